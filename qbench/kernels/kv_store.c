/* Blocks of a quantized KV cache stored from full precision: KIVI's min/max quantization (K per channel over
 * a block's tokens, V per token over groups of channels, 8/4/2 bits, packed along head_dim with the lowest
 * index in the lowest bits) and the fp16/bf16/fp32 copies of an unquantized K or V.
 *
 * It is layers/kvquant.py's _minmax_quant and pack_bits, operation for operation in float32, so its codes and
 * fp16 statistics are theirs bit for bit (tests/test_kvquant.py holds it, edge cases included):
 *   scale = half(max((hi - lo) / levels, 1e-8)), lo16 = half(lo),
 *   code  = clamp(round_half_even((x - lo16) / scale), 0, levels), a NaN (0 / 0 where a scale rounds to
 *           zero in fp16) giving 0 as torch's conversion to uint8 does.
 * The decode step calls it between a layer's KV write and its attention (layer.c), so a block that leaves the
 * residual window costs no trip back to Python; QuantBlockKV._store calls it for every other write.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vecmath.h"

enum { KV_F32 = 0, KV_CHANNEL = 1, KV_TOKEN = 2, KV_FP8 = 3, KV_F16 = 4, KV_BF16 = 5 };

typedef struct { float s, m; } qstat;  /* a statistic's scale and minimum, after their fp16 rounding */

static inline qstat minmax_stat(float lo, float hi, int levels, uint16_t *s16, uint16_t *m16) {
    float s = (hi - lo) / (float)levels;
    s = s < 1e-8f ? 1e-8f : s;  /* torch's clamp(min=): a NaN stays NaN */
    *s16 = to_f16(s);
    *m16 = to_f16(lo);
    return (qstat){_cvtsh_ss(*s16), _cvtsh_ss(*m16)};
}

static inline uint8_t code_of(float x, qstat q, int levels) {
    float r = nearbyintf((x - q.m) / q.s);
    if (r != r) return 0;
    return r <= 0.0f ? 0 : r >= (float)levels ? (uint8_t)levels : (uint8_t)r;
}

/* n codes (each < 2^bits) packed into n * bits / 8 bytes */
static inline void pack(const uint8_t *c, long n, int bits, uint8_t *out) {
    if (bits == 8) {
        memcpy(out, c, n);
        return;
    }
    const int per = 8 / bits;
    for (long j = 0; j < n / per; j++) {
        uint8_t b = 0;
        for (int i = 0; i < per; i++) b |= (uint8_t)(c[j * per + i] << (bits * i));
        out[j] = b;
    }
}

/* One block (bs, nkv, hd) of keys, statistics per (head, channel) over the bs tokens: codes (bs, nkv, hd *
 * bits / 8), scale and min (nkv, hd). */
static void store_channel(const float *x, long bs, long nkv, long hd, int bits, uint8_t *codes, uint16_t *sc,
                          uint16_t *mn) {
    const int levels = (1 << bits) - 1;
    const long row = nkv * hd, rb = hd * bits / 8;
    uint8_t c[256];  /* one row's codes: hd is at most 256 (ops.kv_kernel_fits) */
    qstat q[256];
    for (long h = 0; h < nkv; h++) {
        for (long d = 0; d < hd; d++) {
            float lo = x[h * hd + d], hi = lo;
            for (long t = 1; t < bs; t++) {
                const float v = x[t * row + h * hd + d];
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
            }
            q[d] = minmax_stat(lo, hi, levels, sc + h * hd + d, mn + h * hd + d);
        }
        for (long t = 0; t < bs; t++) {
            for (long d = 0; d < hd; d++) c[d] = code_of(x[t * row + h * hd + d], q[d], levels);
            pack(c, hd, bits, codes + (t * nkv + h) * rb);
        }
    }
}

/* One block (bs, nkv, hd) of values, statistics per (token, head, group of vg channels): codes as above,
 * scale and min (bs, nkv, hd / vg). */
static void store_token(const float *x, long bs, long nkv, long hd, int bits, long vg, uint8_t *codes,
                        uint16_t *sc, uint16_t *mn) {
    const int levels = (1 << bits) - 1;
    const long rb = hd * bits / 8, ng = hd / vg;
    uint8_t c[256];
    for (long r = 0; r < bs * nkv; r++) {  /* r: (token, head) */
        const float *xr = x + r * hd;
        for (long gi = 0; gi < ng; gi++) {
            const float *xg = xr + gi * vg;
            float lo = xg[0], hi = lo;
            for (long d = 1; d < vg; d++) {
                lo = xg[d] < lo ? xg[d] : lo;
                hi = xg[d] > hi ? xg[d] : hi;
            }
            const qstat q = minmax_stat(lo, hi, levels, sc + r * ng + gi, mn + r * ng + gi);
            for (long d = 0; d < vg; d++) c[gi * vg + d] = code_of(xg[d], q, levels);
        }
        pack(c, hd, bits, codes + r * rb);
    }
}

/* n blocks of full-precision rows, block i read at x + src[i] * (bs * nkv * hd) (src NULL: i), into pool
 * blocks blocks[i] of a store whose rows are in `mode`: KV_CHANNEL (keys) or KV_TOKEN (values, vg channels a
 * statistic) codes with fp16 scale and min, or an unquantized KV_F32 / KV_F16 / KV_BF16 copy (codes is then
 * that pool; sc and mn unused). Blocks must be distinct. */
void qb_kv_store(const float *x, const int64_t *src, long n, long bs, long nkv, long hd, int mode, int bits, long vg,
                 const int64_t *blocks, void *codes, uint16_t *sc, uint16_t *mn, int nthreads) {
    const long blk = bs * nkv * hd;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (n > 1)
    for (long i = 0; i < n; i++) {
        const float *xb = x + (src ? src[i] : i) * blk;
        const long b = blocks[i];
        if (mode == KV_CHANNEL)
            store_channel(xb, bs, nkv, hd, bits, (uint8_t *)codes + b * bs * nkv * (hd * bits / 8),
                          sc + b * nkv * hd, mn + b * nkv * hd);
        else if (mode == KV_TOKEN)
            store_token(xb, bs, nkv, hd, bits, vg, (uint8_t *)codes + b * bs * nkv * (hd * bits / 8),
                        sc + b * bs * nkv * (hd / vg), mn + b * bs * nkv * (hd / vg));
        else if (mode == KV_F32)
            memcpy((float *)codes + b * blk, xb, blk * sizeof(float));
        else
            for (long j = 0; j < blk; j++)
                ((uint16_t *)codes)[b * blk + j] = mode == KV_F16 ? to_f16(xb[j]) : to_bf16(xb[j]);
    }
}
