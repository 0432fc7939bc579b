"""Qwen4-Exp checkpoints converted to ours: the same outputs beyond the budget (hyper-connections, PLE, MoE and the
indexer all on), a 4x smaller indexer cache, streamed n-gram tables, and the refusals."""

import json

import pytest
import torch
from qwen_sources import add_shard, save_qwen4_source, save_source, tiny_qwen4_source, tiny_source_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from hybrid_indexpool import HybridIndexPoolForCausalLM
from hybrid_indexpool.conversion import ConversionError, convert_qwen4_exp

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
QUIET = dict(progress=False, log=lambda message: None)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen4")
    source = tiny_qwen4_source()
    save_source(source, folder / "source", max_shard_size="40KB")
    report = convert_qwen4_exp(folder / "source", folder / "ours", max_shard_size="40KB", **QUIET)
    return source, folder, report


def left_padded(length=48, pad=9):
    input_ids = torch.randint(2, 97, (2, length))
    input_ids[0, 20] = 1  # an end-of-sequence inside: the n-gram context restarts after it
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, :pad], attention_mask[1, :pad] = 0, 0
    return input_ids, attention_mask


def test_logits_and_greedy_generation_equal_qwen4_beyond_the_budget(converted):
    source, folder, report = converted
    ours = AutoModelForCausalLM.from_pretrained(folder / "ours", trust_remote_code=True).eval()
    assert ours.config.hc_count == 3 and ours.config.ple_layers == [0, 2] and ours.config.num_experts == 4
    assert ours.config.index_pool_weighting == "learned" and report.fresh  # zero gate and slot bias: the mean
    torch.manual_seed(1)
    input_ids, attention_mask = left_padded()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # Qwen4-Exp takes row positions from the caller
    with torch.no_grad():
        expected = source(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        actual = ours(input_ids, attention_mask=attention_mask).logits
        single = (source(input_ids[:1]).logits - ours(input_ids[:1]).logits).abs().max().item()
    padded = (expected - actual)[attention_mask.bool()].abs().max().item()
    print(f"Qwen4-Exp -> ours: max |logit difference| {single:.2e} (48 tokens, budget 8), {padded:.2e} (left-padded)")
    assert single <= 1e-4 and padded <= 1e-4
    with torch.no_grad():
        expected = source.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False)
        actual = ours.generate(input_ids, attention_mask=attention_mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(expected, actual)


def test_indexer_cache_is_a_quarter_of_qwen4s(converted):
    source, folder, _ = converted
    ours = HybridIndexPoolForCausalLM.from_pretrained(folder / "ours").eval()
    input_ids = torch.randint(2, 97, (1, 64))
    with torch.no_grad():
        source_cache = source(input_ids, use_cache=True).cache
        our_cache = ours(input_ids, use_cache=True).cache
    source_bytes = sum(layer.indexer_keys.numel() * layer.indexer_keys.element_size()
                       for layer in source_cache.layers if getattr(layer, "indexer_keys", None) is not None)
    footprint = our_cache.memory_footprint()
    # 64 tokens are 16 complete windows: the open window (a fixed r - 1 raw keys) is empty.
    assert source_bytes > 0 and footprint["pooled_index_keys"] * 4 == source_bytes


def test_ngram_tables_are_streamed_whole_and_memory_stays_near_a_shard(converted):
    source, folder, report = converted
    index = json.loads((folder / "ours" / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.ple.ple_embedding.ngram_embedding.weight"
    with safe_open(folder / "ours" / index[name], framework="pt") as handle:
        table = handle.get_tensor(name)
    assert torch.equal(table, source.model.layers[0].ple.ple_embedding.ngram_embedding.weight)
    print(report.summary())
    assert report.max_held_bytes <= 3 * report.largest_source_shard_bytes + 40_000


def test_text_only_conversion_of_a_multimodal_checkpoint_converts_its_language_model(tmp_path):
    source = tiny_qwen4_source(multimodal=True)
    save_source(source, tmp_path / "source", max_shard_size="40KB")
    messages = []
    report = convert_qwen4_exp(tmp_path / "source", tmp_path / "ours", text_only=True, progress=False,
                               log=messages.append)
    assert any("vision tower" in message for message in messages)
    assert any(name.startswith("model.visual.") for names in report.ignored.values() for name in names)
    ours = HybridIndexPoolForCausalLM.from_pretrained(tmp_path / "ours").eval()
    input_ids = torch.randint(2, 97, (1, 40))
    with torch.no_grad():
        difference = (source(input_ids=input_ids).logits - ours(input_ids).logits).abs().max().item()
    assert difference <= 1e-4
    with torch.no_grad():
        expected = source.generate(input_ids=input_ids, max_new_tokens=8, do_sample=False)
        actual = ours.generate(input_ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(expected, actual)


def test_refusals(tmp_path, converted):
    _, folder, _ = converted
    with pytest.raises(ConversionError, match="already exists"):
        convert_qwen4_exp(folder / "source", folder / "ours", **QUIET)
    save_source(tiny_source_model("qwen3_next"), tmp_path / "next")
    with pytest.raises(ConversionError, match="convert_qwen3_next"):
        convert_qwen4_exp(tmp_path / "next", tmp_path / "out", **QUIET)

    # A stored hash table that disagrees with the config, and an unknown weight name, each named.
    broken = tmp_path / "broken"
    save_source(tiny_qwen4_source(), broken, max_shard_size="40KB")
    weight_map = json.loads((broken / "model.safetensors.index.json").read_text())["weight_map"]
    buffer = "model.layers.0.ple.ple_embedding.layer_multipliers"
    tensors = load_file(broken / weight_map[buffer])
    tensors[buffer] = tensors[buffer] + 2
    save_file(tensors, broken / weight_map[buffer], metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="layer_multipliers"):
        convert_qwen4_exp(broken, tmp_path / "out", **QUIET)
    tensors["model.layers.0.ple.extra_scale"] = torch.ones(3)
    save_file(tensors, broken / weight_map[buffer], metadata={"format": "pt"})
    with pytest.raises(ConversionError, match="Unknown weight name.*extra_scale"):
        convert_qwen4_exp(broken, tmp_path / "out", **QUIET)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "multimodal"])
def test_the_mtp_head_is_kept_and_computes_what_the_source_modules_compute(multimodal, tmp_path):
    """Our next-next-token logits against Qwen4-Exp's own modules composed as vLLM's Qwen4-Exp MTP does (transformers
    has no MTP): the main model's streams before its final mix, normed together and projected stream by stream, plus
    the projected normed embedding of the next token in every stream; one decoder layer; the MTP's final mix; the
    head."""
    source = tiny_qwen4_source(multimodal=multimodal)
    folder, mtp = save_qwen4_source(source, tmp_path / "source")
    unused = "mtp.hyper_connection_mixer.block_inject_weight"  # stored by some checkpoints, read by nothing
    add_shard(folder, {unused: torch.randn(3, 3 * 64)}, "model-unused.safetensors")
    report = convert_qwen4_exp(folder, tmp_path / "ours", **QUIET)
    assert [name for names in report.ignored.values() for name in names if "mtp." in name] == [unused]
    auto_class = AutoModelForImageTextToText if multimodal else AutoModelForCausalLM
    ours = auto_class.from_pretrained(tmp_path / "ours", trust_remote_code=True).eval()
    text_config = ours.config.get_text_config()
    assert text_config.num_mtp_layers == 1 and text_config.mtp_type == "qwen4_exp"
    language_model = source.model.language_model if multimodal else source.model
    captured = {}
    language_model.hyper_connection_mixer.register_forward_pre_hook(
        lambda module, args: captured.update(streams=args[0]))
    attention_layer = language_model.layers[3]
    attention_layer.register_forward_pre_hook(
        lambda module, args, kwargs: captured.update(layer=kwargs), with_kwargs=True)
    input_ids = torch.randint(2, 97, (1, 41), generator=torch.Generator().manual_seed(0))
    length = input_ids.shape[1] - 1
    with torch.no_grad():
        actual = ours(input_ids, output_mtp_logits=True, use_cache=False).mtp_logits[0][:, :length]
        language_model(input_ids=input_ids, use_cache=False)
        cos, sin = captured["layer"]["position_embeddings"]
        mask = captured["layer"]["attention_mask"]
        embedded = mtp["fc_embedding"](mtp["pre_fc_norm_embedding"](language_model.embed_tokens(input_ids[:, 1:])))
        normed = mtp["pre_fc_norm_hidden"](captured["streams"][:, :length]).unflatten(-1, (3, 64))
        streams = (mtp["fc_hidden"](normed) + embedded.unsqueeze(-2)).flatten(-2)
        streams = mtp["layers.0"](streams, position_embeddings=(cos[..., :length, :], sin[..., :length, :]),
                                  attention_mask=None if mask is None else mask[..., :length, :length])
        expected = source.lm_head(mtp["hyper_connection_mixer"](streams))
    assert (actual - expected).abs().max() <= 1e-4
