/* Continuous batching (graphs/step/batch.h) on the tiny preset: every request's logits and tokens are
 * bit-identical to decoding it alone on a fresh state (greedy and seeded sampling), whatever its
 * neighbours, its join step and the token budget (chunked prefill mixed with decode, reused
 * states); the reference forward likewise; stop strings, EOS, cancel, queue and budget refusals;
 * submission and cancel from other threads (run under TSan in CI at this size). */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/step/batch.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/sample.h"
#include "graphs/step/step.h"
#include "host/tokenizer.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/cli.h"
#include "tests/tiny_ckpt.h"


#define N_REQ 8
#define MAX_GEN 12
#define CTX 96

static int64_t g_V;
static mf_tok *g_tok;

struct solo {
    int n_prompt, n_gen;
    int32_t prompt[64], gen[MAX_GEN];
    float *logits;   /* n_gen x V: the logits each generated token was sampled from */
    int eos;
};

typedef struct solo solo;
static int run_solo(mf_ref *r, mf_step *e, solo *s, int max_gen, double temp, double top_p, uint64_t seed,
                    int ignore_eos);

/* `moeflow decode --prompts` with more lines than one batch (70 > 64), 4 at a time, under a budget
 * of 8 items: every line's tokens equal its solo run; --output has one object per line. */
static void test_cli(mf_ref *r, mf_step *e, const char *dir)
{
    if (!getenv("MOEFLOW_BIN")) {
        printf("test_batch: MOEFLOW_BIN unset, CLI checks skipped\n");
        return;
    }
    char ids[1100], cmd[8192], pf[1200], of[1200];
    snprintf(ids, sizeof ids, "%s_ids", dir);   /* the same weights without a tokenizer: token ids */
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s' && rm '%s/tokenizer.json'", ids, dir, ids, ids);
    CHECK(system(cmd) == 0, "copy %s", dir);
    snprintf(pf, sizeof pf, "%s/prompts.txt", ids);
    snprintf(of, sizeof of, "%s/out.jsonl", ids);
    enum { N = 70, G = 3 };
    static solo s[N];
    static char want[65536], out[65536];
    FILE *f = fopen(pf, "w");
    int w = 0;
    for (int q = 0; q < N && f; q++) {
        s[q].n_prompt = 1 + q % 6;
        for (int i = 0; i < s[q].n_prompt; i++) {
            s[q].prompt[i] = (int32_t)((q * 7 + i * 13 + 2) % g_V);
            fprintf(f, i ? " %d" : "%d", s[q].prompt[i]);
        }
        fprintf(f, "\n");
        s[q].logits = malloc(sizeof(float) * G * g_V);
        CHECK(run_solo(r, e, &s[q], G, 0, 1, 0, 1) == 0, "solo %d", q);
        w += snprintf(want + w, sizeof want - w, "[%d] %d %d %d\n", q, s[q].gen[0], s[q].gen[1], s[q].gen[2]);
        free(s[q].logits);
    }
    if (f) fclose(f);
    snprintf(cmd, sizeof cmd, "decode --checkpoint %s --prompts %s --batch 4 --step-tokens 8 --max-new-tokens %d "
             "--ignore-eos --threads 2 --quiet --output %s", ids, pf, G, of);
    CHECK(mf_test_cli(cmd, out, sizeof out) == 0 && !strcmp(out, want), "decode --prompts of %d lines:\n%s\nwant\n%s", N,
          out, want);
    f = fopen(of, "r");
    int lines = 0, ok = 0;
    char line[4096];
    while (f && fgets(line, sizeof line, f)) {
        lines++;
        int idx = -1;
        char *p = strstr(line, "\"index\":");
        if (p) idx = atoi(p + 8);
        char tk[128];
        if (idx >= 0 && idx < N) {
            snprintf(tk, sizeof tk, "\"tokens\":[%d,%d,%d]", s[idx].gen[0], s[idx].gen[1], s[idx].gen[2]);
            ok += strstr(line, tk) && strstr(line, "\"finish_reason\":\"length\"") && strstr(line, "\"first_token_s\":");
        }
    }
    if (f) fclose(f);
    CHECK(lines == N && ok == N, "--output: %d lines, %d as expected", lines, ok);
    /* the progress line and the summary on stderr */
    snprintf(cmd, sizeof cmd, "decode --checkpoint %s --prompts %s --batch 8 --max-new-tokens 2 --threads 2 "
             "2>&1 >/dev/null", ids, pf);
    CHECK(mf_test_cli(cmd, out, sizeof out) == 0 && strstr(out, "70/70 done") && strstr(out, "tokens/s aggregate"),
          "progress: '%s'", out);
    /* bench serve: both modes, the ratio line, the JSON */
    snprintf(cmd, sizeof cmd, "bench serve --checkpoint %s --requests 4 --concurrency 2 --prompt-tokens 3-9 "
             "--output-tokens 2-4 --warmup 0 --threads 2 --json", ids);
    CHECK(mf_test_cli(cmd, out, sizeof out) == 0 && strstr(out, "\"mode\":\"continuous\",\"concurrency\":2") &&
          strstr(out, "\"mode\":\"static\"") && strstr(out, "\"itl_p99_s\":"), "bench serve --json: '%s'", out);
    {   /* both modes prefill the same prompt tokens; static's prefills carry no decode items */
        const char *st = strstr(out, "\"mode\":\"static\"");
        long pc = -1, ps = -1, dc = -1, ds = -1;
        const char *a = strstr(out, "\"prefill_items\":"), *b = st ? strstr(st, "\"prefill_items\":") : NULL;
        const char *c = strstr(out, "\"prefill_forward_decode_items\":"), *d = st ? strstr(st, "\"prefill_forward_decode_items\":") : NULL;
        if (a && b && c && d && a < st && c < st) {
            pc = atol(a + 16), ps = atol(b + 16), dc = atol(c + 31), ds = atol(d + 31);
        }
        CHECK(pc > 0 && pc == ps && dc >= 0 && ds == 0 && strstr(out, "\"prefill_forward_cpu_s\":"),
              "bench serve --json prefill accounting: %ld %ld %ld %ld in '%s'", pc, ps, dc, ds, out);
    }
    snprintf(cmd, sizeof cmd, "bench serve --checkpoint %s --requests 3 --concurrency 1,3 --prompt-tokens 2-5 "
             "--output-tokens 2-3 --warmup 0 --threads 2", ids);
    CHECK(mf_test_cli(cmd, out, sizeof out) == 0 && strstr(out, "ratio           3"), "bench serve: '%s'", out);
    /* --max-new-tokens 0: prefill only, empty lines out */
    snprintf(cmd, sizeof cmd, "decode --checkpoint %s --tokens 1,2,3 --batch 2 --max-new-tokens 0 --quiet", ids);
    CHECK(mf_test_cli(cmd, out, sizeof out) == 0 && !strcmp(out, "[0] \n[1] \n"), "max-new-tokens 0: '%s'", out);
}


