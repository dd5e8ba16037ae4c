/* Internals of the step-graph builder (graphs/step/stepgraph.h), included only by graphs/step/stepgraph*.c:
 * the record weights, the builder's state and the functions its files share. stepgraph.c is the core
 * (records, tasks, dependencies, mf_stepgraph_new driving the sublayers); one file per sublayer family:
 * _shape (part counts), _dense (dense work on cards, card buffers), _engram, _attn, _heads (heads and
 * index scores), _moe, _head, _place (placement rule, prefetch). */
#ifndef MF_STEPGRAPH_IMPL_H
#define MF_STEPGRAPH_IMPL_H

#include <stdio.h>

#include "graphs/step/stepgraph.h"

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
/* Sizes and parts the builder's files share. */
#define SG_STORE_ALIGN 4096.0   /* host/store.c MF_STORE_SLOT_ALIGN: reads are aligned extents */
#define SG_MAX_MIX 4            /* row parts of a hyper-connection mix */
#define SG_EG_PASSES 4          /* kernel passes of an Engram wkv block (256 items) */
#define SG_LT_RUNS (2 * MF_SG_DENSE_MAX_BLOCKS)   /* a layer's card works of one sublayer on a card: both halves' blocks */

/* The builder's state while mf_stepgraph_new builds one graph. */
typedef struct mf_sg_builder {
    const mf_sg_opts *o;
    mf_stepgraph *sg;
    int cap, rc;
    int u;                       /* item-part tasks per layer part: n (parallel) or 1 */
    double per;                  /* items per item task */
    mf_task_id *io;              /* the layer's IO tasks, n_slots x n_io_parts */
    mf_task_id fmix[MF_SG_MAX_GROUPS][SG_MAX_MIX];   /* the layer's ffn mix parts per item group */
    mf_task_id fnorm[MF_SG_MAX_GROUPS][MF_SG_MAX_PARTS];   /* the layer's ffn_norm column parts per item group */
    /* the last layer's combine column parts per item group, and per unit their join (-1: none yet):
     * where a unit's streams were last written by that join (unit[k] == comb_join[k]), a group's
     * readers wait for its own combine parts only (mf_sg_group_after) */
    mf_task_id comb[MF_SG_MAX_GROUPS][MF_SG_MAX_PARTS], comb_join[MF_SG_MAX_GROUPS];
    /* per task: the task a dependency on it waits for (itself, or the last task of a dense chain
     * on a card that it begins: mf_sg_dense_chain), cap entries */
    mf_task_id *exit_of;
    /* per task: the next task of its group (-1: none): the chains of a dense sublayer split by
     * rows link their first tasks (and their card works) so that a dependency on the group's
     * first task is one on every chain (mf_sg_dep), cap entries */
    mf_task_id *next_of;
    mf_task_id moe_in;           /* dense on cards: the layer's copy-in of the MoE input */
    mf_task_id moe_gate;         /* dense on cards: the layer's gate work on its card */
    mf_task_id chain_run;        /* the card work of the last mf_sg_dense_chain */
    mf_task_id eg_card;          /* dense on cards: the last Engram wkv chain (its first task) */
    /* the micro-batch being built: half h (-1: the head, after both), its items [h0, h1) and
     * units [k0, k1); the MoE done of the half built before it (its route waits for it) */
    int h, h0, h1, k0, k1;
    int g0, g1;                  /* its item groups [g0, g1) */
    mf_task_id last_done;
    mf_task_id route, rows;       /* the layer's route task and what its slots' work waits for (the
                                   * rows join, or the route with one gather part) */
    mf_task_id pre_join[MF_SG_MAX_CARDS];   /* prefetch: per card the join of the layer's copies */
    mf_task_id dev_rows[MF_SG_MAX_CARDS];   /* slot_gather: per card the micro-batch's MF_SG_DEV_ROWS */
    mf_task_id pre_place;                   /* prefetch: the layer's place task (the route reads its placement) */
    mf_task_id pre_done;                    /* prefetch: the MoE done of the layer before the last built
                                             * (mf_sg_prefetch: two layers' pins at a time) */
    mf_task_id *pre_sfx;                    /* prefetch: per expert the join of its card's copies of it and
                                             * above (mf_sg_prefetch) */
    mf_task_id head_done;                   /* draft graphs: the join of the head's parts */
    /* the cuBLASLt path (stepgraph_lt.c): per card and dense sublayer the dequantization task of
     * the layer deq_l1 - 1 (0: none yet), and per parity of the layer the card works that read that
     * scratch (the later layer's dequantization waits for them) */
    mf_task_id deq[MF_SG_MAX_CARDS][MF_SG_N_DENSE];
    int16_t deq_l1[MF_SG_MAX_CARDS][MF_SG_N_DENSE];
    mf_task_id lt_run[MF_SG_MAX_CARDS][MF_SG_N_DENSE][2][SG_LT_RUNS];
    uint8_t n_lt_run[MF_SG_MAX_CARDS][MF_SG_N_DENSE][2];
    char name[64];
} mf_sg_builder;

