/* What CUDA devices this process can see, and a decode check of the fp4/fp8 formats on each: the
 * first CUDA code of the project, so that every build with nvcc proves the toolchain, the archs
 * and the link. Built only with MOEFLOW_CUDA; the declarations are always visible. */
#ifndef MF_CUDA_PROBE_H
#define MF_CUDA_PROBE_H

#include <stddef.h>
#include <stdint.h>

#define MF_CUDA_MAX_DEVICES 16

typedef struct mf_cuda_device_info {
    char name[256];
    int cc_major, cc_minor;
    int n_sms;
    uint64_t mem_bytes;
    int pci_bus;
} mf_cuda_device_info;

/* 1 when this build contains the CUDA backend. */
int mf_cuda_built(void);

/* Fills up to max entries; returns the device count (0 when the driver sees none), or a negative
 * code with mf_last_error() set (-ENOSYS in a build without CUDA). */
int mf_cuda_probe(mf_cuda_device_info *out, int max);

/* On device `dev`: decodes n packed E2M1 values (low nibble first) with one E8M0 scale per 32
 * values into f32 out (host memory; copied through the device), and every E4M3 code into
 * e4m3_out[256]. Used to check device decoding against the host's; 0 or a negative code. */
int mf_cuda_decode_check(int dev, const uint8_t *packed, const uint8_t *scales, size_t n, float *out,
                         float *e4m3_out);

#endif
