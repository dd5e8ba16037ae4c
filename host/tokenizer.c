/* tokenizer.json reading (jansson) and byte-level BPE encoding/decoding, following the
 * `tokenizers` library step by step: added tokens (leftmost-longest, single_word/lstrip/rstrip),
 * normalizer (utf8proc), pre-tokenizers (PCRE2 regex splits with tokenizers' split behaviours,
 * ByteLevel), BPE merges by rank with a min-heap over a linked word, ByteLevel decoding. */
#include "host/tokenizer.h"
#include "host/json_kind.h"

#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "sched/error.h"

/* ---- small containers ------------------------------------------------------------------------ */

/* String -> id, open addressing over (pointer, length) keys that live elsewhere. */
typedef struct mf_strmap {
    const char **key;
    uint32_t *klen;
    int32_t *val;
    size_t cap;   /* power of two */
    size_t n;
} mf_strmap;

static uint64_t mf_hash_bytes(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

static int mf_strmap_init(mf_strmap *m, size_t n_expected)
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

static void mf_strmap_free(mf_strmap *m)
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

static int32_t mf_strmap_get(const mf_strmap *m, const char *s, size_t n)
{
    if (!m->cap) return -1;
    size_t i = mf_strmap_slot(m, s, n);
    return m->key[i] ? m->val[i] : -1;
}

/* Inserts (the table was sized for every key); returns the previous value or -1. */
static int32_t mf_strmap_put(mf_strmap *m, const char *s, size_t n, int32_t v)
{
    size_t i = mf_strmap_slot(m, s, n);
    int32_t old = m->key[i] ? m->val[i] : -1;
    if (!m->key[i]) m->n++;
    m->key[i] = s;
    m->klen[i] = (uint32_t)n;
    m->val[i] = v;
    return old;
}

/* (left id, right id) -> (rank, merged id). */
typedef struct mf_mergemap {
    uint64_t *key;   /* UINT64_MAX: empty */
    int32_t *rank, *new_id;
    size_t cap;
} mf_mergemap;

static size_t mf_merge_slot(const mf_mergemap *m, uint64_t k)
{
    uint64_t h = k * 0x9E3779B97F4A7C15ull;
    size_t i = (size_t)(h >> 20) & (m->cap - 1);
    while (m->key[i] != UINT64_MAX && m->key[i] != k) i = (i + 1) & (m->cap - 1);
    return i;
}

static int mf_merge_lookup(const mf_mergemap *m, int32_t a, int32_t b, int32_t *rank, int32_t *id)
{
    if (!m->cap) return 0;
    size_t i = mf_merge_slot(m, ((uint64_t)(uint32_t)a << 32) | (uint32_t)b);
    if (m->key[i] == UINT64_MAX) return 0;
    *rank = m->rank[i];
    *id = m->new_id[i];
    return 1;
}

typedef struct mf_ids {
    int32_t *v;
    size_t n, cap;
} mf_ids;

static int mf_ids_push(mf_ids *a, int32_t x)
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

typedef struct mf_bytes {
    char *p;
    size_t n, cap;
} mf_bytes;

/* Room for n more bytes and a NUL. */
static int mf_bytes_reserve(mf_bytes *b, size_t n)
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

static int mf_bytes_add(mf_bytes *b, const void *src, size_t n)
{
    if (mf_bytes_reserve(b, n)) return -ENOMEM;
    memcpy(b->p + b->n, src, n);
    b->n += n;
    b->p[b->n] = '\0';
    return 0;
}

/* Spans [start, end) over some buffer. */
typedef struct mf_spans {
    size_t *v;   /* pairs */
    size_t n, cap;
} mf_spans;

static int mf_spans_push(mf_spans *s, size_t a, size_t b)
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

/* Length of the well-formed UTF-8 sequence at s[0..n), or -(k) when the first k >= 1 bytes are
 * the maximal ill-formed subpart (Unicode's "U+FFFD substitution of maximal subparts", the rule
 * of Rust's from_utf8_lossy and Python's errors="replace"). */
static int mf_utf8_next(const unsigned char *s, size_t n)
{
    unsigned char b = s[0];
    if (b < 0x80) return 1;
    int need;
    unsigned char lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) need = 1;
    else if (b == 0xE0) { need = 2; lo = 0xA0; }
    else if (b == 0xED) { need = 2; hi = 0x9F; }
    else if (b >= 0xE1 && b <= 0xEF) need = 2;
    else if (b == 0xF0) { need = 3; lo = 0x90; }
    else if (b == 0xF4) { need = 3; hi = 0x8F; }
    else if (b >= 0xF1 && b <= 0xF3) need = 3;
    else return -1;
    for (int k = 1; k <= need; k++) {
        if ((size_t)k >= n) return -k;
        unsigned char c = s[k];
        unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
        if (c < l || c > h) return -k;
    }
    return need + 1;
}

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

static int32_t mf_utf8_decode1(const unsigned char *s, int len)
{
    if (len == 1) return s[0];
    int32_t cp = s[0] & (0x7F >> len);
    for (int k = 1; k < len; k++) cp = (cp << 6) | (s[k] & 0x3F);
    return cp;
}

/* GPT-2's printable stand-in for each byte: printable Latin-1 bytes stand for themselves, the
 * other 68 take code points 256.. in byte order. */
static int32_t mf_byte_char[256];
static int16_t mf_char_byte[324];   /* inverse, -1 where no byte */

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

static void mf_bytelevel_init(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, mf_bytelevel_fill);
}

/* Rust's char::is_whitespace (Unicode White_Space): Zs, Zl, Zp and the controls 9-13 and 0x85. */
static int mf_is_white_space(int32_t cp)
{
    if ((cp >= 9 && cp <= 13) || cp == 0x85) return 1;
    utf8proc_category_t c = utf8proc_category(cp);
    return c == UTF8PROC_CATEGORY_ZS || c == UTF8PROC_CATEGORY_ZL || c == UTF8PROC_CATEGORY_ZP;
}

/* Rust regex's Unicode \w: letters, letter numbers, marks, decimal digits, connector punctuation,
 * joiners (Other_Alphabetic symbols such as circled letters are not covered). */
static int mf_is_word_char(int32_t cp)
{
    if (cp == 0x200C || cp == 0x200D) return 1;
    switch (utf8proc_category(cp)) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_MN: case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_PC:
        return 1;
    default:
        return 0;
    }
}

/* Code point of the last character of valid UTF-8 s[0..n) (n > 0), and its start. */
static int32_t mf_utf8_last(const char *s, size_t n, size_t *start)
{
    size_t i = n - 1;
    while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80) i--;
    *start = i;
    return mf_utf8_decode1((const unsigned char *)s + i, (int)(n - i));
}

static int32_t mf_utf8_first(const char *s, size_t n, int *len)
{
    *len = mf_utf8_next((const unsigned char *)s, n);
    return mf_utf8_decode1((const unsigned char *)s, *len);
}

