/* The Jinja2 subset of host/jinja.h: a lexer that applies the whitespace rules (trim_blocks,
 * lstrip_blocks, {%- -%}) to the text, a recursive-descent parser into an arena of nodes, and a
 * tree-walking renderer over jansson values (Python's str(), truthiness, scoping: a for loop's
 * iterations each get a fresh scope, `if` none). */
#include "host/jinja.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/error.h"

#define JJ_MAX_DEPTH 64          /* block and bracket nesting */
#define JJ_MAX_EXPR_DEPTH 256    /* an expression tree's height (chains of a + b + ...) */
#define JJ_MAX_OUT ((size_t)64 << 20)
#define JJ_MAX_ITER (1 << 20)

/* ---- tokens ---------------------------------------------------------------------------------- */

enum { T_EOF, T_TEXT, T_VOPEN, T_VCLOSE, T_BOPEN, T_BCLOSE, T_NAME, T_INT, T_FLOAT, T_STR, T_OP };

typedef struct jtok {
    int type, pos;
    const char *s;   /* T_TEXT, T_NAME: into the source; T_STR: the unescaped bytes (owned) */
    size_t n;
    long long iv;
    double fv;
    char op[3];
} jtok;

/* ---- nodes ----------------------------------------------------------------------------------- */

enum {
    /* expressions */
    E_LIT, E_NAME, E_ATTR, E_INDEX, E_SLICE, E_CALL, E_FILTER, E_TEST, E_NEG, E_NOT, E_BIN, E_AND, E_OR,
    E_COND, E_LIST, E_DICT, E_KW,
    /* statements */
    S_TEXT, S_OUT, S_IF, S_FOR, S_SET, S_BREAK, S_CONTINUE
};

typedef struct jnode jnode;
struct jnode {
    int kind, pos, depth;
    char op[3];        /* E_BIN: + - * / // % ~ == != < > <= >= in ni (not in) */
    int neg;           /* E_TEST: is not */
    jnode *a, *b, *c;     /* operands; S_IF: a cond, b then, c else; S_FOR: a iter, b body, c else */
    jnode *args;          /* E_CALL / E_FILTER / E_TEST arguments, E_LIST items, E_DICT key, value pairs */
    jnode *cond;          /* S_FOR: its `if` */
    jnode *next;          /* the next argument, item or statement */
    const char *s;     /* E_NAME, E_ATTR, E_FILTER, E_TEST, E_KW, S_SET (target); S_TEXT text */
    size_t n;
    const char *s2;    /* S_FOR: second target; S_SET: the attribute of `set ns.attr` */
    size_t n2;
    json_t *lit;       /* E_LIT */
};

typedef struct jarena {
    struct jarena *next;
    size_t used;
    jnode nodes[256];
} jarena;

struct mf_jinja {
    char *src;         /* the normalized source (\r\n -> \n, one trailing newline dropped) */
    size_t len;
    char *strs;        /* string literals' bytes, one block */
    jarena *arena;
    jnode *body;
};

/* line and column (1-based) of byte offset pos of src */
static void jj_linecol(const char *src, int pos, int *line, int *col)
{
    int l = 1, c = 1;
    for (int i = 0; i < pos && src[i]; i++) {
        if (src[i] == '\n') {
            l++;
            c = 1;
        } else if (((unsigned char)src[i] & 0xc0) != 0x80) {
            c++;
        }
    }
    *line = l;
    *col = c;
}

