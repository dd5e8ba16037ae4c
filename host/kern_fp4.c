/* FP4 (E2M1 pairs, one E8M0 scale per 1x32 block) fused matmul for the routed experts.
 * The int8 path (what decode uses): activations quantized once per call to int8 with a scale per
 * token per 256 inputs (a "group" of 8 blocks); the AVX2 kernel turns 32 packed bytes into 64 int8
 * weights (2 x e2m1, exact) with one vpshufb per 32 and multiplies with vpmaddubsw: for 1-2 tokens
 * |w| times q with w's sign moved onto q, for more tokens signed w times q + 128 with the 128 *
 * sum(w) part removed once per row group for all tokens. Each block's scale enters as an int16
 * factor 2^(14 - (emax - e)) in vpmaddwd, so a group is one exact int32 sum per lane and one
 * float FMA per token. The scalar path computes the same integers and float operations. The
 * fp32 path decodes exact fp32 tiles for the shared engine (kern_common.c). */
#include "host/kern_internal.h"

#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "host/formats.h"
#include "sched/error.h"

/* Calls of up to this many tokens store signed codes (the sign scheme: no per-row correction);
 * larger ones store q + 128 (the offset scheme: fewer operations per token). */
#define MF_Q8_SIGNED_MAX_TOK 2
#define SIGN_MAX_TOK MF_Q8_SIGNED_MAX_TOK
#define MF_FP4_PREFETCH 2048           /* bytes of weights fetched ahead (16 groups) */
#define CHUNK_TOK 16    /* many-token calls: tokens per sweep over a block of rows */
#define CHUNK_ROWS 8    /* rows per block (8 x 2.7 KB of weights stays in L1/L2) */
#define GROUP_BLOCKS 8                      /* 32-blocks per activation scale group (256 inputs) */

