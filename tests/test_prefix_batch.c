/* The prefix cache under the continuous batcher (graphs/step/batch.h opts.prefix) on the tiny preset:
 * many requests sharing a long system prompt, run at once on a few states, one cancelled mid-prefill,
 * under a cache budget of a few blocks (evictions all the time) and with plenty: every response's
 * tokens and logit vectors equal its solo run from scratch (memcmp), hits are reported per request
 * (n_cached) and counted; a chat's next turn (its prompt = the last turn's prompt, generation and
 * new tokens) hits up to the last token fed; the state budget with mapped pages; submissions and
 * cancels from other threads while the main thread steps, with a disk tier's writer running
 * (this test runs under TSan in CI). */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "graphs/model/model.h"
#include "graphs/prefix/prefix.h"
#include "graphs/step/batch.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/cli.h"
#include "tests/tiny_ckpt.h"

#define CTX 400
#define GEN 5
static int SYS = 150;   /* the shared system prompt (shorter under TSan) */
#define MAX_REQ 24

typedef struct req {
    int n_prompt;
    int32_t prompt[CTX];
    int32_t gen[GEN];
    float *logits;    /* GEN x V: solo */
} req;

typedef struct got {
    int n_gen, done, finish, n_cached, bad_logits, after_done;
    int32_t gen[GEN + 2];
} got;

static int64_t V;
static req R[MAX_REQ];
static got G[MAX_REQ];
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

/* One request alone from scratch: the prompt, then GEN greedy tokens (their logits kept). */
static int solo(mf_ref *r, mf_step *e, req *q)
{
    mf_ref_state *st = NULL;
    float *lg = malloc(sizeof(float) * (size_t)V);
    int rc = lg ? mf_ref_state_new(r, CTX, &st) : -ENOMEM;
    if (!rc) rc = e ? mf_step_prefill(e, st, q->prompt, q->n_prompt, lg) : mf_ref_prefill(r, st, q->prompt, q->n_prompt, lg);
    for (int k = 0; k < GEN && !rc; k++) {
        memcpy(q->logits + (size_t)k * V, lg, sizeof(float) * (size_t)V);
        int32_t t = 0;
        for (int64_t v = 1; v < V; v++)
            if (lg[v] > lg[t]) t = (int32_t)v;
        q->gen[k] = t;
        if (k + 1 < GEN) rc = e ? mf_step_decode(e, &st, &t, 1, lg) : mf_ref_decode(r, &st, &t, 1, lg);
    }
    mf_ref_state_free(st);
    free(lg);
    return rc;
}

static void on_event(void *user, const mf_batch_event *ev)
{
    (void)user;
    int i = (int)(intptr_t)ev->user;
    got *g = &G[i];
    pthread_mutex_lock(&g_mu);
    if (g->done) g->after_done++;
    g->n_cached = ev->n_cached;
    if (ev->kind == MF_BATCH_TOKEN) {
        if (g->n_gen < GEN && memcmp(ev->logits, R[i].logits + (size_t)g->n_gen * V, sizeof(float) * (size_t)V))
            g->bad_logits++;
        if (g->n_gen < GEN + 2) g->gen[g->n_gen] = ev->token;
        g->n_gen++;
    } else {
        g->done = 1;
        g->finish = ev->finish;
    }
    pthread_mutex_unlock(&g_mu);
}

static void make_requests(int n)
{
    for (int i = 0; i < n; i++) {
        req *q = &R[i];
        q->n_prompt = SYS + 3 + (i * 7) % 23;
        for (int k = 0; k < q->n_prompt; k++)
            q->prompt[k] = (int32_t)(k < SYS ? (k * 29 + 3) % V : (k * 13 + i * 101 + 7) % V);
    }
}

typedef struct run_opts {
    int n_req, max_batch, step_tokens, cancel;   /* cancel: request index cancelled mid-prefill (-1: none) */
    uint64_t budget, state_budget;
    const char *dir;
    int threads;                                 /* submit from threads */
} run_opts;

