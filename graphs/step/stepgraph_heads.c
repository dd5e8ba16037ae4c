/* The attention core's heads (scores and values) and index scores, on the host or the cards: their
 * records and prices, where each layer's run (mf_sg_heads_choice, mf_sg_scores_choice: read by
 * stepgraph_shape.c), and their chains on the cards (gather -> q prep -> per card in -> heads -> out
 * -> o post; keys -> per card in -> scores -> out), which stepgraph_attn.c builds into a layer. */
#include "graphs/step/stepgraph_impl.h"

/* ---- the heads' scores and values (host or cards) ---------------------------------------- */

#define SG_W_UNPACK 2.0   /* estimate, not measured: REF multiply-adds per element of a packed KV row unpacked */

/* The position the priorities and the heads' placement price the attention at: the window full
 * and every compressed layer's top-k selected. */
int64_t mf_sg_steady_pos(const mf_config *c)
{
    int64_t pos = c->sliding_window;
    for (int L = 0; L < c->n_layers; L++)
        if ((int64_t)c->compress_ratios[L] * c->index_topk > pos) pos = (int64_t)c->compress_ratios[L] * c->index_topk;
    return pos;
}

/* Keys of an item of layer L at most: the window and, on compressed layers, the top-k. */
int mf_sg_heads_keys(const mf_config *c, int L)
{
    return c->sliding_window + (c->compress_ratios[L] > 0 ? c->index_topk : 0);
}

void mf_sg_heads_range(int n_heads, int parts, int k, int *h0, int *h1)
{
    int per = n_heads / parts, extra = n_heads % parts;
    *h0 = k * per + (k < extra ? k : extra);
    *h1 = *h0 + per + (k < extra);
}

void mf_sg_scores_range(int n, int parts, int k, int q, int *i0, int *i1)
{
    mf_sg_heads_range(n, 2 * parts, q ? k : 2 * parts - 1 - k, i0, i1);
}

/* ---- the index scores on cards --------------------------------------------------------------- */

/* Estimate, not measured: the card's index-score kernel's work per (key, head) beside the dot's
 * index_head_dim multiply-adds, in fp32 multiply-add slots: its half-warp's shuffle tree (4
 * shuffles and 4 adds on 16 lanes: 128) and lane 0's add in double (sm_75 runs fp64 at 1/32 of the
 * fp32 rate, RTX 2080 Ti spec: 32). */
#define SG_W_CARD_ISCORE 160.0

int mf_sg_scores_task(const mf_sg_task *t)
{
    return t->op == MF_SG_ATTN_KEYS || ((t->op == MF_SG_DENSE_IN || t->op == MF_SG_DENSE || t->op == MF_SG_DENSE_OUT) &&
                                        t->dense == MF_SG_D_SCORES);
}

void mf_sg_scores_pos(const mf_config *c, const mf_sg_task *t, int64_t pos0, int step, double *flops, double *bytes)
{
    *flops = *bytes = 0;
    int ratio = c->compress_ratios[t->layer], n = t->i1 - t->i0;
    if (!mf_sg_scores_task(t) || ratio <= 0 || n < 1) return;
    double ih = c->index_n_heads, id = c->index_head_dim, sum = 0;
    /* the table and each score row: the entries the last item sees */
    double last = (double)((pos0 + (int64_t)(n - 1) * step + 1) / ratio);
    for (int k = 0; k < n; k++) sum += (double)((pos0 + (int64_t)k * step + 1) / ratio);
    switch (t->op) {
    case MF_SG_ATTN_KEYS:   /* each entry's key unpacked, each item's count */
        *flops = SG_W_UNPACK * id * last + n;
        break;
    case MF_SG_DENSE_IN:   /* the table: block 0's (mf_sg_scores_range) */
        *bytes = t->block > 0 ? 0 : 4.0 * id * last;
        break;
    case MF_SG_DENSE:   /* per visible entry and head a dot of id, its tree and its term added in double */
        *flops = sum * ih * (id + SG_W_CARD_ISCORE);
        break;
    default:   /* the scores out, doubles: a row of the last item's width per item */
        *bytes = 8.0 * n * last;
        break;
    }
}

