/* Routed experts on emulated cards (graphs/step/step.h placements, device/expert_cache.h) against the
 * host path of the same engine on the tiny preset: prefill + 16 decode steps, batch 1 and 3, on
 * emu:1..4 with placements seed and hybrid, a streamed expert store, and a small cache that
 * evicts: logits bit for bit equal (the emulated kernels are the host's), cache counters that add
 * up, copies seen on the device lanes, and refusals (a card too small for one expert, --exact). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "device/dev.h"
#include "graphs/gen/gen.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/step.h"
#include "sched/error.h"
#include "sched/profile.h"
#include "tests/check.h"
#include "tests/step_run.h"
#include "tests/tiny_ckpt.h"

#define N_PROMPT 12
#define N_DEC (MF_TEST_SANITIZED ? 4 : 16)   /* ASan/TSan: fewer steps (tests/check.h) */
#define N_SEQ 3
#define N_LOG (1 + N_DEC)

static int64_t g_V;

/* Adds the last call's device stats (mf_step_last_dev) to *ds. */
static void add_dev_stats(mf_step *e, mf_step_dev_stats *ds)
{
    mf_step_dev_stats x;
    mf_step_last_dev(e, &x);
    ds->dev_slots += x.dev_slots, ds->host_slots += x.host_slots, ds->hits += x.hits, ds->misses += x.misses;
    ds->evictions += x.evictions, ds->bytes_in += x.bytes_in, ds->host_fallbacks += x.host_fallbacks;
    ds->miss_spans += x.miss_spans;
}

/* n_seq sequences: prefill each, then N_DEC batched greedy decode steps (tokens from the host run
 * when `forced` is given, so a divergence cannot hide behind different inputs). Adds the device
 * stats of every call to *ds. */
static int run(mf_ref *r, mf_step *e, int n_seq, int32_t (*toks)[N_DEC], int forced, float *logits,
               mf_step_dev_stats *ds)
{
    mf_ref_state *st[N_SEQ] = {0};
    int rc = 0;
    for (int s = 0; s < n_seq && !rc; s++) {
        int32_t p[N_PROMPT];
        for (int i = 0; i < N_PROMPT; i++) p[i] = (int32_t)((i * 37 + s * 101 + (i * i) % 13) % g_V);
        rc = mf_ref_state_new(r, N_PROMPT + N_DEC + 1, &st[s]);
        if (!rc) rc = mf_step_prefill(e, st[s], p, N_PROMPT, logits + (size_t)s * N_LOG * g_V);
        add_dev_stats(e, ds);
    }
    float *step = malloc(sizeof(float) * (size_t)n_seq * g_V);
    for (int k = 0; k < N_DEC && !rc; k++) {
        int32_t tok[N_SEQ];
        for (int s = 0; s < n_seq; s++) {
            if (!forced) {
                const float *prev = logits + ((size_t)s * N_LOG + k) * g_V;
                int b = 0;
                for (int64_t i = 1; i < g_V; i++)
                    if (prev[i] > prev[b]) b = (int)i;
                toks[s][k] = b;
            }
            tok[s] = toks[s][k];
        }
        rc = mf_step_decode(e, st, tok, n_seq, step);
        add_dev_stats(e, ds);
        for (int s = 0; s < n_seq && !rc; s++)
            memcpy(logits + ((size_t)s * N_LOG + k + 1) * g_V, step + (size_t)s * g_V, sizeof(float) * g_V);
    }
    free(step);
    for (int s = 0; s < n_seq; s++) mf_ref_state_free(st[s]);
    return rc;
}

/* One sequence on the host placement: its greedy tokens into toks, its logits into host. */
static void host_run(mf_ref *r, int32_t (*toks)[N_DEC], float *host)
{
    mf_step *e = NULL;
    mf_step_dev_stats ds = {0};
    CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2}, &e) == 0 && run(r, e, 1, toks, 0, host, &ds) == 0,
          "host run: %s", mf_last_error());
    mf_step_free(e);
}