typedef struct sub_arg {
    mf_batch *b;
    int from, to, refused;   /* refused: submissions that failed (checked by the main thread) */
} sub_arg;

static void *submitter(void *arg)
{
    sub_arg *a = arg;
    for (int i = a->from; i < a->to; i++) {
        int rc;
        while ((rc = mf_batch_submit(a->b, &(mf_batch_req){.prompt = R[i].prompt, .n_prompt = R[i].n_prompt,
                                                           .max_tokens = GEN, .ignore_eos = 1,
                                                           .user = (void *)(intptr_t)i}, NULL)) == -EAGAIN)
            usleep(1000);
        a->refused += rc != 0;
    }
    return NULL;
}

/* Runs the requests through a batcher with a prefix cache; returns the requests that differ */
static int run(mf_ref *r, mf_step *e, const run_opts *o, const char *what)
{
    memset(G, 0, sizeof G);
    mf_prefix *p = NULL;
    CHECK(mf_prefix_new(&(mf_prefix_opts){.ref = r, .block_tokens = 16, .budget_bytes = o->budget, .dir = o->dir,
                                          .quiet = 1}, &p) == 0, "%s: prefix: %s", what, mf_last_error());
    mf_batch *b = NULL;
    CHECK(mf_batch_new(&(mf_batch_opts){.ref = r, .eng = e, .max_batch = o->max_batch, .step_tokens = o->step_tokens,
                                        .max_context = CTX, .state_budget_bytes = o->state_budget, .prefix = p,
                                        .on_event = on_event}, &b) == 0, "%s: batch: %s", what, mf_last_error());
    if (!p || !b) {
        mf_batch_free(b);
        mf_prefix_free(p);
        return o->n_req;
    }
    pthread_t th[3];
    sub_arg sa[3];
    int nt = o->threads ? 3 : 0;
    if (nt) {
        for (int t = 0; t < nt; t++) {
            sa[t] = (sub_arg){b, o->n_req * t / nt, o->n_req * (t + 1) / nt, 0};
            pthread_create(&th[t], NULL, submitter, &sa[t]);
        }
    } else {
        sa[0] = (sub_arg){b, 0, o->n_req, 0};
        submitter(&sa[0]);
    }
    int steps = 0, cancelled = 0;
    for (;;) {
        int n = 0;
        CHECK(mf_batch_step(b, &n) == 0, "%s: step: %s", what, mf_last_error());
        mf_batch_stats bs;
        mf_batch_get_stats(b, &bs);
        if (o->cancel >= 0 && !cancelled && bs.prefill_items > SYS / 2) {   /* mid-prefill: ids are 1.. in order */
            pthread_mutex_lock(&g_mu);
            int started = !G[o->cancel].n_gen;
            pthread_mutex_unlock(&g_mu);
            if (started && !nt) cancelled = mf_batch_cancel(b, (uint64_t)o->cancel + 1) == 0;
        }
        pthread_mutex_lock(&g_mu);
        int all = 1;
        for (int i = 0; i < o->n_req; i++) all &= G[i].done;
        pthread_mutex_unlock(&g_mu);
        if ((!n && all) || steps > 5000) break;
        if (!n) mf_batch_wait(b, 10000000);   /* the submitters have not queued anything yet */
        else steps++;
    }
    for (int t = 0; t < nt; t++) pthread_join(th[t], NULL);
    for (int t = 0; t < (nt ? nt : 1); t++) CHECK(!sa[t].refused, "%s: %d submissions refused", what, sa[t].refused);
    int bad = 0, hits = 0;
    for (int i = 0; i < o->n_req; i++) {
        if (cancelled && i == o->cancel) {
            CHECK(G[i].done && G[i].finish == MF_BATCH_CANCELLED, "%s: request %d cancelled", what, i);
            continue;
        }
        int same = G[i].done && G[i].finish == MF_BATCH_LENGTH && G[i].n_gen == GEN && !G[i].bad_logits &&
                   !G[i].after_done && !memcmp(G[i].gen, R[i].gen, sizeof(int32_t) * GEN);
        if (!same) printf("%s: request %d: done %d finish %d, %d tokens, %d logit vectors differ, %d cached\n", what,
                          i, G[i].done, G[i].finish, G[i].n_gen, G[i].bad_logits, G[i].n_cached);
        bad += !same;
        hits += G[i].n_cached > 0;
        CHECK(G[i].n_cached >= 0 && G[i].n_cached < R[i].n_prompt, "%s: %d cached of %d", what, G[i].n_cached,
              R[i].n_prompt);
    }
    mf_prefix_stats ps;
    mf_batch_stats bs;
    mf_prefix_get_stats(p, &ps);
    mf_batch_get_stats(b, &bs);
    printf("%s: %d of %d requests bit-identical to scratch, %d hit (%lld tokens), %lld steps; cache: %lld nodes, "
           "%lld bytes (budget %llu), %lld inserted, %lld evicted, %lld refused; disk %lld files\n", what,
           o->n_req - bad - cancelled, o->n_req - cancelled, hits, (long long)bs.cached_tokens, (long long)bs.steps,
           (long long)ps.nodes, (long long)ps.bytes, (unsigned long long)o->budget, (long long)ps.inserted,
           (long long)ps.evicted, (long long)ps.refused, (long long)ps.disk_files);
    CHECK(ps.bytes <= (int64_t)o->budget, "%s: %lld bytes held past the budget %llu", what, (long long)ps.bytes,
          (unsigned long long)o->budget);
    CHECK(bs.cached_tokens == ps.hit_tokens || cancelled || o->state_budget, "%s: %lld cached, %lld hit", what,
          (long long)bs.cached_tokens, (long long)ps.hit_tokens);
    mf_batch_free(b);
    mf_prefix_free(p);
    return bad + (o->n_req > 1 && hits == 0);
}

