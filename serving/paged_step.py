"""The IndexPool layer's batched step over paged caches, in plain tensors: nothing here imports vLLM.

The vLLM plugin (`indexpool_attention.py`) wraps these in vLLM's classes; `scripts/check_gpu.py` runs them on a GPU
machine where vLLM is not installed, and the main test suite runs them on CPU.

Three caches per IndexPool layer, in vLLM's layouts (each a cache layer of its own in vLLM's memory model):

- main keys/values `[blocks, kv_heads, block_size, 2 * head_dim]` (key, then value, per slot), one row per token;
- pooled indexer keys `[blocks, block_size // r, 1, width]`, one row per window of `r` tokens, paged with the
  request's blocks: `width = index_head_dim` in the model's dtype, or `index_head_dim + 4` bytes (uint8) of packed fp8
  keys (`kernels/fp8_index_keys`);
- the open-window ring `[ring blocks, R, 1, index_head_dim + gate_width]`: each request's last `R` raw indexer keys
  and pooling-gate logits (one block per request), token `p` at row `p % R`. `R = r` without speculative decoding;
  with drafts of up to `k` tokens `R` is a multiple of `r` of at least `r + k - 1` rows (`ring_capacity`), so that the
  rows a rejected draft wrote never hold a token of the open window the next step pools.

A step is any mix of prefill chunks and decodes. `PagedMetadataBuilder.build` runs once per step and cache and puts
everything that needs the host (token -> request, positions, write destinations, the selection's tiles and window
bound) into persistent device buffers; `indexpool_step` is then one batched computation over all the step's tokens
whose shapes depend on the token count, the tiles and the budget only, and which reads nothing back from the device:
it can be compiled whole and captured in a CUDA graph.
"""

import functools
import math
from dataclasses import dataclass

import torch

from ..kernels.fp8_index_keys import packed_width
from ..kernels.pooled_index_topk import paged_pooled_index_topk
from ..kernels.pooled_index_topk.reference import PAGED_SCORE_CHUNK_BYTES
from ..kernels.pooled_key_write import write_pooled_keys
from ..kernels.sparse_attention import (
    RequestTiles,
    TileGroup,
    paged_attention_reads_request_tiles,
    paged_sparse_attention,
)
from ..kernels.sparse_attention.reference import PAGED_QUERY_CHUNK

# Queries of one request scored together against its pooled keys (one tile); decode tokens are tiles of one query.
QUERY_TILE = 64
# Fewest windows scored per query: the builder rounds the longest scheduled context up to a power of two, at least
# this, so that the shapes of a step change only when the longest context crosses a power of two.
MIN_WINDOW_BOUND = 64
CACHE_KINDS = ("main", "pooled_keys", "open_window")


@dataclass
class SelectionTiles:
    """The queries one paged selection scores: tiles of `width` queries of one request each (a decode is a tile of
    one query), each against its request's windows `0 .. window_bound - 1`; `tiles * width` rows of scores."""

    tile_tokens: torch.Tensor  # [tiles, width] int64: each tile's queries (the last repeated to the end)
    tile_request: torch.Tensor  # [tiles] int64
    window_bound: int  # windows scored per row: >= the complete windows of every query of these tiles


