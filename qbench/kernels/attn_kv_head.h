/* A task of qb_attention_kv: one query row against the keys and values of its span, for a range of KV heads
 * (each with its own scratch, S[h]): the scores of a head's g query heads against every key, their softmax,
 * and the weighted sum of the values. attn_kv.c includes this file twice: with WIDE 0 (AVX2 helpers) and
 * WIDE 1 (AVX-512 helpers, under a target pragma), SFX naming each copy. The wide helpers sum every lane in
 * the AVX2 helpers' order, so both give the same bits; which heads share a task changes no sum's order. */

/* the scores of heads [kh0, kh1) against block jb's keys */
static void SFX(scores)(const kv_call *C, kv_scratch *S, const kv_task *tk, long kh0, long kh1, long jb) {
    const kv_src *K = &C->K;
    const long nkv = C->nkv, hd = C->hd, bs = C->bs, g = C->g, maxlen = C->maxlen, W = C->W, krb = C->krb;
    const int kper = C->kper, kbits = K->bits;
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
                for (long k = 0; k < nr; k++)
                    for (long i0 = 0; i0 < g; i0 += 8) {
                        long ng = g - i0 < 8 ? g - i0 : 8;
                        SWITCH_HEADS(ng, score_row, mode, rh + k * rstride, qh + i0 * hd, hd, hd,
                                     raw + (i0 * bs + k) * 8, bs * 8)
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
                SWITCH_HEADS4(ng, score_codes2, row, row + rs, qs + i0 * MAXHD, hd, kper, kbits, out + i0 * bs * 8,
                              out + i0 * bs * 8 + 8, bs * 8)
            }
#endif
        }
    for (; r < nrow; r++)
        for (long h = 0; h < nh; h++) {
            const uint8_t *row = sp.codes + (off0 + r) * rs + h * hstep;
            for (long i0 = 0; i0 < g; i0 += 8) {
                long ng = g - i0 < 8 ? g - i0 : 8;
                SWITCH_HEADS(ng, score_codes, row, S[h].qs + i0 * MAXHD, hd, kper, kbits, S[h].raw + (i0 * bs + r) * 8, bs * 8)
            }
        }
    for (r = 0; r < nrow; r++) rowf[r] = C->scale;
    for (long h = 0; h < nh; h++) close_scores(S[h].raw, g, bs, nrow, S[h].c0, rowf, S[h].scores + j0 - start, maxlen);
}

/* head kh's weighted sum of block jb's values, added to its running sums */
static void SFX(values)(const kv_call *C, kv_scratch *S, const kv_task *tk, long kh, long jb) {
    const kv_src *V = &C->V;
    const long nkv = C->nkv, hd = C->hd, bs = C->bs, g = C->g, maxlen = C->maxlen, W = C->W;
    const long vrb = C->vrb, nvg = C->nvg, vC = C->vC;
    const int vper = C->vper, vbits = V->bits;
    const long start = tk->start, end = tk->end, nq = tk->nq, slot = tk->slot;
    const int64_t *tab = tk->tab;
    float *scores = S->scores, *wbuf = S->wbuf;  /* wbuf (g, bs): a block's value weights */
    float *accn = S->accn, *accp = S->accp, *bias = S->bias;
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
        for (long r = 0; r < nrow; r++) {
            const void *row = rows + r * rstride;
            for (long d = 0; d < hd; d += 8) {
                __m256 v = load8(mode, row, d);
                for (long i = 0; i < g; i++) {
                    float *acc = accn + i * MAXHD + d;
                    _mm256_store_ps(acc, _mm256_fmadd_ps(_mm256_set1_ps(wbuf[i * bs + r]), v, _mm256_load_ps(acc)));
                }
            }
        }
#endif
        return;
    }
    /* a KIVI block: per group of channels, each row's weight p * s per head, then the group's chunks
     * accumulate over the block's rows in registers */
    const long st0 = ((blk * bs + off0) * nkv + kh) * nvg, sstride = nkv * nvg, rs = nkv * vrb;
    const uint8_t *rows = sp.codes + off0 * rs;
    float *sg = S->rowf, *mg = S->rowf + bs;
    for (long gi = 0; gi < nvg; gi++) {
        for (long r = 0; r < nrow; r++) {
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
        for (; c < c1; c++)
            for (long i0 = 0; i0 < g; i0 += 8 / vper) {
                const long hg = 8 / vper, ng = g - i0 < hg ? g - i0 : hg;  /* heads per register pass */
                const uint8_t *cc = rows + c * 8;
                const float *w = wbuf + i0 * bs;
                float *acc = accp + i0 * MAXHD + c * vC;
                if (vper == 4) { if (ng == 2) vchunk(2, 4, cc, rs, nrow, w, bs, acc, vbits);
                                 else vchunk(1, 4, cc, rs, nrow, w, bs, acc, vbits); }
                else if (vper == 2) { SWITCH_HEADS4(ng, VCHUNK, 2, cc, rs, nrow, w, bs, acc, vbits) }
                else { SWITCH_HEADS(ng, VCHUNK, 1, cc, rs, nrow, w, bs, acc, vbits) }
            }
    }
}

