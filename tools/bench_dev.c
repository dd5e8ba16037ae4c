/* `moeflow bench dev`: on one card of a device (emu:N or cuda), the FP4 expert matmul (fp32 and
 * int8 paths), the int8 expert FFN (w1, w3, w2) and the dense FP8 and BF16 linears (the same bytes
 * viewed as [rows/2, cols] FP8 and [rows/4, cols] BF16) against a device-to-device copy of the same
 * weight bytes, and pinned host-to-device copies of one expert matrix against the largest single
 * copy tried; weights rotating over more than the card's L2, each op warmed up and then timed by
 * device events around replays of a captured graph. One line per measurement and a JSON summary. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/dev.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "tools/commands.h"

/* The weights rotate over n_sets copies (each one allocation: codes, then scales at +wb) whose
 * total is several times the card's L2 (60 MB on an H200), so a timed op reads HBM, not cache. */
typedef struct mf_bench_dev_args {
    mf_kern_mat w;               /* the shape; w.w and w.scale set per op from the set */
    mf_dev_ffn ffn;
    void *q8;
    float *x, *y;
    int n_tok, card;
    uint8_t **set;               /* [n_sets] device allocations of wb + sb bytes */
    int n_sets;
    size_t wb, sb;
    const void *host;            /* pinned wb + sb bytes: the h2d source */
} mf_bench_dev_args;

typedef int (*mf_bench_dev_op)(mf_dev_stream *s, mf_bench_dev_args *a, int i);

static mf_kern_mat mf_bench_dev_mat(const mf_bench_dev_args *a, int k, int n_out, int n_in)
{
    const uint8_t *b = a->set[k % a->n_sets];
    return (mf_kern_mat){.fmt = MF_KERN_FP4, .w = b, .scale = b + a->wb, .n_out = n_out, .n_in = n_in};
}
static int mf_bench_dev_matmul(mf_dev_stream *s, mf_bench_dev_args *a, int i)
{
    mf_kern_mat w = mf_bench_dev_mat(a, i, a->w.n_out, a->w.n_in);
    return mf_dev_fp4_matmul(s, &w, a->x, a->n_tok, a->y, NULL);
}
static int mf_bench_dev_matmul_q8(mf_dev_stream *s, mf_bench_dev_args *a, int i)
{
    mf_kern_mat w = mf_bench_dev_mat(a, i, a->w.n_out, a->w.n_in);
    return mf_dev_fp4_matmul(s, &w, a->x, a->n_tok, a->y, a->q8);
}
/* w1, w3 and w2 from three consecutive sets (w2 read as the transpose's shape: the same bytes) */
static int mf_bench_dev_ffn(mf_dev_stream *s, mf_bench_dev_args *a, int i)
{
    mf_dev_ffn f = a->ffn;
    f.w1 = mf_bench_dev_mat(a, 3 * i, a->w.n_out, a->w.n_in);
    f.w3 = mf_bench_dev_mat(a, 3 * i + 1, a->w.n_out, a->w.n_in);
    f.w2 = mf_bench_dev_mat(a, 3 * i + 2, a->w.n_in, a->w.n_out);
    return mf_dev_expert_ffn(s, &f);
}
/* The dense linears over a set's bytes (the wb codes bytes): FP8 [n_out / 2, n_in] (its 32x32
 * tile scales from the set's scale bytes, all 1) and BF16 [n_out / 4, n_in], the same bytes as the
 * FP4 matrix and its d2d copy. */
static int mf_bench_dev_fp8_lin_path(mf_dev_stream *s, mf_bench_dev_args *a, int i, mf_dev_lin_path path)
{
    const uint8_t *b = a->set[i % a->n_sets];
    mf_dev_lin l = {.w = {MF_KERN_FP8, b, b + a->wb, a->w.n_out / 2, a->w.n_in}, .x = a->x, .ld_x = a->w.n_in,
                    .n_tok = a->n_tok, .y = a->y, .ld_y = a->w.n_out / 2, .path = path};
    return mf_dev_linear(s, &l);
}
static int mf_bench_dev_fp8_lin(mf_dev_stream *s, mf_bench_dev_args *a, int i)
{
    return mf_bench_dev_fp8_lin_path(s, a, i, MF_DEV_LIN_AUTO);
}
/* the two CUDA kernels of a dense linear, forced (mf_dev_lin.path): their ratio per token count
 * is the measurement MF_DEV_LIN_TILED_MIN_TOK waits for (emulated cards run the host's for both) */
