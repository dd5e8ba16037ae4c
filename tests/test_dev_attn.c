/* mf_dev_attn_heads (device/dev.h), the attention core of long prefill chunks on a card: on
 * emulated cards bit for bit what the host's attention computes with the same keys (host/kernels.h
 * mf_kern_vec_attn per group of heads, then the division and bf16 rounding, as
 * graphs/step/fast_attn.c mf_fa_attn_heads), and within a stated tolerance of a plain double
 * reference, on fresh random data, shapes and key lists; its argument and key-range errors; on a
 * CUDA card (when there is one) the same tolerance, else that part reports SKIP. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "device/dev.h"
#include "host/formats.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/num.h"

typedef struct attn_case {
    int n_tok, n_heads, D;
    int64_t n_kv;
    int max_keys;
} attn_case;

typedef struct attn_data {
    attn_case c;
    float *q, *kv, *sink, *o_host;
    int32_t *keys, *n_keys;
} attn_data;

/* Random queries, keys and sinks; token t's keys: a window of consecutive rows ending at a random
 * row, then random other rows (a selection), some tokens none. */
static void attn_fill(attn_data *a, uint64_t seed)
{
    attn_case *c = &a->c;
    size_t w = (size_t)c->n_heads * c->D;
    a->q = malloc(sizeof(float) * c->n_tok * w);
    a->o_host = malloc(sizeof(float) * c->n_tok * w);
    a->kv = malloc(sizeof(float) * (size_t)c->n_kv * c->D);
    a->sink = malloc(sizeof(float) * c->n_heads);
    a->keys = calloc((size_t)c->n_tok * c->max_keys, sizeof(int32_t));
    a->n_keys = malloc(sizeof(int32_t) * c->n_tok);
    for (size_t i = 0; i < c->n_tok * w; i++) a->q[i] = mf_bf16_round(mf_test_frand(&seed) * 2.0f);
    for (size_t i = 0; i < (size_t)c->n_kv * c->D; i++) a->kv[i] = mf_bf16_round(mf_test_frand(&seed) * 2.0f);
    for (int h = 0; h < c->n_heads; h++) a->sink[h] = mf_test_frand(&seed) * 3.0f;
    for (int t = 0; t < c->n_tok; t++) {
        int n = (int)((mf_test_frand(&seed) + 1.0f) * 0.5f * (float)(c->max_keys + 1));
        if (n > c->max_keys) n = c->max_keys;
        if (t == 1) n = 0;   /* a token with no keys: the sink alone */
        int nw = n / 2, end = (int)((mf_test_frand(&seed) + 1.0f) * 0.5f * (float)c->n_kv);
        for (int i = 0; i < n; i++) {
            int r = i < nw ? end - nw + i : (int)((mf_test_frand(&seed) + 1.0f) * 0.5f * (float)c->n_kv);
            r = r < 0 ? 0 : r >= c->n_kv ? (int)c->n_kv - 1 : r;
            a->keys[(size_t)t * c->max_keys + i] = r;
        }
        a->n_keys[t] = n;
    }
}

static void attn_free(attn_data *a)
{
    free(a->q), free(a->o_host), free(a->kv), free(a->sink), free(a->keys), free(a->n_keys);
}

/* What the host's attention computes (mf_fa_attn_heads after its query rounding and RoPE, before
 * the inverse RoPE): mf_kern_vec_attn over groups of `group` heads, bf16(acc / den). */
static void attn_host(attn_data *a, int group)
{
    attn_case *c = &a->c;
    float *s = malloc(sizeof(float) * 4 * (c->max_keys + 1)), *acc = malloc(sizeof(float) * 4 * c->D);
    const float **kp = malloc(sizeof(*kp) * (c->max_keys + 1));
    float scale = (float)(1.0 / sqrt((double)c->D));
    for (int t = 0; t < c->n_tok; t++) {
        int n = a->n_keys[t];
        for (int i = 0; i < n; i++) kp[i] = a->kv + (size_t)a->keys[(size_t)t * c->max_keys + i] * c->D;
        for (int h0 = 0; h0 < c->n_heads; h0 += group) {
            int G = c->n_heads - h0 < group ? c->n_heads - h0 : group;
            const float *qh[4];
            double den[4];
            for (int g = 0; g < G; g++) qh[g] = a->q + ((size_t)t * c->n_heads + h0 + g) * c->D;
            mf_kern_vec_attn(qh, G, kp, n, c->D, scale, a->sink + h0, s, acc, den);
            for (int g = 0; g < G; g++)
                for (int d = 0; d < c->D; d++)
                    a->o_host[((size_t)t * c->n_heads + h0 + g) * c->D + d] =
                        mf_bf16_round((float)((double)acc[g * c->D + d] / den[g]));
        }
    }
    free(s), free(acc), free(kp);
}

