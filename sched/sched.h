/* The executor: runs a finalized graph on real lanes so that disk reads, host-to-device copies,
 * device kernels and host compute overlap. CPU pools (one per NUMA node, workers pinned with
 * hwloc), an IO lane on a real io_uring ring (pread workers when io_uring is refused), and device
 * lanes driven through mf_dev_lane_ops, which device/ implements. Ready tasks are taken in order
 * of upward rank. A failing task cancels its dependents; the run returns the first error, naming
 * the task. External cancellation and a run timeout end a run cleanly. */
#ifndef MF_SCHED_H
#define MF_SCHED_H

#include <stdint.h>

#include "sched/graph.h"
#include "sched/timeline.h"

/* How device lanes reach a device. enqueue runs the task's fn on a submitting thread to put async
 * work on the lane's queue; notify asks the backend to call done(done_arg) once everything
 * enqueued so far on that queue has finished (a stream callback on CUDA, a host thread on the
 * emulated device): no CPU worker spins waiting for a device. A callback that never comes (a
 * faulted device) is bounded by mf_sched_opts.dev_wait_ns. */
typedef struct mf_dev_lane_ops {
    void *ctx;
    /* Opaque queue handle for (device, lane kind), handed to tasks in mf_task_ctx.queue. */
    void *(*queue)(void *ctx, int device, mf_lane_kind kind);
    int (*notify)(void *ctx, void *queue, void (*done)(void *done_arg), void *done_arg);
    /* Optional; used instead of notify when set: done also learns whether the work enqueued on
     * the queue since the previous notification failed (err 0 or a negative code, msg its
     * message), and the task then fails with it. */
    int (*notify_status)(void *ctx, void *queue,
                         void (*done)(void *done_arg, int err, const char *msg), void *done_arg);
} mf_dev_lane_ops;

struct mf_task_ctx {
    int lane;
    int worker;       /* CPU worker index within the lane, or slot */
    int numa_node;
    void *queue;      /* device lanes: the queue to enqueue on */
};

/* Injected IO faults (mf_sched_opts.io_fault_kind, mf_sched_io_fault). */
enum { MF_IO_FAULT_NONE, MF_IO_FAULT_EIO, MF_IO_FAULT_SHORT, MF_IO_FAULT_ENOSPC };

typedef struct mf_sched_opts {
    const mf_lane_desc *lanes;   /* the lane table graphs run on (must match the graphs') */
    int n_lanes;
    int pin_threads;             /* 1: bind CPU workers to cores with hwloc (default 0) */
    /* 1: the IO lane uses pread workers instead of io_uring. Default 0 (io_uring, pread when the
     * kernel refuses it). The moeflow command sets it (through the engine's and the store's
     * options) for MOEFLOW_IO=pread; the library reads no environment variable. */
    int io_force_pread;
    /* Fault injection: MF_IO_FAULT_EIO or MF_IO_FAULT_SHORT arms mf_sched_io_fault(s,
     * io_fault_kind, io_fault_nth) when the scheduler is created. Default MF_IO_FAULT_NONE (0). */
    int io_fault_kind;
    int64_t io_fault_nth;
    const mf_dev_lane_ops *dev;  /* NULL when the graph has no device lanes */
    /* The longest a device task waits for its device's completion callback after its work was
     * enqueued (0: MF_SCHED_DEV_WAIT_NS; < 0: no bound). A faulted device (CUDA calls no host
     * function after a context error) or a lost callback then fails the task with -ETIMEDOUT and
     * a message naming it, stops the run (nothing new starts) and the run returns instead of
     * hanging. That run's state (a few bytes per task of the graph) is then kept for the rest of
     * the process, since the callback may still come late, in any order of teardown. */
    int64_t dev_wait_ns;
    /* The topology workers are placed on: NULL (default) this machine's; else an hwloc synthetic
     * description ("package:2 numa:1 core:2 pu:1": a NUMA node per package) or the path of an
     * hwloc XML file (ending in .xml), taken as this system's (its PU numbers bind real CPUs:
     * for tests). The moeflow command sets it from MOEFLOW_TOPOLOGY; the library reads no
     * environment variable. */
    const char *topology;
} mf_sched_opts;

#define MF_SCHED_DEV_WAIT_NS (60LL * 1000000000LL)

/* An idle CPU worker polls for new work this many times (a relaxed load and a pause each),
 * then sleeps until a push wakes it (sched/lane_cpu.c; `moeflow calibrate` times the loop). */
#define MF_SCHED_SPIN_ROUNDS 2000

typedef struct mf_sched mf_sched;

/* Starts the workers of every lane. CPU lane concurrency 0 = all cores of its node. */
int mf_sched_create(const mf_sched_opts *o, mf_sched **out);
void mf_sched_destroy(mf_sched *s);

typedef struct mf_run_opts {
    int64_t timeout_ns;          /* 0: none */
    mf_timeline *timeline;       /* optional: filled with the run's spans */
} mf_run_opts;

/* Runs g to completion, first error, cancellation or timeout. Returns 0, the first failing task's
 * code (mf_last_error() names the task), -ECANCELED or -ETIMEDOUT. Every started task has
 * finished when it returns. */
int mf_sched_run(mf_sched *s, mf_graph *g, const mf_run_opts *ro);
/* Cancels the run in progress (from any thread); safe to call when none is. */
void mf_sched_cancel(mf_sched *s);

