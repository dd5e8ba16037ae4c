/* `moeflow bench ref`: the reference code's scalar loops that the decode engine still runs (the
 * grouped wo_a and the gate through mf_ly_linear_rows, the hyper-connection mixes, bf16
 * roundings), in ns per unit, and with --profile their weights against the profile's
 * host_ref_macs_per_s: the ratios graphs/sim/plan.c builds in (docs/sim.md "Weights"); then the
 * engine's hyper-connection mixes of an item group, blocked against in fours (--mixes: only that). */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/layers/layers.h"
#include "graphs/step/fast_attn.h"
#include "host/kernels.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "sched/profile.h"
#include "tools/commands.h"

#define MF_BR_POOL (256u << 20)   /* weights cycle through this, out of the last-level cache */
#define MF_BR_N 65536

static int mf_br_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct mf_br {
    uint8_t *pool;
    float *x, *y;
    int k;
} mf_br;

/* One timed unit of work on the pool's next copy; returns the units it did. */
typedef double (*mf_br_fn)(mf_br *b, size_t each);

static double mf_br_dot_fp8(mf_br *b, size_t each)
{
    uint8_t *w = b->pool + (size_t)(b->k++ % (int)(MF_BR_POOL / each)) * each;
    mf_weight mw = {.kind = MF_W_FP8, .rows = 1024, .cols = 512, .data = w, .scale = w + 1024 * 512,
                    .block_rows = 32, .block_cols = 32};
    mf_ly_linear_rows(NULL, &mw, 0, 1024, b->x, 512, 0, b->y);
    return 1024.0 * 512;
}

static double mf_br_dot_bf16(mf_br *b, size_t each)
{
    uint8_t *w = b->pool + (size_t)(b->k++ % (int)(MF_BR_POOL / each)) * each;
    mf_weight mw = {.kind = MF_W_BF16, .rows = 64, .cols = 1024, .data = w};
    mf_ly_linear_rows(NULL, &mw, 0, 64, b->x, 1024, 0, b->y);
    return 64.0 * 1024;
}

/* mf_ly_hc_mixes' loop: rms-normalize 4096 inputs, 24 rows of fp32 weights summed in double */
static double mf_br_mix(mf_br *b, size_t each)
{
    const uint8_t *w = b->pool + (size_t)(b->k++ % (int)(MF_BR_POOL / each)) * each;
    double ss = 0;
    for (int i = 0; i < 4096; i++) ss += (double)b->x[i] * b->x[i];
    float rs = (float)(1.0 / sqrt(ss / 4096 + 1e-6));
    for (int i = 0; i < 4096; i++) b->y[i] = b->x[i] * rs;
    for (int m = 0; m < 24; m++) {
        double acc = 0;
        for (int i = 0; i < 4096; i++) {
            float v;
            memcpy(&v, w + ((size_t)m * 4096 + i) * 4, 4);
            acc += (double)v * b->y[i];
        }
        b->y[4096 + m] = (float)acc;
    }
    return 24.0 * 4096;
}

/* one mf_bf at a time (the module's loops round inline; mf_bf_n is now the 8-lane kernel, below) */
static double mf_br_round(mf_br *b, size_t each)
{
    (void)each;
    memcpy(b->y, b->x, sizeof(float) * MF_BR_N);
    for (int i = 0; i < MF_BR_N; i++) {
        float v = mf_bf(b->y[i]);
        __asm__ volatile("" : "+x"(v));   /* kept one at a time: not vectorized by the compiler */
        b->y[i] = v;
    }
    return MF_BR_N;
}

/* mf_bf_n (mf_kern_vec_bf16_round: 8 lanes under AVX2), what SG_W_ROUND_VEC prices in host_vec MACs */
static double mf_br_round_vec(mf_br *b, size_t each)
{
    (void)each;
    memcpy(b->y, b->x, sizeof(float) * MF_BR_N);
    mf_bf_n(b->y, MF_BR_N);
    return MF_BR_N;
}

