/* The expert store and Engram gatherer on a generated tiny checkpoint: the reference forward's
 * logits are bit-identical with no store, a resident store and a streamed store under a budget far
 * below the experts' size (io_uring and pread engines); counters add up and the budget holds;
 * injected EIO and short reads fail naming expert, tensor and file, leave nothing partially read
 * marked present and the store usable; a shard truncated or replaced after open is reported as
 * such; a budget below one call's pins is refused. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "graphs/model/config.h"
#include "graphs/gen/gen.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "host/store.h"
#include "sched/error.h"
#include "sched/sched.h"
#include "tests/check.h"

enum { N_TOK = 20 };

static char g_dir[4096], g_dir2[4096];

static int gen_tiny(const char *dir, uint64_t seed)
{
    mf_config c;
    mf_gen_opts go;
    if (mf_config_preset("tiny", &c) || mf_gen_preset_opts("tiny", &go)) return -1;
    go.force = 1;
    go.quiet = 1;
    go.seed = seed;
    return mf_gen_write(&c, dir, &go);
}

/* Logits of N_TOK tokens decoded one at a time. */
static int decode_logits(mf_model *m, float *out)
{
    const mf_config *c = mf_model_config(m);
    mf_ref *r = NULL;
    mf_ref_state *st = NULL;
    int rc = mf_ref_new(m, NULL, &r);
    if (!rc) rc = mf_ref_state_new(r, 64, &st);
    for (int i = 0; !rc && i < N_TOK; i++) {
        int32_t tok = (int32_t)((i * 7919 + 13) % c->vocab_size);
        rc = mf_ref_decode(r, &st, &tok, 1, out + (int64_t)i * c->vocab_size);
    }
    mf_ref_state_free(st);
    mf_ref_free(r);
    return rc;
}

static mf_model *load_io(const char *dir, int store, uint64_t budget, int tables, int pread)
{
    mf_model *m = NULL;
    int rc = mf_model_load(dir, &(mf_model_opts){.quiet = 1, .store = store, .store_tables = tables,
                                                 .store_budget_bytes = budget, .store_io_depth = 8,
                                                 .store_io_pread = pread},
                           &m);
    CHECK(rc == 0, "load %s store %d: %s", dir, store, mf_last_error());
    return m;
}

static mf_model *load(const char *dir, int store, uint64_t budget, int tables)
{
    return load_io(dir, store, budget, tables, 0);
}

