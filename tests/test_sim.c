/* The virtual-time simulator and the timeline's summary and Chrome export: makespans of small
 * graphs worked out by hand (chain, fork-join, concurrency limits, rank order), bit-identical
 * repeat runs, summary values on hand-built timelines, and an exported trace read back. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include <math.h>
#include <unistd.h>

#include "sched/calibrate.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "sched/graph.h"
#include "sched/sched.h"
#include "sched/sim.h"
#include "sched/timeline.h"
#include "tests/check.h"

#define MS 1000000LL

/* Lanes whose models make 1e6 flops (cpu lanes) or 1e6 bytes (io lane) take exactly 1 ms. */
static mf_lane_desc lane(mf_lane_kind kind, const char *name, int conc)
{
    mf_lane_desc d = {.kind = kind, .name = name, .concurrency = conc, .numa_node = -1};
    if (kind == MF_LANE_IO)
        d.model.bytes_per_s = 1e9;
    else
        d.model.flops_per_s = 1e9;
    return d;
}

static int dummy_fn(void *arg, mf_task_ctx *ctx)
{
    return 0;
}

static mf_io_read dummy_read;

/* Adds a task of `ms` milliseconds on lane l. */
static mf_task_id add(mf_graph *g, const char *name, int l, double ms)
{
    mf_task_desc d = {.name = name, .lane = l, .place_hint = -1};
    if (mf_graph_lane(g, l)->kind == MF_LANE_IO) {
        d.arg = &dummy_read;
        d.cost.bytes = ms * 1e6;
    } else {
        d.fn = dummy_fn;
        d.cost.flops = ms * 1e6;
    }
    mf_task_id t = mf_graph_add_task(g, &d);
    CHECK(t >= 0, "add_task %s: %s", name, mf_last_error());
    return t;
}

static void dep(mf_graph *g, mf_task_id a, mf_task_id b)
{
    int rc = mf_graph_add_dep(g, a, b);
    CHECK(rc == 0, "add_dep: %s", mf_last_error());
}

/* Finalizes, simulates, returns the makespan; the timeline is left in *tl_out when asked. */
static int64_t simulate(mf_graph *g, mf_timeline **tl_out)
{
    int rc = mf_graph_finalize(g);
    CHECK(rc == 0, "finalize: %s", mf_last_error());
    mf_timeline *tl = NULL;
    rc = mf_timeline_create(g, &tl);
    CHECK(rc == 0, "timeline: %s", mf_last_error());
    rc = mf_sim_run(g, NULL, tl);
    CHECK(rc == 0, "sim: %s", mf_last_error());
    mf_timeline_summary s;
    rc = mf_timeline_summarize(tl, &s);
    CHECK(rc == 0, "summarize: %s", mf_last_error());
    if (tl_out)
        *tl_out = tl;
    else
        mf_timeline_destroy(tl);
    return s.makespan_ns;
}

static void test_chain(void)
{
    mf_lane_desc l[1] = {lane(MF_LANE_CPU, "cpu", 4)};
    mf_graph *g;
    mf_graph_create(l, 1, &g);
    mf_task_id a = add(g, "a", 0, 1), b = add(g, "b", 0, 2), c = add(g, "c", 0, 3);
    dep(g, a, b);
    dep(g, b, c);
    mf_timeline *tl;
    int64_t m = simulate(g, &tl);
    CHECK(m == 6 * MS, "chain makespan %lld, want 6 ms", (long long)m);
    mf_task_span *sp = mf_timeline_spans(tl);
    CHECK(sp[b].start_ns == 1 * MS && sp[c].start_ns == 3 * MS && sp[c].status == 0,
          "chain spans b %lld c %lld", (long long)sp[b].start_ns, (long long)sp[c].start_ns);
    mf_timeline_destroy(tl);
    mf_graph_destroy(g);
}

