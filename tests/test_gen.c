/* graphs/gen and the gen/info commands: tiny is byte-for-byte deterministic per seed and differs
 * across seeds; every layout tensor is present with its dtype and shape and reads back as the
 * generator's values, all finite, with the intended magnitudes; a non-empty dir is refused; a
 * failing run leaves nothing behind; configurations the loader refuses are refused by gen too;
 * flash41 as sparse headers reproduces the released census, the draft's mtp.* tensors included. */
#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "graphs/model/census.h"
#include "graphs/model/config.h"
#include "graphs/gen/gen.h"
#include "graphs/ref/ref.h"
#include "graphs/model/layout.h"
#include "host/formats.h"
#include "host/safetensors.h"
#include "sched/error.h"
#include "tests/check.h"

static char tmp[2048];

static void rm_tree(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char p[4096];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

static uint8_t *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)len + 1);
    *n = fread(b, 1, (size_t)len, f);
    fclose(f);
    return b;
}

/* 1 when every file of a is in b with the same bytes (and the counts match). */
static int same_dirs(const char *a, const char *b, int *n_files)
{
    DIR *d = opendir(a);
    if (!d) return 0;
    struct dirent *e;
    int same = 1;
    *n_files = 0;
    char pa[4096], pb[4096];
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        (*n_files)++;
        snprintf(pa, sizeof pa, "%s/%s", a, e->d_name);
        snprintf(pb, sizeof pb, "%s/%s", b, e->d_name);
        size_t na, nb;
        uint8_t *xa = slurp(pa, &na), *xb = slurp(pb, &nb);
        if (!xa || !xb || na != nb || memcmp(xa, xb, na)) same = 0;
        free(xa);
        free(xb);
    }
    closedir(d);
    return same;
}

static int shards_differ(const char *a, const char *b, const char *name)
{
    char pa[8192], pb[8192];
    snprintf(pa, sizeof pa, "%s/%s", a, name);
    snprintf(pb, sizeof pb, "%s/%s", b, name);
    size_t na, nb;
    uint8_t *xa = slurp(pa, &na), *xb = slurp(pb, &nb);
    int differ = xa && xb && (na != nb || memcmp(xa, xb, na));
    free(xa);
    free(xb);
    return differ;
}

/* RMS of a dequantized linear (fp8 tiles or fp4 rows) read from the checkpoint. */
static double linear_rms(const mf_st *st, const char *prefix, int fp4)
{
    char wn[512], sn[512];
    snprintf(wn, sizeof wn, "%s.weight", prefix);
    snprintf(sn, sizeof sn, "%s.scale", prefix);
    const mf_st_tensor *w = mf_st_find(st, wn), *s = mf_st_find(st, sn);
    if (!w || !s) return -1;
    uint8_t *wb = malloc(w->n_bytes), *sb = malloc(s->n_bytes);
    mf_st_read(st, w, 0, wb, w->n_bytes);
    mf_st_read(st, s, 0, sb, s->n_bytes);
    double sum = 0;
    int64_t out = w->shape[0], in = fp4 ? w->shape[1] * 2 : w->shape[1], cnt = 0;
    for (int64_t i = 0; i < out; i++)
        for (int64_t j = 0; j < in; j++) {
            double v;
            if (fp4)
                v = mf_e2m1_to_f32(mf_e2m1_get(wb + i * (in / 2), (size_t)j)) *
                    mf_e8m0_to_f32(sb[i * (in / 32) + j / 32]);
            else
                v = mf_e4m3_to_f32(wb[i * in + j]) * mf_e8m0_to_f32(sb[(i / 32) * s->shape[1] + j / 32]);
            sum += v * v;
            cnt++;
        }
    free(wb);
    free(sb);
    return sqrt(sum / (double)cnt) * sqrt((double)in);   /* ~1 when std ~ 1/sqrt(in) */
}