/* The engine's vector column loops (graphs/step/fast_attn.c) at flash41's shape (hidden 5120, 4
 * streams, 6 routed outputs and the shared one), in cache: what SG_W_COMBINE_VEC, SG_W_EXPAND_VEC,
 * SG_W_COLLAPSE_VEC and SG_W_NORM_VEC price in host_vec MACs. */
#define MF_BR_H 5120
#define MF_BR_HC 4
#define MF_BR_K 6

static mf_ly_ctx *mf_br_cx(void)
{
    static mf_config c;
    static mf_layers ly;
    static mf_ly_ctx cx;
    c.hidden_size = MF_BR_H;
    c.hc_mult = MF_BR_HC;
    c.rms_norm_eps = 1e-6;
    ly.c = &c;
    cx.ly = &ly;
    return &cx;
}

/* mf_fa_combine_cols: per column and summed output (6 routed and the shared one) */
static double mf_br_combine(mf_br *b, size_t each)
{
    (void)each;
    static const int32_t rows[MF_BR_K] = {5, 2, 7, 0, 3, 6};
    mf_fa_combine_cols(b->x, NULL, NULL, MF_BR_H, rows, MF_BR_K, b->x + 8 * MF_BR_H, b->y, 0, MF_BR_H);
    return (double)MF_BR_H * (MF_BR_K + 1);
}

/* mf_fa_hc_expand_cols: per column and stream */
static double mf_br_expand(mf_br *b, size_t each)
{
    (void)each;
    static const float post[MF_BR_HC] = {0.5f, 1.25f, 0.75f, 1.0f};
    static const float comb[MF_BR_HC * MF_BR_HC] = {0.25f, 0.5f, 0.125f, 0.125f, 0.5f, 0.25f, 0.125f, 0.125f,
                                                   0.125f, 0.125f, 0.5f, 0.25f, 0.125f, 0.125f, 0.25f, 0.5f};
    memcpy(b->y, b->x, sizeof(float) * MF_BR_HC * MF_BR_H);   /* the streams, fresh (the copy is timed too) */
    mf_fa_hc_expand_cols(mf_br_cx(), b->y, b->x + 8 * MF_BR_H, post, comb, 0, MF_BR_H);
    return (double)MF_BR_H * MF_BR_HC;
}

/* mf_fa_hc_collapse_cols: per column and stream */
static double mf_br_collapse(mf_br *b, size_t each)
{
    (void)each;
    static const float pre[MF_BR_HC] = {0.5f, 0.25f, 0.75f, 1.0f};
    mf_fa_hc_collapse_cols(mf_br_cx(), b->x, pre, b->y, 0, MF_BR_H);
    return (double)MF_BR_H * MF_BR_HC;
}

/* mf_fa_rmsnorm_cols over bf16 weights: per column (its column loop; the sum of squares over all
 * columns, which every part of a norm redoes, is the scalar double loop priced at host_ref) */
static double mf_br_norm(mf_br *b, size_t each)
{
    (void)each;
    mf_weight w = {.kind = MF_W_BF16, .rows = MF_BR_H, .cols = 1, .data = b->pool};   /* finite bf16, in cache */
    mf_fa_rmsnorm_cols(b->x, 8, &w, 1e-6, b->y, 0, MF_BR_H);   /* the scale over 8: the column loop timed */
    return (double)MF_BR_H;
}

/* mf_kern_vec_dots, 4 queries of 1024 floats against 16 keys in cache: host_vec's loop in this run,
 * the unit of the vector loops' weights (as `moeflow calibrate` times host_vec) */
static double mf_br_vec_dots(mf_br *b, size_t each)
{
    (void)each;
    const float *q[4] = {b->x, b->x + 1024, b->x + 2048, b->x + 3072};
    float out[4], sum = 0;
    for (int k = 0; k < 16; k++) {
        mf_kern_vec_dots(q, 4, b->x + 4096 + (size_t)k * 1024, 1024, out);
        sum += out[0];
    }
    b->y[0] = sum;
    return 4.0 * 16 * 1024;
}

