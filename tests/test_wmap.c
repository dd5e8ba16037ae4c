/* Weights mapped from the page cache (host/wmap.h, mf_model_opts.weights) on generated tiny
 * checkpoints: the reference forward's and the scheduled engine's logits bit for bit those of the
 * copied weights, cold (the shards evicted) and warm; nothing wrong is served when the filling
 * process is killed at random points (SIGKILL to a child looping evict + load), when a shard is
 * touched, rewritten in place or replaced by another checkpoint's between runs, or with two
 * checkpoints cached at once; a shard truncated after its header was read is refused; weights
 * larger than the memory fall back to a streamed store (same logits); tensors the file does not
 * align are copied (same logits); emulated cards over mapped weights (the generator's layout and the
 * released one's, scales first) give the copy's logits, each miss one copy of the span; with sockets each share is faulted in by threads bound to its
 * node, a node that does not exist noted; the cached-bytes and evict helpers agree with a load. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/mempolicy.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "device/dev.h"
#include "graphs/gen/gen.h"
#include "graphs/model/config.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/step.h"
#include "host/safetensors.h"
#include "host/store.h"
#include "host/wmap.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/step_run.h"

enum { N_TOK = 12, N_PROMPT = 5, N_DEC = 4 };

static char g_dir[4096], g_dir2[4096], g_odd[4096];
static int64_t g_V;

static int gen(const char *dir, uint64_t seed)
{
    mf_config c;
    mf_gen_opts go;
    if (mf_config_preset("tiny", &c) || mf_gen_preset_opts("tiny", &go)) return -1;
    go.force = 1;
    go.quiet = 1;
    go.seed = seed;
    return mf_gen_write(&c, dir, &go);
}

static mf_model *load_w(const char *dir, mf_model_opts o)
{
    mf_model *m = NULL;
    o.quiet = 1;
    int rc = mf_model_load(dir, &o, &m);
    CHECK(rc == 0, "load %s (weights %d): %s", dir, o.weights, mf_last_error());
    return m;
}

static mf_model *load_mapped(const char *dir) { return load_w(dir, (mf_model_opts){.weights = MF_MODEL_WEIGHTS_MAPPED}); }
static mf_model *load_copied(const char *dir) { return load_w(dir, (mf_model_opts){0}); }

/* Logits of N_TOK tokens decoded one at a time by the reference forward, malloc'ed. */
static float *ref_logits(mf_model *m)
{
    if (!m) return NULL;
    const mf_config *c = mf_model_config(m);
    float *out = malloc(sizeof(float) * (size_t)N_TOK * c->vocab_size);
    mf_ref *r = NULL;
    mf_ref_state *st = NULL;
    int rc = out ? mf_ref_new(m, NULL, &r) : -ENOMEM;
    if (!rc) rc = mf_ref_state_new(r, 64, &st);
    for (int i = 0; !rc && i < N_TOK; i++) {
        int32_t tok = (int32_t)((i * 7919 + 13) % c->vocab_size);
        rc = mf_ref_decode(r, &st, &tok, 1, out + (int64_t)i * c->vocab_size);
    }
    mf_ref_state_free(st);
    mf_ref_free(r);
    CHECK(rc == 0, "reference forward: %s", mf_last_error());
    if (rc) {
        free(out);
        return NULL;
    }
    return out;
}

static int32_t prompt_of(int s, int i) { return (int32_t)((s * 131 + i * 7919 + 5) % g_V); }

/* The scheduled engine's logits: 2 sequences prefilled, N_DEC greedy steps; malloc'ed. */
static float *step_logits(mf_model *m)
{
    if (!m) return NULL;
    g_V = mf_model_config(m)->vocab_size;
    float *out = malloc(sizeof(float) * (size_t)2 * (1 + N_DEC) * g_V);
    int32_t toks[2 * N_DEC];
    mf_ref *r = NULL;
    mf_step *e = NULL;
    int rc = out ? mf_ref_new(m, NULL, &r) : -ENOMEM;
    if (!rc) rc = mf_step_new(r, &(mf_step_opts){.n_threads = 2}, &e);
    if (!rc) rc = mf_test_run_steps(r, e, g_V, 2, N_PROMPT, prompt_of, N_DEC, toks, 1, out);
    mf_step_free(e);
    mf_ref_free(r);
    CHECK(rc == 0, "scheduled engine: %s", mf_last_error());
    if (rc) {
        free(out);
        return NULL;
    }
    return out;
}

