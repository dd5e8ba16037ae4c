/* The reference forward's top level: the forward object (RoPE tables, Engram parameters, token
 * map, scratch), per-sequence states, and the batch forward: embedding into the hyper-connection
 * streams, the layers (Engram, attention and MoE sublayers wrapped by hyper-connection mixes),
 * the final collapse, norm and the fp32 head. Items run layer by layer (layer-major). */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/ref_internal.h"
#include "sched/clock.h"
#include "sched/error.h"

void mf_ref_rope_freqs(const mf_config *c, int layer, float *freqs)
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

static int64_t mf_max64(int64_t a, int64_t b) { return a > b ? a : b; }

int mf_ref_new(const mf_model *m, const mf_ref_opts *opts, mf_ref **out)
{
    *out = NULL;
    const mf_config *c = mf_model_config(m);
    int rc = mf_model_check_supported("reference", c);
    if (rc) return rc;
    if (c->n_experts_per_tok > 256 || c->engram_head_dim > 4096)
        return mf_error(-EINVAL, "reference: num_experts_per_tok %d (max 256) or engram_head_dim %d "
                        "(max 4096) not supported", c->n_experts_per_tok, c->engram_head_dim);
    mf_ref *r = calloc(1, sizeof *r);
    if (!r) return mf_error(-ENOMEM, "reference: out of memory");
    r->m = m;
    r->c = c;
    if (opts) r->opts = *opts;
    r->opts.token_map = NULL;

    int64_t H = c->hidden_size, hc = c->hc_mult;
    int64_t per = (int64_t)(c->engram_max_ngram_size - 1) * c->engram_n_heads;
    int64_t len = mf_max64(hc * H, 2 * H);
    len = mf_max64(len, (int64_t)c->n_heads * c->head_dim);
    len = mf_max64(len, 2 * (int64_t)c->head_dim);
    len = mf_max64(len, (hc + 1) * H);
    len = mf_max64(len, per * c->engram_head_dim);
    len = mf_max64(len, (int64_t)c->index_n_heads * c->index_head_dim);
    len = mf_max64(len, c->index_n_heads);
    len = mf_max64(len, (int64_t)c->o_groups * c->o_lora_rank);
    len = mf_max64(len, c->q_lora_rank);
    len = mf_max64(len, c->moe_intermediate_size);
    len = mf_max64(len, c->n_routed_experts);
    len = mf_max64(len, (2 + hc) * hc);
    r->s_len = len;
    uint64_t lazy_d = 0, lazy_s = 0;
    if (mf_model_is_lazy(m)) {
        const mf_model_layer *y = mf_model_layer_at(m, 0);
        for (int k = 0; k < 3; k++) {
            lazy_d = mf_weight_data_bytes(&y->experts[k]) > lazy_d ? mf_weight_data_bytes(&y->experts[k]) : lazy_d;
            lazy_s = mf_weight_scale_bytes(&y->experts[k]) > lazy_s ? mf_weight_scale_bytes(&y->experts[k]) : lazy_s;
        }
    }
    int rd2 = c->qk_rope_head_dim / 2;
    size_t bytes = 13 * (size_t)len * sizeof(float) + 2 * (size_t)rd2 * sizeof(float) +
                   (size_t)c->vocab_size * sizeof(int32_t) + lazy_d + lazy_s + 64;
    size_t ex_bytes = mf_model_store(m) ? (size_t)c->n_experts_per_tok * H * sizeof(float) : 0;
    size_t egr = (size_t)per * sizeof(int64_t), egc = (size_t)per * c->engram_head_dim,
           egs = (size_t)per * ((c->engram_head_dim + 31) / 32);
    bytes += ex_bytes + egr + egc + egs + 32;
    for (int k = 0; k < c->n_engram; k++) bytes += 2 * (size_t)per * sizeof(int64_t);
    uint8_t *p = calloc(1, bytes);
    if (!p) {
        free(r);
        return mf_error(-ENOMEM, "reference: cannot allocate %zu bytes of scratch", bytes);
    }
    r->mem = p;
#define TAKE(ptr, n) do { (ptr) = (void *)p; p += (n); } while (0)
    for (int i = 0; i < 12; i++) TAKE(r->s[i], (size_t)len * sizeof(float));
    TAKE(r->s_aq, (size_t)len * sizeof(float));
    for (int k = 0; k < c->n_engram; k++) {
        TAKE(r->eg_prime[k], (size_t)per * sizeof(int64_t));
        TAKE(r->eg_off[k], (size_t)per * sizeof(int64_t));
    }
    TAKE(r->freqs_main, (size_t)rd2 * sizeof(float));
    TAKE(r->freqs_comp, (size_t)rd2 * sizeof(float));
    TAKE(r->token_map, (size_t)c->vocab_size * sizeof(int32_t));
    TAKE(r->lazy_data, lazy_d);
    TAKE(r->lazy_scale, lazy_s);
    p = (uint8_t *)(((uintptr_t)p + 7) & ~(uintptr_t)7);
    TAKE(r->eg_rows, egr);
    TAKE(r->ex_out, ex_bytes);
    TAKE(r->eg_codes, egc);
    TAKE(r->eg_scales, egs);
#undef TAKE
    /* RoPE tables: one without YaRN (ratio-0 layers), one with (the others) */
    for (int L = 0; L < c->n_layers; L++)
        mf_ref_rope_freqs(c, L, c->compress_ratios[L] ? r->freqs_comp : r->freqs_main);
    int src = -1;
    for (int L = 0; L < c->n_layers; L++) {
        if (mf_config_is_kv_source(c, L)) src = L;
        r->src_of[L] = c->compress_ratios[L] ? src : -1;
    }
    /* Engram token map */
    int64_t cv = c->engram_compressed_vocab_size > 0 ? c->engram_compressed_vocab_size : 1;
    if (opts && opts->token_map && c->n_engram > 0) {   /* only Engram layers read the map */
        if (opts->n_token_map < 1 || opts->n_token_map > c->vocab_size) {
            mf_ref_free(r);
            return mf_error(-EINVAL, "reference: token map has %" PRId64 " entries, expected 1..%" PRId64,
                            opts->n_token_map, c->vocab_size);
        }
        for (int64_t i = 0; i < opts->n_token_map; i++)
            if (opts->token_map[i] < 0 || opts->token_map[i] >= cv) {
                mf_ref_free(r);
                return mf_error(-EINVAL, "reference: token map entry %" PRId64 " = %d is outside "
                                "[0, engram_compressed_vocab_size %" PRId64 ")", i, opts->token_map[i], cv);
            }
        memcpy(r->token_map, opts->token_map, (size_t)opts->n_token_map * sizeof(int32_t));
        /* ids past the tokenizer's (padding rows of the embedding) map to the pad entry */
        int32_t pad = c->engram_pad_token_id < opts->n_token_map ? opts->token_map[c->engram_pad_token_id] : 0;
        for (int64_t i = opts->n_token_map; i < c->vocab_size; i++) r->token_map[i] = pad;
    } else {
        for (int64_t i = 0; i < c->vocab_size; i++) r->token_map[i] = (int32_t)(i % cv);
    }
    if (c->n_engram > 0 && (rc = mf_ref_engram_setup(r))) {
        mf_ref_free(r);
        return rc;
    }
    *out = r;
    return 0;
}

