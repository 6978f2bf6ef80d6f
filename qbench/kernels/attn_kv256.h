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

/* score_row over a block's nrow natural-order rows (rstride bytes apart; row r's sums at out + r * 8), MODE a
 * compile-time constant so that no load pays for the format dispatch; with up to 3 heads two rows a pass, whose
 * four chains a head (each row's a and b) hide the FMA latency. Each row's sums are score_row's, in its order
 * (attn_kv512.h's score_rows512 is the wide twin). */
static inline __attribute__((always_inline)) void score_rows256(const int NG, const int MODE, const char *rows,
                                                                long rstride, long nrow, const float *qh, long hd,
                                                                float *out, long ostride) {
    long r = 0;
    for (; NG <= 3 && r + 2 <= nrow; r += 2) {
        const char *r0 = rows + r * rstride, *r1 = r0 + rstride;
        __m256 a0[8], b0[8], a1[8], b1[8];  /* 3 used: two rows a pass only up to 3 heads */
        for (int i = 0; i < NG; i++) a0[i] = b0[i] = a1[i] = b1[i] = _mm256_setzero_ps();
        long d = 0;
        for (; d + 16 <= hd; d += 16) {
            const __m256 v0 = load8(MODE, r0, d), v1 = load8(MODE, r1, d);
            const __m256 w0 = load8(MODE, r0, d + 8), w1 = load8(MODE, r1, d + 8);
            for (int i = 0; i < NG; i++) {
                const __m256 q = _mm256_loadu_ps(qh + i * hd + d), p = _mm256_loadu_ps(qh + i * hd + d + 8);
                a0[i] = _mm256_fmadd_ps(q, v0, a0[i]);
                a1[i] = _mm256_fmadd_ps(q, v1, a1[i]);
                b0[i] = _mm256_fmadd_ps(p, w0, b0[i]);
                b1[i] = _mm256_fmadd_ps(p, w1, b1[i]);
            }
        }
        for (; d < hd; d += 8) {
            const __m256 v0 = load8(MODE, r0, d), v1 = load8(MODE, r1, d);
            for (int i = 0; i < NG; i++) {
                const __m256 q = _mm256_loadu_ps(qh + i * hd + d);
                a0[i] = _mm256_fmadd_ps(q, v0, a0[i]);
                a1[i] = _mm256_fmadd_ps(q, v1, a1[i]);
            }
        }
        for (int i = 0; i < NG; i++) {
            _mm256_store_ps(out + i * ostride + r * 8, _mm256_add_ps(a0[i], b0[i]));
            _mm256_store_ps(out + i * ostride + r * 8 + 8, _mm256_add_ps(a1[i], b1[i]));
        }
    }
    for (; r < nrow; r++) score_row(NG, MODE, rows + r * rstride, qh, hd, hd, out + r * 8, ostride);
}

#define SCORE_ROWS256(NG, mode, ...) SWITCH_KV_MODE(score_rows256, NG, mode, __VA_ARGS__)

/* Value rows in natural order (fp32 ring, fp16, bf16, FP8): ND * 8 dimensions from d of NG heads, in registers
 * across nrow rows (rstride bytes apart) weighted by w (heads, wstride), added in row order to the running sums
 * acc (heads MAXHD apart). Each lane takes the rows in order from the running sum, as a load, FMA and store a
 * row would, so the bits are those of that loop (and of vrows512). NG * ND <= 12 accumulators. */
static inline __attribute__((always_inline)) void vrows256(const int NG, const int ND, const int MODE,
                                                           const char *rows, long rstride, long nrow, const float *w,
                                                           long wstride, float *acc, long d) {
    __m256 a[12];  /* head i, chunk k at i * ND + k */
    #pragma GCC unroll 12
    for (int i = 0; i < NG; i++)
        #pragma GCC unroll 4
        for (int k = 0; k < ND; k++) a[i * ND + k] = _mm256_load_ps(acc + i * MAXHD + d + 8 * k);
    for (long r = 0; r < nrow; r++) {
        __m256 wr[8];
        #pragma GCC unroll 8
        for (int i = 0; i < NG; i++) wr[i] = _mm256_set1_ps(w[i * wstride + r]);
        #pragma GCC unroll 4
        for (int k = 0; k < ND; k++) {
            const __m256 v = load8(MODE, rows + r * rstride, d + 8 * k);
            #pragma GCC unroll 8
            for (int i = 0; i < NG; i++) a[i * ND + k] = _mm256_fmadd_ps(wr[i], v, a[i * ND + k]);
        }
    }
    #pragma GCC unroll 12
    for (int i = 0; i < NG; i++)
        #pragma GCC unroll 4
        for (int k = 0; k < ND; k++) _mm256_store_ps(acc + i * MAXHD + d + 8 * k, a[i * ND + k]);
}

#define VROWS256_1(NG, MODE, ...) vrows256(NG, 1, MODE, __VA_ARGS__)

