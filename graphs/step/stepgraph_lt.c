/* The cuBLASLt path in the step graph (graphs/step/stepgraph.h "The cuBLASLt path"): which dense
 * records take it (their lin_path), the per-layer dequantization tasks on the cards' copy-in lanes
 * with their order against the GEMMs of the scratch they overwrite, whether the routed experts may
 * take it, and the scratch a card holds for it (mf_sg_card_bufs_of's lt_* buffers). The engine runs
 * what these records say (graphs/step/step_dense.c, step_moe_cards.c); the simulator prices them. */
#include "graphs/step/stepgraph_impl.h"

#include <assert.h>

static size_t sg_lt_al(size_t b) { return (b + 255) / 256 * 256; }

int mf_sg_lt_dense_ok(int dense, int exact)
{
    switch (dense) {
    case MF_SG_D_ATTN_IN: case MF_SG_D_ATTN_QB: case MF_SG_D_ATTN_OB: case MF_SG_D_ENGRAM:
        return 1;
    case MF_SG_D_ATTN_OA:
        return !exact;
    default:
        return 0;
    }
}

int mf_sg_ffn_lt(const mf_cost_model *m, const mf_work *ew, int tok, int mode, double *ns)
{
    double core = mf_cost_card_on(m, ew, tok, 0);
    double lt = mf_cost_card_lt(m, MF_KF_FP4, ew->w_bytes[MF_KF_FP4], ew->macs[MF_KF_FP4], ew->calls[MF_KF_FP4], tok);
    int on = mode == MF_SG_LT_ON || (mode == MF_SG_LT_COST && lt > 0 && lt < core);
    if (ns) *ns = on && lt > 0 ? lt : core;   /* no tensor-core rate: priced as the CUDA cores */
    return on;
}

/* Sublayer d of layer L: its output rows, those of its FP8 linears, the columns each reads (a
 * stage's linears read one input; wo_a a group's), and its FP8 matrices. */
static void sg_lt_geom(const mf_sg_opts *o, int L, int d, double *rows, double *rows8, double *cols, double *mats)
{
    const mf_config *c = o->c;
    const mf_sg_layer_sizes *y = &o->sz->layer[L];
    *mats = 1;
    if (d == MF_SG_D_ENGRAM) {
        *rows = *rows8 = (double)(c->hc_mult + 1) * c->hidden_size;
        *cols = y->eng_fp8_macs / *rows;
    } else if (d == MF_SG_D_ATTN_OA) {
        *rows = *rows8 = y->st_out_rows[MF_SG_ST_OA];
        *cols = *rows > 0 ? y->attn_ref_macs / *rows : 0;
    } else {
        int st = d - MF_SG_D_ATTN_IN;
        *rows = y->st_out_rows[st];
        *rows8 = y->st_fp8_rows[st];
        *cols = *rows8 > 0 ? y->st_fp8_macs[st] / *rows8 : 0;
        *mats = y->st_fp8_calls[st];
    }
}

int mf_sg_lt_path(mf_sg_builder *b, int L, int d, int parts, int k, const mf_sg_task *t, int n, int blk)
{
    const mf_sg_opts *o = b->o;
    if (o->lt == MF_SG_LT_OFF || L < 0 || !mf_sg_lt_dense_ok(d, o->exact) || !(t->w.calls[MF_KF_FP8] > 0) ||
        !(t->w.macs[MF_KF_FP8] > 0))
        return MF_DEV_LIN_AUTO;
    if (o->lt == MF_SG_LT_COST) {
        mf_cost_model m = {.p = o->profile ? o->profile : mf_cost_default_profile()};
        int lt = 0;
        mf_cost_card_paths(&m, &t->w, n, &lt);
        if (!(lt & (1 << MF_KF_FP8))) return MF_DEV_LIN_AUTO;
    }
    /* the scratch: the card's rows (all, or its part's), of them at most the FP8 rows, each matrix
     * 256-aligned; the cast: a block's tokens over the columns (wo_a: the groups its rows touch) */
    double rows, rows8, cols, mats;
    sg_lt_geom(o, L, d, &rows, &rows8, &cols, &mats);
    int64_t r0 = 0, r1 = (int64_t)rows, xcols = (int64_t)cols;
    if (parts > 1) mf_sg_dense_rows(parts, k, (int64_t)rows, &r0, &r1);
    double own = (double)(r1 - r0) < rows8 ? (double)(r1 - r0) : rows8;
    if (d == MF_SG_D_ATTN_OA && r1 > r0) {
        int64_t R = (int64_t)rows / (o->c->o_groups > 0 ? o->c->o_groups : 1);
        if (R > 0) xcols = ((r1 - 1) / R - r0 / R + 1) * (int64_t)cols;
    }
    size_t w16 = (size_t)(own * cols * 2) + 256 * (size_t)mats, x16 = mf_dev_lt_x16_bytes(blk, xcols);
    if (w16 > b->sg->lt_w16[d]) b->sg->lt_w16[d] = w16;
    if (x16 > b->sg->lt_x16) b->sg->lt_x16 = x16;
    return MF_DEV_LIN_CUBLASLT;
}

