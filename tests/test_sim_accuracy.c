/* Does the simulator predict real runs? Calibrates this machine's CPU and IO lane models, then
 * runs synthetic graphs of cached reads and FMA compute (chains, fan-out/fan-in layers, read ->
 * compute pipelines with different IO:compute ratios) for real with the executor and in virtual
 * time, and prints predicted against measured for each makespan (median of 3 runs) with the cores
 * other processes used meanwhile. Timings are reported, never asserted (the machine is shared);
 * what is checked holds under any load: both timelines keep every dependency (a task starts after
 * its predecessors end) and every lane's concurrency, the simulated durations are the calibrated
 * models' costs, and the simulated makespan lies between the models' critical path and their
 * summed work. Skips under sanitizers, whose slowdowns make the calibration meaningless. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sched/calibrate.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "sched/graph.h"
#include "sched/sched.h"
#include "sched/sim.h"
#include "sched/timeline.h"
#include "tests/check.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define ACC_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define ACC_SANITIZED 1
#endif
#endif

#define ACC_TOLERANCE 0.15      /* reported: graphs predicted within this on a quiet machine */
#define ACC_MAX_FOREIGN 0.10    /* a measurement counts as quiet below this many foreign cores */
#define ACC_MAX_FIT_SPREAD 0.10 /* calibration: rate with 1 vs `concurrency` tasks in flight */
#define ACC_FILE_BYTES (256ull << 20)
#define ACC_MAX_TASKS 2048
#define ACC_BUFS 8            /* read destinations, used round-robin */
#define ACC_BUF_BYTES (8u << 20)

/* One lane table with its scheduler and calibrated models. */
typedef struct acc_setup {
    const char *name;
    mf_lane_desc lanes[2];    /* 0: cpu, 1: io */
    mf_sched *s;
    mf_lane_model models[2];
    int calibrated;           /* CPU model fitted on a quiet machine, not contradicted since */
} acc_setup;

/* A graph under construction with the payloads its tasks point to. */
typedef struct acc_graph {
    acc_setup *su;
    mf_graph *g;
    mf_calib_fma fma[ACC_MAX_TASKS];
    mf_io_read reads[ACC_MAX_TASKS];
    int n_fma, n_reads;
} acc_graph;

static int acc_fd = -1;
static char *acc_bufs;

/* A compute task lasting about `ms` at the calibrated rate. */
static mf_task_id cpu_task(acc_graph *b, const char *name, double ms)
{
    if (b->n_fma == ACC_MAX_TASKS)
        return -ENOSPC;
    mf_calib_fma *w = &b->fma[b->n_fma++];
    w->flops = ms * 1e-3 * b->su->models[0].flops_per_s;
    mf_task_desc d = {.name = name, .lane = 0, .fn = mf_calib_fma_task, .arg = w,
                      .cost = {.flops = w->flops}, .place_hint = -1};
    return mf_graph_add_task(b->g, &d);
}

/* A read of n_bytes from the cached file. */
static mf_task_id io_task(acc_graph *b, const char *name, uint64_t n_bytes)
{
    if (b->n_reads == ACC_MAX_TASKS)
        return -ENOSPC;
    int i = b->n_reads++;
    uint64_t slots = ACC_FILE_BYTES / n_bytes;
    b->reads[i] = (mf_io_read){.fd = acc_fd, .offset = ((uint64_t)i % slots) * n_bytes,
                               .buf = acc_bufs + (size_t)(i % ACC_BUFS) * ACC_BUF_BYTES,
                               .n_bytes = n_bytes};
    mf_task_desc d = {.name = name, .lane = 1, .arg = &b->reads[i],
                      .cost = {.bytes = (double)n_bytes}, .place_hint = -1};
    return mf_graph_add_task(b->g, &d);
}

static void dep(acc_graph *b, mf_task_id x, mf_task_id y)
{
    int rc = mf_graph_add_dep(b->g, x, y);
    CHECK(rc == 0, "add_dep: %s", mf_last_error());
}

/* ---- the graphs ---------------------------------------------------------------------------- */

