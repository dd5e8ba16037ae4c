/* Routing for simulation (graphs/sim/routing.h): draws are distinct, in range and deterministic per
 * seed (and independent of batching); Zipf frequencies match their exact expectation; traces
 * recorded from several threads replay in recorded order; mismatched and malformed traces and
 * bad specs are refused with the path, line and what is wrong; `moeflow decode --record-routing`
 * writes the reference's real routes without changing the tokens. */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "graphs/model/config.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/sim/routing.h"
#include "sched/error.h"
#include "tests/check.h"

static char g_dir[512];

static void check_valid(const int32_t *ex, int L, int n, int K, int E, const char *what)
{
    int bad = 0;
    for (int l = 0; l < L; l++)
        for (int t = 0; t < n; t++) {
            const int32_t *e = ex + ((size_t)l * n + t) * K;
            for (int j = 0; j < K; j++) {
                bad |= e[j] < 0 || e[j] >= E;
                for (int i = 0; i < j; i++) bad |= e[i] == e[j];
            }
        }
    CHECK(!bad, "%s: experts out of range or repeated within a token", what);
}

static void test_draws(void)
{
    const char *specs[] = {"uniform", "zipf:1.1", "zipf:3"};
    static const int shapes[][3] = {{5, 16, 4}, {3, 8, 8}, {2, 64, 1}, {4, 256, 8}};
    for (int s = 0; s < 3; s++)
        for (int sh = 0; sh < 4; sh++) {
            int L = shapes[sh][0], E = shapes[sh][1], K = shapes[sh][2], n = 7;
            mf_routing *a = NULL, *b = NULL, *c = NULL, *d = NULL;
            int rc = mf_routing_open(specs[s], L, E, K, 42, &a);
            CHECK(rc == 0, "%s: %s", specs[s], mf_last_error());
            if (rc) continue;
            mf_routing_open(specs[s], L, E, K, 42, &b);
            mf_routing_open(specs[s], L, E, K, 43, &c);
            mf_routing_open(specs[s], L, E, K, 42, &d);
            size_t len = (size_t)L * n * K;
            int32_t *xa = malloc(len * 4 * sizeof *xa), *xb = malloc(len * 4 * sizeof *xb);
            int32_t *xc = malloc(len * 4 * sizeof *xc), *xd = malloc(len * 4 * sizeof *xd);
            int same_seed = 1, other_seed_same = 1, batched_same = 1;
            for (int step = 0; step < 4; step++) {
                mf_routing_next(a, n, xa);
                mf_routing_next(b, n, xb);
                mf_routing_next(c, n, xc);
                /* d draws the same tokens one at a time */
                for (int t = 0; t < n; t++) {
                    int32_t one[256 * 8];
                    mf_routing_next(d, 1, one);
                    for (int l = 0; l < L; l++)
                        batched_same &= memcmp(one + (size_t)l * K, xa + ((size_t)l * n + t) * K,
                                               (size_t)K * sizeof *one) == 0;
                }
                check_valid(xa, L, n, K, E, specs[s]);
                check_valid(xc, L, n, K, E, specs[s]);
                same_seed &= memcmp(xa, xb, len * sizeof *xa) == 0;
                other_seed_same &= memcmp(xa, xc, len * sizeof *xa) == 0;
            }
            CHECK(same_seed, "%s L%d E%d K%d: same seed, different draws", specs[s], L, E, K);
            CHECK(K == E || !other_seed_same, "%s L%d E%d K%d: another seed, same draws", specs[s], L, E, K);
            CHECK(batched_same, "%s L%d E%d K%d: one token at a time differs from a batch", specs[s], L, E, K);
            free(xa); free(xb); free(xc); free(xd);
            mf_routing_free(a); mf_routing_free(b); mf_routing_free(c); mf_routing_free(d);
        }
    mf_routing *r = NULL;
    CHECK(mf_routing_open("zipf:0", 2, 8, 2, 1, &r) == 0 && strcmp(mf_routing_describe(r), "uniform") == 0,
          "zipf:0 is uniform");
    mf_routing_free(r);
    CHECK(mf_routing_open("zipf:1.1", 2, 8, 2, 1, &r) == 0 && strcmp(mf_routing_describe(r), "zipf:1.1") == 0,
          "describe zipf");
    mf_routing_free(r);
}

