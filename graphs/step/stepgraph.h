/* The step graph: ONE builder for the scheduled engine (graphs/step/step.c) and the simulator
 * (graphs/sim/plan.c). From a config's sizes (the layout, no tensor data), a batch shape and a lane
 * table it emits the mf_graph of one forward step and one record per task: what the task is (op,
 * phase, layer, stage, slot, part, card, items, rows) and the work it does (weight bytes and
 * multiply-adds per kernel family, copy bytes, IO bytes, scalar work). The engine binds its task
 * functions to the records by op; the simulator prices the same records from a hardware profile.
 * Both mark the same noop tasks (mf_stepgraph_mark_noop). Layout of the graph: docs/decode.md. */
#ifndef MF_STEPGRAPH_H
#define MF_STEPGRAPH_H

#include <stdint.h>

#include "device/dev.h"
#include "graphs/layers/layers.h"
#include "graphs/model/config.h"
#include "sched/cost.h"
#include "sched/graph.h"
#include "sched/profile.h"
#include "sched/sched.h"
#include "sched/timeline.h"

#define MF_SG_MAX_ITEMS 512  /* items of a graph of several sequences (a parallel or mixed graph: decode
                              * batches, the continuous batcher's steps; graphs/step/step.h MF_STEP_MAX_ITEMS) */
/* Items of a serial graph (one unit: one sequence's positions, a prefill chunk). The per-item
 * tasks of every graph (collapses, norms, mixes, heads, scores, post, combine; in a parallel or
 * mixed graph the per-sequence ones too) run over item groups of consecutive items: one item each
 * up to MF_SG_MAX_GROUPS items, else MF_SG_MAX_GROUPS groups (mf_stepgraph.group_end), so a long
 * chunk's or a 512-sequence batch's graph has no more tasks than a 128-item one. */
#define MF_SG_MAX_CHUNK 8192
#define MF_SG_MAX_GROUPS 128
#define MF_SG_MAX_PARTS 64   /* row parts of an attention stage */
#define MF_SG_MAX_CARDS MF_DEV_MAX_CARDS
#define MF_SG_EXPERT_PARTS 6 /* a routed expert's parts: w1, w2, w3 codes and scales */

/* What a task does. The engine has one task function per op. The ops marked "item:" run per item
 * group (mf_sg_op_per_item): each item of the record's [i0, i1), one after another, each as a
 * task of that one item would. */
typedef enum mf_sg_op {
    MF_SG_ENGRAM_EMBED,   /* items: hashed table rows, gathered and dequantized (with eg_reads: the
                           * rows the reads staged, put in order and dequantized) */
    MF_SG_ENGRAM_ROWS,    /* rows of the Engram wkv projection, all items */
    MF_SG_ENGRAM_GATE,    /* items: the gated value into the streams */
    MF_SG_ENGRAM_PLAN,    /* eg_reads, items: hashed table rows, the store's reads planned */
    MF_SG_ENGRAM_READ,    /* eg_reads, IO lane: read `read` of the items' gather (as planned) */
    MF_SG_ATTN_PRE,       /* item: columns [r0, r1) of its streams collapsed with the carried pre
                           * (the attention's input before attn_norm; layer -1: the final norm's) */
    MF_SG_ATTN_ROWS,      /* rows of attention linear stage `stage`, all items */
    MF_SG_ATTN_QNORM,     /* item: columns [r0, r1) of its low-rank query normed with its scale */
    MF_SG_ATTN_CORE,      /* items (a group's, or in order a unit's: mf_sg_opts.ordered): the index
                           * query (the rest of the core's prep after MF_SG_ATTN_KV; the select too
                           * on layers without MF_SG_ATTN_SCORE) */
    MF_SG_ATTN_POST,      /* item: columns [r0, r1) of the expand, collapsed with the attention
                           * mix's pre (the MoE input before ffn_norm) */
    MF_SG_GATE_ROWS,      /* rows (experts) of the router's logits, all items */
    MF_SG_ROUTE,          /* top-k, slot table, store batch, placement, noop marks; part p >= 0:
                           * the top-k of items [i0, i1) alone, before the route (part -1), which
                           * then leaves it out (with gather parts and no hooks: sg_router) */
    MF_SG_MOE_DONE,       /* end of the layer's MoE: store batch closed, pins released */
    MF_SG_SLOT_READ,      /* IO lane: read `read` of slot `slot`'s expert into the store */
    MF_SG_SLOT_UP,        /* hidden rows of slot `slot`'s w1/w3 + SwiGLU (host) */
    MF_SG_SLOT_JOIN,      /* slot `slot`'s h quantized (host) */
    MF_SG_SLOT_DOWN,      /* output rows of slot `slot`'s w2 (host) */
    MF_SG_DEV_IN,         /* card `card`: slot's expert (on a miss) and rows copied in */
    MF_SG_DEV_FFN,        /* card `card`: slot's expert FFN */
    MF_SG_DEV_FFN_CARD,   /* card `card`: every slot's FFN of the layer as one device graph */
    MF_SG_DEV_OUT,        /* card `card`: slot's outputs copied out */
    MF_SG_SHARED_UP,      /* hidden rows of the shared expert's w1/w3 */
    MF_SG_SHARED_DOWN,    /* output rows of the shared expert's w2 */
    MF_SG_COMBINE,        /* item: columns [r0, r1) of the fixed-order sum of the experts, expand */
    MF_SG_NORM,           /* item: columns [r0, r1) of the final norm (of its collapse) */
    MF_SG_HEAD,           /* vocabulary rows of the head */
    MF_SG_JOIN,           /* nothing: joins a stage's parts (oa join, shared join, head join) */
    MF_SG_ATTN_MIX,       /* item: rows [r0, r1) of the attention mixes of its streams */
    MF_SG_ATTN_NORM,      /* item: columns [r0, r1) of attn_norm of its collapse */
    MF_SG_ATTN_HEADS,     /* item: the heads of rows [r0, r1) of the attention output: queries
                           * roped, attention over the window and the selection */
    MF_SG_ATTN_RING,      /* items, in order: their window KV into the ring (after the heads; an
                           * item whose sequence has an item W positions on in the graph, W the
                           * sliding window, is left out: that one's KV takes its ring row) */
    MF_SG_FFN_MIX,        /* item: rows [r0, r1) of the ffn mixes of its streams */
    MF_SG_FFN_NORM,       /* item: columns [r0, r1) of ffn_norm of its collapse (the MoE input) */
    MF_SG_ATTN_SCORE,     /* item: part `part` of key_parts of an index layer's scores of its visible
                           * entries (the entries grow with the position: ranges at run time) */
    MF_SG_ATTN_SELECT,    /* items (a group's, or in order a unit's: mf_sg_opts.ordered): an index
                           * layer's candidate mask and top-k */
    MF_SG_DENSE_IN,       /* card `card`: sublayer `dense`'s activations copied in (h2d lane) */
    MF_SG_DENSE,          /* card `card`: sublayer `dense`'s dense work on the card (compute lane) */
    MF_SG_DENSE_OUT,      /* card `card`: sublayer `dense`'s outputs copied out (d2h lane) */
    MF_SG_ATTN_QSCALE,    /* items: the q norm's scale of their low-rank queries (rounded by IN) */
    MF_SG_ATTN_KV,        /* items, in order: window KV (into the ring unless ring_late), compressor
                           * (the core's prep that reads only the IN stage); part 0 the window KV
                           * alone, 1 the compressor alone from the item before each item, 2 both
                           * so (a mixed graph's), -1 both from the state */
    /* the heads on cards (mf_stepgraph.heads_cards[L] > 0): gather -> per item group qprep -> per
     * card MF_SG_DENSE_* of MF_SG_D_HEADS -> per item group opost (none where the outputs stay on
     * the cards: mf_sg_heads_local) */
    MF_SG_ATTN_GATHER,    /* items (the unit's, one sequence): the chunk's key table on the host (the
                           * window rows before the chunk from the ring, the union of the items'
                           * selected compressed entries, each unpacked once) and the sinks */
    MF_SG_ATTN_QPREP,     /* item: its queries rounded and roped (mf_fa_heads_q), its key list */
    MF_SG_ATTN_OPOST,     /* item: the heads' outputs inverse-roped (mf_fa_heads_o) */
    MF_SG_ROUTE_ROWS,     /* part `part` of p_gather of the micro-batch's used slots (in slot order,
                           * equal counts): their rows gathered from the items, the host slots'
                           * rows quantized (with p_gather 1 MF_SG_ROUTE does it, no such task) */
    /* prefetch (mf_stepgraph.prefetch): a layer's routed experts placed and copied in at its start,
     * before its route (a long chunk uses every expert: mf_sg_prefetch_min) */
    MF_SG_MOE_PLACE,      /* layer's experts placed by their expected tokens (mf_sg_place_all), cache
                           * slots taken and pinned, the copy tasks of the host's experts and hits marked noop */
    MF_SG_DEV_PRE,        /* card `card` (h2d lane): expert `part` copied in on a miss (one span or its parts) */
    /* the index scores on cards (mf_stepgraph.scores_cards[L] > 0): keys -> per card and block MF_SG_DENSE_*
     * of MF_SG_D_SCORES -> the select(s) on the host */
    MF_SG_ATTN_KEYS,      /* items (the unit's, one sequence): the index keys of the entries the
                           * last item sees unpacked on the host (mf_ly_cache_get_keys), the items'
                           * visible counts */
    /* a pipeline stage's boundaries (mf_sg_opts.layer_begin, layer_end; lane_net): */
    MF_SG_NET_IN,         /* all items: their boundary (mf_sg_boundary_floats) received from the
                           * stage before and unpacked into their streams, before the first layer */
    MF_SG_NET_OUT,        /* all items: their boundary after the last layer packed and sent to the
                           * stage after (in place of the final norm and head) */
    /* the cuBLASLt path (stepgraph_lt.c): before a layer's dense records that take it, on each card */
    MF_SG_DENSE_DEQ,      /* card `card` (h2d lane): sublayer `dense`'s FP8 weights of layer `layer` that
                           * the card holds (part `part` of a split by rows) dequantized into its
                           * 16-bit scratch (mf_sg_card_bufs.lt_w16) */
    MF_SG_DEV_ROWS,       /* card `card` (h2d lane): the micro-batch's routed rows' items and token
                           * weights copied in (mf_stepgraph.slot_gather), before its slots' copy-ins */
    /* the DSpark draft (mf_sg_opts.draft, feats; graphs/step/stepgraph_draft.c, docs/dspark.md) */
    MF_SG_DRAFT_FEAT,     /* verify graphs (feats): unit's items at a draft target layer, their
                           * features (the streams' mean entering the layer) where asked for */
    MF_SG_DRAFT_FEED,     /* draft graph: part >= 0: rows [r0, r1) of main_proj over every unit's
                           * pending feature rows; part -1: a unit's projected rows normed (main_norm) */
    MF_SG_DRAFT_FEED_KV,  /* draft graph, stage `layer`: part >= 0: rows [r0, r1) of its wkv over every
                           * unit's normed rows; part -1: a unit's rows' window KV into its context ring */
    MF_SG_DRAFT_KV,       /* draft graph: a unit's block positions' window KV of stage `layer` */
    MF_SG_DRAFT_HEADS,    /* draft graph: heads [r0, r1) of a unit's block over its context and block */
    MF_SG_DRAFT_MARKOV,   /* draft graph: rows [r0, r1) of the Markov head's logits of candidate
                           * `cand` of every unit (after its previous candidate's pick) */
    MF_SG_DRAFT_PICK,     /* draft graph: a unit's candidate `cand`: its logits (the head's, plus
                           * the Markov term), their argmax, the confidence head */
    MF_SG_N_OPS
} mf_sg_op;

