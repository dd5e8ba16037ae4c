/* Hardware calibration, host side (graphs/calib/hwcal.h): topology (hwloc), kernel rates of one thread
 * for each family with weights out of cache, plain scalar code in the reference's style, streaming
 * memory bandwidth of one socket's threads, the executor's cost per task; and mf_hwcal_run, which
 * runs every phase (disk: hwcal_io.c, cards: hwcal_dev.c) into one profile. */
#define _GNU_SOURCE
#include "graphs/calib/hwcal_impl.h"

#include <errno.h>
#include <hwloc.h>
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "host/hostmem.h"
#include "host/kernels.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "sched/graph.h"
#include "sched/sched.h"
#include "sched/timeline.h"

/* ---- shared helpers -------------------------------------------------------------------------- */

void mf_hwcal_host_date(char *buf, int cap)
{
    char host[64] = "unknown-host";
    gethostname(host, sizeof host - 1);
    host[sizeof host - 1] = '\0';
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    char date[32];
    strftime(date, sizeof date, "%Y-%m-%d", &tm);
    snprintf(buf, (size_t)cap, "%s %s", host, date);
}

void mf_hwcal_cpu_model(char *buf, int cap)
{
    snprintf(buf, (size_t)cap, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10) != 0) continue;
        char *c = strchr(line, ':');
        if (!c) break;
        c++;
        while (*c == ' ' || *c == '\t') c++;
        c[strcspn(c, "\n")] = '\0';
        snprintf(buf, (size_t)cap, "%s", c);
        break;
    }
    fclose(f);
}

static int mf_hwcal_vsrc(mf_hwcal *h, const char *key, const char *prefix, const char *fmt, va_list ap)
{
    char method[400], src[640];
    vsnprintf(method, sizeof method, fmt, ap);
    snprintf(src, sizeof src, "%s%s", prefix, method);
    src[sizeof h->p->keys[0].source - 1] = '\0';   /* keep within the format's 199 characters */
    return mf_profile_set_source(h->p, key, src);
}

int mf_hwcal_src(mf_hwcal *h, const char *key, const char *fmt, ...)
{
    char prefix[220];
    snprintf(prefix, sizeof prefix, "measured by moeflow calibrate on %s: ", h->who);
    va_list ap;
    va_start(ap, fmt);
    int rc = mf_hwcal_vsrc(h, key, prefix, fmt, ap);
    va_end(ap);
    return rc;
}

int mf_hwcal_src_raw(mf_hwcal *h, const char *key, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = mf_hwcal_vsrc(h, key, "", fmt, ap);
    va_end(ap);
    return rc;
}

void mf_hwcal_note(const mf_hwcal *h, const char *fmt, ...)
{
    if (h->o->quiet) return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "calibrate: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

uint64_t mf_hwcal_rand(mf_hwcal *h)
{
    h->rng ^= h->rng << 13;
    h->rng ^= h->rng >> 7;
    h->rng ^= h->rng << 17;
    return h->rng;
}

void mf_hwcal_fill(mf_hwcal *h, void *p, size_t n, int kind)
{
    uint8_t *b = p;
    for (size_t i = 0; i < n; i += 8) {
        uint64_t v = mf_hwcal_rand(h);
        size_t m = n - i < 8 ? n - i : 8;
        for (size_t j = 0; j < m; j++) {
            uint8_t x = (uint8_t)(v >> (8 * j));
            if (kind == 2 && (x & 0x7f) == 0x7f) x ^= 1;                 /* E4M3: no NaN */
            if (kind == 3 && ((i + j) & 1)) x = (uint8_t)((x & 0x80) | 0x3f);  /* bf16: +-[0.5, 2) */
            if (kind == 4) x = (uint8_t)(118 + x % 8);                   /* E8M0 scales 2^-9 .. 2^-2 */
            b[i + j] = x;
        }
    }
}

static int mf_cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double mf_hwcal_median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, mf_cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int mf_hwcal_fit_kern(const char *what, double bytes_a, double t_a1, double bytes_b, double t_b1,
                      double macs_b, int n_many, double t_bn, mf_profile_kern *out)
{
    if (!(t_b1 > t_a1))
        return mf_error(-EIO, "calibrate %s: the larger matrix (%.0f bytes, %.0f ns) was not slower than the "
                        "smaller (%.0f bytes, %.0f ns): too noisy to fit; run again on a quieter machine",
                        what, bytes_b, t_b1, bytes_a, t_a1);
    if (!(t_bn > t_b1))
        return mf_error(-EIO, "calibrate %s: %d tokens (%.0f ns) were not slower than 1 (%.0f ns): too noisy "
                        "to fit", what, n_many, t_bn, t_b1);
    out->bytes_per_s = (bytes_b - bytes_a) / (t_b1 - t_a1) * 1e9;
    out->latency_ns = t_a1 - bytes_a / out->bytes_per_s * 1e9;
    if (out->latency_ns < 0) {
        /* the small matrix went faster per byte than the large one (its weights partly in a cache, a
         * loop that starts faster): the line through both would need a negative latency, and with it
         * clamped at 0 its slope would price the large matrix above what it took. Latency 0 and the
         * large call's own rate instead: the large matrix's time exactly, the small one's above. */
        out->latency_ns = 0;
        out->bytes_per_s = bytes_b / t_b1 * 1e9;
    }
    out->macs_per_s = (n_many - 1) * macs_b / (t_bn - t_b1) * 1e9;
    return 0;
}

/* ---- topology -------------------------------------------------------------------------------- */

typedef struct mf_hwcal_topo {
    hwloc_topology_t topo;
    int n_packages, n_numa, cores_per_package;
} mf_hwcal_topo;

static int mf_hwcal_topo_load(mf_hwcal_topo *t)
{
    memset(t, 0, sizeof *t);
    if (hwloc_topology_init(&t->topo) != 0 || hwloc_topology_load(t->topo) != 0)
        return mf_error(-EIO, "calibrate: hwloc could not read this machine's topology");
    t->n_packages = hwloc_get_nbobjs_by_type(t->topo, HWLOC_OBJ_PACKAGE);
    if (t->n_packages < 1) t->n_packages = 1;
    t->n_numa = hwloc_get_nbobjs_by_type(t->topo, HWLOC_OBJ_NUMANODE);
    if (t->n_numa < 1) t->n_numa = 1;
    int cores = hwloc_get_nbobjs_by_type(t->topo, HWLOC_OBJ_CORE);
    if (cores < 1) cores = hwloc_get_nbobjs_by_type(t->topo, HWLOC_OBJ_PU);
    t->cores_per_package = cores / t->n_packages > 0 ? cores / t->n_packages : 1;
    return 0;
}

/* The cpuset of package (socket) i, or of the whole machine when there is one. */
static hwloc_const_cpuset_t mf_hwcal_package_set(const mf_hwcal_topo *t, int i)
{
    hwloc_obj_t o = hwloc_get_obj_by_type(t->topo, HWLOC_OBJ_PACKAGE, (unsigned)i);
    return o ? o->cpuset : hwloc_topology_get_topology_cpuset(t->topo);
}

/* ---- streaming reads (memory bandwidth) ------------------------------------------------------ */

/* On 64 bytes, so that code changes elsewhere do not move the probe's loop (on an Intel VM a
 * 32-byte shift of the code moved this probe's rate by ~8%: docs/decode.md) */
__attribute__((target("avx2"), aligned(64))) static uint64_t mf_read_avx2(const uint8_t *p, size_t n)
{
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i *)(p + i + 96)));
    }
    a0 = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    return (uint64_t)_mm256_extract_epi64(a0, 0) + (uint64_t)_mm256_extract_epi64(a0, 3);
}