/* A card whose memory holds every expert and one more, no more, and prefill chunks of the prompt's
 * length: the cache sized without a budget holds back the shapes' buffers (mf_sg_card_reserve: a
 * chunk's and a 64-sequence batch's), so it takes fewer experts and the prefill and decode steps
 * find their buffers (before 2026-12-05 the cache took every expert and the first chunk failed
 * allocating them); the logits stay the host's. xslot: a packed expert's bytes. */
static void test_held_back(mf_ref *r, const mf_config *c, uint64_t xslot)
{
    size_t per = (size_t)N_SEQ * N_LOG * g_V;
    float *host = malloc(sizeof(float) * per), *got = malloc(sizeof(float) * per);
    int32_t toks[N_SEQ][N_DEC];
    host_run(r, toks, host);
    uint64_t all = (uint64_t)c->n_layers * c->n_routed_experts;
    char spec[96];
    snprintf(spec, sizeof spec, "emu:1,mem=%llu", (unsigned long long)((all + 1) * xslot));
    mf_dev *d = NULL;
    mf_step *e = NULL;
    CHECK(mf_dev_open(spec, &d) == 0, "open %s: %s", spec, mf_last_error());
    CHECK(d && mf_step_new(r, &(mf_step_opts){.n_threads = 2, .dev = d, .placement = MF_STEP_PLACE_SEED,
                                                  .prefill_chunk = N_PROMPT}, &e) == 0,
          "held back: %s", mf_last_error());
    if (e) {
        mf_step_dev_stats ds = {0};
        int rc = run(r, e, 1, toks, 1, got, &ds);
        CHECK(rc == 0, "held back: the steps' buffers on a card the cache filled: %s", mf_last_error());
        CHECK(!rc && !memcmp(host, got, sizeof(float) * N_LOG * g_V), "held back: logits differ from the host's");
        mf_step_last_dev(e, &ds);
        CHECK(ds.cache_slots > 0 && (uint64_t)ds.cache_slots < all, "held back: %d cache slots of %llu experts",
              ds.cache_slots, (unsigned long long)all);
    }
    mf_step_free(e);
    mf_dev_close(d);
    free(host);
    free(got);
}

/* Every placement on emu:1..4 against the host run of the same model (r); resident: r's experts
 * are the model's resident ones (every miss then one span), else a store's. */
