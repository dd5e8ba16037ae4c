/* `moeflow bench ref`: the reference code's scalar loops that the decode engine still runs (the
 * grouped wo_a and the gate through mf_ly_linear_rows, the hyper-connection mixes, bf16
 * roundings), in ns per unit, and with --profile their weights against the profile's
 * host_ref_macs_per_s: the ratios graphs/sim/plan.c builds in (docs/sim.md "Weights"). */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/layers/layers.h"
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

int mf_bench_ref(int argc, char **argv)
{
    const char *prof_path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: moeflow bench ref [--profile P]\n\n"
                   "Times the reference loops the decode engine runs in plain C (one thread, weights\n"
                   "out of cache): mf_ly_linear_rows over fp8 (1024 x 512, wo_a) and bf16 (64 x 1024,\n"
                   "the gate) weights per multiply-add, the hyper-connection mixes' loop (24 x 4096\n"
                   "fp32) per multiply-add, one bf16 rounding of a random float, and the 8-lane rounding\n"
                   "loop (mf_bf_n). With --profile P, each as a weight: its ns over P's host_ref ns per\n"
                   "multiply-add (the 8-lane rounding: over P's host_vec ns; the weights of\n"
                   "graphs/step/stepgraph.c; run it right after moeflow calibrate).\n");
            return 0;
        } else if (!strcmp(argv[i], "--profile") && i + 1 < argc) {
            prof_path = argv[++i];
        } else {
            fprintf(stderr, "moeflow bench ref: unknown or incomplete option '%s'\n", argv[i]);
            return 2;
        }
    }
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
    };
    double ref_ns = prof_path && prof.host[MF_KF_REF].macs_per_s > 0 ? 1e9 / prof.host[MF_KF_REF].macs_per_s : 0;
    printf("bench ref: the reference's plain-C loops, 1 thread, weights out of cache%s\n",
           ref_ns > 0 ? "; weight = ns / the profile's host_ref ns per MAC" : "");
    if (ref_ns > 0) printf("  %-32s %8.3f ns (profile %s)\n", "host_ref, per MAC", ref_ns, prof_path);
    for (size_t i = 0; i < sizeof loops / sizeof loops[0]; i++) {
        double ns = mf_br_time(&b, loops[i].fn, loops[i].each);
        int vec = loops[i].fn == mf_br_round_vec;   /* its weight: against host_vec (SG_W_ROUND_VEC) */
        double unit = vec ? (prof_path && prof.host_vec.macs_per_s > 0 ? 1e9 / prof.host_vec.macs_per_s : 0) : ref_ns;
        if (unit > 0) printf("  %-32s %8.3f ns   weight %.2f%s\n", loops[i].what, ns, ns / unit, vec ? " (host_vec MACs)" : "");
        else printf("  %-32s %8.3f ns\n", loops[i].what, ns);
    }
    free(b.pool);
    free(b.x);
    free(b.y);
    return 0;
}
