/* The scheduled engine (graphs/step/step.h) streaming its experts through the expert store (host/store.h)
 * on the tiny preset: bit-identical logits to the engine on a resident model for prefill + 16
 * decode steps, batch 1 and 3, with 1, 2 and 4 workers, under budgets that force misses every
 * step; store counters add up; IO-lane reads appear in the step's timeline; budgets too small are
 * refused naming the requirement; injected IO faults fail the step naming the expert and leave
 * the store usable. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "graphs/gen/gen.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/step.h"
#include "host/store.h"
#include "sched/error.h"
#include "sched/sched.h"
#include "tests/check.h"
#include "tests/cli.h"
#include "tests/tiny_ckpt.h"

#define N_PROMPT 24
#define N_DEC (MF_TEST_SANITIZED ? 6 : 16)   /* ASan/TSan: fewer steps (tests/check.h) */
#define N_SEQ 3
#define N_LOG (1 + N_DEC)

static char g_dir[1024];
static int64_t g_V;
static int g_L, g_K;

static void prompt_of(int s, int32_t *t)
{
    for (int i = 0; i < N_PROMPT; i++) t[i] = (int32_t)((i * 37 + s * 101 + (i * i) % 13) % g_V);
}

static int argmax(const float *x, int64_t n)
{
    int b = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = (int)i;
    return b;
}

/* Per-run store observations (batch-1 decode steps only). */
typedef struct obs {
    int steps_with_miss, bad_count;
    uint64_t misses, bytes;
    int64_t io_busy_ns;
} obs;

/* n_seq sequences: prefill each, then N_DEC batched greedy decode steps (tokens from `forced` when
 * given, else greedy and written to it). logits[s][j] as in tests/test_step.c. */
static int run(mf_ref *r, mf_step *e, mf_store *st, int n_seq, int32_t (*forced)[N_DEC], int force,
               float *logits, obs *ob)
{
    mf_ref_state *sts[N_SEQ] = {0};
    int rc = 0;
    for (int s = 0; s < n_seq && !rc; s++) {
        int32_t p[N_PROMPT];
        prompt_of(s, p);
        rc = mf_ref_state_new(r, N_PROMPT + N_DEC + 1, &sts[s]);
        if (!rc) rc = mf_step_prefill(e, sts[s], p, N_PROMPT, logits + ((size_t)s * N_LOG) * g_V);
    }
    float *step = malloc(sizeof(float) * (size_t)n_seq * g_V);
    for (int k = 0; k < N_DEC && !rc; k++) {
        int32_t tok[N_SEQ];
        for (int s = 0; s < n_seq; s++) {
            if (!force) forced[s][k] = argmax(logits + ((size_t)s * N_LOG + k) * g_V, g_V);
            tok[s] = forced[s][k];
        }
        if (st) mf_store_step(st, NULL);
        rc = mf_step_decode(e, sts, tok, n_seq, step);
        if (!rc && st && ob && n_seq == 1) {
            mf_store_stats x;
            mf_store_step(st, &x);
            mf_step_times tm;
            mf_step_last_times(e, &tm);
            /* one token: its top_k distinct experts in every layer, each a hit or a miss */
            if (x.hits + x.misses != (uint64_t)(g_L * g_K)) ob->bad_count++;
            ob->steps_with_miss += x.misses > 0;
            ob->misses += x.misses;
            ob->bytes += x.bytes_read;
            ob->io_busy_ns += tm.io_busy_ns;
        }
        for (int s = 0; s < n_seq && !rc; s++)
            memcpy(logits + ((size_t)s * N_LOG + k + 1) * g_V, step + (size_t)s * g_V, sizeof(float) * g_V);
    }
    free(step);
    for (int s = 0; s < n_seq; s++) mf_ref_state_free(sts[s]);
    return rc;
}

static mf_model *load_store(uint64_t budget, int tables)
{
    mf_model *m = NULL;
    int rc = mf_model_load(g_dir, &(mf_model_opts){.quiet = 1, .store = MF_MODEL_STORE_STREAMED,
                                                   .store_tables = tables,
                                                   .store_budget_bytes = budget, .store_io_depth = 8}, &m);
    CHECK(rc == 0, "streamed load (budget %llu): %s", (unsigned long long)budget, mf_last_error());
    return m;
}

static mf_model *load_streamed(uint64_t budget) { return load_store(budget, MF_MODEL_STORE_RESIDENT); }

/* 1 when the file at path contains needle (the first 16 MiB). */
static int file_has(const char *path, const char *needle)
{
    FILE *f = fopen(path, "rb");
    char *buf = calloc(1, 1 << 24);
    size_t n = f && buf ? fread(buf, 1, (1 << 24) - 1, f) : 0;
    if (f) fclose(f);
    int yes = n > 0 && strstr(buf, needle) != NULL;
    free(buf);
    return yes;
}

