/* The matcher of host/grammar.h: a stack of frames kept as a persistent list (a byte's step makes
 * new nodes for the frames it changes and shares the rest), so a depth-first walk of the
 * vocabulary's byte trie advances each prefix once and undoes by moving an arena's top back. The
 * committed state lives in its own array; masks are cached by state (the last few). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "host/grammar_impl.h"
#include "sched/error.h"

#define MF_NONE 0xffffffffu
#define MF_GRAM_CACHE 16   /* masks kept per matcher */

struct mf_gram_vocab {
    int64_t n_vocab;
    int32_t eos;
    unsigned char *tbytes;   /* every token's bytes */
    uint32_t *toff, *tlen;   /* per token (tlen MF_NONE: never matches) */
    uint32_t *tok_next;      /* per token: the next token of the same bytes */
    /* the trie: per node its byte, first child, next sibling (children in byte order), first token */
    uint8_t *byte;
    uint32_t *child, *sib, *tok;
    uint32_t n_nodes, max_len;
};

typedef struct mf_pnode {
    const struct mf_pnode *up;
    mf_gframe f;
    int depth;
} mf_pnode;

typedef struct mf_gcache {
    uint64_t hash;
    int depth;           /* -1: empty; else the frames of the state (MF_GRAM_MAX_STACK + 1: complete) */
    uint64_t used;
    int64_t n_allowed;
} mf_gcache;

struct mf_gram_match {
    const mf_gram_vocab *v;
    const mf_gram *g;
    mf_pnode base[MF_GRAM_MAX_STACK];   /* the committed state: base[0..depth) */
    const mf_pnode *top;                /* its top, or &done */
    mf_pnode done;                      /* the complete grammar */
    mf_pnode *arena;                    /* a walk's new nodes */
    size_t n_arena, cap_arena;
    const mf_pnode **st;                /* the walk: per trie depth the state, the next child, the arena mark */
    uint32_t *next;
    size_t *mark;
    mf_gcache cache[MF_GRAM_CACHE];
    mf_gframe *cframes;                 /* MF_GRAM_CACHE x MF_GRAM_MAX_STACK */
    uint32_t *cbits;                    /* MF_GRAM_CACHE masks */
    uint64_t tick;
    int64_t n_computed, n_cached;
};

/* ---- the vocabulary ----------------------------------------------------------------------------- */

typedef struct mf_vsort {
    const unsigned char *s;
    uint32_t n, id;
} mf_vsort;

static int mf_vsort_cmp(const void *pa, const void *pb)
{
    const mf_vsort *a = pa, *b = pb;
    int c = memcmp(a->s, b->s, a->n < b->n ? a->n : b->n);
    if (c) return c;
    return a->n != b->n ? (a->n > b->n) - (a->n < b->n) : (a->id > b->id) - (a->id < b->id);
}

