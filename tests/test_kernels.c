/* The fused CPU kernels (host/kernels.h) against a plain float64 reference built from the scalar
 * decodes of host/formats.h, on fresh random data (seed printed; MOEFLOW_TEST_SEED=n repeats a
 * run), for both SIMD paths: errors stated as float64 ||y - ref|| / ||ref||, the two paths
 * bit-identical, and results bit-identical however output rows are split. */
#include <errno.h>
#include <cpuid.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>

#include "host/formats.h"
#include "host/kernels.h"
#include "sched/error.h"
#include "tests/check.h"

/* Tolerances (relative float64 norm of the error over a whole output):
 *  - fp32 paths (BF16, FP8, FP4 fp32): only fp32 summation, 32 lanes -> TOL_F32;
 *  - FP4 int8 path against the reference on the same int8-rounded activations -> TOL_F32 too
 *    (integer sums are exact; what is left is the fp32 group sums), when no block sits more than
 *    14 binades under its group's largest scale;
 *  - FP4 int8 path against the fp32 reference (activation rounding to int8 per 256) -> TOL_Q8
 *    for normal inputs, TOL_Q8_OUT when 1% of them are 8x outliers;
 *  - the FFN with both int8 quantizations (x and h) -> TOL_FFN_Q8, fp32 path -> TOL_F32. */
#define TOL_F32 1e-5
#define TOL_Q8 2e-2
#define TOL_Q8_OUT 5e-2     /* 1% of inputs 8x larger: they set their groups' int8 step */
#define TOL_FFN_Q8 2.5e-2

static uint64_t rng_state;

static uint64_t rng_next(void)
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double rng_unif(void) { return (double)(rng_next() >> 11) * 0x1.0p-53; }

static float rng_normal(void)
{
    double u1 = rng_unif(), u2 = rng_unif();
    if (u1 < 1e-300)
        u1 = 1e-300;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory (%zu bytes)\n", n);
        exit(2);
    }
    return p;
}

/* A random weight matrix in fmt, its fp64 decode and its mf_kern_mat view. e_lo..e_hi: the range
 * of E8M0 scale codes. */
typedef struct {
    mf_kern_mat m;
    void *w;
    uint8_t *scale;
    double *dec;   /* [n_out][n_in] */
} test_mat;

static void mat_make(test_mat *t, mf_kern_fmt fmt, int n_out, int n_in, int e_lo, int e_hi)
{
    size_t n = (size_t)n_out * n_in;
    t->dec = xmalloc(n * sizeof(double));
    t->scale = NULL;
    if (fmt == MF_KERN_BF16) {
        uint16_t *w = xmalloc(n * 2);
        for (size_t i = 0; i < n; i++) {
            w[i] = mf_bf16_from_f32(rng_normal() * 0.05f);
            t->dec[i] = mf_bf16_to_f32(w[i]);
        }
        t->w = w;
    } else if (fmt == MF_KERN_FP8) {
        uint8_t *w = xmalloc(n);
        int sr = (n_out + 31) / 32, sc = n_in / 32;
        t->scale = xmalloc((size_t)sr * sc);
        for (int i = 0; i < sr * sc; i++)
            t->scale[i] = (uint8_t)(e_lo + (int)(rng_next() % (uint64_t)(e_hi - e_lo + 1)));
        for (size_t i = 0; i < n; i++) {
            uint8_t c;
            do
                c = (uint8_t)rng_next();
            while ((c & 0x7F) == 0x7F);
            w[i] = c;
            int o = (int)(i / n_in), k = (int)(i % n_in);
            t->dec[i] = (double)(mf_e4m3_to_f32(c) * mf_e8m0_to_f32(t->scale[(o / 32) * sc + k / 32]));
        }
        t->w = w;
    } else {
        uint8_t *w = xmalloc(n / 2);
        int nb = n_in / 32;
        t->scale = xmalloc((size_t)n_out * nb);
        for (int i = 0; i < n_out * nb; i++)
            t->scale[i] = (uint8_t)(e_lo + (int)(rng_next() % (uint64_t)(e_hi - e_lo + 1)));
        for (size_t i = 0; i < n / 2; i++)
            w[i] = (uint8_t)rng_next();
        for (size_t i = 0; i < n; i++) {
            int o = (int)(i / n_in), k = (int)(i % n_in);
            t->dec[i] = (double)mf_e2m1_to_f32(mf_e2m1_get(w + (size_t)o * (n_in / 2), (size_t)k)) *
                        (double)mf_e8m0_to_f32(t->scale[o * nb + k / 32]);
        }
        t->w = w;
    }
    t->m = (mf_kern_mat){fmt, t->w, t->scale, n_out, n_in};
}

static void mat_free(test_mat *t)
{
    free(t->w);
    free(t->scale);
    free(t->dec);
}

/* ref[t][o] = sum_k dec[o][k] * x[t][k] in float64. */
static void ref_matmul(const double *dec, int n_out, int n_in, const double *x, int n_tok, double *ref)
{
    for (int t = 0; t < n_tok; t++)
        for (int o = 0; o < n_out; o++) {
            double s = 0;
            for (int k = 0; k < n_in; k++)
                s += dec[(size_t)o * n_in + k] * x[(size_t)t * n_in + k];
            ref[(size_t)t * n_out + o] = s;
        }
}

static double rel_err(const float *y, const double *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)y[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static int bits_equal(const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], 4) && !(isnan(a[i]) && isnan(b[i])))
            return 0;
    return 1;
}

/* The dequantized int8 activations a q8 view holds, [n_tok][n_in] in float64. */
static void q8_dequant(const mf_kern_q8 *q, double *out)
{
    int n_blk = q->n_in / 32;
    for (int t = 0; t < q->n_tok; t++)
        for (int b = 0; b < n_blk; b++)
            for (int e = 0; e < 32; e++) {
                size_t pos = (size_t)(b / 2) * 64 + (size_t)(e & 1) * 32 + (size_t)(b & 1) * 16 + e / 2;
                int c = (int8_t)(uint8_t)((int)q->q[(size_t)t * q->row_bytes + pos] - q->offset);
                out[(size_t)t * q->n_in + b * 32 + e] = c * (double)q->scale[(size_t)t * q->n_sb + b / 8];
            }
}

/* Copies the n_tok x n_out outputs of a buffer with rows ld apart into out. */
static void compact(const float *y, int n_tok, int n_out, int ld, float *out)
{
    for (int t = 0; t < n_tok; t++)
        memcpy(out + (size_t)t * n_out, y + (size_t)t * ld, (size_t)n_out * 4);
}

static int n_paths;
static mf_kern_simd paths[2];

/* Max errors seen, for the summary. */
#define N_WORST 9
static double worst[N_WORST];
enum { W_BF16, W_FP8, W_FP4F32, W_FP4Q8_EXACT, W_FP4Q8, W_FP4Q8_OUT, W_FFN_Q8, W_FFN_F32, W_FFN_FP8 };
static const char *worst_name[N_WORST] = {
    "bf16", "fp8", "fp4 fp32 path", "fp4 int8 vs int8-rounded ref", "fp4 int8 vs fp32 ref",
    "fp4 int8 vs fp32 ref, outliers", "ffn fp4 int8", "ffn fp4 fp32", "ffn fp8 (shared expert)"};

static void note(int which, double e)
{
    if (e > worst[which] || isnan(e))
        worst[which] = e;
}

