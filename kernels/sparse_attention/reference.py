"""PyTorch reference of IndexPool sparse attention.

Each query attends to the raw keys/values of its selected windows (`pool_size` contiguous cache slots each) plus its
tail (the last `tail_length` slots ending at its own slot). Query heads are grouped (GQA): the heads that share a
key/value head also share the selection. Queries go in chunks, so memory is bounded by
`query_chunk x (topk * pool_size + pool_size - 1)` gathered keys, never by the sequence length squared.
"""

import torch

# Gathered key/value elements per query chunk (about 128 MiB in float32 for keys and values together).
GATHER_BLOCK_ELEMENTS = 1 << 24


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
    within_tail = torch.arange(pool_size - 1, device=selected_windows.device)
    tail_slots = query_slots[..., None] - tail_length[..., None] + 1 + within_tail
    tail_valid = within_tail < tail_length[..., None]
    slots = torch.cat([window_slots.flatten(-2), tail_slots], dim=-1)
    valid = torch.cat([window_valid.flatten(-2), tail_valid], dim=-1)
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
    batch_index = torch.arange(batch_size, device=key.device)[:, None]
    query_chunk = max(1, GATHER_BLOCK_ELEMENTS // max(1, batch_size * slots_per_query * num_kv_heads * head_dim))

    outputs, weights = [], None
    if return_weights:
        weights = query.new_zeros(batch_size, num_heads, num_queries, num_slots, dtype=torch.float32)
    for start in range(0, num_queries, query_chunk):
        end = min(start + query_chunk, num_queries)
        slots, valid = attention_slots(
            selected_windows[:, start:end], window_slot_offset, query_slots[:, start:end],
            tail_length[:, start:end], pool_size,
        )
        # Advanced indexing gathers only the selected slots (the cache may be a strided view of larger storage).
        gathered_shape = (batch_size, end - start, slots_per_query, num_kv_heads, head_dim)
        flat_slots = slots.flatten(1)
        chunk_key = key[batch_index, :, flat_slots].view(gathered_shape)  # [b, t * l, kv_heads, d] -> 5-D
        chunk_value = value[batch_index, :, flat_slots].view(gathered_shape)
        # [b, kv_heads, group, t, d] grouped queries against [b, t, l, kv_heads, d] gathered keys
        chunk_query = query[:, :, start:end].reshape(batch_size, num_kv_heads, group, end - start, head_dim)
        scores = torch.einsum("bkgtd,btlkd->bkgtl", chunk_query.float(), chunk_key.float()) * scaling
        probs = masked_softmax(scores, valid[:, None, None])
        if training and dropout > 0.0:
            probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
        out = torch.einsum("bkgtl,btlkd->btkgd", probs, chunk_value.float())
        outputs.append(out.reshape(batch_size, end - start, num_heads, head_dim).to(query.dtype))
        if return_weights:
            scatter_index = slots[:, None].expand(batch_size, num_heads, end - start, slots_per_query)
            weights[:, :, start:end].scatter_add_(
                -1, scatter_index, probs.reshape(batch_size, num_heads, end - start, slots_per_query)
            )
    return torch.cat(outputs, dim=1), weights
