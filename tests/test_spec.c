/* Speculative decoding through the batcher (graphs/step/spec.h, graphs/step/batch.h
 * mf_batch_opts.spec; docs/dspark.md), on the tiny preset (its draft: 3 stages, block 5):
 * - greedy with speculation gives the tokens and the logits of greedy without it, bit for bit: with
 *   the real draft (the engine's and the reference's), fixed 5 candidates and the adaptive k; with
 *   injected candidates that force the acceptance of exactly j of 5 for every j (a wrong token
 *   after the first j of the greedy run's), one sequence speculating inside a batch whose
 *   neighbours do not; every round's counters add up (tokens = accepted + rounds);
 * - sampling with speculation keeps the target's distribution: over 960 seeds the first five
 *   tokens sampled (temperature 0.1, top-p 0.95) with injected candidates (the greedy run's: 41%
 *   accepted) against without, a chi-square test of each position's tokens (categories of at
 *   least 5 expected in both, the rest pooled) below its 0.1% critical value; a rule that always
 *   accepted the candidate fails it (checked here on the same draws);
 * - a request with penalties takes plain steps (its tokens and logits those of its plain run);
 * - the policy's rule (mf_spec_choose) on stated prices. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/model/model.h"
#include "graphs/prefix/prefix.h"
#include "graphs/ref/ref.h"
#include "graphs/step/batch.h"
#include "graphs/step/spec.h"
#include "graphs/step/step.h"
#include "sched/cost.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/tiny_ckpt.h"

enum { NP = 12, GEN = 14, MAXR = 64 };
/* The sampling check: temperature 0.1 (the tiny preset's random logits are nearly flat at 1: its
 * injected candidates were accepted 0.07% of the time there, 41% at 0.1), top-p 0.95 */
#define TEMP 0.1
#define NREQ 960

/* the requests' frequency_penalty (check_controls: a request the acceptance cannot serve) */
static double g_freq_pen;

typedef struct req_out {
    int id, n;
    int32_t tok[GEN];
    float *logits;   /* GEN x V */
    /* injection: the greedy tokens to propose, and how many of each round to propose right */
    const int32_t *truth;
    int64_t pos0;    /* the first generated token's position - 1: the prompt's length */
    int right;       /* candidates proposed right per round (then a wrong one); -1: never speculate */
} req_out;

typedef struct run_ctx {
    int64_t V;
    req_out *out;
    int fail_always_accept;
} run_ctx;

static void on_event(void *user, const mf_batch_event *ev)
{
    run_ctx *x = user;
    req_out *o = ev->user;
    (void)x;
    if (ev->kind != MF_BATCH_TOKEN || o->n >= GEN) return;
    o->tok[o->n] = ev->token;
    if (o->logits) memcpy(o->logits + o->n * x->V, ev->logits, sizeof(float) * (size_t)x->V);
    o->n++;
}

/* The injected candidates: request o's greedy tokens after the anchor, the first `right` of them
 * as they are, then one off by one. */
static int inject(void *user, void *req_user, int64_t pos, int32_t anchor, int n, int32_t *cands)
{
    run_ctx *x = user;
    req_out *o = req_user;
    (void)anchor;
    if (!o || o->right < 0) return 0;
    int64_t g = pos - o->pos0 + 1;   /* the anchor is generated token g - 1: candidates are tokens g, g + 1, ... */
    int m = 0;
    for (int i = 0; i < n && g + i < GEN; i++, m++)
        cands[i] = i < o->right ? o->truth[g + i] : (int32_t)((o->truth[g + i] + 1) % x->V);
    return m;
}

static int32_t prompt_tok(int r, int i) { return (int32_t)((r * 131 + i * 29 + 3) % 500); }

/* Runs n_req requests (prompt NP tokens, GEN tokens, greedy or sampled with seeds seed0 + r)
 * through a batcher of max_batch, with sp (NULL: none); out[r] gets each one's tokens and logits. */