int mf_sg_scores_choice(const mf_sg_opts *o, int L, int heads_cards)
{
    const mf_config *c = o->c;
    if (heads_cards < 1 || !mf_sg_layer_scored(c, L) ||
        (int64_t)c->index_n_heads * c->index_head_dim > MF_DEV_ISCORE_MAX_QD)
        return 0;
    return o->n_dense_cards < o->n ? o->n_dense_cards : o->n;
}

/* The index scores of unit k of layer L on the cards (sg->scores_cards[L] of them): after the
 * cores of its item groups [gu0, gu1] (gate[]), the keys -> per card and block of its share of the
 * unit's items (mf_sg_scores_range) copy in -> scores -> copy out -> the join it returns, which the
 * selects wait for; block 1's copy-in after block 0's (block 0's carries the table both read). */
mf_task_id mf_sg_scores_on_cards(mf_sg_builder *b, int L, int k, const mf_task_id *gate, int gu0, int gu1)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    int parts = sg->scores_cards[L], i0 = k > 0 ? sg->unit_end[k - 1] : 0, n = sg->unit_end[k] - i0;
    double ih = c->index_n_heads, id = c->index_head_dim;
    SG_NAME(b, "attn L%d keys", L);
    mf_sg_task tk = mf_sg_item(b, L, k);
    tk.n_tok = 1;
    mf_task_id keys = mf_sg_add(b, 0, MF_SG_ATTN_KEYS, MF_SG_PH_ATTN, MF_SG_K_OTHER, tk);
    for (int i = gu0; i <= gu1; i++)
        if (i == gu0 || gate[i] != gate[i - 1]) mf_sg_dep(b, gate[i], keys);
    SG_NAME(b, "attn L%d scores join", L);
    mf_task_id join = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ATTN, MF_SG_K_OTHER, mf_sg_rec(L));
    mf_sg_dep(b, keys, join);
    static const int kind_of[3] = {MF_SG_K_COPY, MF_SG_K_OTHER, MF_SG_K_COPY_OUT};
    static const char *const what[3] = {" in", "", " out"};
    for (int p = 0; p < parts && !b->rc; p++) {
        int cd = parts > 1 ? p : mf_sg_dense_card_of(b->o, sg->n_dense_cards, L), a, e;
        mf_task_id in0 = -1;
        int a0, e0;   /* block 0's items: where none (fewer items than blocks), block 1 is the card's first */
        mf_sg_scores_range(n, parts, p, 0, &a0, &e0);
        for (int j = 0; j < 2 && !b->rc; j++) {
            mf_sg_scores_range(n, parts, p, j, &a, &e);
            mf_task_id prev = keys;
            for (int q = 0; q < 3 && e > a; q++) {
                mf_sg_task t = mf_sg_rec(L);
                t.i0 = i0 + a;
                t.i1 = i0 + e;
                t.n_tok = e - a;
                t.card = (int8_t)cd;
                t.part = p;
                t.block = (int8_t)(j && e0 > a0);
                t.dense = MF_SG_D_SCORES;
                if (q == 0) t.w.copy_bytes_tok = 4.0 * (ih * id + ih + 1);   /* queries, weights, count */
                SG_NAME(b, "dev%d L%d scores%s b%d", cd, L, what[q], j);
                mf_task_id x =
                    mf_sg_add(b, b->o->lane_dev0 + 3 * cd + q, MF_SG_DENSE_IN + q, MF_SG_PH_ATTN, kind_of[q], t);
                mf_sg_dep(b, prev, x);
                if (q == 0) mf_sg_dep(b, in0, x);   /* block 1's after block 0's (the table) */
                if (q == 0 && j == 0) in0 = x;
                prev = x;
            }
            if (e > a) mf_sg_dep(b, prev, join);
        }
    }
    return join;
}

/* ---- the heads on the host or the cards ----------------------------------------------------- */

