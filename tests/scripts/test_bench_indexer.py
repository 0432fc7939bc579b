import pytest

from hybrid_indexpool.kernels.pooled_index_topk import cpu_impl
from hybrid_indexpool.scripts import bench_indexer


@pytest.mark.skipif(cpu_impl.KERNEL.load() is None, reason="the CPU kernel could not be built")
def test_reports_kernel_and_reference_side_by_side(tmp_path):
    report = bench_indexer.main(["--windows", "5000", "--threads", "1", "--dtypes", "float32,bfloat16",
                                 "--index-heads", "2", "--index-head-dim", "16", "--topk-windows", "8",
                                 "--repeats", "2", "--head-weights", "--json", str(tmp_path / "report.json")])
    assert [row["dtype"] for row in report["results"]] == ["float32", "bfloat16"]
    for row in report["results"]:
        assert row["same_selection"] and row["kernel_ms"] > 0 and row["reference_ms"] > 0
        assert row["key_bytes"] == 5000 * 16 * (4 if row["dtype"] == "float32" else 2)
        assert 0 < row["kernel_bandwidth_fraction"] < 100
    assert "| 1 | 5,000 | float32 |" in bench_indexer.format_table(report)
    assert (tmp_path / "report.json").exists()


@pytest.mark.skipif(cpu_impl.KERNEL.load() is None, reason="the CPU kernel could not be built")
def test_packed_fp8_keys_beside_bfloat16_with_their_speed_ratio():
    report = bench_indexer.main(["--windows", "3000", "--threads", "1", "--dtypes", "bfloat16,fp8",
                                 "--index-heads", "4", "--index-head-dim", "16", "--topk-windows", "8",
                                 "--repeats", "2"])
    bf16, fp8 = report["results"]
    assert (bf16["dtype"], fp8["dtype"]) == ("bfloat16", "fp8")
    # Packed: 16 fp8 bytes and a 4-byte scale per key, against 32 bytes of bfloat16.
    assert fp8["key_bytes"] == 3000 * (16 + 4) and bf16["key_bytes"] == 3000 * 16 * 2
    assert fp8["same_selection"] and bf16["same_selection"]
    for path in ("kernel", "reference"):
        assert fp8[f"{path}_bf16_over_fp8"] == pytest.approx(bf16[f"{path}_ms"] / fp8[f"{path}_ms"])
        assert f"{path}_bf16_over_fp8" not in bf16
    table = bench_indexer.format_table(report)
    assert "bf16 / fp8 kernel" in table and f"{fp8['kernel_bf16_over_fp8']:.2f}x" in table


@pytest.mark.parametrize("argv, message", [(["--windows", "0"], "positive"), (["--dtypes", "float16"], "float32"),
                                           (["--dtypes", "fp8", "--index-head-dim", "24"], "power-of-two")])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_indexer.parse_arguments(argv)
    assert message in capsys.readouterr().err
