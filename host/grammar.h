/* Constrained decoding: a grammar over bytes (literals, sequences, choices, keyed switches, loops,
 * text up to a terminator, and JSON values: strings, numbers, objects with known keys, arrays, any
 * value), compiled from a JSON Schema subset or built node by node, and a matcher that walks it
 * over a tokenizer's byte-level vocabulary: which tokens keep the output a prefix of the grammar's
 * language (a bit mask per step), and the state after a token. Written for `moeflow serve`'s
 * response_format and tool calls (docs/serve.md "JSON output"): Debian has no grammar library for
 * C, and PyPI's (llguidance, xgrammar, outlines-core) are Python extensions. No model here. */
#ifndef MF_GRAMMAR_H
#define MF_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>

typedef struct mf_tok mf_tok;
typedef struct mf_gram mf_gram;               /* a compiled grammar: immutable, shareable */
typedef struct mf_gram_b mf_gram_b;           /* a grammar being built */
typedef struct mf_gram_vocab mf_gram_vocab;   /* a tokenizer's vocabulary as a byte trie */
typedef struct mf_gram_match mf_gram_match;   /* a matcher: a state and its scratch */

/* Limits: a schema nests at most MF_GRAM_MAX_DEPTH levels, a grammar has at most MF_GRAM_MAX_NODES
 * nodes and MF_GRAM_MAX_BYTES bytes of literals, an object schema at most MF_GRAM_MAX_PROPS
 * properties, an enum at most MF_GRAM_MAX_KEYS values; a matcher's stack holds MF_GRAM_MAX_STACK
 * frames (any JSON value nests at most that deep, minus the frames around it). */
#define MF_GRAM_MAX_DEPTH 32
#define MF_GRAM_MAX_NODES 8192
#define MF_GRAM_MAX_BYTES (1 << 20)
#define MF_GRAM_MAX_PROPS 64
#define MF_GRAM_MAX_KEYS 4096
#define MF_GRAM_MAX_STACK 96

/* ---- building ----------------------------------------------------------------------------------
 * Every function returns a node id (>= 0) or a negative code (-EINVAL with mf_last_error(), -E2BIG
 * past a limit, -ENOMEM); a negative id given to another function is passed through, so a
 * builder can be written without checks and the error read at mf_gram_b_finish. No node matches
 * the empty string. */
int mf_gram_b_new(mf_gram_b **out);
void mf_gram_b_free(mf_gram_b *b);
int mf_gram_lit(mf_gram_b *b, const char *s, size_t n);            /* exactly s[0..n), n >= 1 */
int mf_gram_seq(mf_gram_b *b, const int *ids, int n);              /* ids in order, n >= 1 */
/* one of ids, chosen by the first byte: their first bytes must be disjoint */
int mf_gram_choice(mf_gram_b *b, const int *ids, int n);
/* one of the keys (byte strings, n >= 1, distinct), then conts[i] after key i (-1: nothing; conts
 * NULL: none). A key that is a prefix of another is allowed only without continuations (the
 * longer wins while the next byte extends it, as a JSON number enum needs). */
int mf_gram_switch(mf_gram_b *b, const char *const *keys, const size_t *lens, const int *conts, int n);
/* body zero or more times, then exit; chosen by the first byte (disjoint) */
int mf_gram_loop(mf_gram_b *b, int body, int exit);
/* any valid UTF-8 text, ended by (and including) the first occurrence of term[0..n) */
int mf_gram_until(mf_gram_b *b, const char *term, size_t n);
/* a JSON value valid under schema[0..n) (JSON text; the subset of docs/serve.md: type, properties,
 * required, additionalProperties, items, minItems, maxItems, enum, const; title, description,
 * $schema, $id, $comment, default, examples ignored). Anything else is -EINVAL, with
 * mf_last_error() naming the keyword and where ("unsupported keyword 'pattern' at
 * /properties/name"); -E2BIG past the limits. Objects: keys in any order, each at most once, the
 * required ones before '}'; additionalProperties absent means false when properties are given,
 * true (any value) without properties. Output is compact JSON with at most one space after ':'
 * and ','. */
int mf_gram_json_schema(mf_gram_b *b, const char *schema, size_t n);
int mf_gram_json_any(mf_gram_b *b);          /* any JSON value */
int mf_gram_json_object(mf_gram_b *b);       /* any JSON object */
/* Checks the grammar rooted at `root` (choices' and loops' first bytes disjoint) and freezes it
 * into *out; b is freed either way. The root's completion allows EOS and nothing else. */
int mf_gram_b_finish(mf_gram_b *b, int root, mf_gram **out);
void mf_gram_free(mf_gram *g);

/* A JSON Schema into a grammar of one JSON value (mf_gram_json_schema + finish). */
int mf_gram_from_schema(const char *schema, size_t n, mf_gram **out);

/* ---- matching ------------------------------------------------------------------------------- */

/* The vocabulary of tok (ids 0..n_vocab-1) as a trie of their bytes (mf_tok_token_bytes); tokens
 * marked special and ids no token has never match; eos_id is allowed exactly when a grammar is
 * complete. -ENOMEM, -EINVAL. */
int mf_gram_vocab_new(const mf_tok *tok, int64_t n_vocab, int32_t eos_id, mf_gram_vocab **out);
/* A vocabulary from explicit token byte strings (tests and fuzzers; NULL toks[i]: no token). */
int mf_gram_vocab_from(const char *const *toks, const size_t *lens, int64_t n_vocab, int32_t eos_id,
                       mf_gram_vocab **out);
void mf_gram_vocab_free(mf_gram_vocab *v);
int64_t mf_gram_vocab_size(const mf_gram_vocab *v);

/* A matcher over v with scratch for its masks (a cache of the last masks by state); allocates
 * once, then nothing per token. */
int mf_gram_match_new(const mf_gram_vocab *v, mf_gram_match **out);
void mf_gram_match_free(mf_gram_match *m);
/* Starts matching g (which must outlive the matcher's use of it) from its beginning. */
int mf_gram_match_start(mf_gram_match *m, const mf_gram *g);
/* 1 when token t may come next (EOS: the grammar is complete here), else 0. */
int mf_gram_match_allows(mf_gram_match *m, int32_t t);
/* bits[t / 32] bit t % 32 set for every token that may come next; returns how many (0: none, the
 * grammar cannot go on: only after a token the matcher refused). */
int64_t mf_gram_match_mask(mf_gram_match *m, uint32_t *bits);
/* Advances over token t: 0, or -EINVAL when it may not come next (the state is kept). */
int mf_gram_match_accept(mf_gram_match *m, int32_t t);
/* Advances over bytes s[0..n) (not tokens): 0 or -EINVAL (state kept). */
int mf_gram_match_bytes(mf_gram_match *m, const char *s, size_t n);
/* 1 when nothing but EOS may follow (the grammar is complete and cannot go on). */
int mf_gram_match_done(const mf_gram_match *m);
/* 1 when EOS may follow (complete, though it may go on, e.g. after a number). */
int mf_gram_match_accepting(const mf_gram_match *m);
/* Masks computed and served from the cache since mf_gram_match_new. */
void mf_gram_match_counts(const mf_gram_match *m, int64_t *computed, int64_t *cached);

#endif
