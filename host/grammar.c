/* Grammars for constrained decoding (host/grammar.h): the builder (nodes into growing pools, the
 * first error kept), finishing (first-byte sets, disjointness of choices and loops), and one byte's
 * step of a frame, the only place that knows what each kind of node accepts. The matcher
 * (grammar_match.c) keeps the frames on a stack; the schema compiler is grammar_schema.c. */
#include "host/grammar_impl.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "sched/error.h"

struct mf_gram_b {
    mf_gnode *nodes;
    int n_nodes, cap_nodes;
    unsigned char *bytes;
    size_t n_bytes, cap_bytes;
    uint32_t *kids;
    size_t n_kids, cap_kids;
    mf_gkey *keys;
    size_t n_keys, cap_keys;
    mf_gprop *props;
    size_t n_props, cap_props;
    uint32_t *fail;
    size_t n_fail, cap_fail;
    int any, any_obj;     /* mf_gram_json_any / _object, built once (-1: not yet) */
    int err;              /* the first failure (0: none) */
};

/* Grows *p (elements of size sz) to hold n more than *len; 0 or -ENOMEM / -E2BIG. */
static int mf_gb_grow(void **p, size_t *cap, size_t len, size_t more, size_t sz, size_t limit)
{
    if (len + more > limit) return mf_error(-E2BIG, "grammar: larger than its limit of %zu entries", limit);
    if (len + more <= *cap) return 0;
    size_t c = (len + more) * 2 + 16;
    void *q = realloc(*p, c * sz);
    if (!q) return mf_error(-ENOMEM, "grammar: out of memory");
    *p = q;
    *cap = c;
    return 0;
}

static int mf_gb_fail(mf_gram_b *b, int rc)
{
    if (!b->err) b->err = rc;
    return rc;
}

int mf_gram_b_new(mf_gram_b **out)
{
    *out = calloc(1, sizeof **out);
    if (!*out) return mf_error(-ENOMEM, "grammar: out of memory");
    (*out)->any = (*out)->any_obj = -1;
    return 0;
}

void mf_gram_b_free(mf_gram_b *b)
{
    if (!b) return;
    free(b->nodes);
    free(b->bytes);
    free(b->kids);
    free(b->keys);
    free(b->props);
    free(b->fail);
    free(b);
}

static int mf_gb_node(mf_gram_b *b, mf_gnode n)
{
    if (b->n_nodes >= MF_GRAM_MAX_NODES)
        return mf_gb_fail(b, mf_error(-E2BIG, "grammar: more than %d nodes", MF_GRAM_MAX_NODES));
    size_t cap = (size_t)b->cap_nodes;
    int rc = mf_gb_grow((void **)&b->nodes, &cap, (size_t)b->n_nodes, 1, sizeof n, MF_GRAM_MAX_NODES);
    if (rc) return mf_gb_fail(b, rc);
    b->cap_nodes = (int)cap;
    b->nodes[b->n_nodes] = n;
    return b->n_nodes++;
}

/* Appends s[0..n) to the byte pool; its offset or a negative code. */
static int64_t mf_gb_bytes(mf_gram_b *b, const char *s, size_t n)
{
    int rc = mf_gb_grow((void **)&b->bytes, &b->cap_bytes, b->n_bytes, n, 1, MF_GRAM_MAX_BYTES);
    if (rc) return mf_gb_fail(b, rc);
    memcpy(b->bytes + b->n_bytes, s, n);
    b->n_bytes += n;
    return (int64_t)(b->n_bytes - n);
}

static int mf_gb_kids(mf_gram_b *b, const int *ids, int n, uint32_t *off)
{
    for (int i = 0; i < n; i++)
        if (ids[i] < 0) return ids[i];
    int rc = mf_gb_grow((void **)&b->kids, &b->cap_kids, b->n_kids, (size_t)n, sizeof *b->kids, (size_t)1 << 24);
    if (rc) return mf_gb_fail(b, rc);
    *off = (uint32_t)b->n_kids;
    for (int i = 0; i < n; i++) b->kids[b->n_kids++] = (uint32_t)ids[i];
    return 0;
}

