/* The engine's fast per-item layer math (graphs/step/fast_attn.h): fp32 16-lane dots and fmaf
 * chains (host/kernels.h's vector code: mf_kern_vec_*, an AVX2 path and a scalar path of the same
 * lanes and order) and the vectorized hyper-connection pieces here, over the caches read
 * as the module reads them: the window ring (mf_fa_ring_rows, unpacked per heads call), the selected
 * compressed entries as mf_ly_item_sel_kv gives them (unpacked once at the selection), index keys
 * unpacked in blocks (mf_ly_cache_get_keys), each once for all index heads. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "graphs/step/fast_attn.h"
#include "host/kernels.h"
#include "host/simd_bf16.h"

/* ---- the caches ------------------------------------------------------------------------------ */

/* 8 E4M3 codes times a scale, as mf_ly_unpack_e4m3_pow2 computes them: the code's float built
 * exactly without a subnormal operand (normal codes: the 7 magnitude bits under the float's
 * exponent, +120 on it; subnormal codes m: m * 2^-9; NaN codes as mf_e4m3_to_f32 makes them,
 * sign | 0x7FC00000), the sign, then the one product by the scale. */
__attribute__((target("avx2,fma"))) static inline __m256 mf_fa_e4m3x8_avx2(const uint8_t *codes, __m256 s)
{
    __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)codes));
    __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
    __m256i nrm = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
    __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(0x1p-9f));
    __m256i bits = _mm256_blendv_epi8(nrm, _mm256_castps_si256(sub), _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
    bits = _mm256_or_si256(bits, sign);
    __m256i nan = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F));
    bits = _mm256_blendv_epi8(bits, _mm256_or_si256(sign, _mm256_set1_epi32(0x7FC00000)), nan);
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), s);
}

/* a slot of n values, n a multiple of MF_LY_RING_BLOCK */
__attribute__((target("avx2,fma"))) static void mf_fa_ring_slot_avx2(const uint8_t *codes, const uint8_t *sc, int64_t n,
                                                                   float *out)
{
    for (int64_t i = 0; i < n; i += MF_LY_RING_BLOCK) {
        uint32_t e = (uint32_t)sc[i / MF_LY_RING_BLOCK] << 23;
        float f;
        memcpy(&f, &e, 4);
        __m256 s = _mm256_set1_ps(f);
        for (int k = 0; k < MF_LY_RING_BLOCK; k += 8) _mm256_storeu_ps(out + i + k, mf_fa_e4m3x8_avx2(codes + i + k, s));
    }
}

void mf_fa_ring_rows(const mf_config *c, const mf_ref_state *st, int L, int64_t t0, int64_t n, float *out)
{
    int64_t D = c->head_dim;
    if (mf_kern_simd_active() != MF_KERN_SIMD_AVX2 || D % MF_LY_RING_BLOCK) {
        mf_ly_ring_get(c, st, L, t0, n, out);
        return;
    }
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *sc, *codes = mf_ly_ring_row(c, st, L, t0 + r, &sc);
        mf_fa_ring_slot_avx2(codes, sc, D, out + r * D);
    }
}

/* ---- numeric pieces -------------------------------------------------------------------------- */

/* x[0..n) rounded to bf16 (mf_bf), 8 lanes at a time under AVX2 (mf_kern_vec_bf16_round) */
static void mf_fa_bf_n(float *x, int64_t n) { mf_kern_vec_bf16_round(x, n); }

/* RoPE as mf_ly_rope, with the position's cos/sin computed once for several vectors (the same
 * values, so the same bits). */
typedef struct mf_fa_rope {
    float c[64], s[64];
    int n;
} mf_fa_rope;

static void mf_fa_rope_init(mf_fa_rope *r, int n_pairs, const float *freqs, int64_t pos)
{
    r->n = n_pairs;
    for (int i = 0; i < n_pairs; i++) {
        float ang = (float)pos * freqs[i];
        r->c[i] = (float)cos((double)ang);
        r->s[i] = (float)sin((double)ang);
    }
}

static void mf_fa_rope_apply(const mf_fa_rope *r, float *x, int inverse)
{
    for (int i = 0; i < r->n; i++) {
        float c = r->c[i], s = inverse ? -r->s[i] : r->s[i];
        float a = x[2 * i], b = x[2 * i + 1];
        float ac = a * c, bs = b * s, as = a * s, bc = b * c;   /* products rounded first, as mf_ly_rope */
        x[2 * i] = ac - bs;
        x[2 * i + 1] = as + bc;
    }
}

