/* `moeflow bench kernels`: the fused FP4 expert matmul against a read-bandwidth probe over the same
 * bytes and an expand-then-multiply baseline like the seed's, on the expert shapes, with weights
 * out of cache (a pool of distinct copies > 3x the last-level cache, rotated call by call) and
 * the output rows split across worker threads. Prints a table and PASS/MISS per target. */
#include <errno.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "host/formats.h"
#include "host/kernels.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "tools/commands.h"

#define MAX_THREADS 16
#define DENSE_OUT 1024   /* the dense linears' shape: demo's wo_b / shared expert scale */
#define DENSE_IN 4096
#define N_TOKS 6
static const int bench_toks[N_TOKS] = {1, 2, 4, 8, 16, 64};

/* ---- a spinning barrier (futex wake-ups would cost more than a 1-token call's slack) ---------- */

typedef struct {
    int n;
    int count;
    int gen;
} spin_barrier;

static void spin_wait(spin_barrier *b)
{
    int gen = __atomic_load_n(&b->gen, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == b->n) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->gen, gen + 1, __ATOMIC_RELEASE);
        return;
    }
    for (long spins = 0; __atomic_load_n(&b->gen, __ATOMIC_ACQUIRE) == gen; spins++) {
        if (spins > 20000)
            sched_yield();
        else
            __builtin_ia32_pause();
    }
}

/* ---- the work items ------------------------------------------------------------------------- */

enum job_kind { JOB_FUSED, JOB_FUSED_F32, JOB_PROBE, JOB_EXPAND, JOB_FFN, JOB_DENSE, JOB_QUIT };

typedef struct {
    int n_out, n_in, n_copies;
    size_t w_bytes, s_bytes;
    uint8_t **w, **s;           /* [n_copies] */
} pool;

typedef struct {
    /* set by the main thread before the start barrier */
    enum job_kind kind;
    const pool *pl;
    int copy, n_tok;
    const float *x;
    mf_kern_q8 q8;
    float *y;
    /* the expert FFN: w1/w3 from pool up (two copies), w2 from pool down */
    const pool *up, *down;
    mf_kern_q8 qh;
    float *h;
    float *expanded;             /* [n_out][n_in], the baseline's */
    const mf_kern_mat *dense;    /* JOB_DENSE: an FP8 or BF16 matrix */
    int64_t cpu_ns[MAX_THREADS]; /* JOB_DENSE: each worker's thread CPU time of the call */
    int n_threads;
    spin_barrier bar;
    volatile uint64_t sink[MAX_THREADS * 8];
    int rc[MAX_THREADS];
} bench_ctx;

typedef struct {
    bench_ctx *c;
    int id;
} worker_arg;

__attribute__((target("avx2")))
static uint64_t probe_read(const uint8_t *p, size_t n)
{
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    a0 = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t s = (uint64_t)_mm256_extract_epi64(a0, 0) + (uint64_t)_mm256_extract_epi64(a0, 3);
    for (; i < n; i++)
        s += p[i];
    return s;
}

/* This thread's CPU time: what a call costs when other processes take the cores in turn. */
static int64_t thread_cpu_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void row_range(int n_out, int n_threads, int id, int *r0, int *r1)
{
    *r0 = (int)((int64_t)n_out * id / n_threads);
    *r1 = (int)((int64_t)n_out * (id + 1) / n_threads);
}

