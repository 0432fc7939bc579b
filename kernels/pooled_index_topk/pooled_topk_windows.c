/* Pooled index scores and top-k window selection of a few decode queries in one streaming pass over the pooled
   keys (see cpu_impl.py). Built with ID_BASE, INVISIBLE_HIGH, MAX_HEAD_DIM and MAX_ROWS defined by the Python side,
   which owns those limits. */
#include "cpu_prelude.h"

/* The int64 key of `selection_keys`: ordered float bits (negative floats reversed, -0.0 tied with 0.0) in the
   high word, ID_BASE - id in the low word. */
static inline int64_t selection_key(float score, int64_t window) {
    int32_t bits;
    memcpy(&bits, &score, sizeof bits);
    int32_t sign = bits >> 31;
    bits ^= sign & 0x7FFFFFFF;
    bits -= sign;
    return (int64_t)((uint64_t)(int64_t)bits << 32) | (ID_BASE - window);
}

/* Storage of the keys: float32, bfloat16, or packed fp8 (the row's dim float8_e4m3fn bytes, then its float32
   power-of-two scale). */
enum { KEYS_FLOAT32 = 0, KEYS_BFLOAT16 = 1, KEYS_PACKED_FP8 = 2 };

static inline int64_t element_bytes(int keys_kind) {
    return keys_kind == KEYS_FLOAT32 ? 4 : keys_kind == KEYS_BFLOAT16 ? 2 : 1;
}

/* The key row at `offset` (in elements of its storage) as float32 and the factor its dot products take: in place
   and 1 for float32 keys, widened into `widened` for the others. Packed fp8 rows widen to their fp8 values times 2^-8
   (`load_fp8_lanes_over_256`) and take their power-of-two scale times 2^8: a product by a power of two is exact, so
   scaling the dot product gives the bits of the dot product with the dequantised key, without a multiply per element.
*/
static inline const float *key_row(const void *keys, int keys_kind, int64_t offset, int64_t dim, float *widened,
                                   float *factor) {
    *factor = 1.0f;
    if (keys_kind == KEYS_FLOAT32) return (const float *)keys + offset;
    int64_t d = 0;
    if (keys_kind == KEYS_BFLOAT16) {
        const uint16_t *row = (const uint16_t *)keys + offset;
        for (; d + 8 <= dim; d += 8) {
            lanes widened_lanes = load_bf16_lanes(row + d);
            memcpy(widened + d, &widened_lanes, sizeof widened_lanes);
        }
        for (; d < dim; ++d) widened[d] = bf16_to_float(row[d]);
        return widened;
    }
    const uint8_t *row = (const uint8_t *)keys + offset;
    float scale;
    memcpy(&scale, row + dim, sizeof scale);
    *factor = scale * 0x1p8f;
    for (; d + 8 <= dim; d += 8) {
        lanes widened_lanes = load_fp8_lanes_over_256(row + d);
        memcpy(widened + d, &widened_lanes, sizeof widened_lanes);
    }
    for (; d < dim; ++d) widened[d] = fp8_to_float(row[d]) * 0x1p-8f;
    return widened;
}


/* 16 float32 lanes (one AVX-512 register, two AVX ones: `wide_lanes`), their loads from the three key storages. */
typedef uint16_t wide_halves __attribute__((vector_size(32)));
typedef uint32_t wide_words __attribute__((vector_size(64)));

/* The sum of a wide vector's two halves, in registers where the compiler can say so (GCC 12, Clang): through memory
   the halves of a 64-byte store do not forward to the loads, a stall per key. */
static inline lanes halves_sum(wide_lanes v) {
#if defined(__clang__) || __GNUC__ >= 12
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    lanes halves[2];
    memcpy(halves, &v, sizeof halves);
    return halves[0] + halves[1];
#endif
}

static inline __attribute__((always_inline)) wide_lanes load_wide_key(const void *row, int keys_kind, int64_t d) {
    wide_lanes v;
    if (keys_kind == KEYS_FLOAT32) {
        memcpy(&v, (const float *)row + d, sizeof v);
    } else if (keys_kind == KEYS_BFLOAT16) {
        wide_halves half;
        memcpy(&half, (const uint16_t *)row + d, sizeof half);
        wide_words word = __builtin_convertvector(half, wide_words) << 16;
        memcpy(&v, &word, sizeof v);
    } else {
        v = load_fp8_wide_over_256((const uint8_t *)row + d);
    }
    return v;
}

