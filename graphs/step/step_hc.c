/* The scheduled engine's tasks on the items' residual streams around each sublayer (layer_hc.c's
 * hyper-connections in parts): the collapse before the attention, the norms (attn_norm, ffn_norm,
 * the final norm), the mixes in row parts; and the head's row parts after the final norm. The
 * expands back into the streams end the sublayers' own tasks (step_attn.c's post, step_moe.c's
 * combine). */
#include <errno.h>

#include "graphs/step/fast_attn.h"
#include "graphs/step/step_impl.h"

/* The hyper-connection tasks: one item (a->t->i0) each, a part of its columns or its mix rows
 * [r0, r1) (graphs/step/stepgraph.h); the bits of the whole for any split (layer_hc.c's parts). */

/* Columns of the item's streams collapsed with the carried pre into its row of hcol (the next
 * sublayer's input before its norm; at layer -1 the final norm's). */
static int mf_task_attn_pre(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    int i = a->t->i0;
    (sh->eng->o.exact ? mf_ly_hc_collapse_cols : mf_fa_hc_collapse_cols)(
        cx, sh->items[i].x, sh->items[i].pre, sh->hcol + (size_t)i * cx->ly->c->hidden_size, a->t->r0, a->t->r1);
    return 0;
}

/* Columns of a norm of the item's collapse: attn_norm (the attention input), ffn_norm (the MoE
 * input) or the final norm (the head's input; items without logits have none). */
static int mf_step_norm_cols(mf_step_targ *a, mf_task_ctx *ctx, int op)
{
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_config *c = cx->ly->c;
    int64_t H = c->hidden_size;
    int i = a->t->i0;
    const mf_weight *w;
    float *out;
    if (op == MF_SG_NORM) {
        if (sh->head_row[i] < 0) return 0;
        w = sh->sg->draft ? &mf_model_layer_at(cx->ly->m, c->n_layers + c->n_mtp_layers - 1)->out_norm   /* the draft's */
                          : mf_model_norm(cx->ly->m);
        out = sh->hn + (size_t)sh->head_row[i] * H;
    } else {
        const mf_model_layer *y = mf_model_layer_at(cx->ly->m, a->t->layer);
        w = op == MF_SG_ATTN_NORM ? &y->attn_norm : &y->ffn_norm;
        out = op == MF_SG_ATTN_NORM ? sh->ab[MF_LY_A_IN] + (size_t)i * sh->ab_ld[MF_LY_A_IN] : sh->xin + (size_t)i * H;
    }
    (sh->eng->o.exact ? mf_ly_rmsnorm_cols : mf_fa_rmsnorm_cols)(sh->hcol + (size_t)i * H, H, w, c->rms_norm_eps, out,
                                                                 a->t->r0, a->t->r1);
    if (op == MF_SG_ATTN_NORM) mf_step_ab_cast(sh, MF_LY_A_IN, 1, i, a->t->r0, a->t->r1);   /* for the cards' copies */
    if (op == MF_SG_FFN_NORM) mf_step_bf16_cols(1, sh->xin, sh->xin16, H, i, a->t->r0, a->t->r1);
    return 0;
}

static int mf_task_attn_norm(void *arg, mf_task_ctx *ctx) { return mf_step_norm_cols(arg, ctx, MF_SG_ATTN_NORM); }
static int mf_task_ffn_norm(void *arg, mf_task_ctx *ctx) { return mf_step_norm_cols(arg, ctx, MF_SG_FFN_NORM); }
static int mf_task_norm(void *arg, mf_task_ctx *ctx) { return mf_step_norm_cols(arg, ctx, MF_SG_NORM); }

/* Rows of the attention (amix) or ffn (fmix) mixes of the streams of the record's items (its item
 * group: not run per item by mf_task_items, so the fast path reads each row once per
 * mf_fa_mix_items items, mf_fa_hc_mixes_rows_items on up to MF_FA_MIX_ITEMS at a time; the bits of
 * one item's task per item). */
static int mf_step_mix_rows(mf_step_targ *a, mf_task_ctx *ctx, int ffn)
{
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_model_layer *y = mf_model_layer_at(cx->ly->m, a->t->layer);
    const mf_weight *fn = ffn ? &y->hc_ffn_fn : &y->hc_attn_fn;
    int k0 = (int)a->t->r0, k1 = (int)a->t->r1;
    for (int i0 = a->t->i0; i0 < a->t->i1; i0 += MF_FA_MIX_ITEMS) {
        int G = a->t->i1 - i0 < MF_FA_MIX_ITEMS ? a->t->i1 - i0 : MF_FA_MIX_ITEMS;
        const float *x[MF_FA_MIX_ITEMS];
        float *mix[MF_FA_MIX_ITEMS];
        for (int g = 0; g < G; g++) {
            x[g] = sh->items[i0 + g].x;
            mix[g] = (ffn ? sh->fmix : sh->amix) + (size_t)(i0 + g) * MF_STEP_N_MIX;
            if (sh->eng->o.exact) mf_ly_hc_mixes_rows(cx, x[g], fn, mix[g], k0, k1);
        }
        if (!sh->eng->o.exact) mf_fa_hc_mixes_rows_items(cx, x, G, fn, mix, k0, k1);
    }
    return 0;
}

static int mf_task_attn_mix(void *arg, mf_task_ctx *ctx) { return mf_step_mix_rows(arg, ctx, 0); }
static int mf_task_ffn_mix(void *arg, mf_task_ctx *ctx) { return mf_step_mix_rows(arg, ctx, 1); }

static int mf_task_head(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    if (!sh->n_head) return 0;
    const mf_config *c = sh->eng->c;
    const mf_weight *w = mf_model_head(sh->eng->ly->m);
    int r0 = (int)a->t->r0, r1 = (int)a->t->r1;   /* the record's rows (mf_sg_expert_rows) */
    if (r0 >= r1) return 0;
    mf_step_count_socket(sh->eng, ctx, w, r0, r1, 1);
    return mf_kern_bf16_matmul((const uint16_t *)w->data, (int)c->vocab_size, (int)c->hidden_size,
                               sh->hn, sh->n_head, (int)c->hidden_size, sh->lbuf, (int)c->vocab_size,
                               r0, r1);
}

/* This file's ops (step_impl.h; step_shape.c binds them). */
const mf_task_fn mf_step_hc_fn_of[MF_SG_N_OPS] = {
    [MF_SG_ATTN_PRE] = mf_task_attn_pre,   [MF_SG_ATTN_NORM] = mf_task_attn_norm, [MF_SG_FFN_NORM] = mf_task_ffn_norm,
    [MF_SG_NORM] = mf_task_norm,           [MF_SG_ATTN_MIX] = mf_task_attn_mix,   [MF_SG_FFN_MIX] = mf_task_ffn_mix,
    [MF_SG_HEAD] = mf_task_head,
};
