/* The DSpark draft in the step graph (graphs/step/stepgraph.h mf_sg_opts.draft, .feats; docs/dspark.md):
 * in a step's graph the features the draft reads (per unit at each target layer); the draft
 * round's graph: the pending features' feed (main_proj in row parts over every unit, then per
 * unit its norm and each stage's window KV into the context ring), per stage the attention core
 * (per unit the block's KV, then its heads in groups over the context and the block; the linear
 * stages, mixes, norms and the MoE are the backbone's sublayers on the stage's weights), and after
 * the target's head the greedy chain: per candidate the Markov head's row parts over every unit
 * (with dense cards a dense chain on them), then each unit's pick (argmax, confidence). */
#include "graphs/step/stepgraph_impl.h"

#include <errno.h>

#include "sched/error.h"

int mf_sg_draft_check(const mf_sg_opts *o)
{
    const mf_config *c = o->c;
    int B = c->dspark_block_size;
    if (c->n_mtp_layers < 1 || B < 1)
        return mf_error(-EINVAL, "step graph: a draft round of a config without draft stages");
    if (o->par || o->mixed || o->n_units < 1 || o->n != o->n_units * B || o->n > MF_SG_MAX_GROUPS || !o->unit_end)
        return mf_error(-EINVAL, "step graph: a draft round of %d items in %d units (expected units of "
                        "dspark_block_size %d items, at most %d items: one per item group)", o->n, o->n_units, B,
                        MF_SG_MAX_GROUPS);
    if (o->layer_begin > 0 || (o->layer_end && o->layer_end < c->n_layers))
        return mf_error(-EINVAL, "step graph: a draft round on a pipeline stage (layers [%d, %d)): the draft runs "
                        "on a whole model", o->layer_begin, o->layer_end);
    for (int k = 0; k < o->n_units; k++)
        if (o->unit_end[k] != (k + 1) * B)
            return mf_error(-EINVAL, "step graph: draft unit %d ends at item %d (expected %d)", k, o->unit_end[k],
                            (k + 1) * B);
    /* the draft's experts are resident: on the host, or on the cards that own them (their slots as
     * the backbone's, every one a hit: docs/dspark.md "The draft's experts on the cards") */
    if (o->micro > 1 || o->store || o->eg_reads || o->dev_graphs || o->prefetch_min >= 0)
        return mf_error(-EINVAL, "step graph: a draft round takes no micro-batches, expert store, Engram reads, "
                        "device graphs or prefetch (found %d micro-batches, store %d, reads %d, graphs %d, "
                        "prefetch from %d)", o->micro, o->store, o->eg_reads, o->dev_graphs, o->prefetch_min);
    return 0;
}

/* One stage's wkv (FP8 codes + scales, [head_dim, hidden]): what the feed reads per stage. */
static double sg_draft_wkv_bytes(const mf_config *c)
{
    double D = c->head_dim, H = (double)c->hidden_size;
    return D * H + D / c->quant_block_out * H / c->quant_block_in;   /* one scale byte a block */
}

/* Positions a round's feed projects per unit, for the prices: a verify's kept ones at most (the
 * anchor and dspark_block_size candidates). */
static double sg_draft_feed_rows(const mf_config *c) { return c->dspark_block_size + 1.0; }

/* Rows of a matrix of n_rows outputs in P parts over every unit's feed rows (op, layer L), after
 * `after`, into join j. */
