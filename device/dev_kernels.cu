/* CUDA kernels of the device interface: y = W x with W stored as FP4 (E2M1 pairs + 1x32 E8M0) or
 * FP8 (E4M3 + 32x32 E8M0 tiles), decoded in registers and never written out, fp32 accumulation;
 * and the expert FFN (w1 and w3 rows together, swiglu with limit, token weight, then w2).
 * One warp per output row, lanes over 32-input blocks, up to 8 tokens per warp. Written to match
 * host/kernels.h's fp32 path up to summation order; not yet run on a GPU (docs/device.md). */
#include <cuda_runtime.h>
#include <errno.h>

extern "C" {
#include "device/dev_cuda_kern.h"
#include "sched/error.h"
}

#define KT 8          /* tokens per warp */
#define WARPS 8       /* rows per block */

__device__ static float k_e2m1(unsigned code)
{
    const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    float v = mag[code & 7u];
    return (code & 8u) ? -v : v;
}

__device__ static float k_e8m0(unsigned code)
{
    if (code == 0xFFu) return __int_as_float(0x7FC00000);
    if (code == 0u) return __int_as_float(0x00400000);   /* 2^-127 */
    return __int_as_float((int)(code << 23));
}

__device__ static float k_e4m3(unsigned code)
{
    unsigned s = code >> 7, e = (code >> 3) & 15u, m = code & 7u;
    float v;
    if (e == 15u && m == 7u) v = __int_as_float(0x7FC00000);
    else if (e == 0u) v = ldexpf((float)m, -9);
    else v = ldexpf(1.0f + m / 8.0f, (int)e - 7);
    return s ? -v : v;
}

/* Decodes block b (32 inputs) of row o into wv. */
__device__ static void k_decode(int fmt, const uint8_t *w, const uint8_t *scale, int n_in, int o,
                                int b, float wv[32])
{
    int nb = n_in / 32;
    if (fmt == MF_KERN_FP4) {
        const uint8_t *p = w + (size_t)o * (n_in / 2) + (size_t)b * 16;
        float sc = k_e8m0(scale[(size_t)o * nb + b]);
        for (int i = 0; i < 16; i++) {
            unsigned byte = p[i];
            wv[2 * i] = k_e2m1(byte & 15u) * sc;
            wv[2 * i + 1] = k_e2m1(byte >> 4) * sc;
        }
    } else {
        const uint8_t *p = w + (size_t)o * n_in + (size_t)b * 32;
        float sc = k_e8m0(scale[(size_t)(o / 32) * nb + b]);
        for (int i = 0; i < 32; i++) wv[i] = k_e4m3(p[i]) * sc;
    }
}

/* acc[t] = row o of W times token t0 + t of x, for nt tokens, summed over the warp (lane 0 holds it). */
__device__ static void k_row_dot(int fmt, const uint8_t *w, const uint8_t *scale, int n_in, int o,
                                 const float *x, int t0, int nt, float acc[KT])
{
    int lane = threadIdx.x & 31;
    for (int t = 0; t < KT; t++) acc[t] = 0.0f;
    for (int b = lane; b < n_in / 32; b += 32) {
        float wv[32];
        k_decode(fmt, w, scale, n_in, o, b, wv);
        for (int t = 0; t < nt; t++) {
            const float *xt = x + (size_t)(t0 + t) * n_in + (size_t)b * 32;
            float s = 0.0f;
            for (int i = 0; i < 32; i++) s = fmaf(wv[i], xt[i], s);
            acc[t] += s;
        }
    }
    for (int t = 0; t < nt; t++)
        for (int off = 16; off > 0; off >>= 1) acc[t] += __shfl_down_sync(0xffffffffu, acc[t], off);
}

__global__ static void k_matmul(int fmt, const uint8_t *w, const uint8_t *scale, int n_out, int n_in,
                                const float *x, int n_tok, float *y)
{
    int o = blockIdx.x * WARPS + (threadIdx.x >> 5);
    int t0 = blockIdx.y * KT;
    if (o >= n_out) return;   /* whole warps leave together */
    int nt = n_tok - t0 < KT ? n_tok - t0 : KT;
    float acc[KT];
    k_row_dot(fmt, w, scale, n_in, o, x, t0, nt, acc);
    if ((threadIdx.x & 31) == 0)
        for (int t = 0; t < nt; t++) y[(size_t)(t0 + t) * n_out + o] = acc[t];
}

__global__ static void k_ffn_up(int fmt, const uint8_t *w1, const uint8_t *s1, const uint8_t *w3,
                                const uint8_t *s3, int n_hid, int n_in, const float *x, int n_tok,
                                const float *tok_weight, float limit, float *h)
{
    int r = blockIdx.x * WARPS + (threadIdx.x >> 5);
    int t0 = blockIdx.y * KT;
    if (r >= n_hid) return;
    int nt = n_tok - t0 < KT ? n_tok - t0 : KT;
    float g[KT], u[KT];
    k_row_dot(fmt, w1, s1, n_in, r, x, t0, nt, g);
    k_row_dot(fmt, w3, s3, n_in, r, x, t0, nt, u);
    if ((threadIdx.x & 31) != 0) return;
    for (int t = 0; t < nt; t++) {
        float gv = g[t] > limit ? limit : g[t];   /* NaN stays, as on the host */
        float uv = u[t] > limit ? limit : u[t] < -limit ? -limit : u[t];
        float silu = gv / (1.0f + expf(-gv));
        float wt = tok_weight ? tok_weight[t0 + t] : 1.0f;
        h[(size_t)(t0 + t) * n_hid + r] = (silu * uv) * wt;
    }
}

static int k_launched(const char *what, int line)
{
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return mf_error(-EIO, "%s:%d: %s launch: %s", __FILE__, line, what, cudaGetErrorString(e));
    return 0;
}

extern "C" int mf_cuda_kern_matmul(void *stream, const mf_kern_mat *w, const float *x, int n_tok,
                                   float *y)
{
    dim3 grid((unsigned)((w->n_out + WARPS - 1) / WARPS), (unsigned)((n_tok + KT - 1) / KT));
    k_matmul<<<grid, 32 * WARPS, 0, (cudaStream_t)stream>>>((int)w->fmt, (const uint8_t *)w->w,
                                                           w->scale, w->n_out, w->n_in, x, n_tok, y);
    return k_launched(w->fmt == MF_KERN_FP4 ? "fp4 matmul" : "fp8 matmul", __LINE__);
}

extern "C" int mf_cuda_kern_ffn(void *stream, const mf_dev_ffn *a)
{
    int I = a->w1.n_out, H = a->w1.n_in;
    dim3 grid((unsigned)((I + WARPS - 1) / WARPS), (unsigned)((a->n_tok + KT - 1) / KT));
    k_ffn_up<<<grid, 32 * WARPS, 0, (cudaStream_t)stream>>>(
        (int)a->w1.fmt, (const uint8_t *)a->w1.w, a->w1.scale, (const uint8_t *)a->w3.w,
        a->w3.scale, I, H, a->x, a->n_tok, a->tok_weight, a->limit, a->h);
    int rc = k_launched("expert FFN up", __LINE__);
    if (!rc) rc = mf_cuda_kern_matmul(stream, &a->w2, a->h, a->n_tok, a->y);
    return rc;
}
