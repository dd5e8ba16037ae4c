/* The step graph (graphs/step/stepgraph.h): per layer [engram embed -> wkv parts -> engram gate] ->
 * attn pre -> attention stages (in, qb, oa, ob; row parts) around q norm and core -> attn post
 * -> gate parts -> route -> expert slots ([reads] -> up parts -> join -> down parts, per card in
 * -> ffn -> out) and the shared expert -> moe done -> combine; then norm -> head join -> head
 * parts. One function per sublayer, each returning the tasks it ends with. */
#include "graphs/step/stepgraph.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/model/layout.h"
#include "sched/error.h"

/* The reference code's loops against the profile's REF loop (plain C attention, double sums):
 * what one unit of each costs in REF multiply-adds. Measured on the 2-core development box with a
 * micro-benchmark of each loop in the same minute as `moeflow calibrate` (docs/sim.md "Weights"):
 * a MAC of mf_ly_linear_rows over fp8 weights (0.457 ns) and over bf16 weights (0.728 ns), a
 * MAC of the hyper-connection mixes over fp32 weights out of cache (0.676 ns), one bf16 rounding
 * (mf_bf on random values, 8.83 ns), against host_ref 2.67 GMAC/s (0.374 ns). */
#define SG_W_DOT_FP8 1.22
#define SG_W_DOT_BF16 1.95
#define SG_W_MIX 1.81
#define SG_W_ROUND 23.6
#define SG_STORE_ALIGN 4096.0   /* host/store.c MF_STORE_SLOT_ALIGN: reads are aligned extents */
#define SG_CARD_ALIGN 256.0     /* a part's alignment in a card's cache slot */

/* ---- sizes --------------------------------------------------------------------------------- */

static void sg_size_tensor(mf_sg_sizes *s, const mf_layout_tensor *t)
{
    double b = (double)t->n_bytes, macs = t->n_dims == 2 ? (double)t->shape[0] * (double)t->shape[1] : 0;
    const char *nm = t->name;
    if (t->layer < 0) {
        if (!strcmp(nm, "head.weight")) s->head_bytes = b;
        return;
    }
    mf_sg_layer_sizes *y = &s->layer[t->layer];
    if (t->group == MF_GROUP_ATTN && strstr(nm, ".wo_a.")) {
        /* the grouped wo_a runs through mf_ly_linear_rows: scalar, not the kernels */
        if (t->role == MF_ROLE_FP8_WEIGHT) {
            y->attn_ref_macs += macs;
            y->st_data_bytes[MF_SG_ST_OA] += b;
        }
    } else if (t->group == MF_GROUP_ATTN) {
        /* mf_ly_attn_linears: what reads the input (in), the normed low-rank query (qb), the
         * heads' output (ob); the indexer's wk reads compressed latents inside the core */
        int st = strstr(nm, ".attn.wq_b.") || strstr(nm, ".indexer.wq_b.") ? MF_SG_ST_QB
                 : strstr(nm, ".attn.wo_b.")                                ? MF_SG_ST_OB
                 : strstr(nm, ".indexer.wk.")                               ? MF_SG_ST_CORE
                                                                            : MF_SG_ST_IN;
        if (t->role == MF_ROLE_FP8_WEIGHT) {
            y->st_fp8_calls[st]++;
            y->st_fp8_macs[st] += macs;
            y->st_data_bytes[st] += b;
        }
        if (t->role == MF_ROLE_FP8_WEIGHT || t->role == MF_ROLE_FP8_SCALE) y->st_fp8_bytes[st] += b;
        if (t->role == MF_ROLE_LINEAR) {
            y->st_bf16_bytes[st] += b;
            y->st_bf16_macs[st] += macs;
            y->st_bf16_calls[st]++;
            y->st_data_bytes[st] += b;
        }
    } else if (t->group == MF_GROUP_SHARED_EXPERTS) {
        if (strstr(nm, ".w2.")) s->sh_down_bytes += b;
        else s->sh_up_bytes += b;
        if (t->role == MF_ROLE_FP8_WEIGHT && strstr(nm, ".w1.")) s->sh_rows = (double)t->shape[0];
    } else if (t->group == MF_GROUP_ENGRAM) {
        if (t->role == MF_ROLE_FP8_WEIGHT || t->role == MF_ROLE_FP8_SCALE) y->eng_fp8_bytes += b;
        if (t->role == MF_ROLE_FP8_WEIGHT) {
            y->eng_fp8_macs += macs;
            y->eng_data_bytes += b;
        } else if (t->role == MF_ROLE_LINEAR) {
            y->eng_bf16_bytes += b;
        } else if (t->role == MF_ROLE_TABLE || t->role == MF_ROLE_TABLE_SCALE) {
            y->eng_row_bytes += b / (double)t->shape[0];
        }
    } else if (t->role == MF_ROLE_HC_FN) {
        y->hc_macs += macs;
    } else if (t->group == MF_GROUP_EXPERTS && t->layer == 0 && strstr(nm, ".experts.0.")) {
        int k = strstr(nm, ".w1.") ? 0 : strstr(nm, ".w2.") ? 1 : 2, sc = t->role == MF_ROLE_FP4_SCALE;
        s->part_bytes[2 * k + sc] = b;
        if (k == 1) s->down_bytes += b;
        else s->up_bytes += b;
    }
}

