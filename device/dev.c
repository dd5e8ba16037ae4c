/* The device interface's front: opens a backend by spec, checks every argument once (so backends
 * only do the work), dispatches through the ops table, and adapts a device to the scheduler's
 * device lanes (mf_dev_lane_ops). */
#include <errno.h>
#include <string.h>

#include "device/dev_impl.h"
#include "device/kern_lt.h"
#include "sched/error.h"

int mf_dev_open(const char *spec, mf_dev **out)
{
    if (!out) return mf_error(-EINVAL, "mf_dev_open: out is NULL");
    *out = NULL;
    if (!spec) return mf_error(-EINVAL, "mf_dev_open: spec is NULL (expected \"emu:N\" or \"cuda\")");
    if (!strncmp(spec, "emu:", 4)) return mf_dev_open_emu(spec + 4, out);
    if (!strcmp(spec, "cuda")) return mf_dev_open_cuda(NULL, out);
    if (!strncmp(spec, "cuda:", 5)) return mf_dev_open_cuda(spec + 5, out);
    return mf_error(-EINVAL, "device spec '%s': expected \"emu:N[,mem=..][,bw=..][,lat_ns=..]\", "
                    "\"cuda\" or \"cuda:I,J\"", spec);
}

void mf_dev_close(mf_dev *d)
{
    if (d) d->ops->close(d);
}

int mf_dev_n_cards(const mf_dev *d) { return d ? d->n_cards : 0; }
const char *mf_dev_kind(const mf_dev *d) { return d ? d->ops->kind : "none"; }

static int mf_dev_card_ok(const mf_dev *d, int card, const char *what)
{
    if (!d) return mf_error(-EINVAL, "%s: device is NULL", what);
    if (card < 0 || card >= d->n_cards)
        return mf_error(-EINVAL, "%s: card %d out of range (device has %d)", what, card, d->n_cards);
    return 0;
}

int mf_dev_alloc(mf_dev *d, int card, size_t n_bytes, void **out)
{
    int rc = mf_dev_card_ok(d, card, "mf_dev_alloc");
    if (rc) return rc;
    if (!out) return mf_error(-EINVAL, "mf_dev_alloc: out is NULL");
    *out = NULL;
    if (n_bytes == 0) return mf_error(-EINVAL, "mf_dev_alloc: card %d: size 0", card);
    return d->ops->alloc(d, card, n_bytes, out);
}

void mf_dev_free(mf_dev *d, int card, void *p)
{
    if (p && !mf_dev_card_ok(d, card, "mf_dev_free")) d->ops->free(d, card, p);
}

int mf_dev_host_alloc(mf_dev *d, int card, size_t n_bytes, void **out)
{
    int rc = mf_dev_card_ok(d, card, "mf_dev_host_alloc");
    if (rc) return rc;
    if (!out) return mf_error(-EINVAL, "mf_dev_host_alloc: out is NULL");
    *out = NULL;
    if (n_bytes == 0) return mf_error(-EINVAL, "mf_dev_host_alloc: card %d: size 0", card);
    return d->ops->host_alloc(d, card, n_bytes, out);
}

void mf_dev_host_free(mf_dev *d, void *p)
{
    if (d && p) d->ops->host_free(d, p);
}

mf_dev_stream *mf_dev_stream_of(mf_dev *d, int card, mf_dev_stream_kind kind)
{
    if (!d || card < 0 || card >= d->n_cards || (int)kind < 0 || kind >= MF_DEV_N_STREAMS)
        return NULL;
    return d->streams[card][kind];
}

int mf_dev_stream_card(const mf_dev_stream *s) { return s ? s->card : -1; }

static int mf_dev_copy_ok(mf_dev_stream *s, const void *dst, const void *src, const char *what)
{
    if (!s) return mf_error(-EINVAL, "%s: stream is NULL", what);
    if (!dst || !src) return mf_error(-EINVAL, "%s: card %d: NULL %s", what, s->card,
                                      !dst ? "destination" : "source");
    return 0;
}

int mf_dev_copy_h2d(mf_dev_stream *s, void *dst_dev, const void *src_host, size_t n_bytes)
{
    int rc = mf_dev_copy_ok(s, dst_dev, src_host, "mf_dev_copy_h2d");
    if (rc || !n_bytes) return rc;
    return s->dev->ops->copy(s, MF_DEV_H2D, s->card, dst_dev, -1, src_host, n_bytes);
}

int mf_dev_copy_d2h(mf_dev_stream *s, void *dst_host, const void *src_dev, size_t n_bytes)
{
    int rc = mf_dev_copy_ok(s, dst_host, src_dev, "mf_dev_copy_d2h");
    if (rc || !n_bytes) return rc;
    return s->dev->ops->copy(s, MF_DEV_D2H, -1, dst_host, s->card, src_dev, n_bytes);
}

int mf_dev_copy_d2d(mf_dev_stream *s, int dst_card, void *dst, int src_card, const void *src,
                    size_t n_bytes)
{
    int rc = mf_dev_copy_ok(s, dst, src, "mf_dev_copy_d2d");
    if (!rc) rc = mf_dev_card_ok(s->dev, dst_card, "mf_dev_copy_d2d: destination");
    if (!rc) rc = mf_dev_card_ok(s->dev, src_card, "mf_dev_copy_d2d: source");
    if (rc || !n_bytes) return rc;
    return s->dev->ops->copy(s, MF_DEV_D2D, dst_card, dst, src_card, src, n_bytes);
}