/* The trie of the tokens with bytes, built from them sorted (each new node is its parent's last child). */
static int mf_vocab_trie(mf_gram_vocab *v)
{
    size_t n = 0, total = 0;
    for (int64_t i = 0; i < v->n_vocab; i++)
        if (v->tlen[i] != MF_NONE) n++, total += v->tlen[i];
    mf_vsort *t = malloc(sizeof *t * (n ? n : 1));
    size_t cap = total + 1;
    v->byte = malloc(cap);
    v->child = malloc(sizeof *v->child * cap);
    v->sib = malloc(sizeof *v->sib * cap);
    v->tok = malloc(sizeof *v->tok * cap);
    uint32_t *last = malloc(sizeof *last * cap), *path = malloc(sizeof *path * ((size_t)v->max_len + 1));
    int rc = t && v->byte && v->child && v->sib && v->tok && last && path ? 0 : mf_error(-ENOMEM, "grammar: out of memory for the vocabulary's trie");
    if (!rc) {
        n = 0;
        for (int64_t i = 0; i < v->n_vocab; i++)
            if (v->tlen[i] != MF_NONE) t[n++] = (mf_vsort){v->tbytes + v->toff[i], v->tlen[i], (uint32_t)i};
        qsort(t, n, sizeof *t, mf_vsort_cmp);
        v->n_nodes = 1;
        v->child[0] = v->sib[0] = v->tok[0] = last[0] = MF_NONE;
        path[0] = 0;
        uint32_t plen = 0;
        const mf_vsort *prev = NULL;
        for (size_t k = 0; k < n; k++) {
            uint32_t l = 0;
            while (prev && l < prev->n && l < t[k].n && prev->s[l] == t[k].s[l]) l++;
            if (l > plen) l = plen;
            for (uint32_t d = l; d < t[k].n; d++) {
                uint32_t x = v->n_nodes++, p = path[d];
                v->byte[x] = t[k].s[d];
                v->child[x] = v->sib[x] = v->tok[x] = last[x] = MF_NONE;
                if (last[p] == MF_NONE) v->child[p] = x;
                else v->sib[last[p]] = x;
                last[p] = x;
                path[d + 1] = x;
            }
            plen = t[k].n;
            uint32_t at = path[t[k].n];
            v->tok_next[t[k].id] = v->tok[at];
            v->tok[at] = t[k].id;
            prev = &t[k];
        }
    }
    free(t);
    free(last);
    free(path);
    return rc;
}

static int mf_vocab_alloc(int64_t n_vocab, int32_t eos, size_t bytes, mf_gram_vocab **out)
{
    *out = NULL;
    if (n_vocab < 1 || n_vocab > INT32_MAX) return mf_error(-EINVAL, "grammar: a vocabulary of %lld tokens", (long long)n_vocab);
    mf_gram_vocab *v = calloc(1, sizeof *v);
    if (!v) return mf_error(-ENOMEM, "grammar: out of memory");
    v->n_vocab = n_vocab;
    v->eos = eos;
    v->tbytes = malloc(bytes ? bytes : 1);
    v->toff = malloc(sizeof *v->toff * (size_t)n_vocab);
    v->tlen = malloc(sizeof *v->tlen * (size_t)n_vocab);
    v->tok_next = malloc(sizeof *v->tok_next * (size_t)n_vocab);
    if (!v->tbytes || !v->toff || !v->tlen || !v->tok_next) {
        mf_gram_vocab_free(v);
        return mf_error(-ENOMEM, "grammar: out of memory for a vocabulary of %lld tokens", (long long)n_vocab);
    }
    *out = v;
    return 0;
}

int mf_gram_vocab_from(const char *const *toks, const size_t *lens, int64_t n_vocab, int32_t eos_id,
                       mf_gram_vocab **out)
{
    size_t bytes = 0;
    for (int64_t i = 0; i < n_vocab; i++) bytes += toks[i] ? lens[i] : 0;
    mf_gram_vocab *v;
    int rc = mf_vocab_alloc(n_vocab, eos_id, bytes, &v);
    if (rc) return rc;
    size_t o = 0;
    for (int64_t i = 0; i < n_vocab; i++) {
        int none = !toks[i] || !lens[i] || lens[i] >= MF_NONE || i == eos_id;
        v->toff[i] = (uint32_t)o;
        v->tlen[i] = none ? MF_NONE : (uint32_t)lens[i];
        if (!none) {
            memcpy(v->tbytes + o, toks[i], lens[i]);
            o += lens[i];
            if (lens[i] > v->max_len) v->max_len = (uint32_t)lens[i];
        }
    }
    if ((rc = mf_vocab_trie(v))) {
        mf_gram_vocab_free(v);
        return rc;
    }
    *out = v;
    return 0;
}

void mf_gram_vocab_free(mf_gram_vocab *v)
{
    if (!v) return;
    free(v->tbytes);
    free(v->toff);
    free(v->tlen);
    free(v->tok_next);
    free(v->byte);
    free(v->child);
    free(v->sib);
    free(v->tok);
    free(v);
}

