/* The CUDA int8 FP4 path's arithmetic on the host: device/kern_q8.h's lane functions run in the
 * kernels' lane schedule (one warp per row, a lane per 32-block, shuffle trees emulated in their
 * order) against host/kernels.h on fresh random data. Runs everywhere, so the math of
 * device/dev_kernels.cu is checked without a card (the card itself: tests/test_dev_cuda.c). */
#include <float.h>
#include <math.h>
#include <stdio.h>

#include "device/dense_host.h"
#include "device/kern_attn.h"
#include "device/kern_dense.h"
#include "device/kern_lt.h"
#include "device/kern_q8.h"
#include "host/kern_gate.h"
#include "host/formats.h"
#pragma GCC diagnostic ignored "-Wunused-function"   /* dev_common.h's device helpers */
#include "tests/dev_common.h"
#include "tests/num.h"

/* max |a - b| / max |b| in float64; NaN positions must agree (a NaN anywhere else gives inf). */
static double rel_err(const float *a, const float *b, size_t n)
{
    double md = 0, mb = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]) || isnan(b[i])) {
            if (isnan(a[i]) != isnan(b[i])) md = INFINITY;
            continue;
        }
        double d = fabs((double)a[i] - b[i]);
        if (d > md) md = d;
        if (fabs(b[i]) > mb) mb = fabs(b[i]);
    }
    return mb > 0 ? md / mb : md;
}

/* k_q8_quantize: a warp per (token, group), lane l the inputs 8l..8l+7, max by an xor tree. */
static mf_q8k_view emu_quantize(const float *x, int T, int n_in, void *scratch)
{
    mf_q8k_view v = mf_q8k_view_of(scratch, T, n_in);
    for (int t = 0; t < T; t++)
        for (int s = 0; s < v.n_sb; s++) {
            int len = n_in - s * MF_Q8K_GROUP < MF_Q8K_GROUP ? n_in - s * MF_Q8K_GROUP : MF_Q8K_GROUP;
            const float *xg = x + (size_t)t * n_in + (size_t)s * MF_Q8K_GROUP;
            float am[32], nx[32];
            int bad = 0;
            for (int l = 0; l < 32; l++) {
                am[l] = 0.0f;
                for (int i = 0; i < 8; i++) {
                    int k = l * 8 + i;
                    float a = fabsf(k < len ? xg[k] : 0.0f);
                    am[l] = fmaxf(am[l], a);
                    bad |= !(a <= FLT_MAX);
                }
            }
            for (int off = 16; off > 0; off >>= 1) {
                for (int l = 0; l < 32; l++) nx[l] = fmaxf(am[l], am[l ^ off]);
                memcpy(am, nx, sizeof am);
            }
            float scale, inv = mf_q8k_group_inv(am[0], bad, &scale);
            for (int k = 0; k < len; k++)
                v.q[(size_t)t * n_in + (size_t)s * MF_Q8K_GROUP + k] = (int8_t)mf_q8k_code(xg[k], inv);
            v.scale[(size_t)t * v.n_sb + s] = scale;
        }
    return v;
}

/* k_q8_row_dot for every token: y[t][o] for row o. */
static void emu_row(const mf_kern_mat *w, int o, mf_q8k_view v, int T, float *y, int ld_y)
{
    int n_in = w->n_in, nb = n_in / 32;
    const uint8_t *wb = w->w;
    static float acc[32][64], nx[32];
    memset(acc, 0, sizeof acc);
    for (int base = 0; base < nb; base += 32) {
        unsigned e[32], em[32], ne[32];
        for (int l = 0; l < 32; l++) em[l] = e[l] = base + l < nb ? w->scale[(size_t)o * nb + base + l] : 0u;
        for (int off = 1; off < MF_Q8K_GROUP_BLOCKS; off <<= 1) {
            for (int l = 0; l < 32; l++) ne[l] = em[l] > em[l ^ off] ? em[l] : em[l ^ off];
            memcpy(em, ne, sizeof em);
        }
        for (int l = 0; l < 32; l++) {
            int b = base + l;
            if (b >= nb) continue;
            uint32_t wq[4];
            int32_t wv[8];
            memcpy(wq, wb + (size_t)o * (n_in / 2) + (size_t)b * 16, 16);   /* little endian */
            mf_q8k_fp4_block(wq, wv);
            float f = mf_q8k_block_factor(e[l], em[l]);
            for (int t = 0; t < T; t++)
                acc[l][t] = fmaf(mf_q8k_block_value(wv, f, v.q + (size_t)t * n_in + (size_t)b * 32),
                                 v.scale[(size_t)t * v.n_sb + b / MF_Q8K_GROUP_BLOCKS], acc[l][t]);
        }
    }
    for (int t = 0; t < T; t++) {   /* __shfl_down_sync tree: lanes past 31 read their own */
        float a[32];
        for (int l = 0; l < 32; l++) a[l] = acc[l][t];
        for (int off = 16; off > 0; off >>= 1) {
            for (int l = 0; l < 32; l++) nx[l] = a[l] + (l + off < 32 ? a[l + off] : a[l]);
            memcpy(a, nx, sizeof a);
        }
        y[(size_t)t * ld_y + o] = a[0];
    }
}

static void emu_matmul(const mf_kern_mat *w, const float *x, int T, float *y, void *scratch)
{
    mf_q8k_view v = emu_quantize(x, T, w->n_in, scratch);
    for (int o = 0; o < w->n_out; o++) emu_row(w, o, v, T, y, w->n_out);
}

