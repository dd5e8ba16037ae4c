/* Scalar decode and encode of the checkpoint's number formats (E2M1, E8M0, E4M3fn, BF16, F16),
 * bit-exact with ml_dtypes / numpy, plus E2M1 nibble packing and plain bulk loops. The encoders
 * share one integer round-to-nearest-even routine; each adds its format's NaN and overflow rule. */
#include "host/formats.h"

#include <string.h>

static inline uint32_t f32_bits(float x)
{
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

static inline float f32_from_bits(uint32_t b)
{
    float x;
    memcpy(&x, &b, sizeof x);
    return x;
}

#define F32_SIGN 0x80000000u
#define F32_ABS 0x7FFFFFFFu
#define F32_INF 0x7F800000u
#define F32_QNAN 0x7FC00000u

/* Rounds the positive finite float32 with bits `abs_bits` to a binary format with `man_bits`
 * mantissa bits, exponent bias `bias` and subnormals, ties to even. Returns the magnitude code
 * (biased exponent << man_bits | mantissa). The result is not clamped: a code above the format's
 * largest finite one means overflow, which the caller maps by its own rule. */
static uint32_t round_magnitude(uint32_t abs_bits, int man_bits, int bias)
{
    uint32_t exp_field = abs_bits >> 23;
    uint32_t frac = abs_bits & 0x7FFFFFu;
    if (abs_bits == 0)
        return 0;

    /* value = sig * 2^sig_exp, with top = floor(log2(value)). */
    uint64_t sig;
    int sig_exp, top;
    if (exp_field != 0) {
        sig = frac | 0x800000u;
        sig_exp = (int)exp_field - 150;
        top = (int)exp_field - 127;
    } else {
        sig = frac;
        sig_exp = -149;
        top = 31 - __builtin_clz(frac) - 149;
    }

    /* The target's spacing at this value: 2^quantum, fixed below its smallest normal. */
    int min_normal_exp = 1 - bias;
    int quantum = (top > min_normal_exp ? top : min_normal_exp) - man_bits;
    int shift = quantum - sig_exp;   /* >= 1 for every format here */

    uint64_t k;
    if (shift > 40) {
        k = 0;                       /* below a quarter of the smallest step */
    } else {
        uint64_t half = 1ull << (shift - 1);
        uint64_t rest = sig & ((1ull << shift) - 1);
        k = sig >> shift;
        if (rest > half || (rest == half && (k & 1)))
            k++;
    }
    if (k == 0)
        return 0;
    /* value = k * 2^quantum; a normal k carries its implicit bit at 2^man_bits, which adds one to
     * the biased exponent, and a carry out of the mantissa moves on into the exponent. */
    int64_t exp_base = (int64_t)quantum + man_bits + bias - 1;
    return (uint32_t)((exp_base << man_bits) + (int64_t)k);
}

/* ---- E2M1 ------------------------------------------------------------------------------------ */

static const float e2m1_magnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

float mf_e2m1_to_f32(uint8_t code)
{
    float m = e2m1_magnitude[code & 7];
    return (code & 8) ? -m : m;
}

uint8_t mf_e2m1_from_f32(float x)
{
    uint32_t b = f32_bits(x);
    uint8_t sign = (b & F32_SIGN) ? 8 : 0;
    uint32_t a = b & F32_ABS;
    if (a > F32_INF)
        return sign ? 0x0 : 0x8;     /* no NaN in E2M1: ml_dtypes gives the opposite-signed zero */
    if (a == F32_INF)
        return sign | 0x7;
    uint32_t m = round_magnitude(a, 1, 1);
    return (uint8_t)(sign | (m > 0x7 ? 0x7 : m));
}

/* ---- E8M0 ------------------------------------------------------------------------------------ */

float mf_e8m0_to_f32(uint8_t code)
{
    if (code == 0xFF)
        return f32_from_bits(F32_QNAN);
    if (code == 0)
        return f32_from_bits(0x00400000u);   /* 2^-127, a float32 subnormal */
    return f32_from_bits((uint32_t)code << 23);
}

uint8_t mf_e8m0_from_f32(float x)
{
    uint32_t b = f32_bits(x);
    if ((b & F32_SIGN) || b == 0 || b >= F32_INF)
        return 0xFF;                 /* negative, zero, inf and NaN all become NaN */
    uint32_t exp_field = b >> 23;
    uint32_t frac = b & 0x7FFFFFu;
    if (exp_field == 0) {
        /* float32 subnormals: ml_dtypes sends (2^-127, 2^-126) to 2^-126, all below to 2^-127. */
        return frac > 0x400000u ? 0x01 : 0x00;
    }
    /* 1.frac * 2^(exp_field - 127): a mantissa of 1.5 or more rounds up (ties go up). */
    uint32_t code = exp_field + (frac >= 0x400000u ? 1 : 0);
    return code > 0xFE ? 0xFF : (uint8_t)code;
}

/* ---- E4M3fn ---------------------------------------------------------------------------------- */

float mf_e4m3_to_f32(uint8_t code)
{
    uint32_t sign = (code & 0x80) ? F32_SIGN : 0;
    uint32_t exp_field = (code >> 3) & 0xF;
    uint32_t man = code & 0x7;
    if (exp_field == 0xF && man == 0x7)
        return f32_from_bits(sign | F32_QNAN);
    if (exp_field == 0) {            /* subnormal: man * 2^-9, exact in float32 */
        float m = (float)man * (1.0f / 512.0f);
        return sign ? -m : m;
    }
    return f32_from_bits(sign | ((exp_field - 7 + 127) << 23) | (man << 20));
}

uint8_t mf_e4m3_from_f32(float x)
{
    uint32_t b = f32_bits(x);
    uint8_t sign = (b & F32_SIGN) ? 0x80 : 0;
    uint32_t a = b & F32_ABS;
    if (a >= F32_INF)
        return sign | 0x7F;          /* inf and NaN: NaN, sign kept */
    uint32_t m = round_magnitude(a, 3, 7);
    return (uint8_t)(sign | (m > 0x7E ? 0x7F : m));
}

/* ---- BF16 ------------------------------------------------------------------------------------ */

/* mf_bf16_to_f32 and mf_bf16_from_f32 are inline in host/formats.h (the engine rounds to bf16
 * on every hot path). */

/* ---- F16 ------------------------------------------------------------------------------------- */

float mf_f16_to_f32(uint16_t code)
{
    uint32_t sign = (code & 0x8000) ? F32_SIGN : 0;
    uint32_t exp_field = (code >> 10) & 0x1F;
    uint32_t man = code & 0x3FF;
    if (exp_field == 0x1F)           /* inf, or NaN with its payload kept */
        return f32_from_bits(sign | F32_INF | (man << 13));
    if (exp_field == 0) {            /* subnormal: man * 2^-24, exact in float32 */
        float m = (float)man * (1.0f / 16777216.0f);
        return sign ? -m : m;
    }
    return f32_from_bits(sign | ((exp_field - 15 + 127) << 23) | (man << 13));
}

uint16_t mf_f16_from_f32(float x)
{
    uint32_t b = f32_bits(x);
    uint16_t sign = (b & F32_SIGN) ? 0x8000 : 0;
    uint32_t a = b & F32_ABS;
    if (a > F32_INF) {
        /* numpy keeps the top 10 payload bits; a payload that truncates to 0 becomes 1. */
        uint16_t payload = (uint16_t)((a & 0x7FFFFFu) >> 13);
        return sign | 0x7C00 | (payload ? payload : 1);
    }
    if (a == F32_INF)
        return sign | 0x7C00;
    uint32_t m = round_magnitude(a, 10, 15);
    return (uint16_t)(sign | (m > 0x7BFF ? 0x7C00 : m));
}

/* ---- packing and bulk loops ------------------------------------------------------------------ */

void mf_e2m1_pack(uint8_t *dst, const uint8_t *codes, size_t n)
{
    for (size_t i = 0; i + 1 < n; i += 2)
        dst[i / 2] = (uint8_t)((codes[i] & 0x0F) | ((codes[i + 1] & 0x0F) << 4));
    if (n & 1)
        dst[n / 2] = codes[n - 1] & 0x0F;   /* the unused high nibble is zero */
}

void mf_e2m1_unpack(uint8_t *codes, const uint8_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        codes[i] = mf_e2m1_get(src, i);
}

void mf_bf16_to_f32_n(float *dst, const uint16_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = mf_bf16_to_f32(src[i]);
}

void mf_f32_to_bf16_n(uint16_t *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = mf_bf16_from_f32(src[i]);
}

void mf_e4m3_to_f32_n(float *dst, const uint8_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = mf_e4m3_to_f32(src[i]);
}
