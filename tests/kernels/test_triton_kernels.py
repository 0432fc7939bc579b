"""Triton kernels against the PyTorch reference, in float32 (on CPU under TRITON_INTERPRET=1: the interpreter gets
bfloat16 arithmetic wrong, so the kernels compute in float32 there)."""

import pytest
import torch

from hybrid_indexpool.kernels.pooled_index_topk import pooled_index_topk_torch, pooled_index_topk_triton
from hybrid_indexpool.kernels.sparse_attention import sparse_attention_torch, sparse_attention_triton

pytestmark = pytest.mark.skipif(
    pooled_index_topk_triton is None or sparse_attention_triton is None,
    reason="Triton is not installed (pip install -e '.[triton]'); the PyTorch path is tested elsewhere",
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def layout(batch, queries, pool_size, context, seed):
    """`queries` new tokens ending a context of `context` positions; row b > 0 has up to 4 fewer real tokens (it was
    padded), so its first queries may be padding when the queries reach back into it.

    Returns the generator, the queries' positions (padding clamped to 0), which queries are real, and the context.
    """
    generator = torch.Generator().manual_seed(seed)
    padding = torch.randint(0, 5, (batch,), generator=generator)
    padding[0] = 0
    positions = torch.arange(context - queries, context).expand(batch, queries) - padding[:, None]
    real = positions >= 0
    return generator, positions.clamp(min=0), real, context


TOPK_CASES = [  # batch, queries, heads, head_dim, pool_size, context, topk, head weights
    (1, 1, 4, 32, 4, 400, 16, False),   # decode far past the budget (split over programs)
    (3, 1, 2, 16, 1, 90, 8, True),      # decode, r = 1, left padding
    (2, 17, 3, 16, 2, 60, 40, False),   # budget above what is visible
    (3, 64, 2, 16, 4, 130, 6, True),
    (1, 200, 1, 16, 4, 200, 12, False),  # a whole prefill from position 0
]


@pytest.mark.parametrize("batch, queries, heads, head_dim, pool_size, context, topk, with_weights", TOPK_CASES)
def test_pooled_index_topk_selects_the_same_windows(batch, queries, heads, head_dim, pool_size, context, topk,
                                                    with_weights):
    generator, positions, real, _ = layout(batch, queries, pool_size, context, seed=queries + topk)
    num_windows = context // pool_size
    index_queries = torch.randn(batch, queries, heads, head_dim, generator=generator)
    pooled_keys = torch.randn(batch, num_windows, head_dim, generator=generator)
    num_visible = torch.where(real, (positions + 1) // pool_size, 0)
    weights = torch.randn(batch, queries, heads, generator=generator) if with_weights else None
    expected = pooled_index_topk_torch(index_queries, pooled_keys, num_visible, topk, weights)
    args = [t.to(DEVICE) if t is not None else None for t in (index_queries, pooled_keys, num_visible)]
    got = pooled_index_topk_triton(*args, topk, None if weights is None else weights.to(DEVICE))
    assert torch.equal(got.cpu(), expected)
    if queries == 1:  # the split decode path must agree with a single program per query
        single = pooled_index_topk_triton(*args, topk, None if weights is None else weights.to(DEVICE),
                                          num_splits=1)
        assert torch.equal(single.cpu(), expected)


def test_pooled_index_topk_ties_go_to_the_lower_window():
    index_queries = -torch.ones(1, 2, 1, 16)
    pooled_keys = torch.ones(1, 40, 16)
    selected = pooled_index_topk_triton(index_queries.to(DEVICE), pooled_keys.to(DEVICE),
                                        torch.tensor([[40, 2]], device=DEVICE), 3)
    assert selected.cpu().tolist() == [[[0, 1, 2], [0, 1, -1]]]


ATTENTION_CASES = [  # batch, queries, kv heads, group, head_dim, pool_size, context, topk windows, gradients
    (1, 1, 2, 4, 32, 4, 120, 5, False),   # decode, GQA 4
    (3, 1, 1, 2, 16, 2, 70, 6, False),    # decode, left padding
    (2, 17, 2, 1, 16, 1, 40, 8, True),    # r = 1 (plain DSA), no GQA
    (2, 17, 1, 4, 16, 4, 60, 3, True),
    (3, 64, 1, 2, 16, 2, 100, 4, False),
    (1, 200, 1, 2, 16, 4, 200, 2, False),  # prefill from position 0
    (2, 9, 2, 2, 16, 4, 30, 16, True),    # budget above what is visible
]


@pytest.mark.parametrize("batch, queries, kv_heads, group, head_dim, pool_size, context, topk, with_grad",
                         ATTENTION_CASES)
def test_sparse_attention_matches_reference(batch, queries, kv_heads, group, head_dim, pool_size, context, topk,
                                            with_grad):
    generator, positions, real, num_positions = layout(batch, queries, pool_size, context, seed=queries * 7 + topk)
    num_visible = torch.where(real, (positions + 1) // pool_size, 0)
    selected = torch.full((batch, queries, topk), -1, dtype=torch.long)
    for b in range(batch):
        for t in range(queries):
            chosen = torch.randperm(int(num_visible[b, t]), generator=generator)[:topk].sort().values
            selected[b, t, : len(chosen)] = chosen
    query = torch.randn(batch, kv_heads * group, queries, head_dim, generator=generator)
    key = torch.randn(batch, kv_heads, num_positions, head_dim, generator=generator)
    value = torch.randn(batch, kv_heads, num_positions, head_dim, generator=generator)
    index_args = (selected, positions)
    leaves = [t.clone().requires_grad_(with_grad) for t in (query, key, value)]
    expected, _ = sparse_attention_torch(*leaves, *index_args, pool_size, head_dim**-0.5)
    device_leaves = [t.detach().to(DEVICE).requires_grad_(with_grad) for t in (query, key, value)]
    got = sparse_attention_triton(*device_leaves, *(t.to(DEVICE) for t in index_args), pool_size, head_dim**-0.5)
    torch.testing.assert_close(got.detach().cpu(), expected.detach(), atol=1e-4, rtol=1e-4)
    if queries == 1:
        split = sparse_attention_triton(*(t.detach() for t in device_leaves), *(t.to(DEVICE) for t in index_args),
                                        pool_size, head_dim**-0.5, num_splits=3)
        torch.testing.assert_close(split.cpu(), expected.detach(), atol=1e-4, rtol=1e-4)
    if with_grad:
        grad_output = torch.randn(expected.shape, generator=generator)
        expected_grads = torch.autograd.grad(expected, leaves, grad_output)
        got_grads = torch.autograd.grad(got, device_leaves, grad_output.to(DEVICE))
        for name, want, have in zip(("query", "key", "value"), expected_grads, got_grads):
            torch.testing.assert_close(have.cpu(), want, atol=1e-4, rtol=1e-4, msg=f"gradient of {name}")


def test_sparse_attention_reads_strided_cache_views():
    """The cache hands out `storage[:, :, :slots]` views; forward and backward must honour their strides."""
    generator = torch.Generator().manual_seed(5)
    storage_key = torch.randn(1, 2, 64, 16, generator=generator)
    storage_value = torch.randn(1, 2, 64, 16, generator=generator)
    query = torch.randn(1, 4, 3, 16, generator=generator)
    key, value = storage_key[:, :, :40], storage_value[:, :, :40]
    positions = torch.arange(37, 40)[None]
    index_args = (torch.tensor([[[0, 3, 7]] * 3]), positions)
    leaves = [t.clone().requires_grad_() for t in (query, key.contiguous(), value.contiguous())]
    expected, _ = sparse_attention_torch(*leaves, *index_args, 4, 0.25)
    strided = [query.clone().requires_grad_(), storage_key.clone()[:, :, :40].requires_grad_(), storage_value.clone()[:, :, :40]
               .requires_grad_()]
    assert not strided[1].is_contiguous()
    got = sparse_attention_triton(*(t.to(DEVICE) for t in strided), *(t.to(DEVICE) for t in index_args), 4, 0.25)
    torch.testing.assert_close(got.detach().cpu(), expected.detach(), atol=1e-4, rtol=1e-4)
    grads = torch.autograd.grad(got.sum(), strided)
    for have, want in zip(grads, torch.autograd.grad(expected.sum(), leaves)):
        torch.testing.assert_close(have.cpu(), want, atol=1e-4, rtol=1e-4)
