/* The decode-step simulator (graphs/sim/plan.h): task counts per lane against a hand count for the
 * tiny config, makespans worked out by hand on a profile where only the executor's overhead (and
 * then the head) costs anything, bit-identical repeats, cache counters that add up, the flash41
 * preset at full size without files, refusals of bad options, and the simulator's core pool. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <jansson.h>

#include "device/dev.h"
#include "device/expert_cache.h"
#include "graphs/model/config.h"
#include "graphs/model/model.h"
#include "graphs/sim/plan.h"
#include "graphs/ref/ref.h"
#include "graphs/layers/layers.h"
#include "graphs/step/fast_attn.h"
#include "graphs/step/spec.h"
#include "graphs/step/step.h"
#include "graphs/step/stepgraph.h"
#include "graphs/sim/routing.h"
#include "sched/error.h"
#include "sched/graph.h"
#include "sched/profile.h"
#include "sched/sim.h"
#include "sched/timeline.h"
#include "tests/check.h"
#include "tests/step_run.h"
#include "tests/tiny_ckpt.h"

#define FREE 1e30   /* a rate at which nothing costs anything */

/* A profile where every kernel, the disk and the cards are free and each task costs the executor
 * overhead_ns; threads_per_socket workers on one socket. */
static mf_profile free_profile(int threads, double overhead_ns)
{
    mf_profile p;
    memset(&p, 0, sizeof p);
    snprintf(p.name, sizeof p.name, "test");
    p.n_sockets = 1;
    p.threads_per_socket = threads;
    p.mem_bytes_per_s = FREE;
    p.cross_socket_factor = 1;
    p.task_overhead_ns = overhead_ns;
    for (int k = 0; k < MF_KF_N; k++) {
        p.host[k] = (mf_profile_kern){.bytes_per_s = k == MF_KF_REF ? 0 : FREE, .macs_per_s = FREE};
        p.card[k] = p.host[k];
    }
    p.host_vec = (mf_profile_kern){.macs_per_s = FREE};
    p.disk_bytes_per_s = FREE;
    p.disk_queue_depth = 1;
    p.n_cards = 2;
    p.card_mem_bytes = UINT64_C(1) << 40;
    p.h2d_bytes_per_s = p.d2h_bytes_per_s = p.h2d_total_bytes_per_s = FREE;
    return p;
}

/* Tasks per lane name in the last step's Chrome trace. */
static int count_lane(const char *trace, const char *lane_prefix)
{
    json_error_t err;
    json_t *root = json_load_file(trace, 0, &err);
    CHECK(root, "reading %s: %s", trace, err.text);
    if (!root) return -1;
    json_t *ev = json_is_array(root) ? root : json_object_get(root, "traceEvents");
    /* track names: metadata events "thread_name" with args.name; slices on those tids */
    int tids[256], n_tids = 0, n = 0;
    size_t i;
    json_t *e;
    json_array_foreach(ev, i, e) {
        const char *ph = json_string_value(json_object_get(e, "ph"));
        const char *nm = json_string_value(json_object_get(e, "name"));
        if (ph && nm && !strcmp(ph, "M") && !strcmp(nm, "thread_name")) {
            const char *tn = json_string_value(json_object_get(json_object_get(e, "args"), "name"));
            if (tn && !strncmp(tn, lane_prefix, strlen(lane_prefix)) && n_tids < 256)
                tids[n_tids++] = (int)json_integer_value(json_object_get(e, "tid"));
        }
    }
    json_array_foreach(ev, i, e) {
        const char *ph = json_string_value(json_object_get(e, "ph"));
        if (!ph || strcmp(ph, "X")) continue;
        int tid = (int)json_integer_value(json_object_get(e, "tid"));
        for (int k = 0; k < n_tids; k++) n += tid == tids[k];
    }
    json_decref(root);
    return n;
}

static void test_structure(const char *tmp)
{
    mf_config c;
    CHECK(!mf_config_preset("tiny", &c), "preset tiny");
    mf_profile f = free_profile(1, 1000);
    char trace[512];
    snprintf(trace, sizeof trace, "%s/plan_trace.json", tmp);
    /* batch 1, one worker: n_slots = min(1 x 2, 16) = 2, one row part per expert, one shared part,
     * two head parts, one row part per attention stage and router gate, 4 of the Engram wkv
     * (graphs/step/stepgraph_shape.c SG_EG_ROW_SPLIT per worker and kernel pass), one part
     * (one head group, one column part, one mix part) per item task. Per layer: attention
     * collapse, attn norm, attn mix, in, qb, oa, ob, q scale, q norm, oa join, attn kv, core,
     * heads, post, ffn norm, ffn mix, post join (17), gate, route, moe done, 2 x (join, up, down),
     * shared join, up, down, combine, combine join = 31, plus Engram embed, 4 wkv parts, gate on
     * layers 1 and 3 and the index score part and select on the index layers 2, 4 and 6; then head
     * join, final collapse, final norm, 2 heads: 8 x 31 + 2 x 6 + 3 x 2 + 5 = 271. */
    mf_plan *p;
    mf_plan_report r;
    CHECK(!mf_plan_new(&(mf_plan_opts){.config = &c, .profile = &f, .seed = 3}, &p), "%s", mf_last_error());
    CHECK(!mf_plan_step(p, &r), "%s", mf_last_error());
    CHECK(r.n_tasks == 271, "tiny host: %d tasks, expected 271", r.n_tasks);
    /* every task costs 1 us and there is one worker: the makespan is the task count in us */
    CHECK(r.step_ns == 271 * 1000, "tiny host makespan %lld ns, expected 271000", (long long)r.step_ns);
    CHECK(r.n_lanes == 1 && r.lanes[0].busy_ns == 271000, "cpu lane work %lld", (long long)r.lanes[0].busy_ns);
    CHECK(r.host_slots == 16 && r.dev_slots == 0, "slots: %lld host, %lld dev", (long long)r.host_slots,
          (long long)r.dev_slots);
    mf_plan_free(p);
    /* sleeping workers (worker_wake_ns): the one worker is asleep when the step starts and never
     * idle after (each task releases the next): one wake-up, whatever the spin */
    f.worker_wake_ns = 5000;
    for (int spin = 0; spin <= 1000000; spin += 1000000) {
        f.worker_spin_ns = spin;
        CHECK(!mf_plan_new(&(mf_plan_opts){.config = &c, .profile = &f, .seed = 3}, &p), "%s", mf_last_error());
        CHECK(!mf_plan_step(p, &r), "%s", mf_last_error());
        CHECK(r.step_ns == 271 * 1000 + 5000, "tiny host, wake 5 us, spin %d ns: makespan %lld, expected 276000",
              spin, (long long)r.step_ns);
        mf_plan_free(p);
    }
    f.worker_wake_ns = f.worker_spin_ns = 0;

    /* routed experts alone cost: fp4 at 417792e3 B/s. One expert is w1, w3 [64, 256] and w2
     * [256, 64], each 64 x 256 / 2 code bytes + 64 x 256 / 32 scale bytes = 8704: 26112 bytes;
     * 2 slots x 8 layers = 417792 bytes = 1 ms on the one worker, after the 271 tasks' 1 us each.
     * (An up task is 41666.67 ns, a down task 20833.33 ns: rounded per task they still sum to 1 ms.) */
    f.host[MF_KF_FP4].bytes_per_s = 417792e3;
    CHECK(!mf_plan_new(&(mf_plan_opts){.config = &c, .profile = &f}, &p), "%s", mf_last_error());
    CHECK(!mf_plan_step(p, &r), "%s", mf_last_error());
    CHECK(r.step_ns == 271 * 1000 + 1000000, "tiny host + experts makespan %lld ns, expected 1271000",
          (long long)r.step_ns);
    mf_plan_free(p);
    f.host[MF_KF_FP4].bytes_per_s = FREE;

    /* streamed experts: 6 reads per slot and layer on the IO lane (2 x 6 x 8 = 96);
     * seed on 2 cards: per card, slot and layer in / ffn / out (2 x 2 x 8 = 32 per lane kind) */
    CHECK(!mf_plan_new(&(mf_plan_opts){.config = &c, .profile = &f, .placement = MF_STEP_PLACE_SEED,
                                       .store = MF_PLAN_STORE_STREAMED, .store_budget_bytes = 64 << 20},
                       &p), "%s", mf_last_error());
    CHECK(!mf_plan_step(p, &r), "%s", mf_last_error());
    CHECK(r.n_tasks == 271 + 96 + 3 * 2 * 16, "tiny seed streamed: %d tasks, expected %d", r.n_tasks,
          271 + 96 + 96);
    CHECK(r.n_lanes == 2 + 6, "%d lanes", r.n_lanes);
    CHECK(!mf_plan_write_trace(p, trace), "%s", mf_last_error());
    CHECK(count_lane(trace, "io") == 96, "io lane: %d tasks", count_lane(trace, "io"));
    CHECK(count_lane(trace, "dev0.h2d") == 16, "dev0.h2d: %d tasks", count_lane(trace, "dev0.h2d"));
    CHECK(count_lane(trace, "dev1.compute") == 16, "dev1.compute: %d tasks", count_lane(trace, "dev1.compute"));
    CHECK(count_lane(trace, "cpu") == 271, "cpu: %d tasks", count_lane(trace, "cpu"));
    CHECK(r.dev_slots == 16 && r.host_slots == 0, "seed: %lld dev slots, %lld host", (long long)r.dev_slots,
          (long long)r.host_slots);
    mf_plan_free(p);

    /* emulated cards: each device task first holds its stream's host thread and a core for the
     * round trip (a lane option of the simulator, no tasks of its own): the same 271 + 96 tasks
     * and 1 + 6 lanes; one core (one worker) serializes the 2 slots x 3 device tasks x 8 layers
     * round trips of 1 ms each */
    f.cards_emulated = 1;
    CHECK(!mf_plan_new(&(mf_plan_opts){.config = &c, .profile = &f, .placement = MF_STEP_PLACE_SEED,
                                       .dev_task_ns = 1e6}, &p), "%s", mf_last_error());
    CHECK(!mf_plan_step(p, &r), "%s", mf_last_error());
    CHECK(r.n_tasks == 271 + 96 && r.n_lanes == 1 + 6, "tiny seed emulated: %d tasks, %d lanes", r.n_tasks,
          r.n_lanes);
    CHECK(r.step_ns >= 48 * 1000000 && r.step_ns < 49 * 1000000, "tiny seed emulated: makespan %lld ns, expected "
          "48 ms of round trips on the one core", (long long)r.step_ns);
    mf_plan_free(p);
    remove(trace);
}

