/* The CUDA backend's kernels (device/dev_kernels.cu), launched by device/dev_cuda.c on a stream:
 * FP4 (fp32 and int8 paths) and FP8 matmuls and the expert FFN over device pointers, same shapes
 * as device/dev.h. Built only with MOEFLOW_CUDA. */
#ifndef MF_DEV_CUDA_KERN_H
#define MF_DEV_CUDA_KERN_H

#include "device/dev.h"

/* stream: a cudaStream_t. Arguments are checked by device/dev.c. 0, or -EIO naming the launch. */
int mf_cuda_kern_matmul(void *stream, const mf_kern_mat *w, const float *x, int n_tok, float *y);
/* The int8 path: x quantized into q8_scratch (mf_kern_q8_bytes(n_tok, w->n_in) bytes, laid out
 * as device/kern_q8.h's mf_q8k_view), then the dp4a kernel. */
int mf_cuda_kern_fp4_q8(void *stream, const mf_kern_mat *w, const float *x, int n_tok, float *y,
                        void *q8_scratch);
/* The expert FFN; a->q8_scratch selects the int8 path for the FP4 matrices. */
int mf_cuda_kern_ffn(void *stream, const mf_dev_ffn *a);
/* The slot-table FFN (int8 path): blockIdx.z per slot, entries read when the kernels run. */
int mf_cuda_kern_ffn_table(void *stream, const mf_dev_ffn_table *a);
/* The dense ops (device/dev.h mf_dev_linear, mf_dev_round_bf16, mf_dev_ffn_up, mf_dev_swiglu_bf16);
 * FP8 and BF16 mf_cuda_kern_matmul run the same linear kernel. tiled: the tiled kernel (the caller
 * checked mf_dev_lin_tiled_ok), else the warp-per-row one. */
int mf_cuda_kern_linear(void *stream, const mf_dev_lin *a, int tiled);
int mf_cuda_kern_round_bf16(void *stream, float *y, int n_tok, int64_t ld, int n);
/* mf_dev_bf16_pack (pack 1) and _unpack (pack 0). */
int mf_cuda_kern_bf16_cast(void *stream, int pack, float *x, int64_t ld_x, uint16_t *y, int64_t ld_y, int n_tok, int n);
/* tiled: the tiled kernel's UP variant (both weight tiles per block), else the warp-per-row one. */
int mf_cuda_kern_ffn_up(void *stream, const mf_dev_up *a, int tiled);
int mf_cuda_kern_swiglu_bf16(void *stream, const float *g, const float *u, int n_tok, int64_t ld, int n,
                             float limit, float *h);
/* mf_dev_attn_heads: a block per (token, head), device/kern_attn.h's lanes (device/dev.h says
 * where the bits differ from the host's). */
int mf_cuda_kern_attn_heads(void *stream, const mf_dev_attn *a);
/* mf_dev_index_scores: a block per (16 keys, token), a half-warp per key (device/dev.h). */
int mf_cuda_kern_index_scores(void *stream, const mf_dev_iscore *a);

/* The cuBLASLt path's kernels (device/dev_lt_kernels.cu; its GEMMs: device/dev_cuda_lt.h).
 * mf_dev_dequant; the activations' cast into x16 (header and codes, n_tok rows of cols from x, ld_x
 * apart; alpha 2^(w_shift + xs) into the header); the expert FFN's gating in place in gu. */
int mf_cuda_kern_lt_dequant(void *stream, const mf_kern_mat *w, const mf_dev_w16 *out);
int mf_cuda_kern_lt_cast(void *stream, int f16, const float *x, int n_tok, int64_t ld_x, int64_t cols, int w_shift,
                         void *x16);
int mf_cuda_kern_lt_gate(void *stream, float *gu, int n_tok, int I, const float *tok_weight, float limit);

#endif
