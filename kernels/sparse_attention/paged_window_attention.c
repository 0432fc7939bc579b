/* Sparse attention of a serving step's tokens over their selected windows in vLLM's pages, read in place (see
   cpu_impl.py): no gathered copy, no float32 copy of the keys and values, no score matrix beyond one (token, key/value
   head) pair's. */
#include <math.h>

#include "cpu_prelude.h"

/* Storage of the keys and values (one dtype for both). */
enum { CACHE_FLOAT32 = 0, CACHE_BFLOAT16 = 1 };

/* Rows scored before their values are summed: a few windows, whose scores stay in L1. */
#define CHUNK_ROWS 16

/* Rows ahead of the one being scored whose key and value lines are prefetched, one row at a time (a burst of a
   whole chunk's lines at once measured slower): the rows lie in other pages, where no hardware prefetcher looks. Into
   L2, not L1 (`prefetcht1`): prefetches into L1 wait for its few miss buffers, and the attention took 2.3-2.9 ms against
   3.2-3.7 ms at 32K tokens (16 requests, one thread, runs alternated). 16 to 64 rows ahead measured the same. */
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 32
#endif
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2
#endif

static inline int64_t element_bytes(int cache_kind) { return cache_kind == CACHE_FLOAT32 ? 4 : 2; }

/* Always inlined: GCC may otherwise find a helper of prefetches `const` and delete its calls. */
static inline __attribute__((always_inline)) void prefetch_row(const void *key_cache, const void *value_cache,
                                                              int cache_kind, const int64_t *key_strides,
                                                              const int64_t *value_strides, int64_t head,
                                                              int64_t dim, int64_t block, int64_t row) {
    int64_t size = element_bytes(cache_kind);
    const char *key = (const char *)key_cache
                      + size * (block * key_strides[0] + head * key_strides[1] + row * key_strides[2]);
    const char *value = (const char *)value_cache
                        + size * (block * value_strides[0] + head * value_strides[1] + row * value_strides[2]);
    for (int64_t byte = 0; byte < dim * size; byte += 64) {
        __builtin_prefetch(key + byte, 0, PREFETCH_LOCALITY);
        __builtin_prefetch(value + byte, 0, PREFETCH_LOCALITY);
    }
}

/* Rows are read in chunks of 16 elements, two vectors of 8 lanes (16 AVX-512 lanes measured 5-13% slower: Zen 4
   splits them in two), a head dimension's whole chunks, then its tail one element at a time. */
#define CHUNK 16

/* Elements d .. d + 15 of a cache row as two vectors of 8 float32 lanes, in the chunk order of its storage: float32
   rows as they are (d .. d + 7, then d + 8 .. d + 15); bfloat16 rows widened in registers, the even elements then the
   odd ones (each 32-bit word of the row holds an even element in its low half and the next odd one in its high half,
   so one shift or one mask widens 8 of them). The queries are laid out in that order (`to_chunk_order`) and the
   weighted sums of values come out in it (`from_chunk_order`): no widened copy of a row is ever written. */
static inline __attribute__((always_inline)) void row_chunk(const void *row, int cache_kind, int64_t d, lanes *first,
                                                            lanes *second) {
    if (cache_kind == CACHE_FLOAT32) {
        *first = load_lanes((const float *)row + d);
        *second = load_lanes((const float *)row + d + 8);
        return;
    }
    load_bf16_pairs((const uint16_t *)row + d, first, second);
}

static inline float row_element(const void *row, int cache_kind, int64_t d) {
    return cache_kind == CACHE_FLOAT32 ? ((const float *)row)[d] : bf16_to_float(((const uint16_t *)row)[d]);
}

/* A row of dim float32 elements from natural order into the chunk order of `row_chunk` (bfloat16: each whole chunk's
   even elements, then its odd ones; the tail as it is), and back times `factor`. */
static void to_chunk_order(const float *natural, float *ordered, int64_t dim, int cache_kind) {
    memcpy(ordered, natural, dim * sizeof(float));
    if (cache_kind != CACHE_FLOAT32) split_pairs(ordered, dim);
}

static void from_chunk_order(const float *ordered, float *natural, int64_t dim, int cache_kind, float factor) {
    for (int64_t d = 0; d < dim; ++d) natural[d] = ordered[d] * factor;
    if (cache_kind == CACHE_FLOAT32) return;
    for (int64_t d = 0; d + CHUNK <= dim; d += CHUNK)
        for (int i = 0; i < CHUNK / 2; ++i)
            natural[d + 2 * i] = ordered[d + i] * factor, natural[d + 2 * i + 1] = ordered[d + CHUNK / 2 + i] * factor;
}

