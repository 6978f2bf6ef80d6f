/* A decode step's decoder layers in one call (Llama family: RMSNorm, fused q/k/v, RoPE, paged attention,
 * o, RMSNorm, fused gate/up, SiLU, down, two residuals), on fp32, INT8 or INT4 weights (W4A16 or W4A8)
 * and an fp32, fp16/bf16 or quantized (KIVI, FP8) KV pool.
 *
 * It calls the same kernels, with the same arguments, in the same order as the layer-by-layer path of
 * qbench/models/llama.py, so its results are bit-identical to that path: what it removes is the Python
 * between them (about 0.1 ms a layer, a third of a small model's batch-1 step). The torch path stays the
 * reference; qbench/layers/fused_decode.py decides when this one applies.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "vecmath.h"

void qb_gemm_f32_packed(const float *x, const float *wp, const float *bias, float *y, long M, long K, long N,
                        int nthreads);
void qb_gemm_i8(const float *x, const int8_t *wp, const float *scale, float *y, long M, long K, long N,
                int nthreads);
void qb_gemm_i4(const float *x, const uint8_t *wp, const uint16_t *scales, const uint8_t *zeros, float *y, long M,
                long K, long N, long G, int nthreads);
void qb_gemm_i4a8(const float *x, const uint8_t *wp, const uint16_t *scales, const uint8_t *zeros, float *y,
                  long M, long K, long N, long G, int nthreads);
void qb_gemm_i8a8(const float *x, const int8_t *wp, const float *scale, float *y, long M, long K, long N,
                  int nthreads);
void qb_gemm_f8(const float *x, const uint8_t *wp, const float *scale, float *y, long M, long K, long N,
                int nthreads);
void qb_kv_store(const float *x, const int64_t *src, long n, long bs, long nkv, long hd, int mode, int bits, long vg,
                 const int64_t *blocks, void *codes, uint16_t *sc, uint16_t *mn, int nthreads);
void qb_rmsnorm(const float *x, const float *w, float *y, long rows, long n, float eps, int nthreads);
void qb_silu_mul(const float *gu, float *y, long rows, long n, int nthreads);
void qb_fwht(float *x, long rows, long K, long b, int nthreads);
void qb_rope(float *x, const int64_t *pos, const float *cos_t, const float *sin_t, long ntok, long nheads,
             long nrot, long hd, int nthreads);
void qb_paged_attention(const float *q, const float *kpool, const float *vpool, const int64_t *tables,
                        const int64_t *qpos, const uint8_t *qvalid, float *out, long B, long T, long nh, long nkv,
                        long hd, long bs, long nblk, long window, float scale, int nthreads);
void qb_attention_kv(const float *q, float *out, long B, long T, long nh, long nkv, long hd, long bs, long nblk,
                     const int64_t *tables, const int64_t *qpos, const uint8_t *qvalid, const int64_t *ctx,
                     const int64_t *slots, long W, const float *rk, const float *rv, long window, float scale,
                     int kmode, int kbits, const uint8_t *kc, const uint16_t *ks, const uint16_t *km, int vmode,
                     int vbits, long vg, const uint8_t *vc, const uint16_t *vs, const uint16_t *vm, int nthreads);

enum { LIN_F32 = 0, LIN_I8 = 1, LIN_I4 = 2, LIN_I4A8 = 3, LIN_I8A8 = 4, LIN_F8 = 5 };
enum { POOL_F32 = 0, POOL_F16 = 1, POOL_BF16 = 2, POOL_QUANT = 3 };
enum { STAGE_WRITE = 1, STAGE_REST = 2 };  /* up to the KV write; from attention on */

/* Mirrors qbench/layers/fused_decode.py's ctypes structures field for field. */
typedef struct {
    int64_t kind, K, N, G;
    const void *w, *s, *z;
    const float *bias;
    int64_t rot;  /* b > 0: the inputs are rotated first, x -> x H (qb_fwht) */
} qb_lin;