static void test_placements(mf_ref *r, const char *what, uint64_t cache_bytes, int want_evictions, double cpu_bps,
                            int resident)
{
    size_t per = (size_t)N_SEQ * N_LOG * g_V;
    float *host = malloc(sizeof(float) * per), *got = malloc(sizeof(float) * per);
    /* TSan: batch 3 only, on 1 card (a task per slot) and 2 (device graphs) */
    for (int b = MF_TEST_TSAN ? N_SEQ : 1; b <= N_SEQ; b += N_SEQ - 1) {
        int32_t toks[N_SEQ][N_DEC];
        mf_step *e = NULL;
        mf_step_dev_stats ds = {0};
        CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2}, &e) == 0, "%s host: %s", what, mf_last_error());
        if (!e) break;
        CHECK(run(r, e, b, toks, 0, host, &ds) == 0, "%s host run: %s", what, mf_last_error());
        CHECK(ds.dev_slots == 0 && ds.host_slots == 0, "%s: host placement counted device slots", what);
        mf_step_free(e);
        uint64_t evictions = 0;
        int64_t hyb_dev = 0, hyb_host = 0;
        for (int nc = 1; nc <= (MF_TEST_TSAN ? 2 : 4); nc++)
            for (int pl = MF_STEP_PLACE_SEED; pl <= MF_STEP_PLACE_HYBRID; pl++) {
                char spec[64];
                mf_dev *d = NULL;
                CHECK(mf_test_emu_open(nc, spec, sizeof spec, &d) == 0, "open %s: %s", spec, mf_last_error());
                if (!d) continue;
                e = NULL;
                /* 2 and 4 cards: each layer's device FFNs as one captured graph per card */
                int graphs = nc % 2 == 0;
                CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2, .dev = d, .placement = pl,
                                                     .dev_cache_bytes = cache_bytes, .cpu_bytes_per_s = cpu_bps,
                                                     .dev_graphs = graphs},
                                     &e) == 0,
                      "%s %s placement %d: %s", what, spec, pl, mf_last_error());
                if (e) {
                    memset(got, 0, sizeof(float) * per);
                    ds = (mf_step_dev_stats){0};
                    int rc = run(r, e, b, toks, 1, got, &ds);
                    CHECK(rc == 0, "%s %s placement %d batch %d: %s", what, spec, pl, b, mf_last_error());
                    int same = !rc && !memcmp(host, got, sizeof(float) * (size_t)b * N_LOG * g_V);
                    CHECK(same, "%s %s placement %d batch %d%s: logits differ from the host path", what, spec, pl, b,
                          graphs ? " (device graphs)" : "");
                    CHECK(ds.hits + ds.misses == (uint64_t)ds.dev_slots,
                          "%s %s placement %d: hits %llu + misses %llu != device slots %lld", what, spec, pl,
                          (unsigned long long)ds.hits, (unsigned long long)ds.misses, (long long)ds.dev_slots);
                    CHECK(ds.bytes_in > 0 && ds.misses > 0 && ds.bytes_in % ds.misses == 0,
                          "%s %s placement %d: %llu bytes in for %llu misses", what, spec, pl,
                          (unsigned long long)ds.bytes_in, (unsigned long long)ds.misses);
                    /* resident experts: the card slot mirrors their layout, every miss one copy */
                    CHECK(resident ? ds.miss_spans == (int64_t)ds.misses : ds.miss_spans <= (int64_t)ds.misses, "%s %s placement %d: %lld of %llu misses copied "
                          "as one span", what, spec, pl, (long long)ds.miss_spans, (unsigned long long)ds.misses);
                    if (pl == MF_STEP_PLACE_SEED)
                        CHECK(ds.host_slots == ds.host_fallbacks && ds.dev_slots > 0,
                              "%s %s seed: %lld slots on the host, %lld fallbacks", what, spec,
                              (long long)ds.host_slots, (long long)ds.host_fallbacks);
                    if (pl == MF_STEP_PLACE_HYBRID) {
                        hyb_dev += ds.dev_slots;
                        hyb_host += ds.host_slots;
                    }
                    if (!cache_bytes && ds.dev_slots) CHECK(ds.hits > 0, "%s %s placement %d: no cache hits over %d steps", what,
                                            spec, pl, N_DEC);
                    evictions += ds.evictions;
                    if (graphs && ds.dev_slots) {   /* the cards ran their layers as graph tasks */
                        char path[1100], *buf = malloc(1 << 22);
                        snprintf(path, sizeof path, "%s/place_graphs.json", getenv("MOEFLOW_TMP") ? getenv("MOEFLOW_TMP") : ".");
                        FILE *f = mf_step_write_trace(e, path) == 0 ? fopen(path, "r") : NULL;
                        size_t nr = f && buf ? fread(buf, 1, (1 << 22) - 1, f) : 0;
                        if (buf) buf[nr] = 0;
                        if (f) fclose(f);
                        remove(path);
                        CHECK(buf && strstr(buf, " ffn graph") && !strstr(buf, "slot 0 ffn"),
                              "%s %s: no device graph tasks in the trace", what, spec);
                        free(buf);
                    }
                    /* the last run's timeline: the device lanes ran copies and kernels */
                    mf_step_times t;
                    mf_step_last_times(e, &t);
                    CHECK(pl == MF_STEP_PLACE_HYBRID || t.compute_busy_ns > 0, "%s: no expert compute time", what);
                    mf_step_free(e);
                }
                for (int c = 0; c < nc; c++)
                    CHECK(mf_dev_emu_used_bytes(d, c) == 0, "%s %s: card %d holds %lld bytes after free", what,
                          spec, c, (long long)mf_dev_emu_used_bytes(d, c));
                mf_dev_close(d);
            }
        /* the CPU model set to weigh about as much as a card: hybrid splits the experts */
        CHECK(hyb_dev > 0 && hyb_host > 0, "%s batch %d: hybrid put %lld slots on cards, %lld on the host", what, b,
              (long long)hyb_dev, (long long)hyb_host);
        if (want_evictions) CHECK(evictions > 0, "%s batch %d: a small cache never evicted", what, b);
    }
    free(host);
    free(got);
}