int mf_gram_lit(mf_gram_b *b, const char *s, size_t n)
{
    if (b->err) return b->err;
    if (n == 0) return mf_gb_fail(b, mf_error(-EINVAL, "grammar: an empty literal"));
    int64_t off = mf_gb_bytes(b, s, n);
    if (off < 0) return (int)off;
    return mf_gb_node(b, (mf_gnode){.kind = G_LIT, .a = (uint32_t)off, .b = (uint32_t)n});
}

int mf_gram_seq(mf_gram_b *b, const int *ids, int n)
{
    if (b->err) return b->err;
    if (n < 1) return mf_gb_fail(b, mf_error(-EINVAL, "grammar: an empty sequence"));
    if (n == 1) return ids[0];
    uint32_t off;
    int rc = mf_gb_kids(b, ids, n, &off);
    return rc ? rc : mf_gb_node(b, (mf_gnode){.kind = G_SEQ, .a = off, .b = (uint32_t)n});
}

int mf_gram_choice(mf_gram_b *b, const int *ids, int n)
{
    if (b->err) return b->err;
    if (n < 1) return mf_gb_fail(b, mf_error(-EINVAL, "grammar: a choice of nothing"));
    if (n == 1) return ids[0];
    uint32_t off;
    int rc = mf_gb_kids(b, ids, n, &off);
    return rc ? rc : mf_gb_node(b, (mf_gnode){.kind = G_CHOICE, .a = off, .b = (uint32_t)n});
}

typedef struct mf_gsort {
    const unsigned char *s;
    size_t n;
    int cont, idx;
} mf_gsort;

static int mf_gsort_cmp(const void *pa, const void *pb)
{
    const mf_gsort *x = pa, *y = pb;
    int c = memcmp(x->s, y->s, x->n < y->n ? x->n : y->n);
    return c ? c : (x->n > y->n) - (x->n < y->n);
}

int mf_gram_switch(mf_gram_b *b, const char *const *keys, const size_t *lens, const int *conts, int n)
{
    if (b->err) return b->err;
    if (n < 1 || n > MF_GRAM_MAX_KEYS)
        return mf_gb_fail(b, mf_error(n < 1 ? -EINVAL : -E2BIG, "grammar: a switch of %d keys (1..%d)", n, MF_GRAM_MAX_KEYS));
    mf_gsort *t = malloc(sizeof *t * (size_t)n);
    if (!t) return mf_gb_fail(b, mf_error(-ENOMEM, "grammar: out of memory"));
    int has_cont = 0, rc = 0;
    for (int i = 0; i < n; i++) {
        t[i] = (mf_gsort){(const unsigned char *)keys[i], lens[i], conts ? conts[i] : -1, i};
        if (conts && conts[i] < -1) rc = conts[i];
        has_cont |= t[i].cont >= 0;
        if (!lens[i]) rc = mf_error(-EINVAL, "grammar: an empty switch key");
    }
    if (!rc) qsort(t, (size_t)n, sizeof *t, mf_gsort_cmp);
    for (int i = 1; i < n && !rc; i++) {
        int prefix = t[i - 1].n <= t[i].n && !memcmp(t[i - 1].s, t[i].s, t[i - 1].n);
        if (prefix && t[i - 1].n == t[i].n) rc = mf_error(-EINVAL, "grammar: a switch key given twice ('%.*s')",
                                                            (int)t[i].n, (const char *)t[i].s);
        else if (prefix && has_cont) rc = mf_error(-EINVAL, "grammar: switch key '%.*s' is a prefix of another",
                                                    (int)t[i - 1].n, (const char *)t[i - 1].s);
    }
    uint32_t koff = (uint32_t)b->n_keys, coff = G_NONE;
    if (!rc) rc = mf_gb_grow((void **)&b->keys, &b->cap_keys, b->n_keys, (size_t)n, sizeof *b->keys, (size_t)1 << 24);
    for (int i = 0; i < n && !rc; i++) {
        int64_t off = mf_gb_bytes(b, (const char *)t[i].s, t[i].n);
        if (off < 0) rc = (int)off;
        else b->keys[b->n_keys++] = (mf_gkey){(uint32_t)off, (uint32_t)t[i].n};
    }
    if (!rc && has_cont) {
        int *c = malloc(sizeof *c * (size_t)n);
        if (!c) rc = mf_error(-ENOMEM, "grammar: out of memory");
        for (int i = 0; i < n && !rc; i++) c[i] = t[i].cont < 0 ? (int)G_NONE : t[i].cont;
        if (!rc) {   /* G_NONE passes as a kid id: mf_gb_kids only refuses negative ints */
            rc = mf_gb_grow((void **)&b->kids, &b->cap_kids, b->n_kids, (size_t)n, sizeof *b->kids, (size_t)1 << 24);
            coff = (uint32_t)b->n_kids;
            for (int i = 0; i < n && !rc; i++) b->kids[b->n_kids++] = (uint32_t)c[i];
        }
        free(c);
    }
    free(t);
    if (rc) return mf_gb_fail(b, rc);
    return mf_gb_node(b, (mf_gnode){.kind = G_SWITCH, .a = koff, .b = (uint32_t)n, .c = coff});
}