/* ---- the tokenizer -------------------------------------------------------------------------- */

enum { MF_PT_SPLIT, MF_PT_BYTELEVEL };
enum { MF_SB_REMOVED, MF_SB_ISOLATED, MF_SB_MERGED_PREV, MF_SB_MERGED_NEXT, MF_SB_CONTIGUOUS };

typedef struct mf_pretok {
    int kind;
    pcre2_code *re;      /* Split: its pattern */
    int behavior, invert;
    int add_prefix_space, use_regex;   /* ByteLevel */
} mf_pretok;

typedef struct mf_added {
    const char *content;   /* as matched: normalized when `normalized` and a normalizer exists */
    size_t len;
    int32_t id;
    unsigned char special, lstrip, rstrip, single_word, normalized;
} mf_added;

#define MF_TOK_MAX_STAGES 16

struct mf_tok {
    char *path;
    int n_vocab;
    const char **piece;        /* by id: vocab string or added content, NULL for holes */
    unsigned char *special;    /* by id */
    unsigned char *added;      /* by id */
    mf_strmap vocab;           /* model vocabulary */
    mf_strmap added_map;       /* added token content -> id */
    mf_mergemap merges;
    int ignore_merges, fuse_unk;
    int32_t unk_id;
    mf_added *add;             /* sorted: normalized flag, then longest first */
    int n_add;
    int bucket[2][257];        /* add[bucket[nz][b] .. bucket[nz][b+1]) in by_first: tokens with
                                * normalized == nz whose first byte is b, longest first */
    int *by_first;
    utf8proc_option_t norm[MF_TOK_MAX_STAGES];
    int n_norm;
    mf_pretok pre[MF_TOK_MAX_STAGES];
    int n_pre;
    int decoder_bytelevel;
    pcre2_code *gpt2_re;
    json_t *root;              /* keeps the vocabulary strings alive */
    char **owned;              /* normalized added contents */
    int n_owned;
};

static int mf_tok_bad(const mf_tok *t, const char *field, const char *expected, const json_t *found)
{
    return mf_error(-EINVAL, "%s: field '%s': expected %s, found %s", t->path, field, expected,
                    mf_json_kind(found));
}

/* Optional boolean; absent or null -> def. */
static int mf_tok_bool(const mf_tok *t, const json_t *obj, const char *key, const char *field,
                       int def, int *out)
{
    json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) {
        *out = def;
        return 0;
    }
    if (!json_is_boolean(v)) {
        char f[256];
        snprintf(f, sizeof f, "%s.%s", field, key);
        return mf_tok_bad(t, f, "true or false", v);
    }
    *out = json_is_true(v);
    return 0;
}

static int mf_tok_compile(mf_tok *t, const char *pat, size_t n, int literal, const char *field,
                          pcre2_code **out)
{
    int err;
    PCRE2_SIZE at;
    pcre2_compile_context *cc = pcre2_compile_context_create(NULL);
    if (!cc) return mf_error(-ENOMEM, "%s: out of memory compiling %s", t->path, field);
    pcre2_set_newline(cc, PCRE2_NEWLINE_LF);
    /* Oniguruma (Ruby syntax), which tokenizers uses, has line anchors: hence MULTILINE. */
    uint32_t opt = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP | PCRE2_MULTILINE);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, n, opt, &err, &at, cc);
    pcre2_compile_context_free(cc);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return mf_error(-EINVAL, "%s: field '%s': regex does not compile at offset %zu: %s",
                        t->path, field, (size_t)at, (const char *)msg);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);   /* the interpreter is used if JIT is missing */
    *out = re;
    return 0;
}

static int mf_tok_load_normalizer(mf_tok *t, const json_t *n, const char *field)
{
    if (!n || json_is_null(n)) return 0;
    const char *type = json_string_value(json_object_get(n, "type"));
    char f[256];
    if (!json_is_object(n) || !type) return mf_tok_bad(t, field, "an object with a string 'type'", n);
    if (strcmp(type, "Sequence") == 0) {
        json_t *list = json_object_get(n, "normalizers");
        snprintf(f, sizeof f, "%s.normalizers", field);
        if (!json_is_array(list)) return mf_tok_bad(t, f, "a list", list);
        for (size_t i = 0; i < json_array_size(list); i++) {
            snprintf(f, sizeof f, "%s.normalizers[%zu]", field, i);
            int rc = mf_tok_load_normalizer(t, json_array_get(list, i), f);
            if (rc) return rc;
        }
        return 0;
    }
    utf8proc_option_t o = UTF8PROC_STABLE;
    if (strcmp(type, "NFC") == 0) o |= UTF8PROC_COMPOSE;
    else if (strcmp(type, "NFD") == 0) o |= UTF8PROC_DECOMPOSE;
    else if (strcmp(type, "NFKC") == 0) o |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
    else if (strcmp(type, "NFKD") == 0) o |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
    else
        return mf_error(-EINVAL, "%s: field '%s.type': normalizer '%s' is not supported (NFC, NFD, "
                        "NFKC, NFKD or a Sequence of them)", t->path, field, type);
    if (t->n_norm == MF_TOK_MAX_STAGES)
        return mf_error(-EINVAL, "%s: field '%s': more than %d normalizers", t->path, field,
                        MF_TOK_MAX_STAGES);
    t->norm[t->n_norm++] = o;
    return 0;
}

