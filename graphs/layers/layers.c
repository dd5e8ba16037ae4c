/* The layer math's tables and contexts (graphs/layers/layers.h): the model's RoPE tables, Engram hash
 * parameters and token map, built once; a context's named scratch, sized from the model in one
 * table and carved from one allocation. The math itself is in graphs/layer_*.c. */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/layers/layers.h"
#include "sched/error.h"

void mf_ly_rope_freqs(const mf_config *c, int layer, float *freqs)
{
    int rd = c->qk_rope_head_dim, ratio = c->compress_ratios[layer];
    double base = ratio ? c->compress_rope_theta : c->rope_theta;
    int yarn = ratio && c->yarn_factor > 0;
    double low = 0, high = 0;
    if (yarn) {
        double orig = (double)c->yarn_original_max_position_embeddings;
        double cd_fast = rd * log(orig / (c->yarn_beta_fast * 2 * M_PI)) / (2 * log(base));
        double cd_slow = rd * log(orig / (c->yarn_beta_slow * 2 * M_PI)) / (2 * log(base));
        low = floor(cd_fast) > 0 ? floor(cd_fast) : 0;
        high = ceil(cd_slow) < rd - 1 ? ceil(cd_slow) : rd - 1;
        if (high == low) high += 0.001;
    }
    for (int j = 0; j < rd / 2; j++) {
        double f = pow(base, -2.0 * j / rd);
        if (yarn) {
            double ramp = (j - low) / (high - low);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            f = f / c->yarn_factor * ramp + f * (1 - ramp);
        }
        freqs[j] = (float)f;
    }
}

/* A named buffer of a size table: sized first, then carved from one allocation. */
typedef struct mf_ly_buf {
    const char *name;
    size_t bytes;
    void **ptr;
} mf_ly_buf;

/* Total bytes of the table, each buffer 64-byte aligned. */
static size_t mf_ly_bufs_bytes(const mf_ly_buf *b, int n)
{
    size_t total = 0;
    for (int i = 0; i < n; i++) total += (b[i].bytes + 63) / 64 * 64;
    return total;
}

/* One zeroed allocation for the table; each pointer set (NULL for 0 bytes). */
static void *mf_ly_bufs_alloc(const mf_ly_buf *b, int n, const char *what)
{
    size_t total = mf_ly_bufs_bytes(b, n);
    uint8_t *p = aligned_alloc(64, total ? total : 64);
    if (!p) {
        mf_error(-ENOMEM, "layers: cannot allocate %zu bytes of %s", total, what);
        return NULL;
    }
    memset(p, 0, total);
    uint8_t *q = p;
    for (int i = 0; i < n; i++) {
        *b[i].ptr = b[i].bytes ? q : NULL;
        q += (b[i].bytes + 63) / 64 * 64;
    }
    return p;
}

static int64_t mf_max64(int64_t a, int64_t b) { return a > b ? a : b; }

