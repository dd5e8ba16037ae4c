/* The device expert cache (device/expert_cache.h): a per-card slab of packed-expert slots whose
 * residency (LFU with aging, pins while a step computes on a slot, hit, miss and eviction counters
 * per step and in total) is the shared policy of sched/residency.h, behind this cache's lock. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>

#include "device/expert_cache.h"
#include "sched/error.h"
#include "sched/residency.h"

struct mf_dev_xcache {
    mf_dev *d;
    mf_dev_xcache_opts o;
    uint8_t *slab;
    int n_slots;
    mf_resid *res;        /* item (layer x n_experts + id) -> slot; in the same allocation */
    pthread_mutex_t mu;
};

int mf_dev_xcache_owner(int n_cards, int layer, int id)
{
    if (n_cards <= 1) return 0;
    return (int)(((int64_t)id + layer) % n_cards);
}

int mf_dev_xcache_owned(int n_cards, int card, int layer0, int n_layers, int n_experts)
{
    int n = 0;
    for (int L = layer0; L < layer0 + n_layers; L++)
        for (int id = 0; id < n_experts; id++) n += mf_dev_xcache_owner(n_cards, L, id) == card;
    return n;
}

int64_t mf_dev_xcache_shrink(int64_t n, int64_t min_slots)
{
    int64_t m = n - (n / 8 > 1 ? n / 8 : 1);
    return m < min_slots ? min_slots : m;
}

int64_t mf_dev_xcache_fit(int64_t want, int64_t min_slots, int (*fits)(void *ctx, int64_t n), void *ctx)
{
    int64_t n = want, refused = 0;
    for (;;) {
        int ok = fits(ctx, n);
        if (ok < 0) return ok;
        if (ok) break;
        if (n <= min_slots) return 0;
        refused = n;
        n = mf_dev_xcache_shrink(n, min_slots);
    }
    while (refused - n > 1) {   /* n granted, refused not: halve the gap */
        int64_t mid = n + (refused - n) / 2;
        int ok = fits(ctx, mid);
        if (ok < 0) return ok;
        if (ok) n = mid;
        else refused = mid;
    }
    return n;
}

/* mf_dev_xcache_fit's ask of a card: an allocation of n slots, freed at once. */
typedef struct xc_ask {
    mf_dev *d;
    int card;
    uint64_t slot_bytes;
} xc_ask;

static int xc_grants(void *ctx, int64_t n)
{
    xc_ask *a = ctx;
    void *p = NULL;
    int rc = mf_dev_alloc(a->d, a->card, (size_t)(n * (int64_t)a->slot_bytes), &p);
    if (rc == -ENOMEM) return 0;
    if (rc) return rc;
    mf_dev_free(a->d, a->card, p);
    return 1;
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
    int64_t want = o->budget_bytes ? (int64_t)(o->budget_bytes / o->slot_bytes) : o->size_items > 0 ? o->size_items : n_items;
    if (want > n_items) want = n_items;
    if (want < min_slots)
        return mf_error(-ENOSPC, "expert cache: card %d: a budget of %" PRIu64 " bytes holds %" PRId64
                        " experts of %" PRIu64 " bytes; at least %d needed (%" PRIu64 " bytes)", o->card,
                        o->budget_bytes, want, o->slot_bytes, min_slots, (uint64_t)min_slots * o->slot_bytes);
    void *slab = NULL;
    int rc = 0;
    /* without a budget: as many slots as the card grants */
    int n_slots = 0;
    if (!o->budget_bytes) {
        xc_ask a = {d, o->card, o->slot_bytes};
        int64_t n = mf_dev_xcache_fit(want, min_slots, xc_grants, &a);
        if (n < 0) return (int)n;
        want = n ? n : min_slots;
    }
    rc = mf_dev_alloc(d, o->card, (size_t)(want * (int64_t)o->slot_bytes), &slab);
    if (!rc) n_slots = (int)want;
    if (rc) {
        if (rc == -ENOMEM)
            return mf_error(-ENOSPC, "expert cache: card %d is too small for %d expert(s) of %" PRIu64
                            " bytes (%s)", o->card, min_slots, o->slot_bytes, mf_last_error());
        return rc;
    }
    /* the handle and the policy's tables in one allocation */
    mf_resid_opts ro = {.policy = MF_RESID_LFU, .n_items = (int)n_items, .n_slots = n_slots,
                        .aging_period = o->aging_period > 0 ? o->aging_period : 0};
    size_t head = (sizeof(mf_dev_xcache) + 63) / 64 * 64, res_bytes = mf_resid_bytes(&ro);
    mf_dev_xcache *c = calloc(1, head + res_bytes);
    if (!c) {
        mf_dev_free(d, o->card, slab);
        return mf_error(-ENOMEM, "expert cache: out of memory for %d slots over %" PRId64 " experts",
                        n_slots, n_items);
    }
    c->d = d;
    c->o = *o;
    c->slab = slab;
    c->n_slots = n_slots;
    if ((rc = mf_resid_init(&ro, (uint8_t *)c + head, res_bytes, &c->res))) {
        mf_dev_free(d, o->card, slab);
        free(c);
        return rc;
    }
    pthread_mutex_init(&c->mu, NULL);
    *out = c;
    return 0;
}

