/* The subcommands of `moeflow`; each parses its own arguments and returns the process exit code. */
#ifndef MF_COMMANDS_H
#define MF_COMMANDS_H


#endif
