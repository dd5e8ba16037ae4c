/* Hugging Face tokenizer.json, byte-level BPE (GPT-2, DeepSeek-V3/V4 style): added and special
 * tokens split out first, an optional Unicode normalizer, the pre-tokenizer (Sequence of Split
 * regexes run through PCRE2 with UTF+UCP, ByteLevel), BPE merges by rank, ByteLevel decoding.
 * Encoding and decoding match the `tokenizers` Python package (tests/conformance/tokenizer). */
#ifndef MF_TOKENIZER_H
#define MF_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

typedef struct mf_tok mf_tok;

/* mf_tok_decode flag: leave out added tokens marked "special" (tokenizers' default). */
#define MF_TOK_SKIP_SPECIAL 1

/* Reads and validates `path` (a tokenizer.json). Supported: model.type "BPE" (vocab, merges as
 * "a b" strings or ["a","b"] pairs, ignore_merges, unk_token; byte_fallback, dropout,
 * continuing_subword_prefix and end_of_word_suffix must be unset), added_tokens (content, id,
 * special, lstrip, rstrip, single_word, normalized), normalizer null / NFC / NFD / NFKC / NFKD /
 * Sequence of those, pre_tokenizer null / Split / ByteLevel / Sequence of those, decoder null /
 * ByteLevel. Anything else fails with -EINVAL and a message naming the file and field. */
int mf_tok_load(const char *path, mf_tok **out);
void mf_tok_free(mf_tok *tok);

/* One more than the largest id of the model vocabulary and the added tokens. */
int mf_tok_n_vocab(const mf_tok *tok);

/* Encodes `len` bytes of UTF-8 `text` as tokenizers' encode(text, add_special_tokens=False) does:
 * added tokens found in the text become their ids, the rest is normalized, pre-tokenized and
 * BPE-merged. Writes min(total, cap) ids to `ids` and the total to *n_ids; returns 0, -ENOSPC
 * when cap < total (call again with *n_ids), -EILSEQ for invalid UTF-8 (byte offset named),
 * -ENOMEM. Thread-safe on a shared tokenizer. */
int mf_tok_encode(const mf_tok *tok, const char *text, size_t len, int32_t *ids, size_t cap,
                  size_t *n_ids);

/* Decodes ids to UTF-8 text as tokenizers' decode does: added tokens by content (left out with
 * MF_TOK_SKIP_SPECIAL when special), the ByteLevel decoder maps each token's characters back to
 * bytes (a token with a character outside the byte alphabet is kept as its UTF-8), and the bytes
 * are made valid UTF-8 by replacing each maximal ill-formed subsequence with U+FFFD. Writes
 * min(total, cap) bytes plus a NUL when room is left and the total (without NUL) to *n_bytes;
 * returns 0, -ENOSPC when cap < total + 1, -EINVAL for an id outside [0, n_vocab) or one no
 * token has, -ENOMEM. */
int mf_tok_decode(const mf_tok *tok, const int32_t *ids, size_t n, int flags, char *out,
                  size_t cap, size_t *n_bytes);

/* The raw bytes one token stands for (the ByteLevel decoding of its string; an added token's
 * content as it is), with no UTF-8 repair and no allocation: for streaming output, where a
 * character may span tokens. Writes min(total, cap) bytes, returns the total, or -EINVAL for an
 * id no token has. */
int mf_tok_token_bytes(const mf_tok *tok, int32_t id, char *out, size_t cap);

/* Copies s[0..n) to out with each maximal ill-formed UTF-8 subpart replaced by U+FFFD (the rule
 * mf_tok_decode uses); out must hold 3 * n bytes. Returns the bytes written. */
size_t mf_utf8_lossy(const char *s, size_t n, char *out);

/* The token string of `id` as stored in tokenizer.json (byte-level alphabet, e.g. "Ġthe"; an
 * added token's content), or NULL when no token has that id. */
const char *mf_tok_piece(const mf_tok *tok, int32_t id);

/* The id of the token whose stored string is `piece` (added tokens first, then the model
 * vocabulary), or -ENOENT. Used to find special tokens such as "<｜begin▁of▁sentence｜>". */
int32_t mf_tok_find(const mf_tok *tok, const char *piece);

/* 1 when `id` is an added token marked special, else 0. */
int mf_tok_is_special(const mf_tok *tok, int32_t id);

#endif
