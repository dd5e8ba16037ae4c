/* What a device backend implements: the ops table behind mf_dev (device/dev.h) and the common
 * head of its handles. device/dev.c checks arguments and dispatches; a backend embeds mf_dev,
 * mf_dev_stream and mf_dev_event as the first member of its own structs. Not a public header. */
#ifndef MF_DEV_IMPL_H
#define MF_DEV_IMPL_H

#include "device/dev.h"

typedef enum mf_dev_copy_kind { MF_DEV_H2D, MF_DEV_D2H, MF_DEV_D2D } mf_dev_copy_kind;

typedef struct mf_dev_ops {
    const char *kind;
    void (*close)(mf_dev *d);
    int (*alloc)(mf_dev *d, int card, size_t n_bytes, void **out);
    void (*free)(mf_dev *d, int card, void *p);
    int (*host_alloc)(mf_dev *d, int card, size_t n_bytes, void **out);
    void (*host_free)(mf_dev *d, void *p);
    /* dst_card / src_card: the cards of device-side pointers (-1 for host pointers). */
    int (*copy)(mf_dev_stream *s, mf_dev_copy_kind k, int dst_card, void *dst, int src_card,
                const void *src, size_t n_bytes);
    int (*event_create)(mf_dev *d, int card, int timed, mf_dev_event **out);
    void (*event_destroy)(mf_dev_event *e);
    int (*event_record)(mf_dev_event *e, mf_dev_stream *s);
    int (*stream_wait)(mf_dev_stream *s, mf_dev_event *e);
    /* start and end: timed events of one card (checked by dev.c) */
    int (*event_elapsed)(mf_dev_event *start, mf_dev_event *end, int64_t *out_ns);
    int (*callback)(mf_dev_stream *s, void (*fn)(void *), void *arg);
    /* Optional (NULL: mf_dev_stream_callback_status is -ENOTSUP): fn(arg, err, msg) with the
     * stream's first error not yet delivered, which it takes. */
    int (*callback_status)(mf_dev_stream *s, void (*fn)(void *, int, const char *), void *arg);
    int (*stream_sync)(mf_dev_stream *s);
    /* Kernels: arguments already checked by dev.c. */
    int (*fp4_matmul)(mf_dev_stream *s, const mf_kern_mat *w, const float *x, int n_tok, float *y,
                      void *q8_scratch);
    int (*fp8_matmul)(mf_dev_stream *s, const mf_kern_mat *w, const float *x, int n_tok, float *y);
    int (*bf16_matmul)(mf_dev_stream *s, const mf_kern_mat *w, const float *x, int n_tok, float *y);
    int (*expert_ffn)(mf_dev_stream *s, const mf_dev_ffn *a);
    int (*expert_ffn_table)(mf_dev_stream *s, const mf_dev_ffn_table *a);
    int (*linear)(mf_dev_stream *s, const mf_dev_lin *a);
    int (*round_bf16)(mf_dev_stream *s, float *y, int n_tok, int64_t ld, int n);
    /* pack 1: x -> codes y; 0: codes y -> x (mf_dev_bf16_pack, _unpack) */
    int (*bf16_cast)(mf_dev_stream *s, int pack, float *x, int64_t ld_x, uint16_t *y, int64_t ld_y, int n_tok, int n);
    int (*ffn_up)(mf_dev_stream *s, const mf_dev_up *a);
    int (*swiglu_bf16)(mf_dev_stream *s, const float *g, const float *u, int n_tok, int64_t ld, int n,
                       float limit, float *h);
    /* Optional (NULL: mf_dev_attn_heads is -ENOTSUP). */
    int (*attn_heads)(mf_dev_stream *s, const mf_dev_attn *a);
    /* Optional (NULL: mf_dev_index_scores is -ENOTSUP). */
    int (*index_scores)(mf_dev_stream *s, const mf_dev_iscore *a);
    /* The cuBLASLt path, optional (NULL, or the card's f16 NONE: -ENOTSUP); linear() takes
     * MF_DEV_LIN_CUBLASLT calls too. */
    int (*dequant)(mf_dev_stream *s, const mf_kern_mat *w, const mf_dev_w16 *out);
    int (*expert_ffn_lt)(mf_dev_stream *s, const mf_dev_ffn_lt *a);
    /* Capture: the stream's capturing flag is kept by dev.c. */
    int (*capture_begin)(mf_dev_stream *s);
    int (*capture_end)(mf_dev_stream *s, mf_dev_graph **out);
    int (*graph_launch)(mf_dev_graph *g, mf_dev_stream *s);
    void (*graph_destroy)(mf_dev_graph *g);
    /* Optional (NULL: dev.c copies row by row): a 2D copy of height rows of width bytes (H2D or
     * D2H), arguments checked by dev.c. */
    int (*copy_2d)(mf_dev_stream *s, mf_dev_copy_kind k, void *dst, size_t dst_pitch, const void *src,
                   size_t src_pitch, size_t width, size_t height);
} mf_dev_ops;

struct mf_dev {
    const mf_dev_ops *ops;
    int n_cards;
    mf_dev_stream *streams[MF_DEV_MAX_CARDS][MF_DEV_N_STREAMS];
    mf_dev_f16 f16[MF_DEV_MAX_CARDS];   /* the type each card's tensor cores take (set at open) */
    mf_dev_lane_ops lane_ops;
};

struct mf_dev_stream {
    mf_dev *dev;
    int card;
    mf_dev_stream_kind kind;
    _Atomic int capturing;   /* 1 between capture_begin and capture_end */
};

struct mf_dev_graph {
    mf_dev *dev;
    int card;
};

struct mf_dev_event {
    mf_dev *dev;
    int card;
    int timed;               /* made by mf_dev_event_create_timed */
};

int mf_dev_open_emu(const char *opts, mf_dev **out);    /* opts: what follows "emu:" */
int mf_dev_open_cuda(const char *cards, mf_dev **out);  /* cards: NULL (all) or "0,2" */

#endif
