"""Triton IndexPool sparse attention: forward (prefill and split decode) and backward (dq, dk, dv).

One program serves one query token and one key/value head, i.e. all the query heads of that GQA group at once
(they share the selection). It walks the selected windows in blocks of `BLOCK_N` cache slots (`BLOCK_N / r` windows
of `r` contiguous slots each), then the tail, with an online softmax. For decode the selected windows are split over
several programs whose partial outputs are combined by their log-sum-exp. The backward recomputes the probabilities
from the saved log-sum-exp, keeps dq in registers and adds dk/dv into float32 buffers atomically (a key is shared
by many queries).
"""

import torch

from ..dispatch import triton_interpreted

try:
    import triton
    import triton.language as tl
except ImportError as error:  # Triton is optional; the package falls back to the PyTorch reference.
    raise ImportError("Triton is not installed") from error


@triton.jit
def _block_slots(block, num_window_blocks, selected_row, window_start, window_end, query_position, tail_length,
                 POOL: tl.constexpr, POOL_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Positions of block `block` of a query's walk, and which are valid: first the blocks of selected windows
    `window_start .. window_end` (`BLOCK_N / POOL_PAD` windows each), then the blocks of the tail."""
    n = tl.arange(0, BLOCK_N)
    if block < num_window_blocks:
        window_index = window_start + block * (BLOCK_N // POOL_PAD) + n // POOL_PAD
        within = n % POOL_PAD
        window = tl.load(selected_row + window_index, mask=window_index < window_end, other=-1)
        valid = (window >= 0) & (within < POOL)
        slots = window * POOL + within
    else:
        position = (block - num_window_blocks) * BLOCK_N + n
        valid = position < tail_length
        slots = query_position - tail_length + 1 + position
    return tl.where(valid, slots, 0), valid


@triton.jit
def _program_rows(num_queries, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  DIM_PAD: tl.constexpr):
    """What a program serves: its query token (grid axis 0 over batch x queries), its key/value head (axis 1), the
    query heads of that GQA group and the head dimensions, with their masks."""
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    head_mask = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, DIM_PAD)
    return token, kv_head, token // num_queries, token % num_queries, heads, head_mask, dims, dims < HEAD_DIM


@triton.jit
def _sparse_attention_forward_kernel(
    query_ptr, key_ptr, value_ptr, selected_ptr, position_ptr, out_ptr, lse_ptr,
    num_queries, num_selected, windows_per_split, scale,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_ot, stride_oh, stride_osplit,
    stride_lb, stride_lh, stride_lt, stride_lsplit,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    POOL: tl.constexpr, POOL_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    FP32: tl.constexpr,
):
    split = tl.program_id(2)
    token, kv_head, batch, query, heads, head_mask, dims, dim_mask = _program_rows(
        num_queries, GROUP, GROUP_PAD, HEAD_DIM, DIM_PAD)

    q = tl.load(query_ptr + batch * stride_qb + heads[:, None] * stride_qh + query * stride_qt + dims[None, :],
                mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
    if FP32:
        q = q.to(tl.float32)
    query_position = tl.load(position_ptr + token)  # [batch, queries] contiguous
    tail_length = (query_position + 1) % POOL
    selected_row = selected_ptr + token * num_selected  # [batch, queries, topk] contiguous
    key_base = key_ptr + batch * stride_kb + kv_head * stride_kh
    value_base = value_ptr + batch * stride_vb + kv_head * stride_vh

    row_max = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    row_sum = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, DIM_PAD), tl.float32)
    start = split * windows_per_split
    end = tl.minimum(start + windows_per_split, num_selected)
    num_tail_blocks = tl.where(split == NUM_SPLITS - 1, tl.cdiv(tail_length, BLOCK_N), 0)
    num_window_blocks = tl.cdiv(tl.maximum(end - start, 0), BLOCK_N // POOL_PAD)
    for block in range(0, num_window_blocks + num_tail_blocks):
        slots, valid = _block_slots(block, num_window_blocks, selected_row, start, end, query_position, tail_length,
                                    POOL, POOL_PAD, BLOCK_N)
        k = tl.load(key_base + slots[:, None] * stride_ks + dims[None, :], mask=valid[:, None] & dim_mask[None, :],
                    other=0.0)
        v = tl.load(value_base + slots[:, None] * stride_vs + dims[None, :],
                    mask=valid[:, None] & dim_mask[None, :], other=0.0)
        if FP32:
            k, v = k.to(tl.float32), v.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp(scores - safe_max[:, None])
        correction = tl.exp(row_max - safe_max)
        row_sum = row_sum * correction + tl.sum(probs, axis=1)
        if FP32:
            acc = acc * correction[:, None] + tl.dot(probs, v, input_precision="ieee")
        else:
            acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v)
        row_max = new_max
    output = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    lse = tl.where(row_sum == 0.0, float("-inf"), row_max + tl.log(row_sum))
    tl.store(out_ptr + batch * stride_ob + query * stride_ot + heads[:, None] * stride_oh + split * stride_osplit
             + dims[None, :], output.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & dim_mask[None, :])
    tl.store(lse_ptr + batch * stride_lb + heads * stride_lh + query * stride_lt + split * stride_lsplit, lse,
             mask=head_mask)


@triton.jit
def _sparse_attention_backward_kernel(
    query_ptr, key_ptr, value_ptr, selected_ptr, position_ptr, lse_ptr, delta_ptr,
    grad_out_ptr, grad_query_ptr, grad_key_ptr, grad_value_ptr,
    num_queries, num_selected, scale,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_gb, stride_gh, stride_gs,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lh, stride_lt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    POOL: tl.constexpr, POOL_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    token, kv_head, batch, query, heads, head_mask, dims, dim_mask = _program_rows(
        num_queries, GROUP, GROUP_PAD, HEAD_DIM, DIM_PAD)
    row_mask = head_mask[:, None] & dim_mask[None, :]

    q = tl.load(query_ptr + batch * stride_qb + heads[:, None] * stride_qh + query * stride_qt + dims[None, :],
                mask=row_mask, other=0.0).to(tl.float32)
    grad_out = tl.load(grad_out_ptr + batch * stride_ob + query * stride_ot + heads[:, None] * stride_oh
                       + dims[None, :], mask=row_mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + batch * stride_lb + heads * stride_lh + query * stride_lt, mask=head_mask, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.load(delta_ptr + batch * stride_lb + heads * stride_lh + query * stride_lt, mask=head_mask,
                    other=0.0)
    query_position = tl.load(position_ptr + token)
    tail_length = (query_position + 1) % POOL
    selected_row = selected_ptr + token * num_selected
    key_base = key_ptr + batch * stride_kb + kv_head * stride_kh
    value_base = value_ptr + batch * stride_vb + kv_head * stride_vh
    grad_offset = batch * stride_gb + kv_head * stride_gh  # float32 dk and dv share one contiguous layout

    grad_query = tl.zeros((GROUP_PAD, DIM_PAD), tl.float32)
    num_window_blocks = tl.cdiv(num_selected, BLOCK_N // POOL_PAD)
    for block in range(0, num_window_blocks + tl.cdiv(tail_length, BLOCK_N)):
        slots, valid = _block_slots(block, num_window_blocks, selected_row, 0, num_selected, query_position,
                                    tail_length, POOL, POOL_PAD, BLOCK_N)
        kv_mask = valid[:, None] & dim_mask[None, :]
        k = tl.load(key_base + slots[:, None] * stride_ks + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(value_base + slots[:, None] * stride_vs + dims[None, :], mask=kv_mask,
                    other=0.0).to(tl.float32)
        grad_pointers = grad_offset + slots[:, None] * stride_gs + dims[None, :]
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        probs = tl.where(valid[None, :] & head_mask[:, None], tl.exp(scores - lse[:, None]), 0.0)
        grad_probs = tl.dot(grad_out, tl.trans(v), input_precision="ieee")
        grad_scores = probs * (grad_probs - delta[:, None]) * scale
        grad_query += tl.dot(grad_scores, k, input_precision="ieee")
        tl.atomic_add(grad_key_ptr + grad_pointers, tl.dot(tl.trans(grad_scores), q, input_precision="ieee"),
                      mask=kv_mask)
        tl.atomic_add(grad_value_ptr + grad_pointers, tl.dot(tl.trans(probs), grad_out, input_precision="ieee"),
                      mask=kv_mask)
    tl.store(grad_query_ptr + batch * stride_qb + heads[:, None] * stride_qh + query * stride_qt + dims[None, :],
             grad_query.to(grad_query_ptr.dtype.element_ty), mask=row_mask)


def _launch_settings(query, key, pool_size):
    group = query.shape[1] // key.shape[1]
    pool_pad = triton.next_power_of_2(pool_size)
    return dict(
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=query.shape[-1],
        DIM_PAD=max(16, triton.next_power_of_2(query.shape[-1])), POOL=pool_size, POOL_PAD=pool_pad,
        BLOCK_N=max(16, pool_pad),
    )


def _forward(query, key, value, selected, positions, pool_size, scaling, num_splits=None):
    batch_size, num_heads, num_queries, head_dim = query.shape
    num_kv_heads, num_selected = key.shape[1], selected.shape[-1]
    settings = _launch_settings(query, key, pool_size)
    if num_splits is None:
        programs = batch_size * num_queries * num_kv_heads
        num_splits = 1 if num_queries > 1 else max(1, min(16, num_selected // 32, 512 // max(1, programs)))
    windows_per_split = triton.cdiv(num_selected, num_splits) if num_selected else 1
    num_splits = max(1, triton.cdiv(num_selected, windows_per_split)) if num_selected else 1
    fp32 = query.dtype == torch.float32 or triton_interpreted()
    partial_dtype = query.dtype if num_splits == 1 else torch.float32
    # [batch, queries, heads, splits, head_dim] partial outputs, [batch, heads, queries, splits] log-sum-exp
    out = torch.empty(batch_size, num_queries, num_heads, num_splits, head_dim, dtype=partial_dtype,
                      device=query.device)
    lse = torch.empty(batch_size, num_heads, num_queries, num_splits, dtype=torch.float32, device=query.device)
    grid = (batch_size * num_queries, num_kv_heads, num_splits)
    _sparse_attention_forward_kernel[grid](
        query, key, value, selected, positions, out, lse,
        num_queries, num_selected, windows_per_split, scaling,
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        out.stride(0), out.stride(1), out.stride(2), out.stride(3),
        lse.stride(0), lse.stride(1), lse.stride(2), lse.stride(3),
        NUM_SPLITS=num_splits, FP32=fp32, **settings,
    )
    if num_splits == 1:
        return out.squeeze(3), lse.squeeze(3)
    # Combine the splits by their log-sum-exp.
    total = torch.logsumexp(lse, dim=-1)  # [batch, heads, queries]
    weights = torch.exp(lse - total[..., None]).nan_to_num(0.0)  # a split that saw nothing has lse = -inf
    output = torch.einsum("bqhsd,bhqs->bqhd", out, weights).to(query.dtype)
    return output, total


class SparseAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: Triton forward, Triton backward (dq, dk, dv); the selection gets no gradient."""

    @staticmethod
    def forward(ctx, query, key, value, selected, positions, pool_size, scaling):
        output, lse = _forward(query, key, value, selected, positions, pool_size, scaling)
        ctx.save_for_backward(query, key, value, selected, positions, output, lse)
        ctx.pool_size, ctx.scaling = pool_size, scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, selected, positions, output, lse = ctx.saved_tensors
        batch_size, num_heads, num_queries, _ = query.shape
        grad_output = grad_output.contiguous()
        # delta = rowsum(dO * O) per (batch, head, query), the softmax backward's correction
        delta = (grad_output.float() * output.float()).sum(-1).permute(0, 2, 1).contiguous()
        grad_query = torch.empty_like(query)
        grad_key = torch.zeros(key.shape, dtype=torch.float32, device=key.device)
        grad_value = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
        settings = _launch_settings(query, key, ctx.pool_size)
        grid = (batch_size * num_queries, key.shape[1])
        _sparse_attention_backward_kernel[grid](
            query, key, value, selected, positions, lse, delta,
            grad_output, grad_query, grad_key, grad_value,
            num_queries, selected.shape[-1], ctx.scaling,
            query.stride(0), query.stride(1), query.stride(2),
            key.stride(0), key.stride(1), key.stride(2),
            value.stride(0), value.stride(1), value.stride(2),
            grad_key.stride(0), grad_key.stride(1), grad_key.stride(2),
            grad_output.stride(0), grad_output.stride(1), grad_output.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2),
            **settings,
        )
        return grad_query, grad_key.to(key.dtype), grad_value.to(value.dtype), None, None, None, None


def sparse_attention_triton(query, key, value, selected_windows, query_positions, pool_size, scaling,
                            num_splits=None):
    """Triton version of `sparse_attention_torch` (no dropout, no weights): output `[batch, queries, heads, dim]`.

    `num_splits` splits each query's selection over that many programs (forward without gradient only; default:
    1 for prefill, more for decode).
    """
    # Any layout whose last dimension is contiguous works (the cache hands out views of larger storage).
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    index_args = (selected_windows.to(torch.int32).contiguous(), query_positions.to(torch.int32).contiguous())
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return SparseAttentionFunction.apply(query, key, value, *index_args, pool_size, scaling)
    return _forward(query, key, value, *index_args, pool_size, scaling, num_splits)[0]