/* Phases of a step, for reports (graphs/step/step.h names them mf_step_phase). */
enum { MF_SG_PH_ATTN, MF_SG_PH_MOE, MF_SG_PH_ENGRAM, MF_SG_PH_HEAD, MF_SG_PH_OTHER, MF_SG_N_PHASES };

/* Accounting classes: what the phase table leaves out (IO, copies) and the overlap counters. */
typedef enum mf_sg_kind {
    MF_SG_K_OTHER, MF_SG_K_IO, MF_SG_K_EXPERT, MF_SG_K_COPY, MF_SG_K_DEV, MF_SG_K_COPY_OUT,
    MF_SG_K_NET   /* a pipeline's boundary transfers (MF_SG_NET_*) */
} mf_sg_kind;

/* The attention's linear stages (graphs/layers/layers.h MF_LY_A_STAGE_* has the same order), and the
 * core's own linears (the indexer's wk, inside MF_SG_ATTN_KV's compressor). */
enum { MF_SG_ST_IN, MF_SG_ST_QB, MF_SG_ST_OA, MF_SG_ST_OB, MF_SG_ST_CORE, MF_SG_N_STAGES };

/* Dense sublayers on a card (mf_sg_opts.n_dense_cards): what MF_SG_DENSE_IN copies in, MF_SG_DENSE
 * runs, MF_SG_DENSE_OUT copies out. ATTN_IN: the attn_norm output in, the in stage's linears, their
 * outputs out; ATTN_QB: the normed low-rank query in, the qb stage, its outputs out; ATTN_OA: the
 * core's output in, the grouped wo_a (its output stays on the card); ATTN_OB: wo_b, the attention
 * output out; GATE: the MoE input in (the shared expert reads the same copy), the router's gate
 * logits out; SHARED: the shared expert's FFN, its output out; HEAD: the final norm's output in,
 * the head, the logits out; ENGRAM: an Engram layer's embed rows in, the wkv projection, its
 * output (the gate's keys and value) out; MARKOV (a draft round, candidate `cand`): every unit's
 * previous token's rank-R row of the Markov embedding in, the Markov head's rows (bf16), rounded
 * to bf16, their terms out into the engine's Markov logits (the picks stay on the host). */
enum { MF_SG_D_ATTN_IN, MF_SG_D_ATTN_QB, MF_SG_D_ATTN_OA, MF_SG_D_ATTN_OB, MF_SG_D_GATE, MF_SG_D_SHARED,
       MF_SG_D_HEAD, MF_SG_D_ENGRAM, MF_SG_D_MARKOV, MF_SG_N_DENSE };
/* Not a sublayer with weights (MF_SG_N_DENSE counts those): MF_SG_D_HEADS (the attention heads' scores and values, device/dev.h mf_dev_attn_heads): in the
 * prepared queries of the record's heads (rows [r0, r1) of the MF_LY_A_Q rows, into the card's copy
 * of them), the key table (the gather's rows, the chunk's own KV rows), the key lists and the
 * sinks; out the heads' outputs before their inverse RoPE (rows [r0, r1) of MF_LY_A_O). Where the
 * outputs stay on the card (mf_sg_heads_local) in also the items' inverse RoPE tables, the card's
 * work the inverse RoPE too, and no out. */
#define MF_SG_D_HEADS MF_SG_N_DENSE
/* Nor MF_SG_D_SCORES (the indexer's scores, device/dev.h mf_dev_index_scores), over the record's
 * items [i0, i1) (block `block` of card `part` of scores_cards[L]: mf_sg_scores_range of the unit's
 * items): in their index queries and head weights (their MF_LY_A_QI and MF_LY_A_IW rows, into the
 * card's copies), their visible counts and, block 0, the keys table (block 1's items see fewer;
 * a card's only block, where its block 0 has no items, is its block 0);
 * out their scores, doubles, into the items' rows of the engine's score buffer, which the select
 * reads (on the card block 0's rows from the start of its score rows, block 1's at their end). */
#define MF_SG_D_SCORES (MF_SG_N_DENSE + 1)

/* The work of one task: the cost model's (sched/cost.h mf_work), which prices it. Token-scaled
 * terms multiply by `n_tok`, or with slot_tokens set by the slot's tokens of the step (known once
 * routed). copy_bytes: the packed expert on a cache miss; io_bytes: the aligned extents when read
 * (a store miss; streamed tables). */
typedef mf_work mf_sg_work;

/* One task's record. Fields that do not apply are -1 (layer, stage, slot, part, card) or empty
 * ranges. One meaning per field. */
typedef struct mf_sg_task {
    uint8_t op;        /* mf_sg_op */
    uint8_t phase;     /* MF_SG_PH_* */
    uint8_t kind;      /* mf_sg_kind */
    uint8_t slot_tokens;   /* 1: the work's tokens are the slot's tokens of the step */
    int16_t layer;     /* -1: after the last layer (norm, head) */
    int8_t stage;      /* MF_SG_ST_* of MF_SG_ATTN_ROWS */
    int8_t card;       /* device tasks: the card */
    int16_t read;      /* IO tasks: which read of their group (a slot's: its store extents, w1 ..
                        * w3 scale; an Engram gather's: the planned reads in order, codes then
                        * scales of each run of rows) */
    int8_t dense;      /* dense tasks on a card: the sublayer, MF_SG_D_* */
    int8_t half;       /* the micro-batch whose chain the task is in (0 or 1; -1: the head, after
                        * both); with one micro-batch 0 */
    int8_t block;      /* dense tasks on a card: the chain's item block (mf_sg_dense_blocks; 0: the
                        * first, which also copies in what the blocks share, the heads' key table) */
    int8_t cand;       /* the draft's chain tasks: the candidate (block position) they pick */
    int32_t slot;      /* expert slot */
    int32_t part;      /* row part */
    int32_t i0, i1;    /* items [i0, i1) (item tasks; the tasks over a micro-batch's items: its
                        * items, those of the step with one micro-batch) */
    int64_t r0, r1;    /* output rows [r0, r1) of a row part (where the total is the config's;
                        * per-item parts: of the item's output vector, as each op says) */
    int n_tok;         /* tokens the kernels run over (not slot_tokens) */
    /* MF_SG_DENSE of a dense sublayer: the path its FP8 linears take (device/dev.h mf_dev_lin_path):
     * MF_DEV_LIN_AUTO the CUDA cores (warp-per-row, tiled from MF_DEV_LIN_TILED_MIN_TOK tokens),
     * MF_DEV_LIN_CUBLASLT the tensor cores on the weights its MF_SG_DENSE_DEQ dequantized
     * (mf_sg_opts.lt); AUTO for every other record */
    int8_t lin_path;
    /* MF_SG_DEV_IN: 1 when the card gathers the slot's rows from the MoE input it holds
     * (mf_stepgraph.slot_gather): no copy of rows or token weights, the expert's on a miss alone */
    int8_t gather;
    mf_sg_work w;
} mf_sg_task;

/* Sizes of the model from its layout (graphs/model/layout.h): what the records' work and the
 * priorities are computed from. */
typedef struct mf_sg_layer_sizes {
    /* attention linears per stage on the kernels: fp8 (codes + scales) and bf16 bytes,
     * multiply-adds per token, calls; data_bytes: codes only (the priorities' bytes) */
    double st_fp8_bytes[MF_SG_N_STAGES], st_bf16_bytes[MF_SG_N_STAGES];
    double st_fp8_macs[MF_SG_N_STAGES], st_bf16_macs[MF_SG_N_STAGES];
    double st_fp8_calls[MF_SG_N_STAGES], st_bf16_calls[MF_SG_N_STAGES];
    double st_data_bytes[MF_SG_N_STAGES];
    double st_out_rows[MF_SG_N_STAGES];   /* output rows of a stage's linears (oa: wo_a's) */
    double st_fp8_rows[MF_SG_N_STAGES];   /* output rows of its FP8 linears (not oa: wo_a's are all FP8) */
    double oa_fp8_bytes;      /* wo_a's codes + scales: what a card's fp8 kernel reads */
    double gate_bytes;        /* the router's gate weights (bf16) */
    double hc_macs;           /* both hyper-connection projections (fp32, scalar) */
    double attn_ref_macs;     /* wo_a: the reference's scalar dot rows (grouped) */
    double eng_fp8_bytes, eng_data_bytes, eng_bf16_bytes, eng_fp8_macs;   /* Engram wkv; q/k */
    double eng_row_bytes;     /* one table row (codes + scales) */
    double eng_row_code_bytes;   /* its codes (the scales are the rest) */
} mf_sg_layer_sizes;

typedef struct mf_sg_sizes {
    int n_layers;
    mf_sg_layer_sizes *layer;
    double up_bytes, down_bytes;   /* one routed expert: w1 + w3, w2 (codes + scales) */
    double part_bytes[MF_SG_EXPERT_PARTS];   /* w1, w1 scale, w2, w2 scale, w3, w3 scale */
    double xslot_bytes;            /* packed expert on a card: each part 256-aligned */
    double store_slot_bytes;       /* one expert in the host store: each part 4096-aligned */
    double sh_up_bytes, sh_down_bytes, sh_rows;   /* shared expert per layer, its hidden rows */
    double head_bytes;
    /* the DSpark draft (config n_mtp_layers > 0): layer[] holds n_layers + n_mtp_layers entries,
     * stage s at n_layers + s; main_proj's bytes (FP8 codes + scales), the Markov head's (BF16) */
    double feed_fp8_bytes, mk_head_bytes;
} mf_sg_sizes;

/* Sizes of config c (validated) from its layout. 0, -ENOMEM or the layout's error. */
int mf_sg_sizes_new(const mf_config *c, mf_sg_sizes **out);
void mf_sg_sizes_free(mf_sg_sizes *s);

/* The positional scalar work of task t when its items are at position pos, in REF multiply-adds:
 * the work beyond its record's ref_flops that grows with the context (MF_SG_ATTN_HEADS: the
 * window and selected entries of its heads; MF_SG_ATTN_SCORE: its share of the indexer's scores,
 * part `part` of p_key (mf_stepgraph_key_parts); MF_SG_ATTN_SELECT: the top-k's sort); 0 for the
 * other ops. */
