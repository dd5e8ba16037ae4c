/* The device expert cache on emulated cards: slots, hits and misses, LFU with aging, pins, byte
 * counters per step, a long chunk's prefetch keeping the warm experts of the layers still to come
 * (mf_dev_xcache_acquire_ahead), the owner policy, and a card too small for one expert refused
 * clearly. */
#include <errno.h>
#include <string.h>

#include "device/expert_cache.h"
#include "sched/error.h"
#include "tests/check.h"

#define CK(cond) CHECK(cond, "last error: %s", mf_last_error())

/* A long chunk's prefetch on a card of 8 slots over 4 layers of 8 experts, after a warm fill of
 * expert 0 of every layer: each layer's experts 0..3 taken and pinned at its start (ahead: by
 * mf_dev_xcache_acquire_ahead, else by mf_dev_xcache_acquire, the decode's LFU with aging), then
 * released. Returns the pass's hits; -1 on a failed check. */
static int long_chunk(mf_dev *d, int ahead)
{
    mf_dev_xcache *c = NULL;
    if (mf_dev_xcache_new(d, &(mf_dev_xcache_opts){.card = 0, .n_layers = 4, .n_experts = 8, .slot_bytes = 64,
                                                   .budget_bytes = 8 * 64, .aging_period = 1000}, &c)) return -1;
    void *p[4], *q;
    int hit, hits = 0, ok = mf_dev_xcache_n_slots(c) == 8;
    for (int L = 0; L < 4; L++) {   /* the warm fill */
        ok &= !mf_dev_xcache_acquire(c, L, 0, &q, &hit) && !hit;
        mf_dev_xcache_release(c, L, 0);
    }
    mf_dev_xcache_stats_reset(c);
    for (int L = 0; L < 4; L++) {
        for (int e = 0; e < 4; e++) {
            int rc = ahead ? mf_dev_xcache_acquire_ahead(c, L, e, &p[e], &hit) : mf_dev_xcache_acquire(c, L, e, &p[e], &hit);
            ok &= !rc;
            hits += !rc && hit;
            /* the layer's pinned experts keep their slots */
            for (int f = 0; f < e; f++) ok &= mf_dev_xcache_has(c, L, f) && p[f] != p[e];
        }
        for (int e = 0; e < 4; e++) mf_dev_xcache_release(c, L, e);
    }
    mf_dev_xcache_stats st;
    mf_dev_xcache_stats_total(c, &st);
    ok &= st.hits == (uint64_t)hits && st.hits + st.misses == 16;
    if (ahead) {   /* every slot pinned: refused as by mf_dev_xcache_acquire */
        for (int e = 0; e < 8; e++) ok &= !mf_dev_xcache_acquire_ahead(c, 1, e, &q, &hit);
        ok &= mf_dev_xcache_acquire_ahead(c, 2, 0, &q, &hit) == -ENOSPC;
    }
    mf_dev_xcache_free(c);
    return ok ? hits : -1;
}

/* mf_dev_xcache_fit against a room of `room` slots (refused above it; an error at `err`). */
static int fit_room(void *ctx, int64_t n)
{
    const int64_t *r = ctx;
    return n == r[1] ? -EIO : n <= r[0];
}

/* Every room from 1 to 3,000 slots of 11,008 asked: the fit is the room itself (no slot left
 * unused), 0 below min_slots, and an ask's error comes back. */
static void test_fit(void)
{
    int bad = 0;
    for (int64_t room = 1; room <= 3000; room++) {
        int64_t r[2] = {room, -1};
        bad += mf_dev_xcache_fit(11008, 1, fit_room, r) != room;
    }
    CHECK(!bad, "%d rooms not filled", bad);
    int64_t r[2] = {5, -1};
    CK(mf_dev_xcache_fit(11008, 6, fit_room, r) == 0);
    r[1] = 9632;   /* the second ask (11,008 - 1,376) */
    CK(mf_dev_xcache_fit(11008, 1, fit_room, r) == -EIO);
}

