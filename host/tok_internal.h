/* Shared internals of the tokenizer (host/tokenizer.h), which is cut into tok_load.c (reading
 * tokenizer.json into the tables below), tok_encode.c (added tokens, normalizers, pre-tokenizers,
 * BPE), tok_decode.c (ids back to text) and tok_common.c (hash maps, growable arrays, UTF-8, the
 * byte-level alphabet; the merge lookup and UTF-8 stepping that BPE runs per character are inline
 * here). Not a public header: nothing outside host/tok_*.c includes it. */
#ifndef MF_TOK_INTERNAL_H
#define MF_TOK_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>
#include <utf8proc.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "host/tokenizer.h"

/* ---- small containers (tok_common.c) ---------------------------------------------------------- */

/* String -> id, open addressing over (pointer, length) keys that live elsewhere. */
typedef struct mf_strmap {
    const char **key;
    uint32_t *klen;
    int32_t *val;
    size_t cap;   /* power of two */
    size_t n;
} mf_strmap;

/* Sized for n_expected keys (puts beyond that are not allowed); 0 or -ENOMEM. */
int mf_strmap_init(mf_strmap *m, size_t n_expected);
void mf_strmap_free(mf_strmap *m);
/* The value of s[0..n), or -1. */
int32_t mf_strmap_get(const mf_strmap *m, const char *s, size_t n);
/* Inserts (the table was sized for every key); returns the previous value or -1. */
int32_t mf_strmap_put(mf_strmap *m, const char *s, size_t n, int32_t v);

/* (left id, right id) -> (rank, merged id). */
typedef struct mf_mergemap {
    uint64_t *key;   /* UINT64_MAX: empty */
    int32_t *rank, *new_id;
    size_t cap;
} mf_mergemap;

/* The slot of key k, (left id << 32) | right id: found or the empty one where it would go. */
static inline size_t mf_merge_slot(const mf_mergemap *m, uint64_t k)
{
    /* the product's top bits (Fibonacci hashing): its bits below 32 see only the right id, so
     * slots taken from them cluster by right id and the probes run long */
    uint64_t h = k * 0x9E3779B97F4A7C15ull;
    size_t i = (size_t)(h >> (64 - __builtin_ctzll((unsigned long long)m->cap))) & (m->cap - 1);
    while (m->key[i] != UINT64_MAX && m->key[i] != k) i = (i + 1) & (m->cap - 1);
    return i;
}

/* 1 and the pair's rank and merged id when (a, b) merges, else 0. */
static inline int mf_merge_lookup(const mf_mergemap *m, int32_t a, int32_t b, int32_t *rank,
                                  int32_t *id)
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

int mf_ids_push(mf_ids *a, int32_t x);

typedef struct mf_bytes {
    char *p;
    size_t n, cap;
} mf_bytes;

/* Room for n more bytes and a NUL; 0 or -ENOMEM. */
int mf_bytes_reserve(mf_bytes *b, size_t n);
/* Appends src[0..n) and a NUL (not counted); 0 or -ENOMEM. */
int mf_bytes_add(mf_bytes *b, const void *src, size_t n);

/* Spans [start, end) over some buffer. */
typedef struct mf_spans {
    size_t *v;   /* pairs */
    size_t n, cap;
} mf_spans;

int mf_spans_push(mf_spans *s, size_t a, size_t b);

/* ---- UTF-8 and the byte-level alphabet (tok_common.c) ----------------------------------------- */

/* Length of the well-formed UTF-8 sequence at s[0..n), or -(k) when the first k >= 1 bytes are
 * the maximal ill-formed subpart (Unicode's "U+FFFD substitution of maximal subparts", the rule
 * of Rust's from_utf8_lossy and Python's errors="replace"). */
static inline int mf_utf8_next(const unsigned char *s, size_t n)
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

/* The code point of the well-formed len-byte sequence at s. */
static inline int32_t mf_utf8_decode1(const unsigned char *s, int len)
{
    if (len == 1) return s[0];
    int32_t cp = s[0] & (0x7F >> len);
    for (int k = 1; k < len; k++) cp = (cp << 6) | (s[k] & 0x3F);
    return cp;
}

/* GPT-2's printable stand-in for each byte, and its inverse (-1 where no byte); filled by
 * mf_bytelevel_init (once, thread-safe), which mf_tok_load calls. */
extern int32_t mf_byte_char[256];
extern int16_t mf_char_byte[324];
void mf_bytelevel_init(void);

/* ---- the tokenizer (tok_load.c) --------------------------------------------------------------- */

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

/* ---- encoding (tok_encode.c) ------------------------------------------------------------------ */

/* Applies t's normalizers to s[0..n); *out is malloc'd (NUL-terminated), *out_n its length. 0,
 * -ENOMEM or -EILSEQ. */
int mf_tok_normalize(const mf_tok *t, const char *s, size_t n, char **out, size_t *out_n);

#endif
