/* Two micro-batches in flight (mf_step_opts.micro, graphs/step/stepgraph.h mf_sg_opts.micro): the
 * step graph's halves (items split at a unit boundary, each half's route, slots, shared expert and
 * combine over its own items, one MoE at a time), the simulator running the same graph, and the
 * engine's logits with two micro-batches against one, bit for bit (memcmp), on tiny: batch 2, 3 and
 * 16, host placement on 1 and 2 threads, hybrid on emu:2, dense work on emu:2, resident and
 * streamed experts. A token routed or combined with the other half's rows changes the logits; a
 * half's attention made to wait for the other half's MoE fails the graph's reachability check. */
#include <errno.h>
#include <stdint.h>
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
#include "tests/check.h"
#include "tests/step_run.h"
#include "tests/tiny_ckpt.h"

#define N_PROMPT 5
#define MAX_SEQ 16

static int64_t g_V;

/* Marks in seen[] every task reachable from `from` (itself included). */
static void reach(const mf_graph *g, mf_task_id from, uint8_t *seen, mf_task_id *stack)
{
    int top = 0;
    stack[top++] = from;
    seen[from] = 1;
    while (top) {
        mf_task_id t = stack[--top];
        const mf_task_id *su = mf_graph_succ(g, t);
        for (int k = 0; k < mf_graph_n_succ(g, t); k++)
            if (!seen[su[k]]) {
                seen[su[k]] = 1;
                stack[top++] = su[k];
            }
    }
}

/* What the graph allows: per layer L, nothing of half 1's attention of L waits for half 0's route
 * of L (so it can run beside half 0's MoE), and nothing of half 0's attention of L + 1 waits for
 * half 1's route of L; half 1's route of L does wait for half 0's (one MoE at a time). */
static void test_overlap(const mf_stepgraph *sg, int n_layers)
{
    int nt = sg->n_tasks;
    uint8_t *seen = malloc((size_t)nt);
    mf_task_id *stack = malloc(sizeof *stack * (size_t)nt);
    for (int L = 0; L < n_layers; L++)
        for (int h = 0; h < 2; h++) {
            mf_task_id ro = -1, ro_next = -1;
            for (int t = 0; t < nt; t++)
                if (sg->task[t].op == MF_SG_ROUTE && sg->task[t].part < 0 && sg->task[t].layer == L && sg->task[t].half == h)
                    ro = t;   /* the route (its top-k parts, per item, wait for no other half) */
            for (int t = 0; t < nt; t++)
                if (sg->task[t].op == MF_SG_ROUTE && sg->task[t].part < 0 && sg->task[t].layer == L + h &&
                    sg->task[t].half == 1 - h)
                    ro_next = t;
            CHECK(ro >= 0, "no route of layer %d half %d", L, h);
            if (ro < 0) continue;
            memset(seen, 0, (size_t)nt);
            reach(sg->g, ro, seen, stack);
            int bad = -1;
            for (int t = 0; t < nt && bad < 0; t++)
                if (seen[t] && sg->task[t].phase == MF_SG_PH_ATTN && sg->task[t].half == 1 - h &&
                    sg->task[t].layer == L + h)
                    bad = t;
            CHECK(bad < 0, "layer %d: attention task %d of half %d (layer %d) waits for half %d's route", L, bad,
                  1 - h, L + h, h);
            if (ro_next >= 0) CHECK(seen[ro_next], "layer %d: the next half's route does not wait for half %d's", L, h);
        }
    free(seen);
    free(stack);
}

/* The graph of tiny at batch n (parallel) with two micro-batches: the halves and their slots, every
 * route over its half's items, every MoE task in a half, the head after both. */
