/* Hardware profiles (sched/profile.h): the `key = value  # source: ...` text format, read with
 * every error naming path:line and the key, written back with each figure's source, printed as a
 * table. The key table below is the format; docs/profiles.md describes each key. */
#include "sched/profile.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sched/error.h"
#include "sched/path.h"

/* ---- the format ------------------------------------------------------------------------------ */

typedef enum { MF_PK_STR, MF_PK_INT, MF_PK_DBL, MF_PK_U64 } mf_pk_type;

/* Range rules: [lo, hi]; lo_open: strictly above lo; card: with n_cards 0 the value may be 0.
 * optional: the file may leave the key out (the value is then 0; written back like the others). */
typedef struct mf_pkey {
    const char *key;
    mf_pk_type type;
    size_t off;
    int units;         /* 1: takes K/M/G/T and Ki/Mi/Gi/Ti suffixes (keys ending in _bytes or _per_s) */
    double lo, hi;
    int lo_open;
    int card;
    int optional;
} mf_pkey;

#define OFF(f) offsetof(mf_profile, f)
#define KOFF(arr, k, f) (offsetof(mf_profile, arr) + (k) * sizeof(mf_profile_kern) + \
                         offsetof(mf_profile_kern, f))
#define BIG 1e18
/* One kernel family: bytes_per_s and macs_per_s > 0, latency_ns >= 0. MF_KF_REF has no bytes key. */
#define KERN(pfx, arr, fam, k, card)                                                              \
    {pfx "_" fam "_bytes_per_s", MF_PK_DBL, KOFF(arr, k, bytes_per_s), 1, 0, BIG, 1, card, 0}, \
    {pfx "_" fam "_macs_per_s", MF_PK_DBL, KOFF(arr, k, macs_per_s), 1, 0, BIG, 1, card, 0},   \
    {pfx "_" fam "_latency_ns", MF_PK_DBL, KOFF(arr, k, latency_ns), 0, 0, 1e12, 0, 0, 0}

