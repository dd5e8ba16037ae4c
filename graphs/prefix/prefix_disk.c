/* The prefix cache's disk tier (graphs/prefix/prefix.h): one file per block (or tail) named by its
 * prefix (the 128-bit name of the key, the block size and the token ids up to its end), written by
 * a thread of its own through an IO lane (io_uring, O_DIRECT where the filesystem allows it) to a
 * temporary name and renamed once complete, so a crash mid-write leaves no entry that loads. A load
 * reads the whole file through the same lane and checks it (size, header, checksum, key, name,
 * tokens) before a node is built from it; a corrupt or foreign file is skipped with a warning and
 * removed. Files are evicted least recently used first past the byte budget; an index of the
 * directory (names, sizes, last use) is kept in memory.
 * File: header (mf_pfx_fhdr), then the token ids, each KV source's entries of the block (packed as
 * the pages hold them, graphs/layers/layers.h mf_ly_cache_save), the window rows, the open group (an
 * odd end), zero padding to a multiple of 4096 bytes. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "graphs/prefix/prefix_impl.h"
#include "host/dio.h"
#include "sched/error.h"
#include "sched/graph.h"
#include "sched/sched.h"

#define MF_PFX_MAGIC "MFPFX\0v1"
#define MF_PFX_ALIGN 4096
#define MF_PFX_QUEUE 64            /* writes waiting; more are dropped (counted as failed) */
#define MF_PFX_MAX_FILE (1LL << 31)

typedef struct mf_pfx_fhdr {
    char magic[8];
    uint8_t key[16];        /* mf_prefix_opts.key */
    uint8_t name[16];       /* the node's hkey */
    uint8_t parent[16];     /* its parent's */
    int64_t end;
    int32_t len, block, n_rows, n_src, n_r2, head_dim;
    int64_t rowset, payload_bytes;
    uint8_t payload_sum[16];
    uint8_t hdr_sum[16];    /* of the header with this field zero */
} mf_pfx_fhdr;

typedef struct mf_pfx_dent {
    uint8_t key[16];
    int64_t bytes;
    uint64_t use;           /* last use (0: empty slot) */
} mf_pfx_dent;

typedef struct mf_pfx_job {
    uint8_t key[16];
    uint8_t *buf;
    int64_t bytes;
} mf_pfx_job;

struct mf_pfx_disk {
    mf_prefix *p;
    mf_sched *s;
    mf_lane_desc lane;
    pthread_mutex_t run_mu;   /* one IO run at a time (loads on the stepping thread, writes on the writer) */
    pthread_mutex_t mu;       /* the index, the queue, the stats */
    pthread_cond_t cv;
    mf_pfx_dent *ent;         /* open addressing on the name's first 8 bytes */
    int64_t cap, n, bytes, budget;
    uint64_t clock;
    mf_pfx_job q[MF_PFX_QUEUE];
    int q_head, q_n, busy, stop;
    pthread_t thr;
    int64_t loaded, written, evicted, skipped, failed;
};

/* ---- the index ------------------------------------------------------------------------------- */

static uint64_t mf_pfx_k8(const uint8_t k[16])
{
    uint64_t v;
    memcpy(&v, k, 8);
    return v;
}

static mf_pfx_dent *mf_pfx_find(mf_pfx_disk *d, const uint8_t key[16], int add)
{
    if (add && (d->n + 1) * 10 > d->cap * 7) {   /* grow past 70% full */
        int64_t cap = d->cap ? d->cap * 2 : 1024;
        mf_pfx_dent *t = calloc((size_t)cap, sizeof *t), *old = d->ent;
        if (!t) return NULL;
        for (int64_t i = 0; i < d->cap; i++)
            if (old[i].use) {
                int64_t j = (int64_t)(mf_pfx_k8(old[i].key) % (uint64_t)cap);
                while (t[j].use) j = (j + 1) % cap;
                t[j] = old[i];
            }
        free(old);
        d->ent = t;
        d->cap = cap;
    }
    if (!d->cap) return NULL;
    for (int64_t j = (int64_t)(mf_pfx_k8(key) % (uint64_t)d->cap);; j = (j + 1) % d->cap) {
        if (!d->ent[j].use) {
            if (!add) return NULL;
            memcpy(d->ent[j].key, key, 16);
            d->n++;
            return &d->ent[j];
        }
        if (!memcmp(d->ent[j].key, key, 16)) return &d->ent[j];
    }
}