int mf_sg_sizes_new(const mf_config *c, mf_sg_sizes **out)
{
    *out = NULL;
    mf_layout *lay;
    int rc = mf_layout_build(c, &lay);
    if (rc) return mf_error_wrap(rc, "step graph: the layout of the config");
    mf_sg_sizes *s = calloc(1, sizeof *s);
    if (s) s->layer = calloc((size_t)c->n_layers, sizeof *s->layer);
    if (!s || !s->layer) {
        free(s);
        mf_layout_free(lay);
        return mf_error(-ENOMEM, "step graph: out of memory");
    }
    s->n_layers = c->n_layers;
    for (int i = 0; i < mf_layout_n(lay); i++) sg_size_tensor(s, mf_layout_at(lay, i));
    mf_layout_free(lay);
    s->sh_up_bytes /= c->n_layers;
    s->sh_down_bytes /= c->n_layers;
    for (int k = 0; k < MF_SG_EXPERT_PARTS; k++) {
        s->xslot_bytes += ceil(s->part_bytes[k] / SG_CARD_ALIGN) * SG_CARD_ALIGN;
        s->store_slot_bytes += ceil(s->part_bytes[k] / SG_STORE_ALIGN) * SG_STORE_ALIGN;
    }
    *out = s;
    return 0;
}

void mf_sg_sizes_free(mf_sg_sizes *s)
{
    if (!s) return;
    free(s->layer);
    free(s);
}

double mf_sg_core_flops(const mf_config *c, int L, int64_t pos)
{
    double D = c->head_dim, nh = c->n_heads;
    int64_t W = c->sliding_window, n_win = pos + 1 < W ? pos + 1 : W, n_sel = 0, n_vis = 0;
    int ratio = c->compress_ratios[L];
    if (ratio > 0) {
        n_vis = (pos + 1) / ratio;
        n_sel = n_vis < c->index_topk ? n_vis : c->index_topk;
    }
    double fl = 2.0 * nh * D * (double)(n_win + n_sel);
    if (mf_config_is_index_source(c, L) && n_vis > 0) fl += (double)n_vis * c->index_n_heads * c->index_head_dim;
    return fl;
}

void mf_sg_rows(int64_t n_rows, int parts, int p, int64_t *r0, int64_t *r1)
{
    int64_t chunk = (n_rows + parts - 1) / parts;
    chunk = (chunk + 15) / 16 * 16;
    int64_t a = p * chunk, b = a + chunk;
    *r0 = a < n_rows ? a : n_rows;
    *r1 = b < n_rows ? b : n_rows;
}

/* ---- the builder --------------------------------------------------------------------------- */

typedef struct sg_builder {
    const mf_sg_opts *o;
    mf_stepgraph *sg;
    int cap, rc;
    int u;                       /* item-part tasks per layer part: n (parallel) or 1 */
    double per;                  /* items per item task */
    mf_task_id *io;              /* the layer's IO tasks, n_slots x n_io_parts */
    char name[64];
} sg_builder;

static mf_io_read sg_no_read = {.fd = -1};

/* Adds a task: its record `t` (layer, slot, ... and work; op, phase and kind given here) on
 * `lane` with the priority cost (bytes over the lane's model, time). Returns its id, or -1 after
 * an error (kept in b->rc). */
static mf_task_id sg_add(sg_builder *b, int lane, int op, int phase, int kind, mf_sg_task t, double rank_bytes,
                         double rank_ns)
{
    mf_stepgraph *sg = b->sg;
    if (b->rc) return -1;
    if (sg->n_tasks == b->cap) {
        int cap = b->cap ? 2 * b->cap : 1024;
        mf_sg_task *v = realloc(sg->task, sizeof *v * (size_t)cap);
        if (!v) {
            b->rc = mf_error(-ENOMEM, "step graph: out of memory for %d tasks", cap);
            return -1;
        }
        sg->task = v;
        b->cap = cap;
    }
    int io = b->o->lanes[lane].kind == MF_LANE_IO;
    mf_task_id id = mf_graph_add_task(sg->g, &(mf_task_desc){.name = b->name, .lane = lane,
                                                             .fn = b->o->fn_of && !io ? b->o->fn_of[op] : NULL,
                                                             .arg = io ? &sg_no_read : NULL,
                                                             .cost = {.bytes = rank_bytes, .time_ns = rank_ns},
                                                             .place_hint = -1});
    if (id < 0) {
        b->rc = id;
        return -1;
    }
    t.op = (uint8_t)op;
    t.phase = (uint8_t)phase;
    t.kind = (uint8_t)kind;
    sg->task[id] = t;
    sg->n_tasks = id + 1;
    return id;
}

/* A record of layer L with nothing else set. */
static mf_sg_task sg_rec(int L)
{
    return (mf_sg_task){.layer = (int16_t)L, .stage = -1, .card = -1, .read = -1, .slot = -1, .part = -1};
}

/* Item task k's record: items [i0, i1) of unit k. */
static mf_sg_task sg_item(const sg_builder *b, int L, int k)
{
    mf_sg_task t = sg_rec(L);
    t.i0 = k > 0 ? b->sg->unit_end[k - 1] : 0;
    t.i1 = b->sg->unit_end[k];
    t.n_tok = t.i1 - t.i0;
    return t;
}

static void sg_dep(sg_builder *b, mf_task_id before, mf_task_id after)
{
    if (!b->rc && before >= 0 && after >= 0) b->rc = mf_graph_add_dep(b->sg->g, before, after);
}

#define SG_NAME(b, ...) snprintf((b)->name, sizeof (b)->name, __VA_ARGS__)

