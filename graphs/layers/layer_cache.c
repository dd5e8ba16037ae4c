/* The compressed caches of KV-source layers (graphs/layers/layers.h): entries and index keys stored as
 * the E2M1 codes and scales their fake quantization rounds to, in pages, and the one place the
 * attention and the indexer write and read them; the window ring's slots (E4M3 codes and
 * exponents) likewise. The pages themselves are the state's
 * (graphs/ref/ref_state.c). A page of n entries: KV codes (n x head_dim/2), KV scales (n x
 * head_dim/16), key codes (n x index_head_dim/2), key scales (n x index_head_dim/32). */
#include "graphs/layers/layers.h"

#define MF_LY_KV_BLOCK 16    /* values per E4M3 scale of an entry */
#define MF_LY_KEY_BLOCK 32   /* values per UE8M0 scale of an index key */

typedef struct mf_ly_cgeom {
    int64_t kv_codes, kv_scales, key_codes, key_scales;   /* bytes per entry of each part */
    int64_t per_page;
} mf_ly_cgeom;

static mf_ly_cgeom mf_ly_cache_geom(const mf_config *c, int L)
{
    int64_t D = c->head_dim, id = c->index_head_dim;
    mf_ly_cgeom g = {(D + 1) / 2, (D + MF_LY_KV_BLOCK - 1) / MF_LY_KV_BLOCK, (id + 1) / 2,
                     (id + MF_LY_KEY_BLOCK - 1) / MF_LY_KEY_BLOCK, 0};
    int r = c->compress_ratios[L] > 0 ? c->compress_ratios[L] : 1;
    g.per_page = (MF_LY_PAGE_POSITIONS + r - 1) / r;
    return g;
}

int64_t mf_ly_cache_page_entries(const mf_config *c, int L) { return mf_ly_cache_geom(c, L).per_page; }

int64_t mf_ly_cache_entry_bytes(const mf_config *c)
{
    mf_ly_cgeom g = mf_ly_cache_geom(c, 0);
    return g.kv_codes + g.kv_scales + g.key_codes + g.key_scales;
}

int64_t mf_ly_cache_page_bytes(const mf_config *c, int L)
{
    return mf_ly_cache_page_entries(c, L) * mf_ly_cache_entry_bytes(c);
}

/* Where entry j's parts are: the page, then each part's row (part k's rows start after k parts) */
typedef struct mf_ly_cref {
    uint8_t *kv_codes, *kv_scales, *key_codes, *key_scales;
} mf_ly_cref;

static mf_ly_cref mf_ly_cache_at(const mf_config *c, int L, const mf_ly_cache *ca, int64_t j)
{
    mf_ly_cgeom g = mf_ly_cache_geom(c, L);
    int64_t p = j / g.per_page, r = j % g.per_page, n = g.per_page;
    uint8_t *base = ca->page[p];
    mf_ly_cref e;
    e.kv_codes = base + r * g.kv_codes;
    base += n * g.kv_codes;
    e.kv_scales = base + r * g.kv_scales;
    base += n * g.kv_scales;
    e.key_codes = base + r * g.key_codes;
    base += n * g.key_codes;
    e.key_scales = base + r * g.key_scales;
    return e;
}

void mf_ly_cache_put_kv(const mf_config *c, int L, mf_ly_cache *ca, int64_t j, const float *kv)
{
    mf_ly_cref e = mf_ly_cache_at(c, L, ca, j);
    mf_ly_pack_e2m1_e4m3(kv, c->head_dim, MF_LY_KV_BLOCK, e.kv_codes, e.kv_scales);
}

void mf_ly_cache_put_key(const mf_config *c, int L, mf_ly_cache *ca, int64_t j, const float *key)
{
    mf_ly_cref e = mf_ly_cache_at(c, L, ca, j);
    mf_ly_pack_e2m1_pow2(key, c->index_head_dim, MF_LY_KEY_BLOCK, e.key_codes, e.key_scales);
}

