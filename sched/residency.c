/* The residency policy (sched/residency.h): item -> slot tables, pins, LFU with aging or LRU, and
 * hit, miss and eviction counters, all carved from one block the caller supplies. */
#include "sched/residency.h"

#include <assert.h>
#include <errno.h>
#include <stdalign.h>
#include <string.h>

#include "sched/error.h"

struct mf_resid {
    mf_resid_policy policy;
    int n_items, n_slots, n_free;
    uint64_t tick, accesses, aging_period;
    uint64_t *last;        /* item -> tick of its last access */
    uint32_t *freq;        /* item -> access count (kept while absent) */
    int32_t *slot_of;      /* item -> slot or -1 */
    int32_t *item_of;      /* slot -> item or -1 */
    int32_t *pins;         /* slot -> pin count */
    int32_t *free_stack;   /* free slots, the next one on top */
    mf_resid_stats total, step;
};

static size_t mf_resid_up8(size_t x) { return (x + 7) & ~(size_t)7; }

/* The block's pieces in order: {name, bytes, &ptr}; the handle comes first. */
typedef struct mf_resid_piece {
    const char *name;
    size_t n_bytes;
    void **ptr;
} mf_resid_piece;

static int mf_resid_pieces(const mf_resid_opts *o, mf_resid *r, mf_resid_piece *v)
{
    size_t ni = (size_t)o->n_items, ns = (size_t)o->n_slots;
    int n = 0;
    v[n++] = (mf_resid_piece){"last", ni * sizeof(uint64_t), r ? (void **)&r->last : NULL};
    v[n++] = (mf_resid_piece){"freq", ni * sizeof(uint32_t), r ? (void **)&r->freq : NULL};
    v[n++] = (mf_resid_piece){"slot_of", ni * sizeof(int32_t), r ? (void **)&r->slot_of : NULL};
    v[n++] = (mf_resid_piece){"item_of", ns * sizeof(int32_t), r ? (void **)&r->item_of : NULL};
    v[n++] = (mf_resid_piece){"pins", ns * sizeof(int32_t), r ? (void **)&r->pins : NULL};
    v[n++] = (mf_resid_piece){"free_stack", ns * sizeof(int32_t), r ? (void **)&r->free_stack : NULL};
    return n;
}

static int mf_resid_opts_ok(const mf_resid_opts *o)
{
    return o && o->n_items >= 0 && o->n_slots >= 0 && o->aging_period >= 0 &&
           (o->policy == MF_RESID_LFU || o->policy == MF_RESID_LRU);
}

size_t mf_resid_bytes(const mf_resid_opts *o)
{
    if (!mf_resid_opts_ok(o)) return 0;
    mf_resid_piece v[8];
    int n = mf_resid_pieces(o, NULL, v);
    size_t b = mf_resid_up8(sizeof(mf_resid));
    for (int i = 0; i < n; i++) b += mf_resid_up8(v[i].n_bytes);
    return b;
}

int mf_resid_init(const mf_resid_opts *o, void *mem, size_t n_bytes, mf_resid **out)
{
    *out = NULL;
    if (!mf_resid_opts_ok(o))
        return mf_error(-EINVAL, "residency: bad options (policy %d, %d items, %d slots, aging "
                        "period %d; expected LFU or LRU and counts >= 0)", o ? (int)o->policy : -1,
                        o ? o->n_items : 0, o ? o->n_slots : 0, o ? o->aging_period : 0);
    size_t need = mf_resid_bytes(o);
    if (!mem || n_bytes < need || (uintptr_t)mem % alignof(uint64_t))
        return mf_error(-EINVAL, "residency: a block of %zu bytes at %p for %d items and %d slots "
                        "(expected %zu bytes, 8-byte aligned)", n_bytes, mem, o->n_items, o->n_slots,
                        need);
    memset(mem, 0, need);
    mf_resid *r = mem;
    uint8_t *p = (uint8_t *)mem + mf_resid_up8(sizeof *r);
    mf_resid_piece v[8];
    int n = mf_resid_pieces(o, r, v);
    for (int i = 0; i < n; i++) {
        *v[i].ptr = p;
        p += mf_resid_up8(v[i].n_bytes);
    }
    r->policy = o->policy;
    r->n_items = o->n_items;
    r->n_slots = o->n_slots;
    r->aging_period = o->aging_period > 0 ? (uint64_t)o->aging_period
                                          : 8 * (uint64_t)(o->n_slots ? o->n_slots : 1);
    for (int i = 0; i < r->n_items; i++) r->slot_of[i] = -1;
    for (int s = 0; s < r->n_slots; s++) {
        r->item_of[s] = -1;
        r->free_stack[s] = r->n_slots - 1 - s;
    }
    r->n_free = r->n_slots;
    *out = r;
    return 0;
}

void mf_resid_touch(mf_resid *r, int item)
{
    assert(item >= 0 && item < r->n_items);
    r->last[item] = ++r->tick;
    if (r->freq[item] < UINT32_MAX) r->freq[item]++;
    if (r->policy == MF_RESID_LFU && ++r->accesses % r->aging_period == 0)
        for (int i = 0; i < r->n_items; i++) r->freq[i] >>= 1;
}

