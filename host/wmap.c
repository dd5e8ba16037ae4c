/* Weights mapped from the page cache (host/wmap.h): the reservation of the shards' mappings, the
 * fill that faults ranges in on a few threads (each socket's by threads bound to its node), the
 * residency checks (mincore) and the page-cache facts `moeflow info --resident` prints. */
#define _GNU_SOURCE
#include "host/wmap.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/mempolicy.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "host/dio.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "sched/progress.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

#define MF_WMAP_ALIGN (UINT64_C(2) << 20)    /* shards start on 2 MiB: PMD-mappable folios */
#define MF_WMAP_CHUNK (UINT64_C(32) << 20)   /* bytes one fill job faults in */

struct mf_wmap {
    const mf_st *st;
    uint8_t *base;
    uint64_t bytes, copy_off, copy_bytes;
    int n_shards;
    uint64_t *shard_off, *shard_bytes;
    char (*path)[4096];
};

static uint64_t mf_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

uint8_t *mf_wmap_base(const mf_wmap *w) { return w->base; }
uint64_t mf_wmap_bytes(const mf_wmap *w) { return w->bytes; }
uint64_t mf_wmap_shard_off(const mf_wmap *w, int shard) { return w->shard_off[shard]; }
uint64_t mf_wmap_copy_off(const mf_wmap *w) { return w->copy_off; }
uint64_t mf_wmap_tensor_off(const mf_wmap *w, const mf_st_tensor *t)
{
    return w->shard_off[t->shard] + t->file_offset;
}

void mf_wmap_close(mf_wmap *w)
{
    if (!w) return;
    if (w->base) munmap(w->base, w->bytes);
    free(w->shard_off);
    free(w->shard_bytes);
    free(w->path);
    free(w);
}

