/* The per-lane arithmetic of the CUDA int8 FP4 path (device/dev_kernels.cu), written once for the
 * GPU and the host: activation quantization (as mf_kern_q8_quantize: one scale per token per 256
 * inputs), E2M1 decoding to int8 with byte permutes, dp4a dot products and E8M0 block factors (as
 * host/kern_fp4.c: 2 x e2m1 codes, blocks more than 14 binades below their group's largest scale
 * dropped). tests/test_dev_kmath.c runs the kernels' lane schedule on the host with these same
 * functions against host/kernels.h, so the math is checked on machines without a card. */
#ifndef MF_KERN_Q8_H
#define MF_KERN_Q8_H

#include <stdint.h>

#ifdef __CUDACC__
#define MF_Q8K_FN static __host__ __device__ __forceinline__
#else
#define MF_Q8K_FN static inline
#endif

#define MF_Q8K_GROUP 256        /* inputs per activation scale */
#define MF_Q8K_GROUP_BLOCKS 8   /* 32-blocks per activation scale */

/* The device layout of a q8 scratch (any buffer of mf_kern_q8_bytes(n_tok, n_in) bytes; the
 * host's interleaved layout is not used on the card): codes int8 [n_tok][n_in] from the first
 * 16-byte aligned address, then the scales float [n_tok][n_sb]. */
typedef struct mf_q8k_view {
    int8_t *q;
    float *scale;
    int n_sb;
} mf_q8k_view;

MF_Q8K_FN mf_q8k_view mf_q8k_view_of(void *scratch, int n_tok, int n_in)
{
    mf_q8k_view v;
    uintptr_t p = ((uintptr_t)scratch + 15) & ~(uintptr_t)15;
    v.q = (int8_t *)p;
    v.scale = (float *)(p + (size_t)n_tok * (size_t)n_in);   /* n_in % 32 == 0: aligned */
    v.n_sb = (n_in / 32 + MF_Q8K_GROUP_BLOCKS - 1) / MF_Q8K_GROUP_BLOCKS;
    return v;
}

MF_Q8K_FN float mf_q8k_bits_float(uint32_t u)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    union { uint32_t u; float f; } v;
    v.u = u;
    return v.f;
#endif
}

/* A group's scale and inverse step from its max |x| (nonfinite: it holds inf or NaN), exactly as
 * host/kern_fp4.c: NaN scale and zero codes for a nonfinite group, zero scale and codes for an
 * all-zero (or too tiny) group, else scale = amax / 127 and inverse 127 / amax. */
MF_Q8K_FN float mf_q8k_group_inv(float amax, int nonfinite, float *scale)
{
    if (nonfinite) {
        *scale = mf_q8k_bits_float(0x7FC00000u);
        return 0.0f;
    }
    float inv = 127.0f / amax;
    if (amax == 0.0f || !(inv <= 3.402823466e+38f)) {
        *scale = 0.0f;
        return 0.0f;
    }
    *scale = amax / 127.0f;
    return inv;
}

/* The int8 code of x: round to nearest even of x * inv, saturated (0 where inv is 0). */
MF_Q8K_FN int mf_q8k_code(float x, float inv)
{
    if (inv == 0.0f) return 0;
#ifdef __CUDA_ARCH__
    float v = rintf(__fmul_rn(x, inv));
#else
    float v = __builtin_rintf(x * inv);
#endif
    return v > 127.0f ? 127 : v < -128.0f ? -128 : (int)v;
}

/* __byte_perm(x, y, s) for selectors whose nibbles are 0..7 (bit 3 clear): byte n of the result
 * is byte (s >> 4n) & 7 of the 8 bytes y:x. */
MF_Q8K_FN uint32_t mf_q8k_perm(uint32_t x, uint32_t y, uint32_t s)
{
#ifdef __CUDA_ARCH__
    return __byte_perm(x, y, s);
#else
    uint64_t v = ((uint64_t)y << 32) | x;
    uint32_t r = 0;
    for (int n = 0; n < 4; n++) r |= (uint32_t)((v >> (8 * ((s >> (4 * n)) & 7u))) & 0xFFu) << (8 * n);
    return r;
#endif
}

