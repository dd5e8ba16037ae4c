/* Speculative decoding (graphs/step/spec.h; docs/dspark.md "Speculation"): the policy (mf_spec_choose,
 * the batch's k per sequence, probes), the prices it reads (the simulator's plans of the verify and
 * the draft round: graphs/sim/plan.h), each slot's feature rows and draft context, the draft round,
 * the acceptance and the rollback. */
#include "graphs/step/spec.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/layers/layers.h"
#include "sched/clock.h"
#include "sched/cost.h"
#include "sched/error.h"

#define SP_PRIOR_ALPHA 0.7      /* the acceptance assumed before any is seen (SGLang's 2.82 tokens at 5
                                 * candidates on the released draft is about 0.65 per position) */
#define SP_PRIOR_WEIGHT 2.0     /* as that many rounds' worth of evidence */
#define SP_DECAY 0.95           /* each round's evidence decays so (about the last 20 rounds count) */
#define SP_PROBE_MIN 16         /* plain rounds before a k-0 sequence probes, doubling while probes fail */
#define SP_PROBE_MAX 1024
#define SP_PROBE_SHARE 0.01     /* the most of the plain rounds' time a k-0 sequence's probes take */
#define SP_MAX_SEQ MF_STEP_MAX_ITEMS
#define SP_HOLD 16              /* rounds the draft's experts stay on the cards after the policy's last k > 0 */

typedef struct sp_slot {
    mf_ly_draft_state *ds;      /* the draft's context (MF_SPEC_DSPARK) */
    float *frow;                /* cap rows of features, row r for position base + r */
    int64_t base;
    int k, probe;               /* this step's candidates; 1 when this round is a probe */
    int32_t cand[MF_SPEC_MAX];
    float conf[MF_SPEC_MAX];
    double acc[MF_SPEC_MAX + 1], tried[MF_SPEC_MAX + 1];   /* decayed evidence per position */
    int idle, probe_every;
} sp_slot;

struct mf_spec {
    mf_spec_opts o;
    const mf_config *c;
    int n_max, n_slots, cap, W, B;
    int64_t F;                  /* floats of one position's features */
    sp_slot *slot;
    mf_ref_draft *rd;           /* the reference's draft (no engine) */
    double g_acc[MF_SPEC_MAX + 1], g_tried[MF_SPEC_MAX + 1];   /* over every request */
    mf_plan_opts price;         /* the template */
    double *v_ns;               /* [n_seq][L]: a step of n_seq sequences of L items each (NAN: not priced yet) */
    double *d_ns;               /* [U][k]: a draft round of U sequences, k candidates */
    mf_step_draft_seq *dq;
    int dcards;                 /* 1: the engine has cards for the draft's experts (mf_step_draft_cards) */
    int hold;                   /* rounds left before they are given back */
    mf_spec_stats st;
};

int mf_spec_choose(const double *verify_ns, const double *draft_ns, const double *alpha, int n_max, double *gain)
{
    double e = 1, p = 1, best = verify_ns[0] > 0 ? 1 / verify_ns[0] : 0, base = best;
    int k_best = 0;
    for (int k = 1; k <= n_max; k++) {
        p *= alpha[k];
        e += p;
        double t = verify_ns[k] + draft_ns[k];
        if (t > 0 && e / t > best * (1 + 1e-12)) best = e / t, k_best = k;
    }
    if (gain) *gain = base > 0 ? best / base : 1;
    return k_best;
}

/* ---- prices ------------------------------------------------------------------------------------ */

/* The makespan of the plan of o, mean over a few steps after two of warm-up (0 on error: unpriced). */
static double sp_plan_ns(const mf_plan_opts *o)
{
    mf_plan_report r;
    int rc = mf_plan_run(o, 2, 4, &r);
    if (rc) {
        mf_error_clear();
        return 0;
    }
    return (double)r.step_ns;
}

