/* `moeflow bench io --file F`: the host IO path against plain baselines measured in the same run.
 * Sequential: the store's reads (IO lane, O_DIRECT, large requests, many in flight, registered
 * buffers) vs `dd if=F of=/dev/null bs=4M iflag=direct` run as a subprocess. Scattered: random
 * 264-byte rows (an Engram row: 256 fp8 codes + 8 scales) gathered at depth through the IO lane
 * vs a pread loop of the same rows. The file is dropped from the page cache before each phase
 * (posix_fadvise DONTNEED) and mincore says how much of it was still cached. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "host/dio.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "sched/graph.h"
#include "sched/sched.h"
#include "tools/commands.h"

static double mf_cpu_s(void)
{
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

#define MF_BENCH_MAX_REPS 16

static int mf_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median of n values (sorts a copy). */
static double mf_median(const double *v, int n)
{
    double w[MF_BENCH_MAX_REPS + 1];
    memcpy(w, v, sizeof *v * (size_t)n);
    qsort(w, (size_t)n, sizeof *w, mf_cmp_double);
    return n % 2 ? w[n / 2] : (w[n / 2 - 1] + w[n / 2]) / 2;
}

/* "a, b, c" of n values scaled by mul. */
static const char *mf_list(char *buf, size_t cap, const double *v, int n, double mul, const char *fmt)
{
    size_t k = 0;
    buf[0] = 0;
    for (int i = 0; i < n && k + 16 < cap; i++) {
        if (i) k += (size_t)snprintf(buf + k, cap - k, ", ");
        k += (size_t)snprintf(buf + k, cap - k, fmt, v[i] * mul);
    }
    return buf;
}

static void mf_bench_io_usage(FILE *f)
{
    fprintf(f,
            "usage: moeflow bench io --file F [--depth N] [--request-mib N] [--rows N] [--json]\n"
            "\n"
            "Sequential read throughput of F through the IO lane (O_DIRECT where allowed, requests\n"
            "of --request-mib MiB (default 4), --depth in flight (default 64), registered buffers)\n"
            "against `dd if=F of=/dev/null bs=4M iflag=direct` in the same run; then --rows random\n"
            "264-byte rows (default 20000) gathered at depth against a pread loop of the same rows\n"
            "(buffered, readahead off). F is dropped from the page cache before each phase.\n"
            "--json prints the numbers, including seq_fraction_of_dd and gather_speedup.\n");
}

/* Drops path from the page cache; returns the fraction of its pages (or of the pages of `offs`
 * when given) still resident afterwards, or -1 when mincore is unavailable. */
static double mf_bench_drop(int fd, uint64_t size, const uint64_t *offs, int n)
{
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    long pg = sysconf(_SC_PAGESIZE);
    size_t npg = (size_t)((size + (uint64_t)pg - 1) / (uint64_t)pg);
    void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) return -1;
    unsigned char *vec = malloc(npg ? npg : 1);
    double frac = -1;
    if (vec && mincore(map, (size_t)size, vec) == 0) {
        uint64_t hit = 0, tot = 0;
        if (offs) {
            for (int i = 0; i < n; i++, tot++) hit += vec[offs[i] / (uint64_t)pg] & 1;
        } else {
            for (size_t i = 0; i < npg; i++, tot++) hit += vec[i] & 1;
        }
        frac = tot ? (double)hit / (double)tot : 0;
    }
    free(vec);
    munmap(map, (size_t)size);
    return frac;
}

/* Runs dd with O_DIRECT over the first `bytes` of path; bytes/s from dd's own summary line. */
static int mf_bench_dd(const char *path, uint64_t bytes, double *bps)
{
    char cmd[4400];
    snprintf(cmd, sizeof cmd, "dd if='%s' of=/dev/null bs=4M count=%" PRIu64 " iflag=direct 2>&1",
             path, bytes >> 22);
    FILE *p = popen(cmd, "r");
    if (!p) return mf_error(-errno, "cannot run dd: %s", strerror(errno));
    char line[512], last[512] = "";
    while (fgets(line, sizeof line, p))
        if (strstr(line, "copied")) snprintf(last, sizeof last, "%s", line);
    int st = pclose(p);
    unsigned long long n = 0;
    double secs = 0;
    /* "N bytes (...) copied, T s, X GB/s" */
    const char *c = strstr(last, "copied,");
    if (st != 0 || sscanf(last, "%llu", &n) != 1 || !c || sscanf(c + 7, "%lf", &secs) != 1 || secs <= 0)
        return mf_error(-EIO, "dd on %s failed or printed no summary (status %d): %s", path, st, last);
    *bps = (double)n / secs;
    return 0;
}

