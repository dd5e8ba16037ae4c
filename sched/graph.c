/* Task graphs: tasks are added with a lane, a payload, a cost and a name, dependencies as edges;
 * finalize checks lanes and cycles, packs successors and predecessors into CSR arrays and computes
 * upward ranks. After finalize a graph is read-only except for per-run payload arguments. */
#include "sched/graph_impl.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "sched/error.h"

static const char *mf_lane_kind_name(mf_lane_kind k)
{
    switch (k) {
    case MF_LANE_CPU: return "cpu";
    case MF_LANE_IO: return "io";
    case MF_LANE_DEV_COPY_IN: return "dev-copy-in";
    case MF_LANE_DEV_COMPUTE: return "dev-compute";
    case MF_LANE_DEV_COPY_OUT: return "dev-copy-out";
    }
    return "?";
}

int mf_graph_create(const mf_lane_desc *lanes, int n_lanes, mf_graph **out)
{
    *out = NULL;
    if (n_lanes <= 0 || !lanes)
        return mf_error(-EINVAL, "graph: needs at least one lane (got %d)", n_lanes);
    mf_graph *g = calloc(1, sizeof *g);
    if (!g) return mf_error(-ENOMEM, "graph: out of memory");
    g->lanes = calloc((size_t)n_lanes, sizeof *g->lanes);
    if (!g->lanes) {
        free(g);
        return mf_error(-ENOMEM, "graph: out of memory for %d lanes", n_lanes);
    }
    g->n_lanes = n_lanes;
    for (int i = 0; i < n_lanes; i++) {
        const mf_lane_desc *l = &lanes[i];
        if ((unsigned)l->kind > MF_LANE_DEV_COPY_OUT || l->concurrency < 0) {
            int code = mf_error(-EINVAL, "graph: lane %d ('%s'): bad kind %d or concurrency %d", i,
                                l->name ? l->name : "", (int)l->kind, l->concurrency);
            mf_graph_destroy(g);
            return code;
        }
        g->lanes[i] = *l;
        g->lanes[i].name = strdup(l->name ? l->name : mf_lane_kind_name(l->kind));
        if (!g->lanes[i].name) {
            mf_graph_destroy(g);
            return mf_error(-ENOMEM, "graph: out of memory");
        }
    }
    *out = g;
    return 0;
}

void mf_graph_destroy(mf_graph *g)
{
    if (!g) return;
    if (g->rt_free) g->rt_free(g->rt);
    for (int i = 0; i < g->n_lanes; i++) free((char *)g->lanes[i].name);
    for (int i = 0; i < g->n_tasks; i++) free((char *)g->tasks[i].name);
    free(g->lanes);
    free(g->tasks);
    free(g->edges);
    free(g->succ_off);
    free(g->succ);
    free(g->pred_off);
    free(g->pred);
    free((void *)g->noop);
    free(g->topo);
    free(g->cost_ns);
    free(g->rank_ns);
    free(g);
}

mf_task_id mf_graph_add_task(mf_graph *g, const mf_task_desc *d)
{
    if (g->finalized)
        return mf_error(-EPERM, "graph: cannot add task '%s' after finalize", d->name ? d->name : "");
    if (d->lane < 0 || d->lane >= g->n_lanes)
        return mf_error(-EINVAL, "graph: task '%s': lane %d does not exist (graph has %d lanes)",
                        d->name ? d->name : "", d->lane, g->n_lanes);
    if (g->n_tasks == INT32_MAX) return mf_error(-E2BIG, "graph: too many tasks");
    if (g->n_tasks == g->cap_tasks) {
        int cap = g->cap_tasks ? g->cap_tasks * 2 : 64;
        mf_task_desc *t = realloc(g->tasks, (size_t)cap * sizeof *t);
        if (!t) return mf_error(-ENOMEM, "graph: out of memory for %d tasks", cap);
        g->tasks = t;
        g->cap_tasks = cap;
    }
    mf_task_desc *t = &g->tasks[g->n_tasks];
    *t = *d;
    t->name = strdup(d->name ? d->name : "");
    if (!t->name) return mf_error(-ENOMEM, "graph: out of memory");
    return g->n_tasks++;
}

