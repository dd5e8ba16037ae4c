/* The startup self-check of a card (device/dev_check.h): each device kernel once on random data
 * against host/kernels.h, small shapes (64 x 256 matrices, an FFN of 256 -> 128 -> 256), then the
 * dense sublayers' ops against device/dense_host.h. */
#include "device/dev_check.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "device/dense_host.h"
#include "device/lt_host.h"
#include "host/kernels.h"
#include "sched/error.h"

#define DC_OUT 64
#define DC_IN 256
#define DC_HID 128
#define DC_TOK 3

typedef struct dc_rng {
    uint64_t s;
} dc_rng;

static uint32_t dc_next(dc_rng *r)
{
    r->s = r->s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(r->s >> 33);
}

/* Random stored weights: codes random (FP8 without NaN codes), E8M0 scales 2^-3..2^3. */
static void dc_mat(dc_rng *r, mf_kern_fmt fmt, int n_out, int n_in, uint8_t *w, uint8_t *sc, mf_kern_mat *m)
{
    size_t wb = fmt == MF_KERN_FP4 ? (size_t)n_out * n_in / 2 : (size_t)n_out * n_in;
    size_t sb = fmt == MF_KERN_FP4 ? (size_t)n_out * (n_in / 32) : (size_t)((n_out + 31) / 32) * (n_in / 32);
    for (size_t i = 0; i < wb; i++) {
        w[i] = (uint8_t)dc_next(r);
        if (fmt == MF_KERN_FP8 && (w[i] & 0x7f) == 0x7f) w[i] ^= 1;
    }
    for (size_t i = 0; i < sb; i++) sc[i] = (uint8_t)(124 + dc_next(r) % 7);
    *m = (mf_kern_mat){.fmt = fmt, .w = w, .scale = sc, .n_out = n_out, .n_in = n_in};
}

static double dc_rel(const float *a, const float *b, size_t n)
{
    double md = 0, mb = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= md)) md = d;   /* NaN propagates */
        if (fabs(b[i]) > mb) mb = fabs(b[i]);
    }
    return mb > 0 ? md / mb : md;
}

/* Host memory of one check: weights (w1/w3/w2 or one matrix), x, token weights, outputs. */
enum { DC_W = 3 * DC_HID * DC_IN, DC_S = 3 * DC_HID * (DC_IN / 32) };   /* the FFN's three */
typedef struct dc_host {
    uint8_t w[DC_W], sc[DC_S];
    float x[DC_TOK * DC_IN], x2[DC_TOK * DC_HID], tw[DC_TOK], h[DC_TOK * DC_HID], ref[DC_TOK * DC_IN], got[DC_TOK * DC_IN];
    float xv[DC_TOK * DC_IN], gu[DC_TOK * 2 * DC_HID];   /* the cuBLASLt path's: x's card values, g and u */
    uint8_t q8[1 << 16];
} dc_host;

/* The dense ops (device/dev.h mf_dev_linear and the roundings) of the dense sublayers, each at
 * 1 and 3 tokens against device/dense_host.h on the same data: an FP8 row slice [32, 96) of a
 * 128 x 256 matrix with strided outputs, a BF16 64 x 256 with reference sums (the router gate),
 * an FP8 128 x 64 grouped (4 groups of 32 rows) slice from row 32 with reference sums (wo_a),
 * the tiled kernel (mf_dev_lin.path MF_DEV_LIN_TILED, which the dense chains take from
 * MF_DEV_LIN_TILED_MIN_TOK tokens) on the FP8 slice and on the BF16 matrix with reference sums,
 * the FP8 FFN phase 1 with each kernel (64 x 256, limit 7), the bf16 rounding, a bf16 pack and unpack (strided,
 * through dh: the rounding's bits) and the exact gating. Device
 * buffers: dw (weights), dsc (scales), dx, dh, dy (x, a second input, outputs). */