static int mf_tok_load_pretok(mf_tok *t, const json_t *p, const char *field)
{
    if (!p || json_is_null(p)) return 0;
    const char *type = json_string_value(json_object_get(p, "type"));
    char f[256];
    int rc;
    if (!json_is_object(p) || !type) return mf_tok_bad(t, field, "an object with a string 'type'", p);
    if (strcmp(type, "Sequence") == 0) {
        json_t *list = json_object_get(p, "pretokenizers");
        snprintf(f, sizeof f, "%s.pretokenizers", field);
        if (!json_is_array(list)) return mf_tok_bad(t, f, "a list", list);
        for (size_t i = 0; i < json_array_size(list); i++) {
            snprintf(f, sizeof f, "%s.pretokenizers[%zu]", field, i);
            if ((rc = mf_tok_load_pretok(t, json_array_get(list, i), f))) return rc;
        }
        return 0;
    }
    if (t->n_pre == MF_TOK_MAX_STAGES)
        return mf_error(-EINVAL, "%s: field '%s': more than %d pre-tokenizers", t->path, field,
                        MF_TOK_MAX_STAGES);
    mf_pretok *pt = &t->pre[t->n_pre];
    memset(pt, 0, sizeof *pt);
    if (strcmp(type, "ByteLevel") == 0) {
        pt->kind = MF_PT_BYTELEVEL;
        if ((rc = mf_tok_bool(t, p, "add_prefix_space", field, 1, &pt->add_prefix_space)) ||
            (rc = mf_tok_bool(t, p, "use_regex", field, 1, &pt->use_regex)))
            return rc;
        t->n_pre++;
        return 0;
    }
    if (strcmp(type, "Split") != 0)
        return mf_error(-EINVAL, "%s: field '%s.type': pre-tokenizer '%s' is not supported (Split, "
                        "ByteLevel or a Sequence of them)", t->path, field, type);
    pt->kind = MF_PT_SPLIT;
    json_t *pat = json_object_get(p, "pattern");
    json_t *rx = json_object_get(pat, "Regex"), *lit = json_object_get(pat, "String");
    snprintf(f, sizeof f, "%s.pattern", field);
    if (!json_is_object(pat) || !(json_is_string(rx) || json_is_string(lit)))
        return mf_tok_bad(t, f, "an object {\"Regex\": string} or {\"String\": string}", pat);
    json_t *ps = rx ? rx : lit;
    snprintf(f, sizeof f, "%s.pattern.%s", field, rx ? "Regex" : "String");
    if (json_string_length(ps) == 0 && !rx) {
        pt->re = NULL;   /* empty literal: never matches (tokenizers' rule) */
    } else if ((rc = mf_tok_compile(t, json_string_value(ps), json_string_length(ps), !rx, f,
                                    &pt->re))) {
        return rc;
    }
    t->n_pre++;   /* owns pt->re from here on */
    const char *beh = json_string_value(json_object_get(p, "behavior"));
    static const char *names[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext",
                                  "Contiguous"};
    pt->behavior = -1;
    for (int i = 0; beh && i < 5; i++)
        if (strcmp(beh, names[i]) == 0) pt->behavior = i;
    snprintf(f, sizeof f, "%s.behavior", field);
    if (pt->behavior < 0)
        return beh ? mf_error(-EINVAL, "%s: field '%s': expected Removed, Isolated, "
                              "MergedWithPrevious, MergedWithNext or Contiguous, found '%s'",
                              t->path, f, beh)
                   : mf_tok_bad(t, f, "a string", json_object_get(p, "behavior"));
    return mf_tok_bool(t, p, "invert", field, 0, &pt->invert);
}

/* Applies the normalizers to s[0..n); *out is malloc'd (NUL-terminated), *out_n its length. */
static int mf_tok_normalize(const mf_tok *t, const char *s, size_t n, char **out, size_t *out_n)
{
    char *cur = malloc(n + 1);
    if (!cur) return -ENOMEM;
    memcpy(cur, s, n);
    cur[n] = '\0';
    size_t len = n;
    for (int i = 0; i < t->n_norm; i++) {
        utf8proc_uint8_t *dst = NULL;
        utf8proc_ssize_t m = len ? utf8proc_map((const utf8proc_uint8_t *)cur,
                                                (utf8proc_ssize_t)len, &dst, t->norm[i]) : 0;
        if (!len) continue;
        free(cur);
        if (m < 0) {
            return mf_error(m == UTF8PROC_ERROR_NOMEM ? -ENOMEM : -EILSEQ,
                            "tokenizer: normalizing text: %s", utf8proc_errmsg(m));
        }
        cur = (char *)dst;
        len = (size_t)m;
    }
    *out = cur;
    *out_n = len;
    return 0;
}

static int mf_added_cmp(const void *a, const void *b)
{
    const mf_added *x = a, *y = b;
    if (x->normalized != y->normalized) return x->normalized - y->normalized;
    if (x->len != y->len) return x->len > y->len ? -1 : 1;
    return x->id - y->id;
}

static int mf_tok_load_added(mf_tok *t, const json_t *list)
{
    if (!list || json_is_null(list)) return 0;
    if (!json_is_array(list)) return mf_tok_bad(t, "added_tokens", "a list", list);
    size_t n = json_array_size(list);
    t->add = calloc(n ? n : 1, sizeof *t->add);
    t->owned = calloc(n ? n : 1, sizeof *t->owned);
    if (!t->add || !t->owned || mf_strmap_init(&t->added_map, n)) return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(list, i);
        char f[64];
        snprintf(f, sizeof f, "added_tokens[%zu]", i);
        json_t *c = json_object_get(e, "content"), *id = json_object_get(e, "id");
        if (!json_is_object(e)) return mf_tok_bad(t, f, "an object", e);
        snprintf(f, sizeof f, "added_tokens[%zu].content", i);
        if (!json_is_string(c)) return mf_tok_bad(t, f, "a string", c);
        snprintf(f, sizeof f, "added_tokens[%zu].id", i);
        if (!json_is_integer(id) || json_integer_value(id) < 0 ||
            json_integer_value(id) >= (1 << 30))
            return mf_tok_bad(t, f, "an integer in [0, 2^30)", id);
        snprintf(f, sizeof f, "added_tokens[%zu]", i);
        mf_added a = {.content = json_string_value(c), .len = json_string_length(c),
                      .id = (int32_t)json_integer_value(id)};
        int sp, ls, rs, sw, no, rc;
        if ((rc = mf_tok_bool(t, e, "special", f, 0, &sp)) ||
            (rc = mf_tok_bool(t, e, "lstrip", f, 0, &ls)) ||
            (rc = mf_tok_bool(t, e, "rstrip", f, 0, &rs)) ||
            (rc = mf_tok_bool(t, e, "single_word", f, 0, &sw)) ||
            (rc = mf_tok_bool(t, e, "normalized", f, !sp, &no)))
            return rc;
        if (a.len == 0) continue;   /* tokenizers ignores empty added tokens */
        if (memchr(a.content, 0, a.len))
            return mf_error(-EINVAL, "%s: field '%s.content': contains a NUL byte", t->path, f);
        int32_t in_vocab = mf_strmap_get(&t->vocab, a.content, a.len);
        if (in_vocab >= 0 && in_vocab != a.id)
            return mf_error(-EINVAL, "%s: field '%s': token '%s' has id %d but the model "
                            "vocabulary gives it id %d", t->path, f, a.content, a.id, in_vocab);
        if (mf_strmap_put(&t->added_map, a.content, a.len, a.id) >= 0)
            return mf_error(-EINVAL, "%s: field '%s': token '%s' is listed twice", t->path, f,
                            a.content);
        a.special = (unsigned char)sp;
        a.lstrip = (unsigned char)ls;
        a.rstrip = (unsigned char)rs;
        a.single_word = (unsigned char)sw;
        a.normalized = (unsigned char)no;
        t->add[t->n_add++] = a;
    }
    return 0;
}

