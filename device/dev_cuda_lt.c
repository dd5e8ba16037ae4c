/* The CUDA backend's cuBLASLt path (device/dev_cuda_lt.h): cublasLtMatmul over 16-bit weights
 * dequantized on the card (device/dev_lt_kernels.cu) and activations cast beside them, fp32
 * accumulation and output. A GEMM's descriptors and algorithm are made once per shape (sizes,
 * leading dimensions, type, pointer alignments, workspace) with cublasLtMatmulAlgoGetHeuristic
 * and kept in a per-card cache, so the per-token path allocates nothing after a shape's first call.
 * Every cuBLASLt call is checked with file and line. Compiled, not yet run on a GPU. */
#include "device/dev_cuda_lt.h"

#ifdef MOEFLOW_CUDA
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "device/dev_cuda_kern.h"
#include "device/kern_lt.h"
#include "sched/error.h"

/* Checks a cuBLASLt call: on failure returns -EIO with file, line, the call and cuBLASLt's message. */
#define LT_TRY(call)                                                                                 \
    do {                                                                                             \
        cublasStatus_t s_ = (call);                                                                  \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                             \
            return mf_error(-EIO, "%s:%d: %s: %s", __FILE__, __LINE__, #call, cublasLtGetStatusString(s_)); \
    } while (0)

#define LT_CACHE 128   /* shapes a card keeps: a model's dense linears and experts need a few dozen */

typedef struct lt_key {
    int m, n, k, type;
    int64_t lda, ldb, ldd;
    int align_a, align_b, align_d;
    size_t ws_bytes;
} lt_key;

typedef struct lt_plan {
    lt_key key;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, d;
    cublasLtMatmulAlgo_t algo;
} lt_plan;

struct mf_cuda_lt {
    int device;
    cublasLtHandle_t h;
    pthread_mutex_t mu;   /* the cache */
    int n;
    lt_plan plan[LT_CACHE];
};

int mf_cuda_lt_open(int device, mf_cuda_lt **out)
{
    mf_cuda_lt *lt = calloc(1, sizeof *lt);
    if (!lt) return mf_error(-ENOMEM, "cuBLASLt: out of host memory");
    lt->device = device;
    cublasStatus_t s = cublasLtCreate(&lt->h);
    if (s != CUBLAS_STATUS_SUCCESS) {
        free(lt);
        return mf_error(-EIO, "%s:%d: cublasLtCreate on cuda:%d: %s", __FILE__, __LINE__, device,
                        cublasLtGetStatusString(s));
    }
    pthread_mutex_init(&lt->mu, NULL);
    *out = lt;
    return 0;
}

static void lt_plan_free(lt_plan *p)
{
    if (p->op) cublasLtMatmulDescDestroy(p->op);
    if (p->a) cublasLtMatrixLayoutDestroy(p->a);
    if (p->b) cublasLtMatrixLayoutDestroy(p->b);
    if (p->d) cublasLtMatrixLayoutDestroy(p->d);
}

void mf_cuda_lt_close(mf_cuda_lt *lt)
{
    if (!lt) return;
    for (int i = 0; i < lt->n; i++) lt_plan_free(&lt->plan[i]);
    cublasLtDestroy(lt->h);
    pthread_mutex_destroy(&lt->mu);
    free(lt);
}

static int lt_align(const void *p)
{
    int a = 256;
    while (a > 1 && ((uintptr_t)p % (uintptr_t)a)) a >>= 1;
    return a;
}

/* The descriptors and algorithm of one shape: D (m x n, fp32, column-major, ld ldd) = alpha op(A) B
 * + beta D with A the weights as stored (row-major [m][k] 16-bit = column-major k x m, ld lda,
 * transposed), B the activations (column-major k x n: n tokens' rows of ldb codes), alpha and beta
 * device pointers, fp32 compute. */
static int lt_plan_make(mf_cuda_lt *lt, const lt_key *k, lt_plan *p)
{
    cudaDataType_t dt = k->type == MF_DEV_F16_FP16 ? CUDA_R_16F : CUDA_R_16BF;
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtPointerMode_t pm = CUBLASLT_POINTER_MODE_DEVICE;
    *p = (lt_plan){.key = *k};
    LT_TRY(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    LT_TRY(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_POINTER_MODE, &pm, sizeof pm));
    LT_TRY(cublasLtMatrixLayoutCreate(&p->a, dt, (uint64_t)k->k, (uint64_t)k->m, k->lda));
    LT_TRY(cublasLtMatrixLayoutCreate(&p->b, dt, (uint64_t)k->k, (uint64_t)k->n, k->ldb));
    LT_TRY(cublasLtMatrixLayoutCreate(&p->d, CUDA_R_32F, (uint64_t)k->m, (uint64_t)k->n, k->ldd));
    cublasLtMatmulPreference_t pref = NULL;
    LT_TRY(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t ws = k->ws_bytes;
    uint32_t aa = (uint32_t)k->align_a, ab = (uint32_t)k->align_b, ad = (uint32_t)k->align_d;
    cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof aa);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof ab);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ad, sizeof ad);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ad, sizeof ad);
    cublasLtMatmulHeuristicResult_t res;
    int n_res = 0;
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulAlgoGetHeuristic(lt->h, p->op, p->a, p->b, p->d, p->d, pref, 1, &res, &n_res);
    cublasLtMatmulPreferenceDestroy(pref);
    if (s != CUBLAS_STATUS_SUCCESS)
        return mf_error(-EIO, "%s:%d: cuBLASLt preference or cublasLtMatmulAlgoGetHeuristic (%d x %d x %d): %s",
                        __FILE__, __LINE__, k->m, k->n, k->k, cublasLtGetStatusString(s));
    if (n_res < 1)
        return mf_error(-ENOTSUP, "cuBLASLt on cuda:%d: no algorithm for a %s GEMM of %d x %d x %d (lds %lld, %lld, "
                        "%lld; alignments %d, %d, %d; workspace %zu bytes)", lt->device,
                        k->type == MF_DEV_F16_FP16 ? "fp16" : "bf16", k->m, k->n, k->k, (long long)k->lda,
                        (long long)k->ldb, (long long)k->ldd, k->align_a, k->align_b, k->align_d, k->ws_bytes);
    p->algo = res.algo;
    return 0;
}

