import pytest
import torch

from hybrid_indexpool.kernels.gated_delta_rule import gated_delta_rule


def random_inputs(batch, seq, key_heads, value_heads, key_dim, value_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, seq, key_heads, key_dim, generator=generator)
    key = torch.randn(batch, seq, key_heads, key_dim, generator=generator)
    value = torch.randn(batch, seq, value_heads, value_dim, generator=generator)
    log_decay = -torch.rand(batch, seq, value_heads, generator=generator)
    beta = torch.rand(batch, seq, value_heads, generator=generator)
    state = torch.randn(batch, value_heads, key_dim, value_dim, generator=generator)
    return query, key, value, log_decay, beta, state


@pytest.mark.parametrize("seq", [1, 17, 64, 150])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(seq, with_state):
    query, key, value, log_decay, beta, state = random_inputs(2, seq, 2, 4, 16, 8)
    state = state if with_state else None
    out_chunk, state_chunk = gated_delta_rule(query, key, value, log_decay, beta, state, mode="chunk")
    out_step, state_step = gated_delta_rule(query, key, value, log_decay, beta, state, mode="recurrent")
    torch.testing.assert_close(out_chunk, out_step, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(state_chunk, state_step, atol=2e-5, rtol=1e-4)


def test_splitting_a_sequence_carries_the_state():
    query, key, value, log_decay, beta, _ = random_inputs(1, 100, 2, 2, 8, 8)
    whole, whole_state = gated_delta_rule(query, key, value, log_decay, beta)
    first, state = gated_delta_rule(query[:, :37], key[:, :37], value[:, :37], log_decay[:, :37], beta[:, :37])
    second, final = gated_delta_rule(query[:, 37:], key[:, 37:], value[:, 37:], log_decay[:, 37:], beta[:, 37:], state)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(final, whole_state, atol=2e-5, rtol=1e-4)


def test_zero_beta_and_decay_leave_the_state_untouched():
    query, key, value, log_decay, beta, state = random_inputs(1, 5, 2, 2, 8, 8)
    _, final = gated_delta_rule(query, key, value, torch.zeros_like(log_decay), torch.zeros_like(beta), state)
    torch.testing.assert_close(final, state)


def test_matches_transformers_qwen3_5_reference():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    query, key, value, log_decay, beta, state = random_inputs(2, 70, 2, 4, 16, 8)
    ours, ours_state = gated_delta_rule(query, key, value, log_decay, beta, state)
    theirs, theirs_state = qwen.torch_chunk_gated_delta_rule(
        query, key, value, g=log_decay, beta=beta, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_state, theirs_state, atol=1e-5, rtol=1e-5)


def test_unknown_mode_is_rejected():
    query, key, value, log_decay, beta, _ = random_inputs(1, 2, 1, 1, 4, 4)
    with pytest.raises(ValueError, match="mode is 'fast'"):
        gated_delta_rule(query, key, value, log_decay, beta, mode="fast")
