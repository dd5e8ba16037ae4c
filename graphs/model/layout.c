/* The released DeepSeek-V4.1 text layout, derived from the config: one pass counts the tensors,
 * a second fills one allocation. Names, dtypes and shapes follow docs (shared/v41-flash.md). */
#include "graphs/model/layout.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/error.h"

struct mf_layout {
    int n;
    mf_layout_tensor *t;
    const mf_layout_tensor **by_name;   /* sorted by name, for mf_layout_find */
};

static int mf_cmp_tensor_name(const void *a, const void *b)
{
    return strcmp((*(const mf_layout_tensor *const *)a)->name,
                  (*(const mf_layout_tensor *const *)b)->name);
}

typedef struct mf_emit {
    mf_layout_tensor *t;   /* NULL on the counting pass */
    int n;
    int layer;
    const mf_config *c;
} mf_emit;

static void mf_put(mf_emit *e, mf_dtype dt, int n_dims, int64_t d0, int64_t d1, mf_role role,
                   int64_t fan_in, const char *fmt, ...) __attribute__((format(printf, 8, 9)));

static void mf_put(mf_emit *e, mf_dtype dt, int n_dims, int64_t d0, int64_t d1, mf_role role,
                   int64_t fan_in, const char *fmt, ...)
{
    if (e->t) {
        mf_layout_tensor *t = &e->t[e->n];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(t->name, sizeof t->name, fmt, ap);
        va_end(ap);
        t->dtype = dt;
        t->n_dims = n_dims;
        t->shape[0] = d0;
        t->shape[1] = n_dims > 1 ? d1 : 0;
        t->group = mf_census_group_of(t->name);
        t->role = role;
        t->layer = e->layer;
        t->fan_in = fan_in;
        t->n_bytes = (uint64_t)mf_dtype_bytes(dt, n_dims > 1 ? d0 * d1 : d0);
    }
    e->n++;
}

static int64_t mf_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* X.weight F8_E4M3 [out, in] + X.scale F8_E8M0 [ceil(out/bo), ceil(in/bi)] */
static void mf_put_fp8(mf_emit *e, int64_t out, int64_t in, const char *prefix)
{
    const mf_config *c = e->c;
    mf_put(e, MF_DTYPE_F8_E4M3, 2, out, in, MF_ROLE_FP8_WEIGHT, in, "%s.weight", prefix);
    mf_put(e, MF_DTYPE_F8_E8M0, 2, mf_ceil_div(out, c->quant_block_out),
           mf_ceil_div(in, c->quant_block_in), MF_ROLE_FP8_SCALE, in, "%s.scale", prefix);
}

/* X.weight I8 [out, in/2] (two e2m1 per byte) + X.scale F8_E8M0 [out, in/32] */
static void mf_put_fp4(mf_emit *e, int64_t out, int64_t in, const char *prefix)
{
    mf_put(e, MF_DTYPE_I8, 2, out, in / 2, MF_ROLE_FP4_WEIGHT, in, "%s.weight", prefix);
    mf_put(e, MF_DTYPE_F8_E8M0, 2, out, in / 32, MF_ROLE_FP4_SCALE, in, "%s.scale", prefix);
}

static void mf_put_hc(mf_emit *e, int L, const char *which)
{
    const mf_config *c = e->c;
    int64_t mix = (int64_t)(2 + c->hc_mult) * c->hc_mult;
    int64_t in = (int64_t)c->hc_mult * c->hidden_size;
    mf_put(e, MF_DTYPE_F32, 2, mix, in, MF_ROLE_HC_FN, in, "layers.%d.hc_%s_fn", L, which);
    mf_put(e, MF_DTYPE_F32, 1, mix, 0, MF_ROLE_HC_BASE, 0, "layers.%d.hc_%s_base", L, which);
    mf_put(e, MF_DTYPE_F32, 1, 3, 0, MF_ROLE_HC_SCALE, 0, "layers.%d.hc_%s_scale", L, which);
}

