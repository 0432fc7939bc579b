"""What the exports refuse, and how they say it: LoRA adapters not merged (a real PEFT adapter folder, and a model saved
with its LoRA layers in place), settings the target format cannot express (each named), wrong input folders; and
what they only warn about: tokenizer or processor files missing."""

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from checkpoint_files import saved_tensors
from glm_sources import save_glm_source, tiny_glm_source
from qwen_sources import save_qwen4_source, tiny_qwen4_source
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from hybrid_indexpool.conversion import (
    ConversionError,
    ExportWarning,
    convert_glm5_next,
    convert_qwen4_exp,
    export_glm5_next,
    export_qwen4_exp,
)
from hybrid_indexpool.scripts import export_qwen4_exp as export_qwen4_exp_script

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
QUIET = dict(progress=False, log=lambda message: None)
# family -> (export, the Auto class of its converted checkpoint, an adapted layer's weight under both formats' name)
FAMILIES = {
    "qwen4_exp": (export_qwen4_exp, AutoModelForCausalLM, "model.layers.3.self_attn.o_proj.weight"),
    "glm5_next": (export_glm5_next, AutoModelForImageTextToText,
                  "model.language_model.layers.1.self_attn.o_proj.weight"),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """`{family: (source folder, our converted folder)}`: a tiny text Qwen4-Exp and a tiny GLM-5.3-Flash (multimodal,
    as every GLM conversion), both with their MTP layers."""
    folder = tmp_path_factory.mktemp("export-refusals")
    save_qwen4_source(tiny_qwen4_source(), folder / "qwen4-source")
    convert_qwen4_exp(folder / "qwen4-source", folder / "qwen4-ours", **QUIET)
    save_glm_source(tiny_glm_source(), folder / "glm-source")
    convert_glm5_next(folder / "glm-source", folder / "glm-ours", **QUIET)
    return {"qwen4_exp": (folder / "qwen4-source", folder / "qwen4-ours"),
            "glm5_next": (folder / "glm-source", folder / "glm-ours")}


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_is_refused_with_the_merge_for_the_right_class_until_merged(converted, tmp_path, family):
    from peft import LoraConfig

    from hybrid_indexpool.training import add_lora_adapters

    export, auto_class, adapted = FAMILIES[family]
    source, ours = converted[family]
    model = add_lora_adapters(auto_class.from_pretrained(ours), LoraConfig(r=2, target_modules=["o_proj"]))
    with torch.no_grad():  # trained adapters: B starts at zero, which would merge to nothing
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1)

    model.save_pretrained(tmp_path / "adapters")  # the adapters alone, as `finetune --merge_lora False` saves them
    with pytest.raises(ConversionError) as refusal:
        export(tmp_path / "adapters", tmp_path / "out", **QUIET)
    message = str(refusal.value)
    assert "holds LoRA adapters, not a model" in message and ".merge_and_unload()" in message
    # The base is at hand, so the one class that loads it is named, with the base's folder.
    assert f"{auto_class.__name__}.from_pretrained('{ours}'" in message
    assert "AutoModelFor" + ("CausalLM" if auto_class is AutoModelForImageTextToText else "ImageTextToText") \
        not in message

    model.base_model.model.save_pretrained(tmp_path / "unmerged")  # the model with its LoRA layers in place
    with pytest.raises(ConversionError) as refusal:
        export(tmp_path / "unmerged", tmp_path / "out", **QUIET)
    message = str(refusal.value)
    assert "saved with its LoRA layers in place" in message and "lora_A" in message
    assert f"PeftModel.from_pretrained({auto_class.__name__}.from_pretrained(" in message
    assert "lacks weight" not in message
    assert not (tmp_path / "out").exists()

    merged = model.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    export(tmp_path / "merged", tmp_path / "out", **QUIET)
    exported = saved_tensors(tmp_path / "out")[adapted]
    assert torch.equal(exported, merged.state_dict()[adapted])
    assert not torch.equal(exported, saved_tensors(source)[adapted])


