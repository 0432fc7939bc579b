"""PyTorch reference of the pooled index score and top-k window selection.

For query `t` with indexer queries `q[t, h]` and pooled keys `kbar[c]`:

    s[t, c] = sum_h a[t, h] * relu(q[t, h] . kbar[c]) / sqrt(d)

over the windows `c < num_visible_windows[t]`; the `topk` best are kept. Ties go to the lower window id, so the
result does not depend on how the candidates are split into chunks.

Two ways to the same selection:

- **Fixed shapes, no host reads** (decode, and whatever is compiled): each score is packed with its window id into
  one int64 selection key that sorts like (score, -id), the float32 bits made monotonic in the high word and
  `2^31 - 1 - id` in the low word. Keys are unique, so `torch.topk` over them is exact with no tie repair, and a
  running top-k merges chunks by a plain `topk`.
- **With host bounds** (prefill, `window_limit` given): a float `topk` per chunk, skipping windows no query of a
  chunk can see, and a repair of the rows whose k-th best score is tied across the cut (zeros from the ReLU), found
  by reading a count from the device. Several times cheaper per score on a CPU than building the keys.

Optionally the first `sink_windows` windows and each query's `local_windows` most recent visible windows are always
selected, inside the `topk` (their scores are raised to +inf before the selection, so the indexer picks the rest).

Queries and windows go in chunks, so memory stays bounded by the chunk sizes, never `[T, N / r]`, and a decode step
allocates nothing proportional to the context beyond one window chunk. The per-head products are computed a
cache-sized block at a time and summed straight into the score buffer.
"""

import torch

from ..fp8_index_keys import dequantize_pooled_keys, is_packed, rotate_queries

# Elements of the `[batch, query_chunk, topk + window_chunk]` block of selection keys.
SCORE_BLOCK_ELEMENTS = 1 << 22
# Windows scored between two merges into the running top-k: bounds a decode step's memory at any context.
WINDOW_CHUNK = 32768
# Per-head products computed at once (1 MiB float32): small enough to be summed while still in cache.
HEAD_BLOCK_ELEMENTS = 1 << 18

# Low word of a selection key: larger for lower window ids, so that ties go to the lower id.
ID_BASE = 2**31 - 1
# High word of the key of a -inf score (an invisible window): float bits 0xFF800000 ordered as `selection_keys` does.
INVISIBLE_HIGH = ((0xFF800000 - (1 << 32)) ^ 0x7FFFFFFF) + 1


