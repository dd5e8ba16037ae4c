/* Hardware profiles (sched/profile.h): a profile read, written and read back is the same with its
 * sources; unit suffixes; every malformed input (missing, duplicate and unknown keys, bad numbers,
 * out-of-range values) fails naming path:line and the key; the shipped profiles load. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sched/error.h"
#include "sched/profile.h"
#include "tests/check.h"

/* A valid profile, one key per line (line n of the text is entry n-1 + 2: a comment comes first). */
static const char *base_lines[] = {
    "name = test box",
    "n_sockets = 2",
    "threads_per_socket = 22",
    "mem_bytes_per_s = 60G   # source: a measurement, somewhere",
    "cross_socket_factor = 0.5",
    "task_overhead_ns = 2500",
    "worker_spin_ns = 40000",
    "worker_wake_ns = 30000",
    "host_fp4_bytes_per_s = 1.5Gi",
    "host_fp4_macs_per_s = 3e9",
    "host_fp4_latency_ns = 1000",
    "host_fp8_bytes_per_s = 2G",
    "host_fp8_macs_per_s = 4e9",
    "host_fp8_latency_ns = 800",
    "host_bf16_bytes_per_s = 3G",
    "host_bf16_macs_per_s = 5e9",
    "host_bf16_latency_ns = 700",
    "host_ref_macs_per_s = 1e9   # plain comment, not a source",
    "host_ref_latency_ns = 0",
    "host_vec_macs_per_s = 8e9",
    "host_vec_latency_ns = 0",
    "disk_bytes_per_s = 271Mi  # source: seed page, 'SMR disk at 271 MiB/s'",
    "disk_latency_ns = 8e6",
    "disk_queue_depth = 4",
    "n_cards = 4",
    "cards_emulated = 0",
    "card_mem_bytes = 22Gi",
    "h2d_bytes_per_s = 8.29Gi   # source: seed page: pinned H2D 8.29 GiB/s measured",
    "h2d_latency_ns = 10000",
    "d2h_bytes_per_s = 8Gi",
    "d2h_latency_ns = 10000",
    "h2d_total_bytes_per_s = 12Gi",
    "act_copy_latency_ns = 7000",
    "card_fp4_bytes_per_s = 300G",
    "card_fp4_macs_per_s = 1e12",
    "card_fp4_latency_ns = 5000",
    "card_fp8_bytes_per_s = 300G",
    "card_fp8_macs_per_s = 1e12",
    "card_fp8_latency_ns = 5000",
    "card_bf16_bytes_per_s = 400G",
    "card_bf16_macs_per_s = 2e12",
    "card_bf16_latency_ns = 5000",
    "card_ref_macs_per_s = 1e11",
    "card_ref_latency_ns = 5000",
};
#define N_BASE ((int)(sizeof base_lines / sizeof base_lines[0]))

/* The base text with line `skip` left out (-1: none), `replace_at` replaced by `repl` and
 * `extra` appended (either may be NULL). Caller frees. */
static char *make_text(int skip, int replace_at, const char *repl, const char *extra)
{
    size_t cap = 8192;
    char *t = malloc(cap);
    size_t n = (size_t)snprintf(t, cap, "# a test profile\n");
    for (int i = 0; i < N_BASE; i++) {
        if (i == skip) continue;
        n += (size_t)snprintf(t + n, cap - n, "%s\n", i == replace_at ? repl : base_lines[i]);
    }
    if (extra) n += (size_t)snprintf(t + n, cap - n, "%s\n", extra);
    return t;
}

static int index_of(const char *key)
{
    for (int i = 0; i < N_BASE; i++)
        if (strncmp(base_lines[i], key, strlen(key)) == 0 && base_lines[i][strlen(key)] == ' ') return i;
    return -1;
}

/* Parses the base text with key's line replaced by `repl`; expects -EINVAL and a message holding
 * each of the `want` strings. */
