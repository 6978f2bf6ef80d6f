/* Weight-only INT8 and INT4 GEMM with fp32 activations, on panel-packed weights.
 *
 * torch's _weight_int8pack_mm / _weight_int4pack_mm_for_cpu are fast only with bf16
 * activations, and this class of CPU has no bf16 arithmetic (a bf16 matmul runs at about
 * 1 GFLOP/s here); these kernels unpack integers to fp32 in registers instead.
 *
 * INT8: panel p holds (K, 16) int8; one fp32 scale per output column, applied once at the end. With
 * AVX-512 (qb_isa() == 512) a panel row is one zmm; the AVX2 tiles serve the other CPUs, with the same bits.
 * FP8 (e4m3, qb_gemm_f8): the same layout and tiles with bytes widened as FP8 (panel.h, widen16), on AVX2 on
 * every CPU.
 * INT4: unsigned codes u in [0, 15], 16 fp16 scales and 16 uint8 zero points per (panel, group);
 * a group's integer dot products are accumulated first and its scale is applied once per group
 * (the seeds): y += s * (sum_k x_k u_k - z * sum_k x_k). See qb_gemm_i4 for its layout.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "panel.h"

#define ROW8(i) if (MT > i) { __m256 xb = _mm256_broadcast_ss(x + i * K + k);      \
                              c##i##0 = _mm256_fmadd_ps(xb, w0, c##i##0);          \
                              c##i##1 = _mm256_fmadd_ps(xb, w1, c##i##1); }
#define OUT8(i) if (MT > i) store16(y + i * N, _mm256_mul_ps(c##i##0, s0), _mm256_mul_ps(c##i##1, s1), nvalid);

static inline __attribute__((always_inline)) void tile_i8(const int MT, const int F8, const float *x,
                                                         const int8_t *w, long K, const float *scale, float *y,
                                                         long N, long nvalid) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
           c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (long k = 0; k < K; k++) {
        if ((k & 3) == 0) PREFETCH_Q(w + k * PANEL);
        __m256 w0, w1;
        widen16(F8, w + k * PANEL, &w0, &w1);
        ROW8(0) ROW8(1) ROW8(2) ROW8(3) ROW8(4) ROW8(5)
    }
    __m256 s0 = scale8(F8, scale), s1 = scale8(F8, scale + 8);
    OUT8(0) OUT8(1) OUT8(2) OUT8(3) OUT8(4) OUT8(5)
}

/* One or two rows (decode) against NP panels at once. A single row's two accumulator chains per panel
 * would wait on the FMA latency; NP panels give 2 * NP independent chains, and each column still sums its k
 * in order, exactly as tile_i8 does, so a row's result does not depend on how many rows share its call.
 * The accumulators are named registers: held in an array, GCC kept them on the stack, and every FMA waited
 * on a store and a reload (17 against 22 GB/s of INT8 weights on an AVX2 EPYC). */
#define ACC_I8(i, j) __m256 a##i##j##0 = _mm256_setzero_ps(), a##i##j##1 = a##i##j##0;
#define FMA_I8(i, j, kk, v0, v1) { __m256 xb = _mm256_broadcast_ss(x + i * K + (kk));                  \
                                  a##i##j##0 = _mm256_fmadd_ps(xb, v0, a##i##j##0);                     \
                                  a##i##j##1 = _mm256_fmadd_ps(xb, v1, a##i##j##1); }
#define PANEL_I8(j) if (NP > j) {                                                                       \
        const int8_t *wj = w + j * K * PANEL + k * PANEL;                                                \
        if ((k & 3) == 0) PREFETCH_Q(wj);                                                                \
        __m256 w0, w1;                                                                                  \
        widen16(F8, wj, &w0, &w1);                                                                      \
        FMA_I8(0, j, k, w0, w1) if (MT > 1) FMA_I8(1, j, k, w0, w1) }
#define PANEL_F8(j) if (NP > j) {                                                                       \
        const int8_t *wj = w + j * K * PANEL + k * PANEL;                                                \
        if ((k & 3) == 0) PREFETCH_Q(wj);                                                                \
        __m256 p0, p1, q0, q1;                                                                          \
        widen32_f8(wj, &p0, &p1, &q0, &q1);                                                             \
        FMA_I8(0, j, k, p0, p1) if (MT > 1) FMA_I8(1, j, k, p0, p1)                                     \
        FMA_I8(0, j, k + 1, q0, q1) if (MT > 1) FMA_I8(1, j, k + 1, q0, q1) }
