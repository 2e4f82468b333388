/* Causal attention of whole prompts (no earlier context) on the CPU, every prompt of a step in one call.
 *
 * A prompt's keys and values are this step's own, so they are read where the step's product left
 * them (rows `*_stride` and heads `*_head` floats apart, each head's dims contiguous), never from the cache. A unit of
 * work is BLOCK query rows of one prompt and one KV head; its query heads (the group sharing that KV
 * head) are scored together and their weighted sums take each value row once for all of them. Units
 * run longest first (a block late in a prompt sees the most keys) and are handed out dynamically.
 *
 * With AVX-512 and head_dim a multiple of 64 a unit is computed as two small matrix products instead of
 * row by row: its BLOCK x group query vectors are scored against sixteen keys at a time from a transposed
 * copy of the keys (made once per call: a loaded key tile serves four query vectors, a broadcast query
 * element four tiles), and the weighted sums take six query vectors at a time over each value row. Row by
 * row, every key and value load serves one query row: 16 prompts of 128 tokens at the default model's
 * heads took 2.44 ms a layer so, 1.26 ms blocked (2-core Zen 5; docs/backends.md).
 *
 * Shapes (float32):
 *   query            [tokens, heads, head_dim]      rows q_stride, heads q_head floats apart
 *   key, value       [tokens, kv_heads, head_dim]   rows k_stride / v_stride, heads k_head / v_head apart
 *   out              [tokens, heads, head_dim]      contiguous; only the prompts' rows are written
 *   starts, lens     [spans] int64                  prompt s is rows [starts[s], starts[s] + lens[s])
 * Query row i of a prompt sees keys 0..i of it. Query head h reads KV head h / (heads / kv_heads).
 *
 * Returns 0; 1 when scratch memory could not be allocated (the caller checks the spans' bounds).
 */
#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>
#include "simd.h"

#define BLOCK 16 /* query rows per unit of work */

#if CB_AVX512
/* w[i * ldw + 16 t + c] = scale * (query i . key 16 t + c) for M <= 4 query vectors (rows of qs, dim
 * floats apart) and T <= 4 tiles of sixteen keys (key j's element d at kt[d * ldk + j]). */
static inline __attribute__((always_inline)) void score_tiles(float *restrict w, int64_t ldw, const float *restrict qs,
                                                              const float *restrict kt, int64_t ldk, int64_t dim,
                                                              float scale, const int M, const int T) {
    __m512 a[4][4];
    for (int i = 0; i < M; i++)
        for (int t = 0; t < T; t++) a[i][t] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d++, kt += ldk) {
        __m512 k[4];
        for (int t = 0; t < T; t++) k[t] = _mm512_loadu_ps(kt + 16 * t);
        for (int i = 0; i < M; i++) {
            const __m512 q = _mm512_set1_ps(qs[i * dim + d]);
            for (int t = 0; t < T; t++) a[i][t] = _mm512_fmadd_ps(q, k[t], a[i][t]);
        }
    }
    for (int i = 0; i < M; i++)
        for (int t = 0; t < T; t++) _mm512_storeu_ps(w + i * ldw + 16 * t, _mm512_mul_ps(a[i][t], _mm512_set1_ps(scale)));
}

