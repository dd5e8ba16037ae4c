/* Pieces shared by the safetensors reader (st_read.c, st_open.c) and writer (st_write.c): the
 * size of a tensor from its shape, and whole-file writes that survive short writes and EINTR.
 * Not a public header: nothing outside host/st_*.c includes it. */
#ifndef MF_ST_INTERNAL_H
#define MF_ST_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "host/dtype.h"

/* Bytes of a tensor of dtype dt and the given shape. 0 on success; -1 when a dimension is
 * negative, the element count overflows int64, or a sub-byte dtype (F4) would end mid-byte
 * (the Python package refuses those as misaligned). */
int mf_st_shape_bytes(mf_dtype dt, int n_dims, const int64_t *shape, uint64_t *out);

/* pwrite of all n bytes, retrying on EINTR and short writes; 0 or -errno. */
int mf_st_pwrite_all(int fd, const void *buf, size_t n, uint64_t offset);

/* pread of up to n bytes, retrying on EINTR and short reads; returns the bytes read (less than
 * n only at end of file) or -errno. */
int64_t mf_st_pread_all(int fd, void *buf, size_t n, uint64_t offset);

#endif
