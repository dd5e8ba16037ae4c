/* The virtual-time simulator (sim.h): a discrete-event run of a finalized graph. Each lane has
 * `concurrency` slots; a ready task waits in its lane's heap (highest upward rank first, lowest id
 * on ties), starts on the lowest free slot, and lasts its lane model's cost rounded to whole ns.
 * All completions at one instant are applied before any task starts, so runs are bit-identical.
 * O((V + E) log V). A CPU lane of concurrency 0 ("all cores") gets the online core count.
 * Priorities are the graph's upward ranks (from its own lane models, as the executor uses them)
 * even when `models` overrides the durations; place hints are ignored (any free slot will do).
 * mf_sim_run_opts adds given task durations, a pool of cores shared by flagged lanes, per-lane
 * concurrency overrides and wake phases: lane l's wake phase is a lane of its own (index
 * n_lanes + l, one slot, in the pool), whose events carry the task's id + n_tasks. */
#include "sched/sim.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <unistd.h>

#include "sched/error.h"
#include "sched/graph_impl.h"
#include "sched/timeline_impl.h"

typedef struct sim_ready {   /* a max-heap of ready tasks of one lane */
    mf_task_id *ids;
    int n;
} sim_ready;

typedef struct sim_event {   /* a running task, keyed by end time */
    int64_t end_ns;
    mf_task_id id;
} sim_event;

typedef struct sim_state {
    const double *rank;
    sim_ready *ready;        /* per lane */
    int **free_slots;        /* per lane: a min-heap of free slot indices (sleeping lanes: a list) */
    int *n_free;
    int64_t **freed_at;      /* sleeping lanes (CPU lanes with a sleep model): when each slot was freed */
    int64_t spin_ns, sleep_wake_ns;
    sim_event *events;       /* min-heap */
    int n_events;
} sim_state;

/* Ready order: higher rank first, then lower id. */
static int ready_before(const sim_state *s, mf_task_id a, mf_task_id b)
{
    if (s->rank[a] != s->rank[b])
        return s->rank[a] > s->rank[b];
    return a < b;
}

static void ready_push(sim_state *s, sim_ready *h, mf_task_id t)
{
    int i = h->n++;
    while (i > 0) {
        int p = (i - 1) / 2;
        if (!ready_before(s, t, h->ids[p]))
            break;
        h->ids[i] = h->ids[p];
        i = p;
    }
    h->ids[i] = t;
}

static mf_task_id ready_pop(sim_state *s, sim_ready *h)
{
    mf_task_id top = h->ids[0], last = h->ids[--h->n];
    int i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= h->n)
            break;
        if (c + 1 < h->n && ready_before(s, h->ids[c + 1], h->ids[c]))
            c++;
        if (!ready_before(s, h->ids[c], last))
            break;
        h->ids[i] = h->ids[c];
        i = c;
    }
    if (h->n)
        h->ids[i] = last;
    return top;
}

static void slot_push(int *h, int *n, int v)
{
    int i = (*n)++;
    while (i > 0 && h[(i - 1) / 2] > v) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = v;
}

static int slot_pop(int *h, int *n)
{
    int top = h[0], last = h[--(*n)], i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= *n)
            break;
        if (c + 1 < *n && h[c + 1] < h[c])
            c++;
        if (h[c] >= last)
            break;
        h[i] = h[c];
        i = c;
    }
    if (*n)
        h[i] = last;
    return top;
}

static int event_before(const sim_event *a, const sim_event *b)
{
    return a->end_ns != b->end_ns ? a->end_ns < b->end_ns : a->id < b->id;
}

