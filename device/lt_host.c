/* The host side of the cuBLASLt path (device/lt_host.h): the dequantization plan (device/dev.h
 * mf_dev_w16_plan), the emulated card's dequantization, casts and products, and the answers a card
 * is held to. */
#include "device/lt_host.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "device/dense_host.h"
#include "device/kern_lt.h"
#include "host/formats.h"
#include "host/kern_gate.h"
#include "host/kernels.h"
#include "sched/error.h"

/* ---- the plan ---------------------------------------------------------------------------------- */

static size_t lt_n_scales(const mf_kern_mat *w)
{
    size_t blocks = (size_t)(w->n_in / 32);
    return w->fmt == MF_KERN_FP8 ? (size_t)((w->n_out + 31) / 32) * blocks : (size_t)w->n_out * blocks;
}

int mf_dev_w16_plan(const mf_kern_mat *const *w, int n, mf_dev_f16 type, int *shift)
{
    if (!w || n < 1 || !shift || (type != MF_DEV_F16_BF16 && type != MF_DEV_F16_FP16))
        return mf_error(-EINVAL, "mf_dev_w16_plan: %d matrices, type %d (expected >= 1 and BF16 or FP16)", n, (int)type);
    /* the shifts every matrix allows: k = e - 127 - shift in [k_min, k_max] for each of its scale codes */
    int lo = -100000, hi = 100000, e_min = 255, e_max = -1;
    for (int m = 0; m < n; m++) {
        const mf_kern_mat *a = w[m];
        if (!a || (a->fmt != MF_KERN_FP8 && a->fmt != MF_KERN_FP4) || !a->scale || a->n_out < 1 || a->n_in < 32 ||
            a->n_in % 32)
            return mf_error(-EINVAL, "mf_dev_w16_plan: matrix %d is not an FP8 or FP4 matrix with scales", m);
        int t = type == MF_DEV_F16_FP16 ? MF_LT_FP16 : MF_LT_BF16, kmin = mf_lt_k_min(t, a->fmt),
            kmax = mf_lt_k_max(t, a->fmt);
        int mn = 255, mx = -1;
        size_t ns = lt_n_scales(a);
        for (size_t i = 0; i < ns; i++) {
            int e = a->scale[i];
            if (e == 255) continue;   /* a NaN tile stays NaN in any type */
            if (e < mn) mn = e;
            if (e > mx) mx = e;
        }
        if (mx < 0) continue;
        if (mx > mf_lt_e_max(a->fmt))
            return mf_error(-ERANGE, "mf_dev_w16_plan: matrix %d has scale 2^%d, whose largest values the host decodes "
                            "as inf (no exact 16-bit form)", m, mx - 127);
        if (mn < e_min) e_min = mn;
        if (mx > e_max) e_max = mx;
        if (mx - 127 - kmax > lo) lo = mx - 127 - kmax;
        if (mn - 127 - kmin < hi) hi = mn - 127 - kmin;
    }
    if (e_max < 0) {
        *shift = 0;
        return 0;
    }
    if (lo > hi)
        return mf_error(-ERANGE, "mf_dev_w16_plan: scales 2^%d..2^%d span %d binades, more than %s holds every code "
                        "of these matrices over (keep them on their other path)", e_min - 127, e_max - 127,
                        e_max - e_min + 1, type == MF_DEV_F16_FP16 ? "FP16" : "BF16");
    *shift = lo > 0 ? lo : hi < 0 ? hi : 0;
    return 0;
}

/* ---- dequantization ---------------------------------------------------------------------------- */

int mf_lt_host_dequant(const mf_kern_mat *w, const mf_dev_w16 *out)
{
    int t = out->type == MF_DEV_F16_FP16 ? MF_LT_FP16 : MF_LT_BF16, nb = w->n_in / 32;
    uint16_t *o = out->w;
    for (int i = 0; i < w->n_out; i++)
        for (int k = 0; k < w->n_in; k++) {
            uint32_t code, e;
            if (w->fmt == MF_KERN_FP8) {
                code = ((const uint8_t *)w->w)[(size_t)i * w->n_in + k];
                e = w->scale[(size_t)(i / 32) * nb + k / 32];
            } else {
                code = mf_e2m1_get((const uint8_t *)w->w + (size_t)i * (w->n_in / 2), (size_t)k);
                e = w->scale[(size_t)i * nb + k / 32];
            }
            uint16_t v = mf_lt_dequant(t, w->fmt, code, e, out->shift);
            double want = (w->fmt == MF_KERN_FP8 ? (double)mf_e4m3_to_f32((uint8_t)code) : (double)mf_e2m1_to_f32((uint8_t)code)) *
                          ldexp(1.0, (int)e - 127 - out->shift);
            double got = mf_lt_widen16(t, v);
            if (e != 255 && !isnan(want) && got != want)
                return mf_error(-ERANGE, "dequantize: weight [%d, %d] (code 0x%x, scale 2^%d, shift %d) is not exact in "
                                "%s: %.9g stored for %.9g (mf_dev_w16_plan refuses such a matrix)", i, k, code,
                                (int)e - 127, out->shift, t == MF_LT_FP16 ? "FP16" : "BF16", got, want);
            o[(size_t)i * w->n_in + k] = v;
        }
    return 0;
}

