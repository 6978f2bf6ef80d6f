/* The int8-activation GEMMs of gemm_a8.c (W8A8, W4A8) on AVX-512 VNNI with VBMI's byte permute.
 *
 * vpdpbusd does 64 multiply-adds of unsigned by signed bytes into 16 int32 lanes per instruction, four times
 * an fp32 FMA's. A lane must hold one column's four k, so each 64-byte (W8A8) or 32-byte (W4A8) step of a
 * panel is reordered once by vpermb, an in-register cost shared by a tile's rows; a zmm then holds all 16
 * columns of a panel, and a tile takes up to 8 rows. The activation codes come from gemm_a8.c (row_to_i8),
 * the integer sums are exact, and each output is closed with the same float operations, in the same order,
 * as the AVX2 tiles there, so the two paths agree bit for bit (tests switch between them with qb_set_isa).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "panel.h"
#include "a8_quad.h"

#define AZ_ROWS 8  /* rows per tile: a row holds an int32 and (W4A8) an fp32 accumulator */
int qb_isa(void);

static int a8_wide = -1;

/* Whether the int8-activation GEMMs take the AVX-512 VNNI tiles: qb_isa() == 512 (qb_set_isa(256) forces
 * AVX2) and the CPU has VBMI's byte permute (Ice Lake, Sapphire Rapids and Zen 4 do; Cascade Lake does not). */
int qb_a8_wide(void) {
    if (a8_wide < 0) {
        __builtin_cpu_init();
        a8_wide = __builtin_cpu_supports("avx512vbmi");
    }
    return a8_wide && qb_isa() == 512;
}

#ifndef A8_BLOCK_BYTES
#define A8_BLOCK_BYTES (256 * 1024)  /* a block's codes (block_rows, a8_quad.h) */
#endif
static inline long tile_rows8(long M, long t) { return split_rows(M, t, AZ_ROWS); }

/* SWITCH_ROWS (panel.h) widened to 8 rows. */
#define SWITCH_ROWS8(mt, fn, ...) switch (mt) {                                                        \
        case 8: fn(8, __VA_ARGS__); break;                                                             \
        case 7: fn(7, __VA_ARGS__); break;                                                             \
        default: SWITCH_ROWS(mt, fn, __VA_ARGS__)                                                      \
    }

/* W8A8. vpdpbusd takes unsigned by signed bytes, so the activations are offset to u = x8 + 128 (1..255) and
 * the weight column sums times 128 are taken off once (llama.cpp's and oneDNN's correction term): that sum is
 * one more vpdpbusd per k-quad against bytes of 128. A panel's first tile computes it and hands it to the
 * panel's later tiles (*corr), so at 32 rows it costs one vpdpbusd in 33 instead of one in 9 (a tile alone
 * ran 193 GMAC/s with it and 220 without on a Zen 4 core); the integer sum is the same either way, so the
 * outputs keep their bits. Panel rows k .. k + 3 (64 bytes, row-major) -> lane c = column c's four k; a K
 * that is not a multiple of 4 ends with a masked load. */
/* Each tile reorders the panel's quads itself: reordering them once per panel for all its tiles (tried) made
 * no difference at 32 to 1,024 rows, where vpdpbusd's own throughput bounds the kernel. */
static inline VNNI __attribute__((always_inline)) void tile_i8a8z(const int MT, const uint8_t *xu, long K4,
                                                                const float *sx, const int8_t *w, long K,
                                                                const float *scale, float *y, long N,
                                                                long nvalid, __m512i *corr, int first) {
    const __m512i off = _mm512_set1_epi8((char)0x80);
    __m512i acc[AZ_ROWS];
    #pragma GCC unroll 8
    for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_si512();
    if (first) {  /* two loops: one loop with `if (first)` in it ran 5% slower at 32 rows (GCC kept the branch) */
        __m512i c = _mm512_setzero_si512();
        for (long k = 0; k < K; k += 4) {
            __m512i b = quad_i8(w, k, K);
            c = _mm512_dpbusd_epi32(c, off, b);
            #pragma GCC unroll 8
            for (int i = 0; i < MT; i++)
                acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(*(const int32_t *)(xu + i * K4 + k)), b);
        }
        *corr = c;
    } else {
        for (long k = 0; k < K; k += 4) {
            __m512i b = quad_i8(w, k, K);
            #pragma GCC unroll 8
            for (int i = 0; i < MT; i++)
                acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(*(const int32_t *)(xu + i * K4 + k)), b);
        }
    }
    __m512 s = _mm512_loadu_ps(scale);
    __mmask16 m = (__mmask16)((1u << nvalid) - 1);
    #pragma GCC unroll 8
    for (int i = 0; i < MT; i++) {
        __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i], *corr));
        _mm512_mask_storeu_ps(y + i * N, m, _mm512_mul_ps(d, _mm512_mul_ps(s, _mm512_set1_ps(sx[i]))));
    }
}