/* A 2D copy of kind k (H2D or D2H): the backend's, or a copy per row. */
static int mf_dev_copy_2d(mf_dev_stream *s, mf_dev_copy_kind k, void *dst, size_t dst_pitch, const void *src,
                          size_t src_pitch, size_t width, size_t height, const char *what)
{
    int rc = mf_dev_copy_ok(s, dst, src, what);
    if (rc) return rc;
    if (dst_pitch < width || src_pitch < width)
        return mf_error(-EINVAL, "%s: card %d: pitches %zu, %zu below the width %zu", what, s->card, dst_pitch,
                        src_pitch, width);
    if (!width || !height) return 0;
    if (height == 1 || (dst_pitch == width && src_pitch == width))
        return s->dev->ops->copy(s, k, k == MF_DEV_H2D ? s->card : -1, dst, k == MF_DEV_D2H ? s->card : -1, src,
                                 width * height);
    if (s->dev->ops->copy_2d) return s->dev->ops->copy_2d(s, k, dst, dst_pitch, src, src_pitch, width, height);
    for (size_t i = 0; i < height && !rc; i++)
        rc = s->dev->ops->copy(s, k, k == MF_DEV_H2D ? s->card : -1, (char *)dst + i * dst_pitch,
                               k == MF_DEV_D2H ? s->card : -1, (const char *)src + i * src_pitch, width);
    return rc;
}

int mf_dev_copy_h2d_2d(mf_dev_stream *s, void *dst_dev, size_t dst_pitch, const void *src_host, size_t src_pitch,
                       size_t width, size_t height)
{
    return mf_dev_copy_2d(s, MF_DEV_H2D, dst_dev, dst_pitch, src_host, src_pitch, width, height, "mf_dev_copy_h2d_2d");
}

int mf_dev_copy_d2h_2d(mf_dev_stream *s, void *dst_host, size_t dst_pitch, const void *src_dev, size_t src_pitch,
                       size_t width, size_t height)
{
    return mf_dev_copy_2d(s, MF_DEV_D2H, dst_host, dst_pitch, src_dev, src_pitch, width, height, "mf_dev_copy_d2h_2d");
}

static int mf_dev_event_make(mf_dev *d, int card, int timed, mf_dev_event **out)
{
    int rc = mf_dev_card_ok(d, card, "mf_dev_event_create");
    if (rc) return rc;
    if (!out) return mf_error(-EINVAL, "mf_dev_event_create: out is NULL");
    *out = NULL;
    rc = d->ops->event_create(d, card, timed, out);
    if (!rc) (*out)->timed = timed;
    return rc;
}

int mf_dev_event_create(mf_dev *d, int card, mf_dev_event **out) { return mf_dev_event_make(d, card, 0, out); }
int mf_dev_event_create_timed(mf_dev *d, int card, mf_dev_event **out) { return mf_dev_event_make(d, card, 1, out); }

int mf_dev_event_elapsed_ns(mf_dev_event *start, mf_dev_event *end, int64_t *out_ns)
{
    if (!start || !end || !out_ns) return mf_error(-EINVAL, "mf_dev_event_elapsed_ns: NULL argument");
    if (!start->timed || !end->timed)
        return mf_error(-EINVAL, "mf_dev_event_elapsed_ns: the %s event was not made by "
                        "mf_dev_event_create_timed", !start->timed ? "start" : "end");
    if (start->dev != end->dev || start->card != end->card)
        return mf_error(-EINVAL, "mf_dev_event_elapsed_ns: events of different cards (%d, %d)",
                        start->card, end->card);
    return start->dev->ops->event_elapsed(start, end, out_ns);
}

void mf_dev_event_destroy(mf_dev_event *e)
{
    if (e) e->dev->ops->event_destroy(e);
}

int mf_dev_event_record(mf_dev_event *e, mf_dev_stream *s)
{
    if (!e || !s) return mf_error(-EINVAL, "mf_dev_event_record: NULL %s", !e ? "event" : "stream");
    if (e->dev != s->dev) return mf_error(-EINVAL, "mf_dev_event_record: event and stream belong "
                                          "to different devices");
    if (e->card != s->card)
        return mf_error(-EINVAL, "mf_dev_event_record: an event of card %d recorded on a stream of "
                        "card %d (record on the event's own card; any card may wait on it)",
                        e->card, s->card);
    if (s->capturing)
        return mf_error(-EBUSY, "mf_dev_event_record: card %d's stream is capturing (events are "
                        "not captured)", s->card);
    return s->dev->ops->event_record(e, s);
}

int mf_dev_stream_wait(mf_dev_stream *s, mf_dev_event *e)
{
    if (!e || !s) return mf_error(-EINVAL, "mf_dev_stream_wait: NULL %s", !e ? "event" : "stream");
    if (e->dev != s->dev) return mf_error(-EINVAL, "mf_dev_stream_wait: event and stream belong "
                                          "to different devices");
    if (s->capturing)
        return mf_error(-EBUSY, "mf_dev_stream_wait: card %d's stream is capturing (events are "
                        "not captured)", s->card);
    return s->dev->ops->stream_wait(s, e);
}

