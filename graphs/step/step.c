/* The scheduled decode engine (graphs/step/step.h): per batch size one graph (graphs/step/stepgraph.c
 * builds it; docs/decode.md draws it), per layer [engram embed -> wkv row parts -> engram gate] ->
 * collapse and attn_norm column parts -> attn linear stages (in, qb, oa, ob; row parts) around the
 * q norm (scale, column parts), the core's prep and its head groups -> expand, collapse and
 * ffn_norm column parts -> gate row parts -> route -> expert slots (up parts -> join -> down parts) and the shared expert
 * -> combine column parts, the mixes in row parts beside them; then the final collapse and norm
 * -> head parts. Tasks read the step's data (items, slot table) from the shape's buffers and their
 * ranges from their records, so the graph never changes. The per-item and per-sequence tasks call
 * the layer math (graphs/layers/layers.h) on the running worker's context. */
#include <assert.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/layers/layers.h"
#include "graphs/step/dev_fill.h"
#include "graphs/step/fast_attn.h"
#include "graphs/step/step.h"
#include "graphs/step/stepgraph.h"
#include "host/kernels.h"
#include "host/store.h"
#include "sched/clock.h"
#include "sched/cost.h"
#include "device/dev.h"
#include "device/dev_check.h"
#include "device/expert_cache.h"
#include "sched/error.h"
#include "sched/profile.h"
#include "sched/sched.h"
#include "sched/timeline.h"

typedef struct mf_step_shape mf_step_shape;

/* Floats of one item's hyper-connection mixes ((2 + hc) * hc, at most) */
#define MF_STEP_N_MIX ((2 + MF_LY_MAX_HC) * MF_LY_MAX_HC)
/* Shapes kept for unit patterns other than all-parallel and serial. Each holds its graph (and
 * its cards' buffers); their host buffers are one arena for all (mf_step.umem). */
#define MF_STEP_UNIT_SHAPES 32

/* One task's argument: its shape and its record in the step graph (what it is: layer, stage,
 * slot, part, card, items; graphs/step/stepgraph.h). The layer context (scratch) it uses is its
 * worker's (mf_step_cx). */
typedef struct mf_step_targ {
    mf_step_shape *sh;
    const mf_sg_task *t;
} mf_step_targ;

/* A row of a shape's buffer table: sized first, then carved from one allocation. */
typedef struct mf_step_buf {
    const char *name;
    size_t bytes;
    void **ptr;
} mf_step_buf;

struct mf_step_shape {
    mf_step *eng;
    int n;              /* items */
    int par;            /* 1: items of distinct sequences, per-item parts one task per item */
    /* the step graph (graphs/step/stepgraph.h) and its part counts: slots min(n * top_k, experts),
     * row parts per expert, shared expert, head, attention stage (also Engram wkv, router gate) */
    mf_stepgraph *sg;
    int n_slots, p_exp, p_sh, p_head, p_attn;
    mf_graph *g;        /* sg->g */
    mf_timeline *tl;
    mf_task_span *sorted;   /* per task: the last run's spans sorted by start (phase times) */
    mf_step_targ *args;     /* per task */
    /* items and their activations */
    mf_ly_item *items;
    /* attention: per MF_LY_A_* buffer n rows of ab_ld floats (graphs/layers/layers.h); per item the
     * attention and ffn mixes (MF_STEP_N_MIX floats each) and a collapse of the streams (H) */
    float *ab[MF_LY_A_N];
    int64_t ab_ld[MF_LY_A_N];
    float *amix, *fmix, *hcol;
    float *qrs;         /* n: the q norm's scale per item (MF_SG_ATTN_QSCALE) */
    double *iscore;         /* n x iscore_ld: index scores per item (grown with the longest state) */
    int64_t iscore_ld;
    float *xin;         /* n x H: MoE input (after ffn_norm) */
    float *logits;      /* n x n_routed_experts: router gate logits */
    /* Engram: every buffer below has eg_items rows per Engram slot (mf_config_engram_slot), the
     * slots one after another (mf_step_eg_row): the embed and wkv of every Engram layer run from
     * the step's start (graphs/step/stepgraph.c sg_engram), two layers' at once */
    float *eg_emb, *eg_kv;   /* eg_emb_ld, eg_kv_ld per row: Engram rows (dequantized), wkv output */
    int64_t eg_emb_ld, eg_kv_ld;
    int eg_items;
    /* streamed Engram tables (eng->eg_reads): per item its table rows, their codes and scales in
     * order, the reads of its IO tasks (2 per row at most) and its part of the gather plans'
     * scratch (an item task's items take consecutive parts: mf_store_gather_bytes) */
    int64_t *eg_rows;
    uint8_t *eg_codes, *eg_scales, *eg_scratch;
    mf_io_read *eg_rd;
    int eg_per;              /* rows of an item: (max_ngram - 1) x n_heads */
    size_t eg_scratch_item;
    float *moe_out;     /* n x H: combine output */
    /* routing of the current layer */
    int32_t *ex;        /* n x K: experts of item i in top-k order */
    float *wt;          /* n x K: their weights */
    int32_t *asg;       /* n x K: row of (i, k) in the slot-ordered buffers */
    int32_t *cnt, *fill;   /* n_routed_experts */
    int32_t *slot_of;   /* n_routed_experts -> slot (-1) */
    int32_t *slot_e, *slot_off, *slot_cnt;   /* n_slots */
    int n_used[2];      /* per micro-batch (sg->n_halves): its first slots used (mf_step_slot_live) */
    /* with an expert store: per slot its weights (w1, w2, w3 pointing into the store's slab) and
     * the reads of its IO tasks (n_parts per slot; empty on hits), filled by the route task */
    mf_weight *slot_w;      /* n_slots x 3 */
    mf_io_read *slot_rd;    /* n_slots x n_parts */
    int n_parts;
    int store_layer;        /* layer whose store batch is open, -1 */
    int store_half;         /* the micro-batch whose slots it holds */
    /* with devices: per slot its card (-1: host), its expert's cache slot on the card and whether
     * it must be copied in (a miss); per card the slot-ordered device buffers (x, token weights,
     * h, int8 scratch per slot, y), as offsets into dbuf[card] */
    int32_t *slot_card;
    uint8_t **slot_dev;
    uint8_t *slot_miss;
    /* prefetch (sg->prefetch): per expert of the layer being placed its card (-1: host), cache
     * slot, whether it is copied in (MF_SG_DEV_PRE), and whether it was cached (scratch) */
    int32_t *pre_card;
    uint8_t **pre_dev;
    uint8_t *pre_miss, *pre_cached;
    int dev_layer;          /* layer whose cache slots are pinned, -1 */
    int dev_half;           /* the micro-batch whose slots they are */
    uint8_t *dbuf[MF_DEV_MAX_CARDS];
    mf_sg_card_bufs cb;   /* the cards' buffers (routed and dense blocks) and the host layouts' row lengths */
    size_t d_x, d_w, d_h, d_q, d_y, d_tab, dq_bytes;   /* dq_bytes: the int8 scratch's bytes a row */
    size_t d_x16, d_y16;   /* the rows' bf16 copies (mf_sg_slot_tok_bytes), in slot order as d_x, d_y */
    /* device graphs (opts dev_graphs): per card the slot tables of every layer (pinned host copy
     * filled by the route task, device copy refreshed by the graph) and each layer's graph,
     * captured on its first run: the table's h2d copy, then the slot-table FFN */
    mf_dev_ffn_slot *htab[MF_DEV_MAX_CARDS];
    mf_dev_graph **dgraph[MF_DEV_MAX_CARDS];   /* n_dgraph each: per layer and micro-batch */
    int n_dgraph;
    /* slot-ordered expert buffers (n x K rows) */
    float *xg, *wg, *h, *gg, *uu, *y;
    /* with routed experts on cards: the rows a card's slot copies in and out as bf16 codes
     * (graphs/step/stepgraph.h mf_sg_slot_tok_bytes): xg16 written by the row gather for the card
     * slots' rows (from the xin16 mirror when there is one, else packed), y16 by the slot's copy out
     * (packed on the card's copy stream), read by the combine in place of y; row_card[row] 1 when the
     * row's slot ran on a card (set by the gather: slot_card is reset when the layer's experts are
     * released, before the combine) */
    uint16_t *xg16, *y16;
    uint8_t *row_card;
    mf_kern_q8 *q8x, *q8h;   /* n_slots */
    uint8_t *q8x_mem, *q8h_mem;
    size_t q8x_bytes, q8h_bytes;   /* per row (mf_kern_q8_bytes(1, .)): slot s's at slot_off[s] rows */
    /* shared expert */
    float *hs, *gs, *us, *ys;
    /* head */
    float *hn;          /* n x H */
    float *lbuf;        /* n x vocab */
    int32_t *head_item; /* j -> item */
    int32_t *head_row;  /* item -> j (-1: no logits) */
    int n_head;
    int head_rows;          /* dense cards: the rows of a card's logits buffer (MF_STEP_HEAD_ROWS) */
    /* dense work on cards: per card its device copies of the activations a dense task reads and
     * writes (attention buffers ab, MoE input, gate logits, shared expert's h (and g, u with
     * exact) and output, normed rows, logits, one Engram layer's embed rows and wkv output per
     * item: the Engram chains run one after another) at offsets dd_* into ddense[card] (a launch's
     * failure fails its task through the stream's status callback) */
    uint8_t *ddense[MF_DEV_MAX_CARDS];
    size_t dd_ab[MF_LY_A_N], dd_xin, dd_logits, dd_hs, dd_gs, dd_us, dd_ys, dd_hn, dd_lbuf, dd_eg_emb, dd_eg_kv;
    /* the activations the dense chains copy as bf16 (graphs/step/stepgraph.h mf_sg_attn_buf_bf16,
     * mf_sg_dense_bf16; with dense cards only, else NULL): on the host a mirror of codes beside the
     * floats (the same layout), packed by the host task that writes the floats and unpacked by the
     * one that first reads them (mf_step_bf16_cols); on each card its copy at dd16_* (the card's
     * copy streams pack and unpack it: mf_dev_bf16_pack, _unpack) */
    uint16_t *ab16[MF_LY_A_N], *xin16, *ys16;
    size_t dd16_ab[MF_LY_A_N], dd16_xin, dd16_ys;
    /* the heads on cards (sg->heads_any): the layer's key table as the gather leaves it on the host
     * (hk_tab: the ring's hk_nring rows of positions from hk_t0, then the hk_nent entries of the
     * union of the items' selections, hk_map[j] their rows in the card's table, which has the
     * chunk's hk_nchunk KV rows of positions from hk_pos0 between the two), per item its key list
     * (hk_keys, sg->heads_keys apart) and count (hk_nk), the sinks; hk_host 1 when the entries
     * exceed the table's hk_ecap (the q prep tasks then run the host's heads, the card tasks
     * nothing); the cards' copies at dd_hk_* */
    float *hk_tab, *hk_sink;
    int32_t *hk_keys, *hk_nk, *hk_map;
    int64_t hk_map_cap, hk_t0, hk_pos0, hk_ring_hi;
    int hk_nring, hk_nchunk, hk_nent, hk_ecap, hk_host;
    size_t dd_hk_tab, dd_hk_keys, dd_hk_nk, dd_hk_sink;
    /* the index scores on cards (sg->scores_any): the unit's index keys as MF_SG_ATTN_KEYS leaves
     * them (sk_tab: the sk_nkeys entries the last item sees, unpacked), per item its visible count
     * (sk_nvis); sk_host 1 when the chunk's items are not one sequence's consecutive positions or
     * see more than MF_SG_SCORE_ENTRIES (the selects then score on the host, the card tasks do
     * nothing); the cards' copies at dd_sk_* (a card: the keys its items see; its items' scores,
     * sk_rows rows of at most MF_SG_SCORE_ENTRIES, as many apart as its last item sees) */
    float *sk_tab;
    int32_t *sk_nvis;
    int64_t sk_nkeys;
    int sk_host, sk_rows;
    size_t dd_sk_tab, dd_sk_nvis, dd_sk_score;
    void *mem;              /* its buffers; NULL when they are the engine's umem (unit shapes) */
};

/* A dense card's copy of rows [r0, r1) of a weight (FP8 rows from a 32-row tile boundary, or
 * BF16): m views device memory; w NULL: an unused entry. */
typedef struct mf_step_dmat {
    const mf_weight *w;
    mf_kern_mat m;
    int64_t r0, r1;
} mf_step_dmat;
#define MF_STEP_DW_MAX 16   /* dense weights of one layer: attention stages, gate, shared expert, Engram wkv */

struct mf_step {
    const mf_layers *ly;      /* the model's tables (mf_ref_layers of the caller's forward object) */
    /* the layer contexts of the CPU lane's workers (graphs/layers/layers.h; kernel backend): worker w's
     * tasks use cx[w], so no two running tasks share scratch */
    mf_ly_ctx **cx;
    int n_cx;
    const mf_config *c;
    mf_step_opts o;
    mf_sg_lanes lt;           /* cpu, io with a store, 3 per card (lanes of card c at lane_dev0 + 3c) */
    /* routed experts on devices (placement other than host) */
    mf_dev *dev;
    int n_cards;
    mf_dev_xcache *xc[MF_DEV_MAX_CARDS];
    size_t part_off[6], part_bytes[6];
    uint64_t xslot_bytes;
    int miss_span;            /* 1: the slot mirrors the resident experts' layout (mf_step_xslot_layout) */
    _Atomic int64_t miss_spans;   /* this call's misses copied as one span (mf_step_dev_stats) */
    int dev_graphs;           /* 1: a layer's device FFNs are one captured graph per card */
    mf_step_dev_stats dstat;
    _Atomic int64_t sock_home, sock_cross;   /* this call's (mf_step_dev_stats) */
    _Atomic int64_t dense_home, dense_cross;
    mf_step_fill_stats fill;  /* the warm fill at mf_step_new (mf_step_opts.dev_cache_fill) */
    mf_store *store;         /* its reads issued on this engine's IO lane (the slab registered there) */
    int eg_reads;            /* 1: the store's Engram tables are streamed: gathers are IO tasks */
    int max_items;           /* items per graph run: one layer's slots fit the store */
    int max_chunk;           /* positions of one sequence per graph run (a prefill chunk), likewise */
    mf_sched *sched;
    mf_sg_sizes *sz;          /* the model's sizes for the step graphs (from its layout) */
    mf_step_shape *shapes[2][MF_STEP_MAX_ITEMS + 1];   /* [par][n] */
    /* the serial shape of more than MF_STEP_MAX_ITEMS items (a long prefill chunk): one at a time,
     * replaced when another length is asked for (a prompt's shorter last chunk), so that a
     * prompt never holds more than one long chunk's activations */
    mf_step_shape *long_shape;
    /* shapes of other units (runs of a sequence's items beside single items: chunked prefill
     * mixed with decode), the least recently used replaced; used[k] the call count of last use */
    mf_step_shape *ushapes[MF_STEP_UNIT_SHAPES];
    uint64_t ushape_used[MF_STEP_UNIT_SHAPES], n_calls;
    /* the buffers every unit shape uses (mf_step_shape.mem of none of them): laid out for
     * max_items items, whatever a shape's own count, so that a kept unit shape costs its graph
     * only. One graph runs at a time and a run leaves nothing in them for the next, as a shape
     * run twice relies on already. */
    uint8_t *umem;
    size_t umem_bytes;
    mf_step_shape *last;
    mf_step_build_stats builds;   /* shapes built since mf_step_new (mf_step_builds) */
    mf_step_times times;
    mf_lane_model models[4];   /* mf_step_lane_models: cpu, copy in, card compute, copy out */
    /* dense work on cards (opts dense): cards holding it, cards with lanes (the larger of
     * n_cards and n_dense); each dense card's resident weights (mf_step_dense_weights): one device
     * allocation of dw_bytes, a view per weight it holds, per layer MF_STEP_DW_MAX (the head in
     * row n_layers) */
    int n_dense, n_lane_cards;
    int dense_card[MF_DEV_MAX_CARDS];   /* dense card k is device card dense_card[k] */
    uint8_t *dwmem[MF_DEV_MAX_CARDS];
    uint64_t dw_bytes[MF_DEV_MAX_CARDS];
    mf_step_dmat *dmat[MF_DEV_MAX_CARDS];
    char refused[1024];       /* the startup self-check's refusals ("" when none) */
    unsigned refused_mask;    /* cards refused by it */
    mf_profile prof;          /* a copy of the caller's o.profile (o.profile points here when given) */
};

const char *mf_step_phase_name(mf_step_phase p)
{
    static const char *const names[] = {"attention stack", "MoE", "Engram", "norm + head", "other"};
    return (unsigned)p < MF_STEP_N_PHASES ? names[p] : "?";
}

/* ---- tasks --------------------------------------------------------------------------------- */

/* With sockets: whether a host row part task reading rows [r0, r1) of w (a routed expert's part;
 * dense: a dense matrix of the model's) ran on a worker of the socket whose share holds them
 * (mf_topo_rows; with the store or the model split by sockets, their socket of the rows' first and
 * last bytes as well), counted for mf_step_last_dev. */
static void mf_step_count_socket(mf_step *eng, const mf_task_ctx *ctx, const mf_weight *w, int64_t r0, int64_t r1,
                                 int dense)
{
    if (eng->lt.n_sockets <= 1 || ctx->lane < 0 || ctx->lane >= eng->lt.n_lanes || r0 >= r1 || w->rows <= 0) return;
    int k = eng->lt.sock_of_lane[ctx->lane], ok = 0;
    for (int j = 0; j < eng->lt.n_sockets; j++) {
        int64_t a, b;
        mf_topo_rows(w->rows, eng->lt.n_sockets, j, &a, &b);
        if (r0 >= a && r0 < b) ok = j == k && r1 <= b;
    }
    if (ok && w->st_data && w->data) {
        uint64_t rb = w->st_data->n_bytes / (uint64_t)w->rows;
        const uint8_t *p0 = w->data + (uint64_t)r0 * rb, *p1 = w->data + (uint64_t)r1 * rb - 1;
        int in_store = eng->store && mf_store_socket_of(eng->store, w->data) >= 0;
        const mf_model *m = eng->ly->m;
        if (in_store) ok = mf_store_socket_of(eng->store, p0) == k && mf_store_socket_of(eng->store, p1) == k;
        else if (mf_model_socket_of(m, w->data) >= 0) ok = mf_model_socket_of(m, p0) == k && mf_model_socket_of(m, p1) == k;
    }
    _Atomic int64_t *c = dense ? (ok ? &eng->dense_home : &eng->dense_cross) : ok ? &eng->sock_home : &eng->sock_cross;
    atomic_fetch_add_explicit(c, 1, memory_order_relaxed);
}

static mf_kern_mat mf_step_mat(const mf_weight *w)
{
    mf_kern_mat m = {.w = w->data, .scale = w->scale, .n_out = (int)w->rows, .n_in = (int)w->cols};
    m.fmt = w->kind == MF_W_FP4 ? MF_KERN_FP4 : w->kind == MF_W_FP8 ? MF_KERN_FP8 : MF_KERN_BF16;
    return m;
}

/* The layer context of the worker running a task (the tasks that use one run on the CPU lane, whose
 * workers are 0..n_threads-1); NULL with an error when a task runs elsewhere. */
static mf_ly_ctx *mf_step_cx(const mf_step_targ *a, const mf_task_ctx *ctx)
{
    const mf_step *eng = a->sh->eng;
    if (ctx->lane < 0 || ctx->lane >= eng->lt.n_lanes || eng->lt.lane[ctx->lane].kind != MF_LANE_CPU ||
        ctx->worker < 0 || ctx->worker >= eng->n_cx) {
        mf_error(-EINVAL, "step: a task (op %d) on lane %d worker %d has no layer context", a->t->op, ctx->lane,
                 ctx->worker);
        return NULL;
    }
    int w = eng->lt.cpu_base[ctx->lane] + ctx->worker;   /* workers numbered across the sockets' lanes */
    if (w >= eng->n_cx) {
        mf_error(-EINVAL, "step: a task (op %d) on lane %d worker %d has no layer context", a->t->op, ctx->lane,
                 ctx->worker);
        return NULL;
    }
    return eng->cx[w];
}

/* The row of item i of Engram layer L in the shape's Engram buffers (eg_items per slot). */
static size_t mf_step_eg_row(const mf_step_shape *sh, int L, int i)
{
    return (size_t)mf_config_engram_slot(sh->eng->c, L) * (size_t)sh->eg_items + (size_t)i;
}

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

/* The attention sublayer (layer_attn.c's phases) between per-item parts on the workers' layer
 * contexts and row-split linear stages over all items. Item i's activations between phases. */
static void mf_step_abuf(const mf_step_shape *sh, int i, float **b)
{
    for (int k = 0; k < MF_LY_A_N; k++) b[k] = sh->ab[k] + (size_t)i * sh->ab_ld[k];
}

/* Columns [c0, c1) of item i's row (ld values apart) of activation x packed into its bf16 mirror m
 * (pack 1) or unpacked from it (pack 0): the host's side of a dense chain's bf16 copy; nothing
 * without a mirror (m NULL). Lossless for the values the copies carry (mf_sg_attn_buf_bf16). */
static void mf_step_bf16_cols(int pack, float *x, uint16_t *m, int64_t ld, int i, int64_t c0, int64_t c1)
{
    if (!m || c0 >= c1) return;
    size_t at = (size_t)i * (size_t)ld + (size_t)c0;
    if (pack) mf_kern_vec_bf16_pack(x + at, m + at, c1 - c0);
    else mf_kern_vec_bf16_unpack(m + at, x + at, c1 - c0);
}

/* The same for attention buffer b. */
static void mf_step_ab_cast(mf_step_shape *sh, int b, int pack, int i, int64_t c0, int64_t c1)
{
    mf_step_bf16_cols(pack, sh->ab[b], sh->ab16[b], sh->ab_ld[b], i, c0, c1);
}

/* The hyper-connection tasks: one item (a->t->i0) each, a part of its columns or its mix rows
 * [r0, r1) (graphs/step/stepgraph.h); the bits of the whole for any split (layer_hc.c's parts). */

/* Columns of the item's streams collapsed with the carried pre into its row of hcol (the next
 * sublayer's input before its norm; at layer -1 the final norm's). */
static int mf_task_attn_pre(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    int i = a->t->i0;
    (sh->eng->o.exact ? mf_ly_hc_collapse_cols : mf_fa_hc_collapse_cols)(
        cx, sh->items[i].x, sh->items[i].pre, sh->hcol + (size_t)i * cx->ly->c->hidden_size, a->t->r0, a->t->r1);
    return 0;
}

/* Columns of a norm of the item's collapse: attn_norm (the attention input), ffn_norm (the MoE
 * input) or the final norm (the head's input; items without logits have none). */
static int mf_step_norm_cols(mf_step_targ *a, mf_task_ctx *ctx, int op)
{
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_config *c = cx->ly->c;
    int64_t H = c->hidden_size;
    int i = a->t->i0;
    const mf_weight *w;
    float *out;
    if (op == MF_SG_NORM) {
        if (sh->head_row[i] < 0) return 0;
        w = mf_model_norm(cx->ly->m);
        out = sh->hn + (size_t)sh->head_row[i] * H;
    } else {
        const mf_model_layer *y = mf_model_layer_at(cx->ly->m, a->t->layer);
        w = op == MF_SG_ATTN_NORM ? &y->attn_norm : &y->ffn_norm;
        out = op == MF_SG_ATTN_NORM ? sh->ab[MF_LY_A_IN] + (size_t)i * sh->ab_ld[MF_LY_A_IN] : sh->xin + (size_t)i * H;
    }
    (sh->eng->o.exact ? mf_ly_rmsnorm_cols : mf_fa_rmsnorm_cols)(sh->hcol + (size_t)i * H, H, w, c->rms_norm_eps, out,
                                                                 a->t->r0, a->t->r1);
    if (op == MF_SG_ATTN_NORM) mf_step_ab_cast(sh, MF_LY_A_IN, 1, i, a->t->r0, a->t->r1);   /* for the cards' copies */
    if (op == MF_SG_FFN_NORM) mf_step_bf16_cols(1, sh->xin, sh->xin16, H, i, a->t->r0, a->t->r1);
    return 0;
}

