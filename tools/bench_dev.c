/* `moeflow bench dev`: on one card of a device (emu:N or cuda), the FP4 expert matmul (fp32 and
 * int8 paths), the int8 expert FFN (w1, w3, w2) and the dense FP8 and BF16 linears (the same bytes
 * viewed as [rows/2, cols] FP8 and [rows/4, cols] BF16) against a device-to-device copy of the same
 * weight bytes, the FP8 linear on each of its three paths (warp-per-row, tiled, cuBLASLt on weights
 * dequantized before, the dequantization timed on its own) and the expert FFN on cuBLASLt, and
 * pinned host-to-device copies of one expert matrix against the largest single copy tried; weights
 * rotating over more than the card's L2, each op warmed up and then timed by device events around
 * replays of a captured graph. One line per measurement and a JSON summary. */
#include <errno.h>
#include <inttypes.h>
#include <stddef.h>
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
    /* the cuBLASLt path (type NONE: the card has no tensor cores): the FP8 linear's weights of sets
     * 0..3 dequantized (the GEMM rotates over them), the expert's w13 and w2, the FFN's gu, the
     * cast and the workspace */
    mf_dev_f16 tc;
    mf_dev_w16 w16[4], w13, w2;
    float *gu;
    mf_dev_lt_buf lt;
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
/* the FP8 linear of set i on the cuBLASLt path, over the 16-bit copy of set i % 4 (the same shape
 * and values: every set holds the same bytes) */
