/* Sequence states (graphs/ref/ref.h): a fixed part (the packed window ring, the open compressor
 * groups, the caches' headers) allocated once, and what grows with the positions: the token history and
 * the pages of the packed compressed caches (graphs/layers/layer_cache.c). Pages are added before a
 * forward touches the state (mf_ref_state_reserve) and kept over a reset, unless shared: pages are
 * reference counted (a header before the bytes), so the prefix cache (graphs/prefix/prefix.h) and
 * other states can hold a full page without a copy. */
#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/layers/layers.h"
#include "graphs/ref/ref.h"
#include "sched/error.h"

/* ---- pages: reference-counted blocks --------------------------------------------------------- */

typedef struct mf_pg_hdr {
    _Atomic int refs;    /* holders */
    _Atomic int keep;    /* holders that account its bytes (mf_ref_page_keep) */
    int64_t bytes;
    uint8_t pad[48];     /* the page's bytes start 64 bytes in */
} mf_pg_hdr;
_Static_assert(sizeof(mf_pg_hdr) == 64, "page header");

static mf_pg_hdr *mf_pg_of(const uint8_t *pg) { return (mf_pg_hdr *)(uintptr_t)(pg - sizeof(mf_pg_hdr)); }

uint8_t *mf_ref_page_new(int64_t bytes)
{
    mf_pg_hdr *h = malloc(sizeof *h + (size_t)bytes);
    if (!h) return NULL;
    atomic_init(&h->refs, 1);
    atomic_init(&h->keep, 0);
    h->bytes = bytes;
    return (uint8_t *)(h + 1);
}

void mf_ref_page_hold(uint8_t *pg) { atomic_fetch_add(&mf_pg_of(pg)->refs, 1); }

void mf_ref_page_drop(uint8_t *pg)
{
    if (pg && atomic_fetch_sub(&mf_pg_of(pg)->refs, 1) == 1) free(mf_pg_of(pg));
}

int mf_ref_page_refs(const uint8_t *pg) { return atomic_load(&mf_pg_of(pg)->refs); }
int64_t mf_ref_page_bytes(const uint8_t *pg) { return mf_pg_of(pg)->bytes; }
int mf_ref_page_keep(uint8_t *pg, int delta) { return atomic_fetch_add(&mf_pg_of(pg)->keep, delta) + delta; }

/* ---- states ------------------------------------------------------------------------------------ */

static int64_t mf_st_round(int64_t n) { return (n + MF_LY_PAGE_POSITIONS - 1) / MF_LY_PAGE_POSITIONS * MF_LY_PAGE_POSITIONS; }

/* Pages KV-source layer L's cache needs for positions [0, cap): its entries, floor(cap / ratio). */
static int64_t mf_st_pages(const mf_config *c, int L, int64_t cap)
{
    int64_t per = mf_ly_cache_page_entries(c, L), n = cap / c->compress_ratios[L];
    return (n + per - 1) / per;
}

static int64_t mf_st_fixed_bytes(const mf_config *c)
{
    int64_t D = c->head_dim, n_src = 0;
    for (int L = 0; L < c->n_layers; L++) n_src += mf_config_is_kv_source(c, L);
    return (int64_t)sizeof(mf_ref_state) + c->n_layers * (int64_t)sizeof(mf_ly_cache) +
           n_src * 2 * D * (int64_t)sizeof(float) + mf_ly_ring_bytes(c);
}

/* Bytes of what grows, for positions [0, cap) with cap a multiple of the page */
static int64_t mf_st_grown_bytes(const mf_config *c, int64_t cap)
{
    int64_t bytes = cap * (int64_t)sizeof(int32_t);
    for (int L = 0; L < c->n_layers; L++)
        if (mf_config_is_kv_source(c, L))
            bytes += mf_st_pages(c, L, cap) * (mf_ly_cache_page_bytes(c, L) + (int64_t)sizeof(uint8_t *));
    return bytes;
}

int64_t mf_ref_state_bytes(const mf_config *c, int64_t n_positions)
{
    return mf_st_fixed_bytes(c) + mf_st_grown_bytes(c, mf_st_round(n_positions < 0 ? 0 : n_positions));
}

