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

/* Widest row whose scaled copy of x the one-token loops keep (64 KiB on the worker's stack; flash41's
 * widest FP8 row is 8,192); wider rows take every block through mf_kern_fp8_fma32: the same bits,
 * slower. */
#define MF_FP8_XS_MAX 16384

/* For the rows of one 32-row scale tile (scale codes s[0 .. n/32)): xs = x * 2^8 * scale block by
 * block, and ok[b] = 1 where block b's scale code is at most 246 (2^8 * scale finite) and every
 * product is exact (x * 2^(e - 119) neither rounded into the subnormals nor overflowed, checked by
 * scaling back; a NaN x fails). Where it holds, fma(code as binary16, xs, acc) is mf_kern_fp8_fma32's
 * fast form fma(code as binary16 * 2^8 * scale, x, acc) bit for bit: the same real product, rounded
 * once. A tile's 16 row pairs share one multiply per input instead of one per weight. */
__attribute__((target("avx2,fma,f16c")))
static void mf_kern_fp8_xs_avx2(const float *x, const uint8_t *s, int n, float *xs, uint8_t *ok)
{
    for (int k = 0; k < n; k += 32) {
        unsigned e = s[k / 32];
        ok[k / 32] = 0;
        if (e > 246) continue;
        union { uint32_t u; float f; } sc = {(e + 8) << 23};   /* 2^(e - 119), a normal float */
        __m256 vs = _mm256_set1_ps(sc.f), vi = _mm256_set1_ps(1.0f / sc.f);   /* exact: powers of 2 */
        int same = 0xFF;
        for (int j = 0; j < 32; j += 8) {
            __m256 xv = _mm256_loadu_ps(x + k + j), p = _mm256_mul_ps(xv, vs);
            _mm256_store_ps(xs + k + j, p);
            same &= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_mul_ps(p, vi), xv, _CMP_EQ_OQ));
        }
        ok[k / 32] = same == 0xFF;
    }
}

/* 1 when either block of 32 codes holds an E4M3 NaN (magnitude 0x7F) */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline int mf_kern_fp8_nan2(__m256i ra, __m256i rb)
{
    const __m256i m7f = _mm256_set1_epi8(0x7F);
    __m256i mx = _mm256_max_epu8(_mm256_and_si256(ra, m7f), _mm256_and_si256(rb, m7f));
    return _mm256_movemask_epi8(_mm256_cmpeq_epi8(mx, m7f)) != 0;
}

/* A block of 32 codes without NaN against xs (mf_kern_fp8_xs_avx2's, its ok set), added into the
 * four 8-lane sums: mf_kern_fp8_fma32's fast form with the scale already in xs. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void mf_kern_fp8_fma32_xs(__m256i raw, const float *xs, __m256 *a)
{
    const __m256i mbf80 = _mm256_set1_epi16((short)0xBF80);
    for (int j = 0; j < 32; j += 16) {
        __m256i b = _mm256_cvtepu8_epi16(j ? _mm256_extracti128_si256(raw, 1) : _mm256_castsi256_si128(raw));
        __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(b, 8), 1), mbf80);
        a[j / 8] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_load_ps(xs + j), a[j / 8]);
        a[j / 8 + 1] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), _mm256_load_ps(xs + j + 8),
                                       a[j / 8 + 1]);
    }
}

/* Two rows of one scale tile (wb = wa + n; one row: wb = wa, yb NULL): blocks with ok take
 * mf_kern_fp8_fma32_xs, the others (a NaN code, a scale above 246, an inexact product; every block
 * when xs is NULL) mf_kern_fp8_fma32. */
