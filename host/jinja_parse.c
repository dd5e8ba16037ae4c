/* The parser of the Jinja2 subset (host/jinja.h): a recursive descent over jinja_lex.c's tokens
 * into an arena of nodes (jinja_internal.h), expressions by Jinja's precedence levels and the tags
 * if/elif/else, for/else, set and break/continue; mf_jinja_parse and mf_jinja_free. */
#include "host/jinja_internal.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/error.h"

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
    return mf_jj_err(P->t->src, k->pos, -EINVAL, "%s, found %s", m, got);
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
        return mf_jj_err(P->t->src, x->pos, -EINVAL, "expression nested deeper than %d", JJ_MAX_EXPR_DEPTH);
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
    if (++P->depth > JJ_MAX_DEPTH) return mf_jj_err(P->t->src, k->pos, -EINVAL, "nested deeper than %d", JJ_MAX_DEPTH);
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
            if (!n_colon && !part[0]) return mf_jj_err(P->t->src, pos, -EINVAL, "empty subscript");
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
        if (++P->depth > JJ_MAX_DEPTH) return mf_jj_err(P->t->src, pos, -EINVAL, "nested deeper than %d", JJ_MAX_DEPTH);
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
        if (++P->depth > JJ_MAX_DEPTH) return mf_jj_err(P->t->src, pos, -EINVAL, "nested deeper than %d", JJ_MAX_DEPTH);
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
        return mf_jj_err(P->t->src, k->pos, -EINVAL, "unsupported tag '%.*s'", (int)(k->n > 32 ? 32 : k->n), k->s);
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
        return mf_jj_err(P->t->src, P->k[P->i].pos, -EINVAL, "blocks nested deeper than %d", JJ_MAX_DEPTH);
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
    int rc = mf_jj_lex(&L);
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
