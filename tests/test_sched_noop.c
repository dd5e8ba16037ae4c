/* Noop tasks (mf_graph_set_noop): on random DAGs over a CPU lane and a fake device lane, tasks
 * marked noop never run their fn and never reach their lane (the device sees no work for them),
 * complete with a zero-length span where their last predecessor finished, and still order their
 * successors; marks set by a task fn during the run (as the step engine's route task does) take
 * effect; a failure upstream of a noop task cancels it and its dependents; marks change from run
 * to run with no allocation; a device fn returning MF_TASK_NO_WORK completes without a round trip;
 * the simulator completes noop tasks at their ready time. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/error.h"
#include "sched/graph.h"
#include "sched/sched.h"
#include "sched/sim.h"
#include "sched/timeline.h"
#include "tests/check.h"
#include "tests/sched_fakedev.h"

enum { L_CPU, L_DEV, N_LANES };

typedef struct ctx {
    int n;
    mf_graph *g;
    _Atomic int *runs;
    _Atomic int64_t *order;   /* completion stamp of each task's fn */
    _Atomic int64_t clock;
    char *mark;               /* marks that the marker task sets during the run */
    int marker;               /* task id of the marker (-1: none) */
    int fail;                 /* task whose fn fails (-1: none) */
    int no_work;              /* device fns return MF_TASK_NO_WORK */
} ctx;

typedef struct targ {
    ctx *c;
    int t;
} targ;

static int body(targ *a)
{
    ctx *c = a->c;
    atomic_fetch_add(&c->runs[a->t], 1);
    atomic_store(&c->order[a->t], atomic_fetch_add(&c->clock, 1) + 1);
    if (a->t == c->marker)
        for (int t = a->t + 1; t < c->n; t++) mf_graph_set_noop(c->g, t, c->mark[t]);
    if (a->t == c->fail) return mf_error(-EDOM, "boom %d", a->t);
    return 0;
}

static int cpu_task(void *arg, mf_task_ctx *x)
{
    (void)x;
    return body(arg);
}

static void dev_work(void *arg) { (void)arg; }

static int dev_task(void *arg, mf_task_ctx *x)
{
    targ *a = arg;
    int rc = body(a);
    if (rc) return rc;
    if (a->c->no_work) return MF_TASK_NO_WORK;
    fakedev_enqueue(x->queue, dev_work, NULL);
    return 0;
}

/* Items the fake device's queue q has run, once it is idle (the run's last callback returns
 * before the queue retires its item). */
static long dev_items(fakedev_queue *q)
{
    pthread_mutex_lock(&q->mu);
    while (q->head != q->tail) pthread_cond_wait(&q->cond, &q->mu);
    long n = q->n_run;
    pthread_mutex_unlock(&q->mu);
    return n;
}

static uint64_t rs = 7;
static uint32_t rnd(void)
{
    rs = rs * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(rs >> 33);
}

static mf_graph *make_dag(const mf_lane_desc *lanes, int n, targ *args)
{
    mf_graph *g;
    if (mf_graph_create(lanes, N_LANES, &g)) return NULL;
    for (int t = 0; t < n; t++) {
        int dev = t % 5 == 2;
        char name[32];
        snprintf(name, sizeof name, "t%d", t);
        mf_graph_add_task(g, &(mf_task_desc){.name = name, .lane = dev ? L_DEV : L_CPU, .fn = dev ? dev_task : cpu_task,
                                             .arg = &args[t], .cost = {.time_ns = 1000 + rnd() % 1000},
                                             .place_hint = -1});
        int k = t ? 1 + (int)(rnd() % 3) : 0;
        for (int i = 0; i < k; i++) mf_graph_add_dep(g, t - 1 - (int)(rnd() % (t < 20 ? t : 20)), t);
    }
    if (mf_graph_finalize(g)) {
        mf_graph_destroy(g);
        return NULL;
    }
    return g;
}

static void reset(ctx *c)
{
    for (int t = 0; t < c->n; t++) {
        atomic_store(&c->runs[t], 0);
        atomic_store(&c->order[t], 0);
    }
    atomic_store(&c->clock, 0);
}

