/* The host implementations of the dense device ops (device/dev.h mf_dev_linear, mf_dev_round_bf16,
 * mf_dev_ffn_up, mf_dev_swiglu_bf16): what an emulated card runs on its compute stream, and the
 * answer the startup self-check and the CUDA tests hold a card to. Host pointers; arguments as
 * device/dev.c checked them. The KERN sums and the FFN phase call host/kernels.h; the REF sums and
 * the exact gating restate graphs/layers' mf_ly_linear_rows and the engine's exact epilogue loop
 * for loop (device/ cannot call graphs/), and tests/test_dev_dense.c holds them to those bit for
 * bit. Not a public header of the device interface. */
#ifndef MF_DENSE_HOST_H
#define MF_DENSE_HOST_H

#include "device/dev.h"

int mf_dense_host_linear(const mf_dev_lin *a);
void mf_dense_host_round_bf16(float *y, int n_tok, int64_t ld, int n);
/* mf_dev_bf16_pack (pack 1) and _unpack (pack 0; rows: _gather): per token one mf_kern_vec_bf16_pack / _unpack row. */
void mf_dense_host_bf16_cast(int pack, float *x, int64_t ld_x, uint16_t *y, int64_t ld_y, const int32_t *rows, int n_tok,
                             int n);
int mf_dense_host_ffn_up(const mf_dev_up *a);
void mf_dense_host_swiglu_bf16(const float *g, const float *u, int n_tok, int64_t ld, int n, float limit, float *h);

/* mf_dev_attn_heads on host pointers: per token and group of up to 4 heads (with q_rope_dim their
 * queries prepared in a copy) mf_kern_vec_attn (scratch: 4 x MF_DEV_ATTN_MAX_KEYS floats), then the
 * output's division and bf16 rounding (with rope_dim its inverse RoPE). 0, or -EINVAL
 * for a token's key count or key row out of range (read here). */
int mf_dense_host_attn(const mf_dev_attn *a, float *scratch);

/* mf_dev_index_scores on host pointers: per token mf_kern_vec_index_scores over its visible keys.
 * 0, or -EINVAL for a token's n_vis out of range (read here). */
int mf_dense_host_iscore(const mf_dev_iscore *a);
#endif
