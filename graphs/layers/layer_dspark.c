/* The DSpark draft's forward (graphs/layers/layers.h, docs/dspark.md): the target's features
 * projected into every stage's window-KV ring, the parallel block of anchor + noise embeddings
 * through the stages (hyper-connections, window attention over the context and the block, MoE of
 * the draft's own experts), and the last stage's heads: the target's head plus the Markov head,
 * and the confidence head. Formulas as NeMo AutoModel 0.7.0's deepseek_v41/dspark.py computes
 * them, rounded where the backbone's math rounds (the HF port's places). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/layers/layers.h"
#include "sched/error.h"

int64_t mf_ly_draft_ring_slots(const mf_config *c) { return (int64_t)c->sliding_window + c->dspark_block_size; }

int64_t mf_ly_draft_ring_bytes(const mf_config *c)
{
    return (int64_t)c->n_mtp_layers * mf_ly_draft_ring_slots(c) * mf_ly_ring_row_bytes(c);
}

static uint8_t *mf_ly_draft_slot(const mf_config *c, const mf_ly_draft_state *ds, int s, int64_t p)
{
    int64_t R = mf_ly_draft_ring_slots(c);
    return ds->ring + ((int64_t)s * R + p % R) * mf_ly_ring_row_bytes(c);
}

void mf_ly_draft_feature(const mf_config *c, const float *x, float *out)
{
    int64_t H = c->hidden_size;
    for (int64_t d = 0; d < H; d++) {
        double acc = 0;
        for (int s = 0; s < c->hc_mult; s++) acc += x[s * H + d];
        out[d] = mf_bf((float)(acc / c->hc_mult));
    }
}

int mf_ly_draft_ws_new(const mf_config *c, mf_ly_draft_ws *ws)
{
    memset(ws, 0, sizeof *ws);
    size_t f = sizeof(float), B = (size_t)c->dspark_block_size, H = (size_t)c->hidden_size, D = (size_t)c->head_dim;
    struct { size_t bytes; float **ptr; } t[] = {
        {B * (size_t)c->hc_mult * H * f, &ws->x},
        {B * MF_LY_MAX_HC * f, &ws->pre},
        {B * (size_t)c->n_heads * D * f, &ws->q},
        {B * D * f, &ws->kv},
        {((size_t)c->sliding_window + B) * D * f, &ws->keys},
        {B * H * f, &ws->out},
        {H * f, &ws->feat},
        {B * H * f, &ws->normed},
        {(size_t)c->dspark_markov_rank * f, &ws->mk_emb},
        {(size_t)c->vocab_size * f, &ws->mk_out},
    };
    size_t total = 0;
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) total += (t[i].bytes + 63) / 64 * 64;
    uint8_t *p = calloc(1, total);
    if (!p) return mf_error(-ENOMEM, "draft: out of memory for a block's activations (%zu bytes)", total);
    ws->mem = p;
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        *t[i].ptr = (float *)p;
        p += (t[i].bytes + 63) / 64 * 64;
    }
    return 0;
}

void mf_ly_draft_ws_free(mf_ly_draft_ws *ws)
{
    free(ws->mem);
    memset(ws, 0, sizeof *ws);
}

/* The model's draft stage s, or NULL (with an error) when it was not loaded. */
static const mf_model_layer *mf_ly_draft_layer(const mf_layers *ly, int s)
{
    const mf_model_layer *y = mf_model_has_draft(ly->m) ? mf_model_layer_at(ly->m, ly->c->n_layers + s) : NULL;
    if (!y) mf_error(-EINVAL, "draft: the model was loaded without its DSpark draft (mf_model_opts.load_draft)");
    return y;
}

void mf_ly_draft_feed_norm(const mf_ly_ctx *cx, float *u)
{
    const mf_config *c = cx->ly->c;
    mf_bf_n(u, c->hidden_size);
    mf_ly_rmsnorm(u, c->hidden_size, &mf_model_layer_at(cx->ly->m, c->n_layers)->main_norm, c->rms_norm_eps, u);
}

void mf_ly_draft_feed_put(const mf_ly_ctx *cx, mf_ly_draft_state *ds, int s, int64_t pos, float *kv)
{
    const mf_config *c = cx->ly->c;
    float *b[MF_LY_A_N] = {0};
    b[MF_LY_A_KV] = kv;
    mf_ly_item it = {.pos = pos};
    mf_ly_attn_kv_window(cx, &it, c->n_layers + s, b);   /* kv_norm, RoPE, fp8 (the backbone's formula) */
    uint8_t *row = mf_ly_draft_slot(c, ds, s, pos);
    mf_ly_pack_e4m3_pow2(kv, c->head_dim, MF_LY_RING_BLOCK, row, row + c->head_dim);
}

