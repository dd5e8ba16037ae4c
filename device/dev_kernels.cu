/* CUDA kernels of the device interface: y = W x with W stored as FP4 (E2M1 pairs + 1x32 E8M0),
 * FP8 (E4M3 + 32x32 E8M0 tiles) or BF16 (widened exactly), decoded in registers and never written out, fp32 accumulation;
 * the FP4 int8 path (activations quantized per token per 256 inputs, E2M1 decoded to int8 with
 * byte permutes, dp4a, E8M0 block factors: device/kern_q8.h); and the expert FFN on either path
 * (w1 and w3 rows together, swiglu with limit, token weight, then w2).
 * One warp per output row, lanes over 32-input blocks, up to 8 tokens per warp. Written to match
 * host/kernels.h up to summation order; not yet run on a GPU (docs/device.md). */
#include <cuda_runtime.h>
#include <errno.h>

extern "C" {
#include "device/dev_cuda_kern.h"
#include "device/kern_attn.h"
#include "device/kern_dense.h"
#include "device/kern_q8.h"
#include "host/kern_gate.h"
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
        float sc = mf_dk_e8m0(scale[(size_t)o * nb + b]);
        for (int i = 0; i < 16; i++) {
            unsigned byte = p[i];
            wv[2 * i] = k_e2m1(byte & 15u) * sc;
            wv[2 * i + 1] = k_e2m1(byte >> 4) * sc;
        }
    } else if (fmt == MF_KERN_BF16) {   /* bf16 is the top half of an fp32: exact */
        const uint16_t *p = (const uint16_t *)w + (size_t)o * n_in + (size_t)b * 32;
        for (int i = 0; i < 32; i++) wv[i] = __int_as_float((int)((unsigned)p[i] << 16));
    } else {
        const uint8_t *p = w + (size_t)o * n_in + (size_t)b * 32;
        float sc = mf_dk_e8m0(scale[(size_t)(o / 32) * nb + b]);
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
        float wt = tok_weight ? tok_weight[t0 + t] : 1.0f;
        h[(size_t)(t0 + t) * n_hid + r] = mf_kern_gate(g[t], u[t], limit) * wt;   /* host/kern_gate.h */
    }
}

static int k_launched(const char *what, int line)
{
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return mf_error(-EIO, "%s:%d: %s launch: %s", __FILE__, line, what, cudaGetErrorString(e));
    return 0;
}

/* ---- dense linears: FP8 (E4M3 x 32x32 E8M0 tiles) and BF16 weight slices --------------------
 * One warp per output row of the slice and up to KT tokens (blockIdx.y: the token group). Lane l
 * takes the row's 16-byte chunks l, l + 32, ..., so each load instruction of a warp reads 512
 * consecutive bytes (one uint4 per lane where the row is 16-byte aligned); a chunk is 16 FP8 or 8
 * BF16 weights inside one 32-column block, hence inside one 32x32 scale tile, whose scale is read
 * once per chunk. Weights are decoded in registers (E4M3 from its bits, times the tile's E8M0
 * scale: exact, as the host's decode) and FMA'd against each token's x through the L1 cache:
 * fp32 accumulators (KERN), or (REF, the reference's double sums) the chunk's products of the
 * unscaled codes summed in fp32, times the scale, accumulated in double. A warp shuffle reduction
 * ends the row. Decode at 1-8 tokens is bound by the weight bytes; each further group of 8 tokens
 * reads the weights again (from L2 where the matrix fits). Not tuned, never run on a GPU. */
struct k_lin_args {
    const uint8_t *w, *scale;
    int n_out, n_in;
    long long row0;
    int group_rows;
    const float *x;
    long long ld_x;
    int n_tok;
    float *y;
    long long ld_y;
    int aligned;
};

/* bf16 rounding in bits (device/kern_dense.h, also the host's) */
__device__ static float k_bf(float x) { return mf_dk_bf16(x); }

/* 16 bytes at p as 4 little-endian words: one vector load when p is 16-byte aligned */
__device__ static void k_load16(const uint8_t *p, int aligned, uint32_t q[4])
{
    if (aligned) {
        uint4 v = *(const uint4 *)p;
        q[0] = v.x; q[1] = v.y; q[2] = v.z; q[3] = v.w;
    } else {
        for (int k = 0; k < 4; k++)
            q[k] = (uint32_t)p[4 * k] | (uint32_t)p[4 * k + 1] << 8 | (uint32_t)p[4 * k + 2] << 16 |
                   (uint32_t)p[4 * k + 3] << 24;
    }
}

/* out[t] = row i of the slice against token t0 + t, for nt tokens (lane 0 holds the sums). */
template <int FMT, int REF>
__device__ static void k_lin_row(const k_lin_args &a, int i, int t0, int nt, float out[KT])
{
    const int cpc = MF_DK_CPC(FMT);
    int lane = threadIdx.x & 31, nch = a.n_in / cpc;
    const uint8_t *wr = a.w + (size_t)i * (size_t)a.n_in * (FMT == MF_KERN_FP8 ? 1 : 2);
    long long xoff = mf_dk_xoff(a.row0, a.group_rows, a.n_in, i);
    float accf[KT];
    double accd[KT];
#pragma unroll
    for (int t = 0; t < KT; t++) accf[t] = 0.0f, accd[t] = 0.0;
    for (int c = lane; c < nch; c += 32) {
        uint32_t q[4];
        k_load16(wr + (size_t)c * 16, a.aligned, q);
        float wv[16], sc = FMT == MF_KERN_FP8 ? mf_dk_e8m0(a.scale[mf_dk_scale_at(a.n_in, i, c)]) : 1.0f;
        mf_dk_decode(FMT, q, REF ? 1.0f : sc, wv);
        const float *xc = a.x + xoff + (long long)c * cpc;
#pragma unroll
        for (int t = 0; t < KT; t++)
            if (t < nt) {
                const float *xt = xc + (long long)(t0 + t) * a.ld_x;
                float s = REF ? 0.0f : accf[t];
#pragma unroll
                for (int j = 0; j < cpc; j++) s = fmaf(wv[j], __ldg(xt + j), s);
                if (REF) accd[t] += (double)s * sc;
                else accf[t] = s;
            }
    }
#pragma unroll
    for (int t = 0; t < KT; t++) {
        if (REF) {
            double v = accd[t];
            for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
            out[t] = (float)v;
        } else {
            float v = accf[t];
            for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
            out[t] = v;
        }
    }
}

