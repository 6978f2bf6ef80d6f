/* Shared by the panel GEMM kernels: 16 output columns per panel, stored from two registers. */
#pragma once
#include <immintrin.h>
#include <stdint.h>

#define PANEL 16

/* Store one row of a panel's result; the last panel of a width that is not a multiple of 16
 * writes only its valid columns. */
static inline void store16(float *y, __m256 r0, __m256 r1, long nvalid) {
    if (nvalid == PANEL) { _mm256_storeu_ps(y, r0); _mm256_storeu_ps(y + 8, r1); return; }
    float tmp[PANEL];
    _mm256_storeu_ps(tmp, r0);
    _mm256_storeu_ps(tmp + 8, r1);
    for (long j = 0; j < nvalid; j++) y[j] = tmp[j];
}

/* 16 bytes of a panel row -> columns 0-7 and 8-15 in fp32. INT8 (F8 = 0): the codes. FP8 e4m3 (F8 = 1): the
 * value times 2^-8, exactly, through fp16: with the byte in a 16-bit lane's high half, an arithmetic shift by
 * one puts exponent and mantissa in fp16's bits 13-7 (sign in 15, a copy of it in 14, which is cleared), so
 * the fp16 number is 2^(e - 15) (1 + m / 8) for 2^(e - 7) (1 + m / 8), subnormals included (e = 0 is fp16's
 * subnormal too), and F16C widens it. scale8 folds the 2^8 back into the column scale. */
static inline __attribute__((always_inline)) void widen16(const int F8, const int8_t *p, __m256 *w0, __m256 *w1) {
    if (F8) {
        __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8);
        h = _mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16((short)0xBFFF));
        *w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        *w1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    } else {
        *w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
        *w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
    }
}

/* FP8 rows k and k + 1 of a panel (32 bytes) -> columns 0-7 and 8-15 of each, as widen16 gives them, in fewer
 * operations: the in-lane unpacks against zero put each byte in its 16-bit lane's high half directly (widen16
 * widens and then shifts), and one shift and one mask serve both rows. */
static inline __attribute__((always_inline)) void widen32_f8(const int8_t *p, __m256 *a0, __m256 *a1, __m256 *b0,
                                                             __m256 *b1) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), zero = _mm256_setzero_si256();
    const __m256i m = _mm256_set1_epi16((short)0xBFFF);
    __m256i lo = _mm256_unpacklo_epi8(zero, v), hi = _mm256_unpackhi_epi8(zero, v);  /* [k | k + 1] per lane */
    lo = _mm256_and_si256(_mm256_srai_epi16(lo, 1), m);
    hi = _mm256_and_si256(_mm256_srai_epi16(hi, 1), m);
    *a0 = _mm256_cvtph_ps(_mm256_castsi256_si128(lo));
    *a1 = _mm256_cvtph_ps(_mm256_castsi256_si128(hi));
    *b0 = _mm256_cvtph_ps(_mm256_extracti128_si256(lo, 1));
    *b1 = _mm256_cvtph_ps(_mm256_extracti128_si256(hi, 1));
}

static inline __attribute__((always_inline)) __m256 scale8(const int F8, const float *s) {
    __m256 v = _mm256_loadu_ps(s);
    return F8 ? _mm256_mul_ps(v, _mm256_set1_ps(256.0f)) : v;
}

/* max |x_k| over n floats (0 for n = 0): the scale of a row or group of activations rounded to integers. */
static inline float absmax_f32(const float *x, long n) {
    const __m256 signmask = _mm256_set1_ps(-0.0f);
    __m256 vmax = _mm256_setzero_ps();
    long k = 0;
    for (; k + 8 <= n; k += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(signmask, _mm256_loadu_ps(x + k)));
    float lanes[8], amax = 0.0f;
    _mm256_storeu_ps(lanes, vmax);
    for (int j = 0; j < 8; j++) amax = lanes[j] > amax ? lanes[j] : amax;
    for (; k < n; k++) { float a = x[k] < 0 ? -x[k] : x[k]; amax = a > amax ? a : amax; }
    return amax;
}

