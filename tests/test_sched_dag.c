/* The executor on random DAGs across a CPU lane, the IO lane (io_uring and pread) and three fake
 * device lanes: every task runs exactly once per run and never before its dependencies (per-task
 * counters, done flags, timeline spans), and each task's output -- a hash of its predecessors'
 * outputs and of the bytes its IO predecessors read -- is bit-identical to a sequential reference
 * for 1, 2 and 4 workers and across re-runs with changed arguments. 100k tasks (25k under
 * sanitizers; MOEFLOW_TEST_TASKS overrides). */
#include <fcntl.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sched/error.h"
#include "sched/graph.h"
#include "sched/sched.h"
#include "sched/timeline.h"
#include "tests/check.h"
#include "tests/sched_fakedev.h"

#define BLOCK 64
#define FILE_BLOCKS 4096
#define N_LANES 5
enum { L_CPU, L_IO, L_IN, L_COMP, L_OUT };

typedef struct state {
    int n;
    const mf_graph *g;
    uint64_t seed;
    uint64_t *out;
    uint8_t (*buf)[BLOCK];
    _Atomic int *runs;
    _Atomic int *done;
    _Atomic int bad_order;
    _Atomic int bad_worker;
} state;

typedef struct targ {
    state *st;
    mf_task_id t;
} targ;

static uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    return x ^ (x >> 33);
}

