/* The decode-step simulator (graphs/sim/plan.h). It runs the engine's own step graph (graphs/step/stepgraph.h,
 * the builder graphs/step/step_shape.c uses: the parallel graph of the bucket of `batch` items, the batch
 * live, as the engine's decode steps), built once; each
 * step draws its routing, keeps the slot tables and the caches (host store, per-card device caches)
 * as the engine's route task does, places the slots with the engine's rule (mf_sg_placer: every
 * used slot queued on the host, then the cached ones offered to their cards, then the rest), marks
 * the same noop tasks (mf_stepgraph_mark_noop), prices every task's record from the profile
 * (docs/sim.md "Cost formulas") and runs mf_sim_run_opts with the simulator's lane options (one disk
 * pipe, one stream per device lane, emulated cards' host threads). */
#include "graphs/sim/plan.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "device/expert_cache.h"
#include "graphs/step/stepgraph.h"
#include "sched/error.h"
#include "sched/residency.h"
#include "sched/sim.h"
#include "sched/timeline.h"

#define PL_MAX_CARDS MF_SG_MAX_CARDS

/* A slot of this step's table: its expert, tokens, card (-1: host), device cache miss, store miss. */
typedef struct pl_slot {
    int e, cnt, card, miss, store_miss;
} pl_slot;

struct mf_plan {
    mf_plan_opts o;
    mf_config c;
    mf_profile prof;
    int n_cards, n_threads, n_cores, batch, read_window, copy_slots, emulated;
    int n_dense, n_lane_cards;               /* cards holding dense work (0: host); cards with lanes */
    double act_routed, act_dense;            /* a card's steps' buffers (mf_sg_card_reserve, or this graph's
                                              * with a cache budget): with routed experts, dense */
    double dense_bytes[PL_MAX_CARDS];        /* dense weights per card */
    int draft_slots[PL_MAX_CARDS];           /* draft_cards: each card's share of the draft's experts */
    int K, E, n_layers;
    int L0;                                  /* the graph's first layer (the draft round's: n_layers);
                                              * the tables below are indexed by layer - L0, n_layers of them */
    int n_seq, unit_len;                     /* sequences per step and items each (batch = their product) */
    int l0, l1;                              /* the layers simulated (a pipeline stage's, or all) */
    mf_sg_sizes *sz;
    mf_cost_model cm;                        /* prices on prof; host threads' rate capped at the
                                              * socket's memory over its threads */
    mf_lane_model models[4];                 /* the engine's lane models (mf_step_lane_models) */
    mf_sg_lanes lt;                          /* the engine's lanes */
    /* the simulator's own lane options (mf_sim_opts) */
    int conc[MF_PLAN_MAX_LANES];
    int64_t wake_ns[MF_PLAN_MAX_LANES];
    uint8_t lane_core[MF_PLAN_MAX_LANES];
    /* caches */
    int streamed;
    mf_resid *store;                          /* the host store's policy (streamed), or NULL */
    mf_resid *dev[PL_MAX_CARDS];              /* each card's expert cache policy */
    void *resid_mem;                          /* one block for all of them */
    /* routing */
    uint64_t rng;
    int32_t *ex;                             /* n_layers x batch x K */
    int64_t pos;                             /* position of the next step's tokens (prefill: its first) */
    int n_head;                              /* items whose logits the next step computes */
    int stepped;                             /* a step has been simulated */
    /* the graph, this step's slot tables (n_layers x n_slots) and task durations */
    mf_stepgraph *sg;
    mf_timeline *tl;
    int64_t *task_ns;
    pl_slot *sl;
    int32_t *slot_card;
    /* prefetch, per parity of the layer (two layers' pins at a time, as the engine's): a layer's
     * experts' cards (-1 the host) and whether copied in, the layer pinned (-1 none); scratch:
     * in the cache */
    int32_t *pre_card[2];
    uint8_t *pre_miss[2], *pre_cached;
    int pre_layer[2];
    double pre_left[PL_MAX_CARDS];           /* the link time the last placed layer's MoE window left (mf_sg_place_left) */
    int pre_left_layer;                      /* that layer, -1 */
    int *n_used;                             /* per layer and micro-batch, n_used[2 L + h] */
    mf_plan_report total;
};

/* ---- pricing the records (sched/cost.h mf_work, graphs/step/stepgraph.h mf_sg_task_ns) ---- */

/* 1 when slot s of layer L is used this step (among its micro-batch's first n_used). */
static int pl_slot_live(const mf_plan *p, int L, int s)
{
    int h = mf_stepgraph_half_of_slot(p->sg, s);
    return s - p->sg->half_slot[h] < p->n_used[2 * (L - p->L0) + h];
}

/* A card's FFN of slot s (one expert over its tokens) on the path it takes (mf_sg_ffn_lt: the
 * graph's mode where its experts may take cuBLASLt; a card's FFN graph is int8): 1 on cuBLASLt. */
static int pl_card_ffn(const mf_plan *p, const pl_slot *sl, double *ns)
{
    mf_work w;
    mf_sg_expert_work(&p->c, p->sz, &w);
    return mf_sg_ffn_lt(&p->cm, &w, sl->cnt, p->sg->lt_ffn ? p->o.lt : MF_SG_LT_OFF, ns);
}
static double pl_card_ffn_ns(const mf_plan *p, const pl_slot *sl)
{
    double ns;
    pl_card_ffn(p, sl, &ns);
    return ns;
}

/* Task t's positional work (mf_sg_pos_flops): decode items all at pos; a prefill chunk's item i
 * at pos + i. */
static double pl_pos_flops(const mf_plan *p, const mf_sg_task *t)
{
    int P = t->op == MF_SG_ATTN_SCORE ? mf_stepgraph_key_parts(p->sg, t->i0) : 1;   /* the others' take no parts */
    if (!p->o.prefill) return mf_sg_pos_flops(&p->c, t, P, p->pos);
    mf_sg_task one = *t;
    double f = 0;
    for (int i = t->i0; i < t->i1; i++) {
        one.i0 = i;
        one.i1 = i + 1;
        f += mf_sg_pos_flops(&p->c, &one, P, p->pos + i);
    }
    return f;
}

/* Task t's duration this step without the executor's overhead, from the cost model and what this
 * step drew (the slot's tokens, its cache and store misses, the position); *overhead 0 where the
 * task finishes without it (an empty read). */
static double pl_task_ns(mf_plan *p, const mf_sg_task *t, mf_plan_report *r, int *overhead)
{
    const pl_slot *sl = t->slot >= 0 ? &p->sl[(size_t)(t->layer - p->L0) * p->sg->n_slots + t->slot] : NULL;
    mf_sg_step_cost s = {.slot_tokens = sl ? sl->cnt : 0, .n_head = p->n_head, .dev_miss = sl && sl->miss};
    if (t->op == MF_SG_DEV_FFN && sl) {
        double ns;
        s.ffn_lt = pl_card_ffn(p, sl, &ns);
    }
    *overhead = 1;
    switch (t->op) {
    case MF_SG_ENGRAM_READ:
        r->table_bytes_read += (uint64_t)t->w.io_bytes;
        break;
    case MF_SG_SLOT_READ:
        if (!sl || !pl_slot_live(p, t->layer, t->slot) || !sl->store_miss) {
            *overhead = 0;   /* an empty read finishes at once */
            return 0;
        }
        break;
    case MF_SG_NET_IN:   /* the boundary has arrived: the link between stages is graphs/sim/plan_ranks.c's */
        return 0;
    case MF_SG_DEV_FFN_CARD: {   /* one launch: the slots' FFNs in a row */
        double ns = 0;
        int n = 0;
        int s0 = p->sg->half_slot[t->half];   /* the micro-batch's slots */
        for (int s = s0; s < s0 + p->n_used[2 * (t->layer - p->L0) + t->half]; s++) {
            const pl_slot *x = &p->sl[(size_t)(t->layer - p->L0) * p->sg->n_slots + s];
            if (x->card != t->card) continue;
            ns += pl_card_ffn_ns(p, x) - (n++ ? p->prof.card[MF_KF_FP4].latency_ns : 0);
        }
        return ns;
    }
    default:
        break;
    }
    if (mf_sg_scores_task(t))   /* the index scores on cards: the items' positions together */
        mf_sg_scores_pos(&p->c, t, p->pos + (p->o.prefill ? t->i0 : 0), p->o.prefill != 0, &s.pos_flops, &s.pos_bytes);
    else s.pos_flops = pl_pos_flops(p, t);   /* 0 but for the ops whose work grows with the context */
    return mf_sg_task_ns(t, &p->cm, &s);
}

