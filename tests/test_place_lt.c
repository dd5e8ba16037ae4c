/* The cuBLASLt path in the step graph, the simulator and the engine (graphs/step/stepgraph.h "The
 * cuBLASLt path"; stepgraph_lt.c, step_dense.c, step_moe_cards.c): which dense records take it (the
 * sublayers that read bf16 values, by the cost model on the seed host's profile at a prefill
 * chunk's tokens, not at a decode batch's, never without a tensor-core rate), one dequantization
 * task per layer, card and sublayer before its GEMMs and after the GEMMs of two layers before that
 * read the same scratch, the scratch in the card buffers, the routed experts' choice and the
 * simulator's prices of them; then the engine on emulated cards of both 16-bit types
 * (emu:N,tc=bf16|fp16) with the dense linears on the path (--cublaslt dense): logits bit for bit
 * the host placement's (memcmp), layers and rows splits, item blocks, two micro-batches, routed
 * experts on the host and hybrid, and the path taken (its launches counted); a card without tensor
 * cores (tc=none) leaves it; the routed experts on it (--cublaslt on): their slots took it, the
 * logits within 5% of the host's (x and h cast to 16 bits where the int8 path quantizes them to 8:
 * not the same bits, docs/device.md). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/dev.h"
#include "graphs/model/config.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/sim/plan.h"
#include "graphs/step/step.h"
#include "graphs/step/stepgraph.h"
#include "sched/error.h"
#include "sched/profile.h"
#include "tests/check.h"
#include "tests/step_run.h"
#include "tests/tiny_ckpt.h"

#define N_PROMPT 24

static int64_t g_V;
static mf_profile g_seed;

/* flash41's graph of n items (serial: a prefill chunk; else a decode batch) with its dense work on 4
 * cards split by rows and its routed experts on them, priced on prof (NULL: the built-in machine). */
static mf_stepgraph *flash_graph(const mf_config *c, const mf_sg_sizes *sz, int n, int lt, const mf_profile *prof)
{
    mf_lane_model m[4] = {{.bytes_per_s = 1e9}, {.bytes_per_s = 1e9}, {.bytes_per_s = 1e9}, {.bytes_per_s = 1e9}};
    mf_sg_lanes lanes;
    mf_sg_lanes_init(&lanes, m, 8, 0, 4);
    mf_stepgraph *sg = NULL;
    int rc = mf_stepgraph_new(&(mf_sg_opts){.c = c, .sz = sz, .n = n, .par = n <= MF_SG_MAX_ITEMS && n > 1,
                                            .n_threads = 8, .n_cards = 4, .n_dense_cards = 4,
                                            .dense_split = MF_SG_SPLIT_ROWS, .lanes = lanes.lane,
                                            .n_lanes = lanes.n_lanes, .lane_io = lanes.lane_io,
                                            .lane_dev0 = lanes.lane_dev0, .profile = prof, .lt = lt},
                              &sg);
    CHECK(rc == 0, "flash41 graph of %d, mode %d: %s", n, lt, mf_last_error());
    return sg;
}

/* 1 when task q is among t's predecessors. */
static int has_pred(const mf_stepgraph *sg, mf_task_id t, mf_task_id q)
{
    const mf_task_id *p = mf_graph_pred(sg->g, t);
    for (int k = 0; k < mf_graph_n_pred(sg->g, t); k++)
        if (p[k] == q) return 1;
    return 0;
}

/* The records and order of a 2,048-position chunk (512 under the sanitizers) on the seed host's
 * profile. */
