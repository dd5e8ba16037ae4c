/* `moeflow bench decode --spec dspark|perfect`: speculative decoding against plain decoding in the
 * same run (graphs/step/spec.h, docs/dspark.md): a greedy run of the batch's synthetic prompts
 * through the batcher first (its tokens: what perfect injects, what every run must give), one
 * untimed run of each kind (the shapes built), then rounds alternating plain and speculating runs;
 * tokens/s of the decode (from the first generated token to the last), their medians and ratio,
 * and the speculation's counters (acceptance by position, tokens per target forward, the measured
 * cost of a verify over a plain step, the k chosen). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/batch.h"
#include "graphs/step/spec.h"
#include "graphs/step/step.h"
#include "sched/clock.h"
#include "sched/cost.h"
#include "sched/error.h"
#include "tools/commands.h"
#include "tools/sim_common.h"

typedef struct bs_seq {
    int32_t *tok;        /* generated tokens */
    const int32_t *truth;   /* perfect: the greedy run's */
    int n;
} bs_seq;

typedef struct bs_run {
    bs_seq *seq;
    int64_t first_ns, last_ns, tokens;
} bs_run;

static void bs_on_event(void *user, const mf_batch_event *ev)
{
    bs_run *r = user;
    bs_seq *q = ev->user;
    if (ev->kind != MF_BATCH_TOKEN) return;
    q->tok[q->n++] = ev->token;
    if (q->n == 1) {
        if (!r->first_ns || ev->now_ns < r->first_ns) r->first_ns = ev->now_ns;
    } else {
        r->tokens++;
    }
    if (ev->now_ns > r->last_ns) r->last_ns = ev->now_ns;
}

/* perfect: the greedy run's tokens after the anchor */
static int bs_inject(void *user, void *req_user, int64_t pos, int32_t anchor, int n, int32_t *cands)
{
    const mf_bench_spec_opts *o = user;
    bs_seq *q = req_user;
    (void)anchor;
    int64_t g = pos - o->n_prompt + 1;
    int m = 0;
    for (; m < n && g + m < o->steps; m++) cands[m] = q->truth[g + m];
    return m;
}

/* The process's CPU time (all threads), seconds: what a loaded machine's wall time hides. */
static double bs_cpu_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* One run of the batch through the batcher (sp NULL: plain); its decode tokens/s into *tps, its
 * generated tokens per second of the process's CPU time (prefill included) into *cps. */
static int bs_run_once(const mf_bench_spec_opts *o, mf_ref *r, mf_step *e, mf_spec *sp, bs_seq *seq, double *tps,
                       double *cps)
{
    double c0 = bs_cpu_s();
    bs_run run = {.seq = seq};
    mf_batch *b = NULL;
    int rc = mf_batch_new(&(mf_batch_opts){.ref = r, .eng = e, .max_batch = (int)o->batch,
                                           .max_context = o->n_prompt + o->steps + 1, .on_event = bs_on_event,
                                           .user = &run, .spec = sp},
                          &b);
    const mf_config *c = mf_ref_config(r);
    int32_t *p = malloc(sizeof(int32_t) * (size_t)o->n_prompt);
    if (!rc && !p) rc = mf_error(-ENOMEM, "out of memory");
    for (int s = 0; s < o->batch && !rc; s++) {
        for (int k = 0; k < o->n_prompt; k++) p[k] = (int32_t)((37LL * k + 11 + 101LL * s) % c->vocab_size);
        seq[s].n = 0;
        rc = mf_batch_submit(b, &(mf_batch_req){.prompt = p, .n_prompt = (int)o->n_prompt, .max_tokens = (int)o->steps,
                                                .ignore_eos = 1, .user = &seq[s]},
                             NULL);
    }
    while (!rc && mf_batch_wait(b, 0)) rc = mf_batch_step(b, NULL);
    mf_batch_free(b);
    free(p);
    *tps = run.last_ns > run.first_ns ? run.tokens / ((run.last_ns - run.first_ns) / 1e9) : 0;
    *cps = (run.tokens + o->batch) / (bs_cpu_s() - c0);
    return rc;
}

static int bs_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* A speculation for one run (fresh: its estimates learn within the run). */
static int bs_spec_new(const mf_bench_spec_opts *o, mf_ref *r, mf_step *e, mf_spec **sp)
{
    const mf_config *c = mf_ref_config(r);
    mf_plan_opts price = {.config = c, .profile = mf_cost_default_profile(), .placement = MF_STEP_PLACE_HOST,
                          .n_sockets = 1, .threads_per_socket = (int)o->threads, .context = o->n_prompt + o->steps / 2};
    int perfect = o->spec == MF_TOOL_SPEC_PERFECT;
    return mf_spec_new(&(mf_spec_opts){.ref = r, .eng = e, .source = perfect ? MF_SPEC_INJECT : MF_SPEC_DSPARK,
                                       .n_max = o->spec_tokens ? (int)o->spec_tokens : c->dspark_block_size,
                                       .adaptive = !o->spec_tokens, .price = &price, .inject = bs_inject,
                                       .inject_user = (void *)o},
                       (int)o->batch, sp);
}