static int jj_err(const char *src, int pos, int code, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int jj_err(const char *src, int pos, int code, const char *fmt, ...)
{
    char m[640];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    int line, col;
    jj_linecol(src, pos, &line, &col);
    return mf_error(code, "chat template line %d column %d: %s", line, col, m);
}

/* ---- lexer ----------------------------------------------------------------------------------- */

typedef struct jlex {
    const char *src;
    size_t len;
    jtok *t;
    int n, cap;
    char *strs;        /* string literals' bytes: at most len bytes in all */
    size_t n_strs;
} jlex;

static int jl_push(jlex *L, jtok k)
{
    if (L->n == L->cap) {
        int c = L->cap ? L->cap * 2 : 256;
        jtok *p = realloc(L->t, sizeof *p * (size_t)c);
        if (!p) return -ENOMEM;
        L->t = p;
        L->cap = c;
    }
    L->t[L->n++] = k;
    return 0;
}

static int jj_isws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

/* one expression token at *p (inside a tag); closing tags are recognized by the caller */
static int jl_expr_token(jlex *L, size_t *p)
{
    const char *s = L->src;
    size_t i = *p;
    jtok k = {.pos = (int)i};
    char c = s[i];
    if (isalpha((unsigned char)c) || c == '_') {
        size_t j = i;
        while (j < L->len && (isalnum((unsigned char)s[j]) || s[j] == '_')) j++;
        k.type = T_NAME;
        k.s = s + i;
        k.n = j - i;
        *p = j;
    } else if (isdigit((unsigned char)c)) {
        size_t j = i;
        while (j < L->len && isdigit((unsigned char)s[j])) j++;
        int fl = 0;
        if (j + 1 < L->len && s[j] == '.' && isdigit((unsigned char)s[j + 1])) {
            fl = 1;
            j++;
            while (j < L->len && isdigit((unsigned char)s[j])) j++;
        }
        if (j < L->len && (s[j] == 'e' || s[j] == 'E')) {
            size_t e = j + 1;
            if (e < L->len && (s[e] == '+' || s[e] == '-')) e++;
            if (e < L->len && isdigit((unsigned char)s[e])) {
                fl = 1;
                j = e;
                while (j < L->len && isdigit((unsigned char)s[j])) j++;
            }
        }
        char num[64];
        if (j - i >= sizeof num) return jj_err(s, (int)i, -EINVAL, "number too long");
        memcpy(num, s + i, j - i);
        num[j - i] = 0;
        if (fl) {
            k.type = T_FLOAT;
            k.fv = strtod(num, NULL);
        } else {
            errno = 0;
            k.type = T_INT;
            k.iv = strtoll(num, NULL, 10);
            if (errno) return jj_err(s, (int)i, -EINVAL, "integer %s out of range", num);
        }
        *p = j;
    } else if (c == '\'' || c == '"') {
        size_t j = i + 1;
        char *o = L->strs + L->n_strs;
        k.type = T_STR;
        k.s = o;
        for (;;) {
            if (j >= L->len) return jj_err(s, (int)i, -EINVAL, "unterminated string");
            char d = s[j];
            if (d == c) {
                j++;
                break;
            }
            if (d != '\\') {
                *o++ = d;
                j++;
                continue;
            }
            if (j + 1 >= L->len) return jj_err(s, (int)i, -EINVAL, "unterminated string");
            char e = s[j + 1];
            j += 2;
            switch (e) {
            case 'n': *o++ = '\n'; break;
            case 't': *o++ = '\t'; break;
            case 'r': *o++ = '\r'; break;
            case '0': *o++ = '\0'; break;
            case '\\': *o++ = '\\'; break;
            case '\'': *o++ = '\''; break;
            case '"': *o++ = '"'; break;
            case '\n': break;   /* a line continuation */
            case 'x': case 'u': case 'U': {
                int nd = e == 'x' ? 2 : e == 'u' ? 4 : 8;
                uint32_t cp = 0;
                for (int q = 0; q < nd; q++, j++) {
                    if (j >= L->len || !isxdigit((unsigned char)s[j]))
                        return jj_err(s, (int)j, -EINVAL, "bad \\%c escape in a string", e);
                    char h = s[j];
                    cp = cp * 16 + (uint32_t)(isdigit((unsigned char)h) ? h - '0' : (tolower((unsigned char)h) - 'a' + 10));
                }
                if (cp > 0x10ffff || (cp >= 0xd800 && cp < 0xe000))
                    return jj_err(s, (int)i, -EINVAL, "escape \\%c%X is not a character", e, cp);
                /* \uXXXX takes at most 6 source bytes and writes at most 4 */
                if (cp < 0x80) {
                    *o++ = (char)cp;
                } else if (cp < 0x800) {
                    *o++ = (char)(0xc0 | cp >> 6);
                    *o++ = (char)(0x80 | (cp & 63));
                } else if (cp < 0x10000) {
                    *o++ = (char)(0xe0 | cp >> 12);
                    *o++ = (char)(0x80 | ((cp >> 6) & 63));
                    *o++ = (char)(0x80 | (cp & 63));
                } else {
                    *o++ = (char)(0xf0 | cp >> 18);
                    *o++ = (char)(0x80 | ((cp >> 12) & 63));
                    *o++ = (char)(0x80 | ((cp >> 6) & 63));
                    *o++ = (char)(0x80 | (cp & 63));
                }
                break;
            }
            default:   /* Python keeps an unknown escape as written */
                *o++ = '\\';
                *o++ = e;
            }
        }
        k.n = (size_t)(o - k.s);
        L->n_strs += k.n;
        *p = j;
    } else {
        static const char *two[] = {"//", "**", "==", "!=", "<=", ">="};
        for (int q = 0; q < 6; q++)
            if (i + 1 < L->len && s[i] == two[q][0] && s[i + 1] == two[q][1]) {
                k.type = T_OP;
                memcpy(k.op, two[q], 2);
                *p = i + 2;
                return jl_push(L, k);
            }
        if (!strchr("()[]{}.,:|~+-*/%<>=", c) || !c)
            return jj_err(s, (int)i, -EINVAL, "unexpected character '%c' in a tag", isprint((unsigned char)c) ? c : '?');
        k.type = T_OP;
        k.op[0] = c;
        *p = i + 1;
    }
    return jl_push(L, k);
}

static int jj_lex(jlex *L)
{
    const char *s = L->src;
    size_t len = L->len, pos = 0;
    int after = 0;   /* what the previous tag's end asks of the text after it: 1 strip all, 2 one newline */
    int rc;
    for (;;) {
        size_t q = pos;
        while (q + 1 < len && !(s[q] == '{' && (s[q + 1] == '{' || s[q + 1] == '%' || s[q + 1] == '#'))) q++;
        if (q + 1 >= len) q = len;
        size_t a = pos, b = q;
        if (after == 1)
            while (a < b && jj_isws(s[a])) a++;
        else if (after == 2 && a < b && s[a] == '\n')
            a++;
        char kind = q < len ? s[q + 1] : 0, mod = q + 2 < len ? s[q + 2] : 0;
        if (q < len) {
            if (mod == '-') {
                while (b > a && jj_isws(s[b - 1])) b--;
            } else if (kind != '{' && mod != '+') {   /* lstrip_blocks */
                size_t k = b;
                while (k > a && (s[k - 1] == ' ' || s[k - 1] == '\t')) k--;
                if (k == 0 || s[k - 1] == '\n') b = k;
            }
        }
        if (b > a && (rc = jl_push(L, (jtok){.type = T_TEXT, .pos = (int)a, .s = s + a, .n = b - a}))) return rc;
        if (q >= len) break;
        size_t p = q + 2 + (mod == '-' || mod == '+');
        if (kind == '#') {
            size_t e = p;
            while (e + 1 < len && !(s[e] == '#' && s[e + 1] == '}')) e++;
            if (e + 1 >= len) return jj_err(s, (int)q, -EINVAL, "comment not closed ('#}')");
            after = e > p && s[e - 1] == '-' ? 1 : e > p && s[e - 1] == '+' ? 0 : 2;
            pos = e + 2;
            continue;
        }
        int var = kind == '{';
        if ((rc = jl_push(L, (jtok){.type = var ? T_VOPEN : T_BOPEN, .pos = (int)q}))) return rc;
        for (;;) {
            while (p < len && jj_isws(s[p])) p++;
            if (p >= len) return jj_err(s, (int)q, -EINVAL, "tag not closed ('%s')", var ? "}}" : "%}");
            char cl = var ? '}' : '%';
            int m = (s[p] == '-' || (s[p] == '+' && !var)) && p + 2 < len && s[p + 1] == cl && s[p + 2] == '}';
            if (m || (p + 1 < len && s[p] == cl && s[p + 1] == '}')) {
                if ((rc = jl_push(L, (jtok){.type = var ? T_VCLOSE : T_BCLOSE, .pos = (int)p}))) return rc;
                after = m && s[p] == '-' ? 1 : (!var && !(m && s[p] == '+')) ? 2 : 0;
                pos = p + 2 + m;
                break;
            }
            if ((rc = jl_expr_token(L, &p))) return rc;
        }
    }
    return jl_push(L, (jtok){.type = T_EOF, .pos = (int)len});
}

/* ---- parser ---------------------------------------------------------------------------------- */

typedef struct jparse {
    mf_jinja *t;
    jtok *k;
    int i, depth;
} jparse;

static jnode *jp_node(jparse *P, int kind, int pos)
{
    jarena *a = P->t->arena;
    if (!a || a->used == sizeof a->nodes / sizeof a->nodes[0]) {
        jarena *n = calloc(1, sizeof *n);
        if (!n) return NULL;
        n->next = a;
        P->t->arena = a = n;
    }
    jnode *x = &a->nodes[a->used++];
    x->kind = kind;
    x->pos = pos;
    x->depth = 1;
    return x;
}

static int jp_err(jparse *P, const char *fmt, const char *what)
{
    jtok *k = &P->k[P->i];
    char got[48];
    if (k->type == T_NAME || k->type == T_TEXT)
        snprintf(got, sizeof got, "'%.*s'", (int)(k->n > 24 ? 24 : k->n), k->s);
    else if (k->type == T_OP)
        snprintf(got, sizeof got, "'%s'", k->op);
    else
        snprintf(got, sizeof got, "%s", k->type == T_EOF ? "the end" : k->type == T_INT || k->type == T_FLOAT ? "a number"
                 : k->type == T_STR ? "a string" : k->type == T_VCLOSE ? "'}}'" : k->type == T_BCLOSE ? "'%}'" : "a tag");
    char m[200];
    snprintf(m, sizeof m, fmt, what);
    return jj_err(P->t->src, k->pos, -EINVAL, "%s, found %s", m, got);
}

static int jp_is_op(jparse *P, const char *op) { return P->k[P->i].type == T_OP && !strcmp(P->k[P->i].op, op); }
static int jp_is_name(jparse *P, const char *nm)
{
    jtok *k = &P->k[P->i];
    return k->type == T_NAME && k->n == strlen(nm) && !memcmp(k->s, nm, k->n);
}
static int jp_peek_name(jparse *P, int ahead, const char *nm)
{
    jtok *k = &P->k[P->i + ahead];
    for (int j = 0; j < ahead; j++)
        if (P->k[P->i + j].type == T_EOF) return 0;
    return k->type == T_NAME && k->n == strlen(nm) && !memcmp(k->s, nm, k->n);
}

static int jp_expect_op(jparse *P, const char *op)
{
    if (!jp_is_op(P, op)) return jp_err(P, "expected '%s'", op);
    P->i++;
    return 0;
}

/* sets x->depth from its children; refuses trees too tall */
static int jp_fix(jparse *P, jnode *x)
{
    int d = 0;
    jnode *ch[4] = {x->a, x->b, x->c, x->cond};
    for (int j = 0; j < 4; j++)
        if (ch[j] && ch[j]->depth > d) d = ch[j]->depth;
    for (jnode *g = x->args; g; g = g->next)
        if (g->depth > d) d = g->depth;
    x->depth = d + 1;
    if (x->depth > JJ_MAX_EXPR_DEPTH)
        return jj_err(P->t->src, x->pos, -EINVAL, "expression nested deeper than %d", JJ_MAX_EXPR_DEPTH);
    return 0;
}

static int jp_expr(jparse *P, jnode **out);

/* arguments of a call, filter or test, after '(': positional and name=value */
static int jp_args(jparse *P, jnode **out)
{
    jnode **tail = out;
    int rc;
    while (!jp_is_op(P, ")")) {
        jnode *v;
        if (P->k[P->i].type == T_NAME && P->k[P->i + 1].type == T_OP && !strcmp(P->k[P->i + 1].op, "=")) {
            jnode *kw = jp_node(P, E_KW, P->k[P->i].pos);
            if (!kw) return -ENOMEM;
            kw->s = P->k[P->i].s;
            kw->n = P->k[P->i].n;
            P->i += 2;
            if ((rc = jp_expr(P, &kw->a)) || (rc = jp_fix(P, kw))) return rc;
            v = kw;
        } else if ((rc = jp_expr(P, &v))) {
            return rc;
        }
        *tail = v;
        tail = &v->next;
        if (jp_is_op(P, ",")) P->i++;
        else if (!jp_is_op(P, ")")) return jp_err(P, "expected '%s' or ','", ")");
    }
    P->i++;
    return 0;
}

static int jp_primary(jparse *P, jnode **out)
{
    jtok *k = &P->k[P->i];
    jnode *x = NULL;
    int rc;
    if (++P->depth > JJ_MAX_DEPTH) return jj_err(P->t->src, k->pos, -EINVAL, "nested deeper than %d", JJ_MAX_DEPTH);
    if (k->type == T_INT || k->type == T_FLOAT || k->type == T_STR) {
        if (!(x = jp_node(P, E_LIT, k->pos))) return -ENOMEM;
        x->lit = k->type == T_INT ? json_integer(k->iv) : k->type == T_FLOAT ? json_real(k->fv)
                                                                            : json_stringn_nocheck(k->s, k->n);
        if (!x->lit) return -ENOMEM;
        P->i++;
        /* adjacent string literals join, as in Python */
        while (k->type == T_STR && P->k[P->i].type == T_STR) {
            jtok *k2 = &P->k[P->i++];
            size_t n0 = json_string_length(x->lit);
            char *j = malloc(n0 + k2->n + 1);
            if (!j) return -ENOMEM;
            memcpy(j, json_string_value(x->lit), n0);
            memcpy(j + n0, k2->s, k2->n);
            json_t *s2 = json_stringn_nocheck(j, n0 + k2->n);
            free(j);
            if (!s2) return -ENOMEM;
            json_decref(x->lit);
            x->lit = s2;
        }
    } else if (k->type == T_NAME) {
        static const struct { const char *nm; int v; } kw[] = {
            {"true", 1}, {"True", 1}, {"false", 0}, {"False", 0}, {"none", 2}, {"None", 2}};
        for (int j = 0; j < 6; j++)
            if (jp_is_name(P, kw[j].nm)) {
                if (!(x = jp_node(P, E_LIT, k->pos))) return -ENOMEM;
                x->lit = kw[j].v == 2 ? json_null() : json_boolean(kw[j].v);
                break;
            }
        if (!x) {
            if (!(x = jp_node(P, E_NAME, k->pos))) return -ENOMEM;
            x->s = k->s;
            x->n = k->n;
        }
        P->i++;
    } else if (jp_is_op(P, "(")) {
        P->i++;
        if ((rc = jp_expr(P, &x))) return rc;
        if (jp_is_op(P, ",")) return jp_err(P, "tuples are not supported: expected '%s'", ")");
        if ((rc = jp_expect_op(P, ")"))) return rc;
    } else if (jp_is_op(P, "[") || jp_is_op(P, "{")) {
        int dict = jp_is_op(P, "{");
        const char *close = dict ? "}" : "]";
        if (!(x = jp_node(P, dict ? E_DICT : E_LIST, k->pos))) return -ENOMEM;
        P->i++;
        jnode **tail = &x->args;
        while (!jp_is_op(P, close)) {
            jnode *v;
            if ((rc = jp_expr(P, &v))) return rc;
            *tail = v;
            tail = &v->next;
            if (dict) {
                if ((rc = jp_expect_op(P, ":")) || (rc = jp_expr(P, &v))) return rc;
                *tail = v;
                tail = &v->next;
            }
            if (jp_is_op(P, ",")) P->i++;
            else if (!jp_is_op(P, close)) return jp_err(P, "expected '%s' or ','", close);
        }
        P->i++;
        if ((rc = jp_fix(P, x))) return rc;
    } else {
        return jp_err(P, "expected an expression%s", "");
    }
    /* postfix: .name, [index], [a:b:c], (args) */
    for (;;) {
        int pos = P->k[P->i].pos;
        jnode *y;
        if (jp_is_op(P, ".")) {
            P->i++;
            if (P->k[P->i].type != T_NAME) return jp_err(P, "expected an attribute name after '%s'", ".");
            if (!(y = jp_node(P, E_ATTR, pos))) return -ENOMEM;
            y->s = P->k[P->i].s;
            y->n = P->k[P->i].n;
            P->i++;
            y->a = x;
        } else if (jp_is_op(P, "[")) {
            P->i++;
            jnode *part[3] = {0};
            int n_colon = 0;
            for (;;) {
                if (jp_is_op(P, ":")) {
                    if (++n_colon > 2) return jp_err(P, "expected '%s'", "]");
                    P->i++;
                    continue;
                }
                if (jp_is_op(P, "]")) break;
                if (part[n_colon]) return jp_err(P, "expected '%s' or ':'", "]");
                if ((rc = jp_expr(P, &part[n_colon]))) return rc;
            }
            P->i++;
            if (!(y = jp_node(P, n_colon ? E_SLICE : E_INDEX, pos))) return -ENOMEM;
            if (!n_colon && !part[0]) return jj_err(P->t->src, pos, -EINVAL, "empty subscript");
            y->a = x;
            y->b = part[0];
            y->c = part[1];
            y->cond = part[2];
        } else if (jp_is_op(P, "(")) {
            P->i++;
            if (!(y = jp_node(P, E_CALL, pos))) return -ENOMEM;
            y->a = x;
            if ((rc = jp_args(P, &y->args))) return rc;
        } else {
            break;
        }
        if ((rc = jp_fix(P, y))) return rc;
        x = y;
    }
    P->depth--;
    *out = x;
    return 0;
}

/* unary minus, then filters (| name(args)) and tests (is [not] name) */
static int jp_unary(jparse *P, jnode **out)
{
    int rc;
    jnode *x;
    if (jp_is_op(P, "-") || jp_is_op(P, "+")) {
        int neg = jp_is_op(P, "-");
        int pos = P->k[P->i].pos;
        P->i++;
        if (++P->depth > JJ_MAX_DEPTH) return jj_err(P->t->src, pos, -EINVAL, "nested deeper than %d", JJ_MAX_DEPTH);
        if ((rc = jp_unary(P, &x))) return rc;
        P->depth--;
        if (neg) {
            jnode *y = jp_node(P, E_NEG, pos);
            if (!y) return -ENOMEM;
            y->a = x;
            if ((rc = jp_fix(P, y))) return rc;
            x = y;
        }
    } else if ((rc = jp_primary(P, &x))) {
        return rc;
    }
    for (;;) {
        int pos = P->k[P->i].pos;
        jnode *y;
        if (jp_is_op(P, "|")) {
            P->i++;
            if (P->k[P->i].type != T_NAME) return jp_err(P, "expected a filter name after '%s'", "|");
            if (!(y = jp_node(P, E_FILTER, pos))) return -ENOMEM;
        } else if (jp_is_name(P, "is")) {
            P->i++;
            if (!(y = jp_node(P, E_TEST, pos))) return -ENOMEM;
            if (jp_is_name(P, "not")) {
                y->neg = 1;
                P->i++;
            }
            if (P->k[P->i].type != T_NAME) return jp_err(P, "expected a test name after '%s'", "is");
        } else {
            break;
        }
        y->s = P->k[P->i].s;
        y->n = P->k[P->i].n;
        P->i++;
        y->a = x;
        if (jp_is_op(P, "(")) {
            P->i++;
            if ((rc = jp_args(P, &y->args))) return rc;
        }
        if ((rc = jp_fix(P, y))) return rc;
        x = y;
    }
    *out = x;
    return 0;
}

/* binary levels, loosest first: compare < + - < ~ < * / // % (Jinja's parse_math1/concat/math2) */
static int jp_bin(jparse *P, int level, jnode **out)
{
    static const char *ops[4][7] = {
        {"==", "!=", "<", ">", "<=", ">=", NULL}, {"+", "-", NULL}, {"~", NULL}, {"*", "/", "//", "%", NULL}};
    int rc;
    jnode *x;
    if ((rc = level == 3 ? jp_unary(P, &x) : jp_bin(P, level + 1, &x))) return rc;
    for (;;) {
        const char *op = NULL;
        int pos = P->k[P->i].pos, skip = 1;
        for (int j = 0; ops[level][j]; j++)
            if (jp_is_op(P, ops[level][j])) op = ops[level][j];
        if (level == 0 && jp_is_name(P, "in")) op = "in";
        if (level == 0 && jp_is_name(P, "not") && jp_peek_name(P, 1, "in")) {
            op = "ni";
            skip = 2;
        }
        if (!op) break;
        if (level == 3 && !strcmp(op, "*") && P->k[P->i + 1].type == T_OP && !strcmp(P->k[P->i + 1].op, "*"))
            return jp_err(P, "'%s' is not supported", "**");
        P->i += skip;
        jnode *y = jp_node(P, E_BIN, pos), *r;
        if (!y) return -ENOMEM;
        if ((rc = level == 3 ? jp_unary(P, &r) : jp_bin(P, level + 1, &r))) return rc;
        snprintf(y->op, sizeof y->op, "%s", op);
        y->a = x;
        y->b = r;
        if ((rc = jp_fix(P, y))) return rc;
        x = y;
        if (level == 0 && strcmp(op, "in") && strcmp(op, "ni")) {
            /* a < b < c chains: refused rather than rendered as (a < b) < c */
            for (int j = 0; ops[0][j]; j++)
                if (jp_is_op(P, ops[0][j])) return jp_err(P, "chained comparisons are not supported%s", "");
        }
    }
    *out = x;
    return 0;
}

static int jp_not(jparse *P, jnode **out)
{
    int rc;
    if (jp_is_name(P, "not")) {
        int pos = P->k[P->i].pos;
        P->i++;
        if (++P->depth > JJ_MAX_DEPTH) return jj_err(P->t->src, pos, -EINVAL, "nested deeper than %d", JJ_MAX_DEPTH);
        jnode *y = jp_node(P, E_NOT, pos);
        if (!y) return -ENOMEM;
        if ((rc = jp_not(P, &y->a)) || (rc = jp_fix(P, y))) return rc;
        P->depth--;
        *out = y;
        return 0;
    }
    return jp_bin(P, 0, out);
}

static int jp_andor(jparse *P, int is_or, jnode **out)
{
    int rc;
    jnode *x;
    if ((rc = is_or ? jp_andor(P, 0, &x) : jp_not(P, &x))) return rc;
    while (jp_is_name(P, is_or ? "or" : "and")) {
        jnode *y = jp_node(P, is_or ? E_OR : E_AND, P->k[P->i].pos);
        if (!y) return -ENOMEM;
        P->i++;
        y->a = x;
        if ((rc = is_or ? jp_andor(P, 0, &y->b) : jp_not(P, &y->b)) || (rc = jp_fix(P, y))) return rc;
        x = y;
    }
    *out = x;
    return 0;
}

/* a full expression: or-expression [if cond [else expr]] */
static int jp_expr(jparse *P, jnode **out)
{
    int rc;
    jnode *x;
    if ((rc = jp_andor(P, 1, &x))) return rc;
    while (jp_is_name(P, "if")) {
        jnode *y = jp_node(P, E_COND, P->k[P->i].pos);
        if (!y) return -ENOMEM;
        P->i++;
        y->a = x;
        if ((rc = jp_andor(P, 1, &y->cond))) return rc;
        if (jp_is_name(P, "else")) {
            P->i++;
            if ((rc = jp_andor(P, 1, &y->b))) return rc;
        }
        if ((rc = jp_fix(P, y))) return rc;
        x = y;
    }
    *out = x;
    return 0;
}

static int jp_body(jparse *P, const char *const *ends, int *which, jnode **out);

static int jp_block_end(jparse *P)
{
    if (P->k[P->i].type != T_BCLOSE) return jp_err(P, "expected '%s'", "%}");
    P->i++;
    return 0;
}

static int jp_tag(jparse *P, jnode **out)
{
    jtok *k = &P->k[P->i];   /* the tag's name */
    int rc, which;
    jnode *x;
    if (k->type != T_NAME) return jp_err(P, "expected a tag name%s", "");
    if (jp_is_name(P, "if")) {
        if (!(x = jp_node(P, S_IF, k->pos))) return -ENOMEM;
        P->i++;
        jnode *cur = x;
        for (;;) {
            static const char *const ends[] = {"elif", "else", "endif", NULL};
            if ((rc = jp_expr(P, &cur->a)) || (rc = jp_block_end(P)) || (rc = jp_body(P, ends, &which, &cur->b))) return rc;
            if (which == 0) {   /* elif: an if in the else branch */
                jnode *y = jp_node(P, S_IF, P->k[P->i - 1].pos);
                if (!y) return -ENOMEM;
                cur->c = y;
                cur = y;
                continue;
            }
            if (which == 1) {
                static const char *const ends2[] = {"endif", NULL};
                if ((rc = jp_block_end(P)) || (rc = jp_body(P, ends2, &which, &cur->c))) return rc;
            }
            break;
        }
        rc = jp_block_end(P);
    } else if (jp_is_name(P, "for")) {
        if (!(x = jp_node(P, S_FOR, k->pos))) return -ENOMEM;
        P->i++;
        if (P->k[P->i].type != T_NAME) return jp_err(P, "expected a loop variable%s", "");
        x->s = P->k[P->i].s;
        x->n = P->k[P->i].n;
        P->i++;
        if (jp_is_op(P, ",")) {
            P->i++;
            if (P->k[P->i].type != T_NAME) return jp_err(P, "expected a second loop variable%s", "");
            x->s2 = P->k[P->i].s;
            x->n2 = P->k[P->i].n;
            P->i++;
        }
        if (!jp_is_name(P, "in")) return jp_err(P, "expected '%s'", "in");
        P->i++;
        if ((rc = jp_andor(P, 1, &x->a))) return rc;
        if (jp_is_name(P, "if")) {
            P->i++;
            if ((rc = jp_andor(P, 1, &x->cond))) return rc;
        }
        if (jp_is_name(P, "recursive")) return jp_err(P, "recursive loops are not supported%s", "");
        static const char *const ends[] = {"else", "endfor", NULL};
        if ((rc = jp_block_end(P)) || (rc = jp_body(P, ends, &which, &x->b))) return rc;
        if (which == 0) {
            static const char *const ends2[] = {"endfor", NULL};
            if ((rc = jp_block_end(P)) || (rc = jp_body(P, ends2, &which, &x->c))) return rc;
        }
        rc = jp_block_end(P);
    } else if (jp_is_name(P, "set")) {
        if (!(x = jp_node(P, S_SET, k->pos))) return -ENOMEM;
        P->i++;
        if (P->k[P->i].type != T_NAME) return jp_err(P, "expected a variable name%s", "");
        x->s = P->k[P->i].s;
        x->n = P->k[P->i].n;
        P->i++;
        if (jp_is_op(P, ".")) {
            P->i++;
            if (P->k[P->i].type != T_NAME) return jp_err(P, "expected an attribute name after '%s'", ".");
            x->s2 = P->k[P->i].s;
            x->n2 = P->k[P->i].n;
            P->i++;
        }
        if (jp_is_op(P, ",")) return jp_err(P, "unpacking in set is not supported%s", "");
        if (!jp_is_op(P, "=")) return jp_err(P, "expected '%s' (block set is not supported)", "=");
        P->i++;
        if ((rc = jp_expr(P, &x->a))) return rc;
        rc = jp_block_end(P);
    } else if (jp_is_name(P, "break") || jp_is_name(P, "continue")) {
        if (!(x = jp_node(P, jp_is_name(P, "break") ? S_BREAK : S_CONTINUE, k->pos))) return -ENOMEM;
        P->i++;
        rc = jp_block_end(P);
    } else {
        return jj_err(P->t->src, k->pos, -EINVAL, "unsupported tag '%.*s'", (int)(k->n > 32 ? 32 : k->n), k->s);
    }
    *out = x;
    return rc;
}

/* statements up to a tag named in ends (NULL-terminated; NULL ends: up to the end of the source);
 * *which is its index, and the parser stands after its name */
static int jp_body(jparse *P, const char *const *ends, int *which, jnode **out)
{
    jnode **tail = out;
    int rc;
    *out = NULL;
    if (++P->depth > JJ_MAX_DEPTH)
        return jj_err(P->t->src, P->k[P->i].pos, -EINVAL, "blocks nested deeper than %d", JJ_MAX_DEPTH);
    for (;;) {
        jtok *k = &P->k[P->i];
        jnode *x = NULL;
        if (k->type == T_EOF) {
            if (ends) {
                int last = 0;
                while (ends[last + 1]) last++;
                return jp_err(P, "expected '{%% %s %%}'", ends[last]);
            }
            break;
        }
        if (k->type == T_TEXT) {
            if (!(x = jp_node(P, S_TEXT, k->pos))) return -ENOMEM;
            x->s = k->s;
            x->n = k->n;
            P->i++;
        } else if (k->type == T_VOPEN) {
            P->i++;
            if (!(x = jp_node(P, S_OUT, k->pos))) return -ENOMEM;
            if ((rc = jp_expr(P, &x->a))) return rc;
            if (P->k[P->i].type != T_VCLOSE) return jp_err(P, "expected '%s'", "}}");
            P->i++;
        } else if (k->type == T_BOPEN) {
            P->i++;
            for (int j = 0; ends && ends[j]; j++)
                if (jp_is_name(P, ends[j])) {
                    *which = j;
                    P->i++;
                    P->depth--;
                    return 0;
                }
            static const char *const stray[] = {"elif", "else", "endif", "endfor", "endset", NULL};
            for (int j = 0; stray[j]; j++)
                if (jp_is_name(P, stray[j])) return jp_err(P, "unexpected '%s'", stray[j]);
            if ((rc = jp_tag(P, &x))) return rc;
        } else {
            return jp_err(P, "unexpected token%s", "");
        }
        *tail = x;
        tail = &x->next;
    }
    P->depth--;
    return 0;
}

void mf_jinja_free(mf_jinja *t)
{
    if (!t) return;
    for (jarena *a = t->arena, *n; a; a = n) {
        n = a->next;
        for (size_t i = 0; i < a->used; i++)
            if (a->nodes[i].lit) json_decref(a->nodes[i].lit);
        free(a);
    }
    free(t->strs);
    free(t->src);
    free(t);
}

int mf_jinja_parse(const char *src, size_t len, mf_jinja **out)
{
    *out = NULL;
    if (len > (size_t)INT_MAX / 2) return mf_error(-E2BIG, "chat template of %zu bytes (at most %d)", len, INT_MAX / 2);
    mf_jinja *t = calloc(1, sizeof *t);
    if (!t || !(t->src = malloc(len + 1)) || !(t->strs = malloc(len + 1))) {
        mf_jinja_free(t);
        return -ENOMEM;
    }
    size_t n = 0;   /* newlines as Python's splitlines: \r\n and \r become \n */
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            t->src[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            t->src[n++] = src[i];
        }
    }
    if (n && t->src[n - 1] == '\n') n--;   /* keep_trailing_newline off */
    t->src[n] = 0;
    t->len = n;
    jlex L = {.src = t->src, .len = n, .strs = t->strs};
    int rc = jj_lex(&L);
    if (!rc) {
        jparse P = {.t = t, .k = L.t};
        rc = jp_body(&P, NULL, NULL, &t->body);
    }
    free(L.t);
    if (rc) {
        mf_jinja_free(t);
        return rc;
    }
    *out = t;
    return 0;
}

