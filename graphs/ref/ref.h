/* The plain reference forward of DeepSeek-V4.1 (the oracle every fast path is checked against):
 * plain loops, fp32 values with bf16 rounding where the Hugging Face port holds bf16, dot
 * products accumulated in double, no threads. Sequences keep their caches in mf_ref_state; one
 * call runs any batch of (sequence, token) items layer by layer and yields logits.
 * The layer math is graphs/layers/layers.h's, on a context of its own with the double-sum backend; this
 * is its serial driver. What it computes, step by step, is in docs/reference.md. */
#ifndef MF_REF_H
#define MF_REF_H

#include <stdint.h>

#include "graphs/layers/layers.h"   /* the options (mf_ref_opts), the tables, the sequence type */

typedef struct mf_ref mf_ref;               /* the model's tables (graphs/layers/layers.h) + one context */
typedef struct mf_ref_state mf_ref_state;   /* caches of one sequence */

int mf_ref_new(const mf_model *m, const mf_ref_opts *opts, mf_ref **out);
void mf_ref_free(mf_ref *r);
const mf_config *mf_ref_config(const mf_ref *r);   /* the model's */

/* A state for one sequence of at most max_positions tokens: a fixed part (the packed window ring of every
 * layer, the open compressor groups) allocated here, and what grows with the positions (the token
 * history, the packed compressed KV and index keys of every KV source, graphs/layers/layers.h) in
 * pages of MF_LY_PAGE_POSITIONS positions, added before a forward reaches them. -EINVAL when
 * max_positions exceeds the config's max_position_embeddings, -ENOMEM. */
int mf_ref_state_new(const mf_ref *r, int64_t max_positions, mf_ref_state **out);
void mf_ref_state_free(mf_ref_state *s);
/* Makes s a fresh sequence again (position 0), keeping its memory (pages included, for reuse): a
 * reset state gives the same logits as a new one (tests/test_batch.c). */
void mf_ref_state_reset(mf_ref_state *s);
/* Bytes a state holds once it has grown to n_positions positions (the fixed part, the token
 * history and the caches' pages for them, rounded up to whole pages): what a batcher budgets for a
 * sequence of that length. mf_ref_state_held_bytes: what s holds now (its reserved positions). */
int64_t mf_ref_state_bytes(const mf_config *c, int64_t n_positions);
int64_t mf_ref_state_held_bytes(const mf_ref_state *s);
/* Grows s to hold n_positions positions (no-op when it already does). The forwards call it (via
 * mf_ref_states_reserve, for the items of one call: consecutive items of a state) before they
 * touch a state; a caller may reserve ahead so that no forward allocates. -EINVAL past
 * max_positions; -ENOMEM with s as it was (no page of the failed call kept). */
int mf_ref_state_reserve(mf_ref_state *s, int64_t n_positions);
int mf_ref_states_reserve(mf_ref_state *const *states, int n);
/* Frees the pages s holds past max(n_positions, its position) (e.g. a reset state that held a
 * long sequence, before a short one reuses it). Never fails. */
void mf_ref_state_trim(mf_ref_state *s, int64_t n_positions);
int64_t mf_ref_state_pos(const mf_ref_state *s);   /* tokens consumed so far */

/* One forward over n items: item i is token tokens[i] of states[i] at that state's next position.
 * Items of the same state must be consecutive in this list and are consumed in order. When
 * logits[i] is non-NULL it receives vocab_size fp32 logits of item i. Fails (state unchanged)
 * with -EINVAL on a token out of the vocabulary or a state that would pass its max_positions, and
 * with -ENOMEM when a state cannot get the pages its new positions need. */
int mf_ref_forward(mf_ref *r, mf_ref_state *const *states, const int32_t *tokens, int n,
                   float *const *logits);

/* Prefill: n tokens of one sequence; logits (may be NULL) of the last one. */
int mf_ref_prefill(mf_ref *r, mf_ref_state *s, const int32_t *tokens, int n, float *logits);

/* Decode: one token for each of n_seq sequences; logits is n_seq x vocab_size (row i for
 * states[i]). */
int mf_ref_decode(mf_ref *r, mf_ref_state *const *states, const int32_t *tokens, int n_seq,
                  float *logits);

/* Wall time the forward spent per part, summed over calls since mf_ref_new (for benchmarks):
 * Engram sublayers, the attention stack (hyper-connection mixes, norms, attention), the MoE
 * sublayers (router, experts, shared expert), the final norm + head, and the whole calls. */
typedef struct mf_ref_times {
    int64_t engram_ns, attn_ns, moe_ns, head_ns, total_ns;
} mf_ref_times;
void mf_ref_times_get(const mf_ref *r, mf_ref_times *out);

/* The model's tables behind r (graphs/layers/layers.h), for the scheduled engine, which runs the same layer
 * math on contexts of its own and advances r's states. Valid while r lives. */
const mf_layers *mf_ref_layers(const mf_ref *r);

#endif