/* Next-use distance of item's group ahead of group cur in a cyclic pass over n groups of
 * group_items items: 1 for the next group, n for cur itself (its next use is the next pass's). */
static int mf_resid_ahead(int item, int group_items, int n, int cur)
{
    return ((item / group_items - cur - 1) % n + n) % n + 1;
}

/* The unpinned present slot the policy ranks lowest; -1 when every slot is pinned (or free). With
 * group_items > 0 (a cyclic pass at the group of item `cur_item`): the one whose group is used
 * next farthest ahead first, the policy's order among equals. */
static int mf_resid_victim(const mf_resid *r, int group_items, int cur_item)
{
    int best = -1, best_d = 0;
    int n = group_items > 0 ? (r->n_items + group_items - 1) / group_items : 1;
    int cur = group_items > 0 ? cur_item / group_items : 0;
    for (int s = 0; s < r->n_slots; s++) {
        if (r->pins[s] || r->item_of[s] < 0) continue;
        int it = r->item_of[s], d = group_items > 0 ? mf_resid_ahead(it, group_items, n, cur) : 0;
        if (best < 0 || d > best_d) {
            best = s;
            best_d = d;
            continue;
        }
        if (d < best_d) continue;
        int bt = r->item_of[best];
        if (r->policy == MF_RESID_LRU) {
            if (r->last[it] < r->last[bt]) best = s;
        } else if (r->freq[it] < r->freq[bt] || (r->freq[it] == r->freq[bt] && r->last[it] < r->last[bt])) {
            best = s;
        }
    }
    return best;
}

static int mf_resid_lookup_in(mf_resid *r, int item, int group_items, int *slot)
{
    assert(item >= 0 && item < r->n_items);
    int s = r->slot_of[item];
    if (s >= 0) {
        r->total.hits++;
        r->step.hits++;
        *slot = s;
        return 1;
    }
    if (r->n_free) {   /* a free slot first */
        s = r->free_stack[--r->n_free];
    } else {
        if ((s = mf_resid_victim(r, group_items, item)) < 0) return -ENOSPC;
        r->slot_of[r->item_of[s]] = -1;
        r->total.evictions++;
        r->step.evictions++;
    }
    r->item_of[s] = item;
    r->slot_of[item] = s;
    r->total.misses++;
    r->step.misses++;
    *slot = s;
    return 0;
}

int mf_resid_lookup(mf_resid *r, int item, int *slot) { return mf_resid_lookup_in(r, item, 0, slot); }

static int mf_resid_acquire_in(mf_resid *r, int item, int group_items, int *slot)
{
    int rc = mf_resid_lookup_in(r, item, group_items, slot);
    if (rc < 0) return rc;
    r->pins[*slot]++;
    mf_resid_touch(r, item);
    return rc;
}

int mf_resid_acquire(mf_resid *r, int item, int *slot) { return mf_resid_acquire_in(r, item, 0, slot); }

int mf_resid_acquire_ahead(mf_resid *r, int item, int group_items, int *slot)
{
    assert(group_items > 0);
    return mf_resid_acquire_in(r, item, group_items, slot);
}

void mf_resid_pin(mf_resid *r, int slot)
{
    assert(slot >= 0 && slot < r->n_slots);
    r->pins[slot]++;
}

void mf_resid_unpin(mf_resid *r, int slot)
{
    assert(slot >= 0 && slot < r->n_slots);
    if (r->pins[slot] > 0) r->pins[slot]--;
}

int mf_resid_pins(const mf_resid *r, int slot)
{
    assert(slot >= 0 && slot < r->n_slots);
    return r->pins[slot];
}

void mf_resid_clear(mf_resid *r, int slot)
{
    assert(slot >= 0 && slot < r->n_slots);
    r->pins[slot] = 0;
    if (r->item_of[slot] < 0) return;   /* already free (and on the stack) */
    r->slot_of[r->item_of[slot]] = -1;
    r->item_of[slot] = -1;
    r->free_stack[r->n_free++] = slot;
}

int mf_resid_slot(const mf_resid *r, int item)
{
    return item >= 0 && item < r->n_items ? r->slot_of[item] : -1;
}

int mf_resid_item(const mf_resid *r, int slot)
{
    return slot >= 0 && slot < r->n_slots ? r->item_of[slot] : -1;
}

uint32_t mf_resid_count(const mf_resid *r, int item)
{
    return item >= 0 && item < r->n_items ? r->freq[item] : 0;
}

int mf_resid_n_slots(const mf_resid *r) { return r->n_slots; }
int mf_resid_n_items(const mf_resid *r) { return r->n_items; }

void mf_resid_stats_total(const mf_resid *r, mf_resid_stats *out) { *out = r->total; }

void mf_resid_step(mf_resid *r, mf_resid_stats *out)
{
    if (out) *out = r->step;
    r->step = (mf_resid_stats){0};
}

void mf_resid_stats_reset(mf_resid *r)
{
    r->total = (mf_resid_stats){0};
    r->step = (mf_resid_stats){0};
}