int mf_dev_stream_callback(mf_dev_stream *s, void (*fn)(void *arg), void *arg)
{
    if (!s || !fn) return mf_error(-EINVAL, "mf_dev_stream_callback: NULL %s",
                                   !s ? "stream" : "function");
    return s->dev->ops->callback(s, fn, arg);
}

int mf_dev_stream_callback_status(mf_dev_stream *s, void (*fn)(void *arg, int err, const char *msg),
                                  void *arg)
{
    if (!s || !fn) return mf_error(-EINVAL, "mf_dev_stream_callback_status: NULL %s",
                                   !s ? "stream" : "function");
    if (!s->dev->ops->callback_status)
        return mf_error(-ENOTSUP, "mf_dev_stream_callback_status: the %s backend does not attribute "
                        "asynchronous errors to callbacks (they surface at the next sync)",
                        s->dev->ops->kind);
    return s->dev->ops->callback_status(s, fn, arg);
}

int mf_dev_stream_sync(mf_dev_stream *s)
{
    if (!s) return mf_error(-EINVAL, "mf_dev_stream_sync: stream is NULL");
    if (s->capturing)
        return mf_error(-EBUSY, "mf_dev_stream_sync: card %d's stream is capturing", s->card);
    return s->dev->ops->stream_sync(s);
}

int mf_dev_sync(mf_dev *d)
{
    if (!d) return mf_error(-EINVAL, "mf_dev_sync: device is NULL");
    int first = 0;
    for (int c = 0; c < d->n_cards; c++)
        for (int k = 0; k < MF_DEV_N_STREAMS; k++) {
            if (d->streams[c][k]->capturing) continue;
            int rc = d->ops->stream_sync(d->streams[c][k]);
            if (rc && !first) first = rc;
        }
    return first;
}

/* ---- kernels: shapes checked here, once for every backend ----------------------------------- */

static int mf_dev_mat_ok(const mf_kern_mat *w, mf_kern_fmt want, const char *what, const char *name)
{
    if (!w) return mf_error(-EINVAL, "%s: %s is NULL", what, name);
    if (w->fmt != want && !(want == 0 && (w->fmt == MF_KERN_FP4 || w->fmt == MF_KERN_FP8)))
        return mf_error(-EINVAL, "%s: %s has format %d, expected %s", what, name, (int)w->fmt,
                        want == MF_KERN_FP4 ? "FP4" : want == MF_KERN_FP8 ? "FP8" : "FP4 or FP8");
    if (!w->w || !w->scale) return mf_error(-EINVAL, "%s: %s: NULL weights or scales", what, name);
    if (w->n_out < 1 || w->n_in < 32 || w->n_in % 32)
        return mf_error(-EINVAL, "%s: %s is [%d, %d]; expected n_out >= 1 and n_in a positive "
                        "multiple of 32", what, name, w->n_out, w->n_in);
    return 0;
}

int mf_dev_fp4_matmul(mf_dev_stream *s, const mf_kern_mat *w, const float *x, int n_tok, float *y,
                      void *q8_scratch)
{
    static const char *what = "mf_dev_fp4_matmul";
    if (!s) return mf_error(-EINVAL, "%s: stream is NULL", what);
    int rc = mf_dev_mat_ok(w, MF_KERN_FP4, what, "w");
    if (rc) return rc;
    if (!x || !y || n_tok < 1)
        return mf_error(-EINVAL, "%s: card %d: NULL x or y, or n_tok %d < 1", what, s->card, n_tok);
    return s->dev->ops->fp4_matmul(s, w, x, n_tok, y, q8_scratch);
}

int mf_dev_fp8_matmul(mf_dev_stream *s, const mf_kern_mat *w, const float *x, int n_tok, float *y)
{
    static const char *what = "mf_dev_fp8_matmul";
    if (!s) return mf_error(-EINVAL, "%s: stream is NULL", what);
    int rc = mf_dev_mat_ok(w, MF_KERN_FP8, what, "w");
    if (rc) return rc;
    if (!x || !y || n_tok < 1)
        return mf_error(-EINVAL, "%s: card %d: NULL x or y, or n_tok %d < 1", what, s->card, n_tok);
    return s->dev->ops->fp8_matmul(s, w, x, n_tok, y);
}

int mf_dev_bf16_matmul(mf_dev_stream *s, const mf_kern_mat *w, const float *x, int n_tok, float *y)
{
    static const char *what = "mf_dev_bf16_matmul";
    if (!s) return mf_error(-EINVAL, "%s: stream is NULL", what);
    if (!w || w->fmt != MF_KERN_BF16 || !w->w || w->n_out < 1 || w->n_in < 32 || w->n_in % 32)
        return mf_error(-EINVAL, "%s: w must be a BF16 matrix [n_out >= 1, n_in a positive multiple of 32] "
                        "with weights (found %s)", what, !w ? "NULL" : w->fmt != MF_KERN_BF16 ? "another format"
                                                                   : !w->w ? "NULL weights" : "a bad shape");
    if (!x || !y || n_tok < 1)
        return mf_error(-EINVAL, "%s: card %d: NULL x or y, or n_tok %d < 1", what, s->card, n_tok);
    return s->dev->ops->bf16_matmul(s, w, x, n_tok, y);
}

