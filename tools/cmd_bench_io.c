/* `moeflow bench io --file F`: the host IO path against plain baselines measured in the same run.
 * Sequential: the store's reads (IO lane, O_DIRECT, large requests, many in flight, registered
 * buffers) vs `dd if=F of=/dev/null bs=4M iflag=direct` run as a subprocess. Scattered: random
 * 264-byte rows (an Engram row: 256 fp8 codes + 8 scales) gathered at depth through the IO lane
 * vs a pread loop of the same rows. The file is dropped from the page cache before each phase
 * (posix_fadvise DONTNEED) and mincore says how much of it was still cached. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
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

/* The command line of `moeflow bench io`. */
typedef struct mf_bench_io_cli {
    const char *path;
    int json, gather_buffered;
    long depth, n_rows, reps, req_mib;
} mf_bench_io_cli;

#define F(x) offsetof(mf_bench_io_cli, x)
static const mf_opt mf_bench_io_table[] = {
    {"--file", .kind = MF_OPT_STR, .off = F(path), .meta = "F",
     .help = "the file to read (a few hundred MiB or more, e.g. a checkpoint\nshard)"},
    {"--depth", .kind = MF_OPT_LONG, .off = F(depth), .def = "64", .meta = "N", .lo = 1, .hi = 4096,
     .help = "reads in flight on the IO lane"},
    {"--request-mib", .kind = MF_OPT_LONG, .off = F(req_mib), .def = "4", .meta = "N", .lo = 1, .hi = 256,
     .help = "MiB per sequential read"},
    {"--rows", .kind = MF_OPT_LONG, .off = F(n_rows), .def = "20000", .meta = "N", .lo = 1, .hi = 10000000,
     .help = "random 264-byte rows gathered"},
    {"--reps", .kind = MF_OPT_LONG, .off = F(reps), .def = "3", .meta = "N", .lo = 1, .hi = MF_BENCH_MAX_REPS,
     .help = "alternating rounds of each phase (dd and the store, the pread loop\n"
             "and the gather; dd and the pread loop run once more); each side is\n"
             "the median of its runs"},
    {"--gather-buffered", .kind = MF_OPT_FLAG, .off = F(gather_buffered),
     .help = "the gather reads through the page cache too (default: O_DIRECT\nwhere allowed)"},
    {"--json", .kind = MF_OPT_FLAG, .off = F(json),
     .help = "print the numbers, including seq_fraction_of_dd and gather_speedup"},
    {NULL},
};
#undef F

static const mf_opts_spec mf_bench_io_spec = {
    .cmd = "bench io",
    .usage = "usage: moeflow bench io --file F [--depth N] [--request-mib N] [--rows N] [--reps N]\n"
             "                        [--gather-buffered] [--json]\n"
             "\n"
             "Sequential read throughput of F through the IO lane (O_DIRECT where allowed, requests\n"
             "of --request-mib MiB, --depth in flight, registered buffers) against\n"
             "`dd if=F of=/dev/null bs=4M iflag=direct` in the same run; then --rows random\n"
             "264-byte rows gathered at depth against a pread loop of the same rows (buffered,\n"
             "readahead off). F is dropped from the page cache before each phase.\n\n",
    .opts = mf_bench_io_table,
    .col = 21,
};

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

/* A run of bench io: the file, the IO lane, the graphs and buffers of both phases, the results. */
typedef struct mf_bio {
    const mf_bench_io_cli *a;
    mf_dio_file f;
    int bfd, reps, n_rows;
    uint64_t size, seq_bytes, req, row;
    mf_sched *s;
    mf_graph *g, *gg;
    uint8_t *bufs, *rowbuf, *rowbuf2;
    mf_io_read *rd, *rr;
    uint64_t *offs;
    mf_lane_desc lane;
    /* sequential: dd's and the store's runs (bytes/s) and medians, the page cache before them */
    double dd_run[MF_BENCH_MAX_REPS + 1], seq_run[MF_BENCH_MAX_REPS], dd_bps, seq_bps, cached_dd, cached_seq;
    /* scattered: the pread loop's and the gather's runs (rows/s), CPU time per row, page cache */
    double pr_run[MF_BENCH_MAX_REPS + 1], ga_run[MF_BENCH_MAX_REPS], pread_rps, gather_rps;
    double cached_pread, cached_gather, gather_cpu, pread_cpu;
} mf_bio;

/* Opens the file (O_DIRECT and buffered) and an executor of one IO lane. 0, or a negative code;
 * 2 for a file too small to measure (said on stderr). */