int mf_bench_io(int argc, char **argv)
{
    const char *path = NULL;
    int json = 0, depth = 64, n_rows = 20000, gather_buffered = 0, reps = 3;
    long req_mib = 4;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int hv = i + 1 < argc;
        char *end = NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            mf_bench_io_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--file") && hv) {
            path = argv[++i];
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (!strcmp(a, "--reps") && hv) {
            reps = (int)strtol(argv[++i], &end, 10);
            if (*end || reps < 1 || reps > MF_BENCH_MAX_REPS) {
                fprintf(stderr, "moeflow bench io: --reps: expected 1..%d, found '%s'\n", MF_BENCH_MAX_REPS, argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--gather-buffered")) {
            gather_buffered = 1;
        } else if (!strcmp(a, "--depth") && hv) {
            depth = (int)strtol(argv[++i], &end, 10);
            if (*end || depth < 1 || depth > 4096) {
                fprintf(stderr, "moeflow bench io: --depth: expected 1..4096, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--request-mib") && hv) {
            req_mib = strtol(argv[++i], &end, 10);
            if (*end || req_mib < 1 || req_mib > 256) {
                fprintf(stderr, "moeflow bench io: --request-mib: expected 1..256, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--rows") && hv) {
            n_rows = (int)strtol(argv[++i], &end, 10);
            if (*end || n_rows < 1 || n_rows > 10000000) {
                fprintf(stderr, "moeflow bench io: --rows: expected 1..10000000, found '%s'\n", argv[i]);
                return 2;
            }
        } else {
            fprintf(stderr, "moeflow bench io: unknown argument '%s'\n\n", a);
            mf_bench_io_usage(stderr);
            return 2;
        }
    }
    if (!path) {
        mf_bench_io_usage(stderr);
        return 2;
    }
    uint64_t req = (uint64_t)req_mib << 20, row = 264;
    mf_dio_file f;
    int bfd = -1, rc = mf_dio_open(path, 1, &f);
    if (rc) {
        fprintf(stderr, "moeflow bench io: %s\n", mf_last_error());
        return 1;
    }
    uint64_t size = f.size_bytes, seq_bytes = size / (UINT64_C(4) << 20) * (UINT64_C(4) << 20);
    if (seq_bytes < req || size < 1 << 20) {
        fprintf(stderr, "moeflow bench io: %s has %" PRIu64 " bytes; give a file of at least a few "
                "hundred MiB\n", path, size);
        mf_dio_close(&f);
        return 2;
    }
    int ret = 1;
    mf_sched *s = NULL;
    mf_graph *g = NULL, *gg = NULL;
    uint8_t *bufs = NULL, *rowbuf = NULL;
    mf_io_read *rd = NULL, *rr = NULL;
    uint64_t *offs = NULL;
    mf_lane_desc lane = {.kind = MF_LANE_IO, .name = "io", .concurrency = depth, .numa_node = -1};
    if ((rc = mf_sched_create(&(mf_sched_opts){.lanes = &lane, .n_lanes = 1,
                                               .io_force_pread = mf_tool_io_env.force_pread,
                                               .io_fault_kind = mf_tool_io_env.fault_kind,
                                               .io_fault_nth = mf_tool_io_env.fault_nth}, &s)))
        goto fail;

    /* ---- sequential ---- */
    int n_buf = depth;
    size_t n_req = (size_t)(seq_bytes / req);
    if (posix_memalign((void **)&bufs, 4096, (size_t)n_buf * req) || !(rd = calloc(n_req, sizeof *rd))) {
        rc = mf_error(-ENOMEM, "out of memory for %d buffers of %" PRIu64 " bytes", n_buf, req);
        goto fail;
    }
    memset(bufs, 0, (size_t)n_buf * req);
    {
        void *rb[63];
        uint64_t rl[63];
        int nr = 0;
        for (uint64_t off = 0; off < (uint64_t)n_buf * req && nr < 63; off += UINT64_C(1) << 30, nr++) {
            rb[nr] = bufs + off;
            rl[nr] = (uint64_t)n_buf * req - off < (UINT64_C(1) << 30) ? (uint64_t)n_buf * req - off : UINT64_C(1) << 30;
        }
        if (mf_sched_io_register(s, rb, rl, nr)) mf_error_clear();
    }
    if ((rc = mf_graph_create(&lane, 1, &g))) goto fail;
    for (size_t i = 0; i < n_req; i++) {
        /* buffers are reused round-robin: the data is thrown away, as dd's is */
        rd[i] = (mf_io_read){.fd = f.fd, .offset = i * req, .buf = bufs + (i % (size_t)n_buf) * req,
                             .n_bytes = req, .dio_align = f.dio_align};
        mf_task_id t = mf_graph_add_task(g, &(mf_task_desc){.name = "seq", .lane = 0, .arg = &rd[i],
                                                            .place_hint = -1});
        if (t < 0) { rc = t; goto fail; }
    }
    if ((rc = mf_graph_finalize(g))) goto fail;
    bfd = open(path, O_RDONLY | O_CLOEXEC);
    if (bfd < 0) { rc = mf_error(-errno, "%s: %s", path, strerror(errno)); goto fail; }
    /* dd and the store alternate, reps rounds and a last dd: a host below this machine may cache
     * what was just read and neighbours share the disk, so each side is the median of its runs */
    double dd_run[MF_BENCH_MAX_REPS + 1], seq_run[MF_BENCH_MAX_REPS];
    double cached_dd = mf_bench_drop(bfd, size, NULL, 0), cached_seq = 0;
    int64_t t0;
    for (int k = 0; k <= reps; k++) {
        if ((rc = mf_bench_dd(path, seq_bytes, &dd_run[k]))) goto fail;
        double c = mf_bench_drop(bfd, size, NULL, 0);
        if (k == reps) break;
        if (c > cached_seq) cached_seq = c;
        t0 = mf_now_ns();
        if ((rc = mf_sched_run(s, g, NULL))) goto fail;
        seq_run[k] = (double)seq_bytes / ((mf_now_ns() - t0) * 1e-9);
        mf_bench_drop(bfd, size, NULL, 0);
    }
    double dd_bps = mf_median(dd_run, reps + 1), seq_bps = mf_median(seq_run, reps);

    /* ---- scattered rows ---- */
    uint64_t n_slots = size / row, st = 0x9e3779b97f4a7c15ULL;
    offs = malloc((size_t)n_rows * sizeof *offs);
    rr = calloc((size_t)n_rows, sizeof *rr);
    rowbuf = malloc((size_t)n_rows * row);
    if (!offs || !rr || !rowbuf) { rc = mf_error(-ENOMEM, "out of memory for %d rows", n_rows); goto fail; }
    for (int i = 0; i < n_rows; i++) {
        st ^= st << 13, st ^= st >> 7, st ^= st << 17;
        offs[i] = (st % n_slots) * row;
        rr[i] = (mf_io_read){.fd = gather_buffered ? bfd : f.fd, .offset = offs[i],
                             .buf = rowbuf + (size_t)i * row, .n_bytes = row,
                             .dio_align = gather_buffered ? 0 : f.dio_align};
    }
    if ((rc = mf_graph_create(&lane, 1, &gg))) goto fail;
    for (int i = 0; i < n_rows; i++) {
        mf_task_id t = mf_graph_add_task(gg, &(mf_task_desc){.name = "row", .lane = 0, .arg = &rr[i],
                                                             .place_hint = -1});
        if (t < 0) { rc = t; goto fail; }
    }
    if ((rc = mf_graph_finalize(gg))) goto fail;
    posix_fadvise(bfd, 0, 0, POSIX_FADV_RANDOM);   /* the loop's fair chance: no readahead */
    double cached_pread = 0;
    uint8_t *rowbuf2 = NULL;
    rowbuf2 = malloc((size_t)n_rows * row);
    if (!rowbuf2) { rc = mf_error(-ENOMEM, "out of memory"); goto fail; }
    /* the pread loop and the gather alternate the same way */
    double pr_run[MF_BENCH_MAX_REPS + 1], ga_run[MF_BENCH_MAX_REPS];
    double cached_gather = 0, gather_cpu = 0, pread_cpu = 0;
    for (int k = 0; k <= 2 * reps; k++) {
        double c = mf_bench_drop(bfd, size, offs, n_rows);
        t0 = mf_now_ns();
        double c0 = mf_cpu_s();
        if (k % 2) {
            if (c > cached_gather) cached_gather = c;
            if ((rc = mf_sched_run(s, gg, NULL))) { free(rowbuf2); goto fail; }
            ga_run[k / 2] = n_rows / ((mf_now_ns() - t0) * 1e-9);
            gather_cpu += (mf_cpu_s() - c0) / n_rows / reps;
            continue;
        }
        if (c > cached_pread) cached_pread = c;
        for (int i = 0; i < n_rows; i++) {
            ssize_t got = pread(bfd, rowbuf2 + (size_t)i * row, (size_t)row, (off_t)offs[i]);
            if (got != (ssize_t)row) {
                rc = mf_error(-EIO, "pread of row %d at %" PRIu64 ": %s", i, offs[i], got < 0 ? strerror(errno) : "short");
                free(rowbuf2);
                goto fail;
            }
        }
        pr_run[k / 2] = n_rows / ((mf_now_ns() - t0) * 1e-9);
        pread_cpu += (mf_cpu_s() - c0) / n_rows / (reps + 1);
    }
    double pread_rps = mf_median(pr_run, reps + 1), gather_rps = mf_median(ga_run, reps);
    int same = !memcmp(rowbuf, rowbuf2, (size_t)n_rows * row);
    free(rowbuf2);
    if (!same) { rc = mf_error(-EIO, "gathered rows differ from the pread loop's"); goto fail; }

    const char *eng = mf_sched_io_engine(s);
    char l1[400], l2[400], l3[400], l4[400];
    const double G = 1.0 / 1073741824.0;
    if (json) {
        printf("{\"file\":\"%s\",\"file_bytes\":%" PRIu64 ",\"engine\":\"%s\",\"direct\":%d,"
               "\"dio_align\":%u,\"depth\":%d,\"request_bytes\":%" PRIu64 ",\"seq_bytes\":%" PRIu64 ","
               "\"reps\":%d,\"seq_gib_s\":%.3f,\"dd_gib_s\":%.3f,\"seq_fraction_of_dd\":%.3f,"
               "\"seq_runs_gib_s\":[%s],\"dd_runs_gib_s\":[%s],\"rows\":%d,\"row_bytes\":%" PRIu64 ","
               "\"gather_rows_per_s\":%.0f,\"pread_rows_per_s\":%.0f,\"gather_speedup\":%.2f,"
               "\"gather_runs_rows_per_s\":[%s],\"pread_runs_rows_per_s\":[%s],\"gather_direct\":%d,"
               "\"cached_before_dd\":%.4f,\"cached_before_seq\":%.4f,\"cached_before_pread\":%.4f,"
               "\"cached_before_gather\":%.4f,\"gather_cpu_us_per_row\":%.2f,"
               "\"pread_cpu_us_per_row\":%.2f}\n",
               path, size, eng, f.dio_align > 0, f.dio_align, depth, req, seq_bytes, reps,
               seq_bps * G, dd_bps * G, seq_bps / dd_bps, mf_list(l1, sizeof l1, seq_run, reps, G, "%.3f"),
               mf_list(l2, sizeof l2, dd_run, reps + 1, G, "%.3f"), n_rows, row, gather_rps, pread_rps,
               gather_rps / pread_rps, mf_list(l3, sizeof l3, ga_run, reps, 1, "%.0f"),
               mf_list(l4, sizeof l4, pr_run, reps + 1, 1, "%.0f"), !gather_buffered && f.dio_align > 0,
               cached_dd, cached_seq, cached_pread, cached_gather, gather_cpu * 1e6, pread_cpu * 1e6);
    } else {
        printf("file %s: %.2f GiB; IO lane engine %s, %s (align %u), depth %d; medians of "
               "alternating runs\n", path, size * G, eng, f.dio_align ? "O_DIRECT" : "buffered",
               f.dio_align, depth);
        printf("sequential, %.2f GiB per run:\n", seq_bytes * G);
        printf("  dd bs=4M iflag=direct      %8.3f GiB/s  (runs: %s)\n", dd_bps * G,
               mf_list(l1, sizeof l1, dd_run, reps + 1, G, "%.3f"));
        printf("  store reads (%3ld MiB x %3d) %8.3f GiB/s  (runs: %s)\n", req_mib, depth, seq_bps * G,
               mf_list(l2, sizeof l2, seq_run, reps, G, "%.3f"));
        printf("  fraction of dd             %8.3f\n", seq_bps / dd_bps);
        printf("  page cache before the runs: at most %.2f%% (dd), %.2f%% (store) of the file\n",
               100 * cached_dd, 100 * cached_seq);
        printf("scattered %d rows of %" PRIu64 " bytes at random over the file:\n", n_rows, row);
        printf("  pread loop (buffered)      %8.0f rows/s  (runs: %s)\n", pread_rps,
               mf_list(l3, sizeof l3, pr_run, reps + 1, 1, "%.0f"));
        printf("  IO lane gather, depth %-4d %8.0f rows/s  (%s; runs: %s)\n", depth, gather_rps,
               !gather_buffered && f.dio_align ? "O_DIRECT" : "buffered",
               mf_list(l4, sizeof l4, ga_run, reps, 1, "%.0f"));
        printf("  speedup                    %8.2f x\n", gather_rps / pread_rps);
        printf("  page cache before the runs: at most %.2f%% (pread), %.2f%% (gather) of the rows' pages\n",
               100 * cached_pread, 100 * cached_gather);
        printf("  CPU time per row (this process, user+sys): gather %.1f us, pread loop %.1f us\n",
               gather_cpu * 1e6, pread_cpu * 1e6);
    }
    ret = 0;
    goto out;
fail:
    fprintf(stderr, "moeflow bench io: %s\n", mf_last_error());
out:
    mf_graph_destroy(g);
    mf_graph_destroy(gg);
    mf_sched_destroy(s);
    free(bufs);
    free(rd);
    free(rr);
    free(offs);
    free(rowbuf);
    if (bfd >= 0) close(bfd);
    mf_dio_close(&f);
    return ret;
}