/* Runs the matmul of `m` (int8 path when q8) on the active path over rows split at `cuts`. */
static int run_matmul(const test_mat *m, const float *x, int ld_x, int n_tok, const mf_kern_q8 *q8,
                      float *y, int ld_y, int n_split)
{
    int n_out = m->m.n_out;
    int prev = 0;
    for (int i = 1; i <= n_split; i++) {
        int r = i == n_split ? n_out : (int)(rng_next() % (uint64_t)(n_out + 1));
        if (r < prev)
            r = prev;
        int rc;
        if (m->m.fmt == MF_KERN_FP4 && q8)
            rc = mf_kern_fp4_matmul(m->w, m->scale, n_out, m->m.n_in, q8, y, ld_y, prev, r);
        else if (m->m.fmt == MF_KERN_FP4)
            rc = mf_kern_fp4_matmul_f32(m->w, m->scale, n_out, m->m.n_in, x, n_tok, ld_x, y, ld_y,
                                        prev, r);
        else if (m->m.fmt == MF_KERN_FP8)
            rc = mf_kern_fp8_matmul(m->w, m->scale, n_out, m->m.n_in, x, n_tok, ld_x, y, ld_y,
                                    prev, r);
        else
            rc = mf_kern_bf16_matmul(m->w, n_out, m->m.n_in, x, n_tok, ld_x, y, ld_y, prev, r);
        if (rc)
            return rc;
        prev = r;
    }
    return 0;
}

/* One matmul case: every path, single range and a random split, against the fp64 reference. */
static void case_matmul(mf_kern_fmt fmt, int n_out, int n_in, int n_tok, int e_lo, int e_hi,
                        int outliers)
{
    test_mat m;
    mat_make(&m, fmt, n_out, n_in, e_lo, e_hi);
    /* odd token counts run with padded rows (ld_x > n_in, ld_y > n_out); the padding must stay 0 */
    int pad = n_tok & 1 ? 7 : 0, ld_x = n_in + pad, ld_y = n_out + pad;
    size_t nx = (size_t)n_tok * n_in, ny = (size_t)n_tok * n_out, nyl = (size_t)n_tok * ld_y;
    float *x = xmalloc((size_t)n_tok * ld_x * 4);
    double *xd = xmalloc(nx * 8), *ref = xmalloc(ny * 8), *refq = xmalloc(ny * 8);
    for (int t = 0; t < n_tok; t++)
        for (int k = 0; k < ld_x; k++) {
            float v = rng_normal() * (outliers && rng_unif() < 0.01 ? 8.0f : 1.0f);
            x[(size_t)t * ld_x + k] = k < n_in ? v : NAN;   /* padding must never be read */
            if (k < n_in)
                xd[(size_t)t * n_in + k] = v;
        }
    ref_matmul(m.dec, n_out, n_in, xd, n_tok, ref);

    size_t qb = mf_kern_q8_bytes(n_tok, n_in);
    void *qbuf[2] = {xmalloc(qb), xmalloc(qb)};
    mf_kern_q8 q8[2];
    float *y[2][2];   /* [path][f32 or q8] single range */
    for (int p = 0; p < 2; p++)
        for (int j = 0; j < 2; j++)
            y[p][j] = calloc(nyl, 4);
    float *ys = calloc(nyl, 4), *yc = xmalloc(ny * 4);
    if (!ys || !y[0][0] || !y[0][1] || !y[1][0] || !y[1][1]) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    char what[96];
    snprintf(what, sizeof what, "%s [%d, %d] x %d tok (pad %d), scales %d..%d",
             fmt == MF_KERN_FP4 ? "fp4" : fmt == MF_KERN_FP8 ? "fp8" : "bf16", n_out, n_in, n_tok,
             pad, e_lo, e_hi);
#define COMPACT(src) (compact(src, n_tok, n_out, ld_y, yc), yc)

    for (int p = 0; p < n_paths; p++) {
        CHECK(mf_kern_simd_set(paths[p]) == 0, "%s", mf_last_error());
        const char *pn = mf_kern_simd_name(paths[p]);
        /* fp32 path (FP4 via mf_kern_fp4_matmul_f32) */
        CHECK(run_matmul(&m, x, ld_x, n_tok, NULL, y[p][0], ld_y, 1) == 0, "%s: %s", what, mf_last_error());
        double e = rel_err(COMPACT(y[p][0]), ref, ny);
        note(fmt == MF_KERN_FP4 ? W_FP4F32 : fmt == MF_KERN_FP8 ? W_FP8 : W_BF16, e);
        CHECK(e < TOL_F32, "%s %s fp32 path: rel err %.3g > %.1g", what, pn, e, TOL_F32);
        CHECK(run_matmul(&m, x, ld_x, n_tok, NULL, ys, ld_y, 1 + n_out / 7) == 0, "%s", mf_last_error());
        CHECK(bits_equal(ys, y[p][0], nyl), "%s %s: row split changed the result", what, pn);
        if (fmt != MF_KERN_FP4)
            continue;
        /* int8 path */
        CHECK(mf_kern_q8_init(&q8[p], qbuf[p], qb, n_tok, n_in) == 0, "%s", mf_last_error());
        CHECK(mf_kern_q8_quantize(&q8[p], x, ld_x, 0, n_tok) == 0, "%s", mf_last_error());
        CHECK(run_matmul(&m, x, ld_x, n_tok, &q8[p], y[p][1], ld_y, 1) == 0, "%s: %s", what, mf_last_error());
        e = rel_err(COMPACT(y[p][1]), ref, ny);
        note(outliers ? W_FP4Q8_OUT : W_FP4Q8, e);
        CHECK(e < (outliers ? TOL_Q8_OUT : TOL_Q8), "%s %s int8 path: rel err %.3g > %.1g", what, pn, e,
              outliers ? TOL_Q8_OUT : TOL_Q8);
        if (e_hi - e_lo <= 14) {
            double *xq = xmalloc(nx * 8);
            q8_dequant(&q8[p], xq);
            ref_matmul(m.dec, n_out, n_in, xq, n_tok, refq);
            double eq = rel_err(COMPACT(y[p][1]), refq, ny);
            note(W_FP4Q8_EXACT, eq);
            CHECK(eq < TOL_F32, "%s %s int8 path vs int8-rounded ref: rel err %.3g > %.1g", what,
                  pn, eq, TOL_F32);
            free(xq);
        }
        CHECK(run_matmul(&m, x, ld_x, n_tok, &q8[p], ys, ld_y, 1 + n_out / 5) == 0, "%s", mf_last_error());
        CHECK(bits_equal(ys, y[p][1], nyl), "%s %s int8: row split changed the result", what, pn);
    }
    if (n_paths == 2) {
        CHECK(bits_equal(y[0][0], y[1][0], nyl), "%s: scalar and avx2 fp32 paths differ", what);
        if (fmt == MF_KERN_FP4) {
            CHECK(!memcmp(q8[0].q, q8[1].q, (size_t)n_tok * q8[0].row_bytes) &&
                      bits_equal(q8[0].scale, q8[1].scale, (size_t)n_tok * q8[0].n_sb),
                  "%s: scalar and avx2 quantization differ", what);
            CHECK(bits_equal(y[0][1], y[1][1], nyl), "%s: scalar and avx2 int8 paths differ", what);
        }
    }
    for (int p = 0; p < n_paths; p++)
        for (int j = 0; j < 2; j++)
            for (int t = 0; t < n_tok; t++)
                for (int o = n_out; o < ld_y; o++)
                    CHECK(y[p][j][(size_t)t * ld_y + o] == 0.0f, "%s: padding of y written", what);
#undef COMPACT
    free(yc);
    for (int p = 0; p < 2; p++) {
        free(qbuf[p]);
        free(y[p][0]);
        free(y[p][1]);
    }
    free(ys);
    free(x);
    free(xd);
    free(ref);
    free(refq);
    mat_free(&m);
}