static uint64_t mf_read_plain(const uint8_t *p, size_t n)
{
    const uint64_t *q = (const uint64_t *)p;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i + 4 <= n / 8; i += 4) {
        s0 += q[i];
        s1 += q[i + 1];
        s2 += q[i + 2];
        s3 += q[i + 3];
    }
    return s0 + s1 + s2 + s3;
}

typedef struct mf_bw_job {
    const uint8_t *p;
    size_t n;
    int avx2;
    hwloc_topology_t topo;
    hwloc_const_cpuset_t bind;   /* NULL: unbound */
    const int *go;
    int64_t end_ns;
    uint64_t sink;
} mf_bw_job;

static void *mf_bw_thread(void *arg)
{
    mf_bw_job *j = arg;
    if (j->bind) hwloc_set_cpubind(j->topo, j->bind, HWLOC_CPUBIND_THREAD);
    while (!__atomic_load_n(j->go, __ATOMIC_ACQUIRE)) sched_yield();
    j->sink = j->avx2 ? mf_read_avx2(j->p, j->n) : mf_read_plain(j->p, j->n);
    j->end_ns = mf_now_ns();
    return NULL;
}

/* Bytes per second of n_threads threads each reading its slice of buf once, started together. */
static int mf_hwcal_read_bw(const mf_hwcal_topo *t, hwloc_const_cpuset_t bind, const uint8_t *buf,
                            size_t n, int n_threads, double *bps)
{
    mf_bw_job jobs[256];
    pthread_t th[256];
    int go = 0;
    if (n_threads > 256) n_threads = 256;
    size_t slice = (n / (size_t)n_threads) & ~(size_t)127;
    int avx2 = __builtin_cpu_supports("avx2");
    int started = 0, rc = 0;
    for (int i = 0; i < n_threads; i++) {
        jobs[i] = (mf_bw_job){buf + slice * (size_t)i, slice, avx2, t->topo, bind, &go, 0, 0};
        if (pthread_create(&th[i], NULL, mf_bw_thread, &jobs[i]) != 0) {
            rc = mf_error(-EAGAIN, "calibrate: cannot start memory-bandwidth threads");
            break;
        }
        started++;
    }
    struct timespec settle = {0, 2000000};   /* let every thread reach its start line */
    nanosleep(&settle, NULL);
    int64_t t0 = mf_now_ns(), t1 = t0;
    __atomic_store_n(&go, 1, __ATOMIC_RELEASE);
    uint64_t sink = 0;
    for (int i = 0; i < started; i++) {
        pthread_join(th[i], NULL);
        if (jobs[i].end_ns > t1) t1 = jobs[i].end_ns;
        sink += jobs[i].sink;
    }
    if (rc) return rc;
    __asm__ volatile("" : : "r"(sink));
    *bps = (double)slice * n_threads / ((double)(t1 - t0) / 1e9);
    return 0;
}

struct mf_hwcal_probe {
    uint8_t *buf;
    size_t bytes;
    mf_hwcal_topo t;   /* unused (unbound threads); mf_hwcal_read_bw's argument */
};

int mf_hwcal_probe_new(size_t bytes, mf_hwcal_probe **out)
{
    *out = NULL;
    mf_hwcal_probe *p = calloc(1, sizeof *p);
    if (!p || !(p->buf = mf_hostmem_map(bytes, 1))) {
        free(p);
        return mf_error(-ENOMEM, "read probe: out of memory (%zu MiB)", bytes >> 20);
    }
    p->bytes = bytes;
    for (size_t i = 0; i + 8 <= bytes; i += 8) *(uint64_t *)(p->buf + i) = i * 0x9e3779b97f4a7c15ull;   /* pages in, not zero */
    *out = p;
    return 0;
}

int mf_hwcal_probe_pass(mf_hwcal_probe *p, int n_threads, double *bytes_per_s)
{
    *bytes_per_s = 0;
    return mf_hwcal_read_bw(&p->t, NULL, p->buf, p->bytes, n_threads < 1 ? 1 : n_threads, bytes_per_s);
}

void mf_hwcal_probe_free(mf_hwcal_probe *p)
{
    if (!p) return;
    mf_hostmem_unmap(p->buf, p->bytes, 1);
    free(p);
}

int mf_hwcal_read_rate(int n_threads, size_t bytes, int reps, double *bytes_per_s)
{
    mf_hwcal_probe *p = NULL;
    *bytes_per_s = 0;
    int rc = mf_hwcal_probe_new(bytes, &p);
    for (int r = 0; r < reps && !rc; r++) {
        double v = 0;
        rc = mf_hwcal_probe_pass(p, n_threads, &v);
        if (!rc && v > *bytes_per_s) *bytes_per_s = v;
    }
    mf_hwcal_probe_free(p);
    return rc;
}

static int mf_hwcal_memory(mf_hwcal *h, const mf_hwcal_topo *t)
{
    mf_profile *p = h->p;
    size_t n = (size_t)(h->o->quick ? 128 : 512) << 20;
    int reps = h->o->quick ? 3 : 7, n_threads = p->threads_per_socket;
    uint8_t *buf = NULL;
    if (!(buf = mf_hostmem_map(n, 1))) return mf_error(-ENOMEM, "calibrate: out of memory (%zu MiB)", n >> 20);
    for (size_t i = 0; i < n; i += 8) *(uint64_t *)(buf + i) = i * 0x9e3779b97f4a7c15ull;   /* pages in, not zero */
    hwloc_const_cpuset_t bind = t->n_packages > 1 ? mf_hwcal_package_set(t, 0) : NULL;
    double v[16];
    int rc = 0;
    for (int r = 0; r < reps && !rc; r++) rc = mf_hwcal_read_bw(t, bind, buf, n, n_threads, &v[r]);
    if (rc) goto out;
    p->mem_bytes_per_s = mf_hwcal_median(v, reps);
    mf_hwcal_src(h, "mem_bytes_per_s", "%d threads%s each read a slice of a %zu MiB buffer on 2 MiB pages once (%s "
                 "loads), median of %d", n_threads, bind ? " bound to socket 0" : "", n >> 20,
                 __builtin_cpu_supports("avx2") ? "AVX2" : "64-bit", reps);
    mf_hwcal_note(h, "memory: %.2f GB/s streaming read, %d threads", p->mem_bytes_per_s / 1e9, n_threads);

    if (t->n_numa > 1) {
        /* one thread on node 0 reading memory of node 0, then of node 1 */
        hwloc_obj_t n0 = hwloc_get_obj_by_type(t->topo, HWLOC_OBJ_NUMANODE, 0);
        hwloc_obj_t n1 = hwloc_get_obj_by_type(t->topo, HWLOC_OBJ_NUMANODE, 1);
        size_t m = (size_t)(h->o->quick ? 64 : 256) << 20;
        double bw[2] = {0, 0};
        for (int k = 0; k < 2 && !rc; k++) {
            hwloc_obj_t where = k ? n1 : n0;
            void *b = hwloc_alloc_membind(t->topo, m, where->nodeset, HWLOC_MEMBIND_BIND,
                                          HWLOC_MEMBIND_BYNODESET | HWLOC_MEMBIND_STRICT);
            if (!b) {
                rc = mf_error(-ENOMEM, "calibrate: cannot allocate %zu MiB on NUMA node %d", m >> 20, k);
                break;
            }
            memset(b, 1, m);
            double w[8];
            for (int r = 0; r < 3 && !rc; r++) rc = mf_hwcal_read_bw(t, n0->cpuset, b, m, 1, &w[r]);
            if (!rc) bw[k] = mf_hwcal_median(w, 3);
            hwloc_free(t->topo, b, m);
        }
        if (rc) goto out;
        p->cross_socket_factor = fmin(1.0, bw[1] / bw[0]);
        mf_hwcal_src(h, "cross_socket_factor", "one thread on NUMA node 0 reading %zu MiB bound to node 1 "
                     "(%.2f GB/s) vs node 0 (%.2f GB/s), medians of 3", m >> 20, bw[1] / 1e9, bw[0] / 1e9);
    } else {
        p->cross_socket_factor = 1;
        mf_hwcal_src_raw(h, "cross_socket_factor", "not applicable on %s: one NUMA node, no remote memory "
                         "(1 = no penalty)", h->who);
    }
out:
    mf_hostmem_unmap(buf, n, 1);
    return rc;
}

