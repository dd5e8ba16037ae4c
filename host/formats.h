/* Number formats of the checkpoint: E2M1 (fp4, two per byte, low nibble = lower index), E8M0
 * (power-of-two scales), E4M3fn, BF16 and F16. Decoding is exact; encoding rounds to nearest,
 * ties to even, with the overflow behaviour of the ml_dtypes types (documented per function). */
#ifndef MF_FORMATS_H
#define MF_FORMATS_H

#include <stddef.h>
#include <stdint.h>

/* E2M1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; magnitudes 0,.5,1,1.5,2,3,4,6. */
float mf_e2m1_to_f32(uint8_t code);             /* uses the low 4 bits of code */
uint8_t mf_e2m1_from_f32(float x);              /* RNE; |x| > 6 saturates to +-6; NaN -> see .c */

/* E8M0: 2^(x-127); x = 0 is 2^-127; 0xFF is NaN. */
float mf_e8m0_to_f32(uint8_t code);
uint8_t mf_e8m0_from_f32(float x);              /* nearest power of two as ml_dtypes rounds it */

/* E4M3fn: bias 7, no inf, 0x7F/0xFF NaN, max 448. */
float mf_e4m3_to_f32(uint8_t code);
uint8_t mf_e4m3_from_f32(float x);              /* RNE; overflow behaviour as ml_dtypes */

float mf_bf16_to_f32(uint16_t code);
uint16_t mf_bf16_from_f32(float x);             /* RNE, NaN stays NaN */

float mf_f16_to_f32(uint16_t code);
uint16_t mf_f16_from_f32(float x);              /* RNE, overflow -> inf */

/* Packed E2M1 rows: element i of a row is nibble (i & 1) of byte i / 2 (low nibble first). */
static inline uint8_t mf_e2m1_get(const uint8_t *packed, size_t i)
{
    return (uint8_t)((packed[i >> 1] >> ((i & 1) * 4)) & 0x0F);
}
void mf_e2m1_pack(uint8_t *dst, const uint8_t *codes, size_t n);    /* n codes -> (n+1)/2 bytes */
void mf_e2m1_unpack(uint8_t *codes, const uint8_t *src, size_t n);

/* Bulk conversions (plain loops; the fast kernels live elsewhere). */
void mf_bf16_to_f32_n(float *dst, const uint16_t *src, size_t n);
void mf_f32_to_bf16_n(uint16_t *dst, const float *src, size_t n);
void mf_e4m3_to_f32_n(float *dst, const uint8_t *src, size_t n);

#endif