static int run_batch(mf_ref *r, mf_step *e, mf_spec *sp, int max_batch, int n_req, double temp, uint64_t seed0,
                     req_out *out, int64_t V, int prompts, int gen)
{
    run_ctx x = {.V = V, .out = out};
    mf_batch *b = NULL;
    int rc = mf_batch_new(&(mf_batch_opts){.ref = r, .eng = e, .max_batch = max_batch, .max_context = 64,
                                           .on_event = on_event, .user = &x, .spec = sp},
                          &b);
    if (rc) return rc;
    for (int q = 0; q < n_req && !rc; q++) {
        int32_t p[NP];
        for (int i = 0; i < NP; i++) p[i] = prompt_tok(q % prompts, i);
        out[q].n = 0;
        out[q].pos0 = NP;
        rc = mf_batch_submit(b, &(mf_batch_req){.prompt = p, .n_prompt = NP, .max_tokens = gen, .temperature = temp,
                                                .top_p = 0.95, .seed = seed0 + (uint64_t)q, .ignore_eos = 1,
                                                .frequency_penalty = g_freq_pen, .user = &out[q]},
                             NULL);
    }
    while (!rc && mf_batch_wait(b, 0)) rc = mf_batch_step(b, NULL);
    mf_batch_free(b);
    return rc;
}

static void free_outs(req_out *o, int n)
{
    for (int i = 0; i < n; i++) free(o[i].logits);
}

static void alloc_outs(req_out *o, int n, int64_t V)
{
    for (int i = 0; i < n; i++) {
        memset(&o[i], 0, sizeof o[i]);
        o[i].logits = malloc(sizeof(float) * GEN * (size_t)V);
    }
}

/* Greedy: the same tokens and logits with speculation as without. */
static void check_greedy(mf_ref *r, mf_step *e, const char *who)
{
    const mf_config *c = mf_ref_config(r);
    int64_t V = c->vocab_size;
    enum { NR = 3 };
    req_out base[NR], got[NR];
    alloc_outs(base, NR, V);
    CHECK(run_batch(r, e, NULL, NR, NR, 0, 0, base, V, 7, GEN) == 0, "%s plain: %s", who, mf_last_error());
    /* the real draft: fixed 5 candidates, and the adaptive k */
    for (int adaptive = 0; adaptive < 2; adaptive++) {
        mf_spec *sp = NULL;
        alloc_outs(got, NR, V);
        CHECK(mf_spec_new(&(mf_spec_opts){.ref = r, .eng = e, .source = MF_SPEC_DSPARK, .adaptive = adaptive}, NR, &sp) ==
                  0, "%s: %s", who, mf_last_error());
        CHECK(sp && run_batch(r, e, sp, NR, NR, 0, 0, got, V, 7, GEN) == 0, "%s dspark: %s", who, mf_last_error());
        for (int q = 0; q < NR; q++)
            CHECK(got[q].n == GEN && !memcmp(got[q].tok, base[q].tok, sizeof got[q].tok) &&
                      !memcmp(got[q].logits, base[q].logits, sizeof(float) * GEN * (size_t)V),
                  "%s dspark%s: request %d's tokens or logits differ from greedy without speculation", who,
                  adaptive ? " auto" : "", q);
        mf_spec_stats st;
        if (sp) {
            mf_spec_get_stats(sp, &st);
            CHECK(st.tokens == st.accepted + st.rounds && (adaptive || st.rounds > 0), "%s: counters", who);
            printf("%s dspark%s: %lld rounds, %lld of %lld candidates accepted, %lld plain steps, %lld probes\n", who,
                   adaptive ? " auto" : "", (long long)st.rounds, (long long)st.accepted, (long long)st.proposed,
                   (long long)st.plain, (long long)st.probes);
        }
        mf_spec_free(sp);
        free_outs(got, NR);
    }
    /* injected: exactly j of 5 right in every round, j = 0..5; request 1 does not speculate */
    for (int j = 0; j <= 5; j++) {
        mf_spec *sp = NULL;
        alloc_outs(got, NR, V);
        for (int q = 0; q < NR; q++) got[q].truth = base[q].tok, got[q].right = q == 1 ? -1 : j;
        run_ctx x = {.V = V};
        CHECK(mf_spec_new(&(mf_spec_opts){.ref = r, .eng = e, .source = MF_SPEC_INJECT, .n_max = 5, .inject = inject,
                                          .inject_user = &x},
                          NR, &sp) == 0, "%s: %s", who, mf_last_error());
        CHECK(sp && run_batch(r, e, sp, NR, NR, 0, 0, got, V, 7, GEN) == 0, "%s inject %d: %s", who, j, mf_last_error());
        for (int q = 0; q < NR; q++)
            CHECK(got[q].n == GEN && !memcmp(got[q].tok, base[q].tok, sizeof got[q].tok) &&
                      !memcmp(got[q].logits, base[q].logits, sizeof(float) * GEN * (size_t)V),
                  "%s inject %d right: request %d's tokens or logits differ", who, j, q);
        mf_spec_stats st;
        if (sp) {
            mf_spec_get_stats(sp, &st);
            /* every round of the two speculating requests accepts exactly min(j, candidates) */
            int64_t want = 0;
            CHECK(st.tokens == st.accepted + st.rounds, "%s inject %d: tokens %lld, accepted %lld, rounds %lld", who, j,
                  (long long)st.tokens, (long long)st.accepted, (long long)st.rounds);
            for (int i = 1; i <= 5; i++) want += i <= j ? st.pos_tried[i] - st.pos_accepted[i] : st.pos_accepted[i];
            CHECK(want == 0 && st.rounds > 0, "%s inject %d: acceptance by position not as forced", who, j);
        }
        mf_spec_free(sp);
        free_outs(got, NR);
    }
    free_outs(base, NR);
}

