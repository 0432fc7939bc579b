"""PyTorch reference of the pooled index score and top-k window selection.

For query `t` with indexer queries `q[t, h]` and pooled keys `kbar[c]`:

    s[t, c] = sum_h a[t, h] * relu(q[t, h] . kbar[c]) / sqrt(d)

over the windows `c < num_visible_windows[t]`; the `topk` best are kept. Ties go to the lower window id, so the
result does not depend on how the candidates are split into chunks.

Each score is packed with its window id into one int64 selection key that sorts like (score, -id): the float32
bits made monotonic in the high word, `2^31 - 1 - id` in the low word. Keys are unique, so `torch.topk` over them is
exact with no tie repair, a running top-k merges chunks by a plain `topk` of the concatenation, and nothing reads
the device: a decode step is fixed-shape and free of host synchronisation.

Queries and windows go in chunks, so memory stays bounded by the chunk sizes, never `[T, N / r]`, and a decode step
allocates nothing proportional to the context beyond one window chunk. The per-head products are computed a
cache-sized block at a time.
"""

import torch

# Elements of the `[batch, query_chunk, topk + window_chunk]` block of selection keys.
SCORE_BLOCK_ELEMENTS = 1 << 22
# Windows scored between two merges into the running top-k: bounds a decode step's memory at any context.
WINDOW_CHUNK = 32768
# Per-head products computed at once (1 MiB float32): small enough to be summed while still in cache.
HEAD_BLOCK_ELEMENTS = 1 << 18

# Low word of a selection key: larger for lower window ids, so that ties go to the lower id.
_ID_BASE = 2**31 - 1
# The key of a window the query cannot see: below every real key.
_INVISIBLE = torch.iinfo(torch.int64).min