/* Every task with predecessors marked noop exactly when want[t]; checks a run against it: noop
 * tasks did not run and have zero-length spans on no worker, the others ran once, and every run
 * task ran after each run predecessor (noop tasks pass the order on). */
static void check_run(mf_sched *s, ctx *c, mf_timeline *tl, const char *want, const char *what)
{
    reset(c);
    int rc = mf_sched_run(s, c->g, &(mf_run_opts){.timeline = tl});
    CHECK(rc == 0, "%s: run: %d %s", what, rc, mf_last_error());
    const mf_task_span *sp = mf_timeline_spans(tl);
    int bad_run = 0, bad_span = 0, bad_order = 0, n_noop = 0;
    for (int t = 0; t < c->n; t++) {
        int noop = want[t] && mf_graph_n_pred(c->g, t) > 0;
        n_noop += noop;
        int r = atomic_load(&c->runs[t]);
        bad_run += noop ? r != 0 : r != 1;
        if (noop) bad_span += sp[t].start_ns != sp[t].end_ns || sp[t].worker != -1 || sp[t].status != 0;
        /* transitive order through noop predecessors: every run ancestor finished first */
        if (!noop)
            for (int i = 0; i < mf_graph_n_pred(c->g, t); i++) {
                int p = mf_graph_pred(c->g, t)[i];
                if (sp[p].end_ns > sp[t].start_ns) bad_order++;
                if (!(want[p] && mf_graph_n_pred(c->g, p) > 0) && atomic_load(&c->order[p]) > atomic_load(&c->order[t]))
                    bad_order++;
            }
    }
    CHECK(!bad_run, "%s: %d tasks ran wrongly (%d noop)", what, bad_run, n_noop);
    CHECK(!bad_span, "%s: %d noop spans are not zero-length on worker -1", what, bad_span);
    CHECK(!bad_order, "%s: %d dependencies out of order", what, bad_order);
    CHECK(n_noop > 0, "%s: no noop task", what);
}

