/* The step graph (graphs/step/stepgraph.h): per layer [engram embed -> wkv parts -> engram gate] ->
 * per item collapse -> attn_norm column parts (and the attention mix's row parts) -> attention
 * stages (in, qb, oa, ob; row parts) around the q norm (scale, column parts), the core's prep
 * (per sequence) and its head groups (per item) -> per item expand/collapse -> ffn_norm column parts (and the ffn mix) ->
 * gate parts -> route -> expert slots ([reads] -> up parts -> join -> down parts, per card in ->
 * ffn -> out) and the shared expert -> moe done -> per item combine column parts; then the final
 * collapse -> norm column parts -> head join -> head parts. One function per sublayer, each
 * returning the tasks it ends with. */
#include "graphs/step/stepgraph.h"

#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/expert_cache.h"
#include "graphs/layers/layers.h"
#include "graphs/model/layout.h"
#include "graphs/step/fast_attn.h"
#include "host/kernels.h"
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
/* The engine's bf16 roundings of the heads' queries and outputs (fast_attn.c mf_fa_bf_n: 8 lanes
 * under AVX2), in vector multiply-adds (host_vec): measured on an AMD EPYC VM (family 25 model 17, 2 vCPUs, load
 * average 4.6) on 2026-12-03 with a micro-benchmark of that loop over one item's 64 x 512 queries in
 * cache, 0.1179 ns per element, against 4-query mf_kern_vec_dots in cache in the same run, 11.04
 * GMAC/s (0.0906 ns): 1.30 (a second run: 1.32). (Scalar mf_bf16_round there: 0.391 ns.)
 * docs/measurements.md, ttftattn; `moeflow bench ref --profile P` times the loop. */
#define SG_W_ROUND_VEC 1.30
/* A value packed to or unpacked from bf16 in a host task (host/kernels.h mf_kern_vec_bf16_pack,
 * _unpack, 8 lanes under AVX2: the dense chains' bf16 copies, mf_sg_attn_buf_bf16), in vector
 * multiply-adds: an estimate, not measured, the rounding's weight (the pack is that rounding and a
 * narrowing store; the unpack a widening shift, cheaper). */
#define SG_W_CAST_VEC SG_W_ROUND_VEC
/* The engine's vector column loops (graphs/step/fast_attn.c, 8 or 4 columns under AVX2), in
 * host_vec multiply-adds: `moeflow bench ref` at flash41's shape (hidden 5120, 4 streams, 6 routed
 * outputs and the shared one, in cache) against 4-query in-cache mf_kern_vec_dots in the same run,
 * on an AMD EPYC VM (family 25 model 17, 2 vCPUs shared, load average 0.3-0.5) on 2026-12-03, the
 * median of four runs (dots at 11.97, 10.79, 11.53, 10.07 GMAC/s; combine 4.10 2.71 3.69 4.31,
 * expand 19.17 9.99 14.15 12.28, collapse 2.42 1.52 1.78 1.56, norm 8.47 5.71 5.87 5.46;
 * docs/measurements.md, vecprice). The combine's sum per column and summed output (its rounding, the double
 * add; the sum's rounding shared out), the expand and the collapse per column and stream, a norm's
 * column loop per column (its sum of squares over all columns stays the scalar double loop, host_ref). */
