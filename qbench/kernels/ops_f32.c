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

/* Attention over the block pool.
 * q: (B, T, nh, hd); out: (B, T, nh, hd); pool k/v: (num_blocks, bs, nkv, hd);
 * tables: (B, nblk) int64; qpos: (B, T) int64 absolute positions; qvalid: (B, T) uint8 or NULL.
 * Query (b, t) attends keys 0..qpos (and, with a window, qpos - window < j). Each (b, t, kv head)
 * is one task: its g query heads share every K/V row they load. */
void qb_paged_attention(const float *q, const float *kpool, const float *vpool, const int64_t *tables,
                        const int64_t *qpos, const uint8_t *qvalid, float *out, long B, long T, long nh,
                        long nkv, long hd, long bs, long nblk, long window, float scale, int nthreads) {
    long g = nh / nkv;
    long maxlen = nblk * bs;
    #pragma omp parallel num_threads(nthreads)
    {
        float *scores = (float *)malloc(sizeof(float) * (g * maxlen + 8));
        float *acc = (float *)malloc(sizeof(float) * g * hd);
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
                for (long j = start; j < end; j++) {
                    const float *kr = kpool + ((tab[j / bs] * bs + j % bs) * nkv + kh) * hd;
                    for (long i = 0; i < g; i++) scores[i * maxlen + (j - start)] = dot(qh + i * hd, kr, hd) * scale;
                }
                for (long i = 0; i < g; i++) softmax_row(scores + i * maxlen, n);
                for (long i = 0; i < g * hd; i++) acc[i] = 0.0f;
                for (long j = start; j < end; j++) {
                    const float *vr = vpool + ((tab[j / bs] * bs + j % bs) * nkv + kh) * hd;
                    for (long i = 0; i < g; i++) {
                        __m256 p = _mm256_set1_ps(scores[i * maxlen + (j - start)]);
                        float *a = acc + i * hd;
                        long d = 0;
                        for (; d + 8 <= hd; d += 8)
                            _mm256_storeu_ps(a + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + d), _mm256_loadu_ps(a + d)));
                        for (; d < hd; d++) a[d] += scores[i * maxlen + (j - start)] * vr[d];
                    }
                }
                for (long i = 0; i < g * hd; i++) o[i] = acc[i];
            }
        }
        free(scores);
        free(acc);
    }
}
