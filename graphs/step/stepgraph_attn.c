/* The attention sublayer of a layer (mf_sg_attn, between stepgraph_engram.c's gate and
 * stepgraph_moe.c's router): its input (collapse -> attn_norm, the mix), the linear stages in row
 * parts on the host or as dense chains on the cards (stepgraph_dense.c), the q path, per unit the
 * kv, the core (index scores, select) and the heads (stepgraph_heads.c), and its output (post ->
 * ffn_norm, the ffn mix). */
#include "graphs/step/stepgraph_impl.h"

#include <math.h>

#include "graphs/step/fast_attn.h"

/* Stage st of layer L on its card (split by rows: on every card, mf_sg_dense_chain), over all items:
 * its kernels (oa: the grouped wo_a as an fp8 kernel), their output roundings; in and qb copy
 * their input in and outputs out (qb none where the heads read its queries on the cards:
 * mf_sg_heads_qlocal), oa its input in (none where the heads left it on the card:
 * mf_sg_heads_local) (its output stays for ob; split by rows: out, and ob copies in the other
 * cards' rows, or all of them: mf_sg_ob_in_cols), ob its output out; the bf16 ones in 2 bytes a value (mf_sg_attn_buf_bf16). */
static mf_task_id sg_attn_card(mf_sg_builder *b, int L, int st)
{
    const mf_config *c = b->o->c;
    const mf_sg_layer_sizes *y = &b->o->sz->layer[L];
    int n = b->h1 - b->h0, rows = mf_sg_dense_parts(b->sg->n_dense_cards, b->sg->dense_split, MF_SG_D_ATTN_OA) > 1;
    mf_sg_task t = mf_sg_rec(L);
    t.stage = (int8_t)st;
    double in_tok = 0, out_tok = 0, out_bf = 0;
    if (st == MF_SG_ST_OA) {
        t.w.w_bytes[MF_KF_FP8] = y->oa_fp8_bytes;
        t.w.macs[MF_KF_FP8] = y->attn_ref_macs;
        t.w.calls[MF_KF_FP8] = 1;
        t.w.ref_flops = n * SG_W_ROUND * (double)c->o_groups * c->o_lora_rank;
        /* the heads' outputs in, unless the heads left them on the card (mf_sg_heads_local: its
         * work then waits for the heads of its items there) */
        int local = L < c->n_layers && b->sg->heads_local[L];
        in_tok = local ? 0 : mf_sg_attn_val_bytes(MF_LY_A_O) * c->n_heads * c->head_dim;
        if (rows) out_tok = 4.0 * y->st_out_rows[st];   /* each card's rows of wo_a out, all back in for wo_b */
        out_bf = mf_sg_attn_buf_bf16(MF_LY_A_Z) ? y->st_out_rows[st] : 0;
    } else {
        t.w.w_bytes[MF_KF_FP8] = y->st_fp8_bytes[st];
        t.w.macs[MF_KF_FP8] = y->st_fp8_macs[st];
        t.w.calls[MF_KF_FP8] = y->st_fp8_calls[st];
        t.w.w_bytes[MF_KF_BF16] = y->st_bf16_bytes[st];
        t.w.macs[MF_KF_BF16] = y->st_bf16_macs[st];
        t.w.calls[MF_KF_BF16] = y->st_bf16_calls[st];
        double rounds = st == MF_SG_ST_IN ? (double)c->q_lora_rank : st == MF_SG_ST_OB ? (double)c->hidden_size : 0;
        t.w.ref_flops = SG_W_ROUND * rounds * n;
        in_tok = st == MF_SG_ST_IN   ? mf_sg_attn_val_bytes(MF_LY_A_IN) * c->hidden_size
                 : st == MF_SG_ST_QB ? mf_sg_attn_val_bytes(MF_LY_A_QR) * c->q_lora_rank
                 : rows              ? mf_sg_attn_val_bytes(MF_LY_A_Z) * y->st_out_rows[MF_SG_ST_OA]
                                     : 0;
        out_tok = 4.0 * y->st_out_rows[st];
        /* bf16 rows of the output (mf_ly_attn_linears' order): in's low-rank query (wq_a's rows, first),
         * qb's queries (wq_b's rows, first) and the indexer's (idx_wq_b's, after them), ob's all */
        double nq = (double)c->n_heads * c->head_dim;
        if (st == MF_SG_ST_IN && mf_sg_attn_buf_bf16(MF_LY_A_QR)) out_bf = (double)c->q_lora_rank;
        if (st == MF_SG_ST_QB && mf_sg_attn_buf_bf16(MF_LY_A_Q))
            out_bf = mf_sg_attn_buf_bf16(MF_LY_A_QI) ? y->st_out_rows[st] : nq;
        if (st == MF_SG_ST_OB && mf_sg_attn_buf_bf16(MF_LY_A_OUT)) out_bf = y->st_out_rows[st];
    }
    static const int dense_of[4] = {MF_SG_D_ATTN_IN, MF_SG_D_ATTN_QB, MF_SG_D_ATTN_OA, MF_SG_D_ATTN_OB};
    mf_task_id head = mf_sg_dense_chain(b, L, dense_of[st], t, MF_SG_PH_ATTN, in_tok, out_tok, -1, out_bf);
    /* qb's queries left on the cards for the heads (mf_sg_heads_qlocal: its rows are theirs alone):
     * its copy-outs carry nothing (they stay for the host's fallback heads, which copy them out) */
    for (mf_task_id x = head; st == MF_SG_ST_QB && L < c->n_layers && b->sg->heads_qlocal[L] && x >= 0; x = b->next_of[x])
        if (b->sg->task[b->exit_of[x]].op == MF_SG_DENSE_OUT) b->sg->task[b->exit_of[x]].w.copy_bytes_tok = 0;
    return head;
}