template <int FMT, int REF>
__global__ static void k_lin(k_lin_args a)
{
    int i = blockIdx.x * WARPS + (threadIdx.x >> 5), t0 = blockIdx.y * KT;
    if (i >= a.n_out || t0 >= a.n_tok) return;   /* whole warps leave together */
    int nt = a.n_tok - t0 < KT ? a.n_tok - t0 : KT;
    float acc[KT];
    k_lin_row<FMT, REF>(a, i, t0, nt, acc);
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int t = 0; t < KT; t++)
            if (t < nt) a.y[(long long)(t0 + t) * a.ld_y + i] = acc[t];
}

/* Phase 1 of a dense FFN: rows i of w1 and w3, then mf_kern_ffn_up's clamp and silu. */
template <int FMT>
__global__ static void k_lin_up(k_lin_args a1, k_lin_args a3, float limit, float *h, long long ld_h)
{
    int i = blockIdx.x * WARPS + (threadIdx.x >> 5), t0 = blockIdx.y * KT;
    if (i >= a1.n_out || t0 >= a1.n_tok) return;
    int nt = a1.n_tok - t0 < KT ? a1.n_tok - t0 : KT;
    float g[KT], u[KT];
    k_lin_row<FMT, 0>(a1, i, t0, nt, g);
    k_lin_row<FMT, 0>(a3, i, t0, nt, u);
    if ((threadIdx.x & 31) != 0) return;
#pragma unroll
    for (int t = 0; t < KT; t++)
        if (t < nt) {
            h[(long long)(t0 + t) * ld_h + i] = mf_kern_gate(g[t], u[t], limit) * 1.0f;
        }
}

__global__ static void k_round_bf16(float *y, int n_tok, long long ld, int n)
{
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= (long long)n_tok * n) return;
    long long e = k / n * ld + k % n;
    y[e] = k_bf(y[e]);
}

/* pack: y = the bf16 code of x (mf_dk_bf16's rounding, its top half); unpack: x = the float of code y */
__global__ static void k_bf16_cast(int pack, float *x, long long ld_x, uint16_t *y, long long ld_y, const int32_t *rows,
                                   int n_tok, int n)
{
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= (long long)n_tok * n) return;
    long long t = k / n, i = k % n;
    if (pack) y[t * ld_y + i] = (uint16_t)(mf_dk_bits(k_bf(x[t * ld_x + i])) >> 16);
    else x[t * ld_x + i] = mf_dk_float((uint32_t)y[(rows ? (long long)rows[t] : t) * ld_y + i] << 16);
}

__global__ static void k_swiglu_bf16(const float *g, const float *u, int n_tok, long long ld, int n, float limit,
                                     float *h)
{
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= (long long)n_tok * n) return;
    long long e = k / n * ld + k % n;
    float gi = k_bf(g[e]), ui = k_bf(u[e]);
    if (limit > 0.0f) {
        ui = fminf(fmaxf(ui, -limit), limit);
        gi = fminf(gi, limit);
    }
    float silu = (float)((double)gi / (1.0 + exp(-(double)gi)));
    h[e] = k_bf(1.0f * (silu * ui));
}

/* ---- dense linears at many tokens: the tiled kernel (a GEMM with KERN sums) -------------------
 * Block (blockIdx.x: GT_M rows of the slice, blockIdx.y: GT_N tokens), 256 threads, each 4 rows x 4
 * tokens. Per 32-column step the block decodes the weight tile [GT_M rows][32 columns] once into
 * shared memory (FP8: mf_dk_e4m3 of the code times the tile's E8M0 scale, the host's exact decoded
 * value; BF16: the value) beside the tokens' 32 x columns, then each thread FMAs its 4 x 4 outputs
 * over the 32 columns in column order: fp32 sums in another order than the host's (the bound of
 * the warp-per-row kernel, docs/device.md). Each weight is read once per GT_N tokens where the
 * warp-per-row kernel reads it once per KT. Grouped rows: the block's rows lie in one group
 * (mf_dev_lin_tiled_ok), whose x columns it reads. Compiled, never run on a GPU. */
#define GT_M MF_DEV_LIN_TILE_ROWS   /* device/dev.h: mf_dev_lin_tiled_ok's group alignment */
#define GT_N 64
#define GT_K 32
static_assert(GT_M == 64 && GT_N == 64 && GT_K == 32, "256 threads of 4 rows x 4 tokens; one scale tile a k step");

/* One weight tile [GT_M rows][32 columns] from column k0 into shared memory (0 past the slice):
 * decoded, or (REF) the codes' values, their rows' tile scales into ss. */
template <int FMT, int REF>
__device__ static void k_tile_w(const k_lin_args &a, int m0, int k0, float (*ws)[GT_M + 4], float *ss)
{
    for (int e = threadIdx.x; e < GT_M * GT_K; e += 256) {   /* consecutive threads: consecutive columns */
        int r = e / GT_K, kk = e % GT_K, i = m0 + r;
        ws[kk][r] = i >= a.n_out ? 0.0f
                    : REF        ? mf_dk_code(FMT, a.w, a.n_in, i, k0 + kk)
                                 : mf_dk_weight(FMT, a.w, a.scale, a.n_in, i, k0 + kk);
    }
    if (REF && threadIdx.x < GT_M)
        ss[threadIdx.x] = m0 + (int)threadIdx.x < a.n_out ? mf_dk_tile_scale(FMT, a.scale, a.n_in, m0 + threadIdx.x, k0) : 0.0f;
}

