"""Qwen3-Next and Qwen3.5 checkpoints converted to ours: equal outputs within the budget, a complete checkpoint,
bounded memory, and configs in the older hub layout."""

import json
import os

import pytest
import torch
from qwen_sources import INDEXER, save_source, save_source_with_mtp, tiny_source_model
from transformers import AutoModelForCausalLM

from hybrid_indexpool import HybridIndexPoolForCausalLM
from hybrid_indexpool.conversion import ConversionError, SourceCheckpoint, convert_qwen3_next

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def left_padded_batch(vocab_size=97, length=12, pad=4):
    input_ids = torch.randint(1, vocab_size, (2, length))
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, :pad], attention_mask[1, :pad] = 0, 0
    return input_ids, attention_mask


def max_logit_difference(source, ours, input_ids, attention_mask=None):
    """Largest absolute logit difference over the real tokens. The source counts positions from the first slot, ours
    from each row's first real token, so the source gets those positions explicitly."""
    position_ids = None
    if attention_mask is not None:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = source(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        actual = ours(input_ids=input_ids, attention_mask=attention_mask).logits
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    return (expected - actual)[real].abs().max().item()


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5"])
def test_converted_model_equals_the_source_within_the_budget(tmp_path, kind):
    source = tiny_source_model(kind)
    save_source(source, tmp_path / "source")
    report = convert_qwen3_next(tmp_path / "source", tmp_path / "ours", INDEXER, progress=False,
                                log=lambda message: None)
    ours = HybridIndexPoolForCausalLM.from_pretrained(tmp_path / "ours").eval()
    remote = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", trust_remote_code=True).eval()
    assert ours.config.layer_types == ["linear_attention", "indexpool_attention"] * 2
    assert report.fresh and all(".self_attn.indexer." in name for name in report.fresh)

    # 19 tokens: every window is selected, so IndexPool attention is the source's dense attention.
    input_ids = torch.randint(1, 97, (1, INDEXER.topk + INDEXER.pool_size - 1))
    single = max_logit_difference(source, ours, input_ids)
    padded = max_logit_difference(source, remote, *left_padded_batch())
    print(f"{kind}: max |logit difference| {single:.2e} (one row of 19 tokens), {padded:.2e} (left-padded batch)")
    assert single <= 1e-4 and padded <= 1e-4

    input_ids, attention_mask = left_padded_batch()
    with torch.no_grad():
        expected = source.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
        actual = ours.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(expected, actual)


def test_converted_folder_is_a_complete_checkpoint_and_the_indexer_starts_fresh(tmp_path):
    save_source(tiny_source_model("qwen3_next"), tmp_path / "source")
    convert_qwen3_next(tmp_path / "source", tmp_path / "ours", INDEXER, seed=3, max_shard_size="60KB", progress=False,
                       log=lambda message: None)
    folder = tmp_path / "ours"
    names = {path.name for path in folder.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "generation_config.json", "README.md", "tokenizer.json",
            "tokenizer_config.json", "configuration_hybrid_indexpool.py", "modeling_hybrid_indexpool.py"} <= names
    assert not any(name.startswith(".") for name in os.listdir(tmp_path)), "temporary folders left behind"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["HybridIndexPoolForCausalLM"] and config["auto_map"]["AutoModelForCausalLM"]
    assert (config["index_topk"], config["index_pool_size"], config["index_pool_weighting"]) == (16, 4, "learned")
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.5 and config["num_experts"] == 4
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((folder / shard).exists() for shard in shards)
    assert "| pool size (`index_pool_size`) | 4 |" in (folder / "README.md").read_text()

    model = HybridIndexPoolForCausalLM.from_pretrained(folder)
    indexer = model.model.layers[1].self_attn.indexer
    assert torch.count_nonzero(indexer.pool_gate_proj.weight) == 0 and torch.count_nonzero(indexer.pool_slot_bias) == 0
    assert 0.01 < indexer.q_proj.weight.std() < 0.03  # initializer_range 0.02
    convert_qwen3_next(tmp_path / "source", tmp_path / "again", INDEXER, seed=3, progress=False,
                       log=lambda message: None)
    again = HybridIndexPoolForCausalLM.from_pretrained(tmp_path / "again").model.layers[1].self_attn.indexer
    assert torch.equal(again.q_proj.weight, indexer.q_proj.weight)  # deterministic for a seed


def test_memory_held_stays_near_the_largest_shard(tmp_path):
    source = tiny_source_model("qwen3_next", hidden_size=128, num_hidden_layers=8, layer_types=None)
    save_source(source, tmp_path / "source", max_shard_size="200KB")
    output_shard = 200 * 1000
    report = convert_qwen3_next(tmp_path / "source", tmp_path / "ours", INDEXER, max_shard_size=output_shard,
                                progress=False, log=lambda message: None)
    total = sum(SourceCheckpoint.open(tmp_path / "source").shard_sizes.values())
    print(report.summary())
    print(f"model {total} bytes, largest shard {report.largest_source_shard_bytes}, held at most "
          f"{report.max_held_bytes}, peak RSS {report.peak_rss_bytes} (from {report.start_rss_bytes})")
    assert report.max_held_bytes <= 3 * report.largest_source_shard_bytes + output_shard
    assert report.max_held_bytes < total / 2


def test_config_in_the_older_hub_layout_converts(tmp_path):
    """Released Qwen3-Next configs predate `rope_parameters` and `layer_types`: top-level `rope_theta`,
    `partial_rotary_factor`, `full_attention_interval`, `torch_dtype`."""
    source = tiny_source_model("qwen3_next", layer_types=None)  # every 4th layer is full attention
    save_source(source, tmp_path / "source")
    path = tmp_path / "source" / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    del config["layer_types"]
    config.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                  rope_scaling=None, full_attention_interval=4, torch_dtype=config.pop("dtype"))
    path.write_text(json.dumps(config))
    convert_qwen3_next(tmp_path / "source", tmp_path / "ours", INDEXER, progress=False, log=lambda message: None)
    ours = HybridIndexPoolForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert ours.config.layer_types == ["linear_attention"] * 3 + ["indexpool_attention"]
    assert ours.config.rotary_dim == 8 and ours.dtype == torch.float32
    assert max_logit_difference(source, ours, torch.randint(1, 97, (1, 19))) <= 1e-4


