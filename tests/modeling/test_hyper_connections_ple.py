"""Hyper-connections (`hc_count > 1`) and per-layer n-gram embeddings (`ple_layers`), on their own and against the
Qwen4-Exp modules they reproduce."""

import pytest
import torch
from model_factory import randomize_parameters, tiny_config, tiny_model
from transformers import Qwen4ExpTextConfig
from transformers.models.qwen4_exp import modeling_qwen4_exp as qwen4

from hybrid_indexpool import HybridIndexPoolForCausalLM
from hybrid_indexpool.modeling.per_layer_embedding import HybridIndexPoolNGramEmbedding
from hybrid_indexpool.modeling.residual_streams import HybridIndexPoolHyperConnection

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

HC_PLE = dict(hc_count=3, hc_lowrank=8, ple_layers=[0, 2], ple_ngram_size=3, ple_heads_per_ngram=2,
              ple_ngram_vocab_size_base=40, ple_vocab_size_multiple=8, eos_token_id=1, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def hc_ple_model(seed: int = 0, **overrides) -> HybridIndexPoolForCausalLM:
    """A tiny model with every Qwen4-Exp feature on and its zero-initialised parts (norms, PLE convolution) random."""
    model = tiny_model(seed, **{**HC_PLE, **overrides})
    randomize_parameters(model, lambda name: "norm" in name or "ple.conv1d" in name, seed + 1, 0.3)
    return model


def qwen4_text_config(**overrides) -> Qwen4ExpTextConfig:
    settings = dict(vocab_size=97, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, hc_count=3, hc_lowrank=8, ple_layer_ids=[1], ngram_size=3, heads_per_ngram=2,
                    ngram_vocab_size_base=40, make_ngram_vocab_size_divisible_by=8, eos_token_id=1,
                    num_experts=4, num_experts_per_tok=2)
    settings.update(overrides)
    return Qwen4ExpTextConfig(**settings)


def test_hyper_connection_equals_qwen4_gated_residual():
    torch.manual_seed(0)
    config = tiny_config(hc_count=3, hc_lowrank=8)
    ours, theirs = HybridIndexPoolHyperConnection(config), qwen4.Qwen4ExpTextGatedResidual(qwen4_text_config())
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.3)
    ours.load_state_dict(theirs.state_dict())
    streams, block_output = torch.randn(2, 5, 3 * 64), torch.randn(2, 5, 64)
    block_input, write_gates = ours(streams)
    expected_input, _, expected_gates = theirs(streams)
    assert torch.equal(block_input, expected_input) and torch.equal(write_gates, expected_gates)
    expected = streams + (block_output.unsqueeze(-2) * expected_gates.unsqueeze(-1)).flatten(-2)
    assert torch.equal(ours.inject(streams, block_output, write_gates), expected)


@pytest.mark.parametrize("ple_index", [0, 3])
def test_ngram_hashing_equals_qwen4(ple_index):
    config = tiny_config(**HC_PLE)
    ours = HybridIndexPoolNGramEmbedding(config, ple_index)
    theirs = qwen4.Qwen4ExpTextNGramEmbedding(qwen4_text_config(), 64, layer_idx=0, ple_layer_index=ple_index)
    assert ours.multipliers.tolist() == theirs.layer_multipliers.tolist()
    assert ours.head_table_sizes.tolist() == theirs.ngram_heads_vocab_sizes.tolist()
    assert ours.head_table_offsets.tolist() == theirs.ngram_heads_offsets.tolist()
    assert ours.ngram_embedding.weight.shape == theirs.ngram_embedding.weight.shape
    ours.ngram_embedding.weight.data.copy_(theirs.ngram_embedding.weight)
    token_ids = torch.randint(2, 97, (2, 30))
    token_ids[0, 9] = token_ids[1, 3] = 1  # end-of-sequence inside: n-grams restart after it
    embeddings, context = ours(token_ids, None)
    assert torch.equal(embeddings, theirs(token_ids, cache=None))
    # Continuing from the returned context equals one pass.
    first, context = ours(token_ids[:, :13], None)
    second, _ = ours(token_ids[:, 13:], context)
    assert torch.equal(torch.cat([first, second], dim=1), embeddings)


