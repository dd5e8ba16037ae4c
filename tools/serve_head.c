/* The check of an HTTP/1.x request head before libmicrohttpd sees it (tools/serve_head.h). */
#include "tools/serve_head.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static int mf_head_fail(mf_http_head *h, int status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int mf_head_fail(mf_http_head *h, int status, const char *code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(h->message, sizeof h->message, fmt, ap);
    va_end(ap);
    h->status = status;
    h->code = code;
    return 1;
}

/* RFC 9110 tchar: the bytes of a method or a field name. */
static int mf_tchar(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           (c && strchr("!#$%&'*+-.^_`|~", c));
}

static int mf_name_is(const char *s, size_t n, const char *name)
{
    if (strlen(name) != n) return 0;
    for (size_t i = 0; i < n; i++) {
        char a = s[i] >= 'A' && s[i] <= 'Z' ? (char)(s[i] + 32) : s[i];
        if (a != name[i]) return 0;
    }
    return 1;
}

/* The end of the line starting at p (its LF), or NULL when none is in [p, end); a CR must be
 * followed by LF (*bare_cr 1 otherwise). */
static const char *mf_line_end(const char *p, const char *end, int *bare_cr)
{
    const char *lf = memchr(p, '\n', (size_t)(end - p));
    const char *cr = memchr(p, '\r', (size_t)((lf ? lf : end) - p));
    *bare_cr = cr && cr + 1 != lf && cr + 1 < end;
    return lf;
}

/* The request line p[0..n) (no line ending). 0, or 1 with the refusal. */
static int mf_head_request_line(const char *p, size_t n, mf_http_head *h)
{
    size_t m = 0;
    while (m < n && mf_tchar((unsigned char)p[m])) m++;
    if (m == 0 || m == n || p[m] != ' ')
        return mf_head_fail(h, 400, "bad_request", "malformed request line (expected METHOD SP TARGET SP HTTP/1.1)");
    const char *t = p + m + 1, *sp = memchr(t, ' ', n - m - 1);
    if (!sp) {
        if (n - m - 1 > MF_HTTP_MAX_TARGET)
            return mf_head_fail(h, 414, "uri_too_long", "the request target is longer than %d bytes", MF_HTTP_MAX_TARGET);
        return mf_head_fail(h, 400, "bad_request", "malformed request line (expected METHOD SP TARGET SP HTTP/1.1)");
    }
    size_t tn = (size_t)(sp - t);
    if (tn > MF_HTTP_MAX_TARGET)
        return mf_head_fail(h, 414, "uri_too_long", "the request target is longer than %d bytes", MF_HTTP_MAX_TARGET);
    const char *v = sp + 1;
    size_t vn = n - (size_t)(v - p);
    if (vn != 8 || memcmp(v, "HTTP/", 5) || v[5] < '0' || v[5] > '9' || v[6] != '.' || v[7] < '0' || v[7] > '9')
        return mf_head_fail(h, 400, "bad_request", "malformed request line (expected METHOD SP TARGET SP HTTP/1.1)");
    if (v[5] != '1' || v[7] > '1')
        return mf_head_fail(h, 505, "http_version_not_supported", "HTTP/%c.%c is not supported (HTTP/1.0 and 1.1 are)",
                            v[5], v[7]);
    h->minor = v[7] - '0';
    if (tn == 0 || (t[0] != '/' && !(tn == 1 && t[0] == '*')))
        return mf_head_fail(h, 400, "bad_request", "the request target must be a path beginning with '/'");
    for (size_t i = 0; i < tn; i++)
        if ((unsigned char)t[i] <= 0x20 || (unsigned char)t[i] == 0x7f)
            return mf_head_fail(h, 400, "bad_request", "the request target holds a control byte or a space");
    return 0;
}

/* What the field lines said about the framing. */
typedef struct mf_head_fields {
    int n_host, n_cl, n_te, chunked_only;
} mf_head_fields;

