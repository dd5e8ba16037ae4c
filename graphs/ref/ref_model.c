/* The reference forward's driver (the oracle): the forward object (the model's tables and one
 * context of graphs/layers/layers.h on the double-sum backend), per-sequence states, and the batch
 * forward: embedding into the hyper-connection streams, the layers (Engram, attention and MoE
 * sublayers wrapped by hyper-connection mixes), the final collapse, norm and the fp32 head. Items
 * run layer by layer (layer-major). */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/layers/layers.h"
#include "graphs/ref/ref.h"
#include "sched/clock.h"
#include "sched/error.h"

/* The oracle: the model's tables and one context on the double-sum backend. */
struct mf_ref {
    mf_layers *ly;
    mf_ly_ctx *cx;
    mf_ref_times times;
};

int mf_ref_new(const mf_model *m, const mf_ref_opts *opts, mf_ref **out)
{
    *out = NULL;
    mf_ref *r = calloc(1, sizeof *r);
    if (!r) return mf_error(-ENOMEM, "reference: out of memory");
    int rc = mf_layers_new(m, opts, &r->ly);
    if (!rc) rc = mf_ly_ctx_new(r->ly, MF_LY_LIN_DOUBLE, &r->cx);
    if (rc) {
        mf_ref_free(r);
        return rc;
    }
    *out = r;
    return 0;
}

const mf_layers *mf_ref_layers(const mf_ref *r) { return r->ly; }

void mf_ref_free(mf_ref *r)
{
    if (!r) return;
    mf_ly_ctx_free(r->cx);
    mf_layers_free(r->ly);
    free(r);
}

const mf_config *mf_ref_config(const mf_ref *r) { return r->ly->c; }

/* Layer L of item it; feat (NULL, or hidden floats) receives the draft's feature of the layer's
 * input (after Engram, before the attention's mix). */
static int mf_ref_layer(mf_ref *r, mf_ly_item *it, int L, float *feat)
{
    mf_ly_ctx *cx = r->cx;
    const mf_config *c = r->ly->c;
    const mf_model_layer *y = mf_model_layer_at(r->ly->m, L);
    int64_t H = c->hidden_size;
    float mixes[(2 + MF_LY_MAX_HC) * MF_LY_MAX_HC], pre_a[MF_LY_MAX_HC], post[MF_LY_MAX_HC];
    float comb[MF_LY_MAX_HC * MF_LY_MAX_HC], pre_f[MF_LY_MAX_HC];
    int rc;
    int64_t t0 = mf_now_ns();
    if (mf_config_engram_slot(c, L) >= 0 && (rc = mf_ly_engram(cx, it, L))) return rc;
    int64_t t1 = mf_now_ns();
    if (feat) mf_ly_draft_feature(c, it->x, feat);

    mf_ly_hc_mixes(cx, it->x, &y->hc_attn_fn, mixes);
    mf_ly_hc_split_w(c, mixes, &y->hc_attn_scale, &y->hc_attn_base, pre_a, post, comb);
    mf_ly_hc_collapse(cx, it->x, it->pre, cx->hc_h);   /* the carried pre */
    mf_ly_rmsnorm(cx->hc_h, H, &y->attn_norm, c->rms_norm_eps, cx->sub_in);
    if ((rc = mf_ly_attn(cx, it, L, cx->sub_in, cx->sub_out))) return rc;
    mf_ly_hc_expand(cx, it->x, cx->sub_out, post, comb);

    mf_ly_hc_mixes(cx, it->x, &y->hc_ffn_fn, mixes);
    mf_ly_hc_split_w(c, mixes, &y->hc_ffn_scale, &y->hc_ffn_base, pre_f, post, comb);
    mf_ly_hc_collapse(cx, it->x, pre_a, cx->hc_h);     /* the attention mix's pre */
    mf_ly_rmsnorm(cx->hc_h, H, &y->ffn_norm, c->rms_norm_eps, cx->sub_in);
    int64_t t2 = mf_now_ns();
    if ((rc = mf_ly_moe(cx, it, L, cx->sub_in, cx->sub_out))) return rc;
    int64_t t3 = mf_now_ns();
    mf_ly_hc_expand(cx, it->x, cx->sub_out, post, comb);
    memcpy(it->pre, pre_f, sizeof pre_f);
    r->times.engram_ns += t1 - t0;
    r->times.moe_ns += t3 - t2;
    r->times.attn_ns += t2 - t1 + mf_now_ns() - t3;
    return 0;
}

int mf_ref_forward(mf_ref *r, mf_ref_state *const *states, const int32_t *tokens, int n,
                   float *const *logits)
{
    return mf_ref_forward_feat(r, states, tokens, n, logits, NULL);
}

/* The draft's feature slot of layer L in item i's feats, or NULL. */
static float *mf_ref_feat_of(const mf_config *c, float *const *feats, int i, int L)
{
    if (!feats || !feats[i]) return NULL;
    for (int k = 0; k < c->n_dspark_target; k++)
        if (c->dspark_target_layer_ids[k] == L) return feats[i] + (int64_t)k * c->hidden_size;
    return NULL;
}

