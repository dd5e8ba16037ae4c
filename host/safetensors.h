/* safetensors checkpoints: one file, or a directory of shards with model.safetensors.index.json.
 * Opening reads and validates headers only; tensor data is read on demand with pread. Writing
 * lays out a shard's header first and takes each tensor's bytes afterwards, so a generator can
 * stream data in chunks, or leave it as holes (a sparse file) for layout-only checkpoints. */
#ifndef MF_SAFETENSORS_H
#define MF_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "host/dtype.h"

#define MF_ST_MAX_DIMS 8
#define MF_ST_MAX_HEADER_BYTES (100u * 1000u * 1000u)   /* larger headers are refused */

typedef struct mf_st_tensor {
    const char *name;
    mf_dtype dtype;
    int n_dims;
    int64_t shape[MF_ST_MAX_DIMS];
    int shard;              /* index into the checkpoint's shards */
    uint64_t file_offset;   /* absolute offset of the first byte in the shard file */
    uint64_t n_bytes;
} mf_st_tensor;

typedef struct mf_st mf_st;   /* an open checkpoint */

/* Opens `path`: a .safetensors file, a model.safetensors.index.json, or a directory holding
 * either (the index wins). Every shard's header is read and validated: on any malformed input
 * returns a negative code with mf_last_error() naming the file (and tensor) and the problem.
 * The rules are the Python package's: tensors' byte ranges tile the data section exactly (no
 * gap, overlap or trailing bytes); unknown keys in an entry are ignored. An index and its shards
 * must agree exactly: a tensor the index names but its shard lacks, and a shard tensor the index
 * does not map to that shard, are both refused. At most MF_ST_MAX_DIMS dims per tensor. */
int mf_st_open(const char *path, mf_st **out);
void mf_st_close(mf_st *st);

int mf_st_n_tensors(const mf_st *st);
const mf_st_tensor *mf_st_tensor_at(const mf_st *st, int i);   /* sorted by name */
const mf_st_tensor *mf_st_find(const mf_st *st, const char *name);  /* NULL when absent */
int mf_st_n_shards(const mf_st *st);
const char *mf_st_shard_path(const mf_st *st, int shard);
uint64_t mf_st_shard_bytes(const mf_st *st, int shard);   /* file size */
int mf_st_shard_fd(const mf_st *st, int shard);           /* open read-only fd, owned by st */

/* __metadata__ value for key in the first shard that has it, or NULL. */
const char *mf_st_metadata(const mf_st *st, const char *key);

/* Reads n bytes at offset within tensor t into dst; short reads and EIO are errors naming the
 * file and tensor. */
int mf_st_read(const mf_st *st, const mf_st_tensor *t, uint64_t offset, void *dst, size_t n);

/* Parses one safetensors header from memory (the JSON text after the 8-byte length), checking it
 * against a data section of data_bytes. For the fuzzer and for tests; `what` names the source in
 * errors. On success *n_out tensors are returned in *out (free with mf_st_tensors_free). */
int mf_st_parse_header(const char *what, const char *json, size_t json_bytes, uint64_t data_bytes,
                       mf_st_tensor **out, int *n_out);
void mf_st_tensors_free(mf_st_tensor *t, int n);

/* Parses a whole safetensors file image held in memory (8-byte length, header, data) with the
 * same checks as mf_st_open: the fuzzer's entry point. */
int mf_st_parse_image(const char *what, const void *file, size_t file_bytes, mf_st_tensor **out,
                      int *n_out);

/* ---- writing ---------------------------------------------------------------------------------- */

typedef struct mf_st_spec {
    const char *name;
    mf_dtype dtype;
    int n_dims;
    int64_t shape[MF_ST_MAX_DIMS];
} mf_st_spec;

typedef struct mf_st_writer mf_st_writer;

/* Creates `path` (via a temporary name, renamed into place by mf_st_writer_finish so that a failed
 * run never leaves a file that looks complete), writes the header for the n tensors in `specs`
 * (in that order) and an optional __metadata__ (n_meta key/value pairs: meta_kv[2k] is a key,
 * meta_kv[2k+1] its value). Names must be unique, non-empty UTF-8 and not "__metadata__". */
int mf_st_writer_create(const char *path, const mf_st_spec *specs, int n, const char *const *meta_kv,
                        int n_meta, mf_st_writer **out);
/* Writes n bytes at `offset` inside tensor i. Bytes never written stay holes (read as zero). */
int mf_st_writer_pwrite(mf_st_writer *w, int i, uint64_t offset, const void *data, size_t n);
uint64_t mf_st_writer_tensor_bytes(const mf_st_writer *w, int i);
uint64_t mf_st_writer_file_bytes(const mf_st_writer *w);
/* Sizes the file (holes past the last write), closes and renames into place. */
int mf_st_writer_finish(mf_st_writer *w);
/* Closes and removes the temporary file. */
void mf_st_writer_abort(mf_st_writer *w);

/* Writes dir/model.safetensors.index.json mapping each name to its shard file name, with
 * metadata.total_size = total_bytes. */
int mf_st_index_write(const char *dir, const char *const *names, const char *const *shard_files,
                      int n, uint64_t total_bytes);

#endif
