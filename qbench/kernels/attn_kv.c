/* Decode attention over a block pool whose rows are not fp32: KIVI-quantized blocks (K per channel, V per
 * token, 8/4/2 bits), FP8 (e4m3, one scale per token), fp16 and bf16, plus the fp32 residual ring of a
 * quantized cache. Rows are dequantized in registers as they are read: the cache is never expanded.
 *
 * Codes are packed along head_dim, lowest index in the lowest bits (layers/kvquant.py). Eight bytes hold
 * C = 8 * per values (per = 8 / bits); unpacking them as 8 int32 lanes and shifting by t * bits gives lane l
 * the value of channel l * per + t. Rather than interleave those back, the query (for K) and the value
 * accumulator (for V) are kept in that permuted order, "perm" below: position c*C + t*8 + l <-> channel
 * c*C + l*per + t. Both are sums over channels, so the order costs nothing but the final un-permute.
 *   K per channel (block-wide scale s and min m per channel): q.k = sum_d (q_d s_d) u_d + sum_d q_d m_d, so
 *   q*s is formed once per block and head, and each key costs one fused multiply-add per 8 codes.
 *   V per token (scale and min per group of vg channels): p v = (p s_g) u + p m_g; the min part is summed
 *   per group and added once at the end.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "vecmath.h"

enum { KV_F32 = 0, KV_CHANNEL = 1, KV_TOKEN = 2, KV_FP8 = 3, KV_F16 = 4, KV_BF16 = 5 };
#define MAXHD 256

static float fp8_lut[256];

/* e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN */
static void fp8_lut_init(void) {
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 15, m = b & 7;
        float v = e == 0 ? ldexpf((float)m / 8.0f, -6) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
        if (e == 15 && m == 7) v = NAN;
        fp8_lut[b] = (b & 128) ? -v : v;
    }
}

static inline __m256i u8x8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

/* lane l of field t: (byte l >> t*bits) & mask, as float */
static inline __m256 field(__m256i u, __m256i shift, __m256i mask) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(u, shift), mask));
}

/* 8 consecutive channels of a row stored in a natural-order mode (fp32, fp16, bf16, fp8 without its scale) */
static inline __m256 load8(int mode, const void *row, long d) {
    switch (mode) {
    case KV_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + d)));
    case KV_BF16: return _mm256_castsi256_ps(_mm256_slli_epi32(
                      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + d))), 16));
    case KV_FP8: return _mm256_i32gather_ps(fp8_lut, u8x8((const uint8_t *)row + d), 4);
    default: return _mm256_loadu_ps((const float *)row + d);
    }
}

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

typedef struct {
    int mode, bits;
    long vg;                     /* channels per V statistic (KV_TOKEN) */
    const uint8_t *codes;        /* (num_blocks, bs, nkv, row bytes) */
    const uint16_t *scale, *mn;  /* fp16 statistics in the codec's shape */
} kv_src;

static long row_bytes(const kv_src *s, long hd) {
    switch (s->mode) {
    case KV_CHANNEL: case KV_TOKEN: return hd * s->bits / 8;
    case KV_FP8: return hd;
    case KV_F16: case KV_BF16: return 2 * hd;
    default: return 4 * hd;
    }
}

/* Block jb of a sequence's keys or values: the rows [j0, j1) of the query's span it holds, and where they
 * lie: in the fp32 residual ring (ring != NULL) or in the pool, as block blk's codes. */
typedef struct { long j0, j1, blk; const float *ring; const uint8_t *codes; } kv_span;

static inline kv_span span_at(long jb, long start, long end, long bs, const int64_t *tab, long nq, const float *r,
                              long slot, long W, long nkv, long kh, long hd, const uint8_t *codes, long rb) {
    kv_span sp;
    sp.j0 = jb * bs > start ? jb * bs : start;
    sp.j1 = (jb + 1) * bs < end ? (jb + 1) * bs : end;
    sp.blk = tab[jb];
    sp.ring = jb >= nq ? r + ((slot * W + jb % W) * bs * nkv + kh) * hd : NULL;
    sp.codes = codes + (sp.blk * bs * nkv + kh) * rb;
    return sp;
}

/* row off of a span: an fp32 ring row, or a pool row of rb bytes */
static inline const void *span_row(const kv_span *sp, long off, long nkv, long hd, long rb) {
    return sp->ring ? (const void *)(sp->ring + off * nkv * hd) : (const void *)(sp->codes + off * nkv * rb);
}