#define SG_W_COMBINE_VEC 3.90
#define SG_W_EXPAND_VEC 13.2
#define SG_W_COLLAPSE_VEC 1.67
#define SG_W_NORM_VEC 5.79
#define SG_W_ROPE 3.0   /* estimate, not measured: REF multiply-adds per roped element (a pair's 4 products and 2 sums) */
#define SG_W_SORT 1.0   /* estimate, not measured: one REF multiply-add per comparison of the top-k's sort */
#define SG_STORE_ALIGN 4096.0   /* host/store.c MF_STORE_SLOT_ALIGN: reads are aligned extents */
#define SG_CARD_ALIGN 256.0     /* a part's alignment in a card's cache slot */
#define SG_MAX_EXP_PARTS 32   /* row parts of one routed expert */
#define SG_MIN_GATHER 4         /* rows of a route's gather part, at least */
#define SG_MAX_MIX 4            /* row parts of a hyper-connection mix */
#define SG_MIN_COLS 64          /* columns of a hyper-connection part, at least */
#define SG_MIN_QCOLS 16         /* columns of a q norm part, at least (tiny's 64: 4 parts) */
#define SG_KEY_WAVES 16         /* index score parts of a long unit: waves of the workers (sg_key_parts) */
#define SG_EG_PASSES 4          /* kernel passes of an Engram wkv block (256 items) */
#define SG_EG_ROW_SPLIT 4       /* row parts of an Engram wkv pass per worker (4 beat 1 on every seed-host figure) */

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
            y->st_out_rows[MF_SG_ST_OA] += (double)t->shape[0];
        }
        if (t->role == MF_ROLE_FP8_WEIGHT || t->role == MF_ROLE_FP8_SCALE) y->oa_fp8_bytes += b;
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
        if (t->role == MF_ROLE_FP8_WEIGHT || t->role == MF_ROLE_LINEAR) y->st_out_rows[st] += (double)t->shape[0];
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
            if (t->role == MF_ROLE_TABLE) y->eng_row_code_bytes += b / (double)t->shape[0];
        }
    } else if (t->role == MF_ROLE_LINEAR && strstr(nm, ".ffn.gate.")) {
        y->gate_bytes += b;
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

double mf_sg_pos_flops(const mf_config *c, const mf_sg_task *t, int p_key, int64_t pos)
{
    int card_heads = t->op == MF_SG_DENSE && t->dense == MF_SG_D_HEADS;
    if (t->op != MF_SG_ATTN_HEADS && t->op != MF_SG_ATTN_SCORE && t->op != MF_SG_ATTN_SELECT && !card_heads) return 0;
    int L = t->layer;
    double D = c->head_dim, items = t->i1 - t->i0;
    int64_t W = c->sliding_window, n_win = pos + 1 < W ? pos + 1 : W, n_sel = 0, n_vis = 0;
    int ratio = c->compress_ratios[L];
    if (ratio > 0) {
        n_vis = (pos + 1) / ratio;
        n_sel = n_vis < c->index_topk ? n_vis : c->index_topk;
    }
    if (t->op == MF_SG_ATTN_HEADS || card_heads)   /* per head: scores and weighted values over the entries */
        return items * (double)(t->r1 - t->r0) / D * 2.0 * D * (double)(n_win + n_sel);
    if (t->op == MF_SG_ATTN_SCORE) {   /* its range of the visible entries, as the engine splits them */
        double n = (double)(n_vis * (t->part + 1) / p_key - n_vis * t->part / p_key);
        return items * n * c->index_n_heads * c->index_head_dim;
    }
    /* the select: the picks sorted (qsort), SG_W_SORT per comparison */
    return items * SG_W_SORT * (double)n_vis * log2((double)n_vis + 1);
}

const char *mf_sg_op_name(int op)
{
    static const char *const names[] = {"engram_embed", "engram_rows", "engram_gate", "engram_plan", "engram_read", "attn_pre", "attn_rows", "attn_qnorm", "attn_core", "attn_post", "gate_rows", "route", "moe_done", "slot_read", "slot_up", "slot_join", "slot_down", "dev_in", "dev_ffn", "dev_ffn_card", "dev_out", "shared_up", "shared_down", "combine", "norm", "head", "join", "attn_mix", "attn_norm", "attn_heads", "attn_ring", "ffn_mix", "ffn_norm", "attn_score", "attn_select", "dense_in", "dense", "dense_out", "attn_qscale", "attn_kv", "attn_gather", "attn_qprep", "attn_opost", "route_rows", "moe_place", "dev_pre", "attn_keys"};
    _Static_assert(sizeof names / sizeof names[0] == MF_SG_N_OPS, "one name per mf_sg_op");
    return (unsigned)op < MF_SG_N_OPS ? names[op] : "?";
}

int mf_sg_op_per_item(int op)
{
    switch (op) {
    case MF_SG_ATTN_PRE: case MF_SG_ATTN_POST: case MF_SG_COMBINE: case MF_SG_NORM: case MF_SG_ATTN_MIX:
    case MF_SG_ATTN_NORM: case MF_SG_ATTN_HEADS: case MF_SG_FFN_MIX: case MF_SG_FFN_NORM: case MF_SG_ATTN_SCORE:
    case MF_SG_ATTN_QNORM: case MF_SG_ATTN_QPREP: case MF_SG_ATTN_OPOST:
        return 1;
    default:
        return 0;
    }
}

int mf_sg_layer_scored(const mf_config *c, int L)
{
    return c->compress_ratios[L] > 0 && mf_config_is_index_source(c, L);
}

int mf_sg_stage_rows(const int64_t *rows, int n_lin, int parts, int n_sockets, int p, int64_t *r0, int64_t *r1)
{
    assert(n_lin >= 1 && n_lin <= MF_SG_MAX_STAGE_LIN);
    int S = n_sockets > 1 ? n_sockets : 1, per = parts / S > 0 ? parts / S : 1, k = p / per;
    if (k >= S) k = S - 1;
    int64_t a[MF_SG_MAX_STAGE_LIN], b[MF_SG_MAX_STAGE_LIN], total = 0, lo, hi, off = 0;
    for (int l = 0; l < n_lin; l++) {   /* socket k's share of each linear, one after another */
        mf_topo_rows(rows[l], S, k, &a[l], &b[l]);
        total += b[l] - a[l];
    }
    mf_sg_rows(total, per, p - k * per, &lo, &hi);
    for (int l = 0; l < n_lin; l++) {
        int64_t n = b[l] - a[l], x = lo - off, y = hi - off;
        x = x < 0 ? 0 : x > n ? n : x;
        y = y < x ? x : y > n ? n : y;
        r0[l] = a[l] + x;
        r1[l] = a[l] + y;
        off += n;
    }
    return k;
}

int mf_sg_expert_rows(int64_t n_rows, int parts, int n_sockets, int p, int64_t *r0, int64_t *r1)
{
    return mf_sg_stage_rows(&n_rows, 1, parts, n_sockets, p, r0, r1);
}

void mf_sg_rows(int64_t n_rows, int parts, int p, int64_t *r0, int64_t *r1)
{
    int64_t chunk = (n_rows + parts - 1) / parts;
    chunk = (chunk + 15) / 16 * 16;
    int64_t a = p * chunk, b = a + chunk;
    *r0 = a < n_rows ? a : n_rows;
    *r1 = b < n_rows ? b : n_rows;
}

/* ---- pricing a record (sched/cost.h; docs/sim.md "Cost formulas") ------------------------- */

double mf_sg_task_ns(const mf_sg_task *t, const mf_cost_model *m, const mf_sg_step_cost *s)
{
    const mf_sg_work *w = &t->w;
    int tok = t->slot_tokens ? s->slot_tokens : t->n_tok;
    switch (t->op) {
    case MF_SG_ENGRAM_READ:   /* streamed tables: a row's codes or scales as an aligned block */
    case MF_SG_SLOT_READ:     /* a store miss: one extent of the slot's expert */
        return mf_cost_disk(m, w->io_bytes, w->io_reads);
    case MF_SG_HEAD:   /* the items with logits (a prefill chunk: none, or the prompt's last) */
        return s->n_head ? mf_cost_host(m, w, s->n_head, 0) : 0;
    case MF_SG_DEV_IN:   /* the expert on a miss (one span or its parts), then the rows and token weights */
        return mf_cost_copy(m, 0, 2 + (s->dev_miss ? (w->copies > 0 ? w->copies : MF_SG_EXPERT_PARTS) : 0),
                            (s->dev_miss ? w->copy_bytes : 0) + tok * w->copy_bytes_tok);
    case MF_SG_DEV_PRE:   /* prefetch: the expert, one span or its parts (noop on a hit or the host) */
        return mf_cost_copy(m, 0, w->copies > 0 ? w->copies : MF_SG_EXPERT_PARTS, w->copy_bytes);
    case MF_SG_DEV_FFN:
        return mf_cost_card(m, w, tok);
    case MF_SG_DEV_FFN_CARD:
        return 0;
    case MF_SG_DEV_OUT:
        return mf_cost_copy(m, 1, 1, tok * w->copy_bytes_tok);
    case MF_SG_DENSE_IN:   /* one small copy of the items' activations (the heads: and the key table;
                            * the index scores: and their positional key table) */
        return mf_cost_act_copy(m, 0, w->copy_bytes + tok * w->copy_bytes_tok + s->pos_bytes);
    case MF_SG_DENSE:   /* the heads' and index scores' positional work at the card's fp32 rate */
        return mf_cost_card(m, w, tok) +
               (t->dense == MF_SG_D_HEADS || t->dense == MF_SG_D_SCORES ? mf_cost_ref(m->p, 1, s->pos_flops) : 0);
    case MF_SG_DENSE_OUT:
        return mf_cost_act_copy(m, 1, tok * w->copy_bytes_tok + s->pos_bytes);
    default:   /* kernels over the record's tokens, scalar work and the positional part of it */
        return mf_cost_host(m, w, tok, s->pos_flops);
    }
}

void mf_sg_expert_work(const mf_config *c, const mf_sg_sizes *sz, mf_work *w)
{
    double H = (double)c->hidden_size, I = (double)c->moe_intermediate_size;
    *w = (mf_work){0};
    w->w_bytes[MF_KF_FP4] = sz->up_bytes + sz->down_bytes;
    w->macs[MF_KF_FP4] = 3 * H * I;
    w->calls[MF_KF_FP4] = 1;
}

/* ---- the builder --------------------------------------------------------------------------- */

typedef struct sg_builder {
    const mf_sg_opts *o;
    mf_stepgraph *sg;
    int cap, rc;
    int u;                       /* item-part tasks per layer part: n (parallel) or 1 */
    double per;                  /* items per item task */
    mf_task_id *io;              /* the layer's IO tasks, n_slots x n_io_parts */
    mf_task_id fmix[MF_SG_MAX_GROUPS][SG_MAX_MIX];   /* the layer's ffn mix parts per item group */
    /* per task: the task a dependency on it waits for (itself, or the last task of a dense chain
     * on a card that it begins: sg_dense_chain), cap entries */
    mf_task_id *exit_of;
    /* per task: the next task of its group (-1: none): the chains of a dense sublayer split by
     * rows link their first tasks (and their card works) so that a dependency on the group's
     * first task is one on every chain (sg_dep), cap entries */
    mf_task_id *next_of;
    mf_task_id moe_in;           /* dense on cards: the layer's copy-in of the MoE input */
    mf_task_id moe_gate;         /* dense on cards: the layer's gate work on its card */
    mf_task_id chain_run;        /* the card work of the last sg_dense_chain */
    mf_task_id eg_card;          /* dense on cards: the last Engram wkv chain (its first task) */
    /* the micro-batch being built: half h (-1: the head, after both), its items [h0, h1) and
     * units [k0, k1); the MoE done of the half built before it (its route waits for it) */
    int h, h0, h1, k0, k1;
    int g0, g1;                  /* its item groups [g0, g1) */
    mf_task_id last_done;
    mf_task_id route, rows;       /* the layer's route task and what its slots' work waits for (the
                                   * rows join, or the route with one gather part) */
    mf_task_id pre_join[MF_SG_MAX_CARDS];   /* prefetch: per card the join of the layer's copies */
    mf_task_id pre_place;                   /* prefetch: the layer's place task (the route reads its placement) */
    mf_task_id *pre_sfx;                    /* prefetch: per expert the join of its card's copies of it and above (sg_prefetch) */
    char name[64];
} sg_builder;

static mf_io_read sg_no_read = {.fd = -1};

/* Adds a task: its record `t` (layer, slot, ... and work; op, phase and kind given here) on
 * `lane`; its priority is the cost model's price of the record, set once the graph is built
 * (sg_set_priorities). Returns its id, or -1 after an error (kept in b->rc). */
/* The item group holding item i. */
static int sg_group_of(const mf_stepgraph *sg, int i)
{
    if (sg->n_groups == sg->n) return i;
    int g = (int)((int64_t)i * sg->n_groups / sg->n);   /* near it: groups are n / n_groups or one more */
    while (g > 0 && i < sg->group_end[g - 1]) g--;
    while (i >= sg->group_end[g]) g++;
    return g;
}

/* The CPU lane of socket key mod n_sockets (mf_sg_opts.n_sockets; lane 0 without sockets). */
static int sg_sock_lane(const sg_builder *b, int key)
{
    return b->o->n_sockets > 1 && b->o->lane_sock ? b->o->lane_sock[key % b->o->n_sockets] : 0;
}

static mf_task_id sg_add(sg_builder *b, int lane, int op, int phase, int kind, mf_sg_task t)
{
    mf_stepgraph *sg = b->sg;
    if (b->rc) return -1;
    if (sg->n_tasks == b->cap) {
        int cap = b->cap ? 2 * b->cap : 1024;
        mf_sg_task *v = realloc(sg->task, sizeof *v * (size_t)cap);
        if (v) sg->task = v;
        mf_task_id *x = v ? realloc(b->exit_of, sizeof *x * (size_t)cap) : NULL;
        if (x) b->exit_of = x;
        mf_task_id *nx = x ? realloc(b->next_of, sizeof *nx * (size_t)cap) : NULL;
        if (!nx) {
            b->rc = mf_error(-ENOMEM, "step graph: out of memory for %d tasks", cap);
            return -1;
        }
        b->next_of = nx;
        b->cap = cap;
    }
    int io = b->o->lanes[lane].kind == MF_LANE_IO;
    int grp = t.i1 > t.i0 && t.i0 < sg->n ? sg_group_of(sg, t.i0) : -1;   /* the task's one item group, or -1 */
    if (grp >= 0 && (t.i0 != (grp ? sg->group_end[grp - 1] : 0) || t.i1 != sg->group_end[grp])) grp = -1;
    if (lane == 0 && b->o->n_sockets > 1 && b->o->lane_sock && t.slot < 0 && (t.part >= 0 || grp >= 0)) {
        double wb = 0;   /* no weights, one item (group) or a part: spread over the sockets (mf_sg_opts.n_sockets) */
        for (int f = 0; f < MF_KF_N; f++) wb += t.w.w_bytes[f];
        if (wb == 0) lane = sg_sock_lane(b, (grp >= 0 ? grp : 0) + (t.part > 0 ? t.part : 0));
    }
    if (sg->n_halves > 1 && b->h >= 0) {   /* which micro-batch, in the trace */
        size_t len = strlen(b->name);
        snprintf(b->name + len, sizeof b->name - len, " mb%d", b->h);
    }
    mf_task_id id = mf_graph_add_task(sg->g, &(mf_task_desc){.name = b->name, .lane = lane,
                                                             .fn = b->o->fn_of && !io ? b->o->fn_of[op] : NULL,
                                                             .arg = io ? &sg_no_read : NULL,
                                                             .place_hint = -1});
    if (id < 0) {
        b->rc = id;
        return -1;
    }
    t.op = (uint8_t)op;
    t.phase = (uint8_t)phase;
    t.kind = (uint8_t)kind;
    t.half = (int8_t)b->h;
    sg->task[id] = t;
    sg->n_tasks = id + 1;
    b->exit_of[id] = id;
    b->next_of[id] = -1;
    return id;
}

/* The CPU lane of the socket that row part p of `parts` of a host matrix computes for
 * (mf_sg_stage_rows), and that socket's rows [*r0, *r1) of the matrix's n_rows (r0 NULL: none). */
static int sg_rows_lane(const sg_builder *b, int64_t n_rows, int parts, int p, int64_t *r0, int64_t *r1)
{
    int S = b->o->n_sockets > 1 && b->o->lane_sock ? b->o->n_sockets : 1;
    int64_t a, e;
    int k = mf_sg_expert_rows(n_rows, parts, S, p, &a, &e);
    if (r0) *r0 = a, *r1 = e;
    return S > 1 ? b->o->lane_sock[k] : 0;
}

/* A record of layer L with nothing else set. */
static mf_sg_task sg_rec(int L)
{
    return (mf_sg_task){.layer = (int16_t)L, .stage = -1, .card = -1, .read = -1, .dense = -1, .slot = -1, .part = -1};
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

/* A task over the items of the micro-batch being built: its items and tokens. */
static void sg_span(const sg_builder *b, mf_sg_task *t)
{
    t->i0 = b->h0;
    t->i1 = b->h1;
    t->n_tok = b->h1 - b->h0;
}

/* The unit holding item group g (groups lie in one unit). */
static int sg_group_unit(const mf_stepgraph *sg, int g)
{
    return mf_stepgraph_unit_of(sg, g ? sg->group_end[g - 1] : 0);
}

static mf_sg_task sg_part(const mf_stepgraph *sg, int L, int g, int64_t n_rows, int parts, int p, int even);

/* Unit k's item groups [*g0, *g1) (groups lie in one unit); returns their count. */
static int sg_unit_groups(const mf_stepgraph *sg, int k, int *g0, int *g1)
{
    int i0 = k > 0 ? sg->unit_end[k - 1] : 0, i1 = sg->unit_end[k];
    *g0 = sg_group_of(sg, i0);
    *g1 = sg_group_of(sg, i1 - 1) + 1;
    return *g1 - *g0;
}

/* after waits for before (for the end of before's chain when before begins a dense chain; for
 * every chain of a group when either begins one: sg_dense_chain). */
static void sg_dep(sg_builder *b, mf_task_id before, mf_task_id after)
{
    if (before < 0 || after < 0) return;
    for (mf_task_id x = before; x >= 0 && !b->rc; x = b->next_of[x])
        for (mf_task_id y = after; y >= 0 && !b->rc; y = b->next_of[y])
            b->rc = mf_graph_add_dep(b->sg->g, b->exit_of[x], y);
}

/* prefetch: experts per join of a card's copies (sg_prefetch) */
#define SG_PRE_BLOCK 4

#define SG_NAME(b, ...) snprintf((b)->name, sizeof (b)->name, __VA_ARGS__)

/* ---- dense work on cards ------------------------------------------------------------------- */

int mf_sg_dense_card(const mf_config *c, int n_cards, int L)
{
    int nl = c->n_layers, pos[MF_CONFIG_MAX_IDS + 2], m = 0;
    if (n_cards < 1 || nl < 1) return 0;
    if (L < 0 || L >= nl) L = nl - 1;
    pos[m++] = 0;   /* candidate first layers, ascending: 0 and the KV sources */
    for (int l = 1; l < nl; l++)
        for (int i = 0; i < c->n_kv_source; i++)
            if (c->kv_source_layer_ids[i] == l && m < MF_CONFIG_MAX_IDS + 1) {
                pos[m++] = l;
                break;
            }
    pos[m] = nl;
    int k = n_cards < m ? n_cards : m;
    /* f[g][j]: the least largest range covering layers [0, pos[j]) with g ranges; arg: its last cut */
    int f[MF_SG_MAX_CARDS + 1][MF_CONFIG_MAX_IDS + 2], arg[MF_SG_MAX_CARDS + 1][MF_CONFIG_MAX_IDS + 2];
    for (int j = 1; j <= m; j++) f[1][j] = pos[j], arg[1][j] = 0;
    for (int g = 2; g <= k; g++)
        for (int j = g; j <= m; j++) {
            f[g][j] = nl + 1;
            for (int i = g - 1; i < j; i++) {
                int v = f[g - 1][i] > pos[j] - pos[i] ? f[g - 1][i] : pos[j] - pos[i];
                if (v < f[g][j]) f[g][j] = v, arg[g][j] = i;
            }
        }
    for (int g = k, j = m; g >= 1; g--) {   /* range g - 1 is [pos[arg], pos[j]) */
        int i = arg[g][j];
        if (L >= pos[i]) return g - 1;
        j = i;
    }
    return 0;
}

static const char *const sg_dense_name[MF_SG_N_DENSE] = {"attn in", "attn qb", "attn oa", "attn ob",
                                                         "gate",    "shared",  "head",    "engram wkv"};

int mf_sg_dense_parts(int n_dense_cards, int split, int dense)
{
    return split == MF_SG_SPLIT_ROWS && dense != MF_SG_D_SHARED && n_dense_cards > 1 ? n_dense_cards : 1;
}

void mf_sg_dense_rows(int parts, int part, int64_t n_rows, int64_t *r0, int64_t *r1)
{
    if (part < 0 || parts <= 1) {
        *r0 = 0;
        *r1 = n_rows;
        return;
    }
    int64_t chunk = (n_rows + parts - 1) / parts;
    chunk = (chunk + 31) / 32 * 32;
    int64_t a = part * chunk, e = a + chunk;
    *r0 = a < n_rows ? a : n_rows;
    *r1 = e < n_rows ? e : n_rows;
}

/* The share of n_rows rows that part k of `parts` owns (mf_sg_dense_rows). */
static double sg_dense_share(int parts, int k, double n_rows)
{
    int64_t r0, r1;
    mf_sg_dense_rows(parts, parts > 1 ? k : -1, (int64_t)n_rows, &r0, &r1);
    return n_rows > 0 ? (double)(r1 - r0) / n_rows : 0;
}

double mf_sg_dense_card_bytes(const mf_config *c, const mf_sg_sizes *sz, int n_cards, int split, int card)
{
    double b = 0;
    for (int L = -1; L < c->n_layers && n_cards > 0; L++) {
        int dense[MF_SG_N_DENSE], nd = 0;
        if (L < 0) dense[nd++] = MF_SG_D_HEAD;
        else
            for (int d = MF_SG_D_ATTN_IN; d <= MF_SG_D_SHARED; d++) dense[nd++] = d;
        if (L >= 0 && mf_config_engram_slot(c, L) >= 0) dense[nd++] = MF_SG_D_ENGRAM;
        for (int i = 0; i < nd; i++) {
            int d = dense[i], parts = mf_sg_dense_parts(n_cards, split, d);
            if (parts == 1 && mf_sg_dense_card(c, n_cards, L) != card) continue;
            double w, rows;
            if (L < 0) {
                w = sz->head_bytes, rows = (double)c->vocab_size;
            } else if (d == MF_SG_D_GATE) {
                w = sz->layer[L].gate_bytes, rows = (double)c->n_routed_experts;
            } else if (d == MF_SG_D_SHARED) {
                w = sz->sh_up_bytes + sz->sh_down_bytes, rows = 1;
            } else if (d == MF_SG_D_ENGRAM) {
                w = sz->layer[L].eng_fp8_bytes, rows = (double)(c->hc_mult + 1) * c->hidden_size;
            } else {
                static const int st_of[4] = {MF_SG_ST_IN, MF_SG_ST_QB, MF_SG_ST_OA, MF_SG_ST_OB};
                const mf_sg_layer_sizes *y = &sz->layer[L];
                int st = st_of[d];
                w = st == MF_SG_ST_OA ? y->oa_fp8_bytes : y->st_fp8_bytes[st] + y->st_bf16_bytes[st];
                rows = y->st_out_rows[st];
            }
            b += w * sg_dense_share(parts, card, rows);
        }
    }
    return b;
}

static size_t sg_al256(size_t b) { return (b + 255) / 256 * 256; }

void mf_sg_card_bufs_of(const mf_sg_card_in *in, mf_sg_card_bufs *b)
{
    const mf_config *c = in->c;
    const mf_stepgraph *sg = in->sg;
    memset(b, 0, sizeof *b);
    size_t n_ = (size_t)sg->n, ln = (size_t)(in->ln > sg->n ? in->ln : sg->n), f = sizeof(float);
    size_t H = (size_t)c->hidden_size, I = (size_t)c->moe_intermediate_size, V = (size_t)c->vocab_size;
    size_t E = (size_t)c->n_routed_experts, Ish = c->n_shared_experts > 0 ? (size_t)in->sh_rows : 0;
    int ex = in->exact;
    /* routed: n x top-k rows */
    size_t nk = n_ * (size_t)c->n_experts_per_tok;
    b->q8_row = mf_dev_ffn_q8_bytes(1, (int)H, (int)I);
    b->x = 0;
    b->w = b->x + sg_al256(nk * H * f);
    b->h = b->w + sg_al256(nk * f);
    b->q = b->h + sg_al256(nk * I * f);
    b->y = b->q + sg_al256(nk * b->q8_row);
    b->x16 = b->y + sg_al256(nk * H * f);
    b->y16 = b->x16 + sg_al256(nk * H * 2);
    b->tab = b->y16 + sg_al256(nk * H * 2);
    b->routed_bytes = b->tab + (in->dev_graphs ? sizeof(mf_dev_ffn_slot) * (size_t)sg->n_slots * (size_t)c->n_layers : 0);
    /* dense: the host's layouts' row lengths, then each copy {bytes, &offset} */
    for (int k = 0; k < MF_LY_A_N; k++) b->ab_ld[k] = (mf_ly_attn_buf_len(c, k) + 15) / 16 * 16;
    if (c->n_engram > 0) {
        b->eg_per = (c->engram_max_ngram_size - 1) * c->engram_n_heads;
        b->eg_emb_ld = ((int64_t)b->eg_per * c->engram_head_dim + 15) / 16 * 16;
        b->eg_kv_ld = ((int64_t)(c->hc_mult + 1) * c->hidden_size + 15) / 16 * 16;
    }
    int64_t ecap = (int64_t)ln * c->index_topk;
    b->hk_ecap = (int)(ecap < MF_SG_HEADS_ENTRIES ? ecap : MF_SG_HEADS_ENTRIES);
    for (int L = 0; L < c->n_layers; L++)   /* a card's items of the index scores at most */
        if (sg->scores_cards[L]) {
            int a, e;
            mf_sg_heads_range(sg->n, sg->scores_cards[L], 0, &a, &e);
            if (e - a > b->sk_rows) b->sk_rows = e - a;
        }
    b->head_rows = in->head_rows > 0 ? in->head_rows : MF_SG_HEAD_ROWS;
    if ((size_t)b->head_rows > n_) b->head_rows = (int)n_;
    struct { size_t bytes, *off; } dt[2 * MF_LY_A_N + 19];
    int m = 0;
    for (int k = 0; k < MF_LY_A_N; k++) dt[m++] = (typeof(dt[0])){ln * (size_t)b->ab_ld[k] * f, &b->ab[k]};
    for (int k = 0; k < MF_LY_A_N; k++)   /* the bf16 copies (the host's mirrors' layouts) */
        dt[m++] = (typeof(dt[0])){mf_sg_attn_buf_bf16(k) ? ln * (size_t)b->ab_ld[k] * 2 : 0, &b->ab16[k]};
    dt[m++] = (typeof(dt[0])){mf_sg_dense_bf16(MF_SG_D_GATE, 0) ? n_ * H * 2 : 0, &b->xin16};
    dt[m++] = (typeof(dt[0])){mf_sg_dense_bf16(MF_SG_D_SHARED, 1) && Ish ? n_ * H * 2 : 0, &b->ys16};
    dt[m++] = (typeof(dt[0])){n_ * H * f, &b->xin};
    dt[m++] = (typeof(dt[0])){n_ * E * f, &b->logits};
    dt[m++] = (typeof(dt[0])){n_ * Ish * f, &b->hs};
    dt[m++] = (typeof(dt[0])){ex ? n_ * Ish * f : 0, &b->gs};
    dt[m++] = (typeof(dt[0])){ex ? n_ * Ish * f : 0, &b->us};
    dt[m++] = (typeof(dt[0])){n_ * H * f, &b->ys};
    dt[m++] = (typeof(dt[0])){n_ * H * f, &b->hn};
    dt[m++] = (typeof(dt[0])){(size_t)b->head_rows * V * f, &b->lbuf};
    size_t eg = c->n_engram > 0 ? ln : 0;   /* one Engram layer's rows: its chains run in turn */
    dt[m++] = (typeof(dt[0])){eg * (size_t)b->eg_emb_ld * f, &b->eg_emb};
    dt[m++] = (typeof(dt[0])){eg * (size_t)b->eg_kv_ld * f, &b->eg_kv};
    int hk = sg->heads_any;   /* the heads' key table, lists, counts, sinks */
    size_t D = (size_t)c->head_dim;
    dt[m++] = (typeof(dt[0])){hk ? ((size_t)c->sliding_window + n_ + (size_t)b->hk_ecap) * D * f : 0, &b->hk_tab};
    dt[m++] = (typeof(dt[0])){hk ? n_ * (size_t)sg->heads_keys * 4 : 0, &b->hk_keys};
    dt[m++] = (typeof(dt[0])){hk ? n_ * 4 : 0, &b->hk_nk};
    dt[m++] = (typeof(dt[0])){hk ? (size_t)c->n_heads * f : 0, &b->hk_sink};
    int sk = sg->scores_any;   /* the index scores' keys, counts, scores */
    dt[m++] = (typeof(dt[0])){sk ? (size_t)MF_SG_SCORE_ENTRIES * (size_t)c->index_head_dim * f : 0, &b->sk_tab};
    dt[m++] = (typeof(dt[0])){sk ? n_ * 4 : 0, &b->sk_nvis};
    dt[m++] = (typeof(dt[0])){sk ? (size_t)b->sk_rows * MF_SG_SCORE_ENTRIES * sizeof(double) : 0, &b->sk_score};
    for (int i = 0; i < m; i++) {
        *dt[i].off = b->dense_bytes;
        b->dense_bytes += sg_al256(dt[i].bytes);
    }
}

int mf_sg_card_reserve(const mf_sg_opts *base, const mf_sg_card_in *in, int chunk, int max_items, double *routed,
                       double *dense)
{
    *routed = *dense = 0;
    const int ns[2] = {chunk, max_items};
    for (int k = 0; k < 2; k++) {
        if (ns[k] < 1) continue;
        mf_sg_opts o = *base;
        o.n = ns[k];
        o.par = k == 1 && ns[k] > 1;
        mf_stepgraph *g = NULL;
        int rc = mf_stepgraph_new(&o, &g);
        if (rc) return mf_error_wrap(rc, "the card buffers of a %s of %d", k ? "decode batch" : "prefill chunk", ns[k]);
        mf_sg_card_in ci = *in;
        ci.sg = g;
        ci.ln = ns[k];
        mf_sg_card_bufs b;
        mf_sg_card_bufs_of(&ci, &b);
        if (base->n_cards) *routed += (double)b.routed_bytes;
        if (base->n_dense_cards) *dense += (double)b.dense_bytes;
        mf_stepgraph_free(g);
    }
    return 0;
}

int mf_sg_attn_buf_bf16(int buf)
{
    return buf == MF_LY_A_IN || buf == MF_LY_A_QR || buf == MF_LY_A_Q || buf == MF_LY_A_QI || buf == MF_LY_A_O ||
           buf == MF_LY_A_Z || buf == MF_LY_A_OUT;
}

int mf_sg_dense_bf16(int dense, int out)
{
    return (dense == MF_SG_D_GATE && !out) || (dense == MF_SG_D_SHARED && out);
}

/* Bytes a value of attention buffer buf travels in (mf_sg_attn_buf_bf16). */
static double sg_attn_val_bytes(int buf) { return mf_sg_attn_buf_bf16(buf) ? 2.0 : 4.0; }

/* The share of the heads' output that part k of `parts` of the grouped wo_a's n_rows rows reads:
 * the groups its rows touch (each group's rows read their own slice of the input). */
static double sg_dense_oa_in_share(const mf_config *c, int parts, int k, double n_rows)
{
    int64_t r0, r1, G = c->o_groups > 0 ? c->o_groups : 1, R = (int64_t)n_rows / G;
    if (parts <= 1 || R < 1) return 1;
    mf_sg_dense_rows(parts, k, (int64_t)n_rows, &r0, &r1);
    return r1 > r0 ? (double)((r1 + R - 1) / R - r0 / R) / (double)G : 0;
}

/* Each member of group g on card cd (a dense chain's first task or card work: its chains, one per
 * card and item block) before `after`. */
static void sg_dense_member_dep(sg_builder *b, mf_task_id g, int cd, mf_task_id after)
{
    for (mf_task_id x = g; x >= 0 && after >= 0 && !b->rc; x = b->next_of[x])
        if (b->sg->task[x].card == cd) b->rc = mf_graph_add_dep(b->sg->g, x, after);
}

/* Each card work of group `after` waits for the members of group `before` on its card. */
static void sg_dense_after(sg_builder *b, mf_task_id before, mf_task_id after)
{
    for (mf_task_id y = after; y >= 0 && before >= 0 && !b->rc; y = b->next_of[y])
        sg_dense_member_dep(b, before, b->sg->task[y].card, y);
}

int mf_sg_dense_blocks(int n, int block_min)
{
    int m = block_min > 0 ? block_min : MF_SG_DENSE_BLOCK, k = n / m;
    return k < 1 ? 1 : k > MF_SG_DENSE_MAX_BLOCKS ? MF_SG_DENSE_MAX_BLOCKS : k;
}

/* Dense sublayer d of layer L (-1: the head) on its card, or with --dense-split rows on every
 * card (mf_sg_dense_parts), each card a chain over its rows (mf_sg_dense_rows of the
 * sublayer's out_tok / 4 output rows; its record's part the card, its work and copy-out that
 * share) per item block of the micro-batch's items (mf_sg_dense_blocks; a block's copy in after
 * the block before's): copy in of in_tok bytes per item (0: none; the card work then waits for
 * after_in's members on its card, the copy-ins of an earlier chain) -> the card's work (record t)
 * -> copy out of the card's rows per item (out_tok 0: none, the output stays on the card), the
 * first out_bf_rows of all the rows as bf16 (2 bytes: mf_sg_attn_buf_bf16), the others fp32;
 * in_tok counts the bytes as they travel. Returns the first chain's first task; the chains' first
 * tasks are a group (a dependency on it is one on each chain's last task, sg_dep), their card
 * works another (b->chain_run its first: sg_dense_after). */
static mf_task_id sg_dense_chain(sg_builder *b, int L, int d, mf_sg_task t, int phase, double in_tok, double out_tok,
                                 mf_task_id after_in, double out_bf_rows)
{
    mf_stepgraph *sg = b->sg;
    int parts = mf_sg_dense_parts(sg->n_dense_cards, sg->dense_split, d);
    int n = b->h1 - b->h0, nb = d == MF_SG_D_HEAD ? 1 : mf_sg_dense_blocks(n, sg->dense_block);
    mf_task_id head = -1, prev_first = -1, prev_run = -1;
    for (int k = 0; k < parts && !b->rc; k++) {
        int cd = parts > 1 ? k : mf_sg_dense_card(b->o->c, sg->n_dense_cards, L), lane = b->o->lane_dev0 + 3 * cd;
        double share = parts > 1 ? sg_dense_share(parts, k, out_tok / 4) : 1;
        mf_task_id prev_in = -1;
        for (int j = 0; j < nb && !b->rc; j++) {
            mf_sg_task r = sg_rec(L);
            r.card = (int8_t)cd;
            r.dense = (int8_t)d;
            r.part = parts > 1 ? k : -1;
            sg_span(b, &r);
            if (nb > 1) {   /* block j's items: n / nb or one more */
                r.i0 = b->h0 + (int)((int64_t)n * j / nb);
                r.i1 = b->h0 + (int)((int64_t)n * (j + 1) / nb);
                r.n_tok = r.i1 - r.i0;
                r.block = (int8_t)j;
            }
            char pre[24], blk[16] = "";
            if (L < 0) snprintf(pre, sizeof pre, "dev%d", cd);
            else snprintf(pre, sizeof pre, "dev%d L%d", cd, L);
            if (nb > 1) snprintf(blk, sizeof blk, " b%d", j);
            mf_task_id in = -1;
            if (in_tok > 0) {
                SG_NAME(b, "%s %s in%s", pre, sg_dense_name[d], blk);
                mf_sg_task ti = r;
                ti.w.copy_bytes_tok =
                    in_tok * (d == MF_SG_D_ATTN_OA ? sg_dense_oa_in_share(b->o->c, parts, k, out_tok / 4) : 1);
                in = sg_add(b, lane, MF_SG_DENSE_IN, phase, MF_SG_K_COPY, ti);
                if (!b->rc && prev_in >= 0) b->rc = mf_graph_add_dep(sg->g, prev_in, in);
                prev_in = in;
            }
            mf_sg_task tk = t;
            tk.card = r.card;
            tk.dense = r.dense;
            tk.part = r.part;
            tk.block = r.block;
            tk.i0 = r.i0;
            tk.i1 = r.i1;
            tk.n_tok = r.n_tok;
            for (int f = 0; f < MF_KF_N; f++) {   /* the card's share of the rows (calls: each card's) */
                tk.w.w_bytes[f] *= share;
                tk.w.macs[f] *= share;
            }
            tk.w.ref_flops *= share * (n > 0 ? (double)r.n_tok / n : 1);   /* over the span: the block's share */
            SG_NAME(b, "%s %s%s", pre, sg_dense_name[d], blk);
            mf_task_id run = sg_add(b, lane + 1, MF_SG_DENSE, phase, MF_SG_K_OTHER, tk), last = run;
            if (in >= 0) {
                if (!b->rc) b->rc = mf_graph_add_dep(sg->g, in, run);
            } else if (after_in >= 0) {
                sg_dense_member_dep(b, after_in, cd, run);
            }
            if (out_tok > 0 && share > 0) {
                SG_NAME(b, "%s %s out%s", pre, sg_dense_name[d], blk);
                mf_sg_task to = r;
                int64_t r0, r1, bf = (int64_t)out_bf_rows;   /* the card's rows, those of them bf16 */
                mf_sg_dense_rows(parts, parts > 1 ? k : -1, (int64_t)(out_tok / 4), &r0, &r1);
                double n_bf = (double)((r1 < bf ? r1 : bf) - (r0 < bf ? r0 : bf));
                to.w.copy_bytes_tok = out_tok * share - 2.0 * n_bf;
                last = sg_add(b, lane + 2, MF_SG_DENSE_OUT, phase, MF_SG_K_COPY_OUT, to);
                if (!b->rc) b->rc = mf_graph_add_dep(sg->g, run, last);
            }
            if (b->rc) break;
            mf_task_id first = in_tok > 0 ? in : run;
            b->exit_of[first] = last;
            if (prev_first >= 0) b->next_of[prev_first] = first;
            if (prev_run >= 0 && prev_run != prev_first) b->next_of[prev_run] = run;
            if (head < 0) head = first, b->chain_run = run;
            prev_first = first;
            prev_run = run;
        }
    }
    return b->rc ? -1 : head;
}

/* The Engram wkv of layer L on the dense cards (sg_dense_chain: on its card, or split by rows on
 * every card), over the micro-batch's items: the embed rows in, the fp8 kernel, the output out
 * (the caller chains it after the previous Engram layer's: the cards hold one layer's rows).
 * Returns the chains' first task (a group: sg_dep). */
static mf_task_id sg_engram_card(sg_builder *b, int L)
{
    const mf_config *c = b->o->c;
    const mf_sg_layer_sizes *y = &b->o->sz->layer[L];
    mf_sg_task t = sg_rec(L);
    sg_span(b, &t);
    t.w.w_bytes[MF_KF_FP8] = y->eng_fp8_bytes;
    t.w.macs[MF_KF_FP8] = y->eng_fp8_macs;
    t.w.calls[MF_KF_FP8] = 1;
    double in_tok = 4.0 * (c->engram_max_ngram_size - 1) * c->engram_n_heads * c->engram_head_dim;
    double out_tok = 4.0 * (c->hc_mult + 1) * (double)c->hidden_size;
    return sg_dense_chain(b, L, MF_SG_D_ENGRAM, t, MF_SG_PH_ENGRAM, in_tok, out_tok, -1, 0);
}

/* The Engram wkv of layer L on the host, per block of eg_block of the micro-batch's items p_eg row
 * parts over the block, each after the embeds (emb[], per unit) of the units its items are in.
 * Returns the blocks; wr[j] is block j's first part (its parts are consecutive tasks). */
static int sg_engram_host(sg_builder *b, int L, const mf_task_id *emb, mf_task_id *wr)
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
            mf_sg_task t = sg_rec(L);
            t.part = p;
            int ln = sg_rows_lane(b, (int64_t)R, sg->p_eg, p, &t.r0, &t.r1);
            t.i0 = i0;
            t.i1 = i1;
            t.n_tok = i1 - i0;
            double f = (double)(t.r1 - t.r0) / R;
            t.w.w_bytes[MF_KF_FP8] = y->eng_fp8_bytes * f;
            t.w.macs[MF_KF_FP8] = y->eng_fp8_macs * f;
            t.w.calls[MF_KF_FP8] = f > 0;
            mf_task_id w = sg_add(b, ln, MF_SG_ENGRAM_ROWS, MF_SG_PH_ENGRAM, MF_SG_K_OTHER, t);
            if (p == 0) wr[j] = w;
            assert(b->rc || w == wr[j] + p);
            for (int k = b->k0; k < b->k1; k++)
                if (sg->unit_end[k] > i0 && (k ? sg->unit_end[k - 1] : 0) < i1) sg_dep(b, emb[k], w);
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
static void sg_engram(sg_builder *b, int L, mf_task_id *unit)
{
    const mf_config *c = b->o->c;
    const mf_sg_layer_sizes *y = &b->o->sz->layer[L];
    mf_stepgraph *sg = b->sg;
    double H = (double)c->hidden_size, per = b->per;
    double rows = (double)(c->engram_max_ngram_size - 1) * c->engram_n_heads;
    mf_task_id emb[MF_SG_MAX_ITEMS], wr[MF_SG_MAX_CHUNK / (SG_EG_PASSES * MF_KERN_TOK_PASS) + 1];   /* wr: each block's first part */
    int nr = sg->eg_reads_per_unit, eslot = mf_config_engram_slot(c, L);
    int g0, g1;   /* a unit's item groups */
    /* a read of a row's codes or its scales: an aligned block each (O_DIRECT) */
    double code_io = ceil(y->eng_row_code_bytes / SG_STORE_ALIGN) * SG_STORE_ALIGN;
    double scale_io = ceil((y->eng_row_bytes - y->eng_row_code_bytes) / SG_STORE_ALIGN) * SG_STORE_ALIGN;
    for (int k = b->k0; k < b->k1; k++) {
        mf_task_id pl = -1;
        if (b->o->eg_reads) {
            SG_NAME(b, sg->par ? "engram L%d plan item %d" : "engram L%d plan", L, k);
            mf_sg_task t = sg_item(b, L, k);
            t.w.ref_flops = per * rows * c->engram_max_ngram_size * 4;   /* hashes, sort */
            pl = sg_add(b, 0, MF_SG_ENGRAM_PLAN, MF_SG_PH_ENGRAM, MF_SG_K_OTHER, t);
        }
        SG_NAME(b, sg->par ? "engram L%d embed item %d" : "engram L%d embed", L, k);
        mf_sg_task t = sg_item(b, L, k);
        t.w.ref_flops = per * rows * c->engram_head_dim * 2;
        if (b->o->eg_reads || b->o->store || sg_unit_groups(sg, k, &g0, &g1) == 1) {
            emb[k] = sg_add(b, 0, MF_SG_ENGRAM_EMBED, MF_SG_PH_ENGRAM, MF_SG_K_OTHER, t);
            sg_dep(b, pl, emb[k]);
        } else {   /* the tables in memory: the unit's items in groups on any worker, then a join */
            SG_NAME(b, "engram L%d embed join", L);
            emb[k] = sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ENGRAM, MF_SG_K_OTHER, sg_rec(L));
            for (int g = g0; g < g1; g++) {
                SG_NAME(b, "engram L%d embed %d", L, g);
                mf_sg_task tg = sg_part(sg, L, g, 0, 1, 0, 1);
                tg.part = -1;
                tg.w.ref_flops = tg.n_tok * rows * c->engram_head_dim * 2;
                mf_task_id e = sg_add(b, 0, MF_SG_ENGRAM_EMBED, MF_SG_PH_ENGRAM, MF_SG_K_OTHER, tg);
                sg_dep(b, e, emb[k]);
            }
        }
        /* the unit's own reads (2 per row of its items); the table's other entries stay -1 */
        int nr_k = 2 * (t.i1 - t.i0) * (int)rows;
        for (int r = 0; b->o->eg_reads && r < nr && r < nr_k; r++) {
            if (sg->par) SG_NAME(b, "engram L%d item %d read %d", L, k, r);
            else SG_NAME(b, "engram L%d read %d", L, r);
            mf_sg_task tr = sg_item(b, L, k);
            tr.n_tok = 0;
            tr.read = (int16_t)r;
            tr.w.io_bytes = r % 2 ? scale_io : code_io;
            tr.w.io_reads = 1;
            mf_task_id rd = sg_add(b, b->o->lane_io, MF_SG_ENGRAM_READ, MF_SG_PH_ENGRAM, MF_SG_K_IO, tr);
            sg->eg_read_tid[((size_t)eslot * sg->n_units + k) * nr + r] = rd;
            sg_dep(b, pl, rd);
            sg_dep(b, rd, emb[k]);
        }
    }
    /* the wkv: on the host per block of the micro-batch's items its row parts; with dense work on
     * cards one dense chain, after the previous Engram chain (the cards hold one layer's rows) */
    int nb = 1;
    if (sg->n_dense_cards > 0) {
        wr[0] = sg_engram_card(b, L);
        for (int k = b->k0; k < b->k1; k++) sg_dep(b, emb[k], wr[0]);
        sg_dep(b, b->eg_card, wr[0]);
        b->eg_card = wr[0];
    } else {
        nb = sg_engram_host(b, L, emb, wr);
    }
    for (int k = b->k0; k < b->k1; k++) {
        /* the gate per item group (one task when the unit is one group), joined for the unit */
        int ng = sg_unit_groups(sg, k, &g0, &g1);
        mf_task_id prev = unit[k];   /* the streams' last writer */
        if (ng > 1) {
            SG_NAME(b, "engram L%d gate join", L);
            unit[k] = sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ENGRAM, MF_SG_K_OTHER, sg_rec(L));
        }
        for (int g = g0; g < g1; g++) {
            if (ng > 1) SG_NAME(b, "engram L%d gate %d", L, g);
            else SG_NAME(b, sg->par ? "engram L%d gate item %d" : "engram L%d gate", L, k);
            mf_sg_task t = ng > 1 ? sg_part(sg, L, g, 0, 1, 0, 1) : sg_item(b, L, k);
            double items = t.i1 - t.i0;
            t.part = -1;
            t.n_tok = 1;   /* the q/k weights once per item */
            t.w.w_bytes[MF_KF_BF16] = items * y->eng_bf16_bytes;
            t.w.calls[MF_KF_BF16] = items;
            t.w.ref_flops = items * (6.0 * (c->hc_mult + 1) * H + SG_W_ROUND * (c->hc_mult + 1.0) * H);
            /* on socket g mod n_sockets's lane like the tasks without weights: its q and k weights
             * (2 hc H bf16 values, 80 KiB at flash41, socket 0's) stay in a worker's cache over its
             * items; on socket 0 alone a long unit's 128 groups were 6 waves of its 22 workers */
            mf_task_id gt = sg_add(b, sg_sock_lane(b, g), MF_SG_ENGRAM_GATE, MF_SG_PH_ENGRAM, MF_SG_K_OTHER, t);
            if (sg->n_dense_cards) sg_dep(b, wr[0], gt);   /* the card chains' ends */
            for (int j = 0; j < nb && !sg->n_dense_cards; j++) {   /* the host blocks that hold its items */
                int i0 = b->h0 + j * sg->eg_block, i1 = i0 + sg->eg_block;
                for (int p = 0; p < sg->p_eg && t.i0 < i1 && t.i1 > i0; p++) sg_dep(b, wr[j] + p, gt);
            }
            sg_dep(b, prev, gt);
            if (ng > 1) sg_dep(b, gt, unit[k]);
            else unit[k] = gt;
        }
    }
}