static int same_report(const mf_plan_report *a, const mf_plan_report *b)
{
    if (a->step_ns != b->step_ns || a->n_tasks != b->n_tasks || a->dev_hits != b->dev_hits ||
        a->dev_misses != b->dev_misses || a->store_hits != b->store_hits || a->store_misses != b->store_misses ||
        a->n_lanes != b->n_lanes || a->bottleneck != b->bottleneck || a->token_ns != b->token_ns)
        return 0;
    for (int q = 0; q < MF_STEP_N_PHASES; q++)
        if (a->phase_ns[q] != b->phase_ns[q] || a->busy_ns[q] != b->busy_ns[q]) return 0;
    for (int l = 0; l < a->n_lanes; l++)
        if (a->lanes[l].busy_ns != b->lanes[l].busy_ns || a->lanes[l].share != b->lanes[l].share) return 0;
    return 1;
}

/* A profile with costs everywhere (figures of no machine in particular). */
/* A serial graph's tasks but the index score parts and the compressor's item ranges (the parts of
 * a long unit that are not per item group). */
/* Those parts of a one-unit serial graph: per scored layer key_parts[g] score tasks of group g
 * (p_key..MF_SG_MAX_PARTS each, the last group's at least the first's: its items see more
 * entries), none elsewhere; per layer the compressor's ranges (at most p_attn) tile the items in
 * order. */
static void check_long_parts(const mf_config *c, const mf_stepgraph *sg)
{
    for (int L = 0; L < c->n_layers; L++) {
        int n_score = 0, want = 0, next = 0, n_cmp = 0;
        for (int g = 0; g < sg->n_groups; g++) {
            want += mf_sg_layer_scored(c, L) ? sg->key_parts[g] : 0;
            CHECK(sg->key_parts[g] >= sg->p_key && sg->key_parts[g] <= MF_SG_MAX_PARTS, "group %d: %d score parts", g,
                  sg->key_parts[g]);
        }
        for (int t = 0; t < sg->n_tasks; t++) {
            const mf_sg_task *r = &sg->task[t];
            if (r->layer != L) continue;
            n_score += r->op == MF_SG_ATTN_SCORE;
            if (r->op == MF_SG_ATTN_KV && r->part == 1) {
                CHECK(r->i0 == next && r->i1 > r->i0, "layer %d: a compressor range [%d, %d) after %d", L, r->i0, r->i1,
                      next);
                next = r->i1;
                n_cmp++;
            }
        }
        CHECK(n_score == want, "layer %d: %d score tasks (expected %d)", L, n_score, want);
        CHECK(next == sg->n && n_cmp >= 1 && n_cmp <= sg->p_attn, "layer %d: %d compressor ranges to item %d of %d", L,
              n_cmp, next, sg->n);
    }
    CHECK(sg->key_parts[sg->n_groups - 1] >= sg->key_parts[0], "score parts: the last group %d, the first %d",
          sg->key_parts[sg->n_groups - 1], sg->key_parts[0]);
}

/* A route's row gather in parts: one per worker up to MF_SG_MAX_PARTS when the rows are many (a
 * 300-position chunk's 600 rows on 40 workers: 40 parts, more than batch 64's 16), parts of at
 * least 4 rows (6 items: 12 rows, 3 parts), each part once per layer (MF_SG_ROUTE_ROWS). */
static void check_gather_parts(const mf_config *c)
{
    static const struct { int threads, n, want; } k[] = {{40, 300, 40}, {100, 300, MF_SG_MAX_PARTS}, {40, 6, 3}};
    for (size_t j = 0; j < sizeof k / sizeof k[0]; j++) {
        mf_profile f = free_profile(k[j].threads, 1000);
        mf_plan *p = NULL;
        CHECK(!mf_plan_new(&(mf_plan_opts){.config = c, .profile = &f, .prefill = 1, .batch = k[j].n}, &p), "%s",
              mf_last_error());
        const mf_stepgraph *sg = p ? mf_plan_graph(p) : NULL;
        CHECK(sg && sg->p_gather == k[j].want, "%d items on %d workers: %d gather parts (expected %d)", k[j].n,
              k[j].threads, sg ? sg->p_gather : -1, k[j].want);
        for (int L = 0; sg && L < c->n_layers; L++) {
            uint64_t seen[(MF_SG_MAX_PARTS + 63) / 64] = {0};
            int n_rows = 0;
            for (int t = 0; t < sg->n_tasks; t++) {
                const mf_sg_task *r = &sg->task[t];
                if (r->layer != L || r->op != MF_SG_ROUTE_ROWS) continue;
                CHECK(r->part >= 0 && r->part < sg->p_gather && !(seen[r->part / 64] >> (r->part % 64) & 1),
                      "layer %d: gather part %d of %d", L, r->part, sg->p_gather);
                if (r->part >= 0 && r->part < MF_SG_MAX_PARTS) seen[r->part / 64] |= UINT64_C(1) << (r->part % 64);
                n_rows++;
            }
            CHECK(n_rows == sg->p_gather, "layer %d: %d gather tasks (expected %d)", L, n_rows, sg->p_gather);
        }
        mf_plan_free(p);
    }
}

/* The Engram gate of a long unit on both sockets' lanes (item group g on socket g mod 2's), like
 * the tasks without weights: 300 positions, 128 groups, 64 on each CPU lane. */
static void check_gate_sockets(const mf_config *c)
{
    mf_profile f = free_profile(2, 1000);
    f.n_sockets = 2;
    mf_plan *p = NULL;
    CHECK(!mf_plan_new(&(mf_plan_opts){.config = c, .profile = &f, .prefill = 1, .batch = 300}, &p), "%s",
          mf_last_error());
    const mf_stepgraph *sg = p ? mf_plan_graph(p) : NULL;
    int n_eg = 0;
    for (int L = 0; sg && L < c->n_layers; L++) {
        if (mf_config_engram_slot(c, L) < 0) continue;
        int n[2] = {0}, other = 0;
        n_eg++;
        for (int t = 0; t < sg->n_tasks; t++) {
            if (sg->task[t].layer != L || sg->task[t].op != MF_SG_ENGRAM_GATE) continue;
            const char *ln = mf_graph_lane(sg->g, mf_graph_task(sg->g, t)->lane)->name;
            if (!strcmp(ln, "cpu0")) n[0]++;
            else if (!strcmp(ln, "cpu1")) n[1]++;
            else other++;
        }
        CHECK(n[0] == sg->n_groups / 2 && n[1] == sg->n_groups / 2 && !other,
              "layer %d: Engram gate tasks %d on cpu0, %d on cpu1, %d elsewhere (expected %d each)", L, n[0], n[1],
              other, sg->n_groups / 2);
    }
    CHECK(n_eg > 0, "no Engram layer in the test's config");
    mf_plan_free(p);
}

static mf_profile costly_profile(void)
{
    mf_profile f = free_profile(4, 2000);
    f.mem_bytes_per_s = 40e9;
    for (int k = 0; k < MF_KF_N; k++) {
        f.host[k] = (mf_profile_kern){.bytes_per_s = k == MF_KF_REF ? 0 : 10e9, .macs_per_s = 2e9, .latency_ns = 1000};
        f.card[k] = (mf_profile_kern){.bytes_per_s = k == MF_KF_REF ? 0 : 300e9, .macs_per_s = 10e12, .latency_ns = 5000};
    }
    f.host_vec = (mf_profile_kern){.macs_per_s = 2e9};
    f.disk_bytes_per_s = 1e9;
    f.disk_latency_ns = 100000;
    f.disk_queue_depth = 8;
    f.n_cards = 4;
    f.card_mem_bytes = UINT64_C(11) << 30;
    f.h2d_bytes_per_s = f.d2h_bytes_per_s = f.h2d_total_bytes_per_s = 8e9;
    f.h2d_latency_ns = f.d2h_latency_ns = 10000;
    return f;
}

