/* One residency policy for every expert cache: n_items things (a (layer, expert) pair, numbered by
 * the caller) compete for n_slots slots. The host expert store (host/store.c), each card's expert
 * cache (device/expert_cache.c) and the simulator's mirror of both (graphs/sim/plan.c) call it; they
 * own the bytes the slots stand for, this module only decides which item holds which slot.
 *
 * Policies:
 *  - LFU with aging (the default): every item carries an access count, kept while it is absent;
 *    every aging_period accesses all counts are halved, so old popularity fades. A miss takes a
 *    free slot, else evicts the unpinned present item with the lowest count, the least recently
 *    accessed among equals.
 *  - LRU: a miss takes a free slot, else evicts the unpinned present item accessed least recently.
 * Free slots are taken last-freed first (slots 0, 1, 2, ... at the start). A pinned slot is never
 * evicted. An access (mf_resid_touch) is counted apart from the lookup, so a caller may count all
 * accesses of a batch before choosing any victim (the host store) or after each (the caches).
 * A cyclic pass (mf_resid_acquire_ahead) ranks the victims by their group's next use first.
 *
 * Memory: none of its own. mf_resid_bytes says how many bytes the tables take; the caller hands
 * that much (8-byte aligned) to mf_resid_init, which carves the handle and its tables from it.
 * No allocation after that. Threading: none inside; a caller that shares one across threads
 * holds its own lock around every call. */
#ifndef MF_RESIDENCY_H
#define MF_RESIDENCY_H

#include <stddef.h>
#include <stdint.h>

typedef struct mf_resid mf_resid;

typedef enum mf_resid_policy {
    MF_RESID_LFU = 0,   /* LFU with aging, LRU among equal counts */
    MF_RESID_LRU,
} mf_resid_policy;

typedef struct mf_resid_opts {
    mf_resid_policy policy;   /* default (0): LFU */
    int n_items;              /* >= 0: items are 0..n_items-1 */
    int n_slots;              /* >= 0: slots are 0..n_slots-1 (more than n_items is allowed) */
    int aging_period;         /* LFU: accesses between halvings (0: 8 x max(n_slots, 1)) */
} mf_resid_opts;

typedef struct mf_resid_stats {
    uint64_t hits, misses, evictions;
} mf_resid_stats;

/* Bytes mf_resid_init needs for these options; 0 when they are invalid (negative counts, an
 * unknown policy, a negative aging period). */
size_t mf_resid_bytes(const mf_resid_opts *o);
/* Carves the policy from mem[0..n_bytes) (8-byte aligned, at least mf_resid_bytes(o)): every slot
 * free, every count 0. 0; -EINVAL (with a message) for bad options, a short or misaligned block. */
int mf_resid_init(const mf_resid_opts *o, void *mem, size_t n_bytes, mf_resid **out);

/* Counts one access of item: its count (LFU; saturating) and its recency, and every
 * aging_period-th access halves all counts (LFU). Present or absent alike. */
void mf_resid_touch(mf_resid *r, int item);
/* The slot for item. 1: item is present in *slot (a hit, counted). 0: a miss, counted: *slot was
 * free or held the victim, which is evicted (counted) and is absent from now on; the slot now holds
 * item, unpinned, and the caller fills it. -ENOSPC when item is absent and every slot is pinned
 * (nothing changes, nothing counted). Neither pins nor touches. item must be in range (assert). */
int mf_resid_lookup(mf_resid *r, int item, int *slot);
/* mf_resid_lookup, then pins the slot and touches item: 1 hit, 0 miss, -ENOSPC. */
int mf_resid_acquire(mf_resid *r, int item, int *slot);

/* A cyclic pass (the engine's steps: a decode step's routes and a long chunk's prefetch take the
 * layers' experts in layer order, step after step): the items form groups of group_items
 * consecutive items (a layer's experts), used in group order, cyclically. mf_resid_acquire, but a miss without a free slot evicts the
 * unpinned present item whose group is used next farthest ahead of item's own group g (Belady's
 * choice for such a pass): g's own unpinned items first (their next use is the next pass's), then
 * group g - 1's, g - 2's, ... (cyclically), the policy's order among one group's items.
 * The counts and recency are kept as by mf_resid_acquire. group_items > 0 (assert). */
int mf_resid_acquire_ahead(mf_resid *r, int item, int group_items, int *slot);

/* Pins nest: a slot with pins > 0 is never evicted. Unpinning an unpinned slot does nothing. */
void mf_resid_pin(mf_resid *r, int slot);
void mf_resid_unpin(mf_resid *r, int slot);
int mf_resid_pins(const mf_resid *r, int slot);
/* Frees the slot: its item (if any) is absent again, its pins are dropped; counts are kept. For a
 * slot whose fill failed (nothing partially filled may stay present). */
void mf_resid_clear(mf_resid *r, int slot);

/* The slot holding item, or -1; the item in slot, or -1. No side effects. */
int mf_resid_slot(const mf_resid *r, int item);
int mf_resid_item(const mf_resid *r, int slot);
/* The access count of item now (LFU: after aging), for tests and reports. */
uint32_t mf_resid_count(const mf_resid *r, int item);
int mf_resid_n_slots(const mf_resid *r);
int mf_resid_n_items(const mf_resid *r);

/* Hits, misses and evictions since init (or the last mf_resid_stats_reset), and since the last
 * mf_resid_step call, which resets the per-step counters (out may be NULL). */
void mf_resid_stats_total(const mf_resid *r, mf_resid_stats *out);
void mf_resid_step(mf_resid *r, mf_resid_stats *out);
/* Zeroes both counters (a store after its start-up reads); the policy's state stays. */
void mf_resid_stats_reset(mf_resid *r);

#endif
