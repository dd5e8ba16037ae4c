/* Values of the Jinja2 subset as Python sees them: jansson references (JV_UNDEF for undefined)
 * printed with Python's str() and repr() (floats by repr's shortest digits), truthiness, type
 * names, numbers (bool is an int) and equality; and the output buffer they print into. Used by
 * jinja_render.c and jinja_builtin.c. */
#include "host/jinja_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char mf_jv_undef_tag = 0;   /* JV_UNDEF is its address */

int mf_jb_add(jbuf *b, const char *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        if (b->n + n + 1 > JJ_MAX_OUT) return -E2BIG;
        size_t c = b->cap ? b->cap : 256;
        while (c < b->n + n + 1) c *= 2;
        char *p = realloc(b->p, c);
        if (!p) return -ENOMEM;
        b->p = p;
        b->cap = c;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}
int mf_jb_str(jbuf *b, const char *s) { return mf_jb_add(b, s, strlen(s)); }

/* Python's repr of a float: the shortest digits that read back the same */
static void jv_float_repr(double f, char *o, size_t cap)
{
    if (isnan(f)) {
        snprintf(o, cap, "nan");
        return;
    }
    if (isinf(f)) {
        snprintf(o, cap, f < 0 ? "-inf" : "inf");
        return;
    }
    char d[40];
    int p;
    for (p = 1; p < 17; p++) {
        snprintf(d, sizeof d, "%.*e", p - 1, f);
        if (strtod(d, NULL) == f) break;
    }
    snprintf(d, sizeof d, "%.*e", p - 1, f);
    int e = atoi(strchr(d, 'e') + 1);
    if (e < -4 || e >= 16) {   /* exponent form: mantissa digits, e[+-]XX */
        char m[24];   /* at most 17 digits, a sign and a point */
        snprintf(m, sizeof m, "%.*s", (int)(strchr(d, 'e') - d), d);
        snprintf(o, cap, "%se%c%02d", m, e < 0 ? '-' : '+', (e < 0 ? -e : e) % 1000);
    } else {
        int dec = p - 1 - e;
        snprintf(o, cap, "%.*f", dec > 0 ? dec : 0, f);
        if (!strchr(o, '.')) strncat(o, ".0", cap - strlen(o) - 1);
    }
}

static int jv_repr(jbuf *b, json_t *v);

/* Python's str() */
int mf_jv_str(jbuf *b, json_t *v)
{
    char num[48];
    if (v == JV_UNDEF) return 0;
    switch (json_typeof(v)) {
    case JSON_STRING: return mf_jb_add(b, json_string_value(v), json_string_length(v));
    case JSON_INTEGER: snprintf(num, sizeof num, "%lld", (long long)json_integer_value(v)); return mf_jb_str(b, num);
    case JSON_REAL: jv_float_repr(json_real_value(v), num, sizeof num); return mf_jb_str(b, num);
    case JSON_TRUE: return mf_jb_str(b, "True");
    case JSON_FALSE: return mf_jb_str(b, "False");
    case JSON_NULL: return mf_jb_str(b, "None");
    case JSON_ARRAY: {
        int rc = mf_jb_str(b, "[");
        for (size_t i = 0; !rc && i < json_array_size(v); i++) {
            if (i) rc = mf_jb_str(b, ", ");
            if (!rc) rc = jv_repr(b, json_array_get(v, i));
        }
        return rc ? rc : mf_jb_str(b, "]");
    }
    case JSON_OBJECT: {
        int rc = mf_jb_str(b, "{"), first = 1;
        const char *k;
        size_t kn;
        json_t *x;
        json_object_keylen_foreach(v, k, kn, x) {
            if (rc) break;
            if (!first) rc = mf_jb_str(b, ", ");
            first = 0;
            json_t *ks = json_stringn_nocheck(k, kn);
            if (!ks) return -ENOMEM;
            if (!rc) rc = jv_repr(b, ks);
            json_decref(ks);
            if (!rc) rc = mf_jb_str(b, ": ");
            if (!rc) rc = jv_repr(b, x);
        }
        return rc ? rc : mf_jb_str(b, "}");
    }
    }
    return 0;
}

