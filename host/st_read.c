/* Parsing and validating one safetensors header, following what the Python package accepts:
 * entries are {dtype, shape, data_offsets} (other keys ignored), __metadata__ maps strings to
 * strings (or is null), and the tensors' byte ranges must tile the data section exactly: no gap,
 * no overlap, nothing after the last tensor. Every refusal names the source and the tensor. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "host/st_internal.h"
#include "host/json_kind.h"
#include "sched/error.h"

void mf_st_tensors_free(mf_st_tensor *t, int n)
{
    if (!t) return;
    for (int i = 0; i < n; i++) free((char *)t[i].name);
    free(t);
}

int mf_st_check_prefix(const char *what, const unsigned char *first8, uint64_t file_bytes,
                       uint64_t *header_bytes)
{
    if (file_bytes < 8)
        return mf_error(-EINVAL,
                        "%s: file is %llu bytes, shorter than the 8-byte header length that "
                        "starts a safetensors file",
                        what, (unsigned long long)file_bytes);
    uint64_t n = 0;
    for (int b = 0; b < 8; b++) n |= (uint64_t)first8[b] << (8 * b);
    if (n > MF_ST_MAX_HEADER_BYTES)
        return mf_error(-EINVAL, "%s: header length %llu is over the %u-byte limit", what,
                        (unsigned long long)n, MF_ST_MAX_HEADER_BYTES);
    if (n > file_bytes - 8)
        return mf_error(-EINVAL,
                        "%s: header length %llu runs past the end of the file (%llu bytes, so at "
                        "most %llu)",
                        what, (unsigned long long)n, (unsigned long long)file_bytes,
                        (unsigned long long)(file_bytes - 8));
    *header_bytes = n;
    return 0;
}

/* Reads a non-negative JSON integer; -1 when v is anything else. */
static int get_u64(const json_t *v, uint64_t *out)
{
    if (!json_is_integer(v) || json_integer_value(v) < 0) return -1;
    *out = (uint64_t)json_integer_value(v);
    return 0;
}

static int check_metadata(const char *what, json_t *meta)
{
    if (json_is_null(meta)) return 0;
    if (!json_is_object(meta))
        return mf_error(-EINVAL, "%s: __metadata__: expected an object of strings, found %s",
                        what, mf_json_kind(meta));
    const char *k;
    json_t *v;
    json_object_foreach(meta, k, v) {
        if (!json_is_string(v))
            return mf_error(-EINVAL, "%s: __metadata__ \"%.200s\": expected a string, found %s",
                            what, k, mf_json_kind(v));
    }
    return 0;
}