typedef struct got {
    int n_gen, done, finish, n_bad_logits, first_bad;
    int32_t gen[MAX_GEN + 4];
    double worst;
    char text[4096];
    size_t n_text;
    int events_after_done;
} got;

static void prompt_of(int q, solo *s)
{
    s->n_prompt = 3 + (q * 11) % 37;   /* 3..39 tokens */
    for (int i = 0; i < s->n_prompt; i++) s->prompt[i] = (int32_t)((i * 31 + q * 97 + (i * i) % 7 + 1) % g_V);
}

/* One request alone on a fresh state: prefill, then token by token. */
static int run_solo(mf_ref *r, mf_step *e, solo *s, int max_gen, double temp, double top_p, uint64_t seed,
                    int ignore_eos)
{
    mf_ref_state *st = NULL;
    mf_sampler *smp = NULL;
    const mf_config *c = mf_ref_config(r);
    int rc = mf_ref_state_new(r, CTX, &st);
    if (!rc) rc = mf_sampler_new(g_V, temp, top_p, seed, &smp);
    float *lg = malloc(sizeof(float) * g_V);
    if (!rc) rc = e ? mf_step_prefill(e, st, s->prompt, s->n_prompt, lg) : mf_ref_prefill(r, st, s->prompt, s->n_prompt, lg);
    s->n_gen = 0;
    s->eos = 0;
    while (!rc && s->n_gen < max_gen) {
        int32_t t = mf_sampler_pick(smp, lg);
        if (t == c->eos_token_id && !ignore_eos) {
            s->eos = 1;
            break;
        }
        memcpy(s->logits + (size_t)s->n_gen * g_V, lg, sizeof(float) * g_V);
        s->gen[s->n_gen++] = t;
        if (s->n_gen == max_gen) break;
        rc = e ? mf_step_decode(e, &st, &t, 1, lg) : mf_ref_decode(r, &st, &t, 1, lg);
    }
    free(lg);
    mf_sampler_free(smp);
    mf_ref_state_free(st);
    return rc;
}

