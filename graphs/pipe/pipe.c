/* The pipeline's run (graphs/pipe/pipe.h): rank 0's forward (micro-batches: a header to rank 1, its
 * own layers, the logits back from the last rank), the other ranks' loop (a header in and on, their
 * layers on their own sequence states, the logits back from the last), the engine's boundary
 * callbacks (a boundary may arrive in other pieces than the receiver's engine asks for it: each
 * side's graph runs are its own) and the start-up agreement on the split. Messages go through the
 * link (sched/link.h); nothing here knows MPI. */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/pipe/pipe.h"
#include "graphs/step/stepgraph.h"
#include "sched/clock.h"
#include "sched/error.h"

enum { TAG_HDR = 1, TAG_ACT = 2, TAG_LOGITS = 3, TAG_SPLIT = 4 };
enum { OP_FWD = 1, OP_STOP = 2 };
#define PIPE_MAGIC UINT64_C(0x3130657069706d66)   /* "mfpipe01" */
#define PIPE_MAX_ITEMS 65536                       /* a forward's items (a batcher step: 64; a prompt: more) */
#define PIPE_N_TIMES 65536                         /* transfer times kept for the percentiles */

/* A micro-batch's header, then n items. */
typedef struct mf_pipe_hdr {
    uint64_t magic;
    uint32_t op, n;
    uint64_t step;
    int32_t mb, pad;
} mf_pipe_hdr;

typedef struct mf_pipe_item {
    int32_t slot, token;
    int64_t pos, max_pos;
    int32_t want, pad;
} mf_pipe_item;

/* What precedes a boundary's or the logits' floats. */
typedef struct mf_pipe_pre {
    uint64_t step;
    int32_t mb, pad;
    int64_t send_ns;
} mf_pipe_pre;

/* Rank 0's split and the config's shape (mf_pipe_agree). */
typedef struct mf_pipe_hello {
    uint64_t magic;
    int32_t n_layers, hidden, hc, vocab;
    mf_pipe_split split;
} mf_pipe_hello;

typedef struct mf_pipe_times {
    int64_t *v;
    int64_t n;   /* all ever; the last PIPE_N_TIMES kept */
    double bytes;
} mf_pipe_times;

struct mf_pipe {
    mf_pipe_opts o;
    const mf_link_ops *l;
    const mf_config *c;
    int rank, size, last;
    mf_ref *r;
    mf_step *eng;
    int64_t per, V;               /* boundary floats per item; vocabulary */
    uint64_t step;                /* rank 0: forwards; others: the header being run */
    int mb;                       /* the micro-batch being run */
    /* the boundary of the micro-batch being run: floats expected, received, consumed; the
     * message being consumed (its prefix and floats) */
    int64_t rx_total, rx_recv, rx_done;
    uint8_t *rx;
    size_t rx_cap, rx_have, rx_used;   /* bytes: held, of which used (the prefix counted used) */
    uint8_t *tx, *hdr, *lg;            /* a boundary out; a header; logits (prefix + rows) */
    size_t tx_cap, lg_cap;
    /* rank 0: state -> slot; the others: slot -> their state */
    mf_ref_state *slot[MF_PIPE_MAX_SLOTS];
    int n_slots;
    /* a micro-batch's items (the others') */
    mf_ref_state **it_st;
    int32_t *it_tok;
    float **it_lg;
    mf_pipe_times tb, tl;   /* boundaries and logits received: transfer times */
};

static int64_t mf_pipe_step_timeout(const mf_pipe *p) { return p->o.step_timeout_ns > 0 ? p->o.step_timeout_ns : 600000000000LL; }

static void mf_pipe_time(mf_pipe_times *t, int64_t ns, double bytes)
{
    t->v[t->n++ % PIPE_N_TIMES] = ns;
    t->bytes += bytes;
}

/* Grows *buf to at least n bytes (never shrinks: no allocation once the largest was seen). */
static int mf_pipe_grow(uint8_t **buf, size_t *cap, size_t n)
{
    if (n <= *cap) return 0;
    uint8_t *b = realloc(*buf, n);
    if (!b) return mf_error(-ENOMEM, "pipeline: no memory for a message of %zu bytes", n);
    *buf = b;
    *cap = n;
    return 0;
}