void mf_sg_lt_deq(mf_sg_builder *b, const mf_sg_task *t, int phase, mf_task_id run)
{
    int cd = t->card, d = t->dense, L = t->layer, par = L & 1;
    if (b->rc || run < 0 || cd < 0 || d < 0 || d >= MF_SG_N_DENSE || L < 0) return;
    if (b->deq_l1[cd][d] != L + 1) {   /* the layer's first work of d on the card: its dequantization */
        mf_sg_task r = mf_sg_rec(L);
        r.card = (int8_t)cd;
        r.dense = (int8_t)d;
        r.part = t->part;
        r.w.w_bytes[MF_KF_FP8] = t->w.w_bytes[MF_KF_FP8];
        r.w.macs[MF_KF_FP8] = t->w.macs[MF_KF_FP8];
        r.w.calls[MF_KF_FP8] = t->w.calls[MF_KF_FP8];
        SG_NAME(b, "dev%d L%d %s dequant", cd, L, mf_sg_dense_name(d));
        mf_task_id q = mf_sg_add(b, b->o->lane_dev0 + 3 * cd, MF_SG_DENSE_DEQ, phase, MF_SG_K_DEV, r);
        /* into the scratch of its parity: after the works of two layers before that read it */
        for (int i = 0; i < b->n_lt_run[cd][d][par] && !b->rc; i++)
            b->rc = mf_graph_add_dep(b->sg->g, b->lt_run[cd][d][par][i], q);
        b->n_lt_run[cd][d][par] = 0;
        b->deq[cd][d] = q;
        b->deq_l1[cd][d] = (int16_t)(L + 1);
    }
    if (b->rc) return;
    b->rc = mf_graph_add_dep(b->sg->g, b->deq[cd][d], run);
    assert(b->n_lt_run[cd][d][par] < SG_LT_RUNS);
    b->lt_run[cd][d][par][b->n_lt_run[cd][d][par]++] = run;
}

void mf_sg_lt_ffn(const mf_sg_opts *o, mf_stepgraph *sg)
{
    sg->lt_ffn = sg->lt_ffn_tok = 0;
    if (!sg->n_cards || sg->dev_graphs || o->exact) return;   /* the slot-table FFN is int8 only */
    mf_work ew;
    mf_sg_expert_work(o->c, o->sz, &ew);
    mf_cost_model m = {.p = o->profile ? o->profile : mf_cost_default_profile()};
    if (!mf_sg_ffn_lt(&m, &ew, sg->n, o->lt, NULL)) return;   /* no slot has more than n tokens */
    sg->lt_ffn = 1;
    sg->lt_ffn_tok = sg->n < MF_SG_LT_FFN_TOK ? sg->n : MF_SG_LT_FFN_TOK;
}

size_t mf_sg_lt_routed_bufs(const mf_sg_card_in *in, mf_sg_card_bufs *b, size_t off)
{
    const mf_stepgraph *sg = in->sg;
    b->lt_e13 = b->lt_e2 = b->lt_gu = b->lt_ex16 = b->lt_ews = off;
    if (!sg->lt_ffn) return off;
    size_t H = (size_t)in->c->hidden_size, I = (size_t)in->c->moe_intermediate_size, T = (size_t)sg->lt_ffn_tok;
    b->lt_e13 = off;
    b->lt_e2 = b->lt_e13 + sg_lt_al(2 * I * H * 2);
    b->lt_gu = b->lt_e2 + sg_lt_al(H * I * 2);
    b->lt_ex16 = b->lt_gu + sg_lt_al(T * 2 * I * sizeof(float));
    b->lt_ex16_bytes = mf_dev_lt_x16_bytes((int)T, (int64_t)(H > I ? H : I));
    b->lt_ews = b->lt_ex16 + sg_lt_al(b->lt_ex16_bytes);
    b->lt_ws_bytes = MF_DEV_LT_WS_BYTES;
    return b->lt_ews + sg_lt_al(MF_DEV_LT_WS_BYTES);
}

void mf_sg_lt_dense_bufs(const mf_sg_card_in *in, mf_sg_card_bufs *b, size_t bytes[3])
{
    const mf_stepgraph *sg = in->sg;
    size_t par = 0;
    for (int d = 0; d < MF_SG_N_DENSE; d++) {
        b->lt_w16_d[d] = par;
        par += sg_lt_al(sg->lt_w16[d]);
    }
    b->lt_w16_par = par;
    b->lt_x16_bytes = par ? sg->lt_x16 : 0;
    if (par) b->lt_ws_bytes = MF_DEV_LT_WS_BYTES;
    bytes[0] = 2 * par;
    bytes[1] = b->lt_x16_bytes;
    bytes[2] = par ? MF_DEV_LT_WS_BYTES : 0;
}
