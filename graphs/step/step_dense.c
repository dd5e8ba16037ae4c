/* The scheduled engine's dense work on cards (--dense cards; docs/decode.md): a dense sublayer's
 * copies of activations in and out (as bf16 where stepgraph.h says so), its launches on the card's
 * copies of the activations and its resident weights, and the upload of those weights at
 * mf_step_new. The index scores' and heads' copies and launches are step_attn.c's. */
#include <assert.h>
#include <errno.h>
#include <stdlib.h>

#include "graphs/step/fast_attn.h"
#include "graphs/step/step_impl.h"
#include "sched/error.h"

/* ---- copies of the dense work on cards ---------------------------------------------------- */

/* Enqueues copy cp on q into (out 0) or out of (out 1) the card's buffer db: one block when its rows
 * are whole, else one 2D copy; as bf16 the card's copy stream packs the floats before (out) or
 * unpacks them after (in) the copy of the codes (mf_dev_bf16_pack, _unpack). */
int mf_step_dcopy_run(mf_dev_stream *q, uint8_t *db, const mf_step_dcopy *cp, int out)
{
    int bf = cp->host16 != NULL, rows = (int)cp->rows, n = (int)cp->n;
    size_t vb = bf ? 2 : sizeof(float), w = cp->n * vb, pitch = cp->ld * vb;
    float *df = (float *)(void *)(db + cp->off);
    uint16_t *d16 = (uint16_t *)(void *)(db + cp->off16);
    uint8_t *dev = bf ? (uint8_t *)d16 : (uint8_t *)df, *host = bf ? (uint8_t *)cp->host16 : (uint8_t *)cp->host;
    int rc = 0;
    if (bf && ((cp->rows - 1) * cp->ld + cp->n) * 2 > cp->cap16)
        return mf_error(-ENOSPC, "step: a bf16 copy of %zu rows of %zu values (%zu apart) takes more than the card's "
                        "%zu bytes of staging (graphs/step/stepgraph.h mf_sg_card_bufs.stg_bytes)", cp->rows, cp->n,
                        cp->ld, cp->cap16);
    if (out && bf) rc = mf_dev_bf16_pack(q, df, (int64_t)cp->ld, d16, (int64_t)cp->ld, rows, n);
    if (!rc && (rows == 1 || cp->n == cp->ld))
        rc = out ? mf_dev_copy_d2h(q, host, dev, (cp->rows - 1) * pitch + w)
                 : mf_dev_copy_h2d(q, dev, host, (cp->rows - 1) * pitch + w);
    else if (!rc)
        rc = out ? mf_dev_copy_d2h_2d(q, host, pitch, dev, pitch, w, cp->rows)
                 : mf_dev_copy_h2d_2d(q, dev, pitch, host, pitch, w, cp->rows);
    if (!rc && !out && bf) rc = mf_dev_bf16_unpack(q, d16, (int64_t)cp->ld, df, (int64_t)cp->ld, rows, n);
    return rc;
}

/* ---- dense work on cards ------------------------------------------------------------------- */

/* Rows [r0, r1) of its sublayer's n_rows output rows that dense task a owns: the builder's rule
 * (graphs/step/stepgraph.h mf_sg_dense_rows: all of them on one card, a card's chunk with
 * --dense-split rows, all of them again where its record's part is -1: the in stage split by
 * items, its items its block's). The rows of an attention stage are its linears' one after another. */
static void mf_step_dense_rows(const mf_step_targ *a, int64_t n_rows, int64_t *r0, int64_t *r1)
{
    const mf_stepgraph *sg = a->sh->sg;
    int d = a->t->dense;
    mf_sg_dense_rows(d == MF_SG_D_MARKOV ? sg->mk_parts : mf_sg_dense_parts(sg->n_dense_cards, sg->dense_split, d),
                     a->t->part, n_rows, r0, r1);
}

/* The rows task a computes: its own (mf_step_dense_rows), less the last one under the test fault
 * (mf_step_opts.dense_fault_skip_row: card 0's split tasks). */
static void mf_step_dense_run_rows(const mf_step_targ *a, int64_t n_rows, int64_t *r0, int64_t *r1)
{
    mf_step_dense_rows(a, n_rows, r0, r1);
    if (a->sh->eng->o.dense_fault_skip_row && a->t->part == 0 && *r1 > *r0) (*r1)--;
}

/* The copies into (out 0) or out of (out 1) the card of dense task a, into cp[]; returns their
 * count (at most MF_LY_A_MAX_LIN). Attention stages: the distinct inputs of the stage's linears,
 * and the rows the task owns of their outputs (on one card oa's outputs and ob's inputs stay on
 * the card; split by rows every card's wo_a rows go out and the other cards' (or all of them:
 * mf_sg_ob_in_cols) come back for wo_b). */
