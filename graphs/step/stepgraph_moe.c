/* The MoE sublayer of a layer (mf_sg_moe, after stepgraph_attn.c's post joins): the router (gate
 * parts or its dense chain on a card -> [top-k parts] -> route -> [row gather parts]), the expert
 * slots ([reads] -> up parts -> join -> down parts on the host, per card in -> ffn -> out), the
 * shared expert, the MoE done, and the per item group combine into the streams. Placement and
 * prefetch of the experts: stepgraph_place.c. */
#include "graphs/step/stepgraph_impl.h"

#include <math.h>

#include "device/expert_cache.h"

/* The router of layer L: gate parts over all items (after post[]) -> route. Returns route. */
static mf_task_id sg_router(mf_sg_builder *b, int L, const mf_task_id *post)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    int n = b->h1 - b->h0, K = mf_config_layer_topk(c, L), E = mf_config_layer_experts(c, L), pg = sg->p_gather;
    double H = (double)c->hidden_size;
    SG_NAME(b, "route L%d", L);
    mf_sg_task t = mf_sg_rec(L);
    mf_sg_span(b, &t);
    /* top-k and tables; the gather of the n K rows (a copy and a quantize: 2 per value) here with
     * one part, else in its parts; with gather parts and the items in any order (no hooks) the
     * top-k too, in as many item ranges before it (the route's part p >= 0: the items' top-k only) */
    int pt = sg->route_topk ? (pg < n ? pg : n) : 0;
    t.w.ref_flops = n * ((pg > 1 ? 0 : H * K * 2.0) + (pt ? 2.0 * K : 4.0 * E));
    mf_task_id ro = mf_sg_add(b, 0, MF_SG_ROUTE, MF_SG_PH_MOE, MF_SG_K_OTHER, t), tk[MF_SG_MAX_PARTS];
    b->route = ro;
    for (int p = 0; p < pt; p++) {
        SG_NAME(b, "route L%d topk %d", L, p);
        mf_sg_task tp = mf_sg_rec(L);
        tp.i0 = b->h0 + (int)((int64_t)n * p / pt);
        tp.i1 = b->h0 + (int)((int64_t)n * (p + 1) / pt);
        tp.n_tok = tp.i1 - tp.i0;
        tp.part = p;
        tp.w.ref_flops = tp.n_tok * 4.0 * E;
        tk[p] = mf_sg_add(b, 0, MF_SG_ROUTE, MF_SG_PH_MOE, MF_SG_K_OTHER, tp);
        mf_sg_dep(b, tk[p], ro);
    }
    if (sg->prefetch) mf_sg_dep(b, b->pre_place, ro);   /* mf_step_place_pre reads the place task's cards */
    if (pg > 1) {   /* route -> row parts -> rows join: what the slots' work waits for */
        SG_NAME(b, "route L%d rows join", L);
        mf_task_id rj = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_MOE, MF_SG_K_OTHER, mf_sg_rec(L));
        for (int p = 0; p < pg; p++) {
            SG_NAME(b, "route L%d rows %d", L, p);
            mf_sg_task tg = mf_sg_rec(L);
            mf_sg_span(b, &tg);
            tg.part = p;
            tg.w.ref_flops = n * H * K * 2.0 / pg + n * K;   /* its rows' copy and quantize; the scan of all n K */
            mf_task_id gt = mf_sg_add(b, 0, MF_SG_ROUTE_ROWS, MF_SG_PH_MOE, MF_SG_K_OTHER, tg);
            mf_sg_dep(b, ro, gt);
            mf_sg_dep(b, gt, rj);
        }
        b->rows = rj;
    } else
        b->rows = ro;
    if (sg->n_dense_cards) {   /* on the layer's card: MoE input in, the gate (bf16), logits out */
        t = mf_sg_rec(L);
        double gb = b->o->sz->layer[L].gate_bytes;
        t.w.w_bytes[MF_KF_BF16] = gb;
        t.w.macs[MF_KF_BF16] = H * E;
        t.w.calls[MF_KF_BF16] = 1;
        double vin = mf_sg_dense_bf16(MF_SG_D_GATE, 0) ? 2.0 : 4.0;
        mf_task_id gp = mf_sg_dense_chain(b, L, MF_SG_D_GATE, t, MF_SG_PH_MOE, vin * H, 4.0 * E, -1, 0);
        b->moe_in = gp;
        b->moe_gate = b->chain_run;
        for (int i = b->g0; i < b->g1; i++)   /* each item block of the gate after the ffn_norms of its items */
            for (int p = 0; p < sg->p_hc; p++)
                mf_sg_dep_items(b, b->fnorm[i][p], gp, i ? sg->group_end[i - 1] : 0, sg->group_end[i]);
        for (int k = b->k0; k < b->k1; k++) mf_sg_dep(b, post[k], ro);
        mf_sg_dep(b, gp, ro);
        for (int p = 0; p < pt; p++) mf_sg_dep(b, gp, tk[p]);
        return ro;
    }
    for (int p = 0; p < sg->p_attn; p++) {
        SG_NAME(b, "gate L%d %d", L, p);
        t = mf_sg_rec(L);
        t.part = p;
        mf_sg_span(b, &t);
        int ln = mf_sg_rows_lane(b, E, sg->p_attn, p, &t.r0, &t.r1);
        t.w.ref_flops = n * SG_W_DOT_BF16 * H * (double)(t.r1 - t.r0);
        mf_task_id gp = mf_sg_add(b, ln, MF_SG_GATE_ROWS, MF_SG_PH_MOE, MF_SG_K_OTHER, t);
        for (int k = b->k0; k < b->k1; k++) mf_sg_dep(b, post[k], gp);
        mf_sg_dep(b, gp, ro);
        for (int q = 0; q < pt; q++) mf_sg_dep(b, gp, tk[q]);
    }
    return ro;
}

