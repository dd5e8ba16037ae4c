/* Checks every device backend must pass, shared by test_dev (emulated cards) and test_dev_cuda
 * (real cards, skipped without one): memory, copies both ways and between cards, stream order,
 * events across streams and cards, callbacks, and the scheduler adapter on copy tasks. */
#ifndef MF_TEST_DEV_COMMON_H
#define MF_TEST_DEV_COMMON_H

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "device/dense_host.h"
#include "device/dev.h"
#include "device/lt_host.h"
#include "graphs/layers/layers.h"
#include "graphs/model/model.h"
#include "host/formats.h"
#include "sched/error.h"
#include "sched/sched.h"
#include "tests/check.h"

static uint64_t dv_rng = 0x9e3779b97f4a7c15ULL;
static uint32_t dv_rnd(void)
{
    dv_rng = dv_rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(dv_rng >> 33);
}

static void dv_fill(uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(dv_rnd() >> 11);
}

static void dv_sleep_cb(void *arg)
{
    struct timespec ts = {0, (long)(intptr_t)arg};
    nanosleep(&ts, NULL);
}

/* Host -> card c -> card c+1 (d2d, a peer copy when there are two) -> host: bytes survive. */
static void dev_check_copies(mf_dev *d, size_t n)
{
    int nc = mf_dev_n_cards(d);
    uint8_t *src, *dst;
    CHECK(mf_dev_host_alloc(d, 0, n, (void **)&src) == 0, "host_alloc: %s", mf_last_error());
    CHECK(mf_dev_host_alloc(d, 0, n, (void **)&dst) == 0, "host_alloc: %s", mf_last_error());
    if (!src || !dst) return;
    for (int c = 0; c < nc; c++) {
        int c2 = (c + 1) % nc;
        void *a = NULL, *b = NULL;
        CHECK(mf_dev_alloc(d, c, n, &a) == 0, "alloc card %d: %s", c, mf_last_error());
        CHECK(mf_dev_alloc(d, c2, n, &b) == 0, "alloc card %d: %s", c2, mf_last_error());
        if (!a || !b) return;
        dv_fill(src, n);
        memset(dst, 0, n);
        mf_dev_stream *s = mf_dev_stream_of(d, c, MF_DEV_STREAM_COPY_IN);
        CHECK(mf_dev_copy_h2d(s, a, src, n) == 0, "h2d: %s", mf_last_error());
        CHECK(mf_dev_copy_d2d(s, c2, b, c, a, n) == 0, "d2d: %s", mf_last_error());
        CHECK(mf_dev_copy_d2h(s, dst, b, n) == 0, "d2h: %s", mf_last_error());
        CHECK(mf_dev_stream_sync(s) == 0, "sync: %s", mf_last_error());
        CHECK(memcmp(src, dst, n) == 0, "card %d -> %d: bytes differ after the round trip", c, c2);
        mf_dev_free(d, c, a);
        mf_dev_free(d, c2, b);
    }
    mf_dev_host_free(d, src);
    mf_dev_host_free(d, dst);
}

/* 2D copies (mf_dev_copy_h2d_2d, mf_dev_copy_d2h_2d) on every card: rows of `width` bytes out of
 * a host block of pitch sp into a card block of pitch dp, back into a host block of pitch bp: each
 * row's bytes arrive, the bytes between rows are left alone; pitches below the width are refused. */
static void dev_check_copies_2d(mf_dev *d)
{
    enum { W = 1000, SP = 1536, DP = 1024, BP = 2048, ROWS = 37 };
    uint8_t *src, *back;
    CHECK(mf_dev_host_alloc(d, 0, (size_t)SP * ROWS, (void **)&src) == 0, "host_alloc: %s", mf_last_error());
    CHECK(mf_dev_host_alloc(d, 0, (size_t)BP * ROWS, (void **)&back) == 0, "host_alloc: %s", mf_last_error());
    if (!src || !back) return;
    for (int c = 0; c < mf_dev_n_cards(d); c++) {
        uint8_t *a = NULL;
        CHECK(mf_dev_alloc(d, c, (size_t)DP * ROWS, (void **)&a) == 0, "alloc card %d: %s", c, mf_last_error());
        if (!a) return;
        dv_fill(src, (size_t)SP * ROWS);
        memset(back, 0xa5, (size_t)BP * ROWS);
        mf_dev_stream *in = mf_dev_stream_of(d, c, MF_DEV_STREAM_COPY_IN);
        mf_dev_stream *out = mf_dev_stream_of(d, c, MF_DEV_STREAM_COPY_OUT);
        CHECK(mf_dev_copy_h2d_2d(in, a, DP, src, SP, W, ROWS) == 0 && mf_dev_stream_sync(in) == 0, "h2d 2d: %s",
              mf_last_error());
        CHECK(mf_dev_copy_d2h_2d(out, back, BP, a, DP, W, ROWS) == 0 && mf_dev_stream_sync(out) == 0, "d2h 2d: %s",
              mf_last_error());
        int bad = 0, gap = 0;
        for (int r = 0; r < ROWS; r++) {
            bad += memcmp(back + (size_t)r * BP, src + (size_t)r * SP, W) != 0;
            for (int k = W; k < BP; k++) gap += back[(size_t)r * BP + k] != 0xa5;
        }
        CHECK(bad == 0 && gap == 0, "card %d: 2D round trip: %d rows differ, %d bytes between rows written", c, bad, gap);
        CHECK(mf_dev_copy_h2d_2d(in, a, W - 1, src, SP, W, ROWS) == -EINVAL, "card %d: a pitch below the width taken",
              c);
        mf_dev_free(d, c, a);
    }
    mf_dev_host_free(d, src);
    mf_dev_host_free(d, back);
}

/* Timed events: the time between records around a copy is positive and returned once the end is
 * reached; an untimed event, a never-recorded one and events of two cards are refused. Returns the
 * measured copy time (ns), or -1. */
static int64_t dev_check_event_timing(mf_dev *d, size_t n)
{
    mf_dev_event *t0 = NULL, *t1 = NULL, *plain = NULL, *other = NULL;
    void *src = NULL, *dst = NULL;
    int64_t ns = -1;
    CHECK(mf_dev_event_create_timed(d, 0, &t0) == 0 && mf_dev_event_create_timed(d, 0, &t1) == 0 &&
          mf_dev_event_create(d, 0, &plain) == 0, "%s", mf_last_error());
    CHECK(mf_dev_host_alloc(d, 0, n, &src) == 0 && mf_dev_alloc(d, 0, n, &dst) == 0, "%s", mf_last_error());
    if (t0 && t1 && plain && src && dst) {
        int64_t x = 0;
        CHECK(mf_dev_event_elapsed_ns(t0, t1, &x) == -EINVAL, "never recorded: accepted");
        mf_dev_stream *s = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COPY_IN);
        memset(src, 3, n);
        CHECK(mf_dev_event_record(t0, s) == 0 && mf_dev_copy_h2d(s, dst, src, n) == 0 &&
              mf_dev_event_record(t1, s) == 0 && mf_dev_event_record(plain, s) == 0, "%s", mf_last_error());
        int rc = mf_dev_event_elapsed_ns(t0, t1, &ns);
        CHECK(rc == 0 && ns > 0, "elapsed around a %zu-byte copy: rc %d, %lld ns: %s", n, rc, (long long)ns,
              mf_last_error());
        CHECK(mf_dev_event_elapsed_ns(t0, plain, &x) == -EINVAL && strstr(mf_last_error(), "end event"),
              "an untimed event accepted: %s", mf_last_error());
        if (mf_dev_n_cards(d) > 1 && mf_dev_event_create_timed(d, 1, &other) == 0)
            CHECK(mf_dev_event_elapsed_ns(t0, other, &x) == -EINVAL, "events of two cards accepted");
        CHECK(mf_dev_stream_sync(s) == 0, "%s", mf_last_error());
    }
    mf_dev_event_destroy(t0);
    mf_dev_event_destroy(t1);
    mf_dev_event_destroy(plain);
    mf_dev_event_destroy(other);
    mf_dev_free(d, 0, dst);
    mf_dev_host_free(d, src);
    return ns;
}

