import pytest

from hybrid_indexpool.kernels.sparse_attention import sparse_attention_triton
from hybrid_indexpool.scripts import check_gpu


@pytest.mark.skipif(sparse_attention_triton is None, reason="Triton is not installed")
def test_smoke_run_checks_the_kernels_and_prints_every_table(tmp_path, capsys):
    report = check_gpu.main(["--smoke", "--json", str(tmp_path / "report.json")])
    printed = capsys.readouterr().out
    for section in ("1. kernels against the PyTorch reference", "2. decode step", "3. prefill",
                    "4. bytes and launches of one decode step", "5. registers / shared memory"):
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
                       "sparse_attention_forward", "combine_splits"}
    assert all(row.spills == 0 and row.shared <= row.shared_limit for row in report["aot"])
    assert (tmp_path / "report.json").exists()
