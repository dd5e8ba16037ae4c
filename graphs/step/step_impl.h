/* The scheduled decode engine's insides (graphs/step/step.h is its API): the engine (struct mf_step),
 * a shape (one batch pattern's graph and buffers), a task's argument, the helpers and the internal
 * functions the engine's files share (step.c, step_shape.c and the task files step_engram.c,
 * step_hc.c, step_attn.c, step_moe.c, step_moe_cards.c, step_dense.c). Included by those files only. */
#ifndef MF_GRAPHS_STEP_STEP_IMPL_H
#define MF_GRAPHS_STEP_STEP_IMPL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "device/dev.h"
#include "device/expert_cache.h"
#include "graphs/layers/layers.h"
#include "graphs/step/step.h"
#include "graphs/step/stepgraph.h"
#include "host/kernels.h"
#include "host/store.h"
#include "sched/profile.h"
#include "sched/sched.h"
#include "sched/timeline.h"

typedef struct mf_step_shape mf_step_shape;

/* Floats of one item's hyper-connection mixes ((2 + hc) * hc, at most) */
#define MF_STEP_N_MIX ((2 + MF_LY_MAX_HC) * MF_LY_MAX_HC)
/* Serial shapes (one sequence's items) kept per length up to this many items; a longer chunk runs
 * the one long shape (mf_step.long_shape) */
#define MF_STEP_SERIAL_ITEMS 64
/* Graphs of several sequences: per kind (parallel, mixed) one per bucket of items
 * (graphs/step/stepgraph.h mf_sg_bucket: 2, 4, .. MF_STEP_MAX_ITEMS) */
#define MF_STEP_N_BUCKETS 10
_Static_assert(1 << (MF_STEP_N_BUCKETS - 1) == MF_STEP_MAX_ITEMS, "a bucket per power of two up to the most items");

/* One task's argument: its shape and its record in the step graph (what it is: layer, stage,
 * slot, part, card, items; graphs/step/stepgraph.h). The layer context (scratch) it uses is its
 * worker's (mf_step_cx). */
typedef struct mf_step_targ {
    mf_step_shape *sh;
    const mf_sg_task *t;
} mf_step_targ;