/* Signed 4-way byte dot product plus c (dp4a, sm_61 and later). */
MF_Q8K_FN int32_t mf_q8k_dp4a(int32_t a, int32_t b, int32_t c)
{
#ifdef __CUDA_ARCH__
    return __dp4a(a, b, c);
#else
    for (int n = 0; n < 4; n++)
        c += (int32_t)(int8_t)(uint8_t)((uint32_t)a >> (8 * n)) * (int32_t)(int8_t)(uint8_t)((uint32_t)b >> (8 * n));
    return c;
#endif
}

/* 8 E2M1 codes (4 packed bytes, low nibble first: element 2i in the low nibble of byte i) to 8
 * int8 values 2 x e2m1 (exact: 0, +-1, 2, 3, 4, 6, 8, 12): w[0] holds elements 0..3, w[1] 4..7. */
MF_Q8K_FN void mf_q8k_fp4_word(uint32_t q, int32_t w[2])
{
    const uint32_t p0 = 0x03020100u, p1 = 0x0C080604u;   /* 0 1 2 3 | 4 6 8 12 */
    const uint32_t n0 = 0xFDFEFF00u, n1 = 0xF4F8FAFCu;   /* 0 -1 -2 -3 | -4 -6 -8 -12 */
    for (int h = 0; h < 2; h++) {
        uint32_t c = (q >> (16 * h)) & 0xFFFFu;          /* codes of 4 elements, one per nibble */
        uint32_t m = c & 0x7777u, sgn = (c & 0x8888u) >> 1;
        uint32_t pos = mf_q8k_perm(p0, p1, m), neg = mf_q8k_perm(n0, n1, m);
        w[h] = (int32_t)mf_q8k_perm(pos, neg, 0x3210u | sgn);   /* byte n: pos[n], or neg[n] */
    }
}

/* Decodes one 32-block (16 packed bytes as 4 words) to 8 words of int8 weights. */
MF_Q8K_FN void mf_q8k_fp4_block(const uint32_t wq[4], int32_t w[8])
{
    for (int k = 0; k < 4; k++) mf_q8k_fp4_word(wq[k], w + 2 * k);
}

/* sum over 32 inputs of w * x (int8 each, 8 words each): exact in int32 (|sum| <= 32*12*128). */
MF_Q8K_FN int32_t mf_q8k_block_dot(const int32_t w[8], const int32_t x[8])
{
    int32_t d = 0;
    for (int k = 0; k < 8; k++) d = mf_q8k_dp4a(w[k], x[k], d);
    return d;
}

/* The factor of a block with E8M0 code e in a group whose largest code is emax, for the integer
 * sum of 2 x e2m1 times q: 2^(e - 128); 0 when more than 14 binades below emax (as the host's
 * int16 factors drop it); NaN when emax is 0xFF (the host's group scale is NaN then). */
MF_Q8K_FN float mf_q8k_block_factor(unsigned e, unsigned emax)
{
    if (emax == 0xFFu) return mf_q8k_bits_float(0x7FC00000u);
    if (emax - e > 14u) return 0.0f;
    if (e >= 2u) return mf_q8k_bits_float((e - 1u) << 23);
    return mf_q8k_bits_float(0x00200000u << e);   /* 2^-128, 2^-127: subnormal */
}

/* One block's value for one token: (sum of w x over the block) x the block's factor, exact unless
 * it underflows. xb: the block's 32 int8 codes (16-byte aligned). The kernels add it into the
 * token's sum as fmaf(value, group scale, sum), written out so that no compiler contracts it
 * differently on the card and on the host. */
MF_Q8K_FN float mf_q8k_block_value(const int32_t w[8], float f, const int8_t *xb)
{
    int32_t x[8];
#ifdef __CUDA_ARCH__
    int4 a = ((const int4 *)xb)[0], b = ((const int4 *)xb)[1];
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
#else
    for (int k = 0; k < 8; k++)
        x[k] = (int32_t)((uint32_t)(uint8_t)xb[4 * k] | (uint32_t)(uint8_t)xb[4 * k + 1] << 8 |
                         (uint32_t)(uint8_t)xb[4 * k + 2] << 16 | (uint32_t)(uint8_t)xb[4 * k + 3] << 24);
#endif
    return (float)mf_q8k_block_dot(w, x) * f;
}

#endif
