/* The per-lane arithmetic of the CUDA dense linears (device/dev_kernels.cu k_lin, and the tiled
 * k_lin_tiled's weight decoding), written once for the GPU and the host: E4M3 and BF16 decoding from bits, the bf16 rounding, and where a lane's
 * 16-byte chunk of a weight row sits (its columns, its 32x32 tile's scale, the x columns of its
 * row's group). tests/test_dev_kmath.c runs the kernel's lane schedule on the host with these
 * same functions against device/dense_host.h, so the indexing and the math are checked on
 * machines without a card. */
#ifndef MF_KERN_DENSE_H
#define MF_KERN_DENSE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "host/kernels.h"

#ifdef __CUDACC__
#define MF_DK_FN static __host__ __device__ __forceinline__
#else
#define MF_DK_FN static inline
#endif

/* Columns per 16-byte chunk: 16 FP8 codes or 8 BF16 values; a chunk lies inside one 32-column block. */
#define MF_DK_CPC(fmt) ((fmt) == MF_KERN_FP8 ? 16 : 8)

MF_DK_FN float mf_dk_float(uint32_t u)
{
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

MF_DK_FN uint32_t mf_dk_bits(float f)
{
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
#endif
}

/* E4M3 from its bits: normal 2^(e-7) (1 + m/8), subnormal m 2^-9, S.1111.111 NaN. */
MF_DK_FN float mf_dk_e4m3(uint32_t b)
{
    uint32_t e = (b >> 3) & 15u, m = b & 7u;
    float v = e ? mf_dk_float(((e + 120u) << 23) | (m << 20)) : (float)m * 0.001953125f;
    if ((b & 0x7Fu) == 0x7Fu) v = mf_dk_float(0x7FC00000u);
    return (b & 0x80u) ? -v : v;
}

/* E8M0 from its bits: 2^(code - 127), code 0 2^-127 (subnormal), 0xFF NaN: host/formats.h's. */
MF_DK_FN float mf_dk_e8m0(uint32_t code)
{
    if (code == 0xFFu) return mf_dk_float(0x7FC00000u);
    if (code == 0u) return mf_dk_float(0x00400000u);
    return mf_dk_float(code << 23);
}

/* The tiled kernel's weights (device/dev_kernels.cu k_lin_tiled): row i, column k of a slice, as
 * its code's value (FP8: e4m3, unscaled; BF16: the value), its tile's scale, and decoded (FP8: the
 * code times its 32x32 tile's E8M0 scale, the host's exact value; BF16: the value). */
MF_DK_FN float mf_dk_code(int fmt, const void *w, int n_in, int i, int k)
{
    size_t at = (size_t)i * (size_t)n_in + (size_t)k;
    if (fmt == MF_KERN_FP8) return mf_dk_e4m3(((const uint8_t *)w)[at]);
    return mf_dk_float((uint32_t)((const uint16_t *)w)[at] << 16);
}
/* the scale of row i's 32x32 tile at column k (FP8; BF16: 1) */
MF_DK_FN float mf_dk_tile_scale(int fmt, const uint8_t *scale, int n_in, int i, int k)
{
    return fmt == MF_KERN_FP8 ? mf_dk_e8m0(scale[(size_t)(i / 32) * (size_t)(n_in / 32) + (size_t)(k / 32)]) : 1.0f;
}
MF_DK_FN float mf_dk_weight(int fmt, const void *w, const uint8_t *scale, int n_in, int i, int k)
{
    float c = mf_dk_code(fmt, w, n_in, i, k);
    return fmt == MF_KERN_FP8 ? c * mf_dk_tile_scale(fmt, scale, n_in, i, k) : c;
}

/* Round to nearest even bf16, NaN to the quiet NaN of its sign: host/formats.h's bits. */
MF_DK_FN float mf_dk_bf16(float x)
{
    uint32_t b = mf_dk_bits(x);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return mf_dk_float((b & 0x80000000u) | 0x7FC00000u);
    b += 0x7FFFu + ((b >> 16) & 1u);
    return mf_dk_float(b & 0xFFFF0000u);
}

/* The weights of a chunk (its 16 bytes as 4 little-endian words) into wv[0..MF_DK_CPC), each
 * times scale (FP8; BF16 has none). */
MF_DK_FN void mf_dk_decode(int fmt, const uint32_t q[4], float scale, float wv[16])
{
    if (fmt == MF_KERN_FP8) {
        for (int j = 0; j < 16; j++) wv[j] = mf_dk_e4m3((q[j >> 2] >> (8 * (j & 3))) & 0xFFu) * scale;
    } else {
        for (int j = 0; j < 8; j++) wv[j] = mf_dk_float(((q[j >> 1] >> (16 * (j & 1))) & 0xFFFFu) << 16);
    }
}

/* Row i of a slice: the index of chunk c's scale (FP8: tile row i / 32, block c * 16 / 32), and the
 * first x column of the row's group (grouped: (row0 + i) / group_rows groups of n_in columns). */
MF_DK_FN size_t mf_dk_scale_at(int n_in, int i, int c) { return (size_t)(i / 32) * (size_t)(n_in / 32) + (size_t)(c * 16 / 32); }
MF_DK_FN long long mf_dk_xoff(long long row0, int group_rows, int n_in, int i)
{
    return group_rows ? (row0 + i) / group_rows * n_in : 0;
}

#endif
