/* `moeflow bench dev`: on one card of a device (emu:N or cuda), the FP4 expert matmul (fp32 and
 * int8 paths) and the int8 expert FFN (w1, w3, w2) against a device-to-device copy of the same
 * weight bytes, and pinned host-to-device copies of one expert matrix against the largest single
 * copy tried. Prints one line per measurement and a JSON summary. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/dev.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "tools/commands.h"

/* Mean time of `reps` enqueues of op on s, after one warm-up; negative code on failure. */
typedef int (*mf_bench_dev_op)(mf_dev_stream *s, void *u);
static int64_t mf_bench_dev_time(mf_dev_stream *s, mf_bench_dev_op op, void *u, int reps)
{
    int rc = op(s, u);
    if (!rc) rc = mf_dev_stream_sync(s);
    if (rc) return rc;
    int64_t t0 = mf_now_ns();
    for (int i = 0; i < reps && !rc; i++) rc = op(s, u);
    if (!rc) rc = mf_dev_stream_sync(s);
    return rc ? rc : (mf_now_ns() - t0) / reps;
}

typedef struct mf_bench_dev_args {
    mf_kern_mat w;
    mf_dev_ffn ffn;
    void *q8;
    float *x, *y;
    int n_tok, card;
    void *dst, *src;
    size_t n_bytes;
} mf_bench_dev_args;

static int mf_bench_dev_matmul(mf_dev_stream *s, void *u)
{
    mf_bench_dev_args *a = u;
    return mf_dev_fp4_matmul(s, &a->w, a->x, a->n_tok, a->y, NULL);
}
static int mf_bench_dev_matmul_q8(mf_dev_stream *s, void *u)
{
    mf_bench_dev_args *a = u;
    return mf_dev_fp4_matmul(s, &a->w, a->x, a->n_tok, a->y, a->q8);
}
static int mf_bench_dev_ffn(mf_dev_stream *s, void *u)
{
    mf_bench_dev_args *a = u;
    return mf_dev_expert_ffn(s, &a->ffn);
}
static int mf_bench_dev_d2d(mf_dev_stream *s, void *u)
{
    mf_bench_dev_args *a = u;
    return mf_dev_copy_d2d(s, a->card, a->dst, a->card, a->src, a->n_bytes);
}
static int mf_bench_dev_h2d(mf_dev_stream *s, void *u)
{
    mf_bench_dev_args *a = u;
    return mf_dev_copy_h2d(s, a->dst, a->src, a->n_bytes);
}