/* ---- host kernels ---------------------------------------------------------------------------- */

typedef struct mf_wpool {
    int fmt;                 /* MF_KERN_FP4 / FP8 / BF16 */
    int n_out, n_in, n_copies;
    size_t w_bytes, s_bytes;
    uint8_t *mem;            /* n_copies x (w, s), each 64-byte aligned, on 2 MiB pages as the model's (mem_bytes) */
    size_t mem_bytes;
} mf_wpool;

static size_t mf_up64(size_t n) { return (n + 63) & ~(size_t)63; }

static void mf_wpool_sizes(int fmt, int n_out, int n_in, size_t *w, size_t *s)
{
    size_t e = (size_t)n_out * (size_t)n_in;
    *w = fmt == MF_KERN_FP4 ? e / 2 : fmt == MF_KERN_FP8 ? e : 2 * e;
    *s = fmt == MF_KERN_FP4 ? e / 32 : fmt == MF_KERN_FP8 ? (size_t)((n_out + 31) / 32) * (size_t)(n_in / 32) : 0;
}

/* Distinct random copies of one matrix, together at least min_bytes. */
static int mf_wpool_make(mf_hwcal *h, mf_wpool *pl, int fmt, int n_out, int n_in, size_t min_bytes)
{
    memset(pl, 0, sizeof *pl);
    pl->fmt = fmt;
    pl->n_out = n_out;
    pl->n_in = n_in;
    mf_wpool_sizes(fmt, n_out, n_in, &pl->w_bytes, &pl->s_bytes);
    size_t one = mf_up64(pl->w_bytes) + mf_up64(pl->s_bytes);
    pl->n_copies = (int)(min_bytes / one) + 2;
    pl->mem_bytes = one * (size_t)pl->n_copies;
    if (!(pl->mem = mf_hostmem_map(pl->mem_bytes, 1)))
        return mf_error(-ENOMEM, "calibrate: out of memory for %d copies of a %zu-byte matrix", pl->n_copies, one);
    for (int c = 0; c < pl->n_copies; c++) {
        uint8_t *w = pl->mem + one * (size_t)c;
        mf_hwcal_fill(h, w, pl->w_bytes, fmt == MF_KERN_FP4 ? 1 : fmt == MF_KERN_FP8 ? 2 : 3);
        mf_hwcal_fill(h, w + mf_up64(pl->w_bytes), pl->s_bytes, 4);
    }
    return 0;
}

static const uint8_t *mf_wpool_w(const mf_wpool *pl, int c)
{
    return pl->mem + (mf_up64(pl->w_bytes) + mf_up64(pl->s_bytes)) * (size_t)(c % pl->n_copies);
}

/* ns of one call (a whole matrix on this thread) at n_tok tokens on copy c of the pool. */
static int mf_hwcal_time_call(const mf_wpool *pl, int c, int n_tok, const float *x, float *y, void *qbuf,
                              size_t qbuf_bytes, double *ns)
{
    mf_kern_q8 q8;
    int rc = 0;
    if (pl->fmt == MF_KERN_FP4 && (rc = mf_kern_q8_init(&q8, qbuf, qbuf_bytes, n_tok, pl->n_in))) return rc;
    const uint8_t *w = mf_wpool_w(pl, c);
    const uint8_t *s = w + mf_up64(pl->w_bytes);
    int64_t t0 = mf_now_ns();
    if (pl->fmt == MF_KERN_FP4) {
        rc = mf_kern_q8_quantize(&q8, x, pl->n_in, 0, n_tok);
        if (!rc) rc = mf_kern_fp4_matmul(w, s, pl->n_out, pl->n_in, &q8, y, pl->n_out, 0, pl->n_out);
    } else if (pl->fmt == MF_KERN_FP8) {
        rc = mf_kern_fp8_matmul(w, s, pl->n_out, pl->n_in, x, n_tok, pl->n_in, y, pl->n_out, 0, pl->n_out);
    } else {
        rc = mf_kern_bf16_matmul((const uint16_t *)w, pl->n_out, pl->n_in, x, n_tok, pl->n_in, y, pl->n_out, 0,
                                 pl->n_out);
    }
    *ns = (double)(mf_now_ns() - t0);
    return rc;
}

/* The head of every job mf_hwcal_pinned runs (its first member): where the thread is pinned and
 * what it starts with. */
typedef struct mf_hwcal_thr {
    hwloc_topology_t topo;
    hwloc_const_cpuset_t bind;   /* NULL: unbound */
    pthread_barrier_t *bar;      /* NULL with one thread */
    const int *go;               /* 1: every thread started; 2: some could not start, return */
} mf_hwcal_thr;

/* A job's first step: pin and wait until every thread started; 1 when it must return at once. */
static int mf_hwcal_thr_begin(const mf_hwcal_thr *h)
{
    if (h->bind) hwloc_set_cpubind(h->topo, h->bind, HWLOC_CPUBIND_THREAD);
    int go = 0;
    while (h->go && !(go = __atomic_load_n(h->go, __ATOMIC_ACQUIRE))) sched_yield();
    return h->go && go == 2;
}

/* fn over n_threads jobs of job_bytes each (an mf_hwcal_thr first, filled here), all at once, job
 * i pinned to core i of socket 0, each sample started together (the thr's barrier); one thread
 * runs on the calling thread. `what` names them in the errors. */
static int mf_hwcal_pinned(const mf_hwcal_topo *t, int n_threads, void *(*fn)(void *), void *jobs, size_t job_bytes,
                           const char *what)
{
    pthread_t th[256];
    pthread_barrier_t bar;
    int go = 0, started = 0;
    if (n_threads > 256) return mf_error(-EINVAL, "calibrate: %d %s threads (at most 256)", n_threads, what);
    hwloc_const_cpuset_t pkg = mf_hwcal_package_set(t, 0);
    int n_cores = hwloc_get_nbobjs_inside_cpuset_by_type(t->topo, pkg, HWLOC_OBJ_CORE);
    int rc = n_threads > 1 ? pthread_barrier_init(&bar, NULL, (unsigned)n_threads) : 0;
    if (rc) return mf_error(-rc, "calibrate: cannot make a barrier of %d threads", n_threads);
    for (int i = 0; i < n_threads; i++) {
        hwloc_obj_t core = n_cores > 0 ? hwloc_get_obj_inside_cpuset_by_type(t->topo, pkg, HWLOC_OBJ_CORE,
                                                                             (unsigned)(i % n_cores))
                                       : NULL;
        *(mf_hwcal_thr *)((char *)jobs + job_bytes * (size_t)i) =
            (mf_hwcal_thr){.topo = t->topo, .bind = core ? core->cpuset : NULL, .bar = n_threads > 1 ? &bar : NULL,
                           .go = n_threads > 1 ? &go : NULL};
    }
    if (n_threads == 1) {
        fn(jobs);
        return 0;
    }
    for (int i = 0; i < n_threads; i++) {
        if (pthread_create(&th[i], NULL, fn, (char *)jobs + job_bytes * (size_t)i) != 0) break;
        started++;
    }
    /* the samples' barriers need every thread: if one did not start, the others return at once */
    __atomic_store_n(&go, started == n_threads ? 1 : 2, __ATOMIC_RELEASE);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&bar);
    if (started < n_threads)
        return mf_error(-EAGAIN, "calibrate: cannot start %s thread %d of %d", what, started, n_threads);
    return 0;
}

