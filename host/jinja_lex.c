/* The lexer of the Jinja2 subset (host/jinja.h): template text and the tags' expression tokens,
 * with the whitespace rules (trim_blocks, lstrip_blocks, {%- -%}, {%+) applied to the text as it
 * is cut, and the error messages that name a line and column. jinja_parse.c reads its tokens;
 * the shared types are in jinja_internal.h. */
#include "host/jinja_internal.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/error.h"

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

int mf_jj_err(const char *src, int pos, int code, const char *fmt, ...)
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
        if (j - i >= sizeof num) return mf_jj_err(s, (int)i, -EINVAL, "number too long");
        memcpy(num, s + i, j - i);
        num[j - i] = 0;
        if (fl) {
            k.type = T_FLOAT;
            k.fv = strtod(num, NULL);
        } else {
            errno = 0;
            k.type = T_INT;
            k.iv = strtoll(num, NULL, 10);
            if (errno) return mf_jj_err(s, (int)i, -EINVAL, "integer %s out of range", num);
        }
        *p = j;
    } else if (c == '\'' || c == '"') {
        size_t j = i + 1;
        char *o = L->strs + L->n_strs;
        k.type = T_STR;
        k.s = o;
        for (;;) {
            if (j >= L->len) return mf_jj_err(s, (int)i, -EINVAL, "unterminated string");
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
            if (j + 1 >= L->len) return mf_jj_err(s, (int)i, -EINVAL, "unterminated string");
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
                        return mf_jj_err(s, (int)j, -EINVAL, "bad \\%c escape in a string", e);
                    char h = s[j];
                    cp = cp * 16 + (uint32_t)(isdigit((unsigned char)h) ? h - '0' : (tolower((unsigned char)h) - 'a' + 10));
                }
                if (cp > 0x10ffff || (cp >= 0xd800 && cp < 0xe000))
                    return mf_jj_err(s, (int)i, -EINVAL, "escape \\%c%X is not a character", e, cp);
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
            return mf_jj_err(s, (int)i, -EINVAL, "unexpected character '%c' in a tag", isprint((unsigned char)c) ? c : '?');
        k.type = T_OP;
        k.op[0] = c;
        *p = i + 1;
    }
    return jl_push(L, k);
}

int mf_jj_lex(jlex *L)
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
            if (e + 1 >= len) return mf_jj_err(s, (int)q, -EINVAL, "comment not closed ('#}')");
            after = e > p && s[e - 1] == '-' ? 1 : e > p && s[e - 1] == '+' ? 0 : 2;
            pos = e + 2;
            continue;
        }
        int var = kind == '{';
        if ((rc = jl_push(L, (jtok){.type = var ? T_VOPEN : T_BOPEN, .pos = (int)q}))) return rc;
        for (;;) {
            while (p < len && jj_isws(s[p])) p++;
            if (p >= len) return mf_jj_err(s, (int)q, -EINVAL, "tag not closed ('%s')", var ? "}}" : "%}");
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
