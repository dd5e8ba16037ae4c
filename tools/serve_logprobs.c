/* Logprobs objects of `moeflow serve` (tools/serve_logprobs.h). */
#include "tools/serve_logprobs.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "host/tokenizer.h"

int mf_lp_add(mf_lp_list *l, int32_t tok, int has, float lp, const mf_logprob *top, int n_top)
{
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 32;
        mf_lp_entry *e = realloc(l->e, sizeof *e * (size_t)cap);
        if (!e) return -ENOMEM;
        l->e = e;
        l->cap = cap;
    }
    mf_lp_entry *e = &l->e[l->n++];
    e->tok = tok;
    e->has = (uint8_t)(has != 0);
    e->lp = lp;
    e->n_top = (uint8_t)(has && top ? (n_top < MF_SERVE_MAX_LOGPROBS ? n_top : MF_SERVE_MAX_LOGPROBS) : 0);
    if (e->n_top) memcpy(e->top, top, sizeof *top * e->n_top);
    return 0;
}

void mf_lp_free(mf_lp_list *l)
{
    free(l->e);
    memset(l, 0, sizeof *l);
}

/* A token's raw bytes (no tokenizer or an unknown id: none). */
static int mf_lp_bytes(const mf_tok *tok, int32_t id, char *buf, size_t cap)
{
    int k = tok ? mf_tok_token_bytes(tok, id, buf, cap) : -1;
    return k < 0 ? 0 : (size_t)k > cap ? (int)cap : k;
}

/* The token's text (ill-formed UTF-8 as U+FFFD); *n_chars its characters. */
static json_t *mf_lp_text(const mf_tok *tok, int32_t id, int64_t *n_chars)
{
    char b[512], u[3 * 512 + 1];
    int k = mf_lp_bytes(tok, id, b, sizeof b);
    size_t m = mf_utf8_lossy(b, (size_t)k, u);
    if (n_chars) {
        *n_chars = 0;
        for (size_t i = 0; i < m; i++) *n_chars += ((unsigned char)u[i] & 0xC0) != 0x80;
    }
    return json_stringn(u, m);
}

static json_t *mf_lp_num(float v) { return isfinite(v) ? json_real(v) : json_real(-9999.0); }

static json_t *mf_lp_chat_one(const mf_tok *tok, int32_t id, float lp)
{
    char b[512];
    int k = mf_lp_bytes(tok, id, b, sizeof b);
    json_t *bytes = json_array();
    for (int i = 0; i < k; i++) json_array_append_new(bytes, json_integer((unsigned char)b[i]));
    return json_pack("{s:o, s:o, s:o}", "token", mf_lp_text(tok, id, NULL), "logprob", mf_lp_num(lp), "bytes", bytes);
}

json_t *mf_lp_chat(const mf_tok *tok, const mf_lp_entry *e, int n)
{
    json_t *content = json_array();
    for (int i = 0; i < n; i++) {
        if (!e[i].has) continue;
        json_t *o = mf_lp_chat_one(tok, e[i].tok, e[i].lp), *top = json_array();
        for (int k = 0; k < e[i].n_top; k++) json_array_append_new(top, mf_lp_chat_one(tok, e[i].top[k].id, e[i].top[k].logprob));
        json_object_set_new(o, "top_logprobs", top);
        json_array_append_new(content, o);
    }
    return json_pack("{s:o}", "content", content);
}

json_t *mf_lp_completion(const mf_tok *tok, const mf_lp_entry *e, int n, int64_t *offset)
{
    json_t *toks = json_array(), *lps = json_array(), *tops = json_array(), *offs = json_array();
    for (int i = 0; i < n; i++) {
        int64_t chars = 0;
        json_array_append_new(toks, mf_lp_text(tok, e[i].tok, &chars));
        json_array_append_new(offs, json_integer(*offset));
        *offset += chars;
        if (!e[i].has) {
            json_array_append_new(lps, json_null());
            json_array_append_new(tops, json_null());
            continue;
        }
        json_array_append_new(lps, mf_lp_num(e[i].lp));
        json_t *d = json_object();
        for (int k = 0; k < e[i].n_top; k++) {
            json_t *key = mf_lp_text(tok, e[i].top[k].id, NULL);
            if (!json_object_get(d, json_string_value(key)))
                json_object_set_new(d, json_string_value(key), mf_lp_num(e[i].top[k].logprob));
            json_decref(key);
        }
        json_t *key = mf_lp_text(tok, e[i].tok, NULL);
        json_object_set_new(d, json_string_value(key), mf_lp_num(e[i].lp));
        json_decref(key);
        json_array_append_new(tops, d);
    }
    return json_pack("{s:o, s:o, s:o, s:o}", "tokens", toks, "token_logprobs", lps, "top_logprobs", tops, "text_offset", offs);
}
