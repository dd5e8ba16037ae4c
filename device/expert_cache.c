/* The device expert cache (device/expert_cache.h): a per-card slab of packed-expert slots with the
 * host store's LFU-with-aging policy, pins while a step computes on a slot, and hit, miss,
 * eviction and byte counters per step and in total. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>

#include "device/expert_cache.h"
#include "sched/error.h"

struct mf_dev_xcache {
    mf_dev *d;
    mf_dev_xcache_opts o;
    uint8_t *slab;
    int n_slots, n_items;
    int32_t *slot_of;     /* item -> slot or -1 */
    int32_t *item_of;     /* slot -> item or -1 */
    int32_t *pins;        /* slot -> pin count */
    uint32_t *freq;       /* item -> access count (kept while absent) */
    uint64_t *last;       /* slot -> tick of last use */
    uint64_t tick, accesses, aging_period;
    mf_dev_xcache_stats total, step;
    pthread_mutex_t mu;
};

int mf_dev_xcache_owner(int n_cards, int layer, int id)
{
    if (n_cards <= 1) return 0;
    return (int)(((int64_t)id + layer) % n_cards);
}

int mf_dev_xcache_new(mf_dev *d, const mf_dev_xcache_opts *o, mf_dev_xcache **out)
{
    *out = NULL;
    if (!d || !o || o->n_layers <= 0 || o->n_experts <= 0 || o->slot_bytes == 0 || o->card < 0 ||
        o->card >= mf_dev_n_cards(d))
        return mf_error(-EINVAL, "expert cache: bad options (card %d of %d, %d layers x %d experts, "
                        "slot %" PRIu64 " bytes)", o ? o->card : -1, d ? mf_dev_n_cards(d) : 0,
                        o ? o->n_layers : 0, o ? o->n_experts : 0, o ? o->slot_bytes : 0);
    int min_slots = o->min_slots > 0 ? o->min_slots : 1;
    int64_t n_items = (int64_t)o->n_layers * o->n_experts;
    if (n_items > INT32_MAX) return mf_error(-EINVAL, "expert cache: too many experts");
    int64_t want = o->budget_bytes ? (int64_t)(o->budget_bytes / o->slot_bytes) : n_items;
    if (want > n_items) want = n_items;
    if (want < min_slots)
        return mf_error(-ENOSPC, "expert cache: card %d: a budget of %" PRIu64 " bytes holds %" PRId64
                        " experts of %" PRIu64 " bytes; at least %d needed (%" PRIu64 " bytes)", o->card,
                        o->budget_bytes, want, o->slot_bytes, min_slots, (uint64_t)min_slots * o->slot_bytes);
    mf_dev_xcache *c = calloc(1, sizeof *c);
    if (!c) return mf_error(-ENOMEM, "expert cache: out of memory");
    c->d = d;
    c->o = *o;
    void *slab = NULL;
    int rc = -ENOMEM;
    /* without a budget: as many slots as the card grants */
    for (int64_t n = want;;) {
        rc = mf_dev_alloc(d, o->card, (size_t)(n * (int64_t)o->slot_bytes), &slab);
        if (!rc) {
            c->n_slots = (int)n;
            break;
        }
        if (rc != -ENOMEM || o->budget_bytes || n == min_slots) break;
        n = n / 2 < min_slots ? min_slots : n / 2;
    }
    if (rc) {
        free(c);
        if (rc == -ENOMEM)
            return mf_error(-ENOSPC, "expert cache: card %d is too small for %d expert(s) of %" PRIu64
                            " bytes (%s)", o->card, min_slots, o->slot_bytes, mf_last_error());
        return rc;
    }
    c->slab = slab;
    c->n_items = (int)n_items;
    c->slot_of = malloc((size_t)n_items * sizeof *c->slot_of);
    c->freq = calloc((size_t)n_items, sizeof *c->freq);
    c->item_of = malloc((size_t)c->n_slots * sizeof *c->item_of);
    c->pins = calloc((size_t)c->n_slots, sizeof *c->pins);
    c->last = calloc((size_t)c->n_slots, sizeof *c->last);
    if (!c->slot_of || !c->freq || !c->item_of || !c->pins || !c->last) {
        mf_dev_xcache_free(c);
        return mf_error(-ENOMEM, "expert cache: out of memory");
    }
    for (int64_t i = 0; i < n_items; i++) c->slot_of[i] = -1;
    for (int i = 0; i < c->n_slots; i++) c->item_of[i] = -1;
    c->aging_period = o->aging_period > 0 ? (uint64_t)o->aging_period : 8 * (uint64_t)c->n_slots;
    pthread_mutex_init(&c->mu, NULL);
    *out = c;
    return 0;
}

void mf_dev_xcache_free(mf_dev_xcache *c)
{
    if (!c) return;
    if (c->slab) mf_dev_free(c->d, c->o.card, c->slab);
    if (c->item_of) pthread_mutex_destroy(&c->mu);
    free(c->slot_of);
    free(c->item_of);
    free(c->pins);
    free(c->freq);
    free(c->last);
    free(c);
}