/* The blocked GEMM path (>= MF_KERN_GEMM_MIN_TOK tokens on AVX2) against the per-row tile on the
 * same data (mf_kern_gemm_set(0)) and against one call per token (below the GEMM's threshold):
 * the same lanes and fmaf order, so bit for bit; and against the fp64 reference within TOL_F32.
 * Row counts leaving 1 or 2 rows after the 3-row tiles, odd token counts (a 1..3-token tail of the
 * 4-token blocks),
 * n_in over one 512-input tile and not a multiple of it, a random row split. */
static void case_gemm(mf_kern_fmt fmt, int n_out, int n_in, int n_tok)
{
    test_mat m;
    mat_make(&m, fmt, n_out, n_in, 118, 128);
    int ld_x = n_in + 5, ld_y = n_out + 3;
    size_t nyl = (size_t)n_tok * ld_y, ny = (size_t)n_tok * n_out;
    float *x = xmalloc((size_t)n_tok * ld_x * 4), *yc = xmalloc(ny * 4);
    double *xd = xmalloc((size_t)n_tok * n_in * 8), *ref = xmalloc(ny * 8);
    float *yg = calloc(nyl, 4), *yt = calloc(nyl, 4), *y1 = calloc(nyl, 4);
    if (!yg || !yt || !y1) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    for (int t = 0; t < n_tok; t++)
        for (int k = 0; k < ld_x; k++) {
            float v = rng_normal();
            x[(size_t)t * ld_x + k] = k < n_in ? v : NAN;
            if (k < n_in) xd[(size_t)t * n_in + k] = v;
        }
    ref_matmul(m.dec, n_out, n_in, xd, n_tok, ref);
    char what[80];
    snprintf(what, sizeof what, "gemm %s [%d, %d] x %d tok",
             fmt == MF_KERN_FP4 ? "fp4 f32" : fmt == MF_KERN_FP8 ? "fp8" : "bf16", n_out, n_in, n_tok);
    CHECK(mf_kern_simd_set(MF_KERN_SIMD_AVX2) == 0, "%s", mf_last_error());
    CHECK(run_matmul(&m, x, ld_x, n_tok, NULL, yg, ld_y, 1 + n_out / 9) == 0, "%s: %s", what, mf_last_error());
    mf_kern_gemm_set(0);
    CHECK(run_matmul(&m, x, ld_x, n_tok, NULL, yt, ld_y, 1) == 0, "%s: %s", what, mf_last_error());
    mf_kern_gemm_set(1);
    for (int t = 0; t < n_tok; t++)
        CHECK(run_matmul(&m, x + (size_t)t * ld_x, ld_x, 1, NULL, y1 + (size_t)t * ld_y, ld_y, 1) == 0, "%s: %s",
              what, mf_last_error());
    CHECK(bits_equal(yg, yt, nyl), "%s: GEMM and per-row tile differ", what);
    CHECK(bits_equal(yg, y1, nyl), "%s: GEMM and one call per token differ", what);
    compact(yg, n_tok, n_out, ld_y, yc);
    double e = rel_err(yc, ref, ny);
    note(fmt == MF_KERN_FP4 ? W_FP4F32 : fmt == MF_KERN_FP8 ? W_FP8 : W_BF16, e);
    CHECK(e < TOL_F32, "%s: rel err %.3g > %.1g", what, e, TOL_F32);
    for (int t = 0; t < n_tok; t++)
        for (int o = n_out; o < ld_y; o++) CHECK(yg[(size_t)t * ld_y + o] == 0.0f, "%s: padding of y written", what);
    free(yg);
    free(yt);
    free(y1);
    free(x);
    free(yc);
    free(xd);
    free(ref);
    mat_free(&m);
}

static double silu(double g) { return g / (1.0 + exp(-g)); }

/* The expert FFN: both phases split in random row ranges, int8 and fp32 paths (fp4) or fp8. */
static void case_ffn(mf_kern_fmt fmt, int n_hid, int n_model, int n_tok)
{
    const float limit = 10.0f;
    test_mat w1, w3, w2;
    int elo = fmt == MF_KERN_FP4 ? 119 : 117, ehi = elo + 6;
    mat_make(&w1, fmt, n_hid, n_model, elo, ehi);
    mat_make(&w3, fmt, n_hid, n_model, elo, ehi);
    mat_make(&w2, fmt, n_model, n_hid, elo, ehi);
    size_t nx = (size_t)n_tok * n_model, nh = (size_t)n_tok * n_hid;
    float *x = xmalloc(nx * 4), *tw = xmalloc((size_t)n_tok * 4);
    double *xd = xmalloc(nx * 8), *g = xmalloc(nh * 8), *u = xmalloc(nh * 8), *hd = xmalloc(nh * 8);
    double *ref = xmalloc(nx * 8);
    for (size_t i = 0; i < nx; i++)
        xd[i] = x[i] = rng_normal();
    for (int t = 0; t < n_tok; t++)
        tw[t] = (float)(0.1 + rng_unif());
    ref_matmul(w1.dec, n_hid, n_model, xd, n_tok, g);
    ref_matmul(w3.dec, n_hid, n_model, xd, n_tok, u);
    int n_clamped = 0;
    for (size_t i = 0; i < nh; i++) {
        double gv = g[i] > limit ? limit : g[i];
        double uv = u[i] > limit ? limit : u[i] < -limit ? -limit : u[i];
        n_clamped += g[i] > limit || fabs(u[i]) > limit;
        hd[i] = silu(gv) * uv * tw[i / n_hid];
    }
    ref_matmul(w2.dec, n_model, n_hid, hd, n_tok, ref);

    float *h = xmalloc(nh * 4), *h16 = xmalloc(nh * 4), *y = xmalloc(nx * 4);
    float *yq[2] = {xmalloc(nx * 4), xmalloc(nx * 4)};
    size_t qxb = mf_kern_q8_bytes(n_tok, n_model), qhb = mf_kern_q8_bytes(n_tok, n_hid);
    void *qxbuf = xmalloc(qxb), *qhbuf = xmalloc(qhb);
    mf_kern_q8 qx, qh;
    CHECK(mf_kern_q8_init(&qx, qxbuf, qxb, n_tok, n_model) == 0, "%s", mf_last_error());
    CHECK(mf_kern_q8_init(&qh, qhbuf, qhb, n_tok, n_hid) == 0, "%s", mf_last_error());
    char what[80];
    snprintf(what, sizeof what, "ffn %s hid %d model %d x %d tok (%d clamped)",
             fmt == MF_KERN_FP4 ? "fp4" : "fp8", n_hid, n_model, n_tok, n_clamped);

    for (int p = 0; p < n_paths; p++) {
        CHECK(mf_kern_simd_set(paths[p]) == 0, "%s", mf_last_error());
        for (int use_q8 = 0; use_q8 <= (fmt == MF_KERN_FP4); use_q8++) {
            float *out = use_q8 ? yq[p] : y;
            if (use_q8)
                CHECK(mf_kern_q8_quantize(&qx, x, n_model, 0, n_tok) == 0, "%s", mf_last_error());
            mf_kern_in in = {x, n_tok, n_model, use_q8 ? &qx : NULL};
            /* phase 1 in three row ranges, the between-phase quantization, phase 2 in two */
            int a = n_hid / 3, b = 2 * n_hid / 3;
            CHECK(mf_kern_ffn_up(&w1.m, &w3.m, &in, tw, limit, h, n_hid, 0, a) == 0, "%s", mf_last_error());
            CHECK(mf_kern_ffn_up(&w1.m, &w3.m, &in, tw, limit, h, n_hid, b, n_hid) == 0, "%s", mf_last_error());
            CHECK(mf_kern_ffn_up(&w1.m, &w3.m, &in, tw, limit, h, n_hid, a, b) == 0, "%s", mf_last_error());
            /* the same rows 16 at a time (the step's rows, whatever a call's range): the same bits */
            for (int r = 0; r < n_hid; r += 16)
                CHECK(mf_kern_ffn_up(&w1.m, &w3.m, &in, tw, limit, h16, n_hid, r, r + 16 < n_hid ? r + 16 : n_hid) == 0,
                      "%s", mf_last_error());
            CHECK(bits_equal(h, h16, nh), "%s %s: phase 1 by 16 rows differs from three ranges", what,
                  mf_kern_simd_name(paths[p]));
            if (use_q8)
                CHECK(mf_kern_q8_quantize(&qh, h, n_hid, 0, n_tok) == 0, "%s", mf_last_error());
            mf_kern_in hin = {h, n_tok, n_hid, use_q8 ? &qh : NULL};
            CHECK(mf_kern_ffn_down(&w2.m, &hin, out, n_model, n_model / 2, n_model) == 0, "%s", mf_last_error());
            CHECK(mf_kern_ffn_down(&w2.m, &hin, out, n_model, 0, n_model / 2) == 0, "%s", mf_last_error());
            double e = rel_err(out, ref, nx);
            double tol = use_q8 ? TOL_FFN_Q8 : TOL_F32 * 10;
            note(fmt == MF_KERN_FP8 ? W_FFN_FP8 : use_q8 ? W_FFN_Q8 : W_FFN_F32, e);
            CHECK(e < tol, "%s %s %s: rel err %.3g > %.1g", what, mf_kern_simd_name(paths[p]),
                  use_q8 ? "int8" : "fp32", e, tol);
        }
    }
    if (n_paths == 2 && fmt == MF_KERN_FP4)
        CHECK(bits_equal(yq[0], yq[1], nx), "%s: scalar and avx2 int8 FFN differ", what);
    free(x), free(tw), free(xd), free(g), free(u), free(hd), free(ref), free(h), free(h16), free(y);
    free(yq[0]), free(yq[1]), free(qxbuf), free(qhbuf);
    mat_free(&w1), mat_free(&w3), mat_free(&w2);
}

