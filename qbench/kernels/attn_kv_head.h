/* One (query row, KV head) of qb_attention_kv: the scores of the head's g query heads against every key of
 * its span, their softmax, and the weighted sum of the values. attn_kv.c includes this file twice: with
 * WIDE 0 (AVX2 helpers) and WIDE 1 (AVX-512 helpers, under a target pragma). The wide helpers sum every lane
 * in the AVX2 helpers' order, so both give the same bits. */
static void ATTEND(const kv_call *C, kv_scratch *S, long bt, long kh) {
    const kv_src *K = &C->K, *V = &C->V;
    const long nh = C->nh, nkv = C->nkv, hd = C->hd, bs = C->bs, g = C->g, maxlen = C->maxlen, W = C->W;
    const long krb = C->krb, vrb = C->vrb, nvg = C->nvg, vC = C->vC;
    const int kper = C->kper, vper = C->vper, kbits = K->bits, vbits = V->bits;
    const long b = bt / C->T;
    float *o = C->out + (bt * nh + kh * g) * hd;
    if (C->qvalid && !C->qvalid[bt]) { memset(o, 0, sizeof(float) * g * hd); return; }
    const long end = C->qpos[bt] + 1, start = (C->window > 0 && end > C->window) ? end - C->window : 0;
    const long n = end - start;
    const long nq = W > 0 ? (C->ctx[b] / bs - (W - 1) > 0 ? C->ctx[b] / bs - (W - 1) : 0) : C->nblk;
    const float *qh = C->q + (bt * nh + kh * g) * hd;
    const int64_t *tab = C->tables + b * C->nblk;
    const long slot = C->slots ? C->slots[b] : 0;
    float *scores = S->scores, *wbuf = S->wbuf;  /* wbuf (g, bs): a block's value weights */
    if (K->mode == KV_CHANNEL)  /* the query in K's perm order, once: each KIVI block scales it */
        for (long i = 0; i < g; i++)
            for (long d = 0; d < hd; d++) S->qp[i * MAXHD + d] = qh[i * hd + C->kinv[d]];
    for (long jb = start / bs; jb * bs < end; jb++) {  /* scores: (g, n), block by block */
        const kv_span sp = span_at(jb, start, end, bs, tab, nq, C->rk, slot, W, nkv, kh, hd, K->codes, krb);
        const long j0 = sp.j0, j1 = sp.j1, blk = sp.blk;
        const int in_ring = sp.ring != NULL;
        const long nrow = j1 - j0, off0 = j0 - jb * bs;
        float *raw = S->raw, *rowf = S->rowf;  /* partial scores (g, bs, 8); each row's multiplier */
        if (in_ring || K->mode != KV_CHANNEL) {
            const int mode = in_ring ? KV_F32 : K->mode;
            for (long r = 0; r < nrow; r++) {
                rowf[r] = C->scale;
                if (!in_ring && K->mode == KV_FP8) rowf[r] *= half_to_float(K->scale[blk * bs + off0 + r]);
            }
#if WIDE
            const char *rows = (const char *)span_row(&sp, off0, nkv, hd, krb);
            const long rstride = span_stride(&sp, nkv, hd, krb);
            for (long i0 = 0; i0 < g; i0 += 8) {
                long ng = g - i0 < 8 ? g - i0 : 8;
                SWITCH_HEADS(ng, SCORE_ROWS512, mode, rows, rstride, nrow, qh + i0 * hd, hd, raw + i0 * bs * 8, bs * 8)
            }
#else
            for (long r = 0; r < nrow; r++) {
                const void *row = span_row(&sp, off0 + r, nkv, hd, krb);
                for (long i0 = 0; i0 < g; i0 += 8) {
                    long ng = g - i0 < 8 ? g - i0 : 8;
                    SWITCH_HEADS(ng, score_row, mode, row, qh + i0 * hd, hd, hd, raw + (i0 * bs + r) * 8, bs * 8)
                }
            }
#endif
            close_scores(raw, g, bs, nrow, NULL, rowf, scores + j0 - start, maxlen);
            continue;
        }
        kivi_block_query(C, S, qh, K->scale + (blk * nkv + kh) * hd, K->mn + (blk * nkv + kh) * hd);
        const float *qs = S->qs;
        const long rs = nkv * krb;  /* bytes from one key row to the next */
        long r = 0;
        for (; r + 2 <= nrow; r += 2) {
            const uint8_t *row = sp.codes + (off0 + r) * rs;
            float *out = raw + r * 8;
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
        for (; r < nrow; r++) {
            const uint8_t *row = sp.codes + (off0 + r) * rs;
            for (long i0 = 0; i0 < g; i0 += 8) {
                long ng = g - i0 < 8 ? g - i0 : 8;
                SWITCH_HEADS(ng, score_codes, row, qs + i0 * MAXHD, hd, kper, kbits, raw + (i0 * bs + r) * 8, bs * 8)
            }
        }
        for (r = 0; r < nrow; r++) rowf[r] = C->scale;
        close_scores(raw, g, bs, nrow, S->c0, rowf, scores + j0 - start, maxlen);
    }
    for (long i = 0; i < g; i++)
#if WIDE
        softmax_row512(scores + i * maxlen, n);
#else
        softmax_row(scores + i * maxlen, n);
#endif
    float *accn = S->accn, *accp = S->accp, *bias = S->bias;
    memset(accn, 0, sizeof(float) * g * MAXHD);
    memset(accp, 0, sizeof(float) * g * MAXHD);
    memset(bias, 0, sizeof(float) * g * (nvg + 1));
    for (long jb = start / bs; jb * bs < end; jb++) {  /* values, block by block */
        const kv_span sp = span_at(jb, start, end, bs, tab, nq, C->rv, slot, W, nkv, kh, hd, V->codes, vrb);
        const long j0 = sp.j0, j1 = sp.j1, blk = sp.blk;
        const int in_ring = sp.ring != NULL;
        const long nrow = j1 - j0, off0 = j0 - jb * bs;
        if (in_ring || V->mode != KV_TOKEN) {
            const int mode = in_ring ? KV_F32 : V->mode;
            const char *rows = (const char *)span_row(&sp, off0, nkv, hd, vrb);
            const long rstride = in_ring ? nkv * hd * (long)sizeof(float) : nkv * vrb;
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
            continue;
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
    for (long i = 0; i < g; i++) {
        if (V->mode == KV_TOKEN)
            for (long d = 0; d < hd; d++)
                o[i * hd + d] = accn[i * MAXHD + d] + accp[i * MAXHD + C->vperm[d]] +
                                bias[i * (nvg + 1) + C->vgroup_of[d / vC]];
        else
            memcpy(o + i * hd, accn + i * MAXHD, sizeof(float) * hd);
    }
}
