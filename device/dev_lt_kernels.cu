/* The cuBLASLt path's own kernels (device/dev.h "The cuBLASLt path"; the GEMMs themselves are
 * cublasLtMatmul calls in device/dev_cuda_lt.c): a weight's FP8 or FP4 codes dequantized into a
 * scratch of 16-bit floats, the activations' largest |x| and their cast to 16 bits (with the GEMM's
 * alpha written beside them), and the expert FFN's gating between its two GEMMs. Every value is
 * device/kern_lt.h's arithmetic, which tests/test_dev_kmath.c holds to the host's decode;
 * compiled for sm_75 and sm_90, not yet run on a GPU. */
#include <cuda_runtime.h>
#include <errno.h>

extern "C" {
#include "device/dev_cuda_kern.h"
#include "device/kern_lt.h"
#include "host/kern_gate.h"
#include "sched/error.h"
}

#define LT_THREADS 256
#define LT_PER 8   /* weights (or activations) a thread converts at a time: one 16-byte store */

static int lt_launched(const char *what, int line)
{
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return mf_error(-EIO, "%s:%d: %s launch: %s", __FILE__, line, what, cudaGetErrorString(e));
    return 0;
}

static unsigned lt_blocks(long long items)
{
    long long b = (items + LT_THREADS - 1) / LT_THREADS;
    return (unsigned)(b < 1 ? 1 : b > 65535 * 8 ? 65535 * 8 : b);   /* grid-stride beyond */
}

/* Dequantization: thread i takes weights [8 i, 8 i + 8) of the matrix in row-major order (n_in is a
 * multiple of 32, so 8 never straddle a row or a 32-column block): one scale code, eight codes. */
template <int FMT>
__global__ static void k_lt_dequant(const uint8_t *__restrict__ w, const uint8_t *__restrict__ scale, int n_out,
                                    int n_in, int type, int shift, uint16_t *__restrict__ out)
{
    long long n8 = (long long)n_out * n_in / LT_PER;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n8; j += (long long)gridDim.x * blockDim.x) {
        long long at = j * LT_PER;
        int i = (int)(at / n_in), k = (int)(at % n_in), nb = n_in / 32;
        uint32_t e = FMT == MF_KERN_FP8 ? scale[(size_t)(i / 32) * nb + k / 32] : scale[(size_t)i * nb + k / 32];
        uint16_t v[LT_PER];
        for (int q = 0; q < LT_PER; q++) {
            uint32_t code = FMT == MF_KERN_FP8 ? w[at + q] : (w[(at + q) >> 1] >> (((at + q) & 1) * 4)) & 0xFu;
            v[q] = mf_lt_dequant(type, FMT, code, e, shift);
        }
        uint4 o;
        o.x = v[0] | ((uint32_t)v[1] << 16);
        o.y = v[2] | ((uint32_t)v[3] << 16);
        o.z = v[4] | ((uint32_t)v[5] << 16);
        o.w = v[6] | ((uint32_t)v[7] << 16);
        if (((uintptr_t)(out + at) & 15u) == 0) *(uint4 *)(out + at) = o;
        else
            for (int q = 0; q < LT_PER; q++) out[at + q] = v[q];
    }
}

extern "C" int mf_cuda_kern_lt_dequant(void *stream, const mf_kern_mat *w, const mf_dev_w16 *out)
{
    int type = out->type == MF_DEV_F16_FP16 ? MF_LT_FP16 : MF_LT_BF16;
    unsigned g = lt_blocks((long long)w->n_out * w->n_in / LT_PER);
    cudaStream_t st = (cudaStream_t)stream;
    if (w->fmt == MF_KERN_FP8)
        k_lt_dequant<MF_KERN_FP8><<<g, LT_THREADS, 0, st>>>((const uint8_t *)w->w, w->scale, w->n_out, w->n_in, type,
                                                          out->shift, (uint16_t *)out->w);
    else
        k_lt_dequant<MF_KERN_FP4><<<g, LT_THREADS, 0, st>>>((const uint8_t *)w->w, w->scale, w->n_out, w->n_in, type,
                                                          out->shift, (uint16_t *)out->w);
    return lt_launched(w->fmt == MF_KERN_FP8 ? "fp8 dequantization" : "fp4 dequantization", __LINE__);
}

