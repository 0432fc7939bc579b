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


@pytest.mark.parametrize("argv, message", [(["--windows", "0"], "positive"), (["--dtypes", "float16"], "float32")])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_indexer.parse_arguments(argv)
    assert message in capsys.readouterr().err
