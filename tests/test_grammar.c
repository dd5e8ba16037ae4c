/* The grammar module (host/grammar.h): JSON Schema subset compiled and matched byte by byte (known
 * accepted and refused texts), refusals naming the keyword and place, limits; masks against the
 * matcher (a token is in the mask exactly when the matcher allows it) on a vocabulary of single
 * bytes and multi-byte tokens; seeded random walks over the masks that always end in JSON that
 * satisfies the schema (checked here with jansson); the builder's own nodes (switch, loop, until);
 * and the fuzz seed corpus (tests/fuzz/corpus_grammar) replayed through the fuzz target. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/path.h"
#include "tests/check.h"
#include "tests/fuzz/fuzz_grammar.c"

#ifndef MF_SOURCE_DIR
#error "MF_SOURCE_DIR must name the source tree (tests/CMakeLists.txt defines it)"
#endif

static mf_gram *compile(const char *schema)
{
    mf_gram *g = NULL;
    int rc = mf_gram_from_schema(schema, strlen(schema), &g);
    CHECK(rc == 0, "schema %s: %s", schema, mf_last_error());
    return g;
}

/* 1 when text is accepted up to an accepting state by the grammar of schema. */
static int accepts(const char *schema, const char *text)
{
    mf_gram *g = compile(schema);
    mf_gram_match *m = NULL;
    if (!g || mf_gram_match_new(fg_vocab(), &m)) return -1;
    mf_gram_match_start(m, g);
    int ok = mf_gram_match_bytes(m, text, strlen(text)) == 0 && mf_gram_match_accepting(m);
    mf_gram_match_free(m);
    mf_gram_free(g);
    return ok;
}

static void test_texts(void)
{
    const char *obj = "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"},"
                      "\"tags\":{\"type\":\"array\",\"items\":{\"enum\":[\"a\",\"b\",1,10]},\"maxItems\":3}},"
                      "\"required\":[\"name\"]}";
    static const char *const yes[] = {"{\"name\":\"x\"}", "{\"name\": \"x\", \"age\": -12}", "{\"age\":0,\"name\":\"\"}",
                                      "{\"name\":\"\\u00e9\\n\",\"tags\":[]}", "{\"name\":\"x\",\"tags\":[\"a\", 10, 1]}",
                                      "{\"name\":\"\xc3\xa9\"}"};
    static const char *const no[] = {"{}", "{\"age\":1}", "{\"name\":1}", "{\"name\":\"x\",\"name\":\"y\"}",
                                     "{\"name\":\"x\",\"other\":1}", "{\"name\":\"x\",\"age\":1.5}",
                                     "{\"name\":\"x\",\"tags\":[\"c\"]}", "{\"name\":\"x\",\"tags\":[1,1,1,1]}",
                                     "{\"name\":\"x\" }", "{\"name\":\"\\ud800\"}", "{\"name\":\"\xc3\"}",
                                     "{\"name\":\"\xed\xa0\x80\"}", "{\"name\":\"x\",\"age\":01}", "{\"name\":\"a\nb\"}"};
    for (size_t i = 0; i < sizeof yes / sizeof *yes; i++) CHECK(accepts(obj, yes[i]) == 1, "accepts %s", yes[i]);
    for (size_t i = 0; i < sizeof no / sizeof *no; i++) CHECK(accepts(obj, no[i]) == 0, "refuses %s", no[i]);
    CHECK(accepts("{\"type\":\"number\"}", "-0.25e+10") == 1, "a number");
    CHECK(accepts("{\"type\":\"number\"}", "1.") == 0, "1. is not a number");
    CHECK(accepts("{\"type\":[\"string\",\"null\"]}", "null") == 1, "a type list");
    CHECK(accepts("{\"enum\":[1,10,100]}", "10") == 1 && accepts("{\"enum\":[1,10,100]}", "1") == 1 &&
              accepts("{\"enum\":[1,10,100]}", "1000") == 0,
          "number enums whose values prefix each other");
    CHECK(accepts("{\"const\":{\"a\":[1,2]}}", "{\"a\":[1,2]}") == 1, "const as compact JSON");
    CHECK(accepts("{\"type\":\"object\"}", "{\"x\":{\"y\":[1,{\"z\":null}]},\"w\":\"v\"}") == 1, "any object");
    CHECK(accepts("{\"type\":\"object\",\"properties\":{\"a\":{}},\"additionalProperties\":{\"type\":\"integer\"}}",
                  "{\"b\":1,\"a\":\"s\"}") == 1, "additionalProperties as a schema");
    CHECK(accepts("{\"type\":\"object\",\"properties\":{\"a\":{}},\"additionalProperties\":{\"type\":\"integer\"}}",
                  "{\"b\":\"s\"}") == 0, "additionalProperties' schema holds");
    CHECK(accepts("{\"type\":\"array\",\"minItems\":2}", "[1]") == 0 && accepts("{\"type\":\"array\",\"minItems\":2}", "[1,[]]") == 1,
          "minItems");
    CHECK(accepts("{\"type\":\"object\",\"properties\":{\"a\\\"b\":{\"type\":\"boolean\"}},\"required\":[\"a\\\"b\"]}",
                  "{\"a\\\"b\":true}") == 1, "a property name with an escape");
}