int mf_gram_loop(mf_gram_b *b, int body, int exit)
{
    if (b->err) return b->err;
    if (body < 0) return body;
    if (exit < 0) return exit;
    return mf_gb_node(b, (mf_gnode){.kind = G_LOOP, .a = (uint32_t)body, .b = (uint32_t)exit});
}

int mf_gram_until(mf_gram_b *b, const char *term, size_t n)
{
    if (b->err) return b->err;
    if (n == 0) return mf_gb_fail(b, mf_error(-EINVAL, "grammar: an empty terminator"));
    int64_t off = mf_gb_bytes(b, term, n);
    if (off < 0) return (int)off;
    int rc = mf_gb_grow((void **)&b->fail, &b->cap_fail, b->n_fail, n, sizeof *b->fail, MF_GRAM_MAX_BYTES);
    if (rc) return mf_gb_fail(b, rc);
    uint32_t foff = (uint32_t)b->n_fail, *f = b->fail + foff;
    f[0] = 0;   /* KMP: f[i] = the longest proper border of term[0..i] */
    for (size_t i = 1, k = 0; i < n; i++) {
        while (k && term[i] != term[k]) k = f[k - 1];
        if (term[i] == term[k]) k++;
        f[i] = (uint32_t)k;
    }
    b->n_fail += n;
    return mf_gb_node(b, (mf_gnode){.kind = G_UNTIL, .a = (uint32_t)off, .b = (uint32_t)n, .c = foff});
}

/* ---- JSON nodes (the schema compiler, grammar_schema.c, builds on these) ----------------------- */

int mf_gram_json_str(mf_gram_b *b) { return b->err ? b->err : mf_gb_node(b, (mf_gnode){.kind = G_JSTR}); }

int mf_gram_json_num(mf_gram_b *b, int integer)
{
    return b->err ? b->err : mf_gb_node(b, (mf_gnode){.kind = G_JNUM, .flags = integer ? G_F_INT : 0});
}

int mf_gram_json_arr(mf_gram_b *b, int item, uint32_t min, uint32_t max)
{
    if (b->err) return b->err;
    if (item < 0) return item;
    return mf_gb_node(b, (mf_gnode){.kind = G_JARR, .a = (uint32_t)item, .b = min, .c = max});
}

int mf_gram_json_obj(mf_gram_b *b, const char *const *names, const size_t *lens, const int *values, int n,
                     uint64_t required, int additional)
{
    if (b->err) return b->err;
    if (n > MF_GRAM_MAX_PROPS) return mf_gb_fail(b, mf_error(-E2BIG, "grammar: an object of %d properties (at most %d)",
                                                             n, MF_GRAM_MAX_PROPS));
    if (additional < -1) return additional;
    for (int i = 0; i < n; i++)
        if (values[i] < 0) return values[i];
    int rc = mf_gb_grow((void **)&b->props, &b->cap_props, b->n_props, (size_t)n, sizeof *b->props, (size_t)1 << 24);
    if (rc) return mf_gb_fail(b, rc);
    uint32_t off = (uint32_t)b->n_props;
    for (int i = 0; i < n; i++) {
        int64_t o = mf_gb_bytes(b, names[i], lens[i]);
        if (o < 0) return (int)o;
        b->props[b->n_props++] = (mf_gprop){{(uint32_t)o, (uint32_t)lens[i]}, (uint32_t)values[i]};
    }
    int obj = mf_gb_node(b, (mf_gnode){.kind = G_JOBJ, .a = off, .b = (uint32_t)n,
                                       .c = additional < 0 ? G_NONE : (uint32_t)additional, .m = required});
    if (obj < 0) return obj;
    int key = mf_gb_node(b, (mf_gnode){.kind = G_OKEY, .a = (uint32_t)obj});   /* always obj + 1 */
    return key < 0 ? key : obj;
}

