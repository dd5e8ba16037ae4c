/* The scheduled engine's MoE tasks on the host (graphs/step/stepgraph_moe.c sg_router, mf_sg_moe build
 * them): the router's gate rows, the route (top-k, the slot table, the store's batch) and its row
 * gather, the routed experts' slots (up parts, join, down parts), the shared expert, the combine,
 * the layer's end. Where a slot runs on a card, step_moe_cards.c places it and runs it. */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "graphs/step/fast_attn.h"
#include "graphs/step/step_impl.h"
#include "sched/error.h"

/* Rows (experts) of part a->t->part of sh->p_attn of the router's gate logits, over all items: on
 * the kernels' fp32 sums (mf_fa_gate_rows), with exact as the reference sums them (double sums),
 * so the routing is the reference's. */
static int mf_task_gate_rows(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_weight *w = &mf_model_layer_at(cx->ly->m, a->t->layer)->gate;
    int r0 = (int)a->t->r0, r1 = (int)a->t->r1;   /* the record's rows (mf_sg_expert_rows) */
    if (r0 >= r1) return 0;
    mf_step_count_socket(sh->eng, ctx, w, r0, r1, 1);
    int64_t H = sh->eng->c->hidden_size;
    size_t i0 = (size_t)a->t->i0;   /* the micro-batch's items */
    int rc = (sh->eng->o.exact ? mf_ly_gate_rows : mf_fa_gate_rows)(cx, a->t->layer, sh->xin + i0 * H, a->t->i1 - a->t->i0, H, sh->logits + i0 * w->rows,
                             w->rows, r0, r1);
    return rc ? mf_error_wrap(rc, "step: layer %d, rows [%d, %d) of the router gate", a->t->layer, r0, r1) : 0;
}

/* Top-k of the gate logits of items [i0, i1), in item order (with the route hook). */
static void mf_step_topk(mf_step_shape *sh, mf_ly_ctx *cx, int L, int i0, int i1)
{
    const mf_config *c = cx->ly->c;
    int K = mf_config_layer_topk(c, L), E = mf_config_layer_experts(c, L);   /* a draft stage's own */
    for (int i = i0; i < i1; i++)
        mf_ly_route_item(cx, &sh->items[i], L, sh->logits + (size_t)i * E, sh->ex + (size_t)i * K,
                         sh->wt + (size_t)i * K);
}

/* Opens the store's batch for micro-batch h's slots of layer L (hits and misses decided, all
 * pinned) and fills each slot's IO reads (none on hits) and weight views into the slab. */
static int mf_step_store_begin(mf_step_shape *sh, int L, int h)
{
    mf_store *st = sh->eng->store;
    const mf_model_layer *y = mf_model_layer_at(sh->eng->ly->m, L);
    int s0 = sh->sg->half_slot[h], nu = sh->n_used[h];
    int rc = mf_store_begin(st, L, sh->slot_e + s0, nu), any = 0;
    if (rc) return mf_error_wrap(rc, "step: layer %d: making its %d experts present", L, nu);
    sh->store_layer = L;
    sh->store_half = h;
    for (int s = s0; s < sh->sg->half_slot[h + 1]; s++) {
        int nr = 0, q = s - s0;   /* the slot's place in the store's batch */
        const mf_io_read *rd = q < nu ? mf_store_reads(st, q, &nr) : NULL;
        for (int j = 0; j < sh->n_parts; j++)
            sh->slot_rd[(size_t)s * sh->n_parts + j] = j < nr ? rd[j] : (mf_io_read){.fd = -1};
        any |= nr > 0;
        if (q >= nu) continue;
        for (int k = 0; k < 3; k++) {
            mf_weight *w = &sh->slot_w[(size_t)s * 3 + k];
            *w = y->experts[sh->slot_e[s] * 3 + k];
            w->data = mf_store_batch_part(st, q, 2 * k);
            w->scale = mf_store_batch_part(st, q, 2 * k + 1);
            if (!w->data || !w->scale) {
                sh->store_layer = -1;
                return mf_store_end(st, mf_error(-EFAULT, "step: %s has no place in the expert store "
                                                 "(internal)", w->name));
            }
        }
    }
    if (any && (rc = mf_store_check(st))) {
        sh->store_layer = -1;
        return mf_store_end(st, rc);
    }
    return 0;
}