static int mf_task_attn_norm(void *arg, mf_task_ctx *ctx) { return mf_step_norm_cols(arg, ctx, MF_SG_ATTN_NORM); }
static int mf_task_ffn_norm(void *arg, mf_task_ctx *ctx) { return mf_step_norm_cols(arg, ctx, MF_SG_FFN_NORM); }
static int mf_task_norm(void *arg, mf_task_ctx *ctx) { return mf_step_norm_cols(arg, ctx, MF_SG_NORM); }

/* Rows of the attention (amix) or ffn (fmix) mixes of the streams of the record's items (its item
 * group: not run per item by mf_task_items, so the fast path reads each row once per
 * mf_fa_mix_items items, mf_fa_hc_mixes_rows_items on up to MF_FA_MIX_ITEMS at a time; the bits of
 * one item's task per item). */
static int mf_step_mix_rows(mf_step_targ *a, mf_task_ctx *ctx, int ffn)
{
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_model_layer *y = mf_model_layer_at(cx->ly->m, a->t->layer);
    const mf_weight *fn = ffn ? &y->hc_ffn_fn : &y->hc_attn_fn;
    int k0 = (int)a->t->r0, k1 = (int)a->t->r1;
    for (int i0 = a->t->i0; i0 < a->t->i1; i0 += MF_FA_MIX_ITEMS) {
        int G = a->t->i1 - i0 < MF_FA_MIX_ITEMS ? a->t->i1 - i0 : MF_FA_MIX_ITEMS;
        const float *x[MF_FA_MIX_ITEMS];
        float *mix[MF_FA_MIX_ITEMS];
        for (int g = 0; g < G; g++) {
            x[g] = sh->items[i0 + g].x;
            mix[g] = (ffn ? sh->fmix : sh->amix) + (size_t)(i0 + g) * MF_STEP_N_MIX;
            if (sh->eng->o.exact) mf_ly_hc_mixes_rows(cx, x[g], fn, mix[g], k0, k1);
        }
        if (!sh->eng->o.exact) mf_fa_hc_mixes_rows_items(cx, x, G, fn, mix, k0, k1);
    }
    return 0;
}

static int mf_task_attn_mix(void *arg, mf_task_ctx *ctx) { return mf_step_mix_rows(arg, ctx, 0); }
static int mf_task_ffn_mix(void *arg, mf_task_ctx *ctx) { return mf_step_mix_rows(arg, ctx, 1); }

/* Rows of linear stage a->t->stage (MF_LY_A_STAGE_*) of layer a->t->layer, part a->t->part of sh->p_attn:
 * the rows of each linear mf_sg_stage_rows gives the part (with sockets: of its socket's share of
 * each), each part over all items (weights read once for the batch); a row's bits do not depend on
 * the split. */
static int mf_task_attn_rows(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    mf_ly_attn_lin lin[MF_LY_A_MAX_LIN];
    int n = mf_ly_attn_linears(cx->ly, a->t->layer, a->t->stage, lin);
    int64_t rows[MF_SG_MAX_STAGE_LIN], r0[MF_SG_MAX_STAGE_LIN], r1[MF_SG_MAX_STAGE_LIN];
    for (int k = 0; k < n; k++) rows[k] = lin[k].w->rows;
    mf_sg_stage_rows(rows, n, sh->p_attn, sh->eng->lt.n_sockets, a->t->part, r0, r1);
    for (int k = 0; k < n; k++) {
        const mf_ly_attn_lin *l = &lin[k];
        int64_t lo = r0[k], hi = r1[k];
        if (lo >= hi) continue;
        mf_step_count_socket(sh->eng, ctx, l->w, lo, hi, 1);
        size_t i0 = (size_t)a->t->i0;   /* the micro-batch's items */
        int rc = (l->groups && !sh->eng->o.exact ? mf_fa_grouped_rows : mf_ly_attn_lin_rows)(
            cx, l, sh->ab[l->x] + i0 * sh->ab_ld[l->x], sh->ab_ld[l->x], sh->ab[l->y] + i0 * sh->ab_ld[l->y],
            sh->ab_ld[l->y], a->t->n_tok, lo, hi);
        if (rc) return mf_error_wrap(rc, "step: layer %d, rows [%lld, %lld) of %s", a->t->layer, (long long)lo,
                                     (long long)hi, l->w->name ? l->w->name : "an attention linear");
    }
    return 0;
}

/* Items: the q norm's scale of each one's low-rank query (rounded by the IN stage), into qrs. */
static int mf_task_attn_qscale(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    const mf_config *c = sh->eng->c;
    for (int i = a->t->i0; i < a->t->i1; i++) {
        mf_step_ab_cast(sh, MF_LY_A_QR, 0, i, 0, c->q_lora_rank);   /* in's copy out */
        sh->qrs[i] = mf_ly_rms_scale(sh->ab[MF_LY_A_QR] + (size_t)i * sh->ab_ld[MF_LY_A_QR], c->q_lora_rank,
                                     c->rms_norm_eps);
    }
    return 0;
}

/* Columns [r0, r1) of the item's low-rank query normed in place with its scale (after the QSCALE
 * task of its group): mf_ly_attn_qnorm's bits for any split. */
static int mf_task_attn_qnorm(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    int i = a->t->i0;
    float *q = sh->ab[MF_LY_A_QR] + (size_t)i * sh->ab_ld[MF_LY_A_QR];
    mf_ly_rmsnorm_apply(q, &mf_model_layer_at(sh->eng->ly->m, a->t->layer)->q_norm, sh->qrs[i], q, a->t->r0,
                        a->t->r1);
    mf_step_ab_cast(sh, MF_LY_A_QR, 1, i, a->t->r0, a->t->r1);   /* for qb's copy in */
    return 0;
}

/* The core's window KV per item, in item order: window KV (into the ring unless the ring task
 * writes it), compressor; after the IN stage, beside the q norm and the QB stage. The compressor
 * of a long unit (part 1) runs in item ranges, several at once (mf_ly_attn_kv_compress_item: an
 * item reads the one before it, not the state); the range holding a sequence's first item of the
 * step leaves the state (mf_ly_attn_kv_compress_state) after that item. */
static int mf_task_attn_kv(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_ly_item *items = sh->items;
    float *b[MF_LY_A_N], *prev[MF_LY_A_N];
    int part = a->t->part, L = a->t->layer;   /* -1: the window KV and the compressor; 0: the window KV; 1: the compressor */
    for (int i = a->t->i0; i < a->t->i1; i++) {
        mf_step_abuf(sh, i, b);
        int rc = 0, first = i == 0 || items[i - 1].st != items[i].st;
        if (part < 0) rc = mf_ly_attn_window_kv(cx, &sh->items[i], L, b);
        else if (part == 0) mf_ly_attn_kv_window(cx, &sh->items[i], L, b);
        else {
            if (!first) mf_step_abuf(sh, i - 1, prev);
            rc = mf_ly_attn_kv_compress_item(cx, &items[i], L, b, first ? NULL : prev);
            if (!rc && first) {   /* the state, from the sequence's last item in the step */
                int j = i;
                while (j + 1 < sh->n && items[j + 1].st == items[i].st) j++;
                mf_step_abuf(sh, j, prev);
                rc = mf_ly_attn_kv_compress_state(cx, &items[i], &items[j], L, prev);
            }
        }
        if (rc) return rc;
        if (part < 0 && !sh->sg->ring_late) mf_ly_attn_ring_write(cx, &sh->items[i], L, b[MF_LY_A_KV]);
    }
    return 0;
}

/* The rest of the core's prep per item, in item order (after the window KV and the QB stage): the
 * index query; on layers without score tasks the select (hook). */
static int mf_task_attn_core(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    int scored = mf_sg_layer_scored(cx->ly->c, a->t->layer);
    float *b[MF_LY_A_N];
    const mf_config *c = cx->ly->c;
    for (int i = a->t->i0; i < a->t->i1; i++) {
        mf_step_abuf(a->sh, i, b);
        if (scored)   /* qb's copy out of the indexer's queries (their only reader rounds them first) */
            mf_step_ab_cast(a->sh, MF_LY_A_QI, 0, i, 0, (int64_t)c->index_n_heads * c->index_head_dim);
        mf_ly_attn_index_query(cx, &a->sh->items[i], a->t->layer, b);
        if (!scored) mf_ly_attn_core_select(cx, &a->sh->items[i], a->t->layer, cx->scores);
    }
    return 0;
}

/* Part a->t->part of the item's index score parts (mf_stepgraph_key_parts): its range of the
 * visible entries into the item's row of iscore (disjoint ranges: any split, the same bits). */
static int mf_task_attn_score(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    const mf_layers *ly = sh->eng->ly;
    int i = a->t->i0, q = a->t->part, P = mf_stepgraph_key_parts(sh->sg, i);
    int64_t n_vis = mf_ly_index_n_vis(ly->c, a->t->layer, sh->items[i].pos);
    float *b[MF_LY_A_N];
    mf_step_abuf(sh, i, b);
    (sh->eng->o.exact ? mf_ly_index_scores : mf_fa_index_scores)(
        ly, &sh->items[i], a->t->layer, b, sh->iscore + (size_t)i * sh->iscore_ld, n_vis * q / P, n_vis * (q + 1) / P);
    return 0;
}

/* Per item, in item order: the candidate mask and top-k from its scores (the select hook). With
 * the scores on cards and sk_host, the item's scores on the host first. */
static int mf_task_attn_select(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    int L = a->t->layer, host = sh->sg->scores_cards[L] && sh->sk_host;
    for (int i = a->t->i0; i < a->t->i1; i++) {
        double *score = sh->iscore + (size_t)i * sh->iscore_ld;
        if (host) {
            float *b[MF_LY_A_N];
            mf_step_abuf(sh, i, b);
            mf_fa_index_scores(cx->ly, &sh->items[i], L, b, score, 0, mf_ly_index_n_vis(cx->ly->c, L, sh->items[i].pos));
        }
        (sh->eng->o.exact ? mf_ly_attn_core_select : mf_fa_attn_select)(cx, &sh->items[i], L, score);
    }
    return 0;
}

/* The first item of [i0, i1) that is not the position after the one before it in the same
 * sequence, -1 when they are consecutive positions of one sequence (what the cards' heads and
 * index scores take). */
static int mf_step_items_gap(const mf_step_shape *sh, int i0, int i1)
{
    const mf_ly_item *it = sh->items;
    for (int i = i0 + 1; i < i1; i++)
        if (it[i].st != it[i0].st || it[i].pos != it[i0].pos + (i - i0)) return i;
    return -1;
}

/* ---- the index scores on cards (graphs/step/stepgraph.h MF_SG_ATTN_KEYS, MF_SG_D_SCORES) ----- */

/* The unit's index keys: the entries of layer L's index source its last item sees, unpacked as
 * the host's scores unpack them (mf_ly_cache_get_keys), and each item's visible count; sk_host
 * when the items are not consecutive positions of one sequence or see more than
 * MF_SG_SCORE_ENTRIES entries (mf_step_opts.scores_entries: fewer). */
static int mf_task_attn_keys(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    const mf_layers *ly = sh->eng->ly;
    const mf_config *c = ly->c;
    int L = a->t->layer, i0 = a->t->i0, i1 = a->t->i1;
    const mf_ly_item *it = sh->items;
    sh->sk_host = mf_step_items_gap(sh, i0, i1) >= 0;
    sh->sk_nkeys = mf_ly_index_n_vis(c, L, it[i1 - 1].pos);
    int cap = sh->eng->o.scores_entries > 0 && sh->eng->o.scores_entries < MF_SG_SCORE_ENTRIES
                  ? sh->eng->o.scores_entries : MF_SG_SCORE_ENTRIES;
    if (sh->sk_nkeys > cap) sh->sk_host = 1;
    if (sh->sk_host) return 0;
    for (int i = i0; i < i1; i++) sh->sk_nvis[i] = (int32_t)mf_ly_index_n_vis(c, L, it[i].pos);
    int S = ly->src_of[L];
    if (sh->sk_nkeys > 0) mf_ly_cache_get_keys(c, S, &it[i0].st->cache[S], 0, sh->sk_nkeys, sh->sk_tab);
    return 0;
}

/* The most entries any of the task's items sees: the keys its card reads, its score rows' width. */
static int64_t mf_step_scores_keys(const mf_step_targ *a)
{
    int64_t m = 0;
    for (int i = a->t->i0; i < a->t->i1; i++) m = a->sh->sk_nvis[i] > m ? a->sh->sk_nvis[i] : m;
    return m;
}

/* The scores' copy in (out 0: the items' index queries and head weights, their counts, the keys
 * they see) or out (out 1: their scores into their rows of iscore) on the task's card. */
static int mf_step_scores_copy(const mf_step_targ *a, mf_dev_stream *q, int out)
{
    mf_step_shape *sh = a->sh;
    if (sh->sk_host) return MF_TASK_NO_WORK;
    const mf_config *c = sh->eng->c;
    int i0 = a->t->i0, n = a->t->i1 - i0, ih = c->index_n_heads, id = c->index_head_dim;
    int64_t nk = mf_step_scores_keys(a);
    uint8_t *db = sh->ddense[a->t->card];
    size_t f = sizeof(float);
    if (out) {
        if (!nk) return MF_TASK_NO_WORK;
        size_t w = (size_t)nk * sizeof(double);
        return mf_dev_copy_d2h_2d(q, sh->iscore + (size_t)i0 * sh->iscore_ld, (size_t)sh->iscore_ld * sizeof(double),
                                  db + sh->dd_sk_score, w, w, (size_t)n);
    }
    int rc = 0;
    for (int k = 0; k < 2 && !rc; k++) {   /* the queries, the head weights: the items' rows, as on the host */
        int b = k ? MF_LY_A_IW : MF_LY_A_QI;
        size_t ld = (size_t)sh->ab_ld[b] * f, off = (size_t)i0 * ld;
        rc = mf_dev_copy_h2d_2d(q, db + sh->dd_ab[b] + off, ld, (uint8_t *)sh->ab[b] + off, ld,
                                (size_t)(k ? ih : ih * id) * f, (size_t)n);
    }
    if (!rc) rc = mf_dev_copy_h2d(q, db + sh->dd_sk_nvis + (size_t)i0 * 4, sh->sk_nvis + i0, (size_t)n * 4);
    if (!rc && nk) rc = mf_dev_copy_h2d(q, db + sh->dd_sk_tab, sh->sk_tab, (size_t)nk * id * f);
    return rc;
}

/* The task's items' index scores on its card's compute stream (mf_dev_index_scores: the host's
 * arithmetic; mf_step_opts.scores_fault: the last index head left out). */
static int mf_step_scores_launch(const mf_step_targ *a, mf_dev_stream *st)
{
    mf_step_shape *sh = a->sh;
    int64_t nk = sh->sk_host ? 0 : mf_step_scores_keys(a);
    if (!nk) return MF_TASK_NO_WORK;
    const mf_config *c = sh->eng->c;
    int i0 = a->t->i0;
    uint8_t *db = sh->ddense[a->t->card];
    mf_dev_iscore is = {.q = (const float *)(db + sh->dd_ab[MF_LY_A_QI]) + i0 * sh->ab_ld[MF_LY_A_QI],
                        .ld_q = sh->ab_ld[MF_LY_A_QI],
                        .w = (const float *)(db + sh->dd_ab[MF_LY_A_IW]) + i0 * sh->ab_ld[MF_LY_A_IW],
                        .ld_w = sh->ab_ld[MF_LY_A_IW], .n_tok = a->t->i1 - i0, .n_heads = c->index_n_heads,
                        .D = c->index_head_dim, .keys = (const float *)(db + sh->dd_sk_tab), .n_keys = nk,
                        .n_vis = (const int32_t *)(db + sh->dd_sk_nvis) + i0, .score = (double *)(db + sh->dd_sk_score),
                        .ld_s = nk};
    if (sh->eng->o.scores_fault && is.n_heads > 1) is.n_heads--;
    int rc = mf_dev_index_scores(st, &is);
    return rc ? mf_error_wrap(rc, "the index scores of layer %d on card %d", a->t->layer, a->t->card) : 0;
}

/* Heads [h0, h1) of item a->t->i0 on the host. With the ring written late, the window positions
 * of its sequence's items in this graph are read from their KV rows. */
static void mf_step_heads_host(const mf_step_targ *a, mf_ly_ctx *cx, int h0, int h1)
{
    mf_step_shape *sh = a->sh;
    int i = a->t->i0, j0 = i;
    float *b[MF_LY_A_N];
    mf_step_abuf(sh, i, b);
    mf_ly_win win, *wp = NULL;
    if (sh->sg->ring_late) {   /* the first item of the sequence's run of items */
        while (j0 > 0 && sh->items[j0 - 1].st == sh->items[i].st) j0--;
        win = (mf_ly_win){.kv = sh->ab[MF_LY_A_KV] + (size_t)j0 * sh->ab_ld[MF_LY_A_KV], .ld = sh->ab_ld[MF_LY_A_KV],
                          .pos0 = sh->items[j0].pos};
        wp = &win;
    }
    int D = sh->eng->c->head_dim;
    mf_step_ab_cast(sh, MF_LY_A_Q, 0, i, (int64_t)h0 * D, (int64_t)h1 * D);   /* qb's queries from a card */
    (sh->eng->o.exact ? mf_ly_attn_core_heads : mf_fa_attn_heads)(cx, &sh->items[i], a->t->layer, b, h0, h1, wp);
    mf_step_ab_cast(sh, MF_LY_A_O, 1, i, (int64_t)h0 * D, (int64_t)h1 * D);   /* for oa's copy */
}

/* The heads of rows [r0, r1) of the item's attention output. */
static int mf_task_attn_heads(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    int D = cx->ly->c->head_dim;
    mf_step_heads_host(a, cx, (int)(a->t->r0 / D), (int)(a->t->r1 / D));
    return 0;
}

/* ---- copies of the dense work on cards ---------------------------------------------------- */

/* One copy of a dense sublayer: `rows` rows of n values, ld values apart, from the value at host
 * (its device copy at offset off of the card's buffer, the same layout); with host16 (the value's
 * place in its bf16 mirror, its card's copy at off16) it moves as bf16 (mf_sg_attn_buf_bf16). */
typedef struct mf_step_dcopy {
    float *host;
    uint16_t *host16;
    size_t off, off16, n, rows, ld;
} mf_step_dcopy;

/* Columns [c0, c1) of the vectors (ld floats each) of n_tok items from item i0: host buffer host at
 * device offset off, its bf16 mirror host16 (NULL: none) at off16. */
static mf_step_dcopy mf_step_dcopy_cols(float *host, uint16_t *host16, size_t off, size_t off16, int64_t ld, int64_t c0,
                                        int64_t c1, size_t i0, size_t n_tok)
{
    size_t at = i0 * (size_t)ld + (size_t)c0;
    return (mf_step_dcopy){host + at, host16 ? host16 + at : NULL, off + at * sizeof(float), off16 + at * 2,
                           (size_t)(c1 - c0), n_tok, (size_t)ld};
}

/* The columns of attention buffer b. */
static mf_step_dcopy mf_step_dcopy_ab(const mf_step_shape *sh, int b, int64_t c0, int64_t c1, size_t i0, size_t n_tok)
{
    return mf_step_dcopy_cols(sh->ab[b], sh->ab16[b], sh->dd_ab[b], sh->dd16_ab[b], sh->ab_ld[b], c0, c1, i0, n_tok);
}

/* Enqueues copy cp on q into (out 0) or out of (out 1) the card's buffer db: one block when its rows
 * are whole, else one 2D copy; as bf16 the card's copy stream packs the floats before (out) or
 * unpacks them after (in) the copy of the codes (mf_dev_bf16_pack, _unpack). */
static int mf_step_dcopy_run(mf_dev_stream *q, uint8_t *db, const mf_step_dcopy *cp, int out)
{
    int bf = cp->host16 != NULL, rows = (int)cp->rows, n = (int)cp->n;
    size_t vb = bf ? 2 : sizeof(float), w = cp->n * vb, pitch = cp->ld * vb;
    float *df = (float *)(void *)(db + cp->off);
    uint16_t *d16 = (uint16_t *)(void *)(db + cp->off16);
    uint8_t *dev = bf ? (uint8_t *)d16 : (uint8_t *)df, *host = bf ? (uint8_t *)cp->host16 : (uint8_t *)cp->host;
    int rc = 0;
    if (out && bf) rc = mf_dev_bf16_pack(q, df, (int64_t)cp->ld, d16, (int64_t)cp->ld, rows, n);
    if (!rc && (rows == 1 || cp->n == cp->ld))
        rc = out ? mf_dev_copy_d2h(q, host, dev, (cp->rows - 1) * pitch + w)
                 : mf_dev_copy_h2d(q, dev, host, (cp->rows - 1) * pitch + w);
    else if (!rc)
        rc = out ? mf_dev_copy_d2h_2d(q, host, pitch, dev, pitch, w, cp->rows)
                 : mf_dev_copy_h2d_2d(q, dev, pitch, host, pitch, w, cp->rows);
    if (!rc && !out && bf) rc = mf_dev_bf16_unpack(q, d16, (int64_t)cp->ld, df, (int64_t)cp->ld, rows, n);
    return rc;
}

/* ---- the heads on cards (graphs/step/stepgraph.h MF_SG_ATTN_GATHER, _QPREP, MF_SG_D_HEADS, _OPOST) */

/* The unit's key table: its items consecutive positions of one sequence; the ring's window rows
 * before the chunk (all the window when the ring is written before the heads) unpacked as the
 * host's heads unpack them (mf_fa_ring_rows), the union of the items' selections of layer L's KV
 * source in entry order, each entry unpacked once as mf_ly_item_sel_kv does (mf_ly_cache_get_kv),
 * and the sinks. */
static int mf_task_attn_gather(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    const mf_layers *ly = sh->eng->ly;
    const mf_config *c = ly->c;
    int L = a->t->layer, i0 = a->t->i0, i1 = a->t->i1, D = c->head_dim, W = c->sliding_window;
    const mf_ly_item *it = sh->items;
    int gap = mf_step_items_gap(sh, i0, i1);
    if (gap >= 0)
        return mf_error(-EINVAL, "step: heads on cards: item %d is not the position after item %d of its sequence",
                        gap, gap - 1);
    int64_t pos0 = it[i0].pos, last = it[i1 - 1].pos;
    sh->hk_pos0 = pos0;
    sh->hk_t0 = pos0 - W + 1 < 0 ? 0 : pos0 - W + 1;
    sh->hk_ring_hi = sh->sg->ring_late ? pos0 : last + 1;   /* the window rows the ring holds */
    sh->hk_nring = (int)(sh->hk_ring_hi - sh->hk_t0);
    sh->hk_nchunk = sh->sg->ring_late ? i1 - i0 : 0;
    sh->hk_nent = 0;
    sh->hk_host = 0;
    if (sh->hk_nring > 0) mf_fa_ring_rows(c, it[i0].st, L, sh->hk_t0, sh->hk_nring, sh->hk_tab);
    int S = ly->src_of[L];
    if (c->compress_ratios[L] > 0) {
        int64_t nv = 0;   /* entries [0, nv) hold every selected one */
        for (int i = i0; i < i1; i++)
            for (int j = 0; it[i].topk_src == S && j < it[i].n_topk; j++)
                if (it[i].topk[j] + 1 > nv) nv = it[i].topk[j] + 1;
        if (nv > sh->hk_map_cap) {
            int32_t *m = realloc(sh->hk_map, sizeof *m * (size_t)nv);
            if (!m) return mf_error(-ENOMEM, "step: heads on cards: a map of %lld entries", (long long)nv);
            sh->hk_map = m;
            sh->hk_map_cap = nv;
        }
        for (int64_t j = 0; j < nv; j++) sh->hk_map[j] = -1;
        for (int i = i0; i < i1; i++)
            for (int j = 0; it[i].topk_src == S && j < it[i].n_topk; j++) sh->hk_map[it[i].topk[j]] = -2;
        int base = sh->hk_nring + sh->hk_nchunk;
        for (int64_t j = 0; j < nv; j++) {
            if (sh->hk_map[j] != -2) continue;
            if (sh->hk_nent == sh->hk_ecap) {   /* more than the card's table holds: the host's heads */
                sh->hk_host = 1;
                return 0;
            }
            sh->hk_map[j] = base + sh->hk_nent;
            mf_ly_cache_get_kv(c, S, &it[i0].st->cache[S], j, sh->hk_tab + (int64_t)(sh->hk_nring + sh->hk_nent++) * D);
        }
    }
    const mf_model_layer *y = mf_model_layer_at(ly->m, L);
    for (int h = 0; h < c->n_heads; h++) sh->hk_sink[h] = mf_ly_vec(&y->attn_sink, h);
    return 0;
}