double mf_sg_pos_flops(const mf_config *c, const mf_sg_task *t, int p_key, int64_t pos);
/* 1 for the records of the index scores on cards (MF_SG_ATTN_KEYS, MF_SG_D_SCORES), whose
 * positional work and copies depend on their items' positions together (the key table is the last
 * item's visible entries): mf_sg_scores_pos prices them, not mf_sg_pos_flops (0 for them). */
int mf_sg_scores_task(const mf_sg_task *t);
/* Their positional work and copy bytes when their items are at positions pos0 + k * step (k < the
 * items; step 1 a prefill chunk, 0 decode): *flops the keys' unpacking (MF_SG_ATTN_KEYS, REF) or
 * the card's scores (MF_SG_DENSE: the dots' multiply-adds and the double sums at the card's REF
 * rate), *bytes the key table in (MF_SG_DENSE_IN: the entries the last item sees) or the
 * scores out (MF_SG_DENSE_OUT: as many per item, doubles). */
void mf_sg_scores_pos(const mf_config *c, const mf_sg_task *t, int64_t pos0, int step, double *flops, double *bytes);

/* The op's short name (MF_SG_ATTN_CORE: "attn_core"), for reports (`moeflow sim --json`'s "ops"). */
const char *mf_sg_op_name(int op);

/* 1 for the per-item ops (the "item:" ones of mf_sg_op), whose records cover an item group. */
int mf_sg_op_per_item(int op);

/* 1 when layer L's index scores run as MF_SG_ATTN_SCORE parts and MF_SG_ATTN_SELECT (index-source
 * layers with compression); 0 when the core's prep selects (nothing to score). */
int mf_sg_layer_scored(const mf_config *c, int L);

/* Part p of `parts` of n_rows rows (chunks rounded up to 16 rows: the last parts may be empty). */
void mf_sg_rows(int64_t n_rows, int parts, int p, int64_t *r0, int64_t *r1);
/* The one rule for which rows a host row part computes with n_sockets sockets (the memory rule is
 * sched/sched.h mf_topo_rows: socket k holds rows mf_topo_rows(rows, n_sockets, k) of every matrix
 * the host computes in row parts, graphs/model/model.h mf_model_split_weights, host/store.h). Row
 * part p of `parts` of a stage of n_lin linears (rows[l] output rows each; at most
 * MF_SG_MAX_STAGE_LIN) is socket k = p / (parts / n_sockets)'s: socket k's shares of the linears
 * taken one after another and split by mf_sg_rows in parts / n_sockets; r0[l], r1[l] get linear l's
 * rows (possibly empty). Returns k. parts is a multiple of n_sockets (mf_sg_parts makes the row part
 * counts so). n_sockets <= 1: the linears' rows one after another split by mf_sg_rows. */
#define MF_SG_MAX_STAGE_LIN 8
int mf_sg_stage_rows(const int64_t *rows, int n_lin, int parts, int n_sockets, int p, int64_t *r0, int64_t *r1);
/* The same for one matrix of n_rows rows (a routed expert's, the gate's, the head's, ...). */
int mf_sg_expert_rows(int64_t n_rows, int parts, int n_sockets, int p, int64_t *r0, int64_t *r1);

/* What a step decides that a record's price depends on: the simulator's draws and cache state, or
 * the builder's expectations for the priorities. */
typedef struct mf_sg_step_cost {
    int slot_tokens;    /* records with slot_tokens: the slot's tokens this step */
    int n_head;         /* MF_SG_HEAD: the items whose logits it computes */
    int dev_miss;       /* MF_SG_DEV_IN: the slot's expert is copied in (a miss of the card's cache) */
    double pos_flops;   /* the task's positional scalar work (mf_sg_pos_flops) */
    double pos_bytes;   /* the task's positional copy bytes (mf_sg_scores_pos: MF_SG_D_SCORES) */
    int ffn_lt;         /* MF_SG_DEV_FFN: the slot takes the cuBLASLt path (mf_sg_ffn_lt) */
} mf_sg_step_cost;

/* Task t's time on its lane's side (the host's kernels and scalar code, a card's, a copy, a disk
 * read) priced by m (sched/cost.h) from its record and the step's state s, without the executor's
 * cost per task (docs/sim.md "Cost formulas"). MF_SG_SLOT_READ: its extent read (a store miss);
 * MF_SG_DEV_FFN_CARD: 0 (its record has no work: the card's slots' mf_sg_expert_work). */
double mf_sg_task_ns(const mf_sg_task *t, const mf_cost_model *m, const mf_sg_step_cost *s);

/* One routed expert's FFN as one kernel on a card: w1 + w3 + w2 bytes, 3 H I multiply-adds per
 * token, one call (what a MF_SG_DEV_FFN record holds; a card's FFN graph runs one per slot). */
void mf_sg_expert_work(const mf_config *c, const mf_sg_sizes *sz, mf_work *w);

/* A shape and its lanes. */
typedef struct mf_sg_opts {
    const mf_config *c;
    const mf_sg_sizes *sz;
    int n;              /* items, 1..MF_SG_MAX_ITEMS (serial, one unit: 1..MF_SG_MAX_CHUNK) */
    /* 1: items of distinct sequences (a decode batch): the per-sequence tasks (kv, core, select,
     * Engram embed and gate) run per item group, each its items' sequences one after another, the
     * window KV into the ring in the kv task. 0 with mixed 0: the items of one sequence (serial) */
    int par;
    /* 1 (par 0): a step whose items' sequences are known only at run time (mf_stepgraph_set_live,
     * the engine's items): any composition of n items whose sequences' items are consecutive
     * (decode tokens and prefill chunks: the continuous batcher's steps) runs this one graph. Its
     * per-sequence tasks run per item group as in a parallel graph, the compressor from the item
     * before each item (mf_sg_task.part 2 of MF_SG_ATTN_KV), all before the cores (a kv join); the
     * window KV goes into the ring after every head of the layer (MF_SG_ATTN_RING per item group,
     * after the oa join); one micro-batch. */
    int mixed;
    /* 1: the core's prep (MF_SG_ATTN_CORE) and the select (MF_SG_ATTN_SELECT) are one task per
     * unit, each running its items in order (the engine with layer hooks set: they are called in
     * item order on one thread); 0: one per item group, so the items of a long unit (a prefill
     * chunk) spread over the workers, each group's heads after its own select */
    int ordered;
    int n_threads;      /* CPU workers: the row splits */
    int n_cards;        /* cards with device lanes (0: host only) */
    int dev_graphs;     /* 1: a layer's FFNs on a card are one task (MF_SG_DEV_FFN_CARD) */
    /* cards the dense work is placed on (0: the host): the attention linears, router gate and
     * shared expert of layer L on card mf_sg_dense_card(c, n_dense_cards, L), the head on the
     * last layer's card, each sublayer as copy in -> card work -> copy out on that card's lanes
     * (MF_SG_DENSE_*); the lanes must have n_dense_cards cards (mf_sg_lanes_init's n_cards the
     * larger of n_cards and n_dense_cards) */
    int n_dense_cards;
    /* mf_sg_dense_split: how the dense work is spread over the n_dense_cards cards: by layer
     * ranges (MF_SG_SPLIT_LAYERS, 0) or by output rows across all of them (MF_SG_SPLIT_ROWS:
     * mf_sg_dense_rows) */
    int dense_split;
    /* items a dense chain's item block holds at least (mf_sg_dense_blocks; 0: MF_SG_DENSE_BLOCK) */
    int dense_block;
    /* mf_sg_in_mode: with MF_SG_SPLIT_ROWS, how the attention's in stage is spread over the dense
     * cards (mf_sg_in_items); in_whole: 1 when every dense card holds all its rows (mf_sg_in_whole
     * of the engine's largest prefill chunk: the engine's, the simulator's choice) */
    int in_split, in_whole;
    int store;          /* 1: routed experts are read through a store (IO tasks per slot) */
    /* host->card copies of a card cache miss's packed expert: 1 when its parts lie in host memory
     * as they lie in the card's slot, one span (the engine's resident experts:
     * step_moe_cards.c mf_step_xslot_layout); 0: one copy per part (MF_SG_EXPERT_PARTS: a store's slots) */
    int miss_copies;
    int read_window;    /* slots whose reads are in flight (0: 2, < 0: all) */
    int eg_reads;       /* 1: Engram tables are gathered by reads on the IO lane (streamed tables):
                         * per item task a plan task, its reads (IO tasks) and the embed task */
    const mf_lane_desc *lanes;   /* lane 0 the CPU lane, lane_io the IO lane (store), card c's */
    int n_lanes, lane_io, lane_dev0;   /* three lanes at lane_dev0 + 3c (in, compute, out) */
    const mf_task_fn *fn_of;     /* per op: the engine's task functions; NULL: none (simulator) */
    /* 1: the engine's --exact path, which keeps the module's scalar math (graphs/layers/): the
     * grouped wo_a, the heads' scores and values, the index scores and the mixes sum in double,
     * priced as scalar work at the REF rate; 0: the default path, graphs/step/fast_attn.h (wo_a
     * on the FP8 kernels, the rest as vector code at the profile's host_vec rate), as the
     * simulator prices it */
    int exact;
    /* mf_sg_heads_mode: where the heads' scores and values of a graph of one unit (a prefill
     * chunk; batch-1 decode) run when the dense work is on cards (n_dense_cards > 0, exact 0):
     * MF_SG_HEADS_COST (0) per layer the cheapest of the host, the layer's dense card and all
     * the dense cards (heads split evenly) by the cost model on `profile` (mf_sg_heads_choice),
     * MF_SG_HEADS_CARDS all the dense cards wherever they can (tests), MF_SG_HEADS_HOST the host */
    int heads;
    /* the machine the priorities are priced on (every task's cost: its record's price, sched/cost.h);
     * NULL: the built-in machine (mf_cost_default_profile) */
    const mf_profile *profile;
    /* mf_sg_lt_mode: where the cards' tensor cores take work through cuBLASLt (stepgraph_lt.c):
     * MF_SG_LT_COST (0) where the cost model on `profile` prices it below the CUDA cores (never
     * without a tensor-core rate: the built-in machine), MF_SG_LT_ON wherever it applies (tests),
     * MF_SG_LT_DENSE the dense linears wherever they can and the routed experts never, MF_SG_LT_OFF
     * nowhere */
    int lt;
    /* 2: two micro-batches in flight: the items split in two halves (at the unit boundary that
     * makes them the most equal in tokens; one half when there is one unit), each with its own
     * chain per layer (Engram, attention, router, its slots, shared expert, combine), so that one
     * half's MoE runs beside the other's attention; the halves' MoEs of a layer run in order
     * (half 1's route after half 0's MoE done, half 0's route of the next layer after half 1's
     * MoE done: one store batch and one set of card pins at a time). 0 or 1: one. */
    int micro;
    /* the experts' prefetch (mf_stepgraph.prefetch) of a serial graph of one micro-batch with cards
     * for the routed experts and no store: 0 from mf_sg_prefetch_min(c) positions, > 0 from that
     * many, < 0 never */
    int prefetch_min;
    /* > 1: one CPU lane per socket, socket k's at lane_sock[k] (mf_sg_lanes_sockets). The host
     * tasks that read no weights and are one item's or one of several parts (attention head
     * groups, index score parts, q norm parts, an item's mixes, norms and combines: activations
     * and KV, no home of their own) and the Engram gate (its q and k weights in a worker's cache
     * over its items) go to socket (item + part) mod n_sockets's lane;
     * every row part of a matrix the host keeps (a routed expert's, an attention stage's, the
     * Engram wkv's, the router gate's, the shared expert's, the head's) goes to the lane of the
     * socket whose share of the rows it computes (mf_sg_stage_rows, mf_sg_expert_rows: the part
     * counts multiples of n_sockets); every other host task stays on lane 0 (socket 0's). 0 or 1:
     * none. */
    int n_sockets;
    const int *lane_sock;
    /* The DSpark draft (docs/dspark.md). draft 1: the draft round's graph instead of a step's: its
     * n items are n_units (n_units, unit_end: each a sequence's block of dspark_block_size
     * positions) through the draft stages (layers n_layers .. n_layers + n_mtp_layers - 1: per unit
     * the pending features' feed, then per stage the attention (its core: the block's KV and the
     * heads over the context ring and the block) and the MoE of the draft's experts), the final
     * norm, the target's head over every item and per unit the greedy chain; the routed experts on
     * the host (no cards for them, no store, one micro-batch), the dense work on n_dense_cards as
     * the steps' (the stages after the last layer: its card); at most MF_SG_MAX_GROUPS items (one
     * per item group), never a pipeline stage. feats 1 (a step's graph): per unit (a serial graph's
     * one, a parallel or mixed graph's item groups) a task at each draft target layer handing out
     * the items' features (MF_SG_DRAFT_FEAT; over dead items noop and cut as any task:
     * mf_stepgraph_set_live). 0: neither. */
    int draft, feats;
    /* the draft round's units (draft 1 only): unit k items [unit_end[k - 1], unit_end[k])
     * (unit_end[-1] = 0), at most MF_SG_MAX_GROUPS of them; a step's graph takes its units from par
     * and mixed */
    int n_units;
    const int *unit_end;
    /* A pipeline stage (graphs/pipe/pipe.h): only layers [layer_begin, layer_end) (both 0: every
     * layer, the final norm and head after them). layer_begin > 0: every unit's first layer
     * waits for a MF_SG_NET_IN task; layer_end < n_layers: a MF_SG_NET_OUT task after every unit's
     * last layer instead of the head. Both on lane lane_net (mf_sg_lanes_net). Must be cuts
     * (graphs/model/config.h mf_config_cut_ok). */
    int layer_begin, layer_end;
    int lane_net;
} mf_sg_opts;