typedef struct dv_order {
    int seen[512];
    int n;
} dv_order;
typedef struct dv_order_arg {
    dv_order *o;
    int i;
} dv_order_arg;

static void dv_order_cb(void *arg)
{
    dv_order_arg *a = arg;
    a->o->seen[a->o->n++] = a->i;
}

/* Callbacks run, once each, in the order enqueued on every stream of every card. */
static void dev_check_order(mf_dev *d)
{
    static dv_order o;
    static dv_order_arg args[512];
    for (int c = 0; c < mf_dev_n_cards(d); c++)
        for (int k = 0; k < MF_DEV_N_STREAMS; k++) {
            mf_dev_stream *s = mf_dev_stream_of(d, c, (mf_dev_stream_kind)k);
            CHECK(s && mf_dev_stream_card(s) == c, "stream of card %d kind %d", c, k);
            memset(&o, 0, sizeof o);
            for (int i = 0; i < 512; i++) {
                args[i] = (dv_order_arg){&o, i};
                CHECK(mf_dev_stream_callback(s, dv_order_cb, &args[i]) == 0, "callback: %s",
                      mf_last_error());
            }
            CHECK(mf_dev_stream_sync(s) == 0, "sync: %s", mf_last_error());
            int ok = o.n == 512;
            for (int i = 0; ok && i < 512; i++) ok = o.seen[i] == i;
            CHECK(ok, "card %d stream %d: %d callbacks ran, out of order or missing", c, k, o.n);
        }
}

/* A copy-out stream waits on an event recorded on a compute stream (of the same card, and of the
 * previous card): the compute stream is held 30 ms by a callback before its d2d copy fills the
 * buffer the copy-out reads, so without the wait the copy-out would read zeros. */
static void dev_check_events(mf_dev *d, size_t n)
{
    int nc = mf_dev_n_cards(d);
    uint8_t *pat, *zero, *out;
    CHECK(mf_dev_host_alloc(d, 0, n, (void **)&pat) == 0, "%s", mf_last_error());
    CHECK(mf_dev_host_alloc(d, 0, n, (void **)&zero) == 0, "%s", mf_last_error());
    CHECK(mf_dev_host_alloc(d, 0, n, (void **)&out) == 0, "%s", mf_last_error());
    if (!pat || !zero || !out) return;
    memset(zero, 0, n);
    for (int c = 0; c < nc; c++) {
        int w = (c + 1) % nc;   /* the card whose copy-out waits */
        void *a = NULL, *b = NULL;
        mf_dev_event *e = NULL;
        CHECK(mf_dev_alloc(d, c, n, &a) == 0 && mf_dev_alloc(d, w, n, &b) == 0, "alloc: %s",
              mf_last_error());
        CHECK(mf_dev_event_create(d, c, &e) == 0, "event: %s", mf_last_error());
        if (!a || !b || !e) return;
        dv_fill(pat, n);
        mf_dev_stream *cin = mf_dev_stream_of(d, c, MF_DEV_STREAM_COPY_IN);
        mf_dev_stream *comp = mf_dev_stream_of(d, c, MF_DEV_STREAM_COMPUTE);
        mf_dev_stream *cout = mf_dev_stream_of(d, w, MF_DEV_STREAM_COPY_OUT);
        CHECK(mf_dev_copy_h2d(cin, a, pat, n) == 0 && mf_dev_copy_h2d(cin, b, zero, n) == 0 &&
              mf_dev_stream_sync(cin) == 0, "setup: %s", mf_last_error());
        CHECK(mf_dev_stream_callback(comp, dv_sleep_cb, (void *)(intptr_t)30000000) == 0, "%s",
              mf_last_error());
        CHECK(mf_dev_copy_d2d(comp, w, b, c, a, n) == 0, "%s", mf_last_error());
        CHECK(mf_dev_event_record(e, comp) == 0, "record: %s", mf_last_error());
        if (nc > 1)
            CHECK(mf_dev_event_record(e, cout) == -EINVAL, "recording card %d's event on card %d "
                  "must be refused", c, w);
        CHECK(mf_dev_stream_wait(cout, e) == 0, "wait: %s", mf_last_error());
        CHECK(mf_dev_copy_d2h(cout, out, b, n) == 0, "d2h: %s", mf_last_error());
        CHECK(mf_dev_stream_sync(cout) == 0, "sync: %s", mf_last_error());
        CHECK(memcmp(out, pat, n) == 0, "card %d copy-out did not wait for card %d's compute", w, c);
        CHECK(mf_dev_sync(d) == 0, "%s", mf_last_error());
        mf_dev_event_destroy(e);
        mf_dev_free(d, c, a);
        mf_dev_free(d, w, b);
    }
    mf_dev_host_free(d, pat);
    mf_dev_host_free(d, zero);
    mf_dev_host_free(d, out);
}

static void dv_count_cb(void *arg) { ++*(int *)arg; }

/* A graph captured on a copy-in stream (h2d, d2d, d2h, a callback) runs nothing until launched,
 * then replays with whatever the source holds at each launch; events and sync are refused while
 * capturing, and a graph launches only on its own card. */
static void dev_check_capture(mf_dev *d, size_t n)
{
    for (int c = 0; c < mf_dev_n_cards(d); c++) {
        mf_dev_stream *s = mf_dev_stream_of(d, c, MF_DEV_STREAM_COPY_IN);
        uint8_t *src = NULL, *dst = NULL;
        void *a = NULL, *b = NULL;
        mf_dev_event *e = NULL;
        CHECK(mf_dev_host_alloc(d, c, n, (void **)&src) == 0 &&
              mf_dev_host_alloc(d, c, n, (void **)&dst) == 0 && mf_dev_alloc(d, c, n, &a) == 0 &&
              mf_dev_alloc(d, c, n, &b) == 0 && mf_dev_event_create(d, c, &e) == 0, "%s",
              mf_last_error());
        if (!src || !dst || !a || !b || !e) return;
        int count = 0;
        memset(dst, 0, n);
        dv_fill(src, n);
        mf_dev_graph *g = NULL;
        CHECK(mf_dev_capture_begin(s) == 0, "capture_begin: %s", mf_last_error());
        CHECK(mf_dev_capture_begin(s) == -EBUSY, "capturing twice");
        CHECK(mf_dev_copy_h2d(s, a, src, n) == 0 && mf_dev_copy_d2d(s, c, b, c, a, n) == 0 &&
              mf_dev_copy_d2h(s, dst, b, n) == 0 && mf_dev_stream_callback(s, dv_count_cb, &count) == 0,
              "capturing: %s", mf_last_error());
        CHECK(mf_dev_event_record(e, s) == -EBUSY, "event recorded while capturing");
        CHECK(mf_dev_stream_sync(s) == -EBUSY, "sync while capturing");
        CHECK(mf_dev_capture_end(s, &g) == 0 && g, "capture_end: %s", mf_last_error());
        CHECK(mf_dev_stream_sync(s) == 0, "%s", mf_last_error());
        CHECK(count == 0 && dst[0] == 0 && !memcmp(dst, dst + 1, n - 1), "captured work ran");
        for (int i = 1; i <= 3; i++) {
            dv_fill(src, n);
            CHECK(mf_dev_graph_launch(g, s) == 0, "launch: %s", mf_last_error());
            CHECK(mf_dev_stream_sync(s) == 0, "%s", mf_last_error());
            CHECK(count == i && !memcmp(src, dst, n), "card %d launch %d: count %d, bytes %s", c, i,
                  count, memcmp(src, dst, n) ? "differ" : "equal");
        }
        if (mf_dev_n_cards(d) > 1)
            CHECK(mf_dev_graph_launch(g, mf_dev_stream_of(d, (c + 1) % mf_dev_n_cards(d),
                                                          MF_DEV_STREAM_COPY_IN)) == -EINVAL,
                  "a graph of card %d launched on another card", c);
        mf_dev_graph_destroy(g);
        mf_dev_event_destroy(e);
        mf_dev_free(d, c, a);
        mf_dev_free(d, c, b);
        mf_dev_host_free(d, src);
        mf_dev_host_free(d, dst);
    }
}

/* ---- kernel test data ---------------------------------------------------------------------- */