/* root -> 4 x 2 ms -> join: 1 + 2 + 2 + 1 = 6 ms on 2 slots, 1 + 2 + 1 = 4 ms on 4 slots. */
static void test_fork_join(int conc, int64_t want)
{
    mf_lane_desc l[1] = {lane(MF_LANE_CPU, "cpu", conc)};
    mf_graph *g;
    mf_graph_create(l, 1, &g);
    mf_task_id r = add(g, "root", 0, 1), j = add(g, "join", 0, 1);
    for (int i = 0; i < 4; i++) {
        mf_task_id m = add(g, "mid", 0, 2);
        dep(g, r, m);
        dep(g, m, j);
    }
    int64_t m = simulate(g, NULL);
    CHECK(m == want, "fork-join on %d slots: %lld, want %lld", conc, (long long)m, (long long)want);
    mf_graph_destroy(g);
}

/* 5 independent 1 ms tasks on 2 slots: 3 ms; slots handed out lowest first: 0 1 0 1 0. */
static void test_concurrency_limit(void)
{
    mf_lane_desc l[1] = {lane(MF_LANE_CPU, "cpu", 2)};
    mf_graph *g;
    mf_graph_create(l, 1, &g);
    for (int i = 0; i < 5; i++)
        add(g, "t", 0, 1);
    mf_timeline *tl;
    int64_t m = simulate(g, &tl);
    CHECK(m == 3 * MS, "5 tasks on 2 slots: %lld, want 3 ms", (long long)m);
    mf_task_span *sp = mf_timeline_spans(tl);
    for (int i = 0; i < 5; i++)
        CHECK(sp[i].worker == i % 2 && sp[i].start_ns == (i / 2) * MS, "task %d: slot %d start %lld",
              i, sp[i].worker, (long long)sp[i].start_ns);
    mf_timeline_destroy(tl);
    mf_graph_destroy(g);
}

/* Pipeline: 3 reads of 1 ms (io, 1 slot) each feeding a 2 ms compute (cpu, 1 slot): the reads
 * hide behind compute, so 1 + 3 * 2 = 7 ms. */
static void test_pipeline(void)
{
    mf_lane_desc l[2] = {lane(MF_LANE_CPU, "cpu", 1), lane(MF_LANE_IO, "io", 1)};
    mf_graph *g;
    mf_graph_create(l, 2, &g);
    mf_task_id prev = -1;
    for (int i = 0; i < 3; i++) {
        mf_task_id r = add(g, "read", 1, 1), c = add(g, "compute", 0, 2);
        dep(g, r, c);
        if (prev >= 0)
            dep(g, prev, c);
        prev = c;
    }
    int64_t m = simulate(g, NULL);
    CHECK(m == 7 * MS, "pipeline: %lld, want 7 ms", (long long)m);
    mf_graph_destroy(g);
}

/* Rank order: on a 1-slot lane, a 3 ms lone task S (id 0) and a 1 ms head H whose successor T
 * takes 5 ms on another lane. H has the higher rank (6 ms vs 3) and must go first: 6 ms. Taking
 * S first (as id order would) gives 9 ms. */
static void test_priority(void)
{
    mf_lane_desc l[2] = {lane(MF_LANE_CPU, "x", 1), lane(MF_LANE_CPU, "y", 1)};
    mf_graph *g;
    mf_graph_create(l, 2, &g);
    mf_task_id s = add(g, "S", 0, 3), h = add(g, "H", 0, 1), t = add(g, "T", 1, 5);
    dep(g, h, t);
    mf_timeline *tl;
    int64_t m = simulate(g, &tl);
    CHECK(m == 6 * MS, "priority: %lld, want 6 ms", (long long)m);
    mf_task_span *sp = mf_timeline_spans(tl);
    CHECK(sp[h].start_ns == 0 && sp[s].start_ns == 1 * MS, "H at %lld, S at %lld",
          (long long)sp[h].start_ns, (long long)sp[s].start_ns);
    mf_timeline_destroy(tl);

    /* Equal ranks: the lower id first. */
    mf_graph_destroy(g);
    mf_graph_create(l, 1, &g);
    mf_task_id a = add(g, "a", 0, 2), b = add(g, "b", 0, 2);
    simulate(g, &tl);
    sp = mf_timeline_spans(tl);
    CHECK(sp[a].start_ns == 0 && sp[b].start_ns == 2 * MS, "tie order a %lld b %lld",
          (long long)sp[a].start_ns, (long long)sp[b].start_ns);
    mf_timeline_destroy(tl);
    mf_graph_destroy(g);
}

