/* `moeflow serve`'s request parser (tools/serve_req.c): defaults, every field's type and range,
 * the refusals' messages and params, the chat template; and the fuzz seed corpus
 * (tests/fuzz/corpus_serve) replayed through the fuzz target: valid_* parse, invalid_* are refused. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/check.h"
#include "tests/fuzz/fuzz_serve_req.c"

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

int main(void)
{
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
    CHECK(mf_serve_chat_render(&r, &t, &n) == 0 &&
          !strcmp(t, "S<\xef\xbd\x9cUser\xef\xbd\x9c>hi<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>yo<\xef\xbd\x9c" "end\xe2\x96\x81of"
                     "\xe2\x96\x81sentence\xef\xbd\x9c><\xef\xbd\x9cUser\xef\xbd\x9c>again<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>") &&
          n == strlen(t), "template: '%s'", t ? t : "");
    free(t);
    mf_serve_req_clear(&r);

    /* the fuzz corpus */
    const char *dir = MF_SOURCE_DIR "/tests/fuzz/corpus_serve";
    DIR *d = opendir(dir);
    CHECK(d != NULL, "cannot open %s", dir);
    int n_valid = 0, n_invalid = 0;
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
    CHECK(n_valid >= 3 && n_invalid >= 3, "corpus: %d valid, %d invalid", n_valid, n_invalid);
    return mf_check_exit("test_serve_req");
}
