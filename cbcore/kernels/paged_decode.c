/* Decode attention read straight out of the paged KV pool, on the CPU.
 *
 * One query token per row attends to that row's keys, found through its block
 * table, without first copying them into a right-padded tensor. Each row is
 * one unit of work (with few rows, each row's KV head: see below), and a unit
 * reads its keys in one pass: block run by block run, a run's keys, then the
 * same run's values, folded into a running softmax per query head (the
 * largest score so far m, the sum l of e^(s - m), and the values weighted by
 * e^(s - m), all rescaled when a larger score arrives). The query heads that
 * share a KV head read its records while they are in cache.
 *
 * The pool is far larger than any cache, and the hardware prefetcher does not
 * follow a row from one block to the next (nor past a 4 KiB page), so while a
 * run is computed the next run's records are asked for into L2, a few lines
 * before each chunk of keys: spread out, the requests keep the memory busy
 * without stalling the loads that compute. The two-pass kernel this replaced
 * (all scores, then all values, each run's records asked for at once) read
 * 7-8 GB/s of cold pools on one Zen 4 core; this one 14-15 (docs/backends.md).
 *
 * Shapes (all contiguous, float32):
 *   query, out          [rows, heads, head_dim]
 *   k_pool, v_pool      [slots, kv_heads, head_dim]   slot = block * block_size + offset
 *   tables              [rows, table_stride] int32    a row's blocks, in order
 *   starts, counts      [rows] int64                  the row sees positions [start, start + count)
 * Query head h reads KV head h / (heads / kv_heads) (grouped-query attention).
 *
 * A head's result is the same bits whatever the thread count or the other rows: each head folds its
 * keys in the same chunks, in the same order. Chunks are 16 keys with AVX-512 (CB_AVX512), 8 with
 * AVX2, 16 in plain C otherwise.
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

#if CB_AVX512
enum { CHUNK = 16, VEC = 16 };
#elif CB_AVX2
enum { CHUNK = 8, VEC = 8 };
#else
enum { CHUNK = 16, VEC = 1 };
#endif

/* First slot of position `pos` and how many positions from it lie in the same block (at most `left`). */
static inline int64_t run_at(const int32_t *table, int64_t block_size, int64_t pos, int64_t left, int64_t *run) {
    const int64_t block = pos / block_size, offset = pos - block * block_size;
    *run = block_size - offset < left ? block_size - offset : left;
    return (int64_t)table[block] * block_size + offset;
}

/* Every position a row will read, checked against its table and the pool; the longest row's length. */
static int check_rows(const int32_t *tables, int64_t table_stride, const int64_t *starts, const int64_t *counts,
                      int64_t rows, int64_t block_size, int64_t num_blocks) {
    for (int64_t row = 0; row < rows; row++) {
        const int64_t start = starts[row], n = counts[row];
        if (start < 0 || n < 1 || start + n > table_stride * block_size) return 0;
        for (int64_t b = start / block_size; b <= (start + n - 1) / block_size; b++) {
            const int32_t block = tables[row * table_stride + b];
            if (block < 0 || block >= num_blocks) return 0;
        }
    }
    return 1;
}

/* The records of the run a unit reads next (its KV heads' part of each slot, keys and values): `total`
 * cache lines of each pool, asked for into L2 `done` at a time. */
typedef struct {
    const char *k, *v; /* the first slot's part */
    int64_t slot_bytes, part_lines, total, done;
} Ahead;

static inline void ahead_to(Ahead *a, int64_t upto) {
    for (; a->done < upto; a->done++) {
        const int64_t slot = a->done / a->part_lines, off = slot * a->slot_bytes + (a->done - slot * a->part_lines) * 64;
        __builtin_prefetch(a->k + off, 0, 2);
        __builtin_prefetch(a->v + off, 0, 2);
    }
}

/* The running softmax of one query head: m the largest score so far, l the sum of e^(s - m). */
typedef struct {
    float m, l;
} Running;