/* ---- setup --------------------------------------------------------------------------------- */
static int pl_check(const mf_plan_opts *o)
{
    if (!o || !o->config || !o->profile)
        return mf_error(-EINVAL, "plan: options need a config and a profile");
    const mf_profile *f = o->profile;
    if (o->placement < MF_STEP_PLACE_HOST || o->placement > MF_STEP_PLACE_HYBRID)
        return mf_error(-EINVAL, "plan: placement %d (expected host, seed or hybrid)", o->placement);
    int max_batch = o->prefill ? MF_STEP_MAX_CHUNK : MF_STEP_MAX_ITEMS;   /* a prefill chunk: one sequence */
    if (o->batch < 0 || o->batch > max_batch)
        return mf_error(-EINVAL, "plan: %s %d (expected 1..%d)", o->prefill ? "prefill chunk" : "batch", o->batch,
                        max_batch);
    const mf_config *c = o->config;
    if (o->unit_len < 0 || o->unit_len > MF_STEP_MAX_ITEMS || (o->unit_len > 1 && o->prefill) ||
        (o->unit_len > 1 && (o->batch ? o->batch : 1) * o->unit_len > MF_STEP_MAX_ITEMS))
        return mf_error(-EINVAL, "plan: %d sequences of %d items each (expected at most %d items, no prefill)",
                        o->batch ? o->batch : 1, o->unit_len, MF_STEP_MAX_ITEMS);
    if (o->draft && (o->draft < 0 || c->n_mtp_layers < 1 || o->draft > c->dspark_block_size || o->prefill ||
                     (o->batch ? o->batch : 1) * c->dspark_block_size > MF_STEP_DRAFT_ITEMS))
        return mf_error(-EINVAL, "plan: a draft round of %d candidates for %d sequences (expected a config with "
                        "draft stages, 1..dspark_block_size %d candidates, at most %d items, no prefill)", o->draft,
                        o->batch ? o->batch : 1, c->dspark_block_size, MF_STEP_DRAFT_ITEMS);
    if ((o->draft || o->feats) && (o->layer_begin > 0 || (o->layer_end && o->layer_end < c->n_layers)))
        return mf_error(-EINVAL, "plan: speculation's draft round or features on a pipeline stage (layers [%d, %d)): "
                        "the draft runs on a whole model", o->layer_begin, o->layer_end);
    if (o->n_cards < 0 || o->n_cards > PL_MAX_CARDS)
        return mf_error(-EINVAL, "plan: %d cards (expected 0..%d)", o->n_cards, PL_MAX_CARDS);
    if (o->placement != MF_STEP_PLACE_HOST && (o->n_cards ? o->n_cards : f->n_cards) < 1)
        return mf_error(-EINVAL, "plan: placement %s needs cards; profile '%s' has none and no card count "
                        "was given", o->placement == MF_STEP_PLACE_SEED ? "seed" : "hybrid", f->name);
    if (o->dense != MF_PLAN_DENSE_HOST && o->dense != MF_PLAN_DENSE_CARDS)
        return mf_error(-EINVAL, "plan: dense placement %d (expected host or cards)", o->dense);
    int nl = o->config->n_layers, l1 = o->layer_begin || o->layer_end ? o->layer_end : nl;
    if (o->layer_begin < 0 || o->layer_begin >= l1 || l1 > nl || !mf_config_cut_ok(o->config, o->layer_begin))
        return mf_error(-EINVAL, "plan: layers [%d, %d) of %d (expected a range beginning at a cut)", o->layer_begin,
                        l1, nl);
    if (o->dense == MF_PLAN_DENSE_CARDS &&
        ((o->n_cards ? o->n_cards : f->n_cards) < 1 ||
         !(f->card[MF_KF_FP8].bytes_per_s > 0 && f->card[MF_KF_BF16].bytes_per_s > 0 && f->h2d_bytes_per_s > 0 &&
           f->d2h_bytes_per_s > 0)))
        return mf_error(-EINVAL, "plan: dense work on cards needs cards and the profile's card fp8 and bf16, h2d "
                        "and d2h rates; profile '%s' has %d cards", f->name, f->n_cards);
    if (o->n_sockets < 0 || o->threads_per_socket < 0 || o->threads_per_socket > 256)
        return mf_error(-EINVAL, "plan: %d sockets x %d threads", o->n_sockets, o->threads_per_socket);
    if (o->read_window < -1 || o->read_window > 4096)
        return mf_error(-EINVAL, "plan: read window %d (expected -1 for all, 0 for the default 2, or 1..4096)",
                        o->read_window);
    if (o->copy_slots < 0 || o->copy_slots > 64)
        return mf_error(-EINVAL, "plan: %d copy slots per card (expected 0..64)", o->copy_slots);
    if (o->dev_cache_policy != MF_PLAN_CACHE_LFU && o->dev_cache_policy != MF_PLAN_CACHE_LRU)
        return mf_error(-EINVAL, "plan: cache policy %d (expected lfu or lru)", o->dev_cache_policy);
    if ((o->store != MF_PLAN_STORE_RESIDENT && o->store != MF_PLAN_STORE_STREAMED) ||
        (o->tables != MF_PLAN_STORE_RESIDENT && o->tables != MF_PLAN_STORE_STREAMED))
        return mf_error(-EINVAL, "plan: store modes %d / %d (expected resident or streamed)", o->store, o->tables);
    if (o->context < 0) return mf_error(-EINVAL, "plan: context %" PRId64 " tokens", o->context);
    if (!(o->dev_task_ns >= 0 && o->dev_task_ns < 1e9))
        return mf_error(-EINVAL, "plan: device task time %g ns (expected 0..1e9)", o->dev_task_ns);
    int thr = (o->n_sockets ? o->n_sockets : f->n_sockets) * (o->threads_per_socket ? o->threads_per_socket
                                                                                  : f->threads_per_socket);
    if (thr < 1 || thr > 256)
        return mf_error(-EINVAL, "plan: %d engine threads (expected 1..256; the profile says %d sockets x %d)",
                        thr, f->n_sockets, f->threads_per_socket);
    static const char *const fam[MF_KF_N] = {"fp4", "fp8", "bf16", "ref"};
    for (int k = 0; k < MF_KF_N; k++)
        if (!(k == MF_KF_REF ? f->host[k].macs_per_s > 0 : f->host[k].bytes_per_s > 0))
            return mf_error(-EINVAL, "plan: profile '%s' has no host %s rate", f->name, fam[k]);
    if (!(f->host_vec.macs_per_s > 0))
        return mf_error(-EINVAL, "plan: profile '%s' has no host vec rate", f->name);
    if (o->store == MF_PLAN_STORE_STREAMED || o->tables == MF_PLAN_STORE_STREAMED)
        if (!(f->disk_bytes_per_s > 0))
            return mf_error(-EINVAL, "plan: a streamed store needs the profile's disk_bytes_per_s (profile '%s')",
                            f->name);
    if (o->placement != MF_STEP_PLACE_HOST &&
        !(f->card[MF_KF_FP4].bytes_per_s > 0 && f->h2d_bytes_per_s > 0 && f->d2h_bytes_per_s > 0))
        return mf_error(-EINVAL, "plan: placement on cards needs the profile's card fp4, h2d and d2h rates "
                        "(profile '%s')", f->name);
    return mf_config_validate("plan", o->config);
}

/* The expert caches' bookkeeping: the streamed store's policy (LFU with aging, as host/store.c)
 * and each card's (dev_policy; LFU as device/expert_cache.c), the policy of sched/residency.h
 * over (layer, expert) items L x E + e, all carved from one block. -ENOMEM. */
