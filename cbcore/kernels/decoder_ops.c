/* The elementwise glue of a Llama-family layer, one call each, in place where it can be.
 *
 * Per layer the fused forward runs, besides its four products and attention,
 * about twenty small torch ops (the norm alone is seven: a cast, pow, mean,
 * add, rsqrt and two multiplies); at a decode step each costs more in
 * dispatch than in arithmetic. These three functions do the same arithmetic
 * in one pass over the rows: the residual add with the norm that follows it,
 * rotary on q and k, and the MLP's activation times its up projection.
 *
 * All float32, row-major; a row of `x` or `qk` starts `stride` floats after
 * the previous one (the q/k part of a joined q/k/v product). Rows are split
 * across `threads` only when there are enough of them to pay for it.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "simd.h"

#define ROWS_PER_THREAD 16

/* h += delta (when delta is not NULL); out = weight * (h / sqrt(mean(h^2) + eps)). */
int cb_add_rms_norm(float *restrict h, const float *restrict delta, const float *restrict weight,
                    float *restrict out, int64_t rows, int64_t width, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= 2 * ROWS_PER_THREAD) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *x = h + r * width;
        float *y = out + r * width;
        if (delta != NULL) {
            const float *d = delta + r * width;
#pragma omp simd
            for (int64_t i = 0; i < width; i++) x[i] += d[i];
        }
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < width; i++) sum += x[i] * x[i];
        const float inv = 1.f / sqrtf(sum / (float)width + eps);
#pragma omp simd
        for (int64_t i = 0; i < width; i++) y[i] = weight[i] * (x[i] * inv);
    }
    return 0;
}

/* Rotary on `heads` heads of head_dim each per row, in place: the first half of a head pairs with
 * the second (HF's rotate_half); cos and sin are [rows, head_dim]. */
int cb_rotary(float *restrict qk, int64_t stride, const float *restrict cos, const float *restrict sin,
              int64_t rows, int64_t heads, int64_t head_dim, int threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(threads) if (rows >= 2 * ROWS_PER_THREAD) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * head_dim, *s = sin + r * head_dim;
        for (int64_t hd = 0; hd < heads; hd++) {
            float *x = qk + r * stride + hd * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x[i], b = x[i + half];
                x[i] = a * c[i] - b * s[i];
                x[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
    return 0;
}

/* out[r] = silu(gate_up[r, :n]) * gate_up[r, n:2n]. */
int cb_silu_mul(const float *restrict gate_up, float *restrict out, int64_t rows, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) if (rows >= 2 * ROWS_PER_THREAD) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * n, *u = g + n;
        float *y = out + r * n;
        int64_t i = 0;
#if CB_AVX2
        for (; i + 8 <= n; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
            const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e));
            _mm256_storeu_ps(y + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < n; i++) y[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
    return 0;
}
