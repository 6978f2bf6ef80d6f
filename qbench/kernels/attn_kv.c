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
 *   per group and block (eight rows a lane) and added once at the end.
 *
 * Work is split per query row (all its KV heads), or with few rows per part of a row (VSEG below), into
 * attn_kv_head.h's tasks, compiled twice: with the AVX2 helpers below, and with attn_kv512.h's AVX-512
 * helpers under a target pragma (taken when qb_isa() == 512). A score leaves its kernel as 8 partial sums
 * and close_scores adds eight rows' at once (hsum256x8, hsum256's tree), so both paths, and the fp16/bf16
 * baselines, sum every element in the same order: the same bits.
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

/* eight fp16 values `stride` halves apart (a V group's statistic over eight rows), as floats: one conversion
 * instead of eight, each value exactly half_to_float's */
static inline __m256 halves8(const uint16_t *p, long stride) {
    __m128i h = _mm_cvtsi32_si128(p[0]);
    h = _mm_insert_epi16(h, p[stride], 1);
    h = _mm_insert_epi16(h, p[2 * stride], 2);
    h = _mm_insert_epi16(h, p[3 * stride], 3);
    h = _mm_insert_epi16(h, p[4 * stride], 4);
    h = _mm_insert_epi16(h, p[5 * stride], 5);
    h = _mm_insert_epi16(h, p[6 * stride], 6);
    h = _mm_insert_epi16(h, p[7 * stride], 7);
    return _mm256_cvtph_ps(h);
}

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

/* bytes from one KV head's slice of a span's row to the next head's: an fp32 ring's hd floats, or the pool's
 * rb bytes */
static inline long span_head_step(const kv_span *sp, long hd, long rb) {
    return sp->ring ? hd * (long)sizeof(float) : rb;
}

/* bytes from one row of a span to the next: nkv head slices to a position */
static inline long span_stride(const kv_span *sp, long nkv, long hd, long rb) {
    return nkv * span_head_step(sp, hd, rb);
}

/* row off of a span */
static inline const void *span_row(const kv_span *sp, long off, long nkv, long hd, long rb) {
    return (sp->ring ? (const char *)sp->ring : (const char *)sp->codes) + off * span_stride(sp, nkv, hd, rb);
}

#define SWITCH_HEADS(ng, fn, ...) switch (ng) {                                                      \
        case 8: fn(8, __VA_ARGS__); break; case 7: fn(7, __VA_ARGS__); break;                        \
        case 6: fn(6, __VA_ARGS__); break; case 5: fn(5, __VA_ARGS__); break;                        \
        case 4: fn(4, __VA_ARGS__); break; case 3: fn(3, __VA_ARGS__); break;                        \
        case 2: fn(2, __VA_ARGS__); break; default: fn(1, __VA_ARGS__); break; }
#define SWITCH_HEADS4(ng, fn, ...) switch (ng) {                                                     \
        case 4: fn(4, __VA_ARGS__); break; case 3: fn(3, __VA_ARGS__); break;                        \
        case 2: fn(2, __VA_ARGS__); break; default: fn(1, __VA_ARGS__); break; }

/* fn(NG, MODE, ...) with the row format a compile-time constant */
#define SWITCH_KV_MODE(fn, NG, mode, ...) switch (mode) {                                             \
        case KV_F16: fn(NG, KV_F16, __VA_ARGS__); break; case KV_BF16: fn(NG, KV_BF16, __VA_ARGS__); break; \
        case KV_FP8: fn(NG, KV_FP8, __VA_ARGS__); break; default: fn(NG, KV_F32, __VA_ARGS__); break; }

#include "attn_kv256.h"

typedef struct {
    const float *q; float *out;
    long T, nh, nkv, hd, bs, nblk, W, window;
    float scale;
    const int64_t *tables, *qpos, *ctx, *slots;
    const uint8_t *qvalid;
    const float *rk, *rv;  /* a quantized cache's fp32 residual rings */
    kv_src K, V;
    long g, maxlen, krb, vrb, vC, nvg;
    int kper, vper;
    int kinv[MAXHD], vperm[MAXHD], vgroup_of[MAXHD];  /* K perm position -> channel; V channel -> perm position; V chunk -> group */
} kv_call;

/* Value sums of one head: in natural order (fp32 ring, FP8, fp16/bf16 rows) and in V's perm order (KIVI
 * rows), each (g, MAXHD), and V's group minimums' terms (g, nvg + 1); one 64-byte aligned run of acc_floats */