/* Stage st's part p of layer L over all items: the stage's kernels split evenly over the parts
 * (oa: the reference's scalar grouped rows), their output roundings. */
static mf_task_id sg_attn_rows(mf_sg_builder *b, int L, int st, int p)
{
    static const char *const st_name[4] = {"in", "qb", "oa", "ob"};
    const mf_config *c = b->o->c;
    const mf_sg_layer_sizes *y = &b->o->sz->layer[L];
    int n = b->h1 - b->h0, parts = b->sg->p_attn;
    if (b->sg->n_dense_cards) return p == 0 ? sg_attn_card(b, L, st) : -1;
    SG_NAME(b, "attn L%d %s %d", L, st_name[st], p);
    mf_sg_task t = mf_sg_rec(L);
    t.stage = (int8_t)st;
    t.part = p;
    mf_sg_span(b, &t);
    if (st == MF_SG_ST_OA && b->o->exact) {   /* the reference's double sums */
        t.w.ref_flops = n * (SG_W_DOT_FP8 * y->attn_ref_macs + SG_W_ROUND * (double)c->o_groups * c->o_lora_rank) / parts;
    } else if (st == MF_SG_ST_OA) {   /* the FP8 kernels, one call per group of the part's rows */
        t.w.w_bytes[MF_KF_FP8] = y->oa_fp8_bytes / parts;
        t.w.macs[MF_KF_FP8] = y->attn_ref_macs / parts;
        t.w.calls[MF_KF_FP8] = c->o_groups > parts ? (double)c->o_groups / parts : 1;
        t.w.ref_flops = n * SG_W_ROUND * (double)c->o_groups * c->o_lora_rank / parts;
    } else {
        t.w.w_bytes[MF_KF_FP8] = y->st_fp8_bytes[st] / parts;
        t.w.macs[MF_KF_FP8] = y->st_fp8_macs[st] / parts;
        t.w.calls[MF_KF_FP8] = y->st_fp8_calls[st];
        t.w.w_bytes[MF_KF_BF16] = y->st_bf16_bytes[st] / parts;
        t.w.macs[MF_KF_BF16] = y->st_bf16_macs[st] / parts;
        t.w.calls[MF_KF_BF16] = y->st_bf16_calls[st];
        double rounds = st == MF_SG_ST_IN ? (double)c->q_lora_rank : st == MF_SG_ST_OB ? (double)c->hidden_size : 0;
        t.w.ref_flops = SG_W_ROUND * rounds * n / parts;
    }
    /* the part's rows of each linear are the engine's (mf_sg_stage_rows over the stage's linears);
     * its socket is the same for any row count */
    return mf_sg_add(b, mf_sg_rows_lane(b, 1, parts, p, NULL, NULL), MF_SG_ATTN_ROWS, MF_SG_PH_ATTN, MF_SG_K_OTHER, t);
}

/* The mix of layer L (`op`: attention or ffn) of item group i, in row parts (each part: the norm of
 * all streams, then its rows), after after[0..n_after) (group i's tasks it reads), into mix[]. With
 * mix blocks (mf_stepgraph.mix_groups > 1: a parallel or mixed graph of many items) the mix is one
 * per block of mix_groups groups of the micro-batch (from its first group): the block's first group
 * adds its tasks, over the block's items, and every group of the block adds its own dependencies, so
 * the mix's rows are read once per block, not per group. mixes[i] gets the tasks group i's readers
 * wait for. */
