"""A config.json the converters and exports cannot use ends the command with one `error:` line naming the file and
what is off in it, exit status 2, nothing written: a key misspelled (which transformers would keep as an attribute
while the field it meant took transformers' default), a config transformers refuses, and a file that is not JSON."""

import json

import pytest
from glm_sources import tiny_glm_source
from qwen_sources import save_source, tiny_qwen4_source, tiny_source_model

from hybrid_indexpool.scripts import (
    convert_glm5_next,
    convert_qwen3_next,
    convert_qwen4_exp,
    export_glm5_next,
    export_qwen4_exp,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SOURCES = {
    "qwen4_exp": (tiny_qwen4_source, convert_qwen4_exp),
    "glm5_next": (tiny_glm_source, convert_glm5_next),
    "qwen3_next": (lambda: tiny_source_model("qwen3_next"), convert_qwen3_next),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Each family's tiny source checkpoint, saved once."""
    root = tmp_path_factory.mktemp("sources")
    return {family: save_source(build(), root / family) for family, (build, _) in SOURCES.items()}


def copy_with_config(folder, target, edit):
    """A copy of checkpoint `folder` at `target` whose config.json is `edit(config)` (a dict, dumped as JSON) or, when
    `edit` gives a string, that text."""
    target.mkdir()
    for path in folder.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    edited = edit(json.loads((folder / "config.json").read_text()))
    (target / "config.json").write_text(edited if isinstance(edited, str) else json.dumps(edited))
    return target


def rename_key(config, old, new):
    """`config` with key `old` (of its `text_config` when it has one) renamed to `new`."""
    settings = config.get("text_config", config)
    settings[new] = settings.pop(old)
    return config


def run_refused(command, source, output, capsys) -> str:
    with pytest.raises(SystemExit) as stop:
        command.main(["--source", str(source), "--output", str(output), "--no_progress"])
    printed = capsys.readouterr().err
    assert stop.value.code == 2 and printed.startswith("error: ") and printed.count("\n") == 1, printed
    assert not output.exists()
    return printed


@pytest.mark.parametrize("family", list(SOURCES))
def test_a_misspelled_key_names_the_file_and_the_field_it_resembles(tmp_path, sources, capsys, family):
    source = copy_with_config(sources[family], tmp_path / "source",
                              lambda config: rename_key(config, "num_hidden_layers", "num_hidden_layer"))
    printed = run_refused(SOURCES[family][1], source, tmp_path / "out", capsys)
    where = "text_config." if family == "glm5_next" else ""
    assert f"error: {source / 'config.json'}: `{where}num_hidden_layer` (did you mean `num_hidden_layers`?)" in printed
    assert "(40)" not in printed  # transformers' default for the field never shows as if the user had written it


def test_a_config_transformers_refuses_names_the_file_and_the_reason(tmp_path, sources, capsys):
    def five_layers(config):
        config["num_hidden_layers"] = len(config["layer_types"]) + 1
        return config

    source = copy_with_config(sources["qwen4_exp"], tmp_path / "source", five_layers)
    printed = run_refused(convert_qwen4_exp, source, tmp_path / "out", capsys)
    assert printed.startswith(f"error: {source / 'config.json'} is not a valid qwen4_exp_text config: transformers "
                              "refuses it (ValueError: `num_hidden_layers` (5) must be equal to the number of "
                              "`layer_types` (4))")


@pytest.mark.parametrize("family", list(SOURCES))
def test_a_config_that_is_not_json_names_the_file_and_where_it_breaks(tmp_path, sources, capsys, family):
    source = copy_with_config(sources[family], tmp_path / "source", lambda config: '{"model_type": "x",\n  }')
    printed = run_refused(SOURCES[family][1], source, tmp_path / "out", capsys)
    assert printed == (f"error: {source / 'config.json'} is not valid JSON: Expecting property name enclosed in "
                       "double quotes at line 2, column 3; fix the file (or re-download it).\n")


@pytest.mark.parametrize("family, convert, export", [("qwen4_exp", convert_qwen4_exp, export_qwen4_exp),
                                                     ("glm5_next", convert_glm5_next, export_glm5_next)])
def test_the_export_names_a_config_that_is_not_json(tmp_path, sources, capsys, family, convert, export):
    convert.main(["--source", str(sources[family]), "--output", str(tmp_path / "ours"), "--no_progress"])
    (tmp_path / "ours" / "config.json").write_text('{"model_type": "hybrid_indexpool"')
    printed = run_refused(export, tmp_path / "ours", tmp_path / "back", capsys)
    assert printed.startswith(f"error: {tmp_path / 'ours' / 'config.json'} is not valid JSON: Expecting ',' "
                              "delimiter at line 1")