/* A decode step whose host-to-device copy fails (the emulated device's fault injection, the nth
 * h2d copy of the step for n = 1..6, each on a fresh engine over emu:2): the step returns the
 * copy's error naming the task, the layer and the routed expert; the cache drops the slots copied
 * in that step (with every expert resident, a kept partial slot would be hit again); then the same
 * engine runs the sequence again (prefill and 16 decode steps) with logits equal to the host
 * path's bit for bit. */
static void test_copy_fault(mf_ref *r, double cpu_bps)
{
    size_t per = (size_t)N_LOG * g_V;
    float *host = malloc(sizeof(float) * per), *got = malloc(sizeof(float) * per);
    float *lg = malloc(sizeof(float) * g_V * N_PROMPT);
    int32_t toks[N_SEQ][N_DEC];
    mf_step *e = NULL;
    mf_step_dev_stats ds = {0};
    host_run(r, toks, host);
    int partial = 0;
    /* TSan: the 1st copy (a cache hit's activations) and the 5th (an expert copied in this step) */
    for (int nth = 1; nth <= 6; nth += MF_TEST_TSAN ? 4 : 1) {
        mf_dev *d = NULL;
        CHECK(mf_dev_open("emu:2,bw=50e9,lat_ns=2000", &d) == 0, "%s", mf_last_error());
        e = NULL;
        CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2, .dev = d, .placement = MF_STEP_PLACE_SEED,
                                             .cpu_bytes_per_s = cpu_bps}, &e) == 0, "%s", mf_last_error());
        if (!e) {
            mf_dev_close(d);
            continue;
        }
        mf_ref_state *st = NULL;
        int32_t p[N_PROMPT];
        for (int i = 0; i < N_PROMPT; i++) p[i] = (int32_t)((i * 37 + (i * i) % 13) % g_V);
        CHECK(mf_ref_state_new(r, N_PROMPT + N_DEC + 1, &st) == 0 && mf_step_prefill(e, st, p, N_PROMPT, lg) == 0,
              "prefill: %s", mf_last_error());
        CHECK(mf_dev_emu_fail_h2d(d, nth) == 0, "%s", mf_last_error());
        int rc = mf_step_decode(e, &st, &toks[0][0], 1, lg);
        const char *m = mf_last_error();
        CHECK(rc == -EIO && strstr(m, "injected failure") && strstr(m, "task 'dev") && strstr(m, " in'") &&
              strstr(m, "layer ") && strstr(m, "routed expert "), "nth %d: decode with a failing copy: %d %s",
              nth, rc, m);
        if (strstr(m, "cache slot is dropped")) partial++;
        printf("test_place: h2d copy %d of a decode step failed: %.300s\n", nth, m);
        mf_dev_emu_fail_h2d(d, 0);
        mf_ref_state_free(st);
        memset(got, 0, sizeof(float) * per);
        ds = (mf_step_dev_stats){0};
        rc = run(r, e, 1, toks, 1, got, &ds);
        CHECK(rc == 0 && !memcmp(host, got, sizeof(float) * per), "nth %d: the run after the failed step: %d %s",
              nth, rc, rc ? mf_last_error() : "logits differ from the host path");
        mf_step_free(e);
        mf_dev_close(d);
    }
    CHECK(partial > 0, "no failing copy hit an expert copied in its step (%d)", partial);
    free(host);
    free(got);
    free(lg);
}

