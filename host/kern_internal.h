/* Shared pieces of the CPU kernels (kern_*.c): argument checks, the fp32 tile engine that FP8,
 * BF16 and the FP4 fp32 path run on, and the fixed-order lane reductions both SIMD paths share.
 * Not a public header. */
#ifndef MF_KERN_INTERNAL_H
#define MF_KERN_INTERNAL_H

#include "host/kernels.h"

#include <immintrin.h>

/* Inputs per decoded tile of the fp32 engine (a multiple of 32; 2 KiB of floats). */
#define MF_KERN_TILE 512

/* Decodes inputs [k0, k0 + n) of row `row` of m to fp32 (exact values, scale applied); n is a
 * multiple of 32 and k0 of 32. */
typedef void (*mf_kern_decode_fn)(const mf_kern_mat *m, int row, int k0, int n, float *dst);

/* Checks a matmul call's arguments; 0 or -EINVAL with a message naming `who`. */
int mf_kern_check(const char *who, const void *w, const void *scale, int need_scale, int n_out,
                  int n_in, const void *x, int n_tok, int ld_x, const float *y, int ld_y, int r0,
                  int r1);

/* y rows [r0, r1) = W x with W decoded by dec_avx2 or dec_scalar (whichever path is active); every
 * output is 32 lanes (k mod 32) of fmaf in k order, then mf_kern_reduce32. */
void mf_kern_f32_run(const mf_kern_mat *m, mf_kern_decode_fn dec_avx2, mf_kern_decode_fn dec_scalar,
                     const float *x, int n_tok, int ld_x, float *y, int ld_y, int y_row0, int r0,
                     int r1);

/* Unchecked row kernels behind the public calls; row o of token t goes to
 * y[t * ld_y + o - y_row0] (y_row0 lets the FFN write row chunks into small buffers). */
void mf_kern_fp4_rows(const mf_kern_mat *m, const mf_kern_q8 *xq, float *y, int ld_y, int y_row0,
                      int r0, int r1);
void mf_kern_fp4_rows_f32(const mf_kern_mat *m, const float *x, int n_tok, int ld_x, float *y,
                          int ld_y, int y_row0, int r0, int r1);
void mf_kern_fp8_rows(const mf_kern_mat *m, const float *x, int n_tok, int ld_x, float *y,
                      int ld_y, int y_row0, int r0, int r1);
void mf_kern_bf16_rows(const mf_kern_mat *m, const float *x, int n_tok, int ld_x, float *y,
                       int ld_y, int y_row0, int r0, int r1);

/* Software prefetch of the weight stream MF_KERN_PREFETCH bytes ahead of [p, p + bytes): calls
 * with more than one token consume too slowly for the hardware prefetcher to hide DRAM latency
 * (measured: 3x slower at 2 tokens without it). Prefetches past an array's end do not fault. */
#define MF_KERN_PREFETCH 2048
static inline void mf_kern_prefetch(const void *p, size_t bytes)
{
    const char *c = (const char *)p + MF_KERN_PREFETCH;
    for (size_t i = 0; i < bytes; i += 64)
        __builtin_prefetch(c + i, 0, 3);
}

/* The FP8 one-token register path prefetches each row of its pair this far ahead instead: it
 * consumes a row pair's 2-4 KiB in a few hundred cycles, so 2 KiB ahead is under one DRAM
 * latency. Into L2 (prefetcht1), not L1: a T0 prefetch holds one of L1's few miss buffers until
 * its line arrives, and 8 KiB ahead of two interleaved row streams they run out, stalling the
 * loop on the prefetch itself (perf annotate of the BF16 head, which used it until issue 15: a
 * quarter of the kernel's samples on prefetcht0). docs/kernels.md "The one-token prefetch" has
 * the measurements; the BF16 one-token path now streams one row at a time without it. */
#define MF_KERN_PREFETCH_TOK1 8192
static inline void mf_kern_prefetch_tok1(const void *p)
{
    __builtin_prefetch((const char *)p + MF_KERN_PREFETCH_TOK1, 0, 2);   /* prefetcht1: to L2 */
}

/* Fixed-order sums: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) for 8 lanes; 32 lanes first add
 * (v0+v1)+(v2+v3) lane-wise over the four 8-lane vectors. */
static inline float mf_kern_reduce8(const float *v)
{
    float q0 = v[0] + v[4], q1 = v[1] + v[5], q2 = v[2] + v[6], q3 = v[3] + v[7];
    float r0 = q0 + q2, r1 = q1 + q3;
    return r0 + r1;
}

static inline float mf_kern_reduce32(const float *v)
{
    float s[8];
    for (int i = 0; i < 8; i++)
        s[i] = (v[i] + v[8 + i]) + (v[16 + i] + v[24 + i]);
    return mf_kern_reduce8(s);
}

/* mf_kern_reduce32 of the 32 lanes held in four 8-lane sums (lanes 0-7, 8-15, 16-23, 24-31). */
__attribute__((target("avx2,fma")))
static inline float mf_kern_reduce4x8_avx2(__m256 v0, __m256 v1, __m256 v2, __m256 v3)
{
    _Alignas(32) float l[8];
    _mm256_store_ps(l, _mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
    return mf_kern_reduce8(l);
}

/* 2^(e - 127 - shift) as float for an E8M0 code e (0xFF: NaN); exact, subnormals included, for
 * 0 <= shift <= 22. */
static inline float mf_kern_pow2_e8m0(unsigned e, int shift)
{
    union { uint32_t u; float f; } v;
    if (e == 0xFF) {
        v.u = 0x7FC00000u;
        return v.f;
    }
    int biased = (int)e - shift;      /* float32 biased exponent of the result */
    v.u = biased >= 1 ? (uint32_t)biased << 23 : 0x00400000u >> (-biased);
    return v.f;
}

#endif
