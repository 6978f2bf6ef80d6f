/* Small-M fp32 GEMM on panel-packed weights: y[M,N] = x[M,K] @ W[K,N] + bias.
 *
 * W is packed as (N/16, K, 16): each 16-column panel is contiguous, so a decode step
 * streams the weights sequentially once, and a tile of up to 6 rows of x is multiplied
 * against a panel from registers (12 accumulators). On a 2-core AVX2 machine this runs
 * batch-1 decode at memory bandwidth and small batches several times faster than MKL's
 * small-M path. Threads split the panels (OpenMP, the same runtime torch uses).
 */
#include <immintrin.h>
#include <stddef.h>

#include "panel.h"

static inline void store_row(float *y, __m256 r0, __m256 r1, const __m256 b0, const __m256 b1, long nvalid) {
    store16(y, _mm256_add_ps(r0, b0), _mm256_add_ps(r1, b1), nvalid);
}

/* One tile of MT rows against one panel. Inlined with a constant MT; the accumulators
 * are named scalars, not an array, so they stay in registers (12 at MT = 6). */
#define ROW(i) if (MT > i) { __m256 xb = _mm256_broadcast_ss(x + i * ldx + k);          \
                             c##i##0 = _mm256_fmadd_ps(xb, w0, c##i##0);                \
                             c##i##1 = _mm256_fmadd_ps(xb, w1, c##i##1); }
#define OUT(i) if (MT > i) store_row(y + i * ldy, c##i##0, c##i##1, b0, b1, nvalid);
static inline __attribute__((always_inline)) void tile_mt(const int MT, const float *x, long ldx, const float *w,
                                                         long K, const __m256 b0, const __m256 b1, float *y,
                                                         long ldy, long nvalid) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
           c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (long k = 0; k < K; k++) {
        PREFETCH(w + k * PANEL);
        __m256 w0 = _mm256_loadu_ps(w + k * PANEL), w1 = _mm256_loadu_ps(w + k * PANEL + 8);
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
    }
    OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5)
}
#undef ROW
#undef OUT

static void tile(const float *x, long ldx, const float *w, long K, const float *bias,
                 float *y, long ldy, int mt, long nvalid) {
    __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
    if (bias) {
        float tmp[PANEL];
        for (int j = 0; j < PANEL; j++) tmp[j] = j < nvalid ? bias[j] : 0.0f;
        b0 = _mm256_loadu_ps(tmp);
        b1 = _mm256_loadu_ps(tmp + 8);
    }
    SWITCH_ROWS(mt, tile_mt, x, ldx, w, K, b0, b1, y, ldy, nvalid)
}

/* x (M, K) row-major, wp (ceil(N/16), K, 16), bias (N) or NULL, y (M, N) row-major. */
void qb_gemm_f32_packed(const float *x, const float *wp, const float *bias, float *y,
                        long M, long K, long N, int nthreads) {
    long npanels = (N + PANEL - 1) / PANEL;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long p = 0; p < npanels; p++) {
        const float *w = wp + p * K * PANEL;
        long n0 = p * PANEL;
        long nvalid = N - n0 < PANEL ? N - n0 : PANEL;
        for (long m0 = 0, t = 0; m0 < M; m0 += tile_rows(M, t++)) {
            int mt = (int)tile_rows(M, t);
            tile(x + m0 * K, K, w, K, bias ? bias + n0 : NULL, y + m0 * N + n0, N, mt, nvalid);
        }
    }
}
