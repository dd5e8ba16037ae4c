/* The cost model (sched/cost.h): each price against the formula written out by hand on a made-up
 * profile (relative error 1e-12), the built-in machine against the lane models it replaced, and
 * the step graph's priorities (graphs/step/stepgraph.c) as the prices of the records. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "graphs/model/config.h"
#include "graphs/step/step.h"
#include "graphs/step/stepgraph.h"
#include "sched/cost.h"
#include "sched/error.h"
#include "tests/check.h"

static int near(double a, double b) { return fabs(a - b) <= 1e-12 * (fabs(b) > 1 ? fabs(b) : 1); }

static mf_profile made_up(void)
{
    mf_profile p;
    memset(&p, 0, sizeof p);
    p.n_sockets = 2;
    p.threads_per_socket = 4;
    p.mem_bytes_per_s = 40e9;
    p.host[MF_KF_FP4] = (mf_profile_kern){.bytes_per_s = 30e9, .macs_per_s = 100e9, .latency_ns = 1500};
    p.host[MF_KF_FP8] = (mf_profile_kern){.bytes_per_s = 8e9, .macs_per_s = 50e9, .latency_ns = 700};
    p.host[MF_KF_REF] = (mf_profile_kern){.macs_per_s = 2e9};
    p.host_vec = (mf_profile_kern){.macs_per_s = 16e9, .latency_ns = 300};
    p.card[MF_KF_FP4] = (mf_profile_kern){.bytes_per_s = 900e9, .macs_per_s = 400e12, .latency_ns = 9000};
    p.card[MF_KF_REF] = (mf_profile_kern){.macs_per_s = 50e9};
    p.disk_bytes_per_s = 2e9;
    p.disk_latency_ns = 80000;
    p.disk_queue_depth = 4;
    p.h2d_bytes_per_s = 24e9;
    p.h2d_latency_ns = 11000;
    p.d2h_bytes_per_s = 20e9;
    p.d2h_latency_ns = 13000;
    return p;
}

static void test_formulas(void)
{
    mf_profile p = made_up();
    CHECK(near(mf_cost_thread_share(&p, 6), 40e9 * 2 / 6), "share of 6 threads over 2 sockets");
    CHECK(near(mf_cost_thread_share(&p, 3), 40e9 / 3), "share of 3 threads on 1 socket");
    mf_cost_model m = {.p = &p, .host_bytes_per_s = 10e9};
    const mf_profile_kern *k4 = &p.host[MF_KF_FP4];
    CHECK(near(mf_cost_kern(k4, 30e9, 3e6, 2e6, 1), 1500 + 3e6 / 30e9 * 1e9), "kernel, one token");
    CHECK(near(mf_cost_kern(k4, 30e9, 3e6, 2e6, 5), 1500 + 3e6 / 30e9 * 1e9 + 4 * 2e6 / 100e9 * 1e9), "kernel, 5 tokens");
    mf_work w = {0};
    w.w_bytes[MF_KF_FP4] = 6e6, w.macs[MF_KF_FP4] = 4e6, w.calls[MF_KF_FP4] = 3;
    w.w_bytes[MF_KF_FP8] = 1e6, w.macs[MF_KF_FP8] = 1e6, w.calls[MF_KF_FP8] = 1;
    w.ref_flops = 5e5, w.ref_flops_tok = 1e4;
    /* fp4 capped at the thread's share (10e9 < 30e9), fp8 under it (8e9); 2 more fp4 calls' latencies */
    double host = 1500 + 6e6 / 10e9 * 1e9 + 3 * 4e6 / 100e9 * 1e9 + 2 * 1500 + 700 + 1e6 / 8e9 * 1e9 +
                  3 * 1e6 / 50e9 * 1e9 + (5e5 + 4 * 1e4 + 7e3) / 2e9 * 1e9;
    CHECK(near(mf_cost_host(&m, &w, 4, 7e3), host), "host work: %.3f ns, expected %.3f", mf_cost_host(&m, &w, 4, 7e3), host);
    /* vector code: the larger of its flops at the vec rate and its bytes at the thread's share */
    CHECK(near(mf_cost_vec(&m, 8e6, 1e6), 8e6 / 16e9 * 1e9), "vec, compute bound");
    CHECK(near(mf_cost_vec(&m, 8e6, 8e6), 8e6 / 10e9 * 1e9), "vec, memory bound");
    mf_cost_model nocap = {.p = &p};
    CHECK(near(mf_cost_vec(&nocap, 8e6, 8e9), 8e6 / 16e9 * 1e9), "vec without a cap: bytes free");
    mf_work v = {0};
    v.ref_flops = 4e5, v.vec_flops = 2e6, v.vec_bytes = 4e5;
    double vw = 4e5 / 2e9 * 1e9 + (2e6 + 0) / 16e9 * 1e9;
    CHECK(near(mf_cost_host(&m, &v, 1, 0), vw), "vec work: %.3f ns, expected %.3f", mf_cost_host(&m, &v, 1, 0), vw);
    /* positional work: at REF without extra_vec, with vec_flops with it */
    CHECK(near(mf_cost_host(&m, &v, 1, 6e6), vw + 6e6 / 2e9 * 1e9), "extra at REF");
    v.extra_vec = 1;
    double vx = 4e5 / 2e9 * 1e9 + (2e6 + 6e6) / 16e9 * 1e9;
    CHECK(near(mf_cost_host(&m, &v, 1, 6e6), vx), "extra as vec: %.3f ns, expected %.3f", mf_cost_host(&m, &v, 1, 6e6), vx);
    mf_work e = {0};
    e.w_bytes[MF_KF_FP4] = 6e6, e.macs[MF_KF_FP4] = 4e6, e.calls[MF_KF_FP4] = 1, e.ref_flops = 1e6;
    double card = 9000 + 6e6 / 900e9 * 1e9 + 2 * 4e6 / 400e12 * 1e9 + 1e6 / 50e9 * 1e9;
    CHECK(near(mf_cost_card(&m, &e, 3), card), "card work: %.3f ns, expected %.3f", mf_cost_card(&m, &e, 3), card);
    CHECK(near(mf_cost_disk(&m, 1e6, 6), 6 * 80000.0 / 4 + 1e6 / 2e9 * 1e9), "disk reads");
    CHECK(near(mf_cost_copy(&m, 0, 8, 3e6), 8 * 11000.0 + 3e6 / 24e9 * 1e9), "h2d copies");
    CHECK(near(mf_cost_copy(&m, 1, 1, 3e6), 13000 + 3e6 / 20e9 * 1e9), "d2h copy");
    CHECK(near(mf_cost_act_copy(&m, 1, 4e4), 13000 + 4e4 / 20e9 * 1e9), "act copy without its own latency");
    p.act_copy_latency_ns = 3000;
    CHECK(near(mf_cost_act_copy(&m, 0, 4e4), 3000 + 4e4 / 24e9 * 1e9), "act copy with its latency");
}