/* products[j] = query row j . key row for 4 query rows (row stride dim, chunk order), the key row of storage
   `cache_kind` (a constant once inlined) widened in registers: each key vector is loaded once for the 4 rows. */
static inline __attribute__((always_inline)) void row_products_4(const float *query, const void *key, int cache_kind,
                                                                 int64_t dim, float *products) {
    lanes a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    const float *q0 = query, *q1 = query + dim, *q2 = query + 2 * dim, *q3 = query + 3 * dim;
    int64_t d = 0;
    for (; d + CHUNK <= dim; d += CHUNK) {
        lanes x, y;
        row_chunk(key, cache_kind, d, &x, &y);
        a0 += load_lanes(q0 + d) * x; b0 += load_lanes(q0 + d + 8) * y;
        a1 += load_lanes(q1 + d) * x; b1 += load_lanes(q1 + d + 8) * y;
        a2 += load_lanes(q2 + d) * x; b2 += load_lanes(q2 + d + 8) * y;
        a3 += load_lanes(q3 + d) * x; b3 += load_lanes(q3 + d + 8) * y;
    }
    lanes sums = lane_sums_4(a0 + b0, a1 + b1, a2 + b2, a3 + b3);
    float p[4] = {sums[0], sums[1], sums[2], sums[3]};
    for (; d < dim; ++d) {
        float k = row_element(key, cache_kind, d);
        for (int j = 0; j < 4; ++j) p[j] += query[j * dim + d] * k;
    }
    memcpy(products, p, sizeof p);
}

/* sums (4 rows of dim, chunk order) += the `count` value rows `values` weighted by each sum row's weights
   (`weights[j * CHUNK_ROWS + s]` for sum row j and value row s): a chunk of 16 elements of the 4 sum rows stays in
   registers over the value rows. */
static inline __attribute__((always_inline)) void add_weighted_values_4(float *sums, const float *weights,
                                                                        const void *const *values, int64_t count,
                                                                        int cache_kind, int64_t dim) {
    int64_t d = 0;
    for (; d + CHUNK <= dim; d += CHUNK) {
        float *s0 = sums + d, *s1 = s0 + dim, *s2 = s1 + dim, *s3 = s2 + dim;
        lanes a0 = load_lanes(s0), a1 = load_lanes(s1), a2 = load_lanes(s2), a3 = load_lanes(s3);
        lanes b0 = load_lanes(s0 + 8), b1 = load_lanes(s1 + 8), b2 = load_lanes(s2 + 8), b3 = load_lanes(s3 + 8);
        for (int64_t s = 0; s < count; ++s) {
            lanes x, y;
            row_chunk(values[s], cache_kind, d, &x, &y);
            float w0 = weights[s], w1 = weights[CHUNK_ROWS + s], w2 = weights[2 * CHUNK_ROWS + s],
                  w3 = weights[3 * CHUNK_ROWS + s];
            a0 += w0 * x; b0 += w0 * y;
            a1 += w1 * x; b1 += w1 * y;
            a2 += w2 * x; b2 += w2 * y;
            a3 += w3 * x; b3 += w3 * y;
        }
        memcpy(s0, &a0, sizeof a0); memcpy(s0 + 8, &b0, sizeof b0);
        memcpy(s1, &a1, sizeof a1); memcpy(s1 + 8, &b1, sizeof b1);
        memcpy(s2, &a2, sizeof a2); memcpy(s2 + 8, &b2, sizeof b2);
        memcpy(s3, &a3, sizeof a3); memcpy(s3 + 8, &b3, sizeof b3);
    }
    for (; d < dim; ++d)
        for (int64_t s = 0; s < count; ++s) {
            float v = row_element(values[s], cache_kind, d);
            for (int j = 0; j < 4; ++j) sums[j * dim + d] += weights[j * CHUNK_ROWS + s] * v;
        }
}

/* exp of 8 lanes <= 0 (scores less their maximum): 2^n times a degree-6 polynomial of the remainder in
   [-ln2/2, ln2/2] (relative error ~1e-7, as expf's), flushed to 0 below -87 (float32's smallest normal). */