static void event_push(sim_state *s, sim_event e)
{
    int i = s->n_events++;
    while (i > 0 && event_before(&e, &s->events[(i - 1) / 2])) {
        s->events[i] = s->events[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    s->events[i] = e;
}

static sim_event event_pop(sim_state *s)
{
    sim_event top = s->events[0], last = s->events[--s->n_events];
    int i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= s->n_events)
            break;
        if (c + 1 < s->n_events && event_before(&s->events[c + 1], &s->events[c]))
            c++;
        if (!event_before(&s->events[c], &last))
            break;
        s->events[i] = s->events[c];
        i = c;
    }
    if (s->n_events)
        s->events[i] = last;
    return top;
}

/* A task's duration on a lane model, in whole ns (the formula of graph.h). */
static int64_t sim_duration_ns(const mf_lane_model *m, const mf_cost *c)
{
    double ns = m->latency_ns + c->time_ns;
    if (m->bytes_per_s > 0)
        ns += c->bytes / m->bytes_per_s * 1e9;
    if (m->flops_per_s > 0)
        ns += c->flops / m->flops_per_s * 1e9;
    if (!(ns > 0))   /* also NaN */
        return 0;
    return ns > 9e18 ? (int64_t)9e18 : llround(ns);
}

int mf_sim_run(const mf_graph *g, const mf_lane_model *models, mf_timeline *tl)
{
    return mf_sim_run_opts(g, &(mf_sim_opts){.models = models}, tl);
}

/* A free slot of lane l: the lowest; on a sleeping lane the most recently freed (a spinning
 * worker takes the task before a sleeping one), lowest on ties, and *start is delayed by the
 * wake-up when that slot is asleep. */
static int sim_slot_take(sim_state *s, int l, int64_t now, int64_t *start)
{
    *start = now;
    if (!s->freed_at || !s->freed_at[l]) return slot_pop(s->free_slots[l], &s->n_free[l]);
    int *f = s->free_slots[l], best = 0;
    const int64_t *at = s->freed_at[l];
    for (int i = 1; i < s->n_free[l]; i++)
        if (at[f[i]] > at[f[best]] || (at[f[i]] == at[f[best]] && f[i] < f[best])) best = i;
    int slot = f[best];
    f[best] = f[--s->n_free[l]];
    if (now - at[slot] > s->spin_ns) *start = now + s->sleep_wake_ns;
    return slot;
}

static void sim_slot_give(sim_state *s, int l, int slot, int64_t now)
{
    if (!s->freed_at || !s->freed_at[l]) {
        slot_push(s->free_slots[l], &s->n_free[l], slot);
        return;
    }
    s->free_slots[l][s->n_free[l]++] = slot;
    s->freed_at[l][slot] = now;
}

/* Starts lane l's best ready task on a free slot (sim_slot_take; the caller checked both
 * exist); on a wake lane (l >= n_lanes) its wake phase, of wake_ns[l - n_lanes]. */
static void sim_start_one(sim_state *s, const mf_graph *g, int l, int64_t now, const int64_t *dur,
                          const int64_t *wake_ns, mf_timeline *tl)
{
    mf_task_id t = ready_pop(s, &s->ready[l]);
    int64_t start;
    int slot = sim_slot_take(s, l, now, &start);
    if (l >= g->n_lanes) {
        event_push(s, (sim_event){now + wake_ns[l - g->n_lanes], t + g->n_tasks});
        return;
    }
    tl->spans[t] = (mf_task_span){start, start + dur[t], slot, 0};
    event_push(s, (sim_event){start + dur[t], t});
}

/* The lane a task that became ready queues on: its wake lane first, where it has a wake phase. */
static int sim_ready_lane(const mf_graph *g, const int64_t *wake_ns, mf_task_id t)
{
    int l = g->tasks[t].lane;
    return wake_ns && wake_ns[l] > 0 ? g->n_lanes + l : l;
}

/* One run of mf_sim_run_opts: the graph, its options and every array the run uses. Virtual lanes
 * (n_vl): the graph's lanes, then with wake phases one wake lane per lane. */