static void sg_draft_feed_parts(mf_sg_builder *b, int op, int L, double n_rows, double w_bytes, double macs_tok,
                                mf_task_id after, mf_task_id j)
{
    mf_stepgraph *sg = b->sg;
    int P = sg->p_attn;
    for (int p = 0; p < P; p++) {
        SG_NAME(b, "draft feed L%d rows %d", L, p);
        mf_sg_task t = mf_sg_rec(L);
        t.part = p;
        t.n_tok = (int)(sg_draft_feed_rows(b->o->c) * sg->n_units);
        int ln = mf_sg_rows_lane(b, (int64_t)n_rows, P, p, &t.r0, &t.r1);
        t.w.w_bytes[MF_KF_FP8] = w_bytes / P;
        t.w.macs[MF_KF_FP8] = macs_tok / P;
        t.w.calls[MF_KF_FP8] = 1;
        mf_task_id id = mf_sg_add(b, ln, op, MF_SG_PH_ATTN, MF_SG_K_OTHER, t);
        mf_sg_dep(b, after, id);
        mf_sg_dep(b, id, j);
    }
}

void mf_sg_draft_feed(mf_sg_builder *b, mf_task_id *unit)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    int L = c->n_layers, S = c->n_mtp_layers;
    double H = (double)c->hidden_size, D = c->head_dim, rows = sg_draft_feed_rows(c);
    mf_task_id pj = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ATTN, MF_SG_K_OTHER, mf_sg_rec(L)), nj, kj;
    sg_draft_feed_parts(b, MF_SG_DRAFT_FEED, L, H, b->o->sz->feed_fp8_bytes, H * c->n_dspark_target * H, -1, pj);
    SG_NAME(b, "draft feed norm join");
    nj = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ATTN, MF_SG_K_OTHER, mf_sg_rec(L));
    for (int k = 0; k < sg->n_units; k++) {   /* per unit its rows normed */
        SG_NAME(b, "draft feed norm %d", k);
        mf_sg_task t = mf_sg_item(b, L, k);
        t.n_tok = (int)rows;
        t.w.ref_flops = rows * H * (2.0 + 2.0 * SG_W_ROUND);
        mf_task_id id = mf_sg_add(b, 0, MF_SG_DRAFT_FEED, MF_SG_PH_ATTN, MF_SG_K_OTHER, t);
        mf_sg_dep(b, pj, id);
        mf_sg_dep(b, id, nj);
        unit[k] = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ATTN, MF_SG_K_OTHER, mf_sg_rec(L));   /* the unit's feed done */
    }
    for (int s = 0; s < S; s++) {   /* per stage its wkv in row parts, then per unit the ring's rows */
        SG_NAME(b, "draft feed L%d join", L + s);
        kj = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ATTN, MF_SG_K_OTHER, mf_sg_rec(L + s));
        sg_draft_feed_parts(b, MF_SG_DRAFT_FEED_KV, L + s, D, sg_draft_wkv_bytes(c), D * H, nj, kj);
        for (int k = 0; k < sg->n_units; k++) {
            SG_NAME(b, "draft feed L%d put %d", L + s, k);
            mf_sg_task t = mf_sg_item(b, L + s, k);
            t.n_tok = (int)rows;
            t.w.ref_flops = rows * (4.0 * D + SG_W_ROUND * 2.0 * D + SG_W_ROPE * c->qk_rope_head_dim);
            mf_task_id id = mf_sg_add(b, 0, MF_SG_DRAFT_FEED_KV, MF_SG_PH_ATTN, MF_SG_K_OTHER, t);
            mf_sg_dep(b, kj, id);
            mf_sg_dep(b, id, unit[k]);
        }
    }
}

void mf_sg_draft_feat(mf_sg_builder *b, int L, mf_task_id *unit)
{
    const mf_config *c = b->o->c;
    int target = 0;
    for (int j = 0; j < c->n_dspark_target; j++) target |= c->dspark_target_layer_ids[j] == L;
    if (!target) return;
    double H = (double)c->hidden_size;
    for (int k = b->k0; k < b->k1; k++) {
        SG_NAME(b, b->sg->par ? "draft feat L%d item %d" : "draft feat L%d", L, k);
        mf_sg_task t = mf_sg_item(b, L, k);
        t.w.ref_flops = t.n_tok * H * (c->hc_mult + SG_W_ROUND);   /* the streams' mean, rounded */
        mf_task_id f = mf_sg_add(b, 0, MF_SG_DRAFT_FEAT, MF_SG_PH_ATTN, MF_SG_K_OTHER, t);
        mf_sg_dep(b, unit[k], f);
        unit[k] = f;
    }
}

