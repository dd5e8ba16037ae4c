/* mf_dev_index_scores (device/dev.h), the indexer's scores of long prefill chunks on a card, on
 * fresh random data and shapes: on emulated cards bit for bit the host's (host/kernels.h
 * mf_kern_vec_index_scores per token over its visible keys, as graphs/step/fast_attn.c
 * mf_fa_index_scores computes them); the CUDA kernel's schedule run on the host (device/kern_attn.h's
 * lanes, the half-warp's shuffle tree, the float product and the double sum per head in order)
 * gives the same bits; both within 1e-5 (relative to the largest score) of a plain double
 * reference; keys past a token's count untouched; the argument and count errors. The CUDA card
 * itself: tests/test_dev_cuda.c. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "device/dense_host.h"
#include "device/dev.h"
#include "device/kern_attn.h"
#include "host/kernels.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/num.h"

typedef struct is_case {
    int n_tok, n_heads, D;
    int64_t n_keys;
} is_case;

static const is_case cases[] = {{1, 1, 16, 1}, {3, 5, 40, 37}, {7, 32, 128, 300}, {4, 8, 64, 1000}, {2, 3, 20, 49}};

/* The kernel's schedule on the host: per key and head the 16 lanes, the tree, then the sum. */
static double is_kernel_order(const float *q, const float *w, int H, const float *k, int D)
{
    double acc = 0;
    for (int h = 0; h < H; h++) {
        float l[16];
        for (int i = 0; i < 16; i++) l[i] = mf_da_lane(q + (size_t)h * D, k, D, i);
        float v = mf_da_tree16(l), rl = v > 0 ? v : 0.0f;
        float x = w[h] * rl;
        acc += (double)x;
    }
    return (float)acc;
}

static void check_case(mf_dev *d, const is_case *c, uint64_t seed, int bad_count)
{
    size_t nq = (size_t)c->n_tok * c->n_heads * c->D, ns = (size_t)c->n_tok * c->n_keys;
    float *q = malloc(sizeof(float) * nq), *w = malloc(sizeof(float) * c->n_tok * c->n_heads);
    float *k = malloc(sizeof(float) * c->n_keys * c->D);
    int32_t *nv = malloc(sizeof(int32_t) * c->n_tok);
    double *host = malloc(sizeof(double) * ns), *got = malloc(sizeof(double) * ns);
    const float **kp = malloc(sizeof(*kp) * c->n_keys);
    for (size_t i = 0; i < nq; i++) q[i] = mf_test_frand(&seed);
    for (int i = 0; i < c->n_tok * c->n_heads; i++) w[i] = mf_test_frand(&seed) * 2.0f;
    for (int64_t i = 0; i < c->n_keys * c->D; i++) k[i] = mf_test_frand(&seed);
    for (int64_t j = 0; j < c->n_keys; j++) kp[j] = k + j * c->D;
    for (int t = 0; t < c->n_tok; t++) {   /* causal-like counts: the last token sees every key */
        nv[t] = (int32_t)(c->n_keys * (t + 1) / c->n_tok);
        if (t == 0 && c->n_tok > 2) nv[t] = 0;
    }
    for (size_t i = 0; i < ns; i++) host[i] = got[i] = -7.0;
    double mb = 0, e_ref = 0, e_ker = 0;
    for (int t = 0; t < c->n_tok; t++) {
        const float *qt = q + (size_t)t * c->n_heads * c->D, *wt = w + (size_t)t * c->n_heads;
        mf_kern_vec_index_scores(qt, wt, c->n_heads, kp, nv[t], c->D, host + (size_t)t * c->n_keys);
        for (int64_t j = 0; j < nv[t]; j++) {
            double h = host[(size_t)t * c->n_keys + j], r = 0;
            if (is_kernel_order(qt, wt, c->n_heads, kp[j], c->D) != h) e_ker = 1;
            for (int hh = 0; hh < c->n_heads; hh++) {   /* the plain reference */
                double dot = 0;
                for (int i = 0; i < c->D; i++) dot += (double)qt[(size_t)hh * c->D + i] * kp[j][i];
                r += wt[hh] * (dot > 0 ? dot : 0);
            }
            double e = fabs(h - r);
            if (e > e_ref) e_ref = e;
            if (fabs(r) > mb) mb = fabs(r);
        }
    }
    e_ref = mb > 0 ? e_ref / mb : e_ref;
    CHECK(e_ker == 0, "case %d x %d x %d, %lld keys: the kernel's order differs from the host's bits", c->n_tok,
          c->n_heads, c->D, (long long)c->n_keys);
    CHECK(e_ref < 1e-5, "case %d x %d x %d: relative error %.3g against the double reference", c->n_tok, c->n_heads,
          c->D, e_ref);
    /* the card */
    void *dq = NULL, *dw = NULL, *dk = NULL, *dv = NULL, *dsc = NULL;
    int rc = mf_dev_alloc(d, 0, sizeof(float) * nq, &dq);
    if (!rc) rc = mf_dev_alloc(d, 0, sizeof(float) * c->n_tok * c->n_heads, &dw);
    if (!rc) rc = mf_dev_alloc(d, 0, sizeof(float) * c->n_keys * c->D, &dk);
    if (!rc) rc = mf_dev_alloc(d, 0, sizeof(int32_t) * c->n_tok, &dv);
    if (!rc) rc = mf_dev_alloc(d, 0, sizeof(double) * ns, &dsc);
    mf_dev_stream *s = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COMPUTE);
    if (!rc) rc = mf_dev_copy_h2d(s, dq, q, sizeof(float) * nq);
    if (!rc) rc = mf_dev_copy_h2d(s, dw, w, sizeof(float) * c->n_tok * c->n_heads);
    if (!rc) rc = mf_dev_copy_h2d(s, dk, k, sizeof(float) * c->n_keys * c->D);
    if (!rc) rc = mf_dev_copy_h2d(s, dv, nv, sizeof(int32_t) * c->n_tok);
    if (!rc) rc = mf_dev_copy_h2d(s, dsc, got, sizeof(double) * ns);
    mf_dev_iscore a = {.q = dq, .ld_q = (int64_t)c->n_heads * c->D, .w = dw, .ld_w = c->n_heads, .n_tok = c->n_tok,
                       .n_heads = c->n_heads, .D = c->D, .keys = dk, .n_keys = c->n_keys, .n_vis = dv, .score = dsc,
                       .ld_s = c->n_keys};
    if (!rc) rc = mf_dev_index_scores(s, &a);
    if (!rc) rc = mf_dev_copy_d2h(s, got, dsc, sizeof(double) * ns);
    int rs = mf_dev_stream_sync(s);
    CHECK(!rc && !rs, "case %d x %d x %d: %d %d %s", c->n_tok, c->n_heads, c->D, rc, rs, mf_last_error());
    CHECK(!memcmp(host, got, sizeof(double) * ns), "case %d x %d x %d: the card's scores are not the host's bits",
          c->n_tok, c->n_heads, c->D);
    printf("case %d tok, %d heads of %d, %lld keys: rel err %.2e against double, kernel order and card bit-identical\n",
           c->n_tok, c->n_heads, c->D, (long long)c->n_keys, e_ref);
    if (bad_count) {   /* a count past the keys: an asynchronous -EINVAL (sticky: the last use of d) */
        nv[c->n_tok - 1] = (int32_t)c->n_keys + 1;
        rc = mf_dev_copy_h2d(s, dv, nv, sizeof(int32_t) * c->n_tok);
        if (!rc) rc = mf_dev_index_scores(s, &a);
        CHECK(!rc && mf_dev_stream_sync(s) == -EINVAL, "a count past the keys not refused");
    }
    mf_dev_free(d, 0, dq), mf_dev_free(d, 0, dw), mf_dev_free(d, 0, dk), mf_dev_free(d, 0, dv), mf_dev_free(d, 0, dsc);
    free(q), free(w), free(k), free(nv), free(host), free(got), free(kp);
}

