/* The commands' option tables (tools/opts.h): the one parser of every command line, the help
 * printed from the same rows, the size parser, and the test modes that let tests/test_cli.c hold
 * each command's help against what its parser accepts. A table walker, not getopt_long (opts.h
 * says why). */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/error.h"
#include "tools/opts.h"

int mf_opts_mode = MF_OPTS_MODE_RUN;

uint64_t mf_tool_size(const char *s)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || !(v > 0)) return 0;
    double m = 1;
    switch (*end) {
    case 'K': case 'k': m = 1024.0; end++; break;
    case 'M': case 'm': m = 1048576.0; end++; break;
    case 'G': case 'g': m = 1073741824.0; end++; break;
    case 'T': case 't': m = 1099511627776.0; end++; break;
    default: break;
    }
    if (*end == 'i' && m > 1) end++;
    if (*end == 'B') end++;
    return *end ? 0 : (uint64_t)(v * m);
}

int mf_opt_word_value(const mf_opt_word *words, const char *word)
{
    for (int i = 0; words[i].word; i++)
        if (!strcmp(words[i].word, word)) return words[i].value;
    return -1;
}

const char *mf_opt_word_name(const mf_opt_word *words, int value)
{
    for (int i = 0; words[i].word; i++)
        if (words[i].value == value) return words[i].word;
    return "?";
}

const char *mf_opt_words_list(const mf_opt_word *words, char *buf, size_t cap)
{
    size_t k = 0;
    int n = 0;
    while (words[n].word) n++;
    buf[0] = 0;
    for (int i = 0; i < n && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, "%s%s", i == 0 ? "" : i == n - 1 ? " or " : ", ", words[i].word);
    return buf;
}

/* ---- reading one argument -------------------------------------------------------------------- */

static int mf_opt_long(const mf_opt *o, const char *a, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(a, &end, 10);
    if (errno || *end || !*a || v < o->lo || v > o->hi || ((o->flags & MF_OPT_NOT0) && v == 0)) {
        if (o->expect) return mf_error(-EINVAL, "%s: expected %s, found '%s'", o->flag, o->expect, a);
        return mf_error(-EINVAL, "%s: expected %.0f..%.0f%s, found '%s'", o->flag, o->lo, o->hi,
                        o->flags & MF_OPT_NOT0 ? " (not 0)" : "", a);
    }
    *out = v;
    return 0;
}

static int mf_opt_double(const mf_opt *o, const char *a, double *out)
{
    char *end;
    double v = strtod(a, &end);
    int low_ok = o->flags & MF_OPT_LO_OPEN ? v > o->lo : v >= o->lo;
    if (*end || !*a || !low_ok || !(v <= o->hi))
        return mf_error(-EINVAL, "%s: expected a number in %c%g, %g], found '%s'", o->flag,
                        o->flags & MF_OPT_LO_OPEN ? '(' : '[', o->lo, o->hi, a);
    *out = v;
    return 0;
}

/* Turns argument a of option o into its field; 0 or a negative code with mf_error. */
static int mf_opt_set(const mf_opt *o, const char *a, void *field)
{
    char buf[256];
    switch (o->kind) {
    case MF_OPT_FLAG:
        *(int *)field = 1;
        return 0;
    case MF_OPT_STR:
        *(const char **)field = a;
        return 0;
    case MF_OPT_LONG:
        return mf_opt_long(o, a, field);
    case MF_OPT_ULL: {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(a, &end, 0);
        if (errno || *end || !*a) return mf_error(-EINVAL, "%s: expected a non-negative integer, found '%s'", o->flag, a);
        *(unsigned long long *)field = v;
        return 0;
    }
    case MF_OPT_DOUBLE:
        return mf_opt_double(o, a, field);
    case MF_OPT_SIZE: {
        uint64_t v = mf_tool_size(a);
        if (!v) return mf_error(-EINVAL, "%s: expected a size such as 2G or 512M, found '%s'", o->flag, a);
        *(uint64_t *)field = v;
        return 0;
    }
    case MF_OPT_WORD: {
        int v = mf_opt_word_value(o->words, a);
        if (v < 0)
            return mf_error(-EINVAL, "%s: expected %s, found '%s'", o->flag, mf_opt_words_list(o->words, buf, sizeof buf), a);
        *(int *)field = v;
        return 0;
    }
    case MF_OPT_FN:
        return o->fn(o, a, field);
    case MF_OPT_GROUP:
        break;
    }
    return mf_error(-EINVAL, "%s: an option of no known kind", o->flag);
}

/* ---- help ------------------------------------------------------------------------------------ */

static void mf_opt_help_row(const mf_opt *o, int col, FILE *f)
{
    char left[160];
    int n = snprintf(left, sizeof left, "  %s%s%s%s%s", o->flag, o->alias ? ", " : "", o->alias ? o->alias : "",
                     o->meta ? " " : "", o->meta ? o->meta : "");
    fputs(left, f);
    fprintf(f, "%*s", n < col - 1 ? col - n : 2, "");
    for (const char *p = o->help ? o->help : ""; *p; p++) {
        fputc(*p, f);
        if (*p == '\n') fprintf(f, "%*s", col, "");
    }
    if (o->help_more) fputs(o->help_more(), f);
    if (o->def) fprintf(f, " (default %s)", o->def);
    fputc('\n', f);
}

static void mf_opt_help_rows(const mf_opt *rows, int col, FILE *f)
{
    for (const mf_opt *o = rows; o->flag; o++) {
        if (o->kind == MF_OPT_GROUP) mf_opt_help_rows(o->group, col, f);
        else mf_opt_help_row(o, col, f);
    }
}