void mf_dev_xcache_free(mf_dev_xcache *c)
{
    if (!c) return;
    if (c->slab) mf_dev_free(c->d, c->o.card, c->slab);
    pthread_mutex_destroy(&c->mu);
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
    int r = mf_resid_slot(c->res, it) >= 0;
    pthread_mutex_unlock((pthread_mutex_t *)&c->mu);
    return r;
}

/* ahead: a long chunk's pass (mf_resid_acquire_ahead over the layers' groups of n_experts) */
static int mf_dev_xcache_acquire_in(mf_dev_xcache *c, int layer, int id, int ahead, void **slot, int *hit)
{
    int it = mf_dev_xcache_item(c, layer, id);
    if (it < 0)
        return mf_error(-EINVAL, "expert cache: expert %d of layer %d out of range (%d layers x %d experts)",
                        id, layer, c->o.n_layers, c->o.n_experts);
    pthread_mutex_lock(&c->mu);
    int s, h = ahead ? mf_resid_acquire_ahead(c->res, it, c->o.n_experts, &s) : mf_resid_acquire(c->res, it, &s);
    pthread_mutex_unlock(&c->mu);
    if (h < 0)
        return mf_error(-ENOSPC, "expert cache: card %d: all %d slots pinned, no room for expert %d of "
                        "layer %d", c->o.card, c->n_slots, id, layer);
    *slot = c->slab + (size_t)s * c->o.slot_bytes;
    *hit = h;
    return 0;
}

int mf_dev_xcache_acquire(mf_dev_xcache *c, int layer, int id, void **slot, int *hit)
{
    return mf_dev_xcache_acquire_in(c, layer, id, 0, slot, hit);
}

int mf_dev_xcache_acquire_ahead(mf_dev_xcache *c, int layer, int id, void **slot, int *hit)
{
    return mf_dev_xcache_acquire_in(c, layer, id, 1, slot, hit);
}

void mf_dev_xcache_release(mf_dev_xcache *c, int layer, int id)
{
    int it = mf_dev_xcache_item(c, layer, id);
    if (it < 0) return;
    pthread_mutex_lock(&c->mu);
    int s = mf_resid_slot(c->res, it);
    if (s >= 0) mf_resid_unpin(c->res, s);
    pthread_mutex_unlock(&c->mu);
}

