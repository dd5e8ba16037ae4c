/* Numeric helpers of the layer math (graphs/layers/layers.h): matrix-vector products over every stored
 * weight kind on a context's backend (double sums, or the kernels for resident FP8/BF16), RMSNorm with the HF port's rounding, interleaved RoPE, the three fake
 * quantizations of V4.1 (e4m3 pow2-scaled, e2m1 with e8m0 or e4m3 scales), activations. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/layers/layers.h"
#include "host/kernels.h"
#include "sched/error.h"

static float mf_e4m3_lut[256];
static float mf_e2m1_lut[16];
static float mf_e2m1_pair_lut[256][2];   /* a byte of two packed e2m1 codes: low nibble first */
static pthread_once_t mf_luts_once = PTHREAD_ONCE_INIT;

/* bf16 -> f32 of the 2 bytes at p (host/formats.h mf_bf16_to_f32, inline) */
static inline float mf_bf16_bits(const uint8_t *p)
{
    uint16_t b;
    memcpy(&b, p, 2);
    return mf_bf16_to_f32(b);
}

static void mf_ly_luts_fill(void)
{
    for (int i = 0; i < 256; i++) mf_e4m3_lut[i] = mf_e4m3_to_f32((uint8_t)i);
    for (int i = 0; i < 16; i++) mf_e2m1_lut[i] = mf_e2m1_to_f32((uint8_t)i);
    for (int i = 0; i < 256; i++) {
        mf_e2m1_pair_lut[i][0] = mf_e2m1_lut[i & 15];
        mf_e2m1_pair_lut[i][1] = mf_e2m1_lut[i >> 4];
    }
}

/* filled once per process, so separate forwards may run on separate threads */
static void mf_ly_luts(void) { pthread_once(&mf_luts_once, mf_ly_luts_fill); }

void mf_bf_n(float *x, int64_t n) { mf_kern_vec_bf16_round(x, n); }   /* mf_bf's bits, 8 lanes under AVX2 */

float mf_ly_vec(const mf_weight *w, int64_t i)
{
    if (w->kind == MF_W_F32) {
        float v;
        memcpy(&v, w->data + 4 * i, 4);
        return v;
    }
    uint16_t b;
    memcpy(&b, w->data + 2 * i, 2);
    return mf_bf16_to_f32(b);
}

/* One output row: sum over cols [0, n) of W[row][col0 + k] * x[k], in double. */
static double mf_ly_dot_row(const mf_weight *w, const uint8_t *data, const uint8_t *scale,
                             int64_t row, int64_t col0, int64_t n, const float *x)
{
    double acc = 0;
    int64_t cols = w->cols;
    switch (w->kind) {
    case MF_W_FP8: {
        int64_t sc_cols = (cols + w->block_cols - 1) / w->block_cols;
        const uint8_t *srow = scale + (row / w->block_rows) * sc_cols;
        const uint8_t *d = data + row * cols;
        for (int64_t k = 0; k < n;) {
            int64_t c = col0 + k, blk = c / w->block_cols, end = (blk + 1) * w->block_cols - col0;
            if (end > n) end = n;
            double part = 0;
            for (; k < end; k++) part += (double)mf_e4m3_lut[d[col0 + k]] * x[k];
            acc += part * mf_e8m0_to_f32(srow[blk]);
        }
        break;
    }
    case MF_W_FP4: {
        const uint8_t *d = data + row * (cols / 2), *s = scale + row * (cols / 32);
        for (int64_t k = 0; k < n;) {
            int64_t c = col0 + k, blk = c / 32, end = (blk + 1) * 32 - col0;
            if (end > n) end = n;
            double part = 0;
            for (; k < end; k++) part += (double)mf_e2m1_lut[mf_e2m1_get(d, (size_t)(col0 + k))] * x[k];
            acc += part * mf_e8m0_to_f32(s[blk]);
        }
        break;
    }
    case MF_W_BF16: {
        const uint8_t *d = data + row * cols * 2;
        for (int64_t k = 0; k < n; k++) acc += (double)mf_bf16_bits(d + 2 * (col0 + k)) * x[k];
        break;
    }
    case MF_W_F32: {
        const uint8_t *d = data + row * cols * 4;
        for (int64_t k = 0; k < n; k++) {
            float v;
            memcpy(&v, d + 4 * (col0 + k), 4);
            acc += (double)v * x[k];
        }
        break;
    }
    default:
        break;
    }
    return acc;
}