/* A step of n_seq sequences, L items each (L 1: a plain decode step). */
static double sp_verify_ns(mf_spec *sp, int n_seq, int L)
{
    double *v = &sp->v_ns[(size_t)n_seq * (MF_SPEC_MAX + 2) + L];
    if (isnan(*v)) {
        mf_plan_opts o = sp->price;
        o.batch = n_seq;
        o.unit_len = L;
        o.draft = 0;
        o.feats = sp->o.source == MF_SPEC_DSPARK;
        o.draft_cards = sp->dcards && L > 1;   /* steady state: a verify's with the draft's experts held */
        *v = n_seq * L <= MF_STEP_MAX_ITEMS ? sp_plan_ns(&o) : 0;
    }
    return *v;
}

/* A step of n_seq sequences and n_items items (their extra items spread evenly): between the
 * prices of the equal units either side. */
static double sp_items_ns(mf_spec *sp, int n_seq, int n_items)
{
    int L = n_items / n_seq, extra = n_items - L * n_seq;
    double a = sp_verify_ns(sp, n_seq, L);
    return extra ? a + (sp_verify_ns(sp, n_seq, L + 1) - a) * extra / n_seq : a;
}

/* A draft round of U sequences proposing k candidates each (injected: none to price). */
static double sp_draft_ns(mf_spec *sp, int U, int k)
{
    if (sp->o.source != MF_SPEC_DSPARK || U < 1 || k < 1) return 0;
    int per = MF_STEP_DRAFT_ITEMS / sp->B;
    if (U > per) return sp_draft_ns(sp, per, k) * (U / per) + sp_draft_ns(sp, U % per, k);
    double *v = &sp->d_ns[(size_t)U * (MF_SPEC_MAX + 1) + k];
    if (isnan(*v)) {
        mf_plan_opts o = sp->price;
        o.batch = U;
        o.unit_len = 0;
        o.draft = k;
        o.draft_cards = sp->dcards;
        *v = sp_plan_ns(&o);
    }
    return *v;
}

/* ---- setup --------------------------------------------------------------------------------------- */

static int sp_check(const mf_spec_opts *o, const mf_config *c, int *n_max)
{
    int lim = o->source == MF_SPEC_DSPARK ? c->dspark_block_size : MF_SPEC_MAX;
    *n_max = o->n_max ? o->n_max : c->dspark_block_size;
    if (o->source != MF_SPEC_DSPARK && o->source != MF_SPEC_INJECT)
        return mf_error(-EINVAL, "spec: source %d (expected dspark or injected)", o->source);
    if (o->source == MF_SPEC_INJECT && !o->inject) return mf_error(-EINVAL, "spec: injected candidates without a function");
    if (*n_max < 1 || *n_max > lim || *n_max > MF_SPEC_MAX || *n_max + 1 > c->sliding_window)
        return mf_error(-EINVAL, "spec: %d candidates per round (expected 1..%d%s, below sliding_window %d)", *n_max,
                        lim < MF_SPEC_MAX ? lim : MF_SPEC_MAX, o->source == MF_SPEC_DSPARK ? ", dspark_block_size" : "",
                        c->sliding_window);
    if (o->source == MF_SPEC_DSPARK && !mf_model_has_draft(mf_ref_layers(o->ref)->m))
        return mf_error(-EINVAL, "spec: --spec dspark needs the checkpoint's draft loaded (mf_model_opts.load_draft)");
    return 0;
}

/* The policy's prices, all unpriced again (NAN: sp_verify_ns, sp_draft_ns price them on first use). */
static void sp_prices_forget(mf_spec *sp)
{
    for (int i = 0; i < (SP_MAX_SEQ + 1) * (MF_SPEC_MAX + 2); i++) sp->v_ns[i] = NAN;
    for (int i = 0; i < (SP_MAX_SEQ + 1) * (MF_SPEC_MAX + 1); i++) sp->d_ns[i] = NAN;
}

