/* CUDA side of cuda_probe.h: device query and the format-decoding kernels that check the device's
 * reading of E2M1 x E8M0 and E4M3 against host/formats.c. */
#include <cuda_runtime.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

extern "C" {
#include "device/cuda_probe.h"
#include "sched/error.h"
}

#define MF_CUDA_TRY(call)                                                                      \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess)                                                                 \
            return mf_error(-EIO, "%s:%d: %s: %s", __FILE__, __LINE__, #call,                  \
                            cudaGetErrorString(e_));                                           \
    } while (0)

__device__ static float mf_dev_e2m1(unsigned code)
{
    const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    float v = mag[code & 7u];
    return (code & 8u) ? -v : v;
}

__device__ static float mf_dev_e8m0(unsigned code)
{
    if (code == 0xFFu) return __int_as_float(0x7FC00000);
    if (code == 0u) return __int_as_float(0x00400000);   /* 2^-127, a denormal */
    return __int_as_float((int)(code << 23));
}

__device__ static float mf_dev_e4m3(unsigned code)
{
    unsigned s = code >> 7, e = (code >> 3) & 15u, m = code & 7u;
    float v;
    if (e == 15u && m == 7u) v = __int_as_float(0x7FC00000);
    else if (e == 0u) v = ldexpf((float)m, -9);
    else v = ldexpf(1.0f + m / 8.0f, (int)e - 7);
    return s ? -v : v;
}

__global__ static void mf_decode_kernel(const uint8_t *packed, const uint8_t *scales, size_t n,
                                        float *out, float *e4m3_out)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        unsigned code = (packed[i >> 1] >> ((i & 1) * 4)) & 0xFu;
        out[i] = mf_dev_e2m1(code) * mf_dev_e8m0(scales[i / 32]);
    }
    if (i < 256) e4m3_out[i] = mf_dev_e4m3((unsigned)i);
}

extern "C" int mf_cuda_built(void) { return 1; }

extern "C" int mf_cuda_probe(mf_cuda_device_info *out, int max)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) return 0;
    MF_CUDA_TRY(e);
    for (int d = 0; d < n && d < max; d++) {
        cudaDeviceProp p;
        MF_CUDA_TRY(cudaGetDeviceProperties(&p, d));
        snprintf(out[d].name, sizeof out[d].name, "%s", p.name);
        out[d].cc_major = p.major;
        out[d].cc_minor = p.minor;
        out[d].n_sms = p.multiProcessorCount;
        out[d].mem_bytes = p.totalGlobalMem;
        out[d].pci_bus = p.pciBusID;
    }
    return n;
}

extern "C" int mf_cuda_decode_check(int dev, const uint8_t *packed, const uint8_t *scales, size_t n,
                                    float *out, float *e4m3_out)
{
    uint8_t *d_packed = NULL, *d_scales = NULL;
    float *d_out = NULL, *d_e4m3 = NULL;
    size_t n_scales = (n + 31) / 32;
    size_t n_threads = n > 256 ? n : 256;
    int rc = 0;
    MF_CUDA_TRY(cudaSetDevice(dev));
    if (cudaMalloc(&d_packed, (n + 1) / 2) != cudaSuccess || cudaMalloc(&d_scales, n_scales) != cudaSuccess ||
        cudaMalloc(&d_out, n * sizeof(float)) != cudaSuccess ||
        cudaMalloc(&d_e4m3, 256 * sizeof(float)) != cudaSuccess) {
        rc = mf_error(-ENOMEM, "cuda device %d: cannot allocate decode-check buffers", dev);
        goto done;
    }
    if (cudaMemcpy(d_packed, packed, (n + 1) / 2, cudaMemcpyHostToDevice) != cudaSuccess ||
        cudaMemcpy(d_scales, scales, n_scales, cudaMemcpyHostToDevice) != cudaSuccess) {
        rc = mf_error(-EIO, "cuda device %d: host-to-device copy failed", dev);
        goto done;
    }
    mf_decode_kernel<<<(unsigned)((n_threads + 255) / 256), 256>>>(d_packed, d_scales, n, d_out, d_e4m3);
    if (cudaGetLastError() != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess ||
        cudaMemcpy(out, d_out, n * sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess ||
        cudaMemcpy(e4m3_out, d_e4m3, 256 * sizeof(float), cudaMemcpyDeviceToHost) != cudaSuccess) {
        rc = mf_error(-EIO, "cuda device %d: decode kernel failed: %s", dev,
                      cudaGetErrorString(cudaGetLastError()));
    }
done:
    cudaFree(d_packed);
    cudaFree(d_scales);
    cudaFree(d_out);
    cudaFree(d_e4m3);
    return rc;
}