/* The built-in machine gives the lane models the engine had without a profile. */
static void test_builtin(void)
{
    mf_lane_model m[4];
    mf_step_lane_models(NULL, 2, m);
    CHECK(m[0].bytes_per_s == 20e9 && m[0].latency_ns == 2000 && m[0].flops_per_s == 0, "cpu lane model");
    CHECK(m[1].bytes_per_s == 25e9 && m[1].latency_ns == 10000, "h2d lane model");
    CHECK(m[2].bytes_per_s == 20e9 && m[2].latency_ns == 5000, "card lane model");
    CHECK(m[3].bytes_per_s == 25e9 && m[3].latency_ns == 10000, "d2h lane model");
    const mf_profile *d = mf_cost_default_profile();
    CHECK(d && d->host[MF_KF_REF].macs_per_s > 0 && d->card[MF_KF_FP8].bytes_per_s > 0, "built-in rates");
}

/* Every task's cost in the demo's graph at batch 4 (with a store and 2 cards) is its lane's
 * latency plus its record's price at the expected shape, on the given profile or the built-in. */
static void test_priorities(void)
{
    mf_config c;
    CHECK(mf_config_preset("demo", &c) == 0, "preset demo");
    mf_sg_sizes *sz = NULL;
    CHECK(mf_sg_sizes_new(&c, &sz) == 0, "sizes: %s", mf_last_error());
    mf_profile made = made_up();
    const mf_profile *profs[2] = {NULL, &made};
    for (int k = 0; k < 2 && sz; k++) {
        const mf_profile *f = profs[k], *pf = f ? f : mf_cost_default_profile();
        mf_lane_model lm[4];
        mf_step_lane_models(f, 2, lm);
        mf_sg_lanes lt;
        mf_sg_lanes_init(&lt, lm, 2, 1, 2);
        mf_stepgraph *sg = NULL;
        int n = 4;
        CHECK(mf_stepgraph_new(&(mf_sg_opts){.c = &c, .sz = sz, .n = n, .par = 1, .n_threads = 2, .n_cards = 2,
                                             .store = 1, .lanes = lt.lane, .n_lanes = lt.n_lanes,
                                             .lane_io = lt.lane_io, .lane_dev0 = lt.lane_dev0, .profile = f},
                               &sg) == 0,
              "graph: %s", mf_last_error());
        mf_cost_model m = {.p = pf, .host_bytes_per_s = mf_cost_thread_share(pf, 2)};
        int tok = (n * c.n_experts_per_tok + c.n_routed_experts - 1) / c.n_routed_experts;
        mf_sg_step_cost st = {.slot_tokens = tok > 1 ? tok : 1, .n_head = n, .dev_miss = 1};
        int bad = 0, checked = 0;
        for (int t = 0; sg && t < sg->n_tasks; t++) {
            const mf_sg_task *r = &sg->task[t];
            if (r->op == MF_SG_ATTN_HEADS || r->op == MF_SG_ATTN_SCORE || r->op == MF_SG_ATTN_SELECT ||
                r->op == MF_SG_DEV_FFN_CARD)
                continue;   /* positional work at the steady state; a card's share of the slots */
            double want = mf_graph_lane(sg->g, mf_graph_task(sg->g, t)->lane)->model.latency_ns +
                          mf_sg_task_ns(r, &m, &st);
            double got = mf_graph_task_cost_ns(sg->g, t);
            checked++;
            if (!near(got, want) && bad++ < 5)
                CHECK(0, "%s: task %d (op %d): cost %.3f ns, expected %.3f", f ? "made up" : "built-in", t, r->op,
                      got, want);
        }
        CHECK(checked > 100 && !bad, "%d of %d tasks' costs differ", bad, checked);
        mf_stepgraph_free(sg);
    }
    mf_sg_sizes_free(sz);
}

