/* The device interface: one table of functions (device/dev_impl.h) behind an opaque mf_dev, so the
 * scheduler's device lanes, the graphs and the tests drive a CUDA card and an emulated card alike:
 * device and pinned host memory, streams (copy-in, compute, copy-out per card), events, async
 * copies, host callbacks on a stream, the expert kernels, and single-stream graph capture and
 * replay. Backends: "emu:N" (host threads and
 * host kernels, modelled copy time; device/dev_emu.c) and "cuda[:i,j]" (device/dev_cuda.c). */
#ifndef MF_DEV_H
#define MF_DEV_H

#include <stddef.h>
#include <stdint.h>

#include "host/kernels.h"
#include "sched/sched.h"

#define MF_DEV_MAX_CARDS 16

typedef struct mf_dev mf_dev;
typedef struct mf_dev_stream mf_dev_stream;
typedef struct mf_dev_event mf_dev_event;
typedef struct mf_dev_graph mf_dev_graph;

/* The streams every card has, one per device lane kind. Work on one stream runs in the order it
 * was enqueued; streams run concurrently with each other. */
typedef enum mf_dev_stream_kind {
    MF_DEV_STREAM_COPY_IN = 0,
    MF_DEV_STREAM_COMPUTE,
    MF_DEV_STREAM_COPY_OUT,
    MF_DEV_N_STREAMS
} mf_dev_stream_kind;

/* Opens a device by spec:
 *   "emu:N[,mem=BYTES][,bw=BYTES_PER_S][,lat_ns=NS][,fail_h2d=N][,lose_cb=N][,tc=bf16|fp16|none]"
 *       N emulated cards
 *       (1..16); mem is each card's capacity (suffixes K, M, G; default 16G), bw and lat_ns the
 *       modelled copy bandwidth and latency (defaults 25e9 and 10000: a model, not a measurement),
 *       fail_h2d fault injection (mf_dev_emu_fail_h2d); lose_cb=N: the nth callback (plain or
 *       status, any stream, counted from open) is never called, as CUDA calls no host function
 *       after a context fault (the scheduler's dev_wait_ns bound then fails the task); tc: the
 *       16-bit type the cards' emulated tensor cores take (mf_dev_card_f16; default bf16);
 *   "cuda" every CUDA card the driver sees; "cuda:0,2" those cards; a card named more than once
 *       ("cuda:0,0,0,0") is that many logical cards on one GPU, each with its own streams (to run
 *       multi-card placements on one GPU).
 * -EINVAL with a message for a malformed spec; -ENOSYS for "cuda" in a build without CUDA;
 * -ENODEV when no card (or a named card) is present. */
int mf_dev_open(const char *spec, mf_dev **out);
/* Waits for all enqueued work, then frees every stream and every device and pinned allocation
 * left (events are the caller's to destroy first). NULL is fine. */
void mf_dev_close(mf_dev *d);

int mf_dev_n_cards(const mf_dev *d);
/* "emu" or "cuda". */
const char *mf_dev_kind(const mf_dev *d);

/* Device memory on card `card`. Emulated cards refuse beyond their capacity with -ENOMEM and a
 * message naming the card, the size asked and what is in use. free(NULL) is a no-op. */
int mf_dev_alloc(mf_dev *d, int card, size_t n_bytes, void **out);
void mf_dev_free(mf_dev *d, int card, void *p);
/* Pinned (page-locked) host memory for staging copies to/from `card`, usable with every card.
 * Allocate at start, not per token. */
int mf_dev_host_alloc(mf_dev *d, int card, size_t n_bytes, void **out);
void mf_dev_host_free(mf_dev *d, void *p);

/* The stream of `kind` on `card` (created at open, owned by d); NULL for a bad card or kind. */
mf_dev_stream *mf_dev_stream_of(mf_dev *d, int card, mf_dev_stream_kind kind);
int mf_dev_stream_card(const mf_dev_stream *s);

/* Async copies enqueued on s; they return once enqueued (0) or -EINVAL for bad arguments. Host
 * memory should be pinned (mf_dev_host_alloc) for the copy to be asynchronous on CUDA. d2d copies
 * between device buffers, on the same card or between cards. */