/* Router: the top-k of the gate logits, then the slot table: the distinct experts in
 * ascending id, each with its items in item order; inputs gathered into slot order (and
 * quantized for the int8 path). */
static int mf_step_gather_rows(mf_step_shape *sh, int h, int i0, int i1, int p, int P, int K);

static int mf_task_route(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    mf_step *eng = sh->eng;
    const mf_config *c = eng->c;
    int K = mf_config_layer_topk(c, a->t->layer), E = mf_config_layer_experts(c, a->t->layer);
    /* the micro-batch's items [i0, i1) and slots [s0, s1) (its rows in slot order from i0 * K):
     * the other micro-batch's route runs before this one's MoE starts or after it ends, so the
     * expert counts and fills are this route's alone */
    int h = a->t->half, i0 = a->t->i0, i1 = a->t->i1, s0 = sh->sg->half_slot[h], s1 = sh->sg->half_slot[h + 1];
    if (a->t->part >= 0) {   /* a part: its items' top-k (the route after the parts leaves it out) */
        mf_step_topk(sh, cx, a->t->layer, i0, i1);
        return 0;
    }
    if (!sh->sg->route_topk) mf_step_topk(sh, cx, a->t->layer, i0, i1);
    memset(sh->cnt, 0, sizeof *sh->cnt * (size_t)E);
    for (int j = i0 * K; j < i1 * K; j++) sh->cnt[sh->ex[j]]++;
    int ns = s0, off = i0 * K;
    for (int e = 0; e < E; e++) {
        sh->slot_of[e] = -1;
        if (!sh->cnt[e]) continue;
        if (ns == s1) return mf_error(-EINVAL, "step: more experts than slots (internal)");
        sh->slot_of[e] = ns;
        sh->slot_e[ns] = e;
        sh->slot_off[ns] = off;
        sh->slot_cnt[ns] = sh->cnt[e];
        sh->fill[e] = off;
        off += sh->cnt[e];
        ns++;
    }
    sh->n_used[h] = ns - s0;
    for (int i = i0; i < i1; i++)
        for (int k = 0; k < K; k++) {
            int e = sh->ex[i * K + k], row = sh->fill[e]++;
            sh->asg[i * K + k] = row;
            sh->wg[row] = sh->wt[i * K + k];
        }
    if (sh->slot_w) {   /* a store (the draft's shapes have none: its experts are resident) */
        int rc = mf_step_store_begin(sh, a->t->layer, h);
        if (rc) return rc;
    }
    if (sh->sg->n_cards && sh->sg->prefetch) mf_step_place_pre(sh, a->t->layer, h);   /* placed at the layer's start */
    else if (sh->sg->n_cards) {   /* routed experts on cards */
        int rc = mf_step_place(sh, a->t->layer, h);
        if (rc) return rc;
    }
    /* the slot tasks with nothing to do this step (unused slots; a slot's host tasks when it runs
     * on a card, its tasks on the other cards): the executor completes them where they become
     * ready, without waking a lane's thread or a round trip through a card's stream */
    mf_stepgraph_mark_noop_half(sh->sg, a->t->layer, h, sh->n_used[h], sh->slot_card ? sh->slot_card + s0 : NULL);
    return sh->sg->p_gather > 1 ? 0 : mf_step_gather_rows(sh, h, i0, i1, 0, 1, K);
}

/* Part p of P of micro-batch h's row gather: the used slots [s0 + n p / P, s0 + n (p + 1) / P)
 * of its n, their rows (in slot order, as the route assigned them: asg) copied from the inputs
 * of items [i0, i1), the host slots' rows quantized (the cards quantize their own). Any split
 * gives the same bytes. */
