/* Weights mapped from the page cache: the shards of an open checkpoint mapped read-only and shared
 * (MAP_SHARED, PROT_READ), so that the kernel's page cache is the one resident copy of the weights.
 * It outlives the process: a second run on a warm machine maps the same pages and reads nothing
 * from the disk, and every process that maps the same files shares them. There is no copy that
 * could go stale: the page cache belongs to the file (its inode), so a shard rewritten or replaced
 * between runs is read again, and a run killed while filling leaves only some pages cached, which
 * the next run reads in (docs/io.md, "Resident weights that outlive the process").
 *
 * The shards lie in one reservation of address space, each at a 2 MiB-aligned offset, so that a
 * 2 MiB-aligned file offset is a 2 MiB-aligned address: where the filesystem caches large folios
 * (ext4 and xfs on recent kernels) the kernel maps them with 2 MiB entries. An optional private
 * tail of the reservation holds what the caller copies instead (tensors the file does not align
 * for their element type). Filling faults the caller's ranges in with MADV_POPULATE_READ on a few
 * threads at the disk's rate, with a progress bar and ETA; with sockets, each socket's ranges are
 * faulted in by threads bound to that socket's NUMA node, where the page cache then places them.
 * A shard truncated while mapped makes a later access fault (SIGBUS), as with any file mapping:
 * mf_wmap_open checks that every shard still has the size its header was read at. */
#ifndef MF_WMAP_H
#define MF_WMAP_H

#include <stdint.h>

#include "host/safetensors.h"

typedef struct mf_wmap mf_wmap;

/* Maps every shard of st into one reservation (MADV_HUGEPAGE advised; a refusal is ignored) and,
 * with copy_bytes > 0, a private anonymous tail of that many bytes after them. Nothing is read.
 * -ESTALE when a shard no longer has its size at mf_st_open; -ENOMEM or the mmap error naming the
 * shard otherwise. */
int mf_wmap_open(const mf_st *st, uint64_t copy_bytes, mf_wmap **out);
void mf_wmap_close(mf_wmap *w);

uint8_t *mf_wmap_base(const mf_wmap *w);
uint64_t mf_wmap_bytes(const mf_wmap *w);                 /* the whole reservation */
uint64_t mf_wmap_shard_off(const mf_wmap *w, int shard);  /* where shard's byte 0 lies */
uint64_t mf_wmap_copy_off(const mf_wmap *w);              /* where the private tail starts */
/* Tensor t's offset in the reservation (shard offset + file offset). */
uint64_t mf_wmap_tensor_off(const mf_wmap *w, const mf_st_tensor *t);

/* A range of the reservation to fault in, and the socket whose threads do it (-1: any thread). */
typedef struct mf_wmap_range {
    uint64_t off, n_bytes;
    int socket;
} mf_wmap_range;

typedef struct mf_wmap_fill_opts {
    int n_threads;              /* 0: one where more than 1/16 is read from a rotational disk
                                 * (one stream, no seeks), else 4..8 (the online CPUs); with
                                 * sockets, at least one per socket */
    int n_sockets;              /* > 1: socket k's threads bound to OS NUMA node socket_node[k] */
    const int *socket_node;
    const char *topology;       /* hwloc synthetic description or XML file (tests); NULL: this machine */
    const char *label;          /* the progress bar's ("weights" when NULL) */
    int quiet;                  /* no progress, no notes on stderr */
} mf_wmap_fill_opts;

typedef struct mf_wmap_fill_stats {
    uint64_t bytes;             /* the ranges' pages, merged */
    uint64_t cached_bytes;      /* of them, held by the page cache before the fill (mincore) */
    int64_t wall_ns;            /* the fill, the residency check included */
    int n_threads, n_bound;     /* threads used; sockets whose threads were bound to their node */
} mf_wmap_fill_stats;

/* Faults ranges r[0..n) in (page-rounded, sorted, merged where the socket agrees): pages the page
 * cache holds are only mapped, the others read from the shard files; progress with rate and ETA on
 * stderr for what is read (not when quiet). A socket whose node does not exist, or whose binding
 * the kernel refuses, has its ranges faulted in by unbound threads, with one line on stderr. 0 or
 * a negative code naming the shard and offset that could not be read. stats may be NULL. */
int mf_wmap_fill(mf_wmap *w, const mf_wmap_range *r, int n, const mf_wmap_fill_opts *o,
                 mf_wmap_fill_stats *stats);

/* Bytes of [off, off + n_bytes) of the reservation that the page cache holds now. */
uint64_t mf_wmap_cached(const mf_wmap *w, uint64_t off, uint64_t n_bytes);

/* The kernel's MemAvailable and MemTotal (/proc/meminfo), bytes; 0 or -errno. */
int mf_wmap_meminfo(uint64_t *available, uint64_t *total);

/* For `moeflow info --resident`: the bytes of file `path` the page cache holds (mapped and
 * checked with mincore; nothing is read) and its size; mf_wmap_file_evict asks the kernel to drop
 * its cached pages (written back first, then POSIX_FADV_DONTNEED; pages another process maps stay
 * until it unmaps them).
 * 0 or a negative code naming path. */
int mf_wmap_file_cached(const char *path, uint64_t *cached, uint64_t *size);
int mf_wmap_file_evict(const char *path);

#endif
