/* The scheduled engine's DSpark draft (graphs/step/step.h mf_step_draft, mf_step_forward_feat;
 * graphs/step/stepgraph_draft.c, step_draft.c) against the reference draft (graphs/ref/ref.h
 * mf_ref_draft_*), on the tiny preset's draft (3 stages, block 5, 8 experts top-2, window 16):
 * - the engine's features of a prompt are the layer math's on its own streams, within the
 *   engine's distance from the reference (stated bounds); in a step of several sequences (the
 *   mixed graph of its bucket, items past the step dead) every item's features and logits are
 *   its sequence's run alone, bit for bit, and no dead item's task writes a feature row;
 * - fed the same features, the engine's round gives the reference's candidates (the argmax of
 *   logits within the stated bound; a candidate may differ only where the reference's top two are
 *   nearer than twice that bound), logits and confidences within the bounds below, both on the
 *   default path (int8 experts) and --exact (every linear on the fp32 kernels);
 * - a round of several sequences is, sequence by sequence, the round of each alone, bit for bit;
 *   feeding more than a window of rows keeps only the window's; fewer candidates are a prefix;
 * - bad calls are refused. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/layers/layers.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/step.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/step_run.h"
#include "tests/tiny_ckpt.h"

enum { T = 40, B = 5, NS = 3 };

/* Bounds: the default path (int8 experts) as tests/test_step.c bounds the engine's logits against
 * the reference (worst 0.5, mean 0.15 of a row's largest magnitude; on the tiny preset's random
 * weights the int8 path's ~1% per matmul grows through the layers), confidence logits 0.15
 * absolute; the exact path (the fp32 kernels, only the sums' order differs) 1e-5 (measured: logits
 * 1.1e-7). Candidates: the argmax of logits this near may differ from the reference's only where
 * its top two are nearer than twice the row's distance. Measured values are printed. */
#define TOL_WORST 0.5
#define TOL_MEAN 0.15
#define TOL_CONF 0.15
#define TOL_EXACT 1e-5

typedef struct round_out {
    int32_t tok[B];
    float conf[B];
    float *logits;   /* B x V */
} round_out;

static double rel_diff(const float *a, const float *b, int64_t n)
{
    double d = 0, m = 0;
    for (int64_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - b[i]));
        m = fmax(m, fabs((double)b[i]));
    }
    return m > 0 ? d / m : d;
}

/* The reference's top two logits' gap. */
static double top_gap(const float *l, int64_t V)
{
    double a = -INFINITY, b = -INFINITY;
    for (int64_t v = 0; v < V; v++) {
        if (l[v] > a) b = a, a = l[v];
        else if (l[v] > b) b = l[v];
    }
    return a - b;
}

/* Compares the engine's round e against the reference's r (bound tl on the worst row, tm on the
 * mean, tc on the confidence); returns the worst row's distance, *mean the mean. */
static double compare_round(const round_out *e, const round_out *r, int64_t V, double tl, double tm, double tc,
                            const char *what, double *mean)
{
    double worst = 0, sum = 0;
    int n = 0;
    for (int i = 0; i < B; i++) {
        const float *le = e->logits + i * V, *lr = r->logits + i * V;
        double d = rel_diff(le, lr, V), scale = 0;
        for (int64_t v = 0; v < V; v++) scale = fmax(scale, fabs((double)lr[v]));
        worst = fmax(worst, d);
        sum += d, n++;
        CHECK(d <= tl, "%s position %d: logits %.3g apart (bound %.3g)", what, i, d, tl);
        CHECK(fabs(e->conf[i] - r->conf[i]) <= tc, "%s position %d: confidence %.5f vs %.5f", what, i, e->conf[i],
              r->conf[i]);
        if (e->tok[i] != r->tok[i]) {
            CHECK(top_gap(lr, V) <= 2 * d * scale, "%s position %d: candidate %d vs the reference's %d (gap %.3g)", what,
                  i, e->tok[i], r->tok[i], top_gap(lr, V));
            break;   /* the chains part: later positions follow other tokens */
        }
    }
    CHECK(sum / n <= tm, "%s: logits %.3g apart on average (bound %.3g)", what, sum / n, tm);
    *mean = sum / n;
    return worst;
}

