/* What happened in a run (real or simulated): start/end of every task in ns, per lane. Exported
 * as Chrome trace-event JSON (a track per lane, flow arrows for dependencies) that Perfetto and
 * chrome://tracing open, and summarized: makespan, busy time per lane, the critical path, and the
 * overlap ratio = makespan / busy time of the busiest lane (1.0: the bottleneck never waited). */
#ifndef MF_TIMELINE_H
#define MF_TIMELINE_H

#include <stdint.h>
#include <stdio.h>

#include "sched/graph.h"

typedef struct mf_task_span {
    int64_t start_ns;   /* relative to the run's start */
    int64_t end_ns;
    int32_t worker;     /* slot within the lane (CPU worker, IO slot, device queue) */
    int32_t status;     /* 0 ran, 1 cancelled (not run), negative: its error code */
} mf_task_span;

typedef struct mf_timeline mf_timeline;

/* Allocates room for a graph's tasks once; reused across runs of that graph. */
int mf_timeline_create(const mf_graph *g, mf_timeline **out);
void mf_timeline_destroy(mf_timeline *tl);
void mf_timeline_reset(mf_timeline *tl);
mf_task_span *mf_timeline_spans(mf_timeline *tl);       /* indexed by task id */
const mf_graph *mf_timeline_graph(const mf_timeline *tl);

#define MF_TIMELINE_MAX_LANES 64
typedef struct mf_timeline_summary {
    int64_t makespan_ns;
    int n_lanes;
    int64_t lane_busy_ns[MF_TIMELINE_MAX_LANES];   /* union of the lane's task intervals */
    int busiest_lane;
    double overlap_ratio;                          /* makespan / busiest lane's busy time */
    int64_t critical_path_ns;                      /* longest dependency chain, measured */
    int n_critical;                                /* tasks on it */
    mf_task_id *critical;                          /* owned by the timeline */
} mf_timeline_summary;

int mf_timeline_summarize(mf_timeline *tl, mf_timeline_summary *out);
/* Prints the summary as a small table. */
void mf_timeline_print_summary(const mf_timeline *tl, const mf_timeline_summary *s, FILE *f);
/* Interval union and overlap of task spans (the one home of both: phase times, IO/compute overlap;
 * no memory of their own). mf_timeline_union sorts s[0..n) by start and merges overlapping or
 * touching spans in place; returns the merged count and in *len_ns (may be NULL) their total
 * length. mf_timeline_overlap: the length of the intersection of two merged lists. */
int mf_timeline_union(mf_task_span *s, int n, int64_t *len_ns);
int64_t mf_timeline_overlap(const mf_task_span *a, int na, const mf_task_span *b, int nb);

/* Writes Chrome trace-event JSON to path; 0 or a negative code naming the path. Dependency
 * arrows (flow events) only for graphs of at most 20000 tasks; slices always. */
int mf_timeline_write_chrome(const mf_timeline *tl, const char *path);

#endif