static int pl_caches_new(mf_plan *p, int store_slots, const int *dev_slots, mf_resid_policy dev_policy)
{
    int n_items = p->n_layers * p->E, n = 0;
    mf_resid_opts ro[1 + PL_MAX_CARDS];
    mf_resid **dst[1 + PL_MAX_CARDS];
    if (p->streamed) {
        ro[n] = (mf_resid_opts){.policy = MF_RESID_LFU, .n_items = n_items, .n_slots = store_slots};
        dst[n++] = &p->store;
    }
    for (int cd = 0; cd < p->n_cards; cd++) {
        ro[n] = (mf_resid_opts){.policy = dev_policy, .n_items = n_items, .n_slots = dev_slots[cd]};
        dst[n++] = &p->dev[cd];
    }
    if (!n) return 0;
    size_t total = 0;
    for (int i = 0; i < n; i++) total += mf_resid_bytes(&ro[i]);
    uint8_t *mem = p->resid_mem = malloc(total);
    if (!mem) return mf_error(-ENOMEM, "plan: out of memory for the expert caches (%zu bytes)", total);
    for (int i = 0; i < n; i++) {
        size_t b = mf_resid_bytes(&ro[i]);
        int rc = mf_resid_init(&ro[i], mem, b, dst[i]);
        if (rc) return rc;
        mem += b;
    }
    return 0;
}

/* The warm fill (mf_plan_opts.dev_cache_fill), as the engine's graphs/step/dev_fill.c: per card the
 * plan's experts acquired and released in its cache policy, then the counters zeroed. */
static int pl_fill(mf_plan *p, double xslot)
{
    int64_t n_items = (int64_t)p->n_layers * p->E;
    int32_t *items = malloc(sizeof *items * (size_t)n_items);
    uint32_t *counts = p->o.routing ? malloc(sizeof *counts * (size_t)n_items) : NULL;
    if (!items || (p->o.routing && !counts)) {
        free(items);
        free(counts);
        return mf_error(-ENOMEM, "plan: out of memory for the warm fill");
    }
    if (counts && !mf_routing_counts(p->o.routing, counts)) {
        free(counts);
        counts = NULL;
    }
    double most = 0;
    int rc = 0;
    for (int cd = 0; cd < p->n_cards && rc >= 0; cd++) {
        rc = mf_dev_xcache_fill_plan(p->n_cards, cd, p->n_layers, p->E, counts, mf_resid_n_slots(p->dev[cd]), items);
        for (int i = 0; i < rc; i++) {
            int slot;
            if (mf_resid_acquire(p->dev[cd], items[i], &slot) >= 0) mf_resid_unpin(p->dev[cd], slot);
        }
        if (rc > 0) {
            p->total.fill_experts += rc;
            p->total.fill_bytes += rc * xslot;
            if (rc * xslot > most) most = rc * xslot;
        }
        mf_resid_stats_reset(p->dev[cd]);
    }
    free(items);
    free(counts);
    if (rc < 0) return rc;
    const mf_profile *f = &p->prof;
    double a = f->h2d_total_bytes_per_s > 0 ? p->total.fill_bytes / f->h2d_total_bytes_per_s : 0;
    double b = f->h2d_bytes_per_s > 0 ? most / f->h2d_bytes_per_s : 0;
    p->total.fill_ns = 1e9 * (a > b ? a : b);
    return 0;
}

/* draft_cards, a draft round's plan: each card's cache holds the draft's experts it owns
 * (mf_dev_xcache_owner of the stage's layer, as the engine's mf_step_draft_cards takes them). */
static void pl_fill_draft(mf_plan *p)
{
    for (int cd = 0; cd < p->n_cards; cd++) {
        for (int L = 0; L < p->n_layers; L++)
            for (int e = 0; e < p->E; e++) {
                int slot;
                if (mf_dev_xcache_owner(p->n_cards, p->L0 + L, e) == cd && mf_resid_acquire(p->dev[cd], L * p->E + e, &slot) >= 0)
                    mf_resid_unpin(p->dev[cd], slot);
            }
        mf_resid_stats_reset(p->dev[cd]);
    }
}

/* mf_plan_new's steps, in its order: each 0 or a negative code with a message. */

/* The plan's options, counts and cost model from o and its profile. */
static void pl_init(mf_plan *p, const mf_plan_opts *o)
{
    p->o = *o;
    p->c = *o->config;
    p->prof = *o->profile;
    const mf_profile *f = &p->prof;
    const mf_config *c = &p->c;
    /* a draft round: the draft stages' layers, experts and top-k; every sequence's block of
     * dspark_block_size items (docs/dspark.md); a verify: unit_len items of each sequence */
    p->L0 = o->draft ? c->n_layers : 0;
    p->K = mf_config_layer_topk(c, p->L0);
    p->E = mf_config_layer_experts(c, p->L0);
    p->n_layers = o->draft ? c->n_mtp_layers : c->n_layers;
    p->n_seq = o->batch ? o->batch : 1;
    p->unit_len = o->draft ? c->dspark_block_size : o->unit_len > 1 ? o->unit_len : 1;
    p->batch = p->n_seq * p->unit_len;
    p->l0 = o->draft ? 0 : o->layer_begin;   /* the layers priced (the tables' indices, from L0) */
    p->l1 = o->draft ? p->n_layers : o->layer_begin || o->layer_end ? o->layer_end : c->n_layers;
    p->n_threads = (o->n_sockets ? o->n_sockets : f->n_sockets) *
                   (o->threads_per_socket ? o->threads_per_socket : f->threads_per_socket);
    p->n_cores = f->n_sockets * f->threads_per_socket;
    p->n_cards = o->placement == MF_STEP_PLACE_HOST ? 0 : o->n_cards ? o->n_cards : f->n_cards;
    p->n_dense = o->dense == MF_PLAN_DENSE_CARDS ? (o->n_cards ? o->n_cards : f->n_cards) : 0;
    /* the draft round's experts on the host, or (draft_cards) resident on the cards that own them */
    if (o->draft && !o->draft_cards) p->n_cards = 0;
    for (int cd = 0; cd < p->n_cards && o->draft_cards; cd++)
        p->draft_slots[cd] = mf_dev_xcache_owned(p->n_cards, cd, c->n_layers, c->n_mtp_layers,
                                                 mf_config_layer_experts(c, c->n_layers));
    p->n_lane_cards = p->n_cards > p->n_dense ? p->n_cards : p->n_dense;
    p->emulated = f->cards_emulated;
    p->read_window = o->read_window ? o->read_window : 2;
    p->copy_slots = o->copy_slots ? o->copy_slots : 1;
    p->streamed = o->store == MF_PLAN_STORE_STREAMED && !o->draft;   /* the draft's experts are resident */
    p->pos = o->prefill ? o->context : o->context ? o->context : 16;
    /* a verify's every item; a draft round's the positions whose candidates it picks */
    p->n_head = o->prefill ? 0 : o->draft ? p->n_seq * o->draft : p->batch;
    p->rng = o->seed ^ 0x6d6f65666c6f77ULL;
    /* all threads of a socket streaming weights share its memory bandwidth */
    int per_socket = o->threads_per_socket ? o->threads_per_socket : f->threads_per_socket;
    p->cm = (mf_cost_model){.p = &p->prof,
                            .host_bytes_per_s = f->mem_bytes_per_s > 0 ? f->mem_bytes_per_s / per_socket : 0};
}

/* The engine's lanes, with its models (from the same profile, as an engine given it: `moeflow decode
 * --profile P`) for priorities and hybrid placement, one CPU lane per socket; and the simulator's
 * own lane options. */
