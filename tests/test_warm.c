/* Warm device expert caches (mf_step_opts.dev_cache_fill, graphs/step/dev_fill.h, device/expert_cache.h
 * mf_dev_xcache_fill_plan) on the tiny preset over emulated cards: the fill plan (owned experts only,
 * spread over layers, by counts when given, at most the slots); a fill holds exactly the plan's
 * experts with the host's bytes in their slots and zeroed counters, within the budget; and the
 * warmed engine's logits (seed and hybrid, batch 1 and 3, resident weights and a resident store)
 * bit for bit the host placement's and the unwarmed engine's, with no misses when every expert fits. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/dev.h"
#include "device/expert_cache.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/dev_fill.h"
#include "graphs/step/step.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/tiny_ckpt.h"

#define N_PROMPT 8
#define N_DEC 6
#define N_SEQ 3

static int64_t g_V;

/* n_seq sequences: prefill, then N_DEC greedy decode steps fed from the first run's tokens (toks);
 * logits [s][k] of every decode step; misses and device slots summed into *ds. */
static int run(mf_ref *r, mf_step *e, int n_seq, int32_t (*toks)[N_DEC], int forced, float *logits,
               mf_step_dev_stats *ds)
{
    mf_ref_state *st[N_SEQ] = {0};
    int rc = 0;
    float *tmp = malloc(sizeof(float) * (size_t)N_SEQ * g_V);
    for (int s = 0; s < n_seq && !rc; s++) {
        int32_t p[N_PROMPT];
        for (int i = 0; i < N_PROMPT; i++) p[i] = (int32_t)((i * 41 + s * 97 + 3) % g_V);
        rc = mf_ref_state_new(r, N_PROMPT + N_DEC + 1, &st[s]);
        if (!rc) rc = mf_step_prefill(e, st[s], p, N_PROMPT, tmp + (size_t)s * g_V);
    }
    for (int k = 0; k < N_DEC && !rc; k++) {
        int32_t tok[N_SEQ];
        for (int s = 0; s < n_seq; s++) {
            if (!forced) {
                const float *prev = tmp + (size_t)s * g_V;
                int b = 0;
                for (int64_t i = 1; i < g_V; i++)
                    if (prev[i] > prev[b]) b = (int)i;
                toks[s][k] = b;
            }
            tok[s] = toks[s][k];
        }
        rc = mf_step_decode(e, st, tok, n_seq, tmp);
        mf_step_dev_stats x;
        mf_step_last_dev(e, &x);
        ds->dev_slots += x.dev_slots, ds->misses += x.misses, ds->hits += x.hits;
        for (int s = 0; s < n_seq && !rc; s++)
            memcpy(logits + ((size_t)s * N_DEC + k) * g_V, tmp + (size_t)s * g_V, sizeof(float) * g_V);
    }
    free(tmp);
    for (int s = 0; s < n_seq; s++) mf_ref_state_free(st[s]);
    return rc;
}

/* The plan: owned experts only, distinct, at most n_slots, round-robin over layers without counts,
 * the most counted first with counts. */
static void test_plan(void)
{
    enum { L = 5, E = 12 };
    int32_t items[L * E];
    uint32_t counts[L * E] = {0};
    for (int nc = 1; nc <= 4; nc++)
        for (int cd = 0; cd < nc; cd++) {
            int n = mf_dev_xcache_fill_plan(nc, cd, L, E, NULL, 1000, items), owned = 0;
            for (int l = 0; l < L; l++)
                for (int e = 0; e < E; e++) owned += mf_dev_xcache_owner(nc, l, e) == cd;
            CHECK(n == owned, "plan %d/%d: %d experts, owns %d", cd, nc, n, owned);
            uint8_t seen[L * E] = {0};
            for (int i = 0; i < n; i++) {
                CHECK(items[i] >= 0 && items[i] < L * E && !seen[items[i]] &&
                      mf_dev_xcache_owner(nc, items[i] / E, items[i] % E) == cd, "plan %d/%d: item %d", cd, nc, items[i]);
                seen[items[i]] = 1;
            }
            int k = mf_dev_xcache_fill_plan(nc, cd, L, E, NULL, 7, items);
            int per[L] = {0};
            for (int i = 0; i < k; i++) per[items[i] / E]++;
            for (int l = 0; l < L; l++)   /* 7 slots over 5 layers: 2 for the first two layers, 1 for the rest */
                CHECK(k == 7 && per[l] == (l < 2 ? 2 : 1), "plan %d/%d: layer %d takes %d of %d", cd, nc, l, per[l], k);
        }
    counts[3 * E + 10] = 9, counts[1 * E + 4] = 5, counts[4 * E + 0] = 5;
    int n = mf_dev_xcache_fill_plan(1, 0, L, E, counts, 3, items);
    /* equal counts: the spread order (expert 0 of layer 4 before expert 4 of layer 1) */
    CHECK(n == 3 && items[0] == 3 * E + 10 && items[1] == 4 * E + 0 && items[2] == 1 * E + 4,
          "plan by counts: %d items %d %d %d", n, items[0], items[1], items[2]);
}

