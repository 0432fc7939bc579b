"""CPU kernel of the decode step's linear layers: a matrix-vector product that streams the weight once.

A decode step multiplies one token (or a few) by every weight matrix of the model: the step reads all the weights
and does two flops per weight, so it runs at the memory bandwidth at best. The BLAS behind `F.linear` runs this
batch-1 product well on one thread but barely faster on two (measured on a 2-core AVX2 EPYC: 11-15 GB/s with one or
two threads, where a sum over the same weights reads 17-21 GB/s with two). Here each thread takes a contiguous run of
output rows and reads 4 weight rows side by side against the input held in L1, in float32 or bfloat16 weights
(widened in registers), so two threads read 15-24 GB/s. It is compiled on first use with the system C compiler (see
`cpu_build`) and registered as a custom op, so compiled decode steps keep one graph.

The sum over the input dimension runs in another order than the BLAS's (vector lanes), so results can differ from
`F.linear` in the last bits. Without a C compiler (or with `HYBRID_INDEXPOOL_BACKEND=torch`) `F.linear` runs.
"""

import ctypes

import torch

from ..cpu_build import C_PRELUDE, CompiledLibrary
from ..dispatch import kernel_backend

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support: no DTensor can reach here
    DTensor = ()

# Input rows (tokens) up to which the streaming product beats the BLAS (beyond it the BLAS runs a real GEMM).
MAX_ROWS = 4