static int cmp_desc(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

/* Zipf: with top_k 1 rank r is drawn with p_r = w_r / sum w; with top_k 2 an expert is in a token's
 * pair with p_i + sum_{j != i} p_j p_i / (1 - p_j). Measured shares (sorted, since the ranking is a
 * hidden permutation) must lie within 5 standard errors of these; uniform within 5 of K/E. */
static void test_zipf_skew(void)
{
    const int E = 32, N = 100000;
    const double S = 1.1;
    for (int K = 1; K <= 2; K++) {
        mf_routing *r = NULL;
        int rc = mf_routing_open("zipf:1.1", 3, E, K, 7, &r);
        CHECK(rc == 0, "%s", mf_last_error());
        if (rc) return;
        double p[32], sum = 0, want[32], got[3][32];
        memset(got, 0, sizeof got);
        for (int i = 0; i < E; i++) sum += p[i] = pow(i + 1.0, -S);
        for (int i = 0; i < E; i++) p[i] /= sum;
        for (int i = 0; i < E; i++) {
            want[i] = p[i];
            if (K == 2)
                for (int j = 0; j < E; j++)
                    if (j != i) want[i] += p[j] * p[i] / (1 - p[j]);
        }
        int32_t ex[3 * 100 * 2];
        for (int step = 0; step < N / 100; step++) {
            mf_routing_next(r, 100, ex);
            for (int l = 0; l < 3; l++)
                for (int t = 0; t < 100 * K; t++) got[l][ex[l * 100 * K + t]] += 1.0 / N;
        }
        int top[3] = {0, 0, 0};
        for (int l = 0; l < 3; l++) {
            for (int i = 1; i < E; i++)
                if (got[l][i] > got[l][top[l]]) top[l] = i;
            qsort(got[l], E, sizeof got[l][0], cmp_desc);
            double worst = 0;
            for (int i = 0; i < E; i++) {
                double se = sqrt(want[i] * (1 - want[i]) / N);
                double z = fabs(got[l][i] - want[i]) / se;
                if (z > worst) worst = z;
            }
            CHECK(worst < 5, "zipf:%.1f K%d layer %d: a rank's share is %.1f standard errors off", S, K, l, worst);
            if (l == 0 && K == 1)
                printf("zipf:%.1f E%d K%d: top rank share %.4f (expected %.4f), rank 8 %.4f (expected %.4f)\n",
                       S, E, K, got[l][0], want[0], got[l][7], want[7]);
        }
        CHECK(top[0] != top[1] || top[1] != top[2], "every layer has the same favourite expert: no per-layer ranking");
        mf_routing_free(r);
    }
    mf_routing *u = NULL;
    mf_routing_open("uniform", 1, E, 4, 9, &u);
    double cnt[32] = {0};
    int32_t ex[100 * 4];
    for (int step = 0; step < N / 100; step++) {
        mf_routing_next(u, 100, ex);
        for (int t = 0; t < 400; t++) cnt[ex[t]] += 1.0 / N;
    }
    double want = 4.0 / E, se = sqrt(want * (1 - want) / N), worst = 0;
    for (int i = 0; i < E; i++) worst = fmax(worst, fabs(cnt[i] - want) / se);
    CHECK(worst < 5, "uniform: an expert's share is %.1f standard errors off", worst);
    mf_routing_free(u);
}

/* ---- locality --------------------------------------------------------------------------------- */

/* Mean misses per token and layer against a FIFO window of the last `win` experts loaded (a miss
 * loads the expert, evicting the oldest), per sequence, over `steps` calls of n tokens (token t =
 * sequence t) after `warm` calls: the seed's probe of the released checkpoint. Also the mean
 * distinct experts per layer over runs of `span` consecutive tokens of one sequence (what a
 * verify of span tokens touches). */
static double fifo_misses(mf_routing *r, int L, int E, int K, int n, int warm, int steps, int win, int span,
                          double *distinct)
{
    int32_t *fifo = calloc((size_t)L * n * win, sizeof *fifo), *ex = malloc(sizeof *ex * (size_t)L * n * K);
    int *fill = calloc((size_t)L * n, sizeof *fill);
    int32_t *run = calloc((size_t)L * n * span * K, sizeof *run);
    uint8_t *seen = calloc((size_t)E, 1);
    double miss = 0, cnt = 0, dsum = 0, dcnt = 0;
    for (int step = 0; step < warm + steps; step++) {
        mf_routing_next(r, n, ex);
        for (int l = 0; l < L; l++)
            for (int t = 0; t < n; t++) {
                const int32_t *e = ex + ((size_t)l * n + t) * K;
                int32_t *f = fifo + ((size_t)l * n + t) * win;
                int *nf = &fill[(size_t)l * n + t], m = 0;
                for (int j = 0; j < K; j++) {
                    int hit = 0;
                    for (int i = 0; i < *nf; i++) hit |= f[i] == e[j];
                    if (hit) continue;
                    m++;
                    if (*nf == win) memmove(f, f + 1, sizeof *f * (size_t)(win - 1)), (*nf)--;
                    f[(*nf)++] = e[j];
                }
                if (step >= warm) miss += m, cnt++;
                int32_t *ru = run + ((size_t)l * n + t) * span * K;
                memcpy(ru + (size_t)(step % span) * K, e, sizeof *e * (size_t)K);
                if (step >= warm && (step - warm) % span == span - 1) {
                    int d = 0;
                    for (int i = 0; i < span * K; i++) d += !seen[ru[i]]++;
                    for (int i = 0; i < span * K; i++) seen[ru[i]] = 0;
                    dsum += d, dcnt++;
                }
            }
    }
    free(fifo), free(ex), free(fill), free(run), free(seen);
    *distinct = dsum / dcnt;
    return miss / cnt;
}

/* local routing: valid draws, deterministic per seed, refusals; the default's FIFO-16 misses on
 * the released checkpoint's shape (40 layers, 384 experts, top-6) within the seed's measured
 * 2.67-3.30 per layer, alone and in a batch of 16 sequences (each its own history); uniform
 * draws for contrast. */
static void test_local(void)
{
    const int L = 40, E = 384, K = 6;
    mf_routing *r = NULL, *r2 = NULL, *u = NULL;
    CHECK(mf_routing_open("local", L, E, K, 5, &r) == 0 && !strcmp(mf_routing_describe(r), "local:0.6:16"),
          "local: %s", mf_last_error());
    CHECK(mf_routing_open("local:0.6:16", L, E, K, 5, &r2) == 0, "local:0.6:16: %s", mf_last_error());
    if (!r || !r2) return;
    int32_t a[40 * 4 * 6], b[40 * 4 * 6];
    int same = 1;
    for (int step = 0; step < 20; step++) {
        mf_routing_next(r, 4, a);
        mf_routing_next(r2, 4, b);
        same &= !memcmp(a, b, sizeof a);
        check_valid(a, L, 4, K, E, "local");
    }
    CHECK(same, "local: the same spec and seed drew differently");
    mf_routing_free(r);
    mf_routing_free(r2);
    double d1, d16, du;
    mf_routing_open("local", L, E, K, 11, &r);
    double m1 = fifo_misses(r, L, E, K, 1, 20, 200, 16, 6, &d1);
    mf_routing_free(r);
    mf_routing_open("local", L, E, K, 12, &r);
    double m16 = fifo_misses(r, L, E, K, 16, 20, 60, 16, 6, &d16);
    mf_routing_free(r);
    mf_routing_open("uniform", L, E, K, 13, &u);
    double mu = fifo_misses(u, L, E, K, 1, 20, 200, 16, 6, &du);
    mf_routing_free(u);
    printf("FIFO-16 misses per layer of 6 (seed host: 2.67-3.30): local %.2f (one sequence), %.2f (16 sequences), "
           "uniform %.2f; distinct experts per layer over 6 consecutive tokens: local %.1f / %.1f, uniform %.1f\n",
           m1, m16, mu, d1, d16, du);
    CHECK(m1 >= 2.67 && m1 <= 3.30 && m16 >= 2.67 && m16 <= 3.30, "local: %.2f / %.2f FIFO misses", m1, m16);
    CHECK(mu > 5.5, "uniform: %.2f FIFO misses (expected ~5.8)", mu);
    const char *bad[] = {"local:1.5", "local:0.5:0", "local:0.5:385", "local:x", "local:0.5:16:2"};
    for (int i = 0; i < 5; i++) {
        mf_routing *x = NULL;
        CHECK(mf_routing_open(bad[i], L, E, K, 1, &x) == -EINVAL && !x && strstr(mf_last_error(), bad[i]),
              "%s refused: %s", bad[i], mf_last_error());
    }
}

/* ---- traces ---------------------------------------------------------------------------------- */

#define TL 6
#define TE 1024
#define TK 2
#define TPOS 50

typedef struct { mf_routing_rec *w; int seq; int fails; } rec_arg;

/* expert 0 encodes (seq, pos); expert 1 the layer */
static void token_experts(int seq, int pos, int layer, int32_t *ex)
{
    ex[0] = seq * TPOS + pos;
    ex[1] = (ex[0] + 1 + layer) % TE;
}

static void *rec_thread(void *p)
{
    rec_arg *a = p;
    for (int pos = 0; pos < TPOS; pos++)
        for (int l = TL - 1; l >= 0; l--) {   /* layers in any order */
            int32_t ex[TK];
            token_experts(a->seq, pos, l, ex);
            if (mf_routing_rec_add(a->w, a->seq, pos, l, ex, TK)) a->fails++;
        }
    return NULL;
}

static void test_trace_round_trip(void)
{
    char path[600], spec[620];
    snprintf(path, sizeof path, "%s/threads.trace", g_dir);
    mf_routing_rec *w = NULL;
    int rc = mf_routing_rec_open(path, TL, TE, TK, &w);
    CHECK(rc == 0, "rec open: %s", mf_last_error());
    if (rc) return;
    CHECK(access(path, F_OK) != 0, "the trace appears only when closed");
    int32_t bad[3] = {1, 2, 3};
    CHECK(mf_routing_rec_add(w, 0, 0, 0, bad, 3) == -EINVAL, "a record with 3 experts for top_k 2 is refused");
    bad[1] = 1;
    CHECK(mf_routing_rec_add(w, 0, 0, 0, bad, 2) == -EINVAL, "a repeated expert is refused");
    CHECK(mf_routing_rec_add(w, 0, 0, TL, bad, 2) == -EINVAL, "a layer out of range is refused");
    pthread_t th[4];
    rec_arg args[4];
    for (int i = 0; i < 4; i++) {
        args[i] = (rec_arg){w, i, 0};
        pthread_create(&th[i], NULL, rec_thread, &args[i]);
    }
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 4; i++) CHECK(args[i].fails == 0, "thread %d: adds failed", i);
    rc = mf_routing_rec_close(w);
    CHECK(rc == 0, "rec close: %s", mf_last_error());
    snprintf(spec, sizeof spec, "trace:%s", path);
    mf_routing *r = NULL;
    rc = mf_routing_open(spec, TL, TE, TK, 0, &r);
    CHECK(rc == 0, "replay: %s", mf_last_error());
    if (rc) return;
    CHECK(strstr(mf_routing_describe(r), "(200 tokens)") != NULL, "describe: %s", mf_routing_describe(r));
    /* every recorded token once, each sequence's in position order, layers intact; then it wraps */
    int seen[4 * TPOS] = {0}, last_pos[4] = {-1, -1, -1, -1}, ok = 1, in_order = 1;
    int32_t ex[TL * 1 * TK], first[TL * TK];
    for (int t = 0; t < 4 * TPOS; t++) {
        mf_routing_next(r, 1, ex);
        if (t == 0) memcpy(first, ex, sizeof first);
        int code = ex[0], seq = code / TPOS, pos = code % TPOS;
        if (code < 0 || code >= 4 * TPOS) { ok = 0; continue; }
        seen[code]++;
        in_order &= pos > last_pos[seq];
        last_pos[seq] = pos;
        for (int l = 0; l < TL; l++) {
            int32_t want[TK];
            token_experts(seq, pos, l, want);
            ok &= memcmp(ex + l * TK, want, sizeof want) == 0;
        }
    }
    for (int i = 0; i < 4 * TPOS; i++) ok &= seen[i] == 1;
    CHECK(ok, "replay: tokens lost, repeated or altered");
    CHECK(in_order, "replay: a sequence's tokens out of recorded order");
    mf_routing_next(r, 1, ex);
    CHECK(memcmp(ex, first, sizeof first) == 0, "replay wraps around to the first token");
    mf_routing_free(r);

    /* order: a batch recorded layer-major replays token by token, batched as asked */
    snprintf(path, sizeof path, "%s/order.trace", g_dir);
    mf_routing_rec_open(path, 2, 8, 2, &w);
    int32_t a0[2] = {0, 1}, b0[2] = {2, 3}, a1[2] = {4, 5}, b1[2] = {6, 7};
    mf_routing_rec_add(w, 0, 10, 0, a0, 2);
    mf_routing_rec_add(w, 1, 3, 0, b0, 2);
    mf_routing_rec_add(w, 1, 3, 1, b1, 2);
    mf_routing_rec_add(w, 0, 10, 1, a1, 2);
    CHECK(mf_routing_rec_close(w) == 0, "%s", mf_last_error());
    snprintf(spec, sizeof spec, "trace:%s", path);
    CHECK(mf_routing_open(spec, 2, 8, 2, 0, &r) == 0, "%s", mf_last_error());
    int32_t two[2 * 2 * 2];
    mf_routing_next(r, 2, two);
    /* [layer][token][k]: layer 0: a0 b0; layer 1: a1 b1 */
    static const int32_t want2[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    CHECK(memcmp(two, want2, sizeof want2) == 0, "batch of 2 from the trace: %d %d %d %d %d %d %d %d",
          two[0], two[1], two[2], two[3], two[4], two[5], two[6], two[7]);
    mf_routing_free(r);

    /* a trace for another model is refused, naming the path and what differs */
    static const int other[][3] = {{3, 8, 2}, {2, 16, 2}, {2, 8, 1}};
    static const char *what[] = {"layers 2 (expected 3)", "experts 8 (expected 16)", "top_k 2 (expected 1)"};
    for (int i = 0; i < 3; i++) {
        rc = mf_routing_open(spec, other[i][0], other[i][1], other[i][2], 0, &r);
        CHECK(rc == -EINVAL && strstr(mf_last_error(), path) && strstr(mf_last_error(), what[i]),
              "mismatch %d: rc %d '%s'", i, rc, mf_last_error());
    }
    /* a recorder whose file cannot be created says where */
    char unwritable[700];
    snprintf(unwritable, sizeof unwritable, "%s/x.trace", path);   /* under a file: its folder cannot be made */
    rc = mf_routing_rec_open(unwritable, 2, 8, 2, &w);
    CHECK(rc == -ENOTDIR && strstr(mf_last_error(), unwritable), "unwritable: %s", mf_last_error());
}

/* Each malformed trace is refused with -EINVAL, naming path:line (or the path) and the fault. */
static void test_trace_malformed(void)
{
    static const struct { const char *text; const char *line; const char *why; } cases[] = {
        {"", "", "no 'moeflow-routing' header"},
        {"moeflow-routing 1 layers 2 experts 8\n", ":1", "expected the header"},
        {"moeflow-routing 2 layers 2 experts 8 top_k 2\n", ":1", "version 2"},
        {"moeflow-routing 1 layers 2 experts 8 top_k 2\n", "", "holds no tokens"},
        {"moeflow-routing 1 layers 2 experts 8 top_k 2\n0 0 0 1 x\n", ":2", "found 'x'"},
        {"moeflow-routing 1 layers 2 experts 8 top_k 2\n0 0 0 1\n", ":2", "found 4"},
        {"moeflow-routing 1 layers 2 experts 8 top_k 2\n0 0 0 1 2 3\n", ":2", "found more than 5"},
        {"moeflow-routing 1 layers 2 experts 8 top_k 2\n# c\n0 0 2 1 2\n", ":3", "layer 2"},
        {"moeflow-routing 1 layers 2 experts 8 top_k 2\n0 0 0 1 8\n", ":2", "expert 8 out of range"},
        {"moeflow-routing 1 layers 2 experts 8 top_k 2\n0 0 0 3 3\n", ":2", "expert 3 chosen twice"},
        {"moeflow-routing 1 layers 2 experts 8 top_k 2\n0 0 0 1 2\n0 0 0 1 2\n", ":3", "recorded twice"},
        {"moeflow-routing 1 layers 2 experts 8 top_k 2\n0 0 0 1 2\n0 0 1 1 2\n0 1 1 1 2\n", ":4",
         "has 1 of 2 layers (layer 0 missing)"},
        {"moeflow-routing 1 layers 2 experts 8 top_k 2\n-1 0 0 1 2\n", ":2", "seq -1"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char path[600], spec[620], want[700];
        snprintf(path, sizeof path, "%s/bad%zu.trace", g_dir, i);
        FILE *f = fopen(path, "w");
        fputs(cases[i].text, f);
        fclose(f);
        snprintf(spec, sizeof spec, "trace:%s", path);
        snprintf(want, sizeof want, "%s%s", path, cases[i].line);
        mf_routing *r = NULL;
        int rc = mf_routing_open(spec, 2, 8, 2, 0, &r);
        CHECK(rc == -EINVAL && strstr(mf_last_error(), want) && strstr(mf_last_error(), cases[i].why),
              "case %zu: rc %d '%s' (want '%s' and '%s')", i, rc, mf_last_error(), want, cases[i].why);
        mf_routing_free(r);
    }
    /* bad specs name the spec */
    static const char *specs[] = {"zipf:", "zipf:-1", "zipf:x", "gauss", "trace:", "trace:/no/such/file"};
    for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
        mf_routing *r = NULL;
        int rc = mf_routing_open(specs[i], 2, 8, 2, 0, &r);
        const char *name = strncmp(specs[i], "trace:/", 7) == 0 ? specs[i] + 6 : specs[i];
        CHECK(rc < 0 && r == NULL && strstr(mf_last_error(), name), "spec '%s': rc %d '%s'", specs[i], rc,
              mf_last_error());
    }
    mf_routing *r = NULL;
    CHECK(mf_routing_open("uniform", 2, 8, 9, 0, &r) == -EINVAL, "top_k > experts refused");
}

/* ---- moeflow decode --record-routing ----------------------------------------------------------- */

static int cli(const char *args, char *out, size_t cap)
{
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s %s", getenv("MOEFLOW_BIN"), args);
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    return pclose(p);
}

typedef struct { int32_t ex[3][64][8]; int n; } ref_routes;   /* [pos][layer][k] */

static void on_route(void *user, const void *seq, int64_t pos, int layer, const int32_t *experts,
                     const float *weights, int n)
{
    ref_routes *rr = user;
    if (pos < 3 && layer < 64 && n <= 8) memcpy(rr->ex[pos][layer], experts, (size_t)n * sizeof *experts);
    rr->n++;
}

static void test_cli_record(void)
{
    if (!getenv("MOEFLOW_BIN")) {
        printf("test_routing: MOEFLOW_BIN unset, CLI checks skipped\n");
        return;
    }
    static char out[8192], plain[8192];
    char args[4096], ck[600], tr[700], spec[720];
    snprintf(ck, sizeof ck, "%s/tiny", g_dir);
    snprintf(tr, sizeof tr, "%s/decode.trace", g_dir);
    snprintf(args, sizeof args, "gen --preset tiny --out %s --quiet", ck);
    CHECK(cli(args, out, sizeof out) == 0, "gen tiny");
    snprintf(args, sizeof args, "decode --checkpoint %s --tokens 3,4,5 --batch 2 --max-new-tokens 4 --ignore-eos "
             "--threads 2 --quiet", ck);
    CHECK(cli(args, plain, sizeof plain) == 0, "decode");
    snprintf(args, sizeof args, "decode --checkpoint %s --tokens 3,4,5 --batch 2 --max-new-tokens 4 --ignore-eos "
             "--threads 2 --quiet --record-routing %s", ck, tr);
    CHECK(cli(args, out, sizeof out) == 0 && strcmp(out, plain) == 0, "recording changed the tokens: '%s' vs '%s'",
          out, plain);
    char cfgp[700];
    snprintf(cfgp, sizeof cfgp, "%s/config.json", ck);
    mf_config c;
    if (mf_config_load(cfgp, &c)) {
        CHECK(0, "%s", mf_last_error());
        return;
    }
    int L = c.n_layers, E = c.n_routed_experts, K = c.n_experts_per_tok;
    /* the reference's own routes for sequence 0's prompt */
    static ref_routes rr;
    mf_model *m = NULL;
    mf_ref *ref = NULL;
    mf_ref_state *st = NULL;
    mf_model_opts mo = {.quiet = 1};
    mf_ref_opts ro = {.hooks = {.user = &rr, .on_route = on_route}};
    int rc = mf_model_load(ck, &mo, &m);
    if (!rc) rc = mf_ref_new(m, &ro, &ref);
    if (!rc) rc = mf_ref_state_new(ref, 8, &st);
    int32_t toks[3] = {3, 4, 5};
    if (!rc) rc = mf_ref_prefill(ref, st, toks, 3, NULL);
    CHECK(rc == 0 && L <= 64 && K <= 8, "reference prefill: %s", mf_last_error());
    mf_ref_state_free(st);
    mf_ref_free(ref);
    mf_model_free(m);
    if (rc || L > 64 || K > 8) return;
    /* the scheduled engine's trace (2 sequences x (3 prompt + 3 fed back) tokens) starts with
     * sequence 0's prompt; its int8 experts may route later layers differently, layer 0 not.
     * The reference engine's trace has the reference's routes in every layer. */
    for (int eng = 0; eng < 2; eng++) {
        if (eng == 1) {
            snprintf(args, sizeof args, "decode --checkpoint %s --tokens 3,4,5 --batch 2 --max-new-tokens 4 "
                     "--ignore-eos --quiet --engine reference --record-routing %s", ck, tr);
            CHECK(cli(args, out, sizeof out) == 0 && strcmp(out, plain) == 0, "reference engine: '%s'", out);
        }
        snprintf(spec, sizeof spec, "trace:%s", tr);
        mf_routing *r = NULL;
        rc = mf_routing_open(spec, L, E, K, 0, &r);
        CHECK(rc == 0, "replay the decode's trace: %s", mf_last_error());
        if (rc) return;
        CHECK(strstr(mf_routing_describe(r), "(12 tokens)") != NULL, "%s", mf_routing_describe(r));
        int32_t ex[64 * 8];
        int same = 1;
        for (int t = 0; t < 3; t++) {
            mf_routing_next(r, 1, ex);
            for (int l = 0; l < (eng ? L : 1); l++)
                same &= memcmp(ex + (size_t)l * K, rr.ex[t][l], (size_t)K * sizeof *ex) == 0;
        }
        CHECK(same, "%s engine: the recorded routes differ from the reference's", eng ? "reference" : "scheduled");
        mf_routing_free(r);
    }
    /* an unwritable trace fails the command and names the path */
    snprintf(args, sizeof args, "decode --checkpoint %s --tokens 3 --max-new-tokens 1 --quiet "
             "--record-routing %s/config.json/t.trace 2>&1", ck, ck);   /* under a file */
    CHECK(cli(args, out, sizeof out) != 0 && strstr(out, "config.json/t.trace"), "unwritable: '%s'", out);
}

int main(void)
{
    const char *tmp = getenv("MOEFLOW_TMP");
    snprintf(g_dir, sizeof g_dir, "%s/routing.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) {
        perror(g_dir);
        return 1;
    }
    test_draws();
    test_zipf_skew();
    test_local();
    test_trace_round_trip();
    test_trace_malformed();
    test_cli_record();
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
    return mf_check_exit("test_routing");
}