/* o[i][0:64] = inv[i] * sum over `count` value rows l of w[i * ldw + l] * v[l * stride + 0:64], M <= 6. */
static inline __attribute__((always_inline)) void weigh_rows(float *const *o, const float *restrict inv,
                                                             const float *restrict w, int64_t ldw,
                                                             const float *restrict v, int64_t stride, int64_t count,
                                                             const int M) {
    __m512 a[6][4];
    for (int i = 0; i < M; i++)
        for (int c = 0; c < 4; c++) a[i][c] = _mm512_setzero_ps();
    for (int64_t l = 0; l < count; l++, v += stride) {
        __m512 x[4];
        for (int c = 0; c < 4; c++) x[c] = _mm512_loadu_ps(v + 16 * c);
        for (int i = 0; i < M; i++) {
            const __m512 p = _mm512_set1_ps(w[i * ldw + l]);
            for (int c = 0; c < 4; c++) a[i][c] = _mm512_fmadd_ps(p, x[c], a[i][c]);
        }
    }
    for (int i = 0; i < M; i++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(o[i] + 16 * c, _mm512_mul_ps(a[i][c], _mm512_set1_ps(inv[i])));
}

/* Softmax of w[0:n] in place, unnormalised, then zeros up to `upto`; returns the sum that normalises it. */
static inline float softmax_upto(float *restrict w, int64_t n, int64_t upto) {
    __m512 m = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
    for (int64_t l = 0; l < n; l += 16)
        m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, (__mmask16)(n - l >= 16 ? 0xFFFF : (1u << (n - l)) - 1), w + l));
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    for (int64_t l = 0; l < n; l += 16) {
        const __mmask16 k = (__mmask16)(n - l >= 16 ? 0xFFFF : (1u << (n - l)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, w + l), max)));
        _mm512_mask_storeu_ps(w + l, k, e);
        total = _mm512_add_ps(total, e);
    }
    for (int64_t l = n; l < upto; l++) w[l] = 0.f;
    return _mm512_reduce_add_ps(total);
}

/* One unit on the blocked path: query rows [r0, r0 + rows) of the prompt at row `start`, the `group` query
 * heads of KV head g, whose keys are transposed at kt (ldk apart). qs [rows * group, dim],
 * w [rows * group, ldw] and inv [rows * group] are the thread's scratch. */
static void attend_block(const float *query, int64_t q_stride, int64_t q_head, const float *kt, int64_t ldk,
                         const float *v, int64_t v_stride, float *out, int64_t heads, int64_t start, int64_t r0,
                         int64_t rows, int64_t g, int64_t group, int64_t dim, float scale, float *restrict qs,
                         float *restrict w, int64_t ldw, float *restrict inv) {
    const int64_t m_all = rows * group, n_max = r0 + rows, n16 = (n_max + 15) / 16 * 16;
    for (int64_t m = 0; m < m_all; m++) { /* query vector m: row m / group, head m % group */
        const float *q = query + (start + r0 + m / group) * q_stride + (g * group + m % group) * q_head;
        for (int64_t d = 0; d < dim; d++) qs[m * dim + d] = q[d];
    }
    int64_t m = 0;
    for (; m + 4 <= m_all; m += 4) {
        int64_t j = 0;
        for (; j + 64 <= n16; j += 64) score_tiles(w + m * ldw + j, ldw, qs + m * dim, kt + j, ldk, dim, scale, 4, 4);
        for (; j < n16; j += 16) score_tiles(w + m * ldw + j, ldw, qs + m * dim, kt + j, ldk, dim, scale, 4, 1);
    }
    for (; m < m_all; m++)
        for (int64_t j = 0; j < n16; j += 16) score_tiles(w + m * ldw + j, ldw, qs + m * dim, kt + j, ldk, dim, scale, 1, 1);
    for (m = 0; m < m_all; m++) inv[m] = 1.f / softmax_upto(w + m * ldw, r0 + m / group + 1, n_max);
    for (m = 0; m < m_all; m += 6) {
        const int M = m_all - m < 6 ? (int)(m_all - m) : 6;
        const int64_t count = r0 + (m + M - 1) / group + 1; /* the last vector's keys; the others' past theirs are 0 */
        for (int64_t c = 0; c < dim; c += 64) {
            float *o[6];
            for (int i = 0; i < M; i++)
                o[i] = out + ((start + r0 + (m + i) / group) * heads + g * group + (m + i) % group) * dim + c;
            const float *vc = v + c;
            switch (M) { /* a constant M: the accumulators stay in registers */
            case 1: weigh_rows(o, inv + m, w + m * ldw, ldw, vc, v_stride, count, 1); break;
            case 2: weigh_rows(o, inv + m, w + m * ldw, ldw, vc, v_stride, count, 2); break;
            case 3: weigh_rows(o, inv + m, w + m * ldw, ldw, vc, v_stride, count, 3); break;
            case 4: weigh_rows(o, inv + m, w + m * ldw, ldw, vc, v_stride, count, 4); break;
            case 5: weigh_rows(o, inv + m, w + m * ldw, ldw, vc, v_stride, count, 5); break;
            default: weigh_rows(o, inv + m, w + m * ldw, ldw, vc, v_stride, count, 6);
            }
        }
    }
}
#endif