/* The experts' prefetch (mf_step_opts.prefetch_min; by default from mf_sg_prefetch_min positions,
 * 21 on the tiny preset, longer than these prompts): forced from 1 position, so the 12-position
 * prefill and the batch-1 decode steps place each layer's every expert at the layer's start and
 * copy the cards' ones in before the route. On emu:1..4, seed and hybrid, device graphs on 2 and
 * 4 cards, a resident cache and one of 2 x top_k experts per card (the rest pinned: the host keeps
 * them): logits bit for bit the host's; the prefill counts every expert of every layer (the normal
 * path counts the used ones, fewer than 16 of 24 picks); a failing prefetch copy names its task and
 * expert, and the engine runs the sequence again with the host's logits. */
static void test_prefetch(mf_ref *r, const mf_config *c, uint64_t small_cache, double cpu_bps)
{
    size_t per = (size_t)N_LOG * g_V;
    float *host = malloc(sizeof(float) * per), *got = malloc(sizeof(float) * per);
    float *lg = malloc(sizeof(float) * g_V * N_PROMPT);
    int32_t toks[N_SEQ][N_DEC];
    mf_step *e = NULL;
    mf_step_dev_stats ds = {0};
    host_run(r, toks, host);
    int64_t want = (int64_t)c->n_layers * c->n_routed_experts;
    for (int cache = 0; cache < 2; cache++)
        for (int nc = 1; nc <= (MF_TEST_TSAN ? 2 : 4); nc++)
            for (int pl = MF_STEP_PLACE_SEED; pl <= MF_STEP_PLACE_HYBRID; pl++) {
                char spec[64];
                mf_dev *d = NULL;
                CHECK(mf_test_emu_open(nc, spec, sizeof spec, &d) == 0, "open %s: %s", spec, mf_last_error());
                if (!d) continue;
                e = NULL;
                int graphs = nc % 2 == 0;
                CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2, .dev = d, .placement = pl, .prefetch_min = 1,
                                                     .dev_cache_bytes = cache ? small_cache : 0,
                                                     .cpu_bytes_per_s = cpu_bps, .dev_graphs = graphs},
                                     &e) == 0,
                      "prefetch %s placement %d: %s", spec, pl, mf_last_error());
                if (e) {
                    mf_ref_state *st = NULL;
                    int32_t p[N_PROMPT];
                    for (int i = 0; i < N_PROMPT; i++) p[i] = (int32_t)((i * 37 + (i * i) % 13) % g_V);
                    int rc;
                    if (nc == 2 && pl == MF_STEP_PLACE_SEED && !cache) {   /* a failing prefetch copy (the first
                                                                           * h2d copies: layer 0's experts) */
                        CHECK(mf_ref_state_new(r, N_PROMPT + N_DEC + 1, &st) == 0, "%s", mf_last_error());
                        CHECK(mf_dev_emu_fail_h2d(d, 3) == 0, "%s", mf_last_error());
                        rc = mf_step_prefill(e, st, p, N_PROMPT, lg);
                        const char *m = mf_last_error();
                        CHECK(rc == -EIO && strstr(m, "injected failure") && strstr(m, " pre'") &&
                                  strstr(m, "ahead of its route"), "prefetch: prefill with a failing copy: %d %s", rc, m);
                        printf("test_place: a prefetch copy failed: %.300s\n", m);
                        mf_dev_emu_fail_h2d(d, 0);
                        mf_ref_state_free(st);
                        st = NULL;
                    }
                    rc = mf_ref_state_new(r, N_PROMPT + N_DEC + 1, &st);
                    if (!rc) rc = mf_step_prefill(e, st, p, N_PROMPT, lg);
                    mf_step_dev_stats x = {0};
                    mf_step_last_dev(e, &x);
                    CHECK(rc == 0 && x.dev_slots + x.host_slots == want && x.dev_slots > 0 &&
                              x.hits + x.misses == (uint64_t)x.dev_slots,
                          "prefetch %s placement %d cache %d: prefill rc %d, %lld + %lld experts placed (want %lld), "
                          "%llu hits + %llu misses: %s", spec, pl, cache, rc, (long long)x.dev_slots,
                          (long long)x.host_slots, (long long)want, (unsigned long long)x.hits,
                          (unsigned long long)x.misses, rc ? mf_last_error() : "");
                    /* 2 top_k = 4 cache slots per card: fewer than a layer's 16 / nc experts on 1 or 2 cards */
                    if (cache && nc <= 2)
                        CHECK(x.host_fallbacks > 0, "prefetch %s: a small cache never left an expert to the host", spec);
                    if (!cache && pl == MF_STEP_PLACE_SEED)
                        CHECK(x.host_slots == 0, "prefetch %s seed: %lld experts on the host", spec, (long long)x.host_slots);
                    mf_ref_state_free(st);
                    memset(got, 0, sizeof(float) * per);
                    ds = (mf_step_dev_stats){0};
                    rc = run(r, e, 1, toks, 1, got, &ds);
                    CHECK(rc == 0 && !memcmp(host, got, sizeof(float) * per),
                          "prefetch %s placement %d cache %d%s: %d %s", spec, pl, cache, graphs ? " (device graphs)" : "",
                          rc, rc ? mf_last_error() : "logits differ from the host path");
                    mf_step_free(e);
                }
                for (int k = 0; k < nc; k++)
                    CHECK(mf_dev_emu_used_bytes(d, k) == 0, "prefetch %s: card %d holds bytes after free", spec, k);
                mf_dev_close(d);
            }
    free(host);
    free(got);
    free(lg);
}

