"""Pool distillation: its target against the layer's own dense attention, by brute force; padding; the loss; training
only the pooling gates toward it; and the distilled gates pooling the same in the model and in the Triton write."""

import math

import pytest
import torch
from model_factory import tiny_model

from hybrid_indexpool.kernels.pooled_key_write import write_pooled_keys_torch, write_pooled_keys_triton
from hybrid_indexpool.modeling.attention_indexpool import HybridIndexPoolAttentionBase
from hybrid_indexpool.pool_distillation import (
    PoolDistillation,
    layer_dense_attentions,
    pool_distillation_loss,
    window_token_mass,
    within_window_concentration,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def index_layer(model) -> HybridIndexPoolAttentionBase:
    (layer,) = [module for module in model.modules() if isinstance(module, HybridIndexPoolAttentionBase)]
    return layer


@pytest.mark.parametrize("pool_size", [4, 8])
def test_the_target_is_the_attention_each_token_receives_from_the_queries_that_see_its_window(pool_size):
    model = tiny_model(index_pool_weighting="learned_scalar", index_pool_size=pool_size, index_topk=2 * pool_size)
    input_ids = torch.randint(1, 97, (2, 45), generator=torch.Generator().manual_seed(3))
    with PoolDistillation(model) as distillation, torch.no_grad():
        # The layer's own dense attention (its weights, as the model returns them).
        dense = model(input_ids, output_attentions=True, indexer_loss="dense").attentions[0]
    inputs = distillation._inputs[index_layer(model)]
    recomputed = PoolDistillation.dense_attention(index_layer(model), inputs["hidden_states"],
                                                  inputs["position_embeddings"], inputs["positions"],
                                                  inputs["token_is_real"])
    torch.testing.assert_close(recomputed, dense, rtol=1e-5, atol=1e-6)
    target, complete = window_token_mass(dense, inputs["positions"], inputs["token_is_real"], pool_size)
    windows = 45 // pool_size
    assert target.shape == (2, 45 // pool_size, pool_size) and bool(complete.all())
    for row in range(2):
        for window in range(windows):
            received = [sum(dense[row, :, query, key].sum().item() for query in range(45)
                            if (query + 1) // pool_size > window)
                        for key in range(window * pool_size, (window + 1) * pool_size)]
            expected = torch.tensor(received) / sum(received)
            torch.testing.assert_close(target[row, window], expected, rtol=1e-4, atol=1e-6)
    # Not the uniform weights of mean pooling: there is something to learn.
    assert (target - 1 / pool_size).abs().max() > 0.05


def test_a_left_padded_row_gives_the_loss_of_the_same_sequence_alone():
    model = tiny_model(index_pool_weighting="learned_scalar")
    generator = torch.Generator().manual_seed(5)
    long, short = torch.randint(1, 97, (1, 29), generator=generator), torch.randint(1, 97, (1, 16), generator=generator)
    distillation = PoolDistillation(model)

    def loss(input_ids, attention_mask=None):
        with distillation, torch.no_grad():
            model(input_ids, attention_mask=attention_mask, indexer_loss="dense")
        return distillation.loss().item()

    # The short row ends a window: its padding, laid after it at its last position, must not overwrite that one.
    padded = torch.cat([torch.zeros(1, 13, dtype=torch.long), short], dim=1)
    mask = torch.cat([torch.zeros(1, 13, dtype=torch.long), torch.ones(1, 16, dtype=torch.long)], dim=1)
    batch = loss(torch.cat([long, padded]), torch.cat([torch.ones_like(long), mask]))
    # The mean over complete windows: 7 of the long row, 4 of the short one.
    assert batch == pytest.approx((7 * loss(long) + 4 * loss(short)) / 11, rel=1e-5)
    assert batch > 0


def test_the_loss_is_the_kl_to_the_gate_weights_and_zero_when_they_match():
    target = torch.tensor([[[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]]])
    complete = torch.tensor([[True, True]])
    matching = target.log()[..., None].expand(-1, -1, -1, 3)  # one gate per channel, all equal to the target
    assert pool_distillation_loss(target, matching + 2.0, complete).item() == pytest.approx(0.0, abs=1e-6)
    mean = torch.zeros(1, 2, 4, 1)  # the gate a fresh model starts with
    expected = sum(p * math.log(p / 0.25) for p in (0.7, 0.1, 0.1, 0.1)) / 2  # the second window is uniform
    assert pool_distillation_loss(target, mean, complete).item() == pytest.approx(expected, rel=1e-5)
    # Incomplete windows do not count.
    assert pool_distillation_loss(target, mean, torch.tensor([[False, True]])).item() == pytest.approx(0.0, abs=1e-7)


def test_only_the_pooling_gate_and_slot_bias_learn_from_it_and_a_few_steps_lower_it():
    model = tiny_model(index_pool_weighting="learned_scalar")
    for name, parameter in model.named_parameters():  # a fresh gate: the mean
        if "pool_" in name:
            torch.nn.init.zeros_(parameter)
    input_ids = torch.randint(1, 97, (2, 48), generator=torch.Generator().manual_seed(7))
    distillation = PoolDistillation(model)
    with distillation:
        model(input_ids, indexer_loss="dense")
    distillation.loss().backward()
    learning = sorted(name for name, parameter in model.named_parameters() if parameter.grad is not None
                      and parameter.grad.abs().sum() > 0)
    assert learning == ["model.layers.3.self_attn.indexer.pool_gate_proj.weight",
                        "model.layers.3.self_attn.indexer.pool_slot_bias"]
    gates = [parameter for name, parameter in model.named_parameters() if "pool_" in name]
    optimizer = torch.optim.Adam(gates, lr=0.05)
    losses = []
    for _ in range(15):
        optimizer.zero_grad()
        with distillation:
            model(input_ids, indexer_loss="dense")
        loss = distillation.loss()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_a_model_without_a_learned_gate_is_refused():
    with pytest.raises(ValueError, match="'learned' or 'learned_scalar'"):
        PoolDistillation(tiny_model(index_pool_weighting="mean"))


def test_the_loss_needs_a_forward_inside_the_block():
    with pytest.raises(RuntimeError, match="No forward"):
        PoolDistillation(tiny_model(index_pool_weighting="learned")).loss()


@pytest.mark.skipif(write_pooled_keys_triton is None, reason="Triton is not installed")
@pytest.mark.parametrize("weighting", ["learned_scalar", "learned"])
def test_distilled_gates_pool_the_same_in_the_model_and_in_the_triton_write(weighting):
    """After distillation steps (gates far from the mean), the serving path's pooled-key write (Triton, float32,
    and its PyTorch reference) stores the keys the model's indexer pools. Windows rotate at position 0 here (an
    identity rotation in both), so the comparison is of the pooling and the norm."""
    model = tiny_model(index_pool_weighting=weighting)
    input_ids = torch.randint(1, 97, (1, 32), generator=torch.Generator().manual_seed(2))
    distillation = PoolDistillation(model)
    gates = [parameter for name, parameter in model.named_parameters() if "pool_" in name]
    optimizer = torch.optim.Adam(gates, lr=0.2)
    for _ in range(5):
        optimizer.zero_grad()
        with distillation:
            model(input_ids, indexer_loss="dense")
        distillation.loss().backward()
        optimizer.step()
    indexer = index_layer(model).indexer
    inputs = distillation._inputs[index_layer(model)]
    with torch.no_grad():
        cos, sin = inputs["position_embeddings"]
        _, raw_keys, gate_logits, _ = indexer(inputs["hidden_states"], cos, sin)
        r, windows = indexer.pool_size, 32 // indexer.pool_size
        expected = indexer.pool_windows(raw_keys[0].unflatten(0, (windows, r))[None],
                                        gate_logits[0].unflatten(0, (windows, r))[None],
                                        torch.zeros(1, 1, windows, dtype=torch.long))[0]
    assert gate_logits.abs().max() > 0.1  # trained away from the mean
    head_dim = raw_keys.shape[-1]
    tokens = torch.arange(32)
    step_rows = torch.cat([raw_keys[0], gate_logits[0]], dim=-1)
    window_token = tokens // r * r
    rotary_dim = head_dim // 2
    arguments = dict(
        step_rows=step_rows, ring_cache=torch.zeros(1, r, 1, step_rows.shape[-1]),
        window_token=window_token[:, None] + torch.arange(r), window_ring_block=torch.zeros(32, dtype=torch.long),
        window_start=torch.zeros(32, dtype=torch.long),
        cos_sin_cache=torch.cat([torch.ones(1, rotary_dim // 2), torch.zeros(1, rotary_dim // 2)], dim=-1),
        norm_weight=indexer.k_norm.weight.detach(), norm_eps=indexer.k_norm.eps,
        slot_bias=indexer.pool_slot_bias.detach(), weighting=weighting, write_token=window_token + r - 1,
        write_block=torch.zeros(32, dtype=torch.long), write_row=tokens // r,
        write_keep=torch.ones(32, dtype=torch.bool))
    for write in (write_pooled_keys_torch, write_pooled_keys_triton):
        cache = torch.zeros(1, windows, 1, head_dim)
        write(cache, **arguments)
        torch.testing.assert_close(cache[0, :, 0], expected, rtol=2e-6, atol=2e-6, msg=write.__name__)


def concentration_of(weights: list[list[float]], pool_size: int = 4) -> dict:
    """`within_window_concentration` of one head whose query `t` puts `weights[t]` on the keys (rows padded with 0)."""
    seq_len = len(weights)
    attention = torch.tensor([row + [0.0] * (seq_len - len(row)) for row in weights])[None, None]
    positions = torch.arange(seq_len)[None]
    return within_window_concentration(attention, positions, torch.ones(1, seq_len, dtype=torch.bool), pool_size)


def test_concentration_is_log_r_when_every_query_wants_the_same_token_and_shared_zero_when_they_disagree():
    # 7 tokens: window 0 = tokens 0..3, complete, seen by queries 3..6 (queries 0..2 see no window: not counted).
    same = [[1.0]] * 3 + [[0.0, 0.0, 1.0] + [0.0] * (query - 2) for query in range(3, 7)]
    result = concentration_of(same)
    assert result["per_query"] == pytest.approx(math.log(4), abs=1e-5)
    assert result["shared"] == pytest.approx(math.log(4), abs=1e-5)
    # Each of the four queries wants another token of window 0: each is as peaked, together they are uniform.
    disagree = [[1.0]] * 3 + [[1.0 if key == query - 3 else 0.0 for key in range(query + 1)] for query in range(3, 7)]
    result = concentration_of(disagree)
    assert result["per_query"] == pytest.approx(math.log(4), abs=1e-5)
    assert result["shared"] == pytest.approx(0.0, abs=1e-5)


def test_layer_dense_attentions_are_the_layers_own():
    model = tiny_model(index_pool_weighting="mean")
    input_ids = torch.randint(1, 97, (2, 21), generator=torch.Generator().manual_seed(4))
    ((attention, positions, real),) = layer_dense_attentions(model, input_ids, indexer_loss="dense")
    with torch.no_grad():
        dense = model(input_ids, output_attentions=True, indexer_loss="dense").attentions[0]
    torch.testing.assert_close(attention, dense, rtol=1e-5, atol=1e-6)
    assert torch.equal(positions, torch.arange(21).expand(2, -1)) and bool(real.all())
    concentration = within_window_concentration(attention, positions, real, 4)
    assert 0.0 < concentration["shared"] < concentration["per_query"] < math.log(4)
