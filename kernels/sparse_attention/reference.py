"""PyTorch reference of IndexPool sparse attention.

Keys and values are stored by position (the cache's layout): window `c` of a row is its entries `c * r .. c * r + r
- 1`. Each query attends to the raw keys/values of its selected windows plus its tail, the entries of its own open
window up to itself (`r * ((p + 1) // r) .. p` for a query at position `p`). Query heads are grouped (GQA): the
heads that share a key/value head also share the selection. Queries go in chunks, so memory is bounded by
`query_chunk x (topk * pool_size + pool_size - 1)` gathered keys, never by the sequence length squared.
"""

import functools
from dataclasses import dataclass

import torch

# Gathered key/value elements per query chunk (32 MiB in float32 for keys and values together): small enough that
# the allocator reuses the memory instead of faulting in fresh pages for every chunk.
GATHER_BLOCK_ELEMENTS = 1 << 22


def tail_slots(query_positions: torch.Tensor, pool_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[batch, queries, pool_size - 1]` positions of each query's tail (clamped to be gatherable) and which are
    valid; the tail ends at the query's own position."""
    tail_length = (query_positions + 1) % pool_size
    within_tail = torch.arange(pool_size - 1, device=query_positions.device)
    slots = query_positions[..., None] - tail_length[..., None] + 1 + within_tail
    valid = within_tail < tail_length[..., None]
    return slots.clamp(min=0).masked_fill(~valid, 0), valid


def attention_slots(selected_windows: torch.Tensor, query_positions: torch.Tensor,
                    pool_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions each query attends to, `[batch, queries, topk * pool_size + pool_size - 1]` (window entries in
    window order, then the tail; clamped to be gatherable), and which of them are valid."""
    within_window = torch.arange(pool_size, device=selected_windows.device)
    window_slots = selected_windows[..., None] * pool_size + within_window
    window_valid = (selected_windows >= 0)[..., None].expand_as(window_slots)
    tail, tail_valid = tail_slots(query_positions, pool_size)
    slots = torch.cat([window_slots.flatten(-2), tail], dim=-1)
    valid = torch.cat([window_valid.flatten(-2), tail_valid], dim=-1)
    return slots.clamp(min=0).masked_fill(~valid, 0), valid


def _position_rows(tensor: torch.Tensor) -> torch.Tensor:
    """`[batch, positions, kv_heads * head_dim]` rows of a `[batch, kv_heads, positions, head_dim]` tensor (a view
    when each position's heads are adjacent in memory, as in the cache)."""
    rows = tensor.transpose(1, 2)
    return rows.reshape(rows.shape[0], rows.shape[1], -1)


def gather_positions(rows: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`[batch, n, width]` rows of `rows` `[batch, positions, width]` at `positions` `[batch, ...]` (n entries per
    row), written into `out` when given (not differentiable then)."""
    batch_size, num_positions, width = rows.shape
    row_offsets = num_positions * torch.arange(batch_size, device=rows.device)[:, None]
    flat_index = positions.reshape(batch_size, -1) + row_offsets
    flat_rows = rows.reshape(batch_size * num_positions, width)
    if out is None:
        return flat_rows.index_select(0, flat_index.flatten()).view(batch_size, -1, width)
    torch.index_select(flat_rows, 0, flat_index.flatten(), out=out.view(-1, width))
    return out


def gather_windows(rows: torch.Tensor, windows: torch.Tensor, pool_size: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """`[batch, n, pool_size * width]`: each selected window's `pool_size` entries as one row, from `rows`
    `[batch, positions, width]`; negative ids read window 0 (callers mask them). One index per window instead of one
    per entry: the copy runs in rows `pool_size` times longer."""
    batch_size, num_positions, width = rows.shape
    num_windows = num_positions // pool_size
    if num_windows == 0:  # no complete window anywhere: every id is masked
        empty = rows.new_zeros(batch_size, windows[0].numel(), pool_size * width)
        return empty if out is None else out.view_as(empty).copy_(empty)
    window_rows = rows[:, : num_windows * pool_size].reshape(batch_size, num_windows, pool_size * width)
    return gather_positions(window_rows, windows.clamp(min=0, max=num_windows - 1), out)


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
    query_positions: torch.Tensor,
    pool_size: int,
    scaling: float,
    dropout: float = 0.0,
    training: bool = False,
    return_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of every query over its selected windows and its tail.

    Args:
        query: `[batch, heads, queries, head_dim]`.
        key, value: `[batch, kv_heads, positions, head_dim]`, stored by position.
        selected_windows: `[batch, queries, topk]` window ids, `-1` for none.
        query_positions: `[batch, queries]` position of each query (its tail ends there).
        pool_size: tokens per window.
        scaling: multiplier of the dot products.
        dropout, training: attention dropout, applied in training only.
        return_weights: compute densely and also return the attention weights `[batch, heads, queries, positions]`
            (for inspection on short inputs only).

    Returns:
        Output `[batch, queries, heads, head_dim]` and the weights or None.
    """
    if return_weights:
        return _attention_with_weights(query, key, value, selected_windows, query_positions, pool_size, scaling,
                                       dropout, training)
    batch_size, num_heads, num_queries, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    topk = selected_windows.shape[-1]
    slots_per_query = topk * pool_size + pool_size - 1
    query_chunk = max(1, GATHER_BLOCK_ELEMENTS // max(1, batch_size * slots_per_query * num_kv_heads * head_dim))

    output = query.new_empty(batch_size, num_queries, num_heads, head_dim)
    window_length = topk * pool_size
    width = num_kv_heads * head_dim
    key_rows, value_rows = _position_rows(key), _position_rows(value)
    # Rows per query and width of each gathered part: window keys, window values, tail keys, tail values.
    parts = [(topk, pool_size * width)] * 2 + [(pool_size - 1, width)] * 2
    buffers = [None] * 4
    if num_queries > query_chunk and not (torch.is_grad_enabled() and (key.requires_grad or value.requires_grad)):
        # Inference over several chunks: every chunk gathers into the same (flat) buffers. Fresh tensors of this size
        # would each fault in new pages, which costs more than the gather itself.
        buffers = [key.new_empty(batch_size * query_chunk * rows * row_width) for rows, row_width in parts]
    for start in range(0, num_queries, query_chunk):
        end = min(start + query_chunk, num_queries)
        windows = selected_windows[:, start:end]
        positions = query_positions[:, start:end]
        tail, tail_valid = tail_slots(positions, pool_size)
        valid = torch.cat([(windows >= 0).repeat_interleave(pool_size, dim=-1), tail_valid], dim=-1)
        window_out, window_value_out, tail_out, tail_value_out = (
            None if buffer is None else buffer[: batch_size * (end - start) * rows * row_width].view(
                batch_size, end - start, rows, row_width)
            for buffer, (rows, row_width) in zip(buffers, parts)
        )
        # Whole windows (every entry and head) as rows; the cache's position-major storage makes them contiguous.
        window_shape = (batch_size, end - start, window_length, num_kv_heads, head_dim)
        tail_shape = (batch_size, end - start, pool_size - 1, num_kv_heads, head_dim)
        window_key = gather_windows(key_rows, windows, pool_size, window_out).view(window_shape).float()
        window_value = gather_windows(value_rows, windows, pool_size, window_value_out).view(window_shape).float()
        tail_key = gather_positions(key_rows, tail, tail_out).view(tail_shape).float()
        tail_value = gather_positions(value_rows, tail, tail_value_out).view(tail_shape).float()
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
    return output, None


def _attention_with_weights(query, key, value, selected_windows, query_positions, pool_size, scaling, dropout,
                            training):
    """The same attention computed densely, for inspection on short inputs: the returned weights
    `[batch, heads, queries, positions]` are the ones the output is computed from (so they carry gradients)."""
    num_heads, num_kv_heads, num_positions = query.shape[1], key.shape[1], key.shape[2]
    slots, valid = attention_slots(selected_windows, query_positions, pool_size)
    allowed = torch.zeros(*slots.shape[:2], num_positions + 1, dtype=torch.bool, device=slots.device)
    allowed = allowed.scatter(-1, slots.masked_fill(~valid, num_positions), True)[..., :num_positions]
    group = num_heads // num_kv_heads
    key, value = key.repeat_interleave(group, dim=1).float(), value.repeat_interleave(group, dim=1).float()
    weights = masked_softmax((query.float() @ key.transpose(-1, -2)) * scaling, allowed[:, None])
    probs = torch.nn.functional.dropout(weights, p=dropout, training=True) if training and dropout > 0.0 else weights
    return (probs @ value).transpose(1, 2).to(query.dtype), weights


def sparse_latent_attention_torch(
    query: torch.Tensor,
    latents: torch.Tensor,
    selected_windows: torch.Tensor,
    query_positions: torch.Tensor,
    pool_size: int,
    scaling: float,
    dropout: float = 0.0,
    training: bool = False,
    return_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """MLA's absorbed sparse attention: every query head attends over the same latents, which are both the keys and
    the values (FlashMLA's sparse decode shape), each selected window and tail gathered once for all heads.

    Args:
        query: `[batch, heads, queries, latent_dim]`, the queries with the key expansion absorbed.
        latents: `[batch, 1, positions, latent_dim]`, stored by position.
        selected_windows, query_positions, pool_size, scaling, dropout, training, return_weights: as in
            `sparse_attention_torch`.

    Returns:
        Output latents `[batch, queries, heads, latent_dim]` (the value expansion is applied after) and the weights
        `[batch, heads, queries, positions]` or None.
    """
    if return_weights:
        return _attention_with_weights(query, latents, latents, selected_windows, query_positions, pool_size,
                                       scaling, dropout, training)
    batch_size, num_heads, num_queries, latent_dim = query.shape
    topk = selected_windows.shape[-1]
    slots_per_query = topk * pool_size + pool_size - 1
    query_chunk = max(1, GATHER_BLOCK_ELEMENTS // max(1, batch_size * slots_per_query * latent_dim))
    rows = latents[:, 0]  # [batch, positions, latent_dim]
    outputs = []
    for start in range(0, num_queries, query_chunk):
        end = min(start + query_chunk, num_queries)
        windows = selected_windows[:, start:end]
        tail, tail_valid = tail_slots(query_positions[:, start:end], pool_size)
        valid = torch.cat([(windows >= 0).repeat_interleave(pool_size, dim=-1), tail_valid], dim=-1)
        gathered = torch.cat([
            gather_windows(rows, windows, pool_size).view(batch_size, end - start, topk * pool_size, latent_dim),
            gather_positions(rows, tail).view(batch_size, end - start, pool_size - 1, latent_dim),
        ], dim=2).float()  # [b, t, slots, c]: keys and values at once
        chunk_query = query[:, :, start:end].transpose(1, 2).float()  # [b, t, heads, c]
        probs = masked_softmax(torch.matmul(chunk_query, gathered.transpose(-1, -2)) * scaling, valid[:, :, None])
        if training and dropout > 0.0:
            probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
        outputs.append(torch.matmul(probs, gathered).to(query.dtype))
    return torch.cat(outputs, dim=1), None


# Queries of a paged step attended at once (the vLLM layer's chunk): bounds the gathered keys/values to
# `PAGED_QUERY_CHUNK x (topk * pool_size + pool_size - 1)` rows, whatever the step's token count.
PAGED_QUERY_CHUNK = 256
# Bytes of one float32 tensor of gathered keys (or values) of those queries: fewer queries at once where a query's
# gathered rows are many. CPU allocators hand blocks much larger than this back to the system when freed, and the
# next chunk pays a page fault per 4 KiB written (measured: converting 17 MB to float32 4-5x slower than in 4 MB parts).
PAGED_GATHER_CHUNK_BYTES = 4 << 20
# Bytes of the keys, values (float32) and scores of the request tiles attended at once (`RequestTiles`).
PAGED_TILE_CHUNK_BYTES = 128 << 20
# Reading a request's positions densely (masked to the selection) beats gathering each query's selected positions
# while the positions read are at most this many times the positions a query selects. Measured on a CPU (AVX2, one
# thread, bf16 keys, budget 1024, head dim 128, whole windows gathered): a 2048-query chunk reading 8192 positions
# takes 1.6 s in tiles of 64 and 2.0 s gathered; 16 decodes gather in 15-25 ms at 900 to 8192 positions, against
# 40-500 ms read densely one query at a time, which wins only at a few hundred positions (10 ms against 13 at 300).
DENSE_POSITIONS_PER_SELECTED = {"tiles": 10, "alone": 0.5}


@dataclass(frozen=True)
class TileGroup:
    """Tiles of queries, each tile of one request, attended against the first `num_positions` positions of their
    request (the tiles' last queries' positions need no more)."""

    tile_tokens: torch.Tensor  # [tiles, width] int64: each tile's tokens, all of one request (the last repeated)
    tile_request: torch.Tensor  # [tiles] int64
    tokens: torch.Tensor  # [tiled tokens] int64: the tokens of these tiles
    places: torch.Tensor  # [tiled tokens] int64: each one's row in the flattened tiles
    num_positions: int


@dataclass(frozen=True)
class RequestTiles:
    """A paged step's queries grouped for reading each request's positions once (the PyTorch path's prefill form):
    the queries of long chunks in tiles of one request each, attended against their request's positions with each
    query masked to its windows and tail, instead of gathering every query's positions on its own. Tiles are grouped
    by the positions they read (so that a short request's chunk does not read as far as the step's longest); the
    other tokens (decodes, short chunks, padding) one at a time the same way. Each form is used while its positions
    read are at most `DENSE_POSITIONS_PER_SELECTED` times the positions a query selects; beyond, its tokens
    gather."""

    groups: tuple[TileGroup, ...]
    other_tokens: torch.Tensor  # [other tokens] int64: every token of no tile
    num_positions: int  # positions read for each other token: beyond every query's position


def paged_sparse_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    token_request: torch.Tensor,
    selected_windows: torch.Tensor,
    query_positions: torch.Tensor,
    pool_size: int,
    scaling: float,
    output_gate: torch.Tensor | None = None,
    request_tiles: RequestTiles | None = None,
) -> torch.Tensor:
    """Sparse attention of a step's flattened tokens (any mix of requests, prefill chunks and decodes) over keys and
    values in vLLM's pages: what the vLLM layer computed in PyTorch, `PAGED_QUERY_CHUNK` queries at a time.

    Position `s` of request `q` lives in page `block_table[q, s // block_size]`, row `s % block_size`. A token attends
    to every position of its selected windows and to its open window up to itself, as `sparse_attention_torch`;
    float32 inside, no host read, shapes set by the token count and `topk` only (and by `request_tiles`' sizes).

    Args:
        query: `[tokens, heads, head_dim]`.
        key_cache, value_cache: `[num_blocks, kv_heads, block_size, head_dim]`, any views whose last dimension is
            contiguous (vLLM's keys and values are the two halves `kv[..., :d]`, `kv[..., d:]` of one cache).
        block_table: `[requests, max_blocks]` (int32 or int64) pages of each request.
        token_request: `[tokens]` request of each token (a row of `block_table`).
        selected_windows: `[tokens, topk]` window ids, ascending, `-1` for none (after the last).
        query_positions: `[tokens]` (int64) position of each token in its request.
        pool_size: tokens per window `r`.
        scaling: multiplier of the dot products.
        output_gate: optional `[tokens, heads, head_dim]`: the output is multiplied by its sigmoid (the model's
            output gate), in the output dtype.
        request_tiles: optional `RequestTiles`: where its positions are few enough, each request's positions are
            read once for a tile of its queries (the same attention, masked), not gathered for every query.

    Returns:
        Output `[tokens, heads, head_dim]` in the query's dtype; zeros for a token with nothing to attend to.
    """
    selected_positions = selected_windows.shape[-1] * pool_size + pool_size - 1

    def dense_for(num_positions: int, kind: str) -> bool:
        return num_positions <= DENSE_POSITIONS_PER_SELECTED[kind] * selected_positions

    gather = functools.partial(_gathered_attention, key_cache=key_cache, value_cache=value_cache,
                               block_table=block_table, pool_size=pool_size, scaling=scaling)

    def gather_for(tokens: torch.Tensor) -> torch.Tensor:
        return gather(query[tokens], token_request=token_request[tokens], selected_windows=selected_windows[tokens],
                      query_positions=query_positions[tokens])

    if request_tiles is None:
        output = gather(query, token_request=token_request, selected_windows=selected_windows,
                        query_positions=query_positions)
    else:
        output = torch.empty_like(query)
        dense = functools.partial(_dense_attention, query, key_cache, value_cache, block_table, selected_windows,
                                  query_positions, pool_size, scaling)
        for group in request_tiles.groups:
            if dense_for(group.num_positions, "tiles"):
                tiled = dense(group.tile_tokens, group.tile_request, num_positions=group.num_positions)
                output[group.tokens] = tiled.flatten(0, 1)[group.places]
            else:
                output[group.tokens] = gather_for(group.tokens)
        others = request_tiles.other_tokens
        if dense_for(request_tiles.num_positions, "alone"):
            output[others] = dense(others[:, None], token_request[others],
                                   num_positions=request_tiles.num_positions)[:, 0]
        else:
            output[others] = gather_for(others)
    if output_gate is not None:
        # Contiguous as the layer's `[tokens, heads * head_dim]` gate (a copy of the query projection's half): ATen's
        # CPU sigmoid rounds strided float32 inputs differently (1 ulp).
        output = (output * torch.sigmoid(output_gate.contiguous())).to(query.dtype)
    return output


def _gathered_attention(query, key_cache, value_cache, block_table, token_request, selected_windows,
                        query_positions, pool_size, scaling) -> torch.Tensor:
    """Each token's selected windows and open window gathered from the pages, at most `PAGED_QUERY_CHUNK` tokens (and
    on a CPU `PAGED_GATHER_CHUNK_BYTES` of gathered keys) at a time.

    A window's `r` rows follow each other in its page (the block size is a multiple of `r`), so whole windows are
    gathered (`r * head_dim` elements each, as one row where the cache's strides allow), not positions one by one."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group, r = num_heads // num_kv_heads, pool_size
    if block_size % r:
        raise ValueError(f"The block size ({block_size}) must be a multiple of the pool size ({r}).")
    windows_per_block = block_size // r
    window_caches = [_window_rows(cache, r) for cache in (key_cache, value_cache)]
    output = torch.empty_like(query)
    kv_head_ids = torch.arange(num_kv_heads, device=query.device)
    row_offsets = torch.arange(r, device=query.device)
    queries_per_chunk = PAGED_QUERY_CHUNK
    if query.device.type == "cpu":  # a GPU's caching allocator pays no page faults: fewer, larger chunks there
        gathered_bytes_per_query = 4 * num_kv_heads * (selected_windows.shape[-1] + 1) * r * head_dim
        queries_per_chunk = max(1, min(queries_per_chunk, PAGED_GATHER_CHUNK_BYTES // gathered_bytes_per_query))
    # float32 copies of the gathered keys and values, reused by every chunk (fresh memory costs a page fault per 4 KiB).
    buffers = [torch.empty(min(queries_per_chunk, num_tokens), num_kv_heads, (selected_windows.shape[-1] + 1) * r,
                           head_dim, device=query.device) for _ in range(2)]
    for start in range(0, num_tokens, queries_per_chunk):
        end = min(start + queries_per_chunk, num_tokens)
        chunk = end - start
        positions = query_positions[start:end]
        open_window = (positions + 1) // r  # the window holding the query (empty where the query closes one)
        windows = torch.cat([selected_windows[start:end], open_window[:, None]], dim=-1)  # [chunk, topk + 1]
        # Every row of a selected window; the open window's rows up to the query.
        valid = torch.cat([(selected_windows[start:end] >= 0)[..., None].expand(-1, -1, r),
                           (open_window * r)[:, None, None] + row_offsets <= positions[:, None, None]], dim=1)
        valid = valid.flatten(1)  # [chunk, (topk + 1) * r]
        windows = windows.clamp(min=0)
        columns = (windows // windows_per_block).clamp(max=block_table.shape[1] - 1)
        blocks = block_table[token_request[start:end, None], columns].long()  # [chunk, topk + 1]
        window_in_block = windows % windows_per_block
        gathered = []
        for cache, rows, buffer in zip((key_cache, value_cache), window_caches, buffers, strict=True):
            if rows is not None:  # one row per (block, kv head, window): a plain row gather
                index = (blocks[:, None] * num_kv_heads + kv_head_ids[:, None]) * windows_per_block
                index = index + window_in_block[:, None]  # [chunk, kv_heads, topk + 1]
                part = rows.index_select(0, index.flatten())
            else:
                part = cache.unflatten(2, (windows_per_block, r))[blocks[:, None], kv_head_ids[:, None],
                                                                  window_in_block[:, None]]
            # [chunk, kv_heads, slots, d]
            gathered.append(buffer[:chunk].copy_(part.view(chunk, num_kv_heads, -1, head_dim)))
        key, value = gathered
        # Rows past a query in its open window may never have been written (NaN in vLLM's fresh pages): a zero
        # weight does not cancel them, so their values read as zeros.
        value.masked_fill_(~valid[:, None, :, None], 0.0)
        chunk_query = query[start:end].reshape(chunk, num_kv_heads, group, head_dim).float()
        scores = torch.matmul(chunk_query, key.transpose(-1, -2)) * scaling  # [chunk, kv_heads, group, slots]
        probs = masked_softmax(scores, valid[:, None, None])
        output[start:end] = torch.matmul(probs, value).reshape(chunk, num_heads, head_dim).to(query.dtype)
    return output


def _window_rows(cache: torch.Tensor, pool_size: int) -> torch.Tensor | None:
    """`[blocks * kv_heads * windows per block, r, head_dim]`: a view of a paged cache with one row per window, or
    None where its strides do not allow one (any view whose blocks, heads and rows are not evenly strided)."""
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    try:
        return cache.view(num_blocks * num_kv_heads * (block_size // pool_size), pool_size, head_dim)
    except RuntimeError:
        return None


def _dense_attention(query, key_cache, value_cache, block_table, selected_windows, query_positions, pool_size,
                     scaling, tile_tokens, tile_request, num_positions: int) -> torch.Tensor:
    """`[tiles, width, heads, head_dim]`: the queries `tile_tokens [tiles, width]` of each tile's request
    `tile_request [tiles]` against that request's first `num_positions` positions (whole blocks, read once per tile),
    masked to each query's selected windows and open window."""
    num_tiles, width = tile_tokens.shape
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group, r = num_heads // num_kv_heads, pool_size
    num_blocks = -(-num_positions // block_size)
    num_positions = num_blocks * block_size
    columns = torch.arange(num_blocks, device=query.device).clamp(max=block_table.shape[1] - 1)
    positions_read = torch.arange(num_positions, device=query.device)
    window_of_position = positions_read // r
    output = query.new_empty(num_tiles, width, num_heads, head_dim)
    tile_bytes = 4 * num_positions * (2 * num_kv_heads * head_dim + 3 * width * num_heads)
    tiles_per_chunk = max(1, min(num_tiles, PAGED_TILE_CHUNK_BYTES // tile_bytes))
    # The pages read (cache dtype) and their float32 keys and values, reused by every chunk (fresh memory costs a
    # page fault per 4 KiB).
    pages = [key_cache.new_empty(tiles_per_chunk * num_blocks, num_kv_heads, block_size, head_dim) for _ in range(2)]
    buffers = [torch.empty(tiles_per_chunk, num_kv_heads, num_positions, head_dim, device=query.device)
               for _ in range(2)]
    for start in range(0, num_tiles, tiles_per_chunk):
        end = min(start + tiles_per_chunk, num_tiles)
        tokens = tile_tokens[start:end]  # [chunk, width]
        blocks = block_table[tile_request[start:end, None], columns].long()  # [chunk, blocks]
        keys, values = (
            # [chunk * blocks, kv_heads, block_size, d] -> [chunk, kv_heads, positions, d]
            buffer[: end - start].view(end - start, num_kv_heads, num_blocks, block_size, head_dim).copy_(
                torch.index_select(cache, 0, blocks.flatten(), out=read[: blocks.numel()])
                .view(end - start, num_blocks, num_kv_heads, block_size, head_dim).transpose(1, 2))
            .view(end - start, num_kv_heads, num_positions, head_dim)
            for cache, read, buffer in zip((key_cache, value_cache), pages, buffers, strict=True))
        positions = query_positions[tokens]  # [chunk, width]
        # Rows past the tile's last query were never written (vLLM's pages start uninitialised: NaN or stale rows
        # would leak through the masked softmax's zero weights), so they read as zeros.
        unwritten = positions_read > positions.amax(-1, keepdim=True)  # [chunk, positions]
        keys.masked_fill_(unwritten[:, None, :, None], 0.0)
        values.masked_fill_(unwritten[:, None, :, None], 0.0)
        # Allowed positions: those of the selected windows (a window id past the read range marks none) and the
        # open window up to the query.
        windows = selected_windows[tokens]  # [chunk, width, topk]
        num_windows = num_positions // r
        chosen = torch.zeros(end - start, width, num_windows + 1, dtype=torch.bool, device=query.device)
        chosen.scatter_(-1, windows.masked_fill(windows < 0, num_windows).clamp(max=num_windows), True)
        allowed = chosen[..., window_of_position]  # [chunk, width, positions]
        open_start = (positions + 1) // r * r
        allowed |= (positions_read >= open_start[..., None]) & (positions_read <= positions[..., None])
        # PyTorch's fused attention (float32 inside, no score matrix kept), every head of a group on its key/value head.
        tile_query = query[tokens].float().transpose(1, 2)  # [chunk, heads, width, d]
        tile_output = torch.nn.functional.scaled_dot_product_attention(
            tile_query, keys, values, attn_mask=allowed[:, None], scale=scaling, enable_gqa=group > 1)
        # A query with nothing to attend to gives zeros (the fused attention's softmax of nothing is not).
        tile_output = tile_output.transpose(1, 2).masked_fill(~allowed.any(-1)[..., None, None], 0.0)
        output[start:end] = tile_output.reshape(end - start, width, num_heads, head_dim).to(query.dtype)
    return output