int mf_dev_copy_h2d(mf_dev_stream *s, void *dst_dev, const void *src_host, size_t n_bytes);
int mf_dev_copy_d2h(mf_dev_stream *s, void *dst_host, const void *src_dev, size_t n_bytes);
int mf_dev_copy_d2d(mf_dev_stream *s, int dst_card, void *dst, int src_card, const void *src,
                    size_t n_bytes);
/* Async 2D copies (as above): `height` rows of `width` bytes, row i from src + i * src_pitch to
 * dst + i * dst_pitch (pitches >= width; -EINVAL otherwise): a strided block such as some rows of
 * every item's vector. One copy (one latency) where the backend has it, else a copy per row. */
int mf_dev_copy_h2d_2d(mf_dev_stream *s, void *dst_dev, size_t dst_pitch, const void *src_host, size_t src_pitch,
                       size_t width, size_t height);
int mf_dev_copy_d2h_2d(mf_dev_stream *s, void *dst_host, size_t dst_pitch, const void *src_dev, size_t src_pitch,
                       size_t width, size_t height);

/* Events: record marks the point reached by everything enqueued on s so far; wait makes later
 * work on s start only after the event's last recorded point has been reached (a no-op for an
 * event never recorded). An event is recorded on streams of its own card (CUDA's rule; -EINVAL
 * otherwise) and can be waited on by any stream of any card. Destroying an event waits (emu) or
 * defers (CUDA) until enqueued work naming it is done. */
int mf_dev_event_create(mf_dev *d, int card, mf_dev_event **out);
/* An event that also keeps the device time it was reached at, for timing device work (CUDA:
 * created without cudaEventDisableTiming; emulated: the host clock when the stream thread runs the
 * record). Otherwise as mf_dev_event_create. */
int mf_dev_event_create_timed(mf_dev *d, int card, mf_dev_event **out);
/* The device time from start's to end's last record, both timed events of one card: waits until
 * end's last record has been reached. -EINVAL for an untimed event, events of different cards, or
 * one never recorded. CUDA: cudaEventElapsedTime (resolution about 0.5 us). */
int mf_dev_event_elapsed_ns(mf_dev_event *start, mf_dev_event *end, int64_t *out_ns);
void mf_dev_event_destroy(mf_dev_event *e);
int mf_dev_event_record(mf_dev_event *e, mf_dev_stream *s);
int mf_dev_stream_wait(mf_dev_stream *s, mf_dev_event *e);

/* Enqueues fn(arg) on s: it runs on a backend thread once everything enqueued before it has
 * finished, and later work on s waits for it. fn must not call into the device (CUDA forbids it)
 * and should be short. This is how the scheduler learns a device task is done. */
int mf_dev_stream_callback(mf_dev_stream *s, void (*fn)(void *arg), void *arg);
/* As mf_dev_stream_callback, and fn learns whether work on s before it failed: err is the first
 * error of an asynchronous operation on s not yet delivered (0: none), msg its message (NULL when
 * err is 0; valid during the call). The scheduler adapter uses it so that a device task whose
 * work failed fails. Emulated cards: the callback takes the error (a later sync no longer returns
 * it). CUDA (cudaStreamAddCallback): called also after a fault of the card's context, when plain
 * callbacks (cudaLaunchHostFunc) never are, with err -EIO and CUDA's error named; the fault is
 * sticky (later work and syncs fail too). Not capturable: -EBUSY while s captures on CUDA. */
int mf_dev_stream_callback_status(mf_dev_stream *s, void (*fn)(void *arg, int err, const char *msg),
                                  void *arg);

/* Blocks until everything enqueued on s (or on every stream of d) has finished. Returns 0, or the
 * first error of an async operation on s not delivered to a status callback (sticky until then,
 * with its message). */
int mf_dev_stream_sync(mf_dev_stream *s);
int mf_dev_sync(mf_dev *d);

/* Kernels, enqueued on s (normally a compute stream). Every pointer is device memory of s's card;
 * weights are as stored (mf_kern_mat fields point into device memory); activations are dense
 * rows: x [n_tok][n_in] floats, y [n_tok][n_out] floats.
 * FP4 matmul: q8_scratch != NULL (at least mf_kern_q8_bytes(n_tok, n_in) device bytes) selects the
 * int8 path (mf_kern_fp4_matmul), NULL the fp32 one (mf_kern_fp4_matmul_f32). Shapes are checked
 * when enqueued (-EINVAL); results equal host/kernels.h's bit for bit on the emulated device.
 * On CUDA they differ from the host's in fp32 summation order (int8 path: the same quantized
 * activations and exact integer block sums; relative errors in docs/device.md). */