int mf_spec_new(const mf_spec_opts *o, int n_slots, mf_spec **out)
{
    *out = NULL;
    if (!o->ref) return mf_error(-EINVAL, "spec: no target forward");
    const mf_config *c = mf_ref_config(o->ref);
    int n_max, rc = sp_check(o, c, &n_max);
    if (rc) return rc;
    mf_spec *sp = calloc(1, sizeof *sp);
    if (!sp) return mf_error(-ENOMEM, "spec: out of memory");
    sp->o = *o;
    sp->c = c;
    sp->n_max = sp->st.n_max = n_max;
    sp->n_slots = n_slots;
    sp->W = c->sliding_window;
    sp->B = c->dspark_block_size;
    sp->F = (int64_t)c->n_dspark_target * c->hidden_size;
    sp->cap = sp->W + MF_SPEC_MAX + 1;
    int dspark = o->source == MF_SPEC_DSPARK;
    sp->price = o->price ? *o->price : (mf_plan_opts){.placement = MF_STEP_PLACE_HOST, .context = 1024};
    sp->price.config = c;
    if (!sp->price.profile) sp->price.profile = mf_cost_default_profile();
    sp->price.routing = NULL;   /* the policy's own draws: the caller's routing is its simulation's */
    sp->slot = calloc((size_t)n_slots, sizeof *sp->slot);
    sp->v_ns = malloc(sizeof *sp->v_ns * (SP_MAX_SEQ + 1) * (MF_SPEC_MAX + 2));
    sp->d_ns = malloc(sizeof *sp->d_ns * (SP_MAX_SEQ + 1) * (MF_SPEC_MAX + 1));
    sp->dq = malloc(sizeof *sp->dq * (size_t)(n_slots > 0 ? n_slots : 1));
    rc = sp->slot && sp->v_ns && sp->d_ns && sp->dq ? 0 : mf_error(-ENOMEM, "spec: out of memory");
    if (!rc) sp_prices_forget(sp);
    if (!rc && dspark && !o->eng) rc = mf_ref_draft_new(o->ref, &sp->rd);
    for (int i = 0; !rc && i < n_slots; i++) {
        sp_slot *s = &sp->slot[i];
        if (dspark && !(s->frow = malloc(sizeof(float) * (size_t)(sp->cap * sp->F))))
            rc = mf_error(-ENOMEM, "spec: out of memory for slot %d's feature rows", i);
        if (!rc && dspark) {
            s->ds = calloc(1, sizeof *s->ds);
            s->ds->ring = s->ds ? calloc(1, (size_t)mf_ly_draft_ring_bytes(c)) : NULL;
            if (!s->ds->ring) rc = mf_error(-ENOMEM, "spec: out of memory for slot %d's draft context", i);
        }
    }
    for (int j = 1; j <= MF_SPEC_MAX; j++) sp->g_acc[j] = SP_PRIOR_ALPHA * SP_PRIOR_WEIGHT, sp->g_tried[j] = SP_PRIOR_WEIGHT;
    if (rc) {
        mf_spec_free(sp);
        return rc;
    }
    for (int i = 0; i < n_slots; i++) mf_spec_admit(sp, i);
    if (dspark && o->eng) {
        mf_step_dev_stats ds;
        mf_step_last_dev(o->eng, &ds);
        sp->dcards = ds.n_cards > 0;
    }
    *out = sp;
    return 0;
}

void mf_spec_free(mf_spec *sp)
{
    if (!sp) return;
    if (sp->st.dcards_held) mf_step_draft_cards(sp->o.eng, 0);   /* the backbone's slots back */
    for (int i = 0; sp->slot && i < sp->n_slots; i++) {
        free(sp->slot[i].frow);
        if (sp->slot[i].ds) free(sp->slot[i].ds->ring);
        free(sp->slot[i].ds);
    }
    mf_ref_draft_free(sp->rd);
    free(sp->slot);
    free(sp->v_ns);
    free(sp->d_ns);
    free(sp->dq);
    free(sp);
}

void mf_spec_admit(mf_spec *sp, int slot)
{
    sp_slot *s = &sp->slot[slot];
    if (s->ds) s->ds->n_pos = 0;
    s->base = 0;
    s->k = s->probe = s->idle = 0;
    s->probe_every = SP_PROBE_MIN;
    for (int j = 1; j <= MF_SPEC_MAX; j++) {   /* what all requests have seen, as a prior of its weight */
        s->acc[j] = sp->g_acc[j] / sp->g_tried[j] * SP_PRIOR_WEIGHT;
        s->tried[j] = SP_PRIOR_WEIGHT;
    }
}

