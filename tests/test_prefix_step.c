/* The prefix cache (graphs/prefix/prefix.h) at the state level: a producer runs a prompt through a
 * state with the cache tapping it (chunks of several lengths, then greedy decode tokens), and a
 * consumer restores the longest cached prefix of another prompt and runs the rest; the logits of
 * every position after the hit and of every greedy continuation are bit-identical (memcmp) to the
 * same prompt run from scratch. Hits that end inside the window, at a block, exactly at a page
 * boundary, one past it, on an odd position (a ratio-2 layer's open group), after a generation;
 * blocks smaller and larger than the window; with and without Engram layers; the scheduled engine
 * on the host and with its dense work (and heads) on emulated cards, and the reference forward.
 * Also: the pages a restore maps are shared, not copied, and a reset gives them back. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/dev.h"
#include "graphs/model/model.h"
#include "graphs/prefix/prefix.h"
#include "graphs/ref/ref.h"
#include "graphs/step/step.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/prefix_run.h"
#include "tests/tiny_ckpt.h"

/* One engine, one block size: the producer's prompt of long tokens (past a page), then the hits. */
static void run_cases(const eng *g, int block, int long_n)
{
    const mf_config *c = mf_ref_config(g->r);
    mf_prefix *p = NULL;
    CHECK(mf_prefix_new(&(mf_prefix_opts){.ref = g->r, .block_tokens = block, .budget_bytes = 256u << 20}, &p) == 0,
          "%s", mf_last_error());
    if (!p) return;
    int32_t T[CTX], P[CTX];
    int W = c->sliding_window;
    printf("%s, block %d (window %d): producer of %d tokens\n", g->name, block, W, long_n);
    memcpy(T, A, sizeof T);
    produce(g, p, T, long_n, 37, 0);   /* chunks of 37: blocks complete inside chunks */
    char what[96];
    /* a block's end inside the window (and at the first block) */
    snprintf(what, sizeof what, "hit at %d (inside the window)", block);
    consume(g, p, P, prompt(P, block + 3, 4, 1), block, what);
    /* a block's end past the window */
    int e = (W + block) / block * block + block;
    snprintf(what, sizeof what, "hit at block end %d", e);
    consume(g, p, P, prompt(P, e + 1, 6, 2), e, what);
    if (long_n > 256) {   /* exactly at a page boundary; one past it (a tail) */
        consume(g, p, P, prompt(P, 256 + (block > 1 ? 1 : 0), 3, 3), 256, "hit at the page boundary 256");
        memcpy(T, A, sizeof T);
        produce(g, p, T, 257, 64, 0);
        consume(g, p, P, prompt(P, 257, 5, 4), 257, "hit at 257 (one past the page)");
    }
    /* an odd end: the ratio-2 layers' open group holds position 2k */
    int odd = 2 * block + 5;
    memcpy(T, A, sizeof T);
    produce(g, p, T, odd, 7, 0);
    consume(g, p, P, prompt(P, odd, 4, 5), odd, "hit at an odd position (open ratio-2 group)");
    /* after a generation: the sequence's end is a tail; the next turn extends it */
    memcpy(T, A, sizeof T);
    produce(g, p, T, 3 * block + 2, 16, GEN);
    int nt = 3 * block + 2 + GEN;   /* positions the producer fed */
    memcpy(P, T, sizeof *P * (size_t)nt);
    for (int i = 0; i < 7; i++) P[nt + i] = (int32_t)((i * 13 + 11) % V);
    consume(g, p, P, nt + 7, nt, "the next turn after a generation");
    /* a prompt the cache holds whole: the hit leaves its last token to run (the block below its
     * end, or a tail of A's that ends before it) */
    int whole = e - block, tails[4] = {long_n, 257, odd, 3 * block + 2};
    for (int i = 0; i < 4; i++)
        if (tails[i] > whole && tails[i] < e && (tails[i] != 257 || long_n > 256)) whole = tails[i];
    consume(g, p, P, prompt(P, e, 0, 0), whole, "a prompt cached whole");
    mf_prefix_stats ps;
    mf_prefix_get_stats(p, &ps);
    printf("  %lld lookups, %lld of %lld tokens hit, %lld nodes, %lld bytes\n", (long long)ps.lookups,
           (long long)ps.hit_tokens, (long long)ps.lookup_tokens, (long long)ps.nodes, (long long)ps.bytes);
    CHECK(ps.nodes > 0 && ps.bytes > 0 && ps.bytes <= (int64_t)(256u << 20), "stats");
    mf_prefix_free(p);
}

/* A restore maps the full pages (held, not copied) and copies the partial one; a reset state
 * gives the mapped pages back, keeping its own. */
