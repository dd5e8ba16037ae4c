/* Number formats of the checkpoint: E2M1 (fp4, two per byte, low nibble = lower index), E8M0
 * (power-of-two scales), E4M3fn, BF16 and F16. Decoding is exact; encoding rounds to nearest,
 * ties to even, with the overflow behaviour of the ml_dtypes types (documented per function).
 * Every encoder gives, for every float32 input, the code of
 * np.array(x, np.float32).astype(T) with T = ml_dtypes.float4_e2m1fn, float8_e8m0fnu,
 * float8_e4m3fn, bfloat16 and numpy float16 (checked over all 2^32 inputs against ml_dtypes 0.6.0
 * and numpy 2.4.6; tests/py/check_formats.py). Nothing here fails or reads global state. */
#ifndef MF_FORMATS_H
#define MF_FORMATS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* E2M1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; magnitudes 0,.5,1,1.5,2,3,4,6.
 * Encode: RNE (so 5 -> 4, 0.25 -> 0, 0.75 -> 1); every |x| > 5, +-inf included, gives +-6
 * (saturation, no overflow code); tiny values keep their sign (-0 is 0x8). E2M1 has no NaN: as in ml_dtypes, a NaN becomes the zero of
 * the opposite sign (+NaN -> 0x8, -NaN -> 0x0). */
float mf_e2m1_to_f32(uint8_t code);             /* uses the low 4 bits of code */
uint8_t mf_e2m1_from_f32(float x);

/* E8M0: 2^(x-127); x = 0 is 2^-127 (a float32 subnormal); 0xFF is NaN (decodes to 0x7FC00000).
 * Encode, as ml_dtypes rounds it: the nearest power of two in linear distance with ties going UP
 * (1.5 * 2^e -> 2^(e+1); ml_dtypes' even test sees the implicit bit), so 0.75 -> 1 and 3 -> 4;
 * >= 1.5 * 2^127 -> 0xFF. Zero (either sign), every negative value, +-inf and NaN -> 0xFF.
 * Float32 subnormals: x <= 2^-127 -> 0x00 (2^-127), but 2^-127 < x < 2^-126 -> 0x01 (2^-126),
 * though 2^-127 is nearer: an ml_dtypes quirk, matched on purpose. */
float mf_e8m0_to_f32(uint8_t code);
uint8_t mf_e8m0_from_f32(float x);

/* E4M3fn: bias 7, no inf, 0x7F/0xFF NaN, max 448, subnormals down to 2^-9. Decode of a NaN
 * code gives the float32 quiet NaN of its sign. Encode: RNE with subnormals; no saturation:
 * |x| > 464 (464 itself ties down to 448) and +-inf become NaN 0x7F/0xFF with the input's sign;
 * NaN -> 0x7F or 0xFF by its sign bit. */
float mf_e4m3_to_f32(uint8_t code);
uint8_t mf_e4m3_from_f32(float x);

/* BF16: the top half of a float32; decode is exact, NaN payloads included. Encode: RNE with
 * float32 subnormals kept (no flush); overflow (>= 0x1.FFp127) -> +-inf; every NaN -> the
 * quiet NaN of its sign, 0x7FC0 or 0xFFC0 (payload dropped, as ml_dtypes/Eigen do). */
static inline float mf_bf16_to_f32(uint16_t code)
{
    uint32_t b = (uint32_t)code << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}
static inline uint16_t mf_bf16_from_f32(float x)
{
    uint32_t b;
    memcpy(&b, &x, 4);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)(((b & 0x80000000u) >> 16) | 0x7FC0);
    /* bf16 keeps float32's exponent, so rounding to it is rounding the low 16 bits to even, a
     * carry moving into the exponent: the same result as the round-magnitude form for all 2^32
     * inputs (checked exhaustively) */
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
/* x rounded to the nearest bf16 (ties to even), as a float: the engine's and the reference's
 * bf16 roundings (graphs/layers/layers.h mf_bf). */
static inline float mf_bf16_round(float x) { return mf_bf16_to_f32(mf_bf16_from_f32(x)); }

/* F16 (IEEE binary16, numpy float16): decode exact, NaN payload kept (shifted up 13 bits).
 * Encode: RNE with subnormals; |x| >= 65520 -> +-inf; NaN keeps its sign and the top 10
 * payload bits (no quieting), and a payload that truncates to 0 becomes 1 (0x7C01), as numpy's
 * npy_floatbits_to_halfbits does. */
float mf_f16_to_f32(uint16_t code);
uint16_t mf_f16_from_f32(float x);

/* Packed E2M1 rows: element i of a row is nibble (i & 1) of byte i / 2 (low nibble first). */
static inline uint8_t mf_e2m1_get(const uint8_t *packed, size_t i)
{
    return (uint8_t)((packed[i >> 1] >> ((i & 1) * 4)) & 0x0F);
}
/* Pack writes exactly (n+1)/2 bytes, using the low 4 bits of each code; for odd n the unused
 * high nibble of the last byte is 0. Unpack writes n codes of 0..15. */
void mf_e2m1_pack(uint8_t *dst, const uint8_t *codes, size_t n);    /* n codes -> (n+1)/2 bytes */
void mf_e2m1_unpack(uint8_t *codes, const uint8_t *src, size_t n);

/* Bulk conversions (plain loops; the fast kernels live elsewhere). */
void mf_bf16_to_f32_n(float *dst, const uint16_t *src, size_t n);
void mf_f32_to_bf16_n(uint16_t *dst, const float *src, size_t n);
void mf_e4m3_to_f32_n(float *dst, const uint8_t *src, size_t n);

#endif
