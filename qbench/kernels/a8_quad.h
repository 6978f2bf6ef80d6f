/* A panel's k-quads as vpdpbusd's and AMX's B operand want them: a 32-bit lane (or a B tile's 4-byte cell) holds
 * one column's four k. Shared by the AVX-512 VNNI tiles (gemm_a8_vnni.c) and the AMX tiles (gemm_a8_amx.c). */
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "panel.h"

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")))

/* Rows of x whose codes stay in the L2 cache while every panel of the weight passes over them: whole units
 * of a tile's rows, row_bytes each, within budget bytes (at least one unit, at most M). Without blocks, a
 * 1,024-row prefill streamed all of its codes (5 MB for a 4,864-wide down projection) from beyond L2 once
 * per 16-column panel. A row's result does not depend on the block or tile it falls in (exact integer sums,
 * each row closed alone). */
static inline long block_rows(long M, long row_bytes, long budget, long unit) {
    long r = budget / row_bytes / unit * unit;
    return r < unit ? unit : r > M ? M : r;
}

/* k-quad q of an INT8 panel, reordered: lane c = column c's four k (zero past K). */
static inline VNNI __attribute__((always_inline)) __m512i quad_i8(const int8_t *w, long k, long K) {
    const __m512i perm = _mm512_set_epi8(63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12,
                                         59, 43, 27, 11, 58, 42, 26, 10, 57, 41, 25, 9, 56, 40, 24, 8,
                                         55, 39, 23, 7, 54, 38, 22, 6, 53, 37, 21, 5, 52, 36, 20, 4,
                                         51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32, 16, 0);
    __m512i b;
    if (k + 4 <= K) {
        PREFETCH_Q(w + k * PANEL);
        b = _mm512_loadu_si512((const void *)(w + k * PANEL));
    } else {  /* the panel's last rows: the rest of the quad is zero, whatever its activations */
        b = _mm512_maskz_loadu_epi8((__mmask64)((1ULL << ((K - k) * PANEL)) - 1), w + k * PANEL);
    }
    return _mm512_permutexvar_epi8(perm, b);
}

/* k-quad k / 4 of an INT4 panel, unpacked: lane c = column c's four codes, one byte each. */
static inline VNNI __attribute__((always_inline)) __m512i quad_i4(const uint8_t *w, long k) {
    const __m512i perm = _mm512_set_epi8(31, 30, 15, 14, 29, 28, 13, 12, 27, 26, 11, 10, 25, 24, 9, 8,
                                         23, 22, 7, 6, 21, 20, 5, 4, 19, 18, 3, 2, 17, 16, 1, 0,
                                         31, 30, 15, 14, 29, 28, 13, 12, 27, 26, 11, 10, 25, 24, 9, 8,
                                         23, 22, 7, 6, 21, 20, 5, 4, 19, 18, 3, 2, 17, 16, 1, 0);
    const __m512i shift = _mm512_set_epi64(4 * 0x0001000100010001LL, 4 * 0x0001000100010001LL,
                                           4 * 0x0001000100010001LL, 4 * 0x0001000100010001LL, 0, 0, 0, 0);
    __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w + k * (PANEL / 2))));
    return _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi8(perm, b), shift), _mm512_set1_epi8(0x0F));
}

