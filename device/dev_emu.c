/* The emulated device: N cards on host threads, so everything device-side runs and is tested on
 * machines without a GPU. Each card has a memory capacity (host malloc with accounting), three
 * streams each served by one worker thread that runs its operations in order, events, copies that
 * take modelled time (latency + bytes / bandwidth, slept, never spun) and host/kernels.h kernels,
 * so results equal the host path's bit for bit (the cuBLASLt path: device/lt_host.c's casts and fixed-order
 * products over the card's 16-bit scratch, the host's kernels' bits on the cast activations; the spec's
 * tc= says which 16-bit type). Graph capture records a stream's operations and
 * replays them. A failed operation's error goes to the next status callback of its stream (the
 * scheduler fails that task) or, if none takes it, to the next sync. Fault injection for tests:
 * the nth host-to-device copy copies half its bytes and fails (spec fail_h2d=N, mf_dev_emu_fail_h2d);
 * the nth callback is never called, as CUDA calls no host function after a fault (spec lose_cb=N);
 * every kernel on card C adds 1 to the first element of its output, a card that computes wrong
 * answers silently (spec bad_card=C, for the startup self-check, device/dev_check.h). */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "device/dense_host.h"
#include "device/dev_impl.h"
#include "device/lt_host.h"
#include "sched/clock.h"
#include "sched/error.h"

#define EMU_RING_CAP 1024
#define EMU_ALLOC_MAGIC 0x6d66656d75646576ULL   /* "mfemudev" */
#define EMU_HDR_BYTES 64

typedef enum { OP_COPY, OP_COPY_2D, OP_CALLBACK, OP_RECORD, OP_WAIT, OP_FP4, OP_FP8, OP_BF16, OP_FFN, OP_FFN_TABLE,
               OP_LIN, OP_ROUND, OP_CAST, OP_UP, OP_SWIGLU, OP_ATTN, OP_ISCORE, OP_DEQUANT, OP_FFN_LT } emu_op_kind;

typedef struct emu_event {
    mf_dev_event pub;
    pthread_mutex_t mu;
    pthread_cond_t cond;
    uint64_t recorded;   /* records enqueued so far */
    uint64_t reached;    /* highest record executed */
    int64_t reached_ns;  /* the host clock when it was executed */
    int refs;            /* enqueued operations naming this event */
} emu_event;

typedef struct emu_op {
    emu_op_kind kind;
    union {
        struct { void *dst; const void *src; size_t n; mf_dev_copy_kind k; } copy;
        struct { void *dst; const void *src; size_t dpitch, spitch, width, height; } copy_2d;
        struct { void (*fn)(void *); void (*fn_status)(void *, int, const char *); void *arg; } cb;
        struct { emu_event *e; uint64_t seq; } ev;
        struct { mf_kern_mat w; const float *x; int n_tok; float *y; void *q8; } mm;
        mf_dev_ffn ffn;
        mf_dev_ffn_table tab;
        mf_dev_lin lin;
        mf_dev_up up;
        mf_dev_attn attn;
        mf_dev_iscore isc;
        struct { mf_kern_mat w; mf_dev_w16 out; } dq;
        mf_dev_ffn_lt flt;
        struct { const float *g, *u; float *y; int n_tok, n; int64_t ld; float limit; } ew;   /* round, swiglu */
        struct { float *x; uint16_t *y; int64_t ld_x, ld_y; int n_tok, n, pack; } cast;
    } u;
} emu_op;

typedef struct emu_dev emu_dev;

typedef struct emu_stream {
    mf_dev_stream pub;
    emu_dev *d;
    pthread_t thread;
    int started;
    pthread_mutex_t mu;
    pthread_cond_t cond;     /* work arrived, work retired, exit */
    emu_op ring[EMU_RING_CAP];
    unsigned head, tail;     /* head: next to run (retired after it ran) */
    int exit;
    int err;                 /* first async error not yet delivered (to a status callback) */
    char errmsg[MF_ERROR_MSG_BYTES];
    char cb_msg[MF_ERROR_MSG_BYTES];   /* the message handed to a status callback (its thread) */
    int capturing;           /* enqueued operations go to cap[] instead of the ring */
    emu_op *cap;
    int n_cap, max_cap;
    float attn_scratch[4 * MF_DEV_ATTN_MAX_KEYS];   /* mf_dense_host_attn's scores */
    mf_lt_host_scratch lt;   /* the cuBLASLt path's products (grown on first use) */
} emu_stream;

typedef struct emu_graph {
    mf_dev_graph pub;
    emu_op *ops;
    int n_ops;
} emu_graph;

typedef struct emu_hdr {     /* in front of every device allocation */
    uint64_t magic;
    int card;
    size_t n_bytes;
    struct emu_hdr *prev, *next;
} emu_hdr;

typedef struct emu_card {
    pthread_mutex_t mu;
    uint64_t cap_bytes, used_bytes;
    emu_hdr *allocs;
} emu_card;

struct emu_dev {
    mf_dev pub;
    double bw_bytes_per_s;
    int64_t lat_ns;
    emu_card cards[MF_DEV_MAX_CARDS];
    pthread_mutex_t host_mu;
    emu_hdr *host_allocs;    /* staging memory, freed at close when left */
    emu_stream *streams[MF_DEV_MAX_CARDS][MF_DEV_N_STREAMS];
    _Atomic int64_t fail_h2d;   /* fault injection: h2d copies left until the failing one (0: off) */
    _Atomic int64_t lose_cb;    /* fault injection: callbacks left until the one never called (0: off) */
    int bad_card;               /* fault injection: card whose kernels are off by one (-1: none) */
};