static int mf_step_dense_copies(const mf_step_targ *a, int out, mf_step_dcopy *cp)
{
    mf_step_shape *sh = a->sh;
    const mf_config *c = sh->eng->c;
    /* the micro-batch's items [i0, i0 + n) (the head: the items with logits, from 0) */
    size_t i0 = (size_t)a->t->i0, n = (size_t)(a->t->i1 - a->t->i0), H = (size_t)c->hidden_size;
    int d = a->t->dense, m = 0, split = a->t->part >= 0;
    int64_t r0, r1;
    if (d <= MF_SG_D_ATTN_OB) {
        static const int stage_of[4] = {MF_LY_A_STAGE_IN, MF_LY_A_STAGE_QB, MF_LY_A_STAGE_OA, MF_LY_A_STAGE_OB};
        if (!split && ((d == MF_SG_D_ATTN_OA && out) || (d == MF_SG_D_ATTN_OB && !out))) return 0;
        mf_ly_attn_lin lin[MF_LY_A_MAX_LIN];
        int nl = mf_ly_attn_linears(sh->eng->ly, a->t->layer, stage_of[d], lin), seen = 0;
        int64_t total = 0, base = 0;
        for (int k = 0; k < nl; k++) total += lin[k].w->rows;
        mf_step_dense_rows(a, total, &r0, &r1);
        for (int k = 0; k < nl; k++) {
            int b = out ? lin[k].y : lin[k].x;
            int64_t rows = lin[k].w->rows, lo = r0 - base > 0 ? r0 - base : 0, hi = r1 - base < rows ? r1 - base : rows;
            base += rows;
            if (out && split) {   /* this card's rows of the linear's output */
                if (lo < hi) cp[m++] = mf_step_dcopy_ab(sh, b, lo, hi, i0, n, out);
                continue;
            }
            if (split && d == MF_SG_D_ATTN_OB) {   /* wo_a's output: the columns mf_sg_ob_in_cols gives */
                int64_t cols[2][2];
                int nr = mf_sg_ob_in_cols(sh->sg, a->t->part, (int64_t)c->o_groups * c->o_lora_rank, cols);
                for (int q = 0; q < nr; q++) cp[m++] = mf_step_dcopy_ab(sh, b, cols[q][0], cols[q][1], i0, n, out);
                continue;
            }
            if (split && lin[k].groups) {   /* grouped (wo_a): the input slices of the groups its rows touch */
                int64_t R = rows / lin[k].groups, cols = lin[k].w->cols;
                if (lo < hi) cp[m++] = mf_step_dcopy_ab(sh, b, lo / R * cols, (hi + R - 1) / R * cols, i0, n, out);
                continue;
            }
            if (seen & (1 << b)) continue;
            seen |= 1 << b;
            cp[m++] = mf_step_dcopy_ab(sh, b, 0, sh->ab_ld[b], i0, n, out);   /* whole rows: one block */
        }
        return m;
    }
    size_t nh = (size_t)sh->n_head;
    int64_t E = c->n_routed_experts, V = c->vocab_size;
    switch (d) {
    case MF_SG_D_GATE:
        mf_step_dense_rows(a, E, &r0, &r1);
        if (out && r0 < r1) cp[m++] = mf_step_dcopy_cols(sh->logits, NULL, sh->dd_logits, 0, E, r0, r1, i0, n);
        if (!out)
            cp[m++] = mf_step_dcopy_cols(sh->xin, sh->xin16, sh->dd_xin, sh->dd16_xin, (int64_t)H, 0, (int64_t)H, i0, n);
        break;
    case MF_SG_D_SHARED:
        if (out)
            cp[m++] = mf_step_dcopy_staged(sh, mf_step_dcopy_cols(sh->ys, sh->ys16, sh->dd_ys, 0, (int64_t)H, 0, (int64_t)H,
                                                                  i0, n), 1, 0);
        break;
    case MF_SG_D_HEAD:
        mf_step_dense_rows(a, V, &r0, &r1);
        /* more items than the card's buffer holds: the head's passes copy them out (mf_step_dense_launch) */
        if (nh && out && r0 < r1 && nh <= (size_t)sh->head_rows)
            cp[m++] = mf_step_dcopy_cols(sh->lbuf, NULL, sh->dd_lbuf, 0, V, r0, r1, 0, nh);
        if (nh && !out) cp[m++] = mf_step_dcopy_cols(sh->hn, NULL, sh->dd_hn, 0, (int64_t)H, 0, (int64_t)H, 0, nh);
        break;
    case MF_SG_D_MARKOV: {   /* a draft round's units, a row each */
        size_t U = (size_t)sh->sg->n_units;
        int64_t R = c->dspark_markov_rank;
        mf_step_dense_rows(a, V, &r0, &r1);
        if (out && r0 < r1) cp[m++] = mf_step_dcopy_cols(sh->dmk, NULL, sh->dd_mk_out, 0, V, r0, r1, 0, U);
        if (!out) {   /* the card's own host rows, filled here */
            float *rows = mf_step_draft_mk_rows(sh, a->t->cand, a->t->card);
            cp[m++] = mf_step_dcopy_cols(rows, NULL, sh->dd_mk_in, 0, R, 0, R, 0, U);
        }
        break;
    }
    case MF_SG_D_ENGRAM: {   /* the micro-batch's items: the host's rows of the layer's Engram slot */
        size_t s0 = mf_step_eg_row(sh, a->t->layer, 0), le = (size_t)sh->eg_emb_ld;
        mf_step_dense_rows(a, (c->hc_mult + 1) * H, &r0, &r1);
        if (out && r0 < r1)
            cp[m++] = mf_step_dcopy_cols(sh->eg_kv + s0 * sh->eg_kv_ld, NULL, sh->dd_eg_kv, 0, sh->eg_kv_ld, r0, r1, i0, n);
        if (!out) cp[m++] = mf_step_dcopy_cols(sh->eg_emb + s0 * le, NULL, sh->dd_eg_emb, 0, (int64_t)le, 0, (int64_t)le, i0, n);
        break;
    }
    }
    return m;
}

static int mf_task_dense_in(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    if (a->t->dense == MF_SG_D_HEADS) return mf_step_heads_copy(a, ctx->queue, 0);
    if (a->t->dense == MF_SG_D_SCORES) return mf_step_scores_copy(a, ctx->queue, 0);
    mf_step_dcopy cp[MF_LY_A_MAX_LIN];
    int m = mf_step_dense_copies(a, 0, cp), rc = 0;
    if (!m) return MF_TASK_NO_WORK;
    for (int k = 0; k < m && !rc; k++) rc = mf_step_dcopy_run(ctx->queue, a->sh->ddense[a->t->card], &cp[k], 0);
    return rc;
}