#define SG_NAME(b, ...) snprintf((b)->name, sizeof (b)->name, __VA_ARGS__)

/* ---- the builder's core (stepgraph.c) ---- */

/* The item group holding item i. */
int mf_sg_group_of(const mf_stepgraph *sg, int i);
/* The CPU lane of socket key mod n_sockets (mf_sg_opts.n_sockets; lane 0 without sockets). */
int mf_sg_sock_lane(const mf_sg_builder *b, int key);
/* Adds a task: its record `t` (layer, slot, ... and work; op, phase and kind given here) on
 * `lane`; its priority is the cost model's price of the record, set once the graph is built.
 * Returns its id, or -1 after an error (kept in b->rc). */
mf_task_id mf_sg_add(mf_sg_builder *b, int lane, int op, int phase, int kind, mf_sg_task t);
/* The CPU lane of the socket that row part p of `parts` of a host matrix computes for
 * (mf_sg_stage_rows), and that socket's rows [*r0, *r1) of the matrix's n_rows (r0 NULL: none). */
int mf_sg_rows_lane(const mf_sg_builder *b, int64_t n_rows, int parts, int p, int64_t *r0, int64_t *r1);
/* A record of layer L with nothing else set. */
mf_sg_task mf_sg_rec(int L);
/* Item task k's record: items [i0, i1) of unit k. */
mf_sg_task mf_sg_item(const mf_sg_builder *b, int L, int k);
/* A task over the items of the micro-batch being built: its items and tokens. */
void mf_sg_span(const mf_sg_builder *b, mf_sg_task *t);
/* The unit holding item group g (groups lie in one unit). */
int mf_sg_group_unit(const mf_stepgraph *sg, int g);
/* Part p of `parts` of an item's n_rows output rows: the per-item task record of item group g. */
mf_sg_task mf_sg_part(const mf_stepgraph *sg, int L, int g, int64_t n_rows, int parts, int p, int even);
/* Unit k's item groups [*g0, *g1) (groups lie in one unit); returns their count. */
int mf_sg_unit_groups(const mf_stepgraph *sg, int k, int *g0, int *g1);
/* after waits for before (the ends of before's dense chains, every chain of a group). */
void mf_sg_dep(mf_sg_builder *b, mf_task_id before, mf_task_id after);
/* mf_sg_dep over the members of each group whose items meet [i0, i1) only (a dense chain's item
 * blocks; a task over all items, or without items, meets any range): a task over some items waits
 * for, or holds back, only the blocks that write, or read, those items. */
void mf_sg_dep_items(mf_sg_builder *b, mf_task_id before, mf_task_id after, int i0, int i1);
/* The tasks item group i's first readers of its streams wait for, into after[] (at most
 * MF_SG_MAX_PARTS): its own combine parts of the layer before where its unit's last writer is that
 * layer's combine join and the graph has several groups, else its unit's unit[] task. Returns
 * their count. */
