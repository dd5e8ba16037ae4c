/* The CUDA backend of device/dev.h: per card three non-blocking streams (copy-in, compute,
 * copy-out, named for Nsight through NVTX), events for cross-stream dependencies
 * (cudaStreamWaitEvent, never a host polling loop), cudaMemcpyAsync / cudaMemcpyPeerAsync copies,
 * portable pinned host memory bound to the card's NUMA node, and two kinds of callbacks: status
 * callbacks for the scheduler (cudaStreamAddCallback, which CUDA still calls after a context fault,
 * with the error) and plain ones (cudaLaunchHostFunc, capturable into graphs, but never called
 * after a fault). Every CUDA call is checked with file and line. Kernels in
 * device/dev_kernels.cu (fp32 and int8 FP4 paths); the cuBLASLt path in device/dev_cuda_lt.c (a
 * handle and a GEMM plan cache per card, made at open). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "device/dev_cuda_kern.h"
#include "device/dev_cuda_lt.h"
#include "device/dev_impl.h"
#include "device/numa.h"
#include "sched/error.h"

#ifdef MOEFLOW_CUDA
#include <cuda_runtime.h>
#include <nvtx3/nvToolsExtCudaRt.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>

/* Checks a CUDA call: on failure returns -EIO with file, line, the call and CUDA's message. */
#define CU_TRY(call)                                                                           \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess)                                                                 \
            return mf_error(-EIO, "%s:%d: %s: %s", __FILE__, __LINE__, #call,                  \
                            cudaGetErrorString(e_));                                           \
    } while (0)
/* The same for teardown paths that cannot return a code: records the message and goes on. */
#define CU_NOTE(call)                                                                          \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess)                                                                 \
            mf_error(-EIO, "%s:%d: %s: %s", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
    } while (0)

/* A status callback in flight: the caller's fn and arg, and room for the message it receives.
 * Kept on the stream's free list between uses, so a callback allocates only when more are in
 * flight than ever before. */
typedef struct cu_cb {
    void (*fn)(void *, int, const char *);
    void *arg;
    struct cu_stream *s;
    struct cu_cb *next;      /* the free list */
    struct cu_cb *all;       /* every record of the stream, freed at close */
    char msg[384];
} cu_cb;

typedef struct cu_stream {
    mf_dev_stream pub;
    cudaStream_t st;
    int id;                  /* CUDA device ordinal */
    pthread_mutex_t cb_mu;   /* cb_free, cb_all */
    cu_cb *cb_free, *cb_all;
} cu_stream;

typedef struct cu_event {
    mf_dev_event pub;
    cudaEvent_t ev;
} cu_event;

typedef struct cu_alloc {    /* allocations left at close are freed there */
    void *p;
    int card;                /* -1: pinned host memory */
    size_t n_bytes;
    int numa;                /* pinned host memory: 1 when NUMA-bound and registered */
    struct cu_alloc *next;
} cu_alloc;

typedef struct cu_dev {
    mf_dev pub;
    int ids[MF_DEV_MAX_CARDS];
    int node[MF_DEV_MAX_CARDS];   /* the card's NUMA node, -1 unknown */
    _Atomic int numa_off[MF_DEV_MAX_CARDS];   /* 1: binding to the node failed once; cudaHostAlloc */
    cu_stream streams[MF_DEV_MAX_CARDS][MF_DEV_N_STREAMS];
    mf_cuda_lt *lt[MF_DEV_MAX_CARDS];   /* the cuBLASLt path's handle and plans (NULL: no tensor cores) */
    pthread_mutex_t mu;      /* allocs */
    cu_alloc *allocs;
} cu_dev;

static const char *cu_stream_name[MF_DEV_N_STREAMS] = {"copy-in", "compute", "copy-out"};

static int cu_track(cu_dev *d, void *p, int card, size_t n_bytes, int numa)
{
    cu_alloc *a = malloc(sizeof *a);
    if (!a) return mf_error(-ENOMEM, "cuda device: out of host memory for bookkeeping");
    a->p = p;
    a->card = card;
    a->n_bytes = n_bytes;
    a->numa = numa;
    pthread_mutex_lock(&d->mu);
    a->next = d->allocs;
    d->allocs = a;
    pthread_mutex_unlock(&d->mu);
    return 0;
}

