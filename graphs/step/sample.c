/* Greedy and seeded temperature/top-k/top-p/min-p sampling (see graphs/step/sample.h): softmax in
 * double over the tempered logits, candidates sorted by probability (ties: lower id first), the
 * top_k first, the smallest prefix whose mass reaches top_p, those above min_p x the best kept, one
 * uniform draw from splitmix64; and the log-softmax a server reports. */
#include "graphs/step/sample.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>

#include "sched/error.h"

typedef struct mf_cand {
    double p;
    int32_t id;
} mf_cand;

struct mf_sampler {
    int64_t n;
    double temperature, top_p, min_p;
    int top_k;
    uint64_t rng;
    mf_cand *cand;
};

int mf_sampler_new(int64_t n_vocab, double temperature, double top_p, uint64_t seed, mf_sampler **out)
{
    *out = NULL;
    if (n_vocab < 1 || n_vocab > INT32_MAX)
        return mf_error(-EINVAL, "sampler: vocabulary of %lld entries", (long long)n_vocab);
    if (!(temperature <= 0) && !(top_p > 0 && top_p <= 1))
        return mf_error(-EINVAL, "sampler: top_p must be in (0, 1], found %g", top_p);
    if (isnan(temperature)) return mf_error(-EINVAL, "sampler: temperature is NaN");
    mf_sampler *s = calloc(1, sizeof *s);
    if (!s) return mf_error(-ENOMEM, "sampler: out of memory");
    s->n = n_vocab;
    s->temperature = temperature;
    s->top_p = top_p;
    s->rng = seed;
    if (temperature > 0 && !(s->cand = malloc((size_t)n_vocab * sizeof *s->cand))) {
        free(s);
        return mf_error(-ENOMEM, "sampler: out of memory for %lld candidates", (long long)n_vocab);
    }
    *out = s;
    return 0;
}

int mf_sampler_set(mf_sampler *s, const mf_sample_opts *o)
{
    double top_p = o->top_p ? o->top_p : 1.0;
    if (!(o->temperature <= 0) && !(top_p > 0 && top_p <= 1))
        return mf_error(-EINVAL, "sampler: top_p must be in (0, 1], found %g", o->top_p);
    if (isnan(o->temperature)) return mf_error(-EINVAL, "sampler: temperature is NaN");
    if (o->top_k < 0) return mf_error(-EINVAL, "sampler: top_k must be >= 0, found %d", o->top_k);
    if (!(o->min_p >= 0 && o->min_p <= 1)) return mf_error(-EINVAL, "sampler: min_p must be in [0, 1], found %g", o->min_p);
    if (o->temperature > 0 && !s->cand)
        return mf_error(-EINVAL, "sampler: created greedy, so it has no scratch for temperature %g", o->temperature);
    s->temperature = o->temperature;
    s->top_p = top_p;
    s->top_k = o->top_k;
    s->min_p = o->min_p;
    s->rng = o->seed;
    return 0;
}

int mf_sampler_reset(mf_sampler *s, double temperature, double top_p, uint64_t seed)
{
    return mf_sampler_set(s, &(mf_sample_opts){.temperature = temperature, .top_p = top_p, .seed = seed});
}

void mf_sampler_free(mf_sampler *s)
{
    if (!s) return;
    free(s->cand);
    free(s);
}

int32_t mf_sample_greedy(const float *logits, int64_t n)
{
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = i;
    return (int32_t)best;
}