/* The plain reference in double: max |o - ref| / max |ref| per (token, head), the largest. */
static double attn_ref_err(const attn_data *a, const float *o)
{
    const attn_case *c = &a->c;
    double worst = 0, scale = 1.0 / sqrt((double)c->D);
    double *e = malloc(sizeof(double) * (c->max_keys + 1)), *r = malloc(sizeof(double) * c->D);
    for (int t = 0; t < c->n_tok; t++)
        for (int h = 0; h < c->n_heads; h++) {
            const float *q = a->q + ((size_t)t * c->n_heads + h) * c->D;
            int n = a->n_keys[t];
            double mx = a->sink[h], den = 0, mr = 0, md = 0;
            for (int i = 0; i < n; i++) {
                const float *k = a->kv + (size_t)a->keys[(size_t)t * c->max_keys + i] * c->D;
                double d = 0;
                for (int j = 0; j < c->D; j++) d += (double)q[j] * k[j];
                e[i] = d * scale;
                if (e[i] > mx) mx = e[i];
            }
            den = exp(a->sink[h] - mx);
            for (int i = 0; i < n; i++) den += e[i] = exp(e[i] - mx);
            for (int j = 0; j < c->D; j++) {
                r[j] = 0;
                for (int i = 0; i < n; i++) r[j] += e[i] * a->kv[(size_t)a->keys[(size_t)t * c->max_keys + i] * c->D + j];
                r[j] /= den;
                double dd = fabs(r[j] - o[((size_t)t * c->n_heads + h) * c->D + j]);
                if (fabs(r[j]) > mr) mr = fabs(r[j]);
                if (dd > md) md = dd;
            }
            double err = mr > 0 ? md / mr : md;
            if (err > worst) worst = err;
        }
    free(e), free(r);
    return worst;
}

static const attn_case cases[] = {
    {1, 1, 16, 8, 5},        {3, 5, 64, 40, 37},      {7, 6, 128, 300, 200},
    {4, 4, 512, 700, 640},   {2, 3, 32, 5000, 4096},
};

/* Runs the case on card 0 of d: device copies in, the op (qrd > 0: on qb's raw queries, which the op
 * rounds and ropes forward by each token's table row cs + t * qrd: mf_dev_attn.q_rope_dim), the
 * output back. 0 or the first error. */