int mf_ly_draft_feed_kv(mf_ly_ctx *cx, mf_ly_draft_state *ds, float *u)
{
    const mf_config *c = cx->ly->c;
    if (!mf_ly_draft_layer(cx->ly, 0)) return -EINVAL;
    float kv[MF_LY_DRAFT_MAX_D];
    if (c->head_dim > MF_LY_DRAFT_MAX_D)
        return mf_error(-EINVAL, "draft: head_dim %d (max %d) not supported", c->head_dim, MF_LY_DRAFT_MAX_D);
    mf_ly_draft_feed_norm(cx, u);
    for (int s = 0; s < c->n_mtp_layers; s++) {   /* each stage's window KV of it: bf16(wkv u), ... */
        int rc = mf_ly_linear(cx, &mf_model_layer_at(cx->ly->m, c->n_layers + s)->wkv, u, kv, cx->ly->act_quant);
        if (rc) return rc;
        mf_ly_draft_feed_put(cx, ds, s, ds->n_pos, kv);
    }
    ds->n_pos++;
    return 0;
}

int mf_ly_draft_feed(mf_ly_ctx *cx, mf_ly_draft_ws *ws, mf_ly_draft_state *ds, const float *feat)
{
    const mf_model_layer *y0 = mf_ly_draft_layer(cx->ly, 0);
    if (!y0) return -EINVAL;
    /* stage 0's projection of the features, shared by every stage's keys */
    int rc = mf_ly_linear(cx, &y0->main_proj, feat, ws->feat, cx->ly->act_quant);
    return rc ? rc : mf_ly_draft_feed_kv(cx, ds, ws->feat);
}

int64_t mf_ly_draft_context(const mf_config *c, const mf_ly_draft_state *ds, int s, int64_t a, float *keys)
{
    int64_t D = c->head_dim, t0 = a - c->sliding_window < 0 ? 0 : a - c->sliding_window, n_ctx = a - t0;
    for (int64_t t = 0; t < n_ctx; t++) {
        const uint8_t *row = mf_ly_draft_slot(c, ds, s, t0 + t);
        mf_ly_unpack_e4m3_pow2(row, row + D, D, MF_LY_RING_BLOCK, keys + t * D);
    }
    return n_ctx;
}

void mf_ly_draft_head(mf_ly_ctx *cx, int L, int64_t pos, int h, float *q, const float *keys, int64_t n_keys, float *o)
{
    const mf_config *c = cx->ly->c;
    int D = c->head_dim, rd = c->qk_rope_head_dim;
    const mf_model_layer *y = mf_model_layer_at(cx->ly->m, L);
    float *qh = q + (int64_t)h * D, *oh = o + (int64_t)h * D;
    mf_bf_n(qh, D);
    mf_ly_rope(qh + D - rd, rd / 2, cx->ly->freqs_main, pos, 0);
    mf_bf_n(qh, D);
    mf_ly_attn_sink_rows(qh, keys, n_keys, D, mf_ly_vec(&y->attn_sink, h), cx->scores, cx->attn_acc, oh);
    mf_ly_rope(oh + D - rd, rd / 2, cx->ly->freqs_main, pos, 1);   /* inverse, at the query */
    mf_bf_n(oh + D - rd, rd);
}

/* The attention sublayer of stage s over the block: in (B x hidden, normed) -> ws->out. Queries
 * and the block's KV first (every position sees every other), then per position its heads over
 * the context a-W..a-1 and the block, the output projections. */
static int mf_ly_draft_attn(mf_ly_ctx *cx, mf_ly_draft_ws *ws, const mf_ly_draft_state *ds, int s, const float *in)
{
    const mf_config *c = cx->ly->c;
    int L = c->n_layers + s, B = c->dspark_block_size, D = c->head_dim;
    int64_t H = c->hidden_size, a = ds->n_pos, QD = (int64_t)c->n_heads * D;
    float *b[MF_LY_A_N];
    for (int k = 0; k < MF_LY_A_N; k++) b[k] = cx->attn[k];
    int rc = 0;
    for (int i = 0; i < B && !rc; i++) {
        b[MF_LY_A_IN] = (float *)in + i * H;
        rc = mf_ly_attn_stage(cx, L, MF_LY_A_STAGE_IN, b);   /* wq_a (bf16), wkv */
        if (rc) break;
        mf_ly_attn_qnorm(cx, L, b);
        if ((rc = mf_ly_attn_stage(cx, L, MF_LY_A_STAGE_QB, b))) break;
        memcpy(ws->q + i * QD, b[MF_LY_A_Q], (size_t)QD * sizeof(float));
        mf_ly_item it = {.pos = a + i};
        mf_ly_attn_kv_window(cx, &it, L, b);
        memcpy(ws->kv + (int64_t)i * D, b[MF_LY_A_KV], (size_t)D * sizeof(float));
    }
    /* keys: the context's rows from the ring, then the block's */
    int64_t n_ctx = mf_ly_draft_context(c, ds, s, a, ws->keys);
    memcpy(ws->keys + n_ctx * D, ws->kv, (size_t)B * D * sizeof(float));
    for (int i = 0; i < B && !rc; i++) {
        for (int h = 0; h < c->n_heads; h++) mf_ly_draft_head(cx, L, a + i, h, ws->q + i * QD, ws->keys, n_ctx + B, b[MF_LY_A_O]);
        b[MF_LY_A_OUT] = ws->out + i * H;
        if (!(rc = mf_ly_attn_stage(cx, L, MF_LY_A_STAGE_OA, b))) rc = mf_ly_attn_stage(cx, L, MF_LY_A_STAGE_OB, b);
    }
    return rc;
}