/* The record of a heads task `op` of layer L over items [i0, i1) and heads [h0, h1) (n items in the
 * unit): MF_SG_ATTN_HEADS on the host; the cards' path MF_SG_ATTN_GATHER, MF_SG_ATTN_QPREP,
 * MF_SG_DENSE_IN / MF_SG_DENSE / MF_SG_DENSE_OUT of MF_SG_D_HEADS, MF_SG_ATTN_OPOST. The work of
 * the scores and values is positional (mf_sg_pos_flops); the key table is priced at the steady
 * state (the ring's rows before the chunk, the chunk's rows, top-k entries: a long chunk's union
 * of selections can be larger, up to its last item's visible entries). */
mf_sg_task mf_sg_heads_rec(const mf_config *c, int L, int op, int i0, int i1, int h0, int h1, int n, int exact)
{
    double D = c->head_dim, rd = c->qk_rope_head_dim, W = c->sliding_window, nh = c->n_heads;
    double keys = mf_sg_heads_keys(c, L), sel = c->compress_ratios[L] > 0 ? c->index_topk : 0, hh = h1 - h0;
    mf_sg_task t = mf_sg_rec(L);
    t.i0 = i0;
    t.i1 = i1;
    t.n_tok = i1 - i0;
    t.r0 = (int64_t)h0 * c->head_dim;
    t.r1 = (int64_t)h1 * c->head_dim;
    t.op = (uint8_t)op;
    switch (op) {
    case MF_SG_ATTN_HEADS:   /* each head: its query rounded twice, its output and the output's roped part */
        if (exact) {
            t.w.ref_flops = t.n_tok * hh * SG_W_ROUND * (3.0 * D + rd);
        } else {   /* mf_fa_attn_heads: the query's and the roped part's roundings 8 lanes at a time
                    * (mf_fa_heads_q, _o), the output's in the kernel at REF; the RoPE twice; scores
                    * and values as vector code */
            t.w.ref_flops = t.n_tok * hh * (SG_W_ROUND * D + SG_W_ROPE * 2.0 * rd);
            t.w.vec_flops = t.n_tok * hh * SG_W_ROUND_VEC * (2.0 * D + rd);
            t.w.extra_vec = 1;
        }
        break;
    case MF_SG_ATTN_GATHER:   /* the ring's rows and the entries unpacked, the sinks */
        t.n_tok = 1;
        t.w.ref_flops = SG_W_UNPACK * D * (W - 1 + sel) + nh;
        break;
    case MF_SG_ATTN_QPREP:   /* the queries rounded twice, 8 lanes at a time (mf_fa_heads_q), the RoPE, the key list;
                              * unpacked from qb's copy and packed for the heads' (mf_sg_attn_buf_bf16) */
        t.w.ref_flops = t.n_tok * (hh * SG_W_ROPE * rd + keys);
        t.w.vec_flops = t.n_tok * hh * D * (SG_W_ROUND_VEC * 2.0 + SG_W_CAST_VEC * 2.0 * mf_sg_attn_buf_bf16(MF_LY_A_Q));
        break;
    case MF_SG_DENSE_IN:   /* the queries, the key table (every card its own), the lists and sinks */
        t.dense = MF_SG_D_HEADS;
        t.w.copy_bytes = 4.0 * ((W - 1 + n + sel) * D + nh);
        t.w.copy_bytes_tok = mf_sg_attn_val_bytes(MF_LY_A_Q) * hh * D + 4.0 * (keys + 1);
        break;
    case MF_SG_DENSE:
        t.dense = MF_SG_D_HEADS;
        break;
    case MF_SG_DENSE_OUT:
        t.dense = MF_SG_D_HEADS;
        t.w.copy_bytes_tok = mf_sg_attn_val_bytes(MF_LY_A_O) * hh * D;
        break;
    case MF_SG_ATTN_OPOST:   /* the inverse RoPE, the outputs' roped part rounded 8 lanes at a time (mf_fa_heads_o);
                              * unpacked from the heads' copy and packed for oa's (mf_sg_attn_buf_bf16) */
        t.w.ref_flops = t.n_tok * hh * SG_W_ROPE * rd;
        t.w.vec_flops = t.n_tok * hh * (SG_W_ROUND_VEC * rd + SG_W_CAST_VEC * 2.0 * D * mf_sg_attn_buf_bf16(MF_LY_A_O));
        break;
    }
    return t;
}

