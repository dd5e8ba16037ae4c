/* The released DeepSeek-V4.1 text layout, derived from the config: one pass counts the tensors,
 * a second fills one allocation. Names, dtypes and shapes follow docs/model.md (the backbone) and
 * docs/dspark.md (the draft's mtp.* blocks). */
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
    int layer, stage;
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
        t->stage = e->stage;
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

/* The tensors of backbone layer L ("layers.L") and of draft stage s ("mtp.s", layer n_layers + s)
 * share their names below the prefix: */
static void mf_put_hc(mf_emit *e, const char *pre, const char *which)
{
    const mf_config *c = e->c;
    int64_t mix = (int64_t)(2 + c->hc_mult) * c->hc_mult;
    int64_t in = (int64_t)c->hc_mult * c->hidden_size;
    mf_put(e, MF_DTYPE_F32, 2, mix, in, MF_ROLE_HC_FN, in, "%s.hc_%s_fn", pre, which);
    mf_put(e, MF_DTYPE_F32, 1, mix, 0, MF_ROLE_HC_BASE, 0, "%s.hc_%s_base", pre, which);
    mf_put(e, MF_DTYPE_F32, 1, 3, 0, MF_ROLE_HC_SCALE, 0, "%s.hc_%s_scale", pre, which);
}

static void mf_put_engram(mf_emit *e, const char *pre, int slot)
{
    const mf_config *c = e->c;
    char p[MF_LAYOUT_NAME_BYTES];
    int64_t rows = c->engram_num_embeddings[slot], d = c->engram_head_dim, H = c->hidden_size;
    int64_t cols = (int64_t)(c->engram_max_ngram_size - 1) * c->engram_n_heads;
    mf_put(e, MF_DTYPE_F8_E4M3, 2, rows, d, MF_ROLE_TABLE, 0, "%s.engram.embed.weight", pre);
    mf_put(e, MF_DTYPE_F8_E8M0, 2, rows, d / 32, MF_ROLE_TABLE_SCALE, 0, "%s.engram.embed.scale", pre);
    snprintf(p, sizeof p, "%s.engram.wkv", pre);
    mf_put_fp8(e, (int64_t)(c->hc_mult + 1) * H, cols * d, p);
    mf_put(e, MF_DTYPE_BF16, 2, c->hc_mult, H, MF_ROLE_LINEAR, H, "%s.engram.q_weight", pre);
    mf_put(e, MF_DTYPE_BF16, 2, c->hc_mult, H, MF_ROLE_LINEAR, H, "%s.engram.k_weight", pre);
}

/* The attention sublayer; the compressor and indexer on KV and index sources (never a draft
 * stage). */
static void mf_put_attn(mf_emit *e, const char *pre, int L)
{
    const mf_config *c = e->c;
    char p[MF_LAYOUT_NAME_BYTES];
    int64_t H = c->hidden_size, D = c->head_dim;
    mf_put_hc(e, pre, "attn");
    mf_put(e, MF_DTYPE_BF16, 1, H, 0, MF_ROLE_NORM, 0, "%s.attn_norm.weight", pre);
    snprintf(p, sizeof p, "%s.attn.wq_a", pre);
    mf_put_fp8(e, c->q_lora_rank, H, p);
    mf_put(e, MF_DTYPE_BF16, 1, c->q_lora_rank, 0, MF_ROLE_NORM, 0, "%s.attn.q_norm.weight", pre);
    snprintf(p, sizeof p, "%s.attn.wq_b", pre);
    mf_put_fp8(e, (int64_t)c->n_heads * D, c->q_lora_rank, p);
    snprintf(p, sizeof p, "%s.attn.wkv", pre);
    mf_put_fp8(e, (int64_t)c->n_kv_heads * D, H, p);
    mf_put(e, MF_DTYPE_BF16, 1, D, 0, MF_ROLE_NORM, 0, "%s.attn.kv_norm.weight", pre);
    snprintf(p, sizeof p, "%s.attn.wo_a", pre);
    mf_put_fp8(e, (int64_t)c->o_groups * c->o_lora_rank, (int64_t)c->n_heads * D / c->o_groups, p);
    snprintf(p, sizeof p, "%s.attn.wo_b", pre);
    mf_put_fp8(e, H, (int64_t)c->o_groups * c->o_lora_rank, p);
    mf_put(e, MF_DTYPE_F32, 1, c->n_heads, 0, MF_ROLE_SINK, 0, "%s.attn.attn_sink", pre);
    if (L >= c->n_layers) return;
    int kv_src = mf_config_is_kv_source(c, L), idx_src = mf_config_is_index_source(c, L);
    if (kv_src) {
        mf_put(e, MF_DTYPE_BF16, 2, D, H, MF_ROLE_LINEAR, H, "%s.attn.compressor.wkv.weight", pre);
        if (c->compress_ratios[L] == 2)
            mf_put(e, MF_DTYPE_BF16, 2, D, H, MF_ROLE_LINEAR, H, "%s.attn.compressor.wgate.weight", pre);
        mf_put(e, MF_DTYPE_BF16, 1, D, 0, MF_ROLE_NORM, 0, "%s.attn.compressor.norm.weight", pre);
    }
    if (idx_src) {
        snprintf(p, sizeof p, "%s.attn.indexer.wq_b", pre);
        mf_put_fp8(e, (int64_t)c->index_n_heads * c->index_head_dim, c->q_lora_rank, p);
        mf_put(e, MF_DTYPE_BF16, 2, c->index_n_heads, H, MF_ROLE_LINEAR, H,
               "%s.attn.indexer.weights_proj.weight", pre);
    }
    if (kv_src) {
        mf_put(e, MF_DTYPE_BF16, 2, c->index_head_dim, D, MF_ROLE_LINEAR, D, "%s.attn.indexer.wk.weight", pre);
        mf_put(e, MF_DTYPE_BF16, 1, c->index_head_dim, 0, MF_ROLE_NORM, 0, "%s.attn.indexer.k_norm.weight", pre);
    }
}