int mf_dev_fp4_matmul(mf_dev_stream *s, const mf_kern_mat *w, const float *x, int n_tok, float *y,
                      void *q8_scratch);
int mf_dev_fp8_matmul(mf_dev_stream *s, const mf_kern_mat *w, const float *x, int n_tok, float *y);
/* BF16 matmul (the router gate, the head): w->fmt MF_KERN_BF16, w->w [n_out][n_in] bf16, no
 * scale; as mf_kern_bf16_matmul (bit for bit on the emulated device, fp32 summation order on
 * CUDA). */
int mf_dev_bf16_matmul(mf_dev_stream *s, const mf_kern_mat *w, const float *x, int n_tok, float *y);

/* Dense linears of the dense sublayers on a card (the attention linears, router gate, shared
 * expert, head: graphs/step/step_dense.c). A weight slice: w holds rows [row0, row0 + w.n_out) of a
 * weight (FP8 E4M3 with 32x32 E8M0 tiles, the slice starting at a tile row, or BF16) in device
 * memory; x rows are ld_x floats apart, y rows ld_y floats apart, and y[t * ld_y + i] is written
 * for i in [0, w.n_out) (y points at the slice's first output). group_rows > 0 (the grouped
 * wo_a): row r of the whole weight reads x columns [(r / group_rows) * w.n_in, + w.n_in). sums:
 * MF_DEV_SUMS_KERN as host/kernels.h sums (mf_kern_matmul: fp32); MF_DEV_SUMS_REF the reference's
 * double sums (graphs/layers mf_ly_linear_rows: per 32-column block a double sum, times its scale,
 * summed in double; the router gate and wo_a use them). Emulated cards: bit for bit those host
 * sums. CUDA: fp32 FMAs in another order (REF: fp32 within a 16-column chunk, double across
 * chunks); bounds in docs/device.md. -EINVAL for bad shapes, formats or pointers. */
typedef enum mf_dev_sums { MF_DEV_SUMS_KERN = 0, MF_DEV_SUMS_REF } mf_dev_sums;
/* Which CUDA kernel a linear runs (the emulated card runs the host's sums whatever it asks, but
 * CUBLASLT's own arithmetic, below): AUTO the tiled one at n_tok >= MF_DEV_LIN_TILED_MIN_TOK where it
 * applies, else the warp-per-row one; ROWS and TILED force one (for tests and `moeflow bench dev`).
 * The tiled kernel (a GEMM: a 64-row x 64-token block decodes each 32-column weight tile once into
 * shared memory for all its tokens, where the warp-per-row kernel reads a row once per 8 tokens;
 * kernel or reference sums) takes grouped rows only when group_rows and row0 are multiples of 64
 * (a block's rows in one group); TILED otherwise is -EINVAL on every backend. CUBLASLT: the
 * tensor-core path (below, "The cuBLASLt path"): the slice's weights already dequantized into
 * mf_dev_lin.w16 (mf_dev_dequant), cublasLtMatmul with fp32 accumulation; kernel sums only, any
 * grouping; never chosen by AUTO (the caller's cost model decides: sched/cost.h). */
typedef enum mf_dev_lin_path { MF_DEV_LIN_AUTO = 0, MF_DEV_LIN_ROWS, MF_DEV_LIN_TILED, MF_DEV_LIN_CUBLASLT } mf_dev_lin_path;
/* The tokens from which AUTO takes the tiled kernel: 64, chosen without a GPU (no CUDA line of
 * this project has run); `tools/device-check.sh` times both kernels at 8, 64 and 512 tokens
 * (`bench dev`'s "tiled / rows" ratios) for measuring the crossover on a card. */
#define MF_DEV_LIN_TILED_MIN_TOK 64
/* Rows of the slice a block of the tiled kernel computes (device/dev_kernels.cu GT_M), hence the
 * group alignment mf_dev_lin_tiled_ok asks. */
#define MF_DEV_LIN_TILE_ROWS 64

