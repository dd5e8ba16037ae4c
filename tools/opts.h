/* The commands' options (shared/style.md): each command describes every option once, as a row of
 * {flag, kind, field, default, help} in one table; mf_opts_parse walks argv against that table and
 * `--help` is printed from it (mf_opts_help), so what a command accepts and what its help says
 * cannot drift apart. tests/test_cli.c checks every command's help against its parser.
 *
 * The parser is a small table walker, not getopt_long: options are matched whole, as written
 * ("--threads 4": no abbreviations, no "--threads=4", no bundled short options), in any order, a
 * later one replacing an earlier one (an MF_OPT_FN row may accumulate instead: calibrate's
 * --note); every argument is an option of the table or, where the command takes one, its
 * positional argument. getopt_long would add abbreviations, argument permutation and messages of
 * its own, which would change what the commands accept and say. */
#ifndef MF_TOOLS_OPTS_H
#define MF_TOOLS_OPTS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* "2G", "512M", "64k", "1.5GiB", "4GB", plain bytes; 1024-based (K, M, G, T in either case, then an
 * optional "i" and "B"). 0 for anything else (or zero). The one size parser of every command. */
uint64_t mf_tool_size(const char *s);

typedef enum mf_opt_kind {
    MF_OPT_FLAG,     /* no argument: the int field becomes 1 */
    MF_OPT_STR,      /* const char *: the argument as given */
    MF_OPT_LONG,     /* long: a whole decimal number in [lo, hi] (with MF_OPT_NOT0: and not 0) */
    MF_OPT_ULL,      /* unsigned long long: strtoull, base 0 (seeds: "0x10" too) */
    MF_OPT_DOUBLE,   /* double in [lo, hi] ((lo, hi] with MF_OPT_LO_OPEN) */
    MF_OPT_SIZE,     /* uint64_t bytes: mf_tool_size, not 0 */
    MF_OPT_WORD,     /* int: the value of one of the row's words */
    MF_OPT_FN,       /* the row's fn turns the argument into the field */
    MF_OPT_GROUP,    /* not an option: the rows of another table (.group), whose fields lie in the
                      * struct at .off of this command's (MF_OPT_GROUP_ROW); a group of options
                      * several commands share, written, parsed and documented once */
} mf_opt_kind;

#define MF_OPT_NOT0 1u      /* MF_OPT_LONG: 0 is refused */
#define MF_OPT_LO_OPEN 2u   /* MF_OPT_DOUBLE: lo itself is refused */

/* A word an MF_OPT_WORD option accepts and the value it stands for; a list ends with {NULL}. */
typedef struct mf_opt_word {
    const char *word;
    int value;
} mf_opt_word;

/* The value of `word` in the list, or -1. */
int mf_opt_word_value(const mf_opt_word *words, const char *word);
/* The word of `value` in the list, or "?". */
const char *mf_opt_word_name(const mf_opt_word *words, int value);
/* "a, b or c" into buf (what a refusal says was expected). */
const char *mf_opt_words_list(const mf_opt_word *words, char *buf, size_t cap);

typedef struct mf_opt mf_opt;

/* One option: a row of a command's table (ended by a row with flag NULL). */
struct mf_opt {
    const char *flag;          /* "--threads" */
    const char *alias;         /* another spelling ("-q"), or NULL */
    mf_opt_kind kind;
    size_t off;                /* the field: offsetof(the command's options struct, field) */
    const char *def;           /* the default in the argument's syntax: applied before argv is read
                                * and shown in --help as "(default X)"; NULL: the field keeps the
                                * value the command gave it, which the help line describes */
    const char *meta;          /* the argument's name in --help ("N", "FILE"); NULL for a flag */
    const char *help;          /* what it does; "\n" starts a new line of help */
    double lo, hi;             /* MF_OPT_LONG, MF_OPT_DOUBLE: the accepted range */
    unsigned flags;            /* MF_OPT_NOT0, MF_OPT_LO_OPEN */
    const char *expect;        /* MF_OPT_LONG: what a refusal says was expected, instead of "LO..HI" */
    const mf_opt_word *words;  /* MF_OPT_WORD */
    /* MF_OPT_FN: 0, or a negative code with mf_error naming the option, what it expected and found */
    int (*fn)(const mf_opt *o, const char *arg, void *field);
    int arg;                   /* MF_OPT_FN: a number of the command's own (tune: which knob) */
    const char *example;       /* MF_OPT_FN: an argument it accepts (MOEFLOW_OPTS=table) */
    const char *(*help_more)(void);   /* appended to help (gen --preset: the library's presets) */
    const mf_opt *group;       /* MF_OPT_GROUP: the shared table */
};

/* A row that includes the shared table `tab` (its fields in the struct at offset `off` of the
 * command's options struct) where it stands: its options are parsed and their help printed there. */
#define MF_OPT_GROUP_ROW(tab, off_) {"", .kind = MF_OPT_GROUP, .off = (off_), .group = (tab)}

/* A command: its name in messages, its help around the table, its positional argument. */
typedef struct mf_opts_spec {
    const char *cmd;           /* "decode", "bench io": messages begin "moeflow <cmd>: " */
    const char *usage;         /* the usage lines and what the command does: --help's start */
    const mf_opt *opts;
    const char *tail;          /* printed after the option list, or NULL */
    const char *pos_meta;      /* the one positional argument's name ("DIR"), or NULL: none */
    size_t pos_off;            /* its field (const char *) */
    int col;                   /* the column help text starts at (0: 22) */
} mf_opts_spec;

/* mf_opts_parse's answer when the command is to run (any other answer is its exit code). */
#define MF_OPTS_RUN (-1)

/* Applies the table's defaults to the options struct `o` (whose other fields the command has set),
 * then reads argv[1..argc): --help or -h prints the help on stdout and answers 0; an unknown
 * option, a missing argument or a refused one prints why on stderr (with the help after an
 * unknown option) and answers 2; else MF_OPTS_RUN. With the test modes below it answers 0 (check,
 * table) or 2 (refused) and the command does not run. */
int mf_opts_parse(const mf_opts_spec *s, int argc, char **argv, void *o);

/* The help: usage, one entry per option (flag, alias, argument, help, default), --help, tail. */
void mf_opts_help(const mf_opts_spec *s, FILE *f);

/* A command line the command refuses as a whole (a required option missing): "moeflow <cmd>: "
 * and the message, a blank line and the help, on stderr; answers 2, the exit code. */
int mf_opts_refuse(const mf_opts_spec *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Test modes (MOEFLOW_OPTS, read by tools/moeflow.c): MF_OPTS_MODE_CHECK parses and answers
 * without running the command; MF_OPTS_MODE_TABLE prints the table instead, one option per line:
 * flag, alias or "-", kind, an argument it accepts or "-" (tab-separated); MF_OPTS_MODE_UNKNOWN
 * looks every argument up in the table and prints "unknown option 'X'" on stdout for each one that
 * starts with '-' and is not there, answering 2 if there was one, else 0 (tests/test_cli.c tries
 * every other command's flags on a command in one run). */
enum { MF_OPTS_MODE_RUN, MF_OPTS_MODE_CHECK, MF_OPTS_MODE_TABLE, MF_OPTS_MODE_UNKNOWN };
extern int mf_opts_mode;

/* A macro's value as a string literal, for help text: MF_OPTS_STR(MF_STEP_PREFILL_CHUNK) "512". */
#define MF_OPTS_STR_(x) #x
#define MF_OPTS_STR(x) MF_OPTS_STR_(x)

#endif