static const mf_pkey mf_pkeys[] = {
    {"name", MF_PK_STR, OFF(name), 0, 0, 0, 0, 0, 0},
    /* host */
    {"n_sockets", MF_PK_INT, OFF(n_sockets), 0, 1, 64, 0, 0, 0},
    {"threads_per_socket", MF_PK_INT, OFF(threads_per_socket), 0, 1, 4096, 0, 0, 0},
    {"mem_bytes_per_s", MF_PK_DBL, OFF(mem_bytes_per_s), 1, 0, BIG, 1, 0, 0},
    {"cross_socket_factor", MF_PK_DBL, OFF(cross_socket_factor), 0, 0, 1, 1, 0, 0},
    {"task_overhead_ns", MF_PK_DBL, OFF(task_overhead_ns), 0, 0, 1e12, 0, 0, 0},
    {"worker_spin_ns", MF_PK_DBL, OFF(worker_spin_ns), 0, 0, 1e12, 0, 0, 0},
    {"worker_wake_ns", MF_PK_DBL, OFF(worker_wake_ns), 0, 0, 1e12, 0, 0, 0},
    KERN("host", host, "fp4", MF_KF_FP4, 0),
    KERN("host", host, "fp8", MF_KF_FP8, 0),
    KERN("host", host, "bf16", MF_KF_BF16, 0),
    {"host_ref_macs_per_s", MF_PK_DBL, KOFF(host, MF_KF_REF, macs_per_s), 1, 0, BIG, 1, 0, 0},
    {"host_ref_latency_ns", MF_PK_DBL, KOFF(host, MF_KF_REF, latency_ns), 0, 0, 1e12, 0, 0, 0},
    {"host_vec_macs_per_s", MF_PK_DBL, OFF(host_vec.macs_per_s), 1, 0, BIG, 1, 0, 0},
    {"host_vec_latency_ns", MF_PK_DBL, OFF(host_vec.latency_ns), 0, 0, 1e12, 0, 0, 0},
    /* disk */
    {"disk_bytes_per_s", MF_PK_DBL, OFF(disk_bytes_per_s), 1, 0, BIG, 1, 0, 0},
    {"disk_latency_ns", MF_PK_DBL, OFF(disk_latency_ns), 0, 0, 1e12, 0, 0, 0},
    {"disk_queue_depth", MF_PK_INT, OFF(disk_queue_depth), 0, 1, 65536, 0, 0, 0},
    /* cards */
    {"n_cards", MF_PK_INT, OFF(n_cards), 0, 0, 64, 0, 0, 0},
    {"cards_emulated", MF_PK_INT, OFF(cards_emulated), 0, 0, 1, 0, 0, 0},
    {"card_mem_bytes", MF_PK_U64, OFF(card_mem_bytes), 1, 0, BIG, 1, 1, 0},
    {"h2d_bytes_per_s", MF_PK_DBL, OFF(h2d_bytes_per_s), 1, 0, BIG, 1, 1, 0},
    {"h2d_latency_ns", MF_PK_DBL, OFF(h2d_latency_ns), 0, 0, 1e12, 0, 0, 0},
    {"d2h_bytes_per_s", MF_PK_DBL, OFF(d2h_bytes_per_s), 1, 0, BIG, 1, 1, 0},
    {"d2h_latency_ns", MF_PK_DBL, OFF(d2h_latency_ns), 0, 0, 1e12, 0, 0, 0},
    {"h2d_total_bytes_per_s", MF_PK_DBL, OFF(h2d_total_bytes_per_s), 1, 0, BIG, 1, 1, 0},
    {"act_copy_latency_ns", MF_PK_DBL, OFF(act_copy_latency_ns), 0, 0, 1e12, 0, 0, 0},
    KERN("card", card, "fp4", MF_KF_FP4, 1),
    KERN("card", card, "fp8", MF_KF_FP8, 1),
    KERN("card", card, "bf16", MF_KF_BF16, 1),
    {"card_ref_macs_per_s", MF_PK_DBL, KOFF(card, MF_KF_REF, macs_per_s), 1, 0, BIG, 1, 1, 0},
    {"card_ref_latency_ns", MF_PK_DBL, KOFF(card, MF_KF_REF, latency_ns), 0, 0, 1e12, 0, 0, 0},
    {"card_tc_macs_per_s", MF_PK_DBL, OFF(card_tc_macs_per_s), 1, 0, BIG, 0, 0, 1},
};
#define MF_N_PKEYS ((int)(sizeof mf_pkeys / sizeof mf_pkeys[0]))

_Static_assert(sizeof mf_pkeys / sizeof mf_pkeys[0] <= MF_PROFILE_MAX_KEYS, "keys[] too small");

static const mf_pkey *mf_pkey_find(const char *key)
{
    for (int i = 0; i < MF_N_PKEYS; i++)
        if (strcmp(mf_pkeys[i].key, key) == 0) return &mf_pkeys[i];
    return NULL;
}

static double mf_pkey_get(const mf_profile *p, const mf_pkey *k)
{
    const char *base = (const char *)p + k->off;
    switch (k->type) {
    case MF_PK_INT: return *(const int *)base;
    case MF_PK_U64: return (double)*(const uint64_t *)base;
    case MF_PK_DBL: return *(const double *)base;
    default: return 0;
    }
}

static void mf_pkey_set(mf_profile *p, const mf_pkey *k, double v)
{
    char *base = (char *)p + k->off;
    switch (k->type) {
    case MF_PK_INT: *(int *)base = (int)v; break;
    case MF_PK_U64: *(uint64_t *)base = (uint64_t)v; break;
    case MF_PK_DBL: *(double *)base = v; break;
    default: break;
    }
}

/* ---- numbers --------------------------------------------------------------------------------- */

