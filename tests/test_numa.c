/* Both sockets, one copy, on a synthetic two-socket topology (this VM has one NUMA node; hwloc
 * loads "package:2 numa:1 core:1 pu:1" as this system, so its two PUs bind the real CPUs 0 and 1):
 * the socket table (sched/sched.h mf_topo_sockets), CPU lanes pinned to their socket's cores
 * (sched_getcpu inside tasks), tasks moved between CPU lanes (mf_graph_set_lane, between runs and
 * from a predecessor's fn), the resident store's experts in their home socket's region of the slab
 * (a node that does not exist is a note, not an error), the engine with one CPU lane per socket:
 * every host expert's task run by its home socket's workers (no profile: nothing across), logits
 * bit for bit (memcmp) the one-lane engine's on the same thread count (tiny, batch 1 and 3, two
 * micro-batches), and with a profile whose cost model takes slots across, still the same logits;
 * the simulator's lanes per socket and its slots across. SKIP (77) where CPUs 0 and 1 are not both
 * usable. */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/model/config.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/sim/plan.h"
#include "graphs/step/step.h"
#include "graphs/step/stepgraph.h"
#include "host/store.h"
#include "sched/error.h"
#include "sched/sched.h"
#include "tests/check.h"
#include "tests/step_run.h"
#include "tests/tiny_ckpt.h"

#define TOPO "package:2 numa:1 core:1 pu:1"
#define N_PROMPT 5

static int64_t g_V;

/* What a task saw: its lane and the CPU it ran on. */
typedef struct seen {
    int lane, cpu;
    mf_graph *g;
    mf_task_id move;   /* >= 0: move this task to lane 1 from here */
} seen;

static int record(void *arg, mf_task_ctx *ctx)
{
    seen *s = arg;
    s->lane = ctx->lane;
    s->cpu = sched_getcpu();
    if (s->move >= 0 && mf_graph_set_lane(s->g, s->move, 1)) return -EINVAL;
    return 0;
}

/* Two CPU lanes on the synthetic topology's two nodes, pinned: lane k's tasks run on CPU k; a task
 * moved before a run and one moved by its predecessor run on lane 1; a root cannot move. */
static void test_sched(void)
{
    mf_topo_sockets ts;
    CHECK(mf_topo_sockets_of(TOPO, &ts) == 0, "sockets of %s: %s", TOPO, mf_last_error());
    CHECK(ts.n == 2 && ts.cores[0] == 1 && ts.cores[1] == 1 && ts.numa[0] == 0 && ts.numa[1] == 1 &&
              ts.node[0] == 0 && ts.node[1] == 1,
          "%s: %d sockets, cores %d %d, nodes %d %d", TOPO, ts.n, ts.cores[0], ts.cores[1], ts.node[0], ts.node[1]);
    CHECK(mf_topo_sockets_of("package:2 numa:1 core:2 pu:1", &ts) == 0 && ts.n == 2 && ts.cores[1] == 2,
          "2 cores a socket: %d sockets, %d cores", ts.n, ts.cores[1]);
    CHECK(mf_topo_sockets_of("bogus:7", &ts) < 0, "a bad description accepted");
    mf_lane_desc lanes[2] = {
        {.kind = MF_LANE_CPU, .name = "cpu0", .concurrency = 1, .numa_node = 0, .device = -1},
        {.kind = MF_LANE_CPU, .name = "cpu1", .concurrency = 1, .numa_node = 1, .device = -1},
    };
    mf_sched *s = NULL;
    CHECK(mf_sched_create(&(mf_sched_opts){.lanes = lanes, .n_lanes = 2, .pin_threads = 1, .topology = TOPO}, &s) == 0,
          "sched on %s: %s", TOPO, mf_last_error());
    if (!s) return;
    mf_graph *g = NULL;
    CHECK(mf_graph_create(lanes, 2, &g) == 0, "graph");
    enum { N = 6 };
    seen sv[N];
    mf_task_id id[N];
    /* 0, 1: roots on lane 0 and 1; 2 after 0 on lane 0 (moved before the run); 3 after 0 on lane 0
     * (moved by 0's fn); 4 after 1 on lane 1; 5 after 0 on lane 0 (stays) */
    int lane0[N] = {0, 1, 0, 0, 1, 0}, pred[N] = {-1, -1, 0, 0, 1, 0};
    for (int k = 0; k < N; k++) {
        sv[k] = (seen){.lane = -1, .cpu = -1, .g = g, .move = -1};
        char nm[16];
        snprintf(nm, sizeof nm, "t%d", k);
        id[k] = mf_graph_add_task(g, &(mf_task_desc){.name = nm, .lane = lane0[k], .fn = record, .arg = &sv[k],
                                                     .place_hint = -1, .cost = {.time_ns = 1000}});
        if (pred[k] >= 0) mf_graph_add_dep(g, id[pred[k]], id[k]);
    }
    sv[0].move = id[3];
    CHECK(mf_graph_finalize(g) == 0, "finalize: %s", mf_last_error());
    CHECK(mf_graph_set_lane(g, id[0], 1) == -EINVAL, "a root moved");
    for (int run = 0; run < 2; run++) {
        CHECK(mf_graph_set_lane(g, id[2], 1) == 0, "move t2: %s", mf_last_error());
        CHECK(mf_graph_set_lane(g, id[3], 0) == 0, "t3 back to lane 0: %s", mf_last_error());
        CHECK(mf_sched_run(s, g, NULL) == 0, "run %d: %s", run, mf_last_error());
        int want_lane[N] = {0, 1, 1, 1, 1, 0};
        for (int k = 0; k < N; k++)
            CHECK(sv[k].lane == want_lane[k] && sv[k].cpu == want_lane[k],
                  "run %d: task %d ran on lane %d CPU %d (expected lane and CPU %d)", run, k, sv[k].lane, sv[k].cpu,
                  want_lane[k]);
    }
    mf_graph_destroy(g);
    mf_sched_destroy(s);
}