struct mf_step_shape {
    mf_step *eng;
    int n;              /* items (of a bucket's graph: its bucket; the step's live ones: sg->n_live) */
    int par;            /* 1: items of distinct sequences, per-item parts one task per item */
    int ln;             /* items its host buffers are laid out for (a bucket's: the arena's, umem_items) */
    /* the step graph (graphs/step/stepgraph.h) and its part counts: slots min(n * top_k, experts),
     * row parts per expert, shared expert, head, attention stage (also Engram wkv, router gate) */
    mf_stepgraph *sg;
    int n_slots, p_exp, p_sh, p_head, p_attn;
    mf_graph *g;        /* sg->g */
    mf_timeline *tl;
    mf_task_span *sorted;   /* per task: the last run's spans sorted by start (phase times) */
    mf_step_targ *args;     /* per task */
    /* items and their activations: per item its streams (hc x H), top-k, selection's entries and
     * candidates, rows of the arrays below (mf_ly_item points into them) */
    mf_ly_item *items;
    float *streams, *sel_kv_rows;
    int32_t *topk_rows, *cand_rows;
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
     * the step's start (graphs/step/stepgraph_engram.c mf_sg_engram), two layers' at once */
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
    float *net;         /* a pipeline stage: n x mf_sg_boundary_floats, the boundary in or out */
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
    /* prefetch (sg->prefetch), per parity of the layer (two layers' pins at a time: the next
     * layer's placed while this one's MoE runs, mf_sg_prefetch): per expert its card (-1: host),
     * cache slot, whether it is copied in (MF_SG_DEV_PRE), the layer pinned (-1: none); and
     * whether an expert was cached (the place task's scratch) */
    int32_t *pre_card[2];
    uint8_t **pre_dev[2];
    uint8_t *pre_miss[2], *pre_cached;
    int pre_layer[2];
    double pre_left[MF_SG_MAX_CARDS];   /* the link time the last placed layer's MoE window left (mf_sg_place_left) */
    int pre_left_layer;                 /* that layer, -1 */
    int dev_layer;          /* layer whose slots' cache slots are pinned (prefetch: whose slot table is live), -1 */
    int dev_half;           /* the micro-batch whose slots they are */
    uint8_t *dbuf[MF_DEV_MAX_CARDS];
    mf_sg_card_bufs cb;   /* the cards' buffers (routed and dense blocks) and the host layouts' row lengths */
    size_t d_x, d_w, d_h, d_q, d_y, d_tab, dq_bytes;   /* dq_bytes: the int8 scratch's bytes a row */
    size_t d_x16, d_y16;   /* the rows' bf16 copies (mf_sg_slot_tok_bytes): in, in slot order as d_x; out, each
                            * slot's where its rows in start (mf_sg_card_bufs.y16) */
    size_t d_ri;           /* slot_gather: each row's item (row_item's copy), in slot order */
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
    /* slot_gather (graphs/step/stepgraph.h mf_stepgraph.slot_gather): row_item[row] the item whose
     * input the row is, written by the row gather in place of xg16 (which it leaves unused), copied
     * to each card by MF_SG_DEV_ROWS with wg */
    int32_t *row_item;
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
    size_t dd_mk_in, dd_mk_out;   /* a draft round's Markov rows: the units' rank-R rows in, vocab terms out */
    /* the activations the dense chains copy as bf16 (graphs/step/stepgraph.h mf_sg_attn_buf_bf16,
     * mf_sg_dense_bf16; with dense cards only, else NULL): on the host a mirror of codes beside the
     * floats (the same layout), packed by the host task that writes the floats and unpacked by the
     * one that first reads them (mf_step_bf16_cols); on each card its copy at dd16_* (the card's
     * copy streams pack and unpack it: mf_dev_bf16_pack, _unpack) */
    uint16_t *ab16[MF_LY_A_N], *xin16, *ys16;
    size_t dd16_xin;   /* the MoE input's (whole: the slots' gathers read it); the others staged (cb.stg_*) */
    /* the heads on cards (sg->heads_any): the layer's key table as the gather leaves it on the host
     * (hk_tab: the ring's hk_nring rows of positions from hk_t0, then the hk_nent entries of the
     * union of the items' selections, hk_map[j] their rows in the card's table, which has the
     * chunk's hk_nchunk KV rows of positions from hk_pos0 between the two), per item its key list
     * (hk_keys, sg->heads_keys apart) and count (hk_nk), the sinks; hk_host 1 when the entries
     * exceed the table's hk_ecap (the q prep tasks then run the host's heads, the card tasks
     * nothing); the cards' copies at dd_hk_* */
    float *hk_tab, *hk_sink;
    float *hk_rope;   /* per item its RoPE table (mf_stepgraph.heads_local, _qlocal: qk_rope_head_dim floats) */
    int32_t *hk_keys, *hk_nk, *hk_map;
    int64_t hk_map_cap, hk_t0, hk_pos0, hk_ring_hi;
    int hk_nring, hk_nchunk, hk_nent, hk_ecap, hk_host;
    size_t dd_hk_tab, dd_hk_keys, dd_hk_nk, dd_hk_sink, dd_hk_rope;
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
    /* the DSpark draft (graphs/step/step_draft.c). A step's shape with features (sg->feats): per item
     * where its features go (NULL: none). A draft round's shape (sg->draft, its units the sequences):
     * per unit the caller's sequence; the pending feature rows of every unit one after another
     * (dfeed_x, n_target x hidden each; unit k's from row dfeed_off[k], dfeed_n[k] of them) and
     * main_proj's outputs of them (dfeed_u); per unit its key table (the context's rows, then the
     * block's: dkeys, (window + block) x head_dim, dnkeys of them) and the Markov logits of its
     * candidate being picked (dmk, vocab each; with dense cards, dmk_in: the rank-R rows their
     * chains copy in, a unit each, per dense card its own: mf_step_draft_mk_rows) */
    float **feat_out;
    mf_step_draft_seq *dseq;
    float *dfeed_x, *dfeed_u, *dkv, *dkeys, *dmk, *dmk_in;   /* dkv: the feed's wkv outputs, per stage dfeed_rows x head_dim */
    int *dfeed_off, *dfeed_n, *dnkeys;
    int dfeed_rows;         /* rows dfeed_x holds */
    void *mem;              /* its buffers; NULL when they are the engine's umem (a bucket's) */
};

