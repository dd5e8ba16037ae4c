/* The subcommands of `moeflow`; each parses its own arguments and returns the process exit code. */
#ifndef MF_COMMANDS_H
#define MF_COMMANDS_H

int mf_cmd_gen(int argc, char **argv);    /* tools/cmd_gen.c: synthetic checkpoints */
int mf_cmd_info(int argc, char **argv);   /* tools/cmd_info.c: byte census of a checkpoint */
int mf_bench_kernels(int argc, char **argv);   /* tools/bench_kernels.c: `bench kernels` */

#endif
