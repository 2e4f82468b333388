/* Decode attention read straight out of the paged KV pool, on the CPU.
 *
 * One query token per row attends to that row's keys, found through its block
 * table, without first copying them into a right-padded tensor: every key and
 * value is read once, in the pool's own order (a block's slots are
 * contiguous), and each row is one unit of work (with few rows, each row's
 * KV head: see the kernel), so the query heads that share keys read them together.
 *
 * Shapes (all contiguous, float32):
 *   query, out          [rows, heads, head_dim]
 *   k_pool, v_pool      [slots, kv_heads, head_dim]   slot = block * block_size + offset
 *   tables              [rows, table_stride] int32    a row's blocks, in order
 *   starts, counts      [rows] int64                  the row sees positions [start, start + count)
 * Query head h reads KV head h / (heads / kv_heads) (grouped-query attention).
 *
 * Returns 0; 1 when scratch memory could not be allocated; 2 when a row's
 * positions or blocks lie outside its table or the pool (nothing is read
 * there: the inputs are checked before they are followed).
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>
#include "simd.h"

/* First slot of position `pos` and how many positions from it lie in the same block (at most `left`). */
static inline int64_t run_at(const int32_t *table, int64_t block_size, int64_t pos, int64_t left, int64_t *run) {
    const int64_t block = pos / block_size, offset = pos - block * block_size;
    *run = block_size - offset < left ? block_size - offset : left;
    return (int64_t)table[block] * block_size + offset;
}

/* Ask for `count` slots' records from `slot` on into L2 (a run never crosses its block). */
static inline void prefetch_run(const float *pool, int64_t slot, int64_t count, int64_t slot_stride) {
    const char *p = (const char *)(pool + slot * slot_stride), *end = (const char *)(pool + (slot + count) * slot_stride);
    for (; p < end; p += 64) __builtin_prefetch(p, 0, 2);
}

/* One block of a row, from `*pos` on, asked for into L2 (nothing once `*pos` reaches `end`). */
static inline void prefetch_next_block(const float *pool, const int32_t *table, int64_t block_size, int64_t *pos,
                                       int64_t end, int64_t slot_stride) {
    if (table != NULL && *pos < end) {
        int64_t run;
        const int64_t slot = run_at(table, block_size, *pos, end - *pos, &run);
        prefetch_run(pool, slot, run, slot_stride);
        *pos += run;
    }
}

/* Every position a row will read, checked against its table and the pool; the longest row's length. */
static int check_rows(const int32_t *tables, int64_t table_stride, const int64_t *starts, const int64_t *counts,
                      int64_t rows, int64_t block_size, int64_t num_blocks, int64_t *max_count) {
    *max_count = 1;
    for (int64_t row = 0; row < rows; row++) {
        const int64_t start = starts[row], n = counts[row];
        if (start < 0 || n < 1 || start + n > table_stride * block_size) return 0;
        for (int64_t b = start / block_size; b <= (start + n - 1) / block_size; b++) {
            const int32_t block = tables[row * table_stride + b];
            if (block < 0 || block >= num_blocks) return 0;
        }
        if (n > *max_count) *max_count = n;
    }
    return 1;
}

