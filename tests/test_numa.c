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
#include <hwloc.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
    mf_model_opts mo = {.quiet = 1, .store = MF_MODEL_STORE_RESIDENT, .n_sockets = 2,
                        .socket_node = {0, 1}};
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

/* Whether the page holding p is bound to OS node 0 alone (hwloc's view of its policy). */
static int page_on_node0(hwloc_topology_t topo, const void *p)
{
    uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    hwloc_nodeset_t set = hwloc_bitmap_alloc();
    hwloc_membind_policy_t pol;
    int on = hwloc_get_area_membind(topo, (const void *)((uintptr_t)p / pg * pg), pg, set, &pol,
                                    HWLOC_MEMBIND_BYNODESET) == 0 &&
             pol == HWLOC_MEMBIND_BIND && hwloc_bitmap_weight(set) == 1 && hwloc_bitmap_isset(set, 0);
    hwloc_bitmap_free(set);
    return on;
}

/* Row part rows [r0, r1) of split matrix w given to socket k: 0 when its first and last bytes
 * lie in socket k's share (mf_model_socket_of; its first fp8 scale tile in the share of that
 * tile's first row) and, where
 * the page's first byte is in the part's share too, that page is bound to node 0 exactly when
 * socket k's node (node_of[k]) is 0; else 1. */
static int dense_part_bad(const mf_model *m, hwloc_topology_t topo, const mf_weight *w, int64_t r0, int64_t r1,
                          int k, const int *node_of)
{
    uint64_t rb = w->st_data->n_bytes / (uint64_t)w->rows, pg = (uint64_t)sysconf(_SC_PAGESIZE);
    const uint8_t *p0 = w->data + (uint64_t)r0 * rb, *p1 = w->data + (uint64_t)r1 * rb - 1;
    if (mf_model_socket_of(m, p0) != k || mf_model_socket_of(m, p1) != k) return 1;
    if (w->kind == MF_W_FP8 && w->scale) {   /* a tile's scales lie in its first row's share */
        int64_t t0 = r0 / w->block_rows * w->block_rows, a, b;
        uint64_t sb = w->st_scale->n_bytes / (uint64_t)((w->rows + w->block_rows - 1) / w->block_rows);
        int kt = 0;
        for (int j = 0; j < 2; j++) {
            mf_topo_rows(w->rows, 2, j, &a, &b);
            if (t0 >= a && t0 < b) kt = j;
        }
        if (mf_model_socket_of(m, w->scale + (uint64_t)(r0 / w->block_rows) * sb) != kt) return 1;
    }
    const uint8_t *mid = w->data + ((uint64_t)r0 * rb + (uint64_t)r1 * rb - 1) / 2;
    const uint8_t *page = (const uint8_t *)((uintptr_t)mid / pg * pg);
    if (page >= w->data && mf_model_socket_of(m, page) == k && page_on_node0(topo, mid) != (node_of[k] == 0)) return 1;
    return 0;
}

/* The dense weights (and the routed experts, no store) split across the sockets in the model's
 * memory, one copy: every row part the step graph's rule cuts (mf_sg_expert_rows of each split
 * matrix, mf_sg_stage_rows of all of a layer's together, 2 to 8 parts) lies in the share of the
 * socket it is given, and its pages are bound to that socket's node where the node exists (socket
 * nodes {0, 1} and {1, 0}: node 1 does not exist here, a note). Mutations: each part checked
 * against the other socket must fail. */
