/* Fused fp32 layer ops for the decode hot path: RMSNorm, SiLU-gate, RoPE, and attention
 * that reads K/V straight from the block pool through block tables (no gather copy).
 * Each has a torch reference in qbench.layers; tests compare the two.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <stdint.h>

#include "vecmath.h"

static inline float dot(const float *a, const float *b, long n) {
    __m256 acc = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum256(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, rows of width n. */
void qb_rmsnorm(const float *x, const float *w, float *y, long rows, long n, float eps, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 4)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        float inv = 1.0f / sqrtf(dot(xr, xr, n) / (float)n + eps);
        long i = 0;
        __m256 vi = _mm256_set1_ps(inv);
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vi), _mm256_loadu_ps(w + i)));
        for (; i < n; i++) yr[i] = xr[i] * inv * w[i];
    }
}

/* gu (rows, 2n) = [gate | up] -> y (rows, n) = silu(gate) * up. */
void qb_silu_mul(const float *gu, float *y, long rows, long n, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 4)
    for (long r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * n, *u = g + n;
        float *yr = y + r * n;
        long i = 0;
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
        for (; i < n; i++) yr[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Rotate heads [0, nrot) of each token in place, half-split layout; cos/sin tables (P, hd/2). */
void qb_rope(float *x, const int64_t *pos, const float *cos_t, const float *sin_t, long ntok, long nheads,
             long nrot, long hd, int nthreads) {
    long half = hd / 2;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (ntok > 4)
    for (long t = 0; t < ntok; t++) {
        const float *c = cos_t + pos[t] * half, *s = sin_t + pos[t] * half;
        for (long h = 0; h < nrot; h++) {
            float *a = x + (t * nheads + h) * hd, *b = a + half;
            for (long i = 0; i < half; i++) {
                float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

/* Four dot products of q with keys k0..k3 (n = hd, a multiple of 8), each summed exactly as dot() sums one:
 * an 8-lane FMA chain over d, then hsum256's order ((l0 + l2) + (l1 + l3) of l = low half + high half). The four
 * chains interleave, so each key no longer waits on its own FMA and horizontal-sum latency; a transpose of
 * the four halved sums gives every key's lanes in one register. */
static inline __m128 dot4(const float *q, const float *k0, const float *k1, const float *k2, const float *k3,
                          long n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (long d = 0; d < n; d += 8) {
        __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
    }
#define HALVES4(a) _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1))
    __m128 l0 = HALVES4(a0), l1 = HALVES4(a1), l2 = HALVES4(a2), l3 = HALVES4(a3);
#undef HALVES4
    _MM_TRANSPOSE4_PS(l0, l1, l2, l3);  /* l_j = lane j of keys 0..3 */
    return _mm_add_ps(_mm_add_ps(l0, l2), _mm_add_ps(l1, l3));
}

#define KEY_CHUNK 32

/* Attention over the block pool.
 * q: (B, T, nh, hd); out: (B, T, nh, hd); pool k/v: (num_blocks, bs, nkv, hd);
 * tables: (B, nblk) int64; qpos: (B, T) int64 absolute positions; qvalid: (B, T) uint8 or NULL.
 * Query (b, t) attends keys 0..qpos (and, with a window, qpos - window < j). Each (b, t, kv head)
 * is one task: its g query heads share every K/V row they load. Keys go in chunks of KEY_CHUNK, which stay
 * in L1 while each head takes them: scores four keys at a time (dot4), the weighted sum of V with 64 output
 * dimensions in registers (weighted_rows). Both sum every element in the order a key at a time did (one FMA
 * chain over keys per element; dot()'s order per score), so the results are the same bits as before. */
void qb_paged_attention(const float *q, const float *kpool, const float *vpool, const int64_t *tables,
                        const int64_t *qpos, const uint8_t *qvalid, float *out, long B, long T, long nh,
                        long nkv, long hd, long bs, long nblk, long window, float scale, int nthreads) {
    long g = nh / nkv;
    long maxlen = nblk * bs;
    #pragma omp parallel num_threads(nthreads)
    {
        float *scores = (float *)malloc(sizeof(float) * (g * maxlen + 8));
        const float **rows = (const float **)malloc(sizeof(float *) * (maxlen + 8));
        #pragma omp for schedule(dynamic, 1) collapse(2)
        for (long bt = 0; bt < B * T; bt++) {
            for (long kh = 0; kh < nkv; kh++) {
                long b = bt / T;
                float *o = out + (bt * nh + kh * g) * hd;
                if (qvalid && !qvalid[bt]) {
                    for (long i = 0; i < g * hd; i++) o[i] = 0.0f;
                    continue;
                }
                long end = qpos[bt] + 1;
                long start = (window > 0 && end > window) ? end - window : 0;
                long n = end - start;
                const float *qh = q + (bt * nh + kh * g) * hd;
                const int64_t *tab = tables + b * nblk;
                for (long j = start; j < end; j++) rows[j - start] = kpool + ((tab[j / bs] * bs + j % bs) * nkv + kh) * hd;
                for (long j0 = 0; j0 < n; j0 += KEY_CHUNK) {  /* a chunk of keys stays in L1 for the g heads */
                    long j1 = j0 + KEY_CHUNK < n ? j0 + KEY_CHUNK : n;
                    for (long i = 0; i < g; i++) {
                        const float *qi = qh + i * hd;
                        float *si = scores + i * maxlen;
                        long j = j0;
                        if (hd % 8 == 0)
                            for (; j + 4 <= j1; j += 4)
                                _mm_storeu_ps(si + j, _mm_mul_ps(dot4(qi, rows[j], rows[j + 1], rows[j + 2], rows[j + 3], hd),
                                                                 _mm_set1_ps(scale)));
                        for (; j < j1; j++) si[j] = dot(qi, rows[j], hd) * scale;
                    }
                }
                for (long i = 0; i < g; i++) softmax_row(scores + i * maxlen, n);
                for (long j = start; j < end; j++) rows[j - start] = vpool + ((tab[j / bs] * bs + j % bs) * nkv + kh) * hd;
                for (long i = 0; i < g * hd; i++) o[i] = 0.0f;
                for (long j0 = 0; j0 < n; j0 += KEY_CHUNK) {
                    long j1 = j0 + KEY_CHUNK < n ? j0 + KEY_CHUNK : n;
                    for (long i = 0; i < g; i++)
                        weighted_rows(scores + i * maxlen, rows, j0, j1, 0, hd, o + i * hd);
                }
            }
        }
        free(scores);
        free(rows);
    }
}

/* x (rows, K) in place -> x H, H block-diagonal of unnormalised Sylvester Hadamard blocks of b (a power of two
 * dividing K): the butterflies of qbench/quant/hadamard.py's fwht in its order (h = 1, 2, 4, ..; pair (i, i + h)
 * -> (a + c, a - c)), each an exact fp32 add or subtract, so the two give the same bits. */
void qb_fwht(float *x, long rows, long K, long b, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 4)
    for (long r = 0; r < rows; r++) {
        for (long s = 0; s < K; s += b) {
            float *v = x + r * K + s;
            long h = 1;
            for (; h < 8 && h < b; h *= 2)
                for (long i = 0; i < b; i += 2 * h)
                    for (long j = i; j < i + h; j++) {
                        float a = v[j], c = v[j + h];
                        v[j] = a + c;
                        v[j + h] = a - c;
                    }
            for (; h < b; h *= 2)  /* runs of 8 pairs: whole ymm registers */
                for (long i = 0; i < b; i += 2 * h)
                    for (long j = i; j < i + h; j += 8) {
                        __m256 a = _mm256_loadu_ps(v + j), c = _mm256_loadu_ps(v + j + h);
                        _mm256_storeu_ps(v + j, _mm256_add_ps(a, c));
                        _mm256_storeu_ps(v + j + h, _mm256_sub_ps(a, c));
                    }
        }
    }
}

/* x (rows, n) -> y = log_softmax(x) per row, in one order on every CPU (torch's sums its exponentials in an
 * order that follows the vector width, and takes them from MKL, whose code path follows the CPU): the
 * maximum (exact), exp(x - max) with vecmath.h's exp, their sum in float64 (8 lanes over the row in order, then
 * the lanes in order, then the tail one at a time), lse = log of it rounded to float, y = (x - max) - lse. */
void qb_log_softmax(const float *x, float *y, long rows, long n, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 1)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        const float m = row_max(xr, n);
        const __m256 vm = _mm256_set1_ps(m);
        __m256d s0 = _mm256_setzero_pd(), s1 = s0;
        long j = 0;
        for (; j + 8 <= n; j += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(xr + j), vm));
            s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        }
        double lanes[8], sum = 0.0;
        _mm256_storeu_pd(lanes, s0);
        _mm256_storeu_pd(lanes + 4, s1);
        for (int i = 0; i < 8; i++) sum += lanes[i];
        for (; j < n; j++) sum += (double)exp1(xr[j] - m);
        const float lse = (float)log(sum);
        for (j = 0; j < n; j++) yr[j] = (xr[j] - m) - lse;
    }
}
