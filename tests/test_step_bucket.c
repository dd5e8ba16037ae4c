/* Steps of several sequences by bucket (graphs/step/stepgraph.h mf_sg_bucket, mf_stepgraph_set_live;
 * the engine's parallel and mixed graphs, graphs/step/step.h mf_step_graph): the builder's buckets,
 * dead items (noop marks, cut records, a dead micro-batch's slots), the mixed graph's shape (its
 * compressor from the item before, a kv join, the ring after the oa join, one micro-batch); then on
 * tiny, 512-item shapes: a mixed step of 512 (chunks beside single tokens), a parallel step of 512,
 * a mixed step of 339 live items whose chunk passes the sliding window, a parallel step of 300
 * live, every logit vector bit for bit (memcmp) the same sequence's run alone; the same shapes for
 * other compositions build nothing; the continuous batcher run twice builds nothing the second
 * time. Under the sanitizers the same 512-item shapes (tests/check.h), a third of the sequences
 * checked alone, fewer batcher requests. A dead item that ran (its stale state and token from an
 * earlier step of the bucket, e.g. mf_stepgraph_set_live leaving the kv tasks uncut) fails both the
 * cut check and the engine's steps: tried by hand, the 339-live step then errs and 300 logit rows
 * differ from their sequences alone. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/model/config.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/batch.h"
#include "graphs/step/step.h"
#include "graphs/step/stepgraph.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/tiny_ckpt.h"

#define N 512                              /* the largest bucket */
#define MAX_POS 64                         /* positions a sequence reaches here */
#define N_STEPS 4

static int64_t g_V;

static int32_t tok_of(int s, int pos) { return (int32_t)((pos * 53 + s * 97 + (pos * s) % 11 + 1) % g_V); }

/* ---- the builder ------------------------------------------------------------------------------- */

/* A graph of tiny: n items, parallel or mixed, micro-batches. */
static mf_stepgraph *graph_of(const mf_config *c, const mf_sg_sizes *sz, const mf_sg_lanes *lt, int n, int mixed,
                              int micro)
{
    mf_stepgraph *sg = NULL;
    mf_sg_opts o = {.c = c, .sz = sz, .n = n, .par = !mixed, .mixed = mixed, .n_threads = 2, .lanes = lt->lane,
                    .n_lanes = lt->n_lanes, .lane_io = lt->lane_io, .lane_dev0 = lt->lane_dev0, .micro = micro};
    CHECK(mf_stepgraph_new(&o, &sg) == 0, "graph of %d (mixed %d, micro %d): %s", n, mixed, micro, mf_last_error());
    return sg;
}

/* After mf_stepgraph_set_live(sg, live): every task over items is cut at live, noop exactly when it
 * has none left; returns the noop ones. */
static int check_live(const mf_stepgraph *sg, int live)
{
    int noop = 0, bad = 0;
    for (int t = 0; t < sg->n_tasks; t++) {
        const mf_sg_task *r = &sg->task[t];
        int full = sg->live_i1[t];
        if (full < 0) continue;
        int want = full < live ? full : live > r->i0 ? live : r->i0, dead = mf_graph_noop(sg->g, t);
        if (r->i1 != want || dead != (want == r->i0) || (sg->live_tok[t] && r->n_tok != r->i1 - r->i0)) bad++;
        noop += dead;
    }
    CHECK(!bad && sg->n_live == live, "live %d: %d tasks cut wrong", live, bad);
    return noop;
}

