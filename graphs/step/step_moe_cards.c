/* The scheduled engine's routed experts on cards (placement seed or hybrid; docs/device.md): where
 * the route puts a micro-batch's slots (mf_step_place) or the prefetch a layer's experts, their
 * cache slots on the cards (device/expert_cache.h), the device tasks of a slot (copy in, FFN or a
 * layer's captured graph, copy out), a failed run's device task named; and the engine's setup of
 * them at mf_step_new (the card slot's layout, the expert caches). Called by step_moe.c's route. */
#include <errno.h>
#include <stdatomic.h>
#include <string.h>

#include "graphs/step/dev_fill.h"
#include "graphs/step/step_impl.h"
#include "sched/error.h"

/* With device graphs: the slot tables of micro-batch h's slots of layer L: a card's own slots, the
 * rest unused. */
static void mf_step_dev_tables(mf_step_shape *sh, int L, int h)
{
    mf_step *eng = sh->eng;
    int s0 = sh->sg->half_slot[h], s1 = sh->sg->half_slot[h + 1];
    if (eng->dev_graphs && sh->sg->dev_graphs)   /* not a draft round's (mf_step_draft_opts) */
        for (int c = 0; c < eng->n_cards; c++) {
            mf_dev_ffn_slot *tab = sh->htab[c] + (size_t)L * sh->n_slots;
            for (int s = s0; s < s1; s++)
                tab[s] = mf_step_slot_live(sh, s) && sh->slot_card[s] == c
                             ? (mf_dev_ffn_slot){(uint64_t)(uintptr_t)sh->slot_dev[s], sh->slot_off[s], sh->slot_cnt[s]}
                             : (mf_dev_ffn_slot){0, 0, 0};
        }
}

/* The engine's placer for a layer's routed experts (mf_sg_placer): its lanes' models, profile and
 * workers, the packed expert's card bytes and multiply-adds, a slot's token bytes, and a miss's
 * copies as the engine makes them (one span when the model's layout allows). */
static void mf_step_placer_init(const mf_step *eng, mf_sg_placer *pl)
{
    mf_work ew;
    mf_sg_expert_work(eng->c, eng->sz, &ew);
    mf_sg_placer_init(pl, eng->models, eng->o.profile, eng->o.n_threads, eng->o.placement == MF_STEP_PLACE_HYBRID,
                      (double)eng->xslot_bytes, ew.macs[MF_KF_FP4], mf_sg_slot_tok_bytes(eng->c, 0),
                      mf_sg_slot_tok_bytes(eng->c, 1), eng->miss_span ? 1 : 0);
}

/* The placer of shape sh: its experts' compute priced on the path they take (mf_sg_place_lt). */
static void mf_step_placer_of(const mf_step_shape *sh, mf_sg_placer *pl)
{
    mf_step_placer_init(sh->eng, pl);
    mf_sg_place_lt(pl, sh->sg->lt_ffn ? sh->eng->lt_mode : MF_SG_LT_OFF);
    mf_sg_place_gather(pl, sh->sg->slot_gather);
}

/* Decides where micro-batch h's slots of layer L run (sh->slot_card) and takes their cache slots
 * on the cards (pinned until its MoE's end; a miss evicts by the next use of the victim's layer,
 * mf_dev_xcache_acquire_ahead, as the simulator's pl_layer_slots): SEED the owner card; HYBRID by
 * mf_sg_placer (the cached slots offered first, each moved to its card while the card ends no
 * later than the host's queue of expert work over the workers). */
int mf_step_place(mf_step_shape *sh, int L, int h)
{
    mf_step *eng = sh->eng;
    mf_sg_placer pl;
    int s0 = sh->sg->half_slot[h], s1 = sh->sg->half_slot[h + 1];
    mf_step_placer_of(sh, &pl);
    mf_sg_place_shared(&pl, sh->sg, L, h);
    sh->dev_layer = L;
    sh->dev_half = h;
    int s_end = s0 + sh->n_used[h];
    for (int s = s0; s < s1; s++) sh->slot_card[s] = -1;
    if (L >= eng->c->n_layers && !eng->dcards) {   /* the draft's experts not on the cards: all on the host */
        eng->dstat.host_slots += sh->n_used[h];
        return 0;
    }
    for (int s = s0; s < s_end; s++) {   /* all on the host's queue; slot_miss: not cached (the pass) */
        int e = sh->slot_e[s];
        sh->slot_miss[s] = (uint8_t)!mf_dev_xcache_has(eng->xc[mf_dev_xcache_owner(eng->n_cards, L, e)], L, e);
        mf_sg_place_host_work(&pl, sh->slot_cnt[s]);
    }
    for (int pass = 0; pass < 2; pass++)   /* the cached slots first, then the rest */
        for (int s = s0; s < s_end; s++) {
            if (sh->slot_miss[s] != pass) continue;
            int e = sh->slot_e[s], c = mf_dev_xcache_owner(eng->n_cards, L, e);
            if (!mf_sg_place_want_card(&pl, c, sh->slot_cnt[s], !pass)) {
                eng->dstat.host_slots++;
                continue;
            }
            void *slot = NULL;
            int hit = 0, rc = mf_dev_xcache_acquire_ahead(eng->xc[c], L, e, &slot, &hit);   /* victims by their layer's next use */
            if (rc == -ENOSPC) {   /* every cache slot of the card pinned: the host keeps it */
                eng->dstat.host_slots++;
                eng->dstat.host_fallbacks++;
                continue;
            }
            if (rc) return rc;
            mf_sg_place_card(&pl);
            sh->slot_card[s] = c;
            sh->slot_dev[s] = slot;
            sh->slot_miss[s] = (uint8_t)!hit;
            eng->dstat.dev_slots++;
        }
    mf_step_dev_tables(sh, L, h);
    return 0;
}

