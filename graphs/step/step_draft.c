/* The scheduled engine's DSpark draft (graphs/step/step.h mf_step_draft, mf_step_forward_feat;
 * docs/dspark.md): the tasks of the draft's ops (graphs/step/stepgraph_draft.c builds them: a step's
 * features; a round's feed, the attention core of each stage, the greedy chain) on the layer math's
 * draft pieces (graphs/layers/layer_dspark.c), and a round's run: the draft shape's items set up
 * (each sequence's block: the anchor's embedding, then the noise token's), one graph run. The
 * stages' linears, mixes, norms and MoE are the backbone's tasks on the stages' weights. */
#include <errno.h>
#include <inttypes.h>
#include <string.h>

#include "graphs/step/step_impl.h"
#include "sched/error.h"

#define MF_STEP_DRAFT_MAX_RANK 4096   /* dspark_markov_rank the engine's chain supports (a row on the stack) */

int mf_step_draft_check(const mf_layers *ly)
{
    const mf_config *c = ly->c;
    if (!mf_model_has_draft(ly->m))
        return mf_error(-EINVAL, "step: the draft asked of a model loaded without it (mf_model_opts.load_draft)");
    int l0, l1;
    mf_model_layers(ly->m, &l0, &l1);
    if (l0 > 0 || l1 < c->n_layers)
        return mf_error(-EINVAL, "step: the draft asked of a pipeline stage (layers [%d, %d) of %d); it runs on a "
                        "whole model", l0, l1, c->n_layers);
    if (mf_model_is_lazy(ly->m))
        return mf_error(-ENOTSUP, "step: the draft's experts are not resident (lazy load); the engine's draft "
                        "needs them in memory");
    if (c->dspark_num_experts_per_tok > c->n_experts_per_tok || c->dspark_n_routed_experts > c->n_routed_experts)
        return mf_error(-ENOTSUP, "step: the draft's top-%d of %d experts exceeds the backbone's top-%d of %d, "
                        "which the engine's buffers are sized for", c->dspark_num_experts_per_tok,
                        c->dspark_n_routed_experts, c->n_experts_per_tok, c->n_routed_experts);
    if (c->dspark_markov_rank > MF_STEP_DRAFT_MAX_RANK || c->head_dim > MF_LY_DRAFT_MAX_D ||
        c->dspark_block_size > MF_STEP_DRAFT_ITEMS)
        return mf_error(-ENOTSUP, "step: the draft's Markov rank %d, head_dim %d or block %d (max %d, %d, %d)",
                        c->dspark_markov_rank, c->head_dim, c->dspark_block_size, MF_STEP_DRAFT_MAX_RANK,
                        MF_LY_DRAFT_MAX_D, MF_STEP_DRAFT_ITEMS);
    return 0;
}

/* A step's features: per item of the record's unit that asks for them, the streams entering draft
 * target layer `layer` (its j-th) averaged and rounded (mf_ly_draft_feature) into its row. */
static int mf_task_draft_feat(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    const mf_config *c = sh->eng->c;
    int j = 0;
    while (j < c->n_dspark_target && c->dspark_target_layer_ids[j] != a->t->layer) j++;
    for (int i = a->t->i0; i < a->t->i1; i++)
        if (sh->feat_out[i]) mf_ly_draft_feature(c, sh->items[i].x, sh->feat_out[i] + (int64_t)j * c->hidden_size);
    return 0;
}

/* The feed's projection: part >= 0, rows [r0, r1) of main_proj over every unit's pending rows;
 * part -1, the unit's projected rows rounded and normed (mf_ly_draft_feed_norm). */
static int mf_task_draft_feed(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_config *c = sh->eng->c;
    int64_t H = c->hidden_size, F = (int64_t)c->n_dspark_target * H;
    int U = sh->sg->n_units;
    if (a->t->part >= 0) {
        int rows = sh->dfeed_off[U - 1] + sh->dfeed_n[U - 1];
        if (!rows || a->t->r0 >= a->t->r1) return 0;
        const mf_weight *w = &mf_model_layer_at(cx->ly->m, c->n_layers)->main_proj;
        return mf_ly_linear_part(cx, w, sh->dfeed_x, rows, F, sh->dfeed_u, H, a->t->r0, a->t->r1);
    }
    int k = mf_stepgraph_unit_of(sh->sg, a->t->i0);
    for (int r = 0; r < sh->dfeed_n[k]; r++) mf_ly_draft_feed_norm(cx, sh->dfeed_u + (int64_t)(sh->dfeed_off[k] + r) * H);
    return 0;
}

