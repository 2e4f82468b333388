/* What cbcore's C kernels share: CB_AVX2 (1 where the compiler targets AVX2 with FMA, else 0: the
 * kernels' plain loops run), CB_AVX512 (1 where it also targets AVX-512F) and, with AVX2, exp8.
 *
 * exp8: e^x for eight floats at once. x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6
 * polynomial (Cephes' expf coefficients), times 2^n through the exponent bits. Within 1 ulp of expf on [-86.5, 88] (checked at every 1e-6 step);
 * 0 below -86.5 (e^x < 3e-38) and e^88 above 88, where e^x nears float's largest value.
 */
#ifndef CBCORE_SIMD_H
#define CBCORE_SIMD_H
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
#if CB_AVX2 && defined(__AVX512F__)
#define CB_AVX512 1
#else
#define CB_AVX512 0
#endif
#endif