void mf_ref_free(mf_ref *r)
{
    if (!r) return;
    free(r->s_scores);
    free(r->s_picks);
    free(r->mem);
    free(r);
}

const mf_config *mf_ref_config(const mf_ref *r) { return r->c; }

int64_t mf_ref_state_bytes(const mf_config *c, int64_t max_positions)
{
    int64_t D = c->head_dim, W = c->sliding_window, id = c->index_head_dim;
    int64_t bytes = max_positions * (int64_t)sizeof(int32_t) + c->n_layers * W * D * (int64_t)sizeof(float) +
                    c->n_layers * (int64_t)sizeof(mf_ref_cache) + 64;
    for (int L = 0; L < c->n_layers; L++)
        if (mf_config_is_kv_source(c, L)) {
            int64_t cap = max_positions / c->compress_ratios[L] + 1;
            bytes += cap * (D + id) * (int64_t)sizeof(float) + 2 * D * (int64_t)sizeof(float);
        }
    return bytes + (int64_t)sizeof(mf_ref_state);
}

int mf_ref_state_new(const mf_ref *r, int64_t max_positions, mf_ref_state **out)
{
    *out = NULL;
    const mf_config *c = r->c;
    if (max_positions < 1 || max_positions > c->max_position_embeddings)
        return mf_error(-EINVAL, "reference: max_positions %" PRId64 " outside 1..%" PRId64
                        " (max_position_embeddings)", max_positions, c->max_position_embeddings);
    int64_t D = c->head_dim, W = c->sliding_window, id = c->index_head_dim;
    size_t bytes = (size_t)mf_ref_state_bytes(c, max_positions) - sizeof(mf_ref_state);
    mf_ref_state *s = calloc(1, sizeof *s);
    uint8_t *p = calloc(1, bytes);
    if (!s || !p) {
        free(s);
        free(p);
        return mf_error(-ENOMEM, "reference: cannot allocate %zu bytes of caches for %" PRId64
                        " positions", bytes, max_positions);
    }
    s->r = r;
    s->max_pos = max_positions;
    s->mem = p;
    s->cache = (mf_ref_cache *)p;
    p += (size_t)c->n_layers * sizeof(mf_ref_cache);
    s->ring = (float *)p;
    p += (size_t)c->n_layers * W * D * sizeof(float);
    for (int L = 0; L < c->n_layers; L++)
        if (mf_config_is_kv_source(c, L)) {
            int64_t cap = max_positions / c->compress_ratios[L] + 1;
            mf_ref_cache *ca = &s->cache[L];
            ca->kv = (float *)p;
            p += (size_t)cap * D * sizeof(float);
            ca->key = (float *)p;
            p += (size_t)cap * id * sizeof(float);
            ca->pend_kv = (float *)p;
            p += (size_t)D * sizeof(float);
            ca->pend_score = (float *)p;
            p += (size_t)D * sizeof(float);
        }
    s->tokens = (int32_t *)p;
    *out = s;
    return 0;
}