/* Python's repr(): strings quoted (' unless the text holds ' and no "), the rest as str() */
static int jv_repr(jbuf *b, json_t *v)
{
    if (v == JV_UNDEF || !json_is_string(v)) return mf_jv_str(b, v);
    const char *s = json_string_value(v);
    size_t n = json_string_length(v);
    char q = memchr(s, '\'', n) && !memchr(s, '"', n) ? '"' : '\'';
    int rc = mf_jb_add(b, &q, 1);
    for (size_t i = 0; !rc && i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char e[8];
        if (c == '\\' || c == (unsigned char)q) {
            e[0] = '\\';
            e[1] = (char)c;
            rc = mf_jb_add(b, e, 2);
        } else if (c == '\n') rc = mf_jb_str(b, "\\n");
        else if (c == '\r') rc = mf_jb_str(b, "\\r");
        else if (c == '\t') rc = mf_jb_str(b, "\\t");
        else if (c < 0x20 || c == 0x7f) {
            snprintf(e, sizeof e, "\\x%02x", c);
            rc = mf_jb_str(b, e);
        } else rc = mf_jb_add(b, (const char *)&c, 1);
    }
    return rc ? rc : mf_jb_add(b, &q, 1);
}

int mf_jv_truthy(json_t *v)
{
    if (v == JV_UNDEF) return 0;
    switch (json_typeof(v)) {
    case JSON_STRING: return json_string_length(v) > 0;
    case JSON_INTEGER: return json_integer_value(v) != 0;
    case JSON_REAL: return json_real_value(v) != 0;
    case JSON_TRUE: return 1;
    case JSON_ARRAY: return json_array_size(v) > 0;
    case JSON_OBJECT: return json_object_size(v) > 0;
    default: return 0;
    }
}

const char *mf_jv_type(json_t *v)
{
    if (v == JV_UNDEF) return "undefined";
    switch (json_typeof(v)) {
    case JSON_STRING: return "str";
    case JSON_INTEGER: return "int";
    case JSON_REAL: return "float";
    case JSON_TRUE: case JSON_FALSE: return "bool";
    case JSON_NULL: return "NoneType";
    case JSON_ARRAY: return "list";
    default: return "dict";
    }
}

/* numbers as Python sees them: bool is an int */
int mf_jv_num(json_t *v, double *f, long long *i, int *is_int)
{
    if (v == JV_UNDEF) return 0;
    if (json_is_integer(v)) {
        *i = json_integer_value(v);
        *f = (double)*i;
        *is_int = 1;
        return 1;
    }
    if (json_is_boolean(v)) {
        *i = json_is_true(v);
        *f = (double)*i;
        *is_int = 1;
        return 1;
    }
    if (json_is_real(v)) {
        *f = json_real_value(v);
        *is_int = 0;
        return 1;
    }
    return 0;
}

int mf_jv_eq(json_t *a, json_t *b)
{
    double fa, fb;
    long long ia, ib;
    int ka, kb;
    if (a == JV_UNDEF || b == JV_UNDEF) return a == b;
    if (mf_jv_num(a, &fa, &ia, &ka) && mf_jv_num(b, &fb, &ib, &kb)) return ka && kb ? ia == ib : fa == fb;
    if (json_typeof(a) != json_typeof(b)) return 0;
    if (json_is_array(a)) {
        if (json_array_size(a) != json_array_size(b)) return 0;
        for (size_t i = 0; i < json_array_size(a); i++)
            if (!mf_jv_eq(json_array_get(a, i), json_array_get(b, i))) return 0;
        return 1;
    }
    if (json_is_object(a)) {
        if (json_object_size(a) != json_object_size(b)) return 0;
        const char *k;
        size_t kn;
        json_t *x;
        json_object_keylen_foreach(a, k, kn, x) {
            json_t *y = json_object_getn(b, k, kn);
            if (!y || !mf_jv_eq(x, y)) return 0;
        }
        return 1;
    }
    return json_equal(a, b);
}