static int eng_round(mf_step *e, mf_ly_draft_state *ds, const float *feed, int n_feed, int32_t anchor, int n, round_out *o)
{
    mf_step_draft_seq q = {.ds = ds, .feed = feed, .n_feed = n_feed, .anchor = anchor, .n_cand = n,
                           .tokens = o->tok, .confidence = o->conf, .logits = o->logits};
    return mf_step_draft(e, &q, 1);
}

/* The engine made with opts and the draft, against the reference round, fed the reference's
 * features of the prompt. */
static void check_against_ref(mf_ref *r, mf_ref_draft *rd, int exact, const float *feats, const int32_t *ids)
{
    const mf_config *c = mf_ref_config(r);
    int64_t V = c->vocab_size;
    mf_step *e = NULL;
    CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2, .draft = 1, .exact = exact}, &e) == 0, "%s", mf_last_error());
    if (!e) return;
    round_out ro = {.logits = malloc(sizeof(float) * B * V)}, eo = {.logits = malloc(sizeof(float) * B * V)};
    int64_t per = (int64_t)c->n_dspark_target * c->hidden_size;
    const int anchors[] = {9, 24, 40};
    double worst = 0, mean = 0, m1 = 0, cworst = 0;
    for (int a = 0; a < 3; a++) {
        int n = anchors[a] < T ? anchors[a] : T;
        mf_ly_draft_state *dr = NULL, *de = NULL;
        CHECK(mf_ref_draft_state_new(rd, &dr) == 0 && mf_ref_draft_state_new(rd, &de) == 0, "%s", mf_last_error());
        int rc = mf_ref_draft_feed(rd, dr, feats, n);
        if (!rc) rc = mf_ref_draft_propose(rd, dr, ids[n - 1], B, ro.tok, ro.conf, ro.logits, NULL);
        if (!rc) rc = eng_round(e, de, feats, n, ids[n - 1], B, &eo);
        CHECK(rc == 0, "anchor %d: %s", n, mf_last_error());
        CHECK(de->n_pos == dr->n_pos, "fed %lld vs %lld positions", (long long)de->n_pos, (long long)dr->n_pos);
        char what[64];
        snprintf(what, sizeof what, "%s anchor %d", exact ? "exact" : "default", n);
        if (!rc) {
            worst = fmax(worst, compare_round(&eo, &ro, V, exact ? TOL_EXACT : TOL_WORST, exact ? TOL_EXACT : TOL_MEAN,
                                              exact ? TOL_EXACT : TOL_CONF, what, &m1));
            mean = fmax(mean, m1);
            for (int i = 0; i < B; i++) cworst = fmax(cworst, fabs(eo.conf[i] - ro.conf[i]));
        }
        if (!rc && !exact && a == 1) {   /* fewer candidates: the same first ones */
            round_out f = {.logits = malloc(sizeof(float) * B * V)};
            mf_ly_draft_state *d2 = NULL;
            CHECK(mf_ref_draft_state_new(rd, &d2) == 0 && eng_round(e, d2, feats, n, ids[n - 1], 2, &f) == 0,
                  "%s", mf_last_error());
            CHECK(!memcmp(f.tok, eo.tok, 2 * sizeof(int32_t)) && !memcmp(f.logits, eo.logits, sizeof(float) * 2 * V),
                  "2 candidates are not the first 2 of 5");
            mf_ref_draft_state_free(d2);
            free(f.logits);
        }
        mf_ref_draft_state_free(dr);
        mf_ref_draft_state_free(de);
    }
    printf("engine draft (%s) vs reference: logits worst %.3g, mean %.3g (bounds %.3g, %.3g); confidence %.3g "
           "(bound %.3g)\n", exact ? "exact" : "default", worst, mean, exact ? TOL_EXACT : TOL_WORST,
           exact ? TOL_EXACT : TOL_MEAN, cworst, exact ? TOL_EXACT : TOL_CONF);
    (void)per;
    free(ro.logits);
    free(eo.logits);
    mf_step_free(e);
}