static int mf_task_dense_out(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    if (a->t->dense == MF_SG_D_HEADS) return mf_step_heads_copy(a, ctx->queue, 1);
    if (a->t->dense == MF_SG_D_SCORES) return mf_step_scores_copy(a, ctx->queue, 1);
    /* qb's queries stay on the card for its heads (mf_stepgraph.heads_qlocal; this copy after the
     * gather): out only for the host's fallback heads (hk_host) */
    if (a->t->dense == MF_SG_D_ATTN_QB && a->t->layer < a->sh->eng->c->n_layers && a->sh->sg->heads_qlocal[a->t->layer] &&
        !a->sh->hk_host)
        return MF_TASK_NO_WORK;
    mf_step_dcopy cp[MF_LY_A_MAX_LIN];
    int m = mf_step_dense_copies(a, 1, cp), rc = 0;
    if (!m) return MF_TASK_NO_WORK;
    for (int k = 0; k < m && !rc; k++) rc = mf_step_dcopy_run(ctx->queue, a->sh->ddense[a->t->card], &cp[k], 1);
    return rc;
}

/* The row of layer L's dense weights in a card's table: the backbone's layers, the head (L -1) at
 * n_layers, the draft's stages after it. */
static int mf_step_dense_row(const mf_config *c, int L)
{
    return L < 0 ? c->n_layers : L < c->n_layers ? L : L + 1;
}

/* Dense card k's copy of weight w of layer L (-1: the head), NULL when it holds none. */
static const mf_step_dmat *mf_step_dense_view(const mf_step *eng, int k, int L, const mf_weight *w)
{
    const mf_step_dmat *row = eng->dmat[k] + (size_t)mf_step_dense_row(eng->c, L) * MF_STEP_DW_MAX;
    for (int i = 0; i < MF_STEP_DW_MAX; i++)
        if (row[i].w == w) return &row[i];
    return NULL;
}

/* Rows [r0, r1) of weight w of layer L as a device matrix of card k (its copy must hold them,
 * FP8 from a row of a 32-row tile of the copy). */
static int mf_step_dense_mat(const mf_step *eng, int k, int L, const mf_weight *w, int64_t r0, int64_t r1,
                             mf_kern_mat *out)
{
    const mf_step_dmat *v = mf_step_dense_view(eng, k, L, w);
    const char *name = w->name ? w->name : "a dense weight";
    if (!v || r0 < v->r0 || r1 > v->r1 || (w->kind == MF_W_FP8 && (r0 - v->r0) % 32))
        return mf_error(-EINVAL, "step: rows [%lld, %lld) of %s: dense card %d holds %s", (long long)r0, (long long)r1,
                        name, k, v ? "other rows (FP8 slices start at a 32-row tile)" : "no copy of it");
    *out = v->m;
    int64_t d = r0 - v->r0;
    out->n_out = (int)(r1 - r0);
    if (w->kind == MF_W_FP8) {
        out->w = (const uint8_t *)v->m.w + d * w->cols;
        out->scale = v->m.scale + d / 32 * ((w->cols + 31) / 32);
    } else {
        out->w = (const uint16_t *)v->m.w + d * w->cols;
    }
    return 0;
}

/* ---- the cuBLASLt path of the dense linears ------------------------------------------------ */

/* Where card k's 16-bit copy of v (rows [v->r0, v->r1), layer L) lies in shape sh's scratch: the
 * layer's parity's region of its sublayer (graphs/step/stepgraph.h mf_sg_card_bufs.lt_w16). */
static int mf_step_lt_w16(const mf_step_shape *sh, int k, int L, const mf_step_dmat *v, mf_dev_w16 *o)
{
    const mf_sg_card_bufs *cb = &sh->cb;
    size_t bytes = (size_t)(v->r1 - v->r0) * (size_t)v->w->cols * 2, region = sh->sg->lt_w16[v->dense];
    if (v->w16_off + bytes > region)
        return mf_error(-EINVAL, "step: %s's 16-bit copy (%zu bytes at %zu) outside its scratch of %zu bytes "
                        "(internal)", v->w->name ? v->w->name : "a dense weight", bytes, v->w16_off, region);
    *o = (mf_dev_w16){.w = sh->ddense[k] + cb->lt_w16 + (size_t)(L & 1) * cb->lt_w16_par + cb->lt_w16_d[v->dense] +
                           v->w16_off,
                      .type = mf_dev_card_f16(sh->eng->dev, sh->eng->dense_card[k]), .shift = v->w16_shift,
                      .n_out = (int)(v->r1 - v->r0), .n_in = (int)v->w->cols};
    return 0;
}

mf_dev_lt_buf mf_step_lt_buf(const mf_step_shape *sh, int k, int dense)
{
    const mf_sg_card_bufs *cb = &sh->cb;
    uint8_t *db = dense ? sh->ddense[k] : sh->dbuf[k];
    return (mf_dev_lt_buf){.x16 = db + (dense ? cb->lt_x16 : cb->lt_ex16),
                           .x16_bytes = dense ? cb->lt_x16_bytes : cb->lt_ex16_bytes,
                           .ws = db + (dense ? cb->lt_ws : cb->lt_ews), .ws_bytes = cb->lt_ws_bytes};
}

/* Linear l (rows [r0, r1) of w, its row0 r0) of task a on the cuBLASLt path where its record says
 * so and the linear can (kernel sums, its rows planned: mf_step_dmat.w16_ok): its rows of the 16-bit
 * copy the layer's MF_SG_DENSE_DEQ made, a grouped slice's x from the first group its rows read.
 * Else l as it is (the CUDA cores). */
