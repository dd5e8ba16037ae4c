/* The OpenAI request parser and chat template of `moeflow serve` (tools/serve_req.h). */
#include "tools/serve_req.h"

#include "graphs/gen/gen_chat.h"
#include "host/grammar.h"
#include "host/jinja.h"
#include "tools/serve_tools.h"
#include "sched/error.h"
#include "sched/path.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int mf_req_fail(mf_serve_err *e, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int mf_req_fail(mf_serve_err *e, const char *param, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    snprintf(e->param, sizeof e->param, "%s", param);
    return -EINVAL;
}

void mf_serve_req_clear(mf_serve_req *r)
{
    free(r->prompt);
    free(r->ids);
    for (int i = 0; i < r->n_msgs; i++) {
        free(r->msgs[i].role);
        free(r->msgs[i].content);
        free(r->msgs[i].tool_calls);
        free(r->msgs[i].tool_call_id);
    }
    free(r->msgs);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->model);
    free(r->bias);
    mf_gram_free(r->grammar);
    free(r->tools);
    for (int i = 0; i < r->n_tools; i++) {
        free(r->tool_names[i]);
        free(r->tool_params[i]);
    }
    free(r->tool_names);
    free(r->tool_params);
    free(r->tool_name);
    memset(r, 0, sizeof *r);
}

static char *mf_req_dup(const char *s, size_t n)
{
    char *p = malloc(n + 1);
    if (p) {
        memcpy(p, s, n);
        p[n] = 0;
    }
    return p;
}

/* A prompt given as an array of token ids. */
static int mf_req_ids(json_t *a, mf_serve_req *r, mf_serve_err *e)
{
    size_t n = json_array_size(a);
    if (n == 0) return mf_req_fail(e, "prompt", "'prompt' is an empty list");
    if (n > MF_SERVE_MAX_IDS) return mf_req_fail(e, "prompt", "'prompt' has %zu token ids (at most %d)", n, MF_SERVE_MAX_IDS);
    if (!(r->ids = malloc(sizeof *r->ids * n))) return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(a, i);
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX)
            return mf_req_fail(e, "prompt", "'prompt' item %zu: expected a token id (a non-negative integer)", i);
        r->ids[i] = (int32_t)json_integer_value(v);
    }
    r->n_ids = (int)n;
    return 0;
}

static int mf_req_prompt(json_t *p, mf_serve_req *r, mf_serve_err *e)
{
    if (!p) return mf_req_fail(e, "prompt", "'prompt' is required");
    if (json_is_string(p))
        return (r->prompt = mf_req_dup(json_string_value(p), json_string_length(p))) ? 0 : -ENOMEM;
    if (!json_is_array(p)) return mf_req_fail(e, "prompt", "'prompt' must be a string, a list of token ids, or a "
                                              "list of one of these");
    json_t *x = json_array_get(p, 0);
    if (json_array_size(p) >= 1 && (json_is_string(x) || json_is_array(x))) {
        if (json_array_size(p) > 1)
            return mf_req_fail(e, "prompt", "'prompt' holds %zu prompts; moeflow serves one prompt per request",
                               json_array_size(p));
        if (json_is_string(x))
            return (r->prompt = mf_req_dup(json_string_value(x), json_string_length(x))) ? 0 : -ENOMEM;
        return mf_req_ids(x, r, e);
    }
    return mf_req_ids(p, r, e);
}

/* A message's content: a string, or a list of {"type": "text", "text": ...} parts (joined). */
static int mf_req_content(json_t *c, size_t i, char **out, mf_serve_err *e)
{
    if (json_is_string(c)) return (*out = mf_req_dup(json_string_value(c), json_string_length(c))) ? 0 : -ENOMEM;
    if (!c || json_is_null(c)) return (*out = mf_req_dup("", 0)) ? 0 : -ENOMEM;
    if (!json_is_array(c))
        return mf_req_fail(e, "messages", "messages[%zu].content must be a string or a list of text parts", i);
    size_t n = 0, k;
    json_t *part;
    json_array_foreach(c, k, part) {
        json_t *t = json_object_get(part, "text"), *ty = json_object_get(part, "type");
        if (!json_is_object(part) || !json_is_string(ty) || strcmp(json_string_value(ty), "text") || !json_is_string(t))
            return mf_req_fail(e, "messages", "messages[%zu].content[%zu]: only {\"type\": \"text\", \"text\": ...} "
                               "parts are supported", i, k);
        n += json_string_length(t);
    }
    char *s = malloc(n + 1);
    if (!s) return -ENOMEM;
    size_t o = 0;
    json_array_foreach(c, k, part) {
        json_t *t = json_object_get(part, "text");
        memcpy(s + o, json_string_value(t), json_string_length(t));
        o += json_string_length(t);
    }
    s[o] = 0;
    *out = s;
    return 0;
}

