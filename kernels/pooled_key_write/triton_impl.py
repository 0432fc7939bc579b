"""Triton pooled-key write: a step's windows pooled, normed, rotated, optionally packed as fp8, and stored in vLLM's
paged pooled-key cache in one kernel.

A program holds `BLOCK_T` tokens. Token `t` computes the pooled key of `write_token[t]` (its window's last token in
the step) and stores it at `(write_block[t], write_row[t])` where `write_keep[t]`. The window's `r` rows are gathered
one at a time, each from the step's rows (`window_token >= 0`) or from the ring block of the request; the pooling
weights (softmax over the window of the gate logits plus the slot bias, or `1 / r`) are computed in float32 per
channel (per token for one logit per token, once for all channels). The window is walked by runtime loops (three
passes for the softmax: maximum, sum, weighted keys; the rows are re-read from cache), not unrolled: unrolled at
r = 16 the loads of every row were hoisted and spilled. The key's channels are held in three tiles, the two halves of
the rotary channels and the rest, so that the rotation pairs channel `i` with `i + rotary_dim / 2` without moving data
between lanes; the norm sums the squares of all three.

Rounding follows the reference step by step: the pooled key is rounded to the rows' dtype before the norm, the normed
key after it, and every product and sum of the RoPE is rounded to the dtype as PyTorch's elementwise operators round
them. Divisions and the square root are IEEE-rounded (`div_rn`, `sqrt_rn`), as PyTorch's on a CPU.

fp8 packing (`PACKED_FP8`): the rotated key `H k` (the orthonormal Walsh-Hadamard matrix, built in registers from the
parity of `i & j`, `ROTATION_CHUNK` columns at a time) is one matrix product per channel tile, exact in float32 for
16-bit keys whenever the sums are (the usual case); the power-of-two scale and the float32 -> fp8 e4m3 rounding (to
nearest, ties to even) are integer arithmetic, so sm_80, which has no fp8 conversion, packs the same bytes as
`quantize_pooled_keys`.
"""

import torch

from ..fp8_index_keys import is_packed
from ..launch import Launch, dot_precision
from .reference import WEIGHTINGS, check_write_arguments, gate_width_of

try:
    import triton
    import triton.language as tl
except ImportError as error:  # Triton is optional; the package falls back to the PyTorch reference.
    raise ImportError("Triton is not installed") from error

# Tokens per program and columns of the rotated key computed at once when packing fp8 (see `_store_packed`).
BLOCK_TOKENS, ROTATION_CHUNK = 16, 32
# The same for fp8 packing of float32 keys. Their products run on CUDA cores (`ieee`), each thread holding the whole
# reduction of its outputs' rows and columns: 16 tokens by 32 columns at 8 warps take 255 registers and spill (sm_90:
# 2 words at d = 64, 124 at d = 128; sm_80: 50 at d = 128), and at d = 128 so do 4 or 16 warps, or 8 tokens alone.
# 8 tokens by 16 columns spill nothing at d = 128 (178-182 registers, r = 1/4/16, every weighting) but 2 words at
# d = 64 (r = 16, one gate per token, sm_90, where ptxas holds 128); 8 columns there spill nothing (docs/kernels.md).
FP32_PACKED_BLOCK_TOKENS = 8


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """`x` (float32) rounded to `DTYPE` and back: where the reference holds a tensor of the model's dtype."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _window_row(step_ptr, stride_step, step_token, ring_row, columns, column_mask, token_mask, DTYPE: tl.constexpr):
    """float32 `[BLOCK_T, width]` values at `columns` of one row of each token's window: the step's row of
    `step_token` where it is >= 0, else the ring's row at `ring_row` (pointers `[BLOCK_T]`), first in the step's
    dtype as the reference converts it."""
    from_step = step_token >= 0
    mask = token_mask[:, None] & column_mask[None, :]
    fresh = tl.load(step_ptr + tl.maximum(step_token, 0)[:, None] * stride_step + columns[None, :],
                    mask=mask & from_step[:, None], other=0.0)
    kept = tl.load(ring_row[:, None] + columns[None, :], mask=mask & ~from_step[:, None], other=0.0)
    return tl.where(from_step[:, None], fresh.to(tl.float32), _round(kept.to(tl.float32), DTYPE))


@triton.jit
def _gate_logits(step_ptr, stride_step, step_token, ring_row, bias_ptr, stride_bias, slot, gates, gate_mask,
                 token_mask, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr):
    """float32 gate logits plus the slot's bias, `[BLOCK_T, width]`, of window row `slot` at gate columns `gates`."""
    logits = _window_row(step_ptr, stride_step, step_token, ring_row, HEAD_DIM + gates, gate_mask, token_mask, DTYPE)
    bias = tl.load(bias_ptr + slot * stride_bias + gates, mask=gate_mask, other=0.0).to(tl.float32)
    return logits + bias[None, :]