void mf_ly_cache_get_kv(const mf_config *c, int L, const mf_ly_cache *ca, int64_t j, float *out)
{
    mf_ly_cref e = mf_ly_cache_at(c, L, ca, j);
    mf_ly_unpack_e2m1_e4m3(e.kv_codes, e.kv_scales, c->head_dim, MF_LY_KV_BLOCK, out);
}

void mf_ly_cache_get_key(const mf_config *c, int L, const mf_ly_cache *ca, int64_t j, float *out)
{
    mf_ly_cref e = mf_ly_cache_at(c, L, ca, j);
    mf_ly_unpack_e2m1_pow2(e.key_codes, e.key_scales, c->index_head_dim, MF_LY_KEY_BLOCK, out);
}

void mf_ly_cache_get_keys(const mf_config *c, int L, const mf_ly_cache *ca, int64_t j0, int64_t n, float *out)
{
    mf_ly_cgeom g = mf_ly_cache_geom(c, L);
    int64_t id = c->index_head_dim;
    for (int64_t j = j0; j < j0 + n;) {   /* the keys of one page at a time */
        mf_ly_cref e = mf_ly_cache_at(c, L, ca, j);
        int64_t end = (j / g.per_page + 1) * g.per_page < j0 + n ? (j / g.per_page + 1) * g.per_page : j0 + n;
        for (int64_t r = 0; j < end; j++, r++, out += id)
            mf_ly_unpack_e2m1_pow2(e.key_codes + r * g.key_codes, e.key_scales + r * g.key_scales, id,
                                   MF_LY_KEY_BLOCK, out);
    }
}

void mf_ly_cache_get_kv_rows(const mf_config *c, int L, const mf_ly_cache *ca, const int32_t *rows, int n,
                             float *out)
{
    for (int i = 0; i < n; i++) mf_ly_cache_get_kv(c, L, ca, rows[i], out + (int64_t)i * c->head_dim);
}

void mf_ly_item_selected(const mf_config *c, mf_ly_item *it)
{
    if (it->sel_kv && it->n_topk > 0)
        mf_ly_cache_get_kv_rows(c, it->topk_src, &it->st->cache[it->topk_src], it->topk, it->n_topk, it->sel_kv);
}

const float *mf_ly_item_sel_kv(const mf_config *c, const mf_ly_item *it, float *scratch)
{
    if (it->sel_kv) return it->sel_kv;
    mf_ly_cache_get_kv_rows(c, it->topk_src, &it->st->cache[it->topk_src], it->topk, it->n_topk, scratch);
    return scratch;
}

/* The parts of entries [r0, r0 + n) of a page: part k's rows start after k parts of per_page rows */
static void mf_ly_cache_parts(const mf_config *c, int L, int64_t off[4], int64_t len[4])
{
    mf_ly_cgeom g = mf_ly_cache_geom(c, L);
    int64_t b[4] = {g.kv_codes, g.kv_scales, g.key_codes, g.key_scales}, at = 0;
    for (int k = 0; k < 4; k++) {
        off[k] = at;
        len[k] = b[k];
        at += g.per_page * b[k];
    }
}

void mf_ly_cache_save(const mf_config *c, int L, const uint8_t *page, int64_t r0, int64_t n, uint8_t *out)
{
    int64_t off[4], len[4];
    mf_ly_cache_parts(c, L, off, len);
    for (int k = 0; k < 4; k++, out += n * len[k - 1]) memcpy(out, page + off[k] + r0 * len[k], (size_t)(n * len[k]));
}

void mf_ly_cache_load(const mf_config *c, int L, uint8_t *page, int64_t r0, int64_t n, const uint8_t *in)
{
    int64_t off[4], len[4];
    mf_ly_cache_parts(c, L, off, len);
    for (int k = 0; k < 4; k++, in += n * len[k - 1]) memcpy(page + off[k] + r0 * len[k], in, (size_t)(n * len[k]));
}

/* ---- the window ring ------------------------------------------------------------------------- */