/* One measuring thread: pinned to its core, it times A at 1 token, B at 1 token and B at
 * MF_HWCAL_MANY tokens in turn, reps times (after one round not counted), each call started
 * together with the other threads' (a barrier), on its own copies of the pools (copies id,
 * id + n, ...): the three timings of a fit see the same conditions, a burst of other work
 * lands on all three. t[k]: the medians. */
typedef struct mf_kjob {
    mf_hwcal_thr thr;   /* first: mf_hwcal_pinned */
    const mf_wpool *a, *b;
    int id, n;
    const float *x;
    float *y;
    void *qbuf;
    size_t qbuf_bytes;
    int reps;
    double t[3];
    int rc;
} mf_kjob;

static void *mf_kjob_run(void *arg)
{
    mf_kjob *j = arg;
    if (mf_hwcal_thr_begin(&j->thr)) return NULL;
    double v[3][64];
    for (int r = -1; r < j->reps; r++)
        for (int k = 0; k < 3; k++) {
            if (j->thr.bar) pthread_barrier_wait(j->thr.bar);
            double ns = 0;
            /* this thread's copies only, and B at many tokens on another copy than B at 1 */
            const mf_wpool *pl = k ? j->b : j->a;
            int mine = pl->n_copies / j->n, c = j->id + j->n * ((k ? 2 * (r + 1) + (k == 2) : r + 1) % mine);
            if (!j->rc)
                j->rc = mf_hwcal_time_call(pl, c, k == 2 ? MF_HWCAL_MANY : 1, j->x, j->y, j->qbuf, j->qbuf_bytes, &ns);
            if (r >= 0) v[k][r] = ns;
        }
    for (int k = 0; k < 3 && !j->rc; k++) j->t[k] = mf_hwcal_median(v[k], j->reps);
    return NULL;
}

/* The three timings of one family on n_threads threads at once (one per core of socket 0, each on
 * its own weights): per timing the median over threads of their medians. */
static int mf_hwcal_kern_times(const mf_hwcal_topo *t, const mf_wpool *a, const mf_wpool *b, int n_threads,
                               const float *x, int reps, double out[3])
{
    mf_kjob jobs[256];
    if (n_threads > 256) n_threads = 256;
    size_t yb = sizeof(float) * MF_HWCAL_MANY * MF_HWCAL_B_OUT, qb = mf_kern_q8_bytes(MF_HWCAL_MANY, MF_HWCAL_B_IN);
    uint8_t *mem = malloc((yb + qb + 64) * (size_t)n_threads);
    if (!mem) return mf_error(-ENOMEM, "calibrate: out of memory");
    for (int i = 0; i < n_threads; i++) {
        uint8_t *m = mem + (yb + qb + 64) * (size_t)i;
        jobs[i] = (mf_kjob){.a = a, .b = b, .id = i, .n = n_threads, .x = x, .y = (float *)m, .qbuf = m + yb,
                            .qbuf_bytes = qb, .reps = reps};
    }
    int rc = mf_hwcal_pinned(t, n_threads, mf_kjob_run, jobs, sizeof jobs[0], "kernel");
    if (rc) {
        free(mem);
        return rc;
    }
    double v[256];
    for (int k = 0; k < 3 && !rc; k++) {
        for (int i = 0; i < n_threads; i++) {
            if (jobs[i].rc) rc = jobs[i].rc;
            v[i] = jobs[i].t[k];
        }
        if (!rc) out[k] = mf_hwcal_median(v, n_threads);
    }
    free(mem);
    return rc;
}

/* One family's timings and fits on its pools: alone (when alone_too) and with n_threads at once
 * (every core of socket 0, each on its own weights). k: the all-threads fit; alone: the alone one
 * (zeros where not measured). */
static int mf_hwcal_kern_fam(const mf_hwcal_topo *t, const mf_wpool *a, const mf_wpool *b, int n_threads,
                             const float *x, int reps, int alone_too, const char *name, mf_profile_kern *k,
                             mf_profile_kern *alone, double all[3])
{
    double one[3] = {0};
    int rc = alone_too ? mf_hwcal_kern_times(t, a, b, 1, x, reps, one) : 0;
    if (!rc) rc = n_threads > 1 ? mf_hwcal_kern_times(t, a, b, n_threads, x, reps, all) : 0;
    if (!rc && n_threads == 1) memcpy(all, one, sizeof one);
    if (rc) return rc;
    char what[48];
    snprintf(what, sizeof what, "host %s (%d threads at once)", name, n_threads);
    double macs_b = (double)MF_HWCAL_B_OUT * MF_HWCAL_B_IN;
    double bytes_a = (double)(a->w_bytes + a->s_bytes), bytes_b = (double)(b->w_bytes + b->s_bytes);
    rc = mf_hwcal_fit_kern(what, bytes_a, all[0], bytes_b, all[1], macs_b, MF_HWCAL_MANY, all[2], k);
    if (!rc && (!alone_too || mf_hwcal_fit_kern(name, bytes_a, one[0], bytes_b, one[1], macs_b, MF_HWCAL_MANY, one[2],
                                                alone)))
        *alone = (mf_profile_kern){0};   /* the alone figures are only reported (0: not measured) */
    return rc;
}

/* Each family's figures per thread while every thread of a socket runs the kernel at once, as the
 * engine's workers do (they share the socket's memory bandwidth and last-level cache); the same
 * timings on one thread alone go to the source and the progress line, for comparison. The kernels
 * run the loops the engine runs: the one-token FP8 and FP4 loops on AVX-512 where the CPU has it
 * (the same dispatch), and the BF16 one-token loop with and without its L2 prefetch, the faster
 * kept: the engine's process measures both on its own first large calls and keeps the faster
 * (host/kern_bf16.c), where calibrate's calls would otherwise land in that measuring, in either
 * mode. Then mem_bytes_per_s is raised to the threads times the fastest family's per-thread byte
 * rate where the read probe saw less: those kernels stream their weights with every thread at once,
 * so the socket delivers at least that (the probe's plain AVX2 loop does not reach the one-token
 * loops' rate on every CPU), and the simulator caps each thread at that share. */