/* ---- casts and products ------------------------------------------------------------------------ */

static int lt_type(mf_dev_f16 f) { return f == MF_DEV_F16_FP16 ? MF_LT_FP16 : MF_LT_BF16; }

/* x's card values' shift: fp16 the exponent of the largest finite |x| over the columns, else 0 */
static int lt_xshift(int t, const float *x, int n_tok, int64_t ld_x, int64_t cols, float *mx_out)
{
    float mx = 0.0f;
    if (t == MF_LT_FP16)
        for (int r = 0; r < n_tok; r++)
            for (int64_t k = 0; k < cols; k++) {
                float a = fabsf(x[r * ld_x + k]);
                if (a <= 3.4028234663852886e38f && a > mx) mx = a;
            }
    *mx_out = mx;
    return mf_lt_xshift(t, mx);
}

/* Casts x (n_tok rows of cols, ld_x) into the scratch x16 as a card does (header, then rows of cols
 * codes) with the GEMM's alpha 2^(w_shift + xs); -ERANGE when that power of two is no float. */
static int lt_cast(int t, const float *x, int n_tok, int64_t ld_x, int64_t cols, int w_shift, void *x16)
{
    float mx;
    int xs = lt_xshift(t, x, n_tok, ld_x, cols, &mx), sh = w_shift + xs;
    if (sh < -149 || sh > 127)
        return mf_error(-ERANGE, "cuBLASLt path: alpha 2^%d (weights 2^%d, activations 2^%d) is no float", sh, w_shift,
                        xs);
    uint32_t *hdr = x16;
    hdr[0] = mf_dk_bits(mx);
    hdr[1] = mf_dk_bits(mf_lt_pow2(sh));
    hdr[2] = 0;
    uint16_t *c = (uint16_t *)((char *)x16 + MF_LT_HDR_BYTES);
    for (int r = 0; r < n_tok; r++)
        for (int64_t k = 0; k < cols; k++) c[r * cols + k] = mf_lt_cast(t, x[r * ld_x + k], xs);
    return 0;
}

static int lt_grow(void **p, size_t *cap, size_t n, size_t elem)
{
    if (n <= *cap) return 0;
    void *q = realloc(*p, n * elem);
    if (!q) return mf_error(-ENOMEM, "cuBLASLt path (emulated): out of memory for %zu bytes of scratch", n * elem);
    *p = q;
    *cap = n;
    return 0;
}

/* y[t * ld_y + i] = alpha * sum_k w[i][k] x16[t][xoff + k] for rows [i0, i1) of w, t < n_tok (x16 rows
 * ld16 codes apart): mf_kern_bf16_matmul over the weights' bf16 codes (FP16 ones converted, exact) and
 * the activations widened, then one fp32 multiply by alpha (a power of two). */
static int lt_product(const mf_dev_w16 *w, int i0, int i1, const uint16_t *x16, int64_t ld16, int64_t xoff, int n_tok,
                      float alpha, float *y, int64_t ld_y, mf_lt_host_scratch *sc)
{
    int t = lt_type(w->type), n = w->n_in, rb = t == MF_LT_FP16 ? 256 : i1 - i0;
    int rc = lt_grow((void **)&sc->x, &sc->x_cap, (size_t)MF_KERN_TOK_PASS * n, sizeof(float));
    if (!rc && t == MF_LT_FP16) rc = lt_grow((void **)&sc->w, &sc->w_cap, (size_t)rb * n, sizeof(uint16_t));
    for (int r0 = i0; r0 < i1 && !rc; r0 += rb) {
        int r1 = i1 - r0 < rb ? i1 : r0 + rb;
        const uint16_t *rows = (const uint16_t *)w->w + (size_t)r0 * n;
        if (t == MF_LT_FP16) {   /* as bf16 codes: exact for dequantized weights (at most 4 significant bits) */
            for (size_t j = 0; j < (size_t)(r1 - r0) * n; j++) {
                float v = mf_lt_f16_to_f32(rows[j]);
                uint16_t b = mf_bf16_from_f32(v);
                if (mf_bf16_to_f32(b) != v && !isnan(v))
                    return mf_error(-ERANGE, "cuBLASLt path (emulated): FP16 weight %g of row %zu has more bits than "
                                    "bf16 holds (the emulation multiplies dequantized weights only)", (double)v,
                                    (size_t)r0 + j / n);
                sc->w[j] = b;
            }
            rows = sc->w;
        }
        for (int t0 = 0; t0 < n_tok && !rc; t0 += MF_KERN_TOK_PASS) {
            int nt = n_tok - t0 < MF_KERN_TOK_PASS ? n_tok - t0 : MF_KERN_TOK_PASS;
            for (int r = 0; r < nt; r++)
                for (int k = 0; k < n; k++) sc->x[(size_t)r * n + k] = mf_lt_widen16(t, x16[(t0 + r) * ld16 + xoff + k]);
            rc = mf_kern_bf16_matmul(rows, r1 - r0, n, sc->x, nt, n, y + t0 * ld_y + r0, (int)ld_y, 0, r1 - r0);
        }
    }
    if (!rc && alpha != 1.0f)
        for (int r = 0; r < n_tok; r++)
            for (int i = i0; i < i1; i++) y[r * ld_y + i] *= alpha;
    return rc;
}