int64_t mf_gram_vocab_size(const mf_gram_vocab *v) { return v->n_vocab; }

/* ---- stepping ----------------------------------------------------------------------------------- */

static const mf_pnode *mf_mk(mf_gram_match *m, const mf_pnode *up, const mf_gframe *f, int depth)
{
    if (m->n_arena == m->cap_arena) return NULL;   /* sized for the longest token: not reached */
    mf_pnode *p = &m->arena[m->n_arena++];
    p->up = up;
    p->f = *f;
    p->depth = depth;
    return p;
}

/* The frames above `up` take a completed child's result: the first that is not complete then is
 * the new top; none: the grammar is complete (&m->done). */
static const mf_pnode *mf_complete(mf_gram_match *m, const mf_pnode *up, uint32_t result)
{
    for (; up; up = up->up, result = 0) {
        mf_gframe f = up->f;
        if (!mf_gram_child_done(m->g, &f, result)) return mf_mk(m, up->up, &f, up->depth);
    }
    return &m->done;
}

/* The state after byte c from `top`, or NULL when c cannot come. New nodes go to the arena. */
static const mf_pnode *mf_adv(mf_gram_match *m, const mf_pnode *top, unsigned char c)
{
    const mf_pnode *cur = top;
    for (;;) {
        if (!cur || cur == &m->done) return NULL;
        mf_gframe f = cur->f, child;
        uint32_t res;
        switch (mf_gram_feed(m->g, &f, c, cur->depth, &child, &res)) {
        case G_STAY: return mf_mk(m, cur->up, &f, cur->depth);
        case G_PUSH: {
            if (cur->depth + 1 >= MF_GRAM_MAX_STACK) return NULL;
            const mf_pnode *p = mf_mk(m, cur->up, &f, cur->depth);
            cur = p ? mf_mk(m, p, &child, cur->depth + 1) : NULL;
            continue;
        }
        case G_DONE: return mf_complete(m, cur->up, res);
        case G_DONE_REFEED: cur = mf_complete(m, cur->up, res); continue;
        default: return NULL;
        }
    }
}

static const mf_pnode *mf_adv_bytes(mf_gram_match *m, const mf_pnode *s, const unsigned char *b, size_t n)
{
    for (size_t i = 0; i < n && s; i++) s = mf_adv(m, s, b[i]);
    return s;
}

static int mf_accepting(const mf_gram_match *m, const mf_pnode *top)
{
    if (top == &m->done) return 1;
    if (!mf_gram_can_end(m->g, &top->f)) return 0;
    for (const mf_pnode *up = top->up; up; up = up->up) {
        mf_gframe f = up->f;
        if (!mf_gram_child_done(m->g, &f, 0)) return 0;
    }
    return 1;
}

/* Makes s (in the arena) the committed state. */
static void mf_commit(mf_gram_match *m, const mf_pnode *s)
{
    if (s == &m->done) {
        m->top = s;
        return;
    }
    mf_gframe fr[MF_GRAM_MAX_STACK];
    int d = 0;
    for (const mf_pnode *p = s; p; p = p->up) fr[d++] = p->f;
    for (int i = 0; i < d; i++) {
        m->base[i].f = fr[d - 1 - i];
        m->base[i].up = i ? &m->base[i - 1] : NULL;
        m->base[i].depth = i;
    }
    m->top = &m->base[d - 1];
}

/* ---- the matcher --------------------------------------------------------------------------------- */

