/* Speculative decoding with the checkpoint's DSpark draft (issue 31; docs/dspark.md "Speculation").
 * Per sequence and round: the policy picks k (0 = a plain step) by the cost model; a draft round
 * proposes k candidates after the sequence's pending token (the engine's or the reference's draft,
 * or injected ones); the target runs the anchor and the candidates as one multi-token forward (the
 * engine's unit of one sequence's consecutive items, bit for bit the same as token by token);
 * greedy keeps the longest prefix the target's argmax agrees with plus the target's own next token
 * (the bonus); sampling accepts a candidate with the target's probability of it and otherwise draws
 * from the target's distribution without it (graphs/step/sample.h mf_sampler_pick_cand), so every
 * token has the target's distribution; what the rejected positions wrote is given back
 * (graphs/ref/ref.h mf_ref_state_rollback). The draft only ever sees kept positions: each step's
 * forward hands out its items' features, the kept ones wait in the sequence's feature rows and the
 * next draft round feeds them first, so nothing of the draft is rolled back.
 *
 * The batcher (graphs/step/batch.h mf_batch_opts.spec) drives it: per step mf_spec_plan for its
 * decode sequences, the verify items with mf_spec_rows, the forward, mf_spec_accept per sequence.
 * One thread at a time (the batcher's stepping thread). */
#ifndef MF_SPEC_H
#define MF_SPEC_H

#include <stdint.h>

#include "graphs/ref/ref.h"
#include "graphs/sim/plan.h"
#include "graphs/step/sample.h"
#include "graphs/step/step.h"

#define MF_SPEC_MAX 16   /* candidates per round at most (dspark_block_size: 5 in the release) */

/* Where the candidates come from: the checkpoint's draft (the engine's mf_step_draft with an
 * engine, else the reference's mf_ref_draft_propose), or a caller's function (tests, the perfect
 * draft's upper bound of the benchmarks). */
typedef enum mf_spec_source { MF_SPEC_DSPARK = 1, MF_SPEC_INJECT } mf_spec_source;

/* Injected candidates: up to n tokens after `anchor` at position pos of the sequence whose request
 * carries req_user (mf_batch_req.user) into cands; returns how many (0..n; fewer: a shorter round). */
typedef int (*mf_spec_inject_fn)(void *user, void *req_user, int64_t pos, int32_t anchor, int n, int32_t *cands);

typedef struct mf_spec_opts {
    mf_ref *ref;       /* the target's forward (the states' owner; with the draft, its model loaded with it) */
    mf_step *eng;      /* the scheduled engine over ref (made with mf_step_opts.draft for MF_SPEC_DSPARK), or
                        * NULL: the reference forward and the reference draft */
    int source;        /* mf_spec_source */
    /* candidates per round at most: 1..dspark_block_size (1..MF_SPEC_MAX injected); 0: dspark_block_size */
    int n_max;
    /* 1 (`--spec-tokens auto`): per round and sequence the k of 0..n_max that the cost model says
     * gives the most tokens per unit of time (mf_spec_choose, priced on `price`), with a running
     * estimate of the acceptance at each position; sequences at k 0 still probe now and then (after
     * 16, then 32, ... up to 1024 plain rounds while probes fail, and at least as many as keep the
     * probes' cost, priced and then measured, within 1% of the plain rounds' time) with k 1. 0:
     * n_max every round. */
    int adaptive;
    /* the machine and placement the cost model prices the verify and the draft on (config, profile,
     * placement, cards, dense, threads: what the engine runs; batch, unit_len, draft and feats are
     * set per price); NULL: the built-in machine (sched/cost.h), host placement, eng's threads. */
    const mf_plan_opts *price;
    mf_spec_inject_fn inject;   /* MF_SPEC_INJECT */
    void *inject_user;
} mf_spec_opts;

typedef struct mf_spec mf_spec;

/* A speculation for a batcher of n_slots sequence slots. -EINVAL (bad options: no draft loaded,
 * n_max out of range, an engine without opts.draft), -ENOMEM. */
int mf_spec_new(const mf_spec_opts *o, int n_slots, mf_spec **out);
void mf_spec_free(mf_spec *sp);

/* Slot i starts a new request: its draft context, feature rows and acceptance estimates start over
 * (the estimates from the acceptance seen over all requests so far). */
void mf_spec_admit(mf_spec *sp, int slot);

/* A decode sequence of a step: its slot, state, pending token (the round's anchor, at position
 * st->n_pos), its request's user pointer, and how many candidates it may take at most (tokens it
 * may still generate after the anchor's next one, room left in its state). */
typedef struct mf_spec_seq {
    int slot;
    mf_ref_state *st;
    int32_t anchor;
    void *req_user;
    int room;
} mf_spec_seq;

/* Before a step's forward: picks each sequence's k (the policy, at most its room), runs the draft
 * round of the sequences with k > 0 (one draft call for all of them; injected: one call each) and
 * marks their states (mf_ref_state_mark for 1 + k positions). mf_spec_cands gives each one's
 * candidates after. 0 or the draft's error (nothing marked then). */
int mf_spec_plan(mf_spec *sp, const mf_spec_seq *seqs, int n);
/* Slot i's candidates of this step (k of them; 0: a plain step). */
int mf_spec_cands(const mf_spec *sp, int slot, const int32_t **cands);

/* 1 when the forwards must hand out the draft's features (the checkpoint's draft), 0 (injected). */
int mf_spec_feats(const mf_spec *sp);

/* Where a forward writes the features of positions [pos0, pos0 + n) of slot i's sequence:
 * rows[j] for position pos0 + j, NULL for the positions no later round can read (before the last
 * sliding_window ones). With source MF_SPEC_INJECT, or the draft not needed, all NULL. */
