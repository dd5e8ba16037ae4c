/* The device interface on real CUDA cards: the same checks the emulated cards pass (memory,
 * copies, stream order, events across streams and cards, callbacks, the scheduler adapter on copy
 * tasks), the CUDA kernels (fp32 path) against host/kernels.h within stated tolerances, and the
 * int8 path refused with -ENOTSUP. SKIP (77) in a build without CUDA or on a machine without a
 * card. */
#include <stdio.h>

#include "tests/dev_common.h"

/* max |dev - host| / max |host| in float64 */
static double rel_err(const float *dev, const float *host, size_t n)
{
    double md = 0, mh = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)dev[i] - host[i]);
        if (!(d <= md)) md = d;   /* NaN propagates */
        if (fabs(host[i]) > mh) mh = fabs(host[i]);
    }
    return mh > 0 ? md / mh : md;
}

/* The CUDA kernels against host/kernels.h's fp32 path on fresh random data: relative error
 * (max abs difference over max abs reference, float64) under 1e-5 for the matmuls and 1e-4 for
 * the FFN (summation order differs; the FFN's activation amplifies it). */
static void check_kernels(mf_dev *d)
{
    const int n_out = 200, n_in = 1024, I = 256;
    const int toks[] = {1, 3, 8, 17};
    for (int c = 0; c < mf_dev_n_cards(d); c++)
        for (size_t ti = 0; ti < sizeof toks / sizeof *toks; ti++) {
            int T = toks[ti];
            mf_dev_stream *comp = mf_dev_stream_of(d, c, MF_DEV_STREAM_COMPUTE);
            float *x = malloc(sizeof(float) * T * n_in), *tw = malloc(sizeof(float) * T);
            for (int i = 0; i < T * n_in; i++) x[i] = gauss();
            for (int t = 0; t < T; t++) tw[t] = 0.1f + (dv_rnd() % 1000) / 1000.0f;
            float *yh = malloc(sizeof(float) * T * n_in), *yd = malloc(sizeof(float) * T * n_in);
            float *hh = malloc(sizeof(float) * T * I);
            void *dx = dupload(d, c, x, sizeof(float) * T * n_in), *dtw = dupload(d, c, tw, sizeof(float) * T);
            void *dy = NULL, *dh = NULL;
            CHECK(mf_dev_alloc(d, c, sizeof(float) * T * n_in, &dy) == 0 &&
                  mf_dev_alloc(d, c, sizeof(float) * T * I, &dh) == 0, "%s", mf_last_error());
            for (int f = 0; f < 2; f++) {
                hmat w = hmat_rand(f ? MF_KERN_FP8 : MF_KERN_FP4, n_out, n_in);
                void *ww, *ws;
                mf_kern_mat dw = dmat_upload(d, c, &w, &ww, &ws);
                int rc;
                if (f) {
                    mf_kern_fp8_matmul(w.w, w.scale, n_out, n_in, x, T, n_in, yh, n_out, 0, n_out);
                    rc = mf_dev_fp8_matmul(comp, &dw, dx, T, dy);
                } else {
                    mf_kern_fp4_matmul_f32(w.w, w.scale, n_out, n_in, x, T, n_in, yh, n_out, 0, n_out);
                    rc = mf_dev_fp4_matmul(comp, &dw, dx, T, dy, NULL);
                }
                CHECK(rc == 0, "%s", mf_last_error());
                CHECK(mf_dev_stream_sync(comp) == 0, "%s", mf_last_error());
                ddownload(d, c, yd, dy, sizeof(float) * T * n_out);
                double e = rel_err(yd, yh, (size_t)T * n_out);
                printf("card %d %s matmul T=%d: rel err %.3g\n", c, f ? "fp8" : "fp4", T, e);
                CHECK(e < 1e-5, "card %d %s matmul T=%d: rel err %g", c, f ? "fp8" : "fp4", T, e);
                mf_dev_free(d, c, ww);
                mf_dev_free(d, c, ws);
                hmat_free(&w);
            }
            for (int f = 0; f < 2; f++) {
                mf_kern_fmt fmt = f ? MF_KERN_FP8 : MF_KERN_FP4;
                hmat w1 = hmat_rand(fmt, I, n_in), w3 = hmat_rand(fmt, I, n_in), w2 = hmat_rand(fmt, n_in, I);
                void *p[6];
                mf_dev_ffn a = {.w1 = dmat_upload(d, c, &w1, &p[0], &p[1]),
                                .w3 = dmat_upload(d, c, &w3, &p[2], &p[3]),
                                .w2 = dmat_upload(d, c, &w2, &p[4], &p[5]),
                                .x = dx, .n_tok = T, .tok_weight = dtw, .limit = 7.0f, .h = dh,
                                .y = dy};
                host_ffn(&w1, &w3, &w2, x, T, tw, 7.0f, 0, hh, yh);
                CHECK(mf_dev_expert_ffn(comp, &a) == 0, "%s", mf_last_error());
                CHECK(mf_dev_stream_sync(comp) == 0, "%s", mf_last_error());
                ddownload(d, c, yd, dy, sizeof(float) * T * n_in);
                double e = rel_err(yd, yh, (size_t)T * n_in);
                printf("card %d %s expert FFN T=%d: rel err %.3g\n", c, f ? "fp8" : "fp4", T, e);
                CHECK(e < 1e-4, "card %d %s expert FFN T=%d: rel err %g", c, f ? "fp8" : "fp4", T, e);
                a.q8_scratch = dh;
                if (!f) CHECK(mf_dev_expert_ffn(comp, &a) == -ENOTSUP, "int8 FFN path on CUDA");
                for (int i = 0; i < 6; i++) mf_dev_free(d, c, p[i]);
                hmat_free(&w1);
                hmat_free(&w3);
                hmat_free(&w2);
            }
            mf_dev_free(d, c, dx);
            mf_dev_free(d, c, dtw);
            mf_dev_free(d, c, dy);
            mf_dev_free(d, c, dh);
            free(x);
            free(tw);
            free(yh);
            free(yd);
            free(hh);
        }
}

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
    dev_check_capture(d, 1 << 20);
    check_kernels(d);
    float f[64];
    uint8_t b[64];
    mf_kern_mat m = {.fmt = MF_KERN_FP4, .w = b, .scale = b, .n_out = 1, .n_in = 32};
    rc = mf_dev_fp4_matmul(mf_dev_stream_of(d, 0, MF_DEV_STREAM_COMPUTE), &m, f, 1, f, f);
    CHECK(rc == -ENOTSUP && strstr(mf_last_error(), "int8"), "int8 fp4 launch: %d %s", rc,
          mf_last_error());
    CHECK(mf_dev_sync(d) == 0, "%s", mf_last_error());
    mf_dev_close(d);
    return mf_check_exit("test_dev_cuda");
}
