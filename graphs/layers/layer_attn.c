/* The attention sublayer (graphs/layers/layers.h; the oracle's and the engine's): low-rank q, the fp8 fake-quantized window KV
 * ring, the compressor of KV-source layers (ratio 2 gated pooling or ratio 1) with fp4 index keys
 * and fp4 compressed entries, the indexer (scores, the candidate-block mask, top-k), sparse
 * attention over window + selected entries with a per-head sink, inverse RoPE and the grouped
 * low-rank output. In phases (linear stages and a per-item core) that the scheduled engine also
 * runs, its linear stages split by rows across workers (graphs/layers/layers.h). */
#include <errno.h>
#include <string.h>

#include "graphs/layers/layers.h"
#include "sched/error.h"

/* The compressor's entry of KV-source layer L closed by the token at pos, from its linears'
 * outputs lat (cmp_wkv, overwritten) and sc (cmp_wgate, ratio 2) and, ratio 2, the group's first
 * token's (pend_kv, pend_score): entry (pos + 1) / ratio - 1 and its index key into ca. */
static int mf_ly_compress_entry(mf_ly_ctx *cx, mf_ly_cache *ca, int L, int64_t pos, float *lat, const float *sc,
                                const float *pend_kv, const float *pend_score)
{
    const mf_config *c = cx->ly->c;
    const mf_model_layer *y = mf_model_layer_at(cx->ly->m, L);
    int ratio = c->compress_ratios[L], D = c->head_dim, rd = c->qk_rope_head_dim;
    int id = c->index_head_dim;
    int rc;
    if (ratio == 2) {
        for (int d = 0; d < D; d++) {   /* softmax over the group's 2 tokens, per channel */
            double a = pend_score[d], b = sc[d], m = a > b ? a : b;
            double ea = exp(a - m), eb = exp(b - m);
            lat[d] = (float)((pend_kv[d] * ea + lat[d] * eb) / (ea + eb));
        }
    }
    mf_bf_n(lat, D);
    mf_ly_rmsnorm(lat, D, &y->cmp_norm, c->rms_norm_eps, lat);
    int64_t g = (pos + 1) / ratio - 1, gpos = g * ratio;
    /* index key: k_norm(wk(latent)), RoPE at the group's first position, fp4 (e8m0 per 32) */
    float *key = cx->cache_row;
    if ((rc = mf_ly_linear(cx, &y->idx_wk, lat, key, 0))) return rc;
    mf_bf_n(key, id);
    mf_ly_rmsnorm(key, id, &y->idx_k_norm, c->rms_norm_eps, key);
    mf_ly_rope(key + id - rd, rd / 2, cx->ly->freqs_comp, gpos, 0);
    mf_bf_n(key, id);
    mf_ly_cache_put_key(c, L, ca, g, key);
    /* entry: the roped latent, fp4 (e4m3 scale per 16); lat is the caller's to overwrite */
    mf_ly_rope(lat + D - rd, rd / 2, cx->ly->freqs_comp, gpos, 0);
    mf_bf_n(lat, D);
    mf_ly_cache_put_kv(c, L, ca, g, lat);
    return 0;
}

/* Entries of the compressed cache before position pos (what the compressor has emitted). */
static int64_t mf_ly_compress_before(const mf_config *c, int L, int64_t pos) { return pos / c->compress_ratios[L]; }

/* Compressor of KV-source layer L for the token at it->pos, from its linears' outputs lat
 * (cmp_wkv, overwritten) and sc (cmp_wgate, ratio 2): emits an entry when a group closes, the
 * open group's first token kept in the state. */
