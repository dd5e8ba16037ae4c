/* The fp32 16-lane vector code (host/kernels.h "fp32 vector code"): dots of up to 4 queries
 * against one key, weighted value sums in key order, and one head group's attention over a set
 * of keys built from them. graphs/step/fast_attn.c's heads, index scores and hyper-connection
 * mixes run on these, and `moeflow calibrate` times mf_kern_vec_attn for the profile's vec rate.
 * An AVX2 path and a scalar path of the same lanes and order: the same bits. */
#include <immintrin.h>
#include <math.h>

#include "host/formats.h"
#include "host/kernels.h"
#include "host/simd_bf16.h"

/* The 16-lane tree: lanes l and l+8, then l+4, l+2, l+1. */
static float mf_vec_tree16(const float *l)
{
    float t[8], u[4];
    for (int i = 0; i < 8; i++) t[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; i++) u[i] = t[i] + t[i + 4];
    return (u[0] + u[2]) + (u[1] + u[3]);
}

static float mf_vec_dot_scalar(const float *a, const float *b, int n)
{
    float l[16] = {0};
    for (int k = 0; k < n; k++) l[k % 16] = fmaf(a[k], b[k], l[k % 16]);
    return mf_vec_tree16(l);
}

__attribute__((target("avx2,fma"))) static inline float mf_vec_tree16_avx2(__m256 lo, __m256 hi)
{
    __m256 t = _mm256_add_ps(lo, hi);                                                 /* l + l+8 */
    __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));   /* + l+4 */
    __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));                                    /* u0+u2, u1+u3 */
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

/* out[g] = dot(q[g], k) for G <= 4 queries against one key of n (multiple of 16) floats. */
__attribute__((target("avx2,fma"))) static void mf_vec_dots_avx2(const float *const *q, int G, const float *k, int n,
                                                               float *out)
{
    __m256 lo[4], hi[4];
    for (int g = 0; g < 4; g++) lo[g] = hi[g] = _mm256_setzero_ps();
    for (int d = 0; d < n; d += 16) {
        __m256 k0 = _mm256_loadu_ps(k + d), k1 = _mm256_loadu_ps(k + d + 8);
        for (int g = 0; g < G; g++) {
            lo[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + d), k0, lo[g]);
            hi[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + d + 8), k1, hi[g]);
        }
    }
    for (int g = 0; g < G; g++) out[g] = mf_vec_tree16_avx2(lo[g], hi[g]);
}

static int mf_vec_avx2(int n) { return n % 16 == 0 && mf_kern_simd_active() == MF_KERN_SIMD_AVX2; }

void mf_kern_vec_dots(const float *const *q, int G, const float *k, int n, float *out)
{
    if (mf_vec_avx2(n)) {
        mf_vec_dots_avx2(q, G, k, n, out);
        return;
    }
    for (int g = 0; g < G; g++) out[g] = mf_vec_dot_scalar(q[g], k, n);
}

/* The loop of four queries against three keys over lanes h..h+7 of every 16 elements of [0, n), n
 * a multiple of 16, into the twelve accumulators a0..a3 (key 0), b0..b3 (key 1), c0..c3 (key 2):
 * each query vector, loaded once (v kept in a register: folded into the FMAs it would be loaded
 * three times), serves three keys (7 loads per 12 FMAs; one key at a time loads 10 per 8). Each
 * lane is one fmaf chain in element order. */
#define MF_VEC_DOTS4X3_LOOP(q, k, h, n)                                                                      \
    for (int d = (h); d < (n); d += 16) {                                                                   \
        __m256 k0 = _mm256_loadu_ps((k)[0] + d), k1 = _mm256_loadu_ps((k)[1] + d), k2 = _mm256_loadu_ps((k)[2] + d); \
        __m256 v;                                                                                           \
        MF_VEC_DOTS_STEP(q, 0, a0, b0, c0);                                                                 \
        MF_VEC_DOTS_STEP(q, 1, a1, b1, c1);                                                                 \
        MF_VEC_DOTS_STEP(q, 2, a2, b2, c2);                                                                 \
        MF_VEC_DOTS_STEP(q, 3, a3, b3, c3);                                                                 \
    }
