/* The DSpark draft (graphs/layers/layer_dspark.c, graphs/ref/ref_dspark.c; docs/dspark.md), on the
 * tiny preset's draft (3 stages, block 5): the loader reads the draft's mtp.* tensors only when
 * asked (plain decoding's memory and logits unchanged, a checkpoint without them still loads and
 * is refused only when the draft is asked for); the features the forward hands out are the same
 * in a prefill and one token at a time; a proposal is deterministic, depends on the context
 * window (positions a-W..a-1) and nothing before it, and comes back bit for bit after a rollback
 * of rejected positions; the greedy chain follows its own logits; bad calls are refused. What the
 * draft computes is checked against the oracle in tests/conformance/dspark. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/gen/gen.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/tiny_ckpt.h"

enum { T = 40 };

typedef struct run {
    int32_t tok[5];
    float conf[5];
    float *logits;   /* 5 x V */
    int32_t routes[3 * 5 * 8];
} run;

/* The prompt's features through the reference forward, one prefill. */
static int features(mf_ref *r, const int32_t *ids, int n, float *feats)
{
    const mf_config *c = mf_ref_config(r);
    int64_t per = (int64_t)c->n_dspark_target * c->hidden_size;
    mf_ref_state *s = NULL;
    float **fp = calloc((size_t)n, sizeof *fp);
    mf_ref_state **st = calloc((size_t)n, sizeof *st);
    int rc = mf_ref_state_new(r, n, &s);
    for (int i = 0; i < n; i++) fp[i] = feats + i * per, st[i] = s;
    if (!rc) rc = mf_ref_forward_feat(r, st, ids, n, NULL, fp);
    mf_ref_state_free(s);
    free(fp);
    free(st);
    return rc;
}

static int propose(mf_ref_draft *d, const mf_ly_draft_state *s, int32_t anchor, run *o)
{
    return mf_ref_draft_propose(d, s, anchor, 5, o->tok, o->conf, o->logits, o->routes);
}

static int same_run(const run *a, const run *b, int64_t V)
{
    return !memcmp(a->tok, b->tok, sizeof a->tok) && !memcmp(a->conf, b->conf, sizeof a->conf) &&
           !memcmp(a->logits, b->logits, sizeof(float) * 5 * (size_t)V) && !memcmp(a->routes, b->routes, sizeof a->routes);
}

/* The draft's tensors are read only when asked for; without them (older gen output: a config with
 * no draft stages, or a checkpoint stripped of its mtp.* tensors) plain decoding is unchanged. */