/* The feed's window KV of stage `layer`: part >= 0, rows [r0, r1) of its wkv over every unit's normed
 * rows; part -1, the unit's rows through the window KV formula into its ring (mf_ly_draft_feed_put),
 * at the positions the round's setup gave them (the context's n_pos already past them). */
static int mf_task_draft_feed_kv(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_config *c = sh->eng->c;
    int s = a->t->layer - c->n_layers, U = sh->sg->n_units, D = c->head_dim;
    int rows = sh->dfeed_off[U - 1] + sh->dfeed_n[U - 1];
    float *kv = sh->dkv + (int64_t)s * sh->dfeed_rows * D;
    if (a->t->part >= 0) {
        if (!rows || a->t->r0 >= a->t->r1) return 0;
        const mf_weight *w = &mf_model_layer_at(cx->ly->m, a->t->layer)->wkv;
        return mf_ly_linear_part(cx, w, sh->dfeed_u, rows, c->hidden_size, kv, D, a->t->r0, a->t->r1);
    }
    int k = mf_stepgraph_unit_of(sh->sg, a->t->i0);
    int64_t pos0 = sh->dseq[k].ds->n_pos - sh->dfeed_n[k];
    for (int r = 0; r < sh->dfeed_n[k]; r++)
        mf_ly_draft_feed_put(cx, sh->dseq[k].ds, s, pos0 + r, kv + (int64_t)(sh->dfeed_off[k] + r) * D);
    return 0;
}

/* Stage `layer`'s block KV of the record's unit (the backbone's window KV formula, in place in its
 * items' KV rows), then the unit's key table: its context's rows, the block's. */
static int mf_task_draft_kv(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_config *c = sh->eng->c;
    int L = a->t->layer, k = mf_stepgraph_unit_of(sh->sg, a->t->i0), D = c->head_dim;
    float *keys = sh->dkeys + (int64_t)k * (c->sliding_window + c->dspark_block_size) * D, *b[MF_LY_A_N];
    int64_t n_ctx = mf_ly_draft_context(c, sh->dseq[k].ds, L - c->n_layers, sh->items[a->t->i0].pos, keys);
    for (int i = a->t->i0; i < a->t->i1; i++) {
        mf_step_abuf(sh, i, b);
        mf_ly_attn_kv_window(cx, &sh->items[i], L, b);
        memcpy(keys + (n_ctx + i - a->t->i0) * D, b[MF_LY_A_KV], sizeof(float) * (size_t)D);
    }
    sh->dnkeys[k] = (int)n_ctx + (a->t->i1 - a->t->i0);
    return 0;
}

/* Heads [r0, r1) of every position of the record's unit over its key table (mf_ly_draft_head). */
static int mf_task_draft_heads(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_config *c = sh->eng->c;
    int k = mf_stepgraph_unit_of(sh->sg, a->t->i0);
    const float *keys = sh->dkeys + (int64_t)k * (c->sliding_window + c->dspark_block_size) * c->head_dim;
    float *b[MF_LY_A_N];
    int64_t D = c->head_dim, h0 = a->t->r0, h1 = a->t->r1;
    for (int i = a->t->i0; i < a->t->i1; i++) {
        mf_step_abuf(sh, i, b);
        mf_step_ab_cast(sh, MF_LY_A_Q, 0, i, h0 * D, h1 * D);   /* qb's queries from a dense card */
        for (int64_t h = h0; h < h1; h++)
            mf_ly_draft_head(cx, a->t->layer, sh->items[i].pos, (int)h, b[MF_LY_A_Q], keys, sh->dnkeys[k], b[MF_LY_A_O]);
        mf_step_ab_cast(sh, MF_LY_A_O, 1, i, h0 * D, h1 * D);   /* for oa's copy */
    }
    return 0;
}

/* The token before candidate i of unit k: the anchor, else its candidate i - 1. */
static int32_t mf_step_draft_prev(const mf_step_draft_seq *q, int i)
{
    return i ? q->tokens[i - 1] : q->anchor;
}