/* ---- The cuBLASLt path (prefill-sized dense linears and routed experts on tensor cores) --------
 * A weight is dequantized on its card into a scratch of 16-bit floats (mf_dev_dequant), then
 * multiplied by cublasLtMatmul (fp32 accumulation, fp32 output; the algorithm chosen once per shape
 * by cublasLtMatmulAlgoGetHeuristic and cached per card) against the activations cast to the same
 * type. The 16-bit type is the card's (mf_dev_card_f16): BF16 from sm_80, FP16 on sm_75. A weight
 * (code c, E8M0 scale code e) is stored as c x 2^(e - 127 - shift), exact: BF16 holds every FP8 and
 * FP4 value the host decodes (shift 0) for scale codes in a 243-binade window; FP16 holds them while
 * k = e - 127 - shift stays in [-15, 7] (FP8) or [-23, 13] (FP4), so a matrix whose scales span
 * more than 22 (36) binades has no exact FP16 form: mf_dev_w16_plan says so at load, per matrix,
 * and the caller keeps that matrix on its other path (the tiled kernel; the int8 expert FFN). The
 * GEMM's alpha carries 2^shift back (exact). The activations: BF16 x rounded to nearest even (exact
 * for the engine's bf16 activations); FP16 x 2^-xs rounded, xs the power of two that puts the
 * call's largest finite |x| in [2^14, 2^15) (computed on the card, folded into alpha): a bf16 value
 * is exact there unless it lies more than 31 binades below that largest one. Emulated cards run
 * the same casts and dequantization (device/kern_lt.h) and the product in the host kernels' fixed
 * fp32 order (mf_kern_bf16_matmul over the scratch), so their result is the host's FP8/FP4 fp32
 * kernel on the cast activations bit for bit (device/lt_host.h); CUDA cards differ by the tensor
 * cores' fp32 accumulation order and rounding (bounds in docs/device.md). Compiled for sm_75 and
 * sm_90; never run on a GPU in this project yet. */
typedef enum mf_dev_f16 { MF_DEV_F16_NONE = 0, MF_DEV_F16_BF16, MF_DEV_F16_FP16 } mf_dev_f16;
/* The 16-bit type card's tensor cores take: BF16 (sm_80 and later, and emulated cards by default;
 * those also take FP16), FP16 (sm_70..sm_75; emulated with the spec option tc=fp16), NONE (older
 * cards, tc=none: the path is -ENOTSUP). */
mf_dev_f16 mf_dev_card_f16(const mf_dev *d, int card);
/* A weight dequantized into 16-bit floats on a card: n_out rows of n_in values (row-major, device
 * memory), each code x 2^(e - 127 - shift). */
typedef struct mf_dev_w16 {
    void *w;
    mf_dev_f16 type;
    int shift;
    int n_out, n_in;
} mf_dev_w16;
/* The plan of n matrices' dequantization into one scratch (an expert's w1 and w3 share a GEMM):
 * from their E8M0 scale codes (host memory; FP8 or FP4 matrices), the shift nearest 0 that makes
 * every value exact in type. 0, or -ERANGE naming the scales' span when none does (FP16 and scales
 * spread too widely: keep the matrix on its other path), -EINVAL for a bad argument. */
int mf_dev_w16_plan(const mf_kern_mat *const *w, int n, mf_dev_f16 type, int *shift);
/* Dequantizes w (FP8 with 32x32 tiles from a tile row, or FP4; device memory of s's card) into
 * out->w (out->n_out == w->n_out, out->n_in == w->n_in), enqueued on any stream of the card (the
 * copy-in stream, so it overlaps the compute stream's previous GEMMs; order it with an event).
 * Values the plan does not allow are an asynchronous -ERANGE on emulated cards and not checked on
 * CUDA. -EINVAL for bad shapes or pointers, -ENOTSUP for a type the card does not take. */
int mf_dev_dequant(mf_dev_stream *s, const mf_kern_mat *w, const mf_dev_w16 *out);
/* The scratch of a cuBLASLt call (device memory of the card): x16 holds the activations cast to 16
 * bits (at least mf_dev_lt_x16_bytes(n_tok, columns) bytes: a header, then n_tok rows of the columns
 * the call reads), ws is cublasLtMatmul's workspace (ws_bytes of it; NULL and 0: none, fewer
 * algorithms; MF_DEV_LT_WS_BYTES recommended, allocated at start). Emulated cards use x16 and not
 * ws. A call's scratch must not be in use by another call running at the same time. */