/* Hybrid placement weighs the lanes' models of a hardware profile (mf_step_opts.profile): with slow
 * host kernels every slot goes to a card, with slow copies none does; logits equal the host's. */
static void test_profile_models(mf_ref *r)
{
    size_t per = (size_t)N_LOG * g_V;
    float *host = malloc(sizeof(float) * per), *got = malloc(sizeof(float) * per);
    int32_t toks[N_SEQ][N_DEC];
    mf_step *e = NULL;
    mf_step_dev_stats ds = {0};
    host_run(r, toks, host);
    mf_profile f;
    memset(&f, 0, sizeof f);
    f.n_sockets = 1;
    f.threads_per_socket = 2;
    f.mem_bytes_per_s = 1e12;
    f.host[MF_KF_FP4] = (mf_profile_kern){.bytes_per_s = 1e5};   /* host kernels: 100 kB/s */
    f.card[MF_KF_FP4] = (mf_profile_kern){.bytes_per_s = 1e11};
    f.h2d_bytes_per_s = f.d2h_bytes_per_s = 1e11;
    for (int slow_copies = 0; slow_copies < 2; slow_copies++) {
        if (slow_copies) {
            f.host[MF_KF_FP4].bytes_per_s = 1e11;
            f.h2d_bytes_per_s = 1e5;
        }
        mf_dev *d = NULL;
        CHECK(mf_dev_open("emu:2", &d) == 0, "%s", mf_last_error());
        e = NULL;
        CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2, .dev = d, .placement = MF_STEP_PLACE_HYBRID,
                                             .profile = &f}, &e) == 0, "%s", mf_last_error());
        ds = (mf_step_dev_stats){0};
        int rc = e ? run(r, e, 1, toks, 1, got, &ds) : -1;
        CHECK(rc == 0 && !memcmp(host, got, sizeof(float) * per), "profile run %d: %d", slow_copies, rc);
        if (slow_copies)
            CHECK(ds.dev_slots == 0 && ds.host_slots > 0, "slow copies: %lld slots on cards", (long long)ds.dev_slots);
        else
            CHECK(ds.host_slots == 0 && ds.dev_slots > 0, "slow host: %lld slots on the host", (long long)ds.host_slots);
        mf_step_free(e);
        mf_dev_close(d);
    }
    free(host);
    free(got);
}

