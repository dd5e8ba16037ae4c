/* Hardware calibration, cards (graphs/calib/hwcal.h): through device/dev.h only, so emulated and CUDA
 * cards are measured alike: pinned copy latency (many small copies back to back) and bandwidth
 * (large copies) each way, all cards copying in at once, and the kernel rates of the fp4 and fp8
 * matmuls on card 0's compute stream with weights in card memory. Without --devices the profile
 * has no cards and every card figure is 0. */
#define _GNU_SOURCE
#include "graphs/calib/hwcal_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/cuda_probe.h"
#include "device/dev.h"
#include "sched/clock.h"
#include "sched/error.h"

static const char *mf_card_keys[] = {
    "card_mem_bytes", "h2d_bytes_per_s", "h2d_latency_ns", "d2h_bytes_per_s", "d2h_latency_ns",
    "h2d_total_bytes_per_s", "act_copy_latency_ns", "card_fp4_bytes_per_s", "card_fp4_macs_per_s", "card_fp4_latency_ns",
    "card_fp8_bytes_per_s", "card_fp8_macs_per_s", "card_fp8_latency_ns", "card_bf16_bytes_per_s",
    "card_bf16_macs_per_s", "card_bf16_latency_ns", "card_ref_macs_per_s", "card_ref_latency_ns",
};

/* Per-card memory: emulated cards from the spec's mem= (dev.h's default 16 GiB), CUDA cards from
 * the driver (the smallest of the cards opened). */
static int mf_card_mem(mf_hwcal *h, mf_dev *d, const char *spec)
{
    mf_profile *p = h->p;
    if (!strcmp(mf_dev_kind(d), "emu")) {
        uint64_t mem = 16ull << 30;
        const char *m = strstr(spec, ",mem=");
        if (m) {
            char *end;
            unsigned long long n = strtoull(m + 5, &end, 10);
            uint64_t mul = *end == 'K' || *end == 'k' ? 1ull << 10 : *end == 'M' || *end == 'm' ? 1ull << 20
                           : *end == 'G' || *end == 'g' ? 1ull << 30 : 1;
            mem = n * mul;
        }
        p->card_mem_bytes = mem;
        return mf_hwcal_src_raw(h, "card_mem_bytes", "emulated cards: the capacity of the device spec '%s' (%s)",
                                spec, m ? "mem=" : "device/dev.h's default 16 GiB");
    }
    mf_cuda_device_info info[MF_CUDA_MAX_DEVICES];
    int n = mf_cuda_probe(info, MF_CUDA_MAX_DEVICES);
    if (n <= 0) return n < 0 ? n : mf_error(-ENODEV, "calibrate: the CUDA probe sees no card");
    int ids[MF_CUDA_MAX_DEVICES], n_ids = 0;
    if (!strncmp(spec, "cuda:", 5)) {
        for (const char *s = spec + 5; *s && n_ids < MF_CUDA_MAX_DEVICES;) {
            ids[n_ids++] = (int)strtol(s, (char **)&s, 10);
            if (*s == ',') s++;
            else if (*s) break;
        }
    } else {
        for (int i = 0; i < n; i++) ids[n_ids++] = i;
    }
    uint64_t mem = UINT64_MAX;
    for (int i = 0; i < n_ids; i++)
        if (ids[i] >= 0 && ids[i] < n && info[ids[i]].mem_bytes < mem) mem = info[ids[i]].mem_bytes;
    if (mem == UINT64_MAX) return mf_error(-ENODEV, "calibrate: no card of '%s' in the CUDA probe", spec);
    p->card_mem_bytes = mem;
    return mf_hwcal_src(h, "card_mem_bytes", "CUDA driver: total memory of %s (the smallest card of '%s')",
                        info[ids[0]].name, spec);
}