/* Stage st of layer L on its card (split by rows: on every card, sg_dense_chain), over all items:
 * its kernels (oa: the grouped wo_a as an fp8 kernel), their output roundings; in and qb copy
 * their input in and outputs out, oa its input in (its output stays for ob; split by rows: out, and
 * ob copies all of it in), ob its output out; the bf16 ones in 2 bytes a value (mf_sg_attn_buf_bf16). */
static mf_task_id sg_attn_card(sg_builder *b, int L, int st)
{
    const mf_config *c = b->o->c;
    const mf_sg_layer_sizes *y = &b->o->sz->layer[L];
    int n = b->h1 - b->h0, rows = mf_sg_dense_parts(b->sg->n_dense_cards, b->sg->dense_split, MF_SG_D_ATTN_OA) > 1;
    mf_sg_task t = sg_rec(L);
    t.stage = (int8_t)st;
    double in_tok = 0, out_tok = 0, out_bf = 0;
    if (st == MF_SG_ST_OA) {
        t.w.w_bytes[MF_KF_FP8] = y->oa_fp8_bytes;
        t.w.macs[MF_KF_FP8] = y->attn_ref_macs;
        t.w.calls[MF_KF_FP8] = 1;
        t.w.ref_flops = n * SG_W_ROUND * (double)c->o_groups * c->o_lora_rank;
        in_tok = sg_attn_val_bytes(MF_LY_A_O) * c->n_heads * c->head_dim;
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
        in_tok = st == MF_SG_ST_IN   ? sg_attn_val_bytes(MF_LY_A_IN) * c->hidden_size
                 : st == MF_SG_ST_QB ? sg_attn_val_bytes(MF_LY_A_QR) * c->q_lora_rank
                 : rows              ? sg_attn_val_bytes(MF_LY_A_Z) * y->st_out_rows[MF_SG_ST_OA]
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
    return sg_dense_chain(b, L, dense_of[st], t, MF_SG_PH_ATTN, in_tok, out_tok, -1, out_bf);
}

/* Stage st's part p of layer L over all items: the stage's kernels split evenly over the parts
 * (oa: the reference's scalar grouped rows), their output roundings. */
static mf_task_id sg_attn_rows(sg_builder *b, int L, int st, int p)
{
    static const char *const st_name[4] = {"in", "qb", "oa", "ob"};
    const mf_config *c = b->o->c;
    const mf_sg_layer_sizes *y = &b->o->sz->layer[L];
    int n = b->h1 - b->h0, parts = b->sg->p_attn;
    if (b->sg->n_dense_cards) return p == 0 ? sg_attn_card(b, L, st) : -1;
    SG_NAME(b, "attn L%d %s %d", L, st_name[st], p);
    mf_sg_task t = sg_rec(L);
    t.stage = (int8_t)st;
    t.part = p;
    sg_span(b, &t);
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
    return sg_add(b, sg_rows_lane(b, 1, parts, p, NULL, NULL), MF_SG_ATTN_ROWS, MF_SG_PH_ATTN, MF_SG_K_OTHER, t);
}

/* Part p of `parts` of an item's n_rows output rows (columns of the hidden size, rows of a mix):
 * the per-item task record of item group g (its items and tokens; the caller's work per item
 * times them). Columns split as mf_sg_rows; mixes (a few rows) evenly. */
static mf_sg_task sg_part(const mf_stepgraph *sg, int L, int g, int64_t n_rows, int parts, int p, int even)
{
    mf_sg_task t = sg_rec(L);
    t.i0 = g > 0 ? sg->group_end[g - 1] : 0;
    t.i1 = sg->group_end[g];
    t.n_tok = t.i1 - t.i0;
    t.part = p;
    if (even) {
        t.r0 = n_rows * p / parts;
        t.r1 = n_rows * (p + 1) / parts;
    } else {
        mf_sg_rows(n_rows, parts, p, &t.r0, &t.r1);
    }
    return t;
}

/* Item group i's collapse (MF_SG_ATTN_PRE, after `after`) -> norm `op` column parts, into nrm[]:
 * layer L's attention input (phase attn) or, at L = -1, the final norm (phase head). */
/* A norm part of `cols` columns: the sum of squares over all H columns (the scalar double loop),
 * the columns as mf_ly_rmsnorm_cols (exact) or mf_fa_rmsnorm_cols's vector loop. */
static void sg_norm_price(const sg_builder *b, mf_sg_task *t, double H, double cols)
{
    if (b->o->exact) {
        t->w.ref_flops = t->n_tok * (H + cols * (2.0 + 2.0 * SG_W_ROUND));
    } else {
        t->w.ref_flops = t->n_tok * H;
        t->w.vec_flops = t->n_tok * cols * SG_W_NORM_VEC;
    }
}

static void sg_collapse_norm(sg_builder *b, int L, int i, int op, int phase, mf_task_id after, mf_task_id *nrm)
{
    const mf_config *c = b->o->c;
    int pc = b->sg->p_hc;
    double H = (double)c->hidden_size, hc = c->hc_mult;
    mf_task_id col[MF_SG_MAX_PARTS];
    const char *what = L < 0 ? "final" : "attn";
    for (int p = 0; p < pc; p++) {
        SG_NAME(b, L < 0 ? "%s collapse item %d %d" : "%s L%d collapse item %d %d", what, L < 0 ? i : L,
                L < 0 ? p : i, p);
        mf_sg_task t = sg_part(b->sg, L, i, (int64_t)H, pc, p, 0);
        double cols = (double)(t.r1 - t.r0);
        if (b->o->exact) t.w.ref_flops = t.n_tok * cols * (hc + SG_W_ROUND);   /* mf_ly_hc_collapse_cols */
        else t.w.vec_flops = t.n_tok * cols * hc * SG_W_COLLAPSE_VEC;              /* mf_fa_hc_collapse_cols */
        col[p] = sg_add(b, 0, MF_SG_ATTN_PRE, phase, MF_SG_K_OTHER, t);
        sg_dep(b, after, col[p]);
    }
    for (int p = 0; p < pc; p++) {
        SG_NAME(b, L < 0 ? "%s norm item %d %d" : "%s L%d norm item %d %d", what, L < 0 ? i : L, L < 0 ? p : i, p);
        mf_sg_task t = sg_part(b->sg, L, i, (int64_t)H, pc, p, 0);
        double cols = (double)(t.r1 - t.r0);
        sg_norm_price(b, &t, H, cols);
        if (op == MF_SG_ATTN_NORM && b->sg->n_dense_cards && mf_sg_attn_buf_bf16(MF_LY_A_IN))
            t.w.vec_flops += t.n_tok * cols * SG_W_CAST_VEC;   /* its columns packed for the in stage's copy */
        nrm[p] = sg_add(b, 0, op, phase, MF_SG_K_OTHER, t);
        for (int q = 0; q < pc; q++) sg_dep(b, col[q], nrm[p]);
    }
}

/* Item group i's mix of layer L (`op`: attention or ffn) in row parts after after[0..n_after) (each
 * part: the norm of all streams, then its rows), into mix[]. */
static void sg_mix(sg_builder *b, int L, int i, int op, const mf_task_id *after, int n_after, mf_task_id *mix)
{
    const mf_config *c = b->o->c;
    const mf_sg_layer_sizes *y = &b->o->sz->layer[L];
    int pm = b->sg->p_mix;
    double H = (double)c->hidden_size, hc = c->hc_mult, nm = (2.0 + hc) * hc;
    for (int m = 0; m < pm; m++) {
        SG_NAME(b, "%s L%d mix item %d %d", op == MF_SG_ATTN_MIX ? "attn" : "ffn", L, i, m);
        mf_sg_task t = sg_part(b->sg, L, i, (int64_t)nm, pm, m, 1);
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
        mix[m] = sg_add(b, 0, op, MF_SG_PH_ATTN, MF_SG_K_OTHER, t);
        for (int a = 0; a < n_after; a++) sg_dep(b, after[a], mix[m]);
    }
}

/* ---- the heads' scores and values (host or cards) ---------------------------------------- */

#define SG_W_UNPACK 2.0   /* estimate, not measured: REF multiply-adds per element of a packed KV row unpacked */

/* The position the priorities and the heads' placement price the attention at: the window full
 * and every compressed layer's top-k selected. */
static int64_t sg_steady_pos(const mf_config *c)
{
    int64_t pos = c->sliding_window;
    for (int L = 0; L < c->n_layers; L++)
        if ((int64_t)c->compress_ratios[L] * c->index_topk > pos) pos = (int64_t)c->compress_ratios[L] * c->index_topk;
    return pos;
}

/* Keys of an item of layer L at most: the window and, on compressed layers, the top-k. */
static int sg_heads_keys(const mf_config *c, int L)
{
    return c->sliding_window + (c->compress_ratios[L] > 0 ? c->index_topk : 0);
}

void mf_sg_heads_range(int n_heads, int parts, int k, int *h0, int *h1)
{
    int per = n_heads / parts, extra = n_heads % parts;
    *h0 = k * per + (k < extra ? k : extra);
    *h1 = *h0 + per + (k < extra);
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
    case MF_SG_DENSE_IN:
        *bytes = 4.0 * id * last;
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
 * cores of its item groups [gu0, gu1] (gate[]), the keys -> per card (its share of the unit's items,
 * mf_sg_heads_range) copy in -> scores -> copy out -> the join it returns, which the selects wait for. */
static mf_task_id sg_scores_on_cards(sg_builder *b, int L, int k, const mf_task_id *gate, int gu0, int gu1)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    int parts = sg->scores_cards[L], i0 = k > 0 ? sg->unit_end[k - 1] : 0, n = sg->unit_end[k] - i0;
    double ih = c->index_n_heads, id = c->index_head_dim;
    SG_NAME(b, "attn L%d keys", L);
    mf_sg_task tk = sg_item(b, L, k);
    tk.n_tok = 1;
    mf_task_id keys = sg_add(b, 0, MF_SG_ATTN_KEYS, MF_SG_PH_ATTN, MF_SG_K_OTHER, tk);
    for (int i = gu0; i <= gu1; i++)
        if (i == gu0 || gate[i] != gate[i - 1]) sg_dep(b, gate[i], keys);
    SG_NAME(b, "attn L%d scores join", L);
    mf_task_id join = sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ATTN, MF_SG_K_OTHER, sg_rec(L));
    sg_dep(b, keys, join);
    static const int kind_of[3] = {MF_SG_K_COPY, MF_SG_K_OTHER, MF_SG_K_COPY_OUT};
    static const char *const what[3] = {" in", "", " out"};
    for (int p = 0; p < parts && !b->rc; p++) {
        int cd = parts > 1 ? p : mf_sg_dense_card(c, sg->n_dense_cards, L), a, e;
        mf_sg_heads_range(n, parts, p, &a, &e);
        mf_task_id prev = keys;
        for (int q = 0; q < 3 && e > a; q++) {
            mf_sg_task t = sg_rec(L);
            t.i0 = i0 + a;
            t.i1 = i0 + e;
            t.n_tok = e - a;
            t.card = (int8_t)cd;
            t.part = p;
            t.dense = MF_SG_D_SCORES;
            if (q == 0) t.w.copy_bytes_tok = 4.0 * (ih * id + ih + 1);   /* queries, weights, count */
            SG_NAME(b, "dev%d L%d scores%s", cd, L, what[q]);
            mf_task_id x = sg_add(b, b->o->lane_dev0 + 3 * cd + q, MF_SG_DENSE_IN + q, MF_SG_PH_ATTN, kind_of[q], t);
            sg_dep(b, prev, x);
            prev = x;
        }
        sg_dep(b, prev, join);
    }
    return join;
}

