/* `moeflow bench devtasks`: what device-lane tasks cost the host's cores when the CPU workers are
 * busy. Emulated cards are host threads, so each device task's round trip (the lane's submitting
 * thread, the stream's thread, the callback) takes a core from the workers; `moeflow sim
 * --dev-task-ns` takes this figure (docs/sim.md). Synthetic graphs, no model. */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "device/dev.h"
#include "sched/calibrate.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "sched/graph.h"
#include "sched/sched.h"
#include "tools/commands.h"

#define MF_BDT_WORK 64

static int mf_bdt_nop(void *arg, mf_task_ctx *ctx)
{
    (void)arg;
    (void)ctx;
    return 0;
}

static int mf_bdt_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* layers x [root -> 4 W CPU tasks of work (and, with_dev, per card and slot an empty in -> ffn ->
 * out chain as graphs/step/step_moe_cards.c lays them out) -> join]; the median wall time of reps runs in us. */
static int mf_bdt_run(mf_sched *s, const mf_lane_desc *lanes, int n_lanes, int n_cards, int W, int slots,
                      int layers, int with_dev, mf_calib_fma *work, int reps, double *us, int *n_dev)
{
    mf_graph *g;
    int rc = mf_graph_create(lanes, n_lanes, &g);
    if (rc) return rc;
    mf_task_id prev = -1;
    *n_dev = 0;
    for (int L = 0; L < layers && !rc; L++) {
        mf_task_id r = mf_graph_add_task(g, &(mf_task_desc){.name = "root", .lane = 0, .fn = mf_bdt_nop, .place_hint = -1});
        mf_task_id j = mf_graph_add_task(g, &(mf_task_desc){.name = "join", .lane = 0, .fn = mf_bdt_nop, .place_hint = -1});
        if (r < 0 || j < 0) rc = r < 0 ? r : j;
        if (!rc && prev >= 0) rc = mf_graph_add_dep(g, prev, r);
        for (int k = 0; k < 4 * W && !rc; k++) {
            mf_task_id t = mf_graph_add_task(g, &(mf_task_desc){.name = "work", .lane = 0, .fn = mf_calib_fma_task,
                                                                .arg = &work[k % MF_BDT_WORK], .cost = {.time_ns = 1e5},
                                                                .place_hint = -1});
            rc = t < 0 ? t : mf_graph_add_dep(g, r, t);
            if (!rc) rc = mf_graph_add_dep(g, t, j);
        }
        for (int sl = 0; with_dev && sl < slots && !rc; sl++)
            for (int c = 0; c < n_cards && !rc; c++) {
                mf_task_id t[3];
                for (int k = 0; k < 3 && !rc; k++) {
                    t[k] = mf_graph_add_task(g, &(mf_task_desc){.name = "dev", .lane = 1 + 3 * c + k, .fn = mf_bdt_nop,
                                                                .cost = {.bytes = 1e6}, .place_hint = -1});
                    if (t[k] < 0) rc = t[k];
                    (*n_dev)++;
                }
                if (!rc) rc = mf_graph_add_dep(g, r, t[0]);
                if (!rc) rc = mf_graph_add_dep(g, t[0], t[1]);
                if (!rc) rc = mf_graph_add_dep(g, t[1], t[2]);
                if (!rc) rc = mf_graph_add_dep(g, t[2], j);
            }
        prev = j;
    }
    if (!rc) rc = mf_graph_finalize(g);
    double *w = malloc(sizeof *w * (size_t)reps);
    if (!w && !rc) rc = mf_error(-ENOMEM, "out of memory");
    for (int k = 0; k < reps && !rc; k++) {
        int64_t t0 = mf_now_ns();
        rc = mf_sched_run(s, g, &(mf_run_opts){0});
        w[k] = (mf_now_ns() - t0) / 1e3;
    }
    if (!rc) {
        qsort(w, (size_t)reps, sizeof *w, mf_bdt_cmp);
        *us = w[reps / 2];
    }
    free(w);
    mf_graph_destroy(g);
    return rc;
}

/* The command line of `moeflow bench devtasks`. */
typedef struct mf_bdt_cli {
    const char *spec;
    long threads, slots, layers, reps;
    int json;
} mf_bdt_cli;

#define F(x) offsetof(mf_bdt_cli, x)
static const mf_opt mf_bdt_table[] = {
    {"--devices", .kind = MF_OPT_STR, .off = F(spec), .def = "emu:4", .meta = "SPEC",
     .help = "the cards whose lanes carry the device tasks"},
    {"--threads", .kind = MF_OPT_LONG, .off = F(threads), .meta = "N", .lo = 1, .hi = 4096,
     .help = "CPU workers, all busy (default: the online CPUs)"},
    {"--slots", .kind = MF_OPT_LONG, .off = F(slots), .def = "6", .meta = "S", .lo = 1, .hi = 4096,
     .help = "device chains per card and layer"},
    {"--layers", .kind = MF_OPT_LONG, .off = F(layers), .def = "8", .meta = "L", .lo = 1, .hi = 4096,
     .help = "layers of the graph"},
    {"--reps", .kind = MF_OPT_LONG, .off = F(reps), .def = "21", .meta = "R", .lo = 1, .hi = 4096,
     .help = "runs of each graph; medians"},
    {"--json", .kind = MF_OPT_FLAG, .off = F(json),
     .help = "one JSON object: devices, threads, device_tasks, work_only_us, with_device_us,\n"
             "core_ns_per_device_task"},
    {NULL},
};
#undef F

