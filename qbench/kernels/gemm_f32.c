/* fp32 GEMM on panel-packed weights: y[M,N] = x[M,K] @ W[K,N] + bias.
 *
 * W is packed as (N/16, K, 16): each 16-column panel is contiguous, so a decode step
 * streams the weights sequentially once, and a tile of rows of x is multiplied against a
 * panel from registers. On a 2-core AVX2 machine this runs batch-1 decode at memory
 * bandwidth and small batches several times faster than MKL's small-M path. Threads split
 * the panels (OpenMP, the same runtime torch uses).
 *
 * Every output is one fused multiply-add chain over k = 0, 1, .., K-1 from zero, then + bias
 * (a zero vector without one), whatever the tile, the block or the instruction set: a ymm or
 * zmm lane is one output column, and a block over k stores its partial sums in y and takes
 * them up again exactly. So the AVX-512 tiles (qb_isa() == 512: up to 12 rows by two panels,
 * 24 zmm accumulators) give the AVX2 tiles' bits, a prefill gives a decode step's bits for the
 * same row, and a result does not depend on the CPU: the fixed order that makes a prefill
 * reproduce across machines (oneDNN's and MKL's blocking follows the CPU).
 */
#include <immintrin.h>
#include <omp.h>
#include <stddef.h>

#include "panel.h"

int qb_isa(void);

/* Large products run in blocks of KC values of k (a panel's block, 16 KiB, stays in L1 across the row tiles)
 * and MC rows (their KC columns of x, 120 KiB, stay in L2 across the panels). Below BLOCK_ROWS rows a call
 * streams each panel once, unblocked, as decode wants. */
#define KC 512
#define MC 120
#define BLOCK_ROWS 32

static inline void load_row(const float *y, __m256 *r0, __m256 *r1, long nvalid) {
    if (nvalid == PANEL) { *r0 = _mm256_loadu_ps(y); *r1 = _mm256_loadu_ps(y + 8); return; }
    float tmp[PANEL] = {0};
    for (long j = 0; j < nvalid; j++) tmp[j] = y[j];
    *r0 = _mm256_loadu_ps(tmp);
    *r1 = _mm256_loadu_ps(tmp + 8);
}

/* One tile of MT rows against one panel over kn values of k. first: the chains start at zero, else from the
 * partial sums in y; last: + bias and the final store. Inlined with a constant MT; the accumulators are named
 * scalars, not an array, so they stay in registers (12 at MT = 6). */
