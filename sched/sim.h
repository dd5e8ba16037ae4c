/* The virtual-time simulator: runs a graph without doing the work, each task's duration from its
 * lane's cost model (mf_lane_model) and each lane's concurrency, in upward-rank order like the
 * executor. Tasks marked noop (mf_graph_set_noop) complete the instant they become ready, as the
 * executor completes them. Deterministic; fills the same timeline as a real run. */
#ifndef MF_SIM_H
#define MF_SIM_H

#include "sched/graph.h"
#include "sched/timeline.h"

/* Simulates g; `models` overrides the graph's lane models when non-NULL (one per lane). */
int mf_sim_run(const mf_graph *g, const mf_lane_model *models, mf_timeline *tl);

/* The same with more control. task_ns: each task's duration in ns (overrides the lane models).
 * A core pool: lanes flagged in lane_core[] (e.g. the CPU lanes and emulated cards' compute
 * lanes, whose kernels are host threads) also need one of n_cores cores while a task runs; when
 * cores are short, the ready task of highest upward rank among those lanes goes first (lowest id
 * on ties). n_cores 0: no pool (mf_sim_run). -EINVAL for n_cores < 0. */
/* Lane options of the simulated machine, per lane (NULL: none): concurrency overrides the
 * graph's lane concurrency where > 0 (e.g. one disk pipe, one stream per device lane). wake_ns:
 * where > 0, every task of the lane first holds the lane's own host thread (one task at a time,
 * a core of the pool when there is one) for that long, then queues on its lane: the host-side
 * round trip of an emulated card's stream. Its span is the lane part alone. */
typedef struct mf_sim_opts {
    const mf_lane_model *models;   /* NULL: the graph's */
    const int64_t *task_ns;        /* NULL: from the models */
    const uint8_t *lane_core;      /* n_lanes flags, or NULL */
    int n_cores;
    const int *concurrency;        /* n_lanes, or NULL */
    const int64_t *wake_ns;        /* n_lanes, or NULL */
    /* Sleeping CPU workers (the executor's idle workers spin, then sleep until a push wakes
     * them): where sleep_wake_ns > 0, a CPU lane's slot that has been free for longer than
     * spin_ns is asleep, and a task given to it starts sleep_wake_ns later (its span starts
     * then). A free slot still spinning is chosen before a sleeping one (the most recently freed
     * first, lowest index on ties); every slot is asleep at the start of the run. 0: off, free
     * slots are taken lowest first and start at once. */
    int64_t spin_ns, sleep_wake_ns;
} mf_sim_opts;
int mf_sim_run_opts(const mf_graph *g, const mf_sim_opts *o, mf_timeline *tl);

#endif