/* Slot s of layer L on card cd: in -> ffn (or the card's FFN graph cffn) -> out, between the
 * slot's reads and gathered rows (b->rows) and done. */
static void sg_slot_card(mf_sg_builder *b, int L, int s, int cd, mf_task_id cffn, mf_task_id done)
{
    const mf_config *c = b->o->c;
    const mf_sg_sizes *z = b->o->sz;
    mf_stepgraph *sg = b->sg;
    double H = (double)c->hidden_size, I = (double)c->moe_intermediate_size;
    int lane = b->o->lane_dev0 + 3 * cd;
    mf_task_id *tid = sg->slot_tid + ((size_t)L * sg->n_slots + s) * sg->tid_per_slot + 2 * sg->p_exp + 1 + 3 * cd;
    mf_sg_task t = mf_sg_rec(L);
    t.slot = s;
    t.card = (int8_t)cd;
    t.slot_tokens = 1;
    SG_NAME(b, "dev%d L%d slot %d in", cd, L, s);
    mf_sg_task ti = t;
    ti.w.copy_bytes = z->xslot_bytes;
    ti.w.copies = b->o->miss_copies > 0 ? b->o->miss_copies : MF_SG_EXPERT_PARTS;
    ti.gather = (int8_t)sg->slot_gather;
    ti.w.copy_bytes_tok = sg->slot_gather ? 0 : mf_sg_slot_tok_bytes(c, 0);
    mf_task_id din = mf_sg_add(b, lane, MF_SG_DEV_IN, MF_SG_PH_MOE, MF_SG_K_COPY, ti);
    mf_task_id dff = cffn;
    if (!sg->dev_graphs) {
        SG_NAME(b, "dev%d L%d slot %d ffn", cd, L, s);
        mf_sg_task tf = t;
        tf.w.w_bytes[MF_KF_FP4] = z->up_bytes + z->down_bytes;
        tf.w.macs[MF_KF_FP4] = 3 * H * I;
        tf.w.calls[MF_KF_FP4] = 1;
        dff = mf_sg_add(b, lane + 1, MF_SG_DEV_FFN, MF_SG_PH_MOE, MF_SG_K_DEV, tf);
    }
    SG_NAME(b, "dev%d L%d slot %d out", cd, L, s);
    mf_sg_task to = t;
    to.w.copy_bytes_tok = mf_sg_slot_tok_bytes(c, 1);
    mf_task_id dout = mf_sg_add(b, lane + 2, MF_SG_DEV_OUT, MF_SG_PH_MOE, MF_SG_K_COPY_OUT, to);
    tid[0] = din;
    tid[1] = sg->dev_graphs ? -1 : dff;
    tid[2] = dout;
    /* the rows' join even when its copy of their items follows it (slot_gather): mf_sg_pre_ranks
     * ranks the slot's joins by it, above the host's experts */
    mf_sg_dep(b, b->rows, din);
    if (sg->slot_gather) mf_sg_dep(b, b->dev_rows[cd], din);
    if (sg->prefetch) {   /* the expert is in (mf_sg_prefetch's order): the rows only */
        int E = c->n_routed_experts, f = s;
        while (f < E && mf_dev_xcache_owner(sg->n_cards, L, f) != cd) f++;
        mf_sg_dep(b, f < E ? b->pre_sfx[f] : b->pre_join[cd], din);
    }
    for (int j = 0; j < sg->n_io_parts; j++) mf_sg_dep(b, b->io[(size_t)s * sg->n_io_parts + j], din);
    mf_sg_dep(b, din, dff);
    mf_sg_dep(b, dff, dout);
    mf_sg_dep(b, dout, done);
}