@triton.jit
def _token_logit(step_ptr, stride_step, step_token, ring_row, bias_ptr, stride_bias, slot, token_mask,
                 HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr):
    """float32 `[BLOCK_T]` gate logit (one per token) of window row `slot`, plus the slot's bias."""
    from_step = step_token >= 0
    fresh = tl.load(step_ptr + tl.maximum(step_token, 0) * stride_step + HEAD_DIM, mask=token_mask & from_step,
                    other=0.0)
    kept = tl.load(ring_row + HEAD_DIM, mask=token_mask & ~from_step, other=0.0)
    logit = tl.where(from_step, fresh.to(tl.float32), _round(kept.to(tl.float32), DTYPE))
    return logit + tl.load(bias_ptr + slot * stride_bias).to(tl.float32)


@triton.jit
def _token_softmax(step_ptr, stride_step, window_rows, ring_base, stride_ring_row, bias_ptr, stride_bias, token_mask,
                   HEAD_DIM: tl.constexpr, POOL: tl.constexpr, BLOCK_T: tl.constexpr, DTYPE: tl.constexpr):
    """(maximum, sum of the exponentials in window order), `[BLOCK_T]` each, of one gate logit per token over its
    window: the weight of row `j` is then `exp(logit_j - maximum) / sum`, as PyTorch's softmax computes it."""
    largest = tl.full((BLOCK_T,), float("-inf"), tl.float32)
    for slot in range(POOL):
        step_token = tl.load(window_rows + slot, mask=token_mask, other=0)
        largest = tl.maximum(largest, _token_logit(step_ptr, stride_step, step_token,
                                                   ring_base + slot * stride_ring_row, bias_ptr, stride_bias, slot,
                                                   token_mask, HEAD_DIM, DTYPE))
    total = tl.zeros((BLOCK_T,), tl.float32)
    for slot in range(POOL):
        step_token = tl.load(window_rows + slot, mask=token_mask, other=0)
        total += tl.exp(_token_logit(step_ptr, stride_step, step_token, ring_base + slot * stride_ring_row, bias_ptr,
                                     stride_bias, slot, token_mask, HEAD_DIM, DTYPE) - largest)
    return largest, total