#define MF_VEC_DOTS_STEP(q, g, A, B, C)                                                                     \
    v = _mm256_loadu_ps((q)[g] + d);                                                                        \
    __asm__("" : "+x"(v));                                                                                  \
    A = _mm256_fmadd_ps(v, k0, A), B = _mm256_fmadd_ps(v, k1, B), C = _mm256_fmadd_ps(v, k2, C)

/* out[j][g] = dot(q[g], k[j]) for 4 queries against 3 keys of n (multiple of 16) floats, the bits
 * of mf_vec_dots_avx2 per key: lanes 0-7 of all twelve dots first, then lanes 8-15, so twelve
 * accumulators stay in registers (MF_VEC_DOTS4X3_LOOP). */
__attribute__((target("avx2,fma"))) static void mf_vec_dots4x3_avx2(const float *const *q, const float *const *k, int n,
                                                                 float (*out)[4])
{
    __m256 lo[3][4];
    for (int h = 0; h < 16; h += 8) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;
        MF_VEC_DOTS4X3_LOOP(q, k, h, n)
        if (!h) {
            lo[0][0] = a0, lo[0][1] = a1, lo[0][2] = a2, lo[0][3] = a3;
            lo[1][0] = b0, lo[1][1] = b1, lo[1][2] = b2, lo[1][3] = b3;
            lo[2][0] = c0, lo[2][1] = c1, lo[2][2] = c2, lo[2][3] = c3;
        } else {
            out[0][0] = mf_vec_tree16_avx2(lo[0][0], a0), out[0][1] = mf_vec_tree16_avx2(lo[0][1], a1);
            out[0][2] = mf_vec_tree16_avx2(lo[0][2], a2), out[0][3] = mf_vec_tree16_avx2(lo[0][3], a3);
            out[1][0] = mf_vec_tree16_avx2(lo[1][0], b0), out[1][1] = mf_vec_tree16_avx2(lo[1][1], b1);
            out[1][2] = mf_vec_tree16_avx2(lo[1][2], b2), out[1][3] = mf_vec_tree16_avx2(lo[1][3], b3);
            out[2][0] = mf_vec_tree16_avx2(lo[2][0], c0), out[2][1] = mf_vec_tree16_avx2(lo[2][1], c1);
            out[2][2] = mf_vec_tree16_avx2(lo[2][2], c2), out[2][3] = mf_vec_tree16_avx2(lo[2][3], c3);
        }
    }
}

void mf_kern_vec_dots_keys(const float *const *q, int G, const float *const *k, int64_t nk, int n, float (*out)[4])
{
    int64_t j = 0;
    if (G == 4 && mf_vec_avx2(n))
        for (; j + 3 <= nk; j += 3) mf_vec_dots4x3_avx2(q, k + j, n, out + j);
    for (; j < nk; j++) mf_kern_vec_dots(q, G, k[j], n, out[j]);
}

