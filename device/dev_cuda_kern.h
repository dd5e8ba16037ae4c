/* The CUDA backend's kernels (device/dev_kernels.cu), launched by device/dev_cuda.c on a stream:
 * fp32-path FP4 and FP8 matmuls and the expert FFN over device pointers, same shapes as
 * device/dev.h. The int8 FP4 path is not on CUDA yet. Built only with MOEFLOW_CUDA. */
#ifndef MF_DEV_CUDA_KERN_H
#define MF_DEV_CUDA_KERN_H

#include "device/dev.h"

/* stream: a cudaStream_t. Arguments are checked by device/dev.c. 0, or -EIO naming the launch. */
int mf_cuda_kern_matmul(void *stream, const mf_kern_mat *w, const float *x, int n_tok, float *y);
int mf_cuda_kern_ffn(void *stream, const mf_dev_ffn *a);

#endif
