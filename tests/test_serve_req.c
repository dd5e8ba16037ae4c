/* `moeflow serve`'s request parser (tools/serve_req.c): defaults, every field's type and range,
 * the refusals' messages and params, the chat template; its check of request heads
 * (tools/serve_head.c): each refusal's status and code, complete and incomplete heads; and the fuzz
 * seed corpus (tests/fuzz/corpus_serve) replayed through the fuzz target: valid_* parse, invalid_*
 * are refused, head_* are heads. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>
#include "sched/error.h"

#include "tests/check.h"
#include "tests/fuzz/fuzz_serve_req.c"
#include "tools/serve_head.h"

static int parse(const char *body, int chat, mf_serve_req *r, mf_serve_err *e)
{
    return mf_serve_req_parse(body, strlen(body), chat, r, e);
}

static void refused(const char *body, int chat, const char *param, const char *words)
{
    mf_serve_req r;
    mf_serve_err e;
    int rc = parse(body, chat, &r, &e);
    CHECK(rc == -EINVAL && !strcmp(e.param, param) && strstr(e.message, words), "%s: rc %d param '%s' message '%s'",
          body, rc, e.param, e.message);
    if (!rc) mf_serve_req_clear(&r);
}

/* One head: mf_http_head_check's answer (rc, status, code; for a complete one its length). */
static void head(const char *h, int rc_want, int status, const char *code)
{
    mf_http_head x;
    int rc = mf_http_head_check(h, strlen(h), &x);
    CHECK(rc == rc_want && x.status == status && (!code || (x.code && !strcmp(x.code, code))) &&
          (rc == 0 || status || x.len == strlen(h)) && (!status || x.message[0]),
          "head %.60s: rc %d status %d code %s len %zu", h, rc, x.status, x.code ? x.code : "-", x.len);
}

