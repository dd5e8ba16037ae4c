/* Names and sizes of mf_dtype. */
#include "host/dtype.h"

#include <errno.h>
#include <string.h>

static const struct {
    const char *name;
    int bits;
} mf_dtype_table[MF_DTYPE_COUNT] = {
    [MF_DTYPE_BOOL] = {"BOOL", 8},       [MF_DTYPE_U8] = {"U8", 8},
    [MF_DTYPE_I8] = {"I8", 8},           [MF_DTYPE_U16] = {"U16", 16},
    [MF_DTYPE_I16] = {"I16", 16},        [MF_DTYPE_U32] = {"U32", 32},
    [MF_DTYPE_I32] = {"I32", 32},        [MF_DTYPE_U64] = {"U64", 64},
    [MF_DTYPE_I64] = {"I64", 64},        [MF_DTYPE_F8_E4M3] = {"F8_E4M3", 8},
    [MF_DTYPE_F8_E5M2] = {"F8_E5M2", 8}, [MF_DTYPE_F8_E8M0] = {"F8_E8M0", 8},
    [MF_DTYPE_F4] = {"F4", 4},           [MF_DTYPE_BF16] = {"BF16", 16},
    [MF_DTYPE_F16] = {"F16", 16},        [MF_DTYPE_F32] = {"F32", 32},
    [MF_DTYPE_F64] = {"F64", 64},
};

const char *mf_dtype_name(mf_dtype t)
{
    return (unsigned)t < MF_DTYPE_COUNT ? mf_dtype_table[t].name : "?";
}

int mf_dtype_parse(const char *name, mf_dtype *out)
{
    for (int i = 0; i < MF_DTYPE_COUNT; i++) {
        if (strcmp(name, mf_dtype_table[i].name) == 0) {
            *out = (mf_dtype)i;
            return 0;
        }
    }
    return -EINVAL;
}

int mf_dtype_bits(mf_dtype t)
{
    return (unsigned)t < MF_DTYPE_COUNT ? mf_dtype_table[t].bits : 0;
}

int64_t mf_dtype_bytes(mf_dtype t, int64_t n_elems)
{
    int bits = mf_dtype_bits(t);
    if (n_elems < 0 || bits == 0 || n_elems > INT64_MAX / 64) return -1;
    return (n_elems * bits + 7) / 8;
}
