/* `moeflow bench echo`: what echo's prompt logprobs cost (docs/serve.md "Logprobs"): one prompt
 * through the batcher as a prefill (max_tokens 0), alternately plain and with echo logprobs (every
 * position's logits from the head, each row's log-softmax and top alternative), the same chunks;
 * the median times and their ratio. */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/batch.h"
#include "graphs/step/step.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "tools/commands.h"

typedef struct mf_be_cli {
    const char *dir;
    long prompt, runs, threads, step_tokens;
} mf_be_cli;

#define F(x) offsetof(mf_be_cli, x)
static const mf_opt mf_be_table[] = {
    {"--checkpoint", .kind = MF_OPT_STR, .off = F(dir), .meta = "DIR", .help = "the model"},
    {"--prompt-tokens", .kind = MF_OPT_LONG, .off = F(prompt), .def = "512", .meta = "N", .lo = 2, .hi = 1 << 16,
     .help = "the prompt's length"},
    {"--runs", .kind = MF_OPT_LONG, .off = F(runs), .def = "5", .meta = "N", .lo = 1, .hi = 1000,
     .help = "timed runs of each kind, alternating"},
    {"--step-tokens", .kind = MF_OPT_LONG, .off = F(step_tokens), .def = "64", .meta = "N", .lo = 1, .hi = 1 << 16,
     .help = "the batcher's items per step (echo rows: up to 64)"},
    {"--threads", .kind = MF_OPT_LONG, .off = F(threads), .meta = "N", .lo = 1, .hi = 256,
     .help = "scheduled engine workers (default: the online CPUs)"},
    {NULL},
};
#undef F

static const mf_opts_spec mf_be_spec = {
    .cmd = "bench echo",
    .usage = "usage: moeflow bench echo --checkpoint DIR [--prompt-tokens N] [--runs N] [--step-tokens N]\n"
             "                          [--threads N]\n\n"
             "One prompt of N tokens prefilled through the batcher (max_tokens 0), plain and with\n"
             "echo logprobs (logprobs 1: the prompt tokens' logprobs and top alternative), one\n"
             "untimed run of each, then --runs of each alternating. Prints the median seconds of\n"
             "each and echo / plain.\n\n",
    .opts = mf_be_table,
    .col = 26,
};

static void mf_be_event(void *user, const mf_batch_event *ev)
{
    if (ev->kind == MF_BATCH_DONE) *(int *)user = 1;
}

static int mf_be_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* One request alone: its seconds from submission to its end, and the multiply-adds of its forwards
 * (the step graphs' records: the head only over the items that ask logits). */
static int mf_be_once(mf_batch *b, mf_step *e, const int32_t *p, int n, int echo, int *done, double *sec, double *macs)
{
    *done = 0;
    *macs = 0;
    int64_t t0 = mf_now_ns();
    int rc = mf_batch_submit(b, &(mf_batch_req){.prompt = p, .n_prompt = n, .max_tokens = 0, .logprobs = echo,
                                                .top_logprobs = echo, .echo_logprobs = echo}, NULL);
    while (!rc && !*done) {
        int items = 0;
        rc = mf_batch_step(b, &items);
        mf_step_times t;
        mf_step_last_times(e, &t);
        if (items) *macs += t.macs;
    }
    *sec = (mf_now_ns() - t0) / 1e9;
    return rc;
}

int mf_bench_echo(int argc, char **argv)
{
    mf_be_cli a = {.threads = sysconf(_SC_NPROCESSORS_ONLN)};
    int rc = mf_opts_parse(&mf_be_spec, argc, argv, &a);
    if (rc != MF_OPTS_RUN) return rc;
    if (!a.dir) return mf_opts_refuse(&mf_be_spec, "--checkpoint DIR is required");
    mf_model *m = NULL;
    mf_ref *r = NULL;
    mf_step *e = NULL;
    mf_batch *b = NULL;
    int done = 0, n = (int)a.prompt;
    int32_t *p = malloc(sizeof *p * (size_t)n);
    double *t[2] = {malloc(sizeof(double) * (size_t)a.runs), malloc(sizeof(double) * (size_t)a.runs)};
    rc = p && t[0] && t[1] ? 0 : mf_error(-ENOMEM, "out of memory");
    if (!rc) rc = mf_model_load(a.dir, &(mf_model_opts){.quiet = 1, .resident_limit_bytes = UINT64_C(64) << 30}, &m);
    if (!rc) rc = mf_ref_new(m, NULL, &r);
    if (!rc) rc = mf_step_new(r, &(mf_step_opts){.n_threads = (int)a.threads}, &e);
    if (!rc) {
        const mf_config *c = mf_model_config(m);
        for (int i = 0; i < n; i++) p[i] = (int32_t)((37 * i + 11) % c->vocab_size);
        int rows = a.step_tokens < MF_STEP_MAX_ITEMS ? (int)a.step_tokens : MF_STEP_MAX_ITEMS;
        rc = mf_batch_new(&(mf_batch_opts){.ref = r, .eng = e, .max_batch = 1, .step_tokens = (int)a.step_tokens,
                                           .max_context = n + 1, .echo_rows = rows, .on_event = mf_be_event,
                                           .user = &done}, &b);
    }
    double sec, macs[2] = {0, 0};
    for (int k = 0; k < 2 && !rc; k++) rc = mf_be_once(b, e, p, n, k, &done, &sec, &macs[k]);   /* graphs built untimed */
    for (int i = 0; i < a.runs && !rc; i++)
        for (int k = 0; k < 2 && !rc; k++)
            rc = mf_be_once(b, e, p, n, (i + k) % 2, &done, &t[(i + k) % 2][i], &macs[(i + k) % 2]);
    if (!rc) {
        qsort(t[0], (size_t)a.runs, sizeof(double), mf_be_cmp);
        qsort(t[1], (size_t)a.runs, sizeof(double), mf_be_cmp);
        double m0 = t[0][a.runs / 2], m1 = t[1][a.runs / 2];
        printf("bench echo: %s, a prompt of %d tokens, step budget %ld, %ld threads, %ld runs each\n"
               "prefill             %.3f s (median; %.3f-%.3f)\necho logprobs       %.3f s (median; %.3f-%.3f)\n"
               "echo / prefill      %.3fx\nmultiply-adds       prefill %.2f G, echo %.2f G (%.3fx: the head over every "
               "position)\n", a.dir, n, a.step_tokens, a.threads, a.runs, m0, t[0][0], t[0][a.runs - 1], m1, t[1][0],
               t[1][a.runs - 1], m1 / m0, macs[0] / 1e9, macs[1] / 1e9, macs[1] / macs[0]);
    }
    if (rc) fprintf(stderr, "moeflow bench echo: %s\n", mf_last_error()[0] ? mf_last_error() : "out of memory");
    mf_batch_free(b);
    mf_step_free(e);
    mf_ref_free(r);
    mf_model_free(m);
    free(p);
    free(t[0]);
    free(t[1]);
    return rc ? 1 : 0;
}