/* 2 * e2m1(code) as int8: exact small integers. */
static const int8_t mf_fp4_twice[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* ---- quantized activations ------------------------------------------------------------------- */

static size_t mf_q8_row_bytes(int n_in)
{
    int n_blk = n_in / 32;
    return (size_t)((n_blk + 1) / 2) * 64;
}

size_t mf_kern_q8_bytes(int n_tok, int n_in)
{
    if (n_tok < 1 || n_in < 32 || n_in % 32)
        return 0;
    int n_sb = (n_in / 32 + GROUP_BLOCKS - 1) / GROUP_BLOCKS;
    return 32 + (size_t)n_tok * mf_q8_row_bytes(n_in) + (size_t)n_tok * n_sb * sizeof(float);
}

int mf_kern_q8_init(mf_kern_q8 *q, void *buf, size_t buf_bytes, int n_tok, int n_in)
{
    size_t need = mf_kern_q8_bytes(n_tok, n_in);
    if (!q || !buf || need == 0)
        return mf_error(-EINVAL, "q8 init: %s (n_tok %d, n_in %d: expected n_tok >= 1 and n_in a "
                        "positive multiple of 32)", !q || !buf ? "NULL pointer" : "bad shape",
                        n_tok, n_in);
    if (buf_bytes < need)
        return mf_error(-EINVAL, "q8 init: buffer of %zu bytes for %d x %d, expected >= %zu",
                        buf_bytes, n_tok, n_in, need);
    uintptr_t p = ((uintptr_t)buf + 31) & ~(uintptr_t)31;
    q->n_tok = n_tok;
    q->n_in = n_in;
    q->n_sb = (n_in / 32 + GROUP_BLOCKS - 1) / GROUP_BLOCKS;
    q->row_bytes = mf_q8_row_bytes(n_in);
    q->offset = n_tok <= MF_Q8_SIGNED_MAX_TOK ? 0 : 128;
    q->q = (uint8_t *)p;
    q->scale = (float *)(q->q + (size_t)n_tok * q->row_bytes);
    return 0;
}

/* Byte offset of element e of block b inside a token's quantized row. */
static inline size_t mf_q8_pos(int b, int e)
{
    return (size_t)(b / 2) * 64 + (size_t)(e & 1) * 32 + (size_t)(b & 1) * 16 + (size_t)(e / 2);
}

/* max|x| over a group and whether it holds inf/NaN; returns the group's inverse step (0: all zero
 * codes) and sets *scale. Shared by both paths so the two quantize identically. */
static float mf_q8_group_scale(float amax, int nonfinite, float *scale)
{
    if (nonfinite) {
        *scale = NAN;
        return 0.0f;
    }
    float inv = 127.0f / amax;
    if (amax == 0.0f || !(inv <= FLT_MAX)) {   /* zero or too tiny to scale: codes 0 */
        *scale = 0.0f;
        return 0.0f;
    }
    *scale = amax / 127.0f;
    return inv;
}

static void mf_q8_token_scalar(const mf_kern_q8 *q, const float *x, int t)
{
    const int off = q->offset;
    int n_blk = q->n_in / 32;
    uint8_t *row = q->q + (size_t)t * q->row_bytes;
    for (int s = 0; s < q->n_sb; s++) {
        int b0 = s * GROUP_BLOCKS, b1 = b0 + GROUP_BLOCKS < n_blk ? b0 + GROUP_BLOCKS : n_blk;
        float amax = 0.0f;
        int nonfinite = 0;
        for (int k = b0 * 32; k < b1 * 32; k++) {
            float a = fabsf(x[k]);
            amax = a > amax ? a : amax;
            nonfinite |= !(a <= FLT_MAX);
        }
        float inv = mf_q8_group_scale(amax, nonfinite, &q->scale[(size_t)t * q->n_sb + s]);
        for (int b = b0; b < b1; b++)
            for (int e = 0; e < 32; e++) {
                float v = rintf(x[b * 32 + e] * inv);
                int c = inv == 0.0f ? 0 : (v > 127.0f ? 127 : v < -128.0f ? -128 : (int)v);
                row[mf_q8_pos(b, e)] = (uint8_t)(c + off);
            }
    }
    if (n_blk & 1)   /* the absent partner of an odd last block: q = 0 (its weights are 0 too) */
        for (int e = 0; e < 32; e++)
            row[mf_q8_pos(n_blk, e)] = (uint8_t)off;
}

__attribute__((target("avx2,fma")))
static void mf_q8_token_avx2(const mf_kern_q8 *q, const float *x, int t)
{
    const __m256i off = _mm256_set1_epi8((char)q->offset);   /* 0x80 or 0: + 128 or not */
    int n_blk = q->n_in / 32;
    uint8_t *row = q->q + (size_t)t * q->row_bytes;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 fmax = _mm256_set1_ps(FLT_MAX);
    /* packs give lane 0 = elements {0-3, 8-11, 16-19, 24-27}, lane 1 = {4-7, ...}: within a lane
     * this shuffle puts word pairs (e, e+2) of the evens first. */
    const __m256i ev = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                        0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int s = 0; s < q->n_sb; s++) {
        int b0 = s * GROUP_BLOCKS, b1 = b0 + GROUP_BLOCKS < n_blk ? b0 + GROUP_BLOCKS : n_blk;
        __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int k = b0 * 32; k < b1 * 32; k += 8) {
            __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + k), absmask);
            m = _mm256_max_ps(a, m);                         /* NaN in a: keeps m, as scalar */
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, fmax, _CMP_NLE_UQ));
        }
        _Alignas(32) float mv[8];
        _mm256_store_ps(mv, m);
        float amax = 0.0f;
        for (int i = 0; i < 8; i++)
            amax = mv[i] > amax ? mv[i] : amax;
        int nonfinite = _mm256_movemask_ps(bad) != 0;
        float inv = mf_q8_group_scale(amax, nonfinite, &q->scale[(size_t)t * q->n_sb + s]);
        __m256 vinv = _mm256_set1_ps(inv);
        for (int b = b0; b < b1; b++) {
            const float *xb = x + b * 32;
            __m256i v0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb), vinv));
            __m256i v1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8), vinv));
            __m256i v2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 16), vinv));
            __m256i v3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 24), vinv));
            if (inv == 0.0f)
                v0 = v1 = v2 = v3 = _mm256_setzero_si256();
            /* words: lane0 = e0-3, e8-11 | lane1 = e4-7, e12-15 (and 16-31 likewise) */
            __m256i p01 = _mm256_packs_epi32(v0, v1), p23 = _mm256_packs_epi32(v2, v3);
            /* bytes: lane0 = e0-3, e8-11, e16-19, e24-27 | lane1 = e4-7, e12-15, e20-23, e28-31 */
            __m256i by = _mm256_xor_si256(_mm256_packs_epi16(p01, p23), off);
            /* lane0 -> words (e0,e2)(e8,e10)(e16,e18)(e24,e26) | (e1,e3)(e9,e11)(e17,e19)(e25,e27) */
            __m256i sh = _mm256_shuffle_epi8(by, ev);
            __m128i lo = _mm256_castsi256_si128(sh), hi = _mm256_extracti128_si256(sh, 1);
            __m128i evens = _mm_unpacklo_epi16(lo, hi), odds = _mm_unpackhi_epi16(lo, hi);
            _mm_storeu_si128((__m128i *)(row + mf_q8_pos(b, 0)), evens);
            _mm_storeu_si128((__m128i *)(row + mf_q8_pos(b, 1)), odds);
        }
    }
    if (n_blk & 1) {
        __m128i c = _mm256_castsi256_si128(off);
        _mm_storeu_si128((__m128i *)(row + mf_q8_pos(n_blk, 0)), c);
        _mm_storeu_si128((__m128i *)(row + mf_q8_pos(n_blk, 1)), c);
    }
}

int mf_kern_q8_quantize(const mf_kern_q8 *q, const float *x, int ld_x, int t0, int t1)
{
    if (!q || !q->q || !x)
        return mf_error(-EINVAL, "q8 quantize: NULL %s", !x ? "input" : "q8 view");
    if (ld_x < q->n_in || t0 < 0 || t1 > q->n_tok || t0 > t1)
        return mf_error(-EINVAL, "q8 quantize: tokens [%d, %d) of %d, ld_x %d for n_in %d",
                        t0, t1, q->n_tok, ld_x, q->n_in);
    int avx2 = mf_kern_simd_active() == MF_KERN_SIMD_AVX2;
    for (int t = t0; t < t1; t++) {
        if (avx2)
            mf_q8_token_avx2(q, x + (size_t)t * ld_x, t);
        else
            mf_q8_token_scalar(q, x + (size_t)t * ld_x, t);
    }
    return 0;
}