static int mf_bench_dev_fp8_lin_lt(mf_dev_stream *s, mf_bench_dev_args *a, int i)
{
    const uint8_t *b = a->set[i % a->n_sets];
    mf_dev_lin l = {.w = {MF_KERN_FP8, b, b + a->wb, a->w.n_out / 2, a->w.n_in}, .x = a->x, .ld_x = a->w.n_in,
                    .n_tok = a->n_tok, .y = a->y, .ld_y = a->w.n_out / 2, .path = MF_DEV_LIN_CUBLASLT,
                    .w16 = a->w16[i % 4], .lt = a->lt};
    return mf_dev_linear(s, &l);
}
/* set i's FP8 view dequantized into the 16-bit copy i % 4 (what a layer's MF_SG_DENSE_DEQ does) */
static int mf_bench_dev_dequant(mf_dev_stream *s, mf_bench_dev_args *a, int i)
{
    const uint8_t *b = a->set[i % a->n_sets];
    mf_kern_mat w = {MF_KERN_FP8, b, b + a->wb, a->w.n_out / 2, a->w.n_in};
    return mf_dev_dequant(s, &w, &a->w16[i % 4]);
}
/* the expert FFN on cuBLASLt over the w13 and w2 dequantized before (from sets 0, 1, 2) */
static int mf_bench_dev_ffn_lt(mf_dev_stream *s, mf_bench_dev_args *a, int i)
{
    (void)i;
    mf_dev_ffn_lt f = {.w13 = a->w13, .w2 = a->w2, .x = a->x, .n_tok = a->n_tok, .limit = 7.0f, .gu = a->gu,
                       .lt = a->lt, .y = a->ffn.y};
    return mf_dev_expert_ffn_lt(s, &f);
}
/* an expert's three FP4 matrices dequantized (what a slot on the path does before its FFN) */
static int mf_bench_dev_dequant_ffn(mf_dev_stream *s, mf_bench_dev_args *a, int i)
{
    mf_kern_mat w1 = mf_bench_dev_mat(a, 3 * i, a->w.n_out, a->w.n_in), w3 = mf_bench_dev_mat(a, 3 * i + 1, a->w.n_out, a->w.n_in);
    mf_kern_mat w2 = mf_bench_dev_mat(a, 3 * i + 2, a->w.n_in, a->w.n_out);
    mf_dev_w16 o1 = a->w13, o3 = a->w13;
    o1.n_out = o3.n_out = a->w.n_out;
    o3.w = (uint16_t *)a->w13.w + (size_t)a->w.n_out * a->w.n_in;
    int rc = mf_dev_dequant(s, &w1, &o1);
    if (!rc) rc = mf_dev_dequant(s, &w3, &o3);
    return rc ? rc : mf_dev_dequant(s, &w2, &a->w2);
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

/* The command line of `moeflow bench dev`. */
typedef struct mf_bdv_cli {
    const char *spec;
    long n_out, n_in, n_tok, reps, big_mib, rot_mib;
    double warm_ms, min_ms;
    int linears;
} mf_bdv_cli;

#define F(x) offsetof(mf_bdv_cli, x)
static const mf_opt mf_bdv_table[] = {
    {"--devices", .kind = MF_OPT_STR, .off = F(spec), .def = "emu:1", .meta = "SPEC",
     .help = "the device (emu:N or cuda[:IDS]); card 0 is measured"},
    {"--rows", .kind = MF_OPT_LONG, .off = F(n_out), .def = "2048", .meta = "N", .lo = 32, .hi = 1 << 20,
     .help = "the expert matrix's rows (a multiple of 32)"},
    {"--cols", .kind = MF_OPT_LONG, .off = F(n_in), .def = "7168", .meta = "M", .lo = 32, .hi = 1 << 20,
     .help = "its columns (a multiple of 32)"},
    {"--tokens", .kind = MF_OPT_LONG, .off = F(n_tok), .def = "1", .meta = "T", .lo = 1, .hi = 1 << 16,
     .help = "tokens per matmul, FFN and linear"},
    {"--reps", .kind = MF_OPT_LONG, .off = F(reps), .def = "20", .meta = "R", .lo = 1, .hi = 1 << 20,
     .help = "at least this many ops timed"},
    {"--big-mib", .kind = MF_OPT_LONG, .off = F(big_mib), .def = "256", .meta = "M", .lo = 1, .hi = 1 << 20,
     .help = "the large single h2d copy's MiB (halved until the card and the\nhost grant it)"},
    {"--rotate-mib", .kind = MF_OPT_LONG, .off = F(rot_mib), .def = "256", .meta = "W", .lo = 1, .hi = 1 << 20,
     .help = "MiB of weight copies the ops rotate over (several times an\nH200's 60 MB L2)"},
    {"--warm-ms", .kind = MF_OPT_DOUBLE, .off = F(warm_ms), .def = "200", .meta = "MS", .lo = 0, .hi = 1e6,
     .help = "each op's warm-up"},
    {"--min-ms", .kind = MF_OPT_DOUBLE, .off = F(min_ms), .def = "10", .meta = "MS", .lo = 0, .hi = 1e6,
     .flags = MF_OPT_LO_OPEN, .help = "at least this much timed work per op"},
    {"--linears-only", .kind = MF_OPT_FLAG, .off = F(linears),
     .help = "only the FP8 linear's three paths and its dequantization (prefill\nsizes: 2,048 and 8,192 tokens)"},
    {NULL},
};
#undef F

static const mf_opts_spec mf_bdv_spec = {
    .cmd = "bench dev",
    .usage = "usage: moeflow bench dev [--devices SPEC] [--rows N] [--cols M] [--tokens T] [--reps R]\n"
             "                         [--big-mib M] [--rotate-mib W] [--warm-ms MS] [--min-ms MS]\n"
             "                         [--linears-only]\n\n"
             "On card 0 of SPEC: the FP4 matmul (fp32 and int8 paths) of an N x M expert matrix and\n"
             "the int8 expert FFN (w1, w3: N x M, w2: M x N) against d2d copies of their bytes; the\n"
             "dense FP8 (N/2 x M) and BF16 (N/4 x M) linears of the same bytes, the FP8 one also\n"
             "on each path forced (warp-per-row, tiled, cuBLASLt on its weights dequantized before,\n"
             "the dequantization timed on its own: their ratios at T tokens) and the expert FFN on\n"
             "cuBLASLt (where the card has tensor cores); pinned\n"
             "h2d of one matrix against one copy of --big-mib MiB. The weights rotate over copies\n"
             "totalling W MiB; each op is warmed up for --warm-ms, then timed with device events\n"
             "over at least --min-ms of work and at least R ops. One line per measurement, then a\n"
             "JSON summary.\n\n",
    .opts = mf_bdv_table,
    .col = 19,
};

/* A run of bench dev: the card's buffers, the timing settings, and each op's time and count. */
typedef struct mf_bdv {
    const mf_bdv_cli *a;
    mf_dev *d;
    int n_sets;
    uint8_t **set;
    size_t wb, sb, xb, yb;
    uint64_t big;
    void *x, *y, *hw, *dbig, *hbig, *q8, *h, *yf;
    mf_bench_dev_timing tm;
    mf_dev_stream *cs, *in;
    mf_bench_dev_args args;
    /* the ops' times (ns, -1 not measured) and how many were timed */
    int64_t t_mm, t_d2d, t_h2d, t_big, t_q8, t_ffn, t_f8, t_b16, t_f8r, t_f8t, t_f8l, t_dq, t_fl, t_dqf;
    int64_t n_mm, n_d2d, n_h2d, n_big, n_q8, n_ffn, n_f8, n_b16, n_f8r, n_f8t, n_f8l, n_dq, n_fl, n_dqf;
    void *ltmem;   /* the cuBLASLt path's buffers, one allocation */
} mf_bdv;

/* The cuBLASLt path's buffers where card 0 has tensor cores (mf_dev_card_f16): four 16-bit copies of
 * the FP8 linear's weights, the expert's w13 and w2, gu, the cast of the widest input, the
 * workspace; the copies dequantized once here (the GEMMs' timing leaves them out). */
static int mf_bdv_open_lt(mf_bdv *b)
{
    mf_bench_dev_args *a = &b->args;
    int n_out = a->w.n_out, n_in = a->w.n_in, n_tok = a->n_tok;
    a->tc = mf_dev_card_f16(b->d, 0);
    if (a->tc == MF_DEV_F16_NONE) return 0;
    size_t w16b = (size_t)(n_out / 2) * n_in * 2, e13 = (size_t)2 * n_out * n_in * 2, e2 = (size_t)n_in * n_out * 2;
    size_t gub = (size_t)n_tok * 2 * n_out * 4, x16 = mf_dev_lt_x16_bytes(n_tok, n_in > n_out ? n_in : n_out);
    size_t al = 256, off[7], total = 0, sz[7] = {4 * w16b, e13, e2, gub, x16, MF_DEV_LT_WS_BYTES, 0};
    for (int k = 0; k < 6; k++) {
        off[k] = total;
        total += (sz[k] + al - 1) / al * al;
    }
    int rc = mf_dev_alloc(b->d, 0, total, &b->ltmem);
    if (rc) return rc;
    uint8_t *m = b->ltmem;
    for (int k = 0; k < 4; k++)
        a->w16[k] = (mf_dev_w16){m + off[0] + (size_t)k * w16b, a->tc, 0, n_out / 2, n_in};
    a->w13 = (mf_dev_w16){m + off[1], a->tc, 0, 2 * n_out, n_in};
    a->w2 = (mf_dev_w16){m + off[2], a->tc, 0, n_in, n_out};
    a->gu = (float *)(void *)(m + off[3]);
    a->lt = (mf_dev_lt_buf){m + off[4], x16, m + off[5], MF_DEV_LT_WS_BYTES};
    /* the sets' scales are all 1 (E8M0 127): shift 0 is exact in either type */
    for (int k = 0; k < 4 && !rc && n_out % 64 == 0; k++) rc = mf_bench_dev_dequant(b->cs, a, k);
    if (!rc) rc = mf_bench_dev_dequant_ffn(b->cs, a, 0);
    return rc ? rc : mf_dev_stream_sync(b->cs);
}

/* Opens the device and fills card 0: the rotating weight sets (random codes, scales 1), the
 * activations, the FFN's scratch, pinned host copies. 0 or a negative code. */
static int mf_bdv_open(mf_bdv *b)
{
    const mf_bdv_cli *a = b->a;
    int n_out = (int)a->n_out, n_in = (int)a->n_in, n_tok = (int)a->n_tok;
    int rc = mf_dev_open(a->spec, &b->d);
    if (rc) return rc;
    mf_dev *d = b->d;
    size_t wb = b->wb = (size_t)n_out * n_in / 2, sb = b->sb = (size_t)n_out * n_in / 32;
    size_t xb = b->xb = (size_t)n_tok * n_in * 4;
    b->yb = (size_t)n_tok * n_out * 4;
    uint64_t rot = (uint64_t)a->rot_mib << 20;
    b->n_sets = (int)((rot + wb + sb - 1) / (wb + sb));
    if (b->n_sets < 4) b->n_sets = 4;   /* the FFN's three matrices, and a d2d target apart from its source */
    b->set = calloc((size_t)b->n_sets, sizeof *b->set);
    size_t q8b = mf_dev_ffn_q8_bytes(n_tok, n_in, n_out);
    rc = b->set ? 0 : mf_error(-ENOMEM, "bench dev: out of host memory");
    for (int k = 0; k < b->n_sets && !rc; k++) rc = mf_dev_alloc(d, 0, wb + sb, (void **)&b->set[k]);
    if (!rc) rc = mf_dev_alloc(d, 0, q8b, &b->q8);
    if (!rc) rc = mf_dev_alloc(d, 0, (size_t)n_tok * n_out * 4, &b->h);
    if (!rc) rc = mf_dev_alloc(d, 0, xb, &b->yf);
    if (!rc) rc = mf_dev_alloc(d, 0, xb, &b->x);
    if (!rc) rc = mf_dev_alloc(d, 0, b->yb, &b->y);
    if (!rc) rc = mf_dev_host_alloc(d, 0, wb + sb + xb, &b->hw);
    if (!rc) rc = mf_dev_event_create_timed(d, 0, &b->tm.t0);
    if (!rc) rc = mf_dev_event_create_timed(d, 0, &b->tm.t1);
    b->cs = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COMPUTE);
    b->in = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COPY_IN);
    if (rc) return rc;
    uint8_t *hb = b->hw;
    for (size_t i = 0; i < wb; i++) hb[i] = (uint8_t)(i * 2654435761u >> 13);
    memset(hb + wb, 127, sb);   /* E8M0 scale 1 */
    for (size_t i = 0; i < xb / 4; i++) ((float *)(hb + wb + sb))[i] = (float)((int)(i % 17) - 8) / 8;
    for (int k = 0; k < b->n_sets && !rc; k++) rc = mf_dev_copy_h2d(b->in, b->set[k], hb, wb + sb);
    if (!rc) rc = mf_dev_copy_h2d(b->in, b->x, hb + wb + sb, xb);
    if (!rc) rc = mf_dev_stream_sync(b->in);
    b->args = (mf_bench_dev_args){.w = {.fmt = MF_KERN_FP4, .n_out = n_out, .n_in = n_in}, .x = b->x, .y = b->y,
                                  .n_tok = n_tok, .card = 0, .q8 = b->q8, .set = b->set, .n_sets = b->n_sets,
                                  .wb = wb, .sb = sb, .host = b->hw};
    b->args.ffn = (mf_dev_ffn){.x = b->x, .n_tok = n_tok, .limit = 7.0f, .h = b->h, .q8_scratch = b->q8, .y = b->yf};
    return rc ? rc : mf_bdv_open_lt(b);
}