static void test_graph(const mf_config *c, const mf_sg_sizes *sz)
{
    int n = MF_TEST_SANITIZED ? 512 : 2048;
    mf_stepgraph *sg = flash_graph(c, sz, n, MF_SG_LT_COST, &g_seed);
    if (!sg) return;
    int NL = c->n_layers, n_lt = 0, n_deq = 0, bad = 0;
    /* deq[L][card][d]: the layer's dequantization task */
    mf_task_id *deq = malloc(sizeof *deq * (size_t)NL * 4 * MF_SG_N_DENSE);
    for (int i = 0; i < NL * 4 * MF_SG_N_DENSE; i++) deq[i] = -1;
    for (int t = 0; t < sg->n_tasks; t++) {
        const mf_sg_task *r = &sg->task[t];
        if (r->op != MF_SG_DENSE_DEQ) continue;
        n_deq++;
        mf_task_id *slot = &deq[((size_t)r->layer * 4 + r->card) * MF_SG_N_DENSE + r->dense];
        bad += *slot >= 0 || !mf_sg_lt_dense_ok(r->dense, 0) || !(r->w.macs[MF_KF_FP8] > 0);
        *slot = t;
    }
    for (int t = 0; t < sg->n_tasks; t++) {
        const mf_sg_task *r = &sg->task[t];
        if (r->op != MF_SG_DENSE) {
            bad += r->lin_path != MF_DEV_LIN_AUTO;
            continue;
        }
        if (r->lin_path != MF_DEV_LIN_CUBLASLT) {
            /* at n tokens every sublayer that may take it does (the cost model's choice) */
            bad += mf_sg_lt_dense_ok(r->dense, 0) && r->w.macs[MF_KF_FP8] > 0;
            continue;
        }
        n_lt++;
        mf_task_id q = deq[((size_t)r->layer * 4 + r->card) * MF_SG_N_DENSE + r->dense];
        CHECK(q >= 0 && has_pred(sg, t, q), "task %d (layer %d card %d sublayer %d): no dequantization before it", t,
              r->layer, r->card, r->dense);
        /* the layer two later (the same scratch) dequantizes after it */
        mf_task_id q2 = r->layer + 2 < NL ? deq[((size_t)(r->layer + 2) * 4 + r->card) * MF_SG_N_DENSE + r->dense] : -1;
        if (q2 >= 0) CHECK(has_pred(sg, q2, t), "layer %d's dequantization before task %d of layer %d reads its scratch",
                           r->layer + 2, t, r->layer);
    }
    printf("test_place_lt: flash41, %d positions, seed host: %d dense card works on the cuBLASLt path, %d "
           "dequantizations; routed experts %s\n", n, n_lt, n_deq, sg->lt_ffn ? "may take it" : "never");
    CHECK(!bad && n_lt > 0 && n_deq >= 4 * NL * 4, "%d records off the rule, %d on the path, %d dequantizations", bad,
          n_lt, n_deq);
    CHECK(sg->lt_ffn && sg->lt_ffn_tok == (n < MF_SG_LT_FFN_TOK ? n : MF_SG_LT_FFN_TOK), "experts: lt_ffn %d, %d "
          "tokens a call", sg->lt_ffn, sg->lt_ffn_tok);
    /* the scratch: every sublayer on the path sized, the card buffers hold two layers' and the cast */
    mf_sg_card_in ci = {.c = c, .sg = sg, .sh_rows = (int64_t)sz->sh_rows};
    mf_sg_card_bufs b, b0;
    mf_sg_card_bufs_of(&ci, &b);
    mf_stepgraph *off = flash_graph(c, sz, n, MF_SG_LT_OFF, &g_seed);
    int off_bad = 0;
    for (int t = 0; off && t < off->n_tasks; t++)
        off_bad += off->task[t].op == MF_SG_DENSE_DEQ || off->task[t].lin_path != MF_DEV_LIN_AUTO;
    CHECK(off && !off_bad && !off->lt_ffn, "mode off: %d records on the path", off_bad);
    ci.sg = off;
    if (off) mf_sg_card_bufs_of(&ci, &b0);
    size_t w16 = 0;
    for (int d = 0; d < MF_SG_N_DENSE; d++) {
        CHECK((sg->lt_w16[d] > 0) == mf_sg_lt_dense_ok(d, 0), "sublayer %d: %zu bytes of scratch", d, sg->lt_w16[d]);
        w16 += (sg->lt_w16[d] + 255) / 256 * 256;
    }
    CHECK(b.lt_w16_par == w16 && b.lt_x16_bytes == sg->lt_x16 && b.lt_x16_bytes > 0 && b.lt_ws_bytes == MF_DEV_LT_WS_BYTES,
          "dense scratch %zu a layer (expected %zu), cast %zu", b.lt_w16_par, w16, b.lt_x16_bytes);
    if (off)
        CHECK(b.dense_bytes >= b0.dense_bytes + 2 * w16 + sg->lt_x16 + MF_DEV_LT_WS_BYTES &&
                  b.routed_bytes > b0.routed_bytes + 3 * (size_t)c->hidden_size * c->moe_intermediate_size * 2,
              "buffers with the path: dense %zu (off %zu), routed %zu (off %zu)", b.dense_bytes, b0.dense_bytes,
              b.routed_bytes, b0.routed_bytes);
    free(deq);
    mf_stepgraph_free(sg);
    mf_stepgraph_free(off);
    /* a decode batch's tokens stay on the CUDA cores; no tensor-core rate: never */
    static const struct { int n; int builtin; } none[] = {{16, 0}, {512, 1}};
    for (int k = 0; k < 2; k++) {
        mf_stepgraph *g = flash_graph(c, sz, none[k].n, MF_SG_LT_COST, none[k].builtin ? NULL : &g_seed);
        int on = 0;
        for (int t = 0; g && t < g->n_tasks; t++) on += g->task[t].lin_path != MF_DEV_LIN_AUTO;
        CHECK(g && !on && g->lt_w16[MF_SG_D_ATTN_QB] == 0 && !g->lt_ffn, "%d items%s: %d records on the path",
              none[k].n, none[k].builtin ? " (built-in machine)" : "", on);
        mf_stepgraph_free(g);
    }
}