void mf_opts_help(const mf_opts_spec *s, FILE *f)
{
    int col = s->col ? s->col : 22;
    fputs(s->usage, f);
    mf_opt_help_rows(s->opts, col, f);
    mf_opt_help_row(&(mf_opt){.flag = "--help", .alias = "-h", .help = "this help"}, col, f);
    if (s->tail) fputs(s->tail, f);
}

int mf_opts_refuse(const mf_opts_spec *s, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "moeflow %s: ", s->cmd);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputs("\n\n", stderr);
    mf_opts_help(s, stderr);
    return 2;
}

/* ---- the test modes -------------------------------------------------------------------------- */

static const char *const mf_opt_kind_names[] = {"flag", "str", "long", "ull", "double", "size", "word", "fn", "group"};

/* An argument option o accepts (its default where it has one). */
static const char *mf_opt_example(const mf_opt *o, char *buf, size_t cap)
{
    if (o->def) return o->def;
    switch (o->kind) {
    case MF_OPT_FLAG: return "-";
    case MF_OPT_STR: return "x";
    case MF_OPT_LONG:
        snprintf(buf, cap, "%.0f", (o->flags & MF_OPT_NOT0) && o->lo == 0 ? 1 : o->lo);
        return buf;
    case MF_OPT_ULL: return "0";
    case MF_OPT_DOUBLE:
        snprintf(buf, cap, "%g", o->hi);
        return buf;
    case MF_OPT_SIZE: return "1M";
    case MF_OPT_WORD: return o->words[0].word;
    case MF_OPT_FN: return o->example ? o->example : "?";
    case MF_OPT_GROUP: return "-";
    }
    return "?";
}

static void mf_opts_table_rows(const mf_opt *rows)
{
    char buf[64];
    for (const mf_opt *o = rows; o->flag; o++) {
        if (o->kind == MF_OPT_GROUP) mf_opts_table_rows(o->group);
        else
            printf("%s\t%s\t%s\t%s\n", o->flag, o->alias ? o->alias : "-", mf_opt_kind_names[o->kind],
                   mf_opt_example(o, buf, sizeof buf));
    }
}

static void mf_opts_table(const mf_opts_spec *s)
{
    mf_opts_table_rows(s->opts);
    if (s->pos_meta) printf("%s\t-\tpositional\tx\n", s->pos_meta);
}

/* ---- the parser ------------------------------------------------------------------------------ */

/* The row of flag a in rows (groups included) and the offset its field is relative to. */
static const mf_opt *mf_opt_find(const mf_opt *rows, const char *a, size_t *base)
{
    for (const mf_opt *o = rows; o->flag; o++) {
        if (o->kind == MF_OPT_GROUP) {
            size_t b = 0;
            const mf_opt *r = mf_opt_find(o->group, a, &b);
            if (r) {
                *base += o->off + b;
                return r;
            }
        } else if (!strcmp(a, o->flag) || (o->alias && !strcmp(a, o->alias))) {
            return o;
        }
    }
    return NULL;
}

/* The defaults of rows (groups included) into the struct at o. 0, or the failing row. */
static const mf_opt *mf_opt_defaults(const mf_opt *rows, char *o)
{
    for (const mf_opt *r = rows; r->flag; r++) {
        const mf_opt *bad = r->kind == MF_OPT_GROUP ? mf_opt_defaults(r->group, o + r->off)
                            : r->def && mf_opt_set(r, r->def, o + r->off) ? r : NULL;
        if (bad) return bad;
    }
    return NULL;
}

int mf_opts_parse(const mf_opts_spec *s, int argc, char **argv, void *o)
{
    if (mf_opts_mode == MF_OPTS_MODE_TABLE) {
        mf_opts_table(s);
        return 0;
    }
    if (mf_opts_mode == MF_OPTS_MODE_UNKNOWN) {
        int n_unknown = 0;
        for (int i = 1; i < argc; i++) {
            size_t base = 0;
            if (argv[i][0] == '-' && argv[i][1] && !mf_opt_find(s->opts, argv[i], &base)) {
                printf("unknown option '%s'\n", argv[i]);
                n_unknown++;
            }
        }
        return n_unknown ? 2 : 0;
    }
    const mf_opt *bad = mf_opt_defaults(s->opts, o);
    if (bad) {
        fprintf(stderr, "moeflow %s: the default of %s: %s\n", s->cmd, bad->flag, mf_last_error());
        return 2;
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            mf_opts_help(s, stdout);
            return 0;
        }
        size_t base = 0;
        const mf_opt *r = mf_opt_find(s->opts, a, &base);
        if (!r) {
            const char **pos = s->pos_meta ? (const char **)((char *)o + s->pos_off) : NULL;
            if (a[0] == '-' && a[1]) return mf_opts_refuse(s, "unknown option '%s'", a);
            if (!pos || *pos) return mf_opts_refuse(s, "unexpected argument '%s'", a);
            *pos = a;
            continue;
        }
        if (r->kind != MF_OPT_FLAG && i + 1 >= argc)
            return mf_opts_refuse(s, "%s needs an argument (%s)", a, r->meta ? r->meta : "a value");
        if (mf_opt_set(r, r->kind == MF_OPT_FLAG ? NULL : argv[++i], (char *)o + base + r->off)) {
            fprintf(stderr, "moeflow %s: %s\n", s->cmd, mf_last_error());
            return 2;
        }
    }
    return mf_opts_mode == MF_OPTS_MODE_CHECK ? 0 : MF_OPTS_RUN;
}