/* Parses a number with an optional unit suffix (when units). 0, or -1 with a reason in why. */
static int mf_pnum_parse(const char *s, int units, double *out, const char **why)
{
    size_t n = 0;
    while (s[n] && (isdigit((unsigned char)s[n]) || strchr(".eE+-", s[n]))) n++;
    if (n == 0) {
        *why = "expected a number";
        return -1;
    }
    char num[64];
    if (n >= sizeof num) {
        *why = "number too long";
        return -1;
    }
    memcpy(num, s, n);
    num[n] = '\0';
    char *end;
    errno = 0;
    double v = strtod(num, &end);
    if (*end != '\0' || errno == ERANGE || !isfinite(v)) {
        *why = "expected a finite decimal number";
        return -1;
    }
    const char *suf = s + n;
    double mult = 1;
    if (*suf) {
        static const char letters[] = "KMGT";
        const char *l = strchr(letters, *suf);
        if (!units) {
            *why = "this key takes no unit suffix (only keys ending in _bytes or _per_s do)";
            return -1;
        }
        if (!l || !*l) {
            *why = "unknown unit suffix (K, M, G, T, Ki, Mi, Gi, Ti)";
            return -1;
        }
        int e = (int)(l - letters) + 1;
        if (suf[1] == 'i' && suf[2] == '\0')
            mult = ldexp(1.0, 10 * e);
        else if (suf[1] == '\0')
            mult = pow(1000.0, e);
        else {
            *why = "unknown unit suffix (K, M, G, T, Ki, Mi, Gi, Ti)";
            return -1;
        }
    }
    *out = v * mult;
    if (!isfinite(*out)) {
        *why = "number out of range";
        return -1;
    }
    return 0;
}

/* Shortest text for v that parses back to exactly v; bytes keys get the shortest unit form. */
static void mf_pnum_format(const mf_pkey *k, double v, char *out, size_t cap)
{
    if (k->type == MF_PK_INT) {
        snprintf(out, cap, "%d", (int)v);
        return;
    }
    static const char *sufs[] = {"", "Ki", "Mi", "Gi", "Ti", "K", "M", "G", "T"};
    static const double mults[] = {1, 1024.0, 1048576.0, 1073741824.0, 1099511627776.0,
                                   1e3, 1e6, 1e9, 1e12};
    int n_suf = k->units ? 9 : 1;
    out[0] = '\0';
    size_t best = (size_t)-1;
    for (int s = 0; s < n_suf; s++) {
        if (s > 0 && fabs(v) < mults[s]) continue;
        for (int prec = 1; prec <= 17; prec++) {
            char buf[64];
            snprintf(buf, sizeof buf, "%.*g%s", prec, v / mults[s], sufs[s]);
            double back;
            const char *why;
            if (mf_pnum_parse(buf, k->units, &back, &why) != 0 || back != v) continue;
            /* shortest wins; an exponent counts 4 more, so 10000 beats 1e+04 but 1e+12 stays */
            size_t score = strlen(buf) + (strchr(buf, 'e') ? 4 : 0);
            if (score <= best && strlen(buf) < cap) {   /* ties: the larger unit (45.19G, not 45190M) */
                best = score;
                snprintf(out, cap, "%s", buf);
            }
        }
    }
    if (!out[0]) snprintf(out, cap, "%.17g", v);
}

/* ---- keys[] ---------------------------------------------------------------------------------- */

static int mf_pkeys_index(const mf_profile *p, const char *key)
{
    for (int i = 0; i < p->n_keys; i++)
        if (strcmp(p->keys[i].key, key) == 0) return i;
    return -1;
}

