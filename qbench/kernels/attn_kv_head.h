/* The work of qb_attention_kv on one query row, for all its KV heads (each with its own scratch, S[h]): the
 * scores of a head's g query heads against every key, their softmax, and the weighted sum of the values,
 * segment by segment (VSEG). A row is either one task (``attend``) or, with few rows, shared between threads
 * in phases (``part_scores``, ``softmax_head``, ``seg_values``; attn_kv.c adds the segments up). attn_kv.c
 * includes this file twice: with WIDE 0 (AVX2 helpers) and WIDE 1 (AVX-512 helpers, under a target pragma),
 * SFX naming each copy. The wide helpers sum every lane in the AVX2 helpers' order, so both give the same
 * bits, and so do the two ways of splitting a row: a score is one key's, and a segment's sums start from zero
 * either way. */

/* the scores of heads [kh0, kh1) against block jb's keys */
static void SFX(scores)(const kv_call *C, kv_scratch *S, const kv_task *tk, long kh0, long kh1, long jb) {
    const kv_src *K = &C->K;
    const long nkv = C->nkv, hd = C->hd, bs = C->bs, g = C->g, maxlen = C->maxlen, W = C->W, krb = C->krb;
    const int kbits = K->bits;
    const long start = tk->start, end = tk->end, nq = tk->nq, slot = tk->slot, nh = kh1 - kh0;
    const float *q = C->q + (tk->bt * C->nh + kh0 * g) * hd;  /* head h's queries at q + h * g * hd */
    /* the heads' spans differ only in where their rows start */
    const kv_span sp = span_at(jb, start, end, bs, tk->tab, nq, C->rk, slot, W, nkv, kh0, hd, K->codes, krb);
    const long j0 = sp.j0, j1 = sp.j1, blk = sp.blk;
    const int in_ring = sp.ring != NULL;
    const long nrow = j1 - j0, off0 = j0 - jb * bs;
    const long hstep = span_head_step(&sp, hd, krb);  /* bytes from one head's row slice to the next */
    float *rowf = S->rowf;  /* each row's multiplier, for every head */
    if (in_ring || K->mode != KV_CHANNEL) {
        const int mode = in_ring ? KV_F32 : K->mode;
        for (long r = 0; r < nrow; r++) {
            rowf[r] = C->scale;
            if (!in_ring && K->mode == KV_FP8) rowf[r] *= half_to_float(K->scale[blk * bs + off0 + r]);
        }
        const char *rows = (const char *)span_row(&sp, off0, nkv, hd, krb);
        const long rstride = span_stride(&sp, nkv, hd, krb);
        for (long r = 0; r < nrow; r += 2) {  /* a pair of rows, every head's slice of them */
            const long nr = nrow - r < 2 ? nrow - r : 2;
            for (long h = 0; h < nh; h++) {
                const char *rh = rows + r * rstride + h * hstep;
                const float *qh = q + h * g * hd;
                float *raw = S[h].raw + r * 8;
#if WIDE
                for (long i0 = 0; i0 < g; i0 += 8) {
                    long ng = g - i0 < 8 ? g - i0 : 8;
                    SWITCH_HEADS(ng, SCORE_ROWS512, mode, rh, rstride, nr, qh + i0 * hd, hd, raw + i0 * bs * 8, bs * 8)
                }
#else
                for (long i0 = 0; i0 < g; i0 += 8) {
                    long ng = g - i0 < 8 ? g - i0 : 8;
                    SWITCH_HEADS(ng, SCORE_ROWS256, mode, rh, rstride, nr, qh + i0 * hd, hd, raw + i0 * bs * 8, bs * 8)
                }
#endif
            }
        }
        for (long h = 0; h < nh; h++) close_scores(S[h].raw, g, bs, nrow, NULL, rowf, S[h].scores + j0 - start, maxlen);
        return;
    }
    for (long h = 0; h < nh; h++)
        kivi_block_query(C, S + h, q + h * g * hd, K->scale + (blk * nkv + kh0 + h) * hd, K->mn + (blk * nkv + kh0 + h) * hd);
    const long rs = nkv * krb;  /* bytes from one key row to the next */
    long r = 0;
    for (; r + 2 <= nrow; r += 2)
        for (long h = 0; h < nh; h++) {
            const uint8_t *row = sp.codes + (off0 + r) * rs + h * hstep;
            const float *qs = S[h].qs;
            float *out = S[h].raw + r * 8;
#if WIDE
            for (long i0 = 0; i0 < g; i0 += 8) {
                long ng = g - i0 < 8 ? g - i0 : 8;
                SWITCH_HEADS(ng, SCORE_PAIR512, kbits, row, row + rs, qs + i0 * MAXHD, hd, out + i0 * bs * 8,
                             out + i0 * bs * 8 + 8, bs * 8)
            }
#else
            for (long i0 = 0; i0 < g; i0 += 4) {
                long ng = g - i0 < 4 ? g - i0 : 4;
                SWITCH_HEADS4(ng, score_codes2, row, row + rs, qs + i0 * MAXHD, hd, kbits, out + i0 * bs * 8,
                              out + i0 * bs * 8 + 8, bs * 8)
            }
#endif
        }
    for (; r < nrow; r++)
        for (long h = 0; h < nh; h++) {
            const uint8_t *row = sp.codes + (off0 + r) * rs + h * hstep;
            for (long i0 = 0; i0 < g; i0 += 8) {
                long ng = g - i0 < 8 ? g - i0 : 8;
                SWITCH_HEADS(ng, score_codes, row, S[h].qs + i0 * MAXHD, hd, kbits, S[h].raw + (i0 * bs + r) * 8, bs * 8)
            }
        }
    for (r = 0; r < nrow; r++) rowf[r] = C->scale;
    for (long h = 0; h < nh; h++) close_scores(S[h].raw, g, bs, nrow, S[h].c0, rowf, S[h].scores + j0 - start, maxlen);
}

