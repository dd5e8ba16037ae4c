/* `moeflow gen` in library form: lays a config's tensors out over shards, fills them with
 * counter-based random values (splitmix64 of seed, name and element index) whose scales keep a
 * forward pass finite, and writes config.json and the index last so an interrupted run never
 * leaves a checkpoint that looks complete. */
#include "graphs/gen/gen.h"
#include "graphs/model/engram_map.h"
#include "graphs/gen/gen_chat.h"
#include "graphs/gen/gen_tokenizer.h"
#include "host/tokenizer.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "host/formats.h"
#include "host/safetensors.h"
#include "sched/error.h"
#include "sched/path.h"
#include "sched/progress.h"

#define MF_GEN_CHUNK_BYTES (8u << 20)

int mf_gen_preset_opts(const char *preset, mf_gen_opts *out)
{
    memset(out, 0, sizeof *out);
    if (!strcmp(preset, "tiny")) out->n_shards = 2;
    else if (!strcmp(preset, "demo")) out->n_shards = 4;
    else if (!strcmp(preset, "big")) out->n_shards = 16;
    else if (!strcmp(preset, "flash41")) {
        out->n_shards = 48;   /* as released */
        out->sparse = 1;      /* 475 GiB of holes: the layout without the data */
    } else
        return mf_error(-EINVAL, "unknown preset '%s' (expected one of: %s)", preset,
                        mf_config_preset_names());
    return 0;
}

/* ---- shard assignment ---------------------------------------------------------------------- */

int mf_gen_assign_shards(const mf_layout *l, int n_shards, int *shard_of)
{
    int n = mf_layout_n(l);
    if (n_shards < 1 || n_shards > n)
        return mf_error(-EINVAL, "gen: cannot spread %d tensors over %d shards", n, n_shards);
    uint64_t rem = mf_layout_total_bytes(l);
    int i = 0;
    for (int s = 0; s < n_shards; s++) {
        int shards_left = n_shards - s;
        if (shards_left == 1) {
            for (; i < n; i++) shard_of[i] = s;
            break;
        }
        uint64_t target = rem / (uint64_t)shards_left, cur = 0;
        int last_allowed = n - (shards_left - 1);   /* leave one tensor per later shard */
        while (i < last_allowed) {
            uint64_t b = mf_layout_at(l, i)->n_bytes;
            if (cur > 0 && cur + b / 2 > target) break;
            cur += b;
            shard_of[i++] = s;
        }
        rem -= cur;
    }
    return 0;
}

/* ---- values -------------------------------------------------------------------------------- */

static inline uint64_t mf_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t mf_tensor_key(uint64_t seed, const char *name)
{
    uint64_t h = 0xCBF29CE484222325ull;   /* FNV-1a of the name */
    for (const unsigned char *p = (const unsigned char *)name; *p; p++) h = (h ^ *p) * 0x100000001B3ull;
    return mf_mix64(h ^ mf_mix64(seed + 0x9E3779B97F4A7C15ull));
}

static inline uint64_t mf_rnd(uint64_t key, uint64_t j)
{
    return mf_mix64(key + (j + 1) * 0x9E3779B97F4A7C15ull);
}

/* Approximately N(0,1): the sum of four uniform 16-bit values, centred and scaled (bounded by
 * +-3.46, so an e4m3 code never saturates). */
static inline float mf_normal(uint64_t r)
{
    uint32_t s = (uint32_t)(r & 0xFFFF) + (uint32_t)((r >> 16) & 0xFFFF) +
                 (uint32_t)((r >> 32) & 0xFFFF) + (uint32_t)(r >> 48);
    return ((float)s - 131070.0f) * (1.7320508f / 65536.0f);
}

/* E8M0 code of 2^round(log2(x)), clamped to the finite codes. */
static uint8_t mf_pow2_code(double x)
{
    long e = lround(log2(x)) + 127;
    return (uint8_t)(e < 1 ? 1 : e > 254 ? 254 : e);
}

static uint8_t mf_scale_code(const mf_layout_tensor *t)
{
    double in = t->fan_in > 0 ? (double)t->fan_in : 1.0;
    switch (t->role) {
    case MF_ROLE_FP8_SCALE: return mf_pow2_code(1.0 / sqrt(in));   /* codes ~N(0,1) */
    /* uniform e2m1 codes have mean square (0+.25+1+2.25+4+9+16+36)/8 = 8.5625 */
    case MF_ROLE_FP4_SCALE: return mf_pow2_code(1.0 / sqrt(8.5625 * in));
    default: return 127;   /* Engram tables: unit rows */
    }
}