static void refused(const char *schema, int code, const char *want)
{
    mf_gram *g = NULL;
    int rc = mf_gram_from_schema(schema, strlen(schema), &g);
    CHECK(rc == code && !g && strstr(mf_last_error(), want), "%s: rc %d (want %d), message '%s' (want '%s')", schema, rc,
          code, mf_last_error(), want);
}

static void test_refusals(void)
{
    refused("{\"type\":\"string\",\"pattern\":\"a+\"}", -EINVAL, "unsupported keyword 'pattern' at #");
    refused("{\"properties\":{\"x\":{\"type\":\"string\",\"minLength\":2}}}", -EINVAL,
            "unsupported keyword 'minLength' at #/properties/x");
    refused("{\"$defs\":{\"n\":{}},\"$ref\":\"#/$defs/n\"}", -EINVAL, "unsupported keyword '$");
    refused("{\"anyOf\":[{}]}", -EINVAL, "'anyOf'");
    refused("{\"type\":\"strin\"}", -EINVAL, "unknown type strin");
    refused("{\"required\":[\"a\"]}", -EINVAL, "names a, which is not in its properties");
    refused("false", -EINVAL, "false matches nothing");
    refused("{\"enum\":[]}", -EINVAL, "non-empty list");
    refused("{\"items\":[{}]}", -EINVAL, "tuples");
    refused("{\"type\":\"array\",\"minItems\":3,\"maxItems\":2}", -EINVAL, "'maxItems' 2 < 'minItems' 3");
    refused("{nope", -EINVAL, "not JSON");
    char deep[4096] = "";
    for (int i = 0; i < 40; i++) strcat(deep, "{\"items\":");
    strcat(deep, "{}");
    for (int i = 0; i < 40; i++) strcat(deep, "}");
    refused(deep, -E2BIG, "nested deeper than 32 levels");
    size_t cap = 1 << 20;
    char *big = malloc(cap);
    strcpy(big, "{\"properties\":{");
    for (int i = 0; i < 70; i++) sprintf(big + strlen(big), "%s\"p%d\":{}", i ? "," : "", i);
    strcat(big, "}}");
    refused(big, -E2BIG, "70 properties");
    strcpy(big, "{\"enum\":[");
    for (int i = 0; i < 5000; i++) sprintf(big + strlen(big), "%s%d", i ? "," : "", i);
    strcat(big, "]}");
    refused(big, -E2BIG, "5000 values");
    /* many nodes: a wide, nested schema */
    strcpy(big, "{\"properties\":{");
    for (int i = 0; i < 60; i++) {
        sprintf(big + strlen(big), "%s\"p%d\":{\"properties\":{", i ? "," : "", i);
        for (int j = 0; j < 60; j++) sprintf(big + strlen(big), "%s\"q%d\":{\"type\":[\"string\",\"integer\"]}", j ? "," : "", j);
        strcat(big, "}}");
    }
    strcat(big, "}}");
    refused(big, -E2BIG, "more than 8192 nodes");
    free(big);
}