/* UP = 0: y = the slice's rows against x. UP = 1 (mf_dev_ffn_up: a = w1, a3 = w3, same rows and
 * x): both tiles in shared memory, two accumulators, then mf_kern_ffn_up's clamp and silu into
 * h (a.y, a.ld_y). REF (UP = 0; the reference's sums, MF_DEV_SUMS_REF): each 32-column step's
 * products of the codes' values summed in fp32, times the row's tile scale, accumulated in double
 * (the warp-per-row kernel sums 16 columns in fp32: the same bound, docs/device.md). */
template <int FMT, int UP, int REF>
__global__ static void __launch_bounds__(256) k_lin_tiled(k_lin_args a, k_lin_args a3, float limit)
{
    __shared__ float ws[GT_K][GT_M + 4];
    __shared__ float ws3[UP ? GT_K : 1][GT_M + 4];
    __shared__ float xs[GT_K][GT_N + 4];
    __shared__ float ss[REF ? GT_M : 1];
    double accd[REF ? 4 : 1][4];
    const int tid = threadIdx.x, m0 = blockIdx.x * GT_M, n0 = blockIdx.y * GT_N;
    const int tr = (tid >> 4) * 4, tc = (tid & 15) * 4;
    const long long xoff = mf_dk_xoff(a.row0, a.group_rows, a.n_in, m0);
    float acc[4][4], acc3[UP ? 4 : 1][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            acc[i][j] = 0.0f;
            if (UP) acc3[UP ? i : 0][j] = 0.0f;
            if (REF) accd[REF ? i : 0][j] = 0.0;
        }
    for (int k0 = 0; k0 < a.n_in; k0 += GT_K) {
        k_tile_w<FMT, REF>(a, m0, k0, ws, ss);
        if (UP) k_tile_w<FMT, 0>(a3, m0, k0, ws3, ss);
        for (int e = tid; e < GT_N * GT_K; e += 256) {
            int t = e / GT_K, kk = e % GT_K, tok = n0 + t;
            xs[kk][t] = tok < a.n_tok ? __ldg(a.x + (long long)tok * a.ld_x + xoff + k0 + kk) : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < GT_K; kk++) {
            float wr[4], w3r[4], xr[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                wr[i] = ws[kk][tr + i];
                w3r[i] = UP ? ws3[UP ? kk : 0][tr + i] : 0.0f;
                xr[i] = xs[kk][tc + i];
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    acc[i][j] = fmaf(wr[i], xr[j], acc[i][j]);
                    if (UP) acc3[UP ? i : 0][j] = fmaf(w3r[i], xr[j], acc3[UP ? i : 0][j]);
                }
        }
        if (REF)   /* the step's fp32 sums times the rows' scales, into double; fp32 restarts */
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    accd[REF ? i : 0][j] += (double)acc[i][j] * (double)ss[tr + i];
                    acc[i][j] = 0.0f;
                }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        int tok = n0 + tc + j;
        if (tok >= a.n_tok) continue;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (m0 + tr + i >= a.n_out) continue;
            float v = REF ? (float)accd[REF ? i : 0][j] : acc[i][j];
            if (UP) v = mf_kern_gate(v, acc3[UP ? i : 0][j], limit) * 1.0f;   /* k_lin_up's epilogue */
            a.y[(long long)tok * a.ld_y + m0 + tr + i] = v;
        }
    }
}

/* a3 (UP): w3's arguments, h in a.y; ref: the reference's sums (not with UP) */
static int k_lin_tiled_launch(cudaStream_t st, int fmt, int ref, const k_lin_args &a, const k_lin_args *a3,
                              float limit)
{
    dim3 grid((unsigned)((a.n_out + GT_M - 1) / GT_M), (unsigned)((a.n_tok + GT_N - 1) / GT_N));
    if (a3 && fmt == MF_KERN_FP8) k_lin_tiled<MF_KERN_FP8, 1, 0><<<grid, 256, 0, st>>>(a, *a3, limit);
    else if (a3) k_lin_tiled<MF_KERN_BF16, 1, 0><<<grid, 256, 0, st>>>(a, *a3, limit);
    else if (fmt == MF_KERN_FP8 && ref) k_lin_tiled<MF_KERN_FP8, 0, 1><<<grid, 256, 0, st>>>(a, a, 0.0f);
    else if (fmt == MF_KERN_FP8) k_lin_tiled<MF_KERN_FP8, 0, 0><<<grid, 256, 0, st>>>(a, a, 0.0f);
    else if (ref) k_lin_tiled<MF_KERN_BF16, 0, 1><<<grid, 256, 0, st>>>(a, a, 0.0f);
    else k_lin_tiled<MF_KERN_BF16, 0, 0><<<grid, 256, 0, st>>>(a, a, 0.0f);
    return k_launched(a3 ? (fmt == MF_KERN_FP8 ? "dense ffn up (fp8, tiled)" : "dense ffn up (bf16, tiled)")
                         : fmt == MF_KERN_FP8 ? (ref ? "fp8 linear (tiled, reference sums)" : "fp8 linear (tiled)")
                                              : (ref ? "bf16 linear (tiled, reference sums)" : "bf16 linear (tiled)"),
                      __LINE__);
}

static k_lin_args k_lin_of(const mf_kern_mat *w, long long row0, int group_rows, const float *x, long long ld_x,
                           int n_tok, float *y, long long ld_y)
{
    k_lin_args a = {(const uint8_t *)w->w, w->scale, w->n_out, w->n_in, row0, group_rows, x, ld_x, n_tok, y, ld_y,
                    ((uintptr_t)w->w & 15u) == 0};
    return a;
}

