"""Kimi Delta Attention layer: equals transformers' GLM-5.3-Flash layer (`Glm5NextTextLinearAttention`) with the same
weights, whole, in chunks, decoding and padded; and a whole HybridIndexPool model with it runs and trains."""

import pytest
import torch
from model_factory import KIMI_DELTA, tiny_config, tiny_model
from transformers import DynamicCache
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention

from hybrid_indexpool import HybridIndexPoolForCausalLM
from hybrid_indexpool.modeling.cache_hybrid_indexpool import HybridIndexPoolCache, LinearAttentionLayerCache
from hybrid_indexpool.modeling.linear_attention_kda import HybridIndexPoolKimiDeltaAttention

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
TOLERANCE = dict(atol=1e-5, rtol=1e-5)


def layer_pair(seed=0, lower_bound=-5.0):
    """Our layer and GLM's, 2 heads x 16, with the same random weights (norm and gate parameters included)."""
    torch.manual_seed(seed)
    config = tiny_config(
        num_hidden_layers=1, layer_types=["linear_attention"], linear_attention_type="kimi_delta",
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_gate_lower_bound=lower_bound, rms_norm_eps=1e-5,
    )
    glm_config = Glm5NextTextConfig(
        hidden_size=config.hidden_size, linear_num_heads=2, linear_head_dim=16, linear_lower_bound=lower_bound,
        linear_conv_kernel_dim=config.linear_conv_kernel_dim, num_hidden_layers=1, layer_types=["linear_attention"],
        rms_norm_eps=config.rms_norm_eps, hidden_act=config.hidden_act,
    )
    glm = Glm5NextTextLinearAttention(glm_config, 0).eval()
    with torch.no_grad():
        for parameter in glm.parameters():
            parameter.copy_(torch.randn_like(parameter) * parameter.shape[-1] ** -0.5)
        glm.forget_gate.A_log.uniform_(-1, 1)
    ours = HybridIndexPoolKimiDeltaAttention(config, 0).eval()
    assert set(ours.state_dict()) == set(glm.state_dict())  # the same names: conversion copies them
    ours.load_state_dict(glm.state_dict())
    return config, ours, glm, glm_config


def all_real(batch, seq):
    return torch.ones(batch, seq, dtype=torch.bool)


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["safe_gate", "softplus_gate"])
def test_whole_prompt_equals_glm(lower_bound):
    config, ours, glm, _ = layer_pair(lower_bound=lower_bound)
    hidden = torch.randn(2, 150, config.hidden_size)  # three chunks of 64, the last partial
    with torch.no_grad():
        torch.testing.assert_close(ours(hidden, all_real(2, 150)), glm(hidden), **TOLERANCE)


def test_chunked_prefill_then_decode_equals_glm_whole_and_glm_cached():
    config, ours, glm, glm_config = layer_pair(1)
    hidden = torch.randn(2, 90, config.hidden_size)
    pieces = [(0, 37), (37, 80)] + [(t, t + 1) for t in range(80, 90)]  # two prefill chunks, then decode
    cache, glm_cache = LinearAttentionLayerCache(), DynamicCache(config=glm_config)
    with torch.no_grad():
        whole = glm(hidden)
        for start, end in pieces:
            step = ours(hidden[:, start:end], all_real(2, end - start), cache)
            torch.testing.assert_close(step, whole[:, start:end], **TOLERANCE)
            torch.testing.assert_close(step, glm(hidden[:, start:end], cache=glm_cache), **TOLERANCE)
    assert cache.recurrent_states[0].dtype == torch.float32 and cache.recurrent_states[0].shape == (2, 2, 16, 16)
    assert cache.conv_states[0].shape == (2, 3 * 32, config.linear_conv_kernel_dim - 1)
    torch.testing.assert_close(cache.recurrent_states[0], glm_cache.get_recurrent_state(0, state_idx=0), **TOLERANCE)


def test_padded_batch_equals_each_row_alone_and_glm_masked():
    config, ours, glm, glm_config = layer_pair(2)
    lengths = [29, 20]
    hidden = torch.randn(2, 29, config.hidden_size)
    # Our model lays each row's real tokens first (padding after); GLM takes left padding and a 2D mask.
    real = torch.arange(29)[None] < torch.tensor(lengths)[:, None]
    left = torch.stack([hidden[0], torch.cat([torch.zeros(9, config.hidden_size), hidden[1, :20]])])
    mask = torch.stack([torch.ones(29), torch.arange(29) >= 9]).long()
    next_token = torch.randn(2, 1, config.hidden_size)
    cache, glm_cache = LinearAttentionLayerCache(), DynamicCache(config=glm_config)
    with torch.no_grad():
        padded = ours(torch.where(real[..., None], hidden, float("nan")), real, cache)  # pads may hold anything
        theirs = glm(left, attention_mask=mask, cache=glm_cache)
        for row, length in enumerate(lengths):
            alone = glm(hidden[row:row + 1, :length])
            torch.testing.assert_close(padded[row:row + 1, :length], alone, **TOLERANCE)
            torch.testing.assert_close(padded[row, :length], theirs[row, 29 - length:], **TOLERANCE)
        # The cache holds each row's state after its last real token: the next token continues every row.
        step = ours(next_token, all_real(2, 1), cache)
        torch.testing.assert_close(step, glm(next_token, cache=glm_cache), **TOLERANCE)
    assert torch.isfinite(padded).all()