/* Streamed Engram tables: the gathers are tasks of the engine's own graph (plan, reads on its IO
 * lane, embed): logits bit-identical to the resident engine's for 1 and 2 (TSan: 4) workers and
 * batch 1 and 3, the rows counted by the store, the reads in the trace; an EIO on an Engram read
 * fails the step naming the table, and the next run is bit-identical again. */
static void test_tables_streamed(uint64_t budget, int32_t (*tokens)[N_SEQ][N_DEC], float *const *want, float *got)
{
    mf_model *m = load_store(budget, MF_MODEL_STORE_STREAMED);
    if (!m) return;
    mf_store *st = mf_model_store(m);
    mf_ref *r = NULL;
    CHECK(mf_ref_new(m, NULL, &r) == 0, "ref: %s", mf_last_error());
    for (int w = MF_TEST_TSAN ? 4 : 1; r && w <= (MF_TEST_TSAN ? 4 : 2); w++) {   /* TSan: 4 workers only */
        mf_step *e = NULL;
        CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = w}, &e) == 0, "tables engine: %s", mf_last_error());
        for (int b = 0; e && b < 2; b++) {
            int n_seq = b ? N_SEQ : 1;
            mf_store_stats t0, t1;
            mf_store_stats_total(st, &t0);
            int rc = run(r, e, st, n_seq, tokens[b], 1, got, NULL);
            CHECK(rc == 0, "streamed tables, %d workers, batch %d: %s", w, n_seq, mf_last_error());
            CHECK(!memcmp(got, want[b], sizeof(float) * (size_t)n_seq * N_LOG * g_V),
                  "streamed tables: logits differ from resident (%d workers, batch %d)", w, n_seq);
            mf_store_stats_total(st, &t1);
            CHECK(t1.rows > t0.rows && t1.row_reads > t0.row_reads && t1.row_bytes_read > t0.row_bytes_read,
                  "Engram counters moved (%d workers, batch %d)", w, n_seq);
        }
        if (e && w == 2) {
            char path[1100];
            snprintf(path, sizeof path, "%s/trace_tables.json", g_dir);
            CHECK(mf_step_write_trace(e, path) == 0, "trace: %s", mf_last_error());
            CHECK(file_has(path, "engram L") && file_has(path, " read 0\"") && file_has(path, "plan"),
                  "trace has the Engram plan and reads");
        }
        mf_step_free(e);
    }
    /* every expert is present now (the budget holds all): the first read of a run is an Engram one */
    mf_step *e = NULL;
    CHECK(r && mf_step_new(r, &(mf_step_opts){.n_threads = 2, .io_fault_kind = MF_IO_FAULT_EIO, .io_fault_nth = 1},
                           &e) == 0, "fault engine: %s", mf_last_error());
    if (e) {
        int rc = run(r, e, st, 1, tokens[0], 1, got, NULL);
        CHECK(rc == -EIO && strstr(mf_last_error(), "Engram gather") && strstr(mf_last_error(), "engram.embed"),
              "Engram fault: rc %d: %s", rc, mf_last_error());
        rc = run(r, e, st, 1, tokens[0], 1, got, NULL);
        CHECK(rc == 0 && !memcmp(got, want[0], sizeof(float) * N_LOG * g_V), "after the Engram fault: rc %d: %s", rc,
              mf_last_error());
    }
    mf_step_free(e);
    mf_ref_free(r);
    mf_model_free(m);
}

/* Streamed under budgets[bi] (bi 0: three tokens' experts; 1: one token's, where a decode batch of 3
 * is refused): the resident engine's logits bit for bit at 1, 2 and 4 workers (TSan: 1 and 4), batch
 * 1 and 3, the store's counters moving and every decode step missing; under budget 0 the trace
 * has the IO lane's reads, and an EIO and a short read fail a step naming the expert and leave
 * the store usable. want: the resident logits, got: scratch. */