static void mf_put_layer(mf_emit *e, int L)
{
    const mf_config *c = e->c;
    char p[MF_LAYOUT_NAME_BYTES];
    int64_t H = c->hidden_size, D = c->head_dim;
    e->layer = L;

    int slot = mf_config_engram_slot(c, L);
    if (slot >= 0) {   /* Engram at block entry */
        int64_t rows = c->engram_num_embeddings[slot], d = c->engram_head_dim;
        int64_t cols = (int64_t)(c->engram_max_ngram_size - 1) * c->engram_n_heads;
        mf_put(e, MF_DTYPE_F8_E4M3, 2, rows, d, MF_ROLE_TABLE, 0, "layers.%d.engram.embed.weight", L);
        mf_put(e, MF_DTYPE_F8_E8M0, 2, rows, d / 32, MF_ROLE_TABLE_SCALE, 0,
               "layers.%d.engram.embed.scale", L);
        snprintf(p, sizeof p, "layers.%d.engram.wkv", L);
        mf_put_fp8(e, (int64_t)(c->hc_mult + 1) * H, cols * d, p);
        mf_put(e, MF_DTYPE_BF16, 2, c->hc_mult, H, MF_ROLE_LINEAR, H, "layers.%d.engram.q_weight", L);
        mf_put(e, MF_DTYPE_BF16, 2, c->hc_mult, H, MF_ROLE_LINEAR, H, "layers.%d.engram.k_weight", L);
    }

    mf_put_hc(e, L, "attn");
    mf_put(e, MF_DTYPE_BF16, 1, H, 0, MF_ROLE_NORM, 0, "layers.%d.attn_norm.weight", L);
    snprintf(p, sizeof p, "layers.%d.attn.wq_a", L);
    mf_put_fp8(e, c->q_lora_rank, H, p);
    mf_put(e, MF_DTYPE_BF16, 1, c->q_lora_rank, 0, MF_ROLE_NORM, 0, "layers.%d.attn.q_norm.weight", L);
    snprintf(p, sizeof p, "layers.%d.attn.wq_b", L);
    mf_put_fp8(e, (int64_t)c->n_heads * D, c->q_lora_rank, p);
    snprintf(p, sizeof p, "layers.%d.attn.wkv", L);
    mf_put_fp8(e, (int64_t)c->n_kv_heads * D, H, p);
    mf_put(e, MF_DTYPE_BF16, 1, D, 0, MF_ROLE_NORM, 0, "layers.%d.attn.kv_norm.weight", L);
    snprintf(p, sizeof p, "layers.%d.attn.wo_a", L);
    mf_put_fp8(e, (int64_t)c->o_groups * c->o_lora_rank, (int64_t)c->n_heads * D / c->o_groups, p);
    snprintf(p, sizeof p, "layers.%d.attn.wo_b", L);
    mf_put_fp8(e, H, (int64_t)c->o_groups * c->o_lora_rank, p);
    mf_put(e, MF_DTYPE_F32, 1, c->n_heads, 0, MF_ROLE_SINK, 0, "layers.%d.attn.attn_sink", L);

    int kv_src = mf_config_is_kv_source(c, L), idx_src = mf_config_is_index_source(c, L);
    if (kv_src) {
        mf_put(e, MF_DTYPE_BF16, 2, D, H, MF_ROLE_LINEAR, H, "layers.%d.attn.compressor.wkv.weight", L);
        if (c->compress_ratios[L] == 2)
            mf_put(e, MF_DTYPE_BF16, 2, D, H, MF_ROLE_LINEAR, H, "layers.%d.attn.compressor.wgate.weight", L);
        mf_put(e, MF_DTYPE_BF16, 1, D, 0, MF_ROLE_NORM, 0, "layers.%d.attn.compressor.norm.weight", L);
    }
    if (idx_src) {
        snprintf(p, sizeof p, "layers.%d.attn.indexer.wq_b", L);
        mf_put_fp8(e, (int64_t)c->index_n_heads * c->index_head_dim, c->q_lora_rank, p);
        mf_put(e, MF_DTYPE_BF16, 2, c->index_n_heads, H, MF_ROLE_LINEAR, H,
               "layers.%d.attn.indexer.weights_proj.weight", L);
    }
    if (kv_src) {
        mf_put(e, MF_DTYPE_BF16, 2, c->index_head_dim, D, MF_ROLE_LINEAR, D,
               "layers.%d.attn.indexer.wk.weight", L);
        mf_put(e, MF_DTYPE_BF16, 1, c->index_head_dim, 0, MF_ROLE_NORM, 0,
               "layers.%d.attn.indexer.k_norm.weight", L);
    }

    mf_put_hc(e, L, "ffn");
    mf_put(e, MF_DTYPE_BF16, 1, H, 0, MF_ROLE_NORM, 0, "layers.%d.ffn_norm.weight", L);
    mf_put(e, MF_DTYPE_BF16, 2, c->n_routed_experts, H, MF_ROLE_LINEAR, H, "layers.%d.ffn.gate.weight", L);
    mf_put(e, MF_DTYPE_F32, 1, c->n_routed_experts, 0, MF_ROLE_BIAS, 0, "layers.%d.ffn.gate.bias", L);
    /* the routing bias for vision tokens: V4.1 is multimodal and ships it on every layer; text
     * decoding does not use it, but it is part of the checkpoint (40 x 1,536 B in flash41) */
    mf_put(e, MF_DTYPE_F32, 1, c->n_routed_experts, 0, MF_ROLE_BIAS, 0, "layers.%d.ffn.gate.bias_vl", L);
    if (c->n_shared_experts > 0) {
        int64_t m = (int64_t)c->n_shared_experts * c->moe_intermediate_size;
        snprintf(p, sizeof p, "layers.%d.ffn.shared_experts.w1", L);
        mf_put_fp8(e, m, H, p);
        snprintf(p, sizeof p, "layers.%d.ffn.shared_experts.w2", L);
        mf_put_fp8(e, H, m, p);
        snprintf(p, sizeof p, "layers.%d.ffn.shared_experts.w3", L);
        mf_put_fp8(e, m, H, p);
    }
    int64_t m = c->moe_intermediate_size;
    for (int x = 0; x < c->n_routed_experts; x++) {
        snprintf(p, sizeof p, "layers.%d.ffn.experts.%d.w1", L, x);
        mf_put_fp4(e, m, H, p);
        snprintf(p, sizeof p, "layers.%d.ffn.experts.%d.w2", L, x);
        mf_put_fp4(e, H, m, p);
        snprintf(p, sizeof p, "layers.%d.ffn.experts.%d.w3", L, x);
        mf_put_fp4(e, m, H, p);
    }
}

