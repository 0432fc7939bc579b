/* What every CPU kernel of hybrid_indexpool includes: eight float32 lanes (GCC/Clang vector extension: AVX
   registers where the CPU has them) and their loads from float32, bfloat16 (the high half of the float32 bits) and
   float8_e4m3fn memory. */
#ifndef HYBRID_INDEXPOOL_CPU_PRELUDE_H
#define HYBRID_INDEXPOOL_CPU_PRELUDE_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float lanes __attribute__((vector_size(32)));
typedef uint16_t halves __attribute__((vector_size(16)));
typedef uint32_t words __attribute__((vector_size(32)));

static inline lanes load_lanes(const float *p) {
    lanes v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* bfloat16 -> float32: the 16 bits under float32's high half. With AVX2 one zero-extending load and a shift: GCC 12
   compiles the vector-extension conversion into two half-width widenings put back together (3 more instructions). */
#if defined(__AVX2__)
#include <immintrin.h>
static inline lanes load_bf16_lanes(const uint16_t *p) {
    __m256i word = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
    lanes v;
    memcpy(&v, &word, sizeof v);
    return v;
}
#else
static inline lanes load_bf16_lanes(const uint16_t *p) {
    halves half;
    memcpy(&half, p, sizeof half);
    words word = __builtin_convertvector(half, words) << 16;
    lanes v;
    memcpy(&v, &word, sizeof v);
    return v;
}
#endif

/* The lane sums of 4 vectors, in the first 4 lanes. Clang spells a two-vector shuffle `__builtin_shufflevector` with
   the lane indices as arguments, GCC before 12 only `__builtin_shuffle` with an index vector. */
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int32_t lane_ids __attribute__((vector_size(32)));
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (lane_ids){__VA_ARGS__})
#endif

static inline lanes lane_sums_4(lanes a0, lanes a1, lanes a2, lanes a3) {
    lanes u01 = SHUFFLE(a0, a1, 0, 8, 1, 9, 2, 10, 3, 11) + SHUFFLE(a0, a1, 4, 12, 5, 13, 6, 14, 7, 15);
    lanes u23 = SHUFFLE(a2, a3, 0, 8, 1, 9, 2, 10, 3, 11) + SHUFFLE(a2, a3, 4, 12, 5, 13, 6, 14, 7, 15);
    lanes v = SHUFFLE(u01, u23, 0, 1, 8, 9, 2, 3, 10, 11) + SHUFFLE(u01, u23, 4, 5, 12, 13, 6, 7, 14, 15);
    return v + SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
}

/* products[j] = query row j . key for 4 query rows (row stride dim): 8 independent accumulators (two per row, over
   alternate blocks of 8 lanes), every key vector loaded once for the 4 rows. One accumulator per row leaves the loop
   waiting on the add latency; two keys at a time measured slower (more query loads per product). */
static inline void products_4(const float *query, const float *key, int64_t dim, float *products) {
    lanes a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    const float *q0 = query, *q1 = query + dim, *q2 = query + 2 * dim, *q3 = query + 3 * dim;
    int64_t d = 0;
    for (; d + 16 <= dim; d += 16) {
        lanes x = load_lanes(key + d), y = load_lanes(key + d + 8);
        a0 += load_lanes(q0 + d) * x; b0 += load_lanes(q0 + d + 8) * y;
        a1 += load_lanes(q1 + d) * x; b1 += load_lanes(q1 + d + 8) * y;
        a2 += load_lanes(q2 + d) * x; b2 += load_lanes(q2 + d + 8) * y;
        a3 += load_lanes(q3 + d) * x; b3 += load_lanes(q3 + d + 8) * y;
    }
    for (; d + 8 <= dim; d += 8) {
        lanes x = load_lanes(key + d);
        a0 += load_lanes(q0 + d) * x;
        a1 += load_lanes(q1 + d) * x;
        a2 += load_lanes(q2 + d) * x;
        a3 += load_lanes(q3 + d) * x;
    }
    lanes sums = lane_sums_4(a0 + b0, a1 + b1, a2 + b2, a3 + b3);
    float p[4] = {sums[0], sums[1], sums[2], sums[3]};
    for (; d < dim; ++d)
        for (int j = 0; j < 4; ++j) p[j] += query[j * dim + d] * key[d];
    memcpy(products, p, sizeof p);
}

/* 16 bfloat16 values as two float32 vectors without a widened copy: the even-indexed elements into `even`, the
   odd-indexed ones into `odd` (one shift or one mask widens 8 of them). A product over the row then needs its other
   operand in the same order. */
