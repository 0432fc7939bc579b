"""The IndexPool layer against independent oracles: dense gated attention (transformers' Qwen3.5 attention) within
the budget, and a slow one-query-at-a-time selection beyond it."""

import math

import pytest
import torch
from model_factory import randomize_indexer, tiny_config

from hybrid_indexpool.modeling import attention_indexpool
from hybrid_indexpool.modeling import modeling_hybrid_indexpool as modeling
from hybrid_indexpool.modeling.layers import apply_rotary

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def build_layer(**overrides):
    config = tiny_config(num_hidden_layers=1, layer_types=["indexpool_attention"], **overrides)
    model = modeling.HybridIndexPoolModel(config).eval()
    randomize_indexer(model)
    return config, model.layers[0].self_attn, model.rotary_emb


def run_layer(layer, rotary, hidden, positions=None, token_is_real=None):
    batch, seq, _ = hidden.shape
    positions = torch.arange(seq).expand(batch, seq) if positions is None else positions
    token_is_real = torch.ones(batch, seq, dtype=torch.bool) if token_is_real is None else token_is_real
    with torch.no_grad():
        output, *_ = layer(hidden, rotary(hidden, positions), positions, positions[None], token_is_real)
    return output


@pytest.mark.parametrize("pool_size, topk", [(1, 8), (2, 8), (4, 8), (4, 16)])
def test_within_budget_equals_dense_gated_attention_of_qwen3_5(pool_size, topk):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

    config, layer, rotary = build_layer(index_pool_size=pool_size, index_topk=topk)
    qwen_config = Qwen3_5TextConfig(
        hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        num_hidden_layers=1, layer_types=["full_attention"], vocab_size=config.vocab_size,
    )
    qwen_config._attn_implementation = "eager"
    qwen = Qwen3_5Attention(qwen_config, 0).eval()
    missing, _ = qwen.load_state_dict(layer.state_dict(), strict=False)
    assert missing == []

    seq = topk + pool_size - 1  # the longest input attended densely
    hidden = torch.randn(2, seq, config.hidden_size)
    positions = torch.arange(seq).expand(2, seq)
    causal = torch.full((seq, seq), float("-inf")).triu(1)[None, None].expand(2, 1, seq, seq)
    with torch.no_grad():
        expected, _ = qwen(hidden, rotary(hidden, positions), causal)
    torch.testing.assert_close(run_layer(layer, rotary, hidden), expected, atol=1e-5, rtol=0)