static int mf_bio_open(mf_bio *b)
{
    int rc = mf_dio_open(b->a->path, 1, &b->f);
    if (rc) return rc;
    b->size = b->f.size_bytes;
    b->seq_bytes = b->size / (UINT64_C(4) << 20) * (UINT64_C(4) << 20);
    if (b->seq_bytes < b->req || b->size < 1 << 20) {
        fprintf(stderr, "moeflow bench io: %s has %" PRIu64 " bytes; give a file of at least a few "
                "hundred MiB\n", b->a->path, b->size);
        return 2;
    }
    b->lane = (mf_lane_desc){.kind = MF_LANE_IO, .name = "io", .concurrency = (int)b->a->depth, .numa_node = -1};
    if ((rc = mf_sched_create(&(mf_sched_opts){.lanes = &b->lane, .n_lanes = 1,
                                               .io_force_pread = mf_tool_io_env.force_pread,
                                               .io_fault_kind = mf_tool_io_env.fault_kind,
                                               .io_fault_nth = mf_tool_io_env.fault_nth}, &b->s)))
        return rc;
    b->bfd = open(b->a->path, O_RDONLY | O_CLOEXEC);
    if (b->bfd < 0) return mf_error(-errno, "%s: %s", b->a->path, strerror(errno));
    return 0;
}

/* The sequential phase's graph: the file in requests of req bytes, into depth buffers reused
 * round-robin (the data is thrown away, as dd's is), registered with the IO lane where it can. */
static int mf_bio_seq_graph(mf_bio *b)
{
    int n_buf = (int)b->a->depth;
    size_t n_req = (size_t)(b->seq_bytes / b->req);
    if (posix_memalign((void **)&b->bufs, 4096, (size_t)n_buf * b->req) || !(b->rd = calloc(n_req, sizeof *b->rd)))
        return mf_error(-ENOMEM, "out of memory for %d buffers of %" PRIu64 " bytes", n_buf, b->req);
    memset(b->bufs, 0, (size_t)n_buf * b->req);
    void *rb[63];
    uint64_t rl[63], all = (uint64_t)n_buf * b->req;
    int nr = 0;
    for (uint64_t off = 0; off < all && nr < 63; off += UINT64_C(1) << 30, nr++) {
        rb[nr] = b->bufs + off;
        rl[nr] = all - off < (UINT64_C(1) << 30) ? all - off : UINT64_C(1) << 30;
    }
    if (mf_sched_io_register(b->s, rb, rl, nr)) mf_error_clear();
    int rc = mf_graph_create(&b->lane, 1, &b->g);
    for (size_t i = 0; i < n_req && !rc; i++) {
        b->rd[i] = (mf_io_read){.fd = b->f.fd, .offset = i * b->req, .buf = b->bufs + (i % (size_t)n_buf) * b->req,
                                .n_bytes = b->req, .dio_align = b->f.dio_align};
        mf_task_id t = mf_graph_add_task(b->g, &(mf_task_desc){.name = "seq", .lane = 0, .arg = &b->rd[i],
                                                               .place_hint = -1});
        if (t < 0) rc = t;
    }
    return rc ? rc : mf_graph_finalize(b->g);
}

/* dd and the store alternate, reps rounds and a last dd: a host below this machine may cache what
 * was just read and neighbours share the disk, so each side is the median of its runs. */
static int mf_bio_seq(mf_bio *b)
{
    int rc = mf_bio_seq_graph(b);
    if (rc) return rc;
    b->cached_dd = mf_bench_drop(b->bfd, b->size, NULL, 0);
    for (int k = 0; k <= b->reps; k++) {
        if ((rc = mf_bench_dd(b->a->path, b->seq_bytes, &b->dd_run[k]))) return rc;
        double c = mf_bench_drop(b->bfd, b->size, NULL, 0);
        if (k == b->reps) break;
        if (c > b->cached_seq) b->cached_seq = c;
        int64_t t0 = mf_now_ns();
        if ((rc = mf_sched_run(b->s, b->g, NULL))) return rc;
        b->seq_run[k] = (double)b->seq_bytes / ((mf_now_ns() - t0) * 1e-9);
        mf_bench_drop(b->bfd, b->size, NULL, 0);
    }
    b->dd_bps = mf_median(b->dd_run, b->reps + 1);
    b->seq_bps = mf_median(b->seq_run, b->reps);
    return 0;
}

