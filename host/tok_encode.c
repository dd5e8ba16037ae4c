/* Encoding with a loaded tokenizer (host/tokenizer.h), step by step as the `tokenizers` library
 * does: added tokens split out (leftmost-longest; single_word, lstrip, rstrip), the normalizers,
 * the pre-tokenizers (PCRE2 regex splits with tokenizers' split behaviours, ByteLevel), then BPE
 * merges by rank with a min-heap over a linked word. The tables it reads are built by tok_load.c. */
#include "host/tok_internal.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "sched/error.h"

/* Applies the normalizers to s[0..n); *out is malloc'd (NUL-terminated), *out_n its length. */
int mf_tok_normalize(const mf_tok *t, const char *s, size_t n, char **out, size_t *out_n)
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