static void test_identity(void)
{
    mf_model *m0 = load(g_dir, MF_MODEL_STORE_NONE, 0, 0);
    mf_model *mr = load(g_dir, MF_MODEL_STORE_RESIDENT, 0, 0);
    if (!m0 || !mr) return;
    const mf_config *c = mf_model_config(m0);
    size_t n = (size_t)N_TOK * c->vocab_size;
    float *l0 = malloc(n * sizeof *l0), *l1 = malloc(n * sizeof *l1);
    CHECK(decode_logits(m0, l0) == 0, "reference: %s", mf_last_error());
    mf_store *sr = mf_model_store(mr);
    mf_store_stats x;
    CHECK(decode_logits(mr, l1) == 0, "resident: %s", mf_last_error());
    CHECK(!memcmp(l0, l1, n * sizeof *l0), "resident store logits differ from the reference");
    mf_store_stats_total(sr, &x);
    uint64_t uses = (uint64_t)N_TOK * c->n_layers * c->n_experts_per_tok;
    CHECK(x.misses == 0 && x.hits == uses, "resident: %llu hits %llu misses, expected %llu hits",
          (unsigned long long)x.hits, (unsigned long long)x.misses, (unsigned long long)uses);
    uint64_t slot = mf_store_slot_bytes(sr);
    printf("tiny: expert slot %llu bytes, %d experts\n", (unsigned long long)slot, mf_store_n_slots(sr));

    const char *engines[2] = {"io_uring", "pread"};
    for (int e = 0; e < 2; e++) {
        uint64_t budget = 20 * slot + slot / 2;   /* 20 slots of 128 experts */
        mf_model *ms = load_io(g_dir, MF_MODEL_STORE_STREAMED, budget, MF_MODEL_STORE_STREAMED, e);
        if (!ms) continue;
        mf_store *ss = mf_model_store(ms);
        CHECK(!strcmp(mf_store_io_engine(ss), engines[e]) || e == 0, "engine %s", mf_store_io_engine(ss));
        memset(l1, 0, n * sizeof *l1);
        CHECK(decode_logits(ms, l1) == 0, "streamed (%s): %s", engines[e], mf_last_error());
        CHECK(!memcmp(l0, l1, n * sizeof *l0), "streamed (%s) logits differ from the reference", engines[e]);
        mf_store_stats_total(ss, &x);
        CHECK(mf_store_n_slots(ss) == 20 && mf_store_slab_bytes(ss) <= budget, "slots %d, slab %llu > budget %llu",
              mf_store_n_slots(ss), (unsigned long long)mf_store_slab_bytes(ss), (unsigned long long)budget);
        CHECK(x.hits + x.misses == uses, "streamed: %llu + %llu != %llu uses", (unsigned long long)x.hits,
              (unsigned long long)x.misses, (unsigned long long)uses);
        CHECK(x.misses >= 20 && x.evictions == x.misses - 20 && x.hits > 0,
              "streamed: %llu misses, %llu evictions, %llu hits", (unsigned long long)x.misses,
              (unsigned long long)x.evictions, (unsigned long long)x.hits);
        CHECK(x.bytes_read > 0 && x.bytes_read <= x.misses * slot, "bytes read %llu for %llu misses",
              (unsigned long long)x.bytes_read, (unsigned long long)x.misses);
        uint64_t rows = (uint64_t)N_TOK * c->n_engram * (c->engram_max_ngram_size - 1) * c->engram_n_heads;
        CHECK(x.rows == rows && x.row_reads > 0 && x.row_reads <= 2 * rows, "Engram: %llu rows (expected %llu) in %llu reads",
              (unsigned long long)x.rows, (unsigned long long)rows, (unsigned long long)x.row_reads);
        CHECK(x.io_busy_ns > 0 && x.cpu_busy_ns > 0, "no IO or compute time measured");
        printf("streamed %s (%s): %llu hits, %llu misses, %llu evictions, %.2f MiB read; %llu rows in %llu reads\n",
               engines[e], mf_store_direct(ss) ? "O_DIRECT" : "buffered", (unsigned long long)x.hits,
               (unsigned long long)x.misses, (unsigned long long)x.evictions, x.bytes_read / 1048576.0,
               (unsigned long long)x.rows, (unsigned long long)x.row_reads);
        mf_model_free(ms);
    }
    free(l0);
    free(l1);
    mf_model_free(m0);
    mf_model_free(mr);
}

/* Compares present expert (L, e) with the checkpoint's bytes. */
static int expert_matches(mf_model *m, int L, int e)
{
    mf_store *s = mf_model_store(m);
    const mf_weight *ew = &mf_model_layer_at(m, L)->experts[e * 3];
    for (int k = 0; k < 3; k++) {
        const uint8_t *d = mf_store_part(s, L, e, 2 * k), *sc = mf_store_part(s, L, e, 2 * k + 1);
        uint64_t nd = mf_weight_data_bytes(&ew[k]), ns = mf_weight_scale_bytes(&ew[k]);
        uint8_t *a = malloc(nd), *b = malloc(ns);
        int ok = d && sc && mf_model_weight_read(m, &ew[k], 0, ew[k].rows, a, b) == 0 &&
                 !memcmp(a, d, nd) && !memcmp(b, sc, ns);
        free(a);
        free(b);
        if (!ok) return 0;
    }
    return 1;
}