static float gauss(void)
{
    double u = (dv_rnd() + 1.0) / 4294967297.0, v = dv_rnd() / 4294967296.0;
    return (float)(sqrt(-2 * log(u)) * cos(2 * M_PI * v));
}

/* A random stored matrix in host memory: FP4 (codes random, scales 2^-3..2^3) or FP8 (no NaN codes). */
typedef struct hmat {
    mf_kern_mat m;
    uint8_t *w, *scale;
    size_t w_bytes, s_bytes;
} hmat;

static hmat hmat_rand(mf_kern_fmt fmt, int n_out, int n_in)
{
    hmat h = {.m = {.fmt = fmt, .n_out = n_out, .n_in = n_in}};
    h.w_bytes = fmt == MF_KERN_FP4 ? (size_t)n_out * n_in / 2 : (size_t)n_out * n_in;
    h.s_bytes = fmt == MF_KERN_FP4 ? (size_t)n_out * (n_in / 32) : (size_t)((n_out + 31) / 32) * (n_in / 32);
    h.w = malloc(h.w_bytes);
    h.scale = malloc(h.s_bytes);
    dv_fill(h.w, h.w_bytes);
    if (fmt == MF_KERN_FP8)
        for (size_t i = 0; i < h.w_bytes; i++)
            if ((h.w[i] & 0x7f) == 0x7f) h.w[i] ^= 1;
    for (size_t i = 0; i < h.s_bytes; i++) h.scale[i] = (uint8_t)(124 + dv_rnd() % 7);
    h.m.w = h.w;
    h.m.scale = h.scale;
    return h;
}

static void hmat_free(hmat *h)
{
    free(h->w);
    free(h->scale);
}

/* A copy of h's bytes on card c: the same matrix with device pointers. */
static mf_kern_mat dmat_upload(mf_dev *d, int c, const hmat *h, void **w, void **s)
{
    mf_dev_stream *st = mf_dev_stream_of(d, c, MF_DEV_STREAM_COPY_IN);
    CHECK(mf_dev_alloc(d, c, h->w_bytes, w) == 0 && mf_dev_alloc(d, c, h->s_bytes, s) == 0 &&
          mf_dev_copy_h2d(st, *w, h->w, h->w_bytes) == 0 &&
          mf_dev_copy_h2d(st, *s, h->scale, h->s_bytes) == 0 && mf_dev_stream_sync(st) == 0,
          "upload: %s", mf_last_error());
    mf_kern_mat m = h->m;
    m.w = *w;
    m.scale = *s;
    return m;
}

static void *dupload(mf_dev *d, int c, const void *p, size_t n)
{
    void *a = NULL;
    mf_dev_stream *st = mf_dev_stream_of(d, c, MF_DEV_STREAM_COPY_IN);
    CHECK(mf_dev_alloc(d, c, n, &a) == 0 && mf_dev_copy_h2d(st, a, p, n) == 0 &&
          mf_dev_stream_sync(st) == 0, "upload: %s", mf_last_error());
    return a;
}

static void ddownload(mf_dev *d, int c, void *dst, const void *src, size_t n)
{
    mf_dev_stream *st = mf_dev_stream_of(d, c, MF_DEV_STREAM_COPY_OUT);
    CHECK(mf_dev_copy_d2h(st, dst, src, n) == 0 && mf_dev_stream_sync(st) == 0, "download: %s",
          mf_last_error());
}

/* The host path of the FFN, as graphs/step/step_moe.c runs it (one worker: every row). */
static void host_ffn(const hmat *w1, const hmat *w3, const hmat *w2, const float *x, int T,
                     const float *tw, float lim, int int8, float *h, float *y)
{
    int H = w1->m.n_in, I = w1->m.n_out;
    size_t qb = mf_dev_ffn_q8_bytes(T, H, I);
    void *buf = malloc(qb);
    mf_kern_q8 q;
    int up8 = int8 && w1->m.fmt == MF_KERN_FP4, down8 = int8 && w2->m.fmt == MF_KERN_FP4;
    if (up8) {
        mf_kern_q8_init(&q, buf, qb, T, H);
        mf_kern_q8_quantize(&q, x, H, 0, T);
    }
    CHECK(mf_kern_ffn_up(&w1->m, &w3->m, &(mf_kern_in){x, T, H, up8 ? &q : NULL}, tw, lim, h, I,
                         0, I) == 0, "%s", mf_last_error());
    if (down8) {
        mf_kern_q8_init(&q, buf, qb, T, I);
        mf_kern_q8_quantize(&q, h, I, 0, T);
    }
    CHECK(mf_kern_ffn_down(&w2->m, &(mf_kern_in){h, T, I, down8 ? &q : NULL}, y, H, 0, H) == 0,
          "%s", mf_last_error());
    free(buf);
}

static void dv_status_noop(void *arg, int err, const char *msg)
{
    (void)arg;
    (void)err;
    (void)msg;
}

/* max |a - b| / max |b| in float64 */
static double dv_rel_err(const float *a, const float *b, size_t n)
{
    double md = 0, mb = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= md)) md = d;   /* NaN propagates */
        if (fabs(b[i]) > mb) mb = fabs(b[i]);
    }
    return mb > 0 ? md / mb : md;
}

/* The slot-table FFN in a captured graph (an h2d of the table from pinned memory, then
 * mf_dev_expert_ffn_table), replayed with three routings: other experts in other cache slots,
 * other token counts, an unused slot, rows out of slot order (the int8 scratch by rows, exactly
 * ROWS rows of it). Each used slot's rows against the host's int8 FFN of that
 * expert: bit for bit (exact, emulated cards) or within h 1e-4, y 1e-3 relative (CUDA, as the
 * single FFN). Emulated cards also report a slot with too many tokens at the next sync. */