int mf_pipe_new(const mf_config *c, const mf_pipe_opts *o, mf_pipe **out)
{
    *out = NULL;
    const mf_link_ops *l = o->link;
    const mf_pipe_split *s = &o->split;
    if (!l || l->size < 2 || s->n_ranks != l->size || s->bound[0] != 0 || s->bound[s->n_ranks] != c->n_layers)
        return mf_error(-EINVAL, "pipeline: a split of %d ranks over layers 0..%d for a link of %d ranks", s->n_ranks,
                        s->bound[s->n_ranks], l ? l->size : 0);
    mf_pipe *p = calloc(1, sizeof *p);
    if (!p) return mf_error(-ENOMEM, "pipeline: out of memory");
    p->o = *o;
    p->l = l;
    p->c = c;
    p->rank = l->rank;
    p->size = l->size;
    p->last = l->rank == l->size - 1;
    p->per = mf_sg_boundary_floats(c);
    p->V = c->vocab_size;
    p->hdr = malloc(sizeof(mf_pipe_hdr) + sizeof(mf_pipe_item) * PIPE_MAX_ITEMS);
    p->it_st = malloc(sizeof *p->it_st * PIPE_MAX_ITEMS);
    p->it_tok = malloc(sizeof *p->it_tok * PIPE_MAX_ITEMS);
    p->it_lg = malloc(sizeof *p->it_lg * PIPE_MAX_ITEMS);
    p->tb.v = calloc(PIPE_N_TIMES, sizeof(int64_t));
    p->tl.v = calloc(PIPE_N_TIMES, sizeof(int64_t));
    if (!p->hdr || !p->it_st || !p->it_tok || !p->it_lg || !p->tb.v || !p->tl.v) {
        mf_pipe_free(p);
        return mf_error(-ENOMEM, "pipeline: out of memory");
    }
    *out = p;
    return 0;
}

/* A follower's sequence states freed (their forward must still be alive). */
static void mf_pipe_drop_states(mf_pipe *p)
{
    for (int k = 0; p->rank > 0 && k < p->n_slots; k++) mf_ref_state_free(p->slot[k]);
    p->n_slots = 0;
}

void mf_pipe_free(mf_pipe *p)
{
    if (!p) return;
    free(p->rx);
    free(p->tx);
    free(p->hdr);
    free(p->lg);
    free(p->it_st);
    free(p->it_tok);
    free(p->it_lg);
    free(p->tb.v);
    free(p->tl.v);
    free(p);
}

void mf_pipe_attach(mf_pipe *p, mf_ref *r, mf_step *eng)
{
    p->r = r;
    p->eng = eng;
}

void mf_pipe_fail(mf_pipe *p, const char *msg) { p->l->fail(p->l->ctx, msg); }

/* Fails the pipeline with the current error (told to every rank) and returns rc. */
static int mf_pipe_failed(mf_pipe *p, int rc)
{
    char m[MF_ERROR_MSG_BYTES + 32];
    snprintf(m, sizeof m, "rank %d: %s", p->rank, mf_last_error());
    p->l->fail(p->l->ctx, m);
    return rc;
}

/* ---- the engine's boundary callbacks (on its boundary lane) -------------------------------- */

/* The next k floats of the micro-batch's boundary into buf, message after message from the rank
 * before (its graph runs may cut the items otherwise than ours). */