/* The row of storage at `offset` (in elements of the storage). */
static inline const void *stored_row(const void *keys, int keys_kind, int64_t offset) {
    return keys_kind == KEYS_FLOAT32 ? (const void *)((const float *)keys + offset)
           : keys_kind == KEYS_BFLOAT16 ? (const void *)((const uint16_t *)keys + offset)
                                        : (const void *)((const uint8_t *)keys + offset);
}

static inline float stored_element(const void *row, int keys_kind, int64_t d) {
    return keys_kind == KEYS_FLOAT32 ? ((const float *)row)[d]
           : keys_kind == KEYS_BFLOAT16 ? bf16_to_float(((const uint16_t *)row)[d])
                                        : fp8_to_float(((const uint8_t *)row)[d]) * 0x1p-8f;
}

/* products[k * 4 + j] = query row j . key row k for 4 query rows and `count` (1 or 2, a constant once inlined) key
   rows, read from their storage and widened in registers (no trip through a widened row in memory), 16 lanes at a
   time: for decode's one query of up to 4 heads, the whole score pass is this function. Two keys at once share each
   query load and give 8 independent accumulator chains; every key is summed in the same order either way, so its
   products do not depend on whether it was paired. Packed fp8 keys: products of the fp8 values times 2^-8, to be
   multiplied by `key_factor`. */
static inline __attribute__((always_inline)) void products_4_stored(const float *query, const void *keys,
                                                                    int keys_kind, const int64_t *offsets,
                                                                    int count, int64_t dim, float *products) {
    const void *rows[2] = {stored_row(keys, keys_kind, offsets[0]),
                           stored_row(keys, keys_kind, offsets[count - 1])};
    wide_lanes sums[2][4] = {{{0}}};
    int64_t d = 0;
    for (; d + 16 <= dim; d += 16) {
        wide_lanes x[2];
        for (int k = 0; k < count; ++k) x[k] = load_wide_key(rows[k], keys_kind, d);
        for (int j = 0; j < 4; ++j) {
            wide_lanes q;
            memcpy(&q, query + j * dim + d, sizeof q);
            for (int k = 0; k < count; ++k) sums[k][j] += q * x[k];
        }
    }
    for (int k = 0; k < count; ++k) {
        lanes total = lane_sums_4(halves_sum(sums[k][0]), halves_sum(sums[k][1]), halves_sum(sums[k][2]),
                                  halves_sum(sums[k][3]));
        float p[4] = {total[0], total[1], total[2], total[3]};
        for (int64_t e = d; e < dim; ++e) {  /* the last dim % 16 elements, one by one */
            float element = stored_element(rows[k], keys_kind, e);
            for (int j = 0; j < 4; ++j) p[j] += query[j * dim + e] * element;
        }
        memcpy(products + 4 * k, p, sizeof p);
    }
}

/* The factor the dot products with the key row at `offset` take: its scale times 2^8 for packed fp8 (exact, a power
   of two: the products of the dequantised key), 1 otherwise. */
static inline float key_factor(const void *keys, int keys_kind, int64_t offset, int64_t dim) {
    if (keys_kind != KEYS_PACKED_FP8) return 1.0f;
    float scale;
    memcpy(&scale, (const uint8_t *)keys + offset + dim, sizeof scale);
    return scale * 0x1p8f;
}

/* Ask for the key row a fixed number of bytes ahead while this one is scored: the hardware prefetcher alone leaves the
   loads waiting (measured 7.5 against 10.5 GB/s on one AVX2 EPYC core at 8 float32 rows ahead). The distance is in
   bytes, not rows: what streams is the lines in flight, and at a fixed row count packed fp8 rows (132 B) keep half
   the lines of bfloat16 ones in flight and so read half the bytes per second, for no gain per key. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

static inline int64_t row_bytes(int keys_kind, int64_t dim) {
    return keys_kind == KEYS_PACKED_FP8 ? dim + 4 : dim * element_bytes(keys_kind);
}

/* always_inline: GCC 12 judges a function that only prefetches to be `const` and, where it is not inlined early,
   deletes its calls (the kernel then ran with no prefetch at all). */