typedef struct { float *accn, *accp, *bias; } kv_acc;

typedef struct {  /* one thread's buffers for one KV head */
    float *scores;         /* (g, maxlen), or NULL where a call shares each row's scores between threads */
    float *qp, *qs;        /* the query in K's perm order; times a KIVI block's scales (g, MAXHD) */
    kv_acc seg, tot;       /* a segment's value sums (VSEG below); their total over the segments so far */
    float *c0;             /* q . K's minimums (g) */
    float *sblk, *sperm;   /* a KIVI block's scales and minimums (2 * MAXHD); its scales in perm order */
    float *raw;            /* a block's partial scores (g, bs, 8) */
    float *rowf;           /* per block row: a score multiplier, or V's scale and minimum (2, bs) */
    float *wbuf;           /* a block's value weights (g, bs) */
    float *block;          /* head 0's: the one allocation every head's buffers lie in (scratch_new) */
} kv_scratch;

/* One head's V weights for one group of a KIVI block's rows: w[r] = p[r] * s[r], and the block's share of
 * the group minimum's term, sum_r p[r] * m[r] (eight rows a lane, then hsum256), added to bias */
static inline void vweights(const float *p, const float *sg, const float *mg, long nrow, float *w, float *bias) {
    __m256 acc = _mm256_setzero_ps();
    long r = 0;
    for (; r + 8 <= nrow; r += 8) {
        const __m256 pv = _mm256_loadu_ps(p + r);
        _mm256_storeu_ps(w + r, _mm256_mul_ps(pv, _mm256_loadu_ps(sg + r)));
        acc = _mm256_fmadd_ps(pv, _mm256_loadu_ps(mg + r), acc);
    }
    float t = hsum256(acc);
    for (; r < nrow; r++) {
        w[r] = p[r] * sg[r];
        t += p[r] * mg[r];
    }
    *bias += t;
}

/* A block's scores from their partial sums: scores[i * maxlen + r] = (sum + add[i]) * mul[r] (add may be
 * NULL), eight rows at a time */
static void close_scores(const float *raw, long g, long bs, long nrow, const float *add, const float *mul,
                         float *scores, long maxlen) {
    for (long i = 0; i < g; i++) {
        const float *ri = raw + i * bs * 8;
        float *dst = scores + i * maxlen;
        long r = 0;
        for (; r + 8 <= nrow; r += 8) {
            __m256 t = hsum256x8(ri + r * 8);
            if (add) t = _mm256_add_ps(t, _mm256_set1_ps(add[i]));
            _mm256_storeu_ps(dst + r, _mm256_mul_ps(t, _mm256_loadu_ps(mul + r)));
        }
        for (; r < nrow; r++) {
            float t = hsum256(_mm256_load_ps(ri + r * 8));
            if (add) t += add[i];
            dst[r] = t * mul[r];
        }
    }
}

/* A KIVI K block's statistics meet the query once: qs = q * s in perm order (its scales gathered into perm
 * order once for all heads), c0 = q . m. Each product is the one the per-channel formula takes, so the
 * layout changes no bit. */
static void kivi_block_query(const kv_call *C, kv_scratch *S, const float *qh, const uint16_t *s16,
                             const uint16_t *m16) {
    const long hd = C->hd, g = C->g;
    float *sblk = S->sblk;
    for (long d = 0; d < hd; d += 8) {
        _mm256_storeu_ps(sblk + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s16 + d))));
        _mm256_storeu_ps(sblk + MAXHD + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m16 + d))));
    }
    const float *sp = sblk;
    if (C->kper > 1) {
        for (long d = 0; d < hd; d += 8)
            _mm256_store_ps(S->sperm + d, _mm256_i32gather_ps(sblk, _mm256_loadu_si256((const __m256i *)(C->kinv + d)), 4));
        sp = S->sperm;
    }
    for (long i = 0; i < g; i++) {
        float *qs = S->qs + i * MAXHD;
        const float *qp = S->qp + i * MAXHD;
        __m256 c = _mm256_setzero_ps();
        for (long d = 0; d < hd; d += 8) {
            _mm256_store_ps(qs + d, _mm256_mul_ps(_mm256_load_ps(qp + d), _mm256_loadu_ps(sp + d)));
            c = _mm256_fmadd_ps(_mm256_loadu_ps(qh + i * C->hd + d), _mm256_loadu_ps(sblk + MAXHD + d), c);
        }
        S->c0[i] = hsum256(c);
    }
}

