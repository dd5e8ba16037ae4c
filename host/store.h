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
 * expert is ever marked present, and the store stays usable. A store is driven from one thread at
 * a time (its compute function runs on the store's own worker while that thread waits). */
#ifndef MF_STORE_H
#define MF_STORE_H

#include <stdint.h>

#include "host/safetensors.h"
#include "sched/graph.h"

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
    int force_pread;             /* 1: the pread engine (also mf_sched_io_defaults(1): MOEFLOW_IO=pread of the moeflow command) */
    int numa_node;               /* slab placement (hwloc membind); -1: first touch */
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
} mf_store_layout;

typedef struct mf_store mf_store;

/* Opens the shard files (O_DIRECT where allowed), allocates the slab once, registers it with the
 * IO ring and, in resident mode, reads everything in. Errors name the file/tensor; -ENOSPC when
 * the budget holds fewer slots than max_batch. */
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
 * scale_row_bytes). Streamed tables: one batch of reads per max_rows rows, sorted, duplicates
 * read once, adjacent rows coalesced. */
int mf_store_gather(mf_store *s, int table, const int64_t *rows, int n, uint8_t *data,
                    uint8_t *scale);

typedef struct mf_store_stats {
    uint64_t hits, misses, evictions, bytes_read;      /* experts */
    uint64_t rows, row_reads, row_bytes_read;          /* gathers (reads after coalescing) */
    int64_t read_wall_ns;                              /* time in runs that read */
    int64_t io_busy_ns, cpu_busy_ns, overlap_ns;       /* ensure runs with fn: IO vs compute */
} mf_store_stats;

/* Counters since creation (total) and since the previous mf_store_step call (step; resets). */
void mf_store_stats_total(const mf_store *s, mf_store_stats *out);
void mf_store_step(mf_store *s, mf_store_stats *step);

int mf_store_n_slots(const mf_store *s);
int mf_store_max_batch(const mf_store *s);
int mf_store_n_parts(const mf_store *s);
uint64_t mf_store_slot_bytes(const mf_store *s);
uint64_t mf_store_slab_bytes(const mf_store *s);
const char *mf_store_io_engine(const mf_store *s);
int mf_store_direct(const mf_store *s);          /* 1: shards read with O_DIRECT */
/* Writes the last ensure run with a compute function as Chrome trace JSON. */
int mf_store_write_trace(const mf_store *s, const char *path);

#endif