/* A message's tool parts: an assistant's tool_calls (each {id, type "function", function {name,
 * arguments}}; arguments a JSON string is given to templates parsed when it holds an object, as
 * they iterate over it), a tool message's tool_call_id. */
static int mf_req_msg_tools(json_t *x, size_t i, mf_serve_msg *m, mf_serve_err *e)
{
    json_t *id = json_object_get(x, "tool_call_id"), *tc = json_object_get(x, "tool_calls");
    if (id && !json_is_null(id)) {
        if (!json_is_string(id)) return mf_req_fail(e, "messages", "messages[%zu].tool_call_id must be a string", i);
        if (!(m->tool_call_id = mf_req_dup(json_string_value(id), json_string_length(id)))) return -ENOMEM;
    }
    if (!tc || json_is_null(tc)) return 0;
    if (strcmp(m->role, "assistant") || !json_is_array(tc) || json_array_size(tc) > MF_SERVE_MAX_TOOLS)
        return mf_req_fail(e, "messages", "messages[%zu].tool_calls must be a list of at most %d calls, on an "
                           "assistant message", i, MF_SERVE_MAX_TOOLS);
    json_t *out = json_array();
    int rc = out ? 0 : -ENOMEM;
    size_t k;
    json_t *c;
    json_array_foreach(tc, k, c) {
        json_t *f = json_object_get(c, "function"), *nm = json_object_get(f, "name"), *a = json_object_get(f, "arguments"),
               *cid = json_object_get(c, "id");
        if (rc) break;
        if (!json_is_object(c) || !json_is_object(f) || !json_is_string(nm) || (cid && !json_is_string(cid)) ||
            (a && !json_is_string(a) && !json_is_object(a))) {
            rc = mf_req_fail(e, "messages", "messages[%zu].tool_calls[%zu] must be {\"id\", \"type\": \"function\", "
                             "\"function\": {\"name\", \"arguments\"}}", i, k);
            break;
        }
        json_t *args = a && json_is_string(a) ? json_loads(json_string_value(a), JSON_DECODE_ANY, NULL) : NULL;
        if (args && !json_is_object(args)) json_decref(args), args = NULL;
        if (!args) args = a ? json_incref(a) : json_object();
        json_t *o = json_pack("{s:s, s:{s:O, s:o}}", "type", "function", "function", "name", nm, "arguments", args);
        if (o && cid) json_object_set(o, "id", cid);
        if (!o || json_array_append_new(out, o)) rc = -ENOMEM;
    }
    if (!rc && !(m->tool_calls = json_dumps(out, JSON_COMPACT))) rc = -ENOMEM;
    json_decref(out);
    return rc;
}

static int mf_req_messages(json_t *m, mf_serve_req *r, mf_serve_err *e)
{
    if (!m) return mf_req_fail(e, "messages", "'messages' is required");
    if (!json_is_array(m) || json_array_size(m) == 0)
        return mf_req_fail(e, "messages", "'messages' must be a non-empty list of messages");
    size_t n = json_array_size(m);
    if (n > 4096) return mf_req_fail(e, "messages", "'messages' has %zu messages (at most 4096)", n);
    if (!(r->msgs = calloc(n, sizeof *r->msgs))) return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_array_get(m, i), *role = json_object_get(x, "role");
        if (!json_is_object(x)) return mf_req_fail(e, "messages", "messages[%zu] must be an object", i);
        static const char *const roles[] = {"system", "developer", "user", "assistant", "tool", NULL};
        int k = 0;
        while (roles[k] && !(json_is_string(role) && !strcmp(json_string_value(role), roles[k]))) k++;
        if (!roles[k])
            return mf_req_fail(e, "messages", "messages[%zu].role must be \"system\", \"developer\", \"user\", "
                               "\"assistant\" or \"tool\"", i);
        r->n_msgs = (int)i + 1;
        if (!(r->msgs[i].role = strdup(json_string_value(role)))) return -ENOMEM;
        json_t *c = json_object_get(x, "content");
        if (!c && k != 3)   /* only an assistant's content may be left out (a message of tool calls) */
            return mf_req_fail(e, "messages", "messages[%zu] has no content", i);
        r->msgs[i].content_null = !c || json_is_null(c);
        int rc = mf_req_content(json_object_get(x, "content"), i, &r->msgs[i].content, e);
        if (!rc) rc = mf_req_msg_tools(x, i, &r->msgs[i], e);
        if (rc) return rc;
    }
    return 0;
}