static int mf_step_gather_rows(mf_step_shape *sh, int h, int i0, int i1, int p, int P, int K)
{
    mf_step *eng = sh->eng;
    int n = sh->n_used[h], s0 = sh->sg->half_slot[h];
    int64_t H = eng->c->hidden_size;
    int a = s0 + (int)((int64_t)n * p / P), b = s0 + (int)((int64_t)n * (p + 1) / P);
    if (a >= b) return 0;
    int r0 = sh->slot_off[a], r1 = sh->slot_off[b - 1] + sh->slot_cnt[b - 1];
    if (sh->row_card)   /* which rows go to cards: those copy in as bf16 (mf_sg_slot_tok_bytes) */
        for (int s = a; s < b; s++) memset(sh->row_card + sh->slot_off[s], sh->slot_card[s] >= 0, (size_t)sh->slot_cnt[s]);
    for (int i = i0; i < i1; i++)
        for (int k = 0; k < K; k++) {
            int row = sh->asg[i * K + k];
            if (row < r0 || row >= r1) continue;
            if (sh->row_item) sh->row_item[row] = i;   /* slot_gather: the cards gather their rows */
            if (!sh->row_card || !sh->row_card[row])
                memcpy(sh->xg + (size_t)row * H, sh->xin + (size_t)i * H, sizeof(float) * (size_t)H);
            else if (sh->row_item)
                continue;
            else if (sh->xin16)   /* the ffn_norm's mirror (dense cards): the same codes */
                memcpy(sh->xg16 + (size_t)row * H, sh->xin16 + (size_t)i * H, sizeof(uint16_t) * (size_t)H);
            else
                mf_kern_vec_bf16_pack(sh->xin + (size_t)i * H, sh->xg16 + (size_t)row * H, H);
        }
    if (!eng->o.exact)
        for (int s = a; s < b; s++) {
            if (sh->slot_card && sh->slot_card[s] >= 0) continue;   /* the card quantizes its own */
            size_t r0 = (size_t)sh->slot_off[s], cnt = (size_t)sh->slot_cnt[s];
            int rc = mf_kern_q8_init(&sh->q8x[s], sh->q8x_mem + r0 * sh->q8x_bytes, cnt * sh->q8x_bytes, (int)cnt, (int)H);
            if (!rc) rc = mf_kern_q8_quantize(&sh->q8x[s], sh->xg + (size_t)sh->slot_off[s] * H, (int)H, 0,
                                              sh->slot_cnt[s]);
            if (rc) return rc;
        }
    return 0;
}

static int mf_task_route_rows(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    return mf_step_gather_rows(a->sh, a->t->half, a->t->i0, a->t->i1, a->t->part, a->sh->sg->p_gather,
                               mf_config_layer_topk(a->sh->eng->c, a->t->layer));
}

/* End of a layer's MoE: the store's batch is closed (read experts marked present) and the
 * layer's experts unpinned, now that no task uses them. */
static int mf_task_moe_done(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    mf_store *st = sh->eng->store;
    int h = a->t->half, s0 = sh->sg->half_slot[h];
    if (sh->sg->prefetch && sh->pre_layer[a->t->layer & 1] == a->t->layer) mf_step_pre_release(sh, a->t->layer & 1, 0);
    else if (!sh->sg->prefetch && sh->dev_layer == a->t->layer && sh->dev_half == h) mf_step_dev_release(sh, 0);
    if (!st || sh->store_layer != a->t->layer || sh->store_half != h) return 0;
    int rc = mf_store_end(st, 0);
    mf_store_unpin(st, a->t->layer, sh->slot_e + s0, sh->n_used[h]);
    sh->store_layer = -1;
    return rc;
}

/* Phase 1 of one FFN over rows [r0, r1) of its hidden size, for n_tok tokens of x (ld H).
 * exact: w1 and w3 on the fp32 path, then the reference's roundings (layer_moe.c); else fused. */
static int mf_step_ffn_up(mf_step *eng, const mf_weight *w1, const mf_weight *w3, const float *x,
                          const mf_kern_q8 *q8, int n_tok, const float *tok_w, float *h, float *g,
                          float *u, int r0, int r1)
{
    const mf_config *c = eng->c;
    int H = (int)c->hidden_size, I = (int)w1->rows;
    mf_kern_mat m1 = mf_step_mat(w1), m3 = mf_step_mat(w3);
    float lim = (float)c->swiglu_limit;
    if (!eng->o.exact && lim > 0)
        return mf_kern_ffn_up(&m1, &m3, &(mf_kern_in){x, n_tok, H, q8}, tok_w, lim, h, I, r0, r1);
    mf_kern_in in = {x, n_tok, H, eng->o.exact ? NULL : q8};
    int rc = mf_kern_matmul(&m1, &in, g, I, r0, r1);
    if (!rc) rc = mf_kern_matmul(&m3, &in, u, I, r0, r1);
    if (rc) return rc;
    for (int t = 0; t < n_tok; t++)
        for (int i = r0; i < r1; i++) {
            size_t k = (size_t)t * I + i;
            float gi = mf_bf(g[k]), ui = mf_bf(u[k]);
            if (lim > 0) {
                ui = fminf(fmaxf(ui, -lim), lim);
                gi = fminf(gi, lim);
            }
            h[k] = mf_bf((tok_w ? tok_w[t] : 1.0f) * (mf_ly_silu(gi) * ui));
        }
    return 0;
}

