/* The residency policy (sched/residency.h) on its own: random operation sequences against a plain
 * model written here (items searched one by one, no shared code), pins never evicted, aging
 * halving the counts, least recently used among equal counts, LRU, a cyclic pass's victims by
 * their group's next use (mf_resid_acquire_ahead), counters per step and in
 * total, refusal when every slot is pinned, and bad options and blocks refused. No threads (the
 * policy has none; its callers lock). */
#include <errno.h>
#include <stdalign.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sched/error.h"
#include "sched/residency.h"
#include "tests/check.h"

#define CK(cond) CHECK(cond, "last error: %s", mf_last_error())
/* In a random sequence: the first difference ends the sequence (the rest would only repeat it). */
#define RCHECK(cond, ...)                \
    do {                                 \
        int ok_ = (cond);                \
        CHECK(ok_, __VA_ARGS__);         \
        if (!ok_) {                      \
            free(mem);                   \
            return;                      \
        }                                \
    } while (0)

static uint64_t rng_state;
static uint32_t rnd(uint32_t n)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state % n);
}

/* ---- the model -------------------------------------------------------------------------------- */

#define MAXI 48
#define MAXS 52

typedef struct model {
    int lru, n_items, n_slots;
    uint64_t period, tick, accesses;
    int slot[MAXI];                /* -1: absent */
    uint32_t cnt[MAXI];
    uint64_t last[MAXI];
    int holder[MAXS], pins[MAXS];  /* holder -1: free */
    int freel[MAXS], n_free;       /* free slots, last freed on top */
    mf_resid_stats total, step;
} model;

static void m_init(model *m, int lru, int n_items, int n_slots, int period)
{
    memset(m, 0, sizeof *m);
    m->lru = lru;
    m->n_items = n_items;
    m->n_slots = n_slots;
    m->period = period ? (uint64_t)period : 8 * (uint64_t)(n_slots ? n_slots : 1);
    for (int i = 0; i < n_items; i++) m->slot[i] = -1;
    for (int s = 0; s < n_slots; s++) {
        m->holder[s] = -1;
        m->freel[s] = n_slots - 1 - s;
    }
    m->n_free = n_slots;
}

static void m_touch(model *m, int it)
{
    m->last[it] = ++m->tick;
    m->cnt[it]++;
    if (!m->lru) {
        m->accesses++;
        if (m->accesses % m->period == 0)
            for (int i = 0; i < m->n_items; i++) m->cnt[i] /= 2;
    }
}

/* A cyclic pass's next-use distance of item it's group, counted forward group by group from the
 * group of item cur (of group_items items each; the last may be short): cur's own group is the
 * farthest, all the groups later. */
static int m_ahead(const model *m, int it, int cur, int group_items)
{
    int n = 0, d = 1;
    for (int i = 0; i < m->n_items; i += group_items) n++;
    for (int g = (cur / group_items + 1) % n; g != it / group_items; g = (g + 1) % n) d++;
    return d;
}

/* 1 when item a should be evicted before item b (group_items > 0: a cyclic pass at item cur). */
static int m_before(const model *m, int a, int b, int cur, int group_items)
{
    if (group_items > 0) {
        int da = m_ahead(m, a, cur, group_items), db = m_ahead(m, b, cur, group_items);
        if (da != db) return da > db;
    }
    if (!m->lru && m->cnt[a] != m->cnt[b]) return m->cnt[a] < m->cnt[b];
    if (m->last[a] != m->last[b]) return m->last[a] < m->last[b];
    return m->slot[a] < m->slot[b];   /* never-touched items: the lower slot */
}

static int m_lookup(model *m, int it, int group_items, int *slot)
{
    if (m->slot[it] >= 0) {
        m->total.hits++, m->step.hits++;
        *slot = m->slot[it];
        return 1;
    }
    int s;
    if (m->n_free) {
        s = m->freel[--m->n_free];
    } else {
        int v = -1;
        for (int i = 0; i < m->n_items; i++)
            if (m->slot[i] >= 0 && !m->pins[m->slot[i]] && (v < 0 || m_before(m, i, v, it, group_items))) v = i;
        if (v < 0) return -ENOSPC;
        s = m->slot[v];
        m->slot[v] = -1;
        m->total.evictions++, m->step.evictions++;
    }
    m->holder[s] = it;
    m->slot[it] = s;
    m->total.misses++, m->step.misses++;
    *slot = s;
    return 0;
}

static void m_clear(model *m, int s)
{
    m->pins[s] = 0;
    if (m->holder[s] < 0) return;
    m->slot[m->holder[s]] = -1;
    m->holder[s] = -1;
    m->freel[m->n_free++] = s;
}

