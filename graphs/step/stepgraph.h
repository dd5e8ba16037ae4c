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
#include "graphs/model/config.h"
#include "sched/graph.h"
#include "sched/profile.h"
#include "sched/timeline.h"

#define MF_SG_MAX_ITEMS 64   /* items of one graph (graphs/step/step.h MF_STEP_MAX_ITEMS) */
#define MF_SG_MAX_PARTS 64   /* row parts of an attention stage */
#define MF_SG_MAX_CARDS MF_DEV_MAX_CARDS
#define MF_SG_EXPERT_PARTS 6 /* a routed expert's parts: w1, w2, w3 codes and scales */

/* What a task does. The engine has one task function per op. */
typedef enum mf_sg_op {
    MF_SG_ENGRAM_EMBED,   /* items: hashed table rows, gathered and dequantized */
    MF_SG_ENGRAM_ROWS,    /* rows of the Engram wkv projection, all items */
    MF_SG_ENGRAM_GATE,    /* items: the gated value into the streams */
    MF_SG_ATTN_PRE,       /* items: attention mix, collapse, attn_norm */
    MF_SG_ATTN_ROWS,      /* rows of attention linear stage `stage`, all items */
    MF_SG_ATTN_QNORM,     /* all items: low-rank query rounded and normed */
    MF_SG_ATTN_CORE,      /* items: RoPE, window KV, compressor, indexer, attention */
    MF_SG_ATTN_POST,      /* items: expand, ffn mix, ffn_norm */
    MF_SG_GATE_ROWS,      /* rows (experts) of the router's logits, all items */
    MF_SG_ROUTE,          /* top-k, slot table, store batch, placement, noop marks */
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
    MF_SG_COMBINE,        /* items: fixed-order sum of the experts, expand */
    MF_SG_NORM,           /* items: final collapse and norm */
    MF_SG_HEAD,           /* vocabulary rows of the head */
    MF_SG_JOIN,           /* nothing: joins a stage's parts (oa join, shared join, head join) */
    MF_SG_N_OPS
} mf_sg_op;

/* Phases of a step, for reports (graphs/step/step.h names them mf_step_phase). */
enum { MF_SG_PH_ATTN, MF_SG_PH_MOE, MF_SG_PH_ENGRAM, MF_SG_PH_HEAD, MF_SG_PH_OTHER, MF_SG_N_PHASES };

/* Accounting classes: what the phase table leaves out (IO, copies) and the overlap counters. */
typedef enum mf_sg_kind {
    MF_SG_K_OTHER, MF_SG_K_IO, MF_SG_K_EXPERT, MF_SG_K_COPY, MF_SG_K_DEV, MF_SG_K_COPY_OUT
} mf_sg_kind;

/* The attention's linear stages (graphs/layers/layers.h MF_LY_A_STAGE_* has the same order), and the
 * core's own linears (the indexer's wk, inside MF_SG_ATTN_CORE). */
enum { MF_SG_ST_IN, MF_SG_ST_QB, MF_SG_ST_OA, MF_SG_ST_OB, MF_SG_ST_CORE, MF_SG_N_STAGES };

/* The work of one task. Kernel families as sched/profile.h (MF_KF_*; MF_KF_REF unused here:
 * scalar work is ref_flops). Token-scaled terms multiply by `n_tok`, or with slot_tokens set by
 * the slot's tokens of the step (known once routed). */