typedef struct mf_dev_lt_buf {
    void *x16;
    size_t x16_bytes;
    void *ws;
    size_t ws_bytes;
} mf_dev_lt_buf;
#define MF_DEV_LT_WS_BYTES ((size_t)32 << 20)
size_t mf_dev_lt_x16_bytes(int n_tok, int64_t cols);

typedef struct mf_dev_lin {
    mf_kern_mat w;
    int64_t row0;
    int group_rows;
    mf_dev_sums sums;
    mf_dev_lin_path path;
    const float *x;
    int64_t ld_x;
    int n_tok;
    float *y;
    int64_t ld_y;
    /* MF_DEV_LIN_CUBLASLT only: the slice dequantized (w16.n_out == w.n_out, w16.n_in == w.n_in; the
     * GEMM reads it, not w) and the call's scratch (x16 for n_tok rows of the columns the slice
     * reads: n_in, or grouped (row0 + n_out - 1) / group_rows * n_in + n_in) */
    mf_dev_w16 w16;
    mf_dev_lt_buf lt;
} mf_dev_lin;
int mf_dev_linear(mf_dev_stream *s, const mf_dev_lin *a);
/* 1 when the tiled kernel applies to a (no groups, or group_rows and row0 multiples of
 * MF_DEV_LIN_TILE_ROWS), else 0. */
int mf_dev_lin_tiled_ok(const mf_dev_lin *a);
/* 1 when a call of n_tok tokens asking path runs the tiled kernel (ok: mf_dev_lin_tiled_ok, 1 for
 * mf_dev_ffn_up): forced, or AUTO from MF_DEV_LIN_TILED_MIN_TOK tokens. */
static inline int mf_dev_lin_use_tiled(mf_dev_lin_path path, int n_tok, int ok)
{
    return path == MF_DEV_LIN_TILED || (path == MF_DEV_LIN_AUTO && n_tok >= MF_DEV_LIN_TILED_MIN_TOK && ok);
}
/* Rounds y[t * ld + i] (t < n_tok, i < n) to bf16 in place (round to nearest even, as
 * host/formats.h mf_bf16_from_f32): bit for bit on every backend. */
int mf_dev_round_bf16(mf_dev_stream *s, float *y, int n_tok, int64_t ld, int n);
/* Activations copied as bf16 (2 bytes a value; graphs/step/stepgraph.h mf_sg_attn_buf_bf16): pack
 * writes y[t * ld_y + i] = the bf16 code of x[t * ld_x + i] (host/formats.h mf_bf16_from_f32,
 * NaN included), unpack x[t * ld_x + i] = the float of code y[t * ld_y + i] (exact); t < n_tok,
 * i < n. unpack(pack(x)) is mf_dev_round_bf16's rounding: x itself for a value already bf16. Bit
 * for bit on every backend; enqueued on any stream of the card (the copy streams: before a d2h of
 * y, after an h2d into y). -EINVAL for NULL pointers, n_tok or n < 1, or ld < n. */
int mf_dev_bf16_pack(mf_dev_stream *s, const float *x, int64_t ld_x, uint16_t *y, int64_t ld_y, int n_tok, int n);
int mf_dev_bf16_unpack(mf_dev_stream *s, const uint16_t *y, int64_t ld_y, float *x, int64_t ld_x, int n_tok, int n);
/* The unpack of gathered rows: x[t * ld_x + i] = the float of code y[rows[t] * ld_y + i] (t <
 * n_tok, i < n; rows a card array of n_tok row numbers, read when the op runs, each in the caller's
 * range of y): a routed slot's rows from the MoE input the card holds (graphs/step/stepgraph.h
 * mf_stepgraph.slot_gather). Bit for bit on every backend, exact; -EINVAL as unpack, or rows NULL. */
int mf_dev_bf16_gather(mf_dev_stream *s, const uint16_t *y, int64_t ld_y, const int32_t *rows, float *x,
                       int64_t ld_x, int n_tok, int n);
/* Phase 1 of a dense FFN (the shared expert), as mf_kern_ffn_up without token weights on the
 * fp32 path: rows [0, w1.n_out) of slices w1, w3 (FP8 or BF16, same rows) against x (ld_x),
 * h[t * ld_h + i] = silu(min(w1 x, limit)) * clamp(w3 x, +-limit); limit > 0. */