/* mf_dev_fill on caches of `slots` experts per card of emu:2: the caches hold the plan's experts,
 * their slots hold the host's bytes, the counters are zero. */
static void test_fill(const mf_model *m, int slots)
{
    const mf_config *c = mf_model_config(m);
    const mf_weight *ew = mf_model_layer_at(m, 0)->experts;
    size_t off[6], bytes[6], o = 0;
    for (int k = 0; k < 3; k++) {
        bytes[2 * k] = ew[k].st_data->n_bytes, bytes[2 * k + 1] = ew[k].st_scale->n_bytes;
        off[2 * k] = o, o += (bytes[2 * k] + 255) / 256 * 256;
        off[2 * k + 1] = o, o += (bytes[2 * k + 1] + 255) / 256 * 256;
    }
    mf_dev *d = NULL;
    mf_dev_xcache *xc[2] = {0};
    CHECK(mf_dev_open("emu:2", &d) == 0, "%s", mf_last_error());
    if (!d) return;
    for (int cd = 0; cd < 2; cd++)
        CHECK(mf_dev_xcache_new(d, &(mf_dev_xcache_opts){.card = cd, .n_layers = c->n_layers,
                                                         .n_experts = c->n_routed_experts, .slot_bytes = o,
                                                         .budget_bytes = (uint64_t)slots * o}, &xc[cd]) == 0,
              "cache: %s", mf_last_error());
    mf_step_fill_stats fs;
    int rc = xc[0] && xc[1] ? mf_dev_fill(&(mf_dev_fill_in){.dev = d, .xc = xc, .n_cards = 2, .m = m, .part_off = off,
                                                            .part_bytes = bytes}, &fs) : -1;
    CHECK(rc == 0, "fill: %s", mf_last_error());
    int E = c->n_routed_experts, NI = c->n_layers * E;
    int32_t *items = malloc(sizeof *items * (size_t)NI);
    uint8_t *back = malloc(o);
    int64_t total = 0;
    for (int cd = 0; !rc && cd < 2; cd++) {
        int n = mf_dev_xcache_fill_plan(2, cd, c->n_layers, E, NULL, slots, items);
        total += n;
        int owned = 0, ns = slots < NI ? slots : NI;
        for (int it = 0; it < NI; it++) owned += mf_dev_xcache_owner(2, it / E, it % E) == cd;
        CHECK(n == (ns < owned ? ns : owned) && mf_dev_xcache_n_slots(xc[cd]) == ns,
              "card %d: plan of %d for %d slots", cd, n, slots);
        uint8_t *in = calloc((size_t)NI, 1);
        for (int i = 0; i < n; i++) in[items[i]] = 1;
        int held = 0;
        for (int it = 0; it < NI; it++) {
            int h = mf_dev_xcache_has(xc[cd], it / E, it % E);
            held += h;
            CHECK(h == in[it], "card %d: expert %d of layer %d held %d, planned %d", cd, it % E, it / E, h, in[it]);
        }
        CHECK(held <= ns, "card %d holds %d experts in %d slots", cd, held, slots);
        for (int i = 0; i < n && i < 4; i++) {   /* the slot's bytes are the host's */
            void *slot;
            int hit = 0;
            CHECK(mf_dev_xcache_acquire(xc[cd], items[i] / E, items[i] % E, &slot, &hit) == 0 && hit, "acquire");
            mf_dev_stream *st = mf_dev_stream_of(d, cd, MF_DEV_STREAM_COPY_OUT);
            CHECK(mf_dev_copy_d2h(st, back, slot, o) == 0 && mf_dev_stream_sync(st) == 0, "d2h: %s", mf_last_error());
            const mf_weight *w = &mf_model_layer_at(m, items[i] / E)->experts[(size_t)(items[i] % E) * 3];
            for (int k = 0; k < 3; k++)
                CHECK(!memcmp(back + off[2 * k], w[k].data, bytes[2 * k]) &&
                      !memcmp(back + off[2 * k + 1], w[k].scale, bytes[2 * k + 1]), "card %d: slot bytes differ", cd);
            mf_dev_xcache_release(xc[cd], items[i] / E, items[i] % E);
        }
        mf_dev_xcache_stats x;
        mf_dev_xcache_stats_total(xc[cd], &x);
        CHECK(x.misses == 0 || n == 0, "card %d: counters not zeroed after the fill (hits %llu misses %llu)", cd,
              (unsigned long long)x.hits, (unsigned long long)x.misses);
        free(in);
    }
    CHECK(fs.experts == total && fs.bytes == (uint64_t)total * o && fs.skipped == 0, "fill stats %lld of %lld",
          (long long)fs.experts, (long long)total);
    free(items);
    free(back);
    for (int cd = 0; cd < 2; cd++) mf_dev_xcache_free(xc[cd]);
    mf_dev_close(d);
}

