"""The tiny source checkpoints of the recipe: each family's command writes a checkpoint that transformers' own class
loads and that its converter converts, with a tokenizer whose ids the model covers; an occupied folder is refused."""

import pytest
import torch
from transformers import AutoTokenizer, Glm5NextForConditionalGeneration, Qwen4ExpForCausalLM

from hybrid_indexpool.conversion import convert_glm5_next, convert_qwen4_exp
from hybrid_indexpool.scripts import make_tiny_source

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
FAMILIES = {"qwen4_exp": (Qwen4ExpForCausalLM, convert_qwen4_exp),
            "glm5_next": (Glm5NextForConditionalGeneration, convert_glm5_next)}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_command_writes_a_source_its_converter_reads(tmp_path, family, capsys):
    source_class, convert = FAMILIES[family]
    folder = make_tiny_source.main(["--family", family, str(tmp_path / "source")])
    assert f"wrote a tiny random {family} checkpoint" in capsys.readouterr().out
    source = source_class.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert source.config.get_text_config().vocab_size == len(tokenizer)
    assert len(list(folder.glob("*.safetensors"))) > 1  # sharded, as the released checkpoints are
    report = convert(folder, tmp_path / "ours", progress=False, log=lambda message: None)
    assert report.num_output_shards >= 1 and (tmp_path / "ours" / "tokenizer.json").is_file()
    # The same seed gives the same weights.
    again = make_tiny_source.main(["--family", family, str(tmp_path / "again")])
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(),
                                                 source_class.from_pretrained(again).state_dict().values()))


def test_an_occupied_output_folder_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as stop:
        make_tiny_source.main(["--family", "qwen4_exp", str(tmp_path / "taken")])
    assert stop.value.code == 2 and capsys.readouterr().err == (
        f"error: {tmp_path / 'taken'} already exists and is not an empty folder; choose a new output folder.\n")
    assert [path.name for path in (tmp_path / "taken").iterdir()] == ["notes.txt"]