typedef struct ctx {
    solo *solo;   /* per request index (user pointer = &ids[i]) */
    got *got;
    pthread_mutex_t mu;   /* events come from one thread; the mutex is for the TSan part's readers */
} ctx;

static void on_event(void *user, const mf_batch_event *ev)
{
    ctx *x = user;
    int q = (int)(intptr_t)ev->user;
    got *g = &x->got[q];
    const solo *s = &x->solo[q];
    pthread_mutex_lock(&x->mu);
    if (g->done) g->events_after_done++;
    if (ev->kind == MF_BATCH_TOKEN) {
        int k = g->n_gen;
        if (k < MAX_GEN + 4) g->gen[k] = ev->token;
        if (k < s->n_gen && memcmp(ev->logits, s->logits + (size_t)k * g_V, sizeof(float) * g_V)) {
            if (!g->n_bad_logits++) g->first_bad = k;
            for (int64_t v = 0; v < g_V; v++) {
                double d = fabs((double)ev->logits[v] - s->logits[(size_t)k * g_V + v]);
                g->worst = d > g->worst ? d : g->worst;
            }
        }
        g->n_gen++;
    } else {
        g->done = 1;
        g->finish = ev->finish;
    }
    if (ev->n_text && g->n_text + ev->n_text < sizeof g->text) {
        memcpy(g->text + g->n_text, ev->text, ev->n_text);
        g->n_text += ev->n_text;
    }
    pthread_mutex_unlock(&x->mu);
}

/* Runs the N_REQ requests through a batcher: half submitted at once, the others one per step
 * after `stagger` steps. Returns the number of requests whose tokens or logits differ from alone. */
static int run_batched(mf_ref *r, mf_step *e, solo *so, int max_batch, int step_tokens, int stagger,
                       const double *temp, int check_logits, const char *what)
{
    got g[N_REQ];
    memset(g, 0, sizeof g);
    ctx x = {.solo = so, .got = g};
    pthread_mutex_init(&x.mu, NULL);
    mf_batch *b = NULL;
    CHECK(mf_batch_new(&(mf_batch_opts){.ref = r, .eng = e, .tok = g_tok, .max_batch = max_batch,
                                        .step_tokens = step_tokens, .max_context = CTX, .on_event = on_event,
                                        .user = &x}, &b) == 0, "%s: batch: %s", what, mf_last_error());
    if (!b) return N_REQ;
    int next = 0, steps = 0, bad = 0, max_items = 0;
    for (; next < N_REQ / 2; next++)
        CHECK(mf_batch_submit(b, &(mf_batch_req){.prompt = so[next].prompt, .n_prompt = so[next].n_prompt,
                                                 .max_tokens = MAX_GEN, .temperature = temp ? temp[next] : 0,
                                                 .top_p = 0.9, .seed = 1000 + next, .ignore_eos = 1,
                                                 .user = (void *)(intptr_t)next}, NULL) == 0,
              "%s: submit %d: %s", what, next, mf_last_error());
    for (;;) {
        if (steps >= stagger && next < N_REQ) {
            CHECK(mf_batch_submit(b, &(mf_batch_req){.prompt = so[next].prompt, .n_prompt = so[next].n_prompt,
                                                     .max_tokens = MAX_GEN, .temperature = temp ? temp[next] : 0,
                                                     .top_p = 0.9, .seed = 1000 + next, .ignore_eos = 1,
                                                     .user = (void *)(intptr_t)next}, NULL) == 0,
                  "%s: submit %d: %s", what, next, mf_last_error());
            next++;
        }
        int n = 0;
        CHECK(mf_batch_step(b, &n) == 0, "%s: step: %s", what, mf_last_error());
        max_items = n > max_items ? n : max_items;
        if (!n && next == N_REQ) break;
        if (++steps > 2000) break;
    }
    mf_batch_stats bs;
    mf_batch_get_stats(b, &bs);
    for (int q = 0; q < N_REQ; q++) {
        int same = g[q].done && g[q].finish == MF_BATCH_LENGTH && g[q].n_gen == so[q].n_gen &&
                   !memcmp(g[q].gen, so[q].gen, sizeof(int32_t) * (size_t)so[q].n_gen) && !g[q].events_after_done;
        if (check_logits && g[q].n_bad_logits) {
            printf("%s: request %d: %d of %d logit vectors differ from alone (first at token %d, max |diff| %.3g)\n",
                   what, q, g[q].n_bad_logits, g[q].n_gen, g[q].first_bad, g[q].worst);
            same = 0;
        }
        if (!same) {
            bad++;
            printf("%s: request %d: done %d finish %d, %d tokens (alone %d)\n", what, q, g[q].done, g[q].finish,
                   g[q].n_gen, so[q].n_gen);
        }
    }
    printf("%s: max_batch %d step_tokens %d: %lld steps, %lld items (%lld prefill, %lld decode), largest step %d "
           "items; %d of %d requests bit-identical to alone\n", what, max_batch, step_tokens, (long long)bs.steps,
           (long long)bs.items, (long long)bs.prefill_items, (long long)bs.decode_items, max_items, N_REQ - bad, N_REQ);
    CHECK(bs.running == 0 && bs.queued == 0 && bs.completed == N_REQ, "%s: stats", what);
    mf_batch_free(b);
    pthread_mutex_destroy(&x.mu);
    return bad;
}

