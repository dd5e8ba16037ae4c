/* Reading a Hugging Face tokenizer.json into an mf_tok (host/tokenizer.h): the BPE model (vocab,
 * merges in either form), normalizers (utf8proc options), pre-tokenizers (PCRE2 regexes compiled
 * here), added tokens and the id tables built from them, each field validated with a message that
 * names it; mf_tok_free and the lookups by id and by string. Encoding is tok_encode.c. */
#include "host/tok_internal.h"
#include "host/json_kind.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/error.h"

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
