/* Causal prefill attention over an fp32 block pool, blocked, in one fixed order.
 *
 * The paged kernel (ops_f32.c) takes one key at a time for each query: right for decode, and about 3x slower
 * than torch's flash kernel on a 4k-token prefill. Torch's flash kernel, for its part, sums scores, softmax
 * and values through MKL and ATen's vector code, whose order and exp follow the CPU (AVX2 or AVX-512, and
 * MKL's own dispatch), so a prefill's last bits, and through a quantized cache's rounding its figures,
 * moved between machines. This kernel runs the same arithmetic in the same order on every CPU:
 *
 * - the keys of a query are taken in blocks of KB = 64 from key 0 (absolute positions), so a query's blocks
 *   do not depend on which other queries share its tile, nor on the tile's size or the thread;
 * - a block's K rows are transposed once (hd x KB) for all the queries of a tile (QT positions times the g
 *   query heads of one KV head); a score is one FMA chain over d from zero against q * scale;
 * - online softmax per query: the block's maximum (exact), alpha = exp(M_old - M_new) and p_j = exp(s_j - M)
 *   with vecmath.h's exp, the block's sum of p_j as 8 lane sums (lane i: keys i, i + 8, .. in order) and
 *   hsum256's tree, then l = l * alpha + that sum; the output o = o * alpha, then one FMA chain over the
 *   block's keys per dimension; keys past the query's position count as p = 0 in the lane sums (an exact
 *   no-op) and are left out of the values' chains;
 * - finally o / l.
 * The scores and the values have AVX2 and AVX-512 forms (qb_isa() == 512) whose lanes do the same operations
 * in the same order, so the bits are the same on an AVX2-only EPYC and an AVX-512 Xeon (tests force both).
 * Padded query rows (valid = 0) get zeros.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vecmath.h"

#define KB 64
#define QT 64

/* s[0..KB) = qs . kt[:, j] for two rows (qs1 may equal qs0): one FMA chain over d per key, the KB keys' chains
 * side by side (independent, so the FMA latency is hidden; each key's order is the same whatever the grouping). */
#define SC(i) a##i = _mm256_fmadd_ps(q0, k##i, a##i); b##i = _mm256_fmadd_ps(q1, k##i, b##i);
static inline void block_scores2(const float *qs0, const float *qs1, const float *kt, long hd, float *s0, float *s1) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0;
    for (long d = 0; d < hd; d++) {
        const __m256 q0 = _mm256_broadcast_ss(qs0 + d), q1 = _mm256_broadcast_ss(qs1 + d);
        const float *k = kt + d * KB;
        __m256 k0 = _mm256_load_ps(k), k1 = _mm256_load_ps(k + 8), k2 = _mm256_load_ps(k + 16),
               k3 = _mm256_load_ps(k + 24);
        SC(0) SC(1) SC(2) SC(3)
        __m256 k4 = _mm256_load_ps(k + 32), k5 = _mm256_load_ps(k + 40), k6 = _mm256_load_ps(k + 48),
               k7 = _mm256_load_ps(k + 56);
        SC(4) SC(5) SC(6) SC(7)
    }
    _mm256_store_ps(s0, a0); _mm256_store_ps(s0 + 8, a1); _mm256_store_ps(s0 + 16, a2); _mm256_store_ps(s0 + 24, a3);
    _mm256_store_ps(s0 + 32, a4); _mm256_store_ps(s0 + 40, a5); _mm256_store_ps(s0 + 48, a6); _mm256_store_ps(s0 + 56, a7);
    _mm256_store_ps(s1, b0); _mm256_store_ps(s1 + 8, b1); _mm256_store_ps(s1 + 16, b2); _mm256_store_ps(s1 + 24, b3);
    _mm256_store_ps(s1 + 32, b4); _mm256_store_ps(s1 + 40, b5); _mm256_store_ps(s1 + 48, b6); _mm256_store_ps(s1 + 56, b7);
}
#undef SC

/* Scores s[0..nj) of one row -> p_j = exp(s_j - m_new) in s (0 from nj to KB), m updated; returns alpha =
 * exp(m_old - m_new) (NAN on the row's first block) and the block's sum: 8 lane sums (lane i: keys i, i + 8, ..
 * in order) and hsum256's tree. The maximum is exact in any order. */
