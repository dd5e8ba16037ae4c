/* A whole file read into memory, for tests and their drivers (corpus replays, templates). */
#ifndef MF_TEST_SLURP_H
#define MF_TEST_SLURP_H

#include <stdio.h>
#include <stdlib.h>

/* The bytes of `path` in a malloc'ed buffer (*n of them), NULL when it cannot be opened or read. */
static inline unsigned char *mf_test_slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, len = 0, got;
    unsigned char *buf = malloc(cap);
    while (buf && (got = fread(buf + len, 1, cap - len, f)) > 0) {
        len += got;
        if (len == cap) {
            unsigned char *nb = realloc(buf, cap *= 2);
            if (!nb) free(buf);
            buf = nb;
        }
    }
    fclose(f);
    *n = len;
    return buf;
}

#endif