/* ---- int8 kernel ----------------------------------------------------------------------------- */

/* A group's block factors: S[i] = 2^(14 - (emax - e_i)), 0 when more than 14 binades below emax;
 * returns emax. Absent blocks (i >= nb) read as e = 0. */
static inline unsigned mf_fp4_group_factors(const uint8_t *e, int nb, int32_t S[GROUP_BLOCKS])
{
    unsigned emax = 0;
    for (int i = 0; i < nb; i++)
        emax = e[i] > emax ? e[i] : emax;
    for (int i = 0; i < GROUP_BLOCKS; i++) {
        unsigned d = emax - (i < nb ? e[i] : 0u);
        S[i] = d <= 14 ? 1 << (14 - d) : 0;
    }
    return emax;
}

static void mf_fp4_rows_scalar(const uint8_t *w, const uint8_t *scale, int n_in,
                               const mf_kern_q8 *xq, float *y, int ld_y, int y_row0, int r0, int r1)
{
    int n_blk = n_in / 32;
    _Alignas(32) float facc[MF_KERN_TOK_PASS][8];
    for (int t0 = 0; t0 < xq->n_tok; t0 += MF_KERN_TOK_PASS) {
        int nt = xq->n_tok - t0 < MF_KERN_TOK_PASS ? xq->n_tok - t0 : MF_KERN_TOK_PASS;
        for (int o = r0; o < r1; o++) {
            const uint8_t *wr = w + (size_t)o * (n_in / 2), *sr = scale + (size_t)o * n_blk;
            memset(facc, 0, sizeof(float) * 8 * (size_t)nt);
            for (int s = 0; s < xq->n_sb; s++) {
                int b0 = s * GROUP_BLOCKS, nb = n_blk - b0 < GROUP_BLOCKS ? n_blk - b0 : GROUP_BLOCKS;
                int32_t S[GROUP_BLOCKS];
                unsigned emax = mf_fp4_group_factors(sr + b0, nb, S);
                float gscale = mf_kern_pow2_e8m0(emax, 15);   /* 2^(emax-142): S and the 2x */
                for (int t = 0; t < nt; t++) {
                    const uint8_t *xr = xq->q + (size_t)(t0 + t) * xq->row_bytes;
                    int32_t acc[8] = {0};
                    for (int i = 0; i < nb; i++) {
                        int b = b0 + i, h = i & 1;
                        for (int e = 0; e < 32; e++) {
                            int wv = mf_fp4_twice[mf_e2m1_get(wr + (size_t)b * 16, (size_t)e)];
                            int xv = (int8_t)(uint8_t)((int)xr[mf_q8_pos(b, e)] - xq->offset);
                            acc[4 * h + e / 8] += S[i] * wv * xv;
                        }
                    }
                    float ts = gscale * xq->scale[(size_t)(t0 + t) * xq->n_sb + s];
                    for (int l = 0; l < 8; l++)
                        facc[t][l] = fmaf((float)acc[l], ts, facc[t][l]);
                }
            }
            for (int t = 0; t < nt; t++)
                y[(size_t)(t0 + t) * ld_y + (o - y_row0)] = mf_kern_reduce8(facc[t]);
        }
    }
}

/* vpshufb controls that spread a group's 8 int16 factors to pair p: low lane = block 2p's
 * factor (bytes 4p, 4p+1), high lane = block 2p+1's. */
static const _Alignas(32) uint8_t mf_fp4_pair_ctl[4][32] = {
#define MF_CTL(p) {4 * p, 4 * p + 1, 4 * p, 4 * p + 1, 4 * p, 4 * p + 1, 4 * p, 4 * p + 1,         \
                   4 * p, 4 * p + 1, 4 * p, 4 * p + 1, 4 * p, 4 * p + 1, 4 * p, 4 * p + 1,         \
                   4 * p + 2, 4 * p + 3, 4 * p + 2, 4 * p + 3, 4 * p + 2, 4 * p + 3, 4 * p + 2,   \
                   4 * p + 3, 4 * p + 2, 4 * p + 3, 4 * p + 2, 4 * p + 3, 4 * p + 2, 4 * p + 3,   \
                   4 * p + 2, 4 * p + 3}
    MF_CTL(0), MF_CTL(1), MF_CTL(2), MF_CTL(3)
#undef MF_CTL
};

/* One group of nb blocks (<= 8, ceil(nb/2) pairs) of one row for all nt tokens, added to
 * facc[t]. Two exact integer schemes giving the same lane sums:
 *  - sign (few tokens): |w| as the unsigned operand, the weight's sign moved onto q (vpsignb);
 *  - offset (many tokens): q + 128 as the unsigned operand, signed w, and the 128 * sum(w) part
 *    removed once per row group (C), which leaves 5 ops per token and pair.
 * Always inlined so the pair loops unroll with weights and factors in registers. */