static int k_lin_launch(cudaStream_t st, int fmt, int ref, const k_lin_args &a)
{
    dim3 grid((unsigned)((a.n_out + WARPS - 1) / WARPS), (unsigned)((a.n_tok + KT - 1) / KT));
    if (fmt == MF_KERN_FP8 && ref) k_lin<MF_KERN_FP8, 1><<<grid, 32 * WARPS, 0, st>>>(a);
    else if (fmt == MF_KERN_FP8) k_lin<MF_KERN_FP8, 0><<<grid, 32 * WARPS, 0, st>>>(a);
    else if (ref) k_lin<MF_KERN_BF16, 1><<<grid, 32 * WARPS, 0, st>>>(a);
    else k_lin<MF_KERN_BF16, 0><<<grid, 32 * WARPS, 0, st>>>(a);
    return k_launched(fmt == MF_KERN_FP8 ? (ref ? "fp8 linear (reference sums)" : "fp8 linear")
                                         : (ref ? "bf16 linear (reference sums)" : "bf16 linear"),
                      __LINE__);
}

extern "C" int mf_cuda_kern_linear(void *stream, const mf_dev_lin *a, int tiled)
{
    k_lin_args la = k_lin_of(&a->w, a->row0, a->group_rows, a->x, a->ld_x, a->n_tok, a->y, a->ld_y);
    if (tiled)
        return k_lin_tiled_launch((cudaStream_t)stream, (int)a->w.fmt, a->sums == MF_DEV_SUMS_REF, la, NULL, 0.0f);
    return k_lin_launch((cudaStream_t)stream, (int)a->w.fmt, a->sums == MF_DEV_SUMS_REF, la);
}

extern "C" int mf_cuda_kern_ffn_up(void *stream, const mf_dev_up *a, int tiled)
{
    k_lin_args a1 = k_lin_of(&a->w1, 0, 0, a->x, a->ld_x, a->n_tok, NULL, 0);
    k_lin_args a3 = k_lin_of(&a->w3, 0, 0, a->x, a->ld_x, a->n_tok, NULL, 0);
    if (tiled) {
        a1.y = a->h;
        a1.ld_y = a->ld_h;
        return k_lin_tiled_launch((cudaStream_t)stream, (int)a->w1.fmt, 0, a1, &a3, a->limit);
    }
    dim3 grid((unsigned)((a->w1.n_out + WARPS - 1) / WARPS), (unsigned)((a->n_tok + KT - 1) / KT));
    cudaStream_t st = (cudaStream_t)stream;
    if (a->w1.fmt == MF_KERN_FP8) k_lin_up<MF_KERN_FP8><<<grid, 32 * WARPS, 0, st>>>(a1, a3, a->limit, a->h, a->ld_h);
    else k_lin_up<MF_KERN_BF16><<<grid, 32 * WARPS, 0, st>>>(a1, a3, a->limit, a->h, a->ld_h);
    return k_launched("dense ffn up", __LINE__);
}

extern "C" int mf_cuda_kern_round_bf16(void *stream, float *y, int n_tok, int64_t ld, int n)
{
    long long m = (long long)n_tok * n;
    k_round_bf16<<<(unsigned)((m + 255) / 256), 256, 0, (cudaStream_t)stream>>>(y, n_tok, ld, n);
    return k_launched("bf16 rounding", __LINE__);
}

extern "C" int mf_cuda_kern_bf16_cast(void *stream, int pack, float *x, int64_t ld_x, uint16_t *y, int64_t ld_y,
                                      const int32_t *rows, int n_tok, int n)
{
    long long m = (long long)n_tok * n;
    k_bf16_cast<<<(unsigned)((m + 255) / 256), 256, 0, (cudaStream_t)stream>>>(pack, x, ld_x, y, ld_y, rows, n_tok, n);
    return k_launched(pack ? "bf16 pack" : rows ? "bf16 gather" : "bf16 unpack", __LINE__);
}

extern "C" int mf_cuda_kern_swiglu_bf16(void *stream, const float *g, const float *u, int n_tok, int64_t ld, int n,
                                        float limit, float *h)
{
    long long m = (long long)n_tok * n;
    k_swiglu_bf16<<<(unsigned)((m + 255) / 256), 256, 0, (cudaStream_t)stream>>>(g, u, n_tok, ld, n, limit, h);
    return k_launched("swiglu (bf16 roundings)", __LINE__);
}

/* FP4 on the fp32 path: k_matmul; FP8 and BF16: the dense linear kernel over the whole matrix. */
extern "C" int mf_cuda_kern_matmul(void *stream, const mf_kern_mat *w, const float *x, int n_tok,
                                   float *y)
{
    if (w->fmt != MF_KERN_FP4)
        return k_lin_launch((cudaStream_t)stream, (int)w->fmt, 0, k_lin_of(w, 0, 0, x, w->n_in, n_tok, y, w->n_out));
    dim3 grid((unsigned)((w->n_out + WARPS - 1) / WARPS), (unsigned)((n_tok + KT - 1) / KT));
    k_matmul<<<grid, 32 * WARPS, 0, (cudaStream_t)stream>>>((int)w->fmt, (const uint8_t *)w->w,
                                                           w->scale, w->n_out, w->n_in, x, n_tok, y);
    return k_launched("fp4 matmul", __LINE__);
}

/* ---- the int8 FP4 path ------------------------------------------------------------------------ */

/* Quantizes x [n_tok][n_in] into the device q8 layout (mf_q8k_view): one warp per (token, 256-input
 * group), each lane 8 inputs; max |x| by a warp reduction; codes as mf_kern_q8_quantize's. */
