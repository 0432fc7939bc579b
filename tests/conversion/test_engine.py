"""The streaming conversion library: every refusal with its message, atomic output, the source's layout."""

import json
import os
from dataclasses import replace
from functools import partial

import pytest
import torch
from qwen_sources import INDEXER, save_source, tiny_source_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from hybrid_indexpool import HybridIndexPoolForCausalLM
from hybrid_indexpool.conversion import (
    ConversionError,
    ConversionPlan,
    IgnoreRule,
    SourceCheckpoint,
    convert_checkpoint,
    rename,
)
from hybrid_indexpool.conversion.qwen3_next import build_config, build_plan, convert_qwen3_next, indexer_weights

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
quiet = dict(progress=False, log=lambda message: None)


@pytest.fixture(scope="module")
def source_folder(tmp_path_factory):
    """A Qwen3-Next checkpoint in several shards; tests that damage a source copy it first."""
    return save_source(tiny_source_model("qwen3_next"), tmp_path_factory.mktemp("qwen3_next") / "source")


def copy_source(source_folder, tmp_path):
    folder = tmp_path / "source"
    folder.mkdir()
    for path in source_folder.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    return folder


def library_conversion(folder, output, *, plan_edit=None, **options):
    """The library called directly with the Qwen3-Next plan (optionally edited)."""
    source = SourceCheckpoint.open(folder)
    config = build_config(source, INDEXER)
    plan = build_plan(source, config)
    if plan_edit is not None:
        plan = plan_edit(plan)
    return convert_checkpoint(source, plan, config, output, extra_tensors=partial(indexer_weights, config, 0),
                              **quiet, **options)


def leftovers(parent):
    return sorted(name for name in os.listdir(parent) if name.startswith("."))


def test_source_layout_is_read_from_the_headers_only(source_folder):
    source = SourceCheckpoint.open(source_folder)
    index = json.loads((source_folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(source.weight_names) == sorted(index) and len(source.shards()) > 1
    assert source.model_type == "qwen3_next"
    shard = source.shards()[0]
    tensors = source.load_shard(shard)
    assert sorted(tensors) == sorted(name for name, file in index.items() if file == shard)
    assert source.shard_sizes[shard] == sum(t.numel() * t.element_size() for t in tensors.values())


def test_existing_output_is_refused_and_replaced_only_after_success(source_folder, tmp_path):
    output = tmp_path / "ours"
    output.mkdir()
    (output / "mine.txt").write_text("keep me")
    with pytest.raises(ConversionError, match=r"ours already exists; .*overwrite=True \(--overwrite\)"):
        convert_qwen3_next(source_folder, output, INDEXER, **quiet)

    def broken(plan):
        group = plan.groups[5]
        plan.groups[5] = replace(group, build=lambda tensors: 1 / 0)
        return plan

    with pytest.raises(ZeroDivisionError):
        library_conversion(source_folder, output, overwrite=True, plan_edit=broken)
    assert os.listdir(output) == ["mine.txt"] and (output / "mine.txt").read_text() == "keep me"
    assert leftovers(tmp_path) == []

    convert_qwen3_next(source_folder, output, INDEXER, overwrite=True, **quiet)
    assert not (output / "mine.txt").exists() and (output / "config.json").exists()
    assert leftovers(tmp_path) == []
    with pytest.raises(ConversionError, match="is the source folder"):
        convert_qwen3_next(source_folder, source_folder, INDEXER, overwrite=True, **quiet)


def test_interrupted_conversion_leaves_no_partial_output(source_folder, tmp_path):
    calls = []

    def interrupted(plan):
        def build(original, tensors):
            calls.append(1)
            if len(calls) == 20:  # midway: some output shards are already written
                raise KeyboardInterrupt
            return original(tensors)

        plan.groups = [replace(group, build=partial(build, group.build)) for group in plan.groups]
        return plan

    with pytest.raises(KeyboardInterrupt):
        library_conversion(source_folder, tmp_path / "ours", plan_edit=interrupted, max_shard_size="20KB")
    assert len(calls) == 20 and os.listdir(tmp_path) == []


def test_source_of_another_architecture_is_refused_with_the_right_script(tmp_path):
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    llama.save_pretrained(tmp_path / "llama")
    with pytest.raises(ConversionError, match=r"model_type 'llama' \(architectures \['LlamaForCausalLM'\]\).*"
                                              r"convert_qwen3_next.py converts only model types .*'qwen3_next'"):
        convert_qwen3_next(tmp_path / "llama", tmp_path / "ours", INDEXER, **quiet)

    folder = tmp_path / "qwen4"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen4_exp",
                                                    "architectures": ["Qwen4ExpForCausalLM"]}))
    save_file({"model.norm.weight": torch.zeros(4)}, folder / "model.safetensors")
    with pytest.raises(ConversionError, match=r"'qwen4_exp'.*use scripts/convert_qwen4_exp.py for it"):
        convert_qwen3_next(folder, tmp_path / "ours", INDEXER, **quiet)
    assert sorted(os.listdir(tmp_path)) == ["llama", "qwen4"]