static int same(const float *a, const float *b, size_t n) { return a && b && !memcmp(a, b, n * sizeof(float)); }

static void evict(const char *dir)
{
    mf_st *st = NULL;
    if (mf_st_open(dir, &st)) return;
    for (int s = 0; s < mf_st_n_shards(st); s++) mf_wmap_file_evict(mf_st_shard_path(st, s));
    mf_st_close(st);
}

/* Cold and warm mapped loads against the copy, both engines; the counters of each. */
static void test_cold_warm(void)
{
    mf_model *mc = load_copied(g_dir);
    float *want = ref_logits(mc), *want_s = step_logits(mc);
    size_t n = mc ? (size_t)N_TOK * mf_model_config(mc)->vocab_size : 0, ns = (size_t)2 * (1 + N_DEC) * g_V;
    mf_model_free(mc);
    evict(g_dir);
    mf_model *cold = load_mapped(g_dir);
    if (!cold) return;
    mf_model_weights w;
    mf_model_weights_info(cold, &w);
    CHECK(w.mapped && !w.fell_back && w.map_bytes > 0 && !w.copied_bytes, "mapped %d fell back %d, %llu bytes",
          w.mapped, w.fell_back, (unsigned long long)w.map_bytes);
    CHECK(w.cached_bytes < w.map_bytes, "cold load after evict: %llu of %llu bytes cached before",
          (unsigned long long)w.cached_bytes, (unsigned long long)w.map_bytes);
    CHECK(!mf_model_is_lazy(cold) && !mf_model_store(cold), "mapped weights: nothing lazy, no store");
    mf_model *warm = load_mapped(g_dir);   /* while the first maps the pages */
    mf_model_weights w2;
    if (warm) mf_model_weights_info(warm, &w2);
    CHECK(warm && w2.cached_bytes >= w2.map_bytes, "warm load: %llu of %llu bytes cached",
          warm ? (unsigned long long)w2.cached_bytes : 0ULL, (unsigned long long)w.map_bytes);
    float *a = ref_logits(cold), *b = ref_logits(warm), *bs = step_logits(warm);
    CHECK(same(want, a, n) && same(want, b, n), "reference logits: mapped (cold %d, warm %d) differ from copied",
          same(want, a, n), same(want, b, n));
    CHECK(same(want_s, bs, ns), "scheduled engine logits: mapped differ from copied");
    /* the helpers say the same as the load: the used bytes cached */
    mf_st *st = NULL;
    uint64_t cached = 0, size = 0, tot_c = 0, tot = 0;
    CHECK(mf_st_open(g_dir, &st) == 0, "st_open: %s", mf_last_error());
    for (int s = 0; st && s < mf_st_n_shards(st); s++) {
        CHECK(mf_wmap_file_cached(mf_st_shard_path(st, s), &cached, &size) == 0, "cached: %s", mf_last_error());
        tot_c += cached;
        tot += size;
    }
    mf_st_close(st);
    CHECK(tot_c >= w.map_bytes && tot_c <= tot + 4096 * 8, "file_cached %llu of %llu, the load maps %llu",
          (unsigned long long)tot_c, (unsigned long long)tot, (unsigned long long)w.map_bytes);
    free(a);
    free(b);
    free(bs);
    mf_model_free(warm);
    mf_model_free(cold);
    free(want);
    free(want_s);
}

/* A child loops evict + mapped load + free until killed at a random point; after each kill the
 * page cache holds whatever the killed fill got to, and the next load serves the right weights. */
