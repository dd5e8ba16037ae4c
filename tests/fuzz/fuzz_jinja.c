/* libFuzzer target: the chat template parser and renderer (host/jinja_*.c). The input is a template
 * source. Besides not crashing, leaking or tripping a sanitizer: a refused template's message
 * names a line and column; a parsed one renders over a fixed context (messages of every role,
 * bos/eos, add_generation_prompt) to NUL-terminated text, or fails with a message that names the
 * chat template. test_jinja replays the seed corpus (tests/fuzz/corpus_jinja) through this
 * function: valid_* must parse and render, invalid_* must be refused at parse. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "host/jinja.h"
#include "sched/error.h"

#define FUZZ_REQUIRE(cond)                                                                       \
    do {                                                                                         \
        if (!(cond)) {                                                                           \
            fprintf(stderr, "fuzz_jinja: invariant failed: %s (%s:%d)\n", #cond, __FILE__,       \
                    __LINE__);                                                                   \
            abort();                                                                             \
        }                                                                                        \
    } while (0)

/* 0 rendered, 1 refused at parse, 2 failed at render */
static int fuzz_jinja_one(const uint8_t *data, size_t size)
{
    mf_jinja *t = NULL;
    int rc = mf_jinja_parse((const char *)data, size, &t);
    if (rc) {
        FUZZ_REQUIRE((rc == -EINVAL || rc == -E2BIG || rc == -ENOMEM) && t == NULL);
        FUZZ_REQUIRE(rc != -EINVAL || (strstr(mf_last_error(), "line ") && strstr(mf_last_error(), "column ")));
        return 1;
    }
    json_t *ctx = json_pack("{s:[{s:s,s:s},{s:s,s:s},{s:s,s:n},{s:s,s:[{s:s,s:s}]},{s:s,s:s}],s:b,s:s,s:s}",
                            "messages", "role", "system", "content", "S", "role", "user", "content", " hi ",
                            "role", "assistant", "content", "role", "user", "content", "type", "text", "text", "t",
                            "role", "tool", "content", "42", "add_generation_prompt", 1, "bos_token", "<s>",
                            "eos_token", "</s>");
    FUZZ_REQUIRE(ctx);
    char *out = NULL;
    size_t n = 0;
    rc = mf_jinja_render(t, ctx, &out, &n);
    if (rc) {
        FUZZ_REQUIRE(out == NULL && (rc == -EINVAL || rc == -E2BIG || rc == -ENOMEM));
        FUZZ_REQUIRE(rc == -ENOMEM || strstr(mf_last_error(), "chat template"));
    } else {
        FUZZ_REQUIRE(out && out[n] == 0);
    }
    free(out);
    json_decref(ctx);
    mf_jinja_free(t);
    return rc ? 2 : 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_jinja_one(data, size);
    return 0;
}
