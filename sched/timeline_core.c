/* The timeline's storage: one span per task of a graph, allocated once and reused by every run
 * (real or simulated) of that graph. Summaries and export live in timeline.c. */
#include "sched/timeline_impl.h"

#include <stdlib.h>

#include "sched/error.h"

int mf_timeline_create(const mf_graph *g, mf_timeline **out)
{
    *out = NULL;
    int n = mf_graph_n_tasks(g);
    mf_timeline *tl = calloc(1, sizeof *tl);
    if (!tl) return mf_error(-ENOMEM, "timeline: out of memory");
    tl->g = g;
    tl->n = n;
    tl->spans = calloc((size_t)(n ? n : 1), sizeof *tl->spans);
    tl->critical = calloc((size_t)(n ? n : 1), sizeof *tl->critical);
    if (!tl->spans || !tl->critical) {
        mf_timeline_destroy(tl);
        return mf_error(-ENOMEM, "timeline: out of memory for %d tasks", n);
    }
    mf_timeline_reset(tl);
    *out = tl;
    return 0;
}

void mf_timeline_destroy(mf_timeline *tl)
{
    if (!tl) return;
    free(tl->spans);
    free(tl->critical);
    free(tl);
}

/* Forgets the last run: every task reads as not run (status 1, no worker). */
void mf_timeline_reset(mf_timeline *tl)
{
    for (int i = 0; i < tl->n; i++) tl->spans[i] = (mf_task_span){0, 0, -1, 1};
    tl->n_critical = 0;
}

mf_task_span *mf_timeline_spans(mf_timeline *tl) { return tl->spans; }
const mf_graph *mf_timeline_graph(const mf_timeline *tl) { return tl->g; }