#define OUT_I8(i, j) if (NP > j && MT > i)                                                              \
        store16(y + i * N + j * PANEL, _mm256_mul_ps(a##i##j##0, scale8(F8, scale + j * PANEL)),         \
                _mm256_mul_ps(a##i##j##1, scale8(F8, scale + j * PANEL + 8)), j == NP - 1 ? nlast : PANEL);
static inline __attribute__((always_inline)) void tile_i8_narrow(const int MT, const int NP, const int F8,
                                                                const float *x, const int8_t *w, long K,
                                                                const float *scale, float *y, long N,
                                                                long nlast) {
    ACC_I8(0, 0) ACC_I8(0, 1) ACC_I8(0, 2) ACC_I8(0, 3) ACC_I8(1, 0) ACC_I8(1, 1) ACC_I8(1, 2) ACC_I8(1, 3)
    long k = 0;
    if (F8)  /* two k at a time (widen32_f8); each column still adds k, then k + 1: the same bits */
        for (; k + 2 <= K; k += 2) {
            PANEL_F8(0) PANEL_F8(1) PANEL_F8(2) PANEL_F8(3)
        }
    for (; k < K; k++) {
        PANEL_I8(0) PANEL_I8(1) PANEL_I8(2) PANEL_I8(3)
    }
    OUT_I8(0, 0) OUT_I8(0, 1) OUT_I8(0, 2) OUT_I8(0, 3) OUT_I8(1, 0) OUT_I8(1, 1) OUT_I8(1, 2) OUT_I8(1, 3)
}
#undef ACC_I8
#undef FMA_I8
#undef PANEL_I8
#undef PANEL_F8
#undef OUT_I8

#define NARROW(mt, np) tile_i8_narrow(mt, np, F8, x, w, K, scale + n0, y + n0, N, nlast)
/* Panels [p0, p0 + np) for one or two rows; only the matrix's last panel may be partial. */
static inline __attribute__((always_inline)) void panels_i8_narrow(const int F8, long M, const float *x,
                                                                  const int8_t *wp, long K, const float *scale,
                                                                  float *y, long N, long p0, long np) {
    const int8_t *w = wp + p0 * K * PANEL;
    long n0 = p0 * PANEL, nlast = N - (n0 + (np - 1) * PANEL) < PANEL ? N - (n0 + (np - 1) * PANEL) : PANEL;
    if (M == 2) {
        if (np == 2) NARROW(2, 2); else NARROW(2, 1);
    } else switch (np) {
        case 4: NARROW(1, 4); break;
        case 3: NARROW(1, 3); break;
        case 2: NARROW(1, 2); break;
        default: NARROW(1, 1); break;
    }
}
#undef NARROW

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
int qb_isa(void);

/* INT8 on AVX-512: a panel's 16 columns are one zmm, so each k costs one widening load, one convert and
 * one FMA per row, half the AVX2 path's instructions. Each column sums its k in one chain, in order, exactly as
 * the AVX2 tiles do, so the two paths give the same bits (a quantized head's logits, and so a greedy answer,
 * do not depend on the CPU kind). The FMA latency is hidden across NP panels at once instead: MT * NP
 * independent chains (8 at one row, up to 24 at six), each a named register after unrolling. */
static inline AVX512 __attribute__((always_inline)) void tile_i8z(const int MT, const int NP, const float *x,
                                                                const int8_t *w, long K, const float *scale,
                                                                float *y, long N, long nlast) {
    __m512 acc[6][8];
    #pragma GCC unroll 6
    for (int i = 0; i < MT; i++)
        #pragma GCC unroll 8
        for (int j = 0; j < NP; j++) acc[i][j] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 4 <= K; k += 4) {
        #pragma GCC unroll 8
        for (int j = 0; j < NP; j++) PREFETCH_Q(w + j * K * PANEL + k * PANEL);
        #pragma GCC unroll 4
        for (int u = 0; u < 4; u++)
            #pragma GCC unroll 8
            for (int j = 0; j < NP; j++) {
                __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(w + j * K * PANEL + (k + u) * PANEL))));
                #pragma GCC unroll 6
                for (int i = 0; i < MT; i++)
                    acc[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * K + k + u]), wv, acc[i][j]);
            }
    }
    for (; k < K; k++)
        #pragma GCC unroll 8
        for (int j = 0; j < NP; j++) {
            __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)(w + j * K * PANEL + k * PANEL))));
            #pragma GCC unroll 6
            for (int i = 0; i < MT; i++) acc[i][j] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * K + k]), wv, acc[i][j]);
        }
    #pragma GCC unroll 8
    for (int j = 0; j < NP; j++) {
        __m512 s = _mm512_loadu_ps(scale + j * PANEL);
        __mmask16 m = (__mmask16)((1u << (j == NP - 1 ? nlast : PANEL)) - 1);
        #pragma GCC unroll 6
        for (int i = 0; i < MT; i++) _mm512_mask_storeu_ps(y + i * N + j * PANEL, m, _mm512_mul_ps(acc[i][j], s));
    }
}