int mf_gram_match_new(const mf_gram_vocab *v, mf_gram_match **out)
{
    *out = NULL;
    if (!v) return mf_error(-EINVAL, "grammar: a matcher needs a vocabulary");
    mf_gram_match *m = calloc(1, sizeof *m);
    if (!m) return mf_error(-ENOMEM, "grammar: out of memory");
    m->v = v;
    m->cap_arena = ((size_t)v->max_len + 2) * (MF_GRAM_MAX_STACK + 4);
    m->arena = malloc(sizeof *m->arena * m->cap_arena);
    m->st = malloc(sizeof *m->st * ((size_t)v->max_len + 2));
    m->next = malloc(sizeof *m->next * ((size_t)v->max_len + 2));
    m->mark = malloc(sizeof *m->mark * ((size_t)v->max_len + 2));
    m->cframes = malloc(sizeof *m->cframes * MF_GRAM_CACHE * MF_GRAM_MAX_STACK);
    m->cbits = malloc(sizeof *m->cbits * MF_GRAM_CACHE * (size_t)((v->n_vocab + 31) / 32));
    if (!m->arena || !m->st || !m->next || !m->mark || !m->cframes || !m->cbits) {
        mf_gram_match_free(m);
        return mf_error(-ENOMEM, "grammar: out of memory for a matcher");
    }
    for (int i = 0; i < MF_GRAM_CACHE; i++) m->cache[i].depth = -1;
    *out = m;
    return 0;
}

void mf_gram_match_free(mf_gram_match *m)
{
    if (!m) return;
    free(m->arena);
    free(m->st);
    free(m->next);
    free(m->mark);
    free(m->cframes);
    free(m->cbits);
    free(m);
}

int mf_gram_match_start(mf_gram_match *m, const mf_gram *g)
{
    if (!g) return mf_error(-EINVAL, "grammar: no grammar to match");
    m->g = g;
    m->base[0] = (mf_pnode){.up = NULL, .f = mf_gram_frame(g, g->root), .depth = 0};
    m->top = &m->base[0];
    for (int i = 0; i < MF_GRAM_CACHE; i++) m->cache[i].depth = -1;
    return 0;
}

int mf_gram_match_done(const mf_gram_match *m) { return m->top == &m->done; }
int mf_gram_match_accepting(const mf_gram_match *m) { return mf_accepting(m, m->top); }

int mf_gram_match_allows(mf_gram_match *m, int32_t t)
{
    const mf_gram_vocab *v = m->v;
    if (t < 0 || t >= v->n_vocab) return 0;
    if (t == v->eos) return mf_accepting(m, m->top);
    if (v->tlen[t] == MF_NONE) return 0;
    m->n_arena = 0;
    return mf_adv_bytes(m, m->top, v->tbytes + v->toff[t], v->tlen[t]) != NULL;
}

int mf_gram_match_accept(mf_gram_match *m, int32_t t)
{
    const mf_gram_vocab *v = m->v;
    if (t >= 0 && t < v->n_vocab && t == v->eos) {
        if (!mf_accepting(m, m->top)) return mf_error(-EINVAL, "grammar: EOS before the output is complete");
        m->top = &m->done;
        return 0;
    }
    if (t < 0 || t >= v->n_vocab || v->tlen[t] == MF_NONE)
        return mf_error(-EINVAL, "grammar: token %d has no bytes the grammar could take", t);
    m->n_arena = 0;
    const mf_pnode *s = mf_adv_bytes(m, m->top, v->tbytes + v->toff[t], v->tlen[t]);
    if (!s) return mf_error(-EINVAL, "grammar: token %d cannot come here", t);
    mf_commit(m, s);
    return 0;
}

int mf_gram_match_bytes(mf_gram_match *m, const char *s, size_t n)
{
    const mf_pnode *p = m->top;
    for (size_t i = 0; i < n && p; i++) {   /* bytes one at a time: the arena holds a token's worth */
        m->n_arena = 0;
        p = mf_adv(m, p, (unsigned char)s[i]);
        if (p) mf_commit(m, p), p = m->top;
    }
    return p ? 0 : mf_error(-EINVAL, "grammar: the bytes do not fit the grammar");
}