static void test_killed_filler(void)
{
    mf_model *mc = load_copied(g_dir);
    float *want = ref_logits(mc);
    size_t n = mc ? (size_t)N_TOK * mf_model_config(mc)->vocab_size : 0;
    mf_model_free(mc);
    volatile int *counts = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (counts == MAP_FAILED) return;
    unsigned seed = (unsigned)time(NULL) ^ (unsigned)getpid();
    int mid = 0, partly = 0, rounds = MF_TEST_SANITIZED ? 3 : 8;
    for (int k = 0; k < rounds; k++) {
        counts[0] = counts[1] = 0;
        pid_t pid = fork();
        if (pid == 0) {
            for (;;) {
                evict(g_dir);
                mf_model *m = NULL;
                counts[0]++;
                if (mf_model_load(g_dir, &(mf_model_opts){.quiet = 1, .weights = MF_MODEL_WEIGHTS_MAPPED,
                                                           .map_threads = 1 + (int)(counts[0] % 4)}, &m))
                    _exit(3);
                counts[1]++;
                mf_model_free(m);
            }
        }
        CHECK(pid > 0, "fork: %s", strerror(errno));
        if (pid < 0) break;
        while (counts[0] < 2) usleep(1000);   /* past the first load: the loop runs */
        usleep((useconds_t)(rand_r(&seed) % 40000));
        kill(pid, SIGKILL);
        int status = 0;
        waitpid(pid, &status, 0);
        CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "filler ended with status %d, not by the kill", status);
        mid += counts[0] > counts[1];
        mf_model *m = load_mapped(g_dir);
        mf_model_weights w;
        if (m) mf_model_weights_info(m, &w);
        partly += m && w.cached_bytes < w.map_bytes;
        float *got = ref_logits(m);
        CHECK(same(want, got, n), "round %d: logits after the filler was killed differ from copied", k);
        free(got);
        mf_model_free(m);
    }
    printf("killed filler: %d rounds, %d killed inside a load, %d next loads found the page cache partly filled\n", rounds,
           mid, partly);
    munmap((void *)counts, 4096);
    free(want);
}

/* Overwrites n bytes of tensor `name` of dir in place (pwrite: the page cache is updated, the
 * inode kept), with bytes from pattern. */
static int rewrite_tensor(const char *dir, const char *name, uint8_t pattern)
{
    mf_st *st = NULL;
    int rc = mf_st_open(dir, &st);
    if (rc) return rc;
    const mf_st_tensor *t = mf_st_find(st, name);
    rc = -ENOENT;
    if (t) {
        uint8_t *buf = malloc((size_t)t->n_bytes);
        for (uint64_t i = 0; buf && i < t->n_bytes; i++) buf[i] = (uint8_t)(pattern + (i & 1 ? 0 : 0x40));
        int fd = open(mf_st_shard_path(st, t->shard), O_WRONLY | O_CLOEXEC);
        rc = buf && fd >= 0 && pwrite(fd, buf, (size_t)t->n_bytes, (off_t)t->file_offset) == (ssize_t)t->n_bytes ? 0 : -EIO;
        if (fd >= 0) close(fd);
        free(buf);
    }
    mf_st_close(st);
    return rc;
}

/* Between runs: a shard touched (mtime only), a tensor rewritten in place while cached, the shards
 * replaced by another checkpoint's (new inodes), two checkpoints cached at once: every mapped load
 * gives the copied load's logits of the files as they are. */