static void dev_check_ffn_table(mf_dev *d, int exact)
{
    enum { E = 5, H = 256, I = 32 * 5, S = 3, MT = 4, ROWS = S * MT };
    const int route[3][S][3] = {   /* per slot: expert, row0, n_tok */
        {{4, 0, 2}, {0, 2, 1}, {2, 3, 4}},
        {{1, 4, 4}, {3, 0, 3}, {4, 3, 1}},   /* rows out of slot order: areas by rows, any order */
        {{2, 0, 0}, {2, 0, 3}, {0, 3, 4}}};
    for (int c = 0; c < mf_dev_n_cards(d); c++) {
        mf_dev_stream *cs = mf_dev_stream_of(d, c, MF_DEV_STREAM_COMPUTE);
        hmat w[E][3];
        uint64_t off[6], o = 0;
        for (int k = 0; k < 3; k++) {   /* w1 [I, H], w2 [H, I], w3 [I, H] as in a cache slot */
            size_t wb = (size_t)H * I / 2, sb = (size_t)H * I / 32;
            off[2 * k] = o;
            o += (wb + 255) / 256 * 256;
            off[2 * k + 1] = o;
            o += (sb + 255) / 256 * 256;
        }
        uint64_t slot_bytes = o;
        uint8_t *slab = NULL, *hslab = malloc(slot_bytes * E);
        for (int e = 0; e < E; e++)
            for (int k = 0; k < 3; k++) {
                w[e][k] = hmat_rand(MF_KERN_FP4, k == 1 ? H : I, k == 1 ? I : H);
                memcpy(hslab + e * slot_bytes + off[2 * k], w[e][k].w, w[e][k].w_bytes);
                memcpy(hslab + e * slot_bytes + off[2 * k + 1], w[e][k].scale, w[e][k].s_bytes);
            }
        slab = dupload(d, c, hslab, slot_bytes * E);
        float *x = malloc(sizeof(float) * ROWS * H), *tw = malloc(sizeof(float) * ROWS);
        for (int i = 0; i < ROWS * H; i++) x[i] = gauss();
        for (int i = 0; i < ROWS; i++) tw[i] = 0.1f + (dv_rnd() % 1000) / 1000.0f;
        void *dx = dupload(d, c, x, sizeof(float) * ROWS * H), *dtw = dupload(d, c, tw, sizeof(float) * ROWS);
        void *dh = NULL, *dy = NULL, *dq = NULL, *dtab = NULL;
        mf_dev_ffn_slot *htab = NULL;
        size_t qs = mf_dev_ffn_q8_bytes(1, H, I);   /* a row's int8 scratch: ROWS of them, no more */
        CHECK(mf_dev_alloc(d, c, sizeof(float) * ROWS * I, &dh) == 0 &&
              mf_dev_alloc(d, c, sizeof(float) * ROWS * H, &dy) == 0 && mf_dev_alloc(d, c, qs * ROWS, &dq) == 0 &&
              mf_dev_alloc(d, c, sizeof(mf_dev_ffn_slot) * S, &dtab) == 0 &&
              mf_dev_host_alloc(d, c, sizeof(mf_dev_ffn_slot) * S, (void **)&htab) == 0, "%s", mf_last_error());
        mf_dev_ffn_table a = {.n_in = H, .n_hidden = I, .table = dtab, .n_slots = S, .max_tok = MT, .x = dx,
                              .tok_weight = dtw, .limit = 7.0f, .h = dh, .q8_scratch = dq, .q8_row = qs, .y = dy};
        memcpy(a.part_off, off, sizeof off);
        mf_dev_graph *g = NULL;
        CHECK(mf_dev_capture_begin(cs) == 0 &&
              mf_dev_copy_h2d(cs, dtab, htab, sizeof(mf_dev_ffn_slot) * S) == 0 &&
              mf_dev_expert_ffn_table(cs, &a) == 0 && mf_dev_capture_end(cs, &g) == 0, "capture: %s",
              mf_last_error());
        float *y = malloc(sizeof(float) * ROWS * H), *yr = malloc(sizeof(float) * MT * H);
        float *hr = malloc(sizeof(float) * MT * I);
        for (int r = 0; r < 3 && g; r++) {
            for (int k = 0; k < S; k++)
                htab[k] = (mf_dev_ffn_slot){(uint64_t)(uintptr_t)(slab + route[r][k][0] * slot_bytes),
                                            route[r][k][1], route[r][k][2]};
            CHECK(mf_dev_graph_launch(g, cs) == 0 && mf_dev_stream_sync(cs) == 0, "launch %d: %s", r,
                  mf_last_error());
            ddownload(d, c, y, dy, sizeof(float) * ROWS * H);
            for (int k = 0; k < S; k++) {
                int e = route[r][k][0], r0 = route[r][k][1], n = route[r][k][2];
                if (!n) continue;
                host_ffn(&w[e][0], &w[e][2], &w[e][1], x + r0 * H, n, tw + r0, 7.0f, 1, hr, yr);
                if (exact) {
                    CHECK(!memcmp(yr, y + r0 * H, sizeof(float) * n * H),
                          "card %d routing %d slot %d (expert %d): differs from the host FFN", c, r, k, e);
                } else {
                    double err = dv_rel_err(y + r0 * H, yr, (size_t)n * H);
                    printf("card %d slot-table FFN routing %d slot %d: rel err %.3g\n", c, r, k, err);
                    CHECK(err < 1e-3, "card %d routing %d slot %d: rel err %g", c, r, k, err);
                }
            }
        }
        if (exact && g) {   /* a slot with more tokens than max_tok */
            htab[1].n_tok = MT + 1;
            CHECK(mf_dev_graph_launch(g, cs) == 0, "%s", mf_last_error());
            int rc = mf_dev_stream_sync(cs);
            CHECK(rc == -EINVAL && strstr(mf_last_error(), "slot 1 has 5 tokens"), "bad slot: %d %s", rc,
                  mf_last_error());
            mf_dev_ffn_table bad = a;
            bad.q8_row = qs - 1;
            CHECK(mf_dev_expert_ffn_table(cs, &bad) == -EINVAL, "a q8 scratch row too small accepted");
            CHECK(mf_dev_stream_callback_status(cs, dv_status_noop, NULL) == 0 && mf_dev_stream_sync(cs) == 0,
                  "the error, delivered, stays: %s", mf_last_error());
        }
        mf_dev_graph_destroy(g);
        for (int e = 0; e < E; e++)
            for (int k = 0; k < 3; k++) hmat_free(&w[e][k]);
        mf_dev_free(d, c, slab);
        mf_dev_free(d, c, dx);
        mf_dev_free(d, c, dtw);
        mf_dev_free(d, c, dh);
        mf_dev_free(d, c, dy);
        mf_dev_free(d, c, dq);
        mf_dev_free(d, c, dtab);
        mf_dev_host_free(d, htab);
        free(hslab);
        free(x);
        free(tw);
        free(y);
        free(yr);
        free(hr);
    }
}

/* ---- the scheduler adapter ------------------------------------------------------------------- */

/* Lanes for n cards: copy-in, compute, copy-out of each card, in that order. */
static int dv_lanes(mf_lane_desc *lanes, int n_cards, char names[][32])
{
    static const mf_lane_kind kinds[3] = {MF_LANE_DEV_COPY_IN, MF_LANE_DEV_COMPUTE,
                                          MF_LANE_DEV_COPY_OUT};
    static const char *suffix[3] = {"h2d", "compute", "d2h"};
    for (int c = 0; c < n_cards; c++)
        for (int k = 0; k < 3; k++) {
            snprintf(names[c * 3 + k], 32, "dev%d.%s", c, suffix[k]);
            lanes[c * 3 + k] = (mf_lane_desc){.kind = kinds[k], .name = names[c * 3 + k],
                                              .concurrency = 2, .device = c,
                                              .model = {.bytes_per_s = 25e9, .latency_ns = 1e4}};
        }
    return n_cards * 3;
}

typedef struct dv_job {
    void *in_host, *out_host;   /* pinned */
    void *a, *b;                /* device, on the job's card */
    int card;
    size_t n;
} dv_job;

static int dv_task_in(void *arg, mf_task_ctx *ctx)
{
    dv_job *j = arg;
    return mf_dev_copy_h2d(ctx->queue, j->a, j->in_host, j->n);
}
static int dv_task_mid(void *arg, mf_task_ctx *ctx)
{
    dv_job *j = arg;
    return mf_dev_copy_d2d(ctx->queue, j->card, j->b, j->card, j->a, j->n);
}
static int dv_task_out(void *arg, mf_task_ctx *ctx)
{
    dv_job *j = arg;
    return mf_dev_copy_d2h(ctx->queue, j->out_host, j->b, j->n);
}

/* Through mf_sched_run on every card: per job copy-in -> compute (a d2d copy) -> copy-out tasks,
 * dependencies only through the scheduler (which learns of completion by stream callbacks). */
static void dev_check_sched_copies(mf_dev *d, int n_jobs, size_t n)
{
    int nc = mf_dev_n_cards(d);
    mf_lane_desc lanes[3 * MF_DEV_MAX_CARDS];
    char names[3 * MF_DEV_MAX_CARDS][32];
    int n_lanes = dv_lanes(lanes, nc, names);
    mf_sched *s = NULL;
    int rc = mf_sched_create(&(mf_sched_opts){.lanes = lanes, .n_lanes = n_lanes,
                                              .dev = mf_dev_lane_ops_of(d)}, &s);
    CHECK(rc == 0, "sched_create: %s", mf_last_error());
    mf_graph *g = NULL;
    CHECK(mf_graph_create(lanes, n_lanes, &g) == 0, "%s", mf_last_error());
    if (!s || !g) return;
    dv_job *jobs = calloc((size_t)n_jobs, sizeof *jobs);
    for (int i = 0; i < n_jobs; i++) {
        dv_job *j = &jobs[i];
        j->card = i % nc;
        j->n = n;
        CHECK(mf_dev_host_alloc(d, j->card, n, &j->in_host) == 0 &&
              mf_dev_host_alloc(d, j->card, n, &j->out_host) == 0 &&
              mf_dev_alloc(d, j->card, n, &j->a) == 0 && mf_dev_alloc(d, j->card, n, &j->b) == 0,
              "job %d: %s", i, mf_last_error());
        dv_fill(j->in_host, n);
        memset(j->out_host, 0, n);
        char nm[3][32];
        snprintf(nm[0], 32, "in%d", i);
        snprintf(nm[1], 32, "mid%d", i);
        snprintf(nm[2], 32, "out%d", i);
        mf_task_fn fns[3] = {dv_task_in, dv_task_mid, dv_task_out};
        mf_task_id prev = -1;
        for (int k = 0; k < 3; k++) {
            mf_task_id t = mf_graph_add_task(g, &(mf_task_desc){.name = nm[k], .lane = j->card * 3 + k,
                .fn = fns[k], .arg = j, .cost = {.bytes = (double)n}, .place_hint = -1});
            CHECK(t >= 0, "add_task: %s", mf_last_error());
            if (prev >= 0) CHECK(mf_graph_add_dep(g, prev, t) == 0, "%s", mf_last_error());
            prev = t;
        }
    }
    CHECK(mf_graph_finalize(g) == 0, "finalize: %s", mf_last_error());
    rc = mf_sched_run(s, g, &(mf_run_opts){0});
    CHECK(rc == 0, "sched_run: %d %s", rc, mf_last_error());
    for (int i = 0; i < n_jobs; i++)
        CHECK(memcmp(jobs[i].in_host, jobs[i].out_host, n) == 0, "job %d (card %d): bytes differ",
              i, jobs[i].card);
    mf_sched_destroy(s);
    mf_graph_destroy(g);
    for (int i = 0; i < n_jobs; i++) {
        mf_dev_host_free(d, jobs[i].in_host);
        mf_dev_host_free(d, jobs[i].out_host);
        mf_dev_free(d, jobs[i].card, jobs[i].a);
        mf_dev_free(d, jobs[i].card, jobs[i].b);
    }
    free(jobs);
}

