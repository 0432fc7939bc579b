"""CPU kernel of the pooled index selection: one streaming pass over the pooled keys that keeps the best windows as
it goes, so no score is written to memory. It serves the transformers model's decode (keys contiguous per row,
`pooled_index_topk_cpu`) and the vLLM plugin's step (keys read in place from vLLM's pages through the block table,
`paged_pooled_index_topk_cpu`), one C function for both.

For a few (query, head) rows (decode: one query of 4 heads per row of the batch) the score is a read of every pooled
key once: `s[c] = sum_h a[h] * relu(q[h] . k[c])`. The references compute it as a batched matrix product of the keys
by the queries (after gathering the paged keys into a new tensor), then one pass per head to sum, then the passes of
`selection_keys` (forced windows, invisible windows, the ordered float bits, the window id) and a `topk`: on a CPU the
product of that skinny shape runs well below the memory bandwidth and each pass adds a read and a write of the scores.
Here a small C function does all of it per window, with the key row in L1 while every head of every query of the tile
reads it, and offers the reference's int64 selection key to a running top-k of its range of windows; windows no query
of a tile can see are not read at all (a serving step scores a power-of-two bound of windows). The threads take
(tile, range of windows) items; float32, bfloat16 or packed fp8 keys (widened to float32 in registers, fp8 times its
scale). A quickselect over the ranges' candidates and a sort of the kept ids finish, in C too
(`pooled_topk_windows.c`). It is built on first use by `cpu_build.CpuKernel` and registered as custom ops, so
compiled steps keep one graph.

The sum over the head dimension may run in another order than the reference's product (vector lanes), so scores can
differ in the last bits; the selection is the same except where two windows' scores lie within that rounding.
Without a C compiler (or with `HYBRID_INDEXPOOL_CPU_KERNELS=0` or `HYBRID_INDEXPOOL_BACKEND=torch`) the references
run.
"""

import ctypes
from pathlib import Path

import torch

from ..cpu_build import CpuKernel, op_namespace
from ..fp8_index_keys import SCALE_BYTES, is_packed, rotate_queries
from .reference import ID_BASE, INVISIBLE_HIGH, scaled_head_weights, select_with_keys

# Rows (queries x heads) up to which the fused pass beats the matrix product of the contiguous reference (the
# product wins as a real GEMM). The paged reference has no such product to win: its gathers dominate.
MAX_FUSED_ROWS = 16
# Windows per range below which one range (one thread) does all the work: starting threads costs more than it saves.
WINDOWS_PER_THREAD = 4096
# Ranges of windows with a running top-k each, shared out among the threads. A constant rather than the thread count,
# so that the candidates' shape is fixed when the step is compiled.
MAX_SEGMENTS = 16
# The kernel's `keys_kind` of each key storage (packed fp8: `fp8_index_keys`'s uint8 rows of values and scale).
KEY_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2}


def _declare(library) -> None:
    library.pooled_topk_windows.restype = ctypes.c_int
    library.pooled_topk_windows.argtypes = (
        [ctypes.c_void_p] * 4 + [ctypes.c_int] + [ctypes.c_int64] * 3 + [ctypes.c_void_p, ctypes.c_int]
        + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 10 + [ctypes.c_void_p] * 2
        + [ctypes.c_int])


KERNEL = CpuKernel("pooled_topk_windows", Path(__file__).with_name("pooled_topk_windows.c"), _declare,
                   defines={"ID_BASE": ID_BASE, "INVISIBLE_HIGH": INVISIBLE_HIGH})


def _keys_fit(keys: torch.Tensor) -> bool:
    return keys.device.type == "cpu" and keys.dtype in KEY_KINDS and keys.stride(-1) == 1


def fused_topk_applies(rows_times_heads: int, pooled_index_keys: torch.Tensor) -> bool:
    """Whether the compiled CPU pass serves this selection: CPU, float32, bfloat16 or packed fp8 keys with a
    contiguous last dimension, few (query, head) rows, and the kernel usable (`CpuKernel.usable`)."""
    return _keys_fit(pooled_index_keys) and rows_times_heads <= MAX_FUSED_ROWS and KERNEL.usable()