#define Z8(mt, np) tile_i8z(mt, np, x, w, K, scale, y, N, nlast)
#define Z4(mt) switch (np) { case 4: Z8(mt, 4); break; case 3: Z8(mt, 3); break; case 2: Z8(mt, 2); break;   \
                             default: Z8(mt, 1); break; }
/* Rows [0, mt) against np consecutive panels (at most 8 for one row, 4 otherwise), the last with nlast
 * valid columns. */
static AVX512 void panels_i8z(long mt, long np, const float *x, const int8_t *w, long K, const float *scale,
                              float *y, long N, long nlast) {
    switch (mt) {
        case 1: switch (np) {
                    case 8: Z8(1, 8); break; case 7: Z8(1, 7); break; case 6: Z8(1, 6); break;
                    case 5: Z8(1, 5); break; default: Z4(1); break;
                } break;
        case 2: Z4(2); break;
        case 3: Z4(3); break;
        case 4: Z4(4); break;
        case 5: Z4(5); break;
        default: Z4(6); break;
    }
}
#undef Z4
#undef Z8

/* Each thread takes a contiguous run of panels and walks it np panels at a time, every row tile against the
 * same np panels while they are in cache. */
static void gemm_i8z(const float *x, const int8_t *wp, const float *scale, float *y, long M, long K, long N,
                     int nthreads) {
    long npanels = (N + PANEL - 1) / PANEL, npmax = M == 1 ? 8 : 4;
    #pragma omp parallel num_threads(nthreads)
    {
        long T = omp_get_num_threads(), t = omp_get_thread_num();
        long p1 = npanels * (t + 1) / T;
        for (long p = npanels * t / T; p < p1; p += npmax) {
            long np = p1 - p < npmax ? p1 - p : npmax, n0 = p * PANEL;
            long nlast = p + np == npanels ? N - (npanels - 1) * PANEL : PANEL;
            for (long m0 = 0, r = 0; m0 < M; m0 += tile_rows(M, r++))
                panels_i8z(tile_rows(M, r), np, x + m0 * K, wp + p * K * PANEL, K, scale + n0, y + m0 * N + n0, N,
                           nlast);
        }
    }
}

/* x (M, K) fp32; wp (P, K, 16) int8 or FP8 bytes; scale (P * 16) fp32 (padded); y (M, N). The AVX-512 tiles
 * take INT8 only: FP8 runs the AVX2 ones on every CPU. */
static inline __attribute__((always_inline)) void gemm_8bit(const int F8, const float *x, const int8_t *wp,
                                                           const float *scale, float *y, long M, long K, long N,
                                                           int nthreads) {
    long npanels = (N + PANEL - 1) / PANEL;
    if (!F8 && qb_isa() == 512) {
        gemm_i8z(x, wp, scale, y, M, K, N, nthreads);
        return;
    }
    if (M <= 2) {
        long np = M == 2 ? 2 : 4, ngroups = (npanels + np - 1) / np;
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (long gi = 0; gi < ngroups; gi++) {
            long p0 = gi * np;
            panels_i8_narrow(F8, M, x, wp, K, scale, y, N, p0, npanels - p0 < np ? npanels - p0 : np);
        }
        return;
    }
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long p = 0; p < npanels; p++) {
        const int8_t *w = wp + p * K * PANEL;
        long n0 = p * PANEL, nvalid = N - n0 < PANEL ? N - n0 : PANEL;
        for (long m0 = 0, t = 0; m0 < M; m0 += tile_rows(M, t++)) {
            long mt = tile_rows(M, t);
            const float *xm = x + m0 * K;
            float *ym = y + m0 * N + n0;
            SWITCH_ROWS(mt, tile_i8, F8, xm, w, K, scale + n0, ym, N, nvalid)
        }
    }
}

void qb_gemm_i8(const float *x, const int8_t *wp, const float *scale, float *y, long M, long K, long N,
                int nthreads) {
    gemm_8bit(0, x, wp, scale, y, M, K, N, nthreads);
}