/* the task's heads [kh0, kh1) of query row bt: every head's scores block by block (a block's key rows read
 * once, a pair of rows at a time for all heads), each head's softmax, then the values block by block, each
 * head's slice of a block's rows in turn */
static void SFX(attend)(const kv_call *C, kv_scratch *S, long bt, long kh0, long kh1) {
    const long nh = C->nh, hd = C->hd, bs = C->bs, g = C->g, W = C->W, nvg = C->nvg;
    float *o = C->out + bt * nh * hd;
    if (C->qvalid && !C->qvalid[bt]) { memset(o + kh0 * g * hd, 0, sizeof(float) * (kh1 - kh0) * g * hd); return; }
    kv_task tk = {.bt = bt, .b = bt / C->T};
    tk.end = C->qpos[bt] + 1;
    tk.start = (C->window > 0 && tk.end > C->window) ? tk.end - C->window : 0;
    tk.nq = W > 0 ? (C->ctx[tk.b] / bs - (W - 1) > 0 ? C->ctx[tk.b] / bs - (W - 1) : 0) : C->nblk;
    tk.tab = C->tables + tk.b * C->nblk;
    tk.slot = C->slots ? C->slots[tk.b] : 0;
    const long n = tk.end - tk.start, jbeg = tk.start / bs, jend = (tk.end + bs - 1) / bs;
    for (long kh = kh0; kh < kh1; kh++) {
        kv_scratch *Sh = S + (kh - kh0);
        if (C->K.mode == KV_CHANNEL) {  /* the query in K's perm order, once: each KIVI block scales it */
            const float *qh = C->q + (bt * nh + kh * g) * hd;
            for (long i = 0; i < g; i++)
                for (long d = 0; d < hd; d++) Sh->qp[i * MAXHD + d] = qh[i * hd + C->kinv[d]];
        }
        memset(Sh->accn, 0, sizeof(float) * g * MAXHD);
        memset(Sh->accp, 0, sizeof(float) * g * MAXHD);
        memset(Sh->bias, 0, sizeof(float) * g * (nvg + 1));
    }
    for (long jb = jbeg; jb < jend; jb++) SFX(scores)(C, S, &tk, kh0, kh1, jb);
    for (long kh = kh0; kh < kh1; kh++)
        for (long i = 0; i < g; i++)
#if WIDE
            softmax_row512(S[kh - kh0].scores + i * C->maxlen, n);
#else
            softmax_row(S[kh - kh0].scores + i * C->maxlen, n);
#endif
    for (long jb = jbeg; jb < jend; jb++)
        for (long kh = kh0; kh < kh1; kh++) SFX(values)(C, S + (kh - kh0), &tk, kh, jb);
    for (long kh = kh0; kh < kh1; kh++) {
        const float *accn = S[kh - kh0].accn, *accp = S[kh - kh0].accp, *bias = S[kh - kh0].bias;
        float *oh = o + kh * g * hd;
        for (long i = 0; i < g; i++) {
            if (C->V.mode == KV_TOKEN)
                for (long d = 0; d < hd; d++)
                    oh[i * hd + d] = accn[i * MAXHD + d] + accp[i * MAXHD + C->vperm[d]] +
                                     bias[i * (nvg + 1) + C->vgroup_of[d / C->vC]];
            else
                memcpy(oh + i * hd, accn + i * MAXHD, sizeof(float) * hd);
        }
    }
}