/* The reservation: PROT_NONE address space of n bytes on a 2 MiB boundary. */
static uint8_t *mf_wmap_reserve(uint64_t n)
{
    uint8_t *p = mmap(NULL, n + MF_WMAP_ALIGN, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return NULL;
    uint8_t *a = (uint8_t *)(((uintptr_t)p + MF_WMAP_ALIGN - 1) & ~(uintptr_t)(MF_WMAP_ALIGN - 1));
    if (a > p) munmap(p, (size_t)(a - p));
    if (a + n < p + n + MF_WMAP_ALIGN) munmap(a + n, (size_t)(p + n + MF_WMAP_ALIGN - (a + n)));
    return a;
}

int mf_wmap_open(const mf_st *st, uint64_t copy_bytes, mf_wmap **out)
{
    *out = NULL;
    mf_wmap *w = calloc(1, sizeof *w);
    int n = mf_st_n_shards(st);
    if (w) {
        w->shard_off = calloc((size_t)n + 1, sizeof *w->shard_off);
        w->shard_bytes = calloc((size_t)n + 1, sizeof *w->shard_bytes);
        w->path = calloc((size_t)n + 1, sizeof *w->path);
    }
    if (!w || !w->shard_off || !w->shard_bytes || !w->path) {
        mf_wmap_close(w);
        return mf_error(-ENOMEM, "weights mapping: out of memory for %d shards", n);
    }
    w->st = st;
    w->n_shards = n;
    uint64_t pos = 0;
    for (int s = 0; s < n; s++) {
        struct stat sb;
        const char *path = mf_st_shard_path(st, s);
        snprintf(w->path[s], sizeof w->path[s], "%s", path);
        if (fstat(mf_st_shard_fd(st, s), &sb)) {
            int e = errno;
            mf_wmap_close(w);
            return mf_error(-e, "%s: cannot stat: %s", path, strerror(e));
        }
        if ((uint64_t)sb.st_size != mf_st_shard_bytes(st, s)) {
            mf_wmap_close(w);
            return mf_error(-ESTALE, "%s: %" PRIu64 " bytes now, %" PRIu64 " when its header was read: "
                            "changed while opening", path, (uint64_t)sb.st_size, mf_st_shard_bytes(st, s));
        }
        w->shard_off[s] = pos;
        w->shard_bytes[s] = (uint64_t)sb.st_size;
        pos = mf_up(pos + w->shard_bytes[s], MF_WMAP_ALIGN);
    }
    w->copy_off = pos;
    w->copy_bytes = copy_bytes;
    w->bytes = pos + mf_up(copy_bytes, MF_WMAP_ALIGN);
    if (!w->bytes) w->bytes = MF_WMAP_ALIGN;
    if (!(w->base = mf_wmap_reserve(w->bytes))) {
        int e = errno;
        mf_wmap_close(w);
        return mf_error(-ENOMEM, "weights mapping: cannot reserve %" PRIu64 " bytes of address space: %s",
                        pos, strerror(e));
    }
    for (int s = 0; s < n; s++) {
        if (!w->shard_bytes[s]) continue;
        void *p = mmap(w->base + w->shard_off[s], (size_t)w->shard_bytes[s], PROT_READ, MAP_SHARED | MAP_FIXED,
                       mf_st_shard_fd(st, s), 0);
        if (p == MAP_FAILED) {
            int e = errno;
            mf_wmap_close(w);
            return mf_error(-e, "%s: cannot map %" PRIu64 " bytes read-only: %s", mf_st_shard_path(st, s),
                            w->shard_bytes[s], strerror(e));
        }
    }
    if (copy_bytes &&
        mmap(w->base + w->copy_off, (size_t)(w->bytes - w->copy_off), PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) == MAP_FAILED) {
        int e = errno;
        mf_wmap_close(w);
        return mf_error(-e, "weights mapping: cannot map %" PRIu64 " private bytes: %s", copy_bytes, strerror(e));
    }
    (void)madvise(w->base, (size_t)w->bytes, MADV_HUGEPAGE);   /* advice only */
    *out = w;
    return 0;
}

/* ---- residency --------------------------------------------------------------------------------- */

/* The cachestat(2) of Linux 6.5: pages of a file range the page cache holds, without mapping them
 * (counted per folio: fast on hundreds of GiB). -1 where the kernel lacks it. */
#ifndef SYS_cachestat
#define SYS_cachestat 451
#endif
struct mf_cachestat_range { uint64_t off, len; };
struct mf_cachestat { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; };

static int64_t mf_wmap_cachestat(int fd, uint64_t off, uint64_t len)
{
    struct mf_cachestat_range r = {off, len};
    struct mf_cachestat cs;
    if (syscall(SYS_cachestat, fd, &r, &cs, 0)) return -1;
    return (int64_t)(cs.nr_cache * (uint64_t)sysconf(_SC_PAGESIZE));
}

/* Bytes of the page-aligned [p, p + n) that the page cache holds (mincore in pieces of 1 GiB). */
static uint64_t mf_wmap_mincore(uint8_t *p, uint64_t n)
{
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE), got = 0, piece = UINT64_C(1) << 30;
    unsigned char *v = malloc((size_t)(piece / pg));
    if (!v) return 0;
    for (uint64_t o = 0; o < n; o += piece) {
        uint64_t len = n - o < piece ? n - o : piece, np = (len + pg - 1) / pg;
        if (mincore(p + o, (size_t)len, v)) continue;
        for (uint64_t i = 0; i < np; i++) got += (v[i] & 1) ? pg : 0;
    }
    free(v);
    return got;
}

/* Which shard holds reservation offset off (the last one starting at or before it). */
static int mf_wmap_shard_at(const mf_wmap *w, uint64_t off)
{
    int s = 0;
    while (s + 1 < w->n_shards && w->shard_off[s + 1] <= off) s++;
    return s;
}

uint64_t mf_wmap_cached(const mf_wmap *w, uint64_t off, uint64_t n_bytes)
{
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE), a = off / pg * pg, b = mf_up(off + n_bytes, pg), got = 0;
    if (b > w->bytes) b = w->bytes;
    while (a < b) {   /* shard by shard: cachestat, else mincore; nothing in the gaps */
        if (a >= w->copy_off) {   /* the private tail */
            got += mf_wmap_mincore(w->base + a, b - a);
            break;
        }
        int s = mf_wmap_shard_at(w, a);
        uint64_t s1 = mf_up(w->shard_off[s] + w->shard_bytes[s], pg);
        uint64_t nx = s + 1 < w->n_shards ? w->shard_off[s + 1] : w->copy_off, e = a < s1 ? s1 : nx;
        if (e > b) e = b;
        if (a < s1) {
            int64_t c = mf_wmap_cachestat(mf_st_shard_fd(w->st, s), a - w->shard_off[s], e - a);
            got += c >= 0 ? (uint64_t)c : mf_wmap_mincore(w->base + a, e - a);
        }
        a = e;
    }
    return got;
}