static void test_changed_between_runs(void)
{
    mf_model *m1 = load_mapped(g_dir), *m2 = load_mapped(g_dir2);   /* both cached, both mapped */
    mf_model *c1 = load_copied(g_dir), *c2 = load_copied(g_dir2);
    size_t n = c1 ? (size_t)N_TOK * mf_model_config(c1)->vocab_size : 0;
    float *l1 = ref_logits(m1), *l2 = ref_logits(m2), *w1 = ref_logits(c1), *w2 = ref_logits(c2);
    CHECK(same(l1, w1, n) && same(l2, w2, n) && !same(w1, w2, n),
          "two checkpoints cached at once: each mapped load its own logits");
    mf_model_free(m1);
    mf_model_free(m2);
    mf_model_free(c1);
    mf_model_free(c2);
    /* touched: the same bytes, a new mtime */
    char shard[4200];
    snprintf(shard, sizeof shard, "%s/model-00001-of-00002.safetensors", g_dir);
    CHECK(utimensat(AT_FDCWD, shard, NULL, 0) == 0, "touch %s: %s", shard, strerror(errno));
    mf_model *mt = load_mapped(g_dir);
    float *lt = ref_logits(mt);
    CHECK(same(lt, w1, n), "after a touch: mapped logits differ");
    mf_model_free(mt);
    free(lt);
    /* rewritten in place while cached (and mapped by a live model): the next load sees new bytes */
    mf_model *live = load_mapped(g_dir);
    CHECK(rewrite_tensor(g_dir, "norm.weight", 0x3f) == 0, "rewrite norm.weight: %s", mf_last_error());
    mf_model *mr = load_mapped(g_dir), *cr = load_copied(g_dir);
    float *lr = ref_logits(mr), *wr = ref_logits(cr);
    CHECK(same(lr, wr, n) && !same(wr, w1, n), "rewritten in place: mapped %s the copy's logits, which %s the old ones",
          same(lr, wr, n) ? "equal" : "differ from", same(wr, w1, n) ? "equal" : "differ from");
    mf_model_free(mr);
    mf_model_free(cr);
    mf_model_free(live);
    free(lr);
    free(wr);
    /* replaced by the other checkpoint's shards (renamed over: new inodes, the old pages orphaned) */
    for (int s = 1; s <= 2; s++) {
        char from[4200], tmp[4300], to[4200], cmd[17100];
        snprintf(from, sizeof from, "%s/model-0000%d-of-00002.safetensors", g_dir2, s);
        snprintf(to, sizeof to, "%s/model-0000%d-of-00002.safetensors", g_dir, s);
        snprintf(tmp, sizeof tmp, "%s.new", to);
        snprintf(cmd, sizeof cmd, "cp '%s' '%s' && mv '%s' '%s'", from, tmp, tmp, to);
        CHECK(system(cmd) == 0, "%s", cmd);
    }
    mf_model *mx = load_mapped(g_dir);
    float *lx = ref_logits(mx);
    CHECK(same(lx, w2, n), "shards replaced by another checkpoint's: mapped logits are not that checkpoint's");
    mf_model_free(mx);
    free(lx);
    free(l1);
    free(l2);
    free(w1);
    free(w2);
    CHECK(gen(g_dir, 0) == 0, "regenerate %s: %s", g_dir, mf_last_error());
}

/* A shard truncated after its header was read: the mapping is refused (a later access would fault). */
static void test_truncated(void)
{
    mf_st *st = NULL;
    CHECK(mf_st_open(g_dir, &st) == 0, "st_open: %s", mf_last_error());
    if (!st) return;
    const char *p = mf_st_shard_path(st, 1);
    uint64_t size = mf_st_shard_bytes(st, 1);
    CHECK(truncate(p, (off_t)(size - 4096)) == 0, "truncate: %s", strerror(errno));
    mf_wmap *w = NULL;
    int rc = mf_wmap_open(st, 0, &w);
    CHECK(rc == -ESTALE && strstr(mf_last_error(), p) && strstr(mf_last_error(), "changed"),
          "truncated shard: rc %d: %s", rc, mf_last_error());
    mf_wmap_close(w);
    mf_st_close(st);
    CHECK(gen(g_dir, 0) == 0, "regenerate %s: %s", g_dir, mf_last_error());
}

/* Weights over the memory given: experts and tables through a streamed store, the rest mapped. */
static void test_fallback(void)
{
    mf_model *mc = load_copied(g_dir);
    float *want = ref_logits(mc);
    size_t n = mc ? (size_t)N_TOK * mf_model_config(mc)->vocab_size : 0;
    mf_model_free(mc);
    mf_model *m = load_w(g_dir, (mf_model_opts){.weights = MF_MODEL_WEIGHTS_MAPPED, .map_mem_bytes = 1u << 20,
                                                .store_budget_bytes = 1u << 20});
    mf_model_weights w;
    if (m) mf_model_weights_info(m, &w);
    CHECK(m && w.mapped && w.fell_back && mf_model_store(m) && mf_store_tables_streamed(mf_model_store(m)),
          "over the memory: fell back %d, store %p", m ? w.fell_back : -1, m ? (void *)mf_model_store(m) : NULL);
    float *got = ref_logits(m);
    CHECK(same(want, got, n), "fallback to a streamed store: logits differ from copied");
    free(got);
    mf_model_free(m);
    free(want);
}

/* dir's tensors rewritten as one file out/model.safetensors (config.json beside it), sorted by
 * name as the released checkpoint's Python writer orders them within a dtype size (each expert's
 * scales before its codes), after a 3-byte tensor with odd: every tensor then starts 3 bytes past
 * its alignment. 0 or 1 (said). */
