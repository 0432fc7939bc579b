"""The compiled CPU pass of the decode-time selection against the PyTorch reference."""

import pytest
import torch
import torch._dynamo.testing

from hybrid_indexpool.kernels.pooled_index_topk import cpu_impl, pooled_index_topk, pooled_index_topk_torch

requires_kernel = pytest.mark.skipif(cpu_impl.KERNEL.load() is None,
                                     reason=f"the CPU kernel could not be built: {cpu_impl.KERNEL.error}")


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def selections(index_queries, pooled_keys, num_visible, topk, head_weights=None, sink_windows=0, local_windows=0):
    fused = cpu_impl.pooled_index_topk_cpu(index_queries, pooled_keys, num_visible, topk, head_weights,
                                           sink_windows, local_windows)
    reference = pooled_index_topk_torch(index_queries, pooled_keys, num_visible, topk, head_weights, None,
                                        sink_windows, local_windows)
    return fused, reference


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_head_weights", [False, True])
@pytest.mark.parametrize("queries, heads, dim", [(1, 4, 128), (2, 3, 13), (1, 16, 8)])
def test_matches_the_reference(two_threads, dtype, with_head_weights, queries, heads, dim):
    generator = torch.Generator().manual_seed(queries * 100 + heads * 10 + dim)
    windows = 3 * cpu_impl.WINDOWS_PER_THREAD + 5  # two threads, an odd window count per segment
    index_queries = torch.randn(2, queries, heads, dim, generator=generator)
    pooled_keys = torch.randn(2, windows, dim, generator=generator).to(dtype)
    num_visible = torch.randint(0, windows + 1, (2, queries), generator=generator)
    num_visible[0, 0] = 3  # fewer visible windows than the budget: -1 padding
    head_weights = torch.randn(2, queries, heads, generator=generator) if with_head_weights else None
    fused, reference = selections(index_queries, pooled_keys, num_visible, 64, head_weights)
    assert torch.equal(fused, reference)
    assert (fused[0, 0, 3:] == -1).all()


@requires_kernel
@pytest.mark.parametrize("topk", [1, 7, 300])
def test_ties_go_to_the_lower_window_across_threads(two_threads, topk):
    # Small integers: exact products in any summation order, and many equal scores in every thread's range.
    generator = torch.Generator().manual_seed(topk)
    windows = 2 * cpu_impl.WINDOWS_PER_THREAD + 1
    index_queries = torch.randint(-1, 2, (3, 1, 4, 16), generator=generator).float()
    pooled_keys = torch.randint(-1, 2, (3, windows, 16), generator=generator).float()
    num_visible = torch.tensor([[windows], [windows - 1000], [5]])
    fused, reference = selections(index_queries, pooled_keys, num_visible, topk)
    assert torch.equal(fused, reference)


@requires_kernel
@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_scores_rising_or_falling_along_the_windows(two_threads, order):
    # Rising scores replace the running best at every window (a compaction every topk windows); falling ones never.
    windows = 2 * cpu_impl.WINDOWS_PER_THREAD + 77
    ramp = torch.linspace(0.1, 1.0, windows) if order == "ascending" else torch.linspace(1.0, 0.1, windows)
    pooled_keys = ramp[None, :, None] * torch.ones(1, windows, 8)
    index_queries = torch.ones(1, 1, 2, 8)
    fused, reference = selections(index_queries, pooled_keys, torch.tensor([[windows]]), 100)
    assert torch.equal(fused, reference)
    expected = torch.arange(windows - 100, windows) if order == "ascending" else torch.arange(100)
    assert torch.equal(fused[0, 0], expected)


@requires_kernel
@pytest.mark.parametrize("sink_windows, local_windows", [(1, 0), (0, 2), (2, 3)])
def test_sink_and_local_windows(sink_windows, local_windows):
    generator = torch.Generator().manual_seed(sink_windows + 10 * local_windows)
    index_queries = torch.randn(2, 1, 4, 32, generator=generator)
    pooled_keys = torch.randn(2, 500, 32, generator=generator)
    num_visible = torch.tensor([[500], [4]])
    fused, reference = selections(index_queries, pooled_keys, num_visible, 8, None, sink_windows, local_windows)
    assert torch.equal(fused, reference)
    assert set(range(sink_windows)) <= set(fused[0, 0].tolist())
    assert set(range(500 - local_windows, 500)) <= set(fused[0, 0].tolist())