/* A host heads record (MF_SG_ATTN_HEADS) with the attention's linears on cards: its heads' queries
 * unpacked from qb's bf16 copy, their outputs packed for oa's (mf_sg_attn_buf_bf16). */
void mf_sg_heads_host_cast(mf_sg_task *t)
{
    double vals = t->n_tok * (double)(t->r1 - t->r0);   /* r0, r1: the heads' rows of D each */
    t->w.vec_flops += vals * SG_W_CAST_VEC * (mf_sg_attn_buf_bf16(MF_LY_A_Q) + mf_sg_attn_buf_bf16(MF_LY_A_O));
}

int mf_sg_heads_local(const mf_config *c, int n_dense_cards, int split, int parts)
{
    int G = c->o_groups, nh = c->n_heads;
    if (parts < 1 || mf_sg_dense_parts(n_dense_cards, split, MF_SG_D_ATTN_OA) != parts) return 0;
    if (parts == 1) return 1;   /* both on the layer's dense card */
    if (G < 1 || nh % G || c->o_lora_rank < 1) return 0;
    int64_t R = c->o_lora_rank, r0, r1;
    for (int k = 0; k < parts; k++) {   /* card k's wo_a rows read its heads' groups, and only those */
        int h0, h1;
        mf_sg_heads_range(nh, parts, k, &h0, &h1);
        mf_sg_dense_rows(parts, k, (int64_t)G * R, &r0, &r1);
        if (r1 <= r0 || h1 <= h0 || r0 % R || r1 % R || r0 / R * (nh / G) != h0 || r1 / R * (nh / G) != h1) return 0;
    }
    return 1;
}

int mf_sg_heads_qlocal(const mf_config *c, int L, int n_dense_cards, int split, int parts)
{
    if (parts < 1 || L < 0 || L >= c->n_layers || mf_sg_layer_scored(c, L) ||
        mf_sg_dense_parts(n_dense_cards, split, MF_SG_D_ATTN_QB) != parts)
        return 0;
    if (parts == 1) return 1;   /* both on the layer's dense card */
    int64_t D = c->head_dim, r0, r1;
    for (int k = 0; k < parts; k++) {   /* card k's qb rows are its heads' queries, and only those */
        int h0, h1;
        mf_sg_heads_range(c->n_heads, parts, k, &h0, &h1);
        mf_sg_dense_rows(parts, k, (int64_t)c->n_heads * D, &r0, &r1);
        if (r1 <= r0 || h1 <= h0 || r0 != h0 * D || r1 != h1 * D) return 0;
    }
    return 1;
}

/* A heads record's work where its outputs (local: mf_sg_heads_local) or its queries (qlocal:
 * mf_sg_heads_qlocal) stay on the card: its copy-in the items' RoPE tables (qk_rope_head_dim floats
 * each), with qlocal no queries; its card work the inverse RoPE of its heads' roped parts and their
 * rounding (local), each query's rounding, its roped part's forward RoPE and rounding (qlocal), at
 * the card's REF rate; with qlocal the q prep only each item's key list and RoPE table (its cosines
 * and sines: an estimate, a RoPE's work). */
static void sg_heads_card_work(const mf_config *c, int local, int qlocal, mf_sg_task *t)
{
    double rd = c->qk_rope_head_dim, D = c->head_dim, hh = (double)(t->r1 - t->r0) / D;
    if (t->op == MF_SG_DENSE_IN && (local || qlocal)) t->w.copy_bytes_tok += 4.0 * rd;
    if (t->op == MF_SG_DENSE_IN && qlocal) t->w.copy_bytes_tok -= mf_sg_attn_val_bytes(MF_LY_A_Q) * hh * D;
    if (t->op == MF_SG_DENSE && local) t->w.ref_flops += t->n_tok * hh * rd * (SG_W_ROPE + SG_W_ROUND);
    if (t->op == MF_SG_DENSE && qlocal) t->w.ref_flops += t->n_tok * hh * (SG_W_ROUND * (D + rd) + SG_W_ROPE * rd);
    if (t->op == MF_SG_ATTN_QPREP && qlocal) {
        t->w.ref_flops = t->n_tok * ((double)mf_sg_heads_keys(c, t->layer) + SG_W_ROPE * rd);
        t->w.vec_flops = 0;
    }
}