static int mf_bench_dev_fp8_lin_rows(mf_dev_stream *s, mf_bench_dev_args *a, int i)
{
    return mf_bench_dev_fp8_lin_path(s, a, i, MF_DEV_LIN_ROWS);
}
static int mf_bench_dev_fp8_lin_tiled(mf_dev_stream *s, mf_bench_dev_args *a, int i)
{
    return mf_bench_dev_fp8_lin_path(s, a, i, MF_DEV_LIN_TILED);
}
static int mf_bench_dev_bf16_lin(mf_dev_stream *s, mf_bench_dev_args *a, int i)
{
    const uint8_t *b = a->set[i % a->n_sets];
    mf_dev_lin l = {.w = {MF_KERN_BF16, b, NULL, a->w.n_out / 4, a->w.n_in}, .x = a->x, .ld_x = a->w.n_in,
                    .n_tok = a->n_tok, .y = a->y, .ld_y = a->w.n_out / 4};
    return mf_dev_linear(s, &l);
}
/* the codes of set i onto set i + n/2 (every set holds the same bytes, so they stay valid) */
static int mf_bench_dev_d2d(mf_dev_stream *s, mf_bench_dev_args *a, int i)
{
    int k = i % a->n_sets, o = (k + a->n_sets / 2) % a->n_sets;
    return mf_dev_copy_d2d(s, a->card, a->set[o], a->card, a->set[k], a->wb);
}
static int mf_bench_dev_h2d(mf_dev_stream *s, mf_bench_dev_args *a, int i)
{
    return mf_dev_copy_h2d(s, a->set[i % a->n_sets], a->host, a->wb + a->sb);
}

typedef struct mf_bench_dev_timing {
    int64_t warm_ns, min_ns;     /* warm-up, then at least this much timed work */
    int min_reps;
    mf_dev_event *t0, *t1;       /* timed events of the card */
} mf_bench_dev_timing;

/* Device time of one op, from timed events around replays of a captured graph of nb consecutive
 * ops (so the card runs them back to back, whatever the host's launch cost): one op cold gives a
 * first estimate; the graph (nb ops making about a tenth of min_ns, at most 64) is replayed for
 * warm_ns, then L times (>= min_ns of work, >= min_reps ops) between the events. *n_ops: how many
 * were timed. A negative code on failure. */