static void test_budget(int bi, const uint64_t *budgets, uint64_t slot, uint64_t ex_bytes,
                        int32_t (*tokens)[N_SEQ][N_DEC], float *const *want, float *got)
{
    mf_model *m = load_streamed(budgets[bi]);
    if (!m) return;
    mf_store *st = mf_model_store(m);
    mf_ref *r = NULL;
    mf_step *e = NULL;
    CHECK(mf_store_n_slots(st) == (bi ? g_K : N_SEQ * g_K), "slots %d", mf_store_n_slots(st));
    CHECK(mf_ref_new(m, NULL, &r) == 0, "ref: %s", mf_last_error());
    for (int w = 1; w <= 4; w *= MF_TEST_TSAN ? 4 : 2) {   /* TSan: 1 and 4 workers */
        e = NULL;
        CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = w}, &e) == 0, "streamed engine: %s", mf_last_error());
        if (!e) continue;
        for (int b = 0; b < 2; b++) {
            int n_seq = b ? N_SEQ : 1;
            obs ob = {0};
            mf_store_stats t0, t1;
            mf_store_stats_total(st, &t0);
            int rc = run(r, e, st, n_seq, tokens[b], 1, got, &ob);
            if (bi == 1 && b == 1) {   /* 6 experts' pins over 2 slots */
                CHECK(rc == -ENOSPC && strstr(mf_last_error(), "budget of at least") &&
                      strstr(mf_last_error(), "3 sequences"), "batch 3 on %d slots: rc %d: %s",
                      mf_store_n_slots(st), rc, mf_last_error());
                continue;
            }
            CHECK(rc == 0, "streamed budget %llu, %d workers, batch %d: %s",
                  (unsigned long long)budgets[bi], w, n_seq, mf_last_error());
            CHECK(!memcmp(got, want[b], sizeof(float) * (size_t)n_seq * N_LOG * g_V),
                  "streamed logits differ from resident (budget %llu, %d workers, batch %d)",
                  (unsigned long long)budgets[bi], w, n_seq);
            mf_store_stats_total(st, &t1);
            CHECK(t1.misses > t0.misses && t1.bytes_read > t0.bytes_read && t1.evictions > t0.evictions,
                  "counters moved");
            CHECK(t1.evictions - t0.evictions <= t1.misses - t0.misses, "evictions <= misses");
            if (b == 0) {
                CHECK(ob.bad_count == 0, "%d decode steps whose hits + misses != layers x top_k", ob.bad_count);
                CHECK(ob.steps_with_miss == N_DEC, "%d of %d decode steps missed", ob.steps_with_miss, N_DEC);
                CHECK(ob.misses > 0 && ob.bytes >= ob.misses * ex_bytes && ob.bytes <= ob.misses * slot,
                      "bytes %llu for %llu misses (expert %llu, slot %llu)", (unsigned long long)ob.bytes,
                      (unsigned long long)ob.misses, (unsigned long long)ex_bytes, (unsigned long long)slot);
                CHECK(ob.io_busy_ns > 0, "IO-lane busy time in the step timelines");
            }
        }
        if (bi == 0 && w == 2) {   /* the trace carries the IO lane's reads */
            char path[1100];
            snprintf(path, sizeof path, "%s/trace.json", g_dir);
            CHECK(mf_step_write_trace(e, path) == 0, "trace: %s", mf_last_error());
            FILE *f = fopen(path, "rb");
            char *buf = calloc(1, 1 << 24);
            size_t n = f && buf ? fread(buf, 1, (1 << 24) - 1, f) : 0;
            if (f) fclose(f);
            CHECK(n > 0 && strstr(buf, "read L0 slot 0 part 0") && strstr(buf, "\"io\""),
                  "trace has IO-lane reads");
            free(buf);
        }
        mf_step_free(e);
    }

    /* faults: an EIO and a short read on expert reads fail the step naming the expert; the store
     * (its slots and pins) stays usable: a clean run after each is bit-identical */
    for (int f = 0; bi == 0 && f < 2; f++) {
        /* the fault is armed on the engine's own IO lane, its third read */
        CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2, .io_fault_kind = f ? MF_IO_FAULT_SHORT : MF_IO_FAULT_EIO,
                                             .io_fault_nth = 3}, &e) == 0, "engine: %s", mf_last_error());
        if (!e) break;
        int rc = run(r, e, st, 1, tokens[0], 1, got, NULL);
        CHECK(rc < 0 && strstr(mf_last_error(), "expert") && strstr(mf_last_error(), "layer") &&
              strstr(mf_last_error(), "ffn.experts."), "fault %d: rc %d: %s", f, rc, mf_last_error());
        rc = run(r, e, st, 1, tokens[0], 1, got, NULL);
        CHECK(rc == 0 && !memcmp(got, want[0], sizeof(float) * N_LOG * g_V), "after fault %d: rc %d: %s",
              f, rc, mf_last_error());
        mf_step_free(e);
        e = NULL;
    }
    mf_ref_free(r);
    mf_model_free(m);
}

/* The CLI: the scheduled engine with a streamed store (of budget bytes) prints the resident
 * engine's greedy tokens; its trace has the IO lane's reads. */