static int write_single(const char *dir, const char *out, int odd)
{
    mf_st *st = NULL;
    CHECK(mf_st_open(dir, &st) == 0, "st_open: %s", mf_last_error());
    if (!st) return 1;
    int n = mf_st_n_tensors(st), k0 = odd ? 1 : 0;
    mf_st_spec *sp = calloc((size_t)n + 1, sizeof *sp);
    sp[0] = (mf_st_spec){.name = "aaa.odd", .dtype = MF_DTYPE_U8, .n_dims = 1, .shape = {3}};
    for (int i = 0; i < n; i++) {
        const mf_st_tensor *t = mf_st_tensor_at(st, i);   /* sorted by name */
        sp[i + k0] = (mf_st_spec){.name = t->name, .dtype = t->dtype, .n_dims = t->n_dims};
        memcpy(sp[i + k0].shape, t->shape, sizeof t->shape);
    }
    char path[4200], cmd[13000];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s' && cp '%s/config.json' '%s/'", out, dir, out);
    CHECK(system(cmd) == 0, "%s", cmd);
    snprintf(path, sizeof path, "%s/model.safetensors", out);
    mf_st_writer *wr = NULL;
    int rc = mf_st_writer_create(path, sp, n + k0, NULL, 0, &wr);
    for (int i = 0; !rc && i < n; i++) {
        const mf_st_tensor *t = mf_st_tensor_at(st, i);
        void *buf = malloc((size_t)t->n_bytes + 1);
        rc = buf ? mf_st_read(st, t, 0, buf, (size_t)t->n_bytes) : -ENOMEM;
        if (!rc) rc = mf_st_writer_pwrite(wr, i + k0, 0, buf, (size_t)t->n_bytes);
        free(buf);
    }
    if (!rc) rc = mf_st_writer_finish(wr);
    else mf_st_writer_abort(wr);
    CHECK(rc == 0, "writing %s: %s", path, mf_last_error());
    free(sp);
    mf_st_close(st);
    return rc ? 1 : 0;
}

/* Tensors 3 bytes past alignment: mapped loads copy the bf16 and f32 ones (and view the rest),
 * with the copy's logits. */
static void test_unaligned(void)
{
    if (write_single(g_dir, g_odd, 1)) return;
    mf_model *mc = load_copied(g_odd), *mm = load_mapped(g_odd);
    mf_model_weights w;
    if (mm) mf_model_weights_info(mm, &w);
    CHECK(mm && w.copied_bytes > 0 && w.map_bytes > 0, "unaligned tensors: %llu bytes copied, %llu mapped",
          mm ? (unsigned long long)w.copied_bytes : 0ULL, mm ? (unsigned long long)w.map_bytes : 0ULL);
    size_t nl = mc ? (size_t)N_TOK * mf_model_config(mc)->vocab_size : 0;
    float *a = ref_logits(mc), *b = ref_logits(mm);
    CHECK(same(a, b, nl), "unaligned tensors: mapped logits differ from copied");
    free(a);
    free(b);
    mf_model_free(mc);
    mf_model_free(mm);
}

/* The scheduled engine with 2 emulated cards (seed placement, caches filling on misses) over
 * mapped weights, in the generator's layout (codes, then scales) and the released one's (scales
 * first): the copied weights' logits, and every miss one copy of the expert's span (the card slot
 * mirrors the file's layout). */
static float *cards_logits(mf_model *m, mf_step_dev_stats *ds)
{
    if (!m) return NULL;
    g_V = mf_model_config(m)->vocab_size;
    float *out = malloc(sizeof(float) * (size_t)2 * (1 + N_DEC) * g_V);
    int32_t toks[2 * N_DEC];
    char spec[64];
    mf_dev *d = NULL;
    mf_ref *r = NULL;
    mf_step *e = NULL;
    int rc = out ? mf_test_emu_open(2, spec, sizeof spec, &d) : -ENOMEM;
    if (!rc) rc = mf_ref_new(m, NULL, &r);
    if (!rc) rc = mf_step_new(r, &(mf_step_opts){.n_threads = 2, .dev = d, .placement = MF_STEP_PLACE_SEED}, &e);
    if (!rc) rc = mf_test_run_steps(r, e, g_V, 2, N_PROMPT, prompt_of, N_DEC, toks, 1, out);
    if (!rc) mf_step_last_dev(e, ds);
    mf_step_free(e);
    mf_ref_free(r);
    mf_dev_close(d);
    CHECK(rc == 0, "cards: %s", mf_last_error());
    if (rc) {
        free(out);
        return NULL;
    }
    return out;
}