/* ---- threads: submitters and a canceller while the main thread steps ---- */
typedef struct thr {
    mf_batch *b;
    solo *so;
    int base, n, cancel_every;
    uint64_t ids[N_REQ];
    int refused;
} thr;

static void *submitter(void *arg)
{
    thr *t = arg;
    for (int i = 0; i < t->n; i++) {
        int q = t->base + i;
        int rc = mf_batch_submit(t->b, &(mf_batch_req){.prompt = t->so[q].prompt, .n_prompt = t->so[q].n_prompt,
                                                       .max_tokens = MAX_GEN, .ignore_eos = 1,
                                                       .user = (void *)(intptr_t)q}, &t->ids[i]);
        if (rc) t->refused++;
        if (t->cancel_every && i % t->cancel_every == 1 && !rc) mf_batch_cancel(t->b, t->ids[i]);
    }
    return NULL;
}

/* Refusals, cancel of queued and running requests, stop strings, the state budget. */
static void test_single(mf_ref *r, mf_step *e, solo *so, const mf_config *cp)
{
    mf_config c = *cp;
    /* refusals, stop strings, cancel, admission by the state budget */
    got g[N_REQ];
    memset(g, 0, sizeof g);
    ctx x = {.solo = so, .got = g};
    pthread_mutex_init(&x.mu, NULL);
    mf_batch *b = NULL;
    mf_batch_opts bo = {.ref = r, .eng = e, .tok = g_tok, .max_batch = 4, .max_context = CTX, .max_queue = 3,
                        .on_event = on_event, .user = &x};
    mf_batch *tmp = NULL;
    CHECK(mf_batch_new(&bo, &b) == 0, "batch: %s", mf_last_error());
    int64_t sb = b ? mf_batch_state_bytes(b) : 0;
    CHECK(sb == mf_ref_state_bytes(&c, CTX) && sb > 0, "state bytes %lld", (long long)sb);
    bo.state_budget_bytes = (uint64_t)sb - 1;
    CHECK(mf_batch_new(&bo, &tmp) == -ENOSPC && strstr(mf_last_error(), "state budget"), "budget below one state: %s",
          mf_last_error());
    bo.state_budget_bytes = (uint64_t)sb;
    CHECK(mf_batch_new(&bo, &tmp) == 0, "budget of 1 state");
    mf_batch_stats bs;
    if (tmp) {
        mf_batch_get_stats(tmp, &bs);
        CHECK(bs.n_states == 1, "budget of one state of max_context holds %d", bs.n_states);
        mf_batch_free(tmp);
    }
    mf_batch_req rq = {.prompt = so[0].prompt, .n_prompt = so[0].n_prompt, .max_tokens = CTX, .user = 0};
    CHECK(mf_batch_submit(b, &rq, NULL) == -EINVAL && strstr(mf_last_error(), "context limit"), "context: %s",
          mf_last_error());
    rq.max_tokens = -1;
    CHECK(mf_batch_submit(b, &rq, NULL) == -EINVAL && strstr(mf_last_error(), "max_tokens"), "max_tokens -1");
    int32_t badtok = (int32_t)g_V;
    CHECK(mf_batch_submit(b, &(mf_batch_req){.prompt = &badtok, .n_prompt = 1, .max_tokens = 1}, NULL) == -EINVAL,
          "token outside the vocabulary");
    rq.max_tokens = MAX_GEN;
    rq.temperature = 1;
    rq.top_p = 1.5;
    CHECK(mf_batch_submit(b, &rq, NULL) == -EINVAL && strstr(mf_last_error(), "top_p"), "top_p");
    rq.temperature = 0;
    rq.top_p = 0;
    /* the queue holds 3: the 4th waits for nobody and is refused */
    uint64_t ids[4];
    for (int i = 0; i < 3; i++) {
        rq.user = (void *)(intptr_t)i;
        rq.prompt = so[i].prompt;
        rq.n_prompt = so[i].n_prompt;
        rq.ignore_eos = 1;
        CHECK(mf_batch_submit(b, &rq, &ids[i]) == 0 && ids[i], "submit %d", i);
    }
    CHECK(mf_batch_submit(b, &rq, &ids[3]) == -EAGAIN && strstr(mf_last_error(), "max_queue"), "queue full: %s",
          mf_last_error());
    CHECK(mf_batch_cancel(b, ids[1]) == 0, "cancel queued");
    CHECK(mf_batch_cancel(b, 999999) == -ENOENT, "cancel unknown");
    int n = 0;
    CHECK(mf_batch_step(b, &n) == 0 && n > 0, "step");
    CHECK(g[1].done && g[1].finish == MF_BATCH_CANCELLED && g[1].n_gen == 0, "queued request cancelled");
    for (int k = 0; k < 40 && !(g[0].n_gen >= 2); k++) mf_batch_step(b, &n);
    CHECK(mf_batch_cancel(b, ids[0]) == 0, "cancel running");
    mf_batch_step(b, &n);
    CHECK(g[0].done && g[0].finish == MF_BATCH_CANCELLED && g[0].n_gen >= 2 && g[0].n_gen < MAX_GEN,
          "running request cancelled after %d tokens", g[0].n_gen);
    while (mf_batch_step(b, &n) == 0 && n) {
    }
    CHECK(g[2].done && g[2].finish == MF_BATCH_LENGTH && !memcmp(g[2].gen, so[2].gen, sizeof(int32_t) * MAX_GEN),
          "the third request finishes as alone");
    /* stop string: request 3's text from its 4th generated token on; the output stops before it */
    char full[4096];
    size_t nf = 0, cut = 0;
    for (int k = 0; k < so[3].n_gen; k++) {
        if (k == 3) cut = nf;
        int nb = mf_tok_token_bytes(g_tok, so[3].gen[k], full + nf, sizeof full - nf);
        nf += nb > 0 ? (size_t)nb : 0;
    }
    if (nf > cut + 2 && cut > 0) {
        char stop[8] = {0};
        memcpy(stop, full + cut, nf - cut < 3 ? nf - cut : 3);
        /* the earliest occurrence of the stop in the full text is where the output ends */
        size_t want = cut;
        for (size_t p = 0; p + strlen(stop) <= nf; p++)
            if (!memcmp(full + p, stop, strlen(stop))) {
                want = p;
                break;
            }
        const char *stops[2] = {"\x01never", stop};
        memset(&g[3], 0, sizeof g[3]);
        CHECK(mf_batch_submit(b, &(mf_batch_req){.prompt = so[3].prompt, .n_prompt = so[3].n_prompt,
                                                 .max_tokens = MAX_GEN, .ignore_eos = 1, .stop = stops, .n_stop = 2,
                                                 .user = (void *)(intptr_t)3}, NULL) == 0, "submit with stops: %s",
              mf_last_error());
        while (mf_batch_step(b, &n) == 0 && n) {
        }
        CHECK(g[3].done && g[3].finish == MF_BATCH_STOP && g[3].n_text == want && !memcmp(g[3].text, full, want),
              "stop string: finish %d, %zu bytes (want %zu)", g[3].finish, g[3].n_text, want);
    } else {
        printf("stop string: request 3's text too short to test (%zu bytes)\n", nf);
    }
    mf_batch_shutdown(b);
    CHECK(mf_batch_submit(b, &rq, NULL) == -ESHUTDOWN, "submit after shutdown");
    mf_batch_free(b);
    pthread_mutex_destroy(&x.mu);

}