/* Prefetch: layer L's experts placed by the expected tokens of the chunk (mf_sg_place_all, as the
 * simulator's pl_prefetch), their cache slots taken and pinned until the layer's MoE done, the
 * copy tasks of hits and host experts marked noop. The state of layer L's parity: the previous
 * layer's pins are held meanwhile (its MoE done follows this task, mf_sg_prefetch). */
typedef struct mf_step_take {
    mf_step_shape *sh;
    int L, rc;
} mf_step_take;

static int mf_step_take_slot(void *ctx, int c, int e, int *hit)
{
    mf_step_take *k = ctx;
    mf_step *eng = k->sh->eng;
    void *slot = NULL;
    if (k->rc) return 0;
    int rc = mf_dev_xcache_acquire_ahead(eng->xc[c], k->L, e, &slot, hit);   /* victims by their layer's next use */
    if (rc == -ENOSPC) {   /* every cache slot of the card pinned: the host keeps it */
        eng->dstat.host_fallbacks++;
        return 0;
    }
    if (rc) {
        k->rc = rc;
        return 0;
    }
    k->sh->pre_dev[k->L & 1][e] = slot;
    return 1;
}

static int mf_task_moe_place(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    mf_step *eng = sh->eng;
    int L = a->t->layer, E = eng->c->n_routed_experts, tok = (sh->sg->n * eng->c->n_experts_per_tok + E - 1) / E;
    int k = L & 1;
    if (sh->pre_layer[k] >= 0) return mf_error(-EINVAL, "step: layer %d placed while layer %d's experts are pinned "
                                               "(internal)", L, sh->pre_layer[k]);
    for (int e = 0; e < E; e++)
        sh->pre_cached[e] = (uint8_t)mf_dev_xcache_has(eng->xc[mf_dev_xcache_owner(eng->n_cards, L, e)], L, e);
    mf_sg_placer pl;
    mf_step_placer_of(sh, &pl);
    mf_sg_place_ahead(&pl, sh->sg->pre_ahead_ns[L], sh->sg->pre_moe_host_ns[L],
                      sh->pre_left_layer == L - 1 ? sh->pre_left : NULL);
    mf_sg_place_shared(&pl, sh->sg, L, 0);
    mf_step_take tk = {sh, L, 0};
    int on = mf_sg_place_all(&pl, eng->c, L, eng->n_cards, tok, sh->pre_cached, mf_step_take_slot, &tk, sh->pre_card[k],
                             sh->pre_miss[k]);
    sh->pre_layer[k] = L;
    mf_sg_place_left(&pl, sh->pre_left);
    sh->pre_left_layer = L;
    if (tk.rc) {
        mf_step_pre_release(sh, k, 1);
        return mf_error_wrap(tk.rc, "step: layer %d: the experts' cache slots on the cards", L);
    }
    eng->dstat.dev_slots += on;
    eng->dstat.host_slots += E - on;
    mf_stepgraph_mark_prefetch(sh->sg, L, sh->pre_card[k], sh->pre_miss[k]);
    return 0;
}

/* Prefetch, card a->t->card's h2d lane: expert a->t->part's parts into its cache slot (nothing on a
 * hit or when the host keeps it). */
static int mf_task_dev_pre(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    mf_step *eng = sh->eng;
    int e = a->t->part, k = a->t->layer & 1;
    if (sh->pre_card[k][e] != a->t->card || !sh->pre_miss[k][e]) return MF_TASK_NO_WORK;
    const mf_weight *ew = &mf_model_layer_at(eng->ly->m, a->t->layer)->experts[e * 3];
    const void *src[6] = {ew[0].data, ew[0].scale, ew[1].data, ew[1].scale, ew[2].data, ew[2].scale};
    int rc = mf_dev_copy_expert(ctx->queue, sh->pre_dev[k][e], src, eng->part_off, eng->part_bytes);
    if (rc > 0) atomic_fetch_add_explicit(&eng->miss_spans, 1, memory_order_relaxed);
    return rc > 0 ? 0 : rc;
}

/* Prefetch, in the route: each used slot where its expert was placed (in its cache slot already,
 * so its copy-in copies the rows only). */
void mf_step_place_pre(mf_step_shape *sh, int L, int h)
{
    int s0 = sh->sg->half_slot[h], k = L & 1;
    for (int s = s0; s < sh->sg->half_slot[h + 1]; s++) {
        int used = s - s0 < sh->n_used[h], e = used ? sh->slot_e[s] : -1;
        sh->slot_card[s] = used ? sh->pre_card[k][e] : -1;
        sh->slot_dev[s] = used ? sh->pre_dev[k][e] : NULL;
        sh->slot_miss[s] = 0;
    }
    sh->dev_layer = L;   /* its slot table live until its MoE done */
    sh->dev_half = h;
    mf_step_dev_tables(sh, L, h);
}