/* The experts' choice and price (mf_sg_ffn_lt) and the simulator's first token with and without the
 * path: the dequantizations priced on the copy-in lanes, the path shortening the chunk. */
static void test_sim(const mf_config *c, const mf_sg_sizes *sz)
{
    mf_work ew;
    mf_sg_expert_work(c, sz, &ew);
    mf_cost_model m = {.p = &g_seed}, b = {.p = mf_cost_default_profile()};
    double ns1, ns2;
    CHECK(!mf_sg_ffn_lt(&m, &ew, 1, MF_SG_LT_COST, &ns1) && ns1 == mf_cost_card_on(&m, &ew, 1, 0),
          "an expert of 1 token: the int8 path");
    CHECK(mf_sg_ffn_lt(&m, &ew, 128, MF_SG_LT_COST, &ns2) &&
              ns2 == mf_cost_card_lt(&m, MF_KF_FP4, ew.w_bytes[MF_KF_FP4], ew.macs[MF_KF_FP4], 1, 128) &&
              ns2 < mf_cost_card_on(&m, &ew, 128, 0),
          "an expert of 128 tokens: the tensor cores (%.0f ns)", ns2);
    CHECK(!mf_sg_ffn_lt(&m, &ew, 128, MF_SG_LT_DENSE, NULL) && !mf_sg_ffn_lt(&b, &ew, 4096, MF_SG_LT_COST, NULL) &&
              mf_sg_ffn_lt(&b, &ew, 1, MF_SG_LT_ON, &ns1) && ns1 == mf_cost_card_on(&b, &ew, 1, 0),
          "modes dense, cost without a rate, on");
    int64_t ttft[2] = {0};
    mf_plan_report r[2];
    for (int k = 0; k < 2; k++) {
        mf_plan_opts po = {.config = c, .profile = &g_seed, .placement = MF_STEP_PLACE_HYBRID,
                           .dense = MF_PLAN_DENSE_CARDS, .dense_split = MF_SG_SPLIT_ROWS, .seed = 5,
                           .lt = k ? MF_SG_LT_OFF : MF_SG_LT_COST};
        CHECK(mf_plan_prefill(&po, 2048, 2048, &r[k], &ttft[k]) == 0, "plan prefill (mode %d): %s", po.lt,
              mf_last_error());
    }
    printf("test_place_lt: simulated first token of 2,048 on the seed host: %.3f s with the cuBLASLt path, %.3f s "
           "without; dequantizations %.1f ms on the copy-in lanes\n", ttft[0] / 1e9, ttft[1] / 1e9,
           r[0].op_other_ns[MF_SG_DENSE_DEQ] / 1e6);
    CHECK(ttft[0] < ttft[1] && r[0].op_other_ns[MF_SG_DENSE_DEQ] > 0 && r[1].op_tasks[MF_SG_DENSE_DEQ] == 0,
          "first token %lld ns (cost) against %lld (off)", (long long)ttft[0], (long long)ttft[1]);
    CHECK(r[0].op_other_ns[MF_SG_DENSE] < r[1].op_other_ns[MF_SG_DENSE] &&
              r[0].op_other_ns[MF_SG_DEV_FFN] < r[1].op_other_ns[MF_SG_DEV_FFN],
          "card work: dense %lld / %lld ns, experts %lld / %lld", (long long)r[0].op_other_ns[MF_SG_DENSE],
          (long long)r[1].op_other_ns[MF_SG_DENSE], (long long)r[0].op_other_ns[MF_SG_DEV_FFN],
          (long long)r[1].op_other_ns[MF_SG_DEV_FFN]);
}

