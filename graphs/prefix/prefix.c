/* The prefix cache in memory (graphs/prefix/prefix.h): the tree of blocks, its budget and LRU over
 * leaves, the lookup, the restore into a reset state, and the capture of a running sequence's
 * blocks through the state's window tap (graphs/layers/layers.h). The disk tier is prefix_disk.c,
 * the identity of what is cached prefix_key.c. docs/prefix.md. */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/prefix/prefix_impl.h"
#include "sched/error.h"

/* ---- names ---------------------------------------------------------------------------------- */

static uint64_t mf_pfx_mix(uint64_t z)
{
    z ^= z >> 30;
    z *= UINT64_C(0xbf58476d1ce4e5b9);
    z ^= z >> 27;
    z *= UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

static void mf_pfx_hash_words(const uint8_t in[16], const uint64_t *w, int64_t n, uint64_t tail, uint8_t out[16])
{
    uint64_t a, b;
    memcpy(&a, in, 8);
    memcpy(&b, in + 8, 8);
    for (int64_t i = 0; i < n; i++) {
        a = mf_pfx_mix(a ^ (w[i] + UINT64_C(0x9e3779b97f4a7c15)));
        b = mf_pfx_mix(b + (w[i] ^ UINT64_C(0xc2b2ae3d27d4eb4f))) ^ a;
    }
    a = mf_pfx_mix(a ^ tail ^ (uint64_t)n);
    b = mf_pfx_mix(b ^ a ^ UINT64_C(0x165667b19e3779f9));
    memcpy(out, &a, 8);
    memcpy(out + 8, &b, 8);
}

void mf_pfx_hash(const uint8_t in[16], const int32_t *toks, int64_t n, uint8_t out[16])
{
    uint64_t w[64];
    uint8_t h[16];
    memcpy(h, in, 16);
    for (int64_t i = 0; i < n || i == 0; i += 64) {   /* 64 tokens a round */
        int64_t k = n - i < 64 ? n - i : 64;
        for (int64_t j = 0; j < k; j++) w[j] = (uint32_t)toks[i + j];
        mf_pfx_hash_words(h, w, k, UINT64_C(0x746f6b73), h);
    }
    memcpy(out, h, 16);
}

void mf_pfx_hash_bytes(const uint8_t in[16], const void *bytes, int64_t n, uint8_t out[16])
{
    const uint8_t *b = bytes;
    uint64_t w[64];
    uint8_t h[16];
    memcpy(h, in, 16);
    for (int64_t i = 0; i < n || i == 0; i += 512) {
        int64_t k = n - i < 512 ? n - i : 512;
        memset(w, 0, sizeof w);
        memcpy(w, b + i, (size_t)k);
        mf_pfx_hash_words(h, w, (k + 7) / 8, (uint64_t)k, h);
    }
    memcpy(out, h, 16);
}

/* ---- nodes and the tree ---------------------------------------------------------------------- */

void mf_pfx_stat(mf_prefix *p, int64_t *field, int64_t delta)
{
    pthread_mutex_lock(&p->mu);
    *field += delta;
    pthread_mutex_unlock(&p->mu);
}

mf_pfx_node *mf_pfx_node_new(mf_prefix *p, int len, int n_rows)
{
    mf_pfx_node *x = calloc(1, sizeof *x);
    if (!x) return NULL;
    x->len = len;
    x->n_rows = n_rows;
    x->toks = malloc(sizeof *x->toks * (size_t)(len ? len : 1));
    x->rows = n_rows ? malloc((size_t)(n_rows * p->rowset)) : NULL;
    x->page = calloc((size_t)(p->n_src ? p->n_src : 1), sizeof *x->page);
    if (!x->toks || (n_rows && !x->rows) || !x->page) {
        mf_pfx_node_free(p, x);
        return NULL;
    }
    x->bytes = (int64_t)sizeof *x + len * 4 + n_rows * p->rowset + p->n_src * (int64_t)sizeof *x->page;
    return x;
}

/* Frees a node that is not linked: its pages' holds given back (a linked node's keep too). */
void mf_pfx_node_free(mf_prefix *p, mf_pfx_node *x)
{
    if (!x) return;
    for (int i = 0; x->page && i < p->n_src; i++)
        if (x->page[i]) {
            if (x->linked && mf_ref_page_keep(x->page[i], -1) == 0) mf_pfx_stat(p, &p->bytes, -mf_ref_page_bytes(x->page[i]));
            mf_ref_page_drop(x->page[i]);
        }
    free(x->toks);
    free(x->rows);
    free(x->page);
    free(x->pend);
    free(x);
}

static void mf_pfx_lru_unlink(mf_prefix *p, mf_pfx_node *x)
{
    if (x->lru_prev) x->lru_prev->lru_next = x->lru_next;
    else p->lru_head = x->lru_next;
    if (x->lru_next) x->lru_next->lru_prev = x->lru_prev;
    else p->lru_tail = x->lru_prev;
    x->lru_prev = x->lru_next = NULL;
}

/* x becomes the most recently used */
static void mf_pfx_touch(mf_prefix *p, mf_pfx_node *x)
{
    if (x == &p->root) return;
    if (x->lru_prev || p->lru_head == x) mf_pfx_lru_unlink(p, x);
    x->lru_prev = p->lru_tail;
    if (p->lru_tail) p->lru_tail->lru_next = x;
    else p->lru_head = x;
    p->lru_tail = x;
}

static void mf_pfx_evict(mf_prefix *p, mf_pfx_node *x)
{
    mf_pfx_node **link = &x->parent->child;
    while (*link != x) link = &(*link)->sib;
    *link = x->sib;
    mf_pfx_lru_unlink(p, x);
    mf_pfx_stat(p, &p->bytes, -x->bytes);
    mf_pfx_node_free(p, x);
    pthread_mutex_lock(&p->mu);
    p->st.nodes--;
    p->st.evicted++;
    pthread_mutex_unlock(&p->mu);
}

/* The least recently used leaf nobody maps, or NULL */
static mf_pfx_node *mf_pfx_victim(mf_prefix *p)
{
    for (mf_pfx_node *x = p->lru_head; x; x = x->lru_next)
        if (!x->child && !x->n_lock) return x;
    return NULL;
}

/* Bytes linking x adds: its own and its pages no node keeps yet */
static int64_t mf_pfx_need(const mf_prefix *p, const mf_pfx_node *x)
{
    int64_t need = x->bytes;
    for (int i = 0; i < p->n_src; i++)
        if (x->page[i] && mf_ref_page_keep(x->page[i], 0) == 0) need += mf_ref_page_bytes(x->page[i]);
    return need;
}

int mf_pfx_link(mf_prefix *p, mf_pfx_node *parent, mf_pfx_node *x)
{
    while ((uint64_t)(p->bytes + mf_pfx_need(p, x)) > p->o.budget_bytes) {
        mf_pfx_node *v = mf_pfx_victim(p);
        if (!v || v == parent) return -ENOSPC;
        mf_pfx_evict(p, v);
    }
    int64_t add = x->bytes;
    for (int i = 0; i < p->n_src; i++)
        if (x->page[i] && mf_ref_page_keep(x->page[i], 1) == 1) add += mf_ref_page_bytes(x->page[i]);
    mf_pfx_stat(p, &p->bytes, add);   /* the stats' reader (any thread) takes the mutex */
    x->linked = 1;
    x->parent = parent;
    x->sib = parent->child;
    parent->child = x;
    mf_pfx_touch(p, x);
    pthread_mutex_lock(&p->mu);
    p->st.nodes++;
    p->st.inserted++;
    pthread_mutex_unlock(&p->mu);
    return 0;
}

/* The child of x with these len tokens, or NULL */
static mf_pfx_node *mf_pfx_child(mf_pfx_node *x, const int32_t *toks, int len)
{
    for (mf_pfx_node *c = x->child; c; c = c->sib)
        if (c->len == len && !memcmp(c->toks, toks, sizeof *toks * (size_t)len)) return c;
    return NULL;
}

/* ---- the cache ------------------------------------------------------------------------------- */

int mf_prefix_new(const mf_prefix_opts *o, mf_prefix **out)
{
    *out = NULL;
    if (!o->ref) return mf_error(-EINVAL, "prefix cache: no model (opts.ref)");
    int B = o->block_tokens ? o->block_tokens : MF_PREFIX_BLOCK;
    if (B < 1 || B > MF_LY_PAGE_POSITIONS || MF_LY_PAGE_POSITIONS % B)
        return mf_error(-EINVAL, "prefix cache: block of %d tokens (expected a power of two dividing the state's "
                        "page of %d positions)", B, MF_LY_PAGE_POSITIONS);
    if (!o->budget_bytes) return mf_error(-EINVAL, "prefix cache: a budget of 0 bytes (0 turns the cache off)");
    mf_prefix *p = calloc(1, sizeof *p);
    if (!p) return mf_error(-ENOMEM, "prefix cache: out of memory");
    p->o = *o;
    p->c = mf_ref_config(o->ref);
    p->B = B;
    p->W = p->c->sliding_window;
    for (int L = 0; L < p->c->n_layers; L++)
        if (mf_config_is_kv_source(p->c, L)) {
            p->src[p->n_src++] = L;
            p->n_r2 += p->c->compress_ratios[L] == 2;
        }
    p->rb = mf_ly_ring_row_bytes(p->c);
    p->rowset = p->rb * p->c->n_layers;
    uint32_t b32 = (uint32_t)B;
    mf_pfx_hash_bytes(o->key, &b32, sizeof b32, p->root.hkey);   /* the root's name: the key and the block */
    pthread_mutex_init(&p->mu, NULL);
    p->st.budget_bytes = (int64_t)o->budget_bytes;
    if (o->dir) {
        int rc = mf_pfx_disk_open(p, &p->disk);
        if (rc) {
            mf_prefix_free(p);
            return rc;
        }
    }
    *out = p;
    return 0;
}

void mf_prefix_free(mf_prefix *p)
{
    if (!p) return;
    mf_pfx_disk_close(p->disk);   /* its writes read nothing of the tree */
    while (p->lru_head) {         /* leaves first: every node's children were used no earlier */
        mf_pfx_node *x = mf_pfx_victim(p);
        if (!x)
            for (x = p->lru_head; x->child; x = x->child) {
            }
        x->n_lock = 0;
        mf_pfx_evict(p, x);
    }
    pthread_mutex_destroy(&p->mu);
    free(p);
}

int mf_prefix_block_tokens(const mf_prefix *p) { return p->B; }

double mf_prefix_bytes_per_token(const mf_config *c, int block_tokens)
{
    int B = block_tokens ? block_tokens : MF_PREFIX_BLOCK, W = c->sliding_window, n_src = 0;
    double bytes = 4;   /* the token id */
    for (int L = 0; L < c->n_layers; L++)
        if (mf_config_is_kv_source(c, L)) {
            bytes += (double)mf_ly_cache_entry_bytes(c) / c->compress_ratios[L];
            n_src++;
        }
    double rowset = (double)mf_ly_ring_row_bytes(c) * c->n_layers;
    bytes += rowset * (B < W ? B : W) / B;
    return bytes + (double)(sizeof(mf_pfx_node) + n_src * sizeof(uint8_t *)) / B;
}

void mf_prefix_get_stats(mf_prefix *p, mf_prefix_stats *out)
{
    pthread_mutex_lock(&p->mu);
    *out = p->st;
    out->bytes = p->bytes;
    pthread_mutex_unlock(&p->mu);
    if (p->disk) mf_pfx_disk_stats(p->disk, out);
}

/* ---- sequences ------------------------------------------------------------------------------- */

int mf_prefix_seq_new(mf_prefix *p, mf_prefix_seq **out)
{
    mf_prefix_seq *s = calloc(1, sizeof *s);
    if (!s) return mf_error(-ENOMEM, "prefix cache: out of memory");
    s->p = p;
    *out = s;
    return 0;
}

static void mf_pfx_unlock(mf_prefix_seq *s)
{
    if (s->lock) s->lock->n_lock--;
    s->lock = NULL;
}

static void mf_pfx_drop_pending(mf_prefix_seq *s)
{
    for (int i = 0; i < s->n_pend; i++) mf_pfx_node_free(s->p, s->pend[i]);
    s->n_pend = 0;
    s->parent = NULL;
}

void mf_prefix_seq_free(mf_prefix_seq *s)
{
    if (!s) return;
    mf_pfx_drop_pending(s);
    mf_pfx_unlock(s);
    free(s->pend);
    free(s->tap);
    free(s->path);
    free(s);
}

/* The root-to-x path of x (root excluded) in s->path; its length, or -ENOMEM */
static int mf_pfx_path(mf_prefix_seq *s, mf_pfx_node *x)
{
    int d = 0;
    for (mf_pfx_node *y = x; y->parent; y = y->parent) d++;
    if (d > s->cap_path) {
        mf_pfx_node **t = realloc(s->path, sizeof *t * (size_t)d);
        if (!t) return mf_error(-ENOMEM, "prefix cache: out of memory for a path of %d blocks", d);
        s->path = t;
        s->cap_path = d;
    }
    int i = d;
    for (mf_pfx_node *y = x; y->parent; y = y->parent) s->path[--i] = y;
    return d;
}

/* The child of x that prompt continues with, of at most `room` positions: a full block first (memory,
 * then disk), else the longest tail (memory, then disk). NULL when none. */
static mf_pfx_node *mf_pfx_next(mf_prefix *p, mf_pfx_node *x, const int32_t *prompt, int64_t room)
{
    const int32_t *t = prompt + x->end;
    if (room >= p->B) {
        mf_pfx_node *c = mf_pfx_child(x, t, p->B);
        if (!c && p->disk && (c = mf_pfx_disk_load(p, x, t, p->B)) && mf_pfx_link(p, x, c)) {
            mf_pfx_node_free(p, c);
            c = NULL;
        }
        if (c) return c;
    }
    mf_pfx_node *best = NULL;
    for (mf_pfx_node *c = x->child; c; c = c->sib)
        if (c->len < p->B && c->len <= room && (!best || c->len > best->len) &&
            !memcmp(c->toks, t, sizeof *t * (size_t)c->len))
            best = c;
    for (int len = (int)(room < p->B - 1 ? room : p->B - 1); p->disk && len > (best ? best->len : 0); len--) {
        uint8_t k[16];
        mf_pfx_hash(x->hkey, t, len, k);
        if (!mf_pfx_disk_has(p->disk, k)) continue;
        mf_pfx_node *c = mf_pfx_disk_load(p, x, t, len);
        if (c && !mf_pfx_link(p, x, c)) return c;
        mf_pfx_node_free(p, c);
    }
    return best;
}

int mf_prefix_match(mf_prefix *p, mf_prefix_seq *s, const int32_t *prompt, int n, int64_t *mapped_bytes)
{
    mf_prefix_seq_end(p, s, NULL, 0);
    if (mapped_bytes) *mapped_bytes = 0;
    mf_pfx_node *x = &p->root;
    for (mf_pfx_node *c; x->len == p->B || x == &p->root;) {   /* a tail ends the walk */
        if (!(c = mf_pfx_next(p, x, prompt, n - 1 - x->end))) break;
        x = c;
    }
    s->n_prompt = n;   /* counted when restored: a request that waits may look up many times */
    if (x == &p->root) return 0;
    /* x and its ancestors used now, the ancestors last: a chain's deep end is evicted before the
     * prefix it shares with others */
    for (mf_pfx_node *y = x; y != &p->root; y = y->parent) mf_pfx_touch(p, y);
    x->n_lock++;
    s->lock = x;
    if (mapped_bytes)
        for (int i = 0; i < p->n_src; i++)
            *mapped_bytes += x->end / MF_LY_PAGE_POSITIONS * mf_ly_cache_page_bytes(p->c, p->src[i]);
    return (int)x->end;
}

/* A block s fills, with room for all its rows; NULL when out of memory */
static mf_pfx_node *mf_pfx_pending(mf_prefix *p) { return mf_pfx_node_new(p, p->B, p->B); }

/* Room for n pending blocks in s. 0 or -ENOMEM. */
static int mf_pfx_pend_cap(mf_prefix_seq *s, int64_t n)
{
    if (n <= s->cap_pend) return 0;
    mf_pfx_node **t = realloc(s->pend, sizeof *t * (size_t)n);
    if (!t) return -ENOMEM;
    s->pend = t;
    s->cap_pend = (int)n;
    return 0;
}

int mf_prefix_restore(mf_prefix *p, mf_prefix_seq *s, mf_ref_state *st)
{
    mf_pfx_node *x = s->lock;
    s->parent = &p->root;
    s->blk0 = 0;
    pthread_mutex_lock(&p->mu);
    p->st.lookups++;
    p->st.lookup_tokens += s->n_prompt;
    p->st.hit_tokens += x ? x->end : 0;
    p->st.hits += x != NULL;
    pthread_mutex_unlock(&p->mu);
    if (!x) return 0;
    const mf_config *c = p->c;
    int64_t e = x->end, full = e / MF_LY_PAGE_POSITIONS;
    int d = mf_pfx_path(s, x), rc = d < 0 ? d : 0;
    uint8_t **pages = rc ? NULL : malloc(sizeof *pages * (size_t)(full + 1));
    if (!rc && !pages) rc = mf_error(-ENOMEM, "prefix cache: out of memory restoring %" PRId64 " positions", e);
    for (int i = 0; i < p->n_src && !rc; i++) {   /* the full pages mapped, the partial one copied */
        int L = p->src[i];
        int64_t k = 0;
        for (int j = 0; j < d; j++)
            if (s->path[j]->end % MF_LY_PAGE_POSITIONS == 0) pages[k++] = s->path[j]->page[i];
        if (e % MF_LY_PAGE_POSITIONS) pages[k++] = x->page[i];
        if (!(rc = mf_ref_state_map(st, L, pages, k)) && e % MF_LY_PAGE_POSITIONS) rc = mf_ref_state_unshare(st, L, full);
        st->cache[L].n = e / c->compress_ratios[L];
        if (!rc && e % 2 && c->compress_ratios[L] == 2) {   /* the open group of the odd end */
            int r2 = 0;
            for (int j = 0; j < i; j++) r2 += c->compress_ratios[p->src[j]] == 2;
            memcpy(st->cache[L].pend_kv, x->pend + (int64_t)r2 * 2 * c->head_dim, sizeof(float) * (size_t)c->head_dim);
            memcpy(st->cache[L].pend_score, x->pend + ((int64_t)r2 * 2 + 1) * c->head_dim,
                   sizeof(float) * (size_t)c->head_dim);
        }
    }
    free(pages);
    if (!rc) rc = mf_ref_state_reserve(st, e);   /* the token history (the pages are there) */
    if (rc) {
        mf_ref_state_reset(st);
        mf_prefix_seq_end(p, s, NULL, 0);
        return rc;
    }
    for (int j = 0; j < d; j++)
        memcpy(st->tokens + s->path[j]->end - s->path[j]->len, s->path[j]->toks, sizeof(int32_t) * (size_t)s->path[j]->len);
    /* the window: positions [e - W, e) from x and the ancestors that hold them */
    for (int j = d - 1; j >= 0 && s->path[j]->end > e - p->W; j--) {
        mf_pfx_node *y = s->path[j];
        int64_t r0 = y->end - y->n_rows, t0 = r0 > e - p->W ? r0 : e - p->W;
        for (int64_t t = t0; t < y->end; t++)
            for (int L = 0; L < c->n_layers; L++)
                mf_ly_ring_set_row(c, st, L, t, y->rows + (t - r0) * p->rowset + L * p->rb);
    }
    st->n_pos = e;
    if (x->len == p->B) {
        s->parent = x;
        s->blk0 = e;
    } else {   /* a tail: its rows begin the block the sequence fills, beside it */
        s->parent = x->parent;
        s->blk0 = e - x->len;
        mf_pfx_node *b = mf_pfx_pend_cap(s, 1) ? NULL : mf_pfx_pending(p);
        if (!b) {
            s->parent = NULL;   /* runs on, inserting nothing */
        } else {
            memcpy(b->rows + (x->len - x->n_rows) * p->rowset, x->rows, (size_t)(x->n_rows * p->rowset));
            s->pend[0] = b;
            s->n_pend = 1;
        }
    }
    return (int)e;
}

void mf_prefix_step_begin(mf_prefix *p, mf_prefix_seq *s, mf_ref_state *st, int n)
{
    if (!p || !s->parent || n < 1) return;
    int64_t pos0 = st->n_pos, nb = (pos0 + n - 1 - s->blk0) / p->B + 1;
    if (mf_pfx_pend_cap(s, nb)) goto off;
    while (s->n_pend < nb) {
        if (!(s->pend[s->n_pend] = mf_pfx_pending(p))) goto off;
        s->n_pend++;
    }
    if (n > s->cap_tap) {
        uint8_t **t = realloc(s->tap, sizeof *t * (size_t)n);
        if (!t) goto off;
        s->tap = t;
        s->cap_tap = n;
    }
    for (int i = 0; i < n; i++) {
        int64_t o = pos0 + i - s->blk0;
        s->tap[i] = s->pend[o / p->B]->rows + o % p->B * p->rowset;
    }
    st->tap = s->tap;
    st->tap_pos0 = pos0;
    st->tap_n = n;
    return;
off:   /* out of memory: the sequence runs on without inserting */
    mf_pfx_drop_pending(s);
}

/* Sets x's tokens, pages, name (under parent) and open group from st at x's end */
static void mf_pfx_fill(mf_prefix *p, mf_pfx_node *x, const mf_pfx_node *parent, const mf_ref_state *st)
{
    const mf_config *c = p->c;
    memcpy(x->toks, st->tokens + x->end - x->len, sizeof(int32_t) * (size_t)x->len);
    for (int i = 0; i < p->n_src; i++) {
        x->page[i] = st->cache[p->src[i]].page[(x->end - 1) / MF_LY_PAGE_POSITIONS];
        mf_ref_page_hold(x->page[i]);
    }
    mf_pfx_hash(parent->hkey, x->toks, x->len, x->hkey);
    if (!(x->end % 2) || !p->n_r2 || !(x->pend = malloc(sizeof(float) * 2 * (size_t)(p->n_r2 * c->head_dim)))) return;
    x->bytes += (int64_t)sizeof(float) * 2 * p->n_r2 * c->head_dim;
    for (int i = 0, r2 = 0; i < p->n_src; i++)
        if (c->compress_ratios[p->src[i]] == 2) {
            memcpy(x->pend + (int64_t)r2 * 2 * c->head_dim, st->cache[p->src[i]].pend_kv, sizeof(float) * (size_t)c->head_dim);
            memcpy(x->pend + ((int64_t)r2++ * 2 + 1) * c->head_dim, st->cache[p->src[i]].pend_score,
                   sizeof(float) * (size_t)c->head_dim);
        }
}

/* Links x (filled) under s->parent, or finds its twin there; the sequence then holds that node.
 * A node the budget cannot hold ends the sequence's inserting. */
static void mf_pfx_insert(mf_prefix *p, mf_prefix_seq *s, mf_pfx_node *x, int hold)
{
    mf_pfx_node *twin = mf_pfx_child(s->parent, x->toks, x->len);
    if (twin) {
        mf_pfx_node_free(p, x);
        mf_pfx_touch(p, twin);
        x = twin;
    } else if (mf_pfx_link(p, s->parent, x)) {
        mf_pfx_node_free(p, x);
        mf_pfx_stat(p, &p->st.refused, 1);
        mf_pfx_drop_pending(s);
        return;
    } else if (p->disk) {
        mf_pfx_disk_write(p, x);
    }
    if (!hold) return;
    x->n_lock++;
    mf_pfx_unlock(s);
    s->lock = x;
    s->parent = x;
}

/* The sequence's last partial block [blk0, st->n_pos) as a tail under s->parent */
static void mf_pfx_tail(mf_prefix *p, mf_prefix_seq *s, const mf_ref_state *st)
{
    int len = (int)(st->n_pos - s->blk0);
    if (!s->parent || len < 1 || len >= p->B || s->n_pend < 1) return;
    if (mf_pfx_child(s->parent, st->tokens + s->blk0, len)) return;   /* there already */
    int rows = len < p->W ? len : p->W;
    mf_pfx_node *x = mf_pfx_node_new(p, len, rows);
    if (!x) return;
    x->end = st->n_pos;
    memcpy(x->rows, s->pend[0]->rows + (len - rows) * p->rowset, (size_t)(rows * p->rowset));
    mf_pfx_fill(p, x, s->parent, st);
    mf_pfx_insert(p, s, x, 0);
}

void mf_prefix_step_end(mf_prefix *p, mf_prefix_seq *s, mf_ref_state *st, int ok, int tail)
{
    if (!p) return;
    st->tap = NULL;
    st->tap_n = 0;
    if (!s->parent) return;
    if (!ok) {
        mf_pfx_drop_pending(s);
        return;
    }
    while (s->parent && s->n_pend > 0 && s->blk0 + p->B <= st->n_pos) {   /* completed blocks */
        mf_pfx_node *x = s->pend[0];
        memmove(s->pend, s->pend + 1, sizeof *s->pend * (size_t)--s->n_pend);
        x->end = s->blk0 + p->B;
        s->blk0 += p->B;
        if (p->B > p->W) {   /* only the last W rows are ever read */
            memmove(x->rows, x->rows + (p->B - p->W) * p->rowset, (size_t)(p->W * p->rowset));
            uint8_t *r = realloc(x->rows, (size_t)(p->W * p->rowset));
            if (r) x->rows = r;
            x->n_rows = p->W;
            x->bytes -= (p->B - p->W) * p->rowset;
        }
        mf_pfx_fill(p, x, s->parent, st);
        mf_pfx_insert(p, s, x, 1);
    }
    if (tail) mf_pfx_tail(p, s, st);
}

void mf_prefix_seq_end(mf_prefix *p, mf_prefix_seq *s, mf_ref_state *st, int ok)
{
    if (!p) return;
    if (st && ok) mf_pfx_tail(p, s, st);
    if (st) {
        st->tap = NULL;
        st->tap_n = 0;
    }
    mf_pfx_drop_pending(s);
    mf_pfx_unlock(s);
}
