/* out[m, n] = x[m, k] . w[n, k] (+ bias[n]) for the few rows of a decode step, float32, row-major.
 *
 * With up to a few dozen rows a product is a pass over the weight, and the
 * weight does not fit in any cache: the time is memory bandwidth. oneDNN's
 * general kernels spend about half as long again as that pass here (27 ms
 * against 18 for the default model's products at one row, 2-core AVX2
 * host). This kernel streams four weight rows at a time, each read once per
 * pair of input rows (four with AVX-512) while it is in L1, with independent
 * accumulators. A row's result does not depend on the other rows of the step.
 *
 * Returns 0, or 3 when built for a CPU without AVX2 and FMA (the caller multiplies otherwise).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include "simd.h"
#if CB_AVX512
/* AVX-512: each (input row, weight row) pair is one 16-lane accumulator over k, reduced in a fixed
 * order, then the k % 16 tail; up to four input rows share each load of four weight rows. The same
 * instructions run for a pair whatever else is in its block, so a row's result is its own.
 * At 16 rows a block's arithmetic takes about as long as fetching it, and the hardware
 * prefetcher does not run far enough ahead to overlap the two: the first pass over a block asks
 * for the block AHEAD blocks on into L2. The default model's products at 16 rows (weights beyond
 * L3, 2-core Xeon): 67 ms a 60-layer pass without, 58 with; at one row unchanged (33). */
enum { AHEAD = 2 };

static inline __attribute__((always_inline)) void block(const float *restrict x, int64_t nx, const float *const w[4],
                                                        const float *ahead, int64_t k, float s[16]) {
    const int64_t vec = k - k % 16;
    __m512 acc[4][4];
    for (int64_t i = 0; i < nx; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < vec; d += 16) {
        if (ahead) {
            _mm_prefetch((const char *)(ahead + d), _MM_HINT_T1);
            _mm_prefetch((const char *)(ahead + k + d), _MM_HINT_T1);
            _mm_prefetch((const char *)(ahead + 2 * k + d), _MM_HINT_T1);
            _mm_prefetch((const char *)(ahead + 3 * k + d), _MM_HINT_T1);
        }
        const __m512 t0 = _mm512_loadu_ps(w[0] + d), t1 = _mm512_loadu_ps(w[1] + d),
                     t2 = _mm512_loadu_ps(w[2] + d), t3 = _mm512_loadu_ps(w[3] + d);
        for (int64_t i = 0; i < nx; i++) {
            const __m512 u = _mm512_loadu_ps(x + i * k + d);
            acc[i][0] = _mm512_fmadd_ps(u, t0, acc[i][0]), acc[i][1] = _mm512_fmadd_ps(u, t1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(u, t2, acc[i][2]), acc[i][3] = _mm512_fmadd_ps(u, t3, acc[i][3]);
        }
    }
    for (int64_t i = 0; i < nx; i++) {
        __m256 h[4];
        for (int j = 0; j < 4; j++)
            h[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[i][j]), _mm512_extractf32x8_ps(acc[i][j], 1));
        const __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
        _mm_storeu_ps(s + 4 * i, _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
        for (int j = 0; j < 4; j++)
            for (int64_t d = vec; d < k; d++) s[4 * i + j] = fmaf(x[i * k + d], w[j][d], s[4 * i + j]);
    }
}

/* Up to four input rows against w[0..3]; each count gets its own unrolled copy of block. */
static inline void group(const float *restrict x, int64_t nx, const float *const w[4], const float *ahead, int64_t k,
                         float s[16]) {
    if (nx == 4)
        block(x, 4, w, ahead, k, s);
    else if (nx == 3)
        block(x, 3, w, ahead, k, s);
    else if (nx == 2)
        block(x, 2, w, ahead, k, s);
    else
        block(x, 1, w, ahead, k, s);
}
enum { GROUP = 4 };
#elif CB_AVX2

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The last k % 8 products of a row, one fused multiply-add each (the same instructions for every row). */
static inline void tail(const float *restrict x, const float *const w[4], int64_t from, int64_t k, float s[4]) {
    for (int64_t d = from; d < k; d++)
        for (int j = 0; j < 4; j++) s[j] = fmaf(x[d], w[j][d], s[j]);
}

/* Two rows of x (xa, xb) against weight rows w[0..3]: eight dot products. */
static inline void block2(const float *restrict xa, const float *restrict xb, const float *const w[4], int64_t k,
                          float s[8]) {
    const int64_t vec = k - k % 8;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t d = 0; d < vec; d += 8) {
        const __m256 u = _mm256_loadu_ps(xa + d), v = _mm256_loadu_ps(xb + d);
        __m256 t = _mm256_loadu_ps(w[0] + d);
        a0 = _mm256_fmadd_ps(u, t, a0), b0 = _mm256_fmadd_ps(v, t, b0);
        t = _mm256_loadu_ps(w[1] + d);
        a1 = _mm256_fmadd_ps(u, t, a1), b1 = _mm256_fmadd_ps(v, t, b1);
        t = _mm256_loadu_ps(w[2] + d);
        a2 = _mm256_fmadd_ps(u, t, a2), b2 = _mm256_fmadd_ps(v, t, b2);
        t = _mm256_loadu_ps(w[3] + d);
        a3 = _mm256_fmadd_ps(u, t, a3), b3 = _mm256_fmadd_ps(v, t, b3);
    }
    s[0] = hsum(a0), s[1] = hsum(a1), s[2] = hsum(a2), s[3] = hsum(a3);
    s[4] = hsum(b0), s[5] = hsum(b1), s[6] = hsum(b2), s[7] = hsum(b3);
    tail(xa, w, vec, k, s);
    tail(xb, w, vec, k, s + 4);
}