/* ---- attention heads ------------------------------------------------------------------------- */

#define MF_FA_MAX_D 512      /* widest head the stack scratch holds */
#define MF_FA_MAX_KEYS 4096  /* most keys (window + selection) a call's pointer table holds */

/* The keys of one item's attention: window positions t0..t0+n_win-1 (from win->kv from pos0 on,
 * else the ring's rows, unpacked into ring_kv), then the selected entries of the KV source. */
typedef struct mf_fa_keys {
    const mf_config *c;
    int S;
    int64_t t0, n_win, pos0;
    const mf_ly_win *win;
    const float *ring_kv;  /* window positions t0..pos0-1, unpacked */
    const float *sel_kv;   /* the selected entries, unpacked in selection order */
} mf_fa_keys;

static inline const float *mf_fa_key(const mf_fa_keys *k, int64_t i)
{
    if (i >= k->n_win) return k->sel_kv + (i - k->n_win) * k->c->head_dim;
    int64_t t = k->t0 + i;
    return t >= k->pos0 ? k->win->kv + (t - k->pos0) * k->win->ld : k->ring_kv + i * k->c->head_dim;
}

int mf_fa_heads_fast(const mf_config *c)
{
    return c->head_dim <= MF_FA_MAX_D && c->qk_rope_head_dim / 2 <= 64;
}

/* The RoPE of item it's position for layer L's heads (compressed layers: freqs_comp). */
static void mf_fa_heads_rope(const mf_layers *ly, const mf_ly_item *it, int L, mf_fa_rope *r)
{
    int ratio = ly->c->compress_ratios[L];
    mf_fa_rope_init(r, ly->c->qk_rope_head_dim / 2, ratio ? ly->freqs_comp : ly->freqs_main, it->pos);
}

void mf_fa_heads_q(const mf_layers *ly, const mf_ly_item *it, int L, float *q, int h0, int h1)
{
    int D = ly->c->head_dim, rd = ly->c->qk_rope_head_dim;
    mf_fa_rope rope;
    mf_fa_heads_rope(ly, it, L, &rope);
    for (int h = h0; h < h1; h++) {
        float *qq = q + (int64_t)h * D;
        mf_fa_bf_n(qq, D);
        mf_fa_rope_apply(&rope, qq + D - rd, 0);
        mf_fa_bf_n(qq, D);
    }
}

void mf_fa_heads_o(const mf_layers *ly, const mf_ly_item *it, int L, float *o, int h0, int h1)
{
    int D = ly->c->head_dim, rd = ly->c->qk_rope_head_dim;
    mf_fa_rope rope;
    mf_fa_heads_rope(ly, it, L, &rope);
    for (int h = h0; h < h1; h++) {
        float *oh = o + (int64_t)h * D;
        mf_fa_rope_apply(&rope, oh + D - rd, 1);   /* inverse RoPE at the query position */
        mf_fa_bf_n(oh + D - rd, rd);
    }
}

void mf_fa_heads_rope_cs(const mf_layers *ly, const mf_ly_item *it, int L, float *cs)
{
    mf_fa_rope rope;
    mf_fa_heads_rope(ly, it, L, &rope);
    memcpy(cs, rope.c, sizeof(float) * (size_t)rope.n);
    memcpy(cs + rope.n, rope.s, sizeof(float) * (size_t)rope.n);
}