int mf_layers_new(const mf_model *m, const mf_ref_opts *opts, mf_layers **out)
{
    *out = NULL;
    const mf_config *c = mf_model_config(m);
    int rc = mf_config_validate("reference", c);
    if (rc) return rc;
    if (c->n_experts_per_tok > 256 || c->engram_head_dim > 4096)
        return mf_error(-EINVAL, "reference: num_experts_per_tok %d (max 256) or engram_head_dim %d "
                        "(max 4096) not supported", c->n_experts_per_tok, c->engram_head_dim);
    if (c->index_head_dim > MF_LY_MAX_INDEX_DIM)
        return mf_error(-EINVAL, "reference: index_head_dim %d (max %d) not supported", c->index_head_dim,
                        MF_LY_MAX_INDEX_DIM);
    mf_layers *ly = calloc(1, sizeof *ly);
    if (!ly) return mf_error(-ENOMEM, "layers: out of memory");
    ly->m = m;
    ly->c = c;
    if (opts) {
        ly->act_quant = opts->act_quant;
        ly->hooks = opts->hooks;
    }
    size_t rd2 = (size_t)c->qk_rope_head_dim / 2, per = (size_t)(c->engram_max_ngram_size - 1) * c->engram_n_heads;
    mf_ly_buf b[2 * MF_CONFIG_MAX_ENGRAM + 3] = {
        {"token map", (size_t)c->vocab_size * sizeof(int32_t), (void **)&ly->token_map},
        {"RoPE table", rd2 * sizeof(float), (void **)&ly->freqs_main},
        {"RoPE table (YaRN)", rd2 * sizeof(float), (void **)&ly->freqs_comp},
    };
    int n = 3;
    for (int k = 0; k < c->n_engram; k++) {
        b[n++] = (mf_ly_buf){"Engram primes", per * sizeof(int64_t), (void **)&ly->eg_prime[k]};
        b[n++] = (mf_ly_buf){"Engram offsets", per * sizeof(int64_t), (void **)&ly->eg_off[k]};
    }
    if (!(ly->mem = mf_ly_bufs_alloc(b, n, "the model's tables"))) {
        free(ly);
        return -ENOMEM;
    }
    /* RoPE tables: one without YaRN (ratio-0 layers), one with (the others) */
    for (int L = 0; L < c->n_layers; L++)
        mf_ly_rope_freqs(c, L, c->compress_ratios[L] ? ly->freqs_comp : ly->freqs_main);
    int src = -1;
    for (int L = 0; L < c->n_layers; L++) {
        if (mf_config_is_kv_source(c, L)) src = L;
        ly->src_of[L] = c->compress_ratios[L] ? src : -1;
    }
    /* Engram token map */
    int64_t cv = c->engram_compressed_vocab_size > 0 ? c->engram_compressed_vocab_size : 1;
    if (opts && opts->token_map && c->n_engram > 0) {   /* only Engram layers read the map */
        if (opts->n_token_map < 1 || opts->n_token_map > c->vocab_size) {
            mf_layers_free(ly);
            return mf_error(-EINVAL, "reference: token map has %" PRId64 " entries, expected 1..%" PRId64,
                            opts->n_token_map, c->vocab_size);
        }
        for (int64_t i = 0; i < opts->n_token_map; i++)
            if (opts->token_map[i] < 0 || opts->token_map[i] >= cv) {
                mf_layers_free(ly);
                return mf_error(-EINVAL, "reference: token map entry %" PRId64 " = %d is outside "
                                "[0, engram_compressed_vocab_size %" PRId64 ")", i, opts->token_map[i], cv);
            }
        memcpy(ly->token_map, opts->token_map, (size_t)opts->n_token_map * sizeof(int32_t));
        /* ids past the tokenizer's (padding rows of the embedding) map to the pad entry */
        int32_t pad = c->engram_pad_token_id < opts->n_token_map ? opts->token_map[c->engram_pad_token_id] : 0;
        for (int64_t i = opts->n_token_map; i < c->vocab_size; i++) ly->token_map[i] = pad;
    } else {
        for (int64_t i = 0; i < c->vocab_size; i++) ly->token_map[i] = (int32_t)(i % cv);
    }
    if (c->n_engram > 0 && (rc = mf_ly_engram_setup(ly))) {
        mf_layers_free(ly);
        return rc;
    }
    *out = ly;
    return 0;
}

void mf_layers_free(mf_layers *ly)
{
    if (!ly) return;
    free(ly->mem);
    free(ly);
}