/* Range and cross-key checks; `line_of` gives each key's line (NULL: none known). */
static int mf_profile_check(const mf_profile *p, const char *what, const int *line_of)
{
    for (int i = 0; i < MF_N_PKEYS; i++) {
        const mf_pkey *k = &mf_pkeys[i];
        char at[300];
        if (line_of && line_of[i] > 0)
            snprintf(at, sizeof at, "%s:%d", what, line_of[i]);
        else
            snprintf(at, sizeof at, "%s", what);
        if (k->type == MF_PK_STR) {
            if (!p->name[0]) return mf_error(-EINVAL, "%s: key '%s': expected a name, found nothing", at, k->key);
            continue;
        }
        double v = mf_pkey_get(p, k);
        int may_be_zero = k->card && p->n_cards == 0;
        int low = k->lo_open ? !(v > k->lo) : !(v >= k->lo);
        if (may_be_zero && v == 0) low = 0;
        if (low || v > k->hi || !isfinite(v)) {
            char fv[64];
            mf_pnum_format(k, v, fv, sizeof fv);
            return mf_error(-EINVAL, "%s: key '%s': value %s out of range: expected %s %g%s and <= %g",
                            at, k->key, fv, k->lo_open ? ">" : ">=", k->lo,
                            k->card ? (p->n_cards ? " (the profile has cards)" : " (or 0 without cards)") : "",
                            k->hi);
        }
    }
    return 0;
}

/* ---- reading --------------------------------------------------------------------------------- */

static char *mf_trim(char *s)
{
    while (isspace((unsigned char)*s)) s++;
    size_t n = strlen(s);
    while (n > 0 && isspace((unsigned char)s[n - 1])) s[--n] = '\0';
    return s;
}

int mf_profile_parse(const char *text, const char *what, mf_profile *out)
{
    memset(out, 0, sizeof *out);
    int line_of[MF_N_PKEYS];
    memset(line_of, 0, sizeof line_of);
    const char *s = text;
    for (int line = 1; *s; line++) {
        const char *eol = strchr(s, '\n');
        size_t len = eol ? (size_t)(eol - s) : strlen(s);
        char buf[1024];
        if (len >= sizeof buf)
            return mf_error(-EINVAL, "%s:%d: line longer than %zu characters", what, line, sizeof buf - 1);
        memcpy(buf, s, len);
        buf[len] = '\0';
        s = eol ? eol + 1 : s + len;

        char *hash = strchr(buf, '#');
        char *comment = NULL;
        if (hash) {
            *hash = '\0';
            comment = mf_trim(hash + 1);
        }
        char *body = mf_trim(buf);
        if (!*body) continue;   /* blank or comment-only line */
        char *eq = strchr(body, '=');
        if (!eq)
            return mf_error(-EINVAL, "%s:%d: expected 'key = value', found '%s'", what, line, body);
        *eq = '\0';
        char *key = mf_trim(body), *val = mf_trim(eq + 1);
        const mf_pkey *k = mf_pkey_find(key);
        if (!k) return mf_error(-EINVAL, "%s:%d: unknown key '%s' (docs/profiles.md lists the keys)", what, line, key);
        int ki = (int)(k - mf_pkeys);
        if (line_of[ki])
            return mf_error(-EINVAL, "%s:%d: key '%s' given twice (first at line %d)", what, line, key, line_of[ki]);
        line_of[ki] = line;
        if (!*val) return mf_error(-EINVAL, "%s:%d: key '%s': no value", what, line, key);
        if (strlen(val) >= sizeof out->keys[0].value)
            return mf_error(-EINVAL, "%s:%d: key '%s': value longer than %zu characters", what, line, key,
                            sizeof out->keys[0].value - 1);
        const char *source = "";
        if (comment && strncmp(comment, "source:", 7) == 0) {
            source = mf_trim(comment + 7);
            if (strlen(source) >= sizeof out->keys[0].source)
                return mf_error(-EINVAL, "%s:%d: key '%s': source longer than %zu characters "
                                "(put the rest in a comment line)", what, line, key,
                                sizeof out->keys[0].source - 1);
        }
        if (k->type == MF_PK_STR) {
            snprintf(out->name, sizeof out->name, "%s", val);
        } else {
            double v;
            const char *why;
            if (mf_pnum_parse(val, k->units, &v, &why) != 0)
                return mf_error(-EINVAL, "%s:%d: key '%s': bad number '%s': %s", what, line, key, val, why);
            if (k->type != MF_PK_DBL && v != floor(v))
                return mf_error(-EINVAL, "%s:%d: key '%s': bad number '%s': expected a whole number",
                                what, line, key, val);
            if (k->type == MF_PK_INT && (v < -1e9 || v > 1e9))
                return mf_error(-EINVAL, "%s:%d: key '%s': value %s out of range: expected %g..%g",
                                what, line, key, val, k->lo, k->hi);
            if (k->type == MF_PK_U64 && (v < 0 || v >= 1.8e19))
                return mf_error(-EINVAL, "%s:%d: key '%s': value %s out of range: expected %g..%g",
                                what, line, key, val, k->lo, k->hi);
            mf_pkey_set(out, k, v);
        }
        int e = out->n_keys++;
        snprintf(out->keys[e].key, sizeof out->keys[e].key, "%s", key);
        snprintf(out->keys[e].value, sizeof out->keys[e].value, "%s", val);
        snprintf(out->keys[e].source, sizeof out->keys[e].source, "%s", source);
    }
    for (int i = 0; i < MF_N_PKEYS; i++)
        if (!line_of[i] && !mf_pkeys[i].optional)
            return mf_error(-EINVAL, "%s: key '%s' missing (every key of the format but the optional ones must be "
                            "given once)", what, mf_pkeys[i].key);
    return mf_profile_check(out, what, line_of);
}