void mf_fa_attn_heads(mf_ly_ctx *cx, const mf_ly_item *it, int L, float *const *b, int h0, int h1,
                      const mf_ly_win *win)
{
    const mf_config *c = cx->ly->c;
    const mf_model_layer *y = mf_model_layer_at(cx->ly->m, L);
    int D = c->head_dim, W = c->sliding_window;
    int ratio = c->compress_ratios[L];
    int64_t p = it->pos;
    float *q = b[MF_LY_A_Q], *o = b[MF_LY_A_O];
    if (!mf_fa_heads_fast(c)) {   /* wider than the scratch below: the module */
        mf_ly_attn_core_heads(cx, it, L, b, h0, h1, win);
        return;
    }

    mf_fa_keys ks = {.c = c, .S = -1, .win = win, .ring_kv = cx->win_kv};
    int64_t n_sel = 0;
    if (ratio > 0 && it->topk_src == cx->ly->src_of[L] && h0 < h1) {
        ks.S = it->topk_src;
        n_sel = it->n_topk;
    }
    ks.t0 = p - W + 1 < 0 ? 0 : p - W + 1;
    ks.n_win = p - ks.t0 + 1;
    ks.pos0 = win ? win->pos0 : p + 1;
    int64_t n = ks.n_win + n_sel;
    if (n > MF_FA_MAX_KEYS) {   /* more keys than the pointer table below holds: the module */
        mf_ly_attn_core_heads(cx, it, L, b, h0, h1, win);
        return;
    }
    /* scores of G heads as floats in cx->scores (n_scores doubles >= n keys: G >= 2) */
    float *s = (float *)cx->scores;
    int64_t cap = 2 * cx->n_scores / (n > 0 ? n : 1);
    int Gmax = cap < 4 ? (int)cap : 4;
    if (Gmax < 1) {   /* score buffers not reserved for this length: the module (which needs them too) */
        mf_ly_attn_core_heads(cx, it, L, b, h0, h1, win);
        return;
    }
    if (n_sel) ks.sel_kv = mf_ly_item_sel_kv(c, it, cx->sel_kv);   /* unpacked at the selection, or here */
    int64_t n_ring = (ks.pos0 < p + 1 ? ks.pos0 : p + 1) - ks.t0;   /* window rows from the ring */
    if (n_ring > 0 && h0 < h1) mf_fa_ring_rows(c, it->st, L, ks.t0, n_ring, cx->win_kv);
    const float *kp[MF_FA_MAX_KEYS];   /* each key's row, found once */
    for (int64_t i = 0; i < n; i++) kp[i] = mf_fa_key(&ks, i);
    float scale = (float)(1.0 / sqrt((double)D));
    mf_fa_heads_q(cx->ly, it, L, q, h0, h1);
    for (int hg = h0; hg < h1; hg += Gmax) {
        int G = h1 - hg < Gmax ? h1 - hg : Gmax;
        const float *qh[4];
        float *oh[4], sink[4];
        for (int g = 0; g < G; g++) {
            qh[g] = q + (int64_t)(hg + g) * D;
            oh[g] = o + (int64_t)(hg + g) * D;
            sink[g] = mf_ly_vec(&y->attn_sink, hg + g);
        }
        mf_kern_vec_attn_out(qh, G, kp, n, D, scale, sink, s, oh);
    }
    mf_fa_heads_o(cx->ly, it, L, o, h0, h1);
}

/* ---- index scores ---------------------------------------------------------------------------- */

void mf_fa_index_scores(const mf_layers *ly, const mf_ly_item *it, int L, float *const *b, double *score,
                        int64_t j0, int64_t j1)
{
    if (j0 >= j1) return;
    const mf_config *c = ly->c;
    int S = ly->src_of[L], id = c->index_head_dim;
    enum { NB = 48, KB = 48 * 128 };   /* keys per block (id <= 128): unpacked with one page walk */
    _Static_assert(KB >= MF_LY_MAX_INDEX_DIM, "a block holds one key of any width");
    float kbuf[KB];
    int nb = KB / id < NB ? KB / id : NB;
    const float *k[NB];
    for (int u = 0; u < nb; u++) k[u] = kbuf + (int64_t)u * id;
    for (int64_t jb = j0; jb < j1; jb += nb) {
        int nk = j1 - jb < nb ? (int)(j1 - jb) : nb;
        mf_ly_cache_get_keys(c, S, &it->st->cache[S], jb, nk, kbuf);
        mf_kern_vec_index_scores(b[MF_LY_A_QI], b[MF_LY_A_IW], c->index_n_heads, k, nk, id, score + jb);
    }
}

/* ---- hyper-connections ----------------------------------------------------------------------- */

/* The streams' 1 / rms, as mf_fa_hc_mixes_rows computes it (the mean square a 16-lane dot). */
static float mf_fa_mix_rs(const mf_config *c, const float *x, int n)
{
    const float *xx[1] = {x};
    float ss;
    mf_kern_vec_dots(xx, 1, x, n, &ss);
    return (float)(1.0 / sqrt((double)ss / (double)n + c->rms_norm_eps));
}

void mf_fa_hc_mixes_rows(const mf_ly_ctx *cx, const float *x, const mf_weight *fn, float *mixes, int k0, int k1)
{
    const mf_config *c = cx->ly->c;
    int n = c->hc_mult * (int)c->hidden_size;
    if (fn->kind != MF_W_F32 || !fn->data) {
        mf_ly_hc_mixes_rows(cx, x, fn, mixes, k0, k1);
        return;
    }
    float *xn = cx->hc_xn;
    mf_kern_vec_scale(xn, x, mf_fa_mix_rs(c, x, n), n);
    for (int k = k0; k < k1; k += 4) {   /* four rows against xn at a time: row . xn has xn . row's bits */
        int G = k1 - k < 4 ? k1 - k : 4;
        const float *rows[4];
        for (int g = 0; g < G; g++) rows[g] = (const float *)(const void *)(fn->data + (size_t)(k + g) * n * 4);
        mf_kern_vec_dots(rows, G, xn, n, &mixes[k]);
    }
}

