/* FP8 fused matmul (attention projections, shared expert, Engram projection): E4M3 weights with one
 * E8M0 scale per 32x32 tile, decoded to exact fp32 tile by tile in L1 and applied to every token
 * (kern_common.c's engine). The decoded value is e4m3(w) * 2^(s-127) rounded once, as the
 * reference computes it in fp32. */
#include "host/kern_internal.h"

#include <immintrin.h>
#include <stdatomic.h>

#include "host/formats.h"

static void mf_kern_fp8_decode_scalar(const mf_kern_mat *m, int row, int k0, int n, float *dst)
{
    const uint8_t *w = (const uint8_t *)m->w + (size_t)row * m->n_in + k0;
    const uint8_t *s = m->scale + (size_t)(row / 32) * (m->n_in / 32) + k0 / 32;
    for (int i = 0; i < n; i++)
        dst[i] = mf_e4m3_to_f32(w[i]) * mf_e8m0_to_f32(s[i / 32]);
}

__attribute__((target("avx2,fma,f16c")))
static void mf_kern_fp8_decode_avx2(const mf_kern_mat *m, int row, int k0, int n, float *dst)
{
    const uint8_t *w = (const uint8_t *)m->w + (size_t)row * m->n_in + k0;
    const uint8_t *s = m->scale + (size_t)(row / 32) * (m->n_in / 32) + k0 / 32;
    mf_kern_prefetch(w, (size_t)n);
    /* E4M3 bits moved into binary16 ((b & 0x7F) << 7, sign at bit 15) are the value times 2^-8,
     * subnormals included and no float subnormal on the way; F16C widens 8 at a time, then
     * * 2^8 (exact) and * scale (the reference's one rounding). NaN codes become an f16 NaN. */
    const __m256i m7f = _mm256_set1_epi16(0x7F), m80 = _mm256_set1_epi16(0x80);
    const __m256i f16nan = _mm256_set1_epi16(0x7E00);
    const __m256 two8 = _mm256_set1_ps(256.0f);
    for (int i = 0; i < n; i += 32) {
        __m256 sc = _mm256_set1_ps(mf_e8m0_to_f32(s[i / 32]));
        for (int j = 0; j < 32; j += 16) {
            __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + i + j)));
            __m256i a = _mm256_and_si256(b, m7f);
            __m256i h = _mm256_or_si256(_mm256_slli_epi16(a, 7),
                                        _mm256_slli_epi16(_mm256_and_si256(b, m80), 8));
            h = _mm256_blendv_epi8(h, f16nan, _mm256_cmpeq_epi16(a, m7f));
            __m256 v0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
            __m256 v1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
            _mm256_store_ps(dst + i + j, _mm256_mul_ps(_mm256_mul_ps(v0, two8), sc));
            _mm256_store_ps(dst + i + j + 8, _mm256_mul_ps(_mm256_mul_ps(v1, two8), sc));
        }
    }
}

/* Weights k..k+32 of one row (E8M0 scale code e) applied to x and added into the four 8-lane
 * sums; the values are mf_kern_fp8_decode_avx2's bit for bit. Cheaper where it can be: the sign
 * and magnitude moved into binary16 by one shift pair and a mask; the block checked once for NaN
 * codes (then the decoder's blend, as there); and for e <= 246 one multiply by 2^8 * scale, which
 * is exact there and rounds the same exact product once, as the decoder's two multiplies do. */
