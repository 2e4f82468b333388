/* A linear layer for few rows, on the CPU: y = x W^T + b, streaming W once.
 *
 * A decode step multiplies a handful of rows by every weight matrix. The BLAS
 * treats that as a small matrix product and, on some CPUs, picks kernels that
 * cost several times what reading the weights costs (on a 2-core AVX2 machine
 * with MKL, 3 rows take 2.3x one row). Here eight weight rows at a time are
 * read from memory (eight streams at once: one core needs that many in flight
 * to approach the memory's bandwidth) and dotted with each input row in turn,
 * the later rows finding those weights in the core's caches. A step then
 * costs about what streaming the weights costs, up to a dozen or more rows.
 *
 * Every output element is summed in the same order whatever the number of
 * rows (8 lanes over k, the lanes added in order, the k remainder, the bias),
 * so a row's result does not depend on the rows beside it in the step.
 *
 * Shapes (contiguous, float32): x [rows, in], w [out, in], b [out] or NULL,
 * y [rows, out]. Returns 0.
 */
#include <stdint.h>

typedef float v8 __attribute__((vector_size(32)));

enum { BLOCK = 8 }; /* weight rows read together */

static inline v8 load8(const float *p) {
    v8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

int cb_skinny_linear_f32(const float *x, const float *w, const float *b, float *y, int64_t rows, int64_t out,
                         int64_t in, int threads) {
    const int64_t in8 = in - in % 8;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n0 = 0; n0 < out; n0 += BLOCK) {
        const int64_t nn = out - n0 < BLOCK ? out - n0 : BLOCK;
        const float *wr[BLOCK]; /* past the last weight row, repeat the block's first: summed, never stored */
        for (int j = 0; j < BLOCK; j++) wr[j] = w + (n0 + (j < nn ? j : 0)) * in;
        for (int64_t m = 0; m < rows; m++) {
            const float *xm = x + m * in;
            v8 acc[BLOCK] = {{0}};
            for (int64_t k = 0; k < in8; k += 8) {
                const v8 xv = load8(xm + k);
                for (int j = 0; j < BLOCK; j++) acc[j] += xv * load8(wr[j] + k);
            }
            for (int64_t j = 0; j < nn; j++) {
                float s = 0.f;
                for (int i = 0; i < 8; i++) s += acc[j][i];
                for (int64_t k = in8; k < in; k++) s += xm[k] * wr[j][k];
                y[m * out + n0 + j] = b ? s + b[n0 + j] : s;
            }
        }
    }
    return 0;
}