def slow_selection_and_output(layer, rotary, hidden):
    """Per query: pool every visible window from raw keys, score, keep the best (ties: lower id), attend."""
    indexer = layer.indexer
    batch, seq, _ = hidden.shape
    r, topk = layer.pool_size, layer.topk_windows
    positions = torch.arange(seq).expand(batch, seq)
    cos, sin = rotary(hidden, positions)
    with torch.no_grad():
        raw_keys = indexer.k_proj(hidden)
        queries = apply_rotary(indexer.q_norm(indexer.q_proj(hidden).view(batch, seq, indexer.num_heads, -1)),
                               cos[:, :, None], sin[:, :, None])
        query = apply_rotary(layer.q_norm(layer.q_proj(hidden).view(batch, seq, layer.num_heads, -1).chunk(2, -1)[0]),
                             cos[:, :, None], sin[:, :, None])
        gate = layer.q_proj(hidden).view(batch, seq, layer.num_heads, -1).chunk(2, -1)[1].reshape(batch, seq, -1)
        key = apply_rotary(layer.k_norm(layer.k_proj(hidden).view(batch, seq, layer.num_kv_heads, -1)),
                           cos[:, :, None], sin[:, :, None])
        value = layer.v_proj(hidden).view(batch, seq, layer.num_kv_heads, -1)
        selections = torch.full((batch, seq, topk), -1, dtype=torch.long)
        output = torch.zeros(batch, seq, layer.num_heads, layer.head_dim)
        for b in range(batch):
            pooled = []
            for c in range(seq // r):
                window = raw_keys[b, c * r:(c + 1) * r].float()
                if indexer.learned_pooling:  # [r, d] logits per channel or [r, 1] per token
                    logits = indexer.pool_gate_proj(hidden[b, c * r:(c + 1) * r]).float() + indexer.pool_slot_bias
                    key_c = indexer.k_norm(((logits.softmax(dim=0) * window).sum(dim=0)).to(raw_keys.dtype))
                elif indexer.norm_before_pooling:
                    key_c = torch.stack([indexer.k_norm(window[j]) for j in range(r)]).mean(dim=0)
                else:
                    key_c = indexer.k_norm(window.mean(dim=0).to(raw_keys.dtype))
                window_cos, window_sin = rotary(key_c, torch.tensor([[c * r]]))
                pooled.append(apply_rotary(key_c, window_cos[0, 0], window_sin[0, 0]))
            for t in range(seq):
                visible = (t + 1) // r
                weights = torch.ones(indexer.num_heads)
                if indexer.head_weights_proj is not None:
                    weights = indexer.head_weights_proj(hidden[b, t]).float() * indexer.num_heads**-0.5
                scored = []
                for c in range(visible):
                    per_head = (queries[b, t].float() @ pooled[c].float()).relu()
                    scored.append((-float((weights * per_head).sum()) / math.sqrt(indexer.head_dim), c))
                chosen = sorted(c for _, c in sorted(scored)[:topk])
                selections[b, t, : len(chosen)] = torch.tensor(chosen, dtype=torch.long)
                slots = [c * r + j for c in chosen for j in range(r)] + list(range(visible * r, t + 1))
                slots = torch.tensor(slots)
                for h in range(layer.num_heads):
                    kv = h // (layer.num_heads // layer.num_kv_heads)
                    probs = torch.softmax(key[b, slots, kv] @ query[b, t, h] * layer.scaling, dim=0)
                    output[b, t, h] = probs @ value[b, slots, kv]
        output = layer.o_proj(output.reshape(batch, seq, -1) * torch.sigmoid(gate))
    return selections, output


@pytest.mark.parametrize("pool_size", [1, 2, 4])
@pytest.mark.parametrize("weighting", ["learned", "learned_scalar", "mean", "prenorm_mean"])
@pytest.mark.parametrize("head_weights", [False, True])
def test_beyond_budget_selection_and_output_match_slow_reference(pool_size, weighting, head_weights, monkeypatch):
    config, layer, rotary = build_layer(index_pool_size=pool_size, index_topk=2 * pool_size,
                                        index_pool_weighting=weighting, index_head_weights=head_weights)
    recorded = []

    def recording_topk(*args, **kwargs):
        recorded.append(modeling_topk(*args, **kwargs))
        return recorded[-1]

    modeling_topk = attention_indexpool.pooled_index_topk
    monkeypatch.setattr(attention_indexpool, "pooled_index_topk", recording_topk)
    hidden = torch.randn(2, 6 * pool_size + 3, config.hidden_size)
    output = run_layer(layer, rotary, hidden)
    expected_selection, expected_output = slow_selection_and_output(layer, rotary, hidden)
    assert len(recorded) == 1 and torch.equal(recorded[0], expected_selection)
    torch.testing.assert_close(output, expected_output, atol=1e-5, rtol=1e-4)


def test_learned_pooling_at_initial_weights_equals_mean_pooling_exactly():
    torch.manual_seed(0)
    learned = modeling.HybridIndexPoolForCausalLM(tiny_config(index_pool_weighting="learned")).eval()
    mean = modeling.HybridIndexPoolForCausalLM(tiny_config(index_pool_weighting="mean")).eval()
    missing, unexpected = mean.load_state_dict(learned.state_dict(), strict=False)
    assert missing == [] and all("pool_" in name for name in unexpected) and unexpected
    input_ids = torch.randint(1, 97, (2, 45))
    with torch.no_grad():
        assert torch.equal(learned(input_ids).logits, mean(input_ids).logits)


def test_the_sparse_path_is_taken_beyond_the_budget_and_changes_the_result():
    config, layer, rotary = build_layer(index_topk=4)
    _, dense_layer, _ = build_layer(index_topk=64)
    dense_layer.load_state_dict(layer.state_dict())
    hidden = torch.randn(1, 40, config.hidden_size)
    sparse_out, dense_out = run_layer(layer, rotary, hidden), run_layer(dense_layer, rotary, hidden)
    # Identical where the budget covers everything, different once windows are pruned.
    torch.testing.assert_close(sparse_out[:, :7], dense_out[:, :7], atol=1e-5, rtol=0)
    assert (sparse_out[:, 12:] - dense_out[:, 12:]).abs().max() > 1e-3


def test_sink_and_local_windows_are_selected_by_the_layer_and_decode_equals_one_pass(monkeypatch):
    """`index_sink_windows` / `index_local_windows`: every query past the budget selects the first window and its own
    latest complete window (inside the budget), in the prefill and in each decode step alike."""
    from model_factory import tiny_model

    from hybrid_indexpool import HybridIndexPoolCache

    recorded = []

    def recording_topk(*args, **kwargs):
        recorded.append((args[2], modeling_topk(*args, **kwargs)))  # (visible windows, selection)
        return recorded[-1][1]

    model = tiny_model(index_topk=16, index_sink_windows=1, index_local_windows=1)
    input_ids = torch.randint(1, 97, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = tiny_model(index_topk=16)(input_ids).logits
    modeling_topk = attention_indexpool.pooled_index_topk
    monkeypatch.setattr(attention_indexpool, "pooled_index_topk", recording_topk)
    with torch.no_grad():
        whole = model(input_ids).logits
        assert not torch.allclose(whole, plain, atol=1e-4)  # forcing changed the selections
        cache = HybridIndexPoolCache(model.config, max_cache_len=50)
        steps = [model(input_ids[:, :30], cache=cache).logits]
        steps += [model(input_ids[:, t:t + 1], cache=cache).logits for t in range(30, 50)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-4, rtol=0)
    checked = 0
    for visible, selection in recorded:
        for ids, count in zip(selection.flatten(0, 1).tolist(), visible.flatten().tolist()):
            if count > 4:  # past the budget of 4 windows
                assert 0 in ids and count - 1 in ids and -1 not in ids
                checked += 1
    assert checked > 40