/* Prefetch: releases the cache slots of the layer of parity k (its placed experts, used or not;
 * after its device tasks), and its slot table if live; failed: misses are forgotten, their slots
 * may hold a partial copy. */
void mf_step_pre_release(mf_step_shape *sh, int k, int failed)
{
    mf_step *eng = sh->eng;
    int L = sh->pre_layer[k];
    if (L < 0) return;
    for (int e = 0; e < eng->c->n_routed_experts; e++) {
        int c = sh->pre_card[k][e];
        if (c < 0) continue;
        if (failed && sh->pre_miss[k][e]) mf_dev_xcache_drop(eng->xc[c], L, e);
        else mf_dev_xcache_release(eng->xc[c], L, e);
        sh->pre_card[k][e] = -1;
    }
    sh->pre_layer[k] = -1;
    if (sh->dev_layer != L) return;
    for (int s = 0; s < sh->n_slots; s++) sh->slot_card[s] = -1;
    sh->dev_layer = -1;
}

int mf_step_dev_pinned(const mf_step_shape *sh)
{
    return sh->dev_layer >= 0 || sh->pre_layer[0] >= 0 || sh->pre_layer[1] >= 0;
}

/* Releases layer sh->dev_layer's cache slots (after its device tasks; prefetch: every pinned
 * layer's); failed: misses are forgotten, their slots may hold a partial copy. */
void mf_step_dev_release(mf_step_shape *sh, int failed)
{
    mf_step *eng = sh->eng;
    if (sh->sg->prefetch) {
        for (int k = 0; k < 2; k++) mf_step_pre_release(sh, k, failed);
        sh->dev_layer = -1;
        return;
    }
    if (sh->dev_layer < 0) return;
    int s0 = sh->sg->half_slot[sh->dev_half];
    for (int s = s0; s < s0 + sh->n_used[sh->dev_half]; s++) {
        int c = sh->slot_card[s];
        if (c < 0) continue;
        if (failed && sh->slot_miss[s]) mf_dev_xcache_drop(eng->xc[c], sh->dev_layer, sh->slot_e[s]);
        else mf_dev_xcache_release(eng->xc[c], sh->dev_layer, sh->slot_e[s]);
        sh->slot_card[s] = -1;
    }
    sh->dev_layer = -1;
}

/* After a failed run in layer sh->dev_layer: names the first device task that failed, with its
 * expert and card, in the error (the scheduler's message names the task), and releases the
 * layer's cache slots, dropping those copied in this step (a failed copy may have left them
 * partial). Returns rc. */
int mf_step_dev_fail(mf_step_shape *sh, int rc)
{
    mf_task_span *sp = mf_timeline_spans(sh->tl);
    int L = sh->dev_layer;
    for (int t = 0; sp && t < mf_graph_n_tasks(sh->g); t++) {
        int k = sh->sg->task[t].kind;
        if (sp[t].status >= 0 || (k != MF_SG_K_COPY && k != MF_SG_K_DEV && k != MF_SG_K_COPY_OUT))
            continue;
        const mf_step_targ *a = mf_graph_task(sh->g, t)->arg;
        if (a->t->op == MF_SG_DEV_PRE) {   /* a prefetch copy */
            rc = mf_error_wrap(rc, "layer %d, routed expert %d copied onto card %d ahead of its route (the "
                               "layer's cache slots copied in this step are dropped)", a->t->layer, a->t->part, a->t->card);
            break;
        }
        if (a->t->dense >= 0) {   /* a dense sublayer's copy or work */
            rc = mf_error_wrap(rc, "layer %d, dense work on card %d", a->t->layer, a->t->card);
            break;
        }
        if (a->t->layer != L || a->t->half != sh->dev_half || (a->t->slot >= 0 && !mf_step_slot_live(sh, a->t->slot)))
            continue;
        if (a->t->slot < 0) {   /* a card's graph of the layer's FFNs */
            rc = mf_error_wrap(rc, "layer %d, the routed experts on card %d (their cache slots copied in "
                               "this step are dropped)", L, a->t->card);
            break;
        }
        int s = a->t->slot;
        rc = mf_error_wrap(rc, "layer %d, routed expert %d on card %d (%s)", L, sh->slot_e[s], a->t->card,
                           sh->slot_miss[s] ? "copied in this step: its cache slot is dropped"
                                            : "a cache hit");
        break;
    }
    mf_step_dev_release(sh, 1);
    return rc;
}

/* Device lanes of a slot on card a->t->card (empty unless the route task put the slot there):
 * copy-in of the packed expert on a miss and of the slot's rows (inputs, token weights); the
 * expert FFN on the int8 path (the same kernels as the host's); copy-out of the outputs. */
