/* bf16 rounding of 8 floats in an AVX2 register, by the bits: mf_bf16_from_f32's rule (host/formats.h:
 * NaN keeps its sign and becomes 0x7FC00000; else the low 16 bits rounded to even, a carry moving
 * into the exponent), returned as floats. One home for the host kernels (mf_kern_vec_bf16_round)
 * and the engine's fast attention (graphs/step/fast_attn.c). Callers compile it under
 * target("avx2") and call it only when mf_kern_simd_active() says AVX2. */
#ifndef MF_HOST_SIMD_BF16_H
#define MF_HOST_SIMD_BF16_H

#include <immintrin.h>
#include <stdint.h>

__attribute__((target("avx2,fma"))) static inline __m256 mf_simd_bf16_round8(__m256 x)
{
    __m256i bi = _mm256_castps_si256(x);
    __m256i a = _mm256_and_si256(bi, _mm256_set1_epi32(0x7FFFFFFF));
    __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bi, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(bi, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u));
    __m256i q = _mm256_or_si256(_mm256_and_si256(bi, _mm256_set1_epi32((int)0x80000000u)),
                                _mm256_set1_epi32(0x7FC00000));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(r, q, nan));
}

/* 8 bf16 codes at p widened to floats (exact: the code in the top half). One home for the BF16
 * kernels' loads (host/kern_bf16.c), the unpack (mf_kern_vec_bf16_unpack) and the engine's reads of
 * bf16 copies (graphs/step/fast_attn.c). */
__attribute__((target("avx2,fma"))) static inline __m256 mf_simd_bf16_load8(const uint16_t *p)
{
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)p)), 16));
}

#endif