static void check_heads(void)
{
    head("GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 1, 0, NULL);
    head("\r\nGET /health HTTP/1.0\n\n", 1, 0, NULL);   /* a leading blank line, bare LF, 1.0 without Host */
    head("GET * HTTP/1.1\r\nHost: x\r\n\r\n", 1, 0, NULL);
    head("GET /health HTTP/1.1\r\nHost: x\r\n", 0, 0, NULL);
    head("GET /health HTT", 0, 0, NULL);
    head("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n", 1,
         400, "bad_request");
    head("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", 1, 411, "length_required");
    head("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 1, 501, "not_implemented");
    head("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n", 1, 400, "bad_request");
    head("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: +1\r\n\r\n", 1, 400, "bad_request");
    head("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 123456789012345678901\r\n\r\n", 1, 413, "body_too_large");
    head("GET / HTTP/1.1\r\nHost : x\r\n\r\n", 1, 400, "bad_request");
    head("GET / HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", 1, 400, "bad_request");
    head("GET / HTTP/1.1\r\nHost: x\r\nA: 1\r2\r\n\r\n", 1, 400, "bad_request");
    head("GET / HTTP/1.1\rHost: x\r\n\r\n", 1, 400, "bad_request");
    head("GET / HTTP/1.1\r\nNoColon\r\n\r\n", 1, 400, "bad_request");
    head("GET / HTTP/1.1\r\n\r\n", 1, 400, "bad_request");   /* no Host */
    head("GET / HTTP/2.0\r\nHost: x\r\n\r\n", 1, 505, "http_version_not_supported");
    head("GET / HTTP/0.9\r\nHost: x\r\n\r\n", 1, 505, "http_version_not_supported");
    head("GET / HTTP/1.1x\r\nHost: x\r\n\r\n", 1, 400, "bad_request");
    head("GET  / HTTP/1.1\r\nHost: x\r\n\r\n", 1, 400, "bad_request");
    head("GET http://h/ HTTP/1.1\r\nHost: x\r\n\r\n", 1, 400, "bad_request");
    head("G(T / HTTP/1.1\r\nHost: x\r\n\r\n", 1, 400, "bad_request");
    char *big = malloc(MF_HTTP_MAX_HEAD + 64);
    snprintf(big, MF_HTTP_MAX_HEAD + 64, "GET /%0*d HTTP/1.1\r\nHost: x\r\n\r\n", MF_HTTP_MAX_TARGET, 0);
    head(big, 1, 414, "uri_too_long");
    big[MF_HTTP_MAX_TARGET + 40] = 0;   /* its line still arriving */
    head(big, 1, 414, "uri_too_long");
    snprintf(big, MF_HTTP_MAX_HEAD + 64, "GET / HTTP/1.1\r\nHost: x\r\nX: %0*d\r\n\r\n", MF_HTTP_MAX_HEAD, 0);
    head(big, 1, 431, "header_too_large");
    int k = snprintf(big, MF_HTTP_MAX_HEAD + 64, "GET / HTTP/1.1\r\nHost: x\r\n");
    for (int i = 0; i <= MF_HTTP_MAX_FIELDS; i++) k += snprintf(big + k, (size_t)(MF_HTTP_MAX_HEAD + 64 - k), "X%d: 1\r\n", i);
    snprintf(big + k, (size_t)(MF_HTTP_MAX_HEAD + 64 - k), "\r\n");
    head(big, 1, 431, "header_too_large");
    free(big);
    mf_http_head x;
    const char *p = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 16\r\n\r\n{\"prompt\": \"hi\"}";
    CHECK(mf_http_head_check(p, strlen(p), &x) == 1 && x.status == 0 && x.content_length == 16 && x.minor == 1 &&
          x.len == strlen(p) - 16, "a head with its body: len %zu cl %lld", x.len, (long long)x.content_length);
}

int main(void)
{
    check_heads();
    mf_serve_req r;
    mf_serve_err e;
    CHECK(parse("{\"prompt\": \"hi\"}", 0, &r, &e) == 0 && r.prompt && !strcmp(r.prompt, "hi") && r.max_tokens == -1 &&
          r.temperature == 1 && r.top_p == 1 && !r.stream && r.n_stop == 0, "defaults");
    mf_serve_req_clear(&r);
    CHECK(parse("{\"prompt\": [[3, 4]], \"max_tokens\": 7, \"temperature\": 0, \"top_p\": 0.5, \"seed\": 9, "
                "\"stream\": true, \"stop\": \"\\n\", \"ignore_eos\": true, \"model\": \"m\", \"n\": 1}", 0, &r, &e) == 0 &&
          r.n_ids == 2 && r.ids[1] == 4 && r.max_tokens == 7 && r.temperature == 0 && r.top_p == 0.5 && r.seed == 9 &&
          r.stream && r.ignore_eos && r.n_stop == 1 && !strcmp(r.stop[0], "\n") && !strcmp(r.model, "m"), "fields: %s",
          e.message);
    mf_serve_req_clear(&r);
    refused("{\"prompt\": ", 0, "", "malformed JSON");
    refused("7", 0, "", "JSON object");
    refused("{}", 0, "prompt", "required");
    refused("{\"prompt\": 5}", 0, "prompt", "must be");
    refused("{\"prompt\": [1, -2]}", 0, "prompt", "token id");
    refused("{\"prompt\": [\"a\", \"b\"]}", 0, "prompt", "one prompt");
    CHECK(parse("{\"prompt\": \"x\", \"n\": 3}", 0, &r, &e) == 0 && r.n == 3, "n 3: %s", e.message);
    mf_serve_req_clear(&r);
    CHECK(parse("{\"prompt\": \"x\"}", 0, &r, &e) == 0 && r.n == 1, "n default: %s", e.message);
    mf_serve_req_clear(&r);
    refused("{\"prompt\": \"x\", \"n\": 0}", 0, "n", "1..16");
    refused("{\"prompt\": \"x\", \"n\": 17}", 0, "n", "1..16");
    refused("{\"prompt\": \"x\", \"n\": 2.5}", 0, "n", "integer");
    refused("{\"prompt\": \"x\", \"max_tokens\": 1.5}", 0, "max_tokens", "non-negative integer");
    refused("{\"prompt\": \"x\", \"temperature\": 3}", 0, "temperature", "0..2");
    refused("{\"prompt\": \"x\", \"top_p\": 0}", 0, "top_p", "> 0");
    refused("{\"prompt\": \"x\", \"stream\": \"yes\"}", 0, "stream", "true or false");
    refused("{\"prompt\": \"x\", \"stop\": [\"\"]}", 0, "stop", "non-empty");
    refused("{\"prompt\": \"x\", \"presence_penalty\": 1}", 0, "presence_penalty", "not supported");
    refused("{\"prompt\": \"x\", \"echo\": true}", 0, "echo", "not supported");
    refused("{\"prompt\": \"x\", \"best_of\": 2}", 0, "best_of", "best_of");
    refused("{\"prompt\": \"x\", \"seed\": \"1\"}", 0, "seed", "integer");
    refused("{\"messages\": []}", 1, "messages", "non-empty");
    refused("{\"messages\": [{\"role\": \"user\"}]}", 1, "messages", "content");
    refused("{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}", 1, "messages", "text");
    refused("{\"prompt\": \"x\"}", 1, "messages", "required");
    /* content null is allowed (assistant messages); chat template */
    CHECK(parse("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}, "
                "{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \"again\"}], "
                "\"max_completion_tokens\": 4}", 1, &r, &e) == 0 && r.n_msgs == 4 && r.max_tokens == 4, "chat: %s", e.message);
    char *t = NULL;
    size_t n = 0;
    int bos_in_text = -1;
    CHECK(mf_serve_chat_render(&r, NULL, &t, &n, &bos_in_text) == 0 && bos_in_text == 0 &&
          !strcmp(t, "S<\xef\xbd\x9cUser\xef\xbd\x9c>hi<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>yo<\xef\xbd\x9c" "end\xe2\x96\x81of"
                     "\xe2\x96\x81sentence\xef\xbd\x9c><\xef\xbd\x9cUser\xef\xbd\x9c>again<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>") &&
          n == strlen(t), "template: '%s'", t ? t : "");
    /* a checkpoint's chat template (tokenizer_config.json): tests/py/chat_templates/deepseek_v3_style.jinja
     * writes the built-in format (one system message), after the bos_token */
    const char *tmp = getenv("MOEFLOW_TMP") ? getenv("MOEFLOW_TMP") : "/tmp";
    char ck[900], cfgp[1000], tp[1000];
    snprintf(ck, sizeof ck, "%s/serve_req_chat", tmp);
    snprintf(cfgp, sizeof cfgp, "%s/tokenizer_config.json", ck);
    snprintf(tp, sizeof tp, "%s/tests/py/chat_templates/deepseek_v3_style.jinja", MF_SOURCE_DIR);
    mkdir(ck, 0755);
    FILE *tf = fopen(tp, "rb");
    char src[8192];
    size_t ns = tf ? fread(src, 1, sizeof src - 1, tf) : 0;
    if (tf) fclose(tf);
    src[ns] = 0;
    CHECK(ns > 0, "cannot read %s", tp);
    static const char bos[] = "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>";
    json_t *cfg = json_pack("{s:{s:s},s:s,s:s}", "bos_token", "content", bos,
                            "eos_token", "</s>", "chat_template", src);
    CHECK(cfg && json_dump_file(cfg, cfgp, 0) == 0, "cannot write %s", cfgp);
    json_decref(cfg);
    mf_chat_tmpl *ct = NULL;
    char desc[4400];
    CHECK(mf_chat_tmpl_load(ck, NULL, &ct, desc, sizeof desc) == 0 && ct && strstr(desc, "tokenizer_config.json"),
          "load: %s", mf_last_error());
    char *t2 = NULL;
    size_t n2 = 0;
    bos_in_text = -1;
    CHECK(ct && mf_serve_chat_render(&r, ct, &t2, &n2, &bos_in_text) == 0 && bos_in_text == 1 &&
          !strncmp(t2, bos, strlen(bos)) && !strcmp(t2 + strlen(bos), t),
          "checkpoint template: '%s' against the built-in '%s' (%s)", t2 ? t2 : "", t, mf_last_error());
    free(t2);
    mf_chat_tmpl_free(ct);
    ct = NULL;
    CHECK(mf_chat_tmpl_load(ck, "builtin", &ct, desc, sizeof desc) == 0 && !ct && strstr(desc, "built-in"), "builtin");
    /* a template moeflow does not render: refused at load with its position */
    cfg = json_pack("{s:s}", "chat_template", "{{ bos_token }}\n{% macro x() %}{% endmacro %}");
    CHECK(cfg && json_dump_file(cfg, cfgp, 0) == 0, "cannot write %s", cfgp);
    json_decref(cfg);
    CHECK(mf_chat_tmpl_load(ck, NULL, &ct, desc, sizeof desc) == -EINVAL && !ct &&
          strstr(mf_last_error(), "line 2 column 4: unsupported tag 'macro'"), "refusal: %s", mf_last_error());
    CHECK(mf_chat_tmpl_load(ck, "/nonexistent/t.jinja", &ct, desc, sizeof desc) == -ENOENT, "missing file");
    /* a template's raise_exception is the request's error */
    cfg = json_pack("{s:s}", "chat_template", "{% for m in messages if m.role == 'system' %}{{ raise_exception('no system messages') }}{% endfor %}");
    CHECK(cfg && json_dump_file(cfg, cfgp, 0) == 0, "cannot write %s", cfgp);
    json_decref(cfg);
    CHECK(mf_chat_tmpl_load(ck, NULL, &ct, desc, sizeof desc) == 0 && ct, "load: %s", mf_last_error());
    CHECK(ct && mf_serve_chat_render(&r, ct, &t2, &n2, &bos_in_text) == -EINVAL && strstr(mf_last_error(), "no system messages"),
          "raise_exception: %s", mf_last_error());
    mf_chat_tmpl_free(ct);
    unlink(cfgp);
    free(t);
    mf_serve_req_clear(&r);

    /* the fuzz corpus */
    const char *dir = MF_SOURCE_DIR "/tests/fuzz/corpus_serve";
    DIR *d = opendir(dir);
    CHECK(d != NULL, "cannot open %s", dir);
    int n_valid = 0, n_invalid = 0, n_heads = 0;
    struct dirent *de;
    while (d && (de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.') continue;
        char path[1024], buf[8192];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        FILE *f = fopen(path, "rb");
        size_t len = f ? fread(buf, 1, sizeof buf, f) : 0;
        if (f) fclose(f);
        CHECK(len >= 1, "cannot read %s", path);
        if (len < 1) continue;
        LLVMFuzzerTestOneInput((const uint8_t *)buf, len);   /* aborts on a broken invariant */
        if (!strncmp(de->d_name, "head_", 5)) {
            n_heads++;
            continue;
        }
        int rc = mf_serve_req_parse(buf + 1, len - 1, buf[0] & 1, &r, &e);
        if (!rc) mf_serve_req_clear(&r);
        if (!strncmp(de->d_name, "valid_", 6)) {
            CHECK(rc == 0, "%s should parse: %s", de->d_name, e.message);
            n_valid++;
        } else {
            CHECK(rc < 0 && e.message[0], "%s should be refused", de->d_name);
            n_invalid++;
        }
    }
    if (d) closedir(d);
    CHECK(n_valid >= 3 && n_invalid >= 3 && n_heads >= 5, "corpus: %d valid, %d invalid, %d heads", n_valid, n_invalid,
          n_heads);
    return mf_check_exit("test_serve_req");
}
