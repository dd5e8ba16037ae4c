/* A JSON Schema subset into grammar nodes (host/grammar.h mf_gram_json_schema): type (one or a
 * list), properties, required, additionalProperties, items, minItems, maxItems, enum, const;
 * annotations ignored; every other keyword refused by name and place. Values of enum and const are
 * matched as jansson's compact encoding of them. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "host/grammar_impl.h"
#include "sched/error.h"

enum { T_OBJECT = 1, T_ARRAY = 2, T_STRING = 4, T_NUMBER = 8, T_INTEGER = 16, T_BOOLEAN = 32, T_NULL = 64 };

static const char *const mf_ignored[] = {"title", "description", "$schema", "$id", "$comment", "default",
                                         "examples", "deprecated", "readOnly", "writeOnly", NULL};
static const char *const mf_known[] = {"type", "properties", "required", "additionalProperties", "items",
                                       "minItems", "maxItems", "enum", "const", NULL};

static int mf_in(const char *const *list, const char *k)
{
    for (; *list; list++)
        if (!strcmp(*list, k)) return 1;
    return 0;
}

static int mf_schema(mf_gram_b *b, json_t *s, char *path, size_t cap, int depth);

/* path + "/" + part while f runs (the path buffer is shared down the recursion). */
static int mf_schema_at(mf_gram_b *b, json_t *s, char *path, size_t cap, int depth, const char *part)
{
    size_t n = strlen(path);
    snprintf(path + n, cap - n, "/%s", part);
    int rc = mf_schema(b, s, path, cap, depth);
    if (rc >= 0) path[n] = 0;   /* on failure the path stays, for the message */
    return rc;
}

/* enum (or const: one value) as a switch of the values' compact JSON. */
static int mf_schema_enum(mf_gram_b *b, json_t *vals, const char *path)
{
    size_t n = json_array_size(vals);
    if (!json_is_array(vals) || n == 0) return mf_error(-EINVAL, "schema: 'enum' at %s must be a non-empty list", path);
    if (n > MF_GRAM_MAX_KEYS) return mf_error(-E2BIG, "schema: 'enum' at %s has %zu values (at most %d)", path, n, MF_GRAM_MAX_KEYS);
    char **keys = calloc(n, sizeof *keys);
    size_t *lens = calloc(n, sizeof *lens);
    int rc = keys && lens ? 0 : mf_error(-ENOMEM, "schema: out of memory");
    size_t m = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        char *k = json_dumps(json_array_get(vals, i), JSON_COMPACT | JSON_ENCODE_ANY);
        if (!k) {
            rc = mf_error(-ENOMEM, "schema: out of memory");
            break;
        }
        size_t kl = strlen(k);
        int dup = 0;
        for (size_t j = 0; j < m && !dup; j++) dup = lens[j] == kl && !memcmp(keys[j], k, kl);
        if (dup) {
            free(k);
            continue;
        }
        keys[m] = k;
        lens[m++] = kl;
    }
    if (!rc) rc = mf_gram_switch(b, (const char *const *)keys, lens, NULL, (int)m);
    for (size_t i = 0; keys && i < m; i++) free(keys[i]);
    free(keys);
    free(lens);
    return rc;
}

