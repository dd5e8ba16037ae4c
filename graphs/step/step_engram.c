/* The scheduled engine's Engram tasks (graphs/step/stepgraph_engram.c mf_sg_engram builds them): per item the
 * hashed table rows (gathered from memory, or planned as IO reads of a streamed store), the wkv
 * projection in row parts, the gate into the item's streams. Reads and writes the shape's Engram
 * buffers (step_impl.h); the wkv on dense cards is step_dense.c's. */
#include <errno.h>

#include "graphs/step/step_impl.h"
#include "sched/error.h"

/* Engram (layer_engram.c's phases): per item the hashed table rows, gathered and dequantized into
 * the item's row of eg_emb. Resident tables: in one task (the store's gatherer copies from
 * memory). Streamed tables: the plan task hashes the items' rows and has the store plan their
 * reads into the IO tasks' arguments (the unused ones marked noop); the embed task, after the
 * reads, puts the staged rows in order and dequantizes them. */
static int mf_task_engram_plan(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    const mf_sg_task *t = a->t;
    const mf_layers *ly = sh->eng->ly;
    int es = mf_config_engram_slot(ly->c, t->layer), m = (t->i1 - t->i0) * sh->eg_per, nr = 0;
    size_t r0 = mf_step_eg_row(sh, t->layer, t->i0);
    int64_t *rows = sh->eg_rows + r0 * sh->eg_per;
    for (int i = t->i0; i < t->i1; i++)
        mf_ly_engram_rows(ly, &sh->items[i], t->layer, rows + (size_t)(i - t->i0) * sh->eg_per);
    /* the unit's reads: 2 per row of its items (the graph has as many read tasks for it) */
    int k = mf_stepgraph_unit_of(sh->sg, t->i0), max = 2 * m;
    if (max > sh->sg->eg_reads_per_unit) max = sh->sg->eg_reads_per_unit;
    mf_io_read *rd = sh->eg_rd + r0 * 2 * sh->eg_per;
    int rc = mf_store_gather_reads(sh->eng->store, es, rows, m, sh->eg_scratch + r0 * sh->eg_scratch_item,
                                   rd, max, &nr);
    if (rc) return mf_error_wrap(rc, "step: layer %d: planning the Engram gather", t->layer);
    for (int r = nr; r < max; r++) rd[r] = (mf_io_read){.fd = -1};
    mf_stepgraph_mark_engram(sh->sg, es, k, nr);
    return 0;
}

static int mf_task_engram_embed(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_sg_task *t = a->t;
    int rc = 0;
    size_t r0 = mf_step_eg_row(sh, t->layer, t->i0);
    if (!sh->eng->eg_reads) {
        for (int i = t->i0; i < t->i1 && !rc; i++)
            rc = mf_ly_engram_embed(cx, &sh->items[i], t->layer, sh->eg_emb + (r0 + (size_t)(i - t->i0)) * sh->eg_emb_ld);
        return rc;
    }
    const mf_config *c = sh->eng->c;
    size_t d = (size_t)c->engram_head_dim, sb = (d + 31) / 32, per = (size_t)sh->eg_per;
    mf_store_gather_copy(sh->eng->store, sh->eg_scratch + r0 * sh->eg_scratch_item,
                         sh->eg_codes + r0 * per * d, sh->eg_scales + r0 * per * sb);
    for (size_t r = r0; r < r0 + (size_t)(t->i1 - t->i0); r++)
        mf_ly_engram_dequant(cx->ly, sh->eg_codes + r * per * d, sh->eg_scales + r * per * sb,
                             sh->eg_emb + r * sh->eg_emb_ld);
    return 0;
}

/* Rows [r0, r1) of the wkv projection over the record's block of items (graphs/step/stepgraph.h
 * eg_block: whole kernel passes; as mf_ly_linear sums them: the same bits for any split). */
static int mf_task_engram_rows(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_weight *w = &mf_model_layer_at(cx->ly->m, a->t->layer)->eg_wkv;
    int r0 = (int)a->t->r0, r1 = (int)a->t->r1;   /* the record's rows (mf_sg_expert_rows) */
    if (r0 >= r1) return 0;
    mf_step_count_socket(sh->eng, ctx, w, r0, r1, 1);
    size_t i0 = mf_step_eg_row(sh, a->t->layer, a->t->i0);   /* the micro-batch's items */
    int rc = mf_ly_linear_part(cx, w, sh->eg_emb + i0 * sh->eg_emb_ld, a->t->n_tok, sh->eg_emb_ld,
                                sh->eg_kv + i0 * sh->eg_kv_ld, sh->eg_kv_ld, r0, r1);
    return rc ? mf_error_wrap(rc, "step: layer %d, rows [%d, %d) of the Engram wkv", a->t->layer, r0, r1) : 0;
}

/* Per item: the gated value added into its streams. */
static int mf_task_engram_gate(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    for (int i = a->t->i0; i < a->t->i1; i++)
        mf_ly_engram_gate(cx, &sh->items[i], a->t->layer, sh->eg_kv + mf_step_eg_row(sh, a->t->layer, i) * sh->eg_kv_ld);
    return 0;
}

/* This file's ops (step_impl.h; step_shape.c binds them). */
const mf_task_fn mf_step_engram_fn_of[MF_SG_N_OPS] = {
    [MF_SG_ENGRAM_PLAN] = mf_task_engram_plan, [MF_SG_ENGRAM_EMBED] = mf_task_engram_embed,
    [MF_SG_ENGRAM_ROWS] = mf_task_engram_rows, [MF_SG_ENGRAM_GATE] = mf_task_engram_gate,
};