/* ---- the dense ops (device/dev.h mf_dev_linear, rounding, FFN phase 1, gating) -------------------- */

/* What the host placement of the dense work computes (graphs/step/step_*.c and graphs/layers): the
 * kernels' rows of the whole matrix (mf_kern_matmul), the reference's double sums
 * (mf_ly_linear_rows, grouped mf_ly_attn_lin_rows), mf_bf_n, mf_kern_ffn_up, and the engine's exact
 * gating loop; against the card's ops on a row slice [r0, r1) of each matrix with strided x and y,
 * at 1..64 tokens (the fp8 linear and ffn up on their AUTO path: on CUDA the tiled kernel at 64);
 * then the tiled kernel forced at every count (FP8, BF16 and FP8 grouped by 64-row groups, kernel
 * sums, against device/dense_host.h; the FP8 ffn up; the BF16 and grouped FP8 with the reference's
 * sums). exact: bit for bit (emulated cards); else within the CUDA bounds printed
 * as "rel err" lines (docs/device.md). */
static void dv_dense_cmp(const char *what, int T, const float *got, const float *ref, int64_t ld, int n, double tol,
                         int exact)
{
    double md = 0, mh = 0;
    int same = 1;
    for (int t = 0; t < T; t++)
        for (int i = 0; i < n; i++) {
            float a = got[t * ld + i], b = ref[t * ld + i];
            same &= !memcmp(&a, &b, sizeof a);
            double df = fabs((double)a - b);
            if (!(df <= md)) md = df;
            if (fabs(b) > mh) mh = fabs(b);
        }
    double e = mh > 0 ? md / mh : md;
    if (exact) CHECK(same, "dense %s T=%d: not bit for bit the host's (rel err %.3e)", what, T, e);
    else {
        printf("dense %s T=%d: rel err %.3e\n", what, T, e);
        CHECK(e <= tol, "dense %s T=%d: rel err %.3e (bound %.0e)", what, T, e, tol);
    }
}