int main(void)
{
    mf_dev *d = NULL;
    int rc = mf_dev_open("emu:1,bw=1e12,lat_ns=0", &d);
    CHECK(rc == 0, "open emu: %s", mf_last_error());
    if (rc) return mf_check_exit("test_dev_iscore");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) check_case(d, &cases[i], 0x5eed + i * 977, 0);
    mf_dev_stream *s = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COMPUTE);
    float x[64];
    int32_t n = 1;
    double sc[4];
    mf_dev_iscore bad = {.q = x, .ld_q = 64, .w = x, .ld_w = 4, .n_tok = 1, .n_heads = 4, .D = 16, .keys = x,
                         .n_keys = 4, .n_vis = &n, .score = sc, .ld_s = 4};
    bad.ld_q = 63;
    CHECK(mf_dev_index_scores(s, &bad) == -EINVAL, "ld_q 63 < 64 not refused");
    bad.ld_q = 64;
    bad.ld_s = 3;
    CHECK(mf_dev_index_scores(s, &bad) == -EINVAL, "ld_s 3 < 4 keys not refused");
    bad.ld_s = 4;
    bad.n_heads = 1024;
    bad.ld_q = 1 << 20;
    bad.ld_w = 1024;
    CHECK(mf_dev_index_scores(s, &bad) == -EINVAL, "1024 heads x 16 past MF_DEV_ISCORE_MAX_QD not refused");
    bad.n_heads = 4, bad.ld_q = 64, bad.ld_w = 4, bad.score = NULL;
    CHECK(mf_dev_index_scores(s, &bad) == -EINVAL, "NULL score not refused");
    check_case(d, &cases[1], 3, 1);
    mf_dev_close(d);
    return mf_check_exit("test_dev_iscore");
}