static void test_determinism_and_caches(void)
{
    mf_config c;
    CHECK(!mf_config_preset("demo", &c), "preset demo");
    mf_profile f = costly_profile();
    for (int pl = MF_STEP_PLACE_HOST; pl <= MF_STEP_PLACE_HYBRID; pl++) {
        /* a small device cache (40 experts per card) and a streamed store of 100 experts */
        mf_plan_opts o = {.config = &c, .profile = &f, .placement = pl, .batch = 4, .seed = 11,
                          .dev_cache_bytes = 40 * UINT64_C(1300000), .store = MF_PLAN_STORE_STREAMED,
                          .store_budget_bytes = 100 * UINT64_C(1300000)};
        mf_plan_report a, b;
        CHECK(!mf_plan_run(&o, 2, 5, &a), "%s", mf_last_error());
        CHECK(!mf_plan_run(&o, 2, 5, &b), "%s", mf_last_error());
        CHECK(same_report(&a, &b), "placement %d: two runs with the same seed differ", pl);
        o.seed = 12;
        CHECK(!mf_plan_run(&o, 2, 5, &b), "%s", mf_last_error());
        CHECK(a.step_ns > 0 && a.token_ns == (double)a.step_ns / 4, "placement %d: step %lld token %g", pl,
              (long long)a.step_ns, a.token_ns);
        CHECK(a.dev_hits + a.dev_misses == (uint64_t)a.dev_slots, "placement %d: %llu hits + %llu misses != %lld "
              "card slots", pl, (unsigned long long)a.dev_hits, (unsigned long long)a.dev_misses,
              (long long)a.dev_slots);
        CHECK(a.store_hits + a.store_misses == (uint64_t)(a.dev_slots + a.host_slots), "placement %d: store "
              "%llu + %llu != %lld slots", pl, (unsigned long long)a.store_hits,
              (unsigned long long)a.store_misses, (long long)(a.dev_slots + a.host_slots));
        CHECK(a.store_misses > 0 && a.store_hits > 0, "placement %d: store %llu hits %llu misses", pl,
              (unsigned long long)a.store_hits, (unsigned long long)a.store_misses);
        if (pl == MF_STEP_PLACE_SEED)
            CHECK(a.host_slots == 0 && a.dev_slots > 0 && a.dev_misses > 0 && a.dev_evictions > 0,
                  "seed: %lld host slots, %llu misses, %llu evictions", (long long)a.host_slots,
                  (unsigned long long)a.dev_misses, (unsigned long long)a.dev_evictions);
        if (pl == MF_STEP_PLACE_HOST) CHECK(a.dev_slots == 0, "host: %lld card slots", (long long)a.dev_slots);
        double share = 0;
        for (int l = 0; l < a.n_lanes; l++) {
            CHECK(a.lanes[l].share >= 0 && a.lanes[l].share <= 1.0 + 1e-9, "lane %s share %g", a.lanes[l].name,
                  a.lanes[l].share);
            share = a.lanes[l].share > share ? a.lanes[l].share : share;
        }
        CHECK(a.lanes[a.bottleneck].share == share, "bottleneck is not the busiest lane");
        int64_t ph = 0;
        for (int q = 0; q < MF_STEP_N_PHASES; q++) ph += a.phase_ns[q];
        CHECK(ph >= a.step_ns - MF_STEP_N_PHASES, "phases %lld < step %lld", (long long)ph, (long long)a.step_ns);
    }
    /* LRU and LFU keep different experts: the counters differ on the same draws */
    mf_plan_opts o = {.config = &c, .profile = &f, .placement = MF_STEP_PLACE_SEED, .batch = 2, .seed = 5,
                      .dev_cache_bytes = 30 * UINT64_C(1300000)};
    mf_plan_report lfu, lru;
    CHECK(!mf_plan_run(&o, 4, 8, &lfu), "%s", mf_last_error());
    o.dev_cache_policy = MF_PLAN_CACHE_LRU;
    CHECK(!mf_plan_run(&o, 4, 8, &lru), "%s", mf_last_error());
    CHECK(lfu.dev_slots == lru.dev_slots, "seed slots differ between policies");
    CHECK(lfu.dev_hits != lru.dev_hits, "LFU and LRU gave the same hits (%llu)", (unsigned long long)lfu.dev_hits);
    /* a routing object replaces the built-in draws */
    mf_routing *rt;
    CHECK(!mf_routing_open("zipf:1.2", c.n_layers, c.n_routed_experts, c.n_experts_per_tok, 5, &rt), "%s",
          mf_last_error());
    o.routing = rt;
    o.dev_cache_policy = MF_PLAN_CACHE_LFU;
    mf_plan_report z;
    CHECK(!mf_plan_run(&o, 4, 8, &z), "%s", mf_last_error());
    CHECK(z.dev_hits > lfu.dev_hits, "zipf routing should hit more than uniform: %llu vs %llu",
          (unsigned long long)z.dev_hits, (unsigned long long)lfu.dev_hits);
    mf_routing_free(rt);
}

/* A decode batch that uses nearly every expert of every layer each step (demo: 64 x 6 draws over 64
 * experts) with card caches of a third of the experts: the routes' misses evict by their layers'
 * next use (mf_resid_acquire_ahead), so the caches keep the layers still to come and hit. Plain
 * LFU with aging (every count rising alike, least recently used among equals) evicted each expert
 * just before its next use: 0 hits. */
static void test_decode_cyclic_cache(void)
{
    mf_config c;
    CHECK(!mf_config_preset("demo", &c), "preset demo");
    mf_profile f = costly_profile();
    mf_plan_opts o = {.config = &c, .profile = &f, .placement = MF_STEP_PLACE_SEED, .batch = 64, .seed = 3,
                      .dev_cache_bytes = 40 * UINT64_C(1300000)};
    mf_plan_report r;
    CHECK(!mf_plan_run(&o, 3, 4, &r), "%s", mf_last_error());
    CHECK(r.host_slots == 0 && r.dev_slots > 0, "seed: %lld host slots", (long long)r.host_slots);
    CHECK(r.dev_hits * 10 >= (uint64_t)r.dev_slots, "a batch of 64 on demo: %llu hits of %lld card slots (the "
          "caches thrash)", (unsigned long long)r.dev_hits, (long long)r.dev_slots);
}

/* Hybrid placement weighs the profile's rates (mf_step_lane_models, as an engine given the same
 * profile): slow host kernels send experts to the cards, slow copies keep them on the host. */
static void test_hybrid_models(void)
{
    mf_config c;
    CHECK(!mf_config_preset("demo", &c), "preset demo");
    mf_profile f = costly_profile();
    mf_lane_model m[4];
    mf_step_lane_models(&f, 4, m);
    CHECK(m[0].bytes_per_s == 10e9 && m[0].latency_ns == 1000, "cpu model %g B/s %g ns", m[0].bytes_per_s,
          m[0].latency_ns);
    CHECK(m[1].bytes_per_s == 8e9 && m[1].latency_ns == 10000 && m[2].bytes_per_s == 300e9 &&
          m[3].bytes_per_s == 8e9, "card models %g %g %g", m[1].bytes_per_s, m[2].bytes_per_s, m[3].bytes_per_s);
    mf_step_lane_models(&f, 16, m);   /* 16 workers, one socket: its 40e9 B/s shared */
    CHECK(m[0].bytes_per_s == 40e9 * 1 / 16, "16 workers on one socket: %g B/s each", m[0].bytes_per_s);
    mf_step_lane_models(NULL, 4, m);
    CHECK(m[0].bytes_per_s == 20e9 && m[1].bytes_per_s == 25e9 && m[2].bytes_per_s == 20e9, "built-in models");
    mf_plan_opts o = {.config = &c, .profile = &f, .placement = MF_STEP_PLACE_HYBRID, .batch = 1, .seed = 3};
    mf_plan_report fast_cards, slow_cards;
    f.host[MF_KF_FP4].bytes_per_s = 1e8;   /* host kernels 100x slower than a copy */
    CHECK(!mf_plan_run(&o, 1, 3, &fast_cards), "%s", mf_last_error());
    CHECK(fast_cards.dev_slots > 0, "slow host: hybrid put %lld slots on cards", (long long)fast_cards.dev_slots);
    f = costly_profile();
    f.h2d_bytes_per_s = 1e6;                /* copies 10000x slower than the host */
    o.profile = &f;
    CHECK(!mf_plan_run(&o, 1, 3, &slow_cards), "%s", mf_last_error());
    CHECK(slow_cards.dev_slots == 0 && slow_cards.host_slots > 0, "slow copies: hybrid put %lld slots on cards",
          (long long)slow_cards.dev_slots);
}

static void test_flash41(void)
{
    mf_config c;
    CHECK(!mf_config_preset("flash41", &c), "preset flash41");
    mf_profile f = costly_profile();
    mf_plan *p;
    mf_plan_report r;
    /* 40 layers x 384 experts, the full layout; batch 8, seed on 4 cards, streamed */
    CHECK(!mf_plan_new(&(mf_plan_opts){.config = &c, .profile = &f, .placement = MF_STEP_PLACE_HYBRID,
                                       .batch = 8, .store = MF_PLAN_STORE_STREAMED,
                                       .tables = MF_PLAN_STORE_STREAMED}, &p), "%s", mf_last_error());
    for (int k = 0; k < 2; k++) CHECK(!mf_plan_step(p, &r), "%s", mf_last_error());
    CHECK(r.step_ns > 0 && r.n_tasks > 40 * 48, "flash41: step %lld ns, %d tasks", (long long)r.step_ns, r.n_tasks);
    CHECK(r.dev_slots + r.host_slots > 0 && r.table_bytes_read > 0, "flash41: slots %lld + %lld, table bytes %llu",
          (long long)r.dev_slots, (long long)r.host_slots, (unsigned long long)r.table_bytes_read);
    mf_plan_free(p);
}

/* The card memory a plan takes for the steps' buffers (mf_sg_card_reserve, as the engine holds
 * them back): flash41 with dense cards of 11 GiB: the caches of a 2,048-position chunk hold fewer
 * experts than a 512-position one's (its buffers are larger), the dense-only figure (the cache
 * budget) likewise, and an 8,192-position chunk (7.95 GB of buffers beside 2.0 to 4.7 GB of dense
 * weights: card 3 cannot) is refused as the engine refuses it; with a budget the budget must fit beside them. */
static void test_card_memory(void)
{
    mf_config c;
    CHECK(!mf_config_preset("flash41", &c), "preset flash41");
    mf_profile f = costly_profile();
    int64_t filled[2] = {0, 0};
    const int chunks[2] = {512, 2048};
    for (int k = 0; k < 2; k++) {
        mf_plan *p = NULL;
        CHECK(!mf_plan_new(&(mf_plan_opts){.config = &c, .profile = &f, .placement = MF_STEP_PLACE_HYBRID,
                                           .dense = MF_PLAN_DENSE_CARDS, .batch = chunks[k], .prefill = 1,
                                           .chunk = chunks[k], .dev_cache_fill = 1}, &p),
              "chunk %d: %s", chunks[k], mf_last_error());
        mf_plan_report r;
        if (p) mf_plan_total(p, &r), filled[k] = r.fill_experts;
        mf_plan_free(p);
    }
    CHECK(filled[1] > 0 && filled[1] < filled[0], "cache experts filled: %lld at chunk 512, %lld at 2048",
          (long long)filled[0], (long long)filled[1]);
    mf_plan *p = NULL;
    int rc = mf_plan_new(&(mf_plan_opts){.config = &c, .profile = &f, .placement = MF_STEP_PLACE_HYBRID,
                                         .dense = MF_PLAN_DENSE_CARDS, .batch = 8192, .prefill = 1}, &p);
    CHECK(rc == -ENOSPC && !p && strstr(mf_last_error(), "cannot hold its dense weights"),
          "chunk 8192 on 11 GiB cards: rc %d: %s", rc, mf_last_error());
    mf_plan_free(p);
    p = NULL;
    rc = mf_plan_new(&(mf_plan_opts){.config = &c, .profile = &f, .placement = MF_STEP_PLACE_HYBRID,
                                     .dense = MF_PLAN_DENSE_CARDS, .batch = 2048, .prefill = 1,
                                     .dev_cache_bytes = UINT64_C(8) << 30}, &p);
    CHECK(rc == -ENOSPC && !p && strstr(mf_last_error(), "budget"), "an 8 GiB budget beside chunk 2048's: rc %d: %s",
          rc, mf_last_error());
    mf_plan_free(p);
}

