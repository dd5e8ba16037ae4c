/* `moeflow bench`: micro-benchmarks, one subcommand each. `bench sched` measures the scheduler's
 * per-task overhead on empty tasks in three shapes (chain, independent, layered), with the graph
 * built once and re-run, and reports the best of a few runs in ns per task. */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/clock.h"
#include "sched/error.h"
#include "sched/graph.h"
#include "sched/sched.h"
#include "tools/commands.h"

static int mf_bench_empty(void *arg, mf_task_ctx *ctx) { return 0; }

enum { MF_SHAPE_CHAIN, MF_SHAPE_INDEPENDENT, MF_SHAPE_LAYERED };

/* Builds n empty tasks on lane 0: a chain, no dependencies, or layers of `width` where each task
 * depends on two tasks of the previous layer. */
static int mf_bench_graph(const mf_lane_desc *lane, int shape, int n, int width, mf_graph **out)
{
    mf_graph *g;
    int rc = mf_graph_create(lane, 1, &g);
    if (rc) return rc;
    for (int i = 0; i < n && !rc; i++) {
        mf_task_id t = mf_graph_add_task(g, &(mf_task_desc){.name = "t", .lane = 0,
                                                            .fn = mf_bench_empty, .place_hint = -1,
                                                            .cost = {.time_ns = 1}});
        if (t < 0) rc = t;
        else if (shape == MF_SHAPE_CHAIN && t > 0) rc = mf_graph_add_dep(g, t - 1, t);
        else if (shape == MF_SHAPE_LAYERED && t >= width) {
            int layer = t / width, j = t % width, prev = (layer - 1) * width;
            rc = mf_graph_add_dep(g, prev + j, t);
            if (!rc && width > 1) rc = mf_graph_add_dep(g, prev + (j + 1) % width, t);
        }
    }
    if (!rc) rc = mf_graph_finalize(g);
    if (rc) {
        mf_graph_destroy(g);
        return rc;
    }
    *out = g;
    return 0;
}

/* The command line of `moeflow bench sched`. */
typedef struct mf_bench_sched_cli {
    long n, workers, reps, width;
    int json;
} mf_bench_sched_cli;

#define F(x) offsetof(mf_bench_sched_cli, x)
static const mf_opt mf_bench_sched_table[] = {
    {"--tasks", .kind = MF_OPT_LONG, .off = F(n), .def = "100000", .meta = "N", .lo = 1, .hi = 100000000,
     .help = "empty tasks per graph"},
    {"--workers", .kind = MF_OPT_LONG, .off = F(workers), .def = "2", .meta = "N", .lo = 1, .hi = 100000000,
     .help = "threads of the CPU lane (unpinned)"},
    {"--reps", .kind = MF_OPT_LONG, .off = F(reps), .def = "5", .meta = "N", .lo = 1, .hi = 100000000,
     .help = "timed runs of each graph (after one warm-up run)"},
    {"--width", .kind = MF_OPT_LONG, .off = F(width), .def = "100", .meta = "N", .lo = 1, .hi = 100000000,
     .help = "tasks per layer of the layered shape"},
    {"--json", .kind = MF_OPT_FLAG, .off = F(json),
     .help = "{\"chain_ns_per_task\":..,\"independent_ns_per_task\":..,\"layered_ns_per_task\":..}\n"
             "(best) and the same keys with _mean_ns_per_task instead"},
    {NULL},
};
#undef F

static const mf_opts_spec mf_bench_sched_spec = {
    .cmd = "bench sched",
    .usage = "usage: moeflow bench sched [--tasks N] [--workers N] [--reps N] [--width N] [--json]\n"
             "\n"
             "Measures the scheduler's overhead per task: N empty tasks on one CPU lane of --workers\n"
             "threads, in three graph shapes:\n"
             "  chain        each task depends on the one before\n"
             "  independent  no dependencies\n"
             "  layered      layers of --width tasks, each depending on two tasks of the layer before\n"
             "Each graph is built once and run --reps times; prints the best run's wall time divided\n"
             "by N, and the mean over the runs (with more workers than cores, or other load on the\n"
             "machine, the best run can be a lucky one).\n\n",
    .opts = mf_bench_sched_table,
    .col = 16,
};