/* 80 compute tasks of 2.5 ms in a chain: latency between dependent tasks counts. */
static void g_chain(acc_graph *b)
{
    for (int i = 0; i < 80; i++) {
        mf_task_id t = cpu_task(b, "chain", 2.5);
        if (i)
            dep(b, t - 1, t);
    }
}

/* 12 layers: a 1 ms head fans out to 7 tasks of 3 ms that join in a 0.5 ms task. */
static void g_fanout(acc_graph *b)
{
    mf_task_id prev = -1;
    for (int l = 0; l < 12; l++) {
        mf_task_id head = cpu_task(b, "head", 1.0), join = cpu_task(b, "join", 0.5);
        if (prev >= 0)
            dep(b, prev, head);
        for (int i = 0; i < 7; i++) {
            mf_task_id t = cpu_task(b, "body", 3.0);
            dep(b, head, t);
            dep(b, t, join);
        }
        prev = join;
    }
}

/* n reads of `bytes`, each feeding an independent compute task of `ms`. */
static void pipeline(acc_graph *b, int n, uint64_t bytes, double ms)
{
    for (int i = 0; i < n; i++) {
        mf_task_id r = io_task(b, "read", bytes), c = cpu_task(b, "compute", ms);
        dep(b, r, c);
    }
}

static void g_pipe_compute(acc_graph *b)    /* compute-bound */
{
    pipeline(b, 120, 2u << 20, 2.0);
}

static void g_pipe_io(acc_graph *b)         /* IO-bound */
{
    pipeline(b, 300, 8u << 20, 0.3);
}

static void g_pipe_balanced(acc_graph *b)
{
    pipeline(b, 150, 4u << 20, 1.0);
}

/* MoE-like layers: attention (2 ms), 6 expert reads of 3 MiB that wait for the previous layer,
 * 6 expert computes (1.5 ms) after attention and their read, a 0.5 ms combine. */
static void g_layers(acc_graph *b)
{
    mf_task_id prev = -1;
    for (int l = 0; l < 14; l++) {
        mf_task_id attn = cpu_task(b, "attn", 2.0), comb = cpu_task(b, "combine", 0.5);
        if (prev >= 0)
            dep(b, prev, attn);
        for (int e = 0; e < 6; e++) {
            mf_task_id r = io_task(b, "expert.read", 3u << 20), c = cpu_task(b, "expert", 1.5);
            if (prev >= 0)
                dep(b, prev, r);
            dep(b, r, c);
            dep(b, attn, c);
            dep(b, c, comb);
        }
        prev = comb;
    }
}

/* No overlap possible: 120 x (read 2 MiB -> compute 1 ms) in one chain, so every step hands
 * over between the lanes (overlap ratio > 1: the CPU waits for each read). */
static void g_alternate(acc_graph *b)
{
    mf_task_id prev = -1;
    for (int i = 0; i < 120; i++) {
        mf_task_id r = io_task(b, "read", 2u << 20), c = cpu_task(b, "compute", 1.0);
        if (prev >= 0)
            dep(b, prev, r);
        dep(b, r, c);
        prev = c;
    }
}

typedef struct acc_case {
    const char *name;
    void (*build)(acc_graph *b);
    int setup;   /* which lane table */
} acc_case;

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* What a run's timeline must satisfy whatever the load: every task ran, started no earlier than
 * its predecessors ended, and no lane had more tasks at once than its concurrency; a simulated
 * one also lasts its model's cost (whole ns) and its makespan lies between the models' critical
 * path (the largest upward rank) and their summed work. */
