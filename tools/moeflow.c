/* `moeflow`: one command with subcommands over libmoeflow. Only subcommands that exist are listed;
 * each one's --help says what it does. */
#include <stdio.h>
#include <string.h>

#include "tools/commands.h"

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *what;
} mf_commands[] = {
    {"gen", mf_cmd_gen, "write a synthetic checkpoint with the real layout (tiny, demo, flash41)"},
    {"decode", mf_cmd_decode, "decode text: the scheduled engine (host or cards), or --engine reference"},
    {"serve", mf_cmd_serve, "an OpenAI-compatible HTTP API (completions, chat, SSE) over continuous batching"},
    {"info", mf_cmd_info, "byte census of a checkpoint by group, config summary and layout check"},
    {"sim", mf_cmd_sim, "simulate decode steps on a hardware profile (--measure: against a real run)"},
    {"tune", mf_cmd_tune, "sweep strategy knobs in simulation (or --real) and rank the settings"},
    {"calibrate", mf_cmd_calibrate, "measure this machine into a hardware profile (docs/profiles.md)"},
    {"bench", mf_cmd_bench, "benchmarks against a baseline in the same run: sched, kernels, io, decode, dev"},
    {NULL, NULL, NULL},
};

static void mf_usage(FILE *f)
{
    fprintf(f, "usage: moeflow <command> [options]   (moeflow <command> --help for each)\n\n");
    for (size_t i = 0; mf_commands[i].name; i++)
        fprintf(f, "  %-10s %s\n", mf_commands[i].name, mf_commands[i].what);
}

int main(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        mf_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; mf_commands[i].name; i++)
        if (!strcmp(argv[1], mf_commands[i].name)) return mf_commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "moeflow: unknown command '%s'\n\n", argv[1]);
    mf_usage(stderr);
    return 2;
}
