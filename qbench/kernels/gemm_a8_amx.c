/* The int8-activation GEMMs of gemm_a8.c (W8A8, W4A8) on AMX, where the CPU has it (Sapphire Rapids on).
 *
 * One tdpbusd multiplies a 16 x 64 tile of bytes by a 64 x 16 one into 16 x 16 int32 sums: 16,384 multiply-adds
 * against vpdpbusd's 64. A B tile is 16 rows of 64 bytes, row q holding the four k of k-quad q for each of
 * 16 columns, which is exactly what quad_i8 / quad_i4 (a8_quad.h) make of a panel's quad: each thread
 * reorders one panel into B tiles (once per block of rows), then runs every row of the block against it,
 * four 16-row C tiles at a time. The activations are the codes of gemm_a8.c (row_to_i8), copied into tiles
 * of 16 rows and 64 k with zero padding (a padded k meets a zero weight, a padded row is never stored).
 * The integer sums are exact and each output is closed with the same float operations, in the same order,
 * as the VNNI tiles (gemm_a8_vnni.c), so the three paths give the same bits (tests switch with qb_set_amx).
 *
 * Linux hands out AMX's 8 KiB of tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM), once per
 * process; each thread loads the tile configuration itself and releases it after.
 */
#define _GNU_SOURCE
#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "a8_quad.h"
#include "panel.h"

#if !defined(__x86_64__) || !defined(__has_include) || !__has_include(<amxint8intrin.h>)
/* A compiler without AMX's intrinsics (GCC before 11): the VNNI tiles serve. */
void qb_set_amx(int on) { (void)on; }
int qb_a8_amx(void) { return 0; }
void ax_gemm_i8(const int8_t *x8, const float *sx, const int8_t *wp, const float *scale, float *y, long M, long K,
                long N, int nthreads) { (void)x8, (void)sx, (void)wp, (void)scale, (void)y, (void)M, (void)K, (void)N,
                                        (void)nthreads; abort(); }
void ax_gemm_i4(const int8_t *x8, const float *sx8, const int32_t *xs, const uint8_t *wp, const uint16_t *scales,
                const uint8_t *zeros, float *y, long M, long K4, long N, long G, long ngroups, int nthreads) {
    (void)x8, (void)sx8, (void)xs, (void)wp, (void)scales, (void)zeros, (void)y, (void)M, (void)K4, (void)N, (void)G,
    (void)ngroups, (void)nthreads;
    abort();
}
#else

#define AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AX_TILES 4                 /* C tiles per pass: 64 rows against one panel's 16 columns */
#define AX_ROWS (16 * AX_TILES)
#ifndef AX_BLOCK_BYTES
#define AX_BLOCK_BYTES (512 * 1024) /* activation tiles of one block of rows, kept in L2 across the panels */
#endif

int qb_a8_wide(void);

static int amx_cpu = -1, amx_on = 1;

/* The CPU has AMX-TILE and AMX-INT8 (CPUID 7.0: EDX bits 24, 25) and the kernel granted the tile state. */
static int amx_granted(void) {
    if (amx_cpu < 0) {
        unsigned a, b, c, d;
        amx_cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1) &&
                  syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return amx_cpu;
}

/* qb_set_amx(0) keeps the VNNI tiles on an AMX CPU (tests compare the paths; QBENCH_ISA=avx512). */
void qb_set_amx(int on) { amx_on = on; }

