/* The prefix cache's test driver (tests/test_prefix_step.c, tests/test_prefix_disk.c): a producer
 * runs a prompt through a state the cache taps, a consumer restores another prompt's longest cached
 * prefix, runs the rest and compares every position's logits and a greedy continuation with the same
 * prompt from scratch (memcmp). */
#ifndef MF_TEST_PREFIX_RUN_H
#define MF_TEST_PREFIX_RUN_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/prefix/prefix.h"
#include "graphs/ref/ref.h"
#include "graphs/step/step.h"
#include "sched/error.h"
#include "tests/check.h"

#define CTX 640
#define GEN 6

typedef struct eng {
    const char *name;
    mf_ref *r;
    mf_step *e;   /* NULL: the reference forward */
} eng;

static int64_t V;
static int32_t A[CTX];   /* the producer's tokens */

/* n items of st (tokens t), logits of item i into lg + i * V when lg (else none) */
static int fwd(const eng *g, mf_ref_state *st, const int32_t *t, int n, float *lg)
{
    mf_ref_state *sts[CTX];
    float *lp[CTX];
    for (int i = 0; i < n; i++) {
        sts[i] = st;
        lp[i] = lg ? lg + (size_t)i * V : NULL;
    }
    return g->e ? mf_step_forward(g->e, sts, t, n, lp) : mf_ref_forward(g->r, sts, t, n, lp);
}

static int32_t argmax(const float *l)
{
    int32_t b = 0;
    for (int64_t i = 1; i < V; i++)
        if (l[i] > l[b]) b = (int32_t)i;
    return b;
}

/* The producer: toks[0..n) through a state the cache taps, in chunks of `chunk` (the prompt's end
 * a tail), then gen greedy tokens (appended to toks), then the sequence ends (its last partial
 * block a tail). */
static void produce(const eng *g, mf_prefix *p, int32_t *toks, int n, int chunk, int gen)
{
    mf_ref_state *st = NULL;
    mf_prefix_seq *s = NULL;
    float *lg = malloc(sizeof(float) * (size_t)V);
    CHECK(mf_ref_state_new(g->r, CTX, &st) == 0 && mf_prefix_seq_new(p, &s) == 0 && lg, "%s", mf_last_error());
    if (!st || !s || !lg) goto out;
    CHECK(mf_prefix_match(p, s, toks, n, NULL) >= 0 && mf_prefix_restore(p, s, st) >= 0, "producer restore");
    int done = (int)mf_ref_state_pos(st);
    while (done < n) {
        int k = n - done < chunk ? n - done : chunk;
        mf_prefix_step_begin(p, s, st, k);
        int rc = fwd(g, st, toks + done, k, NULL);
        CHECK(rc == 0, "%s: producer chunk at %d: %s", g->name, done, mf_last_error());
        mf_prefix_step_end(p, s, st, !rc, done + k == n);
        if (rc) goto out;
        done += k;
    }
    for (int i = 0; i < gen; i++) {   /* decode tokens (teacher-forced: their logits do not matter here) */
        int32_t t = (int32_t)((toks[n + i - 1] * 7 + 3) % V);
        toks[n + i] = t;
        mf_prefix_step_begin(p, s, st, 1);
        int rc = fwd(g, st, &toks[n + i], 1, lg);
        mf_prefix_step_end(p, s, st, !rc, 0);
        CHECK(rc == 0, "%s: producer decode %d", g->name, i);
    }
    mf_prefix_seq_end(p, s, st, 1);
out:
    free(lg);
    mf_prefix_seq_free(s);
    mf_ref_state_free(st);
}

/* The consumer: prompt P[0..n) from scratch and from the cache's longest prefix (want positions; < 0:
 * any); every position after the hit and GEN greedy tokens after the prompt: the same bits. Returns
 * the hit's positions. */
static int consume(const eng *g, mf_prefix *p, const int32_t *P, int n, int want, const char *what)
{
    mf_ref_state *a = NULL, *b = NULL;
    mf_prefix_seq *s = NULL;
    float *la = malloc(sizeof(float) * (size_t)(n + GEN) * V), *lb = malloc(sizeof(float) * (size_t)(n + GEN) * V);
    CHECK(la && lb && mf_ref_state_new(g->r, CTX, &a) == 0 && mf_ref_state_new(g->r, CTX, &b) == 0 &&
          mf_prefix_seq_new(p, &s) == 0, "alloc");
    int h = -1;
    if (!la || !lb || !a || !b || !s) goto out;
    h = mf_prefix_match(p, s, P, n, NULL);
    CHECK(h == want || want < 0, "%s %s: hit of %d positions (expected %d)", g->name, what, h, want);
    int hr = mf_prefix_restore(p, s, b);
    CHECK(hr == h && mf_ref_state_pos(b) == h, "%s %s: restored %d", g->name, what, hr);
    if (hr != h) goto out;
    int rc = fwd(g, a, P, n, la);
    CHECK(rc == 0, "%s %s: scratch: %s", g->name, what, mf_last_error());
    for (int at = h, k; at < n && !rc; at += k) {   /* the rest in chunks of 5 (the tap on) */
        k = n - at < 5 ? n - at : 5;
        mf_prefix_step_begin(p, s, b, k);
        rc = fwd(g, b, P + at, k, lb + (size_t)at * V);
        mf_prefix_step_end(p, s, b, !rc, at + k == n);
        CHECK(rc == 0, "%s %s: after the hit: %s", g->name, what, mf_last_error());
    }
    int bad = -1;
    for (int i = h; i < n && bad < 0 && !rc; i++)
        if (memcmp(la + (size_t)i * V, lb + (size_t)i * V, sizeof(float) * (size_t)V)) bad = i;
    CHECK(bad < 0, "%s %s (hit %d of %d): logits of position %d differ from scratch", g->name, what, h, n, bad);
    int32_t ta = argmax(la + (size_t)(n - 1) * V), tb = argmax(lb + (size_t)(n - 1) * V);
    for (int i = 0; i < GEN && !rc; i++) {   /* greedy continuations */
        CHECK(ta == tb, "%s %s: greedy token %d: %d against %d", g->name, what, i, tb, ta);
        rc = fwd(g, a, &ta, 1, la + (size_t)(n + i) * V);
        mf_prefix_step_begin(p, s, b, 1);
        if (!rc) rc = fwd(g, b, &tb, 1, lb + (size_t)(n + i) * V);
        mf_prefix_step_end(p, s, b, !rc, 0);
        CHECK(rc == 0 && !memcmp(la + (size_t)(n + i) * V, lb + (size_t)(n + i) * V, sizeof(float) * (size_t)V),
              "%s %s: greedy step %d logits differ", g->name, what, i);
        ta = argmax(la + (size_t)(n + i) * V);
        tb = argmax(lb + (size_t)(n + i) * V);
    }
    mf_prefix_seq_end(p, s, b, 1);
out:
    mf_prefix_seq_free(s);
    mf_ref_state_free(a);
    mf_ref_state_free(b);
    free(la);
    free(lb);
    return h;
}

/* P = A[0..k) followed by m tokens of its own */
static int prompt(int32_t *P, int k, int m, int salt)
{
    memcpy(P, A, sizeof *P * (size_t)k);
    for (int i = 0; i < m; i++) P[k + i] = (int32_t)((k * 31 + i * 17 + salt * 101 + 5) % V);
    return k + m;
}

#endif