/* Forgets p (its record copied to *rec); 0 when it was tracked (as card), -1 when it was not. */
static int cu_untrack(cu_dev *d, void *p, int card, cu_alloc *rec)
{
    int rc = -1;
    pthread_mutex_lock(&d->mu);
    for (cu_alloc **pp = &d->allocs; *pp; pp = &(*pp)->next)
        if ((*pp)->p == p && (*pp)->card == card) {
            cu_alloc *a = *pp;
            *pp = a->next;
            *rec = *a;
            free(a);
            rc = 0;
            break;
        }
    pthread_mutex_unlock(&d->mu);
    return rc;
}

static int cu_alloc_dev(mf_dev *pd, int card, size_t n_bytes, void **out)
{
    cu_dev *d = (cu_dev *)pd;
    CU_TRY(cudaSetDevice(d->ids[card]));
    cudaError_t e = cudaMalloc(out, n_bytes);
    if (e != cudaSuccess) {
        size_t free_b = 0, total_b = 0;
        (void)cudaGetLastError();   /* clear the (non-sticky) allocation error */
        cudaMemGetInfo(&free_b, &total_b);
        *out = NULL;
        return mf_error(e == cudaErrorMemoryAllocation ? -ENOMEM : -EIO,
                        "%s:%d: cudaMalloc of %zu bytes on card %d (cuda:%d): %s (%zu of %zu bytes "
                        "free)", __FILE__, __LINE__, n_bytes, card, d->ids[card],
                        cudaGetErrorString(e), free_b, total_b);
    }
    int rc = cu_track(d, *out, card, n_bytes, 0);
    if (rc) {
        cudaFree(*out);
        *out = NULL;
    }
    return rc;
}

static void cu_free_dev(mf_dev *pd, int card, void *p)
{
    cu_dev *d = (cu_dev *)pd;
    cu_alloc rec;
    if (cu_untrack(d, p, card, &rec)) {
        mf_error(-EINVAL, "mf_dev_free: %p is not an allocation of card %d (left alone)", p, card);
        return;
    }
    CU_NOTE(cudaSetDevice(d->ids[card]));
    CU_NOTE(cudaFree(p));
}

/* Frees pinned memory as it was made. */
static void cu_host_release(void *p, size_t n_bytes, int numa)
{
    if (numa) {
        CU_NOTE(cudaHostUnregister(p));
        mf_dev_numa_free(p, n_bytes);
    } else {
        CU_NOTE(cudaFreeHost(p));
    }
}

/* Binds n_bytes to the card's node and registers them (0), or says why not (a negative code, the
 * message in mf_last_error()). */
static int cu_host_alloc_numa(cu_dev *d, int card, size_t n_bytes, void **out)
{
    int rc = mf_dev_numa_alloc(n_bytes, d->node[card], out);
    if (rc) return rc;
    cudaError_t e = cudaHostRegister(*out, n_bytes, cudaHostRegisterPortable);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        mf_dev_numa_free(*out, n_bytes);
        *out = NULL;
        return mf_error(-ENOMEM, "%s:%d: cudaHostRegister of %zu bytes on node %d: %s", __FILE__,
                        __LINE__, n_bytes, d->node[card], cudaGetErrorString(e));
    }
    return 0;
}

/* Pinned memory, portable so every card's copies treat it as pinned. On a card whose NUMA node is
 * known it is bound to that node and then registered; where the node is unknown, or binding or
 * registering fails (a VM kernel without NUMA policy), cudaHostAlloc places it: the first failure
 * on a card is said once on stderr and that card uses cudaHostAlloc from then on. */
static int cu_host_alloc(mf_dev *pd, int card, size_t n_bytes, void **out)
{
    cu_dev *d = (cu_dev *)pd;
    int numa = d->node[card] >= 0 && !atomic_load(&d->numa_off[card]);
    CU_TRY(cudaSetDevice(d->ids[card]));
    if (numa && cu_host_alloc_numa(d, card, n_bytes, out)) {
        numa = 0;
        if (!atomic_exchange(&d->numa_off[card], 1))
            fprintf(stderr, "moeflow: cuda card %d (cuda:%d): pinned staging on NUMA node %d failed "
                    "(%s); pinned staging falls back to cudaHostAlloc (placed by the driver)\n",
                    card, d->ids[card], d->node[card], mf_last_error());
        mf_error_clear();
    }
    if (!numa) {
        cudaError_t e = cudaHostAlloc(out, n_bytes, cudaHostAllocPortable);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            *out = NULL;
            return mf_error(-ENOMEM, "%s:%d: cudaHostAlloc of %zu pinned bytes for card %d: %s",
                            __FILE__, __LINE__, n_bytes, card, cudaGetErrorString(e));
        }
    }
    int rc = cu_track(d, *out, -1, n_bytes, numa);
    if (rc) {
        cu_host_release(*out, n_bytes, numa);
        *out = NULL;
    }
    return rc;
}

