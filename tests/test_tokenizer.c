/* host/tokenizer and graphs/engram_map on a hand-made tokenizer.json: a 256-byte alphabet, a few
 * merges, special and added tokens, the DeepSeek-V3 pre-tokenizer; hand-worked encodings (merge
 * order, digits split 1-3, whitespace runs, emoji bytes, added-token stripping), round trips,
 * lossy decoding, the Engram normalizer and map, and every malformed-input error. The exact
 * agreement with the `tokenizers` package is checked by tests/conformance/tokenizer. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "graphs/model/engram_map.h"
#include "host/tokenizer.h"
#include "sched/error.h"

static char g_dir[512];

/* GPT-2 byte -> character, written independently of the library. */
static void byte_char(int b, char *out)
{
    int n = 0, cp = -1;
    for (int x = 0; x < 256; x++) {
        int keep = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174);
        int c = keep ? x : 256 + n++;
        if (x == b) cp = c;
    }
    if (cp < 0x80) {
        out[0] = (char)cp;
        out[1] = 0;
    } else {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        out[2] = 0;
    }
}

enum { ID_GT = 256, ID_HE, ID_GTHE, ID_12, ID_123, ID_GG, ID_GGGG, ID_HELLO1, ID_HELLO2,
       ID_EOT = 300, ID_BOS, ID_X, ID_THINK };

/* The test tokenizer as a JSON object; callers may edit it before writing. */
static json_t *make_tokenizer(void)
{
    json_t *vocab = json_object();
    char c[4];
    for (int b = 0; b < 256; b++) {
        byte_char(b, c);
        json_object_set_new(vocab, c, json_integer(b));
    }
    static const struct { const char *tok; int id; } extra[] = {
        {"Ġt", ID_GT}, {"he", ID_HE}, {"Ġthe", ID_GTHE}, {"12", ID_12}, {"123", ID_123},
        {"ĠĠ", ID_GG}, {"ĠĠĠĠ", ID_GGGG}, {"hel", ID_HELLO1}, {"hell", ID_HELLO2}};
    for (size_t i = 0; i < sizeof extra / sizeof *extra; i++)
        json_object_set_new(vocab, extra[i].tok, json_integer(extra[i].id));
    /* ranks: "Ġ t" 0, "h e" 1, "Ġt he" 2, "1 2" 3, "12 3" 4, "Ġ Ġ" 5, "ĠĠ ĠĠ" 6, "he l" 7,
     * "hel l" 8; mixed string and pair forms */
    json_t *merges = json_pack("[s, [s,s], s, [s,s], s, s, [s,s], s, s]", "Ġ t", "h", "e", "Ġt he",
                               "1", "2", "12 3", "Ġ Ġ", "ĠĠ", "ĠĠ", "he l", "hel l");
    json_t *added = json_pack(
        "[{s:i,s:s,s:b,s:b,s:b,s:b,s:b}, {s:i,s:s,s:b}, {s:i,s:s,s:b,s:b,s:b,s:b},"
        " {s:i,s:s,s:b,s:b}]",
        "id", ID_EOT, "content", "<|EOT|>", "special", 1, "lstrip", 0, "rstrip", 0,
        "single_word", 0, "normalized", 0,
        "id", ID_BOS, "content", "<｜begin▁of▁sentence｜>", "special", 1,
        "id", ID_X, "content", "<x>", "special", 0, "lstrip", 1, "rstrip", 1, "normalized", 0,
        "id", ID_THINK, "content", "<think>", "special", 0, "normalized", 0);
    json_t *split = json_pack(
        "[{s:s,s:{s:s},s:s,s:b}, {s:s,s:{s:s},s:s,s:b}, {s:s,s:{s:s},s:s,s:b},"
        " {s:s,s:b,s:b,s:b}]",
        "type", "Split", "pattern", "Regex", "\\p{N}{1,3}", "behavior", "Isolated", "invert", 0,
        "type", "Split", "pattern", "Regex", "[一-龥\u3040-ゟ゠-ヿ]+", "behavior", "Isolated",
        "invert", 0,
        "type", "Split", "pattern", "Regex",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?"
        "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
        "behavior", "Isolated", "invert", 0,
        "type", "ByteLevel", "add_prefix_space", 0, "trim_offsets", 0, "use_regex", 0);
    return json_pack("{s:s, s:n, s:n, s:o, s:n, s:{s:s,s:o}, s:n, s:{s:s,s:b},"
                     " s:{s:s,s:n,s:n,s:n,s:n,s:b,s:b,s:b,s:o,s:o}}",
                     "version", "1.0", "truncation", "padding", "added_tokens", added,
                     "normalizer", "pre_tokenizer", "type", "Sequence", "pretokenizers", split,
                     "post_processor", "decoder", "type", "ByteLevel", "add_prefix_space", 1,
                     "model", "type", "BPE", "dropout", "unk_token",
                     "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", 0,
                     "byte_fallback", 0, "ignore_merges", 0, "vocab", vocab, "merges", merges);
}