void mf_dev_xcache_drop(mf_dev_xcache *c, int layer, int id)
{
    int it = mf_dev_xcache_item(c, layer, id);
    if (it < 0) return;
    pthread_mutex_lock(&c->mu);
    int s = mf_resid_slot(c->res, it);
    if (s >= 0) {
        mf_resid_unpin(c->res, s);
        if (!mf_resid_pins(c->res, s)) mf_resid_clear(c->res, s);
    }
    pthread_mutex_unlock(&c->mu);
}

/* The policy's counters, with the bytes copied in: slot_bytes per miss. */
static mf_dev_xcache_stats mf_dev_xcache_stats_of(const mf_dev_xcache *c, mf_resid_stats r)
{
    return (mf_dev_xcache_stats){.hits = r.hits, .misses = r.misses, .evictions = r.evictions,
                                 .bytes_in = r.misses * c->o.slot_bytes};
}

void mf_dev_xcache_stats_total(const mf_dev_xcache *c, mf_dev_xcache_stats *out)
{
    mf_resid_stats r;
    pthread_mutex_lock((pthread_mutex_t *)&c->mu);
    mf_resid_stats_total(c->res, &r);
    pthread_mutex_unlock((pthread_mutex_t *)&c->mu);
    *out = mf_dev_xcache_stats_of(c, r);
}

void mf_dev_xcache_step(mf_dev_xcache *c, mf_dev_xcache_stats *out)
{
    mf_resid_stats r;
    pthread_mutex_lock(&c->mu);
    mf_resid_step(c->res, &r);
    pthread_mutex_unlock(&c->mu);
    if (out) *out = mf_dev_xcache_stats_of(c, r);
}

void mf_dev_xcache_stats_reset(mf_dev_xcache *c)
{
    pthread_mutex_lock(&c->mu);
    mf_resid_stats_reset(c->res);
    pthread_mutex_unlock(&c->mu);
}

static int mf_dev_xcache_key_cmp(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

int mf_dev_xcache_fill_plan(int n_cards, int card, int n_layers, int n_experts, const uint32_t *counts,
                            int n_slots, int32_t *items)
{
    int n = n_cards > 1 ? n_cards : 1;
    if (n_layers <= 0 || n_experts <= 0 || n_slots <= 0 || card < 0 || card >= n) return 0;
    /* key: (UINT32_MAX - count) << 32 | (rank x n_layers + layer), rank = the expert's place among
     * the layer's owned experts: sorted ascending, the most counted first, then round-robin over
     * layers by rank */
    int64_t n_items = (int64_t)n_layers * n_experts, m = 0;
    uint64_t *key = malloc(sizeof *key * (size_t)n_items);
    if (!key) return mf_error(-ENOMEM, "expert cache: out of memory for a fill plan of %" PRId64 " experts", n_items);
    for (int L = 0; L < n_layers; L++)
        for (int id = 0, rank = 0; id < n_experts; id++) {
            if (mf_dev_xcache_owner(n, L, id) != card) continue;
            uint32_t cnt = counts ? counts[(int64_t)L * n_experts + id] : 0;
            key[m++] = (uint64_t)(UINT32_MAX - cnt) << 32 | (uint64_t)((int64_t)rank++ * n_layers + L);
        }
    qsort(key, (size_t)m, sizeof *key, mf_dev_xcache_key_cmp);
    int k = 0;
    for (; k < m && k < n_slots; k++) {
        int64_t pos = (int64_t)(key[k] & 0xffffffffu);
        int L = (int)(pos % n_layers), rank = (int)(pos / n_layers);
        int id0 = ((card - L) % n + n) % n;   /* the layer's first owned expert (mf_dev_xcache_owner) */
        items[k] = (int32_t)((int64_t)L * n_experts + id0 + (int64_t)rank * n);
    }
    free(key);
    return k;
}

int mf_dev_xcache_n_slots(const mf_dev_xcache *c) { return c->n_slots; }
uint64_t mf_dev_xcache_slot_bytes(const mf_dev_xcache *c) { return c->o.slot_bytes; }
int mf_dev_xcache_card(const mf_dev_xcache *c) { return c->o.card; }