static void expect_bad(const char *key, const char *repl, const char *want1, const char *want2)
{
    char *t = make_text(-1, index_of(key), repl, NULL);
    mf_profile p;
    int rc = mf_profile_parse(t, "bad.prof", &p);
    const char *m = mf_last_error();
    CHECK(rc == -EINVAL, "%s -> rc %d", repl, rc);
    CHECK(strstr(m, want1) != NULL, "'%s': message '%s' lacks '%s'", repl, m, want1);
    if (want2) CHECK(strstr(m, want2) != NULL, "'%s': message '%s' lacks '%s'", repl, m, want2);
    free(t);
}

static void test_parse_and_units(void)
{
    char *t = make_text(-1, -1, NULL, NULL);
    mf_profile p;
    int rc = mf_profile_parse(t, "base.prof", &p);
    CHECK(rc == 0, "base: %s", mf_last_error());
    CHECK(strcmp(p.name, "test box") == 0, "name '%s'", p.name);
    CHECK(p.n_sockets == 2 && p.threads_per_socket == 22, "ints");
    CHECK(p.mem_bytes_per_s == 60e9, "G = 1000^3: %g", p.mem_bytes_per_s);
    CHECK(p.host[MF_KF_FP4].bytes_per_s == 1.5 * 1073741824.0, "Gi = 1024^3: %g", p.host[MF_KF_FP4].bytes_per_s);
    CHECK(p.disk_bytes_per_s == 271.0 * 1048576.0, "Mi: %g", p.disk_bytes_per_s);
    CHECK(p.card_mem_bytes == 22ull << 30, "card_mem_bytes %llu", (unsigned long long)p.card_mem_bytes);
    CHECK(p.host[MF_KF_REF].bytes_per_s == 0 && p.host[MF_KF_REF].macs_per_s == 1e9, "ref");
    CHECK(p.card[MF_KF_BF16].macs_per_s == 2e12, "card bf16");
    CHECK(p.host_vec.bytes_per_s == 0 && p.host_vec.macs_per_s == 8e9, "vec");
    CHECK(p.n_keys == N_BASE, "n_keys %d", p.n_keys);
    CHECK(strcmp(mf_profile_source(&p, "disk_bytes_per_s"), "seed page, 'SMR disk at 271 MiB/s'") == 0,
          "source '%s'", mf_profile_source(&p, "disk_bytes_per_s"));
    CHECK(strcmp(mf_profile_source(&p, "host_ref_macs_per_s"), "") == 0, "a plain comment is no source");
    CHECK(mf_profile_source(&p, "no_such_key") == NULL, "unknown key -> NULL");
    CHECK(strcmp(p.keys[0].key, "name") == 0 && strcmp(p.keys[3].value, "60G") == 0, "keys[] in file order");
    free(t);

    /* every suffix */
    static const struct { const char *v; double want; } units[] = {
        {"3K", 3e3}, {"3M", 3e6}, {"3G", 3e9}, {"3T", 3e12},
        {"3Ki", 3 * 1024.0}, {"3Mi", 3 * 1048576.0}, {"3Gi", 3 * 1073741824.0},
        {"3Ti", 3 * 1099511627776.0}, {"2.5e3", 2500}, {"0.5Ki", 512}, {"1.25G", 1.25e9},
    };
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        char line[96];
        snprintf(line, sizeof line, "disk_bytes_per_s = %s", units[i].v);
        t = make_text(-1, index_of("disk_bytes_per_s"), line, NULL);
        rc = mf_profile_parse(t, "units.prof", &p);
        CHECK(rc == 0 && p.disk_bytes_per_s == units[i].want, "%s -> %g (%s)", units[i].v,
              p.disk_bytes_per_s, mf_last_error());
        free(t);
    }

    /* the optional tensor-core rate: absent is 0 (a card without tensor cores), given is read with its
     * source, negative is refused */
    CHECK(p.card_tc_macs_per_s == 0 && mf_profile_source(&p, "card_tc_macs_per_s") &&
              !strcmp(mf_profile_source(&p, "card_tc_macs_per_s"), ""),
          "card_tc_macs_per_s absent: %g", p.card_tc_macs_per_s);
    t = make_text(-1, -1, NULL, "card_tc_macs_per_s = 26.4T   # source: a published GEMM");
    rc = mf_profile_parse(t, "tc.prof", &p);
    CHECK(rc == 0 && p.card_tc_macs_per_s == 26.4e12 &&
              !strcmp(mf_profile_source(&p, "card_tc_macs_per_s"), "a published GEMM") && p.n_keys == N_BASE + 1,
          "card_tc_macs_per_s given: %g (%s)", p.card_tc_macs_per_s, mf_last_error());
    free(t);
    t = make_text(-1, -1, NULL, "card_tc_macs_per_s = -1");
    rc = mf_profile_parse(t, "tcneg.prof", &p);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), "card_tc_macs_per_s") && strstr(mf_last_error(), "out of range"),
          "negative card_tc_macs_per_s: %d '%s'", rc, mf_last_error());
    free(t);

    /* keys ending in _per_s take suffixes too */
    t = make_text(-1, index_of("host_fp4_macs_per_s"), "host_fp4_macs_per_s = 3.5G", NULL);
    rc = mf_profile_parse(t, "macs.prof", &p);
    CHECK(rc == 0 && p.host[MF_KF_FP4].macs_per_s == 3.5e9, "macs with a suffix: %s", mf_last_error());
    free(t);

    /* no cards: card rates may be 0 */
    t = make_text(-1, index_of("n_cards"), "n_cards = 0", NULL);
    char *t2 = malloc(16384);
    size_t n = 0;
    for (char *s = t; *s;) {
        char *eol = strchr(s, '\n');
        size_t len = (size_t)(eol - s);
        if (strncmp(s, "card_", 5) == 0 || strncmp(s, "h2d_", 4) == 0 || strncmp(s, "d2h_", 4) == 0) {
            char key[64];
            sscanf(s, "%63s", key);
            n += (size_t)snprintf(t2 + n, 16384 - n, "%s = 0\n", key);
        } else {
            n += (size_t)snprintf(t2 + n, 16384 - n, "%.*s\n", (int)len, s);
        }
        s = eol + 1;
    }
    rc = mf_profile_parse(t2, "nocards.prof", &p);
    CHECK(rc == 0 && p.n_cards == 0 && p.h2d_bytes_per_s == 0, "no cards: %s", mf_last_error());
    free(t);
    free(t2);
}

