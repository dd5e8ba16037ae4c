/* Speculation's rollback (graphs/ref/ref.h mf_ref_state_mark, mf_ref_state_rollback; docs/dspark.md):
 * a verify of the anchor and k candidates run through a forward, then rolled back to keep j + 1 of
 * its positions, leaves every cache byte-identical to a run that never saw the rejected tokens
 * (window ring, compressed KV and index keys, the ratio-2 compressors' open groups, the token
 * history Engram hashes, the position), and the next tokens' logits bit for bit those of that run.
 * On the tiny preset (window 16, ratio-2 and ratio-1 KV sources, Engram), for every j of 0..k at
 * anchors of both parities and one that wraps the window, through the reference forward and the
 * scheduled engine (a verify as one unit of the engine's graph); and inside an engine batch whose
 * neighbours run one token each, every sequence's caches as its runs alone. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/gen/gen.h"
#include "graphs/layers/layers.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/step.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/tiny_ckpt.h"

enum { MAXP = 64, K = 5, NEXT = 3 };

/* 1 when a and b hold the same caches: byte for byte the position, token history, every layer's
 * ring slots and every ratio-2 compressor's open group; every KV source's entries [0, n), KV and
 * index key, bit for bit as they unpack (the codes and scales' values). */
static int same_state(const mf_config *c, const mf_ref_state *a, const mf_ref_state *b, char *why, size_t nw)
{
    if (a->n_pos != b->n_pos) return snprintf(why, nw, "n_pos %lld vs %lld", (long long)a->n_pos, (long long)b->n_pos), 0;
    if (memcmp(a->tokens, b->tokens, sizeof(int32_t) * (size_t)a->n_pos)) return snprintf(why, nw, "token history"), 0;
    if (memcmp(a->ring, b->ring, (size_t)mf_ly_ring_bytes(c))) return snprintf(why, nw, "window ring"), 0;
    int64_t D = c->head_dim, id = c->index_head_dim;
    float u[2][1024];
    for (int L = 0; L < c->n_layers; L++) {
        if (!mf_config_is_kv_source(c, L)) continue;
        const mf_ly_cache *x = &a->cache[L], *y = &b->cache[L];
        if (x->n != y->n) return snprintf(why, nw, "layer %d: %lld vs %lld entries", L, (long long)x->n, (long long)y->n), 0;
        for (int64_t j = 0; j < x->n; j++) {   /* each entry's KV and index key as stored (every bit) */
            mf_ly_cache_get_kv(c, L, x, j, u[0]);
            mf_ly_cache_get_kv(c, L, y, j, u[1]);
            if (memcmp(u[0], u[1], sizeof(float) * (size_t)D)) return snprintf(why, nw, "layer %d entry %lld", L, (long long)j), 0;
            mf_ly_cache_get_key(c, L, x, j, u[0]);
            mf_ly_cache_get_key(c, L, y, j, u[1]);
            if (memcmp(u[0], u[1], sizeof(float) * (size_t)id))
                return snprintf(why, nw, "layer %d index key %lld", L, (long long)j), 0;
        }
        if (c->compress_ratios[L] == 2 && (memcmp(x->pend_kv, y->pend_kv, sizeof(float) * (size_t)D) ||
                                           memcmp(x->pend_score, y->pend_score, sizeof(float) * (size_t)D)))
            return snprintf(why, nw, "layer %d open group", L), 0;
    }
    return 1;
}

/* One forward of n tokens of st (all with logits into lg, n x V) through eng or r. */
static int fwd(mf_ref *r, mf_step *eng, mf_ref_state *st, const int32_t *tok, int n, float *lg, int64_t V)
{
    mf_ref_state *sts[MAXP];
    float *lp[MAXP];
    for (int i = 0; i < n; i++) sts[i] = st, lp[i] = lg ? lg + (size_t)i * V : NULL;
    return eng ? mf_step_forward(eng, sts, tok, n, lp) : mf_ref_forward(r, sts, tok, n, lp);
}

