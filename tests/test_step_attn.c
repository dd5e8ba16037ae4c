/* The scheduled engine's row-split attention (graphs/step/step.c over layer_attn.c's phases) on the tiny
 * preset: each linear stage computed in row ranges (unaligned, across wo_a's groups, over several
 * items) gives the bits of the whole stage, on contexts of both linear backends (graphs/layers/layers.h:
 * the oracle's double sums and the kernels); the
 * reference's per-item stage equals the row-range path bit for bit on the oracle and within 1e-5
 * on the kernels (the low-rank query leaves its stage rounded to bf16); the hyper-connection,
 * q norm (scale, column parts) and attention-core parts (rows, columns, the window KV and index
 * query in reversed order, head groups, the late ring write) give the whole calls' bits on fresh
 * random data; the engine's logits (prefill
 * + decode, batch 1 and 3) equal across 1, 2, 3, 5 and 8 workers (1 to 8 row parts per stage,
 * head groups, column parts) and stay within the existing tolerance of the reference forward;
 * prefill chunks longer than the window give the bits of one token per call. */
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
#include "tests/num.h"
#include "tests/tiny_ckpt.h"

#define N_ITEMS 3
#define NP 12
#define NP_LONG 40   /* past two windows of tiny (16): prefill chunks longer than the window */
#define ND 6

static uint64_t g_rng = 88172645463325252ull;

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
        for (int64_t i = 0; i < N_ITEMS * ld[b]; i++) buf[b][i] = mf_test_frand(&g_rng);
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
                    if (l->y == MF_LY_A_QR) {   /* the q norm's scale task reads it as bf16 */
                        int bf = 1;
                        for (int64_t i = 0; i < N_ITEMS * ly; i++) bf &= whole[i] == mf_bf(whole[i]);
                        CHECK(bf, "layer %d %s (%s): the low-rank query is not rounded to bf16", L, l->w->name,
                              kk ? "kernels" : "oracle");
                    }
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
                            worst_kern = fmax(worst_kern, mf_test_max_rel(one, whole + t * ly, R));
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

/* The hyper-connection parts (layer_hc.c, layer_ops.c) on fresh random streams: mixes in row
 * ranges, collapse, expand and norm in column ranges (1, 7, 13, ... wide: unaligned) give the
 * bits of the whole calls. */
static void test_hc_parts(const mf_model *m, mf_ly_ctx *cx)
{
    const mf_config *c = mf_model_config(m);
    const mf_model_layer *y = mf_model_layer_at(m, 0);
    int64_t H = c->hidden_size;
    int hc = c->hc_mult, nm = (2 + hc) * hc;
    float *x = malloc(sizeof(float) * hc * H), *x2 = malloc(sizeof(float) * hc * H), *out = malloc(sizeof(float) * H);
    float *h = malloc(sizeof(float) * H), *h2 = malloc(sizeof(float) * H);
    float mix[(2 + MF_LY_MAX_HC) * MF_LY_MAX_HC], mix2[(2 + MF_LY_MAX_HC) * MF_LY_MAX_HC];
    float pre[MF_LY_MAX_HC], post[MF_LY_MAX_HC], comb[MF_LY_MAX_HC * MF_LY_MAX_HC];
    int same = 1;
    for (int rep = 0; rep < 3; rep++) {
        for (int64_t i = 0; i < hc * H; i++) x[i] = mf_test_frand(&g_rng) * 4;
        for (int64_t i = 0; i < H; i++) out[i] = mf_test_frand(&g_rng);
        mf_ly_hc_mixes(cx, x, &y->hc_attn_fn, mix);
        for (int k0 = 0, w = 1; k0 < nm; w += 2) {
            int k1 = k0 + w < nm ? k0 + w : nm;
            mf_ly_hc_mixes_rows(cx, x, &y->hc_attn_fn, mix2, k0, k1);
            k0 = k1;
        }
        same &= !memcmp(mix, mix2, sizeof(float) * nm);
        mf_ly_hc_split_w(c, mix, &y->hc_attn_scale, &y->hc_attn_base, pre, post, comb);
        mf_ly_hc_collapse(cx, x, pre, h);
        memcpy(x2, x, sizeof(float) * hc * H);
        mf_ly_hc_expand(cx, x, out, post, comb);
        for (int64_t d0 = 0, w = 1; d0 < H; w += 6) {
            int64_t d1 = d0 + w < H ? d0 + w : H;
            mf_ly_hc_collapse_cols(cx, x2, pre, h2, d0, d1);
            mf_ly_hc_expand_cols(cx, x2, out, post, comb, d0, d1);
            d0 = d1;
        }
        same &= !memcmp(h, h2, sizeof(float) * H) && !memcmp(x, x2, sizeof(float) * hc * H);
        mf_ly_rmsnorm(h, H, &y->attn_norm, c->rms_norm_eps, out);
        for (int64_t d0 = 0, w = 1; d0 < H; w += 6) {
            int64_t d1 = d0 + w < H ? d0 + w : H;
            mf_ly_rmsnorm_cols(h, H, &y->attn_norm, c->rms_norm_eps, h2, d0, d1);
            d0 = d1;
        }
        same &= !memcmp(out, h2, sizeof(float) * H);
    }
    CHECK(same, "hyper-connection parts differ from the whole calls");
    printf("hc parts: mixes by rows, collapse, expand and norm by columns bit-identical\n");
    free(x);
    free(x2);
    free(out);
    free(h);
    free(h2);
}