/* Admission by need: with a budget that holds two states of max_context beside two idle ones,
 * two long requests run at once and four short ones do (their states hold one page each); what
 * the states hold stays within the budget. */
static void test_budget(mf_ref *r, const mf_config *c)
{
    enum { LONG_CTX = 4 * MF_LY_PAGE_POSITIONS };
    int64_t fixed = mf_ref_state_bytes(c, 0), lng = mf_ref_state_bytes(c, LONG_CTX);
    int64_t shrt = mf_ref_state_bytes(c, 16);
    uint64_t budget = (uint64_t)(4 * fixed + 2 * (lng - fixed));
    mf_batch *b = NULL;
    CHECK(mf_batch_new(&(mf_batch_opts){.ref = r, .max_batch = 4, .max_context = LONG_CTX, .state_budget_bytes = budget},
                       &b) == 0, "batch: %s", mf_last_error());
    if (!b) return;
    CHECK(mf_batch_request_bytes(b, 8, LONG_CTX - 8) == lng && mf_batch_request_bytes(b, 8, 8) == shrt && shrt < lng,
          "request bytes: long %lld, short %lld", (long long)lng, (long long)shrt);
    int32_t prompt[8];
    for (int i = 0; i < 8; i++) prompt[i] = 5 + i;
    for (int round = 0; round < 2; round++) {
        int max_tokens = round ? 8 : LONG_CTX - 8, n = 0;
        uint64_t ids[4];
        for (int i = 0; i < 4; i++)
            CHECK(mf_batch_submit(b, &(mf_batch_req){.prompt = prompt, .n_prompt = 8, .max_tokens = max_tokens,
                                                     .ignore_eos = 1}, &ids[i]) == 0, "submit: %s", mf_last_error());
        CHECK(mf_batch_step(b, &n) == 0 && n > 0, "step: %s", mf_last_error());
        mf_batch_stats bs;
        mf_batch_get_stats(b, &bs);
        int want = round ? 4 : 2;
        CHECK(bs.n_states == 4 && bs.running == want && bs.queued == 4 - want,
              "%s requests: %d running, %d queued (expected %d running)", round ? "short" : "long", bs.running,
              bs.queued, want);
        CHECK(bs.state_bytes_held > 0 && (uint64_t)bs.state_bytes_held <= budget, "states hold %lld of %llu",
              (long long)bs.state_bytes_held, (unsigned long long)budget);
        for (int i = 0; i < 4; i++) mf_batch_cancel(b, ids[i]);
        for (int k = 0; k < 8 && mf_batch_wait(b, 0); k++) mf_batch_step(b, &n);
        mf_batch_get_stats(b, &bs);
        CHECK(bs.running == 0 && bs.queued == 0, "all cancelled: %d running, %d queued", bs.running, bs.queued);
    }
    mf_batch_free(b);
}

