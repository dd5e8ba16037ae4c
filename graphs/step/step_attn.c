/* The scheduled engine's attention tasks (graphs/step/stepgraph_attn.c mf_sg_attn builds them; layer_attn.c's
 * phases): the linear stages in row parts over all items, the q norm, the window KV and compressor,
 * the index query, scores and select, the heads, the ring write, the expand. With the index scores
 * or the heads on cards: the host's side (the key tables, the queries' prep) and the cards' copies
 * and launches, which step_dense.c's dense tasks run. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>

#include "graphs/step/fast_attn.h"
#include "graphs/step/step_impl.h"
#include "sched/error.h"

/* Rows of linear stage a->t->stage (MF_LY_A_STAGE_*) of layer a->t->layer, part a->t->part of sh->p_attn:
 * the rows of each linear mf_sg_stage_rows gives the part (with sockets: of its socket's share of
 * each), each part over all items (weights read once for the batch); a row's bits do not depend on
 * the split. */
static int mf_task_attn_rows(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    mf_ly_attn_lin lin[MF_LY_A_MAX_LIN];
    int n = mf_ly_attn_linears(cx->ly, a->t->layer, a->t->stage, lin);
    int64_t rows[MF_SG_MAX_STAGE_LIN], r0[MF_SG_MAX_STAGE_LIN], r1[MF_SG_MAX_STAGE_LIN];
    for (int k = 0; k < n; k++) rows[k] = lin[k].w->rows;
    mf_sg_stage_rows(rows, n, sh->p_attn, sh->eng->lt.n_sockets, a->t->part, r0, r1);
    for (int k = 0; k < n; k++) {
        const mf_ly_attn_lin *l = &lin[k];
        int64_t lo = r0[k], hi = r1[k];
        if (lo >= hi) continue;
        mf_step_count_socket(sh->eng, ctx, l->w, lo, hi, 1);
        size_t i0 = (size_t)a->t->i0;   /* the micro-batch's items */
        int rc = (l->groups && !sh->eng->o.exact ? mf_fa_grouped_rows : mf_ly_attn_lin_rows)(
            cx, l, sh->ab[l->x] + i0 * sh->ab_ld[l->x], sh->ab_ld[l->x], sh->ab[l->y] + i0 * sh->ab_ld[l->y],
            sh->ab_ld[l->y], a->t->n_tok, lo, hi);
        if (rc) return mf_error_wrap(rc, "step: layer %d, rows [%lld, %lld) of %s", a->t->layer, (long long)lo,
                                     (long long)hi, l->w->name ? l->w->name : "an attention linear");
    }
    return 0;
}

/* Items: the q norm's scale of each one's low-rank query (rounded by the IN stage), into qrs. */
static int mf_task_attn_qscale(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    const mf_config *c = sh->eng->c;
    for (int i = a->t->i0; i < a->t->i1; i++) {
        mf_step_ab_cast(sh, MF_LY_A_QR, 0, i, 0, c->q_lora_rank);   /* in's copy out */
        sh->qrs[i] = mf_ly_rms_scale(sh->ab[MF_LY_A_QR] + (size_t)i * sh->ab_ld[MF_LY_A_QR], c->q_lora_rank,
                                     c->rms_norm_eps);
    }
    return 0;
}

/* Columns [r0, r1) of the item's low-rank query normed in place with its scale (after the QSCALE
 * task of its group): mf_ly_attn_qnorm's bits for any split. */
static int mf_task_attn_qnorm(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    int i = a->t->i0;
    float *q = sh->ab[MF_LY_A_QR] + (size_t)i * sh->ab_ld[MF_LY_A_QR];
    mf_ly_rmsnorm_apply(q, &mf_model_layer_at(sh->eng->ly->m, a->t->layer)->q_norm, sh->qrs[i], q, a->t->r0,
                        a->t->r1);
    mf_step_ab_cast(sh, MF_LY_A_QR, 1, i, a->t->r0, a->t->r1);   /* for qb's copy in */
    return 0;
}

/* The core's window KV per item, in item order: window KV (into the ring unless the ring task
 * writes it), compressor; after the IN stage, beside the q norm and the QB stage. The compressor
 * of a long unit (part 1; part 2 with the window KV: a mixed graph's item groups) runs in item
 * ranges, several at once (mf_ly_attn_kv_compress_item: an item reads the one before it, not the
 * state); the range holding a sequence's first item of the step leaves the state
 * (mf_ly_attn_kv_compress_state) after that item. */