@triton.jit
def _pool_channels(step_ptr, stride_step, window_rows, ring_base, stride_ring_row, bias_ptr, stride_bias, channels,
                   channel_mask, token_mask, token_largest, token_total, HEAD_DIM: tl.constexpr,
                   POOL: tl.constexpr, GATES: tl.constexpr, BLOCK_T: tl.constexpr, WIDTH: tl.constexpr,
                   DTYPE: tl.constexpr):
    """Pooled keys `[BLOCK_T, WIDTH]` at `channels`, rounded to the dtype: the softmax over the window of the gate
    logits (`GATES` = 1: one per token, its softmax's maximum and sum from `_token_softmax`; else one per channel)
    times the
    keys, summed in window order; without gates (`GATES` = 0) the mean."""
    accumulator = tl.zeros((BLOCK_T, WIDTH), tl.float32)
    if GATES == 0:
        for slot in range(POOL):
            step_token = tl.load(window_rows + slot, mask=token_mask, other=0)
            accumulator += _window_row(step_ptr, stride_step, step_token, ring_base + slot * stride_ring_row,
                                       channels, channel_mask, token_mask, DTYPE)
        accumulator = tl.math.div_rn(accumulator, tl.full((BLOCK_T, WIDTH), POOL, tl.float32))
    elif GATES == 1:  # the softmax's maximum and sum per token computed once (`token_largest`, `token_total`)
        for slot in range(POOL):
            step_token = tl.load(window_rows + slot, mask=token_mask, other=0)
            ring_row = ring_base + slot * stride_ring_row
            weight = tl.math.div_rn(tl.exp(_token_logit(step_ptr, stride_step, step_token, ring_row, bias_ptr,
                                                        stride_bias, slot, token_mask, HEAD_DIM, DTYPE)
                                           - token_largest), token_total)
            accumulator += weight[:, None] * _window_row(step_ptr, stride_step, step_token, ring_row, channels,
                                                         channel_mask, token_mask, DTYPE)
    else:
        # Three passes over the window (the logits are re-read from cache): the maximum, the sum of the
        # exponentials, then the weights exp / sum times the keys, as PyTorch's softmax and sum compute them.
        largest = tl.full((BLOCK_T, WIDTH), float("-inf"), tl.float32)
        for slot in range(POOL):
            step_token = tl.load(window_rows + slot, mask=token_mask, other=0)
            largest = tl.maximum(largest, _gate_logits(step_ptr, stride_step, step_token,
                                                       ring_base + slot * stride_ring_row, bias_ptr, stride_bias,
                                                       slot, channels, channel_mask, token_mask, HEAD_DIM, DTYPE))
        total = tl.zeros((BLOCK_T, WIDTH), tl.float32)
        for slot in range(POOL):
            step_token = tl.load(window_rows + slot, mask=token_mask, other=0)
            total += tl.exp(_gate_logits(step_ptr, stride_step, step_token, ring_base + slot * stride_ring_row,
                                         bias_ptr, stride_bias, slot, channels, channel_mask, token_mask, HEAD_DIM,
                                         DTYPE) - largest)
        for slot in range(POOL):
            step_token = tl.load(window_rows + slot, mask=token_mask, other=0)
            ring_row = ring_base + slot * stride_ring_row
            weight = tl.math.div_rn(tl.exp(_gate_logits(step_ptr, stride_step, step_token, ring_row, bias_ptr,
                                                        stride_bias, slot, channels, channel_mask, token_mask,
                                                        HEAD_DIM, DTYPE) - largest), total)
            accumulator += weight * _window_row(step_ptr, stride_step, step_token, ring_row, channels, channel_mask,
                                                token_mask, DTYPE)
    return _round(accumulator, DTYPE)


@triton.jit
def _inverse_rms(squares, eps, HEAD_DIM: tl.constexpr):
    """`rsqrt(mean + eps)` of the sums of squares `[BLOCK_T]`, IEEE-rounded (`1 / sqrt`, as PyTorch on a CPU)."""
    mean = tl.math.div_rn(squares, tl.full(squares.shape, HEAD_DIM, tl.float32))
    return tl.math.div_rn(tl.full(squares.shape, 1.0, tl.float32), tl.sqrt_rn(mean + eps))


@triton.jit
def _hadamard_rows(rows, row_mask, columns):
    """Rows `rows` of the unnormalised Walsh-Hadamard matrix at `columns`: `(-1)^popcount(i & j)` (0 where masked)."""
    parity = rows[:, None] & columns[None, :]
    parity ^= parity >> 16
    parity ^= parity >> 8
    parity ^= parity >> 4
    parity ^= parity >> 2
    parity ^= parity >> 1
    return tl.where(row_mask[:, None], 1.0 - 2.0 * (parity & 1).to(tl.float32), 0.0)


