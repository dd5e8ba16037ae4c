/* The Engram token map of DeepSeek-V4.1: every vocabulary id is sent to the id of its normalized
 * string in a compressed vocabulary, as the Engram reference's CompressedTokenizer builds it
 * (NFKC, NFD, strip marks, lowercase, collapse " \t\r\n" runs, strip; ids by first appearance).
 * The n-gram hashes of the Engram layers are computed over these compressed ids. */
#ifndef MF_ENGRAM_MAP_H
#define MF_ENGRAM_MAP_H

#include <stddef.h>
#include <stdint.h>

#include "host/tokenizer.h"

typedef struct mf_engram_map mf_engram_map;

/* Builds the map for ids 0 .. mf_tok_n_vocab(tok)-1. The key of id t is, as in the reference:
 *   text = decode([t]) with special tokens kept (lossy UTF-8);
 *   text contains U+FFFD (a byte token or an incomplete UTF-8 piece) -> the token's stored string
 *     (byte-level alphabet, e.g. "Ã©" style), not normalized;
 *   else mf_engram_normalize(text), or text itself when that is empty.
 * An id no token has (a hole in the vocabulary) has text "" and so key "". Keys share one space;
 * compressed ids are given in order of first appearance by id. Returns 0, -ENOMEM, or an error
 * from decoding. */
int mf_engram_map_build(const mf_tok *tok, mf_engram_map **out);
void mf_engram_map_free(mf_engram_map *m);

int mf_engram_map_n_vocab(const mf_engram_map *m);    /* ids mapped */
int mf_engram_map_n_unique(const mf_engram_map *m);   /* size of the compressed vocabulary */
/* compressed id of each vocabulary id (n_vocab entries) */
const int32_t *mf_engram_map_ids(const mf_engram_map *m);
/* the key of a compressed id and its length in *len (it may hold NUL bytes: the text of the byte
 * token 0x00 is U+0000), or NULL outside [0, n_unique) */
const char *mf_engram_map_key(const mf_engram_map *m, int32_t compressed_id, size_t *len);

/* The reference's normalizer, tokenizers' Sequence [NFKC, NFD, StripAccents, Lowercase,
 * Replace(/[ \t\r\n]+/, " "), Replace(/^ $/, U+E000), Strip, Replace(U+E000, " ")], done with
 * utf8proc: StripAccents removes General_Category M (Mn, Mc, Me); Lowercase is utf8proc_tolower,
 * per code point (Rust's char::to_lowercase; they differ only for U+0130, which NFD has already
 * split); Strip removes White_Space (Zs, Zl, Zp, U+0009-000D, U+0085) at both ends. So " " stays
 * " ", "  \n" becomes " ", " x " becomes "x". s must be valid UTF-8; *out is malloc'd and
 * NUL-terminated. Returns 0, -EILSEQ (invalid UTF-8), -ENOMEM. */
int mf_engram_normalize(const char *s, size_t n, char **out, size_t *out_n);

#endif
