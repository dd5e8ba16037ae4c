/* The Engram sublayer of a layer (mf_sg_engram, called by stepgraph.c mf_stepgraph_new before the
 * attention): per unit embed [plan -> reads] -> the wkv on the host in row parts or as a dense chain
 * on the cards (stepgraph_dense.c) -> per item group gate, into the streams. The engine's tasks:
 * graphs/layers/layer_engram.c. */
#include "graphs/step/stepgraph_impl.h"

#include <assert.h>
#include <math.h>

#include "host/kernels.h"

/* The Engram wkv of layer L on the dense cards (mf_sg_dense_chain: on its card, or split by rows on
 * every card), over the micro-batch's items: the embed rows in, the fp8 kernel, the output out
 * (the caller chains it after the previous Engram layer's: the cards hold one layer's rows).
 * Returns the chains' first task (a group: mf_sg_dep). */
static mf_task_id sg_engram_card(mf_sg_builder *b, int L)
{
    const mf_config *c = b->o->c;
    const mf_sg_layer_sizes *y = &b->o->sz->layer[L];
    mf_sg_task t = mf_sg_rec(L);
    mf_sg_span(b, &t);
    t.w.w_bytes[MF_KF_FP8] = y->eng_fp8_bytes;
    t.w.macs[MF_KF_FP8] = y->eng_fp8_macs;
    t.w.calls[MF_KF_FP8] = 1;
    double in_tok = 4.0 * (c->engram_max_ngram_size - 1) * c->engram_n_heads * c->engram_head_dim;
    double out_tok = 4.0 * (c->hc_mult + 1) * (double)c->hidden_size;
    return mf_sg_dense_chain(b, L, MF_SG_D_ENGRAM, t, MF_SG_PH_ENGRAM, in_tok, out_tok, -1, 0);
}

/* The Engram wkv of layer L on the host, per block of eg_block of the micro-batch's items p_eg row
 * parts over the block, each after the embeds (emb[], per unit) of the units its items are in.
 * Returns the blocks; wr[j] is block j's first part (its parts are consecutive tasks). */
static int sg_engram_host(mf_sg_builder *b, int L, const mf_task_id *emb, mf_task_id *wr)
{
    const mf_config *c = b->o->c;
    const mf_sg_layer_sizes *y = &b->o->sz->layer[L];
    const mf_stepgraph *sg = b->sg;
    double R = (double)(c->hc_mult + 1) * (double)c->hidden_size;
    int nb = (b->h1 - b->h0 + sg->eg_block - 1) / sg->eg_block;
    for (int j = 0; j < nb && !b->rc; j++) {
        int i0 = b->h0 + j * sg->eg_block, i1 = i0 + sg->eg_block < b->h1 ? i0 + sg->eg_block : b->h1;
        for (int p = 0; p < sg->p_eg; p++) {
            if (nb > 1) SG_NAME(b, "engram L%d wkv %d block %d", L, p, j);
            else SG_NAME(b, "engram L%d wkv %d", L, p);
            mf_sg_task t = mf_sg_rec(L);
            t.part = p;
            int ln = mf_sg_rows_lane(b, (int64_t)R, sg->p_eg, p, &t.r0, &t.r1);
            t.i0 = i0;
            t.i1 = i1;
            t.n_tok = i1 - i0;
            double f = (double)(t.r1 - t.r0) / R;
            t.w.w_bytes[MF_KF_FP8] = y->eng_fp8_bytes * f;
            t.w.macs[MF_KF_FP8] = y->eng_fp8_macs * f;
            t.w.calls[MF_KF_FP8] = f > 0;
            mf_task_id w = mf_sg_add(b, ln, MF_SG_ENGRAM_ROWS, MF_SG_PH_ENGRAM, MF_SG_K_OTHER, t);
            if (p == 0) wr[j] = w;
            assert(b->rc || w == wr[j] + p);
            for (int k = b->k0; k < b->k1; k++)
                if (sg->unit_end[k] > i0 && (k ? sg->unit_end[k - 1] : 0) < i1) mf_sg_dep(b, emb[k], w);
        }
    }
    return nb;
}

