/* The pipeline split by layers (graphs/pipe/pipe.h) inside one process: each rank a thread with its
 * own model of its layers, engine and states, joined by an in-process link (tests/link_mem.h);
 * the logits of rank 0's forwards against one engine over the whole model, bit for bit (memcmp):
 * tiny on 2 ranks (two splits) and 3 ranks, one to three micro-batches, prefill of several
 * sequences in one forward and batched greedy decode; demo on 2 ranks where
 * ~/.cache/moeflow/demo exists (normal build). Also: the cuts (mf_config_cut_ok on tiny and
 * flash41), split parsing and its refusals, `auto` against every split, a model loaded for a
 * range that is no cut refused, and a failing rank ending rank 0's forward with its message.
 * The same over Open MPI with separate processes: tests/py/check_mpi.py. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "device/dev.h"
#include "graphs/model/config.h"
#include "graphs/model/model.h"
#include "graphs/pipe/pipe.h"
#include "graphs/ref/ref.h"
#include "graphs/step/step.h"
#include "graphs/step/stepgraph.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/link_mem.h"
#include "tests/tiny_ckpt.h"

#define MAX_SEQ 8
#define MAX_DEC 6

typedef struct rank_ctx {
    const char *dir;
    mf_lmem_hub *hub;
    int rank, micro, fail;   /* fail: this follower fails at once (mf_pipe_fail) */
    int cards, dsplit;       /* cards > 0: emu:cards, dense work and routed experts on them, split by dsplit */
    mf_dev *dev;
    mf_pipe_split split;
    mf_model *m;
    mf_ref *r;
    mf_step *e;
    mf_pipe *p;
    int rc;
    char err[MF_ERROR_MSG_BYTES];
} rank_ctx;

/* Rank x->rank's model of its layers, forward, pipe and engine. */
static int stage_open(rank_ctx *x)
{
    const mf_link_ops *l = &x->hub->ops[x->rank];
    mf_model_opts mo = {.quiet = 1, .resident_limit_bytes = UINT64_C(64) << 30,
                        .layer_begin = x->split.bound[x->rank], .layer_end = x->split.bound[x->rank + 1]};
    int rc = mf_model_load(x->dir, &mo, &x->m);
    if (!rc) rc = mf_ref_new(x->m, NULL, &x->r);
    if (!rc) rc = mf_pipe_new(mf_model_config(x->m), &(mf_pipe_opts){.link = l, .split = x->split, .micro = x->micro,
                                                                       .step_timeout_ns = 120000000000LL}, &x->p);
    char spec[32];
    snprintf(spec, sizeof spec, "emu:%d", x->cards);
    if (!rc && x->cards) rc = mf_dev_open(spec, &x->dev);
    if (!rc)
        rc = mf_step_new(x->r, &(mf_step_opts){.n_threads = 1, .link = mf_pipe_step_link(x->p), .dev = x->dev,
                                               .placement = x->cards ? MF_STEP_PLACE_HYBRID : MF_STEP_PLACE_HOST,
                                               .dense = x->cards ? MF_STEP_DENSE_CARDS : MF_STEP_DENSE_HOST,
                                               .dense_split = x->dsplit, .dev_cache_fill = x->cards > 0},
                         &x->e);
    if (!rc) mf_pipe_attach(x->p, x->r, x->e);
    return rc;
}

static void stage_close(rank_ctx *x)
{
    mf_step_free(x->e);
    mf_dev_close(x->dev);
    mf_pipe_free(x->p);
    mf_ref_free(x->r);
    mf_model_free(x->m);
}

static void *follower(void *arg)
{
    rank_ctx *x = arg;
    x->rc = stage_open(x);
    if (x->rc) x->hub->ops[x->rank].fail(x->hub->ops[x->rank].ctx, mf_last_error());
    else if (x->fail) {
        mf_pipe_fail(x->p, "rank 1: injected failure");
        x->rc = -EPIPE;
    } else {
        x->rc = mf_pipe_follow(x->p);
    }
    if (x->rc) snprintf(x->err, sizeof x->err, "%s", mf_last_error());
    stage_close(x);
    return NULL;
}

typedef int (*fwd_fn)(void *ctx, mf_ref_state *const *states, const int32_t *tokens, int n, float *const *logits);

static int step_fwd(void *ctx, mf_ref_state *const *states, const int32_t *tokens, int n, float *const *logits)
{
    return mf_step_forward(ctx, states, tokens, n, logits);
}

static int32_t prompt_tok(int s, int i, int V) { return (int32_t)((s * 131 + i * 37 + 5) % (V - 3)) + 1; }