/* Engram of layer L: per unit embed (after unit[k]) -> wkv parts -> per unit gate, into unit[]. */
static void sg_engram(sg_builder *b, int L, mf_task_id *unit)
{
    const mf_config *c = b->o->c;
    const mf_sg_layer_sizes *y = &b->o->sz->layer[L];
    mf_stepgraph *sg = b->sg;
    double H = (double)c->hidden_size, per = b->per;
    double rows = (double)(c->engram_max_ngram_size - 1) * c->engram_n_heads;
    mf_task_id emb[MF_SG_MAX_ITEMS], wr[MF_SG_MAX_PARTS];
    for (int k = 0; k < b->u; k++) {
        SG_NAME(b, sg->par ? "engram L%d embed item %d" : "engram L%d embed", L, k);
        mf_sg_task t = sg_item(b, L, k);
        t.w.ref_flops = per * rows * c->engram_head_dim * 2;
        t.w.io_bytes = per * rows * ceil(y->eng_row_bytes / SG_STORE_ALIGN) * SG_STORE_ALIGN;
        t.w.io_reads = t.i1 - t.i0;
        emb[k] = sg_add(b, 0, MF_SG_ENGRAM_EMBED, MF_SG_PH_ENGRAM, MF_SG_K_OTHER, t, 0, per * 2e4);
        sg_dep(b, unit[k], emb[k]);
    }
    double R = (double)(c->hc_mult + 1) * H;
    for (int p = 0; p < sg->p_attn; p++) {
        SG_NAME(b, "engram L%d wkv %d", L, p);
        mf_sg_task t = sg_rec(L);
        t.part = p;
        mf_sg_rows((int64_t)R, sg->p_attn, p, &t.r0, &t.r1);
        t.n_tok = sg->n;
        double f = (double)(t.r1 - t.r0) / R;
        t.w.w_bytes[MF_KF_FP8] = y->eng_fp8_bytes * f;
        t.w.macs[MF_KF_FP8] = y->eng_fp8_macs * f;
        t.w.calls[MF_KF_FP8] = f > 0;
        wr[p] = sg_add(b, 0, MF_SG_ENGRAM_ROWS, MF_SG_PH_ENGRAM, MF_SG_K_OTHER, t, y->eng_data_bytes / sg->p_attn, 0);
        for (int k = 0; k < b->u; k++) sg_dep(b, emb[k], wr[p]);
    }
    for (int k = 0; k < b->u; k++) {
        SG_NAME(b, sg->par ? "engram L%d gate item %d" : "engram L%d gate", L, k);
        mf_sg_task t = sg_item(b, L, k);
        t.n_tok = 1;   /* the q/k weights once per item */
        t.w.w_bytes[MF_KF_BF16] = per * y->eng_bf16_bytes;
        t.w.calls[MF_KF_BF16] = per;
        t.w.ref_flops = per * (6.0 * (c->hc_mult + 1) * H + SG_W_ROUND * (c->hc_mult + 1.0) * H);
        unit[k] = sg_add(b, 0, MF_SG_ENGRAM_GATE, MF_SG_PH_ENGRAM, MF_SG_K_OTHER, t, 0, per * 8.0 * c->hc_mult * H);
        for (int p = 0; p < sg->p_attn; p++) sg_dep(b, wr[p], unit[k]);
    }
}

/* Stage st's part p of layer L over all items: the stage's kernels split evenly over the parts
 * (oa: the reference's scalar grouped rows), their output roundings. */