/* Slot s of layer L: [reads] -> up parts -> join -> down parts on the host, and per card its
 * device tasks, between route (the reads) or its gathered rows (b->rows: the work) and done. */
static void sg_slot(mf_sg_builder *b, int L, int s, mf_task_id ro, const mf_task_id *cffn, mf_task_id done)
{
    const mf_config *c = b->o->c;
    const mf_sg_sizes *z = b->o->sz;
    mf_stepgraph *sg = b->sg;
    double H = (double)c->hidden_size, I = (double)c->moe_intermediate_size;
    int np = sg->n_io_parts, pe = sg->p_exp;
    int win = b->o->read_window ? b->o->read_window : 2;
    mf_task_id *tid = sg->slot_tid + ((size_t)L * sg->n_slots + s) * sg->tid_per_slot;
    mf_sg_task t = mf_sg_rec(L);
    t.slot = s;
    t.slot_tokens = 1;
    SG_NAME(b, "expert L%d slot %d join", L, s);
    mf_sg_task tj = t;
    tj.w.ref_flops_tok = 2.0 * I;
    mf_task_id jo = tid[2 * pe] = mf_sg_add(b, 0, MF_SG_SLOT_JOIN, MF_SG_PH_MOE, MF_SG_K_EXPERT, tj);
    mf_task_id *io = b->io + (size_t)s * np;
    for (int j = 0; j < np; j++) {
        SG_NAME(b, "read L%d slot %d part %d", L, s, j);
        mf_sg_task tr = t;
        tr.slot_tokens = 0;
        tr.read = (int16_t)j;
        tr.w.io_bytes = ceil(z->part_bytes[j] / SG_STORE_ALIGN) * SG_STORE_ALIGN;
        tr.w.io_reads = 1;
        io[j] = mf_sg_add(b, b->o->lane_io, MF_SG_SLOT_READ, MF_SG_PH_MOE, MF_SG_K_IO, tr);
        mf_sg_dep(b, ro, io[j]);
        /* read window: slot s's reads start once slot s - win's are in, so that the first
         * slots' experts arrive early and their compute overlaps the later reads */
        int first = b->sg->half_slot[b->h];   /* the half's first slot */
        for (int i = 0; win > 0 && s - first >= win && i < np; i++)
            mf_sg_dep(b, b->io[(size_t)(s - win) * np + i], io[j]);
    }
    /* each part on the lane of the socket whose memory holds its rows (mf_sg_expert_rows) */
    int S = b->o->n_sockets > 1 && b->o->lane_sock ? b->o->n_sockets : 1;
    for (int p = 0; p < pe; p++) {
        SG_NAME(b, "expert L%d slot %d up %d", L, s, p);
        mf_sg_task tu = t;
        tu.part = p;
        int k = mf_sg_expert_rows((int64_t)I, pe, S, p, &tu.r0, &tu.r1), ln = S > 1 ? b->o->lane_sock[k] : 0;
        tu.w.w_bytes[MF_KF_FP4] = z->up_bytes / pe;
        tu.w.macs[MF_KF_FP4] = 2 * H * I / pe;
        tu.w.calls[MF_KF_FP4] = 1;
        mf_task_id up = tid[p] = mf_sg_add(b, ln, MF_SG_SLOT_UP, MF_SG_PH_MOE, MF_SG_K_EXPERT, tu);
        SG_NAME(b, "expert L%d slot %d down %d", L, s, p);
        mf_sg_task td = t;
        td.part = p;
        mf_sg_expert_rows((int64_t)H, pe, S, p, &td.r0, &td.r1);
        td.w.w_bytes[MF_KF_FP4] = z->down_bytes / pe;
        td.w.macs[MF_KF_FP4] = H * I / pe;
        td.w.calls[MF_KF_FP4] = 1;
        td.w.ref_flops_tok = SG_W_ROUND * H / pe;   /* each output rounded to bf16 */
        mf_task_id dn = tid[pe + p] = mf_sg_add(b, ln, MF_SG_SLOT_DOWN, MF_SG_PH_MOE, MF_SG_K_EXPERT, td);
        mf_sg_dep(b, b->rows, up);
        for (int j = 0; j < np; j++) mf_sg_dep(b, io[j], up);
        mf_sg_dep(b, up, jo);
        mf_sg_dep(b, jo, dn);
        mf_sg_dep(b, dn, done);
    }
    for (int cd = 0; cd < sg->n_cards; cd++) sg_slot_card(b, L, s, cd, sg->dev_graphs ? cffn[cd] : -1, done);
}

