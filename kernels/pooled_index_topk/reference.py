"""PyTorch reference of the pooled index score and top-k window selection.

For query `t` with indexer queries `q[t, h]` and pooled keys `kbar[c]`:

    s[t, c] = sum_h a[t, h] * relu(q[t, h] . kbar[c]) / sqrt(d)

over the windows `c < num_visible_windows[t]`; the `topk` best are kept. Ties go to the lower window id, so the
result does not depend on how the candidates are split into chunks. Queries and windows are processed in
chunks with a running top-k, so memory stays bounded by the chunk sizes, never `[T, N / r]`, and a decode step
allocates nothing proportional to the context.
"""

import torch

# Elements of one `[batch, query_chunk, heads, window_chunk]` float32 score block (64 MiB).
SCORE_BLOCK_ELEMENTS = 1 << 24
WINDOW_CHUNK = 32768


def _chunk_sizes(batch_size: int, num_queries: int, num_heads: int, num_windows: int) -> tuple[int, int]:
    window_chunk = max(1, min(num_windows, WINDOW_CHUNK))
    query_chunk = max(1, min(num_queries, SCORE_BLOCK_ELEMENTS // max(1, batch_size * num_heads * window_chunk)))
    return query_chunk, window_chunk


def pooled_index_scores_torch(
    index_queries: torch.Tensor, pooled_index_keys: torch.Tensor, head_weights: torch.Tensor | None
) -> torch.Tensor:
    """Scores of every query against every given window, `[batch, queries, windows]` in float32 (no masking)."""
    scale = index_queries.shape[-1] ** -0.5
    # [b, t, h, d] x [b, c, d] -> [b, t, h, c]
    per_head = torch.einsum("bthd,bcd->bthc", index_queries.float(), pooled_index_keys.float()).relu_()
    if head_weights is None:
        return per_head.sum(dim=2) * scale
    return torch.einsum("bthc,bth->btc", per_head, head_weights.float()) * scale


def _merge_topk(best_scores, best_ids, scores, ids, topk):
    """The `topk` best of the kept entries and a new chunk, in ascending id order (the kept ids all precede the
    chunk's). Exact tie rule without a full sort: everything above the k-th largest score, then the lowest ids
    among the entries equal to it."""
    scores, ids = torch.cat([best_scores, scores], dim=-1), torch.cat([best_ids, ids], dim=-1)
    if scores.shape[-1] <= topk:
        return scores, ids
    kth = scores.topk(topk, dim=-1).values[..., -1:]
    above, equal = scores > kth, scores == kth
    take = above | (equal & (equal.cumsum(dim=-1) <= topk - above.sum(dim=-1, keepdim=True)))
    position = torch.arange(scores.shape[-1], device=scores.device)
    # The taken positions, smallest first (topk of the smallest returns them in ascending order).
    index = torch.where(take, position, position + scores.shape[-1]).topk(topk, dim=-1, largest=False).indices
    return scores.gather(-1, index), ids.gather(-1, index)


def _entries_above(best_scores, scores, ids, topk):
    """The chunk's entries that can still enter a full running top-k, compacted (ascending ids, `-inf` padding), or
    None when there are none. Only a score above the row's current k-th best can enter: an equal one has a higher
    id than every kept window and loses the tie. Usually only a few qualify, so the merge then handles a handful of
    entries instead of the whole chunk. None of the shortcut applies when many qualify (returns the chunk as is)."""
    passing = scores > best_scores.amin(dim=-1, keepdim=True)
    count = int(passing.sum(dim=-1).max())
    if count == 0:
        return None
    if count > topk:
        return scores, ids
    positions = torch.where(passing, torch.arange(scores.shape[-1], device=scores.device), scores.shape[-1])
    positions = positions.topk(count, dim=-1, largest=False).values  # ascending; the sentinel marks padding
    valid = positions < scores.shape[-1]
    positions = positions.clamp(max=scores.shape[-1] - 1)
    return (scores.gather(-1, positions).masked_fill(~valid, float("-inf")),
            ids.gather(-1, positions).masked_fill(~valid, ids.max() + 1))


def pooled_index_topk_torch(
    index_queries: torch.Tensor,
    pooled_index_keys: torch.Tensor,
    num_visible_windows: torch.Tensor,
    topk: int,
    head_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Select the `topk` best-scoring visible windows of every query.

    Args:
        index_queries: `[batch, queries, index_heads, index_head_dim]`, after norm and RoPE.
        pooled_index_keys: `[batch, windows, index_head_dim]`, window `c` at index `c`.
        num_visible_windows: `[batch, queries]` integer: query `t` may select windows `0 .. n - 1`.
        topk: windows to keep per query.
        head_weights: `[batch, queries, index_heads]` or None (all heads weigh 1).

    Returns:
        `[batch, queries, topk]` int64 window ids in ascending order, `-1` after the last one where fewer than
        `topk` windows are visible.
    """
    batch_size, num_queries, num_heads, _ = index_queries.shape
    num_windows = pooled_index_keys.shape[1]
    device = index_queries.device
    selected = torch.full((batch_size, num_queries, topk), -1, dtype=torch.long, device=device)
    if num_windows == 0 or num_queries == 0 or topk == 0:
        return selected
    query_chunk, window_chunk = _chunk_sizes(batch_size, num_queries, num_heads, num_windows)
    for query_start in range(0, num_queries, query_chunk):
        query_end = min(query_start + query_chunk, num_queries)
        queries = index_queries[:, query_start:query_end]
        weights = None if head_weights is None else head_weights[:, query_start:query_end]
        visible = num_visible_windows[:, query_start:query_end, None]
        best_scores = torch.full((batch_size, query_end - query_start, 0), float("-inf"), device=device)
        best_ids = torch.zeros((batch_size, query_end - query_start, 0), dtype=torch.long, device=device)
        causal_limit = min(num_windows, int(visible.max()))  # no query of the chunk sees beyond
        min_visible = int(visible.min())
        for window_start in range(0, causal_limit, window_chunk):
            window_end = min(window_start + window_chunk, causal_limit)
            scores = pooled_index_scores_torch(queries, pooled_index_keys[:, window_start:window_end], weights)
            ids = torch.arange(window_start, window_end, device=device).expand_as(scores)
            if window_end > min_visible:  # some query of the chunk cannot see all of these windows
                scores = scores.masked_fill(ids >= visible, float("-inf"))
            if best_scores.shape[-1] == topk:
                candidates = _entries_above(best_scores, scores, ids, topk)
                if candidates is None:
                    continue  # nothing in this chunk beats any row's k-th best
                scores, ids = candidates
            best_scores, best_ids = _merge_topk(best_scores, best_ids, scores, ids, topk)
        best_ids = best_ids.masked_fill(best_scores == float("-inf"), -1)
        # Kept in ascending id order already; the -1 of invisible windows go last.
        best_ids = torch.where(best_ids < 0, num_windows, best_ids).sort(dim=-1).values
        best_ids = best_ids.masked_fill(best_ids == num_windows, -1)
        selected[:, query_start:query_end, : best_ids.shape[-1]] = best_ids
    return selected
