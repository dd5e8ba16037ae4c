/* The host side of the cuBLASLt path (device/dev.h "The cuBLASLt path"): what an emulated card runs
 * for mf_dev_dequant, MF_DEV_LIN_CUBLASLT linears and mf_dev_expert_ffn_lt (device/kern_lt.h's
 * casts and dequantization, then the product in host/kernels.h's fixed fp32 order over the 16-bit
 * scratch), and the answer a card is held to (the host's FP8 / FP4 fp32 kernels on the activations
 * as the card casts them). The two agree bit for bit: a 16-bit weight times 2^shift is the host's
 * decoded weight exactly, the cast activations times 2^xs their float exactly, and scaling every
 * term of an fp32 sum by one power of two scales each rounding with it (tests/test_dev.c holds them
 * to it with memcmp). Host pointers; arguments as device/dev.c checked them. Not a public header. */
#ifndef MF_LT_HOST_H
#define MF_LT_HOST_H

#include "device/dev.h"

/* Buffers an emulated stream keeps for the products (grown on first use, freed at close). */
typedef struct mf_lt_host_scratch {
    float *x;            /* a block of tokens' activations widened to fp32 */
    size_t x_cap;        /* floats */
    uint16_t *w;         /* a block of FP16 weight rows as bf16 codes (exact) */
    size_t w_cap;        /* codes */
} mf_lt_host_scratch;
void mf_lt_host_scratch_free(mf_lt_host_scratch *sc);

/* mf_dev_dequant on host pointers: every value as device/kern_lt.h mf_lt_dequant; -ERANGE naming
 * the first weight whose value the type does not hold exactly (the plan was not followed). */
int mf_lt_host_dequant(const mf_kern_mat *w, const mf_dev_w16 *out);
/* MF_DEV_LIN_CUBLASLT on host pointers: the cast of x into a->lt.x16 (header and codes, as a card
 * writes them), then the product. 0, -ENOMEM, or -ERANGE for a weight the bf16 codes cannot hold. */
int mf_lt_host_linear(const mf_dev_lin *a, mf_lt_host_scratch *sc);
/* mf_dev_expert_ffn_lt on host pointers, as mf_lt_host_linear. */
int mf_lt_host_ffn(const mf_dev_ffn_lt *a, mf_lt_host_scratch *sc);

/* The activations as a card multiplies them: out[t * ld_out + k] = widen16(cast(x[t * ld_x + k]))
 * * 2^xs for k < cols, xs the call's fp16 shift over those columns (device/kern_lt.h); returns xs. */
int mf_lt_host_x_values(mf_dev_f16 type, const float *x, int n_tok, int64_t ld_x, int64_t cols, float *out,
                        int64_t ld_out);
/* The answer for mf_dev_expert_ffn_lt of host FP4 matrices w1, w3 [I][H] and w2 [H][I]: x's card
 * values, g and u by mf_kern_fp4_matmul_f32, h = mf_kern_gate(g, u, limit) * tok_weight, h's card
 * values, y = w2 h by mf_kern_fp4_matmul_f32. gu: n_tok x 2I floats of scratch, xv n_tok x max(H,
 * I). 0 or the kernels' -EINVAL. (The linear's answer is device/dense_host.h mf_dense_host_linear
 * on mf_lt_host_x_values.) */
int mf_lt_host_ffn_ref(mf_dev_f16 type, const mf_kern_mat *w1, const mf_kern_mat *w3, const mf_kern_mat *w2,
                       const float *x, int n_tok, const float *tok_weight, float limit, float *gu, float *xv,
                       float *y);

#endif