/* The record of a heads task `op` of layer L over items [i0, i1) and heads [h0, h1) (n items in the
 * unit): MF_SG_ATTN_HEADS on the host; the cards' path MF_SG_ATTN_GATHER, MF_SG_ATTN_QPREP,
 * MF_SG_DENSE_IN / MF_SG_DENSE / MF_SG_DENSE_OUT of MF_SG_D_HEADS, MF_SG_ATTN_OPOST. The work of
 * the scores and values is positional (mf_sg_pos_flops); the key table is priced at the steady
 * state (the ring's rows before the chunk, the chunk's rows, top-k entries: a long chunk's union
 * of selections can be larger, up to its last item's visible entries). */
static mf_sg_task sg_heads_rec(const mf_config *c, int L, int op, int i0, int i1, int h0, int h1, int n, int exact)
{
    double D = c->head_dim, rd = c->qk_rope_head_dim, W = c->sliding_window, nh = c->n_heads;
    double keys = sg_heads_keys(c, L), sel = c->compress_ratios[L] > 0 ? c->index_topk : 0, hh = h1 - h0;
    mf_sg_task t = sg_rec(L);
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
        t.w.copy_bytes_tok = sg_attn_val_bytes(MF_LY_A_Q) * hh * D + 4.0 * (keys + 1);
        break;
    case MF_SG_DENSE:
        t.dense = MF_SG_D_HEADS;
        break;
    case MF_SG_DENSE_OUT:
        t.dense = MF_SG_D_HEADS;
        t.w.copy_bytes_tok = sg_attn_val_bytes(MF_LY_A_O) * hh * D;
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
static void sg_heads_host_cast(mf_sg_task *t)
{
    double vals = t->n_tok * (double)(t->r1 - t->r0);   /* r0, r1: the heads' rows of D each */
    t->w.vec_flops += vals * SG_W_CAST_VEC * (mf_sg_attn_buf_bf16(MF_LY_A_Q) + mf_sg_attn_buf_bf16(MF_LY_A_O));
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
    int units = o->n_units > 0 ? o->n_units : o->par ? o->n : 1;
    if (nc < 1 || o->exact || units != 1 || o->heads == MF_SG_HEADS_HOST || L < 0 || L >= c->n_layers) return 0;
    if (D % 16 || D > MF_DEV_ATTN_MAX_D || c->qk_rope_head_dim / 2 > 64 || sg_heads_keys(c, L) > MF_DEV_ATTN_MAX_KEYS)
        return 0;
    if (o->heads == MF_SG_HEADS_CARDS) return nc;
    const mf_profile *p = o->profile ? o->profile : mf_cost_default_profile();
    mf_cost_model m = {.p = p, .host_bytes_per_s = mf_cost_thread_share(p, o->n_threads)};
    double W = o->n_threads > 0 ? o->n_threads : 1;
    int64_t pos = sg_steady_pos(c);
    mf_sg_task host = sg_heads_rec(c, L, MF_SG_ATTN_HEADS, 0, n, 0, nh, n, 0);
    sg_heads_host_cast(&host);
    double best = sg_heads_ns(c, &m, &host, pos) / W;   /* the host's head tasks over the workers */
    int choice = 0;
    for (int parts = 1; parts <= nc; parts = parts < nc ? nc : nc + 1) {
        mf_sg_task g = sg_heads_rec(c, L, MF_SG_ATTN_GATHER, 0, n, 0, nh, n, 0);
        mf_sg_task qp = sg_heads_rec(c, L, MF_SG_ATTN_QPREP, 0, n, 0, nh, n, 0);
        mf_sg_task op = sg_heads_rec(c, L, MF_SG_ATTN_OPOST, 0, n, 0, nh, n, 0);
        double ns = sg_heads_ns(c, &m, &g, pos) + (sg_heads_ns(c, &m, &qp, pos) + sg_heads_ns(c, &m, &op, pos)) / W;
        double chain = 0;
        for (int k = 0; k < parts; k++) {   /* the chains run side by side: the slowest card's */
            int h0, h1;
            mf_sg_heads_range(nh, parts, k, &h0, &h1);
            double x = 0;
            for (int q = MF_SG_DENSE_IN; q <= MF_SG_DENSE_OUT; q++) {
                mf_sg_task r = sg_heads_rec(c, L, q, 0, n, h0, h1, n, 0);
                x += sg_heads_ns(c, &m, &r, pos);
            }
            chain = x > chain ? x : chain;
        }
        if (ns + chain < best) best = ns + chain, choice = parts;
    }
    return choice;
}

/* The heads of unit k of layer L on the cards (sg->heads_cards[L] of them): after `core`, the
 * gather -> per item group its q prep -> per card copy in -> attention -> copy out -> per item
 * group its o post, before `ring` and the oa stage's tasks oa[0..n_oa). */
static void sg_heads_on_cards(sg_builder *b, int L, int k, mf_task_id core, mf_task_id ring, const mf_task_id *oa,
                              int n_oa)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    int nh = c->n_heads, parts = sg->heads_cards[L], ex = b->o->exact;
    int i0 = k > 0 ? sg->unit_end[k - 1] : 0, i1 = sg->unit_end[k], n = i1 - i0;
    int g0 = sg_group_of(sg, i0), g1 = sg_group_of(sg, i1 - 1) + 1;
    mf_task_id qp[MF_SG_MAX_GROUPS], out[MF_SG_MAX_CARDS * MF_SG_DENSE_MAX_BLOCKS];
    SG_NAME(b, "attn L%d gather", L);
    mf_task_id ga = sg_add(b, 0, MF_SG_ATTN_GATHER, MF_SG_PH_ATTN, MF_SG_K_OTHER,
                           sg_heads_rec(c, L, MF_SG_ATTN_GATHER, i0, i1, 0, nh, n, ex));
    sg_dep(b, core, ga);
    for (int i = g0; i < g1; i++) {
        SG_NAME(b, "attn L%d qprep item %d", L, i);
        qp[i] = sg_add(b, 0, MF_SG_ATTN_QPREP, MF_SG_PH_ATTN, MF_SG_K_OTHER,
                       sg_heads_rec(c, L, MF_SG_ATTN_QPREP, i ? sg->group_end[i - 1] : 0, sg->group_end[i], 0, nh, n, ex));
        sg_dep(b, ga, qp[i]);
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
        int cd = parts > 1 ? p : mf_sg_dense_card(c, sg->n_dense_cards, L), h0, h1;
        mf_sg_heads_range(nh, parts, p, &h0, &h1);
        mf_task_id prev_in = -1;
        for (int j = 0; j < nbk && !b->rc; j++) {
            int j0 = (int)bi0[j], j1 = (int)bi1[j];
            mf_task_id prev = -1;
            for (int q = 0; q < 3; q++) {
                mf_sg_task t = sg_heads_rec(c, L, MF_SG_DENSE_IN + q, j0, j1, h0, h1, n, ex);
                t.card = (int8_t)cd;
                t.part = parts > 1 ? p : -1;
                t.block = (int8_t)j;
                if (j > 0) t.w.copy_bytes = 0;   /* the key table: block 0's */
                if (nbk > 1) SG_NAME(b, "dev%d L%d heads%s%s b%d", cd, L, q == 1 ? "" : " ", what[q], j);
                else SG_NAME(b, "dev%d L%d heads%s%s", cd, L, q == 1 ? "" : " ", what[q]);
                mf_task_id id = sg_add(b, b->o->lane_dev0 + 3 * cd + q, MF_SG_DENSE_IN + q, MF_SG_PH_ATTN, kind_of[q], t);
                if (q == 0) {
                    for (int i = g0; i < g1; i++) {   /* the q preps of the groups it overlaps */
                        int gi0 = i ? sg->group_end[i - 1] : 0, gi1 = sg->group_end[i];
                        if (gi0 < j1 && gi1 > j0) sg_dep(b, qp[i], id);
                    }
                    sg_dep(b, prev_in, id);
                    prev_in = id;
                } else {
                    sg_dep(b, prev, id);
                }
                prev = id;
            }
            out[p * MF_SG_DENSE_MAX_BLOCKS + j] = prev;
        }
    }
    for (int i = g0; i < g1; i++) {
        SG_NAME(b, "attn L%d opost item %d", L, i);
        mf_task_id op = sg_add(b, 0, MF_SG_ATTN_OPOST, MF_SG_PH_ATTN, MF_SG_K_OTHER,
                               sg_heads_rec(c, L, MF_SG_ATTN_OPOST, i ? sg->group_end[i - 1] : 0, sg->group_end[i], 0,
                                            nh, n, ex));
        int gi0 = i ? sg->group_end[i - 1] : 0, gi1 = sg->group_end[i];
        for (int p = 0; p < parts; p++)   /* the blocks it overlaps */
            for (int j = 0; j < nbk; j++)
                if (bi0[j] < gi1 && bi1[j] > gi0) sg_dep(b, out[p * MF_SG_DENSE_MAX_BLOCKS + j], op);
        sg_dep(b, op, ring);
        for (int q = 0; q < n_oa; q++) sg_dep(b, op, oa[q]);
    }
}

/* The attention sublayer of layer L. Per item after unit[] (its unit's): collapse -> attn_norm
 * column parts, and the attention mix in row parts; in parts -> per item group q scale -> q norm
 * column parts -> qb parts; in parts -> per unit kv (window KV, compressor: beside the q path) ->
 * per unit core prep (after kv and qb) -> per item head groups [-> per unit ring] -> oa parts ->
 * oa join -> ob parts; per item post column parts (after ob, its mix, its unit's ring) -> ffn_norm
 * column parts -> per unit post join, into post[]; the ffn mix in row parts (for the combine:
 * b->fmix). */