/* Masks agree with allows() for every token, on a few states of a walk. */
static void test_masks(void)
{
    mf_gram *g = compile("{\"type\":\"object\",\"properties\":{\"ab\":{\"type\":\"boolean\"},\"a\":{\"type\":\"number\"}},"
                         "\"required\":[\"a\"]}");
    mf_gram_match *m = NULL;
    CHECK(g && mf_gram_match_new(fg_vocab(), &m) == 0, "matcher");
    if (!m) return;
    mf_gram_match_start(m, g);
    static const char *const steps[] = {"{\"", "a", "b", "\":", " ", "true", ", \"", "a", "\":", "-", "1", "2", "}"};
    static uint32_t bits[(FG_V + 31) / 32];
    for (size_t s = 0; s < sizeof steps / sizeof *steps; s++) {
        int64_t n = mf_gram_match_mask(m, bits), c = 0;
        for (int t = 0; t < FG_V; t++) {
            int in = (int)(bits[t >> 5] >> (t & 31) & 1);
            c += in;
            CHECK(in == mf_gram_match_allows(m, t), "step %zu token %d: mask %d, allows %d", s, t, in, !in);
        }
        CHECK(n == c && n >= 1, "step %zu: %lld allowed, %lld bits", s, (long long)n, (long long)c);
        CHECK(mf_gram_match_bytes(m, steps[s], strlen(steps[s])) == 0, "step %zu '%s' accepted", s, steps[s]);
    }
    CHECK(mf_gram_match_done(m) && mf_gram_match_allows(m, FG_EOS) && !mf_gram_match_allows(m, '}'), "complete");
    int64_t computed, cached;
    mf_gram_match_counts(m, &computed, &cached);
    CHECK(computed == (int64_t)(sizeof steps / sizeof *steps) && cached == 0, "%lld computed", (long long)computed);
    mf_gram_match_start(m, g);   /* the same states again: not cached (start clears) */
    mf_gram_match_mask(m, bits);
    mf_gram_match_mask(m, bits);
    mf_gram_match_counts(m, &computed, &cached);
    CHECK(cached == 1, "a second mask of one state comes from the cache");
    mf_gram_match_free(m);
    mf_gram_free(g);
}