/* Phase 2: y rows [r0, r1) = w2 h, rounded to bf16 as the reference's expert outputs. */
static int mf_step_ffn_down(mf_step *eng, const mf_weight *w2, const float *h, const mf_kern_q8 *q8,
                            int n_tok, float *y, int r0, int r1)
{
    int H = (int)eng->c->hidden_size, I = (int)w2->cols;
    mf_kern_mat m2 = mf_step_mat(w2);
    int rc = mf_kern_ffn_down(&m2, &(mf_kern_in){h, n_tok, I, eng->o.exact ? NULL : q8}, y, H, r0, r1);
    if (rc) return rc;
    for (int t = 0; t < n_tok; t++)
        for (int o = r0; o < r1; o++) y[(size_t)t * H + o] = mf_bf(y[(size_t)t * H + o]);
    return 0;
}

static int mf_task_slot_up(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    if (!mf_step_slot_live(sh, a->t->slot) || (sh->slot_card && sh->slot_card[a->t->slot] >= 0)) return 0;
    mf_step *eng = sh->eng;
    const mf_config *c = eng->c;
    int64_t H = c->hidden_size, I = c->moe_intermediate_size;
    const mf_weight *ew = mf_step_slot_weights(sh, a->t->layer, a->t->slot);
    int r0 = (int)a->t->r0, r1 = (int)a->t->r1;   /* the record's rows (mf_sg_rows) */
    if (r0 >= r1) return 0;
    mf_step_count_socket(eng, ctx, &ew[0], r0, r1, 0);
    mf_step_count_socket(eng, ctx, &ew[2], r0, r1, 0);
    size_t off = (size_t)sh->slot_off[a->t->slot];
    return mf_step_ffn_up(eng, &ew[0], &ew[2], sh->xg + off * H, &sh->q8x[a->t->slot], sh->slot_cnt[a->t->slot],
                          sh->wg + off, sh->h + off * I, sh->gg ? sh->gg + off * I : NULL,
                          sh->uu ? sh->uu + off * I : NULL, r0, r1);
}

static int mf_task_slot_join(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    if (!mf_step_slot_live(sh, a->t->slot) || sh->eng->o.exact || (sh->slot_card && sh->slot_card[a->t->slot] >= 0))
        return 0;
    int I = (int)sh->eng->c->moe_intermediate_size, s = a->t->slot;
    size_t r0 = (size_t)sh->slot_off[s], cnt = (size_t)sh->slot_cnt[s];
    int rc = mf_kern_q8_init(&sh->q8h[s], sh->q8h_mem + r0 * sh->q8h_bytes, cnt * sh->q8h_bytes, (int)cnt, I);
    if (!rc) rc = mf_kern_q8_quantize(&sh->q8h[s], sh->h + (size_t)sh->slot_off[s] * I, I, 0, sh->slot_cnt[s]);
    return rc;
}

static int mf_task_slot_down(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    if (!mf_step_slot_live(sh, a->t->slot) || (sh->slot_card && sh->slot_card[a->t->slot] >= 0)) return 0;
    mf_step *eng = sh->eng;
    int64_t H = eng->c->hidden_size, I = eng->c->moe_intermediate_size;
    const mf_weight *ew = mf_step_slot_weights(sh, a->t->layer, a->t->slot);
    int r0 = (int)a->t->r0, r1 = (int)a->t->r1;   /* the record's rows (mf_sg_rows) */
    if (r0 >= r1) return 0;
    mf_step_count_socket(eng, ctx, &ew[1], r0, r1, 0);
    size_t off = (size_t)sh->slot_off[a->t->slot];
    return mf_step_ffn_down(eng, &ew[1], sh->h + off * I, &sh->q8h[a->t->slot], sh->slot_cnt[a->t->slot],
                            sh->y + off * H, r0, r1);
}