/* Builds the id tables once the vocabulary and the added tokens are known. */
static int mf_tok_index(mf_tok *t)
{
    int32_t max = -1;
    for (size_t i = 0; i < t->vocab.cap; i++)
        if (t->vocab.key[i] && t->vocab.val[i] > max) max = t->vocab.val[i];
    for (int i = 0; i < t->n_add; i++)
        if (t->add[i].id > max) max = t->add[i].id;
    t->n_vocab = max + 1;
    size_t n = (size_t)(max + 1 > 0 ? max + 1 : 1);
    t->piece = calloc(n, sizeof *t->piece);
    t->special = calloc(n, 1);
    t->added = calloc(n, 1);
    if (!t->piece || !t->special || !t->added) return -ENOMEM;
    for (size_t i = 0; i < t->vocab.cap; i++) {
        if (!t->vocab.key[i]) continue;
        int32_t id = t->vocab.val[i];
        if (t->piece[id])
            return mf_error(-EINVAL, "%s: field 'model.vocab': id %d is given to both '%s' and '%s'",
                            t->path, id, t->piece[id], t->vocab.key[i]);
        t->piece[id] = t->vocab.key[i];
    }
    for (int i = 0; i < t->n_add; i++) {
        mf_added *a = &t->add[i];
        if (t->piece[a->id] && !(t->added[a->id] == 0 && strcmp(t->piece[a->id], a->content) == 0))
            return mf_error(-EINVAL, "%s: field 'added_tokens': id %d is given to both '%s' and '%s'",
                            t->path, a->id, t->piece[a->id], a->content);
        t->piece[a->id] = a->content;
        t->added[a->id] = 1;
        t->special[a->id] = a->special;
    }
    /* Normalized added tokens are matched in normalized text, by their normalized content. */
    for (int i = 0; i < t->n_add; i++) {
        mf_added *a = &t->add[i];
        if (!a->normalized || !t->n_norm) continue;
        char *s;
        size_t len;
        int rc = mf_tok_normalize(t, a->content, a->len, &s, &len);
        if (rc) return mf_error_wrap(rc, "%s: added token '%s'", t->path, a->content);
        t->owned[t->n_owned++] = s;
        a->content = s;
        a->len = len;
    }
    qsort(t->add, (size_t)t->n_add, sizeof *t->add, mf_added_cmp);
    t->by_first = malloc((size_t)(t->n_add ? t->n_add : 1) * sizeof *t->by_first);
    if (!t->by_first) return -ENOMEM;
    int k = 0;
    for (int nz = 0; nz < 2; nz++)
        for (int b = 0; b < 256; b++) {
            t->bucket[nz][b] = k;
            for (int i = 0; i < t->n_add; i++)
                if (t->add[i].normalized == nz && (unsigned char)t->add[i].content[0] == b)
                    t->by_first[k++] = i;
            t->bucket[nz][b + 1] = k;
        }
    return 0;
}