static int mf_task_attn_kv(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_ly_item *items = sh->items;
    float *b[MF_LY_A_N], *prev[MF_LY_A_N];
    /* -1: the window KV and the compressor (from the state); 0: the window KV; 1: the compressor
     * (from the item before); 2: both so */
    int part = a->t->part, L = a->t->layer, n = sh->sg->n_live;
    for (int i = a->t->i0; i < a->t->i1; i++) {
        mf_step_abuf(sh, i, b);
        int rc = 0, first = i == 0 || items[i - 1].st != items[i].st;
        if (part < 0) rc = mf_ly_attn_window_kv(cx, &sh->items[i], L, b);
        if (part == 0 || part == 2) mf_ly_attn_kv_window(cx, &sh->items[i], L, b);
        if (part >= 1) {
            if (!first) mf_step_abuf(sh, i - 1, prev);
            rc = mf_ly_attn_kv_compress_item(cx, &items[i], L, b, first ? NULL : prev);
            if (!rc && first) {   /* the state, from the sequence's last item in the step (and the
                                   * last that opened a group: ratio 2's even positions) */
                int j = i;
                while (j + 1 < n && items[j + 1].st == items[i].st) j++;
                int jo = items[j].pos % 2 ? j - 1 : j;
                if (jo >= i) mf_step_abuf(sh, jo, prev);
                rc = mf_ly_attn_kv_compress_state(cx, &items[i], &items[j], L, jo >= i ? prev : NULL);
            }
        }
        if (rc) return rc;
        if (part < 0 && !sh->sg->ring_late) mf_ly_attn_ring_write(cx, &sh->items[i], L, b[MF_LY_A_KV]);
    }
    return 0;
}

/* The rest of the core's prep per item, in item order (after the window KV and the QB stage): the
 * index query; on layers without score tasks the select (hook). */
static int mf_task_attn_core(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    int scored = mf_sg_layer_scored(cx->ly->c, a->t->layer);
    float *b[MF_LY_A_N];
    const mf_config *c = cx->ly->c;
    for (int i = a->t->i0; i < a->t->i1; i++) {
        mf_step_abuf(a->sh, i, b);
        if (scored)   /* qb's copy out of the indexer's queries (their only reader rounds them first) */
            mf_step_ab_cast(a->sh, MF_LY_A_QI, 0, i, 0, (int64_t)c->index_n_heads * c->index_head_dim);
        mf_ly_attn_index_query(cx, &a->sh->items[i], a->t->layer, b);
        if (!scored) mf_ly_attn_core_select(cx, &a->sh->items[i], a->t->layer, cx->scores);
    }
    return 0;
}

/* Part a->t->part of the item's index score parts (mf_stepgraph_key_parts): its range of the
 * visible entries into the item's row of iscore (disjoint ranges: any split, the same bits). */
static int mf_task_attn_score(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    const mf_layers *ly = sh->eng->ly;
    int i = a->t->i0, q = a->t->part, P = mf_stepgraph_key_parts(sh->sg, i);
    int64_t n_vis = mf_ly_index_n_vis(ly->c, a->t->layer, sh->items[i].pos);
    float *b[MF_LY_A_N];
    mf_step_abuf(sh, i, b);
    (sh->eng->o.exact ? mf_ly_index_scores : mf_fa_index_scores)(
        ly, &sh->items[i], a->t->layer, b, sh->iscore + (size_t)i * sh->iscore_ld, n_vis * q / P, n_vis * (q + 1) / P);
    return 0;
}

/* Per item, in item order: the candidate mask and top-k from its scores (the select hook). With
 * the scores on cards and sk_host, the item's scores on the host first. */
static int mf_task_attn_select(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    int L = a->t->layer, host = sh->sg->scores_cards[L] && sh->sk_host;
    for (int i = a->t->i0; i < a->t->i1; i++) {
        double *score = sh->iscore + (size_t)i * sh->iscore_ld;
        if (host) {
            float *b[MF_LY_A_N];
            mf_step_abuf(sh, i, b);
            mf_fa_index_scores(cx->ly, &sh->items[i], L, b, score, 0, mf_ly_index_n_vis(cx->ly->c, L, sh->items[i].pos));
        }
        (sh->eng->o.exact ? mf_ly_attn_core_select : mf_fa_attn_select)(cx, &sh->items[i], L, score);
    }
    return 0;
}