/* Times op on stream s into *t (ns per op) and *n (ops timed); 0 or a negative code. */
static int mf_bdv_time(mf_bdv *b, mf_dev_stream *s, mf_bench_dev_op op, int64_t *t, int64_t *n)
{
    *t = mf_bench_dev_time(s, op, &b->args, &b->tm, n);
    return *t < 0 ? (int)*t : 0;
}

/* The largest single copy: halve until the card and the host grant it. */
static int mf_bdv_big(mf_bdv *b)
{
    for (; b->big >= (1u << 20); b->big /= 2) {
        if (mf_dev_alloc(b->d, 0, b->big, &b->dbig)) continue;
        if (mf_dev_host_alloc(b->d, 0, b->big, &b->hbig)) {
            mf_dev_free(b->d, 0, b->dbig);
            b->dbig = NULL;
            continue;
        }
        memset(b->hbig, 1, b->big);
        mf_bench_dev_args ab = b->args;
        uint8_t *one[1] = {b->dbig};
        ab.set = one;
        ab.n_sets = 1;
        ab.wb = b->big;
        ab.sb = 0;
        ab.host = b->hbig;
        mf_bench_dev_timing tb = b->tm;
        tb.min_reps = 3;
        b->t_big = mf_bench_dev_time(b->in, mf_bench_dev_h2d, &ab, &tb, &b->n_big);
        return b->t_big < 0 ? (int)b->t_big : 0;
    }
    return 0;
}