/* The shared expert of layer L: up parts (after post[], and route with a store) -> join -> down
 * parts -> done. */
static void sg_shared(mf_sg_builder *b, int L, const mf_task_id *post, mf_task_id ro, mf_task_id done)
{
    const mf_config *c = b->o->c;
    const mf_sg_sizes *z = b->o->sz;
    mf_stepgraph *sg = b->sg;
    int n = b->h1 - b->h0, ps = sg->p_sh;
    double H = (double)c->hidden_size, I = (double)c->moe_intermediate_size;
    if (sg->n_dense_cards && ps > 0) {   /* on the layer's card, after the gate's copy of the input */
        mf_sg_task t = mf_sg_rec(L);
        t.w.w_bytes[MF_KF_FP8] = z->sh_up_bytes + z->sh_down_bytes;
        t.w.macs[MF_KF_FP8] = 3 * H * z->sh_rows;
        t.w.calls[MF_KF_FP8] = 2;
        t.w.ref_flops = SG_W_ROUND * H * n;
        mf_task_id sc = mf_sg_dense_chain(b, L, MF_SG_D_SHARED, t, MF_SG_PH_MOE, 0, 4.0 * H, b->moe_in,
                                          mf_sg_dense_bf16(MF_SG_D_SHARED, 1) ? H : 0);
        /* the gate first on the card: the routed experts wait for its logits, the shared expert's
         * output only at the layer's end (the upward ranks alone, even from the cost model's
         * prices, put the shared expert first on the built-in machine at batch 16: a critical path
         * counts one slot's chain after the route, not the slots' work sharing the workers) */
        mf_sg_dense_after(b, b->moe_gate, b->chain_run);
        mf_sg_dep(b, sc, done);
        return;
    }
    (void)I;
    SG_NAME(b, "shared L%d join", L);
    mf_task_id sj = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_MOE, MF_SG_K_OTHER, mf_sg_rec(L));
    for (int p = 0; p < ps; p++) {
        SG_NAME(b, "shared L%d up %d", L, p);
        mf_sg_task t = mf_sg_rec(L);
        t.part = p;
        mf_sg_span(b, &t);
        int ln = mf_sg_rows_lane(b, (int64_t)z->sh_rows, ps, p, &t.r0, &t.r1);
        t.w.w_bytes[MF_KF_FP8] = z->sh_up_bytes / ps;
        t.w.macs[MF_KF_FP8] = 2 * H * z->sh_rows / ps;
        t.w.calls[MF_KF_FP8] = 1;
        mf_task_id up = mf_sg_add(b, ln, MF_SG_SHARED_UP, MF_SG_PH_MOE, MF_SG_K_EXPERT, t);
        SG_NAME(b, "shared L%d down %d", L, p);
        t = mf_sg_rec(L);
        t.part = p;
        mf_sg_span(b, &t);
        ln = mf_sg_rows_lane(b, (int64_t)H, ps, p, &t.r0, &t.r1);
        t.w.w_bytes[MF_KF_FP8] = z->sh_down_bytes / ps;
        t.w.macs[MF_KF_FP8] = H * z->sh_rows / ps;
        t.w.calls[MF_KF_FP8] = 1;
        t.w.ref_flops = SG_W_ROUND * H / ps * n;
        mf_task_id dn = mf_sg_add(b, ln, MF_SG_SHARED_DOWN, MF_SG_PH_MOE, MF_SG_K_EXPERT, t);
        for (int k = b->k0; k < b->k1; k++) mf_sg_dep(b, post[k], up);
        /* streamed experts: the shared expert runs while the routed experts are read */
        if (b->o->store) mf_sg_dep(b, ro, up);
        mf_sg_dep(b, up, sj);
        mf_sg_dep(b, sj, dn);
        mf_sg_dep(b, dn, done);
    }
}