static inline lanes exp_lanes(lanes x) {
    const lanes log2e = {1.44269504f, 1.44269504f, 1.44269504f, 1.44269504f, 1.44269504f, 1.44269504f, 1.44269504f,
                         1.44269504f};
    signed_words underflow = x < -87.0f;
    x = (lanes)((signed_words)x & ~underflow);  /* 0 there, so that the steps below stay finite */
    lanes t = x * log2e;
    signed_words n = __builtin_convertvector(t, signed_words);  /* toward zero: one more where that rounded up */
    n += (signed_words)(__builtin_convertvector(n, lanes) > t);
    lanes nf = __builtin_convertvector(n, lanes);
    lanes r = x - nf * 0.693145752f - nf * 1.42860677e-6f;  /* ln 2 in two parts: r exact */
    lanes p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    signed_words bits = (n + 127) << 23;
    lanes scale;
    memcpy(&scale, &bits, sizeof scale);
    p *= scale;
    return (lanes)((signed_words)p & ~underflow);
}

/* Where one token's key/value rows are: (block, row in block) of each position it attends to, its selected windows'
   rows in window order then its open window's rows up to itself. Returns their count. */
static int64_t attended_rows(const int64_t *windows, int64_t topk, int64_t position, const void *block_table,
                             int table_int64, int64_t table_row, int64_t table_stride, int64_t max_blocks,
                             int64_t pool_size,
                             int64_t block_size, int64_t *blocks, int64_t *rows) {
    int64_t windows_per_block = block_size / pool_size, count = 0;
    int64_t open_window = (position + 1) / pool_size, open_rows = (position + 1) % pool_size;
    for (int64_t j = 0; j <= topk; ++j) {
        int64_t window = j < topk ? windows[j] : open_window, length = j < topk ? pool_size : open_rows;
        if (window < 0 || length == 0) continue;
        int64_t column = window / windows_per_block;
        if (column > max_blocks - 1) column = max_blocks - 1;
        int64_t entry = table_row * table_stride + column;
        int64_t block = table_int64 ? ((const int64_t *)block_table)[entry] : ((const int32_t *)block_table)[entry];
        int64_t first = (window % windows_per_block) * pool_size;
        for (int64_t i = 0; i < length; ++i) {
            blocks[count] = block;
            rows[count++] = first + i;
        }
    }
    return count;
}

/* out [tokens, kv_heads * group, dim] float32: token t's `group` query heads of key/value head h attend to the rows of
   its selected windows (`selected [tokens, topk]` int64, -1 for none) and of its open window up to its position, in
   the pages of its request's row of `block_table` (`[requests, max_blocks]`, int32 or int64, rows `table_stride` apart). The caches
   are `[blocks, kv_heads, block_size, dim]` with element strides (block, head, row) each and contiguous rows;
   `query` `[tokens, kv_heads * group, dim]` contiguous float32. Rows past a token's position are never read, so
   unwritten (NaN) rows cannot reach the result; a token with nothing to attend to gets zeros. The threads share the
   (token, key/value head) pairs. Returns nonzero when its scratch memory cannot be allocated. */