static void test_errors(void)
{
    mf_profile p;
    /* missing: each key in turn */
    for (int i = 0; i < N_BASE; i++) {
        char *t = make_text(i, -1, NULL, NULL);
        char key[64];
        sscanf(base_lines[i], "%63s", key);
        int rc = mf_profile_parse(t, "miss.prof", &p);
        char want[96];
        snprintf(want, sizeof want, "'%s' missing", key);
        CHECK(rc == -EINVAL && strstr(mf_last_error(), want) && strstr(mf_last_error(), "miss.prof"),
              "missing %s: rc %d '%s'", key, rc, mf_last_error());
        free(t);
    }
    /* duplicate (appended after the 39 keys and the comment: line N_BASE + 2) */
    char *t = make_text(-1, -1, NULL, "n_cards = 2");
    int rc = mf_profile_parse(t, "dup.prof", &p);
    char want[64];
    snprintf(want, sizeof want, "dup.prof:%d", N_BASE + 2);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), want) && strstr(mf_last_error(), "'n_cards' given twice") &&
          strstr(mf_last_error(), "first at line"), "dup: '%s'", mf_last_error());
    free(t);
    /* unknown */
    t = make_text(-1, -1, NULL, "disk_bytes_per_sec = 5");
    rc = mf_profile_parse(t, "unk.prof", &p);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), want + 4) && strstr(mf_last_error(), "unknown key 'disk_bytes_per_sec'"),
          "unknown: '%s'", mf_last_error());
    free(t);
    /* not key = value */
    t = make_text(-1, -1, NULL, "just words");
    rc = mf_profile_parse(t, "kv.prof", &p);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), "expected 'key = value'"), "kv: '%s'", mf_last_error());
    free(t);

    /* bad numbers; the line of mem_bytes_per_s is index + 2 */
    char at[32];
    snprintf(at, sizeof at, "bad.prof:%d", index_of("mem_bytes_per_s") + 2);
    expect_bad("mem_bytes_per_s", "mem_bytes_per_s = fast", at, "key 'mem_bytes_per_s': bad number 'fast'");
    expect_bad("mem_bytes_per_s", "mem_bytes_per_s = 12X", at, "unknown unit suffix");
    expect_bad("mem_bytes_per_s", "mem_bytes_per_s = 12Gx", at, "unknown unit suffix");
    expect_bad("mem_bytes_per_s", "mem_bytes_per_s = 1.2.3", at, "bad number");
    expect_bad("mem_bytes_per_s", "mem_bytes_per_s = nan", at, "bad number");
    expect_bad("mem_bytes_per_s", "mem_bytes_per_s = inf", at, "bad number");
    expect_bad("mem_bytes_per_s", "mem_bytes_per_s =", at, "no value");
    expect_bad("mem_bytes_per_s", "mem_bytes_per_s = 1e999", at, "bad number");
    expect_bad("task_overhead_ns", "task_overhead_ns = 5K", "key 'task_overhead_ns'", "takes no unit suffix");
    expect_bad("n_sockets", "n_sockets = 1.5", "key 'n_sockets'", "whole number");
    expect_bad("card_mem_bytes", "card_mem_bytes = 0.3", "key 'card_mem_bytes'", "whole number");
    /* out of range */
    snprintf(at, sizeof at, "bad.prof:%d", index_of("n_sockets") + 2);
    expect_bad("n_sockets", "n_sockets = 0", at, "key 'n_sockets': value 0 out of range");
    expect_bad("mem_bytes_per_s", "mem_bytes_per_s = -5", "key 'mem_bytes_per_s'", "out of range");
    expect_bad("mem_bytes_per_s", "mem_bytes_per_s = 0", "key 'mem_bytes_per_s'", "out of range");
    expect_bad("cross_socket_factor", "cross_socket_factor = 1.5", "key 'cross_socket_factor'", "out of range");
    expect_bad("cards_emulated", "cards_emulated = 2", "key 'cards_emulated'", "out of range");
    expect_bad("host_fp8_latency_ns", "host_fp8_latency_ns = -1", "key 'host_fp8_latency_ns'", "out of range");
    expect_bad("n_cards", "n_cards = 65", "key 'n_cards'", "out of range");
    /* a card rate of 0 is refused while the profile has cards */
    snprintf(at, sizeof at, "bad.prof:%d", index_of("card_fp8_bytes_per_s") + 2);
    expect_bad("card_fp8_bytes_per_s", "card_fp8_bytes_per_s = 0", at, "the profile has cards");

    /* a missing file names the path */
    rc = mf_profile_load("/nonexistent/x.prof", &p);
    CHECK(rc == -ENOENT && strstr(mf_last_error(), "/nonexistent/x.prof"), "missing file: %d '%s'", rc, mf_last_error());
}