static void cu_host_free(mf_dev *pd, void *p)
{
    cu_alloc rec;
    if (cu_untrack((cu_dev *)pd, p, -1, &rec)) {
        mf_error(-EINVAL, "mf_dev_host_free: %p is not pinned memory of this device (left alone)", p);
        return;
    }
    cu_host_release(p, rec.n_bytes, rec.numa);
}

static int cu_copy(mf_dev_stream *ps, mf_dev_copy_kind k, int dst_card, void *dst, int src_card,
                   const void *src, size_t n_bytes)
{
    cu_stream *s = (cu_stream *)ps;
    cu_dev *d = (cu_dev *)ps->dev;
    CU_TRY(cudaSetDevice(s->id));
    if (k == MF_DEV_H2D) CU_TRY(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyHostToDevice, s->st));
    else if (k == MF_DEV_D2H) CU_TRY(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyDeviceToHost, s->st));
    else if (dst_card == src_card) CU_TRY(cudaMemcpyAsync(dst, src, n_bytes, cudaMemcpyDeviceToDevice, s->st));
    else CU_TRY(cudaMemcpyPeerAsync(dst, d->ids[dst_card], src, d->ids[src_card], n_bytes, s->st));
    return 0;
}

static int cu_copy_2d(mf_dev_stream *ps, mf_dev_copy_kind k, void *dst, size_t dst_pitch, const void *src,
                      size_t src_pitch, size_t width, size_t height)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    CU_TRY(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height,
                             k == MF_DEV_H2D ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, s->st));
    return 0;
}

static int cu_event_create(mf_dev *pd, int card, int timed, mf_dev_event **out)
{
    cu_dev *d = (cu_dev *)pd;
    cu_event *e = calloc(1, sizeof *e);
    if (!e) return mf_error(-ENOMEM, "cuda card %d: out of host memory for an event", card);
    e->pub.dev = pd;
    e->pub.card = card;
    cudaError_t err = cudaSetDevice(d->ids[card]);
    if (err == cudaSuccess)
        err = cudaEventCreateWithFlags(&e->ev, timed ? cudaEventDefault : cudaEventDisableTiming);
    if (err != cudaSuccess) {
        free(e);
        return mf_error(-EIO, "%s:%d: cudaEventCreateWithFlags on card %d: %s", __FILE__, __LINE__,
                        card, cudaGetErrorString(err));
    }
    *out = &e->pub;
    return 0;
}

/* cudaEventDestroy returns at once; CUDA releases the event when work naming it is done. */
static void cu_event_destroy(mf_dev_event *pe)
{
    cu_event *e = (cu_event *)pe;
    CU_NOTE(cudaSetDevice(((cu_dev *)pe->dev)->ids[pe->card]));
    CU_NOTE(cudaEventDestroy(e->ev));
    free(e);
}

static int cu_event_record(mf_dev_event *pe, mf_dev_stream *ps)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    CU_TRY(cudaEventRecord(((cu_event *)pe)->ev, s->st));
    return 0;
}

static int cu_stream_wait(mf_dev_stream *ps, mf_dev_event *pe)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    CU_TRY(cudaStreamWaitEvent(s->st, ((cu_event *)pe)->ev, 0));
    return 0;
}

/* Waits for end, then cudaEventElapsedTime (milliseconds as a float). */
static int cu_event_elapsed(mf_dev_event *start, mf_dev_event *end, int64_t *out_ns)
{
    float ms = 0;
    CU_TRY(cudaSetDevice(((cu_dev *)end->dev)->ids[end->card]));
    CU_TRY(cudaEventSynchronize(((cu_event *)end)->ev));
    CU_TRY(cudaEventElapsedTime(&ms, ((cu_event *)start)->ev, ((cu_event *)end)->ev));
    *out_ns = (int64_t)((double)ms * 1e6);
    return 0;
}

