/* cuda_probe.h in a build without the CUDA backend: says so, truthfully. */
#ifndef MOEFLOW_CUDA
#include <errno.h>

#include "device/cuda_probe.h"
#include "sched/error.h"

int mf_cuda_built(void) { return 0; }

int mf_cuda_probe(mf_cuda_device_info *out, int max)
{
    (void)out;
    (void)max;
    return mf_error(-ENOSYS, "this moeflow was built without CUDA (configure with nvcc on PATH)");
}

int mf_cuda_decode_check(int dev, const uint8_t *packed, const uint8_t *scales, size_t n, float *out,
                         float *e4m3_out)
{
    (void)dev, (void)packed, (void)scales, (void)n, (void)out, (void)e4m3_out;
    return mf_error(-ENOSYS, "this moeflow was built without CUDA");
}
#else
typedef int mf_cuda_none_unused;   /* ISO C forbids an empty translation unit */
#endif