static int64_t mf_bench_dev_time(mf_dev_stream *s, mf_bench_dev_op op, mf_bench_dev_args *a,
                                 const mf_bench_dev_timing *tm, int64_t *n_ops)
{
    int64_t t = mf_now_ns();
    int rc = op(s, a, 0);
    if (!rc) rc = mf_dev_stream_sync(s);
    if (rc) return rc;
    int64_t est = mf_now_ns() - t;
    int nb = (int)(tm->min_ns / 10 / (est > 1 ? est : 1));
    nb = nb < 1 ? 1 : nb > 64 ? 64 : nb;
    /* a short op rotates over every set within a replay, so no set is read again from L2 */
    if (est < 1000000 && nb < a->n_sets) nb = a->n_sets < 64 ? a->n_sets : 64;
    mf_dev_graph *g = NULL;
    rc = mf_dev_capture_begin(s);
    for (int i = 0; i < nb && !rc; i++) rc = op(s, a, i);
    int rc2 = mf_dev_capture_end(s, &g);
    if (!rc) rc = rc2;
    if (rc) {
        mf_dev_graph_destroy(g);
        return rc;
    }
    int64_t w0 = mf_now_ns(), n_warm = 0;
    for (int k = 1; !rc && (n_warm == 0 || mf_now_ns() - w0 < tm->warm_ns); k *= 2) {
        int64_t b0 = mf_now_ns();
        for (int j = 0; j < k && !rc; j++) rc = mf_dev_graph_launch(g, s);
        if (!rc) rc = mf_dev_stream_sync(s);
        n_warm += k;
        est = (mf_now_ns() - b0) / ((int64_t)k * nb);
        if (k >= 1 << 16) break;
    }
    int64_t per_launch = est * nb > 0 ? est * nb : 1;
    int64_t L = (tm->min_ns + per_launch - 1) / per_launch;
    if (L * nb < tm->min_reps) L = (tm->min_reps + nb - 1) / nb;
    if (L > (1 << 20)) L = 1 << 20;
    if (!rc) rc = mf_dev_event_record(tm->t0, s);
    for (int64_t j = 0; j < L && !rc; j++) rc = mf_dev_graph_launch(g, s);
    if (!rc) rc = mf_dev_event_record(tm->t1, s);
    int64_t ns = 0;
    if (!rc) rc = mf_dev_event_elapsed_ns(tm->t0, tm->t1, &ns);
    if (!rc) rc = mf_dev_stream_sync(s);
    mf_dev_graph_destroy(g);
    if (rc) return rc;
    *n_ops = L * nb;
    return ns / (L * nb) > 0 ? ns / (L * nb) : 1;
}

