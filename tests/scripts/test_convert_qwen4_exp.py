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


@pytest.mark.parametrize("size", ["lots", "0", "-5GB", "1.5GB"])
def test_a_shard_size_that_is_not_a_positive_size_is_one_error_line(folder, capsys, size):
    with pytest.raises(SystemExit) as stop:
        convert_qwen4_exp.main(["--source", str(folder / "source"), "--output", str(folder / "out"),
                                f"--max_shard_size={size}", "--no_progress"])
    printed = capsys.readouterr().err
    assert stop.value.code == 2 and printed.count("\n") == 1 and "Traceback" not in printed
    assert printed.startswith(f"error: max_shard_size {size!r} (--max_shard_size) is not a positive size; give a "
                              "number of bytes or a size with a unit, such as 5GB or 500MB.")
    assert sorted(path.name for path in folder.iterdir()) == ["source"]  # nothing written, no work folder left


def test_a_shard_size_in_bytes_is_read_as_bytes(tmp_path, folder):
    report = convert_qwen4_exp.main(["--source", str(folder / "source"), "--output", str(tmp_path / "bytes"),
                                     "--max_shard_size", "100000", "--no_progress"])
    assert report.num_output_shards > 1