/* The first item of [i0, i1) that is not the position after the one before it in the same
 * sequence, -1 when they are consecutive positions of one sequence (what the cards' heads and
 * index scores take). */
static int mf_step_items_gap(const mf_step_shape *sh, int i0, int i1)
{
    const mf_ly_item *it = sh->items;
    for (int i = i0 + 1; i < i1; i++)
        if (it[i].st != it[i0].st || it[i].pos != it[i0].pos + (i - i0)) return i;
    return -1;
}

/* ---- the index scores on cards (graphs/step/stepgraph.h MF_SG_ATTN_KEYS, MF_SG_D_SCORES) ----- */

/* The unit's index keys: the entries of layer L's index source its last item sees, unpacked as
 * the host's scores unpack them (mf_ly_cache_get_keys), and each item's visible count; sk_host
 * when the items are not consecutive positions of one sequence or see more than
 * MF_SG_SCORE_ENTRIES entries (mf_step_opts.scores_entries: fewer). */
static int mf_task_attn_keys(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    const mf_layers *ly = sh->eng->ly;
    const mf_config *c = ly->c;
    int L = a->t->layer, i0 = a->t->i0, i1 = a->t->i1;
    const mf_ly_item *it = sh->items;
    sh->sk_host = mf_step_items_gap(sh, i0, i1) >= 0;
    sh->sk_nkeys = mf_ly_index_n_vis(c, L, it[i1 - 1].pos);
    int cap = sh->eng->o.scores_entries > 0 && sh->eng->o.scores_entries < MF_SG_SCORE_ENTRIES
                  ? sh->eng->o.scores_entries : MF_SG_SCORE_ENTRIES;
    if (sh->sk_nkeys > cap) sh->sk_host = 1;
    if (sh->sk_host) return 0;
    for (int i = i0; i < i1; i++) sh->sk_nvis[i] = (int32_t)mf_ly_index_n_vis(c, L, it[i].pos);
    int S = ly->src_of[L];
    if (sh->sk_nkeys > 0) mf_ly_cache_get_keys(c, S, &it[i0].st->cache[S], 0, sh->sk_nkeys, sh->sk_tab);
    return 0;
}

/* The most entries any of the task's items sees: the keys its card reads, its score rows' width. */
static int64_t mf_step_scores_keys(const mf_step_targ *a)
{
    int64_t m = 0;
    for (int i = a->t->i0; i < a->t->i1; i++) m = a->sh->sk_nvis[i] > m ? a->sh->sk_nvis[i] : m;
    return m;
}

/* The task's score rows on its card: block 0's from the start of the card's score rows, block 1's
 * ending at their end (MF_SG_D_SCORES: the two blocks' rows together at most sk_rows). */
static double *mf_step_scores_rows(const mf_step_targ *a)
{
    const mf_step_shape *sh = a->sh;
    size_t r0 = a->t->block > 0 ? (size_t)(sh->sk_rows - (a->t->i1 - a->t->i0)) * MF_SG_SCORE_ENTRIES : 0;
    return (double *)(sh->ddense[a->t->card] + sh->dd_sk_score) + r0;
}

/* The scores' copy in (out 0: the items' index queries and head weights, their counts, block 0 the
 * keys they see) or out (out 1: their scores into their rows of iscore) on the task's card. */
int mf_step_scores_copy(const mf_step_targ *a, mf_dev_stream *q, int out)
{
    mf_step_shape *sh = a->sh;
    if (sh->sk_host) return MF_TASK_NO_WORK;
    const mf_config *c = sh->eng->c;
    int i0 = a->t->i0, n = a->t->i1 - i0, ih = c->index_n_heads, id = c->index_head_dim;
    int64_t nk = mf_step_scores_keys(a);
    uint8_t *db = sh->ddense[a->t->card];
    size_t f = sizeof(float);
    if (out) {
        if (!nk) return MF_TASK_NO_WORK;
        size_t w = (size_t)nk * sizeof(double);
        return mf_dev_copy_d2h_2d(q, sh->iscore + (size_t)i0 * sh->iscore_ld, (size_t)sh->iscore_ld * sizeof(double),
                                  mf_step_scores_rows(a), w, w, (size_t)n);
    }
    int rc = 0;
    for (int k = 0; k < 2 && !rc; k++) {   /* the queries, the head weights: the items' rows, as on the host */
        int b = k ? MF_LY_A_IW : MF_LY_A_QI;
        size_t ld = (size_t)sh->ab_ld[b] * f, off = (size_t)i0 * ld;
        rc = mf_dev_copy_h2d_2d(q, db + sh->dd_ab[b] + off, ld, (uint8_t *)sh->ab[b] + off, ld,
                                (size_t)(k ? ih : ih * id) * f, (size_t)n);
    }
    if (!rc) rc = mf_dev_copy_h2d(q, db + sh->dd_sk_nvis + (size_t)i0 * 4, sh->sk_nvis + i0, (size_t)n * 4);
    if (!rc && nk && a->t->block == 0) rc = mf_dev_copy_h2d(q, db + sh->dd_sk_tab, sh->sk_tab, (size_t)nk * id * f);
    return rc;
}