static int attn_dev_q(mf_dev *d, const attn_data *a, const float *cs, int qrd, float *o)
{
    const attn_case *c = &a->c;
    size_t w = (size_t)c->n_heads * c->D, bq = sizeof(float) * c->n_tok * w, bkv = sizeof(float) * c->n_kv * c->D;
    size_t bk = sizeof(int32_t) * c->n_tok * c->max_keys;
    void *q = NULL, *kv = NULL, *sink = NULL, *keys = NULL, *nk = NULL, *dout = NULL;
    int rc = mf_dev_alloc(d, 0, bq, &q);
    if (!rc) rc = mf_dev_alloc(d, 0, bkv, &kv);
    if (!rc) rc = mf_dev_alloc(d, 0, sizeof(float) * c->n_heads, &sink);
    if (!rc) rc = mf_dev_alloc(d, 0, bk, &keys);
    if (!rc) rc = mf_dev_alloc(d, 0, sizeof(int32_t) * c->n_tok, &nk);
    if (!rc) rc = mf_dev_alloc(d, 0, bq, &dout);
    void *rope = NULL;
    size_t br = sizeof(float) * c->n_tok * (size_t)(qrd > 0 ? qrd : 1);
    if (!rc) rc = mf_dev_alloc(d, 0, br, &rope);
    mf_dev_stream *s = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COMPUTE);
    if (!rc && qrd > 0) rc = mf_dev_copy_h2d(s, rope, cs, br);
    if (!rc) rc = mf_dev_copy_h2d(s, q, a->q, bq);
    if (!rc) rc = mf_dev_copy_h2d(s, kv, a->kv, bkv);
    if (!rc) rc = mf_dev_copy_h2d(s, sink, a->sink, sizeof(float) * c->n_heads);
    if (!rc) rc = mf_dev_copy_h2d(s, keys, a->keys, bk);
    if (!rc) rc = mf_dev_copy_h2d(s, nk, a->n_keys, sizeof(int32_t) * c->n_tok);
    mf_dev_attn at = {.q = q, .ld_q = (int64_t)w, .n_tok = c->n_tok, .n_heads = c->n_heads, .D = c->D,
                      .scale = (float)(1.0 / sqrt((double)c->D)), .sink = sink, .kv = kv, .n_kv = c->n_kv,
                      .keys = keys, .n_keys = nk, .ld_keys = c->max_keys, .o = dout, .ld_o = (int64_t)w,
                      .rope = qrd > 0 ? rope : NULL, .q_rope_dim = qrd > 0 ? qrd : 0};
    if (!rc) rc = mf_dev_attn_heads(s, &at);
    if (!rc) rc = mf_dev_copy_d2h(s, o, dout, bq);
    int rs = mf_dev_stream_sync(s);
    if (!rc) rc = rs;
    mf_dev_free(d, 0, q), mf_dev_free(d, 0, kv), mf_dev_free(d, 0, sink), mf_dev_free(d, 0, keys);
    mf_dev_free(d, 0, nk), mf_dev_free(d, 0, dout), mf_dev_free(d, 0, rope);
    return rc;
}

static int attn_dev(mf_dev *d, const attn_data *a, float *o)
{
    return attn_dev_q(d, a, NULL, 0, o);
}

/* The queries as qb leaves them (mf_dev_attn.q_rope_dim, 16 values roped): the op on them against
 * the op on the queries the host's q prep makes of them (graphs/step/fast_attn.c mf_fa_heads_q:
 * all values rounded to bf16, the forward RoPE with the products rounded first, rounded again):
 * the same bits, on emulated and CUDA cards alike (the prep is exact float arithmetic). */
static void check_qrope(mf_dev *d, const char *spec)
{
    enum { RD = 16 };
    attn_data a = {.c = cases[2]};
    attn_fill(&a, 0x51ed27ull);
    const attn_case *c = &a.c;
    size_t n = (size_t)c->n_tok * c->n_heads * c->D;
    float *raw = malloc(sizeof(float) * n), *o_raw = malloc(sizeof(float) * n), *o_prep = malloc(sizeof(float) * n);
    float *cs = malloc(sizeof(float) * c->n_tok * RD);
    uint64_t seed = 0x7a3b1ull;
    for (size_t i = 0; i < n; i++) raw[i] = a.q[i] * (1.0f + 0x1p-6f * mf_test_frand(&seed));   /* not bf16 */
    for (int i = 0; i < c->n_tok * RD; i++) cs[i] = mf_test_frand(&seed);
    for (int t = 0; t < c->n_tok; t++)
        for (int h = 0; h < c->n_heads; h++) {
            float *x = a.q + ((size_t)t * c->n_heads + h) * c->D, *r = x + c->D - RD;
            const float *ct = cs + t * RD;
            for (int j = 0; j < c->D; j++) x[j] = mf_bf16_round(raw[((size_t)t * c->n_heads + h) * c->D + j]);
            for (int i = 0; i < RD / 2; i++) {
                float u = r[2 * i], v = r[2 * i + 1], uc = u * ct[i], vs = v * ct[RD / 2 + i], us = u * ct[RD / 2 + i],
                      vc = v * ct[i];
                r[2 * i] = mf_bf16_round(uc - vs);
                r[2 * i + 1] = mf_bf16_round(us + vc);
            }
        }
    int rc = attn_dev_q(d, &a, NULL, 0, o_prep);
    memcpy(a.q, raw, sizeof(float) * n);
    if (!rc) rc = attn_dev_q(d, &a, cs, RD, o_raw);
    CHECK(rc == 0 && !memcmp(o_raw, o_prep, sizeof(float) * n), "%s: the op on qb's queries: %s", spec,
          rc ? mf_last_error() : "not the bits of the op on the host's prepared queries");
    printf("%s: the op on qb's queries (forward RoPE of %d in the op): the prepared queries' bits\n", spec, RD);
    free(raw), free(o_raw), free(o_prep), free(cs);
    attn_free(&a);
}

