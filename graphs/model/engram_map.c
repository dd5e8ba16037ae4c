/* The Engram compressed-vocabulary map (see engram_map.h): the reference's normalizer written
 * with utf8proc, and the first-appearance numbering of keys over the vocabulary. */
#define _GNU_SOURCE   /* memmem */
#include "graphs/model/engram_map.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "sched/error.h"

struct mf_engram_map {
    int n_vocab, n_unique;
    int32_t *ids;
    char **keys;   /* by compressed id; may hold NUL bytes (the text of byte 0 is U+0000) */
    size_t *key_len;
};

#define MF_SENTINEL 0xE000

static int mf_is_white_space(int32_t cp)   /* Unicode White_Space, Rust's char::is_whitespace */
{
    if ((cp >= 9 && cp <= 13) || cp == 0x85) return 1;
    utf8proc_category_t c = utf8proc_category(cp);
    return c == UTF8PROC_CATEGORY_ZS || c == UTF8PROC_CATEGORY_ZL || c == UTF8PROC_CATEGORY_ZP;
}

int mf_engram_normalize(const char *s, size_t n, char **out, size_t *out_n)
{
    *out = NULL;
    *out_n = 0;
    utf8proc_int32_t *cps = NULL;
    utf8proc_ssize_t m = 0;
    if (n) {
        /* NFKC, then NFD (the second pass sees the composed NFKC result, as the reference) */
        utf8proc_uint8_t *nfkc = NULL;
        m = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &nfkc,
                         UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
        if (m < 0) goto bad;
        size_t nk = (size_t)m;
        cps = malloc((nk + 1) * 4 * sizeof *cps);   /* NFD of UTF-8 bytes: at most 4 per byte */
        if (!cps) {
            free(nfkc);
            return mf_error(-ENOMEM, "engram normalize: out of memory");
        }
        m = nk ? utf8proc_decompose(nfkc, (utf8proc_ssize_t)nk, cps, (utf8proc_ssize_t)(nk + 1) * 4,
                                    UTF8PROC_STABLE | UTF8PROC_DECOMPOSE) : 0;
        free(nfkc);
        if (m < 0) goto bad;
    }
    /* strip marks, lowercase, collapse [ \t\r\n]+ to one space (in place: it only shrinks) */
    size_t k = 0;
    int in_run = 0;
    for (utf8proc_ssize_t i = 0; i < m; i++) {
        int32_t c = cps[i];
        utf8proc_category_t cat = utf8proc_category(c);
        if (cat == UTF8PROC_CATEGORY_MN || cat == UTF8PROC_CATEGORY_MC || cat == UTF8PROC_CATEGORY_ME)
            continue;
        c = utf8proc_tolower(c);
        int ws = c == ' ' || c == '\t' || c == '\r' || c == '\n';
        if (ws && in_run) continue;
        in_run = ws;
        cps[k++] = ws ? ' ' : c;
    }
    /* "^ $" -> sentinel, so that Strip keeps a lone space */
    if (k == 1 && cps[0] == ' ') cps[0] = MF_SENTINEL;
    size_t a = 0, b = k;
    while (a < b && mf_is_white_space(cps[a])) a++;
    while (b > a && mf_is_white_space(cps[b - 1])) b--;
    char *o = malloc(4 * (b - a) + 1);
    if (!o) {
        free(cps);
        return mf_error(-ENOMEM, "engram normalize: out of memory");
    }
    size_t len = 0;
    for (size_t i = a; i < b; i++)
        len += (size_t)utf8proc_encode_char(cps[i] == MF_SENTINEL ? ' ' : cps[i],
                                            (utf8proc_uint8_t *)o + len);
    o[len] = '\0';
    free(cps);
    *out = o;
    *out_n = len;
    return 0;
bad:
    free(cps);
    return mf_error(m == UTF8PROC_ERROR_NOMEM ? -ENOMEM : -EILSEQ, "engram normalize: %s",
                    utf8proc_errmsg(m));
}

/* key -> compressed id, open addressing over the owned key strings */
typedef struct mf_keyset {
    int32_t *slot;   /* -1 empty, else compressed id */
    size_t cap;
} mf_keyset;

static uint64_t mf_key_hash(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h ^ (h >> 31);
}

