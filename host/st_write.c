/* Writing safetensors shards and the index of a sharded checkpoint. The header (compact JSON,
 * tensors in the caller's order, padded with spaces to a multiple of 8 bytes as the Python package
 * does) is written at creation; tensor bytes come later through mf_st_writer_pwrite, and bytes
 * never written stay holes, so layout-only checkpoints of any size cost almost no disk. */
#include "host/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "host/st_internal.h"
#include "sched/error.h"

struct mf_st_writer {
    char *path;          /* final name */
    char *tmp_path;      /* path.tmp-<pid>, renamed to path by finish */
    int fd;
    int n;
    char **names;
    uint64_t *begin;     /* absolute file offset of each tensor's first byte */
    uint64_t *n_bytes;
    uint64_t file_bytes;
};

static int cmp_str_ptr(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Checks that no string in v[0..n) repeats; on a repeat, *dup is set to it and -1 returned. */
static int find_duplicate(const char *const *v, int n, const char **dup)
{
    if (n < 2) return 0;
    const char **sorted = malloc((size_t)n * sizeof *sorted);
    if (!sorted) return -2;
    memcpy(sorted, v, (size_t)n * sizeof *sorted);
    qsort(sorted, (size_t)n, sizeof *sorted, cmp_str_ptr);
    int rc = 0;
    for (int i = 1; i < n; i++) {
        if (strcmp(sorted[i - 1], sorted[i]) == 0) {
            *dup = sorted[i];
            rc = -1;
            break;
        }
    }
    free(sorted);
    return rc;
}

static void writer_free(mf_st_writer *w)
{
    if (!w) return;
    if (w->names)
        for (int i = 0; i < w->n; i++) free(w->names[i]);
    free(w->names);
    free(w->begin);
    free(w->n_bytes);
    free(w->tmp_path);
    free(w->path);
    free(w);
}

/* Builds the header object: __metadata__ first (when given), then the tensors in spec order. */
static int build_header(const char *path, const mf_st_spec *specs, int n, const char *const *meta_kv,
                        int n_meta, const uint64_t *n_bytes, json_t **out)
{
    json_t *root = json_object();
    if (!root) return mf_error(-ENOMEM, "%s: out of memory building the header", path);
    if (n_meta > 0) {
        json_t *meta = json_object();
        if (!meta || json_object_set_new(root, "__metadata__", meta) != 0) goto oom;
        for (int i = 0; i < n_meta; i++) {
            const char *k = meta_kv[2 * i], *v = meta_kv[2 * i + 1];
            if (!k || !v) {
                json_decref(root);
                return mf_error(-EINVAL, "%s: metadata pair %d has a NULL key or value", path, i);
            }
            if (json_object_get(meta, k)) {
                json_decref(root);
                return mf_error(-EINVAL, "%s: metadata key \"%s\" given twice", path, k);
            }
            json_t *s = json_string(v);
            if (!s) {
                json_decref(root);
                return mf_error(-EINVAL, "%s: metadata value of \"%s\" is not valid UTF-8", path, k);
            }
            if (json_object_set_new(meta, k, s) != 0) {
                json_decref(root);
                return mf_error(-EINVAL, "%s: metadata key \"%s\" is not valid UTF-8", path, k);
            }
        }
    }
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        json_t *t = json_object(), *shape = json_array(), *offs = json_array();
        if (!t || !shape || !offs) {
            json_decref(t);
            json_decref(shape);
            json_decref(offs);
            goto oom;
        }
        for (int d = 0; d < specs[i].n_dims; d++)
            json_array_append_new(shape, json_integer(specs[i].shape[d]));
        json_array_append_new(offs, json_integer((json_int_t)off));
        json_array_append_new(offs, json_integer((json_int_t)(off + n_bytes[i])));
        off += n_bytes[i];
        json_object_set_new(t, "dtype", json_string(mf_dtype_name(specs[i].dtype)));
        json_object_set_new(t, "shape", shape);
        json_object_set_new(t, "data_offsets", offs);
        if (json_array_size(shape) != (size_t)specs[i].n_dims || json_array_size(offs) != 2 ||
            json_object_size(t) != 3) {
            json_decref(t);
            goto oom;
        }
        if (json_object_set_new(root, specs[i].name, t) != 0) {
            json_decref(root);
            return mf_error(-EINVAL, "%s: tensor name \"%s\" is not valid UTF-8", path,
                            specs[i].name);
        }
    }
    *out = root;
    return 0;
oom:
    json_decref(root);
    return mf_error(-ENOMEM, "%s: out of memory building the header", path);
}

