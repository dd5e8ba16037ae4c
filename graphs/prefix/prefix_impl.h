/* The prefix cache's insides shared by its files (graphs/prefix/prefix.h): the tree's nodes, the
 * cache, a sequence's hold, the hash that names prefixes, and the disk tier's entry points
 * (graphs/prefix/prefix_disk.c). */
#ifndef MF_PREFIX_IMPL_H
#define MF_PREFIX_IMPL_H

#include <pthread.h>
#include <stdint.h>

#include "graphs/prefix/prefix.h"

/* A block of the tree (or a tail: fewer positions than a block, a leaf; or the root: none). */
typedef struct mf_pfx_node {
    struct mf_pfx_node *parent, *child, *sib;   /* children: a list */
    struct mf_pfx_node *lru_prev, *lru_next;    /* every node but the root, least recently used first */
    int64_t end;          /* positions [0, end) are the prefix up to this node's end */
    int len;              /* the node's positions: [end - len, end) */
    int n_rows;           /* window rows kept: positions [end - n_rows, end) */
    int n_lock;           /* sequences that map it (or fill blocks below it) */
    int32_t *toks;        /* len token ids */
    uint8_t *rows;        /* n_rows x rowset bytes (a pending block: block x rowset) */
    uint8_t **page;       /* n_src: per KV source, the page that holds the node's entries (a holder) */
    float *pend;          /* NULL, or n_r2 x 2 x head_dim: the ratio-2 sources' open group (odd end) */
    uint8_t hkey[16];     /* the prefix's name (mf_pfx_hash of the parent's and the tokens) */
    int64_t bytes;        /* what it holds besides its pages */
    int linked;           /* in the tree (a pending block is not) */
} mf_pfx_node;

typedef struct mf_pfx_disk mf_pfx_disk;

struct mf_prefix {
    mf_prefix_opts o;
    const mf_config *c;
    int B, W, n_src, n_r2;
    int src[MF_CONFIG_MAX_LAYERS];   /* KV-source layers, in order */
    int64_t rb, rowset;              /* a window slot's bytes; n_layers of them (a position's rows) */
    int64_t bytes;                   /* nodes and the pages they keep (written under mu) */
    mf_pfx_node root;
    mf_pfx_node *lru_head, *lru_tail;
    mf_pfx_disk *disk;
    pthread_mutex_t mu;              /* the stats */
    mf_prefix_stats st;
};

struct mf_prefix_seq {
    mf_prefix *p;
    mf_pfx_node *lock;      /* the node it holds (matched, restored or last inserted), or NULL */
    mf_pfx_node *parent;    /* where its next block goes (NULL: it inserts nothing) */
    int64_t blk0;           /* the first position of pend[0] */
    mf_pfx_node **pend;     /* the blocks it fills: pend[i] holds positions [blk0 + i * B, + B) */
    int n_pend, cap_pend;
    uint8_t **tap;          /* the window tap (graphs/layers/layers.h mf_ref_state.tap) */
    int64_t cap_tap;
    mf_pfx_node **path;
    int cap_path;
    int n_prompt;           /* the prompt of the last lookup (counted by the restore) */
};

/* The 128-bit names: in, then n token ids (or bytes) into out (may be in). */
void mf_pfx_hash(const uint8_t in[16], const int32_t *toks, int64_t n, uint8_t out[16]);
void mf_pfx_hash_bytes(const uint8_t in[16], const void *bytes, int64_t n, uint8_t out[16]);

/* Node lifetime and the tree (prefix.c): a node of len positions with room for n_rows rows; the
 * bytes it holds; linking under a parent (the pages it holds kept and counted); freeing. */
mf_pfx_node *mf_pfx_node_new(mf_prefix *p, int len, int n_rows);
void mf_pfx_node_free(mf_prefix *p, mf_pfx_node *x);
/* Makes room for x (evicting least recently used leaves nobody maps), then links it under parent
 * and keeps its pages. 0, or -ENOSPC when the budget cannot hold it (x is then the caller's). */
int mf_pfx_link(mf_prefix *p, mf_pfx_node *parent, mf_pfx_node *x);
void mf_pfx_stat(mf_prefix *p, int64_t *field, int64_t delta);

/* The disk tier (prefix_disk.c). open scans dir (creating it), starts its writer and its IO
 * lane; close finishes the writes queued. write queues x's entry (x linked: its pages hold its
 * entries). load finds the entry of the block (or tail) toks[0..len) under parent, reads and checks
 * it, and returns a node built from it (not linked: the caller links it), NULL when there is none
 * or it is refused (then with a warning). */
int mf_pfx_disk_open(mf_prefix *p, mf_pfx_disk **out);
void mf_pfx_disk_close(mf_pfx_disk *d);
void mf_pfx_disk_write(mf_prefix *p, const mf_pfx_node *x);
mf_pfx_node *mf_pfx_disk_load(mf_prefix *p, mf_pfx_node *parent, const int32_t *toks, int len);
/* Whether the disk holds an entry named key (a lookup cheaper than load). */
int mf_pfx_disk_has(mf_pfx_disk *d, const uint8_t key[16]);
void mf_pfx_disk_stats(mf_pfx_disk *d, mf_prefix_stats *st);

#endif