__attribute__((target("avx2,fma"), always_inline))
static inline void mf_fp4_group_avx2(const uint8_t *wg, __m256i Sb, __m256 gscale, int nb,
                                     int sign,
                                     const uint8_t *xg, size_t x_stride, const float *xs,
                                     size_t xs_stride, int nt, __m256 *fa)
{
    const int np = (nb + 1) / 2;
    const __m256i lut = sign
        ? _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12,
                           0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12)
        : _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                           0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m256i nib = _mm256_set1_epi8(0x0F), c128 = _mm256_set1_epi8((char)0x80);
    /* the weight stream runs on contiguously across rows: fetch MF_FP4_PREFETCH bytes ahead, as
     * a many-token call consumes too slowly for the hardware prefetcher to cover DRAM latency
     * (a prefetch past the matrix's end does not fault) */
    _mm_prefetch((const char *)(wg + MF_FP4_PREFETCH), _MM_HINT_T0);
    _mm_prefetch((const char *)(wg + MF_FP4_PREFETCH + 64), _MM_HINT_T0);

    if (sign) {
        /* 1-2 tokens: each pair decoded and used at once, so few vectors are live */
        __m256i acc[SIGN_MAX_TOK];
        for (int t = 0; t < nt; t++)
            acc[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int p = 0; p < np; p++) {
            __m256i v;
            if (2 * p + 1 < nb)
                v = _mm256_loadu_si256((const __m256i *)(wg + 32 * p));
            else
                v = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(wg + 32 * p)));
            /* |w| of the even (A1) and odd (A2) elements of blocks (2p | 2p+1); bit 7 of each
             * byte of v << 4 and v is the sign bit of its low and high nibble (where a
             * magnitude is 0 the product is 0 whatever that sign source says) */
            __m256i A1 = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, nib));
            __m256i A2 = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), nib));
            __m256i G1 = _mm256_slli_epi16(v, 4);
            __m256i Sp = _mm256_shuffle_epi8(Sb, _mm256_load_si256((const __m256i *)mf_fp4_pair_ctl[p]));
            for (int t = 0; t < nt; t++) {
                const uint8_t *xt = xg + (size_t)t * x_stride + 64 * p;
                __m256i q16 = _mm256_add_epi16(
                    _mm256_maddubs_epi16(A1, _mm256_sign_epi8(_mm256_load_si256((const __m256i *)xt), G1)),
                    _mm256_maddubs_epi16(A2, _mm256_sign_epi8(_mm256_load_si256((const __m256i *)(xt + 32)), v)));
                acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(q16, Sp));
            }
        }
        for (int t = 0; t < nt; t++) {
            __m256 ts = _mm256_mul_ps(gscale, _mm256_set1_ps(xs[(size_t)t * xs_stride]));
            fa[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t]), ts, fa[t]);
        }
        return;
    }

    /* many tokens: W1/W2 = even/odd elements of blocks (2p | 2p+1) for all of them; the
     * accumulators start at -C, the +128 part */
    __m256i W1[4], W2[4], S[4];
    __m256i negC = _mm256_setzero_si256();
    for (int p = 0; p < 4; p++)       /* unused when np < 4 */
        W1[p] = W2[p] = S[p] = negC;
#pragma GCC unroll 4
    for (int p = 0; p < np; p++) {
        __m256i v;
        if (2 * p + 1 < nb)
            v = _mm256_loadu_si256((const __m256i *)(wg + 32 * p));
        else
            v = _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(wg + 32 * p)));
        W1[p] = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, nib));
        W2[p] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), nib));
        S[p] = _mm256_shuffle_epi8(Sb, _mm256_load_si256((const __m256i *)mf_fp4_pair_ctl[p]));
        /* 128 * (w_even + w_odd) per byte pair, scaled like the products */
        __m256i ws = _mm256_add_epi8(W1[p], W2[p]);
        negC = _mm256_sub_epi32(negC, _mm256_madd_epi16(_mm256_maddubs_epi16(c128, ws), S[p]));
    }
    for (int t = 0; t < nt; t++) {
        const uint8_t *xt = xg + (size_t)t * x_stride;
        __m256i acc = negC;
#pragma GCC unroll 4
        for (int p = 0; p < np; p++) {
            __m256i x1 = _mm256_load_si256((const __m256i *)(xt + 64 * p));
            __m256i x2 = _mm256_load_si256((const __m256i *)(xt + 64 * p + 32));
            __m256i q16 = _mm256_add_epi16(_mm256_maddubs_epi16(x1, W1[p]),
                                           _mm256_maddubs_epi16(x2, W2[p]));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(q16, S[p]));
        }
        __m256 ts = _mm256_mul_ps(gscale, _mm256_set1_ps(xs[(size_t)t * xs_stride]));
        fa[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), ts, fa[t]);
    }
}

/* A quad of four groups' 32 scale codes (absent blocks 0): per block D = min(emax - e, 15), emax
 * being its group's largest code, and the group scales 2^(emax - 142) (mf_kern_pow2_e8m0(emax,
 * 15)) each in every lane of gs[g]. Both one-token factor forms below start here. */
