/* A call of qb_attention_kv (attn_kv.c includes this file once): its query rows as tasks, the segments of
 * their value sums, and the buffers a thread holds for each KV head. */

/* A query row and the span its heads share: keys [start, end), in blocks [jbeg, jend) */
typedef struct { long bt, b, start, end, nq, slot, jbeg, jend; const int64_t *tab; } kv_task;

/* Value sums are added up a segment of VSEG blocks at a time, from zero, and the segments' sums then in order:
 * the order every call follows, whatever its rows and threads, so that with few rows the threads can share
 * one row's segments (a row alone and the same row in a batch give the same bits). A segment is fixed by
 * its blocks' positions (jb / VSEG), not by the call. */
#define VSEG 32
#define SCHUNK 8  /* blocks of one row's scores a thread takes at a time, where threads share a row */

static kv_task task_of(const kv_call *C, long bt) {
    const long bs = C->bs, W = C->W;
    kv_task tk = {.bt = bt, .b = bt / C->T};
    tk.end = C->qpos[bt] + 1;
    tk.start = (C->window > 0 && tk.end > C->window) ? tk.end - C->window : 0;
    tk.nq = W > 0 ? (C->ctx[tk.b] / bs - (W - 1) > 0 ? C->ctx[tk.b] / bs - (W - 1) : 0) : C->nblk;
    tk.tab = C->tables + tk.b * C->nblk;
    tk.slot = C->slots ? C->slots[tk.b] : 0;
    tk.jbeg = tk.start / bs;
    tk.jend = (tk.end + bs - 1) / bs;
    return tk;
}

static int row_valid(const kv_call *C, long bt) { return !C->qvalid || C->qvalid[bt]; }

/* the row of a call's task t, where row r's tasks are first[r] .. first[r + 1] - 1 (few rows: a scan) */
static long row_of(const long *first, long t) {
    long r = 0;
    while (first[r + 1] <= t) r++;
    return r;
}

/* a task's segments: s0 .. s1 - 1; segment s holds its blocks [max(jbeg, s VSEG), min(jend, (s + 1) VSEG)) */
static long seg_first(const kv_task *tk) { return tk->jbeg / VSEG; }
static long seg_end(const kv_task *tk) { return (tk->jend - 1) / VSEG + 1; }
static long seg_lo(const kv_task *tk, long s) { return s * VSEG > tk->jbeg ? s * VSEG : tk->jbeg; }
static long seg_hi(const kv_task *tk, long s) { return (s + 1) * VSEG < tk->jend ? (s + 1) * VSEG : tk->jend; }

/* the query of head kh of row bt in K's perm order, into S->qp: each KIVI block scales it */
static void query_perm(const kv_call *C, kv_scratch *S, long bt, long kh) {
    const long g = C->g, hd = C->hd;
    const float *qh = C->q + (bt * C->nh + kh * g) * hd;
    for (long i = 0; i < g; i++)
        for (long d = 0; d < hd; d++) S->qp[i * MAXHD + d] = qh[i * hd + C->kinv[d]];
}

/* n floats, 64-byte aligned (aligned_alloc wants a size that is a multiple of the alignment) */
static float *falloc64(long n) { return (float *)aligned_alloc(64, (sizeof(float) * n + 63) & ~63UL); }

/* n floats rounded up to whole 64-byte lines */
static long lines16(long n) { return (n + 15) & ~15L; }

/* floats of one kv_acc, in whole 64-byte lines */
static long acc_floats(const kv_call *C) { return lines16(2 * C->g * MAXHD + C->g * (C->nvg + 1)); }

static kv_acc acc_at(const kv_call *C, float *base) {
    return (kv_acc){.accn = base, .accp = base + C->g * MAXHD, .bias = base + 2 * C->g * MAXHD};
}

/* only the parts a call uses: hd of each head row's MAXHD, and the group minimums */
static void acc_zero(const kv_call *C, const kv_acc *A) {
    for (long i = 0; i < C->g; i++) {
        memset(A->accn + i * MAXHD, 0, sizeof(float) * C->hd);
        memset(A->accp + i * MAXHD, 0, sizeof(float) * C->hd);
    }
    memset(A->bias, 0, sizeof(float) * C->g * (C->nvg + 1));
}

/* dst += src, element by element: a later segment's sums onto the total of those before it */
static void acc_add(const kv_call *C, const kv_acc *dst, const kv_acc *src) {
    const long hd = C->hd;
    for (long i = 0; i < C->g; i++) {
        float *dn = dst->accn + i * MAXHD, *dp = dst->accp + i * MAXHD;
        const float *sn = src->accn + i * MAXHD, *sp = src->accp + i * MAXHD;
        for (long d = 0; d < hd; d++) {
            dn[d] += sn[d];
            dp[d] += sp[d];
        }
    }
    for (long i = 0; i < C->g * (C->nvg + 1); i++) dst->bias[i] += src->bias[i];
}

/* a head's g output rows from its value sums */
static void acc_out(const kv_call *C, const kv_acc *A, float *oh) {
    const long g = C->g, hd = C->hd, nvg = C->nvg;
    for (long i = 0; i < g; i++) {
        if (C->V.mode == KV_TOKEN)
            for (long d = 0; d < hd; d++)
                oh[i * hd + d] = A->accn[i * MAXHD + d] + A->accp[i * MAXHD + C->vperm[d]] +
                                 A->bias[i * (nvg + 1) + C->vgroup_of[d / C->vC]];
        else
            memcpy(oh + i * hd, A->accn + i * MAXHD, sizeof(float) * hd);
    }
}

/* a thread's buffers for every KV head, carved from one allocation (freed with scratch_free); without scores
 * where the call shares them */
static kv_scratch *scratch_new(const kv_call *C, int own_scores) {
    const long g = C->g, bs = C->bs, nkv = C->nkv;
    const long ns = own_scores ? lines16(g * C->maxlen + 16) : 0;
    const long per = ns + 2 * lines16(g * MAXHD) + 2 * acc_floats(C) + lines16(g) + 3 * MAXHD + lines16(g * bs * 8) +
                     lines16(2 * bs) + lines16(g * bs);
    kv_scratch *S = (kv_scratch *)malloc(sizeof(kv_scratch) * nkv);
    float *p = falloc64(nkv * per);
    for (long h = 0; h < nkv; h++) {
        float *q = p + h * per;
#define TAKE(n) (q += (n), q - (n))
        S[h].scores = own_scores ? TAKE(ns) : NULL;
        S[h].qp = TAKE(lines16(g * MAXHD));
        S[h].qs = TAKE(lines16(g * MAXHD));
        S[h].seg = acc_at(C, TAKE(acc_floats(C)));
        S[h].tot = acc_at(C, TAKE(acc_floats(C)));
        S[h].c0 = TAKE(lines16(g));
        S[h].sblk = TAKE(2 * MAXHD);
        S[h].sperm = TAKE(MAXHD);
        S[h].raw = TAKE(lines16(g * bs * 8));
        S[h].rowf = TAKE(lines16(2 * bs));
        S[h].wbuf = TAKE(lines16(g * bs));
#undef TAKE
    }
    S[0].block = p;
    return S;
}

static void scratch_free(kv_scratch *S) {
    free(S[0].block);
    free(S);
}