int mf_fa_mix_items(const mf_config *c, int n_rows, int n_items)
{
    if (n_rows < 1 || n_rows > MF_FA_MIX_MAX_ROWS) return 1;
    if (n_items <= MF_FA_MIX_FOURS) return MF_FA_MIX_FOURS;
    int64_t cap = 4 * (int64_t)c->hc_mult * c->hidden_size;   /* cx->hc_xn's floats (graphs/layers/layers.h) */
    int64_t nb = cap / (16 * (int64_t)n_rows) / 4 * 4;
    if (nb > MF_FA_MIX_ITEMS) nb = MF_FA_MIX_ITEMS;
    return nb > MF_FA_MIX_FOURS ? (int)nb : MF_FA_MIX_FOURS;
}

/* Items in fours (scratch: cx->hc_xn holds four items' normed streams), each four against every
 * row (mf_kern_vec_dots_keys): a row read once per four items. */
static void mf_fa_mixes_fours(const mf_ly_ctx *cx, const float *const *x, int n_items, const float *const *rows,
                              int R, int n, float *const *mixes, int k0)
{
    for (int i0 = 0; i0 < n_items; i0 += MF_FA_MIX_FOURS) {
        int G = n_items - i0 < MF_FA_MIX_FOURS ? n_items - i0 : MF_FA_MIX_FOURS;
        const float *xn[MF_FA_MIX_FOURS];
        for (int g = 0; g < G; g++) {   /* as mf_fa_hc_mixes_rows: the mean square, then x * rs */
            const float *xi = x[i0 + g];
            float *o = cx->hc_xn + (size_t)g * n;
            mf_kern_vec_scale(o, xi, mf_fa_mix_rs(cx->ly->c, xi, n), n);
            xn[g] = o;
        }
        /* the items' normed streams as the queries, the rows as the keys: xn . row per key has the
         * bits of mf_kern_vec_dots(xn, G, row), which are row . xn's (the products commute) */
        float out[MF_FA_MIX_MAX_ROWS][4];
        mf_kern_vec_dots_keys(xn, G, rows, R, n, out);
        for (int g = 0; g < G; g++)
            for (int r = 0; r < R; r++) mixes[i0 + g][k0 + r] = out[r][g];
    }
}

/* G items (at most MF_FA_MIX_ITEMS) against R rows in blocks of MF_FA_MIX_COLS columns: per block
 * each four items' normed columns (x * rs, the bits of the whole normed stream's) against all R
 * rows' block (mf_kern_vec_dots_lanes), their 16 lanes per item and row carried from block to
 * block in cx->hc_xn (G R 16 floats), then each lane tree: a row read once for the G items, each
 * mix the bits of mf_kern_vec_dots over the whole stream. */
static void mf_fa_mixes_blocked(const mf_ly_ctx *cx, const float *const *x, int G, const float *const *rows, int R,
                                int n, float *const *mixes, int k0)
{
    float rs[MF_FA_MIX_ITEMS], *acc = cx->hc_xn;
    for (int g = 0; g < G; g++) rs[g] = mf_fa_mix_rs(cx->ly->c, x[g], n);
    memset(acc, 0, sizeof(float) * 16 * G * R);
    float xb[MF_FA_MIX_FOURS][MF_FA_MIX_COLS];
    const float *kb[MF_FA_MIX_MAX_ROWS];
    for (int c0 = 0; c0 < n; c0 += MF_FA_MIX_COLS) {
        int w = n - c0 < MF_FA_MIX_COLS ? n - c0 : MF_FA_MIX_COLS;
        for (int r = 0; r < R; r++) kb[r] = rows[r] + c0;
        for (int i0 = 0; i0 < G; i0 += MF_FA_MIX_FOURS) {
            int q = G - i0 < MF_FA_MIX_FOURS ? G - i0 : MF_FA_MIX_FOURS;
            const float *xq[MF_FA_MIX_FOURS];
            for (int g = 0; g < q; g++) {
                mf_kern_vec_scale(xb[g], x[i0 + g] + c0, rs[i0 + g], w);
                xq[g] = xb[g];
            }
            mf_kern_vec_dots_lanes(xq, q, kb, R, w, acc + (size_t)i0 * R * 16, R);
        }
    }
    for (int g = 0; g < G; g++)
        for (int r = 0; r < R; r++) mixes[g][k0 + r] = mf_kern_vec_lanes_sum(acc + ((size_t)g * R + r) * 16);
}