enum { DD_LIN, DD_GATE, DD_WOA, DD_LIN_T, DD_GATE_T, DD_UP, DD_UP_T, DD_ROUND, DD_CAST, DD_SWIGLU, DD_N };
static const char *const dd_name[DD_N] = {"fp8 linear (row slice, strides)", "bf16 linear (reference sums)",
                                          "fp8 grouped linear (reference sums)",
                                          "fp8 linear (row slice, strides; tiled kernel)",
                                          "bf16 linear (reference sums; tiled kernel)", "dense ffn up (fp8)",
                                          "dense ffn up (fp8; tiled kernel)",
                                          "bf16 rounding", "bf16 pack and unpack", "swiglu (bf16 roundings)"};

static int dc_dense(mf_dev *d, int card, mf_dev_stream *st, dc_rng *r, dc_host *hb, uint8_t *dw, uint8_t *dsc,
                    float *dx, float *dh, float *dy)
{
    const char *kind = mf_dev_kind(d);
    float *hx2 = hb->x2;
    int rc = 0;
    for (int k = 0; k < DD_N && !rc; k++)
        for (int T = 1; T <= DC_TOK && !rc; T += DC_TOK - 1) {
            mf_kern_mat m[2];
            int kb = k == DD_LIN_T ? DD_LIN : k == DD_GATE_T ? DD_GATE : k == DD_UP_T ? DD_UP : k;   /* the tiled ones' data */
            int ld_y = kb == DD_LIN ? 100 : k == DD_SWIGLU ? DC_HID : 64, n_y = 64;
            size_t wo = 0, so = 0;
            if (kb == DD_GATE) {
                uint16_t *wb = (uint16_t *)hb->w;
                for (int i = 0; i < 64 * DC_IN; i++) wb[i] = (uint16_t)(0x3E00 + dc_next(r) % 0x200 + (dc_next(r) & 0x8000));
                m[0] = (mf_kern_mat){.fmt = MF_KERN_BF16, .w = hb->w, .n_out = 64, .n_in = DC_IN};
                wo = sizeof(uint16_t) * 64 * DC_IN;
            } else if (kb == DD_LIN || kb == DD_WOA) {   /* the whole matrix; the card gets the slice */
                int no = 128, ni = kb == DD_LIN ? DC_IN : 64;
                dc_mat(r, MF_KERN_FP8, no, ni, hb->w, hb->sc, &m[0]);
                m[0].w = hb->w + 32 * ni;   /* rows [32, ...): from the second tile row */
                m[0].scale = hb->sc + ni / 32;
                m[0].n_out = kb == DD_LIN ? 64 : 96;
                wo = (size_t)m[0].n_out * ni;
                so = (size_t)(m[0].n_out / 32) * (ni / 32);
                n_y = m[0].n_out;
                ld_y = kb == DD_LIN ? 100 : 96;
            } else if (kb == DD_UP) {
                dc_mat(r, MF_KERN_FP8, 64, DC_IN, hb->w, hb->sc, &m[0]);
                dc_mat(r, MF_KERN_FP8, 64, DC_IN, hb->w + 64 * DC_IN, hb->sc + 2 * 8, &m[1]);
                wo = 2 * 64 * DC_IN;
                so = 2 * 2 * 8;
            }
            int n_x = k == DD_SWIGLU ? DC_HID : DC_IN;
            for (int i = 0; i < T * n_x; i++) hb->x[i] = ((float)dc_next(r) / 2147483648.0f - 1.0f) * (k >= DD_ROUND ? 8.0f : 2.0f);
            for (int i = 0; i < T * DC_HID; i++) hx2[i] = ((float)dc_next(r) / 2147483648.0f - 1.0f) * 8.0f;
            int rnd = k == DD_ROUND || k == DD_CAST;   /* y: x, rounded in place or through codes */
            if (rnd) n_y = 64, ld_y = DC_IN;
            if (k == DD_SWIGLU) n_y = DC_HID;
            size_t ny_all = (size_t)T * ld_y;
            memset(hb->ref, 0, sizeof hb->ref);
            /* the host's answer, on host pointers */
            mf_dev_lin hl = {.w = m[0], .row0 = 32, .group_rows = k == DD_WOA ? 32 : 0,
                             .sums = kb == DD_LIN ? MF_DEV_SUMS_KERN : MF_DEV_SUMS_REF,
                             .path = k == DD_LIN_T || k == DD_GATE_T ? MF_DEV_LIN_TILED : MF_DEV_LIN_AUTO, .x = hb->x, .ld_x = DC_IN,
                             .n_tok = T, .y = hb->ref, .ld_y = ld_y};
            mf_dev_up hu = {.w1 = m[0], .w3 = m[1], .x = hb->x, .ld_x = DC_IN, .n_tok = T, .limit = 7.0f, .h = hb->ref,
                            .ld_h = ld_y, .path = k == DD_UP_T ? MF_DEV_LIN_TILED : MF_DEV_LIN_AUTO};
            if (k <= DD_GATE_T) rc = mf_dense_host_linear(&hl);
            else if (kb == DD_UP) rc = mf_dense_host_ffn_up(&hu);
            else if (rnd) {
                memcpy(hb->ref, hb->x, sizeof(float) * ny_all);
                mf_dense_host_round_bf16(hb->ref, T, ld_y, n_y);
            } else {
                mf_dense_host_swiglu_bf16(hb->x, hx2, T, DC_HID, DC_HID, 7.0f, hb->ref);
            }
            if (rc) return mf_error_wrap(rc, "card %d (%s): self-check: the host's %s", card, kind, dd_name[k]);
            /* the card's */
            memset(hb->got, 0, sizeof hb->got);
            mf_dev_lin dl = hl;
            mf_dev_up du = hu;
            dl.w.w = du.w1.w = dw;
            dl.w.scale = du.w1.scale = dsc;
            du.w3.w = dw + wo / 2;
            du.w3.scale = dsc + so / 2;
            dl.x = du.x = dx;
            dl.y = du.h = dy;
            rc = wo ? mf_dev_copy_h2d(st, dw, m[0].w, wo) : 0;
            if (!rc && so) rc = mf_dev_copy_h2d(st, dsc, m[0].scale, so);
            if (!rc) rc = mf_dev_copy_h2d(st, dx, hb->x, sizeof(float) * (size_t)T * n_x);
            if (!rc) rc = mf_dev_copy_h2d(st, dh, hx2, sizeof(float) * (size_t)T * DC_HID);
            if (!rc) rc = mf_dev_copy_h2d(st, dy, rnd ? hb->x : hb->got, sizeof(float) * ny_all);
            if (!rc && k <= DD_GATE_T) rc = mf_dev_linear(st, &dl);
            if (!rc && kb == DD_UP) rc = mf_dev_ffn_up(st, &du);
            if (!rc && k == DD_ROUND) rc = mf_dev_round_bf16(st, dy, T, ld_y, n_y);
            if (!rc && k == DD_CAST) rc = mf_dev_bf16_pack(st, dx, DC_IN, (uint16_t *)dh, 70, T, n_y);
            if (!rc && k == DD_CAST) rc = mf_dev_bf16_unpack(st, (const uint16_t *)dh, 70, dy, ld_y, T, n_y);
            if (!rc && k == DD_SWIGLU) rc = mf_dev_swiglu_bf16(st, dx, dh, T, DC_HID, DC_HID, 7.0f, dy);
            if (!rc) rc = mf_dev_copy_d2h(st, hb->got, dy, sizeof(float) * ny_all);
            int rs = mf_dev_stream_sync(st);
            if (!rc) rc = rs;
            if (rc)
                return mf_error_wrap(rc, "card %d (%s): self-check of kernel %s at %d tokens failed", card, kind,
                                     dd_name[k], T);
            double e = dc_rel(hb->got, hb->ref, ny_all);
            double tol = rnd ? 0 : k == DD_SWIGLU ? MF_DEV_CHECK_TOL_BF16 : kb == DD_UP ? MF_DEV_CHECK_TOL_FFN
                                                                                          : MF_DEV_CHECK_TOL_MM;
            if (!(e <= tol))
                rc = mf_error(-EIO, "card %d (%s): kernel %s: relative error %.2e at %d tokens against the host "
                              "kernel (bound %.0e): the card computes wrong answers", card, kind, dd_name[k], e, T, tol);
        }
    return rc;
}