/* The scattered phase's rows (random, seeded) and its graph: one read per row. */
static int mf_bio_gather_graph(mf_bio *b)
{
    int n_rows = b->n_rows, buffered = b->a->gather_buffered;
    uint64_t n_slots = b->size / b->row, st = 0x9e3779b97f4a7c15ULL;
    b->offs = malloc((size_t)n_rows * sizeof *b->offs);
    b->rr = calloc((size_t)n_rows, sizeof *b->rr);
    b->rowbuf = malloc((size_t)n_rows * b->row);
    b->rowbuf2 = malloc((size_t)n_rows * b->row);
    if (!b->offs || !b->rr || !b->rowbuf || !b->rowbuf2) return mf_error(-ENOMEM, "out of memory for %d rows", n_rows);
    for (int i = 0; i < n_rows; i++) {
        st ^= st << 13, st ^= st >> 7, st ^= st << 17;
        b->offs[i] = (st % n_slots) * b->row;
        b->rr[i] = (mf_io_read){.fd = buffered ? b->bfd : b->f.fd, .offset = b->offs[i],
                                .buf = b->rowbuf + (size_t)i * b->row, .n_bytes = b->row,
                                .dio_align = buffered ? 0 : b->f.dio_align};
    }
    int rc = mf_graph_create(&b->lane, 1, &b->gg);
    for (int i = 0; i < n_rows && !rc; i++) {
        mf_task_id t = mf_graph_add_task(b->gg, &(mf_task_desc){.name = "row", .lane = 0, .arg = &b->rr[i],
                                                                .place_hint = -1});
        if (t < 0) rc = t;
    }
    return rc ? rc : mf_graph_finalize(b->gg);
}

/* One run of the pread loop over the rows (into rowbuf2). */
static int mf_bio_pread_rows(mf_bio *b)
{
    for (int i = 0; i < b->n_rows; i++) {
        ssize_t got = pread(b->bfd, b->rowbuf2 + (size_t)i * b->row, (size_t)b->row, (off_t)b->offs[i]);
        if (got != (ssize_t)b->row)
            return mf_error(-EIO, "pread of row %d at %" PRIu64 ": %s", i, b->offs[i], got < 0 ? strerror(errno) : "short");
    }
    return 0;
}

/* The pread loop and the gather alternate as dd and the store do; the gathered rows must equal
 * the loop's. */
static int mf_bio_gather(mf_bio *b)
{
    int rc = mf_bio_gather_graph(b), n_rows = b->n_rows, reps = b->reps;
    if (rc) return rc;
    posix_fadvise(b->bfd, 0, 0, POSIX_FADV_RANDOM);   /* the loop's fair chance: no readahead */
    for (int k = 0; k <= 2 * reps; k++) {
        double c = mf_bench_drop(b->bfd, b->size, b->offs, n_rows);
        int64_t t0 = mf_now_ns();
        double c0 = mf_cpu_s();
        if (k % 2) {
            if (c > b->cached_gather) b->cached_gather = c;
            if ((rc = mf_sched_run(b->s, b->gg, NULL))) return rc;
            b->ga_run[k / 2] = n_rows / ((mf_now_ns() - t0) * 1e-9);
            b->gather_cpu += (mf_cpu_s() - c0) / n_rows / reps;
            continue;
        }
        if (c > b->cached_pread) b->cached_pread = c;
        if ((rc = mf_bio_pread_rows(b))) return rc;
        b->pr_run[k / 2] = n_rows / ((mf_now_ns() - t0) * 1e-9);
        b->pread_cpu += (mf_cpu_s() - c0) / n_rows / (reps + 1);
    }
    b->pread_rps = mf_median(b->pr_run, reps + 1);
    b->gather_rps = mf_median(b->ga_run, reps);
    if (memcmp(b->rowbuf, b->rowbuf2, (size_t)n_rows * b->row))
        return mf_error(-EIO, "gathered rows differ from the pread loop's");
    return 0;
}

static void mf_bio_json(const mf_bio *b)
{
    const double G = 1.0 / 1073741824.0;
    const mf_dio_file *f = &b->f;
    int reps = b->reps;
    char l1[400], l2[400], l3[400], l4[400];
    printf("{\"file\":\"%s\",\"file_bytes\":%" PRIu64 ",\"engine\":\"%s\",\"direct\":%d,"
           "\"dio_align\":%u,\"depth\":%ld,\"request_bytes\":%" PRIu64 ",\"seq_bytes\":%" PRIu64 ","
           "\"reps\":%d,\"seq_gib_s\":%.3f,\"dd_gib_s\":%.3f,\"seq_fraction_of_dd\":%.3f,"
           "\"seq_runs_gib_s\":[%s],\"dd_runs_gib_s\":[%s],\"rows\":%d,\"row_bytes\":%" PRIu64 ","
           "\"gather_rows_per_s\":%.0f,\"pread_rows_per_s\":%.0f,\"gather_speedup\":%.2f,"
           "\"gather_runs_rows_per_s\":[%s],\"pread_runs_rows_per_s\":[%s],\"gather_direct\":%d,"
           "\"cached_before_dd\":%.4f,\"cached_before_seq\":%.4f,\"cached_before_pread\":%.4f,"
           "\"cached_before_gather\":%.4f,\"gather_cpu_us_per_row\":%.2f,"
           "\"pread_cpu_us_per_row\":%.2f}\n",
           b->a->path, b->size, mf_sched_io_engine(b->s), f->dio_align > 0, f->dio_align, b->a->depth, b->req,
           b->seq_bytes, reps, b->seq_bps * G, b->dd_bps * G, b->seq_bps / b->dd_bps,
           mf_list(l1, sizeof l1, b->seq_run, reps, G, "%.3f"), mf_list(l2, sizeof l2, b->dd_run, reps + 1, G, "%.3f"),
           b->n_rows, b->row, b->gather_rps, b->pread_rps, b->gather_rps / b->pread_rps,
           mf_list(l3, sizeof l3, b->ga_run, reps, 1, "%.0f"), mf_list(l4, sizeof l4, b->pr_run, reps + 1, 1, "%.0f"),
           !b->a->gather_buffered && f->dio_align > 0, b->cached_dd, b->cached_seq, b->cached_pread, b->cached_gather,
           b->gather_cpu * 1e6, b->pread_cpu * 1e6);
}

