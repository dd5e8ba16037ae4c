/* The inside of mf_timeline, shared by timeline_core.c (create/reset/spans, used by the executor)
 * and timeline.c (summary, Chrome export) and sim.c. Nothing outside sched/ includes this. */
#ifndef MF_TIMELINE_IMPL_H
#define MF_TIMELINE_IMPL_H

#include "sched/timeline.h"

struct mf_timeline {
    const mf_graph *g;
    int n;                  /* tasks of g when created */
    mf_task_span *spans;    /* n, indexed by task id */
    int n_critical;
    mf_task_id *critical;   /* n: room for the measured critical path (owned here) */
};

#endif
