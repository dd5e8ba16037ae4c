/* The byte census of a checkpoint: every tensor name falls into one group (routed experts,
 * Engram, MTP, attention, shared experts, embed + head, other), and the census sums bytes and
 * counts per group over an open checkpoint. `moeflow info` prints it; the layout uses the same
 * classification so that generated and real checkpoints are counted alike. */
#ifndef MF_CENSUS_H
#define MF_CENSUS_H

#include <stdint.h>

#include "host/safetensors.h"

typedef enum mf_group {
    MF_GROUP_EXPERTS,         /* layers.L.ffn.experts.* (routed, packed fp4) */
    MF_GROUP_ENGRAM,          /* layers.L.engram.* (tables and their projections) */
    MF_GROUP_MTP,             /* mtp.* (draft blocks) */
    MF_GROUP_ATTN,            /* layers.L.attn.* */
    MF_GROUP_SHARED_EXPERTS,  /* layers.L.ffn.shared_experts.* */
    MF_GROUP_EMBED_HEAD,      /* embed.weight, head.weight */
    MF_GROUP_OTHER,           /* norms, gates, hyper-connections, anything else */
    MF_GROUP_COUNT
} mf_group;

/* "experts", "engram", "mtp", "attn", "shared_experts", "embed_head", "other". */
const char *mf_group_name(mf_group g);

/* The group of a tensor name (with or without a leading "model."). */
mf_group mf_census_group_of(const char *name);

typedef struct mf_census {
    uint64_t total_bytes;
    int64_t n_tensors;
    int n_shards;
    uint64_t bytes[MF_GROUP_COUNT];
    int64_t tensors[MF_GROUP_COUNT];
} mf_census;

/* Sums the tensors of an open checkpoint (headers only). */
void mf_census_of(const mf_st *st, mf_census *out);

#endif