int mf_wmap_meminfo(uint64_t *available, uint64_t *total)
{
    *available = *total = 0;
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return mf_error(-errno, "/proc/meminfo: cannot open: %s", strerror(errno));
    char line[256];
    unsigned long long kb;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) *available = (uint64_t)kb << 10;
        if (sscanf(line, "MemTotal: %llu kB", &kb) == 1) *total = (uint64_t)kb << 10;
    }
    fclose(f);
    return *total ? 0 : mf_error(-EINVAL, "/proc/meminfo: no MemTotal line");
}

int mf_wmap_file_cached(const char *path, uint64_t *cached, uint64_t *size)
{
    *cached = *size = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return mf_error(-errno, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    int rc = fstat(fd, &sb) ? mf_error(-errno, "%s: cannot stat: %s", path, strerror(errno)) : 0;
    int64_t c = !rc && sb.st_size > 0 ? mf_wmap_cachestat(fd, 0, 0) : -1;
    if (!rc) *size = (uint64_t)sb.st_size;
    if (c >= 0) {
        *cached = (uint64_t)c < *size ? (uint64_t)c : *size;
    } else if (!rc && sb.st_size > 0) {
        void *p = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) rc = mf_error(-errno, "%s: cannot map: %s", path, strerror(errno));
        else {
            *cached = mf_wmap_mincore(p, (uint64_t)sb.st_size);
            if (*cached > *size) *cached = *size;
            munmap(p, (size_t)sb.st_size);
        }
    }
    close(fd);
    return rc;
}

int mf_wmap_file_evict(const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return mf_error(-errno, "%s: cannot open: %s", path, strerror(errno));
    (void)fdatasync(fd);   /* dirty pages (a file just written) are not dropped */
    int e = posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
    return e ? mf_error(-e, "%s: posix_fadvise(DONTNEED): %s", path, strerror(e)) : 0;
}

/* ---- the fill ---------------------------------------------------------------------------------- */

typedef struct mf_wjob { uint64_t off, len; } mf_wjob;

typedef struct mf_wfill {
    mf_wmap *w;
    mf_wjob *jobs;             /* socket 0's, socket 1's, ..., then any thread's */
    int *first;                /* [n_sock + 2]: where each list starts */
    _Atomic int *next;         /* [n_sock + 1]: each list's next job */
    int n_sock;
    const int *node;
    _Atomic uint64_t done;
    _Atomic int stop, n_bound_mask, finished;
    int err;
    uint64_t err_off;
    pthread_mutex_t mu;
} mf_wfill;

typedef struct mf_wthread { mf_wfill *f; int socket; pthread_t t; } mf_wthread;

/* This thread's memory policy: bound to OS node `node` (its page-cache reads land there), or the
 * default again with node < 0. 0 or -errno. */
static int mf_wmap_bind_thread(int node)
{
    unsigned long mask[16] = {0};
    if (node < 0) return syscall(SYS_set_mempolicy, MPOL_DEFAULT, NULL, 0) ? -errno : 0;
    if (node >= (int)(sizeof mask * 8)) return -EINVAL;
    mask[node / (8 * sizeof mask[0])] |= 1UL << (node % (8 * sizeof mask[0]));
    return syscall(SYS_set_mempolicy, MPOL_BIND, mask, sizeof mask * 8 + 1) ? -errno : 0;
}

/* Faults [p, p + n) in: MADV_POPULATE_READ, or a read of every page where the kernel lacks it. */
static int mf_wmap_populate(uint8_t *p, uint64_t n)
{
    if (!madvise(p, (size_t)n, MADV_POPULATE_READ)) return 0;
    if (errno != EINVAL) return -errno;
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
    volatile uint8_t sink = 0;
    for (uint64_t o = 0; o < n; o += pg) sink ^= p[o];
    (void)sink;
    return 0;
}