/* The task's items' index scores on its card's compute stream (mf_dev_index_scores: the host's
 * arithmetic; mf_step_opts.scores_fault: the last index head left out). */
int mf_step_scores_launch(const mf_step_targ *a, mf_dev_stream *st)
{
    mf_step_shape *sh = a->sh;
    int64_t nk = sh->sk_host ? 0 : mf_step_scores_keys(a);
    if (!nk) return MF_TASK_NO_WORK;
    const mf_config *c = sh->eng->c;
    int i0 = a->t->i0;
    uint8_t *db = sh->ddense[a->t->card];
    mf_dev_iscore is = {.q = (const float *)(db + sh->dd_ab[MF_LY_A_QI]) + i0 * sh->ab_ld[MF_LY_A_QI],
                        .ld_q = sh->ab_ld[MF_LY_A_QI],
                        .w = (const float *)(db + sh->dd_ab[MF_LY_A_IW]) + i0 * sh->ab_ld[MF_LY_A_IW],
                        .ld_w = sh->ab_ld[MF_LY_A_IW], .n_tok = a->t->i1 - i0, .n_heads = c->index_n_heads,
                        .D = c->index_head_dim, .keys = (const float *)(db + sh->dd_sk_tab), .n_keys = nk,
                        .n_vis = (const int32_t *)(db + sh->dd_sk_nvis) + i0, .score = mf_step_scores_rows(a),
                        .ld_s = nk};
    if (sh->eng->o.scores_fault && is.n_heads > 1) is.n_heads--;
    int rc = mf_dev_index_scores(st, &is);
    return rc ? mf_error_wrap(rc, "the index scores of layer %d on card %d", a->t->layer, a->t->card) : 0;
}

/* Heads [h0, h1) of item a->t->i0 on the host. With the ring written late, the window positions
 * of its sequence's items in this graph are read from their KV rows. */
static void mf_step_heads_host(const mf_step_targ *a, mf_ly_ctx *cx, int h0, int h1)
{
    mf_step_shape *sh = a->sh;
    int i = a->t->i0, j0 = i;
    float *b[MF_LY_A_N];
    mf_step_abuf(sh, i, b);
    mf_ly_win win, *wp = NULL;
    if (sh->sg->ring_late) {   /* the first item of the sequence's run of items */
        while (j0 > 0 && sh->items[j0 - 1].st == sh->items[i].st) j0--;
        win = (mf_ly_win){.kv = sh->ab[MF_LY_A_KV] + (size_t)j0 * sh->ab_ld[MF_LY_A_KV], .ld = sh->ab_ld[MF_LY_A_KV],
                          .pos0 = sh->items[j0].pos};
        wp = &win;
    }
    int D = sh->eng->c->head_dim;
    mf_step_ab_cast(sh, MF_LY_A_Q, 0, i, (int64_t)h0 * D, (int64_t)h1 * D);   /* qb's queries from a card */
    (sh->eng->o.exact ? mf_ly_attn_core_heads : mf_fa_attn_heads)(cx, &sh->items[i], a->t->layer, b, h0, h1, wp);
    mf_step_ab_cast(sh, MF_LY_A_O, 1, i, (int64_t)h0 * D, (int64_t)h1 * D);   /* for oa's copy */
}

/* The heads of rows [r0, r1) of the item's attention output. */
static int mf_task_attn_heads(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    int D = cx->ly->c->head_dim;
    mf_step_heads_host(a, cx, (int)(a->t->r0 / D), (int)(a->t->r1 / D));
    return 0;
}