/* Two turns of a chat through one batcher (the second's prompt the first's, its reply and 4 more
 * tokens), with sp and the prefix cache p (either NULL: none); out[t] gets turn t's tokens and
 * logits, out[1].pos0 its prompt's length. */
static int run_turns(mf_ref *r, mf_step *e, mf_spec *sp, mf_prefix *p, req_out *out, int64_t V)
{
    run_ctx x = {.V = V, .out = out};
    mf_batch *b = NULL;
    int rc = mf_batch_new(&(mf_batch_opts){.ref = r, .eng = e, .max_batch = 2, .max_context = 64, .on_event = on_event,
                                           .user = &x, .spec = sp, .prefix = p},
                          &b);
    int32_t p1[NP], p2[NP + GEN + 4];
    for (int t = 0; t < 2 && !rc; t++) {
        int n = t ? NP + GEN + 4 : NP;
        int32_t *pr = t ? p2 : p1;
        for (int i = 0; i < n; i++) pr[i] = i < NP ? prompt_tok(0, i) : i < NP + GEN ? out[0].tok[i - NP] : prompt_tok(1, i);
        out[t].n = 0;
        out[t].pos0 = n;
        rc = mf_batch_submit(b, &(mf_batch_req){.prompt = pr, .n_prompt = n, .max_tokens = GEN, .ignore_eos = 1,
                                                .user = &out[t]},
                             NULL);
        while (!rc && mf_batch_wait(b, 0)) rc = mf_batch_step(b, NULL);
    }
    mf_batch_free(b);
    return rc;
}

/* Speculation with the prefix cache (blocks of 4 tokens): two turns with injected candidates of
 * which 2 a round are right (every round rolls a rejected position back) give both turns' tokens and
 * logits of plain greedy decoding without the cache, and the second turn restores blocks the
 * first's decode completed. The batcher closes a verify's step for the cache after the rollback;
 * closed before it (blocks holding a rejected position's rows inserted), this fails. */