static int mf_tok_load_model(mf_tok *t, const json_t *m)
{
    if (!json_is_object(m)) return mf_tok_bad(t, "model", "an object", m);
    json_t *type = json_object_get(m, "type");
    if (type && !(json_is_string(type) && strcmp(json_string_value(type), "BPE") == 0)) {
        if (json_is_string(type))
            return mf_error(-EINVAL, "%s: field 'model.type': model '%s' is not supported (BPE)",
                            t->path, json_string_value(type));
        return mf_tok_bad(t, "model.type", "\"BPE\"", type);
    }
    int rc, byte_fallback;
    if ((rc = mf_tok_bool(t, m, "byte_fallback", "model", 0, &byte_fallback)) ||
        (rc = mf_tok_bool(t, m, "ignore_merges", "model", 0, &t->ignore_merges)) ||
        (rc = mf_tok_bool(t, m, "fuse_unk", "model", 0, &t->fuse_unk)))
        return rc;
    if (byte_fallback)
        return mf_error(-EINVAL, "%s: field 'model.byte_fallback': true is not supported", t->path);
    json_t *d = json_object_get(m, "dropout");
    if (d && !json_is_null(d) && !(json_is_number(d) && json_number_value(d) == 0.0))
        return mf_tok_bad(t, "model.dropout", "null (BPE dropout is not supported)", d);
    static const char *unset[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        json_t *v = json_object_get(m, unset[i]);
        if (v && !json_is_null(v) && !(json_is_string(v) && json_string_length(v) == 0))
            return mf_error(-EINVAL, "%s: field 'model.%s': only null is supported, found %s",
                            t->path, unset[i], mf_json_kind(v));
    }
    json_t *vocab = json_object_get(m, "vocab");
    if (!json_is_object(vocab)) return mf_tok_bad(t, "model.vocab", "an object", vocab);
    if (mf_strmap_init(&t->vocab, json_object_size(vocab))) return -ENOMEM;
    const char *key;
    json_t *val;
    json_object_foreach(vocab, key, val) {
        if (!json_is_integer(val) || json_integer_value(val) < 0 ||
            json_integer_value(val) >= (1 << 30))
            return mf_error(-EINVAL, "%s: field 'model.vocab': token '%s': expected an integer id "
                            "in [0, 2^30), found %s", t->path, key, mf_json_kind(val));
        /* Keys with NUL bytes are not valid tokens here (jansson keeps them only with a flag). */
        mf_strmap_put(&t->vocab, key, strlen(key), (int32_t)json_integer_value(val));
    }
    t->unk_id = -1;
    json_t *unk = json_object_get(m, "unk_token");
    if (unk && !json_is_null(unk)) {
        if (!json_is_string(unk)) return mf_tok_bad(t, "model.unk_token", "a string or null", unk);
        t->unk_id = mf_strmap_get(&t->vocab, json_string_value(unk), json_string_length(unk));
        if (t->unk_id < 0)
            return mf_error(-EINVAL, "%s: field 'model.unk_token': '%s' is not in model.vocab",
                            t->path, json_string_value(unk));
    }
    json_t *merges = json_object_get(m, "merges");
    if (!merges || json_is_null(merges)) return 0;
    if (!json_is_array(merges)) return mf_tok_bad(t, "model.merges", "a list", merges);
    size_t n = json_array_size(merges), cap = 16;
    while (cap < 2 * n + 1) cap <<= 1;
    mf_mergemap *mm = &t->merges;
    mm->key = malloc(cap * sizeof *mm->key);
    mm->rank = malloc(cap * sizeof *mm->rank);
    mm->new_id = malloc(cap * sizeof *mm->new_id);
    if (!mm->key || !mm->rank || !mm->new_id) return -ENOMEM;
    memset(mm->key, 0xFF, cap * sizeof *mm->key);
    mm->cap = cap;
    char *joined = NULL;
    size_t joined_cap = 0;
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(merges, i);
        const char *a, *b;
        size_t la, lb;
        if (json_is_string(e)) {
            a = json_string_value(e);
            const char *sp = strchr(a, ' ');
            if (!sp || strchr(sp + 1, ' ')) {
                free(joined);
                return mf_error(-EINVAL, "%s: field 'model.merges[%zu]': expected \"left right\" "
                                "(one space), found '%s'", t->path, i, a);
            }
            la = (size_t)(sp - a);
            b = sp + 1;
            lb = strlen(b);
        } else if (json_is_array(e) && json_array_size(e) == 2 &&
                   json_is_string(json_array_get(e, 0)) && json_is_string(json_array_get(e, 1))) {
            a = json_string_value(json_array_get(e, 0));
            la = json_string_length(json_array_get(e, 0));
            b = json_string_value(json_array_get(e, 1));
            lb = json_string_length(json_array_get(e, 1));
        } else {
            free(joined);
            char f[64];
            snprintf(f, sizeof f, "model.merges[%zu]", i);
            return mf_tok_bad(t, f, "a string \"left right\" or a pair [\"left\", \"right\"]", e);
        }
        int32_t ia = mf_strmap_get(&t->vocab, a, la), ib = mf_strmap_get(&t->vocab, b, lb);
        if (la + lb + 1 > joined_cap) {
            joined_cap = 2 * (la + lb + 1);
            char *p = realloc(joined, joined_cap);
            if (!p) {
                free(joined);
                return -ENOMEM;
            }
            joined = p;
        }
        memcpy(joined, a, la);
        memcpy(joined + la, b, lb);
        int32_t ic = mf_strmap_get(&t->vocab, joined, la + lb);
        if (ia < 0 || ib < 0 || ic < 0) {
            const char *which = ia < 0 ? "left part" : ib < 0 ? "right part" : "merged token";
            joined[la + lb] = '\0';
            int rc2 = mf_error(-EINVAL, "%s: field 'model.merges[%zu]': the %s of '%.*s' + '%.*s' "
                               "is not in model.vocab", t->path, i, which, (int)la, a, (int)lb, b);
            free(joined);
            return rc2;
        }
        uint64_t k = ((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib;
        size_t slot = mf_merge_slot(mm, k);
        if (mm->key[slot] == UINT64_MAX) {   /* a repeated pair keeps its first (best) rank */
            mm->key[slot] = k;
            mm->rank[slot] = (int32_t)i;
            mm->new_id[slot] = ic;
        }
    }
    free(joined);
    return 0;
}

void mf_tok_free(mf_tok *t)
{
    if (!t) return;
    for (int i = 0; i < t->n_pre; i++) pcre2_code_free(t->pre[i].re);
    pcre2_code_free(t->gpt2_re);
    mf_strmap_free(&t->vocab);
    mf_strmap_free(&t->added_map);
    free(t->merges.key);
    free(t->merges.rank);
    free(t->merges.new_id);
    for (int i = 0; i < t->n_owned; i++) free(t->owned[i]);
    free(t->owned);
    free(t->add);
    free(t->by_first);
    free(t->piece);
    free(t->special);
    free(t->added);
    json_decref(t->root);
    free(t->path);
    free(t);
}

int mf_tok_load(const char *path, mf_tok **out)
{
    *out = NULL;
    mf_bytelevel_init();
    mf_tok *t = calloc(1, sizeof *t);
    if (!t || !(t->path = strdup(path))) {
        free(t);
        return mf_error(-ENOMEM, "%s: out of memory", path);
    }
    json_error_t jerr;
    t->root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    int rc;
    if (!t->root) {
        rc = mf_error(jerr.line < 0 ? -ENOENT : -EINVAL, "%s: line %d column %d: %s", path,
                      jerr.line, jerr.column, jerr.text);
        goto fail;
    }
    if (!json_is_object(t->root)) {
        rc = mf_error(-EINVAL, "%s: expected a JSON object at the top, found %s", path,
                      mf_json_kind(t->root));
        goto fail;
    }
    static const char *unsupported[] = {"truncation", "padding"};
    for (int i = 0; i < 2; i++) {
        json_t *v = json_object_get(t->root, unsupported[i]);
        if (v && !json_is_null(v)) {
            rc = mf_error(-EINVAL, "%s: field '%s': only null is supported, found %s", path,
                          unsupported[i], mf_json_kind(v));
            goto fail;
        }
    }
    if ((rc = mf_tok_load_model(t, json_object_get(t->root, "model"))) ||
        (rc = mf_tok_load_normalizer(t, json_object_get(t->root, "normalizer"), "normalizer")) ||
        (rc = mf_tok_load_pretok(t, json_object_get(t->root, "pre_tokenizer"), "pre_tokenizer")) ||
        (rc = mf_tok_load_added(t, json_object_get(t->root, "added_tokens"))) ||
        (rc = mf_tok_index(t)))
        goto fail;
    json_t *dec = json_object_get(t->root, "decoder");
    if (dec && !json_is_null(dec)) {
        const char *type = json_string_value(json_object_get(dec, "type"));
        if (!json_is_object(dec) || !type) {
            rc = mf_tok_bad(t, "decoder", "an object with a string 'type'", dec);
            goto fail;
        }
        if (strcmp(type, "ByteLevel") != 0) {
            rc = mf_error(-EINVAL, "%s: field 'decoder.type': decoder '%s' is not supported "
                          "(ByteLevel)", path, type);
            goto fail;
        }
        t->decoder_bytelevel = 1;
    }
    static const char gpt2[] =
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
    if ((rc = mf_tok_compile(t, gpt2, sizeof gpt2 - 1, 0, "ByteLevel regex", &t->gpt2_re)))
        goto fail;
    *out = t;
    return 0;
fail:
    if (rc == -ENOMEM && !strstr(mf_last_error(), "memory")) mf_error(rc, "%s: out of memory", path);
    mf_tok_free(t);
    return rc;
}

int mf_tok_n_vocab(const mf_tok *t) { return t->n_vocab; }

const char *mf_tok_piece(const mf_tok *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab ? t->piece[id] : NULL;
}

int32_t mf_tok_find(const mf_tok *t, const char *piece)
{
    size_t n = strlen(piece);
    int32_t id = mf_strmap_get(&t->added_map, piece, n);
    if (id < 0) id = mf_strmap_get(&t->vocab, piece, n);
    return id < 0 ? -ENOENT : id;
}

int mf_tok_is_special(const mf_tok *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab && t->special[id];
}

/* ---- encoding ------------------------------------------------------------------------------- */

typedef struct mf_enc {
    const mf_tok *t;
    mf_ids out;
    pcre2_match_data *md;
    pcre2_match_context *mc;
    pcre2_jit_stack *js;
    /* BPE scratch */
    int32_t *sym_id, *sym_prev, *sym_next;
    int32_t *heap;   /* triples (rank, pos, new_id) */
    size_t sym_cap, heap_n, heap_cap;
} mf_enc;

static int mf_heap_less(const int32_t *h, size_t a, size_t b)
{
    if (h[3 * a] != h[3 * b]) return h[3 * a] < h[3 * b];
    return h[3 * a + 1] < h[3 * b + 1];
}

static void mf_heap_swap(int32_t *h, size_t a, size_t b)
{
    for (int k = 0; k < 3; k++) {
        int32_t x = h[3 * a + k];
        h[3 * a + k] = h[3 * b + k];
        h[3 * b + k] = x;
    }
}

static int mf_heap_push(mf_enc *e, int32_t rank, int32_t pos, int32_t id)
{
    if (e->heap_n == e->heap_cap) {
        size_t cap = e->heap_cap ? 2 * e->heap_cap : 256;
        int32_t *h = realloc(e->heap, 3 * cap * sizeof *h);
        if (!h) return -ENOMEM;
        e->heap = h;
        e->heap_cap = cap;
    }
    int32_t *h = e->heap;
    size_t i = e->heap_n++;
    h[3 * i] = rank;
    h[3 * i + 1] = pos;
    h[3 * i + 2] = id;
    while (i > 0 && mf_heap_less(h, i, (i - 1) / 2)) {
        mf_heap_swap(h, i, (i - 1) / 2);
        i = (i - 1) / 2;
    }
    return 0;
}

static void mf_heap_pop(mf_enc *e, int32_t *top)
{
    int32_t *h = e->heap;
    memcpy(top, h, 3 * sizeof *h);
    e->heap_n--;
    memcpy(h, h + 3 * e->heap_n, 3 * sizeof *h);
    size_t i = 0, n = e->heap_n;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && mf_heap_less(h, l, m)) m = l;
        if (r < n && mf_heap_less(h, r, m)) m = r;
        if (m == i) break;
        mf_heap_swap(h, i, m);
        i = m;
    }
}