/* Every op in turn: matmuls, FFN, the dense linears (where the shape allows), the copies. */
static int mf_bdv_measure(mf_bdv *b)
{
    int fp8 = b->a->n_out % 64 == 0, lt = b->args.tc != MF_DEV_F16_NONE, rc;
    if ((fp8 && (rc = mf_bdv_time(b, b->cs, mf_bench_dev_fp8_lin_rows, &b->t_f8r, &b->n_f8r))) ||
        (fp8 && (rc = mf_bdv_time(b, b->cs, mf_bench_dev_fp8_lin_tiled, &b->t_f8t, &b->n_f8t))) ||
        (fp8 && lt && (rc = mf_bdv_time(b, b->cs, mf_bench_dev_fp8_lin_lt, &b->t_f8l, &b->n_f8l))) ||
        (fp8 && lt && (rc = mf_bdv_time(b, b->cs, mf_bench_dev_dequant, &b->t_dq, &b->n_dq))))
        return rc;
    if (b->a->linears) return 0;
    if ((lt && (rc = mf_bdv_time(b, b->cs, mf_bench_dev_ffn_lt, &b->t_fl, &b->n_fl))) ||
        (lt && (rc = mf_bdv_time(b, b->cs, mf_bench_dev_dequant_ffn, &b->t_dqf, &b->n_dqf))) ||
        (rc = mf_bdv_time(b, b->cs, mf_bench_dev_matmul, &b->t_mm, &b->n_mm)) ||
        (rc = mf_bdv_time(b, b->cs, mf_bench_dev_matmul_q8, &b->t_q8, &b->n_q8)) ||
        (rc = mf_bdv_time(b, b->cs, mf_bench_dev_ffn, &b->t_ffn, &b->n_ffn)) ||
        (fp8 && (rc = mf_bdv_time(b, b->cs, mf_bench_dev_fp8_lin, &b->t_f8, &b->n_f8))) ||
        (b->a->n_out >= 4 && (rc = mf_bdv_time(b, b->cs, mf_bench_dev_bf16_lin, &b->t_b16, &b->n_b16))) ||
        (rc = mf_bdv_time(b, b->cs, mf_bench_dev_d2d, &b->t_d2d, &b->n_d2d)) ||
        (rc = mf_bdv_time(b, b->in, mf_bench_dev_h2d, &b->t_h2d, &b->n_h2d)))
        return rc;
    return mf_bdv_big(b);
}

