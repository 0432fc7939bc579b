"""Triton IndexPool sparse attention: forward (prefill and split decode), combine, backward (dq; dk and dv key-major).

A query's keys are a list of windows: its selected windows (all `r` positions of each) and then its tail, its own
open window `(p + 1) // r` up to its position `p` (positions `r * ((p + 1) // r) .. p`). One program serves one query
token and one key/value head, i.e. all the query heads of that GQA group (they share the selection) as the rows of
its matrix products, padded only to a power of two. It walks the list in tiles of `BLOCK_N` positions (`BLOCK_N / r`
windows) with an online softmax; products run on tensor cores in bf16/fp16 with float32 accumulation. Decode splits
a query's list over several programs (enough to fill the GPU, a runtime number: no recompilation per batch size)
and a combine kernel merges their partial outputs by log-sum-exp.

The backward recomputes the probabilities from the saved log-sum-exp. dq is query-major (the forward's walk). dk and
dv are key-major, with no atomics: the selection is inverted on the device (each (row, window) lists the queries whose
list holds it, tails included), and one program per window and key/value head accumulates the gradients of its `r`
keys over those queries and writes them once.

Every offset that can pass 2^31 (batch, position and query strides at long contexts) is computed in int64.
"""

import torch

from ..dispatch import triton_interpreted
from ..launch import PROGRAMS_PER_SM, Launch, dot_precision, multiprocessor_count

try:
    import triton
    import triton.language as tl
except ImportError as error:  # Triton is optional; the package falls back to the PyTorch reference.
    raise ImportError("Triton is not installed") from error

# Rows (queries x the GQA group) per step of the key-major backward, 16-bit inputs.
BACKWARD_ROWS = 64
# Software-pipeline stages. With two, ptxas (under the --regAllocOptLevel=2 Triton passes it) settles a handful of
# configurations at 72-80 registers with 2-6 words spilled; three stages for the query-major walks (forward, dq) and
# one for the 16-bit key-major pass (two for its float32 tf32x3 products) compile without spills across the matrix of
# kernels/aot.py. Register caps (`maxnreg`) made it worse: ptxas then fills the cap and still spills.
STAGES, STAGES_KEY_PASS, STAGES_KEY_PASS_FP32 = 3, 1, 2
# Positions a decode split covers at least: its float32 partial output (group x head dim, written, then read by the
# combine) then costs at most group / 64 of the bytes of the keys and values it reads (12.5% for a group of 8).
MIN_SPLIT_POSITIONS = 128
# The latent (MLA) kernel: query heads per program, positions per tile, warps and stages. A program holds its heads'
# float32 accumulator (heads x latent width) and a tile of latents (the keys and the values at once).
LATENT_HEADS, LATENT_BLOCK_N, LATENT_WARPS, LATENT_STAGES = 32, 32, 8, 2


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


@triton.jit(do_not_specialize=["num_splits", "num_rows"])
def _combine_splits_kernel(partial_ptr, partial_lse_ptr, out_ptr, num_splits, num_rows, HEAD_DIM: tl.constexpr,
                           DIM_PAD: tl.constexpr, BLOCK_R: tl.constexpr):
    """Merge the splits' partial outputs `[split, row, dim]` (rows: token x head) by their log-sum-exp."""
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
    tl.store(out_ptr + rows[:, None] * HEAD_DIM + dims[None, :], output.to(out_ptr.dtype.element_ty), mask=mask)


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


