/* Hardware calibration, disk (graphs/calib/hwcal.h): a temporary file under the chosen directory,
 * written and read with O_DIRECT (never through the page cache) through the executor's IO lane,
 * as the expert store reads: per-request latency from a chain of small reads, bandwidth and the
 * useful queue depth from 1 MiB reads at random offsets at depths 1..64. The file is unlinked as
 * soon as it is open, so it is gone even if calibration stops halfway. */
#define _GNU_SOURCE
#include "graphs/calib/hwcal_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "host/dio.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "sched/graph.h"
#include "sched/sched.h"

#define MF_DISK_REQ (1u << 20)   /* bandwidth requests: about an expert matrix */
#define MF_DISK_WRITE (4u << 20)

/* Writes n_bytes of random data to a new file under dir with O_DIRECT and syncs it. */
static int mf_disk_make(mf_hwcal *h, const char *dir, uint64_t n_bytes, char *path, size_t cap)
{
    snprintf(path, cap, "%s/moeflow-calibrate.XXXXXX", dir);
    int fd = mkstemp(path);
    if (fd < 0) {
        int e = errno;
        return mf_error(-e, "calibrate: cannot create a temporary file in %s: %s", dir, strerror(e));
    }
    int rc = 0;
    void *buf = NULL;
    if (fcntl(fd, F_SETFL, O_DIRECT) != 0) {
        int e = errno;
        rc = mf_error(-ENOTSUP, "calibrate: %s refuses O_DIRECT (%s; tmpfs does): the disk is measured without "
                      "the page cache, so give --dir on the disk that will hold the checkpoint", dir, strerror(e));
        goto out;
    }
    if (posix_memalign(&buf, 4096, MF_DISK_WRITE)) {
        rc = mf_error(-ENOMEM, "calibrate: out of memory");
        goto out;
    }
    mf_hwcal_fill(h, buf, MF_DISK_WRITE, 1);
    for (uint64_t off = 0; off < n_bytes; off += MF_DISK_WRITE) {
        ((uint64_t *)buf)[0] = off;   /* no two blocks alike */
        ssize_t w = pwrite(fd, buf, MF_DISK_WRITE, (off_t)off);
        if (w != (ssize_t)MF_DISK_WRITE) {
            int e = w < 0 ? errno : ENOSPC;
            rc = mf_error(-e, "calibrate: writing %s: %s (it needs %llu MiB free)", path, strerror(e),
                          (unsigned long long)(n_bytes >> 20));
            goto out;
        }
    }
    if (fdatasync(fd) != 0) {
        int e = errno;
        rc = mf_error(-e, "calibrate: syncing %s: %s", path, strerror(e));
    }
out:
    free(buf);
    close(fd);
    if (rc) unlink(path);
    return rc;
}

/* Runs n reads of `size` bytes at random aligned offsets through an IO lane of `depth`, as a
 * chain (chain = 1: one after another) or all independent; returns the wall time in ns. */
static int mf_disk_run(mf_hwcal *h, const mf_dio_file *f, uint8_t *bufs, size_t buf_slot, int n_bufs, int depth,
                       int n, uint64_t size, int chain, double *ns)
{
    mf_lane_desc lane = {.kind = MF_LANE_IO, .name = "io", .concurrency = depth, .numa_node = -1,
                         .model = {.bytes_per_s = 1e9}};
    mf_sched *s = NULL;
    mf_graph *g = NULL;
    mf_io_read *reads = calloc((size_t)n, sizeof *reads);
    int rc = reads ? 0 : mf_error(-ENOMEM, "calibrate: out of memory");
    if (rc || (rc = mf_sched_create(&(mf_sched_opts){.lanes = &lane, .n_lanes = 1}, &s)) ||
        (rc = mf_graph_create(&lane, 1, &g)))
        goto out;
    uint64_t slots = f->size_bytes / size;
    for (int i = 0; i < n; i++) {
        reads[i] = (mf_io_read){.fd = f->fd, .offset = (mf_hwcal_rand(h) % slots) * size,
                                .buf = bufs + buf_slot * (size_t)(i % n_bufs), .n_bytes = size,
                                .dio_align = f->dio_align};
        mf_task_id t = mf_graph_add_task(g, &(mf_task_desc){.name = "read", .lane = 0, .arg = &reads[i],
                                                             .cost = {.bytes = (double)size}, .place_hint = -1});
        if (t < 0) {
            rc = t;
            goto out;
        }
        if (chain && i && (rc = mf_graph_add_dep(g, t - 1, t))) goto out;
    }
    if ((rc = mf_graph_finalize(g))) goto out;
    int64_t t0 = mf_now_ns();
    rc = mf_sched_run(s, g, &(mf_run_opts){0});
    *ns = (double)(mf_now_ns() - t0);
out:
    mf_graph_destroy(g);
    mf_sched_destroy(s);
    free(reads);
    return rc;
}

