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

/* Speculation's rollback (graphs/step/spec.h; docs/dspark.md "Rollback"). mf_ref_state_mark, before
 * a forward (either engine) of the sequence's next n positions (a verify: the anchor and n - 1
 * candidates; 1..sliding_window), records what they will overwrite: the window ring's slots they
 * write and the ratio-2 compressors' open groups, and, while they run, the groups they open (the
 * journal, allocated on the first call for max(n, dspark_block_size + 1) positions and kept;
 * -ENOMEM). mf_ref_state_rollback(s, keep), after those n ran, leaves s as if only the first keep
 * of them had (0..n): the ring's slots of the others given back, every compressed cache's entry
 * count (KV and index keys) and open group as of the last kept position, n_pos; the token history
 * (Engram's) past n_pos is overwritten before it is read again. Entries past the count keep
 * whatever the rejected positions wrote (nothing reads them). -EINVAL without a mark, or when the
 * state is not at the marked verify's end. A reset forgets the mark. */
int mf_ref_state_mark(mf_ref_state *s, int n);
int mf_ref_state_rollback(mf_ref_state *s, int keep);

/* Pages of the compressed caches are reference counted, so that a full page (immutable once every
 * entry is written: entries are only appended) can be held by the prefix cache and mapped into other
 * states without a copy (graphs/prefix/prefix.h). new: a page of `bytes` with one holder (NULL when
 * out of memory); hold / drop add and remove a holder (the last drop frees it); refs: the holders.
 * keep counts the holders that account the page's bytes (the prefix cache): it adds delta and
 * returns the new count; a state counts in mf_ref_state_held_bytes only its pages nobody keeps.
 * Thread-safe (atomic counts). A state's own page (one holder) is reused after a reset; a reset
 * gives its shared pages back. */
uint8_t *mf_ref_page_new(int64_t bytes);
void mf_ref_page_hold(uint8_t *pg);
void mf_ref_page_drop(uint8_t *pg);
int mf_ref_page_refs(const uint8_t *pg);
int64_t mf_ref_page_bytes(const uint8_t *pg);
int mf_ref_page_keep(uint8_t *pg, int delta);
/* Maps pages[0..n) (each gets a holder) as pages 0..n-1 of KV-source layer L of a reset state s (its
 * own pages move after them). What they hold is the caller's: entries below the count the caller
 * then sets. -EINVAL (not a KV source, not at position 0), -ENOMEM. */
int mf_ref_state_map(mf_ref_state *s, int L, uint8_t *const *pages, int64_t n);
/* Makes page p of layer L the state's own (a copy of a shared page, which is dropped) before the
 * state appends to it: copy on write of a partial page, into the last page the state kept (after
 * the mapped ones) when it has one, so restores do not grow a state. 0 (also when already its
 * own), -ENOMEM. */
int mf_ref_state_unshare(mf_ref_state *s, int L, int64_t p);

/* One forward over n items: item i is token tokens[i] of states[i] at that state's next position.
 * Items of the same state must be consecutive in this list and are consumed in order. When
 * logits[i] is non-NULL it receives vocab_size fp32 logits of item i. Fails (state unchanged)
 * with -EINVAL on a token out of the vocabulary or a state that would pass its max_positions, and
 * with -ENOMEM when a state cannot get the pages its new positions need. */
int mf_ref_forward(mf_ref *r, mf_ref_state *const *states, const int32_t *tokens, int n,
                   float *const *logits);

/* The same, also writing the DSpark draft's features of item i into feats[i] when feats and
 * feats[i] are non-NULL: n_dspark_target x hidden floats, the mean of the streams entering each
 * layer of dspark_target_layer_ids (mf_ly_draft_feature), what mf_ref_draft_feed takes. */
int mf_ref_forward_feat(mf_ref *r, mf_ref_state *const *states, const int32_t *tokens, int n,
                        float *const *logits, float *const *feats);

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

/* ---- the DSpark draft (graphs/ref/ref_dspark.c; docs/dspark.md) ------------------------------ */

/* The draft's reference driver: r's tables (its model loaded with mf_model_opts.load_draft) and a
 * context of its own on the double-sum backend. -EINVAL without the draft, -ENOMEM. */
typedef struct mf_ref_draft mf_ref_draft;
int mf_ref_draft_new(const mf_ref *r, mf_ref_draft **out);
void mf_ref_draft_free(mf_ref_draft *d);

/* A sequence's draft state (graphs/layers/layers.h mf_ly_draft_state): the stages' context rings,
 * mf_ly_draft_ring_bytes of them, no position fed. */
int mf_ref_draft_state_new(const mf_ref_draft *d, mf_ly_draft_state **out);
void mf_ref_draft_state_free(mf_ly_draft_state *s);

/* Feeds the target's features of the sequence's next n positions (n x n_dspark_target x hidden,
 * from mf_ref_forward_feat) into s. */
int mf_ref_draft_feed(mf_ref_draft *d, mf_ly_draft_state *s, const float *feats, int n);
/* Back to n_pos positions fed: positions at and after it are forgotten (a verify rejected them).
 * At most dspark_block_size back (-EINVAL otherwise: their slots may be overwritten), s unchanged
 * on error. */
int mf_ref_draft_rollback(mf_ly_draft_state *s, const mf_config *c, int64_t n_pos);

/* One round: the candidates after anchor token `anchor`, the token at position s->n_pos (the last
 * one the target produced, not yet run through it). Greedy: candidate i is the argmax (ties to the
 * lower id) of logits_i = head(normed_i) + markov(prev_i), prev_0 the anchor, prev_i candidate
 * i - 1, for i < n (1..dspark_block_size). confidence[i] is the confidence head's logit for
 * candidate i. logits (NULL, or n x vocab) and routes (NULL, or n_mtp_layers x dspark_block_size x
 * dspark_num_experts_per_tok) receive those. s is only read: a round proposes without changing the
 * sequence. */
int mf_ref_draft_propose(mf_ref_draft *d, const mf_ly_draft_state *s, int32_t anchor, int n, int32_t *tokens,
                         float *confidence, float *logits, int32_t *routes);

/* The model's tables behind r (graphs/layers/layers.h), for the scheduled engine, which runs the same layer
 * math on contexts of its own and advances r's states. Valid while r lives. */
const mf_layers *mf_ref_layers(const mf_ref *r);

#endif