/* A dense weight slice: FP8 (with scales) or BF16, n_out >= 1, n_in a positive multiple of 32. */
static int mf_dev_dense_mat_ok(const mf_kern_mat *w, const char *what, const char *name)
{
    if (w->fmt != MF_KERN_FP8 && w->fmt != MF_KERN_BF16)
        return mf_error(-EINVAL, "%s: %s has format %d, expected FP8 or BF16", what, name, (int)w->fmt);
    if (!w->w || (w->fmt == MF_KERN_FP8 && !w->scale))
        return mf_error(-EINVAL, "%s: %s: NULL weights or scales", what, name);
    if (w->n_out < 1 || w->n_in < 32 || w->n_in % 32)
        return mf_error(-EINVAL, "%s: %s is [%d, %d]; expected n_out >= 1 and n_in a positive multiple of 32",
                        what, name, w->n_out, w->n_in);
    return 0;
}

static int mf_dev_path_check(const char *what, mf_dev_lin_path p, int lt_ok)
{
    if (p == MF_DEV_LIN_AUTO || p == MF_DEV_LIN_ROWS || p == MF_DEV_LIN_TILED || (lt_ok && p == MF_DEV_LIN_CUBLASLT))
        return 0;
    return mf_error(-EINVAL, "%s: path %d (expected MF_DEV_LIN_AUTO, _ROWS, _TILED%s)", what, (int)p,
                    lt_ok ? " or _CUBLASLT" : "");
}

/* ---- the cuBLASLt path: checks shared by its ops ---------------------------------------------- */

mf_dev_f16 mf_dev_card_f16(const mf_dev *d, int card)
{
    return d && card >= 0 && card < d->n_cards ? d->f16[card] : MF_DEV_F16_NONE;
}

size_t mf_dev_lt_x16_bytes(int n_tok, int64_t cols)
{
    if (n_tok < 1 || cols < 1) return 0;
    return MF_LT_HDR_BYTES + (((size_t)n_tok * (size_t)cols * 2 + 255) & ~(size_t)255);
}

/* A 16-bit weight the card can multiply: its pointer, shape [n_out, n_in] and a type the card takes. */
static int mf_dev_w16_ok(mf_dev_stream *s, const mf_dev_w16 *w, int n_out, int n_in, const char *what,
                         const char *name)
{
    mf_dev_f16 card = mf_dev_card_f16(s->dev, s->card);
    if (!s->dev->ops->dequant || card == MF_DEV_F16_NONE)
        return mf_error(-ENOTSUP, "%s: card %d (%s) has no tensor cores for the cuBLASLt path", what, s->card,
                        s->dev->ops->kind);
    if (w->type != MF_DEV_F16_BF16 && w->type != MF_DEV_F16_FP16)
        return mf_error(-EINVAL, "%s: %s has 16-bit type %d (expected MF_DEV_F16_BF16 or _FP16)", what, name,
                        (int)w->type);
    if (w->type == MF_DEV_F16_BF16 && card != MF_DEV_F16_BF16)
        return mf_error(-ENOTSUP, "%s: %s is BF16, which card %d's tensor cores do not take (FP16 only: sm_75)",
                        what, name, s->card);
    if (!w->w || w->n_out != n_out || w->n_in != n_in)
        return mf_error(-EINVAL, "%s: %s is %s[%d, %d], expected [%d, %d]", what, name, w->w ? "" : "NULL ",
                        w->n_out, w->n_in, n_out, n_in);
    return 0;
}

static int mf_dev_lt_buf_ok(mf_dev_stream *s, const mf_dev_lt_buf *b, int n_tok, int64_t cols, const char *what)
{
    size_t need = mf_dev_lt_x16_bytes(n_tok, cols);
    if (!b->x16 || b->x16_bytes < need || (b->ws_bytes && !b->ws))
        return mf_error(-EINVAL, "%s: card %d: scratch x16 %p of %zu bytes (expected >= %zu for %d tokens of %lld "
                        "columns), workspace %p of %zu bytes", what, s->card, b->x16, b->x16_bytes, need, n_tok,
                        (long long)cols, b->ws, b->ws_bytes);
    return 0;
}

int mf_dev_dequant(mf_dev_stream *s, const mf_kern_mat *w, const mf_dev_w16 *out)
{
    static const char *what = "mf_dev_dequant";
    if (!s || !w || !out) return mf_error(-EINVAL, "%s: NULL %s", what, !s ? "stream" : !w ? "weight" : "output");
    if (w->fmt != MF_KERN_FP8 && w->fmt != MF_KERN_FP4)
        return mf_error(-EINVAL, "%s: w has format %d, expected FP8 or FP4", what, (int)w->fmt);
    if (!w->w || !w->scale || w->n_out < 1 || w->n_in < 32 || w->n_in % 32)
        return mf_error(-EINVAL, "%s: w is [%d, %d]%s; expected n_out >= 1, n_in a positive multiple of 32", what,
                        w->n_out, w->n_in, !w->w || !w->scale ? " with NULL weights or scales" : "");
    int rc = mf_dev_w16_ok(s, out, w->n_out, w->n_in, what, "out");
    if (rc) return rc;
    return s->dev->ops->dequant(s, w, out);
}

