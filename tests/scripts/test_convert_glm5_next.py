"""The GLM-5.3-Flash converter's command line: a text-only conversion with its summary printed, a refusal's exit."""

import json

import pytest
from glm_sources import VARIANTS, tiny_glm_source
from qwen_sources import save_source

from hybrid_indexpool.scripts import convert_glm5_next

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_command_line(tmp_path, capsys):
    folder = save_source(tiny_glm_source(VARIANTS[1]), tmp_path / "source", max_shard_size="60KB")
    report = convert_glm5_next.main(["--source", str(folder), "--output", str(tmp_path / "cli"), "--text_only",
                                     "--max_shard_size", "100KB", "--no_progress"])
    assert report.num_output_shards > 1 and "largest source shard" in capsys.readouterr().out
    assert "AutoModelForCausalLM" in json.loads((tmp_path / "cli" / "config.json").read_text())["auto_map"]
    with pytest.raises(SystemExit):
        convert_glm5_next.main(["--source", str(folder), "--output", str(tmp_path / "cli")])
    assert "already exists" in capsys.readouterr().err