C_SOURCE = C_PRELUDE + r"""
/* 8 float32 weights from `offset` (float32 or bfloat16 storage; `weight_bf16` is a constant wherever this is
   inlined, so each storage gets its own loop). */
static inline __attribute__((always_inline)) lanes weight_lanes(const void *weight, int weight_bf16, int64_t offset) {
    return weight_bf16 ? load_bf16_lanes((const uint16_t *)weight + offset) : load_lanes((const float *)weight + offset);
}

static inline __attribute__((always_inline)) float weight_at(const void *weight, int weight_bf16, int64_t offset) {
    return weight_bf16 ? bf16_to_float(((const uint16_t *)weight)[offset]) : ((const float *)weight)[offset];
}

static inline float lane_sum(lanes v) {
    float s = 0.0f;
    for (int j = 0; j < 8; ++j) s += v[j];
    return s;
}

/* The products of 2 input rows (x0, x1) with 4 weight rows read side by side (4 streams the prefetchers follow; one
   row at a time measured slower, software prefetching slower still): 8 accumulators, each weight vector loaded once
   for both inputs. rows[j] are the weight rows' offsets; out0/out1 get 4 products each. */
static inline __attribute__((always_inline)) void block_products(
        const float *x0, const float *x1, const void *weight, int weight_bf16, const int64_t *rows,
        int64_t in_features, float *out0, float *out1) {
    lanes a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    int64_t i = 0;
    for (; i + 8 <= in_features; i += 8) {
        lanes u = load_lanes(x0 + i), v = load_lanes(x1 + i);
        lanes w0 = weight_lanes(weight, weight_bf16, rows[0] + i), w1 = weight_lanes(weight, weight_bf16, rows[1] + i);
        lanes w2 = weight_lanes(weight, weight_bf16, rows[2] + i), w3 = weight_lanes(weight, weight_bf16, rows[3] + i);
        a0 += w0 * u; a1 += w1 * u; a2 += w2 * u; a3 += w3 * u;
        b0 += w0 * v; b1 += w1 * v; b2 += w2 * v; b3 += w3 * v;
    }
    float p[4] = {lane_sum(a0), lane_sum(a1), lane_sum(a2), lane_sum(a3)};
    float q[4] = {lane_sum(b0), lane_sum(b1), lane_sum(b2), lane_sum(b3)};
    for (; i < in_features; ++i)
        for (int j = 0; j < 4; ++j) {
            float w = weight_at(weight, weight_bf16, rows[j] + i);
            p[j] += x0[i] * w;
            q[j] += x1[i] * w;
        }
    memcpy(out0, p, sizeof p);
    memcpy(out1, q, sizeof q);
}

/* block_products for one input row: two accumulators per weight row (alternate blocks of 8 lanes), so the adds do
   not wait on each other. */
static inline __attribute__((always_inline)) void block_products_1(
        const float *x, const void *weight, int weight_bf16, const int64_t *rows, int64_t in_features, float *out) {
    lanes a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    int64_t i = 0;
    for (; i + 16 <= in_features; i += 16) {
        lanes u = load_lanes(x + i), v = load_lanes(x + i + 8);
        a0 += weight_lanes(weight, weight_bf16, rows[0] + i) * u;
        a1 += weight_lanes(weight, weight_bf16, rows[1] + i) * u;
        a2 += weight_lanes(weight, weight_bf16, rows[2] + i) * u;
        a3 += weight_lanes(weight, weight_bf16, rows[3] + i) * u;
        b0 += weight_lanes(weight, weight_bf16, rows[0] + i + 8) * v;
        b1 += weight_lanes(weight, weight_bf16, rows[1] + i + 8) * v;
        b2 += weight_lanes(weight, weight_bf16, rows[2] + i + 8) * v;
        b3 += weight_lanes(weight, weight_bf16, rows[3] + i + 8) * v;
    }
    float p[4] = {lane_sum(a0 + b0), lane_sum(a1 + b1), lane_sum(a2 + b2), lane_sum(a3 + b3)};
    for (; i < in_features; ++i)
        for (int j = 0; j < 4; ++j) p[j] += x[i] * weight_at(weight, weight_bf16, rows[j] + i);
    memcpy(out, p, sizeof p);
}

static inline __attribute__((always_inline)) void linear_block(
        const float *input, const void *weight, int weight_bf16, int64_t row_stride, const float *bias, float *out,
        int64_t rows, int64_t in_features, int64_t out_features, int64_t first) {
    int count = out_features - first < 4 ? (int)(out_features - first) : 4;
    int64_t offsets[4];
    for (int j = 0; j < 4; ++j) offsets[j] = (first + (j < count ? j : 0)) * row_stride;  /* short block: repeat */
    if (rows == 1) {
        float p[4];
        block_products_1(input, weight, weight_bf16, offsets, in_features, p);
        for (int j = 0; j < count; ++j) out[first + j] = p[j] + (bias != NULL ? bias[first + j] : 0.0f);
        return;
    }
    for (int64_t r = 0; r < rows; r += 2) {
        const float *x0 = input + r * in_features, *x1 = r + 1 < rows ? x0 + in_features : x0;
        float p[4], q[4];
        block_products(x0, x1, weight, weight_bf16, offsets, in_features, p, q);
        for (int j = 0; j < count; ++j) {
            float shift = bias != NULL ? bias[first + j] : 0.0f;
            out[r * out_features + first + j] = p[j] + shift;
            if (r + 1 < rows) out[(r + 1) * out_features + first + j] = q[j] + shift;
        }
    }
}

/* out [rows, out_features] = input [rows, in_features] (contiguous float32) x weight^T (+ bias), weight
   [out_features, in_features] with row stride `row_stride`, float32 or bfloat16 (weight_bf16), bias float32 or
   NULL. The threads take contiguous runs of blocks of 4 output rows; the input rows go through a block in pairs
   while it is in cache. */
void linear_rows(const float *input, const void *weight, int weight_bf16, int64_t row_stride, const float *bias,
                 float *out, int64_t rows, int64_t in_features, int64_t out_features, int threads) {
    int64_t blocks = (out_features + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t block = 0; block < blocks; ++block) {
        if (weight_bf16)
            linear_block(input, weight, 1, row_stride, bias, out, rows, in_features, out_features, block * 4);
        else
            linear_block(input, weight, 0, row_stride, bias, out, rows, in_features, out_features, block * 4);
    }
}
"""


