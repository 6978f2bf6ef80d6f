/* INT8 activations against INT4 group weights (W4A8) and INT8 per-channel weights (W8A8), a recipe's
 * `activations: int8`.
 *
 * Each row of x is quantized per token, dynamically and symmetrically: s = absmax / 127, x8 = round(x / s)
 * (to nearest even, as torch.round), so |x8| <= 127. The weights stay in qb_gemm_i4's panel layout, so a
 * W4A8 linear holds the same bytes as a W4A16 one. Per group:
 *   y += s_w * s * (sum_k x8_k u_k - z * sum_k x8_k),
 * with the integer sums exact (at most 15 * 127 * 128 per group), the same closing as qb_gemm_i4.
 *
 * Why it is faster than the int16 path at several rows: _mm256_maddubs_epi16 multiplies 32 unsigned codes by
 * 32 signed activations per instruction, twice _mm256_madd_epi16's 16, and the compute-bound batched decode
 * is limited by those multiplies. Its products land in int16 lanes, in pairs (at most 2 * 15 * 127 = 3,810),
 * so eight of them (32 k) add in int16 without overflow before one _mm256_madd_epi16 by ones widens them
 * to int32. For that widening to sum one column's k, a 32-bit lane must hold one column's four k: the
 * 32 bytes of two k-pairs (qb_gemm_i4's layout) are reordered in registers by a qword permute and a byte
 * shuffle, an in-register cost shared by all rows of a tile.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "panel.h"

#define A8_ROWS 4  /* rows per tile (see WIDEN_MEM) */

/* The AVX-512 VNNI tiles (gemm_a8_vnni.c), taken where qb_a8_wide() says so; they read the codes made here. */
int qb_a8_wide(void);
void a8z_gemm_i8(const int8_t *x8, const float *sx, const int8_t *wp, const float *scale, float *y, long M, long K,
                 long N, int nthreads);
void a8z_gemm_i4(const int8_t *x8, const float *sx8, const int32_t *xs, const uint8_t *wp, const uint16_t *scales,
                 const uint8_t *zeros, float *y, long M, long K4, long N, long G, long ngroups, int nthreads);
/* The AMX tiles (gemm_a8_amx.c), taken where qb_a8_route says so. */
int qb_a8_amx(void);
void ax_gemm_i8(const int8_t *x8, const float *sx, const int8_t *wp, const float *scale, float *y, long M, long K,
                long N, int nthreads);
void ax_gemm_i4(const int8_t *x8, const float *sx8, const int32_t *xs, const uint8_t *wp, const uint16_t *scales,
                const uint8_t *zeros, float *y, long M, long K4, long N, long G, long ngroups, int nthreads);
#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 16  /* below, the VNNI tiles are as fast or faster (AMX pads each tile to 16 rows) */
#endif

/* Which tiles an int8-activation GEMM of M rows takes: 2 AMX, 1 AVX-512 VNNI, 0 AVX2. G: W4A8's group size
 * (AMX needs whole 64-k tiles per group), 0 for W8A8. The tests read it to say which path ran. */
int qb_a8_route(long M, long G) {
    if (!qb_a8_wide()) return 0;
    return M >= AMX_MIN_ROWS && G % 64 == 0 && qb_a8_amx() ? 2 : 1;
}

static inline long tile_rows4(long M, long t) { return split_rows(M, t, A8_ROWS); }  /* ceil(M / 4) tiles */

/* Two k-pairs (k .. k + 3) of a panel -> per 32-bit lane c: column c's four codes (lo) and column c + 8's (hi). */
static inline __attribute__((always_inline)) void unpack_quad(const uint8_t *w, __m256i shuf, __m256i *lo,
                                                              __m256i *hi) {
    /* bytes 0-15: pair j (2c + t: columns c | c + 8 << 4, k = 2j + t); bytes 16-31: pair j + 1.
     * qword permute: lane 0 = columns 0-3 of both pairs, lane 1 = columns 4-7; then the shuffle puts
     * pair j's two bytes of a column beside pair j + 1's. */
    __m256i b = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)w), 0xD8);
    b = _mm256_shuffle_epi8(b, shuf);
    const __m256i m = _mm256_set1_epi8(0x0F);
    *lo = _mm256_and_si256(b, m);
    *hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
}