typedef struct mf_stepgraph {
    mf_graph *g;                  /* finalized; args NULL except the IO tasks' (an empty read) */
    mf_sg_task *task;             /* per task id */
    int n_tasks;
    int n, par, mixed, n_slots;   /* items, parallel, mixed (mf_sg_opts), expert slots (the halves' together) */
    int n_layers;
    /* the items that run (mf_stepgraph_set_live; n when built): the records of the tasks over items
     * [n_live, n) are marked noop and their item ranges emptied, those over items on both sides cut
     * at n_live (their i1, and n_tok where it counts the items); live_i1[t] keeps task t's full i1
     * (-1: no items), live_tok[t] 1 where its n_tok counts its items */
    int n_live;
    int32_t *live_i1;
    uint8_t *live_tok;
    /* micro-batches (1 or 2): half h has items [half_end[h - 1], half_end[h]) (half_end[-1] = 0),
     * units [half_unit[h], half_unit[h + 1]), slots [half_slot[h], half_slot[h + 1]) (each half
     * min(its items * top_k, experts); the slot table of a half is its own) */
    int n_halves;
    int half_end[2], half_unit[3], half_slot[3];
    /* the tasks of the per-sequence ops (kv, core, select, ring, Engram embed and gate, the joins
     * between layers): unit k over items [unit_end[k-1], unit_end[k]); a serial graph's one unit,
     * a parallel or mixed graph's item groups */
    int n_units;
    int unit_end[MF_SG_MAX_GROUPS];
    /* the per-item tasks' item groups: group g holds items [group_end[g - 1], group_end[g])
     * (group_end[-1] = 0); one item each when n <= MF_SG_MAX_GROUPS, else MF_SG_MAX_GROUPS groups
     * of n / MF_SG_MAX_GROUPS items or one more (a serial graph: its one unit holds them all) */
    int n_groups;
    int group_end[MF_SG_MAX_GROUPS];
    int p_exp, p_sh, p_head, p_attn;   /* row parts per expert, shared expert, head, stage */
    /* the Engram wkv (MF_SG_ENGRAM_ROWS): a micro-batch's items in blocks of eg_block (whole passes
     * of the host kernel, host/kernels.h MF_KERN_TOK_PASS: the same bits as one call), each block
     * in p_eg row parts (4 p_attn per pass of the largest block), so that the parts stay small enough
     * to fill the workers the layer chain leaves idle without holding its next tasks back */
    int eg_block, p_eg;
    int p_gather;                 /* parts of a route's row gather (MF_SG_ROUTE_ROWS; 1: in the route) */
    int route_topk;               /* 1: a route's top-k in p_gather item ranges before it (MF_SG_ROUTE's
                                   * parts; with gather parts and no hooks: o->ordered 0) */
    /* per item: column parts of the hyper-connection tasks (collapse, norms, expand, combine),
     * row parts of each mix, attention head groups (of ah_heads heads); q norm column parts */
    int p_hc, p_mix, p_ah, ah_heads, p_qn, p_key;   /* p_key: index score parts per item, at least */
    /* item groups per mix task (each mix's row parts over a block of them; 1: per group): a parallel
     * or mixed graph of more than MF_FA_MIX_ITEMS (graphs/step/fast_attn.h) items in blocks of up to
     * that many, whole rows (p_mix 1) */
    int mix_groups;
    /* index score parts of item group g's items (MF_SG_ATTN_SCORE part q of key_parts[g]): p_key,
     * or in a unit of several groups more for the groups whose items see more entries (their
     * offsets in the unit), SG_KEY_WAVES waves of the workers over the unit; at most MF_SG_MAX_PARTS */
    int key_parts[MF_SG_MAX_GROUPS];
    int ring_late;                /* 1: the window KV goes into the ring after the heads (items of
                                   * one sequence in one graph: MF_SG_ATTN_RING), else in the prep */
    int n_cards, dev_graphs, n_io_parts;
    int n_dense_cards;            /* as mf_sg_opts: 0 dense work on the host */
    int dense_split;              /* as mf_sg_opts */
    int mk_parts;                 /* a draft round's Markov rows: the cards they run on (mf_sg_markov_parts) */
    int in_split, in_whole;       /* as mf_sg_opts */
    /* per layer: 1 when its in stage's chain is split by items over the dense cards (mf_sg_in_items) */
    int8_t in_items[MF_CONFIG_MAX_LAYERS];
    int dense_block;              /* as mf_sg_opts (0 replaced by MF_SG_DENSE_BLOCK) */
    /* per layer: 0 its heads on the host (MF_SG_ATTN_HEADS), else the cards its heads' scores and
     * values run on (1: the layer's dense card; n_dense_cards: every card, the heads split by
     * mf_sg_heads_range); heads_keys: the most keys of an item (window + top-k), the stride of the
     * key lists; heads_any: some layer's heads are on cards */
    int8_t heads_cards[MF_CONFIG_MAX_LAYERS];
    int heads_keys, heads_any;
    /* per layer: 1 when its heads' outputs stay on their cards as the input of each card's own wo_a
     * rows (mf_sg_heads_local), the inverse RoPE on the card; heads_local_any: some layer's do */
    int8_t heads_local[MF_CONFIG_MAX_LAYERS];
    int heads_local_any;
    /* per layer: 1 when its heads read their queries where qb left them on their cards
     * (mf_sg_heads_qlocal), the q prep's rounding and RoPE on the card; heads_qlocal_any: some
     * layer's do */
    int8_t heads_qlocal[MF_CONFIG_MAX_LAYERS];
    int heads_qlocal_any;
    /* per layer: 0 its index scores on the host (MF_SG_ATTN_SCORE parts), else the cards they run
     * on (mf_sg_scores_choice); scores_any: some layer's are */
    int8_t scores_cards[MF_CONFIG_MAX_LAYERS];
    int scores_any;
    /* wo_a's outputs exchanged between the cards for wo_b (mf_sg_oa_exchange): oa_x 1 when wo_a and
     * wo_b are split by rows over the same cards; oa_kept[k] 1 when card k's wo_b copy-in leaves out
     * the wo_a rows its own oa made, which stay on it (mf_sg_ob_in_cols) */
    int oa_x;
    int8_t oa_kept[MF_SG_MAX_CARDS];
    /* per layer and slot, the tasks that have nothing to do unless the slot runs on the host
     * (ups, downs, join) or on card c (in, ffn, out): slot_tid[(L * n_slots + s) * tid_per_slot
     * + k], k < 2 p_exp + 1 host, then 3 per card; -1 where absent */
    mf_task_id *slot_tid;
    int tid_per_slot;
    mf_task_id *card_ffn_tid;     /* dev_graphs: per layer, half and card its FFN graph task,
                                   * card_ffn_tid[(L * n_halves + h) * n_cards + c] */
    /* eg_reads: per Engram slot (graphs/model/config.h mf_config_engram_slot) and unit k its
     * reads, eg_read_tid[(slot * n_units + k) * eg_reads_per_unit + r]: unit k's items times 2
     * (codes, scales) times the rows of an item, the most its gather can need; the stride is the
     * largest unit's, a smaller unit's other entries -1 */
    mf_task_id *eg_read_tid;
    int eg_reads_per_unit;
    /* 1 (mf_sg_opts.prefetch_min): every layer's experts placed before the layer's attention
     * (MF_SG_MOE_PLACE, after the previous layer's route: two layers' pins at a time) and copied
     * in by MF_SG_DEV_PRE tasks while the previous layer's MoE and its attention run; the slots'
     * copy-ins then copy only their rows, after their card's copies (a join per card).
     * pre_tid[L * experts + e]: expert e's copy task, on its owner card's h2d lane
     * (mf_dev_xcache_owner); pre_ahead_ns[L]: how long the links have before the layer's route
     * by the priorities' prices, pre_moe_host_ns[L]: the host work of the layer's MoE window
     * other than the routed experts' (the rows' gather, the combine), by the same prices
     * (mf_sg_place_ahead) */
    int prefetch, pre_experts;
    mf_task_id *pre_tid;
    double pre_ahead_ns[MF_CONFIG_MAX_LAYERS], pre_moe_host_ns[MF_CONFIG_MAX_LAYERS];
    /* dense cards: per micro-batch, layer and card the price of the shared expert's work there (the
     * graph's costs of its MF_SG_DENSE tasks), which the card runs beside that layer's routed
     * experts (mf_sg_place_shared) */
    double shared_ns[2][MF_CONFIG_MAX_LAYERS][MF_SG_MAX_CARDS];
    /* the layers the graph runs, [layer0, layer1): the backbone's, or with draft the draft stages'
     * (the per-layer tables above are indexed by the layer, layer1 of them) */
    int draft, feats, layer0, layer1;
    /* the cuBLASLt path (stepgraph_lt.c): lt_w16[d] the bytes of a card's 16-bit scratch for one
     * layer's sublayer d (the most any card holds of any layer's FP8 weights of d, each matrix
     * 256-aligned; 0 where no record of d takes the path), lt_x16 the activations' cast of the
     * largest such call (device/dev.h mf_dev_lt_x16_bytes); lt_ffn 1 when a routed expert's FFN on
     * a card may take it (mf_sg_ffn_lt at the most tokens a slot can have), in calls of at most
     * lt_ffn_tok tokens */
    size_t lt_w16[MF_SG_N_DENSE], lt_x16;
    int lt_ffn, lt_ffn_tok;
    /* 1 (mf_sg_slot_gather) when every card with routed experts holds the MoE input as bf16 (the
     * router gate split by rows over the dense cards, each card's MF_SG_DENSE_IN of it): a
     * layer's rows then do not cross PCIe per slot; per micro-batch and card one MF_SG_DEV_ROWS
     * copies the route's row -> item table and token weights, and each slot's copy-in gathers
     * its rows on the card (device/dev.h mf_dev_bf16_gather) */
    int slot_gather;
} mf_stepgraph;