/* ---- values ---------------------------------------------------------------------------------- */

/* Values are jansson references; an undefined value is the sentinel JV_UNDEF, never passed to jansson. */
static const char jv_undef_tag;
#define JV_UNDEF ((json_t *)(uintptr_t)&jv_undef_tag)

static void jv_drop(json_t *v)
{
    if (v && v != JV_UNDEF) json_decref(v);
}
static json_t *jv_keep(json_t *v) { return v == JV_UNDEF ? v : json_incref(v); }

typedef struct jbuf {
    char *p;
    size_t n, cap;
} jbuf;

static int jb_add(jbuf *b, const char *s, size_t n)
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
static int jb_str(jbuf *b, const char *s) { return jb_add(b, s, strlen(s)); }

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
static int jv_str(jbuf *b, json_t *v)
{
    char num[48];
    if (v == JV_UNDEF) return 0;
    switch (json_typeof(v)) {
    case JSON_STRING: return jb_add(b, json_string_value(v), json_string_length(v));
    case JSON_INTEGER: snprintf(num, sizeof num, "%lld", (long long)json_integer_value(v)); return jb_str(b, num);
    case JSON_REAL: jv_float_repr(json_real_value(v), num, sizeof num); return jb_str(b, num);
    case JSON_TRUE: return jb_str(b, "True");
    case JSON_FALSE: return jb_str(b, "False");
    case JSON_NULL: return jb_str(b, "None");
    case JSON_ARRAY: {
        int rc = jb_str(b, "[");
        for (size_t i = 0; !rc && i < json_array_size(v); i++) {
            if (i) rc = jb_str(b, ", ");
            if (!rc) rc = jv_repr(b, json_array_get(v, i));
        }
        return rc ? rc : jb_str(b, "]");
    }
    case JSON_OBJECT: {
        int rc = jb_str(b, "{"), first = 1;
        const char *k;
        size_t kn;
        json_t *x;
        json_object_keylen_foreach(v, k, kn, x) {
            if (rc) break;
            if (!first) rc = jb_str(b, ", ");
            first = 0;
            json_t *ks = json_stringn_nocheck(k, kn);
            if (!ks) return -ENOMEM;
            if (!rc) rc = jv_repr(b, ks);
            json_decref(ks);
            if (!rc) rc = jb_str(b, ": ");
            if (!rc) rc = jv_repr(b, x);
        }
        return rc ? rc : jb_str(b, "}");
    }
    }
    return 0;
}