static int mf_schema_object(mf_gram_b *b, json_t *s, char *path, size_t cap, int depth)
{
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required"),
           *add = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props)) return mf_error(-EINVAL, "schema: 'properties' at %s must be an object", path);
    if (req && !json_is_array(req)) return mf_error(-EINVAL, "schema: 'required' at %s must be a list of names", path);
    size_t n = json_object_size(props);
    if (n > MF_GRAM_MAX_PROPS)
        return mf_error(-E2BIG, "schema: %zu properties at %s (at most %d)", n, path, MF_GRAM_MAX_PROPS);
    char *names[MF_GRAM_MAX_PROPS];
    size_t lens[MF_GRAM_MAX_PROPS];
    int vals[MF_GRAM_MAX_PROPS], rc = 0;
    const char *key;
    json_t *v;
    size_t k = 0;
    json_object_foreach(props, key, v) {
        char part[300];
        snprintf(part, sizeof part, "properties/%.280s", key);
        if ((rc = mf_schema_at(b, v, path, cap, depth + 1, part)) < 0) break;
        vals[k] = rc;
        json_t *js = json_string(key);
        char *e = js ? json_dumps(js, JSON_ENCODE_ANY) : NULL;
        json_decref(js);
        if (!e) {
            rc = mf_error(-ENOMEM, "schema: out of memory");
            break;
        }
        lens[k] = strlen(e) - 2;   /* the encoded name without its quotes */
        memmove(e, e + 1, lens[k]);
        names[k++] = e;
        rc = 0;
    }
    uint64_t required = 0;
    for (size_t i = 0; !rc && i < json_array_size(req); i++) {
        json_t *r = json_array_get(req, i);
        size_t j = 0;
        for (; json_is_string(r) && j < k; j++) {
            json_t *js = json_string(json_string_value(r));
            char *e = js ? json_dumps(js, JSON_ENCODE_ANY) : NULL;
            json_decref(js);
            int same = e && strlen(e) == lens[j] + 2 && !memcmp(e + 1, names[j], lens[j]);
            free(e);
            if (same) break;
        }
        if (j == k) rc = mf_error(-EINVAL, "schema: 'required' at %s names %s, which is not in its properties", path,
                                  json_is_string(r) ? json_string_value(r) : "a non-string");
        else required |= UINT64_C(1) << j;
    }
    int additional = -1;   /* absent: false with properties (strict, as OpenAI's and xgrammar's), any without */
    if (!rc && (json_is_true(add) || (!add && !props))) additional = mf_gram_json_any(b);
    else if (!rc && add && !json_is_boolean(add)) additional = mf_schema_at(b, add, path, cap, depth + 1, "additionalProperties");
    if (!rc && additional < -1) rc = additional;
    if (!rc) rc = mf_gram_json_obj(b, (const char *const *)names, lens, vals, (int)k, required, additional);
    for (size_t i = 0; i < k; i++) free(names[i]);
    return rc;
}

static int mf_schema_array(mf_gram_b *b, json_t *s, char *path, size_t cap, int depth)
{
    json_t *items = json_object_get(s, "items"), *mn = json_object_get(s, "minItems"), *mx = json_object_get(s, "maxItems");
    if (json_is_array(items)) return mf_error(-EINVAL, "schema: 'items' at %s is a list (tuples are not supported)", path);
    json_int_t lo = 0, hi = -1;
    if (mn && (!json_is_integer(mn) || (lo = json_integer_value(mn)) < 0 || lo > (1 << 30)))
        return mf_error(-EINVAL, "schema: 'minItems' at %s must be an integer in 0..%d", path, 1 << 30);
    if (mx && (!json_is_integer(mx) || (hi = json_integer_value(mx)) < 0 || hi > (1 << 30)))
        return mf_error(-EINVAL, "schema: 'maxItems' at %s must be an integer in 0..%d", path, 1 << 30);
    if (mx && hi < lo) return mf_error(-EINVAL, "schema: 'maxItems' %lld < 'minItems' %lld at %s", (long long)hi,
                                       (long long)lo, path);
    int item = items ? mf_schema_at(b, items, path, cap, depth + 1, "items") : mf_gram_json_any(b);
    return item < 0 ? item : mf_gram_json_arr(b, item, (uint32_t)lo, mx ? (uint32_t)hi : G_NONE);
}