/* The engine's lanes (the simulator's graph has the same; its own lane options go to
 * mf_sim_opts): lane 0 the CPU lane (n_threads workers, models[0]); with a store, lane 1 the IO
 * lane (io_uring, depth 64); then per card c three lanes at lane_dev0 + 3c, "devC.h2d",
 * "devC.compute", "devC.d2h" (concurrency 4, models[1..3]: mf_step_lane_models). */
#define MF_SG_MAX_SOCKETS MF_TOPO_MAX_SOCKETS
#define MF_SG_MAX_LANES (2 + 3 * MF_SG_MAX_CARDS + MF_SG_MAX_SOCKETS)
typedef struct mf_sg_lanes {
    mf_lane_desc lane[MF_SG_MAX_LANES];
    char names[3 * MF_SG_MAX_CARDS + MF_SG_MAX_SOCKETS][16];
    int n_lanes, lane_io, lane_dev0;
    int lane_net;             /* a pipeline stage's boundary lane (mf_sg_lanes_net), -1 */
    /* sockets (mf_sg_lanes_sockets; 1 by default): socket k's CPU lane lane_sock[k] (socket 0's
     * is lane 0, the others after the cards' lanes); per lane its socket (-1 not a CPU lane) and
     * the engine's number of its first worker (workers numbered across the CPU lanes) */
    int n_sockets;
    int lane_sock[MF_SG_MAX_SOCKETS];
    int8_t sock_of_lane[MF_SG_MAX_LANES];
    int cpu_base[MF_SG_MAX_LANES];
} mf_sg_lanes;

void mf_sg_lanes_init(mf_sg_lanes *l, const mf_lane_model models[4], int n_threads, int store, int n_cards);
/* One CPU lane per socket instead of one over the machine (after mf_sg_lanes_init): socket k gets
 * threads[k] of the workers (they sum to the n_threads given to init) on NUMA node numa[k]
 * (mf_topo_sockets numa; -1: any core), named "cpuK"; lane 0 stays socket 0's. A routed expert's
 * row parts are built on the lanes of the sockets holding their rows (mf_sg_expert_rows); the
 * other host tasks as mf_sg_opts.n_sockets says. n_sockets 1 leaves l as it is. 0 or -EINVAL. */
int mf_sg_lanes_sockets(mf_sg_lanes *l, int n_sockets, const int *threads, const int *numa);

/* A pipeline stage's boundary lane, after the others (l->lane_net): a CPU-kind lane of one
 * thread, "net", that runs the MF_SG_NET_* tasks (their transfers wait there, beside the compute
 * lanes' work). */
void mf_sg_lanes_net(mf_sg_lanes *l);

/* Floats of one item's boundary between two pipeline stages: its residual streams (hc_mult x
 * hidden_size) and the mix carried to the next sublayer (hc_mult), in that order (what
 * MF_SG_NET_* move; 4 x this many bytes). */
int64_t mf_sg_boundary_floats(const mf_config *c);

/* Card k's three lanes run on device card card_of[k] (k < n; default: k). */
void mf_sg_lanes_map(mf_sg_lanes *l, const int *card_of, int n);

/* The card that holds layer L's dense work when it is placed on n_cards cards (L -1: the head,
 * on the last layer's card). Layers go in contiguous ranges, one per card, whose first layers are
 * layer 0 or KV-source layers (config kv_source_layer_ids), so that a layer writing compressed KV
 * and the layers reading it share a card; the ranges minimize the largest range's layer count
 * (first such choice). With fewer candidate starts than cards, the last cards hold nothing. */
int mf_sg_dense_card(const mf_config *c, int n_cards, int L);
/* The same over a pipeline stage's layers [l0, l1) (mf_sg_opts.layer_begin/_end): ranges beginning at
 * l0 or a KV source, L outside the range (-1: the head) on the range's last layer's card. */
int mf_sg_dense_card_in(const mf_config *c, int n_cards, int l0, int l1, int L);

/* Where the heads' scores and values run (mf_sg_opts.heads). */
typedef enum mf_sg_heads_mode { MF_SG_HEADS_COST = 0, MF_SG_HEADS_CARDS, MF_SG_HEADS_HOST } mf_sg_heads_mode;
/* The cards layer L's heads run on in a graph of o's shape (mf_stepgraph.heads_cards): 0 (the
 * host) unless o's graph is one unit with dense cards, o->exact 0, the head fits the card op
 * (head_dim a multiple of 16, at most MF_DEV_ATTN_MAX_D; the fast heads' rope) and an item's keys
 * (window + top-k) at most MF_DEV_ATTN_MAX_KEYS; then, by o->heads, the cheaper of the host's heads
 * tasks over the workers and the card chains (the gather, the host's q and o work over the
 * workers, the slowest card's copy in, attention and copy out) priced at the steady state (the
 * window full, top-k entries per item) on o->profile (NULL: the built-in machine), for 1 card and
 * for all of them; the records' own prices (mf_sg_task_ns), so the builder prices what it chose. */
int mf_sg_heads_choice(const mf_sg_opts *o, int L);
/* The cards layer L's index scores run on (mf_stepgraph.scores_cards): where its heads run on cards
 * (heads_cards, mf_sg_heads_choice) and it is scored (mf_sg_layer_scored) with an indexer the card op
 * takes (index_n_heads x index_head_dim at most MF_DEV_ISCORE_MAX_QD), every dense card (the
 * unit's items split by mf_sg_scores_range); else 0 (the host's score parts). */
int mf_sg_scores_choice(const mf_sg_opts *o, int L, int heads_cards);
/* 1 when heads on `parts` cards (mf_stepgraph.heads_cards) leave each card's outputs on it as the
 * input of its own wo_a rows: wo_a runs on as many cards (mf_sg_dense_parts of n_dense_cards under
 * split; one card: both on the layer's dense card) and, split, each card's wo_a rows
 * (mf_sg_dense_rows) are the groups of exactly its heads (mf_sg_heads_range); else 0. Then the
 * card's heads op does the inverse RoPE (device/dev.h mf_dev_attn.rope_dim, the table of each
 * item's cosines and sines copied in with the queries), no heads out, no o post on the host, no oa
 * copy in: the oa work waits for the heads of its items on its card. The host's fallback heads
 * (graphs/step/step_impl.h hk_host) then copy the card's slice of their outputs in with the heads'
 * copy-in. */
int mf_sg_heads_local(const mf_config *c, int n_dense_cards, int split, int parts);
/* 1 when heads on `parts` cards (mf_stepgraph.heads_cards) of layer L read their queries where qb
 * left them on their cards: qb runs on as many cards (mf_sg_dense_parts of n_dense_cards under
 * split; one card: both on the layer's dense card), its rows are the queries alone (a layer not
 * scored: no indexer's queries after them) and, split, each card's qb rows (mf_sg_dense_rows) are
 * exactly its heads' queries (mf_sg_heads_range); else 0. Then qb's copy-outs carry nothing (each
 * waits for the gather and, where the host's fallback heads run, graphs/step/step_impl.h hk_host,
 * copies the card's queries out for them), the q prep only the key list and each item's RoPE
 * table, the heads' copy-in no queries, and the card's heads op rounds and ropes the queries
 * itself (device/dev.h mf_dev_attn.q_rope_dim) as the host's q prep did (mf_fa_heads_q). */
int mf_sg_heads_qlocal(const mf_config *c, int L, int n_dense_cards, int split, int parts);
/* Card k of `parts`' heads [*h0, *h1) of n_heads: equal shares, the first ones a head more. */
void mf_sg_heads_range(int n_heads, int parts, int k, int *h0, int *h1);
/* Block q (0 or 1) of card k of `parts`' items [*i0, *i1) of a unit's n index-scored items: of
 * 2 parts equal blocks (mf_sg_heads_range) block 2 parts - 1 - k (q 0) and block k (q 1), so each
 * card's share of the scores, whose work grows by the same amount from one item to the next, is
 * the same at any position of the chunk (a causal triangle split by items in parts ran 1 : 3 : 5 : 7
 * on 4 cards), and each card's later block runs first (its keys the most: its copy-in the table). */
void mf_sg_scores_range(int n, int parts, int k, int q, int *i0, int *i1);

/* How dense work is spread over its cards (mf_sg_opts.dense_split). */
typedef enum mf_sg_dense_split { MF_SG_SPLIT_LAYERS = 0, MF_SG_SPLIT_ROWS } mf_sg_dense_split;

/* With MF_SG_SPLIT_ROWS, every dense sublayer but the shared expert (whose up and down
 * projections stay together on mf_sg_dense_card's card: it runs beside the routed experts, off
 * the batch-1 critical path, and a split would add a round trip through the host between them)
 * runs as one task chain per card, the record's `part` being the card; a sublayer's output rows
 * are those of its linears one after another (mf_ly_attn_linears' order; the gate's experts, the
 * head's vocabulary). wo_a and wo_b are split alike: wo_a's rows go out to the host and the
 * other cards' come back in to every card for wo_b (mf_sg_oa_exchange; one extra copy each way,
 * cheaper than wo_a and wo_b whole on one card at the seed host's figures: docs/measurements.md
 * part 1); a card's wo_a copies in only the heads' output slices of the groups its rows touch. */
