/* The step graph's core (graphs/step/stepgraph.h; internals: stepgraph_impl.h): the model's sizes, the
 * records' names and prices, the row rules, the builder's primitives (tasks, records, dependencies),
 * mf_stepgraph_new driving the sublayer builders of stepgraph_<family>.c over the layers and
 * micro-batches, the priorities, freeing, the queries and noop marks, the lanes, the phase times. */
#include "graphs/step/stepgraph_impl.h"

#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/model/layout.h"
#include "sched/error.h"

#define SG_CARD_ALIGN 256.0     /* a part's alignment in a card's cache slot */

/* ---- sizes --------------------------------------------------------------------------------- */

static void sg_size_tensor(mf_sg_sizes *s, const mf_layout_tensor *t);

/* A draft stage's tensor (mtp.s.*): as the backbone layer n_layers + s's of the same name where
 * the step graph prices it (attention, router gate, hyper-connections; its shared and routed
 * experts have the backbone's shapes), and the feed's main_proj and the Markov head. */
static void sg_size_draft(mf_sg_sizes *s, const mf_layout_tensor *t)
{
    const char *nm = t->name;
    if (strstr(nm, ".main_proj.")) {
        if (t->role == MF_ROLE_FP8_WEIGHT || t->role == MF_ROLE_FP8_SCALE) s->feed_fp8_bytes += (double)t->n_bytes;
        return;
    }
    if (strstr(nm, ".markov_head.head.")) {
        s->mk_head_bytes += (double)t->n_bytes;
        return;
    }
    if (strstr(nm, ".ffn.shared_experts.") || strstr(nm, ".ffn.experts.")) return;
    mf_layout_tensor u = *t;
    u.layer = s->n_layers + t->stage;
    u.stage = -1;
    u.group = strstr(nm, ".attn.") ? MF_GROUP_ATTN : MF_GROUP_OTHER;
    sg_size_tensor(s, &u);
}