/* The indexer's scores (mf_dev_index_scores) at 1 and 3 tokens against device/dense_host.h on the
 * same data: 4 heads of 32, 40 keys, the tokens seeing 40, 17 and 1 of them, the weights and
 * queries about unit size (ReLU zeroes about half the dots). Device buffers: dk (keys), dv (the
 * counts), dq, dw (queries, weights), ds (scores). */
enum { DI_H = 4, DI_D = 32, DI_K = 40 };
static int dc_iscore(mf_dev *d, int card, mf_dev_stream *st, dc_rng *r, float *dk, int32_t *dv, float *dq, float *dw,
                     double *ds)
{
    const char *kind = mf_dev_kind(d);
    static const int32_t nvis[DC_TOK] = {DI_K, 17, 1};
    float q[DC_TOK * DI_H * DI_D], w[DC_TOK * DI_H], k[DI_K * DI_D];
    double ref[DC_TOK * DI_K], got[DC_TOK * DI_K];
    int rc = 0;
    for (int T = 1; T <= DC_TOK && !rc; T += DC_TOK - 1) {
        for (int i = 0; i < T * DI_H * DI_D; i++) q[i] = (float)dc_next(r) / 2147483648.0f - 1.0f;
        for (int i = 0; i < T * DI_H; i++) w[i] = (float)dc_next(r) / 2147483648.0f - 1.0f;
        for (int i = 0; i < DI_K * DI_D; i++) k[i] = (float)dc_next(r) / 2147483648.0f - 1.0f;
        memset(ref, 0, sizeof ref);
        memset(got, 0, sizeof got);
        mf_dev_iscore a = {.q = q, .ld_q = DI_H * DI_D, .w = w, .ld_w = DI_H, .n_tok = T, .n_heads = DI_H, .D = DI_D,
                           .keys = k, .n_keys = DI_K, .n_vis = nvis, .score = ref, .ld_s = DI_K};
        rc = mf_dense_host_iscore(&a);
        if (rc) return mf_error_wrap(rc, "card %d (%s): self-check: the host's index scores", card, kind);
        a.q = dq, a.w = dw, a.keys = dk, a.n_vis = dv, a.score = ds;
        rc = mf_dev_copy_h2d(st, dq, q, sizeof(float) * (size_t)T * DI_H * DI_D);
        if (!rc) rc = mf_dev_copy_h2d(st, dw, w, sizeof(float) * (size_t)T * DI_H);
        if (!rc) rc = mf_dev_copy_h2d(st, dk, k, sizeof k);
        if (!rc) rc = mf_dev_copy_h2d(st, dv, nvis, sizeof nvis);
        if (!rc) rc = mf_dev_copy_h2d(st, ds, got, sizeof(double) * (size_t)T * DI_K);
        if (!rc) rc = mf_dev_index_scores(st, &a);
        if (!rc) rc = mf_dev_copy_d2h(st, got, ds, sizeof(double) * (size_t)T * DI_K);
        int rs = mf_dev_stream_sync(st);
        if (!rc) rc = rs;
        if (rc) return mf_error_wrap(rc, "card %d (%s): self-check of kernel index scores at %d tokens failed", card, kind, T);
        double md = 0, mb = 0;
        for (int i = 0; i < T * DI_K; i++) {
            double e = fabs(got[i] - ref[i]);
            if (!(e <= md)) md = e;
            if (fabs(ref[i]) > mb) mb = fabs(ref[i]);
        }
        double e = mb > 0 ? md / mb : md;
        if (!(e <= MF_DEV_CHECK_TOL_MM))
            rc = mf_error(-EIO, "card %d (%s): kernel index scores: relative error %.2e at %d tokens against the host "
                          "kernel (bound %.0e): the card computes wrong answers", card, kind, e, T, MF_DEV_CHECK_TOL_MM);
    }
    return rc;
}