static void test_graph(const mf_config *c, int n)
{
    mf_sg_sizes *sz = NULL;
    CHECK(mf_sg_sizes_new(c, &sz) == 0, "sizes: %s", mf_last_error());
    if (!sz) return;
    mf_sg_lanes lt;
    mf_lane_model models[4];
    mf_step_lane_models(NULL, 2, models);
    mf_sg_lanes_init(&lt, models, 2, 0, 0);
    mf_stepgraph *sg = NULL;
    mf_sg_opts o = {.c = c, .sz = sz, .n = n, .par = 1, .n_threads = 2, .lanes = lt.lane, .n_lanes = lt.n_lanes,
                    .lane_io = lt.lane_io, .lane_dev0 = lt.lane_dev0, .micro = 2};
    CHECK(mf_stepgraph_new(&o, &sg) == 0, "graph batch %d: %s", n, mf_last_error());
    if (sg) {
        int K = c->n_experts_per_tok, E = c->n_routed_experts, h0 = n / 2;
        CHECK(sg->n_halves == 2 && sg->half_end[0] == h0 && sg->half_end[1] == n,
              "batch %d: halves %d ending at %d, %d (expected 2 at %d, %d)", n, sg->n_halves, sg->half_end[0],
              sg->half_end[1], h0, n);
        int s0 = h0 * K < E ? h0 * K : E, s1 = (n - h0) * K < E ? (n - h0) * K : E;
        CHECK(sg->half_slot[1] == s0 && sg->n_slots == s0 + s1, "batch %d: slots %d + %d (expected %d + %d)", n,
              sg->half_slot[1], sg->n_slots - sg->half_slot[1], s0, s1);
        int routes = 0;
        for (int t = 0; t < sg->n_tasks; t++) {
            const mf_sg_task *r = &sg->task[t];
            if (r->op == MF_SG_ROUTE) {   /* the route over its half; its top-k parts (MF_SG_ROUTE part >= 0) in it */
                int a = r->half ? h0 : 0, b = r->half ? n : h0;
                if (r->part < 0)
                    CHECK(r->i0 == a && r->i1 == b && r->n_tok == b - a, "L%d half %d route over [%d, %d)", r->layer,
                          r->half, r->i0, r->i1);
                else
                    CHECK(r->i0 >= a && r->i1 <= b && r->i0 < r->i1 && r->n_tok == r->i1 - r->i0,
                          "L%d half %d route top-k part %d over [%d, %d)", r->layer, r->half, r->part, r->i0, r->i1);
                routes += r->part < 0;
            }
            if (r->slot >= 0)
                CHECK(mf_stepgraph_half_of_slot(sg, r->slot) == r->half, "slot %d task in half %d", r->slot, r->half);
            if (r->op == MF_SG_COMBINE)
                CHECK((r->i0 >= h0) == r->half, "combine of item %d in half %d", r->i0, r->half);
            if (r->op == MF_SG_HEAD) CHECK(r->half == -1, "head in half %d", r->half);
        }
        CHECK(routes == 2 * c->n_layers, "%d routes (expected %d)", routes, 2 * c->n_layers);
        test_overlap(sg, c->n_layers);
        mf_stepgraph_free(sg);
    }
    /* one unit (a sequence's items): one half; micro 3 refused */
    o.par = 0;
    CHECK(mf_stepgraph_new(&o, &sg) == 0 && sg->n_halves == 1, "serial batch %d: not one half", n);
    mf_stepgraph_free(sg);
    o.micro = 3;
    sg = NULL;
    CHECK(mf_stepgraph_new(&o, &sg) == -EINVAL && !sg, "micro 3 accepted");
    mf_sg_sizes_free(sz);
}

/* The simulator on the same graph: a step with two micro-batches runs, its routed slots counted
 * per half (as many host slots as the halves' distinct experts). */