/* The MoE sublayer: the router, the shared expert, the layer's routed experts (the draft's own
 * count on draft stages). */
static void mf_put_ffn(mf_emit *e, const char *pre, int L)
{
    const mf_config *c = e->c;
    char p[MF_LAYOUT_NAME_BYTES];
    int64_t H = c->hidden_size, E = mf_config_layer_experts(c, L);
    mf_put_hc(e, pre, "ffn");
    mf_put(e, MF_DTYPE_BF16, 1, H, 0, MF_ROLE_NORM, 0, "%s.ffn_norm.weight", pre);
    mf_put(e, MF_DTYPE_BF16, 2, E, H, MF_ROLE_LINEAR, H, "%s.ffn.gate.weight", pre);
    mf_put(e, MF_DTYPE_F32, 1, E, 0, MF_ROLE_BIAS, 0, "%s.ffn.gate.bias", pre);
    /* the routing bias for vision tokens: V4.1 is multimodal and ships it on every layer (and
     * draft stage); text decoding does not use it, but it is part of the checkpoint (40 x 1,536 B
     * in flash41's backbone) */
    mf_put(e, MF_DTYPE_F32, 1, E, 0, MF_ROLE_BIAS, 0, "%s.ffn.gate.bias_vl", pre);
    if (c->n_shared_experts > 0) {
        int64_t m = (int64_t)c->n_shared_experts * c->moe_intermediate_size;
        snprintf(p, sizeof p, "%s.ffn.shared_experts.w1", pre);
        mf_put_fp8(e, m, H, p);
        snprintf(p, sizeof p, "%s.ffn.shared_experts.w2", pre);
        mf_put_fp8(e, H, m, p);
        snprintf(p, sizeof p, "%s.ffn.shared_experts.w3", pre);
        mf_put_fp8(e, m, H, p);
    }
    int64_t m = c->moe_intermediate_size;
    for (int x = 0; x < E; x++) {
        snprintf(p, sizeof p, "%s.ffn.experts.%d.w1", pre, x);
        mf_put_fp4(e, m, H, p);
        snprintf(p, sizeof p, "%s.ffn.experts.%d.w2", pre, x);
        mf_put_fp4(e, H, m, p);
        snprintf(p, sizeof p, "%s.ffn.experts.%d.w3", pre, x);
        mf_put_fp4(e, m, H, p);
    }
}

static void mf_put_layer(mf_emit *e, int L)
{
    char pre[32];
    snprintf(pre, sizeof pre, "layers.%d", L);
    e->layer = L;
    int slot = mf_config_engram_slot(e->c, L);
    if (slot >= 0) mf_put_engram(e, pre, slot);   /* Engram at block entry */
    mf_put_attn(e, pre, L);
    mf_put_ffn(e, pre, L);
}

/* Draft stage s (docs/dspark.md; the names of the released checkpoint, which NeMo AutoModel's
 * DeepseekV41DSparkStateDictAdapter reads): a backbone block without Engram, compressor or
 * indexer; stage 0 first projects the target's features (main_proj FP8 [H, targets x H],
 * main_norm); the last stage ends with the final norm, the Markov head (embed and head, BF16
 * [V, rank]) and the confidence head (BF16 [1, H + rank]: the released census has it 2 bytes a
 * value). */
static void mf_put_draft(mf_emit *e, int s)
{
    const mf_config *c = e->c;
    char pre[32], p[MF_LAYOUT_NAME_BYTES];
    int64_t H = c->hidden_size, R = c->dspark_markov_rank;
    snprintf(pre, sizeof pre, "mtp.%d", s);
    e->layer = -1;
    e->stage = s;
    int L = c->n_layers + s;   /* its index among the config's layers (compress_ratios, experts) */
    if (s == 0) {
        snprintf(p, sizeof p, "%s.main_proj", pre);
        mf_put_fp8(e, H, (int64_t)c->n_dspark_target * H, p);
        mf_put(e, MF_DTYPE_BF16, 1, H, 0, MF_ROLE_NORM, 0, "%s.main_norm.weight", pre);
    }
    mf_put_attn(e, pre, L);
    mf_put_ffn(e, pre, L);
    if (s == c->n_mtp_layers - 1) {
        mf_put(e, MF_DTYPE_BF16, 1, H, 0, MF_ROLE_NORM, 0, "%s.norm.weight", pre);
        mf_put(e, MF_DTYPE_BF16, 2, c->vocab_size, R, MF_ROLE_EMBED, 0, "%s.markov_head.embed.weight", pre);
        mf_put(e, MF_DTYPE_BF16, 2, c->vocab_size, R, MF_ROLE_LINEAR, R, "%s.markov_head.head.weight", pre);
        mf_put(e, MF_DTYPE_BF16, 2, 1, H + R, MF_ROLE_LINEAR, H + R, "%s.confidence_head.proj.weight", pre);
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
    for (int s = 0; s < c->n_mtp_layers; s++) mf_put_draft(e, s);
}

int mf_layout_build(const mf_config *c, mf_layout **out)
{
    *out = NULL;
    int rc = mf_config_validate("layout", c);
    if (rc) return rc;
    mf_emit e = {NULL, 0, -1, -1, c};
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
    e = (mf_emit){t, 0, -1, -1, c};
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

uint64_t mf_config_draft_bytes(const mf_config *c)
{
    mf_layout *l;
    if (mf_layout_build(c, &l)) return 0;
    uint64_t s = mf_layout_group_bytes(l, MF_GROUP_MTP);
    mf_layout_free(l);
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