/* Host, unwarmed and warmed engines on the same model: logits the same bits. */
static void test_engine(mf_ref *r, const char *what, uint64_t xslot, double cpu_bps, int r_n_items)
{
    int32_t toks[N_SEQ][N_DEC];
    for (int ns = 1; ns <= N_SEQ; ns += 2) {
        size_t nl = (size_t)ns * N_DEC * g_V;
        float *host = malloc(sizeof(float) * nl), *got = malloc(sizeof(float) * nl);
        mf_step *e = NULL;
        mf_step_dev_stats ds = {0};
        CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2}, &e) == 0 && run(r, e, ns, toks, 0, host, &ds) == 0,
              "%s host: %s", what, mf_last_error());
        mf_step_free(e);
        for (int pl = MF_STEP_PLACE_SEED; pl <= MF_STEP_PLACE_HYBRID; pl++)
            for (int cfg = 0; cfg < 3; cfg++) {   /* off; on, every expert; on, 3 per card */
                mf_dev *d = NULL;
                CHECK(mf_dev_open("emu:2", &d) == 0, "%s", mf_last_error());
                e = NULL;
                int rc = mf_step_new(r, &(mf_step_opts){.n_threads = 2, .dev = d, .placement = pl,
                                                        .dev_cache_fill = cfg > 0,
                                                        .dev_cache_bytes = cfg == 2 ? 3 * xslot : 0,
                                                        .cpu_bytes_per_s = cpu_bps, .no_selfcheck = 1}, &e);
                CHECK(rc == 0, "%s %d/%d: %s", what, pl, cfg, mf_last_error());
                mf_step_dev_stats x = {0};
                mf_step_fill_stats fs = {0};
                if (!rc) mf_step_fill(e, &fs);
                int64_t want = cfg == 0 ? 0 : cfg == 2 ? 6 : (int64_t)r_n_items;
                CHECK(fs.experts == want && fs.bytes == (uint64_t)want * xslot,
                      "%s %d/%d: filled %lld", what, pl, cfg, (long long)fs.experts);
                CHECK(!rc && run(r, e, ns, toks, 1, got, &x) == 0, "%s %d/%d run: %s", what, pl, cfg, mf_last_error());
                CHECK(!memcmp(host, got, sizeof(float) * nl), "%s placement %d fill %d batch %d: logits differ", what,
                      pl, cfg, ns);
                if (cfg == 1) CHECK(x.misses == 0 && x.dev_slots > 0, "%s %d warm: %lld misses of %lld slots", what,
                                    pl, (long long)x.misses, (long long)x.dev_slots);
                if (cfg == 0 && pl == MF_STEP_PLACE_SEED) CHECK(x.misses > 0, "%s cold seed: no misses", what);
                mf_step_free(e);
                mf_dev_close(d);
            }
        free(host);
        free(got);
    }
}

int main(void)
{
    char dir[1024];
    mf_config c;
    CHECK(mf_config_preset("tiny", &c) == 0, "preset");
    if (mf_test_gen_ckpt(&c, "warm_tiny", dir, sizeof dir)) return 1;
    g_V = c.vocab_size;
    test_plan();
    mf_model *m = NULL;
    mf_ref *r = NULL;
    CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1}, &m) == 0, "load: %s", mf_last_error());
    if (!m || mf_ref_new(m, NULL, &r)) return mf_check_exit("test_warm");
    const mf_weight *ew = mf_model_layer_at(m, 0)->experts;
    uint64_t xb = 0, xslot = 0;
    for (int k = 0; k < 3; k++) {
        xb += ew[k].st_data->n_bytes + ew[k].st_scale->n_bytes;
        xslot += (ew[k].st_data->n_bytes + 255) / 256 * 256 + (ew[k].st_scale->n_bytes + 255) / 256 * 256;
    }
    double cpu_bps = (double)xb / 200e-6;   /* as tests/test_place.c: a tiny expert costs the host about twice a card's miss */
    test_fill(m, 5);
    test_fill(m, 100000);
    test_engine(r, "resident", xslot, cpu_bps, c.n_layers * c.n_routed_experts);
    mf_ref_free(r);
    mf_model_free(m);
    m = NULL;
    r = NULL;
    CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1, .store = MF_MODEL_STORE_RESIDENT}, &m) == 0,
          "load store: %s", mf_last_error());
    if (m && !mf_ref_new(m, NULL, &r)) test_engine(r, "resident store", xslot, cpu_bps, c.n_layers * c.n_routed_experts);
    mf_ref_free(r);
    mf_model_free(m);
    return mf_check_exit("test_warm");
}
