/* Sampling the next token from logits: greedy (argmax, lowest id on ties), or seeded temperature
 * + top-p (nucleus) sampling with a splitmix64 generator, so a (seed, logits) sequence always gives
 * the same tokens. Scratch is allocated once per sampler. */
#ifndef MF_SAMPLE_H
#define MF_SAMPLE_H

#include <stdint.h>

typedef struct mf_sampler mf_sampler;

/* temperature <= 0 means greedy (top_p and seed unused); otherwise 0 < top_p <= 1.
 * -EINVAL on bad arguments (message names the value). */
int mf_sampler_new(int64_t n_vocab, double temperature, double top_p, uint64_t seed, mf_sampler **out);
void mf_sampler_free(mf_sampler *s);

/* Gives s new settings and a new seed, keeping its scratch (for a sampler reused by another
 * request). -EINVAL on bad values, or temperature > 0 on a sampler created greedy (no scratch). */
int mf_sampler_reset(mf_sampler *s, double temperature, double top_p, uint64_t seed);

/* The next token for logits[n_vocab]. */
int32_t mf_sampler_pick(mf_sampler *s, const float *logits);

/* Speculative decoding's acceptance of one position (graphs/step/spec.h): the next token given a
 * draft's candidate `cand` proposed deterministically (a greedy draft: a point mass at cand).
 * Greedy: the argmax, *accepted = (it is cand). Sampling: with probability p(cand), under the
 * distribution mf_sampler_pick draws from (tempered softmax, top-p prefix), cand itself
 * (*accepted 1); else a draw from p without cand, renormalized (the residual max(p - q, 0)), so the
 * token is distributed exactly as mf_sampler_pick's (the draws differ: one more per position).
 * cand outside the vocabulary: mf_sampler_pick, *accepted 0. */
int32_t mf_sampler_pick_cand(mf_sampler *s, const float *logits, int32_t cand, int *accepted);

/* Argmax with ties to the lowest index. */
int32_t mf_sample_greedy(const float *logits, int64_t n);

#endif