/* Whether the int8-activation GEMMs take the AMX tiles: an AMX CPU, not switched off, on the AVX-512 path. */
int qb_a8_amx(void) { return amx_on && qb_a8_wide() && amx_granted(); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Every tile 16 rows of 64 bytes: 0-3 the C sums, 4 and 6 the activations, 5 the panel. */
static AMX void tiles_on(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

/* Activation codes (M rows of K4 bytes, K real) -> (M16, K64) tiles' rows, zero-padded; flip = 0x80 gives
 * the unsigned u = x8 + 128 of the W8A8 tiles, 0 keeps the signed codes of the W4A8 ones. */
static uint8_t *to_tiles(const int8_t *x8, long M, long K, long K4, long M16, long K64, uint8_t flip,
                         int nthreads) {
    uint8_t *xa = (uint8_t *)aligned_alloc(64, M16 * K64);
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (M >= 64)
    for (long m = 0; m < M16; m++) {
        uint8_t *row = xa + m * K64;
        long k = 0;
        if (m < M)
            for (; k < K; k++) row[k] = (uint8_t)x8[m * K4 + k] ^ flip;
        memset(row + k, 0, K64 - k);
    }
    return xa;
}

/* NT C tiles (16 rows each, from row block xa) += xa's k-tiles times the panel's B tiles kb0 .. kb1 (in 64 k),
 * then stored to c (NT * 16 rows of 16 int32). S = 1: signed activations by unsigned codes (W4A8). */
static inline AMX __attribute__((always_inline)) void pass(const int NT, const int S, const uint8_t *xa, long K64,
                                                         const uint8_t *bp, long kb0, long kb1, int32_t *c) {
    if (NT > 0) _tile_zero(0);
    if (NT > 1) _tile_zero(1);
    if (NT > 2) _tile_zero(2);
    if (NT > 3) _tile_zero(3);
#define DP(ct, at) if (NT > ct) {                                                                      \
        _tile_loadd(at, xa + (ct) * 16 * K64 + kb * 64, K64);                                          \
        if (S) _tile_dpbsud(ct, at, 5); else _tile_dpbusd(ct, at, 5); }
    for (long kb = kb0; kb < kb1; kb++) {
        _tile_loadd(5, bp + kb * 1024, 64);
        DP(0, 4) DP(1, 6) DP(2, 4) DP(3, 6)
    }
#undef DP
    if (NT > 0) _tile_stored(0, c, 64);
    if (NT > 1) _tile_stored(1, c + 256, 64);
    if (NT > 2) _tile_stored(2, c + 512, 64);
    if (NT > 3) _tile_stored(3, c + 768, 64);
}

#define SWITCH_TILES(nt, fn, ...) switch (nt) {                                                        \
        case 4: fn(4, __VA_ARGS__); break;                                                             \
        case 3: fn(3, __VA_ARGS__); break;                                                             \
        case 2: fn(2, __VA_ARGS__); break;                                                             \
        default: fn(1, __VA_ARGS__); break;                                                            \
    }

/* W8A8: tdpbusd's unsigned operand is u = x8 + 128 and its signed one the weight; the correction 128 * (the
 * column's weight sum) is taken off as by the VNNI tiles (one vpdpbusd per quad against bytes of 128). */
AMX void ax_gemm_i8(const int8_t *x8, const float *sx, const int8_t *wp, const float *scale, float *y, long M,
                    long K, long N, int nthreads) {
    long npanels = (N + PANEL - 1) / PANEL, K4 = (K + 3) & ~3L, K64 = (K + 63) & ~63L, M16 = (M + 15) & ~15L;
    uint8_t *xa = to_tiles(x8, M, K, K4, M16, K64, 0x80, nthreads);
    long R = block_rows(M16, K64, AX_BLOCK_BYTES, AX_ROWS);  /* whole passes */
    #pragma omp parallel num_threads(nthreads)
    {
        tiles_on();
        uint8_t *bp = (uint8_t *)aligned_alloc(64, K64 * PANEL);  /* one panel's B tiles */
        int32_t *c = (int32_t *)aligned_alloc(64, sizeof(int32_t) * AX_ROWS * PANEL);
        const __m512i off = _mm512_set1_epi8((char)0x80);
        for (long r0 = 0; r0 < M16; r0 += R) {
            long r1 = r0 + R < M16 ? r0 + R : M16;
            #pragma omp for schedule(static)
            for (long p = 0; p < npanels; p++) {
                long n0 = p * PANEL, nvalid = N - n0 < PANEL ? N - n0 : PANEL;
                const int8_t *w = wp + p * K * PANEL;
                __m512i corr = _mm512_setzero_si512();
                for (long k = 0; k < K64; k += 4) {
                    __m512i b = k < K ? quad_i8(w, k, K) : _mm512_setzero_si512();
                    corr = _mm512_dpbusd_epi32(corr, off, b);
                    _mm512_store_si512((void *)(bp + k * PANEL), b);
                }
                __m512 s = _mm512_loadu_ps(scale + n0);
                __mmask16 mask = (__mmask16)((1u << nvalid) - 1);
                for (long m0 = r0; m0 < r1; m0 += AX_ROWS) {
                    long nt = (r1 - m0) / 16 < AX_TILES ? (r1 - m0) / 16 : AX_TILES;
#define PASS(NT, _) pass(NT, 0, xa + m0 * K64, K64, bp, 0, K64 / 64, c)
                    SWITCH_TILES(nt, PASS, 0)
#undef PASS
                    for (long i = 0; i < nt * 16 && m0 + i < M; i++) {
                        __m512 d = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(c + i * PANEL), corr));
                        _mm512_mask_storeu_ps(y + (m0 + i) * N + n0, mask,
                                              _mm512_mul_ps(d, _mm512_mul_ps(s, _mm512_set1_ps(sx[m0 + i]))));
                    }
                }
            }
        }
        free(bp);
        free(c);
        _tile_release();
    }
    free(xa);
}