static void test_refusals(void)
{
    mf_config c;
    CHECK(!mf_config_preset("tiny", &c), "preset tiny");
    mf_profile f = free_profile(2, 1000), nocards = f;
    nocards.n_cards = 0;
    mf_profile norate = f;
    norate.host[MF_KF_FP8].bytes_per_s = 0;
    mf_plan *p = NULL;
    struct {
        mf_plan_opts o;
        int code;
        const char *needle;
    } bad[] = {
        {{.config = &c, .profile = &f, .batch = MF_STEP_MAX_ITEMS + 1}, -EINVAL, "batch 513"},
        {{.config = &c, .profile = &f, .placement = 7}, -EINVAL, "placement 7"},
        {{.config = &c, .profile = &nocards, .placement = MF_STEP_PLACE_SEED}, -EINVAL, "needs cards"},
        {{.config = &c, .profile = &f, .read_window = -2}, -EINVAL, "read window -2"},
        {{.config = &c, .profile = &f, .copy_slots = 65}, -EINVAL, "65 copy slots"},
        {{.config = &c, .profile = &f, .dev_cache_policy = 3}, -EINVAL, "cache policy 3"},
        {{.config = &c, .profile = &f, .store = 5}, -EINVAL, "store modes"},
        {{.config = &c, .profile = &f, .threads_per_socket = 300}, -EINVAL, "threads"},
        {{.config = &c, .profile = &norate}, -EINVAL, "no host fp8 rate"},
        {{.config = &c, .profile = &f, .batch = 4, .store = MF_PLAN_STORE_STREAMED, .store_budget_bytes = 4096},
         -ENOSPC, "at least"},
        {{.config = &c, .profile = &f, .placement = MF_STEP_PLACE_SEED, .dev_cache_bytes = 100}, -ENOSPC,
         "holds no expert"},
        {{.config = NULL, .profile = &f}, -EINVAL, "config and a profile"},
        {{.config = &c, .profile = &f, .dev_task_ns = -5}, -EINVAL, "device task time"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = mf_plan_new(&bad[i].o, &p);
        CHECK(rc == bad[i].code && !p, "case %zu: rc %d, expected %d", i, rc, bad[i].code);
        CHECK(strstr(mf_last_error(), bad[i].needle), "case %zu: message '%s' lacks '%s'", i, mf_last_error(),
              bad[i].needle);
        mf_plan_free(p);
        p = NULL;
    }
    mf_config broken = c;
    broken.n_experts_per_tok = 99;
    CHECK(mf_plan_new(&(mf_plan_opts){.config = &broken, .profile = &f}, &p) == -EINVAL,
          "an invalid config was accepted");
    CHECK(mf_plan_run(&(mf_plan_opts){.config = &c, .profile = &f}, 0, 0, NULL) == -EINVAL, "0 steps accepted");
    CHECK(!mf_plan_new(&(mf_plan_opts){.config = &c, .profile = &f}, &p), "%s", mf_last_error());
    CHECK(mf_plan_write_trace(p, "/nonexistent/x.json") == -EINVAL && strstr(mf_last_error(), "no step"),
          "trace before a step: %s", mf_last_error());
    mf_plan_free(p);
}

/* sched/sim.c's core pool: two 1 ms tasks on two lanes that need a core. */
static void test_core_pool(void)
{
    mf_lane_desc lanes[2] = {{.kind = MF_LANE_CPU, .name = "a", .concurrency = 1, .numa_node = -1},
                             {.kind = MF_LANE_DEV_COMPUTE, .name = "b", .concurrency = 1, .numa_node = -1}};
    mf_graph *g;
    mf_timeline *tl;
    CHECK(!mf_graph_create(lanes, 2, &g), "%s", mf_last_error());
    mf_task_id a = mf_graph_add_task(g, &(mf_task_desc){.name = "a", .lane = 0, .place_hint = -1});
    mf_task_id b = mf_graph_add_task(g, &(mf_task_desc){.name = "b", .lane = 1, .place_hint = -1});
    CHECK(a == 0 && b == 1, "add tasks");
    CHECK(!mf_graph_finalize(g), "%s", mf_last_error());
    CHECK(!mf_timeline_create(g, &tl), "%s", mf_last_error());
    int64_t ns[2] = {1000000, 1000000};
    uint8_t core[2] = {1, 1};
    mf_timeline_summary s;
    struct { int n_cores; const uint8_t *flags; int64_t makespan; } cases[] = {
        {1, core, 2000000}, {2, core, 1000000}, {0, core, 1000000}, {1, NULL, 1000000}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        CHECK(!mf_sim_run_opts(g, &(mf_sim_opts){.task_ns = ns, .lane_core = cases[i].flags,
                                                 .n_cores = cases[i].n_cores}, tl), "%s", mf_last_error());
        CHECK(!mf_timeline_summarize(tl, &s), "summarize");
        CHECK(s.makespan_ns == cases[i].makespan, "pool case %zu: makespan %lld, expected %lld", i,
              (long long)s.makespan_ns, (long long)cases[i].makespan);
    }
    CHECK(mf_sim_run_opts(g, &(mf_sim_opts){.n_cores = -1}, tl) == -EINVAL, "a negative pool was accepted");
    mf_timeline_destroy(tl);
    mf_graph_destroy(g);
}

/* Two step graphs are the same: tasks (name, lane, priority cost), edges, lanes and records. */
static int same_graph(const mf_stepgraph *a, const mf_stepgraph *b, const char *what)
{
    const mf_graph *x = a->g, *y = b->g;
    int n = mf_graph_n_tasks(x), bad = 0;
    CHECK(n == mf_graph_n_tasks(y) && a->n_tasks == n && b->n_tasks == n, "%s: %d tasks, simulator %d", what, n,
          mf_graph_n_tasks(y));
    CHECK(mf_graph_n_lanes(x) == mf_graph_n_lanes(y), "%s: %d lanes, simulator %d", what, mf_graph_n_lanes(x),
          mf_graph_n_lanes(y));
    if (n != mf_graph_n_tasks(y) || mf_graph_n_lanes(x) != mf_graph_n_lanes(y)) return 0;
    for (int l = 0; l < mf_graph_n_lanes(x); l++) {
        const mf_lane_desc *p = mf_graph_lane(x, l), *q = mf_graph_lane(y, l);
        CHECK(p->kind == q->kind && !strcmp(p->name, q->name) && p->concurrency == q->concurrency &&
                  p->device == q->device && !memcmp(&p->model, &q->model, sizeof p->model),
              "%s: lane %d: %s (%d) vs the simulator's %s (%d)", what, l, p->name, p->concurrency, q->name,
              q->concurrency);
    }
    for (int t = 0; t < n && bad < 3; t++) {
        const mf_task_desc *p = mf_graph_task(x, t), *q = mf_graph_task(y, t);
        const mf_sg_task *r = &a->task[t], *s = &b->task[t];
        int same = !strcmp(p->name, q->name) && p->lane == q->lane && p->cost.bytes == q->cost.bytes &&
                   p->cost.time_ns == q->cost.time_ns && mf_graph_rank_ns(x, t) == mf_graph_rank_ns(y, t) &&
                   mf_graph_n_pred(x, t) == mf_graph_n_pred(y, t) && mf_graph_n_succ(x, t) == mf_graph_n_succ(y, t) &&
                   !memcmp(mf_graph_pred(x, t), mf_graph_pred(y, t), sizeof(mf_task_id) * mf_graph_n_pred(x, t));
        same = same && r->op == s->op && r->phase == s->phase && r->kind == s->kind &&
               r->slot_tokens == s->slot_tokens && r->layer == s->layer && r->stage == s->stage &&
               r->card == s->card && r->read == s->read && r->slot == s->slot && r->part == s->part && r->i0 == s->i0 && r->i1 == s->i1 &&
               r->r0 == s->r0 && r->r1 == s->r1 && r->n_tok == s->n_tok && !memcmp(&r->w, &s->w, sizeof r->w);
        CHECK(same, "%s: task %d: engine '%s' (lane %d, %d preds), simulator '%s' (lane %d, %d preds)", what, t,
              p->name, p->lane, mf_graph_n_pred(x, t), q->name, q->lane, mf_graph_n_pred(y, t));
        bad += !same;
    }
    CHECK(a->n_slots == b->n_slots && a->tid_per_slot == b->tid_per_slot &&
              !memcmp(a->slot_tid, b->slot_tid, sizeof *a->slot_tid * (size_t)8 * a->n_slots * a->tid_per_slot),
          "%s: the slot task tables differ", what);
    return !bad;
}

/* The simulated graph IS the engine's: on the tiny checkpoint, the graph the real engine ran for a
 * decode step and the graph the simulator runs for the same settings are the same tasks, edges,
 * lanes and records, for host, seed and hybrid placement (emulated cards), with and without a
 * streamed store (experts and Engram tables: the gathers' IO tasks too), with and without device
 * graphs, 1 and 3 workers, batch 1 and 3; the
 * simulator then steps through it. */
static void test_same_graph(void)
{
    mf_config c;
    char dir[1024];
    CHECK(!mf_config_preset("tiny", &c), "preset tiny");
    if (mf_test_gen_ckpt(&c, "plan_tiny", dir, sizeof dir)) {
        CHECK(0, "tiny checkpoint");
        return;
    }
    CHECK(c.n_layers == 8, "tiny has %d layers (the slot table check counts 8)", c.n_layers);
    float *logits = malloc(sizeof(float) * 3 * (size_t)c.vocab_size);
    int n_same = 0, n_cases = 0;
    for (int streamed = 0; streamed <= 1; streamed++) {
        mf_model *m = NULL;
        mf_ref *r = NULL;
        CHECK(!mf_model_load(dir, &(mf_model_opts){.quiet = 1, .store = streamed ? MF_MODEL_STORE_STREAMED : 0,
                                                   .store_budget_bytes = 64 << 20}, &m) &&
                  !mf_ref_new(m, NULL, &r), "%s", mf_last_error());
        if (r && !streamed) {   /* the sizes the graph is built from (the layout) are the model's */
            mf_sg_sizes *sz = NULL;
            CHECK(!mf_sg_sizes_new(&c, &sz), "%s", mf_last_error());
            for (int L = 0; sz && L < c.n_layers; L++) {
                const mf_model_layer *y = mf_model_layer_at(m, L);
                for (int st = 0; st < MF_LY_A_N_STAGES; st++) {
                    mf_ly_attn_lin lin[MF_LY_A_MAX_LIN];
                    int nl = mf_ly_attn_linears(mf_ref_layers(r), L, st, lin);
                    double bytes = 0;
                    for (int k = 0; k < nl; k++) bytes += (double)mf_weight_data_bytes(lin[k].w);
                    CHECK(bytes == sz->layer[L].st_data_bytes[st], "layer %d stage %d: the engine's linears have "
                          "%.0f bytes, the layout's %.0f", L, st, bytes, sz->layer[L].st_data_bytes[st]);
                }
                if (mf_config_engram_slot(&c, L) >= 0)
                    CHECK((double)mf_weight_data_bytes(&y->eg_wkv) == sz->layer[L].eng_data_bytes,
                          "layer %d: Engram wkv %.0f bytes in the layout", L, sz->layer[L].eng_data_bytes);
            }
            mf_sg_sizes_free(sz);
        }
        for (int place = MF_STEP_PLACE_HOST; r && place <= MF_STEP_PLACE_HYBRID; place++)
            for (int dg = 0; dg <= (place != MF_STEP_PLACE_HOST); dg++)
                for (int threads = 1; threads <= 3; threads += 2)
                    for (int batch = 1; batch <= 3; batch += 2) {
                        char what[128];
                        snprintf(what, sizeof what, "%s, placement %d, device graphs %d, %d workers, batch %d",
                                 streamed ? "streamed" : "resident", place, dg, threads, batch);
                        mf_profile f = free_profile(threads, 1000);
                        f.cards_emulated = 1;
                        mf_dev *d = NULL;
                        mf_step *e = NULL;
                        if (place != MF_STEP_PLACE_HOST) CHECK(!mf_dev_open("emu:2", &d), "%s", mf_last_error());
                        CHECK(!mf_step_new(r, &(mf_step_opts){.n_threads = threads, .dev = d, .placement = place,
                                                              .dev_graphs = dg, .profile = &f}, &e),
                              "%s: %s", what, mf_last_error());
                        mf_ref_state *st[3] = {0};
                        int32_t tok[3] = {5, 9, 13}, prompt[4] = {1, 2, 3, 4};
                        int rc = e ? 0 : -1;
                        for (int s = 0; s < batch && !rc; s++) {
                            rc = mf_ref_state_new(r, 16, &st[s]);
                            if (!rc) rc = mf_step_prefill(e, st[s], prompt, 4, logits);
                        }
                        if (!rc) rc = mf_step_decode(e, st, tok, batch, logits);
                        CHECK(!rc, "%s: %s", what, mf_last_error());
                        mf_plan *p = NULL;
                        CHECK(!mf_plan_new(&(mf_plan_opts){.config = &c, .profile = &f, .placement = place,
                                                           .n_cards = 2, .batch = batch, .dev_graphs = dg,
                                                           .store = streamed ? MF_PLAN_STORE_STREAMED : 0,
                                                           /* the model's tables follow its store: streamed,
                                                            * Engram gathers as IO tasks in both graphs */
                                                           .tables = streamed ? MF_PLAN_STORE_STREAMED : 0,
                                                           .store_budget_bytes = 64 << 20, .seed = 1},
                                           &p),
                              "%s: %s", what, mf_last_error());
                        const mf_stepgraph *eg = e ? mf_step_graph(e, batch, batch > 1) : NULL;
                        CHECK(eg, "%s: the engine ran no graph of batch %d", what, batch);
                        if (eg && p) n_same += same_graph(eg, mf_plan_graph(p), what);
                        mf_plan_report pr;
                        CHECK(p && !mf_plan_step(p, &pr) && pr.n_tasks == (eg ? eg->n_tasks : -1),
                              "%s: simulating the engine's graph: %s", what, mf_last_error());
                        n_cases++;
                        mf_plan_free(p);
                        for (int s = 0; s < batch; s++) mf_ref_state_free(st[s]);
                        mf_step_free(e);
                        mf_dev_close(d);
                    }
        mf_ref_free(r);
        mf_model_free(m);
    }
    CHECK(n_cases == 40 && n_same == n_cases, "%d of %d settings had the engine's graph", n_same, n_cases);
    free(logits);
}

/* Prefill (mf_plan_prefill): chunks through the engine's serial graph. Hand-computed on the free
 * profile: chunks of 1 position are the batch-1 graph (271 tasks of 1 us on one worker, counted in
 * the tiny host case above, the head parts included though only the last chunk computes logits),
 * so 5 tokens take 5 x 271 us. On the
 * costly profile: deterministic, a later chunk costs more (its positions see more keys), a shorter
 * last chunk adds less than a full one, the default chunk is MF_STEP_PREFILL_CHUNK, refusals. */
/* The hybrid placer (graphs/step/stepgraph.h mf_sg_placer) weighs a slot's tokens by the
 * profile's fp4 multiply-add rates: on costly_profile (host 2 GMAC/s a thread, cards 10 TMAC/s),
 * an expert of 1 MB and 3 M multiply-adds a token, not cached: 1 token on the host (100 us of
 * bytes over 2 workers against a 125 us copy), 100 tokens on the card (149 ms of the host's
 * multiply-adds against 0.2 ms); without multiply-add rates (the 2% a token rule) 100 tokens stay
 * on the host (0.3 ms over 2 workers against 0.16 ms). */
static void test_placer_tokens(void)
{
    mf_profile f = costly_profile();
    mf_lane_model m[4];
    mf_step_lane_models(&f, 2, m);
    mf_sg_placer pl;
    mf_sg_placer_init(&pl, m, &f, 2, 1, 1e6, 3e6, 0, 0, 0);
    mf_sg_place_host_work(&pl, 1);
    CHECK(mf_sg_place_want_card(&pl, 0, 1, 0) == 0, "1 token: the host");
    mf_sg_placer_init(&pl, m, &f, 2, 1, 1e6, 3e6, 0, 0, 0);
    mf_sg_place_host_work(&pl, 100);
    CHECK(mf_sg_place_want_card(&pl, 0, 100, 0) == 1, "100 tokens: the card (host %.0f ns, card %.0f ns)",
          pl.host_ns, pl.t_dev);
    for (int k = 0; k < MF_KF_N; k++) f.host[k].macs_per_s = f.card[k].macs_per_s = 0;
    mf_sg_placer_init(&pl, m, &f, 2, 1, 1e6, 3e6, 0, 0, 0);
    mf_sg_place_host_work(&pl, 100);
    CHECK(mf_sg_place_want_card(&pl, 0, 100, 0) == 0, "100 tokens, no multiply-add rates: the host (%.0f, %.0f ns)",
          pl.host_ns, pl.t_dev);
}

/* The placer's order and prices (graphs/step/stepgraph.h mf_sg_placer): a slot's copy-in is priced as
 * the graph's MF_SG_DEV_IN record is (mf_sg_task_ns: rows, token weights and, on a miss, the
 * expert's parts, each copy paying the h2d latency), hit or miss; a slot is weighed against the
 * host's whole queue, so the same uncached slot offered first stays on the host when the queue is
 * one slot and moves to its card when the queue is 20; moving it takes its work off the host's
 * queue. costly_profile, 2 workers, an expert of 1 MB and 3 M multiply-adds, 16 kB rows. */
static void test_placer_queue(void)
{
    mf_profile f = costly_profile();
    mf_lane_model m[4];
    mf_step_lane_models(&f, 2, m);
    mf_cost_model cm = {.p = &f};
    double miss_ns[2] = {0, 0};
    for (int span = 0; span < 2; span++)   /* a miss one copy per part (0), one span (1) */
        for (int cached = 0; cached < 2; cached++) {
            mf_sg_placer pl;
            mf_sg_placer_init(&pl, m, &f, 2, 1, 1e6, 3e6, 16388, 16384, span);
            mf_sg_place_host_work(&pl, 3);
            (void)mf_sg_place_want_card(&pl, 1, 3, cached);
            mf_sg_task t = {.op = MF_SG_DEV_IN, .slot_tokens = 1,
                            .w = {.copy_bytes = 1e6, .copy_bytes_tok = 16388, .copies = span}};
            mf_sg_step_cost st = {.slot_tokens = 3, .dev_miss = !cached};
            double want = mf_sg_task_ns(&t, &cm, &st);
            CHECK(fabs(pl.copy_ns - want) < 1e-6 * want, "span %d, cached %d: the placer's copy-in %.1f ns, the "
                  "record's %.1f ns", span, cached, pl.copy_ns, want);
            if (!cached) miss_ns[span] = want;
        }
    CHECK(fabs(miss_ns[0] - miss_ns[1] - (MF_SG_EXPERT_PARTS - 1) * f.h2d_latency_ns) < 1e-6 * miss_ns[0],
          "a miss as one span saves %d copies' latency: %.1f against %.1f ns", MF_SG_EXPERT_PARTS - 1, miss_ns[1],
          miss_ns[0]);
    mf_sg_placer pl;
    mf_sg_placer_init(&pl, m, &f, 2, 1, 1e6, 3e6, 16388, 16384, 0);
    mf_sg_place_host_work(&pl, 1);
    CHECK(mf_sg_place_want_card(&pl, 0, 1, 0) == 0, "a queue of one slot: the miss stays on the host (host %.0f ns, "
          "card %.0f ns)", pl.host_q / 2, pl.t_dev);
    mf_sg_placer_init(&pl, m, &f, 2, 1, 1e6, 3e6, 16388, 16384, 0);
    for (int s = 0; s < 20; s++) mf_sg_place_host_work(&pl, 1);
    double q = pl.host_q;
    CHECK(mf_sg_place_want_card(&pl, 0, 1, 0) == 1, "a queue of 20 slots: the first offered moves to its card (host "
          "%.0f ns, card %.0f ns)", pl.host_q / 2, pl.t_dev);
    mf_sg_place_card(&pl);
    CHECK(fabs(pl.host_q - (q - pl.host_ns)) < 1e-6 * q && pl.host_ns > 0, "the moved slot's work left the host's queue");
}

/* The experts' prefetch (graphs/step/stepgraph.h mf_stepgraph.prefetch): the default threshold is
 * the length at which every expert is expected used (tiny: 16 experts, top 2: ceil(ln 16 /
 * -ln(7/8)) = 21; flash41: 378); a prefill chunk of 32 on 2 hybrid cards builds it (one place task
 * and 16 copy tasks a layer) and its report counts every expert of every layer per chunk, a chunk
 * of 8 or --prefetch-min -1 does not; the placer's head start: an uncached expert whose copy fits
 * in it costs the card what a cached one does; the last chunk's trace names the copy tasks; a
 * slot's copy-in waits for its card's copies of the experts from the slot's up (a join of them),
 * not for all, and ranks above them and above the next layer's copies on its card (which share
 * the MoE window's link: two layers' pins at a time); each layer's place task between the
 * previous layer's route and MoE done. */
/* 1 when task `pred` is a direct predecessor of task t. */
static int has_pred(const mf_graph *g, mf_task_id t, mf_task_id pred)
{
    const mf_task_id *pr = mf_graph_pred(g, t);
    for (int k = 0; t >= 0 && k < mf_graph_n_pred(g, t); k++)
        if (pr[k] == pred) return 1;
    return 0;
}

static void test_prefetch_plan(void)
{
    mf_config c;
    CHECK(!mf_config_preset("tiny", &c), "preset tiny");
    mf_config f41;
    CHECK(!mf_config_preset("flash41", &f41), "preset flash41");
    CHECK(mf_sg_prefetch_min(&c) == 21 && mf_sg_prefetch_min(&f41) == 378, "thresholds %d, %d",
          mf_sg_prefetch_min(&c), mf_sg_prefetch_min(&f41));
    mf_profile f = costly_profile();
    for (int k = 0; k < 3; k++) {
        int chunk = k == 1 ? 8 : 32, pm = k == 2 ? -1 : 0;
        mf_plan_opts o = {.config = &c, .profile = &f, .seed = 3, .placement = MF_STEP_PLACE_HYBRID, .n_cards = 2,
                          .prefill = 1, .batch = chunk, .prefetch_min = pm};
        mf_plan *p = NULL;
        CHECK(!mf_plan_new(&o, &p), "%s", mf_last_error());
        if (!p) continue;
        int want = k == 0, pre = 0, place = 0;
        const mf_stepgraph *sg = mf_plan_graph(p);
        for (int t = 0; t < sg->n_tasks; t++) {
            pre += sg->task[t].op == MF_SG_DEV_PRE;
            place += sg->task[t].op == MF_SG_MOE_PLACE;
        }
        CHECK(sg->prefetch == want && pre == want * c.n_layers * c.n_routed_experts && place == want * c.n_layers,
              "chunk %d, prefetch_min %d: prefetch %d, %d copy and %d place tasks", chunk, pm, sg->prefetch, pre, place);
        /* each slot's copy-in on a card: after a join of the card's copies of every expert >= the
         * slot (the slot table's distinct experts ascending: the slot's own among them), not of all
         * of them, and ranked above them all (mf_sg_prefetch, mf_sg_pre_ranks) */
        int E = c.n_routed_experts, bad_dep = 0, bad_rank = 0, early = 0;
        for (int L = 0; want && L < c.n_layers; L++)
            for (int cd = 0; cd < 2; cd++) {
                double top = 0;   /* this layer's copies on the card, and the next layer's (the MoE window's) */
                for (int e = 0; e < E; e++)
                    for (int l = L; l <= L + 1 && l < c.n_layers; l++) {
                        mf_task_id pt = sg->pre_tid[(size_t)l * E + e];
                        if (sg->task[pt].card == cd && mf_graph_rank_ns(sg->g, pt) > top) top = mf_graph_rank_ns(sg->g, pt);
                    }
                for (int s = 0; s < sg->n_slots; s++) {
                    mf_task_id din = sg->slot_tid[((size_t)L * sg->n_slots + s) * sg->tid_per_slot + 2 * sg->p_exp + 1 + 3 * cd];
                    bad_rank += !(mf_graph_rank_ns(sg->g, din) > top);
                    const mf_task_id *pr = mf_graph_pred(sg->g, din);
                    mf_task_id j = -1;
                    for (int k = 0; k < mf_graph_n_pred(sg->g, din); k++)
                        if (sg->task[pr[k]].op == MF_SG_JOIN && sg->task[pr[k]].phase == MF_SG_PH_OTHER) j = pr[k];
                    int missing = j < 0, n_pre = 0;
                    for (int e = s; j >= 0 && e < E; e++) {
                        if (mf_dev_xcache_owner(2, L, e) != cd) continue;
                        int found = 0;
                        const mf_task_id *jp = mf_graph_pred(sg->g, j);
                        for (int k = 0; k < mf_graph_n_pred(sg->g, j); k++) found |= jp[k] == sg->pre_tid[(size_t)L * E + e];
                        missing += !found;
                    }
                    for (int k = 0; j >= 0 && k < mf_graph_n_pred(sg->g, j); k++)
                        n_pre += sg->task[mf_graph_pred(sg->g, j)[k]].op == MF_SG_DEV_PRE;
                    bad_dep += missing > 0;
                    early += j >= 0 && n_pre < E / 2;   /* a high slot waits for fewer than the card's all */
                }
            }
        CHECK(!bad_dep && !bad_rank && (!want || early > 0), "chunk %d: %d slot copy-ins without their experts' "
              "copies, %d ranked below a copy, %d waiting for part of the copies", chunk, bad_dep, bad_rank, early);
        /* two layers' pins at a time (mf_sg_prefetch): layer L's place task follows layer L - 1's
         * route (not its MoE done) and layer L - 2's MoE done, and layer L - 1's MoE done follows it */
        mf_task_id plc[64], route[64], done[64];
        for (int L = 0; L < c.n_layers && L < 64; L++) plc[L] = route[L] = done[L] = -1;
        for (int t = 0; t < sg->n_tasks; t++) {
            const mf_sg_task *r = &sg->task[t];
            if (r->layer < 0 || r->layer >= 64) continue;
            if (r->op == MF_SG_MOE_PLACE) plc[r->layer] = t;
            if (r->op == MF_SG_ROUTE && r->part < 0) route[r->layer] = t;
            if (r->op == MF_SG_MOE_DONE) done[r->layer] = t;
        }
        int bad_pin = 0;
        for (int L = 1; want && L < c.n_layers; L++) {
            bad_pin += !has_pred(sg->g, plc[L], route[L - 1]) || has_pred(sg->g, plc[L], done[L - 1]) ||
                       !has_pred(sg->g, done[L - 1], plc[L]);
            if (L >= 2) bad_pin += !has_pred(sg->g, plc[L], done[L - 2]);
        }
        CHECK(!bad_pin, "chunk %d: %d layers whose place task is not between the previous layer's route and MoE done",
              chunk, bad_pin);
        mf_plan_free(p);
        char trace[1100];
        snprintf(trace, sizeof trace, "%s/plan_prefetch.json", getenv("MOEFLOW_TMP") ? getenv("MOEFLOW_TMP") : ".");
        mf_plan_report r;
        int64_t ns;
        CHECK(!mf_plan_prefill_trace(&o, 2 * chunk, chunk, &r, &ns, trace) && ns > 0, "%s", mf_last_error());
        int64_t all = 2LL * c.n_layers * c.n_routed_experts;
        CHECK(want ? r.dev_slots + r.host_slots == all && r.dev_slots > 0 : r.dev_slots + r.host_slots < all,
              "chunk %d, prefetch_min %d: %lld + %lld slots over 2 chunks (every expert: %lld)", chunk, pm,
              (long long)r.dev_slots, (long long)r.host_slots, (long long)all);
        CHECK(r.dev_hits + r.dev_misses == (uint64_t)r.dev_slots, "chunk %d: hits + misses", chunk);
        FILE *tf = fopen(trace, "r");
        char *buf = malloc(1 << 22);
        size_t nr = tf && buf ? fread(buf, 1, (1 << 22) - 1, tf) : 0;
        if (buf) buf[nr] = 0;
        if (tf) fclose(tf);
        remove(trace);
        CHECK(nr > 0 && (strstr(buf, " expert 0 pre") != NULL) == want, "chunk %d: the prefill's trace (%zu bytes)",
              chunk, nr);
        free(buf);
    }
    mf_lane_model m[4];
    mf_step_lane_models(&f, 2, m);
    mf_sg_placer a, b;
    mf_sg_placer_init(&a, m, &f, 2, 1, 1e6, 3e6, 16388, 16384, 0);
    mf_sg_placer_init(&b, m, &f, 2, 1, 1e6, 3e6, 16388, 16384, 0);
    mf_sg_place_ahead(&b, 1e9, 0, NULL);
    mf_sg_place_host_work(&a, 3);
    mf_sg_place_host_work(&b, 3);
    (void)mf_sg_place_want_card(&a, 1, 3, 1);
    (void)mf_sg_place_want_card(&b, 1, 3, 0);
    CHECK(fabs(a.t_dev - b.t_dev) < 1e-6 * a.t_dev && b.pre_ns > 0,
          "a miss within the head start: %.1f ns on the card, a hit %.1f ns", b.t_dev, a.t_dev);
    mf_sg_place_card(&b);
    CHECK(fabs(b.pre_q[1] - (-1e9 + b.pre_ns)) < 1 && b.copy_q[1] > 0, "the parts' queue and the rows' queue");
    /* the next layer's head start: the link time this layer's MoE window leaves each card (the
     * host's queue over the workers past the card's copies), added to the copies' head start;
     * the window's other host work starts the host's queue */
    mf_sg_placer w;
    mf_sg_placer_init(&w, m, &f, 4, 1, 1e6, 3e6, 16388, 16384, 0);
    double left[MF_SG_MAX_CARDS], extra[MF_SG_MAX_CARDS] = {5e6, 0, 0, 0};
    mf_sg_place_ahead(&w, 1e6, 4e8, extra);
    CHECK(w.host_q == 4e8 && w.pre_q[0] == -6e6 && w.pre_q[1] == -1e6, "head start %.0f, %.0f ns, host %.0f ns",
          w.pre_q[0], w.pre_q[1], w.host_q);
    w.pre_q[0] = 3e7, w.copy_q[0] = 4e7;   /* 100 ms window: 60 ms left */
    w.pre_q[1] = -1e7, w.copy_q[1] = -5e6; /* copies done before the route: all of it */
    w.pre_q[2] = 1.5e8;                    /* past the window: none */
    mf_sg_place_left(&w, left);
    CHECK(fabs(left[0] - 6e7) < 1 && fabs(left[1] - 1e8) < 1 && left[2] == 0, "left %.0f %.0f %.0f ns", left[0],
          left[1], left[2]);
}

static void test_prefill(void)
{
    mf_config c;
    CHECK(!mf_config_preset("tiny", &c), "preset tiny");
    mf_profile f = free_profile(1, 1000);
    mf_plan_opts o = {.config = &c, .profile = &f, .seed = 3};
    mf_plan_report r;
    int64_t t1 = 0, t2 = 0, t3 = 0, t4 = 0;
    CHECK(!mf_plan_prefill(&o, 5, 1, &r, &t1), "%s", mf_last_error());
    CHECK(t1 == 5 * 271 * 1000 && r.n_tasks == 271 && r.batch == 1, "5 chunks of 1: %lld ns, %d tasks",
          (long long)t1, r.n_tasks);
    mf_plan *p = NULL;
    CHECK(!mf_plan_new(&(mf_plan_opts){.config = &c, .profile = &f, .prefill = 1, .batch = 8}, &p), "%s", mf_last_error());
    CHECK(p && !mf_plan_graph(p)->par && mf_plan_graph(p)->n == 8, "prefill plan: the serial graph of 8 items");
    mf_plan_free(p);

    f = costly_profile();
    CHECK(!mf_plan_prefill(&o, 16, 8, &r, &t1) && !mf_plan_prefill(&o, 16, 8, NULL, &t2), "%s", mf_last_error());
    CHECK(t1 == t2 && t1 > 0, "repeat: %lld vs %lld ns", (long long)t1, (long long)t2);
    CHECK(!mf_plan_prefill(&o, 8, 8, NULL, &t3), "%s", mf_last_error());
    CHECK(t1 > 2 * t3, "16 tokens %lld ns, not more than twice 8 tokens' %lld ns", (long long)t1, (long long)t3);
    CHECK(!mf_plan_prefill(&o, 19, 8, NULL, &t4), "%s", mf_last_error());
    CHECK(t4 > t1 && t4 - t1 < t1 / 2, "19 tokens %lld ns against 16 tokens %lld ns", (long long)t4, (long long)t1);
    CHECK(!mf_plan_prefill(&o, 70, 0, NULL, &t1) && !mf_plan_prefill(&o, 70, MF_STEP_PREFILL_CHUNK, NULL, &t2) &&
              t1 == t2, "default chunk: %lld vs %lld ns", (long long)t1, (long long)t2);
    CHECK(mf_plan_prefill(&o, 16, MF_STEP_MAX_CHUNK + 1, NULL, &t1) == -EINVAL, "chunk over the graph's items");
    /* a long chunk (item groups): its serial graph, no more tasks than at 128 items (but the Engram
     * wkv's blocks), and fewer
     * expert slots over the prompt than at 64 (each expert at most once per layer of a chunk; the
     * reports' slot counts are sums over their chunks) */
    CHECK(!mf_plan_new(&(mf_plan_opts){.config = &c, .profile = &f, .prefill = 1, .batch = 300}, &p), "%s",
          mf_last_error());
    mf_plan *p128 = NULL;
    CHECK(!mf_plan_new(&(mf_plan_opts){.config = &c, .profile = &f, .prefill = 1, .batch = 128}, &p128), "%s",
          mf_last_error());
    CHECK(p && p128 && mf_plan_graph(p)->n == 300 && mf_plan_graph(p)->n_groups == MF_SG_MAX_GROUPS &&
              mf_test_fixed_tasks(mf_plan_graph(p)) <= mf_test_fixed_tasks(mf_plan_graph(p128)),
          "a 300-position chunk: %d groups, %d tasks (128: %d)", p ? mf_plan_graph(p)->n_groups : -1,
          p ? mf_plan_graph(p)->n_tasks : -1, p128 ? mf_plan_graph(p128)->n_tasks : -1);
    for (int k = 0; k < 2; k++)   /* the parts that are not per group: as many as the builder says */
        if (p && p128) check_long_parts(&c, mf_plan_graph(k ? p : p128));
    mf_plan_free(p);
    mf_plan_free(p128);
    check_gather_parts(&c);
    check_gate_sockets(&c);
    mf_plan_report r64, r600;
    CHECK(!mf_plan_prefill(&o, 600, 64, &r64, &t1) && !mf_plan_prefill(&o, 600, 600, &r600, &t2), "%s",
          mf_last_error());
    CHECK(r600.host_slots <= (int64_t)c.n_layers * c.n_routed_experts && 4 * r600.host_slots < r64.host_slots,
          "600 positions: %lld slots in one chunk, %lld in the 9 chunks of 64", (long long)r600.host_slots,
          (long long)r64.host_slots);
    CHECK(mf_plan_prefill(&o, 0, 8, NULL, &t1) == -EINVAL, "an empty prompt");
    {   /* a prefix cache's hit (mf_plan_prefill_at): none cached is the prefill; 8 cached leave the chunk
         * from position 8; a prompt cached whole is refused (a token is left to run) */
        int64_t ta = 0, tb = 0;
        CHECK(!mf_plan_prefill_at(&o, 0, 16, 8, NULL, &ta, NULL) && !mf_plan_prefill(&o, 16, 8, NULL, &tb) && ta == tb,
              "0 cached: %lld against %lld ns", (long long)ta, (long long)tb);
        CHECK(!mf_plan_prefill_at(&o, 8, 16, 8, NULL, &ta, NULL) && ta > 0 && ta < tb,
              "8 of 16 cached: %lld ns against %lld", (long long)ta, (long long)tb);
        CHECK(mf_plan_prefill_at(&o, 16, 16, 8, NULL, &ta, NULL) == -EINVAL, "16 of 16 cached refused");
    }
    /* per op: the tasks that ran and their work add up to the lanes' (per-chunk means, so up to
     * one ns of rounding per op and lane) */
    int64_t lane_sum = 0, op_sum = 0;
    int op_tasks = 0;
    for (int l = 0; l < r64.n_lanes; l++) lane_sum += r64.lanes[l].busy_ns;
    for (int op = 0; op < MF_SG_N_OPS; op++) op_sum += r64.op_cpu_ns[op] + r64.op_other_ns[op], op_tasks += r64.op_tasks[op];
    CHECK(op_sum > 0 && llabs(op_sum - lane_sum) <= MF_SG_N_OPS + r64.n_lanes && op_tasks > 0 && op_tasks <= r64.n_tasks,
          "per-op work %lld ns against the lanes' %lld ns, %d of %d tasks", (long long)op_sum, (long long)lane_sum,
          op_tasks, r64.n_tasks);
    CHECK(r64.op_tasks[MF_SG_ATTN_MIX] > 0 && r64.op_cpu_ns[MF_SG_ATTN_MIX] > 0 && !r64.op_other_ns[MF_SG_ATTN_MIX] &&
              !strcmp(mf_sg_op_name(MF_SG_ATTN_MIX), "attn_mix") && !strcmp(mf_sg_op_name(MF_SG_N_OPS), "?"),
          "the mixes run on the CPU lanes");
    /* the trace of a prefill: the last full chunk's */
    char tpath[] = "/tmp/test_plan_trace_XXXXXX";
    int tfd = mkstemp(tpath);
    CHECK(tfd >= 0, "mkstemp");
    if (tfd >= 0) close(tfd);
    CHECK(!mf_plan_prefill_trace(&o, 19, 8, NULL, &t2, tpath) && t2 == t4, "%s", mf_last_error());
    FILE *tf = fopen(tpath, "r");
    char head[64] = "";
    size_t tn = tf ? fread(head, 1, sizeof head - 1, tf) : 0;
    if (tf) fclose(tf);
    head[tn] = 0;
    CHECK(strstr(head, "traceEvents") != NULL, "prefill trace: '%s'", head);
    unlink(tpath);

    /* the command: `moeflow sim --prompt-tokens N --chunk T --json` prints what mf_plan_prefill
     * predicts with the same profile (uniform routing, seed 1: the command's defaults) */
    const char *bin = getenv("MOEFLOW_BIN");
    if (!bin) {
        printf("test_plan: MOEFLOW_BIN unset, sim --prompt-tokens not checked\n");
        return;
    }
    char prof_path[1024], cmd[2048], out[65536] = "";
    snprintf(prof_path, sizeof prof_path, "%s/tools/profiles/seed-host.prof", MF_SOURCE_DIR);
    mf_profile sp;
    CHECK(mf_profile_load(prof_path, &sp) == 0, "%s", mf_last_error());
    mf_routing *rt = NULL;
    CHECK(mf_routing_open("uniform", c.n_layers, c.n_routed_experts, c.n_experts_per_tok, 1, &rt) == 0, "%s",
          mf_last_error());
    mf_plan_opts so = {.config = &c, .profile = &sp, .routing = rt, .seed = 1};
    CHECK(mf_plan_prefill(&so, 20, 8, NULL, &t1) == 0, "%s", mf_last_error());
    mf_routing_free(rt);
    snprintf(cmd, sizeof cmd, "'%s' sim --profile %s --preset tiny --prompt-tokens 20 --chunk 8 --json 2>&1", bin,
             prof_path);
    FILE *pf = popen(cmd, "r");
    size_t n = pf ? fread(out, 1, sizeof out - 1, pf) : 0;
    out[n] = 0;
    int st = pf ? pclose(pf) : -1;
    const char *q = strstr(out, "\"ttft_s\":");
    double ttft = q ? strtod(q + 9, NULL) : -1;
    CHECK(st == 0 && strstr(out, "\"chunk\":8") && fabs(ttft - t1 / 1e9) <= 1e-8 * (t1 / 1e9) + 1e-9,
          "sim --prompt-tokens: '%s' (the library: %.9g s)", out, t1 / 1e9);
    {   /* --cached M: the chunks from position M */
        rt = NULL;
        CHECK(mf_routing_open("uniform", c.n_layers, c.n_routed_experts, c.n_experts_per_tok, 1, &rt) == 0, "%s",
              mf_last_error());
        so.routing = rt;
        CHECK(mf_plan_prefill_at(&so, 12, 20, 8, NULL, &t1, NULL) == 0, "%s", mf_last_error());
        mf_routing_free(rt);
        snprintf(cmd, sizeof cmd, "'%s' sim --profile %s --preset tiny --prompt-tokens 20 --cached 12 --chunk 8 --json 2>&1",
                 bin, prof_path);
        pf = popen(cmd, "r");
        n = pf ? fread(out, 1, sizeof out - 1, pf) : 0;
        out[n] = 0;
        st = pf ? pclose(pf) : -1;
        q = strstr(out, "\"ttft_s\":");
        ttft = q ? strtod(q + 9, NULL) : -1;
        CHECK(st == 0 && strstr(out, "\"cached\":12") && fabs(ttft - t1 / 1e9) <= 1e-8 * (t1 / 1e9) + 1e-9,
              "sim --cached: '%s' (the library: %.9g s)", out, t1 / 1e9);
    }
    snprintf(cmd, sizeof cmd, "'%s' sim --profile %s --preset tiny --prompt-tokens 20 --measure >/dev/null 2>&1", bin,
             prof_path);
    st = system(cmd);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 2, "sim --prompt-tokens --measure: exit %d, expected 2", st);
}

