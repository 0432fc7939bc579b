import pytest

from hybrid_indexpool.kernels.sparse_attention import sparse_attention_triton
from hybrid_indexpool.scripts import check_gpu


@pytest.mark.skipif(sparse_attention_triton is None, reason="Triton is not installed")
def test_smoke_run_checks_the_kernels_and_prints_every_table(tmp_path, capsys):
    report = check_gpu.main(["--smoke", "--json", str(tmp_path / "report.json")])
    printed = capsys.readouterr().out
    for section in ("1. kernels against the PyTorch reference", "2. decode step", "3. prefill",
                    "4. bytes and launches of one decode step", "5. registers / shared memory",
                    "6. the vLLM plugin's batched step"):
        assert section in printed
    assert report["checks"]["torch.float32"]["topk_identical_fraction"] == 1.0
    assert report["checks"]["torch.float32"]["attention_max_error"] < 1e-4
    assert report["checks"]["torch.float32"]["attention_grad_max_error"] < 1e-4
    assert report["checks"]["torch.float32"]["split_decode_max_error"] < 1e-4
    assert [row["context"] for row in report["decode"]] == [128, 256]
    for row in report["decode_traffic"]:  # the kernels move at least the minimum, and not much more
        assert row["minimum_bytes"] <= row["bytes"] < 8 * row["minimum_bytes"]
        assert row["index_triton_launches"] == 1 and row["attention_triton_launches"] >= 1
    kernels = {row.kernel for row in report["aot"]}
    assert kernels == {"pooled_index_scores", "paged_pooled_index_scores", "pooled_key_write",
                       "sparse_attention_forward", "combine_splits", "paged_sparse_attention_forward",
                       "paged_combine_splits"}
    assert all(row.spills == 0 and row.shared <= row.shared_limit for row in report["aot"])
    # Section 6: the vLLM step's Triton path computes what its PyTorch path does (float32: the same selections, the
    # same caches), and its decode benchmark measured every part.
    assert "6. the vLLM plugin's batched step" in printed
    checks = {(row["dtype"], row["fp8_index_keys"]): row for row in report["paged_step_checks"]}
    assert set(checks) == {(dtype, fp8) for dtype in ("torch.float32", "torch.bfloat16") for fp8 in (False, True)}
    for fp8 in (False, True):
        row = checks["torch.float32", fp8]
        assert row["output_max_error"] < 1e-4 and row["selection_identical_fraction"] == 1.0
        assert row["main_cache_equal"] and row["ring_equal"]
    assert checks["torch.float32", False]["pooled_keys_difference"] < 1e-5
    assert checks["torch.float32", True]["pooled_keys_difference"] < 0.01  # share of fp8 keys with a differing byte
    assert [row["context"] for row in report["paged_step_decode"]] == [256, 512]
    assert all(row["step_ms"] > 0 and row["index_bytes"] > 0 and row["attention_bytes"] > 0
               for row in report["paged_step_decode"])
    assert (tmp_path / "report.json").exists()