int mf_dev_expert_ffn_lt(mf_dev_stream *s, const mf_dev_ffn_lt *a)
{
    static const char *what = "mf_dev_expert_ffn_lt";
    if (!s || !a) return mf_error(-EINVAL, "%s: NULL %s", what, !s ? "stream" : "arguments");
    int H = a->w13.n_in, I = a->w13.n_out / 2;
    if (H < 32 || H % 32 || I < 32 || I % 32 || a->w13.n_out != 2 * I)
        return mf_error(-EINVAL, "%s: w13 is [%d, %d], expected [2 I, H] with I and H positive multiples of 32", what,
                        a->w13.n_out, a->w13.n_in);
    int rc = mf_dev_w16_ok(s, &a->w13, 2 * I, H, what, "w13");
    if (!rc) rc = mf_dev_w16_ok(s, &a->w2, H, I, what, "w2");
    if (rc) return rc;
    if (a->w13.type != a->w2.type)
        return mf_error(-EINVAL, "%s: w13 and w2 have different 16-bit types (%d, %d)", what, (int)a->w13.type,
                        (int)a->w2.type);
    if (!(a->limit > 0.0f)) return mf_error(-EINVAL, "%s: swiglu limit %g, expected > 0", what, (double)a->limit);
    if (!a->x || !a->gu || !a->y || a->n_tok < 1)
        return mf_error(-EINVAL, "%s: card %d: NULL x, gu or y, or n_tok %d < 1", what, s->card, a->n_tok);
    if ((rc = mf_dev_lt_buf_ok(s, &a->lt, a->n_tok, H > I ? H : I, what))) return rc;
    if (!s->dev->ops->expert_ffn_lt)
        return mf_error(-ENOTSUP, "%s: the %s backend has no cuBLASLt FFN", what, s->dev->ops->kind);
    return s->dev->ops->expert_ffn_lt(s, a);
}

int mf_dev_lin_tiled_ok(const mf_dev_lin *a)
{
    return !a->group_rows || (a->group_rows % MF_DEV_LIN_TILE_ROWS == 0 && a->row0 % MF_DEV_LIN_TILE_ROWS == 0);
}

int mf_dev_linear(mf_dev_stream *s, const mf_dev_lin *a)
{
    static const char *what = "mf_dev_linear";
    if (!s || !a) return mf_error(-EINVAL, "%s: NULL %s", what, !s ? "stream" : "arguments");
    int rc = mf_dev_dense_mat_ok(&a->w, what, "w");
    if (rc) return rc;
    if (a->sums != MF_DEV_SUMS_KERN && a->sums != MF_DEV_SUMS_REF)
        return mf_error(-EINVAL, "%s: sums %d (expected MF_DEV_SUMS_KERN or _REF)", what, (int)a->sums);
    if ((rc = mf_dev_path_check(what, a->path, 1))) return rc;
    if (a->path == MF_DEV_LIN_TILED && !mf_dev_lin_tiled_ok(a))
        return mf_error(-EINVAL, "%s: the tiled kernel takes groups of %d-row multiples from a %d-row multiple "
                        "(group_rows %d, row0 %lld)", what, MF_DEV_LIN_TILE_ROWS, MF_DEV_LIN_TILE_ROWS, a->group_rows,
                        (long long)a->row0);
    if (a->row0 < 0 || a->group_rows < 0)
        return mf_error(-EINVAL, "%s: row0 %lld, group_rows %d (expected >= 0)", what, (long long)a->row0,
                        a->group_rows);
    if (!a->x || !a->y || a->n_tok < 1)
        return mf_error(-EINVAL, "%s: card %d: NULL x or y, or n_tok %d < 1", what, s->card, a->n_tok);
    int64_t need_x = a->group_rows ? (a->row0 + a->w.n_out - 1) / a->group_rows * a->w.n_in + a->w.n_in : a->w.n_in;
    if (a->ld_x < need_x || a->ld_y < a->w.n_out)
        return mf_error(-EINVAL, "%s: ld_x %lld, ld_y %lld (expected >= %lld and >= %d)", what, (long long)a->ld_x,
                        (long long)a->ld_y, (long long)need_x, a->w.n_out);
    if (a->path == MF_DEV_LIN_CUBLASLT) {
        if (a->sums != MF_DEV_SUMS_KERN)
            return mf_error(-EINVAL, "%s: the cuBLASLt path has the kernels' fp32 sums only (MF_DEV_SUMS_KERN)", what);
        if ((rc = mf_dev_w16_ok(s, &a->w16, a->w.n_out, a->w.n_in, what, "w16"))) return rc;
        if ((rc = mf_dev_lt_buf_ok(s, &a->lt, a->n_tok, need_x, what))) return rc;
    }
    return s->dev->ops->linear(s, a);
}

int mf_dev_round_bf16(mf_dev_stream *s, float *y, int n_tok, int64_t ld, int n)
{
    if (!s) return mf_error(-EINVAL, "mf_dev_round_bf16: stream is NULL");
    if (!y || n_tok < 1 || n < 1 || ld < n)
        return mf_error(-EINVAL, "mf_dev_round_bf16: card %d: y %p, %d tokens of %d values, ld %lld", s->card,
                        (void *)y, n_tok, n, (long long)ld);
    return s->dev->ops->round_bf16(s, y, n_tok, ld, n);
}