static void dev_check_dense(mf_dev *d, int exact)
{
    enum { O = 256, IN = 512, LDX = 520, LDY = 264, R0 = 64, R1 = 192, GI = 128, TMAX = 64 };
    static const int toks[] = {1, 2, 5, 8, 9, 17, 64};
    mf_dev_stream *st = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COMPUTE);
    hmat f8 = hmat_rand(MF_KERN_FP8, O, IN), wa = hmat_rand(MF_KERN_FP8, O, GI), w3 = hmat_rand(MF_KERN_FP8, O, IN);
    uint16_t *bw = malloc(sizeof(uint16_t) * O * IN);
    for (int i = 0; i < O * IN; i++) bw[i] = mf_bf16_from_f32(gauss() * 0.05f);
    size_t xn = (size_t)TMAX * LDX, yn = (size_t)TMAX * LDY;
    float *x = malloc(sizeof(float) * xn), *ref = malloc(sizeof(float) * yn), *got = malloc(sizeof(float) * yn);
    float *g = malloc(sizeof(float) * yn), *u = malloc(sizeof(float) * yn);
    for (size_t i = 0; i < xn; i++) x[i] = gauss();
    for (size_t i = 0; i < yn; i++) g[i] = gauss() * 6, u[i] = gauss() * 6;
    /* the card's copies of rows [R0, R1) */
    size_t sc8 = IN / 32, sca = GI / 32;
    void *dw8 = dupload(d, 0, f8.w + (size_t)R0 * IN, (size_t)(R1 - R0) * IN);
    void *ds8 = dupload(d, 0, f8.scale + R0 / 32 * sc8, (size_t)(R1 - R0) / 32 * sc8);
    void *dw3 = dupload(d, 0, w3.w + (size_t)R0 * IN, (size_t)(R1 - R0) * IN);
    void *ds3 = dupload(d, 0, w3.scale + R0 / 32 * sc8, (size_t)(R1 - R0) / 32 * sc8);
    void *dwa = dupload(d, 0, wa.w + (size_t)R0 * GI, (size_t)(R1 - R0) * GI);
    void *dsa = dupload(d, 0, wa.scale + R0 / 32 * sca, (size_t)(R1 - R0) / 32 * sca);
    void *dbw = dupload(d, 0, bw + (size_t)R0 * IN, sizeof(uint16_t) * (R1 - R0) * IN);
    float *dx = dupload(d, 0, x, sizeof(float) * xn), *dg = dupload(d, 0, g, sizeof(float) * yn);
    float *du = dupload(d, 0, u, sizeof(float) * yn), *dy = NULL;
    CHECK(mf_dev_alloc(d, 0, sizeof(float) * yn, (void **)&dy) == 0, "alloc: %s", mf_last_error());
    mf_weight wwa = {.kind = MF_W_FP8, .rows = O, .cols = GI, .data = wa.w, .scale = wa.scale, .block_rows = 32,
                     .block_cols = 32};
    mf_weight wbf = {.kind = MF_W_BF16, .rows = O, .cols = IN, .data = (const uint8_t *)bw, .block_rows = 32,
                     .block_cols = 32};
    mf_ly_attn_lin l_wa = {.w = &wwa, .groups = 4, .bf = 1};   /* 4 groups of 64 rows; x 4 x 128 columns */
    int n = R1 - R0;
    for (size_t ti = 0; ti < sizeof toks / sizeof toks[0] && dy; ti++) {
        int T = toks[ti];
        for (int op = 0; op < 12; op++) {
            static const char *const name[12] = {"fp8 linear", "bf16 linear (reference sums)",
                                                "fp8 grouped linear (reference sums) + bf16", "ffn up (fp8)",
                                                "bf16 rounding", "swiglu (bf16 roundings)", "fp8 linear (tiled)",
                                                "bf16 linear (tiled)", "fp8 grouped linear (tiled)",
                                                "ffn up (fp8, tiled)", "bf16 linear (reference sums, tiled)",
                                                "fp8 grouped linear (reference sums, tiled)"};
            float *hy = malloc(sizeof(float) * yn);   /* the host's, rows from 0 */
            memset(hy, 0, sizeof(float) * yn);
            int rc = 0;
            mf_dev_lin dl = {.row0 = R0, .x = dx, .ld_x = LDX, .n_tok = T, .y = dy, .ld_y = LDY};
            if (op == 0) {
                rc = mf_kern_matmul(&f8.m, &(mf_kern_in){x, T, LDX, NULL}, hy, LDY, R0, R1);
                dl.w = (mf_kern_mat){MF_KERN_FP8, dw8, ds8, n, IN};
                if (!rc) rc = mf_dev_linear(st, &dl);
            } else if (op == 1) {
                for (int t = 0; t < T && !rc; t++) rc = mf_ly_linear_rows(NULL, &wbf, R0, n, x + t * LDX, IN, 0, hy + t * LDY + R0);
                dl.w = (mf_kern_mat){MF_KERN_BF16, dbw, NULL, n, IN};
                dl.sums = MF_DEV_SUMS_REF;
                if (!rc) rc = mf_dev_linear(st, &dl);
            } else if (op == 2) {
                rc = mf_ly_attn_lin_rows(NULL, &l_wa, x, LDX, hy, LDY, T, R0, R1);
                dl.w = (mf_kern_mat){MF_KERN_FP8, dwa, dsa, n, GI};
                dl.sums = MF_DEV_SUMS_REF;
                dl.group_rows = O / 4;
                if (!rc) rc = mf_dev_linear(st, &dl);
                if (!rc) rc = mf_dev_round_bf16(st, dy, T, LDY, n);
            } else if (op == 3 || op == 9) {
                rc = mf_kern_ffn_up(&f8.m, &w3.m, &(mf_kern_in){x, T, LDX, NULL}, NULL, 7.0f, hy, LDY, R0, R1);
                mf_dev_up a = {.w1 = {MF_KERN_FP8, dw8, ds8, n, IN}, .w3 = {MF_KERN_FP8, dw3, ds3, n, IN}, .x = dx,
                               .ld_x = LDX, .n_tok = T, .limit = 7.0f, .h = dy, .ld_h = LDY,
                               .path = op == 9 ? MF_DEV_LIN_TILED : MF_DEV_LIN_AUTO};
                if (!rc) rc = mf_dev_ffn_up(st, &a);
            } else if (op == 4) {
                for (int t = 0; t < T; t++) {
                    memcpy(hy + t * LDY + R0, g + t * LDY, sizeof(float) * n);
                    mf_bf_n(hy + t * LDY + R0, n);
                }
                rc = mf_dev_copy_d2d(st, 0, dy, 0, dg, sizeof(float) * yn);
                if (!rc) rc = mf_dev_round_bf16(st, dy, T, LDY, n);
            } else if ((op >= 6 && op <= 8) || op >= 10) {   /* the tiled kernel forced; the host's sums of the slice */
                int k = op >= 10 ? op - 3 : op;   /* 10, 11: 7, 8 with the reference's sums */
                mf_kern_mat hm = k == 6   ? (mf_kern_mat){MF_KERN_FP8, f8.w + (size_t)R0 * IN, f8.scale + R0 / 32 * sc8, n, IN}
                                 : k == 7 ? (mf_kern_mat){MF_KERN_BF16, bw + (size_t)R0 * IN, NULL, n, IN}
                                          : (mf_kern_mat){MF_KERN_FP8, wa.w + (size_t)R0 * GI, wa.scale + R0 / 32 * sca, n, GI};
                mf_dev_lin hl = {.w = hm, .row0 = R0, .group_rows = k == 8 ? O / 4 : 0,
                                 .sums = op >= 10 ? MF_DEV_SUMS_REF : MF_DEV_SUMS_KERN, .x = x, .ld_x = LDX,
                                 .n_tok = T, .y = hy + R0, .ld_y = LDY};
                rc = mf_dense_host_linear(&hl);
                dl.sums = hl.sums;
                dl.w = k == 6   ? (mf_kern_mat){MF_KERN_FP8, dw8, ds8, n, IN}
                       : k == 7 ? (mf_kern_mat){MF_KERN_BF16, dbw, NULL, n, IN}
                                : (mf_kern_mat){MF_KERN_FP8, dwa, dsa, n, GI};
                dl.group_rows = hl.group_rows;
                dl.path = MF_DEV_LIN_TILED;
                if (!rc) rc = mf_dev_linear(st, &dl);
            } else {
                for (int t = 0; t < T; t++)   /* graphs/step/step_moe.c mf_step_ffn_up's exact epilogue */
                    for (int i = 0; i < n; i++) {
                        float gi = mf_bf(g[t * LDY + i]), ui = mf_bf(u[t * LDY + i]), lim = 7.0f;
                        ui = fminf(fmaxf(ui, -lim), lim);
                        gi = fminf(gi, lim);
                        hy[t * LDY + R0 + i] = mf_bf(1.0f * (mf_ly_silu(gi) * ui));
                    }
                rc = mf_dev_swiglu_bf16(st, dg, du, T, LDY, n, 7.0f, dy);
            }
            CHECK(rc == 0, "dense %s T=%d: %s", name[op], T, mf_last_error());
            CHECK(mf_dev_stream_sync(st) == 0, "dense %s: sync: %s", name[op], mf_last_error());
            ddownload(d, 0, got, dy, sizeof(float) * yn);
            for (int t = 0; t < T; t++) memcpy(ref + t * LDY, hy + t * LDY + R0, sizeof(float) * n);
            static const double tol[12] = {1e-5, 1e-6, 8e-3, 1e-4, 0, 8e-3, 1e-5, 1e-5, 1e-5, 1e-4, 1e-6, 1e-6};
            dv_dense_cmp(name[op], T, got, ref, LDY, n, tol[op], exact);
            free(hy);
        }
    }
    void *dev[] = {dw8, ds8, dw3, ds3, dwa, dsa, dbw, dx, dg, du, dy};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) mf_dev_free(d, 0, dev[i]);
    /* refusals: a format the dense ops do not take, a short ld */
    mf_dev_lin bad = {.w = {MF_KERN_FP4, f8.w, f8.scale, n, IN}, .x = x, .ld_x = IN, .n_tok = 1, .y = got, .ld_y = n};
    CHECK(mf_dev_linear(st, &bad) == -EINVAL && strstr(mf_last_error(), "expected FP8 or BF16"), "fp4: %s",
          mf_last_error());
    bad.w.fmt = MF_KERN_FP8;
    bad.ld_y = n - 1;
    CHECK(mf_dev_linear(st, &bad) == -EINVAL && strstr(mf_last_error(), "ld_y"), "short ld_y: %s", mf_last_error());
    bad.ld_y = n;   /* the tiled kernel: groups of 64-row multiples from a 64-row multiple */
    bad.path = MF_DEV_LIN_TILED;
    bad.group_rows = 32;
    bad.ld_x = 8 * IN;
    CHECK(mf_dev_linear(st, &bad) == -EINVAL && strstr(mf_last_error(), "tiled"), "tiled, 32-row groups: %s",
          mf_last_error());
    hmat_free(&f8);
    hmat_free(&wa);
    hmat_free(&w3);
    free(bw);
    free(x);
    free(ref);
    free(got);
    free(g);
    free(u);
}

/* ---- the cuBLASLt path (device/dev.h "The cuBLASLt path") -------------------------------------- */

/* One cuBLASLt case's result against its answer: bit for bit (exact: emulated cards) or within tol,
 * printed as a "dense cublaslt ... rel err" line (CUDA). */
static void dv_lt_cmp(const char *what, int T, const float *got, const float *ref, int64_t ld, int n, double tol,
                      int exact)
{
    char w[160];
    snprintf(w, sizeof w, "cublaslt %s", what);
    dv_dense_cmp(w, T, got, ref, ld, n, tol, exact);
}

/* A dequantized copy of h (host) on card 0 as type with the plan's shift, made on the copy-in stream
 * and ordered before the compute stream's later work by an event (the overlap the engine uses). */