static const char *write_json(const char *name, json_t *j)
{
    static char path[640];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    if (json_dump_file(j, path, JSON_INDENT(1))) fprintf(stderr, "cannot write %s\n", path);
    json_decref(j);
    return path;
}

static const char *write_text(const char *name, const char *text)
{
    static char path[640];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    FILE *f = fopen(path, "w");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
    return path;
}

/* Encodes `text` and compares with the expected ids (terminated by -1). */
static void check_encode(mf_tok *tok, const char *text, const int32_t *want)
{
    int32_t ids[256];
    size_t n = 0, nw = 0;
    while (want[nw] >= 0) nw++;
    int rc = mf_tok_encode(tok, text, strlen(text), ids, 256, &n);
    int same = rc == 0 && n == nw && memcmp(ids, want, n * sizeof *ids) == 0;
    CHECK(same, "encode(\"%s\"): rc %d (%s), %zu ids (want %zu): %d %d %d %d ...", text, rc,
          mf_last_error(), n, nw, n > 0 ? ids[0] : -1, n > 1 ? ids[1] : -1, n > 2 ? ids[2] : -1,
          n > 3 ? ids[3] : -1);
}

static void check_roundtrip(mf_tok *tok, const char *text)
{
    int32_t ids[4096];
    size_t n = 0, nb = 0;
    char out[8192];
    int rc = mf_tok_encode(tok, text, strlen(text), ids, 4096, &n);
    CHECK(rc == 0, "encode(\"%s\"): %s", text, mf_last_error());
    rc = mf_tok_decode(tok, ids, n, 0, out, sizeof out, &nb);
    CHECK(rc == 0 && nb == strlen(text) && memcmp(out, text, nb) == 0,
          "decode(encode(\"%s\")) gave \"%.*s\" (rc %d)", text, (int)nb, out, rc);
}

static void check_load_error(const char *name, json_t *j, int want_rc, const char *want1,
                             const char *want2)
{
    const char *path = write_json(name, j);
    mf_tok *tok = NULL;
    int rc = mf_tok_load(path, &tok);
    const char *msg = mf_last_error();
    CHECK(rc == want_rc && tok == NULL, "%s: rc %d (want %d), message: %s", name, rc, want_rc, msg);
    CHECK(strstr(msg, path) && strstr(msg, want1) && (!want2 || strstr(msg, want2)),
          "%s: message should name the file, '%s'%s%s: %s", name, want1, want2 ? " and " : "",
          want2 ? want2 : "", msg);
    mf_tok_free(tok);
}