int64_t mf_ref_state_held_bytes(const mf_ref_state *s)
{
    const mf_config *c = s->ly->c;
    int64_t bytes = mf_st_fixed_bytes(c) + s->tok_cap * (int64_t)sizeof(int32_t);
    for (int L = 0; L < c->n_layers; L++) {
        const mf_ly_cache *ca = &s->cache[L];
        bytes += ca->n_pages * (int64_t)sizeof(uint8_t *);
        for (int64_t p = 0; p < ca->n_pages; p++)   /* a shared page is the prefix cache's to count */
            if (mf_ref_page_keep(ca->page[p], 0) == 0) bytes += mf_ly_cache_page_bytes(c, L);
    }
    return bytes;
}

/* cap_pos from what the pages and the token history hold */
static void mf_st_cap(mf_ref_state *s)
{
    const mf_config *c = s->ly->c;
    int64_t cap = s->tok_cap / MF_LY_PAGE_POSITIONS * MF_LY_PAGE_POSITIONS;
    for (int L = 0; L < c->n_layers; L++)
        if (mf_config_is_kv_source(c, L)) {
            int64_t n = s->cache[L].n_pages * mf_ly_cache_page_entries(c, L) * c->compress_ratios[L];
            n = n / MF_LY_PAGE_POSITIONS * MF_LY_PAGE_POSITIONS;
            if (n < cap) cap = n;
        }
    s->cap_pos = cap;
}

int mf_ref_state_new(const mf_ref *r, int64_t max_positions, mf_ref_state **out)
{
    *out = NULL;
    const mf_layers *ly = mf_ref_layers(r);
    const mf_config *c = ly->c;
    if (max_positions < 1 || max_positions > c->max_position_embeddings)
        return mf_error(-EINVAL, "reference: max_positions %" PRId64 " outside 1..%" PRId64
                        " (max_position_embeddings)", max_positions, c->max_position_embeddings);
    int64_t D = c->head_dim;
    size_t bytes = (size_t)(mf_st_fixed_bytes(c) - (int64_t)sizeof(mf_ref_state));
    mf_ref_state *s = calloc(1, sizeof *s);
    uint8_t *p = calloc(1, bytes);
    if (!s || !p) {
        free(s);
        free(p);
        return mf_error(-ENOMEM, "reference: cannot allocate %zu bytes for a sequence state", bytes);
    }
    s->ly = ly;
    s->max_pos = max_positions;
    s->mem = p;
    s->cache = (mf_ly_cache *)p;
    p += (size_t)c->n_layers * sizeof(mf_ly_cache);
    for (int L = 0; L < c->n_layers; L++)
        if (mf_config_is_kv_source(c, L)) {
            mf_ly_cache *ca = &s->cache[L];
            ca->pend_kv = (float *)p;
            p += (size_t)D * sizeof(float);
            ca->pend_score = (float *)p;
            p += (size_t)D * sizeof(float);
        }
    s->ring = p;   /* last: its bytes leave the floats above aligned */
    *out = s;
    return 0;
}

/* Frees the pages of every cache past what positions [0, cap) need and sizes the tables and the
 * token history to cap (shrinking never fails: a failed realloc keeps the larger block). */
static void mf_st_shrink(mf_ref_state *s, int64_t cap)
{
    const mf_config *c = s->ly->c;
    for (int L = 0; L < c->n_layers; L++) {
        mf_ly_cache *ca = &s->cache[L];
        if (!mf_config_is_kv_source(c, L)) continue;
        int64_t keep = mf_st_pages(c, L, cap);
        while (ca->n_pages > keep) mf_ref_page_drop(ca->page[--ca->n_pages]);
        if (!keep) {
            free(ca->page);
            ca->page = NULL;
        } else {
            uint8_t **t = realloc(ca->page, (size_t)keep * sizeof *t);
            if (t) ca->page = t;
        }
    }
    if (!cap) {
        free(s->tokens);
        s->tokens = NULL;
        s->tok_cap = 0;
    } else if (cap < s->tok_cap) {
        int32_t *t = realloc(s->tokens, (size_t)cap * sizeof *t);
        if (t) s->tokens = t;
        s->tok_cap = cap;
    }
    mf_st_cap(s);
}

