"""Kimi Delta Attention's serving step (`serving/paged_kda.py`, what the vLLM layer runs over vLLM's mamba state cache)
against the transformers layer, on CPU without vLLM: requests split into prefill chunks and decodes across steps, in
state slots that start with NaN, give each request's tokens as the layer gives them over the whole sequence."""

import pytest
import torch

from hybrid_indexpool import HybridIndexPoolConfig
from hybrid_indexpool.modeling.linear_attention_kda import HybridIndexPoolKimiDeltaAttention
from hybrid_indexpool.serving.paged_kda import KdaStepMetadata, kimi_delta_step, short_convolution_step

LENGTHS = [7, 3, 20]  # requests A, B, C
SLOTS = [4, 1, 2]  # their state slots (of 6)
# Steps of (request, tokens): decodes (one token, continuing a state) first, then prefill chunks, as vLLM orders them.
STEPS = [
    [(0, 5), (1, 1), (2, 9)],
    [(1, 1), (0, 2), (2, 8)],
    [(1, 1), (2, 3)],
]


def kda_layer(lower_bound):
    config = HybridIndexPoolConfig(
        hidden_size=32, num_hidden_layers=1, layer_types=["linear_attention"], linear_attention_type="kimi_delta",
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_gate_lower_bound=lower_bound, num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    layer = HybridIndexPoolKimiDeltaAttention(config, 0).eval()
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn(parameter.shape) * 0.3)
    return layer


def served_step(layer, hidden, scheduled, done, conv_state, recurrent_state):
    """One step of `scheduled` `[(request, tokens)]` through the serving step, the projections being the layer's."""
    rows = torch.cat([hidden[request][done[request]: done[request] + count] for request, count in scheduled])
    counts = torch.tensor([count for _, count in scheduled])
    metadata = KdaStepMetadata(
        num_decodes=sum(count == 1 and done[request] > 0 for request, count in scheduled),
        num_prefills=sum(not (count == 1 and done[request] > 0) for request, count in scheduled),
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).int()]),
        state_indices=torch.tensor([SLOTS[request] for request, _ in scheduled], dtype=torch.int32),
        has_initial_state=torch.tensor([done[request] > 0 for request, _ in scheduled]))
    mixed = torch.cat([layer.q_proj(rows), layer.k_proj(rows), layer.v_proj(rows)], dim=-1)
    mixed = short_convolution_step(mixed, conv_state, layer.conv1d.weight[:, 0], metadata, layer.conv1d.activation)
    query, key, value = (part.unflatten(-1, (-1, layer.head_dim)) for part in mixed.chunk(3, dim=-1))
    core = kimi_delta_step(query, key, value, layer.forget_gate(rows), layer.b_proj(rows).sigmoid(), recurrent_state,
                           metadata, layer.gate_lower_bound)
    gate = layer.g_b_proj(layer.g_a_proj(rows)).unflatten(-1, (-1, layer.head_dim))
    output = layer.o_proj(layer.o_norm(core, gate).flatten(-2))
    return output.split(counts.tolist())


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_steps_over_state_slots_match_the_transformers_layer(lower_bound):
    layer = kda_layer(lower_bound)
    hidden = [torch.randn(length, 32) for length in LENGTHS]
    with torch.no_grad():
        expected = [layer(states[None], torch.ones(1, len(states), dtype=torch.bool))[0] for states in hidden]
        # Slots hold another request's leftovers (NaN here): a request's first chunk must not read them.
        conv_state = torch.full((6, 3, 3 * 32), float("nan"))
        recurrent_state = torch.full((6, 2, 16, 16), float("nan"))
        done, outputs = [0] * len(LENGTHS), [[] for _ in LENGTHS]
        for scheduled in STEPS:
            for (request, count), output in zip(scheduled, served_step(layer, hidden, scheduled, done, conv_state,
                                                                        recurrent_state)):
                outputs[request].append(output)
                done[request] += count
    assert done == LENGTHS
    for request, pieces in enumerate(outputs):
        torch.testing.assert_close(torch.cat(pieces), expected[request], rtol=1e-4, atol=1e-5)


def test_a_step_reads_nothing_but_its_requests_slots():
    """Slots of requests outside the step keep their states, bit for bit."""
    layer = kda_layer(-5.0)
    hidden = [torch.randn(length, 32) for length in LENGTHS]
    conv_state, recurrent_state = torch.randn(6, 3, 3 * 32), torch.randn(6, 2, 16, 16)
    untouched = [slot for slot in range(6) if slot not in SLOTS]
    before = conv_state[untouched].clone(), recurrent_state[untouched].clone()
    with torch.no_grad():
        served_step(layer, hidden, STEPS[0], [0, 0, 0], conv_state, recurrent_state)
    assert torch.equal(conv_state[untouched], before[0]) and torch.equal(recurrent_state[untouched], before[1])
