/* Sparse attention of a serving step's tokens over their selected windows in vLLM's pages, read in place (see
   cpu_impl.py): no gathered copy, no float32 copy of the keys and values, no score matrix beyond one (token, key/value
   head) pair's. */
#include <math.h>

#include "cpu_prelude.h"

/* Storage of the keys and values (one dtype for both). */
enum { CACHE_FLOAT32 = 0, CACHE_BFLOAT16 = 1 };

/* The cache row at `offset` (in elements) as float32: in place for float32 caches, widened into `widened` for
   bfloat16 ones. */
static inline const float *cache_row(const void *cache, int cache_kind, int64_t offset, int64_t dim, float *widened) {
    if (cache_kind == CACHE_FLOAT32) return (const float *)cache + offset;
    const uint16_t *row = (const uint16_t *)cache + offset;
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8) {
        lanes v = load_bf16_lanes(row + d);
        memcpy(widened + d, &v, sizeof v);
    }
    for (; d < dim; ++d) widened[d] = bf16_to_float(row[d]);
    return widened;
}

/* Two accumulators over alternate blocks of 8 lanes: one leaves the loop waiting on the add latency. */
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

/* acc += weight * row over `dim` elements. */
static inline void add_scaled(float *acc, float weight, const float *row, int64_t dim) {
    lanes w = {weight, weight, weight, weight, weight, weight, weight, weight};
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8) {
        lanes v = load_lanes(acc + d) + w * load_lanes(row + d);
        memcpy(acc + d, &v, sizeof v);
    }
    for (; d < dim; ++d) acc[d] += weight * row[d];
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
        /* Per thread: the rows' places, each head's scores, the heads' sums and one widened row. */
        int64_t *blocks = malloc(2 * max_rows * sizeof(int64_t));
        float *scratch = malloc((group * max_rows + group * dim + dim) * sizeof(float));
        if (blocks == NULL || scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        int64_t *rows = blocks + max_rows;
        float *scores = scratch, *sums = scratch + group * max_rows, *widened = sums + group * dim;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) {
            if (blocks == NULL || scratch == NULL) continue;
            int64_t token = item / kv_heads, head = item % kv_heads;
            const float *heads_query = query + (token * kv_heads + head) * group * dim;
            float *heads_out = out + (token * kv_heads + head) * group * dim;
            int64_t count = attended_rows(selected + token * topk, topk, positions[token], block_table, table_int64,
                                          token_request[token], table_stride, max_blocks, pool_size, block_size, blocks, rows);
            if (count == 0) {
                memset(heads_out, 0, group * dim * sizeof(float));
                continue;
            }
            for (int64_t s = 0; s < count; ++s) {
                int64_t offset = blocks[s] * key_strides[0] + head * key_strides[1] + rows[s] * key_strides[2];
                const float *key = cache_row(key_cache, cache_kind, offset, dim, widened);
                for (int64_t g = 0; g < group; ++g) scores[g * max_rows + s] = dot(heads_query + g * dim, key, dim);
            }
            /* Softmax of each head's scores: their maximum subtracted, the division by the sum after the values. */
            float totals[group];
            for (int64_t g = 0; g < group; ++g) {
                float *head_scores = scores + g * max_rows, top = -INFINITY, total = 0.0f;
                for (int64_t s = 0; s < count; ++s) {
                    head_scores[s] *= scaling;
                    top = head_scores[s] > top ? head_scores[s] : top;
                }
                for (int64_t s = 0; s < count; ++s) total += head_scores[s] = expf(head_scores[s] - top);
                totals[g] = total;
            }
            memset(sums, 0, group * dim * sizeof(float));
            for (int64_t s = 0; s < count; ++s) {
                int64_t offset = blocks[s] * value_strides[0] + head * value_strides[1] + rows[s] * value_strides[2];
                const float *value = cache_row(value_cache, cache_kind, offset, dim, widened);
                for (int64_t g = 0; g < group; ++g) add_scaled(sums + g * dim, scores[g * max_rows + s], value, dim);
            }
            for (int64_t g = 0; g < group; ++g)
                for (int64_t d = 0; d < dim; ++d) heads_out[g * dim + d] = sums[g * dim + d] / totals[g];
        }
        free(blocks);
        free(scratch);
    }
    return failed;
}