static void test_sim(const mf_config *c)
{
    mf_profile prof;
    memset(&prof, 0, sizeof prof);
    snprintf(prof.name, sizeof prof.name, "test");
    prof.n_sockets = 1;
    prof.threads_per_socket = 2;
    prof.mem_bytes_per_s = 40e9;
    prof.cross_socket_factor = 1;
    prof.task_overhead_ns = 2000;
    for (int k = 0; k < MF_KF_N; k++)
        prof.host[k] = (mf_profile_kern){.bytes_per_s = k == MF_KF_REF ? 0 : 10e9, .macs_per_s = 2e9, .latency_ns = 1000};
    prof.host_vec = (mf_profile_kern){.macs_per_s = 2e9};
    prof.disk_bytes_per_s = 1e9;
    prof.disk_queue_depth = 1;
    for (int micro = 1; micro <= 2; micro++) {
        mf_plan_report r;
        mf_plan_opts po = {.config = c, .profile = &prof, .batch = 8, .threads_per_socket = 2, .seed = 1, .micro = micro};
        CHECK(mf_plan_run(&po, 1, 2, &r) == 0, "sim micro %d: %s", micro, mf_last_error());
        CHECK(r.step_ns > 0 && r.host_slots > 0, "sim micro %d: step %g ns, %lld host slots", micro, (double)r.step_ns,
              (long long)r.host_slots);
    }
}

/* Token i of sequence s's prompt (distinct prompts). */
static int32_t prompt_tok(int s, int i) { return (int32_t)((i * 53 + s * 97 + (i * s) % 11) % g_V); }

/* The engine's logits of every call (tests/step_run.h). */
static int run(mf_ref *r, mf_step *e, int n_seq, int n_dec, int32_t *toks, int fill, float *out)
{
    return mf_test_run_steps(r, e, g_V, n_seq, N_PROMPT, prompt_tok, n_dec, toks, fill, out);
}

/* A setting of the engine: threads, cards (0: none), placement, dense work, device graphs, and split:
 * the CPU model g_split_bps (a tiny expert about twice a card's miss, as tests/test_place.c) under
 * which hybrid puts some slots of the last step on the cards and some on the host (checked at batch
 * 16). */
typedef struct setting {
    const char *name;
    int threads, cards, placement, dense, dev_graphs, split;
} setting;

static double g_split_bps;

/* For each batch and setting: the engine with one micro-batch, then with two, the same logits, and
 * the same as the first setting's (the host's) with one. */
static void test_engine(mf_ref *r, const char *what, const int *batches, int n_b, const setting *set, int n_set,
                        int n_dec)
{
    for (int bi = 0; bi < n_b; bi++) {
        int b = batches[bi];
        size_t per = (size_t)b * (1 + n_dec) * g_V;
        float *one = malloc(sizeof(float) * per), *two = malloc(sizeof(float) * per);
        float *first = malloc(sizeof(float) * per);
        int32_t *toks = malloc(sizeof(int32_t) * (size_t)b * n_dec);
        for (int k = 0; k < n_set; k++) {
            const setting *x = &set[k];
            mf_dev *d = NULL;
            if (x->cards) {
                char spec[64];
                CHECK(mf_test_emu_open(x->cards, spec, sizeof spec, &d) == 0, "open %s: %s", spec, mf_last_error());
                if (!d) continue;
            }
            for (int micro = 1; micro <= 2; micro++) {
                mf_step *e = NULL;
                CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = x->threads, .dev = d, .placement = x->placement,
                                                     .dense = x->dense, .dev_graphs = x->dev_graphs, .micro = micro,
                                                     .cpu_bytes_per_s = x->split ? g_split_bps : 0},
                                  &e) == 0,
                      "%s %s: %s", what, x->name, mf_last_error());
                if (!e) continue;
                float *out = micro == 1 ? one : two;
                memset(out, 0, sizeof(float) * per);
                int rc = run(r, e, b, n_dec, toks, micro == 1, out);
                CHECK(rc == 0, "%s %s micro %d batch %d: %s", what, x->name, micro, b, mf_last_error());
                if (micro == 1 && !rc && k == 0) memcpy(first, one, sizeof(float) * per);
                if (micro == 1 && !rc && k > 0)
                    CHECK(!memcmp(first, one, sizeof(float) * per), "%s %s batch %d: logits differ from %s's", what,
                          x->name, b, set[0].name);
                if (!rc && x->split && b >= 16) {
                    mf_step_dev_stats ds;
                    mf_step_last_dev(e, &ds);
                    CHECK(ds.dev_slots > 0 && ds.host_slots > 0, "%s %s micro %d batch %d: the last step put %lld "
                          "slots on cards, %lld on the host", what, x->name, micro, b, (long long)ds.dev_slots,
                          (long long)ds.host_slots);
                }
                if (micro == 2 && !rc) {
                    size_t bad = per;
                    for (size_t i = 0; i < per && bad == per; i++)
                        if (memcmp(&one[i], &two[i], sizeof(float))) bad = i;
                    CHECK(bad == per,
                          "%s %s batch %d: logits with two micro-batches differ from one's (sequence %zu, call %zu, "
                          "token %zu: %.9g vs %.9g)",
                          what, x->name, b, bad / ((1 + n_dec) * (size_t)g_V), bad / (size_t)g_V % (1 + n_dec),
                          bad % (size_t)g_V, bad < per ? two[bad] : 0.0, bad < per ? one[bad] : 0.0);
                }
                mf_step_free(e);
            }
            mf_dev_close(d);
        }
        free(one);
        free(two);
        free(first);
        free(toks);
    }
}