static void test_encode(mf_tok *tok)
{
    CHECK(mf_tok_n_vocab(tok) == ID_THINK + 1, "n_vocab %d", mf_tok_n_vocab(tok));
    /* " the": Ġ t h e -> (rank 0) Ġt h e -> (rank 1) Ġt he -> (rank 2) Ġthe */
    check_encode(tok, " the", (const int32_t[]){ID_GTHE, -1});
    /* "the" has no Ġ: t he */
    check_encode(tok, "the", (const int32_t[]){'t', ID_HE, -1});
    /* leftmost first among equal ranks: "hehe" -> he he */
    check_encode(tok, "hehe", (const int32_t[]){ID_HE, ID_HE, -1});
    /* rank order beats position: "hell" -> h e l l -> he l l -> hel l -> hell */
    check_encode(tok, "hell", (const int32_t[]){ID_HELLO2, -1});
    /* digits split into runs of at most 3: 123|45 -> 123, 4, 5 */
    check_encode(tok, "12345", (const int32_t[]){ID_123, '4', '5', -1});
    check_encode(tok, "1231", (const int32_t[]){ID_123, '1', -1});
    /* whitespace run: "a", "   " (\s+(?!\S) leaves one space), " b"; ĠĠ Ġ, then Ġ b */
    check_encode(tok, "a    b", (const int32_t[]){'a', ID_GG, ' ', ' ', 'b', -1});
    /* eight spaces at the end: ĠĠ ĠĠ ĠĠ ĠĠ -> ĠĠĠĠ ĠĠĠĠ */
    check_encode(tok, "x        ", (const int32_t[]){'x', ID_GGGG, ID_GGGG, -1});
    /* an emoji is its four UTF-8 bytes */
    check_encode(tok, "\xF0\x9F\x98\x80", (const int32_t[]){0xF0, 0x9F, 0x98, 0x80, -1});
    /* special tokens are cut out before pre-tokenization */
    check_encode(tok, "<|EOT|> the<｜begin▁of▁sentence｜>",
                 (const int32_t[]){ID_EOT, ID_GTHE, ID_BOS, -1});
    /* lstrip/rstrip swallow the spaces around <x>; <think> keeps them */
    check_encode(tok, "a  <x>  b", (const int32_t[]){'a', ID_X, 'b', -1});
    check_encode(tok, "a <think> b", (const int32_t[]){'a', ' ', ID_THINK, ' ', 'b', -1});
    /* an unfinished special token is plain text */
    check_encode(tok, "<|EOT|", (const int32_t[]){'<', '|', 'E', 'O', 'T', '|', -1});
    check_encode(tok, "", (const int32_t[]){-1});

    const char *texts[] = {"Hello, world!  \t\n\n  tabs\tand\r\nnewlines", "naïve café 東京タワー",
                           "x = [1, 22, 333, 4444, 55555];", "👨‍👩‍👧‍👦 🇫🇷 ❤️", "   ", "\n",
                           "a<|EOT|>b<think>c", "¿Qué? ｆｕｌｌ\u3000width ①"};
    for (size_t i = 0; i < sizeof texts / sizeof *texts; i++) check_roundtrip(tok, texts[i]);

    /* a long word: the heap merge stays linear-ish (and correct) */
    static char big[200001];
    memset(big, 'e', sizeof big - 1);
    for (size_t i = 0; i < sizeof big - 1; i += 2) big[i] = 'h';
    int32_t *ids = malloc(200000 * sizeof *ids);
    size_t n = 0;
    int rc = mf_tok_encode(tok, big, sizeof big - 1, ids, 200000, &n);
    int all_he = rc == 0 && n == 100000;
    for (size_t i = 0; all_he && i < n; i++) all_he = ids[i] == ID_HE;
    CHECK(all_he, "200000-byte word: rc %d, %zu ids", rc, n);
    free(ids);

    /* invalid inputs */
    int32_t few[2];
    rc = mf_tok_encode(tok, "abc\xC3(", 5, few, 2, &n);
    CHECK(rc == -EILSEQ && strstr(mf_last_error(), "byte 3"), "invalid UTF-8: rc %d, %s", rc,
          mf_last_error());
    rc = mf_tok_encode(tok, "\xED\xA0\x80", 3, few, 2, &n);   /* a surrogate */
    CHECK(rc == -EILSEQ, "surrogate: rc %d", rc);
    rc = mf_tok_encode(tok, "abcd", 4, few, 2, &n);
    CHECK(rc == -ENOSPC && n == 4 && few[0] == 'a' && few[1] == 'b', "ENOSPC: rc %d n %zu", rc, n);
}