/* The mixes' records of a long chunk's item groups (graphs/step/stepgraph_attn.c sg_mix, priced as
 * mf_fa_hc_mixes_rows_items runs): a group of 8 positions (1024 / 128 groups, demo: 24 rows of
 * 4 x 1024 streams) reads its part's rows once (the blocked kernel's block, mf_fa_mix_items: 40
 * items at 24 rows) and each item's streams a second time; a group of 4 (512 positions) reads the
 * rows once and the streams not again (the fours); a group of one item likewise. */
static void test_mix_records(void)
{
    mf_config c;
    CHECK(!mf_config_preset("demo", &c), "preset demo");
    CHECK(mf_fa_mix_items(&c, 24, 8) == 40 && mf_fa_mix_items(&c, 24, 4) == 4 && mf_fa_mix_items(&c, 65, 8) == 1 &&
              mf_fa_mix_items(&c, 6, 64) == 64,
          "demo's items per read of the rows: %d %d %d %d", mf_fa_mix_items(&c, 24, 8), mf_fa_mix_items(&c, 24, 4),
          mf_fa_mix_items(&c, 65, 8), mf_fa_mix_items(&c, 6, 64));
    mf_config fl;
    CHECK(!mf_config_preset("flash41", &fl) && mf_fa_mix_items(&fl, 24, 64) == MF_FA_MIX_ITEMS,
          "flash41: a group of 64 items reads a mix's 24 rows %d times", 64 / mf_fa_mix_items(&fl, 24, 64));
    mf_profile f = costly_profile();
    double streams = 4.0 * c.hc_mult * c.hidden_size;
    static const int chunk[] = {1024, 512, 1};
    for (int k = 0; k < 3; k++) {
        mf_plan *p = NULL;
        CHECK(!mf_plan_new(&(mf_plan_opts){.config = &c, .profile = &f, .prefill = 1, .batch = chunk[k]}, &p), "%s",
              mf_last_error());
        const mf_stepgraph *sg = p ? mf_plan_graph(p) : NULL;
        int n = 0, bad = 0, group = chunk[k] / (chunk[k] < MF_SG_MAX_GROUPS ? chunk[k] : MF_SG_MAX_GROUPS);
        for (int t = 0; sg && t < sg->n_tasks; t++) {
            const mf_sg_task *r = &sg->task[t];
            if (r->op != MF_SG_ATTN_MIX && r->op != MF_SG_FFN_MIX) continue;
            double rows = (double)(r->r1 - r->r0) * streams, want = rows + (group > 4 ? group * streams : 0);
            n++;
            if ((r->n_tok != group || r->w.vec_bytes != want) && bad++ < 3)
                CHECK(0, "chunk %d: mix task %d of %d items reads %.0f bytes, expected %.0f", chunk[k], t, r->n_tok,
                      r->w.vec_bytes, want);
        }
        CHECK(n > 0 && !bad, "chunk %d: %d mix records, %d wrong", chunk[k], n, bad);
        mf_plan_free(p);
    }
}