int mf_gram_json_any(mf_gram_b *b)
{
    if (b->err) return b->err;
    if (b->any >= 0) return b->any;
    /* the value's node first, so that its object and array can refer to it */
    int any = mf_gb_node(b, (mf_gnode){.kind = G_JANY});
    if (any < 0) return any;
    b->any = any;
    static const char *const lits[3] = {"true", "false", "null"};
    static const size_t lens[3] = {4, 5, 4};
    int obj = mf_gram_json_obj(b, NULL, NULL, NULL, 0, 0, any), arr = mf_gram_json_arr(b, any, 0, G_NONE);
    int tfn = mf_gram_switch(b, lits, lens, NULL, 3), str = mf_gram_json_str(b), num = mf_gram_json_num(b, 0);
    if (b->err) return b->err;
    b->any_obj = obj;
    b->nodes[any].a = (uint32_t)obj;
    b->nodes[any].b = (uint32_t)arr;
    b->nodes[any].c = (uint32_t)tfn;
    b->nodes[any].m = (uint64_t)(uint32_t)str | (uint64_t)(uint32_t)num << 32;
    return any;
}

int mf_gram_json_object(mf_gram_b *b)
{
    int any = mf_gram_json_any(b);
    return any < 0 ? any : b->any_obj;
}

/* ---- finishing ---------------------------------------------------------------------------------- */

static void mf_set_bit(uint8_t *set, unsigned c) { set[c >> 3] |= (uint8_t)(1u << (c & 7)); }
static int mf_has_bit(const uint8_t *set, unsigned c) { return set[c >> 3] >> (c & 7) & 1; }

static void mf_set_str(uint8_t *set, const char *s)
{
    for (; *s; s++) mf_set_bit(set, (unsigned char)*s);
}

/* First bytes of node i (its kids have lower ids, or are fixed kinds). */
static void mf_gram_first(mf_gram *g, uint32_t i)
{
    const mf_gnode *n = &g->nodes[i];
    uint8_t *f = g->first[i];
    memset(f, 0, 32);
    switch (n->kind) {
    case G_LIT: mf_set_bit(f, g->bytes[n->a]); break;
    case G_SEQ: memcpy(f, g->first[g->kids[n->a]], 32); break;
    case G_CHOICE:
        for (uint32_t k = 0; k < n->b; k++)
            for (int j = 0; j < 32; j++) f[j] |= g->first[g->kids[n->a + k]][j];
        break;
    case G_SWITCH:
        for (uint32_t k = 0; k < n->b; k++) mf_set_bit(f, g->bytes[g->keys[n->a + k].off]);
        break;
    case G_LOOP:
        for (int j = 0; j < 32; j++) f[j] = g->first[n->a][j] | g->first[n->b][j];
        break;
    case G_UNTIL:   /* any byte that starts a UTF-8 character */
        for (unsigned c = 0; c < 0x80; c++) mf_set_bit(f, c);
        for (unsigned c = 0xC2; c <= 0xF4; c++) mf_set_bit(f, c);
        break;
    case G_JSTR: case G_OKEY: mf_set_bit(f, '"'); break;
    case G_JNUM: mf_set_str(f, "-0123456789"); break;
    case G_JOBJ: mf_set_bit(f, '{'); break;
    case G_JARR: mf_set_bit(f, '['); break;
    case G_JANY: mf_set_str(f, "{[\"-0123456789tfn"); break;
    }
}

/* Builds the first-byte map of choice node i; -EINVAL when two kids share a first byte. */
static int mf_gram_choice_map(mf_gram *g, uint32_t i, uint32_t slot)
{
    const mf_gnode *n = &g->nodes[i];
    uint8_t *map = g->cmap + (size_t)slot * 256;
    memset(map, 0, 256);
    for (uint32_t k = 0; k < n->b; k++)
        for (unsigned c = 0; c < 256; c++)
            if (mf_has_bit(g->first[g->kids[n->a + k]], c)) {
                if (map[c]) return mf_error(-EINVAL, "grammar: two alternatives of a choice start with byte 0x%02x", c);
                map[c] = (uint8_t)(k + 1);
            }
    return 0;
}

