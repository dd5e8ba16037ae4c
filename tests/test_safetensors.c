/* safetensors reader and writer: round trips (every dtype, scalars, zero-size tensors, metadata,
 * sharded checkpoints with an index), sparse output, and one check per kind of malformed input,
 * each asserting the error code and that the message names the file and the tensor. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "host/safetensors.h"
#include "sched/error.h"
#include "tests/check.h"

static char g_dir[512];

static const char *tpath(const char *name)
{
    static char buf[4][768];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", g_dir, name);
    return buf[k];
}

static void write_bytes(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) {
        perror(path);
        exit(1);
    }
    if (n && fwrite(p, 1, n, f) != n) {
        perror(path);
        exit(1);
    }
    fclose(f);
}

/* A file with an 8-byte length `len_field`, header text and n_data bytes of 0xAB. */
static void write_raw_len(const char *path, uint64_t len_field, const char *hdr, size_t n_data)
{
    size_t h = strlen(hdr);
    unsigned char *buf = malloc(8 + h + n_data + 1);
    for (int b = 0; b < 8; b++) buf[b] = (unsigned char)(len_field >> (8 * b));
    memcpy(buf + 8, hdr, h);
    memset(buf + 8 + h, 0xAB, n_data);
    write_bytes(path, buf, 8 + h + n_data);
    free(buf);
}

static void write_raw(const char *path, const char *hdr, size_t n_data)
{
    write_raw_len(path, strlen(hdr), hdr, n_data);
}

/* mf_st_open(path) must fail with `code` and a message holding every given fragment. */
#define EXPECT_OPEN_FAIL(path, code, ...)                                                        \
    do {                                                                                         \
        mf_st *st_ = (mf_st *)0x1;                                                               \
        int rc_ = mf_st_open(path, &st_);                                                        \
        CHECK(rc_ == (code), "%s: rc %d, want %d (%s)", path, rc_, code, mf_last_error());       \
        CHECK(st_ == NULL, "%s: handle not cleared", path);                                      \
        const char *frags_[] = {__VA_ARGS__};                                                    \
        for (size_t f_ = 0; f_ < sizeof frags_ / sizeof *frags_; f_++)                           \
            CHECK(strstr(mf_last_error(), frags_[f_]), "%s: message lacks \"%s\": %s", path,     \
                  frags_[f_], mf_last_error());                                                  \
        if (rc_ == 0) mf_st_close(st_);                                                          \
        if (getenv("MF_TEST_VERBOSE")) printf("  %d: %s\n", rc_, mf_last_error());             \
    } while (0)

#define ENTRY(name, dt, shape, b, e) \
    "\"" name "\":{\"dtype\":\"" dt "\",\"shape\":" shape ",\"data_offsets\":[" #b "," #e "]}"

static unsigned char pattern(int tensor, uint64_t i)
{
    return (unsigned char)((i * 31 + (uint64_t)tensor * 7 + 1) & 0xff);
}

/* Writes specs into path with pattern bytes, in two pwrites per tensor. */
static int write_file(const char *path, const mf_st_spec *specs, int n, const char *const *kv,
                      int n_meta)
{
    mf_st_writer *w = NULL;
    int rc = mf_st_writer_create(path, specs, n, kv, n_meta, &w);
    if (rc) return rc;
    for (int i = 0; i < n; i++) {
        uint64_t nb = mf_st_writer_tensor_bytes(w, i);
        unsigned char *buf = malloc(nb ? nb : 1);
        for (uint64_t j = 0; j < nb; j++) buf[j] = pattern(i, j);
        uint64_t half = nb / 2;
        rc = mf_st_writer_pwrite(w, i, half, buf + half, nb - half);
        if (!rc) rc = mf_st_writer_pwrite(w, i, 0, buf, half);
        free(buf);
        if (rc) {
            mf_st_writer_abort(w);
            return rc;
        }
    }
    return mf_st_writer_finish(w);
}