/* head kh's weighted sum of block jb's values, added to the sums A */
static void SFX(values)(const kv_call *C, kv_scratch *S, const kv_acc *A, const kv_task *tk, long kh, long jb) {
    const kv_src *V = &C->V;
    const long nkv = C->nkv, hd = C->hd, bs = C->bs, g = C->g, maxlen = C->maxlen, W = C->W;
    const long vrb = C->vrb, nvg = C->nvg, vC = C->vC;
    const int vper = C->vper;
    const long start = tk->start, end = tk->end, nq = tk->nq, slot = tk->slot;
    const int64_t *tab = tk->tab;
    float *scores = S->scores, *wbuf = S->wbuf;  /* wbuf (g, bs): a block's value weights */
    float *accn = A->accn, *accp = A->accp, *bias = A->bias;
    const kv_span sp = span_at(jb, start, end, bs, tab, nq, C->rv, slot, W, nkv, kh, hd, V->codes, vrb);
    const long j0 = sp.j0, j1 = sp.j1, blk = sp.blk;
    const int in_ring = sp.ring != NULL;
    const long nrow = j1 - j0, off0 = j0 - jb * bs;
    if (in_ring || V->mode != KV_TOKEN) {
        const int mode = in_ring ? KV_F32 : V->mode;
        const char *rows = (const char *)span_row(&sp, off0, nkv, hd, vrb);
        const long rstride = span_stride(&sp, nkv, hd, vrb);
        float *mul = S->rowf;  /* each row's FP8 scale (1 otherwise), then its weight per head */
        for (long r = 0; r < nrow; r++)
            mul[r] = (!in_ring && V->mode == KV_FP8) ? half_to_float(V->scale[blk * bs + off0 + r]) : 1.0f;
        for (long i = 0; i < g; i++)
            for (long r = 0; r < nrow; r++) wbuf[i * bs + r] = scores[i * maxlen + j0 + r - start] * mul[r];
#if WIDE
        vrows512_all(mode, rows, rstride, nrow, wbuf, bs, g, accn, hd);
#else
        vrows256_all(mode, rows, rstride, nrow, wbuf, bs, g, accn, hd);
#endif
        return;
    }
    /* a KIVI block: per group of channels, each row's weight p * s per head, then the group's chunks
     * accumulate over the block's rows in registers */
    const long st0 = ((blk * bs + off0) * nkv + kh) * nvg, sstride = nkv * nvg, rs = nkv * vrb;
    const uint8_t *rows = sp.codes + off0 * rs;
    float *sg = S->rowf, *mg = S->rowf + bs;
    for (long gi = 0; gi < nvg; gi++) {
        long r = 0;
        for (; r + 8 <= nrow; r += 8) {  /* eight rows' statistics, sstride halves apart, in one conversion */
            _mm256_storeu_ps(sg + r, halves8(V->scale + st0 + r * sstride + gi, sstride));
            _mm256_storeu_ps(mg + r, halves8(V->mn + st0 + r * sstride + gi, sstride));
        }
        for (; r < nrow; r++) {
            sg[r] = half_to_float(V->scale[st0 + r * sstride + gi]);
            mg[r] = half_to_float(V->mn[st0 + r * sstride + gi]);
        }
        for (long i = 0; i < g; i++)
            vweights(scores + i * maxlen + j0 - start, sg, mg, nrow, wbuf + i * bs, bias + i * (nvg + 1) + gi);
        long c = gi * V->vg / vC;
        const long c1 = (gi + 1) * V->vg / vC;
#if WIDE
        for (; c + 2 <= c1; c += 2)  /* two chunks of each row in one zmm */
            for (long i0 = 0; i0 < g; i0 += 8) {
                long ng = g - i0 < 8 ? g - i0 : 8;
                vchunk2_512_any(ng, vper, rows + c * 8, rs, nrow, wbuf + i0 * bs, bs, accp + i0 * MAXHD + c * vC);
            }
#endif
        for (long nc; c < c1; c += nc) {
            nc = vchunks_at_once(g, vper, c1 - c);
            if (nc > 1) {  /* few heads: several chunks' chains at once */
                vchunk_multi(g, vper, nc, rows + c * 8, rs, nrow, wbuf, bs, accp + c * vC, vC);
                continue;
            }
            for (long i0 = 0; i0 < g; i0 += 8 / vper) {
                const long hg = 8 / vper, ng = g - i0 < hg ? g - i0 : hg;  /* heads per register pass */
                const uint8_t *cc = rows + c * 8;
                const float *w = wbuf + i0 * bs;
                float *acc = accp + i0 * MAXHD + c * vC;
                if (vper == 4) { if (ng == 2) VCHUNK(2, 4, cc, rs, nrow, w, bs, acc);
                                 else VCHUNK(1, 4, cc, rs, nrow, w, bs, acc); }
                else if (vper == 2) { SWITCH_HEADS4(ng, VCHUNK, 2, cc, rs, nrow, w, bs, acc) }
                else { SWITCH_HEADS(ng, VCHUNK, 1, cc, rs, nrow, w, bs, acc) }
            }
        }
    }
}

