/* Classification of tensor names into census groups, and the census over an open checkpoint. */
#include "graphs/model/census.h"

#include <string.h>

static const char *const mf_group_names[MF_GROUP_COUNT] = {
    [MF_GROUP_EXPERTS] = "experts",
    [MF_GROUP_ENGRAM] = "engram",
    [MF_GROUP_MTP] = "mtp",
    [MF_GROUP_ATTN] = "attn",
    [MF_GROUP_SHARED_EXPERTS] = "shared_experts",
    [MF_GROUP_EMBED_HEAD] = "embed_head",
    [MF_GROUP_OTHER] = "other",
};

const char *mf_group_name(mf_group g)
{
    return (unsigned)g < MF_GROUP_COUNT ? mf_group_names[g] : "?";
}

mf_group mf_census_group_of(const char *name)
{
    if (!strncmp(name, "model.", 6)) name += 6;
    if (!strncmp(name, "mtp.", 4)) return MF_GROUP_MTP;
    if (!strcmp(name, "embed.weight") || !strcmp(name, "head.weight")) return MF_GROUP_EMBED_HEAD;
    if (strncmp(name, "layers.", 7) != 0) return MF_GROUP_OTHER;
    const char *rest = strchr(name + 7, '.');   /* after "layers.L" */
    if (!rest) return MF_GROUP_OTHER;
    rest++;
    if (!strncmp(rest, "ffn.experts.", 12)) return MF_GROUP_EXPERTS;
    if (!strncmp(rest, "ffn.shared_experts.", 19)) return MF_GROUP_SHARED_EXPERTS;
    if (!strncmp(rest, "engram.", 7)) return MF_GROUP_ENGRAM;
    if (!strncmp(rest, "attn.", 5)) return MF_GROUP_ATTN;
    return MF_GROUP_OTHER;
}

void mf_census_of(const mf_st *st, mf_census *out)
{
    memset(out, 0, sizeof *out);
    out->n_shards = mf_st_n_shards(st);
    int n = mf_st_n_tensors(st);
    for (int i = 0; i < n; i++) {
        const mf_st_tensor *t = mf_st_tensor_at(st, i);
        mf_group g = mf_census_group_of(t->name);
        out->bytes[g] += t->n_bytes;
        out->tensors[g]++;
        out->total_bytes += t->n_bytes;
        out->n_tensors++;
    }
}