def test_adapters_of_a_base_not_at_hand_name_both_classes(tmp_path):
    (tmp_path / "adapters").mkdir()
    (tmp_path / "adapters" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/model"}))
    with pytest.raises(ConversionError, match=r"AutoModelForCausalLM\.from_pretrained\('org/model'.*"
                                              r"AutoModelForImageTextToText for a multimodal base"):
        export_glm5_next(tmp_path / "adapters", tmp_path / "out", **QUIET)


def with_settings(ours: Path, folder: Path, **settings) -> Path:
    """A copy of our checkpoint `ours` in `folder` whose text config has `settings` changed (the weights as they
    are: every refusal comes before a weight is read)."""
    shutil.copytree(ours, folder)
    config = json.loads((folder / "config.json").read_text())
    (config.get("text_config") or config).update(settings)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("family, settings, named", [
    ("qwen4_exp", dict(index_head_weights=True), r"index_head_weights = True \(Qwen4-Exp: False\)"),
    ("qwen4_exp", dict(mtp_type="deepseek"), r"mtp_type = 'deepseek' \(Qwen4-Exp: 'qwen4_exp'\)"),
    ("qwen4_exp", dict(layer_types=["linear_attention", "indexpool_attention", "linear_attention",
                                    "indexpool_attention"], indexer_types=["full", "full", "full", "shared"]),
     r"indexer_types with 'shared' layers \(Qwen4-Exp: every indexed layer has its indexer\)"),
    ("qwen4_exp", dict(mlp_layer_types=["dense", "sparse", "sparse", "sparse"], intermediate_size=96),
     r"mlp_layer_types mixing dense and MoE layers"),
    ("qwen4_exp", dict(index_pool_weighting="prenorm_mean"),
     r"index_pool_weighting = 'prenorm_mean' \(Qwen4-Exp: mean pooling\)"),
    ("glm5_next", dict(index_head_weights=False), r"index_head_weights = False \(GLM: True\)"),
    ("glm5_next", dict(index_pool_weighting="mean"), r"index_pool_weighting = 'mean' \(GLM: 'learned'\)"),
    ("glm5_next", dict(shared_expert_intermediate_size=48),
     r"shared_expert_intermediate_size = 48 \(GLM: a multiple of moe_intermediate_size, 32\)"),
    ("glm5_next", dict(mtp_type="qwen4_exp", hc_type="qwen4_exp", hc_lowrank=8),
     r"mtp_type = 'qwen4_exp' \(GLM: 'deepseek'"),
], ids=["qwen4-head-weights", "qwen4-mtp-type", "qwen4-shared-indexers", "qwen4-mixed-mlp", "qwen4-pooling",
        "glm-no-head-weights", "glm-mean-pooling", "glm-shared-expert-width", "glm-mtp-type"])
def test_a_setting_the_format_cannot_express_is_refused_by_name(converted, tmp_path, family, settings, named):
    export = FAMILIES[family][0]
    folder = with_settings(converted[family][1], tmp_path / "changed", **settings)
    with pytest.raises(ConversionError, match=f"format cannot express .*{named}"):
        export(folder, tmp_path / "out", **QUIET)
    assert not (tmp_path / "out").exists()


def test_a_config_that_does_not_load_is_refused_with_its_error(converted, tmp_path):
    # A shared indexer on the first IndexPool layer: our config's own check refuses it, and the export says so.
    folder = with_settings(converted["qwen4_exp"][1], tmp_path / "changed", indexer_types=["full"] * 3 + ["shared"])
    with pytest.raises(ConversionError, match=r"config.json of .* is not a valid model config: .*indexer_types\[3\]"):
        export_qwen4_exp(folder, tmp_path / "out", **QUIET)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_wrong_input_path_is_named_for_what_the_export_reads(converted, tmp_path, family):
    export = FAMILIES[family][0]
    ours = converted[family][1]
    with pytest.raises(ConversionError, match=r"Folder to export .*nowhere does not exist; pass the folder of one of "
                                              r"our checkpoints \(a converter's output"):
        export(tmp_path / "nowhere", tmp_path / "out", **QUIET)
    weights = next(ours.glob("*.safetensors"))
    with pytest.raises(ConversionError, match=rf"Folder to export .*{weights.name} is a file, not a folder; .*"
                                              rf"\(this file's folder is {re.escape(str(ours))}\)"):
        export(weights, tmp_path / "out", **QUIET)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match="Folder to export .*empty has no config.json; .*one of our checkpoints"):
        export(tmp_path / "empty", tmp_path / "out", **QUIET)
    assert not (tmp_path / "out").exists()