static inline float block_softmax(float *s, long nj, float *m, float *sum) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (long j = nj; j < KB; j++) s[j] = -INFINITY;
    __m256 vm = ninf;
    for (long c = 0; c < KB; c += 8) vm = _mm256_max_ps(vm, _mm256_load_ps(s + c));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float mb = _mm_cvtss_f32(h), mold = *m, mn = mold > mb ? mold : mb;
    const __m256 vmn = _mm256_set1_ps(mn), zero = _mm256_setzero_ps();
    __m256 acc = zero;
    for (long c = 0; c < KB; c += 8) {
        __m256 x = _mm256_load_ps(s + c);
        __m256 e = _mm256_blendv_ps(exp256(_mm256_sub_ps(x, vmn)), zero, _mm256_cmp_ps(x, ninf, _CMP_EQ_OQ));
        _mm256_store_ps(s + c, e);
        acc = _mm256_add_ps(acc, e);
    }
    *sum = hsum256(acc);
    *m = mn;
    return mold == -INFINITY ? NAN : exp1(mold - mn);
}

static inline void scale_row(float *o, float alpha, long hd) {
    const __m256 va = _mm256_set1_ps(alpha);
    for (long d = 0; d < hd; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), va));
}

/* o[d] = fma(p_j, v_j[d], o[d]) for j = 0 .. nj-1 in order: one chain per dimension (vecmath.h's
 * weighted_rows, which the paged attention's values use too). */
static inline void block_values(const float *p, const float *const *vrows, long nj, long hd, float *o) {
    weighted_rows(p, vrows, 0, nj, 0, hd, o);
}

/* The AVX-512 forms of block_scores2 and block_values (taken when qb_isa() == 512): a zmm holds 16 keys' chains
 * (scores) or 16 dimensions' chains (values), each lane's operations those of the AVX2 form, so the same bits;
 * the values go two rows at a time, so eight chains hide the FMA's latency. */
#define AVX512 __attribute__((target("avx512f,avx512vl,fma")))
int qb_isa(void);

static AVX512 void block_scores2_512(const float *qs0, const float *qs1, const float *kt, long hd, float *s0,
                                     float *s1) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (long d = 0; d < hd; d++) {
        const __m512 q0 = _mm512_set1_ps(qs0[d]), q1 = _mm512_set1_ps(qs1[d]);
        const float *k = kt + d * KB;
        const __m512 k0 = _mm512_load_ps(k), k1 = _mm512_load_ps(k + 16), k2 = _mm512_load_ps(k + 32),
                     k3 = _mm512_load_ps(k + 48);
        a0 = _mm512_fmadd_ps(q0, k0, a0); b0 = _mm512_fmadd_ps(q1, k0, b0);
        a1 = _mm512_fmadd_ps(q0, k1, a1); b1 = _mm512_fmadd_ps(q1, k1, b1);
        a2 = _mm512_fmadd_ps(q0, k2, a2); b2 = _mm512_fmadd_ps(q1, k2, b2);
        a3 = _mm512_fmadd_ps(q0, k3, a3); b3 = _mm512_fmadd_ps(q1, k3, b3);
    }
    _mm512_store_ps(s0, a0); _mm512_store_ps(s0 + 16, a1); _mm512_store_ps(s0 + 32, a2); _mm512_store_ps(s0 + 48, a3);
    _mm512_store_ps(s1, b0); _mm512_store_ps(s1 + 16, b1); _mm512_store_ps(s1 + 32, b2); _mm512_store_ps(s1 + 48, b3);
}

/* the keys [j, nj) of one row that the other row of block_values2_512 does not have, into its four chains */
static AVX512 inline __attribute__((always_inline)) void values_rest_512(const float *p, long j, long nj,
                                                                        const float *const *vrows, long d0,
                                                                        __m512 *a0, __m512 *a1, __m512 *a2,
                                                                        __m512 *a3) {
    for (; j < nj; j++) {
        const __m512 x = _mm512_set1_ps(p[j]);
        const float *v = vrows[j] + d0;
        *a0 = _mm512_fmadd_ps(x, _mm512_loadu_ps(v), *a0); *a1 = _mm512_fmadd_ps(x, _mm512_loadu_ps(v + 16), *a1);
        *a2 = _mm512_fmadd_ps(x, _mm512_loadu_ps(v + 32), *a2); *a3 = _mm512_fmadd_ps(x, _mm512_loadu_ps(v + 48), *a3);
    }
}