static int cu_callback(mf_dev_stream *ps, void (*fn)(void *), void *arg)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    CU_TRY(cudaLaunchHostFunc(s->st, fn, arg));
    return 0;
}

/* Runs on CUDA's callback thread, also after an error in the context (status then names it). */
static void CUDART_CB cu_status_tramp(cudaStream_t st, cudaError_t status, void *ud)
{
    (void)st;
    cu_cb *c = ud;
    cu_stream *s = c->s;
    int err = 0;
    if (status != cudaSuccess) {
        err = -EIO;
        snprintf(c->msg, sizeof c->msg, "cuda card %d (cuda:%d) %s stream: work enqueued before "
                 "this completion failed: %s: %s (a sticky fault of the card: later work fails too)",
                 s->pub.card, s->id, cu_stream_name[s->pub.kind], cudaGetErrorName(status),
                 cudaGetErrorString(status));
    }
    c->fn(c->arg, err, err ? c->msg : NULL);
    pthread_mutex_lock(&s->cb_mu);
    c->next = s->cb_free;
    s->cb_free = c;
    pthread_mutex_unlock(&s->cb_mu);
}

/* cudaStreamAddCallback: not capturable (-EBUSY while s captures; plain callbacks are). */
static int cu_callback_status(mf_dev_stream *ps, void (*fn)(void *, int, const char *), void *arg)
{
    cu_stream *s = (cu_stream *)ps;
    if (ps->capturing)
        return mf_error(-EBUSY, "cuda card %d: a status callback cannot be captured into a graph "
                        "(cudaStreamAddCallback); use mf_dev_stream_callback", ps->card);
    pthread_mutex_lock(&s->cb_mu);
    cu_cb *c = s->cb_free;
    if (c) {
        s->cb_free = c->next;
    } else if ((c = calloc(1, sizeof *c))) {
        c->s = s;
        c->all = s->cb_all;
        s->cb_all = c;
    }
    pthread_mutex_unlock(&s->cb_mu);
    if (!c) return mf_error(-ENOMEM, "cuda card %d: out of host memory for a callback", ps->card);
    c->fn = fn;
    c->arg = arg;
    cudaError_t e = cudaSetDevice(s->id);
    if (e == cudaSuccess) e = cudaStreamAddCallback(s->st, cu_status_tramp, c, 0);
    if (e != cudaSuccess) {
        pthread_mutex_lock(&s->cb_mu);
        c->next = s->cb_free;
        s->cb_free = c;
        pthread_mutex_unlock(&s->cb_mu);
        return mf_error(-EIO, "%s:%d: cudaStreamAddCallback on card %d: %s", __FILE__, __LINE__,
                        ps->card, cudaGetErrorString(e));
    }
    return 0;
}

static int cu_stream_sync(mf_dev_stream *ps)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    CU_TRY(cudaStreamSynchronize(s->st));
    return 0;
}

/* Kernels (device/dev_kernels.cu): FP4 on the fp32 or (q8 scratch given) int8 path, FP8. */
static int cu_fp4_matmul(mf_dev_stream *ps, const mf_kern_mat *w, const float *x, int n_tok,
                         float *y, void *q8)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    if (q8) return mf_cuda_kern_fp4_q8(s->st, w, x, n_tok, y, q8);
    return mf_cuda_kern_matmul(s->st, w, x, n_tok, y);
}

static int cu_fp8_matmul(mf_dev_stream *ps, const mf_kern_mat *w, const float *x, int n_tok, float *y)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    return mf_cuda_kern_matmul(s->st, w, x, n_tok, y);
}

static int cu_bf16_matmul(mf_dev_stream *ps, const mf_kern_mat *w, const float *x, int n_tok, float *y)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    return mf_cuda_kern_matmul(s->st, w, x, n_tok, y);
}

static int cu_expert_ffn(mf_dev_stream *ps, const mf_dev_ffn *a)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    return mf_cuda_kern_ffn(s->st, a);
}

static int cu_expert_ffn_table(mf_dev_stream *ps, const mf_dev_ffn_table *a)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    return mf_cuda_kern_ffn_table(s->st, a);
}