__device__ static void k_q8_quantize_body(const float *x, int n_tok, int n_in, int8_t *q, float *qs,
                                          int n_sb)
{
    int gid = blockIdx.x * WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (gid >= n_tok * n_sb) return;   /* whole warps leave together */
    int t = gid / n_sb, s = gid % n_sb;
    int len = n_in - s * MF_Q8K_GROUP < MF_Q8K_GROUP ? n_in - s * MF_Q8K_GROUP : MF_Q8K_GROUP;
    const float *xg = x + (size_t)t * n_in + (size_t)s * MF_Q8K_GROUP;
    float v[8], amax = 0.0f;
    int bad = 0;
    for (int i = 0; i < 8; i++) {
        int k = lane * 8 + i;
        v[i] = k < len ? xg[k] : 0.0f;
        float a = fabsf(v[i]);
        amax = fmaxf(amax, a);             /* NaN is skipped, as on the host; bad marks it */
        bad |= !(a <= 3.402823466e+38f);
    }
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    bad = __any_sync(0xffffffffu, bad);
    float scale, inv = mf_q8k_group_inv(amax, bad, &scale);
    int8_t *qg = q + (size_t)t * n_in + (size_t)s * MF_Q8K_GROUP;
    if (lane * 8 < len) {
        uint32_t lo = 0, hi = 0;
        for (int i = 0; i < 4; i++) {
            lo |= (uint32_t)(uint8_t)mf_q8k_code(v[i], inv) << (8 * i);
            hi |= (uint32_t)(uint8_t)mf_q8k_code(v[4 + i], inv) << (8 * i);
        }
        *(uint2 *)(qg + lane * 8) = make_uint2(lo, hi);   /* len is a multiple of 32 */
    }
    if (lane == 0) qs[(size_t)t * n_sb + s] = scale;
}

__global__ static void k_q8_quantize(const float *x, int n_tok, int n_in, int8_t *q, float *qs,
                                     int n_sb)
{
    k_q8_quantize_body(x, n_tok, n_in, q, qs, n_sb);
}

/* The 16 packed bytes of block b of row o (as 4 words), vector-loaded when w is 16-byte aligned. */
__device__ static void k_fp4_load(const uint8_t *w, int aligned, int n_in, int o, int b, uint32_t wq[4])
{
    k_load16(w + (size_t)o * (n_in / 2) + (size_t)b * 16, aligned, wq);
}

/* acc[t] = row o of W (FP4) times token t0 + t of the quantized x, for nt tokens, over the warp
 * (lane 0 holds it). Each pass takes 32 consecutive blocks, one per lane (a coalesced 512-byte read
 * of the row); the lanes of a 256-input group (8 consecutive lanes) find its largest scale code by
 * shuffles; each lane decodes its block once and uses it for every token. */
__device__ static void k_q8_row_dot(const uint8_t *w, const uint8_t *scale, int aligned, int n_in,
                                    int o, mf_q8k_view xq, int t0, int nt, float acc[KT])
{
    int lane = threadIdx.x & 31, nb = n_in / 32;
#pragma unroll
    for (int t = 0; t < KT; t++) acc[t] = 0.0f;
    for (int base = 0; base < nb; base += 32) {   /* uniform over the warp */
        int b = base + lane, active = b < nb;
        unsigned e = active ? scale[(size_t)o * nb + b] : 0u, emax = e;
        for (int off = 1; off < MF_Q8K_GROUP_BLOCKS; off <<= 1)
            emax = max(emax, (unsigned)__shfl_xor_sync(0xffffffffu, (int)emax, off));
        if (!active) continue;
        uint32_t wq[4];
        int32_t wv[8];
        k_fp4_load(w, aligned, n_in, o, b, wq);
        mf_q8k_fp4_block(wq, wv);
        float f = mf_q8k_block_factor(e, emax);
        int g = b / MF_Q8K_GROUP_BLOCKS;
#pragma unroll
        for (int t = 0; t < KT; t++)
            if (t < nt) {
                int tt = t0 + t;
                acc[t] = fmaf(mf_q8k_block_value(wv, f, xq.q + (size_t)tt * n_in + (size_t)b * 32),
                              xq.scale[(size_t)tt * xq.n_sb + g], acc[t]);
            }
    }
#pragma unroll
    for (int t = 0; t < KT; t++)
        for (int off = 16; off > 0; off >>= 1) acc[t] += __shfl_down_sync(0xffffffffu, acc[t], off);
}

__device__ static void k_q8_matmul_body(const uint8_t *w, const uint8_t *scale, int aligned, int n_out,
                                        int n_in, mf_q8k_view xq, int n_tok, float *y)
{
    int o = blockIdx.x * WARPS + (threadIdx.x >> 5);
    int t0 = blockIdx.y * KT;
    if (o >= n_out || t0 >= n_tok) return;
    int nt = n_tok - t0 < KT ? n_tok - t0 : KT;
    float acc[KT];
    k_q8_row_dot(w, scale, aligned, n_in, o, xq, t0, nt, acc);
    if ((threadIdx.x & 31) == 0)
#pragma unroll
        for (int t = 0; t < KT; t++)
            if (t < nt) y[(size_t)(t0 + t) * n_out + o] = acc[t];
}

__global__ static void k_q8_matmul(const uint8_t *w, const uint8_t *scale, int aligned, int n_out,
                                   int n_in, mf_q8k_view xq, int n_tok, float *y)
{
    k_q8_matmul_body(w, scale, aligned, n_out, n_in, xq, n_tok, y);
}

/* Phase 1 of the FFN on the int8 path: rows r of w1 and w3 against the quantized x, then the same
 * clamp, silu and token weight as mf_kern_ffn_up. */