def _declare(library) -> None:
    library.linear_rows.restype = None
    library.linear_rows.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_int64] + [ctypes.c_void_p] * 2
                                    + [ctypes.c_int64] * 3 + [ctypes.c_int])


LIBRARY = CompiledLibrary("linear_rows", C_SOURCE, _declare)


def load_library():
    """The compiled kernel, or None when it cannot be built (the reason is then in `library_error()`)."""
    return LIBRARY.load()


def library_error() -> str | None:
    """Why the CPU kernel could not be built (None when it was, or was not tried yet)."""
    return LIBRARY.error


def decode_linear_applies(hidden_states: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the compiled CPU product serves this call: CPU, float32 or bfloat16 weight (rows contiguous) and input
    of the same dtype, at most `MAX_ROWS` input rows, no gradient to record, no autocast (whose dtype rules
    `F.linear` applies), plain tensors (a tensor-parallel DTensor shard is `F.linear`'s to handle), the PyTorch backend
    not forced, and the kernel built."""
    return (hidden_states.device.type == "cpu" and weight.device.type == "cpu" and kernel_backend() == "auto"
            and not isinstance(weight, DTensor) and not isinstance(hidden_states, DTensor)
            and not torch.is_autocast_enabled("cpu")
            and weight.dtype in (torch.float32, torch.bfloat16) and hidden_states.dtype == weight.dtype
            and weight.dim() == 2 and weight.stride(-1) == 1 and hidden_states.shape[-1] == weight.shape[1]
            and hidden_states.numel() <= MAX_ROWS * weight.shape[1]
            and not (torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad))
            and load_library() is not None)


def run_linear_rows(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`input @ weight.T + bias` in float32 by the compiled kernel: `input` `[rows, in_features]`, `weight`
    `[out_features, in_features]` float32 or bfloat16 with contiguous rows, `bias` `[out_features]` or None; returns
    `[rows, out_features]` float32."""
    rows, in_features = input.shape
    out_features = weight.shape[0]
    if weight.stride(-1) != 1 or weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("linear_rows needs a float32 or bfloat16 weight with contiguous rows.")
    if weight.shape[1] != in_features:
        raise ValueError(f"linear_rows: input has {in_features} features, the weight takes {weight.shape[1]}.")
    input = input.float().contiguous()
    bias = None if bias is None else bias.float().contiguous()
    out = torch.empty(rows, out_features, dtype=torch.float32)
    load_library().linear_rows(
        input.data_ptr(), weight.data_ptr(), int(weight.dtype == torch.bfloat16), weight.stride(0),
        None if bias is None else bias.data_ptr(), out.data_ptr(), rows, in_features, out_features,
        torch.get_num_threads())
    return out


@torch.library.custom_op("hybrid_indexpool::linear_rows", mutates_args=(), device_types="cpu")
def linear_rows(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`run_linear_rows` as a custom op, so that a compiled step keeps one graph."""
    return run_linear_rows(input, weight, bias)


@linear_rows.register_fake
def _(input, weight, bias):
    return input.new_empty(input.shape[0], weight.shape[0], dtype=torch.float32)


def decode_linear_cpu(hidden_states, weight, bias=None):
    """`decode_linear_torch` by the compiled streaming product; same arguments and result (dtype of the input)."""
    # Eager code calls the kernel directly: the custom op's dispatch costs tens of microseconds a call, which is
    # ~2 ms of a decode step's 34 products at Qwen3.8-Flash-Next's widths; compiled code needs the op.
    product = linear_rows if torch.compiler.is_compiling() else run_linear_rows
    out = product(hidden_states.reshape(-1, weight.shape[1]), weight, bias)
    return out.to(hidden_states.dtype).reshape(*hidden_states.shape[:-1], weight.shape[0])