/* The price of a heads record over its items at position pos. */
static double sg_heads_ns(const mf_config *c, const mf_cost_model *m, const mf_sg_task *t, int64_t pos)
{
    mf_sg_step_cost st = {.slot_tokens = 1, .pos_flops = mf_sg_pos_flops(c, t, 1, pos)};
    return mf_sg_task_ns(t, m, &st);
}

int mf_sg_heads_choice(const mf_sg_opts *o, int L)
{
    const mf_config *c = o->c;
    int nc = o->n_dense_cards, n = o->n, nh = c->n_heads, D = c->head_dim;
    int units = o->par || o->mixed ? o->n : 1;   /* a mixed graph of n >= 2: sequences at run time */
    if (nc < 1 || o->exact || units != 1 || o->heads == MF_SG_HEADS_HOST || L < 0 || L >= c->n_layers) return 0;
    if (D % 16 || D > MF_DEV_ATTN_MAX_D || c->qk_rope_head_dim / 2 > 64 ||
        mf_sg_heads_keys(c, L) > MF_DEV_ATTN_MAX_KEYS)
        return 0;
    if (o->heads == MF_SG_HEADS_CARDS) return nc;
    const mf_profile *p = o->profile ? o->profile : mf_cost_default_profile();
    mf_cost_model m = {.p = p, .host_bytes_per_s = mf_cost_thread_share(p, o->n_threads)};
    double W = o->n_threads > 0 ? o->n_threads : 1;
    int64_t pos = mf_sg_steady_pos(c);
    mf_sg_task host = mf_sg_heads_rec(c, L, MF_SG_ATTN_HEADS, 0, n, 0, nh, n, 0);
    mf_sg_heads_host_cast(&host);
    double best = sg_heads_ns(c, &m, &host, pos) / W;   /* the host's head tasks over the workers */
    int choice = 0;
    for (int parts = 1; parts <= nc; parts = parts < nc ? nc : nc + 1) {
        mf_sg_task g = mf_sg_heads_rec(c, L, MF_SG_ATTN_GATHER, 0, n, 0, nh, n, 0);
        mf_sg_task qp = mf_sg_heads_rec(c, L, MF_SG_ATTN_QPREP, 0, n, 0, nh, n, 0);
        mf_sg_task op = mf_sg_heads_rec(c, L, MF_SG_ATTN_OPOST, 0, n, 0, nh, n, 0);
        int local = mf_sg_heads_local(c, nc, o->dense_split, parts);   /* no o post, no copy out */
        int qlocal = mf_sg_heads_qlocal(c, L, nc, o->dense_split, parts);   /* no queries in */
        sg_heads_card_work(c, local, qlocal, &qp);
        double post = local ? 0 : sg_heads_ns(c, &m, &op, pos);
        double ns = sg_heads_ns(c, &m, &g, pos) + (sg_heads_ns(c, &m, &qp, pos) + post) / W;
        double chain = 0;
        for (int k = 0; k < parts; k++) {   /* the chains run side by side: the slowest card's */
            int h0, h1;
            mf_sg_heads_range(nh, parts, k, &h0, &h1);
            double x = 0;
            for (int q = MF_SG_DENSE_IN; q <= (local ? MF_SG_DENSE : MF_SG_DENSE_OUT); q++) {
                mf_sg_task r = mf_sg_heads_rec(c, L, q, 0, n, h0, h1, n, 0);
                sg_heads_card_work(c, local, qlocal, &r);
                x += sg_heads_ns(c, &m, &r, pos);
            }
            chain = x > chain ? x : chain;
        }
        if (ns + chain < best) best = ns + chain, choice = parts;
    }
    return choice;
}