/* Several sequences in one round: each as its own round, bit for bit; more than a window's rows. */
static void check_batch(mf_ref *r, mf_ref_draft *rd, const float *feats, const int32_t *ids)
{
    const mf_config *c = mf_ref_config(r);
    int64_t V = c->vocab_size, per = (int64_t)c->n_dspark_target * c->hidden_size;
    mf_step *e = NULL;
    CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2, .draft = 1}, &e) == 0, "%s", mf_last_error());
    if (!e) return;
    round_out one[NS], all[NS];
    mf_ly_draft_state *d1[NS], *dn[NS];
    mf_step_draft_seq q[NS];
    const int fed[NS] = {T, 12, 30};   /* T rows: more than the window (16) */
    for (int k = 0; k < NS; k++) {
        one[k].logits = malloc(sizeof(float) * B * V);
        all[k].logits = malloc(sizeof(float) * B * V);
        mf_ref_draft_state_new(rd, &d1[k]);
        mf_ref_draft_state_new(rd, &dn[k]);
        CHECK(eng_round(e, d1[k], feats, fed[k], ids[fed[k] - 1], B - k, &one[k]) == 0, "%s", mf_last_error());
        q[k] = (mf_step_draft_seq){.ds = dn[k], .feed = feats, .n_feed = fed[k], .anchor = ids[fed[k] - 1],
                                   .n_cand = B - k, .tokens = all[k].tok, .confidence = all[k].conf,
                                   .logits = all[k].logits};
    }
    CHECK(mf_step_draft(e, q, NS) == 0, "%s", mf_last_error());
    for (int k = 0; k < NS; k++) {
        int n = B - k;
        CHECK(!memcmp(one[k].tok, all[k].tok, sizeof(int32_t) * n) && !memcmp(one[k].conf, all[k].conf, sizeof(float) * n) &&
                  !memcmp(one[k].logits, all[k].logits, sizeof(float) * n * V),
              "sequence %d's round in a batch of %d differs from its round alone", k, NS);
        CHECK(dn[k]->n_pos == fed[k] && !memcmp(dn[k]->ring, d1[k]->ring, (size_t)mf_ly_draft_ring_bytes(c)),
              "sequence %d's context after the round", k);
    }
    /* the window's rows alone give the same round as all T */
    mf_ly_draft_state *dw = NULL;
    round_out w = {.logits = malloc(sizeof(float) * B * V)};
    mf_ref_draft_state_new(rd, &dw);
    int W = c->sliding_window;
    dw->n_pos = T - W;
    CHECK(eng_round(e, dw, feats + (T - W) * per, W, ids[T - 1], B, &w) == 0 &&
              !memcmp(w.tok, one[0].tok, sizeof w.tok) && !memcmp(w.logits, one[0].logits, sizeof(float) * B * V),
          "the window's rows do not give the round of all the rows");
    /* refusals */
    round_out bad = {.logits = NULL};
    CHECK(eng_round(e, dw, feats, 0, ids[0], 0, &bad) == -EINVAL, "0 candidates");
    CHECK(eng_round(e, dw, feats, 0, ids[0], B + 1, &bad) == -EINVAL, "more candidates than the block");
    CHECK(eng_round(e, dw, feats, 0, (int32_t)V, 1, &bad) == -EINVAL, "anchor outside the vocabulary");
    mf_ref_draft_state_free(dw);
    free(w.logits);
    for (int k = 0; k < NS; k++) {
        free(one[k].logits);
        free(all[k].logits);
        mf_ref_draft_state_free(d1[k]);
        mf_ref_draft_state_free(dn[k]);
    }
    mf_step_free(e);
}

