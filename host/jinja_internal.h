/* Shared internals of the Jinja2 subset (host/jinja.h), which is cut into jinja_lex.c (text and
 * tokens), jinja_parse.c (tokens to nodes), jinja_value.c (Python's view of jansson values),
 * jinja_render.c (walking the nodes) and jinja_builtin.c (filters, tests, methods, functions).
 * Names: mf_jj_ the lexer and its errors, mf_jv_ values, mf_jb_ output buffers, mf_jr_ rendering.
 * Not a public header: nothing outside host/jinja_*.c includes it. */
#ifndef MF_JINJA_INTERNAL_H
#define MF_JINJA_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "host/jinja.h"

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

/* ---- lexer (jinja_lex.c) ---------------------------------------------------------------------- */

typedef struct jlex {
    const char *src;
    size_t len;
    jtok *t;
    int n, cap;
    char *strs;        /* string literals' bytes: at most len bytes in all */
    size_t n_strs;
} jlex;

/* A failure at byte offset pos of src: mf_error(code, "chat template line L column C: ...");
 * returns code. */
int mf_jj_err(const char *src, int pos, int code, const char *fmt, ...) __attribute__((format(printf, 4, 5)));

static inline int jj_isws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

/* Cuts L->src[0..len) into L->t (ending with T_EOF), string literals' bytes into L->strs; 0,
 * -EINVAL (mf_jj_err) or -ENOMEM. */
int mf_jj_lex(jlex *L);

/* ---- values (jinja_value.c) ------------------------------------------------------------------- */

/* Values are jansson references; an undefined value is the sentinel JV_UNDEF, never passed to jansson. */
extern const char mf_jv_undef_tag;
#define JV_UNDEF ((json_t *)(uintptr_t)&mf_jv_undef_tag)

static inline void jv_drop(json_t *v)
{
    if (v && v != JV_UNDEF) json_decref(v);
}
static inline json_t *jv_keep(json_t *v) { return v == JV_UNDEF ? v : json_incref(v); }

typedef struct jbuf {
    char *p;
    size_t n, cap;
} jbuf;

/* Appends s[0..n) and keeps b->p NUL-terminated; -E2BIG past JJ_MAX_OUT, -ENOMEM. */
int mf_jb_add(jbuf *b, const char *s, size_t n);
int mf_jb_str(jbuf *b, const char *s);

/* Appends Python's str() of v (nothing for undefined). */
int mf_jv_str(jbuf *b, json_t *v);
int mf_jv_truthy(json_t *v);
/* Python's type name of v ("str", "int", "list", "dict", "NoneType", ..., "undefined"). */
const char *mf_jv_type(json_t *v);
/* 1 and the number when v is an int, bool or float (*is_int for int and bool); else 0. */
int mf_jv_num(json_t *v, double *f, long long *i, int *is_int);
/* Python's ==: 1 == 1.0 == True, lists and dicts by their items. */
int mf_jv_eq(json_t *a, json_t *b);

/* ---- renderer (jinja_render.c) ---------------------------------------------------------------- */

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

/* A failure at node x: -EINVAL with the line and column of x. */
int mf_jr_err(jrender *R, const jnode *x, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Evaluates x into *out (a new reference, or JV_UNDEF); 0 or a negative code. */
int mf_jr_eval(jrender *R, const jnode *x, json_t **out);
/* The innermost scope's value of name s[0..n) (borrowed), or NULL. */
json_t *mf_jr_lookup(jrender *R, const char *s, size_t n);
/* *out = a new string s[0..n); 0 or -ENOMEM. */
int mf_jr_strv(const char *s, size_t n, json_t **out);
/* Drops the values pos[0..n). */
void mf_jr_drop_args(json_t **pos, int n);
/* A call's arguments: positional ones into pos (at most max_pos), keyword ones into kw (NULL: none
 * allowed). On an error the positional values taken so far are dropped and *n_pos is 0. */
int mf_jr_args(jrender *R, const jnode *x, json_t **pos, int max_pos, int *n_pos, json_t *kw);

/* ---- built-ins (jinja_builtin.c) -------------------------------------------------------------- */

/* x(args): a method of a string or dict (x->a an E_ATTR) or a global function. */
int mf_jr_call(jrender *R, const jnode *x, json_t **out);
/* v | x->s(x->args) */
int mf_jr_filter(jrender *R, const jnode *x, json_t *v, json_t **out);
/* v is [not] x->s: *hit 1 or 0 */
int mf_jr_test(jrender *R, const jnode *x, json_t *v, int *hit);

#endif