/* FP8 e4m3 codes (as bytes) with fp32 per-column scales, in the INT8 layout (W8A16 FP8). */
void qb_gemm_f8(const float *x, const uint8_t *wp, const float *scale, float *y, long M, long K, long N,
                int nthreads) {
    gemm_8bit(1, x, (const int8_t *)wp, scale, y, M, K, N, nthreads);
}

/* INT4 with 16-bit integer activations.
 *
 * Each row of x is rounded to int16 per weight group (scale = absmax / 32767, a relative error of
 * at most 1.5e-5 of the group's largest activation: finer than fp16 activations). Codes and
 * activations then meet in _mm256_madd_epi16, 16 multiply-adds per instruction on pairs of
 * consecutive k, accumulated exactly in int32 over a group (at most 15 * 32767 * 128 < 2^31);
 * each group is closed once with its weight scale, zero point and activation scale:
 *   y += s_w * s_x * (sum_k x16_k u_k - z * sum_k x16_k).
 * Layout: panel p, k-pair j: 16 bytes; byte 2c + t = code(2j + t, c) | code(2j + t, c + 8) << 4,
 * so a 16-byte load, a mask and a shift give the codes of columns 0-7 and 8-15, already paired
 * by k for madd. K is padded to K4, a multiple of 4, with zero codes that meet zero activations,
 * so the AVX-512 path below can always take two pairs at a time.
 */
static inline void unpack_pair(const uint8_t *w, __m256i *lo, __m256i *hi) {
    __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)w));  /* one widening, both nibbles */
    *lo = _mm256_and_si256(b, _mm256_set1_epi16(0x0F));
    *hi = _mm256_srli_epi16(b, 4);
}

