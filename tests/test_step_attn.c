/* The scheduled engine's row-split attention (graphs/step/step.c over layer_attn.c's phases) on the tiny
 * preset: each linear stage computed in row ranges (unaligned, across wo_a's groups, over several
 * items) gives the bits of the whole stage, on contexts of both linear backends (graphs/layers/layers.h:
 * the oracle's double sums and the kernels); the
 * reference's per-item stage equals the row-range path bit for bit on the oracle and within 1e-5
 * on the kernels; the engine's logits (prefill + decode, batch 1 and 3) equal across 1, 2, 3, 5
 * and 8 workers (1 to 8 row parts per stage) and stay within the existing tolerance of the
 * reference forward. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/layers/layers.h"
#include "graphs/step/step.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/tiny_ckpt.h"

#define N_ITEMS 3
#define NP 12
#define ND 6

static uint64_t g_rng = 88172645463325252ull;

static float frand(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return (float)((double)(g_rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static double max_rel(const float *a, const float *b, int64_t n)
{
    double scale = 0, d = 0;
    for (int64_t i = 0; i < n; i++) {
        scale = fmax(scale, fabs(a[i]));
        d = fmax(d, fabs((double)a[i] - b[i]));
    }
    return scale > 0 ? d / scale : d;
}

/* Every stage of every layer: row ranges against the whole, per-item reference against both. */
static void test_stages(const mf_model *m, mf_ly_ctx *oracle, mf_ly_ctx *kern)
{
    const mf_config *c = mf_model_config(m);
    float *buf[MF_LY_A_N], *whole = NULL, *part = NULL;
    int64_t ld[MF_LY_A_N], maxld = 0;
    for (int b = 0; b < MF_LY_A_N; b++) {
        ld[b] = mf_ly_attn_buf_len(c, b) + 5;   /* strides that are not the row length */
        maxld = ld[b] > maxld ? ld[b] : maxld;
        buf[b] = malloc(sizeof(float) * N_ITEMS * ld[b]);
        for (int64_t i = 0; i < N_ITEMS * ld[b]; i++) buf[b][i] = frand();
    }
    whole = malloc(sizeof(float) * N_ITEMS * maxld);
    part = malloc(sizeof(float) * N_ITEMS * maxld);
    float *one = malloc(sizeof(float) * maxld);
    int n_lin = 0, n_grouped = 0;
    double worst_kern = 0;
    for (int L = 0; L < c->n_layers; L++)
        for (int st = 0; st < MF_LY_A_N_STAGES; st++) {
            mf_ly_attn_lin lin[MF_LY_A_MAX_LIN];
            int n = mf_ly_attn_linears(oracle->ly, L, st, lin);
            CHECK(n >= 1 && n <= MF_LY_A_MAX_LIN, "layer %d stage %d: %d linears", L, st, n);
            for (int k = 0; k < n; k++) {
                const mf_ly_attn_lin *l = &lin[k];
                int64_t R = l->w->rows, lx = ld[l->x], ly = ld[l->y];
                n_lin++;
                n_grouped += l->groups > 0;
                for (int kk = 0; kk < 2; kk++) {
                    mf_ly_ctx *r = kk ? kern : oracle;
                    memset(whole, 0, sizeof(float) * N_ITEMS * ly);
                    memset(part, 0, sizeof(float) * N_ITEMS * ly);
                    CHECK(mf_ly_attn_lin_rows(r, l, buf[l->x], lx, whole, ly, N_ITEMS, 0, R) == 0, "%s: %s",
                          l->w->name, mf_last_error());
                    /* ranges of 1, 7, 13, ... rows: unaligned, crossing group boundaries */
                    for (int64_t a = 0, step = 1; a < R; step += 6) {
                        int64_t b = a + step < R ? a + step : R;
                        CHECK(mf_ly_attn_lin_rows(r, l, buf[l->x], lx, part, ly, N_ITEMS, a, b) == 0, "%s rows", l->w->name);
                        a = b;
                    }
                    int same = 1;
                    for (int t = 0; t < N_ITEMS; t++) same &= !memcmp(whole + t * ly, part + t * ly, sizeof(float) * R);
                    CHECK(same, "layer %d %s (%s): row ranges differ from the whole", L, l->w->name, kk ? "kernels" : "oracle");
                    /* the reference's own call, item by item, on its buffers */
                    for (int t = 0; t < N_ITEMS; t++) {
                        float *b[MF_LY_A_N];
                        for (int q = 0; q < MF_LY_A_N; q++) b[q] = buf[q] + t * ld[q];
                        float *keep = b[l->y];
                        b[l->y] = one;
                        /* the whole stage, this linear's output redirected */
                        CHECK(mf_ly_attn_stage(oracle, L, st, b) == 0, "stage: %s", mf_last_error());
                        b[l->y] = keep;
                        if (kk == 0)
                            CHECK(!memcmp(one, whole + t * ly, sizeof(float) * R), "layer %d %s item %d: the reference's "
                                  "stage differs from its row-range path", L, l->w->name, t);
                        else
                            worst_kern = fmax(worst_kern, max_rel(one, whole + t * ly, R));
                    }
                }
            }
        }
    CHECK(n_grouped == c->n_layers, "one grouped wo_a per layer (%d)", n_grouped);
    CHECK(worst_kern < 1e-5, "kernel rows %.3g off the oracle's double sums", worst_kern);
    printf("stages: %d linears over %d layers, row ranges bit-identical; kernels %.3g off the oracle\n", n_lin,
           c->n_layers, worst_kern);
    for (int b = 0; b < MF_LY_A_N; b++) free(buf[b]);
    free(whole);
    free(part);
    free(one);
}