/* Python's repr(): strings quoted (' unless the text holds ' and no "), the rest as str() */
static int jv_repr(jbuf *b, json_t *v)
{
    if (v == JV_UNDEF || !json_is_string(v)) return jv_str(b, v);
    const char *s = json_string_value(v);
    size_t n = json_string_length(v);
    char q = memchr(s, '\'', n) && !memchr(s, '"', n) ? '"' : '\'';
    int rc = jb_add(b, &q, 1);
    for (size_t i = 0; !rc && i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char e[8];
        if (c == '\\' || c == (unsigned char)q) {
            e[0] = '\\';
            e[1] = (char)c;
            rc = jb_add(b, e, 2);
        } else if (c == '\n') rc = jb_str(b, "\\n");
        else if (c == '\r') rc = jb_str(b, "\\r");
        else if (c == '\t') rc = jb_str(b, "\\t");
        else if (c < 0x20 || c == 0x7f) {
            snprintf(e, sizeof e, "\\x%02x", c);
            rc = jb_str(b, e);
        } else rc = jb_add(b, (const char *)&c, 1);
    }
    return rc ? rc : jb_add(b, &q, 1);
}

static int jv_truthy(json_t *v)
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

static const char *jv_type(json_t *v)
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
static int jv_num(json_t *v, double *f, long long *i, int *is_int)
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