/* A dense card's copy of rows [r0, r1) of a weight (FP8 rows from a 32-row tile boundary, or
 * BF16) of dense sublayer `dense` (MF_SG_D_*): m views device memory; w NULL: an unused entry. With
 * the cuBLASLt path (step_dense.c mf_step_lt_layout): w16_ok 1 when its rows dequantize exactly
 * into the card's 16-bit type with w16_shift (mf_dev_w16_plan), at w16_off of its sublayer's
 * scratch (mf_sg_card_bufs.lt_w16_d); 0: it keeps the CUDA cores. */
typedef struct mf_step_dmat {
    const mf_weight *w;
    mf_kern_mat m;
    int64_t r0, r1;
    int8_t dense, w16_ok;
    int16_t w16_shift;
    size_t w16_off;
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
    mf_dev_xcache *xc[MF_DEV_MAX_CARDS];   /* over the backbone's layers and, with the draft, its stages' */
    int dcards;               /* 1: the draft's experts held in xc (mf_step_draft_cards) */
    size_t part_off[6], part_bytes[6];
    uint64_t xslot_bytes;
    int miss_span;            /* 1: the slot mirrors the resident experts' layout (mf_step_xslot_layout) */
    _Atomic int64_t miss_spans;   /* this call's misses copied as one span (mf_step_dev_stats) */
    int dev_graphs;           /* 1: a layer's device FFNs are one captured graph per card */
    mf_step_dev_stats dstat;
    _Atomic int64_t sock_home, sock_cross;   /* this call's (mf_step_dev_stats) */
    _Atomic int64_t dense_home, dense_cross;
    _Atomic int64_t lt_linears, lt_slots, gather_slots;   /* this call's (mf_step_dev_stats) */
    /* the cuBLASLt path: the mode in effect (mf_step_opts.lt; MF_SG_LT_OFF when a card in use has no
     * tensor cores), and per 16-bit type (BF16, FP16) and (layer, expert) the routed experts' plans as
     * step_moe_cards.c finds them (0: not yet; mf_step_lt_xplan) */
    int lt_mode;
    _Atomic int32_t *lt_xplan[2];
    mf_step_fill_stats fill;  /* the warm fill at mf_step_new (mf_step_opts.dev_cache_fill) */
    mf_store *store;         /* its reads issued on this engine's IO lane (the slab registered there) */
    int eg_reads;            /* 1: the store's Engram tables are streamed: gathers are IO tasks */
    int max_items;           /* items per graph run of several sequences (mf_step_opts.max_batch; the store's fit) */
    int max_chunk;           /* positions of one sequence per graph run (a prefill chunk), likewise */
    mf_sched *sched;
    mf_sg_sizes *sz;          /* the model's sizes for the step graphs (from its layout) */
    /* serial shapes (one sequence's items, or any items with hooks set) of n <= MF_STEP_SERIAL_ITEMS */
    mf_step_shape *shapes[MF_STEP_SERIAL_ITEMS + 1];
    /* the serial shape of more than MF_STEP_SERIAL_ITEMS items (a long prefill chunk): one at a time,
     * replaced when another length is asked for (a prompt's shorter last chunk), so that a
     * prompt never holds more than one long chunk's activations */
    mf_step_shape *long_shape;
    /* the graphs of several sequences, per kind (0 parallel: decode tokens alone; 1 mixed: decode
     * tokens and prefill chunks) and bucket (log2 of its items): built on a bucket's first step,
     * then every step of up to its items runs it, its other items dead (mf_stepgraph_set_live) */
    mf_step_shape *bshapes[2][MF_STEP_N_BUCKETS];
    /* the host buffers every bucket's shape uses (mf_step_shape.mem of none of them): laid out for
     * umem_items items, the largest bucket built (grown, and the kept shapes' buffers carved again,
     * when a larger one is), so that a kept bucket costs its graph and cards' buffers only. One
     * graph runs at a time and a run leaves nothing in them for the next, as a shape run twice
     * relies on already. */
    uint8_t *umem;
    size_t umem_bytes;
    int umem_items;
    mf_step_shape *last;
    /* the draft rounds' shapes (opts.draft): dshapes[U] for U sequences */
    mf_step_shape *dshapes[MF_STEP_DRAFT_ITEMS + 1];
    mf_step_build_stats builds;   /* shapes built since mf_step_new (mf_step_builds) */
    mf_step_times times;
    mf_lane_model models[4];   /* mf_step_lane_models: cpu, copy in, card compute, copy out */
    /* dense work on cards (opts dense): cards holding it, cards with lanes (the larger of
     * n_cards and n_dense); each dense card's resident weights (mf_step_dense_weights): one device
     * allocation of dw_bytes, a view per weight it holds, per layer MF_STEP_DW_MAX (the head in
     * row n_layers) */
    int n_dense, n_lane_cards;
    /* 1: every dense card holds all the attention in stage's rows (graphs/step/stepgraph.h
     * mf_sg_in_whole of the largest prefill chunk, at mf_step_dense_setup), so a shape may split
     * the stage by items (mf_sg_in_items) */
    int in_whole;
    int dense_card[MF_DEV_MAX_CARDS];   /* dense card k is device card dense_card[k] */
    uint8_t *dwmem[MF_DEV_MAX_CARDS];
    uint64_t dw_bytes[MF_DEV_MAX_CARDS];
    mf_step_dmat *dmat[MF_DEV_MAX_CARDS];
    char refused[1024];       /* the startup self-check's refusals ("" when none) */
    unsigned refused_mask;    /* cards refused by it */
    mf_profile prof;          /* a copy of the caller's o.profile (o.profile points here when given) */
    int l0, l1;               /* the layers the model loaded (mf_model_layers): a pipeline stage's */
};