static int cli(const char *args, char *out, size_t cap)
{
    const char *bin = getenv("MOEFLOW_BIN");
    if (!bin) return -1;
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s %s", bin, args);
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    return pclose(p);
}

/* The CLI: the same tokens on every placement; the hybrid trace has the cards' lanes; the per-step
 * device line; refusals. */
static void test_cli(const char *dir)
{
    if (!getenv("MOEFLOW_BIN")) {
        printf("test_place: MOEFLOW_BIN unset, CLI checks skipped\n");
        return;
    }
    static char host[8192], got[8192], err[8192];
    char args[4096], trace[1100];
    snprintf(trace, sizeof trace, "%s/place_trace.json", dir);
    snprintf(args, sizeof args, "decode --checkpoint %s --tokens 5,17,300 --max-new-tokens 12 --ignore-eos "
             "--threads 2 --quiet 2>/dev/null", dir);
    CHECK(cli(args, host, sizeof host) == 0 && strlen(host) > 10, "host decode: '%s'", host);
    const char *pl[] = {"seed", "hybrid"};
    for (int k = 0; k < 2; k++) {
        snprintf(args, sizeof args, "decode --checkpoint %s --tokens 5,17,300 --max-new-tokens 12 --ignore-eos "
                 "--threads 2 --quiet --devices emu:3 --placement %s --trace %s 2>/dev/null", dir, pl[k], trace);
        CHECK(cli(args, got, sizeof got) == 0 && !strcmp(host, got), "%s: '%s' vs host '%s'", pl[k], got, host);
    }
    FILE *f = fopen(trace, "r");
    size_t n = f ? fread(got, 1, sizeof got - 1, f) : 0;
    got[n] = 0;
    if (f) fclose(f);
    CHECK(strstr(got, "dev2.h2d") && strstr(got, "dev0.compute"), "the trace has no device lanes");
    snprintf(args, sizeof args, "decode --checkpoint %s --tokens 5,17,300 --max-new-tokens 4 --threads 2 "
             "--devices emu:2 --placement seed 2>&1 >/dev/null", dir);
    CHECK(cli(args, err, sizeof err) == 0 && strstr(err, "step 2 devices:") && strstr(err, "cache hit rate"),
          "no device lines: '%s'", err);
    snprintf(args, sizeof args, "decode --checkpoint %s --tokens 5 --placement seed 2>&1", dir);
    CHECK(cli(args, err, sizeof err) != 0 && strstr(err, "needs --devices"), "seed without devices: '%s'", err);
    snprintf(args, sizeof args, "decode --checkpoint %s --tokens 5 --devices emu:1 --placement best 2>&1", dir);
    CHECK(cli(args, err, sizeof err) != 0 && strstr(err, "--placement"), "bad placement: '%s'", err);
}