static int mf_hwcal_kernels(mf_hwcal *h, const mf_hwcal_topo *t)
{
    static const struct { int fmt; int fam; const char *name, *how; } fams[] = {
        {MF_KERN_FP4, MF_KF_FP4, "fp4", "fused fp4 int8 path (activation quantization included)"},
        {MF_KERN_FP8, MF_KF_FP8, "fp8", "fp8 32x32-tile matmul"},
        {MF_KERN_BF16, MF_KF_BF16, "bf16", "bf16 matmul"},
    };
    mf_profile *p = h->p;
    int reps = h->o->quick ? 5 : 25, n_threads = p->threads_per_socket;
    size_t pool_min = (h->o->quick ? 1 : 3) * (h->llc_bytes ? h->llc_bytes : (size_t)32 << 20) + ((size_t)8 << 20);
    float *x = malloc(sizeof(float) * 64 * MF_HWCAL_B_IN);
    int rc = 0, fastest = -1;
    if (!x) return mf_error(-ENOMEM, "calibrate: out of memory");
    for (int i = 0; i < 64 * MF_HWCAL_B_IN; i++) x[i] = (float)((int)(mf_hwcal_rand(h) % 2001) - 1000) * 1e-3f;
    const char *simd = mf_kern_simd_name(mf_kern_simd_active());
    for (size_t f = 0; f < sizeof fams / sizeof fams[0] && !rc; f++) {
        mf_wpool a, b;
        memset(&a, 0, sizeof a);
        memset(&b, 0, sizeof b);
        /* every thread rotates through at least 2 copies of its own */
        if (!(rc = mf_wpool_make(h, &a, fams[f].fmt, MF_HWCAL_A_OUT, MF_HWCAL_A_IN, pool_min)) &&
            !(rc = mf_wpool_make(h, &b, fams[f].fmt, MF_HWCAL_B_OUT, MF_HWCAL_B_IN, pool_min)) &&
            (a.n_copies < 2 * n_threads || b.n_copies < 2 * n_threads))
            rc = mf_error(-EINVAL, "calibrate: %d threads need %d copies of each matrix (have %d and %d)", n_threads,
                          2 * n_threads, a.n_copies, b.n_copies);
        /* one thread alone, for the sources (not with --quick, unless it is the measurement) */
        int alone_too = !h->o->quick || n_threads == 1, bf16 = fams[f].fmt == MF_KERN_BF16;
        mf_profile_kern *k = &p->host[fams[f].fam], alone = {0}, kv[2], av[2];
        double all[3] = {0}, allv[2][3];
        char loop[96] = "";
        if (!rc && !bf16) {
            rc = mf_hwcal_kern_fam(t, &a, &b, n_threads, x, reps, alone_too, fams[f].name, k, &alone, all);
            int z = fams[f].fmt == MF_KERN_FP8 ? mf_kern_fp8_tok1_avx512() : mf_kern_fp4_tok1_avx512();
            snprintf(loop, sizeof loop, "%s 1-token loop", z ? "avx-512" : simd);
        } else if (!rc) {   /* both prefetch modes of the one-token loop, the faster kept */
            for (int pf = 0; pf < 2 && !rc; pf++) {
                mf_kern_bf16_tok1_set_prefetch(pf);
                rc = mf_hwcal_kern_fam(t, &a, &b, n_threads, x, reps, alone_too, fams[f].name, &kv[pf], &av[pf], allv[pf]);
            }
            mf_kern_bf16_tok1_set_prefetch(-1);   /* the process measures again, as it would have */
            if (!rc) {
                int best = kv[1].bytes_per_s > kv[0].bytes_per_s;
                *k = kv[best];
                alone = av[best];
                memcpy(all, allv[best], sizeof all);
                snprintf(loop, sizeof loop, "1-token loop, prefetch %s: faster", best ? "on" : "off");
                mf_hwcal_note(h, "host bf16: one-token loop with its L2 prefetch %.2f GB/s, without %.2f GB/s (per thread, "
                              "%d at once): %s kept", kv[1].bytes_per_s / 1e9, kv[0].bytes_per_s / 1e9, n_threads,
                              best ? "with" : "without");
            }
        }
        if (!rc) {
            char key[48];
            snprintf(key, sizeof key, "host_%s_bytes_per_s", fams[f].name);
            mf_hwcal_src(h, key, "%s (%s), %d pinned threads at once, [%dx%d] vs [%dx%d], out of cache, medians of %d, "
                         "alone %.4g", f ? fams[f].how : "fp4 int8 path with x's quantization", loop, n_threads,
                         MF_HWCAL_B_OUT, MF_HWCAL_B_IN, MF_HWCAL_A_OUT, MF_HWCAL_A_IN, reps, alone.bytes_per_s);
            snprintf(key, sizeof key, "host_%s_macs_per_s", fams[f].name);
            mf_hwcal_src(h, key, "%s, per thread with %d at once, [%dx%d] at %d tokens minus 1 token (%.0f vs "
                         "%.0f ns; 1 thread alone: %.4g)", fams[f].how, n_threads, MF_HWCAL_B_OUT, MF_HWCAL_B_IN,
                         MF_HWCAL_MANY, all[2], all[1], alone.macs_per_s);
            snprintf(key, sizeof key, "host_%s_latency_ns", fams[f].name);
            mf_hwcal_src(h, key, "%s, %d threads at once: intercept of the [%dx%d]/[%dx%d] 1-token fit (1 "
                         "thread alone: %.4g)", fams[f].how, n_threads, MF_HWCAL_A_OUT, MF_HWCAL_A_IN,
                         MF_HWCAL_B_OUT, MF_HWCAL_B_IN, alone.latency_ns);
            mf_hwcal_note(h, "host %s: %.2f GB/s of weights, %.2f GMAC/s beyond the first token, latency %.1f us "
                          "(per thread, %d at once; alone %.2f GB/s; %s)", fams[f].name, k->bytes_per_s / 1e9,
                          k->macs_per_s / 1e9, k->latency_ns / 1e3, n_threads, alone.bytes_per_s / 1e9, loop);
            if (fastest < 0 || k->bytes_per_s > p->host[fams[fastest].fam].bytes_per_s) fastest = (int)f;
        }
        mf_hostmem_unmap(a.mem, a.mem_bytes, 1);
        mf_hostmem_unmap(b.mem, b.mem_bytes, 1);
    }
    free(x);
    double streamed = fastest >= 0 ? p->host[fams[fastest].fam].bytes_per_s * n_threads : 0;
    if (!rc && streamed > p->mem_bytes_per_s) {
        double probe = p->mem_bytes_per_s;
        p->mem_bytes_per_s = streamed;
        mf_hwcal_src(h, "mem_bytes_per_s", "%d threads' %s kernel at once streamed %d x %.4g B/s of weights, above the "
                     "read probe's %.4g (AVX2 loads): the larger", n_threads, fams[fastest].name, n_threads,
                     streamed / n_threads, probe);
        mf_hwcal_note(h, "memory: %.2f GB/s (the %s kernel's, %d threads at once; the read probe %.2f GB/s)",
                      streamed / 1e9, fams[fastest].name, n_threads, probe / 1e9);
    }
    return rc;
}

/* The reference's kind of code: attention of one query over n keys, dot products and the weighted
 * sum accumulated in double, a softmax with exp, no SIMD intrinsics (2 * n * d multiply-adds). */
__attribute__((noinline)) static double mf_ref_style_attn(const float *q, const float *k, const float *v, int n,
                                                          int d, double *scores, double *out)
{
    double mx = -1e300;
    for (int j = 0; j < n; j++) {
        double s = 0;
        for (int i = 0; i < d; i++) s += (double)q[i] * (double)k[(size_t)j * d + i];
        scores[j] = s;
        if (s > mx) mx = s;
    }
    double sum = 0;
    for (int j = 0; j < n; j++) sum += scores[j] = exp(scores[j] - mx);
    for (int i = 0; i < d; i++) out[i] = 0;
    for (int j = 0; j < n; j++) {
        double w = scores[j] / sum;
        for (int i = 0; i < d; i++) out[i] += w * (double)v[(size_t)j * d + i];
    }
    return out[0];
}