int mf_ref_state_reserve(mf_ref_state *s, int64_t n_positions)
{
    if (n_positions > s->max_pos)
        return mf_error(-EINVAL, "reference: %" PRId64 " positions reserved, past the state's maximum of %" PRId64,
                        n_positions, s->max_pos);
    if (n_positions <= s->cap_pos) return 0;
    const mf_config *c = s->ly->c;
    int64_t cap = mf_st_round(n_positions), old = s->cap_pos;
    if (cap > s->max_pos) cap = mf_st_round(s->max_pos);
    if (s->tok_cap < cap) {
        int32_t *tok = realloc(s->tokens, (size_t)cap * sizeof *tok);
        if (!tok)
            return mf_error(-ENOMEM, "reference: cannot grow a state's token history to %" PRId64 " positions", cap);
        s->tokens = tok;
        s->tok_cap = cap;
    }
    int l0, l1;   /* a pipeline stage's model: pages only for the layers it runs */
    mf_model_layers(s->ly->m, &l0, &l1);
    for (int L = l0; L < l1; L++) {
        mf_ly_cache *ca = &s->cache[L];
        if (!mf_config_is_kv_source(c, L)) continue;
        int64_t need = mf_st_pages(c, L, cap), pb = mf_ly_cache_page_bytes(c, L);
        if (need <= ca->n_pages) continue;
        uint8_t **t = realloc(ca->page, (size_t)need * sizeof *t);
        if (t) ca->page = t;
        while (t && ca->n_pages < need && (ca->page[ca->n_pages] = mf_ref_page_new(pb))) ca->n_pages++;
        if (ca->n_pages < need) {   /* back to what it held: the state is as it was */
            mf_st_shrink(s, old);
            return mf_error(-ENOMEM, "reference: cannot allocate page %" PRId64 " (%" PRId64 " bytes) of layer %d's "
                            "compressed cache, growing a state to %" PRId64 " positions", ca->n_pages, pb, L, cap);
        }
    }
    mf_st_cap(s);
    return 0;
}

int mf_ref_states_reserve(mf_ref_state *const *states, int n)
{
    for (int i = 0, j = 0; i < n; i++) {
        if (i > 0 && states[i] != states[i - 1]) j = i;   /* j: the first item of i's run */
        if (i + 1 < n && states[i + 1] == states[i]) continue;
        int rc = mf_ref_state_reserve(states[i], states[i]->n_pos + (i - j + 1));
        if (rc) return rc;
    }
    return 0;
}

void mf_ref_state_trim(mf_ref_state *s, int64_t n_positions)
{
    int64_t keep = n_positions > s->n_pos ? n_positions : s->n_pos;
    mf_st_shrink(s, mf_st_round(keep));   /* pages and tokens past it (after a reset: what its shared pages left) */
}

void mf_ref_state_free(mf_ref_state *s)
{
    if (!s) return;
    if (s->jr) free(s->jr->mem);
    free(s->jr);
    mf_st_shrink(s, 0);
    free(s->mem);
    free(s);
}

void mf_ref_state_reset(mf_ref_state *s)
{
    s->n_pos = 0;
    if (s->jr) s->jr->active = 0;
    s->tap = NULL;
    s->tap_n = 0;
    for (int L = 0; L < s->ly->c->n_layers; L++) {
        mf_ly_cache *ca = &s->cache[L];
        ca->n = 0;
        int64_t k = 0;   /* shared pages go back to their other holders; the state's own are kept */
        for (int64_t p = 0; p < ca->n_pages; p++) {
            if (mf_ref_page_refs(ca->page[p]) > 1) mf_ref_page_drop(ca->page[p]);
            else ca->page[k++] = ca->page[p];
        }
        ca->n_pages = k;
    }
    mf_st_cap(s);
}