static inline __attribute__((always_inline)) void prefetch_row(const void *keys, int keys_kind, int64_t offset,
                                                               int64_t dim) {
    int64_t bytes = row_bytes(keys_kind, dim);
    const char *row = (const char *)keys + offset * element_bytes(keys_kind);
    for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(row + byte);
    __builtin_prefetch(row + bytes - 1);  /* the last line of a row that does not start on a line */
}

/* Reorder a[0 .. n) so that a[0 .. k) holds its k largest entries (distinct keys; Hoare partition, quickselect). */
static void keep_largest(int64_t *a, int64_t n, int64_t k) {
    int64_t low = 0, high = n - 1;
    while (low < high) {
        int64_t x = a[low], y = a[low + (high - low) / 2], z = a[high];
        int64_t pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        int64_t i = low, j = high;
        while (i <= j) {
            while (a[i] > pivot) ++i;
            while (a[j] < pivot) --j;
            if (i <= j) {
                int64_t swap = a[i];
                a[i++] = a[j];
                a[j--] = swap;
            }
        }
        if (k - 1 <= j) high = j;
        else if (k - 1 >= i) low = i;
        else break;
    }
}

/* The `capacity` largest keys offered so far, in a buffer of 2 * capacity: keys at or below the threshold (the
   k-th largest at the last compaction) are dropped at once; a full buffer is cut back to its `capacity` largest.
   Each key costs one comparison, most of them rejected, instead of a heap's log(capacity) moves. */
typedef struct {
    int64_t *keys, size, capacity, threshold;
} running_topk;

static inline void offer(running_topk *best, int64_t key) {
    if (key <= best->threshold) return;
    best->keys[best->size++] = key;
    if (best->size == 2 * best->capacity) {
        keep_largest(best->keys, best->size, best->capacity);
        best->size = best->capacity;
        int64_t least = best->keys[0];
        for (int64_t i = 1; i < best->capacity; ++i) least = best->keys[i] < least ? best->keys[i] : least;
        best->threshold = least;
    }
}

