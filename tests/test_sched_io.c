/* The IO lane on a real temp file, with io_uring and with the pread fallback (forced by the option
 * that MOEFLOW_IO=pread sets in the moeflow command): reads of many sizes land byte-exact in caller buffers across re-runs with new offsets;
 * a read past end of file fails naming the task, how far it got and cancels its dependent; a fault
 * armed through the options (io_fault_kind) fails the first read; a bad fd fails with its errno;
 * on io_uring a pipe delivering data in pieces exercises the resubmission of short reads. */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "sched/error.h"
#include "sched/graph.h"
#include "sched/sched.h"
#include "sched/timeline.h"
#include "tests/check.h"

#define FILE_BYTES (1 << 20)
#define N_READS 64
enum { L_CPU, L_IO, N_LANES };

static uint64_t rs = 7;
static uint32_t rnd(void)
{
    rs = rs * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(rs >> 33);
}

static int after_ran;
static int after_task(void *arg, mf_task_ctx *ctx)
{
    after_ran++;
    return 0;
}

typedef struct writer {
    int fd;
    const uint8_t *data;
    int n_pieces, piece_bytes;
} writer;

static void *writer_main(void *arg)
{
    writer *w = arg;
    for (int i = 0; i < w->n_pieces; i++) {
        struct timespec ts = {0, 5000000};
        nanosleep(&ts, NULL);
        if (write(w->fd, w->data + i * w->piece_bytes, (size_t)w->piece_bytes) != w->piece_bytes) break;
    }
    return NULL;
}

static void run_engine(const char *engine, int fd, const uint8_t *file)
{
    mf_lane_desc lanes[N_LANES] = {
        {.kind = MF_LANE_CPU, .name = "cpu", .concurrency = 1, .numa_node = -1},
        {.kind = MF_LANE_IO, .name = "io", .concurrency = 4, .numa_node = -1},
    };
    int force = !strcmp(engine, "pread-option");
    mf_sched *s;
    int rc = mf_sched_create(&(mf_sched_opts){.lanes = lanes, .n_lanes = N_LANES, .io_force_pread = force}, &s);
    CHECK(rc == 0, "%s: %s", engine, mf_last_error());
    if (rc) return;
    const char *got = mf_sched_io_engine(s);
    int uring = !strcmp(got, "io_uring");
    printf("%s: engine %s\n", engine, got);
    if (!strcmp(engine, "io_uring") && !uring)
        printf("io_uring was refused here; only the pread engine is exercised\n");
    if (strcmp(engine, "io_uring")) CHECK(!strcmp(got, "pread"), "%s: engine %s", engine, got);

    /* Reads of many sizes; re-run with new offsets. */
    mf_graph *g;
    CHECK(mf_graph_create(lanes, N_LANES, &g) == 0, "%s", mf_last_error());
    mf_io_read rd[N_READS];
    uint8_t *bufs[N_READS];
    for (int i = 0; i < N_READS; i++) {
        uint64_t n = 1 + rnd() % (i < 8 ? 300000 : 4096);
        bufs[i] = malloc(n);
        rd[i] = (mf_io_read){.fd = fd, .buf = bufs[i], .n_bytes = n};
        char name[16];
        snprintf(name, sizeof name, "read%d", i);
        CHECK(mf_graph_add_task(g, &(mf_task_desc){.name = name, .lane = L_IO, .arg = &rd[i],
                                                   .cost = {.bytes = (double)n}}) == i, "%s", mf_last_error());
    }
    CHECK(mf_graph_finalize(g) == 0, "%s", mf_last_error());
    for (int r = 0; r < 3; r++) {
        for (int i = 0; i < N_READS; i++) {
            rd[i].offset = rnd() % (FILE_BYTES - rd[i].n_bytes + 1);
            memset(bufs[i], 0, rd[i].n_bytes);
            mf_graph_set_arg(g, i, &rd[i]);
        }
        rc = mf_sched_run(s, g, NULL);
        CHECK(rc == 0, "%s run %d: %s", engine, r, mf_last_error());
        int bad = 0;
        for (int i = 0; i < N_READS; i++) bad += memcmp(bufs[i], file + rd[i].offset, rd[i].n_bytes) != 0;
        CHECK(!bad, "%s run %d: %d buffers differ from the file", engine, r, bad);
    }
    mf_graph_destroy(g);
    for (int i = 0; i < N_READS; i++) free(bufs[i]);

    /* End of file: 200 bytes asked 100 before the end; a dependent is cancelled. */
    CHECK(mf_graph_create(lanes, N_LANES, &g) == 0, "%s", mf_last_error());
    uint8_t tail[200];
    memset(tail, 0, sizeof tail);
    mf_io_read eof = {.fd = fd, .offset = FILE_BYTES - 100, .buf = tail, .n_bytes = 200};
    mf_io_read badfd = {.fd = 12345, .offset = 0, .buf = tail, .n_bytes = 10};
    mf_task_id a = mf_graph_add_task(g, &(mf_task_desc){.name = "eof-read", .lane = L_IO, .arg = &eof});
    mf_task_id b = mf_graph_add_task(g, &(mf_task_desc){.name = "after", .lane = L_CPU, .fn = after_task});
    mf_graph_add_dep(g, a, b);
    CHECK(mf_graph_finalize(g) == 0, "%s", mf_last_error());
    mf_timeline *tl;
    mf_timeline_create(g, &tl);
    after_ran = 0;
    rc = mf_sched_run(s, g, &(mf_run_opts){.timeline = tl});
    CHECK(rc == -EIO, "%s eof: %d", engine, rc);
    CHECK(strstr(mf_last_error(), "task 'eof-read'") && strstr(mf_last_error(), "end of file after 100 bytes"),
          "%s eof message: %s", engine, mf_last_error());
    CHECK(!memcmp(tail, file + FILE_BYTES - 100, 100), "%s eof: the first 100 bytes were not read", engine);
    CHECK(!after_ran && mf_timeline_spans(tl)[b].status == 1, "%s: dependent of a failed read ran", engine);
    CHECK(mf_timeline_spans(tl)[a].status == -EIO, "%s: status %d", engine, mf_timeline_spans(tl)[a].status);
    mf_graph_set_arg(g, a, &badfd);
    rc = mf_sched_run(s, g, NULL);
    CHECK(rc == -EBADF && strstr(mf_last_error(), "task 'eof-read'") && strstr(mf_last_error(), "fd 12345"),
          "%s bad fd: %d %s", engine, rc, mf_last_error());
    eof.n_bytes = 100;   /* exactly to the end: fine */
    mf_graph_set_arg(g, a, &eof);
    rc = mf_sched_run(s, g, NULL);
    CHECK(rc == 0 && after_ran == 1, "%s read to the end: %d %s", engine, rc, mf_last_error());
    mf_timeline_destroy(tl);
    mf_graph_destroy(g);

    /* Short reads: a pipe that delivers 4000 bytes in 4 pieces (io_uring only; pread needs a
     * seekable file). */
    if (uring) {
        int p[2];
        CHECK(pipe(p) == 0, "pipe");
        uint8_t data[4000], got_bytes[4000];
        for (int i = 0; i < 4000; i++) data[i] = (uint8_t)rnd();
        memset(got_bytes, 0, sizeof got_bytes);
        mf_io_read prd = {.fd = p[0], .offset = 0, .buf = got_bytes, .n_bytes = 4000};
        CHECK(mf_graph_create(lanes, N_LANES, &g) == 0, "%s", mf_last_error());
        mf_graph_add_task(g, &(mf_task_desc){.name = "pipe-read", .lane = L_IO, .arg = &prd});
        CHECK(mf_graph_finalize(g) == 0, "%s", mf_last_error());
        writer w = {.fd = p[1], .data = data, .n_pieces = 4, .piece_bytes = 1000};
        pthread_t th;
        pthread_create(&th, NULL, writer_main, &w);
        rc = mf_sched_run(s, g, NULL);
        pthread_join(th, NULL);
        CHECK(rc == 0, "pipe read: %s", mf_last_error());
        CHECK(!memcmp(data, got_bytes, sizeof data), "pipe read: bytes differ");
        mf_graph_destroy(g);
        close(p[0]);
        close(p[1]);
    }
    mf_sched_destroy(s);
}