/* The workload: n_seq prompts of 3 + s tokens prefilled in one forward (the logits of each one's
 * last position), then n_dec batched decode steps of toks (teacher-forced; with fill, toks are
 * written first: greedy from the logits). out: n_seq x (1 + n_dec) x V. */
static int run_work(fwd_fn f, void *ctx, mf_ref *r, int64_t V, int n_seq, int n_dec, int32_t *toks, int fill,
                    float *out)
{
    mf_ref_state *st[MAX_SEQ] = {0};
    mf_ref_state *ist[MAX_SEQ * 16] = {0};
    int32_t itok[MAX_SEQ * 16] = {0};
    float *lg[MAX_SEQ * 16] = {0};
    int n = 0, rc = 0, nl = 1 + n_dec;
    for (int s = 0; s < n_seq && !rc; s++) {
        rc = mf_ref_state_new(r, 3 + s + n_dec + 1, &st[s]);
        for (int i = 0; i < 3 + s; i++) {
            ist[n] = st[s];
            itok[n] = prompt_tok(s, i, (int)V);
            lg[n++] = i == 2 + s ? out + (size_t)s * nl * V : NULL;
        }
    }
    if (!rc) rc = f(ctx, ist, itok, n, lg);
    for (int k = 0; k < n_dec && !rc; k++) {
        for (int s = 0; s < n_seq; s++) {
            const float *prev = out + ((size_t)s * nl + k) * V;
            if (fill) {
                int best = 0;
                for (int v = 1; v < V; v++) best = prev[v] > prev[best] ? v : best;
                toks[k * n_seq + s] = best;
            }
            ist[s] = st[s];
            itok[s] = toks[k * n_seq + s];
            lg[s] = out + ((size_t)s * nl + k + 1) * V;
        }
        rc = f(ctx, ist, itok, n_seq, lg);
    }
    for (int s = 0; s < n_seq; s++) mf_ref_state_free(st[s]);
    return rc;
}

/* The whole model's logits of the workload (greedy tokens into toks). */
static int run_whole(const char *dir, int n_seq, int n_dec, int32_t *toks, float *out)
{
    mf_model *m = NULL;
    mf_ref *r = NULL;
    mf_step *e = NULL;
    int rc = mf_model_load(dir, &(mf_model_opts){.quiet = 1, .resident_limit_bytes = UINT64_C(64) << 30}, &m);
    if (!rc) rc = mf_ref_new(m, NULL, &r);
    if (!rc) rc = mf_step_new(r, &(mf_step_opts){.n_threads = 1}, &e);
    if (!rc) rc = run_work(step_fwd, e, r, mf_model_config(m)->vocab_size, n_seq, n_dec, toks, 1, out);
    mf_step_free(e);
    mf_ref_free(r);
    mf_model_free(m);
    return rc;
}

/* The workload over a pipeline of split.n_ranks threads with `micro` micro-batches against want. */
static void run_pipe(const char *dir, const char *spec, int micro, int cards, int dsplit, int n_seq, int n_dec,
                     const int32_t *toks, const float *want, int64_t V)
{
    mf_config c;
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (mf_config_load(path, &c)) {
        CHECK(0, "%s", mf_last_error());
        return;
    }
    int n_ranks = 1;
    for (const char *q = spec; *q; q++) n_ranks += *q == ',';
    rank_ctx x[MF_PIPE_MAX_RANKS] = {0};
    mf_pipe_split split;
    int rc = mf_pipe_split_parse(&c, spec, n_ranks, &split);
    CHECK(!rc, "split %s: %s", spec, mf_last_error());
    mf_lmem_hub *hub = mf_lmem_new(n_ranks);
    pthread_t th[MF_PIPE_MAX_RANKS];
    for (int k = 0; k < n_ranks; k++) {
        x[k] = (rank_ctx){.dir = dir, .hub = hub, .rank = k, .micro = micro, .split = split, .cards = cards,
                          .dsplit = dsplit};
        if (k) pthread_create(&th[k], NULL, follower, &x[k]);
    }
    size_t nl = 1 + (size_t)n_dec;
    float *got = calloc((size_t)n_seq * nl * (size_t)V, sizeof *got);
    int32_t tk[MAX_SEQ * MAX_DEC];
    memcpy(tk, toks, sizeof tk);
    if (!rc) rc = stage_open(&x[0]);
    if (!rc) rc = run_work(mf_pipe_forward, x[0].p, x[0].r, V, n_seq, n_dec, tk, 0, got);
    CHECK(!rc, "%s micro %d: %s", spec, micro, mf_last_error());
    if (!rc) CHECK(!mf_pipe_stop(x[0].p), "stop: %s", mf_last_error());
    else mf_pipe_fail(x[0].p, "rank 0 failed");
    for (int k = 1; k < n_ranks; k++) {
        pthread_join(th[k], NULL);
        CHECK(!x[k].rc || rc, "%s: rank %d: %s", spec, k, x[k].err);
    }
    if (!rc) {
        mf_pipe_stats st;
        mf_pipe_stats_get(x[0].p, &st);
        CHECK(st.n_logits >= 1 + n_dec, "%s: %lld logits messages", spec, (long long)st.n_logits);
        size_t bad = 0;
        for (size_t i = 0; i < (size_t)n_seq * nl; i++)
            bad += memcmp(got + i * V, want + i * V, sizeof(float) * (size_t)V) != 0;
        CHECK(bad == 0, "%s micro %d: %zu of %zu logits rows differ from the whole model's", spec, micro, bad,
              (size_t)n_seq * nl);
        CHECK(mf_lmem_left(hub) == 0, "%s: %d messages left unread", spec, mf_lmem_left(hub));
        printf("  %s, %d micro-batches, %d sequences%s: %zu logits rows identical\n", spec, micro, n_seq,
               !cards ? "" : dsplit ? ", emu:2 per rank (dense by rows, hybrid)" : ", emu:2 per rank (dense by layers, hybrid)",
               (size_t)n_seq * nl);
    }
    stage_close(&x[0]);
    mf_lmem_free(hub);
    free(got);
}

