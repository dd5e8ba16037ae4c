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

/* Argmax with ties to the lowest index. */
int32_t mf_sample_greedy(const float *logits, int64_t n);

#endif