static int mf_task_dev_in(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    int s = a->t->slot;
    if (!mf_step_slot_live(sh, s) || sh->slot_card[s] != a->t->card) return MF_TASK_NO_WORK;
    mf_step *eng = sh->eng;
    mf_dev_stream *st = ctx->queue;
    int64_t H = eng->c->hidden_size;
    int rc = 0;
    if (sh->slot_miss[s]) {
        const mf_weight *ew = mf_step_slot_weights(sh, a->t->layer, s);
        const void *src[6] = {ew[0].data, ew[0].scale, ew[1].data, ew[1].scale, ew[2].data, ew[2].scale};
        rc = mf_dev_copy_expert(st, sh->slot_dev[s], src, eng->part_off, eng->part_bytes);
        if (rc > 0) atomic_fetch_add_explicit(&eng->miss_spans, 1, memory_order_relaxed);
        rc = rc > 0 ? 0 : rc;
    }
    size_t off = (size_t)sh->slot_off[s], cnt = (size_t)sh->slot_cnt[s];
    uint8_t *db = sh->dbuf[a->t->card];
    float *dx = (float *)(void *)(db + sh->d_x) + off * H;
    if (sh->sg->slot_gather) {   /* the rows from the card's MoE input (the gate's copy-in), by their items */
        const uint16_t *xin = (const uint16_t *)(void *)(sh->ddense[a->t->card] + sh->dd16_xin);
        const int32_t *ri = (const int32_t *)(void *)(db + sh->d_ri) + off;
        if (!rc) rc = mf_dev_bf16_gather(st, xin, H, ri, dx, H, (int)cnt, (int)H);
        if (!rc) atomic_fetch_add_explicit(&eng->gather_slots, 1, memory_order_relaxed);
        return rc;
    }
    /* the rows as bf16 (mf_sg_slot_tok_bytes), unpacked on this copy stream; the token weights fp32 */
    uint16_t *d16 = (uint16_t *)(void *)(db + sh->d_x16) + off * H;
    if (!rc) rc = mf_dev_copy_h2d(st, d16, sh->xg16 + off * H, cnt * H * sizeof *d16);
    if (!rc) rc = mf_dev_bf16_unpack(st, d16, H, dx, H, (int)cnt, (int)H);
    if (!rc) rc = mf_dev_copy_h2d(st, db + sh->d_w + off * 4, sh->wg + off, cnt * 4);
    return rc;
}

/* slot_gather, card a->t->card's copy lane, after the route's rows: the micro-batch's rows' items
 * (row_item) and token weights, at their rows, for its slots' copy-ins to gather by (every card:
 * the slots' cards are known only when the route ran). */
static int mf_task_dev_rows(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    int h = a->t->half, s0 = sh->sg->half_slot[h], nu = sh->n_used[h];
    if (nu < 1) return MF_TASK_NO_WORK;
    size_t r0 = (size_t)sh->slot_off[s0], r1 = (size_t)sh->slot_off[s0 + nu - 1] + (size_t)sh->slot_cnt[s0 + nu - 1];
    uint8_t *db = sh->dbuf[a->t->card];
    int rc = mf_dev_copy_h2d(ctx->queue, db + sh->d_ri + r0 * 4, sh->row_item + r0, (r1 - r0) * 4);
    return rc ? rc : mf_dev_copy_h2d(ctx->queue, db + sh->d_w + r0 * 4, sh->wg + r0, (r1 - r0) * 4);
}

/* The shifts that make routed expert e of layer L exact in 16-bit type `type` (mf_dev_w16_plan: w1
 * and w3 together, w2), from its host scales on first use, then from the engine's table
 * (mf_step.lt_xplan: 0 not planned, else 1 | its shifts + 512 in bits 1-10 and 11-20, bit 21 when
 * no shift makes it exact). 0, -ERANGE (keep the int8 path) or the plan's error. */
static int mf_step_lt_xplan(mf_step *eng, int L, int e, const mf_weight *ew, mf_dev_f16 type, int *s13, int *s2)
{
    _Atomic int32_t *slot = &eng->lt_xplan[type == MF_DEV_F16_FP16][(size_t)L * eng->c->n_routed_experts + e];
    int32_t v = atomic_load_explicit(slot, memory_order_relaxed);
    if (!v) {
        mf_kern_mat w1 = mf_step_mat(&ew[0]), w3 = mf_step_mat(&ew[2]), w2 = mf_step_mat(&ew[1]);
        const mf_kern_mat *up[2] = {&w1, &w3}, *dn = &w2;
        int a = 0, b = 0, rc = mf_dev_w16_plan(up, 2, type, &a);
        if (!rc) rc = mf_dev_w16_plan(&dn, 1, type, &b);
        if (rc && rc != -ERANGE) return rc;
        v = 1 | (a + 512) << 1 | (b + 512) << 11 | (rc ? 1 << 21 : 0);
        atomic_store_explicit(slot, v, memory_order_relaxed);
    }
    *s13 = (v >> 1 & 1023) - 512;
    *s2 = (v >> 11 & 1023) - 512;
    return v >> 21 & 1 ? -ERANGE : 0;
}

/* Slot s's FFN on the cuBLASLt path where the slot takes it (mf_sg_ffn_lt: the engine's mode, its
 * tokens, the cost model on the engine's profile, as the simulator decides) and its expert is
 * exact in the card's type: w1 and w3 dequantized into one [2I][H] scratch, w2 into another, then
 * mf_dev_expert_ffn_lt over the slot's rows, lt_ffn_tok at a time. *done 0: it did not (the caller
 * runs the int8 path). */