/* Checks that every spec is in st with its dtype, shape, size and pattern bytes. */
static void check_contents(const mf_st *st, const mf_st_spec *specs, int n)
{
    for (int i = 0; i < n; i++) {
        const mf_st_tensor *t = mf_st_find(st, specs[i].name);
        CHECK(t != NULL, "tensor %s missing", specs[i].name);
        if (!t) continue;
        CHECK(t->dtype == specs[i].dtype, "%s: dtype %s", t->name, mf_dtype_name(t->dtype));
        CHECK(t->n_dims == specs[i].n_dims, "%s: n_dims %d", t->name, t->n_dims);
        int64_t elems = 1;
        for (int d = 0; d < t->n_dims && d < specs[i].n_dims; d++) {
            CHECK(t->shape[d] == specs[i].shape[d], "%s: dim %d", t->name, d);
            elems *= specs[i].shape[d];
        }
        CHECK((int64_t)t->n_bytes == mf_dtype_bytes(specs[i].dtype, elems), "%s: %llu bytes",
              t->name, (unsigned long long)t->n_bytes);
        unsigned char *buf = malloc(t->n_bytes + 1);
        int rc = mf_st_read(st, t, 0, buf, t->n_bytes);
        CHECK(rc == 0, "%s: read: %s", t->name, mf_last_error());
        int bad = 0;
        for (uint64_t j = 0; j < t->n_bytes; j++) bad += buf[j] != pattern(i, j);
        CHECK(bad == 0, "%s: %d bytes differ", t->name, bad);
        if (t->n_bytes > 3) {   /* a read in the middle */
            rc = mf_st_read(st, t, 1, buf, 2);
            CHECK(rc == 0 && buf[0] == pattern(i, 1) && buf[1] == pattern(i, 2), "%s: mid read",
                  t->name);
        }
        free(buf);
    }
}

static void test_roundtrip_single(void)
{
    mf_st_spec specs[MF_DTYPE_COUNT + 3];
    char names[MF_DTYPE_COUNT][32];
    int n = 0;
    for (int d = MF_DTYPE_COUNT - 1; d >= 0; d--, n++) {   /* reverse order: sorting is tested */
        snprintf(names[n], sizeof names[n], "w.%s", mf_dtype_name((mf_dtype)d));
        specs[n] = (mf_st_spec){names[n], (mf_dtype)d, 3, {2, 3, 4}};
    }
    specs[n++] = (mf_st_spec){"scalar", MF_DTYPE_F32, 0, {0}};
    specs[n++] = (mf_st_spec){"empty", MF_DTYPE_BF16, 2, {5, 0}};
    specs[n++] = (mf_st_spec){"a.first", MF_DTYPE_I64, 1, {3}};
    const char *kv[] = {"format", "pt", "note", "héllo \"quoted\""};
    const char *path = tpath("single.safetensors");
    int rc = write_file(path, specs, n, kv, 2);
    CHECK(rc == 0, "write: %s", mf_last_error());
    CHECK(access(tpath("single.safetensors.tmp"), F_OK) != 0, "tmp name is per pid");
    char tmp[800];
    snprintf(tmp, sizeof tmp, "%s.tmp-%ld", path, (long)getpid());
    CHECK(access(tmp, F_OK) != 0, "temporary file left behind");

    /* the header length is a multiple of 8, and the file is exactly as long as the writer said */
    unsigned char first8[8];
    FILE *f = fopen(path, "rb");
    CHECK(f && fread(first8, 1, 8, f) == 8, "read length");
    if (f) fclose(f);
    uint64_t hl = 0;
    for (int b = 0; b < 8; b++) hl |= (uint64_t)first8[b] << (8 * b);
    CHECK(hl % 8 == 0, "header length %llu not a multiple of 8", (unsigned long long)hl);

    mf_st *st = NULL;
    rc = mf_st_open(path, &st);
    CHECK(rc == 0, "open: %s", mf_last_error());
    if (rc) return;
    CHECK(mf_st_n_tensors(st) == n, "n_tensors %d", mf_st_n_tensors(st));
    CHECK(mf_st_n_shards(st) == 1, "n_shards");
    struct stat sb;
    stat(path, &sb);
    CHECK(mf_st_shard_bytes(st, 0) == (uint64_t)sb.st_size, "shard bytes");
    CHECK(strcmp(mf_st_shard_path(st, 0), path) == 0, "shard path");
    CHECK(mf_st_shard_fd(st, 0) >= 0 && mf_st_shard_fd(st, 1) == -1, "shard fd");
    for (int i = 1; i < n; i++)
        CHECK(strcmp(mf_st_tensor_at(st, i - 1)->name, mf_st_tensor_at(st, i)->name) < 0,
              "not sorted at %d", i);
    CHECK(mf_st_tensor_at(st, n) == NULL && mf_st_tensor_at(st, -1) == NULL, "tensor_at range");
    CHECK(mf_st_find(st, "nope") == NULL, "find absent");
    check_contents(st, specs, n);
    const mf_st_tensor *sc = mf_st_find(st, "scalar");
    CHECK(sc && sc->n_dims == 0 && sc->n_bytes == 4, "scalar");
    const mf_st_tensor *em = mf_st_find(st, "empty");
    CHECK(em && em->n_bytes == 0, "empty");
    CHECK(em && mf_st_read(st, em, 0, NULL, 0) == 0, "zero-byte read");
    const char *fmt = mf_st_metadata(st, "format"), *note = mf_st_metadata(st, "note");
    CHECK(fmt && strcmp(fmt, "pt") == 0, "metadata format");
    CHECK(note && strcmp(note, kv[3]) == 0, "metadata note");
    CHECK(mf_st_metadata(st, "absent") == NULL, "metadata absent");

    /* out-of-range reads name the file and the tensor */
    const mf_st_tensor *t = mf_st_find(st, "w.F32");
    unsigned char buf[128];
    rc = mf_st_read(st, t, t->n_bytes - 2, buf, 4);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), "w.F32") && strstr(mf_last_error(), path),
          "read past end: %d %s", rc, mf_last_error());
    rc = mf_st_read(st, t, UINT64_MAX - 1, buf, 4);
    CHECK(rc == -EINVAL, "read at huge offset: %d", rc);
    mf_st_close(st);

    /* a directory holding model.safetensors opens too; an empty directory does not */
    mkdir(tpath("single_dir"), 0755);
    rc = write_file(tpath("single_dir/model.safetensors"), specs, n, NULL, 0);
    CHECK(rc == 0, "write: %s", mf_last_error());
    rc = mf_st_open(tpath("single_dir"), &st);
    CHECK(rc == 0, "open dir: %s", mf_last_error());
    if (rc == 0) {
        CHECK(mf_st_metadata(st, "format") == NULL, "no metadata");
        check_contents(st, specs, n);
        mf_st_close(st);
    }
    mkdir(tpath("empty_dir"), 0755);
    EXPECT_OPEN_FAIL(tpath("empty_dir"), -ENOENT, "empty_dir", "model.safetensors");
    EXPECT_OPEN_FAIL(tpath("does_not_exist.safetensors"), -ENOENT, "does_not_exist");
}

