/* The built-ins of the Jinja2 subset (host/jinja.h) that chat templates use: string and dict
 * methods (strip, split, replace, get, items, ...), the globals namespace(), raise_exception()
 * and range(), the filters (trim, length, tojson, default, join, ...) and the `is` tests, each
 * with Python's or Jinja's result. Called from jinja_render.c's evaluator. */
#include "host/jinja_internal.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/error.h"

static int jj_space_at(const char *s, size_t n, size_t i, size_t *w)
{
    unsigned char c = (unsigned char)s[i];
    if (jj_isws((char)c) || (c >= 0x1c && c <= 0x1f)) {
        *w = 1;
        return 1;
    }
    /* the non-ASCII characters Python's str.isspace() takes: U+0085, U+00A0, U+1680, U+2000-200A,
     * U+2028, U+2029, U+202F, U+205F, U+3000 */
    if (c == 0xc2 && i + 1 < n && ((unsigned char)s[i + 1] == 0x85 || (unsigned char)s[i + 1] == 0xa0)) {
        *w = 2;
        return 1;
    }
    if (i + 2 < n && (c == 0xe1 || c == 0xe2 || c == 0xe3)) {
        unsigned b1 = (unsigned char)s[i + 1], b2 = (unsigned char)s[i + 2];
        unsigned cp = (c & 15u) << 12 | (b1 & 63u) << 6 | (b2 & 63u);
        if (cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 || cp == 0x202f ||
            cp == 0x205f || cp == 0x3000) {
            *w = 3;
            return 1;
        }
    }
    return 0;
}

/* strip of whitespace (chars NULL) or of the characters in chars; which: 1 left, 2 right, 3 both */
static int jr_strip(json_t *v, json_t *chars, int which, json_t **out)
{
    const char *s = json_string_value(v);
    size_t n = json_string_length(v), a = 0, b = n, w;
    const char *cs = chars ? json_string_value(chars) : NULL;
    size_t cn = chars ? json_string_length(chars) : 0;
    if (which & 1)
        while (a < b) {
            if (cs) {
                if (!memchr(cs, s[a], cn) || ((unsigned char)s[a] & 0x80)) break;
                a++;
            } else if (jj_space_at(s, n, a, &w)) {
                a += w;
            } else {
                break;
            }
        }
    if (which & 2)
        while (b > a) {
            if (cs) {
                if (!memchr(cs, s[b - 1], cn) || ((unsigned char)s[b - 1] & 0x80)) break;
                b--;
                continue;
            }
            size_t k = b - 1;
            while (k > a && ((unsigned char)s[k] & 0xc0) == 0x80) k--;
            if (jj_space_at(s, n, k, &w) && k + w == b) b = k;
            else break;
        }
    return mf_jr_strv(s + a, b - a, out);
}

/* tojson: json.dumps(v, ensure_ascii=False[, indent=n]) */
static int jr_tojson(jrender *R, const jnode *x, json_t *v, json_t *indent, json_t **out)
{
    if (v == JV_UNDEF) return mf_jr_err(R, x, "tojson of an undefined value");
    size_t flags = JSON_ENCODE_ANY | JSON_PRESERVE_ORDER;
    if (indent && json_is_integer(indent) && json_integer_value(indent) >= 0 && json_integer_value(indent) <= 31)
        flags |= JSON_INDENT(json_integer_value(indent));
    else if (indent && !json_is_null(indent))
        return mf_jr_err(R, x, "tojson indent: an integer 0..31");
    char *s = json_dumps(v, flags);
    if (!s) return -ENOMEM;
    int rc = mf_jr_strv(s, strlen(s), out);
    free(s);
    return rc;
}