/* The item's queries prepared (mf_fa_heads_q) and its key list: its window positions in order
 * (the ring's rows, then the chunk's), then its selection in selection order, as
 * mf_fa_attn_heads takes them. With hk_host: the host's heads of the item instead. */
static int mf_task_attn_qprep(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_config *c = cx->ly->c;
    int i = a->t->i0, L = a->t->layer, W = c->sliding_window, KK = sh->sg->heads_keys;
    if (sh->hk_host) {
        mf_step_heads_host(a, cx, 0, c->n_heads);
        return 0;
    }
    const mf_ly_item *it = &sh->items[i];
    float *b[MF_LY_A_N];
    int64_t nq = (int64_t)c->n_heads * c->head_dim;
    mf_step_abuf(sh, i, b);
    mf_step_ab_cast(sh, MF_LY_A_Q, 0, i, 0, nq);   /* qb's copy out, then the heads' copy in */
    mf_fa_heads_q(cx->ly, it, L, b[MF_LY_A_Q], 0, c->n_heads);
    mf_step_ab_cast(sh, MF_LY_A_Q, 1, i, 0, nq);
    int32_t *row = sh->hk_keys + (size_t)i * KK;
    int64_t p = it->pos, t0 = p - W + 1 < 0 ? 0 : p - W + 1, m = 0;
    for (int64_t t = t0; t <= p; t++)
        row[m++] = (int32_t)(t < sh->hk_ring_hi ? t - sh->hk_t0 : sh->hk_nring + (t - sh->hk_pos0));
    if (c->compress_ratios[L] > 0 && it->topk_src == cx->ly->src_of[L])
        for (int j = 0; j < it->n_topk; j++) row[m++] = sh->hk_map[it->topk[j]];
    sh->hk_nk[i] = (int32_t)m;
    return 0;
}

/* The item's heads' outputs inverse-roped (mf_fa_heads_o); nothing with hk_host. */
static int mf_task_attn_opost(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    if (sh->hk_host) return 0;
    float *b[MF_LY_A_N];
    int i = a->t->i0;
    int64_t no = (int64_t)cx->ly->c->n_heads * cx->ly->c->head_dim;
    mf_step_abuf(sh, i, b);
    mf_step_ab_cast(sh, MF_LY_A_O, 0, i, 0, no);   /* the heads' copy out, then oa's copy in */
    mf_fa_heads_o(cx->ly, &sh->items[i], a->t->layer, b[MF_LY_A_O], 0, cx->ly->c->n_heads);
    mf_step_ab_cast(sh, MF_LY_A_O, 1, i, 0, no);
    return 0;
}

/* The heads' copy in (out 0) or out (out 1) on the task's card: in the prepared queries of its
 * heads, the key table (the ring's rows, the chunk's KV rows, the entries), the items' key lists
 * and counts, the sinks; out its heads' outputs. */
static int mf_step_heads_copy(const mf_step_targ *a, mf_dev_stream *q, int out)
{
    mf_step_shape *sh = a->sh;
    if (sh->hk_host) return MF_TASK_NO_WORK;
    const mf_config *c = sh->eng->c;
    int i0 = a->t->i0, n = a->t->i1 - i0, D = c->head_dim, KK = sh->sg->heads_keys;
    uint8_t *db = sh->ddense[a->t->card];
    size_t f = sizeof(float), row = (size_t)D * f;
    /* the task's heads' columns of the queries or outputs (bf16: mf_sg_attn_buf_bf16) */
    mf_step_dcopy cq = mf_step_dcopy_ab(sh, out ? MF_LY_A_O : MF_LY_A_Q, a->t->r0, a->t->r1, (size_t)i0, (size_t)n);
    int rc = mf_step_dcopy_run(q, db, &cq, out);
    if (out) return rc;
    /* the key table and the sinks, which the blocks share: block 0's (its items from the unit's
     * first, the chunk's KV rows from there; the blocks' copy-ins run in order) */
    int first = a->t->block == 0;
    uint8_t *tab = db + sh->dd_hk_tab;
    if (!rc && first && sh->hk_nring) rc = mf_dev_copy_h2d(q, tab, sh->hk_tab, (size_t)sh->hk_nring * row);
    if (!rc && first && sh->hk_nchunk) {
        size_t ldkv = (size_t)sh->ab_ld[MF_LY_A_KV] * f;
        rc = mf_dev_copy_h2d_2d(q, tab + (size_t)sh->hk_nring * row, row, (uint8_t *)sh->ab[MF_LY_A_KV] + (size_t)i0 * ldkv,
                                ldkv, row, (size_t)sh->hk_nchunk);
    }
    if (!rc && first && sh->hk_nent)
        rc = mf_dev_copy_h2d(q, tab + (size_t)(sh->hk_nring + sh->hk_nchunk) * row, sh->hk_tab + (size_t)sh->hk_nring * D,
                             (size_t)sh->hk_nent * row);
    if (!rc)
        rc = mf_dev_copy_h2d(q, db + sh->dd_hk_keys + (size_t)i0 * KK * 4, sh->hk_keys + (size_t)i0 * KK,
                             (size_t)n * KK * 4);
    if (!rc) rc = mf_dev_copy_h2d(q, db + sh->dd_hk_nk + (size_t)i0 * 4, sh->hk_nk + i0, (size_t)n * 4);
    if (!rc && first) rc = mf_dev_copy_h2d(q, db + sh->dd_hk_sink, sh->hk_sink, (size_t)c->n_heads * f);
    return rc;
}

/* The task's heads' scores and values on its card's compute stream st (mf_dev_attn_heads: the
 * host's heads' arithmetic; mf_step_opts.heads_fault: the scale 1% off). */
static int mf_step_heads_launch(const mf_step_targ *a, mf_dev_stream *st)
{
    mf_step_shape *sh = a->sh;
    const mf_config *c = sh->eng->c;
    int i0 = a->t->i0, D = c->head_dim, KK = sh->sg->heads_keys;
    uint8_t *db = sh->ddense[a->t->card];
    mf_dev_attn at = {.q = (const float *)(db + sh->dd_ab[MF_LY_A_Q]) + i0 * sh->ab_ld[MF_LY_A_Q] + a->t->r0,
                      .ld_q = sh->ab_ld[MF_LY_A_Q], .n_tok = a->t->i1 - i0, .n_heads = (int)((a->t->r1 - a->t->r0) / D),
                      .D = D, .scale = (float)(1.0 / sqrt((double)D)),
                      .sink = (const float *)(db + sh->dd_hk_sink) + a->t->r0 / D,
                      .kv = (const float *)(db + sh->dd_hk_tab), .n_kv = sh->hk_nring + sh->hk_nchunk + sh->hk_nent,
                      .keys = (const int32_t *)(db + sh->dd_hk_keys) + (size_t)i0 * KK,
                      .n_keys = (const int32_t *)(db + sh->dd_hk_nk) + i0, .ld_keys = KK,
                      .o = (float *)(db + sh->dd_ab[MF_LY_A_O]) + i0 * sh->ab_ld[MF_LY_A_O] + a->t->r0,
                      .ld_o = sh->ab_ld[MF_LY_A_O]};
    if (sh->eng->o.heads_fault) at.scale *= 1.01f;
    int rc = mf_dev_attn_heads(st, &at);
    return rc ? mf_error_wrap(rc, "the heads of layer %d on card %d", a->t->layer, a->t->card) : 0;
}

/* The items' window KV into the ring, in item order (after every head of the items). */
static int mf_task_attn_ring(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    for (int i = a->t->i0; i < a->t->i1; i++)
        mf_ly_attn_ring_write(cx, &a->sh->items[i], a->t->layer,
                              a->sh->ab[MF_LY_A_KV] + (size_t)i * a->sh->ab_ld[MF_LY_A_KV]);
    return 0;
}

/* Columns of the attention output expanded into the item's streams (with the split of its
 * attention mixes), then collapsed with that mix's pre into hcol (the MoE input before ffn_norm):
 * the rest of the first part of the reference's layer (ref_model.c). */
static int mf_task_attn_post(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_config *c = cx->ly->c;
    const mf_model_layer *y = mf_model_layer_at(cx->ly->m, a->t->layer);
    int64_t H = c->hidden_size;
    int i = a->t->i0;
    mf_ly_item *it = &sh->items[i];
    float pre[MF_LY_MAX_HC], post[MF_LY_MAX_HC], comb[MF_LY_MAX_HC * MF_LY_MAX_HC];
    mf_ly_hc_split_w(c, sh->amix + (size_t)i * MF_STEP_N_MIX, &y->hc_attn_scale, &y->hc_attn_base, pre, post, comb);
    int ex = sh->eng->o.exact;
    mf_step_ab_cast(sh, MF_LY_A_OUT, 0, i, a->t->r0, a->t->r1);   /* ob's copy out */
    (ex ? mf_ly_hc_expand_cols : mf_fa_hc_expand_cols)(cx, it->x, sh->ab[MF_LY_A_OUT] + (size_t)i * sh->ab_ld[MF_LY_A_OUT],
                                                       post, comb, a->t->r0, a->t->r1);
    (ex ? mf_ly_hc_collapse_cols : mf_fa_hc_collapse_cols)(cx, it->x, pre, sh->hcol + (size_t)i * H, a->t->r0, a->t->r1);
    return 0;
}

/* Rows (experts) of part a->t->part of sh->p_attn of the router's gate logits, over all items: on
 * the kernels' fp32 sums (mf_fa_gate_rows), with exact as the reference sums them (double sums),
 * so the routing is the reference's. */
static int mf_task_gate_rows(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    const mf_weight *w = &mf_model_layer_at(cx->ly->m, a->t->layer)->gate;
    int r0 = (int)a->t->r0, r1 = (int)a->t->r1;   /* the record's rows (mf_sg_expert_rows) */
    if (r0 >= r1) return 0;
    mf_step_count_socket(sh->eng, ctx, w, r0, r1, 1);
    int64_t H = sh->eng->c->hidden_size;
    size_t i0 = (size_t)a->t->i0;   /* the micro-batch's items */
    int rc = (sh->eng->o.exact ? mf_ly_gate_rows : mf_fa_gate_rows)(cx, a->t->layer, sh->xin + i0 * H, a->t->i1 - a->t->i0, H, sh->logits + i0 * w->rows,
                             w->rows, r0, r1);
    return rc ? mf_error_wrap(rc, "step: layer %d, rows [%d, %d) of the router gate", a->t->layer, r0, r1) : 0;
}

/* Top-k of the gate logits of items [i0, i1), in item order (with the route hook). */
static void mf_step_topk(mf_step_shape *sh, mf_ly_ctx *cx, int L, int i0, int i1)
{
    const mf_config *c = cx->ly->c;
    int K = c->n_experts_per_tok, E = c->n_routed_experts;
    for (int i = i0; i < i1; i++)
        mf_ly_route_item(cx, &sh->items[i], L, sh->logits + (size_t)i * E, sh->ex + (size_t)i * K,
                         sh->wt + (size_t)i * K);
}

/* 1 when slot s is used in this layer (among its micro-batch's first n_used). */
static int mf_step_slot_live(const mf_step_shape *sh, int s)
{
    int h = mf_stepgraph_half_of_slot(sh->sg, s);
    return s - sh->sg->half_slot[h] < sh->n_used[h];
}

/* Opens the store's batch for micro-batch h's slots of layer L (hits and misses decided, all
 * pinned) and fills each slot's IO reads (none on hits) and weight views into the slab. */
static int mf_step_store_begin(mf_step_shape *sh, int L, int h)
{
    mf_store *st = sh->eng->store;
    const mf_model_layer *y = mf_model_layer_at(sh->eng->ly->m, L);
    int s0 = sh->sg->half_slot[h], nu = sh->n_used[h];
    int rc = mf_store_begin(st, L, sh->slot_e + s0, nu), any = 0;
    if (rc) return mf_error_wrap(rc, "step: layer %d: making its %d experts present", L, nu);
    sh->store_layer = L;
    sh->store_half = h;
    for (int s = s0; s < sh->sg->half_slot[h + 1]; s++) {
        int nr = 0, q = s - s0;   /* the slot's place in the store's batch */
        const mf_io_read *rd = q < nu ? mf_store_reads(st, q, &nr) : NULL;
        for (int j = 0; j < sh->n_parts; j++)
            sh->slot_rd[(size_t)s * sh->n_parts + j] = j < nr ? rd[j] : (mf_io_read){.fd = -1};
        any |= nr > 0;
        if (q >= nu) continue;
        for (int k = 0; k < 3; k++) {
            mf_weight *w = &sh->slot_w[(size_t)s * 3 + k];
            *w = y->experts[sh->slot_e[s] * 3 + k];
            w->data = mf_store_batch_part(st, q, 2 * k);
            w->scale = mf_store_batch_part(st, q, 2 * k + 1);
            if (!w->data || !w->scale) {
                sh->store_layer = -1;
                return mf_store_end(st, mf_error(-EFAULT, "step: %s has no place in the expert store "
                                                 "(internal)", w->name));
            }
        }
    }
    if (any && (rc = mf_store_check(st))) {
        sh->store_layer = -1;
        return mf_store_end(st, rc);
    }
    return 0;
}

/* The experts of a slot: the model's (resident), or their place in the store's slab. */
static const mf_weight *mf_step_slot_weights(mf_step_shape *sh, int L, int slot)
{
    if (sh->slot_w) return &sh->slot_w[(size_t)slot * 3];
    return &mf_model_layer_at(sh->eng->ly->m, L)->experts[sh->slot_e[slot] * 3];
}

void mf_step_lane_models(const mf_profile *p, int threads, mf_lane_model models[4])
{
    if (!p) p = mf_cost_default_profile();
    double bps = p->host[MF_KF_FP4].bytes_per_s, share = mf_cost_thread_share(p, threads);
    if (share > 0 && share < bps) bps = share;
    models[0] = (mf_lane_model){.bytes_per_s = bps, .latency_ns = p->host[MF_KF_FP4].latency_ns};
    models[1] = (mf_lane_model){.bytes_per_s = p->h2d_bytes_per_s, .latency_ns = p->h2d_latency_ns};
    models[2] = (mf_lane_model){.bytes_per_s = p->card[MF_KF_FP4].bytes_per_s,
                                .latency_ns = p->card[MF_KF_FP4].latency_ns};
    models[3] = (mf_lane_model){.bytes_per_s = p->d2h_bytes_per_s, .latency_ns = p->d2h_latency_ns};
}

static void mf_step_dev_release(mf_step_shape *sh, int failed);

/* With device graphs: the slot tables of micro-batch h's slots of layer L: a card's own slots, the
 * rest unused. */
static void mf_step_dev_tables(mf_step_shape *sh, int L, int h)
{
    mf_step *eng = sh->eng;
    int s0 = sh->sg->half_slot[h], s1 = sh->sg->half_slot[h + 1];
    if (eng->dev_graphs)
        for (int c = 0; c < eng->n_cards; c++) {
            mf_dev_ffn_slot *tab = sh->htab[c] + (size_t)L * sh->n_slots;
            for (int s = s0; s < s1; s++)
                tab[s] = mf_step_slot_live(sh, s) && sh->slot_card[s] == c
                             ? (mf_dev_ffn_slot){(uint64_t)(uintptr_t)sh->slot_dev[s], sh->slot_off[s], sh->slot_cnt[s]}
                             : (mf_dev_ffn_slot){0, 0, 0};
        }
}

/* The engine's placer for a layer's routed experts (mf_sg_placer): its lanes' models, profile and
 * workers, the packed expert's card bytes and multiply-adds, a slot's token bytes, and a miss's
 * copies as the engine makes them (one span when the model's layout allows). */
static void mf_step_placer_init(const mf_step *eng, mf_sg_placer *pl)
{
    mf_work ew;
    mf_sg_expert_work(eng->c, eng->sz, &ew);
    mf_sg_placer_init(pl, eng->models, eng->o.profile, eng->o.n_threads, eng->o.placement == MF_STEP_PLACE_HYBRID,
                      (double)eng->xslot_bytes, ew.macs[MF_KF_FP4], mf_sg_slot_tok_bytes(eng->c, 0),
                      mf_sg_slot_tok_bytes(eng->c, 1), eng->miss_span ? 1 : 0);
}

/* Decides where micro-batch h's slots of layer L run (sh->slot_card) and takes their cache slots
 * on the cards (pinned until its MoE's end): SEED the owner card; HYBRID by mf_sg_placer (the
 * cached slots offered first, each moved to its card while the card ends no later than the host's
 * queue of expert work over the workers). */
static int mf_step_place(mf_step_shape *sh, int L, int h)
{
    mf_step *eng = sh->eng;
    mf_sg_placer pl;
    int s0 = sh->sg->half_slot[h], s1 = sh->sg->half_slot[h + 1];
    mf_step_placer_init(eng, &pl);
    mf_sg_place_shared(&pl, sh->sg, L, h);
    sh->dev_layer = L;
    sh->dev_half = h;
    int s_end = s0 + sh->n_used[h];
    for (int s = s0; s < s1; s++) sh->slot_card[s] = -1;
    for (int s = s0; s < s_end; s++) {   /* all on the host's queue; slot_miss: not cached (the pass) */
        int e = sh->slot_e[s];
        sh->slot_miss[s] = (uint8_t)!mf_dev_xcache_has(eng->xc[mf_dev_xcache_owner(eng->n_cards, L, e)], L, e);
        mf_sg_place_host_work(&pl, sh->slot_cnt[s]);
    }
    for (int pass = 0; pass < 2; pass++)   /* the cached slots first, then the rest */
        for (int s = s0; s < s_end; s++) {
            if (sh->slot_miss[s] != pass) continue;
            int e = sh->slot_e[s], c = mf_dev_xcache_owner(eng->n_cards, L, e);
            if (!mf_sg_place_want_card(&pl, c, sh->slot_cnt[s], !pass)) {
                eng->dstat.host_slots++;
                continue;
            }
            void *slot = NULL;
            int hit = 0, rc = mf_dev_xcache_acquire(eng->xc[c], L, e, &slot, &hit);
            if (rc == -ENOSPC) {   /* every cache slot of the card pinned: the host keeps it */
                eng->dstat.host_slots++;
                eng->dstat.host_fallbacks++;
                continue;
            }
            if (rc) return rc;
            mf_sg_place_card(&pl);
            sh->slot_card[s] = c;
            sh->slot_dev[s] = slot;
            sh->slot_miss[s] = (uint8_t)!hit;
            eng->dstat.dev_slots++;
        }
    mf_step_dev_tables(sh, L, h);
    return 0;
}

/* Prefetch: layer L's experts placed by the expected tokens of the chunk (mf_sg_place_all, as the
 * simulator's pl_prefetch), their cache slots taken and pinned until the layer's MoE done, the
 * copy tasks of hits and host experts marked noop. */
typedef struct mf_step_take {
    mf_step_shape *sh;
    int L, rc;
} mf_step_take;

static int mf_step_take_slot(void *ctx, int c, int e, int *hit)
{
    mf_step_take *k = ctx;
    mf_step *eng = k->sh->eng;
    void *slot = NULL;
    if (k->rc) return 0;
    int rc = mf_dev_xcache_acquire_ahead(eng->xc[c], k->L, e, &slot, hit);   /* victims by their layer's next use */
    if (rc == -ENOSPC) {   /* every cache slot of the card pinned: the host keeps it */
        eng->dstat.host_fallbacks++;
        return 0;
    }
    if (rc) {
        k->rc = rc;
        return 0;
    }
    k->sh->pre_dev[e] = slot;
    return 1;
}

static int mf_task_moe_place(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    mf_step *eng = sh->eng;
    int L = a->t->layer, E = eng->c->n_routed_experts, tok = (sh->sg->n * eng->c->n_experts_per_tok + E - 1) / E;
    if (sh->dev_layer >= 0) return mf_error(-EINVAL, "step: layer %d placed while layer %d's experts are pinned "
                                            "(internal)", L, sh->dev_layer);
    for (int e = 0; e < E; e++)
        sh->pre_cached[e] = (uint8_t)mf_dev_xcache_has(eng->xc[mf_dev_xcache_owner(eng->n_cards, L, e)], L, e);
    mf_sg_placer pl;
    mf_step_placer_init(eng, &pl);
    mf_sg_place_ahead(&pl, sh->sg->pre_ahead_ns[L]);
    mf_sg_place_shared(&pl, sh->sg, L, 0);
    mf_step_take k = {sh, L, 0};
    int on = mf_sg_place_all(&pl, eng->c, L, eng->n_cards, tok, sh->pre_cached, mf_step_take_slot, &k, sh->pre_card,
                             sh->pre_miss);
    sh->dev_layer = L;
    sh->dev_half = 0;
    if (k.rc) {
        mf_step_dev_release(sh, 1);
        return mf_error_wrap(k.rc, "step: layer %d: the experts' cache slots on the cards", L);
    }
    eng->dstat.dev_slots += on;
    eng->dstat.host_slots += E - on;
    mf_stepgraph_mark_prefetch(sh->sg, L, sh->pre_card, sh->pre_miss);
    return 0;
}

/* Prefetch, card a->t->card's h2d lane: expert a->t->part's parts into its cache slot (nothing on a
 * hit or when the host keeps it). */
static int mf_task_dev_pre(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    mf_step *eng = sh->eng;
    int e = a->t->part;
    if (sh->pre_card[e] != a->t->card || !sh->pre_miss[e]) return MF_TASK_NO_WORK;
    const mf_weight *ew = &mf_model_layer_at(eng->ly->m, a->t->layer)->experts[e * 3];
    const void *src[6] = {ew[0].data, ew[0].scale, ew[1].data, ew[1].scale, ew[2].data, ew[2].scale};
    int rc = mf_dev_copy_expert(ctx->queue, sh->pre_dev[e], src, eng->part_off, eng->part_bytes);
    if (rc > 0) atomic_fetch_add_explicit(&eng->miss_spans, 1, memory_order_relaxed);
    return rc > 0 ? 0 : rc;
}

/* Prefetch, in the route: each used slot where its expert was placed (in its cache slot already,
 * so its copy-in copies the rows only). */
static void mf_step_place_pre(mf_step_shape *sh, int L, int h)
{
    int s0 = sh->sg->half_slot[h];
    for (int s = s0; s < sh->sg->half_slot[h + 1]; s++) {
        int used = s - s0 < sh->n_used[h], e = used ? sh->slot_e[s] : -1;
        sh->slot_card[s] = used ? sh->pre_card[e] : -1;
        sh->slot_dev[s] = used ? sh->pre_dev[e] : NULL;
        sh->slot_miss[s] = 0;
    }
    mf_step_dev_tables(sh, L, h);
}

/* Releases layer L's cache slots (after its device tasks); failed: misses are forgotten, their
 * slots may hold a partial copy. */
static void mf_step_dev_release(mf_step_shape *sh, int failed)
{
    mf_step *eng = sh->eng;
    if (sh->dev_layer < 0) return;
    if (sh->sg->prefetch) {   /* the layer's placed experts, used or not */
        for (int e = 0; e < eng->c->n_routed_experts; e++) {
            int c = sh->pre_card[e];
            if (c < 0) continue;
            if (failed && sh->pre_miss[e]) mf_dev_xcache_drop(eng->xc[c], sh->dev_layer, e);
            else mf_dev_xcache_release(eng->xc[c], sh->dev_layer, e);
            sh->pre_card[e] = -1;
        }
        for (int s = 0; s < sh->n_slots; s++) sh->slot_card[s] = -1;
        sh->dev_layer = -1;
        return;
    }
    int s0 = sh->sg->half_slot[sh->dev_half];
    for (int s = s0; s < s0 + sh->n_used[sh->dev_half]; s++) {
        int c = sh->slot_card[s];
        if (c < 0) continue;
        if (failed && sh->slot_miss[s]) mf_dev_xcache_drop(eng->xc[c], sh->dev_layer, sh->slot_e[s]);
        else mf_dev_xcache_release(eng->xc[c], sh->dev_layer, sh->slot_e[s]);
        sh->slot_card[s] = -1;
    }
    sh->dev_layer = -1;
}