static int32_t prompt_tok(int s, int i) { return (int32_t)((i * 37 + s * 101 + (i * i) % 13) % g_V); }

static int run(mf_ref *r, mf_step *e, int n_seq, int n_dec, int32_t *toks, int fill, float *out)
{
    return mf_test_run_steps(r, e, g_V, n_seq, N_PROMPT, prompt_tok, n_dec, toks, fill, out);
}

/* max |a - b| / max |b| over n values */
static double rel_err(const float *a, const float *b, size_t n)
{
    double md = 0, mh = 0;
    for (size_t i = 0; i < n; i++) {
        double df = fabs((double)a[i] - b[i]);
        if (!(df <= md)) md = df;
        if (fabs(b[i]) > mh) mh = fabs(b[i]);
    }
    return mh > 0 ? md / mh : md;
}

/* One engine on spec against the host's logits: bit for bit (bound < 0) or within bound (relative
 * to the largest); *dst its last call's device counters. */
static void check_engine(mf_ref *r, const char *spec, mf_step_opts o, int b, int n_dec, int32_t *toks,
                         const float *host, double bound, mf_step_dev_stats *dst)
{
    size_t per = (size_t)b * (1 + n_dec) * g_V;
    float *got = calloc(per, sizeof(float));
    mf_dev *d = NULL;
    mf_step *e = NULL;
    memset(dst, 0, sizeof *dst);
    CHECK(mf_dev_open(spec, &d) == 0, "open %s: %s", spec, mf_last_error());
    o.dev = d;
    o.n_threads = 2;
    int rc = d ? mf_step_new(r, &o, &e) : -1;
    CHECK(rc == 0, "%s: %s", spec, mf_last_error());
    if (e) {
        rc = run(r, e, b, n_dec, toks, 0, got);
        CHECK(rc == 0, "%s mode %d split %d batch %d: %s", spec, o.lt, o.dense_split, b, mf_last_error());
        mf_step_last_dev(e, dst);
        double re = rel_err(got, host, per);
        if (bound < 0)
            CHECK(!rc && !memcmp(host, got, sizeof(float) * per),
                  "%s mode %d placement %d split %d batch %d micro %d blocks %d: logits differ from the host "
                  "placement's (rel %.3e)", spec, o.lt, o.placement, o.dense_split, b, o.micro, o.dense_block, re);
        else
            CHECK(!rc && re <= bound, "%s mode %d placement %d batch %d: logits rel err %.3e (bound %.3e)", spec, o.lt,
                  o.placement, b, re, bound);
        if (bound >= 0)
            printf("test_place_lt: %s batch %d, routed experts on the cuBLASLt path: logits rel err %.3e against the "
                   "int8 path's (bound %.3e)\n", spec, b, re, bound);
        mf_step_free(e);
    }
    mf_dev_close(d);
    free(got);
}