/* The attention core in parts (layer_attn.c) against mf_ly_attn_core on twin states (the same
 * prompt, past the window and with compressed entries): per layer in order, on the same random
 * buffers, the prep's kv, index scores in ranges of 1, 3, 5 ... entries and select, then head
 * groups of 1, 2, 3 ... heads reading the item's own KV through a window (the ring written after
 * the heads) give the whole core's output, selection and ring. */
/* The q norm as the engine's tasks run it (MF_SG_ATTN_QSCALE, then MF_SG_ATTN_QNORM column parts in
 * place): on fresh random low-rank queries rounded as the IN stage leaves them, the scale once and
 * the columns in uneven parts give mf_ly_attn_qnorm's bits, every layer. */
static void test_qnorm_parts(const mf_layers *ly, mf_ly_ctx *cx)
{
    const mf_config *c = ly->c;
    int64_t R = c->q_lora_rank;
    float *buf[MF_LY_A_N] = {0}, *part = malloc(sizeof(float) * R);
    buf[MF_LY_A_QR] = malloc(sizeof(float) * R);
    int same = 1, n_parts = 0;
    for (int L = 0; L < c->n_layers && part && buf[MF_LY_A_QR]; L++) {
        for (int64_t i = 0; i < R; i++) buf[MF_LY_A_QR][i] = 4.0f * (float)mf_test_frand(&g_rng);
        mf_bf_n(buf[MF_LY_A_QR], R);
        memcpy(part, buf[MF_LY_A_QR], sizeof(float) * R);
        mf_ly_attn_qnorm(cx, L, buf);
        float rs = mf_ly_rms_scale(part, R, c->rms_norm_eps);
        const mf_weight *w = &mf_model_layer_at(ly->m, L)->q_norm;
        for (int64_t c0 = 0, k = 1; c0 < R; k += 3, n_parts++) {   /* widths 1, 4, 7, ... */
            int64_t c1 = c0 + k < R ? c0 + k : R;
            mf_ly_rmsnorm_apply(part, w, rs, part, c0, c1);
            c0 = c1;
        }
        same &= !memcmp(part, buf[MF_LY_A_QR], sizeof(float) * R);
        CHECK(same, "layer %d: the q norm's scale and column parts differ from mf_ly_attn_qnorm", L);
    }
    printf("q norm parts: scale + %d column parts over %d layers bit-identical to the whole q norm\n", n_parts,
           c->n_layers);
    free(buf[MF_LY_A_QR]);
    free(part);
}