/* Engram of layer L: per unit embed -> wkv parts -> per unit gate (after unit[k]), into unit[].
 * The embed reads only the items' tokens and the wkv only the embed's rows (graphs/layers/
 * layer_engram.c), so both start with the step, off the layer chain, on workers the chain leaves
 * idle (the executor's upward ranks put the chain first); only the gate reads the streams. With
 * eg_reads the embed is three steps: plan (the rows hashed, the store's reads planned) -> the
 * reads on the IO lane (those the plan leaves unused are marked noop) -> embed. */
void mf_sg_engram(mf_sg_builder *b, int L, mf_task_id *unit)
{
    const mf_config *c = b->o->c;
    const mf_sg_layer_sizes *y = &b->o->sz->layer[L];
    mf_stepgraph *sg = b->sg;
    double H = (double)c->hidden_size, per = b->per;
    double rows = (double)(c->engram_max_ngram_size - 1) * c->engram_n_heads;
    mf_task_id emb[MF_SG_MAX_GROUPS], wr[MF_SG_MAX_CHUNK / (SG_EG_PASSES * MF_KERN_TOK_PASS) + 1];   /* wr: each block's first part */
    int nr = sg->eg_reads_per_unit, eslot = mf_config_engram_slot(c, L);
    int g0, g1;   /* a unit's item groups */
    /* a read of a row's codes or its scales: an aligned block each (O_DIRECT) */
    double code_io = ceil(y->eng_row_code_bytes / SG_STORE_ALIGN) * SG_STORE_ALIGN;
    double scale_io = ceil((y->eng_row_bytes - y->eng_row_code_bytes) / SG_STORE_ALIGN) * SG_STORE_ALIGN;
    for (int k = b->k0; k < b->k1; k++) {
        mf_task_id pl = -1;
        if (b->o->eg_reads) {
            SG_NAME(b, sg->par || sg->mixed ? "engram L%d plan item %d" : "engram L%d plan", L, k);
            mf_sg_task t = mf_sg_item(b, L, k);
            t.w.ref_flops = per * rows * c->engram_max_ngram_size * 4;   /* hashes, sort */
            pl = mf_sg_add(b, 0, MF_SG_ENGRAM_PLAN, MF_SG_PH_ENGRAM, MF_SG_K_OTHER, t);
        }
        SG_NAME(b, sg->par || sg->mixed ? "engram L%d embed item %d" : "engram L%d embed", L, k);
        mf_sg_task t = mf_sg_item(b, L, k);
        t.w.ref_flops = per * rows * c->engram_head_dim * 2;
        if (b->o->eg_reads || b->o->store || mf_sg_unit_groups(sg, k, &g0, &g1) == 1) {
            emb[k] = mf_sg_add(b, 0, MF_SG_ENGRAM_EMBED, MF_SG_PH_ENGRAM, MF_SG_K_OTHER, t);
            mf_sg_dep(b, pl, emb[k]);
        } else {   /* the tables in memory: the unit's items in groups on any worker, then a join */
            SG_NAME(b, "engram L%d embed join", L);
            emb[k] = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ENGRAM, MF_SG_K_OTHER, mf_sg_rec(L));
            for (int g = g0; g < g1; g++) {
                SG_NAME(b, "engram L%d embed %d", L, g);
                mf_sg_task tg = mf_sg_part(sg, L, g, 0, 1, 0, 1);
                tg.part = -1;
                tg.w.ref_flops = tg.n_tok * rows * c->engram_head_dim * 2;
                mf_task_id e = mf_sg_add(b, 0, MF_SG_ENGRAM_EMBED, MF_SG_PH_ENGRAM, MF_SG_K_OTHER, tg);
                mf_sg_dep(b, e, emb[k]);
            }
        }
        /* the unit's own reads (2 per row of its items); the table's other entries stay -1 */
        int nr_k = 2 * (t.i1 - t.i0) * (int)rows;
        for (int r = 0; b->o->eg_reads && r < nr && r < nr_k; r++) {
            if (sg->par || sg->mixed) SG_NAME(b, "engram L%d item %d read %d", L, k, r);
            else SG_NAME(b, "engram L%d read %d", L, r);
            mf_sg_task tr = mf_sg_item(b, L, k);
            tr.n_tok = 0;
            tr.read = (int16_t)r;
            tr.w.io_bytes = r % 2 ? scale_io : code_io;
            tr.w.io_reads = 1;
            mf_task_id rd = mf_sg_add(b, b->o->lane_io, MF_SG_ENGRAM_READ, MF_SG_PH_ENGRAM, MF_SG_K_IO, tr);
            sg->eg_read_tid[((size_t)eslot * sg->n_units + k) * nr + r] = rd;
            mf_sg_dep(b, pl, rd);
            mf_sg_dep(b, rd, emb[k]);
        }
    }
    /* the wkv: on the host per block of the micro-batch's items its row parts; with dense work on
     * cards one dense chain, after the previous Engram chain (the cards hold one layer's rows) */
    int nb = 1;
    if (sg->n_dense_cards > 0) {
        wr[0] = sg_engram_card(b, L);
        for (int k = b->k0; k < b->k1; k++) mf_sg_dep(b, emb[k], wr[0]);
        mf_sg_dep(b, b->eg_card, wr[0]);
        b->eg_card = wr[0];
    } else {
        nb = sg_engram_host(b, L, emb, wr);
    }
    for (int k = b->k0; k < b->k1; k++) {
        /* the gate per item group (one task when the unit is one group), joined for the unit */
        int ng = mf_sg_unit_groups(sg, k, &g0, &g1);
        mf_task_id prev = unit[k];   /* the streams' last writer */
        if (ng > 1) {
            SG_NAME(b, "engram L%d gate join", L);
            unit[k] = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ENGRAM, MF_SG_K_OTHER, mf_sg_rec(L));
        }
        for (int g = g0; g < g1; g++) {
            if (ng > 1) SG_NAME(b, "engram L%d gate %d", L, g);
            else SG_NAME(b, sg->par || sg->mixed ? "engram L%d gate item %d" : "engram L%d gate", L, k);
            mf_sg_task t = ng > 1 ? mf_sg_part(sg, L, g, 0, 1, 0, 1) : mf_sg_item(b, L, k);
            double items = t.i1 - t.i0;
            t.part = -1;
            t.n_tok = 1;   /* the q/k weights once per item */
            t.w.w_bytes[MF_KF_BF16] = items * y->eng_bf16_bytes;
            t.w.calls[MF_KF_BF16] = items;
            t.w.ref_flops = items * (6.0 * (c->hc_mult + 1) * H + SG_W_ROUND * (c->hc_mult + 1.0) * H);
            /* on socket g mod n_sockets's lane like the tasks without weights: its q and k weights
             * (2 hc H bf16 values, 80 KiB at flash41, socket 0's) stay in a worker's cache over its
             * items; on socket 0 alone a long unit's 128 groups were 6 waves of its 22 workers */
            mf_task_id gt = mf_sg_add(b, mf_sg_sock_lane(b, g), MF_SG_ENGRAM_GATE, MF_SG_PH_ENGRAM, MF_SG_K_OTHER, t);
            if (sg->n_dense_cards) mf_sg_dep(b, wr[0], gt);   /* the card chains' ends */
            for (int j = 0; j < nb && !sg->n_dense_cards; j++) {   /* the host blocks that hold its items */
                int i0 = b->h0 + j * sg->eg_block, i1 = i0 + sg->eg_block;
                for (int p = 0; p < sg->p_eg && t.i0 < i1 && t.i1 > i0; p++) mf_sg_dep(b, wr[j] + p, gt);
            }
            mf_sg_dep(b, prev, gt);
            if (ng > 1) mf_sg_dep(b, gt, unit[k]);
            else unit[k] = gt;
        }
    }
}
