/* The prefix cache's options and reports shared by the commands that run the batcher (`moeflow
 * decode`, `serve`, `bench serve`): the option rows, opening the cache over a model (its default
 * budget, the disk tier's key), the summary line and /metrics' lines. graphs/prefix/prefix.h,
 * docs/prefix.md. */
#ifndef MF_TOOLS_TOOL_PREFIX_H
#define MF_TOOLS_TOOL_PREFIX_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "graphs/prefix/prefix.h"
#include "tools/opts.h"

/* The default budget: this fraction of the memory available (/proc/meminfo MemAvailable) once the
 * model and the engine are loaded. */
#define MF_TOOL_PREFIX_FRACTION 4   /* a quarter */

typedef struct mf_tool_prefix {
    const char *size;    /* --prefix-cache: SIZE, or 0 (off); NULL: the default */
    const char *dir;     /* --prefix-cache-dir */
    uint64_t disk;       /* --prefix-cache-disk (0: 4 x the memory budget) */
    long block;          /* --prefix-block (0: MF_PREFIX_BLOCK) */
} mf_tool_prefix;

/* The option rows of a command whose options struct has an mf_tool_prefix at `field`, F its offsetof
 * macro (F(x) = offsetof(cli, x)). */
#define MF_TOOL_PREFIX_OPTS(F, field)                                                                          \
    {"--prefix-cache", .kind = MF_OPT_FN, .off = F(field.size), .meta = "SIZE", .fn = mf_tool_prefix_size_opt,  \
     .example = "64M",                                                                                          \
     .help = "host memory for the prefix cache (a repeated prompt prefix is computed\n"                         \
             "once: docs/prefix.md); 0 turns it off (default: a quarter of the\n"                               \
             "memory available once the model is loaded)"},                                                    \
        {"--prefix-cache-dir", .kind = MF_OPT_STR, .off = F(field.dir), .meta = "DIR",                          \
         .help = "keep the prefix cache's blocks on disk in DIR too (io_uring,\n"                               \
                 "O_DIRECT where allowed): a restart keeps its cache"},                                         \
        {"--prefix-cache-disk", .kind = MF_OPT_SIZE, .off = F(field.disk), .meta = "SIZE",                      \
         .help = "bytes the disk tier keeps (default 4 x --prefix-cache)"},                                     \
        {"--prefix-block", .kind = MF_OPT_LONG, .off = F(field.block), .meta = "N", .lo = 1, .hi = 256,         \
         .expect = "1, 2, 4, .. 256", .help = "tokens per cached block (default " MF_OPTS_STR(MF_PREFIX_BLOCK) ")"}

/* Under a pipeline (--ranks-layers) the cache is off: a sequence's states are split over the ranks
 * and the cache holds one process's. Turns it off there, refusing an explicit --prefix-cache SIZE
 * or --prefix-cache-dir. 0, or 2 with the reason on stderr ("moeflow <cmd>: ..."). */
int mf_tool_prefix_check(const char *cmd, mf_tool_prefix *o, int pipeline);
/* --prefix-cache's parser: a size or 0. */
int mf_tool_prefix_size_opt(const mf_opt *o, const char *arg, void *field);

/* The cache over r for the options (NULL in *out when off), with `numerics` the forward's name for
 * the disk tier's key (mf_prefix_key). One line on stderr unless quiet ("<who>: prefix cache ...").
 * 0 or a negative code. */
int mf_tool_prefix_open(const mf_tool_prefix *o, const mf_ref *r, const char *numerics, const char *who, int quiet,
                        mf_prefix **out);
/* "scheduled-int8", "scheduled-fp32", "reference" (+ "-cuda" with CUDA cards: not the host's bits). */
const char *mf_tool_prefix_numerics(int sched, int exact, const char *devices);
/* The cache's summary line (hits, memory, disk) on f. */
void mf_tool_prefix_report(const mf_prefix *p, const char *who, FILE *f);
/* /metrics' lines of the cache (Prometheus text) into buf; their length (< cap). */
size_t mf_tool_prefix_metrics(const mf_prefix *p, char *buf, size_t cap);

#endif
