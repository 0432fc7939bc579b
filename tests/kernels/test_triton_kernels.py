"""Triton kernels against the PyTorch reference, in float32 (on CPU under TRITON_INTERPRET=1: the interpreter gets
bfloat16 arithmetic wrong, so the kernels compute in float32 there; bfloat16 inputs still run the GPU's tile shapes).
"""

import math
import mmap
import sys

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


def to_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


TOPK_CASES = [  # batch, queries, heads, head_dim, pool_size, context, topk, head weights
    (1, 1, 4, 32, 4, 400, 16, False),   # decode far past the budget (split over programs)
    (3, 1, 2, 16, 1, 90, 8, True),      # decode, r = 1, left padding
    (2, 17, 3, 16, 2, 60, 40, False),   # budget above what is visible, heads not a power of two
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
    args = to_device(index_queries, pooled_keys, num_visible, weights)
    assert torch.equal(pooled_index_topk_triton(*args[:3], topk, args[3]).cpu(), expected)
    # The same with one program per query tile, and as a prefill bounded by the longest causal reach.
    assert torch.equal(pooled_index_topk_triton(*args[:3], topk, args[3], num_splits=1).cpu(), expected)
    limit = int(num_visible.max())
    assert torch.equal(pooled_index_topk_triton(*args[:3], topk, args[3], window_limit=limit).cpu(), expected)


def test_pooled_index_topk_keeps_the_sink_and_local_windows_as_the_reference_does():
    generator, positions, real, _ = layout(2, 9, 4, 120, seed=5)
    index_queries = torch.randn(2, 9, 2, 16, generator=generator)
    pooled_keys = torch.randn(2, 30, 16, generator=generator)
    num_visible = torch.where(real, (positions + 1) // 4, 0)
    expected = pooled_index_topk_torch(index_queries, pooled_keys, num_visible, 6, sink_windows=2, local_windows=1)
    args = to_device(index_queries, pooled_keys, num_visible)
    for limit in (None, int(num_visible.max())):
        ours = pooled_index_topk_triton(*args, 6, window_limit=limit, sink_windows=2, local_windows=1)
        assert torch.equal(ours.cpu(), expected)


def test_pooled_index_topk_ties_go_to_the_lower_window():
    index_queries = -torch.ones(1, 2, 1, 16)
    pooled_keys = torch.ones(1, 40, 16)
    selected = pooled_index_topk_triton(*to_device(index_queries, pooled_keys, torch.tensor([[40, 2]])), 3)
    assert selected.cpu().tolist() == [[[0, 1, 2], [0, 1, -1]]]


def test_pooled_index_topk_prefill_in_bounded_chunks(monkeypatch):
    """Queries in chunks whose scratch is bounded; each chunk scores only the windows its queries can see."""
    from hybrid_indexpool.kernels.pooled_index_topk import triton_impl

    generator = torch.Generator().manual_seed(3)
    batch, queries, heads, head_dim, pool_size, topk = 2, 96, 2, 16, 2, 5
    positions = torch.arange(queries).expand(batch, queries)
    num_visible = (positions + 1) // pool_size
    index_queries = torch.randn(batch, queries, heads, head_dim, generator=generator)
    pooled_keys = torch.randn(batch, queries // pool_size, head_dim, generator=generator)
    expected = pooled_index_topk_torch(index_queries, pooled_keys, num_visible, topk)
    monkeypatch.setattr(triton_impl, "SCRATCH_ELEMENTS", batch * 20 * (queries // pool_size))  # chunks of 20
    got = pooled_index_topk_triton(*to_device(index_queries, pooled_keys, num_visible), topk,
                                   window_limit=queries // pool_size)
    assert torch.equal(got.cpu(), expected)


def test_pooled_index_topk_bfloat16_inputs_run_the_gpu_tiles():
    """bfloat16 inputs take the tensor-core tile shapes (upcast in the interpreter): the selection matches the
    reference computed from the same bfloat16 values."""
    generator = torch.Generator().manual_seed(11)
    batch, queries, heads, head_dim, num_windows, topk = 2, 9, 4, 64, 150, 16
    index_queries = torch.randn(batch, queries, heads, head_dim, generator=generator).bfloat16()
    pooled_keys = torch.randn(batch, num_windows, head_dim, generator=generator).bfloat16()
    num_visible = torch.randint(0, num_windows + 1, (batch, queries), generator=generator)
    weights = torch.rand(batch, queries, heads, generator=generator)
    expected = pooled_index_topk_torch(index_queries, pooled_keys, num_visible, topk, weights)
    got = pooled_index_topk_triton(*to_device(index_queries, pooled_keys, num_visible), topk, weights.to(DEVICE))
    assert torch.equal(got.cpu(), expected)


def random_selection(num_visible, topk, generator):
    """Distinct ascending window ids below each query's bound, `-1` padded."""
    batch, queries = num_visible.shape
    selected = torch.full((batch, queries, topk), -1, dtype=torch.long)
    for b in range(batch):
        for t in range(queries):
            chosen = torch.randperm(int(num_visible[b, t]), generator=generator)[:topk].sort().values
            selected[b, t, : len(chosen)] = chosen
    return selected


def check_attention(query, key, value, selected, positions, pool_size, with_grad, generator, atol=1e-4,
                    reference_inputs=None):
    """Triton output (and gradients) against the reference on float32 copies of the same inputs."""
    reference_inputs = reference_inputs or (query, key, value)
    leaves = [t.detach().float().clone().requires_grad_(with_grad) for t in reference_inputs]
    scaling = query.shape[-1] ** -0.5
    expected, _ = sparse_attention_torch(*leaves, selected, positions, pool_size, scaling)
    device_leaves = [t.detach().to(DEVICE).requires_grad_(with_grad) for t in (query, key, value)]
    got = sparse_attention_triton(*device_leaves, *to_device(selected, positions), pool_size, scaling)
    assert got.dtype == query.dtype
    torch.testing.assert_close(got.detach().cpu().float(), expected.detach(), atol=atol, rtol=atol)
    if with_grad:
        grad_output = torch.randn(expected.shape, generator=generator)
        expected_grads = torch.autograd.grad(expected, leaves, grad_output)
        got_grads = torch.autograd.grad(got, device_leaves, grad_output.to(DEVICE, query.dtype))
        for name, want, have in zip(("query", "key", "value"), expected_grads, got_grads):
            torch.testing.assert_close(have.cpu().float(), want, atol=atol, rtol=atol, msg=f"gradient of {name}")
    return expected.detach()


ATTENTION_CASES = [  # batch, queries, kv heads, group, head_dim, pool_size, context, topk windows, gradients
    (1, 1, 2, 4, 32, 4, 120, 5, False),   # decode, GQA 4
    (3, 1, 1, 2, 16, 2, 70, 6, False),    # decode, left padding
    (2, 17, 2, 1, 16, 1, 40, 8, True),    # r = 1 (plain DSA), no GQA
    (2, 17, 1, 4, 16, 4, 60, 3, True),
    (3, 64, 1, 2, 16, 2, 100, 4, False),
    (1, 200, 1, 2, 16, 4, 200, 2, False),  # prefill from position 0
    (2, 9, 2, 2, 16, 4, 30, 16, True),    # budget above what is visible
    (2, 13, 2, 3, 16, 3, 47, 4, True),    # group and pool size not powers of two, positions not whole windows
]


@pytest.mark.parametrize("batch, queries, kv_heads, group, head_dim, pool_size, context, topk, with_grad",
                         ATTENTION_CASES)
def test_sparse_attention_matches_reference(batch, queries, kv_heads, group, head_dim, pool_size, context, topk,
                                            with_grad):
    generator, positions, real, num_positions = layout(batch, queries, pool_size, context, seed=queries * 7 + topk)
    selected = random_selection(torch.where(real, (positions + 1) // pool_size, 0), topk, generator)
    query = torch.randn(batch, kv_heads * group, queries, head_dim, generator=generator)
    key = torch.randn(batch, kv_heads, num_positions, head_dim, generator=generator)
    value = torch.randn(batch, kv_heads, num_positions, head_dim, generator=generator)
    expected = check_attention(query, key, value, selected, positions, pool_size, with_grad, generator)
    if queries == 1:  # decode splits merged by the combine kernel, any number of them
        for num_splits in (2, 3, 100):
            split = sparse_attention_triton(*to_device(query, key, value, selected, positions), pool_size,
                                            head_dim**-0.5, num_splits=num_splits)
            torch.testing.assert_close(split.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_sparse_attention_bfloat16_inputs_run_the_gpu_tiles():
    """bfloat16 inputs take the tensor-core tile shapes (64 positions, the key-major backward's 64 rows) and write
    bfloat16 outputs and gradients; the interpreter computes in float32, so they match the reference on the same
    values to bfloat16 rounding."""
    generator = torch.Generator().manual_seed(4)
    batch, queries, kv_heads, group, head_dim, pool_size, topk = 2, 40, 2, 4, 64, 4, 12
    positions = torch.arange(80, 80 + queries).expand(batch, queries)
    selected = random_selection((positions + 1) // pool_size, topk, generator)
    query = torch.randn(batch, kv_heads * group, queries, head_dim, generator=generator).bfloat16()
    key = torch.randn(batch, kv_heads, 80 + queries, head_dim, generator=generator).bfloat16()
    value = torch.randn(batch, kv_heads, 80 + queries, head_dim, generator=generator).bfloat16()
    check_attention(query, key, value, selected, positions, pool_size, True, generator, atol=2e-2)


def test_sparse_attention_reads_strided_cache_views():
    """The cache hands out `storage.transpose(1, 2)` views of `[batch, capacity, kv_heads, dim]` storage, sliced to
    the positions in use; forward and backward must honour their strides."""
    generator = torch.Generator().manual_seed(5)
    storage_key = torch.randn(2, 64, 2, 16, generator=generator)
    storage_value = torch.randn(2, 64, 2, 16, generator=generator)
    query = torch.randn(2, 4, 3, 16, generator=generator)
    key, value = storage_key.transpose(1, 2)[:, :, :40], storage_value.transpose(1, 2)[:, :, :40]
    assert not key.is_contiguous()
    positions = torch.arange(37, 40).expand(2, 3)
    selected = torch.tensor([[[0, 3, 7]] * 3, [[1, 2, -1]] * 3])
    check_attention(query, key, value, selected, positions, 4, True, generator,
                    reference_inputs=(query, key.contiguous(), value.contiguous()))


# Linux's MAP_NORESERVE: reserve address space without committing memory.
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def sparse_rows(shape, row_stride, fill, keep):
    """A float32 `[rows, *shape]` view whose row b starts `b * row_stride` elements into an address-space
    reservation (anonymous mmap, no memory committed: only the pages written hold memory), filled from `fill`.
    The view starts 2^31 elements in, so that an offset wrapped to a negative int32 reads zeros (a wrong result)
    instead of unmapped memory (a crash). `keep` holds the mapping alive for the test."""
    inner, lead = math.prod(shape), 2**31
    length = (lead + (fill.shape[0] - 1) * row_stride + inner) * 4
    buffer = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
    keep.append(buffer)
    strides = [row_stride] + [math.prod(shape[i + 1:]) for i in range(len(shape))]
    view = torch.frombuffer(buffer, dtype=torch.float32).as_strided((fill.shape[0], *shape), strides, lead)
    return view.copy_(fill)


ROW_STRIDE = 2**30 + 2**20  # fits int32 (it is passed as one); row 2 starts past 2^31 elements


@pytest.mark.skipif(not sys.platform.startswith("linux") or DEVICE != "cpu",
                    reason="reserves 17 GB of address space with MAP_NORESERVE (Linux, interpreter)")
def test_offsets_past_two_to_the_31_are_int64():
    """Caches whose row offsets pass 2^31 elements (a 1M-token cache of 8 kv heads x 128 dims does at batch 2):
    every kernel computes its offsets in int64. Only the touched pages of the huge views hold memory."""
    keep = []
    generator = torch.Generator().manual_seed(8)
    batch, positions_count, kv_heads, head_dim, pool_size = 3, 24, 2, 16, 4
    storage = torch.randn(batch, positions_count, kv_heads, head_dim, generator=generator)
    key = sparse_rows((positions_count, kv_heads, head_dim), ROW_STRIDE, storage, keep).transpose(1, 2)
    value = sparse_rows((positions_count, kv_heads, head_dim), ROW_STRIDE, storage.flip(1), keep).transpose(1, 2)
    assert key.stride(0) * (batch - 1) > 2**31 > key.stride(0)
    query = torch.randn(batch, kv_heads * 2, 5, head_dim, generator=generator)
    positions = torch.arange(19, 24).expand(batch, 5)
    selected = random_selection((positions + 1) // pool_size, 3, generator)
    check_attention(query, key, value, selected, positions, pool_size, True, generator,
                    reference_inputs=(query, key.contiguous(), value.contiguous()))

    index_queries = torch.randn(batch, 2, 2, head_dim, generator=generator)
    pooled = sparse_rows((40, head_dim), ROW_STRIDE, torch.randn(batch, 40, head_dim, generator=generator), keep)
    num_visible = torch.tensor([[40, 31]] * batch)
    expected = pooled_index_topk_torch(index_queries, pooled.contiguous(), num_visible, 6)
    assert torch.equal(pooled_index_topk_triton(index_queries, pooled, num_visible, 6), expected)


class HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records operators that make the host wait for the device (a value read back, a data-dependent shape)."""

    NAMES = ("_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "equal")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0].startswith(self.NAMES):
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_a_decode_step_reads_nothing_back_to_the_host():
    generator = torch.Generator().manual_seed(9)
    batch, heads, head_dim, pool_size, capacity = 2, 4, 16, 4, 64
    index_queries, pooled_keys = torch.randn(batch, 1, 2, 16), torch.randn(batch, capacity // pool_size, 16)
    num_visible = torch.tensor([[13], [9]])
    query = torch.randn(batch, heads, 1, head_dim, generator=generator)
    key = torch.randn(batch, capacity, 2, head_dim, generator=generator).transpose(1, 2)
    positions = torch.tensor([[53], [38]])
    with HostReads() as reads:
        selected = pooled_index_topk_triton(*to_device(index_queries, pooled_keys, num_visible), 4)
        sparse_attention_triton(*to_device(query, key, key), selected, positions.to(DEVICE), pool_size, 0.25)
    assert reads.seen == []
    with HostReads() as reads:  # the counter does see a read
        int(num_visible.max())
    assert reads.seen


LATENT_CASES = [  # batch, queries, heads, latent_dim, pool_size, context, topk
    (1, 1, 4, 32, 4, 400, 16),    # decode far past the budget, fewer heads than a program's rows
    (3, 1, 40, 48, 16, 300, 4),   # GLM's r = 16, heads over two programs, a latent width not a power of two
    (2, 9, 16, 32, 4, 70, 40),    # a prefill whose budget is above what is visible
]


@pytest.mark.parametrize("batch, queries, heads, latent_dim, pool_size, context, topk", LATENT_CASES)
def test_sparse_latent_attention_matches_reference(batch, queries, heads, latent_dim, pool_size, context, topk):
    """MLA's absorbed shape: every head over one latent that is the key and the value; split or not."""
    from hybrid_indexpool.kernels.sparse_attention import sparse_latent_attention_torch, sparse_latent_attention_triton

    generator, positions, real, context = layout(batch, queries, pool_size, context, seed=11)
    num_visible = torch.where(real, (positions + 1) // pool_size, 0)
    selected = random_selection(num_visible, topk, generator)
    query = torch.randn(batch, heads, queries, latent_dim, generator=generator)
    # The cache's layout: [batch, capacity, 1, latent] storage seen as [batch, 1, positions, latent].
    latents = torch.randn(batch, context + 8, 1, latent_dim, generator=generator).transpose(1, 2)[:, :, :context]
    scaling = 24**-0.5
    expected, _ = sparse_latent_attention_torch(query, latents, selected, positions, pool_size, scaling)
    for num_splits in (1, 3, None):
        output = sparse_latent_attention_triton(*to_device(query, latents, selected, positions), pool_size, scaling,
                                                num_splits=num_splits)
        torch.testing.assert_close(output.cpu()[real], expected[real], atol=1e-4, rtol=1e-4)


def test_sparse_latent_attention_bfloat16_inputs_run_the_gpu_tiles():
    """bfloat16 latents and queries at GLM's r = 16 take the 16-bit tile shapes (upcast in the interpreter): the output
    matches the reference on the same values in float32, to bfloat16 rounding."""
    from hybrid_indexpool.kernels.sparse_attention import sparse_latent_attention_torch, sparse_latent_attention_triton

    generator, positions, real, context = layout(2, 1, 16, 260, seed=12)
    selected = random_selection(torch.where(real, (positions + 1) // 16, 0), 6, generator)
    query = torch.randn(2, 64, 1, 64, generator=generator).bfloat16()
    latents = torch.randn(2, 1, context, 64, generator=generator).bfloat16()
    expected, _ = sparse_latent_attention_torch(query.float(), latents.float(), selected, positions, 16, 0.125)
    output = sparse_latent_attention_triton(*to_device(query, latents, selected, positions), 16, 0.125)
    assert output.dtype == torch.bfloat16
    torch.testing.assert_close(output.cpu().float(), expected, atol=2e-2, rtol=2e-2)