static uint64_t rng(uint64_t *x)
{
    uint64_t z = (*x += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* Random walks over the masks: every completed text parses, and meets the schema's required keys and types. */
static void test_walks(void)
{
    const char *schema = "{\"type\":\"object\",\"properties\":{\"id\":{\"type\":\"integer\"},\"name\":{\"type\":\"string\"},"
                         "\"ok\":{\"type\":\"boolean\"},\"xs\":{\"type\":\"array\",\"items\":{\"type\":\"number\"},"
                         "\"minItems\":1,\"maxItems\":3},\"kind\":{\"enum\":[\"x\",\"y\",null]}},\"required\":[\"id\",\"xs\"]}";
    mf_gram *g = compile(schema);
    mf_gram_match *m = NULL;
    CHECK(g && mf_gram_match_new(fg_vocab(), &m) == 0, "matcher");
    if (!m) return;
    static uint32_t bits[(FG_V + 31) / 32];
    int completed = 0;
    uint64_t seed = 7;
    for (int w = 0; w < 200; w++) {
        mf_gram_match_start(m, g);
        char out[4096];
        size_t n = 0;
        int done = 0;
        for (int step = 0; step < 400 && n + 16 < sizeof out; step++) {
            int64_t k = mf_gram_match_mask(m, bits);
            CHECK(k >= 1, "walk %d step %d: a dead end", w, step);
            /* prefer structure: most of the time pick among multi-byte tokens and closers */
            int t, tries = 0;
            do {
                t = (int)(rng(&seed) % FG_V);
            } while (!(bits[t >> 5] >> (t & 31) & 1) && ++tries < 100000);
            if (!(bits[t >> 5] >> (t & 31) & 1)) break;
            if (t == FG_EOS) {
                done = 1;
                break;
            }
            CHECK(mf_gram_match_accept(m, t) == 0, "accept");
            const char *s;
            size_t l = fg_tok(t, &s);
            memcpy(out + n, s, l);
            n += l;
            if (mf_gram_match_done(m)) {
                done = 1;
                break;
            }
        }
        if (!done) continue;
        completed++;
        json_error_t je;
        json_t *j = json_loadb(out, n, 0, &je);
        CHECK(j && json_is_object(j), "walk %d: '%.*s' is not a JSON object: %s", w, (int)n, out, je.text);
        if (!j) continue;
        json_t *id = json_object_get(j, "id"), *xs = json_object_get(j, "xs"), *nm = json_object_get(j, "name"),
               *ok = json_object_get(j, "ok"), *kd = json_object_get(j, "kind");
        CHECK(json_is_integer(id) && json_is_array(xs) && json_array_size(xs) >= 1 && json_array_size(xs) <= 3,
              "walk %d: required keys and array bounds: %.*s", w, (int)n, out);
        CHECK((!nm || json_is_string(nm)) && (!ok || json_is_boolean(ok)) &&
                  (!kd || json_is_null(kd) || (json_is_string(kd) && strchr("xy", json_string_value(kd)[0]))),
              "walk %d: types: %.*s", w, (int)n, out);
        CHECK(json_object_size(j) <= 5, "walk %d: no other keys", w);
        json_decref(j);
    }
    CHECK(completed >= 20, "%d of 200 walks completed", completed);
    mf_gram_match_free(m);
    mf_gram_free(g);
}

/* The builder's own nodes: a tool-call-like shape of switches, a loop and text to a terminator. */
static void test_builder(void)
{
    mf_gram_b *b;
    CHECK(mf_gram_b_new(&b) == 0, "builder");
    const char *names[] = {"get\">", "get_all\">"};
    size_t nl[] = {5, 9};
    const char *os = "{\"type\":\"object\",\"properties\":{\"n\":{\"type\":\"integer\"}}}";
    int sch = mf_gram_json_schema(b, os, strlen(os));
    int args[] = {mf_gram_lit(b, "(", 1), mf_gram_until(b, "</p>", 4)};
    int conts[] = {mf_gram_seq(b, args, 2), sch};
    /* loops decide by the first byte: the shared '<' is read before the loop and after each call */
    int call = mf_gram_seq(b, (int[]){mf_gram_lit(b, "call name=\"", 11), mf_gram_switch(b, names, nl, conts, 2)}, 2);
    int root = mf_gram_seq(b, (int[]){mf_gram_lit(b, "<", 1), mf_gram_loop(b, mf_gram_seq(b, (int[]){call, mf_gram_lit(b, "\n<", 2)}, 2),
                                                                         mf_gram_lit(b, "/calls>", 7))}, 2);
    mf_gram *g = NULL;
    CHECK(mf_gram_b_finish(b, root, &g) == 0, "finish: %s", mf_last_error());
    mf_gram_match *m = NULL;
    CHECK(g && mf_gram_match_new(fg_vocab(), &m) == 0, "matcher");
    if (!m) return;
    const char *good = "<call name=\"get\">(a</b></p>\n<call name=\"get_all\">{\"n\":3}\n</calls>";
    mf_gram_match_start(m, g);
    CHECK(mf_gram_match_bytes(m, good, strlen(good)) == 0 && mf_gram_match_done(m), "a valid call list");
    mf_gram_match_start(m, g);
    CHECK(mf_gram_match_bytes(m, "<call name=\"got\">", 17) < 0, "an unknown name");
    mf_gram_match_start(m, g);
    CHECK(mf_gram_match_bytes(m, "<call name=\"get_all\">{\"n\":\"x\"}", 31) < 0, "a wrong argument type");
    mf_gram_match_free(m);
    mf_gram_free(g);
    /* choices must be decidable by their first byte */
    CHECK(mf_gram_b_new(&b) == 0, "builder");
    int c = mf_gram_choice(b, (int[]){mf_gram_lit(b, "ab", 2), mf_gram_lit(b, "ac", 2)}, 2);
    CHECK(mf_gram_b_finish(b, c, &g) == -EINVAL && strstr(mf_last_error(), "start with byte 0x61"), "%s", mf_last_error());
}

static void test_corpus(void)
{
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/tests/fuzz/corpus_grammar", MF_SOURCE_DIR);
    DIR *d = opendir(dir);
    CHECK(d != NULL, "corpus %s", dir);
    if (!d) return;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char p[8400];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        char *buf = NULL;
        size_t len = 0;
        if (mf_path_read(p, 1 << 20, &buf, &len)) continue;
        LLVMFuzzerTestOneInput((const uint8_t *)buf, len);
        free(buf);
        n++;
    }
    closedir(d);
    CHECK(n >= 5, "%d corpus files", n);
}

int main(void)
{
    test_texts();
    test_refusals();
    test_masks();
    test_walks();
    test_builder();
    test_corpus();
    return mf_check_exit("test_grammar");
}
