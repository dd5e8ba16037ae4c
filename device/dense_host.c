/* The host side of the dense device ops (device/dense_host.h): host/kernels.h for the fp32 sums,
 * and the reference's double sums and exact gating in the reference's order. */
#include "device/dense_host.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

#include "device/kern_attn.h"
#include "host/formats.h"
#include "host/kernels.h"
#include "sched/error.h"

static float dh_e4m3[256];
static pthread_once_t dh_once = PTHREAD_ONCE_INIT;
static void dh_fill(void)
{
    for (int i = 0; i < 256; i++) dh_e4m3[i] = mf_e4m3_to_f32((uint8_t)i);
}

/* Row i of the slice against x (n_in floats), in double as mf_ly_linear_rows: FP8 per 32-column
 * block a double sum times the block's scale; BF16 one double sum. */
static double dh_dot_ref(const mf_kern_mat *w, int i, const float *x)
{
    int n = w->n_in;
    double acc = 0;
    if (w->fmt == MF_KERN_FP8) {
        const uint8_t *d = (const uint8_t *)w->w + (size_t)i * n, *srow = w->scale + (size_t)(i / 32) * (n / 32);
        for (int k = 0; k < n;) {
            int blk = k / 32, end = (blk + 1) * 32;
            double part = 0;
            for (; k < end; k++) part += (double)dh_e4m3[d[k]] * x[k];
            acc += part * mf_e8m0_to_f32(srow[blk]);
        }
    } else {
        const uint16_t *d = (const uint16_t *)w->w + (size_t)i * n;
        for (int k = 0; k < n; k++) acc += (double)mf_bf16_to_f32(d[k]) * x[k];
    }
    return acc;
}

/* Rows [i0, i1) of the slice against x offset by xoff columns. */
static int dh_rows(const mf_dev_lin *a, int64_t xoff, int i0, int i1)
{
    const mf_kern_mat *w = &a->w;
    if (a->sums == MF_DEV_SUMS_KERN) {
        if (w->fmt == MF_KERN_FP8)
            return mf_kern_fp8_matmul(w->w, w->scale, w->n_out, w->n_in, a->x + xoff, a->n_tok, (int)a->ld_x, a->y,
                                      (int)a->ld_y, i0, i1);
        return mf_kern_bf16_matmul(w->w, w->n_out, w->n_in, a->x + xoff, a->n_tok, (int)a->ld_x, a->y, (int)a->ld_y,
                                   i0, i1);
    }
    pthread_once(&dh_once, dh_fill);
    for (int t = 0; t < a->n_tok; t++)
        for (int i = i0; i < i1; i++)
            a->y[t * a->ld_y + i] = (float)dh_dot_ref(w, i, a->x + t * a->ld_x + xoff);
    return 0;
}

int mf_dense_host_linear(const mf_dev_lin *a)
{
    if (!a->group_rows) return dh_rows(a, 0, 0, a->w.n_out);
    for (int i = 0; i < a->w.n_out;) {   /* the rows of one group at a time */
        int64_t g = (a->row0 + i) / a->group_rows;
        int64_t end = (g + 1) * a->group_rows - a->row0;
        int i1 = end < a->w.n_out ? (int)end : a->w.n_out;
        int rc = dh_rows(a, g * a->w.n_in, i, i1);
        if (rc) return rc;
        i = i1;
    }
    return 0;
}

void mf_dense_host_round_bf16(float *y, int n_tok, int64_t ld, int n)
{
    for (int t = 0; t < n_tok; t++)
        for (int i = 0; i < n; i++) y[t * ld + i] = mf_bf16_round(y[t * ld + i]);
}

void mf_dense_host_bf16_cast(int pack, float *x, int64_t ld_x, uint16_t *y, int64_t ld_y, const int32_t *rows, int n_tok,
                             int n)
{
    for (int t = 0; t < n_tok; t++) {
        if (pack) mf_kern_vec_bf16_pack(x + t * ld_x, y + t * ld_y, n);
        else mf_kern_vec_bf16_unpack(y + (rows ? rows[t] : t) * ld_y, x + t * ld_x, n);
    }
}

int mf_dense_host_ffn_up(const mf_dev_up *a)
{
    return mf_kern_ffn_up(&a->w1, &a->w3, &(mf_kern_in){a->x, a->n_tok, (int)a->ld_x, NULL}, NULL, a->limit, a->h,
                          (int)a->ld_h, 0, a->w1.n_out);
}

