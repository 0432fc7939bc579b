"""scripts/check_gpu.py: the verdict table and the exit status it gives, the pieces `--smoke` runs on a CPU (new
batch through a captured step's tensors, selection work per step, Triton against PyTorch on the paged step), and the
whole `--smoke` run (slow)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid_indexpool.kernels.sparse_attention import sparse_attention_triton
from hybrid_indexpool.scripts import check_gpu

needs_triton = pytest.mark.skipif(sparse_attention_triton is None, reason="Triton is not installed")
CHECKOUT = Path(__file__).resolve().parents[2]


def smoke_arguments(*extra):
    return check_gpu.parse_arguments(["--smoke", *extra])


@pytest.mark.parametrize("on_gpu, statuses, exit_status", [
    (False, ["PASS", "PASS"], 0),
    (False, ["PASS", "SKIP"], 0),  # without a GPU, its sections are skipped, and said so
    (True, ["PASS", "SKIP"], 1),  # on a GPU every check must run
    (True, ["PASS", "FAIL"], 1),
    (False, ["FAIL"], 1),
    (False, [], 1),  # nothing checked is no verdict
])
def test_the_exit_status_follows_the_verdicts(on_gpu, statuses, exit_status):
    table = check_gpu.VerdictTable(on_gpu=on_gpu)
    for index, status in enumerate(statuses):
        if status == "SKIP":
            table.skip(f"check {index}", "no GPU", "target")
        else:
            table.check(f"check {index}", status == "PASS", "measured", "target")
    assert table.exit_status() == exit_status
    last_line = table.format().splitlines()[-1]
    assert last_line.startswith("PASS" if exit_status == 0 else "FAIL")
    assert all(f"check {index}" in table.format() for index in range(len(statuses)))


def test_a_section_that_raises_is_a_failed_check_and_the_run_goes_on(capsys):
    table = check_gpu.VerdictTable(on_gpu=False)
    with table.section("broken section"):
        raise RuntimeError("CUDA error: an illegal memory access")
    table.check("next section", True, "ok", "target")
    assert [(row.check, row.status) for row in table.rows] == [("broken section", "FAIL"), ("next section", "PASS")]
    assert "illegal memory access" in table.rows[0].measured
    assert "Traceback" in capsys.readouterr().err
    assert table.exit_status() == 1


def test_the_command_exits_non_zero_when_a_section_fails(monkeypatch, capsys):
    def broken(*args):
        raise ValueError("no byte count for a new kernel")

    monkeypatch.setattr(check_gpu, "traffic_section", broken)
    report = check_gpu.main(["--offline", "--aot", "none"])
    assert report["exit_status"] == 1
    assert report["verdicts"] == [{"check": "decode traffic table", "status": "FAIL",
                                   "measured": "ValueError: no byte count for a new kernel",
                                   "target": "runs without error"}]
    assert "FAIL: 1 of 1 checks" in capsys.readouterr().out


def test_from_a_checkout_the_command_runs_uninstalled_and_exits_with_its_verdict():
    """From the checkout's root, all at once (each process spends its time importing): the subpackages import with
    the project's own install hidden (`configuration/`, `kernels/`, ... found next to `hybrid_indexpool/`); run as
    a file, nothing judged is a failure (exit 1); --smoke without the interpreter is a usage error (exit 2)."""
    hide_install = "import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in f.__module__]; "
    uninstalled = hide_install + ("import hybrid_indexpool.kernels.launch, hybrid_indexpool.serving.synthetic_step, "
                                  "hybrid_indexpool.configuration as c; print(c.__file__)")
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    commands = {"uninstalled": ["-c", uninstalled], "offline": ["scripts/check_gpu.py", "--offline", "--aot", "none"],
                "smoke": ["-m", "hybrid_indexpool.scripts.check_gpu", "--smoke"]}
    processes = {name: subprocess.Popen([sys.executable, *command], cwd=CHECKOUT, env=environment, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for name, command in commands.items()}
    results = {}
    for name, process in processes.items():
        out, err = process.communicate(timeout=600)
        results[name] = (process.returncode, out, err)
    code, out, err = results["uninstalled"]
    assert code == 0 and out.strip() == str(CHECKOUT / "configuration" / "__init__.py"), err[-2000:]
    code, out, err = results["offline"]
    assert code == 1 and "FAIL: no check ran" in out, err[-2000:]
    code, out, err = results["smoke"]
    assert code == 2 and "TRITON_INTERPRET=1" in err


def test_write_into_copies_every_tensor_and_refuses_other_shapes():
    from hybrid_indexpool.serving.paged_step import SelectionTiles

    captured = {"x": torch.zeros(3), "tiles": (SelectionTiles(torch.zeros(2, 1, dtype=torch.long),
                                                             torch.zeros(2, dtype=torch.long), 64),)}
    new = {"x": torch.arange(3.0), "tiles": (SelectionTiles(torch.ones(2, 1, dtype=torch.long),
                                                           torch.ones(2, dtype=torch.long), 64),)}
    check_gpu.write_into(captured, new)
    assert torch.equal(captured["x"], new["x"]) and torch.equal(captured["tiles"][0].tile_tokens, torch.ones(2, 1))
    with pytest.raises(ValueError, match=r"step\['x'\]: captured \(3,\).*new \(4,\)"):
        check_gpu.write_into(captured, {**new, "x": torch.zeros(4)})
    other_bound = {**new, "tiles": (SelectionTiles(new["tiles"][0].tile_tokens, new["tiles"][0].tile_request, 128),)}
    with pytest.raises(ValueError, match="window_bound: 64 captured, 128 new"):
        check_gpu.write_into(captured, other_bound)


def test_the_new_batch_differs_in_every_slot_and_keeps_the_captured_shapes():
    for args in (smoke_arguments(), check_gpu.parse_arguments([])):
        captured, new = check_gpu.replay_batches(args)
        assert all(a != b for a, b in zip(captured, new)) and max(captured) == max(new)
        blocks = [-(-(context + 1) // args.block_size) for context in captured]
        assert sorted(blocks) == sorted(-(-(context + 1) // args.block_size) for context in new)


@needs_triton
def test_a_new_batch_written_into_the_captured_step_computes_the_eager_step():
    row = check_gpu.check_graph_replay(torch.device("cpu"), smoke_arguments())
    assert row["output_equal"] and row["caches_equal"] and not row["graph"]


def test_the_selection_work_of_item_2_is_bounded_by_the_steps_queries():
    from hybrid_indexpool.serving.paged_step import QUERY_TILE

    for name, (contexts, new_tokens, full_graphs) in check_gpu.STEP_WORK_CASES.items():
        work = check_gpu.step_work(contexts, new_tokens, full_graphs, 1 << 20, check_gpu.GPU_TOPK)
        assert work["visible"] <= work["scores"] <= 2 * work["visible"], (name, work)
        assert work["tokens"] <= work["rows"] <= work["tokens"] + QUERY_TILE * work["prefill_requests"], (name, work)
    # A decode batch a full graph replays keeps the captured bound: every window of the model, far beyond 2x.
    graph = check_gpu.step_work([8192] * 4, [1] * 4, True, 1 << 20, check_gpu.GPU_TOPK)
    assert graph["scores"] == 4 * (1 << 20) // 4 > 2 * graph["visible"]


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("pool", check_gpu.POOLS)
def test_the_paged_steps_triton_path_passes_its_thresholds(pool):
    rows = check_gpu.check_paged_step(torch.device("cpu"), smoke_arguments(), pool)
    assert {(row["dtype"], row["fp8_index_keys"]) for row in rows} == {
        (dtype, fp8) for dtype in (torch.float32, torch.bfloat16) for fp8 in (False, True)}
    for row in rows:
        dtype = row["dtype"]
        assert row["main_cache_equal"] and row["ring_equal"], row
        assert row["output_error"] <= check_gpu.KERNEL_ERROR[dtype], row
        assert row["selection_identical_fraction"] >= check_gpu.SELECTIONS_IDENTICAL[dtype], row
        limits = check_gpu.FP8_KEYS_DIFFERING if row["fp8_index_keys"] else check_gpu.KERNEL_ERROR
        assert row["pooled_keys_difference"] <= limits[dtype], row


@needs_triton
@pytest.mark.slow
def test_smoke_run_passes_prints_every_table_and_the_verdict(tmp_path, capsys):
    report = check_gpu.main(["--smoke", "--json", str(tmp_path / "report.json")])
    printed = capsys.readouterr().out
    for section in ("1. kernels against the PyTorch reference", "2. decode step", "3. prefill",
                    "4. bytes and launches of one decode step", "5. registers / shared memory",
                    "6. the vLLM plugin's batched step", "verdict (smoke"):
        assert section in printed
    assert report["exit_status"] == 0, printed[-4000:]
    statuses = {row["check"]: row["status"] for row in report["verdicts"]}
    # Everything a CPU can judge passed; what needs a GPU is an explicit SKIP, never a PASS.
    for pool in check_gpu.POOLS:
        assert statuses[f"kernels float32 r={pool}"] == statuses[f"kernels bfloat16 r={pool}"] == "PASS"
        assert statuses[f"paged step float32 r={pool} fp8 keys"] == "PASS"
    assert statuses["AOT compile sm_80/sm_90"] == "PASS"
    assert statuses["new batch replayed = eager step"] == "SKIP"
    assert all(statuses[f"scores: {name}"] == "PASS" for name in check_gpu.STEP_WORK_CASES)
    gpu_only = [check for check in statuses if check.startswith(("decode bandwidth", "r=4 vs r=1", "cache fill"))]
    assert len(gpu_only) == 2 * 2 + 2 + 2 * 2 and all(statuses[check] == "SKIP" for check in gpu_only)
    for row in report["decode_traffic"]:  # the kernels move at least the minimum, and not much more
        assert row["minimum_bytes"] <= row["bytes"] < 8 * row["minimum_bytes"]
    assert [(row["context"], row["batch"], row["pool"]) for row in report["step_decode"]] == [
        (context, batch, pool) for context in (256, 512) for batch in (1, 2) for pool in (4, 1)]
    assert (tmp_path / "report.json").exists()