/* ---- the policy ---------------------------------------------------------------------------------- */

/* Slot s's expected tokens from k candidates beyond the bonus: sum over i <= k of prod alpha. */
static double sp_expect(const sp_slot *s, int k)
{
    double e = 0, p = 1;
    for (int i = 1; i <= k; i++) e += p *= s->acc[i] / s->tried[i];
    return e;
}

/* Batch 1: mf_spec_choose on the prices of 1 + k items and a draft round of k. */
static int sp_pick_one(mf_spec *sp, const sp_slot *s, int room)
{
    double v[MF_SPEC_MAX + 1], d[MF_SPEC_MAX + 1], a[MF_SPEC_MAX + 1];
    int n = room < sp->n_max ? room : sp->n_max;
    for (int k = 0; k <= n; k++) {
        v[k] = sp_verify_ns(sp, 1, 1 + k);
        d[k] = sp_draft_ns(sp, 1, k);
        a[k] = k ? s->acc[k] / s->tried[k] : 1;
        sp->st.price_verify_ns[k] = v[k];
        sp->st.price_draft_ns[k] = d[k];
    }
    return mf_spec_choose(v, d, a, n, NULL);
}

/* A batch: from every sequence at k 0, the addition with the best expected tokens per unit of time
 * (one more candidate of a speculating sequence, or a first bundle of 1..room of another, which
 * brings it into the draft round) while it raises the step's tokens over its price. */
static void sp_pick_batch(mf_spec *sp, const mf_spec_seq *q, int n, int *k)
{
    int items = n, U = 0, kmax = 0;
    double tok = n, cost = sp_items_ns(sp, n, items);
    for (;;) {
        double best = cost > 0 ? tok / cost : 0;
        int bs = -1, bm = 0;
        for (int i = 0; i < n; i++) {
            const sp_slot *s = &sp->slot[q[i].slot];
            int room = q[i].room < sp->n_max ? q[i].room : sp->n_max;
            for (int m = 1; k[i] + m <= room && (m == 1 || !k[i]); m++) {
                double g = sp_expect(s, k[i] + m) - sp_expect(s, k[i]);
                int km = k[i] + m > kmax ? k[i] + m : kmax;
                double c = sp_items_ns(sp, n, items + m) + sp_draft_ns(sp, U + !k[i], km);
                if (c > 0 && (tok + g) / c > best * (1 + 1e-12)) best = (tok + g) / c, bs = i, bm = m;
            }
        }
        if (bs < 0) return;
        const sp_slot *s = &sp->slot[q[bs].slot];
        tok += sp_expect(s, k[bs] + bm) - sp_expect(s, k[bs]);
        U += !k[bs];
        k[bs] += bm;
        items += bm;
        kmax = k[bs] > kmax ? k[bs] : kmax;
        cost = sp_items_ns(sp, n, items) + sp_draft_ns(sp, U, kmax);
    }
}

int mf_spec_probe_gap(int backoff, double plain_ns, double probe_ns, double share)
{
    if (!(plain_ns > 0) || !(probe_ns >= 0) || !(share > 0)) return backoff;
    double gap = ceil(probe_ns / (share * plain_ns));
    if (gap > SP_PROBE_MAX) gap = SP_PROBE_MAX;
    return gap > backoff ? (int)gap : backoff;
}

/* Plain rounds before slot s's next probe (mf_spec_probe_gap): its backoff, and a probe's cost: this
 * run's measured costs once it has timed a plain step and (with a draft) a draft round (the mean
 * draft round and a two-item step's wall time over a plain one's), before that the cost model's
 * prices of a draft round of 1 and a step of 2 items over a plain step (batch 1). */