#define ROWQ(i, kk) if (MT > i) { __m256i xp = _mm256_set1_epi32(*(const int32_t *)(x16 + i * K4 + (kk))); \
                                  a##i##0 = _mm256_add_epi32(a##i##0, _mm256_madd_epi16(wlo, xp));   \
                                  a##i##1 = _mm256_add_epi32(a##i##1, _mm256_madd_epi16(whi, xp));   \
                                  HOLD_IN_REGS(a##i##0, a##i##1); }  /* panel.h */
#define CLOSEQ(i) if (MT > i) {                                                                      \
        __m256i zs = _mm256_set1_epi32(xs16[i * ngroups + gi]);                                      \
        __m256 sx = _mm256_set1_ps(sx16[i * ngroups + gi]);                                          \
        __m256 d0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(a##i##0, _mm256_mullo_epi32(z0, zs)));       \
        __m256 d1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(a##i##1, _mm256_mullo_epi32(z1, zs)));       \
        float *yr = acc + i * PANEL;                                                                 \
        _mm256_storeu_ps(yr, _mm256_fmadd_ps(_mm256_mul_ps(s0, sx), d0, _mm256_loadu_ps(yr)));       \
        _mm256_storeu_ps(yr + 8, _mm256_fmadd_ps(_mm256_mul_ps(s1, sx), d1, _mm256_loadu_ps(yr + 8))); }

/* One k-pair for a tile's rows. The loop takes four per iteration (one 64-byte line, one prefetch): taken
 * one at a time, its loop control cost as many instructions as the arithmetic, and at one row (decode) the
 * kernel ran at 13-15 GB/s of INT4 weights on an AVX2 EPYC whose memory streams at over 20 (21-23 now).
 * The four pairs' int32 adds into one accumulator are a 4-cycle chain, shorter than the iteration. */
#define PAIR6(kk) { __m256i wlo, whi; unpack_pair(w + (kk) * (PANEL / 2), &wlo, &whi);                   \
                   ROWQ(0, kk) ROWQ(1, kk) ROWQ(2, kk) ROWQ(3, kk) ROWQ(4, kk) ROWQ(5, kk) }

/* The (MT, 16) fp32 sums of a tile's groups -> its rows of y. */
static inline void store_acc(const float *acc, int MT, float *y, long N, long nvalid) {
    for (int i = 0; i < MT; i++)
        store16(y + i * N, _mm256_loadu_ps(acc + i * PANEL), _mm256_loadu_ps(acc + i * PANEL + 8), nvalid);
}

static inline __attribute__((always_inline)) void tile_i4q(const int MT, const int16_t *x16, const float *sx16,
                                                          const int32_t *xs16, const uint8_t *w,
                                                          const uint16_t *sc, const uint8_t *zp, long K4, long G,
                                                          long ngroups, float *y, long N, long nvalid) {
    float acc[6 * PANEL] = {0};
    for (long gi = 0; gi < ngroups; gi++) {
        __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00,
                a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
        long k1 = (gi + 1) * G < K4 ? (gi + 1) * G : K4;
        long k = gi * G;
        for (; k + 8 <= k1; k += 8) {
            PREFETCH_Q(w + k * (PANEL / 2));
            PAIR6(k) PAIR6(k + 2) PAIR6(k + 4) PAIR6(k + 6)
        }
        for (; k < k1; k += 2) PAIR6(k)
        __m256 s0, s1;
        __m256i z0, z1;
        group_params(sc + gi * PANEL, zp + gi * PANEL, &s0, &s1, &z0, &z1);
        CLOSEQ(0) CLOSEQ(1) CLOSEQ(2) CLOSEQ(3) CLOSEQ(4) CLOSEQ(5)
    }
    store_acc(acc, MT, y, N, nvalid);
}
#undef PAIR6

/* The same INT4 math on AVX-512 VNNI, for one and two rows (decode): vpdpwssd multiplies and accumulates
 * in one instruction, and a zmm register takes two k-pairs at once. The 32-byte load of pairs j and j + 1
 * unpacks to [pair j | pair j + 1] for columns 0-7 (low nibbles) and 8-15 (high nibbles); the activations
 * are laid out to match, 8 copies of pair j then 8 of pair j + 1 per 64 bytes (xq), so one memory operand
 * serves both. A group's two halves are added in int32 before it is closed, so the result is bit-identical
 * to the AVX2 path. (Three rows and more: tile_i4w below.) */
#define ROWZ(i) if (MT > i) { __m512i xv = _mm512_loadu_si512(xq + i * ldq + (k >> 2) * 16);           \
                              a##i##0 = _mm512_dpwssd_epi32(a##i##0, wlo, xv);                          \
                              a##i##1 = _mm512_dpwssd_epi32(a##i##1, whi, xv); }
#define HALVES(a) _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1))
#define CLOSEZ(i) if (MT > i) {                                                                      \
        __m256i zs = _mm256_set1_epi32(xs16[i * ngroups + gi]);                                      \
        __m256 sx = _mm256_set1_ps(sx16[i * ngroups + gi]);                                          \
        __m256 d0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(HALVES(a##i##0), _mm256_mullo_epi32(z0, zs))); \
        __m256 d1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(HALVES(a##i##1), _mm256_mullo_epi32(z1, zs))); \
        float *yr = acc + i * PANEL;                                                                 \
        _mm256_storeu_ps(yr, _mm256_fmadd_ps(_mm256_mul_ps(s0, sx), d0, _mm256_loadu_ps(yr)));       \
        _mm256_storeu_ps(yr + 8, _mm256_fmadd_ps(_mm256_mul_ps(s1, sx), d1, _mm256_loadu_ps(yr + 8))); }

/* One or two rows (decode): with only two accumulators per row, each vpdpwssd waits on the previous one
 * (latency, not throughput, bounds the loop). Two k-steps per iteration into separate accumulators,
 * added in int32 before the group closes: exact, so the result stays bit-identical to the AVX2 path. */
#define ROWZ2(i) if (MT > i) { __m512i xv = _mm512_loadu_si512(xq + i * ldq + (k >> 2) * 16);            \
                               __m512i xw = _mm512_loadu_si512(xq + i * ldq + ((k + 4) >> 2) * 16);      \
                               a##i##0 = _mm512_dpwssd_epi32(a##i##0, wlo, xv);                           \
                               a##i##1 = _mm512_dpwssd_epi32(a##i##1, whi, xv);                           \
                               b##i##0 = _mm512_dpwssd_epi32(b##i##0, vlo, xw);                           \
                               b##i##1 = _mm512_dpwssd_epi32(b##i##1, vhi, xw); }
static inline AVX512 __attribute__((always_inline)) void tile_i4z_small(const int MT, const int32_t *xq, long ldq,
                                                                      const float *sx16, const int32_t *xs16,
                                                                      const uint8_t *w, const uint16_t *sc,
                                                                      const uint8_t *zp, long K4, long G,
                                                                      long ngroups, float *y, long N, long nvalid) {
    float acc[6 * PANEL] = {0};
    const __m512i mask16 = _mm512_set1_epi16(0x0F);
    for (long gi = 0; gi < ngroups; gi++) {
        __m512i a00 = _mm512_setzero_si512(), a01 = a00, a10 = a00, a11 = a00;
        __m512i b00 = a00, b01 = a00, b10 = a00, b11 = a00;
        long k1 = (gi + 1) * G < K4 ? (gi + 1) * G : K4, k = gi * G;
        for (; k + 8 <= k1; k += 8) {
            if ((k & 7) == 0) PREFETCH_Q(w + k * (PANEL / 2));
            __m256i b = _mm256_loadu_si256((const __m256i *)(w + k * (PANEL / 2)));
            __m256i c = _mm256_loadu_si256((const __m256i *)(w + (k + 4) * (PANEL / 2)));
            __m512i b16 = _mm512_cvtepu8_epi16(b);  /* one widening serves both nibbles */
            __m512i wlo = _mm512_and_si512(b16, mask16), whi = _mm512_srli_epi16(b16, 4);
            __m512i c16 = _mm512_cvtepu8_epi16(c);  /* one widening serves both nibbles */
            __m512i vlo = _mm512_and_si512(c16, mask16), vhi = _mm512_srli_epi16(c16, 4);
            ROWZ2(0) ROWZ2(1)
        }
        if (k < k1) {  /* a group of 4 mod 8 (K4 is a multiple of 4) */
            __m256i b = _mm256_loadu_si256((const __m256i *)(w + k * (PANEL / 2)));
            __m512i b16 = _mm512_cvtepu8_epi16(b);  /* one widening serves both nibbles */
            __m512i wlo = _mm512_and_si512(b16, mask16), whi = _mm512_srli_epi16(b16, 4);
            ROWZ(0) ROWZ(1)
        }
        a00 = _mm512_add_epi32(a00, b00); a01 = _mm512_add_epi32(a01, b01);
        a10 = _mm512_add_epi32(a10, b10); a11 = _mm512_add_epi32(a11, b11);
        __m256 s0, s1;
        __m256i z0, z1;
        group_params(sc + gi * PANEL, zp + gi * PANEL, &s0, &s1, &z0, &z1);
        CLOSEZ(0) CLOSEZ(1)
    }
    store_acc(acc, MT, y, N, nvalid);
}

/* Three rows and more on AVX-512: one zmm holds one k-pair of all 16 columns (columns 0-7 from the low
 * nibbles in its low half, 8-15 from the high nibbles in its high half), so each row needs one accumulator and
 * meets the weights through vpdpwssd's embedded broadcast of its int16 pair: four bytes per row and pair, from
 * xt, the tile's pairs interleaved row by row (pair j of row i at j * MT + i), so that one pointer and constant
 * offsets reach every row. The six-row tile this replaced read xq, 64 bytes per row and two pairs, which at
 * batch 32 streamed from L2 (a tile's rows of xq outgrow L1 at K = 1,536) and bounded the loop. With one
 * accumulator per row a tile takes up to 16 rows, so the unpacking (three operations per pair) is shared by
 * more rows. Integer sums are exact in any order and each group closes lane by lane as CLOSEZ does: the AVX2
 * path's bits. */
#define W_ACC(i) __m512i a##i = _mm512_setzero_si512();
/* in asm, so that GCC keeps each accumulator in one register (through the intrinsic it copied every one
 * around each iteration) and the pair comes as an embedded broadcast */
#define W_DP(i) if (MT > i) __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(a##i) : "v"(wv), "m"(xj[i]));
#define W_CLOSE(i) if (MT > i) {                                                                     \
        const __m512i zs = _mm512_set1_epi32(xs16[i * ngroups + gi]);                                 \
        const __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(a##i, _mm512_mullo_epi32(z, zs)));     \
        float *yr = acc + i * PANEL;                                                                 \
        _mm512_store_ps(yr, _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(sx16[i * ngroups + gi])), d, \
                                            _mm512_load_ps(yr))); }
#define W_ROWS(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) F(12) F(13) F(14) F(15)
static inline AVX512 __attribute__((always_inline)) void tile_i4w(const int MT, const int32_t *xt, long K4,
                                                                const float *sx16, const int32_t *xs16,
                                                                const uint8_t *w, const uint16_t *sc,
                                                                const uint8_t *zp, long G, long ngroups,
                                                                float *y, long N, long nvalid) {
    float acc[16 * PANEL] __attribute__((aligned(64))) = {0};
    const __m512i mask16 = _mm512_set1_epi16(0x0F);
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    for (long gi = 0; gi < ngroups; gi++) {
        W_ROWS(W_ACC)
        const long k1 = (gi + 1) * G < K4 ? (gi + 1) * G : K4;
        for (long k = gi * G; k < k1; k += 2) {
            if ((k & 7) == 0) PREFETCH_Q(w + k * (PANEL / 2));
            const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(w + k * (PANEL / 2))));
            const __m512i wv = _mm512_and_si512(_mm512_srlv_epi16(_mm512_cvtepu8_epi16(b), shift), mask16);
            const int32_t *xj = xt + (k >> 1) * MT;
            W_ROWS(W_DP)
        }
        __m256 s0, s1;
        __m256i z0, z1;
        group_params(sc + gi * PANEL, zp + gi * PANEL, &s0, &s1, &z0, &z1);
        const __m512 s = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(s0)),
                                                               _mm256_castps_pd(s1), 1));
        const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(z0), z1, 1);
        W_ROWS(W_CLOSE)
    }
    store_acc(acc, MT, y, N, nvalid);
}