int main(void)
{
    int n = sched_test_tasks(3000);
    fakedev dev;
    fakedev_start(&dev);
    mf_lane_desc lanes[N_LANES] = {
        {.kind = MF_LANE_CPU, .name = "cpu", .concurrency = 2, .numa_node = -1, .model = {.bytes_per_s = 1}},
        {.kind = MF_LANE_DEV_COMPUTE, .name = "dev", .concurrency = 2},
    };
    ctx c = {.n = n, .marker = -1, .fail = -1};
    c.runs = calloc((size_t)n, sizeof *c.runs);
    c.order = calloc((size_t)n, sizeof *c.order);
    c.mark = calloc((size_t)n, 1);
    char *want = calloc((size_t)n, 1);
    targ *args = calloc((size_t)n, sizeof *args);
    for (int t = 0; t < n; t++) args[t] = (targ){&c, t};
    c.g = make_dag(lanes, n, args);
    CHECK(c.g, "graph: %s", mf_last_error());
    mf_sched *s;
    CHECK(mf_sched_create(&(mf_sched_opts){.lanes = lanes, .n_lanes = N_LANES, .dev = &dev.ops}, &s) == 0, "%s",
          mf_last_error());
    mf_timeline *tl;
    CHECK(mf_timeline_create(c.g, &tl) == 0, "%s", mf_last_error());

    /* marks set before the run, changing from run to run */
    for (int rep = 0; rep < 4; rep++) {
        long dev_before = dev_items(&dev.q[1]);
        int dev_noop = 0, dev_total = 0;
        for (int t = 0; t < n; t++) {
            want[t] = (char)(rnd() % 3 == 0);
            mf_graph_set_noop(c.g, t, want[t]);
            if (t % 5 == 2) {
                dev_total++;
                dev_noop += want[t] && mf_graph_n_pred(c.g, t) > 0;
            }
        }
        char what[32];
        snprintf(what, sizeof what, "marks %d", rep);
        check_run(s, &c, tl, want, what);
        long items = dev_items(&dev.q[1]) - dev_before;   /* one work item + one notify per run task */
        CHECK(items == 2L * (dev_total - dev_noop), "%s: the device ran %ld items for %d tasks", what, items,
              dev_total - dev_noop);
    }

    /* marks set during the run by task 0, on its descendants (tasks not yet ready then) */
    for (int t = 0; t < n; t++) mf_graph_set_noop(c.g, t, 0);
    char *desc = calloc((size_t)n + 1, 1);
    desc[0] = 1;
    for (int t = 0; t < n; t++)
        if (desc[t])
            for (int i = 0; i < mf_graph_n_succ(c.g, t); i++) desc[mf_graph_succ(c.g, t)[i]] = 1;
    for (int t = 1; t < n; t++) {
        c.mark[t] = (char)(desc[t] && rnd() % 2);
        want[t] = c.mark[t];
    }
    want[0] = 0;
    c.marker = 0;
    check_run(s, &c, tl, want, "marks set by a task");
    c.marker = -1;

    /* a failure upstream: noop dependents complete as cancelled, the run returns the failure */
    for (int t = 0; t < n; t++) mf_graph_set_noop(c.g, t, want[t]);
    c.fail = 0;
    reset(&c);
    int rc = mf_sched_run(s, c.g, &(mf_run_opts){.timeline = tl});
    CHECK(rc == -EDOM && strstr(mf_last_error(), "boom 0"), "failure: %d %s", rc, mf_last_error());
    int bad = 0;
    for (int t = 1; t < n; t++)
        if (desc[t]) bad += mf_timeline_spans(tl)[t].status != 1 || atomic_load(&c.runs[t]) != 0;
    CHECK(!bad, "failure: %d dependents of the failing task not cancelled", bad);
    c.fail = -1;

    /* MF_TASK_NO_WORK: device tasks run their fn but make no round trip */
    for (int t = 0; t < n; t++) mf_graph_set_noop(c.g, t, 0);
    c.no_work = 1;
    reset(&c);
    long before = dev_items(&dev.q[1]);
    CHECK(mf_sched_run(s, c.g, NULL) == 0, "no work: %s", mf_last_error());
    long after = dev_items(&dev.q[1]);
    CHECK(after == before, "no work: the device ran %ld items", after - before);
    int ran = 0;
    for (int t = 0; t < n; t++) ran += atomic_load(&c.runs[t]) == 1;
    CHECK(ran == n, "no work: %d of %d tasks ran", ran, n);
    c.no_work = 0;

    /* the simulator: a chain a -> b -> c of 1 us tasks with b noop takes 2 us, b at a's end */
    mf_graph *ch;
    mf_lane_desc one = {.kind = MF_LANE_CPU, .name = "cpu", .concurrency = 1, .numa_node = -1};
    CHECK(mf_graph_create(&one, 1, &ch) == 0, "%s", mf_last_error());
    for (int t = 0; t < 3; t++)
        mf_graph_add_task(ch, &(mf_task_desc){.name = "x", .lane = 0, .fn = cpu_task, .arg = &args[t],
                                              .cost = {.time_ns = 1000}, .place_hint = -1});
    mf_graph_add_dep(ch, 0, 1);
    mf_graph_add_dep(ch, 1, 2);
    CHECK(mf_graph_finalize(ch) == 0, "%s", mf_last_error());
    mf_graph_set_noop(ch, 1, 1);
    mf_timeline *tc;
    CHECK(mf_timeline_create(ch, &tc) == 0, "%s", mf_last_error());
    CHECK(mf_sim_run(ch, NULL, tc) == 0, "%s", mf_last_error());
    const mf_task_span *sp = mf_timeline_spans(tc);
    CHECK(sp[1].start_ns == 1000 && sp[1].end_ns == 1000 && sp[2].end_ns == 2000, "sim: b [%lld, %lld], c ends %lld",
          (long long)sp[1].start_ns, (long long)sp[1].end_ns, (long long)sp[2].end_ns);
    mf_timeline_destroy(tc);
    mf_graph_destroy(ch);

    mf_timeline_destroy(tl);
    mf_sched_destroy(s);
    mf_graph_destroy(c.g);
    fakedev_stop(&dev);
    free(desc);
    free(args);
    free(want);
    free(c.mark);
    free(c.order);
    free(c.runs);
    return mf_check_exit("test_sched_noop");
}