/* k_q8_ffn_up then the int8 matmul of w2 on h. */
static void emu_ffn(const hmat *w1, const hmat *w3, const hmat *w2, const float *x, int T,
                    const float *tw, float limit, float *h, float *y, void *scratch)
{
    int I = w1->m.n_out, H = w1->m.n_in;
    float *g = malloc(sizeof(float) * T * I), *u = malloc(sizeof(float) * T * I);
    mf_q8k_view v = emu_quantize(x, T, H, scratch);
    for (int r = 0; r < I; r++) {
        emu_row(&w1->m, r, v, T, g, I);
        emu_row(&w3->m, r, v, T, u, I);
    }
    for (int t = 0; t < T; t++)
        for (int r = 0; r < I; r++) {
            h[t * I + r] = mf_kern_gate(g[t * I + r], u[t * I + r], limit) * (tw ? tw[t] : 1.0f);
        }
    emu_matmul(&w2->m, h, T, y, scratch);
    free(g);
    free(u);
}

/* Every 16-bit pattern of 4 codes decodes as 2 x e2m1 of each code, in element order. */
static void check_decode(void)
{
    static const int twice[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    int bad = 0;
    for (uint32_t c = 0; c < 65536; c++) {
        int32_t w[2];
        mf_q8k_fp4_word(c | (c ^ 0x5a5au) << 16, w);
        for (int h = 0; h < 2; h++) {
            uint32_t cc = h ? (c ^ 0x5a5au) : c;
            for (int n = 0; n < 4; n++)
                bad += (int8_t)(uint8_t)((uint32_t)w[h] >> (8 * n)) != twice[(cc >> (4 * n)) & 15u];
        }
    }
    CHECK(bad == 0, "fp4 word decode: %d wrong bytes", bad);
    /* factors: 2^(e-128), dropped beyond 14 binades, NaN for emax 0xFF */
    CHECK(mf_q8k_block_factor(127, 127) == 0.5f && mf_q8k_block_factor(140, 140) == 4096.0f &&
          mf_q8k_block_factor(113, 127) == ldexpf(1.0f, -15) && mf_q8k_block_factor(112, 127) == 0.0f &&
          mf_q8k_block_factor(1, 1) == ldexpf(1.0f, -127) && mf_q8k_block_factor(0, 0) == ldexpf(1.0f, -128) &&
          isnan(mf_q8k_block_factor(3, 255)), "block factors");
}

/* The device quantizer gives the host's codes and scales bit for bit (decoded from the host's
 * interleaved layout), including a partial last group, a zero group and a NaN/inf group. */
static void check_quantize(void)
{
    const int T = 5, n_in = 32 * 21;   /* 3 groups: 8, 8 and 5 blocks */
    float *x = malloc(sizeof(float) * T * n_in);
    for (int i = 0; i < T * n_in; i++) x[i] = gauss() * (1 + (i % 97 == 0) * 8);
    for (int k = 256; k < 512; k++) x[n_in + k] = 0.0f;   /* token 1, group 1: zero */
    x[2 * n_in + 300] = NAN;                               /* token 2, group 1 */
    x[3 * n_in + 600] = INFINITY;                          /* token 3, group 2 */
    x[4 * n_in + 7] = 1e-39f;                              /* subnormal input */
    size_t nb = mf_kern_q8_bytes(T, n_in);
    void *hb = malloc(nb), *db = malloc(nb);
    mf_kern_q8 q;
    CHECK(mf_kern_q8_init(&q, hb, nb, T, n_in) == 0 && mf_kern_q8_quantize(&q, x, n_in, 0, T) == 0,
          "%s", mf_last_error());
    mf_q8k_view v = emu_quantize(x, T, n_in, db);
    CHECK((uint8_t *)v.scale + sizeof(float) * T * v.n_sb <= (uint8_t *)db + nb, "view fits the scratch");
    int bad_q = 0, bad_s = 0;
    for (int t = 0; t < T; t++) {
        const uint8_t *row = q.q + (size_t)t * q.row_bytes;
        for (int k = 0; k < n_in; k++) {
            int b = k / 32, e = k % 32;
            size_t pos = (size_t)(b / 2) * 64 + (size_t)(e & 1) * 32 + (size_t)(b & 1) * 16 + (size_t)(e / 2);
            int hc = (int8_t)(uint8_t)(row[pos] - q.offset);
            bad_q += hc != v.q[(size_t)t * n_in + k];
        }
        for (int s = 0; s < q.n_sb; s++) {
            float a = q.scale[t * q.n_sb + s], b = v.scale[t * v.n_sb + s];
            bad_s += !(a == b || (isnan(a) && isnan(b)));
        }
    }
    CHECK(bad_q == 0 && bad_s == 0, "quantize: %d codes and %d scales differ from the host's", bad_q, bad_s);
    free(x);
    free(hb);
    free(db);
}

/* The int8 matmul against mf_kern_fp4_matmul (relative error under 1e-5: fp32 summation order
 * only, the integer block sums are exact on both) and against a float64 sum of the same
 * dequantized weights and quantized activations (under 1e-5). */
static void check_matmul(int wide_scales)
{
    const int n_out = 37, n_in = 32 * 45;   /* 45 blocks: two passes, a partial group */
    const int toks[] = {1, 2, 3, 8, 17, 64};
    for (size_t ti = 0; ti < sizeof toks / sizeof *toks; ti++) {
        int T = toks[ti];
        hmat w = hmat_rand(MF_KERN_FP4, n_out, n_in);
        if (wide_scales)   /* blocks far below their group's largest: dropped by both */
            for (size_t i = 0; i < w.s_bytes; i++) w.scale[i] = (uint8_t)(100 + dv_rnd() % 40);
        float *x = malloc(sizeof(float) * T * n_in), *yh = malloc(sizeof(float) * T * n_out),
              *ye = malloc(sizeof(float) * T * n_out), *yr = malloc(sizeof(float) * T * n_out);
        for (int i = 0; i < T * n_in; i++) x[i] = gauss();
        size_t nb = mf_kern_q8_bytes(T, n_in);
        void *hb = malloc(nb), *db = malloc(nb);
        mf_kern_q8 q;
        CHECK(mf_kern_q8_init(&q, hb, nb, T, n_in) == 0 && mf_kern_q8_quantize(&q, x, n_in, 0, T) == 0 &&
              mf_kern_fp4_matmul(w.w, w.scale, n_out, n_in, &q, yh, n_out, 0, n_out) == 0, "%s",
              mf_last_error());
        emu_matmul(&w.m, x, T, ye, db);
        mf_q8k_view v = mf_q8k_view_of(db, T, n_in);
        for (int t = 0; t < T; t++)
            for (int o = 0; o < n_out; o++) {
                double s = 0;
                for (int b = 0; b < n_in / 32; b++) {
                    unsigned emax = 0;
                    int g0 = b / 8 * 8;
                    for (int i = g0; i < g0 + 8 && i < n_in / 32; i++)
                        emax = w.scale[o * (n_in / 32) + i] > emax ? w.scale[o * (n_in / 32) + i] : emax;
                    unsigned e = w.scale[o * (n_in / 32) + b];
                    if (emax - e > 14) continue;
                    for (int k = 0; k < 32; k++) {
                        int i = b * 32 + k;
                        double wv = mf_e2m1_to_f32(mf_e2m1_get(w.w + (size_t)o * (n_in / 2), (size_t)i)) *
                                    ldexp(1.0, (int)e - 127);
                        s += wv * v.q[t * n_in + i] * v.scale[t * v.n_sb + b / 8];
                    }
                }
                yr[t * n_out + o] = (float)s;
            }
        double e_host = rel_err(ye, yh, (size_t)T * n_out), e_ref = rel_err(ye, yr, (size_t)T * n_out);
        printf("int8 fp4 matmul%s T=%d: rel err vs host %.3g, vs float64 %.3g\n",
               wide_scales ? " (scales 2^-27..2^12)" : "", T, e_host, e_ref);
        CHECK(e_host < 1e-5 && e_ref < 1e-5, "T=%d: rel err %g vs host, %g vs float64", T, e_host, e_ref);
        hmat_free(&w);
        free(x);
        free(yh);
        free(ye);
        free(yr);
        free(hb);
        free(db);
    }
}

/* A NaN in the activations makes the outputs of its token NaN, as on the host; a 0xFF scale code
 * makes its row NaN. */
static void check_nan(void)
{
    const int n_out = 4, n_in = 512, T = 2;
    hmat w = hmat_rand(MF_KERN_FP4, n_out, n_in);
    w.scale[1 * (n_in / 32) + 3] = 0xFF;
    float x[2 * 512], yh[8], ye[8];
    for (int i = 0; i < T * n_in; i++) x[i] = gauss();
    x[n_in + 5] = NAN;
    size_t nb = mf_kern_q8_bytes(T, n_in);
    void *hb = malloc(nb), *db = malloc(nb);
    mf_kern_q8 q;
    mf_kern_q8_init(&q, hb, nb, T, n_in);
    mf_kern_q8_quantize(&q, x, n_in, 0, T);
    mf_kern_fp4_matmul(w.w, w.scale, n_out, n_in, &q, yh, n_out, 0, n_out);
    emu_matmul(&w.m, x, T, ye, db);
    int ok = 1;
    for (int i = 0; i < T * n_out; i++) {
        int want_nan = i >= n_out || i == 1;
        ok &= (isnan(ye[i]) != 0) == want_nan && (isnan(yh[i]) != 0) == want_nan;
    }
    CHECK(ok, "NaN activations and 0xFF scales: NaN where the host has NaN");
    hmat_free(&w);
    free(hb);
    free(db);
}

/* The FFN (w1, w3, limit, token weights, w2) against the host's int8 FFN. h: relative error under
 * 1e-4 (g and u differ by fp32 summation order relative to their unclamped size, which is much
 * larger than the clamped h). y: under 1e-3, as a few of h's int8 codes may round the other way
 * (one code step of the 1/127 quantization on a few of I inputs). */
static void check_ffn(void)
{
    const int H = 512, I = 32 * 20;
    const int toks[] = {1, 5, 64};
    for (size_t ti = 0; ti < sizeof toks / sizeof *toks; ti++) {
        int T = toks[ti];
        hmat w1 = hmat_rand(MF_KERN_FP4, I, H), w3 = hmat_rand(MF_KERN_FP4, I, H),
             w2 = hmat_rand(MF_KERN_FP4, H, I);
        float *x = malloc(sizeof(float) * T * H), *tw = malloc(sizeof(float) * T);
        float *hh = malloc(sizeof(float) * T * I), *he = malloc(sizeof(float) * T * I);
        float *yh = malloc(sizeof(float) * T * H), *ye = malloc(sizeof(float) * T * H);
        for (int i = 0; i < T * H; i++) x[i] = gauss();
        for (int t = 0; t < T; t++) tw[t] = 0.1f + (dv_rnd() % 1000) / 1000.0f;
        void *db = malloc(mf_dev_ffn_q8_bytes(T, H, I));
        host_ffn(&w1, &w3, &w2, x, T, tw, 7.0f, 1, hh, yh);
        emu_ffn(&w1, &w3, &w2, x, T, tw, 7.0f, he, ye, db);
        double eh = rel_err(he, hh, (size_t)T * I), ey = rel_err(ye, yh, (size_t)T * H);
        printf("int8 expert FFN T=%d: rel err h %.3g, y %.3g\n", T, eh, ey);
        CHECK(eh < 1e-4 && ey < 1e-3, "FFN T=%d: rel err h %g, y %g", T, eh, ey);
        hmat_free(&w1);
        hmat_free(&w3);
        hmat_free(&w2);
        free(x);
        free(tw);
        free(hh);
        free(he);
        free(yh);
        free(ye);
        free(db);
    }
}

/* ---- the dense linears (k_lin) -------------------------------------------------------------- */

/* k_lin's lane schedule on the host: one warp per row i, lane l the row's 16-byte chunks l, l + 32,
 * ..., each decoded by device/kern_dense.h and FMA'd against token t's x (fp32 accumulation per
 * lane, or with REF sums the chunk's fp32 sum times its scale in double), then
 * __shfl_down_sync's tree (a lane past the end keeps its own value); lane 0's sum is written. */
static void emu_lin(const mf_dev_lin *a)
{
    int fmt = a->w.fmt, cpc = MF_DK_CPC(fmt), n_in = a->w.n_in, nch = n_in / cpc, ref = a->sums == MF_DEV_SUMS_REF;
    size_t rb = (size_t)n_in * (fmt == MF_KERN_FP8 ? 1 : 2);
    for (int i = 0; i < a->w.n_out; i++)
        for (int t = 0; t < a->n_tok; t++) {
            float vf[32], nf[32];
            double vd[32], nd[32];
            for (int l = 0; l < 32; l++) {
                vf[l] = 0.0f;
                vd[l] = 0.0;
                for (int c = l; c < nch; c += 32) {
                    uint32_t q[4];
                    memcpy(q, (const uint8_t *)a->w.w + i * rb + (size_t)c * 16, 16);
                    float sc = fmt == MF_KERN_FP8 ? mf_e8m0_to_f32(a->w.scale[mf_dk_scale_at(n_in, i, c)]) : 1.0f, wv[16];
                    mf_dk_decode(fmt, q, ref ? 1.0f : sc, wv);
                    const float *xt = a->x + mf_dk_xoff(a->row0, a->group_rows, n_in, i) + (long long)c * cpc +
                                      (long long)t * a->ld_x;
                    float sm = ref ? 0.0f : vf[l];
                    for (int j = 0; j < cpc; j++) sm = fmaf(wv[j], xt[j], sm);
                    if (ref) vd[l] += (double)sm * sc;
                    else vf[l] = sm;
                }
            }
            for (int off = 16; off > 0; off >>= 1) {
                for (int l = 0; l < 32; l++) {
                    nf[l] = vf[l] + (l + off < 32 ? vf[l + off] : vf[l]);
                    nd[l] = vd[l] + (l + off < 32 ? vd[l + off] : vd[l]);
                }
                memcpy(vf, nf, sizeof vf);
                memcpy(vd, nd, sizeof vd);
            }
            a->y[t * a->ld_y + i] = ref ? (float)vd[0] : vf[0];
        }
}

/* k_lin_tiled's arithmetic on the host: output (i, t) of block row tile m0 = i / 64 * 64 is the fmaf
 * chain over the columns in order of mf_dk_weight(i, k) and x[t][xoff(m0) + k] (each thread's
 * accumulator over the k tiles, 32 columns at a time, in order); with the reference's sums each 32
 * columns' chain of mf_dk_code values, times mf_dk_tile_scale, added in double. */
static void emu_lin_tiled(const mf_dev_lin *a)
{
    int fmt = a->w.fmt, n_in = a->w.n_in, ref = a->sums == MF_DEV_SUMS_REF;
    for (int i = 0; i < a->w.n_out; i++)
        for (int t = 0; t < a->n_tok; t++) {
            const float *xt = a->x + (long long)t * a->ld_x + mf_dk_xoff(a->row0, a->group_rows, n_in, i / MF_DEV_LIN_TILE_ROWS * MF_DEV_LIN_TILE_ROWS);
            float acc = 0.0f;
            double accd = 0.0;
            for (int k = 0; k < n_in; k++) {
                acc = fmaf(ref ? mf_dk_code(fmt, a->w.w, n_in, i, k) : mf_dk_weight(fmt, a->w.w, a->w.scale, n_in, i, k),
                           xt[k], acc);
                if (ref && k % 32 == 31) {
                    accd += (double)acc * (double)mf_dk_tile_scale(fmt, a->w.scale, n_in, i, k);
                    acc = 0.0f;
                }
            }
            a->y[t * a->ld_y + i] = ref ? (float)accd : acc;
        }
}

/* One emulated schedule (emu writes a->y) against device/dense_host.h's sums of the same linear,
 * relative error within tol; y and ref hold 64 x LDY floats. */
static void cmp_lin(const char *what, const char *sched, mf_dev_lin a, void (*emu)(const mf_dev_lin *), float *y,
                    float *ref, size_t n, double tol)
{
    memset(y, 0, sizeof(float) * n);
    memset(ref, 0, sizeof(float) * n);
    a.y = y;
    emu(&a);
    a.y = ref;
    CHECK(mf_dense_host_linear(&a) == 0, "host %s: %s", what, mf_last_error());
    double e = rel_err(y, ref, n);
    printf("dense %s linear, %s T=%d: rel err %.3e\n", what, sched, a.n_tok, e);
    CHECK(e <= tol, "dense %s linear, %s T=%d: rel err %.3e (bound %.0e)", what, sched, a.n_tok, e, tol);
}

/* The E4M3 decode and the bf16 rounding bit for bit against host/formats.h (every code; random
 * bit patterns with inf, NaN, subnormals and the largest finite values), then k_lin's schedule
 * against device/dense_host.h: FP8 and BF16, kernel and reference sums, a grouped FP8 slice from
 * row 32, strided x and y, 1..64 tokens, relative error bounds 1e-5 (kernel sums), 1e-6 (REF). */
static void check_dense(void)
{
    int bad = 0;
    for (uint32_t b = 0; b < 256; b++) {
        float a = mf_dk_e4m3(b), h = mf_e4m3_to_f32((uint8_t)b);
        bad += !(isnan(a) && isnan(h)) && memcmp(&a, &h, 4);
    }
    CHECK(bad == 0, "e4m3 decode: %d of 256 codes differ from mf_e4m3_to_f32", bad);
    bad = 0;
    for (uint32_t b = 0; b < 256; b++) {
        float a = mf_dk_e8m0(b), h = mf_e8m0_to_f32((uint8_t)b);
        bad += !(isnan(a) && isnan(h)) && memcmp(&a, &h, 4);
    }
    CHECK(bad == 0, "e8m0 decode: %d of 256 codes differ from mf_e8m0_to_f32", bad);
    static const uint32_t special[] = {0x7F800000u, 0xFF800000u, 0x7FC00001u, 0xFF812345u, 0x7F7FFFFFu, 0x7F7F8000u,
                                       0x00000001u, 0x807FFFFFu, 0x3F808000u, 0x3F818000u, 0x00008000u, 0};
    bad = 0;
    for (int k = 0; k < 200000 + 12; k++) {
        uint32_t u = k < 12 ? special[k] : dv_rnd() ^ (dv_rnd() << 16);
        float x, a, h;
        memcpy(&x, &u, 4);
        a = mf_dk_bf16(x);
        h = mf_bf16_to_f32(mf_bf16_from_f32(x));
        bad += memcmp(&a, &h, 4) != 0;
    }
    CHECK(bad == 0, "bf16 rounding: %d of 200012 values differ from host/formats.h", bad);

    enum { O = 96, IN = 512, GI = 128, LDX = 520, LDY = 100 };
    hmat f8 = hmat_rand(MF_KERN_FP8, O, IN), wa = hmat_rand(MF_KERN_FP8, O, GI);
    uint16_t *bw = malloc(sizeof(uint16_t) * O * IN);
    for (int i = 0; i < O * IN; i++) bw[i] = mf_bf16_from_f32(gauss() * 0.05f);
    float *x = malloc(sizeof(float) * 64 * LDX), *y = malloc(sizeof(float) * 64 * LDY), *ref = malloc(sizeof(float) * 64 * LDY);
    for (int i = 0; i < 64 * LDX; i++) x[i] = gauss();
    static const int toks[] = {1, 3, 8, 9, 64};
    for (int kind = 0; kind < 4; kind++)
        for (size_t ti = 0; ti < sizeof toks / sizeof toks[0]; ti++) {
            int T = toks[ti];
            static const char *const name[4] = {"fp8", "bf16", "bf16 reference sums", "fp8 grouped reference sums"};
            mf_dev_lin a = {.x = x, .ld_x = LDX, .n_tok = T, .y = y, .ld_y = LDY};
            if (kind == 0) a.w = f8.m;
            else if (kind < 3) a.w = (mf_kern_mat){MF_KERN_BF16, bw, NULL, O, IN};
            else a.w = wa.m, a.row0 = 32, a.group_rows = 64;   /* rows 32..127 of 2 x 64: x 2 x 128 columns */
            if (kind >= 2) a.sums = MF_DEV_SUMS_REF;
            cmp_lin(name[kind], "lane schedule", a, emu_lin, y, ref, (size_t)64 * LDY, kind >= 2 ? 1e-6 : 1e-5);
        }
    /* k_lin_tiled's arithmetic against the host's sums: FP8, BF16, FP8 grouped by 64 rows from row 64
     * (a block's rows in one group, mf_dev_lin_tiled_ok) with kernel sums, then BF16 and the grouped
     * FP8 with the reference's (bound 1e-6, as the warp-per-row kernel's) */
    for (int kind = 0; kind < 5; kind++)
        for (size_t ti = 0; ti < sizeof toks / sizeof toks[0]; ti++) {
            int T = toks[ti];
            static const char *const name[5] = {"fp8", "bf16", "fp8 grouped", "bf16 reference sums",
                                                 "fp8 grouped reference sums"};
            mf_dev_lin a = {.x = x, .ld_x = LDX, .n_tok = T, .y = y, .ld_y = LDY, .path = MF_DEV_LIN_TILED};
            if (kind == 0) a.w = f8.m;
            else if (kind == 1 || kind == 3) a.w = (mf_kern_mat){MF_KERN_BF16, bw, NULL, O, IN};
            else a.w = wa.m, a.row0 = 64, a.group_rows = 64;   /* rows 64..159 of 3 x 64: x 3 x 128 columns */
            if (kind >= 3) a.sums = MF_DEV_SUMS_REF;
            CHECK(mf_dev_lin_tiled_ok(&a), "%s: the tiled kernel should apply", name[kind]);
            cmp_lin(name[kind], "tiled kernel's arithmetic", a, emu_lin_tiled, y, ref, (size_t)64 * LDY,
                    kind >= 3 ? 1e-6 : 1e-5);
        }
    hmat_free(&f8);
    hmat_free(&wa);
    free(bw);
    free(x);
    free(y);
    free(ref);
}


/* k_attn's schedule (a block per token and head: each key's 16 lanes and the half-warp's shuffle
 * tree, the max, expf, the denominator in key order, each value element's chain) with the host's
 * expf, against mf_dense_host_attn: bit for bit (on a card only expf may differ); then with the
 * output's inverse RoPE (mf_dev_attn.rope_dim) likewise. */
static void check_attn(void)
{
    enum { T = 3, NH = 5, D = 128, NKV = 300, MK = 200 };
    uint64_t seed = 0xa77e5eedull;
    static float q[T * NH * D], kv[NKV * D], o_ref[T * NH * D], o_emu[T * NH * D], scratch[4 * MF_DEV_ATTN_MAX_KEYS];
    static int32_t keys[T * MK], n_keys[T];
    float sink[NH];
    int n_dot_diff = 0;   /* the dots alone: the bf16 output hides most one-ulp differences */
    for (int i = 0; i < T * NH * D; i++) q[i] = mf_bf16_round(mf_test_frand(&seed) * 2.0f);
    for (int i = 0; i < NKV * D; i++) kv[i] = mf_bf16_round(mf_test_frand(&seed) * 2.0f);
    for (int h = 0; h < NH; h++) sink[h] = mf_test_frand(&seed) * 3.0f;
    for (int t = 0; t < T; t++) {
        n_keys[t] = t == 1 ? 0 : MK - 17 * t;
        for (int i = 0; i < n_keys[t]; i++) keys[t * MK + i] = (int32_t)((mf_test_frand(&seed) + 1.0f) * 0.5f * (NKV - 1));
    }
    mf_dev_attn a = {.q = q, .ld_q = NH * D, .n_tok = T, .n_heads = NH, .D = D, .scale = (float)(1.0 / sqrt((double)D)),
                     .sink = sink, .kv = kv, .n_kv = NKV, .keys = keys, .n_keys = n_keys, .ld_keys = MK, .o = o_ref,
                     .ld_o = NH * D};
    CHECK(mf_dense_host_attn(&a, scratch) == 0, "mf_dense_host_attn failed");
    for (int t = 0; t < T; t++)
        for (int h = 0; h < NH; h++) {
            const float *qh = q + (t * NH + h) * D;
            const int32_t *rows = keys + t * MK;
            int n = n_keys[t];
            float s[MK] = {0}, mx = sink[h];
            for (int i = 0; i < n; i++) {
                float l[16];
                for (int j = 0; j < 16; j++) l[j] = mf_da_lane(qh, kv + (size_t)rows[i] * D, D, j);
                float dot = mf_da_tree16(l), host;
                mf_kern_vec_dots(&qh, 1, kv + (size_t)rows[i] * D, D, &host);
                n_dot_diff += memcmp(&dot, &host, sizeof dot) != 0;
                s[i] = dot * a.scale;
            }
            for (int i = 0; i < n; i++) mx = s[i] > mx ? s[i] : mx;
            for (int i = 0; i < n; i++) s[i] = expf(s[i] - mx);
            double den = expf(sink[h] - mx);
            for (int i = 0; i < n; i++) den += s[i];
            for (int d = 0; d < D; d++)
                o_emu[(t * NH + h) * D + d] = mf_dk_bf16((float)((double)mf_da_value(s, kv, rows, n, D, d) / den));
        }
    CHECK(n_dot_diff == 0, "k_attn's lanes and tree: %d dots not mf_kern_vec_dots' bits", n_dot_diff);
    CHECK(!memcmp(o_emu, o_ref, sizeof o_ref), "k_attn's lane schedule: not mf_dense_host_attn's bits");
    /* with the output's inverse RoPE (rope_dim 32: each head's last 32 values, a table row a token):
     * k_attn's pairs (mf_da_rope_inv, each value rounded by mf_dk_bf16) against the host op's */
    enum { RD = 32 };
    static float cs[T * RD];
    for (int i = 0; i < T * RD; i++) cs[i] = mf_test_frand(&seed);
    a.rope = cs;
    a.rope_dim = RD;
    CHECK(mf_dense_host_attn(&a, scratch) == 0, "mf_dense_host_attn with the inverse RoPE failed");
    int n_moved = 0;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < NH; h++) {
            float *x = o_emu + (t * NH + h) * D + D - RD;
            float before[RD];
            memcpy(before, x, sizeof before);
            for (int i = 0; i < RD / 2; i++) {
                mf_da_rope_inv(cs + t * RD, RD / 2, i, x);
                x[2 * i] = mf_dk_bf16(x[2 * i]);
                x[2 * i + 1] = mf_dk_bf16(x[2 * i + 1]);
            }
            n_moved += memcmp(before, x, sizeof before) != 0;
        }
    CHECK(n_moved > T * NH / 2, "the inverse RoPE moved only %d of %d heads' roped parts", n_moved, T * NH);
    CHECK(!memcmp(o_emu, o_ref, sizeof o_ref), "k_attn's inverse RoPE: not mf_dense_host_attn's bits");
    printf("attention lanes (%d tokens, %d heads of %d), and with the inverse RoPE of %d: bit-identical to the host "
           "op\n", T, NH, D, RD);
}