static int jv_eq(json_t *a, json_t *b)
{
    double fa, fb;
    long long ia, ib;
    int ka, kb;
    if (a == JV_UNDEF || b == JV_UNDEF) return a == b;
    if (jv_num(a, &fa, &ia, &ka) && jv_num(b, &fb, &ib, &kb)) return ka && kb ? ia == ib : fa == fb;
    if (json_typeof(a) != json_typeof(b)) return 0;
    if (json_is_array(a)) {
        if (json_array_size(a) != json_array_size(b)) return 0;
        for (size_t i = 0; i < json_array_size(a); i++)
            if (!jv_eq(json_array_get(a, i), json_array_get(b, i))) return 0;
        return 1;
    }
    if (json_is_object(a)) {
        if (json_object_size(a) != json_object_size(b)) return 0;
        const char *k;
        size_t kn;
        json_t *x;
        json_object_keylen_foreach(a, k, kn, x) {
            json_t *y = json_object_getn(b, k, kn);
            if (!y || !jv_eq(x, y)) return 0;
        }
        return 1;
    }
    return json_equal(a, b);
}

/* ---- renderer -------------------------------------------------------------------------------- */

typedef struct jrender {
    const mf_jinja *t;
    json_t *frames[JJ_MAX_DEPTH + 2];
    int n_frames;
    json_t *ns[64];     /* objects made by namespace(): the only ones `set x.attr` may change */
    int n_ns;
    long iters;
    int ctl;            /* 1 break, 2 continue */
    jbuf out;
} jrender;