/* Every non-scale value is `constant` (when mul is 0) or mul * N(0,1). */
static void mf_value_rule(const mf_layout_tensor *t, float *constant, float *mul)
{
    double in = t->fan_in > 0 ? (double)t->fan_in : 1.0;
    *constant = 0.0f;
    *mul = 0.0f;
    switch (t->role) {
    case MF_ROLE_NORM: *constant = 1.0f; break;
    case MF_ROLE_SINK: break;
    case MF_ROLE_HC_SCALE: *constant = 1.0f; break;
    case MF_ROLE_BIAS: *mul = 0.01f; break;
    case MF_ROLE_HC_BASE: *mul = 0.1f; break;
    case MF_ROLE_HC_FN: *mul = (float)(0.1 / sqrt(in)); break;
    case MF_ROLE_LINEAR: *mul = (float)(1.0 / sqrt(in)); break;
    default: *mul = 1.0f; break;   /* embed, fp8 weight codes, table codes */
    }
}

/* e4m3 code of mf_normal() for every sum of four 16-bit values (0..4 x 65535): encoding through
 * this table gives the same bytes as mf_e4m3_from_f32 and is ~10x faster. */
#define MF_SUM4_N (4u * 65535u + 1u)
static uint8_t mf_e4m3_of_sum[MF_SUM4_N];
static pthread_once_t mf_e4m3_once = PTHREAD_ONCE_INIT;

static void mf_e4m3_table_init(void)
{
    for (uint32_t s = 0; s < MF_SUM4_N; s++)
        mf_e4m3_of_sum[s] = mf_e4m3_from_f32(((float)s - 131070.0f) * (1.7320508f / 65536.0f));
}

static inline uint32_t mf_sum4(uint64_t r)
{
    return (uint32_t)(r & 0xFFFF) + (uint32_t)((r >> 16) & 0xFFFF) +
           (uint32_t)((r >> 32) & 0xFFFF) + (uint32_t)(r >> 48);
}

void mf_gen_fill(const mf_layout_tensor *t, uint64_t seed, uint64_t offset, void *dst, size_t n)
{
    uint64_t key = mf_tensor_key(seed, t->name);
    uint8_t *d = dst;
    switch (t->role) {
    case MF_ROLE_FP8_SCALE:
    case MF_ROLE_FP4_SCALE:
    case MF_ROLE_TABLE_SCALE:
        memset(d, mf_scale_code(t), n);
        return;
    case MF_ROLE_FP4_WEIGHT:   /* uniform random bytes: two uniform e2m1 codes each */
        for (size_t b = 0; b < n; b++) {
            uint64_t j = offset + b;
            d[b] = (uint8_t)(mf_rnd(key, j >> 3) >> (8 * (j & 7)));
        }
        return;
    default:
        break;
    }
    float constant, mul;
    mf_value_rule(t, &constant, &mul);
    switch (t->dtype) {
    case MF_DTYPE_F8_E4M3:
        if (mul == 1.0f) {
            pthread_once(&mf_e4m3_once, mf_e4m3_table_init);
            for (size_t b = 0; b < n; b++) d[b] = mf_e4m3_of_sum[mf_sum4(mf_rnd(key, offset + b))];
        } else {
            for (size_t b = 0; b < n; b++)
                d[b] = mf_e4m3_from_f32(mul ? mul * mf_normal(mf_rnd(key, offset + b)) : constant);
        }
        return;
    case MF_DTYPE_BF16:
        for (size_t k = 0; k < n / 2; k++) {
            float x = mul ? mul * mf_normal(mf_rnd(key, offset / 2 + k)) : constant;
            uint16_t v = mf_bf16_from_f32(x);
            memcpy(d + 2 * k, &v, 2);
        }
        return;
    case MF_DTYPE_F32:
        for (size_t k = 0; k < n / 4; k++) {
            float x = mul ? mul * mf_normal(mf_rnd(key, offset / 4 + k)) : constant;
            memcpy(d + 4 * k, &x, 4);
        }
        return;
    default:   /* no other dtype appears in the layout */
        memset(d, 0, n);
        return;
    }
}

/* ---- writing ------------------------------------------------------------------------------- */

