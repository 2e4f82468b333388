/* What cbcore's C kernels share: CB_AVX2 (1 where the compiler targets AVX2 with FMA, else 0: the
 * kernels' plain loops run), CB_AVX512 (1 where it also targets AVX-512F), exp8 (and exp16 with AVX-512),
 * and the attention kernels' loops. Which of them a build targets is chosen when it is compiled
 * (cbcore/kernels/native.py: the machine's own, or a narrower set asked for).
 *
 * exp8: e^x for eight floats at once. x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6
 * polynomial (Cephes' expf coefficients), times 2^n through the exponent bits. Within 1 ulp of expf on [-86.5, 88] (checked at every 1e-6 step);
 * 0 below -86.5 (e^x < 3e-38) and e^88 above 88, where e^x nears float's largest value.
 */
#ifndef CBCORE_SIMD_H
#define CBCORE_SIMD_H
#include <math.h>
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CB_AVX2 1

static inline __m256 exp8(__m256 x) {
    const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-86.5f), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-86.5f)), _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}
#else
#define CB_AVX2 0
#endif
#if CB_AVX2 && defined(__AVX512F__) && defined(__AVX512DQ__)
#define CB_AVX512 1
#else
#define CB_AVX512 0
#endif

#if CB_AVX512
/* exp8's arithmetic on sixteen floats. */
static inline __m512 exp16(__m512 x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-86.5f), _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-86.5f)), _mm512_set1_ps(88.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~tiny, p, _mm512_castsi512_ps(bits));
}

/* Sixteen horizontal sums at once: lane j of the result is the sum of a[j]'s lanes (a transposing
 * reduction, 45 operations instead of sixteen separate reductions). */
static inline __m512 sums16(const __m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) /* per 128-bit quarter: a[2i] lanes 0+2, a[2i+1] 0+2, a[2i] 1+3, a[2i+1] 1+3 */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per quarter: the quarter's sum for a[4i .. 4i + 3] */
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* quarters 0+1 and 2+3 of c[2i], then of c[2i + 1] */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

/* y[0:n] += sum over `count` rows of w[l] * v[l * stride + 0:n] (n a multiple of 16), 64 floats of y at
 * a time in registers, each value row read front to back once per 64. */
static inline void add_weighted16(float *restrict y, const float *restrict w, const float *restrict v, int64_t stride,
                                  int64_t count, int64_t n) {
    int64_t d = 0;
    for (; d + 64 <= n; d += 64) {
        __m512 a0 = _mm512_loadu_ps(y + d), a1 = _mm512_loadu_ps(y + d + 16), a2 = _mm512_loadu_ps(y + d + 32),
               a3 = _mm512_loadu_ps(y + d + 48);
        const float *x = v + d;
        for (int64_t l = 0; l < count; l++, x += stride) {
            const __m512 p = _mm512_set1_ps(w[l]);
            a0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(x), a0), a1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(x + 16), a1);
            a2 = _mm512_fmadd_ps(p, _mm512_loadu_ps(x + 32), a2), a3 = _mm512_fmadd_ps(p, _mm512_loadu_ps(x + 48), a3);
        }
        _mm512_storeu_ps(y + d, a0), _mm512_storeu_ps(y + d + 16, a1);
        _mm512_storeu_ps(y + d + 32, a2), _mm512_storeu_ps(y + d + 48, a3);
    }
    for (; d < n; d += 16) {
        __m512 a = _mm512_loadu_ps(y + d);
        const float *x = v + d;
        for (int64_t l = 0; l < count; l++, x += stride) a = _mm512_fmadd_ps(_mm512_set1_ps(w[l]), _mm512_loadu_ps(x), a);
        _mm512_storeu_ps(y + d, a);
    }
}
#endif

/* The attention kernels' inner loops (paged_decode.c, prompt_attention.c): a dot product, y += p x,
 * with AVX2 eight keys' scores at once and a weighted sum of value rows; and an unnormalised softmax. */
static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

static inline void add_scaled(float *restrict y, float p, const float *restrict x, int64_t n) {
#pragma omp simd
    for (int64_t d = 0; d < n; d++) y[d] += p * x[d];
}