static int rerr(jrender *R, const jnode *x, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int rerr(jrender *R, const jnode *x, const char *fmt, ...)
{
    char m[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    return jj_err(R->t->src, x->pos, -EINVAL, "%s", m);
}

static int jr_eval(jrender *R, const jnode *x, json_t **out);

static json_t *jr_lookup(jrender *R, const char *s, size_t n)
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

static int jr_strv(const char *s, size_t n, json_t **out) { return jr_new(json_stringn_nocheck(s, n), out); }

/* x's argument list: positional values into pos[], keyword ones by name into kw (an object) */
static void jr_drop_args(json_t **pos, int n)
{
    for (int i = 0; i < n; i++) jv_drop(pos[i]);
}

/* A call's arguments: positional ones into pos (at most max_pos), keyword ones into kw. On an error
 * the positional values taken so far are dropped and *n_pos is 0, so a caller only drops after
 * success. */
static int jr_args(jrender *R, const jnode *x, json_t **pos, int max_pos, int *n_pos, json_t *kw)
{
    int rc = 0;
    *n_pos = 0;
    for (const jnode *g = x->args; g && !rc; g = g->next) {
        json_t *v;
        if ((rc = jr_eval(R, g->kind == E_KW ? g->a : g, &v))) break;
        if (g->kind == E_KW) {
            if (!kw || v == JV_UNDEF) {
                jv_drop(v);
                rc = rerr(R, g, kw ? "keyword argument '%.*s' is undefined" : "keyword argument '%.*s' is not supported here",
                          (int)g->n, g->s);
            } else if (json_object_setn_new_nocheck(kw, g->s, g->n, v)) {
                rc = -ENOMEM;
            }
        } else if (*n_pos == max_pos) {
            jv_drop(v);
            rc = rerr(R, g, "too many arguments");
        } else {
            pos[(*n_pos)++] = v;
        }
    }
    if (rc) {
        jr_drop_args(pos, *n_pos);
        *n_pos = 0;
    }
    return rc;
}

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
    return jr_strv(s + a, b - a, out);
}

/* tojson: json.dumps(v, ensure_ascii=False[, indent=n]) */
static int jr_tojson(jrender *R, const jnode *x, json_t *v, json_t *indent, json_t **out)
{
    if (v == JV_UNDEF) return rerr(R, x, "tojson of an undefined value");
    size_t flags = JSON_ENCODE_ANY | JSON_PRESERVE_ORDER;
    if (indent && json_is_integer(indent) && json_integer_value(indent) >= 0 && json_integer_value(indent) <= 31)
        flags |= JSON_INDENT(json_integer_value(indent));
    else if (indent && !json_is_null(indent))
        return rerr(R, x, "tojson indent: an integer 0..31");
    char *s = json_dumps(v, flags);
    if (!s) return -ENOMEM;
    int rc = jr_strv(s, strlen(s), out);
    free(s);
    return rc;
}

static int jr_method(jrender *R, const jnode *x, json_t *obj, const char *m, size_t mn, json_t **out)
{
    json_t *a[3] = {0};
    int n = 0, rc;
#define M(name) (mn == sizeof(name) - 1 && !memcmp(m, name, mn))
    if ((rc = jr_args(R, x, a, 3, &n, NULL))) return rc;
    if (obj != JV_UNDEF && json_is_object(obj) && M("get")) {
        if (n < 1 || n > 2 || a[0] == JV_UNDEF || !json_is_string(a[0])) {
            rc = rerr(R, x, "get(key[, default]) with a string key");
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
                rc = rerr(R, x, "%.*s: argument %d must be a string", (int)mn, m, i + 1);
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
            rc = jr_strv(c, sn, out);
            free(c);
        } else if (M("replace") && n == 2 && json_string_length(a[0]) > 0) {
            jbuf b = {0};
            const char *f = json_string_value(a[0]);
            size_t fn = json_string_length(a[0]), i = 0;
            rc = jb_add(&b, "", 0);
            while (!rc && i < sn) {
                if (i + fn <= sn && !memcmp(s + i, f, fn)) {
                    rc = jb_add(&b, json_string_value(a[1]), json_string_length(a[1]));
                    i += fn;
                } else {
                    rc = jb_add(&b, s + i++, 1);
                }
            }
            if (!rc) rc = jr_strv(b.p, b.n, out);
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
                if (!fn) rc = rerr(R, x, "split: empty separator");
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
            rc = rerr(R, x, "unsupported string method '%.*s' (or its arguments)", (int)mn, m);
        }
    } else {
        rc = rerr(R, x, "unsupported method '%.*s' of %s", (int)mn, m, jv_type(obj));
    }
#undef M
    jr_drop_args(a, n);
    return rc;
}

static int jr_call(jrender *R, const jnode *x, json_t **out)
{
    const jnode *f = x->a;
    int rc;
    if (f->kind == E_ATTR) {
        json_t *obj;
        if ((rc = jr_eval(R, f->a, &obj))) return rc;
        rc = jr_method(R, x, obj, f->s, f->n, out);
        jv_drop(obj);
        return rc;
    }
#define F(name) (f->kind == E_NAME && f->n == sizeof(name) - 1 && !memcmp(f->s, name, f->n) && !jr_lookup(R, f->s, f->n))
    if (F("namespace")) {
        json_t *kw = json_object(), *a[1];
        int n;
        if (!kw) return -ENOMEM;
        if ((rc = jr_args(R, x, a, 0, &n, kw))) {
            json_decref(kw);
            return rc;
        }
        if (R->n_ns == (int)(sizeof R->ns / sizeof R->ns[0])) {
            json_decref(kw);
            return rerr(R, x, "more than %d namespace() objects", (int)(sizeof R->ns / sizeof R->ns[0]));
        }
        R->ns[R->n_ns++] = kw;   /* the list's reference: freed at the render's end */
        *out = json_incref(kw);
        return 0;
    }
    if (F("raise_exception")) {
        json_t *a[1];
        int n;
        if ((rc = jr_args(R, x, a, 1, &n, NULL))) return rc;
        jbuf b = {0};
        if (n) rc = jv_str(&b, a[0]);
        jr_drop_args(a, n);
        if (!rc) rc = rerr(R, x, "raise_exception: %s", b.p ? b.p : "");
        free(b.p);
        return rc;
    }
    if (F("range")) {
        json_t *a[3];
        int n;
        long long v[3] = {0, 0, 1};
        if ((rc = jr_args(R, x, a, 3, &n, NULL))) return rc;
        for (int i = 0; i < n; i++)
            if (a[i] == JV_UNDEF || !json_is_integer(a[i])) rc = rerr(R, x, "range() takes integers");
        if (!rc && n == 0) rc = rerr(R, x, "range() needs an argument");
        if (!rc) {
            if (n == 1) v[1] = json_integer_value(a[0]);
            for (int i = 0; n > 1 && i < n; i++) v[i] = json_integer_value(a[i]);
            if (!v[2]) rc = rerr(R, x, "range() step 0");
        }
        jr_drop_args(a, n);
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
    if (f->kind == E_NAME) return rerr(R, x, "unsupported function '%.*s'", (int)f->n, f->s);
    return rerr(R, x, "only named functions and methods can be called");
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
        if ((rc = jr_eval(R, pn[i], &part[i]))) break;
        if (part[i] != JV_UNDEF && json_is_null(part[i])) continue;
        if (part[i] == JV_UNDEF || !json_is_integer(part[i])) rc = rerr(R, x, "slice bounds must be integers");
        else {
            p[i] = json_integer_value(part[i]);
            has[i] = 1;
        }
    }
    for (int i = 0; i < 3; i++) jv_drop(part[i]);
    if (rc) return rc;
    long long step = has[2] ? p[2] : 1;
    if (!step) return rerr(R, x, "slice step 0");
    int is_str = obj != JV_UNDEF && json_is_string(obj);
    if (!is_str && (obj == JV_UNDEF || !json_is_array(obj))) return rerr(R, x, "cannot slice %s", jv_type(obj));
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
    if (is_str) rc = jb_add(&b, "", 0);
    else if (!l) rc = -ENOMEM;
    for (long long i = lo; !rc && (step > 0 ? i < hi : i > hi); i += step) {
        if (is_str) rc = jb_add(&b, s + cp[i], cp[i + 1] - cp[i]);
        else if (json_array_append(l, json_array_get(obj, (size_t)i))) rc = -ENOMEM;
    }
    free(cp);
    if (!rc) rc = is_str ? jr_strv(b.p, b.n, out) : (*out = l, 0);
    else if (l) json_decref(l);
    free(b.p);
    return rc;
}

static int jr_index(jrender *R, const jnode *x, json_t *obj, json_t *key, json_t **out)
{
    if (obj == JV_UNDEF) return rerr(R, x, "subscript of an undefined value");
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
                return jr_strv(s + j, e - j, out);
            }
        }
    }
    *out = JV_UNDEF;   /* Jinja: a missing item is undefined */
    return 0;
}