static void sg_size_tensor(mf_sg_sizes *s, const mf_layout_tensor *t)
{
    double b = (double)t->n_bytes, macs = t->n_dims == 2 ? (double)t->shape[0] * (double)t->shape[1] : 0;
    const char *nm = t->name;
    if (t->stage >= 0) {
        sg_size_draft(s, t);
        return;
    }
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
            y->st_fp8_rows[st] += (double)t->shape[0];
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
    if (s) s->layer = calloc((size_t)(c->n_layers + c->n_mtp_layers), sizeof *s->layer);
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
    static const char *const names[] = {"engram_embed", "engram_rows", "engram_gate", "engram_plan", "engram_read", "attn_pre", "attn_rows", "attn_qnorm", "attn_core", "attn_post", "gate_rows", "route", "moe_done", "slot_read", "slot_up", "slot_join", "slot_down", "dev_in", "dev_ffn", "dev_ffn_card", "dev_out", "shared_up", "shared_down", "combine", "norm", "head", "join", "attn_mix", "attn_norm", "attn_heads", "attn_ring", "ffn_mix", "ffn_norm", "attn_score", "attn_select", "dense_in", "dense", "dense_out", "attn_qscale", "attn_kv", "attn_gather", "attn_qprep", "attn_opost", "route_rows", "moe_place", "dev_pre", "attn_keys", "net_in", "net_out", "dense_deq", "dev_rows", "draft_feat", "draft_feed", "draft_feed_kv", "draft_kv", "draft_heads", "draft_markov", "draft_pick"};
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

double mf_sg_slot_in_ns(const mf_cost_model *m, int gather, int tok, double tok_in, int miss, int miss_copies,
                        double miss_bytes)
{
    return mf_cost_copy(m, 0, (gather ? 0 : 2) + (miss ? miss_copies : 0),
                        (miss ? miss_bytes : 0) + (gather ? 0 : tok * tok_in));
}

int mf_sg_slot_gather(const mf_sg_opts *o)
{
    int nd = o->n_dense_cards;
    return o->n_cards > 0 && nd > 1 && nd >= o->n_cards && !o->exact &&
           mf_sg_dense_parts(nd, o->dense_split, MF_SG_D_GATE) == nd && mf_sg_dense_bf16(MF_SG_D_GATE, 0);
}

double mf_sg_task_ns(const mf_sg_task *t, const mf_cost_model *m, const mf_sg_step_cost *s)
{
    const mf_sg_work *w = &t->w;
    /* the head on a card runs over the items with logits only, as on the host (mf_step_dense_launch:
     * none, no work; a prefill chunk's n_head is its last position's, or none), not the chain's span */
    int head = t->dense == MF_SG_D_HEAD, tok = t->slot_tokens ? s->slot_tokens : head ? s->n_head : t->n_tok;
    if (head && !s->n_head && (t->op == MF_SG_DENSE_IN || t->op == MF_SG_DENSE || t->op == MF_SG_DENSE_OUT)) return 0;
    switch (t->op) {
    case MF_SG_ENGRAM_READ:   /* streamed tables: a row's codes or scales as an aligned block */
    case MF_SG_SLOT_READ:     /* a store miss: one extent of the slot's expert */
        return mf_cost_disk(m, w->io_bytes, w->io_reads);
    case MF_SG_HEAD:   /* the items with logits (a prefill chunk: none, or the prompt's last) */
        return s->n_head ? mf_cost_host(m, w, s->n_head, 0) : 0;
    case MF_SG_DEV_IN:   /* the expert on a miss (one span or its parts), then the rows and token weights */
        return mf_sg_slot_in_ns(m, t->gather, tok, w->copy_bytes_tok, s->dev_miss,
                                w->copies > 0 ? w->copies : MF_SG_EXPERT_PARTS, w->copy_bytes);
    case MF_SG_DEV_ROWS:   /* the rows' items and token weights */
        return mf_cost_copy(m, 0, w->copies, w->copy_bytes);
    case MF_SG_DEV_PRE:   /* prefetch: the expert, one span or its parts (noop on a hit or the host) */
        return mf_cost_copy(m, 0, w->copies > 0 ? w->copies : MF_SG_EXPERT_PARTS, w->copy_bytes);
    case MF_SG_DEV_FFN:   /* the slot's path (mf_sg_ffn_lt) */
        return s->ffn_lt ? mf_cost_card_lt(m, MF_KF_FP4, w->w_bytes[MF_KF_FP4], w->macs[MF_KF_FP4], w->calls[MF_KF_FP4], tok)
                         : mf_cost_card_on(m, w, tok, 0);
    case MF_SG_DEV_FFN_CARD:
        return 0;
    case MF_SG_DEV_OUT:
        return mf_cost_copy(m, 1, 1, tok * w->copy_bytes_tok);
    case MF_SG_DENSE_IN:   /* one small copy of the items' activations (the heads: and the key table;
                            * the index scores: and their positional key table); wo_b's input in
                            * `copies` ranges (mf_sg_ob_in_cols): a latency each */
        return mf_cost_act_copy(m, 0, w->copy_bytes + tok * w->copy_bytes_tok + s->pos_bytes) +
               (w->copies > 1 ? (w->copies - 1) * mf_cost_act_copy(m, 0, 0) : 0);
    case MF_SG_DENSE_DEQ:   /* the layer's FP8 weights of the sublayer the card holds, into 16 bits */
        return mf_cost_card_dequant(m, MF_KF_FP8, w->w_bytes[MF_KF_FP8], w->macs[MF_KF_FP8], w->calls[MF_KF_FP8]);
    case MF_SG_DENSE:   /* its FP8 linears on their path (the dequantization is MF_SG_DENSE_DEQ's); the
                         * heads' and index scores' positional work at the card's fp32 rate */
        return mf_cost_card_on(m, w, tok, t->lin_path == MF_DEV_LIN_CUBLASLT ? 1 << MF_KF_FP8 : 0) +
               (t->dense == MF_SG_D_HEADS || t->dense == MF_SG_D_SCORES ? mf_cost_ref(m->p, 1, s->pos_flops) : 0);
    case MF_SG_DENSE_OUT:   /* an attention stage's copy of nothing (qb's where its queries stay on the
                             * cards, mf_sg_heads_qlocal): none enqueued */
        if (t->dense <= MF_SG_D_ATTN_OB && tok * w->copy_bytes_tok + s->pos_bytes <= 0) return 0;
        return mf_cost_act_copy(m, 1, tok * w->copy_bytes_tok + s->pos_bytes);
    case MF_SG_NET_IN:    /* the boundary over the link from the stage before */
    case MF_SG_NET_OUT:   /* the send posted: a message's latency */
        return mf_cost_net(m, w->net_msgs, w->net_bytes);
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

/* ---- the builder's primitives (stepgraph_impl.h) ------------------------------------------ */

static mf_io_read sg_no_read = {.fd = -1};

/* The item group holding item i. */
int mf_sg_group_of(const mf_stepgraph *sg, int i)
{
    if (sg->n_groups == sg->n) return i;
    int g = (int)((int64_t)i * sg->n_groups / sg->n);   /* near it: groups are n / n_groups or one more */
    while (g > 0 && i < sg->group_end[g - 1]) g--;
    while (i >= sg->group_end[g]) g++;
    return g;
}

/* The CPU lane of socket key mod n_sockets (mf_sg_opts.n_sockets; lane 0 without sockets). */
int mf_sg_sock_lane(const mf_sg_builder *b, int key)
{
    return b->o->n_sockets > 1 && b->o->lane_sock ? b->o->lane_sock[key % b->o->n_sockets] : 0;
}

/* Adds a task: its record `t` (layer, slot, ... and work; op, phase and kind given here) on
 * `lane`; its priority is the cost model's price of the record, set once the graph is built
 * (sg_set_priorities). Returns its id, or -1 after an error (kept in b->rc). */
mf_task_id mf_sg_add(mf_sg_builder *b, int lane, int op, int phase, int kind, mf_sg_task t)
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
    int grp = t.i1 > t.i0 && t.i0 < sg->n ? mf_sg_group_of(sg, t.i0) : -1;   /* the task's one item group, or -1 */
    if (grp >= 0 && (t.i0 != (grp ? sg->group_end[grp - 1] : 0) || t.i1 != sg->group_end[grp])) grp = -1;
    if (lane == 0 && b->o->n_sockets > 1 && b->o->lane_sock && t.slot < 0 && (t.part >= 0 || grp >= 0)) {
        double wb = 0;   /* no weights, one item (group) or a part: spread over the sockets (mf_sg_opts.n_sockets) */
        for (int f = 0; f < MF_KF_N; f++) wb += t.w.w_bytes[f];
        if (wb == 0) lane = mf_sg_sock_lane(b, (grp >= 0 ? grp : 0) + (t.part > 0 ? t.part : 0));
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
int mf_sg_rows_lane(const mf_sg_builder *b, int64_t n_rows, int parts, int p, int64_t *r0, int64_t *r1)
{
    int S = b->o->n_sockets > 1 && b->o->lane_sock ? b->o->n_sockets : 1;
    int64_t a, e;
    int k = mf_sg_expert_rows(n_rows, parts, S, p, &a, &e);
    if (r0) *r0 = a, *r1 = e;
    return S > 1 ? b->o->lane_sock[k] : 0;
}

/* A record of layer L with nothing else set. */
mf_sg_task mf_sg_rec(int L)
{
    return (mf_sg_task){.layer = (int16_t)L, .stage = -1, .card = -1, .read = -1, .dense = -1, .cand = -1, .slot = -1,
                        .part = -1};
}

/* Item task k's record: items [i0, i1) of unit k. */
mf_sg_task mf_sg_item(const mf_sg_builder *b, int L, int k)
{
    mf_sg_task t = mf_sg_rec(L);
    t.i0 = k > 0 ? b->sg->unit_end[k - 1] : 0;
    t.i1 = b->sg->unit_end[k];
    t.n_tok = t.i1 - t.i0;
    return t;
}

/* A task over the items of the micro-batch being built: its items and tokens. */
void mf_sg_span(const mf_sg_builder *b, mf_sg_task *t)
{
    t->i0 = b->h0;
    t->i1 = b->h1;
    t->n_tok = b->h1 - b->h0;
}

/* The unit holding item group g (groups lie in one unit). */
int mf_sg_group_unit(const mf_stepgraph *sg, int g)
{
    return mf_stepgraph_unit_of(sg, g ? sg->group_end[g - 1] : 0);
}

/* Part p of `parts` of an item's n_rows output rows (columns of the hidden size, rows of a mix):
 * the per-item task record of item group g (its items and tokens; the caller's work per item
 * times them). Columns split as mf_sg_rows; mixes (a few rows) evenly. */
mf_sg_task mf_sg_part(const mf_stepgraph *sg, int L, int g, int64_t n_rows, int parts, int p, int even)
{
    mf_sg_task t = mf_sg_rec(L);
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

/* Unit k's item groups [*g0, *g1) (groups lie in one unit); returns their count. */
int mf_sg_unit_groups(const mf_stepgraph *sg, int k, int *g0, int *g1)
{
    int i0 = k > 0 ? sg->unit_end[k - 1] : 0, i1 = sg->unit_end[k];
    *g0 = mf_sg_group_of(sg, i0);
    *g1 = mf_sg_group_of(sg, i1 - 1) + 1;
    return *g1 - *g0;
}

/* after waits for before (for the end of before's chain when before begins a dense chain; for
 * every chain of a group when either begins one: mf_sg_dense_chain). */
void mf_sg_dep(mf_sg_builder *b, mf_task_id before, mf_task_id after)
{
    if (before < 0 || after < 0) return;
    for (mf_task_id x = before; x >= 0 && !b->rc; x = b->next_of[x])
        for (mf_task_id y = after; y >= 0 && !b->rc; y = b->next_of[y])
            b->rc = mf_graph_add_dep(b->sg->g, b->exit_of[x], y);
}

/* Whether task x's items meet [i0, i1) (a record without items spans them all). */
static int sg_meets(const mf_sg_builder *b, mf_task_id x, int i0, int i1)
{
    const mf_sg_task *t = &b->sg->task[x];
    return t->i1 <= t->i0 || (t->i0 < i1 && t->i1 > i0);
}

void mf_sg_dep_items(mf_sg_builder *b, mf_task_id before, mf_task_id after, int i0, int i1)
{
    if (before < 0 || after < 0) return;
    for (mf_task_id x = before; x >= 0 && !b->rc; x = b->next_of[x])
        for (mf_task_id y = after; y >= 0 && !b->rc && sg_meets(b, x, i0, i1); y = b->next_of[y])
            if (sg_meets(b, y, i0, i1)) b->rc = mf_graph_add_dep(b->sg->g, b->exit_of[x], y);
}

int mf_sg_group_after(const mf_sg_builder *b, const mf_task_id *unit, int i, mf_task_id *after)
{
    int u = mf_sg_group_unit(b->sg, i), pc = b->sg->p_hc;
    if (b->sg->n_groups > 1 && unit[u] >= 0 && unit[u] == b->comb_join[u]) {
        for (int p = 0; p < pc; p++) after[p] = b->comb[i][p];
        return pc;
    }
    after[0] = unit[u];
    return 1;
}

/* ---- building a step graph ---------------------------------------------------------------- */

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
    int K = mf_config_layer_topk(c, sg->layer0), E = mf_config_layer_experts(c, sg->layer0);
    int tok = (sg->n * K + E - 1) / E;
    mf_sg_step_cost st = {.slot_tokens = tok > 1 ? tok : 1, .n_head = sg->n, .dev_miss = 1};
    int64_t pos = mf_sg_steady_pos(c);
    mf_work ew;
    mf_sg_expert_work(c, o->sz, &ew);
    double ffn_ns = mf_cost_card_on(&m, &ew, st.slot_tokens, 0);   /* a card's FFN graph: int8 */
    st.ffn_lt = sg->lt_ffn && mf_sg_ffn_lt(&m, &ew, st.slot_tokens, o->lt, NULL);
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

/* The full item ranges of a parallel or mixed graph's records, which mf_stepgraph_set_live cuts. */
static int sg_live_new(mf_stepgraph *sg)
{
    sg->live_i1 = malloc(sizeof *sg->live_i1 * (size_t)sg->n_tasks);
    sg->live_tok = malloc((size_t)sg->n_tasks);
    if (!sg->live_i1 || !sg->live_tok) return mf_error(-ENOMEM, "step graph: out of memory for %d tasks", sg->n_tasks);
    for (int t = 0; t < sg->n_tasks; t++) {
        const mf_sg_task *r = &sg->task[t];
        sg->live_i1[t] = r->i1 > r->i0 ? r->i1 : -1;
        sg->live_tok[t] = r->i1 > r->i0 && r->n_tok == r->i1 - r->i0;
    }
    return 0;
}

/* Builds the chains of micro-batch h next (-1: the head, over all items). */
static void sg_half(mf_sg_builder *b, int h)
{
    const mf_stepgraph *sg = b->sg;
    b->h = h;
    b->h0 = h > 0 ? sg->half_end[h - 1] : 0;
    b->h1 = h >= 0 ? sg->half_end[h] : sg->n;
    b->k0 = h >= 0 ? sg->half_unit[h] : 0;
    b->k1 = h >= 0 ? sg->half_unit[h + 1] : sg->n_units;
    b->per = (double)(b->h1 - b->h0) / (b->k1 - b->k0);
    b->g0 = mf_sg_group_of(sg, b->h0);
    b->g1 = mf_sg_group_of(sg, b->h1 - 1) + 1;
}

/* The step graph, per layer [engram embed -> wkv parts -> engram gate] ->
 * per item collapse -> attn_norm column parts (and the attention mix's row parts) -> attention
 * stages (in, qb, oa, ob; row parts) around the q norm (scale, column parts), the core's prep
 * (per sequence) and its head groups (per item) -> per item expand/collapse -> ffn_norm column parts (and the ffn mix) ->
 * gate parts -> route -> expert slots ([reads] -> up parts -> join -> down parts, per card in ->
 * ffn -> out) and the shared expert -> moe done -> per item combine column parts; then the final
 * collapse -> norm column parts -> head join -> head parts.
 * One function per sublayer (stepgraph_<family>.c), each returning the tasks it ends with. */
int mf_stepgraph_new(const mf_sg_opts *o, mf_stepgraph **out)
{
    *out = NULL;
    int serial = !o->par && !o->mixed, max_n = serial ? MF_SG_MAX_CHUNK : MF_SG_MAX_ITEMS;
    if (o->n < 1 || o->n > max_n || o->n_cards < 0 || o->n_cards > MF_SG_MAX_CARDS)
        return mf_error(-EINVAL, "step graph: %d items (%s), %d cards (expected 1..%d, 0..%d)", o->n,
                        serial ? "one sequence" : "several sequences", o->n_cards, max_n, MF_SG_MAX_CARDS);
    if (o->n_dense_cards < 0 || o->n_dense_cards > MF_SG_MAX_CARDS ||
        (o->n_dense_cards && o->lane_dev0 + 3 * o->n_dense_cards > o->n_lanes))
        return mf_error(-EINVAL, "step graph: dense work on %d cards, lanes for %d (expected 0..%d, with lanes)",
                        o->n_dense_cards, (o->n_lanes - o->lane_dev0) / 3, MF_SG_MAX_CARDS);
    if (o->dense_split != MF_SG_SPLIT_LAYERS && o->dense_split != MF_SG_SPLIT_ROWS)
        return mf_error(-EINVAL, "step graph: dense split %d (expected layers or rows)", o->dense_split);
    if (o->in_split < MF_SG_IN_COST || o->in_split > MF_SG_IN_ITEMS)
        return mf_error(-EINVAL, "step graph: in stage split %d (expected cost, rows or items)", o->in_split);
    if (o->micro < 0 || o->micro > 2)
        return mf_error(-EINVAL, "step graph: %d micro-batches (expected 1 or 2)", o->micro);
    if (o->mixed && o->ordered)
        return mf_error(-EINVAL, "step graph: a mixed graph runs its items' sequences in item groups, not in order");
    if (o->lt < MF_SG_LT_COST || o->lt > MF_SG_LT_OFF)
        return mf_error(-EINVAL, "step graph: cuBLASLt mode %d (expected cost, on, dense or off)", o->lt);
    int rc0 = o->draft ? mf_sg_draft_check(o) : 0;
    if (rc0) return rc0;
    const mf_config *c = o->c;
    int l0 = o->layer_begin, l1 = o->layer_begin || o->layer_end ? o->layer_end : c->n_layers;
    if (l0 < 0 || l0 >= l1 || l1 > c->n_layers || !mf_config_cut_ok(c, l0) ||
        ((l0 > 0 || l1 < c->n_layers) && (o->lane_net < 0 || o->lane_net >= o->n_lanes)))
        return mf_error(-EINVAL, "step graph: layers [%d, %d) of %d, boundary lane %d (expected a range beginning "
                        "at a cut, mf_config_cut_ok, with a lane for its boundaries)", l0, l1, c->n_layers, o->lane_net);
    mf_stepgraph *sg = calloc(1, sizeof *sg);
    if (!sg) return mf_error(-ENOMEM, "step graph: out of memory");
    mf_sg_parts(o, sg);
    sg->prefetch = mf_sg_prefetch_on(o);
    sg->slot_gather = mf_sg_slot_gather(o);
    sg->pre_experts = sg->prefetch ? c->n_routed_experts : 0;
    size_t n_pre = sg->prefetch ? (size_t)c->n_layers * c->n_routed_experts : 0;
    sg->pre_tid = malloc(sizeof *sg->pre_tid * (n_pre + 1));
    for (size_t i = 0; sg->pre_tid && i < n_pre; i++) sg->pre_tid[i] = -1;
    int nL = sg->draft ? sg->layer1 : c->n_layers;   /* the per-layer tables' layers */
    size_t n_tid = (size_t)nL * sg->n_slots * sg->tid_per_slot;
    sg->slot_tid = malloc(sizeof *sg->slot_tid * n_tid);
    sg->card_ffn_tid = malloc(sizeof *sg->card_ffn_tid * (size_t)nL * sg->n_halves * (sg->n_cards ? sg->n_cards : 1));
    size_t n_eg = (size_t)c->n_engram * sg->n_units * sg->eg_reads_per_unit;
    sg->eg_read_tid = malloc(sizeof *sg->eg_read_tid * (n_eg + 1));
    mf_sg_builder b = {.o = o, .sg = sg, .u = sg->n_units, .moe_in = -1, .moe_gate = -1, .chain_run = -1, .eg_card = -1,
                    .last_done = -1, .head_done = -1, .route = -1, .pre_done = -1};
    b.per = (double)o->n / b.u;
    for (int k = 0; k < MF_SG_MAX_GROUPS; k++) b.comb_join[k] = -1;
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
    for (int i = 0; i < nL * sg->n_halves * sg->n_cards; i++) sg->card_ffn_tid[i] = -1;
    mf_task_id unit[MF_SG_MAX_GROUPS], post[MF_SG_MAX_GROUPS];
    mf_task_id in = !sg->draft && l0 > 0 ? mf_sg_net_in(&b) : -1;   /* a pipeline stage after the first */
    for (int k = 0; k < b.u; k++) unit[k] = in;
    if (sg->draft) {   /* the pending features into each sequence's context rings first */
        sg_half(&b, 0);
        mf_sg_draft_feed(&b, unit);
    }
    for (int L = sg->layer0; L < sg->layer1 && !b.rc; L++)
        for (int h = 0; h < sg->n_halves; h++) {   /* each micro-batch's chain of the layer */
            sg_half(&b, h);
            if (sg->prefetch) mf_sg_prefetch(&b, L);
            if (mf_config_engram_slot(c, L) >= 0) mf_sg_engram(&b, L, unit);
            if (sg->feats) mf_sg_draft_feat(&b, L, unit);
            mf_sg_attn(&b, L, unit, post);
            mf_sg_moe(&b, L, post, unit);
        }
    sg_half(&b, -1);
    if (sg->draft || l1 == c->n_layers) mf_sg_head(&b, unit);
    else mf_sg_net_out(&b, unit);   /* a pipeline stage before the last */
    if (sg->draft) mf_sg_draft_propose(&b, b.head_done);
    mf_sg_lt_ffn(o, sg);
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
    if (!rc && sg->prefetch) rc = mf_sg_pre_ahead(o, sg);
    if (!rc && sg->prefetch) rc = mf_sg_pre_ranks(o, sg);
    if (!rc && (sg->par || sg->mixed)) rc = sg_live_new(sg);
    if (rc) {
        mf_stepgraph_free(sg);
        return mf_error_wrap(rc, "step graph: a batch of %d", o->n);
    }
    *out = sg;
    return 0;
}

/* ---- freeing, queries, noop marks ------------------------------------------------------------ */

void mf_stepgraph_free(mf_stepgraph *sg)
{
    if (!sg) return;
    mf_graph_destroy(sg->g);
    free(sg->task);
    free(sg->slot_tid);
    free(sg->card_ffn_tid);
    free(sg->eg_read_tid);
    free(sg->pre_tid);
    free(sg->live_i1);
    free(sg->live_tok);
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
        double tok = r->slot_tokens ? (double)sg->n_live * top_k / sg->n_slots : r->op == MF_SG_HEAD ? n_head : r->n_tok;
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

int mf_sg_bucket(int n)
{
    int b = 1;
    while (b < n && b < MF_SG_MAX_ITEMS) b *= 2;
    return b;
}

void mf_stepgraph_set_live(mf_stepgraph *sg, int n_live)
{
    if (!sg->live_i1 || n_live == sg->n_live || n_live < 1 || n_live > sg->n) return;
    sg->n_live = n_live;
    for (int t = 0; t < sg->n_tasks; t++) {
        mf_sg_task *r = &sg->task[t];
        int full = sg->live_i1[t];
        if (full < 0) continue;
        int i1 = full < n_live ? full : n_live > r->i0 ? n_live : r->i0;
        r->i1 = i1;
        if (sg->live_tok[t]) r->n_tok = i1 - r->i0;
        mf_graph_set_noop(sg->g, t, i1 == r->i0);
    }
    for (int h = 0; h < sg->n_halves; h++)   /* a dead micro-batch's slots: its route does not run */
        if ((h ? sg->half_end[h - 1] : 0) >= n_live)
            for (int L = 0; L < sg->n_layers; L++) mf_stepgraph_mark_noop_half(sg, L, h, 0, NULL);
}

int mf_stepgraph_key_parts(const mf_stepgraph *sg, int item)
{
    assert(item >= 0 && item < sg->n);
    return sg->key_parts[mf_sg_group_of(sg, item)];
}

int mf_stepgraph_unit_of(const mf_stepgraph *sg, int item)
{
    for (int k = 0; k < sg->n_units; k++)
        if (item < sg->unit_end[k]) return k;
    return -1;
}

/* ---- lanes ---------------------------------------------------------------------------------- */

void mf_sg_lanes_init(mf_sg_lanes *l, const mf_lane_model models[4], int n_threads, int store, int n_cards)
{
    static const char *const kn[3] = {"h2d", "compute", "d2h"};
    static const mf_lane_kind kk[3] = {MF_LANE_DEV_COPY_IN, MF_LANE_DEV_COMPUTE, MF_LANE_DEV_COPY_OUT};
    memset(l, 0, sizeof *l);
    l->lane[0] = (mf_lane_desc){.kind = MF_LANE_CPU, .name = "cpu", .concurrency = n_threads, .numa_node = -1,
                                .model = models[0]};
    l->n_lanes = 1;
    l->lane_io = -1;
    l->lane_net = -1;
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

void mf_sg_lanes_net(mf_sg_lanes *l)
{
    if (l->lane_net >= 0 || l->n_lanes >= MF_SG_MAX_LANES) return;
    l->lane_net = l->n_lanes++;
    l->lane[l->lane_net] = (mf_lane_desc){.kind = MF_LANE_CPU, .name = "net", .concurrency = 1, .numa_node = -1};
}

void mf_sg_lanes_map(mf_sg_lanes *l, const int *card_of, int n)
{
    for (int k = 0; k < n && l->lane_dev0 + 3 * k + 2 < l->n_lanes; k++)
        for (int j = 0; j < 3; j++) l->lane[l->lane_dev0 + 3 * k + j].device = card_of[k];
}

/* ---- phase times ---------------------------------------------------------------------------- */

void mf_stepgraph_phase_times(const mf_stepgraph *sg, const mf_task_span *spans, mf_task_span *scratch,
                              int64_t *phase_ns, int64_t *busy_ns)
{
    for (int q = 0; q < MF_SG_N_PHASES; q++) {
        int m = 0;
        for (int t = 0; t < sg->n_tasks; t++) {
            const mf_sg_task *r = &sg->task[t];
            if (r->phase != q || spans[t].status != 0 || r->kind == MF_SG_K_IO || r->kind == MF_SG_K_COPY ||
                r->kind == MF_SG_K_COPY_OUT || r->kind == MF_SG_K_NET)
                continue;
            busy_ns[q] += spans[t].end_ns - spans[t].start_ns;
            scratch[m++] = spans[t];
        }
        int64_t len;
        mf_timeline_union(scratch, m, &len);
        phase_ns[q] += len;
    }
}