void mf_fa_hc_mixes_rows_items(const mf_ly_ctx *cx, const float *const *x, int n_items, const mf_weight *fn,
                               float *const *mixes, int k0, int k1)
{
    const mf_config *c = cx->ly->c;
    int n = c->hc_mult * (int)c->hidden_size, R = k1 - k0;
    if (fn->kind != MF_W_F32 || !fn->data || R > MF_FA_MIX_MAX_ROWS) {
        for (int i = 0; i < n_items; i++) mf_fa_hc_mixes_rows(cx, x[i], fn, mixes[i], k0, k1);
        return;
    }
    const float *rows[MF_FA_MIX_MAX_ROWS];
    for (int r = 0; r < R; r++) rows[r] = (const float *)(const void *)(fn->data + (size_t)(k0 + r) * n * 4);
    int nb = mf_fa_mix_items(c, R, n_items);
    for (int i0 = 0; i0 < n_items; i0 += nb) {
        int G = n_items - i0 < nb ? n_items - i0 : nb;
        if (G > MF_FA_MIX_FOURS) mf_fa_mixes_blocked(cx, x + i0, G, rows, R, n, mixes + i0, k0);
        else mf_fa_mixes_fours(cx, x + i0, G, rows, R, n, mixes + i0, k0);
    }
}

/* 4 columns of a double sum of exact products (p * x, both float): the order of mf_ly_hc_*'s. */
__attribute__((target("avx2,fma"))) static inline __m256d mf_fa_mac4(__m256d acc, float p, const float *x)
{
    __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(x));
    return _mm256_add_pd(acc, _mm256_mul_pd(_mm256_set1_pd((double)p), v));
}

__attribute__((target("avx2,fma"))) static int64_t mf_fa_collapse_avx2(const float *x, const float *pre, int hc,
                                                                     int64_t H, float *h, int64_t d0, int64_t d1)
{
    int64_t d = d0;
    for (; d + 8 <= d1; d += 8) {
        __m256d a = _mm256_setzero_pd(), bb = _mm256_setzero_pd();
        for (int s = 0; s < hc; s++) {
            a = mf_fa_mac4(a, pre[s], x + s * H + d);
            bb = mf_fa_mac4(bb, pre[s], x + s * H + d + 4);
        }
        __m256 f = _mm256_set_m128(_mm256_cvtpd_ps(bb), _mm256_cvtpd_ps(a));
        _mm256_storeu_ps(h + d, mf_simd_bf16_round8(f));
    }
    return d;
}

void mf_fa_hc_collapse_cols(const mf_ly_ctx *cx, const float *x, const float *pre, float *h, int64_t d0, int64_t d1)
{
    const mf_config *c = cx->ly->c;
    int64_t H = c->hidden_size, d = d0;
    if (mf_kern_simd_active() == MF_KERN_SIMD_AVX2) d = mf_fa_collapse_avx2(x, pre, c->hc_mult, H, h, d0, d1);
    for (; d < d1; d++) {
        double acc = 0;
        for (int s = 0; s < c->hc_mult; s++) acc += (double)pre[s] * x[s * H + d];
        h[d] = mf_bf((float)acc);
    }
}

__attribute__((target("avx2,fma"))) static int64_t mf_fa_expand_avx2(float *x, const float *out, const float *post,
                                                                   const float *comb, int hc, int64_t H, int64_t d0,
                                                                   int64_t d1)
{
    int64_t d = d0;
    for (; d + 4 <= d1; d += 4) {
        __m256d col[MF_LY_MAX_HC], o = _mm256_cvtps_pd(_mm_loadu_ps(out + d));
        __m128 res[MF_LY_MAX_HC];
        for (int i = 0; i < hc; i++) col[i] = _mm256_cvtps_pd(_mm_loadu_ps(x + i * H + d));
        for (int j = 0; j < hc; j++) {
            __m256d acc = _mm256_mul_pd(_mm256_set1_pd((double)post[j]), o);
            for (int i = 0; i < hc; i++)
                acc = _mm256_add_pd(acc, _mm256_mul_pd(_mm256_set1_pd((double)comb[i * hc + j]), col[i]));
            res[j] = _mm256_cvtpd_ps(acc);
        }
        for (int j = 0; j < hc; j++) {
            __m256 f = mf_simd_bf16_round8(_mm256_castps128_ps256(res[j]));
            _mm_storeu_ps(x + j * H + d, _mm256_castps256_ps128(f));
        }
    }
    return d;
}