/* Stage s over the block: the backbone block's wiring without Engram (mixes of the streams, the
 * carried pre into the attention, the attention mix's pre into the MoE, the MoE mix's pre carried
 * on), with the draft's attention and the stage's MoE. */
static int mf_ly_draft_stage(mf_ly_ctx *cx, mf_ly_draft_ws *ws, const mf_ly_draft_state *ds, int s, int32_t *routes)
{
    const mf_config *c = cx->ly->c;
    int L = c->n_layers + s, B = c->dspark_block_size, hc = c->hc_mult, K = c->dspark_num_experts_per_tok;
    int64_t H = c->hidden_size, X = (int64_t)hc * H;
    const mf_model_layer *y = mf_model_layer_at(cx->ly->m, L);
    float mixes[(2 + MF_LY_MAX_HC) * MF_LY_MAX_HC], post[MF_LY_MAX_HC], comb[MF_LY_MAX_HC * MF_LY_MAX_HC];
    float pre_a[64][MF_LY_MAX_HC], post_a[64][MF_LY_MAX_HC], comb_a[64][MF_LY_MAX_HC * MF_LY_MAX_HC];
    float *in = ws->normed;   /* B x hidden, the sublayers' normed inputs (scratch until the last stage) */
    for (int i = 0; i < B; i++) {
        float *x = ws->x + i * X;
        mf_ly_hc_mixes(cx, x, &y->hc_attn_fn, mixes);
        mf_ly_hc_split_w(c, mixes, &y->hc_attn_scale, &y->hc_attn_base, pre_a[i], post_a[i], comb_a[i]);
        mf_ly_hc_collapse(cx, x, ws->pre + i * MF_LY_MAX_HC, cx->hc_h);   /* the carried pre */
        mf_ly_rmsnorm(cx->hc_h, H, &y->attn_norm, c->rms_norm_eps, in + i * H);
    }
    int rc = mf_ly_draft_attn(cx, ws, ds, s, in);
    for (int i = 0; i < B && !rc; i++) {
        float *x = ws->x + i * X, pre_f[MF_LY_MAX_HC];
        mf_ly_hc_expand(cx, x, ws->out + i * H, post_a[i], comb_a[i]);
        mf_ly_hc_mixes(cx, x, &y->hc_ffn_fn, mixes);
        mf_ly_hc_split_w(c, mixes, &y->hc_ffn_scale, &y->hc_ffn_base, pre_f, post, comb);
        mf_ly_hc_collapse(cx, x, pre_a[i], cx->hc_h);   /* the attention mix's pre */
        mf_ly_rmsnorm(cx->hc_h, H, &y->ffn_norm, c->rms_norm_eps, cx->sub_in);
        mf_ly_item it = {.pos = ds->n_pos + i, .routes = routes ? routes + ((int64_t)s * B + i) * K : NULL};
        if ((rc = mf_ly_moe(cx, &it, L, cx->sub_in, cx->sub_out))) break;
        mf_ly_hc_expand(cx, x, cx->sub_out, post, comb);
        memcpy(ws->pre + i * MF_LY_MAX_HC, pre_f, sizeof pre_f);
    }
    return rc;
}