static int pl_lanes(mf_plan *p)
{
    const mf_plan_opts *o = &p->o;
    const mf_profile *f = &p->prof;
    int rc, per_socket = o->threads_per_socket ? o->threads_per_socket : f->threads_per_socket;
    mf_step_lane_models(f, p->n_threads, p->models);
    if (o->cpu_bytes_per_s > 0) p->models[0].bytes_per_s = o->cpu_bytes_per_s;
    mf_sg_lanes_init(&p->lt, p->models, p->n_threads, p->streamed || o->tables == MF_PLAN_STORE_STREAMED,
                     p->n_lane_cards);
    /* the simulator's lane options: the disk is one pipe at its bandwidth (reads queue at depth,
     * the latency overlaps); a device lane is one stream, its operations in order (copy-ins:
     * copy_slots streams); emulated cards are host threads: their kernels need a host core, and
     * each device task's round trip through its stream (the stream's thread, the callback) holds
     * the stream's thread and a core for dev_task_ns first */
    /* one CPU lane per socket (the engine's --sockets): every row part of a matrix the host
     * keeps (routed experts, dense weights) on the lane of the socket whose share of its rows it
     * reads (mf_sg_stage_rows), the host tasks without weights spread by item and part, the rest
     * (core prep, Engram gate, route, joins) on socket 0's (the builder) */
    int n_sock = o->n_sockets ? o->n_sockets : f->n_sockets;
    if (n_sock > 1) {
        int thr[MF_SG_MAX_SOCKETS];
        for (int k = 0; k < n_sock && k < MF_SG_MAX_SOCKETS; k++) thr[k] = per_socket;
        if ((rc = mf_sg_lanes_sockets(&p->lt, n_sock, thr, NULL))) return rc;
    }
    if (p->l0 > 0 || p->l1 < p->n_layers) mf_sg_lanes_net(&p->lt);   /* a pipeline stage's boundaries */
    for (int k = 0; k < p->lt.n_sockets; k++) p->lane_core[p->lt.lane_sock[k]] = 1;
    if (p->lt.lane_io >= 0) p->conc[p->lt.lane_io] = 1;
    for (int cd = 0; cd < p->n_lane_cards; cd++)
        for (int k = 0; k < 3; k++) {
            int l = p->lt.lane_dev0 + 3 * cd + k;
            p->conc[l] = k == 0 ? p->copy_slots : 1;
            p->lane_core[l] = k == 1 && p->emulated;
            if (p->emulated)
                p->wake_ns[l] = llround(o->dev_task_ns > 0 ? o->dev_task_ns : f->card[MF_KF_FP4].latency_ns);
        }
    return 0;
}

/* The engine's graph of the shape (*go its options: the card buffers' reserve builds its shapes from
 * them) and its timeline. */
static int pl_graph(mf_plan *p, mf_sg_opts *go)
{
    const mf_plan_opts *o = &p->o;
    const mf_config *c = &p->c;
    /* the engine's graph of a parallel decode shape (serial at batch 1, as the engine's): its
     * bucket's (mf_sg_bucket), the batch's items live; a verify's sequences of unit_len items each
     * the mixed graph of its bucket likewise (one sequence's: serial); a draft round's of its
     * sequences' blocks; or of a prefill chunk (serial) */
    int par = p->batch > 1 && !o->prefill && p->unit_len == 1 && !o->draft;
    int mixed = p->unit_len > 1 && p->n_seq > 1 && !o->draft;
    int unit_end[MF_STEP_DRAFT_ITEMS], units = o->draft ? p->n_seq : 0;
    for (int k = 0; k < units; k++) unit_end[k] = (k + 1) * p->unit_len;
    *go = (mf_sg_opts){.c = c, .sz = p->sz, .n = par || mixed ? mf_sg_bucket(p->batch) : p->batch, .par = par,
                        .mixed = mixed, .n_units = units, .unit_end = units ? unit_end : NULL, .draft = o->draft > 0,
                        .feats = o->feats && !o->draft,
                        .n_threads = p->n_threads, .n_cards = p->n_cards,
                        .n_dense_cards = p->n_dense, .dense_split = o->dense_split, .in_split = o->in_split, .heads = o->heads,
                        .dev_graphs = o->dev_graphs, .store = p->streamed,
                        /* the engine's resident experts: a miss one span
                         * (step_moe_cards.c mf_step_xslot_layout); a store's slots: one copy a part */
                        .miss_copies = p->streamed ? 0 : 1,
                        .eg_reads = o->tables == MF_PLAN_STORE_STREAMED,
                        .read_window = o->read_window, .micro = o->micro,
                        .n_sockets = p->lt.n_sockets, .lane_sock = p->lt.lane_sock, .lanes = p->lt.lane,
                        .n_lanes = p->lt.n_lanes, .lane_io = p->lt.lane_io,
                        .lane_dev0 = p->lt.lane_dev0, .profile = &p->prof,
                        .prefetch_min = o->prefetch_min, .lt = o->lt,
                        .layer_begin = o->layer_begin, .layer_end = o->layer_end, .lane_net = p->lt.lane_net};
    /* the in stage's rows on every dense card where the engine's largest prefill chunk (pl_card_mem's)
     * splits it by items */
    int chunk = o->chunk ? o->chunk : MF_STEP_PREFILL_CHUNK;
    if (o->prefill && p->batch > chunk) chunk = p->batch;
    go->in_whole = mf_sg_in_whole(go, chunk);
    if (o->draft) {   /* no store, device graphs or Engram reads in a draft round (mf_sg_draft_check) */
        go->dev_graphs = go->store = go->eg_reads = 0;
        go->micro = 1;
        go->prefetch_min = -1;
    }
    int rc = mf_stepgraph_new(go, &p->sg);
    if (!rc && (par || mixed)) mf_stepgraph_set_live(p->sg, p->batch);
    if (!rc) p->total.host_bufs = (double)mf_step_host_bytes(c, p->sz, p->sg, 0, p->n_cards, p->n_dense, o->micro);
    go->unit_end = NULL;   /* unit_end is this function's: the reserve below rebuilds from n and par */
    go->n_units = 0;
    go->mixed = 0;
    if (!rc) rc = mf_timeline_create(p->sg->g, &p->tl);
    return rc;
}

/* The streamed store's slots (*store_slots; 0 without a store): its budget's experts, at least a
 * decode batch's. */
static int pl_store_slots(mf_plan *p, int *store_slots)
{
    const mf_plan_opts *o = &p->o;
    double store_slot = p->sz->store_slot_bytes;
    if (p->streamed) {
        uint64_t budget = o->store_budget_bytes ? o->store_budget_bytes : UINT64_C(2) << 30;
        int64_t slots = (int64_t)(budget / store_slot);
        int need = p->batch * p->K < p->E ? p->batch * p->K : p->E;
        if (slots < need) {
            return mf_error(-ENOSPC, "plan: a store budget of %" PRIu64 " bytes holds %" PRId64 " experts of %.0f "
                            "bytes; a decode batch of %d pins up to %d experts of a layer: at least %.0f bytes",
                            budget, slots, store_slot, p->batch, need, need * store_slot);
        }
        if (slots > (int64_t)p->n_layers * p->E) slots = (int64_t)p->n_layers * p->E;
        *store_slots = (int)slots;
    }
    return 0;
}

/* Each dense card's weights and every card's steps' buffers (from go's shapes), refused where a card
 * cannot hold them. */
