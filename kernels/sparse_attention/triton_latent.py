"""MLA's absorbed form: the latent kernel (every query head over one latent per position, both key and value),
its sizes, its decode splits and its planning."""

import torch

from ..launch import PROGRAMS_PER_SM, Launch, dot_precision
from .triton_decode import MIN_SPLIT_POSITIONS, combine_launch
from .triton_shared import _index_strides, _list_slots

try:
    import triton
    import triton.language as tl
except ImportError as error:  # Triton is optional; the package falls back to the PyTorch reference.
    raise ImportError("Triton is not installed") from error

# The latent (MLA) kernel: query heads per program, positions per tile, warps and stages. A program holds its heads'
# float32 accumulator (heads x latent width) and a tile of latents (the keys and the values at once).
LATENT_HEADS, LATENT_BLOCK_N, LATENT_WARPS, LATENT_STAGES = 32, 32, 8, 2


@triton.jit(do_not_specialize=["num_queries", "num_selected", "windows_per_split"])
def _sparse_latent_attention_kernel(
    query_ptr, latent_ptr, selected_ptr, position_ptr, out_ptr, lse_ptr,
    num_queries, num_selected, windows_per_split, scale,
    stride_qb, stride_qh, stride_qt,
    stride_lb, stride_ls,
    stride_sb, stride_st, stride_sk,
    stride_pb, stride_pt,
    HEADS: tl.constexpr, BLOCK_H: tl.constexpr, LATENT_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    POOL: tl.constexpr, POOL_PAD: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """MLA's absorbed form: output (or a split's partial output) `[split, token, head, latent]` and log-sum-exp of
    `BLOCK_H` query heads of one token over one split of its list. Each tile of latents is loaded once and serves as
    the keys and the values of every head of the block; the head blocks of a token are neighbours in the grid, so
    they read the same latents from L2."""
    head_block, token, split = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    batch, query = token // num_queries, token % num_queries
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < HEADS
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < LATENT_DIM
    row_mask = head_mask[:, None] & dim_mask[None, :]
    q = tl.load(query_ptr + batch * stride_qb + heads[:, None] * stride_qh + query * stride_qt + dims[None, :],
                mask=row_mask, other=0.0)
    if FP32:
        q = q.to(tl.float32)
    position = tl.load(position_ptr + batch * stride_pb + query * stride_pt).to(tl.int32)
    selected_row = selected_ptr + batch * stride_sb + query * stride_st
    latent_base = latent_ptr + batch * stride_lb

    row_max = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    row_sum = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, DIM_PAD), tl.float32)
    start = split * windows_per_split
    end = tl.minimum(start + windows_per_split, num_selected + 1)  # + 1: the tail
    for first in range(start, end, BLOCK_N // POOL_PAD):
        entries = first + tl.arange(0, BLOCK_N) // POOL_PAD
        slots, valid = _list_slots(selected_row, stride_sk, entries, num_selected, end, position, POOL, POOL_PAD)
        latents = tl.load(latent_base + slots[:, None].to(tl.int64) * stride_ls + dims[None, :],
                          mask=valid[:, None] & dim_mask[None, :], other=0.0)
        if FP32:
            latents = latents.to(tl.float32)
        scores = tl.dot(q, tl.trans(latents), input_precision=PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing valid yet: no NaN from inf - inf
        probs = tl.exp(scores - safe_max[:, None])
        correction = tl.exp(row_max - safe_max)
        row_sum = row_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs.to(latents.dtype), latents, input_precision=PRECISION)
        row_max = new_max
    output = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    lse = tl.where(row_sum == 0.0, float("-inf"), row_max + tl.log(row_sum))
    row = (split.to(tl.int64) * tl.num_programs(1) + token) * HEADS + heads
    tl.store(out_ptr + row[:, None] * LATENT_DIM + dims[None, :], output.to(out_ptr.dtype.element_ty), mask=row_mask)
    tl.store(lse_ptr + row, lse, mask=head_mask)


def _latent_block_h(num_heads: int) -> int:
    """Query heads per program of the latent kernel: `LATENT_HEADS`, fewer for fewer heads, but at least the 16 rows
    `tl.dot` needs."""
    return max(16, min(LATENT_HEADS, triton.next_power_of_2(num_heads)))


def _latent_sizes(query, latents, pool_size) -> dict:
    """Constexprs of the latent kernel: heads per program, latent width, pool size, arithmetic."""
    fp32, precision = dot_precision(query.dtype)
    return dict(HEADS=query.shape[1], BLOCK_H=_latent_block_h(query.shape[1]),
                LATENT_DIM=latents.shape[-1], DIM_PAD=max(16, triton.next_power_of_2(latents.shape[-1])),
                POOL=pool_size, POOL_PAD=triton.next_power_of_2(pool_size), FP32=fp32, PRECISION=precision)


def latent_splits(query, selected, pool_size, multiprocessors: int) -> int:
    """Splits of each query's list for the latent kernel: enough programs to fill the GPU (`PROGRAMS_PER_SM` per
    multiprocessor), each split `MIN_SPLIT_POSITIONS` positions at least."""
    head_blocks = triton.cdiv(query.shape[1], _latent_block_h(query.shape[1]))
    pool_pad = triton.next_power_of_2(pool_size)
    most = triton.cdiv(selected.shape[-1] + 1, max(LATENT_BLOCK_N, MIN_SPLIT_POSITIONS, pool_pad) // pool_pad)
    programs = query.shape[0] * query.shape[2] * head_blocks
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * multiprocessors, programs), most))


def plan_latent_forward(query, latents, selected, positions, pool_size, scaling, num_splits: int = 1):
    """(launches, output latents `[batch, queries, heads, latent_dim]`): the latent kernel over `num_splits` parts
    of each query's list, then the combine kernel when split."""
    batch_size, num_heads, num_queries, latent_dim = query.shape
    num_selected = selected.shape[-1]
    sizes = _latent_sizes(query, latents, pool_size)
    block_n = max(sizes["POOL_PAD"], LATENT_BLOCK_N)
    windows_per_block = block_n // sizes["POOL_PAD"]
    tokens, head_blocks = batch_size * num_queries, triton.cdiv(num_heads, sizes["BLOCK_H"])
    num_entries = num_selected + 1
    windows_per_split = triton.cdiv(triton.cdiv(num_entries, num_splits), windows_per_block) * windows_per_block
    num_splits = triton.cdiv(num_entries, windows_per_split)
    output = torch.empty(batch_size, num_queries, num_heads, latent_dim, dtype=query.dtype, device=query.device)
    partial, partial_lse = output, torch.empty(tokens, num_heads, dtype=torch.float32, device=query.device)
    if num_splits > 1:
        partial = torch.empty(num_splits, tokens, num_heads, latent_dim, dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(num_splits, tokens, num_heads, dtype=torch.float32, device=query.device)
    launches = [Launch(
        _sparse_latent_attention_kernel, (head_blocks, tokens, num_splits),
        (query, latents, selected, positions, partial, partial_lse, num_queries, num_selected, windows_per_split,
         scaling, *query.stride()[:3], latents.stride(0), latents.stride(2), *_index_strides(selected, positions)),
        dict(BLOCK_N=block_n, **sizes, num_warps=LATENT_WARPS, num_stages=LATENT_STAGES),
    )]
    if num_splits > 1:
        launches.append(combine_launch(partial, partial_lse, output, num_splits, tokens * num_heads, latent_dim,
                                       sizes["DIM_PAD"]))
    return launches, output
