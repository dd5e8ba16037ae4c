/* libFuzzer target: a whole safetensors file image (8-byte length, header, data) through
 * mf_st_parse_image. Besides not crashing, leaking or tripping a sanitizer, every accepted header
 * must satisfy what the parser promises (sizes match shapes, ranges tile the data section), and
 * every refusal must carry a message naming its source. test_fuzz_replay runs this same function
 * over the seed corpus in every build. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "host/safetensors.h"
#include "sched/error.h"

#define FUZZ_REQUIRE(cond)                                                                       \
    do {                                                                                         \
        if (!(cond)) {                                                                           \
            fprintf(stderr, "fuzz_st_header: invariant failed: %s (%s:%d)\n", #cond, __FILE__,   \
                    __LINE__);                                                                   \
            abort();                                                                             \
        }                                                                                        \
    } while (0)

static int cmp_name(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int cmp_u64pair(const void *a, const void *b)
{
    const uint64_t *x = a, *y = b;
    if (x[0] != y[0]) return x[0] < y[0] ? -1 : 1;
    return (x[1] > y[1]) - (x[1] < y[1]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    mf_st_tensor *t = NULL;
    int n = -1;
    mf_error_clear();
    int rc = mf_st_parse_image("fuzz-input", data, size, &t, &n);
    if (rc != 0) {
        FUZZ_REQUIRE(rc < 0 && t == NULL && n == 0);
        FUZZ_REQUIRE(strstr(mf_last_error(), "fuzz-input") != NULL);
        return 0;
    }
    FUZZ_REQUIRE(size >= 8 && n >= 0 && t != NULL);
    uint64_t hdr = 0;
    for (int b = 0; b < 8; b++) hdr |= (uint64_t)data[b] << (8 * b);
    uint64_t data_start = 8 + hdr, data_bytes = size - data_start;
    uint64_t(*ranges)[2] = malloc((size_t)(n ? n : 1) * sizeof *ranges);
    FUZZ_REQUIRE(ranges != NULL);
    for (int i = 0; i < n; i++) {
        FUZZ_REQUIRE(t[i].name != NULL && strcmp(t[i].name, "__metadata__") != 0);
        FUZZ_REQUIRE(t[i].n_dims >= 0 && t[i].n_dims <= MF_ST_MAX_DIMS);
        FUZZ_REQUIRE((unsigned)t[i].dtype < MF_DTYPE_COUNT);
        int64_t elems = 1;
        for (int d = 0; d < t[i].n_dims; d++) {
            FUZZ_REQUIRE(t[i].shape[d] >= 0);
            elems *= t[i].shape[d];   /* the parser refused overflowing shapes */
        }
        FUZZ_REQUIRE(mf_dtype_bytes(t[i].dtype, elems) == (int64_t)t[i].n_bytes);
        FUZZ_REQUIRE(t[i].file_offset >= data_start && t[i].file_offset <= size);
        FUZZ_REQUIRE(t[i].n_bytes <= size - t[i].file_offset);
        ranges[i][0] = t[i].file_offset - data_start;
        ranges[i][1] = ranges[i][0] + t[i].n_bytes;
    }
    const char **names = malloc((size_t)(n ? n : 1) * sizeof *names);   /* names are unique */
    FUZZ_REQUIRE(names != NULL);
    for (int i = 0; i < n; i++) names[i] = t[i].name;
    qsort(names, (size_t)n, sizeof *names, cmp_name);
    for (int i = 1; i < n; i++) FUZZ_REQUIRE(strcmp(names[i - 1], names[i]) != 0);
    free(names);
    qsort(ranges, (size_t)n, sizeof *ranges, cmp_u64pair);
    uint64_t at = 0;
    for (int i = 0; i < n; i++) {
        FUZZ_REQUIRE(ranges[i][0] == at);
        at = ranges[i][1];
    }
    FUZZ_REQUIRE(at == data_bytes);
    free(ranges);
    mf_st_tensors_free(t, n);
    return 0;
}