/* The engine's features against the reference's (its streams are the engine's own). */
static void check_feats(mf_ref *r, const float *feats, const int32_t *ids)
{
    const mf_config *c = mf_ref_config(r);
    int64_t per = (int64_t)c->n_dspark_target * c->hidden_size;
    mf_step *e = NULL, *plain = NULL;
    CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2, .draft = 1}, &e) == 0, "%s", mf_last_error());
    CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2}, &plain) == 0, "%s", mf_last_error());
    if (!e || !plain) return;
    float *ef = malloc(sizeof(float) * T * per), **fp = calloc(T, sizeof *fp);
    float *la = malloc(sizeof(float) * c->vocab_size), *lb = malloc(sizeof(float) * c->vocab_size), **lp = calloc(T, sizeof *lp);
    mf_ref_state *s = NULL, *s2 = NULL, **st = calloc(T, sizeof *st), **st2 = calloc(T, sizeof *st2);
    mf_ref_state_new(r, T, &s);
    mf_ref_state_new(r, T, &s2);
    for (int i = 0; i < T; i++) fp[i] = ef + i * per, st[i] = s, st2[i] = s2;
    lp[T - 1] = la;
    CHECK(mf_step_forward_feat(e, st, ids, T, lp, fp) == 0, "%s", mf_last_error());
    lp[T - 1] = lb;
    CHECK(mf_step_forward(plain, st2, ids, T, lp) == 0, "%s", mf_last_error());
    CHECK(!memcmp(la, lb, sizeof(float) * (size_t)c->vocab_size), "the features' tasks change the logits");
    double worst = 0, sum = 0;
    for (int i = 0; i < T; i++) {
        double d = rel_diff(ef + i * per, feats + i * per, per);
        worst = fmax(worst, d);
        sum += d;
    }
    CHECK(worst <= TOL_WORST && sum / T <= TOL_MEAN, "features %.3g apart, %.3g on average (bounds %.3g, %.3g)", worst,
          sum / T, TOL_WORST, TOL_MEAN);
    printf("engine features (default path) vs reference: worst %.3g, mean %.3g (bounds %.3g, %.3g)\n", worst, sum / T,
           TOL_WORST, TOL_MEAN);
    mf_ref_state *one = NULL;
    mf_ref_state_new(r, 4, &one);
    CHECK(mf_step_forward_feat(plain, &one, ids, 1, NULL, fp) == -EINVAL, "features asked of an engine without the draft");
    mf_ref_state_free(one);
    mf_ref_state_free(s);
    mf_ref_state_free(s2);
    free(st), free(st2), free(ef), free(fp), free(la), free(lb), free(lp);
    mf_step_free(e);
    mf_step_free(plain);
}

/* A step of several sequences runs its bucket's mixed graph, the items past the step dead (their
 * feature tasks noop, the straddling group's cut): every item's features and logits those of its
 * sequence run alone (serial), over two steps of 6 and 5 items in the bucket of 8. */
