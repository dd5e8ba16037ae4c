/* `moeflow`: one command with subcommands over libmoeflow. Only subcommands that exist are listed;
 * each one's --help says what it does. The environment is read here (and by tools/ for
 * MOEFLOW_DEV_GRAPHS), never in the library: MOEFLOW_SIMD=scalar|avx2|auto picks the CPU kernels'
 * path (host/kernels.h, default auto), MOEFLOW_IO and MOEFLOW_IO_FAULT the IO lanes' engine and
 * fault injection, MOEFLOW_OPTS the option parser's test modes (mf_env_apply, tools/opts.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "host/kernels.h"
#include "sched/error.h"
#include "sched/sched.h"
#include "tools/commands.h"
#include "tools/opts.h"

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *what;
} mf_commands[] = {
    {"gen", mf_cmd_gen, "write a synthetic checkpoint with the real layout (tiny, demo, flash41)"},
    {"decode", mf_cmd_decode, "decode text: the scheduled engine (host or cards), or --engine reference"},
#ifdef MOEFLOW_SERVE
    {"serve", mf_cmd_serve, "an OpenAI-compatible HTTP API (completions, chat, SSE) over continuous batching"},
#endif
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
    fprintf(f, "\nenvironment (read here and turned into options; the library reads none):\n"
               "  MOEFLOW_SIMD        scalar, avx2 or auto (default): the CPU kernels' path (now: %s);\n"
               "                      avx2 also keeps the one-token FP8 and FP4 loops off AVX-512\n"
               "  MOEFLOW_IO          pread: IO lanes use pread workers instead of io_uring\n"
               "  MOEFLOW_IO_FAULT    eio:N or short:N: the Nth IO-lane read fails (fault injection)\n"
               "  MOEFLOW_DEV_GRAPHS  1: as --dev-graphs (decode, sim)\n"
               "  MOEFLOW_OPTS        check: a command parses its options and exits (0 accepted, 2 refused)\n"
               "                      without running; table: it prints its option table; unknown: it names\n"
               "                      each argument not in its table (tests/test_cli.c)\n",
            mf_kern_simd_name(mf_kern_simd_active()));
}

/* MOEFLOW_SIMD into mf_kern_simd_set: 0, or 2 (usage) for a value the CPU or the list refuses. */
static int mf_env_simd(void)
{
    const char *env = getenv("MOEFLOW_SIMD");
    if (!env || !*env) return 0;
    mf_kern_simd s = !strcmp(env, "scalar") ? MF_KERN_SIMD_SCALAR
                   : !strcmp(env, "avx2")   ? MF_KERN_SIMD_AVX2
                   : !strcmp(env, "auto")   ? MF_KERN_SIMD_AUTO
                                            : (mf_kern_simd)-1;
    if ((int)s < 0) {
        fprintf(stderr, "moeflow: MOEFLOW_SIMD=%s: expected scalar, avx2 or auto\n", env);
        return 2;
    }
    if (mf_kern_simd_set(s)) {
        fprintf(stderr, "moeflow: MOEFLOW_SIMD=%s: %s\n", env, mf_last_error());
        return 2;
    }
    /* avx2 means no 512-bit loops either (what a CPU without AVX-512 runs); auto as the CPU allows */
    mf_kern_tok1_set_avx512(s == MF_KERN_SIMD_AVX2 ? 0 : -1);
    return 0;
}

int mf_tool_env_on(const char *name)
{
    const char *v = getenv(name);
    return v && !strcmp(v, "1");
}

mf_tool_io mf_tool_io_env;

int mf_tool_sockets_of(const char *arg, mf_tool_sockets *out)
{
    const char *topo = getenv("MOEFLOW_TOPOLOGY");
    *out = (mf_tool_sockets){.n = 1, .node = {-1, -1, -1, -1, -1, -1, -1, -1},
                             .topology = topo && *topo ? topo : NULL};
    mf_topo_sockets ts;
    int rc = mf_topo_sockets_of(out->topology, &ts);
    if (rc) return mf_error_wrap(rc, "--sockets");
    char *end;
    long n = strtol(arg, &end, 10);
    if (!strcmp(arg, "auto")) n = ts.n;
    else if (*end || !*arg || n < 1 || n > MF_TOPO_MAX_SOCKETS)
        return mf_error(-EINVAL, "--sockets: expected auto or 1..%d, found '%s'", MF_TOPO_MAX_SOCKETS, arg);
    if (n > ts.n)
        return mf_error(-EINVAL, "--sockets %ld: the topology (%s) has %d socket(s) (NUMA nodes with cores)", n,
                        out->topology ? out->topology : "this machine", ts.n);
    out->n = (int)n;
    for (int k = 0; k < out->n; k++) out->node[k] = ts.node[k];
    return 0;
}

int mf_tool_sockets_opt(const mf_opt *o, const char *arg, void *field)
{
    (void)o;
    return mf_tool_sockets_of(arg, field);
}

/* The environment variables the moeflow command honours, turned into options before any
 * subcommand runs (the library reads none): MOEFLOW_IO=pread makes the IO lanes of the executors
 * a command makes use pread workers, MOEFLOW_IO_FAULT=eio:N|short:N makes the Nth read of an IO
 * lane fail (mf_tool_io_env, commands.h; docs/io.md), MOEFLOW_OPTS=check|table puts the option
 * parser in a test mode (mf_opts_mode, tools/opts.h). Values it does not understand are reported
 * and ignored. */
static void mf_env_apply(void)
{
    const char *e = getenv("MOEFLOW_IO");
    if (e && *e) {
        if (!strcmp(e, "pread")) mf_tool_io_env.force_pread = 1;
        else fprintf(stderr, "moeflow: MOEFLOW_IO='%s' ignored (expected pread)\n", e);
    }
    e = getenv("MOEFLOW_IO_FAULT");
    if (e && *e) {
        long long n = 0;
        if (!strncmp(e, "eio:", 4) && (n = atoll(e + 4)) > 0)
            mf_tool_io_env = (mf_tool_io){mf_tool_io_env.force_pread, MF_IO_FAULT_EIO, n};
        else if (!strncmp(e, "short:", 6) && (n = atoll(e + 6)) > 0)
            mf_tool_io_env = (mf_tool_io){mf_tool_io_env.force_pread, MF_IO_FAULT_SHORT, n};
        else fprintf(stderr, "moeflow: MOEFLOW_IO_FAULT='%s' ignored (expected eio:N or short:N)\n", e);
    }
    e = getenv("MOEFLOW_OPTS");
    if (e && *e) {
        if (!strcmp(e, "check")) mf_opts_mode = MF_OPTS_MODE_CHECK;
        else if (!strcmp(e, "table")) mf_opts_mode = MF_OPTS_MODE_TABLE;
        else if (!strcmp(e, "unknown")) mf_opts_mode = MF_OPTS_MODE_UNKNOWN;
        else fprintf(stderr, "moeflow: MOEFLOW_OPTS='%s' ignored (expected check, table or unknown)\n", e);
    }
}

int main(int argc, char **argv)
{
    if (mf_env_simd()) return 2;
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