/* A chat: turn 2's prompt is turn 1's prompt, its generated tokens and new ones: it restores up to
 * the last token turn 1 fed (its prompt and all but its last generated token) */
static void test_turns(mf_ref *r, mf_step *e)
{
    memset(G, 0, sizeof G);
    mf_prefix *p = NULL;
    mf_batch *b = NULL;
    CHECK(mf_prefix_new(&(mf_prefix_opts){.ref = r, .block_tokens = 16, .budget_bytes = 64u << 20}, &p) == 0, "prefix");
    CHECK(mf_batch_new(&(mf_batch_opts){.ref = r, .eng = e, .max_batch = 2, .step_tokens = 24, .max_context = CTX,
                                        .prefix = p, .on_event = on_event}, &b) == 0, "batch");
    if (!p || !b) goto out;
    for (int turn = 0, i = MAX_REQ - 3; turn < 3; turn++, i++) {   /* requests MAX_REQ - 3 .. */
        req *q = &R[i];
        q->n_prompt = 0;
        if (turn) {   /* the last turn's prompt and generation, then new tokens */
            memcpy(q->prompt, R[i - 1].prompt, sizeof(int32_t) * (size_t)R[i - 1].n_prompt);
            q->n_prompt = R[i - 1].n_prompt;
            memcpy(q->prompt + q->n_prompt, G[i - 1].gen, sizeof(int32_t) * GEN);
            q->n_prompt += GEN;
        }
        for (int k = 0; k < (turn ? 9 : 40); k++) q->prompt[q->n_prompt++] = (int32_t)((k * 41 + turn * 5 + 2) % V);
        CHECK(solo(r, e, q) == 0, "solo turn %d", turn);
        CHECK(mf_batch_submit(b, &(mf_batch_req){.prompt = q->prompt, .n_prompt = q->n_prompt, .max_tokens = GEN,
                                                 .ignore_eos = 1, .user = (void *)(intptr_t)i}, NULL) == 0, "submit");
        for (int n = 1, k = 0; n && k < 1000; k++) CHECK(mf_batch_step(b, &n) == 0, "step");
        int want = turn ? R[i - 1].n_prompt + GEN - 1 : 0;
        CHECK(G[i].done && !G[i].bad_logits && !memcmp(G[i].gen, q->gen, sizeof(int32_t) * GEN),
              "turn %d differs from scratch", turn);
        CHECK(G[i].n_cached == want, "turn %d: %d cached (expected %d)", turn, G[i].n_cached, want);
        printf("turn %d: %d prompt tokens, %d cached, same bits as scratch\n", turn, q->n_prompt, G[i].n_cached);
    }
out:
    mf_batch_free(b);
    mf_prefix_free(p);
}