static const char *emu_stream_name[MF_DEV_N_STREAMS] = {"copy-in", "compute", "copy-out"};

/* ---- the stream worker ----------------------------------------------------------------------- */

static void emu_sleep_until(int64_t t_ns)
{
    struct timespec ts = {.tv_sec = t_ns / 1000000000LL, .tv_nsec = t_ns % 1000000000LL};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

static void emu_stream_fail(emu_stream *s, int rc)
{
    pthread_mutex_lock(&s->mu);
    if (!s->err) {
        s->err = rc;
        snprintf(s->errmsg, sizeof s->errmsg, "emu card %d %s stream: %s", s->pub.card,
                 emu_stream_name[s->pub.kind], mf_last_error());
    }
    pthread_mutex_unlock(&s->mu);
}

static void emu_event_unref(emu_event *e)
{
    pthread_mutex_lock(&e->mu);
    e->refs--;
    pthread_cond_broadcast(&e->cond);
    pthread_mutex_unlock(&e->mu);
}

static int emu_fp4(const mf_kern_mat *w, const float *x, int n_tok, float *y, void *q8buf,
                   int n_in)
{
    if (!q8buf) return mf_kern_fp4_matmul_f32(w->w, w->scale, w->n_out, n_in, x, n_tok, n_in, y,
                                              w->n_out, 0, w->n_out);
    mf_kern_q8 q;
    int rc = mf_kern_q8_init(&q, q8buf, mf_kern_q8_bytes(n_tok, n_in), n_tok, n_in);
    if (!rc) rc = mf_kern_q8_quantize(&q, x, n_in, 0, n_tok);
    if (!rc) rc = mf_kern_fp4_matmul(w->w, w->scale, w->n_out, n_in, &q, y, w->n_out, 0, w->n_out);
    return rc;
}

/* The expert FFN exactly as a host caller runs it: quantize x once (int8 path), phase 1 over all
 * hidden rows, quantize h, phase 2 over all model rows. */
static int emu_ffn(const mf_dev_ffn *a)
{
    int H = a->w1.n_in, I = a->w1.n_out, T = a->n_tok;
    int fp4_up = a->w1.fmt == MF_KERN_FP4 && a->q8_scratch, fp4_down = a->w2.fmt == MF_KERN_FP4 &&
                                                                       a->q8_scratch;
    mf_kern_q8 q;
    int rc = 0;
    if (fp4_up) {
        rc = mf_kern_q8_init(&q, a->q8_scratch, mf_kern_q8_bytes(T, H), T, H);
        if (!rc) rc = mf_kern_q8_quantize(&q, a->x, H, 0, T);
    }
    if (!rc) rc = mf_kern_ffn_up(&a->w1, &a->w3, &(mf_kern_in){a->x, T, H, fp4_up ? &q : NULL},
                                 a->tok_weight, a->limit, a->h, I, 0, I);
    if (!rc && fp4_down) {
        rc = mf_kern_q8_init(&q, a->q8_scratch, mf_kern_q8_bytes(T, I), T, I);
        if (!rc) rc = mf_kern_q8_quantize(&q, a->h, I, 0, T);
    }
    if (!rc) rc = mf_kern_ffn_down(&a->w2, &(mf_kern_in){a->h, T, I, fp4_down ? &q : NULL}, a->y,
                                   H, 0, H);
    return rc;
}

/* The slot-table FFN: each used slot's entry read now, then exactly emu_ffn for it. */
static int emu_ffn_table(const mf_dev_ffn_table *a)
{
    int H = a->n_in, I = a->n_hidden;
    for (int k = 0; k < a->n_slots; k++) {
        mf_dev_ffn_slot e = a->table[k];
        if (e.n_tok == 0) continue;
        if (e.n_tok < 0 || e.n_tok > a->max_tok || e.row0 < 0)
            return mf_error(-EINVAL, "expert FFN slot table: slot %d has %d tokens from row %d (expected "
                            "0..%d tokens)", k, (int)e.n_tok, (int)e.row0, a->max_tok);
        const uint8_t *b = (const uint8_t *)(uintptr_t)e.base;
        size_t r0 = (size_t)e.row0;
        mf_dev_ffn f = {
            .w1 = {MF_KERN_FP4, b + a->part_off[0], b + a->part_off[1], I, H},
            .w2 = {MF_KERN_FP4, b + a->part_off[2], b + a->part_off[3], H, I},
            .w3 = {MF_KERN_FP4, b + a->part_off[4], b + a->part_off[5], I, H},
            .x = a->x + r0 * H, .n_tok = e.n_tok, .tok_weight = a->tok_weight ? a->tok_weight + r0 : NULL,
            .limit = a->limit, .h = a->h + r0 * I,
            .q8_scratch = (uint8_t *)a->q8_scratch + r0 * a->q8_row, .y = a->y + r0 * H};
        int rc = emu_ffn(&f);
        if (rc) return mf_error_wrap(rc, "expert FFN slot table, slot %d", k);
    }
    return 0;
}

static void emu_run_op(emu_stream *s, emu_op *op)
{
    emu_dev *d = s->d;
    int rc = 0;
    switch (op->kind) {
    case OP_COPY: {
        int64_t t0 = mf_now_ns();
        if (op->u.copy.k == MF_DEV_H2D && atomic_load(&d->fail_h2d) > 0 &&
            atomic_fetch_sub(&d->fail_h2d, 1) == 1) {
            memcpy(op->u.copy.dst, op->u.copy.src, op->u.copy.n / 2);   /* a partial copy */
            rc = mf_error(-EIO, "injected failure of a host-to-device copy of %zu bytes (fail_h2d): "
                          "%zu bytes copied", op->u.copy.n, op->u.copy.n / 2);
            break;
        }
        memcpy(op->u.copy.dst, op->u.copy.src, op->u.copy.n);
        double model_ns = (double)d->lat_ns;
        if (d->bw_bytes_per_s > 0) model_ns += (double)op->u.copy.n / d->bw_bytes_per_s * 1e9;
        emu_sleep_until(t0 + (int64_t)model_ns);
        break;
    }
    case OP_COPY_2D: {   /* one modelled copy of the rows' bytes */
        int64_t t0 = mf_now_ns();
        for (size_t i = 0; i < op->u.copy_2d.height; i++)
            memcpy((char *)op->u.copy_2d.dst + i * op->u.copy_2d.dpitch,
                   (const char *)op->u.copy_2d.src + i * op->u.copy_2d.spitch, op->u.copy_2d.width);
        double model_ns = (double)d->lat_ns;
        if (d->bw_bytes_per_s > 0)
            model_ns += (double)(op->u.copy_2d.width * op->u.copy_2d.height) / d->bw_bytes_per_s * 1e9;
        emu_sleep_until(t0 + (int64_t)model_ns);
        break;
    }
    case OP_CALLBACK:
        if (atomic_load(&d->lose_cb) > 0 && atomic_fetch_sub(&d->lose_cb, 1) == 1) {
            break;   /* lost: its work is done, but nobody hears of it */
        } else if (op->u.cb.fn_status) {   /* takes the stream's undelivered error, if any */
            pthread_mutex_lock(&s->mu);
            int err = s->err;
            if (err) snprintf(s->cb_msg, sizeof s->cb_msg, "%s", s->errmsg);
            s->err = 0;
            pthread_mutex_unlock(&s->mu);
            op->u.cb.fn_status(op->u.cb.arg, err, err ? s->cb_msg : NULL);
        } else {
            op->u.cb.fn(op->u.cb.arg);
        }
        break;
    case OP_RECORD: {
        emu_event *e = op->u.ev.e;
        pthread_mutex_lock(&e->mu);
        if (op->u.ev.seq > e->reached) {
            e->reached = op->u.ev.seq;
            e->reached_ns = mf_now_ns();
        }
        e->refs--;
        pthread_cond_broadcast(&e->cond);
        pthread_mutex_unlock(&e->mu);
        break;
    }
    case OP_WAIT: {
        emu_event *e = op->u.ev.e;
        pthread_mutex_lock(&e->mu);
        while (e->reached < op->u.ev.seq) pthread_cond_wait(&e->cond, &e->mu);
        pthread_mutex_unlock(&e->mu);
        emu_event_unref(e);
        break;
    }
    case OP_FP4:
        rc = emu_fp4(&op->u.mm.w, op->u.mm.x, op->u.mm.n_tok, op->u.mm.y, op->u.mm.q8,
                     op->u.mm.w.n_in);
        break;
    case OP_FP8:
        rc = mf_kern_fp8_matmul(op->u.mm.w.w, op->u.mm.w.scale, op->u.mm.w.n_out, op->u.mm.w.n_in,
                                op->u.mm.x, op->u.mm.n_tok, op->u.mm.w.n_in, op->u.mm.y,
                                op->u.mm.w.n_out, 0, op->u.mm.w.n_out);
        break;
    case OP_BF16:
        rc = mf_kern_bf16_matmul((const uint16_t *)op->u.mm.w.w, op->u.mm.w.n_out, op->u.mm.w.n_in, op->u.mm.x,
                                 op->u.mm.n_tok, op->u.mm.w.n_in, op->u.mm.y, op->u.mm.w.n_out, 0, op->u.mm.w.n_out);
        break;
    case OP_FFN:
        rc = emu_ffn(&op->u.ffn);
        break;
    case OP_FFN_TABLE:
        rc = emu_ffn_table(&op->u.tab);
        break;
    case OP_LIN:
        rc = op->u.lin.path == MF_DEV_LIN_CUBLASLT ? mf_lt_host_linear(&op->u.lin, &s->lt)
                                                   : mf_dense_host_linear(&op->u.lin);
        break;
    case OP_DEQUANT:
        rc = mf_lt_host_dequant(&op->u.dq.w, &op->u.dq.out);
        break;
    case OP_FFN_LT:
        rc = mf_lt_host_ffn(&op->u.flt, &s->lt);
        break;
    case OP_ROUND:
        mf_dense_host_round_bf16(op->u.ew.y, op->u.ew.n_tok, op->u.ew.ld, op->u.ew.n);
        break;
    case OP_CAST:
        mf_dense_host_bf16_cast(op->u.cast.pack, op->u.cast.x, op->u.cast.ld_x, op->u.cast.y, op->u.cast.ld_y,
                                op->u.cast.n_tok, op->u.cast.n);
        break;
    case OP_UP:
        rc = mf_dense_host_ffn_up(&op->u.up);
        break;
    case OP_ATTN:
        rc = mf_dense_host_attn(&op->u.attn, s->attn_scratch);
        break;
    case OP_ISCORE:
        rc = mf_dense_host_iscore(&op->u.isc);
        break;
    case OP_SWIGLU:
        mf_dense_host_swiglu_bf16(op->u.ew.g, op->u.ew.u, op->u.ew.n_tok, op->u.ew.ld, op->u.ew.n, op->u.ew.limit,
                                  op->u.ew.y);
        break;
    }
    if (!rc && s->pub.card == d->bad_card) {   /* fault injection: a wrong first output */
        if (op->kind == OP_FP4 || op->kind == OP_FP8 || op->kind == OP_BF16) op->u.mm.y[0] += 1.0f;
        else if (op->kind == OP_FFN) op->u.ffn.y[0] += 1.0f;
        else if (op->kind == OP_FFN_LT) op->u.flt.y[0] += 1.0f;
        else if (op->kind == OP_LIN) op->u.lin.y[0] += 1.0f;
        else if (op->kind == OP_UP) op->u.up.h[0] += 1.0f;
        else if (op->kind == OP_ATTN) op->u.attn.o[0] += 1.0f;
        else if (op->kind == OP_ISCORE) op->u.isc.score[0] += 1.0;
        else if (op->kind == OP_SWIGLU || op->kind == OP_ROUND) op->u.ew.y[0] += 1.0f;
    }
    if (rc < 0) emu_stream_fail(s, rc);
}

static void *emu_stream_main(void *arg)
{
    emu_stream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (s->head == s->tail && !s->exit) pthread_cond_wait(&s->cond, &s->mu);
        if (s->head == s->tail) break;   /* exit once drained */
        emu_op op = s->ring[s->head % EMU_RING_CAP];
        pthread_mutex_unlock(&s->mu);
        emu_run_op(s, &op);
        pthread_mutex_lock(&s->mu);
        s->head++;   /* retire after running, so sync sees it finished */
        pthread_cond_broadcast(&s->cond);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* Puts op on s's ring (waiting while the ring is full), or records it while s captures. */
static int emu_enqueue(mf_dev_stream *ps, const emu_op *op)
{
    emu_stream *s = (emu_stream *)ps;
    pthread_mutex_lock(&s->mu);
    if (s->capturing) {
        if (s->n_cap == s->max_cap) {
            int m = s->max_cap ? 2 * s->max_cap : 64;
            emu_op *c = realloc(s->cap, sizeof *c * (size_t)m);
            if (!c) {
                pthread_mutex_unlock(&s->mu);
                return mf_error(-ENOMEM, "emu card %d %s stream: out of memory recording a graph",
                                ps->card, emu_stream_name[ps->kind]);
            }
            s->cap = c;
            s->max_cap = m;
        }
        s->cap[s->n_cap++] = *op;
        pthread_mutex_unlock(&s->mu);
        return 0;
    }
    while (s->tail - s->head >= EMU_RING_CAP && !s->exit) pthread_cond_wait(&s->cond, &s->mu);
    if (s->exit) {
        pthread_mutex_unlock(&s->mu);
        return mf_error(-ESHUTDOWN, "emu card %d %s stream: device is closing", ps->card,
                        emu_stream_name[ps->kind]);
    }
    s->ring[s->tail++ % EMU_RING_CAP] = *op;
    pthread_cond_broadcast(&s->cond);
    pthread_mutex_unlock(&s->mu);
    return 0;
}

/* ---- the ops ----------------------------------------------------------------------------------- */

static int emu_alloc(mf_dev *pd, int card, size_t n_bytes, void **out)
{
    emu_dev *d = (emu_dev *)pd;
    emu_card *c = &d->cards[card];
    size_t total = EMU_HDR_BYTES + ((n_bytes + 63) & ~(size_t)63);
    if (total < n_bytes) return mf_error(-ENOMEM, "emu card %d: cannot allocate %zu bytes", card, n_bytes);
    pthread_mutex_lock(&c->mu);
    if (n_bytes > c->cap_bytes - c->used_bytes) {
        uint64_t used = c->used_bytes, cap = c->cap_bytes;
        pthread_mutex_unlock(&c->mu);
        return mf_error(-ENOMEM, "emu card %d: out of device memory: asked %zu bytes, %" PRIu64
                        " of %" PRIu64 " in use", card, n_bytes, used, cap);
    }
    c->used_bytes += n_bytes;
    pthread_mutex_unlock(&c->mu);
    emu_hdr *h = aligned_alloc(64, total);
    if (!h) {
        pthread_mutex_lock(&c->mu);
        c->used_bytes -= n_bytes;
        pthread_mutex_unlock(&c->mu);
        return mf_error(-ENOMEM, "emu card %d: host malloc of %zu bytes failed", card, total);
    }
    h->magic = EMU_ALLOC_MAGIC;
    h->card = card;
    h->n_bytes = n_bytes;
    h->prev = NULL;
    pthread_mutex_lock(&c->mu);
    h->next = c->allocs;
    if (c->allocs) c->allocs->prev = h;
    c->allocs = h;
    pthread_mutex_unlock(&c->mu);
    *out = (char *)h + EMU_HDR_BYTES;
    return 0;
}

static void emu_free(mf_dev *pd, int card, void *p)
{
    emu_dev *d = (emu_dev *)pd;
    emu_hdr *h = (emu_hdr *)((char *)p - EMU_HDR_BYTES);
    if (h->magic != EMU_ALLOC_MAGIC || h->card != card) {
        mf_error(-EINVAL, "mf_dev_free: %p is not an allocation of emu card %d (left alone)", p, card);
        return;
    }
    emu_card *c = &d->cards[card];
    pthread_mutex_lock(&c->mu);
    if (h->prev) h->prev->next = h->next;
    else c->allocs = h->next;
    if (h->next) h->next->prev = h->prev;
    c->used_bytes -= h->n_bytes;
    pthread_mutex_unlock(&c->mu);
    h->magic = 0;
    free(h);
}

/* Staging memory: page-aligned, behind a page holding its header (the list close frees). */
static int emu_host_alloc(mf_dev *pd, int card, size_t n_bytes, void **out)
{
    emu_dev *d = (emu_dev *)pd;
    size_t n = 4096 + ((n_bytes + 4095) & ~(size_t)4095);
    emu_hdr *h = n < n_bytes ? NULL : aligned_alloc(4096, n);
    if (!h) return mf_error(-ENOMEM, "emu card %d: cannot allocate %zu bytes of staging memory",
                            card, n_bytes);
    h->magic = EMU_ALLOC_MAGIC;
    h->card = -1;
    h->n_bytes = n_bytes;
    h->prev = NULL;
    pthread_mutex_lock(&d->host_mu);
    h->next = d->host_allocs;
    if (d->host_allocs) d->host_allocs->prev = h;
    d->host_allocs = h;
    pthread_mutex_unlock(&d->host_mu);
    *out = (char *)h + 4096;
    return 0;
}

static void emu_host_free(mf_dev *pd, void *p)
{
    emu_dev *d = (emu_dev *)pd;
    emu_hdr *h = (emu_hdr *)((char *)p - 4096);
    if (((uintptr_t)p & 4095) || h->magic != EMU_ALLOC_MAGIC || h->card != -1) {
        mf_error(-EINVAL, "mf_dev_host_free: %p is not staging memory of this device (left alone)", p);
        return;
    }
    pthread_mutex_lock(&d->host_mu);
    if (h->prev) h->prev->next = h->next;
    else d->host_allocs = h->next;
    if (h->next) h->next->prev = h->prev;
    pthread_mutex_unlock(&d->host_mu);
    h->magic = 0;
    free(h);
}

static int emu_copy(mf_dev_stream *s, mf_dev_copy_kind k, int dst_card, void *dst, int src_card,
                    const void *src, size_t n_bytes)
{
    (void)dst_card;
    (void)src_card;
    emu_op op = {.kind = OP_COPY, .u.copy = {dst, src, n_bytes, k}};
    return emu_enqueue(s, &op);
}

static int emu_copy_2d(mf_dev_stream *s, mf_dev_copy_kind k, void *dst, size_t dst_pitch, const void *src,
                       size_t src_pitch, size_t width, size_t height)
{
    (void)k;
    emu_op op = {.kind = OP_COPY_2D, .u.copy_2d = {dst, src, dst_pitch, src_pitch, width, height}};
    return emu_enqueue(s, &op);
}

static int emu_event_create(mf_dev *pd, int card, int timed, mf_dev_event **out)
{
    (void)timed;   /* every emulated event keeps its time */
    emu_event *e = calloc(1, sizeof *e);
    if (!e) return mf_error(-ENOMEM, "emu card %d: out of memory for an event", card);
    e->pub.dev = pd;
    e->pub.card = card;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cond, NULL);
    *out = &e->pub;
    return 0;
}

/* Waits until no enqueued operation names e any more, then frees it. */
static void emu_event_destroy(mf_dev_event *pe)
{
    emu_event *e = (emu_event *)pe;
    pthread_mutex_lock(&e->mu);
    while (e->refs > 0) pthread_cond_wait(&e->cond, &e->mu);
    pthread_mutex_unlock(&e->mu);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cond);
    free(e);
}