static void test_dense_mem(const char *dir)
{
    hwloc_topology_t topo;
    CHECK(hwloc_topology_init(&topo) == 0 && hwloc_topology_load(topo) == 0, "hwloc topology");
    for (int map = 0; map < 2; map++) {
        int node_of[2] = {map, 1 - map};
        mf_model *m = NULL;
        mf_model_opts mo = {.quiet = 1, .n_sockets = 2, .socket_node = {node_of[0], node_of[1]}};
        CHECK(mf_model_load(dir, &mo, &m) == 0, "load split over nodes %d, %d: %s", node_of[0], node_of[1],
              mf_last_error());
        if (!m) continue;
        const mf_config *c = mf_model_config(m);
        int max = 16 + 3 * c->n_routed_experts, bad = 0, caught = 0, n_w = 0, experts = 0;
        int64_t parts = 0, per[2] = {0};
        const mf_weight **w = malloc(sizeof *w * (size_t)max);
        for (int L = -1; w && L < c->n_layers; L++) {
            int nw = mf_model_split_weights(m, L, w, max);
            n_w += nw;
            for (int i = 0; i < nw; i++) {
                experts += w[i]->kind == MF_W_FP4;
                for (int pe = 2; pe <= 8; pe += 2)
                    for (int p = 0; p < pe; p++) {
                        int64_t r0, r1;
                        int k = mf_sg_expert_rows(w[i]->rows, pe, 2, p, &r0, &r1);
                        if (r0 >= r1) continue;
                        parts++;
                        if (pe == 2) per[k] += r1 - r0;
                        if (dense_part_bad(m, topo, w[i], r0, r1, k, node_of) && !bad++)
                            CHECK(0, "layer %d %s, row part %d of %d (rows %lld..%lld): not in socket %d's share", L,
                                  w[i]->name, p, pe, (long long)r0, (long long)r1, k);
                        caught += dense_part_bad(m, topo, w[i], r0, r1, 1 - k, node_of);   /* the wrong home */
                    }
            }
            /* the layer's matrices as one stage (the attention rows' rule) */
            int64_t rows[MF_SG_MAX_STAGE_LIN], r0[MF_SG_MAX_STAGE_LIN], r1[MF_SG_MAX_STAGE_LIN];
            int nl = nw < MF_SG_MAX_STAGE_LIN ? nw : MF_SG_MAX_STAGE_LIN;
            for (int i = 0; i < nl; i++) rows[i] = w[i]->rows;
            for (int pe = 2; pe <= 8; pe += 2)
                for (int p = 0; p < pe; p++) {
                    int k = mf_sg_stage_rows(rows, nl, pe, 2, p, r0, r1);
                    for (int i = 0; i < nl; i++)
                        if (r0[i] < r1[i] && dense_part_bad(m, topo, w[i], r0[i], r1[i], k, node_of) && !bad++)
                            CHECK(0, "layer %d stage of %d, part %d of %d, %s rows %lld..%lld: not in socket %d's share",
                                  L, nl, p, pe, w[i]->name, (long long)r0[i], (long long)r1[i], k);
                }
        }
        free(w);
        CHECK(!bad && parts > 0 && caught == parts, "%lld dense row parts, %d outside their share, %d of them caught "
              "at the wrong home", (long long)parts, bad, caught);
        CHECK(n_w > 4 * c->n_layers && experts == 3 * c->n_layers * c->n_routed_experts,
              "%d split matrices (%d of experts)", n_w, experts);
        CHECK(per[0] > 0 && per[1] > 0, "rows per socket %lld / %lld", (long long)per[0], (long long)per[1]);
        CHECK(mf_model_n_bound(m) == 1, "%d sockets' shares bound (expected node 0's)", mf_model_n_bound(m));
        printf("dense: nodes %d, %d: %d split matrices, %lld row parts in their share, rows %lld / %lld per socket\n",
               node_of[0], node_of[1], n_w, (long long)parts, (long long)per[0], (long long)per[1]);
        mf_model_free(m);
    }
    hwloc_topology_destroy(topo);
}

static int32_t prompt_tok(int s, int i) { return (int32_t)((i * 53 + s * 97 + (i * s) % 11) % g_V); }

/* Moves every dense row part task of the decode graph of n items on socket 1's lane to socket 0's
 * (a wrong home); returns how many moved. */
static int move_dense_parts(mf_step *e, int n)
{
    int moved = 0;
    for (int par = 0; par < 2; par++) {
        const mf_stepgraph *sg = mf_step_graph(e, n, par);
        for (int t = 0; sg && t < sg->n_tasks; t++) {
            int op = sg->task[t].op;
            if ((op == MF_SG_ATTN_ROWS || op == MF_SG_GATE_ROWS || op == MF_SG_SHARED_UP || op == MF_SG_HEAD) &&
                mf_graph_task(sg->g, t)->lane != 0 && mf_graph_set_lane(sg->g, t, 0) == 0)
                moved++;
        }
    }
    return moved;
}