static void sg_attn(sg_builder *b, int L, const mf_task_id *unit, mf_task_id *post)
{
    const mf_config *c = b->o->c;
    const mf_sg_layer_sizes *y = &b->o->sz->layer[L];
    mf_stepgraph *sg = b->sg;
    int pc = sg->p_hc, pm = sg->p_mix, pa = sg->p_ah;
    double H = (double)c->hidden_size, hc = c->hc_mult, D = c->head_dim, nh = c->n_heads;
    double sink = c->hc_sinkhorn_iters * 4.0 * hc * hc * 2;
    /* rough costs for priorities: reference code ~1 ns per multiply-add, kernels by bytes */
    int index = mf_sg_layer_scored(c, L);
    mf_task_id rows[4][MF_SG_MAX_PARTS], amix[MF_SG_MAX_GROUPS][SG_MAX_MIX], ring[MF_SG_MAX_ITEMS];
    mf_task_id gate[MF_SG_MAX_GROUPS];   /* per item group: the task its heads wait for (core or select) */
    for (int st = 0; st < 4; st++)
        for (int p = 0; p < sg->p_attn; p++) rows[st][p] = sg_attn_rows(b, L, st, p);
    for (int i = b->g0; i < b->g1; i++) {   /* item groups */
        mf_task_id nrm[MF_SG_MAX_PARTS], u = unit[sg_group_unit(sg, i)];
        sg_collapse_norm(b, L, i, MF_SG_ATTN_NORM, MF_SG_PH_ATTN, u, nrm);
        for (int p = 0; p < pc; p++)
            for (int q = 0; q < sg->p_attn; q++) sg_dep(b, nrm[p], rows[MF_SG_ST_IN][q]);
        sg_mix(b, L, i, MF_SG_ATTN_MIX, &u, 1, amix[i]);
    }
    for (int i = b->g0; i < b->g1; i++) {   /* item groups: the q norm's scale -> its column parts */
        SG_NAME(b, "attn L%d q scale item %d", L, i);
        mf_sg_task t = sg_part(sg, L, i, 1, 1, 0, 1);
        t.w.ref_flops = t.n_tok * 2.0 * c->q_lora_rank;
        if (sg->n_dense_cards && mf_sg_attn_buf_bf16(MF_LY_A_QR))   /* in's copy out unpacked */
            t.w.vec_flops = t.n_tok * SG_W_CAST_VEC * c->q_lora_rank;
        mf_task_id qs = sg_add(b, 0, MF_SG_ATTN_QSCALE, MF_SG_PH_ATTN, MF_SG_K_OTHER, t);
        for (int p = 0; p < sg->p_attn; p++) sg_dep(b, rows[MF_SG_ST_IN][p], qs);
        for (int q = 0; q < sg->p_qn; q++) {
            SG_NAME(b, "attn L%d q norm item %d %d", L, i, q);
            mf_sg_task tq = sg_part(sg, L, i, c->q_lora_rank, sg->p_qn, q, 0);
            tq.w.ref_flops = tq.n_tok * (double)(tq.r1 - tq.r0) * (2.0 + 2.0 * SG_W_ROUND);
            if (sg->n_dense_cards && mf_sg_attn_buf_bf16(MF_LY_A_QR))   /* packed for qb's copy in */
                tq.w.vec_flops = tq.n_tok * (double)(tq.r1 - tq.r0) * SG_W_CAST_VEC;
            mf_task_id qn = sg_add(b, 0, MF_SG_ATTN_QNORM, MF_SG_PH_ATTN, MF_SG_K_OTHER, tq);
            sg_dep(b, qs, qn);
            for (int p = 0; p < sg->p_attn; p++) sg_dep(b, qn, rows[MF_SG_ST_QB][p]);
        }
    }
    SG_NAME(b, "attn L%d oa join", L);
    mf_task_id oj = sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ATTN, MF_SG_K_OTHER, sg_rec(L));
    for (int p = 0; p < sg->p_attn; p++) {
        sg_dep(b, rows[MF_SG_ST_OA][p], oj);
        sg_dep(b, oj, rows[MF_SG_ST_OB][p]);
    }
    for (int k = b->k0; k < b->k1; k++) {
        /* each item its window KV (the four roundings of D: two mf_bf_n, 8 lanes under AVX2, the
         * norm's and the fp8 fake-quant's at REF; its RoPE); each compressed entry the compressor's
         * kernels once (the indexer's wk on the entry: one per `ratio` items, mf_ly_compress; ratio 2
         * in a step of one item: half an entry, the mean over steps). With the ring written late
         * (a serial graph of several item groups) the window KV runs per item group (part 0) beside
         * the compressor over the unit in item ranges (part 1: mf_sg_rows of p_attn, each range's
         * items in order), all before a join; else one task (part -1). */
        mf_sg_task t = sg_item(b, L, k);
        double ratio = c->compress_ratios[L];
        int gk0 = sg_group_of(sg, t.i0), gk1 = sg_group_of(sg, t.i1 - 1), split = sg->ring_late && gk1 > gk0;
        int n_cmp = !split ? 0 : ratio > 0 && mf_config_is_kv_source(c, L) ? sg->p_attn : 1;   /* compressor tasks */
        mf_task_id kv = -1;
        if (split) {
            SG_NAME(b, "attn L%d kv join", L);
            kv = sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ATTN, MF_SG_K_OTHER, sg_rec(L));
        }
        for (int w = split ? gk0 : 0; w <= (split ? gk1 + n_cmp : 0) && !b->rc; w++) {
            int comp = split && w > gk1;   /* a compressor task of the split: range w - gk1 - 1 */
            mf_sg_task tw = split && !comp ? sg_part(sg, L, w, 0, 1, 0, 1) : t;
            if (comp) {
                int64_t r0, r1;
                mf_sg_rows(t.i1 - t.i0, n_cmp, w - gk1 - 1, &r0, &r1);
                if (r0 >= r1) continue;   /* the last ranges of a short unit: empty */
                tw.i0 = t.i0 + (int)r0;
                tw.i1 = t.i0 + (int)r1;
            }
            tw.part = split ? comp : -1;
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
            if (!split) SG_NAME(b, sg->par ? "attn L%d kv item %d" : "attn L%d kv", L, k);
            else if (comp) SG_NAME(b, "attn L%d compress %d", L, w - gk1 - 1);
            else SG_NAME(b, "attn L%d kv %d", L, w);
            mf_task_id id = sg_add(b, 0, MF_SG_ATTN_KV, MF_SG_PH_ATTN, MF_SG_K_OTHER, tw);
            for (int p = 0; p < sg->p_attn; p++) sg_dep(b, rows[MF_SG_ST_IN][p], id);
            if (split) sg_dep(b, id, kv);
            else kv = id;
        }
        /* the core's prep and the select: one task per unit when ordered (the hooks in item
         * order), else one per item group, each group's heads after its own (gate[]) */
        int gu0 = sg_group_of(sg, t.i0), gu1 = sg_group_of(sg, t.i1 - 1), whole = b->o->ordered;
        for (int i = gu0; i <= gu1; i++) {
            int solo = whole ? i == gu0 : 1;   /* a task of its own: whole unit, or group i */
            if (solo) {
                SG_NAME(b, sg->par ? "attn L%d core item %d" : whole ? "attn L%d core" : "attn L%d core %d", L,
                        sg->par ? k : i);
                mf_sg_task tc = whole ? sg_item(b, L, k) : sg_part(sg, L, i, 0, 1, 0, 1);
                tc.part = -1;
                tc.n_tok = 1;   /* the index query: not priced (as before the split) */
                if (sg->n_dense_cards && index && mf_sg_attn_buf_bf16(MF_LY_A_QI))   /* its queries unpacked */
                    tc.w.vec_flops = (double)(tc.i1 - tc.i0) * c->index_n_heads * c->index_head_dim * SG_W_CAST_VEC;
                gate[i] = sg_add(b, 0, MF_SG_ATTN_CORE, MF_SG_PH_ATTN, MF_SG_K_OTHER, tc);
                sg_dep(b, kv, gate[i]);
                for (int p = 0; p < sg->p_attn; p++) sg_dep(b, rows[MF_SG_ST_QB][p], gate[i]);
            } else {
                gate[i] = gate[gu0];
            }
        }
        if (index) {   /* the index scores in parts per item group, then the select, before the heads */
            mf_task_id sel = -1, cards = sg->scores_cards[L] ? sg_scores_on_cards(b, L, k, gate, gu0, gu1) : -1;
            for (int i = gu0; i <= gu1; i++) {
                mf_task_id core = gate[i];
                if (!whole || i == gu0) {
                    SG_NAME(b, sg->par ? "attn L%d select item %d" : whole ? "attn L%d select" : "attn L%d select %d",
                            L, sg->par ? k : i);
                    mf_sg_task ts = whole ? sg_item(b, L, k) : sg_part(sg, L, i, 0, 1, 0, 1);
                    ts.part = -1;
                    ts.n_tok = 1;
                    sel = sg_add(b, 0, MF_SG_ATTN_SELECT, MF_SG_PH_ATTN, MF_SG_K_OTHER, ts);
                    sg_dep(b, cards, sel);
                }
                for (int q = 0; q < sg->key_parts[i] && cards < 0; q++) {
                    SG_NAME(b, "attn L%d score item %d %d", L, i, q);
                    mf_sg_task tk = sg_rec(L);
                    tk.i0 = i ? sg->group_end[i - 1] : 0;
                    tk.i1 = sg->group_end[i];
                    tk.n_tok = tk.i1 - tk.i0;
                    tk.part = q;
                    tk.w.extra_vec = !b->o->exact;   /* mf_fa_index_scores: the vector dots */
                    mf_task_id sc = sg_add(b, 0, MF_SG_ATTN_SCORE, MF_SG_PH_ATTN, MF_SG_K_OTHER, tk);
                    sg_dep(b, core, sc);
                    sg_dep(b, sc, sel);
                }
                gate[i] = sel;
            }
            for (int i = gu0; whole && i <= gu1; i++) gate[i] = sel;
        }
        ring[k] = -1;
        if (sg->ring_late) {
            SG_NAME(b, "attn L%d ring", L);
            mf_sg_task tr = sg_item(b, L, k);
            tr.n_tok = 1;
            tr.w.ref_flops = (double)(t.i1 - t.i0) * D;
            ring[k] = sg_add(b, 0, MF_SG_ATTN_RING, MF_SG_PH_ATTN, MF_SG_K_OTHER, tr);
        }
        if (sg->heads_cards[L]) {
            /* the gather reads every item's selection: after all the unit's selects */
            mf_task_id sj = gate[gu0];
            if (gu1 > gu0 && !whole) {
                SG_NAME(b, "attn L%d select join", L);
                sj = sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ATTN, MF_SG_K_OTHER, sg_rec(L));
                for (int i = gu0; i <= gu1; i++) sg_dep(b, gate[i], sj);
            }
            sg_heads_on_cards(b, L, k, sj, ring[k], rows[MF_SG_ST_OA], sg->p_attn);
            continue;
        }
        for (int i = sg_group_of(sg, t.i0); i <= sg_group_of(sg, t.i1 - 1); i++)   /* the unit's groups */
            for (int g = 0; g < pa; g++) {
                SG_NAME(b, "attn L%d heads item %d %d", L, i, g);
                int h0 = g * sg->ah_heads, h1 = h0 + sg->ah_heads < (int)nh ? h0 + sg->ah_heads : (int)nh;
                mf_sg_task th = sg_heads_rec(c, L, MF_SG_ATTN_HEADS, i ? sg->group_end[i - 1] : 0, sg->group_end[i], h0,
                                             h1, t.i1 - t.i0, b->o->exact);
                th.part = g;
                if (sg->n_dense_cards) sg_heads_host_cast(&th);
                mf_task_id hd = sg_add(b, 0, MF_SG_ATTN_HEADS, MF_SG_PH_ATTN, MF_SG_K_OTHER, th);
                sg_dep(b, gate[i], hd);
                sg_dep(b, hd, ring[k]);
                for (int p = 0; p < sg->p_attn; p++) sg_dep(b, hd, rows[MF_SG_ST_OA][p]);
            }
    }
    for (int k = b->k0; k < b->k1; k++) {
        SG_NAME(b, sg->par ? "attn L%d post join item %d" : "attn L%d post join", L, k);
        post[k] = sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_ATTN, MF_SG_K_OTHER, sg_rec(L));
    }
    for (int i = b->g0; i < b->g1; i++) {   /* item groups */
        int u = sg_group_unit(sg, i);
        mf_task_id pst[MF_SG_MAX_PARTS], fin = post[u];
        for (int p = 0; p < pc; p++) {
            SG_NAME(b, "attn L%d post item %d %d", L, i, p);
            mf_sg_task t = sg_part(sg, L, i, (int64_t)H, pc, p, 0);
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
            pst[p] = sg_add(b, 0, MF_SG_ATTN_POST, MF_SG_PH_ATTN, MF_SG_K_OTHER, t);
            for (int q = 0; q < sg->p_attn; q++) sg_dep(b, rows[MF_SG_ST_OB][q], pst[p]);
            for (int m = 0; m < pm; m++) sg_dep(b, amix[i][m], pst[p]);
            sg_dep(b, ring[u], pst[p]);
        }
        for (int p = 0; p < pc; p++) {
            SG_NAME(b, "attn L%d ffn norm item %d %d", L, i, p);
            mf_sg_task t = sg_part(sg, L, i, (int64_t)H, pc, p, 0);
            double cols = (double)(t.r1 - t.r0);
            sg_norm_price(b, &t, H, cols);
            if (sg->n_dense_cards && mf_sg_dense_bf16(MF_SG_D_GATE, 0))
                t.w.vec_flops += t.n_tok * cols * SG_W_CAST_VEC;   /* packed for the gate's copy */
            mf_task_id fn = sg_add(b, 0, MF_SG_FFN_NORM, MF_SG_PH_ATTN, MF_SG_K_OTHER, t);
            for (int q = 0; q < pc; q++) sg_dep(b, pst[q], fn);
            sg_dep(b, fn, fin);
        }
        /* the ffn mix: for the combine, beside the MoE */
        sg_mix(b, L, i, MF_SG_FFN_MIX, pst, pc, b->fmix[i]);
    }
}

/* The router of layer L: gate parts over all items (after post[]) -> route. Returns route. */
static mf_task_id sg_router(sg_builder *b, int L, const mf_task_id *post)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    int n = b->h1 - b->h0, K = c->n_experts_per_tok, E = c->n_routed_experts, pg = sg->p_gather;
    double H = (double)c->hidden_size;
    SG_NAME(b, "route L%d", L);
    mf_sg_task t = sg_rec(L);
    sg_span(b, &t);
    /* top-k and tables; the gather of the n K rows (a copy and a quantize: 2 per value) here with
     * one part, else in its parts; with gather parts and the items in any order (no hooks) the
     * top-k too, in as many item ranges before it (the route's part p >= 0: the items' top-k only) */
    int pt = sg->route_topk ? (pg < n ? pg : n) : 0;
    t.w.ref_flops = n * ((pg > 1 ? 0 : H * K * 2.0) + (pt ? 2.0 * K : 4.0 * E));
    mf_task_id ro = sg_add(b, 0, MF_SG_ROUTE, MF_SG_PH_MOE, MF_SG_K_OTHER, t), tk[MF_SG_MAX_PARTS];
    b->route = ro;
    for (int p = 0; p < pt; p++) {
        SG_NAME(b, "route L%d topk %d", L, p);
        mf_sg_task tp = sg_rec(L);
        tp.i0 = b->h0 + (int)((int64_t)n * p / pt);
        tp.i1 = b->h0 + (int)((int64_t)n * (p + 1) / pt);
        tp.n_tok = tp.i1 - tp.i0;
        tp.part = p;
        tp.w.ref_flops = tp.n_tok * 4.0 * E;
        tk[p] = sg_add(b, 0, MF_SG_ROUTE, MF_SG_PH_MOE, MF_SG_K_OTHER, tp);
        sg_dep(b, tk[p], ro);
    }
    if (sg->prefetch) sg_dep(b, b->pre_place, ro);   /* mf_step_place_pre reads the place task's cards */
    if (pg > 1) {   /* route -> row parts -> rows join: what the slots' work waits for */
        SG_NAME(b, "route L%d rows join", L);
        mf_task_id rj = sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_MOE, MF_SG_K_OTHER, sg_rec(L));
        for (int p = 0; p < pg; p++) {
            SG_NAME(b, "route L%d rows %d", L, p);
            mf_sg_task tg = sg_rec(L);
            sg_span(b, &tg);
            tg.part = p;
            tg.w.ref_flops = n * H * K * 2.0 / pg + n * K;   /* its rows' copy and quantize; the scan of all n K */
            mf_task_id gt = sg_add(b, 0, MF_SG_ROUTE_ROWS, MF_SG_PH_MOE, MF_SG_K_OTHER, tg);
            sg_dep(b, ro, gt);
            sg_dep(b, gt, rj);
        }
        b->rows = rj;
    } else
        b->rows = ro;
    if (sg->n_dense_cards) {   /* on the layer's card: MoE input in, the gate (bf16), logits out */
        t = sg_rec(L);
        double gb = b->o->sz->layer[L].gate_bytes;
        t.w.w_bytes[MF_KF_BF16] = gb;
        t.w.macs[MF_KF_BF16] = H * E;
        t.w.calls[MF_KF_BF16] = 1;
        double vin = mf_sg_dense_bf16(MF_SG_D_GATE, 0) ? 2.0 : 4.0;
        mf_task_id gp = sg_dense_chain(b, L, MF_SG_D_GATE, t, MF_SG_PH_MOE, vin * H, 4.0 * E, -1, 0);
        b->moe_in = gp;
        b->moe_gate = b->chain_run;
        for (int k = b->k0; k < b->k1; k++) sg_dep(b, post[k], gp);
        sg_dep(b, gp, ro);
        for (int p = 0; p < pt; p++) sg_dep(b, gp, tk[p]);
        return ro;
    }
    for (int p = 0; p < sg->p_attn; p++) {
        SG_NAME(b, "gate L%d %d", L, p);
        t = sg_rec(L);
        t.part = p;
        sg_span(b, &t);
        int ln = sg_rows_lane(b, E, sg->p_attn, p, &t.r0, &t.r1);
        t.w.ref_flops = n * SG_W_DOT_BF16 * H * (double)(t.r1 - t.r0);
        mf_task_id gp = sg_add(b, ln, MF_SG_GATE_ROWS, MF_SG_PH_MOE, MF_SG_K_OTHER, t);
        for (int k = b->k0; k < b->k1; k++) sg_dep(b, post[k], gp);
        sg_dep(b, gp, ro);
        for (int q = 0; q < pt; q++) sg_dep(b, gp, tk[q]);
    }
    return ro;
}

/* Slot s of layer L on card cd: in -> ffn (or the card's FFN graph cffn) -> out, between the
 * slot's reads and gathered rows (b->rows) and done. */
static void sg_slot_card(sg_builder *b, int L, int s, int cd, mf_task_id cffn, mf_task_id done)
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
    ti.w.copies = b->o->miss_copies > 0 ? b->o->miss_copies : MF_SG_EXPERT_PARTS;
    ti.w.copy_bytes_tok = mf_sg_slot_tok_bytes(c, 0);
    mf_task_id din = sg_add(b, lane, MF_SG_DEV_IN, MF_SG_PH_MOE, MF_SG_K_COPY, ti);
    mf_task_id dff = cffn;
    if (!sg->dev_graphs) {
        SG_NAME(b, "dev%d L%d slot %d ffn", cd, L, s);
        mf_sg_task tf = t;
        tf.w.w_bytes[MF_KF_FP4] = z->up_bytes + z->down_bytes;
        tf.w.macs[MF_KF_FP4] = 3 * H * I;
        tf.w.calls[MF_KF_FP4] = 1;
        dff = sg_add(b, lane + 1, MF_SG_DEV_FFN, MF_SG_PH_MOE, MF_SG_K_DEV, tf);
    }
    SG_NAME(b, "dev%d L%d slot %d out", cd, L, s);
    mf_sg_task to = t;
    to.w.copy_bytes_tok = mf_sg_slot_tok_bytes(c, 1);
    mf_task_id dout = sg_add(b, lane + 2, MF_SG_DEV_OUT, MF_SG_PH_MOE, MF_SG_K_COPY_OUT, to);
    tid[0] = din;
    tid[1] = sg->dev_graphs ? -1 : dff;
    tid[2] = dout;
    sg_dep(b, b->rows, din);
    if (sg->prefetch) {   /* the expert is in (sg_prefetch's order): the rows only */
        int E = c->n_routed_experts, f = s;
        while (f < E && mf_dev_xcache_owner(sg->n_cards, L, f) != cd) f++;
        sg_dep(b, f < E ? b->pre_sfx[f] : b->pre_join[cd], din);
    }
    for (int j = 0; j < sg->n_io_parts; j++) sg_dep(b, b->io[(size_t)s * sg->n_io_parts + j], din);
    sg_dep(b, din, dff);
    sg_dep(b, dff, dout);
    sg_dep(b, dout, done);
}