/* BPE on one pre-token (tokenizers' Word::merge_all: lowest rank first, then leftmost). */
static int mf_bpe(mf_enc *e, const char *w, size_t n)
{
    const mf_tok *t = e->t;
    int rc;
    if (t->ignore_merges) {
        int32_t id = mf_strmap_get(&t->vocab, w, n);
        if (id >= 0) return mf_ids_push(&e->out, id);
    }
    if (n > e->sym_cap) {
        size_t cap = n < 64 ? 64 : n;
        int32_t *a = realloc(e->sym_id, cap * sizeof *a);
        if (a) e->sym_id = a;
        int32_t *b = realloc(e->sym_prev, cap * sizeof *b);
        if (b) e->sym_prev = b;
        int32_t *c = realloc(e->sym_next, cap * sizeof *c);
        if (c) e->sym_next = c;
        if (!a || !b || !c) return -ENOMEM;
        e->sym_cap = cap;
    }
    int32_t ns = 0, unk_open = 0;
    for (size_t i = 0; i < n;) {
        int len = mf_utf8_next((const unsigned char *)w + i, n - i);
        if (len < 0) len = 1;   /* cannot happen: text was validated */
        int32_t id = mf_strmap_get(&t->vocab, w + i, (size_t)len);
        i += (size_t)len;
        if (id >= 0) {
            e->sym_id[ns++] = id;
            unk_open = 0;
        } else if (t->unk_id >= 0) {
            if (!(unk_open && t->fuse_unk)) e->sym_id[ns++] = t->unk_id;
            unk_open = 1;
        } /* else: a character outside the vocabulary is dropped, as tokenizers does */
    }
    for (int32_t i = 0; i < ns; i++) {
        e->sym_prev[i] = i - 1;
        e->sym_next[i] = i + 1 < ns ? i + 1 : -1;
    }
    e->heap_n = 0;
    int32_t rank, nid;
    for (int32_t i = 0; i + 1 < ns; i++)
        if (mf_merge_lookup(&t->merges, e->sym_id[i], e->sym_id[i + 1], &rank, &nid) &&
            (rc = mf_heap_push(e, rank, i, nid)))
            return rc;
    while (e->heap_n) {
        int32_t top[3];
        mf_heap_pop(e, top);
        int32_t pos = top[1], nx = e->sym_next[pos];
        if (e->sym_id[pos] < 0 || nx < 0) continue;   /* merged away, or last */
        if (!mf_merge_lookup(&t->merges, e->sym_id[pos], e->sym_id[nx], &rank, &nid) ||
            nid != top[2])
            continue;   /* stale */
        e->sym_id[pos] = nid;
        e->sym_id[nx] = -1;
        e->sym_next[pos] = e->sym_next[nx];
        if (e->sym_next[nx] >= 0) e->sym_prev[e->sym_next[nx]] = pos;
        int32_t pv = e->sym_prev[pos];
        if (pv >= 0 && mf_merge_lookup(&t->merges, e->sym_id[pv], nid, &rank, &nid) &&
            (rc = mf_heap_push(e, rank, pv, nid)))
            return rc;
        nid = e->sym_id[pos];
        nx = e->sym_next[pos];
        if (nx >= 0 && mf_merge_lookup(&t->merges, nid, e->sym_id[nx], &rank, &nid) &&
            (rc = mf_heap_push(e, rank, pos, nid)))
            return rc;
    }
    for (int32_t i = 0; i < ns; i = e->sym_next[i] < 0 ? ns : e->sym_next[i])
        if ((rc = mf_ids_push(&e->out, e->sym_id[i]))) return rc;
    return 0;
}

/* Regex matches inside s[0..n) as tokenizers' find_matches sees them (Oniguruma's iteration:
 * an empty match right where the previous match ended is skipped by one character). Appends
 * (start, end, is_match) triples covering s, relative to s, to `m`. */