static int mf_ly_compress(mf_ly_ctx *cx, mf_ly_item *it, int L, float *lat, const float *sc)
{
    const mf_config *c = cx->ly->c;
    mf_ly_cache *ca = &it->st->cache[L];
    int ratio = c->compress_ratios[L], D = c->head_dim;
    if (ratio == 2 && it->pos % 2 == 0) {   /* opens a group */
        memcpy(ca->pend_kv, lat, (size_t)D * sizeof *lat);
        memcpy(ca->pend_score, sc, (size_t)D * sizeof *sc);
        mf_ly_journal_pend(c, it->st, L, it->pos, lat, sc);
        return 0;
    }
    if (ca->n != mf_ly_compress_before(c, L, it->pos))
        return mf_error(-EINVAL, "reference: layer %d compressed entry %lld out of step at position %lld",
                        L, (long long)ca->n, (long long)it->pos);
    int rc = mf_ly_compress_entry(cx, ca, L, it->pos, lat, sc, ca->pend_kv, ca->pend_score);
    if (!rc) ca->n = (it->pos + 1) / ratio;
    return rc;
}

/* The indexer of index-source layer L in three steps (mf_ly_index runs them in a row): q readies
 * its linears' outputs qi (idx_wq_b) and wts (idx_weights_proj) in place; scores scores the
 * visible entries [j0, j1) of KV source S into score; select builds the candidate mask (on the
 * candidate layer) or applies it (on later index layers of the same source) and leaves the top-k
 * selection of the n_vis entries, ascending, in it->topk. */
static void mf_ly_index_q(const mf_ly_ctx *cx, const mf_ly_item *it, float *qi, float *wts)
{
    const mf_config *c = cx->ly->c;
    int ih = c->index_n_heads, id = c->index_head_dim, rd = c->qk_rope_head_dim;
    mf_bf_n(qi, (int64_t)ih * id);
    for (int h = 0; h < ih; h++) mf_ly_rope(qi + h * id + id - rd, rd / 2, cx->ly->freqs_comp, it->pos, 0);
    mf_bf_n(qi, (int64_t)ih * id);
    mf_ly_fq_e2m1_pow2(qi, (int64_t)ih * id, 32);
    float wscale = (float)(1.0 / sqrt((double)id) / sqrt((double)ih));
    for (int h = 0; h < ih; h++) wts[h] = mf_bf(wts[h]) * wscale;
}

void mf_ly_index_scores(const mf_layers *ly, const mf_ly_item *it, int L, float *const *b, double *score, int64_t j0,
                        int64_t j1)
{
    if (j0 >= j1) return;
    const mf_config *c = ly->c;
    int S = ly->src_of[L];
    const mf_ly_cache *ca = &it->st->cache[S];
    const float *qi = b[MF_LY_A_QI], *wts = b[MF_LY_A_IW];
    int ih = c->index_n_heads, id = c->index_head_dim;
    float k[MF_LY_MAX_INDEX_DIM];   /* the key, unpacked once for all heads */
    for (int64_t j = j0; j < j1; j++) {
        mf_ly_cache_get_key(c, S, ca, j, k);
        double acc = 0;
        for (int h = 0; h < ih; h++) {
            double dot = 0;
            for (int d = 0; d < id; d++) dot += (double)qi[h * id + d] * k[d];
            float rl = (float)dot > 0 ? (float)dot : 0.0f;
            acc += (double)(wts[h] * rl);
        }
        score[j] = (float)acc;
    }
}