/* ns per copy: n copies of `bytes` back to back on stream s, then one sync; median of reps. */
static int mf_copy_time(mf_dev_stream *s, int h2d, void *dev, void *host, size_t bytes, int n, int reps, double *ns)
{
    double v[16];
    for (int r = -1; r < reps; r++) {
        int64_t t0 = mf_now_ns();
        for (int i = 0; i < n; i++) {
            int rc = h2d ? mf_dev_copy_h2d(s, dev, host, bytes) : mf_dev_copy_d2h(s, host, dev, bytes);
            if (rc) return rc;
        }
        int rc = mf_dev_stream_sync(s);
        if (rc) return rc;
        if (r >= 0) v[r] = (double)(mf_now_ns() - t0) / n;
    }
    *ns = mf_hwcal_median(v, reps);
    return 0;
}

static int mf_hwcal_copies(mf_hwcal *h, mf_dev *d, void **hbuf, void **dbuf, size_t big)
{
    mf_profile *p = h->p;
    int reps = h->o->quick ? 3 : 5, n_small = h->o->quick ? 32 : 128, n_big = 4, rc = 0;
    const size_t small = 4096;
    for (int dir = 0; dir < 2 && !rc; dir++) {
        int h2d = dir == 0;
        mf_dev_stream *s = mf_dev_stream_of(d, 0, h2d ? MF_DEV_STREAM_COPY_IN : MF_DEV_STREAM_COPY_OUT);
        double t_small, t_big;
        if ((rc = mf_copy_time(s, h2d, dbuf[0], hbuf[0], small, n_small, reps, &t_small)) ||
            (rc = mf_copy_time(s, h2d, dbuf[0], hbuf[0], big, n_big, reps, &t_big)))
            break;
        if (!(t_big > t_small)) {
            rc = mf_error(-EIO, "calibrate: a %zu MiB copy was not slower than a 4 KiB one: too noisy", big >> 20);
            break;
        }
        double bps = (double)(big - small) / ((t_big - t_small) / 1e9);
        double lat = t_small - (double)small / bps * 1e9;
        if (lat < 0) lat = 0;
        const char *name = h2d ? "h2d" : "d2h";
        char kb[48], kl[48];
        snprintf(kb, sizeof kb, "%s_bytes_per_s", name);
        snprintf(kl, sizeof kl, "%s_latency_ns", name);
        if (h2d) p->h2d_bytes_per_s = bps, p->h2d_latency_ns = lat;
        else p->d2h_bytes_per_s = bps, p->d2h_latency_ns = lat;
        mf_hwcal_src(h, kb, "card 0, pinned %s copies of %zu MiB (%d back to back) vs 4 KiB, one stream, medians of "
                     "%d%s", name, big >> 20, n_big, reps, p->cards_emulated ? "; emulated: the spec's copy model" : "");
        mf_hwcal_src(h, kl, "card 0, %d pinned 4 KiB %s copies back to back, one sync: time per copy less its "
                     "bytes, median of %d", n_small, name, reps);
        mf_hwcal_note(h, "card 0 %s: %.2f GB/s, latency %.1f us", name, bps / 1e9, lat / 1e3);
    }
    if (!rc) {   /* activations are copies of a few KB: the 4 KiB copies' latency, the larger way */
        p->act_copy_latency_ns = p->h2d_latency_ns > p->d2h_latency_ns ? p->h2d_latency_ns : p->d2h_latency_ns;
        mf_hwcal_src(h, "act_copy_latency_ns", "card 0: the larger of h2d_latency_ns and d2h_latency_ns (both "
                     "measured on 4 KiB copies, the size of a sublayer's activations)");
    }
    if (rc) return rc;
    /* every card copying in at once */
    int n = mf_dev_n_cards(d);
    double v[8];
    for (int r = -1; r < reps && !rc; r++) {
        int64_t t0 = mf_now_ns();
        for (int c = 0; c < n && !rc; c++)
            for (int i = 0; i < 2 && !rc; i++)
                rc = mf_dev_copy_h2d(mf_dev_stream_of(d, c, MF_DEV_STREAM_COPY_IN), dbuf[c], hbuf[c], big);
        if (!rc) rc = mf_dev_sync(d);
        if (r >= 0) v[r] = (double)n * 2 * big / ((double)(mf_now_ns() - t0) / 1e9);
    }
    if (rc) return rc;
    p->h2d_total_bytes_per_s = mf_hwcal_median(v, reps);
    mf_hwcal_src(h, "h2d_total_bytes_per_s", "all %d cards at once, 2 pinned %zu MiB h2d copies each: total bytes "
                 "/ time, median of %d", n, big >> 20, reps);
    mf_hwcal_note(h, "all %d cards h2d at once: %.2f GB/s in total", n, p->h2d_total_bytes_per_s / 1e9);
    return 0;
}