static void test_roundtrip_sharded(void)
{
    mkdir(tpath("sharded"), 0755);
    mf_st_spec s0[] = {{"layer.0.w", MF_DTYPE_F8_E4M3, 2, {16, 8}},
                       {"layer.0.scale", MF_DTYPE_F8_E8M0, 1, {16}}};
    mf_st_spec s1[] = {{"layer.1.w", MF_DTYPE_BF16, 2, {4, 4}}, {"embed", MF_DTYPE_F16, 1, {10}}};
    mf_st_spec s2[] = {{"norm", MF_DTYPE_F32, 0, {0}}};
    const char *kv1[] = {"format", "pt"};
    int rc = write_file(tpath("sharded/model-00001-of-00003.safetensors"), s0, 2, NULL, 0);
    rc |= write_file(tpath("sharded/model-00002-of-00003.safetensors"), s1, 2, kv1, 1);
    rc |= write_file(tpath("sharded/model-00003-of-00003.safetensors"), s2, 1, NULL, 0);
    CHECK(rc == 0, "write shards: %s", mf_last_error());
    const char *names[] = {"layer.0.w", "layer.0.scale", "layer.1.w", "embed", "norm"};
    const char *files[] = {"model-00001-of-00003.safetensors", "model-00001-of-00003.safetensors",
                           "model-00002-of-00003.safetensors", "model-00002-of-00003.safetensors",
                           "model-00003-of-00003.safetensors"};
    rc = mf_st_index_write(tpath("sharded"), names, files, 5, 128 + 16 + 32 + 20 + 4);
    CHECK(rc == 0, "index: %s", mf_last_error());
    const char *opens[] = {tpath("sharded"), tpath("sharded/model.safetensors.index.json")};
    for (int o = 0; o < 2; o++) {
        mf_st *st = NULL;
        rc = mf_st_open(opens[o], &st);
        CHECK(rc == 0, "open %s: %s", opens[o], mf_last_error());
        if (rc) continue;
        CHECK(mf_st_n_tensors(st) == 5 && mf_st_n_shards(st) == 3, "counts");
        check_contents(st, s0, 2);
        check_contents(st, s1, 2);
        check_contents(st, s2, 1);
        const mf_st_tensor *t = mf_st_find(st, "embed");
        CHECK(t && strstr(mf_st_shard_path(st, t->shard), "model-00002-of-00003"), "shard of embed");
        CHECK(mf_st_metadata(st, "format") && !strcmp(mf_st_metadata(st, "format"), "pt"), "meta");
        mf_st_close(st);
    }
    /* the index is sorted, pretty JSON */
    FILE *f = fopen(tpath("sharded/model.safetensors.index.json"), "r");
    char text[2048] = {0};
    if (f) {
        size_t got = fread(text, 1, sizeof text - 1, f);
        text[got] = '\0';
        fclose(f);
    }
    char *e = strstr(text, "\"embed\""), *l0 = strstr(text, "\"layer.0.scale\""),
         *n = strstr(text, "\"norm\""), *m = strstr(text, "\"metadata\""),
         *ts = strstr(text, "\"total_size\": 200");
    CHECK(e && l0 && n && m && ts && m < e && e < l0 && l0 < n && strchr(text, '\n'),
          "index layout: %s", text);
}