/* After a failed run in layer sh->dev_layer: names the first device task that failed, with its
 * expert and card, in the error (the scheduler's message names the task), and releases the
 * layer's cache slots, dropping those copied in this step (a failed copy may have left them
 * partial). Returns rc. */
static int mf_step_dev_fail(mf_step_shape *sh, int rc)
{
    mf_task_span *sp = mf_timeline_spans(sh->tl);
    int L = sh->dev_layer;
    for (int t = 0; sp && t < mf_graph_n_tasks(sh->g); t++) {
        int k = sh->sg->task[t].kind;
        if (sp[t].status >= 0 || (k != MF_SG_K_COPY && k != MF_SG_K_DEV && k != MF_SG_K_COPY_OUT))
            continue;
        const mf_step_targ *a = mf_graph_task(sh->g, t)->arg;
        if (a->t->op == MF_SG_DEV_PRE) {   /* a prefetch copy */
            rc = mf_error_wrap(rc, "layer %d, routed expert %d copied onto card %d ahead of its route (the "
                               "layer's cache slots copied in this step are dropped)", a->t->layer, a->t->part, a->t->card);
            break;
        }
        if (a->t->dense >= 0) {   /* a dense sublayer's copy or work */
            rc = mf_error_wrap(rc, "layer %d, dense work on card %d", a->t->layer, a->t->card);
            break;
        }
        if (a->t->layer != L || a->t->half != sh->dev_half || (a->t->slot >= 0 && !mf_step_slot_live(sh, a->t->slot)))
            continue;
        if (a->t->slot < 0) {   /* a card's graph of the layer's FFNs */
            rc = mf_error_wrap(rc, "layer %d, the routed experts on card %d (their cache slots copied in "
                               "this step are dropped)", L, a->t->card);
            break;
        }
        int s = a->t->slot;
        rc = mf_error_wrap(rc, "layer %d, routed expert %d on card %d (%s)", L, sh->slot_e[s], a->t->card,
                           sh->slot_miss[s] ? "copied in this step: its cache slot is dropped"
                                            : "a cache hit");
        break;
    }
    mf_step_dev_release(sh, 1);
    return rc;
}

/* Device lanes of a slot on card a->t->card (empty unless the route task put the slot there):
 * copy-in of the packed expert on a miss and of the slot's rows (inputs, token weights); the
 * expert FFN on the int8 path (the same kernels as the host's); copy-out of the outputs. */
static int mf_task_dev_in(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    int s = a->t->slot;
    if (!mf_step_slot_live(sh, s) || sh->slot_card[s] != a->t->card) return MF_TASK_NO_WORK;
    mf_step *eng = sh->eng;
    mf_dev_stream *st = ctx->queue;
    int64_t H = eng->c->hidden_size;
    int rc = 0;
    if (sh->slot_miss[s]) {
        const mf_weight *ew = mf_step_slot_weights(sh, a->t->layer, s);
        const void *src[6] = {ew[0].data, ew[0].scale, ew[1].data, ew[1].scale, ew[2].data, ew[2].scale};
        rc = mf_dev_copy_expert(st, sh->slot_dev[s], src, eng->part_off, eng->part_bytes);
        if (rc > 0) atomic_fetch_add_explicit(&eng->miss_spans, 1, memory_order_relaxed);
        rc = rc > 0 ? 0 : rc;
    }
    size_t off = (size_t)sh->slot_off[s], cnt = (size_t)sh->slot_cnt[s];
    uint8_t *db = sh->dbuf[a->t->card];
    /* the rows as bf16 (mf_sg_slot_tok_bytes), unpacked on this copy stream; the token weights fp32 */
    uint16_t *d16 = (uint16_t *)(void *)(db + sh->d_x16) + off * H;
    if (!rc) rc = mf_dev_copy_h2d(st, d16, sh->xg16 + off * H, cnt * H * sizeof *d16);
    if (!rc) rc = mf_dev_bf16_unpack(st, d16, H, (float *)(void *)(db + sh->d_x) + off * H, H, (int)cnt, (int)H);
    if (!rc) rc = mf_dev_copy_h2d(st, db + sh->d_w + off * 4, sh->wg + off, cnt * 4);
    return rc;
}

static int mf_task_dev_ffn(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    int s = a->t->slot;
    if (!mf_step_slot_live(sh, s) || sh->slot_card[s] != a->t->card) return MF_TASK_NO_WORK;
    mf_step *eng = sh->eng;
    int64_t H = eng->c->hidden_size, I = eng->c->moe_intermediate_size;
    const mf_weight *ew = mf_step_slot_weights(sh, a->t->layer, s);
    size_t off = (size_t)sh->slot_off[s];
    uint8_t *db = sh->dbuf[a->t->card], *x = sh->slot_dev[s];
    mf_dev_ffn f = {.w1 = mf_step_mat(&ew[0]), .w3 = mf_step_mat(&ew[2]), .w2 = mf_step_mat(&ew[1]),
                    .x = (const float *)(db + sh->d_x) + off * H, .n_tok = sh->slot_cnt[s],
                    .tok_weight = (const float *)(db + sh->d_w) + off, .limit = (float)eng->c->swiglu_limit,
                    .h = (float *)(db + sh->d_h) + off * I, .q8_scratch = db + sh->d_q + off * sh->dq_bytes,
                    .y = (float *)(db + sh->d_y) + off * H};
    f.w1.w = x + eng->part_off[0];
    f.w1.scale = x + eng->part_off[1];
    f.w2.w = x + eng->part_off[2];
    f.w2.scale = x + eng->part_off[3];
    f.w3.w = x + eng->part_off[4];
    f.w3.scale = x + eng->part_off[5];
    return mf_dev_expert_ffn(ctx->queue, &f);
}

/* Graph mode: the FFNs of every slot of layer a->t->layer on card a->t->card, as the layer's graph
 * (captured on its first run: the h2d copy of the layer's slot table, then the slot-table FFN
 * over the shape's buffers), which reads the experts and rows the route task wrote into the
 * table. Nothing when no slot is on the card. */
static int mf_task_dev_ffn_card(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    mf_step *eng = sh->eng;
    int c = a->t->card, L = a->t->layer, h = a->t->half, any = 0;
    int s0 = sh->sg->half_slot[h], ns = sh->sg->half_slot[h + 1] - s0;   /* the micro-batch's slots */
    for (int s = s0; s < s0 + sh->n_used[h] && !any; s++) any = sh->slot_card[s] == c;
    if (!any) return MF_TASK_NO_WORK;
    mf_dev_stream *st = ctx->queue;
    mf_dev_graph **g = &sh->dgraph[c][L * sh->sg->n_halves + h];
    if (!*g) {
        uint8_t *db = sh->dbuf[c];
        mf_dev_ffn_slot *dtab = (mf_dev_ffn_slot *)(db + sh->d_tab) + (size_t)L * sh->n_slots + s0;
        mf_dev_ffn_table t = {.n_in = (int)eng->c->hidden_size, .n_hidden = (int)eng->c->moe_intermediate_size,
                              .table = dtab, .n_slots = ns, .max_tok = sh->n,
                              .x = (const float *)(db + sh->d_x), .tok_weight = (const float *)(db + sh->d_w),
                              .limit = (float)eng->c->swiglu_limit, .h = (float *)(db + sh->d_h),
                              .q8_scratch = db + sh->d_q, .q8_row = sh->dq_bytes,
                              .y = (float *)(db + sh->d_y)};
        for (int k = 0; k < 6; k++) t.part_off[k] = eng->part_off[k];
        int rc = mf_dev_capture_begin(st);
        if (rc) return rc;
        rc = mf_dev_copy_h2d(st, dtab, sh->htab[c] + (size_t)L * sh->n_slots + s0, sizeof *dtab * (size_t)ns);
        if (!rc) rc = mf_dev_expert_ffn_table(st, &t);
        mf_dev_graph *ng = NULL;
        int rc2 = mf_dev_capture_end(st, &ng);
        if (!rc) rc = rc2;
        if (rc) {
            mf_dev_graph_destroy(ng);
            return mf_error_wrap(rc, "step: capturing layer %d's device graph on card %d", L, c);
        }
        *g = ng;
    }
    return mf_dev_graph_launch(*g, st);
}

static int mf_task_dev_out(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    int s = a->t->slot;
    if (!mf_step_slot_live(sh, s) || sh->slot_card[s] != a->t->card) return MF_TASK_NO_WORK;
    int64_t H = sh->eng->c->hidden_size;
    size_t off = (size_t)sh->slot_off[s], cnt = (size_t)sh->slot_cnt[s];
    uint8_t *db = sh->dbuf[a->t->card];
    /* the rows as bf16 (mf_sg_slot_tok_bytes), packed on this copy stream; the combine unpacks them */
    uint16_t *d16 = (uint16_t *)(void *)(db + sh->d_y16) + off * H;
    int rc = mf_dev_bf16_pack(ctx->queue, (const float *)(void *)(db + sh->d_y) + off * H, H, d16, H, (int)cnt, (int)H);
    return rc ? rc : mf_dev_copy_d2h(ctx->queue, sh->y16 + off * H, d16, cnt * H * sizeof *d16);
}

/* Router: the top-k of the gate logits, then the slot table: the distinct experts in
 * ascending id, each with its items in item order; inputs gathered into slot order (and
 * quantized for the int8 path). */
static int mf_step_gather_rows(mf_step_shape *sh, int h, int i0, int i1, int p, int P);

static int mf_task_route(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    mf_step *eng = sh->eng;
    const mf_config *c = eng->c;
    int K = c->n_experts_per_tok, E = c->n_routed_experts;
    /* the micro-batch's items [i0, i1) and slots [s0, s1) (its rows in slot order from i0 * K):
     * the other micro-batch's route runs before this one's MoE starts or after it ends, so the
     * expert counts and fills are this route's alone */
    int h = a->t->half, i0 = a->t->i0, i1 = a->t->i1, s0 = sh->sg->half_slot[h], s1 = sh->sg->half_slot[h + 1];
    if (a->t->part >= 0) {   /* a part: its items' top-k (the route after the parts leaves it out) */
        mf_step_topk(sh, cx, a->t->layer, i0, i1);
        return 0;
    }
    if (!sh->sg->route_topk) mf_step_topk(sh, cx, a->t->layer, i0, i1);
    memset(sh->cnt, 0, sizeof *sh->cnt * (size_t)E);
    for (int j = i0 * K; j < i1 * K; j++) sh->cnt[sh->ex[j]]++;
    int ns = s0, off = i0 * K;
    for (int e = 0; e < E; e++) {
        sh->slot_of[e] = -1;
        if (!sh->cnt[e]) continue;
        if (ns == s1) return mf_error(-EINVAL, "step: more experts than slots (internal)");
        sh->slot_of[e] = ns;
        sh->slot_e[ns] = e;
        sh->slot_off[ns] = off;
        sh->slot_cnt[ns] = sh->cnt[e];
        sh->fill[e] = off;
        off += sh->cnt[e];
        ns++;
    }
    sh->n_used[h] = ns - s0;
    for (int i = i0; i < i1; i++)
        for (int k = 0; k < K; k++) {
            int e = sh->ex[i * K + k], row = sh->fill[e]++;
            sh->asg[i * K + k] = row;
            sh->wg[row] = sh->wt[i * K + k];
        }
    if (eng->store) {
        int rc = mf_step_store_begin(sh, a->t->layer, h);
        if (rc) return rc;
    }
    if (eng->n_cards && sh->sg->prefetch) mf_step_place_pre(sh, a->t->layer, h);   /* placed at the layer's start */
    else if (eng->n_cards) {   /* routed experts on cards */
        int rc = mf_step_place(sh, a->t->layer, h);
        if (rc) return rc;
    }
    /* the slot tasks with nothing to do this step (unused slots; a slot's host tasks when it runs
     * on a card, its tasks on the other cards): the executor completes them where they become
     * ready, without waking a lane's thread or a round trip through a card's stream */
    mf_stepgraph_mark_noop_half(sh->sg, a->t->layer, h, sh->n_used[h], sh->slot_card ? sh->slot_card + s0 : NULL);
        return sh->sg->p_gather > 1 ? 0 : mf_step_gather_rows(sh, h, i0, i1, 0, 1);
}

/* Part p of P of micro-batch h's row gather: the used slots [s0 + n p / P, s0 + n (p + 1) / P)
 * of its n, their rows (in slot order, as the route assigned them: asg) copied from the inputs
 * of items [i0, i1), the host slots' rows quantized (the cards quantize their own). Any split
 * gives the same bytes. */
static int mf_step_gather_rows(mf_step_shape *sh, int h, int i0, int i1, int p, int P)
{
    mf_step *eng = sh->eng;
    int K = eng->c->n_experts_per_tok, n = sh->n_used[h], s0 = sh->sg->half_slot[h];
    int64_t H = eng->c->hidden_size;
    int a = s0 + (int)((int64_t)n * p / P), b = s0 + (int)((int64_t)n * (p + 1) / P);
    if (a >= b) return 0;
    int r0 = sh->slot_off[a], r1 = sh->slot_off[b - 1] + sh->slot_cnt[b - 1];
    if (sh->row_card)   /* which rows go to cards: those copy in as bf16 (mf_sg_slot_tok_bytes) */
        for (int s = a; s < b; s++) memset(sh->row_card + sh->slot_off[s], sh->slot_card[s] >= 0, (size_t)sh->slot_cnt[s]);
    for (int i = i0; i < i1; i++)
        for (int k = 0; k < K; k++) {
            int row = sh->asg[i * K + k];
            if (row < r0 || row >= r1) continue;
            if (!sh->row_card || !sh->row_card[row])
                memcpy(sh->xg + (size_t)row * H, sh->xin + (size_t)i * H, sizeof(float) * (size_t)H);
            else if (sh->xin16)   /* the ffn_norm's mirror (dense cards): the same codes */
                memcpy(sh->xg16 + (size_t)row * H, sh->xin16 + (size_t)i * H, sizeof(uint16_t) * (size_t)H);
            else
                mf_kern_vec_bf16_pack(sh->xin + (size_t)i * H, sh->xg16 + (size_t)row * H, H);
        }
    if (!eng->o.exact)
        for (int s = a; s < b; s++) {
            if (sh->slot_card && sh->slot_card[s] >= 0) continue;   /* the card quantizes its own */
            size_t r0 = (size_t)sh->slot_off[s], cnt = (size_t)sh->slot_cnt[s];
            int rc = mf_kern_q8_init(&sh->q8x[s], sh->q8x_mem + r0 * sh->q8x_bytes, cnt * sh->q8x_bytes, (int)cnt, (int)H);
            if (!rc) rc = mf_kern_q8_quantize(&sh->q8x[s], sh->xg + (size_t)sh->slot_off[s] * H, (int)H, 0,
                                              sh->slot_cnt[s]);
            if (rc) return rc;
        }
    return 0;
}

static int mf_task_route_rows(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    return mf_step_gather_rows(a->sh, a->t->half, a->t->i0, a->t->i1, a->t->part, a->sh->sg->p_gather);
}

/* End of a layer's MoE: the store's batch is closed (read experts marked present) and the
 * layer's experts unpinned, now that no task uses them. */
static int mf_task_moe_done(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    mf_store *st = sh->eng->store;
    int h = a->t->half, s0 = sh->sg->half_slot[h];
    if (sh->dev_layer == a->t->layer && sh->dev_half == h) mf_step_dev_release(sh, 0);
    if (!st || sh->store_layer != a->t->layer || sh->store_half != h) return 0;
    int rc = mf_store_end(st, 0);
    mf_store_unpin(st, a->t->layer, sh->slot_e + s0, sh->n_used[h]);
    sh->store_layer = -1;
    return rc;
}

/* Phase 1 of one FFN over rows [r0, r1) of its hidden size, for n_tok tokens of x (ld H).
 * exact: w1 and w3 on the fp32 path, then the reference's roundings (layer_moe.c); else fused. */
static int mf_step_ffn_up(mf_step *eng, const mf_weight *w1, const mf_weight *w3, const float *x,
                          const mf_kern_q8 *q8, int n_tok, const float *tok_w, float *h, float *g,
                          float *u, int r0, int r1)
{
    const mf_config *c = eng->c;
    int H = (int)c->hidden_size, I = (int)w1->rows;
    mf_kern_mat m1 = mf_step_mat(w1), m3 = mf_step_mat(w3);
    float lim = (float)c->swiglu_limit;
    if (!eng->o.exact && lim > 0)
        return mf_kern_ffn_up(&m1, &m3, &(mf_kern_in){x, n_tok, H, q8}, tok_w, lim, h, I, r0, r1);
    mf_kern_in in = {x, n_tok, H, eng->o.exact ? NULL : q8};
    int rc = mf_kern_matmul(&m1, &in, g, I, r0, r1);
    if (!rc) rc = mf_kern_matmul(&m3, &in, u, I, r0, r1);
    if (rc) return rc;
    for (int t = 0; t < n_tok; t++)
        for (int i = r0; i < r1; i++) {
            size_t k = (size_t)t * I + i;
            float gi = mf_bf(g[k]), ui = mf_bf(u[k]);
            if (lim > 0) {
                ui = fminf(fmaxf(ui, -lim), lim);
                gi = fminf(gi, lim);
            }
            h[k] = mf_bf((tok_w ? tok_w[t] : 1.0f) * (mf_ly_silu(gi) * ui));
        }
    return 0;
}

/* Phase 2: y rows [r0, r1) = w2 h, rounded to bf16 as the reference's expert outputs. */
static int mf_step_ffn_down(mf_step *eng, const mf_weight *w2, const float *h, const mf_kern_q8 *q8,
                            int n_tok, float *y, int r0, int r1)
{
    int H = (int)eng->c->hidden_size, I = (int)w2->cols;
    mf_kern_mat m2 = mf_step_mat(w2);
    int rc = mf_kern_ffn_down(&m2, &(mf_kern_in){h, n_tok, I, eng->o.exact ? NULL : q8}, y, H, r0, r1);
    if (rc) return rc;
    for (int t = 0; t < n_tok; t++)
        for (int o = r0; o < r1; o++) y[(size_t)t * H + o] = mf_bf(y[(size_t)t * H + o]);
    return 0;
}

static int mf_task_slot_up(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    if (!mf_step_slot_live(sh, a->t->slot) || (sh->slot_card && sh->slot_card[a->t->slot] >= 0)) return 0;
    mf_step *eng = sh->eng;
    const mf_config *c = eng->c;
    int64_t H = c->hidden_size, I = c->moe_intermediate_size;
    const mf_weight *ew = mf_step_slot_weights(sh, a->t->layer, a->t->slot);
    int r0 = (int)a->t->r0, r1 = (int)a->t->r1;   /* the record's rows (mf_sg_rows) */
    if (r0 >= r1) return 0;
    mf_step_count_socket(eng, ctx, &ew[0], r0, r1, 0);
    mf_step_count_socket(eng, ctx, &ew[2], r0, r1, 0);
    size_t off = (size_t)sh->slot_off[a->t->slot];
    return mf_step_ffn_up(eng, &ew[0], &ew[2], sh->xg + off * H, &sh->q8x[a->t->slot], sh->slot_cnt[a->t->slot],
                          sh->wg + off, sh->h + off * I, sh->gg ? sh->gg + off * I : NULL,
                          sh->uu ? sh->uu + off * I : NULL, r0, r1);
}

static int mf_task_slot_join(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    if (!mf_step_slot_live(sh, a->t->slot) || sh->eng->o.exact || (sh->slot_card && sh->slot_card[a->t->slot] >= 0))
        return 0;
    int I = (int)sh->eng->c->moe_intermediate_size, s = a->t->slot;
    size_t r0 = (size_t)sh->slot_off[s], cnt = (size_t)sh->slot_cnt[s];
    int rc = mf_kern_q8_init(&sh->q8h[s], sh->q8h_mem + r0 * sh->q8h_bytes, cnt * sh->q8h_bytes, (int)cnt, I);
    if (!rc) rc = mf_kern_q8_quantize(&sh->q8h[s], sh->h + (size_t)sh->slot_off[s] * I, I, 0, sh->slot_cnt[s]);
    return rc;
}

static int mf_task_slot_down(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    if (!mf_step_slot_live(sh, a->t->slot) || (sh->slot_card && sh->slot_card[a->t->slot] >= 0)) return 0;
    mf_step *eng = sh->eng;
    int64_t H = eng->c->hidden_size, I = eng->c->moe_intermediate_size;
    const mf_weight *ew = mf_step_slot_weights(sh, a->t->layer, a->t->slot);
    int r0 = (int)a->t->r0, r1 = (int)a->t->r1;   /* the record's rows (mf_sg_rows) */
    if (r0 >= r1) return 0;
    mf_step_count_socket(eng, ctx, &ew[1], r0, r1, 0);
    size_t off = (size_t)sh->slot_off[a->t->slot];
    return mf_step_ffn_down(eng, &ew[1], sh->h + off * I, &sh->q8h[a->t->slot], sh->slot_cnt[a->t->slot],
                            sh->y + off * H, r0, r1);
}

static int mf_task_sh_up(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    mf_step *eng = sh->eng;
    const mf_model_layer *y = mf_model_layer_at(eng->ly->m, a->t->layer);
    int r0 = (int)a->t->r0, r1 = (int)a->t->r1;   /* the record's rows (mf_sg_expert_rows) */
    if (r0 >= r1) return 0;
    mf_step_count_socket(eng, ctx, &y->sh_w1, r0, r1, 1);
    mf_step_count_socket(eng, ctx, &y->sh_w3, r0, r1, 1);
    size_t i0 = (size_t)a->t->i0, I = (size_t)y->sh_w1.rows;   /* the micro-batch's items */
    return mf_step_ffn_up(eng, &y->sh_w1, &y->sh_w3, sh->xin + i0 * eng->c->hidden_size, NULL, a->t->n_tok, NULL,
                          sh->hs + i0 * I, sh->gs ? sh->gs + i0 * I : NULL, sh->us ? sh->us + i0 * I : NULL, r0, r1);
}

static int mf_task_nop(void *arg, mf_task_ctx *ctx)
{
    (void)arg;
    (void)ctx;
    return 0;
}

static int mf_task_sh_down(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    mf_step *eng = sh->eng;
    const mf_model_layer *y = mf_model_layer_at(eng->ly->m, a->t->layer);
    int r0 = (int)a->t->r0, r1 = (int)a->t->r1;   /* the record's rows (mf_sg_expert_rows) */
    if (r0 >= r1) return 0;
    mf_step_count_socket(eng, ctx, &y->sh_w2, r0, r1, 1);
    size_t i0 = (size_t)a->t->i0;   /* the micro-batch's items */
    return mf_step_ffn_down(eng, &y->sh_w2, sh->hs + i0 * y->sh_w1.rows, NULL, a->t->n_tok,
                            sh->ys + i0 * eng->c->hidden_size, r0, r1);
}

/* Combine, columns [r0, r1) of one item: the routed outputs in its top-k order, then the shared
 * expert, summed in double as the reference does (a fixed order: bit-identical whatever ran
 * where), rounded to bf16 and expanded into the streams with the split of its ffn mixes; part 0
 * carries that split's pre to the next sublayer. */
static int mf_task_combine(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_ly_ctx *cx = mf_step_cx(a, ctx);
    if (!cx) return -EINVAL;
    mf_step_shape *sh = a->sh;
    mf_step *eng = sh->eng;
    const mf_config *c = eng->c;
    const mf_model_layer *y = mf_model_layer_at(cx->ly->m, a->t->layer);
    int64_t H = c->hidden_size, d0 = a->t->r0, d1 = a->t->r1;
    int K = c->n_experts_per_tok, i = a->t->i0;
    float pre[MF_LY_MAX_HC], post[MF_LY_MAX_HC], comb[MF_LY_MAX_HC * MF_LY_MAX_HC];
    mf_ly_hc_split_w(c, sh->fmix + (size_t)i * MF_STEP_N_MIX, &y->hc_ffn_scale, &y->hc_ffn_base, pre, post, comb);
    float *out = sh->moe_out + (size_t)i * H;
    mf_step_bf16_cols(0, sh->ys, sh->ys16, H, i, d0, d1);   /* the shared expert's copy out from its card */
    /* the host's outputs are rounded already (rounding twice changes nothing), the cards' read from
     * the bf16 codes they copied out (row_card); 8 columns at a time under AVX2, each column's sum in
     * the scalar order */
    mf_fa_combine_cols(sh->y, sh->y16, sh->row_card, H, sh->asg + (size_t)i * K, K,
                       c->n_shared_experts > 0 ? sh->ys + (size_t)i * H : NULL, out, d0, d1);
    (sh->eng->o.exact ? mf_ly_hc_expand_cols : mf_fa_hc_expand_cols)(cx, sh->items[i].x, out, post, comb, d0, d1);
    if (a->t->part == 0) memcpy(sh->items[i].pre, pre, sizeof pre);
    return 0;
}

