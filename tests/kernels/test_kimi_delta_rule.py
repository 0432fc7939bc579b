import pytest
import torch
from transformers.models.glm5_next import modeling_glm5_next as glm

from hybrid_indexpool.kernels.kimi_delta_rule import chunk_kimi_delta_rule_torch, kimi_delta_rule


def random_inputs(batch, seq, heads, key_dim, value_dim, lowest_decay=-5.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, seq, heads, key_dim, generator=generator)
    key = torch.randn(batch, seq, heads, key_dim, generator=generator)
    value = torch.randn(batch, seq, heads, value_dim, generator=generator)
    log_decay = lowest_decay * torch.rand(batch, seq, heads, key_dim, generator=generator)
    beta = torch.rand(batch, seq, heads, generator=generator)
    state = torch.randn(batch, heads, key_dim, value_dim, generator=generator)
    return query, key, value, log_decay, beta, state


@pytest.mark.parametrize("seq", [1, 17, 64, 150])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(seq, with_state):
    query, key, value, log_decay, beta, state = random_inputs(2, seq, 2, 16, 8)
    state = state if with_state else None
    out_chunk, state_chunk = kimi_delta_rule(query, key, value, log_decay, beta, state, mode="chunk")
    out_step, state_step = kimi_delta_rule(query, key, value, log_decay, beta, state, mode="recurrent")
    torch.testing.assert_close(out_chunk, out_step, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state_chunk, state_step, atol=2e-5, rtol=1e-4)


def test_strong_decays_without_a_lower_bound_stay_finite_and_exact():
    # Up to -40 per step and channel: a 64-token chunk accumulates far beyond float32's exp range.
    query, key, value, log_decay, beta, state = random_inputs(1, 130, 2, 8, 8, lowest_decay=-40.0)
    out_chunk, state_chunk = kimi_delta_rule(query, key, value, log_decay, beta, state, mode="chunk")
    out_step, state_step = kimi_delta_rule(query, key, value, log_decay, beta, state, mode="recurrent")
    assert torch.isfinite(out_chunk).all() and torch.isfinite(state_chunk).all()
    torch.testing.assert_close(out_chunk, out_step, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state_chunk, state_step, atol=2e-5, rtol=1e-4)


def test_splitting_a_sequence_carries_the_state():
    query, key, value, log_decay, beta, _ = random_inputs(1, 100, 2, 8, 8)
    whole, whole_state = kimi_delta_rule(query, key, value, log_decay, beta)
    inputs = (query, key, value, log_decay, beta)
    first, state = kimi_delta_rule(*(x[:, :37] for x in inputs))
    second, final = kimi_delta_rule(*(x[:, 37:] for x in inputs), state)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(final, whole_state, atol=2e-5, rtol=1e-4)


def test_zero_beta_and_decay_leave_the_state_untouched():
    query, key, value, log_decay, beta, state = random_inputs(1, 5, 2, 8, 8)
    for mode in ("chunk", "recurrent"):
        _, final = kimi_delta_rule(
            query, key, value, torch.zeros_like(log_decay), torch.zeros_like(beta), state, mode=mode
        )
        torch.testing.assert_close(final, state)


@pytest.mark.parametrize("seq", [1, 70])
def test_matches_transformers_glm5_next_references(seq):
    query, key, value, log_decay, beta, state = random_inputs(2, seq, 3, 16, 8)
    arguments = dict(g=log_decay, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    for mode, oracle in (("chunk", glm.chunk_kimi_delta_attention), ("recurrent", glm.recurrent_kimi_delta_attention)):
        ours, ours_state = kimi_delta_rule(query, key, value, log_decay, beta, state, mode=mode)
        theirs, theirs_state = oracle(query, key, value, **arguments)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours_state, theirs_state, atol=1e-5, rtol=1e-5)


def test_gradients_match_the_recurrent_form():
    inputs = [x.requires_grad_() for x in random_inputs(1, 40, 2, 8, 4)]
    grads = []
    for mode in ("chunk", "recurrent"):
        output, state = kimi_delta_rule(*inputs, mode=mode)
        grads.append(torch.autograd.grad((output.sin().sum() + state.cos().sum()), inputs))
    for chunked, recurrent in zip(*grads):
        torch.testing.assert_close(chunked, recurrent, atol=1e-4, rtol=1e-4)


def test_bfloat16_inputs_give_bfloat16_outputs_and_a_float32_state():
    query, key, value, log_decay, beta, _ = random_inputs(1, 20, 1, 8, 8)
    output, state = kimi_delta_rule(query.bfloat16(), key.bfloat16(), value.bfloat16(), log_decay, beta.bfloat16())
    assert output.dtype == torch.bfloat16 and state.dtype == torch.float32


def test_unknown_mode_and_chunk_size_are_rejected():
    query, key, value, log_decay, beta, _ = random_inputs(1, 2, 1, 4, 4)
    with pytest.raises(ValueError, match="mode is 'fast'"):
        kimi_delta_rule(query, key, value, log_decay, beta, mode="fast")
    with pytest.raises(ValueError, match="chunk_size is 24"):
        chunk_kimi_delta_rule_torch(query, key, value, log_decay, beta, chunk_size=24)