static int jr_method(jrender *R, const jnode *x, json_t *obj, const char *m, size_t mn, json_t **out)
{
    json_t *a[3] = {0};
    int n = 0, rc;
#define M(name) (mn == sizeof(name) - 1 && !memcmp(m, name, mn))
    if ((rc = mf_jr_args(R, x, a, 3, &n, NULL))) return rc;
    if (obj != JV_UNDEF && json_is_object(obj) && M("get")) {
        if (n < 1 || n > 2 || a[0] == JV_UNDEF || !json_is_string(a[0])) {
            rc = mf_jr_err(R, x, "get(key[, default]) with a string key");
        } else {
            json_t *v = json_object_getn(obj, json_string_value(a[0]), json_string_length(a[0]));
            *out = v ? json_incref(v) : n == 2 ? jv_keep(a[1]) : json_null();
        }
    } else if (obj != JV_UNDEF && json_is_object(obj) && (M("items") || M("keys") || M("values")) && n == 0) {
        json_t *l = json_array();
        const char *k;
        size_t kn;
        json_t *v;
        if (!l) rc = -ENOMEM;
        json_object_keylen_foreach(obj, k, kn, v) {
            if (rc) break;
            json_t *ks = M("values") ? json_incref(v) : json_stringn_nocheck(k, kn);
            if (ks && M("items")) ks = json_pack("[oO]", ks, v);
            if (!ks || json_array_append_new(l, ks)) rc = -ENOMEM;
        }
        if (rc) json_decref(l);
        else *out = l;
    } else if (obj != JV_UNDEF && json_is_string(obj)) {
        const char *s = json_string_value(obj);
        size_t sn = json_string_length(obj);
        for (int i = 0; i < n; i++)
            if (a[i] == JV_UNDEF || (!json_is_string(a[i]) && !(M("split") && i == 1 && json_is_integer(a[i])) &&
                                     !(M("split") && i == 0 && json_is_null(a[i]))))
                rc = mf_jr_err(R, x, "%.*s: argument %d must be a string", (int)mn, m, i + 1);
        if (rc) {
        } else if ((M("strip") || M("lstrip") || M("rstrip")) && n <= 1) {
            rc = jr_strip(obj, n && !json_is_null(a[0]) ? a[0] : NULL, M("strip") ? 3 : M("lstrip") ? 1 : 2, out);
        } else if ((M("startswith") || M("endswith")) && n == 1) {
            size_t pn = json_string_length(a[0]);
            int hit = pn <= sn && !memcmp(M("startswith") ? s : s + sn - pn, json_string_value(a[0]), pn);
            *out = json_boolean(hit);
        } else if ((M("lower") || M("upper")) && n == 0) {
            char *c = malloc(sn + 1);
            if (!c) return -ENOMEM;
            for (size_t i = 0; i < sn; i++) c[i] = (char)(M("lower") ? tolower((unsigned char)s[i]) : toupper((unsigned char)s[i]));
            rc = mf_jr_strv(c, sn, out);
            free(c);
        } else if (M("replace") && n == 2 && json_string_length(a[0]) > 0) {
            jbuf b = {0};
            const char *f = json_string_value(a[0]);
            size_t fn = json_string_length(a[0]), i = 0;
            rc = mf_jb_add(&b, "", 0);
            while (!rc && i < sn) {
                if (i + fn <= sn && !memcmp(s + i, f, fn)) {
                    rc = mf_jb_add(&b, json_string_value(a[1]), json_string_length(a[1]));
                    i += fn;
                } else {
                    rc = mf_jb_add(&b, s + i++, 1);
                }
            }
            if (!rc) rc = mf_jr_strv(b.p, b.n, out);
            free(b.p);
        } else if (M("split") && n <= 2) {
            long long maxs = n == 2 ? json_integer_value(a[1]) : -1;
            json_t *l = json_array();
            if (!l) return -ENOMEM;
            if (n == 0 || json_is_null(a[0])) {   /* runs of whitespace, none at the ends */
                size_t i = 0, w;
                while (!rc) {
                    while (i < sn && jj_space_at(s, sn, i, &w)) i += w;
                    if (i >= sn) break;
                    size_t j = i;
                    if (maxs >= 0 && (long long)json_array_size(l) == maxs) {
                        size_t e = sn;
                        while (e > j && jj_space_at(s, sn, e - 1, &w)) e--;
                        if (json_array_append_new(l, json_stringn_nocheck(s + j, e - j))) rc = -ENOMEM;
                        break;
                    }
                    while (j < sn && !jj_space_at(s, sn, j, &w)) j++;
                    if (json_array_append_new(l, json_stringn_nocheck(s + i, j - i))) rc = -ENOMEM;
                    i = j;
                }
            } else {
                const char *f = json_string_value(a[0]);
                size_t fn = json_string_length(a[0]), i = 0, st = 0;
                if (!fn) rc = mf_jr_err(R, x, "split: empty separator");
                while (!rc && i + fn <= sn) {
                    if ((maxs < 0 || (long long)json_array_size(l) < maxs) && !memcmp(s + i, f, fn)) {
                        if (json_array_append_new(l, json_stringn_nocheck(s + st, i - st))) rc = -ENOMEM;
                        i += fn;
                        st = i;
                    } else {
                        i++;
                    }
                }
                if (!rc && json_array_append_new(l, json_stringn_nocheck(s + st, sn - st))) rc = -ENOMEM;
            }
            if (rc) json_decref(l);
            else *out = l;
        } else {
            rc = mf_jr_err(R, x, "unsupported string method '%.*s' (or its arguments)", (int)mn, m);
        }
    } else {
        rc = mf_jr_err(R, x, "unsupported method '%.*s' of %s", (int)mn, m, mf_jv_type(obj));
    }
#undef M
    mf_jr_drop_args(a, n);
    return rc;
}