static int mf_step_dense_lt(const mf_step_targ *a, const mf_weight *w, int64_t r0, int64_t r1, mf_dev_lin *l)
{
    mf_step_shape *sh = a->sh;
    const mf_step_dmat *v = mf_step_dense_view(sh->eng, a->t->card, a->t->layer, w);
    if (a->t->lin_path != MF_DEV_LIN_CUBLASLT || l->sums != MF_DEV_SUMS_KERN || !v || !v->w16_ok) return 0;
    int rc = mf_step_lt_w16(sh, a->t->card, a->t->layer, v, &l->w16);
    if (rc) return rc;
    l->w16.w = (uint16_t *)l->w16.w + (size_t)(r0 - v->r0) * (size_t)w->cols;
    l->w16.n_out = (int)(r1 - r0);
    if (l->group_rows) {   /* the cast reads only the groups from the first its rows touch */
        int64_t g0 = r0 / l->group_rows;
        l->x += g0 * w->cols;
        l->row0 = r0 - g0 * l->group_rows;
    }
    l->lt = mf_step_lt_buf(sh, a->t->card, 1);
    l->path = MF_DEV_LIN_CUBLASLT;
    atomic_fetch_add_explicit(&sh->eng->lt_linears, 1, memory_order_relaxed);
    return 0;
}

/* Rows [r0, r1) of y = w x on stream st (the rows task a owns of w: mf_step_dense_rows): x rows
 * ld_x apart, y (its row r0 at y + r0) ld_y apart; grouped (wo_a) with reference sums, else the
 * kernels' sums (on the path the record says: mf_step_dense_lt); bf: y rounded to bf16. */
static int mf_step_dense_lin(const mf_step_targ *a, mf_dev_stream *st, const mf_weight *w, int64_t r0, int64_t r1,
                             int groups, int ref, int bf, const float *x, int64_t ld_x, int n_tok, float *y,
                             int64_t ld_y)
{
    if (r0 >= r1) return 0;
    mf_dev_lin l = {.row0 = r0, .group_rows = groups ? (int)(w->rows / groups) : 0,
                    .sums = ref ? MF_DEV_SUMS_REF : MF_DEV_SUMS_KERN, .x = x, .ld_x = ld_x, .n_tok = n_tok,
                    .y = y + r0, .ld_y = ld_y};
    int rc = mf_step_dense_mat(a->sh->eng, a->t->card, a->t->layer, w, r0, r1, &l.w);
    if (!rc) rc = mf_step_dense_lt(a, w, r0, r1, &l);
    if (!rc) rc = mf_dev_linear(st, &l);
    if (!rc && bf) rc = mf_dev_round_bf16(st, y + r0, n_tok, ld_y, (int)(r1 - r0));
    return rc ? mf_error_wrap(rc, "%s", w->name ? w->name : "a dense linear") : 0;
}

/* The shared expert on stream st: phase 1 over rows of its hidden size (fused as mf_kern_ffn_up,
 * or with exact the two linears and the reference's gating), phase 2 over rows of the model size,
 * rounded to bf16: the launches of what mf_step_ffn_up and mf_step_ffn_down compute. */
static int mf_step_dense_shared(const mf_step_targ *a, mf_dev_stream *st, const mf_model_layer *y)
{
    mf_step_shape *sh = a->sh;
    mf_step *eng = sh->eng;
    int n = a->t->i1 - a->t->i0, k = a->t->card, L = a->t->layer;
    int64_t H = eng->c->hidden_size, I = y->sh_w1.rows, r0, r1, i0 = a->t->i0;   /* the micro-batch's items */
    float lim = (float)eng->c->swiglu_limit;
    uint8_t *db = sh->ddense[k];
    float *x = (float *)(db + sh->dd_xin) + i0 * H, *h = (float *)(db + sh->dd_hs) + i0 * I;
    int rc = 0;
    mf_step_dense_rows(a, I, &r0, &r1);
    if (r0 < r1 && !eng->o.exact && lim > 0) {
        mf_dev_up u = {.x = x, .ld_x = H, .n_tok = n, .limit = lim, .h = h + r0, .ld_h = I};
        rc = mf_step_dense_mat(eng, k, L, &y->sh_w1, r0, r1, &u.w1);
        if (!rc) rc = mf_step_dense_mat(eng, k, L, &y->sh_w3, r0, r1, &u.w3);
        if (!rc) rc = mf_dev_ffn_up(st, &u);
        if (rc) return mf_error_wrap(rc, "the shared expert's w1 and w3");
    } else if (r0 < r1) {
        if (!eng->o.exact)
            return mf_error(-ENOTSUP, "step: the shared expert on a card without a swiglu limit needs exact");
        float *g = (float *)(db + sh->dd_gs) + i0 * I, *u = (float *)(db + sh->dd_us) + i0 * I;
        rc = mf_step_dense_lin(a, st, &y->sh_w1, r0, r1, 0, 0, 0, x, H, n, g, I);
        if (!rc) rc = mf_step_dense_lin(a, st, &y->sh_w3, r0, r1, 0, 0, 0, x, H, n, u, I);
        if (!rc) rc = mf_dev_swiglu_bf16(st, g + r0, u + r0, n, I, (int)(r1 - r0), lim, h + r0);
        if (rc) return rc;
    }
    mf_step_dense_rows(a, H, &r0, &r1);
    return mf_step_dense_lin(a, st, &y->sh_w2, r0, r1, 0, 0, 1, h, I, n, (float *)(db + sh->dd_ys) + i0 * H, H);
}

/* The dense work of task a as launches on its card's compute stream st, on the card's copies of
 * the activations and its resident weights: per linear of the sublayer the rows the task owns
 * (mf_step_dense_run_rows: an attention stage's linears one after another) over the task's items
 * (its micro-batch's), with the sums and roundings the host placement's code uses (the grouped
 * wo_a where it is not on the kernels, and with exact the router gate: reference sums; wo_a, wo_b
 * and the shared expert's output: bf16), so
 * emulated cards give the host placement's bits. */
