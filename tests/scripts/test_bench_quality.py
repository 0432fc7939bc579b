import json

import pytest

from hybrid_indexpool.scripts import bench_quality

pytestmark = pytest.mark.filterwarnings("ignore")

TINY = ["--context", "128", "--budget", "16", "--hidden-size", "32", "--layers", "2", "--batch-size", "2",
        "--train-steps", "4", "--warmup-steps", "3", "--eval-blocks", "2", "--passkey-samples", "4"]


def test_tiny_run_writes_all_four_rows_as_json_and_a_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (in the dev extra)")
    report = bench_quality.main(TINY + ["--json", str(tmp_path / "quality.json"), "--plot", str(tmp_path / "q.png")])
    printed = capsys.readouterr().out
    assert "machine:" in printed and "| learned pooling r=4 |" in printed and "context 128, budget 16" in printed
    written = json.loads((tmp_path / "quality.json").read_text())
    assert written["results"] == report["results"]
    rows = {row["setting"]: row for row in written["results"]}
    assert list(rows) == list(bench_quality.SETTINGS)
    assert (rows["learned_r4"]["pool_size"], rows["mean_r4"]["weighting"], rows["unpooled_r1"]["pool_size"]) == \
        (4, "mean", 1)
    assert rows["dense"]["attention_mass"] == 1.0 and rows["dense"]["ppl_vs_dense"] == 0.0
    for setting in ("learned_r4", "mean_r4", "unpooled_r1"):
        row = rows[setting]
        assert 0.0 < row["attention_mass"] < 1.0 and row["ppl"] > 1.0 and 0.0 <= row["passkey_accuracy"] <= 1.0
        assert len(written["warmup_kl"][setting]) == 3 and row["warmup_kl_first"] > 0
    assert (tmp_path / "q.png").stat().st_size > 0


def test_passkey_samples_have_the_context_length_and_end_with_the_key():
    import random

    text = "line of code\n" * 100
    sample, depth = bench_quality.passkey_sample(text, 200, random.Random(0))
    key = sample[-bench_quality.PASSKEY_DIGITS:]
    assert len(sample) == 200 and key.isdigit() and sample.count(f"# passkey: {key}") == 2 and 0 <= depth <= 1


@pytest.mark.parametrize("extra, message", [
    (["--budget", "18"], "multiple of 4"),
    (["--context", "24"], "at least twice --budget"),
    (["--passkey-fraction", "1.5"], "between 0 and 1"),
])
def test_bad_sizes_are_refused(extra, message, capsys):
    with pytest.raises(SystemExit):
        bench_quality.parse_arguments(TINY + extra)
    assert message in capsys.readouterr().err