/* Removes e (backward-shift deletion keeps every probe chain whole) */
static void mf_pfx_unindex(mf_pfx_disk *d, mf_pfx_dent *e)
{
    int64_t i = e - d->ent;
    d->bytes -= e->bytes;
    d->n--;
    for (int64_t j = (i + 1) % d->cap; d->ent[j].use; j = (j + 1) % d->cap) {
        int64_t h = (int64_t)(mf_pfx_k8(d->ent[j].key) % (uint64_t)d->cap);
        if ((j > i && (h <= i || h > j)) || (j < i && h <= i && h > j)) {
            d->ent[i] = d->ent[j];
            i = j;
        }
    }
    d->ent[i].use = 0;
}

static void mf_pfx_fname(const mf_pfx_disk *d, const uint8_t key[16], char *out, size_t n)
{
    int k = snprintf(out, n, "%s/", d->p->o.dir);
    for (int i = 0; i < 16 && k + 2 < (int)n; i++) k += snprintf(out + k, n - (size_t)k, "%02x", key[i]);
    snprintf(out + k, n - (size_t)k, ".mfp");
}

/* Evicts the least recently used files until `more` bytes fit the budget (d->mu held). */
static void mf_pfx_make_room(mf_pfx_disk *d, int64_t more)
{
    while (d->n && d->bytes + more > d->budget) {
        mf_pfx_dent *v = NULL;
        for (int64_t i = 0; i < d->cap; i++)
            if (d->ent[i].use && (!v || d->ent[i].use < v->use)) v = &d->ent[i];
        char path[4200];
        mf_pfx_fname(d, v->key, path, sizeof path);
        unlink(path);
        mf_pfx_unindex(d, v);
        d->evicted++;
    }
}

/* ---- the IO lane ----------------------------------------------------------------------------- */

/* One read or write of the whole buffer through the lane. 0 or the lane's negative code. */
static int mf_pfx_io(mf_pfx_disk *d, int fd, uint32_t align, uint8_t *buf, int64_t bytes, int write)
{
    mf_io_read r = {.fd = fd, .offset = 0, .buf = buf, .n_bytes = (uint64_t)bytes, .dio_align = align, .write = write};
    mf_graph *g = NULL;
    int rc = mf_graph_create(&d->lane, 1, &g);
    if (!rc && mf_graph_add_task(g, &(mf_task_desc){.name = write ? "prefix write" : "prefix read", .lane = 0,
                                                     .arg = &r, .place_hint = -1}) < 0)
        rc = -EINVAL;
    if (!rc) rc = mf_graph_finalize(g);
    if (!rc) {
        pthread_mutex_lock(&d->run_mu);
        rc = mf_sched_run(d->s, g, &(mf_run_opts){0});
        pthread_mutex_unlock(&d->run_mu);
    }
    mf_graph_destroy(g);
    return rc;
}

/* ---- writing --------------------------------------------------------------------------------- */

static int64_t mf_pfx_payload_bytes(const mf_prefix *p, const mf_pfx_node *x)
{
    int64_t b = x->len * 4 + x->n_rows * p->rowset, start = x->end - x->len;
    for (int i = 0; i < p->n_src; i++) {
        int r = p->c->compress_ratios[p->src[i]];
        b += (x->end / r - start / r) * mf_ly_cache_entry_bytes(p->c);
    }
    return b + (x->end % 2 && p->n_r2 ? (int64_t)sizeof(float) * 2 * p->n_r2 * p->c->head_dim : 0);
}

static void mf_pfx_hdr_sum(const mf_pfx_fhdr *h, uint8_t out[16])
{
    mf_pfx_fhdr t = *h;
    memset(t.hdr_sum, 0, sizeof t.hdr_sum);
    uint8_t z[16] = {0};
    mf_pfx_hash_bytes(z, &t, sizeof t, out);
}