static void sg_mix(mf_sg_builder *b, int L, int i, int op, const mf_task_id *after, int n_after,
                   mf_task_id (*mixes)[SG_MAX_MIX])
{
    const mf_config *c = b->o->c;
    const mf_sg_layer_sizes *y = &b->o->sz->layer[L];
    const mf_stepgraph *sg = b->sg;
    int pm = sg->p_mix, mg = sg->mix_groups, first = (i - b->g0) % mg == 0;
    int gl = i - (i - b->g0) % mg, gh = gl + mg < b->g1 ? gl + mg : b->g1;   /* the block's groups [gl, gh) */
    mf_task_id *mix = mixes[i];
    double H = (double)c->hidden_size, hc = c->hc_mult, nm = (2.0 + hc) * hc;
    for (int m = 0; m < pm; m++) {
        if (!first) {   /* the block's */
            mix[m] = mixes[gl][m];
            for (int a = 0; a < n_after; a++) mf_sg_dep(b, after[a], mix[m]);
            continue;
        }
        SG_NAME(b, "%s L%d mix item %d %d", op == MF_SG_ATTN_MIX ? "attn" : "ffn", L, i, m);
        mf_sg_task t = mf_sg_part(sg, L, i, (int64_t)nm, pm, m, 1);
        t.i1 = sg->group_end[gh - 1];
        t.n_tok = t.i1 - t.i0;
        double f = (double)(t.r1 - t.r0) / nm;
        if (b->o->exact) {   /* the module's double sums, per item of the group */
            t.w.ref_flops = t.n_tok * (2.0 * hc * H + SG_W_MIX * y->hc_macs / 2 * f);
        } else {   /* mf_fa_hc_mixes_rows_items: the vector dots, the part's fp32 rows from memory once per */
            /* mf_fa_mix_items items; the blocked kernel (more than 4) reads each item's streams again */
            int R = (int)(t.r1 - t.r0), per = mf_fa_mix_items(c, R, t.n_tok);
            t.w.vec_flops = t.n_tok * (2.0 * hc * H + y->hc_macs / 2 * f);
            t.w.vec_bytes = ceil((double)t.n_tok / per) * 4.0 * y->hc_macs / 2 * f;
            if (per > MF_FA_MIX_FOURS) t.w.vec_bytes += t.n_tok * 4.0 * hc * H;
        }
        mix[m] = mf_sg_add(b, 0, op, MF_SG_PH_ATTN, MF_SG_K_OTHER, t);
        for (int a = 0; a < n_after; a++) mf_sg_dep(b, after[a], mix[m]);
    }
}

/* The attention's input: its stages' row parts (rows[st][p]: in, qb, oa, ob; on cards *oa_run the
 * oa chains' card works) and per item group of the micro-batch, after its unit's unit[] task, its
 * collapse -> attn_norm column parts (before the in parts) and the attention mix in row parts, into
 * amix[i]. */
static void sg_attn_in(mf_sg_builder *b, int L, const mf_task_id *unit, mf_task_id (*rows)[MF_SG_MAX_PARTS],
                       mf_task_id (*amix)[SG_MAX_MIX], mf_task_id *oa_run)
{
    mf_stepgraph *sg = b->sg;
    int pc = sg->p_hc;
    for (int st = 0; st < 4; st++)
        for (int p = 0; p < sg->p_attn; p++) {
            rows[st][p] = sg_attn_rows(b, L, st, p);
            if (st == MF_SG_ST_OA && p == 0) *oa_run = sg->n_dense_cards ? b->chain_run : -1;
        }
    for (int i = b->g0; i < b->g1; i++) {   /* item groups */
        mf_task_id nrm[MF_SG_MAX_PARTS], after[MF_SG_MAX_PARTS];
        int j0 = i ? sg->group_end[i - 1] : 0, j1 = sg->group_end[i], na = mf_sg_group_after(b, unit, i, after);
        mf_sg_collapse_norm(b, L, i, MF_SG_ATTN_NORM, MF_SG_PH_ATTN, after, na, nrm);
        for (int p = 0; p < pc; p++)   /* the in stage's item blocks (on cards) over group i's items */
            for (int q = 0; q < sg->p_attn; q++) mf_sg_dep_items(b, nrm[p], rows[MF_SG_ST_IN][q], j0, j1);
        sg_mix(b, L, i, MF_SG_ATTN_MIX, after, na, amix);
    }
}