mf_task_id mf_sg_draft_core(mf_sg_builder *b, int L, int k, mf_task_id (*rows)[MF_SG_MAX_PARTS])
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    double D = c->head_dim, W = c->sliding_window, B = c->dspark_block_size, rd = c->qk_rope_head_dim;
    int nh = c->n_heads;
    /* the block's window KV (the backbone's formula), and the unit's key table: the context's rows
     * unpacked from the ring, then the block's */
    SG_NAME(b, "draft L%d kv %d", L, k);
    mf_sg_task t = mf_sg_item(b, L, k);
    t.n_tok = 1;
    t.w.ref_flops = B * (4.0 * D + SG_W_ROUND * 2.0 * D + SG_W_ROPE * rd) + (W + B) * D;
    mf_task_id kv = mf_sg_add(b, 0, MF_SG_DRAFT_KV, MF_SG_PH_ATTN, MF_SG_K_OTHER, t);
    for (int p = 0; p < sg->p_attn; p++) mf_sg_dep(b, rows[MF_SG_ST_IN][p], kv);
    /* the heads in groups, a group per worker the units leave (a unit's B positions are few): per
     * position and head its query roped, scores and values over W + B keys with the sink (double
     * sums: the module's mf_ly_attn_sink_rows), the output inverse-roped */
    int W0 = b->o->n_threads > 0 ? b->o->n_threads : 1, ng = W0 / sg->n_units;
    ng = ng < 1 ? 1 : ng > nh ? nh : ng;
    int per = (nh + ng - 1) / ng;
    for (int g = 0; g * per < nh; g++) {
        int h0 = g * per, h1 = h0 + per < nh ? h0 + per : nh;
        SG_NAME(b, "draft L%d heads %d %d", L, k, g);
        mf_sg_task th = mf_sg_item(b, L, k);
        th.part = g;
        th.r0 = h0;
        th.r1 = h1;
        th.n_tok = 1;
        th.w.ref_flops = B * (h1 - h0) * ((W + B) * (2.0 * D + 4.0) + SG_W_ROUND * 3.0 * D + 2.0 * SG_W_ROPE * rd);
        mf_task_id hd = mf_sg_add(b, 0, MF_SG_DRAFT_HEADS, MF_SG_PH_ATTN, MF_SG_K_OTHER, th);
        mf_sg_dep(b, kv, hd);
        for (int p = 0; p < sg->p_attn; p++) {
            mf_sg_dep(b, rows[MF_SG_ST_QB][p], hd);
            mf_sg_dep(b, hd, rows[MF_SG_ST_OA][p]);
        }
    }
    return -1;   /* the post waits for the ob parts, after the heads */
}

/* Candidate i's Markov rows on the dense cards (MF_SG_D_MARKOV: where mf_sg_dense_parts puts it,
 * split by rows over the cards as the head, or on the head's card, the last stage's): a dense
 * chain over the units, a row each (every unit's previous token's rank-R row in, its vocab terms
 * out). Returns the chain's group. */
static mf_task_id sg_draft_markov_cards(mf_sg_builder *b, int i)
{
    const mf_config *c = b->o->c;
    int h0 = b->h0, h1 = b->h1;
    double V = (double)c->vocab_size, R = c->dspark_markov_rank;
    mf_sg_task t = mf_sg_rec(c->n_layers + c->n_mtp_layers - 1);
    t.cand = (int8_t)i;
    t.w.w_bytes[MF_KF_BF16] = b->o->sz->mk_head_bytes;
    t.w.macs[MF_KF_BF16] = V * R;
    t.w.calls[MF_KF_BF16] = 1;
    b->h0 = 0;   /* the chain's items: the units */
    b->h1 = b->sg->n_units;
    mf_task_id ch = mf_sg_dense_chain(b, t.layer, MF_SG_D_MARKOV, t, MF_SG_PH_HEAD, 4.0 * R, 4.0 * V, -1, 0);
    b->h0 = h0;
    b->h1 = h1;
    return ch;
}

