"""The backward: the query-major dq kernel, the selection inverted on the device, the key-major dk/dv kernel,
and their planning."""

import torch

from ..dispatch import triton_interpreted
from ..launch import Launch
from .triton_shared import (
    STAGES,
    STAGES_KEY_PASS,
    STAGES_KEY_PASS_FP32,
    _block_n,
    _index_strides,
    _list_slots,
    _query_rows,
    _sizes,
    _width,
)

try:
    import triton
    import triton.language as tl
except ImportError as error:  # Triton is optional; the package falls back to the PyTorch reference.
    raise ImportError("Triton is not installed") from error

# Rows (queries x the GQA group) per step of the key-major backward, 16-bit inputs.
BACKWARD_ROWS = 64


@triton.jit(do_not_specialize=["num_queries", "num_selected"])
def _sparse_attention_backward_query_kernel(
    query_ptr, key_ptr, value_ptr, selected_ptr, position_ptr, out_ptr, grad_out_ptr, lse_ptr, delta_ptr,
    grad_query_ptr,
    num_queries, num_selected, scale,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_sb, stride_st, stride_sk,
    stride_pb, stride_pt,
    stride_gqb, stride_gqh, stride_gqt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    POOL: tl.constexpr, POOL_PAD: tl.constexpr, BLOCK_N: tl.constexpr, FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dq of one query token and key/value head (the forward's walk); also writes delta = rowsum(dO * O) `[token,
    head]` for the key-major pass. Output, its gradient, lse, delta and dq are contiguous `[token, head, (dim)]`."""
    token, kv_head = tl.program_id(0), tl.program_id(1)
    batch, query, heads, head_mask, dims, dim_mask = _query_rows(token, num_queries, kv_head, GROUP, GROUP_PAD,
                                                                HEAD_DIM, DIM_PAD)
    row_mask = head_mask[:, None] & dim_mask[None, :]
    q = tl.load(query_ptr + batch * stride_qb + heads[:, None] * stride_qh + query * stride_qt + dims[None, :],
                mask=row_mask, other=0.0)
    row = token.to(tl.int64) * (tl.num_programs(1) * GROUP) + heads
    grad_out = tl.load(grad_out_ptr + row[:, None] * HEAD_DIM + dims[None, :], mask=row_mask, other=0.0)
    out = tl.load(out_ptr + row[:, None] * HEAD_DIM + dims[None, :], mask=row_mask, other=0.0)
    delta = tl.sum(grad_out.to(tl.float32) * out.to(tl.float32), axis=1)
    tl.store(delta_ptr + row, delta, mask=head_mask)
    if FP32:
        q, grad_out = q.to(tl.float32), grad_out.to(tl.float32)
    lse = tl.load(lse_ptr + row, mask=head_mask, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)  # a query that saw nothing: every probability is masked
    position = tl.load(position_ptr + batch * stride_pb + query * stride_pt).to(tl.int32)
    selected_row = selected_ptr + batch * stride_sb + query * stride_st
    key_base = key_ptr + batch * stride_kb + kv_head * stride_kh
    value_base = value_ptr + batch * stride_vb + kv_head * stride_vh

    grad_query = tl.zeros((GROUP_PAD, DIM_PAD), tl.float32)
    for first in range(0, num_selected + 1, BLOCK_N // POOL_PAD):
        entries = first + tl.arange(0, BLOCK_N) // POOL_PAD
        slots, valid = _list_slots(selected_row, stride_sk, entries, num_selected, num_selected + 1, position, POOL,
                                   POOL_PAD)
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(key_base + slots[:, None].to(tl.int64) * stride_ks + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_base + slots[:, None].to(tl.int64) * stride_vs + dims[None, :], mask=kv_mask, other=0.0)
        if FP32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        probs = tl.where(valid[None, :], tl.exp(scores - lse[:, None]), 0.0)
        grad_probs = tl.dot(grad_out, tl.trans(v), input_precision=PRECISION)
        grad_scores = probs * (grad_probs - delta[:, None])
        grad_query += tl.dot(grad_scores.to(k.dtype), k, input_precision=PRECISION)
    tl.store(grad_query_ptr + batch * stride_gqb + heads[:, None] * stride_gqh + query * stride_gqt + dims[None, :],
             (grad_query * scale).to(grad_query_ptr.dtype.element_ty), mask=row_mask)


@triton.jit(do_not_specialize=["num_queries", "num_selected", "num_positions", "windows_per_row"])
def _sparse_attention_backward_key_kernel(
    query_ptr, key_ptr, value_ptr, position_ptr, grad_out_ptr, lse_ptr, delta_ptr, grad_key_ptr, grad_value_ptr,
    entry_ptr, entry_window_ptr, offset_ptr,
    num_queries, num_selected, num_positions, windows_per_row, scale,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_pb, stride_pt,
    stride_gkb, stride_gkh, stride_gks,
    stride_gvb, stride_gvh, stride_gvs,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    POOL: tl.constexpr, POOL_PAD: tl.constexpr, WINDOWS: tl.constexpr, BLOCK_Q: tl.constexpr, FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dk and dv of `WINDOWS` consecutive windows of one row and one key/value head: sums over the queries whose list
    holds one of them. The inverted selection lists them in order: entries `offsets[w] .. offsets[w + 1]` for window
    `w` (counted over all rows), each `token * (topk + 1) + list index` (index `topk` is the tail), with its window in
    `entry_windows`. An entry reaches only its own window's keys: the `WINDOWS * r` keys make one tile of at least 16
    rows for the matrix products, whatever `r`."""
    blocks_per_row = tl.cdiv(windows_per_row, WINDOWS)
    block, kv_head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    batch, first_window = block // blocks_per_row, (block % blocks_per_row).to(tl.int32) * WINDOWS
    dims = tl.arange(0, DIM_PAD)
    dim_mask = dims < HEAD_DIM
    columns = tl.arange(0, WINDOWS * POOL_PAD)
    column_window = first_window + columns // POOL_PAD
    slots = column_window * POOL + columns % POOL_PAD
    slot_mask = (columns % POOL_PAD < POOL) & (column_window < windows_per_row) & (slots < num_positions)
    kv_mask = slot_mask[:, None] & dim_mask[None, :]
    k = tl.load(key_ptr + batch * stride_kb + kv_head * stride_kh + slots[:, None].to(tl.int64) * stride_ks
                + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(value_ptr + batch * stride_vb + kv_head * stride_vh + slots[:, None].to(tl.int64) * stride_vs
                + dims[None, :], mask=kv_mask, other=0.0)
    if FP32:
        k, v = k.to(tl.float32), v.to(tl.float32)

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)  # (entry, head of the group) pairs, entry-major
    group_head = rows % GROUP_PAD
    heads = kv_head * GROUP + group_head
    num_heads = tl.num_programs(1) * GROUP
    grad_key = tl.zeros((WINDOWS * POOL_PAD, DIM_PAD), tl.float32)
    grad_value = tl.zeros((WINDOWS * POOL_PAD, DIM_PAD), tl.float32)
    first_entry = tl.load(offset_ptr + batch * windows_per_row + first_window)
    last_entry = tl.load(offset_ptr + batch * windows_per_row + tl.minimum(first_window + WINDOWS, windows_per_row))
    for start in range(first_entry, last_entry, BLOCK_Q):
        entry_index = start + rows // GROUP_PAD
        row_mask = (entry_index < last_entry) & (group_head < GROUP)
        entry = tl.load(entry_ptr + entry_index, mask=row_mask, other=0)
        window = tl.load(entry_window_ptr + entry_index, mask=row_mask, other=-1) - batch * windows_per_row
        token = entry // (num_selected + 1)
        is_tail = entry % (num_selected + 1) == num_selected
        query = token % num_queries
        position = tl.load(position_ptr + batch * stride_pb + query * stride_pt, mask=row_mask, other=0)
        row = token * num_heads + heads
        q = tl.load(query_ptr + batch * stride_qb + heads[:, None] * stride_qh + query[:, None] * stride_qt
                    + dims[None, :], mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
        grad_out = tl.load(grad_out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
                           mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
        lse = tl.load(lse_ptr + row, mask=row_mask, other=0.0)
        lse = tl.where(lse == float("-inf"), 0.0, lse)
        delta = tl.load(delta_ptr + row, mask=row_mask, other=0.0)
        if FP32:
            q, grad_out = q.to(tl.float32), grad_out.to(tl.float32)
        valid = (row_mask[:, None] & slot_mask[None, :] & (column_window[None, :] == window[:, None])
                 & (~is_tail[:, None] | (slots[None, :] <= position[:, None])))
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [rows, WINDOWS * POOL_PAD]
        probs = tl.where(valid, tl.exp(scores - lse[:, None]), 0.0)
        grad_probs = tl.dot(grad_out, tl.trans(v), input_precision=PRECISION)
        grad_scores = probs * (grad_probs - delta[:, None])
        grad_value += tl.dot(tl.trans(probs.to(grad_out.dtype)), grad_out, input_precision=PRECISION)
        grad_key += tl.dot(tl.trans(grad_scores.to(q.dtype)), q, input_precision=PRECISION)
    tl.store(grad_key_ptr + batch * stride_gkb + kv_head * stride_gkh + slots[:, None].to(tl.int64) * stride_gks
             + dims[None, :], (grad_key * scale).to(grad_key_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(grad_value_ptr + batch * stride_gvb + kv_head * stride_gvh + slots[:, None].to(tl.int64) * stride_gvs
             + dims[None, :], grad_value.to(grad_value_ptr.dtype.element_ty), mask=kv_mask)


def invert_selection(selected, positions, pool_size, num_positions):
    """The inverted selection: (entries, entry_windows, offsets). Entries list every (query token, list index) whose
    window is valid (list index `topk` is the tail window) as `token * (topk + 1) + index`, sorted by (row, window);
    `entry_windows` holds `row * windows + window` of each (`windows = ceil(num_positions / r)` per row), and the
    entries of window `w` of row `b` are `offsets[b * windows + w] .. offsets[b * windows + w + 1]`. On the device,
    without host synchronisation."""
    batch_size, num_queries, num_selected = selected.shape
    windows_per_row = triton.cdiv(num_positions, pool_size)
    tail = torch.where((positions + 1) % pool_size > 0, (positions + 1) // pool_size, -1)
    windows = torch.cat([selected, tail[..., None].to(selected.dtype)], dim=-1).long()
    rows = torch.arange(batch_size, device=selected.device)[:, None, None]
    valid = (windows >= 0) & (windows < windows_per_row)
    sentinel = batch_size * windows_per_row
    keys = torch.where(valid, rows * windows_per_row + windows, sentinel).flatten()
    sorted_keys, entries = torch.sort(keys, stable=True)
    offsets = torch.searchsorted(sorted_keys, torch.arange(sentinel + 1, device=selected.device))
    return entries, sorted_keys, offsets


def plan_backward(query, key, value, selected, positions, pool_size, scaling, output, grad_output, lse, entries,
                  entry_windows, offsets):
    """(launches, grad_query, grad_key, grad_value): dq (also delta), then dk and dv over the inverted selection."""
    batch_size, num_heads, num_queries, head_dim = query.shape
    num_kv_heads, num_positions = key.shape[1], key.shape[2]
    num_selected = selected.shape[-1]
    sizes = _sizes(query, key, pool_size)
    tokens = batch_size * num_queries
    delta = torch.empty(tokens, num_heads, dtype=torch.float32, device=query.device)
    grad_query = torch.empty_like(query)
    grad_key, grad_value = torch.empty_like(key), torch.empty_like(value)
    index_strides = _index_strides(selected, positions)
    wide, fp32_inputs = _width(query) > 256, query.dtype == torch.float32
    query_launch = Launch(
        _sparse_attention_backward_query_kernel, (tokens, num_kv_heads),
        (query, key, value, selected, positions, output, grad_output, lse, delta, grad_query,
         num_queries, num_selected, scaling,
         *query.stride()[:3], *key.stride()[:3], *value.stride()[:3], *index_strides, *grad_query.stride()[:3]),
        dict(BLOCK_N=_block_n(query, pool_size), **sizes, num_warps=8 if wide else 4, num_stages=STAGES),
    )
    # Rows (query x head) per step of the key-major pass: fewer for wide rows. Float32 runs its products as three
    # tf32 products there (float32 accuracy): plain float32 products of these shapes spill thousands of registers.
    rows = 16 if fp32_inputs else BACKWARD_ROWS // (2 if wide else 1)
    key_sizes = dict(sizes, PRECISION="tf32x3") if fp32_inputs and not triton_interpreted() else sizes
    windows_per_row = triton.cdiv(num_positions, pool_size)
    windows = max(1, 16 // sizes["POOL_PAD"])
    key_launch = Launch(
        _sparse_attention_backward_key_kernel, (batch_size * triton.cdiv(windows_per_row, windows), num_kv_heads),
        (query, key, value, positions, grad_output, lse, delta, grad_key, grad_value, entries, entry_windows, offsets,
         num_queries, num_selected, num_positions, windows_per_row, scaling,
         *query.stride()[:3], *key.stride()[:3], *value.stride()[:3], *positions.stride(),
         *grad_key.stride()[:3], *grad_value.stride()[:3]),
        dict(WINDOWS=windows, BLOCK_Q=max(1, rows // sizes["GROUP_PAD"]), **key_sizes,
             num_warps=8 if fp32_inputs else 4, num_stages=STAGES_KEY_PASS_FP32 if fp32_inputs else STAGES_KEY_PASS),
    )
    return [query_launch, key_launch], grad_query, grad_key, grad_value