void mf_ref_state_free(mf_ref_state *s)
{
    if (!s) return;
    free(s->mem);
    free(s);
}

void mf_ref_state_reset(mf_ref_state *s)
{
    s->n_pos = 0;
    for (int L = 0; L < s->r->c->n_layers; L++) s->cache[L].n = 0;
}

int64_t mf_ref_state_pos(const mf_ref_state *s) { return s->n_pos; }

static int mf_ref_layer(mf_ref *r, mf_ref_item *it, int L)
{
    const mf_config *c = r->c;
    const mf_model_layer *y = mf_model_layer_at(r->m, L);
    int64_t H = c->hidden_size;
    float mixes[(2 + MF_REF_MAX_HC) * MF_REF_MAX_HC], pre_a[MF_REF_MAX_HC], post[MF_REF_MAX_HC];
    float comb[MF_REF_MAX_HC * MF_REF_MAX_HC], pre_f[MF_REF_MAX_HC];
    int rc;
    int64_t t0 = mf_now_ns();
    if (mf_config_engram_slot(c, L) >= 0 && (rc = mf_ref_engram(r, it, L))) return rc;
    int64_t t1 = mf_now_ns();

    mf_ref_hc_mixes(r, it->x, &y->hc_attn_fn, mixes);
    mf_ref_hc_split_w(c, mixes, &y->hc_attn_scale, &y->hc_attn_base, pre_a, post, comb);
    mf_ref_hc_collapse(r, it->x, it->pre, r->s[0]);   /* the carried pre */
    mf_ref_rmsnorm(r->s[0], H, &y->attn_norm, c->rms_norm_eps, r->s[1]);
    if ((rc = mf_ref_attn(r, it, L, r->s[1], r->s[2]))) return rc;
    mf_ref_hc_expand(r, it->x, r->s[2], post, comb);

    mf_ref_hc_mixes(r, it->x, &y->hc_ffn_fn, mixes);
    mf_ref_hc_split_w(c, mixes, &y->hc_ffn_scale, &y->hc_ffn_base, pre_f, post, comb);
    mf_ref_hc_collapse(r, it->x, pre_a, r->s[0]);     /* the attention mix's pre */
    mf_ref_rmsnorm(r->s[0], H, &y->ffn_norm, c->rms_norm_eps, r->s[1]);
    int64_t t2 = mf_now_ns();
    if ((rc = mf_ref_moe(r, it, L, r->s[1], r->s[2]))) return rc;
    int64_t t3 = mf_now_ns();
    mf_ref_hc_expand(r, it->x, r->s[2], post, comb);
    memcpy(it->pre, pre_f, sizeof pre_f);
    r->times.engram_ns += t1 - t0;
    r->times.moe_ns += t3 - t2;
    r->times.attn_ns += t2 - t1 + mf_now_ns() - t3;
    return 0;
}