/* A NaN scale (E8M0 0xFF) makes its row NaN on every path; bad arguments are refused. */
/* E4M3 codes under every kind of E8M0 scale (subnormal 2^-127, small, ordinary, the largest the
 * one-token path folds, 247..254 where 2^8 * scale overflows, NaN), one 32x32 tile per scale: rows
 * of positive non-NaN codes (finite or +inf sums, so a wrong value shows) and a last row holding a
 * NaN code. The one-token call (AVX2's register path) against the scalar path and against the same
 * rows taken by the tile engine inside a two-token call, bit for bit (NaN as NaN). */
static void case_fp8_codes(void)
{
    enum { N = 32 };
    static const uint8_t scales[] = {0, 1, 7, 100, 127, 140, 246, 247, 250, 254, 255};
    uint8_t w[N * N], sc[1];
    float x[2 * N], y[3][2 * N];
    for (int i = 0; i < 2 * N; i++) x[i] = 0.5f + (float)rng_unif();
    for (size_t c = 0; c < sizeof scales; c++) {
        for (int i = 0; i < N * N; i++) {
            uint8_t v;
            do v = (uint8_t)(rng_next() & 0x7F);
            while (v == 0x7F);
            w[i] = v;
        }
        w[(N - 1) * N + (int)(rng_next() % N)] = (uint8_t)(0x7F | (rng_next() & 0x80));
        sc[0] = scales[c];
        for (int p = 0; p < n_paths; p++) {
            CHECK(mf_kern_simd_set(paths[p]) == 0, "%s", mf_last_error());
            CHECK(mf_kern_fp8_matmul(w, sc, N, N, x, 1, N, y[p], N, 0, N) == 0, "%s", mf_last_error());
        }
        if (n_paths < 2) continue;
        CHECK(bits_equal(y[0], y[1], N), "fp8 codes, scale %d: one token, scalar and avx2 differ", scales[c]);
        CHECK(mf_kern_fp8_matmul(w, sc, N, N, x, 2, N, y[2], N, 0, N) == 0, "%s", mf_last_error());
        CHECK(bits_equal(y[1], y[2], N), "fp8 codes, scale %d: one-token path and tile engine differ", scales[c]);
        CHECK(isnan(y[1][N - 1]) && (scales[c] == 255 || !isnan(y[1][0])), "fp8 codes, scale %d: NaN rows",
              scales[c]);
    }
    mf_kern_simd_set(MF_KERN_SIMD_AUTO);
}

/* The FP8 one-token loop with AVX-512 (where the CPU has it) against the AVX2 one and the tile
 * engine, bit for bit: 96 x 1024 random codes (NaN codes in two rows' blocks, subnormals), scales
 * 100..140 with a few above 246 in the last tile row (the fallback blocks), x of mixed sign and
 * magnitude; rows [3, 94)
 * so the pairs start odd and a single row ends. */
static void case_fp8_avx512(void)
{
    enum { O = 96, I = 1024 };
    uint8_t *w = malloc(O * I), sc[(O / 32) * (I / 32)];
    float x[2 * I], y[3][2 * O];   /* y[2]: the two-token call's rows, two of O */
    for (int i = 0; i < O * I; i++) {   /* every code but NaN, then NaN codes in rows 5 and 40 */
        w[i] = (uint8_t)rng_next();
        if ((w[i] & 0x7F) == 0x7F) w[i] ^= 1;
    }
    w[5 * I + 64] = 0x7F;
    w[40 * I + 900] = 0xFF;
    for (int i = 0; i < (int)sizeof sc; i++)   /* scales above 246 in the last tile row only */
        sc[i] = (uint8_t)(i / 32 == 2 && i % 11 == 5 ? 247 + i % 8 : 100 + (int)(rng_next() % 41));
    for (int i = 0; i < 2 * I; i++) x[i] = (float)(rng_unif() * 2 - 1) * (i % 7 == 0 ? 100.0f : 1.0f);
    int has = mf_kern_fp8_tok1_avx512();
    printf("fp8 one-token loop: AVX-512 %s on this CPU\n", has ? "used" : "not available");
    mf_kern_tok1_set_avx512(0);
    CHECK(!mf_kern_fp8_tok1_avx512(), "the AVX-512 loop could not be turned off");
    CHECK(mf_kern_fp8_matmul(w, sc, O, I, x, 1, I, y[0], O, 3, 94) == 0, "%s", mf_last_error());
    mf_kern_tok1_set_avx512(1);
    CHECK(mf_kern_fp8_tok1_avx512() == has, "the AVX-512 loop's switch");
    CHECK(mf_kern_fp8_matmul(w, sc, O, I, x, 1, I, y[1], O, 3, 94) == 0, "%s", mf_last_error());
    CHECK(mf_kern_fp8_matmul(w, sc, O, I, x, 2, I, y[2], O, 3, 94) == 0, "%s", mf_last_error());   /* tile engine */
    CHECK(bits_equal(y[0] + 3, y[1] + 3, 91), "fp8 one token: AVX-512 and AVX2 loops differ");
    CHECK(bits_equal(y[1] + 3, y[2] + 3, 91), "fp8 one token: AVX-512 loop and tile engine differ");
    int finite = 0;   /* NaN codes make rows 5 and 40 NaN; scales above 246 may overflow rows 64.. */
    for (int i = 3; i < 64; i++) finite += isfinite(y[1][i]) != 0;
    CHECK(isnan(y[1][5]) && isnan(y[1][40]) && finite == 59, "fp8 one token: NaN rows (%d of rows 3..63 finite, 59 expected)",
          finite);
    free(w);
}

