/* The packed, paged sequence state: the e2m1 pack/unpack pairs give exactly the fake
 * quantizations' floats on fresh random data (bit for bit, edge values included), and the e4m3
 * pair the window ring uses gives back what mf_ly_fq_e4m3_pow2 left; the caches' put/get round
 * trip across pages; the ring's put/get and the engine's vectorized ring unpack give the rows put; a state grown page by page gives the logits of one reserved
 * whole, keeps its pages over a reset (same logits again), trims back, holds what
 * mf_ref_state_bytes says, refuses positions past its maximum, and (outside sanitizer builds) an
 * allocation failure is -ENOMEM with the state as it was. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "graphs/layers/layers.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/fast_attn.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/tiny_ckpt.h"

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t next_u64(void)
{
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}
static double urand(void) { return (double)(next_u64() >> 11) * 0x1p-53; }

/* A value of a random kind: normal of a random magnitude (2^-140 .. 2^20), exact grid points,
 * zeros of both signs, huge values, subnormals. */
static float rand_value(int kind_mix)
{
    int k = (int)(next_u64() % 16);
    if (!kind_mix || k < 10) return (float)((urand() * 2 - 1) * ldexp(1.0, (int)(next_u64() % 160) - 140));
    switch (k) {
    case 10: return 0.0f;
    case 11: return -0.0f;
    case 12: return (float)((int)(next_u64() % 13) - 6) * 0.5f;   /* near the e2m1 grid */
    case 13: return (urand() < 0.5 ? -1 : 1) * (float)ldexp(urand() + 1, 100);   /* past every clamp */
    case 14: return (float)ldexp(urand(), -140);                              /* subnormal */
    default: return (float)(urand() * 4000 - 2000);
    }
}

static int same_bits(const float *a, const float *b, int64_t n, int64_t *at)
{
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], 4)) {
            *at = i;
            return 0;
        }
    return 1;
}

static void test_pack_roundtrip(void)
{
    static const int64_t lens[] = {16, 32, 64, 128, 512, 37, 7, 1};
    float x[512], fq[512], out[512];
    uint8_t codes[256], scales[64];
    int bad = 0;
    for (int trial = 0; trial < 3000; trial++) {
        int64_t n = lens[trial % 8];
        int block = trial % 2 ? 16 : 32;
        /* one block scale for the trial: a block spans magnitudes, as a cache row does */
        double mag = ldexp(1.0, (int)(next_u64() % 40) - 20);
        for (int64_t i = 0; i < n; i++) x[i] = trial % 3 ? (float)((urand() * 2 - 1) * mag) : rand_value(1);
        for (int pow2 = 0; pow2 < 2; pow2++) {
            memcpy(fq, x, sizeof(float) * (size_t)n);
            memset(codes, 0xAA, sizeof codes);
            if (pow2) {
                mf_ly_fq_e2m1_pow2(fq, n, block);
                mf_ly_pack_e2m1_pow2(x, n, block, codes, scales);
                mf_ly_unpack_e2m1_pow2(codes, scales, n, block, out);
            } else {
                mf_ly_fq_e2m1_e4m3(fq, n, block);
                mf_ly_pack_e2m1_e4m3(x, n, block, codes, scales);
                mf_ly_unpack_e2m1_e4m3(codes, scales, n, block, out);
            }
            int64_t at = -1;
            if (!same_bits(fq, out, n, &at) && bad++ < 5)
                CHECK(0, "trial %d %s n %lld: value %lld: fake quant %a, unpacked %a (input %a)", trial,
                      pow2 ? "pow2" : "e4m3", (long long)n, (long long)at, fq[at], out[at], x[at]);
            if (n % 2) CHECK((codes[n / 2] >> 4) == 0, "odd n: the last high nibble is 0");
            /* fake-quantized input packs to itself: storing quantized data is lossless */
            if (pow2) {
                mf_ly_pack_e2m1_pow2(fq, n, block, codes, scales);
                mf_ly_unpack_e2m1_pow2(codes, scales, n, block, out);
            } else {
                mf_ly_pack_e2m1_e4m3(fq, n, block, codes, scales);
                mf_ly_unpack_e2m1_e4m3(codes, scales, n, block, out);
            }
            if (!same_bits(fq, out, n, &at) && bad++ < 5)
                CHECK(0, "trial %d %s: quantized input does not pack to itself at %lld: %a -> %a", trial,
                      pow2 ? "pow2" : "e4m3", (long long)at, fq[at], out[at]);
        }
    }
    CHECK(bad == 0, "%d pack/unpack mismatches", bad);
}