/* Each oa task of group oa (the chains' first tasks: mf_sg_dense_chain) on card cd over items
 * meeting [j0, j1) after `run` (a card's heads over those items, its outputs left on the card). */
static void sg_heads_oa_dep(mf_sg_builder *b, mf_task_id run, int cd, int64_t j0, int64_t j1, mf_task_id oa)
{
    for (mf_task_id x = oa; x >= 0 && !b->rc; x = b->next_of[x]) {
        const mf_sg_task *t = &b->sg->task[x];
        if (t->card == cd && t->i0 < j1 && t->i1 > j0) b->rc = mf_graph_add_dep(b->sg->g, run, x);
    }
}

/* The heads of unit k of layer L on the cards (sg->heads_cards[L] of them): after `core`, the
 * gather -> per item group its q prep (after the qb tasks qb[0..n_oa) over its items) -> per card
 * copy in -> attention -> copy out -> per item group its o post, before `ring` and the oa stage's
 * tasks oa[0..n_oa). With the outputs left on the cards (sg->heads_local[L]) per card copy in ->
 * attention (and the inverse RoPE), each before `ring` and the oa work of its card and items (no
 * copy out, no o post). With the queries left on the cards (sg->heads_qlocal[L]) qb's copy-outs
 * after the gather (they copy nothing unless the host's fallback heads need the queries), the
 * heads' copy-in without queries, the attention rounding and roping them. */
