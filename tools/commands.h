/* The subcommands of `moeflow`; each parses its own arguments and returns the process exit code. */
#ifndef MF_COMMANDS_H
#define MF_COMMANDS_H

/* `moeflow bench <what>`: micro-benchmarks (tools/cmd_bench.c). */
int mf_cmd_bench(int argc, char **argv);

#endif