@triton.jit
def _float32_to_fp8_e4m3(x):
    """float8_e4m3fn bytes (uint8) of float32 `x` with `|x| <= 448` (what the scale guarantees), rounded to nearest,
    ties to even, as PyTorch converts. Integer arithmetic: sm_80 has no fp8 type. A normal value (>= 2^-6) keeps 3 of
    its 23 mantissa bits, the carry of the rounding moving into the exponent, rebiased from 127 to 7; a smaller one
    is the integer nearest `|x| * 2^9` (the subnormal codes, 8 being the smallest normal), from its significand."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
    shift = tl.minimum(141 - (magnitude >> 23), 31)  # 23 - (exponent - 118): |x| * 2^9 = significand >> shift
    significand = (magnitude & 0x7FFFFF) | 0x800000
    kept = significand >> shift
    rest = significand - (kept << shift)
    half = 1 << (shift - 1)
    subnormal = kept + ((rest > half) | ((rest == half) & ((kept & 1) == 1))).to(tl.int32)
    code = tl.where(magnitude >= 0x3C800000, normal, subnormal)  # 0x3C800000: 2^-6
    return (code | sign).to(tl.uint8)


@triton.jit
def _rotated_columns(first, second, rest, first_channels, first_mask, rest_channels, rest_mask, columns,
                     HALF: tl.constexpr, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr, FP32: tl.constexpr,
                     PRECISION: tl.constexpr):
    """Columns `columns` of the rotated keys `(k H) / sqrt(d)`, float32 `[BLOCK_T, len(columns)]`: one product per
    channel tile with the matching rows of `H`."""
    operand = tl.float32 if FP32 else DTYPE  # 16-bit keys and +-1 are exact operands of a tensor-core product
    rotated = tl.dot(first.to(operand), _hadamard_rows(first_channels, first_mask, columns).to(operand),
                     input_precision=PRECISION)
    rotated = tl.dot(second.to(operand), _hadamard_rows(HALF + first_channels, first_mask, columns).to(operand),
                     acc=rotated, input_precision=PRECISION)
    rotated = tl.dot(rest.to(operand), _hadamard_rows(rest_channels, rest_mask, columns).to(operand), acc=rotated,
                     input_precision=PRECISION)
    return rotated * HEAD_DIM**-0.5


@triton.jit
def _store_packed(destination, keep, first, second, rest, first_channels, first_mask, rest_channels, rest_mask,
                  HALF: tl.constexpr, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr, FP32: tl.constexpr,
                  PRECISION: tl.constexpr, ROTATION_CHUNK: tl.constexpr):
    """Pack the keys (three channel tiles, float32 holding dtype values) as `quantize_pooled_keys` does and store the
    `HEAD_DIM` fp8 bytes and the float32 scale at `destination` `[BLOCK_T]` where `keep`.

    The rotated key goes `ROTATION_CHUNK` columns at a time, twice (the maximum, then the bytes): the rows of `H` of
    a whole key at once would hold d^2 / threads values per thread (spills at d = 128); `tiles_of` chooses it."""
    CHUNK: tl.constexpr = ROTATION_CHUNK if HEAD_DIM > ROTATION_CHUNK else HEAD_DIM
    chunk_columns = tl.arange(0, CHUNK)
    largest = tl.zeros(keep.shape, tl.float32)
    for start in tl.static_range(0, HEAD_DIM, CHUNK):
        rotated = _rotated_columns(first, second, rest, first_channels, first_mask, rest_channels, rest_mask,
                                   start + chunk_columns, HALF, HEAD_DIM, DTYPE, FP32, PRECISION)
        largest = tl.maximum(largest, tl.max(tl.abs(rotated), axis=1))
    # Scale 2^ceil(log2(max|x| / 448)): frexp of q = max / 448 is (m, e) with m in [0.5, 1); the scale is 2^e, or
    # 2^(e - 1) when m = 0.5 (q a power of two). As float32 bits: exponent field of q + 1, less one for m = 0.5.
    quotient = tl.math.div_rn(largest, tl.full(largest.shape, 448.0, tl.float32)).to(tl.int32, bitcast=True)
    field = ((quotient >> 23) & 0xFF) + 1 - ((quotient & 0x7FFFFF) == 0).to(tl.int32)
    scale = tl.where(largest > 0, (field << 23).to(tl.float32, bitcast=True), 1.0)
    inverse = tl.where(largest > 0, ((254 - field) << 23).to(tl.float32, bitcast=True), 1.0)  # exact: powers of 2
    for start in tl.static_range(0, HEAD_DIM, CHUNK):
        rotated = _rotated_columns(first, second, rest, first_channels, first_mask, rest_channels, rest_mask,
                                   start + chunk_columns, HALF, HEAD_DIM, DTYPE, FP32, PRECISION)
        codes = _float32_to_fp8_e4m3(rotated * inverse[:, None])
        tl.store(destination[:, None] + start + chunk_columns[None, :], codes, mask=keep[:, None])
    tl.store((destination + HEAD_DIM).to(tl.pointer_type(tl.float32), bitcast=True), scale, mask=keep)


@triton.jit(do_not_specialize=["num_tokens"])
def _pooled_key_write_kernel(
    cache_ptr, step_ptr, ring_ptr, window_token_ptr, ring_block_ptr, window_start_ptr, cos_sin_ptr, norm_weight_ptr,
    bias_ptr, write_token_ptr, write_block_ptr, write_row_ptr, write_keep_ptr,
    num_tokens, eps,
    stride_cache_block, stride_cache_row, stride_step, stride_ring_block, stride_ring_row, stride_window,
    stride_cos, stride_bias,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, REST: tl.constexpr, REST_PAD: tl.constexpr,
    POOL: tl.constexpr, GATES: tl.constexpr, PRENORM: tl.constexpr, PACKED_FP8: tl.constexpr,
    BLOCK_T: tl.constexpr, ROTATION_CHUNK: tl.constexpr, FP32: tl.constexpr, PRECISION: tl.constexpr,
):
    """Pooled keys of `BLOCK_T` tokens' windows (those of `write_token`) into the cache rows `(write_block,
    write_row)` where `write_keep`. Channel tiles: `first` = `[0, HALF)`, `second` = `[HALF, 2 HALF)` (the rotary
    halves), `rest` = `[2 HALF, HEAD_DIM)`. `GATES`: 0 (mean), 1 (a gate logit per token), > 1 (per channel);
    `PRENORM`: the mean of the normed keys."""
    DTYPE: tl.constexpr = step_ptr.dtype.element_ty
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    source = tl.load(write_token_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
    window_rows = window_token_ptr + source * stride_window  # [BLOCK_T] pointers to each window's r step tokens
    ring_base = ring_ptr + tl.load(ring_block_ptr + source, mask=token_mask, other=0).to(tl.int64) * stride_ring_block
    start = tl.load(window_start_ptr + source, mask=token_mask, other=0).to(tl.int64)

    first_channels = tl.arange(0, HALF_PAD)
    first_mask = first_channels < HALF
    rest_channels = 2 * HALF + tl.arange(0, REST_PAD)
    rest_mask = rest_channels < HEAD_DIM
    first_weight = tl.load(norm_weight_ptr + first_channels, mask=first_mask, other=0.0).to(tl.float32) + 1
    second_weight = tl.load(norm_weight_ptr + HALF + first_channels, mask=first_mask, other=0.0).to(tl.float32) + 1
    rest_weight = tl.load(norm_weight_ptr + rest_channels, mask=rest_mask, other=0.0).to(tl.float32) + 1

    if PRENORM:  # each raw key normed (in the dtype), then the mean of the normed keys
        first = tl.zeros((BLOCK_T, HALF_PAD), tl.float32)
        second = tl.zeros((BLOCK_T, HALF_PAD), tl.float32)
        rest = tl.zeros((BLOCK_T, REST_PAD), tl.float32)
        for slot in range(POOL):
            step_token = tl.load(window_rows + slot, mask=token_mask, other=0)
            ring_row = ring_base + slot * stride_ring_row
            key_first = _window_row(step_ptr, stride_step, step_token, ring_row, first_channels, first_mask,
                                    token_mask, DTYPE)
            key_second = _window_row(step_ptr, stride_step, step_token, ring_row, HALF + first_channels, first_mask,
                                     token_mask, DTYPE)
            key_rest = _window_row(step_ptr, stride_step, step_token, ring_row, rest_channels, rest_mask, token_mask,
                                   DTYPE)
            inverse = _inverse_rms(tl.sum(key_first * key_first, 1) + tl.sum(key_second * key_second, 1)
                                   + tl.sum(key_rest * key_rest, 1), eps, HEAD_DIM)[:, None]
            first += _round(key_first * inverse * first_weight[None, :], DTYPE)
            second += _round(key_second * inverse * second_weight[None, :], DTYPE)
            rest += _round(key_rest * inverse * rest_weight[None, :], DTYPE)
        first = _round(tl.math.div_rn(first, tl.full((BLOCK_T, HALF_PAD), POOL, tl.float32)), DTYPE)
        second = _round(tl.math.div_rn(second, tl.full((BLOCK_T, HALF_PAD), POOL, tl.float32)), DTYPE)
        rest = _round(tl.math.div_rn(rest, tl.full((BLOCK_T, REST_PAD), POOL, tl.float32)), DTYPE)
    else:  # pooled, then normed
        token_largest = tl.zeros((BLOCK_T,), tl.float32)
        token_total = tl.zeros((BLOCK_T,), tl.float32)
        if GATES == 1:
            token_largest, token_total = _token_softmax(step_ptr, stride_step, window_rows, ring_base,
                                                        stride_ring_row, bias_ptr, stride_bias, token_mask, HEAD_DIM,
                                                        POOL, BLOCK_T, DTYPE)
        first = _pool_channels(step_ptr, stride_step, window_rows, ring_base, stride_ring_row, bias_ptr, stride_bias,
                               first_channels, first_mask, token_mask, token_largest, token_total, HEAD_DIM, POOL,
                               GATES, BLOCK_T, HALF_PAD, DTYPE)
        second = _pool_channels(step_ptr, stride_step, window_rows, ring_base, stride_ring_row, bias_ptr,
                                stride_bias, HALF + first_channels, first_mask, token_mask, token_largest, token_total,
                                HEAD_DIM, POOL, GATES, BLOCK_T, HALF_PAD, DTYPE)
        rest = _pool_channels(step_ptr, stride_step, window_rows, ring_base, stride_ring_row, bias_ptr, stride_bias,
                              rest_channels, rest_mask, token_mask, token_largest, token_total, HEAD_DIM, POOL, GATES,
                              BLOCK_T, REST_PAD, DTYPE)
        inverse = _inverse_rms(tl.sum(first * first, 1) + tl.sum(second * second, 1) + tl.sum(rest * rest, 1), eps,
                               HEAD_DIM)[:, None]
        first = _round(first * inverse * first_weight[None, :], DTYPE)
        second = _round(second * inverse * second_weight[None, :], DTYPE)
        rest = _round(rest * inverse * rest_weight[None, :], DTYPE)

    # RoPE at the window's first position, each product and sum rounded to the dtype as PyTorch's operators do.
    cos_sin = cos_sin_ptr + start[:, None] * stride_cos + first_channels[None, :]
    rope_mask = token_mask[:, None] & first_mask[None, :]
    cos = _round(tl.load(cos_sin, mask=rope_mask, other=0.0).to(tl.float32), DTYPE)
    sin = _round(tl.load(cos_sin + HALF, mask=rope_mask, other=0.0).to(tl.float32), DTYPE)
    first, second = (_round(_round(first * cos, DTYPE) - _round(second * sin, DTYPE), DTYPE),
                     _round(_round(second * cos, DTYPE) + _round(first * sin, DTYPE), DTYPE))

    block = tl.load(write_block_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
    row = tl.load(write_row_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
    keep = token_mask & (tl.load(write_keep_ptr + tokens, mask=token_mask, other=0) != 0)
    destination = cache_ptr + block * stride_cache_block + row * stride_cache_row  # [BLOCK_T]
    if PACKED_FP8:
        _store_packed(destination, keep, first, second, rest, first_channels, first_mask, rest_channels, rest_mask,
                      HALF, HEAD_DIM, DTYPE, FP32, PRECISION, ROTATION_CHUNK)
    else:
        CACHE: tl.constexpr = cache_ptr.dtype.element_ty
        tl.store(destination[:, None] + first_channels[None, :], first.to(CACHE),
                 mask=keep[:, None] & first_mask[None, :])
        tl.store(destination[:, None] + HALF + first_channels[None, :], second.to(CACHE),
                 mask=keep[:, None] & first_mask[None, :])
        tl.store(destination[:, None] + rest_channels[None, :], rest.to(CACHE), mask=keep[:, None] & rest_mask[None, :])


def _contiguous(tensor):
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def tiles_of(step_dtype: torch.dtype, packed: bool, head_dim: int) -> tuple[int, int]:
    """(tokens per program, rotation columns at once) of a write of `step_dtype` rows of `head_dim` channels: fewer
    of both when float32 keys are packed as fp8, whose Hadamard products on CUDA cores would spill
    (`FP32_PACKED_BLOCK_TOKENS`)."""
    if packed and step_dtype == torch.float32:
        return FP32_PACKED_BLOCK_TOKENS, 8 if head_dim <= 64 else 16
    return BLOCK_TOKENS, ROTATION_CHUNK


def plan_write(pooled_key_cache, step_rows, ring_cache, window_token, window_ring_block, window_start, cos_sin_cache,
               norm_weight, norm_eps, slot_bias, weighting, write_token, write_block, write_row, write_keep) -> Launch:
    """The write kernel's launch (arguments as `write_pooled_keys_torch`; rows and index vectors with a unit last
    stride): a program per `tiles_of`'s tokens."""
    num_tokens = write_token.shape[0]
    head_dim, pool_size = norm_weight.shape[0], window_token.shape[1]
    packed = is_packed(pooled_key_cache)
    block_tokens, rotation_chunk = tiles_of(step_rows.dtype, packed, head_dim)
    half = cos_sin_cache.shape[-1] // 2
    gate_width = step_rows.shape[-1] - head_dim
    fp32, precision = dot_precision(step_rows.dtype)
    bias = slot_bias if slot_bias is not None else norm_weight  # unread placeholder without gates
    return Launch(
        _pooled_key_write_kernel, (triton.cdiv(num_tokens, block_tokens),),
        (pooled_key_cache, step_rows, ring_cache, window_token, window_ring_block, window_start, cos_sin_cache,
         norm_weight, bias, write_token, write_block, write_row, write_keep,
         num_tokens, float(norm_eps),
         *pooled_key_cache.stride()[:2], step_rows.stride(0), *ring_cache.stride()[:2], window_token.stride(0),
         cos_sin_cache.stride(0), bias.stride(0) if slot_bias is not None else 0),
        dict(HEAD_DIM=head_dim, HALF=half, HALF_PAD=max(16, triton.next_power_of_2(half)), REST=head_dim - 2 * half,
             REST_PAD=max(16, triton.next_power_of_2(head_dim - 2 * half)), POOL=pool_size,
             GATES=gate_width, PRENORM=weighting == "prenorm_mean", PACKED_FP8=packed, BLOCK_T=block_tokens,
             ROTATION_CHUNK=rotation_chunk, FP32=fp32, PRECISION=precision, num_warps=8, num_stages=1),
    )


def write_pooled_keys_triton(pooled_key_cache, step_rows, ring_cache, window_token, window_ring_block, window_start,
                             cos_sin_cache, norm_weight, norm_eps, slot_bias, weighting, write_token, write_block,
                             write_row, write_keep) -> None:
    """Triton version of `write_pooled_keys_torch` (same arguments, same cache contents; see the module docstring
    for the rounding). One launch, no host reads."""
    check_write_arguments(pooled_key_cache, step_rows, ring_cache, window_token, cos_sin_cache, norm_weight,
                          slot_bias, weighting)
    if weighting not in WEIGHTINGS:
        raise ValueError(f"Unknown pooling weighting {weighting!r}.")
    if is_packed(pooled_key_cache) and norm_weight.shape[0] & (norm_weight.shape[0] - 1):
        raise ValueError(f"Packed fp8 keys need a power-of-two head dimension, got {norm_weight.shape[0]}.")
    if pooled_key_cache.stride(-1) != 1 or ring_cache.stride(-1) != 1:
        raise ValueError("The caches' rows must be contiguous.")
    if write_token.shape[0] == 0:
        return
    plan_write(pooled_key_cache, _contiguous(step_rows), ring_cache, _contiguous(window_token),
               _contiguous(window_ring_block), _contiguous(window_start), _contiguous(cos_sin_cache),
               _contiguous(norm_weight), norm_eps, None if slot_bias is None else _contiguous(slot_bias), weighting,
               _contiguous(write_token), _contiguous(write_block), _contiguous(write_row),
               _contiguous(write_keep)).run()


def aot_launches(sizes) -> list[tuple[str, Launch]]:
    """The write kernel's launch at `sizes` (an `aot.ModelSizes`), on meta tensors: a decode step's tokens (the
    compilation does not depend on the token count, so prefill plans nothing more)."""
    if sizes.kernels == "attention" or sizes.mode != "decode":
        return []
    meta = dict(device="meta", dtype=sizes.dtype)
    index = dict(dtype=torch.int64, device="meta")
    head_dim, pool_size, num_tokens = sizes.index_head_dim, sizes.pool_size, sizes.batch
    gate_width = gate_width_of(sizes.pool_weighting, head_dim)
    windows_per_block = 64 // pool_size
    num_blocks = num_tokens * (sizes.context // 64) + 1
    if sizes.index_keys == "fp8":
        cache = torch.empty(num_blocks, windows_per_block, 1, head_dim + 4, dtype=torch.uint8, device="meta")
    else:
        cache = torch.empty(num_blocks, windows_per_block, 1, head_dim, **meta)
    step_rows = torch.empty(num_tokens, head_dim + gate_width, **meta)
    ring = torch.empty(num_tokens + 1, pool_size, 1, head_dim + gate_width, **meta)
    cos_sin = torch.empty(sizes.context, sizes.rotary_dim, **meta)
    norm_weight = torch.empty(head_dim, **meta)
    slot_bias = torch.empty(pool_size, gate_width, **meta) if gate_width else None
    token = torch.empty(num_tokens, **index)
    keep = torch.empty(num_tokens, dtype=torch.bool, device="meta")
    return [("pooled_key_write",
             plan_write(cache, step_rows, ring, torch.empty(num_tokens, pool_size, **index), token, token, cos_sin,
                        norm_weight, 1e-6, slot_bias, sizes.pool_weighting, token, token, token, keep))]
