/* `moeflow calibrate`: measures this machine (graphs/calib/hwcal.h) and prints the hardware profile it
 * makes (sched/profile.h), writing it with --out; the simulator (`moeflow sim --profile`) reads
 * it. docs/profiles.md describes the format and how each figure is measured. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "graphs/calib/hwcal.h"
#include "sched/error.h"
#include "sched/profile.h"
#include "tools/commands.h"

static void mf_calibrate_usage(FILE *f)
{
    fprintf(f,
            "usage: moeflow calibrate [--out FILE] [--json] [--dir DIR] [--devices SPEC]\n"
            "                         [--name NAME] [--note TEXT] [--disk-mib N] [--quick] [--quiet]\n\n"
            "Measures this machine in under a minute (--quick: a few seconds, rougher) and prints\n"
            "a hardware profile (docs/profiles.md): every figure with its source, \"measured by\n"
            "moeflow calibrate on HOST DATE: how\". Progress goes to stderr.\n"
            "  host      sockets and cores (hwloc); per thread, with every core's thread running\n"
            "            it at once and weights out of cache (one thread alone in the sources),\n"
            "            the fused fp4 int8 matmul, the fp8 32x32-tile and the bf16 matmul at 1\n"
            "            and 8 tokens (bytes/s, MACs/s, latency) and plain C code in the reference's\n"
            "            style (double-accumulated attention, one thread); the engine's fp32\n"
            "            vector attention (mf_kern_vec_attn, every core's thread at once, data in\n"
            "            cache: host_vec); streaming read bandwidth of one\n"
            "            socket's threads; the executor's cost per task (fork-joins of empty\n"
            "            tasks), its idle workers' spin and how late a sleeping one starts a task;\n"
            "            the cross-socket factor where there are two NUMA nodes or more\n"
            "  disk      O_DIRECT reads (never the page cache) of a temporary file under DIR\n"
            "            through the IO lane: latency of small reads at depth 1, bandwidth of\n"
            "            1 MiB random reads at depths 1..64 and the depth that reaches 90%% of it;\n"
            "            the file is removed (unlinked as soon as it is open)\n"
            "  cards     with --devices: pinned h2d/d2h latency and bandwidth of card 0, all\n"
            "            cards copying in at once, and the fp4/fp8 matmuls on card 0's compute\n"
            "            stream; emulated cards are marked cards_emulated = 1 (their copies follow\n"
            "            the spec's model, their kernels are the host's on one thread)\n\n"
            "  --out FILE      also write the profile to FILE (temporary name, then renamed)\n"
            "  --json          print the profile as JSON instead of a table\n"
            "  --dir DIR       where the disk probe's file goes (default: the current directory);\n"
            "                  put it on the disk that will hold the checkpoint\n"
            "  --devices SPEC  cards to calibrate: emu:N[,mem=..][,bw=..][,lat_ns=..] or cuda,\n"
            "                  cuda:0,1 (default: none; the profile then has n_cards = 0)\n"
            "  --name NAME     the profile's name (default calibrated-<host name>)\n"
            "  --note TEXT     a comment for the written file's header, e.g. what machine this is\n"
            "                  (repeatable)\n"
            "  --disk-mib N    size of the disk probe's file (default 256, --quick 64; 8..65536)\n"
            "  --quick         smaller buffers, fewer repetitions (tests)\n"
            "  --quiet         no progress on stderr\n");
}

int mf_cmd_calibrate(int argc, char **argv)
{
    mf_hwcal_opts o = {0};
    const char *out = NULL;
    char notes[1024] = "";
    int json = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int hv = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            mf_calibrate_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--out") && hv) {
            out = argv[++i];
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (!strcmp(a, "--dir") && hv) {
            o.dir = argv[++i];
        } else if (!strcmp(a, "--devices") && hv) {
            o.devices = argv[++i];
        } else if (!strcmp(a, "--name") && hv) {
            o.name = argv[++i];
        } else if (!strcmp(a, "--note") && hv) {
            const char *t = argv[++i];
            size_t n = strlen(notes);
            if (strlen(t) + n + 2 > sizeof notes) {
                fprintf(stderr, "moeflow calibrate: --note: notes longer than %zu characters\n", sizeof notes - 2);
                return 2;
            }
            snprintf(notes + n, sizeof notes - n, "\n%s", t);
        } else if (!strcmp(a, "--disk-mib") && hv) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || !*argv[i] || v < 8 || v > 65536) {
                fprintf(stderr, "moeflow calibrate: --disk-mib: expected 8..65536, found '%s'\n", argv[i]);
                return 2;
            }
            o.disk_bytes = (uint64_t)v << 20;
        } else if (!strcmp(a, "--quick")) {
            o.quick = 1;
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            o.quiet = 1;
        } else {
            fprintf(stderr, "moeflow calibrate: unknown or incomplete option '%s'\n\n", a);
            mf_calibrate_usage(stderr);
            return 2;
        }
    }
    if (o.dir && access(o.dir, W_OK) != 0) {
        fprintf(stderr, "moeflow calibrate: --dir %s: not a writable directory: %s\n", o.dir, strerror(errno));
        return 2;
    }
    mf_profile *p = malloc(sizeof *p);
    if (!p) {
        fprintf(stderr, "moeflow calibrate: out of memory\n");
        return 1;
    }
    /* a fit that the machine's noise broke (-EIO "too noisy": another process took the core
     * between two timings) is measured again, up to three runs in all, saying so */
    int rc = mf_hwcal_run(&o, p);
    for (int attempt = 2; rc == -EIO && strstr(mf_last_error(), "too noisy") && attempt <= 3; attempt++) {
        fprintf(stderr, "moeflow calibrate: %s; measuring again (run %d of 3)\n", mf_last_error(), attempt);
        rc = mf_hwcal_run(&o, p);
    }
    if (rc) {
        fprintf(stderr, "moeflow calibrate: %s\n", mf_last_error());
        free(p);
        return 1;
    }
    if (out) {
        char who[160], cpu[160], header[2048];
        mf_hwcal_host_date(who, sizeof who);
        mf_hwcal_cpu_model(cpu, sizeof cpu);
        snprintf(header, sizeof header,
                 "written by moeflow calibrate%s%s%s on %s\n"
                 "CPU: %s, %ld online CPUs; cards: %s%s",
                 o.quick ? " --quick" : "", o.devices ? " --devices " : "", o.devices ? o.devices : "", who, cpu,
                 sysconf(_SC_NPROCESSORS_ONLN), o.devices ? o.devices : "none", notes);
        if ((rc = mf_profile_write_header(p, out, header))) {
            fprintf(stderr, "moeflow calibrate: %s\n", mf_last_error());
            free(p);
            return 1;
        }
        snprintf(p->path, sizeof p->path, "%s", out);
        if (!o.quiet) fprintf(stderr, "moeflow calibrate: profile written to %s\n", out);
    }
    if (json)
        mf_profile_print_json(p, stdout);
    else
        mf_profile_print(p, stdout);
    free(p);
    return 0;
}