/* Model terms add up; the `models` argument overrides the graph's lane models. */
static void test_models(void)
{
    mf_lane_desc l[1] = {{.kind = MF_LANE_CPU, .name = "cpu", .concurrency = 1, .numa_node = -1,
                          .model = {.bytes_per_s = 2e9, .flops_per_s = 4e9, .latency_ns = 500}}};
    mf_graph *g;
    mf_graph_create(l, 1, &g);
    mf_task_desc d = {.name = "t", .lane = 0, .fn = dummy_fn, .place_hint = -1,
                      .cost = {.bytes = 2e6, .flops = 8e6, .time_ns = 250}};
    mf_graph_add_task(g, &d);
    mf_graph_add_task(g, &d);
    /* 500 + 1e6 + 2e6 + 250 ns per task, two in a row. */
    mf_timeline *tl;
    int64_t m = simulate(g, &tl);
    CHECK(m == 2 * 3000750LL, "model sum: %lld, want %lld", (long long)m, 2 * 3000750LL);
    mf_lane_model over = {.flops_per_s = 8e9};   /* bytes and latency now free */
    int rc = mf_sim_run(g, &over, tl);
    CHECK(rc == 0, "sim with models: %s", mf_last_error());
    CHECK(mf_timeline_spans(tl)[1].end_ns == 2 * 1000250LL, "override: %lld",
          (long long)mf_timeline_spans(tl)[1].end_ns);
    mf_timeline_destroy(tl);
    mf_graph_destroy(g);
}

/* A random layered multi-lane graph of n tasks (fixed seed). */
static mf_graph *random_graph(int n, unsigned seed, int finalize)
{
    mf_lane_desc l[4] = {lane(MF_LANE_CPU, "cpu0", 2), lane(MF_LANE_CPU, "cpu1", 3),
                         lane(MF_LANE_IO, "io", 8), lane(MF_LANE_DEV_COMPUTE, "dev", 1)};
    l[0].model.latency_ns = 1500;
    l[2].model.latency_ns = 20000;
    mf_graph *g;
    if (mf_graph_create(l, 4, &g))
        return NULL;
    for (int i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        char name[32];
        snprintf(name, sizeof name, "t%d", i);
        add(g, name, (int)(seed >> 16) % 4, 0.001 + (double)((seed >> 8) % 1000) / 7000.0);
        for (int k = 0; k < 3 && i > 0; k++) {
            seed = seed * 1103515245u + 12345u;
            if ((seed >> 12) % 3)
                dep(g, (mf_task_id)((seed >> 4) % (unsigned)i), i);
        }
    }
    if (finalize && mf_graph_finalize(g)) {
        mf_graph_destroy(g);
        return NULL;
    }
    return g;
}

