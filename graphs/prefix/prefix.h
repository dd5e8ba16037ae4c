/* The prefix cache: what a sequence state needs to continue after a prompt prefix, kept so that a
 * repeated prefix (a chat's history, an agent's tool log, a shared system prompt) is computed once.
 * A tree keyed by blocks of token ids below the batcher (graphs/step/batch.h); a node is a block of
 * `block_tokens` positions (or a tail: the last 1..block-1 positions of a sequence, a leaf) and holds
 * what a state at the node's end needs beyond its ancestors': the block's token ids, a reference to
 * the page of every compressed cache that holds the block's entries (pages are shared, reference
 * counted: graphs/ref/ref.h mf_ref_page_*), the packed window KV of its last min(block, window)
 * positions (the window ring at the node's end is the last `sliding_window` positions' rows, from
 * the node and its ancestors) and, at an odd end, the ratio-2 compressors' open group. A restore
 * maps the full pages, copies the partial one (copy on write), the window rows, the open group and
 * the token history into a reset state. Memory is bounded by a byte budget, least recently used
 * leaves evicted first, never one a running sequence maps; a disk tier keeps blocks across restarts
 * (graphs/prefix/prefix_disk.c). docs/prefix.md.
 * Threading: one thread at a time (the batcher's stepping thread) calls everything but
 * mf_prefix_get_stats (any thread). */
#ifndef MF_PREFIX_H
#define MF_PREFIX_H

#include <stdint.h>

#include "graphs/ref/ref.h"

/* Positions a block holds by default (mf_prefix_opts.block_tokens). A power of two dividing
 * MF_LY_PAGE_POSITIONS (256): every page then ends at a block's end, so a block's entries lie in
 * one page and the full pages below a restore point are exactly those of its ancestors that end on
 * a page boundary. 64: the window rows a block keeps cost the same per token for every block up to
 * the window (128 positions on demo and flash41), so a small block costs no memory over a large
 * one; 64 bounds what a hit leaves to recompute to 63 tokens (plus the tail rule) with a quarter
 * of the nodes of 16. */
#define MF_PREFIX_BLOCK 64

typedef struct mf_prefix mf_prefix;
typedef struct mf_prefix_seq mf_prefix_seq;   /* one batcher slot's sequence */

typedef struct mf_prefix_opts {
    const mf_ref *ref;          /* the model the states belong to (required) */
    int block_tokens;           /* 0: MF_PREFIX_BLOCK; else a power of two dividing 256 */
    uint64_t budget_bytes;      /* host memory the cache may hold (> 0) */
    /* The disk tier (NULL: none): a directory of one file per block, written atomically through
     * an IO lane of its own, loaded and checked on a lookup that passes the memory's nodes, evicted
     * (least recently used) past disk_budget_bytes (0: 4 x budget_bytes). */
    const char *dir;
    uint64_t disk_budget_bytes;
    /* The identity of the numbers cached (mf_prefix_key): a disk entry with another key is refused
     * (never used). Required with dir. */
    uint8_t key[16];
    /* the disk tier's IO lane: pread workers instead of io_uring; injected faults (sched/sched.h
     * MF_IO_FAULT_*, the nth request of its lane) */
    int io_force_pread;
    int io_fault_kind;
    int64_t io_fault_nth;
    int quiet;                  /* 1: warnings about skipped disk entries are not printed */
} mf_prefix_opts;

/* The cache. -EINVAL on bad options (block size, budget), -ENOMEM; with a dir, -errno when it cannot
 * be created or read, or its IO lane cannot start. */
int mf_prefix_new(const mf_prefix_opts *o, mf_prefix **out);
/* Frees the cache; every sequence must have ended (mf_prefix_seq_end) or be freed first. */
void mf_prefix_free(mf_prefix *p);
int mf_prefix_block_tokens(const mf_prefix *p);

/* The identity of what a state holds after a prefix, for the disk tier: the model's config, its
 * checkpoint's tensors (the tensor table and a sample of every shard's bytes: another checkpoint of
 * the same shapes differs), the layer options (act_quant, the Engram token map) and `numerics`, the
 * caller's name for its forward ("reference", "scheduled-int8", ...: engines that give different
 * bits must not share entries). 0, or a negative code when the checkpoint cannot be read. */
int mf_prefix_key(const mf_ref *r, const char *numerics, uint8_t key[16]);

/* Bytes the cache holds per cached token of a long sequence with blocks of block_tokens (0: the
 * default): its pages' bytes per token, its token id, and the window rows and node of a block
 * amortized over the block (what `moeflow info` prints). */
double mf_prefix_bytes_per_token(const mf_config *c, int block_tokens);

/* A sequence's hold on the cache (one per batcher slot): the node it maps, the blocks it fills.
 * -ENOMEM. */
int mf_prefix_seq_new(mf_prefix *p, mf_prefix_seq **out);
void mf_prefix_seq_free(mf_prefix_seq *s);

/* The longest cached prefix of prompt[0..n) that leaves at least one token to run (memory, then
 * the disk tier), held for s (its blocks cannot be evicted until mf_prefix_seq_end). Returns the
 * prefix's tokens (0: none) and in *mapped_bytes (may be NULL) the bytes of the full pages a
 * restore maps (what the state does not allocate). A lookup that finds nothing holds nothing. */
int mf_prefix_match(mf_prefix *p, mf_prefix_seq *s, const int32_t *prompt, int n, int64_t *mapped_bytes);
/* Restores the match of s into st, a reset state: maps the full pages, copies the partial page, the
 * window rows, the open groups and the token ids; st is then at the prefix's end and s fills the
 * blocks after it. Returns the tokens restored (0 when the match was empty), or -ENOMEM (st reset,
 * s holds nothing: the request runs from scratch). */
int mf_prefix_restore(mf_prefix *p, mf_prefix_seq *s, mf_ref_state *st);

/* Around a forward that feeds n items to st (its positions st->n_pos .. + n): begin points st's
 * window tap at the blocks s fills; end (ok: the forward succeeded) takes the tap away, inserts the
 * blocks the forward completed and, with tail, the sequence's last partial block (the prompt's
 * end). A block that does not fit the budget (nothing left to evict) ends s's inserting. */
void mf_prefix_step_begin(mf_prefix *p, mf_prefix_seq *s, mf_ref_state *st, int n);
void mf_prefix_step_end(mf_prefix *p, mf_prefix_seq *s, mf_ref_state *st, int ok, int tail);
/* The sequence ends (before st is reset): with ok, its last partial block is inserted as a tail
 * (so the next turn of a chat hits up to the last token fed); s gives up what it holds. st may be
 * NULL (a match that was not restored). */
void mf_prefix_seq_end(mf_prefix *p, mf_prefix_seq *s, mf_ref_state *st, int ok);

typedef struct mf_prefix_stats {
    int64_t lookups, lookup_tokens, hit_tokens, hits;   /* restores (lookups that became sequences),
                                                           their prompt tokens, those restored */
    int64_t nodes, bytes, budget_bytes;                  /* in memory */
    int64_t inserted, evicted, refused;                  /* blocks; refused: no room */
    int64_t disk_files, disk_bytes, disk_budget_bytes;   /* the disk tier */
    int64_t disk_loaded, disk_written, disk_evicted, disk_skipped, disk_failed;   /* skipped: corrupt or
                                                                                     foreign; failed: writes */
} mf_prefix_stats;
void mf_prefix_get_stats(mf_prefix *p, mf_prefix_stats *out);

#endif