def decode_splits(query, key, selected, pool_size, multiprocessors: int) -> int:
    """Splits of each query's list: enough programs to fill the GPU (`PROGRAMS_PER_SM` per multiprocessor), each
    split `MIN_SPLIT_POSITIONS` positions at least. A runtime number (the kernel is not recompiled for another)."""
    programs = query.shape[0] * query.shape[2] * key.shape[1]
    pool_pad = triton.next_power_of_2(pool_size)
    windows_per_split = max(_block_n(query, pool_size), MIN_SPLIT_POSITIONS) // pool_pad
    most = triton.cdiv(selected.shape[-1] + 1, windows_per_split)
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * multiprocessors, programs), most))


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
        block_r = max(1, 2048 // sizes["DIM_PAD"])
        launches.append(Launch(
            _combine_splits_kernel, (triton.cdiv(tokens * num_heads, block_r),),
            (partial, partial_lse, output, num_splits, tokens * num_heads),
            dict(HEAD_DIM=head_dim, DIM_PAD=sizes["DIM_PAD"], BLOCK_R=block_r, num_warps=4, num_stages=1),
        ))
    return launches, output, lse


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
        block_r = max(1, 2048 // sizes["DIM_PAD"])
        launches.append(Launch(
            _combine_splits_kernel, (triton.cdiv(tokens * num_heads, block_r),),
            (partial, partial_lse, output, num_splits, tokens * num_heads),
            dict(HEAD_DIM=latent_dim, DIM_PAD=sizes["DIM_PAD"], BLOCK_R=block_r, num_warps=4, num_stages=1),
        ))
    return launches, output


def sparse_latent_attention_triton(query, latents, selected_windows, query_positions, pool_size, scaling,
                                   num_splits=None):
    """Triton version of `sparse_latent_attention_torch` (inference: no dropout, weights or gradient): output
    latents `[batch, queries, heads, latent_dim]`. Latents may be any view whose last dimension is contiguous (the
    cache's `[batch, capacity, 1, latent_dim]` storage seen as `[batch, 1, positions, latent_dim]`). `num_splits`
    as in `sparse_attention_triton`."""
    query, latents = _last_dim_contiguous(query), _last_dim_contiguous(latents)
    if num_splits is None:
        num_splits = latent_splits(query, selected_windows, pool_size, multiprocessor_count(query.device))
    launches, output = plan_latent_forward(query, latents, selected_windows, query_positions, pool_size, scaling,
                                           num_splits)
    _run(launches)
    return output


def _run(launches):
    for launch in launches:
        launch.run()


class SparseAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: Triton forward, Triton backward (dq, dk, dv); the selection gets no gradient."""

    @staticmethod
    def forward(ctx, query, key, value, selected, positions, pool_size, scaling):
        launches, output, lse = plan_forward(query, key, value, selected, positions, pool_size, scaling)
        _run(launches)
        ctx.save_for_backward(query, key, value, selected, positions, output, lse)
        ctx.pool_size, ctx.scaling = pool_size, scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, selected, positions, output, lse = ctx.saved_tensors
        inverted = invert_selection(selected, positions, ctx.pool_size, key.shape[2])
        launches, grad_query, grad_key, grad_value = plan_backward(
            query, key, value, selected, positions, ctx.pool_size, ctx.scaling, output, grad_output.contiguous(),
            lse, *inverted)
        _run(launches)
        return grad_query, grad_key, grad_value, None, None, None, None


def _last_dim_contiguous(tensor):
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def sparse_attention_triton(query, key, value, selected_windows, query_positions, pool_size, scaling,
                            num_splits=None):
    """Triton version of `sparse_attention_torch` (no dropout, no weights): output `[batch, queries, heads, dim]`.

    `num_splits` splits each query's list of windows over that many programs (forward without gradient only;
    default: enough programs to fill the GPU, one tile at least per split). Keys and values may be any view whose
    last dimension is contiguous (the cache's position-major storage); ids and positions are read as given.
    """
    query, key, value = (_last_dim_contiguous(t) for t in (query, key, value))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return SparseAttentionFunction.apply(query, key, value, selected_windows, query_positions, pool_size,
                                             scaling)
    if num_splits is None:
        num_splits = decode_splits(query, key, selected_windows, pool_size, multiprocessor_count(query.device))
    launches, output, _ = plan_forward(query, key, value, selected_windows, query_positions, pool_size, scaling,
                                       num_splits)
    _run(launches)
    return output


def aot_launches(sizes) -> list[tuple[str, Launch]]:
    """Every attention kernel's launch at `sizes` (an `aot.ModelSizes`), on meta tensors. Decode: one query per row
    against a cache of `context` positions, split for `sizes.multiprocessors`; prefill: `queries` queries with the
    backward too."""
    if sizes.kernels == "index":
        return []
    if sizes.latent_dim:
        return _latent_aot_launches(sizes)
    meta = dict(device="meta", dtype=sizes.dtype)
    num_queries = 1 if sizes.mode == "decode" else sizes.queries
    batch_size = sizes.batch if sizes.mode == "decode" else 1
    num_positions = sizes.context if sizes.mode == "decode" else num_queries
    topk = sizes.budget // sizes.pool_size
    heads = sizes.kv_heads * sizes.group
    query = torch.empty(batch_size, num_queries, heads, sizes.head_dim, **meta).transpose(1, 2)
    # The cache's layout: [batch, capacity, kv_heads, head_dim] storage seen as [batch, kv_heads, positions, dim].
    key = torch.empty(batch_size, num_positions, sizes.kv_heads, sizes.head_dim, **meta).transpose(1, 2)
    selected = torch.empty(batch_size, num_queries, topk, dtype=torch.int64, device="meta")
    positions = torch.empty(batch_size, num_queries, dtype=torch.int64, device="meta")
    names = ("sparse_attention_forward", "combine_splits")
    if sizes.mode == "decode":
        num_splits = decode_splits(query, key, selected, sizes.pool_size, sizes.multiprocessors)
        launches, _, _ = plan_forward(query, key, key, selected, positions, sizes.pool_size, 0.1, num_splits)
        return list(zip(names, launches))
    launches, output, lse = plan_forward(query, key, key, selected, positions, sizes.pool_size, 0.1)
    entries = torch.empty(batch_size * num_queries * (topk + 1), dtype=torch.int64, device="meta")
    offsets = torch.empty(batch_size * num_positions // sizes.pool_size + 1, dtype=torch.int64, device="meta")
    backward, *_ = plan_backward(query, key, key, selected, positions, sizes.pool_size, 0.1, output, output, lse,
                                 entries, entries, offsets)
    return list(zip(names[:1], launches)) + list(zip(("sparse_attention_backward_dq",
                                                      "sparse_attention_backward_dkv"), backward))


def _latent_aot_launches(sizes) -> list[tuple[str, Launch]]:
    """The latent (MLA) kernel's launches at `sizes`: decode split for `sizes.multiprocessors`, prefill unsplit."""
    meta = dict(device="meta", dtype=sizes.dtype)
    num_queries = 1 if sizes.mode == "decode" else sizes.queries
    batch_size = sizes.batch if sizes.mode == "decode" else 1
    num_positions = sizes.context if sizes.mode == "decode" else num_queries
    heads = sizes.kv_heads * sizes.group
    query = torch.empty(batch_size, num_queries, heads, sizes.latent_dim, **meta).transpose(1, 2)
    # The cache's layout: [batch, capacity, 1, latent] storage seen as [batch, 1, positions, latent].
    latents = torch.empty(batch_size, num_positions, 1, sizes.latent_dim, **meta).transpose(1, 2)
    selected = torch.empty(batch_size, num_queries, sizes.budget // sizes.pool_size, dtype=torch.int64,
                           device="meta")
    positions = torch.empty(batch_size, num_queries, dtype=torch.int64, device="meta")
    num_splits = 1
    if sizes.mode == "decode":
        num_splits = latent_splits(query, selected, sizes.pool_size, sizes.multiprocessors)
    launches, _ = plan_latent_forward(query, latents, selected, positions, sizes.pool_size, 0.1, num_splits)
    return list(zip(("sparse_latent_attention", "combine_splits"), launches))