static void test_decode(mf_tok *tok)
{
    char out[256];
    size_t nb;
    int32_t ids[] = {ID_BOS, ID_GTHE, ID_EOT, ' ', 0xF0, 0x9F, 0x98, 0x80};
    int rc = mf_tok_decode(tok, ids, 8, 0, out, sizeof out, &nb);
    const char *want = "<｜begin▁of▁sentence｜> the<|EOT|> \xF0\x9F\x98\x80";
    CHECK(rc == 0 && nb == strlen(want) && strcmp(out, want) == 0, "decode: %d '%s'", rc, out);
    rc = mf_tok_decode(tok, ids, 8, MF_TOK_SKIP_SPECIAL, out, sizeof out, &nb);
    CHECK(rc == 0 && strcmp(out, " the \xF0\x9F\x98\x80") == 0, "decode skip: %d '%s'", rc, out);
    /* ill-formed bytes: F0 9F then 'a' -> one U+FFFD for the maximal subpart; lone 80 -> one;
     * C0 -> one (never valid); E0 80 -> two (E0 needs A0..BF) */
    int32_t bad[] = {0xF0, 0x9F, 'a', 0x80, 0xC0, 0xE0, 0x80, 0xE2, 0x82};
    rc = mf_tok_decode(tok, bad, 9, 0, out, sizeof out, &nb);
    CHECK(rc == 0 && strcmp(out, "\xEF\xBF\xBD" "a" "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"
                                 "\xEF\xBF\xBD\xEF\xBF\xBD") == 0,
          "lossy decode: %d '%s'", rc, out);
    int32_t oob[] = {'a', 5000};
    rc = mf_tok_decode(tok, oob, 2, 0, out, sizeof out, &nb);
    CHECK(rc == -EINVAL && strstr(mf_last_error(), "5000"), "bad id: %d %s", rc, mf_last_error());
    int32_t hole[] = {290};
    rc = mf_tok_decode(tok, hole, 1, 0, out, sizeof out, &nb);
    CHECK(rc == -EINVAL, "hole id: %d", rc);
    rc = mf_tok_decode(tok, ids, 2, 0, out, 5, &nb);
    CHECK(rc == -ENOSPC && nb == strlen("<｜begin▁of▁sentence｜> the"), "decode ENOSPC: %d %zu", rc, nb);

    char tb[64];
    CHECK(mf_tok_token_bytes(tok, ID_GTHE, tb, sizeof tb) == 4 && memcmp(tb, " the", 4) == 0,
          "token bytes of Ġthe");
    CHECK(mf_tok_token_bytes(tok, 0xC3, tb, sizeof tb) == 1 && (unsigned char)tb[0] == 0xC3,
          "token bytes of a byte token");
    CHECK(mf_tok_token_bytes(tok, ID_BOS, tb, 4) == (int)strlen("<｜begin▁of▁sentence｜>") &&
          memcmp(tb, "<\xEF\xBD\x9C", 4) == 0, "token bytes of a special token, truncated");
    CHECK(mf_tok_token_bytes(tok, 290, tb, sizeof tb) == -EINVAL, "token bytes of a hole");
    CHECK(mf_tok_find(tok, "<|EOT|>") == ID_EOT && mf_tok_find(tok, "Ġthe") == ID_GTHE &&
          mf_tok_find(tok, "nope") == -ENOENT, "find");
    CHECK(mf_tok_is_special(tok, ID_EOT) && !mf_tok_is_special(tok, ID_X) &&
          !mf_tok_is_special(tok, 'a') && !mf_tok_is_special(tok, -1), "is_special");
    CHECK(mf_tok_piece(tok, ID_GTHE) && strcmp(mf_tok_piece(tok, ID_GTHE), "Ġthe") == 0 &&
          mf_tok_piece(tok, 290) == NULL && mf_tok_piece(tok, 99999) == NULL, "piece");
}

static void check_norm(const char *in, size_t n, const char *want)
{
    char *out = NULL;
    size_t len = 0, wn = n == 1 && in[0] == 0 ? 1 : strlen(want);
    int rc = mf_engram_normalize(in, n, &out, &len);
    CHECK(rc == 0 && len == wn && memcmp(out, want, len) == 0,
          "normalize(\"%s\") = \"%s\" (want \"%s\")", in, out ? out : "(null)", want);
    free(out);
}