static void mf_ly_index_select(mf_ly_ctx *cx, mf_ly_item *it, int L, int S, double *score, int64_t n_vis)
{
    const mf_config *c = cx->ly->c;
    int bs = c->candidate_block_size, cl = c->candidate_source_layer_id;
    if (L == cl) {   /* publish the candidate blocks: top blocks by max score, newest pinned */
        int64_t nb = (n_vis + bs - 1) / bs;
        mf_ly_pick *pk = cx->picks;
        for (int64_t b = 0; b < nb; b++) {
            double mx = -INFINITY;
            for (int64_t j = b * bs; j < (b + 1) * bs && j < n_vis; j++) mx = score[j] > mx ? score[j] : mx;
            pk[b].score = b == (n_vis - 1) / bs ? INFINITY : mx;
            pk[b].idx = (int32_t)b;
        }
        mf_ly_sort_picks(pk, nb);
        int64_t keep = nb < c->candidate_topk_blocks ? nb : c->candidate_topk_blocks;
        int n = 0;
        for (int64_t i = 0; i < keep; i++)
            if (pk[i].score != -INFINITY) it->cand[n++] = pk[i].idx;
        /* ascending, for the membership test */
        for (int i = 1; i < n; i++)
            for (int j = i; j > 0 && it->cand[j - 1] > it->cand[j]; j--) {
                int32_t t = it->cand[j];
                it->cand[j] = it->cand[j - 1];
                it->cand[j - 1] = t;
            }
        it->n_cand = n;
        it->cand_src = S;
        if (cx->ly->hooks.on_candidates)
            cx->ly->hooks.on_candidates(cx->ly->hooks.user, it->st, it->pos, L, it->cand, n);
    } else if (cl >= 0 && cl < L && it->cand_src == S) {
        int ci = 0;
        for (int64_t j = 0; j < n_vis; j++) {
            int32_t b = (int32_t)(j / bs);
            while (ci < it->n_cand && it->cand[ci] < b) ci++;
            if (ci >= it->n_cand || it->cand[ci] != b) score[j] = -INFINITY;
        }
    }

    int64_t k = n_vis < c->index_topk ? n_vis : c->index_topk;
    mf_ly_pick *pk = cx->picks;
    for (int64_t j = 0; j < n_vis; j++) {
        pk[j].score = score[j];
        pk[j].idx = (int32_t)j;
    }
    mf_ly_sort_picks(pk, n_vis);
    int n = 0;
    for (int64_t i = 0; i < k; i++)
        if (pk[i].score != -INFINITY) it->topk[n++] = pk[i].idx;
    for (int i = 1; i < n; i++)   /* ascending (position order) */
        for (int j = i; j > 0 && it->topk[j - 1] > it->topk[j]; j--) {
            int32_t t = it->topk[j];
            it->topk[j] = it->topk[j - 1];
            it->topk[j - 1] = t;
        }
    it->n_topk = n;
    it->topk_src = S;
    mf_ly_item_selected(c, it);
}

int64_t mf_ly_attn_buf_len(const mf_config *c, int buf)
{
    int64_t qd = (int64_t)c->n_heads * c->head_dim;
    switch (buf) {
    case MF_LY_A_IN: case MF_LY_A_OUT: return c->hidden_size;
    case MF_LY_A_QR: return c->q_lora_rank;
    case MF_LY_A_KV: return (int64_t)c->n_kv_heads * c->head_dim;
    case MF_LY_A_LAT: case MF_LY_A_GATE: return c->head_dim;
    case MF_LY_A_IW: return c->index_n_heads;
    case MF_LY_A_Q: case MF_LY_A_O: return qd;
    case MF_LY_A_QI: return (int64_t)c->index_n_heads * c->index_head_dim;
    case MF_LY_A_Z: return (int64_t)c->o_groups * c->o_lora_rank;
    default: return 0;
    }
}

int mf_ly_attn_linears(const mf_layers *ly, int L, int stage, mf_ly_attn_lin *out)
{
    const mf_config *c = ly->c;
    const mf_model_layer *y = mf_model_layer_at(ly->m, L);
    int ratio = c->compress_ratios[L], n = 0;
    int index = ratio > 0 && mf_config_is_index_source(c, L);
#define MF_LY_A_ADD(w_, x_, y_, aq_, g_, bf_) (out[n++] = (mf_ly_attn_lin){(w_), (x_), (y_), (aq_), (g_), (bf_)})
    switch (stage) {
    case MF_LY_A_STAGE_IN:   /* everything that reads the input */
        MF_LY_A_ADD(&y->wq_a, MF_LY_A_IN, MF_LY_A_QR, 1, 0, 1);   /* rounded: the q norm's input */
        MF_LY_A_ADD(&y->wkv, MF_LY_A_IN, MF_LY_A_KV, 1, 0, 0);
        if (ratio > 0 && ly->src_of[L] == L) {
            MF_LY_A_ADD(&y->cmp_wkv, MF_LY_A_IN, MF_LY_A_LAT, 0, 0, 0);
            if (ratio == 2) MF_LY_A_ADD(&y->cmp_wgate, MF_LY_A_IN, MF_LY_A_GATE, 0, 0, 0);   /* fp32 */
        }
        if (index) MF_LY_A_ADD(&y->idx_weights_proj, MF_LY_A_IN, MF_LY_A_IW, 0, 0, 0);
        break;
    case MF_LY_A_STAGE_QB:   /* everything that reads the normed low-rank query */
        MF_LY_A_ADD(&y->wq_b, MF_LY_A_QR, MF_LY_A_Q, 1, 0, 0);
        if (index) MF_LY_A_ADD(&y->idx_wq_b, MF_LY_A_QR, MF_LY_A_QI, 1, 0, 0);
        break;
    case MF_LY_A_STAGE_OA:   /* grouped low-rank output: z_g = wo_a[g] o_g, no act quant */
        MF_LY_A_ADD(&y->wo_a, MF_LY_A_O, MF_LY_A_Z, 0, c->o_groups, 1);
        break;
    case MF_LY_A_STAGE_OB:
        MF_LY_A_ADD(&y->wo_b, MF_LY_A_Z, MF_LY_A_OUT, 1, 0, 1);
        break;
    }
#undef MF_LY_A_ADD
    return n;
}