/* tile t's rows for tile_i4w's tiles of at most 16 */
static inline long tile_rows16(long M, long t) { return split_rows(M, t, 16); }

/* fn(MT, args...) with MT a compile-time constant from 3 to 16 (tile_i4w's tiles) */
#define SWITCH_ROWS16(mt, fn, ...) switch (mt) {                                                     \
        case 16: fn(16, __VA_ARGS__); break; case 15: fn(15, __VA_ARGS__); break;                    \
        case 14: fn(14, __VA_ARGS__); break; case 13: fn(13, __VA_ARGS__); break;                    \
        case 12: fn(12, __VA_ARGS__); break; case 11: fn(11, __VA_ARGS__); break;                    \
        case 10: fn(10, __VA_ARGS__); break; case 9: fn(9, __VA_ARGS__); break;                      \
        case 8: fn(8, __VA_ARGS__); break; case 7: fn(7, __VA_ARGS__); break;                        \
        case 6: fn(6, __VA_ARGS__); break; case 5: fn(5, __VA_ARGS__); break;                        \
        case 4: fn(4, __VA_ARGS__); break; default: fn(3, __VA_ARGS__); break; }

static AVX512 void panel_i4z(long M, const int32_t *xq, long ldq, const int32_t *xt, const float *sx16,
                             const int32_t *xs16, const uint8_t *w, const uint16_t *sc, const uint8_t *zp, long K4,
                             long G, long ngroups, float *y, long N, long nvalid) {
    if (M <= 2) {
        if (M == 2) tile_i4z_small(2, xq, ldq, sx16, xs16, w, sc, zp, K4, G, ngroups, y, N, nvalid);
        else tile_i4z_small(1, xq, ldq, sx16, xs16, w, sc, zp, K4, G, ngroups, y, N, nvalid);
        return;
    }
    for (long m0 = 0, t = 0; m0 < M; m0 += tile_rows16(M, t++))
        SWITCH_ROWS16(tile_rows16(M, t), tile_i4w, xt + m0 * (K4 / 2), K4, sx16 + m0 * ngroups, xs16 + m0 * ngroups,
                      w, sc, zp, G, ngroups, y + m0 * N, N, nvalid)
}