static int mf_find_matches(mf_enc *e, const pcre2_code *re, const char *s, size_t n, int invert,
                           mf_spans *m, mf_ids *flags)
{
    int rc;
    size_t prev = 0, last_end = 0;
    long last_match_end = -1;
    while (re && last_end <= n) {
        int r = pcre2_match(re, (PCRE2_SPTR)s, n, last_end, PCRE2_NO_UTF_CHECK, e->md, e->mc);
        if (r == PCRE2_ERROR_NOMATCH) break;
        if (r < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(r, msg, sizeof msg);
            return mf_error(-EINVAL, "tokenizer %s: regex match failed: %s", e->t->path,
                            (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
        size_t a = ov[0], b = ov[1];
        if (a == b && (long)last_end == last_match_end) {
            if (last_end >= n) break;
            int len = mf_utf8_next((const unsigned char *)s + last_end, n - last_end);
            last_end += (size_t)(len > 0 ? len : 1);
            continue;
        }
        if (a != prev && ((rc = mf_spans_push(m, prev, a)) || (rc = mf_ids_push(flags, invert))))
            return rc;
        if ((rc = mf_spans_push(m, a, b)) || (rc = mf_ids_push(flags, !invert))) return rc;
        prev = b;
        last_end = b;
        last_match_end = (long)b;
    }
    if (prev != n && ((rc = mf_spans_push(m, prev, n)) || (rc = mf_ids_push(flags, invert))))
        return rc;
    return 0;
}

/* tokenizers' NormalizedString::split: turns (span, is_match) into the kept pieces. */
static int mf_split_piece(mf_enc *e, const mf_pretok *p, const char *buf, size_t a, size_t b,
                          mf_spans *out)
{
    mf_spans m = {0};
    mf_ids fl = {0};
    int rc = mf_find_matches(e, p->re, buf + a, b - a, p->invert, &m, &fl);
    mf_spans r = {0};
    int prev_match = 0;
    for (size_t i = 0; rc == 0 && i < m.n; i++) {
        size_t s = m.v[2 * i], t = m.v[2 * i + 1];
        int is = fl.v[i];
        switch (p->behavior) {
        case MF_SB_ISOLATED:
            rc = mf_spans_push(&r, s, t);
            break;
        case MF_SB_REMOVED:
            if (!is) rc = mf_spans_push(&r, s, t);
            break;
        case MF_SB_CONTIGUOUS:
            if (is == prev_match && r.n) r.v[2 * r.n - 1] = t;
            else rc = mf_spans_push(&r, s, t);
            break;
        case MF_SB_MERGED_PREV:
            if (is && !prev_match && r.n) r.v[2 * r.n - 1] = t;
            else rc = mf_spans_push(&r, s, t);
            break;
        case MF_SB_MERGED_NEXT:
            break;   /* below, walking backwards */
        }
        prev_match = is;
    }
    if (rc == 0 && p->behavior == MF_SB_MERGED_NEXT) {
        prev_match = 0;
        for (size_t i = m.n; rc == 0 && i-- > 0;) {
            size_t s = m.v[2 * i], t = m.v[2 * i + 1];
            int is = fl.v[i];
            if (is && !prev_match && r.n) r.v[2 * r.n - 2] = s;
            else rc = mf_spans_push(&r, s, t);
            prev_match = is;
        }
        for (size_t i = 0; rc == 0 && i < r.n / 2; i++) {
            size_t j = r.n - 1 - i, x0 = r.v[2 * i], x1 = r.v[2 * i + 1];
            r.v[2 * i] = r.v[2 * j];
            r.v[2 * i + 1] = r.v[2 * j + 1];
            r.v[2 * j] = x0;
            r.v[2 * j + 1] = x1;
        }
    }
    for (size_t i = 0; rc == 0 && i < r.n; i++)
        if (r.v[2 * i] != r.v[2 * i + 1]) rc = mf_spans_push(out, a + r.v[2 * i], a + r.v[2 * i + 1]);
    free(m.v);
    free(fl.v);
    free(r.v);
    return rc;
}

/* Pre-tokenizes and BPE-encodes one normalized text segment. */
static int mf_encode_text(mf_enc *e, const char *s, size_t n)
{
    const mf_tok *t = e->t;
    mf_bytes buf = {0};
    mf_spans sp = {0}, nsp = {0};
    int rc = mf_bytes_add(&buf, s, n);
    if (!rc && n) rc = mf_spans_push(&sp, 0, n);
    for (int k = 0; rc == 0 && k < t->n_pre; k++) {
        const mf_pretok *p = &t->pre[k];
        nsp.n = 0;
        if (p->kind == MF_PT_SPLIT) {
            for (size_t i = 0; rc == 0 && i < sp.n; i++)
                rc = mf_split_piece(e, p, buf.p, sp.v[2 * i], sp.v[2 * i + 1], &nsp);
        } else {
            /* ByteLevel: optional prefix space per piece, optional GPT-2 split, bytes -> chars */
            mf_bytes pre = {0}, nb = {0};
            for (size_t i = 0; rc == 0 && i < sp.n; i++) {
                size_t a = sp.v[2 * i], b = sp.v[2 * i + 1];
                pre.n = 0;
                if (p->add_prefix_space && buf.p[a] != ' ') rc = mf_bytes_add(&pre, " ", 1);
                if (!rc) rc = mf_bytes_add(&pre, buf.p + a, b - a);
                mf_spans parts = {0};
                if (!rc && p->use_regex) {
                    mf_pretok iso = {.kind = MF_PT_SPLIT, .re = t->gpt2_re,
                                     .behavior = MF_SB_ISOLATED};
                    rc = mf_split_piece(e, &iso, pre.p, 0, pre.n, &parts);
                } else if (!rc) {
                    rc = mf_spans_push(&parts, 0, pre.n);
                }
                for (size_t j = 0; rc == 0 && j < parts.n; j++) {
                    size_t start = nb.n;
                    for (size_t q = parts.v[2 * j]; rc == 0 && q < parts.v[2 * j + 1]; q++) {
                        char ch[4];
                        int32_t cp = mf_byte_char[(unsigned char)pre.p[q]];
                        int len = (int)utf8proc_encode_char(cp, (utf8proc_uint8_t *)ch);
                        rc = mf_bytes_add(&nb, ch, (size_t)len);
                    }
                    if (!rc) rc = mf_spans_push(&nsp, start, nb.n);
                }
                free(parts.v);
            }
            free(pre.p);
            free(buf.p);
            buf = nb;
        }
        mf_spans x = sp;
        sp = nsp;
        nsp = x;
    }
    for (size_t i = 0; rc == 0 && i < sp.n; i++)
        rc = mf_bpe(e, buf.p + sp.v[2 * i], sp.v[2 * i + 1] - sp.v[2 * i]);
    free(buf.p);
    free(sp.v);
    free(nsp.v);
    return rc;
}

/* tokenizers' AddedVocabulary::find_matches over s[0..n) with the added tokens whose
 * `normalized` flag is `normalized`; text between matches goes to `text_fn`. */
static int mf_encode_added(mf_enc *e, const char *s, size_t n, int normalized,
                           int (*text_fn)(mf_enc *, const char *, size_t))
{
    const mf_tok *t = e->t;
    size_t start_offset = 0, pos = 0;
    int rc;
    while (pos < n) {
        /* leftmost-longest: the first position where any token matches, longest there */
        const mf_added *hit = NULL;
        size_t at = pos;
        for (; at < n && !hit; at++) {
            unsigned char b0 = (unsigned char)s[at];
            for (int i = t->bucket[normalized][b0]; i < t->bucket[normalized][b0 + 1]; i++) {
                const mf_added *a = &t->add[t->by_first[i]];
                if (a->len > n - at) continue;
                if (memcmp(a->content, s + at, a->len) == 0) {
                    hit = a;   /* sorted longest first */
                    break;
                }
            }
        }
        if (!hit) break;
        size_t start = at - 1, stop = start + hit->len;
        pos = stop;   /* non-overlapping: the search resumes after this match */
        if (hit->single_word) {
            size_t ps;
            int len;
            int start_space = start == 0 || !mf_is_word_char(mf_utf8_last(s, start, &ps));
            int stop_space = stop == n || !mf_is_word_char(mf_utf8_first(s + stop, n - stop, &len));
            if (!start_space || !stop_space) continue;
        }
        if (hit->lstrip) {
            size_t ns = start, ps;
            while (ns > 0 && mf_is_white_space(mf_utf8_last(s, ns, &ps))) ns = ps;
            start = ns > start_offset ? ns : start_offset;
        }
        if (hit->rstrip) {
            int len;
            while (stop < n && mf_is_white_space(mf_utf8_first(s + stop, n - stop, &len)))
                stop += (size_t)len;
            pos = stop;
        }
        if (start_offset < start && (rc = text_fn(e, s + start_offset, start - start_offset)))
            return rc;
        if ((rc = mf_ids_push(&e->out, hit->id))) return rc;
        start_offset = stop;
    }
    if (start_offset < n) return text_fn(e, s + start_offset, n - start_offset);
    return 0;
}

static int mf_encode_normalized(mf_enc *e, const char *s, size_t n)
{
    return mf_encode_added(e, s, n, 1, mf_encode_text);
}

/* A piece between non-normalized added tokens: normalize, then look for normalized ones. */
static int mf_encode_raw_piece(mf_enc *e, const char *s, size_t n)
{
    if (!e->t->n_norm) return mf_encode_normalized(e, s, n);
    char *ns;
    size_t nn;
    int rc = mf_tok_normalize(e->t, s, n, &ns, &nn);
    if (rc) return rc;
    rc = mf_encode_normalized(e, ns, nn);
    free(ns);
    return rc;
}

int mf_tok_encode(const mf_tok *t, const char *text, size_t len, int32_t *ids, size_t cap,
                  size_t *n_ids)
{
    *n_ids = 0;
    for (size_t i = 0; i < len;) {
        int k = mf_utf8_next((const unsigned char *)text + i, len - i);
        if (k < 0)
            return mf_error(-EILSEQ, "tokenizer %s: input is not valid UTF-8 at byte %zu (0x%02x)",
                            t->path, i, (unsigned char)text[i]);
        i += (size_t)k;
    }
    mf_enc e = {.t = t};
    int rc = 0;
    e.md = pcre2_match_data_create(1, NULL);
    e.mc = pcre2_match_context_create(NULL);
    e.js = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, NULL);
    if (!e.md || !e.mc || !e.js) rc = mf_error(-ENOMEM, "tokenizer %s: out of memory", t->path);
    if (!rc) {
        pcre2_jit_stack_assign(e.mc, NULL, e.js);
        rc = mf_encode_added(&e, text, len, 0, mf_encode_raw_piece);
        if (rc == -ENOMEM) mf_error(rc, "tokenizer %s: out of memory while encoding", t->path);
    }
    if (!rc) {
        *n_ids = e.out.n;
        size_t m = e.out.n < cap ? e.out.n : cap;
        if (m) memcpy(ids, e.out.v, m * sizeof *ids);
        if (e.out.n > cap)
            rc = mf_error(-ENOSPC, "tokenizer: %zu ids do not fit in %zu", e.out.n, cap);
    }
    pcre2_match_data_free(e.md);
    pcre2_match_context_free(e.mc);
    pcre2_jit_stack_free(e.js);
    free(e.out.v);
    free(e.sym_id);
    free(e.sym_prev);
    free(e.sym_next);
    free(e.heap);
    return rc;
}

/* ---- decoding ------------------------------------------------------------------------------- */

/* The ByteLevel decoding of one token string into out[0..cap) (as much as fits); returns the
 * full length. A token with a character outside the byte alphabet stands for its own UTF-8. */
static size_t mf_token_decode(const char *p, size_t len, char *out, size_t cap)
{
    size_t n = 0;
    for (size_t q = 0; q < len;) {
        int k = mf_utf8_next((const unsigned char *)p + q, len - q);
        int32_t cp = k > 0 ? mf_utf8_decode1((const unsigned char *)p + q, k) : -1;
        if (cp < 0 || cp >= 324 || mf_char_byte[cp] < 0) {
            if (cap) memcpy(out, p, len < cap ? len : cap);
            return len;
        }
        if (n < cap) out[n] = (char)mf_char_byte[cp];
        n++;
        q += (size_t)k;
    }
    return n;
}

int mf_tok_token_bytes(const mf_tok *t, int32_t id, char *out, size_t cap)
{
    if (id < 0 || id >= t->n_vocab || !t->piece[id])
        return mf_error(-EINVAL, "tokenizer %s: id %d is not a token", t->path, id);
    const char *p = t->piece[id];
    size_t len = strlen(p);
    if (!t->decoder_bytelevel) {
        if (cap) memcpy(out, p, len < cap ? len : cap);
        return (int)len;
    }
    return (int)mf_token_decode(p, len, out, cap);
}

int mf_tok_decode(const mf_tok *t, const int32_t *ids, size_t n, int flags, char *out, size_t cap,
                  size_t *n_bytes)
{
    *n_bytes = 0;
    mf_bytes raw = {0}, txt = {0};
    int rc = 0;
    int first = 1;
    for (size_t i = 0; rc == 0 && i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_vocab || !t->piece[id]) {
            rc = mf_error(-EINVAL, "tokenizer %s: id %d at position %zu is not a token (vocabulary "
                          "of %d)", t->path, id, i, t->n_vocab);
            break;
        }
        if ((flags & MF_TOK_SKIP_SPECIAL) && t->special[id]) continue;
        const char *p = t->piece[id];
        size_t len = strlen(p);
        if (!t->decoder_bytelevel) {   /* no decoder: tokens joined by spaces */
            if (!first) rc = mf_bytes_add(&raw, " ", 1);
            if (!rc) rc = mf_bytes_add(&raw, p, len);
            first = 0;
            continue;
        }
        /* all characters in the byte alphabet -> those bytes; otherwise the token as it is */
        if ((rc = mf_bytes_reserve(&raw, len)) == 0)   /* the bytes never outnumber the string's */
            raw.n += mf_token_decode(p, len, raw.p + raw.n, len);
    }
    /* lossy UTF-8: each maximal ill-formed subpart becomes U+FFFD */
    for (size_t i = 0; rc == 0 && i < raw.n;) {
        int k = mf_utf8_next((const unsigned char *)raw.p + i, raw.n - i);
        if (k > 0) {
            rc = mf_bytes_add(&txt, raw.p + i, (size_t)k);
            i += (size_t)k;
        } else {
            rc = mf_bytes_add(&txt, "\xEF\xBF\xBD", 3);
            i += (size_t)-k;
        }
    }
    if (rc == -ENOMEM) mf_error(rc, "tokenizer %s: out of memory while decoding", t->path);
    if (rc == 0) {
        *n_bytes = txt.n;
        size_t m = txt.n < cap ? txt.n : cap;
        if (m) memcpy(out, txt.p, m);
        if (txt.n < cap) out[txt.n] = '\0';
        else rc = mf_error(-ENOSPC, "tokenizer: %zu bytes and a NUL do not fit in %zu", txt.n, cap);
    }
    free(raw.p);
    free(txt.p);
    return rc;
}