int mf_bench_dev(int argc, char **argv)
{
    const char *spec = "emu:1";
    int n_out = 2048, n_in = 7168, n_tok = 1, reps = 20;
    uint64_t big = 256ull << 20, rot = 256ull << 20;
    double warm_ms = 200, min_ms = 10;
    for (int i = 1; i < argc; i++) {
        int hv = i + 1 < argc;
        if (!strcmp(argv[i], "--devices") && hv) spec = argv[++i];
        else if (!strcmp(argv[i], "--rows") && hv) n_out = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--cols") && hv) n_in = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tokens") && hv) n_tok = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && hv) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--big-mib") && hv) big = (uint64_t)atoll(argv[++i]) << 20;
        else if (!strcmp(argv[i], "--rotate-mib") && hv) rot = (uint64_t)atoll(argv[++i]) << 20;
        else if (!strcmp(argv[i], "--warm-ms") && hv) warm_ms = atof(argv[++i]);
        else if (!strcmp(argv[i], "--min-ms") && hv) min_ms = atof(argv[++i]);
        else {
            fprintf(stderr, "usage: moeflow bench dev [--devices SPEC] [--rows N] [--cols N] [--tokens T] "
                            "[--reps R] [--big-mib M] [--rotate-mib W] [--warm-ms MS] [--min-ms MS]\n"
                            "  card 0 of SPEC (default emu:1): the FP4 matmul (fp32 and int8 paths) of an "
                            "N x M expert matrix (default 2048 x 7168) and the int8 expert FFN (w1, w3: N x M, "
                            "w2: M x N) vs d2d copies of their bytes; the dense FP8 (N/2 x M) and BF16 (N/4 x M) "
                            "linears of the same bytes, the FP8 one also with each CUDA kernel forced "
                            "(warp-per-row, tiled: their ratio at T tokens); pinned h2d of one matrix vs one copy of "
                            "M MiB (default 256). The weights rotate over copies totalling W MiB (default 256, "
                            "several times an H200's 60 MB L2); each op is warmed up for MS ms (default 200), "
                            "then timed with device events over at least --min-ms of work (default 10) and at "
                            "least R ops (default 20)\n");
            return 2;
        }
    }
    if (n_out < 32 || n_in < 32 || n_in % 32 || n_out % 32 || n_tok < 1 || reps < 1 || big < (1u << 20) ||
        warm_ms < 0 || min_ms <= 0) {
        fprintf(stderr, "moeflow bench dev: rows and cols multiples of 32, tokens, reps >= 1, big-mib >= 1, "
                        "warm-ms >= 0, min-ms > 0\n");
        return 2;
    }
    mf_dev *d = NULL;
    if (mf_dev_open(spec, &d)) {
        fprintf(stderr, "moeflow bench dev: %s\n", mf_last_error());
        return 1;
    }
    size_t wb = (size_t)n_out * n_in / 2, sb = (size_t)n_out * n_in / 32;
    size_t xb = (size_t)n_tok * n_in * 4, yb = (size_t)n_tok * n_out * 4;
    int n_sets = (int)((rot + wb + sb - 1) / (wb + sb));
    if (n_sets < 4) n_sets = 4;   /* the FFN's three matrices, and a d2d target apart from its source */
    uint8_t **set = calloc((size_t)n_sets, sizeof *set);
    void *x = NULL, *y = NULL, *hw = NULL, *dbig = NULL, *hbig = NULL, *q8 = NULL, *h = NULL, *yf = NULL;
    mf_bench_dev_timing tm = {.warm_ns = (int64_t)(warm_ms * 1e6), .min_ns = (int64_t)(min_ms * 1e6),
                              .min_reps = reps};
    size_t q8b = mf_dev_ffn_q8_bytes(n_tok, n_in, n_out);
    int rc = set ? 0 : mf_error(-ENOMEM, "bench dev: out of host memory");
    for (int k = 0; k < n_sets && !rc; k++) rc = mf_dev_alloc(d, 0, wb + sb, (void **)&set[k]);
    if (!rc) rc = mf_dev_alloc(d, 0, q8b, &q8);
    if (!rc) rc = mf_dev_alloc(d, 0, (size_t)n_tok * n_out * 4, &h);
    if (!rc) rc = mf_dev_alloc(d, 0, xb, &yf);
    if (!rc) rc = mf_dev_alloc(d, 0, xb, &x);
    if (!rc) rc = mf_dev_alloc(d, 0, yb, &y);
    if (!rc) rc = mf_dev_host_alloc(d, 0, wb + sb + xb, &hw);
    if (!rc) rc = mf_dev_event_create_timed(d, 0, &tm.t0);
    if (!rc) rc = mf_dev_event_create_timed(d, 0, &tm.t1);
    mf_dev_stream *cs = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COMPUTE), *in = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COPY_IN);
    int64_t t_mm = -1, t_d2d = -1, t_h2d = -1, t_big = -1, t_q8 = -1, t_ffn = -1, t_f8 = -1, t_b16 = -1;
    int64_t n_mm = 0, n_d2d = 0, n_h2d = 0, n_big = 0, n_q8 = 0, n_ffn = 0, n_f8 = 0, n_b16 = 0;
    int64_t t_f8r = -1, t_f8t = -1, n_f8r = 0, n_f8t = 0;   /* the FP8 linear's two kernels, forced */
    if (!rc) {
        uint8_t *hb = hw;
        for (size_t i = 0; i < wb; i++) hb[i] = (uint8_t)(i * 2654435761u >> 13);
        memset(hb + wb, 127, sb);   /* E8M0 scale 1 */
        for (size_t i = 0; i < xb / 4; i++) ((float *)(hb + wb + sb))[i] = (float)((int)(i % 17) - 8) / 8;
        for (int k = 0; k < n_sets && !rc; k++) rc = mf_dev_copy_h2d(in, set[k], hb, wb + sb);
        if (!rc) rc = mf_dev_copy_h2d(in, x, hb + wb + sb, xb);
        if (!rc) rc = mf_dev_stream_sync(in);
    }
    mf_bench_dev_args a = {.w = {.fmt = MF_KERN_FP4, .n_out = n_out, .n_in = n_in}, .x = x, .y = y,
                           .n_tok = n_tok, .card = 0, .q8 = q8, .set = set, .n_sets = n_sets, .wb = wb,
                           .sb = sb, .host = hw};
    a.ffn = (mf_dev_ffn){.x = x, .n_tok = n_tok, .limit = 7.0f, .h = h, .q8_scratch = q8, .y = yf};
    if (!rc && (t_mm = mf_bench_dev_time(cs, mf_bench_dev_matmul, &a, &tm, &n_mm)) < 0) rc = (int)t_mm;
    if (!rc && (t_q8 = mf_bench_dev_time(cs, mf_bench_dev_matmul_q8, &a, &tm, &n_q8)) < 0) rc = (int)t_q8;
    if (!rc && (t_ffn = mf_bench_dev_time(cs, mf_bench_dev_ffn, &a, &tm, &n_ffn)) < 0) rc = (int)t_ffn;
    if (!rc && n_out % 64 == 0 && (t_f8 = mf_bench_dev_time(cs, mf_bench_dev_fp8_lin, &a, &tm, &n_f8)) < 0)
        rc = (int)t_f8;
    if (!rc && n_out >= 4 && (t_b16 = mf_bench_dev_time(cs, mf_bench_dev_bf16_lin, &a, &tm, &n_b16)) < 0)
        rc = (int)t_b16;
    if (!rc && n_out % 64 == 0 && (t_f8r = mf_bench_dev_time(cs, mf_bench_dev_fp8_lin_rows, &a, &tm, &n_f8r)) < 0)
        rc = (int)t_f8r;
    if (!rc && n_out % 64 == 0 && (t_f8t = mf_bench_dev_time(cs, mf_bench_dev_fp8_lin_tiled, &a, &tm, &n_f8t)) < 0)
        rc = (int)t_f8t;
    if (!rc && (t_d2d = mf_bench_dev_time(cs, mf_bench_dev_d2d, &a, &tm, &n_d2d)) < 0) rc = (int)t_d2d;
    if (!rc && (t_h2d = mf_bench_dev_time(in, mf_bench_dev_h2d, &a, &tm, &n_h2d)) < 0) rc = (int)t_h2d;
    /* the largest single copy: halve until the card and the host grant it */
    for (; !rc && big >= (1u << 20); big /= 2) {
        if (mf_dev_alloc(d, 0, big, &dbig)) continue;
        if (mf_dev_host_alloc(d, 0, big, &hbig)) {
            mf_dev_free(d, 0, dbig);
            dbig = NULL;
            continue;
        }
        memset(hbig, 1, big);
        mf_bench_dev_args ab = a;
        uint8_t *one[1] = {dbig};
        ab.set = one;
        ab.n_sets = 1;
        ab.wb = big;
        ab.sb = 0;
        ab.host = hbig;
        mf_bench_dev_timing tb = tm;
        tb.min_reps = 3;
        if ((t_big = mf_bench_dev_time(in, mf_bench_dev_h2d, &ab, &tb, &n_big)) < 0) rc = (int)t_big;
        break;
    }
    if (rc) {
        fprintf(stderr, "moeflow bench dev: %s\n", mf_last_error());
    } else {
        double wgb = (wb + sb) / 1e9;
        printf("device %s (%s), card 0: weights rotating over %d copies of %.1f MB (%.0f MB); each op "
               "warmed up %.0f ms, then timed by device events over >= %.0f ms\n", spec, mf_dev_kind(d),
               n_sets, (wb + sb) / 1e6, n_sets * (wb + sb) / 1e6, warm_ms, min_ms);
        printf("FP4 matmul %d x %d, %d token(s), fp32 path: %.2f us (%.1f GB/s of weights; %" PRId64 " ops timed)\n",
               n_out, n_in, n_tok, t_mm / 1e3, wgb / (t_mm / 1e9), n_mm);
        printf("FP4 matmul, int8 path: %.2f us (%.1f GB/s of weights; %" PRId64 " ops)\n", t_q8 / 1e3,
               wgb / (t_q8 / 1e9), n_q8);
        printf("d2d copy of the %zu weight bytes: %.2f us (%.1f GB/s read; %" PRId64 " ops); matmul / copy = "
               "%.2f (fp32), %.2f (int8)\n", wb, t_d2d / 1e3, wb / 1e9 / (t_d2d / 1e9), n_d2d,
               (double)t_mm / (double)t_d2d, (double)t_q8 / (double)t_d2d);
        if (t_f8 > 0)
            printf("FP8 dense linear %d x %d (the same %zu bytes, 32x32 tile scales): %.2f us (%.1f GB/s; %" PRId64
                   " ops); linear / copy = %.2f\n", n_out / 2, n_in, wb, t_f8 / 1e3, wb / 1e9 / (t_f8 / 1e9), n_f8,
                   (double)t_f8 / (double)t_d2d);
        if (t_b16 > 0)
            printf("BF16 dense linear %d x %d (the same %zu bytes): %.2f us (%.1f GB/s; %" PRId64
                   " ops); linear / copy = %.2f\n", n_out / 4, n_in, wb, t_b16 / 1e3, wb / 1e9 / (t_b16 / 1e9), n_b16,
                   (double)t_b16 / (double)t_d2d);
        if (t_f8r > 0 && t_f8t > 0)
            printf("FP8 dense linear, %d token(s): warp-per-row kernel %.2f us (%.1f G multiply-adds/s), tiled "
                   "kernel %.2f us (%.1f G/s); tiled / rows = %.2f (AUTO takes the tiled one from %d tokens)\n",
                   n_tok, t_f8r / 1e3, (double)wb * n_tok / t_f8r, t_f8t / 1e3, (double)wb * n_tok / t_f8t,
                   (double)t_f8t / (double)t_f8r, MF_DEV_LIN_TILED_MIN_TOK);
        printf("expert FFN, int8 path (w1, w3, w2: 3 x %zu bytes): %.2f us (%.1f GB/s of weights; %" PRId64
               " ops); FFN / (3 x copy) = %.2f\n", wb + sb, t_ffn / 1e3, 3 * wgb / (t_ffn / 1e9), n_ffn,
               (double)t_ffn / (3.0 * (double)t_d2d));
        printf("pinned h2d of the expert matrix (%zu bytes): %.2f us (%.1f GB/s; %" PRId64 " ops)\n", wb + sb,
               t_h2d / 1e3, wgb / (t_h2d / 1e9), n_h2d);
        if (t_big > 0)
            printf("pinned h2d of one %" PRIu64 " MiB copy: %.1f us (%.1f GB/s; %" PRId64 " ops)\n", big >> 20,
                   t_big / 1e3, big / 1e9 / (t_big / 1e9), n_big);
        printf("{\"device\": \"%s\", \"rows\": %d, \"cols\": %d, \"tokens\": %d, \"rotate_sets\": %d, "
               "\"matmul_ns\": %" PRId64 ", \"matmul_int8_ns\": %" PRId64 ", \"ffn_int8_ns\": %" PRId64
               ", \"d2d_ns\": %" PRId64 ", \"weight_bytes\": %zu, \"h2d_expert_ns\": %" PRId64
               ", \"h2d_big_bytes\": %" PRIu64 ", \"h2d_big_ns\": %" PRId64 ", \"fp8_linear_ns\": %" PRId64
               ", \"bf16_linear_ns\": %" PRId64 ", \"fp8_linear_rows_ns\": %" PRId64
               ", \"fp8_linear_tiled_ns\": %" PRId64 "}\n", spec, n_out, n_in, n_tok,
               n_sets, t_mm, t_q8, t_ffn, t_d2d, wb + sb, t_h2d, t_big > 0 ? big : 0, t_big, t_f8, t_b16, t_f8r, t_f8t);
    }
    mf_dev_event_destroy(tm.t0);
    mf_dev_event_destroy(tm.t1);
    for (int k = 0; set && k < n_sets; k++) mf_dev_free(d, 0, set[k]);
    free(set);
    mf_dev_free(d, 0, x);
    mf_dev_free(d, 0, y);
    mf_dev_free(d, 0, q8);
    mf_dev_free(d, 0, h);
    mf_dev_free(d, 0, yf);
    mf_dev_free(d, 0, dbig);
    mf_dev_host_free(d, hw);
    mf_dev_host_free(d, hbig);
    mf_dev_close(d);
    return rc ? 1 : 0;
}