static void test_faults(const char *engine)
{
    mf_model *m = load_io(g_dir, MF_MODEL_STORE_STREAMED, 1 << 20, MF_MODEL_STORE_STREAMED, !strcmp(engine, "pread"));
    if (!m) return;
    mf_store *s = mf_model_store(m);
    int32_t ids[3] = {3, 5, 9};
    int kinds[2] = {MF_IO_FAULT_EIO, MF_IO_FAULT_SHORT};
    const char *want[2] = {"Input/output error", "end of file"};
    for (int f = 0; f < 2; f++) {
        mf_store_io_fault(s, kinds[f], 2);   /* the second read of the batch */
        int rc = mf_store_ensure(s, 1, ids, 3, NULL, NULL);
        mf_store_io_fault(s, MF_IO_FAULT_NONE, 0);
        const char *msg = mf_last_error();
        CHECK(rc == -EIO, "%s fault %d: rc %d", engine, f, rc);
        CHECK(strstr(msg, "layers.1.ffn.experts.") && strstr(msg, ".safetensors") && strstr(msg, want[f]),
              "%s fault %d: message does not name tensor, file and cause: %s", engine, f, msg);
        for (int k = 0; k < 3; k++)
            CHECK(!mf_store_part(s, 1, ids[k], 0), "%s: expert %d marked present after a failed read", engine, ids[k]);
        /* usable afterwards: the same call succeeds and the bytes are the file's */
        CHECK(mf_store_ensure(s, 1, ids, 3, NULL, NULL) == 0, "%s: retry: %s", engine, mf_last_error());
        for (int k = 0; k < 3; k++) CHECK(expert_matches(m, 1, ids[k]), "%s: expert %d bytes", engine, ids[k]);
        mf_store_unpin(s, 1, ids, 3);
        ids[0] += 1, ids[1] += 1, ids[2] += 1;   /* fresh misses next time */
    }
    /* Engram gather: a failed batch, then the same rows succeed */
    int64_t rows[4] = {5, 6, 100, 2000};
    uint8_t d1[4 * 64], s1[4 * 8], d2[4 * 64], s2[4 * 8];
    mf_store_io_fault(s, MF_IO_FAULT_EIO, 1);
    int rc = mf_store_gather(s, 0, rows, 4, d1, s1);
    mf_store_io_fault(s, MF_IO_FAULT_NONE, 0);
    CHECK(rc == -EIO && strstr(mf_last_error(), "engram.embed") && strstr(mf_last_error(), ".safetensors"),
          "%s: gather fault: rc %d: %s", engine, rc, mf_last_error());
    CHECK(mf_store_gather(s, 0, rows, 4, d1, s1) == 0, "%s: gather: %s", engine, mf_last_error());
    const mf_weight *tw = &mf_model_layer_at(m, mf_model_config(m)->engram_layer_ids[0])->eg_table;
    uint64_t rb = mf_weight_data_bytes(tw) / tw->rows, sb = mf_weight_scale_bytes(tw) / tw->rows;
    for (int i = 0; i < 4; i++)
        CHECK(mf_model_weight_read(m, tw, rows[i], 1, d2 + i * rb, s2 + i * sb) == 0, "row read");
    CHECK(!memcmp(d1, d2, 4 * rb) && !memcmp(s1, s2, 4 * sb), "%s: gathered rows differ from the file", engine);
    mf_model_free(m);
}

static void test_truncate_replace(void)
{
    if (gen_tiny(g_dir2, 7)) {
        CHECK(0, "gen: %s", mf_last_error());
        return;
    }
    mf_model *m = load(g_dir2, MF_MODEL_STORE_STREAMED, 1 << 20, MF_MODEL_STORE_STREAMED);
    if (!m) return;
    mf_store *s = mf_model_store(m);
    const mf_weight *w = &mf_model_layer_at(m, 7)->experts[15 * 3];
    char shard[4200];
    /* the shard of the last layer's last expert */
    const char *path = NULL;
    {
        mf_st *st = NULL;
        CHECK(mf_st_open(g_dir2, &st) == 0, "st: %s", mf_last_error());
        if (st) {
            snprintf(shard, sizeof shard, "%s", mf_st_shard_path(st, w->st_data->shard));
            path = shard;
            mf_st_close(st);
        }
    }
    if (!path) return;
    CHECK(truncate(path, (off_t)w->st_data->file_offset) == 0, "truncate %s", path);
    int32_t id = 15;
    int rc = mf_store_ensure(s, 7, &id, 1, NULL, NULL);
    CHECK(rc < 0 && strstr(mf_last_error(), "truncated") && strstr(mf_last_error(), path) &&
          strstr(mf_last_error(), "layers.7.ffn.experts.15"), "truncated shard: rc %d: %s", rc, mf_last_error());
    CHECK(!mf_store_part(s, 7, 15, 0), "expert of a truncated shard marked present");
    /* replaced: a new file renamed over the shard */
    char tmp[4300];
    snprintf(tmp, sizeof tmp, "%s.new", path);
    FILE *f = fopen(tmp, "w");
    CHECK(f != NULL, "create %s", tmp);
    if (f) {
        fputs("not a shard", f);
        fclose(f);
        CHECK(rename(tmp, path) == 0, "rename");
        rc = mf_store_ensure(s, 7, &id, 1, NULL, NULL);
        CHECK(rc < 0 && strstr(mf_last_error(), "replaced after open"), "replaced shard: rc %d: %s", rc,
              mf_last_error());
    }
    /* experts of the other shards still read fine */
    int32_t id0 = 0;
    const mf_weight *w0 = &mf_model_layer_at(m, 0)->experts[0];
    if (w0->st_data->shard != w->st_data->shard) {
        CHECK(mf_store_ensure(s, 0, &id0, 1, NULL, NULL) == 0, "other shard: %s", mf_last_error());
        mf_store_unpin(s, 0, &id0, 1);
    }
    mf_model_free(m);
}