/* Admission past a head that does not fit: budget for two long states and two short ones beside
 * them. Three long requests then three short: the third long one waits, and short ones start in
 * the room it leaves, at most max_bypass of them while it waits; once it has been passed that
 * often, nothing starts ahead of it (a short one that would fit waits), and it starts as soon as
 * a long one ends. Strict FIFO (-1) starts none ahead of it. */
static void test_bypass(mf_ref *r, const mf_config *c)
{
    enum { LONG_CTX = 4 * MF_LY_PAGE_POSITIONS };
    int64_t fixed = mf_ref_state_bytes(c, 0), lng = mf_ref_state_bytes(c, LONG_CTX), shrt = mf_ref_state_bytes(c, 16);
    uint64_t budget = (uint64_t)(2 * lng + 2 * shrt);
    int32_t prompt[8];
    for (int i = 0; i < 8; i++) prompt[i] = 5 + i;
    static const struct { int max_bypass, running, queued, bypassed; } cases[] = {
        {0, 4, 2, 2},    /* default (16): two short ones start beside the two long ones */
        {1, 3, 3, 1},    /* one may pass; the second short one waits although it fits */
        {-1, 2, 4, 0},   /* strict FIFO */
    };
    for (int k = 0; k < 3; k++) {
        mf_batch *b = NULL;
        CHECK(mf_batch_new(&(mf_batch_opts){.ref = r, .max_batch = 4, .max_context = LONG_CTX, .state_budget_bytes = budget,
                                            .max_bypass = cases[k].max_bypass}, &b) == 0, "batch: %s", mf_last_error());
        if (!b) return;
        CHECK(fixed < shrt && 2 * lng + fixed + lng > (int64_t)budget, "sizes: fixed %lld short %lld long %lld",
              (long long)fixed, (long long)shrt, (long long)lng);
        uint64_t ids[6];
        for (int i = 0; i < 6; i++)
            CHECK(mf_batch_submit(b, &(mf_batch_req){.prompt = prompt, .n_prompt = 8, .max_tokens = i < 3 ? LONG_CTX - 8 : 8,
                                                     .ignore_eos = 1, .user = (void *)(intptr_t)i}, &ids[i]) == 0,
                  "submit: %s", mf_last_error());
        int n = 0;
        CHECK(mf_batch_step(b, &n) == 0 && n > 0, "step: %s", mf_last_error());
        mf_batch_stats bs;
        mf_batch_get_stats(b, &bs);
        CHECK(bs.running == cases[k].running && bs.queued == cases[k].queued && bs.bypassed == cases[k].bypassed,
              "max_bypass %d: %d running, %d queued, %lld bypassed (expected %d, %d, %d)", cases[k].max_bypass,
              bs.running, bs.queued, (long long)bs.bypassed, cases[k].running, cases[k].queued, cases[k].bypassed);
        CHECK((uint64_t)bs.state_bytes_held <= budget, "states hold %lld of %llu", (long long)bs.state_bytes_held,
              (unsigned long long)budget);
        /* the first long one is cancelled (its state is free after that step): the waiting long
         * one starts at the next step, and behind it what fits, in order; one short one is left */
        mf_batch_cancel(b, ids[0]);
        CHECK(mf_batch_step(b, &n) == 0 && mf_batch_step(b, &n) == 0, "step: %s", mf_last_error());
        mf_batch_get_stats(b, &bs);
        CHECK(bs.running == 4 && bs.queued == 1, "max_bypass %d after a long one ends: %d running, %d queued "
              "(expected 4, 1)", cases[k].max_bypass, bs.running, bs.queued);
        for (int i = 0; i < 6; i++) mf_batch_cancel(b, ids[i]);
        for (int s = 0; s < 8 && mf_batch_wait(b, 0); s++) mf_batch_step(b, &n);
        mf_batch_free(b);
    }
}