int mf_gram_b_finish(mf_gram_b *b, int root, mf_gram **out)
{
    *out = NULL;
    int rc = b->err ? b->err : root < 0 ? root : root >= b->n_nodes ? mf_error(-EINVAL, "grammar: no node %d", root) : 0;
    mf_gram *g = rc ? NULL : calloc(1, sizeof *g);
    if (!rc && !g) rc = mf_error(-ENOMEM, "grammar: out of memory");
    if (rc) {
        mf_gram_b_free(b);
        return rc;
    }
    g->nodes = b->nodes;
    g->n_nodes = b->n_nodes;
    g->root = (uint32_t)root;
    g->bytes = b->bytes;
    g->kids = b->kids;
    g->keys = b->keys;
    g->props = b->props;
    g->fail = b->fail;
    b->nodes = NULL, b->bytes = NULL, b->kids = NULL, b->keys = NULL, b->props = NULL, b->fail = NULL;
    mf_gram_b_free(b);
    uint32_t n_choice = 0;
    for (int i = 0; i < g->n_nodes; i++) n_choice += g->nodes[i].kind == G_CHOICE;
    g->first = malloc(32 * (size_t)g->n_nodes);
    g->cmap = malloc(256 * (size_t)(n_choice ? n_choice : 1));
    if (!g->first || !g->cmap) rc = mf_error(-ENOMEM, "grammar: out of memory");
    for (int i = 0; i < g->n_nodes && !rc; i++) mf_gram_first(g, (uint32_t)i);
    for (uint32_t i = 0, slot = 0; i < (uint32_t)g->n_nodes && !rc; i++) {
        mf_gnode *n = &g->nodes[i];
        if (n->kind == G_CHOICE) {
            rc = mf_gram_choice_map(g, i, slot);
            n->c = slot++;
        } else if (n->kind == G_LOOP) {
            for (int j = 0; j < 32 && !rc; j++)
                if (g->first[n->a][j] & g->first[n->b][j])
                    rc = mf_error(-EINVAL, "grammar: a loop's body and its exit start with the same byte");
        }
    }
    if (rc) {
        mf_gram_free(g);
        return rc;
    }
    *out = g;
    return 0;
}

void mf_gram_free(mf_gram *g)
{
    if (!g) return;
    free(g->nodes);
    free(g->bytes);
    free(g->kids);
    free(g->keys);
    free(g->props);
    free(g->fail);
    free(g->first);
    free(g->cmap);
    free(g);
}

/* ---- one byte ----------------------------------------------------------------------------------- */

/* UTF-8: *x is 0 at a character boundary, else (bytes still needed << 16 | lowest << 8 | highest)
 * of the next byte. 1 when c may come, 0 when not. */
static int mf_utf8_step(uint32_t *x, unsigned c)
{
    if (*x) {
        unsigned need = *x >> 16, lo = (*x >> 8) & 0xff, hi = *x & 0xff;
        if (c < lo || c > hi) return 0;
        *x = need > 1 ? (need - 1) << 16 | 0x80 << 8 | 0xBF : 0;
        return 1;
    }
    if (c < 0x80) return 1;
    if (c < 0xC2 || c > 0xF4) return 0;
    if (c <= 0xDF) *x = 1u << 16 | 0x80 << 8 | 0xBF;
    else if (c == 0xE0) *x = 2u << 16 | 0xA0 << 8 | 0xBF;
    else if (c == 0xED) *x = 2u << 16 | 0x80 << 8 | 0x9F;
    else if (c <= 0xEF) *x = 2u << 16 | 0x80 << 8 | 0xBF;
    else if (c == 0xF0) *x = 3u << 16 | 0x90 << 8 | 0xBF;
    else if (c <= 0xF3) *x = 3u << 16 | 0x80 << 8 | 0xBF;
    else *x = 3u << 16 | 0x80 << 8 | 0x8F;
    return 1;
}

static int mf_hexval(unsigned c)
{
    return c >= '0' && c <= '9' ? (int)(c - '0') : c >= 'a' && c <= 'f' ? (int)(c - 'a' + 10)
                                                 : c >= 'A' && c <= 'F' ? (int)(c - 'A' + 10) : -1;
}

/* A byte inside a JSON string (after the opening quote; the closing one is the caller's): s 1 plain,
 * 2 after '\', 3..6 the hex digits of \u (a surrogate, D800..DFFF, is refused), x the UTF-8 state,
 * y whether \u began with D. G_STAY or G_REJECT. */
