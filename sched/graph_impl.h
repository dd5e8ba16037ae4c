/* The inside of mf_graph, shared by graph.c and the executor (sched.c and the lane engines) so
 * the hot path reads the packed arrays directly. Nothing outside sched/ includes this; everyone
 * else uses graph.h. */
#ifndef MF_GRAPH_IMPL_H
#define MF_GRAPH_IMPL_H

#include <stdatomic.h>

#include "sched/graph.h"

typedef struct mf_edge {
    mf_task_id before, after;
} mf_edge;

struct mf_graph {
    int n_lanes;
    mf_lane_desc *lanes;          /* names copied */

    int n_tasks, cap_tasks;
    mf_task_desc *tasks;          /* names copied */

    int n_edges, cap_edges;
    mf_edge *edges;               /* as added; deduplicated at finalize */

    int finalized;
    /* Packed at finalize (CSR): successors of t are succ[succ_off[t] .. succ_off[t+1]). */
    int32_t *succ_off, *succ;
    int32_t *pred_off, *pred;
    mf_task_id *topo;             /* a topological order */
    double *cost_ns;              /* from the lane model */
    double *rank_ns;              /* upward rank: cost + max rank of successors */
    /* Per task, settable between and during runs (mf_graph_set_noop): 1 = nothing to do. */
    _Atomic unsigned char *noop;

    /* The executor's per-graph run state (queues, counters), made at the first run, freed here. */
    void *rt;
    void (*rt_free)(void *rt);
    /* The run state's copy of a task's lane, kept in step by mf_graph_set_lane (NULL: none). */
    void (*rt_set_lane)(void *rt, mf_task_id t, int lane);
};

#endif