def test_a_converter_given_a_file_says_so_in_its_own_words(converted, tmp_path):
    config = converted["qwen4_exp"][0] / "config.json"
    with pytest.raises(ConversionError, match="Source folder .*config.json is a file, not a folder; pass the folder "
                                              "of a downloaded checkpoint"):
        convert_qwen4_exp(config, tmp_path / "out", **QUIET)


@pytest.mark.parametrize("family", FAMILIES)
def test_missing_tokenizer_and_processor_files_are_warned_about_not_refused(converted, tmp_path, family):
    export = FAMILIES[family][0]
    folder = tmp_path / "ours"
    shutil.copytree(converted[family][1], folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        (folder / name).unlink(missing_ok=True)
    with pytest.warns(ExportWarning) as caught:
        export(folder, tmp_path / "out", **QUIET)
    messages = [str(warning.message) for warning in caught if warning.category is ExportWarning]
    assert any("has no tokenizer files (tokenizer_config.json" in message for message in messages)
    # GLM's format is multimodal: its processor is missing too (the tiny source had none to copy).
    assert any("has no processor files (preprocessor_config.json" in message for message in messages) \
        == (family == "glm5_next")
    assert (tmp_path / "out" / "config.json").is_file()


def test_the_export_command_prints_the_warning_plainly(converted, tmp_path, capsys):
    folder = tmp_path / "ours"
    shutil.copytree(converted["qwen4_exp"][1], folder)
    (folder / "tokenizer.json").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("default", ExportWarning)
        export_qwen4_exp_script.main(["--source", str(folder), "--output", str(tmp_path / "out"), "--no_progress"])
    assert f"warning: {folder} has no tokenizer files" in capsys.readouterr().err


@pytest.mark.parametrize("family", FAMILIES)
def test_a_conversion_of_the_other_family_is_refused_with_its_own_export_named(converted, tmp_path, family):
    other = next(name for name in FAMILIES if name != family)
    export = FAMILIES[family][0]
    source_family, script = {"qwen4_exp": ("Qwen4-Exp", "export_qwen4_exp"),
                             "glm5_next": ("GLM-5.3-Flash", "export_glm5_next")}[other]
    with pytest.raises(ConversionError, match=rf"was converted from {source_family}, not .*; export it with {script} "
                                              rf"\(python -m hybrid_indexpool.scripts.{script}\)"):
        export(converted[other][1], tmp_path / "out", **QUIET)
    assert not (tmp_path / "out").exists()


def test_the_export_command_refuses_a_bad_shard_size_in_one_line(converted, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        export_qwen4_exp_script.main(["--source", str(converted["qwen4_exp"][1]), "--output", str(tmp_path / "out"),
                                      "--max_shard_size", "0", "--no_progress"])
    printed = capsys.readouterr().err
    assert stop.value.code == 2 and printed == ("error: max_shard_size '0' (--max_shard_size) is not a positive size; "
                                                "give a number of bytes or a size with a unit, such as 5GB or 500MB.\n")
    assert list(tmp_path.iterdir()) == []