/* every dimension of up to 8 heads: as many chunks a pass as keep the accumulators in registers */
static inline __attribute__((always_inline)) void vrows256_heads(long ng, const int MODE, const char *rows,
                                                                 long rstride, long nrow, const float *w,
                                                                 long wstride, float *acc, long hd) {
    long d = 0;
    switch (ng) {
    case 1: for (; d + 32 <= hd; d += 32) vrows256(1, 4, MODE, rows, rstride, nrow, w, wstride, acc, d); break;
    case 2: for (; d + 32 <= hd; d += 32) vrows256(2, 4, MODE, rows, rstride, nrow, w, wstride, acc, d); break;
    case 3: for (; d + 24 <= hd; d += 24) vrows256(3, 3, MODE, rows, rstride, nrow, w, wstride, acc, d); break;
    case 4: for (; d + 16 <= hd; d += 16) vrows256(4, 2, MODE, rows, rstride, nrow, w, wstride, acc, d); break;
    default: break;
    }
    for (; d < hd; d += 8) { SWITCH_HEADS(ng, VROWS256_1, MODE, rows, rstride, nrow, w, wstride, acc, d) }
}

/* every head and dimension of a block's natural-order value rows; w (g, wstride) */
static inline void vrows256_all(int mode, const char *rows, long rstride, long nrow, const float *w, long wstride,
                                long g, float *accn, long hd) {
    for (long i0 = 0; i0 < g; i0 += 8) {
        const long ng = g - i0 < 8 ? g - i0 : 8;
        const float *wi = w + i0 * wstride;
        float *acc = accn + i0 * MAXHD;
        SWITCH_KV_MODE(vrows256_heads, ng, mode, rows, rstride, nrow, wi, wstride, acc, hd)
    }
}

/* field t of BITS-bit codes widened to int32 lanes, as float: the lowest field needs no shift, the highest no
 * mask (attn_kv512.h's field512 on 8 lanes), so 8-bit codes cost one conversion */
static inline __attribute__((always_inline)) __m256 field256(__m256i u, const int t, const int BITS) {
    __m256i x = t ? _mm256_srli_epi32(u, t * BITS) : u;
    if ((t + 1) * BITS < 8) x = _mm256_and_si256(x, _mm256_set1_epi32((1 << BITS) - 1));
    return _mm256_cvtepi32_ps(x);
}

static inline __attribute__((always_inline)) void score_codes_b(const int NG, const int BITS, const uint8_t *row,
                                                                const float *qs, long hd, float *out, long ostride) {
    const int PER = 8 / BITS;
    const long C = 8 * PER;
    __m256 a[8], b[8];
    for (int i = 0; i < NG; i++) a[i] = b[i] = _mm256_setzero_ps();
    for (long c = 0; c < hd / C; c++) {
        __m256i u = u8x8(row + c * 8);
        #pragma GCC unroll 4
        for (int t = 0; t < PER; t++) {
            __m256 v = field256(u, t, BITS);
            for (int i = 0; i < NG; i++) {
                if (t & 1) b[i] = _mm256_fmadd_ps(_mm256_load_ps(qs + i * MAXHD + c * C + t * 8), v, b[i]);
                else a[i] = _mm256_fmadd_ps(_mm256_load_ps(qs + i * MAXHD + c * C + t * 8), v, a[i]);
            }
        }
    }
    for (int i = 0; i < NG; i++) _mm256_store_ps(out + i * ostride, _mm256_add_ps(a[i], b[i]));
}

/* the code width a compile-time constant (per = 8 / bits), so no shift or mask is spent where none is needed */
static inline __attribute__((always_inline)) void score_codes(const int NG, const uint8_t *row, const float *qs,
                                                              long hd, int bits, float *out, long ostride) {
    switch (bits) {
    case 8: score_codes_b(NG, 8, row, qs, hd, out, ostride); break;
    case 4: score_codes_b(NG, 4, row, qs, hd, out, ostride); break;
    default: score_codes_b(NG, 2, row, qs, hd, out, ostride); break;
    }
}

/* NC adjacent V chunks (8 bytes of codes each: 8 * PER channels in perm order, chunk n's at acc + n * vC) of a
 * block's rows, for NG heads: the accumulators stay in registers across the rows and are added to acc once.
 * w (heads, wstride): each row's weight p * s for each head. NG * PER * NC <= 8.
 * Each accumulator is one chain of FMAs, a row at a time, so with few heads (SmolLM2's 3 per KV head, 8-bit
 * V) one chunk waits on the FMA latency; NC chunks give NC times the chains. Every lane sums its rows in the
 * same order whatever NC (and as vchunk2_512), so NC changes no bit. */