/* The engine's hyper-connection mixes of an item group at flash41's shape (4 streams of 5120, a
 * mix's 24 rows of fp32 weights: a prefill group's one row part; 6: a decode item's part of 4), 1
 * thread, weights and streams out of cache (pools rotated call by call): mf_fa_hc_mixes_rows_items
 * on the whole group (the kernel as the engine runs it: fours up to 4 items, else blocks of
 * mf_fa_mix_items) against the same calls on up to 4 items at a time (the kernel before the
 * blocked one), in interleaved rounds of the same run. */
#define MF_BR_MIX_N (MF_BR_HC * MF_BR_H)
#define MF_BR_MIX_W 32   /* weight copies of 24 rows (63 MB) */
#define MF_BR_MIX_X 8    /* stream sets of MF_FA_MIX_ITEMS items (42 MB) */

typedef struct mf_br_group {
    mf_ly_ctx *cx;
    const float *w, *x;
    float (*out)[64];
    int k;
} mf_br_group;

/* One call (fours = 0) or calls of up to four (fours = 1) over ni items and R rows: MACs done. */
static double mf_br_mix_run(mf_br_group *m, int ni, int R, int fours)
{
    int k = m->k++;
    const float *w = m->w + (size_t)(k % MF_BR_MIX_W) * 24 * MF_BR_MIX_N;
    const float *x = m->x + (size_t)(k % MF_BR_MIX_X) * MF_FA_MIX_ITEMS * MF_BR_MIX_N;
    mf_weight fn = {.kind = MF_W_F32, .rows = 24, .cols = MF_BR_MIX_N, .data = (const uint8_t *)w};
    const float *xp[MF_FA_MIX_ITEMS];
    float *mp[MF_FA_MIX_ITEMS];
    for (int i = 0; i < ni; i++) xp[i] = x + (size_t)i * MF_BR_MIX_N, mp[i] = m->out[i];
    int step = fours ? MF_FA_MIX_FOURS : ni;
    for (int i0 = 0; i0 < ni; i0 += step)
        mf_fa_hc_mixes_rows_items(m->cx, xp + i0, ni - i0 < step ? ni - i0 : step, &fn, mp + i0, 0, R);
    return (double)ni * R * MF_BR_MIX_N;
}

static int mf_br_mixes(void)
{
    size_t wn = (size_t)MF_BR_MIX_W * 24 * MF_BR_MIX_N, xn = (size_t)MF_BR_MIX_X * MF_FA_MIX_ITEMS * MF_BR_MIX_N;
    float *w = malloc(sizeof(float) * wn), *x = malloc(sizeof(float) * xn);
    float (*out)[64] = malloc(sizeof(float) * 64 * MF_FA_MIX_ITEMS);
    mf_ly_ctx *cx = mf_br_cx();
    cx->hc_xn = malloc(sizeof(float) * 4 * MF_BR_MIX_N);   /* layers.c's size */
    if (!w || !x || !out || !cx->hc_xn) {
        free(w), free(x), free(out), free(cx->hc_xn);
        fprintf(stderr, "moeflow bench ref: out of memory\n");
        return 1;
    }
    uint32_t s = 7;
    for (size_t i = 0; i < wn; i++) s = s * 1664525u + 1013904223u, w[i] = (float)((int)(s >> 9) % 2001 - 1000) * 1e-4f;
    for (size_t i = 0; i < xn; i++) s = s * 1664525u + 1013904223u, x[i] = (float)((int)(s >> 9) % 2001 - 1000) * 1e-3f;
    mf_br_group m = {.cx = cx, .w = w, .x = x, .out = out};
    static const int cases[][2] = {{1, 6}, {1, 24}, {4, 24}, {8, 24}, {16, 24}, {64, 24}};
    printf("hc mixes of an item group (4 x 5120 streams, fp32 rows; weights and streams out of cache, 1 thread):\n"
           "  %-14s %6s %10s %10s %8s   %s\n", "items x rows", "block", "fours ns", "group ns", "ratio", "ratio range (11 rounds)");
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int ni = cases[c][0], R = cases[c][1];
        double t[2][11], r[11];
        for (int rd = 0; rd < 11; rd++)
            for (int f = 1; f >= 0; f--) {   /* the fours first, then the group, each >= 20 ms */
                double macs = 0;
                int64_t t0 = mf_now_ns();
                do macs += mf_br_mix_run(&m, ni, R, f);
                while (mf_now_ns() - t0 < 20000000);
                t[f][rd] = (mf_now_ns() - t0) / macs;
                if (!f) r[rd] = t[1][rd] / t[0][rd];
            }
        qsort(t[0], 11, sizeof(double), mf_br_cmp);
        qsort(t[1], 11, sizeof(double), mf_br_cmp);
        qsort(r, 11, sizeof(double), mf_br_cmp);
        char what[32];
        snprintf(what, sizeof what, "%d x %d", ni, R);
        printf("  %-14s %6d %10.4f %10.4f %7.2fx   %.2f..%.2f (per MAC; ratio = fours / group)\n", what,
               mf_fa_mix_items(cx->ly->c, R, ni), t[1][5], t[0][5], r[5], r[0], r[10]);
    }
    free(w), free(x), free(out), free(cx->hc_xn);
    cx->hc_xn = NULL;
    return 0;
}