int mf_bench_dev(int argc, char **argv)
{
    const char *spec = "emu:1";
    int n_out = 2048, n_in = 7168, n_tok = 1, reps = 20;
    uint64_t big = 256ull << 20;
    for (int i = 1; i < argc; i++) {
        int hv = i + 1 < argc;
        if (!strcmp(argv[i], "--devices") && hv) spec = argv[++i];
        else if (!strcmp(argv[i], "--rows") && hv) n_out = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--cols") && hv) n_in = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tokens") && hv) n_tok = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && hv) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--big-mib") && hv) big = (uint64_t)atoll(argv[++i]) << 20;
        else {
            fprintf(stderr, "usage: moeflow bench dev [--devices SPEC] [--rows N] [--cols N] [--tokens T] "
                            "[--reps R] [--big-mib M]\n  card 0 of SPEC (default emu:1): the FP4 matmul "
                            "(fp32 and int8 paths) of an N x M expert matrix (default 2048 x 7168) and the "
                            "int8 expert FFN (w1, w3: N x M, w2: M x N) vs d2d copies of their bytes; pinned "
                            "h2d of one matrix vs one copy of M MiB (default 256)\n");
            return 2;
        }
    }
    if (n_out < 32 || n_in < 32 || n_in % 32 || n_out % 32 || n_tok < 1 || reps < 1 || big < (1u << 20)) {
        fprintf(stderr, "moeflow bench dev: rows and cols multiples of 32, tokens, reps >= 1, big-mib >= 1\n");
        return 2;
    }
    mf_dev *d = NULL;
    if (mf_dev_open(spec, &d)) {
        fprintf(stderr, "moeflow bench dev: %s\n", mf_last_error());
        return 1;
    }
    size_t wb = (size_t)n_out * n_in / 2, sb = (size_t)n_out * n_in / 32;
    size_t xb = (size_t)n_tok * n_in * 4, yb = (size_t)n_tok * n_out * 4;
    void *w = NULL, *sc = NULL, *x = NULL, *y = NULL, *w2 = NULL, *hw = NULL, *dbig = NULL, *hbig = NULL;
    void *q8 = NULL, *h = NULL, *fw[4] = {NULL, NULL, NULL, NULL}, *yf = NULL;
    size_t q8b = mf_dev_ffn_q8_bytes(n_tok, n_in, n_out);
    int rc = mf_dev_alloc(d, 0, wb, &w);
    if (!rc) rc = mf_dev_alloc(d, 0, q8b, &q8);
    if (!rc) rc = mf_dev_alloc(d, 0, (size_t)n_tok * n_out * 4, &h);
    if (!rc) rc = mf_dev_alloc(d, 0, xb, &yf);
    for (int k = 0; k < 4 && !rc; k++) rc = mf_dev_alloc(d, 0, k % 2 ? sb : wb, &fw[k]);   /* w3, w2 */
    if (!rc) rc = mf_dev_alloc(d, 0, sb, &sc);
    if (!rc) rc = mf_dev_alloc(d, 0, xb, &x);
    if (!rc) rc = mf_dev_alloc(d, 0, yb, &y);
    if (!rc) rc = mf_dev_alloc(d, 0, wb + sb, &w2);   /* d2d target, then the h2d target */
    if (!rc) rc = mf_dev_host_alloc(d, 0, wb + sb + xb, &hw);
    mf_dev_stream *cs = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COMPUTE), *in = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COPY_IN);
    int64_t t_mm = -1, t_d2d = -1, t_h2d = -1, t_big = -1, t_q8 = -1, t_ffn = -1;
    if (!rc) {
        uint8_t *h = hw;
        for (size_t i = 0; i < wb; i++) h[i] = (uint8_t)(i * 2654435761u >> 13);
        memset(h + wb, 127, sb);   /* E8M0 scale 1 */
        for (size_t i = 0; i < xb / 4; i++) ((float *)(h + wb + sb))[i] = (float)((int)(i % 17) - 8) / 8;
        rc = mf_dev_copy_h2d(in, w, h, wb);
        if (!rc) rc = mf_dev_copy_h2d(in, sc, h + wb, sb);
        if (!rc) rc = mf_dev_copy_h2d(in, x, h + wb + sb, xb);
        for (int k = 0; k < 4 && !rc; k++) rc = mf_dev_copy_h2d(in, fw[k], h + (k % 2 ? wb : 0), k % 2 ? sb : wb);
        if (!rc) rc = mf_dev_stream_sync(in);
    }
    mf_bench_dev_args a = {.w = {.fmt = MF_KERN_FP4, .w = w, .scale = sc, .n_out = n_out, .n_in = n_in},
                           .x = x, .y = y, .n_tok = n_tok, .card = 0, .dst = w2, .src = w, .n_bytes = wb,
                           .q8 = q8};
    /* the FFN: w1 = the matrix, w3 and w2 copies of it (w2 read as its transpose's shape) */
    a.ffn = (mf_dev_ffn){.w1 = a.w, .w3 = {.fmt = MF_KERN_FP4, .w = fw[0], .scale = fw[1], .n_out = n_out, .n_in = n_in},
                         .w2 = {.fmt = MF_KERN_FP4, .w = fw[2], .scale = fw[3], .n_out = n_in, .n_in = n_out},
                         .x = x, .n_tok = n_tok, .limit = 7.0f, .h = h, .q8_scratch = q8, .y = yf};
    if (!rc && (t_mm = mf_bench_dev_time(cs, mf_bench_dev_matmul, &a, reps)) < 0) rc = (int)t_mm;
    if (!rc && (t_q8 = mf_bench_dev_time(cs, mf_bench_dev_matmul_q8, &a, reps)) < 0) rc = (int)t_q8;
    if (!rc && (t_ffn = mf_bench_dev_time(cs, mf_bench_dev_ffn, &a, reps)) < 0) rc = (int)t_ffn;
    if (!rc && (t_d2d = mf_bench_dev_time(cs, mf_bench_dev_d2d, &a, reps)) < 0) rc = (int)t_d2d;
    a.dst = w2;
    a.src = hw;
    a.n_bytes = wb + sb;
    if (!rc && (t_h2d = mf_bench_dev_time(in, mf_bench_dev_h2d, &a, reps)) < 0) rc = (int)t_h2d;
    /* the largest single copy: halve until the card and the host grant it */
    for (; !rc && big >= (1u << 20); big /= 2) {
        if (mf_dev_alloc(d, 0, big, &dbig)) continue;
        if (mf_dev_host_alloc(d, 0, big, &hbig)) {
            mf_dev_free(d, 0, dbig);
            dbig = NULL;
            continue;
        }
        memset(hbig, 1, big);
        a.dst = dbig;
        a.src = hbig;
        a.n_bytes = big;
        if ((t_big = mf_bench_dev_time(in, mf_bench_dev_h2d, &a, reps < 5 ? reps : 5)) < 0) rc = (int)t_big;
        break;
    }
    if (rc) {
        fprintf(stderr, "moeflow bench dev: %s\n", mf_last_error());
    } else {
        double wgb = (wb + sb) / 1e9;
        printf("device %s (%s), card 0: FP4 matmul %d x %d, %d token(s), fp32 path: %.1f us (%.1f GB/s of weights)\n",
               spec, mf_dev_kind(d), n_out, n_in, n_tok, t_mm / 1e3, wgb / (t_mm / 1e9));
        printf("FP4 matmul, int8 path: %.1f us (%.1f GB/s of weights)\n", t_q8 / 1e3,
               wgb / (t_q8 / 1e9));
        printf("d2d copy of the %zu weight bytes: %.1f us (%.1f GB/s); matmul / copy = %.2f (fp32), %.2f (int8)\n",
               wb, t_d2d / 1e3, wb / 1e9 / (t_d2d / 1e9), (double)t_mm / (double)t_d2d, (double)t_q8 / (double)t_d2d);
        printf("expert FFN, int8 path (w1, w3, w2: 3 x %zu bytes): %.1f us (%.1f GB/s of weights); "
               "FFN / (3 x copy) = %.2f\n", wb + sb, t_ffn / 1e3, 3 * wgb / (t_ffn / 1e9),
               (double)t_ffn / (3.0 * (double)t_d2d));
        printf("pinned h2d of the expert matrix (%zu bytes): %.1f us (%.1f GB/s)\n", wb + sb, t_h2d / 1e3,
               wgb / (t_h2d / 1e9));
        if (t_big > 0)
            printf("pinned h2d of one %" PRIu64 " MiB copy: %.1f us (%.1f GB/s)\n", big >> 20, t_big / 1e3,
                   big / 1e9 / (t_big / 1e9));
        printf("{\"device\": \"%s\", \"rows\": %d, \"cols\": %d, \"tokens\": %d, \"matmul_ns\": %" PRId64
               ", \"matmul_int8_ns\": %" PRId64 ", \"ffn_int8_ns\": %" PRId64 ", \"d2d_ns\": %" PRId64
               ", \"weight_bytes\": %zu, \"h2d_expert_ns\": %" PRId64 ", \"h2d_big_bytes\": %" PRIu64
               ", \"h2d_big_ns\": %" PRId64 "}\n", spec, n_out, n_in, n_tok, t_mm, t_q8, t_ffn, t_d2d, wb + sb,
               t_h2d, t_big > 0 ? big : 0, t_big);
    }
    mf_dev_free(d, 0, w);
    mf_dev_free(d, 0, sc);
    mf_dev_free(d, 0, x);
    mf_dev_free(d, 0, y);
    mf_dev_free(d, 0, w2);
    mf_dev_free(d, 0, q8);
    mf_dev_free(d, 0, h);
    mf_dev_free(d, 0, yf);
    for (int k = 0; k < 4; k++) mf_dev_free(d, 0, fw[k]);
    mf_dev_free(d, 0, dbig);
    mf_dev_host_free(d, hw);
    mf_dev_host_free(d, hbig);
    mf_dev_close(d);
    return rc ? 1 : 0;
}