/* Which IO engine the IO lane ended up with: "io_uring" or "pread". */
const char *mf_sched_io_engine(const mf_sched *s);

/* Registers host buffers (n of them, each at most 1 GiB) with the IO lanes' rings so that reads
 * into them use fixed-buffer reads (no per-read page pinning). Call between runs. Replaces an
 * earlier registration. On the pread engine it records nothing and returns 0; a ring that refuses
 * (memlock limit) returns its negative code, logged once, and reads stay correct unregistered. */
int mf_sched_io_register(mf_sched *s, void *const *bufs, const uint64_t *n_bytes, int n);

/* Fault injection: the nth request (read or write) started from now on by s's IO lanes fails: EIO
 * returns -EIO after it; SHORT delivers half of its bytes and then end of file (a write: then no
 * progress, -EIO); ENOSPC returns -ENOSPC (a full disk). nth 0 (or kind MF_IO_FAULT_NONE) disarms.
 * Both engines honour it. Only s counts: no state is process-wide. The moeflow command arms it,
 * through the options, from MOEFLOW_IO_FAULT=eio:N|short:N|enospc:N. Safe between runs and during
 * one (from any thread). */
void mf_sched_io_fault(mf_sched *s, int kind, int64_t nth);

/* Sockets, as the engine splits its workers and the expert store its memory: the NUMA nodes that
 * have cores (one per package on a two-socket Xeon without sub-NUMA clusters), in hwloc's
 * logical order, each with its cores (PUs where hwloc shows no cores) and its OS node number
 * (what memory is bound to). */
#define MF_TOPO_MAX_SOCKETS 8
typedef struct mf_topo_sockets {
    int n;
    int cores[MF_TOPO_MAX_SOCKETS];
    int node[MF_TOPO_MAX_SOCKETS];   /* OS node number (memory binding); -1: none of its own */
    int numa[MF_TOPO_MAX_SOCKETS];   /* hwloc's logical node index (mf_lane_desc.numa_node); -1 */
} mf_topo_sockets;

/* The sockets of `topology` (as mf_sched_opts.topology; NULL: this machine). 0, or a negative
 * code naming the topology that hwloc could not load; a machine whose one node spans every core
 * has one socket. */
int mf_topo_sockets_of(const char *topology, mf_topo_sockets *out);

/* Socket k's share of a routed expert's output rows [*r0, *r1) of n_rows, n_sockets > 1: the
 * rows split in n_sockets parts on 16-row boundaries (the host kernels' row tile, as the step
 * graph's row parts, mf_sg_rows). Every expert's w1/w3 rows (of moe_intermediate_size) and w2 rows
 * (of hidden_size) lie in these shares in each socket's memory (the resident store) and are
 * computed by that socket's workers (the step graph's expert row parts), one copy, never
 * mirrored. n_sockets <= 1: all rows are socket 0's. */
static inline void mf_topo_rows(int64_t n_rows, int n_sockets, int k, int64_t *r0, int64_t *r1)
{
    if (n_sockets <= 1) {
        *r0 = 0;
        *r1 = n_rows;
        return;
    }
    int64_t chunk = ((n_rows + n_sockets - 1) / n_sockets + 15) / 16 * 16, a = k * chunk, b = a + chunk;
    *r0 = a < n_rows ? a : n_rows;
    *r1 = b < n_rows ? b : n_rows;
}

/* Range i of socket k's share of a region bound by mf_topo_bind_shares: bytes [*a, *b) from the
 * region's base; *first != 0 when the range begins its part (its first page is then the share's,
 * wherever in the page it starts). An empty range (*b <= *a) is skipped. */
typedef void (*mf_topo_share_fn)(void *ctx, int k, int64_t i, uint64_t *a, uint64_t *b, int *first);

/* The pages of a share's range [*a, *b) (mf_topo_share_fn): a page belongs to the share holding its
 * first byte, so [up(a), up(b)), or [down(a), up(b)) for a range that begins its part (first). */
static inline void mf_topo_share_pages(uint64_t *a, uint64_t *b, int first, uint64_t page)
{
    *a = first ? *a / page * page : (*a + page - 1) / page * page;
    *b = (*b + page - 1) / page * page;
}

/* The one binding of socket shares to NUMA nodes (the resident store's experts, the model's dense
 * rows): for every socket k < n_sockets, the pages of each of its n_ranges ranges (share()) bound to
 * OS NUMA node node[k] (mf_topo_sockets node) before anything touches them. A page belongs to the
 * share holding its first byte: [a, b) binds pages [up(a), up(b)), or [down(a), up(b)) for a
 * range that begins its part; clipped to n_bytes. A node that does not exist (or node[k] < 0), a
 * topology hwloc cannot load, or a refused binding is a one-line note on stderr unless quiet
 * ("<who>: socket k's share of <what> not bound to NUMA node n (why); first touch"), never an
 * error: those pages stay first touch. Returns the number of shares bound. */
int mf_topo_bind_shares(uint8_t *base, uint64_t n_bytes, int n_sockets, const int *node, int64_t n_ranges,
                        mf_topo_share_fn share, void *ctx, const char *who, const char *what, int quiet);

/* Convenience lane tables: one CPU lane per NUMA node (threads_per_node 0 = all its cores), an IO
 * lane of the given depth. Returns the number of lanes written (<= max). */
int mf_lanes_default(mf_lane_desc *lanes, int max, int threads_per_node, int io_depth);

#endif
