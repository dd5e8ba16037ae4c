/* What `moeflow sim` and `moeflow tune` share: sizes on the command line and running the real
 * scheduled engine (graphs/step/step.h) with a simulation's settings (graphs/sim/plan.h) on this machine. */
#ifndef MF_SIM_COMMON_H
#define MF_SIM_COMMON_H

#include <stdint.h>

#include "graphs/model/config.h"
#include "graphs/sim/plan.h"
#include "graphs/step/step.h"
#include "graphs/step/stepgraph.h"
#include "sched/profile.h"

/* "2G", "512M", "64k", "1.5GiB", "4GB", plain bytes; 1024-based (K, M, G, T in either case, then an
 * optional "i" and "B"). 0 for anything else (or zero). The one size parser of every command. */
uint64_t mf_tool_size(const char *s);

/* The words of the options sim and tune share, as values; -1 for any other word. */
int mf_tool_placement(const char *s);      /* host, seed, hybrid: mf_step_placement */
int mf_tool_dense(const char *s);          /* host, cards: mf_plan_dense (also mf_step_opts.dense) */
int mf_tool_dense_split(const char *s);    /* layers, rows: mf_sg_dense_split (mf_plan_opts, mf_step_opts) */
int mf_tool_heads(const char *s);          /* cost, cards, host: mf_sg_heads_mode (mf_plan_opts, mf_step_opts) */
/* The commands' default --dense-split (decode, sim, bench decode): rows, which the simulator
 * predicts faster than layers on the seed host at batch 1, 16 and 64, uniform and zipf:1.0
 * routing (docs/measurements.md part 1); the library's zero (mf_step_opts, mf_plan_opts) is layers. */
#define MF_TOOL_DENSE_SPLIT MF_SG_SPLIT_ROWS
int mf_tool_store_mode(const char *s);     /* resident, streamed: mf_plan_store */
int mf_tool_cache_policy(const char *s);   /* lfu, lru: mf_plan_cache_policy */
int mf_tool_on_off(const char *s);         /* on 1, off 0 (--dev-cache-fill) */
/* The commands' default --dev-cache-fill (decode, bench decode, sim, tune): on. With cards and a
 * seed or hybrid placement a warm cache costs one start-up copy (on the seed host ~80 GB at
 * h2d_total_bytes_per_s, ~2 s) and turns batch-1 slots that hybrid sends to the host (a miss's
 * copy costs more than the host's compute) into hits on the card; the library's zero is off. */
#define MF_TOOL_DEV_CACHE_FILL 1

/* Loads the hardware profile at `profile` and the model's config: DIR/config.json when dir is
 * given, else the built-in preset. 0 or a negative code (mf_last_error names the file). */
int mf_tool_plan_inputs(const char *profile, const char *dir, const char *preset, mf_profile *prof, mf_config *cfg);

/* Decodes for real on checkpoint `dir` with po's placement, batch, context, store, read window and
 * device cache (cards emulated: emu:n_cards; threads engine workers): a prefill of po->context
 * tokens per sequence, `warmup` decode steps, then `steps` timed ones. *token_ns = median step
 * wall time / batch; *mean = the mean phase times per step. 0 or a negative code (mf_last_error). */
int mf_tool_measure(const char *dir, const mf_plan_opts *po, int n_cards, int threads, int warmup, int steps,
                    double *token_ns, mf_step_times *mean);

#endif
