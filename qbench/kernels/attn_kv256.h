/* The AVX2 helpers of qb_attention_kv (attn_kv.c): every supported CPU runs them, and attn_kv512.h's
 * AVX-512 twins keep their order of every sum. */

/* Scores of NG query heads (NG <= 8, a compile-time constant so the accumulators stay in registers) against
 * one key row: natural-order rows (fp32 ring, fp16, bf16, FP8) or KIVI codes against q*s in perm order. Each
 * head's score is left as 8 partial sums at out + i * ostride; close_scores adds them (hsum256's tree) for 8
 * rows at a time. */
static inline __attribute__((always_inline)) void score_row(const int NG, int mode, const void *row,
                                                            const float *qh, long qstride, long hd, float *out,
                                                            long ostride) {
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
    for (int i = 0; i < NG; i++) _mm256_store_ps(out + i * ostride, _mm256_add_ps(a[i], b[i]));
}

static inline __attribute__((always_inline)) void score_codes(const int NG, const uint8_t *row, const float *qs,
                                                              long hd, int per, int bits, float *out, long ostride) {
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
    for (int i = 0; i < NG; i++) _mm256_store_ps(out + i * ostride, _mm256_add_ps(a[i], b[i]));
}

/* One V chunk (8 bytes of codes: 8 * PER channels in perm order) of a block's rows, for NG heads: the
 * accumulators stay in registers across the rows and are added to acc once. w (heads, wstride): each row's
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
            for (int i = 0; i < NG; i++) a[i][t] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + i * wstride + r), v, a[i][t]);
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
                                                               float *out0, float *out1, long ostride) {
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
    for (int i = 0; i < NG; i++) { _mm256_store_ps(out0 + i * ostride, a[i]); _mm256_store_ps(out1 + i * ostride, b[i]); }
}