/* The fast path's records (exact 0) carry the heads', index scores', mixes', collapses', posts',
 * norms' and combines' work as vector code, the --exact path's (exact 1) as scalar work (but the
 * combine's sum, vector code on both); a fast heads task's price is its scalar
 * roundings and RoPE at REF plus its 8-lane roundings and positional work at the vec rate. */
static void test_vec_records(void)
{
    mf_config c;
    CHECK(mf_config_preset("demo", &c) == 0, "preset demo");
    mf_sg_sizes *sz = NULL;
    CHECK(mf_sg_sizes_new(&c, &sz) == 0, "sizes: %s", mf_last_error());
    mf_profile made = made_up();
    double comb_fast = 0, comb_ex = 0;   /* the combine records' vector work per path */
    for (int exact = 0; exact < 2 && sz; exact++) {
        mf_lane_model lm[4];
        mf_step_lane_models(&made, 2, lm);
        mf_sg_lanes lt;
        mf_sg_lanes_init(&lt, lm, 2, 0, 0);
        mf_stepgraph *sg = NULL;
        CHECK(mf_stepgraph_new(&(mf_sg_opts){.c = &c, .sz = sz, .n = 2, .par = 1, .n_threads = 2,
                                             .lanes = lt.lane, .n_lanes = lt.n_lanes, .lane_io = lt.lane_io,
                                             .lane_dev0 = lt.lane_dev0, .profile = &made, .exact = exact},
                               &sg) == 0,
              "graph: %s", mf_last_error());
        mf_cost_model m = {.p = &made, .host_bytes_per_s = mf_cost_thread_share(&made, 2)};
        int n_heads = 0, n_score = 0, n_mix = 0, n_col = 0, n_comb = 0, bad = 0;
        for (int t = 0; sg && t < sg->n_tasks; t++) {
            const mf_sg_task *r = &sg->task[t];
            if (r->op == MF_SG_ATTN_HEADS || r->op == MF_SG_ATTN_SCORE) {
                r->op == MF_SG_ATTN_HEADS ? n_heads++ : n_score++;
                /* the fast heads' query and roped-output roundings are vector code too (8 lanes) */
                int vec_ok = r->op == MF_SG_ATTN_HEADS && !exact ? r->w.vec_flops > 0 : r->w.vec_flops == 0;
                bad += r->w.extra_vec != !exact || !vec_ok;
                if (r->op == MF_SG_ATTN_HEADS) {
                    mf_sg_step_cost st = {.pos_flops = 3e6};
                    double want = r->w.ref_flops / 2e9 * 1e9 + (r->w.vec_flops + 3e6) / (exact ? 2e9 : 16e9) * 1e9;
                    if (!near(mf_sg_task_ns(r, &m, &st), want) && bad++ < 3)
                        CHECK(0, "heads task %d: %.3f ns, expected %.3f", t, mf_sg_task_ns(r, &m, &st), want);
                }
            } else if (r->op == MF_SG_ATTN_MIX || r->op == MF_SG_FFN_MIX) {
                n_mix++;
                bad += exact ? !(r->w.ref_flops > 0) || r->w.vec_flops != 0 || r->w.vec_bytes != 0
                             : r->w.ref_flops != 0 || !(r->w.vec_flops > 0) || !(r->w.vec_bytes > 0);
            } else if (r->op == MF_SG_ATTN_PRE || r->op == MF_SG_ATTN_POST || r->op == MF_SG_ATTN_NORM ||
                       r->op == MF_SG_FFN_NORM || r->op == MF_SG_NORM) {
                /* the collapse, the post's expand and collapse, the norms' columns: fast_attn.c's
                 * vector loops on the fast path (the post's split and a norm's sum of squares stay
                 * scalar), the module's scalar loops with exact */
                n_col++;
                int scalar = r->op != MF_SG_ATTN_PRE && r->r1 > r->r0;   /* split or sum of squares */
                bad += exact ? !(r->w.ref_flops > 0) || r->w.vec_flops != 0
                             : !(r->w.vec_flops > 0) || (scalar && !(r->w.ref_flops > 0)) ||
                                   (r->op == MF_SG_ATTN_PRE && r->w.ref_flops != 0);
            } else if (r->op == MF_SG_COMBINE) {
                /* the sum is mf_fa_combine_cols either way (vector work); the expand vector code
                 * only on the fast path */
                n_comb++;
                bad += !(r->w.vec_flops > 0) || !(r->w.ref_flops > 0);
                if (exact) comb_ex += r->w.vec_flops;
                else comb_fast += r->w.vec_flops;
            }
        }
        CHECK(n_heads > 0 && n_score > 0 && n_mix > 0 && n_col > 0 && n_comb > 0 && !bad,
              "exact %d: %d heads, %d score, %d mix, %d column, %d combine records, %d wrong", exact, n_heads,
              n_score, n_mix, n_col, n_comb, bad);
        mf_stepgraph_free(sg);
    }
    CHECK(comb_fast > comb_ex && comb_ex > 0, "combine vector work: fast %.0f, exact %.0f", comb_fast, comb_ex);
    mf_sg_sizes_free(sz);
}


