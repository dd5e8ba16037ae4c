/* The executor's unhappy paths: a failing task (CPU fn, device fn, device notify) cancels exactly
 * its transitive dependents while everything else runs, and the run returns its code with
 * mf_last_error() naming it; cancellation from another thread and a run timeout stop a run (no new
 * task starts, it returns -ECANCELED / -ETIMEDOUT promptly); the scheduler stays usable for many
 * further runs with changing arguments. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sched/clock.h"
#include "sched/error.h"
#include "sched/graph.h"
#include "sched/sched.h"
#include "sched/timeline.h"
#include "tests/check.h"
#include "tests/sched_fakedev.h"

enum { L_CPU, L_DEV, N_LANES };

typedef struct ctx {
    int n;
    _Atomic int *runs;
    _Atomic int64_t *start_ns;
    int fail_a, fail_b;     /* tasks whose fn fails (-1: none) */
    int sleep_us;           /* per task */
} ctx;

typedef struct targ {
    ctx *c;
    int t;
} targ;

static void sleep_us(int us)
{
    struct timespec ts = {us / 1000000, (long)(us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

static int body(targ *a)
{
    ctx *c = a->c;
    atomic_store(&c->start_ns[a->t], mf_now_ns());
    atomic_fetch_add(&c->runs[a->t], 1);
    if (c->sleep_us) sleep_us(c->sleep_us);
    if (a->t == c->fail_a || a->t == c->fail_b) return mf_error(-EDOM - (a->t == c->fail_b), "boom %d", a->t);
    return 0;
}

static int cpu_task(void *arg, mf_task_ctx *x) { return body(arg); }
static void dev_noop(void *arg) { (void)arg; }
static int dev_task(void *arg, mf_task_ctx *x)
{
    int rc = body(arg);
    if (!rc) fakedev_enqueue(x->queue, dev_noop, NULL);
    return rc;
}

static uint64_t rs = 99;
static uint32_t rnd(void)
{
    rs = rs * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(rs >> 33);
}

/* Random DAG of n tasks, every 8th on the device lane. */
static mf_graph *make_dag(const mf_lane_desc *lanes, int n, targ *args)
{
    mf_graph *g;
    if (mf_graph_create(lanes, N_LANES, &g)) return NULL;
    for (int t = 0; t < n; t++) {
        int dev = t % 8 == 3;
        char name[32];
        snprintf(name, sizeof name, "t%d", t);
        mf_graph_add_task(g, &(mf_task_desc){.name = name, .lane = dev ? L_DEV : L_CPU,
                                             .fn = dev ? dev_task : cpu_task, .arg = &args[t],
                                             .cost = {.time_ns = rnd() % 100}, .place_hint = -1});
        int k = t ? (int)(rnd() % 3) : 0;
        for (int i = 0; i < k; i++) mf_graph_add_dep(g, t - 1 - (int)(rnd() % (t < 30 ? t : 30)), t);
    }
    if (mf_graph_finalize(g)) {
        mf_graph_destroy(g);
        return NULL;
    }
    return g;
}

/* Marks the transitive dependents of f (f itself excluded). */
static void descendants(const mf_graph *g, int f, char *mark)
{
    int n = mf_graph_n_tasks(g);
    memset(mark, 0, (size_t)n);
    mark[f] = 2;
    for (int t = f; t < n; t++)   /* ids are a topological order here */
        if (mark[t])
            for (int i = 0; i < mf_graph_n_succ(g, t); i++)
                if (!mark[mf_graph_succ(g, t)[i]]) mark[mf_graph_succ(g, t)[i]] = 1;
}

/* The first task from `from` on `lane` that has dependents. */
static int pick(const mf_graph *g, int from, int lane)
{
    for (int t = from; t < mf_graph_n_tasks(g); t++)
        if (mf_graph_task(g, t)->lane == lane && mf_graph_n_succ(g, t) > 0) return t;
    return from;
}

static void reset(ctx *c)
{
    for (int t = 0; t < c->n; t++) {
        atomic_store(&c->runs[t], 0);
        atomic_store(&c->start_ns[t], 0);
    }
}

typedef struct canceller {
    mf_sched *s;
    int delay_us;
    int64_t done_ns;
} canceller;

static void *cancel_main(void *arg)
{
    canceller *k = arg;
    sleep_us(k->delay_us);
    mf_sched_cancel(k->s);
    k->done_ns = mf_now_ns();
    return NULL;
}

static void check_failure(mf_sched *s, mf_graph *g, ctx *c, mf_timeline *tl, int f, const char *what)
{
    int n = c->n;
    char *mark = malloc((size_t)n);
    descendants(g, f, mark);
    reset(c);
    c->fail_a = f;
    int rc = mf_sched_run(s, g, &(mf_run_opts){.timeline = tl});
    char want[64];
    snprintf(want, sizeof want, "task 't%d': boom %d", f, f);
    CHECK(rc == -EDOM, "%s: run returned %d (%s)", what, rc, mf_last_error());
    CHECK(!strcmp(mf_last_error(), want), "%s: message '%s', want '%s'", what, mf_last_error(), want);
    const mf_task_span *sp = mf_timeline_spans(tl);
    int bad = 0, n_desc = 0;
    for (int t = 0; t < n; t++) {
        int r = atomic_load(&c->runs[t]);
        if (mark[t] == 1) n_desc++, bad += r != 0 || sp[t].status != 1;
        else if (mark[t] == 2) bad += r != 1 || sp[t].status != -EDOM;
        else bad += r != 1 || sp[t].status != 0;
    }
    CHECK(!bad, "%s: %d tasks ran/cancelled wrongly (failing t%d, %d dependents)", what, bad, f, n_desc);
    CHECK(n_desc > 0, "%s: pick a failing task with dependents", what);
    c->fail_a = -1;
    free(mark);
}

int main(void)
{
    int n = sched_test_tasks(5000);
    fakedev dev;
    fakedev_start(&dev);
    mf_lane_desc lanes[N_LANES] = {
        {.kind = MF_LANE_CPU, .name = "cpu", .concurrency = 2, .numa_node = -1},
        {.kind = MF_LANE_DEV_COMPUTE, .name = "dev", .concurrency = 2},
    };
    ctx c = {.n = n, .fail_a = -1, .fail_b = -1};
    c.runs = calloc((size_t)n, sizeof *c.runs);
    c.start_ns = calloc((size_t)n, sizeof *c.start_ns);
    targ *args = calloc((size_t)n, sizeof *args);
    for (int t = 0; t < n; t++) args[t] = (targ){&c, t};
    mf_graph *g = make_dag(lanes, n, args);
    CHECK(g, "graph: %s", mf_last_error());
    mf_sched *s;
    CHECK(mf_sched_create(&(mf_sched_opts){.lanes = lanes, .n_lanes = N_LANES, .dev = &dev.ops}, &s) == 0,
          "%s", mf_last_error());
    mf_timeline *tl;
    CHECK(mf_timeline_create(g, &tl) == 0, "%s", mf_last_error());

    /* Failures: a CPU task early, a device task, a CPU task late. */
    check_failure(s, g, &c, tl, pick(g, 10, L_CPU), "cpu failure");
    check_failure(s, g, &c, tl, pick(g, n / 2, L_DEV), "device failure");
    check_failure(s, g, &c, tl, pick(g, n - 60, L_CPU), "late cpu failure");

    /* Two failing tasks: the run returns one of them, with its own code and name. */
    reset(&c);
    c.fail_a = 20, c.fail_b = 21;
    int rc = mf_sched_run(s, g, NULL);
    char wa[64], wb[64];
    snprintf(wa, sizeof wa, "task 't20': boom 20");
    snprintf(wb, sizeof wb, "task 't21': boom 21");
    CHECK((rc == -EDOM && !strcmp(mf_last_error(), wa)) || (rc == -EDOM - 1 && !strcmp(mf_last_error(), wb)),
          "two failures: %d '%s'", rc, mf_last_error());
    c.fail_a = c.fail_b = -1;

    /* A device notify that fails fails its task. */
    reset(&c);
    dev.q[1].fail_notify = 1;
    rc = mf_sched_run(s, g, NULL);
    CHECK(rc == -EIO && strstr(mf_last_error(), "task 't") && strstr(mf_last_error(), "notify on lane 'dev' failed: "),
          "notify failure: %d '%s'", rc, mf_last_error());
    dev.q[1].fail_notify = 0;

    /* A cancel with no run in progress affects nothing; a clean run follows every failure. */
    mf_sched_cancel(s);
    reset(&c);
    rc = mf_sched_run(s, g, NULL);
    int not_once = 0;
    for (int t = 0; t < n; t++) not_once += atomic_load(&c.runs[t]) != 1;
    CHECK(rc == 0 && !not_once, "clean run after failures: %d (%s), %d not once", rc, mf_last_error(), not_once);

    /* Cancellation from another thread: tasks sleep 1 ms, so the run would take ~n/2 ms. */
    c.sleep_us = 1000;
    for (int round = 0; round < 2; round++) {
        reset(&c);
        canceller k = {.s = s, .delay_us = 20000};
        pthread_t th;
        pthread_create(&th, NULL, cancel_main, &k);
        int64_t t0 = mf_now_ns();
        rc = mf_sched_run(s, g, &(mf_run_opts){.timeline = tl});
        int64_t took = mf_now_ns() - t0;
        pthread_join(th, NULL);
        CHECK(rc == -ECANCELED, "cancel: run returned %d (%s)", rc, mf_last_error());
        CHECK(took < 500000000, "cancel took %.1f ms", took / 1e6);
        int late = 0, ran = 0, twice = 0, bad_status = 0;
        const mf_task_span *sp = mf_timeline_spans(tl);
        for (int t = 0; t < n; t++) {
            int r = atomic_load(&c.runs[t]);
            ran += r;
            twice += r > 1;
            late += r && atomic_load(&c.start_ns[t]) > k.done_ns;
            bad_status += sp[t].status != (r ? 0 : 1);
        }
        /* A worker past its cancellation check when cancel returned may still start one task. */
        CHECK(late <= 3, "cancel: %d tasks started after mf_sched_cancel returned", late);
        CHECK(ran > 0 && ran < n && !twice, "cancel: %d of %d ran, %d twice", ran, n, twice);
        CHECK(!bad_status, "cancel: %d spans with the wrong status", bad_status);
    }

    /* Timeout. */
    reset(&c);
    int64_t t0 = mf_now_ns();
    rc = mf_sched_run(s, g, &(mf_run_opts){.timeout_ns = 30000000});
    int64_t took = mf_now_ns() - t0;
    CHECK(rc == -ETIMEDOUT && strstr(mf_last_error(), "timed out"), "timeout: %d (%s)", rc, mf_last_error());
    CHECK(took >= 30000000 && took < 500000000, "timeout run took %.1f ms", took / 1e6);
    int ran = 0;
    for (int t = 0; t < n; t++) ran += atomic_load(&c.runs[t]);
    CHECK(ran > 0 && ran < n, "timeout: %d of %d ran", ran, n);
    /* A timeout that does not fire. */
    c.sleep_us = 0;
    reset(&c);
    rc = mf_sched_run(s, g, &(mf_run_opts){.timeout_ns = 60000000000LL});
    CHECK(rc == 0, "generous timeout: %d (%s)", rc, mf_last_error());

    /* Many runs of a small graph with changing arguments. */
    mf_graph_destroy(g);
    mf_timeline_destroy(tl);
    int m = 100;
    ctx cs[2] = {{.n = m, .fail_a = -1, .fail_b = -1}, {.n = m, .fail_a = -1, .fail_b = -1}};
    targ *sargs[2];
    for (int v = 0; v < 2; v++) {
        cs[v].runs = calloc((size_t)m, sizeof *cs[v].runs);
        cs[v].start_ns = calloc((size_t)m, sizeof *cs[v].start_ns);
        sargs[v] = calloc((size_t)m, sizeof *sargs[v]);
        for (int t = 0; t < m; t++) sargs[v][t] = (targ){&cs[v], t};
    }
    g = make_dag(lanes, m, sargs[0]);
    int bad_runs = 0, bad_rc = 0;
    int n_runs = sched_test_tasks(2000) / 4;
    for (int r = 0; r < n_runs; r++) {
        int v = r % 2;
        for (int t = 0; t < m; t++) mf_graph_set_arg(g, t, &sargs[v][t]);
        rc = mf_sched_run(s, g, NULL);
        bad_rc += rc != 0;
        for (int t = 0; t < m; t++) bad_runs += atomic_load(&cs[v].runs[t]) != r / 2 + 1;
        bad_runs += atomic_load(&cs[1 - v].runs[0]) != (r + 1) / 2;
    }
    CHECK(!bad_rc && !bad_runs, "reuse: %d failed runs, %d wrong counts over %d runs", bad_rc, bad_runs, n_runs);

    mf_graph_destroy(g);
    mf_sched_destroy(s);
    fakedev_stop(&dev);
    for (int v = 0; v < 2; v++) {
        free(cs[v].runs);
        free(cs[v].start_ns);
        free(sargs[v]);
    }
    free(c.runs);
    free(c.start_ns);
    free(args);
    return mf_check_exit("test_sched_fail");
}