int main(void)
{
    test_fit();
    mf_dev *d = NULL;
    CK(mf_dev_open("emu:2,mem=1M", &d) == 0);
    {   /* no budget on card 0 (1 MiB): 128 experts of 10,000 bytes asked, the 104 it holds granted (the
         * shrink steps alone: 98) */
        mf_dev_xcache *f = NULL;
        CK(mf_dev_xcache_new(d, &(mf_dev_xcache_opts){.card = 0, .n_layers = 2, .n_experts = 64,
                                                           .slot_bytes = 10000}, &f) == 0);
        CHECK(f && mf_dev_xcache_n_slots(f) == 104, "%d slots granted of 1 MiB (expected 104)",
              f ? mf_dev_xcache_n_slots(f) : -1);
        mf_dev_xcache_free(f);
    }
    mf_dev_xcache *c = NULL;
    /* 3 slots of 1000 bytes on card 1 */
    CK(mf_dev_xcache_new(d, &(mf_dev_xcache_opts){.card = 1, .n_layers = 2, .n_experts = 8,
                                                       .slot_bytes = 1000, .budget_bytes = 3500,
                                                       .aging_period = 1000}, &c) == 0);
    CK(mf_dev_xcache_n_slots(c) == 3);
    CK(mf_dev_emu_used_bytes(d, 1) >= 3000 && mf_dev_emu_used_bytes(d, 0) == 0);
    void *p[4];
    int hit = -1;
    CK(mf_dev_xcache_acquire(c, 0, 1, &p[0], &hit) == 0 && hit == 0);
    CK(mf_dev_xcache_acquire(c, 0, 2, &p[1], &hit) == 0 && hit == 0);
    CK(mf_dev_xcache_acquire(c, 1, 1, &p[2], &hit) == 0 && hit == 0);
    CK(p[0] != p[1] && p[1] != p[2] && p[0] != p[2]);
    /* all pinned: a fourth expert is refused */
    CK(mf_dev_xcache_acquire(c, 0, 3, &p[3], &hit) == -ENOSPC);
    CK(strstr(mf_last_error(), "pinned") != NULL);
    CK(mf_dev_xcache_acquire(c, 2, 0, &p[3], &hit) == -EINVAL);
    mf_dev_xcache_release(c, 0, 1);
    mf_dev_xcache_release(c, 0, 2);
    mf_dev_xcache_release(c, 1, 1);
    /* (0,1) used twice more: more frequent than (0,2) and (1,1) */
    void *q = NULL;
    for (int k = 0; k < 2; k++) {
        CK(mf_dev_xcache_acquire(c, 0, 1, &q, &hit) == 0 && hit == 1 && q == p[0]);
        mf_dev_xcache_release(c, 0, 1);
    }
    CK(mf_dev_xcache_has(c, 0, 2) && !mf_dev_xcache_has(c, 0, 3));
    /* a miss evicts the least frequent, oldest among equals: (0,2) */
    CK(mf_dev_xcache_acquire(c, 0, 3, &q, &hit) == 0 && hit == 0 && q == p[1]);
    mf_dev_xcache_release(c, 0, 3);
    CK(!mf_dev_xcache_has(c, 0, 2) && mf_dev_xcache_has(c, 0, 1) && mf_dev_xcache_has(c, 1, 1));
    mf_dev_xcache_stats st;
    mf_dev_xcache_step(c, &st);
    CK(st.hits == 2 && st.misses == 4 && st.evictions == 1 && st.bytes_in == 4000);
    mf_dev_xcache_step(c, &st);
    CK(st.hits == 0 && st.misses == 0 && st.bytes_in == 0);
    /* a dropped expert (failed copy) is absent again */
    CK(mf_dev_xcache_acquire(c, 1, 1, &q, &hit) == 0 && hit == 1);
    mf_dev_xcache_drop(c, 1, 1);
    CK(!mf_dev_xcache_has(c, 1, 1));
    mf_dev_xcache_stats_total(c, &st);
    CK(st.hits == 3 && st.misses == 4 && st.hits + st.misses == 7);
    mf_dev_xcache_free(c);
    CK(mf_dev_emu_used_bytes(d, 1) == 0);

    /* aging: counts halve, so an old favourite can be evicted */
    CK(mf_dev_xcache_new(d, &(mf_dev_xcache_opts){.card = 0, .n_layers = 1, .n_experts = 4,
                                                       .slot_bytes = 64, .budget_bytes = 128,
                                                       .aging_period = 2}, &c) == 0);
    for (int k = 0; k < 3; k++) {
        CK(mf_dev_xcache_acquire(c, 0, 0, &q, &hit) == 0);
        mf_dev_xcache_release(c, 0, 0);
    }
    CK(mf_dev_xcache_acquire(c, 0, 1, &q, &hit) == 0);   /* 4th access: counts halve */
    mf_dev_xcache_release(c, 0, 1);
    CK(mf_dev_xcache_acquire(c, 0, 1, &q, &hit) == 0 && hit == 1);
    mf_dev_xcache_release(c, 0, 1);
    /* counts now 1 (e0: 3>>1) vs 1 (e1: 1>>1 + 1): equal, e0 older: e0 goes */
    CK(mf_dev_xcache_acquire(c, 0, 2, &q, &hit) == 0 && hit == 0);
    mf_dev_xcache_release(c, 0, 2);
    CK(!mf_dev_xcache_has(c, 0, 0) && mf_dev_xcache_has(c, 0, 1));
    mf_dev_xcache_free(c);

    /* a long chunk: the warm experts of the layers to come stay (the misses evict the layers passed)
     * and every one hits; LFU with aging evicts the warm experts of layers 2 and 3 (count 1, older
     * than layer 0's) at layer 1 */
    int ahead_hits = long_chunk(d, 1), lfu_hits = long_chunk(d, 0);
    CHECK(ahead_hits == 4 && lfu_hits == 2, "long chunk: %d hits by the layers' next use (expected 4), %d by LFU "
          "(expected 2); last error: %s", ahead_hits, lfu_hits, mf_last_error());

    /* without a budget: as many slots as the card grants (1 MiB: fewer than 16 x 100 KB) */
    CK(mf_dev_xcache_new(d, &(mf_dev_xcache_opts){.card = 0, .n_layers = 4, .n_experts = 4,
                                                       .slot_bytes = 100000}, &c) == 0);
    CK(mf_dev_xcache_n_slots(c) >= 1 && mf_dev_xcache_n_slots(c) < 16 &&
          mf_dev_emu_used_bytes(d, 0) <= (1 << 20));
    mf_dev_xcache_free(c);
    /* a card too small for one expert */
    CK(mf_dev_xcache_new(d, &(mf_dev_xcache_opts){.card = 0, .n_layers = 1, .n_experts = 4,
                                                       .slot_bytes = 2 << 20}, &c) == -ENOSPC && !c);
    CK(strstr(mf_last_error(), "too small") != NULL && strstr(mf_last_error(), "card 0") != NULL);
    CK(mf_dev_xcache_new(d, &(mf_dev_xcache_opts){.card = 0, .n_layers = 1, .n_experts = 4,
                                                       .slot_bytes = 100, .budget_bytes = 50}, &c) == -ENOSPC);
    CK(mf_dev_xcache_new(d, &(mf_dev_xcache_opts){.card = 2, .n_layers = 1, .n_experts = 4,
                                                       .slot_bytes = 100}, &c) == -EINVAL);
    /* owner policy: every card owns a share of each layer */
    for (int n = 1; n <= 4; n++) {
        int cnt[4] = {0};
        for (int e = 0; e < 16; e++) {
            int o = mf_dev_xcache_owner(n, 3, e);
            CK(o >= 0 && o < n);
            cnt[o]++;
        }
        for (int k = 0; k < n; k++) CK(cnt[k] == 16 / n || cnt[k] == 16 / n + 1);
    }
    CK(mf_dev_xcache_owner(4, 0, 0) != mf_dev_xcache_owner(4, 1, 0));
    mf_dev_close(d);
    return mf_check_exit("test_xcache");
}