/* The types a schema allows (T_* bits); 0 when it names none. */
static int mf_schema_types(json_t *t, const char *path, int *out)
{
    static const char *const names[] = {"object", "array", "string", "number", "integer", "boolean", "null"};
    *out = 0;
    if (!t) return 0;
    size_t n = json_is_array(t) ? json_array_size(t) : 1;
    if (!json_is_string(t) && (!json_is_array(t) || n == 0))
        return mf_error(-EINVAL, "schema: 'type' at %s must be a type name or a non-empty list of them", path);
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_is_array(t) ? json_array_get(t, i) : t;
        int k = 0;
        while (k < 7 && !(json_is_string(x) && !strcmp(json_string_value(x), names[k]))) k++;
        if (k == 7) return mf_error(-EINVAL, "schema: 'type' at %s: unknown type %s", path,
                                    json_is_string(x) ? json_string_value(x) : "(not a string)");
        *out |= 1 << k;
    }
    if (*out & T_NUMBER) *out &= ~T_INTEGER;   /* a number covers the integers */
    return 0;
}

static int mf_schema(mf_gram_b *b, json_t *s, char *path, size_t cap, int depth)
{
    if (depth > MF_GRAM_MAX_DEPTH) return mf_error(-E2BIG, "schema: nested deeper than %d levels at %s", MF_GRAM_MAX_DEPTH, path);
    if (json_is_true(s)) return mf_gram_json_any(b);
    if (!json_is_object(s)) return mf_error(-EINVAL, "schema: %s must be a schema object%s", path,
                                            json_is_false(s) ? " (false matches nothing)" : "");
    const char *key;
    json_t *v;
    json_object_foreach(s, key, v) {
        if (!mf_in(mf_known, key) && !mf_in(mf_ignored, key))
            return mf_error(-EINVAL, "schema: unsupported keyword '%s' at %s", key, path);
    }
    json_t *en = json_object_get(s, "enum"), *cn = json_object_get(s, "const");
    if (en || cn) {
        if (!cn) return mf_schema_enum(b, en, path);
        json_t *one = json_pack("[O]", cn);
        int rc = one ? mf_schema_enum(b, one, path) : mf_error(-ENOMEM, "schema: out of memory");
        json_decref(one);
        return rc;
    }
    int types, rc = mf_schema_types(json_object_get(s, "type"), path, &types);
    if (rc) return rc;
    if (!types) {
        if (json_object_get(s, "properties") || json_object_get(s, "required") || json_object_get(s, "additionalProperties"))
            types = T_OBJECT;
        else if (json_object_get(s, "items") || json_object_get(s, "minItems") || json_object_get(s, "maxItems"))
            types = T_ARRAY;
        else
            return mf_gram_json_any(b);
    }
    int alt[7], n = 0;
    static const char *const tf[2] = {"true", "false"};
    static const size_t tfl[2] = {4, 5};
    if (types & T_OBJECT) alt[n++] = mf_schema_object(b, s, path, cap, depth);
    if (types & T_ARRAY) alt[n++] = mf_schema_array(b, s, path, cap, depth);
    if (types & T_STRING) alt[n++] = mf_gram_json_str(b);
    if (types & (T_NUMBER | T_INTEGER)) alt[n++] = mf_gram_json_num(b, !(types & T_NUMBER));
    if (types & T_BOOLEAN) alt[n++] = mf_gram_switch(b, tf, tfl, NULL, 2);
    if (types & T_NULL) alt[n++] = mf_gram_lit(b, "null", 4);
    for (int i = 0; i < n; i++)
        if (alt[i] < 0) return alt[i];
    return mf_gram_choice(b, alt, n);
}

int mf_gram_json_schema(mf_gram_b *b, const char *schema, size_t n)
{
    json_error_t je;
    json_t *s = json_loadb(schema, n, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &je);
    if (!s) return mf_error(-EINVAL, "schema: not JSON: %s (line %d, column %d)", je.text, je.line, je.column);
    char path[1024] = "#";   /* a JSON pointer into the schema, as in error messages */
    int rc = mf_schema(b, s, path, sizeof path, 0);
    json_decref(s);
    return rc;
}

int mf_gram_from_schema(const char *schema, size_t n, mf_gram **out)
{
    *out = NULL;
    mf_gram_b *b;
    int rc = mf_gram_b_new(&b);
    if (rc) return rc;
    int root = mf_gram_json_schema(b, schema, n);
    return mf_gram_b_finish(b, root, out);
}