static int lt_key_eq(const lt_key *x, const lt_key *y)
{
    return x->m == y->m && x->n == y->n && x->k == y->k && x->type == y->type && x->lda == y->lda &&
           x->ldb == y->ldb && x->ldd == y->ldd && x->align_a == y->align_a && x->align_b == y->align_b &&
           x->align_d == y->align_d && x->ws_bytes == y->ws_bytes;
}

/* D = alpha op(A) B + beta D (lt_plan_make's shapes) with the shape's cached plan; a shape met when
 * the cache is full gets a plan for this call only. */
static int lt_matmul(mf_cuda_lt *lt, cudaStream_t st, int type, int m, int n, int k, const void *A, int64_t lda,
                     const void *B, int64_t ldb, float *D, int64_t ldd, const float *alpha, const float *beta,
                     const mf_dev_lt_buf *buf)
{
    lt_key key = {m, n, k, type, lda, ldb, ldd, lt_align(A), lt_align(B), lt_align(D), buf->ws ? buf->ws_bytes : 0};
    lt_plan once, *p = NULL;
    int rc = 0;
    pthread_mutex_lock(&lt->mu);
    for (int i = 0; i < lt->n && !p; i++)
        if (lt_key_eq(&lt->plan[i].key, &key)) p = &lt->plan[i];
    if (!p && lt->n < LT_CACHE) {
        rc = lt_plan_make(lt, &key, &lt->plan[lt->n]);
        if (!rc) p = &lt->plan[lt->n++];
        else lt_plan_free(&lt->plan[lt->n]);
    }
    pthread_mutex_unlock(&lt->mu);
    if (rc) return rc;
    if (!p) {
        if ((rc = lt_plan_make(lt, &key, &once))) {
            lt_plan_free(&once);
            return rc;
        }
        p = &once;
    }
    cublasStatus_t s = cublasLtMatmul(lt->h, p->op, alpha, A, p->a, B, p->b, beta, D, p->d, D, p->d, &p->algo,
                                      key.ws_bytes ? buf->ws : NULL, key.ws_bytes, st);
    if (p == &once) lt_plan_free(&once);
    if (s != CUBLAS_STATUS_SUCCESS)
        return mf_error(-EIO, "%s:%d: cublasLtMatmul (%d x %d x %d) on cuda:%d: %s", __FILE__, __LINE__, m, n, k,
                        lt->device, cublasLtGetStatusString(s));
    return 0;
}