int mf_sg_dense_parts(int n_dense_cards, int split, int dense);
/* The attention's in stage (MF_SG_D_ATTN_IN: its input, the attn_norm's output, is the widest copy
 * in of a prefill chunk's chains, the whole of it on every card's link when split by rows) under
 * MF_SG_SPLIT_ROWS over several cards: MF_SG_IN_COST (0) each layer's chain of a graph is split by
 * rows or by items (mf_sg_in_items), whichever the cost model prices lower, where every card holds
 * all the stage's rows (mf_sg_in_whole: where the engine's largest prefill chunk splits some layer
 * by items; else each card holds its rows only, a decode engine's cache keeping the room);
 * MF_SG_IN_ROWS by rows, each card holding its rows only; MF_SG_IN_ITEMS by items wherever the
 * graph's blocks allow it, every card holding all rows (tests). Split by items, card k runs
 * all the stage's rows over the item blocks j with j mod n_dense_cards == k (as many blocks a card
 * as the split by rows gives each, while a block holds dense_block items; its records' part -1:
 * all rows) and copies in and out only those items; each output value is the
 * same kernel's dot product on any card, so the logits are the same bits. */
typedef enum mf_sg_in_mode { MF_SG_IN_COST = 0, MF_SG_IN_ROWS, MF_SG_IN_ITEMS } mf_sg_in_mode;
/* 1 when every one of n_dense_cards cards holds all the rows of dense sublayer `dense` of backbone
 * layer L (L < 0 or a draft stage: 0): the in stage under MF_SG_SPLIT_ROWS with in_whole
 * (mf_sg_in_whole). The weights' upload (graphs/step/step_dense.c) and the card memory
 * (mf_sg_dense_card_bytes) follow it. */
int mf_sg_dense_whole(const mf_config *c, int n_dense_cards, int split, int in_whole, int dense, int L);
/* Whether the dense cards of o (its c, sz, n_dense_cards, dense_split, in_split, dense_block,
 * profile) hold all the in stage's rows (mf_sg_opts.in_whole) for an engine whose prefill chunks
 * run up to `chunk` items: MF_SG_IN_ITEMS 1, MF_SG_IN_ROWS 0, MF_SG_IN_COST 1 where `chunk` is at
 * least MF_SG_IN_WHOLE_MIN and a chunk of that many items splits some layer by items
 * (mf_sg_in_items with in_whole). 0 unless split by rows over several cards. The rows the cards
 * hold take room from their expert caches, which the cost model does not price (the misses
 * depend on the routing): MF_SG_IN_WHOLE_MIN is where the simulator's first token on the seed host
 * gains by them (flash41, 8,192 prompt positions, hybrid, split by rows -> by items, 18 fewer
 * cache slots a card: in chunks of 2,048 12.731 -> 12.806 s; 4,096: 8.614 -> 8.650; 8,192: 6.066
 * -> 5.963), so a decode engine's default chunks keep its cache whole. */
#define MF_SG_IN_WHOLE_MIN 8192
int mf_sg_in_whole(const mf_sg_opts *o, int chunk);
/* 1 when layer L's in stage of a graph of o over n items a micro-batch runs split by items
 * (mf_sg_in_mode): with o->in_whole, at least two item blocks, never a draft round, and by cost
 * where the slowest card's chain (its blocks' copies in, work and copies out at the cost model's
 * prices on o->profile) is priced below that of the split by rows. */
int mf_sg_in_items(const mf_sg_opts *o, int n, int L);
/* The cards a draft round's Markov rows (MF_SG_D_MARKOV, a matrix of w_bytes) run on: split by rows
 * over them as the head's (mf_sg_dense_parts) where the cost model on profile p (NULL: the built-in
 * machine) prices a unit's chain on the largest part (its row share in, the card's bf16 matmul,
 * its rows out) below the whole chain on the head's card, else 1 (the head's card). The builder
 * (mf_stepgraph.mk_parts) and the engine's upload of the rows (graphs/step/step_dense.c) ask it. */
int mf_sg_markov_parts(const mf_config *c, const mf_profile *p, double w_bytes, int n_dense_cards, int split);
/* wo_a's outputs exchanged between the cards (issue 37 phase 6), set by mf_sg_parts: where wo_a
 * and wo_b are split by rows over the same cards (mf_stepgraph.oa_x), block j of a card's wo_b
 * copy-in waits only for block j of each card's wo_a (the other cards' copies out through pinned
 * host memory, the card's own oa work), not for every card's whole wo_a (the oa join); and card k
 * keeps the wo_a rows its own oa made (mf_stepgraph.oa_kept[k]) where copying only the others'
 * rows (1 or 2 copies: mf_sg_ob_in_cols) costs less than one copy of all of them at the cost
 * model's act copy (a block of the graph's items: prefill chunks keep them, batch 1 does not).
 * The profile has no card-to-card rate, so the exchange is priced and run as the two links' copies
 * through the host (the source's d2h, the destination's h2d), with no host work between them. */
void mf_sg_oa_exchange(const mf_sg_opts *o, mf_stepgraph *sg);
/* The columns of wo_a's output (n_oa_rows: wo_a's rows) card part k's wo_b copy-in carries:
 * ranges c[r][0..1) for r < the count returned (1 or 2): all of them, or with oa_kept[k] the
 * other cards' rows around its own (mf_sg_dense_rows); 0 when none. */
int mf_sg_ob_in_cols(const mf_stepgraph *sg, int k, int64_t n_oa_rows, int64_t c[2][2]);
/* The item blocks of a dense chain on a card over n items, each a copy in -> card work -> copy out
 * of its own over items [i0 + n j / blocks, i0 + n (j + 1) / blocks) (a card's blocks' copy-ins one
 * after another), so that one block's copies run beside another's card work: a prefill chunk
 * of thousands of items otherwise waits for its whole copy in before the card starts, and for the
 * card's whole work before its copy out (docs/measurements.md, "Second 2026-12-04 session"). n /
 * block_min blocks (block_min 0: MF_SG_DENSE_BLOCK), at least 1, at most MF_SG_DENSE_MAX_BLOCKS;
 * the head's chain (its items with logits) is one block. The items' values are the same bits in
 * any blocks (the kernels' sums are per item). */
#define MF_SG_DENSE_BLOCK 256   /* simulated TTFT of 8,192 on the seed host: 256 / 8 blocks 10.075 s, 1,024 / 4 10.237, 512 / 16 10.267 */
#define MF_SG_DENSE_MAX_BLOCKS 8
int mf_sg_dense_blocks(int n, int block_min);
/* The one rule for which rows a dense task owns: rows [r0, r1) of its sublayer's n_rows output
 * rows. Part -1 (a sublayer on one card): all of them. Part k of `parts`: chunks of
 * ceil(n_rows / parts) rounded up to 32 rows (an fp8 tile), the last parts possibly short or
 * empty. The builder prices each task by these rows and the engine computes and copies them. */
void mf_sg_dense_rows(int parts, int part, int64_t n_rows, int64_t *r0, int64_t *r1);
/* The activations the dense chains copy as bf16, 2 bytes a value instead of 4 (device/dev.h
 * mf_dev_bf16_pack / _unpack on the card's copy stream; host/kernels.h mf_kern_vec_bf16_pack /
 * _unpack in the host task that writes the values or first reads them): only values the copy
 * cannot change, each already bf16 or read only through a bf16 rounding that comes first.
 * mf_sg_attn_buf_bf16(buf), buf an attention buffer (graphs/layers/layers.h MF_LY_A_*), is 1 for
 *   MF_LY_A_IN   the attn_norm's output (mf_ly_rmsnorm's bf16(w * bf16(x * rs))): in for the in stage;
 *   MF_LY_A_QR   wq_a's output, rounded (mf_ly_attn_linears' bf): out of in; then the q norm's
 *                output (bf16(w * bf16(x * rs)) in place): in for qb;
 *   MF_LY_A_Q    wq_b's output (fp32) out of qb: read only by the heads, which round each head's
 *                query to bf16 before any other use (mf_fa_heads_q, mf_ly_attn_core_heads); in for
 *                the heads on cards after the q prep, which rounds it last (mf_fa_heads_q) (where
 *                the queries stay on the cards, mf_sg_heads_qlocal: out only for the host's
 *                fallback heads, in never);
 *   MF_LY_A_QI   the indexer's wq_b output (fp32) out of qb: read only by the index query, which
 *                rounds it first (graphs/layers mf_ly_index_q);
 *   MF_LY_A_O    the heads' output, bf16 before its inverse RoPE (mf_dev_attn_heads, the host's
 *                heads), whose part it rounds again (mf_fa_heads_o): out of the heads, in for oa;
 *   MF_LY_A_Z    wo_a's output, rounded (mf_ly_attn_linears' bf): out of oa, in for ob (by rows);
 *   MF_LY_A_OUT  wo_b's output, rounded: out of ob;
 * 0 for the others: KV (wkv's output, its first head rounded first by the window KV) and IW (the
 * index weights, rounded first by the index query): under 1% of the chain's bytes at flash41, not
 * done; LAT and GATE (fp32 values the compressor reads as they are). The heads' key table stays fp32 (the window rows are fp8
 * fake-quantized, the compressed entries' unpacking is not proven bf16-exact here; 10% of a card's
 * heads' bytes in at flash41's 8192 items, the bf16 queries 77%), the key lists int32.
 * mf_sg_dense_bf16(dense, out) for the other sublayers' copies: 1 for the gate's in (the MoE input,
 * the ffn_norm's output: bf16; the shared expert reads the same copy) and the shared expert's out
 * (w2's output, rounded); 0 for the gate's logits (fp32, the route reads them as they are) and
 * the head's (its input, the final norm's output, is bf16 but one item's per prefill chunk: not
 * done). */
int mf_sg_attn_buf_bf16(int buf);
int mf_sg_dense_bf16(int dense, int out);
/* The dense weight bytes card `card` of n_cards holds under `split` and in_whole (mf_sg_in_whole;
 * codes + scales, bf16): what its dense tasks' records read per step (where mf_sg_dense_whole, all
 * of the in stage's rows: a split by rows reads only its share of them). */
double mf_sg_dense_card_bytes(const mf_config *c, const mf_sg_sizes *sz, int n_cards, int split, int in_whole,
                              int card);
/* The same for a pipeline stage of layers [l0, l1) (the head only when l1 is n_layers). */
double mf_sg_dense_card_bytes_in(const mf_config *c, const mf_sg_sizes *sz, int n_cards, int split, int in_whole,
                                 int card, int l0, int l1);

/* Items whose logits a dense card's head computes at a time (graphs/step/step.h MF_STEP_HEAD_ROWS):
 * a decode batch of 64's (a larger batch takes passes: at flash41's vocabulary 64 rows are 33 MB
 * of a card, 512 would be 265 MB taken from its expert cache) */
