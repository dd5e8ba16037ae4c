/* CUDA toolchain check: on every visible device, decoding of E2M1 x E8M0 and of all E4M3 codes
 * must equal host/formats.c bit for bit. SKIP (77) without the CUDA backend or without a GPU. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/cuda_probe.h"
#include "host/formats.h"
#include "sched/error.h"
#include "tests/check.h"

static int same_f32(float a, float b)
{
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
    uint32_t x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    return x == y;
}

int main(void)
{
    if (!mf_cuda_built()) {
        printf("test_cuda: SKIP (built without CUDA)\n");
        return 77;
    }
    mf_cuda_device_info info[MF_CUDA_MAX_DEVICES];
    int n_dev = mf_cuda_probe(info, MF_CUDA_MAX_DEVICES);
    if (n_dev < 0) {
        printf("test_cuda: SKIP (%s)\n", mf_last_error());
        return 77;
    }
    if (n_dev == 0) {
        printf("test_cuda: SKIP (no CUDA device visible)\n");
        return 77;
    }
    const size_t n = 4096 * 32 + 17;   /* odd count: the last byte holds one value */
    uint8_t *packed = malloc((n + 1) / 2), *scales = malloc((n + 31) / 32);
    float *out = malloc(n * sizeof(float)), e4m3[256];
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < (n + 1) / 2; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        packed[i] = (uint8_t)(s >> 56);
    }
    for (size_t i = 0; i < (n + 31) / 32; i++) scales[i] = (uint8_t)(i % 255);   /* every non-NaN scale */
    for (int d = 0; d < n_dev; d++) {
        printf("device %d: %s, sm_%d%d, %d SMs, %.1f GiB\n", d, info[d].name, info[d].cc_major,
               info[d].cc_minor, info[d].n_sms, info[d].mem_bytes / 1073741824.0);
        int rc = mf_cuda_decode_check(d, packed, scales, n, out, e4m3);
        CHECK(rc == 0, "decode check on device %d: %s", d, mf_last_error());
        if (rc) continue;
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) {
            float want = mf_e2m1_to_f32(mf_e2m1_get(packed, i)) * mf_e8m0_to_f32(scales[i / 32]);
            if (!same_f32(out[i], want)) bad++;
        }
        CHECK(bad == 0, "device %d: %zu of %zu e2m1 x e8m0 values differ from the host", d, bad, n);
        for (int c = 0; c < 256; c++)
            CHECK(same_f32(e4m3[c], mf_e4m3_to_f32((uint8_t)c)), "device %d: e4m3 code 0x%02x: %g vs %g",
                  d, c, e4m3[c], mf_e4m3_to_f32((uint8_t)c));
    }
    free(packed);
    free(scales);
    free(out);
    return mf_check_exit("test_cuda");
}