/* wo_a's outputs exchanged between the cards (mf_sg_oa_exchange): each wo_b copy-in (the chains'
 * first tasks from ob) after each oa chain over items meeting its own (from oa, its card works from
 * run): that chain's copy out, or on its own card where the card keeps its rows (oa_kept) its oa
 * work; not after the oa join (block j's wo_b starts once block j's wo_a is everywhere). */
static void sg_attn_exchange(mf_sg_builder *b, mf_task_id oa, mf_task_id run, mf_task_id ob)
{
    const mf_sg_task *tk = b->sg->task;
    for (mf_task_id x = ob; x >= 0 && !b->rc; x = b->next_of[x]) {
        int k = tk[x].card;
        for (mf_task_id y = oa, r = run; y >= 0 && r >= 0 && !b->rc; y = b->next_of[y], r = b->next_of[r]) {
            if (tk[y].i0 >= tk[x].i1 || tk[y].i1 <= tk[x].i0) continue;
            int own = tk[y].card == k && b->sg->oa_kept[k];
            b->rc = mf_graph_add_dep(b->sg->g, own ? r : b->exit_of[y], x);
        }
    }
}

/* The q path: per item group the q norm's scale (after the in parts) -> its column parts, before the
 * qb parts. */
static void sg_attn_q(mf_sg_builder *b, int L, mf_task_id (*rows)[MF_SG_MAX_PARTS])
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    for (int i = b->g0; i < b->g1; i++) {   /* item groups: the q norm's scale -> its column parts */
        SG_NAME(b, "attn L%d q scale item %d", L, i);
        mf_sg_task t = mf_sg_part(sg, L, i, 1, 1, 0, 1);
        t.w.ref_flops = t.n_tok * 2.0 * c->q_lora_rank;
        if (sg->n_dense_cards && mf_sg_attn_buf_bf16(MF_LY_A_QR))   /* in's copy out unpacked */
            t.w.vec_flops = t.n_tok * SG_W_CAST_VEC * c->q_lora_rank;
        mf_task_id qs = mf_sg_add(b, 0, MF_SG_ATTN_QSCALE, MF_SG_PH_ATTN, MF_SG_K_OTHER, t);
        for (int p = 0; p < sg->p_attn; p++) mf_sg_dep_items(b, rows[MF_SG_ST_IN][p], qs, t.i0, t.i1);
        for (int q = 0; q < sg->p_qn; q++) {
            SG_NAME(b, "attn L%d q norm item %d %d", L, i, q);
            mf_sg_task tq = mf_sg_part(sg, L, i, c->q_lora_rank, sg->p_qn, q, 0);
            tq.w.ref_flops = tq.n_tok * (double)(tq.r1 - tq.r0) * (2.0 + 2.0 * SG_W_ROUND);
            if (sg->n_dense_cards && mf_sg_attn_buf_bf16(MF_LY_A_QR))   /* packed for qb's copy in */
                tq.w.vec_flops = tq.n_tok * (double)(tq.r1 - tq.r0) * SG_W_CAST_VEC;
            mf_task_id qn = mf_sg_add(b, 0, MF_SG_ATTN_QNORM, MF_SG_PH_ATTN, MF_SG_K_OTHER, tq);
            mf_sg_dep(b, qs, qn);
            for (int p = 0; p < sg->p_attn; p++) mf_sg_dep_items(b, qn, rows[MF_SG_ST_QB][p], tq.i0, tq.i1);
        }
    }
}

/* Unit k's kv after the in parts: each item its window KV (the four roundings of D: two mf_bf_n, 8
 * lanes under AVX2, the norm's and the fp8 fake-quant's at REF; its RoPE); each compressed entry
 * the compressor's kernels once (the indexer's wk on the entry: one per `ratio` items,
 * mf_ly_compress; ratio 2 in a step of one item: half an entry, the mean over steps). With the ring
 * written late (a serial graph of several item groups) the window KV runs per item group (part 0)
 * beside the compressor over the unit in item ranges (part 1: mf_sg_rows of p_attn, each range's
 * items in order), all before a join; in a mixed graph one task of both from the item before each
 * item (part 2: its sequences are the run's); else one task (part -1). Returns the join or the
 * task. */