static int mf_step_ffn_lt(mf_step_shape *sh, int L, int s, const mf_dev_ffn *f, mf_dev_stream *st, int *done)
{
    mf_step *eng = sh->eng;
    int card = sh->slot_card[s], cnt = sh->slot_cnt[s], s13, s2;
    *done = 0;
    mf_work ew;
    mf_sg_expert_work(eng->c, eng->sz, &ew);
    mf_cost_model m = {.p = eng->o.profile ? eng->o.profile : mf_cost_default_profile()};
    if (!sh->sg->lt_ffn || !mf_sg_ffn_lt(&m, &ew, cnt, eng->lt_mode, NULL)) return 0;
    mf_dev_f16 type = mf_dev_card_f16(eng->dev, card);
    int rc = mf_step_lt_xplan(eng, L, sh->slot_e[s], mf_step_slot_weights(sh, L, s), type, &s13, &s2);
    if (rc == -ERANGE) return 0;   /* no exact 16-bit form: the int8 path */
    if (rc) return rc;
    const mf_sg_card_bufs *cb = &sh->cb;
    int H = f->w1.n_in, I = f->w1.n_out;
    uint8_t *db = sh->dbuf[card];
    mf_dev_ffn_lt a = {.w13 = {db + cb->lt_e13, type, s13, 2 * I, H}, .w2 = {db + cb->lt_e2, type, s2, H, I},
                       .limit = f->limit, .gu = (float *)(void *)(db + cb->lt_gu), .lt = mf_step_lt_buf(sh, card, 0)};
    mf_dev_w16 w1 = a.w13, w3 = a.w13;
    w1.n_out = w3.n_out = I;
    w3.w = (uint16_t *)a.w13.w + (size_t)I * H;
    rc = mf_dev_dequant(st, &f->w1, &w1);
    if (!rc) rc = mf_dev_dequant(st, &f->w3, &w3);
    if (!rc) rc = mf_dev_dequant(st, &f->w2, &a.w2);
    for (int t0 = 0; t0 < cnt && !rc; t0 += sh->sg->lt_ffn_tok) {
        a.n_tok = cnt - t0 < sh->sg->lt_ffn_tok ? cnt - t0 : sh->sg->lt_ffn_tok;
        a.x = f->x + (size_t)t0 * H;
        a.tok_weight = f->tok_weight + t0;
        a.y = f->y + (size_t)t0 * H;
        rc = mf_dev_expert_ffn_lt(st, &a);
    }
    if (!rc) atomic_fetch_add_explicit(&eng->lt_slots, 1, memory_order_relaxed);
    *done = !rc;
    return rc;
}

static int mf_task_dev_ffn(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    int s = a->t->slot;
    if (!mf_step_slot_live(sh, s) || sh->slot_card[s] != a->t->card) return MF_TASK_NO_WORK;
    mf_step *eng = sh->eng;
    int64_t H = eng->c->hidden_size, I = eng->c->moe_intermediate_size;
    const mf_weight *ew = mf_step_slot_weights(sh, a->t->layer, s);
    size_t off = (size_t)sh->slot_off[s], ho = sh->cb.ffn_slot ? 0 : off;   /* h's and the scratch's first row */
    if (sh->cb.ffn_slot && (size_t)sh->slot_cnt[s] > sh->cb.ffn_rows)
        return mf_error(-ENOSPC, "step: slot %d's %d rows exceed the %zu rows of card %d's FFN scratch "
                        "(graphs/step/stepgraph.h mf_sg_card_bufs.ffn_rows)", s, sh->slot_cnt[s], sh->cb.ffn_rows,
                        a->t->card);
    uint8_t *db = sh->dbuf[a->t->card], *x = sh->slot_dev[s];
    mf_dev_ffn f = {.w1 = mf_step_mat(&ew[0]), .w3 = mf_step_mat(&ew[2]), .w2 = mf_step_mat(&ew[1]),
                    .x = (const float *)(db + sh->d_x) + off * H, .n_tok = sh->slot_cnt[s],
                    .tok_weight = (const float *)(db + sh->d_w) + off, .limit = (float)eng->c->swiglu_limit,
                    .h = (float *)(db + sh->d_h) + ho * I, .q8_scratch = db + sh->d_q + ho * sh->dq_bytes,
                    .y = (float *)(db + sh->d_y) + off * H};
    f.w1.w = x + eng->part_off[0];
    f.w1.scale = x + eng->part_off[1];
    f.w2.w = x + eng->part_off[2];
    f.w2.scale = x + eng->part_off[3];
    f.w3.w = x + eng->part_off[4];
    f.w3.scale = x + eng->part_off[5];
    int done = 0, rc = mf_step_ffn_lt(sh, a->t->layer, s, &f, ctx->queue, &done);
    return rc || done ? rc : mf_dev_expert_ffn(ctx->queue, &f);
}

/* Graph mode: the FFNs of every slot of layer a->t->layer on card a->t->card, as the layer's graph
 * (captured on its first run: the h2d copy of the layer's slot table, then the slot-table FFN
 * over the shape's buffers), which reads the experts and rows the route task wrote into the
 * table. Nothing when no slot is on the card. */
