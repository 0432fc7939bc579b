"""Triton pooled index scores; the selection is the reference's exact top-k over packed (score, window id) keys.

`s[t, c] = sum_h a[t, h] * relu(q[t, h] . k[c]) / sqrt(d)`: a program holds a tile of queries of one row, all their
index heads as the rows of one matrix product, and walks blocks of pooled keys: every key is read once per query tile
for all heads, and the products run on tensor cores (bf16/fp16 products are exact in the float32 accumulator). It
sums the heads and writes one float32 score per (query, window) to scratch. The selection is the reference's own:
`selection_keys` packs score and window id into int64 keys (ties to the lower id, windows at or past the causal bound
`num_visible_windows[b, t]` lowest), `torch.topk` keeps the best, `window_ids_of` sorts the ids, `-1` padded.

Decode (a query per row): the windows are split over enough programs to fill the GPU, the scratch is `[batch, 1,
windows]` float32, and nothing is read back to the host. Prefill: queries go in chunks whose scratch holds at most
`SCRATCH_ELEMENTS` scores. Shared memory and registers depend on the tile sizes only, never on the budget.

Paged (`paged_pooled_index_topk_triton`, a serving step over vLLM's caches): the same kernel with `PAGED` on reads a
tile's queries through its token list and each window's key through the request's block table; the scratch is
`[tiles, width, window_bound]` in chunks of tiles, and every shape and split count follows from the arguments' shapes,
so nothing is read back to the host (CUDA-graph capturable).
"""

import torch

from ..fp8_index_keys import is_packed, packed_width, rotate_queries
from ..launch import PROGRAMS_PER_SM, Launch, dot_precision, multiprocessor_count
from .reference import selection_keys, window_ids_of

try:
    import triton
    import triton.language as tl
except ImportError as error:  # Triton is optional; the package falls back to the PyTorch reference.
    raise ImportError("Triton is not installed") from error

# Float32 scores per prefill chunk (64 MiB). The selection of a chunk adds its int64 keys and their temporaries,
# about 7x that at the peak (~0.5 GiB).
SCRATCH_ELEMENTS = 1 << 24
# Bytes per score of a chunk at the selection's peak: the float32 scores, the int32 sign, the int64 keys, the masks
# of the invisible and forced windows, and the top-k's workspace.
SELECTION_BYTES_PER_SCORE = 28
# Rows (query x head pairs) of a prefill tile, 16-bit and float32 inputs; a decode tile is one query's heads.
TILE_ROWS, TILE_ROWS_FP32 = 128, 64


@triton.jit
def _fp8_e4m3_to_float32(byte):
    """float8_e4m3fn bytes (uint8) -> float32 by integer arithmetic: sm_80 has no fp8 type, and no float32 subnormal
    is formed (the GPU may flush those). A normal value's exponent and mantissa move under float32's bias (+120) by
    one add; a subnormal one is its mantissa times 2^-9."""
    code = byte.to(tl.int32)
    magnitude = code & 0x7F
    normal = ((magnitude + (120 << 3)) << 20).to(tl.float32, bitcast=True)
    value = tl.where(magnitude >= 8, normal, magnitude.to(tl.float32) * 0.001953125)
    return tl.where((code & 0x80) != 0, -value, value)


@triton.jit(do_not_specialize=["num_queries", "num_windows", "windows_per_split", "windows_per_block",
                                "table_columns"])
