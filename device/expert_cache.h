/* The device expert cache: per card a slab of device memory split into equal slots, each holding
 * one routed expert as packed on the host (FP4 codes and scales, not an expanded copy), so the
 * engine copies a miss in once and later steps find it on the card. Replacement is LFU with aging,
 * the policy of sched/residency.h that the host expert store (host/store.h) also runs: counts are
 * kept for absent experts too and halved every aging_period accesses; a miss takes a free slot,
 * else evicts the unpinned present expert with the lowest count (least recently used among
 * equals; the engine's steps evict by the next use of the expert's layer first:
 * mf_dev_xcache_acquire_ahead). Which card owns an expert is a policy function
 * (mf_dev_xcache_owner), not a constant.
 * Thread-safe (one lock per cache, around every call into the policy). */
#ifndef MF_EXPERT_CACHE_H
#define MF_EXPERT_CACHE_H

#include <stdint.h>

#include "device/dev.h"

typedef struct mf_dev_xcache mf_dev_xcache;

typedef struct mf_dev_xcache_opts {
    int card;
    int n_layers, n_experts;      /* the experts it may hold: (layer, id) */
    uint64_t slot_bytes;          /* one packed expert (all its parts) */
    uint64_t budget_bytes;        /* device bytes for the slab; 0: every expert, or as many slots
                                   * as the card grants (mf_dev_xcache_fit) */
    int size_items;               /* without a budget, the experts the first ask is for (0: all
                                   * n_layers x n_experts; the engine's cache over the backbone's and
                                   * the draft's experts asks for the backbone's) */
    int min_slots;                /* fewest slots accepted (0: 1) */
    int aging_period;             /* accesses between halvings (0: 8 x slots) */
} mf_dev_xcache_opts;

/* The next ask of a cache without a budget after the card refused n slots: n - n/8 (at least one
 * fewer), not below min_slots (a halving left up to half of it unused: 480 slots of 18.8 MB where
 * 598 fit). */
int64_t mf_dev_xcache_shrink(int64_t n, int64_t min_slots);
/* The slots of a cache without a budget: from `want`, the asks of mf_dev_xcache_shrink until
 * fits(ctx, n) grants one, then halving the gap to the last refused ask until none is left, so the
 * cache holds every slot the card has room for (a step of n/8 alone left up to 1/8 unused: 817
 * slots where 916 fit). fits returns 1 (granted), 0 (refused) or a negative code, which this
 * returns; 0 when min_slots is refused. The engine asks the card (mf_dev_xcache_new), the simulator
 * its free bytes. */
int64_t mf_dev_xcache_fit(int64_t want, int64_t min_slots, int (*fits)(void *ctx, int64_t n), void *ctx);

/* Allocates the slab on the card once. -ENOSPC with a message naming the card, the slot size and
 * the budget when fewer than min_slots slots fit (a card too small for one expert is refused
 * here); -EINVAL for bad options. */
int mf_dev_xcache_new(mf_dev *d, const mf_dev_xcache_opts *o, mf_dev_xcache **out);
void mf_dev_xcache_free(mf_dev_xcache *c);

/* 1 when (layer, id) is present (no side effects: for cost models), else 0. */
int mf_dev_xcache_has(const mf_dev_xcache *c, int layer, int id);

/* Makes (layer, id) hold a slot and pins it: *slot is its device memory (slot_bytes). *hit = 1
 * when it was present; else a slot was taken (free or evicted), counted as a miss with slot_bytes
 * moved, and the caller must copy the expert in before any compute reads it (ordered by the copy
 * stream and an event). -ENOSPC when every slot is pinned; -EINVAL for a bad (layer, id). */
int mf_dev_xcache_acquire(mf_dev_xcache *c, int layer, int id, void **slot, int *hit);
/* mf_dev_xcache_acquire for the engine's steps (a decode step's routes, a long chunk's prefetch:
 * mf_stepgraph.prefetch), which take the layers' experts in layer order: a miss evicts the unpinned
 * expert whose layer is used next farthest ahead of `layer` (cyclically: layer + 1, ...,
 * n_layers - 1, then the next step's 0..layer; the layers just passed go first, `layer`'s own
 * unpinned experts before them), LFU with aging among equals (mf_resid_acquire_ahead), so the
 * experts of the layers still to come this pass stay and hit (plain LFU evicts every expert just
 * before its next use once a step uses most of every layer's experts). The warm fill takes
 * mf_dev_xcache_acquire. */
int mf_dev_xcache_acquire_ahead(mf_dev_xcache *c, int layer, int id, void **slot, int *hit);
/* Unpins (after the compute that read the slot has finished). */
void mf_dev_xcache_release(mf_dev_xcache *c, int layer, int id);
/* Forgets (layer, id) and unpins it: its copy in failed, so its slot holds nothing usable. */
void mf_dev_xcache_drop(mf_dev_xcache *c, int layer, int id);

typedef struct mf_dev_xcache_stats {
    uint64_t hits, misses, evictions, bytes_in;
} mf_dev_xcache_stats;
/* Counters since creation, and since the previous mf_dev_xcache_step call (which resets them). */
void mf_dev_xcache_stats_total(const mf_dev_xcache *c, mf_dev_xcache_stats *out);
void mf_dev_xcache_step(mf_dev_xcache *c, mf_dev_xcache_stats *out);
/* Zeroes both counters (after a fill, whose copies are not the decode's misses); what the cache
 * holds and the policy's access counts stay. */
void mf_dev_xcache_stats_reset(mf_dev_xcache *c);

int mf_dev_xcache_n_slots(const mf_dev_xcache *c);
uint64_t mf_dev_xcache_slot_bytes(const mf_dev_xcache *c);
int mf_dev_xcache_card(const mf_dev_xcache *c);

/* Expert parallelism: the card that owns expert id of `layer` among n_cards. The policy spreads
 * each layer's experts round-robin, rotated by layer so that expert 0 of every layer does not
 * land on card 0. */
int mf_dev_xcache_owner(int n_cards, int layer, int id);

/* How many experts of layers [layer0, layer0 + n_layers), n_experts each, card `card` of n_cards
 * owns (mf_dev_xcache_owner): the slots that hold all of them. */
int mf_dev_xcache_owned(int n_cards, int card, int layer0, int n_layers, int n_experts);

/* Warming (the fill before the first step, `--dev-cache-fill`): which experts card `card` of
 * n_cards takes, in fill order, written to items[] as layer x n_experts + id; returns how many
 * (at most n_slots and the experts the card owns), -ENOMEM. Only experts the card owns
 * (mf_dev_xcache_owner) are taken: placement looks for an expert on its owner only. Order: by
 * counts (n_layers x n_experts accesses, e.g. a recorded routing trace's; NULL: all equal), the
 * most counted first; among equals spread evenly over the layers: every layer's first owned
 * expert (lowest id), then every layer's second, and so on, so a partial fill gives each layer
 * the same share. One home for the engine (graphs/step/step.c) and the simulator
 * (graphs/sim/plan.c); items needs room for n_layers x n_experts. */
int mf_dev_xcache_fill_plan(int n_cards, int card, int n_layers, int n_experts, const uint32_t *counts,
                            int n_slots, int32_t *items);

#endif
