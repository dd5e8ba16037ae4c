/* Routing for simulation: which routed experts each token of a step picks in each layer, drawn
 * from a stated distribution or replayed from a trace that `moeflow decode --record-routing`
 * wrote while decoding for real. The simulator (graphs/sim/plan.h) asks for one step at a time. */
#ifndef MF_ROUTING_H
#define MF_ROUTING_H

#include <stdint.h>

typedef struct mf_routing mf_routing;

/* spec:
 *   "uniform"      every token's top_k distinct experts uniformly at random, per layer;
 *   "zipf:S"       per layer a fixed random ranking of the experts (from the seed); a token draws
 *                  top_k distinct experts, rank r with probability proportional to 1 / (r + 1)^S
 *                  (S > 0; S = 0 is uniform);
 *   "local[:P[:W]]" temporal locality, per sequence (token t of every call is sequence t, each with
 *                  its own history): each of a token's top_k picks is, with probability P, one of
 *                  its sequence's W most recently used experts of the layer (uniformly among those
 *                  the token has not picked), else uniform among the rest; "local" is P 0.6, W 16
 *                  (MF_ROUTING_LOCAL_*), calibrated to the seed's measurement on the released
 *                  checkpoint: against a FIFO window of the last 16 experts a token's 6 of 384 miss
 *                  2.67-3.30 per layer (these draws: 2.9-3.0; uniform: 5.8; tests/test_routing.c);
 *   "trace:PATH"   replays a recorded trace token by token in recorded order, wrapping around at
 *                  its end; fails with -EINVAL when the trace's layers, experts or top_k differ
 *                  from the arguments, naming PATH and what differs.
 * Draws are deterministic per seed. Bad specs fail with -EINVAL naming the spec. */
#define MF_ROUTING_LOCAL_P 0.6
#define MF_ROUTING_LOCAL_W 16
int mf_routing_open(const char *spec, int n_layers, int n_experts, int top_k, uint64_t seed,
                    mf_routing **out);
/* The routes of the next n_tokens tokens in every layer: ex[(layer * n_tokens + t) * top_k + j]
 * (distinct within a token and layer). Each call advances by n_tokens tokens. */
int mf_routing_next(mf_routing *r, int n_tokens, int32_t *ex);
/* The same for n_seq sequences of per_seq consecutive tokens each (a speculative verify's units):
 * token t is sequence t / per_seq's (local: its history, its tokens one after another); the layout
 * as mf_routing_next's over n_seq x per_seq tokens. mf_routing_next is per_seq 1. */
int mf_routing_next_units(mf_routing *r, int n_seq, int per_seq, int32_t *ex);
/* A trace's accesses per (layer, expert) over all its tokens: counts[layer x n_experts + e]
 * (n_layers x n_experts, overwritten) and 1; 0 (counts untouched) for drawn routings, whose
 * popularity an engine cannot know before decoding. For the warm fill's order
 * (device/expert_cache.h mf_dev_xcache_fill_plan). */
int mf_routing_counts(const mf_routing *r, uint32_t *counts);
/* What it is, for reports ("zipf:1.1", "local:0.6:16", "trace:PATH (N tokens)"). */
const char *mf_routing_describe(const mf_routing *r);
void mf_routing_free(mf_routing *r);

/* Recording a trace while decoding: one record per (sequence, position, layer). The file is
 * written under a temporary name and renamed by mf_routing_rec_close, which returns the first
 * write error (naming the path) if any. Records of one token may arrive in any layer order and from any thread (calls are serialized); a
 * token is complete once all its layers are recorded. */
typedef struct mf_routing_rec mf_routing_rec;
int mf_routing_rec_open(const char *path, int n_layers, int n_experts, int top_k,
                        mf_routing_rec **out);
int mf_routing_rec_add(mf_routing_rec *w, int seq, int64_t pos, int layer, const int32_t *ex, int k);
int mf_routing_rec_close(mf_routing_rec *w);

#endif