/* The cuBLASLt path's price (mf_cost_card_lt) against its formula, and mf_cost_card's choice: the
 * CUDA-core price at few tokens, the tensor cores' at many (the crossover where the two meet), FP8
 * and FP4 work each on its own, BF16 never; without a tensor-core rate every price is as before. */
static void test_lt(void)
{
    mf_profile p = made_up();
    p.card[MF_KF_FP8] = (mf_profile_kern){.bytes_per_s = 500e9, .macs_per_s = 6e12, .latency_ns = 5000};
    p.card[MF_KF_BF16] = (mf_profile_kern){.bytes_per_s = 500e9, .macs_per_s = 6e12, .latency_ns = 5000};
    p.card[MF_KF_FP4] = (mf_profile_kern){.bytes_per_s = 100e9, .macs_per_s = 6e12, .latency_ns = 0};
    mf_cost_model m = {.p = &p};
    mf_work w = {0};
    double B = 16e6, M = 16e6;   /* a 4096 x 4096 FP8 linear: a byte and a MAC a weight */
    w.w_bytes[MF_KF_FP8] = B, w.macs[MF_KF_FP8] = M, w.calls[MF_KF_FP8] = 1;
    double core64 = 5000 + B / 500e9 * 1e9 + 63 * M / 6e12 * 1e9;
    int lt = -1;
    CHECK(mf_cost_card_lt(&m, MF_KF_FP8, B, M, 1, 64) == 0 && near(mf_cost_card_paths(&m, &w, 64, &lt), core64) && lt == 0,
          "no tensor-core rate: the CUDA-core price %.1f, lt %d", mf_cost_card_paths(&m, &w, 64, &lt), lt);
    p.card_tc_macs_per_s = 24e12;
    double lt_ns = MF_COST_LT_LAUNCHES_FP8 * 5000.0 + 512 * M / 24e12 * 1e9 + (B + 4 * M) / 500e9 * 1e9;
    CHECK(near(mf_cost_card_lt(&m, MF_KF_FP8, B, M, 1, 512), lt_ns), "lt price %.1f, expected %.1f",
          mf_cost_card_lt(&m, MF_KF_FP8, B, M, 1, 512), lt_ns);
    CHECK(near(mf_cost_card_paths(&m, &w, 512, &lt), lt_ns) && lt == 1 << MF_KF_FP8, "512 tokens: the cuBLASLt path");
    CHECK(near(mf_cost_card_paths(&m, &w, 1, &lt), 5000 + B / 500e9 * 1e9) && lt == 0, "1 token: the CUDA cores");
    /* the crossover: (n - 1) M / 6e12 = 2 launches + 4 M / 500e9 + n M / 24e12: 2 us a token saved
     * against 138 us of dequantization, 2-byte reads and launches -> about 70 tokens */
    int n_x = 1;
    while (mf_cost_card_paths(&m, &w, n_x, &lt) && !lt) n_x++;
    printf("test_cost: a 4096 x 4096 FP8 linear goes to the tensor cores from %d tokens\n", n_x);
    CHECK(n_x > 64 && n_x < 80, "crossover at %d tokens", n_x);
    /* FP4 (an expert): the bytes at the dense kernels' rate, 8 launches; BF16 never */
    mf_work e = {0};
    e.w_bytes[MF_KF_FP4] = 18e6, e.macs[MF_KF_FP4] = 36e6, e.calls[MF_KF_FP4] = 1;
    double e_lt = 0 + 128 * 36e6 / 24e12 * 1e9 + (18e6 + 4 * 36e6) / 500e9 * 1e9;
    CHECK(near(mf_cost_card_paths(&m, &e, 128, &lt), e_lt) && lt == 1 << MF_KF_FP4, "expert at 128 tokens: %.1f vs %.1f",
          mf_cost_card_paths(&m, &e, 128, &lt), e_lt);
    mf_work b = {0};
    b.w_bytes[MF_KF_BF16] = 2 * M, b.macs[MF_KF_BF16] = M, b.calls[MF_KF_BF16] = 1;
    CHECK(mf_cost_card_lt(&m, MF_KF_BF16, 2 * M, M, 1, 512) == 0 && (mf_cost_card_paths(&m, &b, 512, &lt), lt == 0),
          "bf16: no cuBLASLt price");
    CHECK(near(mf_cost_card(&m, &w, 512), lt_ns), "mf_cost_card is the choice");
    /* its parts: the dequantization (a launch, the stored bytes read, 2 bytes a weight written) and
     * the GEMM (two launches, the 2 bytes read, the tensor cores), which a record on the path is
     * priced at (mf_cost_card_on) when its dequantization is a task of its own */
    double dq = 5000 + (B + 2 * M) / 500e9 * 1e9, gm = 2 * 5000.0 + 2 * M / 500e9 * 1e9 + 512 * M / 24e12 * 1e9;
    CHECK(near(mf_cost_card_dequant(&m, MF_KF_FP8, B, M, 1), dq) && near(mf_cost_card_lt_gemm(&m, MF_KF_FP8, M, 1, 512), gm) &&
              near(dq + gm, lt_ns),
          "dequantization %.1f (expected %.1f), GEMM %.1f (%.1f)", mf_cost_card_dequant(&m, MF_KF_FP8, B, M, 1), dq,
          mf_cost_card_lt_gemm(&m, MF_KF_FP8, M, 1, 512), gm);
    double core512 = 5000 + B / 500e9 * 1e9 + 511 * M / 6e12 * 1e9;
    CHECK(near(mf_cost_card_on(&m, &w, 512, 1 << MF_KF_FP8), gm) && near(mf_cost_card_on(&m, &w, 512, 0), core512) &&
              near(mf_cost_card_on(&m, &b, 512, 1 << MF_KF_BF16), mf_cost_card_on(&m, &b, 512, 0)),
          "card_on: the GEMM on the path, the CUDA cores off it, BF16 never on it");
    p.card_tc_macs_per_s = 0;
    CHECK(mf_cost_card_dequant(&m, MF_KF_FP8, B, M, 1) == 0 && near(mf_cost_card_on(&m, &w, 512, 1 << MF_KF_FP8), core512),
          "no tensor-core rate: no dequantization price, the path priced as the CUDA cores");
}

int main(void)
{
    test_vec_records();
    test_formulas();
    test_builtin();
    test_priorities();
    test_lt();
    return mf_check_exit("test_cost");
}