int mf_graph_add_dep(mf_graph *g, mf_task_id before, mf_task_id after)
{
    if (g->finalized) return mf_error(-EPERM, "graph: cannot add a dependency after finalize");
    if (before < 0 || before >= g->n_tasks || after < 0 || after >= g->n_tasks)
        return mf_error(-EINVAL, "graph: dependency %d -> %d names an unknown task (graph has %d)",
                        before, after, g->n_tasks);
    if (before == after)
        return mf_error(-EINVAL, "graph: task '%s' cannot depend on itself", g->tasks[before].name);
    if (g->n_edges == g->cap_edges) {
        int cap = g->cap_edges ? g->cap_edges * 2 : 64;
        mf_edge *e = realloc(g->edges, (size_t)cap * sizeof *e);
        if (!e) return mf_error(-ENOMEM, "graph: out of memory for %d dependencies", cap);
        g->edges = e;
        g->cap_edges = cap;
    }
    g->edges[g->n_edges++] = (mf_edge){before, after};
    return 0;
}

static double mf_cost_on(const mf_lane_model *m, const mf_cost *c)
{
    double ns = m->latency_ns + c->time_ns;
    if (m->bytes_per_s > 0) ns += c->bytes / m->bytes_per_s * 1e9;
    if (m->flops_per_s > 0) ns += c->flops / m->flops_per_s * 1e9;
    return ns;
}

static int mf_edge_cmp(const void *a, const void *b)
{
    const mf_edge *x = a, *y = b;
    if (x->before != y->before) return x->before < y->before ? -1 : 1;
    return (x->after > y->after) - (x->after < y->after);
}

/* Fills off[n+1]/adj[] from edges (already sorted by `before` when by_before). */
static void mf_pack(int n, const mf_edge *e, int m, int by_before, int32_t *off, int32_t *adj)
{
    memset(off, 0, (size_t)(n + 1) * sizeof *off);
    for (int i = 0; i < m; i++) off[(by_before ? e[i].before : e[i].after) + 1]++;
    for (int i = 0; i < n; i++) off[i + 1] += off[i];
    /* Second pass places entries; use adj positions via a running cursor kept in off[t]. */
    for (int i = 0; i < m; i++) {
        int32_t from = by_before ? e[i].before : e[i].after;
        adj[off[from]++] = by_before ? e[i].after : e[i].before;
    }
    for (int i = n; i > 0; i--) off[i] = off[i - 1];
    off[0] = 0;
}

/* Names a task on a cycle among the tasks Kahn's algorithm could not order (indeg > 0). */
static int mf_report_cycle(const mf_graph *g, const int32_t *indeg)
{
    int n = g->n_tasks, t = -1;
    for (int i = 0; i < n && t < 0; i++)
        if (indeg[i] > 0) t = i;
    /* Walk predecessors that are still unordered: every such task has one, so after n steps we
     * are inside a cycle. */
    for (int step = 0; step < n; step++) {
        for (int k = g->pred_off[t]; k < g->pred_off[t + 1]; k++)
            if (indeg[g->pred[k]] > 0) {
                t = g->pred[k];
                break;
            }
    }
    /* Find a predecessor of t on the cycle to name an edge. */
    int u = t;
    for (int k = g->pred_off[t]; k < g->pred_off[t + 1]; k++)
        if (indeg[g->pred[k]] > 0) {
            u = g->pred[k];
            break;
        }
    return mf_error(-EINVAL, "graph: dependency cycle through task '%s' (depends on '%s', which "
                    "depends back on it)", g->tasks[t].name, g->tasks[u].name);
}

