/* The engine's fast per-item layer math (graphs/step/fast_attn.h) against the module it replaces on
 * the default path (graphs/layers/layers.h), on the tiny preset with fresh random data:
 *  - attention heads, index scores, hyper-connection mixes, the grouped wo_a and the router gate within stated
 *    tolerances of the module (fp32 sums vs double), collapse and expand bit for bit (also on
 *    NaN, inf and overflowing inputs), the selection (top-k, candidate blocks) equal to it;
 *  - every fast piece gives the same bits in parts (head groups, entry ranges, row and column
 *    ranges) as whole, and on the scalar path as on the AVX2 path;
 *  - the engine's default path: chunked prefills + batch decodes on 1, 2, 3 and 8 workers give the
 *    bits of one token per call on one worker (thread counts and chunk sizes do not change them). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/layers/layers.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/fast_attn.h"
#include "graphs/step/step.h"
#include "host/kernels.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/num.h"
#include "tests/tiny_ckpt.h"

/* Tolerances, max|fast - module| / max|module| over a call's outputs: */
#define TOL_SUM 2e-5    /* fp32 vs double sums before any rounding (scores, mixes, wo_a before bf16) */
#define TOL_BF 8e-3     /* outputs rounded to bf16 after the sums: one bf16 step (2^-7) at the largest */
#define MAX_BF_FLIPS 0.05   /* share of rounded outputs allowed a different bf16 value */

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;

static int n_diff(const float *a, const float *b, int64_t n)
{
    int k = 0;
    for (int64_t i = 0; i < n; i++) k += memcmp(a + i, b + i, 4) != 0;
    return k;
}

/* Both SIMD paths when the CPU has AVX2, else the scalar one twice. */
static int set_simd(int scalar)
{
    mf_kern_simd want = scalar ? MF_KERN_SIMD_SCALAR : MF_KERN_SIMD_AUTO;
    return mf_kern_simd_set(want);
}

/* mf_fa_hc_mixes_rows_items of ni items (of 1..MIX_NI: one four, fours, blocks of
 * mf_fa_mix_items and the rest) over row ranges of 1..nm rows and all nm, on both paths, against
 * mf_fa_hc_mixes_rows per item, memcmp; xs holds MIX_NI items' streams. Specials in some items: a
 * NaN (its mixes NaN, the others' unchanged), an inf, squares that overflow, subnormals. 1: equal. */
#define MIX_NI 70
static int mix_groups(const mf_ly_ctx *cx, const mf_weight *fn, float *xs, int nm)
{
    static const int nis[] = {1, 3, 4, 5, 8, 9, 13, 64, 70};
    int64_t n = (int64_t)cx->ly->c->hc_mult * cx->ly->c->hidden_size;
    xs[7] = NAN;
    xs[3 * n + 11] = -INFINITY;
    xs[5 * n + 2] = 3e38f;
    xs[9 * n + 1] = 1e-40f, xs[9 * n + 100] = -1e-39f;
    float gm[MIX_NI][64], gr[MIX_NI][64];
    int same = 1;
    for (int simd = 0; simd < 2; simd++) {
        CHECK(set_simd(simd) == 0, "simd %d", simd);
        for (size_t a = 0; a < sizeof nis / sizeof nis[0]; a++)
            for (int k0 = 0, w = 1; k0 < nm; w += 3) {
                int ni = nis[a], k1 = k0 + w < nm ? k0 + w : nm;
                if (w == 1 && a % 2) k1 = nm;   /* all rows at once */
                const float *xp[MIX_NI];
                float *mp[MIX_NI];
                for (int i = 0; i < ni; i++) {
                    xp[i] = xs + (size_t)i * n;
                    mp[i] = gm[i];
                    memset(gm[i], 0x5a, sizeof gm[i]);
                    memset(gr[i], 0x5a, sizeof gr[i]);
                    mf_fa_hc_mixes_rows(cx, xp[i], fn, gr[i], k0, k1);
                }
                mf_fa_hc_mixes_rows_items(cx, xp, ni, fn, mp, k0, k1);
                for (int i = 0; i < ni; i++) same &= !memcmp(gm[i], gr[i], sizeof gm[i]);
                k0 = k1;
            }
    }
    set_simd(0);
    return same;
}

/* Hyper-connection pieces: mixes within TOL_SUM, by rows = whole, scalar = AVX2; collapse and
 * expand equal to the module bit for bit, by columns, with special values among the inputs. */
