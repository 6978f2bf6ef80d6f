/* AVX-512 twins of attn_kv.c's AVX2 helpers, included under a target pragma. Each keeps its twin's
 * per-lane summation order, so the two paths give the same bits:
 *   - a zmm holds what two ymm chains held: a row's dimensions d..d+7 and d+8..d+15 (score_row512), two key
 *     rows of one chunk (score_codes2_512), or two chunks of one value row (vchunk2_512);
 *   - value rows accumulate in registers across a block in row order, from the running sum (vrows512);
 *   - the softmax takes 16 exponentials at a time but adds them to its sum 8 at a time, in order. */

static inline __m512 load16(int mode, const void *row, long d) {
    switch (mode) {
    case KV_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d)));
    case KV_BF16: return _mm512_castsi512_ps(_mm512_slli_epi32(
                      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + d))), 16));
    case KV_FP8: return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)row + d))),
                                            fp8_lut, 4);
    default: return _mm512_loadu_ps((const float *)row + d);
    }
}

static inline __m256 lo256(__m512 a) { return _mm512_castps512_ps256(a); }
static inline __m256 hi256(__m512 a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)); }
static inline __m512 dup256(const float *p) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_load_pd((const double *)p))); }

/* score_row: the low half of a head's zmm is score_row's chain a, the high half its chain b */
static inline __attribute__((always_inline)) void score_row512(const int NG, int mode, const void *row,
                                                               const float *qh, long qstride, long hd, float *out,
                                                               long ostride) {
    __m512 a[8];
    for (int i = 0; i < NG; i++) a[i] = _mm512_setzero_ps();
    long d = 0;
    for (; d + 16 <= hd; d += 16) {
        __m512 v = load16(mode, row, d);
        for (int i = 0; i < NG; i++) a[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qh + i * qstride + d), v, a[i]);
    }
    if (d < hd) {  /* hd % 16 == 8: chain a only */
        __m512 v = _mm512_zextps256_ps512(load8(mode, row, d));
        for (int i = 0; i < NG; i++)
            a[i] = _mm512_mask3_fmadd_ps(_mm512_zextps256_ps512(_mm256_loadu_ps(qh + i * qstride + d)), v, a[i], 0x00FF);
    }
    for (int i = 0; i < NG; i++) _mm256_storeu_ps(out + i * ostride, _mm256_add_ps(lo256(a[i]), hi256(a[i])));
}

/* score_row512 over a block's nrow natural-order rows (rstride bytes apart), MODE a compile-time constant,
 * two rows a pass: six chains (three heads) hide the FMA latency that one row's 4-deep chain per head left
 * exposed, and no row pays for the format dispatch. Each row's sums are score_row512's, in its order. */
static inline __attribute__((always_inline)) void score_rows512(const int NG, const int MODE, const char *rows,
                                                                long rstride, long nrow, const float *qh, long hd,
                                                                float *out, long ostride) {
    long r = 0;
    for (; r + 2 <= nrow && hd % 16 == 0; r += 2) {
        const char *r0 = rows + r * rstride, *r1 = r0 + rstride;
        __m512 a[8], b[8];
        for (int i = 0; i < NG; i++) a[i] = b[i] = _mm512_setzero_ps();
        for (long d = 0; d < hd; d += 16) {
            __m512 v = load16(MODE, r0, d), w = load16(MODE, r1, d);
            for (int i = 0; i < NG; i++) {
                __m512 q = _mm512_loadu_ps(qh + i * hd + d);
                a[i] = _mm512_fmadd_ps(q, v, a[i]);
                b[i] = _mm512_fmadd_ps(q, w, b[i]);
            }
        }
        for (int i = 0; i < NG; i++) {
            _mm256_storeu_ps(out + i * ostride + r * 8, _mm256_add_ps(lo256(a[i]), hi256(a[i])));
            _mm256_storeu_ps(out + i * ostride + r * 8 + 8, _mm256_add_ps(lo256(b[i]), hi256(b[i])));
        }
    }
    for (; r < nrow; r++) score_row512(NG, MODE, rows + r * rstride, qh, hd, hd, out + r * 8, ostride);
}

#define SCORE_ROWS512(NG, mode, ...) SWITCH_KV_MODE(score_rows512, NG, mode, __VA_ARGS__)

/* field t of BITS-bit codes widened to int32 lanes, as float: the lowest field needs no shift, the highest
 * no mask */