void mf_dense_host_swiglu_bf16(const float *g, const float *u, int n_tok, int64_t ld, int n, float limit, float *h)
{
    for (int t = 0; t < n_tok; t++)
        for (int i = 0; i < n; i++) {
            int64_t k = t * ld + i;
            float gi = mf_bf16_round(g[k]), ui = mf_bf16_round(u[k]);
            if (limit > 0) {
                ui = fminf(fmaxf(ui, -limit), limit);
                gi = fminf(gi, limit);
            }
            float silu = (float)((double)gi / (1.0 + exp(-(double)gi)));
            h[k] = mf_bf16_round(1.0f * (silu * ui));
        }
}

int mf_dense_host_attn(const mf_dev_attn *a, float *scratch)
{
    int D = a->D;
    for (int t = 0; t < a->n_tok; t++) {
        int64_t n = a->n_keys[t];
        if (n < 0 || n > MF_DEV_ATTN_MAX_KEYS)
            return mf_error(-EINVAL, "attention heads: token %d has %lld keys (expected 0..%d)", t, (long long)n,
                            MF_DEV_ATTN_MAX_KEYS);
        const float *kp[MF_DEV_ATTN_MAX_KEYS];
        const int32_t *row = a->keys + (size_t)t * (size_t)a->ld_keys;
        for (int64_t i = 0; i < n; i++) {
            if (row[i] < 0 || row[i] >= a->n_kv)
                return mf_error(-EINVAL, "attention heads: token %d key %lld is row %d (expected 0..%lld)", t,
                                (long long)i, (int)row[i], (long long)a->n_kv - 1);
            kp[i] = a->kv + (size_t)row[i] * (size_t)D;
        }
        int qd = a->q_rope_dim;
        for (int h0 = 0; h0 < a->n_heads; h0 += 4) {
            int G = a->n_heads - h0 < 4 ? a->n_heads - h0 : 4;
            const float *qh[4];
            float *oh[4], qp[4][MF_DEV_ATTN_MAX_D];
            for (int g = 0; g < G; g++) {
                qh[g] = a->q + (size_t)t * (size_t)a->ld_q + (size_t)(h0 + g) * (size_t)D;
                oh[g] = a->o + (size_t)t * (size_t)a->ld_o + (size_t)(h0 + g) * (size_t)D;
                if (qd <= 0) continue;   /* qb's output: prepared as mf_fa_heads_q, here (q stays) */
                memcpy(qp[g], qh[g], sizeof(float) * (size_t)D);
                mf_kern_vec_bf16_round(qp[g], D);
                for (int i = 0; i < qd / 2; i++) mf_da_rope_fwd(a->rope + (size_t)t * (size_t)qd, qd / 2, i, qp[g] + D - qd);
                mf_kern_vec_bf16_round(qp[g], D);
                qh[g] = qp[g];
            }
            mf_kern_vec_attn_out(qh, G, kp, n, D, a->scale, a->sink + h0, scratch, oh);
        }
        int rd = a->rope_dim;   /* the inverse RoPE and its rounding, as mf_fa_heads_o */
        for (int h = 0; rd > 0 && h < a->n_heads; h++) {
            float *x = a->o + (size_t)t * (size_t)a->ld_o + (size_t)h * (size_t)D + (D - rd);
            for (int i = 0; i < rd / 2; i++) mf_da_rope_inv(a->rope + (size_t)t * (size_t)rd, rd / 2, i, x);
            mf_kern_vec_bf16_round(x, rd);
        }
    }
    return 0;
}

int mf_dense_host_iscore(const mf_dev_iscore *a)
{
    enum { NB = 48 };
    const float *kp[NB];
    for (int t = 0; t < a->n_tok; t++) {
        int64_t n = a->n_vis[t];
        if (n < 0 || n > a->n_keys)
            return mf_error(-EINVAL, "index scores: token %d sees %lld keys (expected 0..%lld)", t, (long long)n,
                            (long long)a->n_keys);
        const float *q = a->q + (size_t)t * (size_t)a->ld_q, *w = a->w + (size_t)t * (size_t)a->ld_w;
        double *sc = a->score + (size_t)t * (size_t)a->ld_s;
        for (int64_t j0 = 0; j0 < n; j0 += NB) {
            int nb = n - j0 < NB ? (int)(n - j0) : NB;
            for (int u = 0; u < nb; u++) kp[u] = a->keys + (size_t)(j0 + u) * (size_t)a->D;
            mf_kern_vec_index_scores(q, w, a->n_heads, kp, nb, a->D, sc + j0);
        }
    }
    return 0;
}