static void mf_put_all(mf_emit *e)
{
    const mf_config *c = e->c;
    e->layer = -1;
    mf_put(e, MF_DTYPE_BF16, 2, c->vocab_size, c->hidden_size, MF_ROLE_EMBED, 0, "embed.weight");
    for (int L = 0; L < c->n_layers; L++) mf_put_layer(e, L);
    e->layer = -1;
    mf_put(e, MF_DTYPE_BF16, 1, c->hidden_size, 0, MF_ROLE_NORM, 0, "norm.weight");
    mf_put(e, MF_DTYPE_BF16, 2, c->vocab_size, c->hidden_size, MF_ROLE_LINEAR, c->hidden_size,
           "head.weight");
}

int mf_layout_build(const mf_config *c, mf_layout **out)
{
    *out = NULL;
    int rc = mf_config_validate("layout", c);
    if (rc) return rc;
    mf_emit e = {NULL, 0, -1, c};
    mf_put_all(&e);
    mf_layout *l = calloc(1, sizeof *l);
    mf_layout_tensor *t = calloc((size_t)e.n, sizeof *t);
    const mf_layout_tensor **by_name = calloc((size_t)e.n, sizeof *by_name);
    if (!l || !t || !by_name) {
        free(l);
        free(t);
        free(by_name);
        return mf_error(-ENOMEM, "layout: out of memory for %d tensors", e.n);
    }
    int n = e.n;
    e = (mf_emit){t, 0, -1, c};
    mf_put_all(&e);
    for (int i = 0; i < n; i++) by_name[i] = &t[i];
    qsort(by_name, (size_t)n, sizeof *by_name, mf_cmp_tensor_name);
    for (int i = 1; i < n; i++)
        if (!strcmp(by_name[i - 1]->name, by_name[i]->name)) {   /* a bug here, not bad input */
            int rc2 = mf_error(-EINVAL, "layout: tensor %s appears twice", by_name[i]->name);
            free(by_name);
            free(t);
            free(l);
            return rc2;
        }
    l->n = n;
    l->t = t;
    l->by_name = by_name;
    *out = l;
    return 0;
}

void mf_layout_free(mf_layout *l)
{
    if (!l) return;
    free(l->by_name);
    free(l->t);
    free(l);
}

int mf_layout_n(const mf_layout *l) { return l->n; }

const mf_layout_tensor *mf_layout_at(const mf_layout *l, int i)
{
    return i >= 0 && i < l->n ? &l->t[i] : NULL;
}

int mf_layout_find(const mf_layout *l, const char *name)
{
    int lo = 0, hi = l->n - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2, c = strcmp(l->by_name[mid]->name, name);
        if (c == 0) return (int)(l->by_name[mid] - l->t);
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

uint64_t mf_layout_total_bytes(const mf_layout *l)
{
    uint64_t s = 0;
    for (int i = 0; i < l->n; i++) s += l->t[i].n_bytes;
    return s;
}

uint64_t mf_layout_group_bytes(const mf_layout *l, mf_group g)
{
    uint64_t s = 0;
    for (int i = 0; i < l->n; i++)
        if (l->t[i].group == g) s += l->t[i].n_bytes;
    return s;
}

uint64_t mf_config_resident_bytes(const mf_config *c)
{
    mf_layout *l;
    if (mf_layout_build(c, &l)) return 0;
    uint64_t s = 0;
    for (int i = 0; i < l->n; i++) {
        const mf_layout_tensor *t = &l->t[i];
        if (t->group == MF_GROUP_EXPERTS || t->group == MF_GROUP_MTP ||
            t->role == MF_ROLE_TABLE || t->role == MF_ROLE_TABLE_SCALE)
            continue;
        s += t->n_bytes;
    }
    mf_layout_free(l);
    return s;
}