/* block_values for rows 0 and 1 (o1 NULL: row 0 alone), 64 dimensions at a time; a remainder of hd goes to the
 * AVX2 form, whose order is the same. */
static AVX512 void block_values2_512(const float *p0, long nj0, float *o0, const float *p1, long nj1, float *o1,
                                     const float *const *vrows, long hd) {
    const long both = o1 ? (nj0 < nj1 ? nj0 : nj1) : 0;
    long d0 = 0;
    for (; d0 + 64 <= hd; d0 += 64) {
        __m512 a0 = _mm512_loadu_ps(o0 + d0), a1 = _mm512_loadu_ps(o0 + d0 + 16), a2 = _mm512_loadu_ps(o0 + d0 + 32),
               a3 = _mm512_loadu_ps(o0 + d0 + 48), b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        if (o1) { b0 = _mm512_loadu_ps(o1 + d0); b1 = _mm512_loadu_ps(o1 + d0 + 16); b2 = _mm512_loadu_ps(o1 + d0 + 32);
                  b3 = _mm512_loadu_ps(o1 + d0 + 48); }
        long j = 0;
        for (; j < both; j++) {
            const __m512 x = _mm512_set1_ps(p0[j]), y = _mm512_set1_ps(p1[j]);
            const float *v = vrows[j] + d0;
            const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
                         v3 = _mm512_loadu_ps(v + 48);
            a0 = _mm512_fmadd_ps(x, v0, a0); b0 = _mm512_fmadd_ps(y, v0, b0);
            a1 = _mm512_fmadd_ps(x, v1, a1); b1 = _mm512_fmadd_ps(y, v1, b1);
            a2 = _mm512_fmadd_ps(x, v2, a2); b2 = _mm512_fmadd_ps(y, v2, b2);
            a3 = _mm512_fmadd_ps(x, v3, a3); b3 = _mm512_fmadd_ps(y, v3, b3);
        }
        values_rest_512(p0, j, nj0, vrows, d0, &a0, &a1, &a2, &a3);
        if (o1) {
            values_rest_512(p1, j, nj1, vrows, d0, &b0, &b1, &b2, &b3);
            _mm512_storeu_ps(o1 + d0, b0); _mm512_storeu_ps(o1 + d0 + 16, b1); _mm512_storeu_ps(o1 + d0 + 32, b2);
            _mm512_storeu_ps(o1 + d0 + 48, b3);
        }
        _mm512_storeu_ps(o0 + d0, a0); _mm512_storeu_ps(o0 + d0 + 16, a1); _mm512_storeu_ps(o0 + d0 + 32, a2);
        _mm512_storeu_ps(o0 + d0 + 48, a3);
    }
    if (d0 < hd) {  /* the remainder: the AVX2 form on the columns left (it starts at a multiple of 64) */
        weighted_rows(p0, vrows, 0, nj0, d0, hd, o0);
        if (o1) weighted_rows(p1, vrows, 0, nj1, d0, hd, o1);
    }
}

/* q (B, T, nh, hd), pool (num_blocks, bs, nkv, hd), tables (B, nblk), qpos (B, T) each query's position in its
 * sequence's cache (it attends keys 0..qpos, all written), qvalid (B, T) or NULL -> out (B, T, nh, hd).
 * hd must be a multiple of 8. */
