/* The simulator's expert caches (graphs/plan_cache.h): the bookkeeping of device/expert_cache.c
 * (mf_dev_xcache_acquire / _release / the victim rule), without the memory, plus an LRU variant. */
#include "graphs/plan_cache.h"

#include <errno.h>
#include <stdlib.h>

#include "graphs/plan.h"
#include "sched/error.h"

int mf_plan_cache_init(mf_plan_cache *c, int policy, int n_slots, int n_layers, int n_experts)
{
    *c = (mf_plan_cache){.policy = policy, .n_slots = n_slots, .n_items = n_layers * n_experts,
                         .n_experts = n_experts};
    if (n_slots > c->n_items) c->n_slots = n_slots = c->n_items;
    c->slot_of = malloc((size_t)c->n_items * sizeof *c->slot_of);
    c->freq = calloc((size_t)c->n_items, sizeof *c->freq);
    c->item_of = malloc((size_t)n_slots * sizeof *c->item_of);
    c->pins = calloc((size_t)n_slots, sizeof *c->pins);
    c->last = calloc((size_t)n_slots, sizeof *c->last);
    if (!c->slot_of || !c->freq || !c->item_of || !c->pins || !c->last) {
        mf_plan_cache_free(c);
        return mf_error(-ENOMEM, "plan: out of memory for a cache of %d slots", n_slots);
    }
    for (int i = 0; i < c->n_items; i++) c->slot_of[i] = -1;
    for (int i = 0; i < n_slots; i++) c->item_of[i] = -1;
    c->aging_period = 8 * (uint64_t)n_slots;   /* as mf_dev_xcache_new and mf_store_create */
    return 0;
}

void mf_plan_cache_free(mf_plan_cache *c)
{
    free(c->slot_of);
    free(c->freq);
    free(c->item_of);
    free(c->pins);
    free(c->last);
    c->slot_of = c->item_of = c->pins = NULL;
    c->freq = NULL;
    c->last = NULL;
}

int mf_plan_cache_has(const mf_plan_cache *c, int layer, int id)
{
    return c->slot_of[layer * c->n_experts + id] >= 0;
}

/* mf_dev_xcache_victim: a free slot first, else the unpinned slot with the lowest count (oldest
 * among equals); LRU: the oldest unpinned. -1 when all are pinned. */
static int mf_plan_cache_victim(const mf_plan_cache *c)
{
    int best = -1;
    for (int s = 0; s < c->n_slots; s++) {
        if (c->pins[s]) continue;
        if (c->item_of[s] < 0) return s;
        if (best < 0) {
            best = s;
            continue;
        }
        if (c->policy == MF_PLAN_CACHE_LRU) {
            if (c->last[s] < c->last[best]) best = s;
            continue;
        }
        uint32_t fs = c->freq[c->item_of[s]], fb = c->freq[c->item_of[best]];
        if (fs < fb || (fs == fb && c->last[s] < c->last[best])) best = s;
    }
    return best;
}

int mf_plan_cache_acquire(mf_plan_cache *c, int layer, int id, int *hit)
{
    int it = layer * c->n_experts + id, s = c->slot_of[it], h = s >= 0;
    if (!h) {
        s = mf_plan_cache_victim(c);
        if (s < 0) return -ENOSPC;
        if (c->item_of[s] >= 0) {
            c->slot_of[c->item_of[s]] = -1;
            c->evictions++;
        }
        c->item_of[s] = it;
        c->slot_of[it] = s;
        c->misses++;
    } else {
        c->hits++;
    }
    c->pins[s]++;
    c->last[s] = ++c->tick;
    if (c->freq[it] < UINT32_MAX) c->freq[it]++;
    if (c->policy == MF_PLAN_CACHE_LFU && ++c->accesses % c->aging_period == 0)
        for (int i = 0; i < c->n_items; i++) c->freq[i] >>= 1;
    *hit = h;
    return 0;
}

void mf_plan_cache_release(mf_plan_cache *c, int layer, int id)
{
    int s = c->slot_of[layer * c->n_experts + id];
    if (s >= 0 && c->pins[s] > 0) c->pins[s]--;
}