def test_missing_folder_config_weights_or_shard_are_named(source_folder, tmp_path):
    with pytest.raises(ConversionError, match="nowhere does not exist"):
        SourceCheckpoint.open(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match="has no config.json"):
        SourceCheckpoint.open(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ConversionError, match="neither model.safetensors nor model.safetensors.index.json"):
        SourceCheckpoint.open(tmp_path / "empty")

    folder = copy_source(source_folder, tmp_path)
    shard = SourceCheckpoint.open(folder).shards()[2]
    (folder / shard).unlink()
    with pytest.raises(ConversionError, match=f"lacks the shard file\\(s\\) {shard} .*fetch the missing files"):
        convert_qwen3_next(folder, tmp_path / "ours", INDEXER, **quiet)
    assert not (tmp_path / "ours").exists()


def test_unknown_and_missing_weight_names_are_named_before_any_tensor_is_read(source_folder, tmp_path):
    folder = copy_source(source_folder, tmp_path)
    shard = SourceCheckpoint.open(folder).shards()[1]
    tensors = load_file(folder / shard)
    save_file({**tensors, "model.layers.0.linear_attn.extra_proj.weight": torch.zeros(2, 2)}, folder / shard,
              metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"Unknown weight name\(s\) in the source: "
                                              r"model\.layers\.0\.linear_attn\.extra_proj\.weight;"):
        convert_qwen3_next(folder, tmp_path / "ours", INDEXER, **quiet)

    missing = "model.layers.1.self_attn.k_norm.weight"
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"].pop(missing)
    index_path.write_text(json.dumps(index))
    tensors = load_file(folder / shard)
    del tensors[missing]
    save_file(tensors, folder / shard, metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=f"lacks weight\\(s\\) the conversion needs: {missing} "):
        convert_qwen3_next(folder, tmp_path / "ours", INDEXER, **quiet)
    assert not (tmp_path / "ours").exists() and leftovers(tmp_path) == []


def test_index_that_does_not_match_its_shards_is_refused(source_folder, tmp_path):
    folder = copy_source(source_folder, tmp_path)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.norm.weight"
    index["weight_map"][name] = next(file for file in index["weight_map"].values() if file != index["weight_map"][name])
    index_path.write_text(json.dumps(index))
    with pytest.raises(ConversionError, match=f"places weight '{name}' in .*that file does not hold it"):
        SourceCheckpoint.open(folder)


def test_plan_that_does_not_cover_our_model_is_refused_before_writing(source_folder, tmp_path):
    def without_lm_head(plan):
        plan.groups = [group for group in plan.groups if group.targets != ("lm_head.weight",)]
        plan.ignore.append(IgnoreRule(r"lm_head\.", "dropped on purpose"))
        return plan

    with pytest.raises(ConversionError, match=r"missing lm_head\.weight"):
        library_conversion(source_folder, tmp_path / "ours", plan_edit=without_lm_head)
    assert os.listdir(tmp_path) == []

    source = SourceCheckpoint.open(source_folder)
    plan = ConversionPlan([rename("model.norm.weight", "a"), rename("model.norm.weight", "b")])
    with pytest.raises(ConversionError, match="reads source weight 'model.norm.weight' in two groups"):
        plan.check(source.weight_names)