/* One field line p[0..n) (no line ending). 0, or 1 with the refusal. */
static int mf_head_field(const char *p, size_t n, mf_head_fields *f, mf_http_head *h)
{
    if (p[0] == ' ' || p[0] == '\t')
        return mf_head_fail(h, 400, "bad_request", "obsolete line folding in the header fields");
    const char *colon = memchr(p, ':', n);
    if (!colon) return mf_head_fail(h, 400, "bad_request", "a header field line without a colon");
    size_t nn = (size_t)(colon - p);
    for (size_t i = 0; i < nn; i++)
        if (!mf_tchar((unsigned char)p[i]))
            return mf_head_fail(h, 400, "bad_request", "a header field name that is not a token (white space before "
                                "the colon?)");
    if (nn == 0) return mf_head_fail(h, 400, "bad_request", "a header field with an empty name");
    const char *v = colon + 1, *e = p + n;
    for (const char *q = v; q < e; q++)
        if (((unsigned char)*q < 0x20 && *q != '\t') || *q == 0x7f)
            return mf_head_fail(h, 400, "bad_request", "a header field value holds a control byte");
    while (v < e && (*v == ' ' || *v == '\t')) v++;
    while (e > v && (e[-1] == ' ' || e[-1] == '\t')) e--;
    if (mf_name_is(p, nn, "host")) {
        f->n_host++;
    } else if (mf_name_is(p, nn, "content-length")) {
        if (++f->n_cl > 1) return mf_head_fail(h, 400, "bad_request", "Content-Length is given more than once");
        if (v == e) return mf_head_fail(h, 400, "bad_request", "Content-Length is empty");
        int64_t cl = 0;
        for (const char *q = v; q < e; q++) {
            if (*q < '0' || *q > '9') return mf_head_fail(h, 400, "bad_request", "Content-Length is not a number of bytes");
            if (cl > (INT64_C(1) << 62) / 10)
                return mf_head_fail(h, 413, "body_too_large", "Content-Length is past any body this server takes");
            cl = cl * 10 + (*q - '0');
        }
        h->content_length = cl;
    } else if (mf_name_is(p, nn, "transfer-encoding")) {
        f->n_te++;
        f->chunked_only = (size_t)(e - v) == 7 && mf_name_is(v, 7, "chunked") && f->n_te == 1;
    }
    return 0;
}

int mf_http_head_check(const char *buf, size_t n, mf_http_head *out)
{
    mf_http_head *h = out;
    memset(h, 0, sizeof *h);
    h->content_length = -1;
    const char *p = buf, *end = buf + (n > MF_HTTP_MAX_HEAD ? MF_HTTP_MAX_HEAD : n);
    int bare_cr = 0;
    while (p < end && (*p == '\n' || (*p == '\r' && p + 1 < end && p[1] == '\n'))) p += *p == '\r' ? 2 : 1;
    const char *lf = mf_line_end(p, end, &bare_cr);
    if (bare_cr) return mf_head_fail(h, 400, "bad_request", "a bare CR in the request line");
    if (!lf) {   /* the request line is still arriving: a target already too long is refused now */
        const char *sp = memchr(p, ' ', (size_t)(end - p));
        if (sp && (size_t)(end - sp - 1) > MF_HTTP_MAX_TARGET + 10)
            return mf_head_fail(h, 414, "uri_too_long", "the request target is longer than %d bytes", MF_HTTP_MAX_TARGET);
        if (n >= MF_HTTP_MAX_HEAD)
            return mf_head_fail(h, 431, "header_too_large", "the request head is larger than %d bytes", MF_HTTP_MAX_HEAD);
        return 0;
    }
    if (mf_head_request_line(p, (size_t)(lf - p - (lf > p && lf[-1] == '\r')), h)) return 1;
    mf_head_fields f = {0};
    int n_fields = 0;
    for (p = lf + 1;; p = lf + 1) {
        if (p >= end) break;
        lf = mf_line_end(p, end, &bare_cr);
        if (bare_cr) return mf_head_fail(h, 400, "bad_request", "a bare CR in the header fields");
        if (!lf) break;
        size_t ln = (size_t)(lf - p - (lf > p && lf[-1] == '\r'));
        if (ln == 0) {   /* the blank line: the head is complete */
            h->len = (size_t)(lf + 1 - buf);
            if (f.n_te && f.n_cl)
                return mf_head_fail(h, 400, "bad_request", "both Content-Length and Transfer-Encoding are given "
                                    "(refused: request smuggling)");
            if (f.n_te && f.chunked_only)
                return mf_head_fail(h, 411, "length_required", "a request body needs Content-Length (chunked uploads "
                                    "are not accepted)");
            if (f.n_te) return mf_head_fail(h, 501, "not_implemented", "Transfer-Encoding other than chunked");
            if (h->minor == 1 && f.n_host != 1)
                return mf_head_fail(h, 400, "bad_request", "an HTTP/1.1 request needs exactly one Host header (found %d)",
                                    f.n_host);
            return 1;
        }
        if (++n_fields > MF_HTTP_MAX_FIELDS)
            return mf_head_fail(h, 431, "header_too_large", "more than %d header fields", MF_HTTP_MAX_FIELDS);
        if (mf_head_field(p, ln, &f, h)) return 1;
    }
    if (n >= MF_HTTP_MAX_HEAD)
        return mf_head_fail(h, 431, "header_too_large", "the request head is larger than %d bytes", MF_HTTP_MAX_HEAD);
    return 0;
}
