/* BF16 fused matmul (embedding rows, head, compressor, router, indexer projections): BF16 weights
 * widened to fp32 tile by tile in L1 and applied to every token (kern_common.c's engine). */
#include "host/kern_internal.h"

#include <immintrin.h>

#include "host/formats.h"

static void mf_kern_bf16_decode_scalar(const mf_kern_mat *m, int row, int k0, int n, float *dst)
{
    const uint16_t *w = (const uint16_t *)m->w + (size_t)row * m->n_in + k0;
    for (int i = 0; i < n; i++)
        dst[i] = mf_bf16_to_f32(w[i]);
}

__attribute__((target("avx2,fma")))
static void mf_kern_bf16_decode_avx2(const mf_kern_mat *m, int row, int k0, int n, float *dst)
{
    const uint16_t *w = (const uint16_t *)m->w + (size_t)row * m->n_in + k0;
    mf_kern_prefetch(w, (size_t)n * 2);
    for (int i = 0; i < n; i += 16) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(w + i));
        __m256i lo = _mm256_unpacklo_epi16(_mm256_setzero_si256(), v);   /* bf16 << 16 */
        __m256i hi = _mm256_unpackhi_epi16(_mm256_setzero_si256(), v);
        /* unpack works per 128-bit lane: lo = elements 0-3, 8-11; hi = 4-7, 12-15 */
        __m256i a = _mm256_permute2x128_si256(lo, hi, 0x20);   /* 0-3, 4-7 */
        __m256i b = _mm256_permute2x128_si256(lo, hi, 0x31);   /* 8-11, 12-15 */
        _mm256_store_ps(dst + i, _mm256_castsi256_ps(a));
        _mm256_store_ps(dst + i + 8, _mm256_castsi256_ps(b));
    }
}

void mf_kern_bf16_rows(const mf_kern_mat *m, const float *x, int n_tok, int ld_x, float *y,
                       int ld_y, int y_row0, int r0, int r1)
{
    mf_kern_f32_run(m, mf_kern_bf16_decode_avx2, mf_kern_bf16_decode_scalar, x, n_tok, ld_x, y,
                    ld_y, y_row0, r0, r1);
}

int mf_kern_bf16_matmul(const uint16_t *w, int n_out, int n_in,
                        const float *x, int n_tok, int ld_x, float *y, int ld_y, int r0, int r1)
{
    int rc = mf_kern_check("bf16 matmul", w, NULL, 0, n_out, n_in, x, n_tok, ld_x, y, ld_y, r0, r1);
    if (rc)
        return rc;
    mf_kern_mat m = {MF_KERN_BF16, w, NULL, n_out, n_in};
    mf_kern_bf16_rows(&m, x, n_tok, ld_x, y, ld_y, 0, r0, r1);
    return 0;
}