static void test_cli_streamed(uint64_t budget)
{
    char args[2048], a2[4096], out[4096], out2[4096], tr[1100];
    int32_t p[N_PROMPT];
    prompt_of(0, p);
    int o = snprintf(args, sizeof args, "decode --checkpoint %s --quiet --ignore-eos --max-new-tokens 8 "
                     "--threads 2 --tokens ", g_dir);
    for (int i = 0; i < N_PROMPT; i++) o += snprintf(args + o, sizeof args - o, i ? ",%d" : "%d", p[i]);
    snprintf(tr, sizeof tr, "%s/cli_trace.json", g_dir);
    unlink(tr);
    CHECK(mf_test_cli(args, out, sizeof out) == 0 && out[0], "cli resident: '%s'", out);
    snprintf(a2, sizeof a2, "%s --store streamed --store-budget %llu --trace %s", args,
             (unsigned long long)budget, tr);
    CHECK(mf_test_cli(a2, out2, sizeof out2) == 0 && !strcmp(out, out2), "cli streamed: '%s' want '%s'", out2, out);
    FILE *f = fopen(tr, "rb");
    char *buf = calloc(1, 1 << 24);
    size_t n = f && buf ? fread(buf, 1, (1 << 24) - 1, f) : 0;
    if (f) fclose(f);
    CHECK(n > 0 && strstr(buf, "read L0 slot 0 part 0"), "cli trace has IO-lane reads");
    free(buf);
}

int main(void)
{
    mf_config c;
    CHECK(mf_config_preset("tiny", &c) == 0, "preset");
    if (mf_test_gen_ckpt(&c, "step_store_tiny", g_dir, sizeof g_dir)) return 1;
    g_V = c.vocab_size;
    g_L = c.n_layers;
    g_K = c.n_experts_per_tok;
    size_t per = (size_t)N_SEQ * N_LOG * g_V;
    float *want[2], *got = malloc(sizeof(float) * per);
    int32_t tokens[2][N_SEQ][N_DEC];

    /* the engine on a resident model: logits and greedy tokens, batch 1 and 3 */
    mf_model *m = NULL;
    CHECK(mf_model_load(g_dir, &(mf_model_opts){.quiet = 1}, &m) == 0, "load: %s", mf_last_error());
    if (!m) return mf_check_exit("test_step_store");
    mf_ref *r = NULL;
    mf_step *e = NULL;
    CHECK(mf_ref_new(m, NULL, &r) == 0 && mf_step_new(r, &(mf_step_opts){.n_threads = 2}, &e) == 0,
          "engine: %s", mf_last_error());
    for (int b = 0; b < 2; b++) {
        want[b] = malloc(sizeof(float) * per);
        CHECK(run(r, e, NULL, b ? N_SEQ : 1, tokens[b], 0, want[b], NULL) == 0, "resident batch %d: %s",
              b ? N_SEQ : 1, mf_last_error());
    }
    mf_step_free(e);
    mf_ref_free(r);
    mf_model_free(m);

    /* slot size from a store that holds everything */
    m = load_streamed(UINT64_C(1) << 30);
    if (!m) return mf_check_exit("test_step_store");
    uint64_t slot = mf_store_slot_bytes(mf_model_store(m)), ex_bytes = 0;
    for (int k = 0; k < 3; k++) {   /* an expert's own bytes (a read covers them, aligned out) */
        const mf_weight *w = &mf_model_layer_at(m, 0)->experts[k];
        ex_bytes += mf_weight_data_bytes(w) + mf_weight_scale_bytes(w);
    }
    CHECK(mf_store_n_slots(mf_model_store(m)) == g_L * (int)c.n_routed_experts, "all experts fit");
    mf_model_free(m);

    /* budgets: 3 tokens' experts (batch 3 fits in one graph run), one token's (prefill in chunks
     * of one item, a decode batch of 3 refused); a layer per step needs more than either holds,
     * so every decode step misses */
    uint64_t budgets[2] = {(uint64_t)(N_SEQ * g_K) * slot + slot / 2, (uint64_t)g_K * slot};
    for (int bi = 0; bi < 2; bi++) test_budget(bi, budgets, slot, ex_bytes, tokens, want, got);

    test_tables_streamed(UINT64_C(1) << 30, tokens, want, got);

    /* below one token's experts: refused naming the requirement */
    m = NULL;
    int rc = mf_model_load(g_dir, &(mf_model_opts){.quiet = 1, .store = MF_MODEL_STORE_STREAMED,
                                                   .store_budget_bytes = slot * (uint64_t)(g_K - 1) + slot / 2}, &m);
    CHECK(rc == -ENOSPC && strstr(mf_last_error(), "fewer than the 2 one call may pin"),
          "budget below top_k experts: rc %d: %s", rc, mf_last_error());
    mf_model_free(m);

    if (getenv("MOEFLOW_BIN")) test_cli_streamed(budgets[0]);

    for (int b = 0; b < 2; b++) free(want[b]);
    free(got);
    return mf_check_exit("test_step_store");
}