static int ascending(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The window ids of the `topk` best of `count` selection keys (reordered in place), ascending, -1 for invisible
   windows (score -inf, or a range's INT64_MIN padding) and after the last: `window_ids_of` of the reference. */
static void window_ids(int64_t *candidates, int64_t count, int64_t topk, int64_t *ids) {
    int64_t kept = count < topk ? count : topk;
    if (count > kept) keep_largest(candidates, count, kept);
    for (int64_t i = 0; i < kept; ++i) {
        int64_t key = candidates[i];
        ids[i] = (key >> 32) <= INVISIBLE_HIGH ? ID_BASE : ID_BASE - (key & 0xFFFFFFFFLL);
    }
    qsort(ids, kept, sizeof(int64_t), ascending);
    for (int64_t i = 0; i < topk; ++i)
        if (i >= kept || ids[i] == ID_BASE) ids[i] = -1;
}

/* queries [batch, rows * heads, dim] and weights [batch, rows, heads] contiguous float32 (rows * heads <= MAX_ROWS);
   keys [batch, windows, dim] with the given strides (in elements of the storage), float32, bfloat16 or packed fp8
   (keys_kind; packed rows hold dim + 4 bytes); visible [batch, rows]
   contiguous int64. The windows are split into `segments` contiguous ranges, one thread each at a time; each range's
   `per_segment` best selection keys go to candidates [batch, rows, segments, per_segment] (INT64_MIN where a range
   has fewer windows), and the best `topk` of those to out [batch, rows, topk] as window ids. Returns 0, or 1 when a
   buffer could not be allocated. */
int pooled_topk_windows(const float *queries, const void *keys, int keys_kind, int64_t keys_batch_stride,
                        int64_t keys_row_stride, const float *weights, const int64_t *visible, int64_t *candidates,
                        int64_t *out, int64_t batch, int64_t rows, int64_t heads, int64_t dim, int64_t windows,
                        int64_t segments, int64_t per_segment, int64_t topk, int64_t sink_windows,
                        int64_t local_windows, int threads) {
    int64_t query_rows = rows * heads, groups = (query_rows + 3) / 4;
    int64_t ahead = PREFETCH_BYTES / row_bytes(keys_kind, dim);
    ahead = ahead < 1 ? 1 : ahead;
    int failed = 0;
    for (int64_t b = 0; b < batch; ++b) {
        /* The query rows padded with zero rows to whole groups of 4. */
        float padded[MAX_ROWS * MAX_HEAD_DIM];
        const float *batch_weights = weights + b * query_rows;
        const int64_t *batch_visible = visible + b * rows;
        memset(padded, 0, sizeof(float) * groups * 4 * dim);
        memcpy(padded, queries + b * query_rows * dim, sizeof(float) * query_rows * dim);
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t segment = 0; segment < segments; ++segment) {
            float widened[MAX_HEAD_DIM], products[MAX_ROWS];
            running_topk best[MAX_ROWS];
            int64_t *buffers = malloc(sizeof(int64_t) * 2 * per_segment * rows);
            if (buffers == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            for (int64_t r = 0; r < rows; ++r)
                best[r] = (running_topk){buffers + 2 * per_segment * r, 0, per_segment, INT64_MIN};
            int64_t first = windows * segment / segments, last = windows * (segment + 1) / segments;
            for (int64_t n = first; n < last;) {
                /* Decode's one query of up to 4 heads: two windows at a time, widened in registers (one code path
                   per storage); more rows: one window, widened once into `widened`, read once per group of 4. */
                int count = groups == 1 && n + 1 < last ? 2 : 1;
                int64_t offsets[2] = {b * keys_batch_stride + n * keys_row_stride,
                                      b * keys_batch_stride + (n + count - 1) * keys_row_stride};
                for (int k = 0; k < count; ++k)
                    if (n + k + ahead < last)
                        prefetch_row(keys, keys_kind, offsets[k] + ahead * keys_row_stride, dim);
                float factors[2];
                if (groups == 1) {
#define PRODUCTS(kind) (count == 2 ? products_4_stored(padded, keys, kind, offsets, 2, dim, products) \
                                   : products_4_stored(padded, keys, kind, offsets, 1, dim, products))
                    switch (keys_kind) {
                    case KEYS_FLOAT32: PRODUCTS(KEYS_FLOAT32); break;
                    case KEYS_BFLOAT16: PRODUCTS(KEYS_BFLOAT16); break;
                    default: PRODUCTS(KEYS_PACKED_FP8);
                    }
#undef PRODUCTS
                    for (int k = 0; k < count; ++k) factors[k] = key_factor(keys, keys_kind, offsets[k], dim);
                } else {
                    const float *key = key_row(keys, keys_kind, offsets[0], dim, widened, &factors[0]);
                    for (int64_t g = 0; g < groups; ++g) products_4(padded + g * 4 * dim, key, dim, products + g * 4);
                }
                for (int k = 0; k < count; ++k, ++n) {
                    const float *window_products = products + 4 * k;
                    for (int64_t r = 0; r < rows; ++r) {
                        float score = 0.0f;
                        for (int64_t h = 0; h < heads; ++h) {
                            float product = window_products[r * heads + h] * factors[k];
                            product = product < 0.0f ? 0.0f : product; /* ReLU that keeps NaN, as torch's */
                            float term = product * batch_weights[r * heads + h];
                            score = h == 0 ? term : score + term;
                        }
                        int64_t bound = batch_visible[r];
                        if (n < sink_windows || n >= bound - local_windows) score = __builtin_inff();
                        if (n >= bound) score = -__builtin_inff();
                        offer(&best[r], selection_key(score, n));
                    }
                }
            }
            for (int64_t r = 0; r < rows; ++r) {
                int64_t *target = candidates + ((b * rows + r) * segments + segment) * per_segment;
                int64_t kept = best[r].size < per_segment ? best[r].size : per_segment;
                if (best[r].size > per_segment) keep_largest(best[r].keys, best[r].size, per_segment);
                memcpy(target, best[r].keys, sizeof(int64_t) * kept);
                for (int64_t i = kept; i < per_segment; ++i) target[i] = INT64_MIN;
            }
            free(buffers);
        }
        if (!failed)
            for (int64_t r = 0; r < rows; ++r)
                window_ids(candidates + (b * rows + r) * segments * per_segment, segments * per_segment, topk,
                           out + (b * rows + r) * topk);
    }
    return failed;
}