#if CB_AVX2
/* acc[h][0:64] = sum over keys l of w[h * w_stride + l] * v[l * stride + 0:64] for the G <= 3 heads of a
 * group: each value row is loaded once for all of them (G x 8 accumulators). */
static inline void weighted64_heads(float *restrict acc, const float *restrict w, int64_t w_stride,
                                    const float *restrict v, int64_t stride, int64_t count, const int G) {
    __m256 a[3][8];
    for (int h = 0; h < G; h++)
        for (int i = 0; i < 8; i++) a[h][i] = _mm256_setzero_ps();
    for (int64_t l = 0; l < count; l++, v += stride) {
        __m256 x[8];
        for (int i = 0; i < 8; i++) x[i] = _mm256_loadu_ps(v + 8 * i);
        for (int h = 0; h < G; h++) {
            const __m256 p = _mm256_broadcast_ss(w + h * w_stride + l);
            for (int i = 0; i < 8; i++) a[h][i] = _mm256_fmadd_ps(p, x[i], a[h][i]);
        }
    }
    for (int h = 0; h < G; h++)
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + h * 64 + 8 * i, a[h][i]);
}
#endif

/* Query row r of one prompt, for the `group` query heads of one KV head: scores, softmax, weighted values. */
static inline __attribute__((always_inline)) void attend_row(
    const float *q, int64_t q_head, const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *o,
    int64_t r, int64_t group, int64_t head_dim, int64_t w_stride, float scale, float *restrict weights,
    float *restrict acc) {
    const int64_t n = r + 1; /* keys 0..r */
    int64_t j = 0;
#if CB_AVX2
    if (head_dim % 8 == 0)
        for (; j + 8 <= n; j += 8)
            for (int64_t h = 0; h < group; h++)
                _mm256_storeu_ps(weights + h * w_stride + j,
                                 _mm256_mul_ps(dot8(q + h * q_head, k + j * k_stride, k_stride, head_dim),
                                               _mm256_set1_ps(scale)));
#endif
    for (; j < n; j++)
        for (int64_t h = 0; h < group; h++)
            weights[h * w_stride + j] = dot(q + h * q_head, k + j * k_stride, head_dim) * scale;
    float sums[64]; /* group <= 64: checked by the caller */
    for (int64_t h = 0; h < group; h++) sums[h] = softmax_weights(weights + h * w_stride, n);
#if CB_AVX2
    if (head_dim == 64 && group <= 3) {
        switch (group) { /* a constant G: the accumulators stay in registers */
        case 1: weighted64_heads(acc, weights, w_stride, v, v_stride, n, 1); break;
        case 2: weighted64_heads(acc, weights, w_stride, v, v_stride, n, 2); break;
        default: weighted64_heads(acc, weights, w_stride, v, v_stride, n, 3);
        }
    } else
#endif
        for (int64_t h = 0; h < group; h++) {
            for (int64_t d = 0; d < head_dim; d++) acc[h * head_dim + d] = 0.f;
            for (int64_t l = 0; l < n; l++) add_scaled(acc + h * head_dim, weights[h * w_stride + l], v + l * v_stride, head_dim);
        }
    for (int64_t h = 0; h < group; h++) {
        const float inv = 1.f / sums[h];
        for (int64_t d = 0; d < head_dim; d++) o[h * head_dim + d] = acc[h * head_dim + d] * inv;
    }
}