/* ns per call of the fp4 or fp8 matmul on card 0's compute stream, rotating through n_copies
 * copies of the weights in card memory. */
static int mf_card_kern_time(mf_dev *d, int fp4, uint8_t *const *w, const size_t *s_off, int n_copies, int n_out,
                             int n_in, const float *x, int n_tok, float *y, void *q8, int reps, double *ns)
{
    mf_dev_stream *s = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COMPUTE);
    int calls = n_copies < 4 ? 4 : n_copies;
    double v[32];
    for (int r = -1; r < reps; r++) {
        int64_t t0 = mf_now_ns();
        for (int i = 0; i < calls; i++) {
            int c = i % n_copies;
            mf_kern_mat m = {fp4 ? MF_KERN_FP4 : MF_KERN_FP8, w[c], w[c] + s_off[0], n_out, n_in};
            int rc = fp4 ? mf_dev_fp4_matmul(s, &m, x, n_tok, y, q8) : mf_dev_fp8_matmul(s, &m, x, n_tok, y);
            if (rc) return rc;
        }
        int rc = mf_dev_stream_sync(s);
        if (rc) return rc;
        if (r >= 0) v[r] = (double)(mf_now_ns() - t0) / calls;
    }
    *ns = mf_hwcal_median(v, reps);
    return 0;
}

#define MF_HWCAL_TC_N 4096   /* the tensor-core GEMM's weights: [4096 x 4096] FP8 */
#define MF_HWCAL_TC_T0 256   /* its token counts: the rate is the multiply-adds between them */
#define MF_HWCAL_TC_T1 2048

/* ns per call of the FP8 linear l on the cuBLASLt path at n_tok tokens on stream s: 4 calls then a
 * sync, the median of reps. */
static int mf_card_tc_time(mf_dev_stream *s, mf_dev_lin l, int n_tok, int reps, double *ns)
{
    double v[16];
    l.n_tok = n_tok;
    for (int r = -1; r < reps; r++) {
        int64_t t0 = mf_now_ns();
        for (int i = 0; i < 4; i++) {
            int rc = mf_dev_linear(s, &l);
            if (rc) return rc;
        }
        int rc = mf_dev_stream_sync(s);
        if (rc) return rc;
        if (r >= 0) v[r] = (double)(mf_now_ns() - t0) / 4;
    }
    *ns = mf_hwcal_median(v, reps);
    return 0;
}

/* card_tc_macs_per_s, the tensor cores' GEMM rate on the cuBLASLt path (sched/cost.h
 * mf_cost_card_lt_gemm prices n x macs at it): card 0 (CUDA, with tensor cores: mf_dev_card_f16) runs
 * an FP8 [4096 x 4096] linear with its weights dequantized once (mf_dev_dequant, the card's 16-bit
 * type) at 256 and 2,048 tokens (mf_dev_linear, MF_DEV_LIN_CUBLASLT: the cast and cublasLtMatmul); the
 * rate is the multiply-adds between the two over the time between them. Emulated cards, and cards
 * without tensor cores, get 0: their path is the host's product (emulated) or none, and 0 keeps the
 * cost model off it. */
