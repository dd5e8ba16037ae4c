/* Sampling the next token from logits: greedy (argmax, lowest id on ties), or seeded temperature
 * + top-k / top-p (nucleus) / min-p sampling with a splitmix64 generator, so a (seed, logits)
 * sequence always gives the same tokens. Scratch is allocated once per sampler. Also the
 * log-probabilities a server reports (mf_logprobs). */
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

/* A sampler's settings. Sampling order: softmax of logits / temperature, then the top_k most
 * probable (ties: lower id first), then the smallest prefix of those whose mass reaches top_p,
 * then those with probability >= min_p x the most probable's; one uniform draw among the rest.
 * Logits of -inf (banned, masked) never win. */
typedef struct mf_sample_opts {
    double temperature;   /* <= 0: greedy (the rest unused) */
    double top_p;         /* (0, 1] (0: 1) */
    int top_k;            /* >= 0 (0: all) */
    double min_p;         /* [0, 1] (0: off) */
    uint64_t seed;
} mf_sample_opts;

/* Gives s the settings o (a new seed too), keeping its scratch. -EINVAL on bad values (message
 * names the value), or temperature > 0 on a sampler created greedy (no scratch). */
int mf_sampler_set(mf_sampler *s, const mf_sample_opts *o);

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

/* A token and its log-probability. */
typedef struct mf_logprob {
    int32_t id;
    float logprob;
} mf_logprob;

/* The log-softmax of logits[n] (max and sum of exp in double): *lp_tok (may be NULL) gets token
 * tok's log-probability, top[0..k) (k <= n) the k most probable tokens in order (ties: lower id
 * first). Returns the log of the partition function (log sum exp). No allocation. */
double mf_logprobs(const float *logits, int64_t n, int32_t tok, int k, float *lp_tok, mf_logprob *top);

#endif