/* ---- the heads on cards (graphs/step/stepgraph.h MF_SG_ATTN_GATHER, _QPREP, MF_SG_D_HEADS, _OPOST) */

/* The unit's key table: its items consecutive positions of one sequence; the ring's window rows
 * before the chunk (all the window when the ring is written before the heads) unpacked as the
 * host's heads unpack them (mf_fa_ring_rows), the union of the items' selections of layer L's KV
 * source in entry order, each entry unpacked once as mf_ly_item_sel_kv does (mf_ly_cache_get_kv),
 * and the sinks. */
static int mf_task_attn_gather(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    const mf_layers *ly = sh->eng->ly;
    const mf_config *c = ly->c;
    int L = a->t->layer, i0 = a->t->i0, i1 = a->t->i1, D = c->head_dim, W = c->sliding_window;
    const mf_ly_item *it = sh->items;
    int gap = mf_step_items_gap(sh, i0, i1);
    if (gap >= 0)
        return mf_error(-EINVAL, "step: heads on cards: item %d is not the position after item %d of its sequence",
                        gap, gap - 1);
    int64_t pos0 = it[i0].pos, last = it[i1 - 1].pos;
    sh->hk_pos0 = pos0;
    sh->hk_t0 = pos0 - W + 1 < 0 ? 0 : pos0 - W + 1;
    sh->hk_ring_hi = sh->sg->ring_late ? pos0 : last + 1;   /* the window rows the ring holds */
    sh->hk_nring = (int)(sh->hk_ring_hi - sh->hk_t0);
    sh->hk_nchunk = sh->sg->ring_late ? i1 - i0 : 0;
    sh->hk_nent = 0;
    sh->hk_host = 0;
    if (sh->hk_nring > 0) mf_fa_ring_rows(c, it[i0].st, L, sh->hk_t0, sh->hk_nring, sh->hk_tab);
    int S = ly->src_of[L];
    if (c->compress_ratios[L] > 0) {
        int64_t nv = 0;   /* entries [0, nv) hold every selected one */
        for (int i = i0; i < i1; i++)
            for (int j = 0; it[i].topk_src == S && j < it[i].n_topk; j++)
                if (it[i].topk[j] + 1 > nv) nv = it[i].topk[j] + 1;
        if (nv > sh->hk_map_cap) {
            int32_t *m = realloc(sh->hk_map, sizeof *m * (size_t)nv);
            if (!m) return mf_error(-ENOMEM, "step: heads on cards: a map of %lld entries", (long long)nv);
            sh->hk_map = m;
            sh->hk_map_cap = nv;
        }
        for (int64_t j = 0; j < nv; j++) sh->hk_map[j] = -1;
        for (int i = i0; i < i1; i++)
            for (int j = 0; it[i].topk_src == S && j < it[i].n_topk; j++) sh->hk_map[it[i].topk[j]] = -2;
        int base = sh->hk_nring + sh->hk_nchunk;
        for (int64_t j = 0; j < nv; j++) {
            if (sh->hk_map[j] != -2) continue;
            int cut = sh->eng->o.heads_entries;   /* a test's smaller table */
            if (sh->hk_nent == sh->hk_ecap || (cut > 0 && sh->hk_nent == cut)) {   /* more than the card's table holds: the host's heads */
                sh->hk_host = 1;
                return 0;
            }
            sh->hk_map[j] = base + sh->hk_nent;
            mf_ly_cache_get_kv(c, S, &it[i0].st->cache[S], j, sh->hk_tab + (int64_t)(sh->hk_nring + sh->hk_nent++) * D);
        }
    }
    const mf_model_layer *y = mf_model_layer_at(ly->m, L);
    for (int h = 0; h < c->n_heads; h++) sh->hk_sink[h] = mf_ly_vec(&y->attn_sink, h);
    return 0;
}

/* The item's queries prepared (mf_fa_heads_q; not where they stay on the cards,
 * mf_stepgraph.heads_qlocal: the card's heads prepare them) and its key list: its window positions
 * in order (the ring's rows, then the chunk's), then its selection in selection order, as
 * mf_fa_attn_heads takes them; where the card's heads rope (heads_local, _qlocal) the item's RoPE
 * table. With hk_host: the host's heads of the item instead. */