int mf_ly_attn_lin_rows(mf_ly_ctx *cx, const mf_ly_attn_lin *l, const float *x, int64_t ld_x, float *y,
                         int64_t ld_y, int n_tok, int64_t r0, int64_t r1)
{
    const mf_weight *w = l->w;
    if (!l->groups) {
        int rc = mf_ly_linear_part(cx, w, x, n_tok, ld_x, y, ld_y, r0, r1);
        for (int t = 0; t < n_tok && !rc && l->bf; t++) mf_bf_n(y + t * ld_y + r0, r1 - r0);
        return rc;
    }
    int64_t R = w->rows / l->groups;
    for (int t = 0; t < n_tok; t++)
        for (int64_t a = r0; a < r1;) {   /* the rows of one group at a time */
            int64_t g = a / R, b = (g + 1) * R < r1 ? (g + 1) * R : r1;
            int rc = mf_ly_linear_rows(cx, w, a, b - a, x + t * ld_x + g * w->cols, w->cols, 0, y + t * ld_y + a);
            if (rc) return rc;
            if (l->bf) mf_bf_n(y + t * ld_y + a, b - a);
            a = b;
        }
    return 0;
}

int mf_ly_attn_stage(mf_ly_ctx *cx, int L, int stage, float *const *b)
{
    mf_ly_attn_lin lin[MF_LY_A_MAX_LIN];
    int n = mf_ly_attn_linears(cx->ly, L, stage, lin), aq = cx->ly->act_quant;
    for (int k = 0; k < n; k++) {
        const mf_ly_attn_lin *l = &lin[k];
        int rc;
        if (l->groups) {   /* per group: rows of group g against its slice of x */
            int64_t R = l->w->rows / l->groups;
            for (int g = 0; g < l->groups; g++)
                if ((rc = mf_ly_linear_rows(cx, l->w, g * R, R, b[l->x] + g * l->w->cols, l->w->cols, 0,
                                             b[l->y] + g * R)))
                    return rc;
        } else if ((rc = mf_ly_linear(cx, l->w, b[l->x], b[l->y], l->aq && aq))) {
            return rc;
        }
        if (l->bf) mf_bf_n(b[l->y], l->w->rows);
    }
    return 0;
}

void mf_ly_attn_qnorm(const mf_ly_ctx *cx, int L, float *const *b)
{
    const mf_config *c = cx->ly->c;
    mf_ly_rmsnorm(b[MF_LY_A_QR], c->q_lora_rank, &mf_model_layer_at(cx->ly->m, L)->q_norm, c->rms_norm_eps,
                   b[MF_LY_A_QR]);
}