static mf_dev_w16 dv_lt_dequant(mf_dev *d, const hmat *h, int row0, int rows, mf_dev_f16 type, int shift, void **wbuf,
                                void **dw, void **ds)
{
    mf_dev_stream *in = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COPY_IN), *cs = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COMPUTE);
    int n_in = h->m.n_in, fp8 = h->m.fmt == MF_KERN_FP8;
    size_t wrow = fp8 ? (size_t)n_in : (size_t)n_in / 2, srow = fp8 ? (size_t)n_in / 32 : (size_t)n_in / 32;
    *dw = dupload(d, 0, h->w + (size_t)row0 * wrow, wrow * rows);
    *ds = dupload(d, 0, h->scale + (fp8 ? (size_t)row0 / 32 * srow : (size_t)row0 * srow),
                  fp8 ? (size_t)(rows + 31) / 32 * srow : (size_t)rows * srow);
    mf_dev_w16 o = {.type = type, .shift = shift, .n_out = rows, .n_in = n_in};
    CHECK(mf_dev_alloc(d, 0, (size_t)rows * n_in * 2, wbuf) == 0, "alloc: %s", mf_last_error());
    o.w = *wbuf;
    mf_kern_mat dm = {h->m.fmt, *dw, *ds, rows, n_in};
    mf_dev_event *ev = NULL;
    CHECK(mf_dev_event_create(d, 0, &ev) == 0 && mf_dev_dequant(in, &dm, &o) == 0 && mf_dev_event_record(ev, in) == 0 &&
              mf_dev_stream_wait(cs, ev) == 0,
          "dequantize %s rows %d..%d: %s", fp8 ? "fp8" : "fp4", row0, row0 + rows, mf_last_error());
    mf_dev_event_destroy(ev);
    return o;
}

/* The linears: FP8 rows [64, 192) of a 256 x 512 matrix (strided x and y) dequantized on the copy-in
 * stream, then MF_DEV_LIN_CUBLASLT on the compute stream, at 1, 5, 64 and 130 tokens; bf16-exact x
 * against the host's plain FP8 kernel (the engine's host path: the same bits on an emulated card) and
 * raw x against the kernel on x's card values; a grouped slice (4 groups of 64 rows, wo_a's shape);
 * a matrix whose scales (2^-27..2^-9) need an FP16 shift (-12). */
static void dv_lt_linears(mf_dev *d, mf_dev_f16 type, int exact, double tol)
{
    enum { O = 256, IN = 512, GI = 128, LDX = 520, LDY = 264, R0 = 64, R1 = 192, TMAX = 130 };
    static const int toks[] = {1, 5, 64, 130};
    const char *tn = type == MF_DEV_F16_FP16 ? "fp16" : "bf16";
    mf_dev_stream *cs = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COMPUTE);
    hmat f8 = hmat_rand(MF_KERN_FP8, O, IN), wa = hmat_rand(MF_KERN_FP8, O, GI), wide = hmat_rand(MF_KERN_FP8, O, IN);
    for (size_t i = 0; i < wide.s_bytes; i++) wide.scale[i] = (uint8_t)(100 + dv_rnd() % 19);
    int n = R1 - R0;
    size_t xn = (size_t)TMAX * LDX, yn = (size_t)TMAX * LDY;
    float *x = malloc(sizeof(float) * xn), *xb = malloc(sizeof(float) * xn), *xv = malloc(sizeof(float) * xn);
    float *ref = malloc(sizeof(float) * yn), *got = malloc(sizeof(float) * yn);
    for (size_t i = 0; i < xn; i++) xb[i] = mf_bf16_round(x[i] = gauss());
    const hmat *mats[3] = {&f8, &wa, &wide};
    static const char *const mname[3] = {"fp8 linear", "fp8 grouped linear", "fp8 linear, scales 2^-27..2^-9"};
    float *dx = dupload(d, 0, x, sizeof(float) * xn), *dxb = dupload(d, 0, xb, sizeof(float) * xn), *dy = NULL;
    void *x16 = NULL;
    size_t x16b = mf_dev_lt_x16_bytes(TMAX, LDX);
    CHECK(mf_dev_alloc(d, 0, sizeof(float) * yn, (void **)&dy) == 0 && mf_dev_alloc(d, 0, x16b, &x16) == 0, "alloc: %s",
          mf_last_error());
    for (int mi = 0; mi < 3 && dy && x16; mi++) {
        const hmat *h = mats[mi];
        mf_kern_mat slice = {MF_KERN_FP8, h->w + (size_t)R0 * h->m.n_in, h->scale + R0 / 32 * (h->m.n_in / 32), n, h->m.n_in};
        const mf_kern_mat *one = &slice;
        int shift = 99, prc = mf_dev_w16_plan(&one, 1, type, &shift);
        CHECK(prc == 0 && (mi < 2 ? shift == 0 : type == MF_DEV_F16_FP16 ? shift == -12 : shift == 0),
              "plan %s (%s): rc %d shift %d (%s)", mname[mi], tn, prc, shift, mf_last_error());
        void *wb = NULL, *dw = NULL, *ds = NULL;
        mf_dev_w16 w16 = dv_lt_dequant(d, h, R0, n, type, shift, &wb, &dw, &ds);
        for (size_t ti = 0; ti < sizeof toks / sizeof toks[0]; ti++)
            for (int raw = 0; raw < 2; raw++) {
                int T = toks[ti];
                mf_dev_lin a = {.w = {MF_KERN_FP8, dw, ds, n, h->m.n_in}, .row0 = R0, .group_rows = mi == 1 ? O / 4 : 0,
                                .path = MF_DEV_LIN_CUBLASLT, .x = raw ? dx : dxb, .ld_x = LDX, .n_tok = T, .y = dy,
                                .ld_y = LDY, .w16 = w16, .lt = {x16, x16b, NULL, 0}};
                mf_dev_lin hl = a;   /* the answer: the host's FP8 kernel on the card's values of x */
                hl.w = slice;
                hl.path = MF_DEV_LIN_AUTO;
                hl.y = ref;
                int64_t cols = a.group_rows ? (R0 + n - 1) / a.group_rows * h->m.n_in + h->m.n_in : h->m.n_in;
                memset(xv, 0, sizeof(float) * xn);
                mf_lt_host_x_values(type, raw ? x : xb, T, LDX, cols, xv, LDX);
                if (!raw)   /* bf16 values are their own card values: the engine's host path itself */
                    for (size_t i = 0; i < (size_t)T * LDX; i++)
                        CHECK(xv[i] == xb[i] || (i % LDX) >= (size_t)cols, "%s: a bf16 x is not its card value", tn);
                hl.x = xv;
                CHECK(mf_dense_host_linear(&hl) == 0, "host: %s", mf_last_error());
                CHECK(mf_dev_linear(cs, &a) == 0 && mf_dev_stream_sync(cs) == 0, "%s (%s) T=%d: %s", mname[mi], tn, T,
                      mf_last_error());
                ddownload(d, 0, got, dy, sizeof(float) * yn);
                char what[128];
                snprintf(what, sizeof what, "%s (%s, %s x)", mname[mi], tn, raw ? "fp32" : "bf16");
                dv_lt_cmp(what, T, got, ref, LDY, n, tol, exact);
            }
        mf_dev_free(d, 0, wb);
        mf_dev_free(d, 0, dw);
        mf_dev_free(d, 0, ds);
    }
    /* refusals: the reference's sums, a scratch too small, the dense FFN phase 1 on this path */
    mf_dev_lin bad = {.w = {MF_KERN_FP8, dy, (uint8_t *)dy, n, IN}, .path = MF_DEV_LIN_CUBLASLT, .sums = MF_DEV_SUMS_REF,
                      .x = dx, .ld_x = LDX, .n_tok = 4, .y = dy, .ld_y = LDY,
                      .w16 = {dy, type, 0, n, IN}, .lt = {x16, x16b, NULL, 0}};
    CHECK(mf_dev_linear(cs, &bad) == -EINVAL && strstr(mf_last_error(), "fp32 sums"), "REF sums: %s", mf_last_error());
    bad.sums = MF_DEV_SUMS_KERN;
    bad.lt.x16_bytes = mf_dev_lt_x16_bytes(4, IN) - 1;
    CHECK(mf_dev_linear(cs, &bad) == -EINVAL && strstr(mf_last_error(), "scratch"), "small x16: %s", mf_last_error());
    bad.lt.x16_bytes = x16b;
    bad.w16.n_in = IN / 2;
    CHECK(mf_dev_linear(cs, &bad) == -EINVAL && strstr(mf_last_error(), "w16"), "w16 shape: %s", mf_last_error());
    mf_dev_up up = {.w1 = bad.w, .w3 = bad.w, .x = dx, .ld_x = LDX, .n_tok = 1, .limit = 7.0f, .h = dy, .ld_h = LDY,
                    .path = MF_DEV_LIN_CUBLASLT};
    CHECK(mf_dev_ffn_up(cs, &up) == -EINVAL && strstr(mf_last_error(), "path"), "ffn up: %s", mf_last_error());
    /* a plan refused: FP16 holds no 41-binade span of FP8 scales; BF16 does */
    for (size_t i = 0; i < wide.s_bytes; i++) wide.scale[i] = (uint8_t)(100 + i % 41);
    const mf_kern_mat *wm = &wide.m;
    int shift = 0;
    CHECK(mf_dev_w16_plan(&wm, 1, MF_DEV_F16_FP16, &shift) == -ERANGE && strstr(mf_last_error(), "binades") &&
              mf_dev_w16_plan(&wm, 1, MF_DEV_F16_BF16, &shift) == 0 && shift == 0,
          "plan of a 41-binade span: %s", mf_last_error());
    mf_dev_free(d, 0, dx);
    mf_dev_free(d, 0, dxb);
    mf_dev_free(d, 0, dy);
    mf_dev_free(d, 0, x16);
    hmat_free(&f8);
    hmat_free(&wa);
    hmat_free(&wide);
    free(x);
    free(xb);
    free(xv);
    free(ref);
    free(got);
}