static void test_hc(const mf_model *m, mf_ly_ctx *cx)
{
    const mf_config *c = mf_model_config(m);
    const mf_model_layer *y = mf_model_layer_at(m, 1);
    int64_t H = c->hidden_size;
    int hc = c->hc_mult, nm = (2 + hc) * hc;
    float *x = malloc(sizeof(float) * hc * H), *x1 = malloc(sizeof(float) * hc * H), *x2 = malloc(sizeof(float) * hc * H);
    float *out = malloc(sizeof(float) * H), *h1 = malloc(sizeof(float) * H), *h2 = malloc(sizeof(float) * H);
    float *n1 = malloc(sizeof(float) * H), *n2 = malloc(sizeof(float) * H);
    float mm[64], mf[64], mp[64], ms[64];
    float pre[MF_LY_MAX_HC], post[MF_LY_MAX_HC], comb[MF_LY_MAX_HC * MF_LY_MAX_HC];
    double worst = 0;
    int same = 1, exact = 1;
    for (int rep = 0; rep < 4; rep++) {
        for (int64_t i = 0; i < hc * H; i++) x[i] = mf_test_frand(&g_rng) * (rep + 1) * 3;
        for (int64_t i = 0; i < H; i++) out[i] = mf_test_frand(&g_rng) * 2;
        mf_ly_hc_mixes(cx, x, &y->hc_attn_fn, mm);
        mf_fa_hc_mixes_rows(cx, x, &y->hc_attn_fn, mf, 0, nm);
        for (int k0 = 0, w = 1; k0 < nm; w += 2) {
            int k1 = k0 + w < nm ? k0 + w : nm;
            mf_fa_hc_mixes_rows(cx, x, &y->hc_attn_fn, mp, k0, k1);
            k0 = k1;
        }
        CHECK(set_simd(1) == 0, "scalar path");
        mf_fa_hc_mixes_rows(cx, x, &y->hc_attn_fn, ms, 0, nm);
        set_simd(0);
        worst = fmax(worst, mf_test_max_rel(mm, mf, nm));
        same &= !memcmp(mf, mp, sizeof(float) * nm) && !memcmp(mf, ms, sizeof(float) * nm);

        mf_ly_hc_split_w(c, mm, &y->hc_attn_scale, &y->hc_attn_base, pre, post, comb);
        if (rep == 3) {   /* NaN (one per column: which NaN wins is no matter), inf, fp32 overflow, subnormals */
            x[5] = NAN;
            x[H + 9] = -INFINITY;
            x[2 * H + 17] = 3e38f;
            x[3 * H + 17] = 3e38f;
            x[40] = 1e-40f;
            out[33] = -NAN;
        }
        memcpy(x1, x, sizeof(float) * hc * H);
        memcpy(x2, x, sizeof(float) * hc * H);
        mf_ly_hc_collapse(cx, x1, pre, h1);
        mf_ly_hc_expand(cx, x1, out, post, comb);
        for (int64_t d0 = 0, w = 1; d0 < H; w += 6) {   /* unaligned column ranges */
            int64_t d1 = d0 + w < H ? d0 + w : H;
            mf_fa_hc_collapse_cols(cx, x2, pre, h2, d0, d1);
            mf_fa_hc_expand_cols(cx, x2, out, post, comb, d0, d1);
            d0 = d1;
        }
        exact &= !memcmp(h1, h2, sizeof(float) * H) && !memcmp(x1, x2, sizeof(float) * hc * H);
        mf_ly_rmsnorm(h1, H, &y->attn_norm, c->rms_norm_eps, n1);   /* the norm: the module's bits too */
        for (int64_t d0 = 0, w = 1; d0 < H; w += 6) {
            int64_t d1 = d0 + w < H ? d0 + w : H;
            mf_fa_rmsnorm_cols(h1, H, &y->attn_norm, c->rms_norm_eps, n2, d0, d1);
            d0 = d1;
        }
        exact &= !memcmp(n1, n2, sizeof(float) * H);
        CHECK(set_simd(1) == 0, "scalar path");
        memcpy(x2, x, sizeof(float) * hc * H);
        mf_fa_hc_collapse_cols(cx, x2, pre, h2, 0, H);
        mf_fa_hc_expand_cols(cx, x2, out, post, comb, 0, H);
        mf_fa_rmsnorm_cols(h1, H, &y->attn_norm, c->rms_norm_eps, n2, 0, H);
        set_simd(0);
        exact &= !memcmp(h1, h2, sizeof(float) * H) && !memcmp(x1, x2, sizeof(float) * hc * H);
        exact &= !memcmp(n1, n2, sizeof(float) * H);
    }
    /* the engine's mixes of an item group (mf_fa_hc_mixes_rows_items): per item the bits of
     * mf_fa_hc_mixes_rows, for 1..70 items (fours, blocks and the rest), row ranges of 1..nm rows,
     * both paths, with specials among the items */
    float *xs = malloc(sizeof(float) * MIX_NI * hc * H);
    for (int64_t i = 0; i < MIX_NI * hc * H; i++) xs[i] = mf_test_frand(&g_rng) * 4;
    int grouped = mix_groups(cx, &y->hc_attn_fn, xs, nm);
    free(xs);
    CHECK(grouped, "hc mixes of an item group differ from one item's");
    CHECK(worst < TOL_SUM, "hc mixes %.3g off the module (tolerance %.1g)", worst, TOL_SUM);
    CHECK(same, "hc mixes: rows or the scalar path differ from the whole AVX2 call");
    CHECK(exact, "hc collapse / expand or the norm differ from the module");
    printf("hc: mixes %.3g off the module (tolerance %.1g), rows and scalar %s; collapse, expand and norm %s the module "
           "(specials included)\n", worst, TOL_SUM, same ? "bit-identical" : "DIFFER", exact ? "bit-identical to" : "DIFFER from");
    free(x);
    free(x1);
    free(x2);
    free(out);
    free(h1);
    free(h2);
    free(n1);
    free(n2);
}

