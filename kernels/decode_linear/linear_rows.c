/* The decode step's linear layers: a matrix-vector product that streams the weight once (see cpu_impl.py). */
#include "cpu_prelude.h"
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