/* The cuBLASLt path (where the card has tensor cores), at 1 and 3 tokens in the card's 16-bit type:
 * an FP8 row slice [32, 96) of a 128 x 256 matrix dequantized and multiplied (MF_DEV_LIN_CUBLASLT)
 * against the host's FP8 kernel on x's card values, and an FP4 expert FFN 256 -> 128 -> 256 with
 * token weights (w1 and w3 into one scratch) against mf_lt_host_ffn_ref. Its own device buffers
 * (about 200 KB): the 16-bit weights, the cast scratch, gu. */
static int dc_lt(mf_dev *d, int card, mf_dev_stream *st, dc_rng *r, dc_host *hb, uint8_t *dw, uint8_t *dsc, float *dx,
                 float *dtw, float *dy)
{
    const char *kind = mf_dev_kind(d);
    mf_dev_f16 type = mf_dev_card_f16(d, card);
    if (type == MF_DEV_F16_NONE) return 0;
    size_t w16b = (size_t)3 * DC_HID * DC_IN * 2, x16b = mf_dev_lt_x16_bytes(DC_TOK, DC_IN);
    size_t gub = sizeof(float) * DC_TOK * 2 * DC_HID;
    uint8_t *db = NULL;
    int rc = mf_dev_alloc(d, card, w16b + x16b + gub + 512, (void **)&db);
    if (rc) return mf_error_wrap(rc, "card %d (%s): self-check buffers of the cuBLASLt path", card, kind);
    uint16_t *w16 = (uint16_t *)db;
    void *x16 = db + (w16b + 255) / 256 * 256;
    float *dgu = (float *)((uint8_t *)x16 + (x16b + 255) / 256 * 256);
    static const char *const name[2] = {"cublaslt fp8 linear (row slice; dequantized)", "cublaslt fp4 expert ffn"};
    for (int k = 0; k < 2 && !rc; k++)
        for (int T = 1; T <= DC_TOK && !rc; T += DC_TOK - 1) {
            mf_kern_mat m[3];
            int sh[2] = {0, 0}, n_y = k ? DC_IN : 64;
            size_t wo = 0, so = 0;
            if (!k) {   /* rows [32, 96) of a 128 x 256 FP8 matrix */
                dc_mat(r, MF_KERN_FP8, 128, DC_IN, hb->w, hb->sc, &m[0]);
                m[0].w = hb->w + 32 * DC_IN;
                m[0].scale = hb->sc + DC_IN / 32;
                m[0].n_out = 64;
                wo = 64 * DC_IN;
                so = 2 * (DC_IN / 32);
            } else
                for (int j = 0; j < 3; j++) {   /* w1, w3 [HID][IN], w2 [IN][HID], FP4 */
                    int no = j == 2 ? DC_IN : DC_HID, ni = j == 2 ? DC_HID : DC_IN;
                    dc_mat(r, MF_KERN_FP4, no, ni, hb->w + wo, hb->sc + so, &m[j]);
                    wo += (size_t)no * ni / 2;
                    so += (size_t)no * (ni / 32);
                }
            const mf_kern_mat *pl[2] = {&m[0], &m[1]}, *p2 = &m[2];
            rc = mf_dev_w16_plan(pl, k ? 2 : 1, type, &sh[0]);
            if (!rc && k) rc = mf_dev_w16_plan(&p2, 1, type, &sh[1]);
            for (int i = 0; i < T * DC_IN; i++) hb->x[i] = ((float)dc_next(r) / 2147483648.0f - 1.0f) * 2.0f;
            for (int i = 0; i < T; i++) hb->tw[i] = 0.25f + (float)(dc_next(r) % 100) / 100.0f;
            /* the host's answer */
            if (!rc && !k) {
                mf_lt_host_x_values(type, hb->x, T, DC_IN, DC_IN, hb->xv, DC_IN);
                rc = mf_dense_host_linear(&(mf_dev_lin){.w = m[0], .row0 = 32, .x = hb->xv, .ld_x = DC_IN, .n_tok = T,
                                                        .y = hb->ref, .ld_y = 64});
            } else if (!rc)
                rc = mf_lt_host_ffn_ref(type, &m[0], &m[1], &m[2], hb->x, T, hb->tw, 7.0f, hb->gu, hb->xv, hb->ref);
            if (rc) break;
            /* the card's: the stored weights up, dequantized on the card, multiplied */
            memset(hb->got, 0, sizeof hb->got);
            rc = mf_dev_copy_h2d(st, dw, k ? hb->w : m[0].w, wo);
            if (!rc) rc = mf_dev_copy_h2d(st, dsc, k ? hb->sc : m[0].scale, so);
            if (!rc) rc = mf_dev_copy_h2d(st, dx, hb->x, sizeof(float) * (size_t)T * DC_IN);
            if (!rc) rc = mf_dev_copy_h2d(st, dtw, hb->tw, sizeof(float) * (size_t)T);
            mf_dev_lt_buf lt = {x16, x16b, NULL, 0};
            if (!rc && !k) {
                mf_dev_w16 o = {w16, type, sh[0], 64, DC_IN};
                rc = mf_dev_dequant(st, &(mf_kern_mat){MF_KERN_FP8, dw, dsc, 64, DC_IN}, &o);
                if (!rc)
                    rc = mf_dev_linear(st, &(mf_dev_lin){.w = {MF_KERN_FP8, dw, dsc, 64, DC_IN}, .row0 = 32,
                                                         .path = MF_DEV_LIN_CUBLASLT, .x = dx, .ld_x = DC_IN, .n_tok = T,
                                                         .y = dy, .ld_y = 64, .w16 = o, .lt = lt});
            } else if (!rc) {
                size_t s1 = (size_t)DC_HID * (DC_IN / 32), w1 = (size_t)DC_HID * DC_IN / 2;
                mf_dev_w16 lo = {w16, type, sh[0], DC_HID, DC_IN}, hi = lo, o2 = {w16 + 2 * DC_HID * DC_IN, type, sh[1],
                                                                                 DC_IN, DC_HID};
                hi.w = w16 + DC_HID * DC_IN;
                rc = mf_dev_dequant(st, &(mf_kern_mat){MF_KERN_FP4, dw, dsc, DC_HID, DC_IN}, &lo);
                if (!rc) rc = mf_dev_dequant(st, &(mf_kern_mat){MF_KERN_FP4, dw + w1, dsc + s1, DC_HID, DC_IN}, &hi);
                if (!rc) rc = mf_dev_dequant(st, &(mf_kern_mat){MF_KERN_FP4, dw + 2 * w1, dsc + 2 * s1, DC_IN, DC_HID}, &o2);
                if (!rc)
                    rc = mf_dev_expert_ffn_lt(st, &(mf_dev_ffn_lt){.w13 = {w16, type, sh[0], 2 * DC_HID, DC_IN}, .w2 = o2,
                                                                   .x = dx, .n_tok = T, .tok_weight = dtw, .limit = 7.0f,
                                                                   .gu = dgu, .lt = lt, .y = dy});
            }
            if (!rc) rc = mf_dev_copy_d2h(st, hb->got, dy, sizeof(float) * (size_t)T * n_y);
            int rs = mf_dev_stream_sync(st);
            if (!rc) rc = rs;
            if (rc) {
                rc = mf_error_wrap(rc, "card %d (%s): self-check of kernel %s at %d tokens failed", card, kind, name[k], T);
                break;
            }
            double e = dc_rel(hb->got, hb->ref, (size_t)T * n_y), tol = k ? MF_DEV_CHECK_TOL_LT_FFN : MF_DEV_CHECK_TOL_LT;
            if (!(e <= tol))
                rc = mf_error(-EIO, "card %d (%s): kernel %s: relative error %.2e at %d tokens against the host "
                              "kernel (bound %.0e): the card computes wrong answers", card, kind, name[k], e, T, tol);
        }
    mf_dev_free(d, card, db);
    return rc;
}

