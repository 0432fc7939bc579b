"""Split decode: how many programs share each query's list, and the kernel that merges their partial outputs by
log-sum-exp (for the GQA and the latent forward alike)."""

from ..launch import PROGRAMS_PER_SM, Launch
from .triton_shared import _block_n, _gated

try:
    import triton
    import triton.language as tl
except ImportError as error:  # Triton is optional; the package falls back to the PyTorch reference.
    raise ImportError("Triton is not installed") from error

# Positions a decode split covers at least: its float32 partial output (group x head dim, written, then read by the
# combine) then costs at most group / 64 of the bytes of the keys and values it reads (12.5% for a group of 8).
MIN_SPLIT_POSITIONS = 128


@triton.jit(do_not_specialize=["num_splits", "num_rows"])
def _combine_splits_kernel(partial_ptr, partial_lse_ptr, out_ptr, num_splits, num_rows, gate_ptr, stride_gt,
                           stride_gh, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
                           GATED: tl.constexpr = False, HEADS: tl.constexpr = 1):
    """Merge the splits' partial outputs `[split, row, dim]` (rows: token x head) by their log-sum-exp. `GATED`: the
    output times the sigmoid of `gate_ptr` `[token, head, dim]` (`HEADS` heads per token; None when off)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, DIM_PAD)
    mask = (rows < num_rows)[:, None] & (dims < HEAD_DIM)[None, :]
    row_max = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, DIM_PAD), tl.float32)
    for split in range(num_splits):
        # int64 from the row count: the interpreter's loop index is a Python int, which has no `.to`.
        offset = num_rows.to(tl.int64) * split + rows
        lse = tl.load(partial_lse_ptr + offset, mask=rows < num_rows, other=float("-inf"))
        part = tl.load(partial_ptr + offset[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
        new_max = tl.maximum(row_max, lse)
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a split that saw nothing has lse = -inf
        correction, weight = tl.exp(row_max - safe_max), tl.exp(lse - safe_max)
        acc = acc * correction[:, None] + part * weight[:, None]
        row_sum = row_sum * correction + weight
        row_max = new_max
    output = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    if GATED:
        # Token and head from int32 row ids (token x heads < 2^31): an int64 pair kept across the loop made ptxas
        # spill on sm_90.
        rows32 = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        gate_rows = (rows32 // HEADS).to(tl.int64) * stride_gt + (rows32 % HEADS) * stride_gh
        gate = tl.load(gate_ptr + gate_rows[:, None] + dims[None, :], mask=mask, other=0.0)
        output = _gated(output, gate, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * HEAD_DIM + dims[None, :], output.to(out_ptr.dtype.element_ty), mask=mask)


def combine_launch(partial, partial_lse, output, num_splits: int, num_rows: int, head_dim: int,
                   dim_pad: int, gate=None) -> Launch:
    """The combine kernel's launch: `num_splits` partial outputs `[split, row, head_dim]` and their log-sum-exp
    `[split, row]` into `output` (rows: token x head), times the sigmoid of `gate` `[tokens, heads, head_dim]` (last
    dimension contiguous) when given."""
    block_r = max(1, 2048 // dim_pad)
    options = dict(HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_R=block_r, num_warps=4, num_stages=1)
    gate_args = (None, None, None)
    if gate is not None:
        gate_args = (gate, *gate.stride()[:2])
        options.update(GATED=True, HEADS=gate.shape[1])
    return Launch(
        _combine_splits_kernel, (triton.cdiv(num_rows, block_r),),
        (partial, partial_lse, output, num_splits, num_rows, *gate_args), options,
    )


def decode_splits(query, key, selected, pool_size, multiprocessors: int) -> int:
    """Splits of each query's list: enough programs to fill the GPU (`PROGRAMS_PER_SM` per multiprocessor), each
    split `MIN_SPLIT_POSITIONS` positions at least; but never fewer programs than multiprocessors while the list has
    windows to share (a batch of one on few key/value heads): the splits then cover less than a tile of positions each
    (`plan_forward` gives at least as many as asked where whole tiles cannot). A runtime number (the kernel is not
    recompiled for another)."""
    programs = query.shape[0] * query.shape[2] * key.shape[1]
    pool_pad = triton.next_power_of_2(pool_size)
    entries = selected.shape[-1] + 1  # + 1: the tail
    windows_per_split = max(_block_n(query, pool_size), MIN_SPLIT_POSITIONS) // pool_pad
    splits = max(1, min(triton.cdiv(PROGRAMS_PER_SM * multiprocessors, programs), triton.cdiv(entries,
                                                                                                windows_per_split)))
    if splits * programs >= multiprocessors:
        return splits
    return min(entries, triton.cdiv(multiprocessors, programs))