int mf_graph_finalize(mf_graph *g)
{
    if (g->finalized) return 0;
    int n = g->n_tasks;
    for (int t = 0; t < n; t++) {
        const mf_task_desc *d = &g->tasks[t];
        if (d->lane < 0 || d->lane >= g->n_lanes)
            return mf_error(-EINVAL, "graph: task '%s': lane %d does not exist", d->name, d->lane);
        mf_lane_kind k = g->lanes[d->lane].kind;
        if (k == MF_LANE_IO && (d->fn || !d->arg))
            return mf_error(-EINVAL, "graph: task '%s' on IO lane '%s' needs an mf_io_read arg and "
                            "no fn", d->name, g->lanes[d->lane].name);
    }
    for (int i = 0; i < g->n_edges; i++) {
        const mf_edge *e = &g->edges[i];
        if (e->before < 0 || e->before >= n || e->after < 0 || e->after >= n)
            return mf_error(-EINVAL, "graph: dependency %d -> %d names an unknown task", e->before,
                            e->after);
    }
    if (g->n_edges) qsort(g->edges, (size_t)g->n_edges, sizeof *g->edges, mf_edge_cmp);
    int m = 0;
    for (int i = 0; i < g->n_edges; i++)
        if (!m || mf_edge_cmp(&g->edges[m - 1], &g->edges[i])) g->edges[m++] = g->edges[i];
    g->n_edges = m;

    g->succ_off = malloc((size_t)(n + 1) * sizeof *g->succ_off);
    g->pred_off = malloc((size_t)(n + 1) * sizeof *g->pred_off);
    g->succ = malloc((size_t)(m ? m : 1) * sizeof *g->succ);
    g->pred = malloc((size_t)(m ? m : 1) * sizeof *g->pred);
    g->topo = malloc((size_t)(n ? n : 1) * sizeof *g->topo);
    g->cost_ns = malloc((size_t)(n ? n : 1) * sizeof *g->cost_ns);
    g->rank_ns = malloc((size_t)(n ? n : 1) * sizeof *g->rank_ns);
    g->noop = calloc((size_t)(n ? n : 1), sizeof *g->noop);
    int32_t *indeg = malloc((size_t)(n ? n : 1) * sizeof *indeg);
    int rc = 0;
    if (!g->succ_off || !g->pred_off || !g->succ || !g->pred || !g->topo || !g->cost_ns ||
        !g->rank_ns || !g->noop || !indeg) {
        rc = mf_error(-ENOMEM, "graph: out of memory packing %d tasks, %d dependencies", n, m);
        goto fail;
    }
    mf_pack(n, g->edges, m, 1, g->succ_off, g->succ);
    mf_pack(n, g->edges, m, 0, g->pred_off, g->pred);

    /* Kahn's algorithm; topo doubles as the queue. */
    int head = 0, tail = 0;
    for (int t = 0; t < n; t++) {
        indeg[t] = g->pred_off[t + 1] - g->pred_off[t];
        if (!indeg[t]) g->topo[tail++] = t;
    }
    while (head < tail) {
        int t = g->topo[head++];
        for (int k = g->succ_off[t]; k < g->succ_off[t + 1]; k++)
            if (--indeg[g->succ[k]] == 0) g->topo[tail++] = g->succ[k];
    }
    if (tail < n) {
        rc = mf_report_cycle(g, indeg);
        goto fail;
    }
    for (int i = n - 1; i >= 0; i--) {
        int t = g->topo[i];
        double best = 0;
        for (int k = g->succ_off[t]; k < g->succ_off[t + 1]; k++)
            if (g->rank_ns[g->succ[k]] > best) best = g->rank_ns[g->succ[k]];
        g->cost_ns[t] = mf_cost_on(&g->lanes[g->tasks[t].lane].model, &g->tasks[t].cost);
        g->rank_ns[t] = g->cost_ns[t] + best;
    }
    free(indeg);
    g->finalized = 1;
    return 0;
fail:
    free(indeg);
    free(g->succ_off), g->succ_off = NULL;
    free(g->pred_off), g->pred_off = NULL;
    free(g->succ), g->succ = NULL;
    free(g->pred), g->pred = NULL;
    free(g->topo), g->topo = NULL;
    free(g->cost_ns), g->cost_ns = NULL;
    free(g->rank_ns), g->rank_ns = NULL;
    free((void *)g->noop), g->noop = NULL;
    return rc;
}