int cb_prompt_attention_f32(const float *query, int64_t q_stride, int64_t q_head, const float *key,
                            int64_t k_stride, int64_t k_head, const float *value, int64_t v_stride,
                            int64_t v_head, float *out, const int64_t *starts,
                            const int64_t *lens, int64_t spans, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            float scale, int threads) {
    const int64_t group = heads / kv_heads;
    int64_t units = 0, longest = 1, extent = 0;
    for (int64_t s = 0; s < spans; s++) {
        units += (lens[s] + BLOCK - 1) / BLOCK * kv_heads;
        longest = lens[s] > longest ? lens[s] : longest;
        extent = starts[s] + lens[s] > extent ? starts[s] + lens[s] : extent;
    }
    int64_t *order = malloc(sizeof(int64_t) * 3 * (units > 0 ? units : 1)); /* (span, kv head, block) */
    if (order == NULL) return 1;
    int64_t u = 0;
    for (int64_t b = (longest + BLOCK - 1) / BLOCK - 1; b >= 0; b--)
        for (int64_t s = 0; s < spans; s++)
            for (int64_t g = 0; b * BLOCK < lens[s] && g < kv_heads; g++, u++)
                order[3 * u] = s, order[3 * u + 1] = g, order[3 * u + 2] = b;
#if CB_AVX512
    /* The blocked path's keys, transposed: KV head g's element d of row r at kt[(g * head_dim + d) * ldk + r]
     * (a tile of sixteen may read up to fifteen columns past a prompt's last row: they are scored, never used). */
    const int blocked = head_dim % 64 == 0;
    const int64_t ldk = extent + 16, ldw = (longest + 15) / 16 * 16;
    float *kt = blocked ? malloc(sizeof(float) * kv_heads * head_dim * ldk) : NULL;
    if (blocked && kt == NULL) {
        free(order);
        return 1;
    }
#endif
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
#if CB_AVX512
        if (blocked) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < spans * kv_heads; i++) {
                const int64_t s = i / kv_heads, g = i % kv_heads;
                for (int64_t r = starts[s]; r < starts[s] + lens[s]; r++)
                    for (int64_t d = 0; d < head_dim; d++)
                        kt[(g * head_dim + d) * ldk + r] = key[r * k_stride + g * k_head + d];
            } /* the loop's end is a barrier: every key is in place before a unit reads it */
        }
        const int64_t m_most = BLOCK * group;
        float *qs = blocked ? malloc(sizeof(float) * m_most * head_dim) : NULL;
        float *scores = blocked ? malloc(sizeof(float) * m_most * ldw) : NULL;
        float *inv = blocked ? malloc(sizeof(float) * m_most) : NULL;
        if (blocked && (qs == NULL || scores == NULL || inv == NULL)) {
#pragma omp atomic write
            failed = 1;
        }
#else
        const int blocked = 0;
#endif
        float *weights = blocked ? NULL : malloc(sizeof(float) * group * longest); /* [group, longest] */
        float *acc = blocked ? NULL : malloc(sizeof(float) * group * head_dim);
        if (!blocked && (weights == NULL || acc == NULL)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < units; i++) {
                const int64_t s = order[3 * i], g = order[3 * i + 1], b = order[3 * i + 2];
                const int64_t start = starts[s], end = (b + 1) * BLOCK < lens[s] ? (b + 1) * BLOCK : lens[s];
                const float *k = key + start * k_stride + g * k_head, *v = value + start * v_stride + g * v_head;
#if CB_AVX512
                if (blocked) {
                    attend_block(query, q_stride, q_head, kt + g * head_dim * ldk + start, ldk, v, v_stride, out, heads,
                                 start, b * BLOCK, end - b * BLOCK, g, group, head_dim, scale, qs, scores, ldw, inv);
                    continue;
                }
#endif
                for (int64_t r = b * BLOCK; r < end; r++)
                    attend_row(query + (start + r) * q_stride + g * group * q_head, q_head, k, k_stride, v, v_stride,
                               out + ((start + r) * heads + g * group) * head_dim, r, group, head_dim, longest,
                               scale, weights, acc);
            }
        }
#if CB_AVX512
        free(qs);
        free(scores);
        free(inv);
#endif
        free(weights);
        free(acc);
    }
#if CB_AVX512
    free(kt);
#endif
    free(order);
    return failed;
}
