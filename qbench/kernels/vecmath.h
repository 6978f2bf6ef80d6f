/* Vector math shared by the attention kernels, and the fp16/bf16 roundings of the KV writes. */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* exp of a vector of W-bit floats (W = 256 or 512), Cephes-style range reduction and polynomial, |rel err| <
 * 2e-7. One body for both widths, so a lane's exp is the same bits at either width (attn_kv512.h's softmax). */
#define EXP_PS(W, x, FLOOR) do {                                                                          \
        const __m##W hi_ = _mm##W##_set1_ps(88.3762626647949f), lo_ = _mm##W##_set1_ps(-88.3762626647949f);  \
        x = _mm##W##_min_ps(_mm##W##_max_ps(x, lo_), hi_);                                               \
        __m##W fx = FLOOR(_mm##W##_fmadd_ps(x, _mm##W##_set1_ps(1.44269504088896341f), _mm##W##_set1_ps(0.5f))); \
        x = _mm##W##_fnmadd_ps(fx, _mm##W##_set1_ps(0.693359375f), x);                                   \
        x = _mm##W##_fnmadd_ps(fx, _mm##W##_set1_ps(-2.12194440e-4f), x);                                \
        __m##W z = _mm##W##_mul_ps(x, x), y = _mm##W##_set1_ps(1.9875691500E-4f);                        \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(1.3981999507E-3f));                                 \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(8.3334519073E-3f));                                 \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(4.1665795894E-2f));                                 \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(1.6666665459E-1f));                                 \
        y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(5.0000001201E-1f));                                 \
        y = _mm##W##_add_ps(_mm##W##_fmadd_ps(y, z, x), _mm##W##_set1_ps(1.0f));                         \
        __m##W##i e = _mm##W##_slli_epi32(_mm##W##_add_epi32(_mm##W##_cvttps_epi32(fx), _mm##W##_set1_epi32(0x7f)), 23); \
        x = _mm##W##_mul_ps(y, _mm##W##_castsi##W##_ps(e));                                              \
    } while (0)

static inline __m256 exp256(__m256 x) {
    EXP_PS(256, x, _mm256_floor_ps);
    return x;
}

/* exp of one float with the vector exp's bits */
static inline float exp1(float x) { return _mm256_cvtss_f32(exp256(_mm256_set1_ps(x))); }

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* hsum256 of eight vectors (v + 8 r for r < 8; v 32-byte aligned) at once, with hsum256's adds in its order:
 * lane r holds row r */
static inline __attribute__((always_inline)) __m256 hsum256x8(const float *v) {
    /* [lo + hi of row 2r | of row 2r+1]: a blend and a lane swap, so no half goes through memory */
#define HSUM_PAIR(r) _mm256_add_ps(_mm256_blend_ps(_mm256_load_ps(v + 16 * (r)), _mm256_load_ps(v + 16 * (r) + 8), 0xF0), \
                                   _mm256_permute2f128_ps(_mm256_load_ps(v + 16 * (r)), _mm256_load_ps(v + 16 * (r) + 8), 0x21))
    const __m256 u0 = HSUM_PAIR(0), u1 = HSUM_PAIR(1), u2 = HSUM_PAIR(2), u3 = HSUM_PAIR(3);
#undef HSUM_PAIR
    /* per 128-bit lane: (a0 + a2, a1 + a3) of two rows */
    const __m256 w0 = _mm256_add_ps(_mm256_shuffle_ps(u0, u1, 0x44), _mm256_shuffle_ps(u0, u1, 0xEE));
    const __m256 w1 = _mm256_add_ps(_mm256_shuffle_ps(u2, u3, 0x44), _mm256_shuffle_ps(u2, u3, 0xEE));
    const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(w0, w1, 0x88), _mm256_shuffle_ps(w0, w1, 0xDD));
    return _mm256_permutevar8x32_ps(t, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* max of s[0..n): exact in any order */
static inline float row_max(const float *s, long n) {
    __m256 vm = _mm256_set1_ps(-INFINITY);
    long j = 0;
    for (; j + 8 <= n; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + j));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    float m = _mm_cvtss_f32(h);
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    return m;
}

/* s[0..n) <- softmax(s), in place; max-subtracted, so no score overflows exp */
static inline void softmax_row(float *s, long n) {
    const float m = row_max(s, n);
    __m256 vm = _mm256_set1_ps(m), vsum = _mm256_setzero_ps();
    long j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        _mm256_storeu_ps(s + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float sum = hsum256(vsum);
    for (; j < n; j++) { s[j] = expf(s[j] - m); sum += s[j]; }
    float inv = 1.0f / sum;
    for (j = 0; j < n; j++) s[j] *= inv;
}

/* acc[d0..hd) += sum over keys j in [j0, j1) of p[j] * rows[j][d0..hd), each element an FMA chain over j in
 * order (the scalar tail: a multiply, then an add), 64 dimensions at a time in registers. The paged attention's
 * values (ops_f32.c) and the prefill attention's (attn_prefill.c) both sum this way. */
static inline void weighted_rows(const float *p, const float *const *rows, long j0, long j1, long d0, long hd,
                                 float *acc) {
    for (; d0 + 64 <= hd; d0 += 64) {
        float *a = acc + d0;
        __m256 c0 = _mm256_loadu_ps(a), c1 = _mm256_loadu_ps(a + 8), c2 = _mm256_loadu_ps(a + 16),
               c3 = _mm256_loadu_ps(a + 24), c4 = _mm256_loadu_ps(a + 32), c5 = _mm256_loadu_ps(a + 40),
               c6 = _mm256_loadu_ps(a + 48), c7 = _mm256_loadu_ps(a + 56);
        for (long j = j0; j < j1; j++) {
            const float *vr = rows[j] + d0;
            __m256 pj = _mm256_set1_ps(p[j]);
            c0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr), c0);
            c1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8), c1);
            c2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 16), c2);
            c3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 24), c3);
            c4 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 32), c4);
            c5 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 40), c5);
            c6 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 48), c6);
            c7 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 56), c7);
        }
        _mm256_storeu_ps(a, c0); _mm256_storeu_ps(a + 8, c1); _mm256_storeu_ps(a + 16, c2);
        _mm256_storeu_ps(a + 24, c3); _mm256_storeu_ps(a + 32, c4); _mm256_storeu_ps(a + 40, c5);
        _mm256_storeu_ps(a + 48, c6); _mm256_storeu_ps(a + 56, c7);
    }
    for (; d0 + 8 <= hd; d0 += 8) {
        __m256 c = _mm256_loadu_ps(acc + d0);
        for (long j = j0; j < j1; j++) c = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(rows[j] + d0), c);
        _mm256_storeu_ps(acc + d0, c);
    }
    for (; d0 < hd; d0++) {
        float c = acc[d0];
        for (long j = j0; j < j1; j++) c += p[j] * rows[j][d0];
        acc[d0] = c;
    }
}

static inline uint16_t to_f16(float f) {  /* round to nearest even, as torch's .to(float16) */
    return _cvtss_sh(f, 0);
}

static inline uint16_t to_bf16(float f) {  /* torch's round-to-nearest-even, NaN kept quiet */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