typedef struct mf_dev_up {
    mf_kern_mat w1, w3;
    const float *x;
    int64_t ld_x;
    int n_tok;
    float limit;
    float *h;
    int64_t ld_h;
    mf_dev_lin_path path;   /* the CUDA kernel, as mf_dev_lin.path (the tiled one: both tiles a block) */
} mf_dev_up;
int mf_dev_ffn_up(mf_dev_stream *s, const mf_dev_up *a);
/* The reference's gating of a dense FFN's hidden rows (the engine's exact path): with g' =
 * bf16(g), u' = bf16(u) (limit > 0: g' = min(g', limit), u' clamped to +-limit), h = bf16(silu(g')
 * * u'), silu in double as the reference; g, u, h share ld; element [t * ld + i], i < n. */
int mf_dev_swiglu_bf16(mf_dev_stream *s, const float *g, const float *u, int n_tok, int64_t ld, int n,
                       float limit, float *h);

/* The attention core of a chunk's items on a card (long prefill chunks; graphs/step/fast_attn.c
 * mf_fa_attn_heads computes the same on the host): for token t < n_tok and head h < n_heads, with
 * q_th = q + t * ld_q + h * D (already rounded and roped) and the token's n_keys[t] key rows
 * kv + keys[t * ld_keys + i] * D (values = keys, D floats each), the scores scale * q_th . k_i as
 * host/kernels.h's 16-lane dots, softmax with sink[h] as mf_kern_vec_attn (max, expf, the
 * denominator in double in key order), the weighted values as one fmaf chain per element in key
 * order, and o[t * ld_o + h * D + d] = bf16((float)((double)acc_d / den)): the output before its
 * inverse RoPE; with rope_dim > 0 then, as the host's heads do next (graphs/step/fast_attn.c
 * mf_fa_heads_o), each head's last rope_dim values inverse-roped by token t's table rope + t *
 * rope_dim (its rope_dim / 2 cosines, then as many sines: mf_fa_heads_rope_cs; device/kern_attn.h
 * mf_da_rope_inv) and rounded to bf16 again: the input of the card's own wo_a rows. With
 * q_rope_dim > 0 q_th is instead qb's output as it is (fp32), which the heads first prepare as the
 * host's q prep does (graphs/step/fast_attn.c mf_fa_heads_q), not writing q: all D values rounded
 * to bf16, the last q_rope_dim roped forward by token t's table rope + t * q_rope_dim (the same
 * table; mf_da_rope_fwd), rounded again (where rope_dim > 0 too, the two are equal). keys, n_keys,
 * q, kv, sink, rope and o are device memory of the stream's card; n_keys[t]
 * in [0, MF_DEV_ATTN_MAX_KEYS] and key rows in [0, n_kv) are read when the work runs (emulated:
 * an asynchronous -EINVAL otherwise; CUDA: such a token is skipped). D a multiple of 16, at most
 * MF_DEV_ATTN_MAX_D. Emulated cards: mf_kern_vec_attn itself, so the host's bits. CUDA: the same
 * lanes and orders but CUDA's expf (not bit for bit; compiled for sm_75 and sm_90, never run on a
 * card in this project yet). -EINVAL for bad shapes or NULL pointers. */
#define MF_DEV_ATTN_MAX_KEYS 4096
#define MF_DEV_ATTN_MAX_D 512
#define MF_DEV_ATTN_MAX_ROPE 128
typedef struct mf_dev_attn {
    const float *q;
    int64_t ld_q;
    int n_tok, n_heads, D;
    float scale;
    const float *sink;       /* [n_heads] */
    const float *kv;         /* [n_kv][D] */
    int64_t n_kv;
    const int32_t *keys;     /* [n_tok][ld_keys] key rows */
    const int32_t *n_keys;   /* [n_tok] */
    int64_t ld_keys;
    float *o;
    int64_t ld_o;
    const float *rope;       /* [n_tok][rope_dim], or NULL with rope_dim 0 */
    int rope_dim;            /* even, at most D and MF_DEV_ATTN_MAX_ROPE; 0: the output as it is */
    int q_rope_dim;          /* the same bounds, with rope; 0: q already rounded and roped */
} mf_dev_attn;
int mf_dev_attn_heads(mf_dev_stream *s, const mf_dev_attn *a);