@requires_kernel
def test_strided_cache_storage_and_nan_rows():
    # The keys as a decode step passes them: a view of a larger reserved store; a NaN row stays in its row.
    generator = torch.Generator().manual_seed(5)
    storage = torch.randn(2, 900, 64, generator=generator)
    storage[1, :600] = float("nan")
    pooled_keys = storage[:, :600]
    index_queries = torch.randn(2, 1, 4, 64, generator=generator)
    num_visible = torch.tensor([[600], [600]])
    fused, reference = selections(index_queries, pooled_keys, num_visible, 32)
    assert torch.equal(fused[0], reference[0])
    clean = cpu_impl.pooled_index_topk_cpu(index_queries[:1], pooled_keys[:1].contiguous(), num_visible[:1], 32)
    assert torch.equal(fused[:1], clean)


@requires_kernel
def test_the_entry_point_uses_it_for_decode_only(monkeypatch):
    calls = []
    original = cpu_impl.run_pooled_topk_windows
    monkeypatch.setattr(cpu_impl, "run_pooled_topk_windows", lambda *args: calls.append(1) or original(*args))
    index_queries, pooled_keys = torch.randn(1, 1, 4, 32), torch.randn(1, 100, 32)
    num_visible = torch.tensor([[100]])
    pooled_index_topk(index_queries, pooled_keys, num_visible, 8)
    assert len(calls) == 1
    pooled_index_topk(index_queries, pooled_keys, num_visible, 8, window_limit=100)  # prefill: the reference
    pooled_index_topk(index_queries.double(), pooled_keys.double(), num_visible, 8)  # float64: the reference
    pooled_index_topk(torch.randn(1, 8, 4, 32), pooled_keys, num_visible.expand(1, 8), 8)  # 32 rows: a GEMM
    monkeypatch.setenv("HYBRID_INDEXPOOL_BACKEND", "torch")
    pooled_index_topk(index_queries, pooled_keys, num_visible, 8)
    assert len(calls) == 1


@requires_kernel
def test_one_graph_under_torch_compile():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    step = torch.compile(pooled_index_topk, backend=counter, fullgraph=True)
    index_queries, pooled_keys = torch.randn(1, 1, 4, 32), torch.randn(1, 300, 32)
    num_visible = torch.tensor([[250]])
    assert torch.equal(step(index_queries, pooled_keys, num_visible, 16),
                       pooled_index_topk_torch(index_queries, pooled_keys, num_visible, 16))
    assert counter.frame_count == 1


@requires_kernel
def test_any_number_of_rows_and_head_dimension_and_bad_keys_refused():
    """Its buffers are allocated per call: 5 queries x 4 heads and a head dimension of 1,100 select as the reference;
    keys whose width does not fit the queries are refused with the reason."""
    generator = torch.Generator().manual_seed(11)
    index_queries = torch.randn(1, 5, 4, 1100, generator=generator)
    pooled_keys = torch.randn(1, 300, 1100, generator=generator)
    num_visible = torch.tensor([[300, 299, 250, 7, 0]])
    fused, reference = selections(index_queries, pooled_keys, num_visible, 16)
    assert torch.equal(fused, reference) and (fused[0, 4] == -1).all()
    with pytest.raises(ValueError, match="last dimension 8 does not fit queries of dimension 16"):
        cpu_impl.run_pooled_topk_windows(torch.randn(1, 4, 16), torch.randn(1, 10, 8), torch.ones(1, 1, 4),
                                         torch.tensor([[10]]), 4, 1, 0, 0)


def test_without_a_compiler_the_reference_runs(without_c_compiler):
    without_c_compiler(cpu_impl)
    index_queries, pooled_keys = torch.randn(1, 1, 4, 32), torch.randn(1, 100, 32)
    num_visible = torch.tensor([[100]])
    assert torch.equal(pooled_index_topk(index_queries, pooled_keys, num_visible, 8),
                       pooled_index_topk_torch(index_queries, pooled_keys, num_visible, 8))