static mf_task_id sg_attn_rows(sg_builder *b, int L, int st, int p)
{
    static const char *const st_name[4] = {"in", "qb", "oa", "ob"};
    const mf_config *c = b->o->c;
    const mf_sg_layer_sizes *y = &b->o->sz->layer[L];
    int n = b->sg->n, parts = b->sg->p_attn;
    SG_NAME(b, "attn L%d %s %d", L, st_name[st], p);
    mf_sg_task t = sg_rec(L);
    t.stage = (int8_t)st;
    t.part = p;
    t.n_tok = n;
    if (st == MF_SG_ST_OA) {
        t.w.ref_flops = n * (SG_W_DOT_FP8 * y->attn_ref_macs + SG_W_ROUND * (double)c->o_groups * c->o_lora_rank) / parts;
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
    return sg_add(b, 0, MF_SG_ATTN_ROWS, MF_SG_PH_ATTN, MF_SG_K_OTHER, t, y->st_data_bytes[st] / parts, 0);
}

/* The attention sublayer of layer L: per unit pre (after unit[k]) -> in parts -> q norm -> qb
 * parts -> per unit core -> oa parts -> oa join -> ob parts -> per unit post, into post[]. */
static void sg_attn(sg_builder *b, int L, const mf_task_id *unit, mf_task_id *post)
{
    const mf_config *c = b->o->c;
    const mf_sg_layer_sizes *y = &b->o->sz->layer[L];
    mf_stepgraph *sg = b->sg;
    int n = sg->n, u = b->u;
    double H = (double)c->hidden_size, hc = c->hc_mult, per = b->per, D = c->head_dim, nh = c->n_heads;
    /* rough costs for priorities: reference code ~1 ns per multiply-add, kernels by bytes */
    double hc_ns = per * H * c->hc_mult * (c->hc_mult + 4.0);
    double core_ns = per * nh * D * 2.0 * (c->sliding_window + c->index_topk);
    double sink = c->hc_sinkhorn_iters * 4.0 * hc * hc * 2;
    mf_task_id pre[MF_SG_MAX_ITEMS], core[MF_SG_MAX_ITEMS], rows[4][MF_SG_MAX_PARTS];
    for (int k = 0; k < u; k++) {
        SG_NAME(b, sg->par ? "attn L%d pre item %d" : "attn L%d pre", L, k);
        mf_sg_task t = sg_item(b, L, k);
        t.w.ref_flops = per * (SG_W_MIX * y->hc_macs / 2 + 2.0 * hc * H + 4.0 * H + sink + SG_W_ROUND * 2.0 * H);
        pre[k] = sg_add(b, 0, MF_SG_ATTN_PRE, MF_SG_PH_ATTN, MF_SG_K_OTHER, t, 0, hc_ns);
        sg_dep(b, unit[k], pre[k]);
    }
    for (int st = 0; st < 4; st++)
        for (int p = 0; p < sg->p_attn; p++) rows[st][p] = sg_attn_rows(b, L, st, p);
    SG_NAME(b, "attn L%d q norm", L);
    mf_sg_task t = sg_rec(L);
    t.i1 = t.n_tok = n;
    t.w.ref_flops = n * (4.0 + 2.0 * SG_W_ROUND) * c->q_lora_rank;
    mf_task_id qn = sg_add(b, 0, MF_SG_ATTN_QNORM, MF_SG_PH_ATTN, MF_SG_K_OTHER, t, 0, n * 4.0 * c->q_lora_rank);
    SG_NAME(b, "attn L%d oa join", L);
    mf_task_id oj = sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ATTN, MF_SG_K_OTHER, sg_rec(L), 0, 0);
    for (int k = 0; k < u; k++) {
        SG_NAME(b, sg->par ? "attn L%d core item %d" : "attn L%d core", L, k);
        t = sg_item(b, L, k);
        double items = t.i1 - t.i0;   /* each item: the core's kernels once, its roundings */
        t.n_tok = 1;
        t.w.w_bytes[MF_KF_FP8] = items * y->st_fp8_bytes[MF_SG_ST_CORE];
        t.w.calls[MF_KF_FP8] = items * y->st_fp8_calls[MF_SG_ST_CORE];
        t.w.w_bytes[MF_KF_BF16] = items * y->st_bf16_bytes[MF_SG_ST_CORE];
        t.w.calls[MF_KF_BF16] = items * y->st_bf16_calls[MF_SG_ST_CORE];
        t.w.ref_flops = items * (4.0 * D + SG_W_ROUND * (3.0 * nh * D + nh * (double)c->qk_rope_head_dim + 4.0 * D));
        core[k] = sg_add(b, 0, MF_SG_ATTN_CORE, MF_SG_PH_ATTN, MF_SG_K_OTHER, t, 0, core_ns);
        SG_NAME(b, sg->par ? "attn L%d post item %d" : "attn L%d post", L, k);
        t = sg_item(b, L, k);
        t.w.ref_flops = per * (SG_W_MIX * y->hc_macs / 2 + 2.0 * hc * H * (1 + hc) + 4.0 * H + sink +
                               SG_W_ROUND * (4.0 + hc) * H);
        post[k] = sg_add(b, 0, MF_SG_ATTN_POST, MF_SG_PH_ATTN, MF_SG_K_OTHER, t, 0, 2 * hc_ns);
    }
    for (int p = 0; p < sg->p_attn; p++) {
        for (int k = 0; k < u; k++) {
            sg_dep(b, pre[k], rows[MF_SG_ST_IN][p]);
            sg_dep(b, rows[MF_SG_ST_QB][p], core[k]);
            sg_dep(b, core[k], rows[MF_SG_ST_OA][p]);
            sg_dep(b, rows[MF_SG_ST_OB][p], post[k]);
        }
        sg_dep(b, rows[MF_SG_ST_IN][p], qn);
        sg_dep(b, qn, rows[MF_SG_ST_QB][p]);
        sg_dep(b, rows[MF_SG_ST_OA][p], oj);
        sg_dep(b, oj, rows[MF_SG_ST_OB][p]);
    }
}

/* The router of layer L: gate parts over all items (after post[]) -> route. Returns route. */
static mf_task_id sg_router(sg_builder *b, int L, const mf_task_id *post)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    int n = sg->n, K = c->n_experts_per_tok, E = c->n_routed_experts;
    double H = (double)c->hidden_size;
    SG_NAME(b, "route L%d", L);
    mf_sg_task t = sg_rec(L);
    t.i1 = t.n_tok = n;
    t.w.ref_flops = n * (H * K * 2.0 + 4.0 * E);
    mf_task_id ro = sg_add(b, 0, MF_SG_ROUTE, MF_SG_PH_MOE, MF_SG_K_OTHER, t, 0, n * (H * K + 4.0 * E));
    for (int p = 0; p < sg->p_attn; p++) {
        SG_NAME(b, "gate L%d %d", L, p);
        t = sg_rec(L);
        t.part = p;
        t.n_tok = n;
        mf_sg_rows(E, sg->p_attn, p, &t.r0, &t.r1);
        t.w.ref_flops = n * SG_W_DOT_BF16 * H * (double)(t.r1 - t.r0);
        mf_task_id gp = sg_add(b, 0, MF_SG_GATE_ROWS, MF_SG_PH_MOE, MF_SG_K_OTHER, t, 0, n * H * E / sg->p_attn);
        for (int k = 0; k < b->u; k++) sg_dep(b, post[k], gp);
        sg_dep(b, gp, ro);
    }
    return ro;
}

/* Slot s of layer L on card cd: in -> ffn (or the card's FFN graph cffn) -> out, between the
 * slot's reads (after route) and done. */