static void check_tiny_contents(const char *dir, uint64_t seed)
{
    mf_st *st;
    int rc = mf_st_open(dir, &st);
    CHECK(rc == 0, "open %s: %s", dir, mf_last_error());
    if (rc) return;
    mf_config c;
    mf_config_preset("tiny", &c);
    mf_layout *l;
    mf_layout_build(&c, &l);
    CHECK(mf_st_n_tensors(st) == mf_layout_n(l), "tensors %d vs layout %d", mf_st_n_tensors(st),
          mf_layout_n(l));
    CHECK(mf_st_n_shards(st) == 2, "shards %d", mf_st_n_shards(st));
    int bad_shape = 0, bad_data = 0, nonfinite = 0, nan_codes = 0;
    for (int i = 0; i < mf_layout_n(l); i++) {
        const mf_layout_tensor *t = mf_layout_at(l, i);
        const mf_st_tensor *s = mf_st_find(st, t->name);
        if (!s || s->dtype != t->dtype || s->n_dims != t->n_dims || s->shape[0] != t->shape[0] ||
            (t->n_dims > 1 && s->shape[1] != t->shape[1]) || s->n_bytes != t->n_bytes) {
            if (bad_shape++ < 3) fprintf(stderr, "tensor %s missing or wrong\n", t->name);
            continue;
        }
        uint8_t *got = malloc(s->n_bytes), *want = malloc(s->n_bytes);
        mf_st_read(st, s, 0, got, s->n_bytes);
        mf_gen_fill(t, seed, 0, want, s->n_bytes);
        if (memcmp(got, want, s->n_bytes)) bad_data++;
        for (uint64_t k = 0; k < s->n_bytes; k++) {
            if (t->dtype == MF_DTYPE_F8_E8M0 && (got[k] == 0xFF || !isfinite(mf_e8m0_to_f32(got[k]))))
                nan_codes++;
            if (t->dtype == MF_DTYPE_F8_E4M3 && (got[k] & 0x7F) == 0x7F) nan_codes++;
        }
        if (t->dtype == MF_DTYPE_BF16)
            for (uint64_t k = 0; k < s->n_bytes / 2; k++) {
                uint16_t v;
                memcpy(&v, got + 2 * k, 2);
                if (!isfinite(mf_bf16_to_f32(v))) nonfinite++;
            }
        if (t->dtype == MF_DTYPE_F32)
            for (uint64_t k = 0; k < s->n_bytes / 4; k++) {
                float v;
                memcpy(&v, got + 4 * k, 4);
                if (!isfinite(v)) nonfinite++;
            }
        if (t->role == MF_ROLE_NORM) {
            uint16_t v;
            memcpy(&v, got, 2);
            CHECK(mf_bf16_to_f32(v) == 1.0f, "%s[0] = %g, want 1", t->name, mf_bf16_to_f32(v));
        }
        free(got);
        free(want);
    }
    CHECK(bad_shape == 0, "%d tensors missing or with wrong dtype/shape", bad_shape);
    CHECK(bad_data == 0, "%d tensors differ from mf_gen_fill", bad_data);
    CHECK(nan_codes == 0, "%d NaN fp8/e8m0 codes", nan_codes);
    CHECK(nonfinite == 0, "%d non-finite BF16/F32 values", nonfinite);
    /* magnitudes: rows dot unit-RMS inputs to ~unit scale (power-of-two scales: within 2x) */
    double r8 = linear_rms(st, "layers.2.attn.wq_a", 0), r4 = linear_rms(st, "layers.0.ffn.experts.3.w2", 1);
    CHECK(r8 > 0.5 && r8 < 2.0, "fp8 wq_a rms * sqrt(in) = %g, want ~1", r8);
    CHECK(r4 > 0.5 && r4 < 2.0, "fp4 expert w2 rms * sqrt(in) = %g, want ~1", r4);
    mf_layout_free(l);
    mf_st_close(st);
}