static inline __attribute__((always_inline)) void load_bf16_pairs(const uint16_t *p, lanes *even, lanes *odd) {
    words pairs, low, high;
    memcpy(&pairs, p, sizeof pairs);
    low = pairs << 16;
    high = pairs & 0xFFFF0000u;
    memcpy(even, &low, sizeof low);
    memcpy(odd, &high, sizeof high);
}

/* A float32 row's elements of each whole chunk of 16 reordered in place as `load_bf16_pairs` widens bfloat16: even,
   then odd (the tail past the last whole chunk stays as it is). */
static inline void split_pairs(float *row, int64_t dim) {
    for (int64_t d = 0; d + 16 <= dim; d += 16) {
        float chunk[16];
        for (int i = 0; i < 8; ++i) chunk[i] = row[d + 2 * i], chunk[8 + i] = row[d + 2 * i + 1];
        memcpy(row + d, chunk, sizeof chunk);
    }
}

static inline float bf16_to_float(uint16_t half) {
    uint32_t bits = (uint32_t)half << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* float8_e4m3fn -> float32 by bits, with no float32 subnormal on the way (a CPU flushing denormals still gets exact
   values): a normal fp8 (exponent field e > 0) moves its exponent and 3 mantissa bits under float32's exponent bias
   (+120) by one integer add; a subnormal one is its mantissa times 2^-9. The NaN codes (0x7F, 0xFF) read as +-480:
   the quantisation never writes them. */
typedef uint8_t bytes8 __attribute__((vector_size(8)));
typedef int32_t signed_words __attribute__((vector_size(32)));

static inline lanes load_fp8_lanes(const uint8_t *p) {
    bytes8 byte;
    memcpy(&byte, p, sizeof byte);
    words word = __builtin_convertvector(byte, words), magnitude = word & 0x7F;
    /* Signed: GCC 12 converts an unsigned vector to float one element at a time (magnitude < 128 either way). */
    lanes small = __builtin_convertvector((signed_words)magnitude, lanes) * 0x1p-9f;
    words small_bits, normal = (magnitude + (120 << 3)) << 20;
    memcpy(&small_bits, &small, sizeof small_bits);
    words is_normal = (words)(magnitude >= 8);  /* all ones where the fp8 value is normal */
    words bits = (normal & is_normal) | (small_bits & ~is_normal) | ((word & 0x80) << 24);
    lanes v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* float8_e4m3fn -> float32 times 2^-8, by way of float16 where the CPU converts float16 vectors (x86 F16C): the fp8
   sign goes to float16's sign bit, its 4 exponent and 3 mantissa bits under float16's 5 and 10 (bias 15 instead of
   7), so the float16 is exactly the fp8 value times 2^-8, subnormals included (an fp8 subnormal lands on a float16
   subnormal, which the conversion widens exactly; the float32 result is normal). Four vector instructions per 8
   values: the caller multiplies by 2^8 later (folded into the key's scale). The intrinsic, because GCC 12 widens a
   _Float16 vector one element at a time. Without F16C: load_fp8_lanes times 2^-8. */
#if defined(__F16C__)
#include <immintrin.h>
typedef int16_t shorts8 __attribute__((vector_size(16)));
typedef int8_t signed_bytes8 __attribute__((vector_size(8)));

static inline lanes load_fp8_lanes_over_256(const uint8_t *p) {
    signed_bytes8 byte;
    memcpy(&byte, p, sizeof byte);
    /* Sign-extended, shifted by 7: bits 15 and 14 hold the sign, 13..7 the exponent and mantissa; clear bit 14. */
    shorts8 bits = (__builtin_convertvector(byte, shorts8) << 7) & (int16_t)0xBF80;
    __m128i half;
    memcpy(&half, &bits, sizeof half);
    __m256 wide = _mm256_cvtph_ps(half);
    lanes v;
    memcpy(&v, &wide, sizeof v);
    return v;
}
#else
static inline lanes load_fp8_lanes_over_256(const uint8_t *p) { return load_fp8_lanes(p) * 0x1p-8f; }
#endif

static inline float fp8_to_float(uint8_t byte) {
    uint32_t magnitude = byte & 0x7F, bits = ((magnitude + (120 << 3)) << 20) | ((uint32_t)(byte & 0x80) << 24);
    float value;
    if (magnitude >= 8) {
        memcpy(&value, &bits, sizeof value);
        return value;
    }
    value = (float)magnitude * 0x1p-9f;
    return byte & 0x80 ? -value : value;
}

#endif