void mf_ly_attn_kv_window(const mf_ly_ctx *cx, const mf_ly_item *it, int L, float *const *b)
{
    const mf_config *c = cx->ly->c;
    const mf_model_layer *y = mf_model_layer_at(cx->ly->m, L);
    int D = c->head_dim, rd = c->qk_rope_head_dim;
    const float *freqs = c->compress_ratios[L] ? cx->ly->freqs_comp : cx->ly->freqs_main;
    float *kv = b[MF_LY_A_KV];
    /* window KV: norm, RoPE, fp8 fake-quant over all channels in blocks of 32 (the ring write is
     * mf_ly_attn_ring_write's) */
    mf_bf_n(kv, D);
    mf_ly_rmsnorm(kv, D, &y->kv_norm, c->rms_norm_eps, kv);
    mf_ly_rope(kv + D - rd, rd / 2, freqs, it->pos, 0);
    mf_bf_n(kv, D);
    mf_ly_fq_e4m3_pow2(kv, D, 32);
}

/* 1 when layer L's compressor runs (a KV source with compression). */
static int mf_ly_compressing(const mf_layers *ly, int L)
{
    return ly->c->compress_ratios[L] > 0 && ly->src_of[L] == L;
}

int mf_ly_attn_kv_compress(mf_ly_ctx *cx, mf_ly_item *it, int L, float *const *b)
{
    /* compressed entries */
    if (mf_ly_compressing(cx->ly, L))
        return mf_ly_compress(cx, it, L, b[MF_LY_A_LAT], b[MF_LY_A_GATE]);
    return 0;
}

int mf_ly_attn_kv_compress_item(mf_ly_ctx *cx, const mf_ly_item *it, int L, float *const *b, float *const *prev)
{
    if (!mf_ly_compressing(cx->ly, L)) return 0;
    const mf_config *c = cx->ly->c;
    mf_ly_cache *ca = &it->st->cache[L];
    int ratio = c->compress_ratios[L];
    if (ratio == 2 && it->pos % 2 == 0) {   /* opens a group: read by the next item, or the state's */
        mf_ly_journal_pend(c, it->st, L, it->pos, b[MF_LY_A_LAT], b[MF_LY_A_GATE]);
        return 0;
    }
    const float *pk = ratio == 2 ? (prev ? prev[MF_LY_A_LAT] : ca->pend_kv) : NULL;
    const float *ps = ratio == 2 ? (prev ? prev[MF_LY_A_GATE] : ca->pend_score) : NULL;
    return mf_ly_compress_entry(cx, ca, L, it->pos, b[MF_LY_A_LAT], b[MF_LY_A_GATE], pk, ps);
}

int mf_ly_attn_kv_compress_state(mf_ly_ctx *cx, const mf_ly_item *first, const mf_ly_item *last, int L,
                                 float *const *b_open)
{
    if (!mf_ly_compressing(cx->ly, L)) return 0;
    const mf_config *c = cx->ly->c;
    mf_ly_cache *ca = &first->st->cache[L];
    int ratio = c->compress_ratios[L], D = c->head_dim;
    if (ca->n != mf_ly_compress_before(c, L, first->pos))
        return mf_error(-EINVAL, "step: layer %d compressed entry %lld out of step at position %lld", L,
                        (long long)ca->n, (long long)first->pos);
    if (ratio == 2 && b_open) {   /* the run's last group opened (the next step's when the last item opened it) */
        memcpy(ca->pend_kv, b_open[MF_LY_A_LAT], (size_t)D * sizeof *ca->pend_kv);
        memcpy(ca->pend_score, b_open[MF_LY_A_GATE], (size_t)D * sizeof *ca->pend_score);
    }
    ca->n = (last->pos + 1) / ratio;
    return 0;
}

int mf_ly_attn_window_kv(mf_ly_ctx *cx, mf_ly_item *it, int L, float *const *b)
{
    mf_ly_attn_kv_window(cx, it, L, b);
    return mf_ly_attn_kv_compress(cx, it, L, b);
}

void mf_ly_attn_index_query(const mf_ly_ctx *cx, const mf_ly_item *it, int L, float *const *b)
{
    if (cx->ly->c->compress_ratios[L] > 0 && mf_ly_index_n_vis(cx->ly->c, L, it->pos) > 0)
        mf_ly_index_q(cx, it, b[MF_LY_A_QI], b[MF_LY_A_IW]);
}