static void sg_slot_card(sg_builder *b, int L, int s, int cd, mf_task_id ro, mf_task_id cffn, mf_task_id done)
{
    const mf_config *c = b->o->c;
    const mf_sg_sizes *z = b->o->sz;
    mf_stepgraph *sg = b->sg;
    double H = (double)c->hidden_size, I = (double)c->moe_intermediate_size;
    int lane = b->o->lane_dev0 + 3 * cd;
    mf_task_id *tid = sg->slot_tid + ((size_t)L * sg->n_slots + s) * sg->tid_per_slot + 2 * sg->p_exp + 1 + 3 * cd;
    mf_sg_task t = sg_rec(L);
    t.slot = s;
    t.card = (int8_t)cd;
    t.slot_tokens = 1;
    SG_NAME(b, "dev%d L%d slot %d in", cd, L, s);
    mf_sg_task ti = t;
    ti.w.copy_bytes = z->xslot_bytes;
    ti.w.copy_bytes_tok = H * 4.0 + 4.0;
    mf_task_id din = sg_add(b, lane, MF_SG_DEV_IN, MF_SG_PH_MOE, MF_SG_K_COPY, ti, z->xslot_bytes, 0);
    mf_task_id dff = cffn;
    if (!sg->dev_graphs) {
        SG_NAME(b, "dev%d L%d slot %d ffn", cd, L, s);
        mf_sg_task tf = t;
        tf.w.w_bytes[MF_KF_FP4] = z->up_bytes + z->down_bytes;
        tf.w.macs[MF_KF_FP4] = 3 * H * I;
        tf.w.calls[MF_KF_FP4] = 1;
        dff = sg_add(b, lane + 1, MF_SG_DEV_FFN, MF_SG_PH_MOE, MF_SG_K_DEV, tf, z->xslot_bytes, 0);
    }
    SG_NAME(b, "dev%d L%d slot %d out", cd, L, s);
    mf_sg_task to = t;
    to.w.copy_bytes_tok = H * 4.0;
    mf_task_id dout = sg_add(b, lane + 2, MF_SG_DEV_OUT, MF_SG_PH_MOE, MF_SG_K_COPY_OUT, to, sg->n * H * 4.0, 0);
    tid[0] = din;
    tid[1] = sg->dev_graphs ? -1 : dff;
    tid[2] = dout;
    sg_dep(b, ro, din);
    for (int j = 0; j < sg->n_io_parts; j++) sg_dep(b, b->io[(size_t)s * sg->n_io_parts + j], din);
    sg_dep(b, din, dff);
    sg_dep(b, dff, dout);
    sg_dep(b, dout, done);
}

/* Slot s of layer L: [reads] -> up parts -> join -> down parts on the host, and per card its
 * device tasks, between route and done. */
static void sg_slot(sg_builder *b, int L, int s, mf_task_id ro, const mf_task_id *cffn, mf_task_id done)
{
    const mf_config *c = b->o->c;
    const mf_sg_sizes *z = b->o->sz;
    mf_stepgraph *sg = b->sg;
    double H = (double)c->hidden_size, I = (double)c->moe_intermediate_size;
    double exp_bytes = 3 * H * I * 0.53;   /* priorities: an fp4 expert's bytes, roughly */
    int np = sg->n_io_parts, pe = sg->p_exp;
    int win = b->o->read_window ? b->o->read_window : 2;
    mf_task_id *tid = sg->slot_tid + ((size_t)L * sg->n_slots + s) * sg->tid_per_slot;
    mf_sg_task t = sg_rec(L);
    t.slot = s;
    t.slot_tokens = 1;
    SG_NAME(b, "expert L%d slot %d join", L, s);
    mf_sg_task tj = t;
    tj.w.ref_flops_tok = 2.0 * I;
    mf_task_id jo = tid[2 * pe] = sg_add(b, 0, MF_SG_SLOT_JOIN, MF_SG_PH_MOE, MF_SG_K_EXPERT, tj, 0, I * 2);
    mf_task_id *io = b->io + (size_t)s * np;
    for (int j = 0; j < np; j++) {
        SG_NAME(b, "read L%d slot %d part %d", L, s, j);
        mf_sg_task tr = t;
        tr.slot_tokens = 0;
        tr.read = (int8_t)j;
        tr.w.io_bytes = ceil(z->part_bytes[j] / SG_STORE_ALIGN) * SG_STORE_ALIGN;
        tr.w.io_reads = 1;
        io[j] = sg_add(b, b->o->lane_io, MF_SG_SLOT_READ, MF_SG_PH_MOE, MF_SG_K_IO, tr, z->store_slot_bytes / np, 0);
        sg_dep(b, ro, io[j]);
        /* read window: slot s's reads start once slot s - win's are in, so that the first
         * slots' experts arrive early and their compute overlaps the later reads */
        for (int i = 0; win > 0 && s >= win && i < np; i++) sg_dep(b, b->io[(size_t)(s - win) * np + i], io[j]);
    }
    for (int p = 0; p < pe; p++) {
        SG_NAME(b, "expert L%d slot %d up %d", L, s, p);
        mf_sg_task tu = t;
        tu.part = p;
        mf_sg_rows((int64_t)I, pe, p, &tu.r0, &tu.r1);
        tu.w.w_bytes[MF_KF_FP4] = z->up_bytes / pe;
        tu.w.macs[MF_KF_FP4] = 2 * H * I / pe;
        tu.w.calls[MF_KF_FP4] = 1;
        mf_task_id up = tid[p] = sg_add(b, 0, MF_SG_SLOT_UP, MF_SG_PH_MOE, MF_SG_K_EXPERT, tu, exp_bytes * 2 / 3 / pe, 0);
        SG_NAME(b, "expert L%d slot %d down %d", L, s, p);
        mf_sg_task td = t;
        td.part = p;
        mf_sg_rows((int64_t)H, pe, p, &td.r0, &td.r1);
        td.w.w_bytes[MF_KF_FP4] = z->down_bytes / pe;
        td.w.macs[MF_KF_FP4] = H * I / pe;
        td.w.calls[MF_KF_FP4] = 1;
        td.w.ref_flops_tok = SG_W_ROUND * H / pe;   /* each output rounded to bf16 */
        mf_task_id dn = tid[pe + p] = sg_add(b, 0, MF_SG_SLOT_DOWN, MF_SG_PH_MOE, MF_SG_K_EXPERT, td, exp_bytes / 3 / pe, 0);
        sg_dep(b, ro, up);
        for (int j = 0; j < np; j++) sg_dep(b, io[j], up);
        sg_dep(b, up, jo);
        sg_dep(b, jo, dn);
        sg_dep(b, dn, done);
    }
    for (int cd = 0; cd < sg->n_cards; cd++) sg_slot_card(b, L, s, cd, ro, sg->dev_graphs ? cffn[cd] : -1, done);
}