float *mf_step_draft_mk_rows(mf_step_shape *sh, int cand, int k)
{
    int64_t R = sh->eng->c->dspark_markov_rank, U = sh->sg->n_units;
    float *rows = sh->dmk_in + k * U * R;
    for (int u = 0; u < U; u++) {
        const mf_step_draft_seq *q = &sh->dseq[u];
        mf_ly_draft_mk_emb(sh->eng->ly, cand < q->n_cand ? mf_step_draft_prev(q, cand) : q->anchor, rows + u * R);
    }
    return rows;
}

/* Rows [r0, r1) of the Markov head's logits of candidate `cand` of every unit asking for it, rounded
 * to bf16 (the head's output). */
static int mf_task_draft_markov(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_config *c = sh->eng->c;
    const mf_weight *w = &mf_model_layer_at(cx->ly->m, c->n_layers + c->n_mtp_layers - 1)->mk_head;
    float emb[MF_STEP_DRAFT_MAX_RANK];
    int i = a->t->cand;
    for (int k = 0; k < sh->sg->n_units && a->t->r0 < a->t->r1; k++) {
        if (i >= sh->dseq[k].n_cand) continue;
        mf_ly_draft_mk_emb(cx->ly, mf_step_draft_prev(&sh->dseq[k], i), emb);
        float *mk = sh->dmk + (int64_t)k * c->vocab_size;
        int rc = mf_ly_linear_part(cx, w, emb, 1, c->dspark_markov_rank, mk, c->vocab_size, a->t->r0, a->t->r1);
        if (rc) return rc;
        mf_kern_vec_bf16_round(mk + a->t->r0, a->t->r1 - a->t->r0);
    }
    return 0;
}

/* Candidate `cand` of the record's unit: the head's logits plus the Markov head's (rounded), their
 * argmax (ties to the lower id), the confidence head's logit; the logits handed out where asked. */
static int mf_task_draft_pick(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    const mf_config *c = sh->eng->c;
    int i = a->t->cand, it = a->t->i0, k = mf_stepgraph_unit_of(sh->sg, it);
    mf_step_draft_seq *q = &sh->dseq[k];
    if (i >= q->n_cand) return 0;
    int64_t V = c->vocab_size, best = 0;
    float *row = sh->lbuf + (int64_t)sh->head_row[it] * V, emb[MF_STEP_DRAFT_MAX_RANK];
    const float *mk = sh->dmk + (int64_t)k * V;
    for (int64_t v = 0; v < V; v++) {
        row[v] += mk[v];
        if (row[v] > row[best]) best = v;
    }
    int32_t prev = mf_step_draft_prev(q, i);
    q->tokens[i] = (int32_t)best;
    if (q->confidence) {
        mf_ly_draft_mk_emb(sh->eng->ly, prev, emb);
        q->confidence[i] = mf_ly_draft_confidence(sh->eng->ly, sh->hn + (int64_t)sh->head_row[it] * c->hidden_size, emb);
    }
    if (q->logits) memcpy(q->logits + i * V, row, sizeof(float) * (size_t)V);
    return 0;
}

/* This file's ops (step_impl.h; step_shape.c binds them). */
const mf_task_fn mf_step_draft_fn_of[MF_SG_N_OPS] = {
    [MF_SG_DRAFT_FEAT] = mf_task_draft_feat,   [MF_SG_DRAFT_FEED] = mf_task_draft_feed,
    [MF_SG_DRAFT_FEED_KV] = mf_task_draft_feed_kv,
    [MF_SG_DRAFT_KV] = mf_task_draft_kv,       [MF_SG_DRAFT_HEADS] = mf_task_draft_heads,
    [MF_SG_DRAFT_MARKOV] = mf_task_draft_markov, [MF_SG_DRAFT_PICK] = mf_task_draft_pick,
};

/* ---- a round ---------------------------------------------------------------------------------- */

/* The shape's items for U sequences: unit k's block at positions ds->n_pos + n_feed .., the anchor's
 * embedding then the noise token's in every stream, pre one-hot, every item's logits by the head;
 * the pending rows one after another. */