/* The resident store split across the two sockets by rows: every part (codes, scales) of every
 * expert has its rows mf_topo_rows(rows, 2, k) in socket k's share, and every row part the step
 * graph cuts (mf_sg_expert_rows, 2 to 8 parts) lies wholly in the share of the socket it is given.
 * Node 1 does not exist on a one-node machine: a note, and the store works. */
static void test_store(const char *dir)
{
    mf_model *m = NULL;
    mf_model_opts mo = {.quiet = 1, .store = MF_MODEL_STORE_RESIDENT, .store_n_sockets = 2,
                        .store_socket_node = {0, 1}};
    CHECK(mf_model_load(dir, &mo, &m) == 0, "load with a store on 2 sockets: %s", mf_last_error());
    if (!m) return;
    const mf_store *st = mf_model_store(m);
    const mf_config *c = mf_model_config(m);
    int bad = 0;
    int64_t parts = 0, per[2] = {0};
    for (int L = 0; L < c->n_layers; L++)
        for (int e = 0; e < c->n_routed_experts; e++)
            for (int w = 0; w < 3; w++) {
                const mf_weight *wt = &mf_model_layer_at(m, L)->experts[e * 3 + w];
                for (int q = 0; q < 2; q++) {   /* codes, scales */
                    const uint8_t *base = mf_store_part(st, L, e, 2 * w + q);
                    const mf_st_tensor *t = q ? wt->st_scale : wt->st_data;
                    uint64_t rb = t->n_bytes / (uint64_t)wt->rows;
                    CHECK(base, "layer %d expert %d part %d: not in the store", L, e, 2 * w + q);
                    if (!base) continue;
                    for (int pe = 2; pe <= 8; pe += 2)
                        for (int p = 0; p < pe; p++) {
                            int64_t r0, r1;
                            int k = mf_sg_expert_rows(wt->rows, pe, 2, p, &r0, &r1);
                            if (r0 >= r1) continue;
                            int k0 = mf_store_socket_of(st, base + (uint64_t)r0 * rb),
                                k1 = mf_store_socket_of(st, base + (uint64_t)r1 * rb - 1);
                            parts++;
                            if (pe == 2) per[k] += (r1 - r0) * (int64_t)rb;
                            if ((k0 != k || k1 != k) && !bad++)
                                CHECK(0, "layer %d expert %d part %d, row part %d of %d (rows %lld..%lld): bytes in "
                                      "sockets %d..%d's shares (given socket %d)", L, e, 2 * w + q, p, pe,
                                      (long long)r0, (long long)r1, k0, k1, k);
                        }
                }
            }
    CHECK(!bad && per[0] > 0 && per[1] > 0 && per[0] >= per[1] && per[0] - per[1] <= per[0] / 4,
          "bytes per socket %lld / %lld, %d bad", (long long)per[0], (long long)per[1], bad);
    CHECK(mf_store_n_bound(st) >= 1, "no socket's share bound (node 0 exists everywhere)");
    printf("store: %lld row parts checked, %lld / %lld expert bytes per socket, %d share(s) bound to their node\n",
           (long long)parts, (long long)per[0], (long long)per[1], mf_store_n_bound(st));
    mf_model_free(m);
}

static int32_t prompt_tok(int s, int i) { return (int32_t)((i * 53 + s * 97 + (i * s) % 11) % g_V); }