typedef struct mf_sg_work {
    double w_bytes[MF_KF_N];   /* weight bytes read (codes + scales) */
    double macs[MF_KF_N];      /* multiply-adds per token */
    double calls[MF_KF_N];     /* kernel calls (each pays the family's latency) */
    double ref_flops;          /* plain scalar code, in REF multiply-adds, for the whole task */
    double ref_flops_tok;      /* the same per token of the slot */
    double copy_bytes;         /* host<->card: the packed expert, on a cache miss */
    double copy_bytes_tok;     /* host<->card per token of the slot */
    double io_bytes;           /* disk: the aligned extents, when read (a miss; streamed tables) */
    int io_reads;              /* disk requests (each pays the disk's latency) */
} mf_sg_work;

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
    int8_t read;       /* IO tasks: which of the slot's reads (its store extents, w1 .. w3 scale) */
    int32_t slot;      /* expert slot */
    int32_t part;      /* row part */
    int32_t i0, i1;    /* items [i0, i1) (item tasks) */
    int64_t r0, r1;    /* output rows [r0, r1) of a row part (where the total is the config's) */
    int n_tok;         /* tokens the kernels run over (not slot_tokens) */
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
    double hc_macs;           /* both hyper-connection projections (fp32, scalar) */
    double attn_ref_macs;     /* wo_a: the reference's scalar dot rows (grouped) */
    double eng_fp8_bytes, eng_data_bytes, eng_bf16_bytes, eng_fp8_macs;   /* Engram wkv; q/k */
    double eng_row_bytes;     /* one table row (codes + scales) */
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
} mf_sg_sizes;

/* Sizes of config c (validated) from its layout. 0, -ENOMEM or the layout's error. */
int mf_sg_sizes_new(const mf_config *c, mf_sg_sizes **out);
void mf_sg_sizes_free(mf_sg_sizes *s);

/* The positional scalar work of one item's attention core at position pos (window and selected
 * entries, the indexer's scores), in REF multiply-adds: MF_SG_ATTN_CORE's work beyond its record. */
double mf_sg_core_flops(const mf_config *c, int L, int64_t pos);

/* Part p of `parts` of n_rows rows (chunks rounded up to 16 rows: the last parts may be empty). */
void mf_sg_rows(int64_t n_rows, int parts, int p, int64_t *r0, int64_t *r1);

/* A shape and its lanes. */
typedef struct mf_sg_opts {
    const mf_config *c;
    const mf_sg_sizes *sz;
    int n;              /* items, 1..MF_SG_MAX_ITEMS */
    int par;            /* 1: items of distinct sequences, item parts one task per item */
    /* > 0: units instead of par: the item parts are one task per unit, unit k being items
     * [unit_end[k - 1], unit_end[k]) (unit_end[-1] = 0, unit_end[n_units - 1] = n), run in order;
     * the items of one sequence must lie in one unit. 0: par's units (n of one item, or one) */
    int n_units;
    const int *unit_end;
    int n_threads;      /* CPU workers: the row splits */
    int n_cards;        /* cards with device lanes (0: host only) */
    int dev_graphs;     /* 1: a layer's FFNs on a card are one task (MF_SG_DEV_FFN_CARD) */
    int store;          /* 1: routed experts are read through a store (IO tasks per slot) */
    int read_window;    /* slots whose reads are in flight (0: 2, < 0: all) */
    const mf_lane_desc *lanes;   /* lane 0 the CPU lane, lane_io the IO lane (store), card c's */
    int n_lanes, lane_io, lane_dev0;   /* three lanes at lane_dev0 + 3c (in, compute, out) */
    const mf_task_fn *fn_of;     /* per op: the engine's task functions; NULL: none (simulator) */
} mf_sg_opts;

typedef struct mf_stepgraph {
    mf_graph *g;                  /* finalized; args NULL except the IO tasks' (an empty read) */
    mf_sg_task *task;             /* per task id */
    int n_tasks;
    int n, par, n_slots;          /* items, parallel, expert slots min(n * top_k, experts) */
    int n_units;                  /* item tasks per item part; unit k: items [unit_end[k-1], unit_end[k]) */
    int unit_end[MF_SG_MAX_ITEMS];
    int p_exp, p_sh, p_head, p_attn;   /* row parts per expert, shared expert, head, stage */
    int n_cards, dev_graphs, n_io_parts;
    /* per layer and slot, the tasks that have nothing to do unless the slot runs on the host
     * (ups, downs, join) or on card c (in, ffn, out): slot_tid[(L * n_slots + s) * tid_per_slot
     * + k], k < 2 p_exp + 1 host, then 3 per card; -1 where absent */
    mf_task_id *slot_tid;
    int tid_per_slot;
    mf_task_id *card_ffn_tid;     /* dev_graphs: per layer and card its FFN graph task */
} mf_stepgraph;