/* A follower that fails: rank 0's forward ends with its message. */
static void test_fail(const char *dir)
{
    mf_config c;
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (mf_config_load(path, &c)) {
        CHECK(0, "%s", mf_last_error());
        return;
    }
    mf_pipe_split split;
    CHECK(!mf_pipe_split_parse(&c, "0:4,4:8", 2, &split), "%s", mf_last_error());
    mf_lmem_hub *hub = mf_lmem_new(2);
    rank_ctx x[2] = {{.dir = dir, .hub = hub, .rank = 0, .split = split},
                     {.dir = dir, .hub = hub, .rank = 1, .split = split, .fail = 1}};
    pthread_t th;
    pthread_create(&th, NULL, follower, &x[1]);
    int rc = stage_open(&x[0]);
    float lg[512];
    mf_ref_state *st = NULL;
    if (!rc) rc = mf_ref_state_new(x[0].r, 8, &st);
    int32_t tok = 7;
    float *lp = lg;
    if (!rc) rc = mf_pipe_forward(x[0].p, &st, &tok, 1, &lp);
    CHECK(rc == -EPIPE && strstr(mf_last_error(), "injected"), "a failing rank 1: rc %d, '%s'", rc, mf_last_error());
    pthread_join(th, NULL);
    mf_ref_state_free(st);
    stage_close(&x[0]);
    mf_lmem_free(hub);
}

/* The slowest rank's cost-model time of split b (n ranks) of config c. */
static double slowest(const mf_config *c, const int *b, int n, const double *ns)
{
    double worst = 0;
    for (int k = 0; k < n; k++) {
        double t = (k == 0 ? ns[c->n_layers] : 0) + (k == n - 1 ? ns[c->n_layers + 1] : 0);
        for (int L = b[k]; L < b[k + 1]; L++) t += ns[L];
        worst = t > worst ? t : worst;
    }
    return worst;
}

