/* Opening a checkpoint: one .safetensors file, or the shards listed by a
 * model.safetensors.index.json. Headers are read and validated up front; tensor bytes are read on
 * demand with pread through the shard fds the checkpoint keeps open. The index and the shards
 * must agree exactly: every tensor the index names is in the shard it names, and every tensor a
 * shard holds is named by the index for that shard (a tensor the index does not know is refused,
 * since no loader could reach it and it usually means shards from another checkpoint). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "host/st_internal.h"
#include "sched/error.h"

#define MF_ST_INDEX_NAME "model.safetensors.index.json"

typedef struct st_shard {
    char *path;
    int fd;
    uint64_t bytes;
    json_t *meta;   /* __metadata__ or NULL */
} st_shard;

struct mf_st {
    int n_tensors;
    mf_st_tensor *tensors;   /* sorted by name */
    int n_shards;
    st_shard *shards;
};

static int cmp_tensor_name(const void *a, const void *b)
{
    return strcmp(((const mf_st_tensor *)a)->name, ((const mf_st_tensor *)b)->name);
}

static int cmp_str_ptr(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

void mf_st_close(mf_st *st)
{
    if (!st) return;
    for (int s = 0; s < st->n_shards; s++) {
        if (st->shards[s].fd >= 0) close(st->shards[s].fd);
        free(st->shards[s].path);
        json_decref(st->shards[s].meta);
    }
    free(st->shards);
    mf_st_tensors_free(st->tensors, st->n_tensors);
    free(st);
}

/* Opens one shard file and parses its header into sh and (*t, *n). */
static int open_shard(const char *path, st_shard *sh, mf_st_tensor **t, int *n)
{
    *t = NULL;
    *n = 0;
    sh->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (sh->fd < 0) return mf_error(-errno, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(sh->fd, &sb) != 0) return mf_error(-errno, "%s: stat: %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode)) return mf_error(-EINVAL, "%s: not a regular file", path);
    sh->bytes = (uint64_t)sb.st_size;
    unsigned char first8[8] = {0};
    int64_t got = mf_st_pread_all(sh->fd, first8, sh->bytes < 8 ? (size_t)sh->bytes : 8, 0);
    if (got < 0) return mf_error((int)got, "%s: reading: %s", path, strerror((int)-got));
    if ((uint64_t)got < 8 && sh->bytes >= 8)
        return mf_error(-EIO, "%s: short read of the header length", path);
    uint64_t hdr_bytes = 0;
    int rc = mf_st_check_prefix(path, first8, sh->bytes, &hdr_bytes);
    if (rc) return rc;
    char *hdr = malloc(hdr_bytes ? (size_t)hdr_bytes : 1);
    if (!hdr) return mf_error(-ENOMEM, "%s: out of memory for a %llu-byte header", path,
                              (unsigned long long)hdr_bytes);
    got = mf_st_pread_all(sh->fd, hdr, (size_t)hdr_bytes, 8);
    if (got != (int64_t)hdr_bytes) {
        free(hdr);
        if (got < 0) return mf_error((int)got, "%s: reading the header: %s", path,
                                     strerror((int)-got));
        return mf_error(-EIO, "%s: short read of the header (%lld of %llu bytes)", path,
                        (long long)got, (unsigned long long)hdr_bytes);
    }
    rc = mf_st_parse_header_meta(path, hdr, (size_t)hdr_bytes, sh->bytes - 8 - hdr_bytes, t, n,
                                 &sh->meta);
    free(hdr);
    return rc;
}

static mf_st *st_new(int n_shards)
{
    mf_st *st = calloc(1, sizeof *st);
    if (!st) return NULL;
    st->shards = calloc((size_t)n_shards, sizeof *st->shards);
    if (!st->shards) {
        free(st);
        return NULL;
    }
    st->n_shards = n_shards;
    for (int s = 0; s < n_shards; s++) st->shards[s].fd = -1;
    return st;
}

static int open_single(const char *path, mf_st **out)
{
    mf_st *st = st_new(1);
    if (!st) return mf_error(-ENOMEM, "%s: out of memory", path);
    st->shards[0].path = strdup(path);
    if (!st->shards[0].path) {
        mf_st_close(st);
        return mf_error(-ENOMEM, "%s: out of memory", path);
    }
    int rc = open_shard(path, &st->shards[0], &st->tensors, &st->n_tensors);
    if (rc) {
        mf_st_close(st);
        return rc;
    }
    qsort(st->tensors, (size_t)st->n_tensors, sizeof *st->tensors, cmp_tensor_name);
    *out = st;
    return 0;
}

/* Reads and parses the index JSON into *root, checking its shape: weight_map (name -> shard
 * file name in the same directory) and optional metadata.total_size. */
static int load_index(const char *path, json_t **root_out)
{
    *root_out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return mf_error(-errno, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || (uint64_t)sb.st_size > MF_ST_MAX_HEADER_BYTES) {
        close(fd);
        return mf_error(-EINVAL, "%s: expected a regular file of at most %u bytes", path,
                        MF_ST_MAX_HEADER_BYTES);
    }
    size_t n = (size_t)sb.st_size;
    char *text = malloc(n ? n : 1);
    if (!text) {
        close(fd);
        return mf_error(-ENOMEM, "%s: out of memory", path);
    }
    int64_t got = mf_st_pread_all(fd, text, n, 0);
    close(fd);
    if (got != (int64_t)n) {
        free(text);
        return mf_error(-EIO, "%s: short read (%lld of %zu bytes)", path, (long long)got, n);
    }
    json_error_t jerr;
    json_t *root = json_loadb(text, n, JSON_REJECT_DUPLICATES, &jerr);
    free(text);
    if (!root)
        return mf_error(-EINVAL, "%s: not valid JSON (line %d, column %d): %s", path, jerr.line,
                        jerr.column, jerr.text);
    int rc = 0;
    json_t *map = json_object_get(root, "weight_map"), *meta = json_object_get(root, "metadata");
    if (!json_is_object(root)) {
        rc = mf_error(-EINVAL, "%s: expected a JSON object at the top", path);
    } else if (!json_is_object(map) || json_object_size(map) == 0) {
        rc = mf_error(-EINVAL, "%s: expected \"weight_map\", a non-empty object of tensor -> "
                      "shard file, found %s", path,
                      !map ? "none" : json_is_object(map) ? "an empty object" : "another type");
    } else if (meta && !json_is_object(meta)) {
        rc = mf_error(-EINVAL, "%s: \"metadata\": expected an object", path);
    } else if (meta && json_object_get(meta, "total_size") &&
               !(json_is_number(json_object_get(meta, "total_size")) &&
                 json_number_value(json_object_get(meta, "total_size")) >= 0)) {
        rc = mf_error(-EINVAL, "%s: \"metadata.total_size\": expected a non-negative number", path);
    } else {
        const char *k;
        json_t *v;
        json_object_foreach(map, k, v) {
            const char *f = json_string_value(v);
            if (!f || !f[0] || strchr(f, '/') || strcmp(f, ".") == 0 || strcmp(f, "..") == 0) {
                rc = mf_error(-EINVAL,
                              "%s: weight_map \"%.200s\": expected a shard file name in the "
                              "index's directory, found %s",
                              path, k, f ? f : "a non-string");
                break;
            }
        }
    }
    if (rc) {
        json_decref(root);
        return rc;
    }
    *root_out = root;
    return 0;
}

static int open_index(const char *path, mf_st **out)
{
    json_t *root = NULL;
    int rc = load_index(path, &root);
    if (rc) return rc;
    json_t *map = json_object_get(root, "weight_map");
    size_t n_names = json_object_size(map);

    /* distinct shard file names, sorted */
    const char **files = malloc(n_names * sizeof *files);
    if (!files) {
        json_decref(root);
        return mf_error(-ENOMEM, "%s: out of memory", path);
    }
    size_t n_files = 0;
    const char *k;
    json_t *v;
    json_object_foreach(map, k, v) files[n_files++] = json_string_value(v);
    qsort(files, n_files, sizeof *files, cmp_str_ptr);
    size_t u = 0;
    for (size_t i = 0; i < n_files; i++)
        if (u == 0 || strcmp(files[u - 1], files[i]) != 0) files[u++] = files[i];
    n_files = u;

    mf_st *st = st_new((int)n_files);
    mf_st_tensor **per = calloc(n_files, sizeof *per);
    int *per_n = calloc(n_files, sizeof *per_n);
    const char *slash = strrchr(path, '/');
    size_t dir_len = slash ? (size_t)(slash - path + 1) : 0;
    uint64_t total_n = 0;
    if (!st || !per || !per_n) {
        rc = mf_error(-ENOMEM, "%s: out of memory", path);
        goto out;
    }
    for (size_t s = 0; s < n_files; s++) {
        size_t len = dir_len + strlen(files[s]) + 1;
        st->shards[s].path = malloc(len);
        if (!st->shards[s].path) {
            rc = mf_error(-ENOMEM, "%s: out of memory", path);
            goto out;
        }
        snprintf(st->shards[s].path, len, "%.*s%s", (int)dir_len, path, files[s]);
        rc = open_shard(st->shards[s].path, &st->shards[s], &per[s], &per_n[s]);
        if (rc) {
            if (rc == -ENOENT)
                mf_error_wrap(rc, "%s names shard %s, which is missing", path, files[s]);
            goto out;
        }
        for (int i = 0; i < per_n[s]; i++) {
            per[s][i].shard = (int)s;
            const char *want = json_string_value(json_object_get(map, per[s][i].name));
            if (!want) {
                rc = mf_error(-EINVAL, "%s: tensor \"%.200s\" is not in the index %s",
                              st->shards[s].path, per[s][i].name, path);
                goto out;
            }
            if (strcmp(want, files[s]) != 0) {
                rc = mf_error(-EINVAL,
                              "%s: tensor \"%.200s\" is in shard %s but the index maps it to %s "
                              "(a tensor in two shards, or a stale index)",
                              path, per[s][i].name, files[s], want);
                goto out;
            }
        }
        total_n += (uint64_t)per_n[s];
    }
    /* every shard tensor was mapped to its own shard, and names are unique per shard, so each
     * index entry matched at most once: a shortfall means the index names a missing tensor */
    if (total_n != n_names) {
        json_object_foreach(map, k, v) {
            size_t s = 0;
            while (s < n_files && strcmp(files[s], json_string_value(v)) != 0) s++;
            int found = 0;
            for (int i = 0; s < n_files && i < per_n[s] && !found; i++)
                found = strcmp(per[s][i].name, k) == 0;
            if (!found) {
                rc = mf_error(-EINVAL, "%s: index maps tensor \"%.200s\" to shard %s, which lacks it",
                              path, k, json_string_value(v));
                goto out;
            }
        }
        rc = mf_error(-EINVAL, "%s: index and shards disagree", path);   /* not reached */
        goto out;
    }
    st->tensors = calloc(total_n ? total_n : 1, sizeof *st->tensors);
    if (!st->tensors) {
        rc = mf_error(-ENOMEM, "%s: out of memory", path);
        goto out;
    }
    for (size_t s = 0; s < n_files; s++) {
        memcpy(st->tensors + st->n_tensors, per[s], (size_t)per_n[s] * sizeof *per[s]);
        st->n_tensors += per_n[s];
        free(per[s]);   /* names now belong to st->tensors */
        per[s] = NULL;
        per_n[s] = 0;
    }
    qsort(st->tensors, (size_t)st->n_tensors, sizeof *st->tensors, cmp_tensor_name);
out:
    if (per)
        for (size_t s = 0; s < n_files; s++) mf_st_tensors_free(per[s], per_n[s]);
    free(per);
    free(per_n);
    free(files);
    json_decref(root);
    if (rc) {
        mf_st_close(st);
        return rc;
    }
    *out = st;
    return 0;
}

static int ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

int mf_st_open(const char *path, mf_st **out)
{
    *out = NULL;
    struct stat sb;
    if (stat(path, &sb) != 0) return mf_error(-errno, "%s: cannot open: %s", path, strerror(errno));
    if (S_ISDIR(sb.st_mode)) {
        size_t len = strlen(path) + sizeof MF_ST_INDEX_NAME + 2;
        char *p = malloc(len);
        if (!p) return mf_error(-ENOMEM, "%s: out of memory", path);
        int rc;
        snprintf(p, len, "%s/%s", path, MF_ST_INDEX_NAME);
        if (access(p, F_OK) == 0) {
            rc = open_index(p, out);
        } else {
            snprintf(p, len, "%s/model.safetensors", path);
            if (access(p, F_OK) == 0)
                rc = open_single(p, out);
            else
                rc = mf_error(-ENOENT, "%s: directory holds neither %s nor model.safetensors",
                              path, MF_ST_INDEX_NAME);
        }
        free(p);
        return rc;
    }
    if (ends_with(path, ".json")) return open_index(path, out);
    return open_single(path, out);
}

int mf_st_n_tensors(const mf_st *st) { return st->n_tensors; }

const mf_st_tensor *mf_st_tensor_at(const mf_st *st, int i)
{
    return (i >= 0 && i < st->n_tensors) ? &st->tensors[i] : NULL;
}

const mf_st_tensor *mf_st_find(const mf_st *st, const char *name)
{
    mf_st_tensor key = {.name = name};
    return bsearch(&key, st->tensors, (size_t)st->n_tensors, sizeof key, cmp_tensor_name);
}

int mf_st_n_shards(const mf_st *st) { return st->n_shards; }

const char *mf_st_shard_path(const mf_st *st, int shard)
{
    return (shard >= 0 && shard < st->n_shards) ? st->shards[shard].path : NULL;
}

uint64_t mf_st_shard_bytes(const mf_st *st, int shard)
{
    return (shard >= 0 && shard < st->n_shards) ? st->shards[shard].bytes : 0;
}

int mf_st_shard_fd(const mf_st *st, int shard)
{
    return (shard >= 0 && shard < st->n_shards) ? st->shards[shard].fd : -1;
}

const char *mf_st_metadata(const mf_st *st, const char *key)
{
    for (int s = 0; s < st->n_shards; s++) {
        const char *v = json_string_value(json_object_get(st->shards[s].meta, key));
        if (v) return v;
    }
    return NULL;
}

int mf_st_read(const mf_st *st, const mf_st_tensor *t, uint64_t offset, void *dst, size_t n)
{
    if (!t || t->shard < 0 || t->shard >= st->n_shards)
        return mf_error(-EINVAL, "mf_st_read: tensor %s does not belong to this checkpoint",
                        t && t->name ? t->name : "(null)");
    const char *path = st->shards[t->shard].path;
    if (offset > t->n_bytes || n > t->n_bytes - offset)
        return mf_error(-EINVAL,
                        "%s: tensor \"%.200s\": read of %zu bytes at offset %llu is past its end "
                        "(%llu bytes)",
                        path, t->name, n, (unsigned long long)offset,
                        (unsigned long long)t->n_bytes);
    int64_t got = mf_st_pread_all(st->shards[t->shard].fd, dst, n, t->file_offset + offset);
    if (got < 0)
        return mf_error((int)got, "%s: tensor \"%.200s\": reading %zu bytes at offset %llu: %s",
                        path, t->name, n, (unsigned long long)offset, strerror((int)-got));
    if ((uint64_t)got != n)
        return mf_error(-EIO,
                        "%s: tensor \"%.200s\": short read, %lld of %zu bytes at file offset %llu "
                        "(file truncated since it was opened?)",
                        path, t->name, (long long)got, n,
                        (unsigned long long)(t->file_offset + offset));
    return 0;
}