static const mf_opts_spec mf_bdt_spec = {
    .cmd = "bench devtasks",
    .usage = "usage: moeflow bench devtasks [--devices SPEC] [--threads N] [--slots S] [--layers L] [--reps R]\n"
             "                              [--json]\n\n"
             "What device-lane tasks cost the host's cores while the CPU workers are busy: --layers\n"
             "of 4 x N CPU tasks of 100 us of FMA work each, beside (or not) per card and slot an\n"
             "empty in -> ffn -> out chain on the card's three lanes (4 in flight, as the decode\n"
             "engine has them). The wall time added per device task, times N workers, is the core\n"
             "time one device task takes from the workers: with emulated cards, give it to\n"
             "`moeflow sim --dev-task-ns`. Medians of --reps runs.\n\n",
    .opts = mf_bdt_table,
    .col = 18,
};

/* An executor of one CPU lane (threads workers) and each card's three lanes. */
static int mf_bdt_open(const char *spec, int threads, mf_dev **d, mf_sched **s, mf_lane_desc *lanes, int *n_cards)
{
    int rc = mf_dev_open(spec, d);
    if (rc) return rc;
    *n_cards = mf_dev_n_cards(*d);
    lanes[0] = (mf_lane_desc){.kind = MF_LANE_CPU, .name = "cpu", .concurrency = threads, .numa_node = -1,
                              .model = {.latency_ns = 2000}};
    static const mf_lane_kind kk[3] = {MF_LANE_DEV_COPY_IN, MF_LANE_DEV_COMPUTE, MF_LANE_DEV_COPY_OUT};
    for (int c = 0; c < *n_cards; c++)
        for (int k = 0; k < 3; k++)
            lanes[1 + 3 * c + k] = (mf_lane_desc){.kind = kk[k], .name = "dev", .concurrency = 4, .numa_node = -1,
                                                  .device = c, .model = {.bytes_per_s = 25e9, .latency_ns = 10000}};
    return mf_sched_create(&(mf_sched_opts){.lanes = lanes, .n_lanes = 1 + 3 * *n_cards, .dev = mf_dev_lane_ops_of(*d)},
                           s);
}

int mf_bench_devtasks(int argc, char **argv)
{
    mf_bdt_cli a = {.threads = sysconf(_SC_NPROCESSORS_ONLN)};
    int rc = mf_opts_parse(&mf_bdt_spec, argc, argv, &a);
    if (rc != MF_OPTS_RUN) return rc;
    if (a.threads < 1) a.threads = 1;
    mf_dev *d = NULL;
    mf_sched *s = NULL;
    mf_lane_desc lanes[1 + 3 * MF_DEV_MAX_CARDS];
    static mf_calib_fma work[MF_BDT_WORK];
    int n_cards = 0;
    rc = mf_bdt_open(a.spec, (int)a.threads, &d, &s, lanes, &n_cards);
    /* 100 us of FMA work per task at this machine's speed */
    mf_calib_fma probe = {.flops = 2e7};
    int64_t t0 = mf_now_ns();
    mf_calib_fma_task(&probe, NULL);
    double flops_per_us = 2e7 / ((mf_now_ns() - t0) / 1e3);
    for (int i = 0; i < MF_BDT_WORK; i++) work[i].flops = flops_per_us * 100;
    double w0 = 0, w1 = 0;
    int nd = 0, nd0 = 0;
    if (!rc) rc = mf_bdt_run(s, lanes, 1 + 3 * n_cards, n_cards, (int)a.threads, (int)a.slots, (int)a.layers, 0, work,
                             (int)a.reps, &w0, &nd0);
    if (!rc) rc = mf_bdt_run(s, lanes, 1 + 3 * n_cards, n_cards, (int)a.threads, (int)a.slots, (int)a.layers, 1, work,
                             (int)a.reps, &w1, &nd);
    mf_sched_destroy(s);
    mf_dev_close(d);
    if (rc) {
        fprintf(stderr, "moeflow bench devtasks: %s\n", mf_last_error());
        return 1;
    }
    double per = nd ? (w1 - w0) / nd : 0, core_ns = per * a.threads * 1e3;
    if (a.json)
        printf("{\"devices\":\"%s\",\"threads\":%ld,\"device_tasks\":%d,\"work_only_us\":%.1f,\"with_device_us\":%.1f,"
               "\"core_ns_per_device_task\":%.0f}\n", a.spec, a.threads, nd, w0, w1, core_ns);
    else
        printf("bench devtasks: %s, %ld workers busy with %ld x 100 us of work per layer, %ld layers\n"
               "  work only                      %10.1f us\n"
               "  with %4d empty device tasks  %10.1f us: +%.2f us per device task\n"
               "  core time per device task      %10.0f ns   (moeflow sim --dev-task-ns %.0f)\n",
               a.spec, a.threads, 4 * a.threads, a.layers, w0, nd, w1, per, core_ns, core_ns);
    return 0;
}