static void test_sparse(void)
{
    const uint64_t big = 1ull << 30;
    mf_st_spec s[] = {{"small", MF_DTYPE_U8, 1, {100}}, {"big", MF_DTYPE_U8, 1, {(int64_t)big}}};
    const char *path = tpath("sparse.safetensors");
    mf_st_writer *w = NULL;
    int rc = mf_st_writer_create(path, s, 2, NULL, 0, &w);
    CHECK(rc == 0, "create: %s", mf_last_error());
    if (rc) return;
    CHECK(mf_st_writer_tensor_bytes(w, 1) == big, "big bytes");
    unsigned char tail[4] = {1, 2, 3, 4};
    rc = mf_st_writer_pwrite(w, 1, big - 4, tail, 4);
    CHECK(rc == 0, "pwrite tail: %s", mf_last_error());
    rc = mf_st_writer_pwrite(w, 1, big - 3, tail, 4);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), "\"big\"") && strstr(mf_last_error(), path),
          "pwrite past end: %s", mf_last_error());
    rc = mf_st_writer_pwrite(w, 2, 0, tail, 1);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), path), "pwrite bad index: %s", mf_last_error());
    uint64_t fb = mf_st_writer_file_bytes(w);
    rc = mf_st_writer_finish(w);
    CHECK(rc == 0, "finish: %s", mf_last_error());
    struct stat sb;
    CHECK(stat(path, &sb) == 0 && (uint64_t)sb.st_size == fb, "size %lld vs %llu",
          (long long)sb.st_size, (unsigned long long)fb);
    CHECK((uint64_t)sb.st_blocks * 512 < (1u << 20), "not sparse: %lld blocks of 512",
          (long long)sb.st_blocks);
    mf_st *st = NULL;
    rc = mf_st_open(path, &st);
    CHECK(rc == 0, "open: %s", mf_last_error());
    if (rc) return;
    const mf_st_tensor *t = mf_st_find(st, "big");
    unsigned char buf[8];
    CHECK(mf_st_read(st, t, big - 8, buf, 8) == 0, "read: %s", mf_last_error());
    CHECK(!memcmp(buf, "\0\0\0\0\1\2\3\4", 8), "hole then data");
    mf_st_close(st);
    unlink(path);
}