static int sp_probe_gap(mf_spec *sp, const sp_slot *s)
{
    const mf_spec_stats *t = &sp->st;
    int dspark = sp->o.source == MF_SPEC_DSPARK;
    double plain, probe;
    if (!t->steps[0] || (dspark && !t->draft_calls)) {
        double two = sp_verify_ns(sp, 1, 2);
        plain = sp_verify_ns(sp, 1, 1);
        probe = sp_draft_ns(sp, 1, 1) + (two > plain ? two - plain : 0);
    } else {
        plain = (double)t->step_ns[0] / (double)t->steps[0];
        probe = dspark ? (double)t->draft_ns / (double)t->draft_calls : 0;
        if (t->steps[1] && (double)t->step_ns[1] / (double)t->steps[1] > plain)
            probe += (double)t->step_ns[1] / (double)t->steps[1] - plain;
    }
    return mf_spec_probe_gap(s->probe_every, plain, probe, SP_PROBE_SHARE);
}

/* ---- the feature rows ------------------------------------------------------------------------------ */

/* Slot s's rows for positions [pos0, pos0 + n), of which at least keep_min will be kept: the
 * positions from lo on (what a later round's window can read: from the first kept anchor back a
 * window, and nothing the draft has been fed) in the buffer, moved to its front when they would
 * pass its end. Returns lo. */
static int64_t sp_ensure(mf_spec *sp, sp_slot *s, int64_t pos0, int n, int keep_min)
{
    int64_t lo = pos0 + keep_min - sp->W;
    if (lo < s->ds->n_pos) lo = s->ds->n_pos;
    if (lo < 0) lo = 0;
    if (pos0 + n - s->base > sp->cap) {
        int64_t keep_from = lo > s->base ? lo : s->base, keep_to = pos0 > keep_from ? pos0 : keep_from;
        if (keep_to > keep_from && keep_from - s->base < sp->cap)
            memmove(s->frow, s->frow + (keep_from - s->base) * sp->F,
                    sizeof(float) * (size_t)((keep_to - keep_from) * sp->F));
        s->base = keep_from;
        if (lo < s->base) lo = s->base;
    }
    return lo;
}

void mf_spec_rows(mf_spec *sp, int slot, int64_t pos0, int n, float **rows)
{
    sp_slot *s = &sp->slot[slot];
    for (int j = 0; j < n; j++) rows[j] = NULL;
    if (!s->ds) return;
    int64_t lo = sp_ensure(sp, s, pos0, n, s->k ? 1 : n);
    for (int j = 0; j < n; j++)
        if (pos0 + j >= lo && pos0 + j - s->base < sp->cap) rows[j] = s->frow + (pos0 + j - s->base) * sp->F;
}

/* ---- a round ------------------------------------------------------------------------------------- */

/* The draft round of the sequences with k > 0: the reference's per sequence, or the engine's in one call. */
static int sp_draft(mf_spec *sp, const mf_spec_seq *q, int n)
{
    int m = 0, rc = 0;
    int64_t t0 = mf_now_ns();
    for (int i = 0; i < n && !rc; i++) {
        sp_slot *s = &sp->slot[q[i].slot];
        if (!s->k) continue;
        if (s->ds->n_pos < s->base) s->ds->n_pos = s->base;   /* positions never kept in rows: outside any window */
        if (q[i].st->n_pos - s->ds->n_pos > sp->W) s->ds->n_pos = q[i].st->n_pos - sp->W;
        const float *feed = s->frow + (s->ds->n_pos - s->base) * sp->F;
        int n_feed = (int)(q[i].st->n_pos - s->ds->n_pos);
        if (sp->rd) {
            rc = mf_ref_draft_feed(sp->rd, s->ds, feed, n_feed);
            if (!rc) rc = mf_ref_draft_propose(sp->rd, s->ds, q[i].anchor, s->k, s->cand, s->conf, NULL, NULL);
        } else {
            sp->dq[m++] = (mf_step_draft_seq){.ds = s->ds, .feed = feed, .n_feed = n_feed, .anchor = q[i].anchor,
                                              .n_cand = s->k, .tokens = s->cand, .confidence = s->conf};
        }
    }
    if (!rc && m) rc = mf_step_draft(sp->o.eng, sp->dq, m);
    sp->st.draft_calls++;
    sp->st.draft_ns += mf_now_ns() - t0;
    return rc;
}