static void test_determinism_and_speed(void)
{
    mf_graph *g = random_graph(5000, 7, 1);
    CHECK(g != NULL, "random graph: %s", mf_last_error());
    if (!g)
        return;
    mf_timeline *a, *b;
    mf_timeline_create(g, &a);
    mf_timeline_create(g, &b);
    mf_sim_run(g, NULL, a);
    mf_sim_run(g, NULL, b);
    int n = mf_graph_n_tasks(g);
    CHECK(!memcmp(mf_timeline_spans(a), mf_timeline_spans(b), (size_t)n * sizeof(mf_task_span)),
          "two simulations of one graph differ");
    /* Every dependency respected, every task ran, no slot double-booked within a lane. */
    mf_task_span *sp = mf_timeline_spans(a);
    int bad = 0;
    for (mf_task_id t = 0; t < n; t++) {
        bad += sp[t].status != 0;
        for (int i = 0; i < mf_graph_n_pred(g, t); i++)
            bad += sp[mf_graph_pred(g, t)[i]].end_ns > sp[t].start_ns;
        int c = mf_graph_lane(g, mf_graph_task(g, t)->lane)->concurrency;
        bad += sp[t].worker < 0 || sp[t].worker >= c;
    }
    CHECK(bad == 0, "%d violated constraints in the simulated timeline", bad);
    mf_timeline_destroy(a);
    mf_timeline_destroy(b);
    mf_graph_destroy(g);

    g = random_graph(100000, 11, 0);
    CHECK(g != NULL, "random graph: %s", mf_last_error());
    if (!g)
        return;
    int rc = mf_graph_finalize(g);
    CHECK(rc == 0, "finalize: %s", mf_last_error());
    mf_timeline_create(g, &a);
    int64_t t0 = mf_now_ns();
    rc = mf_sim_run(g, NULL, a);
    double sim_s = (double)(mf_now_ns() - t0) * 1e-9;
    CHECK(rc == 0, "sim 100k: %s", mf_last_error());
    printf("simulated 100000 tasks in %.3f s\n", sim_s);
    /* Well under a second in a normal build; the bound leaves room for sanitizer builds. */
    CHECK(sim_s < 3.0, "simulating 100k tasks took %.3f s", sim_s);
    mf_timeline_summary s;
    t0 = mf_now_ns();
    rc = mf_timeline_summarize(a, &s);
    printf("summarized 100000 tasks in %.3f s\n", (double)(mf_now_ns() - t0) * 1e-9);
    CHECK(rc == 0 && s.critical_path_ns <= s.makespan_ns && s.overlap_ratio >= 1.0,
          "100k summary: cp %lld makespan %lld ratio %f", (long long)s.critical_path_ns,
          (long long)s.makespan_ns, s.overlap_ratio);
    char path[4096];
    const char *tmp = getenv("MOEFLOW_TMP");
    snprintf(path, sizeof path, "%s/sim_100k.json", tmp ? tmp : "/tmp");
    t0 = mf_now_ns();
    rc = mf_timeline_write_chrome(a, path);
    printf("wrote the 100k-task trace (no flows) in %.3f s\n", (double)(mf_now_ns() - t0) * 1e-9);
    CHECK(rc == 0, "chrome 100k: %s", mf_last_error());
    remove(path);
    mf_timeline_destroy(a);
    mf_graph_destroy(g);
}

/* Summary on a hand-built timeline:
 *   lane 0: a [0,10) b [5,15) c [20,30)  -> busy 25     lane 1: d [30,40)  -> busy 10
 *   a cancelled task x on lane 1 with a bogus span must be ignored.
 *   deps a->c, b->c, c->d, x->d. makespan 40, busiest lane 0, ratio 40/25 = 1.6,
 *   critical path from d: c (only pred that ran), then b (ends 15 > 10): b c d, 30 ns. */