void mf_pfx_disk_write(mf_prefix *p, const mf_pfx_node *x)
{
    mf_pfx_disk *d = p->disk;
    int64_t pay = mf_pfx_payload_bytes(p, x), bytes = (int64_t)sizeof(mf_pfx_fhdr) + pay;
    bytes = (bytes + MF_PFX_ALIGN - 1) / MF_PFX_ALIGN * MF_PFX_ALIGN;
    pthread_mutex_lock(&d->mu);
    int have = mf_pfx_find(d, x->hkey, 0) != NULL, full = d->q_n == MF_PFX_QUEUE;
    for (int i = 0; i < d->q_n && !have; i++) have = !memcmp(d->q[(d->q_head + i) % MF_PFX_QUEUE].key, x->hkey, 16);
    if (full && !have) d->failed++;
    pthread_mutex_unlock(&d->mu);
    uint8_t *buf = NULL;
    if (have || full || bytes > MF_PFX_MAX_FILE || posix_memalign((void **)&buf, MF_PFX_ALIGN, (size_t)bytes)) return;
    memset(buf, 0, (size_t)bytes);
    mf_pfx_fhdr *h = (mf_pfx_fhdr *)buf;
    *h = (mf_pfx_fhdr){.end = x->end, .len = x->len, .block = p->B, .n_rows = x->n_rows, .n_src = p->n_src,
                       .n_r2 = p->n_r2, .head_dim = p->c->head_dim, .rowset = p->rowset, .payload_bytes = pay};
    memcpy(h->magic, MF_PFX_MAGIC, 8);
    memcpy(h->key, p->o.key, 16);
    memcpy(h->name, x->hkey, 16);
    memcpy(h->parent, x->parent->hkey, 16);
    uint8_t *o = buf + sizeof *h;
    memcpy(o, x->toks, (size_t)x->len * 4);
    o += x->len * 4;
    int64_t start = x->end - x->len, pi = (x->end - 1) / MF_LY_PAGE_POSITIONS;
    for (int i = 0; i < p->n_src; i++) {
        int L = p->src[i], r = p->c->compress_ratios[L];
        int64_t j0 = start / r, n = x->end / r - j0;
        mf_ly_cache_save(p->c, L, x->page[i], j0 - pi * mf_ly_cache_page_entries(p->c, L), n, o);
        o += n * mf_ly_cache_entry_bytes(p->c);
    }
    memcpy(o, x->rows, (size_t)(x->n_rows * p->rowset));
    o += x->n_rows * p->rowset;
    if (x->end % 2 && p->n_r2) memcpy(o, x->pend, sizeof(float) * 2 * (size_t)(p->n_r2 * p->c->head_dim));
    uint8_t z[16] = {0};
    mf_pfx_hash_bytes(z, buf + sizeof *h, pay, h->payload_sum);
    mf_pfx_hdr_sum(h, h->hdr_sum);
    pthread_mutex_lock(&d->mu);
    mf_pfx_job *j = &d->q[(d->q_head + d->q_n++) % MF_PFX_QUEUE];
    memcpy(j->key, x->hkey, 16);
    j->buf = buf;
    j->bytes = bytes;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
}

/* Writes one job: a temporary file through the lane, flushed, then renamed to its name. */
static int mf_pfx_write_file(mf_pfx_disk *d, const mf_pfx_job *j)
{
    char path[4200], tmp[4300];
    mf_pfx_fname(d, j->key, path, sizeof path);
    snprintf(tmp, sizeof tmp, "%s/.tmp-%ld-%s", d->p->o.dir, (long)getpid(), strrchr(path, '/') + 1);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
    uint32_t align = 0;
    if (fd >= 0) align = mf_dio_align_of(fd);
    if (fd >= 0 && (align > MF_PFX_ALIGN || !align)) {   /* O_DIRECT this file cannot take: buffered */
        close(fd);
        fd = -1;
    }
    if (fd < 0) {
        fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        align = 0;
    }
    if (fd < 0) return mf_error(-errno, "prefix cache: cannot create %s: %s", tmp, strerror(errno));
    int rc = mf_pfx_io(d, fd, align, j->buf, j->bytes, 1);
    if (!rc && fdatasync(fd)) rc = mf_error(-errno, "prefix cache: fdatasync %s: %s", tmp, strerror(errno));
    close(fd);
    if (!rc && rename(tmp, path)) rc = mf_error(-errno, "prefix cache: rename %s: %s", tmp, strerror(errno));
    if (rc) unlink(tmp);
    return rc;
}

