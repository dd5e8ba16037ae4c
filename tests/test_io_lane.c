/* The IO lane's O_DIRECT handling on a real file, on io_uring and on the pread fallback: aligned
 * reads straight into registered and unregistered buffers, misaligned offsets/lengths/buffers
 * through the bounce buffer (byte-exact against the file), a read ending at an unaligned end of
 * file, many empty tasks around real ones (the lane must not wait for a completion that will not
 * come), injected EIO and short reads failing with their cause, and the statx alignment query. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "host/dio.h"
#include "sched/error.h"
#include "sched/graph.h"
#include "sched/sched.h"
#include "tests/check.h"

#define FILE_BYTES ((8u << 20) + 1234)   /* unaligned end */
#define N_READS 96
enum { L_IO, N_LANES };

static uint64_t rs = 11;
static uint32_t rnd(void)
{
    rs = rs * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(rs >> 33);
}

static void run_engine(const char *engine, const mf_dio_file *f, const uint8_t *file)
{
    mf_lane_desc lanes[N_LANES] = {{.kind = MF_LANE_IO, .name = "io", .concurrency = 8, .numa_node = -1}};
    mf_sched *s;
    int rc = mf_sched_create(&(mf_sched_opts){.lanes = lanes, .n_lanes = N_LANES,
                                              .io_force_pread = !strcmp(engine, "pread")}, &s);
    CHECK(rc == 0, "%s: %s", engine, mf_last_error());
    if (rc) return;
    printf("%s: engine %s, dio_align %u\n", engine, mf_sched_io_engine(s), f->dio_align);
    uint8_t *arena = NULL;
    size_t arena_bytes = 16u << 20;
    if (posix_memalign((void **)&arena, 4096, arena_bytes)) {
        CHECK(0, "alloc");
        mf_sched_destroy(s);
        return;
    }
    void *reg[1] = {arena};
    uint64_t reg_bytes[1] = {arena_bytes / 2};   /* first half registered, second half not */
    rc = mf_sched_io_register(s, reg, reg_bytes, 1);
    CHECK(rc == 0, "%s: register: %s", engine, mf_last_error());

    mf_graph *g;
    CHECK(mf_graph_create(lanes, N_LANES, &g) == 0, "%s", mf_last_error());
    static mf_io_read rd[N_READS + 300];
    for (int i = 0; i < N_READS + 300; i++) {
        rd[i] = (mf_io_read){.fd = -1};
        CHECK(mf_graph_add_task(g, &(mf_task_desc){.name = "r", .lane = L_IO, .arg = &rd[i], .place_hint = -1}) == i, "add");
    }
    CHECK(mf_graph_finalize(g) == 0, "%s", mf_last_error());
    uint64_t a = f->dio_align ? f->dio_align : 512;
    for (int round = 0; round < 4; round++) {
        memset(arena, 0xee, arena_bytes);
        size_t slot = arena_bytes / N_READS / 4096 * 4096;
        for (int i = 0; i < N_READS; i++) {
            uint64_t off, len, boff;
            switch (i % 4) {
            case 0:   /* aligned, straight */
                off = (rnd() % (FILE_BYTES / a - 64)) * a;
                len = (1 + rnd() % 32) * a;
                boff = 0;
                break;
            case 1:   /* misaligned offset and length */
                off = rnd() % (FILE_BYTES - 70000);
                len = 1 + rnd() % 65536;
                boff = 0;
                break;
            case 2:   /* aligned file range, misaligned buffer */
                off = (rnd() % (FILE_BYTES / a - 64)) * a;
                len = (1 + rnd() % 16) * a;
                boff = 1 + rnd() % 63;
                break;
            default:  /* up to the unaligned end of file */
                off = FILE_BYTES - 1 - rnd() % 50000;
                len = FILE_BYTES - off;
                boff = rnd() % 7;
                break;
            }
            if (len > slot - boff) len = slot - boff;
            rd[i] = (mf_io_read){.fd = f->fd, .offset = off, .buf = arena + i * slot + boff,
                                 .n_bytes = len, .dio_align = f->dio_align};
        }
        rc = mf_sched_run(s, g, &(mf_run_opts){.timeout_ns = 20000000000LL});
        CHECK(rc == 0, "%s round %d: %s", engine, round, mf_last_error());
        for (int i = 0; i < N_READS && !rc; i++)
            CHECK(!memcmp(rd[i].buf, file + rd[i].offset, rd[i].n_bytes), "%s: read %d (off %llu len %llu) differs",
                  engine, i, (unsigned long long)rd[i].offset, (unsigned long long)rd[i].n_bytes);
    }
    /* injected faults: the cause is reported and the next run is clean */
    for (int i = 0; i < N_READS; i++) rd[i] = (mf_io_read){.fd = -1};
    rd[0] = (mf_io_read){.fd = f->fd, .offset = 0, .buf = arena, .n_bytes = 1 << 20, .dio_align = f->dio_align};
    mf_sched_io_fault(s, MF_IO_FAULT_EIO, 1);
    rc = mf_sched_run(s, g, NULL);
    CHECK(rc == -EIO && strstr(mf_last_error(), "Input/output error"), "%s: EIO: rc %d: %s", engine, rc, mf_last_error());
    mf_sched_io_fault(s, MF_IO_FAULT_SHORT, 1);
    rc = mf_sched_run(s, g, NULL);
    CHECK(rc == -EIO && strstr(mf_last_error(), "end of file after"), "%s: short: rc %d: %s", engine, rc, mf_last_error());
    mf_sched_io_fault(s, MF_IO_FAULT_NONE, 0);
    rc = mf_sched_run(s, g, NULL);
    CHECK(rc == 0 && !memcmp(arena, file, 1 << 20), "%s: clean run after faults: %s", engine, mf_last_error());
    /* past end of file */
    rd[0] = (mf_io_read){.fd = f->fd, .offset = FILE_BYTES - 100, .buf = arena, .n_bytes = 200, .dio_align = f->dio_align};
    rc = mf_sched_run(s, g, NULL);
    CHECK(rc == -EIO && strstr(mf_last_error(), "end of file after 100 bytes"), "%s: past EOF: rc %d: %s", engine, rc,
          mf_last_error());
    mf_graph_destroy(g);
    mf_sched_destroy(s);
    free(arena);
}

