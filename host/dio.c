/* O_DIRECT-capable file handles for the IO lane: open, alignment query (statx STATX_DIOALIGN with
 * a sysfs logical-block-size fallback) and the identity check that catches shards truncated or
 * replaced after open. */
#define _GNU_SOURCE
#include "host/dio.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "sched/error.h"

/* The number in the block device's queue/<what> (sysfs), or for a partition its disk's; -1. */
static long mf_dio_sysfs_queue(dev_t dev, const char *what)
{
    char p[160];
    unsigned ma = major(dev), mi = minor(dev);
    const char *fmt[2] = {"/sys/dev/block/%u:%u/queue/%s", "/sys/dev/block/%u:%u/../queue/%s"};   /* a partition */
    for (int k = 0; k < 2; k++) {
        snprintf(p, sizeof p, fmt[k], ma, mi, what);
        FILE *f = fopen(p, "r");
        if (!f) continue;
        long v = -1;
        int ok = fscanf(f, "%ld", &v) == 1;
        fclose(f);
        if (ok) return v;
    }
    return -1;
}

static uint32_t mf_dio_sysfs_lbs(dev_t dev)
{
    long v = mf_dio_sysfs_queue(dev, "logical_block_size");
    return v >= 512 && !(v & (v - 1)) && v <= (1L << 20) ? (uint32_t)v : 0;
}

int mf_dio_rotational(int fd)
{
    struct stat st;
    if (fstat(fd, &st)) return -1;
    long v = mf_dio_sysfs_queue(st.st_dev, "rotational");
    return v == 0 || v == 1 ? (int)v : -1;
}

uint32_t mf_dio_align_of(int fd)
{
    struct statx sx;
    if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
        sx.stx_dio_offset_align) {
        uint32_t a = sx.stx_dio_mem_align > sx.stx_dio_offset_align ? sx.stx_dio_mem_align
                                                                    : sx.stx_dio_offset_align;
        return a;
    }
    struct stat st;
    uint32_t a = fstat(fd, &st) == 0 ? mf_dio_sysfs_lbs(st.st_dev) : 0;
    return a ? a : 4096;
}

int mf_dio_open(const char *path, int want_direct, mf_dio_file *f)
{
    memset(f, 0, sizeof *f);
    f->fd = -1;
    snprintf(f->path, sizeof f->path, "%s", path);
    int fd = -1;
    if (want_direct) fd = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
    if (fd >= 0) f->dio_align = mf_dio_align_of(fd);
    else fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return mf_error(-errno, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st)) {
        int e = errno;
        close(fd);
        return mf_error(-e, "%s: cannot stat: %s", path, strerror(e));
    }
    f->fd = fd;
    f->size_bytes = (uint64_t)st.st_size;
    f->dev = (uint64_t)st.st_dev;
    f->ino = (uint64_t)st.st_ino;
    f->mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
    return 0;
}

void mf_dio_close(mf_dio_file *f)
{
    if (f->fd >= 0) close(f->fd);
    f->fd = -1;
}

int mf_dio_check(const mf_dio_file *f)
{
    struct stat now, by_path;
    if (fstat(f->fd, &now))
        return mf_error(-errno, "%s: cannot stat the open file: %s", f->path, strerror(errno));
    if (stat(f->path, &by_path))
        return mf_error(-ESTALE, "%s: removed after open (%s)", f->path, strerror(errno));
    if ((uint64_t)by_path.st_ino != f->ino || (uint64_t)by_path.st_dev != f->dev)
        return mf_error(-ESTALE, "%s: replaced after open (inode %" PRIu64 " at open, now %" PRIu64
                        ")", f->path, f->ino, (uint64_t)by_path.st_ino);
    if ((uint64_t)now.st_size != f->size_bytes)
        return mf_error(-ESTALE, "%s: %s from %" PRIu64 " to %" PRIu64 " bytes after open", f->path,
                        (uint64_t)now.st_size < f->size_bytes ? "truncated" : "grown", f->size_bytes,
                        (uint64_t)now.st_size);
    int64_t m = (int64_t)now.st_mtim.tv_sec * 1000000000 + now.st_mtim.tv_nsec;
    if (m != f->mtime_ns)
        return mf_error(-ESTALE, "%s: modified after open (mtime changed)", f->path);
    return 0;
}