static void check_feats_bucket(mf_ref *r, const int32_t *ids)
{
    enum { NQ = 3, NSTEP = 2 };
    static const int len[NSTEP][NQ] = {{3, 1, 2}, {1, 2, 2}};
    const mf_config *c = mf_ref_config(r);
    int64_t per = (int64_t)c->n_dspark_target * c->hidden_size, V = c->vocab_size;
    mf_step *e = NULL, *alone = NULL;
    CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2, .draft = 1}, &e) == 0 &&
          mf_step_new(r, &(mf_step_opts){.n_threads = 2, .draft = 1}, &alone) == 0, "%s", mf_last_error());
    mf_ref_state *sa[NQ] = {0}, *sb[NQ] = {0};
    for (int q = 0; q < NQ; q++) mf_ref_state_new(r, T, &sa[q]), mf_ref_state_new(r, T, &sb[q]);
    float *fa = calloc((size_t)(8 * per), sizeof(float)), *fb = calloc((size_t)(8 * per), sizeof(float));
    float *la = malloc(sizeof(float) * (size_t)(8 * V)), *lb = malloc(sizeof(float) * (size_t)(8 * V));
    int pos[NQ] = {0};
    for (int k = 0; k < NSTEP && e && alone; k++) {
        mf_ref_state *st[8];
        int32_t tok[8];
        float *fp[8], *lp[8];
        int n = 0;
        for (int q = 0; q < NQ; q++)
            for (int j = 0; j < len[k][q]; j++, n++)
                st[n] = sa[q], tok[n] = ids[pos[q] + j], fp[n] = fa + n * per, lp[n] = la + n * V;
        float *keep = malloc(sizeof(float) * (size_t)((8 - n) * per));   /* rows an earlier step's live items had */
        if (keep) memcpy(keep, fa + n * per, sizeof(float) * (size_t)((8 - n) * per));
        CHECK(mf_step_forward_feat(e, st, tok, n, lp, fp) == 0, "%s", mf_last_error());
        CHECK(keep && !memcmp(keep, fa + n * per, sizeof(float) * (size_t)((8 - n) * per)),
              "step %d: a dead item's feature task wrote where an earlier step's item had its row", k);
        free(keep);
        const mf_stepgraph *g = mf_step_graph(e, n, MF_STEP_GRAPH_MIXED);
        CHECK(g && g->n == 8 && g->n_live == n, "step %d: %d items in the mixed graph of %d (%d live)", k, n,
              g ? g->n : 0, g ? g->n_live : 0);
        for (int q = 0, i0 = 0; q < NQ; i0 += len[k][q], q++) {
            for (int j = 0; j < len[k][q]; j++)
                st[j] = sb[q], fp[j] = fb + j * per, lp[j] = lb + j * V;
            CHECK(mf_step_forward_feat(alone, st, ids + pos[q], len[k][q], lp, fp) == 0, "%s", mf_last_error());
            CHECK(!memcmp(fa + i0 * per, fb, sizeof(float) * (size_t)(len[k][q] * per)) &&
                      !memcmp(la + i0 * V, lb, sizeof(float) * (size_t)(len[k][q] * V)),
                  "step %d, sequence %d: features or logits in the bucket differ from its run alone", k, q);
            pos[q] += len[k][q];
        }
    }
    for (int q = 0; q < NQ; q++) mf_ref_state_free(sa[q]), mf_ref_state_free(sb[q]);
    free(fa), free(fb), free(la), free(lb);
    mf_step_free(e);
    mf_step_free(alone);
}

/* The draft's experts on emulated cards (mf_step_draft_cards): a round places its MoE's slots on
 * the cards (every one a hit) and gives the host engine's candidates, confidences and logits bit
 * for bit (the cards run the host's kernels), seed (also with device graphs: the steps' only; and
 * with the dense work on the cards, split by layers and by rows: the stages' dense weights go to
 * the cards too) and hybrid placement; given back, the round runs on the host again, the same bits;
 * the backbone's cache had the draft's share taken. */
static void check_cards(mf_ref *r, mf_ref_draft *rd, const float *feats, const int32_t *ids)
{
    const mf_config *c = mf_ref_config(r);
    int64_t V = c->vocab_size;
    mf_step *h = NULL;
    CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2, .draft = 1}, &h) == 0, "%s", mf_last_error());
    round_out ho = {.logits = malloc(sizeof(float) * B * V)}, co = {.logits = malloc(sizeof(float) * B * V)};
    const int n = 24;
    mf_ly_draft_state *dh = NULL;
    CHECK(h && mf_ref_draft_state_new(rd, &dh) == 0, "%s", mf_last_error());
    CHECK(dh && eng_round(h, dh, feats, n, ids[n - 1], B, &ho) == 0, "host round: %s", mf_last_error());
    /* the third with device graphs, the fourth and fifth with dense cards split by layers, by rows */
    const int places[5] = {MF_STEP_PLACE_SEED, MF_STEP_PLACE_HYBRID, MF_STEP_PLACE_SEED, MF_STEP_PLACE_SEED,
                           MF_STEP_PLACE_SEED};
    for (int pl = 0; pl < 5; pl++) {
        char spec[64];
        mf_dev *d = NULL;
        mf_step *e = NULL;
        CHECK(mf_test_emu_open(2, spec, sizeof spec, &d) == 0, "%s: %s", spec, mf_last_error());
        CHECK(d && mf_step_new(r, &(mf_step_opts){.n_threads = 2, .draft = 1, .dev = d, .placement = places[pl],
                                             .dev_graphs = pl == 2, .dense = pl >= 3 ? MF_STEP_DENSE_CARDS : 0,
                                             .dense_split = pl == 4 ? MF_SG_SPLIT_ROWS : MF_SG_SPLIT_LAYERS},
                               &e) == 0, "%s", mf_last_error());
        if (!e) {
            mf_dev_close(d);
            continue;
        }
        mf_step_dev_stats st;
        for (int on = 1; on >= 0; on--) {
            CHECK(mf_step_draft_cards(e, on) == 0, "draft cards %d: %s", on, mf_last_error());
            mf_ly_draft_state *de = NULL;
            CHECK(mf_ref_draft_state_new(rd, &de) == 0, "%s", mf_last_error());
            memset(co.logits, 0, sizeof(float) * B * V);
            CHECK(de && eng_round(e, de, feats, n, ids[n - 1], B, &co) == 0, "card round: %s", mf_last_error());
            mf_step_last_dev(e, &st);
            /* seed: every slot on its owner card; hybrid: where the cost model puts it */
            CHECK(on ? (st.dev_slots > 0 || pl == 1) && st.misses == 0 : st.dev_slots == 0,
                  "placement %d, draft cards %d: %lld slots on the cards (%llu misses), %lld on the host", places[pl], on,
                  (long long)st.dev_slots, (unsigned long long)st.misses, (long long)st.host_slots);
            CHECK(!memcmp(co.tok, ho.tok, sizeof co.tok) && !memcmp(co.conf, ho.conf, sizeof co.conf) &&
                      !memcmp(co.logits, ho.logits, sizeof(float) * B * V),
                  "case %d (placement %d), draft cards %d: the round differs from the host engine's", pl, places[pl], on);
            mf_ref_draft_state_free(de);
        }
        mf_step_free(e);
        mf_dev_close(d);
    }
    mf_ref_draft_state_free(dh);
    free(ho.logits), free(co.logits);
    mf_step_free(h);
}