static void check_prefix(mf_ref *r, mf_step *e, const char *who)
{
    int64_t V = mf_ref_config(r)->vocab_size;
    req_out base[2], got[2];
    alloc_outs(base, 2, V);
    alloc_outs(got, 2, V);
    CHECK(run_turns(r, e, NULL, NULL, base, V) == 0, "%s turns: %s", who, mf_last_error());
    for (int t = 0; t < 2; t++) got[t].truth = base[t].tok, got[t].right = 2;
    run_ctx x = {.V = V};
    mf_spec *sp = NULL;
    mf_prefix *p = NULL;
    CHECK(mf_spec_new(&(mf_spec_opts){.ref = r, .eng = e, .source = MF_SPEC_INJECT, .n_max = 5, .inject = inject,
                                      .inject_user = &x},
                      2, &sp) == 0 &&
              mf_prefix_new(&(mf_prefix_opts){.ref = r, .block_tokens = 4, .budget_bytes = 64 << 20, .quiet = 1}, &p) ==
                  0,
          "%s: %s", who, mf_last_error());
    CHECK(sp && p && run_turns(r, e, sp, p, got, V) == 0, "%s turns, spec and cache: %s", who, mf_last_error());
    for (int t = 0; t < 2; t++)
        CHECK(got[t].n == GEN && !memcmp(got[t].tok, base[t].tok, sizeof got[t].tok) &&
                  !memcmp(got[t].logits, base[t].logits, sizeof(float) * GEN * (size_t)V),
              "%s spec + prefix cache: turn %d's tokens or logits differ from greedy without either", who, t);
    mf_spec_stats ss = {0};
    mf_prefix_stats ps = {0};
    if (sp) mf_spec_get_stats(sp, &ss);
    if (p) mf_prefix_get_stats(p, &ps);
    CHECK(ss.rounds > 0 && ss.accepted < ss.proposed, "%s: %lld rounds, %lld of %lld accepted (rollbacks expected)",
          who, (long long)ss.rounds, (long long)ss.accepted, (long long)ss.proposed);
    printf("%s spec + prefix: hit %lld inserted %lld nodes %lld\n", who, (long long)ps.hit_tokens, (long long)ps.inserted, (long long)ps.nodes);
    CHECK(ps.hit_tokens > NP, "%s: the second turn restored %lld tokens (expected past the first prompt's %d)", who,
          (long long)ps.hit_tokens, NP);
    mf_spec_free(sp);
    mf_prefix_free(p);
    free_outs(base, 2);
    free_outs(got, 2);
}

/* A request with penalties (as with logprobs, logit_bias or a grammar) takes plain steps under
 * speculation: its tokens are those of its plain run (drawn from the adjusted logits), and no
 * round speculates although the injected candidates would all be accepted by the raw logits. */
static void check_controls(mf_ref *r, mf_step *e)
{
    int64_t V = mf_ref_config(r)->vocab_size;
    enum { NR = 2 };
    req_out base[NR], plain[NR], got[NR];
    alloc_outs(base, NR, V);
    alloc_outs(plain, NR, V);
    alloc_outs(got, NR, V);
    CHECK(run_batch(r, e, NULL, NR, NR, 0, 0, base, V, 7, GEN) == 0, "controls base: %s", mf_last_error());
    g_freq_pen = 1.5;
    CHECK(run_batch(r, e, NULL, NR, NR, 0, 0, plain, V, 7, GEN) == 0, "controls plain: %s", mf_last_error());
    int differs = 0;
    for (int q = 0; q < NR; q++) differs |= memcmp(plain[q].tok, base[q].tok, sizeof base[q].tok) != 0;
    CHECK(differs, "controls: the penalty changes no greedy token (the check would prove nothing)");
    for (int q = 0; q < NR; q++) got[q].truth = base[q].tok, got[q].right = 5;   /* the raw logits' tokens */
    run_ctx x = {.V = V};
    mf_spec *sp = NULL;
    CHECK(mf_spec_new(&(mf_spec_opts){.ref = r, .eng = e, .source = MF_SPEC_INJECT, .n_max = 5, .inject = inject,
                                      .inject_user = &x},
                      NR, &sp) == 0, "controls: %s", mf_last_error());
    CHECK(sp && run_batch(r, e, sp, NR, NR, 0, 0, got, V, 7, GEN) == 0, "controls spec: %s", mf_last_error());
    for (int q = 0; q < NR; q++)
        CHECK(got[q].n == GEN && !memcmp(got[q].tok, plain[q].tok, sizeof got[q].tok) &&
                  !memcmp(got[q].logits, plain[q].logits, sizeof(float) * GEN * (size_t)V),
              "controls: request %d with a penalty: tokens or logits differ from its plain run", q);
    if (sp) {
        mf_spec_stats st;
        mf_spec_get_stats(sp, &st);
        CHECK(st.rounds == 0 && st.proposed == 0, "controls: %lld rounds speculated for penalized requests",
              (long long)st.rounds);
    }
    g_freq_pen = 0;
    mf_spec_free(sp);
    free_outs(base, NR);
    free_outs(plain, NR);
    free_outs(got, NR);
}

