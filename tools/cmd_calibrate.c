/* `moeflow calibrate`: measures this machine (graphs/calib/hwcal.h) and prints the hardware profile it
 * makes (sched/profile.h), writing it with --out; the simulator (`moeflow sim --profile`) reads
 * it. docs/profiles.md describes the format and how each figure is measured. */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "graphs/calib/hwcal.h"
#include "sched/error.h"
#include "sched/profile.h"
#include "tools/commands.h"

/* The command line of `moeflow calibrate`. */
typedef struct mf_calibrate_cli {
    mf_hwcal_opts hw;
    const char *out;
    int json;
    long disk_mib;      /* 0: the default */
    char notes[1024];   /* each --note, after a newline */
} mf_calibrate_cli;

/* --note TEXT (repeatable): appended to the notes, a line each. */
static int mf_calibrate_note(const mf_opt *o, const char *t, void *field)
{
    char *notes = field;
    size_t n = strlen(notes), cap = sizeof ((mf_calibrate_cli *)0)->notes;
    if (strlen(t) + n + 2 > cap) return mf_error(-EINVAL, "%s: notes longer than %zu characters", o->flag, cap - 2);
    snprintf(notes + n, cap - n, "\n%s", t);
    return 0;
}

#define F(x) offsetof(mf_calibrate_cli, x)
static const mf_opt mf_calibrate_table[] = {
    {"--out", .kind = MF_OPT_STR, .off = F(out), .meta = "FILE",
     .help = "also write the profile to FILE (temporary name, then renamed)"},
    {"--json", .kind = MF_OPT_FLAG, .off = F(json), .help = "print the profile as JSON instead of a table"},
    {"--dir", .kind = MF_OPT_STR, .off = F(hw.dir), .meta = "DIR",
     .help = "where the disk probe's file goes (default: the current directory);\n"
             "put it on the disk that will hold the checkpoint"},
    {"--devices", .kind = MF_OPT_STR, .off = F(hw.devices), .meta = "SPEC",
     .help = "cards to calibrate: emu:N[,mem=..][,bw=..][,lat_ns=..] or cuda,\n"
             "cuda:0,1 (default: none; the profile then has n_cards = 0)"},
    {"--name", .kind = MF_OPT_STR, .off = F(hw.name), .meta = "NAME",
     .help = "the profile's name (default calibrated-<host name>)"},
    {"--note", .kind = MF_OPT_FN, .off = F(notes), .meta = "TEXT", .fn = mf_calibrate_note, .example = "x",
     .help = "a comment for the written file's header, e.g. what machine this is\n(repeatable)"},
    {"--disk-mib", .kind = MF_OPT_LONG, .off = F(disk_mib), .meta = "N", .lo = 8, .hi = 65536,
     .help = "size of the disk probe's file (default 256, --quick 64; 8..65536)"},
    {"--quick", .kind = MF_OPT_FLAG, .off = F(hw.quick), .help = "smaller buffers, fewer repetitions (tests)"},
    {"--quiet", "-q", MF_OPT_FLAG, F(hw.quiet), .help = "no progress on stderr"},
    {NULL},
};
#undef F

static const mf_opts_spec mf_calibrate_spec = {
    .cmd = "calibrate",
    .usage =
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
        "            1 MiB random reads at depths 1..64 and the depth that reaches 90% of it;\n"
        "            the file is removed (unlinked as soon as it is open)\n"
        "  cards     with --devices: pinned h2d/d2h latency and bandwidth of card 0, all\n"
        "            cards copying in at once, and the fp4/fp8 matmuls on card 0's compute\n"
        "            stream; emulated cards are marked cards_emulated = 1 (their copies follow\n"
        "            the spec's model, their kernels are the host's on one thread)\n\n",
    .opts = mf_calibrate_table,
    .col = 18,
};

/* Measures into *p: a fit that the machine's noise broke (-EIO "too noisy": another process took
 * the core between two timings) is measured again, up to three runs in all, saying so. */
static int mf_calibrate_run(const mf_hwcal_opts *o, mf_profile *p)
{
    int rc = mf_hwcal_run(o, p);
    for (int attempt = 2; rc == -EIO && strstr(mf_last_error(), "too noisy") && attempt <= 3; attempt++) {
        fprintf(stderr, "moeflow calibrate: %s; measuring again (run %d of 3)\n", mf_last_error(), attempt);
        rc = mf_hwcal_run(o, p);
    }
    return rc;
}

/* --out: the profile with a header of who wrote it, where and with which cards. */
static int mf_calibrate_write(const mf_calibrate_cli *a, mf_profile *p)
{
    const mf_hwcal_opts *o = &a->hw;
    char who[160], cpu[160], header[2048];
    mf_hwcal_host_date(who, sizeof who);
    mf_hwcal_cpu_model(cpu, sizeof cpu);
    snprintf(header, sizeof header,
             "written by moeflow calibrate%s%s%s on %s\n"
             "CPU: %s, %ld online CPUs; cards: %s%s",
             o->quick ? " --quick" : "", o->devices ? " --devices " : "", o->devices ? o->devices : "", who, cpu,
             sysconf(_SC_NPROCESSORS_ONLN), o->devices ? o->devices : "none", a->notes);
    int rc = mf_profile_write_header(p, a->out, header);
    if (rc) return rc;
    snprintf(p->path, sizeof p->path, "%s", a->out);
    if (!o->quiet) fprintf(stderr, "moeflow calibrate: profile written to %s\n", a->out);
    return 0;
}

int mf_cmd_calibrate(int argc, char **argv)
{
    mf_calibrate_cli a = {0};
    int rc = mf_opts_parse(&mf_calibrate_spec, argc, argv, &a);
    if (rc != MF_OPTS_RUN) return rc;
    if (a.disk_mib) a.hw.disk_bytes = (uint64_t)a.disk_mib << 20;
    if (a.hw.dir && access(a.hw.dir, W_OK) != 0) {
        fprintf(stderr, "moeflow calibrate: --dir %s: not a writable directory: %s\n", a.hw.dir, strerror(errno));
        return 2;
    }
    mf_profile *p = malloc(sizeof *p);
    if (!p) {
        fprintf(stderr, "moeflow calibrate: out of memory\n");
        return 1;
    }
    if (mf_calibrate_run(&a.hw, p) || (a.out && mf_calibrate_write(&a, p))) {
        fprintf(stderr, "moeflow calibrate: %s\n", mf_last_error());
        free(p);
        return 1;
    }
    if (a.json)
        mf_profile_print_json(p, stdout);
    else
        mf_profile_print(p, stdout);
    free(p);
    return 0;
}