# Where each source family declares its MTP layers (vLLM reads the same fields).
MTP_COUNT_FIELDS = {"qwen3_next": "num_nextn_predict_layers", "qwen3_5_moe_text": "mtp_num_hidden_layers",
                    "qwen3_5": "mtp_num_hidden_layers"}


@pytest.mark.parametrize("kind", list(MTP_COUNT_FIELDS))
def test_the_mtp_head_is_kept_and_computes_what_the_source_modules_compute(tmp_path, kind):
    """Our next-next-token logits against the source's own modules composed as vLLM's `qwen3_next_mtp` does
    (transformers has no MTP): the normed embedding of the next token (not zeroed at position 0) and the normed final
    hidden state, concatenated, through `fc`, one full-attention decoder layer, the final norm and the head. Within
    the budget the fresh indexer of our MTP layer selects every window, so the attention is the source's."""
    source = tiny_source_model(kind)
    folder, mtp = save_source_with_mtp(source, tmp_path / "source", MTP_COUNT_FIELDS[kind])
    report = convert_qwen3_next(folder, tmp_path / "ours", INDEXER, progress=False, log=lambda message: None)
    assert not [name for names in report.ignored.values() for name in names if name.startswith("mtp.")]
    assert any(name.startswith("model.mtp.layers.0.block.self_attn.indexer.") for name in report.fresh)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", trust_remote_code=True).eval()
    assert (ours.config.num_mtp_layers, ours.config.mtp_type) == (1, "qwen3_next")

    language_model = source.model.language_model if kind == "qwen3_5" else source.model
    captured = {}
    language_model.layers[3].register_forward_pre_hook(
        lambda module, args, kwargs: captured.update(layer=kwargs), with_kwargs=True)
    input_ids = torch.randint(1, 97, (1, INDEXER.topk + INDEXER.pool_size), generator=torch.Generator().manual_seed(0))
    length = input_ids.shape[1] - 1  # 19 MTP entries: within the budget
    with torch.no_grad():
        actual = ours(input_ids, output_mtp_logits=True, use_cache=False).mtp_logits[0][:, :length]
        hidden = language_model(input_ids=input_ids, use_cache=False).last_hidden_state[:, :length]
        cos, sin = captured["layer"]["position_embeddings"]
        mask = captured["layer"]["attention_mask"]
        embedded = mtp["pre_fc_norm_embedding"](language_model.embed_tokens(input_ids[:, 1:]))
        states = mtp["fc"](torch.cat([embedded, mtp["pre_fc_norm_hidden"](hidden)], dim=-1))
        states = mtp["layers.0"](states, position_embeddings=(cos[..., :length, :], sin[..., :length, :]),
                                 attention_mask=None if mask is None else mask[..., :length, :length])
        expected = source.lm_head(mtp["norm"](states))
    difference = (actual - expected).abs().max().item()
    print(f"{kind}: max |MTP logit difference| {difference:.2e}")
    assert difference <= 1e-4
    # Unchanged next-token logits: the MTP head is beside the model, not in it.
    assert max_logit_difference(source, ours, input_ids[:, :19]) <= 1e-4


def test_a_declared_mtp_count_that_the_weights_do_not_hold_is_refused(tmp_path):
    folder, _ = save_source_with_mtp(tiny_source_model("qwen3_next"), tmp_path / "source", "num_nextn_predict_layers")
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 2
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="num_nextn_predict_layers = 2.*1 multi-token-prediction layers"):
        convert_qwen3_next(folder, tmp_path / "ours", INDEXER, progress=False, log=lambda message: None)