/* Chi-square statistic of two samples' counts over categories (those with at least 5 expected in
 * both pooled to the rest) and its degrees of freedom. */
static double chi2_two(const int *a, const int *b, int n_cat, int na, int nb, int *df)
{
    double stat = 0, ra = 0, rb = 0;
    int cats = 0;
    for (int c = 0; c < n_cat; c++) {
        double t = a[c] + b[c], ea = t * na / (na + nb), eb = t * nb / (na + nb);
        if (ea < 5 || eb < 5) {
            ra += a[c], rb += b[c];
            continue;
        }
        stat += (a[c] - ea) * (a[c] - ea) / ea + (b[c] - eb) * (b[c] - eb) / eb;
        cats++;
    }
    double t = ra + rb, ea = t * na / (na + nb), eb = t * nb / (na + nb);
    if (ea >= 5 && eb >= 5) {
        stat += (ra - ea) * (ra - ea) / ea + (rb - eb) * (rb - eb) / eb;
        cats++;
    }
    *df = cats - 1;
    return stat;
}

/* The 0.1% critical value of chi-square with df degrees of freedom (Wilson-Hilferty). */
static double chi2_crit(int df)
{
    double z = 3.0902, h = 2.0 / (9.0 * df);
    return df * pow(1 - h + z * sqrt(h), 3);
}

static void check_sampling(mf_ref *r, mf_step *e)
{
    const mf_config *c = mf_ref_config(r);
    int64_t V = c->vocab_size;
    int NR = MF_TEST_SANITIZED ? 240 : NREQ, POS = 5;
    req_out *base = calloc((size_t)NR, sizeof *base), *got = calloc((size_t)NR, sizeof *got), g1[1];
    int *ca = calloc((size_t)(POS * V), sizeof *ca), *cb = calloc((size_t)(POS * V), sizeof *cb);
    alloc_outs(g1, 1, V);
    CHECK(run_batch(r, e, NULL, 1, 1, 0, 0, g1, V, 1, GEN) == 0, "greedy: %s", mf_last_error());   /* the candidates */
    for (int q = 0; q < NR; q++) got[q].truth = g1[0].tok, got[q].right = 5;
    run_ctx x = {.V = V};
    mf_spec *sp = NULL;
    CHECK(mf_spec_new(&(mf_spec_opts){.ref = r, .eng = e, .source = MF_SPEC_INJECT, .n_max = 5, .inject = inject,
                                      .inject_user = &x},
                      16, &sp) == 0, "%s", mf_last_error());
    /* every request the same prompt (prompt 0), its own seed */
    int rc = 0;
    for (int q0 = 0; q0 < NR && !rc; q0 += 16) {
        int m = NR - q0 < 16 ? NR - q0 : 16;
        for (int q = q0; q < q0 + m; q++) base[q].pos0 = got[q].pos0 = NP;
        rc = run_batch(r, e, NULL, 16, m, TEMP, 1000 + (uint64_t)q0, base + q0, V, 1, POS);
        if (!rc) rc = run_batch(r, e, sp, 16, m, TEMP, 1000 + (uint64_t)q0, got + q0, V, 1, POS);
    }
    CHECK(rc == 0, "sampling runs: %s", mf_last_error());
    mf_spec_stats st;
    mf_spec_get_stats(sp, &st);
    int worst_df = 0;
    double worst = 0, power = 0;
    for (int p = 0; p < POS && !rc; p++) {
        int df;
        memset(ca, 0, sizeof(int) * (size_t)V);
        memset(cb, 0, sizeof(int) * (size_t)V);
        for (int q = 0; q < NR; q++) ca[base[q].tok[p]]++, cb[got[q].tok[p]]++;
        double s = chi2_two(ca, cb, (int)V, NR, NR, &df);
        CHECK(df < 1 || s < chi2_crit(df), "position %d: chi-square %.1f with %d degrees of freedom, past the 0.1%% "
              "critical value %.1f", p, s, df, chi2_crit(df));
        if (df > 0 && s / chi2_crit(df) > worst) worst = s / chi2_crit(df), worst_df = df;
        /* the test's power: a rule that always accepted would give the candidates' tokens there
         * whenever the tokens before were theirs */
        memset(cb, 0, sizeof(int) * (size_t)V);
        for (int q = 0; q < NR; q++) {
            int same = 1;
            for (int i = 0; i < p; i++) same &= base[q].tok[i] == g1[0].tok[i];
            cb[same && p ? g1[0].tok[p] : base[q].tok[p]]++;
        }
        double sb = chi2_two(ca, cb, (int)V, NR, NR, &df);
        if (df >= 1 && sb / chi2_crit(df) > power) power = sb / chi2_crit(df);
    }
    CHECK(power > 1, "the always-accepting rule passes too (at most %.2f of the critical value)", power);
    printf("sampling: %d requests per side, %lld of %lld candidates accepted; worst chi-square at %.2f of its "
           "critical value (%d degrees of freedom); an always-accepting rule at %.1f of it\n", NR,
           (long long)st.accepted, (long long)st.proposed, worst, worst_df, power);
    CHECK(st.accepted > st.proposed / 10, "the injected candidates were seldom accepted (%lld of %lld): the test "
          "would not exercise the rule", (long long)st.accepted, (long long)st.proposed);
    mf_spec_free(sp);
    free_outs(base, NR);
    free_outs(got, NR);
    free_outs(g1, 1);
    free(base), free(got), free(ca), free(cb);
}