def paged_topk_applies(index_queries: torch.Tensor, pooled_key_cache: torch.Tensor) -> bool:
    """Whether the compiled CPU pass serves a paged selection: CPU tensors, float32, bfloat16 or packed fp8 pages with
    contiguous rows, and the kernel usable (`CpuKernel.usable`)."""
    return index_queries.device.type == "cpu" and _keys_fit(pooled_key_cache) and KERNEL.usable()


def _check_keys(keys: torch.Tensor, dim: int) -> None:
    if keys.stride(-1) != 1 or keys.dtype not in KEY_KINDS:
        raise ValueError("pooled_topk_windows needs float32, bfloat16 or packed fp8 (uint8) keys with a contiguous "
                         f"last dimension, got {keys.dtype} with strides {tuple(keys.stride())}.")
    if keys.shape[-1] != dim + (SCALE_BYTES if is_packed(keys) else 0):
        raise ValueError(f"pooled_topk_windows: the keys' last dimension {keys.shape[-1]} does not fit queries of "
                         f"dimension {dim}" + (" (packed fp8 keys hold dim + 4 bytes)." if is_packed(keys) else "."))


def _per_segment(windows: int, topk: int, segments: int) -> int:
    return min(topk, -(-windows // segments))


def _run(queries, weights, visible, keys, block_stride, row_stride, windows_per_block, block_table, tile_tokens,
         tile_request, tiles, width, window_bound, topk, segments, sink_windows, local_windows):
    """The C call: `[tiles, width, topk]` int64 window ids (see `pooled_topk_windows.c` for the arguments; a None
    block table, tile tokens or tile request is NULL there)."""
    heads, dim = weights.shape[-1], queries.shape[-1]
    per_segment = _per_segment(window_bound, topk, segments)
    candidates = torch.empty(tiles, width, segments, per_segment, dtype=torch.int64)
    out = torch.empty(tiles, width, topk, dtype=torch.int64)
    table_pointer, table_int64, table_stride, max_blocks = None, 0, 0, 1
    if block_table is not None:
        table_pointer, table_int64 = block_table.data_ptr(), int(block_table.dtype == torch.int64)
        table_stride, max_blocks = block_table.stride(0), block_table.shape[1]
    failed = KERNEL.load().pooled_topk_windows(
        queries.data_ptr(), weights.data_ptr(), visible.data_ptr(), keys.data_ptr(), KEY_KINDS[keys.dtype],
        block_stride, row_stride, windows_per_block, table_pointer, table_int64, table_stride, max_blocks,
        None if tile_tokens is None else tile_tokens.data_ptr(),
        None if tile_request is None else tile_request.data_ptr(), tiles, width, heads, dim, window_bound, segments,
        per_segment, topk, sink_windows, local_windows, candidates.data_ptr(), out.data_ptr(),
        min(tiles * segments, torch.get_num_threads()))
    if failed:
        raise MemoryError(f"pooled_topk_windows could not allocate its {2 * per_segment * width} candidate keys per "
                          "thread.")
    return out


def run_pooled_topk_windows(queries: torch.Tensor, pooled_index_keys: torch.Tensor, weights: torch.Tensor,
                            visible: torch.Tensor, topk: int, segments: int, sink_windows: int,
                            local_windows: int) -> torch.Tensor:
    """The `topk` best visible windows of each row by the compiled pass: `[batch, rows, topk]` int64 window ids,
    ascending, -1 after the last (as `pooled_index_topk_torch`). The windows are scored in `segments` contiguous
    ranges with a running top-k each (the threads share the ranges). `queries` `[batch, rows * heads, dim]` float32,
    `pooled_index_keys` `[batch, windows, dim]` float32 or bfloat16, or packed fp8 `uint8 [batch, windows, dim + 4]`
    (queries rotated already), last dimension contiguous; `weights` `[batch, rows, heads]` float32 with the
    1/sqrt(d) scale, `visible` `[batch, rows]` integer."""
    batch_size, rows, heads = weights.shape
    windows, dim = pooled_index_keys.shape[1], queries.shape[2]
    _check_keys(pooled_index_keys, dim)
    queries, weights = queries.float().contiguous(), weights.float().contiguous()
    visible = visible.to(torch.int64).reshape(batch_size, rows).contiguous()
    if KERNEL.load() is None:  # a compiled graph chose the op before its build failed: the reference selects the same
        return select_with_keys(queries.reshape(batch_size, rows, heads, dim), pooled_index_keys, visible, topk,
                                weights, sink_windows, local_windows)
    # Each batch row is a tile of `rows` queries whose windows all lie in one "block": no block table.
    return _run(queries, weights, visible, pooled_index_keys, pooled_index_keys.stride(0), pooled_index_keys.stride(1),
                max(windows, 1), None, None, None, batch_size, rows, windows, topk, segments, sink_windows,
                local_windows)


@torch.library.custom_op(f"{op_namespace(__name__)}::pooled_topk_windows", mutates_args=(), device_types="cpu")
def pooled_topk_windows(queries: torch.Tensor, pooled_index_keys: torch.Tensor, weights: torch.Tensor,
                        visible: torch.Tensor, topk: int, segments: int, sink_windows: int,
                        local_windows: int) -> torch.Tensor:
    """`run_pooled_topk_windows` as a custom op, so that a compiled step keeps one graph."""
    return run_pooled_topk_windows(queries, pooled_index_keys, weights, visible, topk, segments, sink_windows,
                                   local_windows)


@pooled_topk_windows.register_fake
def _(queries, pooled_index_keys, weights, visible, topk, segments, sink_windows, local_windows):
    batch_size, rows, _ = weights.shape
    return queries.new_empty(batch_size, rows, topk, dtype=torch.int64)


def pooled_index_topk_cpu(index_queries, pooled_index_keys, num_visible_windows, topk, head_weights=None,
                          sink_windows=0, local_windows=0):
    """`pooled_index_topk_torch` without `window_limit` (decode, compiled code) in one pass of the compiled kernel
    over the keys; same arguments and result."""
    batch_size, num_queries, num_heads, head_dim = index_queries.shape
    num_windows = pooled_index_keys.shape[1]
    if num_windows == 0 or num_queries == 0 or topk == 0:
        return torch.full((batch_size, num_queries, topk), -1, dtype=torch.long, device=index_queries.device)
    segments = max(1, min(MAX_SEGMENTS, num_windows // WINDOWS_PER_THREAD))
    if is_packed(pooled_index_keys):
        index_queries = rotate_queries(index_queries)
    queries = index_queries.float().reshape(batch_size, num_queries * num_heads, head_dim)
    select = KERNEL.dispatch(run_pooled_topk_windows, pooled_topk_windows)
    return select(queries, pooled_index_keys, scaled_head_weights(index_queries, head_weights), num_visible_windows,
                  topk, segments, sink_windows, local_windows)


def run_paged_pooled_topk(index_queries: torch.Tensor, pooled_key_cache: torch.Tensor, block_table: torch.Tensor,
                          tile_tokens: torch.Tensor, tile_request: torch.Tensor, num_visible_windows: torch.Tensor,
                          head_weights: torch.Tensor | None, window_bound: int, topk: int, sink_windows: int,
                          local_windows: int, segments: int | None = None) -> torch.Tensor:
    """`[tiles * width, topk]` int64: the selection of each row of the tiles by the compiled pass, read in place from
    vLLM's pages (`paged_pooled_index_topk_torch`'s arguments, without `token_tile`), each tile's windows in `segments`
    ranges with a running top-k each (the threads share the (tile, range) items; default `paged_segments`)."""
    num_tiles, width = tile_tokens.shape
    segments = paged_segments(num_tiles, window_bound) if segments is None else segments
    dim = index_queries.shape[-1]
    _check_keys(pooled_key_cache, dim)
    if pooled_key_cache.dim() != 4 or pooled_key_cache.shape[2] != 1:
        raise ValueError("pooled_topk_windows reads paged pooled keys [blocks, block_size // r, 1, width], got shape "
                         f"{tuple(pooled_key_cache.shape)}.")
    if KERNEL.load() is None:  # a compiled graph chose the op before its build failed: the reference selects the same
        from .reference import paged_pooled_index_topk_torch

        return paged_pooled_index_topk_torch(index_queries, pooled_key_cache, block_table, tile_tokens, tile_request,
                                             None, num_visible_windows, window_bound, topk, head_weights, sink_windows,
                                             local_windows)
    if is_packed(pooled_key_cache):
        index_queries = rotate_queries(index_queries)
    weights = scaled_head_weights(index_queries[None], None if head_weights is None else head_weights[None])[0]
    if block_table.dtype not in (torch.int32, torch.int64) or block_table.stride(-1) != 1:
        block_table = block_table.long().contiguous()
    return _run(index_queries.float().contiguous(), weights.contiguous(), num_visible_windows.long().contiguous(),
                pooled_key_cache, pooled_key_cache.stride(0), pooled_key_cache.stride(1), pooled_key_cache.shape[1],
                block_table, tile_tokens.long().contiguous(), tile_request.long().contiguous(), num_tiles, width,
                window_bound, topk, segments, sink_windows, local_windows).view(num_tiles * width, topk)


@torch.library.custom_op(f"{op_namespace(__name__)}::paged_pooled_topk", mutates_args=(), device_types="cpu")
def paged_pooled_topk(index_queries: torch.Tensor, pooled_key_cache: torch.Tensor, block_table: torch.Tensor,
                      tile_tokens: torch.Tensor, tile_request: torch.Tensor, num_visible_windows: torch.Tensor,
                      head_weights: torch.Tensor | None, window_bound: int, topk: int, sink_windows: int,
                      local_windows: int) -> torch.Tensor:
    """`run_paged_pooled_topk` as a custom op, so that a compiled step keeps one graph (the ranges of windows are
    chosen when it runs: the thread count is not traceable)."""
    return run_paged_pooled_topk(index_queries, pooled_key_cache, block_table, tile_tokens, tile_request,
                                 num_visible_windows, head_weights, window_bound, topk, sink_windows, local_windows)


@paged_pooled_topk.register_fake
def _(index_queries, pooled_key_cache, block_table, tile_tokens, tile_request, num_visible_windows, head_weights,
      window_bound, topk, sink_windows, local_windows):
    return index_queries.new_empty(tile_tokens.numel(), topk, dtype=torch.int64)


def paged_segments(num_tiles: int, window_bound: int) -> int:
    """Ranges of windows per tile: enough (tile, range) items for twice the threads, none shorter than
    `WINDOWS_PER_THREAD` windows, at most `MAX_SEGMENTS`. From shapes and the thread count only."""
    wanted = -(-2 * torch.get_num_threads() // max(num_tiles, 1))
    return max(1, min(wanted, MAX_SEGMENTS, window_bound // WINDOWS_PER_THREAD))


def paged_pooled_index_topk_cpu(index_queries, pooled_key_cache, block_table, tile_tokens, tile_request, token_tile,
                                num_visible_windows, window_bound, topk, head_weights=None, sink_windows=0,
                                local_windows=0):
    """`paged_pooled_index_topk_torch` by the compiled pass, reading the pooled keys in place from the pages; same
    arguments and result."""
    num_tokens = index_queries.shape[0]
    num_tiles, width = tile_tokens.shape
    if num_tiles == 0 or num_tokens == 0 or topk == 0:
        rows = num_tokens if token_tile is not None else num_tiles * width
        return torch.full((rows, topk), -1, dtype=torch.long, device=index_queries.device)
    select = KERNEL.dispatch(run_paged_pooled_topk, paged_pooled_topk)
    rows = select(index_queries, pooled_key_cache, block_table, tile_tokens, tile_request, num_visible_windows,
                  head_weights, window_bound, topk, sink_windows, local_windows)
    return rows if token_tile is None else rows[token_tile]