static int same_stats(mf_resid_stats a, mf_resid_stats b)
{
    return a.hits == b.hits && a.misses == b.misses && a.evictions == b.evictions;
}

/* Every item's slot, every slot's item and pins, counts (the model's do not saturate: a sequence
 * here is far below 2^32 accesses) and the totals agree. */
static int agree(const mf_resid *r, const model *m)
{
    for (int i = 0; i < m->n_items; i++)
        if (mf_resid_slot(r, i) != m->slot[i] || mf_resid_count(r, i) != m->cnt[i]) return 0;
    for (int s = 0; s < m->n_slots; s++)
        if (mf_resid_item(r, s) != m->holder[s] || mf_resid_pins(r, s) != m->pins[s]) return 0;
    mf_resid_stats t;
    mf_resid_stats_total(r, &t);
    return same_stats(t, m->total);
}

static mf_resid *make(const mf_resid_opts *o, void **mem)
{
    size_t b = mf_resid_bytes(o);
    *mem = b ? malloc(b) : NULL;
    mf_resid *r = NULL;
    if (!*mem || mf_resid_init(o, *mem, b, &r)) {
        fprintf(stderr, "test_residency: cannot make a policy of %zu bytes: %s\n", b, mf_last_error());
        exit(1);
    }
    return r;
}

/* One random sequence: the store's way (touch a batch, pin its hits, then place its misses), the
 * caches' way (acquire, later release; a cyclic pass's acquire in groups of group_items), pins,
 * clears and steps, checked against the model. */
static void random_case(int lru, int n_items, int n_slots, int period, int group_items, int n_ops)
{
    mf_resid_opts o = {.policy = lru ? MF_RESID_LRU : MF_RESID_LFU, .n_items = n_items,
                       .n_slots = n_slots, .aging_period = period};
    void *mem;
    mf_resid *r = make(&o, &mem);
    model m;
    m_init(&m, lru, n_items, n_slots, period);
    RCHECK(agree(r, &m), "fresh policy differs from the model (%d items, %d slots)", n_items, n_slots);
    for (int op = 0; op < n_ops; op++) {
        int kind = (int)rnd(100), it = (int)rnd((uint32_t)n_items), s1 = 0, s2 = 0;
        int pinned_item[MAXS];
        for (int s = 0; s < n_slots; s++) pinned_item[s] = mf_resid_pins(r, s) ? mf_resid_item(r, s) : -1;
        if (kind < 30) {   /* acquire (the caches; a third of them a cyclic pass's) */
            int ahead = kind < 10;
            int a = ahead ? mf_resid_acquire_ahead(r, it, group_items, &s1) : mf_resid_acquire(r, it, &s1);
            int b = m_lookup(&m, it, ahead ? group_items : 0, &s2);
            if (b >= 0) {
                m.pins[s2]++;
                m_touch(&m, it);
            }
            RCHECK(a == b && (a < 0 || s1 == s2), "op %d acquire%s %d: %d slot %d, model %d slot %d", op,
                  ahead ? " ahead" : "", it, a, s1, b, s2);
        } else if (kind < 45) {   /* a touch, then a lookup (the store's two passes) */
            mf_resid_touch(r, it);
            m_touch(&m, it);
            int a = mf_resid_lookup(r, it, &s1), b = m_lookup(&m, it, 0, &s2);
            RCHECK(a == b && (a < 0 || s1 == s2), "op %d lookup %d: %d slot %d, model %d slot %d", op,
                  it, a, s1, b, s2);
            if (a >= 0 && rnd(2)) {
                mf_resid_pin(r, s1);
                m.pins[s2]++;
            }
        } else if (kind < 55) {   /* a touch alone (a batch's counting pass) */
            mf_resid_touch(r, it);
            m_touch(&m, it);
        } else if (kind < 80 && n_slots) {   /* unpin */
            int s = (int)rnd((uint32_t)n_slots);
            mf_resid_unpin(r, s);
            if (m.pins[s] > 0) m.pins[s]--;
        } else if (kind < 88 && n_slots) {   /* clear (a failed fill) */
            int s = (int)rnd((uint32_t)n_slots);
            mf_resid_clear(r, s);
            m_clear(&m, s);
        } else if (kind < 95) {   /* a step */
            mf_resid_stats st;
            mf_resid_step(r, &st);
            RCHECK(same_stats(st, m.step), "op %d: step counters differ", op);
            m.step = (mf_resid_stats){0};
        }
        RCHECK(agree(r, &m), "op %d (kind %d, item %d): policy differs from the model (%s, %d items, "
              "%d slots, period %d, groups of %d)", op, kind, it, lru ? "LRU" : "LFU", n_items, n_slots, period,
              group_items);
        /* a slot pinned before the operation still holds its item unless the op cleared it */
        if (kind < 80)
            for (int s = 0; s < n_slots; s++)
                RCHECK(pinned_item[s] < 0 || mf_resid_item(r, s) == pinned_item[s],
                      "op %d: pinned slot %d lost item %d", op, s, pinned_item[s]);
    }
    free(mem);
}