typedef struct sim_run {
    const mf_graph *g;
    const mf_sim_opts *o;
    const mf_lane_model *models;
    const int64_t *wake_ns;
    mf_timeline *tl;
    int n, n_lanes, n_vl, pool;
    int *conc, *on_lane;         /* per virtual lane: slots, tasks queued on it */
    uint8_t *lane_core;          /* per virtual lane: its slots take a core of the pool */
    int64_t *dur;                /* per task */
    int32_t *waiting;            /* per task: unfinished predecessors */
    mf_task_id *ready_store;     /* the lanes' ready heaps, carved */
    mf_task_id *noop_stack;
    sim_state s;
} sim_run;

/* The options' and the graph's checks. 0 or -EINVAL with a message. */
static int sim_check(const mf_graph *g, const mf_sim_opts *o, const mf_timeline *tl)
{
    if (o && o->n_cores < 0)
        return mf_error(-EINVAL, "sim: a core pool of %d cores", o->n_cores);
    if (o && (o->spin_ns < 0 || o->sleep_wake_ns < 0))
        return mf_error(-EINVAL, "sim: spin %lld ns, wake %lld ns (expected >= 0)", (long long)o->spin_ns,
                        (long long)o->sleep_wake_ns);
    if (!g || !tl)
        return mf_error(-EINVAL, "sim: NULL graph or timeline");
    if (!g->finalized)
        return mf_error(-EINVAL, "sim: the graph must be finalized before it is simulated");
    if (tl->g != g || tl->n != g->n_tasks)
        return mf_error(-EINVAL, "sim: the timeline was made for another graph (%d tasks, graph "
                        "has %d)", tl->n, g->n_tasks);
    return 0;
}

/* The run's per-lane and per-task arrays. 0 or -ENOMEM. */
static int sim_alloc(sim_run *r)
{
    int n = r->n, n_vl = r->n_vl;
    r->conc = malloc((size_t)n_vl * sizeof *r->conc);
    r->on_lane = calloc((size_t)n_vl, sizeof *r->on_lane);
    r->lane_core = calloc((size_t)n_vl, 1);
    r->dur = malloc((size_t)n * sizeof *r->dur);
    r->waiting = malloc((size_t)n * sizeof *r->waiting);
    r->ready_store = malloc((size_t)n * (r->wake_ns ? 2 : 1) * sizeof *r->ready_store);
    r->noop_stack = malloc((size_t)n * sizeof *r->noop_stack);
    sim_state *s = &r->s;
    int sleeping = r->o && r->o->sleep_wake_ns > 0;
    s->ready = calloc((size_t)n_vl, sizeof *s->ready);
    s->free_slots = calloc((size_t)n_vl, sizeof *s->free_slots);
    s->n_free = calloc((size_t)n_vl, sizeof *s->n_free);
    if (sleeping) {
        s->freed_at = calloc((size_t)n_vl, sizeof *s->freed_at);
        s->spin_ns = r->o->spin_ns;
        s->sleep_wake_ns = r->o->sleep_wake_ns;
    }
    if (!r->conc || !r->on_lane || !r->lane_core || !r->dur || !r->waiting || !r->ready_store || !r->noop_stack ||
        !s->ready || !s->free_slots || !s->n_free || (sleeping && !s->freed_at))
        return mf_error(-ENOMEM, "sim: out of memory for %d tasks", n);
    return 0;
}

/* Each virtual lane's slots and pool membership, each task's duration and predecessor count;
 * returns the slots of all lanes. */