/* The item groups' mixes at shapes the tiny preset lacks (a context of the fields the mixes read):
 * hc x hidden a multiple of 16 with a last column block of 288 (hidden 200), and not a multiple
 * of 16 (hidden 203: the scalar lanes on both paths), 24 rows of fresh random fp32 weights. */
static void test_mix_shapes(void)
{
    static const int hs[] = {200, 203};
    int all = 1;
    for (size_t h = 0; h < sizeof hs / sizeof hs[0]; h++) {
        mf_config c = {.hidden_size = hs[h], .hc_mult = 4, .rms_norm_eps = 1e-6};
        mf_layers ly = {.c = &c};
        int64_t n = 4 * (int64_t)hs[h];
        float *w = malloc(sizeof(float) * 24 * n), *xs = malloc(sizeof(float) * MIX_NI * n);
        mf_ly_ctx cx = {.ly = &ly, .hc_xn = malloc(sizeof(float) * 4 * n)};
        for (int64_t i = 0; i < 24 * n; i++) w[i] = mf_test_frand(&g_rng) * 0.1f;
        for (int64_t i = 0; i < MIX_NI * n; i++) xs[i] = mf_test_frand(&g_rng) * 4;
        mf_weight fn = {.kind = MF_W_F32, .rows = 24, .cols = n, .data = (const uint8_t *)w};
        int same = mix_groups(&cx, &fn, xs, 24);
        CHECK(same, "hc mixes of an item group differ from one item's at hidden %d", hs[h]);
        all &= same;
        free(w);
        free(xs);
        free(cx.hc_xn);
    }
    printf("hc mixes of item groups at hidden 200 and 203: %s\n", all ? "per item bit-identical" : "DIFFER");
}

/* The grouped wo_a on the kernels against the module's double sums (kernel contexts both), in row
 * ranges across the groups. */
static void test_grouped(const mf_model *m, mf_ly_ctx *kern)
{
    const mf_config *c = mf_model_config(m);
    mf_ly_attn_lin lin[MF_LY_A_MAX_LIN];
    int n = mf_ly_attn_linears(kern->ly, 0, MF_LY_A_STAGE_OA, lin);
    CHECK(n == 1 && lin[0].groups > 0, "wo_a is not one grouped linear");
    if (n != 1) return;
    const mf_ly_attn_lin *l = &lin[0];
    int nt = 19;
    int64_t ldx = mf_ly_attn_buf_len(c, MF_LY_A_O) + 3, ldy = l->w->rows + 5, R = l->w->rows;
    float *x = malloc(sizeof(float) * nt * ldx), *y1 = calloc((size_t)nt * ldy, 4), *y2 = calloc((size_t)nt * ldy, 4);
    float *y3 = calloc((size_t)nt * ldy, 4);
    for (int64_t i = 0; i < nt * ldx; i++) x[i] = mf_test_frand(&g_rng);
    mf_ly_attn_lin nb = *l;
    nb.bf = 0;   /* before the rounding: the sums themselves */
    CHECK(mf_ly_attn_lin_rows(kern, &nb, x, ldx, y1, ldy, nt, 0, R) == 0, "module wo_a: %s", mf_last_error());
    CHECK(mf_fa_grouped_rows(kern, &nb, x, ldx, y2, ldy, nt, 0, R) == 0, "fast wo_a: %s", mf_last_error());
    double worst = mf_test_max_rel(y1, y2, nt * ldy);
    CHECK(worst < TOL_SUM, "wo_a %.3g off the module (tolerance %.1g)", worst, TOL_SUM);
    for (int64_t r0 = 0, w = 1; r0 < R; w += 37) {
        int64_t r1 = r0 + w < R ? r0 + w : R;
        CHECK(mf_fa_grouped_rows(kern, &nb, x, ldx, y3, ldy, nt, r0, r1) == 0, "fast wo_a rows");
        r0 = r1;
    }
    CHECK(!memcmp(y2, y3, sizeof(float) * nt * ldy), "wo_a row ranges differ from the whole");
    printf("wo_a on the kernels: %.3g off the module (tolerance %.1g), row ranges %s\n", worst, TOL_SUM,
           !memcmp(y2, y3, sizeof(float) * nt * ldy) ? "bit-identical" : "DIFFER");
    free(x);
    free(y1);
    free(y2);
    free(y3);
}

