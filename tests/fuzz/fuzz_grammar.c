/* libFuzzer target: the grammar compiler and matcher (host/grammar*.c). The input is a JSON Schema,
 * a NUL byte, then bytes to feed. Besides not crashing, leaking or tripping a sanitizer: a schema is
 * compiled or refused with a message; then over a vocabulary of the 256 single bytes, some
 * multi-byte tokens and EOS, every state's mask is non-empty (no dead ends), a token is allowed
 * exactly when its mask bit is set, EOS exactly when the state is accepting, and what was accepted
 * up to an accepting state parses as JSON. test_grammar replays tests/fuzz/corpus_grammar. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "host/grammar.h"
#include "sched/error.h"

#define FG_REQUIRE(cond)                                                                         \
    do {                                                                                         \
        if (!(cond)) {                                                                           \
            fprintf(stderr, "fuzz_grammar: invariant failed: %s (%s:%d)\n", #cond, __FILE__,     \
                    __LINE__);                                                                   \
            abort();                                                                             \
        }                                                                                        \
    } while (0)

static const char *const fg_multi[] = {"{\"", "\":", "\": ", ", \"", "\"}", "true", "false", "null", "12",
                                       "-0.5e+3", "[]", "{}", "\"a\"", "ab", "\\u00e9", "\xc3\xa9", "\xe2\x82"};
#define FG_N_MULTI (int)(sizeof fg_multi / sizeof *fg_multi)
#define FG_EOS (256 + FG_N_MULTI)
#define FG_V (FG_EOS + 1)

static mf_gram_vocab *fg_vocab(void)
{
    static mf_gram_vocab *v;
    if (v) return v;
    static char bytes[256];
    const char *t[FG_V];
    size_t l[FG_V];
    for (int i = 0; i < 256; i++) bytes[i] = (char)i, t[i] = bytes + i, l[i] = 1;
    for (int i = 0; i < FG_N_MULTI; i++) t[256 + i] = fg_multi[i], l[256 + i] = strlen(fg_multi[i]);
    t[FG_EOS] = NULL, l[FG_EOS] = 0;
    if (mf_gram_vocab_from(t, l, FG_V, FG_EOS, &v)) abort();
    return v;
}

/* The bytes of token t of fg_vocab. */
static size_t fg_tok(int t, const char **s)
{
    static char b[1];
    if (t < 256) {
        b[0] = (char)t;
        *s = b;
        return 1;
    }
    *s = fg_multi[t - 256];
    return strlen(*s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *z = memchr(data, 0, size);
    size_t n_schema = z ? (size_t)(z - data) : size;
    mf_gram *g = NULL;
    int rc = mf_gram_from_schema((const char *)data, n_schema, &g);
    if (rc) {
        FG_REQUIRE(rc < 0 && !g && mf_last_error()[0]);
        return 0;
    }
    FG_REQUIRE(g);
    mf_gram_match *m = NULL;
    FG_REQUIRE(mf_gram_match_new(fg_vocab(), &m) == 0 && mf_gram_match_start(m, g) == 0);
    static uint32_t bits[(FG_V + 31) / 32];
    char out[8192];
    size_t n_out = 0;
    const uint8_t *in = z ? z + 1 : data + size;
    for (; in < data + size && n_out + 16 < sizeof out; in++) {
        int64_t k = mf_gram_match_mask(m, bits);
        FG_REQUIRE(k >= 1);   /* never a dead end */
        int acc = mf_gram_match_accepting(m);
        FG_REQUIRE(acc == (int)(bits[FG_EOS >> 5] >> (FG_EOS & 31) & 1));
        FG_REQUIRE(mf_gram_match_allows(m, FG_EOS) == acc);
        if (acc) {
            json_error_t je;
            json_t *j = json_loadb(out, n_out, JSON_DECODE_ANY, &je);
            FG_REQUIRE(j);
            json_decref(j);
        }
        if (mf_gram_match_done(m)) {
            FG_REQUIRE(k == 1 && acc);
            break;
        }
        /* the input byte picks a token: < 0xF0 the byte itself, else a multi-byte one */
        int t = *in < 0xF0 ? *in : 256 + (*in - 0xF0) % FG_N_MULTI;
        int allowed = (int)(bits[t >> 5] >> (t & 31) & 1);
        FG_REQUIRE(mf_gram_match_allows(m, t) == allowed);
        if (!allowed) {
            FG_REQUIRE(mf_gram_match_accept(m, t) < 0);
            continue;
        }
        FG_REQUIRE(mf_gram_match_accept(m, t) == 0);
        const char *s;
        size_t l = fg_tok(t, &s);
        memcpy(out + n_out, s, l);
        n_out += l;
    }
    mf_gram_match_free(m);
    mf_gram_free(g);
    return 0;
}