static void test_core_parts(mf_ref *r, mf_ly_ctx *cx)
{
    const mf_layers *ly = mf_ref_layers(r);
    const mf_config *c = ly->c;
    int np = 2 * (int)c->sliding_window + 5, nh = c->n_heads;
    mf_ref_state *st[2] = {0};
    int32_t p[64];
    for (int i = 0; i < np; i++) p[i] = (int32_t)((i * 43 + 9) % c->vocab_size);
    for (int k = 0; k < 2; k++) {
        CHECK(mf_ref_state_new(r, np + 4, &st[k]) == 0 && mf_ref_prefill(r, st[k], p, np, NULL) == 0, "state: %s",
              mf_last_error());
        if (!st[k]) return;
    }
    CHECK(mf_ly_ctx_reserve(cx, np + 4) == 0, "reserve");
    float *buf[2][MF_LY_A_N];
    int32_t topk[2][1024], cand[2][1024];
    mf_ly_item it[2];
    for (int k = 0; k < 2; k++) {
        memset(&it[k], 0, sizeof it[k]);
        it[k] = (mf_ly_item){.st = st[k], .pos = np, .tok = 3, .topk = topk[k], .topk_src = -1, .cand = cand[k],
                             .cand_src = -1};
        for (int b = 0; b < MF_LY_A_N; b++) buf[k][b] = malloc(sizeof(float) * (mf_ly_attn_buf_len(c, b) + 1));
    }
    int same = 1, n_sel = 0;
    double score[64];
    for (int L = 0; L < c->n_layers; L++) {
        for (int b = 0; b < MF_LY_A_N; b++)
            for (int64_t i = 0; i < mf_ly_attn_buf_len(c, b); i++) buf[0][b][i] = buf[1][b][i] = mf_test_frand(&g_rng);
        CHECK(mf_ly_attn_core(cx, &it[0], L, buf[0]) == 0, "core: %s", mf_last_error());
        /* the prep as the engine's tasks run it: kv in its halves (the index query first: they
         * touch disjoint data, so the engine may run them in either order), index scores in
         * ranges, select */
        mf_ly_attn_index_query(cx, &it[1], L, buf[1]);
        CHECK(mf_ly_attn_window_kv(cx, &it[1], L, buf[1]) == 0, "prep: %s", mf_last_error());
        int64_t n_vis = mf_ly_index_n_vis(c, L, np);
        for (int64_t j0 = 0, w = 1; j0 < n_vis; w += 2) {
            int64_t j1 = j0 + w < n_vis ? j0 + w : n_vis;
            mf_ly_index_scores(ly, &it[1], L, buf[1], score, j0, j1);
            j0 = j1;
        }
        mf_ly_attn_core_select(cx, &it[1], L, score);
        mf_ly_win win = {.kv = buf[1][MF_LY_A_KV], .ld = 0, .pos0 = np};
        for (int h0 = 0, g = 1; h0 < nh; g++) {
            int h1 = h0 + g < nh ? h0 + g : nh;
            mf_ly_attn_core_heads(cx, &it[1], L, buf[1], h0, h1, &win);
            h0 = h1;
        }
        mf_ly_attn_ring_write(cx, &it[1], L, buf[1][MF_LY_A_KV]);
        same &= !memcmp(buf[0][MF_LY_A_O], buf[1][MF_LY_A_O], sizeof(float) * mf_ly_attn_buf_len(c, MF_LY_A_O));
        same &= it[0].n_topk == it[1].n_topk && !memcmp(topk[0], topk[1], sizeof(int32_t) * it[0].n_topk);
        CHECK(same, "layer %d: the core's parts differ from the whole", L);
        n_sel += it[0].topk_src >= 0 ? it[0].n_topk : 0;
    }
    CHECK(n_sel > 0, "no compressed entries selected: the test does not reach the selection");
    CHECK(!memcmp(st[0]->ring, st[1]->ring, (size_t)mf_ly_ring_bytes(c)), "rings differ after the core's parts");
    printf("core parts: kv, score ranges, select, head groups, late ring write bit-identical to the whole core, %d layers, %d "
           "selected entries\n", c->n_layers, n_sel);
    for (int k = 0; k < 2; k++) {
        for (int b = 0; b < MF_LY_A_N; b++) free(buf[k][b]);
        mf_ref_state_free(st[k]);
    }
}

/* Prefill of np tokens + teacher-forced decode of n_seq sequences; logits[s * (1 + ND) + j] rows.
 * e NULL: the reference; one: the engine fed one token of one sequence per call. */