static int mf_is_our_file(const char *name)
{
    size_t len = strlen(name);
    if (!strcmp(name, "config.json") || !strcmp(name, "model.safetensors.index.json") ||
        !strcmp(name, "tokenizer.json") || !strcmp(name, "tokenizer_config.json"))
        return 1;
    return !strncmp(name, "model-", 6) && len > 12 && !strcmp(name + len - 12, ".safetensors");
}

/* Checks `dir`: creates it when missing (*created = 1); refuses a non-empty one unless force, in
 * which case our files there are removed. */
static int mf_gen_prepare_dir(const char *dir, int force, int *created)
{
    *created = 0;
    struct stat st;
    if (stat(dir, &st) != 0) {
        if (errno != ENOENT) return mf_error(-errno, "%s: %s", dir, strerror(errno));
        int rc = mf_path_mkdirs(dir);   /* missing parents too, as mkdir -p */
        if (rc) return rc;
        *created = 1;
        return 0;
    }
    if (!S_ISDIR(st.st_mode)) return mf_error(-ENOTDIR, "%s: exists and is not a directory", dir);
    DIR *d = opendir(dir);
    if (!d) return mf_error(-errno, "%s: cannot list: %s", dir, strerror(errno));
    int n_entries = 0, rc = 0;
    struct dirent *e;
    char path[4096];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        n_entries++;
        if (force && mf_is_our_file(e->d_name)) {
            snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
            if (unlink(path) != 0 && !rc)
                rc = mf_error(-errno, "%s: cannot remove: %s", path, strerror(errno));
        }
    }
    closedir(d);
    if (rc) return rc;
    if (n_entries > 0 && !force)
        return mf_error(-EEXIST, "%s: directory is not empty (use --force to write into it)", dir);
    return 0;
}

typedef struct mf_gen_files {
    char **paths;
    int n;
} mf_gen_files;

static void mf_gen_files_add(mf_gen_files *f, const char *path)
{
    f->paths[f->n++] = strdup(path);
}

static void mf_gen_files_undo(mf_gen_files *f, const char *dir, int created)
{
    for (int i = f->n - 1; i >= 0; i--)
        if (f->paths[i]) unlink(f->paths[i]);
    if (created) rmdir(dir);
}

static void mf_gen_files_free(mf_gen_files *f)
{
    for (int i = 0; i < f->n; i++) free(f->paths[i]);
    free(f->paths);
}

/* Writes one shard: tensors idx[0..n) of the layout. */
static int mf_gen_shard(const mf_layout *l, const int *idx, int n, const char *path,
                        const mf_gen_opts *o, uint8_t *buf, mf_progress *prog)
{
    mf_st_spec *specs = calloc((size_t)n, sizeof *specs);
    if (!specs) return mf_error(-ENOMEM, "%s: out of memory", path);
    for (int k = 0; k < n; k++) {
        const mf_layout_tensor *t = mf_layout_at(l, idx[k]);
        specs[k].name = t->name;
        specs[k].dtype = t->dtype;
        specs[k].n_dims = t->n_dims;
        specs[k].shape[0] = t->shape[0];
        specs[k].shape[1] = t->shape[1];
    }
    static const char *const meta[] = {"format", "pt"};
    mf_st_writer *w;
    int rc = mf_st_writer_create(path, specs, n, meta, 1, &w);
    free(specs);
    if (rc) return rc;
    for (int k = 0; k < n && rc == 0; k++) {
        const mf_layout_tensor *t = mf_layout_at(l, idx[k]);
        if (o->sparse) {
            mf_progress_add(prog, t->n_bytes);
            continue;
        }
        for (uint64_t off = 0; off < t->n_bytes && rc == 0;) {
            size_t len = t->n_bytes - off < MF_GEN_CHUNK_BYTES ? (size_t)(t->n_bytes - off)
                                                              : MF_GEN_CHUNK_BYTES;
            mf_gen_fill(t, o->seed, off, buf, len);
            rc = mf_st_writer_pwrite(w, k, off, buf, len);
            off += len;
            mf_progress_add(prog, len);
        }
        if (rc) mf_error_wrap(rc, "%s: tensor %s", path, t->name);
    }
    if (rc) {
        mf_st_writer_abort(w);
        return rc;
    }
    return mf_st_writer_finish(w);
}