int mf_profile_load(const char *path, mf_profile *out)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        int e = errno;
        return mf_error(-e, "%s: cannot open profile: %s", path, strerror(e));
    }
    size_t cap = 1 << 16, n = 0;
    char *text = malloc(cap + 1);
    if (!text) {
        fclose(f);
        return mf_error(-ENOMEM, "%s: out of memory", path);
    }
    size_t got;
    while ((got = fread(text + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            fclose(f);
            free(text);
            return mf_error(-EINVAL, "%s: larger than %zu bytes: not a profile", path, cap);
        }
    }
    int err = ferror(f);
    fclose(f);
    if (err) {
        free(text);
        return mf_error(-EIO, "%s: read failed", path);
    }
    text[n] = '\0';
    if (strlen(text) != n) {
        free(text);
        return mf_error(-EINVAL, "%s: contains a NUL byte: not a profile", path);
    }
    int rc = mf_profile_parse(text, path, out);
    free(text);
    if (rc == 0) snprintf(out->path, sizeof out->path, "%s", path);
    return rc;
}

/* ---- sources --------------------------------------------------------------------------------- */

int mf_profile_set_source(mf_profile *p, const char *key, const char *source)
{
    const mf_pkey *k = mf_pkey_find(key);
    if (!k) return mf_error(-ENOENT, "profile: unknown key '%s'", key);
    if (strlen(source) >= sizeof p->keys[0].source)
        return mf_error(-EINVAL, "profile: key '%s': source longer than %zu characters", key,
                        sizeof p->keys[0].source - 1);
    if (strpbrk(source, "\n\r"))
        return mf_error(-EINVAL, "profile: key '%s': source has a line break", key);
    int i = mf_pkeys_index(p, key);
    if (i < 0) {
        if (p->n_keys >= MF_PROFILE_MAX_KEYS) return mf_error(-ENOSPC, "profile: keys[] full");
        i = p->n_keys++;
        snprintf(p->keys[i].key, sizeof p->keys[i].key, "%s", key);
        p->keys[i].value[0] = '\0';
    }
    snprintf(p->keys[i].source, sizeof p->keys[i].source, "%s", source);
    return 0;
}

const char *mf_profile_source(const mf_profile *p, const char *key)
{
    if (!mf_pkey_find(key)) return NULL;
    int i = mf_pkeys_index(p, key);
    return i < 0 ? "" : p->keys[i].source;
}

/* ---- writing --------------------------------------------------------------------------------- */

static void mf_pkey_text(const mf_profile *p, const mf_pkey *k, char *out, size_t cap)
{
    if (k->type == MF_PK_STR)
        snprintf(out, cap, "%s", p->name);
    else
        mf_pnum_format(k, mf_pkey_get(p, k), out, cap);
}

