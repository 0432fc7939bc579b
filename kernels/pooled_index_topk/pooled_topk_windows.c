/* Pooled index scores and top-k window selection in one streaming pass over the pooled keys, read in place from
   contiguous rows or from vLLM's pages (see cpu_impl.py). Built with ID_BASE and INVISIBLE_HIGH defined by the Python
   side, which owns the selection keys' layout. */
#include "cpu_prelude.h"

/* The int64 key of `selection_keys`: ordered float bits (negative floats reversed, -0.0 tied with 0.0) in the
   high word, ID_BASE - id in the low word. */
static inline int32_t ordered_bits(float score) {
    int32_t bits;
    memcpy(&bits, &score, sizeof bits);
    int32_t sign = bits >> 31;
    bits ^= sign & 0x7FFFFFFF;
    return bits - sign;
}

static inline int64_t selection_key(float score, int64_t window) {
    return (int64_t)((uint64_t)(int64_t)ordered_bits(score) << 32) | (ID_BASE - window);
}

/* Storage of the keys: float32, bfloat16, or packed fp8 (the row's dim float8_e4m3fn bytes, then its float32
   power-of-two scale). */
enum { KEYS_FLOAT32 = 0, KEYS_BFLOAT16 = 1, KEYS_PACKED_FP8 = 2 };

static inline int64_t element_bytes(int keys_kind) {
    return keys_kind == KEYS_FLOAT32 ? 4 : keys_kind == KEYS_BFLOAT16 ? 2 : 1;
}

/* A key row as float32: in place for float32 keys, widened into `widened` for the others. Packed fp8 rows widen to
   their fp8 values times 2^-8 (`load_fp8_lanes_over_256`), and their dot products take their power-of-two scale times
   2^8 (`key_factor`): a product by a power of two is exact, so scaling the dot product gives the bits of the dot
   product with the dequantised key, without a multiply per element. */
static inline const float *key_row(const void *row, int keys_kind, int64_t dim, float *widened) {
    if (keys_kind == KEYS_FLOAT32) return (const float *)row;
    int64_t d = 0;
    if (keys_kind == KEYS_BFLOAT16) {
        for (; d + 8 <= dim; d += 8) {
            lanes widened_lanes = load_bf16_lanes((const uint16_t *)row + d);
            memcpy(widened + d, &widened_lanes, sizeof widened_lanes);
        }
        for (; d < dim; ++d) widened[d] = bf16_to_float(((const uint16_t *)row)[d]);
        return widened;
    }
    for (; d + 8 <= dim; d += 8) {
        lanes widened_lanes = load_fp8_lanes_over_256((const uint8_t *)row + d);
        memcpy(widened + d, &widened_lanes, sizeof widened_lanes);
    }
    for (; d < dim; ++d) widened[d] = fp8_to_float(((const uint8_t *)row)[d]) * 0x1p-8f;
    return widened;
}

/* The factor the dot products with a key row take: its scale times 2^8 for packed fp8 (exact, a power of two: the
   products of the dequantised key), 1 otherwise. */
static inline float key_factor(const void *row, int keys_kind, int64_t dim) {
    if (keys_kind != KEYS_PACKED_FP8) return 1.0f;
    float scale;
    memcpy(&scale, (const uint8_t *)row + dim, sizeof scale);
    return scale * 0x1p8f;
}

/* Elements d .. d + 15 of a stored key row as two vectors of float32 lanes. bfloat16: the even elements, then the odd
   ones (each 32-bit word of the row holds an even element in its low half and the next odd one in its high half, so
   one shift or one mask widens 8 of them); the queries of a bfloat16 product are stored in that order too
   (`split_pairs`). Packed fp8: the values times 2^-8 (see `key_row`). */
static inline __attribute__((always_inline)) void key_chunk(const void *row, int keys_kind, int64_t d, lanes *low,
                                                            lanes *high) {
    if (keys_kind == KEYS_FLOAT32) {
        *low = load_lanes((const float *)row + d);
        *high = load_lanes((const float *)row + d + 8);
    } else if (keys_kind == KEYS_BFLOAT16) {
        load_bf16_pairs((const uint16_t *)row + d, low, high);
    } else {
        *low = load_fp8_lanes_over_256((const uint8_t *)row + d);
        *high = load_fp8_lanes_over_256((const uint8_t *)row + d + 8);
    }
}