/* The window ring's pair: mf_ly_pack_e4m3_pow2 of what mf_ly_fq_e4m3_pow2 gives unpacks to it bit
 * for bit, on fresh random rows of every kind of value (NaN and inf included: a NaN input rounds
 * to a finite value, an inf makes its block NaN and +-inf). */
static void test_e4m3_roundtrip(void)
{
    static const int64_t lens[] = {32, 64, 128, 512, 37, 7, 1, 96};
    float x[512], fq[512], out[512];
    uint8_t codes[512], scales[512 / 16];
    int bad = 0, n_special = 0;
    for (int trial = 0; trial < 6000; trial++) {
        int64_t n = lens[trial % 8];
        int block = trial % 3 ? 32 : 16;
        double mag = ldexp(1.0, (int)(next_u64() % 60) - 40);   /* below the 1e-4 floor too */
        for (int64_t i = 0; i < n; i++) {
            x[i] = trial % 4 ? (float)((urand() * 2 - 1) * mag) : rand_value(1);
            if (trial % 4 == 0 && next_u64() % 64 == 0) x[i] = next_u64() % 2 ? NAN : (next_u64() % 2 ? -1 : 1) * INFINITY;
            if (trial % 7 == 0) x[i] = mf_bf(x[i]);   /* the attention rounds to bf16 first */
        }
        memcpy(fq, x, sizeof(float) * (size_t)n);
        mf_ly_fq_e4m3_pow2(fq, n, block);
        memset(codes, 0xAA, sizeof codes);
        memset(scales, 0xAA, sizeof scales);
        mf_ly_pack_e4m3_pow2(fq, n, block, codes, scales);
        mf_ly_unpack_e4m3_pow2(codes, scales, n, block, out);
        for (int64_t k = 0; k < (n + block - 1) / block; k++) n_special += scales[k] == 255;
        int64_t at = -1;
        if (!same_bits(fq, out, n, &at) && bad++ < 5)
            CHECK(0, "trial %d e4m3 n %lld block %d: value %lld: fake quant %a, unpacked %a (input %a)", trial,
                  (long long)n, block, (long long)at, fq[at], out[at], x[at]);
    }
    CHECK(bad == 0, "%d e4m3 pack/unpack mismatches", bad);
    CHECK(n_special > 0, "no block with an inf: the test does not reach the inf scale");
}

/* Ring slots through a state: put then get gives the fake-quantized rows; the engine's vectorized
 * unpack (mf_fa_ring_rows) gives mf_ly_ring_get's floats on every slot of random bytes (every
 * code, NaN codes and every exponent byte included). */
static void test_ring(mf_ref *r, const mf_config *c)
{
    mf_ref_state *s;
    CHECK(mf_ref_state_new(r, 64, &s) == 0, "state: %s", mf_last_error());
    int D = c->head_dim, W = c->sliding_window, bad = 0;
    float *kv = malloc(sizeof(float) * (size_t)D), *a = malloc(sizeof(float) * (size_t)W * D),
          *b = malloc(sizeof(float) * (size_t)W * D), *want = malloc(sizeof(float) * (size_t)W * D);
    for (int L = 0; L < c->n_layers; L++)
        for (int64_t t = 0; t < 3 * W; t++) {   /* the last W positions stay */
            for (int d = 0; d < D; d++) kv[d] = rand_value(1);
            mf_ly_fq_e4m3_pow2(kv, D, MF_LY_RING_BLOCK);
            mf_ly_ring_put(c, s, L, t, kv);
            if (t >= 2 * W) memcpy(want + (t - 2 * W) * D, kv, sizeof(float) * (size_t)D);
            if (t == 3 * W - 1) {
                int64_t at;
                mf_ly_ring_get(c, s, L, 2 * W, W, a);
                mf_fa_ring_rows(c, s, L, 2 * W, W, b);
                bad += !same_bits(want, a, (int64_t)W * D, &at) + !same_bits(want, b, (int64_t)W * D, &at);
                mf_ly_ring_get(c, s, L, 2 * W + 3, 5, a);   /* a range inside the window */
                bad += !same_bits(want + 3 * D, a, 5 * D, &at);
            }
        }
    CHECK(bad == 0, "%d ring ranges differ from the rows put", bad);
    bad = 0;
    int64_t rb = mf_ly_ring_row_bytes(c);
    for (int64_t i = 0; i < mf_ly_ring_bytes(c); i++)
        s->ring[i] = (uint8_t)(i % rb < D && i % 3 ? (uint64_t)(i / rb + i % rb) : next_u64());
    for (int L = 0; L < c->n_layers; L++) {
        int64_t at = -1;
        mf_ly_ring_get(c, s, L, 7, W, a);
        mf_fa_ring_rows(c, s, L, 7, W, b);
        if (!same_bits(a, b, (int64_t)W * D, &at) && bad++ < 3)
            CHECK(0, "layer %d: fast ring unpack %a, module %a at %lld", L, b[at], a[at], (long long)at);
    }
    CHECK(bad == 0, "%d layers' random ring bytes unpack differently", bad);
    free(kv);
    free(a);
    free(b);
    free(want);
    mf_ref_state_free(s);
}