static int mf_task_attn_qprep(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_config *c = cx->ly->c;
    int i = a->t->i0, L = a->t->layer, W = c->sliding_window, KK = sh->sg->heads_keys;
    if (sh->hk_host) {
        mf_step_heads_host(a, cx, 0, c->n_heads);
        return 0;
    }
    const mf_ly_item *it = &sh->items[i];
    float *b[MF_LY_A_N];
    int64_t nq = (int64_t)c->n_heads * c->head_dim;
    mf_step_abuf(sh, i, b);
    if (!sh->sg->heads_qlocal[L]) {
        mf_step_ab_cast(sh, MF_LY_A_Q, 0, i, 0, nq);   /* qb's copy out, then the heads' copy in */
        mf_fa_heads_q(cx->ly, it, L, b[MF_LY_A_Q], 0, c->n_heads);
        mf_step_ab_cast(sh, MF_LY_A_Q, 1, i, 0, nq);
    }
    if (sh->sg->heads_local[L] || sh->sg->heads_qlocal[L])   /* the card's heads rope: its table */
        mf_fa_heads_rope_cs(cx->ly, it, L, sh->hk_rope + (size_t)i * c->qk_rope_head_dim);
    int32_t *row = sh->hk_keys + (size_t)i * KK;
    int64_t p = it->pos, t0 = p - W + 1 < 0 ? 0 : p - W + 1, m = 0;
    for (int64_t t = t0; t <= p; t++)
        row[m++] = (int32_t)(t < sh->hk_ring_hi ? t - sh->hk_t0 : sh->hk_nring + (t - sh->hk_pos0));
    if (c->compress_ratios[L] > 0 && it->topk_src == cx->ly->src_of[L])
        for (int j = 0; j < it->n_topk; j++) row[m++] = sh->hk_map[it->topk[j]];
    sh->hk_nk[i] = (int32_t)m;
    return 0;
}

/* The item's heads' outputs inverse-roped (mf_fa_heads_o); nothing with hk_host. */
static int mf_task_attn_opost(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    if (sh->hk_host) return 0;
    float *b[MF_LY_A_N];
    int i = a->t->i0;
    int64_t no = (int64_t)cx->ly->c->n_heads * cx->ly->c->head_dim;
    mf_step_abuf(sh, i, b);
    mf_step_ab_cast(sh, MF_LY_A_O, 0, i, 0, no);   /* the heads' copy out, then oa's copy in */
    mf_fa_heads_o(cx->ly, &sh->items[i], a->t->layer, b[MF_LY_A_O], 0, cx->ly->c->n_heads);
    mf_step_ab_cast(sh, MF_LY_A_O, 1, i, 0, no);
    return 0;
}

/* The heads' copy in (out 0) or out (out 1) on the task's card: in the prepared queries of its
 * heads (none where qb left them on the card: mf_stepgraph.heads_qlocal), the key table (the ring's
 * rows, the chunk's KV rows, the entries), the items' key lists and counts, the sinks, and where
 * the outputs or the queries stay on the card (heads_local, _qlocal) the items' RoPE tables; out
 * its heads' outputs. With hk_host nothing, but where the outputs
 * stay on the card the host's heads' outputs of the card's heads in (for its wo_a rows). */