static int mf_task_dev_ffn_card(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    mf_step *eng = sh->eng;
    int c = a->t->card, L = a->t->layer, h = a->t->half, any = 0;
    int s0 = sh->sg->half_slot[h], ns = sh->sg->half_slot[h + 1] - s0;   /* the micro-batch's slots */
    for (int s = s0; s < s0 + sh->n_used[h] && !any; s++) any = sh->slot_card[s] == c;
    if (!any) return MF_TASK_NO_WORK;
    mf_dev_stream *st = ctx->queue;
    mf_dev_graph **g = &sh->dgraph[c][L * sh->sg->n_halves + h];
    if (!*g) {
        uint8_t *db = sh->dbuf[c];
        mf_dev_ffn_slot *dtab = (mf_dev_ffn_slot *)(db + sh->d_tab) + (size_t)L * sh->n_slots + s0;
        mf_dev_ffn_table t = {.n_in = (int)eng->c->hidden_size, .n_hidden = (int)eng->c->moe_intermediate_size,
                              .table = dtab, .n_slots = ns, .max_tok = sh->n,
                              .x = (const float *)(db + sh->d_x), .tok_weight = (const float *)(db + sh->d_w),
                              .limit = (float)eng->c->swiglu_limit, .h = (float *)(db + sh->d_h),
                              .q8_scratch = db + sh->d_q, .q8_row = sh->dq_bytes,
                              .y = (float *)(db + sh->d_y)};
        for (int k = 0; k < 6; k++) t.part_off[k] = eng->part_off[k];
        int rc = mf_dev_capture_begin(st);
        if (rc) return rc;
        rc = mf_dev_copy_h2d(st, dtab, sh->htab[c] + (size_t)L * sh->n_slots + s0, sizeof *dtab * (size_t)ns);
        if (!rc) rc = mf_dev_expert_ffn_table(st, &t);
        mf_dev_graph *ng = NULL;
        int rc2 = mf_dev_capture_end(st, &ng);
        if (!rc) rc = rc2;
        if (rc) {
            mf_dev_graph_destroy(ng);
            return mf_error_wrap(rc, "step: capturing layer %d's device graph on card %d", L, c);
        }
        *g = ng;
    }
    return mf_dev_graph_launch(*g, st);
}

static int mf_task_dev_out(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    int s = a->t->slot;
    if (!mf_step_slot_live(sh, s) || sh->slot_card[s] != a->t->card) return MF_TASK_NO_WORK;
    int64_t H = sh->eng->c->hidden_size;
    size_t off = (size_t)sh->slot_off[s], cnt = (size_t)sh->slot_cnt[s];
    uint8_t *db = sh->dbuf[a->t->card];
    /* the rows as bf16 (mf_sg_slot_tok_bytes), packed on this copy stream where its rows in start
     * (mf_sg_card_bufs.y16); the combine unpacks them */
    uint16_t *d16 = (uint16_t *)(void *)(db + sh->d_y16 + off * H * sizeof(float));
    int rc = mf_dev_bf16_pack(ctx->queue, (const float *)(void *)(db + sh->d_y) + off * H, H, d16, H, (int)cnt, (int)H);
    return rc ? rc : mf_dev_copy_d2h(ctx->queue, sh->y16 + off * H, d16, cnt * H * sizeof *d16);
}

/* ---- the engine's setup of the routed experts' cards (at mf_step_new) ---------------------- */

/* The card slot's layout mirrors the host's: when the model's experts are resident (no store)
 * and every expert's six parts lie at the same offsets from its lowest part (the model block keeps
 * a layer's tensors in layout order, each expert's w1, w1 scale, w2, ... one after another, the
 * parts MF_MODEL_EXPERT_ALIGN-aligned: graphs/model/model.c; weights mapped from the page cache lie
 * as the file has them, where the released checkpoint puts each scale before its codes), each
 * offset a multiple of the card's 256-byte part alignment and the span at most 6 x 4 KiB over the
 * parts' packing, the slot takes those offsets (s->part_off, s->part_bytes, s->xslot_bytes) and 1
 * is returned: a miss is then one copy of the span (mf_dev_copy_expert). 0 otherwise (nothing set). */
static int mf_step_xslot_layout(mf_step *s)
{
    const mf_config *c = s->c;
    const mf_model *m = s->ly->m;
    if (s->store) return 0;
    size_t off[6], bytes[6], packed = 0, span = 0;
    int any = 0;
    for (int L = 0; L < c->n_layers + (s->o.draft ? c->n_mtp_layers : 0); L++)   /* the draft's experts too */
        for (int e = 0; e < mf_config_layer_experts(c, L); e++) {
            const mf_weight *ew = &mf_model_layer_at(m, L)->experts[(size_t)e * 3];
            const uint8_t *src[6] = {ew[0].data, ew[0].scale, ew[1].data, ew[1].scale, ew[2].data, ew[2].scale};
            const uint8_t *b = src[0];
            for (int p = 0; p < 6; p++) {
                if (!src[p]) return 0;
                if (src[p] < b) b = src[p];
            }
            for (int p = 0; p < 6; p++) {
                if (!any) {
                    const mf_weight *w = &ew[p / 2];
                    bytes[p] = p % 2 ? (w->st_scale ? w->st_scale->n_bytes : (size_t)(w->rows * w->cols / 32))
                                     : (w->st_data ? w->st_data->n_bytes : (size_t)(w->rows * w->cols / 2));
                    off[p] = (size_t)(src[p] - b);
                    if (off[p] % 256) return 0;
                    packed += (bytes[p] + 255) / 256 * 256;
                    if (off[p] + bytes[p] > span) span = off[p] + bytes[p];
                } else if ((size_t)(src[p] - b) != off[p]) {
                    return 0;
                }
            }
            for (int p = 0; p < 6 && !any; p++)   /* no two parts overlap */
                for (int q = 0; q < 6; q++)
                    if (q != p && off[q] >= off[p] && off[q] < off[p] + bytes[p]) return 0;
            any = 1;
        }
    span = (span + 255) / 256 * 256;
    if (!any || span > packed + 6 * 4096) return 0;
    memcpy(s->part_off, off, sizeof off);
    memcpy(s->part_bytes, bytes, sizeof bytes);
    s->xslot_bytes = span;
    return 1;
}