int mf_ref_forward_feat(mf_ref *r, mf_ref_state *const *states, const int32_t *tokens, int n,
                        float *const *logits, float *const *feats)
{
    const mf_config *c = r->ly->c;
    if (n < 1) return mf_error(-EINVAL, "reference: forward of %d items", n);
    int64_t t_start = mf_now_ns();
    /* validate everything before touching a state */
    int64_t need_pos = 0;
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= c->vocab_size)
            return mf_error(-EINVAL, "reference: token %d (item %d) outside the vocabulary [0, %" PRId64 ")",
                            tokens[i], i, c->vocab_size);
        if (states[i]->ly != r->ly)
            return mf_error(-EINVAL, "reference: item %d's state belongs to another forward", i);
        for (int j = 0; i > 0 && states[i - 1] != states[i] && j < i - 1; j++)
            if (states[j] == states[i])
                return mf_error(-EINVAL, "reference: items of one sequence must be consecutive (item %d)", i);
        int64_t k = 0;
        for (int j = 0; j < n; j++) k += states[j] == states[i];
        if (states[i]->n_pos + k > states[i]->max_pos)
            return mf_error(-EINVAL, "reference: sequence would reach %" PRId64 " positions, past its "
                            "maximum of %" PRId64, states[i]->n_pos + k, states[i]->max_pos);
        need_pos = need_pos > states[i]->max_pos ? need_pos : states[i]->max_pos;
    }
    int rc = mf_ly_ctx_reserve(r->cx, need_pos);
    if (!rc) rc = mf_ref_states_reserve(states, n);   /* pages for every position the items reach */
    if (rc) return rc;
    int64_t H = c->hidden_size, X = (int64_t)c->hc_mult * H;
    int n_cb = c->candidate_topk_blocks > 0 ? c->candidate_topk_blocks : 1;
    size_t per = (size_t)X * sizeof(float) + (size_t)c->index_topk * sizeof(int32_t) +
                 (size_t)n_cb * sizeof(int32_t);
    mf_ly_item *items = calloc((size_t)n, sizeof *items);
    uint8_t *mem = calloc((size_t)n, per);
    if (!items || !mem) {
        free(items);
        free(mem);
        return mf_error(-ENOMEM, "reference: out of memory for %d items", n);
    }
    /* positions and token history, embedding into every stream */
    const mf_weight *emb = mf_model_embed(r->ly->m);
    for (int i = 0; i < n; i++) {
        mf_ly_item *it = &items[i];
        uint8_t *p = mem + (size_t)i * per;
        it->x = (float *)p;
        it->topk = (int32_t *)(p + (size_t)X * sizeof(float));
        it->cand = it->topk + c->index_topk;
        it->st = states[i];
        it->pos = i > 0 && states[i - 1] == states[i] ? items[i - 1].pos + 1 : states[i]->n_pos;
        it->tok = tokens[i];
        it->st->tokens[it->pos] = tokens[i];
        it->topk_src = it->cand_src = -1;
        it->pre[0] = 1.0f;
        it->logits = logits ? logits[i] : NULL;
        for (int64_t d = 0; d < H; d++) {
            uint16_t b;
            memcpy(&b, emb->data + ((int64_t)tokens[i] * H + d) * 2, 2);
            it->x[d] = mf_bf16_to_f32(b);
        }
        for (int s = 1; s < c->hc_mult; s++) memcpy(it->x + s * H, it->x, (size_t)H * sizeof(float));
    }
    for (int L = 0; L < c->n_layers && !rc; L++)
        for (int i = 0; i < n && !rc; i++) rc = mf_ref_layer(r, &items[i], L, mf_ref_feat_of(c, feats, i, L));
    int64_t t_head = mf_now_ns();
    for (int i = 0; i < n && !rc; i++) {
        mf_ly_item *it = &items[i];
        if (!it->logits) continue;
        mf_ly_hc_collapse(r->cx, it->x, it->pre, r->cx->hc_h);
        mf_ly_rmsnorm(r->cx->hc_h, H, mf_model_norm(r->ly->m), c->rms_norm_eps, r->cx->sub_in);
        rc = mf_ly_linear(r->cx, mf_model_head(r->ly->m), r->cx->sub_in, it->logits, 0);   /* fp32 */
    }
    r->times.head_ns += mf_now_ns() - t_head;
    if (!rc)
        for (int i = 0; i < n; i++) items[i].st->n_pos = items[i].pos + 1;
    free(items);
    free(mem);
    r->times.total_ns += mf_now_ns() - t_start;
    if (rc) return mf_error_wrap(rc, "reference forward (the states involved are now inconsistent: reset them)");
    return 0;
}

void mf_ref_times_get(const mf_ref *r, mf_ref_times *out) { *out = r->times; }

int mf_ref_prefill(mf_ref *r, mf_ref_state *s, const int32_t *tokens, int n, float *logits)
{
    if (n < 1) return mf_error(-EINVAL, "reference: prefill of %d tokens", n);
    mf_ref_state **st = malloc((size_t)n * sizeof *st);
    float **lg = calloc((size_t)n, sizeof *lg);
    if (!st || !lg) {
        free(st);
        free(lg);
        return mf_error(-ENOMEM, "reference: out of memory");
    }
    for (int i = 0; i < n; i++) st[i] = s;
    lg[n - 1] = logits;
    int rc = mf_ref_forward(r, st, tokens, n, lg);
    free(st);
    free(lg);
    return rc;
}

int mf_ref_decode(mf_ref *r, mf_ref_state *const *states, const int32_t *tokens, int n_seq,
                  float *logits)
{
    if (n_seq < 1 || n_seq > 4096) return mf_error(-EINVAL, "reference: decode of %d sequences", n_seq);
    float *lg[4096];
    for (int i = 0; i < n_seq; i++) lg[i] = logits ? logits + (size_t)i * r->ly->c->vocab_size : NULL;
    for (int i = 0; i < n_seq; i++)
        for (int j = 0; j < i; j++)
            if (states[i] == states[j])
                return mf_error(-EINVAL, "reference: decode got sequence %d twice", i);
    return mf_ref_forward(r, states, tokens, n_seq, lg);
}