static void test_summary(void)
{
    mf_lane_desc l[2] = {lane(MF_LANE_CPU, "l0", 2), lane(MF_LANE_CPU, "l1", 1)};
    mf_graph *g;
    mf_graph_create(l, 2, &g);
    mf_task_id a = add(g, "a", 0, 1), b = add(g, "b", 0, 1), c = add(g, "c", 0, 1);
    mf_task_id d = add(g, "d", 1, 1), x = add(g, "x", 1, 1);
    dep(g, a, c);
    dep(g, b, c);
    dep(g, c, d);
    dep(g, x, d);
    mf_graph_finalize(g);
    mf_timeline *tl;
    mf_timeline_create(g, &tl);
    mf_task_span *sp = mf_timeline_spans(tl);
    sp[a] = (mf_task_span){0, 10, 0, 0};
    sp[b] = (mf_task_span){5, 15, 1, 0};
    sp[c] = (mf_task_span){20, 30, 0, 0};
    sp[d] = (mf_task_span){30, 40, 0, 0};
    sp[x] = (mf_task_span){0, 1000, -1, 1};
    mf_timeline_summary s;
    int rc = mf_timeline_summarize(tl, &s);
    CHECK(rc == 0, "summarize: %s", mf_last_error());
    CHECK(s.makespan_ns == 40, "makespan %lld", (long long)s.makespan_ns);
    CHECK(s.lane_busy_ns[0] == 25 && s.lane_busy_ns[1] == 10, "busy %lld %lld",
          (long long)s.lane_busy_ns[0], (long long)s.lane_busy_ns[1]);
    CHECK(s.busiest_lane == 0 && s.overlap_ratio == 1.6, "busiest %d ratio %f", s.busiest_lane,
          s.overlap_ratio);
    CHECK(s.n_critical == 3 && s.critical_path_ns == 30, "critical %d tasks, %lld ns",
          s.n_critical, (long long)s.critical_path_ns);
    if (s.n_critical == 3)
        CHECK(s.critical[0] == b && s.critical[1] == c && s.critical[2] == d,
              "critical path %d %d %d", s.critical[0], s.critical[1], s.critical[2]);
    char buf[4096] = {0};
    FILE *f = fmemopen(buf, sizeof buf - 1, "w");
    mf_timeline_print_summary(tl, &s, f);
    fclose(f);
    CHECK(strstr(buf, "l0") && strstr(buf, "busiest") && strstr(buf, "1.600") &&
          strstr(buf, "b, c, d"), "printed summary:\n%s", buf);
    mf_timeline_destroy(tl);
    mf_graph_destroy(g);
}

/* Exports a simulated random graph and reads it back: one X event per task on its lane's track,
 * a name for every track, a matching s/f pair per dependency. */
static void test_chrome(void)
{
    mf_graph *g = random_graph(300, 3, 1);
    CHECK(g != NULL, "random graph");
    if (!g)
        return;
    mf_timeline *tl;
    mf_timeline_create(g, &tl);
    mf_sim_run(g, NULL, tl);
    char path[4096];
    const char *tmp = getenv("MOEFLOW_TMP");
    snprintf(path, sizeof path, "%s/sim_chrome.json", tmp ? tmp : "/tmp");
    int rc = mf_timeline_write_chrome(tl, path);
    CHECK(rc == 0, "write_chrome: %s", mf_last_error());
    json_error_t err;
    json_t *root = json_load_file(path, 0, &err);
    CHECK(root != NULL, "%s: %s (line %d)", path, err.text, err.line);
    if (root) {
        json_t *evs = json_object_get(root, "traceEvents");
        int n_x = 0, n_s = 0, n_f = 0, n_names = 0, bad = 0;
        int n = mf_graph_n_tasks(g), n_edges = 0;
        for (mf_task_id t = 0; t < n; t++)
            n_edges += mf_graph_n_succ(g, t);
        size_t i;
        json_t *ev;
        json_array_foreach(evs, i, ev) {
            const char *ph = json_string_value(json_object_get(ev, "ph"));
            if (!ph) {
                bad++;
                continue;
            }
            if (!strcmp(ph, "X")) {
                n_x++;
                int t = (int)json_integer_value(json_object_get(json_object_get(ev, "args"), "task"));
                const mf_task_span *sp = &mf_timeline_spans(tl)[t];
                double ts = json_real_value(json_object_get(ev, "ts"));
                bad += t < 0 || t >= n || ts * 1000.0 < (double)sp->start_ns - 0.5 ||
                       ts * 1000.0 > (double)sp->start_ns + 0.5 ||
                       strcmp(json_string_value(json_object_get(ev, "name")),
                              mf_graph_task(g, t)->name);
            }
            n_s += !strcmp(ph, "s");
            n_f += !strcmp(ph, "f");
            n_names += !strcmp(ph, "M") &&
                       !strcmp(json_string_value(json_object_get(ev, "name")), "thread_name");
        }
        CHECK(bad == 0, "%d malformed or misplaced events", bad);
        CHECK(n_x == n, "%d X events for %d tasks", n_x, n);
        CHECK(n_s == n_edges && n_f == n_edges, "%d s, %d f events for %d edges", n_s, n_f, n_edges);
        CHECK(n_names == 2 + 3 + 8 + 1, "%d named tracks, want 14 (one per slot)", n_names);
        json_decref(root);
    }
    /* missing folders are made (mkdir -p); a folder that is a file is refused, naming the path */
    char deep[4200];
    snprintf(deep, sizeof deep, "%s.d/a/b/x.json", path);
    rc = mf_timeline_write_chrome(tl, deep);
    CHECK(rc == 0, "trace into missing folders: %d %s", rc, mf_last_error());
    remove(deep);
    snprintf(deep, sizeof deep, "%s/x.json", path);
    rc = mf_timeline_write_chrome(tl, deep);
    CHECK(rc == -ENOTDIR && strstr(mf_last_error(), deep), "bad path: %d %s", rc, mf_last_error());
    remove(path);
    mf_timeline_destroy(tl);
    mf_graph_destroy(g);
}