/* Raises r.m to `top` if larger, rescaling l and acc[0:D] by e^(m_old - m_new) (0 on the first keys). */
static inline void raise_max(Running *r, float top, float *acc, int64_t D) {
    if (top > r->m) {
        const float alpha = expf(r->m - top);
        for (int64_t d = 0; d < D; d++) acc[d] *= alpha;
        r->l *= alpha;
        r->m = top;
    }
}

/* One chunk of `count` <= CHUNK keys (k, v: the first key's and value's record of this KV head, `stride`
 * floats apart) folded into the running softmax `r` and the weighted values acc[0:D] of query head q:
 * in plain C for any D, with vectors where D is a multiple of VEC. */
static inline void fold_plain(const float *q, const float *k, const float *v, int64_t stride, int64_t count, int64_t D,
                              float scale, Running *r, float *acc) {
    float w[CHUNK], top = -INFINITY;
    for (int64_t j = 0; j < count; j++) {
        w[j] = dot(q, k + j * stride, D) * scale;
        top = w[j] > top ? w[j] : top;
    }
    raise_max(r, top, acc, D);
    for (int64_t j = 0; j < count; j++) r->l += w[j] = expf(w[j] - r->m);
    for (int64_t j = 0; j < count; j++) add_scaled(acc, w[j], v + j * stride, D);
}

#if CB_AVX512
/* 16 keys' scores in one vector; keys from `count` on read key 0 and are masked to -inf. */
static inline __m512 scores16(const float *q, const float *k, int64_t stride, int64_t count, int64_t D) {
    __m512 a[16];
    const float *key[16];
    for (int j = 0; j < 16; j++) a[j] = _mm512_setzero_ps(), key[j] = k + (j < count ? j : 0) * stride;
    for (int64_t d = 0; d < D; d += 16) {
        const __m512 x = _mm512_loadu_ps(q + d);
        for (int j = 0; j < 16; j++) a[j] = _mm512_fmadd_ps(x, _mm512_loadu_ps(key[j] + d), a[j]);
    }
    return _mm512_mask_blend_ps((__mmask16)((1u << count) - 1), _mm512_set1_ps(-INFINITY), sums16(a));
}

static inline __attribute__((always_inline)) void fold_vec(const float *q, const float *k, const float *v, int64_t stride,
                                                            int64_t count, int64_t D, float scale, Running *r, float *acc) {
    const __m512 s = _mm512_mul_ps(scores16(q, k, stride, count, D), _mm512_set1_ps(scale));
    raise_max(r, _mm512_reduce_max_ps(s), acc, D);
    const __m512 p = exp16(_mm512_sub_ps(s, _mm512_set1_ps(r->m)));
    r->l += _mm512_reduce_add_ps(p);
    float w[16];
    _mm512_storeu_ps(w, p);
    add_weighted16(acc, w, v, stride, count, D);
}
#elif CB_AVX2
static inline __attribute__((always_inline)) void fold_vec(const float *q, const float *k, const float *v, int64_t stride,
                                                            int64_t count, int64_t D, float scale, Running *r, float *acc) {
    float w[8];
    __m256 s;
    if (count == 8) {
        s = _mm256_mul_ps(dot8(q, k, stride, D), _mm256_set1_ps(scale));
    } else { /* a run's last keys */
        for (int64_t j = 0; j < 8; j++) w[j] = j < count ? dot(q, k + j * stride, D) * scale : -INFINITY;
        s = _mm256_loadu_ps(w);
    }
    raise_max(r, max8(s), acc, D);
    const __m256 p = exp8(_mm256_sub_ps(s, _mm256_set1_ps(r->m)));
    r->l += sum8(p);
    _mm256_storeu_ps(w, p);
    add_weighted8(acc, w, v, stride, count, D);
}
#else
#define fold_vec fold_plain
#endif