static mf_task_id sg_attn_kv(mf_sg_builder *b, int L, int k, mf_task_id (*rows)[MF_SG_MAX_PARTS])
{
    const mf_config *c = b->o->c;
    const mf_sg_layer_sizes *y = &b->o->sz->layer[L];
    mf_stepgraph *sg = b->sg;
    double D = c->head_dim;
    mf_sg_task t = mf_sg_item(b, L, k);
    double ratio = c->compress_ratios[L];
    int gk0 = mf_sg_group_of(sg, t.i0), gk1 = mf_sg_group_of(sg, t.i1 - 1), split = sg->ring_late && gk1 > gk0;
    int n_cmp = !split ? 0 : ratio > 0 && mf_config_is_kv_source(c, L) ? sg->p_attn : 1;   /* compressor tasks */
    mf_task_id kv = -1;
    if (split) {
        SG_NAME(b, "attn L%d kv join", L);
        kv = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ATTN, MF_SG_K_OTHER, mf_sg_rec(L));
    }
    for (int w = split ? gk0 : 0; w <= (split ? gk1 + n_cmp : 0) && !b->rc; w++) {
        int comp = split && w > gk1;   /* a compressor task of the split: range w - gk1 - 1 */
        mf_sg_task tw = split && !comp ? mf_sg_part(sg, L, w, 0, 1, 0, 1) : t;
        if (comp) {
            int64_t r0, r1;
            mf_sg_rows(t.i1 - t.i0, n_cmp, w - gk1 - 1, &r0, &r1);
            if (r0 >= r1) continue;   /* the last ranges of a short unit: empty */
            tw.i0 = t.i0 + (int)r0;
            tw.i1 = t.i0 + (int)r1;
        }
        tw.part = split ? comp : sg->mixed ? 2 : -1;
        double items = tw.i1 - tw.i0, ent = ratio > 0 && tw.part != 0 ? items / ratio : 0;
        tw.n_tok = 1;
        tw.w.w_bytes[MF_KF_FP8] = ent * y->st_fp8_bytes[MF_SG_ST_CORE];
        tw.w.calls[MF_KF_FP8] = ent * y->st_fp8_calls[MF_SG_ST_CORE];
        tw.w.w_bytes[MF_KF_BF16] = ent * y->st_bf16_bytes[MF_SG_ST_CORE];
        tw.w.calls[MF_KF_BF16] = ent * y->st_bf16_calls[MF_SG_ST_CORE];
        if (tw.part != 1) {
            tw.w.ref_flops = items * (4.0 * D + SG_W_ROUND * 2.0 * D + SG_W_ROPE * c->qk_rope_head_dim);
            tw.w.vec_flops = items * SG_W_ROUND_VEC * 2.0 * D;
        }
        if (!split) SG_NAME(b, sg->par || sg->mixed ? "attn L%d kv item %d" : "attn L%d kv", L, k);
        else if (comp) SG_NAME(b, "attn L%d compress %d", L, w - gk1 - 1);
        else SG_NAME(b, "attn L%d kv %d", L, w);
        mf_task_id id = mf_sg_add(b, 0, MF_SG_ATTN_KV, MF_SG_PH_ATTN, MF_SG_K_OTHER, tw);
        for (int p = 0; p < sg->p_attn; p++)   /* window KV: its items' in blocks; a compressor range: all */
            if (comp) mf_sg_dep(b, rows[MF_SG_ST_IN][p], id);
            else mf_sg_dep_items(b, rows[MF_SG_ST_IN][p], id, tw.i0, tw.i1);
        if (split) mf_sg_dep(b, id, kv);
        else kv = id;
    }
    return kv;
}

/* Unit k's core (after its kv and the qb parts): the core's prep and the select, one task per unit
 * when ordered (the hooks in item order), else one per item group, each group's heads after its
 * own; on scored layers the index scores in parts per item group (or on the cards), then the
 * select. gate[i] of each of the unit's item groups i gets the task its heads wait for. On a layer
 * not scored with its heads on the cards the core reads nothing of qb's (no index query, the
 * selection its source's): not after the qb parts, whose blocks each q prep waits for instead
 * (mf_sg_heads_on_cards), so the heads' copy-ins start with qb's first blocks out. */