static inline __attribute__((always_inline)) __m512 field512(__m512i u, const int t, const int BITS) {
    __m512i x = t ? _mm512_srli_epi32(u, t * BITS) : u;
    if ((t + 1) * BITS < 8) x = _mm512_and_si512(x, _mm512_set1_epi32((1 << BITS) - 1));
    return _mm512_cvtepi32_ps(x);
}

/* score_codes2: row0's chunk in the low half, row1's in the high half; q*s duplicated into both */
static inline __attribute__((always_inline)) void score_codes2_512(const int BITS, const int NG, const uint8_t *row0,
                                                                   const uint8_t *row1, const float *qs, long hd,
                                                                   float *out0, float *out1, long ostride) {
    const int PER = 8 / BITS;
    const long C = 8 * PER;
    __m512 a[8];
    for (int i = 0; i < NG; i++) a[i] = _mm512_setzero_ps();
    for (long c = 0; c < hd / C; c++) {
        __m128d r01 = _mm_loadh_pd(_mm_castsi128_pd(_mm_loadl_epi64((const __m128i *)(row0 + c * 8))),
                                   (const double *)(row1 + c * 8));
        __m512i u = _mm512_cvtepu8_epi32(_mm_castpd_si128(r01));
        #pragma GCC unroll 4
        for (int t = 0; t < PER; t++) {
            __m512 v = field512(u, t, BITS);
            for (int i = 0; i < NG; i++) a[i] = _mm512_fmadd_ps(dup256(qs + i * MAXHD + c * C + t * 8), v, a[i]);
        }
    }
    for (int i = 0; i < NG; i++) {
        _mm256_storeu_ps(out0 + i * ostride, lo256(a[i]));
        _mm256_storeu_ps(out1 + i * ostride, hi256(a[i]));
    }
}

#define SCORE_PAIR_BITS(BITS, NG, ...) score_codes2_512(BITS, NG, __VA_ARGS__)
#define SCORE_PAIR512(NG, bits, ...) switch (bits) {                                                 \
        case 8: SCORE_PAIR_BITS(8, NG, __VA_ARGS__); break; case 4: SCORE_PAIR_BITS(4, NG, __VA_ARGS__); break; \
        default: SCORE_PAIR_BITS(2, NG, __VA_ARGS__); break; }

#define FLOOR512(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)

/* exp256's operations, in its order, on 16 lanes */
static inline __m512 exp512(__m512 x) {
    EXP_PS(512, x, FLOOR512);
    return x;
}

static inline void softmax_row512(float *s, long n) {
    const float m = row_max(s, n);
    const __m512 vm = _mm512_set1_ps(m);
    __m256 vsum = _mm256_setzero_ps();
    long j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
        _mm512_storeu_ps(s + j, e);
        vsum = _mm256_add_ps(_mm256_add_ps(vsum, lo256(e)), hi256(e));
    }
    if (j + 8 <= n) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(m)));
        _mm256_storeu_ps(s + j, e);
        vsum = _mm256_add_ps(vsum, e);
        j += 8;
    }
    float sum = hsum256(vsum);
    for (; j < n; j++) { s[j] = expf(s[j] - m); sum += s[j]; }
    const float inv = 1.0f / sum;
    const __m512 vinv = _mm512_set1_ps(inv);
    for (j = 0; j + 16 <= n; j += 16) _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_loadu_ps(s + j), vinv));
    for (; j < n; j++) s[j] *= inv;
}

/* Value rows in natural order (fp32 ring, fp16, bf16, FP8): ND * 16 dimensions from d of NG heads, in
 * registers across nrow rows (rstride bytes apart) weighted by w (heads, wstride), added in row order to the
 * running sums acc (heads MAXHD apart). */
static inline __attribute__((always_inline)) void vrows512(const int NG, const int ND, int mode, const char *rows,
                                                           long rstride, long nrow, const float *w, long wstride,
                                                           float *acc, long d) {
    __m512 a[8][2];
    for (int i = 0; i < NG; i++)
        for (int k = 0; k < ND; k++) a[i][k] = _mm512_load_ps(acc + i * MAXHD + d + 16 * k);
    for (long r = 0; r < nrow; r++) {
        __m512 v[2];
        for (int k = 0; k < ND; k++) v[k] = load16(mode, rows + r * rstride, d + 16 * k);
        for (int i = 0; i < NG; i++) {
            __m512 wi = _mm512_set1_ps(w[i * wstride + r]);
            for (int k = 0; k < ND; k++) a[i][k] = _mm512_fmadd_ps(wi, v[k], a[i][k]);
        }
    }
    for (int i = 0; i < NG; i++)
        for (int k = 0; k < ND; k++) _mm512_store_ps(acc + i * MAXHD + d + 16 * k, a[i][k]);
}

