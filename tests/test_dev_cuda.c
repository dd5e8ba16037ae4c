/* The device interface on real CUDA cards: the same checks the emulated cards pass (memory,
 * copies, stream order, events across streams and cards, callbacks, the scheduler adapter on copy
 * tasks), and the CUDA kernels (fp32 and int8 FP4 paths, FP8, the expert FFN on both paths)
 * against host/kernels.h within stated tolerances. SKIP (77) in a build without CUDA or on a
 * machine without a card. */
#include <stdio.h>

#include "device/dense_host.h"
#include "device/dev_check.h"
#include "device/kern_q8.h"
#include "host/formats.h"
#include "tests/dev_common.h"
#include "tests/num.h"

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
            {   /* BF16 (gate, head) */
                uint16_t *wb = malloc(sizeof(uint16_t) * (size_t)n_out * n_in);
                for (size_t i = 0; i < (size_t)n_out * n_in; i++) wb[i] = mf_bf16_from_f32(gauss());
                void *dwb = dupload(d, c, wb, sizeof(uint16_t) * (size_t)n_out * n_in);
                mf_kern_mat bm = {.fmt = MF_KERN_BF16, .w = dwb, .n_out = n_out, .n_in = n_in};
                mf_kern_bf16_matmul(wb, n_out, n_in, x, T, n_in, yh, n_out, 0, n_out);
                CHECK(mf_dev_bf16_matmul(comp, &bm, dx, T, dy) == 0 && mf_dev_stream_sync(comp) == 0, "%s",
                      mf_last_error());
                ddownload(d, c, yd, dy, sizeof(float) * T * n_out);
                double e = rel_err(yd, yh, (size_t)T * n_out);
                printf("card %d bf16 matmul T=%d: rel err %.3g\n", c, T, e);
                CHECK(e < 1e-5, "card %d bf16 matmul T=%d: rel err %g", c, T, e);
                mf_dev_free(d, c, dwb);
                free(wb);
            }
            /* the startup self-check (device/dev_check.h) passes on a healthy card */
            CHECK(mf_dev_selfcheck(d, c, (uint64_t)T) == 0, "card %d self-check: %s", c, mf_last_error());
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

/* The int8 FP4 path against the host's int8 kernels on fresh random data, T = 1..64 tokens:
 *  - the card's quantized activations equal the host's bit for bit (codes and scales);
 *  - the matmul: relative error (max abs difference over max abs host value, float64) under 1e-5
 *    (the integer block sums are exact on both; fp32 summation order differs), with weights at a
 *    16-byte aligned address (vector loads) and at an odd one (byte loads);
 *  - the expert FFN (w1, w3, limit 7, token weights, w2): h under 1e-4 (g and u differ in fp32
 *    order relative to their unclamped size), y under 1e-3 (a few of h's int8 codes may round the
 *    other way). tests/test_dev_kmath.c runs the same lane arithmetic on the host. */