static void panel_i4q(long M, const int16_t *x16, const float *sx16, const int32_t *xs16, const uint8_t *w,
                      const uint16_t *sc, const uint8_t *zp, long K4, long G, long ngroups, float *y, long N,
                      long nvalid) {
    for (long m0 = 0, t = 0; m0 < M; m0 += tile_rows(M, t++)) {
        const int16_t *xm = x16 + m0 * K4;
        const float *sm = sx16 + m0 * ngroups;
        const int32_t *xsm = xs16 + m0 * ngroups;
        float *ym = y + m0 * N;
        SWITCH_ROWS(tile_rows(M, t), tile_i4q, xm, sm, xsm, w, sc, zp, K4, G, ngroups, ym, N, nvalid)
    }
}

/* One group of a row of x -> int16 codes, their scale (absmax / 32767) and their sum. Eight at a time:
 * _mm256_cvtps_epi32 rounds to nearest even under the default MXCSR, as lrintf does, so the codes are the
 * scalar loop's; the scalar tail uses the same conversion. (lrintf was a libm call per activation: 20 us
 * for one row of a 4,864-wide down projection.) */
static void group_to_i16(const float *x, long n, int16_t *q, float *scale, int32_t *sum) {
    float amax = absmax_f32(x, n);
    long k;
    float s = amax > 0.0f ? amax / 32767.0f : 1.0f, inv = 1.0f / s;
    __m256 vinv = _mm256_set1_ps(inv);
    __m256i vsum = _mm256_setzero_si256();
    for (k = 0; k + 8 <= n; k += 8) {
        __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv));
        vsum = _mm256_add_epi32(vsum, qi);
        __m128i packed = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
        _mm_storeu_si128((__m128i *)(q + k), packed);
    }
    int32_t sl[8], total = 0;
    _mm256_storeu_si256((__m256i *)sl, vsum);
    for (int j = 0; j < 8; j++) total += sl[j];
    for (; k < n; k++) {
        int32_t v = _mm_cvtss_si32(_mm_set_ss(x[k] * inv));
        q[k] = (int16_t)v;
        total += v;
    }
    *scale = s;
    *sum = total;
}