/* Slot s of layer L: [reads] -> up parts -> join -> down parts on the host, and per card its
 * device tasks, between route (the reads) or its gathered rows (b->rows: the work) and done. */
static void sg_slot(sg_builder *b, int L, int s, mf_task_id ro, const mf_task_id *cffn, mf_task_id done)
{
    const mf_config *c = b->o->c;
    const mf_sg_sizes *z = b->o->sz;
    mf_stepgraph *sg = b->sg;
    double H = (double)c->hidden_size, I = (double)c->moe_intermediate_size;
    int np = sg->n_io_parts, pe = sg->p_exp;
    int win = b->o->read_window ? b->o->read_window : 2;
    mf_task_id *tid = sg->slot_tid + ((size_t)L * sg->n_slots + s) * sg->tid_per_slot;
    mf_sg_task t = sg_rec(L);
    t.slot = s;
    t.slot_tokens = 1;
    SG_NAME(b, "expert L%d slot %d join", L, s);
    mf_sg_task tj = t;
    tj.w.ref_flops_tok = 2.0 * I;
    mf_task_id jo = tid[2 * pe] = sg_add(b, 0, MF_SG_SLOT_JOIN, MF_SG_PH_MOE, MF_SG_K_EXPERT, tj);
    mf_task_id *io = b->io + (size_t)s * np;
    for (int j = 0; j < np; j++) {
        SG_NAME(b, "read L%d slot %d part %d", L, s, j);
        mf_sg_task tr = t;
        tr.slot_tokens = 0;
        tr.read = (int16_t)j;
        tr.w.io_bytes = ceil(z->part_bytes[j] / SG_STORE_ALIGN) * SG_STORE_ALIGN;
        tr.w.io_reads = 1;
        io[j] = sg_add(b, b->o->lane_io, MF_SG_SLOT_READ, MF_SG_PH_MOE, MF_SG_K_IO, tr);
        sg_dep(b, ro, io[j]);
        /* read window: slot s's reads start once slot s - win's are in, so that the first
         * slots' experts arrive early and their compute overlaps the later reads */
        int first = b->sg->half_slot[b->h];   /* the half's first slot */
        for (int i = 0; win > 0 && s - first >= win && i < np; i++) sg_dep(b, b->io[(size_t)(s - win) * np + i], io[j]);
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
        mf_task_id up = tid[p] = sg_add(b, ln, MF_SG_SLOT_UP, MF_SG_PH_MOE, MF_SG_K_EXPERT, tu);
        SG_NAME(b, "expert L%d slot %d down %d", L, s, p);
        mf_sg_task td = t;
        td.part = p;
        mf_sg_expert_rows((int64_t)H, pe, S, p, &td.r0, &td.r1);
        td.w.w_bytes[MF_KF_FP4] = z->down_bytes / pe;
        td.w.macs[MF_KF_FP4] = H * I / pe;
        td.w.calls[MF_KF_FP4] = 1;
        td.w.ref_flops_tok = SG_W_ROUND * H / pe;   /* each output rounded to bf16 */
        mf_task_id dn = tid[pe + p] = sg_add(b, ln, MF_SG_SLOT_DOWN, MF_SG_PH_MOE, MF_SG_K_EXPERT, td);
        sg_dep(b, b->rows, up);
        for (int j = 0; j < np; j++) sg_dep(b, io[j], up);
        sg_dep(b, up, jo);
        sg_dep(b, jo, dn);
        sg_dep(b, dn, done);
    }
    for (int cd = 0; cd < sg->n_cards; cd++) sg_slot_card(b, L, s, cd, sg->dev_graphs ? cffn[cd] : -1, done);
}

/* The shared expert of layer L: up parts (after post[], and route with a store) -> join -> down
 * parts -> done. */
static void sg_shared(sg_builder *b, int L, const mf_task_id *post, mf_task_id ro, mf_task_id done)
{
    const mf_config *c = b->o->c;
    const mf_sg_sizes *z = b->o->sz;
    mf_stepgraph *sg = b->sg;
    int n = b->h1 - b->h0, ps = sg->p_sh;
    double H = (double)c->hidden_size, I = (double)c->moe_intermediate_size;
    if (sg->n_dense_cards && ps > 0) {   /* on the layer's card, after the gate's copy of the input */
        mf_sg_task t = sg_rec(L);
        t.w.w_bytes[MF_KF_FP8] = z->sh_up_bytes + z->sh_down_bytes;
        t.w.macs[MF_KF_FP8] = 3 * H * z->sh_rows;
        t.w.calls[MF_KF_FP8] = 2;
        t.w.ref_flops = SG_W_ROUND * H * n;
        mf_task_id sc = sg_dense_chain(b, L, MF_SG_D_SHARED, t, MF_SG_PH_MOE, 0, 4.0 * H, b->moe_in,
                                       mf_sg_dense_bf16(MF_SG_D_SHARED, 1) ? H : 0);
        /* the gate first on the card: the routed experts wait for its logits, the shared expert's
         * output only at the layer's end (the upward ranks alone, even from the cost model's
         * prices, put the shared expert first on the built-in machine at batch 16: a critical path
         * counts one slot's chain after the route, not the slots' work sharing the workers) */
        sg_dense_after(b, b->moe_gate, b->chain_run);
        sg_dep(b, sc, done);
        return;
    }
    (void)I;
    SG_NAME(b, "shared L%d join", L);
    mf_task_id sj = sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_MOE, MF_SG_K_OTHER, sg_rec(L));
    for (int p = 0; p < ps; p++) {
        SG_NAME(b, "shared L%d up %d", L, p);
        mf_sg_task t = sg_rec(L);
        t.part = p;
        sg_span(b, &t);
        int ln = sg_rows_lane(b, (int64_t)z->sh_rows, ps, p, &t.r0, &t.r1);
        t.w.w_bytes[MF_KF_FP8] = z->sh_up_bytes / ps;
        t.w.macs[MF_KF_FP8] = 2 * H * z->sh_rows / ps;
        t.w.calls[MF_KF_FP8] = 1;
        mf_task_id up = sg_add(b, ln, MF_SG_SHARED_UP, MF_SG_PH_MOE, MF_SG_K_EXPERT, t);
        SG_NAME(b, "shared L%d down %d", L, p);
        t = sg_rec(L);
        t.part = p;
        sg_span(b, &t);
        ln = sg_rows_lane(b, (int64_t)H, ps, p, &t.r0, &t.r1);
        t.w.w_bytes[MF_KF_FP8] = z->sh_down_bytes / ps;
        t.w.macs[MF_KF_FP8] = H * z->sh_rows / ps;
        t.w.calls[MF_KF_FP8] = 1;
        t.w.ref_flops = SG_W_ROUND * H / ps * n;
        mf_task_id dn = sg_add(b, ln, MF_SG_SHARED_DOWN, MF_SG_PH_MOE, MF_SG_K_EXPERT, t);
        for (int k = b->k0; k < b->k1; k++) sg_dep(b, post[k], up);
        /* streamed experts: the shared expert runs while the routed experts are read */
        if (b->o->store) sg_dep(b, ro, up);
        sg_dep(b, up, sj);
        sg_dep(b, sj, dn);
        sg_dep(b, dn, done);
    }
}

/* Prefetch: layer L's place task (after the previous layer's MoE done: one set of card pins at a
 * time) -> per expert its copy on its owner card's h2d lane -> per card a join, which the slots'
 * copy-ins on that card wait for. Built before the layer's attention, so the copies overlap it. */
static void sg_prefetch(sg_builder *b, int L)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    int E = c->n_routed_experts;
    SG_NAME(b, "moe L%d place", L);
    mf_sg_task t = sg_rec(L);
    sg_span(b, &t);
    t.w.ref_flops = 8.0 * E;   /* the placer's sums and the cache's look-ups per expert */
    mf_task_id pl = sg_add(b, 0, MF_SG_MOE_PLACE, MF_SG_PH_OTHER, MF_SG_K_OTHER, t);
    sg_dep(b, b->last_done, pl);
    b->pre_place = pl;
    for (int cd = 0; cd < sg->n_cards; cd++) {
        SG_NAME(b, "dev%d L%d prefetched", cd, L);
        b->pre_join[cd] = sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_OTHER, MF_SG_K_OTHER, sg_rec(L));
    }
    /* per card its experts in descending order in blocks of SG_PRE_BLOCK, each block's join after
     * the copies of every expert of the card's blocks down to it (b->pre_sfx[e] of each expert e
     * of the block): slot s (whose expert, the slot table's distinct experts ascending, is >= s)
     * on card cd waits for the join of the block of the lowest expert >= s that cd owns
     * (sg_slot_card), so a card starts on its slots while the other copies run. Joins on the
     * copies, not the copies chained, so the copies keep their ranks (the dense chains' copies
     * first) and, equal among themselves, go in the order they are added (a lower id first on
     * ties): descending, the first slots' experts first; and not joins chained, so each waits
     * for one worker once its copies are in (sg_pre_ranks ranks them above the host's experts) */
    mf_task_id pj[MF_SG_MAX_CARDS];
    int nb[MF_SG_MAX_CARDS] = {0};
    for (int e = E - 1; e >= 0; e--) {
        int cd = mf_dev_xcache_owner(sg->n_cards, L, e);
        SG_NAME(b, "dev%d L%d expert %d pre", cd, L, e);
        mf_sg_task tp = sg_rec(L);
        tp.card = (int8_t)cd;
        tp.part = e;
        tp.w.copy_bytes = b->o->sz->xslot_bytes;
        tp.w.copies = b->o->miss_copies > 0 ? b->o->miss_copies : MF_SG_EXPERT_PARTS;
        mf_task_id pt = sg->pre_tid[(size_t)L * E + e] =
            sg_add(b, b->o->lane_dev0 + 3 * cd, MF_SG_DEV_PRE, MF_SG_PH_OTHER, MF_SG_K_COPY, tp);
        sg_dep(b, pl, pt);
        sg_dep(b, pt, b->pre_join[cd]);
        if (nb[cd] == 0) {   /* a new block of the card: its join after every copy of the card so far */
            SG_NAME(b, "dev%d L%d experts %d+ in", cd, L, e);
            pj[cd] = sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_OTHER, MF_SG_K_OTHER, sg_rec(L));
            for (int f = e + 1; f < E; f++)
                if (mf_dev_xcache_owner(sg->n_cards, L, f) == cd) sg_dep(b, sg->pre_tid[(size_t)L * E + f], pj[cd]);
        }
        sg_dep(b, pt, pj[cd]);
        b->pre_sfx[e] = pj[cd];
        nb[cd] = (nb[cd] + 1) % SG_PRE_BLOCK;
    }
}

/* The MoE of layer L: router, slots, shared expert, done, per unit combine (into unit[]). */
static void sg_moe(sg_builder *b, int L, const mf_task_id *post, mf_task_id *unit)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    int K = c->n_experts_per_tok;
    double H = (double)c->hidden_size, hc = c->hc_mult;
    mf_task_id ro = sg_router(b, L, post);
    /* two micro-batches: one MoE at a time (the store's batch, the cards' pins) */
    if (sg->n_halves > 1) sg_dep(b, b->last_done, ro);
    SG_NAME(b, "moe L%d done", L);
    mf_sg_task t = sg_rec(L);
    sg_span(b, &t);
    mf_task_id done = sg_add(b, 0, MF_SG_MOE_DONE, MF_SG_PH_MOE, MF_SG_K_OTHER, t);
    b->last_done = done;
    mf_task_id cffn[MF_SG_MAX_CARDS];   /* graph mode: a card's FFNs of the layer */
    for (int cd = 0; cd < sg->n_cards && sg->dev_graphs; cd++) {
        SG_NAME(b, "dev%d L%d ffn graph", cd, L);
        t = sg_rec(L);
        t.card = (int8_t)cd;
        cffn[cd] = sg->card_ffn_tid[(L * sg->n_halves + b->h) * sg->n_cards + cd] =
            sg_add(b, b->o->lane_dev0 + 3 * cd + 1, MF_SG_DEV_FFN_CARD, MF_SG_PH_MOE, MF_SG_K_DEV, t);
    }
    for (int s = sg->half_slot[b->h]; s < sg->half_slot[b->h + 1]; s++) sg_slot(b, L, s, ro, cffn, done);
    sg_shared(b, L, post, ro, done);
    sg_dep(b, ro, done);
    for (int k = b->k0; k < b->k1; k++) {
        SG_NAME(b, sg->par ? "combine L%d join item %d" : "combine L%d join", L, k);
        unit[k] = sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_MOE, MF_SG_K_OTHER, sg_rec(L));
    }
    double sink = c->hc_sinkhorn_iters * 4.0 * hc * hc * 2;
    for (int i = b->g0; i < b->g1; i++)   /* item groups */
        for (int p = 0; p < sg->p_hc; p++) {
            SG_NAME(b, "combine L%d item %d %d", L, i, p);
            t = sg_part(sg, L, i, (int64_t)H, sg->p_hc, p, 0);
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
            mf_task_id cb = sg_add(b, 0, MF_SG_COMBINE, MF_SG_PH_MOE, MF_SG_K_OTHER, t);
            sg_dep(b, done, cb);
            for (int m = 0; m < sg->p_mix; m++) sg_dep(b, b->fmix[i][m], cb);
            sg_dep(b, cb, unit[sg_group_unit(sg, i)]);
        }
}

/* After the last layer: per item the final collapse -> norm column parts -> head join -> head
 * parts. */
static void sg_head(sg_builder *b, const mf_task_id *unit)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    double H = (double)c->hidden_size, V = (double)c->vocab_size;
    SG_NAME(b, "head join");
    mf_task_id hj = sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_HEAD, MF_SG_K_OTHER, sg_rec(-1));
    for (int i = 0; i < sg->n_groups; i++) {
        mf_task_id nrm[MF_SG_MAX_PARTS];
        sg_collapse_norm(b, -1, i, MF_SG_NORM, MF_SG_PH_HEAD, unit[sg_group_unit(sg, i)], nrm);
        for (int p = 0; p < sg->p_hc; p++) sg_dep(b, nrm[p], hj);
    }
    if (sg->n_dense_cards) {   /* on the last layer's card: the normed rows in, the logits out */
        mf_sg_task t = sg_rec(-1);
        t.w.w_bytes[MF_KF_BF16] = b->o->sz->head_bytes;
        t.w.macs[MF_KF_BF16] = V * H;
        t.w.calls[MF_KF_BF16] = 1;
        sg_dep(b, hj, sg_dense_chain(b, -1, MF_SG_D_HEAD, t, MF_SG_PH_HEAD, 4.0 * H, 4.0 * V, -1, 0));
        return;
    }
    for (int p = 0; p < sg->p_head; p++) {
        SG_NAME(b, "head %d", p);
        mf_sg_task t = sg_rec(-1);
        t.part = p;
        t.n_tok = sg->n;
        int ln = sg_rows_lane(b, (int64_t)V, sg->p_head, p, &t.r0, &t.r1);
        t.w.w_bytes[MF_KF_BF16] = b->o->sz->head_bytes / sg->p_head;
        t.w.macs[MF_KF_BF16] = V * H / sg->p_head;
        t.w.calls[MF_KF_BF16] = 1;
        mf_task_id hd = sg_add(b, ln, MF_SG_HEAD, MF_SG_PH_HEAD, MF_SG_K_OTHER, t);
        sg_dep(b, hj, hd);
    }
}

/* The micro-batches of the shape (o->micro; sg's units set): two halves at the unit boundary
 * whose halves are the most equal in items (the first such), else one; each half's slots. */
static void sg_halves(const mf_sg_opts *o, mf_stepgraph *sg)
{
    const mf_config *c = o->c;
    int K = c->n_experts_per_tok, E = c->n_routed_experts, best = 0;
    sg->n_halves = 1;
    sg->half_end[0] = sg->n;
    sg->half_unit[0] = 0;
    sg->half_unit[1] = sg->n_units;
    for (int k = 1; o->micro == 2 && k < sg->n_units; k++) {   /* half 0: units [0, k) */
        int d = abs(2 * sg->unit_end[k - 1] - sg->n);
        if (!best || d < abs(2 * sg->half_end[0] - sg->n)) {
            best = k;
            sg->half_end[0] = sg->unit_end[k - 1];
        }
    }
    if (best) {
        sg->n_halves = 2;
        sg->half_end[1] = sg->n;
        sg->half_unit[1] = best;
        sg->half_unit[2] = sg->n_units;
    }
    sg->half_slot[0] = 0;
    for (int h = 0; h < sg->n_halves; h++) {
        int items = sg->half_end[h] - (h ? sg->half_end[h - 1] : 0);
        sg->half_slot[h + 1] = sg->half_slot[h] + (items * K < E ? items * K : E);
    }
    sg->n_slots = sg->half_slot[sg->n_halves];
}

/* Parts per task of n tasks on W workers: the fewest from p_min that keep the last wave of the
 * n p tasks at least 95% full, at most p_max. */
static int sg_wave_parts(int n, int W, int p_min, int p_max)
{
    int p = p_min;
    for (; p < p_max; p++) {
        int tasks = n * p, waves = (tasks + W - 1) / W;
        if (tasks >= 0.95 * waves * W) break;
    }
    return p;
}

/* The index score parts of each item group (mf_stepgraph.key_parts): p_key, or in a unit of
 * several groups (a long chunk, its items at consecutive positions) parts by the entries its items
 * see in a unit from position 0 (item j of the unit about (j + 1) / ratio), the unit's
 * SG_KEY_WAVES x W parts shared out so (rounded up): a chunk's last groups see twice the mean, and
 * one part each left them the last of the tasks (128 groups on 44 workers: 387 ms of scores where
 * the work over the workers is 288 ms). A later chunk's groups see about the same: there the
 * parts are finer than they need be, no worse balanced. */