/* The dense ops (device/dev_kernels.cu: warp-per-row and tiled FP8/BF16 linears, elementwise
 * roundings). A linear's kernel: mf_dev_lin.path (AUTO: tiled from MF_DEV_LIN_TILED_MIN_TOK tokens
 * where it applies). */
static int cu_linear(mf_dev_stream *ps, const mf_dev_lin *a)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    if (a->path == MF_DEV_LIN_CUBLASLT) return mf_cuda_lt_linear(((cu_dev *)ps->dev)->lt[ps->card], s->st, a);
    return mf_cuda_kern_linear(s->st, a, mf_dev_lin_use_tiled(a->path, a->n_tok, mf_dev_lin_tiled_ok(a)));
}

/* The cuBLASLt path (device/dev_lt_kernels.cu, device/dev_cuda_lt.c); device/dev.c checked that the
 * card has tensor cores of the type asked. */
static int cu_dequant(mf_dev_stream *ps, const mf_kern_mat *w, const mf_dev_w16 *out)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    return mf_cuda_kern_lt_dequant(s->st, w, out);
}

static int cu_expert_ffn_lt(mf_dev_stream *ps, const mf_dev_ffn_lt *a)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    return mf_cuda_lt_ffn(((cu_dev *)ps->dev)->lt[ps->card], s->st, a);
}

static int cu_round_bf16(mf_dev_stream *ps, float *y, int n_tok, int64_t ld, int n)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    return mf_cuda_kern_round_bf16(s->st, y, n_tok, ld, n);
}

static int cu_bf16_cast(mf_dev_stream *ps, int pack, float *x, int64_t ld_x, uint16_t *y, int64_t ld_y, int n_tok,
                        int n)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    return mf_cuda_kern_bf16_cast(s->st, pack, x, ld_x, y, ld_y, n_tok, n);
}

static int cu_ffn_up(mf_dev_stream *ps, const mf_dev_up *a)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    return mf_cuda_kern_ffn_up(s->st, a, mf_dev_lin_use_tiled(a->path, a->n_tok, 1));
}

static int cu_swiglu_bf16(mf_dev_stream *ps, const float *g, const float *u, int n_tok, int64_t ld, int n,
                          float limit, float *h)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    return mf_cuda_kern_swiglu_bf16(s->st, g, u, n_tok, ld, n, limit, h);
}

static int cu_attn_heads(mf_dev_stream *ps, const mf_dev_attn *a)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    return mf_cuda_kern_attn_heads(s->st, a);
}

static int cu_index_scores(mf_dev_stream *ps, const mf_dev_iscore *a)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    return mf_cuda_kern_index_scores(s->st, a);
}

/* Capture: cudaStreamBeginCapture in thread-local mode (other threads' unsafe calls are not
 * disturbed), instantiated once at the end, launched with cudaGraphLaunch. */
typedef struct cu_graph {
    mf_dev_graph pub;
    cudaGraph_t g;
    cudaGraphExec_t exec;
} cu_graph;

static int cu_capture_begin(mf_dev_stream *ps)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    CU_TRY(cudaStreamBeginCapture(s->st, cudaStreamCaptureModeThreadLocal));
    return 0;
}

static int cu_capture_end(mf_dev_stream *ps, mf_dev_graph **out)
{
    cu_stream *s = (cu_stream *)ps;
    cudaGraph_t g = NULL;
    CU_TRY(cudaSetDevice(s->id));
    CU_TRY(cudaStreamEndCapture(s->st, &g));
    cu_graph *cg = calloc(1, sizeof *cg);
    if (!cg) {
        cudaGraphDestroy(g);
        return mf_error(-ENOMEM, "cuda card %d: out of host memory for a graph", ps->card);
    }
    cudaError_t e = cudaGraphInstantiate(&cg->exec, g, 0);
    if (e != cudaSuccess) {
        cudaGraphDestroy(g);
        free(cg);
        return mf_error(-EIO, "%s:%d: cudaGraphInstantiate on card %d: %s", __FILE__, __LINE__,
                        ps->card, cudaGetErrorString(e));
    }
    cg->pub = (mf_dev_graph){.dev = ps->dev, .card = ps->card};
    cg->g = g;
    *out = &cg->pub;
    return 0;
}