/* The draft's experts on the engine's cards while speculation pays: taken when the policy picks
 * k > 0 (k[0..n)), given back SP_HOLD rounds after it last did (a failed take leaves them on the
 * host and is not tried again). */
static void sp_hold(mf_spec *sp, const int *k, int n)
{
    if (!sp->dcards) return;
    int any = 0;
    for (int i = 0; i < n; i++) any |= k[i] > 0;
    sp->hold = any ? SP_HOLD : sp->hold > 0 ? sp->hold - 1 : 0;
    int want = sp->hold > 0;
    if (want == sp->st.dcards_held) return;
    if (mf_step_draft_cards(sp->o.eng, want)) {   /* the draft on the host from now on, priced so */
        mf_error_clear();
        sp->dcards = 0;
        sp_prices_forget(sp);
        return;
    }
    sp->st.dcards_held = want;
    if (want) sp->st.dcards_takes++;
    else sp->st.dcards_drops++;
}

int mf_spec_plan(mf_spec *sp, const mf_spec_seq *q, int n)
{
    int k[SP_MAX_SEQ] = {0}, any = 0, rc = 0;
    if (n > SP_MAX_SEQ) n = SP_MAX_SEQ;
    for (int i = 0; i < n; i++) {
        sp_slot *s = &sp->slot[q[i].slot];
        int room = q[i].room < sp->n_max ? q[i].room : sp->n_max;
        k[i] = !sp->o.adaptive ? room : 0;
        s->probe = 0;
    }
    if (sp->o.adaptive && n == 1) k[0] = sp_pick_one(sp, &sp->slot[q[0].slot], q[0].room);
    else if (sp->o.adaptive) sp_pick_batch(sp, q, n, k);
    sp_hold(sp, k, n);
    for (int i = 0; i < n; i++) {
        sp_slot *s = &sp->slot[q[i].slot];
        if (sp->o.adaptive && !k[i] && q[i].room > 0 && ++s->idle >= sp_probe_gap(sp, s)) {   /* a probe */
            k[i] = 1;
            s->probe = 1;
            sp->st.probes++;
        }
        if (k[i]) s->idle = 0;
        s->k = k[i];
        any |= k[i] > 0;
    }
    if (any && sp->o.source == MF_SPEC_DSPARK) rc = sp_draft(sp, q, n);
    for (int i = 0; i < n && !rc; i++) {   /* injected candidates: as many as the function gives */
        sp_slot *s = &sp->slot[q[i].slot];
        if (s->k && sp->o.source == MF_SPEC_INJECT) {
            int m = sp->o.inject(sp->o.inject_user, q[i].req_user, q[i].st->n_pos, q[i].anchor, s->k, s->cand);
            s->k = m < 0 ? 0 : m < s->k ? m : s->k;
        }
    }
    for (int i = 0; i < n && !rc; i++) {
        sp_slot *s = &sp->slot[q[i].slot];
        if (s->k) rc = mf_ref_state_mark(q[i].st, 1 + s->k);
    }
    if (rc)
        for (int i = 0; i < n; i++) sp->slot[q[i].slot].k = 0;
    return rc;
}

int mf_spec_cands(const mf_spec *sp, int slot, const int32_t **cands)
{
    *cands = sp->slot[slot].cand;
    return sp->slot[slot].k;
}

/* Slot s's evidence at position i (accepted or not), decayed, and the requests' together. */
static void sp_learn(mf_spec *sp, sp_slot *s, int i, int ok)
{
    s->acc[i] = s->acc[i] * SP_DECAY + ok;
    s->tried[i] = s->tried[i] * SP_DECAY + 1;
    sp->g_acc[i] = sp->g_acc[i] * SP_DECAY + ok;
    sp->g_tried[i] = sp->g_tried[i] * SP_DECAY + 1;
}