/* The shared expert of layer L: up parts (after post[], and route with a store) -> join -> down
 * parts -> done. */
static void sg_shared(sg_builder *b, int L, const mf_task_id *post, mf_task_id ro, mf_task_id done)
{
    const mf_config *c = b->o->c;
    const mf_sg_sizes *z = b->o->sz;
    mf_stepgraph *sg = b->sg;
    int n = sg->n, ps = sg->p_sh;
    double H = (double)c->hidden_size, I = (double)c->moe_intermediate_size;
    double sh_bytes = 3 * H * I * 1.0;   /* priorities */
    SG_NAME(b, "shared L%d join", L);
    mf_task_id sj = sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_MOE, MF_SG_K_OTHER, sg_rec(L), 0, 0);
    for (int p = 0; p < ps; p++) {
        SG_NAME(b, "shared L%d up %d", L, p);
        mf_sg_task t = sg_rec(L);
        t.part = p;
        t.n_tok = n;
        mf_sg_rows((int64_t)z->sh_rows, ps, p, &t.r0, &t.r1);
        t.w.w_bytes[MF_KF_FP8] = z->sh_up_bytes / ps;
        t.w.macs[MF_KF_FP8] = 2 * H * z->sh_rows / ps;
        t.w.calls[MF_KF_FP8] = 1;
        mf_task_id up = sg_add(b, 0, MF_SG_SHARED_UP, MF_SG_PH_MOE, MF_SG_K_EXPERT, t, sh_bytes * 2 / 3 / ps, 0);
        SG_NAME(b, "shared L%d down %d", L, p);
        t = sg_rec(L);
        t.part = p;
        t.n_tok = n;
        mf_sg_rows((int64_t)H, ps, p, &t.r0, &t.r1);
        t.w.w_bytes[MF_KF_FP8] = z->sh_down_bytes / ps;
        t.w.macs[MF_KF_FP8] = H * z->sh_rows / ps;
        t.w.calls[MF_KF_FP8] = 1;
        t.w.ref_flops = SG_W_ROUND * H / ps * n;
        mf_task_id dn = sg_add(b, 0, MF_SG_SHARED_DOWN, MF_SG_PH_MOE, MF_SG_K_EXPERT, t, sh_bytes / 3 / ps, 0);
        for (int k = 0; k < b->u; k++) sg_dep(b, post[k], up);
        /* streamed experts: the shared expert runs while the routed experts are read */
        if (b->o->store) sg_dep(b, ro, up);
        sg_dep(b, up, sj);
        sg_dep(b, sj, dn);
        sg_dep(b, dn, done);
    }
}

/* The MoE of layer L: router, slots, shared expert, done, per unit combine (into unit[]). */
static void sg_moe(sg_builder *b, int L, const mf_task_id *post, mf_task_id *unit)
{
    const mf_config *c = b->o->c;
    const mf_sg_sizes *z = b->o->sz;
    mf_stepgraph *sg = b->sg;
    int K = c->n_experts_per_tok, hc = c->hc_mult;
    double H = (double)c->hidden_size, per = b->per;
    mf_task_id ro = sg_router(b, L, post);
    SG_NAME(b, "moe L%d done", L);
    mf_sg_task t = sg_rec(L);
    mf_task_id done = sg_add(b, 0, MF_SG_MOE_DONE, MF_SG_PH_MOE, MF_SG_K_OTHER, t, 0, 0);
    mf_task_id cffn[MF_SG_MAX_CARDS];   /* graph mode: a card's FFNs of the layer */
    for (int cd = 0; cd < sg->n_cards && sg->dev_graphs; cd++) {
        SG_NAME(b, "dev%d L%d ffn graph", cd, L);
        t = sg_rec(L);
        t.card = (int8_t)cd;
        cffn[cd] = sg->card_ffn_tid[L * sg->n_cards + cd] =
            sg_add(b, b->o->lane_dev0 + 3 * cd + 1, MF_SG_DEV_FFN_CARD, MF_SG_PH_MOE, MF_SG_K_DEV, t,
                   z->xslot_bytes * K / sg->n_cards, 0);
    }
    for (int s = 0; s < sg->n_slots; s++) sg_slot(b, L, s, ro, cffn, done);
    sg_shared(b, L, post, ro, done);
    sg_dep(b, ro, done);
    for (int k = 0; k < b->u; k++) {
        SG_NAME(b, sg->par ? "combine L%d item %d" : "combine L%d", L, k);
        t = sg_item(b, L, k);
        /* per item: K routed outputs rounded and summed, the shared one, the sum rounded, the
         * expand into the streams (rounded) */
        t.w.ref_flops = per * H * (K + 2 + hc * (1 + hc) + SG_W_ROUND * (K + 1 + hc));
        unit[k] = sg_add(b, 0, MF_SG_COMBINE, MF_SG_PH_MOE, MF_SG_K_OTHER, t, 0, per * H * (K + 2 + 2 * hc));
        sg_dep(b, done, unit[k]);
    }
}