def _pooled_index_scores_kernel(
    query_ptr, key_ptr, weight_ptr, visible_ptr, score_ptr,
    num_queries, num_windows, windows_per_split, scale,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kc,
    stride_wb, stride_wt, stride_wh,
    stride_vb, stride_vt,
    tile_token_ptr, tile_request_ptr, table_ptr, stride_tile, stride_table, windows_per_block, table_columns,
    HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_W: tl.constexpr, HAS_WEIGHTS: tl.constexpr, FP32: tl.constexpr,
    PRECISION: tl.constexpr, PACKED_FP8: tl.constexpr, PAGED: tl.constexpr = False,
):
    """Scores `[batch, queries, windows]` (float32, contiguous) of one tile of queries over one split of windows;
    windows no query of the tile sees are not written. `PACKED_FP8`: the keys are uint8 rows of `HEAD_DIM` fp8
    bytes and a float32 scale, widened to the queries' dtype for the product (exact) and scaled after it.

    `PAGED` (vLLM's caches; the arguments from `tile_token_ptr` on are None otherwise, so the unpaged compilation
    is what it was): a "batch" row is a tile of one request's queries, `[tiles, width]` tokens at `tile_token_ptr`
    (`num_queries` is the width); queries, head weights and causal bounds are per token (`stride_qt`, `stride_wt`,
    `stride_vt`; the batch strides unused); window `w` is row `w % windows_per_block` (`stride_kc`) of block
    `table[tile_request[tile], w // windows_per_block]` (`stride_kb`), the column clamped to the table's last as
    the reference does."""
    tiles = tl.cdiv(num_queries, BLOCK_Q)
    batch = (tl.program_id(0) // tiles).to(tl.int64)  # int64: offsets pass 2^31 at long contexts and batches
    tile = tl.program_id(0) % tiles
    rows = tl.arange(0, BLOCK_Q * HEADS_PAD)  # query-major (query, head) pairs
    query_index = tile * BLOCK_Q + rows // HEADS_PAD
    head_index = rows % HEADS_PAD
    row_mask = (query_index < num_queries) & (head_index < HEADS)
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < HEAD_DIM
    tile_queries = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)

    if PAGED:  # each row's token through the tile's list; the request's row of the block table
        row_token = tl.load(tile_token_ptr + batch * stride_tile + query_index, mask=row_mask, other=0).to(tl.int64)
        query_rows = query_ptr + row_token[:, None] * stride_qt
        weight_rows = weight_ptr + row_token * stride_wt
        tile_token = tl.load(tile_token_ptr + batch * stride_tile + tile_queries, mask=tile_queries < num_queries,
                             other=0).to(tl.int64)
        visible_rows = visible_ptr + tile_token * stride_vt
        table_row = table_ptr + tl.load(tile_request_ptr + batch).to(tl.int64) * stride_table
    else:
        query_rows = query_ptr + batch * stride_qb + query_index[:, None].to(tl.int64) * stride_qt
        weight_rows = weight_ptr + batch * stride_wb + query_index.to(tl.int64) * stride_wt
        visible_rows = visible_ptr + batch * stride_vb + tile_queries.to(tl.int64) * stride_vt
    queries = tl.load(query_rows + head_index[:, None] * stride_qh + dims[None, :],
                      mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if FP32:
        queries = queries.to(tl.float32)
    if HAS_WEIGHTS:
        weights = tl.load(weight_rows + head_index * stride_wh, mask=row_mask, other=0.0).to(tl.float32) * scale
    else:
        weights = tl.where(row_mask, scale, 0.0)
    visible = tl.load(visible_rows, mask=tile_queries < num_queries, other=0)

    start = tl.program_id(1) * windows_per_split
    end = tl.minimum(tl.minimum(start + windows_per_split, num_windows), tl.max(visible, axis=0).to(tl.int32))
    key_base = key_ptr + batch * stride_kb
    score_rows = score_ptr + (batch * num_queries + tile_queries.to(tl.int64)) * num_windows
    for block_start in range(start, end, BLOCK_W):
        windows = block_start + tl.arange(0, BLOCK_W)
        window_mask = windows < end
        if PAGED:  # each window's block (a page may end inside the block of windows: any block size)
            columns = tl.minimum(windows // windows_per_block, table_columns - 1)
            pages = tl.load(table_row + columns, mask=window_mask, other=0).to(tl.int64)
            key_rows = key_ptr + pages * stride_kb + (windows % windows_per_block).to(tl.int64) * stride_kc
        else:
            key_rows = key_base + windows.to(tl.int64) * stride_kc
        keys = tl.load(key_rows[:, None] + dims[None, :], mask=window_mask[:, None] & dim_mask[None, :], other=0)
        if PACKED_FP8:
            keys = _fp8_e4m3_to_float32(keys).to(queries.dtype)
        elif FP32:
            keys = keys.to(tl.float32)
        per_head = tl.dot(queries, tl.trans(keys), input_precision=PRECISION)  # [BLOCK_Q * HEADS_PAD, BLOCK_W]
        if PACKED_FP8:  # a power of two > 0: scaling the product equals scaling the key, and commutes with the ReLU
            key_scales = tl.load((key_rows + HEAD_DIM).to(tl.pointer_type(tl.float32), bitcast=True),
                                 mask=window_mask, other=0.0)
            per_head = per_head * key_scales[None, :]
        per_head = tl.maximum(per_head, 0.0) * weights[:, None]
        scores = tl.sum(tl.reshape(per_head, (BLOCK_Q, HEADS_PAD, BLOCK_W)), axis=1)
        tl.store(score_rows[:, None] + windows[None, :], scores,
                 mask=(tile_queries < num_queries)[:, None] & window_mask[None, :])


def _tiles_and_splits(num_queries, num_heads, head_dim, dtype, num_rows, num_windows, num_splits, multiprocessors,
                      device, narrow_block_w=None):
    """(block_q, block_w, heads_pad, num_warps, query programs, splits, windows per split) of a score launch over
    `num_rows` rows of `num_queries` queries: from shapes only (and the GPU's size), never from data."""
    heads_pad = triton.next_power_of_2(num_heads)
    # Tiles: up to TILE_ROWS (query, head) rows x 64 windows, 8 warps for 128 rows; float32 inputs (no tensor cores)
    # in smaller tiles. The tiles follow the inputs' dtype, not the interpreter, so that it runs the GPU's shapes.
    wide = dtype == torch.float32
    block_q = max(1, min(triton.next_power_of_2(num_queries), (TILE_ROWS_FP32 if wide else TILE_ROWS) // heads_pad))
    block_w = 32 if wide or head_dim > 128 else 64
    if narrow_block_w is not None:
        block_w = min(block_w, narrow_block_w)
    query_tiles = num_rows * triton.cdiv(num_queries, block_q)
    if num_splits is None:
        multiprocessors = multiprocessors or multiprocessor_count(device)
        num_splits = triton.cdiv(PROGRAMS_PER_SM * multiprocessors, max(1, query_tiles))
    num_splits = max(1, min(num_splits, triton.cdiv(num_windows, block_w), 65535))
    windows_per_split = triton.cdiv(triton.cdiv(num_windows, num_splits), block_w) * block_w
    num_splits = triton.cdiv(num_windows, windows_per_split)
    num_warps = 8 if wide or block_q * heads_pad >= 128 else 4
    return block_q, block_w, heads_pad, num_warps, query_tiles, num_splits, windows_per_split


def _constexprs(num_heads, heads_pad, head_dim, block_q, block_w, head_weights, dtype, packed, num_warps):
    fp32, precision = dot_precision(dtype)
    return dict(HEADS=num_heads, HEADS_PAD=heads_pad, HEAD_DIM=head_dim,
                DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_Q=block_q, BLOCK_W=block_w,
                HAS_WEIGHTS=head_weights is not None, FP32=fp32, PRECISION=precision, PACKED_FP8=packed,
                num_warps=num_warps, num_stages=2)


# Windows per block of a paged launch over packed fp8 keys with tiles of several queries: each key row's address is its
# own 64-bit pointer (its page is data), and widening 64 rows at once beside a tile of 128 (query, head) rows spilled
# on sm_80 (16 index heads x 128, prefill: 128 registers, 2 words). Decode tiles keep 64 (no spill). Float32 tiles
# of several queries (products on CUDA cores, 32 windows) walk 16: at 32, 16 index heads x 64 spilled 2 words on
# sm_90 (64 registers); at 16 every float32 prefill of the AOT matrix takes 42-66 registers, no spills.
PAGED_FP8_BLOCK_W = 32
PAGED_FP32_BLOCK_W = 16

# The paged addressing's arguments of an unpaged launch: None, so that they are constexprs, not parameters.
_UNPAGED = (None,) * 7


def plan_scores(index_queries, pooled_index_keys, visible, head_weights, scores, num_splits=None,
                multiprocessors=None) -> Launch:
    """The launch writing `scores` `[batch, queries, windows]` of `index_queries` `[batch, queries, heads, dim]`
    against `pooled_index_keys` `[batch, windows, dim]`, under the causal bounds `visible` `[batch, queries]`."""
    batch_size, num_queries, num_heads, head_dim = index_queries.shape
    num_windows = scores.shape[-1]
    block_q, block_w, heads_pad, num_warps, query_tiles, num_splits, windows_per_split = _tiles_and_splits(
        num_queries, num_heads, head_dim, index_queries.dtype, batch_size, num_windows, num_splits,
        multiprocessors, index_queries.device)
    weights = head_weights if head_weights is not None else scores  # unread placeholder
    weight_strides = weights.stride() if head_weights is not None else (0, 0, 0)
    return Launch(
        _pooled_index_scores_kernel, (query_tiles, num_splits),
        (index_queries, pooled_index_keys, weights, visible, scores,
         num_queries, num_windows, windows_per_split, head_dim**-0.5,
         *index_queries.stride()[:3], *pooled_index_keys.stride()[:2], *weight_strides, *visible.stride(),
         *_UNPAGED),
        _constexprs(num_heads, heads_pad, head_dim, block_q, block_w, head_weights, index_queries.dtype,
                    is_packed(pooled_index_keys), num_warps),
    )


def plan_paged_scores(index_queries, pooled_key_cache, block_table, tile_tokens, tile_request, num_visible_windows,
                      head_weights, scores, num_splits=None, multiprocessors=None) -> Launch:
    """The launch writing `scores` `[tiles, width, window_bound]` float32 of the tiles `tile_tokens` `[tiles, width]`
    of `index_queries` `[tokens, heads, dim]` (rotated already for packed keys) against their requests'
    (`tile_request [tiles]`) windows in vLLM's paged `pooled_key_cache` `[blocks, block_size // r, 1, width]`
    through `block_table` `[requests, max_blocks]`, under the causal bounds `num_visible_windows` `[tokens]`.
    Windows at or past a tile's largest bound are not written (`selection_keys` masks them)."""
    num_tiles, width = tile_tokens.shape
    _, num_heads, head_dim = index_queries.shape
    num_windows = scores.shape[-1]
    keys = pooled_key_cache[:, :, 0]  # [blocks, windows per block, width]
    several_queries = width > 1
    if several_queries and index_queries.dtype == torch.float32:
        narrow_block_w = PAGED_FP32_BLOCK_W
    elif several_queries and is_packed(pooled_key_cache):
        narrow_block_w = PAGED_FP8_BLOCK_W
    else:
        narrow_block_w = None
    block_q, block_w, heads_pad, num_warps, query_tiles, num_splits, windows_per_split = _tiles_and_splits(
        width, num_heads, head_dim, index_queries.dtype, num_tiles, num_windows, num_splits, multiprocessors,
        index_queries.device, narrow_block_w)
    weights = head_weights if head_weights is not None else scores  # unread placeholder
    weight_strides = (0, *head_weights.stride()) if head_weights is not None else (0, 0, 0)
    return Launch(
        _pooled_index_scores_kernel, (query_tiles, num_splits),
        (index_queries, keys, weights, num_visible_windows, scores,
         width, num_windows, windows_per_split, head_dim**-0.5,
         0, *index_queries.stride()[:2], *keys.stride()[:2], *weight_strides, 0, num_visible_windows.stride(0),
         tile_tokens, tile_request, block_table, tile_tokens.stride(0), block_table.stride(0), keys.shape[1],
         block_table.shape[1]),
        _constexprs(num_heads, heads_pad, head_dim, block_q, block_w, head_weights, index_queries.dtype,
                    is_packed(pooled_key_cache), num_warps) | dict(PAGED=True),
    )


def _last_dim_contiguous(tensor):
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def pooled_index_topk_triton(
    index_queries: torch.Tensor,
    pooled_index_keys: torch.Tensor,
    num_visible_windows: torch.Tensor,
    topk: int,
    head_weights: torch.Tensor | None = None,
    num_splits: int | None = None,
    window_limit: int | None = None,
    sink_windows: int = 0,
    local_windows: int = 0,
) -> torch.Tensor:
    """Triton version of `pooled_index_topk_torch`: same arguments, same result (ids ascending, `-1` padded).

    `num_splits`: programs sharing one query tile's windows (default: enough to fill the GPU). `window_limit`
    (prefill): no query sees a window at or beyond it; the chunks' own causal bounds are then read from the device
    once, so a chunk scores and selects only the windows its queries can see. Without it (decode) nothing is read
    back to the host and every shape is fixed. `sink_windows` / `local_windows`: windows always selected, as in
    the reference.
    """
    batch_size, num_queries, num_heads, head_dim = index_queries.shape
    num_windows = pooled_index_keys.shape[1] if window_limit is None else min(pooled_index_keys.shape[1],
                                                                                window_limit)
    device = index_queries.device
    if num_windows == 0 or num_queries == 0 or topk == 0:
        return torch.full((batch_size, num_queries, topk), -1, dtype=torch.long, device=device)
    if is_packed(pooled_index_keys):
        index_queries = rotate_queries(index_queries)
    index_queries = _last_dim_contiguous(index_queries)
    pooled_index_keys = _last_dim_contiguous(pooled_index_keys[:, :num_windows])
    if head_weights is not None:
        head_weights = _last_dim_contiguous(head_weights)
    chunk = max(1, min(num_queries, SCRATCH_ELEMENTS // (batch_size * num_windows)))
    starts = range(0, num_queries, chunk)
    limits = [num_windows] * len(starts)
    if window_limit is not None and len(starts) > 1:  # one read of every chunk's causal bound
        padded = torch.nn.functional.pad(num_visible_windows, (0, len(starts) * chunk - num_queries))
        limits = padded.view(batch_size, len(starts), chunk).amax(dim=(0, 2)).clamp(max=num_windows).tolist()
    selections = []
    for start, limit in zip(starts, limits):
        end = min(start + chunk, num_queries)
        visible = num_visible_windows[:, start:end]
        if limit <= 0:
            selections.append(torch.full((batch_size, end - start, topk), -1, dtype=torch.long, device=device))
            continue
        scores = torch.empty(batch_size, end - start, limit, dtype=torch.float32, device=device)
        weights = None if head_weights is None else head_weights[:, start:end]
        plan_scores(index_queries[:, start:end], pooled_index_keys, visible, weights, scores, num_splits).run()
        keys = selection_keys(scores, 0, visible[..., None], sink_windows=sink_windows, local_windows=local_windows)
        best = keys if limit <= topk else keys.topk(topk, dim=-1, sorted=False).values
        selections.append(window_ids_of(best, topk))
    return selections[0] if len(selections) == 1 else torch.cat(selections, dim=1)


def paged_pooled_index_topk_triton(
    index_queries: torch.Tensor,
    pooled_key_cache: torch.Tensor,
    block_table: torch.Tensor,
    tile_tokens: torch.Tensor,
    tile_request: torch.Tensor,
    token_tile: torch.Tensor | None,
    num_visible_windows: torch.Tensor,
    window_bound: int,
    topk: int,
    head_weights: torch.Tensor | None = None,
    sink_windows: int = 0,
    local_windows: int = 0,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton version of `paged_pooled_index_topk_torch`: same arguments, same result (`[tokens, topk]` ids
    ascending, `-1` padded). The scores of a chunk of tiles (at most `SCRATCH_ELEMENTS` of them) come from the paged
    score kernel; the selection is the reference's `selection_keys`, `torch.topk` and `window_ids_of`. Every shape
    and the chunks follow from (tokens, tiles, width, window_bound, topk); nothing is read back to the host, so a
    step can be captured in a CUDA graph. `num_splits`: programs sharing a tile's windows (default: enough to fill
    the GPU)."""
    num_tokens = index_queries.shape[0]
    num_tiles, width = tile_tokens.shape
    device = index_queries.device
    if num_tokens == 0 or num_tiles == 0 or topk == 0 or window_bound == 0:
        rows = num_tokens if token_tile is not None else num_tiles * width
        return torch.full((rows, topk), -1, dtype=torch.long, device=device)
    if is_packed(pooled_key_cache):
        index_queries = rotate_queries(index_queries)
    index_queries = _last_dim_contiguous(index_queries)
    tile_tokens, tile_request = _last_dim_contiguous(tile_tokens), _last_dim_contiguous(tile_request)
    if head_weights is not None:
        head_weights = _last_dim_contiguous(head_weights)
    if pooled_key_cache.stride(-1) != 1:
        raise ValueError("The pooled-key cache's rows must be contiguous.")
    chunk = max(1, SCRATCH_ELEMENTS // (width * window_bound))
    selected = []
    for start in range(0, num_tiles, chunk):
        tokens = tile_tokens[start:start + chunk]
        scores = torch.empty(tokens.shape[0], width, window_bound, dtype=torch.float32, device=device)
        plan_paged_scores(index_queries, pooled_key_cache, block_table, tokens, tile_request[start:start + chunk],
                          num_visible_windows, head_weights, scores, num_splits).run()
        keys = selection_keys(scores, 0, num_visible_windows[tokens][..., None], sink_windows=sink_windows,
                              local_windows=local_windows)
        if window_bound > topk:
            keys = keys.topk(topk, dim=-1, sorted=False).values
        selected.append(window_ids_of(keys, topk))
    rows = torch.cat(selected).flatten(0, 1)  # [tiles * width, topk]
    return rows if token_tile is None else rows[token_tile]


def paged_selection_peak_bytes(num_rows: int, width: int, window_bound: int, topk: int) -> int:
    """Temporary bytes of `paged_pooled_index_topk_triton` at its peak for `num_rows` tile rows of `width` queries
    scored against `window_bound` windows: one chunk of tiles' scores and selection keys (`SCRATCH_ELEMENTS` scores
    or one tile's), and every row's selected ids."""
    num_tiles = -(-num_rows // width)
    chunk = min(num_tiles, max(1, SCRATCH_ELEMENTS // (width * window_bound)))
    return chunk * width * window_bound * SELECTION_BYTES_PER_SCORE + 3 * num_rows * topk * 8


# Queries per tile of a serving step (the serving layer's `QUERY_TILE`, which this module cannot import: vLLM) and the
# paged cache's block size the compiled launches are planned with (a runtime value: any block size compiles the same).
AOT_TILE_WIDTH = 64
AOT_BLOCK_SIZE = 64


def aot_launches(sizes) -> list[tuple[str, Launch]]:
    """The score kernel's launches at `sizes` (an `aot.ModelSizes`), on meta tensors: decode is one query per row
    over a full context, prefill a chunk of queries; unpaged, and paged as a serving step has them (decode: a tile
    of one query per request; prefill: tiles of `AOT_TILE_WIDTH` queries of one request)."""
    if sizes.kernels == "attention":
        return []
    meta = dict(device="meta", dtype=sizes.dtype)
    num_windows = sizes.context // sizes.pool_size
    num_queries = 1 if sizes.mode == "decode" else sizes.queries
    batch_size = sizes.batch if sizes.mode == "decode" else 1
    index_queries = torch.empty(batch_size, num_queries, sizes.index_heads, sizes.index_head_dim, **meta)
    key_width = packed_width(sizes.index_head_dim) if sizes.index_keys == "fp8" else sizes.index_head_dim
    key_dtype = torch.uint8 if sizes.index_keys == "fp8" else sizes.dtype
    keys = torch.empty(batch_size, num_windows, key_width, dtype=key_dtype, device="meta")
    visible = torch.empty(batch_size, num_queries, dtype=torch.int64, device="meta")
    weights = torch.empty(batch_size, num_queries, sizes.index_heads, device="meta")
    chunk = max(1, min(num_queries, SCRATCH_ELEMENTS // (batch_size * num_windows)))
    scores = torch.empty(batch_size, chunk, num_windows, device="meta")
    launches = [("pooled_index_scores",
                 plan_scores(index_queries[:, :chunk], keys, visible[:, :chunk], weights[:, :chunk], scores,
                             multiprocessors=sizes.multiprocessors))]

    num_tokens = batch_size * num_queries
    width = 1 if sizes.mode == "decode" else AOT_TILE_WIDTH
    num_tiles = batch_size if sizes.mode == "decode" else triton.cdiv(num_queries, width)
    windows_per_block = AOT_BLOCK_SIZE // sizes.pool_size
    max_blocks = triton.cdiv(num_windows, windows_per_block)
    cache = torch.empty(batch_size * max_blocks + 1, windows_per_block, 1, key_width, dtype=key_dtype, device="meta")
    block_table = torch.empty(batch_size, max_blocks, dtype=torch.int32, device="meta")
    tile_tokens = torch.empty(num_tiles, width, dtype=torch.int64, device="meta")
    tile_request = torch.empty(num_tiles, dtype=torch.int64, device="meta")
    token_visible = torch.empty(num_tokens, dtype=torch.int64, device="meta")
    tiles_per_chunk = max(1, SCRATCH_ELEMENTS // (width * num_windows))
    paged_scores = torch.empty(min(num_tiles, tiles_per_chunk), width, num_windows, device="meta")
    launches.append(("paged_pooled_index_scores",
                     plan_paged_scores(index_queries.flatten(0, 1), cache, block_table,
                                       tile_tokens[:tiles_per_chunk], tile_request[:tiles_per_chunk], token_visible,
                                       weights.flatten(0, 1), paged_scores, multiprocessors=sizes.multiprocessors)))
    return launches