static int mf_step_dense_launch(const mf_step_targ *a, mf_dev_stream *st)
{
    mf_step_shape *sh = a->sh;
    mf_step *eng = sh->eng;
    const mf_config *c = eng->c;
    int k = a->t->card, L = a->t->layer, n = a->t->i1 - a->t->i0, d = a->t->dense;
    int64_t i0 = a->t->i0;   /* the micro-batch's items [i0, i0 + n) (the head: all, from 0) */
    uint8_t *db = sh->ddense[k];
    int64_t H = c->hidden_size;
#define DD(off) ((float *)(db + (off)))
    if (d <= MF_SG_D_ATTN_OB) {
        static const int stage_of[4] = {MF_LY_A_STAGE_IN, MF_LY_A_STAGE_QB, MF_LY_A_STAGE_OA, MF_LY_A_STAGE_OB};
        mf_ly_attn_lin lin[MF_LY_A_MAX_LIN];
        int nl = mf_ly_attn_linears(eng->ly, L, stage_of[d], lin);
        int64_t total = 0, base = 0, r0, r1;
        for (int j = 0; j < nl; j++) total += lin[j].w->rows;
        mf_step_dense_run_rows(a, total, &r0, &r1);
        for (int j = 0; j < nl; j++) {   /* each linear's share of the task's rows */
            const mf_ly_attn_lin *l = &lin[j];
            int64_t lo = r0 - base > 0 ? r0 - base : 0, hi = r1 - base < l->w->rows ? r1 - base : l->w->rows;
            base += l->w->rows;
            /* the host's sums (mf_task_attn_rows): the grouped wo_a on the kernels as mf_fa_grouped_rows
             * where it can, else (and with exact) the reference's, so emulated cards give the host's bits */
            int ref = l->groups > 0 && (eng->o.exact || !mf_fa_grouped_kern(l));
            int rc = mf_step_dense_lin(a, st, l->w, lo, hi, l->groups, ref, l->bf,
                                       DD(sh->dd_ab[l->x]) + i0 * sh->ab_ld[l->x], sh->ab_ld[l->x], n,
                                       DD(sh->dd_ab[l->y]) + i0 * sh->ab_ld[l->y], sh->ab_ld[l->y]);
            if (rc) return rc;
        }
        return 0;
    }
    const mf_model_layer *y = L >= 0 ? mf_model_layer_at(eng->ly->m, L) : NULL;
    switch (d) {
    case MF_SG_D_GATE: {
        int64_t r0, r1;
        mf_step_dense_run_rows(a, y->gate.rows, &r0, &r1);
        /* the host's sums (mf_task_gate_rows): the kernels' where mf_fa_gate_rows takes them */
        int ref = eng->o.exact || !mf_ly_linear_kern(&y->gate);
        return mf_step_dense_lin(a, st, &y->gate, r0, r1, 0, ref, 0, DD(sh->dd_xin) + i0 * H, H, n,
                                 DD(sh->dd_logits) + i0 * y->gate.rows, y->gate.rows);
    }
    case MF_SG_D_SHARED:
        return mf_step_dense_shared(a, st, y);
    case MF_SG_D_HEAD: {
        int64_t r0, r1, V = c->vocab_size;
        mf_step_dense_run_rows(a, V, &r0, &r1);
        if (sh->n_head <= sh->head_rows)   /* the copy-out task copies them */
            return mf_step_dense_lin(a, st, mf_model_head(eng->ly->m), r0, r1, 0, 0, 0, DD(sh->dd_hn), H, sh->n_head,
                                     DD(sh->dd_lbuf), V);
        /* passes of head_rows items over the card's buffer, each copied out on this stream before
         * the next overwrites it */
        int rc = 0;
        for (int j0 = 0; j0 < sh->n_head && !rc; j0 += sh->head_rows) {
            int nj = sh->n_head - j0 < sh->head_rows ? sh->n_head - j0 : sh->head_rows;
            rc = mf_step_dense_lin(a, st, mf_model_head(eng->ly->m), r0, r1, 0, 0, 0, DD(sh->dd_hn) + (int64_t)j0 * H, H,
                                   nj, DD(sh->dd_lbuf), V);
            if (!rc && r0 < r1) {
                mf_step_dcopy cp = mf_step_dcopy_cols(sh->lbuf + (size_t)j0 * V, NULL, sh->dd_lbuf, 0, V, r0, r1, 0, (size_t)nj);
                rc = mf_step_dcopy_run(st, db, &cp, 1);
            }
        }
        return rc;
    }
    case MF_SG_D_MARKOV: {   /* every unit's row; the host's sums (mf_task_draft_markov: mf_ly_linear_part), bf16 */
        int64_t r0, r1, R = c->dspark_markov_rank;
        mf_step_dense_run_rows(a, y->mk_head.rows, &r0, &r1);
        int ref = eng->o.exact || !mf_ly_linear_kern(&y->mk_head);
        return mf_step_dense_lin(a, st, &y->mk_head, r0, r1, 0, ref, 1, DD(sh->dd_mk_in), R, sh->sg->n_units,
                                 DD(sh->dd_mk_out), c->vocab_size);
    }
    case MF_SG_D_ENGRAM: {
        int64_t r0, r1;
        mf_step_dense_run_rows(a, y->eg_wkv.rows, &r0, &r1);
        /* the host's sums (mf_task_engram_rows: mf_ly_linear_part on the kernels, exact or not) */
        int ref = !mf_ly_linear_kern(&y->eg_wkv);
        return mf_step_dense_lin(a, st, &y->eg_wkv, r0, r1, 0, ref, 0, DD(sh->dd_eg_emb) + i0 * sh->eg_emb_ld,
                                 sh->eg_emb_ld, n, DD(sh->dd_eg_kv) + i0 * sh->eg_kv_ld, sh->eg_kv_ld);
    }
    }
#undef DD
    return mf_error(-EINVAL, "step: dense sublayer %d (internal)", d);
}

/* Enqueues the dense work of a on its card's compute stream (the scheduler's completion after
 * it; an asynchronous failure of a launch fails the task through the status callback). */