/* Scores of NG query heads (NG <= 8, a compile-time constant so the accumulators stay in registers) against
 * one key row: natural-order rows (fp32 ring, fp16, bf16, FP8) or KIVI codes against q*s in perm order. */
static inline __attribute__((always_inline)) void score_row(const int NG, int mode, const void *row,
                                                            const float *qh, long qstride, long hd, float *out) {
    __m256 a[8], b[8];
    for (int i = 0; i < NG; i++) a[i] = b[i] = _mm256_setzero_ps();
    long d = 0;
    for (; d + 16 <= hd; d += 16) {  /* two chains per head: the FMA latency is hidden */
        __m256 v = load8(mode, row, d), w = load8(mode, row, d + 8);
        for (int i = 0; i < NG; i++) {
            a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i * qstride + d), v, a[i]);
            b[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i * qstride + d + 8), w, b[i]);
        }
    }
    for (; d < hd; d += 8) {
        __m256 v = load8(mode, row, d);
        for (int i = 0; i < NG; i++) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i * qstride + d), v, a[i]);
    }
    for (int i = 0; i < NG; i++) out[i] = hsum256(_mm256_add_ps(a[i], b[i]));
}

static inline __attribute__((always_inline)) void score_codes(const int NG, const uint8_t *row, const float *qs,
                                                              long hd, int per, int bits, float *out) {
    __m256 a[8], b[8];
    const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
    for (int i = 0; i < NG; i++) a[i] = b[i] = _mm256_setzero_ps();
    const long C = 8 * per;
    for (long c = 0; c < hd / C; c++) {
        __m256i u = u8x8(row + c * 8);
        for (int t = 0; t < per; t++) {
            __m256 v = field(u, _mm256_set1_epi32(t * bits), mask);
            for (int i = 0; i < NG; i++) {
                if (t & 1) b[i] = _mm256_fmadd_ps(_mm256_load_ps(qs + i * MAXHD + c * C + t * 8), v, b[i]);
                else a[i] = _mm256_fmadd_ps(_mm256_load_ps(qs + i * MAXHD + c * C + t * 8), v, a[i]);
            }
        }
    }
    for (int i = 0; i < NG; i++) out[i] = hsum256(_mm256_add_ps(a[i], b[i]));
}

/* One V chunk (8 bytes of codes: 8 * PER channels in perm order) of a block's rows, for NG heads: the
 * accumulators stay in registers across the rows and are added to acc once. w (rows, wstride): each row's
 * weight p * s for each head. NG * PER <= 8. */
static inline __attribute__((always_inline)) void vchunk(const int NG, const int PER, const uint8_t *codes,
                                                         long rstride, long nrow, const float *w, long wstride,
                                                         float *acc, int bits) {
    __m256 a[8][4];
    const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
    for (int i = 0; i < NG; i++)
        for (int t = 0; t < PER; t++) a[i][t] = _mm256_setzero_ps();
    for (long r = 0; r < nrow; r++) {
        __m256i u = u8x8(codes + r * rstride);
        for (int t = 0; t < PER; t++) {
            __m256 v = field(u, _mm256_set1_epi32(t * bits), mask);
            for (int i = 0; i < NG; i++) a[i][t] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + r * wstride + i), v, a[i][t]);
        }
    }
    for (int i = 0; i < NG; i++)
        for (int t = 0; t < PER; t++)
            _mm256_store_ps(acc + i * MAXHD + t * 8, _mm256_add_ps(_mm256_load_ps(acc + i * MAXHD + t * 8), a[i][t]));
}

#define VCHUNK(NG, ...) vchunk(NG, __VA_ARGS__)

/* score_codes for two rows at once: each q*s load serves both, and the two rows are independent chains. */
static inline __attribute__((always_inline)) void score_codes2(const int NG, const uint8_t *row0, const uint8_t *row1,
                                                               const float *qs, long hd, int per, int bits,
                                                               float *out0, float *out1) {
    __m256 a[4], b[4];
    const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
    for (int i = 0; i < NG; i++) a[i] = b[i] = _mm256_setzero_ps();
    const long C = 8 * per;
    for (long c = 0; c < hd / C; c++) {
        __m256i u = u8x8(row0 + c * 8), w = u8x8(row1 + c * 8);
        for (int t = 0; t < per; t++) {
            __m256i sh = _mm256_set1_epi32(t * bits);
            __m256 v = field(u, sh, mask), x = field(w, sh, mask);
            for (int i = 0; i < NG; i++) {
                __m256 qv = _mm256_load_ps(qs + i * MAXHD + c * C + t * 8);
                a[i] = _mm256_fmadd_ps(qv, v, a[i]);
                b[i] = _mm256_fmadd_ps(qv, x, b[i]);
            }
        }
    }
    for (int i = 0; i < NG; i++) { out0[i] = hsum256(a[i]); out1[i] = hsum256(b[i]); }
}