static void test_engine(mf_ref *r)
{
    int n_dec = MF_TEST_SANITIZED ? 2 : 4;
    static const int bs[] = {1, 3};
    for (int bi = 0; bi < 2; bi++) {
        int b = bs[bi];
        size_t per = (size_t)b * (1 + n_dec) * g_V;
        float *host = malloc(sizeof(float) * per);
        int32_t *toks = malloc(sizeof(int32_t) * (size_t)b * n_dec);
        mf_step *e = NULL;
        CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2}, &e) == 0 && run(r, e, b, n_dec, toks, 1, host) == 0,
              "host run: %s", mf_last_error());
        mf_step_free(e);
        mf_step_dev_stats x;
        for (int tc = 0; tc < 2; tc++)
            for (int sp = MF_SG_SPLIT_LAYERS; sp <= MF_SG_SPLIT_ROWS; sp++) {
                if ((MF_TEST_SANITIZED && tc != sp) || (b > 1 && sp != MF_SG_SPLIT_ROWS))
                    continue;   /* sanitizers: bf16 by layers, fp16 by rows; batch 3: by rows */
                char spec[64];
                snprintf(spec, sizeof spec, "emu:2,bw=50e9,lat_ns=2000,tc=%s", tc ? "fp16" : "bf16");
                mf_step_opts o = {.dense = MF_STEP_DENSE_CARDS, .dense_split = sp, .lt = MF_SG_LT_DENSE,
                                  .placement = sp ? MF_STEP_PLACE_HYBRID : MF_STEP_PLACE_HOST};
                check_engine(r, spec, o, b, n_dec, toks, host, -1, &x);
                CHECK(x.lt_linears > 0 && x.lt_slots == 0, "%s split %d: %lld dense linears, %lld expert slots on the "
                      "path", spec, sp, (long long)x.lt_linears, (long long)x.lt_slots);
                if (MF_TEST_SANITIZED || sp != MF_SG_SPLIT_ROWS || tc) continue;
                /* item blocks of 2 (a layer's dequantization serving every block) and two micro-batches */
                o.dense_block = 2;
                o.micro = b > 1 ? 2 : 0;
                check_engine(r, spec, o, b, n_dec, toks, host, -1, &x);
                CHECK(x.lt_linears > 0, "%s blocks: %lld dense linears on the path", spec, (long long)x.lt_linears);
            }
        /* no tensor cores: the CUDA cores' path, whatever the mode (batch 1) */
        if (b == 1) {
            check_engine(r, "emu:2,tc=none",
                         (mf_step_opts){.dense = MF_STEP_DENSE_CARDS, .lt = MF_SG_LT_ON, .placement = MF_STEP_PLACE_HYBRID},
                         b, n_dec, toks, host, -1, &x);
            CHECK(x.lt_linears == 0 && x.lt_slots == 0, "tc=none: %lld linears, %lld slots on the path",
                  (long long)x.lt_linears, (long long)x.lt_slots);
        }
        /* the routed experts on it too (seed: every slot on its card): the slots took it, not the
         * host's bits; the logits no farther from the int8 path's than the host's fp32 path (exact:
         * experts unquantized, and the reference's roundings) is (x 1.25), a random model's routing
         * flips included (a wrong row, weight or matrix lands far beyond) */
        if (!MF_TEST_SANITIZED) {
            float *fp = malloc(sizeof(float) * per);
            CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2, .exact = 1}, &e) == 0 && run(r, e, b, n_dec, toks, 0, fp) == 0,
                  "host exact run: %s", mf_last_error());
            mf_step_free(e);
            double fp_err = rel_err(fp, host, per);
            printf("test_place_lt: batch %d, the host's fp32 experts (exact): logits rel err %.3e against the int8 "
                   "path's\n", b, fp_err);
            check_engine(r, "emu:2,bw=50e9,lat_ns=2000,tc=bf16",
                         (mf_step_opts){.dense = MF_STEP_DENSE_CARDS, .lt = MF_SG_LT_ON, .placement = MF_STEP_PLACE_SEED},
                         b, n_dec, toks, host, 1.25 * fp_err, &x);
            CHECK(x.lt_slots > 0 && x.lt_slots == x.dev_slots, "seed: %lld of %lld card slots on the path",
                  (long long)x.lt_slots, (long long)x.dev_slots);
            free(fp);
        }
        free(host);
        free(toks);
    }
}

int main(void)
{
    mf_config c;
    mf_sg_sizes *sz = NULL;
    CHECK(mf_profile_load(MF_SOURCE_DIR "/tools/profiles/seed-host.prof", &g_seed) == 0, "seed profile: %s",
          mf_last_error());
    CHECK(mf_config_preset("flash41", &c) == 0 && mf_sg_sizes_new(&c, &sz) == 0, "flash41: %s", mf_last_error());
    if (sz && g_seed.card_tc_macs_per_s > 0) {
        test_graph(&c, sz);
        if (!MF_TEST_SANITIZED) test_sim(&c, sz);
    }
    mf_sg_sizes_free(sz);
    char dir[1024];
    CHECK(mf_config_preset("tiny", &c) == 0, "preset tiny");
    if (mf_test_gen_ckpt(&c, "place_lt_tiny", dir, sizeof dir)) return 1;
    g_V = c.vocab_size;
    mf_model *m = NULL;
    mf_ref *r = NULL;
    CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1}, &m) == 0, "load: %s", mf_last_error());
    if (m && !mf_ref_new(m, NULL, &r)) test_engine(r);
    mf_ref_free(r);
    mf_model_free(m);
    return mf_check_exit("test_place_lt");
}