/* The FP8 linear's three paths: one line (the weights' MACs a token over each path's time). */
static void mf_bdv_report_paths(const mf_bdv *b, int n_tok)
{
    double macs = (double)(b->a->n_out / 2) * b->a->n_in * n_tok;   /* a weight a token */
    if (b->t_f8r <= 0 || b->t_f8t <= 0) return;
    printf("FP8 dense linear %ld x %ld, %d token(s): warp-per-row kernel %.2f us (%.1f G multiply-adds/s), tiled "
           "kernel %.2f us (%.1f G/s); tiled / rows = %.2f (AUTO takes the tiled one from %d tokens)\n", b->a->n_out / 2,
           b->a->n_in, n_tok, b->t_f8r / 1e3, macs / b->t_f8r, b->t_f8t / 1e3, macs / b->t_f8t,
           (double)b->t_f8t / (double)b->t_f8r, MF_DEV_LIN_TILED_MIN_TOK);
    if (b->t_f8l > 0 && b->t_dq > 0)
        printf("FP8 dense linear on cuBLASLt (%s weights dequantized before), %d token(s): %.2f us (%.1f G "
               "multiply-adds/s); the dequantization %.2f us a matrix; cuBLASLt / tiled = %.3f, (cuBLASLt + "
               "dequantization) / tiled = %.3f, tiled / cuBLASLt = %.2f\n", b->args.tc == MF_DEV_F16_FP16 ? "fp16" : "bf16",
               n_tok, b->t_f8l / 1e3, macs / b->t_f8l, b->t_dq / 1e3, (double)b->t_f8l / (double)b->t_f8t,
               (double)(b->t_f8l + b->t_dq) / (double)b->t_f8t, (double)b->t_f8t / (double)b->t_f8l);
    else
        printf("FP8 dense linear on cuBLASLt: not measured (card 0 has no tensor cores for it)\n");
}