void mf_kern_vec_index_scores(const float *q, const float *w, int n_heads, const float *const *k, int64_t nk, int n,
                              double *score)
{
    enum { NB = 48 };   /* keys per block: their sums in registers across the heads */
    for (int64_t j0 = 0; j0 < nk; j0 += NB) {
        int nb = nk - j0 < NB ? (int)(nk - j0) : NB;
        double acc[NB];
        float d4[NB][4];
        for (int u = 0; u < nb; u++) acc[u] = 0;
        for (int h0 = 0; h0 < n_heads; h0 += 4) {   /* per key: heads in order */
            int G = n_heads - h0 < 4 ? n_heads - h0 : 4;
            const float *qh[4];
            for (int g = 0; g < G; g++) qh[g] = q + (int64_t)(h0 + g) * n;
            mf_kern_vec_dots_keys(qh, G, k + j0, nb, n, d4);
            for (int u = 0; u < nb; u++)
                for (int g = 0; g < G; g++) {
                    float rl = d4[u][g] > 0 ? d4[u][g] : 0.0f;
                    float x = w[h0 + g] * rl;
                    acc[u] += (double)x;
                }
        }
        for (int u = 0; u < nb; u++) score[j0 + u] = (float)acc[u];
    }
}
/* The lanes of 4 queries against 3 keys over n (multiple of 16) floats carried in acc (see
 * mf_kern_vec_dots_lanes): the loop of mf_vec_dots4x3_avx2 from the lanes in acc instead of zero. */
__attribute__((target("avx2,fma"))) static void mf_vec_lanes4x3_avx2(const float *const *q, const float *const *k, int n,
                                                                  float *acc, int ld)
{
    float *l[3][4];
    for (int j = 0; j < 3; j++)
        for (int g = 0; g < 4; g++) l[j][g] = acc + ((size_t)g * ld + j) * 16;
    for (int h = 0; h < 16; h += 8) {
        __m256 a0 = _mm256_loadu_ps(l[0][0] + h), a1 = _mm256_loadu_ps(l[0][1] + h), a2 = _mm256_loadu_ps(l[0][2] + h);
        __m256 a3 = _mm256_loadu_ps(l[0][3] + h), b0 = _mm256_loadu_ps(l[1][0] + h), b1 = _mm256_loadu_ps(l[1][1] + h);
        __m256 b2 = _mm256_loadu_ps(l[1][2] + h), b3 = _mm256_loadu_ps(l[1][3] + h), c0 = _mm256_loadu_ps(l[2][0] + h);
        __m256 c1 = _mm256_loadu_ps(l[2][1] + h), c2 = _mm256_loadu_ps(l[2][2] + h), c3 = _mm256_loadu_ps(l[2][3] + h);
        MF_VEC_DOTS4X3_LOOP(q, k, h, n)
        _mm256_storeu_ps(l[0][0] + h, a0), _mm256_storeu_ps(l[0][1] + h, a1), _mm256_storeu_ps(l[0][2] + h, a2);
        _mm256_storeu_ps(l[0][3] + h, a3), _mm256_storeu_ps(l[1][0] + h, b0), _mm256_storeu_ps(l[1][1] + h, b1);
        _mm256_storeu_ps(l[1][2] + h, b2), _mm256_storeu_ps(l[1][3] + h, b3), _mm256_storeu_ps(l[2][0] + h, c0);
        _mm256_storeu_ps(l[2][1] + h, c1), _mm256_storeu_ps(l[2][2] + h, c2), _mm256_storeu_ps(l[2][3] + h, c3);
    }
}
#undef MF_VEC_DOTS_STEP
#undef MF_VEC_DOTS4X3_LOOP

/* The lanes of G (1..4) queries against one key over n (multiple of 16) floats: mf_vec_dots_avx2's
 * loop from the lanes in l[g] (16 floats each). */
__attribute__((target("avx2,fma"))) static void mf_vec_lanes_avx2(const float *const *q, int G, const float *k, int n,
                                                                float *const *l)
{
    __m256 lo[4], hi[4];
    for (int g = 0; g < G; g++) lo[g] = _mm256_loadu_ps(l[g]), hi[g] = _mm256_loadu_ps(l[g] + 8);
    for (int d = 0; d < n; d += 16) {
        __m256 k0 = _mm256_loadu_ps(k + d), k1 = _mm256_loadu_ps(k + d + 8);
        for (int g = 0; g < G; g++) {
            lo[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + d), k0, lo[g]);
            hi[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + d + 8), k1, hi[g]);
        }
    }
    for (int g = 0; g < G; g++) _mm256_storeu_ps(l[g], lo[g]), _mm256_storeu_ps(l[g] + 8, hi[g]);
}