static void test_errors(void)
{
    mf_graph *g = random_graph(10, 1, 0), *h = random_graph(12, 1, 1);
    mf_timeline *tl;
    mf_timeline_create(g, &tl);
    int rc = mf_sim_run(g, NULL, tl);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), "finalized"), "unfinalized: %d %s", rc,
          mf_last_error());
    rc = mf_sim_run(h, NULL, tl);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), "another graph"), "wrong timeline: %d %s", rc,
          mf_last_error());
    mf_timeline_destroy(tl);
    mf_graph_destroy(g);
    mf_graph_destroy(h);
}

/* Calibration runs through the real executor and yields usable models (its accuracy is
 * test_sim_accuracy's business); wrong lanes are refused. Also exercised under sanitizers here. */
static void test_calibrate(void)
{
    mf_lane_desc l[2] = {lane(MF_LANE_CPU, "cpu", 2), lane(MF_LANE_IO, "io", 1)};
    mf_sched_opts o = {.lanes = l, .n_lanes = 2};
    mf_sched *s;
    int rc = mf_sched_create(&o, &s);
    CHECK(rc == 0, "sched: %s", mf_last_error());
    if (rc)
        return;
    const char *tmp = getenv("MOEFLOW_TMP");
    int fd = -1;
    rc = mf_calib_file_create(tmp ? tmp : "/tmp", 16u << 20, &fd);
    CHECK(rc == 0, "calibration file: %s", mf_last_error());
    mf_calib_fit cpu, io;
    rc = mf_calibrate_cpu(s, l, 2, 0, &cpu);
    CHECK(rc == 0, "calibrate cpu: %s", mf_last_error());
    CHECK(rc || (cpu.all.flops_per_s > 1e6 && isfinite(cpu.all.flops_per_s) &&
                 cpu.one.flops_per_s > 1e6 && cpu.all.latency_ns >= 0 && cpu.concurrency == 2 &&
                 cpu.all.bytes_per_s == 0), "cpu fit %g flop/s + %g ns", cpu.all.flops_per_s,
          cpu.all.latency_ns);
    if (fd >= 0) {
        rc = mf_calibrate_io(s, l, 2, 1, fd, 16u << 20, &io);
        CHECK(rc == 0, "calibrate io: %s", mf_last_error());
        CHECK(rc || (io.all.bytes_per_s > 1e6 && isfinite(io.all.bytes_per_s) &&
                     io.all.latency_ns >= 0 && io.all.flops_per_s == 0), "io fit %g B/s + %g ns",
              io.all.bytes_per_s, io.all.latency_ns);
        rc = mf_calibrate_io(s, l, 2, 0, fd, 16u << 20, &io);
        CHECK(rc == -EINVAL && strstr(mf_last_error(), "not an IO lane"), "io on cpu lane: %d %s",
              rc, mf_last_error());
        rc = mf_calibrate_io(s, l, 2, 1, fd, 1u << 20, &io);
        CHECK(rc == -EINVAL, "tiny file accepted: %d", rc);
        close(fd);
    }
    rc = mf_calibrate_cpu(s, l, 2, 5, &cpu);
    CHECK(rc == -EINVAL, "lane 5 of 2 accepted: %d", rc);
    mf_sched_destroy(s);
}