def test_decode_and_chunked_prefill_equal_one_pass():
    model = hc_ple_model()
    input_ids = torch.randint(2, 97, (2, 37))
    input_ids[0, 11] = 1
    with torch.no_grad():
        full = model(input_ids).logits
        output = model(input_ids[:, :20], use_cache=True)
        pieces = [output.logits]
        for start in range(20, 37, 6):  # multi-token and one-token steps from the cache
            for step in ((start, start + 5), (start + 5, start + 6)):
                if step[0] < 37:
                    output = model(input_ids[:, step[0]:min(step[1], 37)], cache=output.cache, use_cache=True)
                    pieces.append(output.logits)
        torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-4, rtol=1e-4)
        model.config.prefill_chunk_length = 7
        chunked = model(input_ids, use_cache=True)
    torch.testing.assert_close(chunked.logits, full, atol=1e-4, rtol=1e-4)
    assert chunked.cache.memory_footprint()["ple_state"] > 0


def test_left_padded_row_equals_the_row_alone():
    model = hc_ple_model()
    alone = torch.randint(2, 97, (1, 25))
    padded = torch.cat([torch.zeros(1, 6, dtype=torch.long), alone], dim=1)
    batch = torch.cat([padded, torch.randint(2, 97, (1, 31))])
    mask = torch.ones_like(batch)
    mask[0, :6] = 0
    with torch.no_grad():
        expected = model(alone).logits
        logits = model(batch, attention_mask=mask).logits
    torch.testing.assert_close(logits[0, 6:], expected[0], atol=1e-4, rtol=1e-4)
    generated = model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False)
    generated_alone = model.generate(alone, max_new_tokens=8, do_sample=False)
    assert torch.equal(generated[0, -8:], generated_alone[0, -8:])


def test_save_and_load_restore_hash_buffers_and_logits(tmp_path):
    model = hc_ple_model()
    model.save_pretrained(tmp_path)
    loaded = HybridIndexPoolForCausalLM.from_pretrained(tmp_path).eval()
    input_ids = torch.randint(2, 97, (1, 30))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids).logits, model(input_ids).logits)
    for ours, theirs in zip(model.modules(), loaded.modules()):
        if isinstance(ours, HybridIndexPoolNGramEmbedding):
            assert torch.equal(ours.multipliers, theirs.multipliers)


def test_inputs_embeds_need_ple_ids():
    model = hc_ple_model()
    input_ids = torch.randint(2, 97, (1, 9))
    embeds = model.get_input_embeddings()(input_ids)
    with pytest.raises(ValueError, match="ple_input_ids"):
        model(inputs_embeds=embeds)
    with torch.no_grad():
        torch.testing.assert_close(model(inputs_embeds=embeds, ple_input_ids=input_ids).logits,
                                   model(input_ids).logits)


def test_multimodal_text_positions():
    model = hc_ple_model()
    input_ids = torch.randint(2, 97, (2, 12))
    positions = torch.arange(12).expand(2, -1)
    with torch.no_grad():
        expected = model(input_ids, position_ids=positions).logits
        streams = positions[None].expand(3, -1, -1)
        torch.testing.assert_close(model(input_ids, position_ids=streams).logits, expected)
        image_like = streams.clone()
        image_like[1, :, 4] += 1
        with pytest.raises(ValueError, match="position streams"):
            model(input_ids, position_ids=image_like)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(ple_layers=[3]), "not Gated DeltaNet layers"),
        (dict(ple_layers=[7]), "zero-based"),
        (dict(ple_embed_dim=66), "multiple of the n-gram heads"),
        (dict(eos_token_id=None), "need `eos_token_id`"),
        (dict(hc_lowrank=0), "hc_lowrank"),
        (dict(linear_output_gate_act="relu"), "linear_output_gate_act"),
    ],
)
def test_invalid_settings(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**{**HC_PLE, **overrides})