/* The cache slot of the committed state (hit: *hit 1), or the least recently used one. */
static int mf_cache_slot(mf_gram_match *m, uint64_t *hash, int *hit)
{
    int d = m->top == &m->done ? MF_GRAM_MAX_STACK + 1 : m->top->depth + 1;
    uint64_t h = 1469598103934665603ull ^ (uint64_t)d;
    for (int i = 0; d <= MF_GRAM_MAX_STACK && i < d; i++) {
        const unsigned char *p = (const unsigned char *)&m->base[i].f;
        for (size_t k = 0; k < sizeof(mf_gframe); k++) h = (h ^ p[k]) * 1099511628211ull;
    }
    *hash = h;
    int lru = 0;
    for (int i = 0; i < MF_GRAM_CACHE; i++) {
        mf_gcache *c = &m->cache[i];
        if (c->depth == d && c->hash == h) {
            int same = 1;
            for (int k = 0; d <= MF_GRAM_MAX_STACK && k < d && same; k++)
                same = !memcmp(&m->cframes[(size_t)i * MF_GRAM_MAX_STACK + k], &m->base[k].f, sizeof(mf_gframe));
            if (same) {
                *hit = 1;
                return i;
            }
        }
        if (c->depth < 0 || c->used < m->cache[lru].used) lru = i;
    }
    *hit = 0;
    return lru;
}

/* Every token whose bytes take the committed state somewhere (a depth-first walk of the trie). */
static int64_t mf_walk(mf_gram_match *m, uint32_t *bits)
{
    const mf_gram_vocab *v = m->v;
    int64_t n = 0;
    m->n_arena = 0;
    int d = 0;
    m->st[0] = m->top;
    m->next[0] = v->child[0];
    m->mark[0] = 0;
    while (d >= 0) {
        uint32_t c = m->next[d];
        if (c == MF_NONE) {
            d--;
            continue;
        }
        m->next[d] = v->sib[c];
        m->n_arena = m->mark[d];
        const mf_pnode *s = mf_adv(m, m->st[d], v->byte[c]);
        if (!s) continue;
        for (uint32_t t = v->tok[c]; t != MF_NONE; t = v->tok_next[t]) {
            bits[t >> 5] |= 1u << (t & 31);
            n++;
        }
        if (v->child[c] != MF_NONE) {
            d++;
            m->st[d] = s;
            m->next[d] = v->child[c];
            m->mark[d] = m->n_arena;
        }
    }
    return n;
}

int64_t mf_gram_match_mask(mf_gram_match *m, uint32_t *bits)
{
    const mf_gram_vocab *v = m->v;
    size_t words = (size_t)((v->n_vocab + 31) / 32);
    uint64_t h;
    int hit, slot = mf_cache_slot(m, &h, &hit);
    mf_gcache *c = &m->cache[slot];
    c->used = ++m->tick;
    if (hit) {
        memcpy(bits, m->cbits + (size_t)slot * words, words * sizeof *bits);
        m->n_cached++;
        return c->n_allowed;
    }
    memset(bits, 0, words * sizeof *bits);
    int64_t n = 0;
    if (m->top != &m->done) n = mf_walk(m, bits);
    if (v->eos >= 0 && v->eos < v->n_vocab && mf_accepting(m, m->top)) {
        bits[v->eos >> 5] |= 1u << (v->eos & 31);
        n++;
    }
    int d = m->top == &m->done ? MF_GRAM_MAX_STACK + 1 : m->top->depth + 1;
    c->hash = h;
    c->depth = d;
    c->n_allowed = n;
    for (int k = 0; d <= MF_GRAM_MAX_STACK && k < d; k++) m->cframes[(size_t)slot * MF_GRAM_MAX_STACK + k] = m->base[k].f;
    memcpy(m->cbits + (size_t)slot * words, bits, words * sizeof *bits);
    m->n_computed++;
    return n;
}

void mf_gram_match_counts(const mf_gram_match *m, int64_t *computed, int64_t *cached)
{
    *computed = m->n_computed;
    *cached = m->n_cached;
}