/* The engine with one CPU lane per socket against one lane of the same workers, bit for bit:
 * store 1 with the routed experts in a resident store split by sockets, 0 in the model's memory
 * (split with the dense weights). Every host expert part and dense row part runs on the socket
 * holding its rows; moving the dense parts to the other socket is caught (the counters), with the
 * same logits. */
static void test_engine(const char *dir, int store, int n_dec)
{
    mf_model *m = NULL;
    mf_ref *r = NULL;
    mf_model_opts mo = {.quiet = 1, .store = store ? MF_MODEL_STORE_RESIDENT : MF_MODEL_STORE_NONE, .n_sockets = 2,
                        .socket_node = {0, 1}};
    CHECK(mf_model_load(dir, &mo, &m) == 0 && mf_ref_new(m, NULL, &r) == 0, "load: %s", mf_last_error());
    if (!r) return;
    g_V = mf_model_config(m)->vocab_size;
    static const int batches[] = {1, 3};
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
                CHECK(rc == 0, "store %d batch %d micro %d engine %d: %s", store, b, micro, v, mf_last_error());
                mf_step_dev_stats ds;
                mf_step_last_dev(e, &ds);
                home = ds.sock_home;
                cross = ds.sock_cross;
                if (v == 1) {   /* every host expert and dense part read its rows on the socket holding them */
                    CHECK(home > 0 && cross == 0,
                          "store %d batch %d micro %d: %lld expert part weights read on their socket, %lld across "
                          "(expected all on theirs)", store, b, micro, (long long)home, (long long)cross);
                    CHECK(ds.dense_home > 0 && ds.dense_cross == 0,
                          "store %d batch %d micro %d: %lld dense part weights read on their socket, %lld across "
                          "(expected all on theirs)", store, b, micro, (long long)ds.dense_home,
                          (long long)ds.dense_cross);
                }
                if (v && !rc) {
                    size_t bad = per;
                    for (size_t i = 0; i < per && bad == per; i++)
                        if (memcmp(&out[0][i], &out[v][i], sizeof(float))) bad = i;
                    CHECK(bad == per, "store %d batch %d micro %d engine %d: logits differ from one lane's at %zu (%.9g vs %.9g)",
                          store, b, micro, v, bad, bad < per ? out[v][bad] : 0.0, bad < per ? out[0][bad] : 0.0);
                }
                if (v && !rc && micro == 1) {   /* the mutation: the dense parts at the wrong home */
                    int moved = move_dense_parts(e, b);
                    float *again = calloc(per, sizeof(float));
                    rc = again ? mf_test_run_steps(r, e, g_V, b, N_PROMPT, prompt_tok, n_dec, toks, 0, again) : -ENOMEM;
                    mf_step_last_dev(e, &ds);
                    CHECK(rc == 0 && moved > 0 && ds.dense_cross > 0 && !memcmp(again, out[0], per * sizeof(float)),
                          "store %d batch %d: %d dense parts moved to socket 0, %lld read across (expected some), "
                          "logits %s", store, b, moved, (long long)ds.dense_cross,
                          again && !memcmp(again, out[0], per * sizeof(float)) ? "the same" : "differ");
                    free(again);
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
    test_store(dir);
    test_dense_mem(dir);
    test_engine(dir, 1, MF_TEST_SANITIZED ? 2 : 4);
    test_engine(dir, 0, MF_TEST_SANITIZED ? 2 : 4);
    /* demo-sized, where the generated demo checkpoint is at hand (`moeflow gen --preset demo`) */
    const char *home = getenv("HOME");
    char demo[1200];
    snprintf(demo, sizeof demo, "%s/.cache/moeflow/demo/config.json", home ? home : "");
    if (!MF_TEST_SANITIZED && home && access(demo, R_OK) == 0) {
        demo[strlen(demo) - strlen("/config.json")] = 0;
        test_engine(demo, 0, 2);
        printf("demo (%s): one lane and two sockets compared\n", demo);
    } else {
        printf("demo: skipped (%s)\n", MF_TEST_SANITIZED ? "a sanitizer" : "no ~/.cache/moeflow/demo");
    }
    return mf_check_exit("test_numa");
}