/* One group's 16 fp16 weight scales and 16 zero points, widened for columns 0-7 and 8-15. */
static inline __attribute__((always_inline)) void group_params(const uint16_t *sc, const uint8_t *zp, __m256 *s0,
                                                              __m256 *s1, __m256i *z0, __m256i *z1) {
    *s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sc));
    *s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 8)));
    __m128i zb = _mm_loadu_si128((const __m128i *)zp);
    *z0 = _mm256_cvtepu8_epi32(zb);
    *z1 = _mm256_cvtepu8_epi32(_mm_srli_si128(zb, 8));
}

/* Panel p of an INT4 weight in qb_gemm_i4's layout: its packed codes, fp16 scales and zero points, and the
 * output columns it covers. */
typedef struct { const uint8_t *w; const uint16_t *sc; const uint8_t *zp; long n0, nvalid; } i4_panel;

static inline i4_panel i4_panel_at(const uint8_t *wp, const uint16_t *scales, const uint8_t *zeros, long p,
                                   long K4, long ngroups, long N) {
    i4_panel r = {wp + p * K4 * (PANEL / 2), scales + p * ngroups * PANEL, zeros + p * ngroups * PANEL,
                  p * PANEL, 0};
    r.nvalid = N - r.n0 < PANEL ? N - r.n0 : PANEL;
    return r;
}

/* Rows of tile t when M rows are split into ceil(M / cap) tiles of nearly equal size: with tiles of at
 * most 6, a batch of 8 runs as 4 + 4 rather than 6 + 2, so no tile pays a full unpack or weight pass for
 * two rows. */
static inline long split_rows(long M, long t, long cap) {
    long n = (M + cap - 1) / cap, base = M / n, extra = M % n;
    return base + (t < extra ? 1 : 0);
}

/* tile t's rows for the six-row tiles */
static inline long tile_rows(long M, long t) { return split_rows(M, t, 6); }

/* Weights stream from memory once per decode step; the hardware prefetcher alone leaves a small
 * call (tens of microseconds per projection) waiting on memory. Prefetching this many bytes ahead
 * in the panel stream roughly halved the INT4 decode GEMMs' time on a 2-core Xeon. The integer panels
 * are read faster than fp32 ones per byte of weight, and stream best from closer: 1 KiB rather than 4 KiB
 * took 7-8% off there (24 layers of Qwen2.5-0.5B's INT4 projections, 179 MiB: 17.3 against 16.1 GB/s;
 * its INT8 head: 18.3 against 16.9 GB/s, alternating runs), while the fp32 engine lost about 4%. */
#define PF_DIST 4096
#define PF_DIST_Q 1024
#define PREFETCH_Q(p) _mm_prefetch((const char *)(p) + PF_DIST_Q, _MM_HINT_T0)
#define PREFETCH(p) _mm_prefetch((const char *)(p) + PF_DIST, _MM_HINT_T0)

/* An integer tile's row of two accumulators, held in registers: an empty asm after the row's adds, which GCC
 * must take in that order. Without it GCC re-ordered the AVX2 tiles' adds (INT4 and W8A8: the four unrolled
 * k-pairs' int32 adds into trees; W4A8: a quad's eight multiplies before any add), their live values outgrew
 * the 16 ymm registers, and it stored and reloaded accumulators on the stack every step: at batch 32 on an
 * AVX2 EPYC the INT4 kernel ran at 77-84 GMAC/s, no faster than the fp32 panel GEMM (vpmaddwd does twice FMA's
 * multiply-adds per instruction at the same rate); held, 98-115 (SmolLM2's shapes). Integer sums are exact in
 * any order: the same bits. */
#define HOLD_IN_REGS(a, b) __asm__("" : "+x"(a), "+x"(b))

/* fn(MT, args...) with MT a compile-time constant from 1 to 6, so each tile inlines with its own row count. */
#define SWITCH_ROWS(mt, fn, ...) switch (mt) {                                                       \
        case 6: fn(6, __VA_ARGS__); break;                                                           \
        case 5: fn(5, __VA_ARGS__); break;                                                           \
        case 4: fn(4, __VA_ARGS__); break;                                                           \
        case 3: fn(3, __VA_ARGS__); break;                                                           \
        case 2: fn(2, __VA_ARGS__); break;                                                           \
        default: fn(1, __VA_ARGS__); break;                                                          \
    }