static int mf_jstr_byte(mf_gframe *f, unsigned c)
{
    if (f->s == 1) {
        if (!f->x && c == '\\') {
            f->s = 2;
            return G_STAY;
        }
        if (!f->x && c < 0x20) return G_REJECT;
        return mf_utf8_step(&f->x, c) ? G_STAY : G_REJECT;
    }
    if (f->s == 2) {
        if (c == 'u') {
            f->s = 3;
            f->y = 0;
            return G_STAY;
        }
        if (!c || !strchr("\"\\/bfnrt", (int)c)) return G_REJECT;
        f->s = 1;
        return G_STAY;
    }
    int v = mf_hexval(c);
    if (v < 0 || (f->s == 4 && f->y && v >= 8)) return G_REJECT;
    if (f->s == 3) f->y = v == 0xD;
    f->s = f->s == 6 ? 1 : f->s + 1;
    return G_STAY;
}

static int mf_jnum_feed(const mf_gnode *n, mf_gframe *f, unsigned c)
{
    int digit = c >= '0' && c <= '9', in = n->flags & G_F_INT, e = c == 'e' || c == 'E';
    switch (f->s) {
    case 0:
        if (c == '-') f->s = 1;
        else if (c == '0') f->s = 2;
        else if (digit) f->s = 3, f->x = 1;
        else return G_REJECT;
        return G_STAY;
    case 1:
        if (c == '0') f->s = 2;
        else if (digit) f->s = 3, f->x = 1;
        else return G_REJECT;
        return G_STAY;
    case 2: case 3:
        if (f->s == 3 && digit && f->x < 18) return f->x++, G_STAY;   /* < 1e18: an int64 */
        if (!in && c == '.') return f->s = 4, G_STAY;
        if (!in && e) return f->s = 6, G_STAY;
        return G_DONE_REFEED;
    case 4:
        if (!digit) return G_REJECT;
        return f->s = 5, f->x = 1, G_STAY;
    case 5:
        if (digit && f->x < 16) return f->x++, G_STAY;
        if (e) return f->s = 6, G_STAY;
        return G_DONE_REFEED;
    case 6:
        if (c == '+' || c == '-') return f->s = 7, G_STAY;
        if (digit) return f->s = 8, f->x = 1, G_STAY;
        return G_REJECT;
    case 7:
        if (!digit) return G_REJECT;
        return f->s = 8, f->x = 1, G_STAY;
    default:
        if (digit && f->x < 2) return f->x++, G_STAY;   /* |exponent| < 100: a finite double */
        return G_DONE_REFEED;
    }
}

static uint64_t mf_props_mask(uint32_t n) { return n >= 64 ? ~UINT64_C(0) : (UINT64_C(1) << n) - 1; }

/* An object's key frame (pushed with m: the properties not yet seen, m2: those seen). */
static int mf_okey_feed(const mf_gram *g, mf_gframe *f, unsigned c, uint32_t *result)
{
    const mf_gnode *o = &g->nodes[g->nodes[f->node].a];
    const mf_gprop *p = o->b ? g->props + o->a : NULL;   /* any object: no properties (and no pool) */
    if (f->s == 0) return c == '"' ? (f->s = 1, G_STAY) : G_REJECT;
    if (f->s == 1 && !f->x && c == '"') {   /* the key ends: a property, a duplicate, or an additional one */
        for (uint32_t k = 0; k < o->b; k++)
            if ((f->m >> k & 1) && p[k].name.len == f->y) return *result = k, G_DONE;
        for (uint32_t k = 0; k < o->b; k++)
            if ((f->m2 >> k & 1) && p[k].name.len == f->y) return G_REJECT;
        return o->c != G_NONE ? (*result = o->b, G_DONE) : G_REJECT;
    }
    if (mf_jstr_byte(f, c) == G_REJECT) return G_REJECT;
    for (uint32_t k = 0; k < o->b; k++) {
        uint64_t bit = UINT64_C(1) << k;
        if (((f->m | f->m2) & bit) && !(p[k].name.len > f->y && g->bytes[p[k].name.off + f->y] == c)) {
            f->m &= ~bit;
            f->m2 &= ~bit;
        }
    }
    f->y++;
    return o->c == G_NONE && !f->m ? G_REJECT : G_STAY;
}