static void sg_attn_core(mf_sg_builder *b, int L, int k, mf_task_id kv, mf_task_id (*rows)[MF_SG_MAX_PARTS],
                         mf_task_id *gate)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    int index = mf_sg_layer_scored(c, L);
    mf_sg_task t = mf_sg_item(b, L, k);
    int gu0 = mf_sg_group_of(sg, t.i0), gu1 = mf_sg_group_of(sg, t.i1 - 1), whole = b->o->ordered;
    for (int i = gu0; i <= gu1; i++) {
        int solo = whole ? i == gu0 : 1;   /* a task of its own: whole unit, or group i */
        if (solo) {
            SG_NAME(b, sg->par || sg->mixed ? "attn L%d core item %d" : whole ? "attn L%d core" : "attn L%d core %d", L,
                    sg->par || sg->mixed ? k : i);
            mf_sg_task tc = whole ? mf_sg_item(b, L, k) : mf_sg_part(sg, L, i, 0, 1, 0, 1);
            tc.part = -1;
            tc.n_tok = 1;   /* the index query: not priced (as before the split) */
            if (sg->n_dense_cards && index && mf_sg_attn_buf_bf16(MF_LY_A_QI))   /* its queries unpacked */
                tc.w.vec_flops = (double)(tc.i1 - tc.i0) * c->index_n_heads * c->index_head_dim * SG_W_CAST_VEC;
            gate[i] = mf_sg_add(b, 0, MF_SG_ATTN_CORE, MF_SG_PH_ATTN, MF_SG_K_OTHER, tc);
            mf_sg_dep(b, kv, gate[i]);
            for (int p = 0; p < sg->p_attn && (index || !sg->heads_cards[L]); p++)
                mf_sg_dep(b, rows[MF_SG_ST_QB][p], gate[i]);
        } else {
            gate[i] = gate[gu0];
        }
    }
    if (index) {   /* the index scores in parts per item group, then the select, before the heads */
        mf_task_id sel = -1, cards = sg->scores_cards[L] ? mf_sg_scores_on_cards(b, L, k, gate, gu0, gu1) : -1;
        for (int i = gu0; i <= gu1; i++) {
            mf_task_id core = gate[i];
            if (!whole || i == gu0) {
                SG_NAME(b, sg->par || sg->mixed ? "attn L%d select item %d" : whole ? "attn L%d select" : "attn L%d select %d",
                        L, sg->par || sg->mixed ? k : i);
                mf_sg_task ts = whole ? mf_sg_item(b, L, k) : mf_sg_part(sg, L, i, 0, 1, 0, 1);
                ts.part = -1;
                ts.n_tok = 1;
                sel = mf_sg_add(b, 0, MF_SG_ATTN_SELECT, MF_SG_PH_ATTN, MF_SG_K_OTHER, ts);
                mf_sg_dep(b, cards, sel);
            }
            for (int q = 0; q < sg->key_parts[i] && cards < 0; q++) {
                SG_NAME(b, "attn L%d score item %d %d", L, i, q);
                mf_sg_task tk = mf_sg_rec(L);
                tk.i0 = i ? sg->group_end[i - 1] : 0;
                tk.i1 = sg->group_end[i];
                tk.n_tok = tk.i1 - tk.i0;
                tk.part = q;
                tk.w.extra_vec = !b->o->exact;   /* mf_fa_index_scores: the vector dots */
                mf_task_id sc = mf_sg_add(b, 0, MF_SG_ATTN_SCORE, MF_SG_PH_ATTN, MF_SG_K_OTHER, tk);
                mf_sg_dep(b, core, sc);
                mf_sg_dep(b, sc, sel);
            }
            gate[i] = sel;
        }
        for (int i = gu0; whole && i <= gu1; i++) gate[i] = sel;
    }
}

/* Unit k's heads after gate[] (its item groups'): [the ring ->] per item group its head groups on the
 * host, or the heads on the cards (mf_sg_heads_on_cards, after a join of the selects), before the oa
 * parts. Returns the ring task (ring_late), which the post waits for, or -1: after the unit's heads,
 * in a mixed graph after every head of the layer (the oa join oj: a sequence's items may lie in
 * other units). */