/* The routed expert's FFN (FP4, H 256, I 128): w1 and w3 dequantized into one [2I][H] scratch with
 * their common shift, w2 into another, mf_dev_expert_ffn_lt at 1, 3 and 40 tokens (with token
 * weights at 3) against the host's FP4 fp32 kernels on the card's values of x and h
 * (mf_lt_host_ffn_ref). */
static void dv_lt_ffn(mf_dev *d, mf_dev_f16 type, int exact, double tol)
{
    enum { H = 256, I = 128, TMAX = 40 };
    static const int toks[] = {1, 3, 40};
    const char *tn = type == MF_DEV_F16_FP16 ? "fp16" : "bf16";
    mf_dev_stream *cs = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COMPUTE);
    hmat w1 = hmat_rand(MF_KERN_FP4, I, H), w3 = hmat_rand(MF_KERN_FP4, I, H), w2 = hmat_rand(MF_KERN_FP4, H, I);
    const mf_kern_mat *up[2] = {&w1.m, &w3.m}, *down = &w2.m;
    int s13 = 0, s2 = 0;
    CHECK(mf_dev_w16_plan(up, 2, type, &s13) == 0 && mf_dev_w16_plan(&down, 1, type, &s2) == 0, "plans: %s",
          mf_last_error());
    void *wb1, *dw1, *ds1, *wb3, *dw3, *ds3, *wb2, *dw2, *ds2, *w13 = NULL;
    mf_dev_w16 a1 = dv_lt_dequant(d, &w1, 0, I, type, s13, &wb1, &dw1, &ds1);
    mf_dev_w16 a3 = dv_lt_dequant(d, &w3, 0, I, type, s13, &wb3, &dw3, &ds3);
    mf_dev_w16 a2 = dv_lt_dequant(d, &w2, 0, H, type, s2, &wb2, &dw2, &ds2);
    /* w13: w1's rows then w3's, one scratch (dequantized there directly on the copy-in stream) */
    CHECK(mf_dev_alloc(d, 0, (size_t)2 * I * H * 2, &w13) == 0, "alloc: %s", mf_last_error());
    mf_dev_stream *in = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COPY_IN);
    mf_dev_w16 lo = {w13, type, s13, I, H}, hi = {(uint16_t *)w13 + (size_t)I * H, type, s13, I, H};
    CHECK(mf_dev_dequant(in, &(mf_kern_mat){MF_KERN_FP4, dw1, ds1, I, H}, &lo) == 0 &&
              mf_dev_dequant(in, &(mf_kern_mat){MF_KERN_FP4, dw3, ds3, I, H}, &hi) == 0 && mf_dev_stream_sync(in) == 0,
          "w13: %s", mf_last_error());
    (void)a1;
    (void)a3;
    float *x = malloc(sizeof(float) * TMAX * H), *tw = malloc(sizeof(float) * TMAX), *y = malloc(sizeof(float) * TMAX * H);
    float *ref = malloc(sizeof(float) * TMAX * H), *gu = malloc(sizeof(float) * TMAX * 2 * I);
    float *xv = malloc(sizeof(float) * TMAX * H);
    for (int i = 0; i < TMAX * H; i++) x[i] = mf_bf16_round(gauss());
    for (int t = 0; t < TMAX; t++) tw[t] = 0.25f + 0.5f * (float)(dv_rnd() % 1000) / 1000.0f;
    float *dx = dupload(d, 0, x, sizeof(float) * TMAX * H), *dtw = dupload(d, 0, tw, sizeof(float) * TMAX);
    float *dgu = NULL, *dy = NULL;
    void *x16 = NULL;
    size_t x16b = mf_dev_lt_x16_bytes(TMAX, H);
    CHECK(mf_dev_alloc(d, 0, sizeof(float) * TMAX * 2 * I, (void **)&dgu) == 0 &&
              mf_dev_alloc(d, 0, sizeof(float) * TMAX * H, (void **)&dy) == 0 && mf_dev_alloc(d, 0, x16b, &x16) == 0,
          "alloc: %s", mf_last_error());
    for (size_t ti = 0; ti < sizeof toks / sizeof toks[0] && dy && x16 && w13; ti++) {
        int T = toks[ti];
        mf_dev_ffn_lt a = {.w13 = {w13, type, s13, 2 * I, H}, .w2 = a2, .x = dx, .n_tok = T,
                           .tok_weight = T == 3 ? dtw : NULL, .limit = 7.0f, .gu = dgu, .lt = {x16, x16b, NULL, 0},
                           .y = dy};
        CHECK(mf_lt_host_ffn_ref(type, &w1.m, &w3.m, &w2.m, x, T, T == 3 ? tw : NULL, 7.0f, gu, xv, ref) == 0,
              "host: %s", mf_last_error());
        CHECK(mf_dev_expert_ffn_lt(cs, &a) == 0 && mf_dev_stream_sync(cs) == 0, "ffn (%s) T=%d: %s", tn, T,
              mf_last_error());
        ddownload(d, 0, y, dy, sizeof(float) * T * H);
        char what[64];
        snprintf(what, sizeof what, "fp4 expert ffn (%s)", tn);
        dv_lt_cmp(what, T, y, ref, H, H, tol, exact);
    }
    void *dev[] = {wb1, dw1, ds1, wb3, dw3, ds3, wb2, dw2, ds2, w13, dx, dtw, dgu, dy, x16};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) mf_dev_free(d, 0, dev[i]);
    hmat_free(&w1);
    hmat_free(&w3);
    hmat_free(&w2);
    free(x);
    free(tw);
    free(y);
    free(ref);
    free(gu);
    free(xv);
}

/* The cuBLASLt path on card 0, in every 16-bit type the card takes (BF16 cards also FP16): the
 * linears and the expert FFN against their answers, bit for bit (exact) or within the bounds
 * (tol_lin, tol_ffn: device/dev_check.h's, printed "dense cublaslt ... rel err"); without tensor
 * cores every op is -ENOTSUP. */
static void dev_check_lt(mf_dev *d, int exact, double tol_lin, double tol_ffn)
{
    mf_dev_f16 f = mf_dev_card_f16(d, 0);
    if (f == MF_DEV_F16_NONE) {
        mf_dev_w16 o = {(void *)8, MF_DEV_F16_BF16, 0, 32, 32};
        mf_kern_mat w = {MF_KERN_FP8, (void *)8, (void *)8, 32, 32};
        CHECK(mf_dev_dequant(mf_dev_stream_of(d, 0, MF_DEV_STREAM_COPY_IN), &w, &o) == -ENOTSUP &&
                  strstr(mf_last_error(), "tensor cores"), "no tensor cores: %s", mf_last_error());
        return;
    }
    for (int k = 0; k < 2; k++) {
        mf_dev_f16 type = k ? MF_DEV_F16_FP16 : f;
        if (k && f == MF_DEV_F16_FP16) break;
        dv_lt_linears(d, type, exact, tol_lin);
        dv_lt_ffn(d, type, exact, tol_ffn);
    }
}

#endif