/* The largest finite |x| over n_tok rows of cols (fp16 casts only): per thread, then the warp's by
 * shuffles, then one atomicMax of its bits into hdr[0] (non-negative floats order as their bits). */
__global__ static void k_lt_absmax(const float *__restrict__ x, int n_tok, long long ld_x, long long cols,
                                   unsigned *hdr)
{
    long long n = (long long)n_tok * cols;
    float m = 0.0f;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (long long)gridDim.x * blockDim.x) {
        float a = fabsf(x[(j / cols) * ld_x + j % cols]);
        if (a <= 3.4028234663852886e38f) m = fmaxf(m, a);
    }
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
    if ((threadIdx.x & 31) == 0 && m > 0.0f) atomicMax(hdr, __float_as_uint(m));
}

/* The cast: code = mf_lt_cast(x, xs) with xs from the largest |x| (fp16), rows of cols codes after
 * the header; the first thread writes the GEMM's alpha 2^(w_shift + xs) (NaN when that is no float,
 * which the host side never plans) and beta 0. */
__global__ static void k_lt_cast(int type, const float *__restrict__ x, int n_tok, long long ld_x, long long cols,
                                 int w_shift, unsigned *hdr)
{
    int xs = mf_lt_xshift(type, __uint_as_float(hdr[0]));
    uint16_t *c = (uint16_t *)((char *)hdr + MF_LT_HDR_BYTES);
    long long n = (long long)n_tok * cols;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        int sh = w_shift + xs;
        hdr[1] = sh < -149 || sh > 127 ? 0x7FC00000u : __float_as_uint(mf_lt_pow2(sh));
        hdr[2] = 0u;
    }
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (long long)gridDim.x * blockDim.x)
        c[j] = mf_lt_cast(type, x[(j / cols) * ld_x + j % cols], xs);
}

extern "C" int mf_cuda_kern_lt_cast(void *stream, int f16, const float *x, int n_tok, int64_t ld_x, int64_t cols,
                                    int w_shift, void *x16)
{
    cudaStream_t st = (cudaStream_t)stream;
    int type = f16 == MF_DEV_F16_FP16 ? MF_LT_FP16 : MF_LT_BF16;
    cudaError_t e = cudaMemsetAsync(x16, 0, 4, st);   /* hdr[0]: the largest |x| so far */
    if (e != cudaSuccess)
        return mf_error(-EIO, "%s:%d: cudaMemsetAsync of the cast's header: %s", __FILE__, __LINE__, cudaGetErrorString(e));
    unsigned g = lt_blocks((long long)n_tok * cols);
    if (type == MF_LT_FP16) {
        k_lt_absmax<<<g, LT_THREADS, 0, st>>>(x, n_tok, ld_x, cols, (unsigned *)x16);
        int rc = lt_launched("cuBLASLt activations' largest |x|", __LINE__);
        if (rc) return rc;
    }
    k_lt_cast<<<g, LT_THREADS, 0, st>>>(type, x, n_tok, ld_x, cols, w_shift, (unsigned *)x16);
    return lt_launched("cuBLASLt activations' cast", __LINE__);
}

/* The expert FFN's gating between its GEMMs: gu[t][i] = mf_kern_gate(gu[t][i], gu[t][I + i], limit)
 * * tok_weight[t] for i < I (host/kern_gate.h, as the host's phase 1). */
__global__ static void k_lt_gate(float *gu, int n_tok, int I, const float *tok_weight, float limit)
{
    long long n = (long long)n_tok * I;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += (long long)gridDim.x * blockDim.x) {
        long long t = j / I, i = j % I;
        float *g = gu + t * 2 * I;
        g[i] = mf_kern_gate(g[i], g[I + i], limit) * (tok_weight ? tok_weight[t] : 1.0f);
    }
}

extern "C" int mf_cuda_kern_lt_gate(void *stream, float *gu, int n_tok, int I, const float *tok_weight, float limit)
{
    k_lt_gate<<<lt_blocks((long long)n_tok * I), LT_THREADS, 0, (cudaStream_t)stream>>>(gu, n_tok, I, tok_weight,
                                                                                       limit);
    return lt_launched("cuBLASLt FFN gating", __LINE__);
}