def _chunk_sizes(batch_size: int, num_queries: int, num_windows: int, topk: int) -> tuple[int, int]:
    window_chunk = max(1, min(num_windows, WINDOW_CHUNK))
    query_chunk = max(1, min(num_queries, SCORE_BLOCK_ELEMENTS // max(1, batch_size * (topk + window_chunk))))
    return query_chunk, window_chunk


# Up to this many (query, head) rows the keys are the left operand of the score product (see `_write_scores`).
KEYS_LEFT_ROWS = 32


def _write_scores(out: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> None:
    """Scores of `queries` `[batch, rows * heads, d]` (float32) against `keys` `[batch, n, d]` into `out`
    `[batch, rows, n]` (may be a strided view), with `weights` `[batch, rows, heads]` already holding the
    `1 / sqrt(d)` scale. The per-head products go a cache-sized block at a time and are summed over the heads
    straight into `out`.

    A few rows (decode): `keys @ queries^T`, so that the CPU streams the keys once in the order they are stored,
    close to the memory bandwidth (the other orientation runs ~1.8x slower there). Many rows (prefill):
    `queries @ keys^T`, the faster one for a real matrix product.
    """
    batch_size, rows, num_heads = weights.shape
    num_keys = keys.shape[1]
    block = max(1, min(num_keys, HEAD_BLOCK_ELEMENTS // max(1, batch_size * rows * num_heads)))
    keys_left = rows * num_heads <= KEYS_LEFT_ROWS
    for start in range(0, num_keys, block):
        end = min(start + block, num_keys)
        block_keys = keys[:, start:end]
        block_keys = dequantize_pooled_keys(block_keys) if is_packed(block_keys) else block_keys.float()
        if keys_left:
            per_head = torch.bmm(block_keys, queries.transpose(1, 2)).relu_()  # [batch, n, rows * heads]
            per_head = per_head.view(batch_size, end - start, rows, num_heads).permute(0, 2, 3, 1)
        else:
            per_head = torch.bmm(queries, block_keys.transpose(1, 2)).relu_()  # [batch, rows * heads, n]
            per_head = per_head.view(batch_size, rows, num_heads, end - start)
        target = out[..., start:end]
        torch.mul(per_head[:, :, 0], weights[:, :, 0, None], out=target)
        for head in range(1, num_heads):
            target.addcmul_(per_head[:, :, head], weights[:, :, head, None])


def force_windows(scores: torch.Tensor, window_ids: torch.Tensor, num_visible: torch.Tensor, sink_windows: int,
                  local_windows: int) -> None:
    """Raise to +inf, in place, the scores `[..., n]` of windows `window_ids` `[n]` that are always selected: the
    first `sink_windows` ones and the `local_windows` before `num_visible` (broadcast against `scores`). Windows at
    or beyond `num_visible` are left for the caller to mask."""
    if sink_windows > 0:
        scores.masked_fill_(window_ids < sink_windows, float("inf"))
    if local_windows > 0:
        scores.masked_fill_(window_ids >= num_visible - local_windows, float("inf"))


def selection_keys(scores: torch.Tensor, first_id: int, num_visible: torch.Tensor,
                   out: torch.Tensor | None = None, sink_windows: int = 0, local_windows: int = 0) -> torch.Tensor:
    """int64 keys `[..., n]` ordering float32 `scores` `[..., n]` of windows `first_id ..` by (score, -window id);
    windows at or beyond `num_visible` (broadcast against `scores`) get a score of -inf, below every visible one;
    forced windows (`force_windows`) get +inf, above every other.

    `scores` is overwritten (its memory holds the ordered bits); the keys go into `out` when given. Every step is
    one in-place pass, since on a CPU these passes cost as much as computing the scores.
    """
    window_ids = torch.arange(first_id, first_id + scores.shape[-1], device=scores.device)
    force_windows(scores, window_ids, num_visible, sink_windows, local_windows)
    scores.masked_fill_(window_ids >= num_visible, float("-inf"))
    bits = scores.view(torch.int32)
    sign = bits >> 31  # -1 for negative floats, 0 otherwise
    bits ^= sign & 0x7FFFFFFF  # negative floats order backwards in their bits ...
    bits -= sign  # ... and one up, so that -0.0 ties with 0.0
    keys = bits.to(torch.int64) if out is None else out.copy_(bits)
    keys <<= 32
    keys |= ID_BASE - window_ids
    return keys


def window_ids_of(keys: torch.Tensor, topk: int) -> torch.Tensor:
    """Window ids `[..., topk]` of selection keys `[..., n]` (n <= topk), ascending, `-1` for invisible ones and
    after the last."""
    invisible = (keys >> 32) <= INVISIBLE_HIGH
    ids = (ID_BASE - (keys & 0xFFFFFFFF)).masked_fill_(invisible, ID_BASE)
    ids = ids.sort(dim=-1).values
    ids = ids.masked_fill_(ids == ID_BASE, -1)
    if ids.shape[-1] < topk:
        ids = torch.cat([ids, ids.new_full((*ids.shape[:-1], topk - ids.shape[-1]), -1)], dim=-1)
    return ids


def scaled_head_weights(index_queries, head_weights):
    """`[batch, queries, heads]` float32 head weights times `1 / sqrt(d)` (all heads weigh 1 when None)."""
    batch_size, num_queries, num_heads, head_dim = index_queries.shape
    scale = head_dim**-0.5
    if head_weights is None:
        return torch.full((batch_size, num_queries, num_heads), scale, device=index_queries.device)
    return head_weights.float() * scale


def pooled_index_scores_torch(
    index_queries: torch.Tensor, pooled_index_keys: torch.Tensor, head_weights: torch.Tensor | None
) -> torch.Tensor:
    """Scores of every query against every given window, `[batch, queries, windows]` in float32 (no masking).
    Differentiable (the indexer's KL loss trains through it); the selection computes the same scores in blocks.
    Packed fp8 keys are scored against the rotated queries (no gradient reaches them)."""
    if is_packed(pooled_index_keys):
        index_queries, pooled_index_keys = rotate_queries(index_queries), dequantize_pooled_keys(pooled_index_keys)
    per_head = torch.einsum("bthd,bcd->bthc", index_queries.float(), pooled_index_keys.float()).relu()
    return torch.einsum("bthc,bth->btc", per_head, scaled_head_weights(index_queries, head_weights))


def _top_positions(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Positions of the `topk` best entries of each row of `scores` `[..., n]`, `n > topk`, in ascending order; of
    equal scores the lower position wins. Reads the device once."""
    values, positions = scores.topk(topk, dim=-1, sorted=False)
    kth = values.amin(dim=-1, keepdim=True)
    positions = positions.sort(dim=-1).values
    # A row with more than `topk` entries >= its k-th best has a tie straddling the cut (zeros from the ReLU, or
    # -inf when fewer than topk windows are visible), and topk chose among the tied entries arbitrarily. Those rows
    # take everything above the k-th best, then the lowest positions among the equal ones. Each row is judged on
    # its own, so one row's values (NaN, say) never change another row's selection.
    tied = (scores >= kth).sum(dim=-1, dtype=torch.int32) > topk
    if bool(tied.any()):
        rows = tied.nonzero(as_tuple=True)
        tied_scores, tied_kth = scores[rows], kth[rows]  # [tied rows, n], [tied rows, 1]
        above, equal = tied_scores > tied_kth, tied_scores == tied_kth
        wanted = topk - above.sum(dim=-1, dtype=torch.int32)
        take = above | (equal & (equal.cumsum(dim=-1, dtype=torch.int32) <= wanted[:, None]))
        positions[rows] = take.nonzero()[:, -1].view(-1, topk)  # row-major: each row's positions ascending
    return positions


def pooled_index_topk_torch(
    index_queries: torch.Tensor,
    pooled_index_keys: torch.Tensor,
    num_visible_windows: torch.Tensor,
    topk: int,
    head_weights: torch.Tensor | None = None,
    window_limit: int | None = None,
    sink_windows: int = 0,
    local_windows: int = 0,
) -> torch.Tensor:
    """Select the `topk` best-scoring visible windows of every query.

    Args:
        index_queries: `[batch, queries, index_heads, index_head_dim]`, after norm and RoPE.
        pooled_index_keys: `[batch, windows, index_head_dim]`, window `c` at index `c`; or packed fp8 keys
            `uint8 [batch, windows, index_head_dim + 4]` (`fp8_index_keys`), scored against the rotated queries.
        num_visible_windows: `[batch, queries]` integer: query `t` may select windows `0 .. n - 1`.
        topk: windows to keep per query.
        head_weights: `[batch, queries, index_heads]` or None (all heads weigh 1).
        window_limit: no query sees a window at or beyond this (a host-side bound, for a prefill): selects with
            float top-k, reading bounds and ties from the device. None (decode, compiled code): every window of
            `pooled_index_keys` is scored, with fixed shapes and nothing read from the device.
        sink_windows: the first windows, always selected when visible (attention sinks), inside `topk`.
        local_windows: each query's most recent visible windows, always selected, inside `topk`.
            `sink_windows + local_windows` must not exceed `topk`.

    Returns:
        `[batch, queries, topk]` int64 window ids in ascending order, `-1` after the last one where fewer than
        `topk` windows are visible.
    """
    batch_size, num_queries, _, _ = index_queries.shape
    num_windows = pooled_index_keys.shape[1]
    if window_limit is not None:
        num_windows = min(num_windows, window_limit)
    if num_windows == 0 or num_queries == 0 or topk == 0:
        return torch.full((batch_size, num_queries, topk), -1, dtype=torch.long, device=index_queries.device)
    if is_packed(pooled_index_keys):
        index_queries = rotate_queries(index_queries)
    select = select_with_keys if window_limit is None else _select_with_host_bounds
    return select(index_queries, pooled_index_keys[:, :num_windows], num_visible_windows, topk,
                  scaled_head_weights(index_queries, head_weights), sink_windows, local_windows)


def select_with_keys(index_queries, pooled_index_keys, num_visible_windows, topk, weights, sink_windows,
                     local_windows):
    """`pooled_index_topk_torch` without `window_limit`, with `weights` from `scaled_head_weights`: fixed shapes, no
    host reads, a running top-k of int64 selection keys over window chunks."""
    batch_size, num_queries, num_heads, head_dim = index_queries.shape
    num_windows = pooled_index_keys.shape[1]
    query_chunk, window_chunk = _chunk_sizes(batch_size, num_queries, num_windows, topk)
    selections = []
    for query_start in range(0, num_queries, query_chunk):
        query_end = min(query_start + query_chunk, num_queries)
        rows = query_end - query_start
        queries = index_queries[:, query_start:query_end].float().reshape(batch_size, rows * num_heads, head_dim)
        visible = num_visible_windows[:, query_start:query_end, None]
        # Columns [0, kept) hold the running best keys, the next window chunk's keys follow them.
        keys = torch.empty(batch_size, rows, min(topk, num_windows) + window_chunk, dtype=torch.long,
                           device=index_queries.device)
        scores = torch.empty(batch_size, rows, window_chunk, device=index_queries.device)
        kept = 0
        for window_start in range(0, num_windows, window_chunk):
            count = min(window_chunk, num_windows - window_start)
            _write_scores(scores[..., :count], queries, pooled_index_keys[:, window_start:window_start + count],
                          weights[:, query_start:query_end])
            selection_keys(scores[..., :count], window_start, visible, out=keys[..., kept:kept + count],
                           sink_windows=sink_windows, local_windows=local_windows)
            kept += count
            if kept > topk:
                keys[..., :topk] = keys[..., :kept].topk(topk, dim=-1, sorted=False).values
                kept = topk
        selections.append(window_ids_of(keys[..., :kept], topk))
    return selections[0] if len(selections) == 1 else torch.cat(selections, dim=1)


def _select_with_host_bounds(index_queries, pooled_index_keys, num_visible_windows, topk, weights, sink_windows,
                             local_windows):
    """A running float top-k over window chunks, each query chunk bounded by its own causal limit, with the tie
    repair of `_top_positions`."""
    batch_size, num_queries, num_heads, head_dim = index_queries.shape
    num_windows = pooled_index_keys.shape[1]
    device = index_queries.device
    selected = torch.full((batch_size, num_queries, topk), -1, dtype=torch.long, device=device)
    query_chunk, window_chunk = _chunk_sizes(batch_size, num_queries, num_windows, topk)
    # Columns [0, kept) hold the running best (ascending ids), the chunk's scores follow them.
    score_buffer = torch.empty(batch_size, query_chunk, topk + window_chunk, device=device)
    for query_start in range(0, num_queries, query_chunk):
        query_end = min(query_start + query_chunk, num_queries)
        rows = query_end - query_start
        queries = index_queries[:, query_start:query_end].float().reshape(batch_size, rows * num_heads, head_dim)
        visible = num_visible_windows[:, query_start:query_end, None]
        causal_limit = min(num_windows, int(visible.max()))  # no query of the chunk sees beyond
        min_visible = int(visible.min())
        kept, best_ids = 0, None
        for window_start in range(0, causal_limit, window_chunk):
            window_end = min(window_start + window_chunk, causal_limit)
            scores = score_buffer[:, :rows, : kept + window_end - window_start]
            _write_scores(scores[..., kept:], queries, pooled_index_keys[:, window_start:window_end],
                          weights[:, query_start:query_end])
            if sink_windows > 0 or local_windows > 0:
                force_windows(scores[..., kept:], torch.arange(window_start, window_end, device=device), visible,
                              sink_windows, local_windows)
            if window_end > min_visible:  # some query of the chunk cannot see all of these windows
                first = max(min_visible, window_start)
                ids = torch.arange(first, window_end, device=device)
                scores[..., kept + first - window_start:].masked_fill_(ids >= visible, float("-inf"))
            chunk_ids = torch.arange(window_start - kept, window_end, device=device)  # id of each column
            if scores.shape[-1] <= topk:  # everything stays: the scores are in place already
                fresh = chunk_ids[kept:].expand(batch_size, rows, -1)
                best_ids = fresh if best_ids is None else torch.cat([best_ids, fresh], dim=-1)
                kept = scores.shape[-1]
                continue
            positions = _top_positions(scores, topk)
            best_scores = scores.gather(-1, positions)
            chunk_ids = chunk_ids.expand(batch_size, rows, -1).gather(-1, positions)
            best_ids = chunk_ids if kept == 0 else torch.where(
                positions < kept, best_ids.gather(-1, positions.clamp(max=kept - 1)), chunk_ids)
            kept = topk
            score_buffer[:, :rows, :kept] = best_scores
        if best_ids is None:
            continue
        # Ascending ids already; windows with -inf (invisible) have the highest ids, so the -1 go last.
        invisible = score_buffer[:, :rows, :kept] == float("-inf")
        selected[:, query_start:query_end, :kept] = best_ids.masked_fill(invisible, -1)
    return selected


# Bytes of the per-head scores, selection keys and gathered pooled keys of the tiles one paged selection scores at once
# (the serving layer's `SCORE_CHUNK_BYTES`).
PAGED_SCORE_CHUNK_BYTES = 64 << 20


def paged_tiles_per_chunk(width: int, window_bound: int, num_heads: int, head_dim: int) -> int:
    """Tiles of `width` queries scored together by `paged_pooled_index_topk_torch`: their per-head float32 scores
    (`4 * heads` bytes per query and window), selection keys and scores (12 bytes) and gathered float32 keys stay
    within `PAGED_SCORE_CHUNK_BYTES`. From shapes only."""
    return max(1, PAGED_SCORE_CHUNK_BYTES // (width * window_bound * (4 * num_heads + 12)
                                              + window_bound * head_dim * 4))


def gather_paged_pooled_keys(pooled_key_cache: torch.Tensor, block_table: torch.Tensor, requests: torch.Tensor,
                             num_windows: int) -> torch.Tensor:
    """Windows `0 .. num_windows - 1` of each of `requests` `[n]`, `[n, num_windows, width]` in the cache's dtype,
    from vLLM's paged pooled-key cache `[blocks, block_size // r, 1, width]`: window `w` of request `q` is row
    `w % (block_size // r)` of block `block_table[q, w // (block_size // r)]`. Windows past the table's last column
    read that column's block (no query sees them: the caller masks them)."""
    windows_per_block = pooled_key_cache.shape[1]
    windows = torch.arange(num_windows, device=block_table.device)
    columns = (windows // windows_per_block).clamp(max=block_table.shape[1] - 1)
    blocks = block_table[requests][:, columns].long()  # [n, windows]
    return pooled_key_cache[blocks, windows % windows_per_block, 0]


def paged_pooled_index_topk_torch(
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
) -> torch.Tensor:
    """`pooled_index_topk_torch` over vLLM's paged pooled-key cache for a step of many requests (the serving layer's
    selection): each tile of one request's queries is scored against that request's windows `0 .. window_bound - 1`,
    with fixed shapes and nothing read from the device.

    Args:
        index_queries: `[tokens, index_heads, index_head_dim]`, after norm and RoPE.
        pooled_key_cache: `[blocks, block_size // r, 1, index_head_dim]` in a float dtype, or packed fp8 keys
            `uint8 [blocks, block_size // r, 1, index_head_dim + 4]` (`fp8_index_keys`), scored against the rotated
            queries.
        block_table: `[requests, max_blocks]` int32 or int64, the requests' blocks in order.
        tile_tokens: `[tiles, width]` int64: the tokens of each tile (one request's queries; a short tile repeats its
            last token).
        tile_request: `[tiles]` integer: the request of each tile.
        token_tile: `[tokens]` int64: `tile * width + row` of each token's place in the tiles; None: the rows of the
            tiles are returned (`[tiles * width, topk]`), for a caller that merges several launches' rows.
        num_visible_windows: `[tokens]` integer: token `t` may select windows `0 .. num_visible_windows[t] - 1`.
        window_bound: windows scored per tile, at least every token's `num_visible_windows`.
        topk: windows kept per token.
        head_weights: `[tokens, index_heads]` or None (all heads weigh 1).
        sink_windows, local_windows: windows always selected, as in `pooled_index_topk_torch`.

    Returns:
        `[tokens, topk]` int64 window ids in ascending order, `-1` after the last (`[tiles * width, topk]` per tile
        row without `token_tile`).
    """
    num_tokens, num_heads, head_dim = index_queries.shape
    num_tiles, width = tile_tokens.shape
    if num_tiles == 0 or num_tokens == 0:
        rows = num_tokens if token_tile is not None else num_tiles * width
        return torch.full((rows, topk), -1, dtype=torch.long, device=index_queries.device)
    packed = is_packed(pooled_key_cache)
    if packed:
        index_queries = rotate_queries(index_queries)
    weights = scaled_head_weights(index_queries[None], None if head_weights is None else head_weights[None])[0]
    tiles_per_chunk = paged_tiles_per_chunk(width, window_bound, num_heads, head_dim)
    selected = []
    for start in range(0, num_tiles, tiles_per_chunk):
        tokens = tile_tokens[start:start + tiles_per_chunk]  # [tiles, width]
        keys = gather_paged_pooled_keys(pooled_key_cache, block_table, tile_request[start:start + tiles_per_chunk],
                                        window_bound)  # [tiles, windows, width of a key]
        keys = dequantize_pooled_keys(keys) if packed else keys.float()
        per_head = torch.einsum("tqhd,twd->tqhw", index_queries[tokens].float(), keys).relu_()
        scores = (per_head * weights[tokens][..., None]).sum(dim=2)  # [tiles, width, windows]
        keys = selection_keys(scores, 0, num_visible_windows[tokens][..., None], sink_windows=sink_windows,
                              local_windows=local_windows)
        if window_bound > topk:
            keys = keys.topk(topk, dim=-1, sorted=False).values
        selected.append(window_ids_of(keys, topk))
    rows = torch.cat(selected).flatten(0, 1)  # [tiles * width, topk]
    return rows if token_tile is None else rows[token_tile]