int cb_paged_decode_f32(const float *query, const float *k_pool, const float *v_pool, const int32_t *tables,
                        int64_t table_stride, const int64_t *starts, const int64_t *counts, float *out,
                        int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                        int64_t num_blocks, float scale, int threads) {
    const int64_t group = heads / kv_heads;
    const int64_t slot_stride = kv_heads * head_dim;
    if (!check_rows(tables, table_stride, starts, counts, rows, block_size, num_blocks)) return 2;
    const int vec = head_dim % VEC == 0;
    int failed = 0;
    /* A unit of work is one row, or, with fewer rows than twice the threads, one row's query heads
     * that share one KV head: a single long row then keeps kv_heads threads busy. */
    const int64_t split = rows < 2 * threads ? kv_heads : 1, span = kv_heads / split;
    const int64_t part_lines = (span * head_dim * (int64_t)sizeof(float) + 63) / 64;
    int64_t total = 0;
    for (int64_t row = 0; row < rows; row++) total += counts[row] * split;
#pragma omp parallel num_threads(threads)
    {
        float *acc = malloc(sizeof(float) * heads * head_dim);
        Running *run_of = malloc(sizeof(Running) * heads);
        if (acc == NULL || run_of == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        /* Each thread takes consecutive units holding an equal share of the keys, so it knows the
         * unit it reads after the current one. */
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t lo = total * tid / nt, hi = total * (tid + 1) / nt;
        int64_t first = 0, last = 0;
        for (int64_t unit = 0, seen = 0; unit < rows * split; unit++) {
            const int64_t cost = counts[unit / split];
            if (seen < lo) first = unit + 1;
            if (seen < hi) last = unit + 1;
            seen += cost;
        }
        for (int64_t unit = first; unit < last && !failed; unit++) {
            const int64_t row = unit / split, g0 = (unit % split) * span, h0 = g0 * group, h1 = h0 + span * group;
            const int32_t *table = tables + row * table_stride;
            const int64_t end = starts[row] + counts[row];
            const float *q = query + row * heads * head_dim;
            for (int64_t h = h0; h < h1; h++) {
                run_of[h] = (Running){-INFINITY, 0.f};
                for (int64_t d = 0; d < head_dim; d++) acc[h * head_dim + d] = 0.f;
            }
            int64_t run;
            for (int64_t pos = starts[row]; pos < end; pos += run) {
                const int64_t slot = run_at(table, block_size, pos, end - pos, &run);
                /* The run read next: this row's, else the first of this thread's next unit. */
                int64_t next = pos + run, next_row = row, next_g0 = g0;
                if (next >= end && unit + 1 < last)
                    next_row = (unit + 1) / split, next = starts[next_row], next_g0 = ((unit + 1) % split) * span;
                Ahead ahead = {0};
                if (next < starts[next_row] + counts[next_row]) {
                    int64_t next_run;
                    const int64_t first_slot = run_at(tables + next_row * table_stride, block_size, next,
                                                      starts[next_row] + counts[next_row] - next, &next_run);
                    const int64_t at = first_slot * slot_stride + next_g0 * head_dim;
                    ahead = (Ahead){(const char *)(k_pool + at), (const char *)(v_pool + at),
                                    slot_stride * (int64_t)sizeof(float), part_lines, next_run * part_lines, 0};
                }
                const int64_t steps = (run + CHUNK - 1) / CHUNK * (h1 - h0);
                int64_t step = 0;
                for (int64_t c = 0; c < run; c += CHUNK) {
                    const int64_t n = run - c < CHUNK ? run - c : CHUNK;
                    const float *k = k_pool + (slot + c) * slot_stride, *v = v_pool + (slot + c) * slot_stride;
                    for (int64_t h = h0; h < h1; h++) {
                        ahead_to(&ahead, ahead.total * ++step / steps);
                        const int64_t kv = (h / group) * head_dim;
                        if (vec)
                            fold_vec(q + h * head_dim, k + kv, v + kv, slot_stride, n, head_dim, scale, run_of + h,
                                     acc + h * head_dim);
                        else
                            fold_plain(q + h * head_dim, k + kv, v + kv, slot_stride, n, head_dim, scale, run_of + h,
                                       acc + h * head_dim);
                    }
                }
            }
            for (int64_t h = h0; h < h1; h++) {
                float *o = out + (row * heads + h) * head_dim;
                const float inv = 1.f / run_of[h].l;
                for (int64_t d = 0; d < head_dim; d++) o[d] = acc[h * head_dim + d] * inv;
            }
        }
        free(acc);
        free(run_of);
    }
    return failed;
}