__attribute__((target("avx2,fma"), always_inline))
static inline __m256i mf_fp4_quad_d(__m256i E, __m256 gs[4])
{
    const __m256i bc0 = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8,
                                         0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
    __m256i M = _mm256_max_epu8(E, _mm256_srli_epi64(E, 32));
    M = _mm256_max_epu8(M, _mm256_srli_epi64(M, 16));
    M = _mm256_max_epu8(M, _mm256_srli_epi64(M, 8));            /* emax in byte 0 of each qword */
    /* group scales: dwords 0, 2, 4, 6 hold emax */
    __m256i e = _mm256_and_si256(M, _mm256_set1_epi64x(0xFF));
    __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(15)), 23);
    __m256i sub = _mm256_srlv_epi32(_mm256_set1_epi32(0x400000),
                                    _mm256_sub_epi32(_mm256_set1_epi32(15), e));
    __m256i bits = _mm256_blendv_epi8(sub, normal, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(15)));
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC00000),
                              _mm256_cmpeq_epi32(e, _mm256_set1_epi32(0xFF)));
    __m256 g = _mm256_castsi256_ps(bits);
    gs[0] = _mm256_permutevar8x32_ps(g, _mm256_set1_epi32(0));
    gs[1] = _mm256_permutevar8x32_ps(g, _mm256_set1_epi32(2));
    gs[2] = _mm256_permutevar8x32_ps(g, _mm256_set1_epi32(4));
    gs[3] = _mm256_permutevar8x32_ps(g, _mm256_set1_epi32(6));
    return _mm256_min_epu8(_mm256_subs_epu8(_mm256_shuffle_epi8(M, bc0), E), _mm256_set1_epi8(15));
}

/* Factors of four groups from their 32 scale codes: per group the int16 factors S = 2^(14 - D)
 * (0 for D = 15) in both lanes, and the group scales (mf_fp4_quad_d). */
__attribute__((target("avx2,fma"), always_inline))
static inline void mf_fp4_quad_factors(__m256i E, __m256i Sg[4], __m256 gs[4])
{
    const __m256i tlo = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, (char)0x80, 64, 32, 16, 8, 4, 2, 1, 0,
                                         0, 0, 0, 0, 0, 0, 0, (char)0x80, 64, 32, 16, 8, 4, 2, 1, 0);
    const __m256i thi = _mm256_setr_epi8(64, 32, 16, 8, 4, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         64, 32, 16, 8, 4, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    __m256i D = mf_fp4_quad_d(E, gs);
    __m256i lo = _mm256_shuffle_epi8(tlo, D), hi = _mm256_shuffle_epi8(thi, D);
    __m256i a = _mm256_unpacklo_epi8(lo, hi), b = _mm256_unpackhi_epi8(lo, hi);   /* 0|2, 1|3 */
    Sg[0] = _mm256_permute2x128_si256(a, a, 0x00);
    Sg[1] = _mm256_permute2x128_si256(b, b, 0x00);
    Sg[2] = _mm256_permute2x128_si256(a, a, 0x11);
    Sg[3] = _mm256_permute2x128_si256(b, b, 0x11);
}

/* Rows of one token pass; `sign` picks the scheme and nt_const > 0 fixes the token count (both
 * constants at each call, so the accumulators of a 1- or 2-token pass stay in registers). */
__attribute__((target("avx2,fma"), always_inline))
static inline void mf_fp4_pass_avx2(const uint8_t *w, const uint8_t *scale, int n_in,
                                    const uint8_t *xr, size_t row_bytes, const float *xs, int n_sb,
                                    int nt_var, int nt_const, int sign, float *y, int ld_y,
                                    int y_row0, int r0, int r1)
{
    int n_blk = n_in / 32;
    int nt = nt_const > 0 ? nt_const : nt_var;
    int n_quad = n_blk / 32;              /* quads of four full groups */
    _Alignas(32) __m256 fa[MF_KERN_TOK_PASS];
    _Alignas(32) float lanes[8];
    _Alignas(32) uint8_t epad[32];
    for (int o = r0; o < r1; o++) {
        const uint8_t *wr = w + (size_t)o * (n_in / 2), *sr = scale + (size_t)o * n_blk;
        for (int t = 0; t < nt; t++)
            fa[t] = _mm256_setzero_ps();
        __m256i Sg[4];
        __m256 gs[4];
        for (int q = 0; q < n_quad; q++) {
            _mm_prefetch((const char *)(sr + q * 32 + MF_FP4_PREFETCH / 16), _MM_HINT_T0);
            mf_fp4_quad_factors(_mm256_loadu_si256((const __m256i *)(sr + q * 32)), Sg, gs);
#pragma GCC unroll 4
            for (int g = 0; g < 4; g++) {
                int s = 4 * q + g;
                mf_fp4_group_avx2(wr + (size_t)s * 128, Sg[g], gs[g], GROUP_BLOCKS, sign,
                                  xr + (size_t)s * 256, row_bytes, xs + s, (size_t)n_sb, nt, fa);
            }
        }
        if (n_quad * 4 < n_sb) {          /* the last 1-4 groups, some possibly short */
            int nbq = n_blk - n_quad * 32;
            __m256i E;
            if (nbq % 4 == 0) {           /* whole dwords: a masked load reads nothing past them */
                __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                E = _mm256_maskload_epi32((const int *)(sr + n_quad * 32),
                                          _mm256_cmpgt_epi32(_mm256_set1_epi32(nbq / 4), lane));
            } else {
                memset(epad, 0, sizeof epad);
                memcpy(epad, sr + n_quad * 32, (size_t)nbq);
                E = _mm256_load_si256((const __m256i *)epad);
            }
            mf_fp4_quad_factors(E, Sg, gs);
            for (int g = 0; g < n_sb - n_quad * 4; g++) {
                int s = 4 * n_quad + g;
                int nb = n_blk - s * GROUP_BLOCKS < GROUP_BLOCKS ? n_blk - s * GROUP_BLOCKS : GROUP_BLOCKS;
                if (nb == GROUP_BLOCKS)
                    mf_fp4_group_avx2(wr + (size_t)s * 128, Sg[g], gs[g], GROUP_BLOCKS, sign,
                                      xr + (size_t)s * 256, row_bytes, xs + s, (size_t)n_sb, nt, fa);
                else
                    mf_fp4_group_avx2(wr + (size_t)s * 128, Sg[g], gs[g], nb, sign,
                                      xr + (size_t)s * 256, row_bytes, xs + s, (size_t)n_sb, nt, fa);
            }
        }
        for (int t = 0; t < nt; t++) {
            _mm256_store_ps(lanes, fa[t]);
            y[(size_t)t * ld_y + (o - y_row0)] = mf_kern_reduce8(lanes);
        }
    }
}