static void test_engram(mf_tok *tok)
{
    check_norm("Café", 5, "cafe");
    check_norm(" Hello ", 7, "hello");
    check_norm(" ", 1, " ");                       /* a lone space survives Strip */
    check_norm("  \n", 3, " ");
    check_norm("\t", 1, " ");
    check_norm("x \t\r\n y", 7, "x y");
    check_norm("ﬁ", strlen("ﬁ"), "fi");            /* NFKC */
    check_norm("ＡＢＣ１", strlen("ＡＢＣ１"), "abc1");
    check_norm("\u3000", 3, " ");                  /* NFKC makes it a space */
    check_norm("\x0b", 1, "");                     /* stripped, not collapsed */
    check_norm("Ελληνικά", strlen("Ελληνικά"), "ελληνικα");
    check_norm("e\xCC\x81", 3, "e");               /* combining acute removed */
    check_norm("\0", 1, "\0");

    mf_engram_map *m = NULL;
    int rc = mf_engram_map_build(tok, &m);
    CHECK(rc == 0, "engram map: %s", mf_last_error());
    if (rc) return;
    const int32_t *c = mf_engram_map_ids(m);
    int n = mf_engram_map_n_vocab(m), u = mf_engram_map_n_unique(m);
    CHECK(n == mf_tok_n_vocab(tok) && u > 0 && u < n, "sizes %d %d", n, u);
    CHECK(c[0] == 0, "id 0 is the first key");
    CHECK(c['A'] == c['a'] && c['E'] != c['a'], "A and a share a key");
    CHECK(c[' '] == c['\t'] && c[' '] == c['\n'] && c[' '] == c[ID_GG], "space, tab, newline");
    CHECK(c[ID_GT] == c['t'] && c['T'] == c['t'], "Ġt, t and T share a key");
    size_t klen;
    const char *k = mf_engram_map_key(m, c[0xC3], &klen);   /* byte C3 alone: U+FFFD */
    CHECK(k && klen == 2 && memcmp(k, "Ã", 2) == 0, "byte token key is its stored string");
    k = mf_engram_map_key(m, c[0], &klen);
    CHECK(k && klen == 1 && k[0] == 0, "byte 0 key is U+0000");
    k = mf_engram_map_key(m, c[0x0b], &klen);   /* normalizes to "", keeps its text */
    CHECK(k && klen == 1 && k[0] == 0x0b, "vertical tab key");
    k = mf_engram_map_key(m, c[ID_BOS], &klen);
    CHECK(k && strcmp(k, "<|begin▁of▁sentence|>") == 0, "special token key: %s", k ? k : "");
    CHECK(mf_engram_map_key(m, u, &klen) == NULL, "key out of range");
    /* first appearance order: every compressed id appears first at a larger id than the one before */
    int next = 0, ordered = 1;
    for (int i = 0; i < n; i++) {
        if (c[i] == next) next++;
        else if (c[i] > next) ordered = 0;
    }
    CHECK(ordered && next == u, "first-appearance numbering");
    mf_engram_map_free(m);
}