@dataclass
class PagedCacheMetadata:
    """Per-step metadata of one of an IndexPool layer's caches, in device tensors the step reads without syncing.

    Padding tokens (beyond the scheduled ones, or of dummy requests whose blocks are the null block) take every
    per-token field of the step's last real token, so their writes repeat its writes bit for bit; `write_keep` is
    False only in a step without any real token, whose writes put back what the destinations hold.
    """

    num_actual_tokens: int
    block_table: torch.Tensor  # [requests, blocks] of this cache
    token_request: torch.Tensor  # [tokens] int64
    token_position: torch.Tensor  # [tokens] int64
    write_token: torch.Tensor  # [tokens] int64: whose data each token writes
    write_block: torch.Tensor  # [tokens] int64
    write_row: torch.Tensor  # [tokens] int64: offset in the block (main), window row (pooled keys), ring row
    write_keep: torch.Tensor  # [tokens] bool
    # Main cache only: the selection's tiles and bounds.
    num_visible_windows: torch.Tensor | None = None  # [tokens] int64: complete windows each token sees
    window_bound: int = 0  # the largest of the selection tiles' bounds: >= every request's complete windows
    selection_tiles: tuple["SelectionTiles", ...] = ()  # one paged selection each: decodes, then prefill chunks
    token_tile: torch.Tensor | None = None  # [tokens] int64: each token's row in the selection tiles' rows, in order
    request_tiles: RequestTiles | None = None  # the PyTorch attention's grouping of the queries by request
    # Open-window ring only: where the rows of each token's window come from.
    window_token: torch.Tensor | None = None  # [tokens, r] int64: this step's token holding each row, or -1
    window_ring_row: torch.Tensor | None = None  # [tokens] int64: ring block * R + ring row of the window's first token