/* Median over 11 rounds of 20 ms each: ns per unit. */
static double mf_br_time(mf_br *b, mf_br_fn fn, size_t each)
{
    double t[11];
    for (int r = 0; r < 11; r++) {
        double units = 0;
        int64_t t0 = mf_now_ns();
        do units += fn(b, each);
        while (mf_now_ns() - t0 < 20000000);
        t[r] = (mf_now_ns() - t0) / units;
    }
    qsort(t, 11, sizeof *t, mf_br_cmp);
    return t[5];
}

/* The command line of `moeflow bench ref`. */
typedef struct mf_br_cli {
    const char *prof_path;
    int mixes_only;
} mf_br_cli;

static const mf_opt mf_br_table[] = {
    {"--profile", .kind = MF_OPT_STR, .off = offsetof(mf_br_cli, prof_path), .meta = "P",
     .help = "a hardware profile: each loop also as a weight against its host_ref"},
    {"--mixes", .kind = MF_OPT_FLAG, .off = offsetof(mf_br_cli, mixes_only),
     .help = "only the table of the hyper-connection mixes of an item group"},
    {NULL},
};

static const mf_opts_spec mf_br_spec = {
    .cmd = "bench ref",
    .usage = "usage: moeflow bench ref [--profile P] [--mixes]\n\n"
             "Times the reference loops the decode engine runs in plain C (one thread, weights\n"
             "out of cache): mf_ly_linear_rows over fp8 (1024 x 512, wo_a) and bf16 (64 x 1024,\n"
             "the gate) weights per multiply-add, the hyper-connection mixes' loop (24 x 4096\n"
             "fp32) per multiply-add, one bf16 rounding of a random float, and the 8-lane rounding\n"
             "loop (mf_bf_n), and the engine's vector column loops at flash41's shape (the combine's\n"
             "sum, the hyper-connection expand and collapse, a norm's columns). With --profile P, each\n"
             "as a weight: its ns over P's host_ref ns per\n"
             "multiply-add (the vector loops, with or without P: over this run's in-cache 4-query\n"
             "mf_kern_vec_dots ns per multiply-add, host_vec's loop; the weights of\n"
             "graphs/step/stepgraph_impl.h; run it right after moeflow calibrate). Then the engine's\n"
             "hyper-connection mixes of an item group at flash41's shape (1..64 items, weights and\n"
             "streams out of cache): mf_fa_hc_mixes_rows_items on the whole group (the blocked kernel\n"
             "above 4 items) against calls of up to 4 items (the kernel before it), interleaved in\n"
             "the same run, ns per multiply-add and their ratio.\n\n",
    .opts = mf_br_table,
    .col = 15,
};