static void test_cards(void)
{
    char sorted[4200];
    snprintf(sorted, sizeof sorted, "%s_sorted", g_odd);
    if (write_single(g_dir, sorted, 0)) return;
    const char *dirs[2] = {g_dir, sorted};
    for (int k = 0; k < 2; k++) {
        mf_model *mc = load_copied(dirs[k]), *mm = load_mapped(dirs[k]);
        mf_step_dev_stats dc = {0}, dm = {0};
        float *a = cards_logits(mc, &dc), *b = cards_logits(mm, &dm);
        size_t n = (size_t)2 * (1 + N_DEC) * g_V;
        CHECK(same(a, b, n), "%s: cards over mapped weights: logits differ from copied", dirs[k]);
        CHECK(dm.misses > 0 && dm.miss_spans == (int64_t)dm.misses, "%s: mapped: %lld of %llu misses of the last step "
              "one span", dirs[k], (long long)dm.miss_spans, (unsigned long long)dm.misses);
        free(a);
        free(b);
        mf_model_free(mc);
        mf_model_free(mm);
    }
}

/* Sockets: each share faulted in by threads bound to its node; node 0 exists, a node 999 does not.
 * Where this process may not set a memory policy at all, no share is bound. */
static void test_sockets(void)
{
    unsigned long mask = 1;
    int can = syscall(SYS_set_mempolicy, MPOL_BIND, &mask, 64) == 0;
    syscall(SYS_set_mempolicy, MPOL_DEFAULT, NULL, 0);
    mf_model *mc = load_copied(g_dir);
    float *want = ref_logits(mc);
    size_t n = mc ? (size_t)N_TOK * mf_model_config(mc)->vocab_size : 0;
    mf_model_free(mc);
    for (int k = 0; k < 2; k++) {
        evict(g_dir);
        mf_model_opts o = {.weights = MF_MODEL_WEIGHTS_MAPPED, .n_sockets = 2, .socket_node = {0, k ? 999 : 0}};
        mf_model *m = load_w(g_dir, o);
        if (!m) continue;
        int want_bound = can ? (k ? 1 : 2) : 0;
        CHECK(mf_model_n_bound(m) == want_bound, "sockets {0, %d}: %d bound, expected %d", k ? 999 : 0,
              mf_model_n_bound(m), want_bound);
        const mf_weight *sw[64];
        int nw = mf_model_split_weights(m, 0, sw, 64), seen[2] = {0, 0};
        for (int i = 0; i < nw; i++) {   /* the first and last rows of a split matrix: socket 0 and 1 */
            const mf_weight *x = sw[i];
            uint64_t row = mf_weight_data_bytes(x) / (uint64_t)x->rows;
            int64_t r0, r1;   /* socket 1's share, empty for a matrix of one row tile */
            mf_topo_rows(x->rows, 2, 1, &r0, &r1);
            int s0 = mf_model_socket_of(m, x->data), s1 = mf_model_socket_of(m, x->data + (x->rows - 1) * row);
            seen[0] += s0 == 0;
            seen[1] += s1 == (r1 > r0 ? 1 : 0);
        }
        CHECK(nw > 0 && seen[0] == nw && seen[1] == nw, "mapped split weights: %d of %d start on socket 0, %d end on their last share's",
              seen[0], nw, seen[1]);
        float *got = ref_logits(m);
        CHECK(same(want, got, n), "mapped with sockets: logits differ from copied");
        free(got);
        mf_model_free(m);
    }
    free(want);
}

int main(void)
{
    const char *tmp = getenv("MOEFLOW_TMP");
    snprintf(g_dir, sizeof g_dir, "%s/wmap_tiny", tmp ? tmp : "/tmp");
    snprintf(g_dir2, sizeof g_dir2, "%s/wmap_tiny2", tmp ? tmp : "/tmp");
    snprintf(g_odd, sizeof g_odd, "%s/wmap_odd", tmp ? tmp : "/tmp");
    if (gen(g_dir, 0) || gen(g_dir2, 7)) {
        fprintf(stderr, "gen: %s\n", mf_last_error());
        return 1;
    }
    test_cold_warm();
    test_killed_filler();
    test_changed_between_runs();
    test_truncated();
    test_fallback();
    test_unaligned();
    test_cards();
    test_sockets();
    return mf_check_exit("test_wmap");
}