static void check_timeline(const char *name, const char *what, const mf_graph *g, const mf_task_span *sp,
                           int simulated)
{
    int n = mf_graph_n_tasks(g), bad_dep = 0, bad_dur = 0, bad_status = 0;
    int64_t end = 0;
    double work = 0, cp = 0;
    for (mf_task_id t = 0; t < n; t++) {
        bad_status += sp[t].status != 0 || sp[t].end_ns < sp[t].start_ns;
        for (int k = 0; k < mf_graph_n_pred(g, t); k++)
            bad_dep += sp[t].start_ns < sp[mf_graph_pred(g, t)[k]].end_ns;
        if (sp[t].end_ns > end)
            end = sp[t].end_ns;
        double cost = mf_graph_task_cost_ns(g, t);
        work += cost;
        if (mf_graph_rank_ns(g, t) > cp)
            cp = mf_graph_rank_ns(g, t);
        if (simulated)
            bad_dur += llabs(sp[t].end_ns - sp[t].start_ns - llround(cost)) > 1;
    }
    CHECK(!bad_status, "%s %s: %d tasks did not run cleanly", name, what, bad_status);
    CHECK(!bad_dep, "%s %s: %d dependencies broken (a task started before a predecessor ended)", name,
          what, bad_dep);
    /* lane concurrency: sweep each lane's starts and ends in time order (ends first on ties) */
    for (int l = 0; l < mf_graph_n_lanes(g); l++) {
        int conc = mf_graph_lane(g, l)->concurrency, most = 0, now = 0;
        for (mf_task_id t = 0; t < n; t++) {
            if (mf_graph_task(g, t)->lane != l)
                continue;
            now = 0;
            for (mf_task_id u = 0; u < n; u++)
                now += mf_graph_task(g, u)->lane == l && sp[u].start_ns <= sp[t].start_ns &&
                       sp[u].end_ns > sp[t].start_ns;
            if (now > most)
                most = now;
        }
        CHECK(conc <= 0 || most <= conc, "%s %s: lane %d had %d tasks at once (concurrency %d)", name, what,
              l, most, conc);
    }
    if (simulated) {
        CHECK(!bad_dur, "%s simulated: %d tasks did not last their model's cost", name, bad_dur);
        CHECK(end >= llround(cp) - n && end <= llround(work) + n,
              "%s simulated: makespan %lld ns outside [critical path %.0f, summed work %.0f]", name,
              (long long)end, cp, work);
    }
}

/* Builds the case's graph with the setup's calibrated models, runs it 1 + 3 times for real and
 * once in virtual time; writes the table row to `row` and the relative error to *err. */
static int run_case(const acc_case *c, acc_setup *su, double *err, char *row, size_t row_bytes)
{
    static acc_graph b;
    memset(&b, 0, sizeof b);
    b.su = su;
    mf_lane_desc lanes[2];
    memcpy(lanes, su->lanes, sizeof lanes);
    lanes[0].model = su->models[0];   /* ranks from the calibrated models, as a user would */
    lanes[1].model = su->models[1];
    mf_timeline *tl = NULL, *tl_sim = NULL;
    int rc = mf_graph_create(lanes, 2, &b.g);
    if (rc)
        return rc;
    c->build(&b);
    if (!rc)
        rc = mf_graph_finalize(b.g);
    if (!rc)
        rc = mf_timeline_create(b.g, &tl);
    if (!rc)
        rc = mf_timeline_create(b.g, &tl_sim);
    int64_t ms[3];
    mf_timeline_summary sum, ps;
    for (int r = -1; r < 3 && !rc; r++) {
        mf_run_opts ro = {.timeline = tl};
        rc = mf_sched_run(su->s, b.g, &ro);
        if (!rc && (rc = mf_timeline_summarize(tl, &sum)) == 0 && r >= 0)
            ms[r] = sum.makespan_ns;
    }
    if (!rc)
        check_timeline(c->name, "measured", b.g, mf_timeline_spans(tl), 0);
    if (!rc)
        rc = mf_sim_run(b.g, su->models, tl_sim);
    if (!rc)
        check_timeline(c->name, "simulated", b.g, mf_timeline_spans(tl_sim), 1);
    if (!rc)
        rc = mf_timeline_summarize(tl_sim, &ps);
    if (!rc) {
        qsort(ms, 3, sizeof *ms, cmp_i64);
        double meas = (double)ms[1], pred = (double)ps.makespan_ns;
        *err = (pred - meas) / meas;
        snprintf(row, row_bytes, "%-14s %-8s %5d %8.1f %8.1f %8.1f %8.1f %+7.1f%% %5.2f", c->name,
                 su->name, mf_graph_n_tasks(b.g), meas * 1e-6, (double)ms[0] * 1e-6,
                 (double)ms[2] * 1e-6, pred * 1e-6, 100 * *err, ps.overlap_ratio);
    }
    mf_timeline_destroy(tl);
    mf_timeline_destroy(tl_sim);
    mf_graph_destroy(b.g);
    return rc;
}

