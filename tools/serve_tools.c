/* DeepSeek-V4 DSML tool calls for `moeflow serve` (tools/serve_tools.h): parsing a finished answer,
 * the streamed text's content so far, and the grammar of a forced call. */
#include "tools/serve_tools.h"

#include <errno.h>
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "host/grammar.h"
#include "sched/error.h"

int mf_serve_tool_name_ok(const char *name)
{
    size_t n = strlen(name);
    if (n < 1 || n > 64) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-' ||
              c == '.'))
            return 0;
    }
    return 1;
}

void mf_tool_calls_clear(mf_tool_calls *c)
{
    free(c->content);
    for (int i = 0; i < c->n; i++) {
        free(c->calls[i].name);
        free(c->calls[i].args);
    }
    free(c->calls);
    memset(c, 0, sizeof *c);
}

static const char *mf_find(const char *s, const char *end, const char *pat)
{
    size_t k = strlen(pat);
    for (const char *p = s; p + k <= end; p++)
        if (!memcmp(p, pat, k)) return p;
    return NULL;
}

/* Expects literal pat at *p (advanced past it). */
static int mf_eat(const char **p, const char *end, const char *pat)
{
    size_t k = strlen(pat);
    if ((size_t)(end - *p) < k || memcmp(*p, pat, k)) return 0;
    *p += k;
    return 1;
}

/* One parameter after MF_DSML_PARAM: KEY" string="true|false">VALUE</...parameter>, added to args. */
static int mf_parse_param(const char **p, const char *end, json_t *args)
{
    const char *q = mf_find(*p, end, "\" string=\"");
    if (!q || q == *p) return -EINVAL;
    char key[256];
    if ((size_t)(q - *p) >= sizeof key) return -EINVAL;
    memcpy(key, *p, (size_t)(q - *p));
    key[q - *p] = 0;
    *p = q + 10;
    int str = mf_eat(p, end, "true\">");
    if (!str && !mf_eat(p, end, "false\">")) return -EINVAL;
    const char *v = *p, *ve = mf_find(v, end, MF_DSML_PARAM_CLOSE);
    if (!ve || json_object_get(args, key)) return -EINVAL;   /* unterminated, or a duplicate */
    json_t *val = str ? json_stringn(v, (size_t)(ve - v)) : json_loadb(v, (size_t)(ve - v), JSON_DECODE_ANY, NULL);
    if (!val) return -EINVAL;
    json_object_set_new(args, key, val);
    *p = ve + strlen(MF_DSML_PARAM_CLOSE);
    return 0;
}

/* One invoke after MF_DSML_INVOKE: NAME">\n (params joined by \n) \n</...invoke>. */
static int mf_parse_invoke(const mf_serve_req *r, const char **p, const char *end, mf_tool_call *c)
{
    const char *q = mf_find(*p, end, "\">\n");
    if (!q) return -EINVAL;
    size_t nl = (size_t)(q - *p);
    int known = 0;
    for (int i = 0; i < r->n_tools && !known; i++) known = strlen(r->tool_names[i]) == nl && !memcmp(r->tool_names[i], *p, nl);
    if (!known) return -EINVAL;
    if (!(c->name = strndup(*p, nl))) return -ENOMEM;
    *p = q + 3;
    json_t *args = json_object();
    if (!args) return -ENOMEM;
    int rc = 0;
    while (!rc && mf_eat(p, end, MF_DSML_PARAM)) {
        rc = mf_parse_param(p, end, args);
        if (!rc && !mf_eat(p, end, "\n")) rc = -EINVAL;
    }
    if (!rc && !mf_eat(p, end, MF_DSML_INVOKE_CLOSE)) {
        if (!mf_eat(p, end, "\n") || !mf_eat(p, end, MF_DSML_INVOKE_CLOSE)) rc = -EINVAL;   /* no parameters: "\n\n" */
    }
    if (!rc && !(c->args = json_dumps(args, JSON_COMPACT))) rc = -ENOMEM;
    json_decref(args);
    return rc;
}

int mf_serve_tools_parse(const mf_serve_req *r, const char *text, size_t n, mf_tool_calls *out)
{
    memset(out, 0, sizeof *out);
    const char *end = text + n, *open = mf_find(text, end, MF_DSML_CALLS_OPEN);
    if (!open) return 0;
    const char *p = open + strlen(MF_DSML_CALLS_OPEN);
    int rc = mf_eat(&p, end, "\n") ? 0 : -EINVAL;
    while (!rc && mf_eat(&p, end, MF_DSML_INVOKE)) {
        mf_tool_call *c = realloc(out->calls, sizeof *c * (size_t)(out->n + 1));
        if (!c) {
            rc = -ENOMEM;
            break;
        }
        out->calls = c;
        c = &out->calls[out->n++];
        memset(c, 0, sizeof *c);
        if (!(rc = mf_parse_invoke(r, &p, end, c)) && !mf_eat(&p, end, "\n")) rc = -EINVAL;
    }
    if (!rc && (!out->n || !mf_eat(&p, end, MF_DSML_CALLS_CLOSE))) rc = -EINVAL;
    while (!rc && p < end && (*p == ' ' || *p == '\n')) p++;
    if (!rc && p != end) rc = -EINVAL;   /* text after the calls */
    if (!rc) {
        out->n_content = (size_t)(open - text);
        if (!(out->content = strndup(text, out->n_content))) rc = -ENOMEM;
    }
    if (rc) mf_tool_calls_clear(out);
    return rc ? rc : 1;
}