#define INIT(i) if (MT > i) { if (first) { c##i##0 = _mm256_setzero_ps(); c##i##1 = c##i##0; }             \
                              else load_row(y + i * ldy, &c##i##0, &c##i##1, nvalid); }
#define ROW(i) if (MT > i) { __m256 xb = _mm256_broadcast_ss(x + i * ldx + k);                          \
                             c##i##0 = _mm256_fmadd_ps(xb, w0, c##i##0);                                \
                             c##i##1 = _mm256_fmadd_ps(xb, w1, c##i##1); }
#define OUT(i) if (MT > i) { if (last) { c##i##0 = _mm256_add_ps(c##i##0, b0);                          \
                                         c##i##1 = _mm256_add_ps(c##i##1, b1); }                        \
                             store16(y + i * ldy, c##i##0, c##i##1, nvalid); }
static inline __attribute__((always_inline)) void tile_mt(const int MT, const float *x, long ldx, const float *w,
                                                         long kn, const __m256 b0, const __m256 b1, float *y,
                                                         long ldy, long nvalid, int first, int last) {
    __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
    INIT(0) INIT(1) INIT(2) INIT(3) INIT(4) INIT(5)
    for (long k = 0; k < kn; k++) {
        PREFETCH(w + k * PANEL);
        __m256 w0 = _mm256_loadu_ps(w + k * PANEL), w1 = _mm256_loadu_ps(w + k * PANEL + 8);
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
    }
    OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5)
}
#undef INIT
#undef ROW
#undef OUT

/* The bias of one panel, zero where there is none or past N (added either way: the same bits on every path). */
static inline void panel_bias(const float *bias, long nvalid, float *out) {
    for (int j = 0; j < PANEL; j++) out[j] = bias && j < nvalid ? bias[j] : 0.0f;
}

static void tile(const float *x, long ldx, const float *w, long kn, const float *bias, float *y, long ldy,
                 int mt, long nvalid, int first, int last) {
    float tmp[PANEL];
    panel_bias(bias, nvalid, tmp);
    __m256 b0 = _mm256_loadu_ps(tmp), b1 = _mm256_loadu_ps(tmp + 8);
    SWITCH_ROWS(mt, tile_mt, x, ldx, w, kn, b0, b1, y, ldy, nvalid, first, last)
}

/* AVX-512: MT rows (up to 12) against NP panels (1 or 2), one zmm per panel row, the same chains. */
#define AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,fma")))
#define MR512 12

static inline __attribute__((always_inline)) AVX512 void tile512_mt(
        const int MT, const int NP, const float *x, long ldx, const float *w, long pstride, long kn,
        const float *bias, float *y, long ldy, const long *nvalid, int first, int last) {
    __m512 c[MR512][2];
    __mmask16 m[2];
    for (int j = 0; j < NP; j++) m[j] = (__mmask16)(nvalid[j] >= PANEL ? 0xFFFF : (1u << nvalid[j]) - 1);
#pragma GCC unroll 12
    for (int i = 0; i < MT; i++)
#pragma GCC unroll 2
        for (int j = 0; j < NP; j++)
            c[i][j] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m[j], y + i * ldy + j * PANEL);
    const float *w1 = w + (NP > 1 ? pstride : 0);
    for (long k = 0; k < kn; k++) {
        PREFETCH(w + k * PANEL);
        if (NP > 1) PREFETCH(w1 + k * PANEL);
        __m512 v0 = _mm512_loadu_ps(w + k * PANEL), v1 = _mm512_loadu_ps(w1 + k * PANEL);
#pragma GCC unroll 12
        for (int i = 0; i < MT; i++) {
            __m512 xb = _mm512_set1_ps(x[i * ldx + k]);
            c[i][0] = _mm512_fmadd_ps(xb, v0, c[i][0]);
            if (NP > 1) c[i][1] = _mm512_fmadd_ps(xb, v1, c[i][1]);
        }
    }
    __m512 b[2];
#pragma GCC unroll 2
    for (int j = 0; j < NP; j++) {
        float tmp[PANEL];
        panel_bias(bias ? bias + j * PANEL : NULL, nvalid[j], tmp);
        b[j] = _mm512_loadu_ps(tmp);
    }
#pragma GCC unroll 12
    for (int i = 0; i < MT; i++)
#pragma GCC unroll 2
        for (int j = 0; j < NP; j++)
            _mm512_mask_storeu_ps(y + i * ldy + j * PANEL, m[j], last ? _mm512_add_ps(c[i][j], b[j]) : c[i][j]);
}

#define T512(MT) case MT: if (np == 2) tile512_mt(MT, 2, x, ldx, w, pstride, kn, bias, y, ldy, nvalid, first, last); \
                          else tile512_mt(MT, 1, x, ldx, w, pstride, kn, bias, y, ldy, nvalid, first, last); break;
static AVX512 void tile512(const float *x, long ldx, const float *w, long pstride, long kn, const float *bias,
                           float *y, long ldy, int mt, int np, const long *nvalid, int first, int last) {
    switch (mt) { T512(12) T512(11) T512(10) T512(9) T512(8) T512(7) T512(6) T512(5) T512(4) T512(3) T512(2)
                  default: T512(1) }
}
#undef T512