/* CPU time used so far by the whole machine (busy, including time stolen by the host) and by
 * this process, in ns. Their difference over a window is the load of everything else: other
 * helpers' builds share this machine, and a lane model cannot describe a core taken away. */
static void cpu_times(int64_t *machine_ns, int64_t *self_ns)
{
    unsigned long long user = 0, nice = 0, sys = 0, idle = 0, iowait = 0, irq = 0, softirq = 0,
                       steal = 0;
    FILE *f = fopen("/proc/stat", "r");
    if (f) {
        if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &user, &nice, &sys, &idle,
                   &iowait, &irq, &softirq, &steal) != 8)
            user = nice = sys = irq = softirq = steal = 0;
        fclose(f);
    }
    *machine_ns = (int64_t)((user + nice + sys + irq + softirq + steal) *
                            (1e9 / (double)sysconf(_SC_CLK_TCK)));
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    *self_ns = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

typedef struct acc_window {
    int64_t wall_ns, machine_ns, self_ns;
} acc_window;

static acc_window window_start(void)
{
    acc_window w = {.wall_ns = mf_now_ns()};
    cpu_times(&w.machine_ns, &w.self_ns);
    return w;
}

/* Cores' worth of CPU that other processes used since w started (0.5 = half a core). */
static double foreign_load(const acc_window *w)
{
    acc_window now = window_start();
    double wall = (double)(now.wall_ns - w->wall_ns);
    double other = (double)(now.machine_ns - w->machine_ns) - (double)(now.self_ns - w->self_ns);
    return wall > 0 ? other / wall : 0;
}

/* Fits the setup's IO lane model now, and its CPU lane model too when `cpu` (the CPU rate is
 * stable; memory-copy bandwidth drifts with what the host's other guests do). Returns 1 when a
 * fit is not self-consistent: the rates with one task in flight and with `concurrency` in flight
 * (independent measurements) differ by more than ACC_MAX_FIT_SPREAD. */
static int calibrate(acc_setup *su, int cpu_too)
{
    mf_calib_fit cpu, io;
    int rc, bad = 0;
    if (cpu_too) {
        if ((rc = mf_calibrate_cpu(su->s, su->lanes, 2, 0, &cpu)))
            return rc;
        printf("  calibrated %s cpu: %.2f GFLOP/s + %.1f us (x1 %.2f + %.1f us), worst residual "
               "%.0f%%\n", su->name, cpu.all.flops_per_s * 1e-9, cpu.all.latency_ns * 1e-3,
               cpu.one.flops_per_s * 1e-9, cpu.one.latency_ns * 1e-3, 100 * cpu.max_resid);
        su->models[0] = cpu.all;
        double spread = cpu.all.flops_per_s / cpu.one.flops_per_s;
        bad |= spread > 1 + ACC_MAX_FIT_SPREAD || spread < 1 - ACC_MAX_FIT_SPREAD;
    }
    if ((rc = mf_calibrate_io(su->s, su->lanes, 2, 1, acc_fd, ACC_FILE_BYTES, &io)))
        return rc;
    printf("  calibrated %s io: %.2f GB/s + %.1f us (again %.2f + %.1f us), worst residual "
           "%.0f%%\n", su->name, io.all.bytes_per_s * 1e-9, io.all.latency_ns * 1e-3,
           io.one.bytes_per_s * 1e-9, io.one.latency_ns * 1e-3, 100 * io.max_resid);
    su->models[1] = io.all;
    double spread = io.all.bytes_per_s / io.one.bytes_per_s;
    bad |= spread > 1 + ACC_MAX_FIT_SPREAD || spread < 1 - ACC_MAX_FIT_SPREAD;
    return bad;
}

