/* The warm fill of the device expert caches (graphs/step/dev_fill.h). */
#include "graphs/step/dev_fill.h"

#include <errno.h>
#include <stdlib.h>

#include "sched/clock.h"
#include "sched/error.h"
#include "sched/progress.h"

int mf_dev_copy_expert(mf_dev_stream *st, void *slot, const void *const src[6], const size_t *part_off,
                       const size_t *part_bytes)
{
    int lo = 0;   /* the part at the slot's start: the span's base on the host */
    size_t end = 0;
    for (int p = 0; p < 6; p++) {
        if (part_off[p] < part_off[lo]) lo = p;
        if (part_off[p] + part_bytes[p] > end) end = part_off[p] + part_bytes[p];
    }
    const uint8_t *b = src[lo];
    int span = part_off[lo] == 0;
    for (int p = 0; p < 6 && span; p++) span = (const uint8_t *)src[p] == b + part_off[p];
    if (span) {
        int rc = mf_dev_copy_h2d(st, slot, b, end);
        return rc ? rc : 1;
    }
    int rc = 0;
    for (int p = 0; p < 6 && !rc; p++) rc = mf_dev_copy_h2d(st, (uint8_t *)slot + part_off[p], src[p], part_bytes[p]);
    return rc;
}

/* The 6 parts of expert (L, e) on the host: the model's resident bytes, else the store's. 0 when
 * the host does not hold it. */
static int mf_dev_fill_src(const mf_dev_fill_in *in, int L, int e, const void *src[6])
{
    const mf_weight *ew = &mf_model_layer_at(in->m, L)->experts[(size_t)e * 3];
    for (int k = 0; k < 3; k++) {
        src[2 * k] = ew[k].data;
        src[2 * k + 1] = ew[k].scale;
        if (!ew[k].data || !ew[k].scale) {
            if (!in->store) return 0;
            src[2 * k] = mf_store_part(in->store, L, e, 2 * k);
            src[2 * k + 1] = mf_store_part(in->store, L, e, 2 * k + 1);
        }
        if (!src[2 * k] || !src[2 * k + 1]) return 0;
    }
    return 1;
}

/* Copies the plan's experts items[0..n) into cache c; adds to *out. */
static int mf_dev_fill_card(const mf_dev_fill_in *in, int cd, const int32_t *items, int n, mf_progress *pr,
                            mf_step_fill_stats *out)
{
    mf_dev_xcache *c = in->xc[cd];
    mf_dev_stream *st = mf_dev_stream_of(in->dev, cd, MF_DEV_STREAM_COPY_IN);
    int E = mf_model_config(in->m)->n_routed_experts, rc = 0, pend = 0;
    uint64_t slot_bytes = mf_dev_xcache_slot_bytes(c), pend_bytes = 0;
    int32_t batch[64];
    for (int i = 0; i <= n && !rc; i++) {
        if (pend == 64 || (i == n && pend)) {   /* wait for the batch, then release its slots */
            rc = mf_dev_stream_sync(st);
            for (int j = 0; j < pend; j++) {
                if (rc) mf_dev_xcache_drop(c, batch[j] / E, batch[j] % E);
                else mf_dev_xcache_release(c, batch[j] / E, batch[j] % E);
            }
            if (rc) return mf_error_wrap(rc, "step: warming the expert cache of card %d", cd);
            mf_progress_add(pr, pend_bytes);
            pend = 0;
            pend_bytes = 0;
        }
        if (i == n) break;
        int L = items[i] / E, e = items[i] % E;
        const void *src[6];
        if (!mf_dev_fill_src(in, L, e, src)) {
            out->skipped++;
            continue;
        }
        void *slot = NULL;
        int hit = 0;
        if ((rc = mf_dev_xcache_acquire(c, L, e, &slot, &hit))) break;
        batch[pend++] = items[i];
        rc = mf_dev_copy_expert(st, slot, src, in->part_off, in->part_bytes);
        rc = rc > 0 ? 0 : rc;
        if (rc) {
            mf_dev_stream_sync(st);
            for (int j = 0; j < pend; j++) mf_dev_xcache_drop(c, batch[j] / E, batch[j] % E);
            return mf_error_wrap(rc, "step: warming the expert cache of card %d: expert %d of layer %d", cd, e, L);
        }
        out->experts++;
        out->bytes += slot_bytes;
        pend_bytes += slot_bytes;
    }
    return rc;
}

int mf_dev_fill(const mf_dev_fill_in *in, mf_step_fill_stats *out)
{
    *out = (mf_step_fill_stats){0};
    int64_t t0 = mf_now_ns();
    const mf_config *c = mf_model_config(in->m);
    int64_t n_items = (int64_t)c->n_layers * c->n_routed_experts;
    int32_t *items = malloc(sizeof *items * (size_t)n_items * (size_t)(in->n_cards > 0 ? in->n_cards : 1));
    int *n = calloc((size_t)(in->n_cards > 0 ? in->n_cards : 1), sizeof *n);
    if (!items || !n) {
        free(items);
        free(n);
        return mf_error(-ENOMEM, "step: out of memory for the warm fill's plan");
    }
    uint64_t total = 0;
    int rc = 0;
    for (int cd = 0; cd < in->n_cards && !rc; cd++) {
        rc = mf_dev_xcache_fill_plan(in->n_cards, cd, c->n_layers, c->n_routed_experts, in->counts,
                                     mf_dev_xcache_n_slots(in->xc[cd]), items + (size_t)cd * n_items);
        if (rc >= 0) n[cd] = rc, total += (uint64_t)rc * mf_dev_xcache_slot_bytes(in->xc[cd]), rc = 0;
    }
    mf_progress pr;
    mf_progress_begin(&pr, "warming card caches", total, 1, !in->progress);
    for (int cd = 0; cd < in->n_cards && !rc; cd++)
        rc = mf_dev_fill_card(in, cd, items + (size_t)cd * n_items, n[cd], &pr, out);
    mf_progress_end(&pr);
    for (int cd = 0; cd < in->n_cards; cd++) mf_dev_xcache_stats_reset(in->xc[cd]);
    out->wall_ns = mf_now_ns() - t0;
    free(items);
    free(n);
    return rc;
}