/* Random byte edits of a valid profile: every result is a valid profile or -EINVAL with a message
 * naming the text (under ASan this also checks the parser never reads or writes out of bounds). */
static void test_mutations(void)
{
    char *base = make_text(-1, -1, NULL, NULL);
    size_t n = strlen(base);
    uint64_t x = 88172645463325252ull;
    int bad = 0, refused = 0;
    static const char alphabet[] = "=#\n -.e0123456789KMGTi_ax\t";
    for (int it = 0; it < 3000; it++) {
        char *t = strdup(base);
        int edits = 1 + it % 4;
        for (int e = 0; e < edits; e++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            size_t at = (size_t)(x % n);
            t[at] = alphabet[(x >> 32) % (sizeof alphabet - 1)];
        }
        mf_profile p;
        int rc = mf_profile_parse(t, "mut.prof", &p);
        if (rc != 0 && (rc != -EINVAL || !strstr(mf_last_error(), "mut.prof"))) bad++;
        refused += rc != 0;
        free(t);
    }
    CHECK(bad == 0, "%d mutated profiles failed other than with -EINVAL naming the text", bad);
    CHECK(refused > 1000, "only %d of 3000 mutated profiles refused", refused);
    free(base);
}

static void test_round_trip(const char *tmpdir)
{
    char *t = make_text(-1, -1, NULL, NULL);
    mf_profile a, b;
    CHECK(mf_profile_parse(t, "rt.prof", &a) == 0, "%s", mf_last_error());
    free(t);
    /* a measured-looking value that has no short form must come back exactly */
    a.host[MF_KF_FP8].macs_per_s = 1234567890.123456789;
    a.h2d_latency_ns = 1.0 / 3.0;
    a.act_copy_latency_ns = 7000;
    CHECK(mf_profile_set_source(&a, "host_fp8_macs_per_s", "measured by a test: 1/3 of nothing") == 0, "set");
    CHECK(mf_profile_set_source(&a, "no_such", "x") == -ENOENT, "set unknown -> -ENOENT");
    char path[512];
    snprintf(path, sizeof path, "%s/rt.prof", tmpdir);
    int rc = mf_profile_write_header(&a, path, "line one\nline two");
    CHECK(rc == 0, "write: %s", mf_last_error());
    rc = mf_profile_load(path, &b);
    CHECK(rc == 0, "load back: %s", mf_last_error());
    CHECK(strcmp(b.path, path) == 0, "path kept");
    CHECK(strcmp(a.name, b.name) == 0, "name");
#define SAME(f) CHECK(a.f == b.f, #f ": %.17g vs %.17g", (double)a.f, (double)b.f)
    SAME(n_sockets); SAME(threads_per_socket); SAME(mem_bytes_per_s); SAME(cross_socket_factor);
    SAME(task_overhead_ns); SAME(worker_spin_ns); SAME(worker_wake_ns); SAME(disk_bytes_per_s); SAME(disk_latency_ns); SAME(disk_queue_depth);
    SAME(n_cards); SAME(cards_emulated); SAME(card_mem_bytes); SAME(h2d_bytes_per_s); SAME(h2d_latency_ns);
    SAME(d2h_bytes_per_s); SAME(d2h_latency_ns); SAME(h2d_total_bytes_per_s); SAME(act_copy_latency_ns);
    SAME(host_vec.macs_per_s); SAME(host_vec.latency_ns);
    for (int k = 0; k < MF_KF_N; k++) {
        SAME(host[k].bytes_per_s); SAME(host[k].macs_per_s); SAME(host[k].latency_ns);
        SAME(card[k].bytes_per_s); SAME(card[k].macs_per_s); SAME(card[k].latency_ns);
    }
#undef SAME
    CHECK(b.n_keys == N_BASE, "n_keys %d", b.n_keys);
    for (int i = 0; i < b.n_keys; i++) {
        const char *sa = mf_profile_source(&a, b.keys[i].key);
        CHECK(sa && strcmp(sa, b.keys[i].source) == 0, "source of %s: '%s' vs '%s'", b.keys[i].key,
              sa ? sa : "(null)", b.keys[i].source);
    }
    CHECK(strcmp(mf_profile_source(&b, "h2d_bytes_per_s"), "seed page: pinned H2D 8.29 GiB/s measured") == 0,
          "kept source");
    /* the optional key: left out of the file while 0 without a source, written and read back when set */
    a.card_tc_macs_per_s = 26.4e12;
    char path2[600];
    snprintf(path2, sizeof path2, "%s/rt2.prof", tmpdir);
    CHECK(mf_profile_write(&a, path2) == 0 && mf_profile_load(path2, &b) == 0 && b.card_tc_macs_per_s == 26.4e12 &&
              b.n_keys == N_BASE + 1,
          "card_tc_macs_per_s round trip: %g, %d keys (%s)", b.card_tc_macs_per_s, b.n_keys, mf_last_error());
    /* the written text keeps the short forms and the header */
    FILE *f = fopen(path, "r");
    char text[8192] = {0};
    if (f) {
        size_t n = fread(text, 1, sizeof text - 1, f);
        text[n] = '\0';
        fclose(f);
    }
    CHECK(strstr(text, "# line two\n") != NULL, "header written");
    CHECK(strstr(text, "= 8.29Gi") != NULL && strstr(text, "= 271Mi") != NULL && strstr(text, "= 60G") != NULL,
          "short unit forms: %s", text);
    /* writing an invalid profile is refused and leaves nothing */
    b.n_sockets = 0;
    snprintf(path, sizeof path, "%s/bad_rt.prof", tmpdir);
    rc = mf_profile_write(&b, path);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), "n_sockets"), "invalid write: %d %s", rc, mf_last_error());
    CHECK(access(path, F_OK) != 0, "nothing written");
    /* print names every key */
    char *buf = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&buf, &len);
    mf_profile_print(&a, m);
    fclose(m);
    CHECK(buf && strstr(buf, "card_ref_latency_ns") && strstr(buf, "measured by a test"), "print");
    free(buf);
}