int paged_window_attention(const float *query, const void *key_cache, const void *value_cache, int cache_kind,
                           const int64_t *key_strides, const int64_t *value_strides, const void *block_table,
                           int table_int64, int64_t table_stride, int64_t max_blocks, const int64_t *token_request,
                           const int64_t *selected, int64_t topk, const int64_t *positions, float *out,
                           int64_t tokens, int64_t kv_heads, int64_t group, int64_t dim, int64_t pool_size,
                           int64_t block_size, float scaling, int threads) {
    int64_t max_rows = (topk + 1) * pool_size, items = tokens * kv_heads;
    /* The group's query heads padded with zero rows to a multiple of 4 (the padding's results are never used). */
    int64_t padded = (group + 3) / 4 * 4, size = element_bytes(cache_kind);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* Per thread: the rows' places, one chunk of rows' key and value addresses, the group's queries and weighted
           sums of values (chunk order), and its scores of a chunk of rows. */
        int64_t *blocks = malloc(2 * max_rows * sizeof(int64_t));
        const void **chunk_rows = malloc(2 * CHUNK_ROWS * sizeof(void *));
        float *scratch = calloc(2 * padded * dim + padded * CHUNK_ROWS, sizeof(float));
        if (blocks == NULL || chunk_rows == NULL || scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        int64_t *rows = blocks + max_rows;
        const void **key_rows = chunk_rows, **value_rows = chunk_rows + CHUNK_ROWS;
        float *queries = scratch, *sums = queries + padded * dim, *scores = sums + padded * dim;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            if (failed) continue;
            int64_t token = item / kv_heads, head = item % kv_heads;
            const float *heads_query = query + (token * kv_heads + head) * group * dim;
            float *heads_out = out + (token * kv_heads + head) * group * dim;
            for (int64_t g = 0; g < group; ++g) to_chunk_order(heads_query + g * dim, queries + g * dim, dim, cache_kind);
            int64_t count = attended_rows(selected + token * topk, topk, positions[token], block_table, table_int64,
                                          token_request[token], table_stride, max_blocks, pool_size, block_size,
                                          blocks, rows);
            /* Online softmax over chunks of rows: each head's running maximum and sum of weights, and its weighted
               sum of values rescaled when the maximum grows. */
            float top[padded], total[padded];
            for (int64_t g = 0; g < padded; ++g) top[g] = -INFINITY, total[g] = 0.0f;
            memset(sums, 0, padded * dim * sizeof(float));
            for (int64_t s = 0; s < PREFETCH_ROWS && s < count; ++s)
                prefetch_row(key_cache, value_cache, cache_kind, key_strides, value_strides, head, dim, blocks[s],
                             rows[s]);
            for (int64_t first = 0; first < count; first += CHUNK_ROWS) {
                int64_t chunk = count - first < CHUNK_ROWS ? count - first : CHUNK_ROWS;
                for (int64_t s = 0; s < chunk; ++s) {
                    int64_t block = blocks[first + s], row = rows[first + s];
                    key_rows[s] = (const char *)key_cache
                                  + size * (block * key_strides[0] + head * key_strides[1] + row * key_strides[2]);
                    value_rows[s] = (const char *)value_cache
                                    + size * (block * value_strides[0] + head * value_strides[1]
                                              + row * value_strides[2]);
                }
                /* Scores: each key row against the group's query heads, 4 at a time, widened in registers. */
                for (int64_t s = 0; s < chunk; ++s) {
                    if (first + s + PREFETCH_ROWS < count)
                        prefetch_row(key_cache, value_cache, cache_kind, key_strides, value_strides, head, dim,
                                     blocks[first + s + PREFETCH_ROWS], rows[first + s + PREFETCH_ROWS]);
                    float products[4];
                    for (int64_t g = 0; g < padded; g += 4) {
                        if (cache_kind == CACHE_FLOAT32)
                            row_products_4(queries + g * dim, key_rows[s], CACHE_FLOAT32, dim, products);
                        else
                            row_products_4(queries + g * dim, key_rows[s], CACHE_BFLOAT16, dim, products);
                        for (int j = 0; j < 4; ++j) scores[(g + j) * CHUNK_ROWS + s] = products[j] * scaling;
                    }
                }
                /* Weights: exp of the scores less the running maximum, padded to whole vectors with -inf (weight 0). */
                for (int64_t g = 0; g < group; ++g) {
                    float *head_scores = scores + g * CHUNK_ROWS, chunk_top = top[g];
                    for (int64_t s = 0; s < chunk; ++s) chunk_top = head_scores[s] > chunk_top ? head_scores[s] : chunk_top;
                    for (int64_t s = chunk; s < CHUNK_ROWS; ++s) head_scores[s] = -INFINITY;
                    if (chunk_top > top[g]) {
                        float rescale = expf(top[g] - chunk_top);  /* 0 at the first chunk */
                        total[g] *= rescale;
                        for (int64_t d = 0; d < dim; ++d) sums[g * dim + d] *= rescale;
                        top[g] = chunk_top;
                    }
                    lanes head_total = {0};
                    for (int64_t s = 0; s < CHUNK_ROWS; s += 8) {
                        lanes weights = exp_lanes(load_lanes(head_scores + s) - top[g]);
                        memcpy(head_scores + s, &weights, sizeof weights);
                        head_total += weights;
                    }
                    total[g] += ((head_total[0] + head_total[4]) + (head_total[1] + head_total[5]))
                                + ((head_total[2] + head_total[6]) + (head_total[3] + head_total[7]));
                }
                /* Values: a chunk of 16 elements of 4 heads' sums stays in registers over the chunk's rows. */
                for (int64_t g = 0; g < padded; g += 4) {
                    if (cache_kind == CACHE_FLOAT32)
                        add_weighted_values_4(sums + g * dim, scores + g * CHUNK_ROWS, value_rows, chunk,
                                              CACHE_FLOAT32, dim);
                    else
                        add_weighted_values_4(sums + g * dim, scores + g * CHUNK_ROWS, value_rows, chunk,
                                              CACHE_BFLOAT16, dim);
                }
            }
            /* A token with nothing to attend to: zeros (its sums are zeros, and so is its total). */
            for (int64_t g = 0; g < group; ++g)
                from_chunk_order(sums + g * dim, heads_out + g * dim, dim, cache_kind,
                                 total[g] > 0.0f ? 1.0f / total[g] : 0.0f);
        }
        free(blocks);
        free(chunk_rows);
        free(scratch);
    }
    return failed;
}
