/* The inside of the executor, shared by sched.c (runs, completion, ready queues) and the lane
 * engines: lane_cpu.c (CPU and pread workers), lane_io.c (io_uring), lane_dev.c (device
 * submitters) and topo.c (hwloc placement). Nothing outside sched/ includes this. */
#ifndef MF_SCHED_IMPL_H
#define MF_SCHED_IMPL_H

#include <hwloc.h>
#include <liburing.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "sched/graph_impl.h"
#include "sched/sched.h"
#include "sched/timeline_impl.h"

#define MF_PEND_POISON 0x80000000u   /* a predecessor failed or was cancelled */
#define MF_PEND_MASK   0x7fffffffu
#define MF_BATCH_MAX   16             /* ready tasks a CPU worker takes under one lock */
#define MF_OWN_MAX    128             /* ready tasks a CPU worker holds that the others cannot see */
#define MF_OUT_MAX     64             /* released successors handed to the lane under one lock */
#define MF_IO_BOUNCE_BYTES (256u << 10)   /* per IO slot: misaligned O_DIRECT reads */
#define MF_IO_MAX_REG  64             /* registered buffers per IO lane */

typedef struct mf_sched mf_sched;
typedef struct mf_lane_rt mf_lane_rt;

/* One thread serving a lane: a CPU worker, a pread worker, the io_uring thread or a device
 * submitter. */
typedef struct mf_worker {
    mf_sched *s;
    mf_lane_rt *lane;
    int index;                    /* within the lane */
    pthread_t thread;
    int started;
    pthread_cond_t cond;          /* sleeps on lane->mu */
    int sleeping;
    int busy;                     /* lane mutex: took a task and has not come back for more */
    uint32_t local_done;          /* completions not yet added to the run's count */
    /* CPU workers: the ready tasks this worker holds that the others cannot see (a batch it took
     * from the lane plus successors it released), keys in descending order in own[own_lo ..
     * own_hi), and released successors waiting to go to the lane together. */
    int own_lo, own_hi, n_out;
    uint64_t own[MF_OWN_MAX];
    mf_task_id out[MF_OUT_MAX];
    _Alignas(64) char pad[1];
} mf_worker;

/* Per-graph, per-lane ready queues: a max-heap of keys, the lane's roots pre-sorted by rank with a
 * cursor, and one heap per worker for tasks with a place_hint. Keys sort by rank, then lower id. */
typedef struct mf_lane_q {
    uint64_t *heap;
    int n_heap;
    uint64_t *roots;              /* root keys without a hint, descending */
    int n_roots, i_roots;
    int n_w;                      /* workers of the lane */
    uint64_t **wheap;             /* [n_workers] */
    int *n_wheap;
} mf_lane_q;

/* Run state of one graph on one scheduler, allocated at its first run and kept in the graph. */
typedef struct mf_grt {
    const mf_sched *owner;
    uint64_t owner_gen;
    int n, n_lanes;
    _Atomic uint32_t *pend;       /* unfinished predecessors, | MF_PEND_POISON */
    uint32_t *pend_init;
    uint64_t *key;
    int16_t *lane;
    int16_t *hint;                /* resolved worker index or -1 */
    mf_lane_q *q;                 /* [n_lanes] */
    /* device completion arguments; state: MF_TOK_IDLE, _INFLIGHT (callback awaited since t_ns)
     * or _ABANDONED (the run gave up waiting: a late callback must not touch the run) */
    struct mf_dev_tok { mf_sched *s; mf_task_id t; _Atomic int state; int64_t t_ns; } *tok;
    struct mf_grt *orphan_next;   /* abandoned run states, kept for the process (sched.c) */
    mf_task_id *hinted_roots;     /* roots with a place hint, pushed to their worker at start */
    int n_hinted_roots;
} mf_grt;

enum mf_engine { MF_ENG_CPU, MF_ENG_PREAD, MF_ENG_URING, MF_ENG_DEV };
enum { MF_TOK_IDLE, MF_TOK_INFLIGHT, MF_TOK_ABANDONED };

struct mf_lane_rt {
    int index;
    mf_lane_desc desc;
    enum mf_engine engine;
    int numa_node;
    pthread_mutex_t mu;
    _Atomic int n_ready;          /* ready tasks in the queues (read without the lock to spin) */
    _Atomic uint64_t top_key;     /* best key in the shared queue, 0 if empty */
    _Atomic uint32_t push_seq;    /* bumped by every push: idle workers watch it */
    /* CPU workers of the lane that found nothing and spin or sleep: a busy worker then hands
     * what it holds to the lane. On its own cache line: read at every task, written rarely. */
    _Alignas(64) _Atomic int n_idle;
    _Alignas(64) int n_sleeping;
    mf_lane_q *q;                 /* the running graph's queues (NULL between runs) */
    /* CPU lanes: workers keep successors they release below the lane's top (sched.c, mf_release)
     * only while the lane has no more workers than hardware threads: a worker that holds them
     * and is preempted would keep them from the others. */
    int stash;
    int exit;
    int n_workers;
    mf_worker *workers;
    hwloc_cpuset_t *bind;         /* [n_workers] when pinning */
    /* io_uring */
    struct io_uring ring;
    int ring_ok;
    int efd;
    int wants_wake;
    struct mf_io_slot *slots;     /* [depth] reads in flight */
    uint64_t efd_buf;
    uint8_t *bounce;              /* [max(depth, pread workers)] x MF_IO_BOUNCE_BYTES, aligned */
    int n_reg;                    /* registered buffers (fixed reads) */
    uint8_t *reg_base[MF_IO_MAX_REG];
    uint64_t reg_bytes[MF_IO_MAX_REG];
    /* device */
    void *queue;
    int inflight, cap;
    _Alignas(64) char pad[1];
};