int mf_profile_write_header(const mf_profile *p, const char *path, const char *header)
{
    int rc = mf_profile_check(p, path, NULL);
    if (rc) return mf_error_wrap(rc, "not writing an invalid profile");
    if (strpbrk(p->name, "#\n\r"))
        return mf_error(-EINVAL, "%s: profile name '%s' may not hold '#' or line breaks", path, p->name);
    char tmp[4096];
    FILE *f;
    if ((rc = mf_path_open_tmp(path, tmp, sizeof tmp, &f))) return rc;
    fprintf(f, "# moeflow hardware profile (format: docs/profiles.md)\n");
    if (header && *header) {
        const char *s = header;
        while (*s) {
            const char *eol = strchr(s, '\n');
            int len = eol ? (int)(eol - s) : (int)strlen(s);
            fprintf(f, "# %.*s\n", len, s);
            s += len + (eol ? 1 : 0);
        }
    }
    static const struct { const char *first; const char *title; } sections[] = {
        {"n_sockets", "host: sockets, memory, executor, kernels per thread"},
        {"disk_bytes_per_s", "disk"},
        {"n_cards", "cards (per card)"},
    };
    for (int i = 0; i < MF_N_PKEYS; i++) {
        const mf_pkey *k = &mf_pkeys[i];
        for (size_t s = 0; s < sizeof sections / sizeof sections[0]; s++)
            if (strcmp(sections[s].first, k->key) == 0) fprintf(f, "\n# %s\n", sections[s].title);
        char val[64];
        mf_pkey_text(p, k, val, sizeof val);
        const char *src = mf_profile_source(p, k->key);
        if (k->optional && mf_pkey_get(p, k) == 0 && !(src && *src)) continue;   /* absent reads back as 0 */
        if (src && *src)
            fprintf(f, "%-24s = %-12s  # source: %s\n", k->key, val, src);
        else
            fprintf(f, "%-24s = %s\n", k->key, val);
    }
    return mf_path_commit_tmp(f, tmp, path);
}

int mf_profile_write(const mf_profile *p, const char *path)
{
    return mf_profile_write_header(p, path, NULL);
}

void mf_profile_print(const mf_profile *p, FILE *f)
{
    fprintf(f, "profile %s%s%s%s\n", p->name, p->path[0] ? " (" : "", p->path, p->path[0] ? ")" : "");
    fprintf(f, "  %-24s %-14s %s\n", "key", "value", "source");
    for (int i = 0; i < MF_N_PKEYS; i++) {
        const mf_pkey *k = &mf_pkeys[i];
        char val[64];
        mf_pkey_text(p, k, val, sizeof val);
        const char *src = mf_profile_source(p, k->key);
        fprintf(f, "  %-24s %-14s %s\n", k->key, val, src && *src ? src : "-");
    }
}

static void mf_json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

void mf_profile_print_json(const mf_profile *p, FILE *f)
{
    fprintf(f, "{\"name\": ");
    mf_json_str(f, p->name);
    fprintf(f, ", \"path\": ");
    mf_json_str(f, p->path);
    fprintf(f, ", \"keys\": [");
    for (int i = 0; i < MF_N_PKEYS; i++) {
        const mf_pkey *k = &mf_pkeys[i];
        char val[64];
        mf_pkey_text(p, k, val, sizeof val);
        fprintf(f, "%s\n  {\"key\": \"%s\", \"value\": ", i ? "," : "", k->key);
        if (k->type == MF_PK_STR)
            mf_json_str(f, p->name);
        else
            fprintf(f, "%.17g", mf_pkey_get(p, k));
        fprintf(f, ", \"text\": ");
        mf_json_str(f, val);
        fprintf(f, ", \"source\": ");
        const char *src = mf_profile_source(p, k->key);
        mf_json_str(f, src ? src : "");
        fputc('}', f);
    }
    fprintf(f, "\n]}\n");
}