void mf_kern_vec_dots_lanes(const float *const *q, int G, const float *const *k, int nk, int n, float *acc, int ld)
{
    int j = 0;
    if (mf_vec_avx2(n)) {
        if (G == 4)
            for (; j + 3 <= nk; j += 3) mf_vec_lanes4x3_avx2(q, k + j, n, acc + (size_t)j * 16, ld);
        for (; j < nk; j++) {
            float *l[4];
            for (int g = 0; g < G; g++) l[g] = acc + ((size_t)g * ld + j) * 16;
            mf_vec_lanes_avx2(q, G, k[j], n, l);
        }
        return;
    }
    for (; j < nk; j++)
        for (int g = 0; g < G; g++) {   /* mf_vec_dot_scalar's chains from the lanes in acc */
            float *l = acc + ((size_t)g * ld + j) * 16;
            for (int i = 0; i < n; i++) l[i % 16] = fmaf(q[g][i], k[j][i], l[i % 16]);
        }
}

float mf_kern_vec_lanes_sum(const float *l) { return mf_vec_tree16(l); }

/* acc[g][d] = sum_i e[g][i] * v_i[d], one fmaf chain per (g, d) in key order; e rows ld_e apart. */
__attribute__((target("avx2,fma"))) static void mf_vec_values_avx2(const float *const *kp, int64_t n, const float *e,
                                                                 int64_t ld_e, int G, int D, float *acc)
{
    for (int d = 0; d < D; d += 16) {
        __m256 lo[4], hi[4];
        for (int g = 0; g < 4; g++) lo[g] = hi[g] = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i++) {
            const float *v = kp[i] + d;
            __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
            for (int g = 0; g < G; g++) {
                __m256 w = _mm256_broadcast_ss(e + g * ld_e + i);
                lo[g] = _mm256_fmadd_ps(w, v0, lo[g]);
                hi[g] = _mm256_fmadd_ps(w, v1, hi[g]);
            }
        }
        for (int g = 0; g < G; g++) {
            _mm256_storeu_ps(acc + g * D + d, lo[g]);
            _mm256_storeu_ps(acc + g * D + d + 8, hi[g]);
        }
    }
}

void mf_kern_vec_values(const float *const *kp, int64_t n, const float *e, int64_t ld_e, int G, int D, float *acc)
{
    if (mf_vec_avx2(D)) {
        mf_vec_values_avx2(kp, n, e, ld_e, G, D, acc);
        return;
    }
    for (int i = 0; i < G * D; i++) acc[i] = 0;
    for (int64_t i = 0; i < n; i++) {
        const float *v = kp[i];
        for (int g = 0; g < G; g++)
            for (int d = 0; d < D; d++) acc[g * D + d] = fmaf(e[g * ld_e + i], v[d], acc[g * D + d]);
    }
}

void mf_kern_vec_attn(const float *const *q, int G, const float *const *kp, int64_t n, int D, float scale,
                      const float *sink, float *s, float *acc, double *den)
{
    float mx[4];
    for (int g = 0; g < G; g++) mx[g] = sink[g];
    for (int64_t i0 = 0; i0 < n; i0 += 48) {   /* keys in blocks (threes in mf_kern_vec_dots_keys) */
        float d4[48][4];
        int64_t nb = n - i0 < 48 ? n - i0 : 48;
        mf_kern_vec_dots_keys(q, G, kp + i0, nb, D, d4);
        for (int64_t j = 0; j < nb; j++)
            for (int g = 0; g < G; g++) {
                float v = d4[j][g] * scale;
                s[g * n + i0 + j] = v;
                mx[g] = v > mx[g] ? v : mx[g];
            }
    }
    for (int g = 0; g < G; g++) {
        den[g] = expf(sink[g] - mx[g]);
        for (int64_t i = 0; i < n; i++) {
            float e = expf(s[g * n + i] - mx[g]);
            s[g * n + i] = e;
            den[g] += e;
        }
    }
    mf_kern_vec_values(kp, n, s, n, G, D, acc);
}