static void check_int8(mf_dev *d)
{
    const int n_out = 300, n_in = 32 * 77, I = 32 * 20;   /* partial last 256-groups */
    const int toks[] = {1, 2, 3, 8, 17, 64};
    for (int c = 0; c < mf_dev_n_cards(d); c++)
        for (size_t ti = 0; ti < sizeof toks / sizeof *toks; ti++) {
            int T = toks[ti];
            mf_dev_stream *comp = mf_dev_stream_of(d, c, MF_DEV_STREAM_COMPUTE);
            size_t qb = mf_kern_q8_bytes(T, n_in), fb = mf_dev_ffn_q8_bytes(T, n_in, I);
            float *x = malloc(sizeof(float) * T * n_in), *tw = malloc(sizeof(float) * T);
            float *yh = malloc(sizeof(float) * T * n_in), *yd = malloc(sizeof(float) * T * n_in);
            float *hh = malloc(sizeof(float) * T * I), *hd = malloc(sizeof(float) * T * I);
            uint8_t *qh = malloc(qb), *qd = malloc(qb + 16);
            for (int i = 0; i < T * n_in; i++) x[i] = gauss();
            for (int t = 0; t < T; t++) tw[t] = 0.1f + (dv_rnd() % 1000) / 1000.0f;
            void *dx = dupload(d, c, x, sizeof(float) * T * n_in), *dtw = dupload(d, c, tw, sizeof(float) * T);
            void *dy = NULL, *dh = NULL, *dq = NULL;
            CHECK(mf_dev_alloc(d, c, sizeof(float) * T * n_in, &dy) == 0 &&
                  mf_dev_alloc(d, c, sizeof(float) * T * I, &dh) == 0 &&
                  mf_dev_alloc(d, c, fb + 16, &dq) == 0, "%s", mf_last_error());
            void *dq_odd = (uint8_t *)dq + 4;   /* the view aligns it itself */
            hmat w = hmat_rand(MF_KERN_FP4, n_out, n_in);
            mf_kern_q8 q;
            CHECK(mf_kern_q8_init(&q, qh, qb, T, n_in) == 0 && mf_kern_q8_quantize(&q, x, n_in, 0, T) == 0 &&
                  mf_kern_fp4_matmul(w.w, w.scale, n_out, n_in, &q, yh, n_out, 0, n_out) == 0, "%s",
                  mf_last_error());
            for (int odd = 0; odd < 2; odd++) {
                void *ww, *ws, *wodd = NULL;
                mf_kern_mat dw = dmat_upload(d, c, &w, &ww, &ws);
                if (odd) {   /* the same bytes at an address 16-byte loads cannot use */
                    CHECK(mf_dev_alloc(d, c, w.w_bytes + 1, &wodd) == 0, "%s", mf_last_error());
                    mf_dev_stream *in = mf_dev_stream_of(d, c, MF_DEV_STREAM_COPY_IN);
                    CHECK(mf_dev_copy_h2d(in, (uint8_t *)wodd + 1, w.w, w.w_bytes) == 0 &&
                          mf_dev_stream_sync(in) == 0, "%s", mf_last_error());
                    dw.w = (uint8_t *)wodd + 1;
                }
                CHECK(mf_dev_fp4_matmul(comp, &dw, dx, T, dy, dq_odd) == 0, "%s", mf_last_error());
                CHECK(mf_dev_stream_sync(comp) == 0, "%s", mf_last_error());
                ddownload(d, c, yd, dy, sizeof(float) * T * n_out);
                double e = rel_err(yd, yh, (size_t)T * n_out);
                printf("card %d int8 fp4 matmul T=%d%s: rel err %.3g\n", c, T, odd ? " (unaligned)" : "", e);
                CHECK(e < 1e-5, "card %d int8 fp4 matmul T=%d%s: rel err %g", c, T, odd ? " unaligned" : "", e);
                mf_dev_free(d, c, ww);
                mf_dev_free(d, c, ws);
                mf_dev_free(d, c, wodd);
            }
            /* the card's quantization, read back: the view of the device address, shifted here */
            ddownload(d, c, qd, dq_odd, qb);
            mf_q8k_view dv = mf_q8k_view_of(dq_odd, T, n_in);
            size_t qoff = (size_t)((uint8_t *)dv.q - (uint8_t *)dq_odd);
            const int8_t *cq = (const int8_t *)(qd + qoff);
            const float *cs = (const float *)(qd + qoff + (size_t)T * n_in);
            int bad = 0;
            for (int t = 0; t < T; t++) {
                for (int k = 0; k < n_in; k++) {
                    int b = k / 32, e = k % 32;
                    size_t pos = (size_t)(b / 2) * 64 + (size_t)(e & 1) * 32 + (size_t)(b & 1) * 16 + (size_t)(e / 2);
                    bad += (int8_t)(uint8_t)(q.q[(size_t)t * q.row_bytes + pos] - q.offset) != cq[(size_t)t * n_in + k];
                }
                for (int s = 0; s < q.n_sb; s++) bad += q.scale[t * q.n_sb + s] != cs[t * q.n_sb + s];
            }
            CHECK(bad == 0, "card %d T=%d: %d quantized codes or scales differ from the host's", c, T, bad);
            hmat_free(&w);

            hmat w1 = hmat_rand(MF_KERN_FP4, I, n_in), w3 = hmat_rand(MF_KERN_FP4, I, n_in),
                 w2 = hmat_rand(MF_KERN_FP4, n_in, I);
            void *p[6];
            mf_dev_ffn a = {.w1 = dmat_upload(d, c, &w1, &p[0], &p[1]),
                            .w3 = dmat_upload(d, c, &w3, &p[2], &p[3]),
                            .w2 = dmat_upload(d, c, &w2, &p[4], &p[5]),
                            .x = dx, .n_tok = T, .tok_weight = dtw, .limit = 7.0f, .h = dh,
                            .q8_scratch = dq_odd, .y = dy};
            host_ffn(&w1, &w3, &w2, x, T, tw, 7.0f, 1, hh, yh);
            CHECK(mf_dev_expert_ffn(comp, &a) == 0, "%s", mf_last_error());
            CHECK(mf_dev_stream_sync(comp) == 0, "%s", mf_last_error());
            ddownload(d, c, yd, dy, sizeof(float) * T * n_in);
            ddownload(d, c, hd, dh, sizeof(float) * T * I);
            double eh = rel_err(hd, hh, (size_t)T * I), ey = rel_err(yd, yh, (size_t)T * n_in);
            printf("card %d int8 expert FFN T=%d: rel err h %.3g, y %.3g\n", c, T, eh, ey);
            CHECK(eh < 1e-4 && ey < 1e-3, "card %d int8 expert FFN T=%d: rel err h %g, y %g", c, T, eh, ey);
            for (int i = 0; i < 6; i++) mf_dev_free(d, c, p[i]);
            hmat_free(&w1);
            hmat_free(&w3);
            hmat_free(&w2);
            mf_dev_free(d, c, dx);
            mf_dev_free(d, c, dtw);
            mf_dev_free(d, c, dy);
            mf_dev_free(d, c, dh);
            mf_dev_free(d, c, dq);
            free(x);
            free(tw);
            free(yh);
            free(yd);
            free(hh);
            free(hd);
            free(qh);
            free(qd);
        }
}