static int mf_hwcal_ref(mf_hwcal *h)
{
    enum { D = 256, NA = 32, NB = 512 };
    int reps = h->o->quick ? 7 : 21;
    float *q = malloc(sizeof(float) * D), *k = malloc(sizeof(float) * NB * D), *v = malloc(sizeof(float) * NB * D);
    double *scores = malloc(sizeof(double) * NB), *out = malloc(sizeof(double) * D);
    if (!q || !k || !v || !scores || !out) {
        free(q); free(k); free(v); free(scores); free(out);
        return mf_error(-ENOMEM, "calibrate: out of memory");
    }
    for (int i = 0; i < D; i++) q[i] = (float)((int)(mf_hwcal_rand(h) % 2001) - 1000) * 1e-4f;
    for (int i = 0; i < NB * D; i++) {
        k[i] = (float)((int)(mf_hwcal_rand(h) % 2001) - 1000) * 1e-3f;
        v[i] = (float)((int)(mf_hwcal_rand(h) % 2001) - 1000) * 1e-3f;
    }
    double t[2], sink = 0;
    const int ns[2] = {NA, NB};
    for (int s = 0; s < 2; s++) {
        double w[64];
        int inner = s ? 4 : 64;   /* calls per sample: a few hundred microseconds each */
        for (int r = -1; r < reps; r++) {
            int64_t t0 = mf_now_ns();
            for (int i = 0; i < inner; i++) sink += mf_ref_style_attn(q, k, v, ns[s], D, scores, out);
            if (r >= 0) w[r] = (double)(mf_now_ns() - t0) / inner;
        }
        t[s] = mf_hwcal_median(w, reps);
    }
    __asm__ volatile("" : : "g"(sink));
    free(q); free(k); free(v); free(scores); free(out);
    double macs_a = 2.0 * NA * D, macs_b = 2.0 * NB * D;
    if (!(t[1] > t[0]))
        return mf_error(-EIO, "calibrate host ref: %d keys (%.0f ns) not slower than %d (%.0f ns): too noisy", NB,
                        t[1], NA, t[0]);
    mf_profile_kern *r = &h->p->host[MF_KF_REF];
    r->bytes_per_s = 0;
    r->macs_per_s = (macs_b - macs_a) / (t[1] - t[0]) * 1e9;
    r->latency_ns = fmax(0.0, t[0] - macs_a / r->macs_per_s * 1e9);
    mf_hwcal_src(h, "host_ref_macs_per_s", "plain C attention of 1 query (double dot products, exp softmax, "
                 "weighted sum; d %d) over %d vs %d keys, 1 thread, data in cache, medians of %d", D, NB, NA, reps);
    mf_hwcal_src(h, "host_ref_latency_ns", "intercept of the same plain C attention fit (%d vs %d keys)", NB, NA);
    mf_hwcal_note(h, "host ref (plain C, double accumulation): %.2f GMAC/s, latency %.2f us (1 thread)",
                  r->macs_per_s / 1e9, r->latency_ns / 1e3);
    return 0;
}

/* ---- vector code (the fast attention) --------------------------------------------------------- */

/* One thread of the vec measurement: pinned to its core, on its own queries and keys, it times
 * mf_kern_vec_attn (4 heads, head dim MF_VEC_D) over MF_VEC_NA and over MF_VEC_NB keys in turn,
 * reps times after one round not counted, each sample started with the other threads' (a barrier).
 * t[0], t[1]: the medians, ns per call. */
enum { MF_VEC_G = 4, MF_VEC_D = 512, MF_VEC_NA = 64, MF_VEC_NB = 512, MF_VEC_INNER_A = 8 };
typedef struct mf_vjob {
    mf_hwcal_thr thr;   /* first: mf_hwcal_pinned */
    float *mem;   /* queries G x D, keys NB x D, scores G x NB, acc G x D */
    int reps;
    double t[2];
} mf_vjob;

static void *mf_vjob_run(void *arg)
{
    mf_vjob *j = arg;
    if (mf_hwcal_thr_begin(&j->thr)) return NULL;
    float *q = j->mem, *k = q + MF_VEC_G * MF_VEC_D, *sc = k + (size_t)MF_VEC_NB * MF_VEC_D, *acc = sc + MF_VEC_G * MF_VEC_NB;
    const float *qh[MF_VEC_G], *kp[MF_VEC_NB];
    for (int g = 0; g < MF_VEC_G; g++) qh[g] = q + g * MF_VEC_D;
    for (int i = 0; i < MF_VEC_NB; i++) kp[i] = k + (size_t)i * MF_VEC_D;
    const float sink[MF_VEC_G] = {0.5f, -0.5f, 1.0f, 0.0f};
    float scale = (float)(1.0 / sqrt((double)MF_VEC_D));
    double den[MF_VEC_G], v[2][64], keep = 0;
    for (int r = -1; r < j->reps; r++)
        for (int s = 0; s < 2; s++) {
            if (j->thr.bar) pthread_barrier_wait(j->thr.bar);
            int n = s ? MF_VEC_NB : MF_VEC_NA, inner = s ? 1 : MF_VEC_INNER_A;
            int64_t t0 = mf_now_ns();
            for (int i = 0; i < inner; i++) {
                mf_kern_vec_attn(qh, MF_VEC_G, kp, n, MF_VEC_D, scale, sink, sc, acc, den);
                keep += den[0] + acc[i];
            }
            if (r >= 0) v[s][r] = (double)(mf_now_ns() - t0) / inner;
        }
    __asm__ volatile("" : : "g"(keep));
    for (int s = 0; s < 2; s++) j->t[s] = mf_hwcal_median(v[s], j->reps);
    return NULL;
}

/* host_vec: mf_kern_vec_attn (what the engine's fast attention heads run, host/kernels.h) on
 * threads_per_socket threads at once, pinned one per core of socket 0, each on its own data (in
 * cache: 1 MiB of keys); 2 G n D multiply-adds a call; two-point fit of the medians over threads. */
static int mf_hwcal_vec(mf_hwcal *h, const mf_hwcal_topo *t)
{
    mf_profile *p = h->p;
    int n_threads = p->threads_per_socket > 256 ? 256 : p->threads_per_socket, reps = h->o->quick ? 7 : 25;
    size_t per = (size_t)MF_VEC_G * MF_VEC_D + (size_t)MF_VEC_NB * MF_VEC_D + MF_VEC_G * MF_VEC_NB + MF_VEC_G * MF_VEC_D;
    per = (per + 15) / 16 * 16;   /* each thread's block on its own cache lines */
    float *mem = malloc(sizeof(float) * per * (size_t)n_threads);
    mf_vjob *jobs = calloc((size_t)n_threads, sizeof *jobs);
    if (!mem || !jobs) {
        free(mem);
        free(jobs);
        return mf_error(-ENOMEM, "calibrate: out of memory");
    }
    for (size_t i = 0; i < per * (size_t)n_threads; i++) mem[i] = (float)((int)(mf_hwcal_rand(h) % 2001) - 1000) * 1e-3f;
    for (int i = 0; i < n_threads; i++) jobs[i] = (mf_vjob){.mem = mem + per * (size_t)i, .reps = reps};
    int rc = mf_hwcal_pinned(t, n_threads, mf_vjob_run, jobs, sizeof jobs[0], "vec");
    if (rc) {
        free(mem);
        free(jobs);
        return rc;
    }
    double va[256], vb[256];
    for (int i = 0; i < n_threads; i++) va[i] = jobs[i].t[0], vb[i] = jobs[i].t[1];
    double ta = mf_hwcal_median(va, n_threads), tb = mf_hwcal_median(vb, n_threads);
    free(mem);
    free(jobs);
    double macs_a = 2.0 * MF_VEC_G * MF_VEC_NA * MF_VEC_D, macs_b = 2.0 * MF_VEC_G * MF_VEC_NB * MF_VEC_D;
    if (!(tb > ta))
        return mf_error(-EIO, "calibrate host vec: %d keys (%.0f ns) not slower than %d (%.0f ns): too noisy",
                        MF_VEC_NB, tb, MF_VEC_NA, ta);
    mf_profile_kern *r = &p->host_vec;
    r->bytes_per_s = 0;
    r->macs_per_s = (macs_b - macs_a) / (tb - ta) * 1e9;
    r->latency_ns = fmax(0.0, ta - macs_a / r->macs_per_s * 1e9);
    const char *simd = mf_kern_simd_name(mf_kern_simd_active());
    mf_hwcal_src(h, "host_vec_macs_per_s", "mf_kern_vec_attn (fast attention heads, %s): %d heads x dim %d, %d vs %d "
                 "keys, per thread, %d pinned threads at once, data in cache, medians of %d",
                 simd, MF_VEC_G, MF_VEC_D, MF_VEC_NB, MF_VEC_NA, n_threads, reps);
    mf_hwcal_src(h, "host_vec_latency_ns", "intercept of the same mf_kern_vec_attn fit (%d vs %d keys, %d threads at "
                 "once)", MF_VEC_NB, MF_VEC_NA, n_threads);
    mf_hwcal_note(h, "host vec (fp32 16-lane attention): %.2f GMAC/s, latency %.2f us (per thread, %d at once)",
                  r->macs_per_s / 1e9, r->latency_ns / 1e3, n_threads);
    return 0;
}

