"""The export commands: a round trip on the command line with the summary printed, and refusals ending with an
`error:` line and exit status 2."""

import warnings

import pytest
import torch
from checkpoint_files import saved_tensors
from glm_sources import tiny_glm_source
from qwen_sources import save_source, tiny_qwen4_source

from hybrid_indexpool.scripts import (
    convert_glm5_next,
    convert_qwen4_exp,
    export_glm5_next,
    export_qwen4_exp,
    make_tiny_source,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.parametrize("family", ["qwen4_exp", "glm5_next"])
def test_convert_then_export_on_the_command_line(tmp_path, capsys, family):
    source, convert, export = ((tiny_qwen4_source(), convert_qwen4_exp, export_qwen4_exp) if family == "qwen4_exp"
                               else (tiny_glm_source(), convert_glm5_next, export_glm5_next))
    save_source(source, tmp_path / "source")
    convert.main(["--source", str(tmp_path / "source"), "--output", str(tmp_path / "ours"), "--no_progress"])
    report = export.main(["--source", str(tmp_path / "ours"), "--output", str(tmp_path / "back"), "--no_progress"])
    assert report.num_tensors == len(saved_tensors(tmp_path / "source"))
    assert f"to {tmp_path / 'back'}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:  # the output exists now
        export.main(["--source", str(tmp_path / "ours"), "--output", str(tmp_path / "back"), "--no_progress"])
    assert stop.value.code == 2 and "error: Output folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # a source checkpoint is not one of ours
        export.main(["--source", str(tmp_path / "source"), "--output", str(tmp_path / "other"), "--no_progress"])
    assert stop.value.code == 2 and "the export reads HybridIndexPool checkpoints" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["qwen4_exp", "glm5_next"])
def test_the_readmes_round_trip_prints_no_warning_that_is_not_true(tmp_path, capsys, family):
    """The README's commands on the tiny sources: the export gives back the source's tensors bit for bit, so it
    reports nothing as freshly initialised (Qwen4-Exp's n-gram hashing tables are computed from the config), and the
    GLM source ships its processor settings as the release does, so nothing is missing to warn about."""
    convert, export = ((convert_qwen4_exp, export_qwen4_exp) if family == "qwen4_exp"
                       else (convert_glm5_next, export_glm5_next))
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # any warning would be printed as a `warning:` line
        make_tiny_source.main(["--family", family, str(tmp_path / "source")])
        convert.main(["--source", str(tmp_path / "source"), "--output", str(tmp_path / "ours"), "--no_progress"])
        capsys.readouterr()
        export.main(["--source", str(tmp_path / "ours"), "--output", str(tmp_path / "back"), "--no_progress"])
    printed = capsys.readouterr()
    assert "freshly initialised" not in printed.out and "warning" not in printed.err, printed
    source, back = saved_tensors(tmp_path / "source"), saved_tensors(tmp_path / "back")
    assert source.keys() == back.keys() and all(torch.equal(source[name], back[name]) for name in source)