/* The queries as qb leaves them (mf_dev_attn.q_rope_dim): k_attn's load (each value rounded by
 * mf_dk_bf16, each pair's mf_da_rope_fwd, both rounded) against the host's q prep
 * (graphs/step/fast_attn.c mf_fa_heads_q: all D rounded, the forward RoPE, all D rounded); the host
 * op on the raw queries against the host op on the prepared ones (with the inverse RoPE too): bit
 * for bit, and the raw queries left as they were. */
static void check_attn_qrope(void)
{
    enum { T = 3, NH = 5, D = 128, NKV = 300, MK = 200, RD = 32 };
    uint64_t seed = 0x9e0fa11ull;
    static float q[T * NH * D], q0[T * NH * D], qp[T * NH * D], kv[NKV * D], cs[T * RD], o_ref[T * NH * D],
        o_raw[T * NH * D], scratch[4 * MF_DEV_ATTN_MAX_KEYS];
    static int32_t keys[T * MK], n_keys[T];
    float sink[NH];
    for (int i = 0; i < T * NH * D; i++) q[i] = mf_test_frand(&seed) * 2.0f;   /* fp32: not bf16 */
    for (int i = 0; i < NKV * D; i++) kv[i] = mf_bf16_round(mf_test_frand(&seed) * 2.0f);
    for (int i = 0; i < T * RD; i++) cs[i] = mf_test_frand(&seed);
    for (int h = 0; h < NH; h++) sink[h] = mf_test_frand(&seed) * 3.0f;
    for (int t = 0; t < T; t++) {
        n_keys[t] = MK - 17 * t;
        for (int i = 0; i < n_keys[t]; i++) keys[t * MK + i] = (int32_t)((mf_test_frand(&seed) + 1.0f) * 0.5f * (NKV - 1));
    }
    memcpy(q0, q, sizeof q);
    int n_diff = 0;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < NH; h++) {
            float *x = qp + (t * NH + h) * D, ks[D];   /* the host's q prep, then k_attn's load */
            memcpy(x, q + (t * NH + h) * D, sizeof ks);
            mf_kern_vec_bf16_round(x, D);
            for (int i = 0; i < RD / 2; i++) {
                const float *c = cs + t * RD;
                float a = x[D - RD + 2 * i], b = x[D - RD + 2 * i + 1], ac = a * c[i], bs = b * c[RD / 2 + i];
                float as = a * c[RD / 2 + i], bc = b * c[i];
                x[D - RD + 2 * i] = ac - bs;
                x[D - RD + 2 * i + 1] = as + bc;
            }
            mf_kern_vec_bf16_round(x, D);
            for (int d = 0; d < D; d++) ks[d] = mf_dk_bf16(q[(t * NH + h) * D + d]);
            for (int i = 0; i < RD / 2; i++) {
                mf_da_rope_fwd(cs + t * RD, RD / 2, i, ks + D - RD);
                ks[D - RD + 2 * i] = mf_dk_bf16(ks[D - RD + 2 * i]);
                ks[D - RD + 2 * i + 1] = mf_dk_bf16(ks[D - RD + 2 * i + 1]);
            }
            n_diff += memcmp(ks, x, sizeof ks) != 0;
        }
    CHECK(n_diff == 0, "k_attn's query load: %d heads not mf_fa_heads_q's bits", n_diff);
    mf_dev_attn a = {.q = qp, .ld_q = NH * D, .n_tok = T, .n_heads = NH, .D = D, .scale = (float)(1.0 / sqrt((double)D)),
                     .sink = sink, .kv = kv, .n_kv = NKV, .keys = keys, .n_keys = n_keys, .ld_keys = MK, .o = o_ref,
                     .ld_o = NH * D, .rope = cs, .rope_dim = RD};
    CHECK(mf_dense_host_attn(&a, scratch) == 0, "mf_dense_host_attn on the prepared queries failed");
    a.q = q;
    a.o = o_raw;
    a.q_rope_dim = RD;
    CHECK(mf_dense_host_attn(&a, scratch) == 0, "mf_dense_host_attn on qb's queries failed");
    CHECK(!memcmp(o_raw, o_ref, sizeof o_ref), "the host op's query prep: not the prepared queries' outputs");
    CHECK(!memcmp(q, q0, sizeof q), "the host op's query prep wrote the queries");
    printf("attention on qb's queries (the forward RoPE of %d in the op): bit-identical to the host's q prep\n", RD);
}