int mf_ref_forward(mf_ref *r, mf_ref_state *const *states, const int32_t *tokens, int n,
                   float *const *logits)
{
    const mf_config *c = r->c;
    if (n < 1) return mf_error(-EINVAL, "reference: forward of %d items", n);
    int64_t t_start = mf_now_ns();
    /* validate everything before touching a state */
    int64_t need_scores = 0;
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= c->vocab_size)
            return mf_error(-EINVAL, "reference: token %d (item %d) outside the vocabulary [0, %" PRId64 ")",
                            tokens[i], i, c->vocab_size);
        if (states[i]->r != r)
            return mf_error(-EINVAL, "reference: item %d's state belongs to another forward", i);
        for (int j = 0; i > 0 && states[i - 1] != states[i] && j < i - 1; j++)
            if (states[j] == states[i])
                return mf_error(-EINVAL, "reference: items of one sequence must be consecutive (item %d)", i);
        int64_t k = 0;
        for (int j = 0; j < n; j++) k += states[j] == states[i];
        if (states[i]->n_pos + k > states[i]->max_pos)
            return mf_error(-EINVAL, "reference: sequence would reach %" PRId64 " positions, past its "
                            "maximum of %" PRId64, states[i]->n_pos + k, states[i]->max_pos);
        need_scores = mf_max64(need_scores, states[i]->max_pos + c->sliding_window + c->index_topk + 1);
    }
    if (need_scores > r->s_scores_len) {
        double *sc = realloc(r->s_scores, (size_t)need_scores * sizeof *sc);
        if (sc) r->s_scores = sc;
        mf_ref_pick *pk = realloc(r->s_picks, (size_t)need_scores * sizeof *pk);
        if (pk) r->s_picks = pk;
        if (!sc || !pk) return mf_error(-ENOMEM, "reference: out of memory for score buffers");
        r->s_scores_len = need_scores;
    }
    int64_t H = c->hidden_size, X = (int64_t)c->hc_mult * H;
    int n_cb = c->candidate_topk_blocks > 0 ? c->candidate_topk_blocks : 1;
    size_t per = (size_t)X * sizeof(float) + (size_t)c->index_topk * sizeof(int32_t) +
                 (size_t)n_cb * sizeof(int32_t);
    mf_ref_item *items = calloc((size_t)n, sizeof *items);
    uint8_t *mem = calloc((size_t)n, per);
    if (!items || !mem) {
        free(items);
        free(mem);
        return mf_error(-ENOMEM, "reference: out of memory for %d items", n);
    }
    /* positions and token history, embedding into every stream */
    const mf_weight *emb = mf_model_embed(r->m);
    for (int i = 0; i < n; i++) {
        mf_ref_item *it = &items[i];
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
    int rc = 0;
    for (int L = 0; L < c->n_layers && !rc; L++)
        for (int i = 0; i < n && !rc; i++) rc = mf_ref_layer(r, &items[i], L);
    int64_t t_head = mf_now_ns();
    for (int i = 0; i < n && !rc; i++) {
        mf_ref_item *it = &items[i];
        if (!it->logits) continue;
        mf_ref_hc_collapse(r, it->x, it->pre, r->s[0]);
        mf_ref_rmsnorm(r->s[0], H, mf_model_norm(r->m), c->rms_norm_eps, r->s[1]);
        rc = mf_ref_linear(r, mf_model_head(r->m), r->s[1], it->logits, 0);   /* fp32 */
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
    for (int i = 0; i < n_seq; i++) lg[i] = logits ? logits + (size_t)i * r->c->vocab_size : NULL;
    for (int i = 0; i < n_seq; i++)
        for (int j = 0; j < i; j++)
            if (states[i] == states[j])
                return mf_error(-EINVAL, "reference: decode got sequence %d twice", i);
    return mf_ref_forward(r, states, tokens, n_seq, lg);
}
