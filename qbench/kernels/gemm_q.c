/* Weight-only INT8 and INT4 GEMM with fp32 activations, on panel-packed weights.
 *
 * torch's _weight_int8pack_mm / _weight_int4pack_mm_for_cpu are fast only with bf16
 * activations, and this class of CPU has no bf16 arithmetic (a bf16 matmul runs at about
 * 1 GFLOP/s here); these kernels unpack integers to fp32 in registers instead.
 *
 * INT8: panel p holds (K, 16) int8; one fp32 scale per output column, applied once at the end.
 * INT4: panel p holds (K, 8) bytes, byte j of row k = column j (low nibble) | column j+8 (high
 * nibble), unsigned codes u in [0, 15]; per group of G rows, 16 fp16 scales and 16 uint8 zero
 * points. A group's integer dot products are accumulated first and its scale is applied once
 * per group (the seeds): y += s * (sum_k x_k u_k - z * sum_k x_k).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "panel.h"

#define ROW8(i) if (MT > i) { __m256 xb = _mm256_broadcast_ss(x + i * K + k);      \
                              c##i##0 = _mm256_fmadd_ps(xb, w0, c##i##0);          \
                              c##i##1 = _mm256_fmadd_ps(xb, w1, c##i##1); }
#define OUT8(i) if (MT > i) store16(y + i * N, _mm256_mul_ps(c##i##0, s0), _mm256_mul_ps(c##i##1, s1), nvalid);

static inline __attribute__((always_inline)) void tile_i8(const int MT, const float *x, const int8_t *w, long K,
                                                         const float *scale, float *y, long N, long nvalid) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
           c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (long k = 0; k < K; k++) {
        __m128i b = _mm_loadu_si128((const __m128i *)(w + k * PANEL));
        __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
        ROW8(0) ROW8(1) ROW8(2) ROW8(3) ROW8(4) ROW8(5)
    }
    __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
    OUT8(0) OUT8(1) OUT8(2) OUT8(3) OUT8(4) OUT8(5)
}

#define ROW8U(i) if (MT > i) { __m256 xa = _mm256_broadcast_ss(x + i * K + k);                   \
                               __m256 xb = _mm256_broadcast_ss(x + i * K + k + 1);               \
                               a##i##0 = _mm256_fmadd_ps(xa, wa0, a##i##0);                      \
                               a##i##1 = _mm256_fmadd_ps(xa, wa1, a##i##1);                      \
                               b##i##0 = _mm256_fmadd_ps(xb, wb0, b##i##0);                      \
                               b##i##1 = _mm256_fmadd_ps(xb, wb1, b##i##1); }
#define OUT8U(i) if (MT > i) store16(y + i * N, _mm256_mul_ps(_mm256_add_ps(a##i##0, b##i##0), s0),     \
                                     _mm256_mul_ps(_mm256_add_ps(a##i##1, b##i##1), s1), nvalid);

static inline void unpack16_i8(const int8_t *w, __m256 *w0, __m256 *w1) {
    __m128i b = _mm_loadu_si128((const __m128i *)w);
    *w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    *w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}

/* one or two rows, k unrolled by two: batch-1 decode is otherwise FMA-latency-bound */
static inline __attribute__((always_inline)) void tile_i8_small(const int MT, const float *x, const int8_t *w,
                                                               long K, const float *scale, float *y, long N,
                                                               long nvalid) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, b00 = a00, b01 = a00, b10 = a00, b11 = a00;
    long k = 0;
    for (; k + 2 <= K; k += 2) {
        __m256 wa0, wa1, wb0, wb1;
        unpack16_i8(w + k * PANEL, &wa0, &wa1);
        unpack16_i8(w + (k + 1) * PANEL, &wb0, &wb1);
        ROW8U(0) ROW8U(1)
    }
    if (k < K) {
        __m256 wa0, wa1, wb0 = _mm256_setzero_ps(), wb1 = wb0;
        unpack16_i8(w + k * PANEL, &wa0, &wa1);
        for (int i = 0; i < MT; i++) {
            __m256 xa = _mm256_broadcast_ss(x + i * K + k);
            if (i == 0) { a00 = _mm256_fmadd_ps(xa, wa0, a00); a01 = _mm256_fmadd_ps(xa, wa1, a01); }
            else { a10 = _mm256_fmadd_ps(xa, wa0, a10); a11 = _mm256_fmadd_ps(xa, wa1, a11); }
        }
        (void)wb0; (void)wb1;
    }
    __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
    OUT8U(0) OUT8U(1)
}