/* One worker's share of one call. */
static int do_job(bench_ctx *c, int id)
{
    const pool *pl = c->pl;
    int r0, r1;
    row_range(pl->n_out, c->n_threads, id, &r0, &r1);
    const uint8_t *w = pl->w[c->copy], *s = pl->s[c->copy];
    int rc = 0;
    switch (c->kind) {
    case JOB_FUSED: {
        int t0, t1;
        row_range(c->n_tok, c->n_threads, id, &t0, &t1);
        rc = mf_kern_q8_quantize(&c->q8, c->x, pl->n_in, t0, t1);
        spin_wait(&c->bar);   /* every token quantized before any row uses them */
        if (!rc)
            rc = mf_kern_fp4_matmul(w, s, pl->n_out, pl->n_in, &c->q8, c->y, pl->n_out, r0, r1);
        break;
    }
    case JOB_FUSED_F32:
        rc = mf_kern_fp4_matmul_f32(w, s, pl->n_out, pl->n_in, c->x, c->n_tok, pl->n_in, c->y,
                                    pl->n_out, r0, r1);
        break;
    case JOB_PROBE: {
        size_t wr = pl->w_bytes / pl->n_out, sr = pl->s_bytes / pl->n_out;
        c->sink[id * 8] += probe_read(w + wr * r0, wr * (size_t)(r1 - r0)) +
                           probe_read(s + sr * r0, sr * (size_t)(r1 - r0));
        break;
    }
    case JOB_EXPAND: {
        /* the seed's way: every weight decoded on its own to fp32 and written out, then an fp32
         * matvec over the expanded rows */
        int n_in = pl->n_in, nb = n_in / 32;
        for (int o = r0; o < r1; o++) {
            float *row = c->expanded + (size_t)o * n_in;
            const uint8_t *wr = w + (size_t)o * (n_in / 2);
            for (int k = 0; k < n_in; k++)
                row[k] = mf_e2m1_to_f32(mf_e2m1_get(wr, (size_t)k)) * mf_e8m0_to_f32(s[(size_t)o * nb + k / 32]);
        }
        for (int o = r0; o < r1; o++) {
            const float *row = c->expanded + (size_t)o * n_in;
            float acc = 0.0f;
            for (int k = 0; k < n_in; k++)
                acc += row[k] * c->x[k];
            c->y[o] = acc;
        }
        break;
    }
    case JOB_FFN: {
        int n = c->n_tok, t0, t1, h0, h1, d0, d1;
        const pool *up = c->up, *dn = c->down;
        int cu = c->copy % up->n_copies, cd = c->copy % dn->n_copies;
        mf_kern_mat w1 = {MF_KERN_FP4, up->w[cu], up->s[cu], up->n_out, up->n_in};
        mf_kern_mat w3 = {MF_KERN_FP4, up->w[(cu + 1) % up->n_copies], up->s[(cu + 1) % up->n_copies],
                          up->n_out, up->n_in};
        mf_kern_mat w2 = {MF_KERN_FP4, dn->w[cd], dn->s[cd], dn->n_out, dn->n_in};
        row_range(n, c->n_threads, id, &t0, &t1);
        row_range(up->n_out, c->n_threads, id, &h0, &h1);
        row_range(dn->n_out, c->n_threads, id, &d0, &d1);
        rc = mf_kern_q8_quantize(&c->q8, c->x, up->n_in, t0, t1);
        spin_wait(&c->bar);
        mf_kern_in in = {c->x, n, up->n_in, &c->q8};
        if (!rc)
            rc = mf_kern_ffn_up(&w1, &w3, &in, NULL, 10.0f, c->h, up->n_out, h0, h1);
        spin_wait(&c->bar);
        if (!rc)
            rc = mf_kern_q8_quantize(&c->qh, c->h, up->n_out, t0, t1);
        spin_wait(&c->bar);
        mf_kern_in hin = {c->h, n, up->n_out, &c->qh};
        if (!rc)
            rc = mf_kern_ffn_down(&w2, &hin, c->y, dn->n_out, d0, d1);
        break;
    }
    case JOB_DENSE: {
        const mf_kern_mat *d = c->dense;
        row_range(d->n_out, c->n_threads, id, &r0, &r1);
        mf_kern_in in = {c->x, c->n_tok, d->n_in, NULL};
        int64_t t0 = thread_cpu_ns();
        rc = mf_kern_matmul(d, &in, c->y, d->n_out, r0, r1);
        c->cpu_ns[id] = thread_cpu_ns() - t0;
        break;
    }
    case JOB_QUIT:
        break;
    }
    return rc;
}

static void *worker_main(void *p)
{
    worker_arg *a = p;
    bench_ctx *c = a->c;
    for (;;) {
        spin_wait(&c->bar);
        if (c->kind == JOB_QUIT)
            return NULL;
        c->rc[a->id] = do_job(c, a->id);
        spin_wait(&c->bar);
    }
}