#define MF_SG_HEAD_ROWS 64
/* Compressed entries a prefill chunk's key table for the heads on cards holds at most (with
 * head_dim 512: 32 MiB per card): a chunk whose items' selections together touch more runs the
 * host's heads (graphs/step/step_impl.h mf_step_shape.hk_host) */
#define MF_SG_HEADS_ENTRIES 16384
/* Visible compressed entries the index scores on cards take at most (a card's score buffer: its
 * share of the chunk's items x this many doubles; chunk 8,192 on 4 cards: 256 MiB a card): a chunk
 * whose last item sees more scores on the host (mf_step_shape.sk_host) */
#define MF_SG_SCORE_ENTRIES 16384

/* The card memory a step graph's activations take, as the engine lays it out (graphs/step/step_shape.c
 * allocates one block per card from these offsets, the simulator and the engine's start take the
 * bytes from a card before its expert cache): byte offsets, each buffer 256-aligned. A card with
 * routed experts holds the routed block, a dense card the dense block. */
typedef struct mf_sg_card_bufs {
    /* routed: the slots' rows in (fp32 and the bf16 the links carry: none with slot_gather), token
     * weights, h and the int8 scratch (q8_row bytes a row, mf_dev_ffn_table.q8_row) of ffn_rows
     * rows (ffn_slot 1: one slot's at a time, from row 0; 0, the slot-table FFN: every row's, in
     * slot order), rows out (fp32; bf16 at y16 = x: a slot's bf16 rows where its fp32 rows in start,
     * its FFN having read them), each row's item (slot_gather: the gather's row numbers into the
     * MoE input), the device graphs' slot tables (per layer) */
    size_t x, w, h, q, y, x16, y16, ri, tab, q8_row, ffn_rows, routed_bytes;
    int ffn_slot;
    /* dense: the attention buffers (fp32), the bf16 copies' staging of the copy-in and copy-out
     * streams (mf_sg_attn_buf_bf16, mf_sg_dense_bf16's shared out: stg_bytes each, stg_rows items
     * of the widest row, a copy's rows from the staging's first), the MoE input (bf16, whole: the
     * slots' gathers read it; fp32), the gate's logits, the shared expert's h (and --exact's g, u)
     * and out (fp32), the final norm's out, head_rows rows of logits, one Engram layer's rows and wkv out,
     * the heads' key table, lists, counts and sinks, the items' RoPE tables (where the heads'
     * outputs or queries stay on the cards: mf_sg_heads_local, _qlocal), the index scores' keys, counts and scores; a
     * draft round's Markov rows: every unit's rank-R row in (mk_in), its vocab terms out (mk_out) */
    size_t ab[MF_LY_A_N], stg_in, stg_out, stg_bytes, stg_rows, xin16, xin, logits, hs, gs, us, ys, hn, lbuf, eg_emb, eg_kv,
        hk_tab, hk_keys, hk_nk, hk_sink, hk_rope, sk_tab, sk_nvis, sk_score, mk_in, mk_out, dense_bytes;
    int64_t ab_ld[MF_LY_A_N], eg_emb_ld, eg_kv_ld;   /* floats a row (the host's layouts too) */
    int head_rows, hk_ecap, sk_rows;   /* logits rows at a time; key table entries; a card's score rows */
    int eg_per;                        /* Engram rows of an item: (max n-gram - 1) x heads */
    /* the cuBLASLt path (stepgraph_lt.c; 0 bytes where the graph does not take it): dense, two
     * layers' 16-bit weights (layer L's sublayer d at lt_w16 + (L % 2) lt_w16_par + lt_w16_d[d]: the
     * next layer's dequantization beside this one's GEMMs), the activations' cast (lt_x16_bytes)
     * and cuBLASLt's workspace (lt_ws_bytes, in the routed block too); routed, in the routed block
     * before the slot tables: one expert's w1 and w3 (one [2I][H] scratch) and w2 in 16 bits, its
     * gate and up outputs (lt_ffn_tok rows of 2I floats), its cast (lt_ex16_bytes), a workspace */
    size_t lt_w16, lt_w16_par, lt_w16_d[MF_SG_N_DENSE], lt_x16, lt_x16_bytes, lt_ws, lt_ws_bytes;
    size_t lt_e13, lt_e2, lt_gu, lt_ex16, lt_ex16_bytes, lt_ews;
} mf_sg_card_bufs;

typedef struct mf_sg_card_in {
    const mf_config *c;
    const mf_stepgraph *sg;   /* its n items, slots, heads and scores on cards */
    int ln;                   /* items the host's buffers are laid out for (>= sg->n; 0: sg->n) */
    int64_t sh_rows;          /* the shared expert's hidden rows (mf_sg_sizes.sh_rows) */
    int exact, dev_graphs;    /* mf_step_opts.exact (fp32 g and u copies), .dev_graphs (slot tables) */
    int head_rows;            /* logits rows a dense card computes at a time (0: MF_SG_HEAD_ROWS) */
} mf_sg_card_in;

/* Fills b for in (every field; 0-byte buffers where the graph has none). */
void mf_sg_card_bufs_of(const mf_sg_card_in *in, mf_sg_card_bufs *b);
/* The card memory the engine keeps free for its shapes' buffers when it sizes its expert caches
 * (graphs/step/step.c; the simulator takes the same): the graphs of a prefill chunk of `chunk`
 * positions (serial) and of a decode batch of max_items (the parallel graph of its bucket,
 * mf_sg_bucket; 0: none), each built from base
 * with its n and par replaced, laid out by mf_sg_card_bufs_of; *routed the two routed blocks summed
 * (a card with routed experts), *dense the two dense blocks (a dense card): the engine keeps a long
 * chunk's shape beside the decode shapes. Other batch sizes' shapes are smaller and take what the
 * caches leave. 0 or a negative code (the graphs' building). */
int mf_sg_card_reserve(const mf_sg_opts *base, const mf_sg_card_in *in, int chunk, int max_items, double *routed,
                       double *dense);

/* ---- the cuBLASLt path (stepgraph_lt.c; device/dev.h "The cuBLASLt path") ----------------------
 * Where a card's tensor cores take work (mf_sg_opts.lt). A dense record's FP8 linears take the
 * path (its lin_path MF_DEV_LIN_CUBLASLT) by its chain's tokens (every item block and card alike)
 * when the mode says so: COST where mf_cost_card_paths prices the card's share of the sublayer below
 * the CUDA cores at the micro-batch's tokens (the dequantization counted in that choice). Only the
 * sublayers whose linears read bf16 values (mf_sg_lt_dense_ok), so that the cast to 16 bits is exact
 * and an emulated card gives the host's bits; per layer and card each such sublayer's weights are
 * dequantized by one MF_SG_DENSE_DEQ task on the card's copy-in lane, into the scratch of the
 * layer's parity, after the card works of two layers before that read that scratch and before this
 * layer's. A routed expert's FFN on a card takes it per slot by its tokens (mf_sg_ffn_lt), its
 * dequantization inside its FFN task. */
typedef enum mf_sg_lt_mode { MF_SG_LT_COST = 0, MF_SG_LT_ON, MF_SG_LT_DENSE, MF_SG_LT_OFF } mf_sg_lt_mode;
/* 1 when dense sublayer d's FP8 linears may take the cuBLASLt path: those reading bf16 values with
 * the kernels' sums: the attention stages (their inputs mf_sg_attn_buf_bf16's IN, QR, O, Z) but the
 * grouped wo_a with exact (the reference's sums) and the Engram wkv (its rows E4M3 codes times E8M0
 * scales: bf16 values); not the gate and head (BF16 weights), the shared expert (its w2 reads h in
 * fp32, its w1 and w3 one fused kernel), the heads or the index scores. */
int mf_sg_lt_dense_ok(int dense, int exact);
/* A routed expert's FFN of tok tokens on a card (ew: mf_sg_expert_work): 1 when it takes the
 * cuBLASLt path under mode (MF_SG_LT_ON always; COST where mf_cost_card_paths prices it below the
 * int8 path; DENSE and OFF never), else 0; *ns (when not NULL) its price on the path taken
 * (mf_cost_card_lt, or the CUDA cores' mf_cost_card_on). */
int mf_sg_ffn_lt(const mf_cost_model *m, const mf_work *ew, int tok, int mode, double *ns);
/* Tokens of one routed expert's call on the path at most (mf_stepgraph.lt_ffn_tok): a slot of more
 * takes several, its scratch sized for this many. */
#define MF_SG_LT_FFN_TOK 1024

/* Hybrid and seed placement of a layer's slots (the engine's and the simulator's rule): every
 * used slot's host work is queued first (mf_sg_place_host_work: the host's end if all stayed
 * there), then the slots whose experts are cached on their owner card are offered, in slot
 * order, then the rest (a hit frees as much host work as a miss for a fraction of the link's
 * time). An offered slot moves to its card when the card's end with it (the copy queue: the
 * slot's copy-in as the graph's record prices it, mf_sg_task_ns MF_SG_DEV_IN: its rows and token
 * weights, and on a miss the packed expert's parts, each copy paying the profile's h2d latency;
 * then the compute queue; then the copy-out of its rows) is no later than the host's end with
 * it (the queued work over the workers). Placing each slot against the host's whole queue, not
 * the slots before it, keeps the order from deciding: at batch 1 a cached expert among the
 * first slots went to the host though the host ended later than its card. An expert's time on
 * the host or a card is the cost model's kernel time (sched/cost.h mf_cost_kern): the lane's
 * latency, its bytes over the lane's byte rate, and each token past the first its multiply-adds
 * over the profile's fp4 multiply-add rate there (a thread's on the host); where the profile has
 * no such rate (the built-in machine) each token adds 2% instead. A long prefill chunk's
 * thousands of tokens per expert so weigh the host's compute against a card's. */
typedef struct mf_sg_placer {
    mf_lane_model cpu, comp;
    mf_cost_model cm;                 /* the copies' prices (mf_cost_copy) */
    double workers, bytes;
    double macs, host_macs_per_s, card_macs_per_s;   /* per token of an expert; 0: the 2% rule */
    double tok_in, tok_out;           /* bytes a slot's token copies in and out (mf_sg_slot_tok_bytes) */
    int hybrid;
    int miss_copies;                  /* a miss's copies of the packed expert (mf_sg_opts miss_copies) */
    double host_q, copy_q[MF_SG_MAX_CARDS], comp_q[MF_SG_MAX_CARDS];
    double host_ns, copy_ns, t_dev;   /* the slot being placed (t_dev: its compute's end) */
    int card;
    /* mf_sg_place_ahead: the parts' copies (prefetch) queue per card from their head start;
     * pre_ns, copy_end: the slot being placed's parts and the end of its rows' copy */
    int ahead;
    double pre_q[MF_SG_MAX_CARDS], pre_ns, copy_end;
    int lt;   /* mf_sg_lt_mode of the routed experts (mf_sg_place_lt; init: MF_SG_LT_COST) */
    int gather;   /* mf_sg_place_gather: the cards gather the slots' rows (mf_stepgraph.slot_gather) */
} mf_sg_placer;

