"""Triton pooled index score + top-k: scores and selects in one pass, never writing the `[T, N / r]` score matrix.

Each program takes a tile of queries of one row and a range of windows. For a block of `K` windows it computes the
scores of all query heads with one matrix product, applies ReLU, the head weights and the scale, and merges them into
a running top-`K` kept in registers. Scores and window ids are packed into one int64 sort key (higher score first,
then lower window id: the reference's tie rule). The merge is bitonic: sort the block's keys ascending, take the
elementwise maximum with the running list (sorted descending), which leaves exactly the `K` largest as a bitonic
sequence, and sort that with one bitonic merge. Compare-and-swap steps are reshapes, minimum and maximum (no
`tl.sort`, whose generic reduction is very slow in the CPU interpreter). Prefill uses one window range per query
tile (bounded by the tile's causal limit); decode splits the windows of each query over several programs and merges
their partial lists afterwards.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError as error:  # Triton is optional; the package falls back to the PyTorch reference.
    raise ImportError("Triton is not installed") from error

# Low 32 bits of a sort key: larger for lower window ids, so that ties go to the lower id.
_ID_BASE = 2147483647
_EMPTY_KEY = -(2**63)


@triton.jit
def _sort_key(score, window_ids):
    """Pack float32 scores and int window ids into int64 keys that sort like (score, -id)."""
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 and 0.0 must tie
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # monotonic in the float order
    return (bits.to(tl.int64) << 32) | (_ID_BASE - window_ids).to(tl.int64)


@triton.jit
def _compare_swap(keys, ROWS: tl.constexpr, N: tl.constexpr, STRIDE: tl.constexpr, SIZE: tl.constexpr,
                  DESCENDING: tl.constexpr):
    """One bitonic step on each row: order the pairs (i, i + STRIDE) of every group of 2 * STRIDE elements; groups in
    odd blocks of SIZE elements go the other way (the bitonic build), all go one way when SIZE == N."""
    GROUPS: tl.constexpr = N // (2 * STRIDE)
    pairs = tl.permute(tl.reshape(keys, (ROWS, GROUPS, 2, STRIDE)), (0, 1, 3, 2))
    left, right = tl.split(pairs)  # [ROWS, GROUPS, STRIDE]
    low, high = tl.minimum(left, right), tl.maximum(left, right)
    group = tl.arange(0, GROUPS)[None, :, None]
    reverse = (((group * 2 * STRIDE) // SIZE) % 2 == 1) ^ DESCENDING
    pairs = tl.join(tl.where(reverse, high, low), tl.where(reverse, low, high))
    return tl.reshape(tl.permute(pairs, (0, 1, 3, 2)), (ROWS, N))


@triton.jit
def _bitonic_sort(keys, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr, DESCENDING: tl.constexpr):
    for stage in tl.static_range(1, LOG_N + 1):
        for step in tl.static_range(stage):
            keys = _compare_swap(keys, ROWS, N, (1 << stage) >> (step + 1), 1 << stage, DESCENDING)
    return keys


@triton.jit
def _bitonic_merge(keys, ROWS: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr, DESCENDING: tl.constexpr):
    """Sort rows that are bitonic sequences."""
    for step in tl.static_range(LOG_N):
        keys = _compare_swap(keys, ROWS, N, N >> (step + 1), N, DESCENDING)
    return keys


@triton.jit
def _pooled_index_topk_kernel(
    query_ptr, key_ptr, weight_ptr, visible_ptr, out_ptr,
    num_queries, num_windows, windows_per_split,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kc,
    stride_wb, stride_wt,
    stride_vb,
    stride_ob, stride_ot, stride_os,
    scale,
    HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    TOPK_PAD: tl.constexpr, LOG_TOPK: tl.constexpr, BLOCK_Q: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
):
    batch = tl.program_id(0)
    query_tile = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_Q * HEADS_PAD)  # (query, head) pairs of the tile
    query_index = query_tile * BLOCK_Q + rows // HEADS_PAD
    head_index = rows % HEADS_PAD
    row_mask = (query_index < num_queries) & (head_index < HEADS)
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < HEAD_DIM

    queries = tl.load(
        query_ptr + batch * stride_qb + query_index[:, None] * stride_qt + head_index[:, None] * stride_qh
        + dims[None, :], mask=row_mask[:, None] & dim_mask[None, :], other=0.0,
    ).to(tl.float32)
    if HAS_WEIGHTS:
        head_weights = tl.load(weight_ptr + batch * stride_wb + query_index * stride_wt + head_index,
                               mask=row_mask, other=0.0).to(tl.float32)
    else:
        head_weights = tl.where(row_mask, 1.0, 0.0)
    tile_queries = query_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    visible = tl.load(visible_ptr + batch * stride_vb + tile_queries, mask=tile_queries < num_queries, other=0)

    start = split * windows_per_split
    end = tl.minimum(start + windows_per_split, num_windows)
    end = tl.minimum(end, tl.max(visible, axis=0))  # causal bound of the tile
    best = tl.full((BLOCK_Q, TOPK_PAD), _EMPTY_KEY, tl.int64)
    for block_start in range(start, end, TOPK_PAD):
        window_ids = block_start + tl.arange(0, TOPK_PAD)
        window_mask = window_ids < end
        keys = tl.load(key_ptr + batch * stride_kb + window_ids[:, None] * stride_kc + dims[None, :],
                       mask=window_mask[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)
        per_head = tl.dot(queries, tl.trans(keys), input_precision="ieee")  # [BLOCK_Q * HEADS_PAD, TOPK_PAD]
        per_head = tl.maximum(per_head, 0.0) * head_weights[:, None]
        scores = tl.sum(tl.reshape(per_head, (BLOCK_Q, HEADS_PAD, TOPK_PAD)), axis=1) * scale
        candidate = _sort_key(scores, window_ids[None, :])
        keep = window_mask[None, :] & (window_ids[None, :] < visible[:, None])
        candidate = tl.where(keep, candidate, _EMPTY_KEY)
        candidate = _bitonic_sort(candidate, BLOCK_Q, TOPK_PAD, LOG_TOPK, False)
        best = _bitonic_merge(tl.maximum(best, candidate), BLOCK_Q, TOPK_PAD, LOG_TOPK, True)
    slots = tl.arange(0, TOPK_PAD)
    tl.store(out_ptr + batch * stride_ob + tile_queries[:, None] * stride_ot + split * stride_os + slots[None, :],
             best, mask=(tile_queries < num_queries)[:, None])


def _next_power_of_two(value: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(value))


def pooled_index_topk_triton(
    index_queries: torch.Tensor,
    pooled_index_keys: torch.Tensor,
    num_visible_windows: torch.Tensor,
    topk: int,
    head_weights: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton version of `pooled_index_topk_torch`: same arguments, same result (ids ascending, `-1` padded).

    `num_splits` splits each query's windows over that many programs (default: 1 for prefill, enough to fill
    the GPU for decode).
    """
    batch_size, num_queries, num_heads, head_dim = index_queries.shape
    num_windows = pooled_index_keys.shape[1]
    if num_windows == 0 or num_queries == 0 or topk == 0:
        return torch.full((batch_size, num_queries, topk), -1, dtype=torch.long, device=index_queries.device)
    index_queries = index_queries.contiguous()
    pooled_index_keys = pooled_index_keys.contiguous()
    visible = num_visible_windows.to(torch.int32).contiguous()
    topk_pad = _next_power_of_two(topk, 16)
    heads_pad = _next_power_of_two(num_heads)
    block_q = max(1, min(16, 64 // heads_pad)) if num_queries > 1 else 1
    block_q = _next_power_of_two(block_q)
    while block_q * heads_pad < 16:  # tl.dot needs at least 16 rows
        block_q *= 2
    if num_splits is None:
        query_tiles = batch_size * triton.cdiv(num_queries, block_q)
        num_splits = 1 if num_queries > 1 else max(1, min(64, triton.cdiv(num_windows, 4 * topk_pad),
                                                          256 // max(1, query_tiles)))
    windows_per_split = triton.cdiv(triton.cdiv(num_windows, num_splits), topk_pad) * topk_pad
    num_splits = triton.cdiv(num_windows, windows_per_split)
    partial = torch.empty(batch_size, num_queries, num_splits, topk_pad, dtype=torch.int64,
                          device=index_queries.device)
    weights = head_weights.float().contiguous() if head_weights is not None else visible  # unused placeholder
    grid = (batch_size, triton.cdiv(num_queries, block_q), num_splits)
    _pooled_index_topk_kernel[grid](
        index_queries, pooled_index_keys, weights, visible, partial,
        num_queries, num_windows, windows_per_split,
        index_queries.stride(0), index_queries.stride(1), index_queries.stride(2),
        pooled_index_keys.stride(0), pooled_index_keys.stride(1),
        weights.stride(0), weights.stride(1),
        visible.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2),
        head_dim**-0.5,
        HEADS=num_heads, HEADS_PAD=heads_pad, HEAD_DIM=head_dim, DIM_PAD=_next_power_of_two(head_dim, 16),
        TOPK_PAD=topk_pad, LOG_TOPK=topk_pad.bit_length() - 1, BLOCK_Q=block_q, HAS_WEIGHTS=head_weights is not None,
    )
    return decode_sort_keys(partial.flatten(2), topk)


def decode_sort_keys(keys: torch.Tensor, topk: int) -> torch.Tensor:
    """Merge partial top-k lists of packed keys `[..., n]` into window ids `[..., topk]`, ascending, `-1` padded."""
    best = keys.sort(dim=-1, descending=True).values[..., :topk]
    ids = _ID_BASE - (best & 0xFFFFFFFF)
    ids = ids.masked_fill(best == _EMPTY_KEY, 1 << 62).sort(dim=-1).values
    ids = ids.masked_fill(ids == 1 << 62, -1)
    if ids.shape[-1] < topk:
        ids = torch.cat([ids, ids.new_full((*ids.shape[:-1], topk - ids.shape[-1]), -1)], dim=-1)
    return ids