/* The scheme follows the codes' storage (signed for calls of 1-2 tokens, see mf_kern_q8_init). */
/* Many tokens: blocks of CHUNK_ROWS rows (in cache after the first chunk) against CHUNK_TOK
 * tokens at a time, so those tokens' codes stay in L1. Kept out of line: inlined next to the
 * single-sweep pass it made GCC schedule that one worse (10% at 8 tokens). */
__attribute__((target("avx2,fma"), noinline))
static void mf_fp4_rows_chunked_avx2(const uint8_t *w, const uint8_t *scale, int n_in,
                                     const uint8_t *xr, size_t row_bytes, const float *xs, int n_sb,
                                     int nt, float *yt, int ld_y, int y_row0, int r0, int r1)
{
    for (int o0 = r0; o0 < r1; o0 += CHUNK_ROWS) {
        int o1 = r1 - o0 < CHUNK_ROWS ? r1 : o0 + CHUNK_ROWS;
        for (int tc = 0; tc < nt; tc += CHUNK_TOK) {
            int nc = nt - tc < CHUNK_TOK ? nt - tc : CHUNK_TOK;
            mf_fp4_pass_avx2(w, scale, n_in, xr + (size_t)tc * row_bytes, row_bytes,
                             xs + (size_t)tc * n_sb, n_sb, nc, 0, 0, yt + (size_t)tc * ld_y, ld_y,
                             y_row0, o0, o1);
        }
    }
}

/* ---- one token on AVX-512 (VNNI, VBMI) ------------------------------------------------------- */

/* Widest input whose relaid codes the one-token AVX-512 loop keeps on the stack (16 KiB). */
#define MF_FP4_Z_MAX 16384

/* A quad's per-block left shifts for the AVX-512 loop: 14 - D of its exact int32 sums, 32 where
 * D = 15 (the factor 0: vpsllvd then gives 0), i.e. mf_fp4_quad_factors' S as shifts, in bytes;
 * the group scales as there (mf_fp4_quad_d). */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma"), always_inline))
static inline __m256i mf_fp4_quad_shifts(__m256i E, __m256 gs[4])
{
    __m256i D = mf_fp4_quad_d(E, gs);
    return _mm256_mask_blend_epi8(_mm256_cmpeq_epi8_mask(D, _mm256_set1_epi8(15)),
                                  _mm256_sub_epi8(_mm256_set1_epi8(14), D), _mm256_set1_epi8(32));
}

/* Rows [r0, r1) for one token whose codes are signed (the sign scheme), n_in a multiple of 256:
 * mf_fp4_pass_avx2's integers and float operations, 64 bytes of weights (four blocks) a step.
 * |w| of the low and high nibbles by vpermb from a 64-entry table (the nibble's other index bits
 * select copies), the weights' signs onto x by masked negation, vpdpbusd for sums of four products,
 * each block's factor as a left shift of its int32 sums (vpsllvd), and the group's blocks folded
 * into the AVX2 loop's eight lanes (even blocks 0-3, odd 4-7): exact integers, so the same lane
 * sums, then the same cvt and FMA per group and the same reduction: the same bits. The token's
 * codes are first laid out per four blocks as 64 even elements then 64 odd (xz). */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma")))