/* put/get through a state's caches at entries on several pages, against the fake quantizations */
static void test_cache_rows(mf_ref *r, const mf_config *c)
{
    mf_ref_state *s;
    int64_t npos = 3 * MF_LY_PAGE_POSITIONS + 17;
    CHECK(mf_ref_state_new(r, npos, &s) == 0 && mf_ref_state_reserve(s, npos) == 0, "state: %s", mf_last_error());
    int D = c->head_dim, id = c->index_head_dim, bad = 0;
    float *kv = malloc(sizeof(float) * (size_t)D * 2), *key = malloc(sizeof(float) * (size_t)id * 2);
    float *rows = malloc(sizeof(float) * (size_t)D * 8);
    for (int L = 0; L < c->n_layers; L++) {
        if (!mf_config_is_kv_source(c, L)) continue;
        mf_ly_cache *ca = &s->cache[L];
        int64_t n = npos / c->compress_ratios[L];
        CHECK(ca->n_pages * mf_ly_cache_page_entries(c, L) >= n, "layer %d: pages for %lld entries", L, (long long)n);
        int32_t pick[8];
        /* write every entry (so neighbours are live), check a few, then rows across pages */
        for (int64_t j = 0; j < n; j++) {
            for (int d = 0; d < D; d++) kv[d] = (float)((urand() * 2 - 1) * (1 + j % 5));
            for (int d = 0; d < id; d++) key[d] = (float)((urand() * 2 - 1) * (1 + j % 3));
            mf_ly_cache_put_kv(c, L, ca, j, kv);
            mf_ly_cache_put_key(c, L, ca, j, key);
            if (j % 97 && j != n - 1) continue;
            mf_ly_fq_e2m1_e4m3(kv, D, 16);
            mf_ly_fq_e2m1_pow2(key, id, 32);
            mf_ly_cache_get_kv(c, L, ca, j, kv + D);
            mf_ly_cache_get_key(c, L, ca, j, key + id);
            int64_t at;
            bad += !same_bits(kv, kv + D, D, &at) || !same_bits(key, key + id, id, &at);
        }
        /* runs of keys (mf_ly_cache_get_keys) starting anywhere, crossing pages, against one at a time */
        for (int64_t j0 = 0; j0 < n; j0 += 37 + j0 % 61) {
            int64_t m = n - j0 < 300 ? n - j0 : 300;
            float *run = malloc(sizeof(float) * (size_t)(id * m));
            mf_ly_cache_get_keys(c, L, ca, j0, m, run);
            for (int64_t j = 0; j < m; j++) {
                mf_ly_cache_get_key(c, L, ca, j0 + j, key);
                int64_t at;
                bad += !same_bits(key, run + j * id, id, &at);
            }
            free(run);
        }
        for (int i = 0; i < 8; i++) pick[i] = (int32_t)((int64_t)(i * 131 + 7) % n);
        mf_ly_cache_get_kv_rows(c, L, ca, pick, 8, rows);
        for (int i = 0; i < 8; i++) {
            mf_ly_cache_get_kv(c, L, ca, pick[i], kv);
            int64_t at;
            bad += !same_bits(kv, rows + (int64_t)i * D, D, &at);
        }
    }
    CHECK(bad == 0, "%d cache rows differ from their fake quantization", bad);
    free(kv);
    free(key);
    free(rows);
    mf_ref_state_free(s);
}

