/* The per-lane arithmetic of the CUDA attention kernel (device/dev_kernels.cu k_attn), written once
 * for the GPU and the host: a key's score as host/kernels.h's 16-lane dot (lane l sums elements
 * l, l + 16, ... with fmaf; the half-warp's shuffle tree adds lanes l + 8, l + 4, then l + 2 and
 * l + 1, which is mf_kern_vec_dots' tree), and a value element's fmaf chain in key order.
 * With it the forward RoPE of a query's roped part (mf_da_rope_fwd) and the inverse RoPE of the
 * output's (mf_da_rope_inv).
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
/* One float product, sum or difference, each rounded on its own (no fused multiply-add on the card) */
#ifdef __CUDA_ARCH__
#define MF_DA_MUL(a, b) __fmul_rn(a, b)
#define MF_DA_ADD(a, b) __fadd_rn(a, b)
#define MF_DA_SUB(a, b) __fsub_rn(a, b)
#else
#define MF_DA_MUL(a, b) ((a) * (b))
#define MF_DA_ADD(a, b) ((a) + (b))
#define MF_DA_SUB(a, b) ((a) - (b))
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

/* Pair i of a head output's inverse RoPE (graphs/step/fast_attn.c mf_fa_heads_o's mf_fa_rope_apply
 * with inverse 1): cs[i] the pair's cosine, cs[n_pairs + i] its sine, x the roped values; the four
 * products rounded first, then the difference and the sum. The caller rounds both to bf16. */
MF_DA_FN void mf_da_rope_inv(const float *cs, int n_pairs, int i, float *x)
{
    float c = cs[i], s = -cs[n_pairs + i], a = x[2 * i], b = x[2 * i + 1];
    float ac = MF_DA_MUL(a, c), bs = MF_DA_MUL(b, s), as = MF_DA_MUL(a, s), bc = MF_DA_MUL(b, c);
    x[2 * i] = MF_DA_SUB(ac, bs);
    x[2 * i + 1] = MF_DA_ADD(as, bc);
}

/* Pair i of a query's forward RoPE (mf_fa_heads_q's mf_fa_rope_apply with inverse 0), the same
 * table: cs[i] the cosine, cs[n_pairs + i] the sine; the products rounded first, then the
 * difference and the sum. The caller rounds the query to bf16 before and both values after. */
MF_DA_FN void mf_da_rope_fwd(const float *cs, int n_pairs, int i, float *x)
{
    float c = cs[i], s = cs[n_pairs + i], a = x[2 * i], b = x[2 * i + 1];
    float ac = MF_DA_MUL(a, c), bs = MF_DA_MUL(b, s), as = MF_DA_MUL(a, s), bc = MF_DA_MUL(b, c);
    x[2 * i] = MF_DA_SUB(ac, bs);
    x[2 * i + 1] = MF_DA_ADD(as, bc);
}

#endif