int mf_sg_group_after(const mf_sg_builder *b, const mf_task_id *unit, int i, mf_task_id *after);

/* ---- the shape (stepgraph_shape.c) ---- */

/* Part counts, units, item groups and micro-batch halves of the shape. */
void mf_sg_parts(const mf_sg_opts *o, mf_stepgraph *sg);

/* ---- dense work on cards (stepgraph_dense.c) ---- */

/* Bytes a value of attention buffer buf travels in (mf_sg_attn_buf_bf16). */
double mf_sg_attn_val_bytes(int buf);
/* Dense sublayer d's name in task names ("attn qb"). */
const char *mf_sg_dense_name(int d);
/* Dense sublayer d of layer L on its card or split by rows on every card: the chains' first task
 * (a group: mf_sg_dep); b->chain_run the first card work. */
mf_task_id mf_sg_dense_chain(mf_sg_builder *b, int L, int d, mf_sg_task t, int phase, double in_tok, double out_tok,
                             mf_task_id after_in, double out_bf_rows);
/* mf_sg_dense_card_in over the graph's layers (a pipeline stage's, o->layer_begin/_end). */
int mf_sg_dense_card_of(const mf_sg_opts *o, int n_cards, int L);
/* Each card work of group `after` waits for the members of group `before` on its card. */
void mf_sg_dense_after(mf_sg_builder *b, mf_task_id before, mf_task_id after);

/* ---- the cuBLASLt path (stepgraph_lt.c) ---- */

/* The path of dense sublayer d's chain of layer L on card part k of `parts` (mf_sg_dense_rows of
 * the sublayer's output rows; parts 1: all of them) whose record is t (the card's share of the
 * work) over n tokens in blocks of at most blk: MF_DEV_LIN_CUBLASLT or MF_DEV_LIN_AUTO
 * (mf_sg_opts.lt); with the path, the graph's scratch sizes grow to hold it (mf_stepgraph.lt_w16,
 * lt_x16). */
int mf_sg_lt_path(mf_sg_builder *b, int L, int d, int parts, int k, const mf_sg_task *t, int n, int blk);
/* Card work `run` (record t, on the path) after the dequantization of its layer's sublayer on its
 * card (made on the first such work of the layer: MF_SG_DENSE_DEQ, t's share of the weights, after
 * the works that read the scratch of its parity two layers before). */
void mf_sg_lt_deq(mf_sg_builder *b, const mf_sg_task *t, int phase, mf_task_id run);
/* After the layers: whether the routed experts may take the path (mf_stepgraph.lt_ffn, lt_ffn_tok). */
void mf_sg_lt_ffn(const mf_sg_opts *o, mf_stepgraph *sg);
/* The cuBLASLt scratch in a card's buffers (mf_sg_card_bufs_of): the routed one from offset off
 * (returns its end), the dense regions' bytes (w16 of both parities, the cast, the workspace) with
 * b's lt_w16_par and lt_w16_d filled. */
size_t mf_sg_lt_routed_bufs(const mf_sg_card_in *in, mf_sg_card_bufs *b, size_t off);
void mf_sg_lt_dense_bufs(const mf_sg_card_in *in, mf_sg_card_bufs *b, size_t bytes[3]);

/* ---- the heads and index scores (stepgraph_heads.c) ---- */