static int pl_card_mem(mf_plan *p, const mf_sg_opts *go)
{
    const mf_plan_opts *o = &p->o;
    const mf_profile *f = &p->prof;
    const mf_config *c = &p->c;
    int rc;
    for (int cd = 0; cd < p->n_dense; cd++)   /* the dense weights each card holds */
        p->dense_bytes[cd] = mf_sg_dense_card_bytes_in(c, p->sz, p->n_dense, o->dense_split, go->in_whole, cd, o->draft ? 0 : p->l0,
                                                       o->draft ? c->n_layers : p->l1);
    for (int cd = 0; cd < p->n_dense; cd++)
        if (f->card_mem_bytes && p->dense_bytes[cd] > (double)f->card_mem_bytes) {
            return mf_error(-ENOSPC, "plan: card %d: its dense layers take %.0f bytes, the card has %" PRIu64, cd,
                            p->dense_bytes[cd], f->card_mem_bytes);
        }
    /* the steps' buffers on a card (mf_sg_card_bufs): without a budget the engine holds back its
     * largest shapes' (mf_sg_card_reserve: its prefill chunk's and a full decode batch's; an expert
     * store's smaller batches are not modelled, so this is the most it holds back) before it sizes a
     * cache, and refuses a card that cannot hold them; with a budget the cache, the dense weights and
     * this graph's buffers must fit, or the engine's first step fails allocating them */
    mf_sg_card_in ci = {.c = c, .sg = p->sg, .ln = p->batch, .sh_rows = (int64_t)p->sz->sh_rows,
                        .dev_graphs = o->dev_graphs};
    if (p->n_lane_cards && !o->dev_cache_bytes && !o->draft) {
        int chunk = o->chunk ? o->chunk : MF_STEP_PREFILL_CHUNK;
        if (o->prefill && p->batch > chunk) chunk = p->batch;
        /* the engine of `decode --batch B`: its max_batch B past the default */
        int mb = p->batch > MF_STEP_DEFAULT_BATCH && !o->prefill ? p->batch : MF_STEP_DEFAULT_BATCH;
        if ((rc = mf_sg_card_reserve(go, &ci, chunk, mb, &p->act_routed, &p->act_dense))) return rc;
    } else if (p->n_lane_cards) {
        mf_sg_card_bufs b;
        mf_sg_card_bufs_of(&ci, &b);
        p->act_routed = p->n_cards ? (double)b.routed_bytes : 0;
        p->act_dense = p->n_dense ? (double)b.dense_bytes : 0;
    }
    if (p->n_lane_cards) {   /* card 0's, for the report */
        p->total.card_weights = p->n_dense ? p->dense_bytes[0] : 0;
        p->total.card_in_whole = go->in_whole;
        p->total.card_bufs = (p->n_dense ? p->act_dense : 0) + (p->n_cards ? p->act_routed : 0);
    }
    for (int cd = 0; cd < p->n_lane_cards && f->card_mem_bytes; cd++) {
        double need = (cd < p->n_dense ? p->dense_bytes[cd] + p->act_dense : 0) + (cd < p->n_cards ? p->act_routed : 0) +
                      (cd < p->n_cards ? (double)o->dev_cache_bytes : 0);
        if (need > (double)f->card_mem_bytes) {
            return mf_error(-ENOSPC, "plan: card %d cannot hold its dense weights (%.3f GB), the steps' buffers (%.3f GB)%s "
                            "in its %.3f GB, as the engine would refuse it (a shorter --chunk or a smaller --dev-cache "
                            "needs less)", cd, cd < p->n_dense ? p->dense_bytes[cd] / 1e9 : 0,
                            ((cd < p->n_dense ? p->act_dense : 0) + (cd < p->n_cards ? p->act_routed : 0)) / 1e9,
                            o->dev_cache_bytes && cd < p->n_cards ? " and the expert cache's budget" : "",
                            (double)f->card_mem_bytes / 1e9);
        }
    }
    return 0;
}

/* mf_dev_xcache_fit's ask of a card in the plan: n slots of room[1] bytes within its room[0] free. */
static int pl_room_fits(void *ctx, int64_t n)
{
    const double *room = ctx;
    return (double)n * room[1] <= room[0];
}

/* Each card's expert cache slots (dev_slots[card]). */
static int pl_dev_slots(mf_plan *p, int *dev_slots)
{
    const mf_plan_opts *o = &p->o;
    const mf_profile *f = &p->prof;
    double xslot = p->sz->xslot_bytes;
    for (int cd = 0; cd < p->n_cards; cd++) {
        /* mf_dev_xcache_new: the budget's slots, or every expert shrunk until the card holds them
         * (what its dense weights and the steps' buffers held back leave) */
        int64_t n_items = (int64_t)p->n_layers * p->E, slots;
        double mem = f->card_mem_bytes ? (double)f->card_mem_bytes - (cd < p->n_dense ? p->dense_bytes[cd] + p->act_dense : 0) -
                                             p->act_routed
                                       : 0;
        if (o->dev_cache_bytes) {
            slots = (int64_t)(o->dev_cache_bytes / xslot);
        } else {
            double room[2] = {mem, xslot};
            slots = mem > 0 ? mf_dev_xcache_fit(n_items, 1, pl_room_fits, room) : n_items;
            if (slots < 1) slots = 1;
        }
        if (slots > n_items) slots = n_items;
        /* draft_cards: one cache a card over the backbone's and the draft's experts, the draft's
         * share held resident in it (the engine's mf_step_draft_cards): a draft round's plan has
         * that share, a step's the rest */
        if (o->draft) slots = p->draft_slots[cd];
        else slots -= p->draft_slots[cd];
        if (slots < 1) {
            return mf_error(-ENOSPC, "plan: card %d: a cache of %" PRIu64 " bytes holds no expert of %.0f bytes",
                            cd, o->dev_cache_bytes ? o->dev_cache_bytes : f->card_mem_bytes, xslot);
        }
        dev_slots[cd] = (int)slots;
        if (!cd) p->total.card_slots = (int)slots, p->total.card_cache = (double)slots * xslot;
    }
    return 0;
}

/* The steps' tables. */
static int pl_alloc(mf_plan *p)
{
    size_t n_sl = (size_t)p->n_layers * p->sg->n_slots;
    p->ex = malloc(sizeof *p->ex * (size_t)p->n_layers * p->batch * p->K);
    p->task_ns = malloc(sizeof *p->task_ns * (size_t)p->sg->n_tasks);
    p->sl = calloc(n_sl, sizeof *p->sl);
    p->slot_card = malloc(sizeof *p->slot_card * n_sl);
    for (int k = 0; k < 2; k++) {
        p->pre_card[k] = malloc(sizeof *p->pre_card[k] * (size_t)p->E);
        p->pre_miss[k] = malloc((size_t)p->E);
        p->pre_layer[k] = -1;
    }
    p->pre_cached = malloc((size_t)p->E);
    p->n_used = calloc((size_t)p->n_layers * 2, sizeof *p->n_used);
    if (!p->ex || !p->task_ns || !p->sl || !p->slot_card || !p->n_used || !p->pre_card[0] || !p->pre_miss[0] ||
        !p->pre_card[1] || !p->pre_miss[1] || !p->pre_cached) {
        return mf_error(-ENOMEM, "plan: out of memory");
    }
    return 0;
}

int mf_plan_new(const mf_plan_opts *o, mf_plan **out)
{
    *out = NULL;
    int rc = pl_check(o);
    if (rc) return rc;
    mf_plan *p = calloc(1, sizeof *p);
    if (!p) return mf_error(-ENOMEM, "plan: out of memory");
    pl_init(p, o);
    mf_sg_opts go;
    int store_slots = 0, dev_slots[PL_MAX_CARDS] = {0};
    rc = mf_sg_sizes_new(&p->c, &p->sz);
    if (!rc) rc = pl_lanes(p);
    if (!rc) rc = pl_graph(p, &go);
    if (!rc) rc = pl_store_slots(p, &store_slots);
    if (!rc) rc = pl_card_mem(p, &go);
    if (!rc) rc = pl_dev_slots(p, dev_slots);
    if (!rc)
        rc = pl_caches_new(p, store_slots, dev_slots,
                           o->dev_cache_policy == MF_PLAN_CACHE_LRU ? MF_RESID_LRU : MF_RESID_LFU);
    if (!rc && o->draft && p->n_cards) pl_fill_draft(p);
    else if (!rc && o->dev_cache_fill && p->n_cards) rc = pl_fill(p, p->sz->xslot_bytes);
    if (!rc) rc = pl_alloc(p);
    if (rc) {
        mf_plan_free(p);
        return rc;
    }
    *out = p;
    return 0;
}

void mf_plan_free(mf_plan *p)
{
    if (!p) return;
    mf_timeline_destroy(p->tl);
    mf_stepgraph_free(p->sg);
    mf_sg_sizes_free(p->sz);
    free(p->resid_mem);
    free(p->task_ns);
    free(p->sl);
    free(p->slot_card);
    for (int k = 0; k < 2; k++) free(p->pre_card[k]), free(p->pre_miss[k]);
    free(p->pre_cached);
    free(p->n_used);
    free(p->ex);
    free(p);
}

/* ---- routing ------------------------------------------------------------------------------- */

static uint64_t pl_next(uint64_t *s)   /* splitmix64 */
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* The step's routes, ex[(L * batch + t) * K + j], from the routing or uniform draws. */
static int pl_route(mf_plan *p)
{
    int n = p->batch, K = p->K, E = p->E;
    if (p->o.routing && !p->o.draft) return mf_routing_next_units(p->o.routing, p->n_seq, p->unit_len, p->ex);
    for (int L = 0; L < p->n_layers; L++)
        for (int t = 0; t < n; t++) {
            int32_t *e = p->ex + ((size_t)L * n + t) * K;
            for (int j = 0; j < K; j++) {
                int x, dup;
                do {
                    x = (int)(pl_next(&p->rng) % (uint64_t)E);
                    dup = 0;
                    for (int i = 0; i < j; i++) dup |= e[i] == x;
                } while (dup);
                e[j] = x;
            }
        }
    return 0;
}