/* Fills t (name excluded) and the range [begin, end) of the data section from one entry. */
static int parse_entry(const char *what, const char *name, json_t *v, uint64_t data_bytes,
                       mf_st_tensor *t, uint64_t *begin, uint64_t *end)
{
    if (!json_is_object(v))
        return mf_error(-EINVAL, "%s: tensor \"%.200s\": expected an object, found %s", what, name,
                        mf_json_kind(v));
    json_t *dt = json_object_get(v, "dtype"), *shape = json_object_get(v, "shape"),
           *offs = json_object_get(v, "data_offsets");
    if (!dt || !shape || !offs)
        return mf_error(-EINVAL, "%s: tensor \"%.200s\": missing field \"%s\"", what, name,
                        !dt ? "dtype" : !shape ? "shape" : "data_offsets");
    if (!json_is_string(dt))
        return mf_error(-EINVAL, "%s: tensor \"%.200s\": dtype: expected a string, found %s",
                        what, name, mf_json_kind(dt));
    if (mf_dtype_parse(json_string_value(dt), &t->dtype) != 0)
        return mf_error(-EINVAL, "%s: tensor \"%.200s\": unknown dtype \"%.40s\"", what, name,
                        json_string_value(dt));
    if (!json_is_array(shape))
        return mf_error(-EINVAL, "%s: tensor \"%.200s\": shape: expected an array, found %s",
                        what, name, mf_json_kind(shape));
    size_t n_dims = json_array_size(shape);
    if (n_dims > MF_ST_MAX_DIMS)
        return mf_error(-EINVAL, "%s: tensor \"%.200s\": shape has %zu dims, at most %d supported",
                        what, name, n_dims, MF_ST_MAX_DIMS);
    t->n_dims = (int)n_dims;
    for (size_t d = 0; d < n_dims; d++) {
        json_t *e = json_array_get(shape, d);
        if (!json_is_integer(e) || json_integer_value(e) < 0) {
            if (json_is_integer(e))
                return mf_error(-EINVAL, "%s: tensor \"%.200s\": shape[%zu] is negative (%lld)",
                                what, name, d, (long long)json_integer_value(e));
            return mf_error(-EINVAL,
                            "%s: tensor \"%.200s\": shape[%zu]: expected a non-negative integer, "
                            "found %s",
                            what, name, d, mf_json_kind(e));
        }
        t->shape[d] = (int64_t)json_integer_value(e);
    }
    if (!json_is_array(offs) || json_array_size(offs) != 2 ||
        get_u64(json_array_get(offs, 0), begin) != 0 || get_u64(json_array_get(offs, 1), end) != 0)
        return mf_error(-EINVAL,
                        "%s: tensor \"%.200s\": data_offsets: expected [begin, end] of two "
                        "non-negative integers",
                        what, name);
    if (*end < *begin)
        return mf_error(-EINVAL, "%s: tensor \"%.200s\": data_offsets [%llu, %llu] end before begin",
                        what, name, (unsigned long long)*begin, (unsigned long long)*end);
    int sz = mf_st_shape_bytes(t->dtype, t->n_dims, t->shape, &t->n_bytes);
    if (sz == -2)
        return mf_error(-EINVAL, "%s: tensor \"%.200s\": %s elements end mid-byte (need an even "
                        "count)", what, name, mf_dtype_name(t->dtype));
    if (sz != 0)
        return mf_error(-EINVAL, "%s: tensor \"%.200s\": element count of the shape overflows "
                        "64 bits", what, name);
    if (*end - *begin != t->n_bytes) {
        char dims[MF_ST_MAX_DIMS * 22 + 4] = "[";
        for (int d = 0; d < t->n_dims; d++)
            snprintf(dims + strlen(dims), sizeof dims - strlen(dims), "%s%lld", d ? ", " : "",
                     (long long)t->shape[d]);
        strcat(dims, "]");
        return mf_error(-EINVAL,
                        "%s: tensor \"%.200s\": shape %s of %s needs %llu bytes, "
                        "data_offsets [%llu, %llu] hold %llu",
                        what, name, dims, mf_dtype_name(t->dtype),
                        (unsigned long long)t->n_bytes, (unsigned long long)*begin,
                        (unsigned long long)*end, (unsigned long long)(*end - *begin));
    }
    if (*end > data_bytes)
        return mf_error(-EINVAL,
                        "%s: tensor \"%.200s\": data_offsets end %llu is past the data section "
                        "(%llu bytes after the header): the file is truncated or the offsets wrong",
                        what, name, (unsigned long long)*end, (unsigned long long)data_bytes);
    return 0;
}

typedef struct range {
    uint64_t begin, end;
    int i;
} range;

static int cmp_range(const void *a, const void *b)
{
    const range *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return x->i - y->i;
}

/* The ranges, sorted by begin, must follow each other without gap or overlap and end exactly at
 * the end of the data section (the Python package's rule; it refuses files with gaps). */