int mf_jr_call(jrender *R, const jnode *x, json_t **out)
{
    const jnode *f = x->a;
    int rc;
    if (f->kind == E_ATTR) {
        json_t *obj;
        if ((rc = mf_jr_eval(R, f->a, &obj))) return rc;
        rc = jr_method(R, x, obj, f->s, f->n, out);
        jv_drop(obj);
        return rc;
    }
#define F(name) (f->kind == E_NAME && f->n == sizeof(name) - 1 && !memcmp(f->s, name, f->n) && !mf_jr_lookup(R, f->s, f->n))
    if (F("namespace")) {
        json_t *kw = json_object(), *a[1];
        int n;
        if (!kw) return -ENOMEM;
        if ((rc = mf_jr_args(R, x, a, 0, &n, kw))) {
            json_decref(kw);
            return rc;
        }
        if (R->n_ns == (int)(sizeof R->ns / sizeof R->ns[0])) {
            json_decref(kw);
            return mf_jr_err(R, x, "more than %d namespace() objects", (int)(sizeof R->ns / sizeof R->ns[0]));
        }
        R->ns[R->n_ns++] = kw;   /* the list's reference: freed at the render's end */
        *out = json_incref(kw);
        return 0;
    }
    if (F("raise_exception")) {
        json_t *a[1];
        int n;
        if ((rc = mf_jr_args(R, x, a, 1, &n, NULL))) return rc;
        jbuf b = {0};
        if (n) rc = mf_jv_str(&b, a[0]);
        mf_jr_drop_args(a, n);
        if (!rc) rc = mf_jr_err(R, x, "raise_exception: %s", b.p ? b.p : "");
        free(b.p);
        return rc;
    }
    if (F("range")) {
        json_t *a[3];
        int n;
        long long v[3] = {0, 0, 1};
        if ((rc = mf_jr_args(R, x, a, 3, &n, NULL))) return rc;
        for (int i = 0; i < n; i++)
            if (a[i] == JV_UNDEF || !json_is_integer(a[i])) rc = mf_jr_err(R, x, "range() takes integers");
        if (!rc && n == 0) rc = mf_jr_err(R, x, "range() needs an argument");
        if (!rc) {
            if (n == 1) v[1] = json_integer_value(a[0]);
            for (int i = 0; n > 1 && i < n; i++) v[i] = json_integer_value(a[i]);
            if (!v[2]) rc = mf_jr_err(R, x, "range() step 0");
        }
        mf_jr_drop_args(a, n);
        if (rc) return rc;
        json_t *l = json_array();
        if (!l) return -ENOMEM;
        for (long long i = v[0]; v[2] > 0 ? i < v[1] : i > v[1]; i += v[2]) {
            if (json_array_size(l) >= JJ_MAX_ITER) {
                json_decref(l);
                return mf_error(-E2BIG, "chat template: range() of more than %d values", JJ_MAX_ITER);
            }
            if (json_array_append_new(l, json_integer(i))) {
                json_decref(l);
                return -ENOMEM;
            }
        }
        *out = l;
        return 0;
    }
#undef F
    if (f->kind == E_NAME) return mf_jr_err(R, x, "unsupported function '%.*s'", (int)f->n, f->s);
    return mf_jr_err(R, x, "only named functions and methods can be called");
}