int mf_dev_selfcheck(mf_dev *d, int card, uint64_t seed)
{
    static const char *const kname[5] = {"fp8 matmul", "fp4 matmul (fp32 path)", "fp4 matmul (int8 path)",
                                         "expert ffn (int8 path)", "bf16 matmul"};
    const char *kind = mf_dev_kind(d);
    dc_host *hb = malloc(sizeof *hb);
    size_t dbytes = sizeof hb->w + sizeof hb->sc + sizeof hb->x + sizeof hb->tw + sizeof hb->h + sizeof hb->got +
                    sizeof hb->q8 + 6 * 256;
    uint8_t *db = NULL;
    int rc = hb ? mf_dev_alloc(d, card, dbytes, (void **)&db) : mf_error(-ENOMEM, "self-check: out of memory");
    if (rc) {
        free(hb);
        return mf_error_wrap(rc, "card %d (%s): self-check buffers", card, kind);
    }
    uint8_t *dw = db, *dsc = dw + (sizeof hb->w + 255) / 256 * 256, *dq = dsc + (sizeof hb->sc + 255) / 256 * 256;
    float *dx = (float *)(dq + sizeof hb->q8), *dtw = dx + DC_TOK * DC_IN, *dh = dtw + DC_TOK + 61,
          *dy = dh + DC_TOK * DC_HID;
    mf_dev_stream *st = mf_dev_stream_of(d, card, MF_DEV_STREAM_COMPUTE);
    dc_rng r = {seed ^ 0x73656c66636b ^ (uint64_t)card};
    for (int k = 0; k < 5 && !rc; k++)
        for (int T = 1; T <= DC_TOK && !rc; T += DC_TOK - 1) {
            mf_kern_fmt fmt = k == 0 ? MF_KERN_FP8 : MF_KERN_FP4;
            mf_kern_mat m[3], dm[3];
            size_t wo = 0, so = 0;
            int nm = k == 3 ? 3 : k == 4 ? 0 : 1;
            if (k == 4) {   /* bf16 [OUT][IN]: random values of about unit size */
                uint16_t *wb = (uint16_t *)hb->w;
                for (int i = 0; i < DC_OUT * DC_IN; i++) wb[i] = (uint16_t)(0x3E00 + dc_next(&r) % 0x200 + (dc_next(&r) & 0x8000));
                m[0] = (mf_kern_mat){.fmt = MF_KERN_BF16, .w = hb->w, .n_out = DC_OUT, .n_in = DC_IN};
                dm[0] = m[0];
                dm[0].w = dw;
                wo = sizeof(uint16_t) * DC_OUT * DC_IN;
            }
            for (int j = 0; j < nm; j++) {   /* ffn: w1, w3 [HID][IN], w2 [IN][HID] */
                int no = k == 3 ? (j == 2 ? DC_IN : DC_HID) : DC_OUT, ni = k == 3 && j == 2 ? DC_HID : DC_IN;
                dc_mat(&r, fmt, no, ni, hb->w + wo, hb->sc + so, &m[j]);
                dm[j] = m[j];
                dm[j].w = dw + wo;
                dm[j].scale = dsc + so;
                wo += (size_t)no * ni;
                so += fmt == MF_KERN_FP4 ? (size_t)no * (ni / 32) : (size_t)((no + 31) / 32) * (ni / 32);
            }
            for (int i = 0; i < T * DC_IN; i++) hb->x[i] = ((float)dc_next(&r) / 2147483648.0f - 1.0f) * 2.0f;
            for (int i = 0; i < T; i++) hb->tw[i] = 0.25f + (float)(dc_next(&r) % 100) / 100.0f;
            int n_y = k == 3 ? DC_IN : DC_OUT;
            /* the host's answer */
            mf_kern_q8 q;
            if (k == 0) rc = mf_kern_fp8_matmul(hb->w, hb->sc, DC_OUT, DC_IN, hb->x, T, DC_IN, hb->ref, DC_OUT, 0, DC_OUT);
            else if (k == 4)
                rc = mf_kern_bf16_matmul((const uint16_t *)hb->w, DC_OUT, DC_IN, hb->x, T, DC_IN, hb->ref, DC_OUT, 0, DC_OUT);
            else if (k == 1)
                rc = mf_kern_fp4_matmul_f32(hb->w, hb->sc, DC_OUT, DC_IN, hb->x, T, DC_IN, hb->ref, DC_OUT, 0, DC_OUT);
            else if (k == 2) {
                rc = mf_kern_q8_init(&q, hb->q8, sizeof hb->q8, T, DC_IN);
                if (!rc) rc = mf_kern_q8_quantize(&q, hb->x, DC_IN, 0, T);
                if (!rc) rc = mf_kern_fp4_matmul(hb->w, hb->sc, DC_OUT, DC_IN, &q, hb->ref, DC_OUT, 0, DC_OUT);
            } else {
                rc = mf_kern_q8_init(&q, hb->q8, sizeof hb->q8, T, DC_IN);
                if (!rc) rc = mf_kern_q8_quantize(&q, hb->x, DC_IN, 0, T);
                if (!rc)
                    rc = mf_kern_ffn_up(&m[0], &m[1], &(mf_kern_in){hb->x, T, DC_IN, &q}, hb->tw, 7.0f, hb->h, DC_HID, 0,
                                        DC_HID);
                if (!rc) rc = mf_kern_q8_init(&q, hb->q8, sizeof hb->q8, T, DC_HID);
                if (!rc) rc = mf_kern_q8_quantize(&q, hb->h, DC_HID, 0, T);
                if (!rc) rc = mf_kern_ffn_down(&m[2], &(mf_kern_in){hb->h, T, DC_HID, &q}, hb->ref, DC_IN, 0, DC_IN);
            }
            if (rc) {
                rc = mf_error_wrap(rc, "card %d (%s): self-check: the host's %s", card, kind, kname[k]);
                break;
            }
            /* the card's */
            memset(hb->got, 0, sizeof hb->got);
            rc = mf_dev_copy_h2d(st, dw, hb->w, wo);
            if (!rc && so) rc = mf_dev_copy_h2d(st, dsc, hb->sc, so);
            if (!rc) rc = mf_dev_copy_h2d(st, dx, hb->x, sizeof(float) * (size_t)T * DC_IN);
            if (!rc) rc = mf_dev_copy_h2d(st, dtw, hb->tw, sizeof(float) * (size_t)T);
            if (!rc && k == 0) rc = mf_dev_fp8_matmul(st, &dm[0], dx, T, dy);
            if (!rc && k == 4) rc = mf_dev_bf16_matmul(st, &dm[0], dx, T, dy);
            if (!rc && (k == 1 || k == 2)) rc = mf_dev_fp4_matmul(st, &dm[0], dx, T, dy, k == 2 ? dq : NULL);
            if (!rc && k == 3)
                rc = mf_dev_expert_ffn(st, &(mf_dev_ffn){.w1 = dm[0], .w3 = dm[1], .w2 = dm[2], .x = dx, .n_tok = T,
                                                         .tok_weight = dtw, .limit = 7.0f, .h = dh, .q8_scratch = dq,
                                                         .y = dy});
            if (!rc) rc = mf_dev_copy_d2h(st, hb->got, dy, sizeof(float) * (size_t)T * n_y);
            int rs = mf_dev_stream_sync(st);
            if (!rc) rc = rs;
            if (rc) {
                rc = mf_error_wrap(rc, "card %d (%s): self-check of kernel %s at %d tokens failed", card, kind, kname[k], T);
                break;
            }
            double e = dc_rel(hb->got, hb->ref, (size_t)T * n_y), tol = k == 3 ? MF_DEV_CHECK_TOL_FFN : MF_DEV_CHECK_TOL_MM;
            if (!(e <= tol))
                rc = mf_error(-EIO, "card %d (%s): kernel %s: relative error %.2e at %d tokens against the host "
                              "kernel (bound %.0e): the card computes wrong answers", card, kind, kname[k], e, T, tol);
        }
    if (!rc) rc = dc_dense(d, card, st, &r, hb, dw, dsc, dx, dh, dy);
    if (!rc) rc = dc_iscore(d, card, st, &r, (float *)dw, (int32_t *)dsc, dx, dh, (double *)dy);
    if (!rc) rc = dc_lt(d, card, st, &r, hb, dw, dsc, dx, dtw, dy);
    mf_dev_free(d, card, db);
    free(hb);
    return rc;
}