/* Bytes one token of a slot on a card copies in (dir 0: its input row and its weight) or out
 * (dir 1: its output row): the one home of the slot copies' sizes (the builder's records, the
 * placer; the engine's mf_task_dev_in / _out copy these). The rows travel as bf16 codes, 2 bytes a
 * value (the dense chains' rule, mf_sg_attn_buf_bf16): the input row is the ffn_norm's output,
 * bf16 already (the card quantizes it itself, as the host does the fp32 row), and every output
 * row is read only by the combine, which rounds it to bf16 first (mf_fa_combine_cols). The token
 * weight (the route's normalized score, not bf16) stays fp32. */
double mf_sg_slot_tok_bytes(const mf_config *c, int dir);
/* Whether a graph of these options gathers its slots' rows on the cards (mf_stepgraph.slot_gather):
 * routed experts on cards, the gate split by rows over n_dense_cards >= n_cards cards, its input
 * copied as bf16, not exact. */
int mf_sg_slot_gather(const mf_sg_opts *o);
/* The price of a slot's copy-in (MF_SG_DEV_IN; the placer's): on a miss the packed expert's
 * miss_copies copies of miss_bytes; unless gather the rows and token weights, two copies of tok x
 * tok_in bytes. Each copy pays the profile's h2d latency (mf_cost_copy). */
double mf_sg_slot_in_ns(const mf_cost_model *m, int gather, int tok, double tok_in, int miss, int miss_copies,
                        double miss_bytes);

/* A layer's placer: models as mf_sg_lanes_init's, hybrid 0 for seed (always the card); the
 * packed expert's bytes on a card (mf_sg_sizes xslot_bytes) and its multiply-adds per token
 * (mf_sg_expert_work), the bytes a token copies in and out (mf_sg_slot_tok_bytes), the fp4
 * multiply-add rates and the copies' figures from prof (NULL: the built-in machine,
 * mf_cost_default_profile; prof must outlive the placer); miss_copies: the copies of the packed
 * expert on a miss (mf_sg_opts miss_copies: 1 one span, 0 one per part). */
void mf_sg_placer_init(mf_sg_placer *p, const mf_lane_model models[4], const mf_profile *prof, int n_threads,
                       int hybrid, double expert_bytes, double expert_macs, double tok_in, double tok_out,
                       int miss_copies);
/* The chunk length from which a serial graph prefetches its experts by default: the fewest
 * positions n at which fewer than one of the E experts is expected unused under uniform routing,
 * E (1 - K / E)^n < 1 (flash41, 384 experts, top 6: 378). */
int mf_sg_prefetch_min(const mf_config *c);
/* 1 when a graph of these options prefetches (mf_stepgraph.prefetch): serial (one unit), one
 * micro-batch, routed experts on cards, no store, n >= the threshold of o->prefetch_min. */
int mf_sg_prefetch_on(const mf_sg_opts *o);
/* A card's compute of an expert priced on the path mf_sg_ffn_lt takes under mode (the graph's
 * mf_sg_opts.lt where its lt_ffn, else MF_SG_LT_OFF), engine and simulator alike. */
void mf_sg_place_lt(mf_sg_placer *p, int mode);
/* A slot's copy-in priced as the graph's records of mf_stepgraph.slot_gather (on 1) price it. */
void mf_sg_place_gather(mf_sg_placer *p, int on);
/* Prefetch: the placer's copy queues start ahead_ns before the route (the experts' copies run
 * while the layer's attention does: mf_stepgraph.pre_ahead_ns), card c's left_ns[c] earlier
 * (NULL: none; the link time the previous layer's MoE window leaves it, mf_sg_place_left: the
 * place task follows that layer's route), and the host's queue starts with host_ns (the MoE
 * window's other host work, mf_stepgraph.pre_moe_host_ns); so a card takes an expert while its
 * copy, less that head start, and compute end no later than the host's share. */
void mf_sg_place_ahead(mf_sg_placer *p, double ahead_ns, double host_ns, const double *left_ns);
/* Prefetch, after mf_sg_place_all: per card how long its link stays free in the layer's MoE
 * window by the placer's prices, the host's queue over the workers (the window) past the card's
 * copies, at least 0: the next layer's left_ns (engine and simulator alike). */
void mf_sg_place_left(const mf_sg_placer *p, double left_ns[MF_SG_MAX_CARDS]);
/* Prefetch: the layer's E experts placed as mf_sg_placer places a route's slots (the cached ones
 * first), each with tok = ceil(n top_k / E) expected tokens, with the copy head start ahead_ns.
 * cached[e]: 1 when expert e is in its owner card's cache (mf_dev_xcache_owner); take(card, e):
 * the caller's cache slot for it, 1 taken (want: hit 1 / miss 0 in *hit), 0 none (the host keeps
 * it). card[e] gets the card or -1, miss[e] 1 where it must be copied in. Returns the experts on
 * cards. */
typedef int (*mf_sg_take_fn)(void *ctx, int card, int e, int *hit);
int mf_sg_place_all(mf_sg_placer *p, const mf_config *c, int L, int n_cards, int tok, const uint8_t *cached,
                    mf_sg_take_fn take, void *ctx, int32_t *card, uint8_t *miss);
/* Micro-batch h's layer L: each card's compute queue starts with its shared expert's work there
 * (mf_stepgraph.shared_ns), so that the card holding it takes fewer of the routed experts it owns
 * (a long prefill chunk's shared expert is tens of ms on one card). Engine and simulator alike,
 * after mf_sg_placer_init (and mf_sg_place_ahead). */
void mf_sg_place_shared(mf_sg_placer *p, const mf_stepgraph *sg, int L, int h);
/* Marks layer L's prefetch copies: noop unless card[e] >= 0 and miss[e]. */
void mf_stepgraph_mark_prefetch(mf_stepgraph *sg, int L, const int32_t *card, const uint8_t *miss);
/* Queues a used slot of cnt tokens on the host (every used slot, before any is offered). */
void mf_sg_place_host_work(mf_sg_placer *p, int cnt);
/* Offers a queued slot, of cnt tokens, owned by `card` (cached: its expert is in that card's
 * cache; the cached ones first): 1 when it should run on the card (then mf_sg_place_card once
 * the card took it; a card that cannot leaves it on the host), 0 when it stays on the host. */
int mf_sg_place_want_card(mf_sg_placer *p, int card, int cnt, int cached);
void mf_sg_place_card(mf_sg_placer *p);

/* Phase times of a run of sg (spans per task, as the timeline's): per phase the length of the
 * union of its tasks' spans and their summed durations, over the tasks that ran (status 0) except
 * IO reads and copies, which belong to no phase. scratch holds n_tasks spans. Adds to phase_ns
 * and busy_ns (MF_SG_N_PHASES each; OTHER is left to the caller). */
void mf_stepgraph_phase_times(const mf_stepgraph *sg, const mf_task_span *spans, mf_task_span *scratch,
                              int64_t *phase_ns, int64_t *busy_ns);

/* Multiply-adds on the kernels in one run of sg, from its records (the macs of every kernel
 * family): row and item tasks over their n_tok tokens, the head over n_head tokens (the items
 * that want logits), the routed experts over the run's n x top_k (item, expert) pairs by the host
 * tasks' records (a slot does the same work wherever it runs; device records are not counted
 * again). Scalar work (ref_flops: mixes, scores, roundings) is not counted. */
double mf_stepgraph_macs(const mf_stepgraph *sg, int top_k, int n_head);

/* Weight bytes (codes + scales, every kernel family) that the host's kernels read in the run of sg
 * just finished: the records of the host tasks not marked noop (a slot's parts count once for
 * the slot, whatever its tokens; the head once). Device tasks are not counted. */
double mf_stepgraph_weight_bytes(const mf_stepgraph *sg);

/* Builds and finalizes the graph of one shape. 0 or a negative code with a message. */
int mf_stepgraph_new(const mf_sg_opts *o, mf_stepgraph **out);
void mf_stepgraph_free(mf_stepgraph *sg);

/* Marks layer L's slot tasks with nothing to do as noop (mf_graph_set_noop), the rest normal:
 * slots >= n_used; a slot's host tasks when it runs on a card (slot_card[s] >= 0; NULL: every
 * slot on the host); its tasks on the other cards; a card's FFN graph when no slot is on it.
 * With two micro-batches: half 0's slots (mf_stepgraph_mark_noop_half for each half). */
void mf_stepgraph_mark_noop(mf_stepgraph *sg, int L, int n_used, const int32_t *slot_card);
/* The same for half h's slots of layer L: its first n_used slots are used, slot_card[j] (NULL:
 * all on the host) the card of its slot j (slot half_slot[h] + j of the graph). */
void mf_stepgraph_mark_noop_half(mf_stepgraph *sg, int L, int h, int n_used, const int32_t *slot_card);
/* The half (0 or 1) whose slots include slot s. */
int mf_stepgraph_half_of_slot(const mf_stepgraph *sg, int s);

/* A draft round's graph (mf_sg_opts.draft): the chain's tasks of candidates n_cand and after noop
 * (no unit asks for them), the others normal. */
void mf_stepgraph_mark_draft(mf_stepgraph *sg, int n_cand);

/* Marks the reads of item task k's Engram gather of Engram slot es (mf_config_engram_slot) past
 * the first n_used noop, the rest normal (eg_reads; nothing otherwise). */
void mf_stepgraph_mark_engram(mf_stepgraph *sg, int es, int k, int n_used);

/* The items of the graph that a step of n items of several sequences runs in (the engine's
 * parallel and mixed graphs, the simulator's decode graph): the least power of two >= n, at most
 * MF_SG_MAX_ITEMS; n itself for n < 2. The graph's other items are marked dead
 * (mf_stepgraph_set_live), so one graph serves every step of n_live <= its n. */
int mf_sg_bucket(int n);

/* Makes a graph's first n_live items (1..n) the ones that run: the tasks over items [n_live, n)
 * only are marked noop and their records' item ranges emptied (i1 = i0; a task without
 * predecessors still runs, over no items), the tasks over items on both sides cut at n_live (i1,
 * and n_tok where it counts the items); a micro-batch all of whose items are dead has its span
 * tasks (route, gate, moe done) and its slots marked noop too. The records' work (mf_sg_work) is
 * not changed: a cut task is priced for its full items (the simulator's partially live item group
 * and the span tasks' scalar terms; none where n_live is a power of two). Cheap when n_live is the
 * last one set. Between runs. */
void mf_stepgraph_set_live(mf_stepgraph *sg, int n_live);

/* The unit (0..n_units-1) that holds item `item`, -1 if none. */
int mf_stepgraph_unit_of(const mf_stepgraph *sg, int item);

/* Index score parts of item `item`'s scores (key_parts of its group): what the engine splits its
 * visible entries in and mf_sg_pos_flops's p_key for its MF_SG_ATTN_SCORE records. */
int mf_stepgraph_key_parts(const mf_stepgraph *sg, int item);

#endif