static int mf_task_head(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    if (!sh->n_head) return 0;
    const mf_config *c = sh->eng->c;
    const mf_weight *w = mf_model_head(sh->eng->ly->m);
    int r0 = (int)a->t->r0, r1 = (int)a->t->r1;   /* the record's rows (mf_sg_expert_rows) */
    if (r0 >= r1) return 0;
    mf_step_count_socket(sh->eng, ctx, w, r0, r1, 1);
    return mf_kern_bf16_matmul((const uint16_t *)w->data, (int)c->vocab_size, (int)c->hidden_size,
                               sh->hn, sh->n_head, (int)c->hidden_size, sh->lbuf, (int)c->vocab_size,
                               r0, r1);
}

/* ---- dense work on cards ------------------------------------------------------------------- */

/* Rows [r0, r1) of its sublayer's n_rows output rows that dense task a owns: the builder's rule
 * (graphs/step/stepgraph.h mf_sg_dense_rows: all of them on one card, a card's chunk with
 * --dense-split rows). The rows of an attention stage are its linears' one after another. */
static void mf_step_dense_rows(const mf_step_targ *a, int64_t n_rows, int64_t *r0, int64_t *r1)
{
    const mf_stepgraph *sg = a->sh->sg;
    mf_sg_dense_rows(mf_sg_dense_parts(sg->n_dense_cards, sg->dense_split, a->t->dense), a->t->part, n_rows, r0, r1);
}

/* The rows task a computes: its own (mf_step_dense_rows), less the last one under the test fault
 * (mf_step_opts.dense_fault_skip_row: card 0's split tasks). */
static void mf_step_dense_run_rows(const mf_step_targ *a, int64_t n_rows, int64_t *r0, int64_t *r1)
{
    mf_step_dense_rows(a, n_rows, r0, r1);
    if (a->sh->eng->o.dense_fault_skip_row && a->t->part == 0 && *r1 > *r0) (*r1)--;
}

/* The copies into (out 0) or out of (out 1) the card of dense task a, into cp[]; returns their
 * count (at most MF_LY_A_MAX_LIN). Attention stages: the distinct inputs of the stage's linears,
 * and the rows the task owns of their outputs (on one card oa's outputs and ob's inputs stay on
 * the card; split by rows every card's wo_a rows go out and all of them come back for wo_b). */
static int mf_step_dense_copies(const mf_step_targ *a, int out, mf_step_dcopy *cp)
{
    mf_step_shape *sh = a->sh;
    const mf_config *c = sh->eng->c;
    /* the micro-batch's items [i0, i0 + n) (the head: the items with logits, from 0) */
    size_t i0 = (size_t)a->t->i0, n = (size_t)(a->t->i1 - a->t->i0), H = (size_t)c->hidden_size;
    int d = a->t->dense, m = 0, split = a->t->part >= 0;
    int64_t r0, r1;
    if (d <= MF_SG_D_ATTN_OB) {
        static const int stage_of[4] = {MF_LY_A_STAGE_IN, MF_LY_A_STAGE_QB, MF_LY_A_STAGE_OA, MF_LY_A_STAGE_OB};
        if (!split && ((d == MF_SG_D_ATTN_OA && out) || (d == MF_SG_D_ATTN_OB && !out))) return 0;
        mf_ly_attn_lin lin[MF_LY_A_MAX_LIN];
        int nl = mf_ly_attn_linears(sh->eng->ly, a->t->layer, stage_of[d], lin), seen = 0;
        int64_t total = 0, base = 0;
        for (int k = 0; k < nl; k++) total += lin[k].w->rows;
        mf_step_dense_rows(a, total, &r0, &r1);
        for (int k = 0; k < nl; k++) {
            int b = out ? lin[k].y : lin[k].x;
            int64_t rows = lin[k].w->rows, lo = r0 - base > 0 ? r0 - base : 0, hi = r1 - base < rows ? r1 - base : rows;
            base += rows;
            if (out && split) {   /* this card's rows of the linear's output */
                if (lo < hi) cp[m++] = mf_step_dcopy_ab(sh, b, lo, hi, i0, n);
                continue;
            }
            if (split && lin[k].groups) {   /* grouped (wo_a): the input slices of the groups its rows touch */
                int64_t R = rows / lin[k].groups, cols = lin[k].w->cols;
                if (lo < hi) cp[m++] = mf_step_dcopy_ab(sh, b, lo / R * cols, (hi + R - 1) / R * cols, i0, n);
                continue;
            }
            if (seen & (1 << b)) continue;
            seen |= 1 << b;
            cp[m++] = mf_step_dcopy_ab(sh, b, 0, sh->ab_ld[b], i0, n);   /* whole rows: one block */
        }
        return m;
    }
    size_t nh = (size_t)sh->n_head;
    int64_t E = c->n_routed_experts, V = c->vocab_size;
    switch (d) {
    case MF_SG_D_GATE:
        mf_step_dense_rows(a, E, &r0, &r1);
        if (out && r0 < r1) cp[m++] = mf_step_dcopy_cols(sh->logits, NULL, sh->dd_logits, 0, E, r0, r1, i0, n);
        if (!out)
            cp[m++] = mf_step_dcopy_cols(sh->xin, sh->xin16, sh->dd_xin, sh->dd16_xin, (int64_t)H, 0, (int64_t)H, i0, n);
        break;
    case MF_SG_D_SHARED:
        if (out)
            cp[m++] = mf_step_dcopy_cols(sh->ys, sh->ys16, sh->dd_ys, sh->dd16_ys, (int64_t)H, 0, (int64_t)H, i0, n);
        break;
    case MF_SG_D_HEAD:
        mf_step_dense_rows(a, V, &r0, &r1);
        /* more items than the card's buffer holds: the head's passes copy them out (mf_step_dense_launch) */
        if (nh && out && r0 < r1 && nh <= (size_t)sh->head_rows)
            cp[m++] = mf_step_dcopy_cols(sh->lbuf, NULL, sh->dd_lbuf, 0, V, r0, r1, 0, nh);
        if (nh && !out) cp[m++] = mf_step_dcopy_cols(sh->hn, NULL, sh->dd_hn, 0, (int64_t)H, 0, (int64_t)H, 0, nh);
        break;
    case MF_SG_D_ENGRAM: {   /* the micro-batch's items: the host's rows of the layer's Engram slot */
        size_t s0 = mf_step_eg_row(sh, a->t->layer, 0), le = (size_t)sh->eg_emb_ld;
        mf_step_dense_rows(a, (c->hc_mult + 1) * H, &r0, &r1);
        if (out && r0 < r1)
            cp[m++] = mf_step_dcopy_cols(sh->eg_kv + s0 * sh->eg_kv_ld, NULL, sh->dd_eg_kv, 0, sh->eg_kv_ld, r0, r1, i0, n);
        if (!out) cp[m++] = mf_step_dcopy_cols(sh->eg_emb + s0 * le, NULL, sh->dd_eg_emb, 0, (int64_t)le, 0, (int64_t)le, i0, n);
        break;
    }
    }
    return m;
}

static int mf_task_dense_in(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    if (a->t->dense == MF_SG_D_HEADS) return mf_step_heads_copy(a, ctx->queue, 0);
    if (a->t->dense == MF_SG_D_SCORES) return mf_step_scores_copy(a, ctx->queue, 0);
    mf_step_dcopy cp[MF_LY_A_MAX_LIN];
    int m = mf_step_dense_copies(a, 0, cp), rc = 0;
    if (!m) return MF_TASK_NO_WORK;
    for (int k = 0; k < m && !rc; k++) rc = mf_step_dcopy_run(ctx->queue, a->sh->ddense[a->t->card], &cp[k], 0);
    return rc;
}

static int mf_task_dense_out(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    if (a->t->dense == MF_SG_D_HEADS) return mf_step_heads_copy(a, ctx->queue, 1);
    if (a->t->dense == MF_SG_D_SCORES) return mf_step_scores_copy(a, ctx->queue, 1);
    mf_step_dcopy cp[MF_LY_A_MAX_LIN];
    int m = mf_step_dense_copies(a, 1, cp), rc = 0;
    if (!m) return MF_TASK_NO_WORK;
    for (int k = 0; k < m && !rc; k++) rc = mf_step_dcopy_run(ctx->queue, a->sh->ddense[a->t->card], &cp[k], 1);
    return rc;
}

/* Dense card k's copy of weight w of layer L (-1: the head), NULL when it holds none. */
static const mf_step_dmat *mf_step_dense_view(const mf_step *eng, int k, int L, const mf_weight *w)
{
    const mf_step_dmat *row = eng->dmat[k] + (size_t)(L < 0 ? eng->c->n_layers : L) * MF_STEP_DW_MAX;
    for (int i = 0; i < MF_STEP_DW_MAX; i++)
        if (row[i].w == w) return &row[i];
    return NULL;
}

/* Rows [r0, r1) of weight w of layer L as a device matrix of card k (its copy must hold them,
 * FP8 from a row of a 32-row tile of the copy). */
static int mf_step_dense_mat(const mf_step *eng, int k, int L, const mf_weight *w, int64_t r0, int64_t r1,
                             mf_kern_mat *out)
{
    const mf_step_dmat *v = mf_step_dense_view(eng, k, L, w);
    const char *name = w->name ? w->name : "a dense weight";
    if (!v || r0 < v->r0 || r1 > v->r1 || (w->kind == MF_W_FP8 && (r0 - v->r0) % 32))
        return mf_error(-EINVAL, "step: rows [%lld, %lld) of %s: dense card %d holds %s", (long long)r0, (long long)r1,
                        name, k, v ? "other rows (FP8 slices start at a 32-row tile)" : "no copy of it");
    *out = v->m;
    int64_t d = r0 - v->r0;
    out->n_out = (int)(r1 - r0);
    if (w->kind == MF_W_FP8) {
        out->w = (const uint8_t *)v->m.w + d * w->cols;
        out->scale = v->m.scale + d / 32 * ((w->cols + 31) / 32);
    } else {
        out->w = (const uint16_t *)v->m.w + d * w->cols;
    }
    return 0;
}

/* Rows [r0, r1) of y = w x on stream st (the rows task a owns of w: mf_step_dense_rows): x rows
 * ld_x apart, y (its row r0 at y + r0) ld_y apart; grouped (wo_a) with reference sums, else the
 * kernels' sums; bf: y rounded to bf16. */
static int mf_step_dense_lin(const mf_step_targ *a, mf_dev_stream *st, const mf_weight *w, int64_t r0, int64_t r1,
                             int groups, int ref, int bf, const float *x, int64_t ld_x, int n_tok, float *y,
                             int64_t ld_y)
{
    if (r0 >= r1) return 0;
    mf_dev_lin l = {.row0 = r0, .group_rows = groups ? (int)(w->rows / groups) : 0,
                    .sums = ref ? MF_DEV_SUMS_REF : MF_DEV_SUMS_KERN, .x = x, .ld_x = ld_x, .n_tok = n_tok,
                    .y = y + r0, .ld_y = ld_y};
    int rc = mf_step_dense_mat(a->sh->eng, a->t->card, a->t->layer, w, r0, r1, &l.w);
    if (!rc) rc = mf_dev_linear(st, &l);
    if (!rc && bf) rc = mf_dev_round_bf16(st, y + r0, n_tok, ld_y, (int)(r1 - r0));
    return rc ? mf_error_wrap(rc, "%s", w->name ? w->name : "a dense linear") : 0;
}

/* The shared expert on stream st: phase 1 over rows of its hidden size (fused as mf_kern_ffn_up,
 * or with exact the two linears and the reference's gating), phase 2 over rows of the model size,
 * rounded to bf16: the launches of what mf_step_ffn_up and mf_step_ffn_down compute. */
static int mf_step_dense_shared(const mf_step_targ *a, mf_dev_stream *st, const mf_model_layer *y)
{
    mf_step_shape *sh = a->sh;
    mf_step *eng = sh->eng;
    int n = a->t->i1 - a->t->i0, k = a->t->card, L = a->t->layer;
    int64_t H = eng->c->hidden_size, I = y->sh_w1.rows, r0, r1, i0 = a->t->i0;   /* the micro-batch's items */
    float lim = (float)eng->c->swiglu_limit;
    uint8_t *db = sh->ddense[k];
    float *x = (float *)(db + sh->dd_xin) + i0 * H, *h = (float *)(db + sh->dd_hs) + i0 * I;
    int rc = 0;
    mf_step_dense_rows(a, I, &r0, &r1);
    if (r0 < r1 && !eng->o.exact && lim > 0) {
        mf_dev_up u = {.x = x, .ld_x = H, .n_tok = n, .limit = lim, .h = h + r0, .ld_h = I};
        rc = mf_step_dense_mat(eng, k, L, &y->sh_w1, r0, r1, &u.w1);
        if (!rc) rc = mf_step_dense_mat(eng, k, L, &y->sh_w3, r0, r1, &u.w3);
        if (!rc) rc = mf_dev_ffn_up(st, &u);
        if (rc) return mf_error_wrap(rc, "the shared expert's w1 and w3");
    } else if (r0 < r1) {
        if (!eng->o.exact)
            return mf_error(-ENOTSUP, "step: the shared expert on a card without a swiglu limit needs exact");
        float *g = (float *)(db + sh->dd_gs) + i0 * I, *u = (float *)(db + sh->dd_us) + i0 * I;
        rc = mf_step_dense_lin(a, st, &y->sh_w1, r0, r1, 0, 0, 0, x, H, n, g, I);
        if (!rc) rc = mf_step_dense_lin(a, st, &y->sh_w3, r0, r1, 0, 0, 0, x, H, n, u, I);
        if (!rc) rc = mf_dev_swiglu_bf16(st, g + r0, u + r0, n, I, (int)(r1 - r0), lim, h + r0);
        if (rc) return rc;
    }
    mf_step_dense_rows(a, H, &r0, &r1);
    return mf_step_dense_lin(a, st, &y->sh_w2, r0, r1, 0, 0, 1, h, I, n, (float *)(db + sh->dd_ys) + i0 * H, H);
}

/* The dense work of task a as launches on its card's compute stream st, on the card's copies of
 * the activations and its resident weights: per linear of the sublayer the rows the task owns
 * (mf_step_dense_run_rows: an attention stage's linears one after another) over the task's items
 * (its micro-batch's), with the sums and roundings the host placement's code uses (the grouped
 * wo_a where it is not on the kernels, and with exact the router gate: reference sums; wo_a, wo_b
 * and the shared expert's output: bf16), so
 * emulated cards give the host placement's bits. */
static int mf_step_dense_launch(const mf_step_targ *a, mf_dev_stream *st)
{
    mf_step_shape *sh = a->sh;
    mf_step *eng = sh->eng;
    const mf_config *c = eng->c;
    int k = a->t->card, L = a->t->layer, n = a->t->i1 - a->t->i0, d = a->t->dense;
    int64_t i0 = a->t->i0;   /* the micro-batch's items [i0, i0 + n) (the head: all, from 0) */
    uint8_t *db = sh->ddense[k];
    int64_t H = c->hidden_size;
#define DD(off) ((float *)(db + (off)))
    if (d <= MF_SG_D_ATTN_OB) {
        static const int stage_of[4] = {MF_LY_A_STAGE_IN, MF_LY_A_STAGE_QB, MF_LY_A_STAGE_OA, MF_LY_A_STAGE_OB};
        mf_ly_attn_lin lin[MF_LY_A_MAX_LIN];
        int nl = mf_ly_attn_linears(eng->ly, L, stage_of[d], lin);
        int64_t total = 0, base = 0, r0, r1;
        for (int j = 0; j < nl; j++) total += lin[j].w->rows;
        mf_step_dense_run_rows(a, total, &r0, &r1);
        for (int j = 0; j < nl; j++) {   /* each linear's share of the task's rows */
            const mf_ly_attn_lin *l = &lin[j];
            int64_t lo = r0 - base > 0 ? r0 - base : 0, hi = r1 - base < l->w->rows ? r1 - base : l->w->rows;
            base += l->w->rows;
            /* the host's sums (mf_task_attn_rows): the grouped wo_a on the kernels as mf_fa_grouped_rows
             * where it can, else (and with exact) the reference's, so emulated cards give the host's bits */
            int ref = l->groups > 0 && (eng->o.exact || !mf_fa_grouped_kern(l));
            int rc = mf_step_dense_lin(a, st, l->w, lo, hi, l->groups, ref, l->bf,
                                       DD(sh->dd_ab[l->x]) + i0 * sh->ab_ld[l->x], sh->ab_ld[l->x], n,
                                       DD(sh->dd_ab[l->y]) + i0 * sh->ab_ld[l->y], sh->ab_ld[l->y]);
            if (rc) return rc;
        }
        return 0;
    }
    const mf_model_layer *y = L >= 0 ? mf_model_layer_at(eng->ly->m, L) : NULL;
    switch (d) {
    case MF_SG_D_GATE: {
        int64_t r0, r1;
        mf_step_dense_run_rows(a, y->gate.rows, &r0, &r1);
        /* the host's sums (mf_task_gate_rows): the kernels' where mf_fa_gate_rows takes them */
        int ref = eng->o.exact || !mf_ly_linear_kern(&y->gate);
        return mf_step_dense_lin(a, st, &y->gate, r0, r1, 0, ref, 0, DD(sh->dd_xin) + i0 * H, H, n,
                                 DD(sh->dd_logits) + i0 * y->gate.rows, y->gate.rows);
    }
    case MF_SG_D_SHARED:
        return mf_step_dense_shared(a, st, y);
    case MF_SG_D_HEAD: {
        int64_t r0, r1, V = c->vocab_size;
        mf_step_dense_run_rows(a, V, &r0, &r1);
        if (sh->n_head <= sh->head_rows)   /* the copy-out task copies them */
            return mf_step_dense_lin(a, st, mf_model_head(eng->ly->m), r0, r1, 0, 0, 0, DD(sh->dd_hn), H, sh->n_head,
                                     DD(sh->dd_lbuf), V);
        /* passes of head_rows items over the card's buffer, each copied out on this stream before
         * the next overwrites it */
        int rc = 0;
        for (int j0 = 0; j0 < sh->n_head && !rc; j0 += sh->head_rows) {
            int nj = sh->n_head - j0 < sh->head_rows ? sh->n_head - j0 : sh->head_rows;
            rc = mf_step_dense_lin(a, st, mf_model_head(eng->ly->m), r0, r1, 0, 0, 0, DD(sh->dd_hn) + (int64_t)j0 * H, H,
                                   nj, DD(sh->dd_lbuf), V);
            if (!rc && r0 < r1) {
                mf_step_dcopy cp = mf_step_dcopy_cols(sh->lbuf + (size_t)j0 * V, NULL, sh->dd_lbuf, 0, V, r0, r1, 0, (size_t)nj);
                rc = mf_step_dcopy_run(st, db, &cp, 1);
            }
        }
        return rc;
    }
    case MF_SG_D_ENGRAM: {
        int64_t r0, r1;
        mf_step_dense_run_rows(a, y->eg_wkv.rows, &r0, &r1);
        /* the host's sums (mf_task_engram_rows: mf_ly_linear_part on the kernels, exact or not) */
        int ref = !mf_ly_linear_kern(&y->eg_wkv);
        return mf_step_dense_lin(a, st, &y->eg_wkv, r0, r1, 0, ref, 0, DD(sh->dd_eg_emb) + i0 * sh->eg_emb_ld,
                                 sh->eg_emb_ld, n, DD(sh->dd_eg_kv) + i0 * sh->eg_kv_ld, sh->eg_kv_ld);
    }
    }
#undef DD
    return mf_error(-EINVAL, "step: dense sublayer %d (internal)", d);
}

/* Enqueues the dense work of a on its card's compute stream (the scheduler's completion after
 * it; an asynchronous failure of a launch fails the task through the status callback). */
static int mf_task_dense(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    if (a->t->dense == MF_SG_D_HEAD && !a->sh->n_head) return MF_TASK_NO_WORK;
    if (a->t->dense == MF_SG_D_HEADS) return a->sh->hk_host ? MF_TASK_NO_WORK : mf_step_heads_launch(a, ctx->queue);
    if (a->t->dense == MF_SG_D_SCORES) return mf_step_scores_launch(a, ctx->queue);
    return mf_step_dense_launch(a, ctx->queue);
}

/* ---- graph and buffers of one batch size ---------------------------------------------------- */

static void mf_step_shape_free(mf_step_shape *sh)
{
    if (!sh) return;
    mf_timeline_destroy(sh->tl);
    mf_stepgraph_free(sh->sg);
    free(sh->slot_w);
    free(sh->slot_rd);
    free(sh->slot_card);
    free(sh->slot_dev);
    free(sh->slot_miss);
    free(sh->pre_card);
    free(sh->pre_dev);
    free(sh->pre_miss);
    free(sh->pre_cached);
    for (int c = 0; c < sh->eng->n_cards; c++) {
        for (int L = 0; sh->dgraph[c] && L < sh->n_dgraph; L++) mf_dev_graph_destroy(sh->dgraph[c][L]);
        free(sh->dgraph[c]);
        mf_dev_host_free(sh->eng->dev, sh->htab[c]);
        mf_dev_free(sh->eng->dev, c, sh->dbuf[c]);
    }
    for (int c = 0; c < sh->eng->n_dense; c++) mf_dev_free(sh->eng->dev, sh->eng->dense_card[c], sh->ddense[c]);
    free(sh->sorted);
    free(sh->hk_map);
    free(sh->iscore);
    free(sh->args);
    free(sh->mem);
    free(sh);
}

/* The engine's task function of each op of the step graph (graphs/step/stepgraph.h). */
static const mf_task_fn mf_step_fn_of[MF_SG_N_OPS] = {
    [MF_SG_ENGRAM_EMBED] = mf_task_engram_embed, [MF_SG_ENGRAM_ROWS] = mf_task_engram_rows,
    [MF_SG_ENGRAM_GATE] = mf_task_engram_gate,   [MF_SG_ATTN_PRE] = mf_task_attn_pre,
    [MF_SG_ENGRAM_PLAN] = mf_task_engram_plan,
    [MF_SG_ATTN_ROWS] = mf_task_attn_rows,       [MF_SG_ATTN_QNORM] = mf_task_attn_qnorm,
    [MF_SG_ATTN_CORE] = mf_task_attn_core,       [MF_SG_ATTN_POST] = mf_task_attn_post,
    [MF_SG_GATE_ROWS] = mf_task_gate_rows,       [MF_SG_ROUTE] = mf_task_route,
    [MF_SG_ROUTE_ROWS] = mf_task_route_rows,
    [MF_SG_MOE_DONE] = mf_task_moe_done,         [MF_SG_SLOT_UP] = mf_task_slot_up,
    [MF_SG_SLOT_JOIN] = mf_task_slot_join,       [MF_SG_SLOT_DOWN] = mf_task_slot_down,
    [MF_SG_DEV_IN] = mf_task_dev_in,             [MF_SG_DEV_FFN] = mf_task_dev_ffn,
    [MF_SG_DEV_FFN_CARD] = mf_task_dev_ffn_card, [MF_SG_DEV_OUT] = mf_task_dev_out,
    [MF_SG_SHARED_UP] = mf_task_sh_up,           [MF_SG_SHARED_DOWN] = mf_task_sh_down,
    [MF_SG_COMBINE] = mf_task_combine,           [MF_SG_NORM] = mf_task_norm,
    [MF_SG_HEAD] = mf_task_head,                 [MF_SG_JOIN] = mf_task_nop,
    [MF_SG_ATTN_MIX] = mf_task_attn_mix,         [MF_SG_ATTN_NORM] = mf_task_attn_norm,
    [MF_SG_ATTN_HEADS] = mf_task_attn_heads,     [MF_SG_ATTN_RING] = mf_task_attn_ring,
    [MF_SG_FFN_MIX] = mf_task_ffn_mix,           [MF_SG_FFN_NORM] = mf_task_ffn_norm,
    [MF_SG_ATTN_SCORE] = mf_task_attn_score,     [MF_SG_ATTN_SELECT] = mf_task_attn_select,
    [MF_SG_DENSE_IN] = mf_task_dense_in,         [MF_SG_DENSE] = mf_task_dense,
    [MF_SG_DENSE_OUT] = mf_task_dense_out,       [MF_SG_ATTN_QSCALE] = mf_task_attn_qscale,
    [MF_SG_ATTN_KV] = mf_task_attn_kv,           [MF_SG_ATTN_GATHER] = mf_task_attn_gather,
    [MF_SG_ATTN_KEYS] = mf_task_attn_keys,
    [MF_SG_ATTN_QPREP] = mf_task_attn_qprep,     [MF_SG_ATTN_OPOST] = mf_task_attn_opost,
    [MF_SG_MOE_PLACE] = mf_task_moe_place,       [MF_SG_DEV_PRE] = mf_task_dev_pre,
};