/* The commands: `decode --prompts` with the cache (the default), without (--prefix-cache 0) and twice
 * on a --prefix-cache-dir (the second run loads from disk): the same tokens; `bench serve --turns` */
static void test_cli(const char *dir)
{
    if (!getenv("MOEFLOW_BIN")) {
        printf("test_prefix_batch: MOEFLOW_BIN unset, CLI checks skipped\n");
        return;
    }
    char ids[1040], pf[1100], pdir[1100], cmd[8192];
    static char a[65536], b[65536], c[65536], d[65536];
    snprintf(ids, sizeof ids, "%s_ids", dir);   /* token ids: no tokenizer */
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s' && rm '%s/tokenizer.json'", ids, dir, ids, ids);
    CHECK(system(cmd) == 0, "copy %s", dir);
    snprintf(pf, sizeof pf, "%s/prompts.txt", ids);
    snprintf(pdir, sizeof pdir, "%s/pcache", ids);
    FILE *f = fopen(pf, "w");
    for (int i = 0; f && i < 10; i++) {
        for (int k = 0; k < R[i].n_prompt; k++) fprintf(f, k ? " %d" : "%d", R[i].prompt[k]);
        fprintf(f, "\n");
    }
    if (f) fclose(f);
    const char *base = "--batch 3 --step-tokens 16 --max-new-tokens 4 --ignore-eos --threads 2";
    snprintf(cmd, sizeof cmd, "decode --checkpoint %s --prompts %s %s --quiet", ids, pf, base);
    CHECK(mf_test_cli(cmd, a, sizeof a) == 0 && strlen(a) > 20, "decode with the cache: '%s'", a);
    snprintf(cmd, sizeof cmd, "decode --checkpoint %s --prompts %s %s --quiet --prefix-cache 0", ids, pf, base);
    CHECK(mf_test_cli(cmd, b, sizeof b) == 0 && !strcmp(a, b), "decode without the cache:\n%s\nwith:\n%s", b, a);
    snprintf(cmd, sizeof cmd, "decode --checkpoint %s --prompts %s %s --prefix-cache 8M --prefix-block 16 "
             "--prefix-cache-dir %s 2>&1 >/dev/null", ids, pf, base, pdir);
    CHECK(mf_test_cli(cmd, c, sizeof c) == 0 && strstr(c, "prefix cache: ") && strstr(c, "written"), "first run: '%s'", c);
    snprintf(cmd, sizeof cmd, "decode --checkpoint %s --prompts %s %s --quiet --prefix-cache 8M --prefix-block 16 "
             "--prefix-cache-dir %s", ids, pf, base, pdir);
    CHECK(mf_test_cli(cmd, d, sizeof d) == 0 && !strcmp(a, d), "restart on the disk tier:\n%s\nwant\n%s", d, a);
    snprintf(cmd, sizeof cmd, "decode --checkpoint %s --prompts %s %s --prefix-cache 8M --prefix-block 16 "
             "--prefix-cache-dir %s 2>&1 >/dev/null", ids, pf, base, pdir);
    const char *l = mf_test_cli(cmd, c, sizeof c) == 0 ? strstr(c, "disk: ") : NULL;
    CHECK(l && atoi(l + 6) > 0, "a restart loads from disk: '%s'", c);
    snprintf(cmd, sizeof cmd, "decode --checkpoint %s --prompts %s %s --prefix-block 48 2>&1", ids, pf, base);
    CHECK(mf_test_cli(cmd, c, sizeof c) != 0 && strstr(c, "power of two"), "--prefix-block 48: '%s'", c);
    snprintf(cmd, sizeof cmd, "bench serve --checkpoint %s --turns 3 --requests 2 --concurrency 2 --prompt-tokens 4-8 "
             "--output-tokens 6-10 --system-tokens 40 --warmup 0 --threads 2 --json", ids);
    int ok = mf_test_cli(cmd, c, sizeof c) == 0;
    const char *ct = strstr(c, "\"cached_tokens\":");   /* the prefix cache's mode comes first */
    CHECK(ok && strstr(c, "\"mode\":\"prefix_cache\"") && strstr(c, "\"ttft_ratio\":[") && ct && atoi(ct + 16) > 0,
          "bench serve --turns: '%s'", c);
}