int main(void)
{
    const char *tmp = getenv("MOEFLOW_TMP");
    char path[4096];
    snprintf(path, sizeof path, "%s/io_lane.bin", tmp ? tmp : "/tmp");
    uint8_t *file = malloc(FILE_BYTES);
    for (uint32_t i = 0; i < FILE_BYTES; i++) file[i] = (uint8_t)(rnd() >> 7);
    FILE *fp = fopen(path, "wb");
    if (!fp || fwrite(file, 1, FILE_BYTES, fp) != FILE_BYTES || fclose(fp)) {
        fprintf(stderr, "cannot write %s\n", path);
        return 1;
    }
    mf_dio_file f;
    CHECK(mf_dio_open(path, 1, &f) == 0, "open: %s", mf_last_error());
    CHECK(f.size_bytes == FILE_BYTES, "size");
    if (f.dio_align) {
        CHECK(!(f.dio_align & (f.dio_align - 1)) && f.dio_align >= 1 && f.dio_align <= 65536,
              "dio_align %u", f.dio_align);
        int fl = fcntl(f.fd, F_GETFL);
        CHECK(fl & O_DIRECT, "fd is not O_DIRECT");
    } else {
        printf("O_DIRECT refused on %s: buffered reads only\n", path);
    }
    run_engine("io_uring", &f, file);
    run_engine("pread", &f, file);
    CHECK(mf_dio_check(&f) == 0, "check: %s", mf_last_error());
    mf_dio_close(&f);
    unlink(path);
    free(file);
    return mf_check_exit("test_io_lane");
}