__device__ static void k_q8_ffn_up_body(const uint8_t *w1, const uint8_t *s1, const uint8_t *w3,
                                        const uint8_t *s3, int aligned, int n_hid, int n_in,
                                        mf_q8k_view xq, int n_tok, const float *tok_weight,
                                        float limit, float *h)
{
    int r = blockIdx.x * WARPS + (threadIdx.x >> 5);
    int t0 = blockIdx.y * KT;
    if (r >= n_hid || t0 >= n_tok) return;
    int nt = n_tok - t0 < KT ? n_tok - t0 : KT;
    float g[KT], u[KT];
    k_q8_row_dot(w1, s1, aligned, n_in, r, xq, t0, nt, g);
    k_q8_row_dot(w3, s3, aligned, n_in, r, xq, t0, nt, u);
    if ((threadIdx.x & 31) != 0) return;
#pragma unroll
    for (int t = 0; t < KT; t++)
        if (t < nt) {
            float wt = tok_weight ? tok_weight[t0 + t] : 1.0f;
            h[(size_t)(t0 + t) * n_hid + r] = mf_kern_gate(g[t], u[t], limit) * wt;
        }
}

__global__ static void k_q8_ffn_up(const uint8_t *w1, const uint8_t *s1, const uint8_t *w3,
                                   const uint8_t *s3, int aligned, int n_hid, int n_in,
                                   mf_q8k_view xq, int n_tok, const float *tok_weight, float limit,
                                   float *h)
{
    k_q8_ffn_up_body(w1, s1, w3, s3, aligned, n_hid, n_in, xq, n_tok, tok_weight, limit, h);
}

/* ---- the slot-table FFN: blockIdx.z is the slot, its entry read when the kernel runs --------- */

/* Slot z's entry; n_tok 0 (skipped) when it is out of range. */
__device__ static mf_dev_ffn_slot k_slot(const mf_dev_ffn_table &a)
{
    mf_dev_ffn_slot e = a.table[blockIdx.z];
    if (e.n_tok < 0 || e.n_tok > a.max_tok || e.row0 < 0) e.n_tok = 0;
    return e;
}

/* Slot e's q8 scratch: its rows' area (mf_dev_ffn_table.q8_row). */
__device__ static mf_q8k_view k_slot_view(const mf_dev_ffn_table &a, const mf_dev_ffn_slot &e, int n_in)
{
    return mf_q8k_view_of((uint8_t *)a.q8_scratch + (size_t)e.row0 * a.q8_row, e.n_tok, n_in);
}

/* which = 0: quantize the slot's rows of x (n_in = H); 1: of h (n_in = I). */
__global__ static void k_tab_quantize(mf_dev_ffn_table a, int which)
{
    mf_dev_ffn_slot e = k_slot(a);
    int n_in = which ? a.n_hidden : a.n_in;
    const float *src = (which ? a.h : a.x) + (size_t)e.row0 * n_in;
    mf_q8k_view v = k_slot_view(a, e, n_in);
    k_q8_quantize_body(src, e.n_tok, n_in, v.q, v.scale, v.n_sb);
}

__global__ static void k_tab_up(mf_dev_ffn_table a)
{
    mf_dev_ffn_slot e = k_slot(a);
    const uint8_t *b = (const uint8_t *)(uintptr_t)e.base;
    const uint8_t *w1 = b + a.part_off[0], *w3 = b + a.part_off[4];
    int aligned = (((uintptr_t)w1 | (uintptr_t)w3) & 15u) == 0;
    k_q8_ffn_up_body(w1, b + a.part_off[1], w3, b + a.part_off[5], aligned, a.n_hidden, a.n_in,
                     k_slot_view(a, e, a.n_in), e.n_tok,
                     a.tok_weight ? a.tok_weight + e.row0 : NULL, a.limit,
                     a.h + (size_t)e.row0 * a.n_hidden);
}

__global__ static void k_tab_down(mf_dev_ffn_table a)
{
    mf_dev_ffn_slot e = k_slot(a);
    const uint8_t *b = (const uint8_t *)(uintptr_t)e.base;
    const uint8_t *w2 = b + a.part_off[2];
    k_q8_matmul_body(w2, b + a.part_off[3], ((uintptr_t)w2 & 15u) == 0, a.n_in, a.n_hidden,
                     k_slot_view(a, e, a.n_hidden), e.n_tok, a.y + (size_t)e.row0 * a.n_in);
}