/* After the last layer: per unit norm -> head join -> head parts. */
static void sg_head(sg_builder *b, const mf_task_id *unit)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    double H = (double)c->hidden_size, V = (double)c->vocab_size, per = b->per;
    SG_NAME(b, "head join");
    mf_task_id hj = sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_HEAD, MF_SG_K_OTHER, sg_rec(-1), 0, 0);
    for (int k = 0; k < b->u; k++) {
        SG_NAME(b, sg->par ? "norm item %d" : "norm", k);
        mf_sg_task t = sg_item(b, -1, k);
        t.w.ref_flops = per * H * (c->hc_mult + 2 + 3 * SG_W_ROUND);
        mf_task_id no = sg_add(b, 0, MF_SG_NORM, MF_SG_PH_HEAD, MF_SG_K_OTHER, t, 0, per * H * 8);
        sg_dep(b, unit[k], no);
        sg_dep(b, no, hj);
    }
    for (int p = 0; p < sg->p_head; p++) {
        SG_NAME(b, "head %d", p);
        mf_sg_task t = sg_rec(-1);
        t.part = p;
        t.n_tok = sg->n;
        mf_sg_rows((int64_t)V, sg->p_head, p, &t.r0, &t.r1);
        t.w.w_bytes[MF_KF_BF16] = b->o->sz->head_bytes / sg->p_head;
        t.w.macs[MF_KF_BF16] = V * H / sg->p_head;
        t.w.calls[MF_KF_BF16] = 1;
        mf_task_id hd = sg_add(b, 0, MF_SG_HEAD, MF_SG_PH_HEAD, MF_SG_K_OTHER, t, 2.0 * V * H / sg->p_head, 0);
        sg_dep(b, hj, hd);
    }
}

/* Part counts of the shape (one home: the engine's buffers and the simulator read them here). */
static void sg_parts(const mf_sg_opts *o, mf_stepgraph *sg)
{
    const mf_config *c = o->c;
    int K = c->n_experts_per_tok, E = c->n_routed_experts, W = o->n_threads > 0 ? o->n_threads : 1;
    sg->n = o->n;
    sg->par = o->par;
    /* units: o's, else n of one item (par) or one of all */
    sg->n_units = o->n_units > 0 ? o->n_units : o->par ? o->n : 1;
    for (int k = 0; k < sg->n_units; k++)
        sg->unit_end[k] = o->n_units > 0 ? o->unit_end[k] : o->par ? k + 1 : o->n;
    sg->n_slots = o->n * K < E ? o->n * K : E;
    /* split experts by rows when there are fewer slots than two per worker */
    sg->p_exp = sg->n_slots >= 2 * W ? 1 : (2 * W + sg->n_slots - 1) / sg->n_slots;
    if (sg->p_exp > 8) sg->p_exp = 8;
    sg->p_sh = c->n_shared_experts > 0 ? (W < 8 ? W : 8) : 0;
    sg->p_head = 2 * W;
    /* attention stages, Engram wkv, router gate: one part per worker (row chunks of >= 16) */
    sg->p_attn = W < MF_SG_MAX_PARTS ? W : MF_SG_MAX_PARTS;
    sg->n_cards = o->n_cards;
    sg->dev_graphs = o->n_cards > 0 && o->dev_graphs;
    sg->n_io_parts = o->store ? MF_SG_EXPERT_PARTS : 0;
    sg->tid_per_slot = 2 * sg->p_exp + 1 + 3 * sg->n_cards;
}

int mf_stepgraph_new(const mf_sg_opts *o, mf_stepgraph **out)
{
    *out = NULL;
    if (o->n < 1 || o->n > MF_SG_MAX_ITEMS || o->n_cards < 0 || o->n_cards > MF_SG_MAX_CARDS)
        return mf_error(-EINVAL, "step graph: %d items, %d cards (expected 1..%d, 0..%d)", o->n, o->n_cards,
                        MF_SG_MAX_ITEMS, MF_SG_MAX_CARDS);
    for (int k = 0; k < o->n_units; k++)
        if (o->unit_end[k] <= (k ? o->unit_end[k - 1] : 0) || o->unit_end[k] > o->n || o->n_units > o->n ||
            (k == o->n_units - 1 && o->unit_end[k] != o->n))
            return mf_error(-EINVAL, "step graph: unit %d of %d ends at item %d (expected increasing, the last at %d)",
                            k, o->n_units, o->unit_end[k], o->n);
    const mf_config *c = o->c;
    mf_stepgraph *sg = calloc(1, sizeof *sg);
    if (!sg) return mf_error(-ENOMEM, "step graph: out of memory");
    sg_parts(o, sg);
    size_t n_tid = (size_t)c->n_layers * sg->n_slots * sg->tid_per_slot;
    sg->slot_tid = malloc(sizeof *sg->slot_tid * n_tid);
    sg->card_ffn_tid = malloc(sizeof *sg->card_ffn_tid * (size_t)c->n_layers * (sg->n_cards ? sg->n_cards : 1));
    sg_builder b = {.o = o, .sg = sg, .u = sg->n_units};
    b.per = (double)o->n / b.u;
    b.io = malloc(sizeof *b.io * ((size_t)sg->n_slots * sg->n_io_parts + 1));
    int rc = !sg->slot_tid || !sg->card_ffn_tid || !b.io ? mf_error(-ENOMEM, "step graph: out of memory")
                                                          : mf_graph_create(o->lanes, o->n_lanes, &sg->g);
    if (rc) {
        free(b.io);
        mf_stepgraph_free(sg);
        return rc;
    }
    for (size_t i = 0; i < n_tid; i++) sg->slot_tid[i] = -1;
    for (int i = 0; i < c->n_layers * sg->n_cards; i++) sg->card_ffn_tid[i] = -1;
    mf_task_id unit[MF_SG_MAX_ITEMS], post[MF_SG_MAX_ITEMS];
    for (int k = 0; k < b.u; k++) unit[k] = -1;
    for (int L = 0; L < c->n_layers && !b.rc; L++) {
        if (mf_config_engram_slot(c, L) >= 0) sg_engram(&b, L, unit);
        sg_attn(&b, L, unit, post);
        sg_moe(&b, L, post, unit);
    }
    sg_head(&b, unit);
    free(b.io);
    rc = b.rc ? b.rc : mf_graph_finalize(sg->g);
    if (rc) {
        mf_stepgraph_free(sg);
        return mf_error_wrap(rc, "step graph: a batch of %d", o->n);
    }
    *out = sg;
    return 0;
}