/* Rows [r0, r0 + rows) against panels [p, p + np) over k in [k0, k0 + kn): the tiles of one block. */
static inline void panel_block(const float *x, const float *wp, const float *bias, float *y, long K, long N,
                               long ldy, int wide, long cap, long p, int np, long k0, long kn, long r0, long rows,
                               int first, int last) {
    const float *w = wp + p * K * PANEL + k0 * PANEL;
    long n0 = p * PANEL;
    long nvalid[2] = {N - n0 < PANEL ? N - n0 : PANEL, 0};
    if (np == 2) nvalid[1] = N - n0 - PANEL < PANEL ? N - n0 - PANEL : PANEL;
    const float *b = bias ? bias + n0 : NULL;
    for (long m0 = 0, t = 0; m0 < rows; m0 += split_rows(rows, t++, cap)) {
        int mt = (int)split_rows(rows, t, cap);
        const float *xt = x + (r0 + m0) * K + k0;
        float *yt = y + (r0 + m0) * ldy + n0;
        if (wide) tile512(xt, K, w, K * PANEL, kn, b, yt, ldy, mt, np, nvalid, first, last);
        else tile(xt, K, w, kn, b, yt, ldy, mt, nvalid[0], first, last);
    }
}

/* x (M, K) row-major, wp (ceil(N/16), K, 16), bias (N) or NULL, y (M, N) with rows ldy floats apart (a slab of
 * a wider output's columns). Blocks run k-block by k-block over all of a thread's panels, so that an x block
 * stays in L2 across them, unless all of x fits in L2 (a batched decode step): then each panel takes all its
 * k-blocks in turn, its output tile stays in L1 between them, and a weight too large for the caches (an output
 * head) streams from memory once, in order. Before, SmolLM2's head at 32 rows (K = 576: blocks of 512 and 64)
 * took its last 64 k of every panel in a second pass, 4 KiB in each 36 KiB, with the 6 MiB output reloaded:
 * 78-82 GMAC/s against 81-92 now on a 2-core Zen 4 (the layers' shapes 93-102 either way). Each output's FMA
 * chain over k is the same either way. */
#define X_IN_L2 (256 * 1024)
void qb_gemm_f32_panels(const float *x, const float *wp, const float *bias, float *y,
                        long M, long K, long N, long ldy, int nthreads) {
    long npanels = (N + PANEL - 1) / PANEL;
    const int wide = qb_isa() == 512;
    const long kc = M >= BLOCK_ROWS ? KC : (K > 0 ? K : 1), mc = M >= BLOCK_ROWS ? MC : M;
    const long cap = wide ? MR512 : 6, nkb = K > 0 ? (K + kc - 1) / kc : 1;
    const int panel_major = M <= mc && M * K * (long)sizeof(float) <= X_IN_L2;
    #pragma omp parallel num_threads(nthreads)
    {
        long nt = omp_get_num_threads(), id = omp_get_thread_num();
        long p0 = npanels * id / nt, p1 = npanels * (id + 1) / nt;
#define STEP(p) (wide && (p) + 1 < p1 ? 2 : 1)
#define KN(kb) (K - (kb) * kc < kc ? K - (kb) * kc : kc)
        if (panel_major) {
            for (long p = p0; p < p1; p += STEP(p))
                for (long kb = 0; kb < nkb; kb++)
                    panel_block(x, wp, bias, y, K, N, ldy, wide, cap, p, STEP(p), kb * kc, KN(kb), 0, M, kb == 0,
                                kb == nkb - 1);
        } else {
            for (long kb = 0; kb < nkb; kb++)
                for (long r0 = 0; r0 < M; r0 += mc)
                    for (long p = p0; p < p1; p += STEP(p))
                        panel_block(x, wp, bias, y, K, N, ldy, wide, cap, p, STEP(p), kb * kc, KN(kb), r0,
                                    M - r0 < mc ? M - r0 : mc, kb == 0, kb == nkb - 1);
        }
#undef STEP
#undef KN
    }
}

/* y (M, N) row-major. */
void qb_gemm_f32_packed(const float *x, const float *wp, const float *bias, float *y,
                        long M, long K, long N, int nthreads) {
    qb_gemm_f32_panels(x, wp, bias, y, M, K, N, N, nthreads);
}