/* Sets c->engram_compressed_vocab_size to the number of Engram keys of the tokenizer at path. */
static int mf_gen_engram_vocab(const char *path, mf_config *c)
{
    mf_tok *tok;
    mf_engram_map *map;
    int rc = mf_tok_load(path, &tok);
    if (rc) return rc;
    rc = mf_engram_map_build(tok, &map);
    mf_tok_free(tok);
    if (rc) return rc;
    c->engram_compressed_vocab_size = mf_engram_map_n_unique(map);
    mf_engram_map_free(map);
    return 0;
}

int mf_gen_write(const mf_config *c, const char *dir, const mf_gen_opts *o)
{
    mf_layout *l;
    int rc = mf_layout_build(c, &l);
    if (rc) return rc;
    int n = mf_layout_n(l);
    int *shard_of = malloc((size_t)n * sizeof *shard_of);
    int *idx = malloc((size_t)n * sizeof *idx);
    const char **names = malloc((size_t)n * sizeof *names);
    const char **files = malloc((size_t)n * sizeof *files);
    char **shard_names = calloc((size_t)(o->n_shards > 0 ? o->n_shards : 1), sizeof *shard_names);
    uint8_t *buf = o->sparse ? NULL : malloc(MF_GEN_CHUNK_BYTES);
    mf_gen_files written = {calloc((size_t)(o->n_shards > 0 ? o->n_shards : 1) + 3, sizeof(char *)), 0};
    int created = 0;
    char path[4096];
    if (!shard_of || !idx || !names || !files || !shard_names || (!o->sparse && !buf) ||
        !written.paths) {
        rc = mf_error(-ENOMEM, "gen: out of memory for %d tensors", n);
        goto out;
    }
    if ((rc = mf_gen_assign_shards(l, o->n_shards, shard_of))) goto out;
    if ((rc = mf_gen_prepare_dir(dir, o->force, &created))) goto out;

    mf_progress prog;
    mf_progress_begin(&prog, o->sparse ? "gen (layout only)" : "gen", mf_layout_total_bytes(l), 1,
                      o->quiet);
    for (int s = 0, i = 0; s < o->n_shards; s++) {
        int k = 0;
        for (; i < n && shard_of[i] == s; i++) idx[k++] = i;
        char name[64];
        snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, o->n_shards);
        shard_names[s] = strdup(name);
        snprintf(path, sizeof path, "%s/%s", dir, name);
        if (!shard_names[s]) {
            rc = mf_error(-ENOMEM, "gen: out of memory");
            break;
        }
        if ((rc = mf_gen_shard(l, idx, k, path, o, buf, &prog))) break;
        mf_gen_files_add(&written, path);
    }
    /* A model with weights gets a tokenizer.json sized to its vocabulary; its Engram token map
     * defines the compressed vocabulary, so the config written says that size. Layout-only
     * (sparse) checkpoints keep the preset's figures and get no tokenizer. */
    mf_config cw = *c;
    if (rc == 0 && !o->sparse) {
        snprintf(path, sizeof path, "%s/tokenizer.json", dir);
        rc = mf_gen_tokenizer_write(c, path);
        if (rc == 0) mf_gen_files_add(&written, path);
        if (rc == 0) rc = mf_gen_engram_vocab(path, &cw);
        /* its chat template (DeepSeek-V4's encoding with tools, graphs/gen/gen_chat.h) */
        snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
        if (rc == 0) rc = mf_gen_tokenizer_config_write(c, path);
        if (rc == 0) mf_gen_files_add(&written, path);
    }
    if (rc == 0) {
        snprintf(path, sizeof path, "%s/config.json", dir);
        rc = mf_config_write_json(&cw, path);
        if (rc == 0) mf_gen_files_add(&written, path);
    }
    if (rc == 0) {
        for (int i = 0; i < n; i++) {
            names[i] = mf_layout_at(l, i)->name;
            files[i] = shard_names[shard_of[i]];
        }
        rc = mf_st_index_write(dir, names, files, n, mf_layout_total_bytes(l));
    }
    if (rc == 0) mf_progress_end(&prog);
    else mf_gen_files_undo(&written, dir, created);
out:
    if (shard_names)
        for (int s = 0; s < o->n_shards; s++) free(shard_names[s]);
    free(shard_names);
    mf_gen_files_free(&written);
    free(buf);
    free(files);
    free(names);
    free(idx);
    free(shard_of);
    mf_layout_free(l);
    return rc;
}