typedef struct {
    int64_t H, nh, nkv, hd, I, window, pool, W;
    float eps, scale;
    const float *norm_in, *norm_post;
    qb_lin qkv, o, gate_up, down;
    void *k, *v;  /* the pool (blocks, bs, nkv, hd), or a quantized pool's fp32 rings (seqs, W, bs, nkv, hd) */
    int64_t kmode, kbits, vmode, vbits, vgroup;  /* how qb_attention_kv reads a quantized or 16-bit pool */
    const void *kc, *ks, *km, *vc, *vs, *vm;
} qb_layer;

typedef struct {
    int64_t B, bs, nblk;
    const int64_t *positions, *slots, *tables, *ctx, *kv_slots;  /* slots: pool slots, or ring rows (quantized) */
    const float *cos, *sin;
    const int64_t *kvpos;  /* each row's index in its cache: its position less the tokens evicted before it */
    int64_t nleave;  /* blocks that leave a quantized pool's window on this step: ring slot -> pool block */
    const int64_t *leave_ring, *leave_blk;
} qb_step;

/* Per-row scratch of one layer, in floats. */
static long scratch_floats(const qb_layer *L) {
    long qkv = (L->nh + 2 * L->nkv) * L->hd, q = L->nh * L->hd;
    return L->H + qkv + 2 * q + 3 * L->I + L->H;
}

long qb_decode_scratch(const qb_layer *L, long n) {
    long most = 0;
    for (long i = 0; i < n; i++) {
        long f = scratch_floats(L + i);
        most = f > most ? f : most;
    }
    return most;
}

/* x is the layer's scratch: a rotated linear (l->rot) rotates it in place, as QuantLinear rotates a copy. */
static void linear(const qb_lin *l, float *x, float *y, long M, int nt) {
    if (l->rot) qb_fwht(x, M, l->K, l->rot, nt);
    if (l->kind == LIN_F32) {  /* the bias is added inside the kernel, as Linear does */
        qb_gemm_f32_packed(x, (const float *)l->w, l->bias, y, M, l->K, l->N, nt);
        return;
    }
    if (l->kind == LIN_F8) qb_gemm_f8(x, (const uint8_t *)l->w, (const float *)l->s, y, M, l->K, l->N, nt);
    else if (l->kind == LIN_I8 || l->kind == LIN_I8A8)
        (l->kind == LIN_I8A8 ? qb_gemm_i8a8 : qb_gemm_i8)(x, (const int8_t *)l->w, (const float *)l->s, y, M, l->K,
                                                          l->N, nt);
    else (l->kind == LIN_I4A8 ? qb_gemm_i4a8 : qb_gemm_i4)(x, (const uint8_t *)l->w, (const uint16_t *)l->s,
                                                            (const uint8_t *)l->z, y, M, l->K, l->N, l->G, nt);
    if (l->bias)  /* QuantLinear adds it after the product: y += bias */
        for (long m = 0; m < M; m++)
            for (long n = 0; n < l->N; n++) y[m * l->N + n] += l->bias[n];
}

/* Row b's new k and v (nkv * hd each) into its slot: a pool slot, or a quantized pool's ring row. */
static void write_kv(const qb_layer *L, const qb_step *S, const float *qkv, long b) {
    long row = (L->nh + 2 * L->nkv) * L->hd, n = L->nkv * L->hd;
    const float *k = qkv + b * row + L->nh * L->hd, *v = k + n;
    long at = S->slots[b] * n;
    if (L->pool == POOL_F32 || L->pool == POOL_QUANT) {
        memcpy((float *)L->k + at, k, n * sizeof(float));
        memcpy((float *)L->v + at, v, n * sizeof(float));
        return;
    }
    uint16_t *kd = (uint16_t *)L->k + at, *vd = (uint16_t *)L->v + at;
    for (long j = 0; j < n; j++) {
        kd[j] = L->pool == POOL_F16 ? to_f16(k[j]) : to_bf16(k[j]);
        vd[j] = L->pool == POOL_F16 ? to_f16(v[j]) : to_bf16(v[j]);
    }
}

/* The blocks that leave a quantized pool's window, whole in their ring slots (a one-token step never writes
 * the slot it frees), into their pool blocks: QuantBlockKV.store_leaving's stores, done here so that the step
 * stays in one call. fused_decode.py passes them only for the layouts qb_kv_store takes (not FP8). */