static void check_loading(const char *dir)
{
    mf_config c;
    mf_config_preset("tiny", &c);
    char old[1200], bare[1300];
    /* the older gen's output: no draft stages at all */
    mf_config co = c;
    co.n_mtp_layers = 0;
    if (mf_test_gen_ckpt(&co, "dspark_old", old, sizeof old)) {
        CHECK(0, "gen old");
        return;
    }
    mf_model *plain = NULL, *with = NULL, *older = NULL;
    CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1}, &plain) == 0, "plain: %s", mf_last_error());
    CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1, .load_draft = 1}, &with) == 0, "draft: %s", mf_last_error());
    CHECK(mf_model_load(old, &(mf_model_opts){.quiet = 1}, &older) == 0, "older: %s", mf_last_error());
    if (plain && with && older) {
        CHECK(mf_model_resident_bytes(plain) == mf_model_resident_bytes(older),
              "plain decoding holds %llu bytes, the checkpoint without a draft %llu",
              (unsigned long long)mf_model_resident_bytes(plain), (unsigned long long)mf_model_resident_bytes(older));
        CHECK(mf_model_resident_bytes(with) >= mf_model_resident_bytes(plain) + mf_config_draft_bytes(&c),
              "with the draft %llu bytes", (unsigned long long)mf_model_resident_bytes(with));
        CHECK(!mf_model_has_draft(plain) && mf_model_has_draft(with) && !mf_model_layer_at(plain, c.n_layers) &&
                  mf_model_layer_at(with, c.n_layers + 2) && mf_model_layer_at(with, c.n_layers + 2)->mk_head.data &&
                  mf_model_layer_at(with, c.n_layers)->main_proj.data && !mf_model_layer_at(with, c.n_layers + 3),
              "draft stages bound only when loaded");
        /* the same logits from all three (the backbone's values depend on names only) */
        mf_ref *r[3] = {NULL, NULL, NULL};
        mf_model *ms[3] = {plain, with, older};
        float *lg[3];
        int32_t ids[8] = {3, 50, 7, 300, 11, 42, 5, 9};
        for (int k = 0; k < 3; k++) {
            lg[k] = malloc(sizeof(float) * (size_t)c.vocab_size);
            mf_ref_state *s = NULL;
            CHECK(mf_ref_new(ms[k], NULL, &r[k]) == 0 && mf_ref_state_new(r[k], 64, &s) == 0 &&
                      mf_ref_prefill(r[k], s, ids, 8, lg[k]) == 0,
                  "model %d: %s", k, mf_last_error());
            mf_ref_state_free(s);
        }
        CHECK(!memcmp(lg[0], lg[1], sizeof(float) * (size_t)c.vocab_size) &&
                  !memcmp(lg[0], lg[2], sizeof(float) * (size_t)c.vocab_size),
              "plain decoding's logits differ with the draft loaded or absent");
        for (int k = 0; k < 3; k++) mf_ref_free(r[k]), free(lg[k]);
    }
    mf_model *m = NULL;
    CHECK(mf_model_load(old, &(mf_model_opts){.quiet = 1, .load_draft = 1}, &m) == -EINVAL && !m &&
              strstr(mf_last_error(), "no draft stages"),
          "the draft asked of a config without one: %s", mf_last_error());
    /* a checkpoint whose config has the draft but not its tensors: the tiny config over the older
     * shards */
    snprintf(bare, sizeof bare, "%s_bare", old);
    char cmd[8000];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s' && cp '%s/config.json' '%s/config.json'", bare, old, bare,
             dir, bare);
    CHECK(system(cmd) == 0, "%s", cmd);
    CHECK(mf_model_load(bare, &(mf_model_opts){.quiet = 1}, &m) == 0, "no mtp tensors, plain: %s", mf_last_error());
    mf_model_free(m);
    m = NULL;
    CHECK(mf_model_load(bare, &(mf_model_opts){.quiet = 1, .load_draft = 1}, &m) == -EINVAL && !m &&
              strstr(mf_last_error(), "mtp.0.main_proj.weight is missing"),
          "no mtp tensors, draft asked for: %s", mf_last_error());
    /* `moeflow info` notes the absence, and exits 0 */
    const char *bin = getenv("MOEFLOW_BIN");
    if (bin) {
        snprintf(cmd, sizeof cmd, "'%s' info '%s'", bin, bare);
        FILE *f = popen(cmd, "r");
        char out[1 << 15] = "";
        size_t n = f ? fread(out, 1, sizeof out - 1, f) : 0;
        out[n] = 0;
        int status = f ? pclose(f) : -1;
        CHECK(status == 0 && strstr(out, "plain decoding only") && strstr(out, "0 missing, 0 mismatched"),
              "info without the draft's tensors: status %d: %s", status, out);
    }
    mf_model_free(plain);
    mf_model_free(with);
    mf_model_free(older);
}

/* Features: a prefill's equal one token at a time (the forward's layer-major order does not
 * matter). */
static void check_features(mf_ref *r, const int32_t *ids, const float *feats)
{
    const mf_config *c = mf_ref_config(r);
    int64_t per = (int64_t)c->n_dspark_target * c->hidden_size;
    float *one = malloc(sizeof(float) * (size_t)per);
    mf_ref_state *s = NULL;
    int same = mf_ref_state_new(r, T, &s) == 0;
    for (int i = 0; i < T && same; i++) {
        float *fp[1] = {one};
        same = mf_ref_forward_feat(r, &s, &ids[i], 1, NULL, fp) == 0 && !memcmp(one, feats + i * per, sizeof(float) * (size_t)per);
    }
    CHECK(same, "features one token at a time differ from the prefill's");
    double rms = 0;
    for (int64_t d = 0; d < per; d++) rms += (double)feats[d] * feats[d];
    CHECK(rms > 0 && isfinite(rms), "features are zero or not finite");
    mf_ref_state_free(s);
    free(one);
}