/* ---- executor -------------------------------------------------------------------------------- */

static int mf_empty_task(void *arg, mf_task_ctx *ctx) { return 0; }

/* Median ns per run of g, divided by `per`. */
static int mf_hwcal_sched_time(mf_sched *s, mf_graph *g, int reps, double per, double *ns)
{
    double v[16];
    for (int r = -1; r < reps; r++) {
        int64_t t0 = mf_now_ns();
        int rc = mf_sched_run(s, g, &(mf_run_opts){0});
        if (rc) return rc;
        if (r >= 0) v[r] = (double)(mf_now_ns() - t0) / per;
    }
    *ns = mf_hwcal_median(v, reps);
    return 0;
}

static mf_task_id mf_empty_add(mf_graph *g)
{
    return mf_graph_add_task(g, &(mf_task_desc){.name = "empty", .lane = 0, .fn = mf_empty_task,
                                                 .place_hint = -1, .cost = {.flops = 1}});
}

/* Two graphs of empty tasks on one CPU lane over every core: a chain (a successor may run on the
 * worker that finished its predecessor) and fork-joins as a step's layers make them (one task
 * releases one task per worker, all of which release the next join), whose critical path is two
 * tasks per stage and crosses workers. task_overhead_ns is the fork-join time per critical-path
 * task: what a dependent task waits for beyond its predecessor's work. */
static int mf_hwcal_executor(mf_hwcal *h)
{
    int n = h->o->quick ? 500 : 2000, stages = h->o->quick ? 100 : 400, reps = h->o->quick ? 3 : 5, rc;
    int workers = h->p->n_sockets * h->p->threads_per_socket;
    mf_lane_desc lane = {.kind = MF_LANE_CPU, .name = "cpu", .concurrency = 0, .numa_node = -1,
                         .model = {.flops_per_s = 1e9}};
    mf_sched *s = NULL;
    mf_graph *g = NULL, *fj = NULL;
    double chain_ns = 0, fj_ns = 0;
    if ((rc = mf_sched_create(&(mf_sched_opts){.lanes = &lane, .n_lanes = 1, .pin_threads = 1}, &s)) ||
        (rc = mf_graph_create(&lane, 1, &g)) || (rc = mf_graph_create(&lane, 1, &fj)))
        goto out;
    for (int i = 0; i < n; i++) {
        mf_task_id t = mf_empty_add(g);
        if (t < 0 || (i && (rc = mf_graph_add_dep(g, t - 1, t)))) {
            rc = t < 0 ? t : rc;
            goto out;
        }
    }
    mf_task_id join = mf_empty_add(fj);
    if (join < 0) {
        rc = join;
        goto out;
    }
    for (int st = 0; st < stages; st++) {
        mf_task_id next = -1;
        for (int w = 0; w <= workers; w++) {
            mf_task_id t = mf_empty_add(fj);   /* workers fan tasks, then the next join */
            if (t < 0) {
                rc = t;
                goto out;
            }
            if (w < workers) {
                if ((rc = mf_graph_add_dep(fj, join, t))) goto out;
            } else {
                next = t;
                for (int k = 0; k < workers; k++)
                    if ((rc = mf_graph_add_dep(fj, t - workers + k, t))) goto out;
            }
        }
        join = next;
    }
    if ((rc = mf_graph_finalize(g)) || (rc = mf_graph_finalize(fj)) ||
        (rc = mf_hwcal_sched_time(s, g, reps, n, &chain_ns)) ||
        (rc = mf_hwcal_sched_time(s, fj, reps, 2.0 * stages, &fj_ns)))
        goto out;
    h->p->task_overhead_ns = fj_ns;
    mf_hwcal_src(h, "task_overhead_ns", "%d fork-joins of empty tasks over %d pinned workers (1 -> %d -> 1): time per "
                 "critical-path task, median of %d (a plain chain: %.0f ns per task)", stages, workers, workers,
                 reps, chain_ns);
    mf_hwcal_note(h, "executor: %.2f us per critical-path task in fork-joins over %d workers (%.2f us in a chain)",
                  fj_ns / 1e3, workers, chain_ns / 1e3);
out:
    mf_graph_destroy(g);
    mf_graph_destroy(fj);
    mf_sched_destroy(s);
    return rc ? mf_error_wrap(rc, "calibrate: executor overhead") : 0;
}

/* ---- sleeping workers ------------------------------------------------------------------------ */

/* ns of the executor's idle loop (sched/lane_cpu.c): MF_SCHED_SPIN_ROUNDS relaxed loads of a
 * counter nobody changes, a pause each; the median of 15. */
static double mf_hwcal_spin_ns(void)
{
    _Atomic int seq = 0;
    double v[15];
    for (int r = -1; r < 15; r++) {
        int64_t t0 = mf_now_ns();
        for (int i = 0; i < MF_SCHED_SPIN_ROUNDS; i++) {
            if (atomic_load_explicit(&seq, memory_order_relaxed) != 0) break;
            _mm_pause();
        }
        if (r >= 0) v[r] = (double)(mf_now_ns() - t0);
    }
    return mf_hwcal_median(v, 15);
}

static int mf_busy_task(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    int64_t t0 = mf_now_ns(), ns = *(const int64_t *)arg;
    while (mf_now_ns() - t0 < ns) _mm_pause();
    return 0;
}

/* worker_spin_ns: the idle loop timed. worker_wake_ns: stages of one busy task (4 spins long, at
 * least 200 us: the other workers go to sleep meanwhile) that releases one task of 2 ms per
 * worker, which all release the next stage, on the real executor (pinned workers, the timeline
 * on): the median over stages and released tasks not run by the releasing worker of their start
 * minus the busy task's end. */