static void test_builder(const mf_config *c)
{
    static const int in[] = {1, 2, 3, 5, 64, 65, 129, 300, 512, 600}, out[] = {1, 2, 4, 8, 64, 128, 256, 512, 512, 512};
    for (size_t k = 0; k < sizeof in / sizeof in[0]; k++)
        CHECK(mf_sg_bucket(in[k]) == out[k], "bucket of %d: %d (expected %d)", in[k], mf_sg_bucket(in[k]), out[k]);
    mf_sg_sizes *sz = NULL;
    CHECK(mf_sg_sizes_new(c, &sz) == 0, "sizes: %s", mf_last_error());
    if (!sz) return;
    mf_sg_lanes lt;
    mf_lane_model models[4];
    mf_step_lane_models(NULL, 2, models);
    mf_sg_lanes_init(&lt, models, 2, 0, 0);
    /* a parallel graph of 512: 128 units of 4 sequences; cut at 300, back to 512 */
    mf_stepgraph *sg = graph_of(c, sz, &lt, N, 0, 2);
    if (sg) {
        CHECK(sg->n_units == MF_SG_MAX_GROUPS && sg->unit_end[0] == 4 && sg->n_halves == 2 && sg->half_end[0] == 256,
              "parallel 512: %d units, the first of %d items, %d halves", sg->n_units, sg->unit_end[0], sg->n_halves);
        int kv = 0, mix = 0;
        for (int t = 0; t < sg->n_tasks; t++) {
            kv += sg->task[t].op == MF_SG_ATTN_KV && sg->task[t].layer == 0;
            mix += sg->task[t].op == MF_SG_ATTN_MIX && sg->task[t].layer == 0 && sg->task[t].i1 - sg->task[t].i0 == 16;
        }
        CHECK(kv == MF_SG_MAX_GROUPS && mix == N / 16 && sg->mix_groups == 4,
              "parallel 512: %d kv tasks a layer (expected one per unit), %d mixes of 16 items (expected %d)", kv, mix,
              N / 16);
        CHECK(check_live(sg, N) == 0, "all live: noop item tasks");
        int n300 = check_live((mf_stepgraph_set_live(sg, 300), sg), 300);
        CHECK(n300 > 0, "300 live: no dead task");
        mf_stepgraph_set_live(sg, 200);   /* half 1 (items 256..511) all dead: its route, slots */
        check_live(sg, 200);
        int slots_live = 0, routes_live = 0;
        for (int t = 0; t < sg->n_tasks; t++) {
            const mf_sg_task *r = &sg->task[t];
            if (r->half != 1) continue;
            slots_live += r->slot >= 0 && !mf_graph_noop(sg->g, t);
            routes_live += r->op == MF_SG_ROUTE && !mf_graph_noop(sg->g, t);
        }
        CHECK(!slots_live && !routes_live, "200 live: half 1 has %d slot tasks, %d routes not noop", slots_live,
              routes_live);
        CHECK(check_live((mf_stepgraph_set_live(sg, N), sg), N) == 0, "back to 512: noop item tasks");
        mf_stepgraph_free(sg);
    }
    /* a mixed graph: one micro-batch, the compressor from the item before, a kv join before the
     * cores, every ring after the oa join */
    sg = graph_of(c, sz, &lt, 64, 1, 2);
    if (sg) {
        CHECK(sg->n_halves == 1 && sg->ring_late && sg->n_units == 64, "mixed: %d halves, ring late %d, %d units",
              sg->n_halves, sg->ring_late, sg->n_units);
        int bad_kv = 0, rings = 0, rings_after = 0, cores = 0, cores_after = 0;
        for (int t = 0; t < sg->n_tasks; t++) {
            const mf_sg_task *r = &sg->task[t];
            if (r->op == MF_SG_ATTN_KV) bad_kv += r->part != 2;
            if (r->op != MF_SG_ATTN_RING && r->op != MF_SG_ATTN_CORE) continue;
            const mf_task_id *pr = mf_graph_pred(sg->g, t);
            int after = 0;
            for (int k = 0; k < mf_graph_n_pred(sg->g, t); k++)
                after |= strstr(mf_graph_task(sg->g, pr[k])->name, r->op == MF_SG_ATTN_RING ? "oa join" : "kv join") != NULL;
            if (r->op == MF_SG_ATTN_RING) rings++, rings_after += after;
            else cores++, cores_after += after;
        }
        CHECK(!bad_kv && rings == 64 * c->n_layers && rings_after == rings && cores_after == cores && cores > 0,
              "mixed: %d kv tasks not part 2, %d of %d rings after the oa join, %d of %d cores after the kv join", bad_kv,
              rings_after, rings, cores_after, cores);
        mf_stepgraph_free(sg);
    }
    mf_sg_sizes_free(sz);
}

/* ---- the engine --------------------------------------------------------------------------------- */

/* One step's items: n (sequence, number of positions) runs; logits at each run's last item. */
typedef struct step_plan {
    int n;
    int seq[N], len[N];
} step_plan;

/* The steps: a mixed step of 512 (sequences 0..127 three positions, 128..255 one), a parallel one of
 * 512 (0..511 one each), a mixed one of 339 live (sequence 0 forty positions: past the window of 16,
 * 1..299 one each), a parallel one of 300 live. */