int mf_ly_draft_block(mf_ly_ctx *cx, mf_ly_draft_ws *ws, const mf_ly_draft_state *ds, int32_t anchor,
                      int32_t *routes)
{
    const mf_config *c = cx->ly->c;
    int B = c->dspark_block_size, hc = c->hc_mult, S = c->n_mtp_layers;
    int64_t H = c->hidden_size, X = (int64_t)hc * H;
    if (!mf_ly_draft_layer(cx->ly, 0)) return -EINVAL;
    if (anchor < 0 || anchor >= c->vocab_size)
        return mf_error(-EINVAL, "draft: anchor token %d outside the vocabulary [0, %lld)", anchor,
                        (long long)c->vocab_size);
    if (B > 64) return mf_error(-EINVAL, "draft: dspark_block_size %d (max 64) not supported", B);
    int rc = mf_ly_ctx_reserve(cx, B);
    if (rc) return rc;
    /* streams: the anchor's embedding, then the noise token's, in every stream; pre one-hot */
    const mf_weight *emb = mf_model_embed(cx->ly->m);
    for (int i = 0; i < B; i++) {
        int64_t tok = i == 0 ? anchor : c->dspark_noise_token_id;
        float *x = ws->x + i * X;
        for (int64_t d = 0; d < H; d++) {
            uint16_t v;
            memcpy(&v, emb->data + (tok * H + d) * 2, 2);
            x[d] = mf_bf16_to_f32(v);
        }
        for (int k = 1; k < hc; k++) memcpy(x + k * H, x, (size_t)H * sizeof *x);
        float *pre = ws->pre + i * MF_LY_MAX_HC;
        memset(pre, 0, MF_LY_MAX_HC * sizeof *pre);
        pre[0] = 1.0f;
    }
    for (int s = 0; s < S && !rc; s++) rc = mf_ly_draft_stage(cx, ws, ds, s, routes);
    if (rc) return rc;
    /* the final collapse (the last MoE mix's pre) and norm */
    const mf_model_layer *yl = mf_model_layer_at(cx->ly->m, c->n_layers + S - 1);
    for (int i = 0; i < B; i++) {
        mf_ly_hc_collapse(cx, ws->x + i * X, ws->pre + i * MF_LY_MAX_HC, cx->hc_h);
        mf_ly_rmsnorm(cx->hc_h, H, &yl->out_norm, c->rms_norm_eps, ws->normed + i * H);
    }
    return 0;
}

void mf_ly_draft_mk_emb(const mf_layers *ly, int32_t prev, float *emb)
{
    const mf_config *c = ly->c;
    const mf_model_layer *yl = mf_model_layer_at(ly->m, c->n_layers + c->n_mtp_layers - 1);
    for (int64_t r = 0; r < c->dspark_markov_rank; r++) {   /* a bf16 row */
        uint16_t v;
        memcpy(&v, yl->mk_embed.data + ((int64_t)prev * c->dspark_markov_rank + r) * 2, 2);
        emb[r] = mf_bf16_to_f32(v);
    }
}

float mf_ly_draft_confidence(const mf_layers *ly, const float *normed, const float *emb)
{
    const mf_config *c = ly->c;
    const mf_model_layer *yl = mf_model_layer_at(ly->m, c->n_layers + c->n_mtp_layers - 1);
    int64_t H = c->hidden_size, R = c->dspark_markov_rank;
    double acc = 0;   /* fp32 proj of [normed, markov embedding] */
    for (int64_t d = 0; d < H + R; d++) acc += (double)mf_ly_vec(&yl->conf_proj, d) * (d < H ? normed[d] : emb[d - H]);
    return (float)acc;
}

int mf_ly_draft_heads(mf_ly_ctx *cx, const mf_ly_draft_ws *ws, int i, int32_t prev, float *logits,
                      float *confidence)
{
    const mf_config *c = cx->ly->c;
    const mf_model_layer *yl = mf_ly_draft_layer(cx->ly, c->n_mtp_layers - 1);
    if (!yl) return -EINVAL;
    if (i < 0 || i >= c->dspark_block_size || prev < 0 || prev >= c->vocab_size)
        return mf_error(-EINVAL, "draft: heads of position %d after token %d (expected 0..%d and a token id < %lld)",
                        i, prev, c->dspark_block_size - 1, (long long)c->vocab_size);
    int64_t H = c->hidden_size, V = c->vocab_size;
    const float *h = ws->normed + (int64_t)i * H;
    mf_ly_draft_mk_emb(cx->ly, prev, ws->mk_emb);   /* the Markov embedding of the token before */
    int rc = mf_ly_linear(cx, mf_model_head(cx->ly->m), h, logits, 0);   /* fp32, the target's head */
    if (!rc) rc = mf_ly_linear(cx, &yl->mk_head, ws->mk_emb, ws->mk_out, 0);
    if (rc) return rc;
    for (int64_t v = 0; v < V; v++) logits[v] += mf_bf(ws->mk_out[v]);   /* the head's bf16 output */
    *confidence = mf_ly_draft_confidence(cx->ly, h, ws->mk_emb);
    return 0;
}