#define QUAD(kk) { __m256i wlo, whi; unpack_quad(w + (kk) * (PANEL / 2), shuf, &wlo, &whi);                 \
                   ROW8(0, kk) ROW8(1, kk) ROW8(2, kk) ROW8(3, kk) }
#define ROW8(i, kk) if (MT > i) { __m256i xb = _mm256_set1_epi32(*(const int32_t *)(x8 + i * K4 + (kk)));    \
                                  h##i##0 = _mm256_add_epi16(h##i##0, _mm256_maddubs_epi16(wlo, xb));       \
                                  h##i##1 = _mm256_add_epi16(h##i##1, _mm256_maddubs_epi16(whi, xb));       \
                                  HOLD_IN_REGS(h##i##0, h##i##1); }  /* panel.h */
/* int16 block sums -> the group's int32 sums. Up to two rows they stay in registers; with more, in memory: beside
 * them, a tile's accumulators would not fit the 16 ymm registers. So would six rows' int16 ones (12, beside the
 * codes, an activation, the mask and the shuffle): GCC kept those on the stack, a load and a store per add, so
 * a tile takes at most four rows. */
#define WIDEN_REG(i) if (MT > i) { a##i##0 = _mm256_add_epi32(a##i##0, _mm256_madd_epi16(h##i##0, ones));      \
                                   a##i##1 = _mm256_add_epi32(a##i##1, _mm256_madd_epi16(h##i##1, ones)); }
#define STORE_MEM(i) if (MT > i) {                                                                         \
        __m256i *g = (__m256i *)(g32 + i * PANEL);                                                         \
        g[0] = _mm256_madd_epi16(h##i##0, ones);                                                           \
        g[1] = _mm256_madd_epi16(h##i##1, ones); }
#define WIDEN_MEM(i) if (MT > i) {                                                                         \
        __m256i *g = (__m256i *)(g32 + i * PANEL);                                                         \
        g[0] = _mm256_add_epi32(g[0], _mm256_madd_epi16(h##i##0, ones));                                   \
        g[1] = _mm256_add_epi32(g[1], _mm256_madd_epi16(h##i##1, ones)); }
/* d = sum - z * sum_x in fp32 is exact: every term is an integer below 2^24 (15 * 127 * 128), so one fused
 * multiply-add replaces the 32-bit integer multiply (two uops on Zen 3) and the subtraction. */
#define CLOSE8(i, d0i, d1i) if (MT > i) {                                                                  \
        __m256 zs = _mm256_set1_ps((float)xs[i * ngroups + gi]);                                           \
        __m256 sx = _mm256_set1_ps(sx8[i]);                                                                \
        __m256 d0 = _mm256_fnmadd_ps(z0f, zs, _mm256_cvtepi32_ps(d0i));                                    \
        __m256 d1 = _mm256_fnmadd_ps(z1f, zs, _mm256_cvtepi32_ps(d1i));                                    \
        float *yr = acc + i * PANEL;                                                                       \
        _mm256_storeu_ps(yr, _mm256_fmadd_ps(_mm256_mul_ps(s0, sx), d0, _mm256_loadu_ps(yr)));             \
        _mm256_storeu_ps(yr + 8, _mm256_fmadd_ps(_mm256_mul_ps(s1, sx), d1, _mm256_loadu_ps(yr + 8))); }
#define CLOSE_MEM(i) CLOSE8(i, _mm256_load_si256((const __m256i *)(g32 + i * PANEL)),                       \
                            _mm256_load_si256((const __m256i *)(g32 + i * PANEL + 8)))

static inline __attribute__((always_inline)) void tile_i4a8(const int MT, const int8_t *x8, const float *sx8,
                                                           const int32_t *xs, const uint8_t *w, const uint16_t *sc,
                                                           const uint8_t *zp, long K4, long G, long ngroups,
                                                           float *y, long N, long nvalid) {
    const __m256i shuf = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                          0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    const __m256i ones = _mm256_set1_epi16(1);
    float acc[A8_ROWS * PANEL] = {0};
    int32_t g32[A8_ROWS * PANEL] __attribute__((aligned(32)));
    for (long gi = 0; gi < ngroups; gi++) {
        __m256i a00 = _mm256_setzero_si256(), a01 = a00, a10 = a00, a11 = a00;  /* one or two rows */
        long k = gi * G, k1 = (gi + 1) * G < K4 ? (gi + 1) * G : K4;
        int first = 1;  /* a group's first block stores its sums, the next ones add to them */
        while (k < k1) {
            long kb = k + 32 < k1 ? k + 32 : k1;  /* eight k-quads at most: the int16 sums cannot overflow */
            __m256i h00 = _mm256_setzero_si256(), h01 = h00, h10 = h00, h11 = h00, h20 = h00, h21 = h00,
                    h30 = h00, h31 = h00;
            if (MT <= 2)  /* two quads (one 64-byte line) an iteration: the registers allow it */
                for (; k + 8 <= kb; k += 8) {
                    PREFETCH_Q(w + k * (PANEL / 2));
                    QUAD(k) QUAD(k + 4)
                }
            for (; k < kb; k += 4) {  /* with more rows, one an iteration: two would not fit the registers */
                if ((k & 7) == 0) PREFETCH_Q(w + k * (PANEL / 2));
                QUAD(k)
            }
            if (MT <= 2) { WIDEN_REG(0) WIDEN_REG(1) }
            else if (first) { STORE_MEM(0) STORE_MEM(1) STORE_MEM(2) STORE_MEM(3) }
            else { WIDEN_MEM(0) WIDEN_MEM(1) WIDEN_MEM(2) WIDEN_MEM(3) }
            first = 0;
        }
        __m256 s0, s1;
        __m256i z0, z1;
        group_params(sc + gi * PANEL, zp + gi * PANEL, &s0, &s1, &z0, &z1);
        __m256 z0f = _mm256_cvtepi32_ps(z0), z1f = _mm256_cvtepi32_ps(z1);
        if (MT <= 2) { CLOSE8(0, a00, a01) CLOSE8(1, a10, a11) }
        else { CLOSE_MEM(0) CLOSE_MEM(1) CLOSE_MEM(2) CLOSE_MEM(3) }
    }
    for (int i = 0; i < MT; i++)
        store16(y + i * N, _mm256_loadu_ps(acc + i * PANEL), _mm256_loadu_ps(acc + i * PANEL + 8), nvalid);
}
#undef QUAD
#undef ROW8
#undef WIDEN_REG
#undef WIDEN_MEM
#undef STORE_MEM
#undef CLOSE8
#undef CLOSE_MEM

/* A row's activation scale and its reciprocal: those of qbench.quant.primitives.quantize_activations,
 * s = absmax / 127 in fp32 (1 for a zero row); codes are round-to-nearest-even(x * (1 / s)), as
 * _mm256_cvtps_epi32 rounds under the default MXCSR. */
static inline float row_scale(const float *x, long K, float *inv) {
    float amax = absmax_f32(x, K), s = amax > 0.0f ? amax / 127.0f : 1.0f;
    *inv = 1.0f / s;
    return s;
}

/* One row of x (K values) -> int8 codes (zero-padded to K4), its scale, and its code sum per weight group. */
static void row_to_i8(const float *x, long K, long K4, long G, int8_t *q, float *scale, int32_t *sums) {
    long k;
    float inv, s = row_scale(x, K, &inv);
    __m256 vinv = _mm256_set1_ps(inv);
    for (k = 0; k + 8 <= K; k += 8) {
        __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv));
        __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
        _mm_storel_epi64((__m128i *)(q + k), _mm_packs_epi16(w16, w16));
    }
    for (; k < K; k++) q[k] = (int8_t)_mm_cvtss_si32(_mm_set_ss(x[k] * inv));
    for (; k < K4; k++) q[k] = 0;
    for (long g0 = 0, gi = 0; g0 < K; g0 += G, gi++) {
        int32_t total = 0;
        for (long j = g0; j < g0 + G && j < K; j++) total += q[j];
        sums[gi] = total;
    }
    *scale = s;
}

/* x (M, K) fp32; the weight in qb_gemm_i4's layout; y (M, N). */
void qb_gemm_i4a8(const float *x, const uint8_t *wp, const uint16_t *scales, const uint8_t *zeros, float *y,
                  long M, long K, long N, long G, int nthreads) {
    long npanels = (N + PANEL - 1) / PANEL, ngroups = (K + G - 1) / G, K4 = (K + 3) & ~3L;
    int8_t *x8 = (int8_t *)malloc(M * K4 + 64);
    float *sx8 = (float *)malloc(sizeof(float) * M + 16);
    int32_t *xs = (int32_t *)malloc(sizeof(int32_t) * M * ngroups + 16);
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (M >= 16)  /* rows are independent */
    for (long m = 0; m < M; m++) row_to_i8(x + m * K, K, K4, G, x8 + m * K4, sx8 + m, xs + m * ngroups);
    int route = qb_a8_route(M, G);
    if (route) {
        (route == 2 ? ax_gemm_i4 : a8z_gemm_i4)(x8, sx8, xs, wp, scales, zeros, y, M, K4, N, G, ngroups, nthreads);
    } else {
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (long p = 0; p < npanels; p++) {
            i4_panel pn = i4_panel_at(wp, scales, zeros, p, K4, ngroups, N);
            for (long m0 = 0, t = 0; m0 < M; m0 += tile_rows4(M, t++)) {
#define TILE(mt) tile_i4a8(mt, x8 + m0 * K4, sx8 + m0, xs + m0 * ngroups, pn.w, pn.sc, pn.zp, K4, G, ngroups,  \
                         y + m0 * N + pn.n0, N, pn.nvalid)
                switch (tile_rows4(M, t)) {
                    case 4: TILE(4); break;
                    case 3: TILE(3); break;
                    case 2: TILE(2); break;
                    default: TILE(1); break;
                }
#undef TILE
            }
        }
    }
    free(x8);
    free(sx8);
    free(xs);
}

/* W8A8: INT8 weights in qb_gemm_i8's panels ((P, K, 16) int8, one fp32 scale per column) against the same
 * per-token INT8 activations. The products are not unsigned x signed, so _mm256_maddubs_epi16 does not take
 * them without llama.cpp's sign trick, and its int16 pair sums (up to 2 * 127 * 127) would need a widening
 * _mm256_madd_epi16 after every one; _mm256_madd_epi16 on int16 operands does the same multiplies into int32
 * directly. Rows k and k + 1 of a panel are interleaved and sign-extended once per tile (two shuffles and two
 * extensions per k-pair, shared by its rows); each row then costs two madd and two adds per k-pair. The int32
 * column sums are exact (|sum| <= 127 * 127 * K < 2^31 for K < 133,000), and
 *   y = float(sum) * (s_w * s_x),
 * rounded in that order, which the tests reproduce bit for bit from an int64 matmul. */
#define ACC_I8A8(i) __m256i a##i##0 = _mm256_setzero_si256(), a##i##1 = a##i##0;
#define ROW_I8A8(i) if (MT > i) { __m256i xb = _mm256_set1_epi32(*(const int32_t *)(x16 + i * K2 + k));    \
                                  a##i##0 = _mm256_add_epi32(a##i##0, _mm256_madd_epi16(w0, xb));         \
                                  a##i##1 = _mm256_add_epi32(a##i##1, _mm256_madd_epi16(w1, xb));         \
                                  HOLD_IN_REGS(a##i##0, a##i##1); }  /* panel.h */
#define PAIR_I8A8(r1) { __m128i r0 = _mm_loadu_si128((const __m128i *)(w + k * PANEL));                     \
                        __m256i w0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(r0, r1));                      \
                        __m256i w1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(r0, r1));                      \
                        ROW_I8A8(0) ROW_I8A8(1) ROW_I8A8(2) ROW_I8A8(3) ROW_I8A8(4) ROW_I8A8(5) }