void mf_graph_set_arg(mf_graph *g, mf_task_id t, void *arg)
{
    assert(t >= 0 && t < g->n_tasks);
    g->tasks[t].arg = arg;
}

int mf_graph_set_cost(mf_graph *g, mf_task_id t, mf_cost cost)
{
    if (g->finalized) return mf_error(-EPERM, "graph: cannot set a task's cost after finalize");
    if (t < 0 || t >= g->n_tasks) return mf_error(-EINVAL, "graph: task %d unknown (graph has %d)", t, g->n_tasks);
    g->tasks[t].cost = cost;
    return 0;
}

void mf_graph_set_noop(mf_graph *g, mf_task_id t, int noop)
{
    assert(g->finalized && t >= 0 && t < g->n_tasks);
    atomic_store_explicit(&g->noop[t], (unsigned char)!!noop, memory_order_relaxed);
}

int mf_graph_set_lane(mf_graph *g, mf_task_id t, int lane)
{
    if (!g->finalized || t < 0 || t >= g->n_tasks || lane < 0 || lane >= g->n_lanes)
        return mf_error(-EINVAL, "graph: set_lane of task %d to lane %d (graph: %d tasks, %d lanes, %s)", t,
                        lane, g->n_tasks, g->n_lanes, g->finalized ? "finalized" : "not finalized");
    mf_task_desc *d = &g->tasks[t];
    if (d->lane == lane) return 0;
    if (g->lanes[d->lane].kind != MF_LANE_CPU || g->lanes[lane].kind != MF_LANE_CPU || d->place_hint >= 0 ||
        g->pred_off[t + 1] == g->pred_off[t])
        return mf_error(-EINVAL, "graph: task '%s' cannot move from lane '%s' to '%s' (CPU lanes only, a task "
                        "with predecessors and no place hint)", d->name, g->lanes[d->lane].name,
                        g->lanes[lane].name);
    d->lane = lane;
    if (g->rt && g->rt_set_lane) g->rt_set_lane(g->rt, t, lane);
    return 0;
}

int mf_graph_noop(const mf_graph *g, mf_task_id t)
{
    return g->noop ? atomic_load_explicit(&g->noop[t], memory_order_relaxed) : 0;
}

int mf_graph_n_tasks(const mf_graph *g) { return g->n_tasks; }
int mf_graph_n_lanes(const mf_graph *g) { return g->n_lanes; }
const mf_lane_desc *mf_graph_lane(const mf_graph *g, int lane) { return &g->lanes[lane]; }
const mf_task_desc *mf_graph_task(const mf_graph *g, mf_task_id t) { return &g->tasks[t]; }

/* Adjacency and ranks exist only after finalize; before it, a task has none. */
int mf_graph_n_succ(const mf_graph *g, mf_task_id t)
{
    return g->finalized ? g->succ_off[t + 1] - g->succ_off[t] : 0;
}
const mf_task_id *mf_graph_succ(const mf_graph *g, mf_task_id t)
{
    return g->finalized ? g->succ + g->succ_off[t] : NULL;
}
int mf_graph_n_pred(const mf_graph *g, mf_task_id t)
{
    return g->finalized ? g->pred_off[t + 1] - g->pred_off[t] : 0;
}
const mf_task_id *mf_graph_pred(const mf_graph *g, mf_task_id t)
{
    return g->finalized ? g->pred + g->pred_off[t] : NULL;
}
double mf_graph_task_cost_ns(const mf_graph *g, mf_task_id t)
{
    return g->finalized ? g->cost_ns[t] : mf_cost_on(&g->lanes[g->tasks[t].lane].model, &g->tasks[t].cost);
}
double mf_graph_rank_ns(const mf_graph *g, mf_task_id t) { return g->finalized ? g->rank_ns[t] : 0; }

int mf_graph_raise_rank(mf_graph *g, mf_task_id t, double rank_ns)
{
    if (!g || t < 0 || t >= g->n_tasks) return -EINVAL;
    if (!g->finalized) return -EPERM;
    if (rank_ns > g->rank_ns[t]) g->rank_ns[t] = rank_ns;
    return 0;
}