static void sg_key_parts(mf_stepgraph *sg, int W)
{
    for (int k = 0; k < sg->n_units; k++) {
        int i0 = k > 0 ? sg->unit_end[k - 1] : 0, i1 = sg->unit_end[k];
        int g0 = sg_group_of(sg, i0), g1 = sg_group_of(sg, i1 - 1) + 1;
        double n = i1 - i0, total = n * (n + 1) / 2;   /* sum of j + 1 over the unit's items */
        for (int g = g0; g < g1; g++) {
            double a = (g ? sg->group_end[g - 1] : 0) - i0, b = sg->group_end[g] - i0;
            double share = (b * (b + 1) - a * (a + 1)) / 2 / total;
            int q = g1 - g0 > 1 ? (int)ceil(SG_KEY_WAVES * W * share) : sg->p_key;
            sg->key_parts[g] = q < sg->p_key ? sg->p_key : q > MF_SG_MAX_PARTS ? MF_SG_MAX_PARTS : q;
        }
    }
}

#define SG_HEAD_PART_BYTES (16.0 * 1024 * 1024)   /* the head's largest part (sg_parts) */

/* Part counts of the shape (one home: the engine's buffers and the simulator read them here). */
static void sg_parts(const mf_sg_opts *o, mf_stepgraph *sg)
{
    const mf_config *c = o->c;
    int W = o->n_threads > 0 ? o->n_threads : 1;
    sg->n = o->n;
    sg->par = o->par;
    /* units: o's, else n of one item (par) or one of all */
    sg->n_units = o->n_units > 0 ? o->n_units : o->par ? o->n : 1;
    for (int k = 0; k < sg->n_units; k++)
        sg->unit_end[k] = o->n_units > 0 ? o->unit_end[k] : o->par ? k + 1 : o->n;
    /* item groups: one item each, or MF_SG_MAX_GROUPS of consecutive items (one unit: a serial graph) */
    sg->n_groups = o->n < MF_SG_MAX_GROUPS ? o->n : MF_SG_MAX_GROUPS;
    for (int g = 0; g < sg->n_groups; g++)
        sg->group_end[g] = (int)((int64_t)o->n * (g + 1) / sg->n_groups);
    sg_halves(o, sg);
    int ns_half = 0;   /* the larger half's slots: what one MoE runs at a time */
    for (int h = 0; h < sg->n_halves; h++)
        if (sg->half_slot[h + 1] - sg->half_slot[h] > ns_half) ns_half = sg->half_slot[h + 1] - sg->half_slot[h];
    /* split experts by rows when there are fewer slots than two per worker: the fewest parts that
     * give at least two tasks per worker and keep the last wave of tasks at least 95% full (6
     * slots on 44 workers: 8 parts are 48 tasks, a second wave of 4, twice the time; 22 parts
     * are 132, three full waves), at most SG_MAX_EXP_PARTS */
    sg->p_exp = ns_half < 2 * W ? sg_wave_parts(ns_half, W, (2 * W + ns_half - 1) / ns_half, SG_MAX_EXP_PARTS) : 1;
    /* with sockets, a multiple of them: each socket's share of the rows (mf_topo_rows) in equal
     * parts, so that every part lies in one socket's memory */
    int S = o->n_sockets > 1 && o->lane_sock ? o->n_sockets : 1;
    sg->p_exp = (sg->p_exp + S - 1) / S * S;
    /* the dense matrices' row parts likewise (mf_sg_stage_rows; p_attn's cap MF_SG_MAX_PARTS is a
     * multiple of 2, 4 and 8 sockets: with another count the last socket's extra parts are empty) */
    sg->p_sh = c->n_shared_experts > 0 ? ((W < 8 ? W : 8) + S - 1) / S * S : 0;
    /* the head: at least two parts per worker, and parts of at most SG_HEAD_PART_BYTES, so that a
     * worker the machine slows (a neighbour on a VM) holds up the step by at most one such part:
     * on the Intel VM of the third 2026-12-05 session (two workers, demo's 265 MB head), 16-32
     * parts ended the head's phase about 5% sooner than 4 (docs/measurements.md); flash41's
     * 1.32 GB on 44 workers keeps its 88 */
    int ph = 2 * W;
    if (o->sz && o->sz->head_bytes > (double)ph * SG_HEAD_PART_BYTES) ph = (int)ceil(o->sz->head_bytes / SG_HEAD_PART_BYTES);
    sg->p_head = (ph + S - 1) / S * S;
    /* a route's row gather: parts of >= SG_MIN_GATHER rows, at most one per worker (and
     * MF_SG_MAX_PARTS), one (in the route) for a few rows. Before, at most 16 (batch 64's 384
     * rows): an 8192-item chunk's 49,152 rows were 16 parts of 13.5 ms on every layer's path
     * between the gate and the experts (simulated seed host; 44 parts: 5 ms) */
    int max_items = 0;
    for (int h = 0; h < sg->n_halves; h++) {
        int items = sg->half_end[h] - (h ? sg->half_end[h - 1] : 0);
        if (items > max_items) max_items = items;
    }
    int g_rows = max_items * c->n_experts_per_tok;
    sg->p_gather = (g_rows + SG_MIN_GATHER - 1) / SG_MIN_GATHER;
    if (sg->p_gather > W) sg->p_gather = W;
    if (sg->p_gather > MF_SG_MAX_PARTS) sg->p_gather = MF_SG_MAX_PARTS;
    if (sg->p_gather < 1) sg->p_gather = 1;
    /* attention stages, Engram wkv, router gate: one part per worker (row chunks of >= 16) */
    sg->p_attn = ((W < MF_SG_MAX_PARTS ? W : MF_SG_MAX_PARTS) + S - 1) / S * S;
    if (sg->p_attn > MF_SG_MAX_PARTS) sg->p_attn = MF_SG_MAX_PARTS;
    /* the Engram wkv: blocks of SG_EG_PASSES kernel passes, SG_EG_ROW_SPLIT x p_attn row parts
     * per pass of a block (a decode batch of <= 64 items: one block of 4 p_attn parts) */
    sg->eg_block = SG_EG_PASSES * MF_KERN_TOK_PASS;
    int passes = (max_items < sg->eg_block ? max_items : sg->eg_block);
    passes = (passes + MF_KERN_TOK_PASS - 1) / MF_KERN_TOK_PASS;
    sg->p_eg = sg->p_attn * passes * SG_EG_ROW_SPLIT;
    /* per item, the parts that give the workers work when the items are fewer: T = workers per
     * item; hyper-connection columns in chunks of >= SG_MIN_COLS, mixes in up to SG_MAX_MIX row
     * parts, heads in equal groups; the q norm's columns in chunks of >= SG_MIN_QCOLS */
    int T = (W + sg->n_groups - 1) / sg->n_groups, nh = c->n_heads, cols = (int)(c->hidden_size / SG_MIN_COLS);
    int hc_max = cols < 1 ? 1 : cols < MF_SG_MAX_PARTS ? cols : MF_SG_MAX_PARTS;
    sg->p_hc = sg_wave_parts(sg->n_groups, W, T < hc_max ? T : hc_max, hc_max);
    sg->p_mix = sg_wave_parts(sg->n_groups, W, T < SG_MAX_MIX ? T : SG_MAX_MIX, SG_MAX_MIX);
    /* head groups: from T, the fewest that keep the last wave of the groups' tasks 95% full
     * (batch 64 on 44 workers: 2 groups, 128 tasks in three waves, not 64 in two) */
    int ta = sg_wave_parts(sg->n_groups, W, T < nh ? T : nh, nh);
    sg->ah_heads = (nh + ta - 1) / ta;
    sg->p_ah = (nh + sg->ah_heads - 1) / sg->ah_heads;
    int qcols = (int)(c->q_lora_rank / SG_MIN_QCOLS);
    sg->p_qn = T < qcols ? T : qcols > 0 ? qcols : 1;
    if (sg->p_qn > MF_SG_MAX_PARTS) sg->p_qn = MF_SG_MAX_PARTS;
    sg->ring_late = !o->par && o->n > 1;
    sg->p_key = T < MF_SG_MAX_PARTS ? T : MF_SG_MAX_PARTS;
    sg_key_parts(sg, W);
    sg->n_cards = o->n_cards;
    sg->dev_graphs = o->n_cards > 0 && o->dev_graphs;
    sg->n_dense_cards = o->n_dense_cards;
    sg->dense_split = o->dense_split;
    sg->route_topk = sg->p_gather > 1 && !o->ordered;
    sg->dense_block = o->dense_block > 0 ? o->dense_block : MF_SG_DENSE_BLOCK;
    for (int L = 0; L < c->n_layers && L < MF_CONFIG_MAX_LAYERS; L++) {
        sg->heads_cards[L] = (int8_t)mf_sg_heads_choice(o, L);
        if (sg->heads_cards[L] && sg_heads_keys(c, L) > sg->heads_keys) sg->heads_keys = sg_heads_keys(c, L);
        sg->heads_any |= sg->heads_cards[L] > 0;
        sg->scores_cards[L] = (int8_t)mf_sg_scores_choice(o, L, sg->heads_cards[L]);
        sg->scores_any |= sg->scores_cards[L] > 0;
    }
    sg->n_io_parts = o->store ? MF_SG_EXPERT_PARTS : 0;
    sg->tid_per_slot = 2 * sg->p_exp + 1 + 3 * sg->n_cards;
    /* Engram reads: a unit's items x rows x (codes, scales), the table's stride the largest unit's */
    int max_unit = 0;
    for (int k = 0; k < sg->n_units; k++) {
        int len = sg->unit_end[k] - (k ? sg->unit_end[k - 1] : 0);
        if (len > max_unit) max_unit = len;
    }
    sg->eg_reads_per_unit = o->eg_reads ? 2 * max_unit * (c->engram_max_ngram_size - 1) * c->engram_n_heads : 0;
}

/* Prefetch: per layer the links' head start before its route (mf_stepgraph.pre_ahead_ns): how long
 * the layer's attention and Engram take before the route, the longer of the priced host work over
 * the workers and the longest priced path from the layer's place task to its route (the dense
 * chains' copies and card work, which the workers do not shorten), less the most any card's h2d
 * lane copies for them (its dense inputs), at least 0. After finalize (the path reads the
 * graph's edges); 0 or -ENOMEM. */
static int sg_pre_ahead(const mf_sg_opts *o, mf_stepgraph *sg)
{
    int W = o->n_threads > 0 ? o->n_threads : 1, n = sg->n_tasks, nl = o->c->n_layers;
    double cpu[MF_CONFIG_MAX_LAYERS] = {0}, h2d[MF_CONFIG_MAX_LAYERS][MF_SG_MAX_CARDS] = {{0}};
    mf_task_id place[MF_CONFIG_MAX_LAYERS], route[MF_CONFIG_MAX_LAYERS];
    for (int L = 0; L < nl; L++) place[L] = route[L] = -1;
    for (int t = 0; t < n; t++) {
        const mf_sg_task *r = &sg->task[t];
        if (r->layer < 0) continue;
        if (r->op == MF_SG_MOE_PLACE && place[r->layer] < 0) place[r->layer] = t;
        if (r->op == MF_SG_ROUTE && r->part < 0 && route[r->layer] < 0) route[r->layer] = t;
        if (r->phase != MF_SG_PH_ATTN && r->phase != MF_SG_PH_ENGRAM) continue;
        double ns = mf_graph_task(sg->g, t)->cost.time_ns;
        if (r->kind == MF_SG_K_COPY && r->card >= 0) h2d[r->layer][r->card] += ns;
        else if (r->kind != MF_SG_K_COPY_OUT && r->kind != MF_SG_K_DEV && r->kind != MF_SG_K_IO) cpu[r->layer] += ns;
    }
    /* each task's earliest start by the prices with unbounded lanes, in topological order */
    double *top = calloc((size_t)n + 1, sizeof *top);
    int *left = malloc(sizeof *left * ((size_t)n + 1)), *queue = malloc(sizeof *queue * ((size_t)n + 1));
    if (!top || !left || !queue) {
        free(top), free(left), free(queue);
        return mf_error(-ENOMEM, "step graph: out of memory");
    }
    int qh = 0, qt = 0;
    for (int t = 0; t < n; t++)
        if (!(left[t] = mf_graph_n_pred(sg->g, t))) queue[qt++] = t;
    while (qh < qt) {
        int t = queue[qh++], ns = mf_graph_n_succ(sg->g, t);
        const mf_task_id *su = mf_graph_succ(sg->g, t);
        double end = top[t] + mf_graph_task(sg->g, t)->cost.time_ns;
        for (int k = 0; k < ns; k++) {
            if (end > top[su[k]]) top[su[k]] = end;
            if (!--left[su[k]]) queue[qt++] = su[k];
        }
    }
    for (int L = 0; L < nl; L++) {
        double most = 0, path = 0;
        for (int cd = 0; cd < MF_SG_MAX_CARDS; cd++) most = h2d[L][cd] > most ? h2d[L][cd] : most;
        if (place[L] >= 0 && route[L] >= 0)
            path = top[route[L]] - top[place[L]] - mf_graph_task(sg->g, place[L])->cost.time_ns;
        double a = (cpu[L] / W > path ? cpu[L] / W : path) - most;
        sg->pre_ahead_ns[L] = a > 0 ? a : 0;
    }
    free(top), free(left), free(queue);
    return 0;
}

/* Prefetch: each slot's copy-in on a card ranks above the layer's expert copies on that card, and
 * the joins it waits for above it. Its own expert's copy is in once it is ready (sg_prefetch's
 * joins) and its card's FFN waits for it alone, but the copies still queued rank above it by their
 * own cost (an expert's copy takes longer than a slot's rows), so the card would idle until the
 * last of them; and its joins would wait for a worker behind the host's experts. 0 or the
 * graph's error. */
static int sg_pre_ranks(const mf_sg_opts *o, mf_stepgraph *sg)
{
    int E = o->c->n_routed_experts, rc = 0;
    for (int L = 0; L < o->c->n_layers && !rc; L++)
        for (int cd = 0; cd < sg->n_cards && !rc; cd++) {
            double top = 0;
            for (int e = 0; e < E; e++) {
                mf_task_id pt = sg->pre_tid[(size_t)L * E + e];
                if (pt >= 0 && sg->task[pt].card == cd && mf_graph_rank_ns(sg->g, pt) > top) top = mf_graph_rank_ns(sg->g, pt);
            }
            for (int s = 0; s < sg->n_slots && !rc; s++) {
                mf_task_id din = sg->slot_tid[((size_t)L * sg->n_slots + s) * sg->tid_per_slot + 2 * sg->p_exp + 1 + 3 * cd];
                if (din < 0) continue;
                rc = mf_graph_raise_rank(sg->g, din, top + 1);
                /* and the joins it waits for (its copies', its rows') as the highest of them and
                 * the copies: they are free, and would wait for a worker behind the host's experts */
                const mf_task_id *pr = mf_graph_pred(sg->g, din);
                double jr = top + 2;
                for (int k = 0; k < mf_graph_n_pred(sg->g, din); k++)
                    if (sg->task[pr[k]].op == MF_SG_JOIN && mf_graph_rank_ns(sg->g, pr[k]) > jr)
                        jr = mf_graph_rank_ns(sg->g, pr[k]);
                for (int k = 0; k < mf_graph_n_pred(sg->g, din) && !rc; k++)
                    if (sg->task[pr[k]].op == MF_SG_JOIN) rc = mf_graph_raise_rank(sg->g, pr[k], jr);
            }
        }
    return rc;
}

/* The executor's priorities: every task's cost (mf_graph_set_cost, before finalize) is the cost
 * model's price of its record on its lane's side (mf_sg_task_ns) on o->profile, or the built-in
 * machine (mf_cost_default_profile), for what the shape leaves open expected: a slot's tokens the
 * mean n top_k / experts rounded up (at least 1), a copy-in a cache miss, a read a store miss, the
 * head every item's logits, a card's FFN graph its share of the slots, and the attention at its
 * steady state (the window full, the index's top-k selected). 0 or the graph's error. */
static int sg_set_priorities(const mf_sg_opts *o, mf_stepgraph *sg)
{
    const mf_config *c = o->c;
    const mf_profile *p = o->profile ? o->profile : mf_cost_default_profile();
    mf_cost_model m = {.p = p, .host_bytes_per_s = mf_cost_thread_share(p, o->n_threads)};
    int K = c->n_experts_per_tok, E = c->n_routed_experts;
    int tok = (sg->n * K + E - 1) / E;
    mf_sg_step_cost st = {.slot_tokens = tok > 1 ? tok : 1, .n_head = sg->n, .dev_miss = 1};
    int64_t pos = sg_steady_pos(c);
    mf_work ew;
    mf_sg_expert_work(c, o->sz, &ew);
    double ffn_ns = mf_cost_card(&m, &ew, st.slot_tokens);
    int per_card = sg->n_cards ? (sg->n_slots + sg->n_cards - 1) / sg->n_cards : 0;
    for (int t = 0; t < sg->n_tasks; t++) {
        const mf_sg_task *r = &sg->task[t];
        st.pos_flops = mf_sg_pos_flops(c, r, r->op == MF_SG_ATTN_SCORE ? mf_stepgraph_key_parts(sg, r->i0) : 1, pos);
        if (mf_sg_scores_task(r)) mf_sg_scores_pos(c, r, pos, sg->ring_late, &st.pos_flops, &st.pos_bytes);
        else st.pos_bytes = 0;
        double ns = r->op == MF_SG_DEV_FFN_CARD ? per_card * ffn_ns - (per_card - 1) * p->card[MF_KF_FP4].latency_ns
                                                : mf_sg_task_ns(r, &m, &st);
        int rc = mf_graph_set_cost(sg->g, t, (mf_cost){.time_ns = ns});
        if (rc) return rc;
    }
    return 0;
}

/* Builds the chains of micro-batch h next (-1: the head, over all items). */
static void sg_half(sg_builder *b, int h)
{
    const mf_stepgraph *sg = b->sg;
    b->h = h;
    b->h0 = h > 0 ? sg->half_end[h - 1] : 0;
    b->h1 = h >= 0 ? sg->half_end[h] : sg->n;
    b->k0 = h >= 0 ? sg->half_unit[h] : 0;
    b->k1 = h >= 0 ? sg->half_unit[h + 1] : sg->n_units;
    b->per = (double)(b->h1 - b->h0) / (b->k1 - b->k0);
    b->g0 = sg_group_of(sg, b->h0);
    b->g1 = sg_group_of(sg, b->h1 - 1) + 1;
}