void mf_sg_draft_propose(mf_sg_builder *b, mf_task_id head_done)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    int B = c->dspark_block_size, P = sg->p_head, U = sg->n_units;
    double V = (double)c->vocab_size, H = (double)c->hidden_size, R = c->dspark_markov_rank;
    mf_task_id prev = -1;   /* the previous candidate's picks, joined */
    for (int i = 0; i < B && !b->rc; i++) {
        SG_NAME(b, "draft markov %d join", i);
        mf_task_id mj = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_HEAD, MF_SG_K_OTHER, mf_sg_rec(-1));
        if (sg->n_dense_cards) {
            mf_task_id ch = sg_draft_markov_cards(b, i);
            mf_sg_dep(b, prev, ch);
            mf_sg_dep(b, ch, mj);
        }
        for (int p = 0; p < P && !sg->n_dense_cards; p++) {   /* else on the host, in row parts */
            SG_NAME(b, "draft markov %d %d", i, p);
            mf_sg_task t = mf_sg_rec(-1);
            t.cand = (int8_t)i;
            t.part = p;
            t.n_tok = U;
            int ln = mf_sg_rows_lane(b, (int64_t)V, P, p, &t.r0, &t.r1);
            t.w.w_bytes[MF_KF_BF16] = b->o->sz->mk_head_bytes / P;
            t.w.macs[MF_KF_BF16] = V * R / P;
            t.w.calls[MF_KF_BF16] = 1;
            t.w.vec_flops = U * (double)(t.r1 - t.r0) * SG_W_ROUND_VEC;   /* its rows rounded to bf16 */
            mf_task_id mk = mf_sg_add(b, ln, MF_SG_DRAFT_MARKOV, MF_SG_PH_HEAD, MF_SG_K_OTHER, t);
            mf_sg_dep(b, prev, mk);
            mf_sg_dep(b, mk, mj);
        }
        SG_NAME(b, "draft pick %d join", i);
        mf_task_id pj = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_HEAD, MF_SG_K_OTHER, mf_sg_rec(-1));
        for (int k = 0; k < U; k++) {   /* the head's row plus the Markov term, argmax, confidence */
            SG_NAME(b, "draft pick %d unit %d", i, k);
            mf_sg_task t = mf_sg_rec(-1);
            t.cand = (int8_t)i;
            t.i0 = sg->unit_end[k] - B + i;
            t.i1 = t.i0 + 1;
            t.n_tok = 1;
            t.w.ref_flops = 2.0 * V + H + R;   /* the rows' sum and argmax; the confidence's dot */
            mf_task_id pk = mf_sg_add(b, 0, MF_SG_DRAFT_PICK, MF_SG_PH_HEAD, MF_SG_K_OTHER, t);
            mf_sg_dep(b, head_done, pk);
            mf_sg_dep(b, mj, pk);
            mf_sg_dep(b, pk, pj);
        }
        prev = pj;
    }
}

void mf_stepgraph_mark_draft(mf_stepgraph *sg, int n_cand)
{
    for (int t = 0; t < sg->n_tasks; t++) {
        int op = sg->task[t].op;
        int markov = sg->task[t].dense == MF_SG_D_MARKOV && sg->task[t].card >= 0;   /* its chains on the cards */
        if (op == MF_SG_DRAFT_MARKOV || op == MF_SG_DRAFT_PICK || markov)
            mf_graph_set_noop(sg->g, t, sg->task[t].cand >= n_cand);
    }
}