static int emu_event_op(mf_dev_stream *s, mf_dev_event *pe, emu_op_kind kind)
{
    emu_event *e = (emu_event *)pe;
    pthread_mutex_lock(&e->mu);
    uint64_t seq = kind == OP_RECORD ? ++e->recorded : e->recorded;
    e->refs++;
    pthread_mutex_unlock(&e->mu);
    emu_op op = {.kind = kind, .u.ev = {e, seq}};
    int rc = emu_enqueue(s, &op);
    if (rc) emu_event_unref(e);   /* a lost record is never reached: closing anyway */
    return rc;
}

static int emu_event_record(mf_dev_event *e, mf_dev_stream *s) { return emu_event_op(s, e, OP_RECORD); }

/* Waits until e's last record has run; its time, or -EINVAL when it was never recorded. */
static int emu_event_time(emu_event *e, int64_t *t)
{
    pthread_mutex_lock(&e->mu);
    while (e->reached < e->recorded) pthread_cond_wait(&e->cond, &e->mu);
    int ok = e->recorded > 0;
    *t = e->reached_ns;
    pthread_mutex_unlock(&e->mu);
    return ok ? 0 : mf_error(-EINVAL, "mf_dev_event_elapsed_ns: emu card %d: an event never recorded",
                             e->pub.card);
}

