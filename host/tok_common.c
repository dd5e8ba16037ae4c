/* The tokenizer's small pieces (host/tokenizer.h): the string and merge hash maps and growable
 * arrays the loader and the encoder share, UTF-8 stepping with Unicode's maximal-subpart rule
 * (and mf_utf8_lossy), and GPT-2's byte-level alphabet in both directions. Declared in
 * tok_internal.h. */
#include "host/tok_internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* ---- small containers ------------------------------------------------------------------------ */

static uint64_t mf_hash_bytes(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

int mf_strmap_init(mf_strmap *m, size_t n_expected)
{
    size_t cap = 16;
    while (cap < 2 * n_expected + 1) cap <<= 1;
    m->key = calloc(cap, sizeof *m->key);
    m->klen = calloc(cap, sizeof *m->klen);
    m->val = calloc(cap, sizeof *m->val);
    m->cap = cap;
    m->n = 0;
    return (m->key && m->klen && m->val) ? 0 : -ENOMEM;
}

void mf_strmap_free(mf_strmap *m)
{
    free(m->key);
    free(m->klen);
    free(m->val);
}

/* Slot of `s` (found or the empty one where it would go). */
static size_t mf_strmap_slot(const mf_strmap *m, const char *s, size_t n)
{
    size_t i = mf_hash_bytes(s, n) & (m->cap - 1);
    while (m->key[i] && !(m->klen[i] == n && memcmp(m->key[i], s, n) == 0)) i = (i + 1) & (m->cap - 1);
    return i;
}

int32_t mf_strmap_get(const mf_strmap *m, const char *s, size_t n)
{
    if (!m->cap) return -1;
    size_t i = mf_strmap_slot(m, s, n);
    return m->key[i] ? m->val[i] : -1;
}

/* Inserts (the table was sized for every key); returns the previous value or -1. */
int32_t mf_strmap_put(mf_strmap *m, const char *s, size_t n, int32_t v)
{
    size_t i = mf_strmap_slot(m, s, n);
    int32_t old = m->key[i] ? m->val[i] : -1;
    if (!m->key[i]) m->n++;
    m->key[i] = s;
    m->klen[i] = (uint32_t)n;
    m->val[i] = v;
    return old;
}

int mf_ids_push(mf_ids *a, int32_t x)
{
    if (a->n == a->cap) {
        size_t cap = a->cap ? 2 * a->cap : 64;
        int32_t *v = realloc(a->v, cap * sizeof *v);
        if (!v) return -ENOMEM;
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = x;
    return 0;
}

/* Room for n more bytes and a NUL. */
int mf_bytes_reserve(mf_bytes *b, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) return -ENOMEM;
        b->p = p;
        b->cap = cap;
    }
    return 0;
}

int mf_bytes_add(mf_bytes *b, const void *src, size_t n)
{
    if (mf_bytes_reserve(b, n)) return -ENOMEM;
    memcpy(b->p + b->n, src, n);
    b->n += n;
    b->p[b->n] = '\0';
    return 0;
}

int mf_spans_push(mf_spans *s, size_t a, size_t b)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 32;
        size_t *v = realloc(s->v, 2 * cap * sizeof *v);
        if (!v) return -ENOMEM;
        s->v = v;
        s->cap = cap;
    }
    s->v[2 * s->n] = a;
    s->v[2 * s->n + 1] = b;
    s->n++;
    return 0;
}

/* ---- UTF-8 and the byte-level alphabet --------------------------------------------------------- */

size_t mf_utf8_lossy(const char *s, size_t n, char *out)
{
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        int k = mf_utf8_next((const unsigned char *)s + i, n - i);
        if (k > 0) {
            memcpy(out + o, s + i, (size_t)k);
            o += (size_t)k;
            i += (size_t)k;
        } else {
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i += (size_t)-k;
        }
    }
    return o;
}

/* GPT-2's printable stand-in for each byte: printable Latin-1 bytes stand for themselves, the
 * other 68 take code points 256.. in byte order. */
int32_t mf_byte_char[256];
int16_t mf_char_byte[324];   /* inverse, -1 where no byte */

static void mf_bytelevel_fill(void)
{
    int n = 0;
    for (int i = 0; i < 324; i++) mf_char_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        int keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        mf_byte_char[b] = keep ? b : 256 + n++;
        mf_char_byte[mf_byte_char[b]] = (int16_t)b;
    }
}

void mf_bytelevel_init(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, mf_bytelevel_fill);
}