static int k_aligned(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Quantizes x [n_tok][n_in] into the scratch (device layout) and returns its view. */
static int k_quantize(cudaStream_t st, const float *x, int n_tok, int n_in, void *scratch,
                      mf_q8k_view *v)
{
    *v = mf_q8k_view_of(scratch, n_tok, n_in);
    int n_groups = n_tok * v->n_sb;
    k_q8_quantize<<<(unsigned)((n_groups + WARPS - 1) / WARPS), 32 * WARPS, 0, st>>>(
        x, n_tok, n_in, v->q, v->scale, v->n_sb);
    return k_launched("q8 quantize", __LINE__);
}

extern "C" int mf_cuda_kern_fp4_q8(void *stream, const mf_kern_mat *w, const float *x, int n_tok,
                                   float *y, void *q8_scratch)
{
    cudaStream_t st = (cudaStream_t)stream;
    mf_q8k_view v;
    int rc = k_quantize(st, x, n_tok, w->n_in, q8_scratch, &v);
    if (rc) return rc;
    dim3 grid((unsigned)((w->n_out + WARPS - 1) / WARPS), (unsigned)((n_tok + KT - 1) / KT));
    k_q8_matmul<<<grid, 32 * WARPS, 0, st>>>((const uint8_t *)w->w, w->scale, k_aligned(w->w),
                                             w->n_out, w->n_in, v, n_tok, y);
    return k_launched("fp4 matmul (int8 path)", __LINE__);
}

extern "C" int mf_cuda_kern_ffn_table(void *stream, const mf_dev_ffn_table *a)
{
    cudaStream_t st = (cudaStream_t)stream;
    int H = a->n_in, I = a->n_hidden, T = a->max_tok, S = a->n_slots;
    int sb_h = (H / 32 + MF_Q8K_GROUP_BLOCKS - 1) / MF_Q8K_GROUP_BLOCKS;
    int sb_i = (I / 32 + MF_Q8K_GROUP_BLOCKS - 1) / MF_Q8K_GROUP_BLOCKS;
    unsigned ty = (unsigned)((T + KT - 1) / KT);
    k_tab_quantize<<<dim3((unsigned)((T * sb_h + WARPS - 1) / WARPS), 1, (unsigned)S), 32 * WARPS, 0, st>>>(*a, 0);
    int rc = k_launched("slot-table FFN: quantize x", __LINE__);
    if (rc) return rc;
    k_tab_up<<<dim3((unsigned)((I + WARPS - 1) / WARPS), ty, (unsigned)S), 32 * WARPS, 0, st>>>(*a);
    if ((rc = k_launched("slot-table FFN: up", __LINE__))) return rc;
    k_tab_quantize<<<dim3((unsigned)((T * sb_i + WARPS - 1) / WARPS), 1, (unsigned)S), 32 * WARPS, 0, st>>>(*a, 1);
    if ((rc = k_launched("slot-table FFN: quantize h", __LINE__))) return rc;
    k_tab_down<<<dim3((unsigned)((H + WARPS - 1) / WARPS), ty, (unsigned)S), 32 * WARPS, 0, st>>>(*a);
    return k_launched("slot-table FFN: down", __LINE__);
}

extern "C" int mf_cuda_kern_ffn(void *stream, const mf_dev_ffn *a)
{
    cudaStream_t st = (cudaStream_t)stream;
    int I = a->w1.n_out, H = a->w1.n_in;
    dim3 grid((unsigned)((I + WARPS - 1) / WARPS), (unsigned)((a->n_tok + KT - 1) / KT));
    int rc;
    if (a->q8_scratch && a->w1.fmt == MF_KERN_FP4) {
        mf_q8k_view v;
        rc = k_quantize(st, a->x, a->n_tok, H, a->q8_scratch, &v);
        if (rc) return rc;
        k_q8_ffn_up<<<grid, 32 * WARPS, 0, st>>>(
            (const uint8_t *)a->w1.w, a->w1.scale, (const uint8_t *)a->w3.w, a->w3.scale,
            k_aligned(a->w1.w) && k_aligned(a->w3.w), I, H, v, a->n_tok, a->tok_weight, a->limit,
            a->h);
        rc = k_launched("expert FFN up (int8 path)", __LINE__);
    } else {
        k_ffn_up<<<grid, 32 * WARPS, 0, st>>>(
            (int)a->w1.fmt, (const uint8_t *)a->w1.w, a->w1.scale, (const uint8_t *)a->w3.w,
            a->w3.scale, I, H, a->x, a->n_tok, a->tok_weight, a->limit, a->h);
        rc = k_launched("expert FFN up", __LINE__);
    }
    if (rc) return rc;
    if (a->q8_scratch && a->w2.fmt == MF_KERN_FP4)
        return mf_cuda_kern_fp4_q8(stream, &a->w2, a->h, a->n_tok, a->y, a->q8_scratch);
    return mf_cuda_kern_matmul(stream, &a->w2, a->h, a->n_tok, a->y);
}

/* ---- attention heads (mf_dev_attn_heads) ------------------------------------------------------ */

#define KA_THREADS 256

/* Block (token t, head h): q in shared memory; each half-warp scores keys hw, hw + 16, ... (lane l
 * of device/kern_attn.h, the shuffle tree in mf_da_tree16's order); the max (order-free); the
 * exponentials; the denominator in double in key order by thread 0; each thread a value element's
 * fmaf chain in key order; the division in double and the bf16 rounding; with rope_dim the
 * roped part's inverse RoPE, a pair a thread, and its rounding. With q_rope_dim the query rounded
 * as it is loaded, its roped part's forward RoPE a pair a thread, rounded (mf_fa_heads_q's bits). */
__global__ static void k_attn(mf_dev_attn a)
{
    __shared__ float qs[MF_DEV_ATTN_MAX_D];
    __shared__ float s[MF_DEV_ATTN_MAX_KEYS];
    __shared__ float red[KA_THREADS / 32];
    __shared__ double den;
    int t = blockIdx.x, h = blockIdx.y, D = a.D, tid = threadIdx.x;
    int n = a.n_keys[t];
    const int32_t *rows = a.keys + (long long)t * a.ld_keys;
    if (n < 0 || n > MF_DEV_ATTN_MAX_KEYS) return;   /* skipped (device/dev.h) */
    for (int i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= a.n_kv) return;
    const float *q = a.q + (long long)t * a.ld_q + (long long)h * D;
    int qd = a.q_rope_dim;
    for (int d = tid; d < D; d += KA_THREADS) qs[d] = qd > 0 ? k_bf(q[d]) : q[d];
    __syncthreads();
    if (qd > 0) {   /* qb's output: the forward RoPE of the roped part (mf_da_rope_fwd), a pair a thread */
        float *x = qs + D - qd;
        for (int i = tid; i < qd / 2; i += KA_THREADS) {
            mf_da_rope_fwd(a.rope + (long long)t * qd, qd / 2, i, x);
            x[2 * i] = k_bf(x[2 * i]);
            x[2 * i + 1] = k_bf(x[2 * i + 1]);
        }
        __syncthreads();
    }
    int hw = tid / 16, l = tid % 16;
    unsigned m = 0xffffu << (tid & 16);   /* the half-warp's lanes: the two halves may loop apart */
    for (int i = hw; i < n; i += KA_THREADS / 16) {
        float v = mf_da_lane(qs, a.kv + (long long)rows[i] * D, D, l);
        v += __shfl_down_sync(m, v, 8, 16);
        v += __shfl_down_sync(m, v, 4, 16);
        float u2 = __shfl_down_sync(m, v, 2, 16);   /* lanes 0, 1: u0 + u2, u1 + u3 */
        v += u2;
        v += __shfl_down_sync(m, v, 1, 16);
        if (l == 0) s[i] = v * a.scale;
    }
    __syncthreads();
    float mx = a.sink[h];
    for (int i = tid; i < n; i += KA_THREADS) mx = s[i] > mx ? s[i] : mx;
    for (int o = 16; o > 0; o /= 2) {
        float w = __shfl_down_sync(0xffffffffu, mx, o);
        mx = w > mx ? w : mx;
    }
    if (tid % 32 == 0) red[tid / 32] = mx;
    __syncthreads();
    mx = red[0];
    for (int w = 1; w < KA_THREADS / 32; w++) mx = red[w] > mx ? red[w] : mx;
    __syncthreads();
    for (int i = tid; i < n; i += KA_THREADS) s[i] = expf(s[i] - mx);
    __syncthreads();
    if (tid == 0) {
        double dn = expf(a.sink[h] - mx);
        for (int i = 0; i < n; i++) dn += s[i];
        den = dn;
    }
    __syncthreads();
    float *o = a.o + (long long)t * a.ld_o + (long long)h * D;
    for (int d = tid; d < D; d += KA_THREADS) o[d] = k_bf((float)((double)mf_da_value(s, a.kv, rows, n, D, d) / den));
    if (a.rope_dim <= 0) return;
    __syncthreads();   /* the inverse RoPE of the roped part (mf_da_rope_inv), each pair by one thread */
    float *x = o + D - a.rope_dim;
    const float *cs = a.rope + (long long)t * a.rope_dim;
    for (int i = tid; i < a.rope_dim / 2; i += KA_THREADS) {
        mf_da_rope_inv(cs, a.rope_dim / 2, i, x);
        x[2 * i] = k_bf(x[2 * i]);
        x[2 * i + 1] = k_bf(x[2 * i + 1]);
    }
}

extern "C" int mf_cuda_kern_attn_heads(void *stream, const mf_dev_attn *a)
{
    dim3 grid((unsigned)a->n_tok, (unsigned)a->n_heads);
    k_attn<<<grid, KA_THREADS, 0, (cudaStream_t)stream>>>(*a);
    return k_launched("attention heads", __LINE__);
}

/* ---- index scores (mf_dev_index_scores) ------------------------------------------------------- */

#define KI_THREADS 256
#define KI_KEYS (KI_THREADS / 16)   /* keys per block: one per half-warp */

/* Block (key block x, token y): the token's queries and weights in shared memory; half-warp hw
 * scores key x * KI_KEYS + hw: per head in order lane l of device/kern_attn.h's 16-lane dot, the
 * shuffle tree in mf_da_tree16's order, then lane 0 the float product by the head's weight of the
 * dot's ReLU added in double (mf_kern_vec_index_scores' order); the score (float) of the sum. */
__global__ static void k_iscore(mf_dev_iscore a)
{
    extern __shared__ float ks[];   /* n_heads x D queries, then n_heads weights */
    int t = blockIdx.y, D = a.D, H = a.n_heads, tid = threadIdx.x;
    long long n = a.n_vis[t], j0 = (long long)blockIdx.x * KI_KEYS;
    if (n < 0 || n > a.n_keys) return;   /* skipped (device/dev.h) */
    if (j0 >= n) return;
    const float *q = a.q + (long long)t * a.ld_q, *w = a.w + (long long)t * a.ld_w;
    for (int i = tid; i < H * D; i += KI_THREADS) ks[i] = q[i];
    for (int i = tid; i < H; i += KI_THREADS) ks[H * D + i] = w[i];
    __syncthreads();
    int hw = tid / 16, l = tid % 16;
    long long j = j0 + hw;
    if (j >= n) return;   /* the whole half-warp: its shuffles stay within it */
    unsigned m = 0xffffu << (tid & 16);
    const float *k = a.keys + j * D;
    double acc = 0;
    for (int h = 0; h < H; h++) {
        float v = mf_da_lane(ks + h * D, k, D, l);
        v += __shfl_down_sync(m, v, 8, 16);
        v += __shfl_down_sync(m, v, 4, 16);
        float u2 = __shfl_down_sync(m, v, 2, 16);   /* lanes 0, 1: u0 + u2, u1 + u3 */
        v += u2;
        v += __shfl_down_sync(m, v, 1, 16);
        float rl = v > 0 ? v : 0.0f;
        acc = __dadd_rn(acc, (double)__fmul_rn(ks[H * D + h], rl));
    }
    if (l == 0) a.score[(long long)t * a.ld_s + j] = (double)(float)acc;
}

extern "C" int mf_cuda_kern_index_scores(void *stream, const mf_dev_iscore *a)
{
    if (a->n_keys == 0) return 0;
    size_t shm = sizeof(float) * ((size_t)a->n_heads * a->D + a->n_heads);
    for (int t0 = 0; t0 < a->n_tok; t0 += 65535) {   /* gridDim.y's limit */
        mf_dev_iscore s = *a;
        s.n_tok = a->n_tok - t0 < 65535 ? a->n_tok - t0 : 65535;
        s.q += (long long)t0 * a->ld_q;
        s.w += (long long)t0 * a->ld_w;
        s.n_vis += t0;
        s.score += (long long)t0 * a->ld_s;
        dim3 grid((unsigned)((a->n_keys + KI_KEYS - 1) / KI_KEYS), (unsigned)s.n_tok);
        k_iscore<<<grid, KI_THREADS, shm, (cudaStream_t)stream>>>(s);
        int rc = k_launched("index scores", __LINE__);
        if (rc) return rc;
    }
    return 0;
}