static int mf_hwcal_card_tc(mf_hwcal *h, mf_dev *d, void *hstage, size_t hstage_bytes)
{
    mf_profile *p = h->p;
    mf_dev_f16 tc = mf_dev_card_f16(d, 0);
    p->card_tc_macs_per_s = 0;
    if (p->cards_emulated || tc == MF_DEV_F16_NONE)
        return mf_hwcal_src_raw(h, "card_tc_macs_per_s", "%s", p->cards_emulated
                                ? "emulated cards: 0, not measured (their cuBLASLt path is the host's product in host "
                                  "code, no tensor cores; 0 keeps the cost model off the path unless asked)"
                                : "card 0 has no tensor cores for the cuBLASLt path (before sm_70): 0");
    const int N = MF_HWCAL_TC_N, T1 = MF_HWCAL_TC_T1, reps = h->o->quick ? 3 : 7;
    size_t wb = (size_t)N * N, sb = (size_t)(N / 32) * (N / 32), xb = sizeof(float) * T1 * N;
    size_t w16b = wb * 2, x16b = mf_dev_lt_x16_bytes(T1, N);
    uint8_t *w = NULL;
    void *w16 = NULL, *x16 = NULL, *ws = NULL;
    float *x = NULL, *y = NULL;
    mf_dev_stream *cs = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COMPUTE), *cin = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COPY_IN);
    int rc = 0;
    if ((rc = mf_dev_alloc(d, 0, wb + sb, (void **)&w)) || (rc = mf_dev_alloc(d, 0, w16b, &w16)) ||
        (rc = mf_dev_alloc(d, 0, xb, (void **)&x)) || (rc = mf_dev_alloc(d, 0, xb, (void **)&y)) ||
        (rc = mf_dev_alloc(d, 0, x16b, &x16)) || (rc = mf_dev_alloc(d, 0, MF_DEV_LT_WS_BYTES, &ws)))
        goto out;
    /* random codes, scales 1 (E8M0 127: shift 0 exact in either type), random activations */
    for (size_t off = 0; off < wb + sb && !rc; off += hstage_bytes) {
        size_t n = wb + sb - off < hstage_bytes ? wb + sb - off : hstage_bytes;
        mf_hwcal_fill(h, hstage, n, 2);
        size_t s0 = off > wb ? off : wb;   /* the chunk's scale bytes [s0, off + n) */
        if (s0 < off + n) memset((uint8_t *)hstage + (s0 - off), 127, off + n - s0);
        if (!(rc = mf_dev_copy_h2d(cin, w + off, hstage, n))) rc = mf_dev_stream_sync(cin);
    }
    float *hx = hstage;
    for (size_t i = 0; i < hstage_bytes / sizeof(float); i++) hx[i] = (float)((int)(mf_hwcal_rand(h) % 2001) - 1000) * 1e-3f;
    for (size_t off = 0; off < xb && !rc; off += hstage_bytes)
        rc = mf_dev_copy_h2d(cin, (uint8_t *)x + off, hstage, xb - off < hstage_bytes ? xb - off : hstage_bytes);
    if (!rc) rc = mf_dev_stream_sync(cin);
    mf_dev_lin l = {.w = {MF_KERN_FP8, w, w + wb, N, N}, .x = x, .ld_x = N, .y = y, .ld_y = N,
                    .path = MF_DEV_LIN_CUBLASLT, .w16 = {w16, tc, 0, N, N}, .lt = {x16, x16b, ws, MF_DEV_LT_WS_BYTES}};
    if (!rc) rc = mf_dev_dequant(cs, &l.w, &l.w16);
    double t0 = 0, t1 = 0;
    if (!rc) rc = mf_card_tc_time(cs, l, MF_HWCAL_TC_T0, reps, &t0);
    if (!rc) rc = mf_card_tc_time(cs, l, T1, reps, &t1);
    if (!rc && t1 > t0) {
        p->card_tc_macs_per_s = (double)N * N * (T1 - MF_HWCAL_TC_T0) / (t1 - t0) * 1e9;
        mf_hwcal_src(h, "card_tc_macs_per_s", "card 0 cuBLASLt path (mf_dev_linear MF_DEV_LIN_CUBLASLT, %s weights "
                     "dequantized once): [%dx%d] FP8 linear at %d and %d tokens, the multiply-adds between over the "
                     "time between (%.1f and %.1f us), medians of %d", tc == MF_DEV_F16_FP16 ? "fp16" : "bf16", N, N,
                     MF_HWCAL_TC_T0, T1, t0 / 1e3, t1 / 1e3, reps);
        mf_hwcal_note(h, "card 0 tensor cores (cuBLASLt): %.2f T multiply-adds/s", p->card_tc_macs_per_s / 1e12);
    } else if (!rc) {
        mf_hwcal_src_raw(h, "card_tc_macs_per_s", "card 0 cuBLASLt path: %d tokens took no longer than %d (%.1f, %.1f "
                         "us): no rate, 0", T1, MF_HWCAL_TC_T0, t1 / 1e3, t0 / 1e3);
    }
