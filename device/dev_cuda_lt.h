/* The CUDA backend's cuBLASLt path (device/dev.h "The cuBLASLt path"): per card one cublasLt
 * handle and a cache of the algorithm chosen for each GEMM shape, and the two ops built on it (the
 * dense linear and the routed expert's FFN): the activations' cast kernel, then cublasLtMatmul with
 * fp32 accumulation, alpha and beta read from the cast's header on the card. Built only with
 * MOEFLOW_CUDA; device/dev_cuda.c opens one per card. Not a public header. */
#ifndef MF_DEV_CUDA_LT_H
#define MF_DEV_CUDA_LT_H

#include "device/dev.h"

typedef struct mf_cuda_lt mf_cuda_lt;

/* Opens the context of CUDA device `device` (made current by the caller): cublasLtCreate. 0 or -EIO
 * naming the call. */
int mf_cuda_lt_open(int device, mf_cuda_lt **out);
/* Destroys the cached descriptors and the handle (NULL is fine). */
void mf_cuda_lt_close(mf_cuda_lt *lt);
/* MF_DEV_LIN_CUBLASLT (arguments as device/dev.c checked them): the cast of x, then one
 * cublasLtMatmul per group of rows (one for an ungrouped slice). stream: a cudaStream_t. */
int mf_cuda_lt_linear(mf_cuda_lt *lt, void *stream, const mf_dev_lin *a);
/* mf_dev_expert_ffn_lt: cast x, gu = w13 x, gating, cast h, y = w2 h. */
int mf_cuda_lt_ffn(mf_cuda_lt *lt, void *stream, const mf_dev_ffn_lt *a);

#endif