static void test_writer_errors(void)
{
    const char *path = tpath("bad_writer.safetensors");
    mf_st_writer *w = (mf_st_writer *)0x1;
    mf_st_spec dup[] = {{"x", MF_DTYPE_U8, 1, {1}}, {"y", MF_DTYPE_U8, 1, {1}},
                        {"x", MF_DTYPE_U8, 1, {2}}};
    int rc = mf_st_writer_create(path, dup, 3, NULL, 0, &w);
    CHECK(rc == -EINVAL && w == NULL && strstr(mf_last_error(), "\"x\"") &&
          strstr(mf_last_error(), path), "dup: %s", mf_last_error());
    mf_st_spec meta[] = {{"__metadata__", MF_DTYPE_U8, 1, {1}}};
    rc = mf_st_writer_create(path, meta, 1, NULL, 0, &w);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), "__metadata__"), "reserved: %s", mf_last_error());
    mf_st_spec neg[] = {{"neg", MF_DTYPE_U8, 2, {1, -1}}};
    rc = mf_st_writer_create(path, neg, 1, NULL, 0, &w);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), "neg"), "neg: %s", mf_last_error());
    mf_st_spec dims[] = {{"dims", MF_DTYPE_U8, MF_ST_MAX_DIMS + 1, {1}}};
    rc = mf_st_writer_create(path, dims, 1, NULL, 0, &w);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), "dims"), "dims: %s", mf_last_error());
    mf_st_spec dt[] = {{"dt", (mf_dtype)MF_DTYPE_COUNT, 1, {1}}};
    rc = mf_st_writer_create(path, dt, 1, NULL, 0, &w);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), "dt"), "dtype: %s", mf_last_error());
    mf_st_spec ovf[] = {{"ovf", MF_DTYPE_F32, 2, {1ll << 40, 1ll << 40}}};
    rc = mf_st_writer_create(path, ovf, 1, NULL, 0, &w);
    CHECK(rc == -EOVERFLOW && strstr(mf_last_error(), "ovf"), "overflow: %s", mf_last_error());
    mf_st_spec f4[] = {{"f4odd", MF_DTYPE_F4, 1, {3}}};
    rc = mf_st_writer_create(path, f4, 1, NULL, 0, &w);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), "f4odd") && strstr(mf_last_error(), "mid-byte"),
          "f4: %s", mf_last_error());
    const char *kv[] = {"k", "v", "k", "w"};
    mf_st_spec ok[] = {{"ok", MF_DTYPE_U8, 1, {1}}};
    rc = mf_st_writer_create(path, ok, 1, kv, 2, &w);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), "\"k\""), "meta dup: %s", mf_last_error());
    rc = mf_st_writer_create(tpath("no/such/dir/x.safetensors"), ok, 1, NULL, 0, &w);
    CHECK(rc == -ENOENT && strstr(mf_last_error(), "no/such/dir"), "no dir: %s", mf_last_error());
    CHECK(access(path, F_OK) != 0, "a failed create left %s", path);

    /* abort leaves neither the final nor the temporary file */
    rc = mf_st_writer_create(path, ok, 1, NULL, 0, &w);
    CHECK(rc == 0, "create: %s", mf_last_error());
    if (rc == 0) mf_st_writer_abort(w);
    char tmp[800];
    snprintf(tmp, sizeof tmp, "%s.tmp-%ld", path, (long)getpid());
    CHECK(access(path, F_OK) != 0 && access(tmp, F_OK) != 0, "abort left files");

    const char *names[] = {"a", "a"}, *files[] = {"s1.safetensors", "s2.safetensors"};
    rc = mf_st_index_write(g_dir, names, files, 2, 0);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), "\"a\""), "index dup: %s", mf_last_error());
    const char *slash[] = {"../evil.safetensors"};
    rc = mf_st_index_write(g_dir, names, slash, 1, 0);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), "evil"), "index slash: %s", mf_last_error());
}