/* One copy of a dense sublayer: `rows` rows of n values, ld values apart, from the value at host
 * (its device copy at offset off of the card's buffer, the same layout); with host16 (the value's
 * place in its bf16 mirror) it moves as bf16 (mf_sg_attn_buf_bf16) through the card's codes at
 * off16, rows ld apart, of which cap16 bytes are the copy's (a staging: mf_step_dcopy_staged). */
typedef struct mf_step_dcopy {
    float *host;
    uint16_t *host16;
    size_t off, off16, cap16, n, rows, ld;
} mf_step_dcopy;

static inline mf_kern_mat mf_step_mat(const mf_weight *w)
{
    mf_kern_mat m = {.w = w->data, .scale = w->scale, .n_out = (int)w->rows, .n_in = (int)w->cols};
    m.fmt = w->kind == MF_W_FP4 ? MF_KERN_FP4 : w->kind == MF_W_FP8 ? MF_KERN_FP8 : MF_KERN_BF16;
    return m;
}

/* The row of item i of Engram layer L in the shape's Engram buffers (eg_items per slot). */
static inline size_t mf_step_eg_row(const mf_step_shape *sh, int L, int i)
{
    return (size_t)mf_config_engram_slot(sh->eng->c, L) * (size_t)sh->eg_items + (size_t)i;
}

/* Columns [c0, c1) of item i's row (ld values apart) of activation x packed into its bf16 mirror m
 * (pack 1) or unpacked from it (pack 0): the host's side of a dense chain's bf16 copy; nothing
 * without a mirror (m NULL). Lossless for the values the copies carry (mf_sg_attn_buf_bf16). */
static inline void mf_step_bf16_cols(int pack, float *x, uint16_t *m, int64_t ld, int i, int64_t c0, int64_t c1)
{
    if (!m || c0 >= c1) return;
    size_t at = (size_t)i * (size_t)ld + (size_t)c0;
    if (pack) mf_kern_vec_bf16_pack(x + at, m + at, c1 - c0);
    else mf_kern_vec_bf16_unpack(m + at, x + at, c1 - c0);
}

/* The same for attention buffer b. */
static inline void mf_step_ab_cast(mf_step_shape *sh, int b, int pack, int i, int64_t c0, int64_t c1)
{
    mf_step_bf16_cols(pack, sh->ab[b], sh->ab16[b], sh->ab_ld[b], i, c0, c1);
}

/* Item i's attention buffers (graphs/layers/layers.h MF_LY_A_*: its rows of the shape's ab). */
static inline void mf_step_abuf(const mf_step_shape *sh, int i, float **b)
{
    for (int k = 0; k < MF_LY_A_N; k++) b[k] = sh->ab[k] + (size_t)i * sh->ab_ld[k];
}