static void *mf_pfx_writer(void *arg)
{
    mf_pfx_disk *d = arg;
    pthread_mutex_lock(&d->mu);
    for (;;) {
        while (!d->q_n && !d->stop) pthread_cond_wait(&d->cv, &d->mu);
        if (!d->q_n) break;
        mf_pfx_job j = d->q[d->q_head];
        d->busy = 1;
        mf_pfx_make_room(d, j.bytes);
        pthread_mutex_unlock(&d->mu);
        int rc = mf_pfx_write_file(d, &j);
        if (rc && !d->p->o.quiet) fprintf(stderr, "moeflow: prefix cache: a block not written to disk: %s\n", mf_last_error());
        pthread_mutex_lock(&d->mu);
        d->q_head = (d->q_head + 1) % MF_PFX_QUEUE;
        d->q_n--;
        d->busy = 0;
        mf_pfx_dent *e = rc ? NULL : mf_pfx_find(d, j.key, 1);
        if (e) {
            d->bytes += j.bytes - e->bytes;
            e->bytes = j.bytes;
            e->use = ++d->clock;
            d->written++;
        } else {
            d->failed++;
        }
        free(j.buf);
        pthread_cond_broadcast(&d->cv);
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

/* ---- loading --------------------------------------------------------------------------------- */

int mf_pfx_disk_has(mf_pfx_disk *d, const uint8_t key[16])
{
    pthread_mutex_lock(&d->mu);
    int has = mf_pfx_find(d, key, 0) != NULL;
    pthread_mutex_unlock(&d->mu);
    return has;
}

/* Checks a file's bytes against what the block under parent must be; NULL, or why not */
static const char *mf_pfx_check(const mf_prefix *p, const uint8_t *buf, int64_t n, const mf_pfx_node *parent,
                                const int32_t *toks, int len, const uint8_t key[16])
{
    const mf_pfx_fhdr *h = (const mf_pfx_fhdr *)buf;
    uint8_t sum[16], z[16] = {0};
    if (n < (int64_t)sizeof *h || memcmp(h->magic, MF_PFX_MAGIC, 8)) return "not a prefix cache entry (magic)";
    mf_pfx_hdr_sum(h, sum);
    if (memcmp(sum, h->hdr_sum, 16)) return "header checksum mismatch";
    if (memcmp(h->key, p->o.key, 16)) return "written for another checkpoint or engine (key mismatch)";
    if (memcmp(h->name, key, 16) || memcmp(h->parent, parent->hkey, 16)) return "another prefix (name mismatch)";
    if (h->block != p->B || h->len != len || h->end != parent->end + len || h->n_src != p->n_src ||
        h->n_r2 != p->n_r2 || h->head_dim != p->c->head_dim || h->rowset != p->rowset ||
        h->n_rows != (len < p->W ? len : p->W))
        return "layout mismatch";
    if (h->payload_bytes < 0 || (int64_t)sizeof *h + h->payload_bytes > n) return "truncated";
    mf_pfx_node fake = {.end = h->end, .len = len, .n_rows = h->n_rows};
    if (mf_pfx_payload_bytes(p, &fake) != h->payload_bytes) return "size mismatch";
    mf_pfx_hash_bytes(z, buf + sizeof *h, h->payload_bytes, sum);
    if (memcmp(sum, h->payload_sum, 16)) return "payload checksum mismatch";
    if (memcmp(buf + sizeof *h, toks, (size_t)len * 4)) return "other tokens";
    return NULL;
}

/* The node a checked file describes: its pages built (a block that starts inside a page copies its
 * parent's page first: copy on write). NULL when out of memory. */
static mf_pfx_node *mf_pfx_build(mf_prefix *p, const uint8_t *buf, mf_pfx_node *parent, int len)
{
    const mf_pfx_fhdr *h = (const mf_pfx_fhdr *)buf;
    mf_pfx_node *x = mf_pfx_node_new(p, len, h->n_rows);
    if (!x) return NULL;
    x->end = h->end;
    memcpy(x->hkey, h->name, 16);
    const uint8_t *in = buf + sizeof *h;
    memcpy(x->toks, in, (size_t)len * 4);
    in += len * 4;
    int64_t start = x->end - len, pi = (x->end - 1) / MF_LY_PAGE_POSITIONS;
    for (int i = 0; i < p->n_src; i++) {
        int L = p->src[i], r = p->c->compress_ratios[L];
        int64_t pb = mf_ly_cache_page_bytes(p->c, L), j0 = start / r, n = x->end / r - j0;
        if (!(x->page[i] = mf_ref_page_new(pb))) {
            mf_pfx_node_free(p, x);
            return NULL;
        }
        if (start % MF_LY_PAGE_POSITIONS) memcpy(x->page[i], parent->page[i], (size_t)pb);
        mf_ly_cache_load(p->c, L, x->page[i], j0 - pi * mf_ly_cache_page_entries(p->c, L), n, in);
        in += n * mf_ly_cache_entry_bytes(p->c);
    }
    memcpy(x->rows, in, (size_t)(x->n_rows * p->rowset));
    in += x->n_rows * p->rowset;
    if (x->end % 2 && p->n_r2) {
        size_t pb = sizeof(float) * 2 * (size_t)(p->n_r2 * p->c->head_dim);
        if (!(x->pend = malloc(pb))) {
            mf_pfx_node_free(p, x);
            return NULL;
        }
        memcpy(x->pend, in, pb);
        x->bytes += (int64_t)pb;
    }
    return x;
}

mf_pfx_node *mf_pfx_disk_load(mf_prefix *p, mf_pfx_node *parent, const int32_t *toks, int len)
{
    mf_pfx_disk *d = p->disk;
    uint8_t key[16];
    mf_pfx_hash(parent->hkey, toks, len, key);
    pthread_mutex_lock(&d->mu);
    mf_pfx_dent *e = mf_pfx_find(d, key, 0);
    int64_t bytes = e ? e->bytes : 0;
    pthread_mutex_unlock(&d->mu);
    if (!e) return NULL;
    char path[4200];
    mf_pfx_fname(d, key, path, sizeof path);
    mf_dio_file f = {.fd = -1};
    uint8_t *buf = NULL;
    const char *why = NULL;
    int rc = mf_dio_open(path, 1, &f);
    if (rc == -ENOENT) return NULL;   /* evicted since (the writer makes room) */
    if (!rc && (f.size_bytes != (uint64_t)bytes || f.size_bytes > MF_PFX_MAX_FILE)) why = "truncated or grown (size)";
    if (!rc && !why && posix_memalign((void **)&buf, MF_PFX_ALIGN, (size_t)bytes)) buf = NULL;
    if (!rc && !why && buf) rc = mf_pfx_io(d, f.fd, f.dio_align, buf, bytes, 0);
    if (!rc && !why && buf) why = mf_pfx_check(p, buf, bytes, parent, toks, len, key);
    if (!rc && !why && buf) futimens(f.fd, NULL);   /* its last use, for the next start's order */
    if (f.fd >= 0) mf_dio_close(&f);
    mf_pfx_node *x = !rc && !why && buf ? mf_pfx_build(p, buf, parent, len) : NULL;
    free(buf);
    pthread_mutex_lock(&d->mu);
    if ((e = mf_pfx_find(d, key, 0))) {
        if (x) {
            e->use = ++d->clock;
            d->loaded++;
        } else if (rc || why) {   /* never used again: skipped, removed */
            d->skipped++;
            mf_pfx_unindex(d, e);
            unlink(path);
        }
    }
    pthread_mutex_unlock(&d->mu);
    if ((rc || why) && !p->o.quiet)
        fprintf(stderr, "moeflow: prefix cache: skipped disk entry %s: %s\n", path, why ? why : mf_last_error());
    return x;
}

/* ---- the directory --------------------------------------------------------------------------- */

/* Indexes dir's entries (by last modification) and removes temporary files of processes gone */
static int mf_pfx_scan(mf_pfx_disk *d)
{
    const char *dir = d->p->o.dir;
    if (mkdir(dir, 0755) && errno != EEXIST)
        return mf_error(-errno, "prefix cache: cannot create directory %s: %s", dir, strerror(errno));
    DIR *dh = opendir(dir);
    if (!dh) return mf_error(-errno, "prefix cache: cannot read directory %s: %s", dir, strerror(errno));
    struct dirent *de;
    while ((de = readdir(dh))) {
        char path[4200];
        struct stat sb;
        long pid = 0;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        if (sscanf(de->d_name, ".tmp-%ld-", &pid) == 1) {
            if (pid != getpid() && kill((pid_t)pid, 0) && errno == ESRCH) unlink(path);
            continue;
        }
        uint8_t key[16];
        int ok = strlen(de->d_name) == 36 && !strcmp(de->d_name + 32, ".mfp") && !stat(path, &sb);
        for (int i = 0; ok && i < 16; i++) {
            unsigned v;
            ok = sscanf(de->d_name + 2 * i, "%2x", &v) == 1;
            key[i] = (uint8_t)v;
        }
        mf_pfx_dent *e = ok ? mf_pfx_find(d, key, 1) : NULL;
        if (!e) continue;
        e->bytes = sb.st_size;
        e->use = (uint64_t)sb.st_mtim.tv_sec * 1000000000u + (uint64_t)sb.st_mtim.tv_nsec;
        d->bytes += e->bytes;
        if (e->use > d->clock) d->clock = e->use;
    }
    closedir(dh);
    mf_pfx_make_room(d, 0);
    return 0;
}

int mf_pfx_disk_open(mf_prefix *p, mf_pfx_disk **out)
{
    *out = NULL;
    mf_pfx_disk *d = calloc(1, sizeof *d);
    if (!d) return mf_error(-ENOMEM, "prefix cache: out of memory");
    d->p = p;
    d->budget = (int64_t)(p->o.disk_budget_bytes ? p->o.disk_budget_bytes : 4 * p->o.budget_bytes);
    d->lane = (mf_lane_desc){.kind = MF_LANE_IO, .name = "prefix-io", .concurrency = 4, .numa_node = -1};
    pthread_mutex_init(&d->run_mu, NULL);
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->cv, NULL);
    p->disk = d;
    int rc = mf_pfx_scan(d);
    if (!rc)
        rc = mf_sched_create(&(mf_sched_opts){.lanes = &d->lane, .n_lanes = 1, .io_force_pread = p->o.io_force_pread,
                                              .io_fault_kind = p->o.io_fault_kind, .io_fault_nth = p->o.io_fault_nth},
                             &d->s);
    if (!rc && pthread_create(&d->thr, NULL, mf_pfx_writer, d)) rc = mf_error(-EAGAIN, "prefix cache: cannot start its writer");
    if (rc) {
        if (d->s) mf_sched_destroy(d->s);
        free(d->ent);
        free(d);
        p->disk = NULL;
        return rc;
    }
    *out = d;
    return 0;
}

void mf_pfx_disk_close(mf_pfx_disk *d)
{
    if (!d) return;
    pthread_mutex_lock(&d->mu);
    d->stop = 1;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    pthread_join(d->thr, NULL);
    mf_sched_destroy(d->s);
    pthread_mutex_destroy(&d->run_mu);
    pthread_mutex_destroy(&d->mu);
    pthread_cond_destroy(&d->cv);
    free(d->ent);
    free(d);
}

void mf_pfx_disk_stats(mf_pfx_disk *d, mf_prefix_stats *st)
{
    pthread_mutex_lock(&d->mu);
    st->disk_files = d->n;
    st->disk_bytes = d->bytes;
    st->disk_budget_bytes = d->budget;
    st->disk_loaded = d->loaded;
    st->disk_written = d->written;
    st->disk_evicted = d->evicted;
    st->disk_skipped = d->skipped;
    st->disk_failed = d->failed;
    pthread_mutex_unlock(&d->mu);
}