static void store_leaving(const qb_layer *L, const qb_step *S, int nt) {
    qb_kv_store((const float *)L->k, S->leave_ring, S->nleave, S->bs, L->nkv, L->hd, (int)L->kmode, (int)L->kbits,
                0, S->leave_blk, (void *)L->kc, (uint16_t *)L->ks, (uint16_t *)L->km, nt);
    qb_kv_store((const float *)L->v, S->leave_ring, S->nleave, S->bs, L->nkv, L->hd, (int)L->vmode, (int)L->vbits,
                L->vgroup, S->leave_blk, (void *)L->vc, (uint16_t *)L->vs, (uint16_t *)L->vm, nt);
}

static void attention(const qb_layer *L, const qb_step *S, const float *q, float *out, int nt) {
    if (L->pool == POOL_F32) {
        qb_paged_attention(q, (const float *)L->k, (const float *)L->v, S->tables, S->kvpos, NULL, out, S->B, 1,
                           L->nh, L->nkv, L->hd, S->bs, S->nblk, L->window, L->scale, nt);
        return;
    }
    int quant = L->pool == POOL_QUANT;
    qb_attention_kv(q, out, S->B, 1, L->nh, L->nkv, L->hd, S->bs, S->nblk, S->tables, S->kvpos, NULL, S->ctx,
                    quant ? S->kv_slots : NULL, quant ? L->W : 0, quant ? (const float *)L->k : NULL,
                    quant ? (const float *)L->v : NULL, L->window, L->scale, (int)L->kmode, (int)L->kbits,
                    (const uint8_t *)L->kc, (const uint16_t *)L->ks, (const uint16_t *)L->km, (int)L->vmode,
                    (int)L->vbits, L->vgroup, (const uint8_t *)L->vc, (const uint16_t *)L->vs,
                    (const uint16_t *)L->vm, nt);
}

/* x (B, H) in place through layers [0, n), or only the stages asked for (one layer at a time, when an FP8
 * pool's leaving blocks are stored by torch between the KV write and attention; S->nleave blocks of the
 * other quantized layouts are stored here, in the write stage). scratch: B * qb_decode_scratch floats, kept
 * between the two stages of a layer. */
void qb_decode_layers(const qb_layer *layers, long n, const qb_step *S, float *x, float *scratch, int stages,
                      int nt) {
    long B = S->B;
    for (long li = 0; li < n; li++) {
        const qb_layer *L = layers + li;
        long H = L->H, nq = L->nh * L->hd, nrow = (L->nh + 2 * L->nkv) * L->hd;
        float *h = scratch, *qkv = h + B * H, *q = qkv + B * nrow, *att = q + B * nq, *gu = att + B * nq,
              *act = gu + B * 2 * L->I, *o = act + B * L->I;
        if (stages & STAGE_WRITE) {
            qb_rmsnorm(x, L->norm_in, h, B, H, L->eps, nt);
            linear(&L->qkv, h, qkv, B, nt);  /* (B, nh + 2 nkv, hd) */
            qb_rope(qkv, S->positions, S->cos, S->sin, B, L->nh + 2 * L->nkv, L->nh + L->nkv, L->hd, nt);
            for (long b = 0; b < B; b++) write_kv(L, S, qkv, b);
            if (S->nleave && L->pool == POOL_QUANT) store_leaving(L, S, nt);
        }
        if (!(stages & STAGE_REST)) continue;
        for (long b = 0; b < B; b++) memcpy(q + b * nq, qkv + b * nrow, nq * sizeof(float));  /* (B, nh, hd) */
        attention(L, S, q, att, nt);
        linear(&L->o, att, o, B, nt);
        for (long j = 0; j < B * H; j++) x[j] += o[j];
        qb_rmsnorm(x, L->norm_post, h, B, H, L->eps, nt);
        linear(&L->gate_up, h, gu, B, nt);  /* (B, 2I): [gate | up] */
        qb_silu_mul(gu, act, B, L->I, nt);
        linear(&L->down, act, o, B, nt);
        for (long j = 0; j < B * H; j++) x[j] += o[j];
    }
}