/* The MoE of layer L: router, slots, shared expert, done, per unit combine (into unit[]). */
void mf_sg_moe(mf_sg_builder *b, int L, const mf_task_id *post, mf_task_id *unit)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    int K = mf_config_layer_topk(c, L);
    double H = (double)c->hidden_size, hc = c->hc_mult;
    mf_task_id ro = sg_router(b, L, post);
    /* two micro-batches: one MoE at a time (the store's batch, the cards' pins) */
    if (sg->n_halves > 1) mf_sg_dep(b, b->last_done, ro);
    SG_NAME(b, "moe L%d done", L);
    mf_sg_task t = mf_sg_rec(L);
    mf_sg_span(b, &t);
    mf_task_id done = mf_sg_add(b, 0, MF_SG_MOE_DONE, MF_SG_PH_MOE, MF_SG_K_OTHER, t);
    b->last_done = done;
    mf_task_id cffn[MF_SG_MAX_CARDS];   /* graph mode: a card's FFNs of the layer */
    for (int cd = 0; cd < sg->n_cards && sg->dev_graphs; cd++) {
        SG_NAME(b, "dev%d L%d ffn graph", cd, L);
        t = mf_sg_rec(L);
        t.card = (int8_t)cd;
        cffn[cd] = sg->card_ffn_tid[(L * sg->n_halves + b->h) * sg->n_cards + cd] =
            mf_sg_add(b, b->o->lane_dev0 + 3 * cd + 1, MF_SG_DEV_FFN_CARD, MF_SG_PH_MOE, MF_SG_K_DEV, t);
    }
    for (int cd = 0; cd < sg->n_cards && sg->slot_gather; cd++) {   /* the rows' items and weights */
        SG_NAME(b, "dev%d L%d rows", cd, L);
        t = mf_sg_rec(L);
        mf_sg_span(b, &t);
        t.card = (int8_t)cd;
        t.w.copies = 2;
        t.w.copy_bytes = (double)(b->h1 - b->h0) * K * 8.0;   /* an int32 item and an fp32 weight a row */
        b->dev_rows[cd] = mf_sg_add(b, b->o->lane_dev0 + 3 * cd, MF_SG_DEV_ROWS, MF_SG_PH_MOE, MF_SG_K_COPY, t);
        mf_sg_dep(b, b->rows, b->dev_rows[cd]);
    }
    for (int s = sg->half_slot[b->h]; s < sg->half_slot[b->h + 1]; s++) sg_slot(b, L, s, ro, cffn, done);
    sg_shared(b, L, post, ro, done);
    mf_sg_dep(b, ro, done);
    for (int k = b->k0; k < b->k1; k++) {
        SG_NAME(b, sg->par || sg->mixed ? "combine L%d join item %d" : "combine L%d join", L, k);
        unit[k] = b->comb_join[k] = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_MOE, MF_SG_K_OTHER, mf_sg_rec(L));
    }
    double sink = c->hc_sinkhorn_iters * 4.0 * hc * hc * 2;
    for (int i = b->g0; i < b->g1; i++)   /* item groups */
        for (int p = 0; p < sg->p_hc; p++) {
            SG_NAME(b, "combine L%d item %d %d", L, i, p);
            t = mf_sg_part(sg, L, i, (int64_t)H, sg->p_hc, p, 0);
            double cols = (double)(t.r1 - t.r0);
            /* the split of the ffn mixes; per column K routed outputs rounded and summed, the
             * shared one, the sum rounded (mf_fa_combine_cols, vector code either way), the expand
             * into the streams (rounded; the module's loop when exact, else fast_attn.c's) */
            double nsum = K + (c->n_shared_experts > 0);
            t.w.vec_flops = t.n_tok * cols * nsum * SG_W_COMBINE_VEC;
            if (b->o->exact) {
                t.w.ref_flops = t.n_tok * (sink + cols * (hc * (1 + hc) + SG_W_ROUND * hc));
            } else {
                t.w.ref_flops = t.n_tok * sink;
                t.w.vec_flops += t.n_tok * cols * hc * SG_W_EXPAND_VEC;
            }
            if (sg->n_dense_cards && sg->p_sh > 0 && mf_sg_dense_bf16(MF_SG_D_SHARED, 1))
                t.w.vec_flops += t.n_tok * cols * SG_W_CAST_VEC;   /* the shared expert's output columns unpacked */
            mf_task_id cb = b->comb[i][p] = mf_sg_add(b, 0, MF_SG_COMBINE, MF_SG_PH_MOE, MF_SG_K_OTHER, t);
            mf_sg_dep(b, done, cb);
            for (int m = 0; m < sg->p_mix; m++) mf_sg_dep(b, b->fmix[i][m], cb);
            mf_sg_dep(b, cb, unit[mf_sg_group_unit(sg, i)]);
        }
}