/* The router gate on the kernels against the module's double sums (kernel contexts both), over
 * 19 items (the kernels' GEMM) and one item at a time (their per-row tile), in row ranges, and on
 * the scalar path. */
static void test_gate(const mf_model *m, mf_ly_ctx *kern)
{
    const mf_config *c = mf_model_config(m);
    int L = c->n_layers - 1, nt = 19;
    const mf_weight *w = &mf_model_layer_at(m, L)->gate;
    CHECK(mf_ly_linear_kern(w), "the tiny preset's gate is not on the kernels (kind %d)", (int)w->kind);
    int64_t H = c->hidden_size, E = w->rows, ldx = H + 3, ldy = E + 5;
    size_t ny = (size_t)nt * ldy;
    float *x = malloc(sizeof(float) * nt * ldx), *y1 = calloc(ny, 4), *y2 = calloc(ny, 4), *y3 = calloc(ny, 4);
    float *y4 = calloc(ny, 4);
    for (int64_t i = 0; i < nt * ldx; i++) x[i] = mf_test_frand(&g_rng);
    CHECK(mf_ly_gate_rows(kern, L, x, nt, ldx, y1, ldy, 0, E) == 0, "module gate: %s", mf_last_error());
    CHECK(mf_fa_gate_rows(kern, L, x, nt, ldx, y2, ldy, 0, E) == 0, "fast gate: %s", mf_last_error());
    double worst = mf_test_max_rel(y1, y2, (int64_t)ny);
    CHECK(worst < TOL_SUM, "gate %.3g off the module (tolerance %.1g)", worst, TOL_SUM);
    for (int64_t r0 = 0, k = 1; r0 < E; k += 5) {   /* row ranges, one item per call */
        int64_t r1 = r0 + k < E ? r0 + k : E;
        for (int t = 0; t < nt; t++)
            CHECK(mf_fa_gate_rows(kern, L, x + t * ldx, 1, ldx, y3 + t * ldy, ldy, r0, r1) == 0, "fast gate rows");
        r0 = r1;
    }
    int same = !memcmp(y2, y3, sizeof(float) * ny);
    CHECK(same, "gate: row ranges of one item differ from the whole batch");
    CHECK(set_simd(1) == 0, "scalar path");
    CHECK(mf_fa_gate_rows(kern, L, x, nt, ldx, y4, ldy, 0, E) == 0, "fast gate, scalar: %s", mf_last_error());
    set_simd(0);
    int same_s = !memcmp(y2, y4, sizeof(float) * ny);
    CHECK(same_s, "gate: the scalar path differs from the AVX2 path");
    printf("router gate on the kernels: %.3g off the module (tolerance %.1g), one item and row ranges %s, "
           "scalar %s\n", worst, TOL_SUM, same ? "bit-identical" : "DIFFER", same_s ? "bit-identical" : "DIFFERS");
    free(x);
    free(y1);
    free(y2);
    free(y3);
    free(y4);
}

/* Attention heads and index scores on states past the window with compressed entries, per layer:
 * the module's prep (kv, scores, select), then the heads by the module and by the fast version
 * (whole, in head groups, scalar), and the index scores by both (whole, ranges, scalar). */