int cb_paged_decode_f32(const float *query, const float *k_pool, const float *v_pool, const int32_t *tables,
                        int64_t table_stride, const int64_t *starts, const int64_t *counts, float *out,
                        int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                        int64_t num_blocks, float scale, int threads) {
    const int64_t group = heads / kv_heads;
    const int64_t slot_stride = kv_heads * head_dim;
    int64_t max_count;
    if (!check_rows(tables, table_stride, starts, counts, rows, block_size, num_blocks, &max_count)) return 2;
    int failed = 0;
    /* A unit of work is one row, or, with fewer rows than twice the threads, one row's query heads
     * that share one KV head: a single long row then keeps kv_heads threads busy, while many rows
     * keep reading all of a slot's KV heads at once (768 contiguous bytes instead of 256 strided). */
    const int64_t split = rows < 2 * threads ? kv_heads : 1, span = kv_heads / split;
    int64_t total = 0;
    for (int64_t row = 0; row < rows; row++) total += counts[row] * split;
#pragma omp parallel num_threads(threads)
    {
        /* Per thread: softmax weights [heads, max_count], accumulators [heads, head_dim], sums [heads]. */
        float *weights = malloc(sizeof(float) * heads * max_count);
        float *acc = malloc(sizeof(float) * heads * head_dim);
        float *sums = malloc(sizeof(float) * heads);
        if (weights == NULL || acc == NULL || sums == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        /* Each thread takes consecutive units holding an equal share of the keys, so it knows the
         * unit it runs next: the pool is far larger than any cache, and the hardware prefetcher does
         * not look past a block (a few KB). So while a row's keys are scored its values are asked
         * for, and while its values are summed the next unit's keys. Reading a pool in DRAM, the
         * kernel took 10 GB/s without this and 15 with it, of the 30 the two cores stream; whole
         * decode steps of the default model took 0.89-0.94x the time (16 and 64 rows). */
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t lo = total * tid / nt, hi = total * (tid + 1) / nt;
        int64_t first = 0, last = 0;
        for (int64_t unit = 0, seen = 0; unit < rows * split; unit++) {
            const int64_t cost = counts[unit / split];
            if (seen < lo) first = unit + 1;
            if (seen < hi) last = unit + 1;
            seen += cost;
        }
        if (!failed) {
            for (int64_t unit = first; unit < last; unit++) {
                const int64_t row = unit / split, h0 = (unit % split) * span * group, h1 = h0 + span * group;
                const int32_t *table = tables + row * table_stride;
                const int64_t start = starts[row], n = counts[row];
                const float *q = query + row * heads * head_dim;
                /* The next row's keys are asked for block by block while this row's values are summed.
                 * Not with units of one KV head: they read a slot's record a part at a time, and asking
                 * for whole records would multiply the traffic. */
                const int64_t next = split == 1 && unit + 1 < last ? unit + 1 : -1;
                const int32_t *next_table = next < 0 ? NULL : tables + next * table_stride;
                const int64_t next_end = next < 0 ? 0 : starts[next] + counts[next];
                int64_t next_k = next < 0 ? 0 : starts[next];
                int64_t run;
                /* Scores, one pass over the keys. */
                for (int64_t pos = start, l = 0; pos < start + n; pos += run) {
                    const int64_t slot = run_at(table, block_size, pos, start + n - pos, &run);
                    const float *k = k_pool + slot * slot_stride;
                    if (split == 1) prefetch_run(v_pool, slot, run, slot_stride);
                    int64_t i = 0;
#if CB_AVX2
                    if (head_dim % 8 == 0)
                        for (; i + 8 <= run; i += 8, l += 8, k += 8 * slot_stride) {
                            for (int64_t h = h0; h < h1; h++) {
                                const __m256 s = dot8(q + h * head_dim, k + (h / group) * head_dim, slot_stride, head_dim);
                                _mm256_storeu_ps(weights + h * n + l, _mm256_mul_ps(s, _mm256_set1_ps(scale)));
                            }
                        }
#endif
                    for (; i < run; i++, l++, k += slot_stride)
                        for (int64_t h = h0; h < h1; h++)
                            weights[h * n + l] = dot(q + h * head_dim, k + (h / group) * head_dim, head_dim) * scale;
                }
                /* Softmax per head; the sum divides the output at the end. */
                for (int64_t h = h0; h < h1; h++) {
                    sums[h] = softmax_weights(weights + h * n, n);
                    for (int64_t d = 0; d < head_dim; d++) acc[h * head_dim + d] = 0.f;
                }
                /* Weighted values, one pass. */
                for (int64_t pos = start, l = 0; pos < start + n; pos += run, l += run) {
                    const float *v = v_pool + run_at(table, block_size, pos, start + n - pos, &run) * slot_stride;
                    prefetch_next_block(k_pool, next_table, block_size, &next_k, next_end, slot_stride);
#if CB_AVX2
                    if (head_dim % 8 == 0) {
                        for (int64_t h = h0; h < h1; h++)
                            add_weighted8(acc + h * head_dim, weights + h * n + l, v + (h / group) * head_dim,
                                          slot_stride, run, head_dim);
                        continue;
                    }
#endif
                    for (int64_t i = 0; i < run; i++, v += slot_stride)
                        for (int64_t h = h0; h < h1; h++)
                            add_scaled(acc + h * head_dim, weights[h * n + l + i], v + (h / group) * head_dim, head_dim);
                }
                while (next_k < next_end) prefetch_next_block(k_pool, next_table, block_size, &next_k, next_end, slot_stride);
                for (int64_t h = h0; h < h1; h++) {
                    float *o = out + (row * heads + h) * head_dim;
                    const float inv = 1.f / sums[h];
                    for (int64_t d = 0; d < head_dim; d++) o[d] = acc[h * head_dim + d] * inv;
                }
            }
        }
        free(weights);
        free(acc);
        free(sums);
    }
    return failed;
}