static inline float stored_element(const void *row, int keys_kind, int64_t d) {
    return keys_kind == KEYS_FLOAT32 ? ((const float *)row)[d]
           : keys_kind == KEYS_BFLOAT16 ? bf16_to_float(((const uint16_t *)row)[d])
                                        : fp8_to_float(((const uint8_t *)row)[d]) * 0x1p-8f;
}

/* Windows scored together: 4 query rows x KEY_BLOCK windows of accumulators of 8 lanes, the keys and a query row in
   vector registers (32 with AVX-512, 16 with AVX2). */
#if defined(__AVX512F__)
#define KEY_BLOCK 4
#else
#define KEY_BLOCK 2
#endif

/* A query's scores of a block of windows (KEY_BLOCK of the 4 lanes used), written and read as one vector: a vector
   read of scalar writes would wait for them to reach the cache. */
typedef float quad __attribute__((vector_size(16)));

/* The lane sums of 8 vectors: lane i holds the sum of a[i]'s lanes (21 shuffles and adds). */
static inline lanes lane_sums_8(const lanes *a) {
    lanes pairs[4], quads[2];
    for (int i = 0; i < 4; ++i)
        pairs[i] = SHUFFLE(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14)
                   + SHUFFLE(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; ++i)
        quads[i] = SHUFFLE(pairs[2 * i], pairs[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13)
                   + SHUFFLE(pairs[2 * i], pairs[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUFFLE(quads[0], quads[1], 0, 1, 2, 3, 8, 9, 10, 11)
           + SHUFFLE(quads[0], quads[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Products of 4 query rows (row stride dim; bfloat16 keys: chunks in `split_pairs` order) with KEY_BLOCK key rows
   `rows` of storage `keys_kind` (a constant once inlined), widened in registers: out[i] lane 4 * b + j holds query row
   j . key 2 * i + b. Each key vector is loaded once for the 4 query rows and each query vector once for the keys.
   Packed fp8 keys: products of the fp8 values times 2^-8, to be multiplied by the keys' factors. */
static inline __attribute__((always_inline)) void products_block(const float *query, const void *const *rows,
                                                                 int keys_kind, int64_t dim, lanes *out) {
    lanes sums[KEY_BLOCK][4];
    memset(sums, 0, sizeof sums);
    int64_t d = 0;
    for (; d + 16 <= dim; d += 16) {
        lanes low[KEY_BLOCK], high[KEY_BLOCK];
        for (int k = 0; k < KEY_BLOCK; ++k) key_chunk(rows[k], keys_kind, d, &low[k], &high[k]);
        for (int j = 0; j < 4; ++j) {
            lanes query_low = load_lanes(query + j * dim + d), query_high = load_lanes(query + j * dim + d + 8);
            for (int k = 0; k < KEY_BLOCK; ++k) {
                sums[k][j] += query_low * low[k];
                sums[k][j] += query_high * high[k];
            }
        }
    }
    for (int i = 0; i < KEY_BLOCK / 2; ++i) {
        out[i] = lane_sums_8(&sums[2 * i][0]);  /* keys 2i and 2i + 1: 8 consecutive accumulators */
        for (int64_t e = d; e < dim; ++e)  /* the last dim % 16 elements, one by one */
            for (int b = 0; b < 2; ++b)
                for (int j = 0; j < 4; ++j)
                    out[i][4 * b + j] += query[j * dim + e] * stored_element(rows[2 * i + b], keys_kind, e);
    }
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

/* Every cache line of a key row. always_inline: GCC 12 judges a function that only prefetches to be `const` and,
   where it is not inlined early, deletes its calls (the kernel then ran with no prefetch at all). */
static inline __attribute__((always_inline)) void prefetch_row(const char *row, int64_t bytes) {
    const char *line = (const char *)((uintptr_t)row & ~(uintptr_t)63);
    for (; line < row + bytes; line += 64) __builtin_prefetch(line);
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
    /* Without a branch on the key: written in the next free place, which it keeps only when above the threshold (a
       branch there is mispredicted for about a quarter of the keys of the blocks scored near the threshold). */
    best->keys[best->size] = key;
    best->size += key > best->threshold;
    if (best->size == 2 * best->capacity) {
        keep_largest(best->keys, best->size, best->capacity);
        best->size = best->capacity;
        int64_t least = best->keys[0];
        for (int64_t i = 1; i < best->capacity; ++i) least = best->keys[i] < least ? best->keys[i] : least;
        best->threshold = least;
    }
}

/* The window ids of the `topk` best of `count` selection keys (reordered in place), ascending, -1 for invisible
   windows (score -inf, or a range's INT64_MIN padding) and after the last: `window_ids_of` of the reference. Sorted
   by marking each id in `marks`, a bitmap of the `window_bound` ids (all clear, and left clear). */
static void window_ids(int64_t *candidates, int64_t count, int64_t topk, int64_t window_bound, uint64_t *marks,
                       int64_t *ids) {
    int64_t kept = count < topk ? count : topk, found = 0;
    if (count > kept) keep_largest(candidates, count, kept);
    for (int64_t i = 0; i < kept; ++i) {
        int64_t key = candidates[i], id = ID_BASE - (key & 0xFFFFFFFFLL);
        if ((key >> 32) > INVISIBLE_HIGH && id < window_bound) marks[id >> 6] |= (uint64_t)1 << (id & 63);
    }
    for (int64_t word = 0; word < (window_bound + 63) / 64; ++word) {
        for (uint64_t bits = marks[word]; bits != 0; bits &= bits - 1) ids[found++] = word * 64 + __builtin_ctzll(bits);
        marks[word] = 0;
    }
    for (int64_t i = found; i < topk; ++i) ids[i] = -1;
}

/* Where each request's pooled keys lie: window w of request q is row w % windows_per_block of block
   block_table[q, w / windows_per_block] (int32 or int64 entries, rows table_stride apart; columns past max_blocks - 1
   read the last, as the reference), rows row_stride and blocks block_stride elements of the storage apart. Without a
   table (contiguous keys [batch, windows, dim]) request q's windows are all in block q. */
typedef struct {
    const void *keys;
    int keys_kind;
    int64_t block_stride, row_stride, windows_per_block;
    const void *table;
    int table_int64;
    int64_t table_stride, max_blocks;
} paged_keys;

/* The address of a request's block `column`'s first row. */
static inline const char *block_address(const paged_keys *pages, int64_t request, int64_t column) {
    int64_t block = request;
    if (pages->table != NULL) {
        column = column < pages->max_blocks - 1 ? column : pages->max_blocks - 1;
        int64_t entry = request * pages->table_stride + column;
        block = pages->table_int64 ? ((const int64_t *)pages->table)[entry] : ((const int32_t *)pages->table)[entry];
    }
    return (const char *)pages->keys + block * pages->block_stride * element_bytes(pages->keys_kind);
}

/* A request's windows walked in order: the current one's block column, row in the block and address; the table is
   read once per block. */
typedef struct {
    int64_t column, row;
    const char *address;
} window_walk;

static inline window_walk walk_from(const paged_keys *pages, int64_t request, int64_t window) {
    int64_t column = window / pages->windows_per_block, row = window % pages->windows_per_block;
    return (window_walk){column, row, block_address(pages, request, column)
                                          + row * pages->row_stride * element_bytes(pages->keys_kind)};
}

static inline void step(const paged_keys *pages, int64_t request, window_walk *walk) {
    if (++walk->row < pages->windows_per_block) {
        walk->address += pages->row_stride * element_bytes(pages->keys_kind);
    } else {
        walk->row = 0;
        walk->address = block_address(pages, request, ++walk->column);
    }
}

/* One thread's scratch: the query rows of a tile (each distinct query's heads in turn) padded with zero rows to whole
   groups of 4, each row's query (among the distinct ones), head and weight, KEY_BLOCK widened key rows, each distinct
   query's scores of a block of windows, the tile's distinct tokens and each one's running top-k of `per_segment`
   keys, and the bitmap `window_ids` sorts with. */
typedef struct {
    float *queries, *row_weights, *widened;
    quad *scores;
    int64_t *row_queries, *row_heads, *rows, *buffers;
    running_topk *best;
    uint64_t *marks;
} thread_scratch;

static int allocate_scratch(thread_scratch *s, int64_t width, int64_t heads, int64_t dim, int64_t per_segment,
                            int64_t window_bound) {
    int64_t padded_rows = (width * heads + 3) / 4 * 4;
    s->scores = malloc(sizeof(quad) * width);
    s->queries = malloc(sizeof(float) * (padded_rows * dim + padded_rows + KEY_BLOCK * dim));
    s->row_weights = s->queries == NULL ? NULL : s->queries + padded_rows * dim;
    s->widened = s->queries == NULL ? NULL : s->row_weights + padded_rows;
    s->row_queries = malloc(sizeof(int64_t) * (2 * padded_rows + width + 2 * per_segment * width));
    s->row_heads = s->row_queries == NULL ? NULL : s->row_queries + padded_rows;
    s->rows = s->row_queries == NULL ? NULL : s->row_heads + padded_rows;
    s->buffers = s->row_queries == NULL ? NULL : s->rows + width;
    s->best = malloc(sizeof(running_topk) * width);
    s->marks = calloc((window_bound + 63) / 64 + 1, sizeof(uint64_t));
    return s->scores != NULL && s->queries != NULL && s->row_queries != NULL && s->best != NULL && s->marks != NULL;
}

static void free_scratch(thread_scratch *s) {
    free(s->scores);
    free(s->queries);
    free(s->row_queries);
    free(s->best);
    free(s->marks);
}

/* The token of row i of tile t: tile_tokens[t, i], or t * width + i without tile_tokens. */
static inline int64_t tile_token(const int64_t *tile_tokens, int64_t width, int64_t tile, int64_t i) {
    return tile_tokens == NULL ? tile * width + i : tile_tokens[tile * width + i];
}

/* Add one group of 4 query rows' terms `weight * relu(product * factor)` (`products` and `factors` laid out as
   `products_block`'s) to their queries' scores of the block of windows; a query's first head sets its scores. Where
   the group is 4 heads of one query (heads a multiple of 4) they are summed in the vector, pairwise. */
static inline void add_group_terms(const thread_scratch *s, int64_t group, int64_t query_rows, int64_t heads,
                                   const lanes *products, const lanes *factors) {
    lanes weights;
    for (int j = 0; j < 8; ++j) weights[j] = s->row_weights[group * 4 + j % 4];
    lanes terms[KEY_BLOCK / 2];
    for (int i = 0; i < KEY_BLOCK / 2; ++i) {
        lanes term = products[i] * factors[i];
        /* ReLU that keeps NaN, as torch's: only lanes below zero are cleared. */
        term = (lanes)((signed_words)term & ~(signed_words)(term < (lanes){0}));
        terms[i] = term * weights;
    }
    if (heads % 4 == 0) {
        /* The 4 heads of each window summed in the vector: lanes 0 and 4 of each term. */
        quad sums = {0};
        for (int i = 0; i < KEY_BLOCK / 2; ++i) {
            lanes term = terms[i] + SHUFFLE(terms[i], terms[i], 1, 0, 3, 2, 5, 4, 7, 6);
            term += SHUFFLE(term, term, 2, 3, 0, 1, 6, 7, 4, 5);
            sums[2 * i] = term[0];
            sums[2 * i + 1] = term[4];
        }
        quad *scores = &s->scores[s->row_queries[group * 4]];
        *scores = s->row_heads[group * 4] == 0 ? sums : *scores + sums;
        return;
    }
    for (int j = 0; j < 4 && group * 4 + j < query_rows; ++j) {
        quad *scores = &s->scores[s->row_queries[group * 4 + j]];
        int first = s->row_heads[group * 4 + j] == 0;
        for (int i = 0; i < KEY_BLOCK / 2; ++i) {
            (*scores)[2 * i] = first ? terms[i][j] : (*scores)[2 * i] + terms[i][j];
            (*scores)[2 * i + 1] = first ? terms[i][4 + j] : (*scores)[2 * i + 1] + terms[i][4 + j];
        }
    }
}

/* Score windows first .. last - 1 of `request` for the tile's `count` distinct queries (set up in `s`), a block of
   KEY_BLOCK windows at a time, and offer each query's selection keys to its running top-k. */
static void score_range(const thread_scratch *s, int64_t count, const paged_keys *pages, int64_t request,
                        int64_t first, int64_t last, const int64_t *visible, int64_t heads, int64_t dim,
                        int64_t sink_windows, int64_t local_windows) {
    int keys_kind = pages->keys_kind;
    int64_t query_rows = count * heads, groups = (query_rows + 3) / 4;
    int64_t bytes = row_bytes(keys_kind, dim), ahead = PREFETCH_BYTES / bytes;
    ahead = ahead < 1 ? 1 : ahead;
    window_walk here = walk_from(pages, request, first), soon = walk_from(pages, request, first + ahead);
    for (int64_t n = first; n < last; n += KEY_BLOCK) {
        int64_t valid = last - n < KEY_BLOCK ? last - n : KEY_BLOCK;
        const void *rows[KEY_BLOCK];
        for (int64_t k = 0; k < KEY_BLOCK; ++k) {
            if (k >= valid) {  /* past the range: the last window again, scored and never offered */
                rows[k] = rows[valid - 1];
                continue;
            }
            rows[k] = here.address;
            step(pages, request, &here);
            if (n + k + ahead < last) prefetch_row(soon.address, bytes);
            step(pages, request, &soon);
        }
        lanes products[KEY_BLOCK / 2], factors[KEY_BLOCK / 2];
        for (int i = 0; i < KEY_BLOCK / 2; ++i) {
            float even = key_factor(rows[2 * i], keys_kind, dim), odd = key_factor(rows[2 * i + 1], keys_kind, dim);
            factors[i] = (lanes){even, even, even, even, odd, odd, odd, odd};
        }
        if (groups == 1) {
            /* Decode's one query of up to 4 heads: the keys widened in registers, one code path per storage. */
            switch (keys_kind) {
            case KEYS_FLOAT32: products_block(s->queries, rows, KEYS_FLOAT32, dim, products); break;
            case KEYS_BFLOAT16: products_block(s->queries, rows, KEYS_BFLOAT16, dim, products); break;
            default: products_block(s->queries, rows, KEYS_PACKED_FP8, dim, products);
            }
            add_group_terms(s, 0, query_rows, heads, products, factors);
        } else {
            /* More rows: the keys widened once, read by every group of 4. */
            const void *widened[KEY_BLOCK];
            for (int k = 0; k < KEY_BLOCK; ++k) widened[k] = key_row(rows[k], keys_kind, dim, s->widened + k * dim);
            for (int64_t g = 0; g < groups; ++g) {
                products_block(s->queries + g * 4 * dim, widened, KEYS_FLOAT32, dim, products);
                add_group_terms(s, g, query_rows, heads, products, factors);
            }
        }
        for (int64_t r = 0; r < count; ++r) {
            int64_t bound = visible[s->rows[r]];
            quad scores = s->scores[r];
            running_topk *best = &s->best[r];
            if (n >= sink_windows && n + valid <= bound - local_windows) {
                /* Nothing forced nor invisible: a block whose scores all lie below the threshold's is skipped. */
                int32_t top = INT32_MIN;
                for (int64_t k = 0; k < valid; ++k) top = ordered_bits(scores[k]) > top ? ordered_bits(scores[k]) : top;
                if (top < (int32_t)(best->threshold >> 32)) continue;
            }
            for (int64_t k = 0; k < valid; ++k) {
                float score = scores[k];
                if (n + k < sink_windows || n + k >= bound - local_windows) score = __builtin_inff();
                if (n + k >= bound) score = -__builtin_inff();
                offer(best, selection_key(score, n + k));
            }
        }
    }
}

/* The `topk` best windows of each query row of a step's tiles over (paged) pooled keys, as the reference's
   `paged_pooled_index_topk_torch` and `pooled_index_topk_torch` select them.

   queries [tokens, heads, dim] and weights [tokens, heads] contiguous float32 (weights with the 1/sqrt(d) scale),
   visible [tokens] int64: token t may select windows 0 .. visible[t] - 1. Tile t holds `width` rows: the tokens
   tile_tokens[t, :] (int64; NULL: t * width + i), of request tile_request[t] (NULL: t), each scored against that
   request's windows 0 .. window_bound - 1, in the keys of `pages` (float32, bfloat16 or packed fp8: the row's dim
   float8_e4m3fn bytes then its float32 scale), read in place. A row repeating the previous row's token (a short
   tile's padding) is scored once. Only windows some row of the tile sees are read, so rows past them (unwritten,
   NaN) never count.

   Each tile's windows are split into `segments` contiguous ranges, one (tile, range) per thread at a time, each
   keeping a running top-k per row; a range's `per_segment` best keys go to candidates
   [tiles, width, segments, per_segment] (INT64_MIN where it has fewer), and the best `topk` of those to
   out [tiles, width, topk] as window ids, ascending, -1 after the last. Returns 0, or 1 when a buffer could not be
   allocated. */
int pooled_topk_windows(const float *queries, const float *weights, const int64_t *visible, const void *keys,
                        int keys_kind, int64_t block_stride, int64_t row_stride, int64_t windows_per_block,
                        const void *block_table, int table_int64, int64_t table_stride, int64_t max_blocks,
                        const int64_t *tile_tokens, const int64_t *tile_request, int64_t tiles, int64_t width,
                        int64_t heads, int64_t dim, int64_t window_bound, int64_t segments, int64_t per_segment,
                        int64_t topk, int64_t sink_windows, int64_t local_windows, int64_t *candidates, int64_t *out,
                        int threads) {
    const paged_keys pages = {keys, keys_kind, block_stride, row_stride, windows_per_block, block_table, table_int64,
                              table_stride, max_blocks};
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        thread_scratch s;
        if (!allocate_scratch(&s, width, heads, dim, per_segment, window_bound)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < tiles * segments; ++item) {
            if (failed) continue;
            int64_t tile = item / segments, segment = item % segments;
            int64_t request = tile_request == NULL ? tile : tile_request[tile];
            /* The tile's distinct rows, their queries (zero rows to a whole group of 4) and the windows they see. */
            int64_t count = 0, seen = 0;
            for (int64_t i = 0; i < width; ++i) {
                int64_t token = tile_token(tile_tokens, width, tile, i);
                if (i > 0 && token == s.rows[count - 1]) continue;
                memcpy(s.queries + count * heads * dim, queries + token * heads * dim, sizeof(float) * heads * dim);
                for (int64_t h = 0; h < heads; ++h) {
                    s.row_queries[count * heads + h] = count;
                    s.row_heads[count * heads + h] = h;
                    s.row_weights[count * heads + h] = weights[token * heads + h];
                }
                seen = visible[token] > seen ? visible[token] : seen;
                s.rows[count++] = token;
            }
            int64_t padded_rows = (count * heads + 3) / 4 * 4;
            memset(s.queries + count * heads * dim, 0, sizeof(float) * (padded_rows - count * heads) * dim);
            if (keys_kind == KEYS_BFLOAT16 && padded_rows == 4)  /* keys widened in registers: `key_chunk`'s order */
                for (int64_t row = 0; row < count * heads; ++row) split_pairs(s.queries + row * dim, dim);
            seen = seen < window_bound ? seen : window_bound;
            for (int64_t r = 0; r < count; ++r)
                s.best[r] = (running_topk){s.buffers + 2 * per_segment * r, 0, per_segment, INT64_MIN};
            int64_t first = seen * segment / segments, last = seen * (segment + 1) / segments;
            score_range(&s, count, &pages, request, first, last, visible, heads, dim, sink_windows, local_windows);
            /* Each distinct row's candidates at its first place in the tile. */
            for (int64_t i = 0, r = -1; i < width; ++i) {
                int64_t token = tile_token(tile_tokens, width, tile, i);
                if (i > 0 && token == s.rows[r]) continue;
                running_topk *best = &s.best[++r];
                int64_t *target = candidates + ((tile * width + i) * segments + segment) * per_segment;
                int64_t kept = best->size < per_segment ? best->size : per_segment;
                if (best->size > per_segment) keep_largest(best->keys, best->size, per_segment);
                memcpy(target, best->keys, sizeof(int64_t) * kept);
                for (int64_t j = kept; j < per_segment; ++j) target[j] = INT64_MIN;
            }
        }
        /* The selections of the distinct rows, then each repeated row takes its predecessor's. */
#pragma omp for schedule(dynamic, 16)
        for (int64_t place = 0; place < tiles * width; ++place) {
            int64_t tile = place / width, i = place % width;
            if (failed || (i > 0 && tile_token(tile_tokens, width, tile, i) ==
                                        tile_token(tile_tokens, width, tile, i - 1)))
                continue;
            window_ids(candidates + place * segments * per_segment, segments * per_segment, topk, window_bound, s.marks,
                       out + place * topk);
        }
        free_scratch(&s);
    }
    if (failed) return 1;
    for (int64_t place = 0; place < tiles * width; ++place) {
        int64_t tile = place / width, i = place % width;
        if (i > 0 && tile_token(tile_tokens, width, tile, i) == tile_token(tile_tokens, width, tile, i - 1))
            memcpy(out + place * topk, out + (place - 1) * topk, sizeof(int64_t) * topk);
    }
    return 0;
}