size_t mf_serve_tools_content_len(const char *text, size_t n)
{
    const char *open = mf_find(text, text + n, MF_DSML_CALLS_OPEN);
    if (open) return (size_t)(open - text);
    size_t k = strlen(MF_DSML_CALLS_OPEN);
    for (size_t hold = k - 1; hold > 0; hold--)   /* the longest tail that begins the opening */
        if (hold <= n && !memcmp(text + n - hold, MF_DSML_CALLS_OPEN, hold)) return n - hold;
    return n;
}

/* ---- the grammar of a forced call ---------------------------------------------------------------- */

/* A string enum parameter: key + '" string="true">' then one of the values, raw, and the close. */
static int mf_param_enum(mf_gram_b *b, const char *key, size_t kl, json_t *vals, char **keys, size_t *lens, int *conts,
                         int *n)
{
    size_t nv = json_is_array(vals) ? json_array_size(vals) : 1;
    char **vk = calloc(nv, sizeof *vk);
    size_t *vl = calloc(nv, sizeof *vl), m = 0;
    int rc = vk && vl ? 0 : -ENOMEM;
    for (size_t i = 0; i < nv && !rc; i++) {
        json_t *v = json_is_array(vals) ? json_array_get(vals, i) : vals;
        size_t l = json_string_length(v), cl = strlen(MF_DSML_PARAM_CLOSE);
        int dup = 0;
        for (size_t j = 0; j < m && !dup; j++) dup = vl[j] == l + cl && !memcmp(vk[j], json_string_value(v), l);
        if (dup) continue;
        if (!(vk[m] = malloc(l + cl))) rc = -ENOMEM;
        else memcpy(vk[m], json_string_value(v), l), memcpy(vk[m] + l, MF_DSML_PARAM_CLOSE, cl), vl[m++] = l + cl;
    }
    const char *suf = "\" string=\"true\">";
    size_t sl = strlen(suf);
    if (!rc && !(keys[*n] = malloc(kl + sl))) rc = -ENOMEM;
    if (!rc) {
        memcpy(keys[*n], key, kl);
        memcpy(keys[*n] + kl, suf, sl);
        lens[*n] = kl + sl;
        conts[*n] = mf_gram_switch(b, (const char *const *)vk, vl, NULL, (int)m);
        if (conts[*n] < 0) rc = conts[*n], free(keys[*n]);
        else (*n)++;
    }
    for (size_t i = 0; i < m; i++) free(vk[i]);
    free(vk);
    free(vl);
    return rc;
}

/* The value of a parameter whose schema is s (JSON text): key suffixes and their continuations. A
 * string-typed one is raw text (string="true"), a typed one JSON ("false"), an untyped one either. */
static int mf_param_value(mf_gram_b *b, const char *key, size_t kl, json_t *s, char **keys, size_t *lens, int *conts,
                          int *n)
{
    json_t *t = json_object_get(s, "type"), *en = json_object_get(s, "enum"), *cn = json_object_get(s, "const");
    int all_str = en || cn;   /* an enum (const) of strings: one of them as raw text */
    for (size_t i = 0; en && i < json_array_size(en); i++) all_str &= json_is_string(json_array_get(en, i));
    if (cn) all_str &= json_is_string(cn);
    if (all_str) return mf_param_enum(b, key, kl, en ? en : cn, keys, lens, conts, n);
    int str = !t || (json_is_string(t) && !strcmp(json_string_value(t), "string"));
    int js = !(json_is_string(t) && !strcmp(json_string_value(t), "string"));
    for (int v = 0; v < 2; v++) {
        if (v == 0 ? !str : !js) continue;
        const char *suf = v == 0 ? "\" string=\"true\">" : "\" string=\"false\">";
        size_t sl = strlen(suf);
        if (!(keys[*n] = malloc(kl + sl))) return -ENOMEM;
        memcpy(keys[*n], key, kl);
        memcpy(keys[*n] + kl, suf, sl);
        lens[*n] = kl + sl;
        if (v == 0) {
            conts[*n] = mf_gram_until(b, MF_DSML_PARAM_CLOSE, strlen(MF_DSML_PARAM_CLOSE));
        } else {
            char *txt = json_dumps(s, JSON_COMPACT | JSON_ENCODE_ANY);
            int val = txt ? mf_gram_json_schema(b, txt, strlen(txt)) : -ENOMEM;
            free(txt);
            conts[*n] = mf_gram_seq(b, (int[]){val, mf_gram_lit(b, MF_DSML_PARAM_CLOSE, strlen(MF_DSML_PARAM_CLOSE))}, 2);
        }
        if (conts[*n] < 0) return free(keys[*n]), conts[*n];
        (*n)++;
    }
    return 0;
}