void mf_engram_map_free(mf_engram_map *m)
{
    if (!m) return;
    for (int i = 0; i < m->n_unique; i++) free(m->keys[i]);
    free(m->keys);
    free(m->key_len);
    free(m->ids);
    free(m);
}

int mf_engram_map_build(const mf_tok *tok, mf_engram_map **out)
{
    *out = NULL;
    int n = mf_tok_n_vocab(tok);
    mf_engram_map *m = calloc(1, sizeof *m);
    mf_keyset ks = {0};
    ks.cap = 16;
    while (ks.cap < 2 * (size_t)n + 1) ks.cap <<= 1;
    size_t dcap = 256;
    char *dec = malloc(dcap);
    if (m) {
        m->ids = malloc((size_t)(n ? n : 1) * sizeof *m->ids);
        m->keys = calloc((size_t)(n ? n : 1), sizeof *m->keys);
        m->key_len = calloc((size_t)(n ? n : 1), sizeof *m->key_len);
    }
    ks.slot = malloc(ks.cap * sizeof *ks.slot);
    int rc = 0;
    if (!m || !m->ids || !m->keys || !m->key_len || !ks.slot || !dec) {
        rc = mf_error(-ENOMEM, "engram map: out of memory");
        goto done;
    }
    m->n_vocab = n;
    memset(ks.slot, 0xFF, ks.cap * sizeof *ks.slot);
    for (int32_t id = 0; id < n; id++) {
        size_t dn = 0;
        const char *piece = mf_tok_piece(tok, id);
        if (piece) {
            rc = mf_tok_decode(tok, &id, 1, 0, dec, dcap, &dn);
            if (rc == -ENOSPC) {
                dcap = 2 * dn + 1;
                char *p = realloc(dec, dcap);
                if (!p) {
                    rc = mf_error(-ENOMEM, "engram map: out of memory");
                    goto done;
                }
                dec = p;
                rc = mf_tok_decode(tok, &id, 1, 0, dec, dcap, &dn);
            }
            if (rc) {
                rc = mf_error_wrap(rc, "engram map: decoding id %d", id);
                goto done;
            }
        } else {
            dec[0] = '\0';
        }
        char *key;
        size_t kn;
        if (memmem(dec, dn, "\xEF\xBF\xBD", 3)) {
            key = strdup(piece);
            kn = strlen(piece);
            if (!key) {
                rc = mf_error(-ENOMEM, "engram map: out of memory");
                goto done;
            }
        } else {
            if ((rc = mf_engram_normalize(dec, dn, &key, &kn))) {
                rc = mf_error_wrap(rc, "engram map: id %d", id);
                goto done;
            }
            if (kn == 0) {
                free(key);
                kn = dn;
                if (!(key = malloc(dn + 1))) {
                    rc = mf_error(-ENOMEM, "engram map: out of memory");
                    goto done;
                }
                memcpy(key, dec, dn + 1);
            }
        }
        size_t s = mf_key_hash(key, kn) & (ks.cap - 1);
        while (ks.slot[s] >= 0 && !(m->key_len[ks.slot[s]] == kn &&
                                    memcmp(m->keys[ks.slot[s]], key, kn) == 0))
            s = (s + 1) & (ks.cap - 1);
        if (ks.slot[s] >= 0) {
            m->ids[id] = ks.slot[s];
            free(key);
        } else {
            ks.slot[s] = m->n_unique;
            m->keys[m->n_unique] = key;
            m->key_len[m->n_unique] = kn;
            m->ids[id] = m->n_unique++;
        }
    }
done:
    free(dec);
    free(ks.slot);
    if (rc) {
        mf_engram_map_free(m);
        return rc;
    }
    *out = m;
    return 0;
}

int mf_engram_map_n_vocab(const mf_engram_map *m) { return m->n_vocab; }
int mf_engram_map_n_unique(const mf_engram_map *m) { return m->n_unique; }
const int32_t *mf_engram_map_ids(const mf_engram_map *m) { return m->ids; }

const char *mf_engram_map_key(const mf_engram_map *m, int32_t c, size_t *len)
{
    if (c < 0 || c >= m->n_unique) return NULL;
    *len = m->key_len[c];
    return m->keys[c];
}