static void mf_fp4_tok1_zmm(const uint8_t *w, const uint8_t *scale, int n_in, const uint8_t *xr,
                            const float *xs, int n_sb, float *y, int y_row0, int r0, int r1)
{
    const int n_blk = n_in / 32, n_quad = n_blk / 32;
    _Alignas(64) uint8_t xz[MF_FP4_Z_MAX];
    for (int k = 0; k < n_blk / 4; k++) {   /* blocks 4k..4k+3 = pairs 2k, 2k+1 of the q8 row */
        const uint8_t *p = xr + (size_t)k * 128;
        memcpy(xz + k * 128, p, 32);
        memcpy(xz + k * 128 + 32, p + 64, 32);
        memcpy(xz + k * 128 + 64, p + 32, 32);
        memcpy(xz + k * 128 + 96, p + 96, 32);
    }
    _Alignas(64) static const uint8_t abs2[64] = {
#define MF_ABS8 0, 1, 2, 3, 4, 6, 8, 12
        MF_ABS8, MF_ABS8, MF_ABS8, MF_ABS8, MF_ABS8, MF_ABS8, MF_ABS8, MF_ABS8
#undef MF_ABS8
    };
    const __m512i lut = _mm512_load_si512((const void *)abs2);
    const __m512i s08 = _mm512_set1_epi8(0x08), zero = _mm512_setzero_si512();
    /* dword j of half h of group g takes block 8g + 4h + j / 4's shift: its byte 0 indexes the
     * quad's shift bytes (the permute below keeps byte 0 and zeroes the rest) */
    const __m512i sidx0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512i sidx[4][2];
    for (int g = 0; g < 4; g++)
        for (int h = 0; h < 2; h++) sidx[g][h] = _mm512_add_epi32(sidx0, _mm512_set1_epi32(8 * g + 4 * h));
    _Alignas(32) float lanes[8];
    _Alignas(32) uint8_t epad[32];
    for (int o = r0; o < r1; o++) {
        const uint8_t *wr = w + (size_t)o * (n_in / 2), *sr = scale + (size_t)o * n_blk;
        __m256 fa = _mm256_setzero_ps();
        for (int q = 0; q * 4 < n_sb; q++) {
            int ng = n_sb - 4 * q < 4 ? n_sb - 4 * q : 4;
            __m256i E;
            if (q < n_quad) {
                E = _mm256_loadu_si256((const __m256i *)(sr + q * 32));
            } else {   /* the last 1-3 whole groups */
                memset(epad, 0, sizeof epad);
                memcpy(epad, sr + q * 32, (size_t)ng * 8);
                E = _mm256_load_si256((const __m256i *)epad);
            }
            _mm_prefetch((const char *)(sr + q * 32 + MF_FP4_PREFETCH / 16), _MM_HINT_T0);
            __m256 gs[4];
            __m512i sh = _mm512_castsi256_si512(mf_fp4_quad_shifts(E, gs));
            for (int g = 0; g < ng; g++) {
                int s = 4 * q + g;
                const uint8_t *wg = wr + (size_t)s * 128, *xg = xz + (size_t)s * 256;
                _mm_prefetch((const char *)(wg + MF_FP4_PREFETCH), _MM_HINT_T0);
                _mm_prefetch((const char *)(wg + MF_FP4_PREFETCH + 64), _MM_HINT_T0);
                __m512i acc = zero;
                for (int h = 0; h < 2; h++) {
                    __m512i v = _mm512_loadu_si512((const void *)(wg + 64 * h));
                    __m512i A1 = _mm512_permutexvar_epi8(v, lut);
                    __m512i A2 = _mm512_permutexvar_epi8(_mm512_srli_epi16(v, 4), lut);
                    __m512i x1 = _mm512_load_si512((const void *)(xg + 128 * h));
                    __m512i x2 = _mm512_load_si512((const void *)(xg + 128 * h + 64));
                    x1 = _mm512_mask_sub_epi8(x1, _mm512_test_epi8_mask(v, s08), zero, x1);
                    x2 = _mm512_mask_sub_epi8(x2, _mm512_movepi8_mask(v), zero, x2);
                    __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, A1, x1), A2, x2);
                    acc = _mm512_add_epi32(acc, _mm512_sllv_epi32(d, _mm512_maskz_permutexvar_epi8(
                                                                        0x1111111111111111ull, sidx[g][h], sh)));
                }
                /* lanes 0 + 2 (even blocks), 1 + 3 (odd): the AVX2 loop's eight lane sums */
                acc = _mm512_add_epi32(acc, _mm512_shuffle_i64x2(acc, acc, _MM_SHUFFLE(1, 0, 3, 2)));
                __m256 ts = _mm256_mul_ps(gs[g], _mm256_set1_ps(xs[s]));
                fa = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm512_castsi512_si256(acc)), ts, fa);
            }
        }
        _mm256_store_ps(lanes, fa);
        y[o - y_row0] = mf_kern_reduce8(lanes);
    }
}

__attribute__((target("avx2,fma")))
static void mf_fp4_rows_avx2(const uint8_t *w, const uint8_t *scale, int n_in,
                             const mf_kern_q8 *xq, float *y, int ld_y, int y_row0, int r0, int r1)
{
    for (int t0 = 0; t0 < xq->n_tok; t0 += MF_KERN_TOK_PASS) {
        int nt = xq->n_tok - t0 < MF_KERN_TOK_PASS ? xq->n_tok - t0 : MF_KERN_TOK_PASS;
        const uint8_t *xr = xq->q + (size_t)t0 * xq->row_bytes;
        const float *xs = xq->scale + (size_t)t0 * xq->n_sb;
        float *yt = y + (size_t)t0 * ld_y;
        if (!xq->offset && nt == 1 && xq->n_in % 256 == 0 && xq->n_in <= MF_FP4_Z_MAX && mf_kern_fp4_tok1_avx512()) {
            mf_fp4_tok1_zmm(w, scale, n_in, xr, xs, xq->n_sb, yt, y_row0, r0, r1);
        } else if (!xq->offset) {
            /* signed codes (calls of 1-2 tokens, or hand-made views): two tokens at a time */
            for (int tc = 0; tc < nt; tc += 2) {
                const uint8_t *xc = xr + (size_t)tc * xq->row_bytes;
                const float *sc = xs + (size_t)tc * xq->n_sb;
                if (nt - tc == 1)
                    mf_fp4_pass_avx2(w, scale, n_in, xc, xq->row_bytes, sc, xq->n_sb, 1, 1, 1,
                                     yt + (size_t)tc * ld_y, ld_y, y_row0, r0, r1);
                else
                    mf_fp4_pass_avx2(w, scale, n_in, xc, xq->row_bytes, sc, xq->n_sb, 2, 2, 1,
                                     yt + (size_t)tc * ld_y, ld_y, y_row0, r0, r1);
            }
        } else if (nt <= CHUNK_TOK) {
            mf_fp4_pass_avx2(w, scale, n_in, xr, xq->row_bytes, xs, xq->n_sb, nt, 0, 0, yt, ld_y,
                             y_row0, r0, r1);
        } else {
            mf_fp4_rows_chunked_avx2(w, scale, n_in, xr, xq->row_bytes, xs, xq->n_sb, nt, yt, ld_y,
                                     y_row0, r0, r1);
        }
    }
}

