/* The host expert store and the Engram row gatherer. Experts (packed w1/w2/w3 codes and scales,
 * n_parts tensors each) live in one slab allocated at start, split into equal slots. Resident mode
 * reads every expert in at start (progress, ETA); streamed mode holds a byte budget of slots and
 * reads misses through the IO lane (io_uring, O_DIRECT where allowed, many reads in flight) while
 * the caller computes on experts already present. Engram tables are resident (read at start) or
 * gathered: all rows of a call read in one batch at depth, adjacent rows coalesced.
 *
 * Replacement policy (streamed): LFU with aging, the shared policy of sched/residency.h (the
 * device expert cache runs the same). Every expert carries an access count, kept also while it is
 * not in the store; every aging_period accesses all counts are halved, so old popularity fades. A
 * call counts all its experts' accesses first and pins its hits, then places its misses: a miss
 * takes a free slot, else evicts the unpinned present expert with the lowest count (least
 * recently used among equals). Experts named by the current call are pinned and never evicted
 * until unpinned. A read that fails leaves its slot free: no partially read
 * expert is ever marked present, and the store stays usable.
 *
 * Who issues the reads. The store hands out reads (mf_io_read: extent and destination in its slab
 * or in the caller's staging): mf_store_begin/mf_store_reads for experts, mf_store_gather_reads for
 * Engram rows. An engine puts them on IO tasks of its own graph, on its own IO lane, with the slab
 * registered on that ring (mf_store_io_buffers), and releases the store's private run
 * (mf_store_io_release): one executor per engine. The synchronous calls (mf_store_ensure,
 * mf_store_gather, the start-up loads), used by the oracle and the tools, issue them on a private
 * run of the store's own (one compute worker and an IO lane), made at creation and again when such
 * a call comes after a release. A store is driven from one thread at a time (its compute function
 * runs on the private run's worker while that thread waits), except mf_store_gather_reads and
 * mf_store_gather_copy, which tasks of several items may call at once. */
#ifndef MF_STORE_H
#define MF_STORE_H

#include <stdint.h>

#include "host/safetensors.h"
#include "sched/graph.h"
#include "sched/sched.h"

typedef enum mf_store_mode { MF_STORE_RESIDENT, MF_STORE_STREAMED } mf_store_mode;

typedef struct mf_store_opts {
    mf_store_mode mode;          /* experts */
    mf_store_mode table_mode;    /* Engram tables */
    uint64_t budget_bytes;       /* streamed experts: slab bytes (0: 2 GiB) */
    int io_depth;                /* reads in flight (0: 64) */
    int max_batch;               /* most experts one call names (0: 16) */
    int min_slots;               /* streamed: fewest slots the budget must hold (0: max_batch);
                                  * a call naming more experts than there are slots fails */
    int max_rows;                /* most rows per gather round (0: 1024) */
    int read_window;             /* calls with a compute function: experts whose reads are in
                                  * flight at once, in selection order (0: 2), so that the first
                                  * arrives early and its compute overlaps the others' reads */
    int buffered;                /* 1: no O_DIRECT (page-cache reads) */
    int force_pread;             /* 1: the private run's IO lane uses pread workers (the moeflow
                                  * command sets it for MOEFLOW_IO=pread) */
    int io_fault_kind;           /* MF_IO_FAULT_* armed on the private run (sched/sched.h) */
    int64_t io_fault_nth;        /* ... on its nth read (MOEFLOW_IO_FAULT of the moeflow command) */
    int numa_node;               /* slab placement (hwloc membind); -1: first touch */
    /* > 1, resident mode: every expert split across the sockets' memory by rows, one copy: the
     * rows mf_topo_rows(rows, n_sockets, k) (sched/sched.h) of each of its parts (codes and
     * scales) bound to OS node socket_node[k], page by page (a page straddling a share boundary
     * goes to the later share; numa_node is then unused). A node that does not exist, or a
     * binding the kernel refuses, leaves that region to first touch with one line on stderr
     * naming the node (unless quiet). Streamed mode: the slots are shared by the replacement
     * policy, so the slab is not split (numa_node as above). 0 or 1: one region. */
    int n_sockets;
    int socket_node[MF_TOPO_MAX_SOCKETS];
    int aging_period;            /* accesses between halvings (0: 8 x slots) */
    int quiet;                   /* no progress on stderr */
    /* Called once on the slab when a device will copy from it (cudaHostRegister, mlock);
     * NULL: none. A negative return fails mf_store_create. */
    int (*pin_hook)(void *user, void *p, uint64_t n_bytes);
    void *pin_user;
} mf_store_opts;

/* What the store holds, as tensors of an open checkpoint. */
typedef struct mf_store_layout {
    int n_layers, n_experts, n_parts;
    const mf_st_tensor *const *parts;    /* [n_layers][n_experts][n_parts] */
    int n_tables;
    const mf_st_tensor *const *tables;   /* [n_tables][2]: row codes [rows, ...], scales [rows, ...] */
    /* the number the callers give the first layer and the first table (a pipeline stage's store
     * holds layers [layer0, layer0 + n_layers) and tables [table0, table0 + n_tables)); 0: from 0 */
    int layer0, table0;
} mf_store_layout;

typedef struct mf_store mf_store;

/* Opens the shard files (O_DIRECT where allowed), allocates the slab once, starts the private run
 * and, in resident mode, reads everything in (the slab registered with the private run's ring
 * before its first expert read). Errors name the file/tensor; -ENOSPC when the budget holds fewer
 * slots than max_batch. */
int mf_store_create(const mf_st *st, const mf_store_layout *lay, const mf_store_opts *o,
                    mf_store **out);
void mf_store_destroy(mf_store *s);