#define SWITCH_HEADS(ng, fn, ...) switch (ng) {                                                      \
        case 8: fn(8, __VA_ARGS__); break; case 7: fn(7, __VA_ARGS__); break;                        \
        case 6: fn(6, __VA_ARGS__); break; case 5: fn(5, __VA_ARGS__); break;                        \
        case 4: fn(4, __VA_ARGS__); break; case 3: fn(3, __VA_ARGS__); break;                        \
        case 2: fn(2, __VA_ARGS__); break; default: fn(1, __VA_ARGS__); break; }
#define SWITCH_HEADS4(ng, fn, ...) switch (ng) {                                                     \
        case 4: fn(4, __VA_ARGS__); break; case 3: fn(3, __VA_ARGS__); break;                        \
        case 2: fn(2, __VA_ARGS__); break; default: fn(1, __VA_ARGS__); break; }

/* q (B, T, nh, hd); out (B, T, nh, hd); tables (B, nblk); qpos (B, T); qvalid (B, T) uint8 or NULL;
 * ctx (B,) tokens cached after this step; slots (B,) residual ring slots; rk/rv (seqs, W, bs, nkv, hd) fp32.
 * W == 0: no ring, every block is read from the pool (an fp16 or bf16 cache). */
void qb_attention_kv(const float *q, float *out, long B, long T, long nh, long nkv, long hd, long bs, long nblk,
                     const int64_t *tables, const int64_t *qpos, const uint8_t *qvalid, const int64_t *ctx,
                     const int64_t *slots, long W, const float *rk, const float *rv, long window, float scale,
                     int kmode, int kbits, const uint8_t *kc, const uint16_t *ks, const uint16_t *km,
                     int vmode, int vbits, long vg, const uint8_t *vc, const uint16_t *vs, const uint16_t *vm,
                     int nthreads) {
    static int lut_ready = 0;
    if (!lut_ready) { fp8_lut_init(); lut_ready = 1; }  /* idempotent: a racing second init writes the same */
    const kv_src K = {kmode, kbits, 0, kc, ks, km}, V = {vmode, vbits, vg, vc, vs, vm};
    const long g = nh / nkv, maxlen = nblk * bs, krb = row_bytes(&K, hd), vrb = row_bytes(&V, hd);
    const int kper = kmode == KV_CHANNEL ? 8 / kbits : 1, vper = vmode == KV_TOKEN ? 8 / vbits : 1;
    const long kC = 8 * kper, vC = 8 * vper, nvg = vmode == KV_TOKEN ? hd / vg : 1, nvc = hd / vC;
    int kperm[MAXHD], vperm[MAXHD], vgroup_of[MAXHD];  /* channel d -> its perm position; V chunk -> group */
    for (long d = 0; d < hd; d++) {
        kperm[d] = (int)((d / kC) * kC + (d % kC % kper) * 8 + d % kC / kper);
        vperm[d] = (int)((d / vC) * vC + (d % vC % vper) * 8 + d % vC / vper);
    }
    for (long c = 0; c < nvc; c++) vgroup_of[c] = vmode == KV_TOKEN ? (int)(c * vC / vg) : 0;
    #pragma omp parallel num_threads(nthreads)
    {
        float *scores = (float *)malloc(sizeof(float) * (g * maxlen + 8));
        float *qs = (float *)aligned_alloc(64, sizeof(float) * g * MAXHD);       /* q*s, perm order */
        float *accn = (float *)aligned_alloc(64, sizeof(float) * g * MAXHD);     /* natural order */
        float *accp = (float *)aligned_alloc(64, sizeof(float) * g * MAXHD);     /* perm order */
        float *bias = (float *)malloc(sizeof(float) * g * (nvg + 1));
        float *c0 = (float *)malloc(sizeof(float) * g), *sblk = (float *)malloc(sizeof(float) * 2 * MAXHD);
        float *sc = (float *)malloc(sizeof(float) * g), *sc2 = (float *)malloc(sizeof(float) * g);
        float *wbuf = (float *)malloc(sizeof(float) * g * bs);  /* a block's rows x heads: p * s */
        #pragma omp for schedule(dynamic, 1) collapse(2)
        for (long bt = 0; bt < B * T; bt++) {
            for (long kh = 0; kh < nkv; kh++) {
                const long b = bt / T;
                float *o = out + (bt * nh + kh * g) * hd;
                if (qvalid && !qvalid[bt]) { memset(o, 0, sizeof(float) * g * hd); continue; }
                const long end = qpos[bt] + 1, start = (window > 0 && end > window) ? end - window : 0, n = end - start;
                const long nq = W > 0 ? (ctx[b] / bs - (W - 1) > 0 ? ctx[b] / bs - (W - 1) : 0) : nblk;
                const float *qh = q + (bt * nh + kh * g) * hd;
                const int64_t *tab = tables + b * nblk;
                const long slot = slots ? slots[b] : 0;
                for (long jb = start / bs; jb * bs < end; jb++) {  /* scores: (g, n), block by block */
                    const kv_span sp = span_at(jb, start, end, bs, tab, nq, rk, slot, W, nkv, kh, hd, K.codes, krb);
                    const long j0 = sp.j0, j1 = sp.j1, blk = sp.blk;
                    const int in_ring = sp.ring != NULL;
                    if (in_ring || K.mode != KV_CHANNEL) {
                        const int mode = in_ring ? KV_F32 : K.mode;
                        for (long j = j0; j < j1; j++) {
                            const long off = j - jb * bs;
                            const void *row = span_row(&sp, off, nkv, hd, krb);
                            float mul = scale;
                            if (!in_ring && K.mode == KV_FP8) mul *= half_to_float(K.scale[blk * bs + off]);
                            for (long i0 = 0; i0 < g; i0 += 8) {
                                long ng = g - i0 < 8 ? g - i0 : 8;
                                SWITCH_HEADS(ng, score_row, mode, row, qh + i0 * hd, hd, hd, sc + i0)
                            }
                            for (long i = 0; i < g; i++) scores[i * maxlen + j - start] = sc[i] * mul;
                        }
                        continue;
                    }
                    /* a KIVI block: its channel scales and mins meet the query once */
                    const uint16_t *s16 = K.scale + (blk * nkv + kh) * hd, *m16 = K.mn + (blk * nkv + kh) * hd;
                    for (long d = 0; d < hd; d += 8) {
                        _mm256_storeu_ps(sblk + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s16 + d))));
                        _mm256_storeu_ps(sblk + MAXHD + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m16 + d))));
                    }
                    for (long i = 0; i < g; i++) {
                        for (long d = 0; d < hd; d++) qs[i * MAXHD + kperm[d]] = qh[i * hd + d] * sblk[d];
                        __m256 c = _mm256_setzero_ps();
                        for (long d = 0; d < hd; d += 8)
                            c = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i * hd + d), _mm256_loadu_ps(sblk + MAXHD + d), c);
                        c0[i] = hsum256(c);
                    }
                    long j = j0;
                    for (; j + 2 <= j1; j += 2) {
                        const uint8_t *row = sp.codes + (j - jb * bs) * nkv * krb;
                        for (long i0 = 0; i0 < g; i0 += 4) {
                            long ng = g - i0 < 4 ? g - i0 : 4;
                            SWITCH_HEADS4(ng, score_codes2, row, row + nkv * krb, qs + i0 * MAXHD, hd, kper, kbits,
                                          sc + i0, sc2 + i0)
                        }
                        for (long i = 0; i < g; i++) {
                            scores[i * maxlen + j - start] = (sc[i] + c0[i]) * scale;
                            scores[i * maxlen + j + 1 - start] = (sc2[i] + c0[i]) * scale;
                        }
                    }
                    for (; j < j1; j++) {
                        const uint8_t *row = sp.codes + (j - jb * bs) * nkv * krb;
                        for (long i0 = 0; i0 < g; i0 += 8) {
                            long ng = g - i0 < 8 ? g - i0 : 8;
                            SWITCH_HEADS(ng, score_codes, row, qs + i0 * MAXHD, hd, kper, kbits, sc + i0)
                        }
                        for (long i = 0; i < g; i++) scores[i * maxlen + j - start] = (sc[i] + c0[i]) * scale;
                    }
                }
                for (long i = 0; i < g; i++) softmax_row(scores + i * maxlen, n);
                memset(accn, 0, sizeof(float) * g * MAXHD);
                memset(accp, 0, sizeof(float) * g * MAXHD);
                memset(bias, 0, sizeof(float) * g * (nvg + 1));
                for (long jb = start / bs; jb * bs < end; jb++) {  /* values, block by block */
                    const kv_span sp = span_at(jb, start, end, bs, tab, nq, rv, slot, W, nkv, kh, hd, V.codes, vrb);
                    const long j0 = sp.j0, j1 = sp.j1, blk = sp.blk;
                    const int in_ring = sp.ring != NULL;
                    if (in_ring || V.mode != KV_TOKEN) {
                        const int mode = in_ring ? KV_F32 : V.mode;
                        for (long j = j0; j < j1; j++) {
                            const long off = j - jb * bs;
                            const float *p = scores + j - start;  /* p[i * maxlen]: head i's weight of this row */
                            const void *row = span_row(&sp, off, nkv, hd, vrb);
                            float mul = (!in_ring && V.mode == KV_FP8) ? half_to_float(V.scale[blk * bs + off]) : 1.0f;
                            for (long i = 0; i < g; i++) sc[i] = p[i * maxlen] * mul;
                            for (long d = 0; d < hd; d += 8) {
                                __m256 v = load8(mode, row, d);
                                for (long i = 0; i < g; i++) {
                                    float *acc = accn + i * MAXHD + d;
                                    _mm256_store_ps(acc, _mm256_fmadd_ps(_mm256_set1_ps(sc[i]), v, _mm256_load_ps(acc)));
                                }
                            }
                        }
                        continue;
                    }
                    /* a KIVI block: per group of channels, each row's weight p * s per head, then the group's
                     * chunks accumulate over the block's rows in registers */
                    const long nrow = j1 - j0, off0 = j0 - jb * bs;
                    const long st0 = ((blk * bs + off0) * nkv + kh) * nvg, sstride = nkv * nvg;
                    const uint8_t *rows = sp.codes + off0 * nkv * vrb;
                    const int hg = 8 / vper;  /* heads per register pass */
                    for (long gi = 0; gi < nvg; gi++) {
                        for (long r = 0; r < nrow; r++) {
                            const float *p = scores + j0 + r - start;
                            float sg = half_to_float(V.scale[st0 + r * sstride + gi]), mg = half_to_float(V.mn[st0 + r * sstride + gi]);
                            for (long i = 0; i < g; i++) {
                                wbuf[r * g + i] = p[i * maxlen] * sg;
                                bias[i * (nvg + 1) + gi] += p[i * maxlen] * mg;
                            }
                        }
                        for (long c = gi * V.vg / vC; c < (gi + 1) * V.vg / vC; c++)
                            for (long i0 = 0; i0 < g; i0 += hg) {
                                long ng = g - i0 < hg ? g - i0 : hg;
                                const uint8_t *cc = rows + c * 8;
                                float *acc = accp + i0 * MAXHD + c * vC;
                                if (vper == 4) { if (ng == 2) VCHUNK(2, 4, cc, nkv * vrb, nrow, wbuf + i0, g, acc, vbits);
                                                 else VCHUNK(1, 4, cc, nkv * vrb, nrow, wbuf + i0, g, acc, vbits); }
                                else if (vper == 2) { SWITCH_HEADS4(ng, VCHUNK, 2, cc, nkv * vrb, nrow, wbuf + i0, g, acc, vbits) }
                                else { SWITCH_HEADS(ng, VCHUNK, 1, cc, nkv * vrb, nrow, wbuf + i0, g, acc, vbits) }
                            }
                    }
                }
                for (long i = 0; i < g; i++) {
                    if (V.mode == KV_TOKEN)
                        for (long d = 0; d < hd; d++)
                            o[i * hd + d] = accn[i * MAXHD + d] + accp[i * MAXHD + vperm[d]] +
                                            bias[i * (nvg + 1) + vgroup_of[d / vC]];
                    else
                        memcpy(o + i * hd, accn + i * MAXHD, sizeof(float) * hd);
                }
            }
        }
        free(scores); free(qs); free(accn); free(accp); free(bias); free(c0); free(sblk); free(sc); free(wbuf); free(sc2);
    }
}