struct mf_sched {
    int n_lanes;
    mf_lane_rt *lanes;
    const mf_dev_lane_ops *dev;
    hwloc_topology_t topo;
    int pin;
    int io_pread;
    _Atomic int64_t io_fault_left;   /* IO-lane reads until the injected fault; <= 0: disarmed */
    _Atomic int io_fault_kind;       /* MF_IO_FAULT_* (mf_sched_io_fault) */
    uint64_t gen;                 /* identifies this scheduler to graphs' run state */
    const char *io_engine;
    int64_t dev_wait_ns;          /* bound on a device task's completion wait; <= 0: none */
    int n_dev_lanes;

    /* the run in progress */
    mf_graph *g;
    mf_grt *rt;
    mf_task_span *spans;          /* NULL: no timeline */
    int64_t t0_ns;
    _Atomic int stop;             /* 1: cancelled or timed out, start nothing new */
    _Atomic int result;           /* first error, -ECANCELED or -ETIMEDOUT */
    _Atomic int running;
    _Atomic uint32_t n_done;
    _Atomic uint32_t run_n;       /* tasks in the run (kept after it, read by late completions) */
    char err_msg[1024];
    pthread_mutex_t run_mu;
    pthread_cond_t run_cond;
    int finished;
    int in_run;                   /* under run_mu: a run is between start and end */
};

/* A ready-queue key holds the rank's float bits above the inverted task id (sched.c, mf_key). */
static inline mf_task_id mf_key_task(uint64_t k) { return (mf_task_id)(uint32_t)~(uint32_t)k; }

/* sched.c: ready queues and completion. */
/* Takes the best ready task of the lane for worker w (-1: any worker) if its key is above `above`
 * (0: any), else -1. Lane mutex held. */
int mf_q_take(mf_lane_rt *L, int w, uint64_t above);
void mf_q_push(mf_sched *s, mf_task_id t);
/* CPU workers (lane->mu held for give_back and refill). */
void mf_q_give_back(mf_sched *s, mf_lane_rt *L, mf_worker *w, int keep);
int mf_q_refill(mf_sched *s, mf_lane_rt *L, mf_worker *w);
void mf_task_finish(mf_sched *s, mf_task_id t, int status, mf_worker *w);
void mf_task_fail(mf_sched *s, mf_task_id t, int code, const char *msg);
void mf_done_flush(mf_sched *s, mf_worker *w);
void mf_done_add(mf_sched *s, uint32_t n);
/* Whether t must be completed as cancelled instead of run. */
static inline int mf_task_skip(mf_sched *s, mf_task_id t)
{
    return atomic_load_explicit(&s->stop, memory_order_relaxed) ||
           (atomic_load_explicit(&s->rt->pend[t], memory_order_relaxed) & MF_PEND_POISON);
}
static inline int64_t mf_span_now(const mf_sched *s);

/* The best task CPU worker w holds while nothing in its lane's queue outranks it, taken; else -1. */
static inline mf_task_id mf_own_next(mf_worker *w)
{
    if (w->own_lo == w->own_hi ||
        w->own[w->own_lo] < atomic_load_explicit(&w->lane->top_key, memory_order_relaxed))
        return -1;
    mf_task_id t = mf_key_task(w->own[w->own_lo++]);
    if (w->own_lo == w->own_hi) w->own_lo = w->own_hi = 0;
    return t;
}

/* lane engines */
void *mf_cpu_worker_main(void *arg);          /* CPU and pread workers */
int mf_io_uring_start(mf_sched *s, mf_lane_rt *L);
void mf_io_uring_stop(mf_lane_rt *L);
void *mf_io_uring_main(void *arg);
int mf_io_pread(mf_sched *s, mf_task_id t, int worker);
int mf_io_lane_alloc(mf_lane_rt *L);          /* bounce buffers, after the engine is chosen */
void *mf_dev_submit_main(void *arg);
void mf_lane_wake(mf_sched *s, mf_lane_rt *L, int hint);   /* lane->mu held */
void mf_lane_wake_n(mf_sched *s, mf_lane_rt *L, int n);    /* lane->mu held */

/* topo.c */
/* Loads `desc` (mf_sched_opts.topology; NULL: this machine) into *out. 0 or a negative code. */
int mf_topo_load(const char *desc, hwloc_topology_t *out);
int mf_topo_plan(mf_sched *s, mf_lane_rt *L);   /* resolves CPU lane size and pin sets */
int mf_topo_bind(mf_sched *s, mf_lane_rt *L, int w);

#include "sched/clock.h"
static inline int64_t mf_span_now(const mf_sched *s) { return mf_now_ns() - s->t0_ns; }

#endif