void mf_fa_hc_expand_cols(const mf_ly_ctx *cx, float *x, const float *out, const float *post, const float *comb,
                          int64_t d0, int64_t d1)
{
    const mf_config *c = cx->ly->c;
    int64_t H = c->hidden_size, d = d0;
    int hc = c->hc_mult;
    if (mf_kern_simd_active() == MF_KERN_SIMD_AVX2) d = mf_fa_expand_avx2(x, out, post, comb, hc, H, d0, d1);
    float col[MF_LY_MAX_HC];
    for (; d < d1; d++) {
        for (int i = 0; i < hc; i++) col[i] = x[i * H + d];
        for (int j = 0; j < hc; j++) {
            double acc = (double)post[j] * out[d];
            for (int i = 0; i < hc; i++) acc += (double)comb[i * hc + j] * col[i];
            x[j * H + d] = mf_bf((float)acc);
        }
    }
}

__attribute__((target("avx2,fma"))) static int64_t mf_fa_combine_avx2(const float *y, const uint16_t *y16,
                                                                    const uint8_t *row16, int64_t ld,
                                                                    const int32_t *rows, int n, const float *sh,
                                                                    float *out, int64_t d0, int64_t d1)
{
    int64_t d = d0;
    for (; d + 8 <= d1; d += 8) {
        __m256d a = _mm256_setzero_pd(), bb = _mm256_setzero_pd();
        for (int k = 0; k < n; k++) {   /* the outputs in their order: each column's double sum as the scalar loop */
            size_t at = (size_t)rows[k] * ld + (size_t)d;
            __m256 v = row16 && row16[rows[k]] ? mf_simd_bf16_load8(y16 + at) : mf_simd_bf16_round8(_mm256_loadu_ps(y + at));
            a = _mm256_add_pd(a, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
            bb = _mm256_add_pd(bb, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
        }
        if (sh) {
            a = _mm256_add_pd(a, _mm256_cvtps_pd(_mm_loadu_ps(sh + d)));
            bb = _mm256_add_pd(bb, _mm256_cvtps_pd(_mm_loadu_ps(sh + d + 4)));
        }
        __m256 f = _mm256_set_m128(_mm256_cvtpd_ps(bb), _mm256_cvtpd_ps(a));
        _mm256_storeu_ps(out + d, mf_simd_bf16_round8(f));
    }
    return d;
}

void mf_fa_combine_cols(const float *y, const uint16_t *y16, const uint8_t *row16, int64_t ld, const int32_t *rows,
                        int n, const float *sh, float *out, int64_t d0, int64_t d1)
{
    int64_t d = d0;
    if (mf_kern_simd_active() == MF_KERN_SIMD_AVX2) d = mf_fa_combine_avx2(y, y16, row16, ld, rows, n, sh, out, d0, d1);
    for (; d < d1; d++) {
        double acc = 0;
        for (int k = 0; k < n; k++) {
            size_t at = (size_t)rows[k] * ld + (size_t)d;
            acc += row16 && row16[rows[k]] ? mf_bf16_to_f32(y16[at]) : mf_bf(y[at]);
        }
        if (sh) acc += sh[d];
        out[d] = mf_bf((float)acc);
    }
}

/* ---- grouped wo_a ---------------------------------------------------------------------------- */

int mf_fa_grouped_kern(const mf_ly_attn_lin *l)
{
    const mf_weight *w = l->w;
    return l->groups > 0 && w->data && w->kind == MF_W_FP8 && w->block_rows == 32 && w->block_cols == 32 &&
           !(w->cols % 32) && !((w->rows / l->groups) % 32);
}

int mf_fa_grouped_rows(mf_ly_ctx *cx, const mf_ly_attn_lin *l, const float *x, int64_t ld_x, float *y,
                       int64_t ld_y, int n_tok, int64_t r0, int64_t r1)
{
    const mf_weight *w = l->w;
    if (cx->lin != MF_LY_LIN_KERN || !mf_fa_grouped_kern(l))
        return mf_ly_attn_lin_rows(cx, l, x, ld_x, y, ld_y, n_tok, r0, r1);
    mf_kern_mat m = {.fmt = MF_KERN_FP8, .w = w->data, .scale = w->scale, .n_out = (int)w->rows,
                     .n_in = (int)w->cols};
    int64_t R = w->rows / l->groups;
    for (int64_t a = r0; a < r1;) {   /* the rows of one group at a time, all items */
        int64_t g = a / R, e = (g + 1) * R < r1 ? (g + 1) * R : r1;
        int rc = mf_kern_matmul(&m, &(mf_kern_in){x + g * w->cols, n_tok, (int)ld_x, NULL}, y, (int)ld_y, (int)a,
                                (int)e);
        if (rc) return rc;
        if (l->bf)
            for (int t = 0; t < n_tok; t++) mf_fa_bf_n(y + t * ld_y + a, e - a);
        a = e;
    }
    return 0;
}

/* ---- the indexer's selection ----------------------------------------------------------------- */

/* a before b in mf_ly_sort_picks's order (score descending, index ascending): a strict total
 * order on picks without NaN scores, so the k first of it are one set however they are found */
static inline int mf_fa_before(const mf_ly_pick *a, const mf_ly_pick *b)
{
    return a->score > b->score || (a->score == b->score && a->idx < b->idx);
}

static inline void mf_fa_swap(mf_ly_pick *a, mf_ly_pick *b)
{
    mf_ly_pick t = *a;
    *a = *b;
    *b = t;
}

/* Reorders p so that p[0, k) are its k first picks (in no particular order): quickselect with a
 * median-of-three pivot, insertion sort below 16. */
static void mf_fa_top(mf_ly_pick *p, int64_t n, int64_t k)
{
    if (k <= 0 || k >= n) return;
    int64_t lo = 0, hi = n;
    while (hi - lo > 16) {
        int64_t mid = lo + (hi - lo) / 2;
        if (mf_fa_before(&p[mid], &p[lo])) mf_fa_swap(&p[mid], &p[lo]);
        if (mf_fa_before(&p[hi - 1], &p[lo])) mf_fa_swap(&p[hi - 1], &p[lo]);
        if (mf_fa_before(&p[hi - 1], &p[mid])) mf_fa_swap(&p[hi - 1], &p[mid]);
        mf_fa_swap(&p[mid], &p[hi - 1]);   /* the median as pivot, at the end */
        mf_ly_pick piv = p[hi - 1];
        int64_t st = lo;
        for (int64_t i = lo; i < hi - 1; i++)
            if (mf_fa_before(&p[i], &piv)) mf_fa_swap(&p[i], &p[st++]);
        mf_fa_swap(&p[st], &p[hi - 1]);
        if (k <= st) hi = st;
        else if (k > st + 1) lo = st + 1;
        else return;
    }
    for (int64_t i = lo + 1; i < hi; i++)
        for (int64_t j = i; j > lo && mf_fa_before(&p[j], &p[j - 1]); j--) mf_fa_swap(&p[j], &p[j - 1]);
}

/* The indices of the k first picks whose score is not -inf, ascending, into out; their count. */
static int mf_fa_top_idx(mf_ly_pick *p, int64_t n, int64_t k, int32_t *out)
{
    mf_fa_top(p, n, k);
    int m = 0;
    for (int64_t i = 0; i < k; i++)
        if (p[i].score != -INFINITY) out[m++] = p[i].idx;
    for (int i = 1; i < m; i++)
        for (int j = i; j > 0 && out[j - 1] > out[j]; j--) {
            int32_t t = out[j];
            out[j] = out[j - 1];
            out[j - 1] = t;
        }
    return m;
}

void mf_fa_attn_select(mf_ly_ctx *cx, mf_ly_item *it, int L, double *score)
{
    const mf_config *c = cx->ly->c;
    int ratio = c->compress_ratios[L];
    if (ratio == 0) return;
    int S = cx->ly->src_of[L];
    int64_t n_vis = mf_ly_index_n_vis(c, L, it->pos);
    for (int64_t j = 0; j < n_vis; j++)
        if (isnan(score[j])) {   /* no total order: the module's sort decides */
            mf_ly_attn_core_select(cx, it, L, score);
            return;
        }
    if (n_vis > 0) {
        int bs = c->candidate_block_size, cl = c->candidate_source_layer_id;
        mf_ly_pick *pk = cx->picks;
        if (L == cl) {   /* the candidate blocks: top blocks by max score, the newest pinned */
            int64_t nb = (n_vis + bs - 1) / bs;
            for (int64_t b = 0; b < nb; b++) {
                double mx = -INFINITY;
                for (int64_t j = b * bs; j < (b + 1) * bs && j < n_vis; j++) mx = score[j] > mx ? score[j] : mx;
                pk[b].score = b == (n_vis - 1) / bs ? INFINITY : mx;
                pk[b].idx = (int32_t)b;
            }
            it->n_cand = mf_fa_top_idx(pk, nb, nb < c->candidate_topk_blocks ? nb : c->candidate_topk_blocks, it->cand);
            it->cand_src = S;
            if (cx->ly->hooks.on_candidates)
                cx->ly->hooks.on_candidates(cx->ly->hooks.user, it->st, it->pos, L, it->cand, it->n_cand);
        } else if (cl >= 0 && cl < L && it->cand_src == S) {   /* outside the candidate blocks: -inf */
            int ci = 0;
            for (int64_t j = 0; j < n_vis; j++) {
                int32_t b = (int32_t)(j / bs);
                while (ci < it->n_cand && it->cand[ci] < b) ci++;
                if (ci >= it->n_cand || it->cand[ci] != b) score[j] = -INFINITY;
            }
        }
        for (int64_t j = 0; j < n_vis; j++) pk[j] = (mf_ly_pick){score[j], (int32_t)j};
        it->n_topk = mf_fa_top_idx(pk, n_vis, n_vis < c->index_topk ? n_vis : c->index_topk, it->topk);
        it->topk_src = S;
        mf_ly_item_selected(c, it);
    }
    if (mf_config_is_index_source(c, L) && n_vis == 0) {
        it->n_topk = 0;
        it->topk_src = S;
    }
    if (cx->ly->hooks.on_select) {
        int sel = it->topk_src == S;
        cx->ly->hooks.on_select(cx->ly->hooks.user, it->st, it->pos, L, sel ? it->topk : NULL, sel ? it->n_topk : 0);
    }
}

/* ---- norms ----------------------------------------------------------------------------------- */

/* out[i] = bf(w[i] * bf(x[i] * rs)) for 8 columns at a time (w fp32 or bf16): the scalar loop's products */
__attribute__((target("avx2,fma"))) static int64_t mf_fa_norm_avx2(const float *x, const uint8_t *w, int f32, float rs,
                                                                 float *out, int64_t c0, int64_t c1)
{
    __m256 r = _mm256_set1_ps(rs);
    int64_t i = c0;
    for (; i + 8 <= c1; i += 8) {
        __m256 t = mf_simd_bf16_round8(_mm256_mul_ps(_mm256_loadu_ps(x + i), r));
        __m256 wv = f32 ? _mm256_loadu_ps((const float *)(const void *)(w + 4 * i))
                        : mf_simd_bf16_load8((const uint16_t *)(const void *)(w + 2 * i));
        _mm256_storeu_ps(out + i, mf_simd_bf16_round8(_mm256_mul_ps(wv, t)));
    }
    return i;
}

void mf_fa_rmsnorm_cols(const float *x, int64_t n, const mf_weight *w, double eps, float *out, int64_t c0,
                        int64_t c1)
{
    if ((w->kind != MF_W_BF16 && w->kind != MF_W_F32) || !w->data) {
        mf_ly_rmsnorm_cols(x, n, w, eps, out, c0, c1);
        return;
    }
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];   /* the module's order */
    float rs = (float)(1.0 / sqrt(ss / (double)n + eps));
    int64_t i = c0;
    if (mf_kern_simd_active() == MF_KERN_SIMD_AVX2) i = mf_fa_norm_avx2(x, w->data, w->kind == MF_W_F32, rs, out, c0, c1);
    for (; i < c1; i++) {
        float wv;
        if (w->kind == MF_W_F32) {
            memcpy(&wv, w->data + 4 * i, 4);
        } else {
            uint16_t h;
            memcpy(&h, w->data + 2 * i, 2);
            uint32_t u = (uint32_t)h << 16;
            memcpy(&wv, &u, 4);
        }
        out[i] = mf_bf(wv * mf_bf(x[i] * rs));
    }
}

/* ---- the router gate ------------------------------------------------------------------------- */

int mf_fa_gate_rows(mf_ly_ctx *cx, int L, const float *x, int n_tok, int64_t ld_x, float *logits, int64_t ld_y,
                    int64_t r0, int64_t r1)
{
    const mf_weight *w = &mf_model_layer_at(cx->ly->m, L)->gate;
    if (cx->lin != MF_LY_LIN_KERN || !mf_ly_linear_kern(w)) return mf_ly_gate_rows(cx, L, x, n_tok, ld_x, logits, ld_y, r0, r1);
    return mf_ly_linear_part(cx, w, x, n_tok, ld_x, logits, ld_y, r0, r1);
}