/* One line per measurement, then the JSON summary. */
static void mf_bdv_report(const mf_bdv *b)
{
    const mf_bdv_cli *a = b->a;
    int n_out = (int)a->n_out, n_in = (int)a->n_in, n_tok = (int)a->n_tok;
    size_t wb = b->wb, sb = b->sb;
    double wgb = (wb + sb) / 1e9;
    printf("device %s (%s), card 0: weights rotating over %d copies of %.1f MB (%.0f MB); each op "
           "warmed up %.0f ms, then timed by device events over >= %.0f ms\n", a->spec, mf_dev_kind(b->d),
           b->n_sets, (wb + sb) / 1e6, b->n_sets * (wb + sb) / 1e6, a->warm_ms, a->min_ms);
    mf_bdv_report_paths(b, n_tok);
    if (!a->linears) {
        printf("FP4 matmul %d x %d, %d token(s), fp32 path: %.2f us (%.1f GB/s of weights; %" PRId64 " ops timed)\n",
               n_out, n_in, n_tok, b->t_mm / 1e3, wgb / (b->t_mm / 1e9), b->n_mm);
        printf("FP4 matmul, int8 path: %.2f us (%.1f GB/s of weights; %" PRId64 " ops)\n", b->t_q8 / 1e3,
               wgb / (b->t_q8 / 1e9), b->n_q8);
        printf("d2d copy of the %zu weight bytes: %.2f us (%.1f GB/s read; %" PRId64 " ops); matmul / copy = "
               "%.2f (fp32), %.2f (int8)\n", wb, b->t_d2d / 1e3, wb / 1e9 / (b->t_d2d / 1e9), b->n_d2d,
               (double)b->t_mm / (double)b->t_d2d, (double)b->t_q8 / (double)b->t_d2d);
    }
    if (b->t_f8 > 0)
        printf("FP8 dense linear %d x %d (the same %zu bytes, 32x32 tile scales): %.2f us (%.1f GB/s; %" PRId64
               " ops); linear / copy = %.2f\n", n_out / 2, n_in, wb, b->t_f8 / 1e3, wb / 1e9 / (b->t_f8 / 1e9), b->n_f8,
               (double)b->t_f8 / (double)b->t_d2d);
    if (b->t_b16 > 0)
        printf("BF16 dense linear %d x %d (the same %zu bytes): %.2f us (%.1f GB/s; %" PRId64
               " ops); linear / copy = %.2f\n", n_out / 4, n_in, wb, b->t_b16 / 1e3, wb / 1e9 / (b->t_b16 / 1e9),
               b->n_b16, (double)b->t_b16 / (double)b->t_d2d);
    if (!a->linears) {
        printf("expert FFN, int8 path (w1, w3, w2: 3 x %zu bytes): %.2f us (%.1f GB/s of weights; %" PRId64
               " ops); FFN / (3 x copy) = %.2f\n", wb + sb, b->t_ffn / 1e3, 3 * wgb / (b->t_ffn / 1e9), b->n_ffn,
               (double)b->t_ffn / (3.0 * (double)b->t_d2d));
        if (b->t_fl > 0)
            printf("expert FFN on cuBLASLt (w1, w3, w2 dequantized before): %.2f us (%.1f G multiply-adds/s); their "
                   "dequantization %.2f us; cuBLASLt / int8 = %.3f, (cuBLASLt + dequantization) / int8 = %.3f\n",
                   b->t_fl / 1e3, 3.0 * n_out * n_in * n_tok / b->t_fl, b->t_dqf / 1e3,
                   (double)b->t_fl / (double)b->t_ffn, (double)(b->t_fl + b->t_dqf) / (double)b->t_ffn);
        printf("pinned h2d of the expert matrix (%zu bytes): %.2f us (%.1f GB/s; %" PRId64 " ops)\n", wb + sb,
               b->t_h2d / 1e3, wgb / (b->t_h2d / 1e9), b->n_h2d);
    }
    if (b->t_big > 0)
        printf("pinned h2d of one %" PRIu64 " MiB copy: %.1f us (%.1f GB/s; %" PRId64 " ops)\n", b->big >> 20,
               b->t_big / 1e3, b->big / 1e9 / (b->t_big / 1e9), b->n_big);
    printf("{\"device\": \"%s\", \"rows\": %d, \"cols\": %d, \"tokens\": %d, \"rotate_sets\": %d, "
           "\"matmul_ns\": %" PRId64 ", \"matmul_int8_ns\": %" PRId64 ", \"ffn_int8_ns\": %" PRId64
           ", \"d2d_ns\": %" PRId64 ", \"weight_bytes\": %zu, \"h2d_expert_ns\": %" PRId64
           ", \"h2d_big_bytes\": %" PRIu64 ", \"h2d_big_ns\": %" PRId64 ", \"fp8_linear_ns\": %" PRId64
           ", \"bf16_linear_ns\": %" PRId64 ", \"fp8_linear_rows_ns\": %" PRId64
           ", \"fp8_linear_tiled_ns\": %" PRId64 ", \"tc\": \"%s\", \"fp8_linear_cublaslt_ns\": %" PRId64
           ", \"fp8_dequant_ns\": %" PRId64 ", \"ffn_cublaslt_ns\": %" PRId64 ", \"ffn_dequant_ns\": %" PRId64 "}\n",
           a->spec, n_out, n_in, n_tok, b->n_sets, b->t_mm, b->t_q8, b->t_ffn, b->t_d2d, wb + sb, b->t_h2d,
           b->t_big > 0 ? b->big : 0, b->t_big, b->t_f8, b->t_b16, b->t_f8r, b->t_f8t,
           b->args.tc == MF_DEV_F16_BF16 ? "bf16" : b->args.tc == MF_DEV_F16_FP16 ? "fp16" : "none", b->t_f8l, b->t_dq,
           b->t_fl, b->t_dqf);
}