def test_bfloat16_keeps_the_decay_parameters_and_state_in_float32():
    config, ours, _, _ = layer_pair(3)
    ours = ours.to(torch.bfloat16)
    for parameter in (ours.forget_gate.A_log, ours.forget_gate.dt_bias):
        parameter.data = parameter.data.float()  # as `_keep_in_fp32_modules_strict` keeps them when loading
    cache = LinearAttentionLayerCache()
    with torch.no_grad():
        output = ours(torch.randn(1, 10, config.hidden_size, dtype=torch.bfloat16), all_real(1, 10), cache)
    assert output.dtype == torch.bfloat16 and torch.isfinite(output).all()
    assert cache.recurrent_states[0].dtype == torch.float32


def test_a_kimi_delta_model_generates_like_its_uncached_forward_and_trains():
    model = tiny_model(**KIMI_DELTA)
    assert type(model.model.layers[0].linear_attn) is HybridIndexPoolKimiDeltaAttention
    prompt = torch.tensor([[5, 9, 2, 33, 7, 1, 8, 60, 4, 3, 11], [0, 0, 0, 12, 15, 40, 2, 9, 9, 13, 70]])
    mask = (prompt != 0).long()
    with torch.no_grad():
        generated = model.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False)
        # Greedy tokens equal re-running the whole sequence without a cache, row by row.
        for row in range(2):
            tokens = generated[row][mask[row].bool().tolist() + [True] * 6]
            logits = model(tokens[None, :-1], use_cache=False).logits
            assert logits[0, -6:].argmax(-1).tolist() == tokens[-6:].tolist()

    model.train()
    loss = model(prompt, attention_mask=mask, labels=prompt).loss
    loss.backward()
    attention = model.model.layers[0].linear_attn
    for parameter in (attention.forget_gate.A_log, attention.forget_gate.dt_bias, attention.conv1d.weight,
                      attention.q_proj.weight, attention.o_norm.weight):
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0


def test_a_kimi_delta_model_prefilled_in_chunks_gives_the_whole_prompts_logits():
    model = tiny_model(**KIMI_DELTA)
    prompt = torch.randint(1, 97, (2, 75))
    mask = torch.ones_like(prompt)
    mask[1, :10] = 0  # left padding
    with torch.no_grad():
        whole = model(prompt, attention_mask=mask, use_cache=False).logits
        model.config.prefill_chunk_length = 16
        chunked = model(prompt, attention_mask=mask, use_cache=True).logits
    torch.testing.assert_close(chunked[mask.bool()], whole[mask.bool()], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["safe_gate", "softplus_gate"])
def test_a_fresh_model_initialises_the_gates_as_glm_and_fla_do(lower_bound):
    torch.manual_seed(0)
    config = tiny_config(**(KIMI_DELTA | dict(linear_gate_lower_bound=lower_bound)))
    attention = HybridIndexPoolForCausalLM(config).model.layers[0].linear_attn
    assert attention.o_norm.weight.eq(1).all()
    if lower_bound is None:
        assert attention.forget_gate.A_log.exp().min() >= 1 and attention.forget_gate.A_log.exp().max() <= 16
    else:
        assert attention.forget_gate.A_log.eq(0).all()
    step = torch.nn.functional.softplus(attention.forget_gate.dt_bias)  # dt_bias is an inverse softplus
    assert step.min() >= 1e-3 - 1e-7 and step.max() <= 1e-1 + 1e-7
    assert attention.forget_gate.dt_bias.dtype == torch.float32


def test_cache_of_a_kimi_delta_model_holds_float32_states_and_refuses_cropping_without_recording():
    model = tiny_model(**KIMI_DELTA)
    cache = HybridIndexPoolCache(model.config)
    with torch.no_grad():
        model(torch.tensor([[5, 9, 2, 33]]), cache=cache, use_cache=True)
    layer = cache.layers[0]
    assert layer.conv_states[0].dtype == torch.float32 and layer.recurrent_states[0].shape == (1, 2, 8, 8)
    with pytest.raises(ValueError, match="activate_past_recording"):
        cache.crop(-1)