static uint64_t hash_bytes(const uint8_t *p, int n)
{
    uint64_t h = 1469598103934665603ULL;
    for (int i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}

/* The task's output from its predecessors' (shared by executor and reference). */
static uint64_t compute(const mf_graph *g, uint64_t seed, mf_task_id t, const uint64_t *out,
                        uint8_t (*buf)[BLOCK])
{
    uint64_t h = mix(seed ^ (uint64_t)t);
    int np = mf_graph_n_pred(g, t);
    const mf_task_id *p = mf_graph_pred(g, t);
    for (int i = 0; i < np; i++) {
        uint64_t v = mf_graph_task(g, p[i])->lane == L_IO ? hash_bytes(buf[p[i]], BLOCK) : out[p[i]];
        h = mix(h ^ v);
    }
    return h;
}

static void exec(targ *a)
{
    state *st = a->st;
    mf_task_id t = a->t;
    int np = mf_graph_n_pred(st->g, t);
    const mf_task_id *p = mf_graph_pred(st->g, t);
    for (int i = 0; i < np; i++)
        if (mf_graph_task(st->g, p[i])->lane != L_IO &&
            !atomic_load_explicit(&st->done[p[i]], memory_order_acquire))
            atomic_fetch_add(&st->bad_order, 1);
    st->out[t] = compute(st->g, st->seed, t, st->out, st->buf);
    atomic_store_explicit(&st->done[t], 1, memory_order_release);
}

static int cpu_task(void *arg, mf_task_ctx *ctx)
{
    targ *a = arg;
    if (ctx->lane != L_CPU || ctx->worker < 0) atomic_fetch_add(&a->st->bad_worker, 1);
    atomic_fetch_add(&a->st->runs[a->t], 1);
    exec(a);
    return 0;
}

static void dev_exec(void *arg) { exec(arg); }

static int dev_task(void *arg, mf_task_ctx *ctx)
{
    targ *a = arg;
    if (!ctx->queue) atomic_fetch_add(&a->st->bad_worker, 1);
    atomic_fetch_add(&a->st->runs[a->t], 1);
    fakedev_enqueue(ctx->queue, dev_exec, a);
    return 0;
}

static uint64_t rnd_state = 0x1234567;
static uint32_t rnd(void)
{
    rnd_state = rnd_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(rnd_state >> 33);
}

/* Adds n tasks to g: 80% on the CPU lane (a tenth with a place hint), 7% IO reads of a block of fd
 * (reads[v][t], per argument variant v), the rest on the three device lanes; each depends on up to 3
 * earlier ones, mostly within the last 64. The counts of IO, device and hinted tasks go to out[0..2]. */
static void add_tasks(mf_graph *g, int n, int fd, state *st, targ **args, mf_io_read **reads, int out[3])
{
    int n_io = 0, n_dev = 0, n_hint = 0;
    for (int t = 0; t < n; t++) {
        uint32_t r = rnd() % 100;
        int lane = r < 80 ? L_CPU : r < 87 ? L_IO : r < 92 ? L_IN : r < 97 ? L_COMP : L_OUT;
        for (int v = 0; v < 2; v++) {
            args[v][t] = (targ){&st[v], t};
            reads[v][t] = (mf_io_read){.fd = fd, .buf = st[v].buf[t], .n_bytes = BLOCK,
                                       .offset = (uint64_t)((t * 7 + v * 13) % FILE_BLOCKS) * BLOCK};
        }
        int hint = lane == L_CPU && rnd() % 10 == 0 ? (int)(rnd() % 4) : -1;
        char name[32];
        snprintf(name, sizeof name, "t%d", t);
        mf_task_id id = mf_graph_add_task(g, &(mf_task_desc){
            .name = name, .lane = lane,
            .fn = lane == L_IO ? NULL : lane == L_CPU ? cpu_task : dev_task,
            .arg = lane == L_IO ? (void *)&reads[0][t] : (void *)&args[0][t],
            .cost = {.time_ns = 1 + rnd() % 1000}, .place_hint = hint});
        CHECK(id == t, "id %d for %d: %s", id, t, mf_last_error());
        n_io += lane == L_IO;
        n_dev += lane >= L_IN;
        n_hint += hint >= 0;
        int k = t ? (int)(rnd() % 4) : 0;
        for (int i = 0; i < k; i++) {
            int span = rnd() % 8 == 0 ? t : (t < 64 ? t : 64);
            int p = t - 1 - (int)(rnd() % (uint32_t)span);
            CHECK(mf_graph_add_dep(g, p, t) == 0, "%s", mf_last_error());
        }
    }
    out[0] = n_io;
    out[1] = n_dev;
    out[2] = n_hint;
}

/* One run's checks over the timeline tl and the state S of argument variant v: every task ran once
 * with the reference's output (ref[v]), IO buffers hold the file's bytes, no span starts before a
 * predecessor ended, every status is 0, no task ran early or on a bad context. */
static void check_run(const mf_graph *g, int n, mf_timeline *tl, state *S, mf_io_read **reads, uint64_t **ref,
                      int v, const uint8_t *file, int workers, int r)
{
    int bad_runs = 0, bad_out = 0, bad_buf = 0, bad_span = 0, bad_status = 0;
    const mf_task_span *sp = mf_timeline_spans(tl);
    for (int t = 0; t < n; t++) {
        int lane = mf_graph_task(g, t)->lane;
        if (lane == L_IO) {
            bad_buf += memcmp(S->buf[t], file + reads[v][t].offset, BLOCK) != 0;
        } else {
            bad_runs += atomic_load(&S->runs[t]) != 1;
            bad_out += S->out[t] != ref[v][t];
        }
        bad_status += sp[t].status != 0;
        int np = mf_graph_n_pred(g, t);
        const mf_task_id *p = mf_graph_pred(g, t);
        for (int i = 0; i < np; i++) bad_span += sp[p[i]].end_ns > sp[t].start_ns;
        bad_span += sp[t].end_ns < sp[t].start_ns;
    }
    CHECK(!bad_runs, "%d tasks did not run exactly once (workers %d, run %d)", bad_runs,
          workers, r);
    CHECK(!bad_out, "%d outputs differ from the reference (workers %d, run %d)", bad_out,
          workers, r);
    CHECK(!bad_buf, "%d IO buffers differ from the file", bad_buf);
    CHECK(!bad_span, "%d spans start before a predecessor ended", bad_span);
    CHECK(!bad_status, "%d spans without status 0", bad_status);
    CHECK(!atomic_load(&S->bad_order), "%d tasks ran before a predecessor was done",
          atomic_load(&S->bad_order));
    CHECK(!atomic_load(&S->bad_worker), "bad task contexts");
}

int main(void)
{
    int n = sched_test_tasks(100000);
    char path[512];
    const char *tmp = getenv("MOEFLOW_TMP");
    snprintf(path, sizeof path, "%s/sched_dag_%d.bin", tmp ? tmp : "/tmp", (int)getpid());
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    CHECK(fd >= 0, "cannot create %s", path);
    uint8_t *file = malloc((size_t)FILE_BLOCKS * BLOCK);
    for (int i = 0; i < FILE_BLOCKS * BLOCK; i++) file[i] = (uint8_t)(rnd() >> 7);
    CHECK(write(fd, file, (size_t)FILE_BLOCKS * BLOCK) == FILE_BLOCKS * BLOCK, "write %s", path);

    mf_lane_desc lanes[N_LANES] = {
        {.kind = MF_LANE_CPU, .name = "cpu", .concurrency = 1, .numa_node = -1},
        {.kind = MF_LANE_IO, .name = "io", .concurrency = 8, .numa_node = -1},
        {.kind = MF_LANE_DEV_COPY_IN, .name = "dev0.h2d", .concurrency = 2},
        {.kind = MF_LANE_DEV_COMPUTE, .name = "dev0.compute", .concurrency = 4},
        {.kind = MF_LANE_DEV_COPY_OUT, .name = "dev0.d2h", .concurrency = 0},
    };
    mf_graph *g;
    CHECK(mf_graph_create(lanes, N_LANES, &g) == 0, "%s", mf_last_error());
    state st[2];
    targ *args[2];
    mf_io_read *reads[2];
    for (int v = 0; v < 2; v++) {
        st[v] = (state){.n = n, .g = g, .seed = 1000 + (uint64_t)v};
        st[v].out = calloc((size_t)n, sizeof *st[v].out);
        st[v].buf = calloc((size_t)n, BLOCK);
        st[v].runs = calloc((size_t)n, sizeof *st[v].runs);
        st[v].done = calloc((size_t)n, sizeof *st[v].done);
        args[v] = calloc((size_t)n, sizeof *args[v]);
        reads[v] = calloc((size_t)n, sizeof *reads[v]);
    }
    int counts[3];
    add_tasks(g, n, fd, st, args, reads, counts);
    CHECK(mf_graph_finalize(g) == 0, "%s", mf_last_error());

    /* Sequential reference for both argument variants. */
    uint64_t *ref[2];
    for (int v = 0; v < 2; v++) {
        ref[v] = calloc((size_t)n, sizeof *ref[v]);
        uint8_t(*rbuf)[BLOCK] = calloc((size_t)n, BLOCK);
        for (int t = 0; t < n; t++) {
            if (mf_graph_task(g, t)->lane == L_IO)
                memcpy(rbuf[t], file + reads[v][t].offset, BLOCK);
            else
                ref[v][t] = compute(g, st[v].seed, t, ref[v], rbuf);
        }
        free(rbuf);
    }

    fakedev dev;
    fakedev_start(&dev);
    mf_timeline *tl;
    CHECK(mf_timeline_create(g, &tl) == 0, "%s", mf_last_error());
    int worker_counts[3] = {1, 2, 4};
    for (int wi = 0; wi < 3; wi++) {
        lanes[L_CPU].concurrency = worker_counts[wi];
        mf_sched *s;
        int force_pread = wi == 1;
        int rc = mf_sched_create(&(mf_sched_opts){.lanes = lanes, .n_lanes = N_LANES,
                                                  .io_force_pread = force_pread, .dev = &dev.ops},
                                 &s);
        CHECK(rc == 0, "sched create: %s", mf_last_error());
        if (rc) break;
        printf("workers %d, io engine %s\n", worker_counts[wi], mf_sched_io_engine(s));
        if (force_pread) CHECK(!strcmp(mf_sched_io_engine(s), "pread"), "forced pread ignored");
        for (int r = 0; r < 3; r++) {
            int v = (r + wi) % 2;
            state *S = &st[v];
            for (int t = 0; t < n; t++)
                mf_graph_set_arg(g, t, mf_graph_task(g, t)->lane == L_IO ? (void *)&reads[v][t]
                                                                          : (void *)&args[v][t]);
            memset(S->out, 0, (size_t)n * sizeof *S->out);
            memset(S->buf, 0, (size_t)n * BLOCK);
            for (int t = 0; t < n; t++) {
                atomic_store(&S->runs[t], 0);
                atomic_store(&S->done[t], 0);
            }
            rc = mf_sched_run(s, g, &(mf_run_opts){.timeline = tl});
            CHECK(rc == 0, "run: %s", mf_last_error());
            check_run(g, n, tl, S, reads, ref, v, file, worker_counts[wi], r);
        }
        mf_sched_destroy(s);
    }
    printf("%d tasks: %d IO, %d device, %d with a place hint\n", n, counts[0], counts[1], counts[2]);
    mf_timeline_destroy(tl);
    fakedev_stop(&dev);
    mf_graph_destroy(g);
    for (int v = 0; v < 2; v++) {
        free(st[v].out);
        free(st[v].buf);
        free(st[v].runs);
        free(st[v].done);
        free(args[v]);
        free(reads[v]);
        free(ref[v]);
    }
    free(file);
    close(fd);
    unlink(path);
    return mf_check_exit("test_sched_dag");
}
