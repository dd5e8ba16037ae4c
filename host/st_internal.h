/* Pieces shared by the safetensors reader (st_read.c, st_open.c) and writer (st_write.c): the
 * size of a tensor from its shape, and whole-file writes that survive short writes and EINTR.
 * Not a public header: nothing outside host/st_*.c includes it. */
#ifndef MF_ST_INTERNAL_H
#define MF_ST_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "host/dtype.h"
#include "host/safetensors.h"

/* Bytes of a tensor of dtype dt and the given shape. 0 on success; -1 when a dimension is
 * negative or the element count overflows int64; -2 when a sub-byte dtype (F4) would end
 * mid-byte (the Python package refuses those as misaligned). */
int mf_st_shape_bytes(mf_dtype dt, int n_dims, const int64_t *shape, uint64_t *out);

/* pwrite of all n bytes, retrying on EINTR and short writes; 0 or -errno. */
int mf_st_pwrite_all(int fd, const void *buf, size_t n, uint64_t offset);

/* pread of up to n bytes, retrying on EINTR and short reads; returns the bytes read (less than
 * n only at end of file) or -errno. */
int64_t mf_st_pread_all(int fd, void *buf, size_t n, uint64_t offset);

/* mf_st_parse_header that also hands back the header's __metadata__ object (a new reference to
 * free with json_decref, or NULL when the header has none). */
int mf_st_parse_header_meta(const char *what, const char *json, size_t json_bytes,
                            uint64_t data_bytes, mf_st_tensor **out, int *n_out, json_t **meta_out);

/* Checks the 8-byte little-endian header length `first8` of a file of file_bytes bytes against
 * the file size and MF_ST_MAX_HEADER_BYTES; 0 with *header_bytes set, or -EINVAL naming `what`. */
int mf_st_check_prefix(const char *what, const unsigned char *first8, uint64_t file_bytes,
                       uint64_t *header_bytes);

#endif