/* x (M, K) fp32; wp (P, K, 16) int8; scale (P * 16) fp32 (padded); y (M, N). */
void qb_gemm_i8(const float *x, const int8_t *wp, const float *scale, float *y, long M, long K, long N,
                int nthreads) {
    long npanels = (N + PANEL - 1) / PANEL;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long p = 0; p < npanels; p++) {
        const int8_t *w = wp + p * K * PANEL;
        long n0 = p * PANEL, nvalid = N - n0 < PANEL ? N - n0 : PANEL;
        if (M <= 2) {
            if (M == 2) tile_i8_small(2, x, w, K, scale + n0, y + n0, N, nvalid);
            else tile_i8_small(1, x, w, K, scale + n0, y + n0, N, nvalid);
            continue;
        }
        for (long m0 = 0, t = 0; m0 < M; m0 += tile_rows(M, t++)) {
            long mt = tile_rows(M, t);
            const float *xm = x + m0 * K;
            float *ym = y + m0 * N + n0;
            switch (mt) {
                case 6: tile_i8(6, xm, w, K, scale + n0, ym, N, nvalid); break;
                case 5: tile_i8(5, xm, w, K, scale + n0, ym, N, nvalid); break;
                case 4: tile_i8(4, xm, w, K, scale + n0, ym, N, nvalid); break;
                case 3: tile_i8(3, xm, w, K, scale + n0, ym, N, nvalid); break;
                case 2: tile_i8(2, xm, w, K, scale + n0, ym, N, nvalid); break;
                default: tile_i8(1, xm, w, K, scale + n0, ym, N, nvalid); break;
            }
        }
    }
}

static inline void unpack16(const uint8_t *w, __m256 *w0, __m256 *w1) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i b = _mm_loadl_epi64((const __m128i *)w);
    __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    *w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    *w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
}

/* Rows of x are fed two k at a time into separate accumulators (a: even k, b: odd k), so the
 * FMA dependency chains are twice as many and a batch-1 decode is not latency-bound. */
#define ROW4(i) if (MT > i) { __m256 xa = _mm256_broadcast_ss(x + i * K + k);                    \
                              __m256 xb = _mm256_broadcast_ss(x + i * K + k + 1);                \
                              a##i##0 = _mm256_fmadd_ps(xa, wa0, a##i##0);                       \
                              a##i##1 = _mm256_fmadd_ps(xa, wa1, a##i##1);                       \
                              b##i##0 = _mm256_fmadd_ps(xb, wb0, b##i##0);                       \
                              b##i##1 = _mm256_fmadd_ps(xb, wb1, b##i##1); }
#define TAIL4(i) if (MT > i) { __m256 xa = _mm256_broadcast_ss(x + i * K + k);                   \
                               a##i##0 = _mm256_fmadd_ps(xa, wa0, a##i##0);                      \
                               a##i##1 = _mm256_fmadd_ps(xa, wa1, a##i##1); }
/* close a group: acc += s * (sum_k x_k u_k - z * sum_k x_k) */
#define CLOSE4(i) if (MT > i) { __m256 xs = _mm256_set1_ps(xsum[i * ngroups + gi]);                     \
                                __m256 g0 = _mm256_add_ps(a##i##0, b##i##0), g1 = _mm256_add_ps(a##i##1, b##i##1); \
                                c##i##0 = _mm256_fmadd_ps(s0, _mm256_fnmadd_ps(z0, xs, g0), c##i##0); \
                                c##i##1 = _mm256_fmadd_ps(s1, _mm256_fnmadd_ps(z1, xs, g1), c##i##1); }
#define OUT4(i) if (MT > i) store16(y + i * N, c##i##0, c##i##1, nvalid);

static inline __attribute__((always_inline)) void tile_i4(const int MT, const float *x, const float *xsum,
                                                         const uint8_t *w, const uint16_t *sc, const uint8_t *zp,
                                                         long K, long G, long ngroups, float *y, long N,
                                                         long nvalid) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00;
    for (long gi = 0; gi < ngroups; gi++) {
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00;
        __m256 b00 = a00, b01 = a00, b10 = a00, b11 = a00;
        long k = gi * G, k1 = (gi + 1) * G < K ? (gi + 1) * G : K;
        for (; k + 2 <= k1; k += 2) {
            __m256 wa0, wa1, wb0, wb1;
            unpack16(w + k * (PANEL / 2), &wa0, &wa1);
            unpack16(w + (k + 1) * (PANEL / 2), &wb0, &wb1);
            ROW4(0) ROW4(1)
        }
        if (k < k1) {
            __m256 wa0, wa1;
            unpack16(w + k * (PANEL / 2), &wa0, &wa1);
            TAIL4(0) TAIL4(1)
        }
        __m128i sh = _mm_loadu_si128((const __m128i *)(sc + gi * PANEL));
        __m128i sh2 = _mm_loadu_si128((const __m128i *)(sc + gi * PANEL + 8));
        __m256 s0 = _mm256_cvtph_ps(sh), s1 = _mm256_cvtph_ps(sh2);
        __m128i zb = _mm_loadu_si128((const __m128i *)(zp + gi * PANEL));
        __m256 z0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(zb));
        __m256 z1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(zb, 8)));
        CLOSE4(0) CLOSE4(1)
    }
    OUT4(0) OUT4(1)
}

/* Up to six rows against one panel for prefill and larger batches: each unpacked weight vector
 * feeds six rows, so the unpack cost is amortised. The per-group accumulators stay in registers
 * (12 at MT = 6) and the running result lives in y, updated once per group. */
#define ROWW(i) if (MT > i) { __m256 xb = _mm256_broadcast_ss(x + i * K + k);                    \
                              g##i##0 = _mm256_fmadd_ps(xb, w0, g##i##0);                        \
                              g##i##1 = _mm256_fmadd_ps(xb, w1, g##i##1); }