static int mf_task_dense(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    if (a->t->dense == MF_SG_D_HEAD && !a->sh->n_head) return MF_TASK_NO_WORK;
    if (a->t->dense == MF_SG_D_HEADS) return a->sh->hk_host ? MF_TASK_NO_WORK : mf_step_heads_launch(a, ctx->queue);
    if (a->t->dense == MF_SG_D_SCORES) return mf_step_scores_launch(a, ctx->queue);
    return mf_step_dense_launch(a, ctx->queue);
}

/* The layer's FP8 weights of sublayer a->t->dense that card a->t->card holds and planned, dequantized
 * into the scratch of the layer's parity on the card's copy-in stream (after the works of two
 * layers before that read it: the builder's order, graphs/step/stepgraph_lt.c). */
static int mf_task_dense_deq(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    const mf_step *eng = a->sh->eng;
    int k = a->t->card, L = a->t->layer, n = 0, rc = 0;
    const mf_step_dmat *row = eng->dmat[k] + (size_t)L * MF_STEP_DW_MAX;
    for (int j = 0; j < MF_STEP_DW_MAX && !rc; j++) {
        const mf_step_dmat *v = &row[j];
        if (!v->w || v->dense != a->t->dense || !v->w16_ok) continue;
        mf_dev_w16 o;
        rc = mf_step_lt_w16(a->sh, k, L, v, &o);
        if (!rc) rc = mf_dev_dequant(ctx->queue, &v->m, &o);
        if (rc) rc = mf_error_wrap(rc, "step: dequantizing %s on dense card %d", v->w->name ? v->w->name : "a weight", k);
        n++;
    }
    return rc ? rc : n ? 0 : MF_TASK_NO_WORK;
}

/* ---- the dense cards' resident weights (at mf_step_new) ------------------------------------ */

/* Rows [*r0, *r1) of weight w (rows base.. of its sublayer d's total rows) that dense card k holds:
 * mf_sg_dense_rows' share of the card when d is split by rows (an attention stage's linears one
 * after another), every row on the layer-range card of a sublayer that is not, every row on every
 * card where mf_sg_dense_whole (the in stage split by rows or by items). 0: none. */
static int mf_step_dense_wrows(const mf_step *s, int k, int L, int d, const mf_weight *w, int64_t base,
                               int64_t total, int64_t *r0, int64_t *r1)
{
    /* the Markov rows' parts as the step graph's (mf_stepgraph.mk_parts: the same sizes and profile) */
    int parts = d == MF_SG_D_MARKOV ? mf_sg_markov_parts(s->c, s->o.profile, s->sz->mk_head_bytes, s->n_dense,
                                                         s->o.dense_split)
                                    : mf_sg_dense_parts(s->n_dense, s->o.dense_split, d);
    int64_t a = 0, b = total;
    if (mf_sg_dense_whole(s->c, s->n_dense, s->o.dense_split, s->in_whole, d, L)) b = total;   /* every row */
    else if (parts > 1) mf_sg_dense_rows(parts, k, total, &a, &b);
    else if (mf_sg_dense_card_in(s->c, s->n_dense, s->l0, s->l1, L) != k) b = 0;
    *r0 = a - base > 0 ? a - base : 0;
    *r1 = b - base < w->rows ? b - base : w->rows;
    return *r0 < *r1;
}

/* The dense weights of layer L (-1: the head) that dense card k holds rows of, with those rows and
 * their sublayers (MF_SG_D_*); returns their count. */
static int mf_step_dense_weights_of(const mf_step *s, int L, int k, const mf_weight **w, int64_t *r0, int64_t *r1,
                                    int8_t *dd)
{
    int n = 0, stage = s->o.draft && L >= s->c->n_layers;   /* a draft stage: the card of the last layer's rows */
    if (L < 0 ? s->l1 < s->c->n_layers : (L < s->l0 || L >= s->l1) && !stage) return 0;   /* a pipeline stage's only */
    if (L < 0) {
        w[0] = mf_model_head(s->ly->m);
        dd[0] = MF_SG_D_HEAD;
        return mf_step_dense_wrows(s, k, L, MF_SG_D_HEAD, w[0], 0, w[0]->rows, &r0[0], &r1[0]);
    }
    const mf_model_layer *y = mf_model_layer_at(s->ly->m, L);
    for (int st = 0; st < MF_LY_A_N_STAGES; st++) {   /* sublayer MF_SG_D_ATTN_IN + st */
        mf_ly_attn_lin lin[MF_LY_A_MAX_LIN];
        int nl = mf_ly_attn_linears(s->ly, L, st, lin);
        int64_t total = 0, base = 0;
        for (int j = 0; j < nl; j++) total += lin[j].w->rows;
        for (int j = 0; j < nl; base += lin[j++].w->rows)
            if (mf_step_dense_wrows(s, k, L, MF_SG_D_ATTN_IN + st, lin[j].w, base, total, &r0[n], &r1[n])) {
                dd[n] = (int8_t)(MF_SG_D_ATTN_IN + st);
                w[n++] = lin[j].w;
            }
    }
    const mf_weight *rest[4] = {&y->gate, &y->sh_w1, &y->sh_w3, &y->sh_w2};
    for (int j = 0; j < (s->c->n_shared_experts > 0 ? 4 : 1); j++)
        if (mf_step_dense_wrows(s, k, L, j ? MF_SG_D_SHARED : MF_SG_D_GATE, rest[j], 0, rest[j]->rows, &r0[n], &r1[n])) {
            dd[n] = j ? MF_SG_D_SHARED : MF_SG_D_GATE;
            w[n++] = rest[j];
        }
    if (mf_config_engram_slot(s->c, L) >= 0 &&
        mf_step_dense_wrows(s, k, L, MF_SG_D_ENGRAM, &y->eg_wkv, 0, y->eg_wkv.rows, &r0[n], &r1[n])) {
        dd[n] = MF_SG_D_ENGRAM;
        w[n++] = &y->eg_wkv;
    }
    if (stage && L == s->c->n_layers + s->c->n_mtp_layers - 1 &&   /* the Markov head (stepgraph_draft.c) */
        mf_step_dense_wrows(s, k, L, MF_SG_D_MARKOV, &y->mk_head, 0, y->mk_head.rows, &r0[n], &r1[n])) {
        dd[n] = MF_SG_D_MARKOV;
        w[n++] = &y->mk_head;
    }
    assert(n <= MF_STEP_DW_MAX);
    return n;
}