static void test_errors(void)
{
    mf_tok *tok = NULL;
    char missing[600];
    snprintf(missing, sizeof missing, "%s/missing.json", g_dir);
    CHECK(mf_tok_load(missing, &tok) == -ENOENT && strstr(mf_last_error(), missing), "missing: %s",
          mf_last_error());
    const char *p = write_text("syntax.json", "{\"model\": {\"vocab\": {\"a\": 0,}}");
    CHECK(mf_tok_load(p, &tok) == -EINVAL && strstr(mf_last_error(), p) &&
          strstr(mf_last_error(), "line"), "syntax: %s", mf_last_error());
    p = write_text("list.json", "[1, 2]");
    CHECK(mf_tok_load(p, &tok) == -EINVAL, "top-level list: %s", mf_last_error());

    json_t *j = make_tokenizer();
    json_object_set_new(json_object_get(j, "model"), "type", json_string("WordPiece"));
    check_load_error("type.json", j, -EINVAL, "model.type", "WordPiece");
    j = make_tokenizer();
    json_object_del(j, "model");
    check_load_error("nomodel.json", j, -EINVAL, "'model'", "missing");
    j = make_tokenizer();
    json_object_set_new(json_object_get(j, "model"), "vocab", json_array());
    check_load_error("vocab.json", j, -EINVAL, "model.vocab", "a list");
    j = make_tokenizer();
    json_object_set_new(json_object_get(json_object_get(j, "model"), "vocab"), "zz",
                        json_string("7"));
    check_load_error("vocabid.json", j, -EINVAL, "model.vocab", "zz");
    j = make_tokenizer();
    json_array_append_new(json_object_get(json_object_get(j, "model"), "merges"),
                          json_string("q z"));
    check_load_error("merge.json", j, -EINVAL, "model.merges[9]", "merged token");
    j = make_tokenizer();
    json_array_append_new(json_object_get(json_object_get(j, "model"), "merges"),
                          json_string("abc"));
    check_load_error("merge2.json", j, -EINVAL, "model.merges[9]", "one space");
    j = make_tokenizer();
    json_array_append_new(json_object_get(json_object_get(j, "model"), "merges"),
                          json_integer(3));
    check_load_error("merge3.json", j, -EINVAL, "model.merges[9]", "an integer");
    j = make_tokenizer();
    json_object_set_new(json_object_get(j, "model"), "byte_fallback", json_true());
    check_load_error("fallback.json", j, -EINVAL, "model.byte_fallback", NULL);
    j = make_tokenizer();
    json_object_set_new(j, "normalizer", json_pack("{s:s}", "type", "Lowercase"));
    check_load_error("norm.json", j, -EINVAL, "normalizer.type", "Lowercase");
    j = make_tokenizer();
    json_object_set_new(j, "pre_tokenizer", json_pack("{s:s}", "type", "Whitespace"));
    check_load_error("pretok.json", j, -EINVAL, "pre_tokenizer.type", "Whitespace");
    j = make_tokenizer();
    json_object_set_new(json_array_get(json_object_get(json_object_get(j, "pre_tokenizer"),
                                                       "pretokenizers"), 0),
                        "pattern", json_pack("{s:s}", "Regex", "([a-z"));
    check_load_error("regex.json", j, -EINVAL, "pre_tokenizer.pretokenizers[0].pattern.Regex",
                     "offset");
    j = make_tokenizer();
    json_object_set_new(json_array_get(json_object_get(json_object_get(j, "pre_tokenizer"),
                                                       "pretokenizers"), 1),
                        "behavior", json_string("Sideways"));
    check_load_error("behavior.json", j, -EINVAL, "pretokenizers[1].behavior", "Sideways");
    j = make_tokenizer();
    json_object_set_new(json_array_get(json_object_get(j, "added_tokens"), 1), "id",
                        json_string("301"));
    check_load_error("addedid.json", j, -EINVAL, "added_tokens[1].id", "a string");
    j = make_tokenizer();
    json_object_set_new(json_array_get(json_object_get(j, "added_tokens"), 0), "content",
                        json_string("Ġthe"));
    check_load_error("addedclash.json", j, -EINVAL, "added_tokens[0]", "vocabulary gives it");
    j = make_tokenizer();
    json_object_set_new(json_array_get(json_object_get(j, "added_tokens"), 0), "id",
                        json_integer(ID_BOS));
    check_load_error("addeddup.json", j, -EINVAL, "added_tokens", "both");
    j = make_tokenizer();
    json_object_set_new(json_array_get(json_object_get(j, "added_tokens"), 2), "lstrip",
                        json_string("yes"));
    check_load_error("addedbool.json", j, -EINVAL, "added_tokens[2].lstrip", "true or false");
    j = make_tokenizer();
    json_object_set_new(j, "decoder", json_pack("{s:s}", "type", "WordPiece"));
    check_load_error("decoder.json", j, -EINVAL, "decoder.type", "WordPiece");
    j = make_tokenizer();
    json_object_set_new(j, "truncation", json_pack("{s:i}", "max_length", 8));
    check_load_error("trunc.json", j, -EINVAL, "truncation", NULL);
    j = make_tokenizer();
    json_object_set_new(json_object_get(j, "model"), "unk_token", json_string("<unk>"));
    check_load_error("unk.json", j, -EINVAL, "model.unk_token", "<unk>");
}

int main(void)
{
    const char *tmp = getenv("MOEFLOW_TMP");
    snprintf(g_dir, sizeof g_dir, "%s/test_tokenizer_%d", tmp ? tmp : "/tmp", (int)getpid());
    char cmd[700];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", g_dir);
    if (system(cmd) != 0) return fprintf(stderr, "cannot make %s\n", g_dir), 1;

    mf_tok *tok = NULL;
    int rc = mf_tok_load(write_json("tokenizer.json", make_tokenizer()), &tok);
    CHECK(rc == 0, "load: %s", mf_last_error());
    if (rc == 0) {
        test_encode(tok);
        test_decode(tok);
        test_engram(tok);
        mf_tok_free(tok);
    }
    test_errors();

    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
    return mf_check_exit("test_tokenizer");
}