/* One malformed single file per case: the open fails with -EINVAL naming the file (and tensor). */
static void test_malformed_single(void)
{
    const char *p;
    p = tpath("short.safetensors");
    write_bytes(p, "\x10\0\0\0\0", 5);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "5 bytes", "shorter than");
    p = tpath("zero.safetensors");
    write_bytes(p, "", 0);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "0 bytes");

    p = tpath("hdrlen_past_eof.safetensors");
    write_raw_len(p, 1000, "{}", 0);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "header length 1000", "past the end");
    p = tpath("hdr_too_big.safetensors");
    write_raw_len(p, 200u * 1000u * 1000u, "{}", 0);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "200000000", "limit");
    p = tpath("hdr_huge_len.safetensors");
    write_raw_len(p, UINT64_MAX, "{}", 0);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "limit");

    p = tpath("bad_json.safetensors");
    write_raw(p, "{\"a\":{\"dtype\":\"U8\",\n \"shape\":[1],,}}", 0);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "not valid JSON", "line 2");
    p = tpath("empty_hdr.safetensors");
    write_raw(p, "", 0);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "not valid JSON");
    p = tpath("array_hdr.safetensors");
    write_raw(p, "[1,2]", 0);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "expected a JSON object", "array");
    p = tpath("nul_in_hdr.safetensors");
    write_raw_len(p, 3, "{}", 1);   /* the header's last byte is the 0xAB data byte */
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "not valid JSON");

    p = tpath("entry_not_object.safetensors");
    write_raw(p, "{\"weird\":5}", 0);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"weird\"", "expected an object", "integer");
    p = tpath("unknown_dtype.safetensors");
    write_raw(p, "{" ENTRY("t.unk", "F7", "[2]", 0, 2) "}", 2);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"t.unk\"", "unknown dtype \"F7\"");
    p = tpath("dtype_not_string.safetensors");
    write_raw(p, "{\"t.dt\":{\"dtype\":3,\"shape\":[1],\"data_offsets\":[0,1]}}", 1);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"t.dt\"", "dtype: expected a string");
    p = tpath("no_dtype.safetensors");
    write_raw(p, "{\"t.nd\":{\"shape\":[1],\"data_offsets\":[0,1]}}", 1);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"t.nd\"", "missing field \"dtype\"");
    p = tpath("no_shape.safetensors");
    write_raw(p, "{\"t.ns\":{\"dtype\":\"U8\",\"data_offsets\":[0,1]}}", 1);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"t.ns\"", "missing field \"shape\"");
    p = tpath("no_offsets.safetensors");
    write_raw(p, "{\"t.no\":{\"dtype\":\"U8\",\"shape\":[1]}}", 1);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"t.no\"", "missing field \"data_offsets\"");
    p = tpath("shape_string.safetensors");
    write_raw(p, "{" ENTRY("t.ss", "U8", "\"1\"", 0, 1) "}", 1);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"t.ss\"", "shape: expected an array", "string");
    p = tpath("shape_real.safetensors");
    write_raw(p, "{" ENTRY("t.sr", "U8", "[1.0]", 0, 1) "}", 1);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"t.sr\"", "shape[0]", "real");
    p = tpath("offsets_one.safetensors");
    write_raw(p, "{\"t.o1\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0]}}", 1);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"t.o1\"", "data_offsets: expected [begin, end]");
    p = tpath("offsets_negative.safetensors");
    write_raw(p, "{" ENTRY("t.on", "U8", "[1]", -1, 0) "}", 1);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"t.on\"", "data_offsets");
    p = tpath("offsets_reversed.safetensors");
    write_raw(p, "{" ENTRY("t.or", "U8", "[0]", 1, 0) "}", 1);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"t.or\"", "end before begin");
    p = tpath("offsets_too_big.safetensors");
    write_raw(p, "{" ENTRY("t.ob", "U8", "[1]", 0, 99999999999999999999) "}", 1);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "not valid JSON", "too big");

    p = tpath("negative_dim.safetensors");
    write_raw(p, "{" ENTRY("t.neg", "U8", "[2,-1]", 0, 2) "}", 2);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"t.neg\"", "shape[1] is negative");
    p = tpath("too_many_dims.safetensors");
    write_raw(p, "{" ENTRY("t.9d", "U8", "[1,1,1,1,1,1,1,1,1]", 0, 1) "}", 1);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"t.9d\"", "9 dims", "at most 8");
    p = tpath("shape_overflow.safetensors");
    write_raw(p, "{" ENTRY("t.ovf", "F32", "[4294967296,4294967296]", 0, 0) "}", 0);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"t.ovf\"", "overflows 64 bits");
    p = tpath("f4_misaligned.safetensors");
    write_raw(p, "{" ENTRY("t.f4", "F4", "[3]", 0, 2) "}", 2);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"t.f4\"", "mid-byte");
    p = tpath("size_mismatch.safetensors");
    write_raw(p, "{" ENTRY("t.sz", "F32", "[2,3]", 0, 20) "}", 20);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"t.sz\"", "[2, 3]", "needs 24 bytes", "hold 20");

    p = tpath("offsets_out_of_bounds.safetensors");
    write_raw(p, "{" ENTRY("t.a", "U8", "[4]", 0, 4) "," ENTRY("t.oob", "U8", "[4]", 4, 8) "}", 6);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"t.oob\"", "end 8 is past the data section (6 bytes");
    p = tpath("overlap.safetensors");
    write_raw(p, "{" ENTRY("t.b", "U8", "[4]", 2, 6) "," ENTRY("t.a", "U8", "[4]", 0, 4) "}", 6);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"t.b\"", "overlaps tensor \"t.a\"");
    p = tpath("gap.safetensors");
    write_raw(p, "{" ENTRY("t.a", "U8", "[4]", 0, 4) "," ENTRY("t.gap", "U8", "[2]", 6, 8) "}", 8);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "[4, 6)", "gap before tensor \"t.gap\"");
    p = tpath("leading_gap.safetensors");
    write_raw(p, "{" ENTRY("t.lg", "U8", "[2]", 2, 4) "}", 4);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "[0, 2)", "\"t.lg\"");
    p = tpath("trailing.safetensors");
    write_raw(p, "{" ENTRY("t.a", "U8", "[4]", 0, 4) "}", 7);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "7 bytes", "cover only 4");
    p = tpath("duplicate.safetensors");
    write_raw(p, "{" ENTRY("t.dup", "U8", "[2]", 0, 2) "," ENTRY("t.dup", "U8", "[2]", 2, 4) "}", 4);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "names a key twice", "t.dup");
    p = tpath("meta_not_string.safetensors");
    write_raw(p, "{\"__metadata__\":{\"k\":1}," ENTRY("t.a", "U8", "[1]", 0, 1) "}", 1);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "__metadata__ \"k\"", "expected a string");
    p = tpath("meta_not_object.safetensors");
    write_raw(p, "{\"__metadata__\":[]," ENTRY("t.a", "U8", "[1]", 0, 1) "}", 1);
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "__metadata__", "list");

    /* accepted variants, as the Python package accepts them */
    mf_st *st = NULL;
    p = tpath("ok_variants.safetensors");
    write_raw(p, "  {\"__metadata__\":null," ENTRY("z", "U8", "[0]", 0, 0) ","
                 "\"b\":{\"extra\":[1],\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
                 ENTRY("a", "U8", "[0]", 2, 2) "}   ", 2);
    int rc = mf_st_open(p, &st);
    CHECK(rc == 0, "variants: %s", mf_last_error());
    if (rc == 0) {
        CHECK(mf_st_n_tensors(st) == 3 && mf_st_find(st, "b")->n_bytes == 2, "variants content");
        mf_st_close(st);
    }
    p = tpath("ok_empty.safetensors");
    write_raw(p, "{}", 0);
    rc = mf_st_open(p, &st);
    CHECK(rc == 0 && mf_st_n_tensors(st) == 0, "empty file: %s", mf_last_error());
    if (rc == 0) mf_st_close(st);
}