void mf_spec_rows(mf_spec *sp, int slot, int64_t pos0, int n, float **rows);

/* After the forward, slot i's tokens: from its 1 + k logits rows (lrows, vocab_size apart; row j the
 * logits at position anchor + j) the target's next tokens by smp (greedy or sampling) with the
 * candidates' acceptance; out[0..*n_out) receives the accepted candidates and the bonus token (1..k + 1
 * tokens), each token out[j]'s logits being row j. The state is rolled back to its kept positions
 * (the anchor and the accepted ones), the acceptance estimates and counters updated. 0 or the
 * rollback's error. */
int mf_spec_accept(mf_spec *sp, int slot, mf_ref_state *st, mf_sampler *smp, const float *lrows, int32_t *out,
                   int *n_out);

/* After the forward: its wall time and shape (items, sequences), for the measured cost of a verify
 * against a plain step (mf_spec_stats). */
void mf_spec_step_done(mf_spec *sp, int64_t wall_ns, int n_items, int n_seq);

/* What speculation did since mf_spec_new. Acceptance at position i: of the rounds that proposed an
 * i-th candidate with the ones before it accepted, the share that accepted it. */
typedef struct mf_spec_stats {
    int n_max;
    int64_t rounds;                     /* sequence-rounds with k > 0 */
    int64_t plain;                      /* sequence-steps with k 0 */
    int64_t proposed, accepted;         /* candidates */
    int64_t tokens;                     /* tokens the speculating sequence-rounds gave (accepted + bonus) */
    int64_t pos_tried[MF_SPEC_MAX + 1], pos_accepted[MF_SPEC_MAX + 1];   /* [1..n_max] */
    int64_t k_chosen[MF_SPEC_MAX + 1];  /* sequence-rounds per k (0: plain) */
    int64_t probes;                     /* rounds a k-0 sequence speculated to learn its acceptance */
    /* measured: draft rounds and their wall time; steps by their extra items (items - sequences,
     * capped at n_max: at batch 1 a verify of 1 + k) and their wall time */
    int64_t draft_calls, draft_ns;
    int64_t steps[MF_SPEC_MAX + 1], step_ns[MF_SPEC_MAX + 1];
    /* the cost model's prices the policy used, batch 1: a step of 1 + k items, a draft round of k */
    double price_verify_ns[MF_SPEC_MAX + 1], price_draft_ns[MF_SPEC_MAX + 1];
    /* an engine with cards: the draft's experts taken onto them (mf_step_draft_cards) when the
     * policy picks k > 0, dropped after SP_HOLD rounds in a row in which it picked k 0 everywhere
     * (probes do not count), and whether they are held now */
    int64_t dcards_takes, dcards_drops;
    int dcards_held;
} mf_spec_stats;
void mf_spec_get_stats(const mf_spec *sp, mf_spec_stats *out);

/* The one rule of the adaptive k (the engine's policy and `moeflow sim --spec`): of k = 0..n_max, the
 * one with the most expected tokens per unit of time, E(k) / T(k): E(k) = 1 + sum over i = 1..k of
 * prod over j <= i of alpha[j] (alpha[j]: the estimated acceptance of candidate j given the ones
 * before it accepted; the bonus makes the 1), T(0) = verify_ns[0] (a plain step), T(k) =
 * verify_ns[k] + draft_ns[k] (the verify of 1 + k and the draft round). Ties to the smaller k.
 * *gain (may be NULL): E(k) / T(k) over E(0) / T(0). */
int mf_spec_choose(const double *verify_ns, const double *draft_ns, const double *alpha, int n_max, double *gain);
/* The probes' spacing: plain rounds before a k-0 sequence's next probe, at least its backoff (16,
 * 32, ... while its probes fail) and at least as many as keep a probe's cost probe_ns (its draft
 * round and its verify's extra item, as measured) within `share` of the plain rounds' time
 * (plain_ns each) between probes, at most 1024 (unless the backoff is more). Costs not known
 * (plain_ns <= 0): the backoff. */
int mf_spec_probe_gap(int backoff, double plain_ns, double probe_ns, double share);

/* The simulator's view of a speculating batch (`moeflow sim --spec`): po's machine and settings
 * (its routing drawing each sequence's verify as consecutive tokens), `batch` sequences, each step
 * a verify of 1 + k items per sequence for k = 0..n_max (0: a plain step; k stops where batch x
 * (1 + k) passes MF_STEP_MAX_ITEMS, *n_k the last k priced), the engine's graph with the draft's
 * features; the draft round of batch sequences proposing k (uniform draws of its experts). Each k
 * in its steady state: with cards, k > 0 holds the draft's experts on them (the draft round's MoE
 * on the cards, the verify's backbone cache short of their slots: mf_plan_opts.draft_cards), k 0
 * gives them back (a plain step of the engine without the draft). Each priced as mf_plan_step does: warmup steps, then the mean makespan of `steps`. verify_ns[k],
 * draft_ns[k] (draft_ns[0] = 0). 0 or the plans' error. */
int mf_spec_sim(const mf_plan_opts *po, int n_max, int warmup, int steps, double *verify_ns, double *draft_ns,
                int *n_k);

/* The plan mf_spec_sim prices at k: the verify of 1 + k items a sequence (draft 0) or the draft
 * round of k candidates of at most MF_STEP_DRAFT_ITEMS / dspark_block_size sequences (draft 1),
 * in k's steady state (draft_cards: k > 0). */
mf_plan_opts mf_spec_sim_plan(const mf_plan_opts *po, int k, int draft);

#endif