/* Resident data of w, or a read of it into cx's lazy buffers. */
static int mf_ly_weight_bytes(mf_ly_ctx *cx, const mf_weight *w, const uint8_t **data,
                               const uint8_t **scale)
{
    if (w->data) {
        *data = w->data;
        *scale = w->scale;
        return 0;
    }
    int rc = mf_model_weight_read(cx->ly->m, w, 0, w->rows, cx->lazy_data, cx->lazy_scale);
    if (rc) return rc;
    *data = cx->lazy_data;
    *scale = cx->lazy_scale;
    return 0;
}

int mf_ly_linear_rows(mf_ly_ctx *cx, const mf_weight *w, int64_t row0, int64_t n, const float *x,
                       int64_t x_cols, int64_t col0, float *y)
{
    mf_ly_luts();
    const uint8_t *data, *scale;
    int rc = mf_ly_weight_bytes(cx, w, &data, &scale);
    if (rc) return rc;
    for (int64_t i = 0; i < n; i++)
        y[i] = (float)mf_ly_dot_row(w, data, scale, row0 + i, col0, x_cols, x);
    return 0;
}

int mf_ly_linear_kern(const mf_weight *w)
{
    return w->data && w->cols % 32 == 0 &&
           (w->kind == MF_W_BF16 || (w->kind == MF_W_FP8 && w->block_rows == 32 && w->block_cols == 32));
}

int mf_ly_linear_part(mf_ly_ctx *cx, const mf_weight *w, const float *x, int n_tok, int64_t ld_x, float *y, int64_t ld_y, int64_t r0, int64_t r1)
{
    if (w->kind == MF_W_NONE || w->kind == MF_W_TABLE)
        return mf_error(-EINVAL, "layers: %s is not a linear", w->name ? w->name : "(absent)");
    if (r0 < 0 || r1 > w->rows || r0 > r1 || n_tok < 1)
        return mf_error(-EINVAL, "layers: rows [%lld, %lld) of %s (%lld rows), %d inputs", (long long)r0,
                        (long long)r1, w->name ? w->name : "(unnamed)", (long long)w->rows, n_tok);
    if (cx->lin == MF_LY_LIN_KERN && mf_ly_linear_kern(w)) {
        mf_kern_mat m = {.fmt = w->kind == MF_W_BF16 ? MF_KERN_BF16 : MF_KERN_FP8, .w = w->data,
                         .scale = w->scale, .n_out = (int)w->rows, .n_in = (int)w->cols};
        return mf_kern_matmul(&m, &(mf_kern_in){x, n_tok, (int)ld_x, NULL}, y, (int)ld_y, (int)r0, (int)r1);
    }
    for (int t = 0; t < n_tok; t++) {
        int rc = mf_ly_linear_rows(cx, w, r0, r1 - r0, x + t * ld_x, w->cols, 0, y + t * ld_y + r0);
        if (rc) return rc;
    }
    return 0;
}

int mf_ly_linear(mf_ly_ctx *cx, const mf_weight *w, const float *x, float *y, int aq)
{
    if (w->kind == MF_W_NONE || w->kind == MF_W_TABLE)
        return mf_error(-EINVAL, "layers: %s is not a linear", w->name ? w->name : "(absent)");
    if (!aq) return mf_ly_linear_part(cx, w, x, 1, w->cols, y, w->rows, 0, w->rows);
    if (aq && (w->kind == MF_W_FP8 || w->kind == MF_W_FP4)) {
        memcpy(cx->aq, x, (size_t)w->cols * sizeof *x);
        mf_ly_fq_e4m3_pow2(cx->aq, w->cols, 32);
        x = cx->aq;
    }
    return mf_ly_linear_rows(cx, w, 0, w->rows, x, w->cols, 0, y);
}

float mf_ly_rms_scale(const float *x, int64_t n, double eps)
{
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    return (float)(1.0 / sqrt(ss / (double)n + eps));
}

void mf_ly_rmsnorm_apply(const float *x, const mf_weight *w, float rs, float *out, int64_t c0, int64_t c1)
{
    for (int64_t i = c0; i < c1; i++) out[i] = mf_bf(mf_ly_vec(w, i) * mf_bf(x[i] * rs));
}

void mf_ly_rmsnorm_cols(const float *x, int64_t n, const mf_weight *w, double eps, float *out, int64_t c0,
                        int64_t c1)
{
    mf_ly_rmsnorm_apply(x, w, mf_ly_rms_scale(x, n, eps), out, c0, c1);
}

void mf_ly_rmsnorm(const float *x, int64_t n, const mf_weight *w, double eps, float *out)
{
    mf_ly_rmsnorm_cols(x, n, w, eps, out, 0, n);
}

void mf_ly_rope(float *x, int n_pairs, const float *freqs, int64_t pos, int inverse)
{
    for (int i = 0; i < n_pairs; i++) {
        float ang = (float)pos * freqs[i];
        float c = (float)cos((double)ang), s = (float)sin((double)ang);
        if (inverse) s = -s;
        float a = x[2 * i], b = x[2 * i + 1];
        x[2 * i] = a * c - b * s;
        x[2 * i + 1] = a * s + b * c;
    }
}