/* W4A8, G a multiple of 64: the codes are unsigned already, so tdpbsud takes the signed activations by them
 * with no correction, and each group's k-tiles make their own C sums, closed into fp32 as the VNNI tiles
 * close them: y += (s_w * s_x) * (sum - z * sum_x). */
AMX void ax_gemm_i4(const int8_t *x8, const float *sx8, const int32_t *xs, const uint8_t *wp,
                    const uint16_t *scales, const uint8_t *zeros, float *y, long M, long K4, long N, long G,
                    long ngroups, int nthreads) {
    long npanels = (N + PANEL - 1) / PANEL, K64 = (K4 + 63) & ~63L, M16 = (M + 15) & ~15L, gt = G / 64;
    uint8_t *xa = to_tiles(x8, M, K4, K4, M16, K64, 0, nthreads);
    long R = block_rows(M16, K64, AX_BLOCK_BYTES, AX_ROWS);  /* whole passes */
    #pragma omp parallel num_threads(nthreads)
    {
        tiles_on();
        uint8_t *bp = (uint8_t *)aligned_alloc(64, K64 * PANEL);
        int32_t *c = (int32_t *)aligned_alloc(64, sizeof(int32_t) * AX_ROWS * PANEL);
        float *acc = (float *)aligned_alloc(64, sizeof(float) * AX_ROWS * PANEL);
        for (long r0 = 0; r0 < M16; r0 += R) {
            long r1 = r0 + R < M16 ? r0 + R : M16;
            #pragma omp for schedule(static)
            for (long p = 0; p < npanels; p++) {
                i4_panel pn = i4_panel_at(wp, scales, zeros, p, K4, ngroups, N);
                for (long k = 0; k < K64; k += 4)
                    _mm512_store_si512((void *)(bp + k * PANEL), k < K4 ? quad_i4(pn.w, k) : _mm512_setzero_si512());
                __mmask16 mask = (__mmask16)((1u << pn.nvalid) - 1);
                for (long m0 = r0; m0 < r1; m0 += AX_ROWS) {
                    long nt = (r1 - m0) / 16 < AX_TILES ? (r1 - m0) / 16 : AX_TILES;
                    long rows = nt * 16 < M - m0 ? nt * 16 : M - m0;  /* the pass's real rows */
                    for (long i = 0; i < rows; i++) _mm512_store_ps(acc + i * PANEL, _mm512_setzero_ps());
                    for (long gi = 0; gi < ngroups; gi++) {
                        long kb1 = (gi + 1) * gt < K64 / 64 ? (gi + 1) * gt : K64 / 64;
#define PASS(NT, _) pass(NT, 1, xa + m0 * K64, K64, bp, gi * gt, kb1, c)
                        SWITCH_TILES(nt, PASS, 0)
#undef PASS
                        __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pn.sc + gi * PANEL)));
                        __m512 zf = _mm512_cvtepi32_ps(
                            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(pn.zp + gi * PANEL))));
                        for (long i = 0; i < rows; i++) {
                            __m512 d = _mm512_fnmadd_ps(zf, _mm512_set1_ps((float)xs[(m0 + i) * ngroups + gi]),
                                                        _mm512_cvtepi32_ps(_mm512_load_si512(c + i * PANEL)));
                            _mm512_store_ps(acc + i * PANEL,
                                            _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(sx8[m0 + i])), d,
                                                            _mm512_load_ps(acc + i * PANEL)));
                        }
                    }
                    for (long i = 0; i < rows; i++)
                        _mm512_mask_storeu_ps(y + (m0 + i) * N + pn.n0, mask, _mm512_load_ps(acc + i * PANEL));
                }
            }
        }
        free(bp);
        free(c);
        free(acc);
        _tile_release();
    }
    free(xa);
}
#endif