static int mf_pipe_recv_cb(void *user, float *buf, int64_t k)
{
    mf_pipe *p = user;
    while (k > 0) {
        if (p->rx_used == p->rx_have) {   /* the next message */
            int64_t left = p->rx_total - p->rx_recv;
            if (left <= 0)
                return mf_error(-EPROTO, "pipeline: rank %d: the engine asks more of step %" PRIu64 "'s boundary than "
                                "its %" PRId64 " floats", p->rank, p->step, p->rx_total);
            size_t cap = sizeof(mf_pipe_pre) + (size_t)left * sizeof(float), got = 0;
            int rc = mf_pipe_grow(&p->rx, &p->rx_cap, cap);
            char what[96];
            snprintf(what, sizeof what, "the activations of step %" PRIu64 " micro-batch %d", p->step, p->mb);
            if (!rc) rc = p->l->recv(p->l->ctx, p->rank - 1, TAG_ACT, p->rx, cap, &got, mf_pipe_step_timeout(p), what);
            if (rc) return rc;
            mf_pipe_pre pre;
            memcpy(&pre, p->rx, sizeof pre);
            if (got < sizeof pre || (got - sizeof pre) % sizeof(float) || pre.step != p->step || pre.mb != p->mb)
                return mf_error(-EPROTO, "pipeline: rank %d: got %zu bytes of step %" PRIu64 " micro-batch %d from rank "
                                "%d, expected step %" PRIu64 " micro-batch %d", p->rank, got, pre.step, pre.mb,
                                p->rank - 1, p->step, p->mb);
            mf_pipe_time(&p->tb, mf_now_ns() - pre.send_ns, (double)got);
            p->rx_have = got;
            p->rx_used = sizeof pre;
            p->rx_recv += (int64_t)((got - sizeof pre) / sizeof(float));
        }
        size_t avail = (p->rx_have - p->rx_used) / sizeof(float), m = avail < (size_t)k ? avail : (size_t)k;
        memcpy(buf, p->rx + p->rx_used, m * sizeof(float));
        p->rx_used += m * sizeof(float);
        p->rx_done += (int64_t)m;
        buf += m;
        k -= (int64_t)m;
    }
    return 0;
}

/* k floats of the micro-batch's boundary to the rank after, as one message. */
static int mf_pipe_send_cb(void *user, const float *buf, int64_t k)
{
    mf_pipe *p = user;
    size_t n = sizeof(mf_pipe_pre) + (size_t)k * sizeof(float);
    int rc = mf_pipe_grow(&p->tx, &p->tx_cap, n);
    if (rc) return rc;
    mf_pipe_pre pre = {.step = p->step, .mb = p->mb, .send_ns = mf_now_ns()};
    memcpy(p->tx, &pre, sizeof pre);
    memcpy(p->tx + sizeof pre, buf, (size_t)k * sizeof(float));
    return p->l->send(p->l->ctx, p->rank + 1, TAG_ACT, p->tx, n);
}

mf_step_link mf_pipe_step_link(mf_pipe *p)
{
    return (mf_step_link){.user = p, .recv = p->rank > 0 ? mf_pipe_recv_cb : NULL,
                          .send = p->last ? NULL : mf_pipe_send_cb};
}

/* ---- rank 0 ----------------------------------------------------------------------------------- */

/* The slot of state st (assigned at first sight). -ENOSPC past MF_PIPE_MAX_SLOTS states. */
static int mf_pipe_slot_of(mf_pipe *p, const mf_ref_state *st)
{
    for (int k = 0; k < p->n_slots; k++)
        if (p->slot[k] == st) return k;
    if (p->n_slots == MF_PIPE_MAX_SLOTS)
        return mf_error(-ENOSPC, "pipeline: more than %d sequence states", MF_PIPE_MAX_SLOTS);
    p->slot[p->n_slots] = (mf_ref_state *)st;
    return p->n_slots++;
}

/* Items [0, n) cut into at most m micro-batches at sequence boundaries, the most equal in items:
 * end[j] is micro-batch j's end; returns how many. */
static int mf_pipe_cut_micro(mf_ref_state *const *states, int n, int m, int *end)
{
    int n_mb = 0, start = 0;
    for (int i = 1; i <= n; i++) {
        if (i < n && states[i] == states[i - 1]) continue;   /* inside a sequence's run */
        int left = m - n_mb;   /* close the micro-batch once it holds its share of what is left */
        if (i == n || (left > 1 && (int64_t)(i - start) * left >= (int64_t)(n - start))) {
            end[n_mb++] = i;
            start = i;
        }
    }
    return n_mb;
}

