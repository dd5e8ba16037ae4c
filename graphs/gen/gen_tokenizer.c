/* The synthetic tokenizer.json behind gen_tokenizer.h, built as JSON with jansson: special tokens
 * at the config's bos/eos/pad ids, the 256 byte-level tokens, then merges (prefix, last letter)
 * that grow words one letter at a time, all words of a length before any longer one, so every
 * merge's prefix is already a token. */
#include "graphs/gen/gen_tokenizer.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "sched/error.h"

static const char mf_letters[] = "etaoinshrdlcumwfgypbvkjxqz";   /* English frequency order */
#define MF_N_LETTERS 26
#define MF_SPACE_MARK "\xc4\xa0"                                  /* U+0120 'Ġ', the byte 0x20 */

/* GPT-2's byte-to-character map: printable bytes stand for themselves, the others for U+0100 + n. */
static void mf_byte_char(int b, char out[4])
{
    int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    int cp = b;
    if (!printable) {
        int n = 0;
        for (int x = 0; x < b; x++)
            if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF))) n++;
        cp = 256 + n;
    }
    if (cp < 0x80) {
        out[0] = (char)cp;
        out[1] = '\0';
    } else {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        out[2] = '\0';
    }
}

/* Next id not taken by a special token. */
static int mf_next_id(const mf_config *c, int id)
{
    while (id == c->bos_token_id || id == c->eos_token_id || id == c->pad_token_id) id++;
    return id;
}

static int mf_add_special(json_t *added, int id, const char *content)
{
    json_t *t = json_pack("{s:i, s:s, s:b, s:b, s:b, s:b, s:b}", "id", id, "content", content,
                          "single_word", 0, "lstrip", 0, "rstrip", 0, "normalized", 0, "special", 1);
    return t ? json_array_append_new(added, t) : -1;
}

int mf_gen_tokenizer_write(const mf_config *c, const char *path)
{
    int n_special = 2 + (c->pad_token_id >= 0);
    if (c->vocab_size < 256 + n_special + 1)
        return mf_error(-EINVAL, "%s: vocab_size %lld is too small for a byte-level tokenizer (need >= %d)",
                        path, (long long)c->vocab_size, 256 + n_special + 1);
    json_t *root = json_object(), *vocab = json_object(), *merges = json_array(), *added = json_array();
    int rc = 0;
    if (!root || !vocab || !merges || !added) {
        rc = mf_error(-ENOMEM, "%s: out of memory", path);
        goto out;
    }
    if (mf_add_special(added, c->bos_token_id, "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>") ||
        mf_add_special(added, c->eos_token_id, "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>") ||
        (c->pad_token_id >= 0 && mf_add_special(added, c->pad_token_id, "<\xef\xbd\x9c\xe2\x96\x81pad\xe2\x96\x81\xef\xbd\x9c>"))) {
        rc = mf_error(-ENOMEM, "%s: out of memory", path);
        goto out;
    }
    /* The special tokens are in the model vocabulary too, as in DeepSeek's own tokenizer.json. */
    json_t *a;
    size_t ai;
    json_array_foreach(added, ai, a)
        json_object_set(vocab, json_string_value(json_object_get(a, "content")), json_object_get(a, "id"));
    int id = 0;
    for (int b = 0; b < 256; b++) {
        char ch[4];
        mf_byte_char(b, ch);
        id = mf_next_id(c, id);
        json_object_set_new(vocab, ch, json_integer(id++));
    }
    /* Words of length L over the letters, with and without the space mark, by increasing L. */
    char word[64], prefix[64], last[2] = {0, 0};
    int digits[16];
    for (int len = 2; len < 16; len++) {
        for (int with_space = 1; with_space >= 0; with_space--) {
            int n_letters = with_space ? len - 1 : len;
            memset(digits, 0, sizeof digits);
            for (;;) {
                id = mf_next_id(c, id);
                if (id >= c->vocab_size) goto done;
                size_t w = 0;
                if (with_space) {
                    memcpy(word, MF_SPACE_MARK, 2);
                    w = 2;
                }
                for (int k = 0; k < n_letters; k++) word[w++] = mf_letters[digits[k]];
                word[w] = '\0';
                memcpy(prefix, word, w - 1);
                prefix[w - 1] = '\0';
                last[0] = word[w - 1];
                char merge[130];
                snprintf(merge, sizeof merge, "%s %s", prefix, last);
                json_object_set_new(vocab, word, json_integer(id++));
                json_array_append_new(merges, json_string(merge));
                int k = n_letters - 1;   /* odometer over the letters, last letter fastest */
                while (k >= 0 && ++digits[k] == MF_N_LETTERS) digits[k--] = 0;
                if (k < 0) break;
            }
        }
    }
done:;
    json_t *model = json_pack("{s:s, s:n, s:n, s:n, s:n, s:b, s:b, s:b, s:o, s:o}", "type", "BPE",
                              "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
                              "fuse_unk", 0, "byte_fallback", 0, "ignore_merges", 0, "vocab", vocab,
                              "merges", merges);
    vocab = merges = NULL;   /* owned by model now */
    json_t *byte_level = json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 0,
                                   "trim_offsets", 1, "use_regex", 1);
    json_t *decoder = json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 0,
                                "trim_offsets", 1, "use_regex", 1);
    if (!model || !byte_level || !decoder ||
        json_object_set_new(root, "version", json_string("1.0")) ||
        json_object_set_new(root, "truncation", json_null()) ||
        json_object_set_new(root, "padding", json_null()) ||
        json_object_set(root, "added_tokens", added) ||
        json_object_set_new(root, "normalizer", json_null()) ||
        json_object_set_new(root, "pre_tokenizer", byte_level) ||
        json_object_set_new(root, "post_processor", json_null()) ||
        json_object_set_new(root, "decoder", decoder) || json_object_set_new(root, "model", model)) {
        rc = mf_error(-ENOMEM, "%s: out of memory", path);
        goto out;
    }
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (json_dump_file(root, tmp, JSON_INDENT(1) | JSON_PRESERVE_ORDER) != 0) {
        rc = mf_error(-EIO, "%s: cannot write: %s", tmp, strerror(errno));
        remove(tmp);
    } else if (rename(tmp, path) != 0) {
        rc = mf_error(-errno, "%s: cannot rename into place: %s", path, strerror(errno));
        remove(tmp);
    }
out:
    json_decref(vocab);
    json_decref(merges);
    json_decref(added);
    json_decref(root);
    return rc;
}