/* ---- the step ------------------------------------------------------------------------------ */

/* Prefetch: a cache slot on card cd for expert e of layer ctx's (mf_sg_take_fn), the victim by its
 * layer's next use as the engine's (device/expert_cache.h mf_dev_xcache_acquire_ahead). */
typedef struct pl_take {
    mf_plan *p;
    int L;
    mf_plan_report *r;
} pl_take;

static int pl_take_slot(void *ctx, int cd, int e, int *hit)
{
    pl_take *k = ctx;
    int slot, h = mf_resid_acquire_ahead(k->p->dev[cd], k->L * k->p->E + e, k->p->E, &slot);
    if (h == -ENOSPC) {
        k->r->host_fallbacks++;
        return 0;
    }
    *hit = h;
    return 1;
}

/* The placer as the engine makes it (graphs/step/step_moe_cards.c mf_step_placer_init): a miss one copy
 * without a streamed store (the model's resident layout), one per part with one. */
static void pl_placer_init(const mf_plan *p, mf_sg_placer *pl)
{
    mf_work ew;
    mf_sg_expert_work(&p->c, p->sz, &ew);
    mf_sg_placer_init(pl, p->models, &p->prof, p->n_threads, p->o.placement == MF_STEP_PLACE_HYBRID,
                      p->sz->xslot_bytes, ew.macs[MF_KF_FP4], mf_sg_slot_tok_bytes(&p->c, 0),
                      mf_sg_slot_tok_bytes(&p->c, 1), p->streamed ? 0 : 1);
    mf_sg_place_lt(pl, p->sg->lt_ffn ? p->o.lt : MF_SG_LT_OFF);
    mf_sg_place_gather(pl, p->sg->slot_gather);
}

/* Prefetch: layer L's experts placed as the engine's place task does (mf_sg_place_all, every
 * expert with the chunk's expected tokens, the copies' head start pre_ahead_ns), their cache slots
 * taken and pinned, the copy tasks marked; the counts are of experts (every one, used or not). */
static void pl_prefetch(mf_plan *p, int L, mf_plan_report *r)
{
    int E = p->E, tok = (p->batch * p->K + E - 1) / E;
    for (int e = 0; e < E; e++)
        p->pre_cached[e] = mf_resid_slot(p->dev[mf_dev_xcache_owner(p->n_cards, p->L0 + L, e)], L * E + e) >= 0;
    mf_sg_placer pl;
    pl_placer_init(p, &pl);
    mf_sg_place_ahead(&pl, p->sg->pre_ahead_ns[L], p->sg->pre_moe_host_ns[L], p->pre_left_layer == L - 1 ? p->pre_left : NULL);
    mf_sg_place_shared(&pl, p->sg, L, 0);
    pl_take k = {p, L, r};
    int32_t *card = p->pre_card[L & 1];
    uint8_t *miss = p->pre_miss[L & 1];
    int on = mf_sg_place_all(&pl, &p->c, L, p->n_cards, tok, p->pre_cached, pl_take_slot, &k, card, miss);
    p->pre_layer[L & 1] = L;
    mf_sg_place_left(&pl, p->pre_left);
    p->pre_left_layer = L;
    r->dev_slots += on;
    r->host_slots += E - on;
    for (int e = 0; e < E; e++) {
        if (card[e] < 0) continue;
        if (!miss[e]) r->dev_hits++;
        else {
            r->dev_misses++;
            r->dev_bytes_in += (uint64_t)p->sz->xslot_bytes;
        }
    }
    mf_stepgraph_mark_prefetch(p->sg, L, card, miss);
}

/* Prefetch: the pins of the layer of parity k released (its MoE done), if it holds one. */
static void pl_prefetch_release(mf_plan *p, int k)
{
    int L = p->pre_layer[k];
    for (int e = 0; L >= 0 && e < p->E; e++)
        if (p->pre_card[k][e] >= 0) mf_resid_unpin(p->dev[p->pre_card[k][e]], mf_resid_slot(p->dev[p->pre_card[k][e]], L * p->E + e));
    p->pre_layer[k] = -1;
}

/* Micro-batch h's slot table of layer L (of the graph's: layer L0 + L) as the engine's route task builds it (distinct experts of
 * its tokens ascending, their token counts), the store's begin (hits and misses, pinned) and the
 * engine's placement (card or host; cache slots taken and pinned, a miss evicting by the next use
 * of the victim's layer), then the noop marks; its MoE's
 * end releases the pins (before the next micro-batch's route, as the graph orders them). */
static int pl_layer_slots(mf_plan *p, int L, int h, mf_plan_report *r)
{
    int n = p->batch, K = p->K, E = p->E, n_slots = p->sg->n_slots;
    int i0 = h ? p->sg->half_end[h - 1] : 0, i1 = p->sg->half_end[h] < n ? p->sg->half_end[h] : n;   /* live items */
    int s0 = p->sg->half_slot[h];
    int n_half = p->sg->half_slot[h + 1] - s0, ns = 0;
    pl_slot *sl = p->sl + (size_t)L * n_slots + s0;   /* the micro-batch's slots */
    int32_t *card = p->slot_card + (size_t)L * n_slots + s0;
    int32_t cnt[4096];
    int32_t *cn = E <= 4096 ? cnt : calloc((size_t)E, sizeof *cn);
    if (!cn) return mf_error(-ENOMEM, "plan: out of memory");
    memset(cn, 0, sizeof *cn * (size_t)E);
    for (int j = i0 * K; j < i1 * K; j++) cn[p->ex[(size_t)L * n * K + j]]++;
    for (int e = 0; e < E; e++)
        if (cn[e]) sl[ns++] = (pl_slot){.e = e, .cnt = cn[e], .card = -1};
    if (cn != cnt) free(cn);
    for (int s = ns; s < n_half; s++) sl[s] = (pl_slot){.e = -1, .card = -1};
    p->n_used[2 * L + h] = ns;
    for (int s = 0; p->streamed && s < ns; s++) {
        int slot, hit = mf_resid_acquire(p->store, L * E + sl[s].e, &slot);
        if (hit < 0) return mf_error(-ENOSPC, "plan: the expert store's slots are all pinned (internal)");
        sl[s].store_miss = !hit;
        if (hit) r->store_hits++;
        else {
            r->store_misses++;
            r->store_bytes_read += (uint64_t)p->sz->store_slot_bytes;
        }
    }
    if (!p->n_cards) r->host_slots += ns;
    if (p->sg->prefetch) {   /* placed at the layer's start: the slots take their experts' places */
        pl_prefetch(p, L, r);
        for (int s = 0; s < ns; s++) {
            sl[s].card = p->pre_card[L & 1][sl[s].e];
            sl[s].miss = 0;
        }
        for (int s = 0; s < n_half; s++) card[s] = sl[s].card;
        mf_stepgraph_mark_noop_half(p->sg, L + p->L0, h, ns, card);
        /* the previous layer's end: its pins released after this layer's are taken (the graph
         * orders the MoE done after the next layer's place task: mf_sg_prefetch); the last
         * layer's at the step's end (pl_price) */
        pl_prefetch_release(p, (L + 1) & 1);
        return 0;
    }
    mf_sg_placer pl;
    pl_placer_init(p, &pl);
    mf_sg_place_shared(&pl, p->sg, L, h);
    for (int s = 0; s < ns && p->n_cards; s++) {   /* all on the host's queue; miss: not cached (the pass) */
        int e = sl[s].e;
        sl[s].miss = mf_resid_slot(p->dev[mf_dev_xcache_owner(p->n_cards, p->L0 + L, e)], L * E + e) < 0;
        mf_sg_place_host_work(&pl, sl[s].cnt);
    }
    for (int pass = 0; pass < 2 && p->n_cards; pass++)   /* the cached slots first, then the rest */
        for (int s = 0; s < ns; s++) {
            if (sl[s].miss != pass) continue;
            int e = sl[s].e, c = mf_dev_xcache_owner(p->n_cards, p->L0 + L, e), slot;
            if (!mf_sg_place_want_card(&pl, c, sl[s].cnt, !pass)) {
                r->host_slots++;
                continue;
            }
            int hit = mf_resid_acquire_ahead(p->dev[c], L * E + e, E, &slot);   /* as the engine's route */
            if (hit == -ENOSPC) {
                r->host_slots++;
                r->host_fallbacks++;
                continue;
            }
            mf_sg_place_card(&pl);
            sl[s].card = c;
            sl[s].miss = !hit;
            r->dev_slots++;
            if (hit) r->dev_hits++;
            else {
                r->dev_misses++;
                r->dev_bytes_in += (uint64_t)p->sz->xslot_bytes;
            }
        }
    for (int s = 0; s < n_half; s++) card[s] = sl[s].card;
    mf_stepgraph_mark_noop_half(p->sg, L + p->L0, h, ns, card);
    for (int s = 0; s < ns; s++) {   /* the layer's end: store batch closed, pins released */
        int item = L * E + sl[s].e;
        if (p->streamed) mf_resid_unpin(p->store, mf_resid_slot(p->store, item));
        if (sl[s].card >= 0) mf_resid_unpin(p->dev[sl[s].card], mf_resid_slot(p->dev[sl[s].card], item));
    }
    return 0;
}