/* A number field in [lo, hi]; absent or null keeps *v. */
static int mf_req_number(json_t *o, const char *k, double lo, double hi, double *v, mf_serve_err *e)
{
    json_t *x = json_object_get(o, k);
    if (!x || json_is_null(x)) return 0;
    if (!json_is_number(x)) return mf_req_fail(e, k, "'%s' must be a number", k);
    double d = json_number_value(x);
    if (!(d >= lo && d <= hi)) return mf_req_fail(e, k, "'%s' is %g (expected %g..%g)", k, d, lo, hi);
    *v = d;
    return 0;
}

static int mf_req_bool(json_t *o, const char *k, int *v, mf_serve_err *e)
{
    json_t *x = json_object_get(o, k);
    if (!x || json_is_null(x)) return 0;
    if (!json_is_boolean(x)) return mf_req_fail(e, k, "'%s' must be true or false", k);
    *v = json_is_true(x);
    return 0;
}

static int mf_req_stop(json_t *s, mf_serve_req *r, mf_serve_err *e)
{
    if (!s || json_is_null(s)) return 0;
    json_t *one = json_is_string(s) ? s : NULL;
    size_t n = one ? 1 : json_array_size(s);
    if (!one && !json_is_array(s)) return mf_req_fail(e, "stop", "'stop' must be a string or a list of strings");
    if (n > MF_SERVE_MAX_STOP) return mf_req_fail(e, "stop", "'stop' has %zu strings (at most %d)", n, MF_SERVE_MAX_STOP);
    for (size_t i = 0; i < n; i++) {
        json_t *x = one ? one : json_array_get(s, i);
        if (!json_is_string(x) || json_string_length(x) == 0 || json_string_length(x) > 256)
            return mf_req_fail(e, "stop", "'stop' strings must be non-empty strings of at most 256 bytes");
        if (!(r->stop[i] = mf_req_dup(json_string_value(x), json_string_length(x)))) return -ENOMEM;
        r->n_stop = (int)i + 1;
    }
    return 0;
}

/* Options moeflow does not implement: accepted only at their defaults. */
static int mf_req_unsupported(json_t *o, mf_serve_err *e)
{
    static const char *const off[] = {"suffix", "functions", "function_call"};
    for (size_t i = 0; i < sizeof off / sizeof *off; i++) {
        json_t *x = json_object_get(o, off[i]);
        int dflt = !x || json_is_null(x) || (json_is_string(x) && !json_string_length(x)) ||
                   (json_is_array(x) && !json_array_size(x));
        if (!dflt) return mf_req_fail(e, off[i], "'%s' is not supported by moeflow serve%s", off[i],
                                      i ? " (use tools and tool_choice)" : "");
    }
    json_t *b = json_object_get(o, "best_of");
    if (b && !json_is_null(b) && !(json_is_integer(b) && json_integer_value(b) == 1))
        return mf_req_fail(e, "best_of", "'best_of' other than 1 is not supported");
    return 0;
}

/* An integer field in [lo, hi]; absent or null keeps *v. */
static int mf_req_int(json_t *o, const char *k, long long lo, long long hi, int *v, mf_serve_err *e)
{
    json_t *x = json_object_get(o, k);
    if (!x || json_is_null(x)) return 0;
    if (!json_is_integer(x) || json_integer_value(x) < lo || json_integer_value(x) > hi)
        return mf_req_fail(e, k, "'%s' must be an integer in %lld..%lld", k, lo, hi);
    *v = (int)json_integer_value(x);
    return 0;
}