/* The FP8 one-token loops scale x once per 32-row tile and fall back block by block where that
 * product is not exact. Tile rows of scale codes {0, 1, 2, 60, 119, 127, 200, 230}, {240, 245,
 * 246, 247, 252, 100, 130, 10} and all 0, against x whose block 0 is near FLT_MIN (rounded into
 * the subnormals under code 0), block 1 subnormal (scaled down under 1, up under 245), block 2 near
 * FLT_MAX (exact under 2, past FLT_MAX under 246: the second tile's rows overflow), signed zeros
 * throughout; then with an infinity; then a NaN; then x all about 2^-10, which code 0 scales into
 * the subnormals while the third tile's sums stay there, where a rounded product shows (the
 * second tile's codes 246 and 252 overflow its rows). The AVX2
 * and AVX-512 loops and the scalar path against the tile engine (a two-token call), bit for bit
 * (NaN as NaN), rows [1, 95) so a tile starts with a single row. */
static void case_fp8_xs(void)
{
    enum { O = 96, I = 256, NB = I / 32 };
    static const uint8_t sc[(O / 32) * NB] = {0, 1, 2, 60, 119, 127, 200, 230, 240, 245, 246, 247, 252, 100, 130, 10};
    uint8_t w[O * I];
    float x[2 * I], y[4][2 * O];
    for (int i = 0; i < O * I; i++) {
        w[i] = (uint8_t)rng_next();
        if ((w[i] & 0x7F) == 0x7F) w[i] ^= 1;
    }
    for (int v = 0; v < 4; v++) {
        for (int i = 0; i < 2 * I; i++) {
            float r = (float)(rng_unif() * 2 - 1);
            int b = i % I / 32;
            x[i] = v == 3 ? r * 0x1p-10f
                 : i % 7 == 3 ? (i % 2 ? -0.0f : 0.0f) : b == 0 ? r * 2e-37f : b == 1 ? r * 1e-39f : b == 2 ? r * 3e38f : r;
        }
        if (v == 1) x[3 * 32 + 5] = -INFINITY;
        if (v == 2) x[5 * 32 + 17] = NAN;
        mf_kern_tok1_set_avx512(0);
        CHECK(mf_kern_fp8_matmul(w, sc, O, I, x, 1, I, y[0], O, 1, O - 1) == 0, "%s", mf_last_error());
        mf_kern_tok1_set_avx512(1);
        CHECK(mf_kern_fp8_matmul(w, sc, O, I, x, 1, I, y[1], O, 1, O - 1) == 0, "%s", mf_last_error());
        CHECK(mf_kern_fp8_matmul(w, sc, O, I, x, 2, I, y[2], O, 1, O - 1) == 0, "%s", mf_last_error());
        mf_kern_simd_set(MF_KERN_SIMD_SCALAR);
        CHECK(mf_kern_fp8_matmul(w, sc, O, I, x, 1, I, y[3], O, 1, O - 1) == 0, "%s", mf_last_error());
        mf_kern_simd_set(MF_KERN_SIMD_AUTO);
        if (n_paths < 2) continue;
        CHECK(bits_equal(y[0] + 1, y[2] + 1, O - 2), "fp8 x variant %d: AVX2 one-token loop and tile engine differ", v);
        CHECK(bits_equal(y[1] + 1, y[2] + 1, O - 2), "fp8 x variant %d: AVX-512 one-token loop and tile engine differ", v);
        CHECK(bits_equal(y[3] + 1, y[2] + 1, O - 2), "fp8 x variant %d: scalar path and tile engine differ", v);
        int finite[3] = {0, 0, 0};   /* per tile: rows [1, 32), [32, 64), [64, 95) */
        for (int i = 1; i < O - 1; i++) finite[i / 32] += isfinite(y[1][i]) != 0;
        CHECK(v == 1 || v == 2 ? finite[0] + finite[1] + finite[2] == 0 : finite[0] == 31 && finite[1] < 32 && finite[2] == 31,
              "fp8 x variant %d: %d, %d, %d rows of the three tiles finite", v, finite[0], finite[1], finite[2]);
    }
}

/* The FP4 one-token loop on AVX-512 (VNNI, VBMI; where the CPU has them) against the AVX2 loop and
 * the scalar path, bit for bit: inputs of 256 (one group), 768 and 2,304 (a quad and one or two
 * groups after it: the demo's and flash41's w2) and 5,120 (five quads), scale codes spread so that
 * some blocks are 15 or more binades under their group's largest (factor 0), a NaN scale in one
 * row, an all-zero group of x, rows [2, 37). */
static void case_fp4_avx512(void)
{
    static const int n_ins[] = {256, 768, 2304, 5120};
    enum { O = 40 };
    int has = mf_kern_fp4_tok1_avx512();
    printf("fp4 one-token loop: AVX-512 %s on this CPU\n", has ? "used" : "not available");
    for (size_t c = 0; c < sizeof n_ins / sizeof n_ins[0]; c++) {
        int I = n_ins[c], nb = I / 32;
        test_mat m;
        mat_make(&m, MF_KERN_FP4, O, I, 100, 140);
        for (int i = 0; i < O * nb; i++)
            if (i % 13 == 4) m.scale[i] = (uint8_t)(rng_next() % 90);   /* far under the group's largest */
        m.scale[7 * nb + nb / 2] = 0xFF;
        float *x = xmalloc((size_t)I * 4), y[3][O];
        for (int i = 0; i < I; i++) x[i] = i >= 256 && i < 512 ? 0.0f : rng_normal() * (i % 5 ? 1.0f : 30.0f);
        size_t qb = mf_kern_q8_bytes(1, I);
        void *qbuf = xmalloc(qb);
        mf_kern_q8 q;
        CHECK(mf_kern_q8_init(&q, qbuf, qb, 1, I) == 0 && mf_kern_q8_quantize(&q, x, I, 0, 1) == 0, "%s", mf_last_error());
        mf_kern_tok1_set_avx512(0);
        CHECK(!mf_kern_fp4_tok1_avx512(), "the FP4 AVX-512 loop could not be turned off");
        CHECK(mf_kern_fp4_matmul(m.w, m.scale, O, I, &q, y[0], O, 2, 37) == 0, "%s", mf_last_error());
        mf_kern_tok1_set_avx512(1);
        CHECK(mf_kern_fp4_tok1_avx512() == has, "the FP4 AVX-512 loop's switch");
        CHECK(mf_kern_fp4_matmul(m.w, m.scale, O, I, &q, y[1], O, 2, 37) == 0, "%s", mf_last_error());
        mf_kern_simd_set(MF_KERN_SIMD_SCALAR);
        CHECK(mf_kern_q8_quantize(&q, x, I, 0, 1) == 0, "%s", mf_last_error());
        CHECK(mf_kern_fp4_matmul(m.w, m.scale, O, I, &q, y[2], O, 2, 37) == 0, "%s", mf_last_error());
        mf_kern_simd_set(MF_KERN_SIMD_AUTO);
        if (n_paths == 2) {
            CHECK(bits_equal(y[0] + 2, y[1] + 2, 35), "fp4 one token, n_in %d: AVX-512 and AVX2 loops differ", I);
            CHECK(bits_equal(y[2] + 2, y[1] + 2, 35), "fp4 one token, n_in %d: AVX-512 loop and scalar path differ", I);
        }
        int nan = 0;
        for (int o = 2; o < 37; o++) nan += isnan(y[1][o]) != 0;
        CHECK(isnan(y[1][7]) && nan == 1, "fp4 one token, n_in %d: %d NaN rows (row 7 alone expected)", I, nan);
        free(x), free(qbuf);
        mat_free(&m);
    }
}