/* Micro-batch [i0, i1)'s header to rank 1. */
static int mf_pipe_send_hdr(mf_pipe *p, mf_ref_state *const *states, const int32_t *tokens, int i0, int i1,
                            float *const *logits)
{
    mf_pipe_hdr h = {.magic = PIPE_MAGIC, .op = OP_FWD, .n = (uint32_t)(i1 - i0), .step = p->step, .mb = p->mb};
    memcpy(p->hdr, &h, sizeof h);
    mf_pipe_item *it = (mf_pipe_item *)(p->hdr + sizeof h);
    for (int i = i0; i < i1; i++) {
        int s = mf_pipe_slot_of(p, states[i]);
        if (s < 0) return s;
        int64_t pos = i > i0 && states[i - 1] == states[i] ? it[i - i0 - 1].pos + 1 : states[i]->n_pos;
        it[i - i0] = (mf_pipe_item){.slot = s, .token = tokens[i], .pos = pos, .max_pos = states[i]->max_pos,
                                    .want = logits && logits[i]};
    }
    return p->l->send(p->l->ctx, 1, TAG_HDR, p->hdr, sizeof h + sizeof *it * (size_t)(i1 - i0));
}

/* Micro-batch j's logits from the last rank into the rows of its items that want them. */
static int mf_pipe_take_logits(mf_pipe *p, int j, int i0, int i1, float *const *logits)
{
    int want = 0;
    for (int i = i0; logits && i < i1; i++) want += logits[i] != NULL;
    size_t cap = sizeof(mf_pipe_pre) + (size_t)want * (size_t)p->V * sizeof(float), got = 0;
    int rc = mf_pipe_grow(&p->lg, &p->lg_cap, cap);
    char what[96];
    snprintf(what, sizeof what, "the logits of step %" PRIu64 " micro-batch %d", p->step, j);
    if (!rc) rc = p->l->recv(p->l->ctx, p->size - 1, TAG_LOGITS, p->lg, cap, &got, mf_pipe_step_timeout(p), what);
    if (rc) return rc;
    mf_pipe_pre pre;
    memcpy(&pre, p->lg, sizeof pre);
    if (got != cap || pre.step != p->step || pre.mb != j)
        return mf_error(-EPROTO, "pipeline: rank 0: got %zu bytes of logits of step %" PRIu64 " micro-batch %d from "
                        "rank %d, expected %zu of step %" PRIu64 " micro-batch %d", got, pre.step, pre.mb, p->size - 1,
                        cap, p->step, j);
    mf_pipe_time(&p->tl, mf_now_ns() - pre.send_ns, (double)got);
    const float *row = (const float *)(p->lg + sizeof pre);
    for (int i = i0; logits && i < i1; i++)
        if (logits[i]) {
            memcpy(logits[i], row, sizeof(float) * (size_t)p->V);
            row += p->V;
        }
    return 0;
}

int mf_pipe_forward(void *ctx, mf_ref_state *const *states, const int32_t *tokens, int n, float *const *logits)
{
    mf_pipe *p = ctx;
    if (p->rank != 0 || !p->eng) return mf_error(-EINVAL, "pipeline: a forward runs on rank 0, attached");
    if (n < 1 || n > PIPE_MAX_ITEMS)
        return mf_error(-EINVAL, "pipeline: a forward of %d items (1..%d)", n, PIPE_MAX_ITEMS);
    p->step++;
    int end[MF_PIPE_MAX_RANKS * 4], m = p->o.micro > 0 ? p->o.micro : p->size;
    if (m > (int)(sizeof end / sizeof end[0])) m = (int)(sizeof end / sizeof end[0]);
    int n_mb = mf_pipe_cut_micro(states, n, m, end), rc = 0;
    for (int j = 0; j < n_mb && !rc; j++) {   /* each micro-batch: its header on, our layers, its boundary on */
        int i0 = j ? end[j - 1] : 0;
        p->mb = j;
        rc = mf_pipe_send_hdr(p, states, tokens, i0, end[j], logits);
        if (!rc) rc = mf_step_forward(p->eng, states + i0, tokens + i0, end[j] - i0, NULL);
    }
    for (int j = 0; j < n_mb && !rc; j++) rc = mf_pipe_take_logits(p, j, j ? end[j - 1] : 0, end[j], logits);
    return rc ? mf_pipe_failed(p, rc) : 0;
}

int mf_pipe_stop(mf_pipe *p)
{
    mf_pipe_hdr h = {.magic = PIPE_MAGIC, .op = OP_STOP, .step = p->step};
    return p->l->send(p->l->ctx, 1, TAG_HDR, &h, sizeof h);
}

/* ---- ranks > 0 -------------------------------------------------------------------------------- */