int mf_ref_state_map(mf_ref_state *s, int L, uint8_t *const *pages, int64_t n)
{
    const mf_config *c = s->ly->c;
    if (L < 0 || L >= c->n_layers || !mf_config_is_kv_source(c, L))
        return mf_error(-EINVAL, "reference: layer %d has no compressed cache to map pages into", L);
    if (s->n_pos)
        return mf_error(-EINVAL, "reference: pages mapped into a state at position %" PRId64 " (expected a reset "
                        "state)", s->n_pos);
    mf_ly_cache *ca = &s->cache[L];
    uint8_t **t = realloc(ca->page, (size_t)(ca->n_pages + n) * sizeof *t);
    if (!t && ca->n_pages + n) return mf_error(-ENOMEM, "reference: cannot grow a state's page table");
    ca->page = t;
    memmove(t + n, t, (size_t)ca->n_pages * sizeof *t);   /* its own pages after the mapped ones */
    for (int64_t p = 0; p < n; p++) {
        mf_ref_page_hold(pages[p]);
        t[p] = pages[p];
    }
    ca->n_pages += n;
    mf_st_cap(s);
    return 0;
}

int mf_ref_state_unshare(mf_ref_state *s, int L, int64_t p)
{
    mf_ly_cache *ca = &s->cache[L];
    if (p < 0 || p >= ca->n_pages || mf_ref_page_refs(ca->page[p]) == 1) return 0;
    int64_t pb = mf_ly_cache_page_bytes(s->ly->c, L), last = ca->n_pages - 1;
    uint8_t *pg;
    if (last > p && mf_ref_page_refs(ca->page[last]) == 1) {   /* a page the state kept (after the mapped ones) */
        pg = ca->page[last];
        ca->n_pages--;
        mf_st_cap(s);
    } else if (!(pg = mf_ref_page_new(pb))) {
        return mf_error(-ENOMEM, "reference: cannot copy page %" PRId64 " of layer %d (%" PRId64 " bytes)", p, L, pb);
    }
    memcpy(pg, ca->page[p], (size_t)pb);
    mf_ref_page_drop(ca->page[p]);
    ca->page[p] = pg;
    return 0;
}

int64_t mf_ref_state_pos(const mf_ref_state *s) { return s->n_pos; }

/* ---- speculation: the verify's journal and the rollback (docs/dspark.md "Rollback") ---------- */

/* The ring slot of layer L that position t writes (layer_cache.c's layout: slot t % window). */
static uint8_t *mf_st_ring_slot(const mf_config *c, mf_ref_state *s, int L, int64_t t)
{
    return s->ring + ((int64_t)L * c->sliding_window + t % c->sliding_window) * mf_ly_ring_row_bytes(c);
}

/* The journal's buffers for `cap` positions, one allocation (kept for the state's life). */
static int mf_st_journal_new(mf_ref_state *s, int cap)
{
    const mf_config *c = s->ly->c;
    mf_ly_journal *jr = s->jr ? s->jr : calloc(1, sizeof *jr);
    if (!jr) return mf_error(-ENOMEM, "reference: out of memory for a state's journal");
    s->jr = jr;
    free(jr->mem);
    jr->mem = NULL;
    jr->n_src2 = 0;
    for (int L = 0; L < c->n_layers; L++)
        if (mf_config_is_kv_source(c, L) && c->compress_ratios[L] == 2) jr->src2[jr->n_src2++] = L;
    size_t D = (size_t)c->head_dim, ring = (size_t)c->n_layers * (size_t)cap * (size_t)mf_ly_ring_row_bytes(c);
    size_t pend = (size_t)jr->n_src2 * (size_t)(1 + cap) * 2 * D * sizeof(float);
    uint8_t *p = malloc(pend + ring + (size_t)jr->n_src2 * (size_t)cap + 1);
    if (!p) return mf_error(-ENOMEM, "reference: out of memory for a journal of %d positions", cap);
    jr->mem = p;
    jr->pend = (float *)p;
    jr->ring = p + pend;
    jr->pend_set = p + pend + ring;
    jr->cap = cap;
    jr->active = 0;
    return 0;
}