int mf_step_heads_copy(const mf_step_targ *a, mf_dev_stream *q, int out)
{
    mf_step_shape *sh = a->sh;
    const mf_config *c = sh->eng->c;
    int i0 = a->t->i0, n = a->t->i1 - i0, D = c->head_dim, KK = sh->sg->heads_keys, rd = c->qk_rope_head_dim;
    int local = sh->sg->heads_local[a->t->layer], qlocal = sh->sg->heads_qlocal[a->t->layer];
    uint8_t *db = sh->ddense[a->t->card];
    size_t f = sizeof(float), row = (size_t)D * f;
    if (sh->hk_host && local && !out) {   /* the host's heads' outputs of the card's heads, for its wo_a rows */
        mf_step_dcopy co = mf_step_dcopy_ab(sh, MF_LY_A_O, a->t->r0, a->t->r1, (size_t)i0, (size_t)n, 0);
        return mf_step_dcopy_run(q, db, &co, 0);
    }
    if (sh->hk_host) return MF_TASK_NO_WORK;
    /* the task's heads' columns of the queries or outputs (bf16: mf_sg_attn_buf_bf16) */
    mf_step_dcopy cq = mf_step_dcopy_ab(sh, out ? MF_LY_A_O : MF_LY_A_Q, a->t->r0, a->t->r1, (size_t)i0, (size_t)n, out);
    int rc = out || !qlocal ? mf_step_dcopy_run(q, db, &cq, out) : 0;
    if (out) return rc;
    /* the key table and the sinks, which the blocks share: block 0's (its items from the unit's
     * first, the chunk's KV rows from there; the blocks' copy-ins run in order) */
    int first = a->t->block == 0;
    uint8_t *tab = db + sh->dd_hk_tab;
    if (!rc && first && sh->hk_nring) rc = mf_dev_copy_h2d(q, tab, sh->hk_tab, (size_t)sh->hk_nring * row);
    if (!rc && first && sh->hk_nchunk) {
        size_t ldkv = (size_t)sh->ab_ld[MF_LY_A_KV] * f;
        rc = mf_dev_copy_h2d_2d(q, tab + (size_t)sh->hk_nring * row, row, (uint8_t *)sh->ab[MF_LY_A_KV] + (size_t)i0 * ldkv,
                                ldkv, row, (size_t)sh->hk_nchunk);
    }
    if (!rc && first && sh->hk_nent)
        rc = mf_dev_copy_h2d(q, tab + (size_t)(sh->hk_nring + sh->hk_nchunk) * row, sh->hk_tab + (size_t)sh->hk_nring * D,
                             (size_t)sh->hk_nent * row);
    if (!rc)
        rc = mf_dev_copy_h2d(q, db + sh->dd_hk_keys + (size_t)i0 * KK * 4, sh->hk_keys + (size_t)i0 * KK,
                             (size_t)n * KK * 4);
    if (!rc) rc = mf_dev_copy_h2d(q, db + sh->dd_hk_nk + (size_t)i0 * 4, sh->hk_nk + i0, (size_t)n * 4);
    if (!rc && first) rc = mf_dev_copy_h2d(q, db + sh->dd_hk_sink, sh->hk_sink, (size_t)c->n_heads * f);
    if (!rc && (local || qlocal))
        rc = mf_dev_copy_h2d(q, db + sh->dd_hk_rope + (size_t)i0 * rd * f, sh->hk_rope + (size_t)i0 * rd, (size_t)n * rd * f);
    return rc;
}

/* The task's heads' scores and values on its card's compute stream st (mf_dev_attn_heads: the
 * host's heads' arithmetic; mf_step_opts.heads_fault: the scale 1% off). */
int mf_step_heads_launch(const mf_step_targ *a, mf_dev_stream *st)
{
    mf_step_shape *sh = a->sh;
    const mf_config *c = sh->eng->c;
    int i0 = a->t->i0, D = c->head_dim, KK = sh->sg->heads_keys;
    uint8_t *db = sh->ddense[a->t->card];
    mf_dev_attn at = {.q = (const float *)(db + sh->dd_ab[MF_LY_A_Q]) + i0 * sh->ab_ld[MF_LY_A_Q] + a->t->r0,
                      .ld_q = sh->ab_ld[MF_LY_A_Q], .n_tok = a->t->i1 - i0, .n_heads = (int)((a->t->r1 - a->t->r0) / D),
                      .D = D, .scale = (float)(1.0 / sqrt((double)D)),
                      .sink = (const float *)(db + sh->dd_hk_sink) + a->t->r0 / D,
                      .kv = (const float *)(db + sh->dd_hk_tab), .n_kv = sh->hk_nring + sh->hk_nchunk + sh->hk_nent,
                      .keys = (const int32_t *)(db + sh->dd_hk_keys) + (size_t)i0 * KK,
                      .n_keys = (const int32_t *)(db + sh->dd_hk_nk) + i0, .ld_keys = KK,
                      .o = (float *)(db + sh->dd_ab[MF_LY_A_O]) + i0 * sh->ab_ld[MF_LY_A_O] + a->t->r0,
                      .ld_o = sh->ab_ld[MF_LY_A_O]};
    int local = sh->sg->heads_local[a->t->layer], qlocal = sh->sg->heads_qlocal[a->t->layer];
    if (local || qlocal) at.rope = (const float *)(db + sh->dd_hk_rope) + (size_t)i0 * c->qk_rope_head_dim;
    if (local) at.rope_dim = c->qk_rope_head_dim;     /* the inverse RoPE too: the outputs stay for the card's wo_a */
    if (qlocal) at.q_rope_dim = c->qk_rope_head_dim;  /* qb's queries as it left them: the q prep's work here */
    if (sh->eng->o.heads_fault) at.scale *= 1.01f;
    int rc = mf_dev_attn_heads(st, &at);
    return rc ? mf_error_wrap(rc, "the heads of layer %d on card %d", a->t->layer, a->t->card) : 0;
}