int main(void)
{
    mf_config c;
    char dir[1024], pdir[1200];
    CHECK(mf_config_preset("tiny", &c) == 0, "preset");
    if (mf_test_gen_ckpt(&c, "prefix_batch_tiny", dir, sizeof dir)) return 1;
    mf_model *m;
    mf_ref *r;
    mf_step *e;
    if (mf_test_open(dir, 0, &m, &r, &e)) return 1;
    V = c.vocab_size;
    int tsan = MF_TEST_TSAN, san = MF_TEST_SANITIZED, n = tsan ? 4 : san ? 8 : 16;
    if (tsan) SYS = 40;
    make_requests(n);
    for (int i = 0; i < MAX_REQ; i++) R[i].logits = malloc(sizeof(float) * GEN * (size_t)V);
    for (int i = 0; i < n; i++) CHECK(solo(r, e, &R[i]) == 0, "solo %d: %s", i, mf_last_error());
    int64_t block_bytes = (int64_t)(mf_prefix_bytes_per_token(&c, 16) * 16);
    if (!tsan) {
        CHECK(run(r, e, &(run_opts){n, 4, 16, -1, 64u << 20, 0, NULL, 0}, "plenty") == 0, "plenty");
        CHECK(run(r, e, &(run_opts){n, 6, 40, 0, 64u << 20, 0, NULL, 0}, "cancel mid-prefill") == 0, "cancel");
        /* a budget of a few blocks: every insert evicts; hits are few and short, never wrong */
        int bad = run(r, e, &(run_opts){n, 4, 40, 0, (uint64_t)(6 * block_bytes), 0, NULL, 0}, "a budget of a few blocks");
        CHECK(bad <= 1, "few blocks: %d differ", bad);   /* 1: no hit at all is allowed there */
        /* states under a budget of two long ones: the pages a hit maps are not counted again */
        if (!san)
            CHECK(run(r, e, &(run_opts){n, 8, 16, -1, 64u << 20, 2 * (uint64_t)mf_ref_state_bytes(&c, CTX), NULL, 0},
                      "state budget") == 0, "state budget");
        test_turns(r, e);
    }
    const char *tmp = getenv("MOEFLOW_TMP");
    snprintf(pdir, sizeof pdir, "%s/prefix_batch_disk", tmp ? tmp : "/tmp");
    char cmd[1300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", pdir);
    CHECK(system(cmd) == 0, "rm");
    /* threads submitting while the main thread steps, the disk tier's writer beside them */
    CHECK(run(r, e, &(run_opts){n, tsan ? 2 : 4, 16, -1, 64u << 20, 0, pdir, 1}, "threads, disk tier") == 0, "threads");
    /* a restart on that directory (loads beside the writer), under a budget of a few blocks */
    CHECK(run(r, e, &(run_opts){n, tsan ? 2 : 4, 16, -1, (uint64_t)(5 * block_bytes), 0, pdir, 1},
              "threads, small budget, disk") <= 1, "threads, small budget");
    if (!san) test_cli(dir);
    for (int i = 0; i < MAX_REQ; i++) free(R[i].logits);
    mf_step_free(e);
    mf_ref_free(r);
    mf_model_free(m);
    return mf_check_exit("test_prefix_batch");
}