void mf_stepgraph_free(mf_stepgraph *sg)
{
    if (!sg) return;
    mf_graph_destroy(sg->g);
    free(sg->task);
    free(sg->slot_tid);
    free(sg->card_ffn_tid);
    free(sg);
}

void mf_stepgraph_mark_noop(mf_stepgraph *sg, int L, int n_used, const int32_t *slot_card)
{
    int nc = sg->n_cards, pe = sg->p_exp;
    for (int s = 0; s < sg->n_slots; s++) {
        const mf_task_id *tid = sg->slot_tid + ((size_t)L * sg->n_slots + s) * sg->tid_per_slot;
        int used = s < n_used, card = used && slot_card ? slot_card[s] : -1;
        for (int k = 0; k < 2 * pe + 1; k++) mf_graph_set_noop(sg->g, tid[k], !used || card >= 0);
        for (int cd = 0; cd < nc; cd++)
            for (int k = 0; k < 3; k++)
                if (tid[2 * pe + 1 + 3 * cd + k] >= 0) mf_graph_set_noop(sg->g, tid[2 * pe + 1 + 3 * cd + k], card != cd);
    }
    for (int cd = 0; cd < nc && sg->dev_graphs; cd++) {
        int any = 0;
        for (int s = 0; s < n_used && !any && slot_card; s++) any = slot_card[s] == cd;
        mf_graph_set_noop(sg->g, sg->card_ffn_tid[L * nc + cd], !any);
    }
}

/* ---- lanes and placement ------------------------------------------------------------------- */

void mf_sg_lanes_init(mf_sg_lanes *l, const mf_lane_model models[4], int n_threads, int store, int n_cards)
{
    static const char *const kn[3] = {"h2d", "compute", "d2h"};
    static const mf_lane_kind kk[3] = {MF_LANE_DEV_COPY_IN, MF_LANE_DEV_COMPUTE, MF_LANE_DEV_COPY_OUT};
    memset(l, 0, sizeof *l);
    l->lane[0] = (mf_lane_desc){.kind = MF_LANE_CPU, .name = "cpu", .concurrency = n_threads, .numa_node = -1,
                                .model = models[0]};
    l->n_lanes = 1;
    l->lane_io = -1;
    if (store) {
        l->lane_io = l->n_lanes++;
        l->lane[l->lane_io] = (mf_lane_desc){.kind = MF_LANE_IO, .name = "io", .concurrency = 64, .numa_node = -1,
                                             .model = {.bytes_per_s = 2e9, .latency_ns = 1e5}};
    }
    l->lane_dev0 = l->n_lanes;
    for (int cd = 0; cd < n_cards && cd < MF_SG_MAX_CARDS; cd++)
        for (int k = 0; k < 3; k++) {
            char *nm = l->names[3 * cd + k];
            snprintf(nm, sizeof l->names[0], "dev%d.%s", cd, kn[k]);
            l->lane[l->n_lanes++] = (mf_lane_desc){.kind = kk[k], .name = nm, .concurrency = 4, .numa_node = -1,
                                                   .device = cd, .model = models[k + 1]};
        }
}

static double sg_lane_ns(const mf_lane_model *m, double bytes)
{
    return m->latency_ns + (m->bytes_per_s > 0 ? bytes / m->bytes_per_s * 1e9 : 0);
}

void mf_sg_placer_init(mf_sg_placer *p, const mf_lane_model models[4], int n_threads, int hybrid,
                       double expert_bytes)
{
    memset(p, 0, sizeof *p);
    p->cpu = models[0];
    p->copy = models[1];
    p->comp = models[2];
    p->workers = n_threads;
    p->hybrid = hybrid;
    p->bytes = expert_bytes;
}

int mf_sg_place_want_card(mf_sg_placer *p, int card, int cnt, int cached)
{
    int c = card;
    p->card = c;
    p->host_ns = sg_lane_ns(&p->cpu, p->bytes) * (1 + 0.02 * cnt);
    p->copy_ns = cached ? 0 : sg_lane_ns(&p->copy, p->bytes);
    double comp_ns = sg_lane_ns(&p->comp, p->bytes) * (1 + 0.02 * cnt);
    p->t_dev = (p->copy_q[c] + p->copy_ns > p->comp_q[c] ? p->copy_q[c] + p->copy_ns : p->comp_q[c]) + comp_ns;
    double t_host = (p->host_q + p->host_ns) / p->workers;
    if (p->hybrid && t_host <= p->t_dev) {
        p->host_q += p->host_ns;
        return 0;
    }
    return 1;
}

void mf_sg_place_card(mf_sg_placer *p)
{
    p->copy_q[p->card] += p->copy_ns;
    p->comp_q[p->card] = p->t_dev;
}

void mf_sg_place_host(mf_sg_placer *p)
{
    p->host_q += p->host_ns;
}

void mf_stepgraph_phase_times(const mf_stepgraph *sg, const mf_task_span *spans, mf_task_span *scratch,
                              int64_t *phase_ns, int64_t *busy_ns)
{
    for (int q = 0; q < MF_SG_N_PHASES; q++) {
        int m = 0;
        for (int t = 0; t < sg->n_tasks; t++) {
            const mf_sg_task *r = &sg->task[t];
            if (r->phase != q || spans[t].status != 0 || r->kind == MF_SG_K_IO || r->kind == MF_SG_K_COPY ||
                r->kind == MF_SG_K_COPY_OUT)
                continue;
            busy_ns[q] += spans[t].end_ns - spans[t].start_ns;
            scratch[m++] = spans[t];
        }
        int64_t len;
        mf_timeline_union(scratch, m, &len);
        phase_ns[q] += len;
    }
}