static int mf_task_sh_up(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    mf_step *eng = sh->eng;
    const mf_model_layer *y = mf_model_layer_at(eng->ly->m, a->t->layer);
    int r0 = (int)a->t->r0, r1 = (int)a->t->r1;   /* the record's rows (mf_sg_expert_rows) */
    if (r0 >= r1) return 0;
    mf_step_count_socket(eng, ctx, &y->sh_w1, r0, r1, 1);
    mf_step_count_socket(eng, ctx, &y->sh_w3, r0, r1, 1);
    size_t i0 = (size_t)a->t->i0, I = (size_t)y->sh_w1.rows;   /* the micro-batch's items */
    return mf_step_ffn_up(eng, &y->sh_w1, &y->sh_w3, sh->xin + i0 * eng->c->hidden_size, NULL, a->t->n_tok, NULL,
                          sh->hs + i0 * I, sh->gs ? sh->gs + i0 * I : NULL, sh->us ? sh->us + i0 * I : NULL, r0, r1);
}

static int mf_task_sh_down(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    mf_step *eng = sh->eng;
    const mf_model_layer *y = mf_model_layer_at(eng->ly->m, a->t->layer);
    int r0 = (int)a->t->r0, r1 = (int)a->t->r1;   /* the record's rows (mf_sg_expert_rows) */
    if (r0 >= r1) return 0;
    mf_step_count_socket(eng, ctx, &y->sh_w2, r0, r1, 1);
    size_t i0 = (size_t)a->t->i0;   /* the micro-batch's items */
    return mf_step_ffn_down(eng, &y->sh_w2, sh->hs + i0 * y->sh_w1.rows, NULL, a->t->n_tok,
                            sh->ys + i0 * eng->c->hidden_size, r0, r1);
}

/* Combine, columns [r0, r1) of one item: the routed outputs in its top-k order, then the shared
 * expert, summed in double as the reference does (a fixed order: bit-identical whatever ran
 * where), rounded to bf16 and expanded into the streams with the split of its ffn mixes; part 0
 * carries that split's pre to the next sublayer. */
static int mf_task_combine(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    mf_step *eng = sh->eng;
    const mf_config *c = eng->c;
    const mf_model_layer *y = mf_model_layer_at(cx->ly->m, a->t->layer);
    int64_t H = c->hidden_size, d0 = a->t->r0, d1 = a->t->r1;
    int K = mf_config_layer_topk(c, a->t->layer), i = a->t->i0;
    float pre[MF_LY_MAX_HC], post[MF_LY_MAX_HC], comb[MF_LY_MAX_HC * MF_LY_MAX_HC];
    mf_ly_hc_split_w(c, sh->fmix + (size_t)i * MF_STEP_N_MIX, &y->hc_ffn_scale, &y->hc_ffn_base, pre, post, comb);
    float *out = sh->moe_out + (size_t)i * H;
    mf_step_bf16_cols(0, sh->ys, sh->ys16, H, i, d0, d1);   /* the shared expert's copy out from its card */
    /* the host's outputs are rounded already (rounding twice changes nothing), the cards' read from
     * the bf16 codes they copied out (row_card); 8 columns at a time under AVX2, each column's sum in
     * the scalar order */
    mf_fa_combine_cols(sh->y, sh->y16, sh->row_card, H, sh->asg + (size_t)i * K, K,
                       c->n_shared_experts > 0 ? sh->ys + (size_t)i * H : NULL, out, d0, d1);
    (sh->eng->o.exact ? mf_ly_hc_expand_cols : mf_fa_hc_expand_cols)(cx, sh->items[i].x, out, post, comb, d0, d1);
    if (a->t->part == 0) memcpy(sh->items[i].pre, pre, sizeof pre);
    return 0;
}

/* This file's ops (step_impl.h; step_shape.c binds them). */
const mf_task_fn mf_step_moe_fn_of[MF_SG_N_OPS] = {
    [MF_SG_GATE_ROWS] = mf_task_gate_rows,   [MF_SG_ROUTE] = mf_task_route,
    [MF_SG_ROUTE_ROWS] = mf_task_route_rows, [MF_SG_MOE_DONE] = mf_task_moe_done,
    [MF_SG_SLOT_UP] = mf_task_slot_up,       [MF_SG_SLOT_JOIN] = mf_task_slot_join,
    [MF_SG_SLOT_DOWN] = mf_task_slot_down,   [MF_SG_SHARED_UP] = mf_task_sh_up,
    [MF_SG_SHARED_DOWN] = mf_task_sh_down,   [MF_SG_COMBINE] = mf_task_combine,
};