static uint64_t mf_splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static int mf_cand_cmp(const void *a, const void *b)
{
    const mf_cand *x = a, *y = b;
    if (x->p > y->p) return -1;
    if (x->p < y->p) return 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* The distribution the sampler draws from (top_k, top_p, min_p): s->cand[0..k) sorted (ties: lower id), weights p (the
 * tempered softmax's, unnormalized), the smallest prefix reaching top_p of the mass; *keep its mass. */
static int64_t mf_sampler_dist(mf_sampler *s, const float *logits, double *keep)
{
    double mx = -INFINITY;
    for (int64_t i = 0; i < s->n; i++) mx = logits[i] > mx ? logits[i] : mx;
    double sum = 0;
    for (int64_t i = 0; i < s->n; i++) {
        s->cand[i].p = exp(((double)logits[i] - mx) / s->temperature);
        s->cand[i].id = (int32_t)i;
        sum += s->cand[i].p;
    }
    qsort(s->cand, (size_t)s->n, sizeof *s->cand, mf_cand_cmp);
    int64_t lim = s->n;
    while (lim > 1 && s->cand[lim - 1].p == 0) lim--;   /* -inf logits (banned, masked) never win */
    if (s->top_k > 0 && s->top_k < lim) {
        lim = s->top_k;
        sum = 0;
        for (int64_t i = 0; i < lim; i++) sum += s->cand[i].p;
    }
    double kept = 0;
    int64_t k = 0;
    while (k < lim && (k == 0 || kept < s->top_p * sum)) kept += s->cand[k++].p;
    if (s->min_p > 0)
        while (k > 1 && s->cand[k - 1].p < s->min_p * s->cand[0].p) kept -= s->cand[--k].p;
    *keep = kept;
    return k;
}

/* A draw over cand[0..k) of mass `mass`, skipping id `skip` (-1: none). */
static int32_t mf_sampler_draw(mf_sampler *s, int64_t k, double mass, int32_t skip)
{
    double u = (double)(mf_splitmix64(&s->rng) >> 11) * 0x1p-53 * mass, acc = 0;
    int32_t last = -1;
    for (int64_t i = 0; i < k; i++) {
        if (s->cand[i].id == skip) continue;
        acc += s->cand[i].p;
        last = s->cand[i].id;
        if (u < acc) return last;
    }
    return last;
}

int32_t mf_sampler_pick(mf_sampler *s, const float *logits)
{
    if (s->temperature <= 0) return mf_sample_greedy(logits, s->n);
    double keep;
    int64_t k = mf_sampler_dist(s, logits, &keep);
    return mf_sampler_draw(s, k, keep, -1);
}

int32_t mf_sampler_pick_cand(mf_sampler *s, const float *logits, int32_t cand, int *accepted)
{
    *accepted = 0;
    if (s->temperature <= 0) {
        int32_t t = mf_sample_greedy(logits, s->n);
        *accepted = t == cand;
        return t;
    }
    if (cand < 0 || cand >= s->n) return mf_sampler_pick(s, logits);
    double keep, pc = 0;
    int64_t k = mf_sampler_dist(s, logits, &keep);
    for (int64_t i = 0; i < k; i++)
        if (s->cand[i].id == cand) pc = s->cand[i].p;
    if (pc > 0 && (double)(mf_splitmix64(&s->rng) >> 11) * 0x1p-53 * keep < pc) {
        *accepted = 1;
        return cand;
    }
    /* rejected: the residual max(p - q, 0) of a point mass q at cand is p without cand */
    if (k == 1 && pc > 0) return cand;   /* nothing else has mass (not reached: then pc = keep) */
    return mf_sampler_draw(s, k, keep - pc, pc > 0 ? cand : -1);
}

/* Whether (la, ia) ranks before (lb, ib): higher logit first, then lower id. */
static int mf_lp_before(float la, int32_t ia, float lb, int32_t ib) { return la > lb || (la == lb && ia < ib); }

double mf_logprobs(const float *logits, int64_t n, int32_t tok, int k, float *lp_tok, mf_logprob *top)
{
    double mx = -INFINITY;
    for (int64_t i = 0; i < n; i++) mx = logits[i] > mx ? logits[i] : mx;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += exp((double)logits[i] - mx);
    double lse = mx + log(sum);
    if (lp_tok) *lp_tok = (float)((double)logits[tok] - lse);
    if (k > n) k = (int)n;
    int m = 0;   /* top[0..m) sorted; insertion of the few that beat the last */
    for (int64_t i = 0; i < n && k > 0; i++) {
        float l = logits[i];
        if (m == k && !mf_lp_before(l, (int32_t)i, top[m - 1].logprob, top[m - 1].id)) continue;
        int j = m < k ? m++ : m - 1;
        while (j > 0 && mf_lp_before(l, (int32_t)i, top[j - 1].logprob, top[j - 1].id)) {
            top[j] = top[j - 1];
            j--;
        }
        top[j] = (mf_logprob){(int32_t)i, l};
    }
    for (int j = 0; j < m; j++) top[j].logprob = (float)((double)top[j].logprob - lse);
    return lse;
}
