"""The Qwen4-Exp converter's command line: a conversion with its summary printed, a refusal's exit."""

import pytest
from qwen_sources import save_source, tiny_qwen4_source

from hybrid_indexpool.scripts import convert_qwen4_exp

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def folder(tmp_path):
    """`tmp_path` with a tiny Qwen4-Exp checkpoint in several shards in `source`."""
    save_source(tiny_qwen4_source(), tmp_path / "source", max_shard_size="40KB")
    return tmp_path


def test_command_line(tmp_path, folder, capsys):
    report = convert_qwen4_exp.main(["--source", str(folder / "source"), "--output", str(tmp_path / "cli"),
                                     "--max_shard_size", "100KB", "--no_progress"])
    assert report.num_output_shards > 1 and "largest source shard" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        convert_qwen4_exp.main(["--source", str(tmp_path / "missing"), "--output", str(tmp_path / "x")])
    assert "does not exist" in capsys.readouterr().err