static int jr_filter(jrender *R, const jnode *x, json_t *v, json_t **out)
{
    json_t *a[2] = {0}, *kw = json_object();
    int n = 0, rc;
    if (!kw) return -ENOMEM;
    if ((rc = jr_args(R, x, a, 2, &n, kw))) goto done;
#define M(name) (x->n == sizeof(name) - 1 && !memcmp(x->s, name, x->n))
    if ((M("trim") || M("lower") || M("upper")) && n == 0) {   /* of str(v), as Jinja's soft_str */
        jbuf b = {0};
        json_t *sv = NULL;
        rc = jb_add(&b, "", 0);
        if (!rc) rc = jv_str(&b, v);
        if (!rc) rc = jr_strv(b.p, b.n, &sv);
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
        else rc = rerr(R, x, "length of %s", jv_type(v));
    } else if (M("tojson") && n <= 1) {
        json_t *ind = n ? a[0] : json_object_get(kw, "indent");
        if (ind == JV_UNDEF) ind = NULL;
        rc = jr_tojson(R, x, v, ind, out);
    } else if (M("string") && n == 0) {
        jbuf b = {0};
        rc = jb_add(&b, "", 0);
        if (!rc) rc = jv_str(&b, v);
        if (!rc) rc = jr_strv(b.p, b.n, out);
        free(b.p);
    } else if ((M("default") || M("d")) && n <= 2) {
        int use = v == JV_UNDEF || (n == 2 && jv_truthy(a[1]) == 1 && !jv_truthy(v));
        *out = use ? (n ? jv_keep(a[0]) : json_string("")) : jv_keep(v);
        if (!*out) rc = -ENOMEM;
    } else if ((M("first") || M("last")) && n == 0) {
        if (v != JV_UNDEF && json_is_array(v)) {
            size_t k = json_array_size(v);
            *out = k ? json_incref(json_array_get(v, M("first") ? 0 : k - 1)) : JV_UNDEF;
        } else rc = rerr(R, x, "%.*s of %s", (int)x->n, x->s, jv_type(v));
    } else if (M("join") && n <= 1) {
        if (v == JV_UNDEF || !json_is_array(v)) {
            rc = rerr(R, x, "join of %s", jv_type(v));
        } else if (n && (a[0] == JV_UNDEF || !json_is_string(a[0]))) {
            rc = rerr(R, x, "join: the separator must be a string");
        } else {
            jbuf b = {0};
            rc = jb_add(&b, "", 0);
            for (size_t i = 0; !rc && i < json_array_size(v); i++) {
                if (i && n) rc = jb_add(&b, json_string_value(a[0]), json_string_length(a[0]));
                if (!rc) rc = jv_str(&b, json_array_get(v, i));
            }
            if (!rc) rc = jr_strv(b.p, b.n, out);
            free(b.p);
        }
    } else if (M("safe") && n == 0) {
        *out = jv_keep(v);
    } else if (M("int") && n == 0) {
        double f;
        long long i;
        int isint;
        if (jv_num(v, &f, &i, &isint)) *out = json_integer(isint ? i : (json_int_t)f);
        else rc = rerr(R, x, "int of %s is not supported", jv_type(v));
    } else {
        rc = rerr(R, x, "unsupported filter '%.*s' (or its arguments)", (int)x->n, x->s);
    }
#undef M
    if (!rc && !*out) rc = -ENOMEM;
done:
    jr_drop_args(a, n);
    json_decref(kw);
    return rc;
}

static int jr_test(jrender *R, const jnode *x, json_t *v, int *hit)
{
    if (x->args) return rerr(R, x, "tests with arguments are not supported");
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
    else return rerr(R, x, "unsupported test '%.*s'", (int)x->n, x->s);
#undef M
    if (x->neg) *hit = !*hit;
    return 0;
}