/* Interval union and overlap (mf_timeline_union, mf_timeline_overlap) against a count of the
 * covered nanoseconds on fresh random spans. */
static void test_union(void)
{
    uint64_t x = 0x9e3779b97f4a7c15ULL;
    for (int rep = 0; rep < 200; rep++) {
        mf_task_span a[40], b[40];
        uint8_t in_a[1200] = {0}, in_b[1200] = {0};
        int na = 1 + rep % 40, nb = 1 + (rep * 7) % 40;
        for (int k = 0; k < na + nb; k++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            int64_t s0 = (int64_t)(x % 1000), len = (int64_t)((x >> 20) % 120);
            mf_task_span sp = {s0, s0 + len, 0, 0};
            uint8_t *cov = k < na ? in_a : in_b;
            for (int64_t t = sp.start_ns; t < sp.end_ns; t++) cov[t] = 1;
            if (k < na) a[k] = sp;
            else b[k - na] = sp;
        }
        int64_t want_a = 0, want_b = 0, want_ab = 0, la, lb;
        for (int t = 0; t < 1200; t++) {
            want_a += in_a[t];
            want_b += in_b[t];
            want_ab += in_a[t] && in_b[t];
        }
        int ua = mf_timeline_union(a, na, &la), ub = mf_timeline_union(b, nb, &lb);
        CHECK(la == want_a && lb == want_b, "union: %lld and %lld ns, counted %lld and %lld", (long long)la,
              (long long)lb, (long long)want_a, (long long)want_b);
        for (int k = 1; k < ua; k++) CHECK(a[k].start_ns > a[k - 1].end_ns, "union: spans %d, %d not merged", k - 1, k);
        int64_t ov = mf_timeline_overlap(a, ua, b, ub);
        CHECK(ov == want_ab, "overlap %lld ns, counted %lld", (long long)ov, (long long)want_ab);
    }
}

/* Lane options of the simulated machine: a concurrency override, and a wake phase on the lane's
 * own thread (one at a time) before each task. */
static void test_lane_options(void)
{
    mf_lane_desc l = {.kind = MF_LANE_CPU, .name = "cpu", .concurrency = 4, .numa_node = -1,
                      .model = {.flops_per_s = 1e9}};
    mf_graph *g;
    CHECK(mf_graph_create(&l, 1, &g) == 0, "%s", mf_last_error());
    for (int k = 0; k < 3; k++) add(g, "t", 0, 1.0);   /* three independent tasks of 1 ms */
    CHECK(mf_graph_finalize(g) == 0, "%s", mf_last_error());
    mf_timeline *tl;
    CHECK(mf_timeline_create(g, &tl) == 0, "%s", mf_last_error());
    mf_timeline_summary s;
    int one = 1;
    CHECK(!mf_sim_run_opts(g, &(mf_sim_opts){.concurrency = &one}, tl) && !mf_timeline_summarize(tl, &s) &&
              s.makespan_ns == 3 * MS, "one slot: makespan %lld", (long long)s.makespan_ns);
    /* wake 2 ms each on the lane's one thread, then 1 ms on one of 4 slots: 2, 4, 6 ms + 1 */
    int64_t wake = 2 * MS;
    CHECK(!mf_sim_run_opts(g, &(mf_sim_opts){.wake_ns = &wake}, tl) && !mf_timeline_summarize(tl, &s) &&
              s.makespan_ns == 7 * MS, "wake phases: makespan %lld, expected 7 ms", (long long)s.makespan_ns);
    mf_task_span *sp = mf_timeline_spans(tl);
    CHECK(sp[0].start_ns == 2 * MS && sp[0].end_ns == 3 * MS, "wake: the span is the lane's part alone");
    mf_timeline_destroy(tl);
    mf_graph_destroy(g);
}

/* Sleeping workers: a free slot idle for longer than spin_ns is asleep and a task given to it
 * starts sleep_wake_ns later; a spinning slot (the most recently freed) is taken first. Tasks of
 * 1 ms on 2 slots, spin 0.5 ms, wake 0.3 ms: A -> (B, C) -> D -> (long E, F), F -> G. */