/* The draft's experts on the cards (mf_plan_opts.draft_cards; docs/dspark.md): a draft round's MoE
 * takes card slots, every one a hit (each card holds its owned share resident), none without;
 * a step's backbone cache has exactly that share fewer slots (of a budget's and of the engine's own
 * sizing: one cache a card over both); mf_spec_sim prices k 0 with the cache whole (the plain plan's makespan exactly)
 * and k > 0 with the draft's experts on the cards. */
static void test_draft_cards(void)
{
    mf_config c;
    CHECK(!mf_config_preset("demo", &c), "preset demo");
    mf_profile f = costly_profile();
    int E_d = mf_config_layer_experts(&c, c.n_layers), own = mf_dev_xcache_owned(4, 0, c.n_layers, c.n_mtp_layers, E_d);
    CHECK(own == (c.n_mtp_layers * E_d + 3) / 4, "card 0 owns %d of the draft's %d experts", own, c.n_mtp_layers * E_d);
    mf_plan_report r[2];
    for (int dc = 0; dc < 2; dc++) {   /* a draft round of 2 sequences, 5 candidates */
        CHECK(!mf_plan_run(&(mf_plan_opts){.config = &c, .profile = &f, .placement = MF_STEP_PLACE_HYBRID,
                                           .dense = MF_PLAN_DENSE_CARDS, .batch = 2, .draft = 5, .draft_cards = dc},
                           1, 2, &r[dc]), "draft round, draft_cards %d: %s", dc, mf_last_error());
    }
    CHECK(r[0].dev_slots == 0 && r[1].dev_slots > 0 && r[1].dev_misses == 0 && r[1].card_slots == own,
          "draft round: %lld card slots on the host's draft, %lld (%lld misses) on the cards' in %d slots of card 0",
          (long long)r[0].dev_slots, (long long)r[1].dev_slots, (long long)r[1].dev_misses, r[1].card_slots);
    mf_plan_opts vo = {.config = &c, .profile = &f, .placement = MF_STEP_PLACE_HYBRID, .batch = 2, .unit_len = 3,
                       .feats = 1};
    CHECK(!mf_plan_run(&vo, 1, 2, &r[0]) && r[0].card_slots == c.n_layers * c.n_routed_experts, "verify: %s",
          mf_last_error());
    double xslot = r[0].card_cache / r[0].card_slots;
    mf_profile small = f;   /* a card whose cache holds about 300 experts beside its buffers */
    small.card_mem_bytes = (uint64_t)(r[0].card_bufs + r[0].card_weights + 301 * xslot);
    for (int budget = 0; budget < 2; budget++) {   /* a step: the backbone's cache less the draft's share */
        vo.profile = budget ? &f : &small;
        vo.dev_cache_bytes = budget ? (uint64_t)(200 * xslot) : 0;
        for (int dc = 0; dc < 2; dc++) {
            vo.draft_cards = dc;
            CHECK(!mf_plan_run(&vo, 1, 2, &r[dc]), "verify, draft_cards %d: %s", dc, mf_last_error());
        }
        CHECK(r[1].card_slots == r[0].card_slots - own &&
                  (budget ? r[0].card_slots == 200 : r[0].card_slots < c.n_layers * c.n_routed_experts),
              "budget %d: the backbone's cache %d slots, %d with the draft's experts on the cards", budget,
              r[0].card_slots, r[1].card_slots);
    }
    mf_plan_opts po = {.config = &c, .profile = &f, .placement = MF_STEP_PLACE_HYBRID, .batch = 1,
                       .dev_cache_bytes = (uint64_t)(200 * xslot)};
    double v[MF_SPEC_MAX + 1], d[MF_SPEC_MAX + 1];
    int n_k = 0;
    CHECK(!mf_spec_sim(&po, 2, 1, 2, v, d, &n_k) && n_k == 2, "mf_spec_sim: %s", mf_last_error());
    for (int k = 0; k <= 2; k++) {
        mf_plan_opts o = po;
        o.unit_len = 1 + k, o.feats = 1, o.draft_cards = k > 0;
        CHECK(!mf_plan_run(&o, 1, 2, &r[0]) && (double)r[0].step_ns == v[k],
              "k %d: mf_spec_sim %.0f ns, the plan with draft_cards %d %lld ns", k, v[k], k > 0, (long long)r[0].step_ns);
    }
}

int main(void)
{
    const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    test_structure(tmp);
    test_same_graph();
    test_determinism_and_caches();
    test_decode_cyclic_cache();
    test_hybrid_models();
    test_flash41();
    test_card_memory();
    test_refusals();
    test_core_pool();
    test_prefill();
    test_prefetch_plan();
    test_placer_tokens();
    test_placer_queue();
    test_mix_records();
    test_draft_cards();
    return mf_check_exit("test_plan");
}