/* This step's slot tables, noop marks and task durations (every task pays the executor's cost of
 * starting and finishing it; noop tasks cost nothing). */
static int pl_price(mf_plan *p, mf_plan_report *r)
{
    if (p->o.draft) mf_stepgraph_mark_draft(p->sg, p->o.draft);   /* the chain's candidates asked for */
    p->pre_left_layer = -1;
    for (int L = p->l0; L < p->l1; L++)
        for (int h = 0; h < p->sg->n_halves; h++) {
            int rc = pl_layer_slots(p, L, h, r);
            if (rc) return rc;
        }
    for (int k = 0; k < 2; k++) pl_prefetch_release(p, k);
    for (int t = 0; t < p->sg->n_tasks; t++) {
        int ov = 1;
        double ns = mf_graph_noop(p->sg->g, t) ? 0 : pl_task_ns(p, &p->sg->task[t], r, &ov);
        p->task_ns[t] = mf_graph_noop(p->sg->g, t) ? 0 : llround(ns + (ov ? p->prof.task_overhead_ns : 0));
    }
    return 0;
}

/* ---- reports ------------------------------------------------------------------------------- */

/* The engine's phase accounting (mf_stepgraph_phase_times), lanes' work, the makespan. */
static int pl_account(mf_plan *p, mf_plan_report *r)
{
    const mf_task_span *sp = mf_timeline_spans(p->tl);
    const mf_graph *g = p->sg->g;
    int n = mf_graph_n_tasks(g);
    mf_task_span *scratch = malloc(sizeof *scratch * (size_t)(n ? n : 1));
    if (!scratch) return mf_error(-ENOMEM, "plan: out of memory");
    int64_t end = 0;
    for (int t = 0; t < n; t++) {
        if (sp[t].end_ns > end) end = sp[t].end_ns;
        int lane = mf_graph_task(g, t)->lane;
        int64_t d = sp[t].end_ns - sp[t].start_ns;
        r->lanes[lane].busy_ns += d;
        int op = p->sg->task[t].op;
        if (op < MF_SG_N_OPS && !mf_graph_noop(g, t)) {
            *(p->lt.sock_of_lane[lane] >= 0 ? &r->op_cpu_ns[op] : &r->op_other_ns[op]) += d;
            r->op_tasks[op]++;
        }
    }
    mf_stepgraph_phase_times(p->sg, sp, scratch, r->phase_ns, r->busy_ns);
    free(scratch);
    int64_t rest = end;
    for (int q = 0; q < MF_STEP_OTHER; q++) rest -= r->phase_ns[q];
    r->phase_ns[MF_STEP_OTHER] = rest > 0 ? rest : 0;
    r->step_ns = end;
    r->n_tasks = n;
    return 0;
}

static void pl_shares(const mf_plan *p, mf_plan_report *r, double step_ns)
{
    r->n_lanes = p->lt.n_lanes;
    r->bottleneck = 0;
    for (int l = 0; l < p->lt.n_lanes; l++) {
        snprintf(r->lanes[l].name, sizeof r->lanes[l].name, "%s", p->lt.lane[l].name);
        r->lanes[l].slots = p->conc[l] > 0 ? p->conc[l] : p->lt.lane[l].concurrency;
        r->lanes[l].share = step_ns > 0 ? r->lanes[l].busy_ns / (double)r->lanes[l].slots / step_ns : 0;
        if (r->lanes[l].share > r->lanes[r->bottleneck].share) r->bottleneck = l;
    }
}

int mf_plan_step(mf_plan *p, mf_plan_report *out)
{
    mf_plan_report r = {.n_steps = 1, .batch = p->batch};
    int rc = pl_route(p);
    if (rc) return mf_error_wrap(rc, "plan: routing of step %d", p->total.n_steps);
    mf_resid_stats st;
    if (p->store) mf_resid_step(p->store, NULL);
    for (int cd = 0; cd < p->n_cards; cd++) mf_resid_step(p->dev[cd], NULL);
    if ((rc = pl_price(p, &r))) return mf_error_wrap(rc, "plan: step %d", p->total.n_steps);
    for (int cd = 0; cd < p->n_cards; cd++) {
        mf_resid_step(p->dev[cd], &st);
        r.dev_evictions += st.evictions;
    }
    if (p->store) {
        mf_resid_step(p->store, &st);
        r.store_evictions = st.evictions;
    }
    rc = mf_sim_run_opts(p->sg->g, &(mf_sim_opts){.task_ns = p->task_ns, .lane_core = p->lane_core,
                                                  .n_cores = p->emulated && p->n_lane_cards ? p->n_cores : 0,
                                                  .concurrency = p->conc, .wake_ns = p->wake_ns,
                                                  .spin_ns = llround(p->prof.worker_spin_ns),
                                                  .sleep_wake_ns = llround(p->prof.worker_wake_ns)},
                         p->tl);
    if (!rc) rc = pl_account(p, &r);
    if (rc) return rc;
    p->pos += p->o.prefill ? p->batch : 1;
    p->stepped = 1;
    pl_shares(p, &r, (double)r.step_ns);
    r.token_ns = (double)r.step_ns / p->batch;
    /* totals */
    mf_plan_report *t = &p->total;
    t->n_steps++;
    t->batch = p->batch;
    t->step_ns += r.step_ns;
    for (int q = 0; q < MF_STEP_N_PHASES; q++) {
        t->phase_ns[q] += r.phase_ns[q];
        t->busy_ns[q] += r.busy_ns[q];
    }
    for (int l = 0; l < p->lt.n_lanes; l++) t->lanes[l].busy_ns += r.lanes[l].busy_ns;
    for (int op = 0; op < MF_SG_N_OPS; op++) {
        t->op_cpu_ns[op] += r.op_cpu_ns[op];
        t->op_other_ns[op] += r.op_other_ns[op];
        t->op_tasks[op] += r.op_tasks[op];
    }
    t->n_tasks = r.n_tasks;
    t->dev_slots += r.dev_slots;
    t->host_slots += r.host_slots;
    t->host_fallbacks += r.host_fallbacks;
    t->dev_hits += r.dev_hits;
    t->dev_misses += r.dev_misses;
    t->dev_bytes_in += r.dev_bytes_in;
    t->store_hits += r.store_hits;
    t->store_misses += r.store_misses;
    t->store_bytes_read += r.store_bytes_read;
    t->table_bytes_read += r.table_bytes_read;
    t->dev_evictions += r.dev_evictions;
    t->store_evictions += r.store_evictions;
    if (out) *out = r;
    return 0;
}