__attribute__((target("avx2,fma,f16c")))
static inline void mf_kern_fp8_fma32(const uint8_t *w, unsigned e, const float *x, __m256 *a)
{
    const __m256i m7f = _mm256_set1_epi16(0x7F), m80 = _mm256_set1_epi16(0x80);
    const __m256i f16nan = _mm256_set1_epi16(0x7E00), mbf80 = _mm256_set1_epi16((short)0xBF80);
    const __m256 two8 = _mm256_set1_ps(256.0f);
    __m256i raw = _mm256_loadu_si256((const __m256i *)w);
    int nan = _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(raw, _mm256_set1_epi8(0x7F)),
                                                     _mm256_set1_epi8(0x7F)));
    if (!nan && e <= 246) {
        const __m256 sc8 = _mm256_castsi256_ps(_mm256_set1_epi32((int)(e + 8) << 23));   /* 2^8 * 2^(e - 127) */
        for (int j = 0; j < 32; j += 16) {
            __m256i b = _mm256_cvtepu8_epi16(j ? _mm256_extracti128_si256(raw, 1) : _mm256_castsi256_si128(raw));
            /* b << 8 puts the sign at bit 15, the magnitude at 14..8; >> 1 (arithmetic) moves the
             * magnitude to 13..7 and copies the sign into bit 14, which the mask clears */
            __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(b, 8), 1), mbf80);
            __m256 v0 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), sc8);
            __m256 v1 = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), sc8);
            a[j / 8] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(x + j), a[j / 8]);
            a[j / 8 + 1] = _mm256_fmadd_ps(v1, _mm256_loadu_ps(x + j + 8), a[j / 8 + 1]);
        }
        return;
    }
    const __m256 sc = _mm256_set1_ps(mf_e8m0_to_f32((uint8_t)e));
    for (int j = 0; j < 32; j += 16) {   /* mf_kern_fp8_decode_avx2's operations */
        __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + j)));
        __m256i m = _mm256_and_si256(b, m7f);
        __m256i h = _mm256_or_si256(_mm256_slli_epi16(m, 7), _mm256_slli_epi16(_mm256_and_si256(b, m80), 8));
        h = _mm256_blendv_epi8(h, f16nan, _mm256_cmpeq_epi16(m, m7f));
        __m256 v0 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), two8), sc);
        __m256 v1 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), two8), sc);
        a[j / 8] = _mm256_fmadd_ps(v0, _mm256_loadu_ps(x + j), a[j / 8]);
        a[j / 8 + 1] = _mm256_fmadd_ps(v1, _mm256_loadu_ps(x + j + 8), a[j / 8 + 1]);
    }
}

/* One token (batch-1 decode: the attention linears, the shared expert, Engram's projection): the
 * weights decoded in registers and applied at once, two rows at a time, instead of through an L1
 * tile. Same lanes, order and tree as the tile engine, so the same bits. */
__attribute__((target("avx2,fma,f16c")))
static void mf_kern_fp8_tok1_avx2(const mf_kern_mat *m, const float *x, float *y, int y_row0, int r0, int r1)
{
    const int n = m->n_in, nb = n / 32;
    int o = r0;
    for (; o + 2 <= r1; o += 2) {
        const uint8_t *wa = (const uint8_t *)m->w + (size_t)o * n, *wb = wa + n;
        const uint8_t *sa = m->scale + (size_t)(o / 32) * nb, *sb = m->scale + (size_t)((o + 1) / 32) * nb;
        __m256 a[4], b[4];
        for (int i = 0; i < 4; i++) a[i] = b[i] = _mm256_setzero_ps();
        for (int k = 0; k < n; k += 32) {
            mf_kern_prefetch_tok1(wa + k);
            mf_kern_prefetch_tok1(wb + k);
            mf_kern_fp8_fma32(wa + k, sa[k / 32], x + k, a);
            mf_kern_fp8_fma32(wb + k, sb[k / 32], x + k, b);
        }
        y[o - y_row0] = mf_kern_reduce4x8_avx2(a[0], a[1], a[2], a[3]);
        y[o + 1 - y_row0] = mf_kern_reduce4x8_avx2(b[0], b[1], b[2], b[3]);
    }
    if (o < r1) {
        const uint8_t *wa = (const uint8_t *)m->w + (size_t)o * n, *sa = m->scale + (size_t)(o / 32) * nb;
        __m256 a[4];
        for (int i = 0; i < 4; i++) a[i] = _mm256_setzero_ps();
        for (int k = 0; k < n; k += 32)
            mf_kern_fp8_fma32(wa + k, sa[k / 32], x + k, a);
        y[o - y_row0] = mf_kern_reduce4x8_avx2(a[0], a[1], a[2], a[3]);
    }
}