static void check_choose(void)
{
    /* a plain step 10, a verify of 1 + k 10 + 2k, a draft round 5: at acceptance 0.9 five pay
     * (5.10 / 25 over 1 / 10: 2.04x), at 0.1 none (k 1: 1.1 / 17) */
    double v[6], d[6] = {0}, hi[6], lo[6], g;
    for (int k = 0; k <= 5; k++) v[k] = 10 + 2 * k, d[k] = k ? 5 : 0, hi[k] = 0.9, lo[k] = 0.1;
    CHECK(mf_spec_choose(v, d, hi, 5, &g) == 5 && fabs(g - (1 + 0.9 + 0.81 + 0.729 + 0.6561 + 0.59049) / 25 * 10) < 1e-9,
          "choose at 0.9: gain %.4f", g);
    CHECK(mf_spec_choose(v, d, lo, 5, &g) == 0 && g == 1, "choose at 0.1");
    double zero_cost[6] = {10, 10, 10, 10, 10, 10};
    CHECK(mf_spec_choose(zero_cost, d, lo, 5, NULL) == 0, "a draft of cost 5 with acceptance 0.1 never pays");
    /* the probes' spacing: a probe of 22.5 plain steps held to a quarter of the time waits 90
     * rounds (exact in binary); a cheap one its backoff */
    CHECK(mf_spec_probe_gap(16, 4e6, 90e6, 0.25) == 90, "probe gap %d", mf_spec_probe_gap(16, 4e6, 90e6, 0.25));
    CHECK(mf_spec_probe_gap(32, 4e6, 4e6, 0.25) == 32, "a cheap probe keeps the backoff");
    CHECK(mf_spec_probe_gap(16, 1, 1e6, 0.02) == 1024 && mf_spec_probe_gap(2048, 1, 1e6, 0.02) == 2048, "at most 1024");
    CHECK(mf_spec_probe_gap(16, 0, 5, 0.02) == 16, "costs unknown: the backoff");
}

/* The draft's experts on emulated cards (mf_step_draft_cards, taken and given back by the policy:
 * mf_spec_stats.dcards_*): greedy speculation on an engine whose routed experts (the draft's
 * among them) run on 2 emulated cards gives the plain host run's tokens and logits, bit for bit:
 * 5 candidates every round (the draft's experts taken at the first round and held), then the
 * adaptive k priced on a machine where only the weights' bytes cost (it speculates while the
 * prior acceptance lasts, then settles at k 0 and gives the experts back SP_HOLD rounds later). */
