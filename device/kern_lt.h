/* The per-element arithmetic of the cuBLASLt path (device/dev.h MF_DEV_LIN_CUBLASLT,
 * mf_dev_dequant, mf_dev_expert_ffn_lt), written once for the card (device/dev_lt_kernels.cu) and
 * the host (device/lt_host.c: the emulated card and the answer a card is held to): a weight code
 * dequantized into a 16-bit float (FP8 E4M3 or FP4 E2M1 times its E8M0 scale, times 2^-shift),
 * float -> fp16 and -> bf16 rounding, and the activations' power-of-two shift for fp16.
 * tests/test_dev_kmath.c holds the dequantization to host/formats.h's decode of every code at every
 * scale the plan allows, and the roundings to host/formats.h's. */
#ifndef MF_KERN_LT_H
#define MF_KERN_LT_H

#include <stdint.h>

#include "device/kern_dense.h"

/* The 16-bit types (device/dev.h mf_dev_f16's values). */
#define MF_LT_BF16 1
#define MF_LT_FP16 2

/* Bytes of an activation scratch's header (device/dev.h mf_dev_lt_x16_bytes): word 0 the call's
 * largest finite |x| as float bits (fp16), word 1 the GEMM's alpha, word 2 its beta (0). The
 * 16-bit values follow. */
#define MF_LT_HDR_BYTES 256

/* The window of k (the weight's value is code x 2^k, k = e - 127 - shift) where every code of a
 * format is exact in a 16-bit type: the code's lowest bit (FP8 subnormal 2^-9, FP4 0.5 = 2^-1) not
 * below the type's smallest subnormal (fp16 2^-24, bf16 2^-133), the largest code (448, 6) times
 * 2^k below the type's largest finite value (65504; bf16 (2 - 2^-7) 2^127). */
MF_DK_FN int mf_lt_k_min(int type, int fmt)
{
    int lo_bit = fmt == MF_KERN_FP8 ? -9 : -1, sub = type == MF_LT_FP16 ? -24 : -133;
    return sub - lo_bit;
}
MF_DK_FN int mf_lt_k_max(int type, int fmt)
{
    /* fp16: 448 2^7 = 57344 and 6 2^13 = 49152 fit, one more binade does not; bf16: 448 2^119 and
     * 6 2^125 fit (largest finite 2^128 (1 - 2^-8)) */
    if (type == MF_LT_FP16) return fmt == MF_KERN_FP8 ? 7 : 13;
    return fmt == MF_KERN_FP8 ? 119 : 125;
}

/* The largest E8M0 scale code whose every value the host decodes as a finite float (448 x 2^119 and
 * 6 x 2^125 are; one binade more overflows): a matrix with a larger one has no exact 16-bit form. */
MF_DK_FN int mf_lt_e_max(int fmt) { return fmt == MF_KERN_FP8 ? 246 : 252; }

/* 2^k as a float, k in [-149, 127] (subnormal below -126). */
MF_DK_FN float mf_lt_pow2(int k)
{
    return k >= -126 ? mf_dk_float((uint32_t)(k + 127) << 23) : mf_dk_float(1u << (k + 149));
}

/* Round to nearest even fp16 with subnormals; |x| beyond the largest finite rounds to inf; NaN to
 * the quiet NaN of its sign (0x7E00). host/formats.h mf_f16_from_f32's bits for every non-NaN x. */
MF_DK_FN uint16_t mf_lt_f16(float x)
{
    uint32_t b = mf_dk_bits(x), sign = (b >> 16) & 0x8000u, a = b & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);   /* >= 65520: inf */
    uint32_t e = a >> 23;
    if (e < 113) {   /* below 2^-14: a subnormal (or 0), the value's bits shifted into 10 */
        if (e < 102) return (uint16_t)sign;   /* below 2^-25: rounds to 0 */
        uint32_t m = (a & 0x7FFFFFu) | 0x800000u, sh = 126 - e;   /* value = m 2^(e - 150); ulp 2^-24 */
        uint32_t q = m >> sh, rem = m & ((1u << sh) - 1u), half = 1u << (sh - 1);
        q += rem > half || (rem == half && (q & 1u));
        return (uint16_t)(sign | q);
    }
    uint32_t r = a - (112u << 23);   /* rebias 127 -> 15 */
    r += 0xFFFu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
}

