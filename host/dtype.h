/* Element types of checkpoint tensors, with their safetensors names and sizes. */
#ifndef MF_DTYPE_H
#define MF_DTYPE_H

#include <stdint.h>

typedef enum mf_dtype {
    MF_DTYPE_BOOL,
    MF_DTYPE_U8,
    MF_DTYPE_I8,
    MF_DTYPE_U16,
    MF_DTYPE_I16,
    MF_DTYPE_U32,
    MF_DTYPE_I32,
    MF_DTYPE_U64,
    MF_DTYPE_I64,
    MF_DTYPE_F8_E4M3,   /* safetensors "F8_E4M3" (e4m3fn) */
    MF_DTYPE_F8_E5M2,
    MF_DTYPE_F8_E8M0,   /* safetensors "F8_E8M0" (e8m0fnu, a power-of-two scale) */
    MF_DTYPE_F4,        /* safetensors "F4": e2m1, two per byte (released experts use I8 instead) */
    MF_DTYPE_BF16,
    MF_DTYPE_F16,
    MF_DTYPE_F32,
    MF_DTYPE_F64,
    MF_DTYPE_COUNT
} mf_dtype;

/* The safetensors spelling ("BF16"), or "?" for an out-of-range value. */
const char *mf_dtype_name(mf_dtype t);

/* Parses a safetensors dtype name; 0 on success, -EINVAL for an unknown name. */
int mf_dtype_parse(const char *name, mf_dtype *out);

/* Bits per element (4 for F4, 8 for F8_*, 16 for BF16...). */
int mf_dtype_bits(mf_dtype t);

/* Bytes taken by n_elems elements, rounded up to whole bytes; -1 on overflow. */
int64_t mf_dtype_bytes(mf_dtype t, int64_t n_elems);

#endif