static void test_core(mf_ref *r, mf_ly_ctx *cx)
{
    const mf_layers *ly = mf_ref_layers(r);
    const mf_config *c = ly->c;
    int np = 2 * (int)c->sliding_window + 7, nh = c->n_heads;
    int64_t nq = mf_ly_attn_buf_len(c, MF_LY_A_Q), no = mf_ly_attn_buf_len(c, MF_LY_A_O);
    mf_ref_state *st = NULL;
    int32_t p[64];
    for (int i = 0; i < np; i++) p[i] = (int32_t)((i * 37 + 5) % c->vocab_size);
    CHECK(mf_ref_state_new(r, np + 4, &st) == 0 && mf_ref_prefill(r, st, p, np, NULL) == 0, "state: %s",
          mf_last_error());
    if (!st) return;
    CHECK(mf_ly_ctx_reserve(cx, np + 4) == 0, "reserve");
    float *buf[MF_LY_A_N];
    int32_t topk[1024], cand[1024];
    mf_ly_item it = {.st = st, .pos = np, .tok = 3, .topk = topk, .topk_src = -1, .cand = cand, .cand_src = -1};
    for (int b = 0; b < MF_LY_A_N; b++) buf[b] = malloc(sizeof(float) * (mf_ly_attn_buf_len(c, b) + 1));
    float *q0 = malloc(sizeof(float) * nq), *o_mod = malloc(sizeof(float) * no), *o_fast = malloc(sizeof(float) * no);
    double sm[128], sf[128], sp[128], ss[128];
    float fm[128], ff[128];
    double worst_o = 0, worst_s = 0;
    int same = 1, flips = 0, n_out = 0, n_sel = 0, n_scored = 0;
    for (int L = 0; L < c->n_layers; L++) {
        for (int b = 0; b < MF_LY_A_N; b++)
            for (int64_t i = 0; i < mf_ly_attn_buf_len(c, b); i++) buf[b][i] = mf_test_frand(&g_rng);
        CHECK(mf_ly_attn_core_kv(cx, &it, L, buf) == 0, "prep: %s", mf_last_error());
        int64_t n_vis = mf_ly_index_n_vis(c, L, np);
        if (n_vis > 0) {
            CHECK(n_vis <= 128, "scores buffer");
            mf_ly_index_scores(ly, &it, L, buf, sm, 0, n_vis);
            mf_fa_index_scores(ly, &it, L, buf, sf, 0, n_vis);
            for (int64_t j0 = 0, w = 1; j0 < n_vis; w += 2) {
                int64_t j1 = j0 + w < n_vis ? j0 + w : n_vis;
                mf_fa_index_scores(ly, &it, L, buf, sp, j0, j1);
                j0 = j1;
            }
            CHECK(set_simd(1) == 0, "scalar path");
            mf_fa_index_scores(ly, &it, L, buf, ss, 0, n_vis);
            set_simd(0);
            for (int64_t j = 0; j < n_vis; j++) {
                fm[j] = (float)sm[j];
                ff[j] = (float)sf[j];
                same &= sf[j] == sp[j] && sf[j] == ss[j];
            }
            worst_s = fmax(worst_s, mf_test_max_rel(fm, ff, n_vis));
            n_scored += (int)n_vis;
        }
        mf_ly_attn_core_select(cx, &it, L, sm);
        mf_ly_win win = {.kv = buf[MF_LY_A_KV], .ld = 0, .pos0 = np};
        memcpy(q0, buf[MF_LY_A_Q], sizeof(float) * nq);
        mf_ly_attn_core_heads(cx, &it, L, buf, 0, nh, &win);
        memcpy(o_mod, buf[MF_LY_A_O], sizeof(float) * no);
        memcpy(buf[MF_LY_A_Q], q0, sizeof(float) * nq);
        mf_fa_attn_heads(cx, &it, L, buf, 0, nh, &win);
        memcpy(o_fast, buf[MF_LY_A_O], sizeof(float) * no);
        worst_o = fmax(worst_o, mf_test_max_rel(o_mod, o_fast, no));
        flips += n_diff(o_mod, o_fast, no);
        n_out += (int)no;
        for (int h0 = 0, g = 1; h0 < nh; g++) {   /* head groups 1, 2, 3 ... */
            int h1 = h0 + g < nh ? h0 + g : nh;
            memcpy(buf[MF_LY_A_Q], q0, sizeof(float) * nq);
            mf_fa_attn_heads(cx, &it, L, buf, h0, h1, &win);
            h0 = h1;
        }
        same &= !memcmp(o_fast, buf[MF_LY_A_O], sizeof(float) * no);
        CHECK(set_simd(1) == 0, "scalar path");
        memcpy(buf[MF_LY_A_Q], q0, sizeof(float) * nq);
        mf_fa_attn_heads(cx, &it, L, buf, 0, nh, &win);
        set_simd(0);
        same &= !memcmp(o_fast, buf[MF_LY_A_O], sizeof(float) * no);
        {   /* the queries' and outputs' roundings (8 lanes under AVX2) with specials and ties: the scalar path's bits */
            float *qa = malloc(sizeof(float) * nq), *qs = malloc(sizeof(float) * nq);
            memcpy(qa, q0, sizeof(float) * nq);
            qa[1] = NAN, qa[2] = -INFINITY, qa[3] = 3.4e38f, qa[4] = 1e-41f, qa[5] = 1.00390625f, qa[nq - 1] = -0.0f;
            memcpy(qs, qa, sizeof(float) * nq);
            mf_fa_heads_q(ly, &it, L, qa, 0, nh);
            mf_fa_heads_o(ly, &it, L, qa, 0, nh);
            CHECK(set_simd(1) == 0, "scalar path");
            mf_fa_heads_q(ly, &it, L, qs, 0, nh);
            mf_fa_heads_o(ly, &it, L, qs, 0, nh);
            set_simd(0);
            same &= !memcmp(qa, qs, sizeof(float) * nq);
            free(qa);
            free(qs);
        }
        CHECK(same, "layer %d: fast heads or scores differ between parts, groups or SIMD paths", L);
        mf_ly_attn_ring_write(cx, &it, L, buf[MF_LY_A_KV]);
        n_sel += it.topk_src >= 0 ? it.n_topk : 0;
    }
    CHECK(n_sel > 0 && n_scored > 0, "no selection or no scores: the test does not reach them");
    CHECK(worst_s < TOL_SUM, "index scores %.3g off the module (tolerance %.1g)", worst_s, TOL_SUM);
    CHECK(worst_o < TOL_BF && flips <= MAX_BF_FLIPS * n_out, "heads %.3g off the module, %d of %d outputs another "
          "bf16 value (tolerance %.1g, %.0f%%)", worst_o, flips, n_out, TOL_BF, 100 * MAX_BF_FLIPS);
    printf("heads: %.3g off the module, %d of %d outputs another bf16 value (tolerance %.1g, %.0f%%); index scores "
           "%.3g (tolerance %.1g); %d selected entries; head groups, ranges and scalar %s\n",
           worst_o, flips, n_out, TOL_BF, 100 * MAX_BF_FLIPS, worst_s, TOL_SUM, n_sel, same ? "bit-identical" : "DIFFER");
    for (int b = 0; b < MF_LY_A_N; b++) free(buf[b]);
    free(q0);
    free(o_mod);
    free(o_fast);
    mf_ref_state_free(st);
}