/* Parameters in their schema's order, each at most once, none required skipped: after[i] is what may
 * follow once the parameters before i are settled ("<" then a parameter j >= i up to the first
 * required one, or the close when none is left). keys k of property pk[k] have values val[k]. */
static int mf_invoke_ordered(mf_gram_b *b, int np, const int *pk, char **keys, const size_t *lens, const int *val, int nk,
                             const uint8_t *req)
{
    const char *pre = &MF_DSML_PARAM[1];   /* the keys of a switch after '<' */
    size_t pl = strlen(pre);
    int *after = malloc(sizeof *after * (size_t)(np + 1)), *cont = malloc(sizeof *cont * (size_t)(nk + 1));
    char **fk = calloc((size_t)nk + 1, sizeof *fk);
    size_t *fl = calloc((size_t)nk + 1, sizeof *fl);
    int *fc = calloc((size_t)nk + 1, sizeof *fc), rc = after && cont && fk && fl && fc ? 0 : -ENOMEM;
    for (int k = 0; k < nk && !rc; k++) {
        if (!(fk[k] = malloc(pl + lens[k]))) rc = -ENOMEM;
        else memcpy(fk[k], pre, pl), memcpy(fk[k] + pl, keys[k], lens[k]), fl[k] = pl + lens[k];
    }
    char *close = (char *)(&MF_DSML_INVOKE_CLOSE[1]);
    for (int i = np; i >= 0 && !rc; i--) {
        for (int k = 0; k < nk; k++)   /* keys of property i go on after it */
            if (pk[k] == i) cont[k] = mf_gram_seq(b, (int[]){val[k], mf_gram_lit(b, "\n", 1), after[i + 1]}, 3);
        int m = 0, stop = 0;
        char *sk[2 * MF_GRAM_MAX_PROPS + 1];
        size_t sl[2 * MF_GRAM_MAX_PROPS + 1];
        int sc[2 * MF_GRAM_MAX_PROPS + 1];
        for (int j = i; j < np && !stop; j++) {
            for (int k = 0; k < nk; k++)
                if (pk[k] == j) sk[m] = fk[k], sl[m] = fl[k], sc[m++] = cont[k];
            stop = req[j];
        }
        if (!stop) sk[m] = close, sl[m] = strlen(close), sc[m++] = -1;
        after[i] = mf_gram_seq(b, (int[]){mf_gram_lit(b, "<", 1), mf_gram_switch(b, (const char *const *)sk, sl, sc, m)}, 2);
        if (after[i] < 0) rc = after[i];
    }
    int start = rc ? rc : after[0];
    int any_req = 0;
    for (int j = 0; j < np; j++) any_req |= req[j];
    if (!rc && !any_req)   /* no parameters at all: "\n" before the close, as the encoding writes it */
        start = mf_gram_choice(b, (int[]){after[0], mf_gram_lit(b, "\n" MF_DSML_INVOKE_CLOSE, 1 + strlen(MF_DSML_INVOKE_CLOSE))}, 2);
    for (int k = 0; k < nk; k++) free(fk[k]);
    free(fk);
    free(fl);
    free(fc);
    free(after);
    free(cont);
    return rc ? rc : start;
}

/* An invoke's parameters and its close, after 'NAME">\n'. With properties: mf_invoke_ordered.
 * Without: any names, values raw or JSON, in a loop. */