static int cu_graph_launch(mf_dev_graph *pg, mf_dev_stream *ps)
{
    cu_stream *s = (cu_stream *)ps;
    CU_TRY(cudaSetDevice(s->id));
    CU_TRY(cudaGraphLaunch(((cu_graph *)pg)->exec, s->st));
    return 0;
}

static void cu_graph_destroy(mf_dev_graph *pg)
{
    cu_graph *g = (cu_graph *)pg;
    CU_NOTE(cudaGraphExecDestroy(g->exec));
    CU_NOTE(cudaGraphDestroy(g->g));
    free(g);
}

static void cu_close(mf_dev *pd)
{
    cu_dev *d = (cu_dev *)pd;
    int faulted = 0;
    for (int c = 0; c < pd->n_cards; c++)
        for (int k = 0; k < MF_DEV_N_STREAMS; k++) {
            cu_stream *s = &d->streams[c][k];
            if (!s->st) continue;
            CU_NOTE(cudaSetDevice(s->id));
            cudaError_t e = cudaStreamSynchronize(s->st);
            if (e != cudaSuccess) {
                faulted = 1;
                mf_error(-EIO, "%s:%d: cudaStreamSynchronize at close: %s", __FILE__, __LINE__,
                         cudaGetErrorString(e));
            }
            CU_NOTE(cudaStreamDestroy(s->st));
        }
    for (int c = 0; c < pd->n_cards; c++)
        if (d->lt[c]) {
            CU_NOTE(cudaSetDevice(d->ids[c]));
            mf_cuda_lt_close(d->lt[c]);
        }
    /* after a fault, status callbacks may still be running on CUDA's thread and touch their
     * stream: the streams' records and d itself are left (a leak only on a faulted card) */
    for (int c = 0; c < pd->n_cards && !faulted; c++)
        for (int k = 0; k < MF_DEV_N_STREAMS; k++) {
            cu_stream *s = &d->streams[c][k];
            for (cu_cb *b = s->cb_all, *nx; b; b = nx) {
                nx = b->all;
                free(b);
            }
            if (s->pub.dev) pthread_mutex_destroy(&s->cb_mu);
        }
    for (cu_alloc *a = d->allocs, *nx; a; a = nx) {
        nx = a->next;
        if (a->card < 0) {
            cu_host_release(a->p, a->n_bytes, a->numa);
        } else {
            CU_NOTE(cudaSetDevice(d->ids[a->card]));
            CU_NOTE(cudaFree(a->p));
        }
        free(a);
    }
    pthread_mutex_destroy(&d->mu);
    if (!faulted) free(d);
}

static const mf_dev_ops cu_ops = {
    .kind = "cuda",
    .close = cu_close,
    .alloc = cu_alloc_dev,
    .free = cu_free_dev,
    .host_alloc = cu_host_alloc,
    .host_free = cu_host_free,
    .copy = cu_copy,
    .event_create = cu_event_create,
    .event_destroy = cu_event_destroy,
    .event_record = cu_event_record,
    .stream_wait = cu_stream_wait,
    .event_elapsed = cu_event_elapsed,
    .callback = cu_callback,
    .callback_status = cu_callback_status,
    .stream_sync = cu_stream_sync,
    .fp4_matmul = cu_fp4_matmul,
    .fp8_matmul = cu_fp8_matmul,
    .bf16_matmul = cu_bf16_matmul,
    .expert_ffn = cu_expert_ffn,
    .expert_ffn_table = cu_expert_ffn_table,
    .linear = cu_linear,
    .round_bf16 = cu_round_bf16,
    .bf16_cast = cu_bf16_cast,
    .ffn_up = cu_ffn_up,
    .swiglu_bf16 = cu_swiglu_bf16,
    .attn_heads = cu_attn_heads,
    .index_scores = cu_index_scores,
    .dequant = cu_dequant,
    .expert_ffn_lt = cu_expert_ffn_lt,
    .capture_begin = cu_capture_begin,
    .capture_end = cu_capture_end,
    .graph_launch = cu_graph_launch,
    .graph_destroy = cu_graph_destroy,
    .copy_2d = cu_copy_2d,
};

