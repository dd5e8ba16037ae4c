/* libFuzzer target: `moeflow serve`'s request parser (tools/serve_req.c) and its check of request
 * heads (tools/serve_head.c). The first byte picks: bit 1 set, the rest is a request head for
 * mf_http_head_check; else the endpoint (bit 0: chat), the rest the body. Besides not crashing,
 * leaking or tripping a sanitizer, every accepted request must be what the parser promises (a
 * prompt or messages, values in range, the chat template renders), every refusal must carry a
 * message, and a head is complete, refused with one of its statuses, or incomplete below the
 * limit; an accepted head checks the same when cut at its end. test_serve_req replays the seed
 * corpus (tests/fuzz/corpus_serve) through this function. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <errno.h>

#include "host/grammar.h"
#include "tools/serve_head.h"
#include "tools/serve_req.h"
#include "tools/serve_tools.h"

#define FUZZ_REQUIRE(cond)                                                                       \
    do {                                                                                         \
        if (!(cond)) {                                                                           \
            fprintf(stderr, "fuzz_serve_req: invariant failed: %s (%s:%d)\n", #cond, __FILE__,   \
                    __LINE__);                                                                   \
            abort();                                                                             \
        }                                                                                        \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A head: mf_http_head_check's promises. */
static void fuzz_head(const char *p, size_t n)
{
    mf_http_head h;
    int rc = mf_http_head_check(p, n, &h);
    FUZZ_REQUIRE(rc == 0 || rc == 1);
    if (rc == 0) {
        FUZZ_REQUIRE(n < MF_HTTP_MAX_HEAD && h.status == 0);
        return;
    }
    if (h.status) {
        FUZZ_REQUIRE(h.code && h.code[0] && h.message[0]);
        FUZZ_REQUIRE(h.status == 400 || h.status == 411 || h.status == 413 || h.status == 414 || h.status == 431 ||
                     h.status == 501 || h.status == 505);
        return;
    }
    FUZZ_REQUIRE(h.len > 0 && h.len <= n && h.len <= MF_HTTP_MAX_HEAD && p[h.len - 1] == '\n');
    FUZZ_REQUIRE(h.minor == 0 || h.minor == 1);
    mf_http_head h2;
    FUZZ_REQUIRE(mf_http_head_check(p, h.len, &h2) == 1 && h2.status == 0 && h2.len == h.len &&
                 h2.content_length == h.content_length);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    if (data[0] & 2) {
        fuzz_head((const char *)data + 1, size - 1);
        return 0;
    }
    int chat = data[0] & 1;
    mf_serve_req r;
    mf_serve_err e;
    int rc = mf_serve_req_parse((const char *)data + 1, size - 1, chat, &r, &e);
    if (rc) {
        FUZZ_REQUIRE(rc < 0 && e.message[0]);
        FUZZ_REQUIRE(r.prompt == NULL && r.ids == NULL && r.msgs == NULL && r.n_stop == 0);
        return 0;
    }
    FUZZ_REQUIRE(r.chat == chat);
    if (chat) {
        FUZZ_REQUIRE(r.n_msgs >= 1 && r.msgs);
        for (int i = 0; i < r.n_msgs; i++) FUZZ_REQUIRE(r.msgs[i].role && r.msgs[i].content);
        int tools = r.n_tools > 0;
        for (int i = 0; i < r.n_msgs; i++) tools |= r.msgs[i].tool_calls || !strcmp(r.msgs[i].role, "tool");
        char *t = NULL;
        size_t n = 0;
        int bos_in_text = -1;
        if (tools) {   /* the built-in format has no tools: refused with a message */
            FUZZ_REQUIRE(mf_serve_chat_render(&r, NULL, &t, &n, &bos_in_text) == -EINVAL && !t);
        } else {
            FUZZ_REQUIRE(mf_serve_chat_render(&r, NULL, &t, &n, &bos_in_text) == 0 && t && strlen(t) <= n && bos_in_text == 0);
        }
        free(t);
        FUZZ_REQUIRE((r.n_tools > 0) == (r.tools != NULL) && r.n_tools <= MF_SERVE_MAX_TOOLS);
        for (int i = 0; i < r.n_tools; i++) FUZZ_REQUIRE(mf_serve_tool_name_ok(r.tool_names[i]) && r.tool_params[i]);
        FUZZ_REQUIRE((r.tool_choice == MF_TOOLS_NAMED) == (r.tool_name != NULL));
        FUZZ_REQUIRE((r.tool_choice == MF_TOOLS_REQUIRED || r.tool_choice == MF_TOOLS_NAMED) ? r.grammar != NULL : 1);
    } else {
        FUZZ_REQUIRE(r.prompt || (r.ids && r.n_ids >= 1 && r.n_ids <= MF_SERVE_MAX_IDS));
        for (int i = 0; r.ids && i < r.n_ids; i++) FUZZ_REQUIRE(r.ids[i] >= 0);
    }
    FUZZ_REQUIRE(r.max_tokens >= -1);
    FUZZ_REQUIRE(r.temperature >= 0 && r.temperature <= 2 && r.top_p > 0 && r.top_p <= 1);
    FUZZ_REQUIRE(r.n_stop >= 0 && r.n_stop <= MF_SERVE_MAX_STOP);
    for (int i = 0; i < r.n_stop; i++) FUZZ_REQUIRE(r.stop[i] && r.stop[i][0]);
    FUZZ_REQUIRE(r.stream == 0 || r.stream == 1);
    FUZZ_REQUIRE((r.logprobs == 0 || r.logprobs == 1) && r.top_logprobs >= 0 && r.top_logprobs <= MF_SERVE_MAX_LOGPROBS);
    FUZZ_REQUIRE(r.presence_penalty >= -2 && r.presence_penalty <= 2 && r.frequency_penalty >= -2 && r.frequency_penalty <= 2);
    FUZZ_REQUIRE(r.repetition_penalty > 0 && r.repetition_penalty <= 2 && r.min_p >= 0 && r.min_p <= 1 && r.top_k >= 0);
    FUZZ_REQUIRE(r.n_bias >= 0 && r.n_bias <= 1024 && (r.n_bias == 0 || r.bias));
    for (int i = 0; i < r.n_bias; i++) FUZZ_REQUIRE(r.bias[i].id >= 0 && r.bias[i].bias >= -100 && r.bias[i].bias <= 100);
    FUZZ_REQUIRE(r.json_mode ? r.grammar != NULL : 1);
    mf_serve_req_clear(&r);
    return 0;
}