/* Prompt of n_prompt tokens, then a verify of the anchor and K candidates of which j are kept
 * (rolled back to j + 1 positions), then NEXT more tokens; against the same prompt, the anchor and
 * the j accepted ones run without a verify, then the same NEXT tokens. */
static void check_case(mf_ref *r, mf_step *eng, int n_prompt, int j, const char *who)
{
    const mf_config *c = mf_ref_config(r);
    int64_t V = c->vocab_size;
    int32_t prompt[MAXP], ver[K + 1], next[NEXT];
    for (int i = 0; i < n_prompt; i++) prompt[i] = (int32_t)((i * 37 + 11) % V);
    for (int i = 0; i <= K; i++) ver[i] = (int32_t)((i * 101 + 7 * n_prompt + 3) % V);
    for (int i = 0; i < NEXT; i++) next[i] = (int32_t)((i * 53 + 5) % V);
    /* rejected candidates differ from what the plain run feeds next: position j + 1 gets next[0] */
    float *la = malloc(sizeof(float) * (size_t)V * (K + 1)), *lb = malloc(sizeof(float) * (size_t)V * (K + 1));
    float *na = malloc(sizeof(float) * (size_t)V * NEXT), *nb = malloc(sizeof(float) * (size_t)V * NEXT);
    mf_ref_state *a = NULL, *b = NULL;
    int rc = mf_ref_state_new(r, MAXP + 2 * K, &a);
    if (!rc) rc = mf_ref_state_new(r, MAXP + 2 * K, &b);
    if (!rc) rc = fwd(r, eng, a, prompt, n_prompt, NULL, V);
    if (!rc) rc = fwd(r, eng, b, prompt, n_prompt, NULL, V);
    if (!rc) rc = mf_ref_state_mark(a, K + 1);
    if (!rc) rc = fwd(r, eng, a, ver, K + 1, la, V);
    if (!rc) rc = mf_ref_state_rollback(a, j + 1);
    if (!rc) rc = fwd(r, eng, b, ver, j + 1, lb, V);
    CHECK(rc == 0, "%s prompt %d keep %d: %s", who, n_prompt, j + 1, mf_last_error());
    if (rc) goto out;
    /* the verify's logits of the kept positions are the plain run's */
    CHECK(!memcmp(la, lb, sizeof(float) * (size_t)V * (size_t)(j + 1)), "%s prompt %d keep %d: verify logits differ",
          who, n_prompt, j + 1);
    char why[160];
    CHECK(same_state(c, a, b, why, sizeof why), "%s prompt %d keep %d: after the rollback: %s", who, n_prompt, j + 1, why);
    rc = fwd(r, eng, a, next, NEXT, na, V);
    if (!rc) rc = fwd(r, eng, b, next, NEXT, nb, V);
    CHECK(rc == 0, "%s next: %s", who, mf_last_error());
    if (!rc) {
        CHECK(!memcmp(na, nb, sizeof(float) * (size_t)V * NEXT), "%s prompt %d keep %d: the next tokens' logits differ",
              who, n_prompt, j + 1);
        CHECK(same_state(c, a, b, why, sizeof why), "%s prompt %d keep %d: after the next tokens: %s", who, n_prompt,
              j + 1, why);
    }
out:
    mf_ref_state_free(a);
    mf_ref_state_free(b);
    free(la), free(lb), free(na), free(nb);
}

/* Inside a batch: sequence a verifies K candidates (keeping j + 1) in the same engine forward as
 * neighbours b and c running one token each; a's caches are those of a run of the j + 1 alone, and
 * the neighbours' those of runs without a. */