static int mf_dev_bf16_cast(mf_dev_stream *s, int pack, float *x, int64_t ld_x, uint16_t *y, int64_t ld_y,
                            const int32_t *rows, int n_tok, int n)
{
    const char *what = pack ? "mf_dev_bf16_pack" : rows ? "mf_dev_bf16_gather" : "mf_dev_bf16_unpack";
    if (!s) return mf_error(-EINVAL, "%s: stream is NULL", what);
    if (!x || !y || n_tok < 1 || n < 1 || ld_x < n || ld_y < n)
        return mf_error(-EINVAL, "%s: card %d: x %p, y %p, %d tokens of %d values, ld_x %lld, ld_y %lld", what,
                        s->card, (void *)x, (void *)y, n_tok, n, (long long)ld_x, (long long)ld_y);
    return s->dev->ops->bf16_cast(s, pack, x, ld_x, y, ld_y, rows, n_tok, n);
}

int mf_dev_bf16_pack(mf_dev_stream *s, const float *x, int64_t ld_x, uint16_t *y, int64_t ld_y, int n_tok, int n)
{
    return mf_dev_bf16_cast(s, 1, (float *)(uintptr_t)x, ld_x, y, ld_y, NULL, n_tok, n);
}

int mf_dev_bf16_unpack(mf_dev_stream *s, const uint16_t *y, int64_t ld_y, float *x, int64_t ld_x, int n_tok, int n)
{
    return mf_dev_bf16_cast(s, 0, x, ld_x, (uint16_t *)(uintptr_t)y, ld_y, NULL, n_tok, n);
}

int mf_dev_bf16_gather(mf_dev_stream *s, const uint16_t *y, int64_t ld_y, const int32_t *rows, float *x,
                       int64_t ld_x, int n_tok, int n)
{
    if (s && !rows) return mf_error(-EINVAL, "mf_dev_bf16_gather: card %d: rows is NULL", s->card);
    return mf_dev_bf16_cast(s, 0, x, ld_x, (uint16_t *)(uintptr_t)y, ld_y, rows, n_tok, n);
}

int mf_dev_ffn_up(mf_dev_stream *s, const mf_dev_up *a)
{
    static const char *what = "mf_dev_ffn_up";
    if (!s || !a) return mf_error(-EINVAL, "%s: NULL %s", what, !s ? "stream" : "arguments");
    int rc = mf_dev_dense_mat_ok(&a->w1, what, "w1");
    if (!rc) rc = mf_dev_dense_mat_ok(&a->w3, what, "w3");
    if (rc) return rc;
    if (a->w1.fmt != a->w3.fmt || a->w1.n_out != a->w3.n_out || a->w1.n_in != a->w3.n_in)
        return mf_error(-EINVAL, "%s: w1 [%d, %d] and w3 [%d, %d] differ in shape or format", what, a->w1.n_out,
                        a->w1.n_in, a->w3.n_out, a->w3.n_in);
    if (!(a->limit > 0.0f)) return mf_error(-EINVAL, "%s: swiglu limit %g, expected > 0", what, (double)a->limit);
    if ((rc = mf_dev_path_check(what, a->path, 0))) return rc;
    if (!a->x || !a->h || a->n_tok < 1 || a->ld_x < a->w1.n_in || a->ld_h < a->w1.n_out)
        return mf_error(-EINVAL, "%s: card %d: NULL x or h, n_tok %d, ld_x %lld, ld_h %lld", what, s->card, a->n_tok,
                        (long long)a->ld_x, (long long)a->ld_h);
    return s->dev->ops->ffn_up(s, a);
}

int mf_dev_swiglu_bf16(mf_dev_stream *s, const float *g, const float *u, int n_tok, int64_t ld, int n,
                       float limit, float *h)
{
    if (!s) return mf_error(-EINVAL, "mf_dev_swiglu_bf16: stream is NULL");
    if (!g || !u || !h || n_tok < 1 || n < 1 || ld < n)
        return mf_error(-EINVAL, "mf_dev_swiglu_bf16: card %d: NULL g, u or h, or %d tokens of %d values, ld %lld",
                        s->card, n_tok, n, (long long)ld);
    return s->dev->ops->swiglu_bf16(s, g, u, n_tok, ld, n, limit, h);
}