/* One row of x against w[0..3], summed in the same order as a row of block2. */
static inline void block1(const float *restrict xa, const float *const w[4], int64_t k, float s[4]) {
    const int64_t vec = k - k % 8;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < vec; d += 8) {
        const __m256 u = _mm256_loadu_ps(xa + d);
        a0 = _mm256_fmadd_ps(u, _mm256_loadu_ps(w[0] + d), a0);
        a1 = _mm256_fmadd_ps(u, _mm256_loadu_ps(w[1] + d), a1);
        a2 = _mm256_fmadd_ps(u, _mm256_loadu_ps(w[2] + d), a2);
        a3 = _mm256_fmadd_ps(u, _mm256_loadu_ps(w[3] + d), a3);
    }
    s[0] = hsum(a0), s[1] = hsum(a1), s[2] = hsum(a2), s[3] = hsum(a3);
    tail(xa, w, vec, k, s);
}

/* Up to two input rows against w[0..3] (AVX2 has no room for more accumulators). */
static inline void group(const float *restrict x, int64_t nx, const float *const w[4], const float *ahead, int64_t k,
                         float s[16]) {
    (void)ahead;
    if (nx == 2)
        block2(x, x + k, w, k, s);
    else
        block1(x, w, k, s);
}
enum { GROUP = 2, AHEAD = 0 };
#endif

#if CB_AVX2
int cb_small_gemm(const float *restrict x, const float *restrict w, const float *restrict bias, float *restrict out,
                  int64_t m, int64_t n, int64_t k, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r0 = 0; r0 < n; r0 += 4) {
        const int64_t rows = n - r0 < 4 ? n - r0 : 4;
        /* A last block of fewer than four rows repeats its first row in the unused lanes. */
        const float *wr[4] = {w + r0 * k, w + (r0 + (rows > 1)) * k, w + (r0 + 2 * (rows > 2)) * k,
                              w + (r0 + 3 * (rows > 3)) * k};
        const float *next = AHEAD && r0 + 4 * AHEAD + 4 <= n ? w + (r0 + 4 * AHEAD) * k : NULL;
        for (int64_t i = 0; i < m; i += GROUP) {
            float s[16];
            const int64_t nx = m - i < GROUP ? m - i : GROUP;
            group(x + i * k, nx, wr, i == 0 ? next : NULL, k, s);
            for (int64_t a = 0; a < nx; a++)
                for (int64_t j = 0; j < rows; j++) out[(i + a) * n + r0 + j] = s[4 * a + j] + (bias ? bias[r0 + j] : 0.f);
        }
    }
    return 0;
}
#else
int cb_small_gemm(const float *x, const float *w, const float *bias, float *out, int64_t m, int64_t n, int64_t k,
                  int threads) {
    (void)x, (void)w, (void)bias, (void)out, (void)m, (void)n, (void)k, (void)threads;
    return 3;
}
#endif