/* Routed experts on s->o.dev: checks that the cards can run them as the host does (int8 path,
 * swiglu limit, FP4 experts), lays out a packed expert (w1, w2, w3 codes and scales) and takes the
 * cards (three lanes each); mf_step_caches_new opens their expert caches once the lanes exist. */
int mf_step_dev_setup(mf_step *s)
{
    const mf_config *c = s->c;
    if (s->o.placement != MF_STEP_PLACE_SEED && s->o.placement != MF_STEP_PLACE_HYBRID)
        return mf_error(-EINVAL, "step: unknown placement %d", s->o.placement);
    if (s->o.exact)
        return mf_error(-ENOTSUP, "step: routed experts on devices run the int8 path; --exact (the fp32 "
                        "path with the reference's bf16 roundings) is host-only for now");
    if (!(c->swiglu_limit > 0))
        return mf_error(-ENOTSUP, "step: routed experts on devices need a swiglu limit (the fused "
                        "kernel); this model has none");
    const mf_weight *ew = mf_model_layer_at(s->ly->m, 0)->experts;
    for (int k = 0; k < 3; k++)
        if (ew[k].kind != MF_W_FP4)
            return mf_error(-ENOTSUP, "step: routed experts on devices need FP4 experts; %s is not",
                            ew[k].name);
    if (!(s->miss_span = mf_step_xslot_layout(s))) {   /* else the parts packed 256-aligned */
        uint64_t off = 0;
        for (int k = 0; k < 3; k++) {
            uint64_t db = ew[k].st_data ? ew[k].st_data->n_bytes : (uint64_t)(ew[k].rows * ew[k].cols / 2);
            uint64_t sb = ew[k].st_scale ? ew[k].st_scale->n_bytes : (uint64_t)(ew[k].rows * ew[k].cols / 32);
            s->part_off[2 * k] = off;
            s->part_bytes[2 * k] = db;
            off += (db + 255) / 256 * 256;
            s->part_off[2 * k + 1] = off;
            s->part_bytes[2 * k + 1] = sb;
            off += (sb + 255) / 256 * 256;
        }
        s->xslot_bytes = off;
    }
    s->dev = s->o.dev;
    s->dev_graphs = s->o.dev_graphs;
    s->n_cards = mf_dev_n_cards(s->dev);
    s->dstat.n_cards = s->n_cards;
    return 0;
}

/* The expert cache of each card with routed experts, after the dense weights and the lanes. With a
 * budget (mf_step_opts.dev_cache_bytes) a cache takes that; without one, what the card grants
 * (every expert, halved until it fits) once the buffers of the engine's largest shapes are held
 * back (mf_sg_card_reserve: a prefill chunk's and the largest decode batch's, routed and dense
 * blocks): held by an allocation while the cache is sized, then released for the shapes, which
 * allocate when they first run. A card that cannot hold them beside its dense weights is refused
 * here, naming the card and the sizes, not at a chunk's first run. */