class PagedMetadataBuilder:
    """Everything the step needs from the host for one cache (`kind`: `main`, `pooled_keys` or `open_window`),
    computed once per step into persistent buffers of `max_num_tokens` tokens and `max_num_requests` requests.

    Reads on the host only what an engine holds there anyway (the query start offsets, the longest query and
    context, the requests' lengths where given); the rest is device work.

    The selection scores each query against a bound of windows, a power of two at least every visible window of the
    tiles' requests: decodes and prefill chunks each against their own longest context (decodes one row each, chunks
    in tiles of `QUERY_TILE`), so that a step's scores are at most about twice its queries' visible windows. Only a
    step that a full CUDA graph replays keeps the captured shapes: with `full_graphs` (vLLM's resolved graph mode has
    full graphs; settable, as the vLLM builder reads that mode per step), a uniform single-token decode batch of at
    most `max_graph_tokens` tokens is scored against every window a request can reach (`max_model_len / r`).
    """

    def __init__(self, kind: str, pool_size: int, block_size: int, max_model_len: int, max_num_tokens: int,
                 max_num_requests: int, device: torch.device, full_graphs: bool = False,
                 max_graph_tokens: int | None = None, metadata_class: type = PagedCacheMetadata):
        if kind not in CACHE_KINDS:
            raise ValueError(f"kind must be one of {CACHE_KINDS}, got {kind!r}")
        if block_size % pool_size:
            raise ValueError(f"The block size ({block_size}) must be a multiple of the pool size ({pool_size}).")
        self.kind, self.pool_size, self.block_size, self.device = kind, pool_size, block_size, device
        self.metadata_class = metadata_class
        self.max_windows = -(-max_model_len // pool_size)
        self.full_graphs, self.max_graph_tokens = full_graphs, max_graph_tokens
        buffer = functools.partial(torch.empty, dtype=torch.long, device=device)
        self.token_buffers = {name: buffer(max_num_tokens) for name in (
            "token_request", "token_position", "write_token", "write_block", "write_row", "num_visible_windows",
            "token_tile", "window_ring_row")}
        self.write_keep_buffer = torch.empty(max_num_tokens, dtype=torch.bool, device=device)
        self.window_token_buffer = buffer(max_num_tokens, pool_size)
        self.tile_tokens_buffer = buffer(max_num_tokens + max_num_requests * QUERY_TILE)
        self.tile_request_buffer = buffer(max_num_tokens + max_num_requests)
        # The PyTorch attention's request tiles: built only where the attention takes that path.
        self.request_tile_buffers = None
        if kind == "main" and paged_attention_reads_request_tiles(device):
            self.request_tile_buffers = {
                "tile_tokens": buffer(max_num_tokens + max_num_requests * QUERY_TILE),
                "tile_request": buffer(max_num_tokens + max_num_requests),
                **{name: buffer(max_num_tokens) for name in ("tokens", "places", "other_tokens")}}

    def build(self, num_tokens: int, num_requests: int, query_start_loc_cpu: torch.Tensor,
              query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
              slot_mapping: torch.Tensor, max_query_len: int, max_seq_len: int,
              seq_lens_cpu: torch.Tensor | None = None) -> PagedCacheMetadata:
        """The metadata of a step of `num_tokens` tokens (scheduled ones first, then padding) of `num_requests`
        requests: `query_start_loc[_cpu] [requests + 1]` their token offsets (device and host copies),
        `seq_lens [requests]` their lengths after the step, `block_table [requests, blocks]` this cache's blocks,
        `slot_mapping [tokens]` the main cache's slot of each token (read for `main` only), `seq_lens_cpu` optional
        host upper bounds of the requests' lengths (vLLM's `seq_lens_cpu_upper_bound`: the PyTorch attention's tiles
        then read no further than their queries need)."""
        r = self.pool_size
        starts_cpu = query_start_loc_cpu[: num_requests + 1]
        query_lens_cpu = (starts_cpu[1:] - starts_cpu[:-1]).long()
        num_scheduled = int(starts_cpu[-1])
        out = {name: buffer[:num_tokens] for name, buffer in self.token_buffers.items()}

        # Token -> request from the host copy (requests of zero tokens own none); tokens beyond them are padding.
        token_request = torch.repeat_interleave(torch.arange(num_requests), query_lens_cpu)
        token_request = torch.cat([token_request, token_request.new_full((num_tokens - num_scheduled,),
                                                                          max(num_requests - 1, 0))])
        request = out["token_request"].copy_(token_request, non_blocking=True)
        tokens = torch.arange(num_tokens, device=self.device)
        starts = query_start_loc.long()
        first_token, end_token = starts[request], starts[request + 1]
        position = seq_lens.long()[request] - (end_token - first_token) + tokens - first_token
        column = 0 if self.kind == "open_window" else (position // self.block_size).clamp(0, block_table.shape[1] - 1)
        # Dummy requests (warm-up and capture runs) have null-block rows: their tokens are padding too.
        real = (tokens < num_scheduled) & (position >= 0) & (block_table[request, column] > 0)
        last_real = torch.where(real, tokens, -1).amax() if num_tokens else tokens.new_tensor(-1)
        source = torch.where(real, tokens, last_real.clamp(min=0))
        request, position = out["token_request"].copy_(request[source]), position[source]
        first_token, end_token = first_token[source], end_token[source]
        out["token_position"].copy_(position)
        keep = self.write_keep_buffer[:num_tokens].copy_((last_real >= 0).expand(num_tokens))

        metadata = dict(num_actual_tokens=num_tokens, block_table=block_table, write_keep=keep)
        if self.kind == "main":
            slot = slot_mapping[:num_tokens].long()[source]
            write_token, block, row = source, slot // self.block_size, slot % self.block_size
            out["num_visible_windows"].copy_((position + 1) // r)
            metadata.update(self._tiles(query_lens_cpu, starts_cpu, num_tokens, num_scheduled, max_query_len,
                                        max_seq_len, out["token_tile"], seq_lens_cpu))
            metadata["num_visible_windows"] = out["num_visible_windows"]
        elif self.kind == "pooled_keys":
            # Every token writes the pooled key of its window, computed at the window's last token of the step:
            # a complete window's key, or one a later step overwrites before any query sees the window.
            write_token = torch.minimum(source + (r - 1) - position % r, end_token - 1)
            window = position // r
            column = (window * r // self.block_size).clamp(max=block_table.shape[1] - 1)
            block, row = block_table[request, column].long(), window % (self.block_size // r)
        else:
            # Of the step's tokens sharing a ring row, the last one's row stays: every earlier token writes it too.
            capacity = self.block_size  # ring rows R, a multiple of r
            last_token = end_token - 1
            write_token = source + capacity * ((last_token - source) // capacity)
            block, row = block_table[request, 0].long(), position % capacity
            # The r rows of each token's window: this step's tokens, the earlier ones from the ring.
            rows = (position // r * r)[:, None] + torch.arange(r, device=self.device)
            step_start = position - (source - first_token)
            from_step = rows >= step_start[:, None]
            window_token = torch.minimum(first_token[:, None] + rows - step_start[:, None], last_token[:, None])
            metadata["window_token"] = self.window_token_buffer[:num_tokens].copy_(
                torch.where(from_step, window_token, -1))
            metadata["window_ring_row"] = out["window_ring_row"].copy_(block * capacity + position // r * r % capacity)
        no_write = ~keep
        metadata.update(
            token_request=request, token_position=out["token_position"],
            write_token=out["write_token"].copy_(write_token),
            write_block=out["write_block"].copy_(block.masked_fill(no_write, 0)),
            write_row=out["write_row"].copy_(row.masked_fill(no_write, 0)),
        )
        return self.metadata_class(**metadata)

    def replays_full_graph(self, num_tokens: int, max_query_len: int) -> bool:
        """Whether a full CUDA graph replays a step of `num_tokens` tokens whose longest query is `max_query_len`
        (the step must keep the captured shapes): a uniform single-token decode batch within the captured sizes."""
        return self.full_graphs and max_query_len <= 1 and (self.max_graph_tokens is None
                                                            or num_tokens <= self.max_graph_tokens)

    def window_bound(self, longest_context: int) -> int:
        """Windows scored per query for requests of at most `longest_context` tokens: the power of two at or above
        their complete windows (at least `MIN_WINDOW_BOUND`, at most `max_model_len / r`), so that shapes change only
        when the longest context crosses a power of two."""
        needed = max(1, longest_context // self.pool_size)
        return min(self.max_windows, max(MIN_WINDOW_BOUND, 1 << (needed - 1).bit_length()))

    def _tiles(self, query_lens_cpu, starts_cpu, num_tokens, num_scheduled, max_query_len, max_seq_len, token_tile,
               seq_lens_cpu):
        """The selection's tiles (host arithmetic on the host copies) and the `RequestTiles` of the PyTorch attention.

        Decodes are tiles of one query, prefill chunks tiles of `min(QUERY_TILE, max_query_len)` queries; each tile's
        bound is `window_bound` of the context its last query sees (`seq_lens_cpu` where given, else `max_seq_len`
        for all), and tiles of one width and bound form one selection launch. A step a full graph replays is one
        launch of one tile per request (also of a request without queries) against `max_model_len / r` windows."""
        num_requests = len(query_lens_cpu)
        if self.replays_full_graph(num_tokens, max_query_len):
            kinds = [(torch.ones(num_requests, dtype=torch.bool), 1)]
        else:
            kinds = [(query_lens_cpu == 1, 1), (query_lens_cpu > 1, max(1, min(QUERY_TILE, max_query_len)))]
            if num_scheduled == 0:  # a step of no query: one tile per request keeps the launch well-formed
                kinds = [(torch.ones(num_requests, dtype=torch.bool), 1)]
        # Each scheduled token's row in the launches' rows; padding tokens read the first row (their output is unused).
        places = torch.zeros(num_tokens, dtype=torch.long)
        selection_tiles, used_tiles, used_rows = [], 0, 0
        for requests, width in kinds:
            if not requests.any():
                continue
            tile_request, tile_tokens, owner, valid = tile_requests(query_lens_cpu, starts_cpu, requests, width,
                                                                    num_tokens)
            valid &= owner < num_scheduled
            if self.replays_full_graph(num_tokens, max_query_len):
                bounds = torch.full((len(tile_request),), self.max_windows)
            elif seq_lens_cpu is None:
                bounds = torch.full((len(tile_request),), self.window_bound(max_seq_len))
            else:
                context_start = seq_lens_cpu[:num_requests].long() - query_lens_cpu
                last_query = torch.where(valid, owner, -1).amax(-1) - starts_cpu[:-1].long()[tile_request]
                seen = (context_start[tile_request] + last_query + 1).tolist()
                bounds = torch.tensor([self.window_bound(tokens) for tokens in seen], dtype=torch.long)
            for bound in sorted(set(bounds.tolist())):
                member = bounds == bound
                num_tiles = int(member.sum())
                member_tokens = tile_tokens[member]
                rows = torch.arange(used_rows, used_rows + num_tiles * width).view(num_tiles, width)
                places[owner[member][valid[member]]] = rows[valid[member]]
                selection_tiles.append(SelectionTiles(
                    tile_tokens=self.tile_tokens_buffer[used_rows: used_rows + num_tiles * width]
                    .view(num_tiles, width).copy_(member_tokens, non_blocking=True),
                    tile_request=self.tile_request_buffer[used_tiles: used_tiles + num_tiles].copy_(
                        tile_request[member], non_blocking=True),
                    window_bound=bound))
                used_tiles, used_rows = used_tiles + num_tiles, used_rows + num_tiles * width
        window_bound = max((tiles.window_bound for tiles in selection_tiles), default=MIN_WINDOW_BOUND)
        return dict(
            window_bound=window_bound,
            selection_tiles=tuple(selection_tiles),
            token_tile=token_tile.copy_(places, non_blocking=True),
            request_tiles=None if self.request_tile_buffers is None else self._request_tiles(
                query_lens_cpu, starts_cpu, num_tokens, window_bound * self.pool_size, seq_lens_cpu),
        )

    def _request_tiles(self, query_lens_cpu, starts_cpu, num_tokens, num_positions, seq_lens_cpu) -> RequestTiles:
        """Tiles of `QUERY_TILE` queries of the requests with at least half that many in the step, grouped by the
        positions they read: through their last query (where the host knows the requests' lengths, `seq_lens_cpu`)
        rounded up to an eighth of the step's `num_positions`; every other token (decodes, short chunks, padding) on
        its own."""
        tiled = query_lens_cpu >= QUERY_TILE // 2
        tile_request, tile_tokens, owner, valid = tile_requests(query_lens_cpu, starts_cpu, tiled, QUERY_TILE,
                                                                num_tokens)
        if seq_lens_cpu is None:
            reads = torch.full((len(tile_request),), num_positions)
        else:
            context_start = seq_lens_cpu[: len(query_lens_cpu)].long() - query_lens_cpu
            last_query = torch.where(valid, owner, -1).amax(-1) - starts_cpu[:-1].long()[tile_request]
            granularity = max(self.block_size, -(-num_positions // (8 * self.block_size)) * self.block_size)
            needed = context_start[tile_request] + last_query + 1
            reads = ((needed + granularity - 1) // granularity * granularity).clamp(max=num_positions)
        buffers = self.request_tile_buffers
        groups, used_tiles, used_tokens = [], 0, 0
        for read in sorted(set(reads.tolist())):
            member = reads == read
            num_tiles = int(member.sum())
            tokens = owner[member][valid[member]]
            group_places = torch.arange(num_tiles * QUERY_TILE).view(num_tiles, QUERY_TILE)[valid[member]]
            count = len(tokens)
            groups.append(TileGroup(
                tile_tokens=buffers["tile_tokens"][used_tiles * QUERY_TILE: (used_tiles + num_tiles) * QUERY_TILE]
                .view(num_tiles, QUERY_TILE).copy_(tile_tokens[member], non_blocking=True),
                tile_request=buffers["tile_request"][used_tiles: used_tiles + num_tiles].copy_(tile_request[member],
                                                                                              non_blocking=True),
                tokens=buffers["tokens"][used_tokens: used_tokens + count].copy_(tokens, non_blocking=True),
                places=buffers["places"][used_tokens: used_tokens + count].copy_(group_places, non_blocking=True),
                num_positions=int(read)))
            used_tiles, used_tokens = used_tiles + num_tiles, used_tokens + count
        is_tiled = torch.zeros(num_tokens, dtype=torch.bool)
        is_tiled[owner[valid]] = True
        other_tokens = torch.arange(num_tokens)[~is_tiled]
        return RequestTiles(
            groups=tuple(groups),
            other_tokens=buffers["other_tokens"][: len(other_tokens)].copy_(other_tokens, non_blocking=True),
            num_positions=num_positions,
        )


def tile_requests(query_lens_cpu: torch.Tensor, starts_cpu: torch.Tensor, requests: torch.Tensor, width: int,
                  num_tokens: int):
    """Host tiles of `width` queries over each request of the mask `requests` (at least one per request, also of a
    request without queries): `tile_request [tiles]`, `tile_tokens [tiles, width]` (a tile's last token repeated to
    its end), `owner [tiles, width]` (the token each entry would be) and `valid [tiles, width]` (it is one)."""
    counts = ((query_lens_cpu + width - 1) // width).clamp(min=1) * requests
    tile_request = torch.repeat_interleave(torch.arange(len(query_lens_cpu)), counts)
    tile_start = torch.cumsum(counts, 0) - counts
    tile_in_request = torch.arange(len(tile_request)) - tile_start[tile_request]
    first = starts_cpu[:-1].long()[tile_request] + tile_in_request * width
    last = (starts_cpu[1:].long()[tile_request] - 1).clamp(min=0)
    tile_tokens = torch.minimum(first[:, None] + torch.arange(width), last[:, None]).clamp(max=max(num_tokens - 1, 0))
    owner = first[:, None] + torch.arange(width)
    return tile_request, tile_tokens, owner, owner <= last[:, None]


@dataclass
class PagedCaches:
    """One IndexPool layer's three paged caches (layouts in the module's docstring)."""

    main: torch.Tensor
    pooled_keys: torch.Tensor
    open_window: torch.Tensor


@dataclass
class IndexPoolStepSettings:
    """The layer's sizes and the parameters its step reads besides the projections' outputs."""

    pool_size: int
    topk_windows: int  # windows selected per query
    sink_windows: int
    local_windows: int
    scaling: float  # of the main attention's scores
    weighting: str  # the indexer's pooling: `learned`, `learned_scalar`, `mean` or `prenorm_mean`
    key_norm_weight: torch.Tensor  # [index_head_dim]: the pooled key's RMSNorm (1 + weight)
    key_norm_eps: float
    pool_slot_bias: torch.Tensor | None  # [r, gate_width] with learned pooling
    cos_sin_cache: torch.Tensor  # [max_positions, rotary_dim]: cosines then sines, the pooled keys' RoPE


def pooled_key_width(index_head_dim: int, index_key_cache_dtype: str) -> tuple[int, torch.dtype | None]:
    """(row width, dtype or None for the model's) of the pooled-key cache: packed fp8 rows of `index_head_dim + 4`
    bytes, or keys in the model's dtype."""
    if index_key_cache_dtype == "float8_e4m3fn":
        return packed_width(index_head_dim), torch.uint8
    return index_head_dim, None


def step_working_memory_bytes(query: torch.Tensor, key: torch.Tensor, index_queries: torch.Tensor,
                              settings: IndexPoolStepSettings, max_windows: int, triton_path: bool) -> int:
    """An upper bound of the temporary memory of a step with these inputs' shapes, beyond the inputs and the output,
    on the path that will run (`triton_path`: the Triton kernels, on CUDA; else the PyTorch references), for a model
    of `max_windows` windows (`max_model_len / r`).

    Triton: the selection's peak over a chunk of tiles at the largest bound (`paged_selection_peak_bytes`) and the
    split attention's float32 partial outputs. PyTorch: the larger of the attention's gathers for one chunk of
    queries (keys and values of their windows, float32 copies, scores and probabilities) and the selection's chunk of
    scores."""
    num_tokens, num_heads, head_dim = query.shape
    topk = settings.topk_windows
    if triton_path:
        from ..kernels.launch import PROGRAMS_PER_SM
        from ..kernels.pooled_index_topk.triton_impl import paged_selection_peak_bytes

        # Decode tiles are one row per token; prefill tiles QUERY_TILE rows: the wider one bounds both.
        selection = paged_selection_peak_bytes(num_tokens + QUERY_TILE, QUERY_TILE, max_windows, topk)
        # Splits only where programs are few: at most about `PROGRAMS_PER_SM` per multiprocessor, one query-group
        # row of float32 (and its log-sum-exp) each.
        multiprocessors = torch.cuda.get_device_properties(query.device).multi_processor_count \
            if query.device.type == "cuda" else 132
        group = num_heads // key.shape[1]
        partials = PROGRAMS_PER_SM * multiprocessors * group * (head_dim + 1) * 4
        return selection + partials
    queries = min(num_tokens, PAGED_QUERY_CHUNK)
    slots = topk * settings.pool_size + settings.pool_size - 1
    gathered = queries * slots * key.shape[1] * head_dim * 2 * (query.element_size() + 4)
    scores = 2 * queries * num_heads * slots * 4
    return max(gathered + scores, PAGED_SCORE_CHUNK_BYTES)


def ring_capacity(pool_size: int, num_speculative_tokens: int) -> int:
    """Rows `R` of the open-window ring for drafts of up to `num_speculative_tokens` tokens: the smallest power-of-two
    multiple of `pool_size` of at least `pool_size + num_speculative_tokens - 1` rows.

    A verify step writes its drafts' rows before acceptance is known; the next step starts at the first token not
    accepted and pools its window from the ring rows of that window's earlier tokens (at most `r - 1`, all accepted).
    A rejected draft is at most `k` positions beyond the last accepted token, so its row `p % R` holds a token at
    least `R - k + 1` positions back: outside the open window when `R >= r + k - 1`. A power-of-two multiple of `r`
    divides vLLM's block sizes (the ring's rows join the least common multiple of the block sizes that sets the
    scheduler's block)."""
    needed = -(-(pool_size + max(num_speculative_tokens, 1) - 1) // pool_size)
    return pool_size * (1 << (needed - 1).bit_length())


def ring_windows(ring: torch.Tensor, pool_size: int,
                 window_ring_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ring `[blocks, R, 1, width]` as the pooled-key write reads it, `[windows, r, 1, width]` with a window of `r`
    rows starting at every row (an overlapping strided view of the same memory, read only), and each token's window
    in that view, from `window_ring_row` `[tokens]` (ring block * R + the row of the window's first token).

    vLLM pads a ring block to the page of the other caches, so the blocks are not `R` rows apart: the view steps by
    the greatest common divisor of the block and row strides, at which both land."""
    blocks, capacity = ring.shape[:2]
    block_stride, row_stride = ring.stride(0), ring.stride(1)
    step = math.gcd(block_stride, row_stride)
    count = ((blocks - 1) * block_stride + (capacity - pool_size) * row_stride) // step + 1
    windows = ring.as_strided((count, pool_size, *ring.shape[2:]), (step, row_stride, *ring.stride()[2:]))
    block, row = window_ring_row // capacity, window_ring_row % capacity
    return windows, (block * block_stride + row * row_stride) // step


def write_rows(cache: torch.Tensor, metadata: PagedCacheMetadata, rows: torch.Tensor) -> None:
    """Write each token's `rows[write_token]` `[tokens, ...]` at `(write_block, write_row)` of a `[blocks, rows,
    ...]` cache (the main cache seen slot-major). Tokens sharing a destination write the same bits; in a step without
    a real token, each destination gets back what it holds."""
    new = rows[metadata.write_token].to(cache.dtype)
    old = cache[metadata.write_block, metadata.write_row]
    keep = metadata.write_keep.view(-1, *[1] * (new.dim() - 1))
    cache[metadata.write_block, metadata.write_row] = torch.where(keep, new, old)


def select_windows(index_queries: torch.Tensor, head_weights: torch.Tensor | None, caches: PagedCaches,
                   main: PagedCacheMetadata, pooled: PagedCacheMetadata,
                   settings: IndexPoolStepSettings) -> torch.Tensor:
    """`[tokens, windows]` each token's selected windows, ascending, -1 after the last: the top `topk_windows` of the
    paged scoring of each of the step's selection tiles; or, where the step's window bound is within the budget
    (every visible window is selected, as the model's dense attention within the budget), all visible windows
    without scoring them, `window_bound` wide."""
    if main.window_bound <= settings.topk_windows:
        windows = torch.arange(main.window_bound, device=index_queries.device)
        return torch.where(windows < main.num_visible_windows[:, None], windows, -1)

    def select(tiles: SelectionTiles, token_tile: torch.Tensor | None) -> torch.Tensor:
        return paged_pooled_index_topk(
            index_queries, caches.pooled_keys, pooled.block_table, tiles.tile_tokens, tiles.tile_request, token_tile,
            main.num_visible_windows, tiles.window_bound, settings.topk_windows, head_weights,
            sink_windows=settings.sink_windows, local_windows=settings.local_windows)

    if len(main.selection_tiles) == 1:
        return select(main.selection_tiles[0], main.token_tile)
    # Each group's rows in order (decodes, then prefill tiles), then each token's row.
    return torch.cat([select(tiles, None) for tiles in main.selection_tiles])[main.token_tile]


def selection_work(main: PagedCacheMetadata, topk_windows: int) -> dict[str, int]:
    """What the step's window selection computes: `rows` scored (query rows of its tiles, repeats included) and
    `scores` (each row against its tiles' window bound); none within the budget, where nothing is scored."""
    if main.window_bound <= topk_windows:
        return {"rows": 0, "scores": 0}
    rows = [tiles.tile_tokens.numel() for tiles in main.selection_tiles]
    return {"rows": sum(rows),
            "scores": sum(count * tiles.window_bound for count, tiles in zip(rows, main.selection_tiles))}


def indexpool_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, index_queries: torch.Tensor,
                   ring_rows: torch.Tensor, head_weights: torch.Tensor | None, output_gate: torch.Tensor | None,
                   caches: PagedCaches, main: PagedCacheMetadata, pooled: PagedCacheMetadata,
                   ring: PagedCacheMetadata, settings: IndexPoolStepSettings) -> torch.Tensor:
    """One IndexPool step of every request at once: write the new keys/values, pool every token's window into the
    pooled-key cache (complete windows are final, an open one is overwritten by a later step before any query sees
    it), keep the last `R` tokens in the ring, select each query's windows and attend to them and to its open window.

    `query [tokens, heads, head_dim]`, `key`/`value [tokens, kv_heads, head_dim]` (normed and rotated),
    `index_queries [tokens, index_heads, index_head_dim]` (rotated), `ring_rows [tokens, index_head_dim +
    gate_width]` (raw indexer keys and gate logits), `head_weights [tokens, index_heads]` float32 or None,
    `output_gate [tokens, heads, head_dim]` (sigmoid gate logits) or None -> `[tokens, heads, head_dim]`.
    """
    head_dim = query.shape[-1]
    write_rows(caches.main.transpose(1, 2), main, torch.cat([key, value], dim=-1))
    windows, window_ring_block = ring_windows(caches.open_window, settings.pool_size, ring.window_ring_row)
    write_pooled_keys(
        caches.pooled_keys, ring_rows, windows, ring.window_token, window_ring_block,
        ring.token_position // settings.pool_size * settings.pool_size, settings.cos_sin_cache,
        settings.key_norm_weight, settings.key_norm_eps, settings.pool_slot_bias, settings.weighting,
        pooled.write_token, pooled.write_block, pooled.write_row, pooled.write_keep)
    # The ring is written after the pooling, which read its rows of earlier steps.
    write_rows(caches.open_window[:, :, 0], ring, ring_rows)
    selected = select_windows(index_queries, head_weights, caches, main, pooled, settings)
    return paged_sparse_attention(
        query, caches.main[..., :head_dim], caches.main[..., head_dim:], main.block_table, main.token_request,
        selected, main.token_position, settings.pool_size, settings.scaling, output_gate,
        request_tiles=main.request_tiles)
