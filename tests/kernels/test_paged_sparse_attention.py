"""Paged IndexPool sparse attention (the vLLM plugin's keys and values in vLLM's pages): the PyTorch reference against
the unpaged reference on the same keys/values laid out contiguously per request, the Triton kernel (in the
interpreter on CPU, float32) and the CPU kernel (float32 and bfloat16) against the reference, and none reading a
value back to the host.
"""

import shutil

import pytest
import torch
from host_sync import HostSyncGuard

from hybrid_indexpool.kernels import sparse_attention
from hybrid_indexpool.kernels.cpu_build import ENABLE_VARIABLE
from hybrid_indexpool.kernels.sparse_attention import (
    cpu_impl,
    paged_sparse_attention,
    paged_sparse_attention_torch,
    paged_sparse_attention_triton,
    sparse_attention_torch,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(paged_sparse_attention_triton is None, reason="Triton is not installed")
needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler on this machine")


def paged_step(lengths, new_tokens, kv_heads, group, head_dim, pool_size, block_size, topk, seed, dtype=torch.float32,
               order=None):
    """One step of several requests: request `q` holds `lengths[q]` positions, the last `new_tokens[q]` of them this
    step's tokens (1: a decode, more: a prefill chunk), flattened in request order `order`.

    Keys and values are laid out contiguously per request (`[requests, kv_heads, max_length, dim]`) and scattered over
    shuffled pages of one `[blocks, kv_heads, block_size, 2 * dim]` cache (keys, then values, as vLLM's), block 0
    unused (vLLM's null block, also the padding of the block table), unused rows NaN (vLLM's pages start
    uninitialised: nothing may read them into a result). Each token selects up to `topk` of its complete windows at
    random (ascending, -1 after the last); a request whose length is a multiple of `r` gives its last token no window,
    so that it has nothing to attend to.
    """
    generator = torch.Generator().manual_seed(seed)
    num_requests, max_length = len(lengths), max(lengths)
    pages_per_request = [-(-length // block_size) for length in lengths]
    num_blocks = 1 + sum(pages_per_request) + 2  # the null block, the requests' pages, two spare ones
    contiguous_key = torch.randn(num_requests, kv_heads, max_length, head_dim, generator=generator)
    contiguous_value = torch.randn(num_requests, kv_heads, max_length, head_dim, generator=generator)
    cache = torch.full((num_blocks, kv_heads, block_size, 2 * head_dim), float("nan"))
    block_table = torch.zeros(num_requests, max(pages_per_request) + 1, dtype=torch.int64)
    pages = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()
    for request, length in enumerate(lengths):
        for column in range(pages_per_request[request]):
            page = pages.pop()
            block_table[request, column] = page
            positions = slice(column * block_size, min(length, (column + 1) * block_size))
            rows = positions.stop - positions.start
            cache[page, :, :rows, :head_dim] = contiguous_key[request, :, positions]
            cache[page, :, :rows, head_dim:] = contiguous_value[request, :, positions]
    # The pages really are shuffled: no request's positions follow the blocks' order.
    assert any(torch.any(row[:count].diff() != 1) for row, count in zip(block_table, pages_per_request) if count > 1)

    token_request, query_positions = [], []
    for request in order or range(num_requests):
        token_request += [request] * new_tokens[request]
        query_positions += range(lengths[request] - new_tokens[request], lengths[request])
    token_request, query_positions = torch.tensor(token_request), torch.tensor(query_positions)
    num_tokens, heads = len(token_request), kv_heads * group
    selected = torch.full((num_tokens, topk), -1, dtype=torch.int64)
    for token, position in enumerate(query_positions.tolist()):
        visible = (position + 1) // pool_size
        count = min(topk, visible) - (token % 3 == 1)  # some tokens select fewer windows than they could
        selected[token, : max(count, 0)] = torch.randperm(visible, generator=generator)[: max(count, 0)].sort().values
    empty = [token for token, position in enumerate(query_positions.tolist())
             if (position + 1) % pool_size == 0 and token_request[token] == 0 and position == lengths[0] - 1]
    selected[empty] = -1
    query = torch.randn(num_tokens, heads, head_dim, generator=generator)
    # The model's gate: the second half of each head's query projection, a strided view.
    gate = torch.randn(num_tokens, heads, 2 * head_dim, generator=generator).chunk(2, dim=-1)[1]
    return dict(query=query.to(dtype), cache=cache.to(dtype), block_table=block_table, token_request=token_request,
                selected=selected, positions=query_positions, gate=gate.to(dtype), empty=empty,
                contiguous=(contiguous_key.to(dtype), contiguous_value.to(dtype)))


def paged_args(step, block_table=None):
    """The entry points' arguments but `pool_size`, `scaling` and the gate: vLLM's key and value views of one cache."""
    head_dim = step["query"].shape[-1]
    cache = step["cache"]
    return (step["query"], cache[..., :head_dim], cache[..., head_dim:],
            step["block_table"] if block_table is None else block_table, step["token_request"], step["selected"],
            step["positions"])


def unpaged_expected(step, pool_size, scaling, gated):
    """The unpaged reference, request by request, on the contiguous keys/values."""
    query, token_request = step["query"], step["token_request"]
    contiguous_key, contiguous_value = step["contiguous"]
    output = torch.zeros_like(query)
    for request in range(contiguous_key.shape[0]):
        tokens = (token_request == request).nonzero().flatten()
        if len(tokens) == 0:
            continue
        result, _ = sparse_attention_torch(query[tokens].transpose(0, 1)[None], contiguous_key[request: request + 1],
                                           contiguous_value[request: request + 1], step["selected"][tokens][None],
                                           step["positions"][tokens][None], pool_size, scaling)
        output[tokens] = result[0]
    return output * torch.sigmoid(step["gate"]) if gated else output


STEP = dict(lengths=[36, 23, 61, 5], new_tokens=[1, 7, 1, 5], order=[2, 0, 1, 3])


def test_reference_gathers_windows_from_caches_of_any_layout():
    """Keys and values whose blocks and heads cannot merge into one row index (heads outermost in memory) are
    gathered window by window through their strides: the same attention as from vLLM's layout."""
    step = paged_step(**STEP, kv_heads=2, group=2, head_dim=8, pool_size=4, block_size=12, topk=3, seed=21)
    expected = paged_sparse_attention_torch(*paged_args(step), 4, 0.3, step["gate"])
    heads_outermost = step["cache"].transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    with pytest.raises(RuntimeError):
        heads_outermost[..., :8].view(-1, 4, 8)
    got = paged_sparse_attention_torch(*paged_args({**step, "cache": heads_outermost}), 4, 0.3, step["gate"])
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("block_size", [16, 12])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("pool_size", [1, 4])
def test_reference_matches_unpaged_attention_on_contiguous_keys(pool_size, group, block_size, gated):
    """Decodes and prefill chunks of four requests over shuffled pages; a request's keys in a page count not a power
    of two (12); selections padded with -1; a token with nothing to attend to outputs zeros."""
    step = paged_step(**STEP, kv_heads=2, group=group, head_dim=8, pool_size=pool_size, block_size=block_size, topk=5,
                      seed=pool_size * 100 + group * 10 + block_size)
    scaling = 8**-0.5
    gate = step["gate"] if gated else None
    got = paged_sparse_attention_torch(*paged_args(step), pool_size, scaling, gate)
    expected = unpaged_expected(step, pool_size, scaling, gated)
    assert got.shape == step["query"].shape and got.dtype == step["query"].dtype
    torch.testing.assert_close(got, expected)
    assert step["empty"] and torch.all(got[step["empty"]] == 0)
    assert got.abs().sum(dim=(1, 2)).gt(0).sum() == len(got) - len(step["empty"])
    # Read in the blocks' order instead of through the table, the same cache gives another result.
    in_order = torch.arange(step["block_table"].numel()).view_as(step["block_table"]) + 1
    in_order = in_order.clamp(max=step["cache"].shape[0] - 1)
    wrong = paged_sparse_attention_torch(*paged_args(step, in_order), pool_size, scaling, gate)
    assert not torch.allclose(wrong, expected, atol=1e-3)


def test_reference_bounds_memory_by_its_query_chunk(monkeypatch):
    """Chunks of queries give the same result as one chunk (the reference gathers `PAGED_QUERY_CHUNK` tokens at a
    time), and the dispatching entry takes the reference on CPU tensors when the CPU kernels are off."""
    from hybrid_indexpool.kernels.sparse_attention import reference

    step = paged_step(**STEP, kv_heads=1, group=2, head_dim=8, pool_size=4, block_size=12, topk=4, seed=3)
    whole = paged_sparse_attention_torch(*paged_args(step), 4, 0.3, step["gate"])
    monkeypatch.setattr(reference, "PAGED_QUERY_CHUNK", 3)
    chunked = paged_sparse_attention_torch(*paged_args(step), 4, 0.3, step["gate"])
    torch.testing.assert_close(chunked, whole, rtol=0, atol=0)
    monkeypatch.setenv(ENABLE_VARIABLE, "0")
    torch.testing.assert_close(paged_sparse_attention(*paged_args(step), 4, 0.3, step["gate"]), whole, rtol=0, atol=0)


def request_tiles(step, width: int, tiled_requests: set, num_positions: int, group_reads=None):
    """`RequestTiles` of a step: the tokens of `tiled_requests` in tiles of `width` (the last token repeated), the
    others on their own; tiles in one group reading `num_positions`, or (`group_reads`) in groups by the positions
    through their last query rounded up to a multiple of `group_reads`."""
    from hybrid_indexpool.kernels.sparse_attention import RequestTiles, TileGroup

    tiles_by_read = {}
    others = []
    for request in range(len(step["block_table"])):
        owned = (step["token_request"] == request).nonzero()[:, 0].tolist()
        if request not in tiled_requests:
            others += owned
            continue
        for start in range(0, len(owned), width):
            chunk = owned[start:start + width]
            read = num_positions
            if group_reads:
                read = -(-(int(step["positions"][chunk[-1]]) + 1) // group_reads) * group_reads
            tiles_by_read.setdefault(read, []).append((request, chunk))
    groups = []
    for read, tiles in sorted(tiles_by_read.items()):
        tokens, places = [], []
        for number, (_, chunk) in enumerate(tiles):
            tokens += chunk
            places += range(number * width, number * width + len(chunk))
        groups.append(TileGroup(torch.tensor([chunk + [chunk[-1]] * (width - len(chunk)) for _, chunk in tiles]),
                                torch.tensor([request for request, _ in tiles]), torch.tensor(tokens),
                                torch.tensor(places), read))
    return RequestTiles(tuple(groups), torch.tensor(sorted(others), dtype=torch.long), num_positions)


@pytest.mark.parametrize("pool_size, block_size", [(4, 12), (1, 16)])
def test_reference_reading_each_requests_positions_once_gives_the_gathered_attention(pool_size, block_size,
                                                                                      monkeypatch):
    """With `RequestTiles` the reference reads a request's positions once per tile of its queries (and once per other
    query) and masks them to each query's windows and tail: the same attention as gathering each query's positions,
    for tiles with repeated rows, decodes and a token with nothing to attend to; beyond the dense bound it gathers."""
    from hybrid_indexpool.kernels.sparse_attention import reference

    # Every request of this step within both bounds.
    monkeypatch.setattr(reference, "DENSE_POSITIONS_PER_SELECTED", {"tiles": 100, "alone": 100})
    # The tiles read unwritten (NaN) rows: in the requests' last pages and the block table's padding.
    step = paged_step(**STEP, kv_heads=2, group=2, head_dim=8, pool_size=pool_size, block_size=block_size, topk=3,
                      seed=11)
    gathered = paged_sparse_attention_torch(*paged_args(step), pool_size, 0.3, step["gate"])
    multi_token = {request for request, count in enumerate(STEP["new_tokens"]) if count > 1}
    num_positions = max(STEP["lengths"])
    tiles = request_tiles(step, 4, multi_token, num_positions)
    assert len(tiles.groups[0].tokens) and len(tiles.other_tokens)
    assert (tiles.groups[0].tile_tokens[:, -1] == tiles.groups[0].tile_tokens[:, -2]).any()  # a repeated row
    dense = paged_sparse_attention_torch(*paged_args(step), pool_size, 0.3, step["gate"], tiles)
    assert not gathered.isnan().any()
    torch.testing.assert_close(dense, gathered, rtol=1e-5, atol=1e-5)
    assert torch.all(dense[step["empty"]] == 0)
    # Tiles in groups, each reading only through its last query's (rounded up): the same.
    grouped = request_tiles(step, 4, multi_token, num_positions, group_reads=8)
    assert len(grouped.groups) > 1 and any(group.num_positions < max(STEP["lengths"]) for group in grouped.groups)
    torch.testing.assert_close(paged_sparse_attention_torch(*paged_args(step), pool_size, 0.3, step["gate"], grouped),
                               gathered, rtol=1e-5, atol=1e-5)
    # Another tile width, and one over every request: the same.
    torch.testing.assert_close(paged_sparse_attention_torch(
        *paged_args(step), pool_size, 0.3, step["gate"], request_tiles(step, 3, set(range(4)), num_positions)),
        gathered, rtol=1e-5, atol=1e-5)
    # Past a bound its tokens gather: bit for bit the gathered result for them.
    monkeypatch.setattr(reference, "DENSE_POSITIONS_PER_SELECTED", {"tiles": 100, "alone": 0})
    mixed = paged_sparse_attention_torch(*paged_args(step), pool_size, 0.3, step["gate"], tiles)
    assert torch.equal(mixed[tiles.other_tokens], gathered[tiles.other_tokens])
    torch.testing.assert_close(mixed, gathered, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(reference, "DENSE_POSITIONS_PER_SELECTED", {"tiles": 0, "alone": 0})
    every_one_gathered = paged_sparse_attention_torch(*paged_args(step), pool_size, 0.3, step["gate"], grouped)
    torch.testing.assert_close(every_one_gathered, gathered, rtol=1e-6, atol=1e-6)


def run_triton(step, pool_size, scaling, gated, num_splits=None, int32_table=False):
    args = [None if t is None else t.to(DEVICE) for t in paged_args(step)]
    if int32_table:
        args[3] = args[3].int()
    gate = step["gate"].to(DEVICE) if gated else None
    return paged_sparse_attention_triton(*args, pool_size, scaling, gate, num_splits).cpu()


def recorded_launches(monkeypatch):
    """The kernels each Triton call runs, with their grids."""
    from hybrid_indexpool.kernels.sparse_attention import triton_impl

    launches, run = [], triton_impl._run
    monkeypatch.setattr(triton_impl, "_run", lambda planned: (launches.append(planned), run(planned)))
    return launches


@needs_triton
@pytest.mark.parametrize("gated", [False, True])
def test_triton_decode_with_splits_matches_reference(monkeypatch, gated):
    """Decodes of three requests (48-row pages, 36 windows: the list spans three splits of 16 windows, merged by the
    combine kernel, some splits seeing nothing), the gate in the combine's store."""
    step = paged_step(lengths=[164, 150, 133], new_tokens=[1, 1, 1], kv_heads=2, group=2, head_dim=16, pool_size=4,
                      block_size=48, topk=36, seed=11, order=[1, 2, 0])
    scaling = 0.25
    expected = paged_sparse_attention_torch(*paged_args(step), 4, scaling, step["gate"] if gated else None)
    launches = recorded_launches(monkeypatch)
    got = run_triton(step, 4, scaling, gated, num_splits=3, int32_table=True)
    [(forward, combine)] = launches
    assert forward.grid == (3, 2, 3) and combine.kernel.__name__ == "_combine_splits_kernel"
    assert combine.options.get("GATED", False) == gated and not forward.options.get("GATED", False)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # One split: another schedule of the same sums.
    torch.testing.assert_close(run_triton(step, 4, scaling, gated, num_splits=1), expected, atol=1e-5, rtol=1e-5)
    # Splits of less than a tile (how a batch of one fills a GPU): at least as many as asked, here a window each.
    launches.clear()
    torch.testing.assert_close(run_triton(step, 4, scaling, gated, num_splits=20), expected, atol=1e-5, rtol=1e-5)
    [(forward, _)] = launches
    assert forward.grid == (3, 2, 37)


@needs_triton
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("pool_size, group", [(4, 4), (1, 1)])
def test_triton_prefill_matches_reference(monkeypatch, pool_size, group, gated):
    """A mixed step (decodes and prefill chunks, a token with nothing to attend to) over 12-row pages, unsplit: the
    gate in the forward's store."""
    step = paged_step(**STEP, kv_heads=2, group=group, head_dim=16, pool_size=pool_size, block_size=12, topk=5,
                      seed=pool_size + group)
    scaling = 0.25
    expected = paged_sparse_attention_torch(*paged_args(step), pool_size, scaling, step["gate"] if gated else None)
    launches = recorded_launches(monkeypatch)
    got = run_triton(step, pool_size, scaling, gated)
    [(forward,)] = launches
    assert forward.grid[2] == 1 and forward.options["PAGED"] and forward.options.get("GATED", False) == gated
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.all(got[step["empty"]] == 0)


def test_the_guard_catches_host_reads():
    tensor = torch.ones(3)
    for read in (lambda: tensor.sum().item(), lambda: bool(tensor[0]), lambda: tensor[tensor > 0],
                 lambda: torch.nonzero(tensor), lambda: tensor.tolist()):
        with pytest.raises(AssertionError, match="host sync|boolean-mask"), HostSyncGuard():
            read()


@pytest.mark.parametrize("path", ["reference", "cpu_kernel", pytest.param("triton", marks=needs_triton)])
def test_no_host_sync_and_shapes_independent_of_values(path, monkeypatch):
    """After its inputs are built, a call reads nothing back from the device (the Triton entry: its planning, split
    count and allocations), and runs the same operators with the same shapes for other positions, selections and
    pages: it can be captured in a CUDA graph."""
    if path == "reference":
        monkeypatch.setenv(ENABLE_VARIABLE, "0")
    traces = []
    for seed, lengths in ((5, [30, 23, 61, 5]), (6, [35, 14, 70, 12])):  # the same page counts
        step = paged_step(lengths=lengths, new_tokens=[1, 7, 1, 5], kv_heads=2, group=2, head_dim=16, pool_size=4,
                          block_size=12, topk=3, seed=seed)
        args = [t.to(DEVICE) for t in paged_args(step)]
        gate = step["gate"].to(DEVICE)
        for num_splits in (None, 2):
            with HostSyncGuard() as guard:
                if path == "triton":
                    output = paged_sparse_attention_triton(*args, 4, 0.25, gate, num_splits)
                else:
                    output = paged_sparse_attention(*args, 4, 0.25, gate)
            assert output.shape == step["query"].shape
            traces.append(guard.trace)
    assert traces[0] and all(trace == traces[0] for trace in traces[1:] if path != "triton")
    assert traces[0] == traces[2] and traces[1] == traces[3]


# bfloat16 outputs: the reference rounds the same float32 sums, summed in another order here.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def kernel_output(step, pool_size, scaling, gate=None):
    return cpu_impl.paged_sparse_attention_cpu(*paged_args(step), pool_size, scaling, gate)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pool_size, block_size", [(4, 12), (4, 16), (1, 16)])
@pytest.mark.parametrize("group", [1, 4, 6])
def test_kernel_matches_reference(dtype, pool_size, block_size, group):
    """Decodes and prefill chunks of four requests in a shuffled order; groups of 1, 4 and 4 + 2 query heads per
    key/value head; a head dimension with a tail past the vector lanes (20); the gate; NaN rows never read."""
    step = paged_step(**STEP, kv_heads=2, group=group, head_dim=20, pool_size=pool_size, block_size=block_size,
                      topk=5, seed=group * 10 + pool_size, dtype=dtype)
    expected = paged_sparse_attention_torch(*paged_args(step), pool_size, 0.3, step["gate"])
    got = kernel_output(step, pool_size, 0.3, step["gate"])
    assert got.dtype == dtype and got.shape == step["query"].shape and not got.isnan().any()
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    assert step["empty"] and torch.all(got[step["empty"]] == 0)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_chunks_and_a_tail_of_the_head_dimension(dtype):
    """A head dimension of four whole chunks of 16 (read as vectors, bfloat16 pairs split into even and odd elements
    and put back in order) and a tail of 8 (one by one), groups of 3 and 8 query heads (a padded quad, two quads)."""
    for group in (3, 8):
        step = paged_step(**STEP, kv_heads=2, group=group, head_dim=72, pool_size=4, block_size=16, topk=6,
                          seed=group, dtype=dtype)
        expected = paged_sparse_attention_torch(*paged_args(step), 4, 0.3, step["gate"])
        torch.testing.assert_close(kernel_output(step, 4, 0.3, step["gate"]), expected, **TOLERANCE[dtype])


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_selections_rescale_the_running_softmax(dtype):
    """Decodes selecting 40 windows (160 rows and a tail: many chunks of rows), scores spread widely (the running
    maximum grows from chunk to chunk, and rows far below it weigh nothing), head dimension 128 as served."""
    step = paged_step(lengths=[300, 257, 420], new_tokens=[1, 1, 3], kv_heads=2, group=4, head_dim=128, pool_size=4,
                      block_size=64, topk=40, seed=7, dtype=dtype)
    for scaling in (128**-0.5, 2.0):
        expected = paged_sparse_attention_torch(*paged_args(step), 4, scaling)
        # Scores up to about 60 at the larger scaling: their float32 rounding in another order of the sums moves the
        # weights by some 1e-5 relative.
        tolerance = TOLERANCE[dtype] if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kernel_output(step, 4, scaling), expected, **tolerance)


@needs_compiler
def test_block_tables_and_cache_layouts():
    """An int32 block table, a block table that is a view of wider rows (vLLM's persistent buffer), and caches whose
    heads are outermost in memory: the same attention."""
    step = paged_step(**STEP, kv_heads=2, group=2, head_dim=16, pool_size=4, block_size=12, topk=4, seed=5)
    expected = kernel_output(step, 4, 0.3)
    torch.testing.assert_close(expected, paged_sparse_attention_torch(*paged_args(step), 4, 0.3))
    table = step["block_table"]
    wide = torch.zeros(table.shape[0], table.shape[1] + 3, dtype=torch.int32)
    wide[:, : table.shape[1]] = table
    for other_table in (table.int(), wide[:, : table.shape[1]]):
        got = cpu_impl.paged_sparse_attention_cpu(*paged_args(step, other_table), 4, 0.3)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    heads_outermost = step["cache"].transpose(0, 1).contiguous().transpose(0, 1)
    got = kernel_output({**step, "cache": heads_outermost}, 4, 0.3)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@needs_compiler
def test_custom_op_computes_the_direct_call():
    step = paged_step(**STEP, kv_heads=1, group=2, head_dim=8, pool_size=4, block_size=12, topk=3, seed=2)
    direct = cpu_impl.run_paged_window_attention(*paged_args(step), 4, 0.3)
    assert direct.dtype == torch.float32
    torch.testing.assert_close(cpu_impl.paged_window_attention(*paged_args(step), 4, 0.3), direct, rtol=0, atol=0)


@needs_compiler
def test_bad_inputs_say_what_is_wrong():
    step = paged_step(**STEP, kv_heads=1, group=2, head_dim=8, pool_size=4, block_size=12, topk=3, seed=2)
    with pytest.raises(ValueError, match="block size .* multiple of the pool size"):
        cpu_impl.run_paged_window_attention(*paged_args(step), 5, 0.3)
    args = list(paged_args(step))
    args[1], args[2] = args[1].half(), args[2].half()
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_impl.run_paged_window_attention(*args, 4, 0.3)


@needs_compiler
def test_dispatch_sends_cpu_steps_to_the_kernel_unless_switched_off(monkeypatch):
    """`paged_sparse_attention` on CPU tensors runs the kernel (so the metadata builder makes no request tiles);
    with the CPU kernels off, the reference (and the tiles it reads); float16 pages, which the kernel does not take,
    the reference."""
    step = paged_step(**STEP, kv_heads=2, group=2, head_dim=8, pool_size=4, block_size=12, topk=3, seed=4)
    calls = []
    run = cpu_impl.run_paged_window_attention
    monkeypatch.setattr(cpu_impl, "run_paged_window_attention", lambda *args: calls.append(1) or run(*args))
    got = paged_sparse_attention(*paged_args(step), 4, 0.3, step["gate"])
    assert calls and not sparse_attention.paged_attention_reads_request_tiles("cpu")
    torch.testing.assert_close(got, paged_sparse_attention_torch(*paged_args(step), 4, 0.3, step["gate"]))
    calls.clear()
    half = {**step, "cache": step["cache"].half(), "query": step["query"].half()}
    paged_sparse_attention(*paged_args(half), 4, 0.3)
    assert not calls
    monkeypatch.setenv(ENABLE_VARIABLE, "0")
    paged_sparse_attention(*paged_args(step), 4, 0.3, step["gate"])
    assert not calls and sparse_attention.paged_attention_reads_request_tiles("cpu")
