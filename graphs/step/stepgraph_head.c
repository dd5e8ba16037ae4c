/* After the last layer (mf_sg_head): per item group the final collapse -> norm column parts -> head
 * join -> head row parts on the host, or the head as a dense chain on the last layer's card
 * (stepgraph_dense.c). The collapse -> norm parts and the norm's price are shared with the
 * attention's input and its ffn_norm (stepgraph_attn.c). */
#include "graphs/step/stepgraph_impl.h"

/* A norm part of `cols` columns: the sum of squares over all H columns (the scalar double loop),
 * the columns as mf_ly_rmsnorm_cols (exact) or mf_fa_rmsnorm_cols's vector loop. */
void mf_sg_norm_price(const mf_sg_builder *b, mf_sg_task *t, double H, double cols)
{
    if (b->o->exact) {
        t->w.ref_flops = t->n_tok * (H + cols * (2.0 + 2.0 * SG_W_ROUND));
    } else {
        t->w.ref_flops = t->n_tok * H;
        t->w.vec_flops = t->n_tok * cols * SG_W_NORM_VEC;
    }
}

/* Item group i's collapse (MF_SG_ATTN_PRE, after after[0..n_after)) -> norm `op` column parts, into nrm[]:
 * layer L's attention input (phase attn) or, at L = -1, the final norm (phase head). */
void mf_sg_collapse_norm(mf_sg_builder *b, int L, int i, int op, int phase, const mf_task_id *after, int n_after,
                         mf_task_id *nrm)
{
    const mf_config *c = b->o->c;
    int pc = b->sg->p_hc;
    double H = (double)c->hidden_size, hc = c->hc_mult;
    mf_task_id col[MF_SG_MAX_PARTS];
    const char *what = L < 0 ? "final" : "attn";
    for (int p = 0; p < pc; p++) {
        SG_NAME(b, L < 0 ? "%s collapse item %d %d" : "%s L%d collapse item %d %d", what, L < 0 ? i : L,
                L < 0 ? p : i, p);
        mf_sg_task t = mf_sg_part(b->sg, L, i, (int64_t)H, pc, p, 0);
        double cols = (double)(t.r1 - t.r0);
        if (b->o->exact) t.w.ref_flops = t.n_tok * cols * (hc + SG_W_ROUND);   /* mf_ly_hc_collapse_cols */
        else t.w.vec_flops = t.n_tok * cols * hc * SG_W_COLLAPSE_VEC;              /* mf_fa_hc_collapse_cols */
        col[p] = mf_sg_add(b, 0, MF_SG_ATTN_PRE, phase, MF_SG_K_OTHER, t);
        for (int a = 0; a < n_after; a++) mf_sg_dep(b, after[a], col[p]);
    }
    for (int p = 0; p < pc; p++) {
        SG_NAME(b, L < 0 ? "%s norm item %d %d" : "%s L%d norm item %d %d", what, L < 0 ? i : L, L < 0 ? p : i, p);
        mf_sg_task t = mf_sg_part(b->sg, L, i, (int64_t)H, pc, p, 0);
        double cols = (double)(t.r1 - t.r0);
        mf_sg_norm_price(b, &t, H, cols);
        if (op == MF_SG_ATTN_NORM && b->sg->n_dense_cards && mf_sg_attn_buf_bf16(MF_LY_A_IN))
            t.w.vec_flops += t.n_tok * cols * SG_W_CAST_VEC;   /* its columns packed for the in stage's copy */
        nrm[p] = mf_sg_add(b, 0, op, phase, MF_SG_K_OTHER, t);
        for (int q = 0; q < pc; q++) mf_sg_dep(b, col[q], nrm[p]);
    }
}

/* After the last layer: per item the final collapse -> norm column parts -> head join -> head
 * parts. */
void mf_sg_head(mf_sg_builder *b, const mf_task_id *unit)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    double H = (double)c->hidden_size, V = (double)c->vocab_size;
    SG_NAME(b, "head join");
    mf_task_id hj = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_HEAD, MF_SG_K_OTHER, mf_sg_rec(-1));
    for (int i = 0; i < sg->n_groups; i++) {
        mf_task_id nrm[MF_SG_MAX_PARTS], after[MF_SG_MAX_PARTS];
        int na = mf_sg_group_after(b, unit, i, after);
        mf_sg_collapse_norm(b, -1, i, MF_SG_NORM, MF_SG_PH_HEAD, after, na, nrm);
        for (int p = 0; p < sg->p_hc; p++) mf_sg_dep(b, nrm[p], hj);
    }
    if (sg->draft) {   /* the draft's chain waits for every part (on cards: every chain's copy out) */
        SG_NAME(b, "head done");
        b->head_done = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_HEAD, MF_SG_K_OTHER, mf_sg_rec(-1));
    }
    if (sg->n_dense_cards) {   /* on the last layer's card: the normed rows in, the logits out */
        mf_sg_task t = mf_sg_rec(-1);
        t.w.w_bytes[MF_KF_BF16] = b->o->sz->head_bytes;
        t.w.macs[MF_KF_BF16] = V * H;
        t.w.calls[MF_KF_BF16] = 1;
        mf_task_id ch = mf_sg_dense_chain(b, -1, MF_SG_D_HEAD, t, MF_SG_PH_HEAD, 4.0 * H, 4.0 * V, -1, 0);
        mf_sg_dep(b, hj, ch);
        if (sg->draft) mf_sg_dep(b, ch, b->head_done);
        return;
    }
    for (int p = 0; p < sg->p_head; p++) {
        SG_NAME(b, "head %d", p);
        mf_sg_task t = mf_sg_rec(-1);
        t.part = p;
        t.n_tok = sg->n;
        int ln = mf_sg_rows_lane(b, (int64_t)V, sg->p_head, p, &t.r0, &t.r1);
        t.w.w_bytes[MF_KF_BF16] = b->o->sz->head_bytes / sg->p_head;
        t.w.macs[MF_KF_BF16] = V * H / sg->p_head;
        t.w.calls[MF_KF_BF16] = 1;
        mf_task_id hd = mf_sg_add(b, ln, MF_SG_HEAD, MF_SG_PH_HEAD, MF_SG_K_OTHER, t);
        mf_sg_dep(b, hj, hd);
        if (sg->draft) mf_sg_dep(b, hd, b->head_done);
    }
}