/* mf_dev_index_scores on card 0 against device/dense_host.h (the host's bits, tests/test_dev_iscore.c):
 * 9 tokens, 32 heads of 128 (flash41's indexer), 700 keys, the tokens seeing a growing prefix;
 * within 1e-5 of the largest score (the kernel's lanes, tree and sums are the host's: bit for bit
 * expected, reported). */
static void check_iscore(mf_dev *d)
{
    enum { T = 9, H = 32, D = 128, K = 700 };
    uint64_t seed = 0x15c0;
    float *q = malloc(sizeof(float) * T * H * D), *w = malloc(sizeof(float) * T * H), *k = malloc(sizeof(float) * K * D);
    double *ref = calloc((size_t)T * K, sizeof(double)), *got = calloc((size_t)T * K, sizeof(double));
    int32_t nv[T];
    for (int i = 0; i < T * H * D; i++) q[i] = mf_test_frand(&seed);
    for (int i = 0; i < T * H; i++) w[i] = mf_test_frand(&seed);
    for (int i = 0; i < K * D; i++) k[i] = mf_test_frand(&seed);
    for (int t = 0; t < T; t++) nv[t] = K * (t + 1) / T;
    mf_dev_iscore a = {.q = q, .ld_q = H * D, .w = w, .ld_w = H, .n_tok = T, .n_heads = H, .D = D, .keys = k,
                       .n_keys = K, .n_vis = nv, .score = ref, .ld_s = K};
    CHECK(mf_dense_host_iscore(&a) == 0, "host index scores: %s", mf_last_error());
    void *dq = NULL, *dw = NULL, *dk = NULL, *dv = NULL, *ds = NULL;
    int rc = mf_dev_alloc(d, 0, sizeof(float) * T * H * D, &dq);
    if (!rc) rc = mf_dev_alloc(d, 0, sizeof(float) * T * H, &dw);
    if (!rc) rc = mf_dev_alloc(d, 0, sizeof(float) * K * D, &dk);
    if (!rc) rc = mf_dev_alloc(d, 0, sizeof nv, &dv);
    if (!rc) rc = mf_dev_alloc(d, 0, sizeof(double) * T * K, &ds);
    mf_dev_stream *s = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COMPUTE);
    if (!rc) rc = mf_dev_copy_h2d(s, dq, q, sizeof(float) * T * H * D);
    if (!rc) rc = mf_dev_copy_h2d(s, dw, w, sizeof(float) * T * H);
    if (!rc) rc = mf_dev_copy_h2d(s, dk, k, sizeof(float) * K * D);
    if (!rc) rc = mf_dev_copy_h2d(s, dv, nv, sizeof nv);
    if (!rc) rc = mf_dev_copy_h2d(s, ds, got, sizeof(double) * T * K);
    a.q = dq, a.w = dw, a.keys = dk, a.n_vis = dv, a.score = ds;
    if (!rc) rc = mf_dev_index_scores(s, &a);
    if (!rc) rc = mf_dev_copy_d2h(s, got, ds, sizeof(double) * T * K);
    if (!rc) rc = mf_dev_stream_sync(s);
    CHECK(rc == 0, "cuda index scores: %s", mf_last_error());
    double md = 0, mb = 0;
    for (int i = 0; i < T * K; i++) {
        double e = fabs(got[i] - ref[i]);
        if (!(e <= md)) md = e;
        if (fabs(ref[i]) > mb) mb = fabs(ref[i]);
    }
    CHECK(md <= 1e-5 * mb, "cuda index scores: max error %.3g of largest %.3g", md, mb);
    printf("test_dev_cuda: index scores %d tok x %d heads of %d, %d keys: max rel err %.2e, %s\n", T, H, D, K,
           mb > 0 ? md / mb : md, !memcmp(got, ref, sizeof(double) * T * K) ? "bit-identical" : "NOT bit-identical");
    mf_dev_free(d, 0, dq), mf_dev_free(d, 0, dw), mf_dev_free(d, 0, dk), mf_dev_free(d, 0, dv), mf_dev_free(d, 0, ds);
    free(q), free(w), free(k), free(ref), free(got);
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
    /* a refused allocation (compute-sanitizer memcheck reports it as an API error unless run with
     * --report-api-errors no, as tools/device-check.sh does) */
    void *big = NULL;
    rc = mf_dev_alloc(d, 0, (size_t)1 << 50, &big);
    CHECK(rc == -ENOMEM && !big && strstr(mf_last_error(), "cudaMalloc"), "1 PiB: rc %d %s", rc,
          mf_last_error());
    dev_check_copies(d, (8 << 20) + 13);
    dev_check_copies_2d(d);
    dev_check_order(d);
    printf("test_dev_cuda: pinned h2d of 64 MiB between timed events: %.1f us\n",
           (double)dev_check_event_timing(d, 64 << 20) / 1e3);
    dev_check_events(d, 8 << 20);
    dev_check_sched_copies(d, 16, 1 << 20);
    dev_check_capture(d, 1 << 20);
    check_kernels(d);
    check_int8(d);
    dev_check_ffn_table(d, 0);
    dev_check_dense(d, 0);
    mf_dev_f16 f16 = mf_dev_card_f16(d, 0);
    printf("test_dev_cuda: cuBLASLt path: card 0's tensor cores take %s\n",
           f16 == MF_DEV_F16_BF16 ? "bf16 (and fp16)" : f16 == MF_DEV_F16_FP16 ? "fp16" : "nothing (no tensor cores)");
    dev_check_lt(d, 0, MF_DEV_CHECK_TOL_LT, MF_DEV_CHECK_TOL_LT_FFN);
    check_iscore(d);
    CHECK(mf_dev_sync(d) == 0, "%s", mf_last_error());
    mf_dev_close(d);
    return mf_check_exit("test_dev_cuda");
}