/* A slot: head_dim E4M3 codes, then ceil(head_dim / MF_LY_RING_BLOCK) exponent bytes. */
int64_t mf_ly_ring_row_bytes(const mf_config *c)
{
    return c->head_dim + (c->head_dim + MF_LY_RING_BLOCK - 1) / MF_LY_RING_BLOCK;
}

int64_t mf_ly_ring_bytes(const mf_config *c) { return (int64_t)c->n_layers * c->sliding_window * mf_ly_ring_row_bytes(c); }

static uint8_t *mf_ly_ring_slot(const mf_config *c, const mf_ref_state *st, int L, int64_t t)
{
    return st->ring + ((int64_t)L * c->sliding_window + t % c->sliding_window) * mf_ly_ring_row_bytes(c);
}

const uint8_t *mf_ly_ring_row(const mf_config *c, const mf_ref_state *st, int L, int64_t t, const uint8_t **scales)
{
    const uint8_t *row = mf_ly_ring_slot(c, st, L, t);
    *scales = row + c->head_dim;
    return row;
}

/* The tap's row of position pos, layer L (NULL: the tap does not hold pos) */
static uint8_t *mf_ly_ring_tap_row(const mf_config *c, const mf_ref_state *st, int L, int64_t pos)
{
    int64_t i = pos - st->tap_pos0;
    if (!st->tap || i < 0 || i >= st->tap_n || !st->tap[i]) return NULL;
    return st->tap[i] + L * mf_ly_ring_row_bytes(c);
}

void mf_ly_ring_put(const mf_config *c, mf_ref_state *st, int L, int64_t pos, const float *kv)
{
    uint8_t *row = mf_ly_ring_slot(c, st, L, pos), *tap = mf_ly_ring_tap_row(c, st, L, pos);
    mf_ly_pack_e4m3_pow2(kv, c->head_dim, MF_LY_RING_BLOCK, row, row + c->head_dim);
    if (tap) memcpy(tap, row, (size_t)mf_ly_ring_row_bytes(c));
}

void mf_ly_ring_tap(const mf_config *c, mf_ref_state *st, int L, int64_t pos, const float *kv)
{
    uint8_t *tap = mf_ly_ring_tap_row(c, st, L, pos);
    if (tap) mf_ly_pack_e4m3_pow2(kv, c->head_dim, MF_LY_RING_BLOCK, tap, tap + c->head_dim);
}

void mf_ly_ring_set_row(const mf_config *c, mf_ref_state *st, int L, int64_t t, const uint8_t *row)
{
    memcpy(mf_ly_ring_slot(c, st, L, t), row, (size_t)mf_ly_ring_row_bytes(c));
}

void mf_ly_ring_get(const mf_config *c, const mf_ref_state *st, int L, int64_t t0, int64_t n, float *out)
{
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *sc, *row = mf_ly_ring_row(c, st, L, t0 + i, &sc);
        mf_ly_unpack_e4m3_pow2(row, sc, c->head_dim, MF_LY_RING_BLOCK, out + i * c->head_dim);
    }
}

/* ---- speculation's journal (mf_ly_journal) --------------------------------------------------- */

void mf_ly_journal_pend(const mf_config *c, mf_ref_state *st, int L, int64_t pos, const float *kv, const float *score)
{
    mf_ly_journal *jr = st->jr;
    if (!jr || !jr->active || pos < jr->pos0 || pos >= jr->pos0 + jr->n) return;
    int k = 0;
    while (k < jr->n_src2 && jr->src2[k] != L) k++;
    if (k == jr->n_src2) return;
    int64_t D = c->head_dim, i = pos - jr->pos0;
    float *p = jr->pend + ((int64_t)k * (1 + jr->cap) + 1 + i) * 2 * D;
    memcpy(p, kv, (size_t)D * sizeof *p);
    memcpy(p + D, score, (size_t)D * sizeof *p);
    jr->pend_set[(int64_t)k * jr->cap + i] = 1;
}