/* ---- cases by hand ---------------------------------------------------------------------------- */

static void hand_cases(void)
{
    void *mem;
    int s = -1, s0, s1, s2;
    mf_resid_stats st;

    /* LFU, 3 slots: free slots in order, a refusal when all are pinned */
    mf_resid *r = make(&(mf_resid_opts){.n_items = 8, .n_slots = 3, .aging_period = 1000}, &mem);
    CK(mf_resid_acquire(r, 1, &s0) == 0 && s0 == 0);
    CK(mf_resid_acquire(r, 2, &s1) == 0 && s1 == 1);
    CK(mf_resid_acquire(r, 5, &s2) == 0 && s2 == 2);
    mf_resid_stats before;
    mf_resid_stats_total(r, &before);
    CK(mf_resid_acquire(r, 6, &s) == -ENOSPC && mf_resid_slot(r, 6) < 0);
    CK(mf_resid_lookup(r, 6, &s) == -ENOSPC);
    mf_resid_stats_total(r, &st);
    CK(same_stats(st, before) && st.misses == 3 && st.hits == 0 && st.evictions == 0);
    CK(mf_resid_count(r, 6) == 0 && mf_resid_count(r, 1) == 1);   /* refused: not counted */
    /* nested pins: two unpins needed */
    mf_resid_pin(r, s0);
    mf_resid_unpin(r, s0);
    CK(mf_resid_pins(r, s0) == 1);
    mf_resid_unpin(r, s0);
    mf_resid_unpin(r, s0);   /* below zero: nothing */
    CK(mf_resid_pins(r, s0) == 0);
    mf_resid_unpin(r, s1);
    mf_resid_unpin(r, s2);
    /* item 1 twice more: 3 accesses against 1 each for 2 and 5; a miss evicts 2 (count 1, older
     * than 5), never the pinned one */
    for (int k = 0; k < 2; k++) {
        CK(mf_resid_acquire(r, 1, &s) == 1 && s == s0);
        mf_resid_unpin(r, s);
    }
    mf_resid_pin(r, s2);   /* 5 pinned: not a candidate although its count is lowest too */
    CK(mf_resid_acquire(r, 3, &s) == 0 && s == s1 && mf_resid_slot(r, 2) < 0);
    mf_resid_unpin(r, s);
    mf_resid_unpin(r, s2);
    mf_resid_step(r, &st);
    CK(st.hits == 2 && st.misses == 4 && st.evictions == 1);
    mf_resid_step(r, &st);
    CK(st.hits == 0 && st.misses == 0 && st.evictions == 0);
    mf_resid_stats_total(r, &st);
    CK(st.hits == 2 && st.misses == 4 && st.evictions == 1);
    /* clear: the slot is free again and taken first (last freed first) */
    mf_resid_clear(r, s2);
    CK(mf_resid_slot(r, 5) < 0 && mf_resid_item(r, s2) < 0 && mf_resid_pins(r, s2) == 0);
    CK(mf_resid_acquire(r, 7, &s) == 0 && s == s2);
    mf_resid_stats_total(r, &st);
    CK(st.evictions == 1);   /* a free slot evicts nothing */
    mf_resid_stats_reset(r);
    mf_resid_stats_total(r, &st);
    CK(st.hits == 0 && st.misses == 0 && mf_resid_slot(r, 7) == s2);
    free(mem);

    /* aging: every 4th access halves all counts, absent items' too */
    r = make(&(mf_resid_opts){.n_items = 4, .n_slots = 2, .aging_period = 4}, &mem);
    for (int k = 0; k < 3; k++) mf_resid_touch(r, 0);
    CK(mf_resid_count(r, 0) == 3);
    mf_resid_touch(r, 3);   /* absent, 4th access */
    CK(mf_resid_count(r, 0) == 1 && mf_resid_count(r, 3) == 0);
    free(mem);

    /* aging changes the victim (test_xcache's sequence): e0 used 3 times, then halved to 1; e1
     * at 1; equal counts, e0 older: e0 goes */
    r = make(&(mf_resid_opts){.n_items = 4, .n_slots = 2, .aging_period = 2}, &mem);
    for (int k = 0; k < 3; k++) {
        CK(mf_resid_acquire(r, 0, &s) >= 0);
        mf_resid_unpin(r, s);
    }
    for (int k = 0; k < 2; k++) {
        CK(mf_resid_acquire(r, 1, &s) >= 0);
        mf_resid_unpin(r, s);
    }
    CK(mf_resid_count(r, 0) == 1 && mf_resid_count(r, 1) == 1);
    CK(mf_resid_acquire(r, 2, &s) == 0 && mf_resid_slot(r, 0) < 0 && mf_resid_slot(r, 1) >= 0);
    free(mem);

    /* default aging period: 8 x slots */
    r = make(&(mf_resid_opts){.n_items = 3, .n_slots = 2}, &mem);
    for (int k = 0; k < 15; k++) mf_resid_touch(r, 0);
    CK(mf_resid_count(r, 0) == 15);
    mf_resid_touch(r, 1);
    CK(mf_resid_count(r, 0) == 7 && mf_resid_count(r, 1) == 0);
    free(mem);

    /* LRU: the least recently used goes whatever the counts; LFU would keep the frequent one */
    for (int lru = 0; lru < 2; lru++) {
        r = make(&(mf_resid_opts){.policy = lru ? MF_RESID_LRU : MF_RESID_LFU, .n_items = 4,
                                  .n_slots = 2, .aging_period = 1000}, &mem);
        for (int k = 0; k < 5; k++) {
            CK(mf_resid_acquire(r, 0, &s) >= 0);
            mf_resid_unpin(r, s);
        }
        CK(mf_resid_acquire(r, 1, &s) >= 0);
        mf_resid_unpin(r, s);
        CK(mf_resid_acquire(r, 2, &s) == 0);
        CK(lru ? mf_resid_slot(r, 0) < 0 && mf_resid_slot(r, 1) >= 0
               : mf_resid_slot(r, 1) < 0 && mf_resid_slot(r, 0) >= 0);
        free(mem);
    }

    /* no slots: every lookup refused */
    r = make(&(mf_resid_opts){.n_items = 2, .n_slots = 0}, &mem);
    CK(mf_resid_lookup(r, 1, &s) == -ENOSPC && mf_resid_n_slots(r) == 0 && mf_resid_n_items(r) == 2);
    free(mem);

    /* bad options and blocks */
    CK(mf_resid_bytes(&(mf_resid_opts){.n_items = -1, .n_slots = 1}) == 0);
    CK(mf_resid_bytes(&(mf_resid_opts){.n_items = 1, .n_slots = 1, .policy = (mf_resid_policy)9}) == 0);
    CK(mf_resid_bytes(&(mf_resid_opts){.n_items = 1, .n_slots = 1, .aging_period = -2}) == 0);
    mf_resid_opts o = {.n_items = 10, .n_slots = 4};
    size_t b = mf_resid_bytes(&o);
    alignas(8) static uint8_t blk[4096];
    CK(b > 0 && b < sizeof blk - 8);
    CK(mf_resid_init(&o, blk, b - 1, &r) == -EINVAL && r == NULL);
    CK(strstr(mf_last_error(), "expected") != NULL);
    CK(mf_resid_init(&o, blk + 4, b, &r) == -EINVAL);
    CK(mf_resid_init(&(mf_resid_opts){.n_items = 1, .n_slots = -1}, blk, sizeof blk, &r) == -EINVAL);
    CK(mf_resid_init(&o, blk, b, &r) == 0 && mf_resid_n_slots(r) == 4 && mf_resid_n_items(r) == 10);
    CK(mf_resid_slot(r, -1) == -1 && mf_resid_slot(r, 10) == -1 && mf_resid_item(r, 4) == -1);
}

int main(void)
{
    const char *env = getenv("MOEFLOW_TEST_SEED");
    uint64_t seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)clock() << 32);
    rng_state = seed | 1;
    printf("test_residency: seed %llu (MOEFLOW_TEST_SEED=%llu repeats this run)\n",
           (unsigned long long)seed, (unsigned long long)seed);
    hand_cases();
    int n_cases = 0;
    for (int c = 0; c < 300; c++) {
        int n_items = 1 + (int)rnd(MAXI);
        int n_slots = (int)rnd((uint32_t)(n_items + 4 < MAXS ? n_items + 4 : MAXS));
        if (c % 3 == 0) n_slots = 1 + (int)rnd(n_items < 6 ? (uint32_t)n_items : 6);   /* tight */
        int period = rnd(3) ? 1 + (int)rnd(12) : 0;
        int group_items = 1 + (int)rnd(8);
        random_case((int)rnd(2), n_items, n_slots, period, group_items, 400 + (int)rnd(800));
        n_cases++;
    }
    printf("test_residency: %d random sequences agree with the model\n", n_cases);
    return mf_check_exit("test_residency");
}
