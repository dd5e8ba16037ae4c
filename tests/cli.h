/* Test fixture: runs the moeflow command ($MOEFLOW_BIN, set by ctest) with `args` through the
 * shell and captures its standard output into out[0..cap). Its stderr is dropped unless args
 * redirect it themselves (any "2>", e.g. "2>&1" to capture it). Returns pclose's status, or -1
 * without $MOEFLOW_BIN or when the shell cannot start. */
#ifndef MF_TEST_CLI_H
#define MF_TEST_CLI_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static inline int mf_test_cli(const char *args, char *out, size_t cap)
{
    const char *bin = getenv("MOEFLOW_BIN");
    if (!bin) return -1;
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "%s %s%s", bin, args, strstr(args, "2>") ? "" : " 2>/dev/null");
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    return pclose(p);
}

#endif