int mf_spec_accept(mf_spec *sp, int slot, mf_ref_state *st, mf_sampler *smp, const float *lrows, int32_t *out,
                   int *n_out)
{
    sp_slot *s = &sp->slot[slot];
    int64_t V = sp->c->vocab_size;
    int k = s->k, j = 0;
    for (;;) {   /* row j: the target's token after the anchor and j accepted candidates */
        int ok;
        int32_t cand = j < k ? s->cand[j] : -1;
        out[j] = mf_sampler_pick_cand(smp, lrows + j * V, cand, &ok);
        j++;
        if (cand < 0) break;   /* the bonus after all k */
        sp->st.pos_tried[j]++;
        sp_learn(sp, s, j, ok);
        if (!ok) break;        /* out[j - 1] is the target's own token there: the bonus */
        sp->st.pos_accepted[j]++;
    }
    *n_out = j;   /* j - 1 accepted candidates and the bonus */
    sp->st.k_chosen[k]++;
    if (!k) {
        sp->st.plain++;
        return 0;
    }
    sp->st.rounds++;
    sp->st.proposed += k;
    sp->st.accepted += j - 1;
    sp->st.tokens += j;
    if (s->probe) s->probe_every = j > 1 ? SP_PROBE_MIN : s->probe_every * 2 > SP_PROBE_MAX ? SP_PROBE_MAX : s->probe_every * 2;
    s->k = 0;
    return mf_ref_state_rollback(st, j);   /* the anchor and the accepted candidates */
}

void mf_spec_step_done(mf_spec *sp, int64_t wall_ns, int n_items, int n_seq)
{
    int e = n_items - n_seq;
    if (e < 0) return;
    if (e > sp->n_max) e = sp->n_max;
    sp->st.steps[e]++;
    sp->st.step_ns[e] += wall_ns;
}

void mf_spec_get_stats(const mf_spec *sp, mf_spec_stats *out) { *out = sp->st; }

int mf_spec_feats(const mf_spec *sp) { return sp->o.source == MF_SPEC_DSPARK; }

/* The mean makespan of `steps` steps of po after `warmup`. */
static int sp_sim_one(const mf_plan_opts *po, int warmup, int steps, double *ns)
{
    mf_plan_report r;
    int rc = mf_plan_run(po, warmup, steps, &r);
    *ns = rc ? 0 : (double)r.step_ns;
    return rc;
}

mf_plan_opts mf_spec_sim_plan(const mf_plan_opts *po, int k, int draft)
{
    /* the steady state at k: speculating (k > 0), the draft's experts on the cards and the
     * backbone's cache short of their slots; plain (k 0), the backbone's cache whole (draft_cards) */
    mf_plan_opts o = *po;
    int per = MF_STEP_DRAFT_ITEMS / po->config->dspark_block_size, b = po->batch ? po->batch : 1;
    o.draft_cards = k > 0;
    o.unit_len = draft ? 0 : 1 + k;
    o.feats = !draft;
    o.draft = draft ? k : 0;
    if (draft) {   /* one round of at most `per` sequences, its experts drawn uniformly */
        o.batch = b < per ? b : per;
        o.routing = NULL;
    }
    return o;
}

int mf_spec_sim(const mf_plan_opts *po, int n_max, int warmup, int steps, double *verify_ns, double *draft_ns,
                int *n_k)
{
    int b = po->batch ? po->batch : 1, per = MF_STEP_DRAFT_ITEMS / po->config->dspark_block_size, rc = 0;
    *n_k = 0;
    draft_ns[0] = 0;
    for (int k = 0; k <= n_max && !rc && b * (1 + k) <= MF_STEP_MAX_ITEMS; k++) {
        mf_plan_opts o = mf_spec_sim_plan(po, k, 0);
        rc = sp_sim_one(&o, warmup, steps, &verify_ns[k]);
        for (int done = 0; k && !rc && done < b; done += per) {   /* draft rounds of at most `per` sequences */
            double ns;
            o = mf_spec_sim_plan(po, k, 1);
            o.batch = b - done < per ? b - done : per;
            rc = sp_sim_one(&o, warmup, steps, &ns);
            draft_ns[k] = (done ? draft_ns[k] : 0) + ns;
        }
        if (!rc) *n_k = k;
    }
    return rc;
}
