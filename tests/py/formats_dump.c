/* Oracle helper for tests/py/check_formats.py: writes, as raw little-endian binary on stdout, the
 * float32 decode of every code of each format, or the codes host/formats.c gives for a list of
 * float32 inputs, so the script can compare both with ml_dtypes.
 *
 *   formats_dump decode            every code, in this order: e2m1 (16), e8m0 (256), e4m3 (256),
 *                                  bf16 (65536), f16 (65536), each as float32
 *   formats_dump encode            float32 values from stdin -> e2m1 codes (1 byte each, not
 *                                  packed), e8m0 (1 byte), e4m3 (1 byte), bf16 (2), f16 (2)
 *   formats_dump encode-range LO N like encode, for the float32 bit patterns LO .. LO+N-1 */
#include "host/formats.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int write_all(const void *p, size_t n_bytes)
{
    if (fwrite(p, 1, n_bytes, stdout) != n_bytes) {
        fprintf(stderr, "formats_dump: writing %zu bytes to stdout failed: %s\n", n_bytes,
                strerror(errno));
        return -1;
    }
    return 0;
}

static int dump_decode(void)
{
    static float out[65536];
    for (int c = 0; c < 16; c++)
        out[c] = mf_e2m1_to_f32((uint8_t)c);
    if (write_all(out, 16 * sizeof(float)))
        return -1;
    for (int c = 0; c < 256; c++)
        out[c] = mf_e8m0_to_f32((uint8_t)c);
    if (write_all(out, 256 * sizeof(float)))
        return -1;
    for (int c = 0; c < 256; c++)
        out[c] = mf_e4m3_to_f32((uint8_t)c);
    if (write_all(out, 256 * sizeof(float)))
        return -1;
    for (int c = 0; c < 65536; c++)
        out[c] = mf_bf16_to_f32((uint16_t)c);
    if (write_all(out, 65536 * sizeof(float)))
        return -1;
    for (int c = 0; c < 65536; c++)
        out[c] = mf_f16_to_f32((uint16_t)c);
    return write_all(out, 65536 * sizeof(float));
}

/* Encodes x[0..n) into every format and writes the five code arrays one after the other. */
static int dump_encode(const float *x, size_t n)
{
    uint8_t *b8 = calloc(n ? n : 1, 1);
    uint16_t *b16 = calloc(n ? n : 1, sizeof(uint16_t));
    int rc = -1;
    if (!b8 || !b16) {
        fprintf(stderr, "formats_dump: out of memory for %zu values\n", n);
        free(b8);
        free(b16);
        return -1;
    }
    for (size_t i = 0; i < n; i++)
        b8[i] = mf_e2m1_from_f32(x[i]);
    if (write_all(b8, n))
        goto out;
    for (size_t i = 0; i < n; i++)
        b8[i] = mf_e8m0_from_f32(x[i]);
    if (write_all(b8, n))
        goto out;
    for (size_t i = 0; i < n; i++)
        b8[i] = mf_e4m3_from_f32(x[i]);
    if (write_all(b8, n))
        goto out;
    mf_f32_to_bf16_n(b16, x, n);
    if (write_all(b16, n * sizeof(uint16_t)))
        goto out;
    for (size_t i = 0; i < n; i++)
        b16[i] = mf_f16_from_f32(x[i]);
    if (write_all(b16, n * sizeof(uint16_t)))
        goto out;
    rc = 0;
out:
    free(b8);
    free(b16);
    return rc;
}

/* Reads all of stdin as float32 values. */
static float *read_stdin_floats(size_t *n_out)
{
    size_t cap = 1 << 20, len = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t got = fread(buf + len, 1, cap - len, stdin);
        len += got;
        if (got == 0)
            break;
        if (len == cap) {
            char *bigger = realloc(buf, cap * 2);
            if (!bigger) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = bigger;
            cap *= 2;
        }
    }
    if (!buf) {
        fprintf(stderr, "formats_dump: out of memory reading stdin\n");
        return NULL;
    }
    if (ferror(stdin) || len % sizeof(float)) {
        fprintf(stderr, "formats_dump: stdin: expected whole float32 values, got %zu bytes%s\n",
                len, ferror(stdin) ? " and a read error" : "");
        free(buf);
        return NULL;
    }
    *n_out = len / sizeof(float);
    return (float *)buf;
}

static int parse_u64(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || end == s || *end) {
        fprintf(stderr, "formats_dump: '%s' is not a number\n", s);
        return -1;
    }
    *out = v;
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "decode") == 0)
        return dump_decode() ? 1 : 0;
    if (argc == 2 && strcmp(argv[1], "encode") == 0) {
        size_t n;
        float *x = read_stdin_floats(&n);
        if (!x)
            return 1;
        int rc = dump_encode(x, n);
        free(x);
        return rc ? 1 : 0;
    }
    if (argc == 4 && strcmp(argv[1], "encode-range") == 0) {
        uint64_t lo, n;
        if (parse_u64(argv[2], &lo) || parse_u64(argv[3], &n))
            return 2;
        if (lo + n > (1ull << 32) || n > (1ull << 28)) {
            fprintf(stderr, "formats_dump: range %llu+%llu: expected LO+N <= 2^32, N <= 2^28\n",
                    (unsigned long long)lo, (unsigned long long)n);
            return 2;
        }
        float *x = malloc((n ? n : 1) * sizeof(float));
        if (!x) {
            fprintf(stderr, "formats_dump: out of memory for %llu values\n",
                    (unsigned long long)n);
            return 1;
        }
        for (uint64_t i = 0; i < n; i++) {
            uint32_t bits = (uint32_t)(lo + i);
            memcpy(&x[i], &bits, sizeof bits);
        }
        int rc = dump_encode(x, n);
        free(x);
        return rc ? 1 : 0;
    }
    fprintf(stderr, "usage: formats_dump decode | encode < floats.f32 | encode-range LO N\n");
    return 2;
}
