"""The export commands: a round trip on the command line with the summary printed, and refusals ending with an
`error:` line and exit status 2."""

import pytest
from checkpoint_files import saved_tensors
from glm_sources import tiny_glm_source
from qwen_sources import save_source, tiny_qwen4_source

from hybrid_indexpool.scripts import convert_glm5_next, convert_qwen4_exp, export_glm5_next, export_qwen4_exp

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