static void test_sharing(const eng *g)
{
    const mf_config *c = mf_ref_config(g->r);
    mf_prefix *p = NULL;
    CHECK(mf_prefix_new(&(mf_prefix_opts){.ref = g->r, .block_tokens = 64, .budget_bytes = 64u << 20}, &p) == 0, "new");
    if (!p) return;
    int32_t T[CTX], P[CTX];
    memcpy(T, A, sizeof T);
    produce(g, p, T, 300, 64, 0);
    mf_ref_state *st = NULL;
    mf_prefix_seq *s = NULL;
    CHECK(mf_ref_state_new(g->r, CTX, &st) == 0 && mf_prefix_seq_new(p, &s) == 0, "alloc");
    int64_t mapped = 0;
    int h = mf_prefix_match(p, s, P, prompt(P, 290, 3, 9), &mapped);
    CHECK(h == 256 && mapped > 0, "hit %d, mapped %lld bytes", h, (long long)mapped);
    CHECK(mf_prefix_restore(p, s, st) == h, "restore");
    int L = -1;
    for (int k = 0; k < c->n_layers && L < 0; k++)
        if (mf_config_is_kv_source(c, k)) L = k;
    CHECK(st->cache[L].n_pages >= 1 && mf_ref_page_refs(st->cache[L].page[0]) >= 2,
          "page 0 of layer %d shared (refs %d)", L, st->cache[L].n_pages ? mf_ref_page_refs(st->cache[L].page[0]) : 0);
    int64_t held = mf_ref_state_held_bytes(st);
    mf_prefix_seq_end(p, s, st, 0);
    mf_ref_state_reset(st);
    CHECK(st->cache[L].n_pages == 0 || mf_ref_page_refs(st->cache[L].page[0]) == 1, "a reset state holds no shared page");
    CHECK(mf_ref_state_held_bytes(st) <= held, "held bytes after reset");
    mf_prefix_seq_free(s);
    mf_ref_state_free(st);
    mf_prefix_free(p);
}

static int open_model(const char *name, int engram, mf_model **m, mf_ref **r)
{
    mf_config c;
    char dir[1024];
    CHECK(mf_config_preset("tiny", &c) == 0, "preset");
    if (!engram) c.n_engram = 0;
    if (mf_test_gen_ckpt(&c, name, dir, sizeof dir)) return 1;
    CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1}, m) == 0, "load %s: %s", name, mf_last_error());
    if (!*m) return 1;
    CHECK(mf_ref_new(*m, NULL, r) == 0, "ref: %s", mf_last_error());
    return *r ? 0 : 1;
}

int main(void)
{
    mf_model *m = NULL, *m0 = NULL;
    mf_ref *r = NULL, *r0 = NULL;
    if (open_model("prefix_tiny", 1, &m, &r) || open_model("prefix_tiny_noeg", 0, &m0, &r0))
        return mf_check_exit("test_prefix_step");
    V = mf_ref_config(r)->vocab_size;
    for (int i = 0; i < CTX; i++) A[i] = (int32_t)((i * 37 + (i * i) % 11 + 1) % V);
    int san = MF_TEST_SANITIZED, tsan = MF_TEST_TSAN;   /* TSan: the engine's threads on one short case */
    mf_step *e = NULL, *e0 = NULL, *ec = NULL;
    mf_dev *d = NULL;
    CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2}, &e) == 0, "step: %s", mf_last_error());
    CHECK(mf_step_new(r0, &(mf_step_opts){.n_threads = 2}, &e0) == 0, "step: %s", mf_last_error());
    CHECK(mf_dev_open("emu:2,bw=50e9,lat_ns=2000", &d) == 0, "emu: %s", mf_last_error());
    if (d)
        CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2, .dev = d, .placement = MF_STEP_PLACE_SEED,
                                             .dense = MF_STEP_DENSE_CARDS, .heads = MF_SG_HEADS_CARDS},
                          &ec) == 0,
              "step on emu:2: %s", mf_last_error());
    eng host = {"scheduled", r, e}, noeg = {"scheduled, no Engram", r0, e0}, cards = {"scheduled, emu:2 dense+heads", r, ec},
        ref = {"reference", r, NULL};
    if (e) {
        run_cases(&host, 8, tsan ? 50 : san ? 120 : 300);   /* blocks smaller than the window (16) */
        if (!san) run_cases(&host, 32, 300);                /* larger */
        if (!tsan) test_sharing(&host);
    }
    if (e0 && !tsan) run_cases(&noeg, 16, san ? 80 : 300);
    if (ec && !san) run_cases(&cards, 16, 300);
    if (!tsan) run_cases(&ref, 8, san ? 60 : 100);
    mf_step_free(e);
    mf_step_free(e0);
    mf_step_free(ec);
    mf_dev_close(d);
    mf_ref_free(r);
    mf_ref_free(r0);
    mf_model_free(m);
    mf_model_free(m0);
    return mf_check_exit("test_prefix_step");
}
