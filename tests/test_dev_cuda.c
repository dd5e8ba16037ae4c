/* The device interface on real CUDA cards: the same checks the emulated cards pass (memory,
 * copies, stream order, events across streams and cards, callbacks, the scheduler adapter on copy
 * tasks), and kernel launches refused with -ENOTSUP until the CUDA kernels exist. SKIP (77) in a
 * build without CUDA or on a machine without a card. */
#include <stdio.h>

#include "tests/dev_common.h"

int main(void)
{
    mf_dev *d = NULL;
    int rc = mf_dev_open("cuda", &d);
    if (rc == -ENOSYS || rc == -ENODEV) {
        printf("test_dev_cuda: SKIP: %s\n", mf_last_error());
        return 77;
    }
    CHECK(rc == 0, "open cuda: %s", mf_last_error());
    if (rc) return mf_check_exit("test_dev_cuda");
    printf("test_dev_cuda: %d card(s)\n", mf_dev_n_cards(d));
    CHECK(!strcmp(mf_dev_kind(d), "cuda"), "kind %s", mf_dev_kind(d));
    void *big = NULL;
    rc = mf_dev_alloc(d, 0, (size_t)1 << 50, &big);
    CHECK(rc == -ENOMEM && !big && strstr(mf_last_error(), "cudaMalloc"), "1 PiB: rc %d %s", rc,
          mf_last_error());
    dev_check_copies(d, (8 << 20) + 13);
    dev_check_order(d);
    dev_check_events(d, 8 << 20);
    dev_check_sched_copies(d, 16, 1 << 20);
    float f[64];
    uint8_t b[64];
    mf_kern_mat m = {.fmt = MF_KERN_FP4, .w = b, .scale = b, .n_out = 1, .n_in = 32};
    rc = mf_dev_fp4_matmul(mf_dev_stream_of(d, 0, MF_DEV_STREAM_COMPUTE), &m, f, 1, f, NULL);
    CHECK(rc == -ENOTSUP && strstr(mf_last_error(), "not implemented"), "fp4 launch: %d %s", rc,
          mf_last_error());
    CHECK(mf_dev_sync(d) == 0, "%s", mf_last_error());
    mf_dev_close(d);
    return mf_check_exit("test_dev_cuda");
}