void qb_prefill_attention(const float *q, const float *kpool, const float *vpool, const int64_t *tables,
                          const int64_t *qpos, const uint8_t *qvalid, float *out, long B, long T, long nh,
                          long nkv, long hd, long bs, long nblk, float scale, int nthreads) {
    const long g = nh / nkv, tiles = (T + QT - 1) / QT, rows_max = QT * g;
    const int wide = qb_isa() == 512;
    #pragma omp parallel num_threads(nthreads)
    {
        float *kt = (float *)aligned_alloc(64, sizeof(float) * hd * KB);
        float *qs = (float *)malloc(sizeof(float) * rows_max * hd);
        float *o = (float *)malloc(sizeof(float) * rows_max * hd);
        float *m = (float *)malloc(sizeof(float) * rows_max), *l = (float *)malloc(sizeof(float) * rows_max);
        long *rp = (long *)malloc(sizeof(long) * rows_max);   /* each row's position, -1 for a padded row */
        const float **vrows = (const float **)malloc(sizeof(float *) * KB);
        long *act = (long *)malloc(sizeof(long) * rows_max);
        float s[KB] __attribute__((aligned(64))), s2[KB] __attribute__((aligned(64)));
        #pragma omp for schedule(dynamic, 1) collapse(3)
        for (long b = 0; b < B; b++)
            for (long kh = 0; kh < nkv; kh++)
                for (long tile = 0; tile < tiles; tile++) {
                    const long t0 = tile * QT, nt = T - t0 < QT ? T - t0 : QT, rows = nt * g;
                    const int64_t *tab = tables + b * nblk;
                    long pmax = -1;
                    for (long r = 0; r < rows; r++) {  /* row r: position t0 + r / g, query head kh * g + r % g */
                        long bt = b * T + t0 + r / g;
                        rp[r] = qvalid && !qvalid[bt] ? -1 : qpos[bt];
                        pmax = rp[r] > pmax ? rp[r] : pmax;
                        const float *qr = q + (bt * nh + kh * g + r % g) * hd;
                        for (long d = 0; d < hd; d++) qs[r * hd + d] = qr[d] * scale;
                        m[r] = -INFINITY;
                        l[r] = 0.0f;
                        memset(o + r * hd, 0, sizeof(float) * hd);
                    }
                    for (long k0 = 0; k0 <= pmax; k0 += KB) {
                        const long n = pmax + 1 - k0 < KB ? pmax + 1 - k0 : KB;
                        for (long j = 0; j < KB; j++) {
                            if (j < n) {
                                long key = k0 + j, slot = (tab[key / bs] * bs + key % bs) * nkv + kh;
                                const float *kr = kpool + slot * hd;
                                for (long d = 0; d < hd; d++) kt[d * KB + j] = kr[d];
                                vrows[j] = vpool + slot * hd;
                            } else {
                                for (long d = 0; d < hd; d++) kt[d * KB + j] = 0.0f;
                            }
                        }
                        long na = 0;
                        for (long r = 0; r < rows; r++)  /* rows with a key in this block (not padded, not all future) */
                            if (rp[r] >= k0) act[na++] = r;
                        for (long i = 0; i < na; i += 2) {
                            const long r0 = act[i], r1 = i + 1 < na ? act[i + 1] : act[i], pair = r1 != r0;
                            if (wide) block_scores2_512(qs + r0 * hd, qs + r1 * hd, kt, hd, s, s2);
                            else block_scores2(qs + r0 * hd, qs + r1 * hd, kt, hd, s, s2);
                            long nj[2];
                            for (int u = 0; u <= pair; u++) {
                                const long r = u ? r1 : r0;
                                float *p = u ? s2 : s, sum;
                                nj[u] = rp[r] - k0 + 1 < n ? rp[r] - k0 + 1 : n;
                                const float alpha = block_softmax(p, nj[u], m + r, &sum);
                                float *orow = o + r * hd;
                                if (isnan(alpha)) { l[r] = sum; memset(orow, 0, sizeof(float) * hd); }
                                else { l[r] = l[r] * alpha + sum; scale_row(orow, alpha, hd); }
                                if (!wide) block_values(p, vrows, nj[u], hd, orow);
                            }
                            if (wide) block_values2_512(s, nj[0], o + r0 * hd, s2, pair ? nj[1] : 0, pair ? o + r1 * hd : NULL,
                                                        vrows, hd);
                        }
                    }
                    for (long r = 0; r < rows; r++) {
                        long bt = b * T + t0 + r / g;
                        float *dst = out + (bt * nh + kh * g + r % g) * hd;
                        if (rp[r] < 0) { memset(dst, 0, sizeof(float) * hd); continue; }
                        const __m256 vl = _mm256_set1_ps(l[r]);
                        for (long d = 0; d < hd; d += 8)
                            _mm256_storeu_ps(dst + d, _mm256_div_ps(_mm256_loadu_ps(o + r * hd + d), vl));
                    }
                }
        free(kt); free(qs); free(o); free(m); free(l); free(rp); free(vrows); free(act);
    }
}
