/* `moeflow`: one command with subcommands over libmoeflow. Only subcommands that exist are listed;
 * each one's --help says what it does. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/sched.h"
#include "tools/commands.h"

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *what;
} mf_commands[] = {
    {"gen", mf_cmd_gen, "write a synthetic checkpoint with the real layout (tiny, demo, flash41)"},
    {"decode", mf_cmd_decode, "decode text: the scheduled engine (host or cards), or --engine reference"},
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

/* The environment variables the moeflow command honours, turned into library settings before any
 * subcommand runs (the library reads none): MOEFLOW_IO=pread makes every IO lane use pread workers
 * (mf_sched_io_defaults), MOEFLOW_IO_FAULT=eio:N|short:N makes the Nth IO-lane read fail
 * (mf_io_fault_inject; docs/io.md). Values it does not understand are reported and ignored. */
static void mf_env_apply(void)
{
    const char *e = getenv("MOEFLOW_IO");
    if (e && *e) {
        if (!strcmp(e, "pread")) mf_sched_io_defaults(1);
        else fprintf(stderr, "moeflow: MOEFLOW_IO='%s' ignored (expected pread)\n", e);
    }
    e = getenv("MOEFLOW_IO_FAULT");
    if (e && *e) {
        long long n = 0;
        if (!strncmp(e, "eio:", 4) && (n = atoll(e + 4)) > 0) mf_io_fault_inject(MF_IO_FAULT_EIO, n);
        else if (!strncmp(e, "short:", 6) && (n = atoll(e + 6)) > 0) mf_io_fault_inject(MF_IO_FAULT_SHORT, n);
        else fprintf(stderr, "moeflow: MOEFLOW_IO_FAULT='%s' ignored (expected eio:N or short:N)\n", e);
    }
}

int main(int argc, char **argv)
{
    mf_env_apply();
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