/* Validates the specs and fills n_bytes[i]; errors name the file and tensor. */
static int check_specs(const char *path, const mf_st_spec *specs, int n, uint64_t *n_bytes)
{
    uint64_t total = 0;
    for (int i = 0; i < n; i++) {
        const mf_st_spec *s = &specs[i];
        if (!s->name || !s->name[0])
            return mf_error(-EINVAL, "%s: tensor %d has an empty name", path, i);
        if (strcmp(s->name, "__metadata__") == 0)
            return mf_error(-EINVAL, "%s: \"__metadata__\" is reserved and cannot name a tensor",
                            path);
        if ((unsigned)s->dtype >= MF_DTYPE_COUNT)
            return mf_error(-EINVAL, "%s: tensor \"%s\": dtype %d is not a known dtype", path,
                            s->name, (int)s->dtype);
        if (s->n_dims < 0 || s->n_dims > MF_ST_MAX_DIMS)
            return mf_error(-EINVAL, "%s: tensor \"%s\": expected 0..%d dims, got %d", path,
                            s->name, MF_ST_MAX_DIMS, s->n_dims);
        for (int d = 0; d < s->n_dims; d++)
            if (s->shape[d] < 0)
                return mf_error(-EINVAL, "%s: tensor \"%s\": dim %d is negative (%lld)", path,
                                s->name, d, (long long)s->shape[d]);
        int sz = mf_st_shape_bytes(s->dtype, s->n_dims, s->shape, &n_bytes[i]);
        if (sz == -2)
            return mf_error(-EINVAL, "%s: tensor \"%s\": %s elements end mid-byte (need an even "
                            "count)", path, s->name, mf_dtype_name(s->dtype));
        if (sz != 0)
            return mf_error(-EOVERFLOW, "%s: tensor \"%s\": element count of the shape "
                            "overflows 64 bits", path, s->name);
        if (n_bytes[i] > (uint64_t)INT64_MAX / 2 - total)
            return mf_error(-EFBIG, "%s: tensor \"%s\": data section would exceed 2^62 bytes",
                            path, s->name);
        total += n_bytes[i];
    }
    const char **names = malloc((size_t)(n > 0 ? n : 1) * sizeof *names);
    if (!names) return mf_error(-ENOMEM, "%s: out of memory", path);
    for (int i = 0; i < n; i++) names[i] = specs[i].name;
    const char *dup = NULL;
    int rc = find_duplicate(names, n, &dup);
    free(names);
    if (rc == -2) return mf_error(-ENOMEM, "%s: out of memory", path);
    if (rc == -1) return mf_error(-EINVAL, "%s: tensor \"%s\" is given twice", path, dup);
    return 0;
}