/* The float of an fp16 code (exact). */
MF_DK_FN float mf_lt_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3FFu;
    if (e == 31) return mf_dk_float(sign | 0x7F800000u | (m << 13));
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-8f;   /* m 2^-24, exact */
        return sign ? -v : v;
    }
    return mf_dk_float(sign | ((e + 112u) << 23) | (m << 13));
}

/* A float rounded to the type's 16-bit code (bf16: kern_dense.h's rounding). */
MF_DK_FN uint16_t mf_lt_round16(int type, float x)
{
    return type == MF_LT_FP16 ? mf_lt_f16(x) : (uint16_t)(mf_dk_bits(mf_dk_bf16(x)) >> 16);
}
/* The float of a 16-bit code (exact). */
MF_DK_FN float mf_lt_widen16(int type, uint16_t c)
{
    return type == MF_LT_FP16 ? mf_lt_f16_to_f32(c) : mf_dk_float((uint32_t)c << 16);
}

/* E2M1 from its 4 bits: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (host/formats.h's). */
MF_DK_FN float mf_lt_e2m1(uint32_t c)
{
    float v = (float)(((c & 7u) < 4u ? (c & 7u) : (2u + (c & 1u)) << ((c & 7u) / 2u - 1u))) * 0.5f;
    return (c & 8u) ? -v : v;
}

/* One weight dequantized: code (FP8: E4M3 byte; FP4: E2M1 nibble) times 2^(e - 127 - shift) with
 * e its E8M0 scale code, rounded to the type (exact where the plan allows the matrix: k in
 * [mf_lt_k_min, mf_lt_k_max]); scale code 255 (NaN) and E4M3 NaN codes give the type's NaN. The
 * product is one fp32 multiply of the decoded code by a power of two: exact, so the 16-bit value
 * times 2^shift is host/formats.h's decode of the same code and scale. */
MF_DK_FN uint16_t mf_lt_dequant(int type, int fmt, uint32_t code, uint32_t e, int shift)
{
    float c = fmt == MF_KERN_FP8 ? mf_dk_e4m3(code) : mf_lt_e2m1(code);
    int k = (int)e - 127 - shift;
    if (e == 255u) c = mf_dk_float(0x7FC00000u);
    float v = k < -149 ? c * 0.0f : k > 127 ? c * mf_lt_pow2(127) * mf_lt_pow2(k - 127) : c * mf_lt_pow2(k);
    return mf_lt_round16(type, v);
}

/* The activations' shift for fp16: the exponent that puts the call's largest finite |x| (mx, its
 * float; 0 when none) in [2^14, 2^15) (at least -126), 0 for bf16 or mx 0. x is cast as
 * round16(x 2^-xs). */
MF_DK_FN int mf_lt_xshift(int type, float mx)
{
    if (type != MF_LT_FP16 || !(mx > 0.0f)) return 0;
    uint32_t b = mf_dk_bits(mx);
    int ex = (int)(b >> 23) - 127;
    if (ex == -127) {   /* subnormal: the exponent of its leading bit */
        uint32_t m = b & 0x7FFFFFu;
        ex = -127;
        while (!(m & 0x800000u)) m <<= 1, ex--;
        ex++;
    }
    return ex - 14 < -126 ? -126 : ex - 14;   /* 2^-xs stays a float */
}

/* One activation cast: round16(x 2^-xs), the multiply in fp32 (exact unless it falls among the fp32
 * subnormals, then rounded once there, as on the card). */
MF_DK_FN uint16_t mf_lt_cast(int type, float x, int xs)
{
    return mf_lt_round16(type, xs ? x * mf_lt_pow2(-xs) : x);
}

#endif
