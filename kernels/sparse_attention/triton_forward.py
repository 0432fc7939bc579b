"""The forward kernel (prefill, and one split of a decode step's lists) and its planning."""

import torch

from ..launch import Launch
from .triton_decode import combine_launch
from .triton_shared import STAGES, _block_n, _index_strides, _list_slots, _query_rows, _sizes, _width

try:
    import triton
    import triton.language as tl
except ImportError as error:  # Triton is optional; the package falls back to the PyTorch reference.
    raise ImportError("Triton is not installed") from error


@triton.jit(do_not_specialize=["num_queries", "num_selected", "windows_per_split"])
def _sparse_attention_forward_kernel(
    query_ptr, key_ptr, value_ptr, selected_ptr, position_ptr, out_ptr, lse_ptr,
    num_queries, num_selected, windows_per_split, scale,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_sb, stride_st, stride_sk,
    stride_pb, stride_pt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    POOL: tl.constexpr, POOL_PAD: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Output (or a split's partial output, float32) `[split, token, head, dim]` and log-sum-exp `[split, token,
    head]` of one query token, key/value head and split of its list."""
    token, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    batch, query, heads, head_mask, dims, dim_mask = _query_rows(token, num_queries, kv_head, GROUP, GROUP_PAD,
                                                                HEAD_DIM, DIM_PAD)
    q = tl.load(query_ptr + batch * stride_qb + heads[:, None] * stride_qh + query * stride_qt + dims[None, :],
                mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
    if FP32:
        q = q.to(tl.float32)
    position = tl.load(position_ptr + batch * stride_pb + query * stride_pt).to(tl.int32)
    selected_row = selected_ptr + batch * stride_sb + query * stride_st
    key_base = key_ptr + batch * stride_kb + kv_head * stride_kh
    value_base = value_ptr + batch * stride_vb + kv_head * stride_vh

    row_max = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    row_sum = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, DIM_PAD), tl.float32)
    start = split * windows_per_split
    end = tl.minimum(start + windows_per_split, num_selected + 1)  # + 1: the tail
    for first in range(start, end, BLOCK_N // POOL_PAD):
        entries = first + tl.arange(0, BLOCK_N) // POOL_PAD
        slots, valid = _list_slots(selected_row, stride_sk, entries, num_selected, end, position, POOL, POOL_PAD)
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(key_base + slots[:, None].to(tl.int64) * stride_ks + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_base + slots[:, None].to(tl.int64) * stride_vs + dims[None, :], mask=kv_mask, other=0.0)
        if FP32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # nothing valid yet: no NaN from inf - inf
        probs = tl.exp(scores - safe_max[:, None])
        correction = tl.exp(row_max - safe_max)
        row_sum = row_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        row_max = new_max
    output = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    lse = tl.where(row_sum == 0.0, float("-inf"), row_max + tl.log(row_sum))
    row = (split.to(tl.int64) * tl.num_programs(0) + token) * (tl.num_programs(1) * GROUP) + heads
    tl.store(out_ptr + row[:, None] * HEAD_DIM + dims[None, :], output.to(out_ptr.dtype.element_ty),
             mask=head_mask[:, None] & dim_mask[None, :])
    tl.store(lse_ptr + row, lse, mask=head_mask)


def plan_forward(query, key, value, selected, positions, pool_size, scaling, num_splits=1):
    """(launches, output `[batch, queries, heads, dim]`, lse `[batch * queries, heads]`): the forward kernel and,
    with several splits, the combine kernel."""
    batch_size, num_heads, num_queries, head_dim = query.shape
    num_kv_heads, num_selected = key.shape[1], selected.shape[-1]
    sizes = _sizes(query, key, pool_size)
    block_n = _block_n(query, pool_size)
    windows_per_block = block_n // sizes["POOL_PAD"]
    num_entries = num_selected + 1
    windows_per_split = triton.cdiv(triton.cdiv(num_entries, num_splits), windows_per_block) * windows_per_block
    num_splits = triton.cdiv(num_entries, windows_per_split)
    tokens = batch_size * num_queries
    output = torch.empty(batch_size, num_queries, num_heads, head_dim, dtype=query.dtype, device=query.device)
    lse = torch.empty(tokens, num_heads, dtype=torch.float32, device=query.device)
    partial, partial_lse = output, lse
    if num_splits > 1:
        partial = torch.empty(num_splits, tokens, num_heads, head_dim, dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(num_splits, tokens, num_heads, dtype=torch.float32, device=query.device)
    launches = [Launch(
        _sparse_attention_forward_kernel, (tokens, num_kv_heads, num_splits),
        (query, key, value, selected, positions, partial, partial_lse,
         num_queries, num_selected, windows_per_split, scaling,
         *query.stride()[:3], *key.stride()[:3], *value.stride()[:3], *_index_strides(selected, positions)),
        dict(BLOCK_N=block_n, **sizes, num_warps=4 if _width(query) <= 256 else 8, num_stages=STAGES),
    )]
    if num_splits > 1:
        launches.append(combine_launch(partial, partial_lse, output, num_splits, tokens * num_heads, head_dim,
                                       sizes["DIM_PAD"]))
    return launches, output, lse