out:
    if (rc == -ENOMEM) {   /* a small card: say so, keep the rest of the calibration */
        mf_hwcal_src_raw(h, "card_tc_macs_per_s", "card 0 cuBLASLt path: not measured (no room for a [%dx%d] linear "
                         "at %d tokens): 0", N, N, T1);
        rc = 0;
    }
    mf_dev_free(d, 0, w);
    mf_dev_free(d, 0, w16);
    mf_dev_free(d, 0, x);
    mf_dev_free(d, 0, y);
    mf_dev_free(d, 0, x16);
    mf_dev_free(d, 0, ws);
    return rc;
}

static int mf_hwcal_card_kernels(mf_hwcal *h, mf_dev *d, void *hstage, size_t hstage_bytes)
{
    mf_profile *p = h->p;
    int reps = h->o->quick ? 3 : 7, rc = 0;
    size_t pool_min = (h->o->quick ? 1 : 3) * (h->llc_bytes ? h->llc_bytes : (size_t)32 << 20) + ((size_t)8 << 20);
    float *x = NULL, *y = NULL;
    void *q8 = NULL;
    size_t xb = sizeof(float) * MF_HWCAL_MANY * MF_HWCAL_B_IN, yb = sizeof(float) * MF_HWCAL_MANY * MF_HWCAL_B_OUT;
    size_t qb = mf_kern_q8_bytes(MF_HWCAL_MANY, MF_HWCAL_B_IN);
    if ((rc = mf_dev_alloc(d, 0, xb, (void **)&x)) || (rc = mf_dev_alloc(d, 0, yb, (void **)&y)) ||
        (rc = mf_dev_alloc(d, 0, qb, &q8)))
        goto out;
    float *hx = hstage;
    for (size_t i = 0; i < xb / sizeof(float); i++) hx[i] = (float)((int)(mf_hwcal_rand(h) % 2001) - 1000) * 1e-3f;
    mf_dev_stream *cin = mf_dev_stream_of(d, 0, MF_DEV_STREAM_COPY_IN);
    if ((rc = mf_dev_copy_h2d(cin, x, hx, xb)) || (rc = mf_dev_stream_sync(cin))) goto out;
    int fp4_int8 = 1;
    for (int fam = 0; fam < 2 && !rc; fam++) {
        int fp4 = fam == 0;
        const char *name = fp4 ? "fp4" : "fp8";
        int shapes[2][2] = {{MF_HWCAL_A_OUT, MF_HWCAL_A_IN}, {MF_HWCAL_B_OUT, MF_HWCAL_B_IN}};
        double t1[2] = {0, 0}, tn = 0, bytes[2];
        for (int sh = 0; sh < 2 && !rc; sh++) {
            int n_out = shapes[sh][0], n_in = shapes[sh][1];
            size_t e = (size_t)n_out * n_in;
            size_t wb = fp4 ? e / 2 : e, sb = fp4 ? e / 32 : (size_t)((n_out + 31) / 32) * (n_in / 32);
            size_t one = ((wb + 255) & ~(size_t)255) + sb;
            bytes[sh] = (double)(wb + sb);
            int n_copies = (int)(pool_min / one) + 2;
            if (n_copies > 64) n_copies = 64;
            uint8_t *w[64] = {0};
            size_t s_off[1] = {(wb + 255) & ~(size_t)255};
            if (one > hstage_bytes) {
                rc = mf_error(-EINVAL, "calibrate: staging buffer too small");
                break;
            }
            mf_hwcal_fill(h, hstage, wb, fp4 ? 1 : 2);
            mf_hwcal_fill(h, (uint8_t *)hstage + s_off[0], sb, 4);
            for (int c = 0; c < n_copies && !rc; c++)
                if (!(rc = mf_dev_alloc(d, 0, one, (void **)&w[c]))) rc = mf_dev_copy_h2d(cin, w[c], hstage, one);
            if (!rc) rc = mf_dev_stream_sync(cin);
            void *qq = fp4 && fp4_int8 ? q8 : NULL;
            if (!rc) {
                rc = mf_card_kern_time(d, fp4, w, s_off, n_copies, n_out, n_in, x, 1, y, qq, reps, &t1[sh]);
                if (rc == -ENOTSUP && qq) {   /* CUDA cards: the fp32 path only */
                    fp4_int8 = 0;
                    qq = NULL;
                    rc = mf_card_kern_time(d, fp4, w, s_off, n_copies, n_out, n_in, x, 1, y, qq, reps, &t1[sh]);
                }
            }
            if (!rc && sh == 1)
                rc = mf_card_kern_time(d, fp4, w, s_off, n_copies, n_out, n_in, x, MF_HWCAL_MANY, y, qq, reps, &tn);
            for (int c = 0; c < n_copies; c++) mf_dev_free(d, 0, w[c]);
        }
        if (rc) break;
        char what[32];
        snprintf(what, sizeof what, "card %s", name);
        mf_profile_kern *k = &p->card[fp4 ? MF_KF_FP4 : MF_KF_FP8];
        if ((rc = mf_hwcal_fit_kern(what, bytes[0], t1[0], bytes[1], t1[1], (double)MF_HWCAL_B_OUT * MF_HWCAL_B_IN,
                                    MF_HWCAL_MANY, tn, k)))
            break;
        const char *how = fp4 ? (fp4_int8 ? "fp4 int8 path" : "fp4 fp32 path (the card has no int8 path)")
                              : "fp8 32x32-tile matmul";
        char key[48];
        snprintf(key, sizeof key, "card_%s_bytes_per_s", name);
        mf_hwcal_src(h, key, "card 0 %s (mf_dev), 1 token, [%dx%d] vs [%dx%d] weights in card memory, medians of %d%s",
                     how, MF_HWCAL_B_OUT, MF_HWCAL_B_IN, MF_HWCAL_A_OUT, MF_HWCAL_A_IN, reps,
                     p->cards_emulated ? "; emulated: host kernels on 1 thread" : "");
        snprintf(key, sizeof key, "card_%s_macs_per_s", name);
        mf_hwcal_src(h, key, "card 0 %s, [%dx%d] at %d tokens minus 1 token", how, MF_HWCAL_B_OUT, MF_HWCAL_B_IN,
                     MF_HWCAL_MANY);
        snprintf(key, sizeof key, "card_%s_latency_ns", name);
        mf_hwcal_src(h, key, "card 0 %s: intercept of the 1-token fit (includes the enqueue cost)", how);
        mf_hwcal_note(h, "card 0 %s: %.2f GB/s of weights, %.2f GMAC/s beyond the first token, latency %.1f us", name,
                      k->bytes_per_s / 1e9, k->macs_per_s / 1e9, k->latency_ns / 1e3);
    }
    if (rc) goto out;
    /* no bf16 or plain-code kernels on cards in moeflow: the engine runs them on the host */
    if (p->cards_emulated) {
        p->card[MF_KF_BF16] = p->host[MF_KF_BF16];
        p->card[MF_KF_REF] = p->host[MF_KF_REF];
        static const char *k[] = {"card_bf16_bytes_per_s", "card_bf16_macs_per_s", "card_bf16_latency_ns",
                                  "card_ref_macs_per_s", "card_ref_latency_ns"};
        for (int i = 0; i < 5; i++)
            mf_hwcal_src_raw(h, k[i], "estimate: emulated cards run host kernels on one thread per stream, so "
                             "the host_%s figure; moeflow has no %s kernel on cards", i < 3 ? "bf16" : "ref",
                             i < 3 ? "bf16" : "plain-code");
    } else {
        p->card[MF_KF_BF16] = p->card[MF_KF_FP8];
        p->card[MF_KF_REF] = (mf_profile_kern){0, p->card[MF_KF_FP8].macs_per_s, p->card[MF_KF_FP8].latency_ns};
        static const char *k[] = {"card_bf16_bytes_per_s", "card_bf16_macs_per_s", "card_bf16_latency_ns",
                                  "card_ref_macs_per_s", "card_ref_latency_ns"};
        for (int i = 0; i < 5; i++)
            mf_hwcal_src_raw(h, k[i], "estimate: not measured, moeflow has no %s kernel on cards (device/dev.h); "
                             "the card fp8 figure stands in (the engine runs this on the host)",
                             i < 3 ? "bf16" : "plain-code");
    }
    rc = mf_hwcal_card_tc(h, d, hstage, hstage_bytes);
out:
    mf_dev_free(d, 0, x);
    mf_dev_free(d, 0, y);
    mf_dev_free(d, 0, q8);
    return rc;
}