/* The demo preset (~1.4 GiB) decoded with no store, a resident store and a 64 MiB streamed store:
 * the same logits, bit for bit. Skipped under AddressSanitizer and ThreadSanitizer (minutes there;
 * the tiny model's runs above carry the store's concurrent paths). */
static void test_demo(const char *tmp)
{
#if MF_TEST_SANITIZED
    printf("demo identity: skipped under a sanitizer\n");
    (void)tmp;
#else
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/store_demo", tmp);
    mf_config c;
    mf_gen_opts go;
    mf_config_preset("demo", &c);
    mf_gen_preset_opts("demo", &go);
    go.force = 1;
    go.quiet = 1;
    if (mf_gen_write(&c, dir, &go)) {
        CHECK(0, "gen demo: %s", mf_last_error());
        return;
    }
    enum { T = 3 };
    size_t n = (size_t)T * c.vocab_size;
    float *l[3];
    int modes[3] = {MF_MODEL_STORE_NONE, MF_MODEL_STORE_RESIDENT, MF_MODEL_STORE_STREAMED};
    for (int k = 0; k < 3; k++) {
        l[k] = calloc(n, sizeof(float));
        mf_model *m = load(dir, modes[k], 64u << 20, 0);
        if (!m) continue;
        mf_ref *r = NULL;
        mf_ref_state *st = NULL;
        int rc = mf_ref_new(m, NULL, &r);
        if (!rc) rc = mf_ref_state_new(r, 16, &st);
        for (int i = 0; !rc && i < T; i++) {
            int32_t tok = 1000 + 37 * i;
            rc = mf_ref_decode(r, &st, &tok, 1, l[k] + (size_t)i * c.vocab_size);
        }
        CHECK(rc == 0, "demo mode %d: %s", modes[k], mf_last_error());
        if (modes[k] == MF_MODEL_STORE_STREAMED) {
            mf_store_stats x;
            mf_store_stats_total(mf_model_store(m), &x);
            printf("demo streamed (64 MiB, %d slots): %llu hits, %llu misses, %.1f MiB read\n",
                   mf_store_n_slots(mf_model_store(m)), (unsigned long long)x.hits,
                   (unsigned long long)x.misses, x.bytes_read / 1048576.0);
            CHECK(x.misses > 0 && mf_store_slab_bytes(mf_model_store(m)) <= (64u << 20), "demo streamed counters");
        }
        mf_ref_state_free(st);
        mf_ref_free(r);
        mf_model_free(m);
    }
    CHECK(!memcmp(l[0], l[1], n * sizeof(float)), "demo: resident store logits differ");
    CHECK(!memcmp(l[0], l[2], n * sizeof(float)), "demo: streamed store logits differ");
    for (int k = 0; k < 3; k++) free(l[k]);
    /* the checkpoint is 1.4 GiB: do not leave it behind */
    for (int i = 1; i <= go.n_shards; i++) {
        char p[4200];
        snprintf(p, sizeof p, "%s/model-%05d-of-%05d.safetensors", dir, i, go.n_shards);
        unlink(p);
    }
#endif
}

/* The store's pieces: begin/reads/end driven from a graph of our own; gathers that coalesce
 * adjacent rows and read duplicates once; LFU keeps a hot expert through a scan of cold ones; a
 * store made directly on NUMA node 0 with a pin hook. */