int mf_bench_decode_spec(const mf_bench_spec_opts *o)
{
    mf_model *m = NULL;
    mf_ref *r = NULL;
    mf_step *e = NULL;
    int dspark = o->spec == MF_TOOL_SPEC_DSPARK, rc, B = (int)o->batch, same = 1;
    rc = mf_model_load(o->dir, &(mf_model_opts){.quiet = 1, .resident_limit_bytes = UINT64_C(64) << 30,
                                                .load_draft = dspark},
                       &m);
    if (!rc) rc = mf_ref_new(m, NULL, &r);
    if (!rc) rc = mf_step_new(r, &(mf_step_opts){.n_threads = (int)o->threads, .exact = o->exact, .draft = dspark}, &e);
    bs_seq *base = calloc((size_t)B, sizeof *base), *got = calloc((size_t)B, sizeof *got);
    double *ta = calloc((size_t)o->rounds, sizeof *ta), *tb = calloc((size_t)o->rounds, sizeof *tb), t, ct;
    double *ca = calloc((size_t)o->rounds, sizeof *ca), *cb = calloc((size_t)o->rounds, sizeof *cb);
    for (int s = 0; !rc && s < B; s++) {
        base[s].tok = malloc(sizeof(int32_t) * (size_t)o->steps);
        got[s].tok = malloc(sizeof(int32_t) * (size_t)o->steps);
        if (!base[s].tok || !got[s].tok) rc = mf_error(-ENOMEM, "out of memory");
        got[s].truth = base[s].tok;
    }
    if (!rc) rc = bs_run_once(o, r, e, NULL, base, &t, &ct);   /* the greedy tokens; the plain shapes built */
    mf_spec *sp = NULL;
    mf_spec_stats st = {0};
    if (!rc && !(rc = bs_spec_new(o, r, e, &sp))) rc = bs_run_once(o, r, e, sp, got, &t, &ct);   /* the verify shapes */
    mf_spec_free(sp);
    sp = NULL;
    for (int k = 0; k < o->rounds && !rc; k++) {   /* alternating: plain, then speculating */
        rc = bs_run_once(o, r, e, NULL, got, &ta[k], &ca[k]);
        if (!rc) rc = bs_spec_new(o, r, e, &sp);
        if (!rc) rc = bs_run_once(o, r, e, sp, got, &tb[k], &cb[k]);
        for (int s = 0; !rc && s < B; s++) same &= got[s].n == o->steps && !memcmp(got[s].tok, base[s].tok, sizeof(int32_t) * (size_t)o->steps);
        if (sp) mf_spec_get_stats(sp, &st);
        mf_spec_free(sp);
        sp = NULL;
    }
    if (!rc) {
        qsort(ta, (size_t)o->rounds, sizeof *ta, bs_cmp);
        qsort(tb, (size_t)o->rounds, sizeof *tb, bs_cmp);
        qsort(ca, (size_t)o->rounds, sizeof *ca, bs_cmp);
        qsort(cb, (size_t)o->rounds, sizeof *cb, bs_cmp);
        double a = ta[o->rounds / 2], b = tb[o->rounds / 2], xa = ca[o->rounds / 2], xb = cb[o->rounds / 2];
        /* a target forward's time over a plain step's: tokens per forward x plain / speculating rate */
        int64_t fw = st.rounds + st.plain;
        double tpf = fw ? (double)(st.tokens + st.plain) / fw : 1, vcost = tpf * a / b;
        const char *src = dspark ? "dspark" : "perfect";
        if (o->json) {
            printf("{\"spec\":\"%s\",\"spec_tokens\":%ld,\"batch\":%d,\"steps\":%ld,\"prompt_tokens\":%ld,\"threads\":%ld,"
                   "\"rounds\":%ld,\"plain_tokens_per_s\":%.6g,\"spec_tokens_per_s\":%.6g,\"speedup\":%.6g,"
                   "\"plain_tokens_per_cpu_s\":%.6g,\"spec_tokens_per_cpu_s\":%.6g,\"speedup_cpu\":%.6g,"
                   "\"forward_cost_over_plain\":%.6g,\"same_tokens\":%s", src, o->spec_tokens, B, o->steps, o->n_prompt,
                   o->threads, o->rounds, a, b, b / a, xa, xb, xb / xa, vcost, same ? "true" : "false");
            mf_tool_spec_json(stdout, &st);
            printf("}\n");
        } else {
            printf("bench decode --spec %s (%s): %s, batch %d, %ld-token prompt, %ld tokens, %ld threads, %ld rounds "
                   "alternating\ndecode tokens/s (median): plain %.2f, speculating %.2f: %.3fx; greedy tokens %s\n"
                   "tokens per second of process CPU time (median, prefill included): plain %.2f, speculating %.2f: "
                   "%.3fx\na target forward of the speculating runs took %.2f plain steps (measured)\n",
                   src, o->spec_tokens ? "fixed k" : "auto", o->dir, B, o->n_prompt, o->steps, o->threads, o->rounds, a,
                   b, b / a, same ? "the same" : "DIFFER", xa, xb, xb / xa, vcost);
            mf_tool_spec_line(stdout, "last speculating run", &st);
        }
        if (!same) rc = mf_error(-EIO, "bench decode --spec: speculation changed greedy tokens");
    }
    for (int s = 0; s < B && base && got; s++) free(base[s].tok), free(got[s].tok);
    free(base), free(got), free(ta), free(tb), free(ca), free(cb);
    mf_step_free(e);
    mf_ref_free(r);
    mf_model_free(m);
    return rc;
}
