"""CPU kernel of the decode-time selection: one streaming pass over the pooled keys that keeps the best windows as
it goes, so no score is written to memory.

For a few (query, head) rows (decode: one query of 4 heads per row of the batch) the score is a read of every pooled
key once: `s[c] = sum_h a[h] * relu(q[h] . k[c])`. The reference computes it as a batched matrix product of the keys
by the queries, then one pass per head to sum, then the passes of `selection_keys` (forced windows, invisible
windows, the ordered float bits, the window id) and a `topk`: on a CPU the product of that skinny shape runs well
below the memory bandwidth and each pass adds a read and a write of the scores. Here a small C function does all of it
per window, with the key row in L1 while every head reads it, and offers the reference's int64 selection key to a
running top-k of its range of windows; the threads take contiguous runs of ranges (so each streams its part of the
keys in order); float32, bfloat16 or packed fp8 keys (widened to float32 in registers, fp8 times its scale). A
quickselect over the ranges' candidates and a sort of the kept ids finish, in C too (`pooled_topk_windows.c`). It
is built on first use by `cpu_build.CpuKernel` and registered as a custom op, so compiled decode steps keep one graph.

The sum over the head dimension may run in another order than the reference's product (vector lanes), so scores can
differ in the last bits; the selection is the same except where two windows' scores lie within that rounding.
Without a C compiler (or with `HYBRID_INDEXPOOL_CPU_KERNELS=0` or `HYBRID_INDEXPOOL_BACKEND=torch`) the reference path
runs.
"""

import ctypes
from pathlib import Path

import torch

from ..cpu_build import CpuKernel, op_namespace
from ..fp8_index_keys import SCALE_BYTES, is_packed, rotate_queries
from .reference import ID_BASE, INVISIBLE_HIGH, scaled_head_weights, select_with_keys

# Rows (queries x heads) up to which the fused pass beats the matrix product (the product wins as a real GEMM).
MAX_FUSED_ROWS = 16
# Longest head dimension the kernel's per-thread key buffer holds.
MAX_HEAD_DIM = 1024
# Windows per range below which one range (one thread) does all the work: starting threads costs more than it saves.
WINDOWS_PER_THREAD = 4096
# Ranges of windows with a running top-k each, shared out among the threads in contiguous runs. A constant rather
# than the thread count, so that the candidates' shape is fixed when the step is compiled.
MAX_SEGMENTS = 16
# The kernel's `keys_kind` of each key storage (packed fp8: `fp8_index_keys`'s uint8 rows of values and scale).
KEY_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2}


def _declare(library) -> None:
    library.pooled_topk_windows.restype = ctypes.c_int
    library.pooled_topk_windows.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_int64] * 2
                                            + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 10 + [ctypes.c_int])


KERNEL = CpuKernel("pooled_topk_windows", Path(__file__).with_name("pooled_topk_windows.c"), _declare,
                   defines={"ID_BASE": ID_BASE, "INVISIBLE_HIGH": INVISIBLE_HIGH, "MAX_HEAD_DIM": MAX_HEAD_DIM,
                            "MAX_ROWS": MAX_FUSED_ROWS})


def fused_topk_applies(rows_times_heads: int, pooled_index_keys: torch.Tensor) -> bool:
    """Whether the compiled CPU pass serves this selection: CPU, float32, bfloat16 or packed fp8 keys with a
    contiguous last dimension, few (query, head) rows, and the kernel usable (`CpuKernel.usable`)."""
    return (pooled_index_keys.device.type == "cpu" and pooled_index_keys.dtype in KEY_KINDS
            and pooled_index_keys.stride(-1) == 1 and pooled_index_keys.shape[-1] <= MAX_HEAD_DIM
            and rows_times_heads <= MAX_FUSED_ROWS and KERNEL.usable())


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
    if pooled_index_keys.stride(-1) != 1 or pooled_index_keys.dtype not in KEY_KINDS:
        raise ValueError("pooled_topk_windows needs float32, bfloat16 or packed fp8 (uint8) keys with a contiguous "
                         "last dimension.")
    if pooled_index_keys.shape[2] != dim + (SCALE_BYTES if is_packed(pooled_index_keys) else 0):
        raise ValueError(f"pooled_topk_windows: the keys' last dimension {pooled_index_keys.shape[2]} does not fit "
                         f"queries of dimension {dim}.")
    if rows * heads > MAX_FUSED_ROWS or dim > MAX_HEAD_DIM:  # the kernel's fixed buffers
        raise ValueError(f"pooled_topk_windows takes at most {MAX_FUSED_ROWS} query rows x heads (got {rows * heads}) "
                         f"and head dimension {MAX_HEAD_DIM} (got {dim}).")
    per_segment = _per_segment(windows, topk, segments)
    candidates = torch.empty(batch_size, rows, segments * per_segment, dtype=torch.int64)
    out = torch.empty(batch_size, rows, topk, dtype=torch.int64)
    queries, weights = queries.float().contiguous(), weights.float().contiguous()
    visible = visible.to(torch.int64).reshape(batch_size, rows).contiguous()
    library = KERNEL.load()
    if library is None:  # a compiled graph chose the op before its build failed: the reference selects the same
        return select_with_keys(queries.reshape(batch_size, rows, heads, dim), pooled_index_keys, visible, topk,
                                 weights, sink_windows, local_windows)
    failed = library.pooled_topk_windows(
        queries.data_ptr(), pooled_index_keys.data_ptr(), KEY_KINDS[pooled_index_keys.dtype],
        pooled_index_keys.stride(0), pooled_index_keys.stride(1), weights.data_ptr(), visible.data_ptr(),
        candidates.data_ptr(), out.data_ptr(), batch_size, rows, heads, dim, windows, segments, per_segment, topk,
        sink_windows, local_windows, min(segments, torch.get_num_threads()))
    if failed:
        raise MemoryError(f"pooled_topk_windows could not allocate its {2 * per_segment * rows} candidate keys per "
                          "range.")
    return out


def _per_segment(windows: int, topk: int, segments: int) -> int:
    return min(topk, -(-windows // segments))


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
