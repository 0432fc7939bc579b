"""The forward kernel (prefill, and one split of a decode step's lists) and its planning."""

import torch

from ..launch import Launch
from .triton_decode import combine_launch
from .triton_shared import STAGES, _block_n, _gated, _index_strides, _list_slots, _query_rows, _sizes, _width

try:
    import triton
    import triton.language as tl
except ImportError as error:  # Triton is optional; the package falls back to the PyTorch reference.
    raise ImportError("Triton is not installed") from error


# Not specialised: the sizes that change from call to call (one compilation for every batch size and split count), and
# vLLM's block size and block-table width (any integers; the table is read one id per position).
@triton.jit(do_not_specialize=["num_queries", "num_selected", "windows_per_split", "stride_table", "block_size"])
def _sparse_attention_forward_kernel(
    query_ptr, key_ptr, value_ptr, selected_ptr, position_ptr, out_ptr, lse_ptr,
    num_queries, num_selected, windows_per_split, scale,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_sb, stride_st, stride_sk,
    stride_pb, stride_pt,
    table_ptr, request_ptr, stride_table, block_size,
    gate_ptr, stride_gt, stride_gh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    POOL: tl.constexpr, POOL_PAD: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr,
    PRECISION: tl.constexpr, PAGED: tl.constexpr = False, GATED: tl.constexpr = False,
):
    """Output (or a split's partial output, float32) `[split, token, head, dim]` and log-sum-exp `[split, token,
    head]` of one query token, key/value head and split of its list.

    `PAGED`: keys and values live in vLLM's pages (`[num_blocks, kv_heads, block_size, dim]`, the `b` strides step
    over pages); the batch is 1 (the step's flattened tokens), token `t` belongs to request `request_ptr[t]`, whose
    position `s` is row `s % block_size` of page `table_ptr[request, s // block_size]`. `GATED` (unsplit only): the
    output times the sigmoid of `gate_ptr` `[token, head, dim]`, rounded as the model's gate in the output dtype.
    Off, the table and gate arguments are None and the kernel is the unpaged one."""
    token, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    batch, query, heads, head_mask, dims, dim_mask = _query_rows(token, num_queries, kv_head, GROUP, GROUP_PAD,
                                                                HEAD_DIM, DIM_PAD)
    q = tl.load(query_ptr + batch * stride_qb + heads[:, None] * stride_qh + query * stride_qt + dims[None, :],
                mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
    if FP32:
        q = q.to(tl.float32)
    position = tl.load(position_ptr + batch * stride_pb + query * stride_pt).to(tl.int32)
    selected_row = selected_ptr + batch * stride_sb + query * stride_st
    if PAGED:
        # The pages' base is the cache's: each row's page is added per tile.
        table_row = table_ptr + tl.load(request_ptr + query).to(tl.int64) * stride_table
        key_base = key_ptr + kv_head * stride_kh
        value_base = value_ptr + kv_head * stride_vh
    else:
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
        if PAGED:
            # One page id per position (a window may straddle pages when r does not divide the block size); int64:
            # page x page stride passes 2^31 in a large cache.
            page = tl.load(table_row + slots // block_size, mask=valid, other=0).to(tl.int64)
            row = (slots % block_size).to(tl.int64)
            key_rows = page * stride_kb + row * stride_ks
            value_rows = page * stride_vb + row * stride_vs
            k = tl.load(key_base + key_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            v = tl.load(value_base + value_rows[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        else:
            k = tl.load(key_base + slots[:, None].to(tl.int64) * stride_ks + dims[None, :], mask=kv_mask, other=0.0)
            v = tl.load(value_base + slots[:, None].to(tl.int64) * stride_vs + dims[None, :], mask=kv_mask,
                        other=0.0)
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
    if GATED:
        gate = tl.load(gate_ptr + token.to(tl.int64) * stride_gt + heads[:, None] * stride_gh + dims[None, :],
                       mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
        output = _gated(output, gate, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row[:, None] * HEAD_DIM + dims[None, :], output.to(out_ptr.dtype.element_ty),
             mask=head_mask[:, None] & dim_mask[None, :])
    tl.store(lse_ptr + row, lse, mask=head_mask)


def plan_forward(query, key, value, selected, positions, pool_size, scaling, num_splits=1, paging=None, gate=None):
    """(launches, output `[batch, queries, heads, dim]`, lse `[batch * queries, heads]`): the forward kernel and,
    with several splits, the combine kernel.

    `paging` = (block_table `[requests, max_blocks]`, token_request `[queries]`, block_size): keys and values are
    vLLM's pages `[num_blocks, kv_heads, block_size, dim]` and the batch is one (a step's flattened tokens). `gate`
    `[batch * queries, heads, dim]` (last dimension contiguous): the output times its sigmoid, in the store of the
    kernel that writes the output (the forward when unsplit, else the combine)."""
    batch_size, num_heads, num_queries, head_dim = query.shape
    num_kv_heads, num_selected = key.shape[1], selected.shape[-1]
    sizes = _sizes(query, key, pool_size)
    block_n = _block_n(query, pool_size)
    windows_per_block = block_n // sizes["POOL_PAD"]
    num_entries = num_selected + 1
    # Whole tiles per split where they give the splits asked for; else (a small batch filling the GPU) splits of
    # less than a tile, at least as many as asked.
    windows_per_split = triton.cdiv(triton.cdiv(num_entries, num_splits), windows_per_block) * windows_per_block
    if triton.cdiv(num_entries, windows_per_split) < num_splits:
        windows_per_split = max(1, num_entries // num_splits)
    num_splits = triton.cdiv(num_entries, windows_per_split)
    tokens = batch_size * num_queries
    output = torch.empty(batch_size, num_queries, num_heads, head_dim, dtype=query.dtype, device=query.device)
    lse = torch.empty(tokens, num_heads, dtype=torch.float32, device=query.device)
    partial, partial_lse = output, lse
    if num_splits > 1:
        partial = torch.empty(num_splits, tokens, num_heads, head_dim, dtype=torch.float32, device=query.device)
        partial_lse = torch.empty(num_splits, tokens, num_heads, dtype=torch.float32, device=query.device)
    options = dict(BLOCK_N=block_n, **sizes)
    # Off, the paged and gate arguments are None: constexprs, absent from the compiled signature.
    paged_args, gate_args = (None,) * 4, (None,) * 3
    if paging is not None:
        block_table, token_request, block_size = paging
        paged_args = (block_table, token_request, block_table.stride(0), block_size)
        options.update(PAGED=True)
    if gate is not None and num_splits == 1:
        gate_args = (gate, *gate.stride()[:2])
        options.update(GATED=True)
    launches = [Launch(
        _sparse_attention_forward_kernel, (tokens, num_kv_heads, num_splits),
        (query, key, value, selected, positions, partial, partial_lse,
         num_queries, num_selected, windows_per_split, scaling,
         *query.stride()[:3], *key.stride()[:3], *value.stride()[:3], *_index_strides(selected, positions),
         *paged_args, *gate_args),
        dict(options, num_warps=4 if _width(query) <= 256 else 8, num_stages=STAGES),
    )]
    if num_splits > 1:
        launches.append(combine_launch(partial, partial_lse, output, num_splits, tokens * num_heads, head_dim,
                                       sizes["DIM_PAD"], gate))
    return launches, output, lse