int mf_dev_attn_heads(mf_dev_stream *s, const mf_dev_attn *a)
{
    static const char *what = "mf_dev_attn_heads";
    if (!s || !a) return mf_error(-EINVAL, "%s: NULL %s", what, !s ? "stream" : "arguments");
    if (!a->q || !a->sink || !a->kv || !a->keys || !a->n_keys || !a->o)
        return mf_error(-EINVAL, "%s: card %d: NULL q, sink, kv, keys, n_keys or o", what, s->card);
    if (a->n_tok < 1 || a->n_heads < 1 || a->D < 16 || a->D % 16 || a->D > MF_DEV_ATTN_MAX_D || a->n_kv < 0)
        return mf_error(-EINVAL, "%s: %d tokens, %d heads of %d (expected >= 1, >= 1, a multiple of 16 up to %d), "
                        "%lld key rows", what, a->n_tok, a->n_heads, a->D, MF_DEV_ATTN_MAX_D, (long long)a->n_kv);
    int64_t w = (int64_t)a->n_heads * a->D;
    if (a->ld_q < w || a->ld_o < w || a->ld_keys < 0)
        return mf_error(-EINVAL, "%s: ld_q %lld, ld_o %lld (expected >= %lld), ld_keys %lld", what,
                        (long long)a->ld_q, (long long)a->ld_o, (long long)w, (long long)a->ld_keys);
    if (a->rope_dim < 0 || a->rope_dim % 2 || a->rope_dim > a->D || a->rope_dim > MF_DEV_ATTN_MAX_ROPE ||
        (a->rope_dim > 0 && !a->rope))
        return mf_error(-EINVAL, "%s: an inverse RoPE of %d values (table %p; expected even, at most %d and the head's %d)",
                        what, a->rope_dim, (const void *)a->rope, MF_DEV_ATTN_MAX_ROPE, a->D);
    if (a->q_rope_dim < 0 || a->q_rope_dim % 2 || a->q_rope_dim > a->D || a->q_rope_dim > MF_DEV_ATTN_MAX_ROPE ||
        (a->q_rope_dim > 0 && !a->rope) || (a->q_rope_dim > 0 && a->rope_dim > 0 && a->q_rope_dim != a->rope_dim))
        return mf_error(-EINVAL, "%s: a query RoPE of %d values (table %p, the output's %d; expected even, at most %d "
                        "and the head's %d, the output's where it has one)", what, a->q_rope_dim, (const void *)a->rope,
                        a->rope_dim, MF_DEV_ATTN_MAX_ROPE, a->D);
    if (!s->dev->ops->attn_heads) return mf_error(-ENOTSUP, "%s: the %s backend has no attention", what, s->dev->ops->kind);
    return s->dev->ops->attn_heads(s, a);
}

int mf_dev_index_scores(mf_dev_stream *s, const mf_dev_iscore *a)
{
    static const char *what = "mf_dev_index_scores";
    if (!s || !a) return mf_error(-EINVAL, "%s: NULL %s", what, !s ? "stream" : "arguments");
    if (!a->q || !a->w || !a->keys || !a->n_vis || !a->score)
        return mf_error(-EINVAL, "%s: card %d: NULL q, w, keys, n_vis or score", what, s->card);
    if (a->n_tok < 1 || a->n_heads < 1 || a->D < 1 || (int64_t)a->n_heads * a->D > MF_DEV_ISCORE_MAX_QD ||
        a->n_keys < 0)
        return mf_error(-EINVAL, "%s: %d tokens, %d heads of %d (expected >= 1, and heads x dim up to %d), %lld keys",
                        what, a->n_tok, a->n_heads, a->D, MF_DEV_ISCORE_MAX_QD, (long long)a->n_keys);
    if (a->ld_q < (int64_t)a->n_heads * a->D || a->ld_w < a->n_heads || a->ld_s < a->n_keys)
        return mf_error(-EINVAL, "%s: ld_q %lld, ld_w %lld, ld_s %lld (expected >= %lld, %d, %lld)", what,
                        (long long)a->ld_q, (long long)a->ld_w, (long long)a->ld_s,
                        (long long)a->n_heads * a->D, a->n_heads, (long long)a->n_keys);
    if (!s->dev->ops->index_scores)
        return mf_error(-ENOTSUP, "%s: the %s backend has no index scores", what, s->dev->ops->kind);
    return s->dev->ops->index_scores(s, a);
}

size_t mf_dev_ffn_q8_bytes(int n_tok, int n_in, int n_hidden)
{
    size_t a = mf_kern_q8_bytes(n_tok, n_in), b = mf_kern_q8_bytes(n_tok, n_hidden);
    if (!a || !b) return 0;
    return a > b ? a : b;
}

int mf_dev_expert_ffn(mf_dev_stream *s, const mf_dev_ffn *a)
{
    static const char *what = "mf_dev_expert_ffn";
    if (!s || !a) return mf_error(-EINVAL, "%s: NULL %s", what, !s ? "stream" : "arguments");
    int rc = mf_dev_mat_ok(&a->w1, 0, what, "w1");
    if (!rc) rc = mf_dev_mat_ok(&a->w3, 0, what, "w3");
    if (!rc) rc = mf_dev_mat_ok(&a->w2, 0, what, "w2");
    if (rc) return rc;
    if (a->w1.n_out != a->w3.n_out || a->w1.n_in != a->w3.n_in || a->w2.n_in != a->w1.n_out ||
        a->w2.n_out != a->w1.n_in)
        return mf_error(-EINVAL, "%s: shapes w1 [%d, %d], w3 [%d, %d], w2 [%d, %d] do not chain "
                        "(expected w1 = w3 = [I, H], w2 = [H, I])", what, a->w1.n_out, a->w1.n_in,
                        a->w3.n_out, a->w3.n_in, a->w2.n_out, a->w2.n_in);
    if (a->w1.fmt != a->w3.fmt)
        return mf_error(-EINVAL, "%s: w1 and w3 have different formats (%d, %d)", what,
                        (int)a->w1.fmt, (int)a->w3.fmt);
    if (!(a->limit > 0.0f))
        return mf_error(-EINVAL, "%s: swiglu limit %g, expected > 0", what, (double)a->limit);
    if (!a->x || !a->h || !a->y || a->n_tok < 1)
        return mf_error(-EINVAL, "%s: card %d: NULL x, h or y, or n_tok %d < 1", what, s->card,
                        a->n_tok);
    return s->dev->ops->expert_ffn(s, a);
}