static int mf_invoke_body(mf_gram_b *b, const char *params)
{
    json_t *p = json_loads(params, 0, NULL), *props = json_object_get(p, "properties"), *rq = json_object_get(p, "required");
    int body = -1, rc = 0, n = 0, np = 0;
    size_t cap = 2 * json_object_size(props) + 2;
    char **keys = calloc(cap, sizeof *keys);
    size_t *lens = calloc(cap, sizeof *lens);
    int *conts = calloc(cap, sizeof *conts), *pk = calloc(cap, sizeof *pk);
    uint8_t req[MF_GRAM_MAX_PROPS] = {0};
    if (!p || !keys || !lens || !conts || !pk) rc = -ENOMEM;
    if (!rc && json_object_size(props) > MF_GRAM_MAX_PROPS)
        rc = mf_error(-E2BIG, "%zu parameters (at most %d)", json_object_size(props), MF_GRAM_MAX_PROPS);
    const char *k;
    json_t *v;
    if (!rc && json_is_object(props)) {
        json_object_foreach(props, k, v) {
            int n0 = n;
            if ((rc = mf_param_value(b, k, strlen(k), v, keys, lens, conts, &n))) break;
            for (int i = n0; i < n; i++) pk[i] = np;
            for (size_t i = 0; i < json_array_size(rq); i++)
                if (json_is_string(json_array_get(rq, i)) && !strcmp(json_string_value(json_array_get(rq, i)), k)) req[np] = 1;
            np++;
        }
        if (!rc) body = mf_invoke_ordered(b, np, pk, keys, lens, conts, n, req);
    } else if (!rc) {   /* no properties: any names, values raw or JSON */
        json_t *any = json_object();
        rc = any ? mf_param_value(b, "", 0, any, keys, lens, conts, &n) : -ENOMEM;
        json_decref(any);
        /* the name is free text up to its '"', then the same choice of value kinds */
        for (int i = 0; !rc && i < n; i++) memmove(keys[i], keys[i] + 1, --lens[i]);   /* drop the leading quote */
        int name = mf_gram_until(b, "\"", 1);
        int one = mf_gram_seq(b, (int[]){mf_gram_lit(b, &MF_DSML_PARAM[1], strlen(MF_DSML_PARAM) - 1), name,
                                         mf_gram_switch(b, (const char *const *)keys, lens, conts, n), mf_gram_lit(b, "\n<", 2)}, 4);
        int close = mf_gram_lit(b, &MF_DSML_INVOKE_CLOSE[1], strlen(MF_DSML_INVOKE_CLOSE) - 1);
        body = mf_gram_seq(b, (int[]){mf_gram_lit(b, "<", 1), mf_gram_loop(b, one, close)}, 2);
    }
    for (int i = 0; i < n; i++) free(keys[i]);
    free(keys);
    free(lens);
    free(conts);
    free(pk);
    json_decref(p);
    return rc ? rc : body;
}

int mf_serve_tools_grammar(const mf_serve_req *r, mf_gram **out)
{
    *out = NULL;
    mf_gram_b *b;
    int rc = mf_gram_b_new(&b);
    if (rc) return rc;
    char **keys = calloc((size_t)r->n_tools + 1, sizeof *keys);
    size_t *lens = calloc((size_t)r->n_tools + 1, sizeof *lens);
    int *conts = calloc((size_t)r->n_tools + 1, sizeof *conts), n = 0;
    if (!keys || !lens || !conts) rc = mf_error(-ENOMEM, "tools: out of memory");
    for (int i = 0; i < r->n_tools && !rc; i++) {
        if (r->tool_choice == MF_TOOLS_NAMED && strcmp(r->tool_names[i], r->tool_name)) continue;
        size_t nl = strlen(r->tool_names[i]);
        if (!(keys[n] = malloc(nl + 3))) {
            rc = mf_error(-ENOMEM, "tools: out of memory");
            break;
        }
        memcpy(keys[n], r->tool_names[i], nl);
        memcpy(keys[n] + nl, "\">\n", 3);
        lens[n] = nl + 3;
        conts[n] = mf_invoke_body(b, r->tool_params[i]);
        if (conts[n] < 0) rc = mf_error_wrap(conts[n], "tools: %s's parameters", r->tool_names[i]);
        n++;
    }
    int root = -1;
    if (!rc) {
        const char *invoke = &MF_DSML_INVOKE[1];   /* after its '<' */
        int call = mf_gram_seq(b, (int[]){mf_gram_lit(b, invoke, strlen(invoke)),
                                          mf_gram_switch(b, (const char *const *)keys, lens, conts, n)}, 2);
        int head = mf_gram_lit(b, MF_DSML_CALLS_OPEN "\n<", strlen(MF_DSML_CALLS_OPEN) + 2);
        int tail = mf_gram_lit(b, "\n<", 2);
        int end = mf_gram_lit(b, &MF_DSML_CALLS_CLOSE[1], strlen(MF_DSML_CALLS_CLOSE) - 1);
        if (r->tool_choice == MF_TOOLS_NAMED)   /* exactly one call */
            root = mf_gram_seq(b, (int[]){head, call, tail, end}, 4);
        else   /* one or more: after each call "\n<", then another or the close */
            root = mf_gram_seq(b, (int[]){head, call, tail, mf_gram_loop(b, mf_gram_seq(b, (int[]){call, tail}, 2), end)}, 4);
    }
    for (int i = 0; i < n; i++) free(keys[i]);
    free(keys);
    free(lens);
    free(conts);
    if (rc) {
        mf_gram_b_free(b);
        return rc;
    }
    rc = mf_gram_b_finish(b, root, out);
    return rc ? mf_error_wrap(rc, "tools") : 0;
}
