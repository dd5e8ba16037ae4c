/* Files read by the IO lane: opened O_DIRECT where the filesystem allows it, with the alignment
 * the kernel asks for (statx STATX_DIOALIGN, else the device's logical block size), and an
 * identity (inode, size, mtime) taken at open so that a shard truncated or replaced later is
 * reported clearly instead of read as wrong data. */
#ifndef MF_DIO_H
#define MF_DIO_H

#include <stdint.h>

typedef struct mf_dio_file {
    int fd;                 /* O_DIRECT when dio_align > 0, else a buffered fd; -1 when closed */
    uint32_t dio_align;     /* offset/length/buffer alignment of fd's reads; 0: buffered */
    uint64_t size_bytes;    /* at open */
    uint64_t dev, ino;
    int64_t mtime_ns;
    char path[4096];
} mf_dio_file;

/* Opens path read-only; with want_direct, O_DIRECT when the filesystem accepts it (tmpfs and
 * some overlays do not: then a buffered fd with dio_align 0). 0 or a negative code naming path. */
int mf_dio_open(const char *path, int want_direct, mf_dio_file *f);
void mf_dio_close(mf_dio_file *f);

/* The O_DIRECT alignment of an open fd: statx STATX_DIOALIGN (max of memory and offset
 * alignment); when the kernel does not report it, the logical block size of the device holding
 * the file (sysfs), else 4096. */
uint32_t mf_dio_align_of(int fd);

/* Whether the device holding fd's file is rotational (sysfs queue/rotational of its block device
 * or, for a partition, of the disk): 1, 0, or -1 when the kernel does not say (tmpfs, overlays). */
int mf_dio_rotational(int fd);

/* Checks that path still names the file opened, at its size at open: -ESTALE with a message
 * ("replaced after open", "truncated from X to Y bytes", "modified after open") otherwise. */
int mf_dio_check(const mf_dio_file *f);

#endif