int mf_ref_state_mark(mf_ref_state *s, int n)
{
    const mf_config *c = s->ly->c;
    if (n < 1 || n > c->sliding_window)
        return mf_error(-EINVAL, "reference: a journal of %d positions (expected 1..sliding_window %d)", n,
                        c->sliding_window);
    if (!s->jr || s->jr->cap < n) {
        int cap = c->dspark_block_size + 1 > n ? c->dspark_block_size + 1 : n;
        if (cap > c->sliding_window) cap = c->sliding_window;
        int rc = mf_st_journal_new(s, cap);
        if (rc) return rc;
    }
    mf_ly_journal *jr = s->jr;
    int64_t D = c->head_dim, rb = mf_ly_ring_row_bytes(c);
    jr->pos0 = s->n_pos;
    jr->n = n;
    for (int L = 0; L < c->n_layers; L++)
        for (int i = 0; i < n; i++)
            memcpy(jr->ring + ((int64_t)L * jr->cap + i) * rb, mf_st_ring_slot(c, s, L, jr->pos0 + i), (size_t)rb);
    for (int k = 0; k < jr->n_src2; k++) {
        const mf_ly_cache *ca = &s->cache[jr->src2[k]];
        float *p = jr->pend + (int64_t)k * (1 + jr->cap) * 2 * D;
        memcpy(p, ca->pend_kv, (size_t)D * sizeof *p);
        memcpy(p + D, ca->pend_score, (size_t)D * sizeof *p);
        memset(jr->pend_set + (int64_t)k * jr->cap, 0, (size_t)jr->cap);
    }
    jr->active = 1;
    return 0;
}

int mf_ref_state_rollback(mf_ref_state *s, int keep)
{
    const mf_config *c = s->ly->c;
    mf_ly_journal *jr = s->jr;
    if (!jr || !jr->active)
        return mf_error(-EINVAL, "reference: rollback without a journal (mf_ref_state_mark before the verify)");
    if (keep < 0 || keep > jr->n || s->n_pos != jr->pos0 + jr->n)
        return mf_error(-EINVAL, "reference: rollback keeping %d of %d positions from %lld, the state at %lld "
                        "(expected the verify's %d positions run)", keep, jr->n, (long long)jr->pos0,
                        (long long)s->n_pos, jr->n);
    int64_t D = c->head_dim, rb = mf_ly_ring_row_bytes(c), end = jr->pos0 + keep;
    /* the open group as of the last kept position: the latest even position before end */
    int64_t e = end - 1 - ((end - 1) % 2 + 2) % 2;
    for (int k = 0; k < jr->n_src2; k++) {
        int64_t i = e - jr->pos0;   /* -1 or less: the group open before the verify */
        if (i >= 0 && !jr->pend_set[(int64_t)k * jr->cap + i])
            return mf_error(-EINVAL, "reference: layer %d's group at position %lld was not journaled (internal)",
                            jr->src2[k], (long long)e);
    }
    for (int L = 0; L < c->n_layers; L++)
        for (int i = keep; i < jr->n; i++)
            memcpy(mf_st_ring_slot(c, s, L, jr->pos0 + i), jr->ring + ((int64_t)L * jr->cap + i) * rb, (size_t)rb);
    for (int k = 0; k < jr->n_src2; k++) {
        mf_ly_cache *ca = &s->cache[jr->src2[k]];
        int64_t i = e - jr->pos0;
        const float *p = jr->pend + ((int64_t)k * (1 + jr->cap) + (i >= 0 ? 1 + i : 0)) * 2 * D;
        memcpy(ca->pend_kv, p, (size_t)D * sizeof *p);
        memcpy(ca->pend_score, p + D, (size_t)D * sizeof *p);
    }
    for (int L = 0; L < c->n_layers; L++)
        if (mf_config_is_kv_source(c, L) && c->compress_ratios[L] > 0) s->cache[L].n = end / c->compress_ratios[L];
    s->n_pos = end;
    jr->active = 0;
    /* prefix cache (issue 30): blocks published for positions >= end must be dropped here */
    return 0;
}