/* The object frame: s 0 '{', 1 after '{', 2 waiting for a key, 3 ':', 4 after ':' (x: the space
 * taken), 5 after a value, 6 after ',' (x), 7 waiting for a value; y the key's property (b: an
 * additional one), m the properties seen. */
static int mf_jobj_feed(const mf_gram *g, mf_gframe *f, unsigned c, int depth, mf_gframe *child)
{
    const mf_gnode *n = &g->nodes[f->node];
    uint64_t all = mf_props_mask(n->b), more = (all & ~f->m) || n->c != G_NONE;
    switch (f->s) {
    case 0: return c == '{' ? (f->s = 1, G_STAY) : G_REJECT;
    case 1: case 5:
        if (c == '}') return (n->m & ~f->m) ? G_REJECT : G_DONE;   /* every required property seen */
        if (f->s == 5) return c == ',' && more ? (f->s = 6, f->x = 0, G_STAY) : G_REJECT;
        break;
    case 6:
        if (c == ' ' && !f->x) return f->x = 1, G_STAY;
        break;
    case 3: return c == ':' ? (f->s = 4, f->x = 0, G_STAY) : G_REJECT;
    default: return G_REJECT;
    case 4:
        if (c == ' ' && !f->x) return f->x = 1, G_STAY;
        if (depth + 1 >= MF_GRAM_MAX_STACK) return G_REJECT;
        *child = mf_gram_frame(g, f->y < n->b ? g->props[n->a + f->y].node : n->c);
        f->s = 7;
        return G_PUSH;
    }
    if (c != '"' || !more) return G_REJECT;   /* a key, after '{' or ',' */
    *child = (mf_gframe){.node = f->node + 1, .m = all & ~f->m, .m2 = f->m};
    f->s = 2;
    return G_PUSH;
}

/* The array frame: s 0 '[', 1 after '[', 2 waiting for an item, 3 after an item, 4 after ','
 * (y: the space taken); x the items so far. */
static int mf_jarr_feed(const mf_gram *g, mf_gframe *f, unsigned c, int depth, mf_gframe *child)
{
    const mf_gnode *n = &g->nodes[f->node];
    switch (f->s) {
    case 0: return c == '[' ? (f->s = 1, G_STAY) : G_REJECT;
    case 3:
        if (c == ']') return f->x >= n->b ? G_DONE : G_REJECT;
        return c == ',' && f->x < n->c ? (f->s = 4, f->y = 0, G_STAY) : G_REJECT;
    case 1: case 4:
        if (f->s == 1 && c == ']') return n->b == 0 ? G_DONE : G_REJECT;
        if (f->s == 4 && c == ' ' && !f->y) return f->y = 1, G_STAY;
        if (f->x >= n->c || depth + 1 >= MF_GRAM_MAX_STACK) return G_REJECT;
        *child = mf_gram_frame(g, n->a);
        f->s = 2;
        return G_PUSH;
    }
    return G_REJECT;
}

/* A switch frame: s 0 matching keys [x, y) that share the m bytes read, 1 key x complete with a
 * continuation to push, 2 waiting for it. */
static int mf_switch_feed(const mf_gram *g, mf_gframe *f, unsigned c, mf_gframe *child, uint32_t *result)
{
    const mf_gnode *n = &g->nodes[f->node];
    const mf_gkey *k = g->keys + n->a;
    uint32_t pos = (uint32_t)f->m;
    if (f->s == 1) {
        *child = mf_gram_frame(g, g->kids[n->c + f->x]);
        f->s = 2;
        return G_PUSH;
    }
    uint32_t lo = f->x, hi = f->y;
    int complete = k[lo].len == pos;
    if (complete) lo++;
    /* keys in [lo, hi) are longer than pos and sorted by their byte at pos */
    uint32_t a = lo, z = hi;
    while (a < z) {
        uint32_t mid = a + (z - a) / 2;
        if (g->bytes[k[mid].off + pos] < c) a = mid + 1;
        else z = mid;
    }
    uint32_t e = a;
    while (e < hi && g->bytes[k[e].off + pos] == c) e++;
    if (a == e) return complete && n->c == G_NONE ? (*result = f->x, G_DONE_REFEED) : G_REJECT;
    f->x = a;
    f->y = e;
    f->m = ++pos;
    if (e - a == 1 && k[a].len == pos) {
        if (n->c == G_NONE || g->kids[n->c + a] == G_NONE) return *result = a, G_DONE;
        f->s = 1;
    }
    return G_STAY;
}