#if CB_AVX2
/* Eight keys' dot products with one query at once (head_dim a multiple of 8): eight independent
 * accumulators, then one transposing reduction, instead of eight dependent chains and eight
 * horizontal sums. */
static inline __m256 dot8(const float *restrict q, const float *restrict k, int64_t stride, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < n; d += 8) {
        const __m256 x = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + d), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + stride + d), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 2 * stride + d), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 3 * stride + d), a3);
        a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 4 * stride + d), a4);
        a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 5 * stride + d), a5);
        a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 6 * stride + d), a6);
        a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 7 * stride + d), a7);
    }
    const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    const __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* y[0:n] += sum over `count` keys of w[l] * v[l * stride + 0:n] (n a multiple of 8). Key by key, so each
 * value record is read front to back once; 64 floats of y at a time stay in registers. */
static inline void add_weighted8(float *restrict y, const float *restrict w, const float *restrict v, int64_t stride,
                                 int64_t count, int64_t n) {
    int64_t d = 0;
    for (; d + 64 <= n; d += 64) {
        __m256 a0 = _mm256_loadu_ps(y + d), a1 = _mm256_loadu_ps(y + d + 8), a2 = _mm256_loadu_ps(y + d + 16),
               a3 = _mm256_loadu_ps(y + d + 24), a4 = _mm256_loadu_ps(y + d + 32), a5 = _mm256_loadu_ps(y + d + 40),
               a6 = _mm256_loadu_ps(y + d + 48), a7 = _mm256_loadu_ps(y + d + 56);
        const float *x = v + d;
        for (int64_t l = 0; l < count; l++, x += stride) {
            const __m256 p = _mm256_broadcast_ss(w + l);
            a0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(x), a0);
            a1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(x + 8), a1);
            a2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(x + 16), a2);
            a3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(x + 24), a3);
            a4 = _mm256_fmadd_ps(p, _mm256_loadu_ps(x + 32), a4);
            a5 = _mm256_fmadd_ps(p, _mm256_loadu_ps(x + 40), a5);
            a6 = _mm256_fmadd_ps(p, _mm256_loadu_ps(x + 48), a6);
            a7 = _mm256_fmadd_ps(p, _mm256_loadu_ps(x + 56), a7);
        }
        _mm256_storeu_ps(y + d, a0), _mm256_storeu_ps(y + d + 8, a1), _mm256_storeu_ps(y + d + 16, a2);
        _mm256_storeu_ps(y + d + 24, a3), _mm256_storeu_ps(y + d + 32, a4), _mm256_storeu_ps(y + d + 40, a5);
        _mm256_storeu_ps(y + d + 48, a6), _mm256_storeu_ps(y + d + 56, a7);
    }
    for (; d < n; d += 8) {
        __m256 a = _mm256_loadu_ps(y + d);
        const float *x = v + d;
        for (int64_t l = 0; l < count; l++, x += stride) a = _mm256_fmadd_ps(_mm256_broadcast_ss(w + l), _mm256_loadu_ps(x), a);
        _mm256_storeu_ps(y + d, a);
    }
}


/* The largest and the sum of eight lanes. */
static inline float max8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

static inline float sum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
#endif

/* Softmax of w[0:n] in place, unnormalised; returns the sum that normalises it. */
static inline float softmax_weights(float *restrict w, int64_t n) {
    float max = -INFINITY, sum = 0.f;
    for (int64_t l = 0; l < n; l++) max = w[l] > max ? w[l] : max;
    int64_t l = 0;
#if CB_AVX2
    __m256 total = _mm256_setzero_ps();
    for (; l + 8 <= n; l += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(w + l), _mm256_set1_ps(max)));
        _mm256_storeu_ps(w + l, e);
        total = _mm256_add_ps(total, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, total);
    for (int i = 0; i < 8; i++) sum += lanes[i];
#endif
    for (; l < n; l++) {
        w[l] = expf(w[l] - max);
        sum += w[l];
    }
    return sum;
}

#endif