/* Rows [r0, r1) of weight w onto dense card k at offset *off of its weight memory (NULL: only
 * sized), the copies enqueued on st; fills *v. FP8 slices start at a 32-row tile (their scale
 * rows); each part 256-byte aligned. */
static int mf_step_dense_upload(mf_step *s, int k, mf_dev_stream *st, const mf_weight *w, int64_t r0, int64_t r1,
                                size_t *off, mf_step_dmat *v)
{
    const char *name = w->name ? w->name : "a dense weight";
    if (!w->data || w->cols % 32 || !(w->kind == MF_W_BF16 || (w->kind == MF_W_FP8 && w->block_rows == 32 &&
                                                                w->block_cols == 32)))
        return mf_error(-ENOTSUP, "step: %s cannot go on a card (%s): the dense card kernels take resident "
                        "FP8 with 32x32 tiles or BF16, columns a multiple of 32", name, !w->data ? "not resident"
                                                                                       : "format or shape");
    if (w->kind == MF_W_FP8 && r0 % 32)
        return mf_error(-EINVAL, "step: rows [%lld, %lld) of %s: FP8 slices start at a 32-row tile", (long long)r0,
                        (long long)r1, name);
    size_t sc_cols = (size_t)(w->cols + 31) / 32;
    size_t wb = (size_t)(r1 - r0) * w->cols * (w->kind == MF_W_FP8 ? 1 : 2);
    size_t sb = w->kind == MF_W_FP8 ? (size_t)((r1 + 31) / 32 - r0 / 32) * sc_cols : 0;
    size_t o_w = *off, o_s = o_w + (wb + 255) / 256 * 256;
    *off = o_s + (sb + 255) / 256 * 256;
    uint8_t *base = s->dwmem[k];
    *v = (mf_step_dmat){.w = w, .r0 = r0, .r1 = r1,
                        .m = {.fmt = w->kind == MF_W_FP8 ? MF_KERN_FP8 : MF_KERN_BF16, .n_out = (int)(r1 - r0),
                              .n_in = (int)w->cols}};
    if (!base) return 0;
    v->m.w = base + o_w;
    v->m.scale = sb ? base + o_s : NULL;
    int rc = mf_dev_copy_h2d(st, base + o_w, w->data + (size_t)r0 * w->cols * (w->kind == MF_W_FP8 ? 1 : 2), wb);
    if (!rc && sb) rc = mf_dev_copy_h2d(st, base + o_s, w->scale + (size_t)(r0 / 32) * sc_cols, sb);
    return rc ? mf_error_wrap(rc, "step: copying %s to dense card %d", name, k) : 0;
}

/* Each dense card's resident weights: the rows of each dense weight it computes
 * (mf_step_dense_weights_of: the layers mf_sg_dense_card gives it and the head on the last
 * layer's card; split by rows, its share of every layer's and the head's), sized first, then one
 * allocation and the copies on the card's copy-in stream, waited for. A card without room fails
 * with -ENOMEM naming the card and the bytes. */
static int mf_step_dense_weights(mf_step *s)
{
    const mf_config *c = s->c;
    int NL = c->n_layers, ND = s->o.draft ? c->n_mtp_layers : 0;   /* the draft's stages after the head */
    for (int k = 0; k < s->n_dense; k++) {
        int cd = s->dense_card[k];
        mf_dev_stream *st = mf_dev_stream_of(s->dev, cd, MF_DEV_STREAM_COPY_IN);
        s->dmat[k] = calloc((size_t)(NL + 1 + ND) * MF_STEP_DW_MAX, sizeof *s->dmat[k]);
        if (!s->dmat[k]) return mf_error(-ENOMEM, "step: out of memory");
        for (int pass = 0; pass < 2; pass++) {
            size_t off = 0;
            int first = -1, last = -1, head = 0;
            for (int L = -1; L < NL + ND; L++) {
                const mf_weight *w[MF_STEP_DW_MAX];
                int64_t r0[MF_STEP_DW_MAX], r1[MF_STEP_DW_MAX];
                int8_t dd[MF_STEP_DW_MAX];
                int nw = mf_step_dense_weights_of(s, L, k, w, r0, r1, dd);
                if (!nw) continue;
                head |= L < 0;
                if (L >= 0 && first < 0) first = L;
                if (L >= 0) last = L;
                mf_step_dmat *row = s->dmat[k] + (size_t)mf_step_dense_row(c, L) * MF_STEP_DW_MAX;
                for (int j = 0; j < nw; j++) {
                    int rc = mf_step_dense_upload(s, k, st, w[j], r0[j], r1[j], &off, &row[j]);
                    if (rc) return rc;
                    row[j].dense = dd[j];
                }
            }
            if (pass) break;
            s->dw_bytes[k] = off;
            if (!off) break;
            int rc = mf_dev_alloc(s->dev, cd, off, (void **)&s->dwmem[k]);
            if (rc)
                return mf_error_wrap(rc, "step: the dense weights of layers %d..%d%s (%llu bytes) do not fit on "
                                     "card %d (%s)", first, last, head ? " and the head" : "",
                                     (unsigned long long)off, cd, mf_dev_kind(s->dev));
        }
        int rc = mf_dev_stream_sync(st);
        if (rc) return mf_error_wrap(rc, "step: copying the dense weights to card %d", cd);
    }
    return 0;
}