/* Creates the streams of every card and turns on peer access between cards that support it. */
static int cu_setup(cu_dev *d)
{
    for (int c = 0; c < d->pub.n_cards; c++) {
        char bus[32];
        CU_TRY(cudaSetDevice(d->ids[c]));
        CU_TRY(cudaDeviceGetPCIBusId(bus, (int)sizeof bus, d->ids[c]));
        d->node[c] = mf_dev_pci_numa_node(bus);
        /* tensor cores: fp16 with fp32 accumulation from sm_70, bf16 from sm_80 (the cuBLASLt path) */
        int major = 0;
        CU_TRY(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d->ids[c]));
        d->pub.f16[c] = major >= 8 ? MF_DEV_F16_BF16 : major == 7 ? MF_DEV_F16_FP16 : MF_DEV_F16_NONE;
        if (d->pub.f16[c] != MF_DEV_F16_NONE) {
            int rc = mf_cuda_lt_open(d->ids[c], &d->lt[c]);
            if (rc) return rc;
        }
        for (int k = 0; k < MF_DEV_N_STREAMS; k++) {
            cu_stream *s = &d->streams[c][k];
            s->pub = (mf_dev_stream){.dev = &d->pub, .card = c, .kind = (mf_dev_stream_kind)k};
            s->id = d->ids[c];
            pthread_mutex_init(&s->cb_mu, NULL);
            CU_TRY(cudaStreamCreateWithFlags(&s->st, cudaStreamNonBlocking));
            char name[64];
            snprintf(name, sizeof name, "card%d.%s", c, cu_stream_name[k]);
            nvtxNameCudaStreamA(s->st, name);
            d->pub.streams[c][k] = &s->pub;
        }
        for (int o = 0; o < d->pub.n_cards; o++) {
            int can = 0;
            if (d->ids[o] == d->ids[c]) continue;   /* the same GPU (a card named twice) */
            CU_TRY(cudaDeviceCanAccessPeer(&can, d->ids[c], d->ids[o]));
            if (!can) continue;   /* peer copies then go through host memory, still correct */
            cudaError_t e = cudaDeviceEnablePeerAccess(d->ids[o], 0);
            if (e == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError();
            else CU_TRY(e);
        }
    }
    return 0;
}

int mf_dev_open_cuda(const char *cards, mf_dev **out)
{
    int n_visible = 0;
    cudaError_t e = cudaGetDeviceCount(&n_visible);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || (e == cudaSuccess && !n_visible))
        return mf_error(-ENODEV, "device spec 'cuda': no CUDA card is visible (%s)",
                        e == cudaSuccess ? "the driver reports 0" : cudaGetErrorString(e));
    CU_TRY(e);
    cu_dev *d = calloc(1, sizeof *d);
    if (!d) return mf_error(-ENOMEM, "cuda device: out of host memory");
    d->pub.ops = &cu_ops;
    pthread_mutex_init(&d->mu, NULL);
    int rc = 0;
    if (!cards) {
        d->pub.n_cards = n_visible < MF_DEV_MAX_CARDS ? n_visible : MF_DEV_MAX_CARDS;
        for (int c = 0; c < d->pub.n_cards; c++) d->ids[c] = c;
    } else {
        const char *p = cards;
        while (!rc) {
            char *end;
            long id = strtol(p, &end, 10);
            if (end == p || (*end && *end != ',') || d->pub.n_cards >= MF_DEV_MAX_CARDS)
                rc = mf_error(-EINVAL, "device spec 'cuda:%s': expected card numbers separated by "
                              "commas (at most %d)", cards, MF_DEV_MAX_CARDS);
            else if (id < 0 || id >= n_visible)
                rc = mf_error(-ENODEV, "device spec 'cuda:%s': card %ld does not exist (%d visible)",
                              cards, id, n_visible);
            if (rc) break;   /* a card named twice is two logical cards (own streams) on one GPU */
            d->ids[d->pub.n_cards++] = (int)id;
            if (!*end) break;
            p = end + 1;
        }
    }
    if (!rc) rc = cu_setup(d);
    if (rc) {
        cu_close(&d->pub);
        return rc;
    }
    *out = &d->pub;
    return 0;
}

#else /* !MOEFLOW_CUDA */

int mf_dev_open_cuda(const char *cards, mf_dev **out)
{
    (void)cards;
    (void)out;
    return mf_error(-ENOSYS, "device spec 'cuda': this moeflow was built without CUDA (configure "
                    "with nvcc on PATH, or use \"emu:N\")");
}

#endif