static void case_edges(void)
{
    test_mat m;
    mat_make(&m, MF_KERN_FP4, 4, 512, 120, 126);
    m.scale[1 * 16 + 3] = 0xFF;   /* row 1, block 3 */
    float x[512], y[4];
    for (int i = 0; i < 512; i++)
        x[i] = rng_normal();
    _Alignas(32) uint8_t qbuf[2048];
    mf_kern_q8 q;
    CHECK(mf_kern_q8_bytes(1, 512) <= sizeof qbuf, "q8 size");
    CHECK(mf_kern_q8_init(&q, qbuf, sizeof qbuf, 1, 512) == 0, "%s", mf_last_error());
    for (int p = 0; p < n_paths; p++) {
        mf_kern_simd_set(paths[p]);
        mf_kern_q8_quantize(&q, x, 512, 0, 1);
        CHECK(mf_kern_fp4_matmul(m.w, m.scale, 4, 512, &q, y, 4, 0, 4) == 0, "%s", mf_last_error());
        CHECK(isnan(y[1]) && !isnan(y[0]) && !isnan(y[2]), "NaN scale: %g %g %g", y[0], y[1], y[2]);
        CHECK(mf_kern_fp4_matmul_f32(m.w, m.scale, 4, 512, x, 1, 512, y, 4, 0, 4) == 0, "%s", mf_last_error());
        CHECK(isnan(y[1]) && !isnan(y[0]) && !isnan(y[2]), "NaN scale fp32: %g %g %g", y[0], y[1], y[2]);
        /* an all-zero input group: scale 0, outputs exactly 0 */
        float z[512] = {0};
        mf_kern_q8_quantize(&q, z, 512, 0, 1);
        CHECK(mf_kern_fp4_matmul(m.w, m.scale, 4, 512, &q, y, 4, 0, 1) == 0 && y[0] == 0.0f, "zero input");
    }
    /* the two integer schemes give the same bits: 5 tokens stored as signed codes (a hand-made
     * view; init picks +128 for 5) against the usual +128 codes */
    {
        test_mat m5;
        mat_make(&m5, MF_KERN_FP4, 9, 800, 118, 130);
        float x5[5 * 800], ya[5 * 9], yb[5 * 9];
        for (int i = 0; i < 5 * 800; i++)
            x5[i] = rng_normal();
        size_t qb5 = mf_kern_q8_bytes(5, 800);
        void *b5 = xmalloc(qb5);
        mf_kern_q8 q5;
        for (int p = 0; p < n_paths; p++) {
            mf_kern_simd_set(paths[p]);
            CHECK(mf_kern_q8_init(&q5, b5, qb5, 5, 800) == 0 && q5.offset == 128, "q8 init 5");
            mf_kern_q8_quantize(&q5, x5, 800, 0, 5);
            CHECK(mf_kern_fp4_matmul(m5.w, m5.scale, 9, 800, &q5, ya, 9, 0, 9) == 0, "%s", mf_last_error());
            q5.offset = 0;
            mf_kern_q8_quantize(&q5, x5, 800, 0, 5);
            CHECK(mf_kern_fp4_matmul(m5.w, m5.scale, 9, 800, &q5, yb, 9, 0, 9) == 0, "%s", mf_last_error());
            CHECK(bits_equal(ya, yb, 45), "%s: signed and +128 codes differ",
                  mf_kern_simd_name(paths[p]));
        }
        free(b5);
        mat_free(&m5);
    }
    CHECK(mf_kern_fp4_matmul_f32(m.w, m.scale, 4, 500, x, 1, 512, y, 4, 0, 4) == -EINVAL, "n_in 500");
    CHECK(strstr(mf_last_error(), "multiple of 32") != NULL, "message: %s", mf_last_error());
    CHECK(mf_kern_fp8_matmul(m.w, m.scale, 4, 512, x, 1, 512, y, 4, 2, 5) == -EINVAL, "range");
    CHECK(mf_kern_bf16_matmul(NULL, 4, 512, x, 1, 512, y, 4, 0, 4) == -EINVAL, "NULL");
    CHECK(mf_kern_q8_quantize(&q, x, 512, 0, 2) == -EINVAL, "token range");
    CHECK(mf_kern_q8_init(&q, qbuf, 10, 1, 512) == -EINVAL, "small buffer");
    mat_free(&m);
}

/* mf_kern_vec_bf16_round, _pack and _unpack on every path: mf_bf16_round's bits for random bit patterns (NaNs, infs,
 * subnormals, ties among them), lengths that leave a tail of 0..7 */
static void test_bf16_round(const mf_kern_simd *paths, int n_paths)
{
    enum { N = 1 << 16 };
    float *x = xmalloc(sizeof(float) * N), *y = xmalloc(sizeof(float) * N), *z = xmalloc(sizeof(float) * N);
    uint16_t *code = xmalloc(sizeof(uint16_t) * N);
    static const uint32_t special[] = {0x7F800000u, 0xFF800000u, 0x7FC00001u, 0xFF800001u, 0x7F7FFFFFu, 0x00000001u,
                                       0x80008000u, 0x3F808000u, 0x3F818000u, 0x7F7F8000u, 0x00000000u, 0x80000000u};
    int same = 1, packed = 1;
    for (int p = 0; p < n_paths; p++) {
        CHECK(mf_kern_simd_set(paths[p]) == 0, "%s", mf_last_error());
        for (int rep = 0; rep < 4; rep++) {
            for (int i = 0; i < N; i++) {
                uint32_t b = (uint32_t)rng_next();
                if (i % 5 == 0) b = (b & 0xFFFF0000u) | 0x8000u;   /* ties */
                if (i < (int)(sizeof special / sizeof special[0])) b = special[i];
                memcpy(&x[i], &b, 4);
            }
            int n = N - rep * 3;
            memcpy(y, x, sizeof(float) * N);
            mf_kern_vec_bf16_round(y, n);
            for (int i = 0; i < N; i++) {
                float want = i < n ? mf_bf16_round(x[i]) : x[i];
                same &= !memcmp(&want, &y[i], 4);
            }
            /* pack: mf_bf16_from_f32's codes; unpack of them: the rounding's bits (tail untouched) */
            for (int i = 0; i < N; i++) code[i] = 0x5A5A;
            mf_kern_vec_bf16_pack(x, code, n);
            for (int i = 0; i < N; i++) packed &= code[i] == (i < n ? mf_bf16_from_f32(x[i]) : 0x5A5A);
            memcpy(z, x, sizeof(float) * N);
            mf_kern_vec_bf16_unpack(code, z, n);
            packed &= !memcmp(z, y, sizeof(float) * N);
        }
        CHECK(same, "%s: mf_kern_vec_bf16_round differs from mf_bf16_round", mf_kern_simd_name(paths[p]));
        CHECK(packed, "%s: mf_kern_vec_bf16_pack/unpack differ from mf_bf16_from_f32/mf_bf16_round",
              mf_kern_simd_name(paths[p]));
    }
    mf_kern_simd_set(MF_KERN_SIMD_AUTO);
    free(x);
    free(y);
    free(z);
    free(code);
}