static int mf_dev_xcache_item(const mf_dev_xcache *c, int layer, int id)
{
    if (layer < 0 || layer >= c->o.n_layers || id < 0 || id >= c->o.n_experts) return -1;
    return layer * c->o.n_experts + id;
}

int mf_dev_xcache_has(const mf_dev_xcache *c, int layer, int id)
{
    int it = mf_dev_xcache_item(c, layer, id);
    if (it < 0) return 0;
    pthread_mutex_lock((pthread_mutex_t *)&c->mu);
    int r = c->slot_of[it] >= 0;
    pthread_mutex_unlock((pthread_mutex_t *)&c->mu);
    return r;
}

/* Free slot first, else the unpinned slot with the lowest count (oldest among equals); -1. */
static int mf_dev_xcache_victim(const mf_dev_xcache *c)
{
    int best = -1;
    for (int s = 0; s < c->n_slots; s++) {
        if (c->pins[s]) continue;
        if (c->item_of[s] < 0) return s;
        if (best < 0) {
            best = s;
            continue;
        }
        uint32_t fs = c->freq[c->item_of[s]], fb = c->freq[c->item_of[best]];
        if (fs < fb || (fs == fb && c->last[s] < c->last[best])) best = s;
    }
    return best;
}

int mf_dev_xcache_acquire(mf_dev_xcache *c, int layer, int id, void **slot, int *hit)
{
    int it = mf_dev_xcache_item(c, layer, id);
    if (it < 0)
        return mf_error(-EINVAL, "expert cache: expert %d of layer %d out of range (%d layers x %d experts)",
                        id, layer, c->o.n_layers, c->o.n_experts);
    pthread_mutex_lock(&c->mu);
    int s = c->slot_of[it], h = s >= 0;
    if (!h) {
        s = mf_dev_xcache_victim(c);
        if (s < 0) {
            pthread_mutex_unlock(&c->mu);
            return mf_error(-ENOSPC, "expert cache: card %d: all %d slots pinned, no room for expert %d of "
                            "layer %d", c->o.card, c->n_slots, id, layer);
        }
        if (c->item_of[s] >= 0) {
            c->slot_of[c->item_of[s]] = -1;
            c->total.evictions++;
            c->step.evictions++;
        }
        c->item_of[s] = it;
        c->slot_of[it] = s;
        c->total.misses++;
        c->step.misses++;
        c->total.bytes_in += c->o.slot_bytes;
        c->step.bytes_in += c->o.slot_bytes;
    } else {
        c->total.hits++;
        c->step.hits++;
    }
    c->pins[s]++;
    c->last[s] = ++c->tick;
    if (c->freq[it] < UINT32_MAX) c->freq[it]++;
    if (++c->accesses % c->aging_period == 0)
        for (int i = 0; i < c->n_items; i++) c->freq[i] >>= 1;
    pthread_mutex_unlock(&c->mu);
    *slot = c->slab + (size_t)s * c->o.slot_bytes;
    *hit = h;
    return 0;
}

void mf_dev_xcache_release(mf_dev_xcache *c, int layer, int id)
{
    int it = mf_dev_xcache_item(c, layer, id);
    if (it < 0) return;
    pthread_mutex_lock(&c->mu);
    int s = c->slot_of[it];
    if (s >= 0 && c->pins[s] > 0) c->pins[s]--;
    pthread_mutex_unlock(&c->mu);
}

void mf_dev_xcache_drop(mf_dev_xcache *c, int layer, int id)
{
    int it = mf_dev_xcache_item(c, layer, id);
    if (it < 0) return;
    pthread_mutex_lock(&c->mu);
    int s = c->slot_of[it];
    if (s >= 0) {
        if (c->pins[s] > 0) c->pins[s]--;
        if (!c->pins[s]) {
            c->item_of[s] = -1;
            c->slot_of[it] = -1;
        }
    }
    pthread_mutex_unlock(&c->mu);
}

void mf_dev_xcache_stats_total(const mf_dev_xcache *c, mf_dev_xcache_stats *out)
{
    pthread_mutex_lock((pthread_mutex_t *)&c->mu);
    *out = c->total;
    pthread_mutex_unlock((pthread_mutex_t *)&c->mu);
}

void mf_dev_xcache_step(mf_dev_xcache *c, mf_dev_xcache_stats *out)
{
    pthread_mutex_lock(&c->mu);
    if (out) *out = c->step;
    c->step = (mf_dev_xcache_stats){0};
    pthread_mutex_unlock(&c->mu);
}

int mf_dev_xcache_n_slots(const mf_dev_xcache *c) { return c->n_slots; }
uint64_t mf_dev_xcache_slot_bytes(const mf_dev_xcache *c) { return c->o.slot_bytes; }
int mf_dev_xcache_card(const mf_dev_xcache *c) { return c->o.card; }