/* A per-item op's task over its record's item group (graphs/step/stepgraph.h mf_sg_op_per_item):
 * the op's function once per item, in item order, each seeing a record of that one item. */
static int mf_task_items(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_task_fn fn = mf_step_fn_of[a->t->op];
    if (a->t->i1 - a->t->i0 <= 1) return fn(arg, ctx);
    mf_sg_task one = *a->t;
    mf_step_targ b = {a->sh, &one};
    for (int i = a->t->i0; i < a->t->i1; i++) {
        one.i0 = i;
        one.i1 = i + 1;
        one.n_tok = 1;
        int rc = fn(&b, ctx);
        if (rc) return rc;
    }
    return 0;
}

/* The step graph options of a shape of n items; fn_of: MF_SG_N_OPS entries, filled, kept by the
 * caller while the options are used. */
static mf_sg_opts mf_step_sg_opts(const mf_step *eng, int n, int par, int n_units, const int *unit_end, mf_task_fn *fn_of)
{
    for (int op = 0; op < MF_SG_N_OPS; op++)   /* the per-item ops over their item groups; the mixes
                                                 * take their whole item group (mf_step_mix_rows) */
        fn_of[op] = mf_sg_op_per_item(op) && op != MF_SG_ATTN_MIX && op != MF_SG_FFN_MIX ? mf_task_items
                                                                                          : mf_step_fn_of[op];
    const mf_ref_hooks *hk = &eng->ly->hooks;
    int ordered = hk->on_route || hk->on_select || hk->on_candidates;   /* the hooks in item order */
    return (mf_sg_opts){.c = eng->c, .sz = eng->sz, .n = n, .par = par,
                        .n_units = n_units, .unit_end = unit_end, .ordered = ordered,
                        .n_threads = eng->o.n_threads, .n_cards = eng->n_cards,
                        .n_dense_cards = eng->n_dense, .dense_split = eng->o.dense_split,
                        .dense_block = eng->o.dense_block,
                        .dev_graphs = eng->dev_graphs, .store = eng->store != NULL,
                        .miss_copies = eng->miss_span ? 1 : 0,
                        .read_window = eng->o.read_window, .eg_reads = eng->eg_reads,
                        .lanes = eng->lt.lane, .n_sockets = eng->lt.n_sockets,
                        .lane_sock = eng->lt.lane_sock,
                        .n_lanes = eng->lt.n_lanes, .lane_io = eng->lt.lane_io,
                        .lane_dev0 = eng->lt.lane_dev0,
                        .micro = eng->o.micro, .exact = eng->o.exact, .heads = eng->o.heads,
                        .prefetch_min = eng->o.prefetch_min,
                        .fn_of = fn_of,
                        .profile = eng->o.profile};
}

/* The step graph of a shape of n items (parallel, serial, or n_units units ending at unit_end[])
 * on the engine's lanes. */
static int mf_step_graph_new(mf_step *eng, int n, int par, int n_units, const int *unit_end, mf_stepgraph **out)
{
    mf_task_fn fn_of[MF_SG_N_OPS];
    mf_sg_opts o = mf_step_sg_opts(eng, n, par, n_units, unit_end, fn_of);
    return mf_stepgraph_new(&o, out);
}

/* What the card buffers of shape graph sg (laid out for ln items) take (stepgraph.h: the one layout
 * of them, which the simulator and the caches' sizing read too). */
static mf_sg_card_in mf_step_card_in(const mf_step *eng, const mf_stepgraph *sg, int ln)
{
    return (mf_sg_card_in){.c = eng->c, .sg = sg, .ln = ln, .sh_rows = (int64_t)eng->sz->sh_rows,
                           .exact = eng->o.exact, .dev_graphs = eng->dev_graphs, .head_rows = eng->o.head_rows};
}

/* Binds the shape's buffers to its graph's tasks: each task's argument is its record (its worker's
 * layer context is found when it runs); an IO task's is its slot's read. Then the timeline and the spans' scratch. */
static int mf_step_bind(mf_step *eng, mf_step_shape *sh)
{
    mf_stepgraph *sg = sh->sg;
    int n = sg->n_tasks;
    sh->args = calloc((size_t)n, sizeof *sh->args);
    sh->sorted = malloc(sizeof *sh->sorted * 2 * (size_t)n);
    if (!sh->args || !sh->sorted) return mf_error(-ENOMEM, "step: out of memory for the graph");
    for (int t = 0; t < n; t++) {
        const mf_sg_task *rec = &sg->task[t];
        sh->args[t] = (mf_step_targ){sh, rec};
        if (rec->op == MF_SG_SLOT_READ)
            mf_graph_set_arg(sh->g, t, &sh->slot_rd[(size_t)rec->slot * sh->n_parts + rec->read]);
        else if (rec->op == MF_SG_ENGRAM_READ)
            mf_graph_set_arg(sh->g, t, &sh->eg_rd[mf_step_eg_row(sh, rec->layer, rec->i0) * 2 * sh->eg_per + rec->read]);
        else
            mf_graph_set_arg(sh->g, t, &sh->args[t]);
    }
    return mf_timeline_create(sh->g, &sh->tl);
}

/* The card buffers of shape sh (experts on cards): slot tables, one device allocation per card
 * (rows in, token weights, h, quantized h, outputs, the FFN graphs' slot tables). 0 or a negative
 * code; the caller frees sh. */
static int mf_step_shape_cards(mf_step *eng, mf_step_shape *sh)
{
    const mf_config *c = eng->c;
    int n = sh->n;
    if (!eng->n_cards) return 0;
    sh->slot_card = malloc((size_t)sh->n_slots * sizeof *sh->slot_card);
    sh->slot_dev = calloc((size_t)sh->n_slots, sizeof *sh->slot_dev);
    sh->slot_miss = calloc((size_t)sh->n_slots, 1);
    if (!sh->slot_card || !sh->slot_dev || !sh->slot_miss) return mf_error(-ENOMEM, "step: out of memory");
    for (int s = 0; s < sh->n_slots; s++) sh->slot_card[s] = -1;
    if (sh->sg->prefetch) {
        size_t E = (size_t)c->n_routed_experts;
        sh->pre_card = malloc(E * sizeof *sh->pre_card);
        sh->pre_dev = calloc(E, sizeof *sh->pre_dev);
        sh->pre_miss = calloc(E, 1);
        sh->pre_cached = calloc(E, 1);
        if (!sh->pre_card || !sh->pre_dev || !sh->pre_miss || !sh->pre_cached)
            return mf_error(-ENOMEM, "step: out of memory");
        for (size_t e = 0; e < E; e++) sh->pre_card[e] = -1;
    }
    /* the routed block of the one layout (mf_sg_card_bufs); the int8 scratch by rows
     * (mf_dev_ffn_table.q8_row): a slot's area where its rows are */
    const mf_sg_card_bufs *cb = &sh->cb;
    sh->dq_bytes = cb->q8_row;
    sh->d_x = cb->x;
    sh->d_w = cb->w;
    sh->d_h = cb->h;
    sh->d_q = cb->q;
    sh->d_y = cb->y;
    sh->d_x16 = cb->x16;
    sh->d_y16 = cb->y16;
    sh->d_tab = cb->tab;
    size_t tab_bytes = cb->routed_bytes - cb->tab, total = cb->routed_bytes;
    for (int cd = 0; cd < eng->n_cards; cd++) {
        void *p = NULL;
        int rc = mf_dev_alloc(eng->dev, cd, total, &p);
        if (rc) return mf_error_wrap(rc, "step: device buffers of a batch of %d on card %d", n, cd);
        sh->dbuf[cd] = p;
        if (!eng->dev_graphs) continue;
        sh->n_dgraph = c->n_layers * sh->sg->n_halves;   /* per layer and micro-batch */
        sh->dgraph[cd] = calloc((size_t)sh->n_dgraph, sizeof *sh->dgraph[cd]);
        rc = sh->dgraph[cd] ? mf_dev_host_alloc(eng->dev, cd, tab_bytes, (void **)&sh->htab[cd])
                            : mf_error(-ENOMEM, "step: out of memory");
        if (rc) return mf_error_wrap(rc, "step: slot tables on card %d", cd);
        memset(sh->htab[cd], 0, tab_bytes);
    }
    return 0;
}

/* Each dense card's copies of shape sh's activations (--dense cards): the dense block of the one
 * layout (mf_sg_card_bufs), one device allocation per card. 0 or a negative code; the caller
 * frees sh. */
static int mf_step_shape_dense(mf_step *eng, mf_step_shape *sh)
{
    if (!eng->n_dense) return 0;
    const mf_sg_card_bufs *cb = &sh->cb;
    for (int b = 0; b < MF_LY_A_N; b++) {
        sh->dd_ab[b] = cb->ab[b];
        sh->dd16_ab[b] = cb->ab16[b];
    }
    sh->dd16_xin = cb->xin16;
    sh->dd16_ys = cb->ys16;
    sh->dd_xin = cb->xin;
    sh->dd_logits = cb->logits;
    sh->dd_hs = cb->hs;
    sh->dd_gs = cb->gs;
    sh->dd_us = cb->us;
    sh->dd_ys = cb->ys;
    sh->dd_hn = cb->hn;
    sh->head_rows = cb->head_rows;
    sh->dd_lbuf = cb->lbuf;
    sh->dd_eg_emb = cb->eg_emb;
    sh->dd_eg_kv = cb->eg_kv;
    sh->dd_hk_tab = cb->hk_tab;
    sh->dd_hk_keys = cb->hk_keys;
    sh->dd_hk_nk = cb->hk_nk;
    sh->dd_hk_sink = cb->hk_sink;
    sh->dd_sk_tab = cb->sk_tab;
    sh->dd_sk_nvis = cb->sk_nvis;
    sh->dd_sk_score = cb->sk_score;
    size_t total = cb->dense_bytes;
    for (int cd = 0; cd < eng->n_dense; cd++) {
        void *dp = NULL;
        int rc = mf_dev_alloc(eng->dev, eng->dense_card[cd], total, &dp);
        if (rc)
            return mf_error_wrap(rc, "step: dense activations of a batch of %d on card %d", sh->n, eng->dense_card[cd]);
        sh->ddense[cd] = dp;
    }
    return 0;
}

/* A shape of n items: parallel, serial, or n_units units ending at unit_end[]. A unit shape
 * (n_units > 0) carves its buffers from the engine's umem, laid out for max_items items (the
 * first n used); the others own theirs. */
static int mf_step_shape_new(mf_step *eng, int n, int par, int n_units, const int *unit_end, mf_step_shape **out)
{
    const mf_config *c = eng->c;
    int64_t H = c->hidden_size, I = c->moe_intermediate_size, V = c->vocab_size;
    int64_t Ish = c->n_shared_experts > 0 ? mf_model_layer_at(eng->ly->m, 0)->sh_w1.rows : 0;
    int K = c->n_experts_per_tok, E = c->n_routed_experts, hc = c->hc_mult;
    int n_cb = c->candidate_topk_blocks > 0 ? c->candidate_topk_blocks : 1;
    int64_t t0 = mf_now_ns();
    mf_step_shape *sh = calloc(1, sizeof *sh);
    if (!sh) return mf_error(-ENOMEM, "step: out of memory");
    sh->eng = eng;
    sh->n = n;
    sh->par = par;
    int rc = mf_step_graph_new(eng, n, par, n_units, unit_end, &sh->sg);
    if (rc) {
        free(sh);
        return mf_error_wrap(rc, "step: building the graph of a batch of %d", n);
    }
    sh->g = sh->sg->g;
    sh->n_slots = sh->sg->n_slots;
    sh->p_exp = sh->sg->p_exp;
    sh->p_sh = sh->sg->p_sh;
    sh->p_head = sh->sg->p_head;
    sh->p_attn = sh->sg->p_attn;
    sh->store_layer = -1;
    if (eng->store) {
        sh->n_parts = mf_store_n_parts(eng->store);
        sh->slot_w = calloc((size_t)sh->n_slots * 3, sizeof *sh->slot_w);
        sh->slot_rd = calloc((size_t)sh->n_slots * sh->n_parts, sizeof *sh->slot_rd);
        if (!sh->slot_w || !sh->slot_rd) {
            mf_step_shape_free(sh);
            return mf_error(-ENOMEM, "step: out of memory");
        }
        for (int i = 0; i < sh->n_slots * sh->n_parts; i++) sh->slot_rd[i] = (mf_io_read){.fd = -1};
    }
    sh->dev_layer = -1;
    int shared = n_units > 0, ln = shared ? eng->max_items : n;   /* the layout's items */
    mf_sg_card_in ci = mf_step_card_in(eng, sh->sg, ln);
    mf_sg_card_bufs_of(&ci, &sh->cb);
    if ((rc = mf_step_shape_cards(eng, sh))) {
        mf_step_shape_free(sh);
        return rc;
    }
    /* the int8 rows by rows (host/kernels.h mf_kern_q8_bytes): a slot's area where its rows are */
    size_t nk = (size_t)ln * K, q8x = mf_kern_q8_bytes(1, (int)H), q8h = mf_kern_q8_bytes(1, (int)I);
    int ex = eng->o.exact;
    size_t f = sizeof(float), bytes = 0, ab_sz[MF_LY_A_N];
    size_t eg_d = 0;
    if (c->n_engram > 0) {   /* Engram rows of one item, its wkv output */
        sh->eg_per = sh->cb.eg_per;
        sh->eg_emb_ld = sh->cb.eg_emb_ld;
        sh->eg_kv_ld = sh->cb.eg_kv_ld;
        eg_d = (size_t)c->engram_head_dim;
        if (eng->eg_reads) sh->eg_scratch_item = (mf_store_gather_bytes(eng->store, sh->eg_per) + 15) / 16 * 16;
    }
    sh->eg_items = ln;
    size_t eg_items = (size_t)ln * (size_t)c->n_engram;   /* one set of rows per Engram slot */
    size_t eg_n = eng->eg_reads ? eg_items * sh->eg_per : 0;
    /* with dense cards: the bf16 mirrors of what their chains copy as bf16 (mf_sg_attn_buf_bf16) */
    size_t ab16_sz[MF_LY_A_N], dn = eng->n_dense > 0 ? (size_t)ln : 0;
    for (int b = 0; b < MF_LY_A_N; b++) {
        sh->ab_ld[b] = sh->cb.ab_ld[b];
        ab_sz[b] = (size_t)ln * sh->ab_ld[b] * sizeof(float);
        ab16_sz[b] = mf_sg_attn_buf_bf16(b) ? dn * sh->ab_ld[b] * 2 : 0;
    }
    size_t xin16_sz = mf_sg_dense_bf16(MF_SG_D_GATE, 0) ? dn * H * 2 : 0;
    size_t ys16_sz = mf_sg_dense_bf16(MF_SG_D_SHARED, 1) && c->n_shared_experts > 0 ? dn * H * 2 : 0;
    /* the shape's buffers: {name, bytes, &ptr}, sized first, then carved from one allocation */
    float *x = NULL;
    int32_t *topk = NULL, *cand = NULL;
    float *sel_kv = NULL;   /* per item its selection's entries, unpacked once (mf_ly_item.sel_kv) */
    int has_comp = 0;
    for (int L = 0; L < c->n_layers; L++) has_comp |= c->compress_ratios[L] > 0;
    size_t n_ = (size_t)ln, ns = (size_t)sh->n_slots;
    if (shared) {   /* the most slots a shape of ln items has (two micro-batches: E per half at most) */
        size_t cap = (size_t)(eng->o.micro == 2 ? 2 : 1) * E;
        ns = nk < cap ? nk : cap;
        if ((size_t)sh->n_slots > ns) {
            mf_step_shape_free(sh);
            return mf_error(-EINVAL, "step: a unit shape of %d items has %d expert slots, past the %zu laid out",
                            n, sh->n_slots, ns);
        }
    }
        /* the heads on cards: the key table's entries at most (a longer union runs the host's heads) */
    int hk = sh->sg->heads_any, sk = sh->sg->scores_any;
    sh->sk_rows = sh->cb.sk_rows;   /* a card's items of the index scores at most */
    sh->hk_ecap = sh->cb.hk_ecap;
    mf_step_buf tab[] = {
        {"items", n_ * sizeof(mf_ly_item), (void **)&sh->items},
        {"streams", n_ * hc * H * f, (void **)&x},
        {"topk", n_ * c->index_topk * 4, (void **)&topk},
        {"sel_kv", has_comp ? n_ * c->index_topk * c->head_dim * f : 0, (void **)&sel_kv},
        {"candidates", n_ * n_cb * 4, (void **)&cand},
        {"xin", n_ * H * f, (void **)&sh->xin},
        {"moe_out", n_ * H * f, (void **)&sh->moe_out},
        {"ex", nk * 4, (void **)&sh->ex},
        {"wt", nk * f, (void **)&sh->wt},
        {"asg", nk * 4, (void **)&sh->asg},
        {"cnt", (size_t)E * 4, (void **)&sh->cnt},
        {"fill", (size_t)E * 4, (void **)&sh->fill},
        {"slot_of", (size_t)E * 4, (void **)&sh->slot_of},
        {"slot_e", ns * 4, (void **)&sh->slot_e},
        {"slot_off", ns * 4, (void **)&sh->slot_off},
        {"slot_cnt", ns * 4, (void **)&sh->slot_cnt},
        {"xg", nk * H * f, (void **)&sh->xg},
        {"wg", nk * f, (void **)&sh->wg},
        {"h", nk * I * f, (void **)&sh->h},
        {"gg", ex ? nk * I * f : 0, (void **)&sh->gg},
        {"uu", ex ? nk * I * f : 0, (void **)&sh->uu},
        {"y", nk * H * f, (void **)&sh->y},
        {"xg16", eng->n_cards ? nk * H * 2 : 0, (void **)&sh->xg16},
        {"y16", eng->n_cards ? nk * H * 2 : 0, (void **)&sh->y16},
        {"row_card", eng->n_cards ? nk : 0, (void **)&sh->row_card},
        {"q8x", ns * sizeof(mf_kern_q8), (void **)&sh->q8x},
        {"q8h", ns * sizeof(mf_kern_q8), (void **)&sh->q8h},
        {"q8x_mem", nk * q8x, (void **)&sh->q8x_mem},
        {"q8h_mem", nk * q8h, (void **)&sh->q8h_mem},
        {"hs", n_ * Ish * f, (void **)&sh->hs},
        {"gs", ex ? n_ * Ish * f : 0, (void **)&sh->gs},
        {"us", ex ? n_ * Ish * f : 0, (void **)&sh->us},
        {"ys", n_ * H * f, (void **)&sh->ys},
        {"hn", n_ * H * f, (void **)&sh->hn},
        {"lbuf", n_ * V * f, (void **)&sh->lbuf},
        {"head_item", n_ * 4, (void **)&sh->head_item},
        {"head_row", n_ * 4, (void **)&sh->head_row},
        {"amix", n_ * MF_STEP_N_MIX * f, (void **)&sh->amix},
        {"fmix", n_ * MF_STEP_N_MIX * f, (void **)&sh->fmix},
        {"hcol", n_ * H * f, (void **)&sh->hcol},
        {"qrs", n_ * f, (void **)&sh->qrs},
        {"logits", n_ * E * f, (void **)&sh->logits},
        {"eg_emb", eg_items * sh->eg_emb_ld * f, (void **)&sh->eg_emb},
        {"eg_kv", eg_items * sh->eg_kv_ld * f, (void **)&sh->eg_kv},
        {"eg_rows", eg_n * sizeof(int64_t), (void **)&sh->eg_rows},
        {"eg_codes", eg_n * eg_d, (void **)&sh->eg_codes},
        {"eg_scales", eg_n * ((eg_d + 31) / 32), (void **)&sh->eg_scales},
        {"eg_rd", 2 * eg_n * sizeof(mf_io_read), (void **)&sh->eg_rd},
        {"eg_scratch", eng->eg_reads ? eg_items * sh->eg_scratch_item : 0, (void **)&sh->eg_scratch},
        {"ab_in", ab_sz[MF_LY_A_IN], (void **)&sh->ab[MF_LY_A_IN]},
        {"ab_qr", ab_sz[MF_LY_A_QR], (void **)&sh->ab[MF_LY_A_QR]},
        {"ab_kv", ab_sz[MF_LY_A_KV], (void **)&sh->ab[MF_LY_A_KV]},
        {"ab_lat", ab_sz[MF_LY_A_LAT], (void **)&sh->ab[MF_LY_A_LAT]},
        {"ab_gate", ab_sz[MF_LY_A_GATE], (void **)&sh->ab[MF_LY_A_GATE]},
        {"ab_iw", ab_sz[MF_LY_A_IW], (void **)&sh->ab[MF_LY_A_IW]},
        {"ab_q", ab_sz[MF_LY_A_Q], (void **)&sh->ab[MF_LY_A_Q]},
        {"ab_qi", ab_sz[MF_LY_A_QI], (void **)&sh->ab[MF_LY_A_QI]},
        {"ab_o", ab_sz[MF_LY_A_O], (void **)&sh->ab[MF_LY_A_O]},
        {"ab_z", ab_sz[MF_LY_A_Z], (void **)&sh->ab[MF_LY_A_Z]},
        {"ab_out", ab_sz[MF_LY_A_OUT], (void **)&sh->ab[MF_LY_A_OUT]},
        {"hk_tab", hk ? ((size_t)c->sliding_window + (size_t)sh->hk_ecap) * c->head_dim * f : 0, (void **)&sh->hk_tab},
        {"hk_keys", hk ? n_ * sh->sg->heads_keys * 4 : 0, (void **)&sh->hk_keys},
        {"hk_nk", hk ? n_ * 4 : 0, (void **)&sh->hk_nk},
        {"hk_sink", hk ? (size_t)c->n_heads * f : 0, (void **)&sh->hk_sink},
        {"ab16_in", ab16_sz[MF_LY_A_IN], (void **)&sh->ab16[MF_LY_A_IN]},
        {"ab16_qr", ab16_sz[MF_LY_A_QR], (void **)&sh->ab16[MF_LY_A_QR]},
        {"ab16_q", ab16_sz[MF_LY_A_Q], (void **)&sh->ab16[MF_LY_A_Q]},
        {"ab16_qi", ab16_sz[MF_LY_A_QI], (void **)&sh->ab16[MF_LY_A_QI]},
        {"ab16_o", ab16_sz[MF_LY_A_O], (void **)&sh->ab16[MF_LY_A_O]},
        {"ab16_z", ab16_sz[MF_LY_A_Z], (void **)&sh->ab16[MF_LY_A_Z]},
        {"ab16_out", ab16_sz[MF_LY_A_OUT], (void **)&sh->ab16[MF_LY_A_OUT]},
        {"xin16", xin16_sz, (void **)&sh->xin16},
        {"ys16", ys16_sz, (void **)&sh->ys16},
        {"sk_tab", sk ? (size_t)MF_SG_SCORE_ENTRIES * c->index_head_dim * f : 0, (void **)&sh->sk_tab},
        {"sk_nvis", sk ? n_ * 4 : 0, (void **)&sh->sk_nvis},
    };
    _Static_assert(MF_LY_A_N == 11, "one row per attention buffer");
    enum { N_TAB = sizeof tab / sizeof tab[0] };
    for (int i = 0; i < N_TAB; i++) bytes += (tab[i].bytes + 63) / 64 * 64;
    uint8_t *p = shared ? eng->umem : NULL;
    if (shared && p && bytes != eng->umem_bytes) {
        mf_step_shape_free(sh);
        return mf_error(-EINVAL, "step: unit shape buffers of %zu bytes, the engine laid out %zu", bytes, eng->umem_bytes);
    }
    if (!p) {
        if (!(p = aligned_alloc(64, bytes))) {
            mf_step_shape_free(sh);
            return mf_error(-ENOMEM, "step: cannot allocate %zu bytes of buffers for a batch of %d", bytes, ln);
        }
        memset(p, 0, bytes);
        if (shared) {
            eng->umem = p;
            eng->umem_bytes = bytes;
        } else {
            sh->mem = p;
        }
    }
    for (int i = 0; i < N_TAB; i++) {
        *tab[i].ptr = tab[i].bytes ? p : NULL;
        p += (tab[i].bytes + 63) / 64 * 64;
    }
    for (int b = 0; b < MF_LY_A_N; b++)
        if (ab16_sz[b] && !sh->ab16[b]) {   /* a bf16 buffer (mf_sg_attn_buf_bf16) without a row above */
            mf_step_shape_free(sh);
            return mf_error(-EINVAL, "step: attention buffer %d is copied as bf16 but has no mirror (internal)", b);
        }
    sh->q8x_bytes = q8x;
    sh->q8h_bytes = q8h;
    for (int i = 0; i < n; i++) {
        sh->items[i].x = x + (size_t)i * hc * H;
        sh->items[i].topk = topk + (size_t)i * c->index_topk;
        sh->items[i].sel_kv = sel_kv ? sel_kv + (size_t)i * c->index_topk * c->head_dim : NULL;
        sh->items[i].cand = cand + (size_t)i * n_cb;
    }
    if ((rc = mf_step_shape_dense(eng, sh))) {
        mf_step_shape_free(sh);
        return rc;
    }
    rc = mf_step_bind(eng, sh);
    if (rc) {
        mf_step_shape_free(sh);
        return mf_error_wrap(rc, "step: building the graph of a batch of %d", n);
    }
    eng->builds.n_built++;
    eng->builds.build_ns += mf_now_ns() - t0;
    *out = sh;
    return 0;
}