/* 1 when slot s is used in this layer (among its micro-batch's first n_used). */
static inline int mf_step_slot_live(const mf_step_shape *sh, int s)
{
    int h = mf_stepgraph_half_of_slot(sh->sg, s);
    return s - sh->sg->half_slot[h] < sh->n_used[h];
}

/* The experts of a slot: the model's (resident), or their place in the store's slab. */
static inline const mf_weight *mf_step_slot_weights(mf_step_shape *sh, int L, int slot)
{
    if (sh->slot_w) return &sh->slot_w[(size_t)slot * 3];
    return &mf_model_layer_at(sh->eng->ly->m, L)->experts[sh->slot_e[slot] * 3];
}

/* Columns [c0, c1) of the vectors (ld floats each) of n_tok items from item i0: host buffer host at
 * device offset off, its bf16 mirror host16 (NULL: none) at off16. */
static inline mf_step_dcopy mf_step_dcopy_cols(float *host, uint16_t *host16, size_t off, size_t off16, int64_t ld,
                                               int64_t c0, int64_t c1, size_t i0, size_t n_tok)
{
    size_t at = i0 * (size_t)ld + (size_t)c0;
    return (mf_step_dcopy){host + at, host16 ? host16 + at : NULL, off + at * sizeof(float), off16 + at * 2, SIZE_MAX,
                           (size_t)(c1 - c0), n_tok, (size_t)ld};
}

/* cp (columns from c0) through the bf16 staging of the card's copy-in (out 0) or copy-out (out 1)
 * stream (graphs/step/stepgraph.h mf_sg_card_bufs.stg_in, stg_out): its rows from the staging's
 * first, which each copy of that stream uses in turn (pack or unpack, then the next copy). */
static inline mf_step_dcopy mf_step_dcopy_staged(const mf_step_shape *sh, mf_step_dcopy cp, int out, int64_t c0)
{
    size_t at = (size_t)c0 * 2, cap = sh->cb.stg_bytes;
    cp.off16 = (out ? sh->cb.stg_out : sh->cb.stg_in) + at;
    cp.cap16 = cap > at ? cap - at : 0;
    return cp;
}

/* The columns of attention buffer b, copied in (out 0) or out (out 1). */
static inline mf_step_dcopy mf_step_dcopy_ab(const mf_step_shape *sh, int b, int64_t c0, int64_t c1, size_t i0,
                                             size_t n_tok, int out)
{
    mf_step_dcopy cp = mf_step_dcopy_cols(sh->ab[b], sh->ab16[b], sh->dd_ab[b], 0, sh->ab_ld[b], c0, c1, i0, n_tok);
    return cp.host16 ? mf_step_dcopy_staged(sh, cp, out, c0) : cp;
}

/* ---- shared between the engine's files ----------------------------------------------------- */

/* step.c: the layer context of the worker running a task (NULL with an error off the CPU lane);
 * with sockets, whether a host row part read its rows on their socket (mf_step_last_dev). */
mf_ly_ctx *mf_step_cx(const mf_step_targ *a, const mf_task_ctx *ctx);
void mf_step_count_socket(mf_step *eng, const mf_task_ctx *ctx, const mf_weight *w, int64_t r0, int64_t r1,
                          int dense);

/* step_shape.c: the shape for a chunk's items (built on first use, kept; a bucket's with the chunk's
 * items live), its release, and what a shape's step graph and card buffers take (the expert
 * caches' sizing reads them too). */
int mf_step_shape_of(mf_step *s, mf_ref_state *const *states, int n, mf_step_shape **out);
void mf_step_shape_free(mf_step_shape *sh);
mf_sg_opts mf_step_sg_opts(const mf_step *eng, int n, int par, int mixed, mf_task_fn *fn_of);
/* step_draft.c: -EINVAL unless the engine can run the model's draft (loaded, resident experts, its
 * top-k and experts within the backbone's, which the shapes' buffers are sized for). */