/* 2^ceil(log2(v)) for a positive normal float v, by its bits (exponent + (mantissa != 0)). */
static float mf_pow2_ceil(float v)
{
    uint32_t b;
    memcpy(&b, &v, 4);
    int e = (int)((b >> 23) & 0xFF) - 127 + ((b & 0x7FFFFF) != 0);
    return ldexpf(1.0f, e);
}

static float mf_block_amax(const float *x, int64_t n)
{
    float a = 0;
    for (int64_t i = 0; i < n; i++) a = fmaxf(a, fabsf(x[i]));
    return a;
}

/* A UE8M0 scale byte b is the float with exponent field b and no mantissa: 2^(b-127), 255 inf. */
static float mf_ue8m0_f32(uint8_t e)
{
    uint32_t b = (uint32_t)e << 23;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* The scales of one block of m values, as the byte the packed caches store: the e2m1 pow2
 * scale's UE8M0 byte (the scale is a power of two >= 2^-126, or inf) and the e2m1 e4m3 scale's
 * E4M3 code. */
static uint8_t mf_blk_e2m1_ue8m0(const float *x, int64_t m)
{
    float s = mf_pow2_ceil(fmaxf(mf_block_amax(x, m), 6.0f * 0x1p-126f) / 6.0f);
    uint32_t b;
    memcpy(&b, &s, 4);
    return (uint8_t)(b >> 23);
}

static uint8_t mf_blk_e2m1_e4m3(const float *x, int64_t m)
{
    /* amax/6 past e4m3's 448 would be NaN; clamped (reachable only with |x| > 2688) */
    return mf_e4m3_from_f32(fminf(fmaxf(mf_block_amax(x, m), 6.0f * 0x1p-9f) / 6.0f, 448.0f));
}

/* The e4m3 pow2 rounding's scale of a block of m values (mf_ly_fq_e4m3_pow2's formula) */
static float mf_blk_e4m3_pow2(const float *x, int64_t m)
{
    return mf_pow2_ceil(fmaxf(mf_block_amax(x, m), 1e-4f) * (1.0f / 448.0f));
}

static inline uint8_t mf_e2m1_code(float x, float s) { return mf_e2m1_from_f32(fminf(fmaxf(x / s, -6.0f), 6.0f)); }

void mf_ly_fq_e4m3_pow2(float *x, int64_t n, int block)
{
    mf_ly_luts();
    for (int64_t b0 = 0; b0 < n; b0 += block) {
        int64_t m = n - b0 < block ? n - b0 : block;
        float s = mf_blk_e4m3_pow2(x + b0, m);
        for (int64_t i = 0; i < m; i++) {
            float q = fminf(fmaxf(x[b0 + i] / s, -448.0f), 448.0f);
            x[b0 + i] = mf_e4m3_lut[mf_e4m3_from_f32(q)] * s;
        }
    }
}

void mf_ly_fq_e2m1_pow2(float *x, int64_t n, int block)
{
    mf_ly_luts();
    for (int64_t b0 = 0; b0 < n; b0 += block) {
        int64_t m = n - b0 < block ? n - b0 : block;
        float s = mf_ue8m0_f32(mf_blk_e2m1_ue8m0(x + b0, m));
        for (int64_t i = 0; i < m; i++) x[b0 + i] = mf_e2m1_lut[mf_e2m1_code(x[b0 + i], s)] * s;
    }
}

void mf_ly_fq_e2m1_e4m3(float *x, int64_t n, int block)
{
    mf_ly_luts();
    for (int64_t b0 = 0; b0 < n; b0 += block) {
        int64_t m = n - b0 < block ? n - b0 : block;
        float s = mf_e4m3_lut[mf_blk_e2m1_e4m3(x + b0, m)];
        for (int64_t i = 0; i < m; i++) x[b0 + i] = mf_e2m1_lut[mf_e2m1_code(x[b0 + i], s)] * s;
    }
}

/* The packed forms: the same codes and scales the fake quantizations above round to. */
static void mf_ly_pack_e2m1(const float *x, int64_t n, int block, int e4m3_scales, uint8_t *codes, uint8_t *scales)
{
    mf_ly_luts();
    memset(codes, 0, (size_t)(n + 1) / 2);
    for (int64_t b0 = 0, k = 0; b0 < n; b0 += block, k++) {
        int64_t m = n - b0 < block ? n - b0 : block;
        scales[k] = e4m3_scales ? mf_blk_e2m1_e4m3(x + b0, m) : mf_blk_e2m1_ue8m0(x + b0, m);
        float s = e4m3_scales ? mf_e4m3_lut[scales[k]] : mf_ue8m0_f32(scales[k]);
        for (int64_t i = b0; i < b0 + m; i++) codes[i >> 1] |= (uint8_t)(mf_e2m1_code(x[i], s) << ((i & 1) * 4));
    }
}

static void mf_ly_unpack_e2m1(const uint8_t *codes, const uint8_t *scales, int64_t n, int block, int e4m3_scales,
                              float *out)
{
    mf_ly_luts();
    for (int64_t b0 = 0, k = 0; b0 < n; b0 += block, k++) {
        int64_t end = n - b0 < block ? n : b0 + block;
        float s = e4m3_scales ? mf_e4m3_lut[scales[k]] : mf_ue8m0_f32(scales[k]);
        int64_t i = b0;
        if (!(b0 & 1))   /* whole bytes: two values each */
            for (; i + 1 < end; i += 2) {
                const float *v = mf_e2m1_pair_lut[codes[i >> 1]];
                out[i] = v[0] * s;
                out[i + 1] = v[1] * s;
            }
        for (; i < end; i++) out[i] = mf_e2m1_lut[mf_e2m1_get(codes, (size_t)i)] * s;
    }
}

void mf_ly_pack_e2m1_pow2(const float *x, int64_t n, int block, uint8_t *codes, uint8_t *scales)
{
    mf_ly_pack_e2m1(x, n, block, 0, codes, scales);
}

void mf_ly_pack_e2m1_e4m3(const float *x, int64_t n, int block, uint8_t *codes, uint8_t *scales)
{
    mf_ly_pack_e2m1(x, n, block, 1, codes, scales);
}

void mf_ly_unpack_e2m1_pow2(const uint8_t *codes, const uint8_t *scales, int64_t n, int block, float *out)
{
    mf_ly_unpack_e2m1(codes, scales, n, block, 0, out);
}

void mf_ly_unpack_e2m1_e4m3(const uint8_t *codes, const uint8_t *scales, int64_t n, int block, float *out)
{
    mf_ly_unpack_e2m1(codes, scales, n, block, 1, out);
}

void mf_ly_pack_e4m3_pow2(const float *x, int64_t n, int block, uint8_t *codes, uint8_t *scales)
{
    for (int64_t b0 = 0, k = 0; b0 < n; b0 += block, k++) {
        int64_t m = n - b0 < block ? n - b0 : block;
        int finite = 1;
        for (int64_t i = b0; i < b0 + m; i++) finite &= isfinite(x[i]) != 0;
        if (!finite) {   /* the rounding's scale was inf: code 0 * inf is NaN, +-1 * inf is +-inf */
            scales[k] = 255;
            for (int64_t i = b0; i < b0 + m; i++) codes[i] = isnan(x[i]) ? 0x00 : x[i] > 0 ? 0x38 : 0xB8;
            continue;
        }
        /* the scale found again is at most the rounding's (its values are within 448 of it), and a
         * value c * s over a smaller power of two s' is c * (s / s') <= 448: an E4M3 value again */
        float s = mf_blk_e4m3_pow2(x + b0, m);
        uint32_t sb;
        memcpy(&sb, &s, 4);
        scales[k] = (uint8_t)(sb >> 23);
        for (int64_t i = b0; i < b0 + m; i++) codes[i] = mf_e4m3_from_f32(fminf(fmaxf(x[i] / s, -448.0f), 448.0f));
    }
}

void mf_ly_unpack_e4m3_pow2(const uint8_t *codes, const uint8_t *scales, int64_t n, int block, float *out)
{
    mf_ly_luts();
    for (int64_t b0 = 0, k = 0; b0 < n; b0 += block, k++) {
        int64_t end = n - b0 < block ? n : b0 + block;
        float s = mf_ue8m0_f32(scales[k]);
        for (int64_t i = b0; i < end; i++) out[i] = mf_e4m3_lut[codes[i]] * s;
    }
}

float mf_ly_silu(float x) { return (float)((double)x / (1.0 + exp(-(double)x))); }
float mf_ly_sigmoid(float x) { return (float)(1.0 / (1.0 + exp(-(double)x))); }
float mf_ly_softplus(float x) { return x > 20.0f ? x : (float)log1p(exp((double)x)); }

static int mf_pick_cmp(const void *a, const void *b)
{
    const mf_ly_pick *x = a, *y = b;
    if (x->score > y->score) return -1;
    if (x->score < y->score) return 1;
    return (x->idx > y->idx) - (x->idx < y->idx);
}

void mf_ly_sort_picks(mf_ly_pick *p, int64_t n) { qsort(p, (size_t)n, sizeof *p, mf_pick_cmp); }
