"""The Qwen3-Next / Qwen3.5 converter's command line: every indexer option reaches the config, a refusal's exit
status, and the help."""

import json

import pytest
from qwen_sources import save_source, tiny_source_model

from hybrid_indexpool.scripts import convert_qwen3_next

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_command_line_converts_a_checkpoint(tmp_path, capsys):
    save_source(tiny_source_model("qwen3_5_moe_text"), tmp_path / "source")
    report = convert_qwen3_next.main([
        "--source", str(tmp_path / "source"), "--output", str(tmp_path / "ours"), "--index_n_heads", "2",
        "--index_head_dim", "16", "--index_topk", "16", "--index_pool_weighting", "mean", "--index_head_weights",
        "--index_sink_windows", "1", "--index_local_windows", "2", "--max_shard_size", "100KB", "--no_progress",
    ])
    printed = capsys.readouterr().out
    assert f"to {tmp_path / 'ours'}" in printed and "x the largest source shard" in printed
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (config["index_pool_weighting"], config["index_head_weights"], config["index_n_heads"]) == ("mean", True, 2)
    assert (config["index_sink_windows"], config["index_local_windows"]) == (1, 2)
    assert report.num_output_shards > 1
    with pytest.raises(SystemExit) as exit_info:  # the output exists now
        convert_qwen3_next.main(["--source", str(tmp_path / "source"), "--output", str(tmp_path / "ours")])
    assert exit_info.value.code == 2 and "already exists" in capsys.readouterr().err


def test_help_describes_the_options(capsys):
    with pytest.raises(SystemExit):
        convert_qwen3_next.main(["--help"])
    printed = capsys.readouterr().out
    for option in ("--source", "--output", "--overwrite", "--max_shard_size", "--index_topk", "--seed"):
        assert option in printed