static void mf_bdv_close(mf_bdv *b)
{
    mf_dev *d = b->d;
    if (!d) return;
    mf_dev_event_destroy(b->tm.t0);
    mf_dev_event_destroy(b->tm.t1);
    for (int k = 0; b->set && k < b->n_sets; k++) mf_dev_free(d, 0, b->set[k]);
    free(b->set);
    mf_dev_free(d, 0, b->x);
    mf_dev_free(d, 0, b->y);
    mf_dev_free(d, 0, b->q8);
    mf_dev_free(d, 0, b->h);
    mf_dev_free(d, 0, b->yf);
    mf_dev_free(d, 0, b->dbig);
    mf_dev_free(d, 0, b->ltmem);
    mf_dev_host_free(d, b->hw);
    mf_dev_host_free(d, b->hbig);
    mf_dev_close(d);
}

int mf_bench_dev(int argc, char **argv)
{
    mf_bdv_cli a = {0};
    int rc = mf_opts_parse(&mf_bdv_spec, argc, argv, &a);
    if (rc != MF_OPTS_RUN) return rc;
    if (a.n_out % 32 || a.n_in % 32) {
        fprintf(stderr, "moeflow bench dev: --rows and --cols: multiples of 32, found %ld x %ld\n", a.n_out, a.n_in);
        return 2;
    }
    mf_bdv b = {.a = &a, .big = (uint64_t)a.big_mib << 20,
                .tm = {.warm_ns = (int64_t)(a.warm_ms * 1e6), .min_ns = (int64_t)(a.min_ms * 1e6), .min_reps = (int)a.reps},
                .t_mm = -1, .t_d2d = -1, .t_h2d = -1, .t_big = -1, .t_q8 = -1, .t_ffn = -1, .t_f8 = -1, .t_b16 = -1,
                .t_f8r = -1, .t_f8t = -1, .t_f8l = -1, .t_dq = -1, .t_fl = -1, .t_dqf = -1};
    rc = mf_bdv_open(&b);
    if (!b.d) {
        fprintf(stderr, "moeflow bench dev: %s\n", mf_last_error());
        return 1;
    }
    if (!rc) rc = mf_bdv_measure(&b);
    if (rc) fprintf(stderr, "moeflow bench dev: %s\n", mf_last_error());
    else mf_bdv_report(&b);
    mf_bdv_close(&b);
    return rc ? 1 : 0;
}