/* The indexer's scores of a chunk's items on a card (long prefill chunks; graphs/step/fast_attn.c
 * mf_fa_index_scores computes the same on the host): for token t < n_tok and key j < n_vis[t],
 * with q_th = q + t * ld_q + h * D (the item's index queries, MF_LY_A_QI), w_th = w[t * ld_w + h]
 * (its head weights, MF_LY_A_IW) and the key rows keys + j * D (the visible compressed entries'
 * index keys, unpacked), score[t * ld_s + j] = (float) of the sum in double over heads h in order
 * of the float w_th * max(q_th . k_j, 0), the dots host/kernels.h's 16-lane dots
 * (mf_kern_vec_index_scores). q, w, keys, n_vis and score are device memory of the stream's card;
 * n_vis[t] in [0, n_keys] is read when the work runs (emulated: an asynchronous -EINVAL otherwise;
 * CUDA: such a token is skipped); score beyond n_vis[t] is not written. n_heads x D at most
 * MF_DEV_ISCORE_MAX_QD (a token's queries in the CUDA kernel's shared memory). Emulated cards:
 * mf_kern_vec_index_scores itself, so the host's bits. CUDA: the same lanes, tree and orders
 * (fmaf, IEEE adds and products in fp32 and double; device/kern_attn.h), so the same bits where
 * nvcc keeps IEEE arithmetic (no fast-math); compiled for sm_75 and sm_90, never run on a card in
 * this project yet. -EINVAL for bad shapes or NULL pointers. */
#define MF_DEV_ISCORE_MAX_QD 8192
typedef struct mf_dev_iscore {
    const float *q;          /* [n_tok] rows ld_q apart: n_heads x D queries */
    int64_t ld_q;
    const float *w;          /* [n_tok] rows ld_w apart: n_heads weights */
    int64_t ld_w;
    int n_tok, n_heads, D;
    const float *keys;       /* [n_keys][D] */
    int64_t n_keys;
    const int32_t *n_vis;    /* [n_tok] */
    double *score;           /* [n_tok] rows ld_s apart */
    int64_t ld_s;
} mf_dev_iscore;
int mf_dev_index_scores(mf_dev_stream *s, const mf_dev_iscore *a);

/* The expert FFN y = w2 (silu(min(w1 x, limit)) * clamp(w3 x, +-limit) * tok_weight), as
 * mf_kern_ffn_up then mf_kern_ffn_down with every row. h is device scratch [n_tok][w1.n_out];
 * q8_scratch (at least mf_dev_ffn_q8_bytes) selects the int8 path for FP4 matrices (x and then h
 * quantized into it), NULL the fp32 path. tok_weight may be NULL (weight 1). */
typedef struct mf_dev_ffn {
    mf_kern_mat w1, w3, w2;
    const float *x;
    int n_tok;
    const float *tok_weight;
    float limit;
    float *h;
    void *q8_scratch;
    float *y;
} mf_dev_ffn;
size_t mf_dev_ffn_q8_bytes(int n_tok, int n_in, int n_hidden);
int mf_dev_expert_ffn(mf_dev_stream *s, const mf_dev_ffn *a);

/* A routed expert's FFN on the cuBLASLt path (prefill chunks: many tokens per expert): w13 holds w1's
 * I rows then w3's ([2I][H], both dequantized into one scratch with one shift: mf_dev_w16_plan of
 * the two), w2 [H][I]. x [n_tok][H] cast to the 16-bit type as mf_dev_linear casts, one GEMM
 * gu = w13 x ([n_tok][2I] fp32), h = mf_kern_gate(g, u, limit) * tok_weight (host/kern_gate.h, in
 * place of g), h cast to 16 bits (its own fp16 shift), y = w2 h ([n_tok][H] fp32). Emulated cards:
 * the host's FP4 fp32 kernels on the cast x and h bit for bit (device/lt_host.h); CUDA: tensor-core
 * sums, and an h value may round the other way (bounds in docs/device.md). lt.x16 holds n_tok rows
 * of max(H, I) columns. -EINVAL for bad shapes or pointers, -ENOTSUP where the card has no such
 * type. */
