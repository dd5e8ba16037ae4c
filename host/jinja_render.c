/* The renderer of the Jinja2 subset (host/jinja.h): walks jinja_parse.c's nodes over jansson
 * values with Python's semantics: names through a stack of scopes (a for loop's iterations each
 * get a fresh one, `if` none), subscripts and slices, operators, for loops with loop.*, set, and
 * mf_jinja_render. Filters, tests, methods and global functions are in jinja_builtin.c. */
#include "host/jinja_internal.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/error.h"

int mf_jr_err(jrender *R, const jnode *x, const char *fmt, ...)
{
    char m[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    return mf_jj_err(R->t->src, x->pos, -EINVAL, "%s", m);
}

json_t *mf_jr_lookup(jrender *R, const char *s, size_t n)
{
    for (int f = R->n_frames - 1; f >= 0; f--) {
        json_t *v = json_object_getn(R->frames[f], s, n);
        if (v) return v;
    }
    return NULL;
}

static int jr_new(json_t *v, json_t **out)
{
    if (!v) return -ENOMEM;
    *out = v;
    return 0;
}

int mf_jr_strv(const char *s, size_t n, json_t **out) { return jr_new(json_stringn_nocheck(s, n), out); }

void mf_jr_drop_args(json_t **pos, int n)
{
    for (int i = 0; i < n; i++) jv_drop(pos[i]);
}

/* A call's arguments: positional ones into pos (at most max_pos), keyword ones into kw. On an error
 * the positional values taken so far are dropped and *n_pos is 0, so a caller only drops after
 * success. */
int mf_jr_args(jrender *R, const jnode *x, json_t **pos, int max_pos, int *n_pos, json_t *kw)
{
    int rc = 0;
    *n_pos = 0;
    for (const jnode *g = x->args; g && !rc; g = g->next) {
        json_t *v;
        if ((rc = mf_jr_eval(R, g->kind == E_KW ? g->a : g, &v))) break;
        if (g->kind == E_KW) {
            if (!kw || v == JV_UNDEF) {
                jv_drop(v);
                rc = mf_jr_err(R, g, kw ? "keyword argument '%.*s' is undefined" : "keyword argument '%.*s' is not supported here",
                          (int)g->n, g->s);
            } else if (json_object_setn_new_nocheck(kw, g->s, g->n, v)) {
                rc = -ENOMEM;
            }
        } else if (*n_pos == max_pos) {
            jv_drop(v);
            rc = mf_jr_err(R, g, "too many arguments");
        } else {
            pos[(*n_pos)++] = v;
        }
    }
    if (rc) {
        mf_jr_drop_args(pos, *n_pos);
        *n_pos = 0;
    }
    return rc;
}

/* a code-point slice of a string or a slice of a list, Python's rules */
static int jr_slice(jrender *R, const jnode *x, json_t *obj, json_t **out)
{
    json_t *part[3] = {0};
    const jnode *pn[3] = {x->b, x->c, x->cond};
    long long p[3] = {0};
    int has[3] = {0}, rc = 0;
    for (int i = 0; i < 3 && !rc; i++) {
        if (!pn[i]) continue;
        if ((rc = mf_jr_eval(R, pn[i], &part[i]))) break;
        if (part[i] != JV_UNDEF && json_is_null(part[i])) continue;
        if (part[i] == JV_UNDEF || !json_is_integer(part[i])) rc = mf_jr_err(R, x, "slice bounds must be integers");
        else {
            p[i] = json_integer_value(part[i]);
            has[i] = 1;
        }
    }
    for (int i = 0; i < 3; i++) jv_drop(part[i]);
    if (rc) return rc;
    long long step = has[2] ? p[2] : 1;
    if (!step) return mf_jr_err(R, x, "slice step 0");
    int is_str = obj != JV_UNDEF && json_is_string(obj);
    if (!is_str && (obj == JV_UNDEF || !json_is_array(obj))) return mf_jr_err(R, x, "cannot slice %s", mf_jv_type(obj));
    const char *s = is_str ? json_string_value(obj) : NULL;
    size_t sn = is_str ? json_string_length(obj) : 0;
    size_t *cp = NULL;   /* a string's code point offsets */
    long long len = 0;
    if (is_str) {
        if (!(cp = malloc(sizeof *cp * (sn + 1)))) return -ENOMEM;
        for (size_t i = 0; i < sn; i++)
            if (((unsigned char)s[i] & 0xc0) != 0x80) cp[len++] = i;
        cp[len] = sn;
    } else {
        len = (long long)json_array_size(obj);
    }
    long long lo, hi;
    for (int i = 0; i < 2; i++) {
        long long *d = i ? &hi : &lo;
        if (!has[i]) {
            *d = step > 0 ? (i ? len : 0) : (i ? -1 : len - 1);
            continue;
        }
        long long v = p[i] < 0 ? p[i] + len : p[i];
        if (step > 0) *d = v < 0 ? 0 : v > len ? len : v;
        else *d = v < -1 ? -1 : v > len - 1 ? len - 1 : v;
    }
    jbuf b = {0};
    json_t *l = is_str ? NULL : json_array();
    if (is_str) rc = mf_jb_add(&b, "", 0);
    else if (!l) rc = -ENOMEM;
    for (long long i = lo; !rc && (step > 0 ? i < hi : i > hi); i += step) {
        if (is_str) rc = mf_jb_add(&b, s + cp[i], cp[i + 1] - cp[i]);
        else if (json_array_append(l, json_array_get(obj, (size_t)i))) rc = -ENOMEM;
    }
    free(cp);
    if (!rc) rc = is_str ? mf_jr_strv(b.p, b.n, out) : (*out = l, 0);
    else if (l) json_decref(l);
    free(b.p);
    return rc;
}

static int jr_index(jrender *R, const jnode *x, json_t *obj, json_t *key, json_t **out)
{
    if (obj == JV_UNDEF) return mf_jr_err(R, x, "subscript of an undefined value");
    if (json_is_object(obj)) {
        json_t *v = key != JV_UNDEF && json_is_string(key) ? json_object_getn(obj, json_string_value(key), json_string_length(key)) : NULL;
        *out = v ? json_incref(v) : JV_UNDEF;
        return 0;
    }
    if ((json_is_array(obj) || json_is_string(obj)) && key != JV_UNDEF && json_is_integer(key)) {
        long long i = json_integer_value(key);
        if (json_is_array(obj)) {
            long long n = (long long)json_array_size(obj);
            if (i < 0) i += n;
            *out = i >= 0 && i < n ? json_incref(json_array_get(obj, (size_t)i)) : JV_UNDEF;
            return 0;
        }
        const char *s = json_string_value(obj);
        size_t sn = json_string_length(obj);
        long long n = 0;
        for (size_t j = 0; j < sn; j++) n += ((unsigned char)s[j] & 0xc0) != 0x80;
        if (i < 0) i += n;
        if (i < 0 || i >= n) {
            *out = JV_UNDEF;
            return 0;
        }
        long long c = -1;
        for (size_t j = 0; j < sn; j++) {
            if (((unsigned char)s[j] & 0xc0) != 0x80 && ++c == i) {
                size_t e = j + 1;
                while (e < sn && ((unsigned char)s[e] & 0xc0) == 0x80) e++;
                return mf_jr_strv(s + j, e - j, out);
            }
        }
    }
    *out = JV_UNDEF;   /* Jinja: a missing item is undefined */
    return 0;
}

static int jr_binop(jrender *R, const jnode *x, json_t *a, json_t *b, json_t **out)
{
    const char *op = x->op;
    double fa, fb;
    long long ia, ib;
    int ka, kb;
    int na = mf_jv_num(a, &fa, &ia, &ka), nb = mf_jv_num(b, &fb, &ib, &kb);
    if (!strcmp(op, "~")) {
        jbuf s = {0};
        int rc = mf_jb_add(&s, "", 0);
        if (!rc) rc = mf_jv_str(&s, a);
        if (!rc) rc = mf_jv_str(&s, b);
        if (!rc) rc = mf_jr_strv(s.p, s.n, out);
        free(s.p);
        return rc;
    }
    if (!strcmp(op, "==") || !strcmp(op, "!=")) {
        int e = mf_jv_eq(a, b);
        *out = json_boolean(op[0] == '=' ? e : !e);
        return 0;
    }
    if (!strcmp(op, "in") || !strcmp(op, "ni")) {
        int hit = 0;
        if (b == JV_UNDEF) {
            hit = 0;
        } else if (json_is_string(b)) {
            if (a == JV_UNDEF || !json_is_string(a)) return mf_jr_err(R, x, "'in <string>' needs a string on the left, got %s", mf_jv_type(a));
            const char *h = json_string_value(b), *nd = json_string_value(a);
            size_t hn = json_string_length(b), nn = json_string_length(a);
            for (size_t i = 0; !hit && i + nn <= hn; i++) hit = !memcmp(h + i, nd, nn);
        } else if (json_is_array(b)) {
            for (size_t i = 0; !hit && i < json_array_size(b); i++) hit = mf_jv_eq(a, json_array_get(b, i));
        } else if (json_is_object(b)) {
            hit = a != JV_UNDEF && json_is_string(a) && json_object_getn(b, json_string_value(a), json_string_length(a));
        } else {
            return mf_jr_err(R, x, "'in' of %s", mf_jv_type(b));
        }
        *out = json_boolean(op[0] == 'i' ? hit : !hit);
        return 0;
    }
    if (op[0] == '<' || op[0] == '>') {
        int c;
        if (na && nb) c = fa < fb ? -1 : fa > fb;
        else if (a != JV_UNDEF && b != JV_UNDEF && json_is_string(a) && json_is_string(b)) {
            size_t an = json_string_length(a), bn = json_string_length(b);
            int m = memcmp(json_string_value(a), json_string_value(b), an < bn ? an : bn);
            c = m ? (m < 0 ? -1 : 1) : an < bn ? -1 : an > bn;
        } else {
            return mf_jr_err(R, x, "'%s' between %s and %s", op, mf_jv_type(a), mf_jv_type(b));
        }
        int r = op[0] == '<' ? (op[1] ? c <= 0 : c < 0) : (op[1] ? c >= 0 : c > 0);
        *out = json_boolean(r);
        return 0;
    }
    if (!strcmp(op, "+") && a != JV_UNDEF && b != JV_UNDEF && json_is_string(a) && json_is_string(b)) {
        size_t an = json_string_length(a), bn = json_string_length(b);
        if (an + bn > JJ_MAX_OUT) return mf_error(-E2BIG, "chat template: a string past %zu bytes", JJ_MAX_OUT);
        char *s = malloc(an + bn + 1);
        if (!s) return -ENOMEM;
        memcpy(s, json_string_value(a), an);
        memcpy(s + an, json_string_value(b), bn);
        int rc = mf_jr_strv(s, an + bn, out);
        free(s);
        return rc;
    }
    if (!strcmp(op, "+") && a != JV_UNDEF && b != JV_UNDEF && json_is_array(a) && json_is_array(b)) {
        json_t *l = json_copy(a);
        if (!l || json_array_extend(l, b)) {
            jv_drop(l);
            return -ENOMEM;
        }
        *out = l;
        return 0;
    }
    if (!strcmp(op, "*") && ((na && ka && b != JV_UNDEF && json_is_string(b)) || (nb && kb && a != JV_UNDEF && json_is_string(a)))) {
        json_t *str = na ? b : a;   /* a string repeated */
        long long k = na ? ia : ib;
        size_t sn = json_string_length(str);
        if (k < 0) k = 0;
        if (sn && (size_t)k > JJ_MAX_OUT / sn) return mf_error(-E2BIG, "chat template: a string past %zu bytes", JJ_MAX_OUT);
        char *r = malloc(sn * (size_t)k + 1);
        if (!r) return -ENOMEM;
        for (long long i = 0; i < k; i++) memcpy(r + sn * (size_t)i, json_string_value(str), sn);
        int rc = mf_jr_strv(r, sn * (size_t)k, out);
        free(r);
        return rc;
    }
    if (!na || !nb) return mf_jr_err(R, x, "'%s' between %s and %s", op, mf_jv_type(a), mf_jv_type(b));
    int ints = ka && kb;
    if (op[0] == '+' || op[0] == '-' || (op[0] == '*' && !op[1])) {
        if (ints) {
            long long r;
            int ov = op[0] == '+' ? __builtin_add_overflow(ia, ib, &r) : op[0] == '-' ? __builtin_sub_overflow(ia, ib, &r)
                                                                                      : __builtin_mul_overflow(ia, ib, &r);
            if (ov) return mf_jr_err(R, x, "integer overflow");
            *out = json_integer(r);
        } else {
            *out = json_real(op[0] == '+' ? fa + fb : op[0] == '-' ? fa - fb : fa * fb);
        }
        return *out ? 0 : -ENOMEM;
    }
    if ((ints && ib == 0) || (!ints && fb == 0)) return mf_jr_err(R, x, "division by zero");
    if (!strcmp(op, "/")) {
        *out = json_real(fa / fb);
    } else if (ints) {   /* // and %: Python floors */
        if (ia == LLONG_MIN && ib == -1) return mf_jr_err(R, x, "integer overflow");
        long long q = ia / ib, r = ia % ib;
        if (r && ((r < 0) != (ib < 0))) {
            q--;
            r += ib;
        }
        *out = json_integer(op[0] == '%' ? r : q);
    } else {
        double q = floor(fa / fb);
        *out = json_real(op[0] == '%' ? fa - q * fb : q);
    }
    return *out ? 0 : -ENOMEM;
}

int mf_jr_eval(jrender *R, const jnode *x, json_t **out)
{
    json_t *a = NULL, *b = NULL;
    int rc = 0;
    *out = NULL;
    switch (x->kind) {
    case E_LIT:
        *out = json_incref(x->lit);
        return 0;
    case E_NAME: {
        json_t *v = mf_jr_lookup(R, x->s, x->n);
        *out = v ? json_incref(v) : JV_UNDEF;
        return 0;
    }
    case E_ATTR:
        if ((rc = mf_jr_eval(R, x->a, &a))) return rc;
        if (a == JV_UNDEF) rc = mf_jr_err(R, x, "'.%.*s' of an undefined value", (int)x->n, x->s);
        else if (json_is_object(a)) {
            json_t *v = json_object_getn(a, x->s, x->n);
            *out = v ? json_incref(v) : JV_UNDEF;
        } else {
            *out = JV_UNDEF;
        }
        jv_drop(a);
        return rc;
    case E_INDEX:
        if ((rc = mf_jr_eval(R, x->a, &a))) return rc;
        if (!(rc = mf_jr_eval(R, x->b, &b))) rc = jr_index(R, x, a, b, out);
        jv_drop(a);
        jv_drop(b);
        return rc;
    case E_SLICE:
        if ((rc = mf_jr_eval(R, x->a, &a))) return rc;
        rc = jr_slice(R, x, a, out);
        jv_drop(a);
        return rc;
    case E_CALL:
        return mf_jr_call(R, x, out);
    case E_FILTER:
        if ((rc = mf_jr_eval(R, x->a, &a))) return rc;
        rc = mf_jr_filter(R, x, a, out);
        jv_drop(a);
        return rc;
    case E_TEST: {
        int hit = 0;
        if ((rc = mf_jr_eval(R, x->a, &a))) return rc;
        rc = mf_jr_test(R, x, a, &hit);
        jv_drop(a);
        if (!rc) *out = json_boolean(hit);
        return rc;
    }
    case E_NEG: {
        double f;
        long long i;
        int isint;
        if ((rc = mf_jr_eval(R, x->a, &a))) return rc;
        if (!mf_jv_num(a, &f, &i, &isint)) rc = mf_jr_err(R, x, "'-' of %s", mf_jv_type(a));
        else if (isint && i == LLONG_MIN) rc = mf_jr_err(R, x, "integer overflow");
        else *out = isint ? json_integer(-i) : json_real(-f);
        jv_drop(a);
        return rc;
    }
    case E_NOT:
        if ((rc = mf_jr_eval(R, x->a, &a))) return rc;
        *out = json_boolean(!mf_jv_truthy(a));
        jv_drop(a);
        return 0;
    case E_AND: case E_OR:   /* Python's: the deciding operand itself */
        if ((rc = mf_jr_eval(R, x->a, &a))) return rc;
        if (mf_jv_truthy(a) == (x->kind == E_OR)) {
            *out = a;
            return 0;
        }
        jv_drop(a);
        return mf_jr_eval(R, x->b, out);
    case E_COND:
        if ((rc = mf_jr_eval(R, x->cond, &a))) return rc;
        int t = mf_jv_truthy(a);
        jv_drop(a);
        if (t) return mf_jr_eval(R, x->a, out);
        if (x->b) return mf_jr_eval(R, x->b, out);
        *out = JV_UNDEF;
        return 0;
    case E_BIN:
        if ((rc = mf_jr_eval(R, x->a, &a))) return rc;
        if (!(rc = mf_jr_eval(R, x->b, &b))) rc = jr_binop(R, x, a, b, out);
        jv_drop(a);
        jv_drop(b);
        return rc;
    case E_LIST: case E_DICT: {
        json_t *c = x->kind == E_LIST ? json_array() : json_object();
        if (!c) return -ENOMEM;
        for (const jnode *g = x->args; g && !rc; g = g->next) {
            if ((rc = mf_jr_eval(R, g, &a))) break;
            if (a == JV_UNDEF) {
                rc = mf_jr_err(R, g, "an undefined value in a %s literal", x->kind == E_LIST ? "list" : "dict");
            } else if (x->kind == E_LIST) {
                if (json_array_append(c, a)) rc = -ENOMEM;
            } else {
                g = g->next;
                if (!json_is_string(a)) rc = mf_jr_err(R, g, "dict keys must be strings");
                else if (!(rc = mf_jr_eval(R, g, &b))) {
                    if (b == JV_UNDEF) rc = mf_jr_err(R, g, "an undefined value in a dict literal");
                    else if (json_object_setn_nocheck(c, json_string_value(a), json_string_length(a), b)) rc = -ENOMEM;
                    jv_drop(b);
                }
            }
            jv_drop(a);
        }
        if (rc) json_decref(c);
        else *out = c;
        return rc;
    }
    default:
        return mf_jr_err(R, x, "not an expression");
    }
}

static int jr_body(jrender *R, const jnode *s);

static int jr_push(jrender *R, const jnode *at)
{
    if (R->n_frames == JJ_MAX_DEPTH + 2) return mf_jr_err(R, at, "loops nested deeper than %d", JJ_MAX_DEPTH);
    if (!(R->frames[R->n_frames] = json_object())) return -ENOMEM;
    R->n_frames++;
    return 0;
}
static void jr_pop(jrender *R) { json_decref(R->frames[--R->n_frames]); }

static int jr_set_loopvars(json_t *f, const jnode *s, json_t *item, json_t *items, size_t i, size_t n)
{
    json_t *loop = json_pack("{sIsIsIsIsbsbsI}", "index0", (json_int_t)i, "index", (json_int_t)i + 1, "revindex",
                             (json_int_t)(n - i), "revindex0", (json_int_t)(n - i - 1), "first", i == 0, "last",
                             i + 1 == n, "length", (json_int_t)n);
    if (!loop) return -ENOMEM;
    if (i > 0) json_object_set(loop, "previtem", json_array_get(items, i - 1));
    if (i + 1 < n) json_object_set(loop, "nextitem", json_array_get(items, i + 1));
    if (json_object_set_new(f, "loop", loop)) return -ENOMEM;
    if (s->s2) {
        if (!json_is_array(item) || json_array_size(item) != 2) return 1;   /* the caller names the error */
        if (json_object_setn_nocheck(f, s->s, s->n, json_array_get(item, 0)) ||
            json_object_setn_nocheck(f, s->s2, s->n2, json_array_get(item, 1)))
            return -ENOMEM;
        return 0;
    }
    return json_object_setn_nocheck(f, s->s, s->n, item) ? -ENOMEM : 0;
}

static int jr_for(jrender *R, const jnode *s)
{
    json_t *it, *items = NULL;
    int rc;
    if ((rc = mf_jr_eval(R, s->a, &it))) return rc;
    /* the sequence: a list's items, a dict's keys, a string's characters; undefined: none */
    if (it == JV_UNDEF) {
        items = json_array();
    } else if (json_is_array(it)) {
        items = json_incref(it);
    } else if (json_is_object(it) || json_is_string(it)) {
        items = json_array();
        if (items && json_is_object(it)) {
            const char *k;
            size_t kn;
            json_t *v;
            json_object_keylen_foreach(it, k, kn, v) if (json_array_append_new(items, json_stringn_nocheck(k, kn))) rc = -ENOMEM;
        } else if (items) {
            const char *t = json_string_value(it);
            size_t n = json_string_length(it);
            for (size_t i = 0; i < n && !rc;) {
                size_t e = i + 1;
                while (e < n && ((unsigned char)t[e] & 0xc0) == 0x80) e++;
                if (json_array_append_new(items, json_stringn_nocheck(t + i, e - i))) rc = -ENOMEM;
                i = e;
            }
        }
    } else {
        rc = mf_jr_err(R, s->a, "cannot loop over %s", mf_jv_type(it));
    }
    jv_drop(it);
    if (!rc && !items) rc = -ENOMEM;
    if (!rc && s->cond) {   /* for x in y if cond: filtered first, so loop.* counts what is left */
        json_t *kept = json_array();
        if (!kept) rc = -ENOMEM;
        for (size_t i = 0; !rc && i < json_array_size(items); i++) {
            if ((rc = jr_push(R, s))) break;
            json_t *c = NULL;
            rc = jr_set_loopvars(R->frames[R->n_frames - 1], s, json_array_get(items, i), items, 0, 1);
            if (rc == 1) rc = mf_jr_err(R, s, "cannot unpack an item into two loop variables");
            if (!rc) json_object_del(R->frames[R->n_frames - 1], "loop");
            if (!rc && !(rc = mf_jr_eval(R, s->cond, &c)) && mf_jv_truthy(c) && json_array_append(kept, json_array_get(items, i)))
                rc = -ENOMEM;
            jv_drop(c);
            jr_pop(R);
        }
        json_decref(items);
        items = kept;
    }
    size_t n = items ? json_array_size(items) : 0;
    for (size_t i = 0; !rc && i < n; i++) {
        if (++R->iters > JJ_MAX_ITER) {
            rc = mf_error(-E2BIG, "chat template: more than %d loop iterations", JJ_MAX_ITER);
            break;
        }
        if ((rc = jr_push(R, s))) break;
        rc = jr_set_loopvars(R->frames[R->n_frames - 1], s, json_array_get(items, i), items, i, n);
        if (rc == 1) rc = mf_jr_err(R, s, "cannot unpack an item into two loop variables");
        if (!rc) rc = jr_body(R, s->b);
        jr_pop(R);
        int ctl = R->ctl;
        R->ctl = 0;
        if (ctl == 1) break;
    }
    if (!rc && n == 0 && s->c) rc = jr_body(R, s->c);
    jv_drop(items);
    return rc;
}

static int jr_body(jrender *R, const jnode *s)
{
    int rc = 0;
    for (; s && !rc && !R->ctl; s = s->next) {
        json_t *v = NULL;
        switch (s->kind) {
        case S_TEXT:
            rc = mf_jb_add(&R->out, s->s, s->n);
            break;
        case S_OUT:
            if (!(rc = mf_jr_eval(R, s->a, &v))) rc = mf_jv_str(&R->out, v);
            jv_drop(v);
            break;
        case S_IF:
            if ((rc = mf_jr_eval(R, s->a, &v))) break;
            rc = jr_body(R, mf_jv_truthy(v) ? s->b : s->c);
            jv_drop(v);
            break;
        case S_FOR:
            rc = jr_for(R, s);
            break;
        case S_SET:
            if ((rc = mf_jr_eval(R, s->a, &v))) break;
            if (v == JV_UNDEF) {   /* Jinja keeps an undefined value; we drop the name, the same to every reader */
                if (!s->s2) {
                    json_t *f = R->frames[R->n_frames - 1];
                    char nm[256];
                    if (s->n < sizeof nm) {
                        memcpy(nm, s->s, s->n);
                        nm[s->n] = 0;
                        json_object_del(f, nm);
                    }
                    break;
                }
                rc = mf_jr_err(R, s, "setting an attribute to an undefined value");
                break;
            }
            if (s->s2) {
                json_t *o = mf_jr_lookup(R, s->s, s->n);
                int ok = 0;
                for (int i = 0; o && i < R->n_ns; i++) ok |= R->ns[i] == o;
                if (!ok) rc = mf_jr_err(R, s, "'%.*s' is not a namespace(): its attributes cannot be set", (int)s->n, s->s);
                else if (json_object_setn_nocheck(o, s->s2, s->n2, v)) rc = -ENOMEM;
            } else if (json_object_setn_nocheck(R->frames[R->n_frames - 1], s->s, s->n, v)) {
                rc = -ENOMEM;
            }
            jv_drop(v);
            break;
        case S_BREAK: case S_CONTINUE:
            R->ctl = s->kind == S_BREAK ? 1 : 2;
            break;
        }
    }
    return rc;
}

int mf_jinja_render(const mf_jinja *t, const json_t *ctx, char **out, size_t *n_out)
{
    *out = NULL;
    *n_out = 0;
    if (!json_is_object(ctx)) return mf_error(-EINVAL, "chat template: the context must be a JSON object");
    jrender R = {.t = t};
    R.frames[0] = json_copy((json_t *)ctx);   /* shallow: a top-level set must not change the caller's */
    if (!R.frames[0]) return -ENOMEM;
    R.n_frames = 1;
    int rc = mf_jb_add(&R.out, "", 0);
    if (!rc) rc = jr_body(&R, t->body);
    if (rc == -E2BIG && !strstr(mf_last_error(), "chat template")) mf_error(rc, "chat template: output past %zu bytes", JJ_MAX_OUT);
    while (R.n_frames) jr_pop(&R);
    for (int i = 0; i < R.n_ns; i++) json_decref(R.ns[i]);
    if (rc) {
        free(R.out.p);
        return rc;
    }
    *out = R.out.p;
    *n_out = R.out.n;
    return 0;
}