static inline __attribute__((always_inline)) void vchunkn(const int NG, const int PER, const int NC,
                                                          const uint8_t *codes, long rstride, long nrow,
                                                          const float *w, long wstride, float *acc, long vC) {
    const int BITS = 8 / PER;
    __m256 a[8];  /* head i, field t, chunk n at (i * PER + t) * NC + n: a small flat array stays in registers */
    #pragma GCC unroll 8
    for (int k = 0; k < NG * PER * NC; k++) a[k] = _mm256_setzero_ps();
    for (long r = 0; r < nrow; r++) {
        __m256 wr[8];
        #pragma GCC unroll 8
        for (int i = 0; i < NG; i++) wr[i] = _mm256_broadcast_ss(w + i * wstride + r);
        #pragma GCC unroll 4
        for (int n = 0; n < NC; n++) {
            const __m256i u = u8x8(codes + r * rstride + n * 8);
            #pragma GCC unroll 4
            for (int t = 0; t < PER; t++) {
                const __m256 v = field256(u, t, BITS);
                #pragma GCC unroll 8
                for (int i = 0; i < NG; i++) a[(i * PER + t) * NC + n] = _mm256_fmadd_ps(wr[i], v, a[(i * PER + t) * NC + n]);
            }
        }
    }
    #pragma GCC unroll 8
    for (int i = 0; i < NG; i++)
        #pragma GCC unroll 4
        for (int t = 0; t < PER; t++)
            #pragma GCC unroll 4
            for (int n = 0; n < NC; n++) {
                float *p = acc + i * MAXHD + n * vC + t * 8;
                _mm256_store_ps(p, _mm256_add_ps(_mm256_load_ps(p), a[(i * PER + t) * NC + n]));
            }
}

#define VCHUNK(NG, PER, ...) vchunkn(NG, PER, 1, __VA_ARGS__, 0)

/* How many chunks one pass takes with all g heads' accumulators in registers: 4 or 2 where g * per * 4 (or 2) <= 8
 * and the V group has that many left (vchunk_multi then), else 1 (vchunkn by heads) */
static inline long vchunks_at_once(long g, int vper, long left) {
    if (g * vper * 4 <= 8 && left >= 4) return 4;
    if (g * vper * 2 <= 8 && left >= 2) return 2;
    return 1;
}

/* nc (2 or 4, from vchunks_at_once) chunks for all g heads in one pass */
static inline void vchunk_multi(long g, int vper, long nc, const uint8_t *codes, long rstride, long nrow,
                                const float *w, long wstride, float *acc, long vC) {
    if (nc == 4) {
        if (vper == 2) vchunkn(1, 2, 4, codes, rstride, nrow, w, wstride, acc, vC);
        else if (g == 2) vchunkn(2, 1, 4, codes, rstride, nrow, w, wstride, acc, vC);
        else vchunkn(1, 1, 4, codes, rstride, nrow, w, wstride, acc, vC);
    } else if (vper == 1) {
        switch (g) {
        case 4: vchunkn(4, 1, 2, codes, rstride, nrow, w, wstride, acc, vC); break;
        case 3: vchunkn(3, 1, 2, codes, rstride, nrow, w, wstride, acc, vC); break;
        case 2: vchunkn(2, 1, 2, codes, rstride, nrow, w, wstride, acc, vC); break;
        default: vchunkn(1, 1, 2, codes, rstride, nrow, w, wstride, acc, vC); break;
        }
    } else if (vper == 2) {
        if (g == 2) vchunkn(2, 2, 2, codes, rstride, nrow, w, wstride, acc, vC);
        else vchunkn(1, 2, 2, codes, rstride, nrow, w, wstride, acc, vC);
    } else {
        vchunkn(1, 4, 2, codes, rstride, nrow, w, wstride, acc, vC);
    }
}

/* score_codes for two rows at once: each q*s load serves both, and the two rows are independent chains. */
static inline __attribute__((always_inline)) void score_codes2_b(const int NG, const int BITS, const uint8_t *row0,
                                                                 const uint8_t *row1, const float *qs, long hd,
                                                                 float *out0, float *out1, long ostride) {
    const int PER = 8 / BITS;
    const long C = 8 * PER;
    __m256 a[4], b[4];
    for (int i = 0; i < NG; i++) a[i] = b[i] = _mm256_setzero_ps();
    for (long c = 0; c < hd / C; c++) {
        __m256i u = u8x8(row0 + c * 8), w = u8x8(row1 + c * 8);
        #pragma GCC unroll 4
        for (int t = 0; t < PER; t++) {
            __m256 v = field256(u, t, BITS), x = field256(w, t, BITS);
            for (int i = 0; i < NG; i++) {
                __m256 qv = _mm256_load_ps(qs + i * MAXHD + c * C + t * 8);
                a[i] = _mm256_fmadd_ps(qv, v, a[i]);
                b[i] = _mm256_fmadd_ps(qv, x, b[i]);
            }
        }
    }
    for (int i = 0; i < NG; i++) { _mm256_store_ps(out0 + i * ostride, a[i]); _mm256_store_ps(out1 + i * ostride, b[i]); }
}

static inline __attribute__((always_inline)) void score_codes2(const int NG, const uint8_t *row0, const uint8_t *row1,
                                                               const float *qs, long hd, int bits, float *out0,
                                                               float *out1, long ostride) {
    switch (bits) {
    case 8: score_codes2_b(NG, 8, row0, row1, qs, hd, out0, out1, ostride); break;
    case 4: score_codes2_b(NG, 4, row0, row1, qs, hd, out0, out1, ostride); break;
    default: score_codes2_b(NG, 2, row0, row1, qs, hd, out0, out1, ostride); break;
    }
}
