/* Decoding ids back to text (host/tokenizer.h): each token's ByteLevel characters mapped back to
 * bytes (added tokens by content, specials optionally left out), then made valid UTF-8 with
 * U+FFFD for each maximal ill-formed subpart, as the `tokenizers` library decodes. */
#include "host/tok_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "sched/error.h"

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