void mf_plan_total(const mf_plan *p, mf_plan_report *out)
{
    *out = p->total;
    int n = out->n_steps;
    if (!n) {
        *out = (mf_plan_report){.batch = p->batch, .fill_experts = p->total.fill_experts,
                                .fill_bytes = p->total.fill_bytes, .fill_ns = p->total.fill_ns,
                                .card_weights = p->total.card_weights, .card_bufs = p->total.card_bufs,
                                .card_slots = p->total.card_slots, .card_in_whole = p->total.card_in_whole,
                                .host_bufs = p->total.host_bufs,
                                .card_cache = p->total.card_cache};
        return;
    }
    out->step_ns = p->total.step_ns / n;
    for (int q = 0; q < MF_STEP_N_PHASES; q++) {
        out->phase_ns[q] /= n;
        out->busy_ns[q] /= n;
    }
    for (int l = 0; l < p->lt.n_lanes; l++) out->lanes[l].busy_ns /= n;
    for (int op = 0; op < MF_SG_N_OPS; op++) {
        out->op_cpu_ns[op] /= n;
        out->op_other_ns[op] /= n;
        out->op_tasks[op] /= n;
    }
    pl_shares(p, out, (double)p->total.step_ns / n);
    out->token_ns = (double)out->step_ns / p->batch;
}

void mf_plan_reset_totals(mf_plan *p)
{
    p->total = (mf_plan_report){.batch = p->batch, .fill_experts = p->total.fill_experts,
                                .fill_bytes = p->total.fill_bytes, .fill_ns = p->total.fill_ns,
                                .card_weights = p->total.card_weights, .card_bufs = p->total.card_bufs,
                                .card_slots = p->total.card_slots, .card_in_whole = p->total.card_in_whole,
                                .host_bufs = p->total.host_bufs,
                                .card_cache = p->total.card_cache};
}

int mf_plan_run(const mf_plan_opts *o, int warmup, int n_steps, mf_plan_report *out)
{
    if (warmup < 0 || n_steps < 1)
        return mf_error(-EINVAL, "plan: %d warm-up and %d measured steps (expected >= 0 and >= 1)", warmup, n_steps);
    mf_plan *p;
    int rc = mf_plan_new(o, &p);
    for (int i = 0; !rc && i < warmup; i++) rc = mf_plan_step(p, NULL);
    if (!rc) mf_plan_reset_totals(p);
    for (int i = 0; !rc && i < n_steps; i++) rc = mf_plan_step(p, NULL);
    if (!rc) mf_plan_total(p, out);
    mf_plan_free(p);
    return rc;
}

int mf_plan_prefill(const mf_plan_opts *o, int64_t n_prompt, int chunk, mf_plan_report *out, int64_t *ttft_ns)
{
    return mf_plan_prefill_trace(o, n_prompt, chunk, out, ttft_ns, NULL);
}

int mf_plan_prefill_trace(const mf_plan_opts *o, int64_t n_prompt, int chunk, mf_plan_report *out,
                          int64_t *ttft_ns, const char *trace_path)
{
    return mf_plan_prefill_at(o, 0, n_prompt, chunk, out, ttft_ns, trace_path);
}

int mf_plan_prefill_at(const mf_plan_opts *o, int64_t n_cached, int64_t n_prompt, int chunk, mf_plan_report *out,
                       int64_t *ttft_ns, const char *trace_path)
{
    *ttft_ns = 0;
    if (chunk == 0) chunk = MF_STEP_PREFILL_CHUNK;
    if (n_prompt < 1 || chunk < 1 || chunk > MF_STEP_MAX_CHUNK)
        return mf_error(-EINVAL, "plan: prefill of %" PRId64 " tokens in chunks of %d (expected >= 1 tokens, "
                        "chunks of 1..%d)", n_prompt, chunk, MF_STEP_MAX_CHUNK);
    if (n_cached < 0 || n_cached >= n_prompt)
        return mf_error(-EINVAL, "plan: %" PRId64 " cached positions of a %" PRId64 "-token prompt (expected 0..%" PRId64
                        ": a token is left to run)", n_cached, n_prompt, n_prompt - 1);
    int64_t n_run = n_prompt - n_cached, n_full = n_run / chunk, rest = n_run % chunk;
    mf_plan_report last = {0};
    for (int part = 0; part < 2; part++) {   /* the full chunks, then the shorter last one */
        int64_t n_steps = part ? (rest > 0) : n_full;
        if (!n_steps) continue;
        mf_plan_opts po = *o;
        po.prefill = 1;
        po.chunk = chunk;
        po.batch = part ? (int)rest : chunk;
        po.context = n_cached + (part ? n_full * chunk : 0);
        mf_plan *p = NULL;
        int rc = mf_plan_new(&po, &p);
        for (int64_t k = 0; k < n_steps && !rc; k++) {
            p->n_head = k + 1 == n_steps && (part || !rest);   /* the prompt's last position */
            rc = mf_plan_step(p, &last);
            *ttft_ns += last.step_ns;
        }
        if (!rc && out && !part) mf_plan_total(p, out);
        else if (!rc && out && !n_full) *out = last;
        if (!rc && trace_path && (!part || !n_full)) rc = mf_plan_write_trace(p, trace_path);
        mf_plan_free(p);
        if (rc) return mf_error_wrap(rc, "plan: prefill of %" PRId64 " tokens", n_prompt);
    }
    return 0;
}

const mf_stepgraph *mf_plan_graph(const mf_plan *p) { return p->sg; }

int mf_plan_write_trace(const mf_plan *p, const char *path)
{
    if (!p->stepped) return mf_error(-EINVAL, "plan: no step has been simulated yet, nothing to trace");
    return mf_timeline_write_chrome(p->tl, path);
}

void mf_plan_print(const mf_plan_report *r, FILE *f)
{
    fprintf(f, "predicted: %.3f ms per step of %d, %.3f ms per token (%.2f tokens/s), %d tasks, mean of %d steps\n",
            r->step_ns / 1e6, r->batch, r->token_ns / 1e6, r->token_ns > 0 ? 1e9 / r->token_ns : 0, r->n_tasks,
            r->n_steps);
    fprintf(f, "\n%-16s %12s %12s\n", "phase", "wall ms", "work ms");
    for (int q = 0; q < MF_STEP_N_PHASES; q++)
        fprintf(f, "%-16s %12.3f %12.3f\n", mf_step_phase_name((mf_step_phase)q), r->phase_ns[q] / 1e6,
                r->busy_ns[q] / 1e6);
    fprintf(f, "\n%-16s %6s %12s %8s\n", "lane", "slots", "work ms", "busy");
    for (int l = 0; l < r->n_lanes; l++)
        fprintf(f, "%-16s %6d %12.3f %7.1f%%%s\n", r->lanes[l].name, r->lanes[l].slots, r->lanes[l].busy_ns / 1e6,
                100 * r->lanes[l].share, l == r->bottleneck ? "  <- bottleneck" : "");
    fprintf(f, "\nrouted-expert slots: %" PRId64 " on cards, %" PRId64 " on the host (%" PRId64 " fallbacks)\n",
            r->dev_slots, r->host_slots, r->host_fallbacks);
    if (r->dev_slots)
        fprintf(f, "device caches: %" PRIu64 " hits, %" PRIu64 " misses, %" PRIu64 " evictions, %.1f MiB in\n",
                r->dev_hits, r->dev_misses, r->dev_evictions, r->dev_bytes_in / 1048576.0);
    if (r->store_hits + r->store_misses)
        fprintf(f, "host store: %" PRIu64 " hits, %" PRIu64 " misses, %" PRIu64 " evictions, %.1f MiB read\n",
                r->store_hits, r->store_misses, r->store_evictions, r->store_bytes_read / 1048576.0);
    if (r->table_bytes_read) fprintf(f, "Engram rows read: %.2f MiB\n", r->table_bytes_read / 1048576.0);
    if (r->card_weights + r->card_bufs > 0)
        fprintf(f, "card 0 memory: dense weights %.3f GB, the steps' buffers %.3f GB (held back from its cache), "
                "expert cache %d slots (%.3f GB)\n", r->card_weights / 1e9, r->card_bufs / 1e9, r->card_slots,
                r->card_cache / 1e9);
    if (r->host_bufs > 0) fprintf(f, "host memory: the step's buffers %.3f GB\n", r->host_bufs / 1e9);
    if (r->fill_experts)
        fprintf(f, "warm fill at start: %" PRId64 " experts, %.2f GB copied in, %.3f s\n", r->fill_experts,
                r->fill_bytes / 1e9, r->fill_ns / 1e9);
}