static void *mf_wmap_worker(void *arg)
{
    mf_wthread *t = arg;
    mf_wfill *f = t->f;
    int bound = 0;
    if (t->socket >= 0 && f->node[t->socket] >= 0 && !mf_wmap_bind_thread(f->node[t->socket])) {
        bound = 1;
        atomic_fetch_or(&f->n_bound_mask, 1 << t->socket);
    }
    int lists[2] = {t->socket >= 0 ? t->socket : f->n_sock, f->n_sock};
    for (int l = 0; l < 2 && !f->stop; l++) {
        int L = lists[l];
        if (l && L == lists[0]) break;
        for (;;) {
            int j = atomic_fetch_add(&f->next[L], 1) + f->first[L];
            if (j >= f->first[L + 1] || f->stop) break;
            int rc = mf_wmap_populate(f->w->base + f->jobs[j].off, f->jobs[j].len);
            if (rc == -ENOMEM && bound) {   /* the node is full: anywhere rather than nowhere */
                mf_wmap_bind_thread(-1);
                bound = 0;
                rc = mf_wmap_populate(f->w->base + f->jobs[j].off, f->jobs[j].len);
            }
            if (rc) {
                pthread_mutex_lock(&f->mu);
                if (!f->err) {
                    f->err = rc;
                    f->err_off = f->jobs[j].off;
                }
                pthread_mutex_unlock(&f->mu);
                f->stop = 1;
                break;
            }
            atomic_fetch_add(&f->done, f->jobs[j].len);
        }
    }
    if (bound) mf_wmap_bind_thread(-1);
    atomic_fetch_add(&f->finished, 1);
    return NULL;
}

static int mf_wrange_cmp(const void *a, const void *b)
{
    const mf_wmap_range *x = a, *y = b;
    if (x->socket != y->socket) return x->socket < y->socket ? -1 : 1;
    return x->off < y->off ? -1 : x->off > y->off;
}

static int mf_woff_cmp(const void *a, const void *b)
{
    const mf_wmap_range *x = a, *y = b;
    return x->off < y->off ? -1 : x->off > y->off;
}

/* The ranges page-rounded and clipped into v (sorted by socket, any-thread ones last, then
 * offset; merged within a socket), their union's bytes and cached bytes; the jobs (pieces of at
 * most MF_WMAP_CHUNK ending on 2 MiB boundaries) per list. */
static int mf_wmap_plan(mf_wfill *f, const mf_wmap_range *r, int n, mf_wmap_fill_stats *st)
{
    mf_wmap *w = f->w;
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
    mf_wmap_range *v = malloc(sizeof *v * (size_t)(n + 1));
    if (!v) return mf_error(-ENOMEM, "weights mapping: out of memory for %d ranges", n);
    int m = 0;
    for (int i = 0; i < n; i++) {
        uint64_t a = r[i].off / pg * pg, b = mf_up(r[i].off + r[i].n_bytes, pg);
        if (b > w->bytes) b = w->bytes;
        if (b <= a) continue;
        int s = r[i].socket >= 0 && r[i].socket < f->n_sock ? r[i].socket : f->n_sock;
        v[m++] = (mf_wmap_range){a, b - a, s};
    }
    /* the union (any socket): what the fill covers and the page cache held before */
    qsort(v, (size_t)m, sizeof *v, mf_woff_cmp);
    uint64_t end = 0;
    for (int i = 0; i < m; i++) {
        uint64_t a = v[i].off > end ? v[i].off : end, b = v[i].off + v[i].n_bytes;
        if (b <= a) continue;
        st->bytes += b - a;
        st->cached_bytes += mf_wmap_cached(w, a, b - a);
        end = b;
    }
    qsort(v, (size_t)m, sizeof *v, mf_wrange_cmp);
    int k = 0;
    for (int i = 0; i < m; i++) {   /* merge touching or overlapping ranges of one list */
        if (k && v[k - 1].socket == v[i].socket && v[i].off <= v[k - 1].off + v[k - 1].n_bytes) {
            uint64_t e = v[i].off + v[i].n_bytes;
            if (e > v[k - 1].off + v[k - 1].n_bytes) v[k - 1].n_bytes = e - v[k - 1].off;
        } else {
            v[k++] = v[i];
        }
    }
    int n_jobs = 0;
    for (int i = 0; i < k; i++) n_jobs += (int)(v[i].n_bytes / MF_WMAP_CHUNK) + 2;
    f->jobs = malloc(sizeof *f->jobs * (size_t)(n_jobs + 1));
    if (!f->jobs) {
        free(v);
        return mf_error(-ENOMEM, "weights mapping: out of memory for %d fill jobs", n_jobs);
    }
    int j = 0;
    for (int L = 0, i = 0; L <= f->n_sock; L++) {
        f->first[L] = j;
        for (; i < k && v[i].socket == L; i++)
            for (uint64_t a = v[i].off, e = v[i].off + v[i].n_bytes; a < e;) {
                uint64_t b = (a + MF_WMAP_CHUNK) / MF_WMAP_ALIGN * MF_WMAP_ALIGN;
                if (b <= a || b > e) b = e;
                f->jobs[j++] = (mf_wjob){a, b - a};
                a = b;
            }
    }
    f->first[f->n_sock + 1] = j;
    free(v);
    return 0;
}