/* The selection on long random score rows (few distinct levels: ties broken by the index; some
 * -inf), every compressed layer in order on twin items (candidate blocks, then their mask on the
 * later index layers): the module's items and the fast version's hold the same top-k and blocks. */
static void test_select(mf_ref *r, mf_ly_ctx *cx)
{
    const mf_layers *ly = mf_ref_layers(r);
    const mf_config *c = ly->c;
    int64_t pos = 3001;
    CHECK(mf_ly_ctx_reserve(cx, pos + 1) == 0, "reserve");
    double *s1 = malloc(sizeof(double) * (pos + 1)), *s2 = malloc(sizeof(double) * (pos + 1));
    int32_t *tk[2], *cd[2];
    for (int k = 0; k < 2; k++) {
        tk[k] = malloc(sizeof(int32_t) * c->index_topk);
        cd[k] = malloc(sizeof(int32_t) * c->candidate_topk_blocks);
    }
    int same = 1, n_layers = 0, n_cand = 0;
    int64_t max_vis = 0;
    for (int rep = 0; rep < 6; rep++) {
        mf_ly_item it[2];
        for (int k = 0; k < 2; k++)
            it[k] = (mf_ly_item){.pos = pos - rep * 397, .topk = tk[k], .topk_src = -1, .cand = cd[k], .cand_src = -1};
        for (int L = 0; L < c->n_layers; L++) {
            int64_t n_vis = mf_ly_index_n_vis(c, L, it[0].pos);
            for (int64_t j = 0; j < n_vis; j++) {
                double v = rep % 2 ? (double)(int)(mf_test_frand(&g_rng) * 6) : mf_test_frand(&g_rng);   /* ties on odd reps */
                s1[j] = s2[j] = mf_test_frand(&g_rng) > 0.9f ? -INFINITY : v;
            }
            mf_ly_attn_core_select(cx, &it[0], L, s1);
            mf_fa_attn_select(cx, &it[1], L, s2);
            same &= it[0].n_topk == it[1].n_topk && it[0].topk_src == it[1].topk_src &&
                    !memcmp(tk[0], tk[1], sizeof(int32_t) * it[0].n_topk) && it[0].n_cand == it[1].n_cand &&
                    it[0].cand_src == it[1].cand_src && !memcmp(cd[0], cd[1], sizeof(int32_t) * it[0].n_cand);
            n_layers += n_vis > 0;
            max_vis = n_vis > max_vis ? n_vis : max_vis;
            n_cand += it[0].n_cand;
        }
    }
    CHECK(same, "fast selection differs from the module's");
    CHECK(n_layers > 0 && n_cand > 0, "the selection test reaches no scored layer or no candidate blocks");
    printf("select: %d scored layer rows of up to %lld entries: top-k and candidate blocks %s the module's\n",
           n_layers, (long long)max_vis, same ? "equal to" : "DIFFER from");
    free(s1);
    free(s2);
    for (int k = 0; k < 2; k++) {
        free(tk[k]);
        free(cd[k]);
    }
}

