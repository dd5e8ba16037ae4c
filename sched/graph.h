/* Task graphs: a decode step becomes tasks on lanes with dependencies, a payload, a cost estimate
 * and a name. A graph is built once per shape of step, finalized (checked acyclic, priorities
 * computed, adjacency packed), then run any number of times with new payload arguments and no
 * allocation per run. Nothing here knows about models. */
#ifndef MF_GRAPH_H
#define MF_GRAPH_H

#include <stdint.h>

typedef int32_t mf_task_id;

/* What kind of resource a lane is. A graph names lanes by index into its lane table. */
typedef enum mf_lane_kind {
    MF_LANE_CPU,          /* a CPU pool (one per NUMA node), task fn runs on a pinned worker */
    MF_LANE_IO,           /* the io_uring lane: the task's payload is an mf_io_read (a read or a write) */
    MF_LANE_DEV_COPY_IN,  /* device lanes: task fn enqueues async work on the lane's stream */
    MF_LANE_DEV_COMPUTE,
    MF_LANE_DEV_COPY_OUT,
} mf_lane_kind;

/* The cost model of one lane, used for critical-path priorities and by the simulator. A task's
 * duration = latency_ns + bytes / bytes_per_s + flops / flops_per_s + time_ns. */
typedef struct mf_lane_model {
    double bytes_per_s;   /* 0: bytes cost nothing on this lane */
    double flops_per_s;   /* 0: flops cost nothing */
    double latency_ns;    /* fixed cost per task */
} mf_lane_model;

typedef struct mf_lane_desc {
    mf_lane_kind kind;
    const char *name;     /* timeline track name, e.g. "cpu0", "io", "dev1.h2d" */
    int concurrency;      /* tasks in flight at once: CPU threads, IO queue depth, device slots */
    int numa_node;        /* CPU lanes: the node whose cores serve it (-1: any) */
    int device;           /* device lanes: which device */
    mf_lane_model model;
} mf_lane_desc;

/* A task's estimated cost; any mix of the three. */
typedef struct mf_cost {
    double bytes;
    double flops;
    double time_ns;
} mf_cost;

/* Task payload for CPU and device lanes: returns 0 or a negative code with mf_error() set.
 * `ctx` is the executor's per-call context (worker index, device stream) -- see sched.h. */
typedef struct mf_task_ctx mf_task_ctx;
typedef int (*mf_task_fn)(void *arg, mf_task_ctx *ctx);
/* What a device-lane fn returns when it enqueued no work (e.g. an expert slot placed on another
 * card this step): the task completes at once on the submitting thread, without a round trip
 * through its stream. Elsewhere it means the same as 0. */
#define MF_TASK_NO_WORK 1

/* Payload of an IO-lane task: read n_bytes at offset of fd into buf. dio_align 0: a buffered fd.
 * Otherwise fd was opened O_DIRECT and file offsets, lengths and buffer addresses must be
 * multiples of dio_align (a power of two): the lane reads aligned requests straight into buf and
 * misaligned ones through an aligned bounce buffer of its own (the enclosing aligned range, then
 * copied out). A buf inside a buffer registered with mf_sched_io_register is read with
 * io_uring's fixed-buffer reads. */
typedef struct mf_io_read {
    int fd;
    uint64_t offset;
    void *buf;
    uint64_t n_bytes;
    uint32_t dio_align;
    /* 1: write n_bytes from buf at offset instead (short writes resubmitted for the rest; with
     * dio_align, offset, n_bytes and buf must all be multiples of it: no bounce buffer for writes,
     * a misaligned write fails with -EINVAL). 0 (default): read. */
    int write;
} mf_io_read;

typedef struct mf_task_desc {
    const char *name;     /* copied into the graph */
    int lane;
    mf_task_fn fn;        /* CPU and device lanes; NULL on the IO lane */
    void *arg;            /* fn's argument; on the IO lane an mf_io_read* */
    mf_cost cost;
    int place_hint;       /* CPU lanes: preferred worker (data locality), -1: none */
} mf_task_desc;

typedef struct mf_graph mf_graph;

/* Creates an empty graph over n_lanes lanes (copied). */
int mf_graph_create(const mf_lane_desc *lanes, int n_lanes, mf_graph **out);
void mf_graph_destroy(mf_graph *g);

/* Adds a task; returns its id (>= 0) or a negative code. Not allowed after finalize. */
mf_task_id mf_graph_add_task(mf_graph *g, const mf_task_desc *d);
/* `after` may start only once `before` has finished. */
int mf_graph_add_dep(mf_graph *g, mf_task_id before, mf_task_id after);
/* Checks for cycles and bad lanes, packs adjacency, computes upward ranks. */
int mf_graph_finalize(mf_graph *g);

/* Replaces task t's cost estimate (what its priority is computed from) before finalize: 0,
 * -EPERM after finalize, -EINVAL for an unknown task. */
int mf_graph_set_cost(mf_graph *g, mf_task_id t, mf_cost cost);

/* Raises task t's priority after finalize to at least rank_ns (its upward rank otherwise): for a
 * policy the ranks cannot express, e.g. a copy whose successor waits for it alone on a lane that
 * also holds longer copies which rank above it by their own cost (graphs/step/stepgraph_place.c
 * mf_sg_pre_ranks). Before any run. 0, -EPERM before finalize, -EINVAL for an unknown task. */
int mf_graph_raise_rank(mf_graph *g, mf_task_id t, double rank_ns);

/* Per-run payload update (allowed after finalize, between runs). */
void mf_graph_set_arg(mf_graph *g, mf_task_id t, void *arg);
/* Marks task t as having nothing to do (noop 1) or as normal (0), until changed. Allowed after
 * finalize, between runs and during one: a task fn may mark tasks that are not yet ready (e.g. its
 * successors), and the executor reads the mark when the task's last predecessor finishes. A
 * marked task is completed right there, without being queued to its lane: no lane thread wakes,
 * no device round trip; its span has zero length (worker -1). A marked task without predecessors
 * runs normally. Marks of a run that fails are honoured as cancellations. */
void mf_graph_set_noop(mf_graph *g, mf_task_id t, int noop);
int mf_graph_noop(const mf_graph *g, mf_task_id t);
/* Moves task t to another CPU lane (e.g. the pool of the socket that holds the data it reads),
 * until changed. Allowed after finalize, between runs and during one from a predecessor's fn (the
 * move is then seen when t becomes ready, as a noop mark is). Both lanes must be CPU lanes; t must
 * have predecessors and no place_hint. 0, or -EINVAL naming what was wrong. */
int mf_graph_set_lane(mf_graph *g, mf_task_id t, int lane);

/* Read access for executors, the simulator and the timeline. */
int mf_graph_n_tasks(const mf_graph *g);
int mf_graph_n_lanes(const mf_graph *g);
const mf_lane_desc *mf_graph_lane(const mf_graph *g, int lane);
const mf_task_desc *mf_graph_task(const mf_graph *g, mf_task_id t);
int mf_graph_n_succ(const mf_graph *g, mf_task_id t);
const mf_task_id *mf_graph_succ(const mf_graph *g, mf_task_id t);
int mf_graph_n_pred(const mf_graph *g, mf_task_id t);
const mf_task_id *mf_graph_pred(const mf_graph *g, mf_task_id t);
double mf_graph_task_cost_ns(const mf_graph *g, mf_task_id t);   /* from its lane's model */
double mf_graph_rank_ns(const mf_graph *g, mf_task_id t);       /* upward rank (critical path) */

#endif