#define OUT_I8A8(i) if (MT > i) { __m256 sx = _mm256_set1_ps(sx16[i]);                                      \
        store16(y + i * N, _mm256_mul_ps(_mm256_cvtepi32_ps(a##i##0), _mm256_mul_ps(s0, sx)),              \
                _mm256_mul_ps(_mm256_cvtepi32_ps(a##i##1), _mm256_mul_ps(s1, sx)), nvalid); }
static inline __attribute__((always_inline)) void tile_i8a8(const int MT, const int16_t *x16, const float *sx16,
                                                           const int8_t *w, long K, long K2, const float *scale,
                                                           float *y, long N, long nvalid) {
    ACC_I8A8(0) ACC_I8A8(1) ACC_I8A8(2) ACC_I8A8(3) ACC_I8A8(4) ACC_I8A8(5)
    long k = 0;
    for (; k + 2 <= K; k += 2) {
        if ((k & 3) == 0) PREFETCH_Q(w + k * PANEL);
        PAIR_I8A8(_mm_loadu_si128((const __m128i *)(w + (k + 1) * PANEL)))
    }
    if (k < K) PAIR_I8A8(_mm_setzero_si128())  /* an odd K: the panel ends; x16's padding is zero too */
    __m256 s0 = _mm256_loadu_ps(scale), s1 = _mm256_loadu_ps(scale + 8);
    OUT_I8A8(0) OUT_I8A8(1) OUT_I8A8(2) OUT_I8A8(3) OUT_I8A8(4) OUT_I8A8(5)
}
#undef ACC_I8A8
#undef ROW_I8A8
#undef PAIR_I8A8
#undef OUT_I8A8

/* One row of x -> int16 codes (the int8 grid, zero-padded to K2 = K rounded up to even) and its scale. */
static void row_to_i16(const float *x, long K, long K2, int16_t *q, float *scale) {
    long k;
    float inv;
    *scale = row_scale(x, K, &inv);
    __m256 vinv = _mm256_set1_ps(inv);
    for (k = 0; k + 8 <= K; k += 8) {
        __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vinv));
        _mm_storeu_si128((__m128i *)(q + k), _mm_packs_epi32(_mm256_castsi256_si128(qi),
                                                             _mm256_extracti128_si256(qi, 1)));
    }
    for (; k < K; k++) q[k] = (int16_t)_mm_cvtss_si32(_mm_set_ss(x[k] * inv));
    for (; k < K2; k++) q[k] = 0;
}

/* x (M, K) fp32; the weight in qb_gemm_i8's layout with its per-column scales; y (M, N). */
void qb_gemm_i8a8(const float *x, const int8_t *wp, const float *scale, float *y, long M, long K, long N,
                  int nthreads) {
    int route = qb_a8_route(M, 0);
    if (route) {  /* int8 codes, zero-padded to a multiple of 4 k */
        long K4 = (K + 3) & ~3L;
        int8_t *x8 = (int8_t *)malloc(M * K4 + 64);
        float *sx = (float *)malloc(sizeof(float) * M + 16);
        #pragma omp parallel for num_threads(nthreads) schedule(static) if (M >= 16)
        for (long m = 0; m < M; m++) {
            int32_t sum;  /* one group: unused */
            row_to_i8(x + m * K, K, K4, K4, x8 + m * K4, sx + m, &sum);
        }
        (route == 2 ? ax_gemm_i8 : a8z_gemm_i8)(x8, sx, wp, scale, y, M, K, N, nthreads);
        free(x8);
        free(sx);
        return;
    }
    long npanels = (N + PANEL - 1) / PANEL, K2 = (K + 1) & ~1L;
    int16_t *x16 = (int16_t *)malloc(sizeof(int16_t) * M * K2 + 64);
    float *sx16 = (float *)malloc(sizeof(float) * M + 16);
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (M >= 16)  /* rows are independent */
    for (long m = 0; m < M; m++) row_to_i16(x + m * K, K, K2, x16 + m * K2, sx16 + m);
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long p = 0; p < npanels; p++) {
        long n0 = p * PANEL, nvalid = N - n0 < PANEL ? N - n0 : PANEL;
        const int8_t *w = wp + p * K * PANEL;
        for (long m0 = 0, t = 0; m0 < M; m0 += tile_rows(M, t++)) {
#define TILE(mt, _) tile_i8a8(mt, x16 + m0 * K2, sx16 + m0, w, K, K2, scale + n0, y + m0 * N + n0, N, nvalid)
            SWITCH_ROWS(tile_rows(M, t), TILE, 0)
#undef TILE
        }
    }
    free(x16);
    free(sx16);
}