/* The engine with one CPU lane per socket against one lane of the same workers, bit for bit. */
static void test_engine(const char *dir)
{
    mf_model *m = NULL;
    mf_ref *r = NULL;
    mf_model_opts mo = {.quiet = 1, .store = MF_MODEL_STORE_RESIDENT, .store_n_sockets = 2,
                        .store_socket_node = {0, 1}};
    CHECK(mf_model_load(dir, &mo, &m) == 0 && mf_ref_new(m, NULL, &r) == 0, "load: %s", mf_last_error());
    if (!r) return;
    static const int batches[] = {1, 3};
    int n_dec = MF_TEST_SANITIZED ? 2 : 4;
    for (int bi = 0; bi < 2; bi++)
        for (int micro = 1; micro <= (batches[bi] > 1 ? 2 : 1); micro++) {
            int b = batches[bi];
            size_t per = (size_t)b * (1 + n_dec) * g_V;
            float *out[2] = {calloc(per, sizeof(float)), calloc(per, sizeof(float))};
            int32_t *toks = calloc((size_t)b * n_dec, sizeof *toks);
            for (int v = 0; v < 2; v++) {   /* one lane; two sockets */
                mf_step *e = NULL;
                mf_step_opts so = {.n_threads = 2, .micro = micro};
                if (v) {
                    so.n_sockets = 2;
                    so.topology = TOPO;
                    so.pin_threads = 1;
                }
                CHECK(mf_step_new(r, &so, &e) == 0, "engine %d: %s", v, mf_last_error());
                if (!e) continue;
                int64_t home = 0, cross = 0;
                int rc = mf_test_run_steps(r, e, g_V, b, N_PROMPT, prompt_tok, n_dec, toks, v == 0, out[v]);
                CHECK(rc == 0, "batch %d micro %d engine %d: %s", b, micro, v, mf_last_error());
                mf_step_dev_stats ds;
                mf_step_last_dev(e, &ds);
                home = ds.sock_home;
                cross = ds.sock_cross;
                if (v == 1)   /* every host expert part read its rows on the socket holding them */
                    CHECK(home > 0 && cross == 0,
                          "batch %d micro %d: %lld expert part weights read on their socket, %lld across "
                          "(expected all on theirs)", b, micro, (long long)home, (long long)cross);
                if (v && !rc) {
                    size_t bad = per;
                    for (size_t i = 0; i < per && bad == per; i++)
                        if (memcmp(&out[0][i], &out[v][i], sizeof(float))) bad = i;
                    CHECK(bad == per, "batch %d micro %d engine %d: logits differ from one lane's at %zu (%.9g vs %.9g)",
                          b, micro, v, bad, bad < per ? out[v][bad] : 0.0, bad < per ? out[0][bad] : 0.0);
                }
                mf_step_free(e);
            }
            for (int v = 0; v < 2; v++) free(out[v]);
            free(toks);
        }
    /* more sockets than the topology has, or than workers: refused */
    mf_step *e = NULL;
    CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2, .n_sockets = 3, .topology = TOPO}, &e) == -EINVAL && !e,
          "3 sockets on a 2-socket topology accepted");
    CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 1, .n_sockets = 2, .topology = TOPO}, &e) == -EINVAL && !e,
          "2 sockets for 1 worker accepted");
    mf_ref_free(r);
    mf_model_free(m);
}

/* The simulator with two sockets: a CPU lane each, every routed expert's row parts on both (each
 * on the lane of the socket holding its rows: the same work on each at any routing). */
static void test_sim(const mf_config *c)
{
    static mf_profile prof;
    memset(&prof, 0, sizeof prof);
    snprintf(prof.name, sizeof prof.name, "test");
    prof.n_sockets = 2;
    prof.threads_per_socket = 2;
    prof.mem_bytes_per_s = 40e9;
    prof.task_overhead_ns = 2000;
    for (int k = 0; k < MF_KF_N; k++)
        prof.host[k] = (mf_profile_kern){.bytes_per_s = k == MF_KF_REF ? 0 : 10e9, .macs_per_s = 2e9, .latency_ns = 1000};
    prof.host_vec = (mf_profile_kern){.macs_per_s = 2e9};
    for (int b = 1; b <= 8; b += 7) {
        mf_plan_report r;
        mf_plan_opts po = {.config = c, .profile = &prof, .batch = b, .seed = 1};
        CHECK(mf_plan_run(&po, 1, 4, &r) == 0, "sim: %s", mf_last_error());
        int lanes = 0;
        double busy[2] = {0};
        for (int l = 0; l < r.n_lanes; l++)
            if (!strcmp(r.lanes[l].name, "cpu0") || !strcmp(r.lanes[l].name, "cpu1")) {
                busy[lanes++ & 1] = (double)r.lanes[l].busy_ns;
                CHECK(r.lanes[l].busy_ns > 0 && r.lanes[l].slots == 2, "sim lane %s: %g ns busy, %d slots",
                      r.lanes[l].name, (double)r.lanes[l].busy_ns, r.lanes[l].slots);
            }
        CHECK(lanes == 2, "sim: %d socket lanes (expected cpu0, cpu1)", lanes);
        printf("sim batch %d: cpu0 %.3f ms, cpu1 %.3f ms of work\n", b, busy[0] / 1e6, busy[1] / 1e6);
    }
}

int main(void)
{
    cpu_set_t cs;
    if (sched_getaffinity(0, sizeof cs, &cs) || !CPU_ISSET(0, &cs) || !CPU_ISSET(1, &cs)) {
        printf("SKIP: CPUs 0 and 1 are not both usable here (the synthetic topology binds them)\n");
        return 77;
    }
    mf_config c;
    char dir[1024];
    CHECK(mf_config_preset("tiny", &c) == 0, "preset");
    test_sched();
    test_sim(&c);
    if (mf_test_gen_ckpt(&c, "numa_tiny", dir, sizeof dir)) return 1;
    g_V = c.vocab_size;
    test_store(dir);
    test_engine(dir);
    return mf_check_exit("test_numa");
}