int main(void)
{
    mf_config c;
    mf_config_preset("tiny", &c);
    char dir[1024];
    if (mf_test_gen_ckpt(&c, "step_draft", dir, sizeof dir)) return 1;
    mf_model *m = NULL, *plain_m = NULL;
    mf_ref *r = NULL, *rp = NULL;
    mf_ref_draft *rd = NULL;
    if (mf_model_load(dir, &(mf_model_opts){.quiet = 1, .load_draft = 1}, &m) || mf_ref_new(m, NULL, &r) ||
        mf_ref_draft_new(r, &rd) || mf_model_load(dir, &(mf_model_opts){.quiet = 1}, &plain_m) ||
        mf_ref_new(plain_m, NULL, &rp)) {
        fprintf(stderr, "setup: %s\n", mf_last_error());
        return 1;
    }
    mf_step *e = NULL;
    CHECK(mf_step_new(rp, &(mf_step_opts){.n_threads = 1, .draft = 1}, &e) == -EINVAL && !e,
          "the draft on a model loaded without it: %s", mf_last_error());
    int64_t per = (int64_t)c.n_dspark_target * c.hidden_size;
    int32_t ids[T];
    for (int i = 0; i < T; i++) ids[i] = (int32_t)((i * 97 + 13) % c.vocab_size);
    float *feats = malloc(sizeof(float) * T * per), **fp = calloc(T, sizeof *fp);
    mf_ref_state *s = NULL, **st = calloc(T, sizeof *st);
    mf_ref_state_new(r, T, &s);
    for (int i = 0; i < T; i++) fp[i] = feats + i * per, st[i] = s;
    if (mf_ref_forward_feat(r, st, ids, T, NULL, fp)) {
        fprintf(stderr, "features: %s\n", mf_last_error());
        return 1;
    }
    check_feats(r, feats, ids);
    check_feats_bucket(r, ids);
    check_against_ref(r, rd, 0, feats, ids);
    check_against_ref(r, rd, 1, feats, ids);
    check_batch(r, rd, feats, ids);
    check_cards(r, rd, feats, ids);
    mf_ref_state_free(s);
    free(st), free(fp), free(feats);
    mf_ref_draft_free(rd);
    mf_ref_free(r);
    mf_ref_free(rp);
    mf_model_free(m);
    mf_model_free(plain_m);
    return mf_check_exit("test_step_draft");
}