static void check_cards(mf_ref *r, mf_step *host)
{
    int64_t V = mf_ref_config(r)->vocab_size;
    enum { NR = 3 };
    req_out base[NR], got[NR];
    alloc_outs(base, NR, V);
    CHECK(run_batch(r, host, NULL, NR, NR, 0, 0, base, V, 7, GEN) == 0, "plain: %s", mf_last_error());
    mf_dev *d = NULL;
    mf_step *e = NULL;
    CHECK(mf_dev_open("emu:2,bw=50e9,lat_ns=2000", &d) == 0 &&
              mf_step_new(r, &(mf_step_opts){.n_threads = 2, .draft = 1, .dev = d, .placement = MF_STEP_PLACE_SEED},
                          &e) == 0, "cards: %s", mf_last_error());
    mf_profile f = *mf_cost_default_profile();
    f.task_overhead_ns = 0;
    for (int k = 0; k < MF_KF_N; k++) f.host[k].latency_ns = 0, f.host[k].macs_per_s = 1e30;
    f.host_vec = (mf_profile_kern){.macs_per_s = 1e30};
    mf_plan_opts price = {.placement = MF_STEP_PLACE_HOST, .context = 64, .profile = &f};
    for (int adaptive = 0; adaptive < 2 && e; adaptive++) {
        mf_spec *sp = NULL;
        CHECK(mf_spec_new(&(mf_spec_opts){.ref = r, .eng = e, .source = MF_SPEC_DSPARK, .adaptive = adaptive,
                                          .price = &price}, NR, &sp) == 0, "%s", mf_last_error());
        for (int run = 0; run < 1 + 2 * adaptive && sp; run++) {
            alloc_outs(got, NR, V);
            CHECK(run_batch(r, e, sp, NR, NR, 0, 0, got, V, 7, GEN) == 0, "cards dspark: %s", mf_last_error());
            for (int q = 0; q < NR; q++)
                CHECK(got[q].n == GEN && !memcmp(got[q].tok, base[q].tok, sizeof got[q].tok) &&
                          !memcmp(got[q].logits, base[q].logits, sizeof(float) * GEN * (size_t)V),
                      "cards dspark%s, run %d: request %d's tokens or logits differ from greedy without speculation",
                      adaptive ? " auto" : "", run, q);
            free_outs(got, NR);
        }
        mf_spec_stats st = {0};
        if (sp) mf_spec_get_stats(sp, &st);
        printf("cards dspark%s: %lld rounds, %lld plain steps; the draft's experts taken %lld, given back %lld, held %d\n",
               adaptive ? " auto" : "", (long long)st.rounds, (long long)st.plain, (long long)st.dcards_takes,
               (long long)st.dcards_drops, st.dcards_held);
        CHECK(adaptive ? st.rounds > 0 && st.dcards_takes >= 1 && st.dcards_drops >= 1 && !st.dcards_held
                       : st.rounds > 0 && st.dcards_takes == 1 && st.dcards_held,
              "cards dspark%s: takes %lld, drops %lld, held %d", adaptive ? " auto" : "", (long long)st.dcards_takes,
              (long long)st.dcards_drops, st.dcards_held);
        mf_spec_free(sp);
    }
    free_outs(base, NR);
    mf_step_free(e);
    mf_dev_close(d);
}

int main(void)
{
    mf_config c;
    mf_config_preset("tiny", &c);
    char dir[1024];
    if (mf_test_gen_ckpt(&c, "spec", dir, sizeof dir)) return 1;
    mf_model *m;
    mf_ref *r;
    mf_step *e;
    if (mf_test_open(dir, 1, &m, &r, &e)) return 1;
    check_choose();
    check_greedy(r, e, "engine");
    check_cards(r, e);
    check_controls(r, e);
    check_prefix(r, e, "engine");
    if (!MF_TEST_SANITIZED) check_prefix(r, NULL, "reference");
    if (!MF_TEST_SANITIZED) check_greedy(r, NULL, "reference");
    check_sampling(r, e);
    mf_step_free(e);
    mf_ref_free(r);
    mf_model_free(m);
    return mf_check_exit("test_spec");
}