static int64_t sim_durations(sim_run *r)
{
    const mf_graph *g = r->g;
    const mf_sim_opts *o = r->o;
    long n_cores = sysconf(_SC_NPROCESSORS_ONLN);
    int64_t total_slots = 0;
    for (int l = 0; l < r->n_vl; l++) {
        const mf_lane_desc *ld = &g->lanes[l % r->n_lanes];
        r->conc[l] = l >= r->n_lanes ? 1
                     : o && o->concurrency && o->concurrency[l] > 0 ? o->concurrency[l]
                     : ld->concurrency > 0 ? ld->concurrency
                     : ld->kind == MF_LANE_CPU && n_cores > 0 ? (int)n_cores : 1;
        r->lane_core[l] = r->pool > 0 && (l >= r->n_lanes || o->lane_core[l]);
        total_slots += r->conc[l];
    }
    for (mf_task_id t = 0; t < r->n; t++) {
        const mf_task_desc *d = &g->tasks[t];
        r->on_lane[d->lane]++;
        if (r->wake_ns && r->wake_ns[d->lane] > 0)
            r->on_lane[r->n_lanes + d->lane]++;
        r->dur[t] = o && o->task_ns ? (o->task_ns[t] > 0 ? o->task_ns[t] : 0)
                    : sim_duration_ns(r->models ? &r->models[d->lane] : &g->lanes[d->lane].model, &d->cost);
        r->waiting[t] = g->pred_off[t + 1] - g->pred_off[t];
    }
    return total_slots;
}

/* The event heap, each lane's ready heap and free slots (every slot free, sleeping lanes' slots
 * asleep). 0 or -ENOMEM. */
static int sim_queues(sim_run *r, int64_t total_slots)
{
    sim_state *s = &r->s;
    int64_t n = r->n;
    s->events = malloc((size_t)(total_slots < 2 * n ? total_slots : 2 * n) * sizeof *s->events);
    if (!s->events)
        return mf_error(-ENOMEM, "sim: out of memory");
    for (int l = 0, off = 0; l < r->n_vl; l++) {
        s->ready[l].ids = r->ready_store + off;
        off += r->on_lane[l];
        /* A lane never has more busy slots than tasks. */
        int slots = r->conc[l] < r->on_lane[l] ? r->conc[l] : r->on_lane[l];
        s->free_slots[l] = malloc((size_t)(slots ? slots : 1) * sizeof **s->free_slots);
        if (!s->free_slots[l])
            return mf_error(-ENOMEM, "sim: out of memory");
        for (int k = 0; k < slots; k++)
            slot_push(s->free_slots[l], &s->n_free[l], k);   /* ascending: a heap and a list alike */
        if (s->freed_at && l < r->n_lanes && r->g->lanes[l].kind == MF_LANE_CPU) {
            s->freed_at[l] = malloc((size_t)(slots ? slots : 1) * sizeof **s->freed_at);
            if (!s->freed_at[l])
                return mf_error(-ENOMEM, "sim: out of memory");
            for (int k = 0; k < slots; k++) s->freed_at[l][k] = INT64_MIN / 4;   /* asleep at the start */
        }
    }
    return 0;
}

/* Starts whatever fits at `now`: lanes outside the pool are independent, so their order does not
 * matter; pooled lanes take the free cores best rank first. */
static void sim_start_ready(sim_run *r, int64_t now)
{
    sim_state *s = &r->s;
    for (int l = 0; l < r->n_vl; l++)
        while (!r->lane_core[l] && s->ready[l].n && s->n_free[l])
            sim_start_one(s, r->g, l, now, r->dur, r->wake_ns, r->tl);
    while (r->pool > 0) {
        int best = -1;
        for (int l = 0; l < r->n_vl; l++)
            if (r->lane_core[l] && s->ready[l].n && s->n_free[l] &&
                (best < 0 || ready_before(s, s->ready[l].ids[0], s->ready[best].ids[0])))
                best = l;
        if (best < 0)
            break;
        sim_start_one(s, r->g, best, now, r->dur, r->wake_ns, r->tl);
        r->pool--;
    }
}

/* Event t (a task, or t - n's wake phase) ended at `now`: its slot freed, a woken task queued on
 * its lane, or a finished task's successors released; those marked noop (mf_graph_set_noop)
 * complete at once, as the executor completes them where they become ready, and release theirs.
 * Returns the tasks completed. */