static int logits_same(const float *a, const float *b, int64_t n) { return !memcmp(a, b, sizeof(float) * (size_t)n); }

/* Feeds toks[0..n) in chunks of `chunk` (1: token by token), the logits of every position into lg. */
static int feed(mf_ref *r, mf_ref_state *s, const int32_t *toks, int n, int chunk, float *lg, int64_t V)
{
    mf_ref_state **st = malloc(sizeof *st * (size_t)chunk);
    float **out = malloc(sizeof *out * (size_t)chunk);
    int rc = 0;
    for (int i = 0; i < n && !rc; i += chunk) {
        int k = n - i < chunk ? n - i : chunk;
        for (int j = 0; j < k; j++) st[j] = s, out[j] = lg + (int64_t)(i + j) * V;
        rc = mf_ref_forward(r, st, toks + i, k, out);
    }
    free(st);
    free(out);
    return rc;
}

static void test_growth(mf_ref *r, const mf_config *c)
{
    int64_t V = c->vocab_size;
    int N = MF_TEST_SANITIZED ? MF_LY_PAGE_POSITIONS + 40 : 2 * MF_LY_PAGE_POSITIONS + 60;
    int32_t *toks = malloc(sizeof *toks * (size_t)N);
    for (int i = 0; i < N; i++) toks[i] = (int32_t)((i * 37 + (i * i) % 13 + 5) % V);
    float *a = malloc(sizeof(float) * (size_t)(V * N)), *b = malloc(sizeof(float) * (size_t)(V * N));
    mf_ref_state *grow, *whole;
    CHECK(mf_ref_state_new(r, N, &grow) == 0 && mf_ref_state_new(r, N, &whole) == 0, "state: %s", mf_last_error());
    int64_t fixed = mf_ref_state_bytes(c, 0);
    CHECK(mf_ref_state_held_bytes(grow) == fixed, "a new state holds only its fixed part: %lld vs %lld",
          (long long)mf_ref_state_held_bytes(grow), (long long)fixed);
    CHECK(mf_ref_state_reserve(whole, N) == 0, "reserve: %s", mf_last_error());
    CHECK(mf_ref_state_held_bytes(whole) == mf_ref_state_bytes(c, N), "held %lld, by need %lld",
          (long long)mf_ref_state_held_bytes(whole), (long long)mf_ref_state_bytes(c, N));
    CHECK(mf_ref_state_reserve(whole, N + 1) == -EINVAL, "past max_positions");
    /* grown page by page (chunks of 48, crossing page boundaries inside a chunk) vs reserved whole
     * and fed token by token */
    CHECK(feed(r, grow, toks, N, 48, a, V) == 0, "grown: %s", mf_last_error());
    CHECK(feed(r, whole, toks, N, 1, b, V) == 0, "whole: %s", mf_last_error());
    int64_t first_bad = -1;
    for (int i = 0; i < N && first_bad < 0; i++)
        if (!logits_same(a + (int64_t)i * V, b + (int64_t)i * V, V)) first_bad = i;
    CHECK(first_bad < 0, "grown and whole states differ first at position %lld", (long long)first_bad);
    CHECK(mf_ref_state_held_bytes(grow) == mf_ref_state_bytes(c, N), "grown holds %lld, by need %lld",
          (long long)mf_ref_state_held_bytes(grow), (long long)mf_ref_state_bytes(c, N));
    /* a reset keeps the pages, and the same sequence gives the same logits again */
    int64_t held = mf_ref_state_held_bytes(grow);
    mf_ref_state_reset(grow);
    CHECK(mf_ref_state_held_bytes(grow) == held, "reset keeps the pages");
    CHECK(feed(r, grow, toks, N, 64, b, V) == 0, "after reset: %s", mf_last_error());
    CHECK(logits_same(a, b, V * N), "a reset state gives the logits of a new one");
    /* trim: never below the position; a reset state trims to what it is told */
    mf_ref_state_trim(grow, 0);
    CHECK(mf_ref_state_held_bytes(grow) == held, "trim keeps what the position needs");
    mf_ref_state_reset(grow);
    mf_ref_state_trim(grow, 10);
    CHECK(mf_ref_state_held_bytes(grow) == mf_ref_state_bytes(c, 10) && mf_ref_state_bytes(c, 10) < held,
          "trimmed to one page: %lld", (long long)mf_ref_state_held_bytes(grow));
    CHECK(feed(r, grow, toks, N, 100, b, V) == 0, "after trim: %s", mf_last_error());
    CHECK(logits_same(a, b, V * N), "a trimmed state regrows to the same logits");
    /* bytes by need: monotone, whole pages, every page adds the same */
    int64_t page = mf_ref_state_bytes(c, MF_LY_PAGE_POSITIONS) - fixed;
    CHECK(page > 0 && mf_ref_state_bytes(c, 1) == fixed + page &&
              mf_ref_state_bytes(c, 3 * MF_LY_PAGE_POSITIONS + 1) == fixed + 4 * page,
          "bytes by need in pages of %lld", (long long)page);

    /* allocation failure: -ENOMEM, the state as it was (a child under an address-space limit;
     * not under sanitizers, whose shadow memory such a limit breaks) */
    if (!MF_TEST_SANITIZED) {
        mf_ref_state *big;
        int64_t max = c->max_position_embeddings;
        CHECK(mf_ref_state_new(r, max, &big) == 0, "big state: %s", mf_last_error());
        CHECK(feed(r, big, toks, 10, 10, b, V) == 0, "big state: %s", mf_last_error());
        int64_t before = mf_ref_state_held_bytes(big);
        fflush(NULL);
        pid_t pid = fork();
        if (pid == 0) {
            long pages = 0, pg = sysconf(_SC_PAGESIZE);
            FILE *f = fopen("/proc/self/statm", "r");
            if (!f || fscanf(f, "%ld", &pages) != 1) _exit(3);
            fclose(f);
            /* room for a few pages of the caches, not for max_position_embeddings positions */
            struct rlimit rl = {(rlim_t)pages * (rlim_t)pg + (16u << 20), (rlim_t)pages * (rlim_t)pg + (16u << 20)};
            if (setrlimit(RLIMIT_AS, &rl)) _exit(3);
            int rc = mf_ref_state_reserve(big, max);
            if (rc != -ENOMEM) _exit(4);
            if (mf_ref_state_held_bytes(big) != before || mf_ref_state_pos(big) != 10) _exit(5);
            if (feed(r, big, toks + 10, 1, 1, b, V)) _exit(6);   /* still usable */
            _exit(0);
        }
        int st = 0;
        CHECK(pid > 0 && waitpid(pid, &st, 0) == pid, "fork");
        CHECK(WIFEXITED(st) && (WEXITSTATUS(st) == 0 || WEXITSTATUS(st) == 3),
              "allocation failure: child status %d (4: not -ENOMEM, 5: state changed, 6: unusable after)",
              WIFEXITED(st) ? WEXITSTATUS(st) : -1);
        if (WIFEXITED(st) && WEXITSTATUS(st) == 3) printf("SKIP the allocation-failure check (no RLIMIT_AS)\n");
        mf_ref_state_free(big);
    }
    mf_ref_state_free(grow);
    mf_ref_state_free(whole);
    free(a);
    free(b);
    free(toks);
}

int main(void)
{
    test_pack_roundtrip();
    test_e4m3_roundtrip();
    mf_config c;
    char dir[1024];
    CHECK(mf_config_preset("tiny", &c) == 0, "preset");
    if (mf_test_gen_ckpt(&c, "kvpack_tiny", dir, sizeof dir)) return 1;
    mf_model *m = NULL;
    mf_ref *r = NULL;
    CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1}, &m) == 0, "load: %s", mf_last_error());
    CHECK(m && mf_ref_new(m, NULL, &r) == 0, "ref: %s", mf_last_error());
    if (!r) return mf_check_exit("test_kvpack");
    test_cache_rows(r, mf_ref_config(r));
    test_ring(r, mf_ref_config(r));
    test_growth(r, mf_ref_config(r));
    mf_ref_free(r);
    mf_model_free(m);
    return mf_check_exit("test_kvpack");
}