void mf_kern_fp4_rows(const mf_kern_mat *m, const mf_kern_q8 *xq, float *y, int ld_y, int y_row0,
                      int r0, int r1)
{
    if (mf_kern_simd_active() == MF_KERN_SIMD_AVX2)
        mf_fp4_rows_avx2(m->w, m->scale, m->n_in, xq, y, ld_y, y_row0, r0, r1);
    else
        mf_fp4_rows_scalar(m->w, m->scale, m->n_in, xq, y, ld_y, y_row0, r0, r1);
}

int mf_kern_fp4_matmul(const uint8_t *w, const uint8_t *scale, int n_out, int n_in,
                       const mf_kern_q8 *xq, float *y, int ld_y, int r0, int r1)
{
    if (!xq || !xq->q)
        return mf_error(-EINVAL, "fp4 matmul: NULL quantized input");
    int rc = mf_kern_check("fp4 matmul", w, scale, 1, n_out, n_in, xq->q, xq->n_tok, xq->n_in, y,
                           ld_y, r0, r1);
    if (rc)
        return rc;
    if (xq->n_in != n_in)
        return mf_error(-EINVAL, "fp4 matmul: input quantized for n_in %d, weights have n_in %d",
                        xq->n_in, n_in);
    mf_kern_mat m = {MF_KERN_FP4, w, scale, n_out, n_in};
    mf_kern_fp4_rows(&m, xq, y, ld_y, 0, r0, r1);
    return 0;
}

/* ---- fp32 path ------------------------------------------------------------------------------- */

static void mf_fp4_decode_scalar(const mf_kern_mat *m, int row, int k0, int n, float *dst)
{
    const uint8_t *w = (const uint8_t *)m->w + (size_t)row * (m->n_in / 2);
    const uint8_t *s = m->scale + (size_t)row * (m->n_in / 32);
    for (int i = 0; i < n; i++)
        dst[i] = mf_e2m1_to_f32(mf_e2m1_get(w, (size_t)(k0 + i))) * mf_e8m0_to_f32(s[(k0 + i) / 32]);
}

__attribute__((target("avx2,fma")))
static void mf_fp4_decode_avx2(const mf_kern_mat *m, int row, int k0, int n, float *dst)
{
    const uint8_t *w = (const uint8_t *)m->w + (size_t)row * (m->n_in / 2) + k0 / 2;
    const uint8_t *s = m->scale + (size_t)row * (m->n_in / 32) + k0 / 32;
    mf_kern_prefetch(w, (size_t)n / 2);
    const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i nib = _mm_set1_epi8(0x0F);
    for (int i = 0; i < n; i += 32) {
        __m128i v = _mm_loadu_si128((const __m128i *)(w + i / 2));
        __m128i lo = _mm_and_si128(v, nib), hi = _mm_and_si128(_mm_srli_epi16(v, 4), nib);
        __m128i c0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));   /* elements 0-15 */
        __m128i c1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));   /* 16-31 */
        __m256 sc = _mm256_set1_ps(mf_kern_pow2_e8m0(s[i / 32], 1));     /* 2^(e-128): 2x codes */
        _mm256_store_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c0)), sc));
        _mm256_store_ps(dst + i + 8, _mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c0, 8))), sc));
        _mm256_store_ps(dst + i + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c1)), sc));
        _mm256_store_ps(dst + i + 24, _mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c1, 8))), sc));
    }
}

void mf_kern_fp4_rows_f32(const mf_kern_mat *m, const float *x, int n_tok, int ld_x, float *y,
                          int ld_y, int y_row0, int r0, int r1)
{
    mf_kern_f32_run(m, mf_fp4_decode_avx2, mf_fp4_decode_scalar, x, n_tok, ld_x, y, ld_y, y_row0,
                    r0, r1);
}

int mf_kern_fp4_matmul_f32(const uint8_t *w, const uint8_t *scale, int n_out, int n_in,
                           const float *x, int n_tok, int ld_x, float *y, int ld_y, int r0, int r1)
{
    int rc = mf_kern_check("fp4 matmul (fp32)", w, scale, 1, n_out, n_in, x, n_tok, ld_x, y, ld_y,
                           r0, r1);
    if (rc)
        return rc;
    mf_kern_mat m = {MF_KERN_FP4, w, scale, n_out, n_in};
    mf_kern_fp4_rows_f32(&m, x, n_tok, ld_x, y, ld_y, 0, r0, r1);
    return 0;
}