static void plans_of(step_plan *p)
{
    memset(p, 0, sizeof *p * N_STEPS);
    for (int s = 0; s < 256; s++) p[0].seq[p[0].n] = s, p[0].len[p[0].n++] = s < 128 ? 3 : 1;
    for (int s = 0; s < N; s++) p[1].seq[p[1].n] = s, p[1].len[p[1].n++] = 1;
    for (int s = 0; s < 300; s++) p[2].seq[p[2].n] = s, p[2].len[p[2].n++] = s ? 1 : 40;
    for (int s = 0; s < 300; s++) p[3].seq[p[3].n] = s, p[3].len[p[3].n++] = 1;
}

/* Runs the plans batched; row s * MAX_POS + pos of lg gets the logits of sequence s at position
 * pos where have[] says so; pos[s] the positions sequence s reached. 0 or the engine's error. */
static int run_batched(mf_ref *r, mf_step *e, const step_plan *p, mf_ref_state **st, float *lg, uint8_t *have,
                       int *pos)
{
    static mf_ref_state *sts[2 * N];
    static int32_t tk[2 * N];
    static float *out[2 * N];
    int rc = 0;
    for (int s = 0; s < N && !rc; s++) rc = mf_ref_state_new(r, MAX_POS, &st[s]);
    for (int k = 0; k < N_STEPS && !rc; k++) {
        int n = 0;
        for (int j = 0; j < p[k].n; j++) {
            int s = p[k].seq[j];
            for (int q = 0; q < p[k].len[j]; q++, pos[s]++) {
                sts[n] = st[s];
                tk[n] = tok_of(s, pos[s]);
                out[n] = q == p[k].len[j] - 1 ? lg + ((size_t)s * MAX_POS + pos[s]) * g_V : NULL;
                if (out[n]) have[s * MAX_POS + pos[s]] = 1;
                n++;
            }
        }
        rc = mf_step_forward(e, sts, tk, n, out);
        const mf_stepgraph *sg = mf_step_graph(e, n, k % 2 ? MF_STEP_GRAPH_PAR : MF_STEP_GRAPH_MIXED);
        CHECK(!rc && sg && sg->n == N && sg->n_live == n, "step %d of %d items: graph of %d, %d live (%s)", k, n,
              sg ? sg->n : -1, sg ? sg->n_live : -1, rc ? mf_last_error() : "ran");
    }
    return rc;
}

/* Each sequence alone: its pos[s] positions in one forward, logits where the batched run had them;
 * each the same bits. */
static void check_alone(mf_step *e, mf_ref_state **st, const float *lg, const uint8_t *have, const int *pos)
{
    static int32_t tk[MAX_POS];
    static mf_ref_state *sts[MAX_POS];
    static float *out[MAX_POS];
    float *mine = malloc(sizeof(float) * (size_t)MAX_POS * g_V);
    int bad = 0, rows = 0, n_seq = 0;
    for (int s = 0; s < N && mine; s += MF_TEST_SANITIZED ? 3 : 1) {   /* sanitizers: a third of them */
        int n = pos[s];
        if (!n) continue;
        mf_ref_state_reset(st[s]);
        for (int i = 0; i < n; i++) {
            sts[i] = st[s];
            tk[i] = tok_of(s, i);
            out[i] = have[s * MAX_POS + i] ? mine + (size_t)i * g_V : NULL;
        }
        int rc = mf_step_forward(e, sts, tk, n, out);
        CHECK(!rc, "sequence %d alone: %s", s, mf_last_error());
        for (int i = 0; i < n && !rc; i++)
            if (out[i]) {
                rows++;
                bad += memcmp(out[i], lg + ((size_t)s * MAX_POS + i) * g_V, sizeof(float) * (size_t)g_V) != 0;
            }
        n_seq++;
    }
    CHECK(rows > (MF_TEST_SANITIZED ? 400 : 1000) && !bad, "%d of %d logit rows (%d sequences) differ from the sequence alone",
          bad, rows, n_seq);
    printf("bucket: %d logit rows of %d sequences bit for bit their runs alone\n", rows, n_seq);
    free(mine);
}

/* The continuous batcher over the engine: requests of mixed lengths at max_batch 24, run twice; the
 * second run builds no shape. */
