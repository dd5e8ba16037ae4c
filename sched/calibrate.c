/* Lane-model calibration (calibrate.h): runs chains of tasks of three sizes through the real
 * executor, takes the median makespan per task over a few repetitions, and fits time = latency +
 * size / rate by least squares. Reads go to a file the caller keeps in the page cache, so the IO
 * fit describes cached reads (memory copies through the IO lane), independent of drop_caches. */
#define _GNU_SOURCE
#include "sched/calibrate.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sched/clock.h"
#include "sched/error.h"
#include "sched/timeline.h"

#define CALIB_CHAIN_CPU 16 /* tasks per chain: about 64 ms at the largest CPU point */
#define CALIB_CHAIN_IO 48  /* reads are shorter: about 20 ms at the largest IO point */
#define CALIB_REPS 3       /* runs per point; the median counts */
#define CALIB_POINTS 3
#define CALIB_IO_AREA (64u << 20)   /* read destinations rotate through more than the LLC */

/* Not inlined, so the direct timing probe below cannot be folded away. */
__attribute__((noinline)) int mf_calib_fma_task(void *arg, mf_task_ctx *ctx)
{
    mf_calib_fma *w = arg;
    /* 8 independent FMA chains (enough to fill two FMA pipes of 4-cycle latency): 16 flops per
     * iteration. The values converge to 1 and never overflow or go subnormal. */
    uint64_t n = w->flops > 0 ? (uint64_t)(w->flops / 16.0) : 0;
    double a0 = 1.0, a1 = 1.1, a2 = 1.2, a3 = 1.3, a4 = 1.4, a5 = 1.5, a6 = 1.6, a7 = 1.7;
    const double x = 0.9999999, y = 1e-7;
    for (uint64_t i = 0; i < n; i++) {
        a0 = fma(a0, x, y);
        a1 = fma(a1, x, y);
        a2 = fma(a2, x, y);
        a3 = fma(a3, x, y);
        a4 = fma(a4, x, y);
        a5 = fma(a5, x, y);
        a6 = fma(a6, x, y);
        a7 = fma(a7, x, y);
    }
    w->sink = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* What one measurement runs: FMA tasks of `size` flops or reads of `size` bytes. */
typedef struct calib_work {
    int io;
    int fd;
    uint64_t file_bytes;
} calib_work;

/* Runs k chains of CALIB_CHAIN_* tasks of `size` on `lane` CALIB_REPS times (after one warm-up)
 * and stores the median makespan divided by the chain length in *per_task_ns. */
static int calib_measure(mf_sched *s, const mf_lane_desc *lanes, int n_lanes, int lane,
                         const calib_work *w, int k, double size, double *per_task_ns)
{
    int chain = w->io ? CALIB_CHAIN_IO : CALIB_CHAIN_CPU, n = k * chain, rc;
    mf_graph *g = NULL;
    mf_timeline *tl = NULL;
    mf_calib_fma *fma_args = NULL;
    mf_io_read *reads = NULL;
    char *bufs = NULL;
    size_t buf_bytes = ((size_t)size + 4095) & ~(size_t)4095;
    size_t n_bufs = CALIB_IO_AREA / buf_bytes > 0 ? CALIB_IO_AREA / buf_bytes : 1;

    if ((rc = mf_graph_create(lanes, n_lanes, &g)) < 0)
        goto out;
    if (w->io) {
        reads = calloc((size_t)n, sizeof *reads);
        if (!reads || posix_memalign((void **)&bufs, 4096, buf_bytes * n_bufs)) {
            rc = mf_error(-ENOMEM, "calibrate: out of memory for %zu read buffers of %zu bytes",
                          n_bufs, buf_bytes);
            goto out;
        }
        memset(bufs, 0, buf_bytes * n_bufs);   /* fault the pages in before timing */
    } else if (!(fma_args = calloc((size_t)n, sizeof *fma_args))) {
        rc = mf_error(-ENOMEM, "calibrate: out of memory");
        goto out;
    }
    for (int c = 0; c < k; c++) {
        for (int i = 0; i < chain; i++) {
            int j = c * chain + i;
            mf_task_desc d = {.name = "calib", .lane = lane, .place_hint = -1};
            if (w->io) {
                /* Successive reads walk through the file and through the destination area, so
                 * neither side of the copy is cache-hot, as with real expert loads. */
                uint64_t slots = w->file_bytes / (uint64_t)size;
                reads[j] = (mf_io_read){.fd = w->fd,
                                        .offset = ((uint64_t)j % (slots ? slots : 1)) * (uint64_t)size,
                                        .buf = bufs + ((size_t)j % n_bufs) * buf_bytes,
                                        .n_bytes = (uint64_t)size};
                d.arg = &reads[j];
                d.cost.bytes = size;
            } else {
                fma_args[j].flops = size;
                d.fn = mf_calib_fma_task;
                d.arg = &fma_args[j];
                d.cost.flops = size;
            }
            mf_task_id t = mf_graph_add_task(g, &d);
            if (t < 0) {
                rc = t;
                goto out;
            }
            if (i > 0 && (rc = mf_graph_add_dep(g, t - 1, t)) < 0)
                goto out;
        }
    }
    if ((rc = mf_graph_finalize(g)) < 0 || (rc = mf_timeline_create(g, &tl)) < 0)
        goto out;
    double ms[CALIB_REPS];
    for (int r = -1; r < CALIB_REPS; r++) {
        mf_run_opts ro = {.timeline = tl};
        if ((rc = mf_sched_run(s, g, &ro)) < 0) {
            mf_error_wrap(rc, "calibrate lane %d", lane);
            goto out;
        }
        mf_timeline_summary sum;
        if ((rc = mf_timeline_summarize(tl, &sum)) < 0)
            goto out;
        if (r >= 0)
            ms[r] = (double)sum.makespan_ns;
    }
    qsort(ms, CALIB_REPS, sizeof *ms, cmp_double);
    *per_task_ns = ms[CALIB_REPS / 2] / chain;
    rc = 0;
out:
    mf_timeline_destroy(tl);
    mf_graph_destroy(g);
    free(fma_args);
    free(reads);
    free(bufs);
    return rc;
}

/* Least-squares fit of y = lat + x / rate (x in task units, y in ns); a negative intercept is
 * clamped to 0 and the slope refitted through the origin. */
static int calib_fit(const double *x, const double *y, int n, mf_lane_model *m, int io,
                     double *max_resid)
{
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    for (int i = 0; i < n; i++) {
        sx += x[i];
        sy += y[i];
        sxx += x[i] * x[i];
        sxy += x[i] * y[i];
    }
    double slope = (n * sxy - sx * sy) / (n * sxx - sx * sx);
    double lat = (sy - slope * sx) / n;
    if (lat < 0) {
        lat = 0;
        slope = sxy / sxx;
    }
    if (!(slope > 0))
        return mf_error(-EIO, "calibrate: time per task does not grow with its size (slope %g "
                        "ns per unit); the machine is too noisy to fit", slope);
    memset(m, 0, sizeof *m);
    m->latency_ns = lat;
    if (io)
        m->bytes_per_s = 1e9 / slope;
    else
        m->flops_per_s = 1e9 / slope;
    for (int i = 0; i < n; i++) {
        double r = fabs(y[i] - (lat + slope * x[i])) / y[i];
        if (r > *max_resid)
            *max_resid = r;
    }
    return 0;
}

static int calib_lane(mf_sched *s, const mf_lane_desc *lanes, int n_lanes, int lane,
                      const calib_work *w, const double *sizes, mf_calib_fit *out)
{
    memset(out, 0, sizeof *out);
    int k = lanes[lane].concurrency > 0 ? lanes[lane].concurrency
                                        : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (k < 1)
        k = 1;
    out->concurrency = k;
    for (int pass = 0; pass < 2; pass++) {
        double *y = pass ? out->all_ns : out->one_ns;
        for (int i = 0; i < CALIB_POINTS; i++) {
            out->size[i] = sizes[i];
            int rc = calib_measure(s, lanes, n_lanes, lane, w, pass ? k : 1, sizes[i], &y[i]);
            if (rc < 0)
                return rc;
        }
        int rc = calib_fit(sizes, y, CALIB_POINTS, pass ? &out->all : &out->one, w->io,
                           &out->max_resid);
        if (rc < 0)
            return mf_error_wrap(rc, "lane %d ('%s')", lane, lanes[lane].name);
    }
    return 0;
}

static int calib_check(const mf_lane_desc *lanes, int n_lanes, int lane, mf_lane_kind want)
{
    if (!lanes || lane < 0 || lane >= n_lanes)
        return mf_error(-EINVAL, "calibrate: lane %d is not one of the %d lanes", lane, n_lanes);
    if (lanes[lane].kind != want)
        return mf_error(-EINVAL, "calibrate: lane %d ('%s') is not a%s lane", lane,
                        lanes[lane].name ? lanes[lane].name : "", want == MF_LANE_IO ? "n IO" : " CPU");
    return 0;
}

int mf_calibrate_cpu(mf_sched *s, const mf_lane_desc *lanes, int n_lanes, int lane,
                     mf_calib_fit *out)
{
    int rc = calib_check(lanes, n_lanes, lane, MF_LANE_CPU);
    if (rc < 0)
        return rc;
    /* Size the points from a direct probe of the kernel: about 50 us, 1 ms and 4 ms per task. */
    static volatile double probe_sink;
    mf_calib_fma probe = {.flops = 4e6};
    mf_calib_fma_task(&probe, NULL);
    int64_t t0 = mf_now_ns();
    mf_calib_fma_task(&probe, NULL);
    double rate = probe.flops / ((double)(mf_now_ns() - t0 + 1) * 1e-9);
    probe_sink = probe.sink;
    (void)probe_sink;
    if (rate > 1e12)   /* cannot be: a broken clock or a vanished loop */
        return mf_error(-EIO, "calibrate: the FMA probe ran at %.3g flop/s, which is impossible",
                        rate);
    double sizes[CALIB_POINTS] = {rate * 50e-6, rate * 1e-3, rate * 4e-3};
    calib_work w = {.io = 0};
    return calib_lane(s, lanes, n_lanes, lane, &w, sizes, out);
}

int mf_calibrate_io(mf_sched *s, const mf_lane_desc *lanes, int n_lanes, int lane, int fd,
                    uint64_t file_bytes, mf_calib_fit *out)
{
    int rc = calib_check(lanes, n_lanes, lane, MF_LANE_IO);
    if (rc < 0)
        return rc;
    if (file_bytes < (8u << 20))
        return mf_error(-EINVAL, "calibrate: the IO file has %llu bytes, at least 8 MiB needed",
                        (unsigned long long)file_bytes);
    double sizes[CALIB_POINTS] = {256 << 10, 2 << 20, 8 << 20};
    calib_work w = {.io = 1, .fd = fd, .file_bytes = file_bytes};
    return calib_lane(s, lanes, n_lanes, lane, &w, sizes, out);
}

int mf_calib_file_create(const char *dir, uint64_t n_bytes, int *fd_out)
{
    *fd_out = -1;
    char path[4096];
    snprintf(path, sizeof path, "%s/moeflow-calib-XXXXXX", dir ? dir : "/tmp");
    int fd = mkstemp(path);
    if (fd < 0)
        return mf_error(-errno, "%s: cannot create the calibration file: %s", path, strerror(errno));
    unlink(path);
    enum { CHUNK = 1 << 20 };
    uint64_t *chunk = malloc(CHUNK);
    if (!chunk) {
        close(fd);
        return mf_error(-ENOMEM, "calibrate: out of memory");
    }
    for (size_t i = 0; i < CHUNK / sizeof *chunk; i++)
        chunk[i] = 0x9e3779b97f4a7c15ull * (i + 1);
    int rc = 0;
    for (uint64_t off = 0; off < n_bytes && !rc; off += CHUNK) {
        size_t len = n_bytes - off < CHUNK ? (size_t)(n_bytes - off) : CHUNK;
        if (pwrite(fd, chunk, len, (off_t)off) != (ssize_t)len)
            rc = mf_error(-EIO, "%s: writing the calibration file failed: %s", path, strerror(errno));
    }
    /* Read it back once: every later read is served from the page cache. */
    for (uint64_t off = 0; off < n_bytes && !rc; off += CHUNK) {
        size_t len = n_bytes - off < CHUNK ? (size_t)(n_bytes - off) : CHUNK;
        if (pread(fd, chunk, len, (off_t)off) != (ssize_t)len)
            rc = mf_error(-EIO, "%s: reading the calibration file back failed: %s", path,
                          strerror(errno));
    }
    free(chunk);
    if (rc) {
        close(fd);
        return rc;
    }
    *fd_out = fd;
    return 0;
}