typedef struct mf_dev_ffn_lt {
    mf_dev_w16 w13, w2;
    const float *x;
    int n_tok;
    const float *tok_weight;   /* NULL: weight 1 */
    float limit;
    float *gu;                 /* [n_tok][2I] */
    mf_dev_lt_buf lt;
    float *y;
} mf_dev_ffn_lt;
int mf_dev_expert_ffn_lt(mf_dev_stream *s, const mf_dev_ffn_lt *a);

/* The expert FFN of several routed experts whose weights and rows are read from a slot table in
 * device memory when the work runs, not when it is enqueued: a graph captured once (e.g. the h2d
 * copy of the table from pinned memory, then this) replays with a new routing, new experts in
 * new cache slots, by rewriting the table's host copy. FP4 experts, int8 path only.
 * Slot s: the expert's packed weights at `base` (device memory of the stream's card; w1, w2, w3
 * codes and scales at part_off[0..5]), its rows [row0, row0 + n_tok) of x [.][n_in], tok_weight,
 * h [.][n_hidden] and y [.][n_in], its q8 scratch at q8_scratch + row0 * q8_row (q8_row >=
 * mf_dev_ffn_q8_bytes(1, n_in, n_hidden): a slot's rows' area, never another's while slots' row
 * ranges do not overlap; the scratch holds (rows) x q8_row bytes); n_tok 0: the slot is unused. Each used slot
 * computes exactly what mf_dev_expert_ffn computes for it. A slot with n_tok outside [0, max_tok]
 * is an asynchronous error on emulated cards (-EINVAL at the next status callback or sync) and
 * skipped on CUDA. */
typedef struct mf_dev_ffn_slot {
    uint64_t base;          /* device address of the expert's packed weights */
    int32_t row0, n_tok;
} mf_dev_ffn_slot;

typedef struct mf_dev_ffn_table {
    int n_in, n_hidden;             /* H (w1 and w3 inputs, w2 outputs), I */
    uint64_t part_off[6];           /* in a slot: w1 codes, w1 scales, w2 codes, w2 scales, w3 codes, w3 scales */
    const mf_dev_ffn_slot *table;   /* device memory, n_slots entries */
    int n_slots, max_tok;
    const float *x;
    const float *tok_weight;        /* NULL: weight 1 */
    float limit;
    float *h;
    void *q8_scratch;
    size_t q8_row;                  /* bytes of scratch a row: slot s's at q8_scratch + row0 * q8_row */
    float *y;
} mf_dev_ffn_table;
int mf_dev_expert_ffn_table(mf_dev_stream *s, const mf_dev_ffn_table *a);

/* Graph capture and replay of one stream (CUDA graphs; recorded operations on the emulated
 * device): between capture_begin and capture_end, work enqueued on s (copies, callbacks, kernels)
 * is recorded, not run; launching the graph enqueues the recorded work, with the same pointers and
 * arguments, on a stream of the same card, any number of times. While s captures, events and
 * sync on s are refused (-EBUSY), and nothing else (the scheduler) may enqueue on s. Only
 * single-stream capture: no fork/join through events. */
int mf_dev_capture_begin(mf_dev_stream *s);
int mf_dev_capture_end(mf_dev_stream *s, mf_dev_graph **out);
int mf_dev_graph_launch(mf_dev_graph *g, mf_dev_stream *s);
void mf_dev_graph_destroy(mf_dev_graph *g);

/* The scheduler's view of d: queue(device, kind) is mf_dev_stream_of(d, device, lane kind),
 * notify is mf_dev_stream_callback and notify_status mf_dev_stream_callback_status. Owned by d; valid until mf_dev_close. A task on a device
 * lane finds its stream in ctx->queue (an mf_dev_stream *). */
const mf_dev_lane_ops *mf_dev_lane_ops_of(mf_dev *d);

/* Emulated devices only: bytes in use on a card (-1 for other backends or a bad card). */
int64_t mf_dev_emu_used_bytes(const mf_dev *d, int card);
/* Emulated devices only, fault injection for tests: the nth host-to-device copy executed from now
 * on (any stream of any card; 1 = the next) copies the first half of its bytes and then fails
 * with -EIO ("injected failure ..."); 0 disarms. The spec option fail_h2d=N arms it at open.
 * -EINVAL for other backends. */
int mf_dev_emu_fail_h2d(mf_dev *d, int64_t nth);

#endif
