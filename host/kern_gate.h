/* The expert FFN's gating of one hidden row (v41-flash step 5: u = clamp(w3 x, +-limit), g =
 * min(w1 x, limit), silu(g) * u), written once for the host kernels (host/kern_ffn.c), the CUDA
 * kernels (device/dev_kernels.cu) and their host emulation (tests/test_dev_kmath.c). fp32 in this
 * order; a NaN g stays NaN. Callers multiply by the token's routing weight after. */
#ifndef MF_KERN_GATE_H
#define MF_KERN_GATE_H

#include <math.h>

#ifdef __CUDACC__
#define MF_KG_FN static __host__ __device__ __forceinline__
#else
#define MF_KG_FN static inline
#endif

MF_KG_FN float mf_kern_gate(float g, float u, float limit)
{
    float gv = g > limit ? limit : g;
    float uv = u > limit ? limit : u < -limit ? -limit : u;
    float silu = gv / (1.0f + expf(-gv));
    return silu * uv;
}

#endif
