/* Causal attention of whole prompts (no earlier context) on the CPU, every prompt of a step in one call.
 *
 * A prompt's keys and values are this step's own, so they are read where the step's product left
 * them (rows `*_stride` and heads `*_head` floats apart, each head's dims contiguous), never from the cache. A unit of
 * work is BLOCK query rows of one prompt and one KV head; its query heads (the group sharing that KV
 * head) are scored together and their weighted sums take each value row once for all of them. Units
 * run longest first (a block late in a prompt sees the most keys) and are handed out dynamically.
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
    int64_t units = 0, longest = 1;
    for (int64_t s = 0; s < spans; s++) {
        units += (lens[s] + BLOCK - 1) / BLOCK * kv_heads;
        longest = lens[s] > longest ? lens[s] : longest;
    }
    int64_t *order = malloc(sizeof(int64_t) * 3 * (units > 0 ? units : 1)); /* (span, kv head, block) */
    if (order == NULL) return 1;
    int64_t u = 0;
    for (int64_t b = (longest + BLOCK - 1) / BLOCK - 1; b >= 0; b--)
        for (int64_t s = 0; s < spans; s++)
            for (int64_t g = 0; b * BLOCK < lens[s] && g < kv_heads; g++, u++)
                order[3 * u] = s, order[3 * u + 1] = g, order[3 * u + 2] = b;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *weights = malloc(sizeof(float) * group * longest); /* [group, longest] */
        float *acc = malloc(sizeof(float) * group * head_dim);
        if (weights == NULL || acc == NULL) {
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
                for (int64_t r = b * BLOCK; r < end; r++)
                    attend_row(query + (start + r) * q_stride + g * group * q_head, q_head, k, k_stride, v, v_stride,
                               out + ((start + r) * heads + g * group) * head_dim, r, group, head_dim, longest,
                               scale, weights, acc);
            }
        }
        free(weights);
        free(acc);
    }
    free(order);
    return failed;
}