/* The cuts of tiny and flash41, split parsing, `auto` against every 2- and 3-rank split. */
static void test_cuts(void)
{
    mf_config c;
    mf_config_preset("tiny", &c);
    int want_tiny[8] = {1, 1, 1, 0, 1, 0, 0, 0};
    for (int L = 0; L < 8; L++) CHECK(mf_config_cut_ok(&c, L) == want_tiny[L], "tiny: cut at %d", L);
    mf_pipe_split s;
    CHECK(!mf_pipe_split_parse(&c, "0:2,2:8", 2, &s) && s.bound[1] == 2 && s.bound[2] == 8, "0:2,2:8");
    CHECK(mf_pipe_split_parse(&c, "0:3,3:8", 2, &s) == -EINVAL && strstr(mf_last_error(), "layer 3"),
          "a range beginning inside a KV group: %s", mf_last_error());
    CHECK(mf_pipe_split_parse(&c, "0:2,2:7", 2, &s) == -EINVAL, "ranges short of the last layer");
    CHECK(mf_pipe_split_parse(&c, "0:2,3:8", 2, &s) == -EINVAL, "a gap");
    CHECK(mf_pipe_split_parse(&c, "0:2,2:4,4:8", 2, &s) == -EINVAL, "more ranges than ranks");
    mf_config f;
    mf_config_preset("flash41", &f);
    char cuts[128] = "";
    for (int L = 0; L < f.n_layers; L++)
        if (mf_config_cut_ok(&f, L)) snprintf(cuts + strlen(cuts), sizeof cuts - strlen(cuts), "%d ", L);
    CHECK(!strcmp(cuts, "0 1 2 8 14 20 "), "flash41's cuts: %s", cuts);
    double bytes[MF_CONFIG_MAX_LAYERS + 2], ns[MF_CONFIG_MAX_LAYERS + 2];
    CHECK(!mf_pipe_layer_costs(&f, NULL, 4, bytes, ns), "%s", mf_last_error());
    int pos[6] = {0, 1, 2, 8, 14, 20};
    for (int n = 2; n <= 3; n++) {
        mf_pipe_split a;
        CHECK(!mf_pipe_split_auto(&f, bytes, ns, n, 0, &a), "%s", mf_last_error());
        double best = 1e300, got = slowest(&f, a.bound, n, ns);   /* auto's slowest rank against every split's */
        for (int i = 1; i < 6; i++)
            for (int j = i + 1; j <= (n == 3 ? 5 : i + 1); j++) {
                int b[4] = {0, pos[i], n == 3 ? pos[j] : 40, 40};
                double w = slowest(&f, b, n, ns);
                best = w < best ? w : best;
            }
        char str[64];
        mf_pipe_split_str(&a, str, sizeof str);
        CHECK(got <= best * (1 + 1e-12), "flash41 auto on %d ranks (%s): slowest rank %.0f ns, a split has %.0f", n,
              str, got, best);
        printf("  flash41 auto on %d ranks: %s\n", n, str);
    }
}

int main(void)
{
    test_cuts();
    mf_config c;
    mf_config_preset("tiny", &c);
    char dir[4096];
    if (mf_test_gen_ckpt(&c, "step_pipe_tiny", dir, sizeof dir)) return 1;
    CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1, .layer_begin = 3, .layer_end = 8}, &(mf_model *){0}) ==
              -EINVAL && strstr(mf_last_error(), "layer 3"), "a model of layers 3..7 (no cut): %s", mf_last_error());
    int64_t V = c.vocab_size;
    int n_seq = MF_TEST_SANITIZED ? 3 : 4, n_dec = MF_TEST_SANITIZED ? 3 : MAX_DEC;
    float *want = calloc((size_t)n_seq * (1 + n_dec) * (size_t)V, sizeof *want);
    int32_t toks[MAX_SEQ * MAX_DEC] = {0};
    int rc = run_whole(dir, n_seq, n_dec, toks, want);
    CHECK(!rc, "whole model: %s", mf_last_error());
    if (!rc) {
        run_pipe(dir, "0:4,4:8", 1, 0, 0, n_seq, n_dec, toks, want, V);
        run_pipe(dir, "0:2,2:8", 2, 0, 0, n_seq, n_dec, toks, want, V);
        run_pipe(dir, "0:1,1:4,4:8", 3, 0, 0, n_seq, n_dec, toks, want, V);
        run_pipe(dir, "0:2,2:8", 2, 2, MF_SG_SPLIT_ROWS, n_seq, n_dec, toks, want, V);
        if (!MF_TEST_SANITIZED) {
            run_pipe(dir, "0:2,2:4,4:8", 2, 0, 0, n_seq, n_dec, toks, want, V);
            run_pipe(dir, "0:2,2:8", 1, 2, MF_SG_SPLIT_LAYERS, n_seq, n_dec, toks, want, V);
        }
    }
    free(want);
    test_fail(dir);
    const char *home = getenv("HOME");
    char demo[4200];
    snprintf(demo, sizeof demo, "%s/.cache/moeflow/demo", home ? home : "/root");
    if (!MF_TEST_SANITIZED && access(demo, R_OK) == 0) {
        mf_config d;
        char cp[4300];
        snprintf(cp, sizeof cp, "%s/config.json", demo);
        if (!mf_config_load(cp, &d)) {
            float *w = calloc((size_t)3 * 3 * (size_t)d.vocab_size, sizeof *w);
            int32_t t[MAX_SEQ * MAX_DEC] = {0};
            rc = run_whole(demo, 3, 2, t, w);
            CHECK(!rc, "demo whole: %s", mf_last_error());
            if (!rc) run_pipe(demo, "0:4,4:8", 2, 0, 0, 3, 2, t, w, d.vocab_size);
            free(w);
        }
    } else {
        printf("  demo: skipped (%s)\n", MF_TEST_SANITIZED ? "sanitized build" : "no ~/.cache/moeflow/demo");
    }
    return mf_check_exit("test_step_pipe");
}