/* logprobs, top_logprobs (chat) or logprobs: N and echo (completions). */
static int mf_req_logprobs(json_t *o, int chat, mf_serve_req *r, mf_serve_err *e)
{
    json_t *lp = json_object_get(o, "logprobs");
    int rc;
    if (chat) {
        if ((rc = mf_req_bool(o, "logprobs", &r->logprobs, e)) ||
            (rc = mf_req_int(o, "top_logprobs", 0, MF_SERVE_MAX_LOGPROBS, &r->top_logprobs, e)))
            return rc;
        json_t *tl = json_object_get(o, "top_logprobs");
        if (tl && !json_is_null(tl) && !r->logprobs)
            return mf_req_fail(e, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
        return 0;
    }
    if (lp && !json_is_null(lp)) {
        if (json_is_boolean(lp)) return mf_req_fail(e, "logprobs", "'logprobs' of completions is an integer 0..%d (the "
                                                    "alternatives per token)", MF_SERVE_MAX_LOGPROBS);
        if ((rc = mf_req_int(o, "logprobs", 0, MF_SERVE_MAX_LOGPROBS, &r->top_logprobs, e))) return rc;
        r->logprobs = 1;
    }
    return mf_req_bool(o, "echo", &r->echo, e);
}

/* logit_bias: {"token id": bias}, ids as decimal strings, biases -100..100. */
static int mf_req_bias(json_t *x, mf_serve_req *r, mf_serve_err *e)
{
    if (!x || json_is_null(x)) return 0;
    if (!json_is_object(x)) return mf_req_fail(e, "logit_bias", "'logit_bias' must be an object of token ids to biases");
    size_t n = json_object_size(x);
    if (n > 1024) return mf_req_fail(e, "logit_bias", "'logit_bias' has %zu entries (at most 1024)", n);
    if (n && !(r->bias = malloc(sizeof *r->bias * n))) return -ENOMEM;
    const char *k;
    json_t *v;
    json_object_foreach(x, k, v) {
        char *end;
        long long id = strtoll(k, &end, 10);
        if (!*k || *end || id < 0 || id > INT32_MAX || (k[0] == '0' && k[1]))
            return mf_req_fail(e, "logit_bias", "'logit_bias' key '%.40s' is not a token id", k);
        if (!json_is_number(v) || !(json_number_value(v) >= -100 && json_number_value(v) <= 100))
            return mf_req_fail(e, "logit_bias", "'logit_bias' of token %lld must be a number in -100..100", id);
        r->bias[r->n_bias++] = (mf_serve_bias){(int32_t)id, (float)json_number_value(v)};
    }
    return 0;
}

/* response_format: text, json_object, or json_schema {name, schema, strict}: compiled here. */
static int mf_req_format(json_t *x, mf_serve_req *r, mf_serve_err *e)
{
    if (!x || json_is_null(x)) return 0;
    json_t *t = json_object_get(x, "type");
    const char *ty = json_is_string(t) ? json_string_value(t) : "";
    if (!json_is_object(x) || (strcmp(ty, "text") && strcmp(ty, "json_object") && strcmp(ty, "json_schema")))
        return mf_req_fail(e, "response_format", "'response_format' must be {\"type\": \"text\"}, {\"type\": "
                           "\"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\"}}");
    if (!strcmp(ty, "text")) return 0;
    int rc;
    if (!strcmp(ty, "json_object")) {
        mf_gram_b *b;
        if ((rc = mf_gram_b_new(&b))) return rc;
        rc = mf_gram_b_finish(b, mf_gram_json_object(b), &r->grammar);
        r->json_mode = 1;
    } else {
        json_t *js = json_object_get(x, "json_schema"), *sc = json_object_get(js, "schema");
        if (!json_is_object(js) || !(json_is_object(sc) || json_is_boolean(sc)))
            return mf_req_fail(e, "response_format", "'response_format.json_schema' must be an object with a 'schema'");
        char *txt = json_dumps(sc, JSON_COMPACT | JSON_ENCODE_ANY);
        if (!txt) return -ENOMEM;
        rc = mf_gram_from_schema(txt, strlen(txt), &r->grammar);
        free(txt);
        r->json_mode = 2;
    }
    if (rc == -ENOMEM) return rc;
    return rc ? mf_req_fail(e, "response_format", "response_format: %s", mf_last_error()) : 0;
}

/* tools (functions with a name, an optional description and parameters) and tool_choice. */
static int mf_req_tools(json_t *o, mf_serve_req *r, mf_serve_err *e)
{
    json_t *ts = json_object_get(o, "tools"), *ch = json_object_get(o, "tool_choice");
    size_t n = json_array_size(ts);
    if (ts && !json_is_null(ts) && (!json_is_array(ts) || n > MF_SERVE_MAX_TOOLS))
        return mf_req_fail(e, "tools", "'tools' must be a list of at most %d functions", MF_SERVE_MAX_TOOLS);
    r->tool_choice = n ? MF_TOOLS_AUTO : MF_TOOLS_NONE;
    if (ch && !json_is_null(ch)) {
        const char *c = json_is_string(ch) ? json_string_value(ch) : NULL;
        json_t *f = json_object_get(ch, "function"), *nm = json_object_get(f, "name");
        if (c && !strcmp(c, "none")) r->tool_choice = MF_TOOLS_NONE;
        else if (c && !strcmp(c, "auto")) r->tool_choice = MF_TOOLS_AUTO;
        else if (c && !strcmp(c, "required")) r->tool_choice = MF_TOOLS_REQUIRED;
        else if (json_is_object(ch) && json_is_string(nm)) r->tool_choice = MF_TOOLS_NAMED;
        else return mf_req_fail(e, "tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                "{\"type\": \"function\", \"function\": {\"name\": ...}}");
        if (r->tool_choice != MF_TOOLS_NONE && !n)
            return mf_req_fail(e, "tool_choice", "'tool_choice' other than \"none\" needs 'tools'");
        if (r->tool_choice == MF_TOOLS_NAMED && !(r->tool_name = strdup(json_string_value(nm)))) return -ENOMEM;
    }
    if (!n || r->tool_choice == MF_TOOLS_NONE) return 0;   /* the template sees no tools */
    r->tool_names = calloc(n, sizeof *r->tool_names);
    r->tool_params = calloc(n, sizeof *r->tool_params);
    json_t *out = json_array();
    if (!r->tool_names || !r->tool_params || !out) return json_decref(out), -ENOMEM;
    int rc = 0, named = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        json_t *t = json_array_get(ts, i), *f = json_object_get(t, "function"), *nm = json_object_get(f, "name"),
               *d = json_object_get(f, "description"), *p = json_object_get(f, "parameters"), *ty = json_object_get(t, "type");
        const char *name = json_string_value(nm);
        if (!json_is_object(f) || !json_is_string(ty) || strcmp(json_string_value(ty), "function") || !name ||
            !mf_serve_tool_name_ok(name) || (d && !json_is_null(d) && !json_is_string(d)) ||
            (p && !json_is_null(p) && !json_is_object(p))) {
            rc = mf_req_fail(e, "tools", "tools[%zu] must be {\"type\": \"function\", \"function\": {\"name\": "
                             "1-64 of a-z A-Z 0-9 _ - ., \"description\", \"parameters\": {...}}}", i);
            break;
        }
        for (size_t j = 0; j < i && !rc; j++)
            if (!strcmp(r->tool_names[j], name)) rc = mf_req_fail(e, "tools", "tools[%zu]: the name %s is given twice", i, name);
        named |= r->tool_name && !strcmp(r->tool_name, name);
        r->n_tools = (int)i + 1;
        if (!rc && (!(r->tool_names[i] = strdup(name)) ||
                    !(r->tool_params[i] = p && !json_is_null(p) ? json_dumps(p, JSON_COMPACT) : strdup("{}")) ||
                    json_array_append(out, t)))
            rc = -ENOMEM;
    }
    if (!rc && r->tool_choice == MF_TOOLS_NAMED && !named)
        rc = mf_req_fail(e, "tool_choice", "'tool_choice' names %.64s, which is not in 'tools'", r->tool_name);
    if (!rc && !(r->tools = json_dumps(out, JSON_COMPACT))) rc = -ENOMEM;
    json_decref(out);
    return rc;
}

/* The sampling controls: penalties, min_p, top_k, logit_bias. */
static int mf_req_controls(json_t *o, mf_serve_req *r, mf_serve_err *e)
{
    r->repetition_penalty = 1;
    int rc;
    if ((rc = mf_req_number(o, "presence_penalty", -2, 2, &r->presence_penalty, e)) ||
        (rc = mf_req_number(o, "frequency_penalty", -2, 2, &r->frequency_penalty, e)) ||
        (rc = mf_req_number(o, "repetition_penalty", 0, 2, &r->repetition_penalty, e)) ||
        (rc = mf_req_number(o, "min_p", 0, 1, &r->min_p, e)) ||
        (rc = mf_req_int(o, "top_k", -1, 1 << 20, &r->top_k, e)))
        return rc;
    if (r->repetition_penalty == 0) return mf_req_fail(e, "repetition_penalty", "'repetition_penalty' must be > 0");
    if (r->top_k < 0) r->top_k = 0;   /* vLLM's -1: all */
    return mf_req_bias(json_object_get(o, "logit_bias"), r, e);
}

static int mf_req_fields(json_t *o, int chat, mf_serve_req *r, mf_serve_err *e)
{
    int rc = chat ? mf_req_messages(json_object_get(o, "messages"), r, e) : mf_req_prompt(json_object_get(o, "prompt"), r, e);
    if (rc) return rc;
    json_t *n = json_object_get(o, "n");
    if (n && !json_is_null(n)) {
        if (!json_is_integer(n)) return mf_req_fail(e, "n", "'n' must be an integer");
        if (json_integer_value(n) < 1 || json_integer_value(n) > MF_SERVE_MAX_N)
            return mf_req_fail(e, "n", "'n' is %lld: choices per request must be 1..%d", (long long)json_integer_value(n),
                               MF_SERVE_MAX_N);
        r->n = (int)json_integer_value(n);
    }
    const char *mt = chat && json_object_get(o, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    json_t *x = json_object_get(o, mt);
    r->max_tokens = -1;
    if (x && !json_is_null(x)) {
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > INT32_MAX / 2)
            return mf_req_fail(e, mt, "'%s' must be a non-negative integer", mt);
        r->max_tokens = (int)json_integer_value(x);
    }
    r->temperature = 1.0;
    r->top_p = 1.0;
    if ((rc = mf_req_number(o, "temperature", 0, 2, &r->temperature, e)) ||
        (rc = mf_req_number(o, "top_p", 0, 1, &r->top_p, e)))
        return rc;
    if (r->top_p == 0) return mf_req_fail(e, "top_p", "'top_p' must be > 0");
    x = json_object_get(o, "seed");
    if (x && !json_is_null(x)) {
        if (!json_is_integer(x)) return mf_req_fail(e, "seed", "'seed' must be an integer");
        r->seed = (uint64_t)json_integer_value(x);
        r->seed_given = 1;
    }
    if ((rc = mf_req_bool(o, "stream", &r->stream, e)) || (rc = mf_req_bool(o, "ignore_eos", &r->ignore_eos, e)) ||
        (rc = mf_req_stop(json_object_get(o, "stop"), r, e)) || (rc = mf_req_unsupported(o, e)) ||
        (rc = mf_req_logprobs(o, chat, r, e)) || (rc = mf_req_controls(o, r, e)) ||
        (rc = mf_req_format(json_object_get(o, "response_format"), r, e)) || (chat && (rc = mf_req_tools(o, r, e))))
        return rc;
    if (r->grammar && (r->tool_choice == MF_TOOLS_REQUIRED || r->tool_choice == MF_TOOLS_NAMED))
        return mf_req_fail(e, "response_format", "'response_format' and a required tool call cannot both constrain "
                           "the output");
    if (r->tool_choice == MF_TOOLS_REQUIRED || r->tool_choice == MF_TOOLS_NAMED) {
        if ((rc = mf_serve_tools_grammar(r, &r->grammar)))
            return rc == -ENOMEM ? rc : mf_req_fail(e, "tools", "%s", mf_last_error());
    }
    x = json_object_get(o, "stream_options");
    if (x && !json_is_null(x) && !json_is_object(x))
        return mf_req_fail(e, "stream_options", "'stream_options' must be an object");
    x = json_object_get(o, "model");
    if (x && !json_is_null(x)) {
        if (!json_is_string(x)) return mf_req_fail(e, "model", "'model' must be a string");
        if (!(r->model = mf_req_dup(json_string_value(x), json_string_length(x)))) return -ENOMEM;
    }
    x = json_object_get(o, "user");
    if (x && !json_is_null(x) && !json_is_string(x)) return mf_req_fail(e, "user", "'user' must be a string");
    return 0;
}

int mf_serve_req_parse(const char *body, size_t len, int chat, mf_serve_req *out, mf_serve_err *err)
{
    memset(out, 0, sizeof *out);
    memset(err, 0, sizeof *err);
    out->chat = chat;
    out->n = 1;
    json_error_t je;
    json_t *o = json_loadb(body, len, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &je);
    if (!o)
        return mf_req_fail(err, "", "malformed JSON body: %s (line %d, column %d)", je.text, je.line, je.column);
    int rc = json_is_object(o) ? mf_req_fields(o, chat, out, err)
                               : mf_req_fail(err, "", "the body must be a JSON object");
    json_decref(o);
    if (rc == -ENOMEM) snprintf(err->message, sizeof err->message, "out of memory");
    if (rc) mf_serve_req_clear(out);
    if (rc) out->chat = chat, out->n = 1;
    return rc;
}

static int mf_req_cat(char **s, size_t *n, size_t *cap, const char *add)
{
    size_t k = strlen(add);
    if (*n + k + 1 > *cap) {
        size_t c = (*n + k + 1) * 2;
        char *p = realloc(*s, c);
        if (!p) return -ENOMEM;
        *s = p;
        *cap = c;
    }
    memcpy(*s + *n, add, k + 1);
    *n += k;
    return 0;
}

static int mf_chat_builtin(const mf_serve_req *r, char **out, size_t *n_out)
{
    static const char user[] = "<\xef\xbd\x9cUser\xef\xbd\x9c>", asst[] = "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>",
                      eos[] = "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>";
    char *s = NULL;
    size_t n = 0, cap = 0;
    int rc = mf_req_cat(&s, &n, &cap, "");
    for (int i = 0; i < r->n_msgs && !rc; i++)   /* system prompts first, as DeepSeek's template */
        if (!strcmp(r->msgs[i].role, "system") || !strcmp(r->msgs[i].role, "developer"))
            rc = mf_req_cat(&s, &n, &cap, r->msgs[i].content);
    for (int i = 0; i < r->n_msgs && !rc; i++) {
        if (!strcmp(r->msgs[i].role, "user")) {
            rc = mf_req_cat(&s, &n, &cap, user);
            if (!rc) rc = mf_req_cat(&s, &n, &cap, r->msgs[i].content);
        } else if (!strcmp(r->msgs[i].role, "assistant")) {
            rc = mf_req_cat(&s, &n, &cap, asst);
            if (!rc) rc = mf_req_cat(&s, &n, &cap, r->msgs[i].content);
            if (!rc) rc = mf_req_cat(&s, &n, &cap, eos);
        }
    }
    if (!rc) rc = mf_req_cat(&s, &n, &cap, asst);
    if (rc) {
        free(s);
        return rc;
    }
    *out = s;
    *n_out = n;
    return 0;
}

struct mf_chat_tmpl {
    mf_jinja *jinja;
    char *bos, *eos;   /* NULL: not given (undefined in the template) */
};

void mf_chat_tmpl_free(mf_chat_tmpl *t)
{
    if (!t) return;
    mf_jinja_free(t->jinja);
    free(t->bos);
    free(t->eos);
    free(t);
}

/* bos_token / eos_token of a tokenizer_config.json: a string or an AddedToken {"content": ...} */
static int mf_chat_special(json_t *cfg, const char *key, char **out)
{
    json_t *v = json_object_get(cfg, key);
    if (json_is_object(v)) v = json_object_get(v, "content");
    if (!json_is_string(v)) return 0;
    return (*out = mf_req_dup(json_string_value(v), json_string_length(v))) ? 0 : -ENOMEM;
}


int mf_chat_tmpl_load(const char *dir, const char *spec, mf_chat_tmpl **out, char *desc, size_t desc_cap)
{
    char cfg_path[4200];
    json_t *cfg = NULL, *spec_cfg = NULL;
    json_error_t je;
    char *src = NULL;
    size_t n_src = 0;
    int rc = 0;
    *out = NULL;
    if (spec && !strcmp(spec, "builtin")) {
        snprintf(desc, desc_cap, "the built-in DeepSeek-V3 chat format (--chat-template builtin)");
        return 0;
    }
    if (spec && !strcmp(spec, "deepseek-v4")) {   /* gen's template: DeepSeek-V4's encoding with tools */
        mf_chat_tmpl *ct = calloc(1, sizeof *ct);
        const char *t = mf_gen_chat_template();
        if (!ct || !(ct->bos = strdup("<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>")) ||
            !(ct->eos = strdup("<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"))) {
            mf_chat_tmpl_free(ct);
            return mf_error(-ENOMEM, "out of memory");
        }
        int rc = mf_jinja_parse(t, strlen(t), &ct->jinja);
        if (rc) {
            mf_chat_tmpl_free(ct);
            return mf_error_wrap(rc, "--chat-template deepseek-v4");
        }
        snprintf(desc, desc_cap, "the built-in DeepSeek-V4 chat template with tools (--chat-template deepseek-v4)");
        *out = ct;
        return 0;
    }
    snprintf(cfg_path, sizeof cfg_path, "%s/tokenizer_config.json", dir);
    FILE *probe = fopen(cfg_path, "rb");
    if (probe) {
        fclose(probe);
        if (!(cfg = json_load_file(cfg_path, 0, &je)))
            return mf_error(-EINVAL, "%s line %d: %s", cfg_path, je.line, je.text);
    }
    if (!spec && !cfg) {
        snprintf(desc, desc_cap, "the built-in DeepSeek-V3 chat format (no tokenizer_config.json)");
        return 0;
    }
    const char *from = cfg_path;
    json_t *tcfg = cfg;   /* where the template comes from */
    size_t sl = spec ? strlen(spec) : 0;
    if (spec && sl > 5 && !strcmp(spec + sl - 5, ".json")) {
        if (!(spec_cfg = json_load_file(spec, 0, &je))) {
            rc = mf_error(access(spec, R_OK) ? -ENOENT : -EINVAL, "--chat-template %s: %s", spec, je.text);
            goto done;
        }
        tcfg = spec_cfg;
        from = spec;
    } else if (spec) {
        if ((rc = mf_path_read(spec, (size_t)64 << 20, &src, &n_src))) goto done;
        from = spec;
        tcfg = NULL;
    }
    if (tcfg) {
        json_t *t = json_object_get(tcfg, "chat_template");
        if (json_is_array(t)) {   /* named templates: the default one */
            size_t i;
            json_t *e, *pick = NULL;
            json_array_foreach(t, i, e) {
                json_t *nm = json_object_get(e, "name");
                if (json_is_string(nm) && !strcmp(json_string_value(nm), "default")) pick = json_object_get(e, "template");
            }
            t = pick;
        }
        if (!json_is_string(t)) {
            if (spec) rc = mf_error(-EINVAL, "--chat-template %s: no chat_template string in it", spec);
            else snprintf(desc, desc_cap, "the built-in DeepSeek-V3 chat format (tokenizer_config.json has no chat_template)");
            goto done;
        }
        if (!(src = mf_req_dup(json_string_value(t), json_string_length(t)))) {
            rc = -ENOMEM;
            goto done;
        }
        n_src = json_string_length(t);
    }
    mf_chat_tmpl *ct = calloc(1, sizeof *ct);
    if (!ct) {
        rc = -ENOMEM;
        goto done;
    }
    json_t *sp = spec_cfg ? spec_cfg : cfg;
    if ((rc = mf_jinja_parse(src, n_src, &ct->jinja))) {
        mf_chat_tmpl_free(ct);
        rc = mf_error_wrap(rc, "%s", from);
        goto done;
    }
    if (sp && ((rc = mf_chat_special(sp, "bos_token", &ct->bos)) || (rc = mf_chat_special(sp, "eos_token", &ct->eos)))) {
        mf_chat_tmpl_free(ct);
        goto done;
    }
    snprintf(desc, desc_cap, "the chat template of %s (%zu bytes)", from, n_src);
    *out = ct;
done:
    free(src);
    if (cfg) json_decref(cfg);
    if (spec_cfg) json_decref(spec_cfg);
    return rc;
}

int mf_serve_chat_render(const mf_serve_req *r, const mf_chat_tmpl *t, char **out, size_t *n_out, int *bos_in_text)
{
    *bos_in_text = 0;
    if (!t) {
        int tools = r->n_tools > 0;
        for (int i = 0; i < r->n_msgs; i++) tools |= r->msgs[i].tool_calls || !strcmp(r->msgs[i].role, "tool");
        if (tools)
            return mf_error(-EINVAL, "the built-in chat format has no tools or tool messages (serve with a chat template "
                            "that has them: `moeflow gen` writes one, or --chat-template deepseek-v4)");
        return mf_chat_builtin(r, out, n_out);
    }
    json_t *msgs = json_array(), *ctx = NULL;
    int rc = msgs ? 0 : -ENOMEM;
    for (int i = 0; i < r->n_msgs && !rc; i++) {
        const mf_serve_msg *m = &r->msgs[i];
        json_t *o = json_pack("{s:s,s:o}", "role", m->role, "content",
                              m->content_null ? json_null() : json_stringn_nocheck(m->content, strlen(m->content)));
        if (o && m->tool_calls) json_object_set_new(o, "tool_calls", json_loads(m->tool_calls, 0, NULL));
        if (o && m->tool_call_id) json_object_set_new(o, "tool_call_id", json_string(m->tool_call_id));
        if (!o || json_array_append_new(msgs, o)) rc = -ENOMEM;
    }
    if (!rc && !(ctx = json_pack("{s:o,s:b}", "messages", json_incref(msgs), "add_generation_prompt", 1))) rc = -ENOMEM;
    if (!rc && r->tools && json_object_set_new(ctx, "tools", json_loads(r->tools, 0, NULL))) rc = -ENOMEM;
    if (!rc && t->bos && json_object_set_new(ctx, "bos_token", json_string(t->bos))) rc = -ENOMEM;
    if (!rc && t->eos && json_object_set_new(ctx, "eos_token", json_string(t->eos))) rc = -ENOMEM;
    if (!rc) rc = mf_jinja_render(t->jinja, ctx, out, n_out);
    if (msgs) json_decref(msgs);
    if (ctx) json_decref(ctx);
    if (!rc) *bos_in_text = 1;
    return rc;
}