/* The cuBLASLt path's arithmetic (device/kern_lt.h, which device/dev_lt_kernels.cu runs per element):
 * every FP8 code (256) and FP4 code (16) dequantized at every scale code the plan's window allows
 * for a shift (each type: shifts 0, -12 and 9; NaN scale 255 too; codes whose host decode is finite:
 * mf_lt_e_max), widened back and times 2^shift,
 * bit for bit host/formats.h's decode of the same code and scale (code x E8M0 in fp32), and the
 * window's edges: one binade past each end is no longer exact (or finite); the fp16 rounding against
 * host/formats.h mf_f16_from_f32 on every bit pattern of a float's top 20 bits (both rounding
 * edges of each) and 200,000 random floats, NaN to the quiet NaN of its sign; the fp16 widening of
 * all 65,536 codes against mf_f16_to_f32; the activations' shift and cast: the largest |x| lands in
 * [2^14, 2^15), and a bf16 value up to 31 binades below it comes back exactly. */
static void check_lt(void)
{
    int bad = 0, n = 0;
    static const int shifts[3] = {0, -12, 9};
    for (int type = MF_LT_BF16; type <= MF_LT_FP16; type++)
        for (int fmt = MF_KERN_FP8; fmt <= MF_KERN_FP4; fmt++)
            for (int si = 0; si < 3; si++) {
                int shift = shifts[si], kmin = mf_lt_k_min(type, fmt), kmax = mf_lt_k_max(type, fmt);
                for (int e = 0; e < 256; e++) {
                    int k = e - 127 - shift, in = (k >= kmin && k <= kmax && e <= mf_lt_e_max(fmt)) || e == 255;
                    for (uint32_t c = 0; c < (fmt == MF_KERN_FP8 ? 256u : 16u); c++) {
                        float host = (fmt == MF_KERN_FP8 ? mf_e4m3_to_f32((uint8_t)c) : mf_e2m1_to_f32((uint8_t)c)) *
                                     mf_e8m0_to_f32((uint8_t)e);
                        uint16_t v = mf_lt_dequant(type, fmt, c, (uint32_t)e, shift);
                        double back = (double)mf_lt_widen16(type, v) * ldexp(1.0, shift);
                        int same = isnan(host) ? isnan(back) : back == (double)host;
                        if (in) {
                            n++;
                            bad += !same;
                        }
                    }
                }
                /* one binade past the window: the smallest or the largest code stops being exact or finite */
                uint32_t lo_code = fmt == MF_KERN_FP8 ? 1u : 1u, hi_code = fmt == MF_KERN_FP8 ? 0x7Eu : 7u;
                int elo = kmin - 1 + 127 + shift, ehi = kmax + 1 + 127 + shift;
                if (elo >= 0 && elo < 255) {
                    float host = (fmt == MF_KERN_FP8 ? mf_e4m3_to_f32((uint8_t)lo_code) : mf_e2m1_to_f32((uint8_t)lo_code)) *
                                 mf_e8m0_to_f32((uint8_t)elo);
                    bad += (double)mf_lt_widen16(type, mf_lt_dequant(type, fmt, lo_code, (uint32_t)elo, shift)) *
                               ldexp(1.0, shift) == (double)host;
                }
                if (ehi >= 0 && ehi < 255) {
                    float host = (fmt == MF_KERN_FP8 ? mf_e4m3_to_f32((uint8_t)hi_code) : mf_e2m1_to_f32((uint8_t)hi_code)) *
                                 mf_e8m0_to_f32((uint8_t)ehi);
                    bad += isfinite((double)mf_lt_widen16(type, mf_lt_dequant(type, fmt, hi_code, (uint32_t)ehi, shift))) &&
                           (double)mf_lt_widen16(type, mf_lt_dequant(type, fmt, hi_code, (uint32_t)ehi, shift)) *
                                   ldexp(1.0, shift) == (double)host;
                }
            }
    /* scale codes past mf_lt_e_max: the host's largest values are inf */
    bad += isfinite(mf_e4m3_to_f32(0x7E) * mf_e8m0_to_f32(247)) || !isfinite(mf_e4m3_to_f32(0x7E) * mf_e8m0_to_f32(246)) ||
           isfinite(mf_e2m1_to_f32(7) * mf_e8m0_to_f32(253)) || !isfinite(mf_e2m1_to_f32(7) * mf_e8m0_to_f32(252));
    CHECK(bad == 0 && n > 100000, "dequantization: %d of %d values not the host's decode (or exact past the window)", bad, n);
    /* fp16 rounding: the top 20 bits of a float, each with its low bits at the halfway point -1, 0, +1
     * ulp of fp16 and at its extremes, and random floats */
    int bad16 = 0, m = 0;
    for (uint32_t hi = 0; hi < (1u << 20); hi++) {
        static const uint32_t lows[6] = {0, 1, 0xFFF, 0x1000, 0x1001, 0xFFF0};
        for (int j = 0; j < 6; j++) {
            uint32_t b = hi << 12 | (lows[j] & 0xFFFu) | (j == 5 ? 0xFF0u : 0);
            float x = mf_dk_float(b);
            uint16_t got = mf_lt_f16(x);
            if (isnan(x)) bad16 += got != (uint16_t)((b >> 16 & 0x8000u) | 0x7E00u);
            else bad16 += got != mf_f16_from_f32(x);
            m++;
        }
    }
    for (int i = 0; i < 200000; i++) {
        float x = mf_dk_float(dv_rnd() ^ (dv_rnd() << 16));
        if (!isnan(x)) bad16 += mf_lt_f16(x) != mf_f16_from_f32(x), m++;
    }
    for (uint32_t c = 0; c < 65536; c++) {
        float a = mf_lt_f16_to_f32((uint16_t)c), b = mf_f16_to_f32((uint16_t)c);
        bad16 += isnan(b) ? !isnan(a) : memcmp(&a, &b, 4) != 0;
    }
    CHECK(bad16 == 0, "fp16 rounding and widening: %d of %d differ from host/formats.h", bad16, m + 65536);
    /* the activations: the shift puts the largest |x| in [2^14, 2^15); bf16 values within 31 binades come back */
    int badx = 0;
    for (int i = 0; i < 2000; i++) {
        float mx = ldexpf(1.0f + (float)(dv_rnd() % 1000) / 1000.0f, (int)(dv_rnd() % 200) - 100);
        int xs = mf_lt_xshift(MF_LT_FP16, mx);
        float sc = mx * mf_lt_pow2(-xs);
        badx += !(sc >= 16384.0f && sc < 32768.0f);
        float v = mf_bf16_round(ldexpf(1.0f + (float)(dv_rnd() % 1000) / 1000.0f, ilogbf(mx) - (int)(dv_rnd() % 32)));
        badx += mf_lt_widen16(MF_LT_FP16, mf_lt_cast(MF_LT_FP16, v, xs)) * mf_lt_pow2(xs) != v;
        badx += mf_lt_widen16(MF_LT_BF16, mf_lt_cast(MF_LT_BF16, v, 0)) != v;   /* bf16: itself */
    }
    CHECK(badx == 0 && mf_lt_xshift(MF_LT_FP16, 0.0f) == 0 && mf_lt_xshift(MF_LT_BF16, 1e30f) == 0,
          "activation casts: %d wrong", badx);
    printf("test_dev_kmath: cuBLASLt dequantization %d values, fp16 rounding %d floats: the host's bits\n", n, m);
}

int main(void)
{
    check_decode();
    check_quantize();
    check_matmul(0);
    check_matmul(1);
    check_nan();
    check_ffn();
    check_dense();
    check_attn();
    check_attn_qrope();
    check_lt();
    return mf_check_exit("test_dev_kmath");
}
