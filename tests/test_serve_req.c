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

/* logprobs, echo, penalties, logit_bias, response_format, tools: accepted values and refusals. */
static void test_new_fields(void)
{
    mf_serve_req r;
    mf_serve_err e;
    CHECK(parse("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"logprobs\": true, \"top_logprobs\": 5}", 1,
                &r, &e) == 0 && r.logprobs == 1 && r.top_logprobs == 5, "chat logprobs: %s", e.message);
    mf_serve_req_clear(&r);
    CHECK(parse("{\"prompt\": [1, 2], \"logprobs\": 3, \"echo\": true, \"max_tokens\": 0}", 0, &r, &e) == 0 && r.logprobs &&
          r.top_logprobs == 3 && r.echo && r.max_tokens == 0, "completions logprobs: %s", e.message);
    mf_serve_req_clear(&r);
    CHECK(parse("{\"prompt\": \"x\", \"presence_penalty\": 0.5, \"frequency_penalty\": -1, \"repetition_penalty\": 1.3, "
                "\"min_p\": 0.1, \"top_k\": 40, \"logit_bias\": {\"5\": 100, \"7\": -100}}", 0, &r, &e) == 0 &&
          r.presence_penalty == 0.5 && r.frequency_penalty == -1 && r.repetition_penalty == 1.3 && r.min_p == 0.1 &&
          r.top_k == 40 && r.n_bias == 2 && r.bias[1].id == 7 && r.bias[1].bias == -100, "controls: %s", e.message);
    mf_serve_req_clear(&r);
    CHECK(parse("{\"prompt\": \"x\", \"top_k\": -1}", 0, &r, &e) == 0 && r.top_k == 0 && r.repetition_penalty == 1,
          "top_k -1: %s", e.message);
    mf_serve_req_clear(&r);
    static const char *const bad[][3] = {
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"logprobs\": true, \"top_logprobs\": 21}", "top_logprobs", "0..20"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"top_logprobs\": 2}", "top_logprobs", "needs 'logprobs'"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"logprobs\": 1}", "logprobs", "true or false"},
        {"{\"prompt\": \"x\", \"logprobs\": true}", "logprobs", "integer 0..20"},
        {"{\"prompt\": \"x\", \"logprobs\": 21}", "logprobs", "0..20"},
        {"{\"prompt\": \"x\", \"frequency_penalty\": \"a\"}", "frequency_penalty", "number"},
        {"{\"prompt\": \"x\", \"repetition_penalty\": 0}", "repetition_penalty", "> 0"},
        {"{\"prompt\": \"x\", \"repetition_penalty\": 2.5}", "repetition_penalty", "0..2"},
        {"{\"prompt\": \"x\", \"min_p\": 1.5}", "min_p", "0..1"},
        {"{\"prompt\": \"x\", \"top_k\": -2}", "top_k", "integer"},
        {"{\"prompt\": \"x\", \"top_k\": 1.5}", "top_k", "integer"},
        {"{\"prompt\": \"x\", \"logit_bias\": []}", "logit_bias", "object"},
        {"{\"prompt\": \"x\", \"logit_bias\": {\"x\": 1}}", "logit_bias", "not a token id"},
        {"{\"prompt\": \"x\", \"logit_bias\": {\"-1\": 1}}", "logit_bias", "not a token id"},
        {"{\"prompt\": \"x\", \"logit_bias\": {\"5\": 101}}", "logit_bias", "-100..100"},
        {"{\"prompt\": \"x\", \"response_format\": {\"type\": \"xml\"}}", "response_format", "must be"},
        {"{\"prompt\": \"x\", \"response_format\": {\"type\": \"json_schema\"}}", "response_format", "'schema'"},
        {"{\"prompt\": \"x\", \"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"n\", "
         "\"schema\": {\"type\": \"string\", \"pattern\": \"a\"}}}}", "response_format", "unsupported keyword 'pattern' at #"},
        {"{\"prompt\": \"x\", \"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"schema\": "
         "{\"$ref\": \"#\"}}}}", "response_format", "'$ref'"},
        {"{\"prompt\": \"x\", \"functions\": [{\"name\": \"f\"}]}", "functions", "tools"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tool_choice\": \"required\"}", "tool_choice", "needs 'tools'"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": \"function\", \"function\": "
         "{\"name\": \"a b\"}}]}", "tools", "tools[0]"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": \"function\", \"function\": "
         "{\"name\": \"f\"}}, {\"type\": \"function\", \"function\": {\"name\": \"f\"}}]}", "tools", "given twice"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": \"function\", \"function\": "
         "{\"name\": \"f\"}}], \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"g\"}}}", "tool_choice",
         "not in 'tools'"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": [{\"type\": \"function\", \"function\": "
         "{\"name\": \"f\", \"parameters\": {\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\", "
         "\"minimum\": 0}}}}}], \"tool_choice\": \"required\"}", "tools", "unsupported keyword 'minimum'"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tool_choice\": 3}", "tool_choice", "must be"},
        {"{\"messages\": [{\"role\": \"tool\", \"content\": \"x\", \"tool_call_id\": 3}]}", "messages", "tool_call_id"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\", \"tool_calls\": []}]}", "messages", "assistant"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) refused(bad[i][0], bad[i][0][2] == 'm', bad[i][1], bad[i][2]);
    CHECK(parse("{\"prompt\": \"x\", \"response_format\": {\"type\": \"json_object\"}}", 0, &r, &e) == 0 && r.grammar &&
          r.json_mode == 1, "json_object: %s", e.message);
    mf_serve_req_clear(&r);
    const char *tools = "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"d\", "
                        "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}, \"days\": "
                        "{\"type\": \"integer\"}}, \"required\": [\"city\"]}}}, {\"type\": \"function\", \"function\": {\"name\": \"now\"}}]";
    char body[2048];
    static const char *const choices[] = {"", ", \"tool_choice\": \"auto\"", ", \"tool_choice\": \"required\"",
                                          ", \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"now\"}}",
                                          ", \"tool_choice\": \"none\""};
    static const int want[] = {MF_TOOLS_AUTO, MF_TOOLS_AUTO, MF_TOOLS_REQUIRED, MF_TOOLS_NAMED, MF_TOOLS_NONE};
    for (int i = 0; i < 5; i++) {
        snprintf(body, sizeof body, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"assistant\", "
                 "\"tool_calls\": [{\"id\": \"c1\", \"type\": \"function\", \"function\": {\"name\": \"now\", \"arguments\": "
                 "\"{}\"}}]}, {\"role\": \"tool\", \"tool_call_id\": \"c1\", \"content\": \"12:00\"}], %s%s}", tools, choices[i]);
        int rc = parse(body, 1, &r, &e);
        CHECK(rc == 0 && r.tool_choice == want[i] && r.n_tools == (i == 4 ? 0 : 2) && !r.grammar == (i < 2 || i == 4) &&
              r.msgs[1].content_null && r.msgs[1].tool_calls && strstr(r.msgs[1].tool_calls, "\"arguments\":{}") &&
              r.msgs[2].tool_call_id && !strcmp(r.msgs[2].tool_call_id, "c1"), "tools %d: %s", i, e.message);
        if (!rc) mf_serve_req_clear(&r);
    }
}