int mf_hwcal_cards(mf_hwcal *h)
{
    mf_profile *p = h->p;
    const char *spec = h->o->devices;
    if (!spec) {
        p->n_cards = 0;
        p->cards_emulated = 0;
        mf_hwcal_src_raw(h, "n_cards", "no cards calibrated (moeflow calibrate without --devices)");
        mf_hwcal_src_raw(h, "cards_emulated", "no cards");
        for (size_t i = 0; i < sizeof mf_card_keys / sizeof mf_card_keys[0]; i++)
            mf_hwcal_src_raw(h, mf_card_keys[i], "no cards: 0");
        return 0;
    }
    mf_dev *d = NULL;
    int rc = mf_dev_open(spec, &d);
    if (rc) return mf_error_wrap(rc, "calibrate --devices");
    p->n_cards = mf_dev_n_cards(d);
    p->cards_emulated = !strcmp(mf_dev_kind(d), "emu");
    mf_hwcal_src(h, "n_cards", "cards of device spec '%s'", spec);
    mf_hwcal_src_raw(h, "cards_emulated", "%s", p->cards_emulated ? "emulated cards (device/dev_emu.c): kernels "
                     "run on this host's cores, copies follow the spec's model" : "CUDA cards");
    mf_hwcal_note(h, "cards: %d %s", p->n_cards, p->cards_emulated ? "emulated" : "CUDA");
    size_t big = (size_t)(h->o->quick ? 16 : 64) << 20;
    size_t stage = (size_t)16 << 20;
    if (stage < big) stage = big;
    void *hbuf[MF_DEV_MAX_CARDS] = {0}, *dbuf[MF_DEV_MAX_CARDS] = {0};
    if ((rc = mf_card_mem(h, d, spec))) goto out;
    for (int c = 0; c < p->n_cards && !rc; c++) {
        if (!(rc = mf_dev_host_alloc(d, c, stage, &hbuf[c]))) rc = mf_dev_alloc(d, c, big, &dbuf[c]);
        if (!rc) memset(hbuf[c], 1, stage);
    }
    if (!rc) rc = mf_hwcal_copies(h, d, hbuf, dbuf, big);
    if (!rc) rc = mf_hwcal_card_kernels(h, d, hbuf[0], stage);
out:
    for (int c = 0; c < p->n_cards; c++) {
        mf_dev_host_free(d, hbuf[c]);
        mf_dev_free(d, c, dbuf[c]);
    }
    mf_dev_close(d);
    return rc ? mf_error_wrap(rc, "calibrate: cards") : 0;
}
