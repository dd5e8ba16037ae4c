/* Writes the Chrome trace of a simulated synthetic graph for tests/py/check_trace.py: a pipeline
 * of reads (io lane, 4 slots) feeding fan-out/fan-in compute layers on two CPU lanes (2 and 1
 * slots) and a 1-slot device lane. Usage: trace_tool OUT.json [layers]; prints tasks and edges. */
#include <stdio.h>
#include <stdlib.h>

#include "sched/error.h"
#include "sched/graph.h"
#include "sched/sim.h"
#include "sched/timeline.h"

static int noop(void *arg, mf_task_ctx *ctx)
{
    return 0;
}

static mf_io_read fake_read;

static mf_task_id add(mf_graph *g, const char *name, int lane, double flops, double bytes)
{
    mf_task_desc d = {.name = name, .lane = lane, .cost = {.bytes = bytes, .flops = flops},
                      .place_hint = -1};
    if (lane == 2)
        d.arg = &fake_read;
    else
        d.fn = noop;
    return mf_graph_add_task(g, &d);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: trace_tool OUT.json [layers]\n");
        return 2;
    }
    int layers = argc > 2 ? atoi(argv[2]) : 12;
    mf_lane_desc lanes[4] = {
        {.kind = MF_LANE_CPU, .name = "cpu0", .concurrency = 2, .numa_node = -1,
         .model = {.flops_per_s = 2e10, .latency_ns = 2000}},
        {.kind = MF_LANE_CPU, .name = "cpu1", .concurrency = 1, .numa_node = -1,
         .model = {.flops_per_s = 1e10, .latency_ns = 2000}},
        {.kind = MF_LANE_IO, .name = "io", .concurrency = 4, .numa_node = -1,
         .model = {.bytes_per_s = 3e9, .latency_ns = 50000}},
        {.kind = MF_LANE_DEV_COMPUTE, .name = "dev0.compute", .concurrency = 1, .numa_node = -1,
         .device = 0, .model = {.flops_per_s = 1e12, .latency_ns = 5000}},
    };
    mf_graph *g;
    mf_timeline *tl;
    int rc = mf_graph_create(lanes, 4, &g);
    mf_task_id prev_join = -1;
    int n_edges = 0;
    char name[64];
    for (int l = 0; rc >= 0 && l < layers; l++) {
        snprintf(name, sizeof name, "layer%d.attn", l);
        mf_task_id attn = add(g, name, 1, 4e6, 0);
        if (prev_join >= 0)
            rc |= mf_graph_add_dep(g, prev_join, attn), n_edges++;
        snprintf(name, sizeof name, "layer%d.join", l);
        mf_task_id join = add(g, name, l % 2 ? 3 : 1, 1e6, 0);
        for (int e = 0; e < 6; e++) {
            snprintf(name, sizeof name, "layer%d.read%d", l, e);
            mf_task_id rd = add(g, name, 2, 0, 2e6 + 1e5 * e);
            snprintf(name, sizeof name, "layer%d.expert%d", l, e);
            mf_task_id ex = add(g, name, 0, 2e7, 0);
            rc |= mf_graph_add_dep(g, rd, ex);
            rc |= mf_graph_add_dep(g, attn, ex);
            rc |= mf_graph_add_dep(g, ex, join);
            n_edges += 3;
        }
        prev_join = join;
    }
    if (rc < 0 || (rc = mf_graph_finalize(g)) < 0 || (rc = mf_timeline_create(g, &tl)) < 0 ||
        (rc = mf_sim_run(g, NULL, tl)) < 0 || (rc = mf_timeline_write_chrome(tl, argv[1])) < 0) {
        fprintf(stderr, "trace_tool: %s\n", mf_last_error());
        return 1;
    }
    mf_timeline_summary s;
    if (mf_timeline_summarize(tl, &s) == 0)
        mf_timeline_print_summary(tl, &s, stderr);
    printf("%d %d\n", mf_graph_n_tasks(g), n_edges);
    mf_timeline_destroy(tl);
    mf_graph_destroy(g);
    return 0;
}