/* The header's items as this rank's states (created at a slot's first sight, reset where a
 * sequence starts over at position 0) and tokens; the last rank's logits rows. */
static int mf_pipe_items(mf_pipe *p, const mf_pipe_item *it, int n, int *n_want)
{
    *n_want = 0;
    for (int i = 0; i < n; i++) {
        const mf_pipe_item *x = &it[i];
        if (x->slot < 0 || x->slot >= MF_PIPE_MAX_SLOTS || x->token < 0 || x->token >= p->c->vocab_size)
            return mf_error(-EPROTO, "pipeline: rank %d: item %d of step %" PRIu64 ": slot %d, token %d", p->rank, i,
                            p->step, x->slot, x->token);
        while (p->n_slots <= x->slot) p->slot[p->n_slots++] = NULL;
        mf_ref_state **st = &p->slot[x->slot];
        int first = i == 0 || it[i - 1].slot != x->slot;
        if (*st && (*st)->max_pos != x->max_pos) {
            mf_ref_state_free(*st);
            *st = NULL;
        }
        if (!*st) {
            int rc = mf_ref_state_new(p->r, x->max_pos, st);
            if (rc) return rc;
        }
        if (first && x->pos == 0) mf_ref_state_reset(*st);
        if (first && (*st)->n_pos != x->pos)
            return mf_error(-EPROTO, "pipeline: rank %d: sequence slot %d is at position %" PRId64 " here, rank 0 runs "
                            "position %" PRId64, p->rank, x->slot, (*st)->n_pos, x->pos);
        p->it_st[i] = *st;
        p->it_tok[i] = x->token;
        p->it_lg[i] = NULL;
        *n_want += x->want != 0;
    }
    if (!p->last) return 0;
    size_t cap = sizeof(mf_pipe_pre) + (size_t)*n_want * (size_t)p->V * sizeof(float);
    int rc = mf_pipe_grow(&p->lg, &p->lg_cap, cap);
    if (rc) return rc;
    float *row = (float *)(p->lg + sizeof(mf_pipe_pre));   /* the wanted rows in item order */
    for (int i = 0; i < n; i++)
        if (it[i].want) {
            p->it_lg[i] = row;
            row += p->V;
        }
    return 0;
}

/* One header's micro-batch on this rank: the header on, the items, the engine, the logits back. */
static int mf_pipe_follow_one(mf_pipe *p, size_t got)
{
    mf_pipe_hdr h;
    memcpy(&h, p->hdr, sizeof h);
    if (h.op == OP_FWD && (h.n < 1 || h.n > PIPE_MAX_ITEMS || got != sizeof h + sizeof(mf_pipe_item) * h.n))
        return mf_error(-EPROTO, "pipeline: rank %d: a header of %zu bytes for %u items", p->rank, got, h.n);
    if (!p->last) {
        int rc = p->l->send(p->l->ctx, p->rank + 1, TAG_HDR, p->hdr, got);
        if (rc) return rc;
    }
    p->step = h.step;
    p->mb = h.mb;
    int n = (int)h.n, n_want = 0;
    int rc = mf_pipe_items(p, (const mf_pipe_item *)(p->hdr + sizeof h), n, &n_want);
    if (rc) return rc;
    p->rx_total = (int64_t)n * p->per;
    p->rx_recv = p->rx_done = 0;
    p->rx_have = p->rx_used = 0;
    rc = mf_step_forward(p->eng, p->it_st, p->it_tok, n, p->last ? p->it_lg : NULL);
    if (rc) return rc;
    if (p->rx_done != p->rx_total || p->rx_used != p->rx_have)
        return mf_error(-EPROTO, "pipeline: rank %d: step %" PRIu64 " used %" PRId64 " of its boundary's %" PRId64
                        " floats", p->rank, p->step, p->rx_done, p->rx_total);
    if (!p->last) return 0;
    mf_pipe_pre pre = {.step = p->step, .mb = p->mb, .send_ns = mf_now_ns()};
    memcpy(p->lg, &pre, sizeof pre);
    return p->l->send(p->l->ctx, 0, TAG_LOGITS, p->lg, sizeof pre + (size_t)n_want * (size_t)p->V * sizeof(float));
}