int main(void)
{
#ifdef ACC_SANITIZED
    printf("test_sim_accuracy: SKIP (sanitizer build: timings are meaningless)\n");
    return 77;
#endif
    const char *tmp = getenv("MOEFLOW_TMP");
    int rc = mf_calib_file_create(tmp ? tmp : "/tmp", ACC_FILE_BYTES, &acc_fd);
    CHECK(rc == 0, "calibration file: %s", mf_last_error());
    if (rc || posix_memalign((void **)&acc_bufs, 4096, (size_t)ACC_BUFS * ACC_BUF_BYTES))
        return mf_check_exit("test_sim_accuracy");
    memset(acc_bufs, 1, (size_t)ACC_BUFS * ACC_BUF_BYTES);

    /* Two CPU workers for compute-only graphs; one worker beside the IO lane for mixed graphs,
     * because cached reads are memory copies that need a core of their own on this 2-core
     * machine (the simulator models lanes, not contention between them for cores). */
    acc_setup setups[2] = {
        {.name = "cpu2",
         .lanes = {{.kind = MF_LANE_CPU, .name = "cpu", .concurrency = 2, .numa_node = -1},
                   {.kind = MF_LANE_IO, .name = "io", .concurrency = 1, .numa_node = -1}}},
        {.name = "cpu1+io1",
         .lanes = {{.kind = MF_LANE_CPU, .name = "cpu", .concurrency = 1, .numa_node = -1},
                   {.kind = MF_LANE_IO, .name = "io", .concurrency = 1, .numa_node = -1}}},
    };
    const acc_case cases[] = {
        {"chain", g_chain, 0},          {"fanout", g_fanout, 0},
        {"pipe.compute", g_pipe_compute, 1}, {"pipe.balanced", g_pipe_balanced, 1},
        {"pipe.io", g_pipe_io, 1},      {"alternate", g_alternate, 1},
        {"layers", g_layers, 1},
    };
    for (int i = 0; i < 2; i++) {
        mf_sched_opts o = {.lanes = setups[i].lanes, .n_lanes = 2, .pin_threads = 0};
        rc = mf_sched_create(&o, &setups[i].s);
        CHECK(rc == 0, "%s: %s", setups[i].name, mf_last_error());
        if (rc)
            return mf_check_exit("test_sim_accuracy");
    }
    printf("IO engine %s; reads hit the page cache (file read back after writing)\n",
           mf_sched_io_engine(setups[1].s));
    printf("%-14s %-8s %5s %8s %8s %8s %8s %8s %5s %4s\n", "graph", "lanes", "tasks", "meas ms",
           "min ms", "max ms", "pred ms", "error", "ovl", "busy");
    printf("(busy: cores other processes used during the calibration and the runs; error: reported,\n"
           " not checked: with other processes on the cores it is theirs as much as the model's)\n");
    /* Calibrate right before each graph (the CPU lane before a lane table's first graph, and
     * again after a fit that was not self-consistent), run it, print. */
    int64_t t0 = mf_now_ns();
    int n_cases = (int)(sizeof cases / sizeof *cases), n_within = 0, n_quiet = 0;
    char row[256];
    for (int i = 0; i < n_cases; i++) {
        acc_setup *su = &setups[cases[i].setup];
        acc_window w = window_start();
        if ((rc = calibrate(su, !su->calibrated)) < 0) {
            CHECK(0, "%s: calibrate: %s", su->name, mf_last_error());
            continue;
        }
        su->calibrated = rc == 0;
        double err = 0;
        if ((rc = run_case(&cases[i], su, &err, row, sizeof row))) {
            CHECK(0, "%s: %s", cases[i].name, mf_last_error());
            continue;
        }
        double foreign = foreign_load(&w);
        int quiet = foreign <= ACC_MAX_FOREIGN, within = err <= ACC_TOLERANCE && err >= -ACC_TOLERANCE;
        n_quiet += quiet;
        n_within += quiet && within;
        printf("%s %4.2f%s\n", row, foreign, within ? "" : quiet ? "  (outside 15% on a quiet machine)" : "");
    }
    printf("within +-%.0f%%: %d of the %d graphs measured with the machine quiet (%d in all)\n",
           100 * ACC_TOLERANCE, n_within, n_quiet, n_cases);
    printf("total %.1f s\n", (double)(mf_now_ns() - t0) * 1e-9);
    for (int i = 0; i < 2; i++)
        mf_sched_destroy(setups[i].s);
    close(acc_fd);
    free(acc_bufs);
    return mf_check_exit("test_sim_accuracy");
}