int mf_step_draft_check(const mf_layers *ly);
/* The draft round's shape of n_seq sequences (built on first use, kept). */
int mf_step_draft_shape(mf_step *s, int n_seq, mf_step_shape **out);
/* Every unit's Markov embedding row of the token before its candidate `cand` (a unit without that
 * candidate: its anchor's, unused) into dense card k's rows of sh->dmk_in, which its Markov chain
 * copies in (each card its own: the chains' copies run at once); returns them. */
float *mf_step_draft_mk_rows(mf_step_shape *sh, int cand, int k);
mf_sg_card_in mf_step_card_in(const mf_step *eng, const mf_stepgraph *sg, int ln);

/* step_attn.c: the index scores and the heads on cards, copies (out 0: in, 1: out) and launches,
 * which the dense tasks of step_dense.c run for MF_SG_D_SCORES and MF_SG_D_HEADS. */
int mf_step_scores_copy(const mf_step_targ *a, mf_dev_stream *q, int out);
int mf_step_scores_launch(const mf_step_targ *a, mf_dev_stream *st);
int mf_step_heads_copy(const mf_step_targ *a, mf_dev_stream *q, int out);
int mf_step_heads_launch(const mf_step_targ *a, mf_dev_stream *st);

/* step_moe_cards.c: the routed experts on cards: the setup (mf_step_new), where the route puts a
 * micro-batch's slots, the layer's cache slots released, a failed run's device task named. */
int mf_step_dev_setup(mf_step *s);
int mf_step_caches_new(mf_step *s);
int mf_step_place(mf_step_shape *sh, int L, int h);
void mf_step_place_pre(mf_step_shape *sh, int L, int h);
void mf_step_dev_release(mf_step_shape *sh, int failed);
/* A call's routed-expert counters (mf_step_last_dev): zeroed at a forward's or a draft round's
 * start (mf_step_dev_begin), the caches' counters over it gathered at its end (step.c). */
void mf_step_dev_begin(mf_step *s);
void mf_step_dev_end(mf_step *s);
void mf_step_pre_release(mf_step_shape *sh, int k, int failed);
/* 1 while a layer's cache slots are pinned (mf_step_dev_fail releases them after a failed run). */
int mf_step_dev_pinned(const mf_step_shape *sh);
int mf_step_dev_fail(mf_step_shape *sh, int rc);

/* step_dense.c: one copy of a dense sublayer enqueued; the dense cards and their resident weights
 * (mf_step_new, mf_step_free). */
int mf_step_dcopy_run(mf_dev_stream *q, uint8_t *db, const mf_step_dcopy *cp, int out);
int mf_step_dense_setup(mf_step *s);
void mf_step_dense_free(mf_step *s);
/* step_dense.c: the cuBLASLt path on the engine's cards (after the dense and routed setups): the
 * mode in effect (mf_step.lt_mode), each dense card's 16-bit layout and plans of the weights it
 * holds (mf_step_dmat), the routed experts' plan tables; freed by mf_step_dense_free. And the
 * scratch of the cuBLASLt calls of shape sh on card slot k of its dense (dense 1) or routed block. */
int mf_step_lt_setup(mf_step *s);
mf_dev_lt_buf mf_step_lt_buf(const mf_step_shape *sh, int k, int dense);

/* Each file of tasks binds the ops it runs (graphs/step/stepgraph.h MF_SG_*) to its task functions
 * in a table of MF_SG_N_OPS entries, NULL for other files' ops; step_shape.c looks an op up in all
 * of them (mf_step_fn_of). */
extern const mf_task_fn mf_step_engram_fn_of[MF_SG_N_OPS];      /* step_engram.c */
extern const mf_task_fn mf_step_hc_fn_of[MF_SG_N_OPS];          /* step_hc.c */
extern const mf_task_fn mf_step_attn_fn_of[MF_SG_N_OPS];        /* step_attn.c */
extern const mf_task_fn mf_step_moe_fn_of[MF_SG_N_OPS];         /* step_moe.c */
extern const mf_task_fn mf_step_moe_cards_fn_of[MF_SG_N_OPS];   /* step_moe_cards.c */
extern const mf_task_fn mf_step_dense_fn_of[MF_SG_N_OPS];       /* step_dense.c */
extern const mf_task_fn mf_step_draft_fn_of[MF_SG_N_OPS];       /* step_draft.c */
extern const mf_task_fn mf_step_net_fn_of[MF_SG_N_OPS];         /* step_net.c */

#endif