/* mf_kern_vec_dots_lanes: a vector read in pieces (multiples of 16, the last any length), its lanes
 * carried, gives mf_kern_vec_dots' bits through mf_kern_vec_lanes_sum, for 1..4 queries and 1..7
 * keys (threes and the rest), lengths that are and are not multiples of 16, on every path, with a
 * NaN, an inf, products that overflow and subnormals among the inputs; the paths' bits agree. */
static void test_vec_lanes(const mf_kern_simd *paths, int n_paths)
{
    enum { NMAX = 1300, NK = 7 };
    static const int lens[] = {16, 48, 512, 1296, 37, 1299};
    float *q = xmalloc(sizeof(float) * 4 * NMAX), *k = xmalloc(sizeof(float) * NK * NMAX);
    float lanes[2][4 * NK * 16];
    int same = 1, agree = 1;
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        int n = lens[li];
        for (int i = 0; i < 4 * NMAX; i++) q[i] = rng_normal();
        for (int i = 0; i < NK * NMAX; i++) k[i] = rng_normal();
        if (li == 3) {   /* specials (one NaN bit pattern: which NaN wins is no matter) */
            q[NMAX + 5] = NAN, q[2 * NMAX + 40] = -INFINITY, q[3 * NMAX + 7] = 3e38f, k[3 * NMAX + 7] = 4.0f;
            k[2 * NMAX + 3] = 1e-40f, q[9] = 1e-41f;
        }
        const float *qp[4] = {q, q + NMAX, q + 2 * NMAX, q + 3 * NMAX}, *kp[NK];
        for (int j = 0; j < NK; j++) kp[j] = k + (size_t)j * NMAX;
        for (int p = 0; p < n_paths; p++) {
            CHECK(mf_kern_simd_set(paths[p]) == 0, "%s", mf_last_error());
            for (int G = 1; G <= 4; G++)
                for (int nk = 1; nk <= NK; nk += 2) {
                    float *acc = lanes[p];
                    memset(acc, 0, sizeof lanes[p]);
                    for (int c0 = 0; c0 < n;) {   /* pieces of 16..256 elements, in 16s */
                        int w = 16 * (1 + (int)(rng_next() % 16));
                        if (w > n - c0) w = n - c0;
                        const float *qc[4], *kc[NK];
                        for (int g = 0; g < G; g++) qc[g] = qp[g] + c0;
                        for (int j = 0; j < nk; j++) kc[j] = kp[j] + c0;
                        mf_kern_vec_dots_lanes(qc, G, kc, nk, w, acc, nk);
                        c0 += w;
                    }
                    for (int j = 0; j < nk; j++) {
                        float want[4];
                        mf_kern_vec_dots(qp, G, kp[j], n, want);
                        for (int g = 0; g < G; g++) {
                            float got = mf_kern_vec_lanes_sum(acc + ((size_t)g * nk + j) * 16);
                            same &= !memcmp(&got, &want[g], 4);
                        }
                    }
                    if (p == 1 && G == 4 && nk == NK) agree &= !memcmp(lanes[0], lanes[1], sizeof lanes[0]);
                }
        }
    }
    CHECK(same, "mf_kern_vec_dots_lanes in pieces differs from mf_kern_vec_dots");
    CHECK(agree, "mf_kern_vec_dots_lanes: the AVX2 lanes differ from the scalar ones");
    mf_kern_simd_set(MF_KERN_SIMD_AUTO);
    free(q);
    free(k);
}

/* The BF16 one-token loop with and without its L2 prefetch (mf_kern_bf16_tok1_set_prefetch): the
 * same bits; left to measure, 20 calls over 4.3 MB settle on one of them with the same bits. */
static void case_bf16_prefetch(void)
{
    if (mf_kern_simd_active() != MF_KERN_SIMD_AVX2) return;
    enum { R = 2112, C = 1024 };
    uint16_t *w = malloc(sizeof(uint16_t) * R * C);
    float *x = malloc(sizeof(float) * C), *y[3];
    for (int k = 0; k < 3; k++) y[k] = malloc(sizeof(float) * R);
    for (int64_t i = 0; i < (int64_t)R * C; i++) w[i] = mf_bf16_from_f32(rng_normal());
    for (int i = 0; i < C; i++) x[i] = rng_normal();
    for (int pf = 0; pf < 2; pf++) {
        mf_kern_bf16_tok1_set_prefetch(pf);
        CHECK(mf_kern_bf16_tok1_prefetch() == pf, "prefetch %d not set", pf);
        CHECK(mf_kern_bf16_matmul(w, R, C, x, 1, C, y[pf], R, 0, R) == 0, "%s", mf_last_error());
    }
    CHECK(bits_equal(y[0], y[1], R), "bf16 one token: the prefetching loop's bits differ");
    mf_kern_bf16_tok1_set_prefetch(-1);
    CHECK(mf_kern_bf16_tok1_prefetch() == -1, "measuring not restarted");
    for (int k = 0; k < 20; k++) {
        memset(y[2], 0, sizeof(float) * R);
        CHECK(mf_kern_bf16_matmul(w, R, C, x, 1, C, y[2], R, 0, R) == 0, "%s", mf_last_error());
        CHECK(bits_equal(y[0], y[2], R), "bf16 one token, measuring call %d: bits differ", k);
    }
    int pf = mf_kern_bf16_tok1_prefetch();
    CHECK(pf == 0 || pf == 1, "20 calls of %d bytes left the prefetch unchosen (%d)", R * C * 2, pf);
    printf("test_kernels: the BF16 one-token loop here: prefetch %s (measured)\n", pf == 1 ? "on" : "off");
    free(w);
    free(x);
    for (int k = 0; k < 3; k++) free(y[k]);
}

/* The BF16 few-token loop (2..8 tokens with AVX-512: a speculative verify's head) against the tile
 * engine (AVX-512 switched off): the same bits, at odd row ranges and input strides. */
static void case_bf16_tokn(void)
{
    if (mf_kern_simd_active() != MF_KERN_SIMD_AVX2 || !mf_kern_fp8_tok1_avx512()) return;
    enum { R = 301, C = 1088, LD = 1100 };
    uint16_t *w = malloc(sizeof(uint16_t) * R * C);
    float *x = malloc(sizeof(float) * 9 * LD), *y[2];
    for (int k = 0; k < 2; k++) y[k] = malloc(sizeof(float) * 9 * R);
    for (int64_t i = 0; i < (int64_t)R * C; i++) w[i] = mf_bf16_from_f32(rng_normal());
    for (int i = 0; i < 9 * LD; i++) x[i] = rng_normal();
    int same = 1;
    for (int n = 2; n <= 9; n++)
        for (int k = 0; k < 2; k++) {
            mf_kern_tok1_set_avx512(k);   /* 0: the tile engine; 1: the few-token loop (as the CPU allows) */
            memset(y[k], 0, sizeof(float) * 9 * R);
            CHECK(mf_kern_bf16_matmul(w, R, C, x, n, LD, y[k], R, 3, R - 2) == 0, "%s", mf_last_error());
            if (k) same &= bits_equal(y[0], y[1], 9 * R);
        }
    CHECK(same, "bf16 2..9 tokens: the few-token loop's bits differ from the tile engine's");
    mf_kern_tok1_set_avx512(1);
    free(w);
    free(x);
    for (int k = 0; k < 2; k++) free(y[k]);
}