/* Makes experts ids[0..n) of `layer` present and pins them, reading misses in one batch at depth.
 * With fn, fn(user, k) runs on the store's compute worker as soon as expert k is present (a task
 * of the same graph), so reads of some experts overlap the compute of others; a non-zero return
 * fails the call. 0 or a negative code naming the expert, tensor and file. n <= max_batch; ids
 * must be distinct. */
typedef int (*mf_store_fn)(void *user, int k);
int mf_store_ensure(mf_store *s, int layer, const int32_t *ids, int n, mf_store_fn fn, void *user);
void mf_store_unpin(mf_store *s, int layer, const int32_t *ids, int n);

/* Part p of a present expert (the bytes of parts[layer][id][p]); NULL when absent. */
const uint8_t *mf_store_part(const mf_store *s, int layer, int id, int part);

/* The same in pieces, for step graphs built elsewhere: begin decides hits and misses and pins;
 * mf_store_reads gives the reads of batch entry k (n = 0 for a hit, at most n_parts) to put on IO
 * tasks of the caller's graph; mf_store_batch_part is where part p of entry k is (a miss: once its
 * reads are done); mf_store_check checks the shards the batch will read (replaced or truncated
 * since open; on failure call end with its code); end marks the read experts present (status 0,
 * they stay pinned) or frees their slots and unpins the batch (status < 0). */
int mf_store_begin(mf_store *s, int layer, const int32_t *ids, int n);
mf_io_read *mf_store_reads(mf_store *s, int k, int *n);
const uint8_t *mf_store_batch_part(const mf_store *s, int k, int part);
int mf_store_check(mf_store *s);
int mf_store_end(mf_store *s, int status);

/* Rows rows[0..n) of Engram table `table`: codes to data (n x row_bytes), scales to scale (n x
 * scale_row_bytes; NULL: codes only). Resident tables: copied from memory (callers on several
 * threads at once are fine). Streamed tables: on the private run, one batch of reads per max_rows
 * rows (mf_store_gather_reads), at depth; one caller at a time. */
int mf_store_gather(mf_store *s, int table, const int64_t *rows, int n, uint8_t *data,
                    uint8_t *scale);

/* The same in pieces, for an engine's IO tasks. mf_store_gather_reads plans the gather of
 * rows[0..n) of `table` into scratch (the caller's, mf_store_gather_bytes(s, n) bytes, 16-byte
 * aligned; it holds the plan and the staging): rows sorted, duplicates read once, runs of
 * consecutive rows one read per tensor (codes, scales), so at most 2n reads, written to
 * reads[0..*n_reads) (max_reads >= 2n); none for a resident table. Once the reads are done,
 * mf_store_gather_copy puts the rows in order into data and scale (NULL: codes only).
 * mf_store_gather_check names a table's shard that was replaced or truncated since open (after a
 * failed read). 0 or -EINVAL naming the table or row. Both may run on several threads at once
 * (distinct scratch); the counters are updated atomically. */
uint64_t mf_store_gather_bytes(const mf_store *s, int n);
int mf_store_gather_reads(mf_store *s, int table, const int64_t *rows, int n, void *scratch,
                          mf_io_read *reads, int max_reads, int *n_reads);
void mf_store_gather_copy(const mf_store *s, const void *scratch, uint8_t *data, uint8_t *scale);
int mf_store_gather_check(mf_store *s, int table);
int mf_store_tables_streamed(const mf_store *s);   /* 1: Engram tables are gathered by reads */

/* For an engine that issues the store's reads on its own IO lane. mf_store_io_buffers writes the
 * buffers the expert reads land in (the slab of a streamed store, in pieces of at most 1 GiB, at
 * most max) for mf_sched_io_register on that lane and returns their count (0: resident, nothing
 * is read into the slab after start). mf_store_io_release ends the store's private run (its
 * ring, its threads) between calls; a later synchronous call starts it again. mf_store_io_fault
 * arms fault injection (sched/sched.h mf_sched_io_fault) on the private run's nth read from now
 * on (the run started later, if released). */
int mf_store_io_buffers(const mf_store *s, void **bufs, uint64_t *n_bytes, int max);
void mf_store_io_release(mf_store *s);
void mf_store_io_fault(mf_store *s, int kind, int64_t nth);

typedef struct mf_store_stats {
    uint64_t hits, misses, evictions, bytes_read;      /* experts */
    uint64_t rows, row_reads, row_bytes_read;          /* gathers (reads after coalescing) */
    int64_t read_wall_ns;                              /* time in runs that read */
    int64_t io_busy_ns, cpu_busy_ns, overlap_ns;       /* ensure runs with fn: IO vs compute */
} mf_store_stats;

/* Counters since creation (total) and since the previous mf_store_step call (step; resets). */
void mf_store_stats_total(const mf_store *s, mf_store_stats *out);
void mf_store_step(mf_store *s, mf_store_stats *step);

/* The socket whose share of an expert's rows holds p (n_sockets > 1, resident: the share of the
 * row of the part p lies in), else -1; how many sockets' shares were bound to their node (the rest
 * are first touch). */
int mf_store_socket_of(const mf_store *s, const void *p);
int mf_store_n_bound(const mf_store *s);

int mf_store_n_slots(const mf_store *s);
int mf_store_max_batch(const mf_store *s);
int mf_store_n_parts(const mf_store *s);
uint64_t mf_store_slot_bytes(const mf_store *s);
uint64_t mf_store_slab_bytes(const mf_store *s);
const char *mf_store_io_engine(const mf_store *s);   /* the private run's (the last one's) */
int mf_store_direct(const mf_store *s);          /* 1: shards read with O_DIRECT */
/* Writes the last ensure run with a compute function as Chrome trace JSON. */
int mf_store_write_trace(const mf_store *s, const char *path);

#endif
