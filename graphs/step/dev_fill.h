/* Warming the device expert caches before the first step (mf_step_opts.dev_cache_fill): the
 * engine's one fill loop, apart from step.c so that it reads as one piece. Internal to
 * graphs/step/ (mf_step_new calls it). */
#ifndef MF_DEV_FILL_H
#define MF_DEV_FILL_H

#include <stddef.h>
#include <stdint.h>

#include "device/dev.h"
#include "device/expert_cache.h"
#include "graphs/model/model.h"
#include "graphs/step/step.h"
#include "host/store.h"

/* The packed expert's layout in a cache slot: part p (w1 codes, w1 scales, w2 ..., w3 ...) at
 * part_off[p], part_bytes[p] bytes (the layout mf_step's misses copy). */
typedef struct mf_dev_fill_in {
    mf_dev *dev;
    mf_dev_xcache *const *xc;   /* the cards' caches, n_cards */
    int n_cards;
    const mf_model *m;          /* the experts' bytes where resident (weights with data) */
    const mf_store *store;      /* else the store's present experts (NULL: none) */
    const size_t *part_off, *part_bytes;
    const uint32_t *counts;     /* mf_dev_xcache_fill_plan's counts, or NULL */
    int progress;               /* 1: progress on stderr */
} mf_dev_fill_in;

/* Enqueues the copy of a packed expert's six parts src[p] (w1 codes, w1 scales, w2 ..., w3 ...)
 * into a card slot, part p at slot + part_off[p] (part_bytes[p] bytes), on stream st: one copy of
 * the span (up to the furthest part's end) from the part at offset 0 when the parts lie on the host
 * as in the slot (src[p] == that part + part_off[p] for every p: the model's resident or mapped
 * experts, whose layout the slot then mirrors), else one copy per part. 1: one span, 0: per part, or the first copy's
 * error (negative). The one home of a miss's copies (the engine's misses, the warm fill). */
int mf_dev_copy_expert(mf_dev_stream *st, void *slot, const void *const src[6], const size_t *part_off,
                       const size_t *part_bytes);

/* Per card: the plan's experts (mf_dev_xcache_fill_plan for the card's slots) acquired in its
 * cache, copied on its copy-in stream (mf_dev_copy_expert), the stream waited for every 64
 * experts (and the progress advanced), each slot released; an expert the host does not hold is left out
 * (counted in skipped). Then every cache's counters are zeroed. A failed copy drops the slot and
 * fails with the card and expert named. */
int mf_dev_fill(const mf_dev_fill_in *in, mf_step_fill_stats *out);

#endif