static mf_task_id sg_attn_heads(mf_sg_builder *b, int L, int k, const mf_task_id *gate,
                                mf_task_id (*rows)[MF_SG_MAX_PARTS], mf_task_id oj)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    int pa = sg->p_ah;
    double D = c->head_dim, nh = c->n_heads;
    mf_sg_task t = mf_sg_item(b, L, k);
    int gu0 = mf_sg_group_of(sg, t.i0), gu1 = mf_sg_group_of(sg, t.i1 - 1), whole = b->o->ordered;
    mf_task_id ring = -1;
    if (sg->ring_late) {
        SG_NAME(b, "attn L%d ring", L);
        mf_sg_task tr = mf_sg_item(b, L, k);
        tr.n_tok = 1;
        tr.w.ref_flops = (double)(t.i1 - t.i0) * D;
        ring = mf_sg_add(b, 0, MF_SG_ATTN_RING, MF_SG_PH_ATTN, MF_SG_K_OTHER, tr);
        if (sg->mixed) mf_sg_dep(b, oj, ring);
    }
    if (sg->heads_cards[L]) {
        /* the gather reads every item's selection: after all the unit's selects */
        mf_task_id sj = gate[gu0];
        if (gu1 > gu0 && !whole) {
            SG_NAME(b, "attn L%d select join", L);
            sj = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ATTN, MF_SG_K_OTHER, mf_sg_rec(L));
            for (int i = gu0; i <= gu1; i++) mf_sg_dep(b, gate[i], sj);
        }
        mf_sg_heads_on_cards(b, L, k, sj, ring, rows[MF_SG_ST_QB], rows[MF_SG_ST_OA], sg->p_attn);
        return ring;
    }
    for (int i = gu0; i <= gu1; i++)   /* the unit's groups */
        for (int g = 0; g < pa; g++) {
            SG_NAME(b, "attn L%d heads item %d %d", L, i, g);
            int h0 = g * sg->ah_heads, h1 = h0 + sg->ah_heads < (int)nh ? h0 + sg->ah_heads : (int)nh;
            mf_sg_task th = mf_sg_heads_rec(c, L, MF_SG_ATTN_HEADS, i ? sg->group_end[i - 1] : 0, sg->group_end[i], h0,
                                            h1, t.i1 - t.i0, b->o->exact);
            th.part = g;
            if (sg->n_dense_cards) mf_sg_heads_host_cast(&th);
            mf_task_id hd = mf_sg_add(b, 0, MF_SG_ATTN_HEADS, MF_SG_PH_ATTN, MF_SG_K_OTHER, th);
            mf_sg_dep(b, gate[i], hd);
            if (!sg->mixed) mf_sg_dep(b, hd, ring);
            for (int p = 0; p < sg->p_attn; p++) mf_sg_dep(b, hd, rows[MF_SG_ST_OA][p]);
        }
    return ring;
}

/* The attention's output: per unit its post join, into post[]; per item group the post column parts
 * (after the ob parts, its attention mix amix[i] and its unit's ring[]) -> ffn_norm column parts ->
 * its unit's post join, and the ffn mix in row parts (for the combine: b->fmix). */
static void sg_attn_out(mf_sg_builder *b, int L, mf_task_id (*rows)[MF_SG_MAX_PARTS], mf_task_id (*amix)[SG_MAX_MIX],
                        const mf_task_id *ring, mf_task_id *post)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    int pc = sg->p_hc, pm = sg->p_mix;
    double H = (double)c->hidden_size, hc = c->hc_mult;
    double sink = c->hc_sinkhorn_iters * 4.0 * hc * hc * 2;
    for (int k = b->k0; k < b->k1; k++) {
        SG_NAME(b, sg->par || sg->mixed ? "attn L%d post join item %d" : "attn L%d post join", L, k);
        post[k] = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ATTN, MF_SG_K_OTHER, mf_sg_rec(L));
    }
    for (int i = b->g0; i < b->g1; i++) {   /* item groups */
        int u = mf_sg_group_unit(sg, i);
        mf_task_id pst[MF_SG_MAX_PARTS], fin = post[u];
        for (int p = 0; p < pc; p++) {
            SG_NAME(b, "attn L%d post item %d %d", L, i, p);
            mf_sg_task t = mf_sg_part(sg, L, i, (int64_t)H, pc, p, 0);
            double cols = (double)(t.r1 - t.r0);
            /* the split of the mixes, per column the expand (rounded) and the collapse (rounded):
             * the module's loops (exact) or fast_attn.c's vector ones */
            if (b->o->exact) {
                t.w.ref_flops = t.n_tok * (sink + cols * (hc * (1 + hc) + hc * SG_W_ROUND + hc + SG_W_ROUND));
            } else {
                t.w.ref_flops = t.n_tok * sink;
                t.w.vec_flops = t.n_tok * cols * hc * (SG_W_EXPAND_VEC + SG_W_COLLAPSE_VEC);
            }
            if (sg->n_dense_cards && mf_sg_attn_buf_bf16(MF_LY_A_OUT))
                t.w.vec_flops += t.n_tok * cols * SG_W_CAST_VEC;   /* ob's output columns unpacked */
            pst[p] = mf_sg_add(b, 0, MF_SG_ATTN_POST, MF_SG_PH_ATTN, MF_SG_K_OTHER, t);
            for (int q = 0; q < sg->p_attn; q++) mf_sg_dep_items(b, rows[MF_SG_ST_OB][q], pst[p], t.i0, t.i1);
            for (int m = 0; m < pm; m++) mf_sg_dep(b, amix[i][m], pst[p]);
        }
        mf_sg_dep(b, ring[u], fin);   /* the unit's attention done: its ring too (the post reads none of it) */
        for (int p = 0; p < pc; p++) {
            SG_NAME(b, "attn L%d ffn norm item %d %d", L, i, p);
            mf_sg_task t = mf_sg_part(sg, L, i, (int64_t)H, pc, p, 0);
            double cols = (double)(t.r1 - t.r0);
            mf_sg_norm_price(b, &t, H, cols);
            if (sg->n_dense_cards && mf_sg_dense_bf16(MF_SG_D_GATE, 0))
                t.w.vec_flops += t.n_tok * cols * SG_W_CAST_VEC;   /* packed for the gate's copy */
            mf_task_id fn = b->fnorm[i][p] = mf_sg_add(b, 0, MF_SG_FFN_NORM, MF_SG_PH_ATTN, MF_SG_K_OTHER, t);
            for (int q = 0; q < pc; q++) mf_sg_dep(b, pst[q], fn);
            mf_sg_dep(b, fn, fin);
        }
        /* the ffn mix: for the combine, beside the MoE */
        sg_mix(b, L, i, MF_SG_FFN_MIX, pst, pc, b->fmix);
    }
}