int mf_jr_filter(jrender *R, const jnode *x, json_t *v, json_t **out)
{
    json_t *a[2] = {0}, *kw = json_object();
    int n = 0, rc;
    if (!kw) return -ENOMEM;
    if ((rc = mf_jr_args(R, x, a, 2, &n, kw))) goto done;
#define M(name) (x->n == sizeof(name) - 1 && !memcmp(x->s, name, x->n))
    if ((M("trim") || M("lower") || M("upper")) && n == 0) {   /* of str(v), as Jinja's soft_str */
        jbuf b = {0};
        json_t *sv = NULL;
        rc = mf_jb_add(&b, "", 0);
        if (!rc) rc = mf_jv_str(&b, v);
        if (!rc) rc = mf_jr_strv(b.p, b.n, &sv);
        free(b.p);
        if (!rc && M("trim")) {
            rc = jr_strip(sv, NULL, 3, out);
        } else if (!rc) {
            jnode call = *x;
            call.args = NULL;
            rc = jr_method(R, &call, sv, x->s, x->n, out);
        }
        jv_drop(sv);
    } else if ((M("length") || M("count")) && n == 0) {
        if (v == JV_UNDEF) *out = json_integer(0);
        else if (json_is_string(v)) {
            long long c = 0;
            for (size_t j = 0; j < json_string_length(v); j++) c += ((unsigned char)json_string_value(v)[j] & 0xc0) != 0x80;
            *out = json_integer(c);
        } else if (json_is_array(v)) *out = json_integer((json_int_t)json_array_size(v));
        else if (json_is_object(v)) *out = json_integer((json_int_t)json_object_size(v));
        else rc = mf_jr_err(R, x, "length of %s", mf_jv_type(v));
    } else if (M("tojson") && n <= 1) {
        json_t *ind = n ? a[0] : json_object_get(kw, "indent");
        if (ind == JV_UNDEF) ind = NULL;
        rc = jr_tojson(R, x, v, ind, out);
    } else if (M("string") && n == 0) {
        jbuf b = {0};
        rc = mf_jb_add(&b, "", 0);
        if (!rc) rc = mf_jv_str(&b, v);
        if (!rc) rc = mf_jr_strv(b.p, b.n, out);
        free(b.p);
    } else if ((M("default") || M("d")) && n <= 2) {
        int use = v == JV_UNDEF || (n == 2 && mf_jv_truthy(a[1]) == 1 && !mf_jv_truthy(v));
        *out = use ? (n ? jv_keep(a[0]) : json_string("")) : jv_keep(v);
        if (!*out) rc = -ENOMEM;
    } else if ((M("first") || M("last")) && n == 0) {
        if (v != JV_UNDEF && json_is_array(v)) {
            size_t k = json_array_size(v);
            *out = k ? json_incref(json_array_get(v, M("first") ? 0 : k - 1)) : JV_UNDEF;
        } else rc = mf_jr_err(R, x, "%.*s of %s", (int)x->n, x->s, mf_jv_type(v));
    } else if (M("join") && n <= 1) {
        if (v == JV_UNDEF || !json_is_array(v)) {
            rc = mf_jr_err(R, x, "join of %s", mf_jv_type(v));
        } else if (n && (a[0] == JV_UNDEF || !json_is_string(a[0]))) {
            rc = mf_jr_err(R, x, "join: the separator must be a string");
        } else {
            jbuf b = {0};
            rc = mf_jb_add(&b, "", 0);
            for (size_t i = 0; !rc && i < json_array_size(v); i++) {
                if (i && n) rc = mf_jb_add(&b, json_string_value(a[0]), json_string_length(a[0]));
                if (!rc) rc = mf_jv_str(&b, json_array_get(v, i));
            }
            if (!rc) rc = mf_jr_strv(b.p, b.n, out);
            free(b.p);
        }
    } else if (M("safe") && n == 0) {
        *out = jv_keep(v);
    } else if (M("int") && n == 0) {
        double f;
        long long i;
        int isint;
        if (mf_jv_num(v, &f, &i, &isint)) *out = json_integer(isint ? i : (json_int_t)f);
        else rc = mf_jr_err(R, x, "int of %s is not supported", mf_jv_type(v));
    } else {
        rc = mf_jr_err(R, x, "unsupported filter '%.*s' (or its arguments)", (int)x->n, x->s);
    }
#undef M
    if (!rc && !*out) rc = -ENOMEM;
done:
    mf_jr_drop_args(a, n);
    json_decref(kw);
    return rc;
}

int mf_jr_test(jrender *R, const jnode *x, json_t *v, int *hit)
{
    if (x->args) return mf_jr_err(R, x, "tests with arguments are not supported");
#define M(name) (x->n == sizeof(name) - 1 && !memcmp(x->s, name, x->n))
    int u = v == JV_UNDEF;
    json_type t = u ? JSON_NULL : json_typeof(v);
    if (M("defined")) *hit = !u;
    else if (M("undefined")) *hit = u;
    else if (M("none")) *hit = !u && t == JSON_NULL;
    else if (M("string")) *hit = !u && t == JSON_STRING;
    else if (M("number")) *hit = !u && (t == JSON_INTEGER || t == JSON_REAL);
    else if (M("integer")) *hit = !u && t == JSON_INTEGER;
    else if (M("float")) *hit = !u && t == JSON_REAL;
    else if (M("boolean")) *hit = !u && (t == JSON_TRUE || t == JSON_FALSE);
    else if (M("true")) *hit = !u && t == JSON_TRUE;
    else if (M("false")) *hit = !u && t == JSON_FALSE;
    else if (M("mapping")) *hit = !u && t == JSON_OBJECT;
    else if (M("sequence")) *hit = !u && (t == JSON_ARRAY || t == JSON_STRING || t == JSON_OBJECT);
    else if (M("iterable")) *hit = u || t == JSON_ARRAY || t == JSON_STRING || t == JSON_OBJECT;
    else return mf_jr_err(R, x, "unsupported test '%.*s'", (int)x->n, x->s);
#undef M
    if (x->neg) *hit = !*hit;
    return 0;
}
