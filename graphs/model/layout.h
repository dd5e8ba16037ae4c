/* The tensor layout of a DeepSeek-V4.1 text checkpoint as released: for a config, every tensor's
 * name (no `model.` prefix), dtype, shape ([out, in] for linears), census group and role, the
 * DSpark draft's mtp.* blocks included (group MF_GROUP_MTP, their stage in `stage`). The generator
 * writes exactly this list; loaders check a checkpoint against it (the draft's only when asked
 * for). Vision tensors are not part of it. */
#ifndef MF_LAYOUT_H
#define MF_LAYOUT_H

#include <stdint.h>

#include "graphs/model/census.h"
#include "graphs/model/config.h"
#include "host/dtype.h"

#define MF_LAYOUT_NAME_BYTES 96

/* What a tensor holds: decides how `moeflow gen` fills it. */
typedef enum mf_role {
    MF_ROLE_FP8_WEIGHT,    /* e4m3 codes of an fp8 linear [out, in] */
    MF_ROLE_FP8_SCALE,     /* e8m0 tile scales of an fp8 linear */
    MF_ROLE_FP4_WEIGHT,    /* packed e2m1 codes (I8) of a routed expert projection */
    MF_ROLE_FP4_SCALE,     /* e8m0 scales, one per 32 along K */
    MF_ROLE_LINEAR,        /* plain BF16/F32 linear [out, in] */
    MF_ROLE_EMBED,         /* token embedding rows */
    MF_ROLE_NORM,          /* RMSNorm weight */
    MF_ROLE_BIAS,          /* router bias */
    MF_ROLE_SINK,          /* per-head attention sink logit */
    MF_ROLE_HC_FN,         /* hyper-connection projection */
    MF_ROLE_HC_BASE,
    MF_ROLE_HC_SCALE,
    MF_ROLE_TABLE,         /* Engram table codes (e4m3) */
    MF_ROLE_TABLE_SCALE,   /* Engram table scales (e8m0, one per 32) */
} mf_role;

typedef struct mf_layout_tensor {
    char name[MF_LAYOUT_NAME_BYTES];
    mf_dtype dtype;
    int n_dims;
    int64_t shape[2];
    mf_group group;
    mf_role role;
    int layer;             /* backbone layer; -1 for top-level and draft tensors */
    int stage;             /* draft stage s of an mtp.s.* tensor; -1 otherwise */
    int64_t fan_in;        /* input width of the linear a weight/scale belongs to (0 otherwise) */
    uint64_t n_bytes;
} mf_layout_tensor;

typedef struct mf_layout mf_layout;

/* Builds the list for a validated config, in checkpoint order: embed, then layer by layer, then
 * the final norm and head, then the draft stage by stage. 0, or a negative code with a message. */
int mf_layout_build(const mf_config *c, mf_layout **out);
void mf_layout_free(mf_layout *l);

int mf_layout_n(const mf_layout *l);
const mf_layout_tensor *mf_layout_at(const mf_layout *l, int i);
/* Index of a tensor by name, or -1. */
int mf_layout_find(const mf_layout *l, const char *name);

uint64_t mf_layout_total_bytes(const mf_layout *l);
uint64_t mf_layout_group_bytes(const mf_layout *l, mf_group g);

#endif