VNNI void a8z_gemm_i8(const int8_t *x8, const float *sx, const int8_t *wp, const float *scale, float *y, long M,
                      long K, long N, int nthreads) {
    long npanels = (N + PANEL - 1) / PANEL, K4 = (K + 3) & ~3L;
    uint8_t *xu = (uint8_t *)malloc(M * K4 + 64);
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (M >= 16)
    for (long i = 0; i < M * K4; i++) xu[i] = (uint8_t)x8[i] ^ 0x80;  /* x8 + 128 as an unsigned byte */
    for (long r0 = 0, R = block_rows(M, K4, A8_BLOCK_BYTES, AZ_ROWS); r0 < M; r0 += R) {
        long mb = M - r0 < R ? M - r0 : R;
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (long p = 0; p < npanels; p++) {
            long n0 = p * PANEL, nvalid = N - n0 < PANEL ? N - n0 : PANEL;
            const int8_t *w = wp + p * K * PANEL;
            __m512i corr;
            for (long m0 = r0, t = 0; m0 < r0 + mb; m0 += tile_rows8(mb, t++)) {
#define TILE(mt, _) tile_i8a8z(mt, xu + m0 * K4, K4, sx + m0, w, K, scale + n0, y + m0 * N + n0, N, nvalid, \
                               &corr, t == 0)
                SWITCH_ROWS8(tile_rows8(mb, t), TILE, 0)
#undef TILE
            }
        }
    }
    free(xu);
}

/* W4A8: the codes are unsigned already, so they are vpdpbusd's unsigned operand and the activations its
 * signed one, with no correction. 32 bytes of a panel (k-pairs j, j + 1: byte 2c + t of pair j holds column c
 * in its low nibble and column c + 8 in its high one, k = 2j + t) -> lane c < 8: column c's four low nibbles,
 * lane c + 8: the same bytes' high nibbles (a per-lane shift by 4 in the upper half, then a mask). A group is
 * closed as tile_i4a8 closes it: y += (s_w * s_x) * (sum - z * sum_x), the bracket exact in one fnmadd. */
static inline VNNI __attribute__((always_inline)) void tile_i4a8z(const int MT, const int8_t *x8, long K4,
                                                                const float *sx8, const int32_t *xs,
                                                                const uint8_t *w, const uint16_t *sc,
                                                                const uint8_t *zp, long G, long ngroups, float *y,
                                                                long N, long nvalid) {
    __m512 yacc[AZ_ROWS];
    #pragma GCC unroll 8
    for (int i = 0; i < MT; i++) yacc[i] = _mm512_setzero_ps();
    for (long gi = 0; gi < ngroups; gi++) {
        __m512i acc[AZ_ROWS], acc2[2];  /* one or two rows: two chains hide vpdpbusd's latency */
        #pragma GCC unroll 8
        for (int i = 0; i < MT; i++) acc[i] = _mm512_setzero_si512();
        acc2[0] = acc2[1] = _mm512_setzero_si512();
        long k = gi * G, k1 = (gi + 1) * G < K4 ? (gi + 1) * G : K4;
#define UNPACK_Z(kk) quad_i4(w, kk)
        if (MT <= 2)
            for (; k + 8 <= k1; k += 8) {
                PREFETCH_Q(w + k * (PANEL / 2));
                __m512i b0 = UNPACK_Z(k), b1 = UNPACK_Z(k + 4);
                #pragma GCC unroll 2
                for (int i = 0; i < MT; i++) {
                    acc[i] = _mm512_dpbusd_epi32(acc[i], b0, _mm512_set1_epi32(*(const int32_t *)(x8 + i * K4 + k)));
                    acc2[i] = _mm512_dpbusd_epi32(acc2[i], b1,
                                                  _mm512_set1_epi32(*(const int32_t *)(x8 + i * K4 + k + 4)));
                }
            }
        for (; k < k1; k += 4) {
            if ((k & 7) == 0) PREFETCH_Q(w + k * (PANEL / 2));
            __m512i b0 = UNPACK_Z(k);
            #pragma GCC unroll 8
            for (int i = 0; i < MT; i++)
                acc[i] = _mm512_dpbusd_epi32(acc[i], b0, _mm512_set1_epi32(*(const int32_t *)(x8 + i * K4 + k)));
        }
#undef UNPACK_Z
        __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + gi * PANEL)));
        __m512 zf = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(zp + gi * PANEL))));
        #pragma GCC unroll 8
        for (int i = 0; i < MT; i++) {
            __m512i a = MT <= 2 ? _mm512_add_epi32(acc[i], acc2[i < 2 ? i : 0]) : acc[i];
            __m512 d = _mm512_fnmadd_ps(zf, _mm512_set1_ps((float)xs[i * ngroups + gi]), _mm512_cvtepi32_ps(a));
            yacc[i] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(sx8[i])), d, yacc[i]);
        }
    }
    __mmask16 m = (__mmask16)((1u << nvalid) - 1);
    #pragma GCC unroll 8
    for (int i = 0; i < MT; i++) _mm512_mask_storeu_ps(y + i * N, m, yacc[i]);
}

VNNI void a8z_gemm_i4(const int8_t *x8, const float *sx8, const int32_t *xs, const uint8_t *wp,
                      const uint16_t *scales, const uint8_t *zeros, float *y, long M, long K4, long N, long G,
                      long ngroups, int nthreads) {
    long npanels = (N + PANEL - 1) / PANEL;
    for (long r0 = 0, R = block_rows(M, K4, A8_BLOCK_BYTES, AZ_ROWS); r0 < M; r0 += R) {
        long mb = M - r0 < R ? M - r0 : R;
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (long p = 0; p < npanels; p++) {
            i4_panel pn = i4_panel_at(wp, scales, zeros, p, K4, ngroups, N);
            for (long m0 = r0, t = 0; m0 < r0 + mb; m0 += tile_rows8(mb, t++)) {
#define TILE(mt, _) tile_i4a8z(mt, x8 + m0 * K4, K4, sx8 + m0, xs + m0 * ngroups, pn.w, pn.sc, pn.zp, G,       \
                               ngroups, y + m0 * N + pn.n0, N, pn.nvalid)
                SWITCH_ROWS8(tile_rows8(mb, t), TILE, 0)
#undef TILE
            }
        }
    }
}