static void mf_step_draft_items(mf_step *s, mf_step_shape *sh, const mf_step_draft_seq *seqs, int U)
{
    const mf_config *c = s->c;
    int B = c->dspark_block_size, rows = 0;
    int64_t H = c->hidden_size, F = (int64_t)c->n_dspark_target * H;
    const mf_weight *emb = mf_model_embed(s->ly->m);
    sh->n_head = 0;
    for (int k = 0; k < U; k++) {
        const mf_step_draft_seq *q = &seqs[k];
        sh->dseq[k] = *q;
        sh->dfeed_off[k] = rows;
        sh->dfeed_n[k] = q->n_feed;
        q->ds->n_pos += q->n_feed;   /* its rows' KV goes in by the graph's feed tasks */
        memcpy(sh->dfeed_x + rows * F, q->feed, sizeof(float) * (size_t)(q->n_feed * F));
        rows += q->n_feed;
        for (int i = 0; i < B; i++) {
            int n = k * B + i;
            mf_ly_item *it = &sh->items[n];
            it->st = NULL;
            it->pos = q->ds->n_pos + i;
            it->tok = i ? (int32_t)c->dspark_noise_token_id : q->anchor;
            it->topk_src = it->cand_src = -1;
            it->n_topk = it->n_cand = 0;
            it->logits = NULL;
            memset(it->pre, 0, sizeof it->pre);
            it->pre[0] = 1.0f;
            for (int64_t d = 0; d < H; d++) {
                uint16_t v;
                memcpy(&v, emb->data + ((int64_t)it->tok * H + d) * 2, 2);
                it->x[d] = mf_bf16_to_f32(v);
            }
            for (int h = 1; h < c->hc_mult; h++) memcpy(it->x + h * H, it->x, sizeof(float) * (size_t)H);
            sh->head_row[n] = i < q->n_cand ? sh->n_head : -1;   /* the head only where a candidate is picked */
            if (i < q->n_cand) sh->head_item[sh->n_head++] = n;
        }
    }
}

/* One graph run of the draft round for U sequences (U x dspark_block_size <= MF_STEP_DRAFT_ITEMS). */
static int mf_step_draft_run(mf_step *s, mf_step_draft_seq *seqs, int U)
{
    const mf_config *c = s->c;
    mf_step_shape *sh;
    int rc = mf_step_draft_shape(s, U, &sh), max_cand = 0;
    for (int w = 0; !rc && w < s->n_cx; w++)   /* the heads' scores over the window and the block */
        rc = mf_ly_ctx_reserve(s->cx[w], (int64_t)c->sliding_window + c->dspark_block_size);
    if (rc) return rc;
    mf_step_draft_items(s, sh, seqs, U);
    for (int k = 0; k < U; k++) max_cand = seqs[k].n_cand > max_cand ? seqs[k].n_cand : max_cand;
    mf_stepgraph_mark_draft(sh->sg, max_cand);
    mf_timeline_reset(sh->tl);
    rc = mf_sched_run(s->sched, sh->g, &(mf_run_opts){.timeline = sh->tl});
    s->last = sh;
    return rc ? mf_error_wrap(rc, "step: a draft round of %d sequences", U) : 0;
}

int mf_step_draft(mf_step *s, mf_step_draft_seq *seqs, int n_seq)
{
    const mf_config *c = s->c;
    if (!s->o.draft) return mf_error(-EINVAL, "step: a draft round on an engine made without the draft (opts.draft)");
    int B = c->dspark_block_size, W = c->sliding_window, per = MF_STEP_DRAFT_ITEMS / B;
    int64_t F = (int64_t)c->n_dspark_target * c->hidden_size;
    for (int k = 0; k < n_seq; k++) {
        mf_step_draft_seq *q = &seqs[k];
        if (q->n_cand < 1 || q->n_cand > B || q->anchor < 0 || q->anchor >= c->vocab_size || q->n_feed < 0 || !q->ds)
            return mf_error(-EINVAL, "step: draft sequence %d: %d candidates after token %d, %d rows to feed (expected "
                            "1..%d, a token id < %" PRId64 ", >= 0)", k, q->n_cand, q->anchor, q->n_feed, B,
                            (int64_t)c->vocab_size);
        if (q->n_feed > W) {   /* rows before the window are never read: only their positions advance */
            q->ds->n_pos += q->n_feed - W;
            q->feed += (q->n_feed - W) * F;
            q->n_feed = W;
        }
    }
    int rc = 0;
    mf_step_dev_begin(s);
    for (int k = 0; k < n_seq && !rc; k += per) rc = mf_step_draft_run(s, seqs + k, n_seq - k < per ? n_seq - k : per);
    mf_step_dev_end(s);
    return rc;
}