int mf_ly_attn_core_kv(mf_ly_ctx *cx, mf_ly_item *it, int L, float *const *b)
{
    int rc = mf_ly_attn_window_kv(cx, it, L, b);
    if (!rc) mf_ly_attn_index_query(cx, it, L, b);
    return rc;
}

int64_t mf_ly_index_n_vis(const mf_config *c, int L, int64_t pos)
{
    int ratio = c->compress_ratios[L];
    return ratio > 0 && mf_config_is_index_source(c, L) ? (pos + 1) / ratio : 0;
}

void mf_ly_attn_core_select(mf_ly_ctx *cx, mf_ly_item *it, int L, double *score)
{
    const mf_config *c = cx->ly->c;
    int ratio = c->compress_ratios[L];
    if (ratio == 0) return;
    int S = cx->ly->src_of[L];
    int64_t n_vis = mf_ly_index_n_vis(c, L, it->pos);
    if (n_vis > 0) mf_ly_index_select(cx, it, L, S, score, n_vis);
    if (mf_config_is_index_source(c, L) && n_vis == 0) {
        it->n_topk = 0;
        it->topk_src = S;
    }
    if (cx->ly->hooks.on_select) {
        int sel = it->topk_src == S;
        cx->ly->hooks.on_select(cx->ly->hooks.user, it->st, it->pos, L, sel ? it->topk : NULL, sel ? it->n_topk : 0);
    }
}

int mf_ly_attn_core_prep(mf_ly_ctx *cx, mf_ly_item *it, int L, float *const *b)
{
    int rc = mf_ly_attn_core_kv(cx, it, L, b);
    if (rc) return rc;
    mf_ly_index_scores(cx->ly, it, L, b, cx->scores, 0, mf_ly_index_n_vis(cx->ly->c, L, it->pos));
    mf_ly_attn_core_select(cx, it, L, cx->scores);
    return 0;
}

void mf_ly_attn_ring_write(const mf_ly_ctx *cx, const mf_ly_item *it, int L, const float *kv)
{
    mf_ly_ring_put(cx->ly->c, it->st, L, it->pos, kv);
}

void mf_ly_attn_core_heads(mf_ly_ctx *cx, const mf_ly_item *it, int L, float *const *b, int h0, int h1,
                           const mf_ly_win *win)
{
    const mf_config *c = cx->ly->c;
    const mf_model_layer *y = mf_model_layer_at(cx->ly->m, L);
    int D = c->head_dim, rd = c->qk_rope_head_dim, W = c->sliding_window;
    int ratio = c->compress_ratios[L];
    int64_t p = it->pos;
    const float *freqs = ratio ? cx->ly->freqs_comp : cx->ly->freqs_main;
    float *q = b[MF_LY_A_Q], *o = b[MF_LY_A_O];

    /* the selection the prep left (compressed layers whose source has one) */
    const float *ckv = NULL;
    int n_sel = 0;
    if (ratio > 0 && it->topk_src == cx->ly->src_of[L] && h0 < h1) {
        n_sel = it->n_topk;
        ckv = mf_ly_item_sel_kv(c, it, cx->sel_kv);   /* unpacked at the selection, or here */
    }

    /* attention with a sink: window slots of positions max(0, p-W+1)..p, then the selection;
     * window positions at or after win->pos0 are the unwritten rows of win->kv */
    int64_t t0 = p - W + 1 < 0 ? 0 : p - W + 1, n_win = p - t0 + 1;
    int64_t pos0 = win ? win->pos0 : p + 1;
    /* the window rows before pos0 come from the ring, unpacked once for the call's heads */
    int64_t n_ring = (pos0 < p + 1 ? pos0 : p + 1) - t0;
    if (n_ring > 0 && h0 < h1) mf_ly_ring_get(c, it->st, L, t0, n_ring, cx->win_kv);
    const float *ring = cx->win_kv;
    double *s = cx->scores, scale = 1.0 / sqrt((double)D);
#define MF_LY_KEY(i)                                                                                    \
    ((i) < n_win ? (t0 + (i) >= pos0 ? win->kv + (t0 + (i) - pos0) * win->ld : ring + (int64_t)(i) * D) \
                 : ckv + (int64_t)((i) - n_win) * D)
    for (int h = h0; h < h1; h++) {
        float *qh = q + (int64_t)h * D;
        /* the head's query: rounded, roped, rounded */
        mf_bf_n(qh, D);
        mf_ly_rope(qh + D - rd, rd / 2, freqs, p, 0);
        mf_bf_n(qh, D);
        double sink = mf_ly_vec(&y->attn_sink, h), mx = sink;
        for (int64_t i = 0; i < n_win + n_sel; i++) {
            const float *k = MF_LY_KEY(i);
            double dot = 0;
            for (int d = 0; d < D; d++) dot += (double)qh[d] * k[d];
            s[i] = dot * scale;
            mx = s[i] > mx ? s[i] : mx;
        }
        double den = exp(sink - mx);
        double *acc = cx->attn_acc;   /* head_dim doubles */
        for (int d = 0; d < D; d++) acc[d] = 0;
        for (int64_t i = 0; i < n_win + n_sel; i++) {
            const float *v = MF_LY_KEY(i);
            double e = exp(s[i] - mx);
            den += e;
            for (int d = 0; d < D; d++) acc[d] += e * v[d];
        }
        float *oh = o + (int64_t)h * D;
        for (int d = 0; d < D; d++) oh[d] = mf_bf((float)(acc[d] / den));
        mf_ly_rope(oh + D - rd, rd / 2, freqs, p, 1);   /* inverse RoPE at the query position */
        mf_bf_n(oh + D - rd, rd);
    }
#undef MF_LY_KEY
}

