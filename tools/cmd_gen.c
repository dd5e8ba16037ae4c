/* `moeflow gen`: writes a synthetic checkpoint with the real DeepSeek-V4.1 layout from a preset
 * (tiny, demo, flash41 as sparse layout-only files). */
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/model/config.h"
#include "graphs/gen/gen.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "tools/commands.h"

/* The command line of `moeflow gen`. */
typedef struct mf_gen_cli {
    const char *preset, *out;
    unsigned long long seed;
    long shards;   /* 0: the preset's */
    int sparse, force, quiet;
} mf_gen_cli;

#define F(x) offsetof(mf_gen_cli, x)
static const mf_opt mf_gen_table[] = {
    {"--preset", .kind = MF_OPT_STR, .off = F(preset), .meta = "NAME", .help = "one of: ",
     .help_more = mf_config_preset_names},
    {"--out", .kind = MF_OPT_STR, .off = F(out), .meta = "DIR",
     .help = "output directory (refused when not empty, unless --force)"},
    {"--seed", .kind = MF_OPT_ULL, .off = F(seed), .def = "0", .meta = "N", .help = "random seed"},
    {"--shards", .kind = MF_OPT_LONG, .off = F(shards), .meta = "N", .lo = 1, .hi = 100000,
     .help = "number of shards (default: tiny 2, demo 4, flash41 48)"},
    {"--sparse", .kind = MF_OPT_FLAG, .off = F(sparse), .help = "leave tensor data as holes (layout only)"},
    {"--force", .kind = MF_OPT_FLAG, .off = F(force),
     .help = "write into a non-empty DIR, replacing checkpoint files there"},
    {"--quiet", "-q", MF_OPT_FLAG, F(quiet), .help = "no progress on stderr"},
    {NULL},
};
#undef F

static const mf_opts_spec mf_gen_spec = {
    .cmd = "gen",
    .usage = "usage: moeflow gen --preset NAME --out DIR [--seed N] [--shards N] [--sparse]\n"
             "                   [--force] [--quiet]\n\n"
             "Writes config.json, safetensors shards and model.safetensors.index.json with the\n"
             "released DeepSeek-V4.1 names, dtypes, shapes and quantization, filled with\n"
             "deterministic random values (same seed, same bytes), and (except --sparse) a\n"
             "byte-level BPE tokenizer.json sized to the vocabulary, whose Engram token map\n"
             "sets engram_compressed_vocab_size in config.json. flash41 is the full released\n"
             "layout: 48 sparse shards, headers only.\n\n",
    .opts = mf_gen_table,
    .col = 17,
};

int mf_cmd_gen(int argc, char **argv)
{
    mf_gen_cli a = {0};
    int rc = mf_opts_parse(&mf_gen_spec, argc, argv, &a);
    if (rc != MF_OPTS_RUN) return rc;
    if (!a.preset || !a.out) return mf_opts_refuse(&mf_gen_spec, "--preset and --out are required");
    mf_config c;
    mf_gen_opts o;
    if (mf_config_preset(a.preset, &c) || mf_gen_preset_opts(a.preset, &o)) {
        fprintf(stderr, "moeflow gen: %s\n", mf_last_error());
        return 2;
    }
    o.seed = a.seed;
    o.force = a.force;
    o.quiet = a.quiet;
    if (a.shards) o.n_shards = (int)a.shards;
    if (a.sparse) o.sparse = 1;
    int64_t t0 = mf_now_ns();
    if (mf_gen_write(&c, a.out, &o)) {
        fprintf(stderr, "moeflow gen: %s\n", mf_last_error());
        return 1;
    }
    if (!a.quiet)
        fprintf(stderr, "moeflow gen: wrote preset %s (seed %llu, %d shards%s) to %s in %.2f s\n", a.preset, a.seed,
                o.n_shards, o.sparse ? ", sparse" : "", a.out, (mf_now_ns() - t0) / 1e9);
    return 0;
}