/* 1 when a shard lies on a rotational disk: one stream per socket reads it best (seeks). */
static int mf_wmap_rotational(const mf_wmap *w)
{
    for (int s = 0; s < w->n_shards; s++)
        if (mf_dio_rotational(mf_st_shard_fd(w->st, s)) == 1) return 1;
    return 0;
}

int mf_wmap_fill(mf_wmap *w, const mf_wmap_range *r, int n, const mf_wmap_fill_opts *opts,
                 mf_wmap_fill_stats *stats)
{
    mf_wmap_fill_opts o = opts ? *opts : (mf_wmap_fill_opts){0};
    mf_wmap_fill_stats st = {0};
    int64_t t0 = mf_now_ns();
    int n_sock = o.n_sockets > 1 && o.socket_node ? o.n_sockets : 0;
    if (n_sock > 30) n_sock = 30;
    mf_wfill f = {.w = w, .n_sock = n_sock, .node = o.socket_node};
    f.first = calloc((size_t)n_sock + 2, sizeof *f.first);
    f.next = calloc((size_t)n_sock + 1, sizeof *f.next);
    int rc = !f.first || !f.next ? mf_error(-ENOMEM, "weights mapping: out of memory") : 0;
    if (!rc) rc = mf_wmap_plan(&f, r, n, &st);
    uint64_t to_read = st.bytes > st.cached_bytes ? st.bytes - st.cached_bytes : 0;
    /* reading from a rotational disk: one stream per socket; else (or almost all cached: the
     * fill only maps, CPU work) up to 8 threads, no more than the online CPUs */
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    int T = to_read > st.bytes / 16 && mf_wmap_rotational(w) ? 1 : cpus < 4 ? 4 : cpus > 8 ? 8 : (int)cpus;
    if (o.n_threads > 0) T = o.n_threads;
    if (T < n_sock) T = n_sock;
    mf_wthread *th = calloc((size_t)T, sizeof *th);
    if (!rc && !th) rc = mf_error(-ENOMEM, "weights mapping: out of memory");
    pthread_mutex_init(&f.mu, NULL);
    int started = 0;
    mf_progress pr;
    mf_progress_begin(&pr, o.label ? o.label : "weights", st.bytes, 1, o.quiet || !to_read);
    for (int i = 0; !rc && i < T; i++) {
        th[i] = (mf_wthread){.f = &f, .socket = n_sock ? i % n_sock : -1};
        if (pthread_create(&th[i].t, NULL, mf_wmap_worker, &th[i])) {
            f.stop = 1;
            rc = mf_error(-EAGAIN, "weights mapping: cannot start fill thread %d of %d", i, T);
            break;
        }
        started++;
    }
    uint64_t shown = 0;
    while (f.finished < started) {   /* the progress, from here */
        nanosleep(&(struct timespec){0, 20000000}, NULL);
        uint64_t d = f.done;
        mf_progress_add(&pr, d - shown);
        shown = d;
    }
    for (int i = 0; i < started; i++) pthread_join(th[i].t, NULL);
    mf_progress_add(&pr, f.done - shown);
    if (started) mf_progress_end(&pr);
    if (!rc && f.err) {
        int s = mf_wmap_shard_at(w, f.err_off);
        rc = mf_error(f.err, "%s: cannot read the mapped bytes at offset %" PRIu64 ": %s", w->path[s],
                      f.err_off - w->shard_off[s], strerror(-f.err));
    }
    for (int k = 0; k < n_sock; k++) {
        if (f.n_bound_mask & (1 << k)) st.n_bound++;
        else if (!rc && !o.quiet)
            fprintf(stderr, "weights mapping: socket %d's share not read into NUMA node %d (%s); first touch\n", k,
                    o.socket_node[k], o.socket_node[k] < 0 ? "it has none of its own" : "the kernel refused the binding");
    }
    st.n_threads = started;
    st.wall_ns = mf_now_ns() - t0;
    if (stats) *stats = st;
    pthread_mutex_destroy(&f.mu);
    free(f.jobs);
    free(f.first);
    free((void *)f.next);
    free(th);
    return rc;
}