__attribute__((target("avx2,fma,f16c")))
static void mf_kern_fp8_pair_avx2(const uint8_t *wa, const uint8_t *wb, int n, const uint8_t *s, const float *x,
                                  const float *xs, const uint8_t *ok, float *ya, float *yb)
{
    __m256 a[4], b[4];
    for (int i = 0; i < 4; i++) a[i] = b[i] = _mm256_setzero_ps();
    for (int k = 0; k < n; k += 32) {
        /* runs of fast blocks in an inner loop without calls, so its constants stay in registers */
        for (; k < n; k += 32) {
            mf_kern_prefetch_tok1(wa + k);
            if (yb) mf_kern_prefetch_tok1(wb + k);
            __m256i ra = _mm256_loadu_si256((const __m256i *)(wa + k)), rb = _mm256_loadu_si256((const __m256i *)(wb + k));
            if (!xs || !ok[k / 32] || mf_kern_fp8_nan2(ra, rb)) break;
            mf_kern_fp8_fma32_xs(ra, xs + k, a);
            if (yb) mf_kern_fp8_fma32_xs(rb, xs + k, b);
        }
        if (k == n) break;
        mf_kern_fp8_fma32(wa + k, s[k / 32], x + k, a);
        if (yb) mf_kern_fp8_fma32(wb + k, s[k / 32], x + k, b);
    }
    *ya = mf_kern_reduce4x8_avx2(a[0], a[1], a[2], a[3]);
    if (yb) *yb = mf_kern_reduce4x8_avx2(b[0], b[1], b[2], b[3]);
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

/* mf_kern_fp8_pair_avx2 for two rows with 16-lane AVX-512 (BW for the 32 codes widened at once),
 * where the CPU has it: per block the same operations on 16 weights at a time (the codes' bits into
 * binary16, F16C widening, FMA with xs), the 32 lanes held as two 16-lane sums whose halves are
 * the AVX2 loop's four 8-lane sums (lanes 0-15, 16-31), the same fixed reduction: the same bits.
 * Blocks without ok or with a NaN code take mf_kern_fp8_fma32 on those halves. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
static void mf_kern_fp8_pair_zmm(const uint8_t *wa, const uint8_t *wb, int n, const uint8_t *s, const float *x,
                                 const float *xs, const uint8_t *ok, float *ya, float *yb)
{
    const __m512i mbf80 = _mm512_set1_epi16((short)0xBF80);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    for (int k = 0; k < n; k += 32) {
        for (; k < n; k += 32) {   /* as mf_kern_fp8_pair_avx2: fast runs without calls */
            mf_kern_prefetch_tok1(wa + k);
            mf_kern_prefetch_tok1(wb + k);
            __m256i ra = _mm256_loadu_si256((const __m256i *)(wa + k)), rb = _mm256_loadu_si256((const __m256i *)(wb + k));
            if (!xs || !ok[k / 32] || mf_kern_fp8_nan2(ra, rb)) break;
            /* magnitude to bits 13..7 and the sign to 15 of each binary16 */
            __m512i ha = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(_mm512_cvtepu8_epi16(ra), 8), 1), mbf80);
            __m512i hb = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(_mm512_cvtepu8_epi16(rb), 8), 1), mbf80);
            __m512 x0 = _mm512_load_ps(xs + k), x1 = _mm512_load_ps(xs + k + 16);
            a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(ha)), x0, a0);
            a1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(ha, 1)), x1, a1);
            b0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(hb)), x0, b0);
            b1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(hb, 1)), x1, b1);
        }
        if (k == n) break;
        {
            __m256 a[4], b[4];
            mf_kern_zmm_halves(a0, &a[0], &a[1]);
            mf_kern_zmm_halves(a1, &a[2], &a[3]);
            mf_kern_zmm_halves(b0, &b[0], &b[1]);
            mf_kern_zmm_halves(b1, &b[2], &b[3]);
            mf_kern_fp8_fma32(wa + k, s[k / 32], x + k, a);
            mf_kern_fp8_fma32(wb + k, s[k / 32], x + k, b);
            a0 = mf_kern_zmm_of(a[0], a[1]);
            a1 = mf_kern_zmm_of(a[2], a[3]);
            b0 = mf_kern_zmm_of(b[0], b[1]);
            b1 = mf_kern_zmm_of(b[2], b[3]);
        }
    }
    __m256 h[8];
    mf_kern_zmm_halves(a0, &h[0], &h[1]);
    mf_kern_zmm_halves(a1, &h[2], &h[3]);
    mf_kern_zmm_halves(b0, &h[4], &h[5]);
    mf_kern_zmm_halves(b1, &h[6], &h[7]);
    *ya = mf_kern_reduce4x8_avx2(h[0], h[1], h[2], h[3]);
    *yb = mf_kern_reduce4x8_avx2(h[4], h[5], h[6], h[7]);
}

/* One token (batch-1 decode: the attention linears, the shared expert, Engram's projection): the
 * weights decoded in registers and applied at once, two rows at a time, instead of through an L1
 * tile; per 32-row scale tile x is scaled once (mf_kern_fp8_xs_avx2). Same lanes, order and tree
 * as the tile engine, so the same bits. zmm: the row pairs on AVX-512 (mf_kern_fp8_pair_zmm). */
__attribute__((target("avx2,fma,f16c")))
static void mf_kern_fp8_tok1(const mf_kern_mat *m, const float *x, float *y, int y_row0, int r0, int r1, int zmm)
{
    const int n = m->n_in, nb = n / 32;
    _Alignas(64) float xs_buf[MF_FP8_XS_MAX];
    uint8_t ok[MF_FP8_XS_MAX / 32];
    const float *xs = n <= MF_FP8_XS_MAX ? xs_buf : NULL;
    for (int o0 = r0; o0 < r1;) {
        int o1 = (o0 / 32 + 1) * 32 < r1 ? (o0 / 32 + 1) * 32 : r1;   /* this scale tile's rows */
        const uint8_t *s = m->scale + (size_t)(o0 / 32) * nb;
        if (xs) mf_kern_fp8_xs_avx2(x, s, n, xs_buf, ok);
        int o = o0;
        for (; o + 2 <= o1; o += 2) {
            const uint8_t *wa = (const uint8_t *)m->w + (size_t)o * n;
            if (zmm) mf_kern_fp8_pair_zmm(wa, wa + n, n, s, x, xs, ok, &y[o - y_row0], &y[o + 1 - y_row0]);
            else mf_kern_fp8_pair_avx2(wa, wa + n, n, s, x, xs, ok, &y[o - y_row0], &y[o + 1 - y_row0]);
        }
        if (o < o1) {
            const uint8_t *wa = (const uint8_t *)m->w + (size_t)o * n;
            mf_kern_fp8_pair_avx2(wa, wa, n, s, x, xs, ok, &y[o - y_row0], NULL);
        }
        o0 = o1;
    }
}

void mf_kern_fp8_rows(const mf_kern_mat *m, const float *x, int n_tok, int ld_x, float *y,
                      int ld_y, int y_row0, int r0, int r1)
{
    if (n_tok == 1 && mf_kern_simd_active() == MF_KERN_SIMD_AVX2) {
        mf_kern_fp8_tok1(m, x, y, y_row0, r0, r1, mf_kern_fp8_tok1_avx512());
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