static int check_tiling(const char *what, const mf_st_tensor *t, range *r, int n,
                        uint64_t data_bytes)
{
    qsort(r, (size_t)n, sizeof *r, cmp_range);
    uint64_t at = 0;
    for (int k = 0; k < n; k++) {
        if (r[k].begin > at)
            return mf_error(-EINVAL,
                            "%s: data bytes [%llu, %llu) belong to no tensor (gap before tensor "
                            "\"%.200s\")",
                            what, (unsigned long long)at, (unsigned long long)r[k].begin,
                            t[r[k].i].name);
        if (r[k].begin < at)
            return mf_error(-EINVAL,
                            "%s: tensor \"%.200s\" [%llu, %llu) overlaps tensor \"%.200s\" which "
                            "ends at %llu",
                            what, t[r[k].i].name, (unsigned long long)r[k].begin,
                            (unsigned long long)r[k].end, t[r[k - 1].i].name,
                            (unsigned long long)at);
        at = r[k].end;
    }
    if (at != data_bytes)
        return mf_error(-EINVAL,
                        "%s: data section is %llu bytes but the tensors cover only %llu (trailing "
                        "bytes after the last tensor)",
                        what, (unsigned long long)data_bytes, (unsigned long long)at);
    return 0;
}

int mf_st_parse_header_meta(const char *what, const char *json, size_t json_bytes,
                            uint64_t data_bytes, mf_st_tensor **out, int *n_out, json_t **meta_out)
{
    *out = NULL;
    *n_out = 0;
    if (meta_out) *meta_out = NULL;
    json_error_t jerr;
    json_t *root = json_loadb(json, json_bytes, JSON_REJECT_DUPLICATES, &jerr);
    if (!root && json_error_code(&jerr) == json_error_duplicate_key)
        return mf_error(-EINVAL, "%s: header names a key twice (line %d, column %d): %s", what,
                        jerr.line, jerr.column, jerr.text);
    if (!root)
        return mf_error(-EINVAL, "%s: header is not valid JSON (line %d, column %d): %s", what,
                        jerr.line, jerr.column, jerr.text);
    if (!json_is_object(root)) {
        int rc = mf_error(-EINVAL, "%s: header: expected a JSON object, found %s", what,
                          mf_json_kind(root));
        json_decref(root);
        return rc;
    }
    int rc = 0;
    json_t *meta = json_object_get(root, "__metadata__");
    size_t cap = json_object_size(root);
    mf_st_tensor *t = calloc(cap ? cap : 1, sizeof *t);
    range *r = calloc(cap ? cap : 1, sizeof *r);
    if (!t || !r) {
        rc = mf_error(-ENOMEM, "%s: out of memory for %zu tensors", what, cap);
        goto out;
    }
    if (meta && (rc = check_metadata(what, meta)) != 0) goto out;
    int n = 0;
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (strcmp(key, "__metadata__") == 0) continue;
        if (n >= INT32_MAX - 1) {
            rc = mf_error(-EINVAL, "%s: too many tensors", what);
            goto out;
        }
        rc = parse_entry(what, key, v, data_bytes, &t[n], &r[n].begin, &r[n].end);
        if (rc) goto out;
        t[n].name = strdup(key);
        if (!t[n].name) {
            rc = mf_error(-ENOMEM, "%s: out of memory", what);
            goto out;
        }
        t[n].shard = 0;
        t[n].file_offset = 8 + (uint64_t)json_bytes + r[n].begin;
        r[n].i = n;
        n++;
    }
    *n_out = n;
    rc = check_tiling(what, t, r, n, data_bytes);
out:
    free(r);
    if (rc) {
        mf_st_tensors_free(t, (int)cap);   /* unused slots have NULL names */
        *n_out = 0;
    } else {
        *out = t;
        if (meta_out && json_is_object(meta)) *meta_out = json_incref(meta);
    }
    json_decref(root);
    return rc;
}

int mf_st_parse_header(const char *what, const char *json, size_t json_bytes, uint64_t data_bytes,
                       mf_st_tensor **out, int *n_out)
{
    return mf_st_parse_header_meta(what, json, json_bytes, data_bytes, out, n_out, NULL);
}

int mf_st_parse_image(const char *what, const void *file, size_t file_bytes, mf_st_tensor **out,
                      int *n_out)
{
    *out = NULL;
    *n_out = 0;
    uint64_t n = 0;
    int rc = mf_st_check_prefix(what, file, file_bytes, &n);
    if (rc) return rc;
    return mf_st_parse_header(what, (const char *)file + 8, (size_t)n, file_bytes - 8 - n, out,
                              n_out);
}