/* The items' window KV into the ring, in item order (after every head that reads the ring rows
 * they take). An item whose sequence reaches W = sliding_window positions further in this graph is
 * left out of the ring: that later item takes its ring row (so item groups of a mixed graph, each
 * writing its own items, never write one row twice; in one task in order the later write won the
 * same way); its row still goes to the prefix cache's tap (mf_ly_ring_tap), which keeps every
 * position's. */
static int mf_task_attn_ring(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    const mf_ly_item *it = a->sh->items;
    int n = a->sh->sg->n_live, W = cx->ly->c->sliding_window;
    int64_t last = -1;   /* the position of the last item of item i's sequence in the graph */
    for (int i = a->t->i0; i < a->t->i1; i++) {
        if (i == a->t->i0 || it[i].st != it[i - 1].st) {
            int j = i;
            while (j + 1 < n && it[j + 1].st == it[i].st) j++;
            last = it[j].pos;
        }
        const float *kv = a->sh->ab[MF_LY_A_KV] + (size_t)i * a->sh->ab_ld[MF_LY_A_KV];
        if (last - it[i].pos >= W)   /* the ring never holds it; the prefix cache's tap still does */
            mf_ly_ring_tap(cx->ly->c, it[i].st, a->t->layer, it[i].pos, kv);
        else
            mf_ly_attn_ring_write(cx, &a->sh->items[i], a->t->layer, kv);
    }
    return 0;
}

/* Columns of the attention output expanded into the item's streams (with the split of its
 * attention mixes), then collapsed with that mix's pre into hcol (the MoE input before ffn_norm):
 * the rest of the first part of the reference's layer (ref_model.c). */
static int mf_task_attn_post(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_config *c = cx->ly->c;
    const mf_model_layer *y = mf_model_layer_at(cx->ly->m, a->t->layer);
    int64_t H = c->hidden_size;
    int i = a->t->i0;
    mf_ly_item *it = &sh->items[i];
    float pre[MF_LY_MAX_HC], post[MF_LY_MAX_HC], comb[MF_LY_MAX_HC * MF_LY_MAX_HC];
    mf_ly_hc_split_w(c, sh->amix + (size_t)i * MF_STEP_N_MIX, &y->hc_attn_scale, &y->hc_attn_base, pre, post, comb);
    int ex = sh->eng->o.exact;
    mf_step_ab_cast(sh, MF_LY_A_OUT, 0, i, a->t->r0, a->t->r1);   /* ob's copy out */
    (ex ? mf_ly_hc_expand_cols : mf_fa_hc_expand_cols)(cx, it->x, sh->ab[MF_LY_A_OUT] + (size_t)i * sh->ab_ld[MF_LY_A_OUT],
                                                       post, comb, a->t->r0, a->t->r1);
    (ex ? mf_ly_hc_collapse_cols : mf_fa_hc_collapse_cols)(cx, it->x, pre, sh->hcol + (size_t)i * H, a->t->r0, a->t->r1);
    return 0;
}

/* This file's ops (step_impl.h; step_shape.c binds them). */
const mf_task_fn mf_step_attn_fn_of[MF_SG_N_OPS] = {
    [MF_SG_ATTN_ROWS] = mf_task_attn_rows,     [MF_SG_ATTN_QSCALE] = mf_task_attn_qscale,
    [MF_SG_ATTN_QNORM] = mf_task_attn_qnorm,   [MF_SG_ATTN_KV] = mf_task_attn_kv,
    [MF_SG_ATTN_CORE] = mf_task_attn_core,     [MF_SG_ATTN_SCORE] = mf_task_attn_score,
    [MF_SG_ATTN_SELECT] = mf_task_attn_select, [MF_SG_ATTN_KEYS] = mf_task_attn_keys,
    [MF_SG_ATTN_HEADS] = mf_task_attn_heads,   [MF_SG_ATTN_GATHER] = mf_task_attn_gather,
    [MF_SG_ATTN_QPREP] = mf_task_attn_qprep,   [MF_SG_ATTN_OPOST] = mf_task_attn_opost,
    [MF_SG_ATTN_RING] = mf_task_attn_ring,     [MF_SG_ATTN_POST] = mf_task_attn_post,
};
