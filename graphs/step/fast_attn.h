/* The scheduled engine's own fast versions of per-item layer math (graphs/layers/layers.h is the
 * module they are tested against; the engine's --exact path keeps the module): the attention
 * core's heads, the indexer's scores and selection, the hyper-connection mixes, collapse and
 * expand, the grouped wo_a and the router gate on the kernels. The engine's tasks (graphs/step/step_*.c) call them.
 *
 * Sums: a dot product of n floats is 16 lanes (lane l sums elements k = l mod 16 in k order with
 * fmaf), then a fixed tree (lanes l and l+8, then l+4, l+2, l+1); the attention's weighted values
 * are one fmaf chain per output element in key order. The AVX2 path (host/kernels.h's run-time
 * choice, mf_kern_simd_active) and the scalar path compute exactly that, so both give the same
 * bits, and every output element depends only on its own item, head or row: any split of heads,
 * rows, columns or entries, any thread count and any chunk size give the same bits.
 *
 * Against the module (tests/test_fast_attn.c, fresh random data): the heads, scores and mixes sum
 * in fp32 where the module sums in double (outputs within ~1e-6 relative before their bf16
 * rounding, which can then move single elements by one bf16 step); collapse and expand equal the
 * module bit for bit (their products are exact in double, so the order is the module's). */
#ifndef MF_FAST_ATTN_H
#define MF_FAST_ATTN_H

#include "graphs/layers/layers.h"

/* mf_ly_attn_core_heads (same arguments, scratch: cx->scores as floats) with fp32 sums: queries
 * rounded and roped as the module does, q.k over the window and the selection for up to 4 heads
 * per pass over the keys (heads share the keys), softmax with the sink (expf, the denominator in
 * double), weighted values, inverse RoPE. */
void mf_fa_attn_heads(mf_ly_ctx *cx, const mf_ly_item *it, int L, float *const *b, int h0, int h1,
                      const mf_ly_win *win);
/* The pieces of mf_fa_attn_heads that a card's heads (device/dev.h mf_dev_attn_heads, which computes
 * the rest) leave to the host, for heads [h0, h1) of item it on layer L: the queries q (the item's
 * MF_LY_A_Q row) rounded, roped at the item's position and rounded again, and the outputs o (its
 * MF_LY_A_O row) inverse-roped and their roped part rounded. The fast heads run (these pieces and
 * 16-lane dots) where mf_fa_heads_fast(c) is 1 (head_dim <= 512, qk_rope_head_dim <= 128); else
 * mf_fa_attn_heads calls the module. */
int mf_fa_heads_fast(const mf_config *c);
void mf_fa_heads_q(const mf_layers *ly, const mf_ly_item *it, int L, float *q, int h0, int h1);
void mf_fa_heads_o(const mf_layers *ly, const mf_ly_item *it, int L, float *o, int h0, int h1);
/* The table mf_fa_heads_o's inverse RoPE of item it on layer L uses: cs[0, rd / 2) the cosines,
 * cs[rd / 2, rd) the sines (rd = qk_rope_head_dim), the same floats; a card's heads take it
 * (device/dev.h mf_dev_attn.rope) to do mf_fa_heads_o's work bit for bit. */
void mf_fa_heads_rope_cs(const mf_layers *ly, const mf_ly_item *it, int L, float *cs);
/* mf_ly_ring_get (same arguments) vectorized where the kernels run AVX2 and head_dim is a
 * multiple of MF_LY_RING_BLOCK: the module's floats bit for bit (tests/test_kvpack.c), NaN codes
 * and the inf scale included. */
void mf_fa_ring_rows(const mf_config *c, const mf_ref_state *st, int L, int64_t t0, int64_t n, float *out);
/* mf_ly_index_scores with fp32 dots: score[j] for j in [j0, j1). */
void mf_fa_index_scores(const mf_layers *ly, const mf_ly_item *it, int L, float *const *b, double *score,
                        int64_t j0, int64_t j1);
/* mf_ly_attn_core_select with the same result (the top-k and the candidate blocks as sets are
 * the k first of a total order, found by quickselect instead of a sort of all entries; scores
 * holding NaN go to the module, whose sort decides them). */
void mf_fa_attn_select(mf_ly_ctx *cx, mf_ly_item *it, int L, double *score);
/* mf_ly_hc_mixes_rows with fp32 sums (the streams' mean square and each row). */
void mf_fa_hc_mixes_rows(const mf_ly_ctx *cx, const float *x, const mf_weight *fn, float *mixes, int k0, int k1);
/* mf_fa_hc_mixes_rows of n_items items (streams x[i], rows [k0, k1) into mixes[i]), each item's
 * mixes the bits of its own call, the rows read once per mf_fa_mix_items(c, k1 - k0, n_items)
 * items: up to 4 items (MF_FA_MIX_FOURS) against each row at a time (mf_kern_vec_dots_keys;
 * scratch: cx->hc_xn holds four items' normed streams); more in blocks of up to MF_FA_MIX_ITEMS
 * items against all rows MF_FA_MIX_COLS columns at a time, every item's and row's 16 lanes carried
 * from block to block (mf_kern_vec_dots_lanes; scratch: cx->hc_xn holds them), which reads each
 * item's streams twice (the mean square, then the blocks). More than MF_FA_MIX_MAX_ROWS rows, or
 * weights not fp32: mf_fa_hc_mixes_rows per item. */
