/* The per-lane arithmetic of the CUDA attention kernel (device/dev_kernels.cu k_attn), written once
 * for the GPU and the host: a key's score as host/kernels.h's 16-lane dot (lane l sums elements
 * l, l + 16, ... with fmaf; the half-warp's shuffle tree adds lanes l + 8, l + 4, then l + 2 and
 * l + 1, which is mf_kern_vec_dots' tree), and a value element's fmaf chain in key order.
 * tests/test_dev_kmath.c runs the kernel's schedule on the host with these functions against
 * device/dense_host.h's mf_dense_host_attn. */
#ifndef MF_KERN_ATTN_H
#define MF_KERN_ATTN_H

#include <stdint.h>

#ifdef __CUDACC__
#define MF_DA_FN static __host__ __device__ __forceinline__
#else
#define MF_DA_FN static inline
#endif

/* Lane l (0..15) of the dot of q and k (D floats, a multiple of 16). */
MF_DA_FN float mf_da_lane(const float *q, const float *k, int D, int l)
{
    float acc = 0.0f;
    for (int j = l; j < D; j += 16) acc = fmaf(q[j], k[j], acc);
    return acc;
}

/* The 16 lanes' tree in the half-warp's shuffle order (host/kern_vec.c mf_vec_tree16). */
MF_DA_FN float mf_da_tree16(const float *l)
{
    float t[8], u[4];
    for (int i = 0; i < 8; i++) t[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; i++) u[i] = t[i] + t[i + 4];
    return (u[0] + u[2]) + (u[1] + u[3]);
}

/* Element d of the weighted values: e[i] times key row i's element d, one fmaf chain in key order
 * (kv rows D floats apart, rows[i] the key rows). */
MF_DA_FN float mf_da_value(const float *e, const float *kv, const int32_t *rows, int64_t n, int D, int d)
{
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc = fmaf(e[i], kv[(int64_t)rows[i] * D + d], acc);
    return acc;
}

#endif