static void check_batch(mf_ref *r, mf_step *eng, int j)
{
    const mf_config *c = mf_ref_config(r);
    int64_t V = c->vocab_size;
    mf_ref_state *s[3] = {0}, *solo[3] = {0};
    int32_t pr[3][20], ver[K + 1];
    for (int q = 0; q < 3; q++)
        for (int i = 0; i < 20; i++) pr[q][i] = (int32_t)((q * 71 + i * 13 + 1) % V);
    for (int i = 0; i <= K; i++) ver[i] = (int32_t)((i * 31 + 9) % V);
    int rc = 0;
    for (int q = 0; q < 3 && !rc; q++) {
        rc = mf_ref_state_new(r, MAXP, &s[q]);
        if (!rc) rc = mf_ref_state_new(r, MAXP, &solo[q]);
        if (!rc) rc = fwd(r, eng, s[q], pr[q], 11 + q, NULL, V);
        if (!rc) rc = fwd(r, eng, solo[q], pr[q], 11 + q, NULL, V);
    }
    /* one forward: a's verify of 1 + K, then b's and c's next token */
    mf_ref_state *sts[K + 3];
    int32_t tok[K + 3];
    for (int i = 0; i <= K; i++) sts[i] = s[0], tok[i] = ver[i];
    sts[K + 1] = s[1], tok[K + 1] = pr[1][11 + 1];
    sts[K + 2] = s[2], tok[K + 2] = pr[2][12 + 1];
    if (!rc) rc = mf_ref_state_mark(s[0], K + 1);
    if (!rc) rc = mf_step_forward(eng, sts, tok, K + 3, NULL);
    if (!rc) rc = mf_ref_state_rollback(s[0], j + 1);
    if (!rc) rc = fwd(r, eng, solo[0], ver, j + 1, NULL, V);
    if (!rc) rc = fwd(r, eng, solo[1], &tok[K + 1], 1, NULL, V);
    if (!rc) rc = fwd(r, eng, solo[2], &tok[K + 2], 1, NULL, V);
    CHECK(rc == 0, "batch keep %d: %s", j + 1, mf_last_error());
    char why[160];
    for (int q = 0; q < 3 && !rc; q++)
        CHECK(same_state(c, s[q], solo[q], why, sizeof why), "batch keep %d: sequence %d: %s", j + 1, q, why);
    for (int q = 0; q < 3; q++) mf_ref_state_free(s[q]), mf_ref_state_free(solo[q]);
}

/* The journal's refusals. */
static void check_refusals(mf_ref *r)
{
    mf_ref_state *s = NULL;
    int32_t t[2] = {5, 6};
    CHECK(mf_ref_state_new(r, 32, &s) == 0, "%s", mf_last_error());
    CHECK(mf_ref_state_rollback(s, 0) == -EINVAL, "rollback without a mark");
    CHECK(mf_ref_state_mark(s, 0) == -EINVAL, "a mark of 0 positions");
    CHECK(mf_ref_state_mark(s, 2) == 0, "%s", mf_last_error());
    CHECK(mf_ref_state_rollback(s, 1) == -EINVAL, "rollback before the verify ran");
    mf_ref_state *sts[2] = {s, s};
    CHECK(mf_ref_forward(r, sts, t, 2, NULL) == 0, "%s", mf_last_error());
    CHECK(mf_ref_state_rollback(s, 3) == -EINVAL, "keeping more than ran");
    CHECK(mf_ref_state_rollback(s, 1) == 0 && mf_ref_state_pos(s) == 1, "%s", mf_last_error());
    CHECK(mf_ref_state_rollback(s, 1) == -EINVAL, "a second rollback of one mark");
    mf_ref_state_free(s);
}

int main(void)
{
    mf_config c;
    mf_config_preset("tiny", &c);
    char dir[1024];
    if (mf_test_gen_ckpt(&c, "spec_rollback", dir, sizeof dir)) return 1;
    mf_model *m;
    mf_ref *r;
    mf_step *eng;
    if (mf_test_open(dir, 0, &m, &r, &eng)) return 1;
    check_refusals(r);
    /* anchors at even and odd positions, and one whose verify wraps the window (16) */
    const int prompts[] = {9, 10, 14, 33};
    int np = MF_TEST_SANITIZED ? 2 : 4;
    for (int p = 0; p < np; p++)
        for (int j = 0; j <= K; j++) {
            check_case(r, NULL, prompts[p], j, "reference");
            check_case(r, eng, prompts[p], j, "engine");
        }
    for (int j = 0; j <= K; j++) check_batch(r, eng, j);
    mf_step_free(eng);
    mf_ref_free(r);
    mf_model_free(m);
    return mf_check_exit("test_spec_rollback");
}