#define MF_FA_MIX_FOURS 4
#define MF_FA_MIX_ITEMS 64
#define MF_FA_MIX_COLS 1024
#define MF_FA_MIX_MAX_ROWS 64
void mf_fa_hc_mixes_rows_items(const mf_ly_ctx *cx, const float *const *x, int n_items, const mf_weight *fn,
                               float *const *mixes, int k0, int k1);
/* The items of a call of mf_fa_hc_mixes_rows_items over n_items items and n_rows rows that share
 * one read of the rows (one home: the engine's kernel and the step graph's price read it): 1 over
 * MF_FA_MIX_MAX_ROWS rows; 4 up to 4 items; else the blocked kernel's items per block, the most
 * (a multiple of 4, at most MF_FA_MIX_ITEMS) whose lanes (16 floats per item and row) fit the
 * 4 x hc_mult x hidden floats of cx->hc_xn, or 4 where fewer than 8 fit. */
int mf_fa_mix_items(const mf_config *c, int n_rows, int n_items);
/* mf_ly_hc_collapse_cols and mf_ly_hc_expand_cols, vectorized: the module's bits. */
void mf_fa_hc_collapse_cols(const mf_ly_ctx *cx, const float *x, const float *pre, float *h, int64_t d0, int64_t d1);
void mf_fa_hc_expand_cols(const mf_ly_ctx *cx, float *x, const float *out, const float *post, const float *comb,
                          int64_t d0, int64_t d1);
/* The combine's sum, columns [d0, d1): out[d] = bf(sum in double of bf(y[rows[k] * ld + d]) for k in
 * [0, n) in that order, then + sh[d] when sh is not NULL), 8 columns at a time under AVX2: the bits
 * of the scalar loop (each column's sum in the same order). A row r with row16 non-NULL and
 * row16[r] nonzero is read from the bf16 codes y16 (the same layout as y) instead: the float of
 * its code in place of bf(y), the same value when y16 holds y's codes (the routed rows copied out
 * of cards as bf16, graphs/step/stepgraph.h mf_sg_slot_tok_bytes). */
void mf_fa_combine_cols(const float *y, const uint16_t *y16, const uint8_t *row16, int64_t ld, const int32_t *rows,
                        int n, const float *sh, float *out, int64_t d0, int64_t d1);
/* mf_ly_rmsnorm_cols with the weights read inline, the columns 8 at a time under AVX2 (the sum of
 * squares over all n in the module's order, scalar): the module's bits. */
void mf_fa_rmsnorm_cols(const float *x, int64_t n, const mf_weight *w, double eps, float *out, int64_t c0,
                        int64_t c1);
/* 1 when grouped linear l (wo_a) runs on the FP8 kernels in mf_fa_grouped_rows (resident FP8 in
 * 32x32 blocks, columns and group rows multiples of 32): the one rule the host's tasks and the
 * dense cards' launches follow. */
int mf_fa_grouped_kern(const mf_ly_attn_lin *l);
/* mf_ly_attn_lin_rows for a grouped linear (wo_a) on the FP8 kernels (fp32 sums; the module sums in
 * double) when the weight is resident FP8 in 32x32 blocks and cx's backend is the kernels; else
 * the module's. Rows [r0, r1) for n_tok items; 0 or the kernels' / module's error. */
int mf_fa_grouped_rows(mf_ly_ctx *cx, const mf_ly_attn_lin *l, const float *x, int64_t ld_x, float *y,
                       int64_t ld_y, int n_tok, int64_t r0, int64_t r1);

/* mf_ly_gate_rows (same arguments) with the kernels' fp32 sums (host/kernels.h: 32 lanes, fmaf in
 * k order, a fixed tree; the module sums in double) where mf_ly_linear_part runs the gate on them
 * (cx's backend the kernels and mf_ly_linear_kern), else the module's. Every logit depends only on its row and item: any row split, token
 * count or thread count gives the same bits, the scalar path the AVX2 path's. 0 or the error. */
int mf_fa_gate_rows(mf_ly_ctx *cx, int L, const float *x, int n_tok, int64_t ld_x, float *logits, int64_t ld_y,
                    int64_t r0, int64_t r1);

#endif