/* Prefill + teacher-forced decode of n_seq sequences; logits[s * (1 + ND) + j] rows. */
static int run(mf_ref *r, mf_step *e, int n_seq, int64_t V, float *logits)
{
    mf_ref_state *st[N_ITEMS] = {0};
    int rc = 0;
    for (int s = 0; s < n_seq && !rc; s++) {
        int32_t p[NP];
        for (int i = 0; i < NP; i++) p[i] = (int32_t)((i * 41 + s * 97 + 5) % V);
        rc = mf_ref_state_new(r, NP + ND + 1, &st[s]);
        float *lg = logits + (size_t)s * (1 + ND) * V;
        if (!rc) rc = e ? mf_step_prefill(e, st[s], p, NP, lg) : mf_ref_prefill(r, st[s], p, NP, lg);
    }
    float *step = malloc(sizeof(float) * N_ITEMS * V);
    for (int k = 0; k < ND && !rc; k++) {
        int32_t t[N_ITEMS];
        for (int s = 0; s < n_seq; s++) t[s] = (int32_t)((k * 29 + s * 11 + 3) % V);
        rc = e ? mf_step_decode(e, st, t, n_seq, step) : mf_ref_decode(r, st, t, n_seq, step);
        for (int s = 0; s < n_seq && !rc; s++)
            memcpy(logits + ((size_t)s * (1 + ND) + 1 + k) * V, step + (size_t)s * V, sizeof(float) * V);
    }
    free(step);
    for (int s = 0; s < n_seq; s++) mf_ref_state_free(st[s]);
    return rc;
}

static void test_engine(mf_ref *r, int64_t V)
{
    size_t per = (size_t)N_ITEMS * (1 + ND) * V;
    float *ref = malloc(sizeof(float) * per), *first = malloc(sizeof(float) * per), *got = malloc(sizeof(float) * per);
    /* TSan: 1, 3 and 8 workers (an uneven split, more workers than cores) */
    static const int workers[] = {1, 2, 3, 5, 8}, tsan_skip[] = {0, 1, 0, 1, 0};
    for (int b = 1; b <= N_ITEMS; b += 2) {
        size_t nv = (size_t)b * (1 + ND);
        int same = 1;
        double worst = 0;
        int n_far = 0;
        CHECK(run(r, NULL, b, V, ref) == 0, "reference: %s", mf_last_error());
        for (int wi = 0; wi < (int)(sizeof workers / sizeof workers[0]); wi++) {
            if (MF_TEST_TSAN && tsan_skip[wi]) continue;
            mf_step *e = NULL;
            CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = workers[wi], .exact = 1}, &e) == 0, "step: %s",
                  mf_last_error());
            if (!e) continue;
            CHECK(run(r, e, b, V, wi ? got : first) == 0, "engine, %d workers, batch %d: %s", workers[wi], b,
                  mf_last_error());
            mf_step_free(e);
            if (wi) {
                same &= !memcmp(first, got, sizeof(float) * nv * V);
                CHECK(same, "batch %d: %d workers differ from 1", b, workers[wi]);
                continue;
            }
            for (size_t j = 0; j < nv; j++) {
                double d = max_rel(ref + j * V, first + j * V, V);
                worst = fmax(worst, d);
                n_far += d > 1e-6;
            }
            /* test_step's exact-path tolerance (fp32 kernels vs double sums, rare flipped ties) */
            CHECK(n_far * 4 <= (int)nv && worst < 5e-2, "batch %d: %d of %zu logit vectors more than 1e-6 off the "
                  "reference, worst %.3g", b, n_far, nv, worst);
        }
        printf("engine batch %d: %.3g off the reference at worst (%d of %zu vectors past 1e-6); %s "
               "workers %s\n", b, worst, n_far, nv, MF_TEST_TSAN ? "1, 3, 8" : "1, 2, 3, 5, 8",
               same ? "bit-identical" : "DIFFER");
    }
    free(ref);
    free(first);
    free(got);
}

int main(void)
{
    mf_config c;
    char dir[1024];
    CHECK(mf_config_preset("tiny", &c) == 0, "preset");
    if (mf_test_gen_ckpt(&c, "step_attn_tiny", dir, sizeof dir)) return 1;
    mf_model *m = NULL;
    CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1}, &m) == 0, "load: %s", mf_last_error());
    if (!m) return mf_check_exit("test_step_attn");
    /* the layer math on both backends over the oracle's tables */
    mf_ref *oracle = NULL;
    mf_ly_ctx *dbl = NULL, *kern = NULL;
    CHECK(mf_ref_new(m, NULL, &oracle) == 0, "ref: %s", mf_last_error());
    if (oracle)
        CHECK(mf_ly_ctx_new(mf_ref_layers(oracle), MF_LY_LIN_DOUBLE, &dbl) == 0 &&
                  mf_ly_ctx_new(mf_ref_layers(oracle), MF_LY_LIN_KERN, &kern) == 0, "contexts: %s", mf_last_error());
    if (dbl && kern) {
        if (!MF_TEST_TSAN) test_stages(m, dbl, kern);   /* one thread: nothing for TSan */
        test_engine(oracle, c.vocab_size);
    }
    mf_ly_ctx_free(kern);
    mf_ly_ctx_free(dbl);
    mf_ref_free(oracle);
    mf_model_free(m);
    return mf_check_exit("test_step_attn");
}