/* The profiles shipped in tools/profiles/ load and look like their machines. */
static void test_shipped(void)
{
    const char *names[] = {"this-machine.prof", "seed-host.prof"};
    for (int i = 0; i < 2; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/tools/profiles/%s", MF_SOURCE_DIR, names[i]);
        if (access(path, F_OK) != 0) {
            CHECK(0, "%s is not shipped", path);
            continue;
        }
        mf_profile p;
        int rc = mf_profile_load(path, &p);
        CHECK(rc == 0, "%s: %s", path, mf_last_error());
        if (rc) continue;
        /* every figure has its source */
        for (int k = 0; k < p.n_keys; k++)
            if (strcmp(p.keys[k].key, "name") != 0)
                CHECK(p.keys[k].source[0] != '\0', "%s: key %s has no source", names[i], p.keys[k].key);
        if (i == 1) {
            CHECK(p.n_sockets == 2 && p.n_cards == 4 && !p.cards_emulated, "seed host shape");
            CHECK(p.disk_bytes_per_s == 271.0 * 1048576.0, "seed disk 271 MiB/s");
            CHECK(p.h2d_bytes_per_s == 10.6 * 1073741824.0, "seed h2d: the raw pinned slot, 10.6 GiB/s");
            /* the token load's 1,440 copies of 4.20 GiB at the measured 8.29 GiB/s, within 0.1% */
            double load_s = 1440 * p.h2d_latency_ns / 1e9 + 4.20 * 1073741824.0 / p.h2d_bytes_per_s;
            CHECK(fabs(4.20 / load_s - 8.29) < 0.01, "seed token load at %.3f GiB/s, measured 8.29", 4.20 / load_s);
            CHECK(p.threads_per_socket == 22 && p.card_mem_bytes == 22528ull << 20, "seed cores and card memory");
            /* no figure without a kind of source */
            for (int k = 0; k < p.n_keys; k++)
                if (strcmp(p.keys[k].key, "name") != 0)
                    CHECK(!strncmp(p.keys[k].source, "seed page", 9) || !strncmp(p.keys[k].source, "spec:", 5) ||
                              !strncmp(p.keys[k].source, "published:", 10) ||
                              !strncmp(p.keys[k].source, "estimate:", 9),
                          "seed %s: source '%s'", p.keys[k].key, p.keys[k].source);
            /* the cards' tensor cores: a published cuBLAS GEMM rate, below the whitepaper's peak */
            CHECK(p.card_tc_macs_per_s > p.card[MF_KF_FP8].macs_per_s && p.card_tc_macs_per_s <= 56.9e12 / 2,
                  "seed tensor-core rate %g MAC/s", p.card_tc_macs_per_s);
        } else {
            CHECK(p.n_cards == 4 && p.cards_emulated == 1, "this machine's cards: emu:4, emulated");
            CHECK(strstr(mf_profile_source(&p, "host_fp4_bytes_per_s"), "measured by moeflow calibrate") != NULL,
                  "this machine's figures come from moeflow calibrate");
        }
    }
}

int main(void)
{
    const char *tmp = getenv("MOEFLOW_TMP");
    char dir[512];
    snprintf(dir, sizeof dir, "%s/profile.XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(dir)) {
        perror(dir);
        return 1;
    }
    test_parse_and_units();
    test_errors();
    test_mutations();
    test_round_trip(dir);
    test_shipped();
    char cmd[1100];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
    return mf_check_exit("test_profile");
}