/* mf_pipe_follow's loop. */
static int mf_pipe_follow_loop(mf_pipe *p)
{
    size_t cap = sizeof(mf_pipe_hdr) + sizeof(mf_pipe_item) * PIPE_MAX_ITEMS;
    for (;;) {
        size_t got = 0;
        int rc = p->l->recv(p->l->ctx, p->rank - 1, TAG_HDR, p->hdr, cap, &got, -1, "the next step's header");
        mf_pipe_hdr h;
        if (!rc) memcpy(&h, p->hdr, got < sizeof h ? got : sizeof h);
        if (!rc && (got < sizeof h || h.magic != PIPE_MAGIC || (h.op != OP_FWD && h.op != OP_STOP)))
            rc = mf_error(-EPROTO, "pipeline: rank %d: a message of %zu bytes from rank %d is no header", p->rank, got,
                          p->rank - 1);
        if (!rc && h.op == OP_STOP) return p->last ? 0 : p->l->send(p->l->ctx, p->rank + 1, TAG_HDR, p->hdr, got);
        if (!rc) rc = mf_pipe_follow_one(p, got);
        if (rc) return mf_pipe_failed(p, rc);
    }
}

int mf_pipe_follow(mf_pipe *p)
{
    if (p->rank == 0 || !p->eng) return mf_error(-EINVAL, "pipeline: ranks after 0 follow, attached");
    int rc = mf_pipe_follow_loop(p);
    mf_pipe_drop_states(p);
    return rc;
}

/* ---- the start ---------------------------------------------------------------------------------- */

int mf_pipe_agree(const mf_link_ops *l, const mf_config *c, mf_pipe_split *s)
{
    mf_pipe_hello me = {.magic = PIPE_MAGIC, .n_layers = c->n_layers, .hidden = (int32_t)c->hidden_size,
                        .hc = c->hc_mult, .vocab = (int32_t)c->vocab_size, .split = *s};
    if (l->rank == 0) {
        for (int k = 1; k < l->size; k++) {
            int rc = l->send(l->ctx, k, TAG_SPLIT, &me, sizeof me);
            if (rc) return rc;
        }
        return 0;
    }
    mf_pipe_hello h;
    size_t got = 0;
    int rc = l->recv(l->ctx, 0, TAG_SPLIT, &h, sizeof h, &got, -1, "the split");
    if (rc) return rc;
    if (got != sizeof h || h.magic != PIPE_MAGIC || h.n_layers != me.n_layers || h.hidden != me.hidden ||
        h.hc != me.hc || h.vocab != me.vocab)
        return mf_error(-EINVAL, "pipeline: rank %d's model (%d layers, hidden %d, vocabulary %d) is not rank 0's "
                        "(%d layers, hidden %d, vocabulary %d): every rank must open the same checkpoint", l->rank,
                        me.n_layers, me.hidden, me.vocab, h.n_layers, h.hidden, h.vocab);
    *s = h.split;
    return 0;
}

/* ---- statistics --------------------------------------------------------------------------------- */

static int mf_pipe_cmp64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

static void mf_pipe_pct(const mf_pipe_times *t, int64_t *p50, int64_t *p99)
{
    int64_t n = t->n < PIPE_N_TIMES ? t->n : PIPE_N_TIMES;
    *p50 = *p99 = 0;
    int64_t *v = n ? malloc(sizeof *v * (size_t)n) : NULL;
    if (!v) return;
    memcpy(v, t->v, sizeof *v * (size_t)n);
    qsort(v, (size_t)n, sizeof *v, mf_pipe_cmp64);
    *p50 = v[(n - 1) / 2];
    *p99 = v[(n - 1) * 99 / 100];
    free(v);
}

void mf_pipe_stats_get(const mf_pipe *p, mf_pipe_stats *out)
{
    *out = (mf_pipe_stats){.n_boundary = p->tb.n, .n_logits = p->tl.n, .steps = (int64_t)p->step,
                           .boundary_bytes = p->tb.bytes, .logits_bytes = p->tl.bytes};
    mf_pipe_pct(&p->tb, &out->boundary_p50_ns, &out->boundary_p99_ns);
    mf_pipe_pct(&p->tl, &out->logits_p50_ns, &out->logits_p99_ns);
}