/* The engine's lanes (the simulator's graph has the same; its own lane options go to
 * mf_sim_opts): lane 0 the CPU lane (n_threads workers, models[0]); with a store, lane 1 the IO
 * lane (io_uring, depth 64); then per card c three lanes at lane_dev0 + 3c, "devC.h2d",
 * "devC.compute", "devC.d2h" (concurrency 4, models[1..3]: mf_step_lane_models). */
typedef struct mf_sg_lanes {
    mf_lane_desc lane[2 + 3 * MF_SG_MAX_CARDS];
    char names[3 * MF_SG_MAX_CARDS][16];
    int n_lanes, lane_io, lane_dev0;
} mf_sg_lanes;

void mf_sg_lanes_init(mf_sg_lanes *l, const mf_lane_model models[4], int n_threads, int store, int n_cards);

/* Hybrid and seed placement of a layer's slots, in slot order (the engine's and the simulator's
 * rule): a slot goes to the earlier finish of the host (its queue of expert work over the
 * workers, by the CPU lane's model) and its owner card (the copy queue: nothing when cached,
 * else the packed expert's bytes over the copy lane's model; then the compute queue). An
 * expert's time is its bytes over a lane's model; each token of the slot adds 2%. */
typedef struct mf_sg_placer {
    mf_lane_model cpu, copy, comp;
    double workers, bytes;
    int hybrid;
    double host_q, copy_q[MF_SG_MAX_CARDS], comp_q[MF_SG_MAX_CARDS];
    double host_ns, copy_ns, t_dev;   /* the slot being placed */
    int card;
} mf_sg_placer;

/* A layer's placer: models as mf_sg_lanes_init's, hybrid 0 for seed (always the card). */
void mf_sg_placer_init(mf_sg_placer *p, const mf_lane_model models[4], int n_threads, int hybrid,
                       double expert_bytes);
/* The next slot, of cnt tokens, owned by `card` (cached: its expert is in that card's cache):
 * 1 when it should run on the card (then mf_sg_place_card, or mf_sg_place_host when the card
 * cannot take it), 0 when on the host (already queued there). */
int mf_sg_place_want_card(mf_sg_placer *p, int card, int cnt, int cached);
void mf_sg_place_card(mf_sg_placer *p);
void mf_sg_place_host(mf_sg_placer *p);

/* Phase times of a run of sg (spans per task, as the timeline's): per phase the length of the
 * union of its tasks' spans and their summed durations, over the tasks that ran (status 0) except
 * IO reads and copies, which belong to no phase. scratch holds n_tasks spans. Adds to phase_ns
 * and busy_ns (MF_SG_N_PHASES each; OTHER is left to the caller). */
void mf_stepgraph_phase_times(const mf_stepgraph *sg, const mf_task_span *spans, mf_task_span *scratch,
                              int64_t *phase_ns, int64_t *busy_ns);

/* Builds and finalizes the graph of one shape. 0 or a negative code with a message. */
int mf_stepgraph_new(const mf_sg_opts *o, mf_stepgraph **out);
void mf_stepgraph_free(mf_stepgraph *sg);

/* Marks layer L's slot tasks with nothing to do as noop (mf_graph_set_noop), the rest normal:
 * slots >= n_used; a slot's host tasks when it runs on a card (slot_card[s] >= 0; NULL: every
 * slot on the host); its tasks on the other cards; a card's FFN graph when no slot is on it. */
void mf_stepgraph_mark_noop(mf_stepgraph *sg, int L, int n_used, const int32_t *slot_card);

#endif
