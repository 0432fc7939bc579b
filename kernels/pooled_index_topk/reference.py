"""PyTorch reference of the pooled index score and top-k window selection.

For query `t` with indexer queries `q[t, h]` and pooled keys `kbar[c]`:

    s[t, c] = sum_h a[t, h] * relu(q[t, h] . kbar[c]) / sqrt(d)

over the windows `c < num_visible_windows[t]`; the `topk` best are kept. Ties go to the lower window id, so the
result does not depend on how the candidates are split into chunks.

Queries and windows go in chunks with a running top-k, so memory stays bounded by the chunk sizes, never
`[T, N / r]`, and a decode step allocates nothing proportional to the context. The per-head products are computed a
cache-sized block at a time and summed straight into one reused score buffer: on a CPU this is several times faster
than materialising `[queries, heads, windows]` (whose first touch of fresh memory alone costs more than the
arithmetic), and it is what makes a prefill of a million tokens take minutes rather than hours.
"""

import torch

# Elements of the `[batch, query_chunk, topk + window_chunk]` float32 score buffer (16 MiB).
SCORE_BLOCK_ELEMENTS = 1 << 22
# Windows scored between two merges into the running top-k: bounds a decode step's memory at any context.
WINDOW_CHUNK = 32768
# Per-head products computed at once (1 MiB float32): small enough to be summed while still in cache.
HEAD_BLOCK_ELEMENTS = 1 << 18


def _chunk_sizes(batch_size: int, num_queries: int, num_windows: int, topk: int) -> tuple[int, int]:
    window_chunk = max(1, min(num_windows, WINDOW_CHUNK))
    query_chunk = max(1, min(num_queries, SCORE_BLOCK_ELEMENTS // max(1, batch_size * (topk + window_chunk))))
    return query_chunk, window_chunk


def _write_scores(out, queries, keys, weights, head_buffer):
    """Scores of `queries` `[batch, rows * heads, d]` (float32) against `keys` `[batch, n, d]` into `out`
    `[batch, rows, n]` (may be a strided view), with `weights` `[batch, rows, heads]` already holding the
    `1 / sqrt(d)` scale."""
    batch_size, rows, num_heads = weights.shape
    block = head_buffer.shape[-1]
    for start in range(0, keys.shape[1], block):
        end = min(start + block, keys.shape[1])
        per_head = head_buffer[..., : end - start]
        torch.bmm(queries, keys[:, start:end].float().transpose(1, 2), out=per_head)
        per_head = per_head.relu_().view(batch_size, rows, num_heads, end - start)
        target = out[..., start:end]
        torch.mul(per_head[:, :, 0], weights[:, :, 0, None], out=target)
        for head in range(1, num_heads):
            target.addcmul_(per_head[:, :, head], weights[:, :, head, None])


def _scaled_head_weights(index_queries, head_weights):
    """`[batch, queries, heads]` float32 head weights times `1 / sqrt(d)` (all heads weigh 1 when None)."""
    batch_size, num_queries, num_heads, head_dim = index_queries.shape
    scale = head_dim**-0.5
    if head_weights is None:
        return torch.full((batch_size, num_queries, num_heads), scale, device=index_queries.device)
    return head_weights.float() * scale


def _head_buffer(batch_size, rows, num_heads, num_windows, device):
    block = max(1, min(num_windows, HEAD_BLOCK_ELEMENTS // max(1, batch_size * rows * num_heads)))
    return torch.empty(batch_size, rows * num_heads, block, device=device)


def pooled_index_scores_torch(
    index_queries: torch.Tensor, pooled_index_keys: torch.Tensor, head_weights: torch.Tensor | None
) -> torch.Tensor:
    """Scores of every query against every given window, `[batch, queries, windows]` in float32 (no masking).
    Differentiable (the indexer's KL loss trains through it); the selection computes the same scores in blocks."""
    per_head = torch.einsum("bthd,bcd->bthc", index_queries.float(), pooled_index_keys.float()).relu()
    return torch.einsum("bthc,bth->btc", per_head, _scaled_head_weights(index_queries, head_weights))


def _top_positions(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Positions of the `topk` best entries of each row of `scores` `[..., n]`, `n > topk`, in ascending order; of
    equal scores the lower position wins."""
    values, positions = scores.topk(topk, dim=-1, sorted=False)
    kth = values.amin(dim=-1, keepdim=True)
    positions = positions.sort(dim=-1).values
    # A row with more than `topk` entries >= its k-th best has a tie straddling the cut (zeros from the ReLU, or
    # -inf when fewer than topk windows are visible), and topk chose among the tied entries arbitrarily. Those rows
    # take everything above the k-th best, then the lowest positions among the equal ones.
    at_least = scores >= kth
    if int(torch.count_nonzero(at_least)) > positions.numel():  # cheaper than counting per row; rarely true
        tied = at_least.view(torch.uint8).sum(dim=-1, dtype=torch.int32) > topk
        rows = tied.nonzero(as_tuple=True)
        tied_scores, tied_kth = scores[rows], kth[rows]  # [tied rows, n], [tied rows, 1]
        above, equal = tied_scores > tied_kth, tied_scores == tied_kth
        wanted = topk - above.view(torch.uint8).sum(dim=-1, dtype=torch.int32)
        take = above | (equal & (equal.cumsum(dim=-1, dtype=torch.int32) <= wanted[:, None]))
        positions[rows] = take.nonzero()[:, -1].view(-1, topk)  # row-major: each row's positions ascending
    return positions


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
    batch_size, num_queries, num_heads, head_dim = index_queries.shape
    num_windows = pooled_index_keys.shape[1]
    device = index_queries.device
    selected = torch.full((batch_size, num_queries, topk), -1, dtype=torch.long, device=device)
    if num_windows == 0 or num_queries == 0 or topk == 0:
        return selected
    query_chunk, window_chunk = _chunk_sizes(batch_size, num_queries, num_windows, topk)
    weights = _scaled_head_weights(index_queries, head_weights)
    # Columns [0, kept) hold the running best (ascending ids), the chunk's scores follow them.
    score_buffer = torch.empty(batch_size, query_chunk, topk + window_chunk, device=device)
    head_buffer = _head_buffer(batch_size, query_chunk, num_heads, window_chunk, device)
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
                          weights[:, query_start:query_end], head_buffer[:, : rows * num_heads])
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
