/* Panel-packed INT8 / INT4 weights -> fp32, as a dense (K, N) matrix or as fp32 panels (P, K, 16), for
 * prefill-sized GEMMs.
 *
 * The integer GEMMs (gemm_q.c) stream each weight panel once per call and keep a tile of up to 6 rows
 * of x in registers, which is what batch-1 and small-batch decode need. At prefill sizes (hundreds to
 * thousands of rows) every panel re-reads all of x from beyond the L2 cache, and they fall to well
 * under half of a blocked fp32 GEMM's rate. There the weights are dequantized once per call (N x K
 * values, a few milliseconds) into fp32 panels, and the product runs on the blocked panel GEMM
 * (gemm_f32.c), whose fixed order gives the same bits on every CPU. The values written are exactly the
 * dequantized weights the reference path multiplies by: s * q (INT8) and s * (u - z) (INT4, s widened
 * from fp16), one rounding each.
 *
 * Layout: panels = 0 writes out (K, N) row-major; panels = 1 writes out (P, K, 16), every column of the
 * last panel included (padding columns dequantize to zero scales' products; the GEMM never stores them).
 */
#include <immintrin.h>
#include <stdint.h>

#include "panel.h"

static inline float *at(float *out, int panels, long p, long k, long K, long N) {
    return panels ? out + (p * K + k) * PANEL : out + k * N + p * PANEL;
}

/* wp (P, K, 16) int8 (or FP8 bytes), scale (P * 16) fp32 -> out (K, N) fp32, row-major. */
static inline __attribute__((always_inline)) void dequant_8bit(const int F8, const int8_t *wp, const float *scale,
                                                              float *out, long K, long N, int panels,
                                                              int nthreads) {
    long npanels = (N + PANEL - 1) / PANEL;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long p = 0; p < npanels; p++) {
        const int8_t *w = wp + p * K * PANEL;
        long n0 = p * PANEL, nvalid = N - n0 < PANEL ? N - n0 : PANEL;
        __m256 s0 = scale8(F8, scale + n0), s1 = scale8(F8, scale + n0 + 8);
        for (long k = 0; k < K; k++) {
            __m256 w0, w1;
            widen16(F8, w + k * PANEL, &w0, &w1);
            store16(at(out, panels, p, k, K, N), _mm256_mul_ps(w0, s0), _mm256_mul_ps(w1, s1),
                    panels ? PANEL : nvalid);
        }
    }
}

void qb_dequant_i8(const int8_t *wp, const float *scale, float *out, long K, long N, int panels, int nthreads) {
    dequant_8bit(0, wp, scale, out, K, N, panels, nthreads);
}

void qb_dequant_f8(const uint8_t *wp, const float *scale, float *out, long K, long N, int panels, int nthreads) {
    dequant_8bit(1, (const int8_t *)wp, scale, out, K, N, panels, nthreads);
}

/* wp (P, K4 / 2, 16) uint8 in qb_gemm_i4's layout (byte 2c + t of k-pair j holds code(2j + t, c) in its
 * low nibble and code(2j + t, c + 8) in its high one), scales (P, ngroups, 16) fp16, zeros (P, ngroups, 16)
 * uint8 -> out (K, N) fp32, row-major. */
void qb_dequant_i4(const uint8_t *wp, const uint16_t *scales, const uint8_t *zeros, float *out, long K, long N,
                   long G, int panels, int nthreads) {
    long npanels = (N + PANEL - 1) / PANEL;
    long ngroups = (K + G - 1) / G;
    long K4 = (K + 3) & ~3L;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (long p = 0; p < npanels; p++) {
        i4_panel pn = i4_panel_at(wp, scales, zeros, p, K4, ngroups, N);
        const uint8_t *w = pn.w, *zp = pn.zp;
        const uint16_t *sc = pn.sc;
        long nvalid = pn.nvalid;
        for (long gi = 0; gi < ngroups; gi++) {
            __m256 s0, s1;
            __m256i zi0, zi1;
            group_params(sc + gi * PANEL, zp + gi * PANEL, &s0, &s1, &zi0, &zi1);
            __m256 z0 = _mm256_cvtepi32_ps(zi0), z1 = _mm256_cvtepi32_ps(zi1);
            long k1 = (gi + 1) * G < K ? (gi + 1) * G : K;
            for (long k = gi * G; k < k1; k++) {
                const uint8_t *pair = w + (k >> 1) * PANEL;
                uint8_t lo[PANEL / 2 * 2];
                for (int c = 0; c < 8; c++) {  /* byte 2c + t: column c low nibble, column c + 8 high */
                    uint8_t b = pair[2 * c + (k & 1)];
                    lo[c] = b & 0x0F;
                    lo[c + 8] = b >> 4;
                }
                __m128i u = _mm_loadu_si128((const __m128i *)lo);
                __m256 u0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(u));
                __m256 u1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(u, 8)));
                store16(at(out, panels, p, k, K, N), _mm256_mul_ps(_mm256_sub_ps(u0, z0), s0),
                        _mm256_mul_ps(_mm256_sub_ps(u1, z1), s1), panels ? PANEL : nvalid);
            }
        }
    }
}
