/* The expert caches of the decode-step simulator (graphs/plan.h): slots of (layer, expert) items
 * with the replacement policy of device/expert_cache.c and host/store.c (LFU with aging: counts
 * kept for absent items too and halved every aging_period accesses; a miss takes a free slot,
 * else evicts the unpinned present item with the lowest count, least recently used among equals),
 * or plain LRU. Bookkeeping only: no memory of the experts. */
#ifndef MF_PLAN_CACHE_H
#define MF_PLAN_CACHE_H

#include <stdint.h>

typedef struct mf_plan_cache {
    int policy;           /* mf_plan_cache_policy */
    int n_slots, n_items, n_experts;
    int32_t *slot_of;     /* item -> slot or -1 */
    int32_t *item_of;     /* slot -> item or -1 */
    int32_t *pins;
    uint32_t *freq;       /* item -> access count */
    uint64_t *last;       /* slot -> tick of last use */
    uint64_t tick, accesses, aging_period;
    uint64_t hits, misses, evictions;
} mf_plan_cache;

/* n_slots (>= 1) slots over n_layers x n_experts items. -ENOMEM. */
int mf_plan_cache_init(mf_plan_cache *c, int policy, int n_slots, int n_layers, int n_experts);
void mf_plan_cache_free(mf_plan_cache *c);
/* 1 when present (no side effects). */
int mf_plan_cache_has(const mf_plan_cache *c, int layer, int id);
/* Makes (layer, id) present and pins it; *hit. -ENOSPC when every slot is pinned. */
int mf_plan_cache_acquire(mf_plan_cache *c, int layer, int id, int *hit);
void mf_plan_cache_release(mf_plan_cache *c, int layer, int id);

#endif