int mf_st_writer_create(const char *path, const mf_st_spec *specs, int n, const char *const *meta_kv,
                        int n_meta, mf_st_writer **out)
{
    *out = NULL;
    if (n < 0 || n_meta < 0 || (n > 0 && !specs) || (n_meta > 0 && !meta_kv))
        return mf_error(-EINVAL, "%s: bad arguments (n=%d, n_meta=%d)", path, n, n_meta);
    mf_st_writer *w = calloc(1, sizeof *w);
    if (!w) return mf_error(-ENOMEM, "%s: out of memory", path);
    w->fd = -1;
    size_t cap = (size_t)(n > 0 ? n : 1);
    w->names = calloc(cap, sizeof *w->names);
    w->begin = calloc(cap, sizeof *w->begin);
    w->n_bytes = calloc(cap, sizeof *w->n_bytes);
    w->path = strdup(path);
    size_t tmp_len = strlen(path) + 32;
    w->tmp_path = malloc(tmp_len);
    if (!w->names || !w->begin || !w->n_bytes || !w->path || !w->tmp_path) {
        writer_free(w);
        return mf_error(-ENOMEM, "%s: out of memory", path);
    }
    snprintf(w->tmp_path, tmp_len, "%s.tmp-%ld", path, (long)getpid());

    int rc = check_specs(path, specs, n, w->n_bytes);
    if (rc) {
        writer_free(w);
        return rc;
    }
    json_t *root = NULL;
    rc = build_header(path, specs, n, meta_kv, n_meta, w->n_bytes, &root);
    if (rc) {
        writer_free(w);
        return rc;
    }
    char *text = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (!text) {
        writer_free(w);
        return mf_error(-ENOMEM, "%s: out of memory printing the header", path);
    }
    size_t len = strlen(text);
    size_t padded = (len + 7) / 8 * 8;
    char *hdr = malloc(8 + padded);
    if (!hdr) {
        free(text);
        writer_free(w);
        return mf_error(-ENOMEM, "%s: out of memory", path);
    }
    for (int b = 0; b < 8; b++) hdr[b] = (char)(((uint64_t)padded >> (8 * b)) & 0xff);
    memcpy(hdr + 8, text, len);
    memset(hdr + 8 + len, ' ', padded - len);
    free(text);

    w->n = n;
    uint64_t off = 8 + (uint64_t)padded;
    for (int i = 0; i < n; i++) {
        w->names[i] = strdup(specs[i].name);
        if (!w->names[i]) {
            free(hdr);
            writer_free(w);
            return mf_error(-ENOMEM, "%s: out of memory", path);
        }
        w->begin[i] = off;
        off += w->n_bytes[i];
    }
    w->file_bytes = off;

    w->fd = open(w->tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (w->fd < 0) {
        rc = mf_error(-errno, "%s: cannot create %s: %s", path, w->tmp_path, strerror(errno));
        free(hdr);
        writer_free(w);
        return rc;
    }
    rc = mf_st_pwrite_all(w->fd, hdr, 8 + padded, 0);
    free(hdr);
    if (rc) {
        mf_error(rc, "%s: writing the header to %s: %s", path, w->tmp_path, strerror(-rc));
        mf_st_writer_abort(w);
        return rc;
    }
    *out = w;
    return 0;
}

int mf_st_writer_pwrite(mf_st_writer *w, int i, uint64_t offset, const void *data, size_t n)
{
    if (i < 0 || i >= w->n)
        return mf_error(-EINVAL, "%s: tensor index %d out of range (0..%d)", w->path, i, w->n - 1);
    if (offset > w->n_bytes[i] || n > w->n_bytes[i] - offset)
        return mf_error(-EINVAL,
                        "%s: tensor \"%s\": write of %zu bytes at offset %llu is past its end "
                        "(%llu bytes)",
                        w->path, w->names[i], n, (unsigned long long)offset,
                        (unsigned long long)w->n_bytes[i]);
    int rc = mf_st_pwrite_all(w->fd, data, n, w->begin[i] + offset);
    if (rc)
        return mf_error(rc, "%s: tensor \"%s\": writing %zu bytes at offset %llu: %s", w->path,
                        w->names[i], n, (unsigned long long)offset, strerror(-rc));
    return 0;
}

uint64_t mf_st_writer_tensor_bytes(const mf_st_writer *w, int i)
{
    return (i >= 0 && i < w->n) ? w->n_bytes[i] : 0;
}

uint64_t mf_st_writer_file_bytes(const mf_st_writer *w) { return w->file_bytes; }

int mf_st_writer_finish(mf_st_writer *w)
{
    int rc = 0;
    if (ftruncate(w->fd, (off_t)w->file_bytes) != 0)
        rc = mf_error(-errno, "%s: sizing %s to %llu bytes: %s", w->path, w->tmp_path,
                      (unsigned long long)w->file_bytes, strerror(errno));
    if (close(w->fd) != 0 && rc == 0)
        rc = mf_error(-errno, "%s: closing %s: %s", w->path, w->tmp_path, strerror(errno));
    w->fd = -1;
    if (rc == 0 && rename(w->tmp_path, w->path) != 0)
        rc = mf_error(-errno, "%s: renaming %s into place: %s", w->path, w->tmp_path,
                      strerror(errno));
    if (rc) unlink(w->tmp_path);
    writer_free(w);
    return rc;
}

void mf_st_writer_abort(mf_st_writer *w)
{
    if (!w) return;
    if (w->fd >= 0) close(w->fd);
    unlink(w->tmp_path);
    writer_free(w);
}

int mf_st_index_write(const char *dir, const char *const *names, const char *const *shard_files,
                      int n, uint64_t total_bytes)
{
    size_t plen = strlen(dir) + 64;
    char *path = malloc(plen), *tmp = malloc(plen + 32);
    json_t *root = json_object(), *meta = json_object(), *map = json_object();
    char *text = NULL;
    int rc = 0, fd = -1;
    if (!path || !tmp || !root || !meta || !map) {
        rc = mf_error(-ENOMEM, "%s: out of memory writing the index", dir);
        json_decref(meta);
        json_decref(map);
        goto out;
    }
    snprintf(path, plen, "%s/model.safetensors.index.json", dir);
    snprintf(tmp, plen + 32, "%s.tmp-%ld", path, (long)getpid());
    if (total_bytes > (uint64_t)INT64_MAX) {
        rc = mf_error(-EINVAL, "%s: total_size %llu does not fit a JSON integer", path,
                      (unsigned long long)total_bytes);
        json_decref(meta);
        json_decref(map);
        goto out;
    }
    json_object_set_new(meta, "total_size", json_integer((json_int_t)total_bytes));
    json_object_set_new(root, "metadata", meta);
    json_object_set_new(root, "weight_map", map);
    for (int i = 0; i < n; i++) {
        if (!names[i] || !shard_files[i] || !names[i][0] || !shard_files[i][0]) {
            rc = mf_error(-EINVAL, "%s: entry %d has an empty tensor or shard name", path, i);
            goto out;
        }
        if (strchr(shard_files[i], '/')) {
            rc = mf_error(-EINVAL, "%s: tensor \"%s\": shard \"%s\" must be a file name in %s",
                          path, names[i], shard_files[i], dir);
            goto out;
        }
        if (json_object_get(map, names[i])) {
            rc = mf_error(-EINVAL, "%s: tensor \"%s\" is given twice", path, names[i]);
            goto out;
        }
        json_t *s = json_string(shard_files[i]);
        if (!s || json_object_set_new(map, names[i], s) != 0) {
            rc = mf_error(-EINVAL, "%s: tensor \"%s\": name or shard is not valid UTF-8", path,
                          names[i]);
            goto out;
        }
    }
    text = json_dumps(root, JSON_INDENT(2) | JSON_SORT_KEYS);
    if (!text) {
        rc = mf_error(-ENOMEM, "%s: out of memory printing the index", path);
        goto out;
    }
    size_t len = strlen(text);
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        rc = mf_error(-errno, "%s: cannot create %s: %s", path, tmp, strerror(errno));
        goto out;
    }
    rc = mf_st_pwrite_all(fd, text, len, 0);
    if (rc == 0) rc = mf_st_pwrite_all(fd, "\n", 1, len);
    if (rc) {
        mf_error(rc, "%s: writing %s: %s", path, tmp, strerror(-rc));
    } else if (close(fd) != 0) {
        rc = mf_error(-errno, "%s: closing %s: %s", path, tmp, strerror(errno));
        fd = -1;
    } else {
        fd = -1;
        if (rename(tmp, path) != 0)
            rc = mf_error(-errno, "%s: renaming %s into place: %s", path, tmp, strerror(errno));
    }
    if (fd >= 0) close(fd);
    if (rc) unlink(tmp);
out:
    free(text);
    json_decref(root);
    free(tmp);
    free(path);
    return rc;
}
