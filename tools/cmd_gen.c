/* `moeflow gen`: writes a synthetic checkpoint with the real DeepSeek-V4.1 layout from a preset
 * (tiny, demo, flash41 as sparse layout-only files). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/model/config.h"
#include "graphs/gen/gen.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "tools/commands.h"

static void mf_gen_usage(FILE *f)
{
    fprintf(f,
            "usage: moeflow gen --preset NAME --out DIR [--seed N] [--shards N] [--sparse]\n"
            "                   [--force] [--quiet]\n\n"
            "Writes config.json, safetensors shards and model.safetensors.index.json with the\n"
            "released DeepSeek-V4.1 names, dtypes, shapes and quantization, filled with\n"
            "deterministic random values (same seed, same bytes), and (except --sparse) a\n"
            "byte-level BPE tokenizer.json sized to the vocabulary, whose Engram token map\n"
            "sets engram_compressed_vocab_size in config.json.\n\n"
            "  --preset NAME  %s\n"
            "                 (flash41: the full released layout, 48 sparse shards, headers only)\n"
            "  --out DIR      output directory (refused when not empty, unless --force)\n"
            "  --seed N       random seed (default 0)\n"
            "  --shards N     number of shards (default: tiny 2, demo 4, flash41 48)\n"
            "  --sparse       leave tensor data as holes (layout only)\n"
            "  --force        write into a non-empty DIR, replacing checkpoint files there\n"
            "  --quiet        no progress on stderr\n",
            mf_config_preset_names());
}

int mf_cmd_gen(int argc, char **argv)
{
    const char *preset = NULL, *out = NULL;
    unsigned long long seed = 0;
    int shards = 0, sparse = 0, force = 0, quiet = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has_val = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            mf_gen_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--preset") && has_val) {
            preset = argv[++i];
        } else if (!strcmp(a, "--out") && has_val) {
            out = argv[++i];
        } else if (!strcmp(a, "--seed") && has_val) {
            char *end;
            errno = 0;
            seed = strtoull(argv[++i], &end, 0);
            if (errno || *end || !*argv[i]) {
                fprintf(stderr, "moeflow gen: --seed: expected a non-negative integer, found '%s'\n",
                        argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--shards") && has_val) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 1 || v > 100000) {
                fprintf(stderr, "moeflow gen: --shards: expected 1..100000, found '%s'\n", argv[i]);
                return 2;
            }
            shards = (int)v;
        } else if (!strcmp(a, "--sparse")) {
            sparse = 1;
        } else if (!strcmp(a, "--force")) {
            force = 1;
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            quiet = 1;
        } else {
            fprintf(stderr, "moeflow gen: unknown or incomplete option '%s'\n\n", a);
            mf_gen_usage(stderr);
            return 2;
        }
    }
    if (!preset || !out) {
        fprintf(stderr, "moeflow gen: --preset and --out are required\n\n");
        mf_gen_usage(stderr);
        return 2;
    }
    mf_config c;
    mf_gen_opts o;
    if (mf_config_preset(preset, &c) || mf_gen_preset_opts(preset, &o)) {
        fprintf(stderr, "moeflow gen: %s\n", mf_last_error());
        return 2;
    }
    o.seed = seed;
    o.force = force;
    o.quiet = quiet;
    if (shards) o.n_shards = shards;
    if (sparse) o.sparse = 1;
    int64_t t0 = mf_now_ns();
    int rc = mf_gen_write(&c, out, &o);
    if (rc) {
        fprintf(stderr, "moeflow gen: %s\n", mf_last_error());
        return 1;
    }
    if (!quiet)
        fprintf(stderr, "moeflow gen: wrote preset %s (seed %llu, %d shards%s) to %s in %.2f s\n",
                preset, seed, o.n_shards, o.sparse ? ", sparse" : "", out,
                (mf_now_ns() - t0) / 1e9);
    return 0;
}