int mf_bench_ref(int argc, char **argv)
{
    mf_br_cli a = {0};
    int rc = mf_opts_parse(&mf_br_spec, argc, argv, &a);
    if (rc != MF_OPTS_RUN) return rc;
    const char *prof_path = a.prof_path;
    int mixes_only = a.mixes_only;
    if (mixes_only) return mf_br_mixes();
    static mf_profile prof;
    if (prof_path && mf_profile_load(prof_path, &prof)) {
        fprintf(stderr, "moeflow bench ref: %s\n", mf_last_error());
        return 1;
    }
    mf_br b = {.pool = aligned_alloc(4096, MF_BR_POOL), .x = malloc(sizeof(float) * MF_BR_N),
               .y = malloc(sizeof(float) * MF_BR_N)};
    if (!b.pool || !b.x || !b.y) {
        free(b.pool);
        free(b.x);
        free(b.y);
        fprintf(stderr, "moeflow bench ref: out of memory\n");
        return 1;
    }
    uint32_t s = 1;
    for (size_t i = 0; i < MF_BR_POOL; i++) {
        s = s * 1664525u + 1013904223u;
        b.pool[i] = (uint8_t)(s >> 24) & 0x77;   /* finite fp8, bf16 and fp32 values */
    }
    for (int i = 0; i < MF_BR_N; i++) {
        s = s * 1664525u + 1013904223u;
        b.x[i] = (float)((int)((s >> 9) % 20001) - 10000) / 3000.0f;
    }
    struct {
        const char *what;
        mf_br_fn fn;
        size_t each;
    } loops[] = {
        {"fp8 dot rows (wo_a), per MAC", mf_br_dot_fp8, 1024 * 512 + 32 * 16 + 4096},
        {"bf16 dot rows (gate), per MAC", mf_br_dot_bf16, 64 * 1024 * 2 + 4096},
        {"hc mixes, per MAC", mf_br_mix, 24 * 4096 * 4 + 4096},
        {"bf16 rounding, per element", mf_br_round, 0},
        {"bf16 rounding, 8 lanes (mf_bf_n)", mf_br_round_vec, 0},
        {"combine sum, per col x output", mf_br_combine, 0},
        {"hc expand, per col x stream", mf_br_expand, 0},
        {"hc collapse, per col x stream", mf_br_collapse, 0},
        {"norm columns (bf16 w), per col", mf_br_norm, 0},
    };
    double ref_ns = prof_path && prof.host[MF_KF_REF].macs_per_s > 0 ? 1e9 / prof.host[MF_KF_REF].macs_per_s : 0;
    printf("bench ref: the reference's plain-C loops, 1 thread, weights out of cache%s\n",
           ref_ns > 0 ? "; weight = ns / the profile's host_ref ns per MAC" : "");
    if (ref_ns > 0) printf("  %-32s %8.3f ns (profile %s)\n", "host_ref, per MAC", ref_ns, prof_path);
    double vec_ns = mf_br_time(&b, mf_br_vec_dots, 0);   /* this run's host_vec ns per MAC */
    printf("  %-32s %8.3f ns (%.2f GMAC/s: the vector loops' unit)\n", "host_vec here, 4-query dots", vec_ns,
           1 / vec_ns);
    for (size_t i = 0; i < sizeof loops / sizeof loops[0]; i++) {
        double ns = mf_br_time(&b, loops[i].fn, loops[i].each);
        /* the vector loops' weights: against host_vec (SG_W_ROUND_VEC and the column loops') */
        int vec = loops[i].fn == mf_br_round_vec || loops[i].fn == mf_br_combine || loops[i].fn == mf_br_expand ||
                  loops[i].fn == mf_br_collapse || loops[i].fn == mf_br_norm;
        double unit = vec ? vec_ns : ref_ns;
        if (unit > 0) printf("  %-32s %8.3f ns   weight %.2f%s\n", loops[i].what, ns, ns / unit, vec ? " (host_vec MACs)" : "");
        else printf("  %-32s %8.3f ns\n", loops[i].what, ns);
    }
    free(b.pool);
    free(b.x);
    free(b.y);
    return mf_br_mixes();
}