static void check_draft(mf_ref *r, const int32_t *ids, float *feats)
{
    const mf_config *c = mf_ref_config(r);
    int64_t V = c->vocab_size, per = (int64_t)c->n_dspark_target * c->hidden_size;
    int W = c->sliding_window, a = 30;   /* the anchor: ids[a] at position a, context 14..29 */
    mf_ref_draft *d = NULL;
    mf_ly_draft_state *s = NULL, *s2 = NULL;
    int rc = mf_ref_draft_new(r, &d);
    CHECK(rc == 0, "draft: %s", mf_last_error());
    if (rc) return;
    CHECK(mf_ref_draft_state_new(d, &s) == 0 && mf_ref_draft_state_new(d, &s2) == 0, "states");
    run x[4];
    for (int k = 0; k < 4; k++) x[k].logits = malloc(sizeof(float) * 5 * (size_t)V), memset(x[k].routes, 0, sizeof x[k].routes);
    CHECK(mf_ref_draft_feed(d, s, feats, a) == 0 && s->n_pos == a, "feed: %s", mf_last_error());
    CHECK(propose(d, s, ids[a], &x[0]) == 0 && propose(d, s, ids[a], &x[1]) == 0, "propose: %s", mf_last_error());
    CHECK(same_run(&x[0], &x[1], V), "a proposal is not deterministic (or changed the state)");
    /* the greedy chain: each candidate the argmax of its logits (which include the Markov term of
     * the one before); all finite; routes in range and distinct */
    int chain = 1, finite = 1, routes_ok = 1;
    for (int i = 0; i < 5; i++) {
        const float *lg = x[0].logits + i * V;
        for (int64_t v = 0; v < V; v++) {
            finite &= isfinite(lg[v]);
            chain &= lg[v] < lg[x[0].tok[i]] || (lg[v] == lg[x[0].tok[i]] && v >= x[0].tok[i]);
        }
        finite &= isfinite(x[0].conf[i]);
    }
    for (int q = 0; q < 3 * 5; q++)
        for (int k = 0; k < 2; k++) {
            int e = x[0].routes[q * 2 + k];
            routes_ok &= e >= 0 && e < c->dspark_n_routed_experts && (k == 0 || e != x[0].routes[q * 2]);
        }
    CHECK(chain && finite && routes_ok, "greedy chain %d, finite %d, routes %d", chain, finite, routes_ok);
    /* the Markov term conditions on the token before: another anchor moves position 0's logits */
    CHECK(propose(d, s, (ids[a] + 1) % (int32_t)V, &x[2]) == 0 &&
              memcmp(x[2].logits, x[0].logits, sizeof(float) * (size_t)V) != 0,
          "the anchor does not reach the logits");
    /* a verify that rejects: positions a..a+4 fed (a rejected continuation), rolled back to a: the
     * same proposal, bit for bit; and feeding the same positions from scratch in one go as well */
    float *junk = malloc(sizeof(float) * (size_t)(5 * per));
    for (int64_t k = 0; k < 5 * per; k++) junk[k] = feats[(k + 7 * per) % (T * per)] * 1.5f;
    CHECK(mf_ref_draft_feed(d, s, junk, 5) == 0 && mf_ref_draft_rollback(s, c, a) == 0 && s->n_pos == a, "rollback: %s",
          mf_last_error());
    CHECK(propose(d, s, ids[a], &x[2]) == 0 && same_run(&x[0], &x[2], V), "after a rollback the proposal differs");
    CHECK(mf_ref_draft_feed(d, s, junk, 5) == 0 && mf_ref_draft_rollback(s, c, a - 1) == -EINVAL && s->n_pos == a + 5,
          "a rollback of 6 > block 5 positions refused");
    /* the context is the window a-W..a-1: a change before it does nothing, inside it changes the
     * proposal */
    float keep = feats[(a - W - 1) * per];
    feats[(a - W - 1) * per] += 4.0f;
    CHECK(mf_ref_draft_feed(d, s2, feats, a) == 0 && propose(d, s2, ids[a], &x[3]) == 0 && same_run(&x[0], &x[3], V),
          "a feature before the window changed the proposal");
    feats[(a - W - 1) * per] = keep;
    keep = feats[(a - 1) * per + 3];
    feats[(a - 1) * per + 3] += 4.0f;
    s2->n_pos = 0;
    CHECK(mf_ref_draft_feed(d, s2, feats, a) == 0 && propose(d, s2, ids[a], &x[3]) == 0 &&
              memcmp(x[3].logits, x[0].logits, sizeof(float) * 5 * (size_t)V) != 0,
          "a feature inside the window did not change the proposal");
    feats[(a - 1) * per + 3] = keep;
    /* refusals */
    CHECK(mf_ref_draft_propose(d, s, ids[a], 6, x[3].tok, x[3].conf, NULL, NULL) == -EINVAL &&
              mf_ref_draft_propose(d, s, ids[a], 0, x[3].tok, x[3].conf, NULL, NULL) == -EINVAL &&
              mf_ref_draft_propose(d, s, (int32_t)V, 2, x[3].tok, x[3].conf, NULL, NULL) == -EINVAL,
          "bad proposals refused");
    printf("draft at anchor %d: candidates %d %d %d %d %d, confidence logits %.3f %.3f %.3f %.3f %.3f\n", a, x[0].tok[0],
           x[0].tok[1], x[0].tok[2], x[0].tok[3], x[0].tok[4], x[0].conf[0], x[0].conf[1], x[0].conf[2], x[0].conf[3],
           x[0].conf[4]);
    free(junk);
    for (int k = 0; k < 4; k++) free(x[k].logits);
    mf_ref_draft_state_free(s);
    mf_ref_draft_state_free(s2);
    mf_ref_draft_free(d);
}