def test_wrong_shapes_are_named_as_they_are_built(source_folder, tmp_path):
    def transposed_embedding(plan):
        plan.groups[0] = replace(plan.groups[0],
                                 build=lambda t: {"model.embed_tokens.weight": next(iter(t.values())).T})
        return plan

    with pytest.raises(ConversionError, match=r"Built model\.embed_tokens\.weight with shape \(64, 97\), but the "
                                              r"target model expects \(97, 64\)"):
        library_conversion(source_folder, tmp_path / "ours", plan_edit=transposed_embedding)
    assert os.listdir(tmp_path) == []


def test_single_file_source_and_tied_embeddings(tmp_path):
    source = tiny_source_model("qwen3_5_text", tie_word_embeddings=True)
    source.save_pretrained(tmp_path / "source")  # one model.safetensors, no lm_head
    assert (tmp_path / "source" / "model.safetensors").exists()
    report = convert_qwen3_next(tmp_path / "source", tmp_path / "ours", INDEXER, **quiet)
    assert report.num_output_shards == 1 and (tmp_path / "ours" / "model.safetensors").exists()
    assert not (tmp_path / "ours" / "model.safetensors.index.json").exists()
    ours = HybridIndexPoolForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert ours.config.tie_word_embeddings and ours.lm_head.weight is ours.model.embed_tokens.weight
    input_ids = torch.randint(1, 97, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids).logits, source(input_ids).logits, atol=1e-4, rtol=0)


def test_sigterm_mid_conversion_removes_the_partial_output(source_folder, tmp_path, monkeypatch):
    import signal

    from hybrid_indexpool.conversion import Terminated

    loaded = []

    def terminated_while_loading(self, shard):
        loaded.append(shard)
        if len(loaded) == 2:  # the work folder holds a partial output by now
            assert any(name.startswith(".ours.converting-") for name in os.listdir(tmp_path))
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, shard)

    original = SourceCheckpoint.load_shard
    monkeypatch.setattr(SourceCheckpoint, "load_shard", terminated_while_loading)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated, match="SIGTERM"):
        library_conversion(source_folder, tmp_path / "ours")
    assert os.listdir(tmp_path) == [] and signal.getsignal(signal.SIGTERM) is before


def test_a_killed_converter_process_leaves_nothing_behind(tmp_path):
    import signal
    import subprocess
    import sys

    source = save_source(tiny_source_model("qwen3_next"), tmp_path / "source")
    # The converter's command line, held still after its first output shard (so that the signal lands mid-conversion
    # whatever the machine's speed): the shard writer announces it on stdout and sleeps.
    held_converter = (
        "import sys, time\n"
        "import hybrid_indexpool.conversion.checkpoint_io as checkpoint_io\n"
        "from hybrid_indexpool.scripts import convert_qwen3_next\n"
        "write = checkpoint_io.save_file\n"
        "def write_then_hold(*args, **kwargs):\n"
        "    write(*args, **kwargs)\n"
        "    print('shard written', flush=True)\n"
        "    time.sleep(120)\n"
        "checkpoint_io.save_file = write_then_hold\n"
        "convert_qwen3_next.main(sys.argv[1:])\n"
    )
    command = [sys.executable, "-c", held_converter, "--source", str(source), "--output", str(tmp_path / "ours"),
               "--no_progress"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "shard written\n", process.stderr.read()[-2000:]
        assert [name for name in os.listdir(tmp_path) if name.startswith(".ours.converting-")]
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "partial output was removed" in stderr
    assert sorted(os.listdir(tmp_path)) == ["source"]


def test_a_truncated_source_shard_is_named(source_folder, tmp_path):
    folder = copy_source(source_folder, tmp_path)
    shard = sorted(folder.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-64])
    with pytest.raises(ConversionError, match=f"Source shard {shard.name} cannot be read .*truncated"):
        library_conversion(folder, tmp_path / "ours")
    assert not (tmp_path / "ours").exists()
