/* The virtual-time simulator: runs a graph without doing the work, each task's duration from its
 * lane's cost model (mf_lane_model) and each lane's concurrency, in upward-rank order like the
 * executor. Deterministic; fills the same timeline as a real run. */
#ifndef MF_SIM_H
#define MF_SIM_H

#include "sched/graph.h"
#include "sched/timeline.h"

/* Simulates g; `models` overrides the graph's lane models when non-NULL (one per lane). */
int mf_sim_run(const mf_graph *g, const mf_lane_model *models, mf_timeline *tl);

#endif