#define N_SEQ 3
#define NP 40   /* past two windows of tiny (16) */
#define ND 4

/* Prefill NP tokens of N_SEQ sequences (one token per call with one, else whole) and ND batch
 * decode steps (per sequence with one); logits[s][0..ND]. */
static int run(mf_ref *r, mf_step *e, int64_t V, float *logits, int one)
{
    mf_ref_state *st[N_SEQ] = {0};
    int rc = 0;
    for (int s = 0; s < N_SEQ && !rc; s++) {
        int32_t p[NP];
        for (int i = 0; i < NP; i++) p[i] = (int32_t)((i * 53 + s * 89 + 7) % V);
        rc = mf_ref_state_new(r, NP + ND + 1, &st[s]);
        float *lg = logits + (size_t)s * (1 + ND) * V;
        for (int q = 0; one && q < NP && !rc; q++) rc = mf_step_prefill(e, st[s], p + q, 1, lg);
        if (!rc && !one) rc = mf_step_prefill(e, st[s], p, NP, lg);
    }
    float *step = malloc(sizeof(float) * N_SEQ * V);
    for (int k = 0; k < ND && !rc; k++) {
        int32_t t[N_SEQ];
        for (int s = 0; s < N_SEQ; s++) t[s] = (int32_t)((k * 31 + s * 13 + 1) % V);
        for (int s = 0; one && s < N_SEQ && !rc; s++) rc = mf_step_decode(e, st + s, t + s, 1, step + (size_t)s * V);
        if (!one) rc = mf_step_decode(e, st, t, N_SEQ, step);
        for (int s = 0; s < N_SEQ && !rc; s++)
            memcpy(logits + ((size_t)s * (1 + ND) + 1 + k) * V, step + (size_t)s * V, sizeof(float) * V);
    }
    free(step);
    for (int s = 0; s < N_SEQ; s++) mf_ref_state_free(st[s]);
    return rc;
}

/* The default path's bits across worker counts and chunk sizes (the fast pieces inside it). */
static void test_engine(mf_ref *r, int64_t V)
{
    size_t per = (size_t)N_SEQ * (1 + ND) * V;
    float *one = malloc(sizeof(float) * per), *got = malloc(sizeof(float) * per);
    static const int workers[] = {1, 2, 3, 8};
    int nw = MF_TEST_TSAN ? 2 : 4, same = 1;
    mf_step *e = NULL;
    CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 1}, &e) == 0, "step: %s", mf_last_error());
    if (!e) goto out;
    CHECK(run(r, e, V, one, 1) == 0, "engine, one token per call: %s", mf_last_error());
    mf_step_free(e);
    for (int wi = 0; wi < nw; wi++) {
        int w = MF_TEST_TSAN ? (wi ? 8 : 1) : workers[wi];
        for (int chunk = 7; chunk <= 64; chunk += 57) {
            CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = w, .prefill_chunk = chunk}, &e) == 0, "step: %s",
                  mf_last_error());
            if (!e) continue;
            CHECK(run(r, e, V, got, 0) == 0, "engine, %d workers: %s", w, mf_last_error());
            mf_step_free(e);
            same &= !memcmp(one, got, sizeof(float) * per);
            CHECK(same, "default path, %d workers, chunks of %d: differs from one token per call", w, chunk);
        }
    }
    printf("engine default path: %d-token prefills in chunks of 7 and 64 + batch-%d decodes on %s workers %s one "
           "token per call\n", NP, N_SEQ, MF_TEST_TSAN ? "1, 8" : "1, 2, 3, 8", same ? "bit-identical to" : "DIFFER from");
out:
    free(one);
    free(got);
}

/* The combine's sum (mf_fa_combine_cols) against its plain loop (each column: the outputs' roundings
 * summed in double in their order, the shared output, the sum rounded) bit for bit, for 1..9
 * outputs with and without the shared one, unaligned column ranges, special values, both paths,
 * with every row fp32 and with some rows read from their bf16 codes (the cards' rows, row16);
 * and mf_fa_rmsnorm_cols over fp32 and bf16 weights against mf_ly_rmsnorm_cols, both paths. */