static int run_np(mf_ref *r, mf_step *e, int n_seq, int64_t V, float *logits, int np, int one)
{
    mf_ref_state *st[N_ITEMS] = {0};
    int rc = 0;
    for (int s = 0; s < n_seq && !rc; s++) {
        int32_t p[NP_LONG];
        for (int i = 0; i < np; i++) p[i] = (int32_t)((i * 41 + s * 97 + 5) % V);
        rc = mf_ref_state_new(r, np + ND + 1, &st[s]);
        float *lg = logits + (size_t)s * (1 + ND) * V;
        for (int q = 0; one && q < np && !rc; q++) rc = mf_step_prefill(e, st[s], p + q, 1, lg);
        if (!rc && !one) rc = e ? mf_step_prefill(e, st[s], p, np, lg) : mf_ref_prefill(r, st[s], p, np, lg);
    }
    float *step = malloc(sizeof(float) * N_ITEMS * V);
    for (int k = 0; k < ND && !rc; k++) {
        int32_t t[N_ITEMS];
        for (int s = 0; s < n_seq; s++) t[s] = (int32_t)((k * 29 + s * 11 + 3) % V);
        for (int s = 0; one && s < n_seq && !rc; s++) rc = mf_step_decode(e, st + s, t + s, 1, step + (size_t)s * V);
        if (!one) rc = e ? mf_step_decode(e, st, t, n_seq, step) : mf_ref_decode(r, st, t, n_seq, step);
        for (int s = 0; s < n_seq && !rc; s++)
            memcpy(logits + ((size_t)s * (1 + ND) + 1 + k) * V, step + (size_t)s * V, sizeof(float) * V);
    }
    free(step);
    for (int s = 0; s < n_seq; s++) mf_ref_state_free(st[s]);
    return rc;
}

static int run(mf_ref *r, mf_step *e, int n_seq, int64_t V, float *logits)
{
    return run_np(r, e, n_seq, V, logits, NP, 0);
}

/* Prompts past two windows in one chunk (items of one sequence attending to each other's KV
 * rows, the ring written after the heads), then batch-3 decodes, on 1, 3 and 8 workers: the bits
 * of the engine fed one token of one sequence per call (no chunk, the ring written in the prep).
 * (The reference is not the yardstick here: from ~20 positions on, the engine's fp32 linears
 * flip a tie of tiny's fp4 index scores against the oracle's double sums.) */
static void test_chunks(mf_ref *r, int64_t V)
{
    size_t nv = (size_t)N_ITEMS * (1 + ND), per = nv * V;
    float *one = malloc(sizeof(float) * per), *got = malloc(sizeof(float) * per);
    static const int workers[] = {1, 3, 8};
    mf_step *e = NULL;
    CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 1, .exact = 1}, &e) == 0, "step: %s", mf_last_error());
    if (!e) return;
    CHECK(run_np(r, e, N_ITEMS, V, one, NP_LONG, 1) == 0, "engine, one token per call: %s", mf_last_error());
    mf_step_free(e);
    int same = 1;
    for (int wi = 0; wi < 3; wi++) {
        CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = workers[wi], .exact = 1}, &e) == 0, "step: %s",
              mf_last_error());
        if (!e) continue;
        CHECK(run_np(r, e, N_ITEMS, V, got, NP_LONG, 0) == 0, "engine, %d workers: %s", workers[wi], mf_last_error());
        mf_step_free(e);
        same &= !memcmp(one, got, sizeof(float) * per);
        CHECK(same, "%d-token chunks on %d workers differ from one token per call", NP_LONG, workers[wi]);
    }
    printf("chunks: %d-token prefills + batch-%d decodes on 1, 3, 8 workers %s one token per call\n", NP_LONG,
           N_ITEMS, same ? "bit-identical to" : "DIFFER from");
    free(one);
    free(got);
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
                double d = mf_test_max_rel(ref + j * V, first + j * V, V);
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
        if (!MF_TEST_TSAN) {   /* one thread: nothing for TSan */
            test_stages(m, dbl, kern);
            test_hc_parts(m, dbl);
            test_qnorm_parts(mf_ref_layers(oracle), dbl);
            test_core_parts(oracle, dbl);
        }
        test_engine(oracle, c.vocab_size);
        test_chunks(oracle, c.vocab_size);
    }
    mf_ly_ctx_free(kern);
    mf_ly_ctx_free(dbl);
    mf_ref_free(oracle);
    mf_model_free(m);
    return mf_check_exit("test_step_attn");
}