/* every head's softmax over the row's n scores */
static void SFX(softmax_head)(const kv_call *C, float *scores, long n) {
    for (long i = 0; i < C->g; i++)
#if WIDE
        softmax_row512(scores + i * C->maxlen, n);
#else
        softmax_row(scores + i * C->maxlen, n);
#endif
}

/* query row bt as one task: every head's scores block by block (a block's key rows read once, a pair of rows
 * at a time for all heads), each head's softmax, then the values segment by segment, each block's rows head
 * after head; the first segment sums into the total directly, a later one from zero and is then added */
static void SFX(attend)(const kv_call *C, kv_scratch *S, long bt) {
    const long nh = C->nh, hd = C->hd, g = C->g, nkv = C->nkv;
    float *o = C->out + bt * nh * hd;
    if (!row_valid(C, bt)) { memset(o, 0, sizeof(float) * nh * hd); return; }
    const kv_task tk = task_of(C, bt);
    if (C->K.mode == KV_CHANNEL)
        for (long kh = 0; kh < nkv; kh++) query_perm(C, S + kh, bt, kh);
    for (long jb = tk.jbeg; jb < tk.jend; jb++) SFX(scores)(C, S, &tk, 0, nkv, jb);
    for (long kh = 0; kh < nkv; kh++) SFX(softmax_head)(C, S[kh].scores, tk.end - tk.start);
    const long s0 = seg_first(&tk), s1 = seg_end(&tk);
    for (long s = s0; s < s1; s++) {
        for (long kh = 0; kh < nkv; kh++) acc_zero(C, s == s0 ? &S[kh].tot : &S[kh].seg);
        for (long jb = seg_lo(&tk, s); jb < seg_hi(&tk, s); jb++)
            for (long kh = 0; kh < nkv; kh++) SFX(values)(C, S + kh, s == s0 ? &S[kh].tot : &S[kh].seg, &tk, kh, jb);
        if (s > s0)
            for (long kh = 0; kh < nkv; kh++) acc_add(C, &S[kh].tot, &S[kh].seg);
    }
    for (long kh = 0; kh < nkv; kh++) acc_out(C, &S[kh].tot, o + kh * g * hd);
}

/* A row shared between threads, phase 1: every head's scores against blocks [ja, jz), into the row's scores
 * shared by the call (scores[kh], each (g, maxlen)); *qp_row: the row whose permuted query S holds */
static void SFX(part_scores)(const kv_call *C, kv_scratch *S, long bt, long ja, long jz, float *const *scores,
                             long *qp_row) {
    const kv_task tk = task_of(C, bt);
    for (long kh = 0; kh < C->nkv; kh++) {
        S[kh].scores = scores[kh];
        if (C->K.mode == KV_CHANNEL && *qp_row != bt) query_perm(C, S + kh, bt, kh);
    }
    *qp_row = bt;  /* the row whose query S[].qp holds: a thread's next part of it needs no new one */
    for (long jb = ja; jb < jz; jb++) SFX(scores)(C, S, &tk, 0, C->nkv, jb);
}

/* phase 3: segment s's value sums of heads [kh0, kh1) from zero, into A[kh] */
static void SFX(seg_values)(const kv_call *C, kv_scratch *S, long bt, long s, long kh0, long kh1,
                            float *const *scores, const kv_acc *A) {
    const kv_task tk = task_of(C, bt);
    for (long kh = kh0; kh < kh1; kh++) {
        S[kh].scores = scores[kh];
        acc_zero(C, A + kh);
    }
    for (long jb = seg_lo(&tk, s); jb < seg_hi(&tk, s); jb++)
        for (long kh = kh0; kh < kh1; kh++) SFX(values)(C, S + kh, A + kh, &tk, kh, jb);
}