static void test_truncated_data(void)
{
    mf_st_spec s[] = {{"a", MF_DTYPE_F32, 1, {16}}, {"b.last", MF_DTYPE_F32, 1, {16}}};
    const char *p = tpath("truncated.safetensors");
    int rc = write_file(p, s, 2, NULL, 0);
    CHECK(rc == 0, "write: %s", mf_last_error());
    struct stat sb;
    stat(p, &sb);
    mf_st *st = NULL;
    rc = mf_st_open(p, &st);
    CHECK(rc == 0, "open: %s", mf_last_error());
    /* cut after open: reads of the lost bytes are short reads naming file and tensor */
    CHECK(truncate(p, sb.st_size - 10) == 0, "truncate");
    if (rc == 0) {
        unsigned char buf[64];
        const mf_st_tensor *t = mf_st_find(st, "b.last");
        rc = mf_st_read(st, t, 0, buf, 64);
        CHECK(rc == -EIO && strstr(mf_last_error(), "short read") &&
              strstr(mf_last_error(), "b.last") && strstr(mf_last_error(), p),
              "short read: %d %s", rc, mf_last_error());
        rc = mf_st_read(st, t, 0, buf, 54);
        CHECK(rc == 0, "read of the bytes still there: %s", mf_last_error());
        mf_st_close(st);
    }
    /* and a fresh open refuses the cut file */
    EXPECT_OPEN_FAIL(p, -EINVAL, p, "\"b.last\"", "past the data section", "truncated");
}

static void test_parse_entry_points(void)
{
    const char *hdr = "{" ENTRY("x", "I32", "[2]", 0, 8) "}";
    mf_st_tensor *t = NULL;
    int n = -1;
    int rc = mf_st_parse_header("mem", hdr, strlen(hdr), 8, &t, &n);
    CHECK(rc == 0 && n == 1 && t && t[0].n_bytes == 8 && t[0].file_offset == 8 + strlen(hdr),
          "parse_header: %s", mf_last_error());
    mf_st_tensors_free(t, n);
    rc = mf_st_parse_header("memsrc", hdr, strlen(hdr), 4, &t, &n);
    CHECK(rc == -EINVAL && t == NULL && n == 0 && strstr(mf_last_error(), "memsrc"),
          "parse_header small data: %s", mf_last_error());
    unsigned char img[64] = {0};
    size_t hl = strlen(hdr);
    img[0] = (unsigned char)hl;
    memcpy(img + 8, hdr, hl);
    rc = mf_st_parse_image("img", img, 8 + hl + 8, &t, &n);
    CHECK(rc == 0 && n == 1, "parse_image: %s", mf_last_error());
    mf_st_tensors_free(t, n);
    rc = mf_st_parse_image("img7", img, 7, &t, &n);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), "img7"), "parse_image short");
}

/* Writes a shard named `file` in the "idx" directory holding tensors (U8, 2 bytes each). */
static void make_shard(const char *dir, const char *file, const char *const *names, int n)
{
    mf_st_spec s[8];
    for (int i = 0; i < n; i++) s[i] = (mf_st_spec){names[i], MF_DTYPE_U8, 1, {2}};
    char p[800];
    snprintf(p, sizeof p, "%s/%s", dir, file);
    int rc = write_file(p, s, n, NULL, 0);
    CHECK(rc == 0, "make_shard: %s", mf_last_error());
}

static void write_index_text(const char *dir, const char *text)
{
    char p[800];
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    write_bytes(p, text, strlen(text));
}