int main(void)
{
    const char *env = getenv("MOEFLOW_TEST_SEED");
    uint64_t seed = env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)clock() << 32);
    rng_state = seed;
    printf("test_kernels: seed %llu (MOEFLOW_TEST_SEED=%llu repeats this run)\n",
           (unsigned long long)seed, (unsigned long long)seed);

    /* the setting: SCALAR forces the fallback (the moeflow command maps MOEFLOW_SIMD=scalar to
     * it); AUTO, the default, is the run-time choice; the library reads no environment */
    CHECK(mf_kern_simd_set(MF_KERN_SIMD_SCALAR) == 0, "%s", mf_last_error());
    CHECK(mf_kern_simd_active() == MF_KERN_SIMD_SCALAR, "SCALAR setting ignored");
    setenv("MOEFLOW_SIMD", "scalar", 1);   /* must not matter any more */
    CHECK(mf_kern_simd_set(MF_KERN_SIMD_AUTO) == 0, "%s", mf_last_error());
    unsigned ca, cb, cc, cd;   /* F16C: cpuid leaf 1, ECX bit 29 (clang 14 lacks the builtin) */
    int have_f16c = __get_cpuid(1, &ca, &cb, &cc, &cd) && (cc & (1u << 29));
    int have_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && have_f16c;
    CHECK(mf_kern_simd_active() == (have_avx2 ? MF_KERN_SIMD_AVX2 : MF_KERN_SIMD_SCALAR),
          "auto chose %s (MOEFLOW_SIMD=scalar in the environment must be ignored by the library)",
          mf_kern_simd_name(mf_kern_simd_active()));
    unsetenv("MOEFLOW_SIMD");
    CHECK(mf_kern_simd_set((mf_kern_simd)7) == -EINVAL, "an unknown path was accepted");
    /* the moeflow command turns the environment into the setting (its --help names the path) */
    const char *bin = getenv("MOEFLOW_BIN");
    if (bin) {
        static const struct { const char *env, *want; int rc; } cli[] = {
            {"scalar", "(now: scalar)", 0}, {"auto", NULL, 0}, {"bogus", NULL, 2}};
        for (size_t i = 0; i < sizeof cli / sizeof cli[0]; i++) {
            char cmd[1024], out[4096] = "";
            snprintf(cmd, sizeof cmd, "MOEFLOW_SIMD=%s '%s' --help 2>&1", cli[i].env, bin);
            FILE *f = popen(cmd, "r");
            CHECK(f != NULL, "popen %s", cmd);
            if (!f) continue;
            size_t n = fread(out, 1, sizeof out - 1, f);
            out[n] = 0;
            int st = pclose(f);
            int rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
            CHECK(rc == cli[i].rc, "MOEFLOW_SIMD=%s moeflow --help: exit %d, expected %d", cli[i].env, rc,
                  cli[i].rc);
            CHECK(!cli[i].want || strstr(out, cli[i].want), "MOEFLOW_SIMD=%s: '%s' not in: %s",
                  cli[i].env, cli[i].want, out);
        }
    } else {
        printf("test_kernels: MOEFLOW_BIN unset, the command's MOEFLOW_SIMD not checked\n");
    }

    paths[n_paths++] = MF_KERN_SIMD_SCALAR;
    if (mf_kern_simd_set(MF_KERN_SIMD_AVX2) == 0)
        paths[n_paths++] = MF_KERN_SIMD_AVX2;
    else
        printf("test_kernels: no AVX2+FMA here, scalar path only (%s)\n", mf_last_error());

    test_bf16_round(paths, n_paths);
    test_vec_lanes(paths, n_paths);
    static const int toks[] = {1, 2, 3, 8, 17, 64, 71};   /* 71: two token passes */
    for (size_t i = 0; i < sizeof toks / sizeof toks[0]; i++) {
        int nt = toks[i];
        int out = (int)(i & 1);
        case_matmul(MF_KERN_FP4, 37, 352, nt, 118, 130, out);   /* 11 blocks: 3-block tail group */
        case_matmul(MF_KERN_FP4, 70, 512, nt, 100, 140, out);   /* wide spread: flushed blocks */
        case_matmul(MF_KERN_FP8, 45, 320, nt, 115, 130, out);   /* a partial 32-row scale tile */
        case_matmul(MF_KERN_BF16, 33, 96, nt, 0, 0, out);
    }
    case_matmul(MF_KERN_FP4, 64, 2304, 3, 120, 130, 0);         /* w2's n_in: 72 blocks */
    case_matmul(MF_KERN_FP4, 16, 5120, 17, 120, 130, 1);        /* w1/w3's n_in */
    case_matmul(MF_KERN_FP8, 40, 1280, 8, 120, 127, 0);
    /* one token over several 512-input tiles and a partial one (the batch-1 register paths) */
    case_matmul(MF_KERN_FP8, 67, 1056, 1, 110, 135, 0);
    case_matmul(MF_KERN_BF16, 37, 1312, 1, 0, 0, 1);
    case_bf16_prefetch();
    case_bf16_tokn();
    case_ffn(MF_KERN_FP4, 96, 256, 5);
    case_ffn(MF_KERN_FP4, 160, 544, 64);
    case_ffn(MF_KERN_FP4, 64, 256, 67);                      /* two token passes */
    case_ffn(MF_KERN_FP8, 64, 320, 3);
    /* one and two tokens: phase-1 steps of 1,024 and 512 rows, a range spanning two of them */
    case_ffn(MF_KERN_FP4, 3264, 256, 1);
    case_ffn(MF_KERN_FP4, 1632, 256, 2);
    case_ffn(MF_KERN_FP8, 3264, 256, 1);
    case_edges();
    case_fp8_codes();
    case_fp8_avx512();
    case_fp8_xs();
    case_fp4_avx512();
    if (n_paths == 2) {
        static const int gt[] = {MF_KERN_GEMM_MIN_TOK, 19, 64, 71};
        for (size_t i = 0; i < sizeof gt / sizeof gt[0]; i++) {
            case_gemm(MF_KERN_FP8, 45, 800, gt[i]);
            case_gemm(MF_KERN_BF16, 33, 1056, gt[i]);
            case_gemm(MF_KERN_FP4, 18, 544, gt[i]);
            case_gemm(MF_KERN_BF16, 38, 544, gt[i]);   /* 4 x 9 + 2: a pair after the triples */
            case_gemm(MF_KERN_FP8, 37, 1024, gt[i]);   /* 4 x 9 + 1: a single row after them */
        }
    } else {
        printf("test_kernels: no AVX2, the GEMM path is not checked\n");
    }
    mf_kern_simd_set(MF_KERN_SIMD_AUTO);

    printf("test_kernels: max relative errors (float64 norm) over all cases and paths:\n");
    for (int i = 0; i < N_WORST; i++)
        printf("  %-32s %.3g\n", worst_name[i], worst[i]);
    return mf_check_exit("test_kernels");
}
