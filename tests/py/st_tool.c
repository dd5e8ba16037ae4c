/* Helper for check_st_interop.py: `st_tool dump PATH [KEY...]` prints a checkpoint's tensors
 * (name, dtype, shape, shard, bytes as hex) and the given __metadata__ keys as JSON;
 * `st_tool write PATH` and `st_tool write-sharded DIR` write files with known contents (byte j of
 * a tensor is (s + 7 j) mod 256, s the sum of its name's bytes; BOOL bytes are that value's bit 1)
 * for the Python side to check. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "host/safetensors.h"
#include "sched/error.h"

static int dump(const char *path, char **keys, int n_keys)
{
    mf_st *st = NULL;
    int rc = mf_st_open(path, &st);
    if (rc) {
        fprintf(stderr, "st_tool: %s\n", mf_last_error());
        return 1;
    }
    json_t *root = json_object(), *tensors = json_array(), *meta = json_object();
    json_object_set_new(root, "n_shards", json_integer(mf_st_n_shards(st)));
    json_object_set_new(root, "tensors", tensors);
    json_object_set_new(root, "metadata", meta);
    for (int i = 0; i < mf_st_n_tensors(st) && rc == 0; i++) {
        const mf_st_tensor *t = mf_st_tensor_at(st, i);
        unsigned char *buf = malloc(t->n_bytes ? t->n_bytes : 1);
        char *hex = malloc(2 * t->n_bytes + 1);
        if (!buf || !hex || (rc = mf_st_read(st, t, 0, buf, t->n_bytes)) != 0) {
            fprintf(stderr, "st_tool: %s\n", rc ? mf_last_error() : "out of memory");
            rc = rc ? rc : -1;
        } else {
            for (uint64_t j = 0; j < t->n_bytes; j++) sprintf(hex + 2 * j, "%02x", buf[j]);
            hex[2 * t->n_bytes] = '\0';
            json_t *shape = json_array();
            for (int d = 0; d < t->n_dims; d++) json_array_append_new(shape, json_integer(t->shape[d]));
            const char *shard = strrchr(mf_st_shard_path(st, t->shard), '/');
            json_array_append_new(tensors, json_pack("{s:s, s:s, s:o, s:s, s:s}", "name", t->name,
                                                     "dtype", mf_dtype_name(t->dtype), "shape",
                                                     shape, "shard",
                                                     shard ? shard + 1 : mf_st_shard_path(st, t->shard),
                                                     "hex", hex));
        }
        free(buf);
        free(hex);
    }
    for (int k = 0; k < n_keys; k++) {
        const char *v = mf_st_metadata(st, keys[k]);
        json_object_set_new(meta, keys[k], v ? json_string(v) : json_null());
    }
    mf_st_close(st);
    if (rc == 0) {
        json_dumpf(root, stdout, JSON_COMPACT);
        putchar('\n');
    }
    json_decref(root);
    return rc ? 1 : 0;
}

static unsigned char known_byte(const char *name, mf_dtype dt, uint64_t j)
{
    unsigned s = 0;
    for (const char *p = name; *p; p++) s += (unsigned char)*p;
    unsigned v = (s + 7u * (unsigned)(j & 0xffffffu)) & 0xffu;
    return dt == MF_DTYPE_BOOL ? (unsigned char)((v >> 1) & 1u) : (unsigned char)v;
}

static int write_known(const char *path, const mf_st_spec *specs, int n, const char *const *kv,
                       int n_meta)
{
    mf_st_writer *w = NULL;
    int rc = mf_st_writer_create(path, specs, n, kv, n_meta, &w);
    for (int i = 0; i < n && rc == 0; i++) {
        uint64_t nb = mf_st_writer_tensor_bytes(w, i);
        unsigned char *buf = malloc(nb ? nb : 1);
        if (!buf) {
            mf_st_writer_abort(w);
            fprintf(stderr, "st_tool: out of memory\n");
            return 1;
        }
        for (uint64_t j = 0; j < nb; j++) buf[j] = known_byte(specs[i].name, specs[i].dtype, j);
        rc = mf_st_writer_pwrite(w, i, 0, buf, nb);
        free(buf);
        if (rc) mf_st_writer_abort(w);
    }
    if (rc == 0) rc = mf_st_writer_finish(w);
    if (rc) fprintf(stderr, "st_tool: %s\n", mf_last_error());
    return rc ? 1 : 0;
}

int main(int argc, char **argv)
{
    if (argc >= 3 && strcmp(argv[1], "dump") == 0) return dump(argv[2], argv + 3, argc - 3);
    if (argc == 3 && strcmp(argv[1], "write") == 0) {
        mf_st_spec specs[MF_DTYPE_COUNT + 3];
        char names[MF_DTYPE_COUNT][32];
        int n = 0;
        for (int d = 0; d < MF_DTYPE_COUNT; d++, n++) {
            snprintf(names[d], sizeof names[d], "t.%s", mf_dtype_name((mf_dtype)d));
            specs[n] = (mf_st_spec){names[d], (mf_dtype)d, 2, {3, 4}};
        }
        specs[n++] = (mf_st_spec){"scalar.f32", MF_DTYPE_F32, 0, {0}};
        specs[n++] = (mf_st_spec){"empty.bf16", MF_DTYPE_BF16, 3, {2, 0, 5}};
        specs[n++] = (mf_st_spec){"deep.i8", MF_DTYPE_I8, 8, {1, 2, 1, 2, 1, 2, 1, 3}};
        const char *kv[] = {"writer", "moeflow st_tool", "format", "np"};
        return write_known(argv[2], specs, n, kv, 2);
    }
    if (argc == 3 && strcmp(argv[1], "write-sharded") == 0) {
        char p[4096];
        mf_st_spec a[] = {{"model.embed", MF_DTYPE_BF16, 2, {8, 4}},
                          {"model.layers.0.w", MF_DTYPE_F8_E4M3, 2, {4, 8}}};
        mf_st_spec b[] = {{"model.layers.0.scale", MF_DTYPE_F8_E8M0, 1, {4}},
                          {"model.norm", MF_DTYPE_F32, 1, {4}}};
        snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", argv[2]);
        if (write_known(p, a, 2, NULL, 0)) return 1;
        snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", argv[2]);
        if (write_known(p, b, 2, NULL, 0)) return 1;
        const char *names[] = {a[0].name, a[1].name, b[0].name, b[1].name};
        const char *files[] = {"model-00001-of-00002.safetensors", "model-00001-of-00002.safetensors",
                               "model-00002-of-00002.safetensors", "model-00002-of-00002.safetensors"};
        if (mf_st_index_write(argv[2], names, files, 4, 64 + 32 + 4 + 16) != 0) {
            fprintf(stderr, "st_tool: %s\n", mf_last_error());
            return 1;
        }
        return 0;
    }
    fprintf(stderr, "usage: st_tool dump PATH [KEY...] | write PATH | write-sharded DIR\n");
    return 2;
}
