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
   whole chunk's lines at once measured slower): the rows lie in other pages, where no hardware prefetcher looks. */
#define PREFETCH_ROWS 16

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
        __builtin_prefetch(key + byte);
        __builtin_prefetch(value + byte);
    }
}

/* `count` cache rows (element offsets `offsets`) as float32 rows: in place for float32 caches, widened into
   `widened` (`count` rows of `dim`) for bfloat16 ones. */
static inline void cache_rows(const void *cache, int cache_kind, const int64_t *offsets, int64_t count, int64_t dim,
                              float *widened, const float **out) {
    for (int64_t s = 0; s < count; ++s) {
        if (cache_kind == CACHE_FLOAT32) {
            out[s] = (const float *)cache + offsets[s];
            continue;
        }
        const uint16_t *row = (const uint16_t *)cache + offsets[s];
        float *target = widened + s * dim;
        int64_t d = 0;
        for (; d + 8 <= dim; d += 8) {
            lanes v = load_bf16_lanes(row + d);
            memcpy(target + d, &v, sizeof v);
        }
        for (; d < dim; ++d) target[d] = bf16_to_float(row[d]);
        out[s] = target;
    }
}

static inline float dot(const float *a, const float *b, int64_t dim) {
    lanes x = {0}, y = {0};
    int64_t d = 0;
    for (; d + 16 <= dim; d += 16) {
        x += load_lanes(a + d) * load_lanes(b + d);
        y += load_lanes(a + d + 8) * load_lanes(b + d + 8);
    }
    for (; d + 8 <= dim; d += 8) x += load_lanes(a + d) * load_lanes(b + d);
    x += y;
    float sum = ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
    for (; d < dim; ++d) sum += a[d] * b[d];
    return sum;
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
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        /* Per thread: the rows' places, one chunk's row offsets, row pointers, widened rows and scores of each head
           (rounded up to whole vectors), and the heads' sums. */
        int64_t *blocks = malloc((2 * max_rows + CHUNK_ROWS) * sizeof(int64_t));
        const float **chunk_rows = malloc(CHUNK_ROWS * sizeof(float *));
        float *scratch = malloc((CHUNK_ROWS * dim + (group + 3) * CHUNK_ROWS + group * dim) * sizeof(float));
        if (blocks == NULL || chunk_rows == NULL || scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        int64_t *rows = blocks + max_rows, *offsets = rows + max_rows;
        float *widened = scratch, *scores = widened + CHUNK_ROWS * dim, *sums = scores + (group + 3) * CHUNK_ROWS;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            if (failed) continue;
            int64_t token = item / kv_heads, head = item % kv_heads;
            const float *heads_query = query + (token * kv_heads + head) * group * dim;
            float *heads_out = out + (token * kv_heads + head) * group * dim;
            int64_t count = attended_rows(selected + token * topk, topk, positions[token], block_table, table_int64,
                                          token_request[token], table_stride, max_blocks, pool_size, block_size,
                                          blocks, rows);
            /* Online softmax over chunks of rows: each head's running maximum and sum of weights, and its weighted
               sum of values rescaled when the maximum grows. */
            float top[group], total[group];
            for (int64_t g = 0; g < group; ++g) top[g] = -INFINITY, total[g] = 0.0f;
            memset(sums, 0, group * dim * sizeof(float));
            for (int64_t s = 0; s < PREFETCH_ROWS && s < count; ++s)
                prefetch_row(key_cache, value_cache, cache_kind, key_strides, value_strides, head, dim, blocks[s],
                             rows[s]);
            for (int64_t first = 0; first < count; first += CHUNK_ROWS) {
                int64_t chunk = count - first < CHUNK_ROWS ? count - first : CHUNK_ROWS;
                /* Scores: each key row against the group's query heads, 4 at a time while it is in L1. */
                for (int64_t s = 0; s < chunk; ++s)
                    offsets[s] = blocks[first + s] * key_strides[0] + head * key_strides[1]
                                 + rows[first + s] * key_strides[2];
                cache_rows(key_cache, cache_kind, offsets, chunk, dim, widened, chunk_rows);
                for (int64_t s = 0; s < chunk; ++s) {
                    if (first + s + PREFETCH_ROWS < count)
                        prefetch_row(key_cache, value_cache, cache_kind, key_strides, value_strides, head, dim,
                                     blocks[first + s + PREFETCH_ROWS], rows[first + s + PREFETCH_ROWS]);
                    float products[4];
                    int64_t g = 0;
                    for (; g + 4 <= group; g += 4) {
                        products_4(heads_query + g * dim, chunk_rows[s], dim, products);
                        for (int j = 0; j < 4; ++j) scores[(g + j) * CHUNK_ROWS + s] = products[j] * scaling;
                    }
                    for (; g < group; ++g)
                        scores[g * CHUNK_ROWS + s] = dot(heads_query + g * dim, chunk_rows[s], dim) * scaling;
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
                /* Values: 8 lanes of 4 heads' sums stay in registers over the chunk's rows. */
                for (int64_t s = 0; s < chunk; ++s)
                    offsets[s] = blocks[first + s] * value_strides[0] + head * value_strides[1]
                                 + rows[first + s] * value_strides[2];
                cache_rows(value_cache, cache_kind, offsets, chunk, dim, widened, chunk_rows);
                int64_t d = 0;
                for (; d + 8 <= dim; d += 8) {
                    int64_t g = 0;
                    for (; g + 4 <= group; g += 4) {
                        float *sum = sums + g * dim + d;
                        const float *weight = scores + g * CHUNK_ROWS;
                        lanes a0 = load_lanes(sum), a1 = load_lanes(sum + dim), a2 = load_lanes(sum + 2 * dim),
                              a3 = load_lanes(sum + 3 * dim);
                        for (int64_t s = 0; s < chunk; ++s) {
                            lanes v = load_lanes(chunk_rows[s] + d);
                            a0 += weight[s] * v;
                            a1 += weight[CHUNK_ROWS + s] * v;
                            a2 += weight[2 * CHUNK_ROWS + s] * v;
                            a3 += weight[3 * CHUNK_ROWS + s] * v;
                        }
                        memcpy(sum, &a0, sizeof a0);
                        memcpy(sum + dim, &a1, sizeof a1);
                        memcpy(sum + 2 * dim, &a2, sizeof a2);
                        memcpy(sum + 3 * dim, &a3, sizeof a3);
                    }
                    for (; g < group; ++g) {
                        lanes a = load_lanes(sums + g * dim + d);
                        for (int64_t s = 0; s < chunk; ++s) a += scores[g * CHUNK_ROWS + s] * load_lanes(chunk_rows[s] + d);
                        memcpy(sums + g * dim + d, &a, sizeof a);
                    }
                }
                for (; d < dim; ++d)
                    for (int64_t g = 0; g < group; ++g)
                        for (int64_t s = 0; s < chunk; ++s) sums[g * dim + d] += scores[g * CHUNK_ROWS + s] * chunk_rows[s][d];
            }
            /* A token with nothing to attend to: zeros (its sums are zeros, and so is its total). */
            for (int64_t g = 0; g < group; ++g) {
                float inverse = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
                for (int64_t d = 0; d < dim; ++d) heads_out[g * dim + d] = sums[g * dim + d] * inverse;
            }
        }
        free(blocks);
        free(chunk_rows);
        free(scratch);
    }
    return failed;
}