def _chunk_sizes(batch_size: int, num_queries: int, num_windows: int, topk: int) -> tuple[int, int]:
    window_chunk = max(1, min(num_windows, WINDOW_CHUNK))
    query_chunk = max(1, min(num_queries, SCORE_BLOCK_ELEMENTS // max(1, batch_size * (topk + window_chunk))))
    return query_chunk, window_chunk


def _chunk_scores(queries: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Scores `[batch, rows, n]` of `queries` `[batch, rows * heads, d]` (float32) against `keys` `[batch, n, d]`,
    with `weights` `[batch, rows, heads]` already holding the `1 / sqrt(d)` scale."""
    batch_size, rows, num_heads = weights.shape
    num_keys = keys.shape[1]
    block = max(1, min(num_keys, HEAD_BLOCK_ELEMENTS // max(1, batch_size * rows * num_heads)))
    head_weights = weights.reshape(batch_size * rows, 1, num_heads)
    blocks = []
    for start in range(0, num_keys, block):
        end = min(start + block, num_keys)
        per_head = torch.bmm(queries, keys[:, start:end].float().transpose(1, 2)).relu_()  # [b, rows * heads, n]
        per_head = per_head.view(batch_size * rows, num_heads, end - start)
        blocks.append(torch.bmm(head_weights, per_head).view(batch_size, rows, end - start))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=-1)


def selection_keys(scores: torch.Tensor, first_id: int, num_visible: torch.Tensor) -> torch.Tensor:
    """int64 keys `[..., n]` ordering float32 `scores` `[..., n]` of windows `first_id ..` by (score, -window id);
    windows at or beyond `num_visible` (broadcast against `scores`) get the lowest key."""
    bits = scores.view(torch.int32)
    # Negative floats order backwards in their bits; -0.0 and 0.0 must tie.
    bits = torch.where(scores == 0, 0, torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits))
    window_ids = torch.arange(first_id, first_id + scores.shape[-1], device=scores.device)
    keys = (bits.to(torch.int64) << 32) | (_ID_BASE - window_ids)
    return keys.masked_fill_(window_ids >= num_visible, _INVISIBLE)


def window_ids_of(keys: torch.Tensor, topk: int) -> torch.Tensor:
    """Window ids `[..., topk]` of selection keys `[..., n]` (n <= topk), ascending, `-1` for invisible ones and
    after the last."""
    ids = (_ID_BASE - (keys & 0xFFFFFFFF)).masked_fill(keys == _INVISIBLE, _ID_BASE)
    ids = ids.sort(dim=-1).values
    ids = ids.masked_fill(ids == _ID_BASE, -1)
    if ids.shape[-1] < topk:
        ids = torch.cat([ids, ids.new_full((*ids.shape[:-1], topk - ids.shape[-1]), -1)], dim=-1)
    return ids


def _scaled_head_weights(index_queries, head_weights):
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
    Differentiable (the indexer's KL loss trains through it); the selection computes the same scores in blocks."""
    per_head = torch.einsum("bthd,bcd->bthc", index_queries.float(), pooled_index_keys.float()).relu()
    return torch.einsum("bthc,bth->btc", per_head, _scaled_head_weights(index_queries, head_weights))


def pooled_index_topk_torch(
    index_queries: torch.Tensor,
    pooled_index_keys: torch.Tensor,
    num_visible_windows: torch.Tensor,
    topk: int,
    head_weights: torch.Tensor | None = None,
    window_limit: int | None = None,
) -> torch.Tensor:
    """Select the `topk` best-scoring visible windows of every query.

    Args:
        index_queries: `[batch, queries, index_heads, index_head_dim]`, after norm and RoPE.
        pooled_index_keys: `[batch, windows, index_head_dim]`, window `c` at index `c`.
        num_visible_windows: `[batch, queries]` integer: query `t` may select windows `0 .. n - 1`.
        topk: windows to keep per query.
        head_weights: `[batch, queries, index_heads]` or None (all heads weigh 1).
        window_limit: no query sees a window at or beyond this (a host-side bound, for a prefill). When given, each
            query chunk also reads its own causal bound from the device to skip windows none of its queries can see.
            None (decode): every window of `pooled_index_keys` is scored and nothing is read from the device.

    Returns:
        `[batch, queries, topk]` int64 window ids in ascending order, `-1` after the last one where fewer than
        `topk` windows are visible.
    """
    batch_size, num_queries, num_heads, head_dim = index_queries.shape
    num_windows = pooled_index_keys.shape[1]
    if window_limit is not None:
        num_windows = min(num_windows, window_limit)
    if num_windows == 0 or num_queries == 0 or topk == 0:
        return torch.full((batch_size, num_queries, topk), -1, dtype=torch.long, device=index_queries.device)
    query_chunk, window_chunk = _chunk_sizes(batch_size, num_queries, num_windows, topk)
    weights = _scaled_head_weights(index_queries, head_weights)
    selections = []
    for query_start in range(0, num_queries, query_chunk):
        query_end = min(query_start + query_chunk, num_queries)
        rows = query_end - query_start
        queries = index_queries[:, query_start:query_end].float().reshape(batch_size, rows * num_heads, head_dim)
        visible = num_visible_windows[:, query_start:query_end, None]
        limit = num_windows if window_limit is None else min(num_windows, int(visible.max()))
        best = None
        for window_start in range(0, limit, window_chunk):
            window_end = min(window_start + window_chunk, limit)
            scores = _chunk_scores(queries, pooled_index_keys[:, window_start:window_end],
                                   weights[:, query_start:query_end])
            keys = selection_keys(scores, window_start, visible)
            if best is not None:
                keys = torch.cat([best, keys], dim=-1)
            best = keys if keys.shape[-1] <= topk else keys.topk(topk, dim=-1, sorted=False).values
        if best is None:
            best = torch.full((batch_size, rows, 0), _INVISIBLE, dtype=torch.long, device=index_queries.device)
        selections.append(window_ids_of(best, topk))
    return selections[0] if len(selections) == 1 else torch.cat(selections, dim=1)