/* The 16 lanes of lo (0-7) and hi (8-15) as one vector, and a vector's two halves */
__attribute__((target("avx512f,avx2")))
static inline __m512 mf_kern_zmm_of(__m256 lo, __m256 hi)
{
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
__attribute__((target("avx512f,avx2")))
static inline void mf_kern_zmm_halves(__m512 v, __m256 *lo, __m256 *hi)
{
    *lo = _mm512_castps512_ps256(v);
    *hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* The one-token loop with 16-lane AVX-512 (BW for the 32 codes widened at once), where the CPU has
 * it: per row pair and block the decoder's very operations on 16 weights at a time (the codes'
 * bits into binary16, F16C widening, times 2^8 x scale, FMA with x), the 32 lanes held as two
 * 16-lane sums whose halves are mf_kern_fp8_tok1_avx2's four 8-lane sums (lanes 0-15, 16-31), the
 * same fixed reduction: the same bits. Blocks with a NaN code or a scale code above 246 take
 * mf_kern_fp8_fma32 on those halves. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
static void mf_kern_fp8_tok1_zmm(const mf_kern_mat *m, const float *x, float *y, int y_row0, int r0, int r1)
{
    const int n = m->n_in, nb = n / 32;
    const __m512i mbf80 = _mm512_set1_epi16((short)0xBF80);
    const __m256i m7f = _mm256_set1_epi8(0x7F);
    int o = r0;
    for (; o + 2 <= r1; o += 2) {
        const uint8_t *wa = (const uint8_t *)m->w + (size_t)o * n, *wb = wa + n;
        const uint8_t *sa = m->scale + (size_t)(o / 32) * nb, *sb = m->scale + (size_t)((o + 1) / 32) * nb;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
        for (int k = 0; k < n; k += 32) {
            mf_kern_prefetch_tok1(wa + k);
            mf_kern_prefetch_tok1(wb + k);
            __m256i ra = _mm256_loadu_si256((const __m256i *)(wa + k)), rb = _mm256_loadu_si256((const __m256i *)(wb + k));
            unsigned ea = sa[k / 32], eb = sb[k / 32];
            if (_mm256_cmpeq_epi8_mask(_mm256_and_si256(ra, m7f), m7f) | _mm256_cmpeq_epi8_mask(_mm256_and_si256(rb, m7f), m7f) ||
                ea > 246 || eb > 246) {
                __m256 a[4], b[4];
                mf_kern_zmm_halves(a0, &a[0], &a[1]);
                mf_kern_zmm_halves(a1, &a[2], &a[3]);
                mf_kern_zmm_halves(b0, &b[0], &b[1]);
                mf_kern_zmm_halves(b1, &b[2], &b[3]);
                mf_kern_fp8_fma32(wa + k, ea, x + k, a);
                mf_kern_fp8_fma32(wb + k, eb, x + k, b);
                a0 = mf_kern_zmm_of(a[0], a[1]);
                a1 = mf_kern_zmm_of(a[2], a[3]);
                b0 = mf_kern_zmm_of(b[0], b[1]);
                b1 = mf_kern_zmm_of(b[2], b[3]);
                continue;
            }
            /* mf_kern_fp8_fma32's fast form, 16 lanes: magnitude to bits 13..7 and the sign to 15 of
             * each binary16, times 2^8 x scale (one multiply, exact for e <= 246) */
            const __m512 sa8 = _mm512_castsi512_ps(_mm512_set1_epi32((int)(ea + 8) << 23));
            const __m512 sb8 = _mm512_castsi512_ps(_mm512_set1_epi32((int)(eb + 8) << 23));
            __m512i ha = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(_mm512_cvtepu8_epi16(ra), 8), 1), mbf80);
            __m512i hb = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(_mm512_cvtepu8_epi16(rb), 8), 1), mbf80);
            __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
            a0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(ha)), sa8), x0, a0);
            a1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(ha, 1)), sa8), x1, a1);
            b0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(hb)), sb8), x0, b0);
            b1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(hb, 1)), sb8), x1, b1);
        }
        __m256 h[8];
        mf_kern_zmm_halves(a0, &h[0], &h[1]);
        mf_kern_zmm_halves(a1, &h[2], &h[3]);
        mf_kern_zmm_halves(b0, &h[4], &h[5]);
        mf_kern_zmm_halves(b1, &h[6], &h[7]);
        y[o - y_row0] = mf_kern_reduce4x8_avx2(h[0], h[1], h[2], h[3]);
        y[o + 1 - y_row0] = mf_kern_reduce4x8_avx2(h[4], h[5], h[6], h[7]);
    }
    if (o < r1) mf_kern_fp8_tok1_avx2(m, x, y, y_row0, o, r1);
}

/* -1: not yet looked at; 0: AVX2 only; 1: the CPU has AVX-512 F/BW/VL and the one-token loop uses it */
static atomic_int g_fp8_512 = -1;

int mf_kern_fp8_tok1_avx512(void)
{
    int v = atomic_load_explicit(&g_fp8_512, memory_order_relaxed);
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl");
        atomic_store(&g_fp8_512, v);
    }
    return v;
}

void mf_kern_fp8_tok1_set_avx512(int on)
{
    atomic_store(&g_fp8_512, on == 0 ? 0 : -1);   /* 1 or -1: as the CPU allows, looked at again */
}

void mf_kern_fp8_rows(const mf_kern_mat *m, const float *x, int n_tok, int ld_x, float *y,
                      int ld_y, int y_row0, int r0, int r1)
{
    if (n_tok == 1 && mf_kern_simd_active() == MF_KERN_SIMD_AVX2) {
        if (mf_kern_fp8_tok1_avx512()) mf_kern_fp8_tok1_zmm(m, x, y, y_row0, r0, r1);
        else mf_kern_fp8_tok1_avx2(m, x, y, y_row0, r0, r1);
        return;
    }
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