/* The attention sublayer of layer L. Per item after unit[] (its unit's): collapse -> attn_norm
 * column parts, and the attention mix in row parts; in parts -> per item group q scale -> q norm
 * column parts -> qb parts; in parts -> per unit kv (window KV, compressor: beside the q path)
 * [-> kv join: a mixed graph] -> per unit core prep (after kv and qb) -> per item head groups
 * [-> per unit ring: after the unit's heads, a mixed graph's after the oa join] -> oa parts ->
 * oa join -> ob parts (wo_a's outputs exchanged between cards: per block, sg_attn_exchange); per item post column parts (after ob, its mix, its unit's ring) -> ffn_norm
 * column parts -> per unit post join, into post[]; the ffn mix in row parts (for the combine:
 * b->fmix). */
void mf_sg_attn(mf_sg_builder *b, int L, const mf_task_id *unit, mf_task_id *post)
{
    mf_stepgraph *sg = b->sg;
    mf_task_id rows[4][MF_SG_MAX_PARTS], amix[MF_SG_MAX_GROUPS][SG_MAX_MIX], ring[MF_SG_MAX_GROUPS];
    mf_task_id gate[MF_SG_MAX_GROUPS];   /* per item group: the task its heads wait for (core or select) */
    mf_task_id oa_run = -1;
    sg_attn_in(b, L, unit, rows, amix, &oa_run);
    sg_attn_q(b, L, rows);
    SG_NAME(b, "attn L%d oa join", L);
    mf_task_id oj = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ATTN, MF_SG_K_OTHER, mf_sg_rec(L));
    for (int p = 0; p < sg->p_attn; p++) {
        mf_sg_dep(b, rows[MF_SG_ST_OA][p], oj);
        if (!sg->oa_x) mf_sg_dep(b, oj, rows[MF_SG_ST_OB][p]);
    }
    if (sg->oa_x) sg_attn_exchange(b, rows[MF_SG_ST_OA][0], oa_run, rows[MF_SG_ST_OB][0]);
    mf_task_id kvj = -1;   /* a mixed graph: every kv before any core (a sequence's items may lie in other units) */
    if (sg->mixed) {
        SG_NAME(b, "attn L%d kv join", L);
        kvj = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ATTN, MF_SG_K_OTHER, mf_sg_rec(L));
    }
    for (int k = b->k0; k < b->k1; k++) {
        if (L >= b->o->c->n_layers) {   /* a draft stage: the block's KV and heads (stepgraph_draft.c) */
            ring[k] = mf_sg_draft_core(b, L, k, rows);
            continue;
        }
        mf_task_id kv = sg_attn_kv(b, L, k, rows);
        mf_sg_dep(b, kv, kvj);
        sg_attn_core(b, L, k, sg->mixed ? kvj : kv, rows, gate);
        ring[k] = sg_attn_heads(b, L, k, gate, rows, oj);
    }
    sg_attn_out(b, L, rows, amix, ring, post);
}