static void test_combine(void)
{
    enum { H = 203, NR = 12, NO = 9 };
    float *y = malloc(sizeof(float) * NR * H), sh[H], want[H], got[H], wf[H];
    uint16_t wb[H], *y16 = malloc(sizeof(uint16_t) * NR * H);
    uint8_t row16[NR];
    int32_t rows[NO];
    int same = 1;
    for (int64_t i = 0; i < NR * H; i++) y[i] = mf_test_frand(&g_rng) * 8;
    for (int i = 0; i < H; i++) {
        sh[i] = mf_bf16_round(mf_test_frand(&g_rng) * 4);
        wf[i] = mf_test_frand(&g_rng) * 2;
        float b = mf_bf16_round(wf[i]);
        uint32_t u;
        memcpy(&u, &b, 4);
        wb[i] = (uint16_t)(u >> 16);
    }
    y[3] = NAN;
    y[H + 17] = INFINITY;
    y[2 * H + 17] = -INFINITY;
    y[3 * H + 40] = 3e38f;
    y[4 * H + 40] = 3e38f;
    y[5 * H + 41] = 1e-40f;
    y[6 * H + 50] = -0.0f;
    sh[60] = -0.0f;
    for (int64_t i = 0; i < NR * H; i++) y16[i] = mf_bf16_from_f32(y[i]);
    for (int r = 0; r < NR; r++) row16[r] = (uint8_t)(r % 3 == 1);
    for (int simd = 0; simd < 2; simd++) {
        CHECK(set_simd(simd) == 0, "simd %d", simd);
        for (int n = 1; n <= NO; n++)
            for (int with_sh = 0; with_sh < 2; with_sh++) {
                for (int k = 0; k < n; k++) rows[k] = (int32_t)((k * 5 + n) % NR);
                for (int d = 0; d < H; d++) {
                    double acc = 0;
                    for (int k = 0; k < n; k++) acc += mf_bf16_round(y[(size_t)rows[k] * H + d]);
                    if (with_sh) acc += sh[d];
                    want[d] = mf_bf16_round((float)acc);
                }
                for (int b16 = 0; b16 < 2; b16++) {   /* the rows r % 3 == 1 from their codes */
                    memset(got, 0x5a, sizeof got);
                    for (int64_t d0 = 0, w = 1; d0 < H; w += 5) {
                        int64_t d1 = d0 + w < H ? d0 + w : H;
                        mf_fa_combine_cols(y, b16 ? y16 : NULL, b16 ? row16 : NULL, H, rows, n, with_sh ? sh : NULL,
                                           got, d0, d1);
                        d0 = d1;
                    }
                    same &= n_diff(want, got, H) == 0;
                }
            }
        /* the norm: 8 columns at a time against the module's loop, both weight kinds */
        mf_weight w32 = {.kind = MF_W_F32, .rows = H, .cols = 1, .data = (uint8_t *)wf};
        mf_weight w16 = {.kind = MF_W_BF16, .rows = H, .cols = 1, .data = (uint8_t *)wb};
        for (int kind = 0; kind < 2; kind++) {
            const mf_weight *w = kind ? &w16 : &w32;
            mf_ly_rmsnorm_cols(y + 7 * H, H, w, 1e-6, want, 0, H);
            for (int64_t d0 = 0, wd = 1; d0 < H; wd += 5) {
                int64_t d1 = d0 + wd < H ? d0 + wd : H;
                mf_fa_rmsnorm_cols(y + 7 * H, H, w, 1e-6, got, d0, d1);
                d0 = d1;
            }
            same &= n_diff(want, got, H) == 0;
        }
    }
    set_simd(0);
    CHECK(same, "mf_fa_combine_cols / mf_fa_rmsnorm_cols differ from their plain loops");
    free(y);
    free(y16);
}

int main(void)
{
    mf_config c;
    char dir[1024];
    CHECK(mf_config_preset("tiny", &c) == 0, "preset");
    if (mf_test_gen_ckpt(&c, "fast_attn_tiny", dir, sizeof dir)) return 1;
    mf_model *m = NULL;
    CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1}, &m) == 0, "load: %s", mf_last_error());
    if (!m) return mf_check_exit("test_fast_attn");
    if (mf_kern_simd_active() != MF_KERN_SIMD_AVX2) printf("no AVX2 here: the scalar path only\n");
    mf_ref *oracle = NULL;
    mf_ly_ctx *kern = NULL;
    CHECK(mf_ref_new(m, NULL, &oracle) == 0, "ref: %s", mf_last_error());
    if (oracle) CHECK(mf_ly_ctx_new(mf_ref_layers(oracle), MF_LY_LIN_KERN, &kern) == 0, "context: %s", mf_last_error());
    if (kern) {
        if (!MF_TEST_TSAN) {   /* one thread: nothing for TSan */
            test_hc(m, kern);
            test_mix_shapes();
            test_combine();
            test_grouped(m, kern);
            test_gate(m, kern);
            test_core(oracle, kern);
            test_select(oracle, kern);
        }
        test_engine(oracle, c.vocab_size);
    }
    mf_ly_ctx_free(kern);
    mf_ref_free(oracle);
    mf_model_free(m);
    return mf_check_exit("test_fast_attn");
}