void mf_kern_vec_attn_out(const float *const *q, int G, const float *const *kp, int64_t n, int D, float scale,
                          const float *sink, float *s, float *const *o)
{
    float acc[4 * MF_KERN_VEC_ATTN_MAX_D];
    double den[4];
    mf_kern_vec_attn(q, G, kp, n, D, scale, sink, s, acc, den);
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) o[g][d] = mf_bf16_round((float)((double)acc[g * D + d] / den[g]));
}

/* y[0..n) = x[0..n) * s (n a multiple of 8), 8 lanes at a time */
__attribute__((target("avx2,fma"))) static void mf_vec_scale_avx2(float *y, const float *x, float s, int64_t n)
{
    __m256 v = _mm256_set1_ps(s);
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), v));
}

void mf_kern_vec_scale(float *y, const float *x, float s, int64_t n)
{
    int64_t i = 0;
    if (n >= 8 && mf_kern_simd_active() == MF_KERN_SIMD_AVX2) {
        i = n & ~(int64_t)7;
        mf_vec_scale_avx2(y, x, s, i);
    }
    for (; i < n; i++) y[i] = x[i] * s;
}

/* x[0..n) (n a multiple of 8) rounded to bf16, 8 lanes at a time */
__attribute__((target("avx2,fma"))) static void mf_vec_bf16_round_avx2(float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(x + i, mf_simd_bf16_round8(_mm256_loadu_ps(x + i)));
}

void mf_kern_vec_bf16_round(float *x, int64_t n)
{
    int64_t i = 0;
    if (n >= 8 && mf_kern_simd_active() == MF_KERN_SIMD_AVX2) {
        i = n & ~(int64_t)7;
        mf_vec_bf16_round_avx2(x, i);
    }
    for (; i < n; i++) x[i] = mf_bf16_round(x[i]);
}

/* x[0..n) (n a multiple of 8) as bf16 codes into y, 8 lanes at a time: the rounding's top halves */
__attribute__((target("avx2,fma"))) static void mf_vec_bf16_pack_avx2(const float *x, uint16_t *y, int64_t n)
{
    for (int64_t i = 0; i < n; i += 8) {
        __m256i r = _mm256_srli_epi32(_mm256_castps_si256(mf_simd_bf16_round8(_mm256_loadu_ps(x + i))), 16);
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);   /* lanes 0-3, 4-7 */
        _mm_storeu_si128((__m128i *)(void *)(y + i), _mm256_castsi256_si128(p));
    }
}

__attribute__((target("avx2,fma"))) static void mf_vec_bf16_unpack_avx2(const uint16_t *y, float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i += 8) {
        _mm256_storeu_ps(x + i, mf_simd_bf16_load8(y + i));
    }
}

void mf_kern_vec_bf16_pack(const float *x, uint16_t *y, int64_t n)
{
    int64_t i = 0;
    if (n >= 8 && mf_kern_simd_active() == MF_KERN_SIMD_AVX2) {
        i = n & ~(int64_t)7;
        mf_vec_bf16_pack_avx2(x, y, i);
    }
    for (; i < n; i++) y[i] = mf_bf16_from_f32(x[i]);
}

void mf_kern_vec_bf16_unpack(const uint16_t *y, float *x, int64_t n)
{
    int64_t i = 0;
    if (n >= 8 && mf_kern_simd_active() == MF_KERN_SIMD_AVX2) {
        i = n & ~(int64_t)7;
        mf_vec_bf16_unpack_avx2(y, x, i);
    }
    for (; i < n; i++) x[i] = mf_bf16_to_f32(y[i]);
}