/* A fault armed through the options: the first read of the first run fails with EIO, the next
 * run reads the bytes. */
static void fault_option(int fd, const uint8_t *file)
{
    mf_lane_desc lanes[N_LANES] = {
        {.kind = MF_LANE_CPU, .name = "cpu", .concurrency = 1, .numa_node = -1},
        {.kind = MF_LANE_IO, .name = "io", .concurrency = 4, .numa_node = -1},
    };
    mf_sched *s;
    int rc = mf_sched_create(&(mf_sched_opts){.lanes = lanes, .n_lanes = N_LANES,
                                              .io_fault_kind = MF_IO_FAULT_EIO, .io_fault_nth = 1}, &s);
    CHECK(rc == 0, "fault option: %s", mf_last_error());
    if (rc) return;
    static uint8_t buf[4096];
    mf_io_read rd = {.fd = fd, .offset = 4096, .buf = buf, .n_bytes = sizeof buf};
    mf_graph *g;
    CHECK(mf_graph_create(lanes, N_LANES, &g) == 0, "%s", mf_last_error());
    CHECK(mf_graph_add_task(g, &(mf_task_desc){.name = "faulty", .lane = L_IO, .arg = &rd,
                                               .place_hint = -1}) == 0, "%s", mf_last_error());
    CHECK(mf_graph_finalize(g) == 0, "%s", mf_last_error());
    rc = mf_sched_run(s, g, NULL);
    CHECK(rc == -EIO && strstr(mf_last_error(), "faulty"), "fault option: rc %d: %s", rc, mf_last_error());
    rc = mf_sched_run(s, g, NULL);
    CHECK(rc == 0 && !memcmp(buf, file + 4096, sizeof buf), "fault option, second run: %s", mf_last_error());
    mf_graph_destroy(g);
    mf_sched_destroy(s);
}

int main(void)
{
    char path[512];
    const char *tmp = getenv("MOEFLOW_TMP");
    snprintf(path, sizeof path, "%s/sched_io_%d.bin", tmp ? tmp : "/tmp", (int)getpid());
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    CHECK(fd >= 0, "cannot create %s", path);
    uint8_t *file = malloc(FILE_BYTES);
    for (int i = 0; i < FILE_BYTES; i++) file[i] = (uint8_t)(rnd() >> 5);
    CHECK(write(fd, file, FILE_BYTES) == FILE_BYTES, "write %s", path);
    run_engine("io_uring", fd, file);
    run_engine("pread-option", fd, file);
    fault_option(fd, file);
    free(file);
    close(fd);
    unlink(path);
    return mf_check_exit("test_sched_io");
}