static void check_tiny(void)
{
    char a[4096], b[4096], c[4096];
    snprintf(a, sizeof a, "%s/gen_tiny_a", tmp);
    snprintf(b, sizeof b, "%s/gen_tiny_b", tmp);
    snprintf(c, sizeof c, "%s/gen_tiny_c", tmp);
    rm_tree(a);
    rm_tree(b);
    rm_tree(c);
    mf_config cfg;
    mf_gen_opts o;
    CHECK(mf_config_preset("tiny", &cfg) == 0 && mf_gen_preset_opts("tiny", &o) == 0, "preset");
    o.seed = 7;
    o.quiet = 1;
    CHECK(mf_gen_write(&cfg, a, &o) == 0, "gen a: %s", mf_last_error());
    CHECK(mf_gen_write(&cfg, b, &o) == 0, "gen b: %s", mf_last_error());
    o.seed = 8;
    CHECK(mf_gen_write(&cfg, c, &o) == 0, "gen c: %s", mf_last_error());
    int n_files = 0;
    CHECK(same_dirs(a, b, &n_files) && n_files == 6, "same seed: dirs differ (%d files)", n_files);   /* with tokenizer_config.json */
    CHECK(shards_differ(a, c, "model-00001-of-00002.safetensors") &&
              shards_differ(a, c, "model-00002-of-00002.safetensors"),
          "different seeds gave identical shards");
    check_tiny_contents(a, 7);

    /* a non-empty dir is refused without force; with force it is rewritten identically */
    o.seed = 7;
    CHECK(mf_gen_write(&cfg, a, &o) == -EEXIST && strstr(mf_last_error(), "--force"),
          "non-empty dir: %s", mf_last_error());
    o.force = 1;
    CHECK(mf_gen_write(&cfg, a, &o) == 0, "force: %s", mf_last_error());
    CHECK(same_dirs(a, b, &n_files), "forced rewrite differs");
    o.force = 0;

    /* the CLI writes the same bytes as the library */
    const char *bin = getenv("MOEFLOW_BIN");
    if (bin) {
        char cmd[8192];
        rm_tree(c);
        snprintf(cmd, sizeof cmd, "'%s' gen --preset tiny --out '%s' --seed 7 --quiet", bin, c);
        CHECK(system(cmd) == 0, "%s failed", cmd);
        CHECK(same_dirs(a, c, &n_files) && n_files == 6, "CLI output differs from the library's");
    }

    /* a run that fails midway (file size limit) leaves nothing, and removes the dir it made:
     * find a shard count where a later shard is larger than the first, and cap files at the
     * first's size */
    struct stat sb;
    off_t first = 0, larger = 0;
    for (int ns = 3; ns <= 12 && !larger; ns++) {
        rm_tree(b);
        o.n_shards = ns;
        CHECK(mf_gen_write(&cfg, b, &o) == 0, "%d shards: %s", ns, mf_last_error());
        for (int s = 1; s <= ns; s++) {
            char sp[8192];
            snprintf(sp, sizeof sp, "%s/model-%05d-of-%05d.safetensors", b, s, ns);
            if (stat(sp, &sb) != 0) continue;
            if (s == 1) first = sb.st_size;
            else if (sb.st_size > first) larger = sb.st_size;
        }
    }
    CHECK(larger > 0, "no shard count gives a later shard larger than the first");
    rm_tree(b);
    struct rlimit old, lim;
    getrlimit(RLIMIT_FSIZE, &old);
    lim = old;
    lim.rlim_cur = (rlim_t)first;
    signal(SIGXFSZ, SIG_IGN);
    setrlimit(RLIMIT_FSIZE, &lim);
    int rc = mf_gen_write(&cfg, b, &o);
    setrlimit(RLIMIT_FSIZE, &old);
    CHECK(rc < 0, "gen under a %lld-byte file limit succeeded", (long long)first);
    CHECK(strstr(mf_last_error(), "model-0000") != NULL, "failure message: %s", mf_last_error());
    CHECK(stat(b, &sb) != 0 && errno == ENOENT, "failed run left %s behind", b);
    /* into an existing empty dir: the dir stays, empty */
    mkdir(b, 0755);
    setrlimit(RLIMIT_FSIZE, &lim);
    rc = mf_gen_write(&cfg, b, &o);
    setrlimit(RLIMIT_FSIZE, &old);
    DIR *d = opendir(b);
    int left = 0;
    struct dirent *e;
    while (d && (e = readdir(d)))
        if (e->d_name[0] != '.') left++;
    if (d) closedir(d);
    CHECK(rc < 0 && left == 0, "failed run into an existing dir left %d files", left);
    rm_tree(a);
    rm_tree(b);
    rm_tree(c);
}

static void gib2(char *buf, uint64_t bytes) { snprintf(buf, 32, "%.2f", bytes / 1073741824.0); }

/* One validation (mf_config_validate) for gen, the loader and info: configurations the loader
 * once refused and gen still wrote are refused by gen, naming the field, with nothing written. */
static void check_refusals(void)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/gen_refused", tmp);
    rm_tree(dir);
    mf_gen_opts o;
    mf_gen_preset_opts("tiny", &o);
    o.quiet = 1;
    for (int k = 0; k < 4; k++) {
        mf_config c;
        mf_config_preset("tiny", &c);
        const char *field = NULL;
        if (k == 0) {   /* index keys of 16 dims: the fp4 blocks are 32 */
            c.index_head_dim = 16;
            c.qk_rope_head_dim = 16;
            field = "index_head_dim";
        } else if (k == 1) {   /* ratio-1 layer 4 stays a KV source; layer 3 (ratio 2) moves past it */
            c.compress_ratios[5] = 2;
            field = "compress_ratios";
        } else if (k == 2) {   /* the candidate layer no KV source (6 is an index source on 4) */
            c.candidate_source_layer_id = 6;
            field = "candidate_source_layer_id";
        } else {   /* index layer 6 made a KV source after candidate layer 4 */
            c.kv_source_layer_ids[c.n_kv_source++] = 6;
            field = "index_source_layer_ids";
        }
        mf_error_clear();
        int rc = mf_gen_write(&c, dir, &o);
        struct stat sb;
        CHECK(rc == -EINVAL && strstr(mf_last_error(), field), "case %d: gen rc %d: %s", k, rc, mf_last_error());
        CHECK(stat(dir, &sb) != 0, "case %d: a refused config left %s", k, dir);
        rm_tree(dir);
    }
}