int main(void)
{
    char dir[1024];
    mf_config c;
    CHECK(mf_config_preset("tiny", &c) == 0, "preset");
    if (mf_test_gen_ckpt(&c, "place_tiny", dir, sizeof dir)) return 1;
    g_V = c.vocab_size;
    mf_model *m = NULL;
    mf_ref *r = NULL;
    CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1}, &m) == 0, "load: %s", mf_last_error());
    if (!m || mf_ref_new(m, NULL, &r)) return mf_check_exit("test_place");
    /* a packed tiny expert: w1, w2, w3 codes and scales */
    const mf_weight *ew = mf_model_layer_at(m, 0)->experts;
    uint64_t xb = 0;
    for (int k = 0; k < 3; k++) xb += ew[k].st_data->n_bytes + ew[k].st_scale->n_bytes;

    /* a CPU model under which a tiny expert costs a worker 200 us, about twice what a miss costs a
     * card on the built-in machine (its copy-in: the rows, the token weights and six parts, each
     * copy 10 us; the kernel; the copy-out) and six times a hit: at batch 1 the host's queue of
     * top_k = 2 slots over 2 workers ends at 200 us, so hybrid moves a slot or two to the cards
     * and keeps others (the default model gives everything to the host at these sizes) */
    double cpu_bps = (double)xb / 200e-6;
    test_cli(dir);
    test_copy_fault(r, cpu_bps);
    test_prefetch(r, &c, (uint64_t)(2 * c.n_experts_per_tok) * (xb + 6 * 256), cpu_bps);
    test_profile_models(r);
    test_held_back(r, &c, xb + 6 * 256);
    test_placements(r, "resident", 0, 0, cpu_bps, 1);
    /* a cache of 2 x top_k experts per card: misses evict (and are pinned slots respected) */
    if (!MF_TEST_TSAN)   /* TSan: the resident and streamed sweeps carry the concurrent paths */
        test_placements(r, "small cache", (uint64_t)(2 * c.n_experts_per_tok) * (xb + 6 * 256), 1, cpu_bps, 1);

    /* refusals: a card too small for the shapes' buffers (the caches sized without a budget hold
     * them back), for one expert (a budget: nothing held back); --exact */
    mf_dev *d = NULL;
    char spec[64];
    snprintf(spec, sizeof spec, "emu:2,mem=%llu", (unsigned long long)(xb / 2));
    CHECK(mf_dev_open(spec, &d) == 0, "open %s: %s", spec, mf_last_error());
    mf_step *e = NULL;
    int rc = mf_step_new(r, &(mf_step_opts){.n_threads = 1, .dev = d, .placement = MF_STEP_PLACE_SEED}, &e);
    CHECK(rc == -ENOSPC && !e && strstr(mf_last_error(), "card 0 cannot hold the buffers of a 512-position prefill"),
          "tiny card: rc %d: %s", rc, mf_last_error());
    rc = mf_step_new(r, &(mf_step_opts){.n_threads = 1, .dev = d, .placement = MF_STEP_PLACE_SEED,
                                        .dev_cache_bytes = xb + 6 * 256}, &e);
    CHECK(rc == -ENOSPC && !e && strstr(mf_last_error(), "too small") && strstr(mf_last_error(), "card 0"),
          "tiny card, a budget: rc %d: %s", rc, mf_last_error());
    mf_dev_close(d);
    CHECK(mf_dev_open("emu:1", &d) == 0, "open: %s", mf_last_error());
    rc = mf_step_new(r, &(mf_step_opts){.n_threads = 1, .exact = 1, .dev = d, .placement = MF_STEP_PLACE_HYBRID}, &e);
    CHECK(rc == -ENOTSUP && !e && strstr(mf_last_error(), "exact"), "exact on devices: rc %d: %s", rc, mf_last_error());
    mf_dev_close(d);

    /* streamed experts: the card copies from the host store's slab once the reads are in */
    mf_ref_free(r);
    mf_model_free(m);
    m = NULL;
    r = NULL;
    CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1, .store = MF_MODEL_STORE_STREAMED,
                                              .store_budget_bytes = 64ull << 20}, &m) == 0,
          "load streamed: %s", mf_last_error());
    if (m && !mf_ref_new(m, NULL, &r)) test_placements(r, "streamed", 0, 0, cpu_bps, 0);
    mf_ref_free(r);
    mf_model_free(m);
    return mf_check_exit("test_place");
}