static void test_malformed_index(void)
{
    char dir[600];
    snprintf(dir, sizeof dir, "%s/idx", g_dir);
    mkdir(dir, 0755);
    const char *a[] = {"t.a", "t.b"}, *b[] = {"t.c"}, *dupb[] = {"t.c", "t.a"};
    make_shard(dir, "s1.safetensors", a, 2);
    make_shard(dir, "s2.safetensors", b, 1);
    make_shard(dir, "s3.safetensors", dupb, 2);
    char idx[700];
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", dir);

    write_index_text(dir, "{\"metadata\":{\"total_size\":6},\"weight_map\":{\"t.a\":\"s1.safetensors\","
                          "\"t.b\":\"s1.safetensors\",\"t.c\":\"s2.safetensors\"}}");
    mf_st *st = NULL;
    int rc = mf_st_open(dir, &st);
    CHECK(rc == 0, "good index: %s", mf_last_error());
    if (rc == 0) {
        CHECK(mf_st_n_tensors(st) == 3 && mf_st_n_shards(st) == 2, "good index counts");
        mf_st_close(st);
    }
    write_index_text(dir, "{\"weight_map\":{\"t.a\":\"s1.safetensors\",\"t.b\":\"s1.safetensors\","
                          "\"t.c\":\"s9.safetensors\"}}");
    EXPECT_OPEN_FAIL(dir, -ENOENT, idx, "s9.safetensors", "missing");
    write_index_text(dir, "{\"weight_map\":{\"t.a\":\"s1.safetensors\",\"t.b\":\"s1.safetensors\","
                          "\"t.c\":\"s2.safetensors\",\"t.zz\":\"s2.safetensors\"}}");
    EXPECT_OPEN_FAIL(dir, -EINVAL, idx, "\"t.zz\"", "s2.safetensors", "lacks it");
    write_index_text(dir, "{\"weight_map\":{\"t.a\":\"s1.safetensors\",\"t.c\":\"s2.safetensors\"}}");
    EXPECT_OPEN_FAIL(dir, -EINVAL, "s1.safetensors", "\"t.b\"", "not in the index");
    /* t.a in s1 and in s3: whichever shard the index does not map it to is refused */
    write_index_text(dir, "{\"weight_map\":{\"t.a\":\"s1.safetensors\",\"t.b\":\"s1.safetensors\","
                          "\"t.c\":\"s3.safetensors\"}}");
    EXPECT_OPEN_FAIL(dir, -EINVAL, idx, "\"t.a\"", "s3.safetensors", "maps it to s1.safetensors");
    write_index_text(dir, "{\"weight_map\":{\"t.a\":\"s1.safetensors\",\"t.a\":\"s1.safetensors\"}}");
    EXPECT_OPEN_FAIL(dir, -EINVAL, idx, "duplicate", "t.a");
    write_index_text(dir, "{\"weight_map\":{\"t.a\":\"s1.safetensors\",}");
    EXPECT_OPEN_FAIL(dir, -EINVAL, idx, "not valid JSON", "line 1");
    write_index_text(dir, "{\"metadata\":{}}");
    EXPECT_OPEN_FAIL(dir, -EINVAL, idx, "weight_map");
    write_index_text(dir, "{\"weight_map\":{\"t.a\":\"../s1.safetensors\"}}");
    EXPECT_OPEN_FAIL(dir, -EINVAL, idx, "\"t.a\"", "../s1.safetensors");
    write_index_text(dir, "{\"weight_map\":{\"t.a\":7}}");
    EXPECT_OPEN_FAIL(dir, -EINVAL, idx, "\"t.a\"", "non-string");
    write_index_text(dir, "{\"metadata\":{\"total_size\":\"big\"},\"weight_map\":{\"t.a\":\"s1.safetensors\"}}");
    EXPECT_OPEN_FAIL(dir, -EINVAL, idx, "total_size");
    /* a malformed shard behind a good index names the shard */
    write_raw(tpath("idx/s4.safetensors"), "{" ENTRY("t.d", "U8", "[2]", 0, 3) "}", 3);
    write_index_text(dir, "{\"weight_map\":{\"t.d\":\"s4.safetensors\"}}");
    EXPECT_OPEN_FAIL(dir, -EINVAL, "s4.safetensors", "\"t.d\"", "needs 2 bytes");
}

int main(void)
{
    const char *base = getenv("MOEFLOW_TMP");
    snprintf(g_dir, sizeof g_dir, "%s/st-%ld", base && base[0] ? base : "/tmp", (long)getpid());
    if (mkdir(g_dir, 0755) != 0 && errno != EEXIST) {
        perror(g_dir);
        return 1;
    }
    test_roundtrip_single();
    test_roundtrip_sharded();
    test_sparse();
    test_writer_errors();
    test_malformed_single();
    test_truncated_data();
    test_parse_entry_points();
    test_malformed_index();
    char cmd[700];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (mf_check_failures == 0 && system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
    return mf_check_exit("test_safetensors");
}