int mf_step_caches_new(mf_step *s)
{
    const mf_config *c = s->c;
    void *hold[MF_DEV_MAX_CARDS] = {0};
    int rc = 0;
    if (!s->o.dev_cache_bytes) {
        mf_task_fn fn_of[MF_SG_N_OPS];
        int chunk = s->o.prefill_chunk > 0 ? s->o.prefill_chunk : MF_STEP_PREFILL_CHUNK;
        if (chunk > s->max_chunk) chunk = s->max_chunk;
        mf_sg_opts o = mf_step_sg_opts(s, chunk, 0, 0, fn_of);
        mf_sg_card_in ci = mf_step_card_in(s, NULL, 0);
        double routed = 0, dense = 0;
        rc = mf_sg_card_reserve(&o, &ci, chunk, s->max_items, &routed, &dense);
        for (int cd = 0; !rc && cd < s->n_cards; cd++) {
            double b = routed;
            for (int k = 0; k < s->n_dense; k++) b += s->dense_card[k] == cd ? dense : 0;
            if (b > 0 && (rc = mf_dev_alloc(s->dev, cd, (size_t)b, &hold[cd])))
                rc = mf_error_wrap(rc == -ENOMEM ? -ENOSPC : rc, "step: card %d cannot hold the buffers of a %d-position prefill chunk and a "
                                   "decode batch of %d (%.3f GB) beside its dense weights (a shorter --chunk needs "
                                   "less)", cd, chunk, s->max_items, b / 1e9);
        }
    }
    /* with the draft: one cache over the backbone's and the draft stages' experts, sized as the
     * backbone's alone (mf_step_draft_cards holds the draft's share while speculation pays) */
    int dl = s->o.draft ? c->n_mtp_layers : 0;
    if (dl && mf_config_layer_experts(c, c->n_layers) > c->n_routed_experts)
        rc = mf_error(-ENOTSUP, "step: the draft's %d routed experts a stage on the cards need at most the backbone's %d",
                      mf_config_layer_experts(c, c->n_layers), c->n_routed_experts);
    for (int cd = 0; !rc && cd < s->n_cards; cd++) {
        rc = mf_dev_xcache_new(s->dev, &(mf_dev_xcache_opts){.card = cd, .n_layers = c->n_layers + dl,
                                                             .n_experts = c->n_routed_experts,
                                                             .size_items = c->n_layers * c->n_routed_experts,
                                                             .slot_bytes = s->xslot_bytes,
                                                             .budget_bytes = s->o.dev_cache_bytes},
                               &s->xc[cd]);
        if (rc) rc = mf_error_wrap(rc, "step: the expert cache of card %d", cd);
    }
    for (int cd = 0; cd < s->n_cards; cd++)
        if (hold[cd]) mf_dev_free(s->dev, cd, hold[cd]);
    if (rc) {
        for (int k = 0; k < s->n_cards; k++) {
            mf_dev_xcache_free(s->xc[k]);
            s->xc[k] = NULL;
        }
        return rc;
    }
    s->dstat.cache_slots = mf_dev_xcache_n_slots(s->xc[0]);
    return 0;
}

/* Card cd's share of the draft's experts, each dropped (unpinned and forgotten) up to *n of them
 * in the order mf_step_draft_cards takes them. */
static void mf_step_draft_drop(mf_step *s, int cd, int n)
{
    const mf_config *c = s->c;
    for (int L = c->n_layers, k = 0; L < c->n_layers + c->n_mtp_layers; L++)
        for (int e = 0; e < mf_config_layer_experts(c, L) && k < n; e++)
            if (mf_dev_xcache_owner(s->n_cards, L, e) == cd) mf_dev_xcache_drop(s->xc[cd], L, e), k++;
}

int mf_step_draft_cards(mf_step *s, int on)
{
    const mf_config *c = s->c;
    if (!s->o.draft || !s->n_cards) return mf_error(-EINVAL, "step: the draft's experts on the cards need an "
                                                    "engine with the draft and routed experts on cards");
    if (!on == !s->dcards) return 0;
    if (!on) {
        for (int cd = 0; cd < s->n_cards; cd++) mf_step_draft_drop(s, cd, INT32_MAX);
        s->dcards = 0;
        return 0;
    }
    int rc = 0, cd = 0, n = 0;
    for (; cd < s->n_cards && !rc; cd++) {   /* each owned expert taken, pinned, copied in */
        mf_dev_stream *st = mf_dev_stream_of(s->dev, cd, MF_DEV_STREAM_COPY_IN);
        n = 0;
        for (int L = c->n_layers; L < c->n_layers + c->n_mtp_layers && !rc; L++)
            for (int e = 0; e < mf_config_layer_experts(c, L) && !rc; e++) {
                if (mf_dev_xcache_owner(s->n_cards, L, e) != cd) continue;
                const mf_weight *ew = &mf_model_layer_at(s->ly->m, L)->experts[(size_t)e * 3];
                const void *src[6] = {ew[0].data, ew[0].scale, ew[1].data, ew[1].scale, ew[2].data, ew[2].scale};
                void *slot = NULL;
                int hit = 0;
                if ((rc = mf_dev_xcache_acquire(s->xc[cd], L, e, &slot, &hit))) break;
                n++;
                if (!hit) rc = mf_dev_copy_expert(st, slot, src, s->part_off, s->part_bytes);
                rc = rc > 0 ? 0 : rc;
            }
        if (!rc) rc = mf_dev_stream_sync(st);
        mf_dev_xcache_stats_reset(s->xc[cd]);   /* these copies are not a step's misses */
    }
    if (rc) {   /* nothing held: the failed card's taken ones and every earlier card's */
        for (int k = 0; k < cd; k++) mf_step_draft_drop(s, k, k == cd - 1 ? n : INT32_MAX);
        return mf_error_wrap(rc, "step: the draft's experts onto card %d", cd - 1);
    }
    s->dcards = 1;
    return 0;
}

/* This file's ops (step_impl.h; step_shape.c binds them). */
const mf_task_fn mf_step_moe_cards_fn_of[MF_SG_N_OPS] = {
    [MF_SG_MOE_PLACE] = mf_task_moe_place, [MF_SG_DEV_PRE] = mf_task_dev_pre,
    [MF_SG_DEV_IN] = mf_task_dev_in,       [MF_SG_DEV_FFN] = mf_task_dev_ffn,
    [MF_SG_DEV_FFN_CARD] = mf_task_dev_ffn_card, [MF_SG_DEV_OUT] = mf_task_dev_out,
    [MF_SG_DEV_ROWS] = mf_task_dev_rows,
};