/* -1 until first use; qb_set_isa(256) forces AVX2 (tests compare the two paths bit for bit). A request for
 * AVX-512 on a CPU without it keeps AVX2: the AVX-512 code would die on an illegal instruction, and a test
 * that restored "512" after forcing AVX2 did exactly that on an AVX2-only EPYC. */
static int use_avx512 = -1;

static int cpu_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

void qb_set_isa(int level) { use_avx512 = level >= 512 && cpu_avx512(); }

int qb_isa(void) {
    if (use_avx512 < 0) use_avx512 = cpu_avx512();
    return use_avx512 ? 512 : 256;
}

/* x (M, K) fp32; wp (P, K4 / 2, 16) uint8 with K4 = K rounded up to a multiple of 4; scales (P, ngroups, 16)
 * fp16; zeros (P, ngroups, 16) uint8; y (M, N). */
void qb_gemm_i4(const float *x, const uint8_t *wp, const uint16_t *scales, const uint8_t *zeros,
                float *y, long M, long K, long N, long G, int nthreads) {
    long npanels = (N + PANEL - 1) / PANEL;
    long ngroups = (K + G - 1) / G;
    long K4 = (K + 3) & ~3L;
    int wide = qb_isa() == 512;
    int16_t *x16 = (int16_t *)calloc(M * K4 + 16, sizeof(int16_t));
    float *sx16 = (float *)malloc(sizeof(float) * M * ngroups + 16);
    int32_t *xs16 = (int32_t *)malloc(sizeof(int32_t) * M * ngroups + 16);
    long ldq = K4 * 4;  /* int32 per row of xq: 16 per 4 k */
    int32_t *xq = wide && M <= 2 ? (int32_t *)malloc(sizeof(int32_t) * M * ldq + 64) : NULL;  /* tile_i4z_small's */
    int32_t *xt = wide && M > 2 ? (int32_t *)malloc(sizeof(int32_t) * M * (K4 / 2) + 64) : NULL;  /* tile_i4w's */
    for (long m = 0; m < M; m++) {
        for (long gi = 0; gi < ngroups; gi++) {
            long k0 = gi * G, k1 = (gi + 1) * G < K ? (gi + 1) * G : K;
            group_to_i16(x + m * K + k0, k1 - k0, x16 + m * K4 + k0, sx16 + m * ngroups + gi,
                         xs16 + m * ngroups + gi);
        }
        if (xq) {
            const int32_t *pairs = (const int32_t *)(x16 + m * K4);  /* pair j = (x[2j], x[2j+1]) */
            for (long j = 0; j < K4 / 2; j++)
                for (int c = 0; c < 8; c++) xq[m * ldq + (j >> 1) * 16 + (j & 1) * 8 + c] = pairs[j];
        }
    }
    if (xt)  /* each tile's pairs, row by row: pair j of the tile's row i at j * mt + i */
        for (long m0 = 0, t = 0; m0 < M; m0 += tile_rows16(M, t++)) {
            const long mt = tile_rows16(M, t);
            for (long i = 0; i < mt; i++) {
                const int32_t *pairs = (const int32_t *)(x16 + (m0 + i) * K4);
                for (long j = 0; j < K4 / 2; j++) xt[m0 * (K4 / 2) + j * mt + i] = pairs[j];
            }
        }
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long p = 0; p < npanels; p++) {
        i4_panel pn = i4_panel_at(wp, scales, zeros, p, K4, ngroups, N);
        if (wide) panel_i4z(M, xq, ldq, xt, sx16, xs16, pn.w, pn.sc, pn.zp, K4, G, ngroups, y + pn.n0, N, pn.nvalid);
        else panel_i4q(M, x16, sx16, xs16, pn.w, pn.sc, pn.zp, K4, G, ngroups, y + pn.n0, N, pn.nvalid);
    }
    free(x16);
    free(sx16);
    free(xs16);
    free(xq);
    free(xt);
}
