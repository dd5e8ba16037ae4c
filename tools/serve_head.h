/* `moeflow serve`'s check of an HTTP/1.x request head (the request line and the header fields, up
 * to the blank line), before libmicrohttpd sees it: what libmicrohttpd would refuse with an HTML
 * page (a long target, huge or malformed headers, a bad version) and what it would let through
 * (Content-Length beside Transfer-Encoding, obs-fold, a space before a colon, duplicate framing
 * headers) are refused here with a status and an OpenAI error code, so the front door
 * (tools/serve_door.c) answers with an error object. No sockets and no state, so it is fuzzed with
 * the request parser (tests/fuzz/fuzz_serve_req.c). docs/serve.md, "Hostile clients". */
#ifndef MF_SERVE_HEAD_H
#define MF_SERVE_HEAD_H

#include <stddef.h>
#include <stdint.h>

#define MF_HTTP_MAX_HEAD (16 << 10)     /* request line + headers, bytes: more is 431 */
#define MF_HTTP_MAX_TARGET (8 << 10)    /* the request target, bytes: more is 414 */
#define MF_HTTP_MAX_FIELDS 100          /* header fields: more is 431 */

/* What mf_http_head_check found. On a refusal: status (400, 411, 413, 414, 431, 501, 505), the error
 * object's code and a message; else status 0. */
typedef struct mf_http_head {
    size_t len;                /* bytes of the head, its blank line included (complete heads) */
    int status;
    const char *code;          /* "bad_request", "uri_too_long", ... */
    char message[200];
    int minor;                 /* HTTP/1.minor */
    int64_t content_length;    /* -1: none */
} mf_http_head;

/* Checks the request head at the start of buf[0..n) (leading blank lines are skipped, as RFC 9112
 * allows). Returns 1 when the head is complete or refused (out->status says which), 0 when more
 * bytes are needed: no blank line yet, and fewer than MF_HTTP_MAX_HEAD bytes. Refused: a request
 * line that is not `METHOD SP TARGET SP HTTP/d.d` (400), a version other than 1.0 and 1.1 (505),
 * a target over MF_HTTP_MAX_TARGET bytes (414; also while its line is still arriving), a target
 * that is not origin-form (or `*`) or holds control bytes (400), a head over MF_HTTP_MAX_HEAD bytes
 * or MF_HTTP_MAX_FIELDS fields (431), a field line without a colon, with white space before it, a
 * name that is not a token, a value with control bytes, obs-fold or a bare CR (400),
 * Content-Length twice or not digits (400) or past 2^62 (413), Transfer-Encoding beside Content-Length
 * (400: request smuggling), Transfer-Encoding chunked (411: a body needs Content-Length), any other
 * Transfer-Encoding (501), HTTP/1.1 without exactly one Host (400). */
int mf_http_head_check(const char *buf, size_t n, mf_http_head *out);

#endif
