/* FP8 fused matmul (attention projections, shared expert, Engram projection): E4M3 weights with one
 * E8M0 scale per 32x32 tile, decoded to exact fp32 tile by tile in L1 and applied to every token
 * (kern_common.c's engine). The decoded value is e4m3(w) * 2^(s-127) rounded once, as the
 * reference computes it in fp32. */
#include "host/kern_internal.h"

#include <immintrin.h>

#include "host/formats.h"

static void mf_kern_fp8_decode_scalar(const mf_kern_mat *m, int row, int k0, int n, float *dst)
{
    const uint8_t *w = (const uint8_t *)m->w + (size_t)row * m->n_in + k0;
    const uint8_t *s = m->scale + (size_t)(row / 32) * (m->n_in / 32) + k0 / 32;
    for (int i = 0; i < n; i++)
        dst[i] = mf_e4m3_to_f32(w[i]) * mf_e8m0_to_f32(s[i / 32]);
}

__attribute__((target("avx2,fma")))
static void mf_kern_fp8_decode_avx2(const mf_kern_mat *m, int row, int k0, int n, float *dst)
{
    const uint8_t *w = (const uint8_t *)m->w + (size_t)row * m->n_in + k0;
    const uint8_t *s = m->scale + (size_t)(row / 32) * (m->n_in / 32) + k0 / 32;
    const __m256i mag = _mm256_set1_epi32(0x7F), nan_code = _mm256_set1_epi32(0x7F);
    const __m256 two120 = _mm256_castsi256_ps(_mm256_set1_epi32((127 + 120) << 23));
    const __m256 qnan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
    for (int i = 0; i < n; i += 32) {
        __m256 sc = _mm256_set1_ps(mf_e8m0_to_f32(s[i / 32]));
        for (int j = 0; j < 32; j += 8) {
            __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + i + j)));
            __m256i a = _mm256_and_si256(b, mag);
            /* e4m3 magnitude bits placed at float bit 20: 2^-120 times the value (subnormals
             * included), then the sign, then * 2^120 (exact) and * scale (one rounding). */
            __m256i f = _mm256_or_si256(_mm256_slli_epi32(a, 20),
                                        _mm256_slli_epi32(_mm256_andnot_si256(mag, b), 24));
            __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(f), two120);
            v = _mm256_blendv_ps(v, qnan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, nan_code)));
            _mm256_store_ps(dst + i + j, _mm256_mul_ps(v, sc));
        }
    }
}

void mf_kern_fp8_rows(const mf_kern_mat *m, const float *x, int n_tok, int ld_x, float *y,
                      int ld_y, int y_row0, int r0, int r1)
{
    mf_kern_f32_run(m, mf_kern_fp8_decode_avx2, mf_kern_fp8_decode_scalar, x, n_tok, ld_x, y,
                    ld_y, y_row0, r0, r1);
}

int mf_kern_fp8_matmul(const uint8_t *w, const uint8_t *scale, int n_out, int n_in,
                       const float *x, int n_tok, int ld_x, float *y, int ld_y, int r0, int r1)
{
    int rc = mf_kern_check("fp8 matmul", w, scale, 1, n_out, n_in, x, n_tok, ld_x, y, ld_y, r0, r1);
    if (rc)
        return rc;
    mf_kern_mat m = {MF_KERN_FP8, w, scale, n_out, n_in};
    mf_kern_fp8_rows(&m, x, n_tok, ld_x, y, ld_y, 0, r0, r1);
    return 0;
}