static int jr_binop(jrender *R, const jnode *x, json_t *a, json_t *b, json_t **out)
{
    const char *op = x->op;
    double fa, fb;
    long long ia, ib;
    int ka, kb;
    int na = jv_num(a, &fa, &ia, &ka), nb = jv_num(b, &fb, &ib, &kb);
    if (!strcmp(op, "~")) {
        jbuf s = {0};
        int rc = jb_add(&s, "", 0);
        if (!rc) rc = jv_str(&s, a);
        if (!rc) rc = jv_str(&s, b);
        if (!rc) rc = jr_strv(s.p, s.n, out);
        free(s.p);
        return rc;
    }
    if (!strcmp(op, "==") || !strcmp(op, "!=")) {
        int e = jv_eq(a, b);
        *out = json_boolean(op[0] == '=' ? e : !e);
        return 0;
    }
    if (!strcmp(op, "in") || !strcmp(op, "ni")) {
        int hit = 0;
        if (b == JV_UNDEF) {
            hit = 0;
        } else if (json_is_string(b)) {
            if (a == JV_UNDEF || !json_is_string(a)) return rerr(R, x, "'in <string>' needs a string on the left, got %s", jv_type(a));
            const char *h = json_string_value(b), *nd = json_string_value(a);
            size_t hn = json_string_length(b), nn = json_string_length(a);
            for (size_t i = 0; !hit && i + nn <= hn; i++) hit = !memcmp(h + i, nd, nn);
        } else if (json_is_array(b)) {
            for (size_t i = 0; !hit && i < json_array_size(b); i++) hit = jv_eq(a, json_array_get(b, i));
        } else if (json_is_object(b)) {
            hit = a != JV_UNDEF && json_is_string(a) && json_object_getn(b, json_string_value(a), json_string_length(a));
        } else {
            return rerr(R, x, "'in' of %s", jv_type(b));
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
            return rerr(R, x, "'%s' between %s and %s", op, jv_type(a), jv_type(b));
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
        int rc = jr_strv(s, an + bn, out);
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
        int rc = jr_strv(r, sn * (size_t)k, out);
        free(r);
        return rc;
    }
    if (!na || !nb) return rerr(R, x, "'%s' between %s and %s", op, jv_type(a), jv_type(b));
    int ints = ka && kb;
    if (op[0] == '+' || op[0] == '-' || (op[0] == '*' && !op[1])) {
        if (ints) {
            long long r;
            int ov = op[0] == '+' ? __builtin_add_overflow(ia, ib, &r) : op[0] == '-' ? __builtin_sub_overflow(ia, ib, &r)
                                                                                      : __builtin_mul_overflow(ia, ib, &r);
            if (ov) return rerr(R, x, "integer overflow");
            *out = json_integer(r);
        } else {
            *out = json_real(op[0] == '+' ? fa + fb : op[0] == '-' ? fa - fb : fa * fb);
        }
        return *out ? 0 : -ENOMEM;
    }
    if ((ints && ib == 0) || (!ints && fb == 0)) return rerr(R, x, "division by zero");
    if (!strcmp(op, "/")) {
        *out = json_real(fa / fb);
    } else if (ints) {   /* // and %: Python floors */
        if (ia == LLONG_MIN && ib == -1) return rerr(R, x, "integer overflow");
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

static int jr_eval(jrender *R, const jnode *x, json_t **out)
{
    json_t *a = NULL, *b = NULL;
    int rc = 0;
    *out = NULL;
    switch (x->kind) {
    case E_LIT:
        *out = json_incref(x->lit);
        return 0;
    case E_NAME: {
        json_t *v = jr_lookup(R, x->s, x->n);
        *out = v ? json_incref(v) : JV_UNDEF;
        return 0;
    }
    case E_ATTR:
        if ((rc = jr_eval(R, x->a, &a))) return rc;
        if (a == JV_UNDEF) rc = rerr(R, x, "'.%.*s' of an undefined value", (int)x->n, x->s);
        else if (json_is_object(a)) {
            json_t *v = json_object_getn(a, x->s, x->n);
            *out = v ? json_incref(v) : JV_UNDEF;
        } else {
            *out = JV_UNDEF;
        }
        jv_drop(a);
        return rc;
    case E_INDEX:
        if ((rc = jr_eval(R, x->a, &a))) return rc;
        if (!(rc = jr_eval(R, x->b, &b))) rc = jr_index(R, x, a, b, out);
        jv_drop(a);
        jv_drop(b);
        return rc;
    case E_SLICE:
        if ((rc = jr_eval(R, x->a, &a))) return rc;
        rc = jr_slice(R, x, a, out);
        jv_drop(a);
        return rc;
    case E_CALL:
        return jr_call(R, x, out);
    case E_FILTER:
        if ((rc = jr_eval(R, x->a, &a))) return rc;
        rc = jr_filter(R, x, a, out);
        jv_drop(a);
        return rc;
    case E_TEST: {
        int hit = 0;
        if ((rc = jr_eval(R, x->a, &a))) return rc;
        rc = jr_test(R, x, a, &hit);
        jv_drop(a);
        if (!rc) *out = json_boolean(hit);
        return rc;
    }
    case E_NEG: {
        double f;
        long long i;
        int isint;
        if ((rc = jr_eval(R, x->a, &a))) return rc;
        if (!jv_num(a, &f, &i, &isint)) rc = rerr(R, x, "'-' of %s", jv_type(a));
        else if (isint && i == LLONG_MIN) rc = rerr(R, x, "integer overflow");
        else *out = isint ? json_integer(-i) : json_real(-f);
        jv_drop(a);
        return rc;
    }
    case E_NOT:
        if ((rc = jr_eval(R, x->a, &a))) return rc;
        *out = json_boolean(!jv_truthy(a));
        jv_drop(a);
        return 0;
    case E_AND: case E_OR:   /* Python's: the deciding operand itself */
        if ((rc = jr_eval(R, x->a, &a))) return rc;
        if (jv_truthy(a) == (x->kind == E_OR)) {
            *out = a;
            return 0;
        }
        jv_drop(a);
        return jr_eval(R, x->b, out);
    case E_COND:
        if ((rc = jr_eval(R, x->cond, &a))) return rc;
        int t = jv_truthy(a);
        jv_drop(a);
        if (t) return jr_eval(R, x->a, out);
        if (x->b) return jr_eval(R, x->b, out);
        *out = JV_UNDEF;
        return 0;
    case E_BIN:
        if ((rc = jr_eval(R, x->a, &a))) return rc;
        if (!(rc = jr_eval(R, x->b, &b))) rc = jr_binop(R, x, a, b, out);
        jv_drop(a);
        jv_drop(b);
        return rc;
    case E_LIST: case E_DICT: {
        json_t *c = x->kind == E_LIST ? json_array() : json_object();
        if (!c) return -ENOMEM;
        for (const jnode *g = x->args; g && !rc; g = g->next) {
            if ((rc = jr_eval(R, g, &a))) break;
            if (a == JV_UNDEF) {
                rc = rerr(R, g, "an undefined value in a %s literal", x->kind == E_LIST ? "list" : "dict");
            } else if (x->kind == E_LIST) {
                if (json_array_append(c, a)) rc = -ENOMEM;
            } else {
                g = g->next;
                if (!json_is_string(a)) rc = rerr(R, g, "dict keys must be strings");
                else if (!(rc = jr_eval(R, g, &b))) {
                    if (b == JV_UNDEF) rc = rerr(R, g, "an undefined value in a dict literal");
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
        return rerr(R, x, "not an expression");
    }
}

static int jr_body(jrender *R, const jnode *s);

static int jr_push(jrender *R, const jnode *at)
{
    if (R->n_frames == JJ_MAX_DEPTH + 2) return rerr(R, at, "loops nested deeper than %d", JJ_MAX_DEPTH);
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
    if ((rc = jr_eval(R, s->a, &it))) return rc;
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
        rc = rerr(R, s->a, "cannot loop over %s", jv_type(it));
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
            if (rc == 1) rc = rerr(R, s, "cannot unpack an item into two loop variables");
            if (!rc) json_object_del(R->frames[R->n_frames - 1], "loop");
            if (!rc && !(rc = jr_eval(R, s->cond, &c)) && jv_truthy(c) && json_array_append(kept, json_array_get(items, i)))
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
        if (rc == 1) rc = rerr(R, s, "cannot unpack an item into two loop variables");
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
            rc = jb_add(&R->out, s->s, s->n);
            break;
        case S_OUT:
            if (!(rc = jr_eval(R, s->a, &v))) rc = jv_str(&R->out, v);
            jv_drop(v);
            break;
        case S_IF:
            if ((rc = jr_eval(R, s->a, &v))) break;
            rc = jr_body(R, jv_truthy(v) ? s->b : s->c);
            jv_drop(v);
            break;
        case S_FOR:
            rc = jr_for(R, s);
            break;
        case S_SET:
            if ((rc = jr_eval(R, s->a, &v))) break;
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
                rc = rerr(R, s, "setting an attribute to an undefined value");
                break;
            }
            if (s->s2) {
                json_t *o = jr_lookup(R, s->s, s->n);
                int ok = 0;
                for (int i = 0; o && i < R->n_ns; i++) ok |= R->ns[i] == o;
                if (!ok) rc = rerr(R, s, "'%.*s' is not a namespace(): its attributes cannot be set", (int)s->n, s->s);
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
    int rc = jb_add(&R.out, "", 0);
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
