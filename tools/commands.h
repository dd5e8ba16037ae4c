/* The subcommands of `moeflow`; each reads its arguments through its option table (tools/opts.h)
 * and returns the process exit code. */
#ifndef MF_COMMANDS_H
#define MF_COMMANDS_H

#include "tools/opts.h"

int mf_cmd_gen(int argc, char **argv);    /* tools/cmd_gen.c: synthetic checkpoints */
int mf_cmd_decode(int argc, char **argv);  /* tools/cmd_decode.c: decoding (scheduled or reference engine) */
int mf_cmd_serve(int argc, char **argv);  /* tools/cmd_serve.c: OpenAI-compatible HTTP API, continuous batching */
int mf_cmd_info(int argc, char **argv);   /* tools/cmd_info.c: byte census of a checkpoint */
int mf_cmd_sim(int argc, char **argv);    /* tools/cmd_sim.c: simulated decode steps on a hardware profile */
int mf_cmd_tune(int argc, char **argv);   /* tools/cmd_tune.c: strategy sweeps, simulated or real */
int mf_cmd_calibrate(int argc, char **argv);  /* tools/cmd_calibrate.c: hardware profile of this machine */
/* `moeflow bench <what>`: micro-benchmarks (tools/cmd_bench.c). */
int mf_cmd_bench(int argc, char **argv);
/* `moeflow bench io`: store reads vs dd, gathers vs a pread loop (tools/cmd_bench_io.c). */
int mf_bench_io(int argc, char **argv);
int mf_bench_kernels(int argc, char **argv);   /* tools/bench_kernels.c: `bench kernels` */
int mf_bench_decode(int argc, char **argv);    /* tools/bench_decode.c: `bench decode` */
int mf_bench_serve(int argc, char **argv);     /* tools/bench_serve.c: `bench serve` */
int mf_bench_weights(int argc, char **argv);   /* tools/bench_weights.c: `bench weights` */
int mf_bench_echo(int argc, char **argv);      /* tools/bench_echo.c: `bench echo` */
int mf_bench_dev(int argc, char **argv);       /* tools/bench_dev.c: `bench dev` */
int mf_bench_devtasks(int argc, char **argv);  /* tools/bench_devtasks.c: `bench devtasks` */
int mf_bench_ref(int argc, char **argv);       /* tools/bench_ref.c: `bench ref` */

/* 1 when environment variable `name` is "1": compatibility switches (MOEFLOW_DEV_GRAPHS=1 for
 * --dev-graphs) that tools/ turn into options; the library reads no environment (tools/moeflow.c). */
int mf_tool_env_on(const char *name);

/* The IO settings of the environment, parsed once by tools/moeflow.c before any subcommand runs:
 * MOEFLOW_IO=pread (force_pread 1: IO lanes on pread workers) and MOEFLOW_IO_FAULT=eio:N|short:N
 * (the Nth read of an IO lane fails; MF_IO_FAULT_* of sched/sched.h). Commands copy them into the
 * options of the executors they make: the scheduled engine's (mf_step_opts), the expert store's
 * (mf_model_opts, its private run: the fault only where no engine issues the reads), their own. */
typedef struct mf_tool_io {
    int force_pread;
    int fault_kind;
    long long fault_nth;
} mf_tool_io;
extern mf_tool_io mf_tool_io_env;

/* --sockets (moeflow decode, bench decode): "auto" (the sockets hwloc finds: sched/sched.h
 * mf_topo_sockets) or 1..8, on the topology MOEFLOW_TOPOLOGY names (an hwloc synthetic
 * description such as "package:2 numa:1 core:1 pu:1" or an XML file, for tests; unset: this
 * machine). Fills n and each socket's OS node (for the store's memory) and returns 0; -EINVAL
 * (mf_error: "--sockets: ...") on a bad value or a topology with fewer sockets. */
typedef struct mf_tool_sockets {
    int n;
    int node[8];
    const char *topology;   /* MOEFLOW_TOPOLOGY or NULL */
} mf_tool_sockets;
int mf_tool_sockets_of(const char *arg, mf_tool_sockets *out);
/* mf_tool_sockets_of as an option table's MF_OPT_FN (the field: an mf_tool_sockets). */
int mf_tool_sockets_opt(const mf_opt *o, const char *arg, void *field);

/* `moeflow bench decode --spec dspark|perfect` (tools/bench_spec.c): plain against speculating
 * batcher runs of the synthetic prompts, alternating. spec: MF_TOOL_SPEC_DSPARK or _PERFECT
 * (tools/sim_common.h); spec_tokens 0: auto. 0 or a negative code. */
typedef struct mf_bench_spec_opts {
    const char *dir;
    int spec, exact, json;
    long spec_tokens, batch, steps, n_prompt, threads, rounds;
} mf_bench_spec_opts;
int mf_bench_decode_spec(const mf_bench_spec_opts *o);

#endif