int main(void)
{
    mf_config c;
    char dir[1024], tp[1100];
    CHECK(mf_config_preset("tiny", &c) == 0, "preset");
    if (mf_test_gen_ckpt(&c, "batch_tiny", dir, sizeof dir)) return 1;
    snprintf(tp, sizeof tp, "%s/tokenizer.json", dir);
    CHECK(mf_tok_load(tp, &g_tok) == 0, "tokenizer: %s", mf_last_error());
    mf_model *m = NULL;
    CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1}, &m) == 0, "load: %s", mf_last_error());
    if (!m) return mf_check_exit("test_batch");
    g_V = mf_model_config(m)->vocab_size;
    mf_ref *r = NULL;
    mf_step *e = NULL;
    CHECK(mf_ref_new(m, NULL, &r) == 0, "ref: %s", mf_last_error());
    CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2}, &e) == 0, "step: %s", mf_last_error());
    if (!r || !e) return mf_check_exit("test_batch");
    int tsan = MF_TEST_TSAN,   /* TSan: one greedy run and the threaded part */
        n_req = tsan ? 4 : N_REQ;

    solo so[N_REQ];
    for (int q = 0; q < N_REQ; q++) {
        prompt_of(q, &so[q]);
        so[q].logits = malloc(sizeof(float) * (size_t)MAX_GEN * g_V);
        if (q < n_req) CHECK(run_solo(r, e, &so[q], MAX_GEN, 0, 1, 0, 1) == 0, "solo %d: %s", q, mf_last_error());
    }
    /* greedy: several budgets and batch sizes; small budgets cut prompts into chunks that share
     * steps with other sequences' decode tokens; 3 states for 8 requests are reused */
    if (!tsan) {
        CHECK(run_batched(r, e, so, 3, 7, 2, NULL, 1, "greedy") == 0, "greedy, batch 3, budget 7");
        CHECK(run_batched(r, e, so, 8, 64, 1, NULL, 1, "greedy") == 0, "greedy, batch 8, budget 64");
        CHECK(run_batched(r, e, so, 5, 2, 3, NULL, 1, "greedy") == 0, "greedy, batch 5, budget 2");
        CHECK(run_batched(r, e, so, 1, 16, 0, NULL, 1, "greedy") == 0, "greedy, batch 1");
        /* 5 workers: each prefill unit's compressor in more item ranges and its index scores in
         * more parts (graphs/step/stepgraph.h key_parts), the bits of the solo runs on 2 */
        mf_step *e5 = NULL;
        CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 5}, &e5) == 0, "step, 5 workers: %s", mf_last_error());
        if (e5) CHECK(run_batched(r, e5, so, 8, 64, 1, NULL, 1, "greedy") == 0, "greedy, batch 8, budget 64, 5 workers");
        mf_step_free(e5);
    }
    /* sampling: per-request temperature and seed, equal to the same sampler alone */
    double temp[N_REQ];
    solo ss[N_REQ];
    for (int q = 0; q < N_REQ; q++) {
        temp[q] = q % 3 == 0 ? 0 : 0.5 + 0.25 * (q % 4);
        ss[q] = so[q];
        ss[q].logits = malloc(sizeof(float) * (size_t)MAX_GEN * g_V);
        if (!tsan) CHECK(run_solo(r, e, &ss[q], MAX_GEN, temp[q], 0.9, 1000 + q, 1) == 0, "solo sampled %d", q);
    }
    if (!tsan) CHECK(run_batched(r, e, ss, 4, 9, 1, temp, 1, "sampled") == 0, "sampled, batch 4, budget 9");
    /* the reference forward through the batcher: its own solo runs (4 requests) */
    if (!tsan) {
        solo rs[N_REQ];
        for (int q = 0; q < N_REQ; q++) {
            rs[q] = so[q];
            rs[q].n_prompt = so[q].n_prompt < 8 ? so[q].n_prompt : 8;
            rs[q].logits = malloc(sizeof(float) * (size_t)MAX_GEN * g_V);
            CHECK(run_solo(r, NULL, &rs[q], MAX_GEN, 0, 1, 0, 1) == 0, "solo reference %d", q);
        }
        CHECK(run_batched(r, NULL, rs, 3, 5, 1, NULL, 1, "reference") == 0, "reference forward, batch 3, budget 5");
        for (int q = 0; q < N_REQ; q++) free(rs[q].logits);
    }

    if (!tsan) test_single(r, e, so, &c);
    if (!tsan) test_budget(r, &c);
    if (!tsan) test_bypass(r, &c);
    got g[N_REQ];
    mf_batch *b = NULL;
    mf_batch_stats bs;
    int n = 0;

    /* threads: two submitters (one cancelling every other request) while this thread steps */
    memset(g, 0, sizeof g);
    ctx y = {.solo = so, .got = g};
    pthread_mutex_init(&y.mu, NULL);
    b = NULL;
    CHECK(mf_batch_new(&(mf_batch_opts){.ref = r, .eng = e, .max_batch = 3, .step_tokens = 8, .max_context = CTX,
                                        .on_event = on_event, .user = &y}, &b) == 0, "batch: %s", mf_last_error());
    thr t1 = {.b = b, .so = so, .base = 0, .n = n_req / 2}, t2 = {.b = b, .so = so, .base = n_req / 2, .n = n_req / 2,
                                                                 .cancel_every = 2};
    pthread_t p1, p2;
    pthread_create(&p1, NULL, submitter, &t1);
    pthread_create(&p2, NULL, submitter, &t2);
    int joined = 0, dn = 0;
    for (int k = 0; k < 4000; k++) {
        if (!joined) {
            pthread_mutex_lock(&y.mu);
            dn = 0;
            for (int q = 0; q < n_req; q++) dn += g[q].done;
            pthread_mutex_unlock(&y.mu);
        }
        mf_batch_wait(b, 2000000);
        CHECK(mf_batch_step(b, &n) == 0, "threaded step: %s", mf_last_error());
        mf_batch_get_stats(b, &bs);
        if (bs.queued == 0 && bs.running == 0 && !n) {
            if (!joined) {
                pthread_join(p1, NULL);
                pthread_join(p2, NULL);
                joined = 1;
                continue;   /* one more pass for what was submitted last */
            }
            break;
        }
    }
    if (!joined) {
        pthread_join(p1, NULL);
        pthread_join(p2, NULL);
    }
    int n_done = 0, n_cancel = 0, n_same = 0;
    for (int q = 0; q < n_req; q++) {
        n_done += g[q].done;
        n_cancel += g[q].finish == MF_BATCH_CANCELLED;
        if (g[q].finish == MF_BATCH_LENGTH)
            n_same += g[q].n_gen == MAX_GEN && !memcmp(g[q].gen, so[q].gen, sizeof(int32_t) * MAX_GEN);
        CHECK(!g[q].events_after_done, "request %d: events after its DONE", q);
    }
    printf("threads: %d of %d requests done (%d cancelled, %d finished equal to alone)\n", n_done, n_req, n_cancel,
           n_same);
    CHECK(n_done == n_req && n_same == n_req - n_cancel && t1.refused == 0 && t2.refused == 0,
          "threads: done %d, same %d, cancelled %d", n_done, n_same, n_cancel);
    mf_batch_free(b);
    pthread_mutex_destroy(&y.mu);
    (void)dn;

    if (!tsan) test_cli(r, e, dir);
    for (int q = 0; q < N_REQ; q++) {
        free(so[q].logits);
        free(ss[q].logits);
    }
    mf_step_free(e);
    mf_ref_free(r);
    mf_model_free(m);
    mf_tok_free(g_tok);
    return mf_check_exit("test_batch");
}
