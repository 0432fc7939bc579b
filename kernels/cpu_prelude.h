/* What every CPU kernel of hybrid_indexpool includes: eight float32 lanes (GCC/Clang vector extension: AVX
   registers where the CPU has them) and their loads from float32 and bfloat16 memory (the bfloat16 bits are the high
   half of the float32 bits). */
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

#endif
