/* Hyper-connections (graphs/layers/layers.h; V4.1 "single-pass" mHC): the mixes of the four
 * residual streams (RMS-normalized, then projected: the HF port's order), their split into pre,
 * post and a Sinkhorn-normalized comb matrix, the collapse into a sublayer input and the expand
 * of its output back into the streams. */
#include <string.h>

#include "graphs/layers/layers.h"

void mf_ly_hc_mixes_rows(const mf_ly_ctx *cx, const float *x, const mf_weight *fn, float *mixes, int k0, int k1)
{
    const mf_config *c = cx->ly->c;
    int64_t n = (int64_t)c->hc_mult * c->hidden_size;
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float rs = (float)(1.0 / sqrt(ss / (double)n + c->rms_norm_eps));
    float *xn = cx->hc_xn;
    for (int64_t i = 0; i < n; i++) xn[i] = x[i] * rs;
    for (int k = k0; k < k1; k++) {
        const uint8_t *row = fn->data + (size_t)k * n * 4;
        double acc = 0;
        for (int64_t i = 0; i < n; i++) {
            float w;
            memcpy(&w, row + 4 * i, 4);
            acc += (double)w * xn[i];
        }
        mixes[k] = (float)acc;
    }
}

void mf_ly_hc_mixes(const mf_ly_ctx *cx, const float *x, const mf_weight *fn, float *mixes)
{
    const mf_config *c = cx->ly->c;
    mf_ly_hc_mixes_rows(cx, x, fn, mixes, 0, (2 + c->hc_mult) * c->hc_mult);
}

void mf_ly_hc_split(const mf_config *c, const float *m, const float *scale, const float *base,
                     float *pre, float *post, float *comb)
{
    int hc = c->hc_mult;
    float eps = (float)c->hc_eps;
    for (int i = 0; i < hc; i++) {
        pre[i] = mf_ly_sigmoid(m[i] * scale[0] + base[i]) + eps;
        post[i] = 2.0f * mf_ly_sigmoid(m[hc + i] * scale[1] + base[hc + i]);
    }
    /* comb[i][j]: row i = source stream; softmax along j, + eps */
    for (int i = 0; i < hc; i++) {
        float *row = comb + i * hc, mx = -INFINITY;
        for (int j = 0; j < hc; j++) {
            row[j] = m[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j];
            mx = fmaxf(mx, row[j]);
        }
        float sum = 0;
        for (int j = 0; j < hc; j++) {
            row[j] = expf(row[j] - mx);
            sum += row[j];
        }
        for (int j = 0; j < hc; j++) row[j] = row[j] / sum + eps;
    }
    /* column-normalize, then (iters - 1) x {row, column}; eps goes into each sum */
    for (int it = 0; it < c->hc_sinkhorn_iters; it++) {
        if (it > 0)
            for (int i = 0; i < hc; i++) {
                float s = 0;
                for (int j = 0; j < hc; j++) s += comb[i * hc + j];
                for (int j = 0; j < hc; j++) comb[i * hc + j] /= s + eps;
            }
        for (int j = 0; j < hc; j++) {
            float s = 0;
            for (int i = 0; i < hc; i++) s += comb[i * hc + j];
            for (int i = 0; i < hc; i++) comb[i * hc + j] /= s + eps;
        }
    }
}

void mf_ly_hc_split_w(const mf_config *c, const float *mixes, const mf_weight *scale,
                       const mf_weight *base, float *pre, float *post, float *comb)
{
    float sc[3], b[(2 + MF_LY_MAX_HC) * MF_LY_MAX_HC];
    for (int i = 0; i < 3; i++) sc[i] = mf_ly_vec(scale, i);
    for (int i = 0; i < (2 + c->hc_mult) * c->hc_mult; i++) b[i] = mf_ly_vec(base, i);
    mf_ly_hc_split(c, mixes, sc, b, pre, post, comb);
}

void mf_ly_hc_collapse_cols(const mf_ly_ctx *cx, const float *x, const float *pre, float *h, int64_t d0,
                            int64_t d1)
{
    const mf_config *c = cx->ly->c;
    int64_t H = c->hidden_size;
    for (int64_t d = d0; d < d1; d++) {
        double acc = 0;
        for (int s = 0; s < c->hc_mult; s++) acc += (double)pre[s] * x[s * H + d];
        h[d] = mf_bf((float)acc);
    }
}

void mf_ly_hc_collapse(const mf_ly_ctx *cx, const float *x, const float *pre, float *h)
{
    mf_ly_hc_collapse_cols(cx, x, pre, h, 0, cx->ly->c->hidden_size);
}

void mf_ly_hc_expand_cols(const mf_ly_ctx *cx, float *x, const float *out, const float *post, const float *comb,
                          int64_t d0, int64_t d1)
{
    const mf_config *c = cx->ly->c;
    int64_t H = c->hidden_size;
    int hc = c->hc_mult;
    float col[MF_LY_MAX_HC];
    for (int64_t d = d0; d < d1; d++) {
        for (int i = 0; i < hc; i++) col[i] = x[i * H + d];
        for (int j = 0; j < hc; j++) {
            double acc = (double)post[j] * out[d];
            for (int i = 0; i < hc; i++) acc += (double)comb[i * hc + j] * col[i];
            x[j * H + d] = mf_bf((float)acc);
        }
    }
}

void mf_ly_hc_expand(const mf_ly_ctx *cx, float *x, const float *out, const float *post,
                      const float *comb)
{
    mf_ly_hc_expand_cols(cx, x, out, post, comb, 0, cx->ly->c->hidden_size);
}