void mf_sg_heads_on_cards(mf_sg_builder *b, int L, int k, mf_task_id core, mf_task_id ring, const mf_task_id *qb,
                          const mf_task_id *oa, int n_oa)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    int nh = c->n_heads, parts = sg->heads_cards[L], ex = b->o->exact, local = sg->heads_local[L];
    int qlocal = sg->heads_qlocal[L];
    int i0 = k > 0 ? sg->unit_end[k - 1] : 0, i1 = sg->unit_end[k], n = i1 - i0;
    int g0 = mf_sg_group_of(sg, i0), g1 = mf_sg_group_of(sg, i1 - 1) + 1;
    mf_task_id qp[MF_SG_MAX_GROUPS], out[MF_SG_MAX_CARDS * MF_SG_DENSE_MAX_BLOCKS];
    SG_NAME(b, "attn L%d gather", L);
    mf_task_id ga = mf_sg_add(b, 0, MF_SG_ATTN_GATHER, MF_SG_PH_ATTN, MF_SG_K_OTHER,
                              mf_sg_heads_rec(c, L, MF_SG_ATTN_GATHER, i0, i1, 0, nh, n, ex));
    mf_sg_dep(b, core, ga);
    for (int q = 0; q < n_oa && qlocal; q++)   /* qb's copy-outs (its queries for the host's fallback heads) */
        for (mf_task_id x = qb[q]; x >= 0 && !b->rc; x = b->next_of[x]) b->rc = mf_graph_add_dep(sg->g, ga, b->exit_of[x]);
    for (int i = g0; i < g1; i++) {
        SG_NAME(b, "attn L%d qprep item %d", L, i);
        mf_sg_task tq = mf_sg_heads_rec(c, L, MF_SG_ATTN_QPREP, i ? sg->group_end[i - 1] : 0, sg->group_end[i], 0, nh, n, ex);
        sg_heads_card_work(c, local, qlocal, &tq);
        qp[i] = mf_sg_add(b, 0, MF_SG_ATTN_QPREP, MF_SG_PH_ATTN, MF_SG_K_OTHER, tq);
        mf_sg_dep(b, ga, qp[i]);
        for (int q = 0; q < n_oa; q++)
            mf_sg_dep_items(b, qb[q], qp[i], i ? sg->group_end[i - 1] : 0, sg->group_end[i]);
    }
    static const int kind_of[3] = {MF_SG_K_COPY, MF_SG_K_OTHER, MF_SG_K_COPY_OUT};
    static const char *const what[3] = {"in", "", "out"};
    /* per card its item blocks (mf_sg_dense_blocks), each in -> heads -> out after the q preps of
     * the groups it overlaps; block 0's copy in the key table too (the blocks' copy-ins in order) */
    int nbk = mf_sg_dense_blocks(n, sg->dense_block);
    int64_t bi0[MF_SG_DENSE_MAX_BLOCKS], bi1[MF_SG_DENSE_MAX_BLOCKS];
    for (int j = 0; j < nbk; j++) {   /* n / nbk items or one more (mf_sg_dense_blocks: nbk <= n) */
        bi0[j] = i0 + (int64_t)n * j / nbk;
        bi1[j] = i0 + (int64_t)n * (j + 1) / nbk;
    }
    for (int p = 0; p < parts && !b->rc; p++) {
        int cd = parts > 1 ? p : mf_sg_dense_card_of(b->o, sg->n_dense_cards, L), h0, h1;
        mf_sg_heads_range(nh, parts, p, &h0, &h1);
        mf_task_id prev_in = -1;
        for (int j = 0; j < nbk && !b->rc; j++) {
            int j0 = (int)bi0[j], j1 = (int)bi1[j];
            mf_task_id prev = -1;
            for (int q = 0; q < 3 - local; q++) {
                mf_sg_task t = mf_sg_heads_rec(c, L, MF_SG_DENSE_IN + q, j0, j1, h0, h1, n, ex);
                sg_heads_card_work(c, local, qlocal, &t);
                t.card = (int8_t)cd;
                t.part = parts > 1 ? p : -1;
                t.block = (int8_t)j;
                if (j > 0) t.w.copy_bytes = 0;   /* the key table: block 0's */
                if (nbk > 1) SG_NAME(b, "dev%d L%d heads%s%s b%d", cd, L, q == 1 ? "" : " ", what[q], j);
                else SG_NAME(b, "dev%d L%d heads%s%s", cd, L, q == 1 ? "" : " ", what[q]);
                mf_task_id id =
                    mf_sg_add(b, b->o->lane_dev0 + 3 * cd + q, MF_SG_DENSE_IN + q, MF_SG_PH_ATTN, kind_of[q], t);
                if (q == 0) {
                    for (int i = g0; i < g1; i++) {   /* the q preps of the groups it overlaps */
                        int gi0 = i ? sg->group_end[i - 1] : 0, gi1 = sg->group_end[i];
                        if (gi0 < j1 && gi1 > j0) mf_sg_dep(b, qp[i], id);
                    }
                    mf_sg_dep(b, prev_in, id);
                    prev_in = id;
                } else {
                    mf_sg_dep(b, prev, id);
                }
                prev = id;
            }
            out[p * MF_SG_DENSE_MAX_BLOCKS + j] = prev;
            if (!local) continue;
            mf_sg_dep(b, prev, ring);
            for (int q = 0; q < n_oa; q++) sg_heads_oa_dep(b, prev, cd, bi0[j], bi1[j], oa[q]);
        }
    }
    for (int i = g0; i < g1 && !local; i++) {
        SG_NAME(b, "attn L%d opost item %d", L, i);
        mf_task_id op = mf_sg_add(b, 0, MF_SG_ATTN_OPOST, MF_SG_PH_ATTN, MF_SG_K_OTHER,
                                  mf_sg_heads_rec(c, L, MF_SG_ATTN_OPOST, i ? sg->group_end[i - 1] : 0,
                                                  sg->group_end[i], 0, nh, n, ex));
        int gi0 = i ? sg->group_end[i - 1] : 0, gi1 = sg->group_end[i];
        for (int p = 0; p < parts; p++)   /* the blocks it overlaps */
            for (int j = 0; j < nbk; j++)
                if (bi0[j] < gi1 && bi1[j] > gi0) mf_sg_dep(b, out[p * MF_SG_DENSE_MAX_BLOCKS + j], op);
        mf_sg_dep(b, op, ring);
        for (int q = 0; q < n_oa; q++) mf_sg_dep(b, op, oa[q]);
    }
}