/* Runs each shape reps + 1 times (the first a warm-up): best[] and mean[] ns per task. */
static int mf_bench_sched_run(const mf_bench_sched_cli *a, double best[3], double mean[3])
{
    int n = (int)a->n, reps = (int)a->reps;
    mf_lane_desc lane = {.kind = MF_LANE_CPU, .name = "cpu", .concurrency = (int)a->workers,
                         .numa_node = -1, .device = -1};
    mf_sched *s;
    int rc = mf_sched_create(&(mf_sched_opts){.lanes = &lane, .n_lanes = 1}, &s);
    if (rc) return rc;
    for (int shape = 0; shape < 3; shape++) {
        mf_graph *g;
        rc = mf_bench_graph(&lane, shape, n, (int)a->width, &g);
        if (rc) break;
        best[shape] = 1e30;
        mean[shape] = 0;
        for (int r = 0; r < reps + 1 && !rc; r++) {   /* the first run is a warm-up */
            int64_t t0 = mf_now_ns();
            rc = mf_sched_run(s, g, NULL);
            double ns = (double)(mf_now_ns() - t0) / n;
            if (r && ns < best[shape]) best[shape] = ns;
            if (r) mean[shape] += ns / reps;
        }
        mf_graph_destroy(g);
    }
    mf_sched_destroy(s);
    return rc;
}

static int mf_bench_sched(int argc, char **argv)
{
    mf_bench_sched_cli a = {0};
    int rc = mf_opts_parse(&mf_bench_sched_spec, argc, argv, &a);
    if (rc != MF_OPTS_RUN) return rc;
    static const char *const names[] = {"chain", "independent", "layered"};
    double best[3], mean[3];
    if (mf_bench_sched_run(&a, best, mean)) {
        fprintf(stderr, "moeflow bench sched: %s\n", mf_last_error());
        return 1;
    }
    if (a.json) {
        printf("{\"chain_ns_per_task\":%.1f,\"independent_ns_per_task\":%.1f,"
               "\"layered_ns_per_task\":%.1f,\"chain_mean_ns_per_task\":%.1f,"
               "\"independent_mean_ns_per_task\":%.1f,\"layered_mean_ns_per_task\":%.1f}\n",
               best[0], best[1], best[2], mean[0], mean[1], mean[2]);
    } else {
        printf("scheduler overhead, %ld empty tasks, %ld workers, best (mean) of %ld runs:\n", a.n, a.workers,
               a.reps);
        for (int i = 0; i < 3; i++) printf("  %-12s %8.1f ns/task (%.1f)\n", names[i], best[i], mean[i]);
    }
    return 0;
}

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *what;
} mf_bench_subs[] = {
    {"sched", mf_bench_sched, "scheduler overhead per task (chain, independent, layered)"},
    {"io", mf_bench_io, "store reads vs dd iflag=direct; 264-byte gathers vs a pread loop"},
    {"dev", mf_bench_dev, "device FP4 matmul vs a d2d copy of its bytes; pinned h2d of an expert vs one large copy"},
    {"kernels", mf_bench_kernels, "fused FP4 expert matmul and FFN vs read probe and expand baseline"},
    {"devtasks", mf_bench_devtasks, "core time device-lane tasks take from busy CPU workers (sim --dev-task-ns)"},
    {"ref", mf_bench_ref, "the reference's plain-C loops per unit, as weights against a profile's host_ref (sim)"},
    {"decode", mf_bench_decode, "decode steps: scheduled vs reference engine, phase table per step"},
    {"serve", mf_bench_serve, "a mixed-length workload: continuous batching vs static batching, tokens/s, TTFT, ITL"},
    {"weights", mf_bench_weights, "decode steps on weights mapped from the page cache vs a private copy vs the store"},
    {"echo", mf_bench_echo, "a prompt's prefill with and without echo logprobs (every position's logits)"},
    {NULL, NULL, NULL},
};

static void mf_bench_usage(FILE *f)
{
    fprintf(f, "usage: moeflow bench <what> [options]   (moeflow bench <what> --help for each)\n\n");
    for (int i = 0; mf_bench_subs[i].name; i++)
        fprintf(f, "  %-8s %s\n", mf_bench_subs[i].name, mf_bench_subs[i].what);
}

int mf_cmd_bench(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        mf_bench_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (int i = 0; mf_bench_subs[i].name; i++)
        if (!strcmp(argv[1], mf_bench_subs[i].name)) return mf_bench_subs[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "moeflow bench: unknown benchmark '%s'\n\n", argv[1]);
    mf_bench_usage(stderr);
    return 2;
}