void mf_step_dense_free(mf_step *s)
{
    for (int k = 0; k < s->n_dense; k++) {
        mf_dev_free(s->dev, s->dense_card[k], s->dwmem[k]);
        free(s->dmat[k]);
    }
    free(s->lt_xplan[0]);
    free(s->lt_xplan[1]);
}

/* Each dense card's 16-bit layout of the weights its cuBLASLt calls may read: per layer and
 * sublayer (mf_sg_lt_dense_ok) each FP8 slice the card holds at the next 256-aligned offset, with
 * the shift that makes it exact in the card's type (mf_dev_w16_plan on its host scales); a slice
 * no shift makes exact keeps the CUDA cores (w16_ok 0). The step graph sizes the scratch by the same
 * slices (graphs/step/stepgraph_lt.c: at most the card's rows of the sublayer's FP8 linears). */
static int mf_step_lt_layout(mf_step *s)
{
    int NL = s->c->n_layers;
    for (int k = 0; k < s->n_dense; k++) {
        mf_dev_f16 type = mf_dev_card_f16(s->dev, s->dense_card[k]);
        for (int L = 0; L < NL; L++) {
            size_t off[MF_SG_N_DENSE] = {0};
            mf_step_dmat *row = s->dmat[k] + (size_t)L * MF_STEP_DW_MAX;
            for (int j = 0; j < MF_STEP_DW_MAX; j++) {
                mf_step_dmat *v = &row[j];
                if (!v->w || v->m.fmt != MF_KERN_FP8 || !mf_sg_lt_dense_ok(v->dense, s->o.exact)) continue;
                const mf_weight *w = v->w;
                size_t sc_cols = (size_t)(w->cols + 31) / 32;
                mf_kern_mat hm = {.fmt = MF_KERN_FP8, .w = w->data + (size_t)v->r0 * w->cols,
                                  .scale = w->scale + (size_t)(v->r0 / 32) * sc_cols, .n_out = (int)(v->r1 - v->r0),
                                  .n_in = (int)w->cols};
                const mf_kern_mat *one = &hm;
                int shift = 0, rc = mf_dev_w16_plan(&one, 1, type, &shift);
                if (rc == -ERANGE) continue;   /* not exact in this type: the CUDA cores */
                if (rc) return mf_error_wrap(rc, "step: planning %s's 16-bit copy", w->name ? w->name : "a weight");
                v->w16_ok = 1;
                v->w16_shift = (int16_t)shift;
                v->w16_off = off[v->dense];
                off[v->dense] += ((size_t)(v->r1 - v->r0) * (size_t)w->cols * 2 + 255) / 256 * 256;
            }
        }
    }
    return 0;
}

int mf_step_lt_setup(mf_step *s)
{
    s->lt_mode = s->o.lt;
    for (int k = 0; k < s->n_dense; k++)   /* a card in use without tensor cores: none of them */
        if (mf_dev_card_f16(s->dev, s->dense_card[k]) == MF_DEV_F16_NONE) s->lt_mode = MF_SG_LT_OFF;
    for (int c = 0; c < s->n_cards; c++)
        if (mf_dev_card_f16(s->dev, c) == MF_DEV_F16_NONE) s->lt_mode = MF_SG_LT_OFF;
    if (s->lt_mode == MF_SG_LT_OFF || (!s->n_dense && !s->n_cards)) return 0;
    if (s->n_cards && s->lt_mode != MF_SG_LT_DENSE) {
        size_t n = (size_t)(s->c->n_layers + (s->o.draft ? s->c->n_mtp_layers : 0)) * (size_t)s->c->n_routed_experts;
        s->lt_xplan[0] = calloc(n, sizeof *s->lt_xplan[0]);
        s->lt_xplan[1] = calloc(n, sizeof *s->lt_xplan[1]);
        if (!s->lt_xplan[0] || !s->lt_xplan[1]) return mf_error(-ENOMEM, "step: out of memory");
    }
    return mf_step_lt_layout(s);
}

uint64_t mf_step_dense_bytes(const mf_step *s, int k, int *card)
{
    if (k < 0 || k >= s->n_dense) return 0;
    if (card) *card = s->dense_card[k];
    return s->dw_bytes[k];
}

/* Dense work on s->o.dev's cards (emulated or CUDA, through the device API): the cards that passed
 * the self-check, whether they hold all the in stage's rows (s->in_whole, for the largest prefill
 * chunk), each with its resident weights (mf_step_dense_weights). */
int mf_step_dense_setup(mf_step *s)
{
    if (s->o.dense != MF_STEP_DENSE_CARDS) return mf_error(-EINVAL, "step: unknown dense placement %d", s->o.dense);
    if (!s->o.dev) return mf_error(-EINVAL, "step: dense work on cards needs a device (--devices)");
    s->dev = s->o.dev;
    for (int cd = 0; cd < mf_dev_n_cards(s->dev); cd++)
        if (!(s->refused_mask & (1u << cd))) s->dense_card[s->n_dense++] = cd;
    int chunk = s->o.prefill_chunk > 0 ? s->o.prefill_chunk : MF_STEP_PREFILL_CHUNK;   /* the largest prefill chunk */
    if (chunk > s->max_chunk) chunk = s->max_chunk;
    s->in_whole = mf_sg_in_whole(&(mf_sg_opts){.c = s->c, .sz = s->sz, .n_dense_cards = s->n_dense,
                                               .dense_split = s->o.dense_split, .in_split = s->o.in_split,
                                               .dense_block = s->o.dense_block, .profile = s->o.profile},
                                 chunk);
    return mf_step_dense_weights(s);
}

/* This file's ops (step_impl.h; step_shape.c binds them). */
const mf_task_fn mf_step_dense_fn_of[MF_SG_N_OPS] = {
    [MF_SG_DENSE_IN] = mf_task_dense_in, [MF_SG_DENSE] = mf_task_dense, [MF_SG_DENSE_OUT] = mf_task_dense_out,
    [MF_SG_DENSE_DEQ] = mf_task_dense_deq,
};
