/* The prefix cache's disk tier (graphs/prefix/prefix_disk.c) on the tiny preset: blocks written,
 * the cache freed and opened again on the same directory (a restart: memory empty), the hit loaded
 * from disk with the bits of a run from scratch (memcmp, every position and a greedy continuation),
 * on io_uring and on pread workers; a truncated file, a flipped byte, an entry of another checkpoint
 * under this one's name, a full disk (ENOSPC injected through the IO lane's faults): each refused
 * or skipped with a message and the prompt served from scratch; a temporary file left by a crashed
 * writer never loads; the byte budget evicts; the key tells checkpoints and engines apart. */
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "graphs/model/model.h"
#include "tests/check.h"
#include "tests/prefix_run.h"
#include "tests/tiny_ckpt.h"

static char g_dir[1100];

/* The directory's entries (*.mfp) into names (up to 64), their count */
static int entries(char names[][64], int max)
{
    DIR *d = opendir(g_dir);
    int n = 0;
    struct dirent *de;
    while (d && (de = readdir(d)))
        if (strlen(de->d_name) == 36 && strstr(de->d_name, ".mfp") && n < max) snprintf(names[n++], 64, "%s", de->d_name);
    if (d) closedir(d);
    return n;
}

/* An entry's end position (the header's field after magic, key, name and parent: byte 56) */
static long long entry_end(const char *name)
{
    char path[1200];
    long long end = -1;
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    FILE *f = fopen(path, "rb");
    if (f && fseek(f, 56, SEEK_SET) == 0 && fread(&end, sizeof end, 1, f) != 1) end = -1;
    if (f) fclose(f);
    return end;
}

static const char *entry_at(char names[][64], int n, long long end)
{
    for (int i = 0; i < n; i++)
        if (entry_end(names[i]) == end) return names[i];
    return NULL;
}

static mf_prefix *open_cache(mf_ref *r, const uint8_t key[16], int pread, int fault, uint64_t disk_budget)
{
    mf_prefix *p = NULL;
    mf_prefix_opts o = {.ref = r, .block_tokens = 16, .budget_bytes = 32u << 20, .dir = g_dir,
                        .disk_budget_bytes = disk_budget, .io_force_pread = pread, .io_fault_kind = fault,
                        .io_fault_nth = fault ? 1 : 0};
    memcpy(o.key, key, 16);
    CHECK(mf_prefix_new(&o, &p) == 0, "open %s: %s", g_dir, mf_last_error());
    return p;
}

/* Runs f with stderr into a file; the text written into out */
static void capture(void (*f)(void *), void *arg, char *out, size_t n)
{
    char path[1200];
    snprintf(path, sizeof path, "%s.err", g_dir);
    fflush(stderr);
    int keep = dup(2), fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    f(arg);
    fflush(stderr);
    dup2(keep, 2);
    close(fd);
    close(keep);
    FILE *fh = fopen(path, "r");
    size_t k = fh ? fread(out, 1, n - 1, fh) : 0;
    out[k] = 0;
    if (fh) fclose(fh);
    fputs(out, stderr);
}

typedef struct cres {
    const eng *g;
    mf_prefix *p;
    const int32_t *P;
    int n, want, hit;
    const char *what;
} cres;

static void consume_cb(void *arg)
{
    cres *c = arg;
    c->hit = consume(c->g, c->p, c->P, c->n, c->want, c->what);
}