static void test_batcher(mf_ref *r, mf_step *e)
{
    int n_req = MF_TEST_SANITIZED ? 16 : 48;
    int32_t prompt[40];
    int64_t built[2];
    for (int pass = 0; pass < 2; pass++) {
        mf_batch *b = NULL;
        CHECK(mf_batch_new(&(mf_batch_opts){.ref = r, .eng = e, .max_batch = 24, .step_tokens = 40,
                                            .max_context = 64, .max_queue = n_req}, &b) == 0,
              "batcher: %s", mf_last_error());
        if (!b) return;
        for (int q = 0; q < n_req; q++) {
            int np = 2 + (q * 7) % 37;
            for (int i = 0; i < np; i++) prompt[i] = tok_of(q, i);
            CHECK(mf_batch_submit(b, &(mf_batch_req){.prompt = prompt, .n_prompt = np, .max_tokens = 1 + q % 9,
                                                     .ignore_eos = 1}, NULL) == 0, "submit: %s", mf_last_error());
        }
        mf_step_build_stats b0, b1;
        mf_step_builds(e, &b0);
        mf_batch_stats bs;
        int items = 1, steps = 0;
        while (items && steps < 10000) {
            CHECK(mf_batch_step(b, &items) == 0, "step: %s", mf_last_error());
            steps++;
        }
        mf_step_builds(e, &b1);
        mf_batch_get_stats(b, &bs);
        built[pass] = b1.n_built - b0.n_built;
        printf("bucket: batcher pass %d: %d steps, %lld items, %lld shapes built\n", pass, steps, (long long)bs.items,
               (long long)built[pass]);
        mf_batch_free(b);
    }
    CHECK(built[1] == 0, "the second batcher run built %lld shapes", (long long)built[1]);
}

int main(void)
{
    mf_config c;
    CHECK(mf_config_preset("tiny", &c) == 0, "preset");
    g_V = c.vocab_size;
    test_builder(&c);
    char dir[1024];
    if (mf_test_gen_ckpt(&c, "bucket_tiny", dir, sizeof dir)) return 1;
    mf_model *m = NULL;
    mf_ref *r = NULL;
    mf_step *e = NULL;
    CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1}, &m) == 0 && mf_ref_new(m, NULL, &r) == 0,
          "load: %s", mf_last_error());
    CHECK(r && mf_step_new(r, &(mf_step_opts){.n_threads = MF_TEST_SANITIZED ? 2 : 3, .max_batch = N}, &e) == 0,
          "engine: %s", mf_last_error());
    static step_plan plan[N_STEPS];
    static mf_ref_state *st[N];
    plans_of(plan);
    float *lg = calloc((size_t)N * MAX_POS * (size_t)g_V, sizeof(float));
    uint8_t *have = calloc((size_t)N * MAX_POS, 1);
    if (e && lg && have) {
        mf_step_build_stats b0, b1;
        static int pos[N];
        CHECK(run_batched(r, e, plan, st, lg, have, pos) == 0, "batched: %s", mf_last_error());
        check_alone(e, st, lg, have, pos);
        /* other compositions of the same buckets (257 to 500 sequences, up to 429 items): nothing built */
        for (int s = 0; s < N; s++) mf_ref_state_reset(st[s]), pos[s] = 0;
        for (int k = 0; k < N_STEPS; k++) {
            plan[k].n = k % 2 ? 200 + 100 * k : 257 + 50 * k;
            for (int j = 0; j < plan[k].n; j++) plan[k].seq[j] = j, plan[k].len[j] = k % 2 ? 1 : 1 + (j % 5 == 0);
        }
        mf_step_builds(e, &b0);
        int rc = 0;
        static mf_ref_state *sts[2 * N];
        static int32_t tk[2 * N];
        for (int k = 0; k < N_STEPS && !rc; k++) {
            int n = 0;
            for (int j = 0; j < plan[k].n; j++)
                for (int q = 0; q < plan[k].len[j]; q++, n++) sts[n] = st[plan[k].seq[j]], tk[n] = tok_of(j, pos[j]++);
            rc = mf_step_forward(e, sts, tk, n, NULL);
        }
        mf_step_builds(e, &b1);
        CHECK(!rc && b1.n_built == b0.n_built, "other compositions: %s, %lld shapes built", rc ? mf_last_error() : "ran",
              (long long)(b1.n_built - b0.n_built));
        test_batcher(r, e);
    }
    for (int s = 0; s < N; s++) mf_ref_state_free(st[s]);
    free(lg);
    free(have);
    mf_step_free(e);
    mf_ref_free(r);
    mf_model_free(m);
    return mf_check_exit("test_step_bucket");
}