static void mf_bio_text(const mf_bio *b)
{
    const double G = 1.0 / 1073741824.0;
    const mf_dio_file *f = &b->f;
    int reps = b->reps, depth = (int)b->a->depth;
    char l1[400], l2[400], l3[400], l4[400];
    printf("file %s: %.2f GiB; IO lane engine %s, %s (align %u), depth %d; medians of "
           "alternating runs\n", b->a->path, b->size * G, mf_sched_io_engine(b->s), f->dio_align ? "O_DIRECT" : "buffered",
           f->dio_align, depth);
    printf("sequential, %.2f GiB per run:\n", b->seq_bytes * G);
    printf("  dd bs=4M iflag=direct      %8.3f GiB/s  (runs: %s)\n", b->dd_bps * G,
           mf_list(l1, sizeof l1, b->dd_run, reps + 1, G, "%.3f"));
    printf("  store reads (%3ld MiB x %3d) %8.3f GiB/s  (runs: %s)\n", b->a->req_mib, depth, b->seq_bps * G,
           mf_list(l2, sizeof l2, b->seq_run, reps, G, "%.3f"));
    printf("  fraction of dd             %8.3f\n", b->seq_bps / b->dd_bps);
    printf("  page cache before the runs: at most %.2f%% (dd), %.2f%% (store) of the file\n",
           100 * b->cached_dd, 100 * b->cached_seq);
    printf("scattered %d rows of %" PRIu64 " bytes at random over the file:\n", b->n_rows, b->row);
    printf("  pread loop (buffered)      %8.0f rows/s  (runs: %s)\n", b->pread_rps,
           mf_list(l3, sizeof l3, b->pr_run, reps + 1, 1, "%.0f"));
    printf("  IO lane gather, depth %-4d %8.0f rows/s  (%s; runs: %s)\n", depth, b->gather_rps,
           !b->a->gather_buffered && f->dio_align ? "O_DIRECT" : "buffered",
           mf_list(l4, sizeof l4, b->ga_run, reps, 1, "%.0f"));
    printf("  speedup                    %8.2f x\n", b->gather_rps / b->pread_rps);
    printf("  page cache before the runs: at most %.2f%% (pread), %.2f%% (gather) of the rows' pages\n",
           100 * b->cached_pread, 100 * b->cached_gather);
    printf("  CPU time per row (this process, user+sys): gather %.1f us, pread loop %.1f us\n",
           b->gather_cpu * 1e6, b->pread_cpu * 1e6);
}

static void mf_bio_close(mf_bio *b)
{
    mf_graph_destroy(b->g);
    mf_graph_destroy(b->gg);
    mf_sched_destroy(b->s);
    free(b->bufs);
    free(b->rd);
    free(b->rr);
    free(b->offs);
    free(b->rowbuf);
    free(b->rowbuf2);
    if (b->bfd >= 0) close(b->bfd);
    mf_dio_close(&b->f);
}

int mf_bench_io(int argc, char **argv)
{
    mf_bench_io_cli a = {0};
    int rc = mf_opts_parse(&mf_bench_io_spec, argc, argv, &a);
    if (rc != MF_OPTS_RUN) return rc;
    if (!a.path) return mf_opts_refuse(&mf_bench_io_spec, "--file F is required");
    static mf_bio b;
    b = (mf_bio){.a = &a, .bfd = -1, .f = {.fd = -1}, .reps = (int)a.reps, .n_rows = (int)a.n_rows,
                 .req = (uint64_t)a.req_mib << 20, .row = 264};
    rc = mf_bio_open(&b);
    if (!rc) rc = mf_bio_seq(&b);
    if (!rc) rc = mf_bio_gather(&b);
    if (!rc && a.json) mf_bio_json(&b);
    else if (!rc) mf_bio_text(&b);
    if (rc < 0) fprintf(stderr, "moeflow bench io: %s\n", mf_last_error());
    mf_bio_close(&b);
    return rc < 0 ? 1 : rc;
}