/* ---- the engine ---------------------------------------------------------------------------- */

/* The card slot's layout mirrors the host's: when the model's experts are resident (no store)
 * and every expert's six parts lie at the same offsets from its w1 codes (the model block keeps
 * a layer's tensors in layout order, each expert's w1, w1 scale, w2, ... one after another, the
 * parts MF_MODEL_EXPERT_ALIGN-aligned: graphs/model/model.c), each offset a multiple of the
 * card's 256-byte part alignment and the span at most 6 x 4 KiB over the parts' packing, the slot
 * takes those offsets (s->part_off, s->part_bytes, s->xslot_bytes) and 1 is returned: a miss is
 * then one copy of the span (mf_dev_copy_expert). 0 otherwise (nothing set). */
static int mf_step_xslot_layout(mf_step *s)
{
    const mf_config *c = s->c;
    const mf_model *m = s->ly->m;
    if (s->store) return 0;
    size_t off[6], bytes[6], packed = 0;
    const uint8_t *b0 = NULL;
    for (int L = 0; L < c->n_layers; L++)
        for (int e = 0; e < c->n_routed_experts; e++) {
            const mf_weight *ew = &mf_model_layer_at(m, L)->experts[(size_t)e * 3];
            const uint8_t *src[6] = {ew[0].data, ew[0].scale, ew[1].data, ew[1].scale, ew[2].data, ew[2].scale};
            for (int p = 0; p < 6; p++) {
                if (!src[p]) return 0;
                if (!L && !e) {
                    const mf_weight *w = &ew[p / 2];
                    bytes[p] = p % 2 ? (w->st_scale ? w->st_scale->n_bytes : (size_t)(w->rows * w->cols / 32))
                                     : (w->st_data ? w->st_data->n_bytes : (size_t)(w->rows * w->cols / 2));
                    if (src[p] < src[0]) return 0;
                    off[p] = (size_t)(src[p] - src[0]);
                    if (off[p] % 256 || (p && off[p] < off[p - 1] + bytes[p - 1])) return 0;
                    packed += (bytes[p] + 255) / 256 * 256;
                } else if (src[p] < src[0] || (size_t)(src[p] - src[0]) != off[p]) {
                    return 0;
                }
            }
            b0 = src[0];
        }
    size_t span = (off[5] + bytes[5] + 255) / 256 * 256;
    if (!b0 || span > packed + 6 * 4096) return 0;
    memcpy(s->part_off, off, sizeof off);
    memcpy(s->part_bytes, bytes, sizeof bytes);
    s->xslot_bytes = span;
    return 1;
}

/* Routed experts on s->o.dev: checks that the cards can run them as the host does (int8 path,
 * swiglu limit, FP4 experts), lays out a packed expert (w1, w2, w3 codes and scales) and takes the
 * cards (three lanes each); mf_step_caches_new opens their expert caches once the lanes exist. */
static int mf_step_dev_setup(mf_step *s)
{
    const mf_config *c = s->c;
    if (s->o.placement != MF_STEP_PLACE_SEED && s->o.placement != MF_STEP_PLACE_HYBRID)
        return mf_error(-EINVAL, "step: unknown placement %d", s->o.placement);
    if (s->o.exact)
        return mf_error(-ENOTSUP, "step: routed experts on devices run the int8 path; --exact (the fp32 "
                        "path with the reference's bf16 roundings) is host-only for now");
    if (!(c->swiglu_limit > 0))
        return mf_error(-ENOTSUP, "step: routed experts on devices need a swiglu limit (the fused "
                        "kernel); this model has none");
    const mf_weight *ew = mf_model_layer_at(s->ly->m, 0)->experts;
    for (int k = 0; k < 3; k++)
        if (ew[k].kind != MF_W_FP4)
            return mf_error(-ENOTSUP, "step: routed experts on devices need FP4 experts; %s is not",
                            ew[k].name);
    if (!(s->miss_span = mf_step_xslot_layout(s))) {   /* else the parts packed 256-aligned */
        uint64_t off = 0;
        for (int k = 0; k < 3; k++) {
            uint64_t db = ew[k].st_data ? ew[k].st_data->n_bytes : (uint64_t)(ew[k].rows * ew[k].cols / 2);
            uint64_t sb = ew[k].st_scale ? ew[k].st_scale->n_bytes : (uint64_t)(ew[k].rows * ew[k].cols / 32);
            s->part_off[2 * k] = off;
            s->part_bytes[2 * k] = db;
            off += (db + 255) / 256 * 256;
            s->part_off[2 * k + 1] = off;
            s->part_bytes[2 * k + 1] = sb;
            off += (sb + 255) / 256 * 256;
        }
        s->xslot_bytes = off;
    }
    s->dev = s->o.dev;
    s->dev_graphs = s->o.dev_graphs;
    s->n_cards = mf_dev_n_cards(s->dev);
    s->dstat.n_cards = s->n_cards;
    return 0;
}

/* The expert cache of each card with routed experts, after the dense weights and the lanes. With a
 * budget (mf_step_opts.dev_cache_bytes) a cache takes that; without one, what the card grants
 * (every expert, halved until it fits) once the buffers of the engine's largest shapes are held
 * back (mf_sg_card_reserve: a prefill chunk's and the largest decode batch's, routed and dense
 * blocks): held by an allocation while the cache is sized, then released for the shapes, which
 * allocate when they first run. A card that cannot hold them beside its dense weights is refused
 * here, naming the card and the sizes, not at a chunk's first run. */
static int mf_step_caches_new(mf_step *s)
{
    const mf_config *c = s->c;
    void *hold[MF_DEV_MAX_CARDS] = {0};
    int rc = 0;
    if (!s->o.dev_cache_bytes) {
        mf_task_fn fn_of[MF_SG_N_OPS];
        int chunk = s->o.prefill_chunk > 0 ? s->o.prefill_chunk : MF_STEP_PREFILL_CHUNK;
        if (chunk > s->max_chunk) chunk = s->max_chunk;
        mf_sg_opts o = mf_step_sg_opts(s, chunk, 0, 0, NULL, fn_of);
        mf_sg_card_in ci = mf_step_card_in(s, NULL, 0);
        double routed = 0, dense = 0;
        rc = mf_sg_card_reserve(&o, &ci, chunk, s->max_items, &routed, &dense);
        for (int cd = 0; !rc && cd < s->n_cards; cd++) {
            double b = routed;
            for (int k = 0; k < s->n_dense; k++) b += s->dense_card[k] == cd ? dense : 0;
            if (b > 0 && (rc = mf_dev_alloc(s->dev, cd, (size_t)b, &hold[cd])))
                rc = mf_error_wrap(rc == -ENOMEM ? -ENOSPC : rc, "step: card %d cannot hold the buffers of a %d-position prefill chunk and a "
                                   "decode batch of %d (%.3f GB) beside its dense weights (a shorter --chunk needs "
                                   "less)", cd, chunk, s->max_items, b / 1e9);
        }
    }
    for (int cd = 0; !rc && cd < s->n_cards; cd++) {
        rc = mf_dev_xcache_new(s->dev, &(mf_dev_xcache_opts){.card = cd, .n_layers = c->n_layers,
                                                             .n_experts = c->n_routed_experts,
                                                             .slot_bytes = s->xslot_bytes,
                                                             .budget_bytes = s->o.dev_cache_bytes},
                               &s->xc[cd]);
        if (rc) rc = mf_error_wrap(rc, "step: the expert cache of card %d", cd);
    }
    for (int cd = 0; cd < s->n_cards; cd++)
        if (hold[cd]) mf_dev_free(s->dev, cd, hold[cd]);
    if (rc) {
        for (int k = 0; k < s->n_cards; k++) {
            mf_dev_xcache_free(s->xc[k]);
            s->xc[k] = NULL;
        }
        return rc;
    }
    s->dstat.cache_slots = mf_dev_xcache_n_slots(s->xc[0]);
    return 0;
}

/* Rows [*r0, *r1) of weight w (rows base.. of its sublayer d's total rows) that dense card k holds:
 * mf_sg_dense_rows' share of the card when d is split by rows (an attention stage's linears one
 * after another), every row on the layer-range card of a sublayer that is not. 0: none. */
static int mf_step_dense_wrows(const mf_step *s, int k, int L, int d, const mf_weight *w, int64_t base,
                               int64_t total, int64_t *r0, int64_t *r1)
{
    int parts = mf_sg_dense_parts(s->n_dense, s->o.dense_split, d);
    int64_t a = 0, b = total;
    if (parts > 1) mf_sg_dense_rows(parts, k, total, &a, &b);
    else if (mf_sg_dense_card(s->c, s->n_dense, L) != k) b = 0;
    *r0 = a - base > 0 ? a - base : 0;
    *r1 = b - base < w->rows ? b - base : w->rows;
    return *r0 < *r1;
}

/* The dense weights of layer L (-1: the head) that dense card k holds rows of, with those rows;
 * returns their count. */
static int mf_step_dense_weights_of(const mf_step *s, int L, int k, const mf_weight **w, int64_t *r0, int64_t *r1)
{
    int n = 0;
    if (L < 0) {
        w[0] = mf_model_head(s->ly->m);
        return mf_step_dense_wrows(s, k, L, MF_SG_D_HEAD, w[0], 0, w[0]->rows, &r0[0], &r1[0]);
    }
    const mf_model_layer *y = mf_model_layer_at(s->ly->m, L);
    for (int st = 0; st < MF_LY_A_N_STAGES; st++) {   /* sublayer MF_SG_D_ATTN_IN + st */
        mf_ly_attn_lin lin[MF_LY_A_MAX_LIN];
        int nl = mf_ly_attn_linears(s->ly, L, st, lin);
        int64_t total = 0, base = 0;
        for (int j = 0; j < nl; j++) total += lin[j].w->rows;
        for (int j = 0; j < nl; base += lin[j++].w->rows)
            if (mf_step_dense_wrows(s, k, L, MF_SG_D_ATTN_IN + st, lin[j].w, base, total, &r0[n], &r1[n]))
                w[n++] = lin[j].w;
    }
    const mf_weight *rest[4] = {&y->gate, &y->sh_w1, &y->sh_w3, &y->sh_w2};
    for (int j = 0; j < (s->c->n_shared_experts > 0 ? 4 : 1); j++)
        if (mf_step_dense_wrows(s, k, L, j ? MF_SG_D_SHARED : MF_SG_D_GATE, rest[j], 0, rest[j]->rows, &r0[n], &r1[n]))
            w[n++] = rest[j];
    if (mf_config_engram_slot(s->c, L) >= 0 &&
        mf_step_dense_wrows(s, k, L, MF_SG_D_ENGRAM, &y->eg_wkv, 0, y->eg_wkv.rows, &r0[n], &r1[n]))
        w[n++] = &y->eg_wkv;
    assert(n <= MF_STEP_DW_MAX);
    return n;
}

/* Rows [r0, r1) of weight w onto dense card k at offset *off of its weight memory (NULL: only
 * sized), the copies enqueued on st; fills *v. FP8 slices start at a 32-row tile (their scale
 * rows); each part 256-byte aligned. */
static int mf_step_dense_upload(mf_step *s, int k, mf_dev_stream *st, const mf_weight *w, int64_t r0, int64_t r1,
                                size_t *off, mf_step_dmat *v)
{
    const char *name = w->name ? w->name : "a dense weight";
    if (!w->data || w->cols % 32 || !(w->kind == MF_W_BF16 || (w->kind == MF_W_FP8 && w->block_rows == 32 &&
                                                                w->block_cols == 32)))
        return mf_error(-ENOTSUP, "step: %s cannot go on a card (%s): the dense card kernels take resident "
                        "FP8 with 32x32 tiles or BF16, columns a multiple of 32", name, !w->data ? "not resident"
                                                                                       : "format or shape");
    if (w->kind == MF_W_FP8 && r0 % 32)
        return mf_error(-EINVAL, "step: rows [%lld, %lld) of %s: FP8 slices start at a 32-row tile", (long long)r0,
                        (long long)r1, name);
    size_t sc_cols = (size_t)(w->cols + 31) / 32;
    size_t wb = (size_t)(r1 - r0) * w->cols * (w->kind == MF_W_FP8 ? 1 : 2);
    size_t sb = w->kind == MF_W_FP8 ? (size_t)((r1 + 31) / 32 - r0 / 32) * sc_cols : 0;
    size_t o_w = *off, o_s = o_w + (wb + 255) / 256 * 256;
    *off = o_s + (sb + 255) / 256 * 256;
    uint8_t *base = s->dwmem[k];
    *v = (mf_step_dmat){.w = w, .r0 = r0, .r1 = r1,
                        .m = {.fmt = w->kind == MF_W_FP8 ? MF_KERN_FP8 : MF_KERN_BF16, .n_out = (int)(r1 - r0),
                              .n_in = (int)w->cols}};
    if (!base) return 0;
    v->m.w = base + o_w;
    v->m.scale = sb ? base + o_s : NULL;
    int rc = mf_dev_copy_h2d(st, base + o_w, w->data + (size_t)r0 * w->cols * (w->kind == MF_W_FP8 ? 1 : 2), wb);
    if (!rc && sb) rc = mf_dev_copy_h2d(st, base + o_s, w->scale + (size_t)(r0 / 32) * sc_cols, sb);
    return rc ? mf_error_wrap(rc, "step: copying %s to dense card %d", name, k) : 0;
}

/* Each dense card's resident weights: the rows of each dense weight it computes
 * (mf_step_dense_weights_of: the layers mf_sg_dense_card gives it and the head on the last
 * layer's card; split by rows, its share of every layer's and the head's), sized first, then one
 * allocation and the copies on the card's copy-in stream, waited for. A card without room fails
 * with -ENOMEM naming the card and the bytes. */
static int mf_step_dense_weights(mf_step *s)
{
    const mf_config *c = s->c;
    int NL = c->n_layers;
    for (int k = 0; k < s->n_dense; k++) {
        int cd = s->dense_card[k];
        mf_dev_stream *st = mf_dev_stream_of(s->dev, cd, MF_DEV_STREAM_COPY_IN);
        s->dmat[k] = calloc((size_t)(NL + 1) * MF_STEP_DW_MAX, sizeof *s->dmat[k]);
        if (!s->dmat[k]) return mf_error(-ENOMEM, "step: out of memory");
        for (int pass = 0; pass < 2; pass++) {
            size_t off = 0;
            int first = -1, last = -1, head = 0;
            for (int L = -1; L < NL; L++) {
                const mf_weight *w[MF_STEP_DW_MAX];
                int64_t r0[MF_STEP_DW_MAX], r1[MF_STEP_DW_MAX];
                int nw = mf_step_dense_weights_of(s, L, k, w, r0, r1);
                if (!nw) continue;
                head |= L < 0;
                if (L >= 0 && first < 0) first = L;
                if (L >= 0) last = L;
                mf_step_dmat *row = s->dmat[k] + (size_t)(L < 0 ? NL : L) * MF_STEP_DW_MAX;
                for (int j = 0; j < nw; j++) {
                    int rc = mf_step_dense_upload(s, k, st, w[j], r0[j], r1[j], &off, &row[j]);
                    if (rc) return rc;
                }
            }
            if (pass) break;
            s->dw_bytes[k] = off;
            if (!off) break;
            int rc = mf_dev_alloc(s->dev, cd, off, (void **)&s->dwmem[k]);
            if (rc)
                return mf_error_wrap(rc, "step: the dense weights of layers %d..%d%s (%llu bytes) do not fit on "
                                     "card %d (%s)", first, last, head ? " and the head" : "",
                                     (unsigned long long)off, cd, mf_dev_kind(s->dev));
        }
        int rc = mf_dev_stream_sync(st);
        if (rc) return mf_error_wrap(rc, "step: copying the dense weights to card %d", cd);
    }
    return 0;
}

static void mf_step_dense_free(mf_step *s)
{
    for (int k = 0; k < s->n_dense; k++) {
        mf_dev_free(s->dev, s->dense_card[k], s->dwmem[k]);
        free(s->dmat[k]);
    }
}

uint64_t mf_step_dense_bytes(const mf_step *s, int k, int *card)
{
    if (k < 0 || k >= s->n_dense) return 0;
    if (card) *card = s->dense_card[k];
    return s->dw_bytes[k];
}

/* Dense work on s->o.dev's cards (emulated or CUDA, through the device API): the cards that passed
 * the self-check, each with its resident weights (mf_step_dense_weights). */
static int mf_step_dense_setup(mf_step *s)
{
    if (s->o.dense != MF_STEP_DENSE_CARDS) return mf_error(-EINVAL, "step: unknown dense placement %d", s->o.dense);
    if (!s->o.dev) return mf_error(-EINVAL, "step: dense work on cards needs a device (--devices)");
    s->dev = s->o.dev;
    for (int cd = 0; cd < mf_dev_n_cards(s->dev); cd++)
        if (!(s->refused_mask & (1u << cd))) s->dense_card[s->n_dense++] = cd;
    return mf_step_dense_weights(s);
}

/* The startup self-check (device/dev_check.h) of every card of s->o.dev: a card that fails is
 * refused (its message kept in s->refused); with any refused, the routed experts run on the host
 * and the dense work on the cards that passed (on the host when none did). */
static void mf_step_selfcheck(mf_step *s)
{
    int n = mf_dev_n_cards(s->o.dev), len = 0;
    for (int cd = 0; cd < n; cd++) {
        /* a card without room for the check's buffers is left to the setup, which refuses a
         * card too small for its work with its own message */
        int rc = mf_dev_selfcheck(s->o.dev, cd, 1);
        if (!rc || rc == -ENOMEM) continue;
        s->refused_mask |= 1u << cd;
        len += snprintf(s->refused + len, sizeof s->refused - (size_t)len, "%srefused %s", len ? "; " : "",
                        mf_last_error());
        if (len >= (int)sizeof s->refused) len = (int)sizeof s->refused - 1;
    }
    if (!s->refused_mask) return;
    if (s->o.placement != MF_STEP_PLACE_HOST) {
        s->o.placement = MF_STEP_PLACE_HOST;
        len += snprintf(s->refused + len, sizeof s->refused - (size_t)len, "; routed experts run on the host");
        if (len >= (int)sizeof s->refused) len = (int)sizeof s->refused - 1;
    }
    if (s->o.dense && s->refused_mask == (1u << n) - 1) {
        s->o.dense = MF_STEP_DENSE_HOST;
        snprintf(s->refused + len, sizeof s->refused - (size_t)len, "; the dense work runs on the host");
    }
}

const char *mf_step_refused(const mf_step *s) { return s->refused; }

void mf_step_last_dev(const mf_step *s, mf_step_dev_stats *out)
{
    *out = s->dstat;
    out->sock_home = atomic_load(&s->sock_home);
    out->sock_cross = atomic_load(&s->sock_cross);
    out->dense_home = atomic_load(&s->dense_home);
    out->dense_cross = atomic_load(&s->dense_cross);
    out->miss_spans = atomic_load(&s->miss_spans);
}

void mf_step_fill(const mf_step *s, mf_step_fill_stats *out) { *out = s->fill; }

/* One executor per engine: the store's reads go to this engine's IO lane, whose ring registers the
 * slab (fixed-buffer reads; a refusal is logged and reads stay correct), and the store's own run
 * is released (the oracle's synchronous calls start it again when they come). */
static int mf_step_store_attach(mf_step *s)
{
    void *bufs[63];
    uint64_t lens[63];
    int n = mf_store_io_buffers(s->store, bufs, lens, 63);
    if (n) mf_sched_io_register(s->sched, bufs, lens, n);
    mf_error_clear();
    mf_store_io_release(s->store);
    return 0;
}

/* One CPU lane per socket (mf_step_opts.n_sockets): the topology's sockets, the workers split in
 * proportion to their cores (at least one each). */
static int mf_step_socket_lanes(mf_step *s)
{
    mf_topo_sockets ts;
    int n = s->o.n_sockets, rc = mf_topo_sockets_of(s->o.topology, &ts);
    if (rc) return rc;
    if (ts.n < n || n > s->o.n_threads)
        return mf_error(-EINVAL, "step: %d sockets asked; the topology%s%s has %d, and %d workers to share",
                        n, s->o.topology ? " " : "", s->o.topology ? s->o.topology : "", ts.n, s->o.n_threads);
    int thr[MF_TOPO_MAX_SOCKETS], cores = 0, given = 0;
    for (int k = 0; k < n; k++) cores += ts.cores[k];
    for (int k = 0; k < n; k++) {
        thr[k] = (int)((int64_t)s->o.n_threads * ts.cores[k] / cores);
        if (thr[k] < 1) thr[k] = 1;
        given += thr[k];
    }
    for (int k = 0; given != s->o.n_threads; k = (k + 1) % n) {   /* the rounding, one at a time */
        if (given < s->o.n_threads) thr[k]++, given++;
        else if (thr[k] > 1) thr[k]--, given--;
    }
    return mf_sg_lanes_sockets(&s->lt, n, thr, ts.numa);
}