static int emu_event_elapsed(mf_dev_event *start, mf_dev_event *end, int64_t *out_ns)
{
    int64_t t0 = 0, t1 = 0;
    int rc = emu_event_time((emu_event *)end, &t1);
    if (!rc) rc = emu_event_time((emu_event *)start, &t0);
    if (!rc) *out_ns = t1 - t0;
    return rc;
}
static int emu_stream_wait(mf_dev_stream *s, mf_dev_event *e) { return emu_event_op(s, e, OP_WAIT); }

static int emu_callback(mf_dev_stream *s, void (*fn)(void *), void *arg)
{
    emu_op op = {.kind = OP_CALLBACK, .u.cb = {fn, NULL, arg}};
    return emu_enqueue(s, &op);
}

static int emu_callback_status(mf_dev_stream *s, void (*fn)(void *, int, const char *), void *arg)
{
    emu_op op = {.kind = OP_CALLBACK, .u.cb = {NULL, fn, arg}};
    return emu_enqueue(s, &op);
}

static int emu_stream_sync(mf_dev_stream *ps)
{
    emu_stream *s = (emu_stream *)ps;
    pthread_mutex_lock(&s->mu);
    unsigned until = s->tail;
    while ((int)(s->head - until) < 0) pthread_cond_wait(&s->cond, &s->mu);
    int rc = s->err;
    if (rc) mf_error(rc, "%s", s->errmsg);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static int emu_fp4_matmul(mf_dev_stream *s, const mf_kern_mat *w, const float *x, int n_tok,
                          float *y, void *q8)
{
    emu_op op = {.kind = OP_FP4, .u.mm = {*w, x, n_tok, y, q8}};
    return emu_enqueue(s, &op);
}

static int emu_fp8_matmul(mf_dev_stream *s, const mf_kern_mat *w, const float *x, int n_tok, float *y)
{
    emu_op op = {.kind = OP_FP8, .u.mm = {*w, x, n_tok, y, NULL}};
    return emu_enqueue(s, &op);
}

static int emu_bf16_matmul(mf_dev_stream *s, const mf_kern_mat *w, const float *x, int n_tok, float *y)
{
    emu_op op = {.kind = OP_BF16, .u.mm = {*w, x, n_tok, y, NULL}};
    return emu_enqueue(s, &op);
}

static int emu_expert_ffn(mf_dev_stream *s, const mf_dev_ffn *a)
{
    emu_op op = {.kind = OP_FFN, .u.ffn = *a};
    return emu_enqueue(s, &op);
}

static int emu_expert_ffn_table(mf_dev_stream *s, const mf_dev_ffn_table *a)
{
    emu_op op = {.kind = OP_FFN_TABLE, .u.tab = *a};
    return emu_enqueue(s, &op);
}

static int emu_linear(mf_dev_stream *s, const mf_dev_lin *a)
{
    emu_op op = {.kind = OP_LIN, .u.lin = *a};
    return emu_enqueue(s, &op);
}

static int emu_dequant(mf_dev_stream *s, const mf_kern_mat *w, const mf_dev_w16 *out)
{
    emu_op op = {.kind = OP_DEQUANT, .u.dq = {*w, *out}};
    return emu_enqueue(s, &op);
}

static int emu_expert_ffn_lt(mf_dev_stream *s, const mf_dev_ffn_lt *a)
{
    emu_op op = {.kind = OP_FFN_LT, .u.flt = *a};
    return emu_enqueue(s, &op);
}

static int emu_round_bf16(mf_dev_stream *s, float *y, int n_tok, int64_t ld, int n)
{
    emu_op op = {.kind = OP_ROUND, .u.ew = {.y = y, .n_tok = n_tok, .n = n, .ld = ld}};
    return emu_enqueue(s, &op);
}

static int emu_bf16_cast(mf_dev_stream *s, int pack, float *x, int64_t ld_x, uint16_t *y, int64_t ld_y, int n_tok,
                         int n)
{
    emu_op op = {.kind = OP_CAST, .u.cast = {x, y, ld_x, ld_y, n_tok, n, pack}};
    return emu_enqueue(s, &op);
}

static int emu_ffn_up(mf_dev_stream *s, const mf_dev_up *a)
{
    emu_op op = {.kind = OP_UP, .u.up = *a};
    return emu_enqueue(s, &op);
}

static int emu_swiglu_bf16(mf_dev_stream *s, const float *g, const float *u, int n_tok, int64_t ld, int n,
                           float limit, float *h)
{
    emu_op op = {.kind = OP_SWIGLU, .u.ew = {g, u, h, n_tok, n, ld, limit}};
    return emu_enqueue(s, &op);
}

static int emu_attn_heads(mf_dev_stream *s, const mf_dev_attn *a)
{
    emu_op op = {.kind = OP_ATTN, .u.attn = *a};
    return emu_enqueue(s, &op);
}

static int emu_index_scores(mf_dev_stream *s, const mf_dev_iscore *a)
{
    emu_op op = {.kind = OP_ISCORE, .u.isc = *a};
    return emu_enqueue(s, &op);
}

static int emu_capture_begin(mf_dev_stream *ps)
{
    emu_stream *s = (emu_stream *)ps;
    pthread_mutex_lock(&s->mu);
    s->capturing = 1;
    s->n_cap = 0;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

static int emu_capture_end(mf_dev_stream *ps, mf_dev_graph **out)
{
    emu_stream *s = (emu_stream *)ps;
    emu_graph *g = calloc(1, sizeof *g);
    pthread_mutex_lock(&s->mu);
    s->capturing = 0;
    if (g) {
        g->pub = (mf_dev_graph){.dev = ps->dev, .card = ps->card};
        g->ops = s->cap;   /* the recording becomes the graph's */
        g->n_ops = s->n_cap;
        s->cap = NULL;
        s->n_cap = s->max_cap = 0;
    }
    pthread_mutex_unlock(&s->mu);
    if (!g) return mf_error(-ENOMEM, "emu card %d: out of memory for a graph", ps->card);
    *out = &g->pub;
    return 0;
}

static int emu_graph_launch(mf_dev_graph *pg, mf_dev_stream *s)
{
    emu_graph *g = (emu_graph *)pg;
    for (int i = 0; i < g->n_ops; i++) {
        int rc = emu_enqueue(s, &g->ops[i]);
        if (rc) return rc;
    }
    return 0;
}

static void emu_graph_destroy(mf_dev_graph *pg)
{
    emu_graph *g = (emu_graph *)pg;
    free(g->ops);
    free(g);
}

static void emu_close(mf_dev *pd)
{
    emu_dev *d = (emu_dev *)pd;
    for (int c = 0; c < pd->n_cards; c++)
        for (int k = 0; k < MF_DEV_N_STREAMS; k++) {
            emu_stream *s = d->streams[c][k];
            if (!s) continue;
            if (s->started) {
                pthread_mutex_lock(&s->mu);
                s->exit = 1;   /* the worker drains what is queued, then leaves */
                pthread_cond_broadcast(&s->cond);
                pthread_mutex_unlock(&s->mu);
                pthread_join(s->thread, NULL);
            }
            pthread_mutex_destroy(&s->mu);
            pthread_cond_destroy(&s->cond);
            free(s->cap);
            mf_lt_host_scratch_free(&s->lt);
            free(s);
        }
    for (int c = 0; c < pd->n_cards; c++) {
        for (emu_hdr *h = d->cards[c].allocs, *nx; h; h = nx) {
            nx = h->next;
            free(h);
        }
        pthread_mutex_destroy(&d->cards[c].mu);
    }
    for (emu_hdr *h = d->host_allocs, *nx; h; h = nx) {
        nx = h->next;
        free(h);
    }
    pthread_mutex_destroy(&d->host_mu);
    free(d);
}

static const mf_dev_ops emu_ops = {
    .kind = "emu",
    .close = emu_close,
    .alloc = emu_alloc,
    .free = emu_free,
    .host_alloc = emu_host_alloc,
    .host_free = emu_host_free,
    .copy = emu_copy,
    .event_create = emu_event_create,
    .event_destroy = emu_event_destroy,
    .event_record = emu_event_record,
    .stream_wait = emu_stream_wait,
    .event_elapsed = emu_event_elapsed,
    .callback = emu_callback,
    .callback_status = emu_callback_status,
    .stream_sync = emu_stream_sync,
    .fp4_matmul = emu_fp4_matmul,
    .fp8_matmul = emu_fp8_matmul,
    .bf16_matmul = emu_bf16_matmul,
    .expert_ffn = emu_expert_ffn,
    .expert_ffn_table = emu_expert_ffn_table,
    .linear = emu_linear,
    .round_bf16 = emu_round_bf16,
    .bf16_cast = emu_bf16_cast,
    .ffn_up = emu_ffn_up,
    .swiglu_bf16 = emu_swiglu_bf16,
    .attn_heads = emu_attn_heads,
    .index_scores = emu_index_scores,
    .dequant = emu_dequant,
    .expert_ffn_lt = emu_expert_ffn_lt,
    .capture_begin = emu_capture_begin,
    .capture_end = emu_capture_end,
    .graph_launch = emu_graph_launch,
    .graph_destroy = emu_graph_destroy,
    .copy_2d = emu_copy_2d,
};

/* ---- opening --------------------------------------------------------------------------------- */

/* "16G", "64M", "4096": a byte count with an optional K/M/G suffix (powers of 1024). */
static int emu_parse_bytes(const char *v, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long n = strtoull(v, &end, 10);
    if (end == v || errno) return -1;
    uint64_t mul = 1;
    if (*end == 'K' || *end == 'k') mul = 1ULL << 10, end++;
    else if (*end == 'M' || *end == 'm') mul = 1ULL << 20, end++;
    else if (*end == 'G' || *end == 'g') mul = 1ULL << 30, end++;
    if (*end) return -1;
    *out = (uint64_t)n * mul;
    return 0;
}

int mf_dev_open_emu(const char *opts, mf_dev **out)
{
    char buf[256];
    if (strlen(opts) >= sizeof buf) return mf_error(-EINVAL, "device spec 'emu:%.32s...' is too long", opts);
    snprintf(buf, sizeof buf, "%s", opts);
    char *save = NULL, *tok = strtok_r(buf, ",", &save);
    char *end;
    long n = tok ? strtol(tok, &end, 10) : 0;
    if (!tok || *end || n < 1 || n > MF_DEV_MAX_CARDS)
        return mf_error(-EINVAL, "device spec 'emu:%s': expected a card count 1..%d after 'emu:'",
                        opts, MF_DEV_MAX_CARDS);
    uint64_t mem = 16ULL << 30;
    double bw = 25e9, lat = 10000, fail_h2d = 0, lose_cb = 0, bad_card = -1;
    mf_dev_f16 tc = MF_DEV_F16_BF16;
    while ((tok = strtok_r(NULL, ",", &save))) {
        char *eq = strchr(tok, '=');
        int bad = !eq;
        if (eq) {
            *eq = 0;
            const char *v = eq + 1;
            if (!strcmp(tok, "mem")) bad = emu_parse_bytes(v, &mem) || mem == 0;
            else if (!strcmp(tok, "bw")) bad = (bw = strtod(v, &end)) < 0 || *end || end == v;
            else if (!strcmp(tok, "lat_ns")) bad = (lat = strtod(v, &end)) < 0 || *end || end == v;
            else if (!strcmp(tok, "fail_h2d"))
                bad = (fail_h2d = strtod(v, &end)) < 0 || *end || end == v || fail_h2d != (int64_t)fail_h2d;
            else if (!strcmp(tok, "lose_cb"))
                bad = (lose_cb = strtod(v, &end)) < 0 || *end || end == v || lose_cb != (int64_t)lose_cb;
            else if (!strcmp(tok, "tc"))
                bad = !strcmp(v, "bf16") ? (tc = MF_DEV_F16_BF16, 0) : !strcmp(v, "fp16") ? (tc = MF_DEV_F16_FP16, 0)
                      : !strcmp(v, "none") ? (tc = MF_DEV_F16_NONE, 0) : 1;
            else if (!strcmp(tok, "bad_card"))
                bad = (bad_card = strtod(v, &end)) < 0 || *end || end == v || bad_card != (int)bad_card ||
                      bad_card >= n;
            else bad = 1;
            if (!bad) continue;
            *eq = '=';
        }
        return mf_error(-EINVAL, "device spec 'emu:%s': bad option '%s' (expected mem=BYTES[K|M|G], "
                        "bw=BYTES_PER_S, lat_ns=NS, fail_h2d=N, lose_cb=N, bad_card=C, tc=bf16|fp16|none)", opts, tok);
    }
    emu_dev *d = calloc(1, sizeof *d);
    if (!d) return mf_error(-ENOMEM, "emu device: out of memory");
    d->pub.ops = &emu_ops;
    d->pub.n_cards = (int)n;
    d->bw_bytes_per_s = bw;
    d->lat_ns = (int64_t)lat;
    atomic_init(&d->fail_h2d, (int64_t)fail_h2d);
    atomic_init(&d->lose_cb, (int64_t)lose_cb);
    d->bad_card = (int)bad_card;
    pthread_mutex_init(&d->host_mu, NULL);
    for (int c = 0; c < n; c++) {
        pthread_mutex_init(&d->cards[c].mu, NULL);
        d->cards[c].cap_bytes = mem;
        d->pub.f16[c] = tc;
    }
    int rc = 0;
    for (int c = 0; c < n && !rc; c++)
        for (int k = 0; k < MF_DEV_N_STREAMS && !rc; k++) {
            emu_stream *s = calloc(1, sizeof *s);
            if (!s) {
                rc = mf_error(-ENOMEM, "emu device: out of memory for streams");
                break;
            }
            s->pub = (mf_dev_stream){.dev = &d->pub, .card = c, .kind = (mf_dev_stream_kind)k};
            s->d = d;
            pthread_mutex_init(&s->mu, NULL);
            pthread_cond_init(&s->cond, NULL);
            d->streams[c][k] = s;
            d->pub.streams[c][k] = &s->pub;
            if (pthread_create(&s->thread, NULL, emu_stream_main, s))
                rc = mf_error(-EAGAIN, "emu card %d: cannot start a stream thread", c);
            else
                s->started = 1;
        }
    if (rc) {
        emu_close(&d->pub);
        return rc;
    }
    *out = &d->pub;
    return 0;
}

int64_t mf_dev_emu_used_bytes(const mf_dev *pd, int card)
{
    if (!pd || pd->ops != &emu_ops || card < 0 || card >= pd->n_cards) return -1;
    emu_card *c = &((emu_dev *)pd)->cards[card];
    pthread_mutex_lock(&c->mu);
    int64_t used = (int64_t)c->used_bytes;
    pthread_mutex_unlock(&c->mu);
    return used;
}

int mf_dev_emu_fail_h2d(mf_dev *pd, int64_t nth)
{
    if (!pd || pd->ops != &emu_ops || nth < 0)
        return mf_error(-EINVAL, "mf_dev_emu_fail_h2d: %s", nth < 0 ? "negative count" : "not an emulated device");
    atomic_store(&((emu_dev *)pd)->fail_h2d, nth);
    return 0;
}
