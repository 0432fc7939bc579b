"""The compiled CPU pass of the paged selection (the vLLM plugin's scoring over pooled keys in vLLM's pages) against
the paged PyTorch reference: float32, bfloat16 and packed fp8 pages, NaN in every row no query may see, ties, ranges
of windows shared by threads, forced windows, block tables and cache layouts, the dispatch and the custom op."""

import pytest
import torch
import torch._dynamo.testing

from hybrid_indexpool.kernels.cpu_build import ENABLE_VARIABLE
from hybrid_indexpool.kernels.fp8_index_keys import quantize_pooled_keys, rotate_queries
from hybrid_indexpool.kernels.pooled_index_topk import (
    cpu_impl,
    paged_pooled_index_topk,
    paged_pooled_index_topk_torch,
)
from hybrid_indexpool.kernels.pooled_index_topk.reference import gather_paged_pooled_keys

from .test_paged_pooled_index_topk import STEPS, PagedStep

requires_kernel = pytest.mark.skipif(cpu_impl.KERNEL.load() is None,
                                     reason=f"the CPU kernel could not be built: {cpu_impl.KERNEL.error}")
FP8_NAN_ROW = 0x7F  # float8_e4m3fn NaN


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def poison_unwritten_rows(paged: PagedStep) -> int:
    """NaN in every cache row that holds none of the requests' keys (packed fp8: NaN values and a NaN scale); returns
    how many rows."""
    per_block = paged.cache.shape[1]
    written = torch.zeros(paged.cache.shape[:2], dtype=torch.bool)
    for request, count in enumerate(paged.windows):
        windows = torch.arange(count)
        written[paged.block_table[request, windows // per_block].long(), windows % per_block] = True
    if paged.cache.dtype == torch.uint8:
        nan_row = torch.full((paged.cache.shape[-1],), FP8_NAN_ROW, dtype=torch.uint8)
        nan_row[-4:] = torch.tensor([float("nan")]).view(torch.uint8)
        paged.cache[~written] = nan_row
    else:
        paged.cache[~written] = float("nan")
    return int((~written).sum())


def exact_scores(paged: PagedStep, window_bound: int) -> torch.Tensor:
    """`[tokens, window_bound]` float64 scores of every token against its request's windows (-inf where unseen)."""
    keys = gather_paged_pooled_keys(paged.cache, paged.block_table, paged.token_request, window_bound)
    queries = paged.queries
    if keys.dtype == torch.uint8:
        from hybrid_indexpool.kernels.fp8_index_keys import dequantize_pooled_keys

        keys, queries = dequantize_pooled_keys(keys), rotate_queries(queries)
    per_head = torch.einsum("thd,twd->thw", queries.double(), keys.double()).relu()
    weights = torch.ones_like(paged.queries[..., 0]) if paged.head_weights is None else paged.head_weights
    scores = (per_head * weights.double()[..., None]).sum(1) * paged.queries.shape[-1] ** -0.5
    visible = torch.arange(window_bound) < paged.num_visible[:, None]
    return scores.masked_fill(~visible, float("-inf"))


def assert_same_selection(got, expected, scores=None, topk=None):
    """The selections are identical, except in rows where the scores at the cut tie within float32 rounding (the
    kernel sums in another order than the reference)."""
    differ = (got != expected).any(-1)
    if not differ.any():
        return
    assert scores is not None, f"rows {differ.nonzero().flatten().tolist()} differ"
    best = scores[differ].sort(dim=-1, descending=True).values
    kth, next_ = best[:, topk - 1], best[:, topk]
    assert torch.all((kth - next_).abs() <= 1e-5 * kth.abs().clamp(min=1e-3)), "a selection differs where no tie is"


def kernel_rows(paged, window_bound, topk, sink_windows=0, local_windows=0, segments=1):
    rows = cpu_impl.run_paged_pooled_topk(paged.queries, paged.cache, paged.block_table, paged.tile_tokens,
                                          paged.tile_request, paged.num_visible, paged.head_weights, window_bound,
                                          topk, sink_windows, local_windows, segments)
    return rows[paged.token_tile]


@requires_kernel
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("block_size", [16, 12])
@pytest.mark.parametrize("keys", ["float32", "bfloat16", "fp8"])
def test_matches_the_reference_with_nan_in_every_unwritten_row(two_threads, step, block_size, keys):
    """Decodes and a prefill chunk over several tiles (short tiles repeat their last token), windows per block of 4
    and 3, int64 and int32 tables; every row no query sees is NaN, and the kernel is run with more ranges of windows
    than the threads."""
    paged = PagedStep(*STEPS[step], block_size, fp8=keys == "fp8", seed=block_size + len(keys),
                      table_dtype=torch.int32 if block_size == 12 else torch.int64)
    if keys == "bfloat16":
        paged.queries, paged.cache = paged.queries.bfloat16(), paged.cache.bfloat16()
    assert poison_unwritten_rows(paged) > 0
    scores = exact_scores(paged, 64)
    for topk, (sinks, locals_), segments in ((6, (0, 0), 1), (6, (1, 2), 3), (50, (0, 0), 2)):
        expected = paged_pooled_index_topk_torch(*paged.args(64), topk, paged.head_weights, sinks, locals_)
        got = kernel_rows(paged, 64, topk, sinks, locals_, segments)
        assert_same_selection(got, expected, scores if sinks + locals_ == 0 else None, topk)
        assert torch.all((got < paged.num_visible[:, None]) | (got == -1))


@requires_kernel
@pytest.mark.parametrize("segments", [1, 3])
def test_ties_go_to_the_lower_window(two_threads, segments):
    """Small integers (exact products in any order) and head weights of 1: many equal scores, in every range."""
    paged = PagedStep(*STEPS["mixed"], block_size=16, ties=True, weights=False, seed=4)
    for topk in (1, 6, 20):
        expected = paged_pooled_index_topk_torch(*paged.args(48), topk)
        assert torch.equal(kernel_rows(paged, 48, topk, segments=segments), expected)
    assert paged.tied_at(6) > 0


@requires_kernel
@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_scores_rising_or_falling_along_the_windows(two_threads, order):
    """Rising scores replace the running best at every window (a compaction every topk windows); falling ones never.
    Two requests of one query each, over ranges of windows shared by the threads."""
    windows = 3 * 257
    paged = PagedStep([windows, windows - 100], [1, 1], block_size=64, heads=2, head_dim=8, weights=False)
    ramp = torch.linspace(0.1, 1.0, windows) if order == "ascending" else torch.linspace(1.0, 0.1, windows)
    per_block = paged.cache.shape[1]
    for request, count in enumerate(paged.windows):
        ids = torch.arange(count)
        paged.cache[paged.block_table[request, ids // per_block], ids % per_block, 0] = ramp[:count, None].expand(-1, 8)
    paged.queries = torch.ones_like(paged.queries)
    got = kernel_rows(paged, 1024, 100, segments=4)
    assert torch.equal(got, paged_pooled_index_topk_torch(*paged.args(1024), 100))
    first = torch.arange(windows - 100, windows) if order == "ascending" else torch.arange(100)
    assert torch.equal(got[0], first)


@requires_kernel
def test_wide_tiles_of_many_heads():
    """A prefill chunk of 40 queries in tiles of 16 with 16 index heads of dimension 128 (every query's heads in
    several groups of 4), head weights of any sign."""
    paged = PagedStep([300, 90], [40, 1], block_size=64, heads=16, head_dim=128, seed=9, width=16)
    paged.head_weights = paged.head_weights - 0.5
    poison_unwritten_rows(paged)
    expected = paged_pooled_index_topk_torch(*paged.args(512), 32, paged.head_weights)
    assert_same_selection(kernel_rows(paged, 512, 32, segments=2), expected, exact_scores(paged, 512), 32)


@requires_kernel
def test_block_tables_and_cache_layouts():
    """A block table that is a view of wider rows (vLLM's persistent buffer) and a cache whose rows are a view of
    wider ones: the same selection as a contiguous copy."""
    paged = PagedStep(*STEPS["decode"], block_size=16, seed=3)
    expected = kernel_rows(paged, 64, 8)
    wide_table = torch.zeros(paged.block_table.shape[0], paged.block_table.shape[1] + 5, dtype=torch.int32)
    wide_table[:, : paged.block_table.shape[1]] = paged.block_table
    wide_cache = torch.full((*paged.cache.shape[:-1], 40), float("nan"))
    wide_cache[..., :16] = paged.cache
    paged.block_table, paged.cache = wide_table[:, : paged.block_table.shape[1]], wide_cache[..., :16]
    assert not paged.cache.is_contiguous() and not paged.block_table.is_contiguous()
    assert torch.equal(kernel_rows(paged, 64, 8), expected)


@requires_kernel
def test_custom_op_and_one_graph_under_torch_compile():
    paged = PagedStep(*STEPS["mixed"], block_size=12, seed=6)
    args = (paged.queries, paged.cache, paged.block_table, paged.tile_tokens, paged.tile_request, paged.num_visible,
            paged.head_weights, 48, 6, 1, 1)
    direct = cpu_impl.run_paged_pooled_topk(*args)
    assert torch.equal(cpu_impl.paged_pooled_topk(*args), direct)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    select = torch.compile(paged_pooled_index_topk, backend=counter, fullgraph=True)
    got = select(*paged.args(48), 6, paged.head_weights, 1, 1)
    assert torch.equal(got, paged_pooled_index_topk_torch(*paged.args(48), 6, paged.head_weights, 1, 1))
    assert counter.frame_count == 1


@requires_kernel
def test_dispatch_sends_cpu_selections_to_the_kernel_unless_switched_off(monkeypatch):
    """`paged_pooled_index_topk` on CPU runs the kernel (float32, bfloat16 and fp8 pages); float16 pages, which it
    does not read, the CPU kernels switched off or the PyTorch backend forced run the reference."""
    paged = PagedStep(*STEPS["decode"], block_size=16, seed=2)
    calls = []
    run = cpu_impl.run_paged_pooled_topk
    monkeypatch.setattr(cpu_impl, "run_paged_pooled_topk", lambda *args: calls.append(1) or run(*args))
    expected = paged_pooled_index_topk_torch(*paged.args(64), 8, paged.head_weights)
    assert torch.equal(paged_pooled_index_topk(*paged.args(64), 8, paged.head_weights), expected)
    fp8 = PagedStep(*STEPS["decode"], block_size=16, seed=2, fp8=True)
    paged_pooled_index_topk(*fp8.args(64), 8)
    assert len(calls) == 2
    paged.cache = paged.cache.half()
    paged_pooled_index_topk(*paged.args(64), 8)
    paged.cache = paged.cache.float()
    for variable, value in ((ENABLE_VARIABLE, "0"), ("HYBRID_INDEXPOOL_BACKEND", "torch")):
        with monkeypatch.context() as switched:
            switched.setenv(variable, value)
            assert torch.equal(paged_pooled_index_topk(*paged.args(64), 8, paged.head_weights), expected)
    assert len(calls) == 2


@requires_kernel
def test_bad_inputs_say_what_is_wrong():
    paged = PagedStep(*STEPS["decode"], block_size=16)
    args = [paged.queries, paged.cache, paged.block_table, paged.tile_tokens, paged.tile_request, paged.num_visible,
            None, 64, 4, 0, 0]
    with pytest.raises(ValueError, match="last dimension 8 does not fit queries of dimension 16"):
        cpu_impl.run_paged_pooled_topk(*args[:1], paged.cache[..., :8], *args[2:])
    with pytest.raises(ValueError, match=r"reads paged pooled keys \[blocks, block_size // r, 1, width\]"):
        cpu_impl.run_paged_pooled_topk(*args[:1], paged.cache[:, :, 0], *args[2:])
    packed = quantize_pooled_keys(paged.cache.float())
    with pytest.raises(ValueError, match="packed fp8 keys hold dim \\+ 4 bytes"):
        cpu_impl.run_paged_pooled_topk(*args[:1], packed[..., :-1], *args[2:])


def test_without_a_compiler_the_reference_runs(without_c_compiler):
    without_c_compiler(cpu_impl)
    paged = PagedStep(*STEPS["mixed"], block_size=16, seed=8)
    assert torch.equal(paged_pooled_index_topk(*paged.args(64), 6, paged.head_weights),
                       paged_pooled_index_topk_torch(*paged.args(64), 6, paged.head_weights))
