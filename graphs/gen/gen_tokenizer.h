/* A tokenizer.json for synthetic checkpoints: byte-level BPE (GPT-2 byte alphabet and regex) whose
 * vocabulary is exactly the config's, so `moeflow decode --prompt` works on generated models and
 * every id a random model samples decodes to text. The merges build lowercase words (with and
 * without a leading space) in English letter-frequency order; deterministic, no randomness. */
#ifndef MF_GEN_TOKENIZER_H
#define MF_GEN_TOKENIZER_H

#include "graphs/model/config.h"

/* Writes the tokenizer for config `c` to `path` (bos/eos/pad ids of the config become the
 * DeepSeek special tokens). Needs vocab_size >= 259 + 3; 0 or a negative code with a message. */
int mf_gen_tokenizer_write(const mf_config *c, const char *path);

#endif