static int pin_calls;
static int pin_hook(void *user, void *p, uint64_t n)
{
    (void)user;
    pin_calls += p != NULL && n > 0;
    return 0;
}

static void test_api(void)
{
    mf_model *m = load(g_dir, MF_MODEL_STORE_STREAMED, 20 * 32768, MF_MODEL_STORE_STREAMED);
    if (!m) return;
    mf_store *s = mf_model_store(m);
    const mf_config *c = mf_model_config(m);

    /* (1) reads on IO tasks of a caller's graph */
    mf_lane_desc lanes[1] = {{.kind = MF_LANE_IO, .name = "io", .concurrency = 4, .numa_node = -1}};
    mf_sched *sch = NULL;
    mf_graph *g = NULL;
    CHECK(mf_sched_create(&(mf_sched_opts){.lanes = lanes, .n_lanes = 1}, &sch) == 0, "%s", mf_last_error());
    CHECK(mf_graph_create(lanes, 1, &g) == 0, "%s", mf_last_error());
    int32_t ids[2] = {4, 11};
    CHECK(mf_store_begin(s, 2, ids, 2) == 0, "begin: %s", mf_last_error());
    int n_tasks = 0;
    for (int k = 0; k < 2; k++) {
        int n;
        mf_io_read *r = mf_store_reads(s, k, &n);
        CHECK(n >= 1, "expert %d: %d reads", ids[k], n);
        for (int j = 0; j < n; j++, n_tasks++)
            mf_graph_add_task(g, &(mf_task_desc){.name = "expert", .lane = 0, .arg = &r[j], .place_hint = -1});
    }
    CHECK(mf_graph_finalize(g) == 0, "%s", mf_last_error());
    CHECK(!mf_store_part(s, 2, 4, 0), "present before its reads ran");
    int rc = mf_sched_run(sch, g, NULL);
    CHECK(mf_store_end(s, rc) == 0, "end: %s", mf_last_error());
    CHECK(expert_matches(m, 2, 4) && expert_matches(m, 2, 11), "experts read through a caller's graph");
    mf_store_unpin(s, 2, ids, 2);
    mf_graph_destroy(g);
    mf_sched_destroy(sch);

    /* (2) gathers: 7 rows, 2 duplicates, runs {5,6,7} and {100} -> 2 runs x 2 tensors */
    mf_store_stats a, b;
    mf_store_stats_total(s, &a);
    int64_t rows[7] = {7, 5, 100, 6, 7, 5, 100};
    int d = c->engram_head_dim, sb = d / 32;
    uint8_t dat[7 * 64], sc[7 * 8], ref_d[64], ref_s[8];
    CHECK(mf_store_gather(s, 1, rows, 7, dat, sc) == 0, "gather: %s", mf_last_error());
    mf_store_stats_total(s, &b);
    CHECK(b.row_reads - a.row_reads == 4 && b.rows - a.rows == 7, "gather of 7 rows: %llu reads",
          (unsigned long long)(b.row_reads - a.row_reads));
    const mf_weight *tw = &mf_model_layer_at(m, c->engram_layer_ids[1])->eg_table;
    for (int i = 0; i < 7; i++) {
        CHECK(mf_model_weight_read(m, tw, rows[i], 1, ref_d, ref_s) == 0, "row");
        CHECK(!memcmp(dat + i * d, ref_d, (size_t)d) && !memcmp(sc + i * sb, ref_s, (size_t)sb),
              "gathered row %d (%lld) differs", i, (long long)rows[i]);
    }
    int64_t bad = tw->rows;
    CHECK(mf_store_gather(s, 1, &bad, 1, dat, sc) == -EINVAL && strstr(mf_last_error(), "outside"),
          "row out of range: %s", mf_last_error());

    /* (3) LFU with aging: expert 0 of layer 5 used 6 times, then 40 others once each */
    int32_t hot = 0;
    for (int i = 0; i < 6; i++) {
        CHECK(mf_store_ensure(s, 5, &hot, 1, NULL, NULL) == 0, "%s", mf_last_error());
        mf_store_unpin(s, 5, &hot, 1);
    }
    for (int L = 6; L < 8; L++)
        for (int e = 0; e < 16; e += 4) {
            int32_t cold[4] = {e, e + 1, e + 2, e + 3};
            CHECK(mf_store_ensure(s, L, cold, 4, NULL, NULL) == 0, "%s", mf_last_error());
            mf_store_unpin(s, L, cold, 4);
        }
    for (int e = 1; e < 9; e++) {
        int32_t cold = e;
        CHECK(mf_store_ensure(s, 5, &cold, 1, NULL, NULL) == 0, "%s", mf_last_error());
        mf_store_unpin(s, 5, &cold, 1);
    }
    CHECK(mf_store_part(s, 5, 0, 0) != NULL, "LFU: the hot expert was evicted by a scan of 40 cold ones");
    mf_store_stats_total(s, &b);
    CHECK(b.evictions > 0, "the scan evicted nothing");
    mf_model_free(m);

    /* (4) direct creation on NUMA node 0 with a pin hook, resident, tables resident */
    m = load(g_dir, MF_MODEL_STORE_NONE, 0, 0);
    if (!m) return;
    c = mf_model_config(m);
    tw = &mf_model_layer_at(m, c->engram_layer_ids[1])->eg_table;
    int ne = c->n_routed_experts, nl = c->n_layers;
    const mf_st_tensor **parts = calloc((size_t)nl * ne * 6, sizeof *parts);
    for (int L = 0; L < nl; L++)
        for (int e = 0; e < ne; e++)
            for (int k = 0; k < 3; k++) {
                const mf_weight *w = &mf_model_layer_at(m, L)->experts[e * 3 + k];
                parts[((size_t)L * ne + e) * 6 + 2 * k] = w->st_data;
                parts[((size_t)L * ne + e) * 6 + 2 * k + 1] = w->st_scale;
            }
    const mf_st_tensor *tabs[2] = {tw->st_data, tw->st_scale};
    mf_st *st = NULL;
    CHECK(mf_st_open(g_dir, &st) == 0, "%s", mf_last_error());
    mf_store *ds = NULL;
    if (st) {
        mf_store_layout lay = {.n_layers = nl, .n_experts = ne, .n_parts = 6, .parts = parts,
                               .n_tables = 1, .tables = tabs};
        rc = mf_store_create(st, &lay, &(mf_store_opts){.mode = MF_STORE_RESIDENT, .numa_node = 0,
                                                          .quiet = 1, .pin_hook = pin_hook}, &ds);
        CHECK(rc == 0, "store on node 0: %s", mf_last_error());
        CHECK(pin_calls == 1, "pin hook called %d times", pin_calls);
        if (ds) {
            CHECK(mf_store_part(ds, 3, 7, 5) != NULL, "resident expert absent");
            CHECK(mf_store_gather(ds, 0, rows, 7, dat, sc) == 0 && !memcmp(dat + 2 * d, ref_d, (size_t)d),
                  "resident table gather: %s", mf_last_error());
        }
        mf_store_destroy(ds);
        mf_st_close(st);
    }
    free(parts);
    mf_model_free(m);
}

static void test_budget(void)
{
    mf_model *m = NULL;
    int rc = mf_model_load(g_dir, &(mf_model_opts){.quiet = 1, .store = MF_MODEL_STORE_STREAMED,
                                                   .store_budget_bytes = 4096}, &m);
    CHECK(rc == -ENOSPC && strstr(mf_last_error(), "budget"), "tiny budget: rc %d: %s", rc, mf_last_error());
    mf_model_free(m);
}

int main(void)
{
    const char *tmp = getenv("MOEFLOW_TMP");
    snprintf(g_dir, sizeof g_dir, "%s/store_tiny", tmp ? tmp : "/tmp");
    snprintf(g_dir2, sizeof g_dir2, "%s/store_tiny_fault", tmp ? tmp : "/tmp");
    if (gen_tiny(g_dir, 0)) {
        fprintf(stderr, "gen: %s\n", mf_last_error());
        return 1;
    }
    test_identity();
    test_faults("io_uring");
    test_faults("pread");
    test_truncate_replace();
    test_budget();
    test_api();
    test_demo(tmp ? tmp : "/tmp");
    return mf_check_exit("test_store");
}