int main(void)
{
    mf_config c;
    CHECK(mf_config_preset("tiny", &c) == 0, "preset");
    char dir[1200];
    if (mf_test_gen_ckpt(&c, "dspark_tiny", dir, sizeof dir)) return 1;
    check_loading(dir);
    mf_model *m = NULL;
    mf_ref *r = NULL;
    int rc = mf_model_load(dir, &(mf_model_opts){.quiet = 1, .load_draft = 1}, &m);
    if (!rc) rc = mf_ref_new(m, NULL, &r);
    CHECK(rc == 0, "%s", mf_last_error());
    if (!rc) {
        int32_t ids[T];
        for (int i = 0; i < T; i++) ids[i] = (int32_t)((i * 37 + 11) % c.vocab_size);
        int64_t per = (int64_t)c.n_dspark_target * c.hidden_size;
        float *feats = malloc(sizeof(float) * (size_t)(T * per));
        CHECK(features(r, ids, T, feats) == 0, "features: %s", mf_last_error());
        check_features(r, ids, feats);
        check_draft(r, ids, feats);
        free(feats);
        /* the draft of a model loaded without it */
        mf_model *plain = NULL;
        mf_ref *rp = NULL;
        mf_ref_draft *d = NULL;
        CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1}, &plain) == 0 && mf_ref_new(plain, NULL, &rp) == 0 &&
                  mf_ref_draft_new(rp, &d) == -EINVAL && strstr(mf_last_error(), "load_draft"),
              "a draft without its tensors: %s", mf_last_error());
        mf_ref_free(rp);
        mf_model_free(plain);
    }
    mf_ref_free(r);
    mf_model_free(m);
    return mf_check_exit("test_dspark");
}