/* The cast header's alpha and beta, and its codes. */
static const float *lt_alpha(const void *x16) { return (const float *)x16 + 1; }
static const float *lt_beta(const void *x16) { return (const float *)x16 + 2; }
static const uint16_t *lt_codes(const void *x16) { return (const uint16_t *)((const char *)x16 + MF_LT_HDR_BYTES); }

int mf_cuda_lt_linear(mf_cuda_lt *lt, void *stream, const mf_dev_lin *a)
{
    int n_in = a->w.n_in;
    int64_t cols = a->group_rows ? (a->row0 + a->w.n_out - 1) / a->group_rows * n_in + n_in : n_in;
    int rc = mf_cuda_kern_lt_cast(stream, a->w16.type, a->x, a->n_tok, a->ld_x, cols, a->w16.shift, a->lt.x16);
    for (int i = 0; i < a->w.n_out && !rc;) {   /* the rows of one group at a time */
        int64_t g = a->group_rows ? (a->row0 + i) / a->group_rows : 0;
        int64_t end = a->group_rows ? (g + 1) * a->group_rows - a->row0 : a->w.n_out;
        int i1 = end < a->w.n_out ? (int)end : a->w.n_out;
        rc = lt_matmul(lt, (cudaStream_t)stream, a->w16.type, i1 - i, a->n_tok, n_in,
                       (const uint16_t *)a->w16.w + (size_t)i * n_in, n_in, lt_codes(a->lt.x16) + g * n_in, cols,
                       a->y + i, a->ld_y, lt_alpha(a->lt.x16), lt_beta(a->lt.x16), &a->lt);
        i = i1;
    }
    return rc;
}

int mf_cuda_lt_ffn(mf_cuda_lt *lt, void *stream, const mf_dev_ffn_lt *a)
{
    int H = a->w13.n_in, I = a->w13.n_out / 2, T = a->n_tok;
    cudaStream_t st = (cudaStream_t)stream;
    int rc = mf_cuda_kern_lt_cast(stream, a->w13.type, a->x, T, H, H, a->w13.shift, a->lt.x16);
    if (!rc)
        rc = lt_matmul(lt, st, a->w13.type, 2 * I, T, H, a->w13.w, H, lt_codes(a->lt.x16), H, a->gu, 2 * I,
                       lt_alpha(a->lt.x16), lt_beta(a->lt.x16), &a->lt);
    if (!rc) rc = mf_cuda_kern_lt_gate(stream, a->gu, T, I, a->tok_weight, a->limit);
    if (!rc) rc = mf_cuda_kern_lt_cast(stream, a->w2.type, a->gu, T, 2 * I, I, a->w2.shift, a->lt.x16);
    if (!rc)
        rc = lt_matmul(lt, st, a->w2.type, H, T, I, a->w2.w, I, lt_codes(a->lt.x16), I, a->y, H, lt_alpha(a->lt.x16),
                       lt_beta(a->lt.x16), &a->lt);
    return rc;
}

#endif