static int mf_hwcal_sleep(mf_hwcal *h)
{
    int stages = h->o->quick ? 20 : 60, rc, workers = h->p->n_sockets * h->p->threads_per_socket;
    double spin = mf_hwcal_spin_ns();
    int64_t busy_ns = (int64_t)fmax(4 * spin, 200e3), rel_ns = 2000000;   /* a released task: 2 ms */
    mf_lane_desc lane = {.kind = MF_LANE_CPU, .name = "cpu", .concurrency = 0, .numa_node = -1,
                         .model = {.flops_per_s = 1e9}};
    mf_sched *s = NULL;
    mf_graph *g = NULL;
    mf_timeline *tl = NULL;
    double *d = malloc(sizeof *d * (size_t)stages * (size_t)(workers > 1 ? workers : 1));
    mf_task_id *busy = malloc(sizeof *busy * (size_t)stages);
    int n_d = 0;
    if (!d || !busy) {
        rc = mf_error(-ENOMEM, "calibrate: out of memory");
        goto out;
    }
    if (workers < 2) {   /* one worker never waits for another to wake */
        h->p->worker_spin_ns = spin;
        h->p->worker_wake_ns = 0;
        mf_hwcal_src(h, "worker_spin_ns", "%d rounds of the executor's idle loop (a relaxed load and a pause), "
                     "median of 15", MF_SCHED_SPIN_ROUNDS);
        mf_hwcal_src(h, "worker_wake_ns", "one worker: no worker is woken for another's task (0)");
        rc = 0;
        goto out;
    }
    if ((rc = mf_sched_create(&(mf_sched_opts){.lanes = &lane, .n_lanes = 1, .pin_threads = 1}, &s)) ||
        (rc = mf_graph_create(&lane, 1, &g)))
        goto out;
    mf_task_id prev = -1;
    for (int st = 0; st < stages && !rc; st++) {
        mf_task_id b = busy[st] = mf_graph_add_task(g, &(mf_task_desc){.name = "busy", .lane = 0, .fn = mf_busy_task,
                                                                       .arg = &busy_ns, .place_hint = -1,
                                                                       .cost = {.flops = 1e6}});
        if (b < 0) {
            rc = b;
            break;
        }
        if (prev >= 0) rc = mf_graph_add_dep(g, prev, b);
        mf_task_id join = -1;
        for (int w = 0; w <= workers && !rc; w++) {
            /* released tasks of 2 ms: the releasing worker runs one of them, the others wait for
             * their own (woken) workers, unless a wake-up takes longer than that */
            mf_task_id t = w < workers ? mf_graph_add_task(g, &(mf_task_desc){.name = "released", .lane = 0,
                                                                                .fn = mf_busy_task, .arg = &rel_ns,
                                                                                .place_hint = -1,
                                                                                .cost = {.flops = 1e6}})
                                       : mf_empty_add(g);
            if (t < 0) {
                rc = t;
                break;
            }
            if (w < workers) {
                rc = mf_graph_add_dep(g, b, t);
            } else {
                join = t;
                for (int k = 0; k < workers && !rc; k++) rc = mf_graph_add_dep(g, t - workers + k, t);
            }
        }
        prev = join;
    }
    if (rc || (rc = mf_graph_finalize(g)) || (rc = mf_timeline_create(g, &tl))) goto out;
    for (int r = 0; r < 2 && !rc; r++) {   /* the first run warms up; the second counts */
        if ((rc = mf_sched_run(s, g, &(mf_run_opts){.timeline = tl}))) break;
        if (r == 0) continue;
        const mf_task_span *sp = mf_timeline_spans(tl);
        for (int st = 0; st < stages; st++) {
            mf_task_id b = busy[st];
            for (int w = 0; w < workers; w++) {
                const mf_task_span *x = &sp[b + 1 + w];
                if (x->worker != sp[b].worker) d[n_d++] = (double)(x->start_ns - sp[b].end_ns);
            }
        }
    }
    if (rc) goto out;
    /* a wake-up slower than a released task loses its sample (the releasing worker ran the task):
     * with none left, the released task's length is a lower bound */
    h->p->worker_spin_ns = spin;
    h->p->worker_wake_ns = n_d ? fmax(0.0, mf_hwcal_median(d, n_d)) : (double)rel_ns;
    mf_hwcal_src(h, "worker_spin_ns", "%d rounds of the executor's idle loop (a relaxed load and a pause), median "
                 "of 15", MF_SCHED_SPIN_ROUNDS);
    mf_hwcal_src(h, "worker_wake_ns", "%d busy tasks of %.0f us on %d pinned workers releasing one 2 ms task per "
                 "worker: start minus busy end on woken workers, median of %d of %d%s", stages, busy_ns / 1e3,
                 workers, n_d, stages * (workers - 1), n_d ? "" : " (none: at least 2 ms)");
    mf_hwcal_note(h, "executor: idle workers spin %.1f us, then sleep; a sleeping worker starts a task %.1f us after "
                  "its release", spin / 1e3, h->p->worker_wake_ns / 1e3);
out:
    mf_timeline_destroy(tl);
    mf_graph_destroy(g);
    mf_sched_destroy(s);
    free(d);
    free(busy);
    return rc ? mf_error_wrap(rc, "calibrate: sleeping workers") : 0;
}

/* ---- the host phase and the whole run -------------------------------------------------------- */

static size_t mf_hwcal_llc(void)
{
    size_t best = 0;
    for (int i = 0; i < 8; i++) {
        char path[96], buf[32];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        if (fgets(buf, sizeof buf, f)) {
            char *end;
            size_t v = strtoull(buf, &end, 10);
            if (*end == 'K') v <<= 10;
            else if (*end == 'M') v <<= 20;
            if (v > best) best = v;
        }
        fclose(f);
    }
    return best;
}

int mf_hwcal_host(mf_hwcal *h)
{
    mf_hwcal_topo t;
    int rc = mf_hwcal_topo_load(&t);
    if (rc) return rc;
    mf_profile *p = h->p;
    p->n_sockets = t.n_packages;
    p->threads_per_socket = t.cores_per_package;
    mf_hwcal_src(h, "n_sockets", "hwloc: %d package%s, %d NUMA node%s", t.n_packages, t.n_packages > 1 ? "s" : "",
                 t.n_numa, t.n_numa > 1 ? "s" : "");
    mf_hwcal_src(h, "threads_per_socket", "hwloc: cores per package (the executor runs one CPU worker per core)");
    h->llc_bytes = mf_hwcal_llc();
    if (!(rc = mf_hwcal_memory(h, &t)) && !(rc = mf_hwcal_kernels(h, &t)) && !(rc = mf_hwcal_ref(h)) &&
        !(rc = mf_hwcal_vec(h, &t)))
        rc = mf_hwcal_executor(h);
    if (!rc) rc = mf_hwcal_sleep(h);
    hwloc_topology_destroy(t.topo);
    return rc;
}

/* Measured figures carry 4 significant digits: the rest is noise, and the file stays readable. */
static void mf_round4(double *v)
{
    if (*v == 0 || !isfinite(*v)) return;
    char b[40];
    snprintf(b, sizeof b, "%.4g", *v);
    *v = strtod(b, NULL);
}

static void mf_hwcal_round(mf_profile *p)
{
    double *f[] = {&p->mem_bytes_per_s, &p->cross_socket_factor, &p->task_overhead_ns, &p->worker_spin_ns,
                   &p->worker_wake_ns, &p->disk_bytes_per_s,
                   &p->disk_latency_ns, &p->h2d_bytes_per_s, &p->h2d_latency_ns, &p->d2h_bytes_per_s,
                   &p->d2h_latency_ns, &p->h2d_total_bytes_per_s};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) mf_round4(f[i]);
    mf_round4(&p->host_vec.macs_per_s);
    mf_round4(&p->host_vec.latency_ns);
    for (int k = 0; k < MF_KF_N; k++) {
        mf_round4(&p->host[k].bytes_per_s);
        mf_round4(&p->host[k].macs_per_s);
        mf_round4(&p->host[k].latency_ns);
        mf_round4(&p->card[k].bytes_per_s);
        mf_round4(&p->card[k].macs_per_s);
        mf_round4(&p->card[k].latency_ns);
    }
}

int mf_hwcal_run(const mf_hwcal_opts *o, mf_profile *out)
{
    memset(out, 0, sizeof *out);
    mf_hwcal h = {.o = o, .p = out, .rng = 0x2545f4914f6cdd1dull};
    mf_hwcal_host_date(h.who, sizeof h.who);
    if (o->name) {
        if (!*o->name || strlen(o->name) >= sizeof out->keys[0].value || strpbrk(o->name, "#\n\r"))
            return mf_error(-EINVAL, "calibrate: profile name '%s': expected 1..%zu characters without '#'", o->name,
                            sizeof out->keys[0].value - 1);
        snprintf(out->name, sizeof out->name, "%s", o->name);
    } else {
        char host[64] = "host";
        gethostname(host, sizeof host - 1);
        host[sizeof host - 1] = '\0';
        snprintf(out->name, sizeof out->name, "calibrated-%.30s", host);
    }
    int64_t t0 = mf_now_ns();
    int rc;
    mf_hwcal_note(&h, "measuring %s (%s)", h.who, o->quick ? "quick" : "full");
    if ((rc = mf_hwcal_host(&h)) || (rc = mf_hwcal_disk(&h)) || (rc = mf_hwcal_cards(&h))) return rc;
    mf_hwcal_round(out);
    mf_hwcal_note(&h, "done in %.1f s", (mf_now_ns() - t0) / 1e9);
    return 0;
}