mf_gframe mf_gram_frame(const mf_gram *g, uint32_t n)
{
    mf_gframe f = {.node = n};
    if (g->nodes[n].kind == G_SWITCH) f.y = g->nodes[n].b;
    return f;
}

int mf_gram_feed(const mf_gram *g, mf_gframe *f, unsigned char c, int depth, mf_gframe *child, uint32_t *result)
{
    const mf_gnode *n = &g->nodes[f->node];
    *result = 0;
    switch (n->kind) {
    case G_LIT:
        if (g->bytes[n->a + f->s] != c) return G_REJECT;
        return ++f->s == n->b ? G_DONE : G_STAY;
    case G_SEQ:
        *child = mf_gram_frame(g, g->kids[n->a + f->s]);
        return G_PUSH;
    case G_CHOICE: {
        uint8_t k = g->cmap[(size_t)n->c * 256 + c];
        if (!k || f->s) return G_REJECT;
        f->s = 1;
        *child = mf_gram_frame(g, g->kids[n->a + k - 1]);
        return G_PUSH;
    }
    case G_SWITCH: return mf_switch_feed(g, f, c, child, result);
    case G_LOOP:
        if (mf_has_bit(g->first[n->a], c)) f->s = 1;
        else if (mf_has_bit(g->first[n->b], c)) f->s = 2;
        else return G_REJECT;
        *child = mf_gram_frame(g, f->s == 1 ? n->a : n->b);
        return G_PUSH;
    case G_UNTIL: {
        const unsigned char *t = g->bytes + n->a;
        if (!mf_utf8_step(&f->x, c)) return G_REJECT;
        while (f->s && t[f->s] != c) f->s = g->fail[n->c + f->s - 1];
        if (t[f->s] == c) f->s++;
        return f->s == n->b ? G_DONE : G_STAY;
    }
    case G_JSTR:
        if (f->s == 0) return c == '"' ? (f->s = 1, G_STAY) : G_REJECT;
        if (f->s == 1 && !f->x && c == '"') return G_DONE;
        return mf_jstr_byte(f, c);
    case G_JNUM: return mf_jnum_feed(n, f, c);
    case G_JOBJ: return mf_jobj_feed(g, f, c, depth, child);
    case G_OKEY: return mf_okey_feed(g, f, c, result);
    case G_JARR: return mf_jarr_feed(g, f, c, depth, child);
    case G_JANY: {
        uint32_t k;
        if (c == '{' || c == '[') {
            if (depth + 4 >= MF_GRAM_MAX_STACK) return G_REJECT;
            k = c == '{' ? n->a : n->b;
        } else if (c == '"') {
            k = (uint32_t)n->m;
        } else if (c == '-' || (c >= '0' && c <= '9')) {
            k = (uint32_t)(n->m >> 32);
        } else if (c == 't' || c == 'f' || c == 'n') {
            k = n->c;
        } else {
            return G_REJECT;
        }
        *child = mf_gram_frame(g, k);
        return G_PUSH;
    }
    }
    return G_REJECT;
}

int mf_gram_child_done(const mf_gram *g, mf_gframe *f, uint32_t result)
{
    const mf_gnode *n = &g->nodes[f->node];
    switch (n->kind) {
    case G_SEQ: return ++f->s == n->b;
    case G_LOOP:
        if (f->s == 1) return f->s = 0, 0;
        return 1;
    case G_JOBJ:
        if (f->s == 2) {
            f->y = result;
            if (result < n->b) f->m |= UINT64_C(1) << result;
            f->s = 3;
        } else {
            f->s = 5;
        }
        return 0;
    case G_JARR:
        f->x++;
        f->s = 3;
        return 0;
    default:   /* choice, switch (its continuation), any value */
        return 1;
    }
}

int mf_gram_can_end(const mf_gram *g, const mf_gframe *f)
{
    const mf_gnode *n = &g->nodes[f->node];
    if (n->kind == G_JNUM) return f->s == 2 || f->s == 3 || f->s == 5 || f->s == 8;
    if (n->kind == G_SWITCH)
        return f->s == 0 && f->m && g->keys[n->a + f->x].len == (uint32_t)f->m && n->c == G_NONE;
    return 0;
}