int mf_dev_expert_ffn_table(mf_dev_stream *s, const mf_dev_ffn_table *a)
{
    static const char *what = "mf_dev_expert_ffn_table";
    if (!s || !a) return mf_error(-EINVAL, "%s: NULL %s", what, !s ? "stream" : "arguments");
    if (a->n_in < 32 || a->n_in % 32 || a->n_hidden < 32 || a->n_hidden % 32)
        return mf_error(-EINVAL, "%s: n_in %d, n_hidden %d: expected positive multiples of 32", what,
                        a->n_in, a->n_hidden);
    if (a->n_slots < 1 || a->max_tok < 1 || a->max_tok > 65535 || a->n_slots > 65535)
        return mf_error(-EINVAL, "%s: %d slots of at most %d tokens (expected 1..65535 each)", what,
                        a->n_slots, a->max_tok);
    if (!a->table || !a->x || !a->h || !a->y || !a->q8_scratch)
        return mf_error(-EINVAL, "%s: card %d: NULL table, x, h, y or q8 scratch", what, s->card);
    size_t need = mf_dev_ffn_q8_bytes(1, a->n_in, a->n_hidden);
    if (a->q8_row < need)
        return mf_error(-EINVAL, "%s: q8 scratch of %zu bytes a row, expected >= %zu (mf_dev_ffn_q8_bytes(1, "
                        "%d, %d))", what, a->q8_row, need, a->n_in, a->n_hidden);
    if (!(a->limit > 0.0f))
        return mf_error(-EINVAL, "%s: swiglu limit %g, expected > 0", what, (double)a->limit);
    return s->dev->ops->expert_ffn_table(s, a);
}

/* ---- graph capture ---------------------------------------------------------------------------- */

int mf_dev_capture_begin(mf_dev_stream *s)
{
    if (!s) return mf_error(-EINVAL, "mf_dev_capture_begin: stream is NULL");
    if (s->capturing)
        return mf_error(-EBUSY, "mf_dev_capture_begin: card %d's stream is already capturing", s->card);
    int rc = s->dev->ops->capture_begin(s);
    if (!rc) s->capturing = 1;
    return rc;
}

int mf_dev_capture_end(mf_dev_stream *s, mf_dev_graph **out)
{
    if (!s || !out) return mf_error(-EINVAL, "mf_dev_capture_end: NULL %s", !s ? "stream" : "out");
    *out = NULL;
    if (!s->capturing)
        return mf_error(-EINVAL, "mf_dev_capture_end: card %d's stream is not capturing", s->card);
    int rc = s->dev->ops->capture_end(s, out);
    s->capturing = 0;
    return rc;
}

int mf_dev_graph_launch(mf_dev_graph *g, mf_dev_stream *s)
{
    if (!g || !s) return mf_error(-EINVAL, "mf_dev_graph_launch: NULL %s", !g ? "graph" : "stream");
    if (g->dev != s->dev || g->card != s->card)
        return mf_error(-EINVAL, "mf_dev_graph_launch: a graph captured on card %d launched on a "
                        "stream of card %d%s", g->card, s->card,
                        g->dev != s->dev ? " of another device" : "");
    if (s->capturing)
        return mf_error(-EBUSY, "mf_dev_graph_launch: card %d's stream is capturing", s->card);
    return s->dev->ops->graph_launch(g, s);
}

void mf_dev_graph_destroy(mf_dev_graph *g)
{
    if (g) g->dev->ops->graph_destroy(g);
}

/* ---- the scheduler's adapter ----------------------------------------------------------------- */

static void *mf_dev_lane_queue(void *ctx, int device, mf_lane_kind kind)
{
    mf_dev_stream_kind k = kind == MF_LANE_DEV_COPY_IN    ? MF_DEV_STREAM_COPY_IN
                           : kind == MF_LANE_DEV_COMPUTE  ? MF_DEV_STREAM_COMPUTE
                           : kind == MF_LANE_DEV_COPY_OUT ? MF_DEV_STREAM_COPY_OUT
                                                          : MF_DEV_N_STREAMS;
    return mf_dev_stream_of(ctx, device, k);
}

static int mf_dev_lane_notify(void *ctx, void *queue, void (*done)(void *), void *done_arg)
{
    mf_dev *d = ctx;
    if (!queue) return mf_error(-EINVAL, "device lane has no stream (a lane names a card beyond "
                                "the device's %d, or a non-device kind)", d->n_cards);
    return mf_dev_stream_callback(queue, done, done_arg);
}

static int mf_dev_lane_notify_status(void *ctx, void *queue, void (*done)(void *, int, const char *),
                                     void *done_arg)
{
    mf_dev *d = ctx;
    if (!queue) return mf_error(-EINVAL, "device lane has no stream (a lane names a card beyond "
                                "the device's %d, or a non-device kind)", d->n_cards);
    return mf_dev_stream_callback_status(queue, done, done_arg);
}

/* notify_status where the backend has status callbacks (emu, CUDA), so that a device task whose
 * work failed fails in the scheduler, also after a CUDA context fault; plain notify otherwise. */
const mf_dev_lane_ops *mf_dev_lane_ops_of(mf_dev *d)
{
    if (!d) return NULL;
    d->lane_ops = (mf_dev_lane_ops){.ctx = d, .queue = mf_dev_lane_queue,
                                    .notify = mf_dev_lane_notify,
                                    .notify_status = d->ops->callback_status ? mf_dev_lane_notify_status
                                                                             : NULL};
    return &d->lane_ops;
}