int mf_stepgraph_new(const mf_sg_opts *o, mf_stepgraph **out)
{
    *out = NULL;
    int serial = !o->par && o->n_units <= 1, max_n = serial ? MF_SG_MAX_CHUNK : MF_SG_MAX_ITEMS;
    if (o->n < 1 || o->n > max_n || o->n_cards < 0 || o->n_cards > MF_SG_MAX_CARDS)
        return mf_error(-EINVAL, "step graph: %d items (%s), %d cards (expected 1..%d, 0..%d)", o->n,
                        serial ? "one sequence" : "several units", o->n_cards, max_n, MF_SG_MAX_CARDS);
    if (o->n_dense_cards < 0 || o->n_dense_cards > MF_SG_MAX_CARDS ||
        (o->n_dense_cards && o->lane_dev0 + 3 * o->n_dense_cards > o->n_lanes))
        return mf_error(-EINVAL, "step graph: dense work on %d cards, lanes for %d (expected 0..%d, with lanes)",
                        o->n_dense_cards, (o->n_lanes - o->lane_dev0) / 3, MF_SG_MAX_CARDS);
    if (o->dense_split != MF_SG_SPLIT_LAYERS && o->dense_split != MF_SG_SPLIT_ROWS)
        return mf_error(-EINVAL, "step graph: dense split %d (expected layers or rows)", o->dense_split);
    for (int k = 0; k < o->n_units; k++)
        if (o->unit_end[k] <= (k ? o->unit_end[k - 1] : 0) || o->unit_end[k] > o->n || o->n_units > o->n ||
            (k == o->n_units - 1 && o->unit_end[k] != o->n))
            return mf_error(-EINVAL, "step graph: unit %d of %d ends at item %d (expected increasing, the last at %d)",
                            k, o->n_units, o->unit_end[k], o->n);
    if (o->micro < 0 || o->micro > 2)
        return mf_error(-EINVAL, "step graph: %d micro-batches (expected 1 or 2)", o->micro);
    const mf_config *c = o->c;
    mf_stepgraph *sg = calloc(1, sizeof *sg);
    if (!sg) return mf_error(-ENOMEM, "step graph: out of memory");
    sg_parts(o, sg);
    sg->prefetch = mf_sg_prefetch_on(o);
    sg->pre_experts = sg->prefetch ? c->n_routed_experts : 0;
    size_t n_pre = sg->prefetch ? (size_t)c->n_layers * c->n_routed_experts : 0;
    sg->pre_tid = malloc(sizeof *sg->pre_tid * (n_pre + 1));
    for (size_t i = 0; sg->pre_tid && i < n_pre; i++) sg->pre_tid[i] = -1;
    size_t n_tid = (size_t)c->n_layers * sg->n_slots * sg->tid_per_slot;
    sg->slot_tid = malloc(sizeof *sg->slot_tid * n_tid);
    sg->card_ffn_tid = malloc(sizeof *sg->card_ffn_tid * (size_t)c->n_layers * sg->n_halves * (sg->n_cards ? sg->n_cards : 1));
    size_t n_eg = (size_t)c->n_engram * sg->n_units * sg->eg_reads_per_unit;
    sg->eg_read_tid = malloc(sizeof *sg->eg_read_tid * (n_eg + 1));
    sg_builder b = {.o = o, .sg = sg, .u = sg->n_units, .moe_in = -1, .moe_gate = -1, .chain_run = -1, .eg_card = -1,
                    .last_done = -1};
    b.per = (double)o->n / b.u;
    b.io = malloc(sizeof *b.io * ((size_t)sg->n_slots * sg->n_io_parts + 1));
    b.pre_sfx = malloc(sizeof *b.pre_sfx * ((size_t)c->n_routed_experts + 1));
    int rc = !sg->slot_tid || !sg->card_ffn_tid || !b.io || !b.pre_sfx || !sg->eg_read_tid || !sg->pre_tid ? mf_error(-ENOMEM, "step graph: out of memory")
                                                          : mf_graph_create(o->lanes, o->n_lanes, &sg->g);
    for (size_t k = 0; !rc && k < n_eg; k++) sg->eg_read_tid[k] = -1;
    if (rc) {
        free(b.io);
        free(b.pre_sfx);
        mf_stepgraph_free(sg);
        return rc;
    }
    for (size_t i = 0; i < n_tid; i++) sg->slot_tid[i] = -1;
    for (size_t i = 0; i < n_eg; i++) sg->eg_read_tid[i] = -1;
    for (int i = 0; i < c->n_layers * sg->n_halves * sg->n_cards; i++) sg->card_ffn_tid[i] = -1;
    mf_task_id unit[MF_SG_MAX_ITEMS], post[MF_SG_MAX_ITEMS];
    for (int k = 0; k < b.u; k++) unit[k] = -1;
    for (int L = 0; L < c->n_layers && !b.rc; L++)
        for (int h = 0; h < sg->n_halves; h++) {   /* each micro-batch's chain of the layer */
            sg_half(&b, h);
            if (sg->prefetch) sg_prefetch(&b, L);
            if (mf_config_engram_slot(c, L) >= 0) sg_engram(&b, L, unit);
            sg_attn(&b, L, unit, post);
            sg_moe(&b, L, post, unit);
        }
    sg_half(&b, -1);
    sg_head(&b, unit);
    free(b.io);
    free(b.pre_sfx);
    free(b.exit_of);
    free(b.next_of);
    rc = b.rc ? b.rc : sg_set_priorities(o, sg);
    if (!rc) rc = mf_graph_finalize(sg->g);
    for (int t = 0; !rc && t < sg->n_tasks; t++) {   /* the shared expert's price per card (mf_sg_place_shared) */
        const mf_sg_task *r = &sg->task[t];
        if (r->op == MF_SG_DENSE && r->dense == MF_SG_D_SHARED && r->card >= 0 && r->layer >= 0 && r->half >= 0)
            sg->shared_ns[r->half][r->layer][r->card] += mf_graph_task_cost_ns(sg->g, t);
    }
    if (!rc && sg->prefetch) rc = sg_pre_ahead(o, sg);
    if (!rc && sg->prefetch) rc = sg_pre_ranks(o, sg);
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
    free(sg->eg_read_tid);
    free(sg->pre_tid);
    free(sg);
}

double mf_stepgraph_macs(const mf_stepgraph *sg, int top_k, int n_head)
{
    double total = 0;
    for (int t = 0; t < sg->n_tasks; t++) {
        const mf_sg_task *r = &sg->task[t];
        double per = 0;
        for (int f = 0; f < MF_KF_N; f++) per += r->w.macs[f];
        if (per == 0 || r->card >= 0) continue;
        double tok = r->slot_tokens ? (double)sg->n * top_k / sg->n_slots : r->op == MF_SG_HEAD ? n_head : r->n_tok;
        total += per * tok;
    }
    return total;
}

double mf_stepgraph_weight_bytes(const mf_stepgraph *sg)
{
    double total = 0;
    for (int t = 0; t < sg->n_tasks; t++) {
        const mf_sg_task *r = &sg->task[t];
        if (r->card >= 0 || mf_graph_noop(sg->g, t)) continue;
        for (int f = 0; f < MF_KF_N; f++) total += r->w.w_bytes[f];
    }
    return total;
}

void mf_stepgraph_mark_noop(mf_stepgraph *sg, int L, int n_used, const int32_t *slot_card)
{
    mf_stepgraph_mark_noop_half(sg, L, 0, n_used, slot_card);
}

int mf_stepgraph_half_of_slot(const mf_stepgraph *sg, int s)
{
    return sg->n_halves > 1 && s >= sg->half_slot[1];
}

void mf_stepgraph_mark_noop_half(mf_stepgraph *sg, int L, int h, int n_used, const int32_t *slot_card)
{
    int nc = sg->n_cards, pe = sg->p_exp, s0 = sg->half_slot[h];
    for (int s = s0; s < sg->half_slot[h + 1]; s++) {
        const mf_task_id *tid = sg->slot_tid + ((size_t)L * sg->n_slots + s) * sg->tid_per_slot;
        int used = s - s0 < n_used, card = used && slot_card ? slot_card[s - s0] : -1;
        for (int k = 0; k < 2 * pe + 1; k++) mf_graph_set_noop(sg->g, tid[k], !used || card >= 0);
        for (int cd = 0; cd < nc; cd++)
            for (int k = 0; k < 3; k++)
                if (tid[2 * pe + 1 + 3 * cd + k] >= 0) mf_graph_set_noop(sg->g, tid[2 * pe + 1 + 3 * cd + k], card != cd);
    }
    for (int cd = 0; cd < nc && sg->dev_graphs; cd++) {
        int any = 0;
        for (int s = 0; s < n_used && !any && slot_card; s++) any = slot_card[s] == cd;
        mf_graph_set_noop(sg->g, sg->card_ffn_tid[(L * sg->n_halves + h) * nc + cd], !any);
    }
}

void mf_stepgraph_mark_engram(mf_stepgraph *sg, int es, int k, int n_used)
{
    if (!sg->eg_reads_per_unit || es < 0 || k < 0 || k >= sg->n_units) return;
    const mf_task_id *tid = sg->eg_read_tid + ((size_t)es * sg->n_units + k) * sg->eg_reads_per_unit;
    for (int r = 0; r < sg->eg_reads_per_unit; r++)
        if (tid[r] >= 0) mf_graph_set_noop(sg->g, tid[r], r >= n_used);
}

int mf_stepgraph_key_parts(const mf_stepgraph *sg, int item)
{
    assert(item >= 0 && item < sg->n);
    return sg->key_parts[sg_group_of(sg, item)];
}

int mf_stepgraph_unit_of(const mf_stepgraph *sg, int item)
{
    for (int k = 0; k < sg->n_units; k++)
        if (item < sg->unit_end[k]) return k;
    return -1;
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
    l->n_sockets = 1;
    for (size_t k = 0; k < sizeof l->sock_of_lane; k++) l->sock_of_lane[k] = -1;
    l->sock_of_lane[0] = 0;
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

static double sg_lane_ns(const mf_lane_model *m, double bytes);

int mf_sg_lanes_sockets(mf_sg_lanes *l, int n_sockets, const int *threads, const int *numa)
{
    if (n_sockets <= 1) return 0;
    if (n_sockets > MF_SG_MAX_SOCKETS || l->n_sockets != 1)
        return mf_error(-EINVAL, "step graph: %d sockets (expected 1..%d, once)", n_sockets, MF_SG_MAX_SOCKETS);
    int total = 0;
    for (int k = 0; k < n_sockets; k++) {
        if (threads[k] < 1) return mf_error(-EINVAL, "step graph: socket %d has %d workers", k, threads[k]);
        total += threads[k];
    }
    if (total != l->lane[0].concurrency)
        return mf_error(-EINVAL, "step graph: the sockets' %d workers are not the CPU lane's %d", total,
                        l->lane[0].concurrency);
    mf_lane_desc cpu = l->lane[0];
    for (int k = 0; k < n_sockets; k++) {
        int lane = k ? l->n_lanes++ : 0;
        char *nm = l->names[3 * MF_SG_MAX_CARDS + k];
        snprintf(nm, sizeof l->names[0], "cpu%d", k);
        l->lane[lane] = cpu;
        l->lane[lane].name = nm;
        l->lane[lane].concurrency = threads[k];
        l->lane[lane].numa_node = numa ? numa[k] : -1;
        l->lane_sock[k] = lane;
        l->sock_of_lane[lane] = (int8_t)k;
        l->cpu_base[lane] = k ? l->cpu_base[l->lane_sock[k - 1]] + threads[k - 1] : 0;
    }
    l->n_sockets = n_sockets;
    return 0;
}

void mf_sg_lanes_map(mf_sg_lanes *l, const int *card_of, int n)
{
    for (int k = 0; k < n && l->lane_dev0 + 3 * k + 2 < l->n_lanes; k++)
        for (int j = 0; j < 3; j++) l->lane[l->lane_dev0 + 3 * k + j].device = card_of[k];
}

static double sg_lane_ns(const mf_lane_model *m, double bytes)
{
    return m->latency_ns + (m->bytes_per_s > 0 ? bytes / m->bytes_per_s * 1e9 : 0);
}

/* An expert of `bytes` and `macs` per token over cnt tokens on a lane of model m whose kernels
 * multiply-add at macs_per_s (mf_cost_kern's formula; 0: each token adds 2% to the bytes' time). */
static double sg_place_ns(const mf_lane_model *m, double macs_per_s, double bytes, double macs, int cnt)
{
    if (!(macs_per_s > 0) || !(macs > 0)) return sg_lane_ns(m, bytes) * (1 + 0.02 * cnt);
    mf_profile_kern k = {.bytes_per_s = m->bytes_per_s, .macs_per_s = macs_per_s, .latency_ns = m->latency_ns};
    return mf_cost_kern(&k, k.bytes_per_s, bytes, macs, cnt);
}

double mf_sg_slot_tok_bytes(const mf_config *c, int dir)
{
    return (double)c->hidden_size * 2.0 + (dir ? 0 : 4.0);   /* bf16 rows; an fp32 token weight in */
}

void mf_sg_placer_init(mf_sg_placer *p, const mf_lane_model models[4], const mf_profile *prof, int n_threads,
                       int hybrid, double expert_bytes, double expert_macs, double tok_in, double tok_out,
                       int miss_copies)
{
    memset(p, 0, sizeof *p);
    if (!prof) prof = mf_cost_default_profile();
    p->cm = (mf_cost_model){.p = prof};
    p->macs = expert_macs;
    p->host_macs_per_s = prof->host[MF_KF_FP4].macs_per_s;
    p->card_macs_per_s = prof->card[MF_KF_FP4].macs_per_s;
    p->cpu = models[0];
    p->comp = models[2];
    p->workers = n_threads;
    p->hybrid = hybrid;
    p->bytes = expert_bytes;
    p->tok_in = tok_in;
    p->tok_out = tok_out;
    p->miss_copies = miss_copies > 0 ? miss_copies : MF_SG_EXPERT_PARTS;
}

void mf_sg_place_host_work(mf_sg_placer *p, int cnt)
{
    p->host_q += sg_place_ns(&p->cpu, p->host_macs_per_s, p->bytes, p->macs, cnt);
}

int mf_sg_place_want_card(mf_sg_placer *p, int card, int cnt, int cached)
{
    int c = card;
    p->card = c;
    p->host_ns = sg_place_ns(&p->cpu, p->host_macs_per_s, p->bytes, p->macs, cnt);
    /* the copy-in as mf_sg_task_ns prices MF_SG_DEV_IN: rows and weights, and the expert on a miss (one span or its parts);
     * ahead (prefetch): the expert as MF_SG_DEV_PRE on their own queue from its head start, the rows
     * after the route and the parts */
    double copy_end;
    if (p->ahead) {
        p->pre_ns = cached ? 0 : mf_cost_copy(&p->cm, 0, p->miss_copies, p->bytes);
        p->copy_ns = mf_cost_copy(&p->cm, 0, 2, cnt * p->tok_in);
        double pre_end = p->pre_q[c] + p->pre_ns;
        p->copy_end = (pre_end > p->copy_q[c] ? pre_end : p->copy_q[c]) + p->copy_ns;
        copy_end = p->copy_end;
    } else {
        p->copy_ns = mf_cost_copy(&p->cm, 0, 2 + (cached ? 0 : p->miss_copies),
                                  (cached ? 0 : p->bytes) + cnt * p->tok_in);
        copy_end = p->copy_q[c] + p->copy_ns;
    }
    double comp_ns = sg_place_ns(&p->comp, p->card_macs_per_s, p->bytes, p->macs, cnt);
    double out_ns = mf_cost_copy(&p->cm, 1, 1, cnt * p->tok_out);
    p->t_dev = (copy_end > p->comp_q[c] ? copy_end : p->comp_q[c]) + comp_ns;
    return !p->hybrid || p->t_dev + out_ns <= p->host_q / p->workers;
}

void mf_sg_place_card(mf_sg_placer *p)
{
    if (p->ahead) {
        p->pre_q[p->card] += p->pre_ns;
        p->copy_q[p->card] = p->copy_end;
    } else
        p->copy_q[p->card] += p->copy_ns;
    p->comp_q[p->card] = p->t_dev;
    p->host_q -= p->host_ns;
}

int mf_sg_prefetch_min(const mf_config *c)
{
    double E = c->n_routed_experts, K = c->n_experts_per_tok;
    if (!(E > 1) || K >= E) return 1;
    return (int)ceil(log(E) / -log(1 - K / E));
}

int mf_sg_prefetch_on(const mf_sg_opts *o)
{
    int serial = !o->par && o->n_units <= 1;
    int min = o->prefetch_min > 0 ? o->prefetch_min : mf_sg_prefetch_min(o->c);
    return o->prefetch_min >= 0 && serial && o->micro < 2 && o->n_cards > 0 && !o->store && o->n >= min;
}

void mf_sg_place_ahead(mf_sg_placer *p, double ahead_ns)
{
    p->ahead = 1;
    for (int c = 0; c < MF_SG_MAX_CARDS; c++) p->pre_q[c] = -ahead_ns;
}

int mf_sg_place_all(mf_sg_placer *p, const mf_config *c, int L, int n_cards, int tok, const uint8_t *cached,
                    mf_sg_take_fn take, void *ctx, int32_t *card, uint8_t *miss)
{
    int E = c->n_routed_experts, n = 0;
    for (int e = 0; e < E; e++) {
        card[e] = -1;
        miss[e] = 0;
        mf_sg_place_host_work(p, tok);
    }
    for (int pass = 0; pass < 2; pass++)   /* the cached experts first, then the rest */
        for (int e = 0; e < E; e++) {
            if (cached[e] == pass) continue;
            int cd = mf_dev_xcache_owner(n_cards, L, e), hit = 0;
            if (!mf_sg_place_want_card(p, cd, tok, !pass) || !take(ctx, cd, e, &hit)) continue;
            mf_sg_place_card(p);
            card[e] = cd;
            miss[e] = (uint8_t)!hit;
            n++;
        }
    return n;
}

void mf_sg_place_shared(mf_sg_placer *p, const mf_stepgraph *sg, int L, int h)
{
    if (L < 0 || L >= MF_CONFIG_MAX_LAYERS || h < 0 || h > 1) return;
    for (int cd = 0; cd < MF_SG_MAX_CARDS; cd++) p->comp_q[cd] += sg->shared_ns[h][L][cd];
}

void mf_stepgraph_mark_prefetch(mf_stepgraph *sg, int L, const int32_t *card, const uint8_t *miss)
{
    for (int e = 0; sg->prefetch && e < sg->pre_experts; e++)
        mf_graph_set_noop(sg->g, sg->pre_tid[(size_t)L * sg->pre_experts + e], card[e] < 0 || !miss[e]);
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
