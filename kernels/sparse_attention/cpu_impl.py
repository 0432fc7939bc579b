"""CPU kernel of the paged sparse attention (the vLLM plugin's step on a CPU): each token's selected windows read in
place from vLLM's pages.

The PyTorch path (`paged_sparse_attention_torch`) gathers every token's windows into a new tensor, converts it to
float32, masks it and multiplies it: for a decode step the gathered keys and values are written and read again three
or four times, and each of its few dozen operators runs on the two small matrices of one chunk. Here a small C
function takes one (token, key/value head) pair at a time: it walks the token's windows through its row of the
block table, scores each key row against the `group` query heads sharing it while the row is in L1 (bfloat16 widened
in registers), and sums the value rows with the softmax weights, so the step reads each selected key and value once
and writes only its output (`paged_window_attention.c`). The threads share the pairs. It is built on first use by
`cpu_build.CpuKernel` and registered as a custom op, so compiled steps keep one graph.

Sums run in another order than the reference's products (vector lanes), so outputs can differ in the last bits.
Without a C compiler (or with `HYBRID_INDEXPOOL_CPU_KERNELS=0` or `HYBRID_INDEXPOOL_BACKEND=torch`) the reference
runs.
"""

import ctypes
from pathlib import Path

import torch

from ..cpu_build import CpuKernel, op_namespace

# The kernel's `cache_kind` of each key/value storage.
CACHE_KINDS = {torch.float32: 0, torch.bfloat16: 1}


def _declare(library) -> None:
    library.paged_window_attention.restype = ctypes.c_int
    library.paged_window_attention.argtypes = (
        [ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int] + [ctypes.c_int64] * 2
        + [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 6
        + [ctypes.c_float, ctypes.c_int])


KERNEL = CpuKernel("paged_window_attention", Path(__file__).with_name("paged_window_attention.c"), _declare)


def paged_attention_cpu_applies(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the compiled CPU kernel serves this step: CPU tensors, float32 or bfloat16 keys and values (one dtype)
    with contiguous rows, no gradient to record, and the kernel usable (`CpuKernel.usable`)."""
    return (query.device.type == "cpu" and key_cache.device.type == "cpu" and value_cache.device.type == "cpu"
            and key_cache.dtype in CACHE_KINDS and value_cache.dtype == key_cache.dtype
            and key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1
            and not (torch.is_grad_enabled() and query.requires_grad)
            and KERNEL.usable())


def run_paged_window_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_table: torch.Tensor, token_request: torch.Tensor,
                               selected_windows: torch.Tensor, query_positions: torch.Tensor, pool_size: int,
                               scaling: float) -> torch.Tensor:
    """`[tokens, heads, head_dim]` float32: the paged sparse attention by the compiled kernel (arguments as
    `paged_sparse_attention_torch`'s, without the gate)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    if block_size % pool_size:
        raise ValueError(f"The block size ({block_size}) must be a multiple of the pool size ({pool_size}).")
    if key_cache.dtype not in CACHE_KINDS or value_cache.dtype != key_cache.dtype or key_cache.stride(-1) != 1 \
            or value_cache.stride(-1) != 1:
        raise ValueError("paged_window_attention needs float32 or bfloat16 keys and values (one dtype) with "
                         "contiguous rows.")
    library = KERNEL.load()
    if library is None:  # a compiled graph chose the op before its build failed: the reference computes the same
        from .reference import paged_sparse_attention_torch

        return paged_sparse_attention_torch(query.float(), key_cache.float(), value_cache.float(), block_table,
                                            token_request, selected_windows, query_positions, pool_size, scaling)
    if block_table.dtype not in (torch.int32, torch.int64) or block_table.stride(-1) != 1:
        block_table = block_table.long().contiguous()
    query = query.float().contiguous()
    selected_windows = selected_windows.long().contiguous()
    token_request, query_positions = token_request.long().contiguous(), query_positions.long().contiguous()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    strides = [(ctypes.c_int64 * 3)(*cache.stride()[:3]) for cache in (key_cache, value_cache)]
    failed = library.paged_window_attention(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), CACHE_KINDS[key_cache.dtype], *strides,
        block_table.data_ptr(), int(block_table.dtype == torch.int64), block_table.stride(0), block_table.shape[1],
        token_request.data_ptr(), selected_windows.data_ptr(), selected_windows.shape[-1], query_positions.data_ptr(),
        out.data_ptr(), num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim, pool_size, block_size,
        scaling, torch.get_num_threads())
    if failed:
        raise MemoryError("paged_window_attention could not allocate its scratch memory "
                          f"({(selected_windows.shape[-1] + 1) * pool_size} rows per thread).")
    return out


@torch.library.custom_op(f"{op_namespace(__name__)}::paged_window_attention", mutates_args=(), device_types="cpu")
def paged_window_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, token_request: torch.Tensor, selected_windows: torch.Tensor,
                           query_positions: torch.Tensor, pool_size: int, scaling: float) -> torch.Tensor:
    """`run_paged_window_attention` as a custom op, so that a compiled step keeps one graph."""
    return run_paged_window_attention(query, key_cache, value_cache, block_table, token_request, selected_windows,
                                      query_positions, pool_size, scaling)


@paged_window_attention.register_fake
def _(query, key_cache, value_cache, block_table, token_request, selected_windows, query_positions, pool_size,
      scaling):
    return query.new_empty(query.shape, dtype=torch.float32)


def paged_sparse_attention_cpu(query, key_cache, value_cache, block_table, token_request, selected_windows,
                               query_positions, pool_size, scaling, output_gate=None) -> torch.Tensor:
    """`paged_sparse_attention_torch` by the compiled kernel; same arguments (no `request_tiles`: every token reads
    its own windows in place) and result."""
    attend = KERNEL.dispatch(run_paged_window_attention, paged_window_attention)
    output = attend(query, key_cache, value_cache, block_table, token_request, selected_windows, query_positions,
                    pool_size, scaling).to(query.dtype)
    if output_gate is not None:
        # As the reference: in the output dtype, the gate contiguous (ATen's CPU sigmoid rounds strided float32
        # inputs differently).
        output = (output * torch.sigmoid(output_gate.contiguous())).to(query.dtype)
    return output