int mf_hwcal_disk(mf_hwcal *h)
{
    const char *dir = h->o->dir ? h->o->dir : ".";
    uint64_t file_bytes = h->o->disk_bytes ? h->o->disk_bytes : (uint64_t)(h->o->quick ? 64 : 256) << 20;
    file_bytes = (file_bytes + MF_DISK_WRITE - 1) / MF_DISK_WRITE * MF_DISK_WRITE;
    if (file_bytes < (8u << 20)) file_bytes = 8u << 20;
    char path[4200];
    mf_dio_file f = {.fd = -1};
    uint8_t *bufs = NULL;
    int rc = mf_disk_make(h, dir, file_bytes, path, sizeof path);
    if (rc) return rc;
    rc = mf_dio_open(path, 1, &f);
    unlink(path);   /* gone from the directory now; its blocks go when f closes */
    if (rc) return rc;
    if (f.dio_align == 0) {
        rc = mf_error(-ENOTSUP, "calibrate: %s refuses O_DIRECT reads: give --dir on the disk that will hold "
                      "the checkpoint", dir);
        goto out;
    }
    mf_hwcal_note(h, "disk: %llu MiB temporary file in %s, O_DIRECT (alignment %u)",
                  (unsigned long long)(file_bytes >> 20), dir, f.dio_align);
    const int max_depth = 64;
    if (posix_memalign((void **)&bufs, 4096, (size_t)max_depth * MF_DISK_REQ)) {
        rc = mf_error(-ENOMEM, "calibrate: out of memory");
        goto out;
    }
    memset(bufs, 0, (size_t)max_depth * MF_DISK_REQ);

    /* latency: a chain of small reads at depth 1 */
    uint64_t small = f.dio_align > 4096 ? f.dio_align : 4096;
    int n_lat = h->o->quick ? 64 : 256;
    double v[8], ns;
    int reps = 3;
    for (int r = 0; r < reps && !rc; r++) {
        rc = mf_disk_run(h, &f, bufs, MF_DISK_REQ, 1, 1, n_lat, small, 1, &ns);
        v[r] = ns / n_lat;
    }
    if (rc) goto out;
    mf_profile *p = h->p;
    p->disk_latency_ns = mf_hwcal_median(v, reps);
    mf_hwcal_src(h, "disk_latency_ns", "a chain of %d O_DIRECT %llu-byte reads at random offsets of a %llu MiB "
                 "file in %s through the IO lane, depth 1: time / reads, median of %d", n_lat,
                 (unsigned long long)small, (unsigned long long)(file_bytes >> 20), dir, reps);

    /* bandwidth at depths 1..64: 1 MiB reads at random offsets */
    static const int depths[] = {1, 2, 4, 8, 16, 32, 64};
    double bw[7], best = 0;
    int n_bw = h->o->quick ? 32 : 128;
    for (int d = 0; d < 7 && !rc; d++) {
        int n = n_bw > 2 * depths[d] ? n_bw : 2 * depths[d];
        rc = mf_disk_run(h, &f, bufs, MF_DISK_REQ, max_depth, depths[d], n, MF_DISK_REQ, 0, &ns);
        bw[d] = (double)n * MF_DISK_REQ / (ns / 1e9);
        if (bw[d] > best) best = bw[d];
    }
    if (rc) goto out;
    int qd = 64;
    for (int d = 6; d >= 0; d--)
        if (bw[d] >= 0.9 * best) qd = depths[d];
    p->disk_bytes_per_s = best;
    p->disk_queue_depth = qd;
    mf_hwcal_src(h, "disk_bytes_per_s", "O_DIRECT 1 MiB reads at random offsets of a %llu MiB file in %s, IO lane "
                 "at depths 1..64 (%d reads each): the best (%.0f MB/s at depth 1)",
                 (unsigned long long)(file_bytes >> 20), dir, n_bw, bw[0] / 1e6);
    mf_hwcal_src(h, "disk_queue_depth", "the smallest depth whose 1 MiB random-read bandwidth is within 10%% of the "
                 "best (depths 1..64: %.0f %.0f %.0f %.0f %.0f %.0f %.0f MB/s)", bw[0] / 1e6, bw[1] / 1e6,
                 bw[2] / 1e6, bw[3] / 1e6, bw[4] / 1e6, bw[5] / 1e6, bw[6] / 1e6);
    mf_hwcal_note(h, "disk: %.0f MB/s (1 MiB reads; %.0f MB/s at depth 1), %.1f us per small read, depth %d",
                  best / 1e6, bw[0] / 1e6, p->disk_latency_ns / 1e3, qd);
out:
    free(bufs);
    mf_dio_close(&f);
    return rc ? mf_error_wrap(rc, "calibrate: disk") : 0;
}
