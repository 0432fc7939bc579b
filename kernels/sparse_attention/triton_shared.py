"""What the IndexPool attention kernels share: the list walk's `@triton.jit` helpers (a tile's positions in the
list of windows, a program's query rows), the pipeline stages and the host helpers that size the kernels'
constexprs and tiles."""

import torch

from ..launch import dot_precision

try:
    import triton
    import triton.language as tl
except ImportError as error:  # Triton is optional; the package falls back to the PyTorch reference.
    raise ImportError("Triton is not installed") from error

# Software-pipeline stages. With two, ptxas (under the --regAllocOptLevel=2 Triton passes it) settles a handful of
# configurations at 72-80 registers with 2-6 words spilled; three stages for the query-major walks (forward, dq) and
# one for the 16-bit key-major pass (two for its float32 tf32x3 products) compile without spills across the matrix of
# kernels/aot.py. Register caps (`maxnreg`) made it worse: ptxas then fills the cap and still spills.
STAGES, STAGES_KEY_PASS, STAGES_KEY_PASS_FP32 = 3, 1, 2


@triton.jit
def _list_slots(selected_row, stride_sk, entries, num_selected, end, position, POOL: tl.constexpr,
                POOL_PAD: tl.constexpr):
    """Positions of list entries `entries` (one per element; entry `num_selected` is the tail window) at
    `arange(BLOCK_N) % POOL_PAD` within their window, and which are valid."""
    within = tl.arange(0, entries.shape[0]) % POOL_PAD
    window = tl.load(selected_row + entries.to(tl.int64) * stride_sk, mask=entries < tl.minimum(end, num_selected),
                     other=-1).to(tl.int32)
    is_tail = entries == num_selected
    window = tl.where(is_tail, (position + 1) // POOL, window)
    slots = window * POOL + within
    valid = (window >= 0) & (within < POOL) & (entries < end) & (~is_tail | (slots <= position))
    return tl.where(valid, slots, 0), valid


@triton.jit
def _query_rows(token, num_queries, kv_head, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                DIM_PAD: tl.constexpr):
    """A program's query token split into (batch, query) in int64, its query heads (the GQA group of `kv_head`) and
    head dimensions, with their masks."""
    token = token.to(tl.int64)
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    return token // num_queries, token % num_queries, heads, tl.arange(0, GROUP_PAD) < GROUP, dims, dims < HEAD_DIM


@triton.jit
def _gated(output, gate, OUT_DTYPE: tl.constexpr):
    """`output * sigmoid(gate)` (float32, to be stored as `OUT_DTYPE`) rounded as the model's gate computes it in its
    dtype: the attention output in `OUT_DTYPE`, the sigmoid in the gate's dtype, then their product."""
    sigmoid = tl.sigmoid(gate.to(tl.float32)).to(gate.dtype).to(tl.float32)
    return output.to(OUT_DTYPE).to(tl.float32) * sigmoid


def _sizes(query, key, pool_size) -> dict:
    """Constexprs every attention kernel shares: the GQA group (rows of the products, padded only to a power of
    two), head dim and pool size, and the arithmetic (float32 in the interpreter and for float32 inputs)."""
    group = query.shape[1] // key.shape[1]
    fp32, precision = dot_precision(query.dtype)
    return dict(GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=query.shape[-1],
                DIM_PAD=max(16, triton.next_power_of_2(query.shape[-1])), POOL=pool_size,
                POOL_PAD=triton.next_power_of_2(pool_size), FP32=fp32, PRECISION=precision)


def _width(query) -> int:
    """Bytes of a head-dim row in the products' registers: tiles shrink as it grows (the tiles follow the inputs'
    dtype, not the interpreter, so that it runs the GPU's shapes)."""
    return triton.next_power_of_2(query.shape[-1]) * (4 if query.dtype == torch.float32 else 2)


def _block_n(query, pool_size) -> int:
    """Positions per tile of a query's walk: 64, or 32 where a wider row would spill."""
    return max(triton.next_power_of_2(pool_size), 64 if _width(query) <= 256 else 32)


def _index_strides(selected, positions) -> tuple:
    return (*selected.stride(), *positions.stride())