#include "attn_kv_rows.h"

#define WIDE 0
#define SFX(f) f##_avx2
#include "attn_kv_head.h"
#undef WIDE
#undef SFX

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
#include "attn_kv512.h"
#define WIDE 1
#define SFX(f) f##_avx512
#include "attn_kv_head.h"
#undef WIDE
#undef SFX
#pragma GCC pop_options

int qb_isa(void);

/* q (B, T, nh, hd); out (B, T, nh, hd); tables (B, nblk); qpos (B, T); qvalid (B, T) uint8 or NULL;
 * ctx (B,) tokens cached after this step; slots (B,) residual ring slots; rk/rv (seqs, W, bs, nkv, hd) fp32.
 * W == 0: no ring, every block is read from the pool (an fp16 or bf16 cache). On AVX-512 CPUs
 * (qb_isa() == 512) the wide helpers serve, with the same bits. */
void qb_attention_kv(const float *q, float *out, long B, long T, long nh, long nkv, long hd, long bs, long nblk,
                     const int64_t *tables, const int64_t *qpos, const uint8_t *qvalid, const int64_t *ctx,
                     const int64_t *slots, long W, const float *rk, const float *rv, long window, float scale,
                     int kmode, int kbits, const uint8_t *kc, const uint16_t *ks, const uint16_t *km,
                     int vmode, int vbits, long vg, const uint8_t *vc, const uint16_t *vs, const uint16_t *vm,
                     int nthreads) {
    static int lut_ready = 0;
    if (!lut_ready) { fp8_lut_init(); lut_ready = 1; }  /* idempotent: a racing second init writes the same */
    kv_call *C = (kv_call *)malloc(sizeof(kv_call));
    *C = (kv_call){.q = q, .out = out, .T = T, .nh = nh, .nkv = nkv, .hd = hd, .bs = bs, .nblk = nblk, .W = W,
                   .window = window, .scale = scale, .tables = tables, .qpos = qpos, .ctx = ctx, .slots = slots,
                   .qvalid = qvalid, .rk = rk, .rv = rv, .K = {kmode, kbits, 0, kc, ks, km},
                   .V = {vmode, vbits, vg, vc, vs, vm}};
    C->g = nh / nkv;
    C->maxlen = nblk * bs;
    C->krb = row_bytes(&C->K, hd);
    C->vrb = row_bytes(&C->V, hd);
    C->kper = kmode == KV_CHANNEL ? 8 / kbits : 1;
    C->vper = vmode == KV_TOKEN ? 8 / vbits : 1;
    C->vC = 8 * C->vper;
    C->nvg = vmode == KV_TOKEN ? hd / vg : 1;
    const long kC = 8 * C->kper, vC = C->vC;
    const int kper = C->kper, vper = C->vper;
    for (long d = 0; d < hd; d++) {
        C->kinv[(d / kC) * kC + (d % kC % kper) * 8 + d % kC / kper] = (int)d;
        C->vperm[d] = (int)((d / vC) * vC + (d % vC % vper) * 8 + d % vC / vper);
    }
    for (long c = 0; c < hd / vC; c++) C->vgroup_of[c] = vmode == KV_TOKEN ? (int)(c * vC / vg) : 0;
    const int wide = qb_isa() == 512;
    /* Every task takes all KV heads of its rows. A pool row holds all heads side by side; one head's slice
     * alone (1/nkv of each row, nkv * row bytes apart) streamed from DRAM at about the speed of whole rows, so
     * each head paid for the others' bytes. Reading each pair of key rows for all heads, and each block's
     * values head after head, halved a 4k-token call for the fp16 and K8V8 caches on the Zen 4 EPYC (README,
     * "Quantized KV cache"). With rows enough to keep the threads busy, a row is a task; with fewer, the
     * threads share each row's segments instead of its heads. */
    const long R = B * T;
    if (R >= 2L * nthreads) {
        #pragma omp parallel num_threads(nthreads)
        {
            kv_scratch *S = scratch_new(C, 1);
            #pragma omp for schedule(dynamic, 1)
            for (long bt = 0; bt < R; bt++) {
                if (wide) attend_avx512(C, S, bt);
                else attend_avx2(C, S, bt);
            }
            scratch_free(S);
        }
        free(C);
        return;
    }
    /* few rows: each row's scores (nkv, g, maxlen) and each of its segments' value sums (nkv heads) are the
     * call's, and the threads share the rows in phases: scores a few blocks at a time for every head, the
     * softmax a head at a time, the value sums a segment at a time (for every head, or with fewer segments
     * than threads for one head: its sums are its own either way), then each head's segments in order */
    long *first = (long *)malloc(sizeof(long) * (R + 1));  /* row r's segments: first[r] .. first[r+1]-1 */
    long *cfirst = (long *)malloc(sizeof(long) * (R + 1));  /* row r's score chunks: cfirst[r] .. */
    first[0] = cfirst[0] = 0;
    for (long r = 0; r < R; r++) {
        const kv_task tk = task_of(C, r);
        const int ok = row_valid(C, r);
        first[r + 1] = first[r] + (ok ? seg_end(&tk) - seg_first(&tk) : 0);
        cfirst[r + 1] = cfirst[r] + (ok ? (tk.jend - tk.jbeg + SCHUNK - 1) / SCHUNK : 0);
    }
    const long nseg = first[R], nchunk = cfirst[R], sstride = C->g * C->maxlen + 16, astride = acc_floats(C);
    const long hpt = nseg >= nthreads ? nkv : 1, nvt = nseg * (nkv / hpt);  /* heads per values task */
    float *scores = falloc64(R * nkv * sstride), *accs = falloc64((nseg > 0 ? nseg : 1) * nkv * astride);
    #pragma omp parallel num_threads(nthreads)
    {
        kv_scratch *S = scratch_new(C, 0);
        float **sc = (float **)malloc(sizeof(float *) * nkv);
        kv_acc *A = (kv_acc *)malloc(sizeof(kv_acc) * nkv);
        long qp_row = -1;
        #pragma omp for schedule(dynamic, 1)
        for (long t = 0; t < nchunk; t++) {  /* 1: the scores, SCHUNK blocks at a time */
            const long r = row_of(cfirst, t);
            const kv_task tk = task_of(C, r);
            const long ja = tk.jbeg + (t - cfirst[r]) * SCHUNK, jz = ja + SCHUNK < tk.jend ? ja + SCHUNK : tk.jend;
            for (long h = 0; h < nkv; h++) sc[h] = scores + (r * nkv + h) * sstride;
            if (wide) part_scores_avx512(C, S, r, ja, jz, sc, &qp_row);
            else part_scores_avx2(C, S, r, ja, jz, sc, &qp_row);
        }
        #pragma omp for schedule(dynamic, 1)
        for (long t = 0; t < R * nkv; t++) {  /* 2: each head's softmax over the whole row */
            const long r = t / nkv;
            if (!row_valid(C, r)) continue;
            const kv_task tk = task_of(C, r);
            if (wide) softmax_head_avx512(C, scores + t * sstride, tk.end - tk.start);
            else softmax_head_avx2(C, scores + t * sstride, tk.end - tk.start);
        }
        #pragma omp for schedule(dynamic, 1)
        for (long t = 0; t < nvt; t++) {  /* 3: a segment's value sums, from zero */
            const long u = t / (nkv / hpt), h0 = t % (nkv / hpt) * hpt;
            const long r = row_of(first, u);
            const kv_task tk = task_of(C, r);
            for (long h = h0; h < h0 + hpt; h++) {
                sc[h] = scores + (r * nkv + h) * sstride;
                A[h] = acc_at(C, accs + (u * nkv + h) * astride);
            }
            if (wide) seg_values_avx512(C, S, r, seg_first(&tk) + u - first[r], h0, h0 + hpt, sc, A);
            else seg_values_avx2(C, S, r, seg_first(&tk) + u - first[r], h0, h0 + hpt, sc, A);
        }
        #pragma omp for schedule(dynamic, 1)
        for (long t = 0; t < R * nkv; t++) {  /* 4: a head's segments added in order, and its output */
            const long r = t / nkv, h = t % nkv;
            float *oh = out + (r * nh + h * C->g) * hd;
            if (!row_valid(C, r)) { memset(oh, 0, sizeof(float) * C->g * hd); continue; }
            const kv_acc tot = acc_at(C, accs + (first[r] * nkv + h) * astride);
            for (long u = first[r] + 1; u < first[r + 1]; u++) {
                const kv_acc a = acc_at(C, accs + (u * nkv + h) * astride);
                acc_add(C, &tot, &a);
            }
            acc_out(C, &tot, oh);
        }
        scratch_free(S);
        free(sc); free(A);
    }
    free(cfirst);
    free(scores); free(accs); free(first);
    free(C);
}