/* Runs one call on all threads (the caller is worker 0); returns its wall time. */
static int64_t run_call(bench_ctx *c, enum job_kind kind, int copy, int n_tok)
{
    c->kind = kind;
    c->copy = copy;
    c->n_tok = n_tok;
    int64_t t0 = mf_now_ns();
    spin_wait(&c->bar);
    c->rc[0] = do_job(c, 0);
    spin_wait(&c->bar);
    return mf_now_ns() - t0;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The median of n times (sorts them). */
static int64_t median_of(int64_t *t, int n)
{
    qsort(t, (size_t)n, sizeof t[0], cmp_i64);
    return t[n / 2];
}

/* The largest data/unified cache in sysfs, in bytes (0 when unknown). */
static size_t llc_bytes(void)
{
    size_t best = 0;
    for (int i = 0; i < 8; i++) {
        char path[96], buf[32];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        if (fgets(buf, sizeof buf, f)) {
            char *end;
            size_t v = strtoull(buf, &end, 10);
            if (*end == 'K')
                v <<= 10;
            else if (*end == 'M')
                v <<= 20;
            if (v > best)
                best = v;
        }
        fclose(f);
    }
    return best;
}

static uint64_t bench_rng = 0x1234567ull;
static uint64_t rnd(void)
{
    bench_rng ^= bench_rng << 13;
    bench_rng ^= bench_rng >> 7;
    bench_rng ^= bench_rng << 17;
    return bench_rng;
}

static int pool_make(pool *pl, int n_out, int n_in, size_t min_bytes)
{
    memset(pl, 0, sizeof *pl);
    pl->n_out = n_out;
    pl->n_in = n_in;
    pl->w_bytes = (size_t)n_out * n_in / 2;
    pl->s_bytes = (size_t)n_out * (n_in / 32);
    pl->n_copies = (int)((min_bytes + pl->w_bytes + pl->s_bytes - 1) / (pl->w_bytes + pl->s_bytes)) + 1;
    pl->w = calloc((size_t)pl->n_copies, sizeof *pl->w);
    pl->s = calloc((size_t)pl->n_copies, sizeof *pl->s);
    if (!pl->w || !pl->s)
        return mf_error(-ENOMEM, "bench kernels: out of memory for the weight pool");
    for (int i = 0; i < pl->n_copies; i++) {
        pl->w[i] = aligned_alloc(64, (pl->w_bytes + 63) & ~(size_t)63);
        pl->s[i] = aligned_alloc(64, (pl->s_bytes + 63) & ~(size_t)63);
        if (!pl->w[i] || !pl->s[i])
            return mf_error(-ENOMEM, "bench kernels: out of memory for the weight pool (%d copies "
                            "of %zu bytes)", pl->n_copies, pl->w_bytes + pl->s_bytes);
        for (size_t j = 0; j < pl->w_bytes; j += 8) {
            uint64_t v = rnd();
            memcpy(pl->w[i] + j, &v, pl->w_bytes - j < 8 ? pl->w_bytes - j : 8);
        }
        for (size_t j = 0; j < pl->s_bytes; j++)
            pl->s[i][j] = (uint8_t)(118 + rnd() % 8);   /* a realistic spread of block scales */
    }
    return 0;
}

static void pool_free(pool *pl)
{
    for (int i = 0; i < pl->n_copies; i++) {
        if (pl->w)
            free(pl->w[i]);
        if (pl->s)
            free(pl->s[i]);
    }
    free(pl->w);
    free(pl->s);
}

typedef struct {
    const char *name;
    int n_out, n_in;
    int64_t fused_ns[N_TOKS], f32_ns[2], probe_ns, expand_ns;
    double bytes;
} shape_result;

/* The command line of `moeflow bench kernels`. */
typedef struct mf_bk_cli {
    int json;
    long n_threads, reps, pool_mib;
} mf_bk_cli;

#define F(x) offsetof(mf_bk_cli, x)
static const mf_opt mf_bk_table[] = {
    {"--json", .kind = MF_OPT_FLAG, .off = F(json),
     .help = "one JSON object (bw_fraction_1, time_ratio_8, time_ratio_16, speedup_vs_expand,\n"
             "shapes, ffn_ns, dense) instead of the tables"},
    {"--threads", .kind = MF_OPT_LONG, .off = F(n_threads), .def = "2", .meta = "N", .lo = 1, .hi = MAX_THREADS,
     .help = "worker threads, each its share of the output rows"},
    {"--reps", .kind = MF_OPT_LONG, .off = F(reps), .def = "9", .meta = "N", .lo = 1, .hi = 64,
     .help = "rounds, every measurement once per round; medians"},
    {"--pool-mib", .kind = MF_OPT_LONG, .off = F(pool_mib), .meta = "N", .lo = 0, .hi = 1 << 30,
     .help = "MiB of weight copies per shape (default, and 0: 3x the last-level cache)"},
    {NULL},
};
#undef F

static const mf_opts_spec mf_bk_spec = {
    .cmd = "bench kernels",
    .usage = "usage: moeflow bench kernels [--json] [--threads N] [--reps N] [--pool-mib N]\n\n"
             "Times the fused FP4 matmul (int8 path, quantization included) on the expert\n"
             "shapes at 1, 2, 4, 8, 16, 64 tokens, a read-bandwidth probe over the same bytes\n"
             "and an expand-then-multiply baseline (1 token), weights out of cache, then the\n"
             "expert FFN and the dense FP8 and BF16 linears (blocked GEMM against the per-row\n"
             "tile); prints PASS/MISS per target. The current kernel path is the one\n"
             "MOEFLOW_SIMD picks (moeflow --help).\n\n",
    .opts = mf_bk_table,
    .col = 16,
};

/* A run of bench kernels: the shared context and buffers, the workers, and what was measured. */
typedef struct mf_bk {
    int n_threads, reps, json, status;
    size_t llc, pool_bytes, qb;
    bench_ctx *c;
    float *x, *y, *expanded;
    void *qbuf;
    pthread_t th[MAX_THREADS];
    worker_arg args[MAX_THREADS];
    int n_started;
    pool pools[2];
    shape_result sh[2];
    int64_t ffn_ns[3];
    int64_t dense_ns[2][2][2];    /* [fp8, bf16][tokens][gemm off, on]: wall, median */
    int64_t dense_cpu[2][2][2];   /* the slowest worker's thread CPU time, least over rounds */
} mf_bk;

static const int ffn_toks[3] = {1, 8, 16};
static const int dense_toks[2] = {16, 64};

/* Buffers, the weight pools and the worker threads (the caller is worker 0). 0 or 1. */
static int mf_bk_open(mf_bk *k)
{
    k->sh[0] = (shape_result){"w1/w3", 2304, 5120, {0}, {0}, 0, 0, 0};
    k->sh[1] = (shape_result){"w2", 5120, 2304, {0}, {0}, 0, 0, 0};
    k->c = aligned_alloc(64, (sizeof *k->c + 63) & ~(size_t)63);
    if (k->c) memset(k->c, 0, sizeof *k->c);
    k->x = malloc(sizeof(float) * 64 * 5120);
    k->y = malloc(sizeof(float) * 64 * 5120);
    k->expanded = malloc(sizeof(float) * 2304 * 5120);
    k->qb = mf_kern_q8_bytes(64, 5120);
    k->qbuf = malloc(k->qb);
    if (!k->c || !k->x || !k->y || !k->expanded || !k->qbuf) {
        fprintf(stderr, "bench kernels: out of memory\n");
        return 1;
    }
    bench_ctx *c = k->c;
    memset(k->expanded, 0, sizeof(float) * 2304 * 5120);
    for (int i = 0; i < 64 * 5120; i++)
        k->x[i] = (float)((int64_t)(rnd() % 2001) - 1000) * 1e-3f;
    c->x = k->x;
    c->y = k->y;
    c->expanded = k->expanded;
    c->n_threads = k->n_threads;
    c->bar.n = k->n_threads;
    for (k->n_started = 1; k->n_started < k->n_threads; k->n_started++) {
        k->args[k->n_started] = (worker_arg){c, k->n_started};
        if (pthread_create(&k->th[k->n_started], NULL, worker_main, &k->args[k->n_started])) {
            fprintf(stderr, "bench kernels: pthread_create failed\n");
            return 1;
        }
    }
    for (int s = 0; s < 2; s++)
        if (pool_make(&k->pools[s], k->sh[s].n_out, k->sh[s].n_in, k->pool_bytes)) {
            fprintf(stderr, "%s\n", mf_last_error());
            return 1;
        }
    return 0;
}

/* 1 (said on stderr) when a worker's call failed. */
static int mf_bk_failed(const mf_bk *k)
{
    int bad = 0;
    for (int i = 0; i < k->n_threads; i++)
        if (k->c->rc[i]) {
            fprintf(stderr, "bench kernels: %s\n", mf_last_error());
            bad = 1;
        }
    return bad;
}

/* One shape: rounds of every measurement once (so load from other processes falls on all of them
 * alike), each call on the next copy of the pool; the medians into sh. 0 or 1. */
static int mf_bk_shape(mf_bk *k, int s)
{
    bench_ctx *c = k->c;
    pool pl = k->pools[s];
    shape_result *sh = &k->sh[s];
    int reps = k->reps;
    c->pl = &pl;
    sh->bytes = (double)(pl.w_bytes + pl.s_bytes);
    if (!k->json)
        fprintf(stderr, "bench kernels: %s [%d, %d], %d copies of %.2f MiB (LLC %zu MiB), "
                "%d threads, %s path\n", sh->name, sh->n_out, sh->n_in, pl.n_copies,
                sh->bytes / 1048576.0, k->llc >> 20, k->n_threads, mf_kern_simd_name(mf_kern_simd_active()));
    int next = 0;
    /* one untimed pass over the pool: pages touched, caches cold for what follows */
    for (int i = 0; i < pl.n_copies; i++)
        run_call(c, JOB_PROBE, i, 1);
    int64_t t_probe[64], t_fused[N_TOKS][64], t_f32[2][64], t_expand[64];
    int n_expand = reps < 3 ? reps : 3;
    for (int r = 0; r < reps; r++) {
        t_probe[r] = run_call(c, JOB_PROBE, next, 1);
        next = (next + 1) % pl.n_copies;
        for (int i = 0; i < N_TOKS; i++) {
            mf_kern_q8_init(&c->q8, k->qbuf, k->qb, bench_toks[i], sh->n_in);
            t_fused[i][r] = run_call(c, JOB_FUSED, next, bench_toks[i]);
            next = (next + 1) % pl.n_copies;
        }
        for (int i = 0; i < 2; i++) {
            t_f32[i][r] = run_call(c, JOB_FUSED_F32, next, i ? 8 : 1);
            next = (next + 1) % pl.n_copies;
        }
        if (r < n_expand) {
            t_expand[r] = run_call(c, JOB_EXPAND, next, 1);
            next = (next + 1) % pl.n_copies;
        }
    }
    sh->probe_ns = median_of(t_probe, reps);
    for (int i = 0; i < N_TOKS; i++)
        sh->fused_ns[i] = median_of(t_fused[i], reps);
    for (int i = 0; i < 2; i++)
        sh->f32_ns[i] = median_of(t_f32[i], reps);
    sh->expand_ns = median_of(t_expand, n_expand);
    return mf_bk_failed(k);
}

/* The expert FFN: w1, w3 (two copies of the up pool), q8 of h, w2. 0 or 1. */
static int mf_bk_ffn(mf_bk *k)
{
    bench_ctx *c = k->c;
    size_t qhb = mf_kern_q8_bytes(64, 2304);
    void *qhbuf = malloc(qhb);
    c->h = malloc(sizeof(float) * 64 * 2304);
    if (!qhbuf || !c->h) {
        fprintf(stderr, "bench kernels: out of memory\n");
        free(qhbuf);
        return 1;
    }
    c->up = &k->pools[0];
    c->down = &k->pools[1];
    c->pl = &k->pools[0];
    int64_t t[3][64];
    int next = 0;
    for (int r = 0; r < k->reps; r++)
        for (int i = 0; i < 3; i++) {
            mf_kern_q8_init(&c->q8, k->qbuf, k->qb, ffn_toks[i], 5120);
            mf_kern_q8_init(&c->qh, qhbuf, qhb, ffn_toks[i], 2304);
            t[i][r] = run_call(c, JOB_FFN, next, ffn_toks[i]);
            next = (next + 2) % k->pools[0].n_copies;
        }
    for (int i = 0; i < 3; i++)
        k->ffn_ns[i] = median_of(t[i], k->reps);
    free(qhbuf);
    return mf_bk_failed(k);
}

/* Dense FP8 / BF16 linears at 16 and 64 tokens: the blocked GEMM against the per-row tile
 * (mf_kern_gemm_set(0)), alternating within each round; weights warm in the last-level cache (a
 * decode step's linears are read once per step, the tokens are what grows). 0 or 1. */
static int mf_bk_dense(mf_bk *k)
{
    bench_ctx *c = k->c;
    uint8_t *dw = malloc((size_t)DENSE_OUT * DENSE_IN * 2), *ds = malloc((size_t)(DENSE_OUT / 32) * (DENSE_IN / 32));
    if (!dw || !ds) {
        fprintf(stderr, "bench kernels: out of memory\n");
        free(dw);
        free(ds);
        return 1;
    }
    for (size_t j = 0; j < (size_t)DENSE_OUT * DENSE_IN * 2; j++) {
        uint8_t v = (uint8_t)rnd();
        dw[j] = (j & 1) || (v & 0x7F) != 0x7F ? v : 0x11;   /* no E4M3 NaN codes; bf16 high bytes any */
        if (j & 1) dw[j] = (uint8_t)(0x3C + (v & 1) + (v & 0x80));   /* bf16 magnitudes near 1 */
    }
    for (int j = 0; j < (DENSE_OUT / 32) * (DENSE_IN / 32); j++) ds[j] = (uint8_t)(120 + rnd() % 4);
    mf_kern_mat dm[2] = {{MF_KERN_FP8, dw, ds, DENSE_OUT, DENSE_IN}, {MF_KERN_BF16, dw, NULL, DENSE_OUT, DENSE_IN}};
    static int64_t t[2][2][2][64];
    for (int r = 0; r < k->reps; r++)
        for (int f = 0; f < 2; f++)
            for (int i = 0; i < 2; i++)
                for (int g = 0; g < 2; g++) {
                    c->dense = &dm[f];
                    mf_kern_gemm_set(g);
                    t[f][i][g][r] = run_call(c, JOB_DENSE, 0, dense_toks[i]);
                    int64_t slow = 0;
                    for (int q = 0; q < k->n_threads; q++) slow = c->cpu_ns[q] > slow ? c->cpu_ns[q] : slow;
                    if (!r || slow < k->dense_cpu[f][i][g]) k->dense_cpu[f][i][g] = slow;
                }
    mf_kern_gemm_set(1);
    for (int f = 0; f < 2; f++)
        for (int i = 0; i < 2; i++)
            for (int g = 0; g < 2; g++) k->dense_ns[f][i][g] = median_of(t[f][i][g], k->reps);
    free(dw);
    free(ds);
    return mf_bk_failed(k);
}

/* Stops the workers and frees what mf_bk_open made. */
static void mf_bk_close(mf_bk *k)
{
    if (k->c) {
        free(k->c->h);
        k->c->kind = JOB_QUIT;
        if (k->n_started == k->n_threads) {
            spin_wait(&k->c->bar);
            for (int i = 1; i < k->n_threads; i++)
                pthread_join(k->th[i], NULL);
        }
    }
    pool_free(&k->pools[0]);
    pool_free(&k->pools[1]);
    free(k->c);
    free(k->x);
    free(k->y);
    free(k->expanded);
    free(k->qbuf);
}

/* The worst over the shapes of each target's figure. */
typedef struct mf_bk_worst {
    double bw_frac, r8, r16, speed;
} mf_bk_worst;

/* One shape's table and its targets (the text report). */
static void mf_bk_print_shape(const mf_bk *k, const shape_result *r)
{
    double probe_bw = r->bytes / (double)r->probe_ns, f = r->bytes / (double)r->fused_ns[0] / probe_bw;
    double a8 = (double)r->fused_ns[3] / r->fused_ns[0], a16 = (double)r->fused_ns[4] / r->fused_ns[0];
    double sp = (double)r->expand_ns / r->fused_ns[0];
    printf("%s [%d, %d] fp4, %.2f MiB per call (weights + scales), %d threads:\n", r->name,
           r->n_out, r->n_in, r->bytes / 1048576.0, k->n_threads);
    printf("  %-28s %10s %9s %9s\n", "", "time us", "GB/s", "x 1-tok");
    for (int i = 0; i < N_TOKS; i++) {
        char label[40];
        snprintf(label, sizeof label, "fused int8, %d tok", bench_toks[i]);
        printf("  %-28s %10.1f %9.2f %9.2f\n", label, r->fused_ns[i] / 1e3,
               r->bytes / r->fused_ns[i], (double)r->fused_ns[i] / r->fused_ns[0]);
    }
    printf("  %-28s %10.1f %9.2f %9.2f\n", "fused fp32 path, 1 tok", r->f32_ns[0] / 1e3,
           r->bytes / r->f32_ns[0], (double)r->f32_ns[0] / r->fused_ns[0]);
    printf("  %-28s %10.1f %9.2f %9.2f\n", "fused fp32 path, 8 tok", r->f32_ns[1] / 1e3,
           r->bytes / r->f32_ns[1], (double)r->f32_ns[1] / r->fused_ns[0]);
    printf("  %-28s %10.1f %9.2f\n", "read probe (same bytes)", r->probe_ns / 1e3, probe_bw);
    printf("  %-28s %10.1f %9.2f %9.2f  (%.0f Mparam/s)\n", "expand then multiply, 1 tok",
           r->expand_ns / 1e3, r->bytes / r->expand_ns, (double)r->expand_ns / r->fused_ns[0],
           (double)r->n_out * r->n_in / r->expand_ns * 1e3);
    printf("  targets: 1-tok bandwidth %.1f%% of probe (>= 85%%) %s; vs expand %.1fx (>= 30x) %s;"
           " 8 tok %.2fx (<= 2.5x) %s; 16 tok %.2fx (<= 4x) %s\n", 100 * f,
           f >= 0.85 ? "PASS" : "MISS", sp, sp >= 30 ? "PASS" : "MISS", a8,
           a8 <= 2.5 ? "PASS" : "MISS", a16, a16 <= 4.0 ? "PASS" : "MISS");
}

/* The text report after the shapes: the FFN, the dense linears and the worst figures. */
static void mf_bk_print_rest(const mf_bk *k, const mf_bk_worst *w)
{
    const shape_result *sh = k->sh;
    double ffn_bytes = sh[0].bytes * 2 + sh[1].bytes;
    double ffn_probe = 2.0 * (double)sh[0].probe_ns + (double)sh[1].probe_ns;
    printf("expert FFN (w1, w3, swiglu, q8 of h, w2; %.2f MiB), %d threads:\n", ffn_bytes / 1048576.0, k->n_threads);
    for (int i = 0; i < 3; i++)
        printf("  %-28s %10.1f %9.2f %9.2f  (%.0f%% of the probes' bandwidth)\n",
               i == 0 ? "ffn, 1 tok" : i == 1 ? "ffn, 8 tok" : "ffn, 16 tok", k->ffn_ns[i] / 1e3,
               ffn_bytes / k->ffn_ns[i], (double)k->ffn_ns[i] / k->ffn_ns[0], 100.0 * ffn_probe / k->ffn_ns[i]);
    printf("dense linears [%d, %d], weights warm, %d threads: blocked GEMM vs per-row tile (wall: median;\n"
           "  cpu: the slowest worker's thread CPU time, least over the rounds, which load does not stretch)\n",
           DENSE_OUT, DENSE_IN, k->n_threads);
    for (int f = 0; f < 2; f++)
        for (int i = 0; i < 2; i++) {
            const int64_t *ns = k->dense_ns[f][i], *cpu = k->dense_cpu[f][i];
            double macs = (double)DENSE_OUT * DENSE_IN * dense_toks[i];
            printf("  %-5s %2d tok: wall tile %8.1f us, gemm %8.1f us: %.2fx; cpu tile %8.1f us (%5.1f GMAC/s), "
                   "gemm %8.1f us (%5.1f GMAC/s): %.2fx\n", f ? "bf16" : "fp8", dense_toks[i], ns[0] / 1e3,
                   ns[1] / 1e3, (double)ns[0] / ns[1], cpu[0] / 1e3, macs / cpu[0], cpu[1] / 1e3, macs / cpu[1],
                   (double)cpu[0] / cpu[1]);
        }
    printf("worst over shapes: bw_fraction_1 %.3f, time_ratio_8 %.2f, time_ratio_16 %.2f, "
           "speedup_vs_expand %.1f\n", w->bw_frac, w->r8, w->r16, w->speed);
}

static void mf_bk_json(const mf_bk *k, const mf_bk_worst *w)
{
    printf("{\"bw_fraction_1\": %.4f, \"time_ratio_8\": %.4f, \"time_ratio_16\": %.4f, "
           "\"speedup_vs_expand\": %.2f, \"threads\": %d, \"simd\": \"%s\", \"shapes\": [",
           w->bw_frac, w->r8, w->r16, w->speed, k->n_threads, mf_kern_simd_name(mf_kern_simd_active()));
    for (int s = 0; s < 2; s++) {
        const shape_result *r = &k->sh[s];
        printf("%s{\"name\": \"%s\", \"n_out\": %d, \"n_in\": %d, \"bytes\": %.0f, "
               "\"probe_ns\": %lld, \"expand_ns\": %lld, \"fused_ns\": {", s ? ", " : "",
               r->name, r->n_out, r->n_in, r->bytes, (long long)r->probe_ns, (long long)r->expand_ns);
        for (int i = 0; i < N_TOKS; i++)
            printf("%s\"%d\": %lld", i ? ", " : "", bench_toks[i], (long long)r->fused_ns[i]);
        printf("}, \"fused_f32_ns\": {\"1\": %lld, \"8\": %lld}}", (long long)r->f32_ns[0], (long long)r->f32_ns[1]);
    }
    printf("], \"ffn_ns\": {\"1\": %lld, \"8\": %lld, \"16\": %lld}, \"dense\": [", (long long)k->ffn_ns[0],
           (long long)k->ffn_ns[1], (long long)k->ffn_ns[2]);
    for (int f = 0; f < 2; f++)
        for (int i = 0; i < 2; i++) {
            const int64_t *ns = k->dense_ns[f][i], *cpu = k->dense_cpu[f][i];
            printf("%s{\"fmt\": \"%s\", \"n_out\": %d, \"n_in\": %d, \"tokens\": %d, \"tile_ns\": %lld, "
                   "\"gemm_ns\": %lld, \"speedup\": %.4f, \"tile_cpu_ns\": %lld, \"gemm_cpu_ns\": %lld, "
                   "\"cpu_speedup\": %.4f}", f || i ? ", " : "", f ? "bf16" : "fp8", DENSE_OUT, DENSE_IN,
                   dense_toks[i], (long long)ns[0], (long long)ns[1], (double)ns[0] / ns[1], (long long)cpu[0],
                   (long long)cpu[1], (double)cpu[0] / cpu[1]);
        }
    printf("]}\n");
}

/* The report: per shape (text) and the worst figures over the shapes; then the rest. */
static void mf_bk_report(const mf_bk *k)
{
    mf_bk_worst w = {1e9, 0, 0, 1e9};
    for (int s = 0; s < 2; s++) {
        const shape_result *r = &k->sh[s];
        double f = r->bytes / (double)r->fused_ns[0] / (r->bytes / (double)r->probe_ns);
        double a8 = (double)r->fused_ns[3] / r->fused_ns[0], a16 = (double)r->fused_ns[4] / r->fused_ns[0];
        double sp = (double)r->expand_ns / r->fused_ns[0];
        w.bw_frac = f < w.bw_frac ? f : w.bw_frac;
        w.r8 = a8 > w.r8 ? a8 : w.r8;
        w.r16 = a16 > w.r16 ? a16 : w.r16;
        w.speed = sp < w.speed ? sp : w.speed;
        if (!k->json) mf_bk_print_shape(k, r);
    }
    if (k->json) mf_bk_json(k, &w);
    else mf_bk_print_rest(k, &w);
}

int mf_bench_kernels(int argc, char **argv)
{
    mf_bk_cli a = {0};
    int rc = mf_opts_parse(&mf_bk_spec, argc, argv, &a);
    if (rc != MF_OPTS_RUN) return rc;
    static mf_bk k;
    k = (mf_bk){.n_threads = (int)a.n_threads, .reps = (int)a.reps, .json = a.json, .llc = llc_bytes()};
    k.pool_bytes = a.pool_mib ? (size_t)a.pool_mib << 20 : 3 * (k.llc ? k.llc : (size_t)32 << 20);
    int status = mf_bk_open(&k);
    for (int s = 0; s < 2 && !status; s++) status = mf_bk_shape(&k, s);
    if (!status) status = mf_bk_ffn(&k);
    if (!status) status = mf_bk_dense(&k);
    mf_bk_close(&k);
    if (!status) mf_bk_report(&k);
    return status;
}