#define VROWS_ND(NG, ND, ...) vrows512(NG, ND, __VA_ARGS__)
#define VROWS2(NG, ...) VROWS_ND(NG, 2, __VA_ARGS__)
#define VROWS1(NG, ...) VROWS_ND(NG, 1, __VA_ARGS__)

/* every head and dimension of a block's natural-order value rows; w (g, wstride) */
static inline void vrows512_all(int mode, const char *rows, long rstride, long nrow, const float *w, long wstride,
                                long g, float *accn, long hd) {
    const long hd16 = hd & ~15L;
    for (long i0 = 0; i0 < g; i0 += 8) {
        const long ng = g - i0 < 8 ? g - i0 : 8;
        float *acc = accn + i0 * MAXHD;
        long d = 0;
        const float *wi = w + i0 * wstride;
        for (; d + 32 <= hd16; d += 32) { SWITCH_HEADS(ng, VROWS2, mode, rows, rstride, nrow, wi, wstride, acc, d) }
        if (d < hd16) { SWITCH_HEADS(ng, VROWS1, mode, rows, rstride, nrow, wi, wstride, acc, d) }
        if (hd16 < hd)  /* hd % 16 == 8: the last 8 dimensions as the AVX2 loop does them */
            for (long r = 0; r < nrow; r++) {
                __m256 v = load8(mode, rows + r * rstride, hd16);
                for (long i = 0; i < ng; i++) {
                    float *p = acc + i * MAXHD + hd16;
                    _mm256_store_ps(p, _mm256_fmadd_ps(_mm256_set1_ps(wi[i * wstride + r]), v, _mm256_load_ps(p)));
                }
            }
    }
}

/* vchunk over two adjacent chunks of one V group: chunk c in the low halves, c + 1 in the high halves */
static inline __attribute__((always_inline)) void vchunk2_512(const int NG, const int PER, const uint8_t *codes,
                                                              long rstride, long nrow, const float *w, long wstride,
                                                              float *acc, long vC) {
    const int BITS = 8 / PER;
    __m512 a[8][4];
    for (int i = 0; i < NG; i++)
        for (int t = 0; t < PER; t++) a[i][t] = _mm512_setzero_ps();
    for (long r = 0; r < nrow; r++) {
        __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + r * rstride)));
        #pragma GCC unroll 4
        for (int t = 0; t < PER; t++) {
            __m512 v = field512(u, t, BITS);
            for (int i = 0; i < NG; i++) a[i][t] = _mm512_fmadd_ps(_mm512_set1_ps(w[i * wstride + r]), v, a[i][t]);
        }
    }
    for (int i = 0; i < NG; i++)
        for (int t = 0; t < PER; t++) {
            float *p0 = acc + i * MAXHD + t * 8, *p1 = p0 + vC;
            _mm256_store_ps(p0, _mm256_add_ps(_mm256_load_ps(p0), lo256(a[i][t])));
            _mm256_store_ps(p1, _mm256_add_ps(_mm256_load_ps(p1), hi256(a[i][t])));
        }
}

#define VCH2(NG, PER, ...) vchunk2_512(NG, PER, __VA_ARGS__)

/* up to 8 heads; 2-bit codes take four fields each, so at most 4 heads a pass */
static inline void vchunk2_512_any(long ng, int vper, const uint8_t *codes, long rstride, long nrow, const float *w,
                                   long wstride, float *acc) {
    const long vC = 8 * vper;
    if (vper == 1) { SWITCH_HEADS(ng, VCH2, 1, codes, rstride, nrow, w, wstride, acc, vC) }
    else if (vper == 2) { SWITCH_HEADS(ng, VCH2, 2, codes, rstride, nrow, w, wstride, acc, vC) }
    else
        for (long i0 = 0; i0 < ng; i0 += 4) {
            const long m = ng - i0 < 4 ? ng - i0 : 4;
            SWITCH_HEADS4(m, VCH2, 4, codes, rstride, nrow, w + i0 * wstride, wstride, acc + i0 * MAXHD, vC)
        }
}