static void check_flash41(void)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/gen_flash41", tmp);
    rm_tree(dir);
    mf_config c;
    mf_gen_opts o;
    CHECK(mf_config_preset("flash41", &c) == 0 && mf_gen_preset_opts("flash41", &o) == 0, "preset");
    o.quiet = 1;
    CHECK(o.sparse == 1 && o.n_shards == 48, "flash41 defaults");
    int rc = mf_gen_write(&c, dir, &o);
    CHECK(rc == 0, "gen flash41: %s", mf_last_error());
    if (rc) return;

    /* sparse: the files claim ~467 GiB but occupy next to nothing */
    DIR *d = opendir(dir);
    struct dirent *e;
    uint64_t apparent = 0, allocated = 0;
    char p[8192];
    while (d && (e = readdir(d))) {
        struct stat sb;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        if (e->d_name[0] != '.' && stat(p, &sb) == 0) {
            apparent += (uint64_t)sb.st_size;
            allocated += (uint64_t)sb.st_blocks * 512;
        }
    }
    if (d) closedir(d);
    CHECK(apparent > 400ull << 30, "apparent size %llu", (unsigned long long)apparent);
    CHECK(allocated < 256ull << 20, "sparse files occupy %llu bytes", (unsigned long long)allocated);

    mf_st *st;
    rc = mf_st_open(dir, &st);
    CHECK(rc == 0, "open flash41: %s", mf_last_error());
    if (rc) return;
    mf_census cs;
    mf_census_of(st, &cs);
    uint64_t tables = 0;
    for (int i = 0; i < mf_st_n_tensors(st); i++) {
        const mf_st_tensor *t = mf_st_tensor_at(st, i);
        if (strstr(t->name, ".engram.embed.")) tables += t->n_bytes;
    }
    char g[32];
    CHECK(cs.bytes[MF_GROUP_EXPERTS] == 288777830400ull, "experts %llu",
          (unsigned long long)cs.bytes[MF_GROUP_EXPERTS]);
    CHECK(tables == 202758032400ull, "engram tables %llu", (unsigned long long)tables);
    gib2(g, cs.bytes[MF_GROUP_ENGRAM]);
    CHECK(!strcmp(g, "189.13"), "engram group %s GiB", g);
    gib2(g, cs.bytes[MF_GROUP_ATTN]);
    CHECK(!strcmp(g, "4.80"), "attn %s GiB", g);
    gib2(g, cs.bytes[MF_GROUP_SHARED_EXPERTS]);
    CHECK(!strcmp(g, "1.32"), "shared experts %s GiB", g);
    CHECK(cs.bytes[MF_GROUP_EMBED_HEAD] == 2647654400ull, "embed+head %llu",
          (unsigned long long)cs.bytes[MF_GROUP_EMBED_HEAD]);
    /* the draft: the seed's census of the released mtp.* tensors (7.39 GiB, 2,401 tensors) */
    CHECK(cs.bytes[MF_GROUP_MTP] == 7932874632ull && cs.tensors[MF_GROUP_MTP] == 2401, "mtp %llu bytes, %lld tensors",
          (unsigned long long)cs.bytes[MF_GROUP_MTP], (long long)cs.tensors[MF_GROUP_MTP]);
    gib2(g, cs.bytes[MF_GROUP_MTP]);
    CHECK(!strcmp(g, "7.39"), "mtp %s GiB", g);
    CHECK(mf_config_draft_bytes(&c) == 7932874632ull, "draft bytes %llu", (unsigned long long)mf_config_draft_bytes(&c));
    CHECK(cs.total_bytes - cs.bytes[MF_GROUP_EXPERTS] - cs.bytes[MF_GROUP_MTP] - tables == 9846748608ull,
          "resident text weights %llu",
          (unsigned long long)(cs.total_bytes - cs.bytes[MF_GROUP_EXPERTS] - cs.bytes[MF_GROUP_MTP] - tables));
    /* 96,085 released tensors = these (text + 2,401 mtp) + 259 vision + 4 aligner + 3 image tokens */
    CHECK(cs.n_tensors == 96085 - 259 - 4 - 3, "tensors %lld", (long long)cs.n_tensors);
    CHECK(cs.n_shards == 48, "shards %d", cs.n_shards);
    mf_st_close(st);

    /* the CLI's --json census agrees */
    const char *bin = getenv("MOEFLOW_BIN");
    if (bin) {
        char cmd[8192];
        snprintf(cmd, sizeof cmd, "'%s' info '%s' --json", bin, dir);
        FILE *f = popen(cmd, "r");
        char *out = calloc(1, 1 << 16);
        size_t n = f ? fread(out, 1, (1 << 16) - 1, f) : 0;
        int status = f ? pclose(f) : -1;
        CHECK(status == 0 && n > 0, "%s: status %d", cmd, status);
        json_error_t jerr;
        json_t *j = json_loads(out, 0, &jerr);
        CHECK(j != NULL, "info --json output is not JSON: %s", jerr.text);
        if (j) {
            json_t *gr = json_object_get(j, "groups");
            CHECK(json_integer_value(json_object_get(j, "total_bytes")) == (json_int_t)cs.total_bytes,
                  "total_bytes");
            CHECK(json_integer_value(json_object_get(j, "n_tensors")) == cs.n_tensors, "n_tensors");
            CHECK(json_integer_value(json_object_get(j, "n_shards")) == 48, "n_shards");
            for (int k = 0; k < MF_GROUP_COUNT; k++)
                CHECK(json_integer_value(json_object_get(gr, mf_group_name(k))) ==
                          (json_int_t)cs.bytes[k],
                      "group %s", mf_group_name(k));
            /* the sequence state by need: graphs/ref's sizes; per token the packed caches' 890
             * bytes (the public figure for flash41) + 4 of token history + the page tables */
            json_t *ss = json_object_get(j, "sequence_state");
            mf_config fc;
            CHECK(mf_config_preset("flash41", &fc) == 0, "preset");
            double bpt = json_real_value(json_object_get(ss, "bytes_per_token"));
            CHECK(json_integer_value(json_object_get(ss, "bytes_8k")) == mf_ref_state_bytes(&fc, 8192) &&
                      json_integer_value(json_object_get(ss, "fixed_bytes")) == mf_ref_state_bytes(&fc, 0) &&
                      bpt > 890 && bpt < 900,
                  "sequence_state: bytes_8k %lld, bytes_per_token %g", (long long)json_integer_value(json_object_get(ss, "bytes_8k")), bpt);
            json_decref(j);
        }
        free(out);
        /* the text table and the layout check */
        snprintf(cmd, sizeof cmd, "'%s' info '%s'", bin, dir);
        f = popen(cmd, "r");
        out = calloc(1, 1 << 16);
        n = f ? fread(out, 1, (1 << 16) - 1, f) : 0;
        status = f ? pclose(f) : -1;
        CHECK(status == 0 && strstr(out, "268.95") && strstr(out, "189.13") &&
                  strstr(out, "7.39") && strstr(out, "draft: 3 stages (DSpark") &&
                  strstr(out, "0 missing, 0 mismatched, 0 not in layout"),
              "info text: %s", out);
        free(out);
        /* errors: a missing dir, and a checkpoint whose index names a missing shard */
        snprintf(cmd, sizeof cmd, "'%s' info '%s/nope' 2>&1", bin, tmp);
        f = popen(cmd, "r");
        out = calloc(1, 1 << 16);
        n = f ? fread(out, 1, (1 << 16) - 1, f) : 0;
        status = f ? pclose(f) : -1;
        CHECK(status != 0 && strstr(out, "nope"), "info on a missing dir: %d %s", status, out);
        free(out);
        snprintf(p, sizeof p, "%s/model-00017-of-00048.safetensors", dir);
        unlink(p);
        snprintf(cmd, sizeof cmd, "'%s' info '%s' 2>&1", bin, dir);
        f = popen(cmd, "r");
        out = calloc(1, 1 << 16);
        n = f ? fread(out, 1, (1 << 16) - 1, f) : 0;
        status = f ? pclose(f) : -1;
        CHECK(status != 0 && strstr(out, "model-00017-of-00048"), "info with a missing shard: %d %s",
              status, out);
        free(out);
    }
    rm_tree(dir);
}

int main(void)
{
    const char *t = getenv("MOEFLOW_TMP");
    snprintf(tmp, sizeof tmp, "%s", t ? t : "/tmp");
    mkdir(tmp, 0755);
    check_tiny();
    check_refusals();
    check_flash41();
    return mf_check_exit("test_gen");
}