/* The position the priorities and the heads' placement price the attention at. */
int64_t mf_sg_steady_pos(const mf_config *c);
/* Keys of an item of layer L at most: the window and, on compressed layers, the top-k. */
int mf_sg_heads_keys(const mf_config *c, int L);
/* The index scores of unit k of layer L on the cards: the join the selects wait for. */
mf_task_id mf_sg_scores_on_cards(mf_sg_builder *b, int L, int k, const mf_task_id *gate, int gu0, int gu1);
/* The record of a heads task `op` of layer L over items [i0, i1) and heads [h0, h1). */
mf_sg_task mf_sg_heads_rec(const mf_config *c, int L, int op, int i0, int i1, int h0, int h1, int n, int exact);
/* A host heads record with the attention's linears on cards: its bf16 casts. */
void mf_sg_heads_host_cast(mf_sg_task *t);
/* The heads of unit k of layer L on the cards, between `core` and `ring` and the oa stage's tasks;
 * each item group's q prep after the qb stage's tasks qb[0..n_oa) over its items. */
void mf_sg_heads_on_cards(mf_sg_builder *b, int L, int k, mf_task_id core, mf_task_id ring, const mf_task_id *qb,
                          const mf_task_id *oa, int n_oa);

/* ---- the final norm and head (stepgraph_head.c) ---- */

/* A norm part of `cols` columns of H. */
void mf_sg_norm_price(const mf_sg_builder *b, mf_sg_task *t, double H, double cols);
/* Item group i's collapse -> norm `op` column parts, into nrm[] (L -1: the final norm). */
void mf_sg_collapse_norm(mf_sg_builder *b, int L, int i, int op, int phase, const mf_task_id *after, int n_after,
                         mf_task_id *nrm);

/* ---- the sublayers, in the order mf_stepgraph_new builds them ---- */

void mf_sg_prefetch(mf_sg_builder *b, int L);                                   /* stepgraph_place.c */
void mf_sg_engram(mf_sg_builder *b, int L, mf_task_id *unit);                   /* stepgraph_engram.c */
void mf_sg_attn(mf_sg_builder *b, int L, const mf_task_id *unit, mf_task_id *post);   /* stepgraph_attn.c */
void mf_sg_moe(mf_sg_builder *b, int L, const mf_task_id *post, mf_task_id *unit);    /* stepgraph_moe.c */
void mf_sg_head(mf_sg_builder *b, const mf_task_id *unit);                      /* stepgraph_head.c */
mf_task_id mf_sg_net_in(mf_sg_builder *b);                                      /* stepgraph_net.c */
void mf_sg_net_out(mf_sg_builder *b, const mf_task_id *unit);                   /* stepgraph_net.c */

/* ---- the DSpark draft (stepgraph_draft.c) ---- */

/* -EINVAL with a message unless o's draft graph can be built (a config with draft stages, units of
 * dspark_block_size items, at most MF_SG_MAX_GROUPS items, host only, a whole model's layers). */
int mf_sg_draft_check(const mf_sg_opts *o);
/* Per unit the feed of its pending features, into unit[] (what each unit's first stage waits for). */
void mf_sg_draft_feed(mf_sg_builder *b, mf_task_id *unit);
/* Verify graphs (feats): at a draft target layer L, per unit its items' features after unit[k]
 * (the layer's input), into unit[k]. Nothing at other layers. */
void mf_sg_draft_feat(mf_sg_builder *b, int L, mf_task_id *unit);
/* Draft stage L's attention core of unit k after the in and qb stages' row parts: the block's KV,
 * then the heads in groups, before the oa parts. Returns the last task the post waits for. */
mf_task_id mf_sg_draft_core(mf_sg_builder *b, int L, int k, mf_task_id (*rows)[MF_SG_MAX_PARTS]);
/* After the head (head_done: its parts' join): the greedy chain, per candidate the Markov head's
 * row parts over every unit, then each unit's pick. */
void mf_sg_draft_propose(mf_sg_builder *b, mf_task_id head_done);

/* Prefetch after finalize (stepgraph_place.c): the links' head start per layer, the copy-ins' ranks. */
int mf_sg_pre_ahead(const mf_sg_opts *o, mf_stepgraph *sg);
int mf_sg_pre_ranks(const mf_sg_opts *o, mf_stepgraph *sg);

#endif
