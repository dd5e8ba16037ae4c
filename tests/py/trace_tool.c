/* Writes the Chrome trace of a synthetic graph for tests/py/check_trace.py: per layer, reads (io
 * lane, 4 slots) feed expert tasks (cpu0, 2 slots) after an attention task (cpu1, 1 slot), joined
 * on cpu1 or a device lane. Usage: trace_tool OUT.json [layers] [sim|real]: "sim" (default)
 * simulates it; "real" runs it through the executor (FMA tasks, reads of a cached temp file in
 * $MOEFLOW_TMP, no device lane), so the trace carries real worker slots. Prints tasks and edges. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sched/calibrate.h"
#include "sched/error.h"
#include "sched/graph.h"
#include "sched/sched.h"
#include "sched/sim.h"
#include "sched/timeline.h"

#define MAX_TASKS 4096
#define READ_BYTES (64u << 10)
#define FILE_BYTES (16u << 20)

static int noop(void *arg, mf_task_ctx *ctx)
{
    return 0;
}

static int real_mode, file_fd = -1, n_fma, n_reads;
static mf_calib_fma fma_args[MAX_TASKS];
static mf_io_read reads[MAX_TASKS];
static char *read_bufs;

static mf_task_id add(mf_graph *g, const char *name, int lane, double flops, double bytes)
{
    if (n_fma == MAX_TASKS || n_reads == MAX_TASKS)
        return -1;
    mf_task_desc d = {.name = name, .lane = lane, .cost = {.bytes = bytes, .flops = flops},
                      .place_hint = -1};
    if (lane == 2) {
        int i = n_reads++;
        reads[i] = (mf_io_read){.fd = file_fd, .offset = (uint64_t)(i % (FILE_BYTES / READ_BYTES)) * READ_BYTES,
                                .buf = read_bufs ? read_bufs + (size_t)i * READ_BYTES : NULL,
                                .n_bytes = READ_BYTES};
        d.arg = &reads[i];
    } else if (real_mode) {
        fma_args[n_fma].flops = flops / 20;   /* real tasks of tens of us */
        d.fn = mf_calib_fma_task;
        d.arg = &fma_args[n_fma++];
    } else {
        d.fn = noop;
    }
    return mf_graph_add_task(g, &d);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: trace_tool OUT.json [layers] [sim|real]\n");
        return 2;
    }
    int layers = argc > 2 ? atoi(argv[2]) : 12;
    real_mode = argc > 3 && !strcmp(argv[3], "real");
    if (layers < 1 || layers > MAX_TASKS / 14) {
        fprintf(stderr, "trace_tool: layers must be 1..%d\n", MAX_TASKS / 14);
        return 2;
    }
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
    int n_lanes = real_mode ? 3 : 4;
    mf_sched *s = NULL;
    mf_graph *g = NULL;
    mf_timeline *tl = NULL;
    int rc = 0;
    if (real_mode) {
        const char *tmp = getenv("MOEFLOW_TMP");
        mf_sched_opts o = {.lanes = lanes, .n_lanes = n_lanes};
        if ((rc = mf_calib_file_create(tmp ? tmp : "/tmp", FILE_BYTES, &file_fd)) < 0 ||
            (rc = mf_sched_create(&o, &s)) < 0)
            goto fail;
        if (!(read_bufs = calloc((size_t)layers * 6, READ_BYTES))) {
            rc = mf_error(-ENOMEM, "trace_tool: out of memory");
            goto fail;
        }
    }
    if ((rc = mf_graph_create(lanes, n_lanes, &g)) < 0)
        goto fail;
    mf_task_id prev_join = -1;
    int n_edges = 0;
    char name[64];
    for (int l = 0; l < layers; l++) {
        snprintf(name, sizeof name, "layer%d.attn", l);
        mf_task_id attn = add(g, name, 1, 4e6, 0);
        if (prev_join >= 0)
            rc |= mf_graph_add_dep(g, prev_join, attn), n_edges++;
        snprintf(name, sizeof name, "layer%d.join", l);
        mf_task_id join = add(g, name, l % 2 && !real_mode ? 3 : 1, 1e6, 0);
        for (int e = 0; e < 6; e++) {
            snprintf(name, sizeof name, "layer%d.read%d", l, e);
            mf_task_id rd = add(g, name, 2, 0, READ_BYTES);
            snprintf(name, sizeof name, "layer%d.expert%d", l, e);
            mf_task_id ex = add(g, name, 0, 2e7, 0);
            rc |= mf_graph_add_dep(g, rd, ex);
            rc |= mf_graph_add_dep(g, attn, ex);
            rc |= mf_graph_add_dep(g, ex, join);
            n_edges += 3;
        }
        prev_join = join;
    }
    if (rc < 0 || (rc = mf_graph_finalize(g)) < 0 || (rc = mf_timeline_create(g, &tl)) < 0)
        goto fail;
    if (real_mode) {
        mf_run_opts ro = {.timeline = tl};
        rc = mf_sched_run(s, g, &ro);
    } else {
        rc = mf_sim_run(g, NULL, tl);
    }
    if (rc < 0 || (rc = mf_timeline_write_chrome(tl, argv[1])) < 0)
        goto fail;
    mf_timeline_summary sum;
    if (mf_timeline_summarize(tl, &sum) == 0)
        mf_timeline_print_summary(tl, &sum, stderr);
    printf("%d %d\n", mf_graph_n_tasks(g), n_edges);
fail:
    if (rc < 0)
        fprintf(stderr, "trace_tool: %s\n", mf_last_error());
    mf_timeline_destroy(tl);
    mf_graph_destroy(g);
    mf_sched_destroy(s);
    if (file_fd >= 0)
        close(file_fd);
    free(read_bufs);
    return rc < 0 ? 1 : 0;
}
