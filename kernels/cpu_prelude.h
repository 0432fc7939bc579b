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

static inline lanes load_bf16_lanes(const uint16_t *p) {
    halves half;
    memcpy(&half, p, sizeof half);
    words word = __builtin_convertvector(half, words) << 16;
    lanes v;
    memcpy(&v, &word, sizeof v);
    return v;
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
    lanes small = __builtin_convertvector(magnitude, lanes) * 0x1p-9f;
    words small_bits, normal = (magnitude + (120 << 3)) << 20;
    memcpy(&small_bits, &small, sizeof small_bits);
    words is_normal = (words)(magnitude >= 8);  /* all ones where the fp8 value is normal */
    words bits = (normal & is_normal) | (small_bits & ~is_normal) | ((word & 0x80) << 24);
    lanes v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

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