int mf_ly_attn_core(mf_ly_ctx *cx, mf_ly_item *it, int L, float *const *b)
{
    int rc = mf_ly_attn_core_prep(cx, it, L, b);
    if (rc) return rc;
    mf_ly_attn_ring_write(cx, it, L, b[MF_LY_A_KV]);
    mf_ly_attn_core_heads(cx, it, L, b, 0, cx->ly->c->n_heads, NULL);
    return 0;
}

int mf_ly_attn(mf_ly_ctx *cx, mf_ly_item *it, int L, const float *in, float *out)
{
    float *b[MF_LY_A_N];
    for (int k = 0; k < MF_LY_A_N; k++) b[k] = cx->attn[k];
    b[MF_LY_A_IN] = (float *)in;
    b[MF_LY_A_OUT] = out;
    int rc = mf_ly_attn_stage(cx, L, MF_LY_A_STAGE_IN, b);
    if (!rc) mf_ly_attn_qnorm(cx, L, b);
    if (!rc) rc = mf_ly_attn_stage(cx, L, MF_LY_A_STAGE_QB, b);
    if (!rc) rc = mf_ly_attn_core(cx, it, L, b);
    if (!rc) rc = mf_ly_attn_stage(cx, L, MF_LY_A_STAGE_OA, b);
    if (!rc) rc = mf_ly_attn_stage(cx, L, MF_LY_A_STAGE_OB, b);
    return rc;
}

void mf_ly_attn_sink_rows(const float *qh, const float *keys, int64_t n, int D, double sink, double *s,
                          double *acc, float *oh)
{
    double scale = 1.0 / sqrt((double)D), mx = sink;
    for (int64_t i = 0; i < n; i++) {
        const float *k = keys + i * D;
        double dot = 0;
        for (int d = 0; d < D; d++) dot += (double)qh[d] * k[d];
        s[i] = dot * scale;
        mx = s[i] > mx ? s[i] : mx;
    }
    double den = exp(sink - mx);
    for (int d = 0; d < D; d++) acc[d] = 0;
    for (int64_t i = 0; i < n; i++) {
        const float *v = keys + i * D;
        double e = exp(s[i] - mx);
        den += e;
        for (int d = 0; d < D; d++) acc[d] += e * v[d];
    }
    for (int d = 0; d < D; d++) oh[d] = mf_bf((float)(acc[d] / den));
}
