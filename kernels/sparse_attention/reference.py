"""PyTorch reference of IndexPool sparse attention.

Each query attends to the raw keys/values of its selected windows (`pool_size` contiguous cache slots each) plus its
tail (the last `tail_length` slots ending at its own slot). Query heads are grouped (GQA): the heads that share a
key/value head also share the selection. Queries go in chunks, so memory is bounded by
`query_chunk x (topk * pool_size + pool_size - 1)` gathered keys, never by the sequence length squared.
"""

import torch

# Gathered key/value elements per query chunk (32 MiB in float32 for keys and values together): small enough that
# the allocator reuses the memory instead of faulting in fresh pages for every chunk.
GATHER_BLOCK_ELEMENTS = 1 << 22


def attention_slots(
    selected_windows: torch.Tensor,
    window_slot_offset: torch.Tensor,
    query_slots: torch.Tensor,
    tail_length: torch.Tensor,
    pool_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots each query attends to, and which of them are valid.

    Args:
        selected_windows: `[batch, queries, topk]` window ids, `-1` for none.
        window_slot_offset: `[batch]` slot of position 0 of each row: window `c` starts at `offset + c * pool_size`.
        query_slots: `[batch, queries]` slot of each query.
        tail_length: `[batch, queries]` tail slots, ending at (and including) the query's own slot.
        pool_size: tokens per window.

    Returns:
        `slots` `[batch, queries, topk * pool_size + pool_size - 1]` (int64, clamped to be gatherable) and `valid`
        of the same shape; window slots come first in window order, then the tail in position order.
    """
    within_window = torch.arange(pool_size, device=selected_windows.device)
    window_slots = window_slot_offset[:, None, None, None] + selected_windows[..., None] * pool_size + within_window
    window_valid = (selected_windows >= 0)[..., None].expand_as(window_slots)
    tail, tail_valid = tail_slots(query_slots, tail_length, pool_size)
    slots = torch.cat([window_slots.flatten(-2), tail], dim=-1)
    valid = torch.cat([window_valid.flatten(-2), tail_valid], dim=-1)
    return slots.clamp(min=0).masked_fill(~valid, 0), valid


def slot_rows(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """Row `batch` of a `[batch, kv_heads, slots, head_dim]` tensor as `[slots, kv_heads * head_dim]` (a view when
    the heads of a slot are adjacent in memory, as in the cache)."""
    rows = tensor[batch].transpose(0, 1)
    return rows.reshape(rows.shape[0], -1)  # a view when each slot's heads are adjacent, a copy otherwise


def gather_slots(tensor: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`[batch, n, kv_heads * head_dim]` rows of the given `[batch, ...]` slots of a `[batch, kv_heads, slots, d]`
    tensor, written into `out` when given (not differentiable then)."""
    if out is not None:
        for b in range(tensor.shape[0]):
            torch.index_select(slot_rows(tensor, b), 0, slots[b].flatten(), out=out[b])
        return out
    rows = [slot_rows(tensor, b).index_select(0, slots[b].flatten()) for b in range(tensor.shape[0])]
    return rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(rows)


def gather_windows(
    tensor: torch.Tensor,
    windows: torch.Tensor,
    window_slot_offset: torch.Tensor,
    pool_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[batch, n, pool_size * kv_heads * head_dim]`: each selected window's `pool_size` slots as one row, from a
    `[batch, kv_heads, slots, head_dim]` tensor whose window `c` starts at slot `window_slot_offset + c * pool_size`;
    written into `out` when given (not differentiable then). Negative ids read window 0 (callers mask them). One
    index per window instead of one per slot: the copy runs in rows `pool_size` times longer."""
    gathered = []
    for b in range(tensor.shape[0]):
        rows = slot_rows(tensor, b).contiguous()  # [slots, width]; already contiguous for a cache's storage
        start = int(window_slot_offset[b])
        count = max(0, (rows.shape[0] - start) // pool_size)
        ids = windows[b].flatten()
        if count == 0:  # no complete window in this row: every id is masked
            empty = rows.new_zeros(ids.numel(), pool_size * rows.shape[1])
            gathered.append(empty if out is None else out[b].copy_(empty))
            continue
        window_rows = rows[start:start + count * pool_size].view(count, pool_size * rows.shape[1])
        ids = ids.clamp(min=0, max=count - 1)
        if out is None:
            gathered.append(window_rows.index_select(0, ids))
        else:
            gathered.append(torch.index_select(window_rows, 0, ids, out=out[b]))
    if out is not None:
        return out
    return gathered[0].unsqueeze(0) if len(gathered) == 1 else torch.stack(gathered)


def tail_slots(query_slots: torch.Tensor, tail_length: torch.Tensor, pool_size: int):
    """`[batch, queries, pool_size - 1]` slots of each query's tail (gatherable) and which are valid."""
    within_tail = torch.arange(pool_size - 1, device=query_slots.device)
    slots = query_slots[..., None] - tail_length[..., None] + 1 + within_tail
    valid = within_tail < tail_length[..., None]
    return slots.clamp(min=0).masked_fill(~valid, 0), valid


def masked_softmax(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim restricted to `valid`; rows with nothing valid give zeros instead of NaN."""
    scores = scores.masked_fill(~valid, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).min)
    weights = (scores - row_max).exp()
    return weights / weights.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(scores.dtype).tiny)


def sparse_attention_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    selected_windows: torch.Tensor,
    window_slot_offset: torch.Tensor,
    query_slots: torch.Tensor,
    tail_length: torch.Tensor,
    pool_size: int,
    scaling: float,
    dropout: float = 0.0,
    training: bool = False,
    return_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of every query over its selected windows and its tail.

    Args:
        query: `[batch, heads, queries, head_dim]`.
        key, value: `[batch, kv_heads, slots, head_dim]`, every cache slot.
        selected_windows, window_slot_offset, query_slots, tail_length, pool_size: see `attention_slots`.
        scaling: multiplier of the dot products.
        dropout, training: attention dropout, applied in training only.
        return_weights: also return the attention weights scattered to `[batch, heads, queries, slots]` (dense;
            for inspection on short inputs only).

    Returns:
        Output `[batch, queries, heads, head_dim]` and the weights or None.
    """
    batch_size, num_heads, num_queries, head_dim = query.shape
    num_kv_heads, num_slots = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    slots_per_query = selected_windows.shape[-1] * pool_size + pool_size - 1
    query_chunk = max(1, GATHER_BLOCK_ELEMENTS // max(1, batch_size * slots_per_query * num_kv_heads * head_dim))

    output = query.new_empty(batch_size, num_queries, num_heads, head_dim)
    weights = None
    if return_weights:
        weights = query.new_zeros(batch_size, num_heads, num_queries, num_slots, dtype=torch.float32)
    window_length = selected_windows.shape[-1] * pool_size
    width = num_kv_heads * head_dim
    buffers = [None] * 4
    if not (torch.is_grad_enabled() and (key.requires_grad or value.requires_grad)):
        # Inference: every chunk gathers into the same buffers. Fresh tensors of this size would each fault in new
        # pages, which costs more than the gather itself.
        chunk = min(query_chunk, num_queries)
        window_rows = (selected_windows.shape[-1], pool_size * width)
        tail_rows = (pool_size - 1, width)
        buffers = [key.new_empty(batch_size, chunk, *rows) for rows in (window_rows, window_rows, tail_rows, tail_rows)]
    for start in range(0, num_queries, query_chunk):
        end = min(start + query_chunk, num_queries)
        windows = selected_windows[:, start:end]
        tail, tail_valid = tail_slots(query_slots[:, start:end], tail_length[:, start:end], pool_size)
        valid = torch.cat([(windows >= 0).repeat_interleave(pool_size, dim=-1), tail_valid], dim=-1)
        # [batch, queries * rows per query, row width] views of the buffers (each batch row contiguous)
        window_out, window_value_out, tail_out, tail_value_out = (
            None if buffer is None else buffer[:, : end - start].flatten(1, 2) for buffer in buffers
        )
        # Whole windows (every slot and head) as rows; the cache's slot-major storage makes them contiguous.
        window_shape = (batch_size, end - start, window_length, num_kv_heads, head_dim)
        tail_shape = (batch_size, end - start, pool_size - 1, num_kv_heads, head_dim)
        window_key = gather_windows(key, windows, window_slot_offset, pool_size, window_out)
        window_value = gather_windows(value, windows, window_slot_offset, pool_size, window_value_out)
        tail_key = gather_slots(key, tail, tail_out).view(tail_shape).float()
        tail_value = gather_slots(value, tail, tail_value_out).view(tail_shape).float()
        window_key, window_value = window_key.view(window_shape).float(), window_value.view(window_shape).float()
        if return_weights:
            slots, _ = attention_slots(windows, window_slot_offset, query_slots[:, start:end],
                                       tail_length[:, start:end], pool_size)
        for kv_head in range(num_kv_heads):
            heads = slice(kv_head * group, (kv_head + 1) * group)
            chunk_query = query[:, heads, start:end].transpose(1, 2).float()  # [b, t, group, d]
            # [b, t, group, d] x [b, t, d, l]: strided views of the gathered rows, no copies
            scores = torch.cat([torch.matmul(chunk_query, window_key[..., kv_head, :].transpose(-1, -2)),
                                torch.matmul(chunk_query, tail_key[..., kv_head, :].transpose(-1, -2))], dim=-1)
            probs = masked_softmax(scores * scaling, valid[:, :, None])
            if training and dropout > 0.0:
                probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
            chunk_output = torch.matmul(probs[..., :window_length], window_value[..., kv_head, :])
            chunk_output = chunk_output + torch.matmul(probs[..., window_length:], tail_value[..., kv_head, :])
            output[:, start:end, heads] = chunk_output.to(query.dtype)
            if return_weights:
                scatter_index = slots[:, None].expand(batch_size, group, end - start, slots_per_query)
                weights[:, heads, start:end].scatter_add_(-1, scatter_index, probs.transpose(1, 2))
    return output, weights
