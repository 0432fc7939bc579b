import pytest
import torch

from hybrid_indexpool.kernels.sparse_attention import reference, sparse_attention


def dense_reference(query, key, value, position_sets, scaling):
    """Per query and head: softmax attention over an explicit set of positions."""
    batch, heads, queries, dim = query.shape
    group = heads // key.shape[1]
    output = torch.zeros(batch, queries, heads, dim, dtype=query.dtype)
    for b in range(batch):
        for t in range(queries):
            slots = torch.tensor(sorted(position_sets[b][t]), dtype=torch.long)
            for h in range(heads):
                keys, values = key[b, h // group, slots], value[b, h // group, slots]
                probs = torch.softmax(keys @ query[b, h, t] * scaling, dim=0)
                output[b, t, h] = probs @ values
    return output


@pytest.mark.parametrize("pool_size", [1, 2, 4])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_matches_attention_over_explicit_position_sets(pool_size, group):
    generator = torch.Generator().manual_seed(pool_size * 10 + group)
    batch, kv_heads, dim, queries, topk = 2, 2, 8, 6, 3
    positions = torch.tensor([[30, 31, 32, 33, 34, 35], [25, 26, 27, 28, 29, 30]])
    num_positions = 41
    tail_length = (positions + 1) % pool_size
    num_visible = (positions + 1) // pool_size
    selected = torch.full((batch, queries, topk), -1, dtype=torch.long)
    position_sets = [[set() for _ in range(queries)] for _ in range(batch)]
    for b in range(batch):
        for t in range(queries):
            chosen = torch.randperm(int(num_visible[b, t]), generator=generator)[: topk - (t % 2)].sort().values
            selected[b, t, : len(chosen)] = chosen
            for c in chosen.tolist():
                position_sets[b][t].update(c * pool_size + j for j in range(pool_size))
            position_sets[b][t].update(int(positions[b, t]) - j for j in range(int(tail_length[b, t])))
    query = torch.randn(batch, kv_heads * group, queries, dim, generator=generator)
    key = torch.randn(batch, kv_heads, num_positions, dim, generator=generator)
    value = torch.randn(batch, kv_heads, num_positions, dim, generator=generator)
    output, weights = sparse_attention(query, key, value, selected, positions, pool_size, dim**-0.5,
                                       return_weights=True)
    torch.testing.assert_close(output, dense_reference(query, key, value, position_sets, dim**-0.5))
    for b in range(batch):
        for t in range(queries):
            nonzero = set(torch.nonzero(weights[b, 0, t]).flatten().tolist())
            assert nonzero == position_sets[b][t]
    torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))


def test_query_chunks_do_not_change_the_result(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 2, 20, 4, generator=generator)
    key = torch.randn(1, 1, 40, 4, generator=generator)
    value = torch.randn(1, 1, 40, 4, generator=generator)
    positions = torch.arange(20, 40)[None]
    selected = torch.tensor([[[1, 4]]]).expand(1, 20, 2).clone()
    args = (selected, positions, 2, 0.5)
    whole, _ = sparse_attention(query, key, value, *args)
    monkeypatch.setattr(reference, "GATHER_BLOCK_ELEMENTS", 1)
    chunked, _ = sparse_attention(query, key, value, *args)
    torch.testing.assert_close(whole, chunked)


def test_gradients_flow_to_query_key_and_value():
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 2, 5, 4, generator=generator, requires_grad=True)
    key = torch.randn(1, 1, 12, 4, generator=generator, requires_grad=True)
    value = torch.randn(1, 1, 12, 4, generator=generator, requires_grad=True)
    positions = torch.arange(7, 12)[None]
    selected = torch.tensor([[[0, 1]] * 5])
    output, _ = sparse_attention(query, key, value, selected, positions, 4, 0.5)
    output.square().sum().backward()
    for tensor in (query, key, value):
        assert torch.isfinite(tensor.grad).all() and tensor.grad.abs().sum() > 0


@pytest.mark.parametrize("gather_block", [1 << 20, 1500])
def test_reused_gather_buffers_give_the_differentiable_result(monkeypatch, gather_block):
    """Inference gathers into buffers reused across query chunks (the last chunk smaller); training gathers fresh,
    differentiable tensors. Both read the same positions, from the cache's position-major layout."""
    monkeypatch.setattr(reference, "GATHER_BLOCK_ELEMENTS", gather_block)  # 1500: chunks of 3, 3, 3 and 1 queries
    generator = torch.Generator().manual_seed(1)
    batch, kv_heads, dim, queries, pool_size, num_positions = 2, 2, 8, 10, 4, 48
    key = torch.randn(batch, num_positions, kv_heads, dim, generator=generator).transpose(1, 2)
    value = torch.randn(batch, num_positions, kv_heads, dim, generator=generator).transpose(1, 2)
    query = torch.randn(batch, 2 * kv_heads, queries, dim, generator=generator)
    positions = torch.stack([torch.arange(30, 30 + queries), torch.arange(27, 27 + queries)])
    selected = torch.stack([torch.randperm(7, generator=generator)[:3].sort().values for _ in range(batch * queries)])
    selected = selected.view(batch, queries, 3)
    selected[0, 0, 2] = -1  # a query with fewer windows
    args = (selected, positions, pool_size, dim**-0.5)
    with torch.no_grad():
        buffered, _ = sparse_attention(query, key, value, *args)
    fresh, _ = sparse_attention(query, key.requires_grad_(), value.requires_grad_(), *args)
    torch.testing.assert_close(buffered, fresh.detach(), rtol=0, atol=0)