int mf_lt_host_linear(const mf_dev_lin *a, mf_lt_host_scratch *sc)
{
    int t = lt_type(a->w16.type), n_in = a->w.n_in;
    int64_t cols = a->group_rows ? (a->row0 + a->w.n_out - 1) / a->group_rows * n_in + n_in : n_in;
    int rc = lt_cast(t, a->x, a->n_tok, a->ld_x, cols, a->w16.shift, a->lt.x16);
    if (rc) return rc;
    const uint16_t *x16 = (const uint16_t *)((const char *)a->lt.x16 + MF_LT_HDR_BYTES);
    float alpha = mf_dk_float(((const uint32_t *)a->lt.x16)[1]);
    for (int i = 0; i < a->w.n_out && !rc;) {   /* the rows of one group at a time */
        int64_t g = a->group_rows ? (a->row0 + i) / a->group_rows : 0;
        int64_t end = a->group_rows ? (g + 1) * a->group_rows - a->row0 : a->w.n_out;
        int i1 = end < a->w.n_out ? (int)end : a->w.n_out;
        rc = lt_product(&a->w16, i, i1, x16, cols, g * n_in, a->n_tok, alpha, a->y, a->ld_y, sc);
        i = i1;
    }
    return rc;
}

int mf_lt_host_ffn(const mf_dev_ffn_lt *a, mf_lt_host_scratch *sc)
{
    int t = lt_type(a->w13.type), H = a->w13.n_in, I = a->w13.n_out / 2, T = a->n_tok;
    const uint16_t *x16 = (const uint16_t *)((const char *)a->lt.x16 + MF_LT_HDR_BYTES);
    const uint32_t *hdr = a->lt.x16;
    int rc = lt_cast(t, a->x, T, H, H, a->w13.shift, a->lt.x16);
    if (!rc) rc = lt_product(&a->w13, 0, 2 * I, x16, H, 0, T, mf_dk_float(hdr[1]), a->gu, 2 * I, sc);
    if (rc) return rc;
    for (int r = 0; r < T; r++) {
        float wt = a->tok_weight ? a->tok_weight[r] : 1.0f, *g = a->gu + (size_t)r * 2 * I;
        for (int i = 0; i < I; i++) g[i] = mf_kern_gate(g[i], g[I + i], a->limit) * wt;
    }
    rc = lt_cast(t, a->gu, T, 2 * I, I, a->w2.shift, a->lt.x16);
    if (!rc) rc = lt_product(&a->w2, 0, H, x16, I, 0, T, mf_dk_float(hdr[1]), a->y, H, sc);
    return rc;
}

void mf_lt_host_scratch_free(mf_lt_host_scratch *sc)
{
    free(sc->x);
    free(sc->w);
    memset(sc, 0, sizeof *sc);
}

/* ---- the answers ------------------------------------------------------------------------------- */

int mf_lt_host_x_values(mf_dev_f16 type, const float *x, int n_tok, int64_t ld_x, int64_t cols, float *out,
                        int64_t ld_out)
{
    int t = lt_type(type);
    float mx;
    int xs = lt_xshift(t, x, n_tok, ld_x, cols, &mx);
    float back = mf_lt_pow2(xs);
    for (int r = 0; r < n_tok; r++)
        for (int64_t k = 0; k < cols; k++)
            out[r * ld_out + k] = mf_lt_widen16(t, mf_lt_cast(t, x[r * ld_x + k], xs)) * back;
    return xs;
}

int mf_lt_host_ffn_ref(mf_dev_f16 type, const mf_kern_mat *w1, const mf_kern_mat *w3, const mf_kern_mat *w2,
                       const float *x, int n_tok, const float *tok_weight, float limit, float *gu, float *xv, float *y)
{
    int H = w1->n_in, I = w1->n_out, T = n_tok;
    mf_lt_host_x_values(type, x, T, H, H, xv, H);
    int rc = mf_kern_fp4_matmul_f32(w1->w, w1->scale, I, H, xv, T, H, gu, 2 * I, 0, I);
    if (!rc) rc = mf_kern_fp4_matmul_f32(w3->w, w3->scale, I, H, xv, T, H, gu + I, 2 * I, 0, I);
    if (rc) return rc;
    for (int r = 0; r < T; r++) {
        float wt = tok_weight ? tok_weight[r] : 1.0f, *g = gu + (size_t)r * 2 * I;
        for (int i = 0; i < I; i++) g[i] = mf_kern_gate(g[i], g[I + i], limit) * wt;
    }
    mf_lt_host_x_values(type, gu, T, 2 * I, I, xv, I);
    return mf_kern_fp4_matmul_f32(w2->w, w2->scale, H, I, xv, T, I, y, H, 0, H);
}