static void test_sleeping_workers(void)
{
    mf_lane_desc l = {.kind = MF_LANE_CPU, .name = "cpu", .concurrency = 2, .numa_node = -1,
                      .model = {.flops_per_s = 1e9}};
    mf_graph *g;
    CHECK(mf_graph_create(&l, 1, &g) == 0, "%s", mf_last_error());
    mf_task_id a = add(g, "a", 0, 1), b = add(g, "b", 0, 1), c = add(g, "c", 0, 1), d = add(g, "d", 0, 1);
    mf_task_id e = add(g, "e", 0, 3), f = add(g, "f", 0, 1), h = add(g, "g", 0, 1);
    dep(g, a, b), dep(g, a, c), dep(g, b, d), dep(g, c, d), dep(g, d, e), dep(g, d, f), dep(g, f, h);
    CHECK(mf_graph_finalize(g) == 0, "%s", mf_last_error());
    mf_timeline *tl;
    CHECK(mf_timeline_create(g, &tl) == 0, "%s", mf_last_error());
    mf_timeline_summary s;
    /* off: 0-1 a, 1-2 b c, 2-3 d, 3-6 e, 3-4 f, 4-5 g */
    CHECK(!mf_sim_run_opts(g, &(mf_sim_opts){.spin_ns = MS / 2}, tl) && !mf_timeline_summarize(tl, &s) &&
              s.makespan_ns == 6 * MS, "no wake-up: makespan %lld, expected 6 ms", (long long)s.makespan_ns);
    /* on: a wakes at 0.3 (every slot asleep at the start), ends 1.3 on slot 0; b takes spinning
     * slot 0 at 1.3 (ends 2.3), c wakes slot 1 (1.6-2.6); d at 2.6 on slot 1, just freed (3.6);
     * e on slot 1 (3.6-6.6), f on slot 0, idle since 2.3, asleep: 3.9-4.9; g on slot 0, 4.9-5.9 */
    CHECK(!mf_sim_run_opts(g, &(mf_sim_opts){.spin_ns = MS / 2, .sleep_wake_ns = 3 * MS / 10}, tl) &&
              !mf_timeline_summarize(tl, &s), "%s", mf_last_error());
    mf_task_span *sp = mf_timeline_spans(tl);
    const struct { mf_task_id t; int64_t start; int worker; } want[] = {
        {a, 3 * MS / 10, 0}, {b, 13 * MS / 10, 0}, {c, 16 * MS / 10, 1}, {d, 26 * MS / 10, 1},
        {e, 36 * MS / 10, 1}, {f, 39 * MS / 10, 0}, {h, 49 * MS / 10, 0}};
    for (size_t k = 0; k < sizeof want / sizeof want[0]; k++)
        CHECK(sp[want[k].t].start_ns == want[k].start && sp[want[k].t].worker == want[k].worker,
              "sleeping workers: task %d starts %lld on slot %d, expected %lld on %d", want[k].t,
              (long long)sp[want[k].t].start_ns, sp[want[k].t].worker, (long long)want[k].start, want[k].worker);
    CHECK(s.makespan_ns == 66 * MS / 10, "sleeping workers: makespan %lld, expected 6.6 ms", (long long)s.makespan_ns);
    CHECK(mf_sim_run_opts(g, &(mf_sim_opts){.spin_ns = -1, .sleep_wake_ns = 1}, tl) == -EINVAL,
          "a negative spin is refused");
    mf_timeline_destroy(tl);
    mf_graph_destroy(g);
}

int main(void)
{
    test_union();
    test_lane_options();
    test_sleeping_workers();
    test_chain();
    test_fork_join(2, 6 * MS);
    test_fork_join(4, 4 * MS);
    test_concurrency_limit();
    test_pipeline();
    test_priority();
    test_models();
    test_summary();
    test_determinism_and_speed();
    test_chrome();
    test_errors();
    test_calibrate();
    return mf_check_exit("test_sim");
}