int main(void)
{
    char dir[1024];
    mf_config c;
    CHECK(mf_config_preset("tiny", &c) == 0, "preset");
    test_graph(&c, 16);
    test_graph(&c, 3);
    test_sim(&c);
    if (mf_test_gen_ckpt(&c, "micro_tiny", dir, sizeof dir)) return 1;
    g_V = c.vocab_size;
    static const setting all[] = {
        {"host 1 thread", 1, 0, MF_STEP_PLACE_HOST, 0, 0, 0},
        {"host 2 threads", 2, 0, MF_STEP_PLACE_HOST, 0, 0, 0},
        {"hybrid emu:2", 2, 2, MF_STEP_PLACE_HYBRID, 0, 0, 0},
        {"hybrid emu:2 split", 2, 2, MF_STEP_PLACE_HYBRID, 0, 0, 1},
        {"seed emu:2 device graphs", 2, 2, MF_STEP_PLACE_SEED, 0, 1, 0},
        {"dense emu:2", 2, 2, MF_STEP_PLACE_HOST, MF_STEP_DENSE_CARDS, 0, 0},
        {"dense + hybrid emu:2", 2, 2, MF_STEP_PLACE_HYBRID, MF_STEP_DENSE_CARDS, 0, 0},
        {"dense + hybrid emu:2 split", 2, 2, MF_STEP_PLACE_HYBRID, MF_STEP_DENSE_CARDS, 0, 1},
    };
    /* TSan: batch 3, the settings with cards and 2 threads (the concurrent paths), 2 steps */
    static const int batches[] = {2, 3, 16}, tsan_b[] = {3};
    int n_dec = MF_TEST_SANITIZED ? 2 : 4;
    for (int store = 0; store < 2; store++) {
        mf_model *m = NULL;
        mf_ref *r = NULL;
        mf_model_opts mo = {.quiet = 1};
        if (store) {
            mo.store = MF_MODEL_STORE_STREAMED;
            mo.store_budget_bytes = 64ull << 20;
        }
        CHECK(mf_model_load(dir, &mo, &m) == 0, "load: %s", mf_last_error());
        if (!m || mf_ref_new(m, NULL, &r)) return mf_check_exit("test_micro");
        const mf_weight *ew = mf_model_layer_at(m, 0)->experts;
        double xb = 0;
        for (int k = 0; k < 3; k++) xb += (double)(ew[k].st_data->n_bytes + ew[k].st_scale->n_bytes);
        g_split_bps = xb / 200e-6;
        const char *what = store ? "tiny streamed" : "tiny resident";
        if (MF_TEST_TSAN) test_engine(r, what, tsan_b, 1, all + 2, store ? 1 : 4, n_dec);
        else test_engine(r, what, batches, 3, all, store ? 6 : 8, n_dec);
        mf_ref_free(r);
        mf_model_free(m);
    }
    return mf_check_exit("test_micro");
}