#define CLOSEW(i) if (MT > i) { __m256 xs = _mm256_set1_ps(xsum[i * ngroups + gi]);                   \
                                float *yr = acc + i * PANEL;                                          \
                                _mm256_storeu_ps(yr, _mm256_fmadd_ps(s0, _mm256_fnmadd_ps(z0, xs, g##i##0), \
                                                                     _mm256_loadu_ps(yr)));           \
                                _mm256_storeu_ps(yr + 8, _mm256_fmadd_ps(s1, _mm256_fnmadd_ps(z1, xs, g##i##1), \
                                                                         _mm256_loadu_ps(yr + 8))); }

static inline __attribute__((always_inline)) void tile_i4_wide(const int MT, const float *x, const float *xsum,
                                                              const uint8_t *w, const uint16_t *sc,
                                                              const uint8_t *zp, long K, long G, long ngroups,
                                                              float *y, long N, long nvalid) {
    float acc[6 * PANEL] = {0};
    for (long gi = 0; gi < ngroups; gi++) {
        __m256 g00 = _mm256_setzero_ps(), g01 = g00, g10 = g00, g11 = g00, g20 = g00, g21 = g00,
               g30 = g00, g31 = g00, g40 = g00, g41 = g00, g50 = g00, g51 = g00;
        long k1 = (gi + 1) * G < K ? (gi + 1) * G : K;
        for (long k = gi * G; k < k1; k++) {
            __m256 w0, w1;
            unpack16(w + k * (PANEL / 2), &w0, &w1);
            ROWW(0) ROWW(1) ROWW(2) ROWW(3) ROWW(4) ROWW(5)
        }
        __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + gi * PANEL)));
        __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + gi * PANEL + 8)));
        __m128i zb = _mm_loadu_si128((const __m128i *)(zp + gi * PANEL));
        __m256 z0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(zb));
        __m256 z1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(zb, 8)));
        CLOSEW(0) CLOSEW(1) CLOSEW(2) CLOSEW(3) CLOSEW(4) CLOSEW(5)
    }
    for (int i = 0; i < MT; i++)
        store16(y + i * N, _mm256_loadu_ps(acc + i * PANEL), _mm256_loadu_ps(acc + i * PANEL + 8), nvalid);
}

/* x (M, K) fp32; wp (P, K, 8) uint8; scales (P, ngroups, 16) fp16;
 * zeros (P, ngroups, 16) uint8; y (M, N). */
void qb_gemm_i4(const float *x, const uint8_t *wp, const uint16_t *scales, const uint8_t *zeros,
                float *y, long M, long K, long N, long G, int nthreads) {
    long npanels = (N + PANEL - 1) / PANEL;
    long ngroups = (K + G - 1) / G;
    /* each group's sum of x, once per call, for the zero-point term */
    float *xsum = (float *)malloc(sizeof(float) * (M * ngroups + 1));
    for (long m = 0; m < M; m++)
        for (long gi = 0; gi < ngroups; gi++) {
            float acc = 0.0f;
            long k1 = (gi + 1) * G < K ? (gi + 1) * G : K;
            for (long k = gi * G; k < k1; k++) acc += x[m * K + k];
            xsum[m * ngroups + gi] = acc;
        }
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long p = 0; p < npanels; p++) {
        const uint8_t *w = wp + p * K * (PANEL / 2);
        const uint16_t *sc = scales + p * ngroups * PANEL;
        const uint8_t *zp = zeros + p * ngroups * PANEL;
        long n0 = p * PANEL, nvalid = N - n0 < PANEL ? N - n0 : PANEL;
        if (M <= 2) {  /* decode: k unrolled by two so the FMA chains are not latency-bound */
            if (M == 2) tile_i4(2, x, xsum, w, sc, zp, K, G, ngroups, y + n0, N, nvalid);
            else tile_i4(1, x, xsum, w, sc, zp, K, G, ngroups, y + n0, N, nvalid);
            continue;
        }
        for (long m0 = 0, t = 0; m0 < M; m0 += tile_rows(M, t++)) {
            const float *xm = x + m0 * K, *xs = xsum + m0 * ngroups;
            float *ym = y + m0 * N + n0;
            switch (tile_rows(M, t)) {
                case 6: tile_i4_wide(6, xm, xs, w, sc, zp, K, G, ngroups, ym, N, nvalid); break;
                case 5: tile_i4_wide(5, xm, xs, w, sc, zp, K, G, ngroups, ym, N, nvalid); break;
                case 4: tile_i4_wide(4, xm, xs, w, sc, zp, K, G, ngroups, ym, N, nvalid); break;
                case 3: tile_i4_wide(3, xm, xs, w, sc, zp, K, G, ngroups, ym, N, nvalid); break;
                case 2: tile_i4(2, xm, xs, w, sc, zp, K, G, ngroups, ym, N, nvalid); break;
                default: tile_i4(1, xm, xs, w, sc, zp, K, G, ngroups, ym, N, nvalid); break;
            }
        }
    }
    free(xsum);
}