/* DeepSeek-V4 DSML tool calls: parsing, the streamed content's safe length, the forced-call grammar. */
static void test_tools(void)
{
    mf_serve_req r;
    mf_serve_err e;
    const char *body = "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tool_choice\": \"required\", \"tools\": "
                       "[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\", "
                       "\"properties\": {\"city\": {\"type\": \"string\"}, \"days\": {\"type\": \"integer\"}}}}}, "
                       "{\"type\": \"function\", \"function\": {\"name\": \"now\", \"parameters\": {\"type\": \"object\", "
                       "\"properties\": {}}}}]}";
    CHECK(parse(body, 1, &r, &e) == 0 && r.grammar, "tools: %s", e.message);
    if (!r.grammar) return;
    const char *call = "\n\n<" MF_DSML "tool_calls>\n" MF_DSML_INVOKE "get_weather\">\n" MF_DSML_PARAM "city\" string=\"true\">"
                       "Paris, \"FR\"" MF_DSML_PARAM_CLOSE "\n" MF_DSML_PARAM "days\" string=\"false\">3" MF_DSML_PARAM_CLOSE
                       "\n" MF_DSML_INVOKE_CLOSE "\n" MF_DSML_INVOKE "now\">\n\n" MF_DSML_INVOKE_CLOSE "\n" MF_DSML_CALLS_CLOSE;
    char text[2048];
    snprintf(text, sizeof text, "Let me look.%s", call);
    mf_tool_calls tc;
    CHECK(mf_serve_tools_parse(&r, text, strlen(text), &tc) == 1 && tc.n == 2 && !strcmp(tc.content, "Let me look.") &&
          !strcmp(tc.calls[0].name, "get_weather") && !strcmp(tc.calls[0].args, "{\"city\":\"Paris, \\\"FR\\\"\",\"days\":3}") &&
          !strcmp(tc.calls[1].name, "now") && !strcmp(tc.calls[1].args, "{}"), "parse: %s", tc.n ? tc.calls[0].args : "");
    mf_tool_calls_clear(&tc);
    CHECK(mf_serve_tools_parse(&r, "plain text", 10, &tc) == 0, "no calls");
    static const char *const bad[] = {"get_wether", "days\" string=\"false\">x"};
    for (int i = 0; i < 2; i++) {   /* an unknown tool, a value that is not JSON: the text stays content */
        char t2[2048];
        snprintf(t2, sizeof t2, "%s", text);
        char *at = strstr(t2, i ? "days\" string=\"false\">3" : "get_weather");
        memmove(at + strlen(bad[i]), at + (i ? strlen("days\" string=\"false\">3") : 11), strlen(at) + 1);
        memcpy(at, bad[i], strlen(bad[i]));
        CHECK(mf_serve_tools_parse(&r, t2, strlen(t2), &tc) == -EINVAL, "malformed %d", i);
    }
    CHECK(mf_serve_tools_content_len("abc\n\n<\xef\xbd", 8) == 3 && mf_serve_tools_content_len("abc\n", 4) == 3 &&
          mf_serve_tools_content_len("abc", 3) == 3 && mf_serve_tools_content_len(text, strlen(text)) == 12, "content length");
    /* the forced call's grammar takes exactly such text, byte by byte */
    static char bytes[256];
    const char *toks[257];
    size_t lens[257];
    for (int i = 0; i < 256; i++) bytes[i] = (char)i, toks[i] = bytes + i, lens[i] = 1;
    toks[256] = NULL, lens[256] = 0;
    mf_gram_vocab *v = NULL;
    mf_gram_match *m = NULL;
    CHECK(mf_gram_vocab_from(toks, lens, 257, 256, &v) == 0 && mf_gram_match_new(v, &m) == 0, "matcher");
    mf_gram_match_start(m, r.grammar);
    CHECK(mf_gram_match_bytes(m, call, strlen(call)) == 0 && mf_gram_match_done(m), "the call fits: %s", mf_last_error());
    mf_gram_match_start(m, r.grammar);
    CHECK(mf_gram_match_bytes(m, "Let", 3) < 0, "required: no content before the call");
    mf_gram_match_start(m, r.grammar);
    const char *wrong = "\n\n<" MF_DSML "tool_calls>\n" MF_DSML_INVOKE "get_weather\">\n" MF_DSML_PARAM "days\" string=\"false\">x";
    CHECK(mf_gram_match_bytes(m, wrong, strlen(wrong)) < 0, "a value outside its schema");
    mf_gram_match_free(m);
    mf_gram_vocab_free(v);
    mf_serve_req_clear(&r);
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
    test_new_fields();
    test_tools();
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
    refused("{\"prompt\": \"x\", \"presence_penalty\": 3}", 0, "presence_penalty", "-2..2");
    refused("{\"prompt\": \"x\", \"echo\": 1}", 0, "echo", "true or false");
    refused("{\"prompt\": \"x\", \"suffix\": \"y\"}", 0, "suffix", "not supported");
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