static void rm_dir(void)
{
    char cmd[1300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    CHECK(system(cmd) == 0, "rm");
}

/* A restart on each IO engine: write, free, open, hit from disk. */
static void test_restart(const eng *g, const uint8_t key[16], int pread)
{
    rm_dir();
    int32_t T[CTX], P[CTX];
    memcpy(T, A, sizeof T);
    mf_prefix *p = open_cache(g->r, key, pread, 0, 0);
    if (!p) return;
    produce(g, p, T, 100, 23, 0);   /* blocks 16..96 and a tail at 100 */
    mf_prefix_free(p);              /* waits for the writes */
    char names[64][64];
    int n = entries(names, 64);
    CHECK(n == 7, "%s: %d entries on disk (expected 6 blocks and a tail)", pread ? "pread" : "io_uring", n);
    p = open_cache(g->r, key, pread, 0, 0);
    if (!p) return;
    int h = consume(g, p, P, prompt(P, 100, 5, 1), 100, pread ? "restart (pread)" : "restart (io_uring)");
    mf_prefix_stats st;
    mf_prefix_get_stats(p, &st);
    CHECK(h == 100 && st.disk_loaded == 7 && st.disk_skipped == 0, "loaded %lld, skipped %lld", (long long)st.disk_loaded,
          (long long)st.disk_skipped);
    printf("%s: %d entries written, a restart hit %d positions from disk, the bits of scratch\n",
           pread ? "pread" : "io_uring", n, h);
    mf_prefix_free(p);
}

/* Damage one entry (the block ending at `end`) in one of three ways; after a restart the walk stops
 * before it with a message naming why. */
static void test_damage(const eng *g, const uint8_t key[16], const uint8_t other[16], int how)
{
    static const char *const kind[] = {"truncated", "payload checksum mismatch", "key mismatch"};
    static const char *const why[] = {"truncated", "payload checksum mismatch", "another checkpoint"};
    rm_dir();
    int32_t T[CTX], P[CTX];
    memcpy(T, A, sizeof T);
    mf_prefix *p = open_cache(g->r, key, 0, 0, 0);
    if (!p) return;
    produce(g, p, T, 70, 70, 0);
    mf_prefix_free(p);
    char names[64][64], path[1300], cmd[2800];
    int n = entries(names, 64);
    const char *victim = entry_at(names, n, 48);
    CHECK(victim != NULL, "no entry ends at 48");
    if (!victim) return;
    snprintf(path, sizeof path, "%.1100s/%.64s", g_dir, victim);
    if (how == 0) {
        CHECK(truncate(path, 4096) == 0, "truncate");
    } else if (how == 1) {
        FILE *f = fopen(path, "r+b");
        unsigned char ch = 0;
        CHECK(f && fseek(f, 300, SEEK_SET) == 0 && fread(&ch, 1, 1, f) == 1, "read");
        ch ^= 0x10;
        if (f && fseek(f, 300, SEEK_SET) == 0) fwrite(&ch, 1, 1, f);
        if (f) fclose(f);
    } else {   /* another checkpoint's entry for the same block put under this one's name */
        char sub[1100];
        snprintf(sub, sizeof sub, "%s", g_dir);
        snprintf(g_dir, sizeof g_dir, "%.1000s_other", sub);
        rm_dir();
        mf_prefix *q = open_cache(g->r, other, 0, 0, 0);
        memcpy(T, A, sizeof T);
        if (q) produce(g, q, T, 70, 70, 0);
        mf_prefix_free(q);
        char on[64][64];
        int m = entries(on, 64);
        const char *src = entry_at(on, m, 48);
        CHECK(src != NULL, "the other checkpoint's entry at 48");
        snprintf(cmd, sizeof cmd, "cp '%.1100s/%.64s' '%.1300s'", g_dir, src ? src : "x", path);
        snprintf(g_dir, sizeof g_dir, "%s", sub);
        CHECK(src && system(cmd) == 0, "%s", cmd);
    }
    p = open_cache(g->r, key, 0, 0, 0);
    if (!p) return;
    char err[4096];
    cres c = {g, p, P, prompt(P, 60, 4, 2), 32, 0, kind[how]};
    capture(consume_cb, &c, err, sizeof err);
    mf_prefix_stats st;
    mf_prefix_get_stats(p, &st);
    CHECK(c.hit == 32 && st.disk_skipped == 1 && strstr(err, "skipped disk entry") && strstr(err, why[how]),
          "%s: hit %d, %lld skipped, message '%s'", kind[how], c.hit, (long long)st.disk_skipped, err);
    printf("%s: skipped with a message, served from position 32, the bits of scratch\n", kind[how]);
    mf_prefix_free(p);
    /* the run from scratch wrote the block again: the next restart hits past it, nothing skipped */
    p = open_cache(g->r, key, 0, 0, 0);
    if (!p) return;
    int h = consume(g, p, P, prompt(P, 60, 4, 2), -1, "after the rewrite");
    mf_prefix_get_stats(p, &st);
    CHECK(h >= 48 && st.disk_skipped == 0, "%s: after the rewrite: hit %d, %lld skipped", kind[how], h,
          (long long)st.disk_skipped);
    mf_prefix_free(p);
}

/* A full disk: the first write fails with ENOSPC through the lane's fault injection */
static void produce_cb(void *arg)
{
    cres *c = arg;
    int32_t T[CTX];
    memcpy(T, A, sizeof T);
    produce(c->g, c->p, T, c->n, 16, 0);
    mf_prefix_free(c->p);
}

static void test_enospc(const eng *g, const uint8_t key[16])
{
    rm_dir();
    mf_prefix *p = open_cache(g->r, key, 0, MF_IO_FAULT_ENOSPC, 0);
    if (!p) return;
    char err[4096];
    cres c = {g, p, NULL, 50, 0, 0, "enospc"};
    capture(produce_cb, &c, err, sizeof err);
    char names[64][64];
    int n = entries(names, 64);
    CHECK(strstr(err, "not written") && strstr(err, "No space left") && n == 3,
          "ENOSPC: %d entries (expected 3 of 4), message '%s'", n, err);
    p = open_cache(g->r, key, 0, 0, 0);
    int32_t P[CTX];
    if (p) {
        int h = consume(g, p, P, prompt(P, 50, 3, 3), -1, "after ENOSPC");
        CHECK(h == 0, "the first block was not written: hit %d (expected 0)", h);
    }
    mf_prefix_free(p);
    printf("ENOSPC: refused with a message, the other blocks written, served from scratch\n");
}

/* A writer's temporary file left by a crash never loads and is removed; the budget evicts */
static void test_crash_budget(const eng *g, const uint8_t key[16])
{
    rm_dir();
    mkdir(g_dir, 0755);
    char path[1300];
    snprintf(path, sizeof path, "%s/.tmp-2147483000-00112233445566778899aabbccddeeff.mfp", g_dir);
    FILE *f = fopen(path, "w");
    if (f) fclose(f);
    int32_t T[CTX], P[CTX];
    mf_prefix *p = open_cache(g->r, key, 0, 0, 3 * 40960);
    CHECK(access(path, F_OK) != 0, "a crashed writer's temporary file removed");
    memcpy(T, A, sizeof T);
    if (p) produce(g, p, T, 200, 64, 0);
    mf_prefix_free(p);
    mf_prefix_stats st;
    p = open_cache(g->r, key, 0, 0, 3 * 40960);
    if (p) mf_prefix_get_stats(p, &st);
    CHECK(p && st.disk_bytes <= 3 * 40960 && st.disk_files >= 1, "disk budget: %lld bytes in %lld files",
          p ? (long long)st.disk_bytes : -1LL, p ? (long long)st.disk_files : -1LL);
    if (p) consume(g, p, P, prompt(P, 150, 3, 4), -1, "after evictions");
    mf_prefix_free(p);
}

int main(void)
{
    mf_config c;
    char dir[1024], dir2[1100];
    CHECK(mf_config_preset("tiny", &c) == 0, "preset");
    if (mf_test_gen_ckpt(&c, "prefix_disk_tiny", dir, sizeof dir)) return 1;
    mf_model *m;
    mf_ref *r;
    mf_step *e;
    if (mf_test_open(dir, 0, &m, &r, &e)) return 1;
    V = c.vocab_size;
    for (int i = 0; i < CTX; i++) A[i] = (int32_t)((i * 37 + (i * i) % 11 + 1) % V);
    /* keys: the same checkpoint and engine agree; another engine, another checkpoint differ */
    uint8_t k1[16], k2[16], k3[16], k4[16];
    CHECK(mf_prefix_key(r, "scheduled-int8", k1) == 0 && mf_prefix_key(r, "scheduled-int8", k2) == 0 &&
          mf_prefix_key(r, "reference", k3) == 0, "key: %s", mf_last_error());
    CHECK(!memcmp(k1, k2, 16) && memcmp(k1, k3, 16), "keys of one checkpoint: same engine equal, others differ");
    mf_gen_opts go;
    mf_gen_preset_opts("tiny", &go);
    go.force = go.quiet = 1;
    go.seed = 7;
    snprintf(dir2, sizeof dir2, "%s_seed7", dir);
    mf_model *m2 = NULL;
    mf_ref *r2 = NULL;
    CHECK(mf_gen_write(&c, dir2, &go) == 0 && mf_model_load(dir2, &(mf_model_opts){.quiet = 1}, &m2) == 0 &&
          mf_ref_new(m2, NULL, &r2) == 0 && mf_prefix_key(r2, "scheduled-int8", k4) == 0, "seed 7: %s", mf_last_error());
    CHECK(memcmp(k1, k4, 16), "another checkpoint of the same config (seed 7) has another key");
    const char *tmp = getenv("MOEFLOW_TMP");
    snprintf(g_dir, sizeof g_dir, "%s/prefix_disk_cache", tmp ? tmp : "/tmp");
    eng g = {"scheduled", r, e};
    test_restart(&g, k1, 0);
    test_restart(&g, k1, 1);
    for (int how = 0; how < 3; how++) test_damage(&g, k1, k4, how);
    test_enospc(&g, k1);
    test_crash_budget(&g, k1);
    mf_ref_free(r2);
    mf_model_free(m2);
    mf_step_free(e);
    mf_ref_free(r);
    mf_model_free(m);
    return mf_check_exit("test_prefix_disk");
}