int mf_step_new(mf_ref *r, const mf_step_opts *opts, mf_step **out)
{
    *out = NULL;
    const mf_layers *ly = mf_ref_layers(r);
    const mf_config *c = ly->c;
    mf_store *store = mf_model_store(ly->m);
    if (mf_model_is_lazy(ly->m) && !store)
        return mf_error(-ENOTSUP, "step: the model's experts are not resident (lazy load); the "
                        "scheduled engine needs them in memory or behind an expert store");
    int max_items = MF_STEP_MAX_ITEMS, max_chunk = MF_STEP_MAX_CHUNK;
    if (store) {   /* a graph run pins one layer's slots: min(items x top_k, experts) */
        int K = c->n_experts_per_tok, E = c->n_routed_experts;
        int fit = mf_store_n_slots(store) < mf_store_max_batch(store) ? mf_store_n_slots(store)
                                                                        : mf_store_max_batch(store);
        if (mf_store_n_parts(store) != 6 || mf_store_n_parts(store) > 64)
            return mf_error(-EINVAL, "step: the expert store holds %d parts per expert, expected 6",
                            mf_store_n_parts(store));
        if (fit < K && fit < E)
            return mf_error(-ENOSPC, "step: the expert store holds %d experts (slots of %" PRIu64 " bytes); "
                            "the scheduled engine pins the top_k = %d experts of a token's layer at once: "
                            "a budget of at least %" PRIu64 " bytes", fit, mf_store_slot_bytes(store), K,
                            (uint64_t)K * mf_store_slot_bytes(store));
        max_items = fit >= E ? MF_STEP_MAX_ITEMS : fit / K;
        if (max_items > MF_STEP_MAX_ITEMS) max_items = MF_STEP_MAX_ITEMS;
        max_chunk = fit >= E ? MF_STEP_MAX_CHUNK : fit / K;
        if (max_chunk > MF_STEP_MAX_CHUNK) max_chunk = MF_STEP_MAX_CHUNK;
    }
    if (ly->act_quant)
        return mf_error(-ENOTSUP, "step: act_quant is not supported by the scheduled engine");
    if (c->quant_block_out != 32 || c->quant_block_in != 32)
        return mf_error(-ENOTSUP, "step: FP8 scale tiles %dx%d, the kernels need 32x32",
                        c->quant_block_out, c->quant_block_in);
    if (mf_model_head(ly->m)->kind != MF_W_BF16)
        return mf_error(-ENOTSUP, "step: head.weight is not bf16");
    if (c->n_shared_experts > 1)
        return mf_error(-ENOTSUP, "step: %d shared experts (expected 0 or 1)", c->n_shared_experts);
    if (c->hidden_size % 32 || c->moe_intermediate_size % 32)
        return mf_error(-ENOTSUP, "step: hidden_size %" PRId64 " and moe_intermediate_size %" PRId64
                        " must be multiples of 32", (int64_t)c->hidden_size, (int64_t)c->moe_intermediate_size);
    mf_step *s = calloc(1, sizeof *s);
    if (!s) return mf_error(-ENOMEM, "step: out of memory");
    s->ly = ly;
    s->c = c;
    if (opts) s->o = *opts;
    if (s->o.n_threads < 1) s->o.n_threads = 1;
    if (s->o.prefill_chunk < 0 || s->o.prefill_chunk > MF_STEP_MAX_CHUNK) {
        int n = s->o.prefill_chunk;
        free(s);
        return mf_error(-EINVAL, "step: prefill chunk %d (expected 0 for the default %d, or 1..%d)", n,
                        MF_STEP_PREFILL_CHUNK, MF_STEP_MAX_CHUNK);
    }
    if (s->o.n_threads > 256) {
        int n = s->o.n_threads;
        free(s);
        return mf_error(-EINVAL, "step: %d threads (max 256)", n);
    }
    s->store = store;
    s->eg_reads = store && mf_store_tables_streamed(store);
    s->max_items = max_items;
    s->max_chunk = max_chunk;
    if (s->o.profile) {   /* the shapes' graphs are priced on it later (mf_sg_opts.profile) */
        s->prof = *s->o.profile;
        s->o.profile = &s->prof;
    }
    mf_step_lane_models(s->o.profile, s->o.n_threads, s->models);
    if (s->o.cpu_bytes_per_s > 0) s->models[0].bytes_per_s = s->o.cpu_bytes_per_s;
    int rc = 0;
    if (s->o.dev && (s->o.placement != MF_STEP_PLACE_HOST || s->o.dense) && !s->o.no_selfcheck)
        mf_step_selfcheck(s);
    /* the dense weights first: the expert caches then take what the cards have left */
    if (s->o.dense) rc = mf_step_dense_setup(s);
    if (!rc && s->o.dev && s->o.placement != MF_STEP_PLACE_HOST) rc = mf_step_dev_setup(s);
    s->n_lane_cards = s->n_cards > s->n_dense ? s->n_cards : s->n_dense;
    /* lanes: models for placement and priorities (mf_step_lane_models: the profile's, or the
     * built-in assumptions); dense-only cards map to the cards that passed the self-check */
    mf_sg_lanes_init(&s->lt, s->models, s->o.n_threads, store != NULL, s->n_lane_cards);
    if (!s->n_cards) mf_sg_lanes_map(&s->lt, s->dense_card, s->n_dense);
    if (!rc && s->o.n_sockets > 1) rc = mf_step_socket_lanes(s);
    if (s->lt.lane_io >= 0 && s->o.io_depth > 0) s->lt.lane[s->lt.lane_io].concurrency = s->o.io_depth;
    /* one layer context per CPU worker, on the kernels */
    s->cx = calloc((size_t)s->o.n_threads, sizeof *s->cx);
    if (!rc && !s->cx) rc = mf_error(-ENOMEM, "step: out of memory");
    for (int w = 0; !rc && w < s->o.n_threads; w++)
        if (!(rc = mf_ly_ctx_new(ly, MF_LY_LIN_KERN, &s->cx[w]))) s->n_cx = w + 1;
    if (!rc) rc = mf_sg_sizes_new(c, &s->sz);
    if (!rc && s->n_cards) rc = mf_step_caches_new(s);
    if (!rc) rc = mf_sched_create(&(mf_sched_opts){.lanes = s->lt.lane, .n_lanes = s->lt.n_lanes,
                                                   .pin_threads = s->o.pin_threads,
                                                   .dev = s->dev ? mf_dev_lane_ops_of(s->dev) : NULL,
                                                   .dev_wait_ns = s->o.dev_wait_ns,
                                                   .io_force_pread = s->o.io_force_pread,
                                                   .io_fault_kind = s->o.io_fault_kind,
                                                   .io_fault_nth = s->o.io_fault_nth,
                                                   .topology = s->o.topology},
                                  &s->sched);
    if (!rc && store) rc = mf_step_store_attach(s);
    if (!rc && s->o.dev_cache_fill && s->n_cards)
        rc = mf_dev_fill(&(mf_dev_fill_in){.dev = s->dev, .xc = s->xc, .n_cards = s->n_cards, .m = s->ly->m,
                                           .store = store, .part_off = s->part_off, .part_bytes = s->part_bytes,
                                           .counts = s->o.dev_fill_counts, .progress = s->o.dev_fill_progress},
                         &s->fill);
    s->o.dev_fill_counts = NULL;   /* read only here */
    if (rc) {
        mf_sg_sizes_free(s->sz);
        for (int w = 0; w < s->n_cx; w++) mf_ly_ctx_free(s->cx[w]);
        free(s->cx);
        for (int c = 0; c < s->n_cards; c++) mf_dev_xcache_free(s->xc[c]);
        mf_step_dense_free(s);
        mf_sched_destroy(s->sched);
        free(s);
        return rc;
    }
    *out = s;
    return 0;
}

void mf_step_free(mf_step *s)
{
    if (!s) return;
    mf_sched_destroy(s->sched);
    for (int i = 0; i <= MF_STEP_MAX_ITEMS; i++) {
        mf_step_shape_free(s->shapes[0][i]);
        mf_step_shape_free(s->shapes[1][i]);
    }
    for (int k = 0; k < MF_STEP_UNIT_SHAPES; k++) mf_step_shape_free(s->ushapes[k]);
    free(s->umem);
    mf_step_shape_free(s->long_shape);
    for (int c = 0; c < s->n_cards; c++) mf_dev_xcache_free(s->xc[c]);
    mf_step_dense_free(s);
    for (int w = 0; w < s->n_cx; w++) mf_ly_ctx_free(s->cx[w]);
    free(s->cx);
    mf_sg_sizes_free(s->sz);
    free(s);
}

/* Checks as mf_ref_forward does, before any state changes. */
static int mf_step_check(mf_step *s, mf_ref_state *const *states, const int32_t *tokens, int n)
{
    const mf_config *c = s->c;
    int64_t need = 0;
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= c->vocab_size)
            return mf_error(-EINVAL, "step: token %d (item %d) outside the vocabulary [0, %" PRId64 ")",
                            tokens[i], i, c->vocab_size);
        if (states[i]->ly != s->ly) return mf_error(-EINVAL, "step: item %d's state belongs to another forward", i);
        for (int j = 0; i > 0 && states[i - 1] != states[i] && j < i - 1; j++)
            if (states[j] == states[i])
                return mf_error(-EINVAL, "step: items of one sequence must be consecutive (item %d)", i);
        int64_t k = 0;
        for (int j = 0; j < n; j++) k += states[j] == states[i];
        if (states[i]->n_pos + k > states[i]->max_pos)
            return mf_error(-EINVAL, "step: sequence would reach %" PRId64 " positions, past its maximum "
                            "of %" PRId64, states[i]->n_pos + k, states[i]->max_pos);
        need = need > states[i]->max_pos ? need : states[i]->max_pos;
    }
    for (int w = 0; w < s->n_cx; w++) {   /* score buffers for the longest sequence */
        int rc = mf_ly_ctx_reserve(s->cx[w], need);
        if (rc) return rc;
    }
    return mf_ref_states_reserve(states, n);   /* the states' pages for every position the items reach */
}

/* The spans of the last run's tasks of the kinds in mask `kinds`, merged (mf_timeline_union) into
 * out; returns their count, *busy their length. */
static int mf_step_union(mf_step_shape *sh, mf_task_span *out, unsigned kinds, int64_t *busy)
{
    const mf_task_span *sp = mf_timeline_spans(sh->tl);
    int n = mf_graph_n_tasks(sh->g), m = 0;
    for (int t = 0; t < n; t++)
        if (sp[t].status == 0 && ((kinds >> sh->sg->task[t].kind) & 1) && sp[t].end_ns > sp[t].start_ns)
            out[m++] = sp[t];
    return mf_timeline_union(out, m, busy);
}

/* IO busy time of the last run (union of its IO-lane reads) and the part of it during which an
 * expert's compute task (routed or shared) was running; with devices the same for copy-ins
 * against expert compute on the host or a card. */
static void mf_step_io_overlap(mf_step *s, mf_step_shape *sh)
{
    int n = mf_graph_n_tasks(sh->g);
    mf_task_span *io = sh->sorted, *cp = sh->sorted + n;
    int64_t bi, bc;
    if (s->store) {
        int ni = mf_step_union(sh, io, 1u << MF_SG_K_IO, &bi);
        int nc = mf_step_union(sh, cp, 1u << MF_SG_K_EXPERT, &bc);
        s->times.io_busy_ns += bi;
        s->times.io_overlap_ns += mf_timeline_overlap(io, ni, cp, nc);
        s->times.expert_busy_ns += bc;
    }
    if (s->n_lane_cards) {   /* copy-in tasks (experts, dense activations) vs expert compute on the host or a card */
        int u = mf_step_union(sh, io, 1u << MF_SG_K_COPY, &bi);
        int ny = mf_step_union(sh, cp, (1u << MF_SG_K_EXPERT) | (1u << MF_SG_K_DEV), &bc);
        s->times.copy_busy_ns += bi;
        s->times.compute_busy_ns += bc;
        s->times.copy_overlap_ns += mf_timeline_overlap(io, u, cp, ny);
    }
}

/* Adds the last run's time per phase to s->times (mf_stepgraph_phase_times: per phase the union
 * of its tasks' intervals and their summed durations). */
static void mf_step_account(mf_step *s, mf_step_shape *sh)
{
    mf_step_io_overlap(s, sh);
    mf_stepgraph_phase_times(sh->sg, mf_timeline_spans(sh->tl), sh->sorted, s->times.phase_ns, s->times.busy_ns);
    s->times.n_tasks = mf_graph_n_tasks(sh->g);
}

/* After a failed run with a store: names the expert of the first failed read, closes the store's
 * open batch (its new slots freed, nothing pinned) so that the store stays usable. */
static int mf_step_store_fail(mf_step *s, mf_step_shape *sh, int rc)
{
    const mf_task_span *sp = mf_timeline_spans(sh->tl);
    int n = mf_graph_n_tasks(sh->g);
    for (int t = 0; t < n; t++) {
        if (sh->sg->task[t].kind != MF_SG_K_IO || sp[t].status >= 0) continue;
        const mf_step_targ *a = &sh->args[t];
        if (a->t->op == MF_SG_ENGRAM_READ) {
            const mf_model_layer *y = mf_model_layer_at(s->ly->m, a->t->layer);
            const mf_io_read *rd = &sh->eg_rd[mf_step_eg_row(sh, a->t->layer, a->t->i0) * 2 * sh->eg_per + a->t->read];
            int c = mf_store_gather_check(s->store, mf_config_engram_slot(s->c, a->t->layer));
            rc = mf_error_wrap(c ? c : rc, "step: layer %d: Engram gather of %s: reading %" PRIu64 " bytes at offset %"
                               PRIu64 " failed", a->t->layer, y->eg_table.name, rd->n_bytes, rd->offset);
            break;
        }
        const mf_model_layer *y = mf_model_layer_at(s->ly->m, a->t->layer);
        const mf_io_read *rd = &sh->slot_rd[(size_t)a->t->slot * sh->n_parts + a->t->read];
        rc = mf_error_wrap(rc, "step: layer %d expert %d (%s...): reading %" PRIu64 " bytes at offset %"
                           PRIu64 " into the expert store failed", a->t->layer, sh->slot_e[a->t->slot],
                           y->experts[sh->slot_e[a->t->slot] * 3].name, rd->n_bytes, rd->offset);
        break;
    }
    if (sh->store_layer >= 0) {
        mf_store_end(s->store, rc);
        sh->store_layer = -1;
    }
    return rc;
}

/* The shape for items of `states` (one state's items consecutive): per-item parts one task per
 * run of a state's items (a unit), run in order; with hooks set, one task for all (the hooks are
 * called in order on one thread then). Units all single: the parallel shape; one unit: the
 * serial one; else a unit shape, built on first use and kept among the last
 * MF_STEP_UNIT_SHAPES used. */
static int mf_step_shape_of(mf_step *s, mf_ref_state *const *states, int n, mf_step_shape **out)
{
    const mf_ref_hooks *hk = &s->ly->hooks;
    int hooks = hk->on_route || hk->on_select || hk->on_candidates, n_units = 0, unit_end[MF_STEP_MAX_ITEMS], rc;
    if (n > MF_STEP_MAX_ITEMS) {   /* a long chunk of one sequence (mf_step_forward_chunks checked it) */
        if (!s->long_shape || s->long_shape->n != n) {
            if (s->last == s->long_shape) s->last = NULL;
            mf_step_shape_free(s->long_shape);
            s->long_shape = NULL;
            if ((rc = mf_step_shape_new(s, n, 0, 0, NULL, &s->long_shape))) return rc;
        }
        *out = s->long_shape;
        return 0;
    }
    for (int i = 1; i <= n; i++)
        if (i == n || states[i] != states[i - 1]) unit_end[n_units++] = i;
    int par = n > 1 && !hooks && n_units == n;
    if (hooks || n_units == 1 || par) {
        if (!s->shapes[par][n] && (rc = mf_step_shape_new(s, n, par, 0, NULL, &s->shapes[par][n]))) return rc;
        *out = s->shapes[par][n];
        return 0;
    }
    s->n_calls++;
    int lru = 0;
    for (int k = 0; k < MF_STEP_UNIT_SHAPES; k++) {
        const mf_stepgraph *g = s->ushapes[k] ? s->ushapes[k]->sg : NULL;
        if (g && g->n == n && g->n_units == n_units && !memcmp(g->unit_end, unit_end, sizeof(int) * (size_t)n_units)) {
            s->ushape_used[k] = s->n_calls;
            *out = s->ushapes[k];
            return 0;
        }
        if (s->ushape_used[k] < s->ushape_used[lru]) lru = k;
    }
    if (s->last == s->ushapes[lru]) s->last = NULL;
    mf_step_shape_free(s->ushapes[lru]);
    s->ushapes[lru] = NULL;
    s->ushape_used[lru] = 0;
    if ((rc = mf_step_shape_new(s, n, 0, n_units, unit_end, &s->ushapes[lru]))) return rc;
    s->ushape_used[lru] = s->n_calls;
    *out = s->ushapes[lru];
    return 0;
}

static int mf_step_chunk(mf_step *s, mf_ref_state *const *states, const int32_t *tokens, int n,
                         float *const *logits)
{
    const mf_config *c = s->c;
    mf_step_shape *sh;
    int rc = mf_step_shape_of(s, states, n, &sh);
    if (rc) return rc;
    int64_t H = c->hidden_size, need = 0;
    for (int i = 0; i < n; i++) need = need > states[i]->max_pos ? need : states[i]->max_pos;
    if (need > sh->iscore_ld) {   /* index scores for the longest sequence (as the workers' score buffers) */
        double *v = realloc(sh->iscore, sizeof *v * (size_t)n * (size_t)need);
        if (!v) return mf_error(-ENOMEM, "step: index scores of %d items of up to %" PRId64 " positions", n, need);
        sh->iscore = v;
        sh->iscore_ld = need;
    }
    const mf_weight *emb = mf_model_embed(s->ly->m);
    sh->n_head = 0;
    for (int i = 0; i < n; i++) {
        mf_ly_item *it = &sh->items[i];
        it->st = states[i];
        it->pos = i > 0 && states[i - 1] == states[i] ? sh->items[i - 1].pos + 1 : states[i]->n_pos;
        it->tok = tokens[i];
        it->st->tokens[it->pos] = tokens[i];
        it->topk_src = it->cand_src = -1;
        it->n_topk = it->n_cand = 0;
        memset(it->pre, 0, sizeof it->pre);
        it->pre[0] = 1.0f;
        it->logits = logits ? logits[i] : NULL;
        sh->head_row[i] = it->logits ? sh->n_head : -1;
        if (it->logits) sh->head_item[sh->n_head++] = i;
        for (int64_t d = 0; d < H; d++) {
            uint16_t b;
            memcpy(&b, emb->data + ((int64_t)tokens[i] * H + d) * 2, 2);
            it->x[d] = mf_bf16_to_f32(b);
        }
        for (int k = 1; k < c->hc_mult; k++) memcpy(it->x + k * H, it->x, (size_t)H * sizeof(float));
    }
    mf_timeline_reset(sh->tl);
    rc = mf_sched_run(s->sched, sh->g, &(mf_run_opts){.timeline = sh->tl});
    s->last = sh;
    if (rc && sh->dev_layer >= 0) rc = mf_step_dev_fail(sh, rc);
    if (rc && s->store) rc = mf_step_store_fail(s, sh, rc);
    if (rc) return rc;
    for (int j = 0; j < sh->n_head; j++)
        memcpy(sh->items[sh->head_item[j]].logits, sh->lbuf + (size_t)j * c->vocab_size,
               sizeof(float) * (size_t)c->vocab_size);
    for (int i = 0; i < n; i++) sh->items[i].st->n_pos = sh->items[i].pos + 1;
    mf_step_account(s, sh);
    s->times.macs += mf_stepgraph_macs(sh->sg, c->n_experts_per_tok, sh->n_head);
    s->times.weight_bytes += mf_stepgraph_weight_bytes(sh->sg);
    return 0;
}

/* mf_step_forward in graph runs of at most `chunk` items. */
static int mf_step_forward_chunks(mf_step *s, mf_ref_state *const *states, const int32_t *tokens, int n,
                                  float *const *logits, int chunk)
{
    int64_t t0 = mf_now_ns();
    memset(&s->times, 0, sizeof s->times);
    s->dstat.dev_slots = s->dstat.host_slots = s->dstat.host_fallbacks = 0;
    atomic_store(&s->sock_home, 0);
    atomic_store(&s->sock_cross, 0);
    atomic_store(&s->dense_home, 0);
    atomic_store(&s->dense_cross, 0);
    atomic_store(&s->miss_spans, 0);
    for (int c = 0; c < s->n_cards; c++) mf_dev_xcache_step(s->xc[c], NULL);
    if (n < 1) return mf_error(-EINVAL, "step: forward of %d items", n);
    int rc = mf_step_check(s, states, tokens, n);
    if (rc) return rc;
    for (int i = 0; i < n && !rc; i += chunk) {
        int m = n - i < chunk ? n - i : chunk;
        rc = mf_step_chunk(s, states + i, tokens + i, m, logits ? logits + i : NULL);
    }
    s->times.wall_ns = mf_now_ns() - t0;
    s->dstat.hits = s->dstat.misses = s->dstat.evictions = s->dstat.bytes_in = 0;
    for (int c = 0; c < s->n_cards; c++) {
        mf_dev_xcache_stats x;
        mf_dev_xcache_step(s->xc[c], &x);
        s->dstat.hits += x.hits;
        s->dstat.misses += x.misses;
        s->dstat.evictions += x.evictions;
        s->dstat.bytes_in += x.bytes_in;
    }
    int64_t rest = s->times.wall_ns;
    for (int p = 0; p < MF_STEP_OTHER; p++) rest -= s->times.phase_ns[p];
    s->times.phase_ns[MF_STEP_OTHER] = rest > 0 ? rest : 0;
    if (rc) return mf_error_wrap(rc, "scheduled forward (the states involved are now inconsistent: reset them)");
    return 0;
}

int mf_step_forward(mf_step *s, mf_ref_state *const *states, const int32_t *tokens, int n,
                    float *const *logits)
{
    int one = 1;   /* items all of one sequence: its serial graph runs up to max_chunk of them */
    for (int i = 1; i < n && one; i++) one = states[i] == states[0];
    return mf_step_forward_chunks(s, states, tokens, n, logits, one && n > s->max_items ? s->max_chunk : s->max_items);
}

int mf_step_prefill(mf_step *s, mf_ref_state *st, const int32_t *tokens, int n, float *logits)
{
    if (n < 1) return mf_error(-EINVAL, "step: prefill of %d tokens", n);
    mf_ref_state **sts = malloc((size_t)n * sizeof *sts);
    float **lg = calloc((size_t)n, sizeof *lg);
    if (!sts || !lg) {
        free(sts);
        free(lg);
        return mf_error(-ENOMEM, "step: out of memory");
    }
    for (int i = 0; i < n; i++) sts[i] = st;
    lg[n - 1] = logits;
    int chunk = s->o.prefill_chunk > 0 ? s->o.prefill_chunk : MF_STEP_PREFILL_CHUNK;
    int rc = mf_step_forward_chunks(s, sts, tokens, n, lg, chunk < s->max_chunk ? chunk : s->max_chunk);
    free(sts);
    free(lg);
    return rc;
}

int mf_step_decode(mf_step *s, mf_ref_state *const *states, const int32_t *tokens, int n_seq,
                   float *logits)
{
    if (n_seq < 1 || n_seq > MF_STEP_MAX_ITEMS)
        return mf_error(-EINVAL, "step: decode of %d sequences (1..%d)", n_seq, MF_STEP_MAX_ITEMS);
    float *lg[MF_STEP_MAX_ITEMS];
    for (int i = 0; i < n_seq; i++) lg[i] = logits ? logits + (size_t)i * s->c->vocab_size : NULL;
    for (int i = 0; i < n_seq; i++)
        for (int j = 0; j < i; j++)
            if (states[i] == states[j]) return mf_error(-EINVAL, "step: decode got sequence %d twice", i);
    if (n_seq > s->max_items) {
        int K = s->c->n_experts_per_tok;
        return mf_error(-ENOSPC, "step: a decode batch of %d sequences pins up to %d experts of a layer "
                        "at once; the expert store holds %d (slots of %" PRIu64 " bytes): a budget of at "
                        "least %" PRIu64 " bytes, or at most %d sequences", n_seq, n_seq * K,
                        mf_store_n_slots(s->store), mf_store_slot_bytes(s->store),
                        (uint64_t)(n_seq * K < s->c->n_routed_experts ? n_seq * K : s->c->n_routed_experts) *
                            mf_store_slot_bytes(s->store), s->max_items);
    }
    return mf_step_forward(s, states, tokens, n_seq, lg);
}

void mf_step_last_times(const mf_step *s, mf_step_times *out) { *out = s->times; }

void mf_step_builds(const mf_step *s, mf_step_build_stats *out) { *out = s->builds; }

const mf_stepgraph *mf_step_graph(const mf_step *s, int n, int par)
{
    if (n > MF_STEP_MAX_ITEMS && !par && s->long_shape && s->long_shape->n == n) return s->long_shape->sg;
    if (n < 1 || n > MF_STEP_MAX_ITEMS || !s->shapes[!!par][n]) return NULL;
    return s->shapes[!!par][n]->sg;
}

int mf_step_write_trace(const mf_step *s, const char *path)
{
    if (!s->last) return mf_error(-EINVAL, "step: no step has run yet, nothing to trace");
    return mf_timeline_write_chrome(s->last->tl, path);
}