static int sim_complete(sim_run *r, mf_task_id t, int64_t now)
{
    const mf_graph *g = r->g;
    sim_state *s = &r->s;
    if (t >= r->n) {   /* a wake phase ended: the task queues on its lane */
        int wl = r->n_lanes + g->tasks[t - r->n].lane;
        if (r->lane_core[wl])
            r->pool++;
        slot_push(s->free_slots[wl], &s->n_free[wl], 0);
        ready_push(s, &s->ready[wl - r->n_lanes], t - r->n);
        return 0;
    }
    int l = g->tasks[t].lane, done = 1;
    if (r->lane_core[l])
        r->pool++;
    sim_slot_give(s, l, r->tl->spans[t].worker, now);
    int top = 0;
    r->noop_stack[top++] = t;
    while (top) {
        mf_task_id x = r->noop_stack[--top];
        for (int k = g->succ_off[x]; k < g->succ_off[x + 1]; k++) {
            mf_task_id u = g->succ[k];
            if (--r->waiting[u] != 0)
                continue;
            if (mf_graph_noop(g, u)) {
                r->tl->spans[u] = (mf_task_span){now, now, -1, 0};
                done++;
                r->noop_stack[top++] = u;
            } else {
                ready_push(s, &s->ready[sim_ready_lane(g, r->wake_ns, u)], u);
            }
        }
    }
    return done;
}

/* The event loop from time 0: returns the tasks that ran. */
static int sim_events(sim_run *r)
{
    sim_state *s = &r->s;
    for (mf_task_id t = 0; t < r->n; t++)
        if (!r->waiting[t])
            ready_push(s, &s->ready[sim_ready_lane(r->g, r->wake_ns, t)], t);
    int64_t now = 0;
    int n_done = 0;
    for (;;) {
        sim_start_ready(r, now);
        if (!s->n_events)
            break;
        /* Apply every completion at the next instant before starting anything. */
        now = s->events[0].end_ns;
        while (s->n_events && s->events[0].end_ns == now)
            n_done += sim_complete(r, event_pop(s).id, now);
    }
    return n_done;
}

static void sim_run_free(sim_run *r)
{
    sim_state *s = &r->s;
    if (s->free_slots)
        for (int l = 0; l < r->n_vl; l++)
            free(s->free_slots[l]);
    if (s->freed_at)
        for (int l = 0; l < r->n_vl; l++)
            free(s->freed_at[l]);
    free(s->freed_at);
    free(s->free_slots);
    free(s->n_free);
    free(s->ready);
    free(s->events);
    free(r->ready_store);
    free(r->noop_stack);
    free(r->waiting);
    free(r->dur);
    free(r->on_lane);
    free(r->lane_core);
    free(r->conc);
}

int mf_sim_run_opts(const mf_graph *g, const mf_sim_opts *o, mf_timeline *tl)
{
    int rc = sim_check(g, o, tl);
    if (rc)
        return rc;
    sim_run r = {.g = g, .o = o, .models = o ? o->models : NULL, .wake_ns = o ? o->wake_ns : NULL, .tl = tl,
                 .n = g->n_tasks, .n_lanes = g->n_lanes,
                 .pool = o && o->n_cores > 0 && o->lane_core ? o->n_cores : 0, .s = {.rank = g->rank_ns}};
    r.n_vl = r.wake_ns ? 2 * r.n_lanes : r.n_lanes;
    mf_timeline_reset(tl);
    if (r.n == 0)
        return 0;
    rc = sim_alloc(&r);
    if (!rc)
        rc = sim_queues(&r, sim_durations(&r));
    int n_done = rc ? 0 : sim_events(&r);
    if (!rc && n_done != r.n)   /* finalize rejects cycles, so this means a corrupt graph */
        rc = mf_error(-EINVAL, "sim: only %d of %d tasks could run", n_done, r.n);
    sim_run_free(&r);
    return rc;
}