/* bf16 outputs: one bf16 step (2^-8 relative) plus the fp32 sums: 1e-2 of the largest output. */
#define ATTN_TOL 1e-2

static void check_backend(const char *spec)
{
    mf_dev *d = NULL;
    int rc = mf_dev_open(spec, &d);
    if (rc == -ENOSYS || rc == -ENODEV) {
        printf("SKIP %s: no such device here (%d)\n", spec, rc);
        return;
    }
    CHECK(rc == 0, "open %s: %d", spec, rc);
    if (rc) return;
    int emu = !strcmp(mf_dev_kind(d), "emu");
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        attn_data a = {.c = cases[k]};
        attn_fill(&a, 0x9e3779b97f4a7c15ull + k);
        attn_host(&a, 4);
        size_t n = (size_t)a.c.n_tok * a.c.n_heads * a.c.D;
        float *o = malloc(sizeof(float) * n), *o2 = malloc(sizeof(float) * n);
        memcpy(o2, a.o_host, sizeof(float) * n);
        attn_host(&a, 1);   /* any grouping of heads: the same bits */
        CHECK(!memcmp(o2, a.o_host, sizeof(float) * n), "case %zu: host bits depend on the head grouping", k);
        rc = attn_dev(d, &a, o);
        CHECK(rc == 0, "%s case %zu: %d", spec, k, rc);
        double eh = attn_ref_err(&a, a.o_host), ed = attn_ref_err(&a, o);
        CHECK(eh < ATTN_TOL && ed < ATTN_TOL, "%s case %zu: rel err host %.3g, device %.3g (tol %g)", spec, k, eh, ed,
              ATTN_TOL);
        if (emu) CHECK(!memcmp(o, a.o_host, sizeof(float) * n), "%s case %zu: not the host's bits", spec, k);
        printf("%s case %zu (%d tok, %d heads of %d, <= %d keys): rel err host %.2e device %.2e%s\n", spec, k,
               a.c.n_tok, a.c.n_heads, a.c.D, a.c.max_keys, eh, ed, emu ? ", bit-identical" : "");
        free(o), free(o2);
        attn_free(&a);
    }
    check_qrope(d, spec);
    /* errors: a key row out of range is an asynchronous -EINVAL on emulated cards, bad shapes at once */
    attn_data a = {.c = cases[1]};
    attn_fill(&a, 7);
    a.keys[0] = (int32_t)a.c.n_kv;
    a.n_keys[0] = a.n_keys[0] ? a.n_keys[0] : 1;
    float *o = malloc(sizeof(float) * a.c.n_tok * a.c.n_heads * a.c.D);
    if (emu) CHECK(attn_dev(d, &a, o) == -EINVAL, "a key row out of range not refused");
    mf_dev_stream *s = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COMPUTE);
    mf_dev_attn bad = {.q = a.q, .ld_q = 64, .n_tok = 1, .n_heads = 1, .D = 24, .sink = a.sink, .kv = a.kv,
                       .n_kv = 1, .keys = a.keys, .n_keys = a.n_keys, .o = o, .ld_o = 64};
    CHECK(mf_dev_attn_heads(s, &bad) == -EINVAL, "D 24 not refused");
    bad.D = 16;
    bad.ld_o = 8;
    CHECK(mf_dev_attn_heads(s, &bad) == -EINVAL, "ld_o 8 < 16 not refused");
    bad.ld_o = 64;
    bad.q_rope_dim = 4;
    CHECK(mf_dev_attn_heads(s, &bad) == -EINVAL, "a query RoPE without a table not refused");
    bad.rope = a.sink;
    bad.q_rope_dim = 3;
    CHECK(mf_dev_attn_heads(s, &bad) == -EINVAL, "a query RoPE of 3 values not refused");
    bad.q_rope_dim = 4;
    bad.rope_dim = 8;
    CHECK(mf_dev_attn_heads(s, &bad) == -EINVAL, "a query RoPE of 4 values with the output's 8 not refused");
    free(o);
    attn_free(&a);
    mf_dev_close(d);
}

int main(void)
{
    check_backend("emu:1,bw=1e12,lat_ns=0");
    check_backend("cuda");
    return mf_check_exit("test_dev_attn");
}