int mf_ly_ctx_new(const mf_layers *ly, mf_ly_lin lin, mf_ly_ctx **out)
{
    *out = NULL;
    const mf_config *c = ly->c;
    const mf_model *m = ly->m;
    mf_ly_ctx *cx = calloc(1, sizeof *cx);
    if (!cx) return mf_error(-ENOMEM, "layers: out of memory");
    cx->ly = ly;
    cx->lin = lin;
    int64_t H = c->hidden_size, hc = c->hc_mult, E = c->n_routed_experts;
    if (c->n_mtp_layers > 0) E = mf_max64(E, c->dspark_n_routed_experts);   /* the draft's router */
    int64_t per = (int64_t)(c->engram_max_ngram_size - 1) * c->engram_n_heads, egd = c->engram_head_dim;
    int64_t ffn = c->moe_intermediate_size;   /* an expert's hidden size: routed or shared */
    for (int L = 0; c->n_shared_experts > 0 && L < c->n_layers; L++)
        ffn = mf_max64(ffn, mf_model_layer_at(m, L)->sh_w1.rows);
    /* the widest input of a linear that may be act-quantized */
    int64_t wide = mf_max64(H, c->q_lora_rank);
    wide = mf_max64(wide, (int64_t)c->o_groups * c->o_lora_rank);
    wide = mf_max64(wide, ffn);
    wide = mf_max64(wide, per * egd);
    if (c->n_mtp_layers > 0) wide = mf_max64(wide, (int64_t)c->n_dspark_target * H);   /* the draft's main_proj */
    uint64_t lazy_d = 0, lazy_s = 0;
    if (mf_model_is_lazy(m)) {
        const mf_model_layer *y = mf_model_layer_at(m, 0);
        for (int k = 0; k < 3; k++) {
            lazy_d = mf_weight_data_bytes(&y->experts[k]) > lazy_d ? mf_weight_data_bytes(&y->experts[k]) : lazy_d;
            lazy_s = mf_weight_scale_bytes(&y->experts[k]) > lazy_s ? mf_weight_scale_bytes(&y->experts[k]) : lazy_s;
        }
    }
    size_t f = sizeof(float);
    mf_ly_buf b[32 + MF_LY_A_N] = {
        {"hc_xn", (size_t)(4 * hc * H) * f, (void **)&cx->hc_xn},   /* fast_attn.h mf_fa_mix_items sizes its blocks to it */
        {"hc_h", (size_t)H * f, (void **)&cx->hc_h},
        {"sub_in", (size_t)H * f, (void **)&cx->sub_in},
        {"sub_out", (size_t)H * f, (void **)&cx->sub_out},
        {"aq", (size_t)wide * f, (void **)&cx->aq},
        {"attn_acc", (size_t)c->head_dim * sizeof(double), (void **)&cx->attn_acc},
        {"sel_kv", (size_t)c->index_topk * c->head_dim * f, (void **)&cx->sel_kv},
        {"win_kv", (size_t)c->sliding_window * c->head_dim * f, (void **)&cx->win_kv},
        {"cache_row", (size_t)mf_max64(c->head_dim, c->index_head_dim) * f, (void **)&cx->cache_row},
        {"gate_logits", (size_t)E * f, (void **)&cx->gate_logits},
        {"gate_bias", (size_t)E * f, (void **)&cx->gate_bias},
        {"ffn_g", (size_t)ffn * f, (void **)&cx->ffn_g},
        {"ffn_u", (size_t)ffn * f, (void **)&cx->ffn_u},
        {"ffn_y", (size_t)H * f, (void **)&cx->ffn_y},
        {"moe_acc", (size_t)H * sizeof(double), (void **)&cx->moe_acc},
        {"ex_out", mf_model_store(m) ? (size_t)c->n_experts_per_tok * H * f : 0, (void **)&cx->ex_out},
        {"eg_emb", (size_t)(per * egd) * f, (void **)&cx->eg_emb},
        {"eg_kv", (size_t)((hc + 1) * H) * f, (void **)&cx->eg_kv},
        {"eg_rows", (size_t)per * sizeof(int64_t), (void **)&cx->eg_rows},
        {"eg_codes", (size_t)(per * egd), (void **)&cx->eg_codes},
        {"eg_scales", (size_t)(per * ((egd + 31) / 32)), (void **)&cx->eg_scales},
        {"lazy_data", (size_t)lazy_d, (void **)&cx->lazy_data},
        {"lazy_scale", (size_t)lazy_s, (void **)&cx->lazy_scale},
    };
    int n = 23;
    for (int k = 0; k < MF_LY_A_N; k++)
        if (k != MF_LY_A_IN && k != MF_LY_A_OUT)
            b[n++] = (mf_ly_buf){"attn", (size_t)mf_ly_attn_buf_len(c, k) * f, (void **)&cx->attn[k]};
    if (!(cx->mem = mf_ly_bufs_alloc(b, n, "layer scratch"))) {
        free(cx);
        return -ENOMEM;
    }
    *out = cx;
    return 0;
}

void mf_ly_ctx_free(mf_ly_ctx *cx)
{
    if (!cx) return;
    free(cx->scores);
    free(cx->picks);
    free(cx->mem);
    free(cx);
}

int mf_ly_ctx_reserve(mf_ly_ctx *cx, int64_t max_positions)
{
    const mf_config *c = cx->ly->c;
    int64_t need = max_positions + c->sliding_window + c->index_topk + 1;
    if (need <= cx->n_scores) return 0;
    double *sc = realloc(cx->scores, (size_t)need * sizeof *sc);
    if (sc) cx->scores = sc;
    mf_ly_pick *pk = realloc(cx->picks, (size_t)need * sizeof *pk);
    if (pk) cx->picks = pk;
    if (!sc || !pk) return mf_error(-ENOMEM, "layers: out of memory for score buffers");
    cx->n_scores = need;
    return 0;
}
