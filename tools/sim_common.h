/* What `moeflow sim` and `moeflow tune` share: the words of their options and running the real
 * scheduled engine (graphs/step/step.h) with a simulation's settings (graphs/sim/plan.h) on this machine. */
#ifndef MF_SIM_COMMON_H
#define MF_SIM_COMMON_H

#include <stdint.h>
#include <stdio.h>

#include "graphs/model/config.h"
#include "graphs/sim/plan.h"
#include "graphs/step/step.h"
#include "graphs/step/stepgraph.h"
#include "sched/profile.h"
#include "tools/opts.h"

/* The words of the options sim, tune, decode and bench decode share, and their values (the word
 * lists of their option tables, tools/opts.h); the functions give a word's value, or -1 for any
 * other word. */
extern const mf_opt_word mf_tool_placements[];   /* host, seed, hybrid: mf_step_placement */
extern const mf_opt_word mf_tool_denses[];       /* host, cards: mf_plan_dense (also mf_step_opts.dense) */
extern const mf_opt_word mf_tool_dense_splits[]; /* layers, rows: mf_sg_dense_split (mf_plan_opts, mf_step_opts) */
extern const mf_opt_word mf_tool_in_splits[];    /* cost, rows, items: mf_sg_in_mode (mf_plan_opts, mf_step_opts) */
extern const mf_opt_word mf_tool_heads_modes[];  /* cost, cards, host: mf_sg_heads_mode (mf_plan_opts, mf_step_opts) */
extern const mf_opt_word mf_tool_lt_modes[];     /* cost, on, dense, off: mf_sg_lt_mode (mf_plan_opts, mf_step_opts) */
extern const mf_opt_word mf_tool_store_modes[];  /* resident, streamed: mf_plan_store */
extern const mf_opt_word mf_tool_cache_policies[];   /* lfu, lru: mf_plan_cache_policy */
extern const mf_opt_word mf_tool_on_off[];       /* on 1, off 0 (--dev-cache-fill) */
int mf_tool_placement(const char *s);
int mf_tool_dense(const char *s);
int mf_tool_dense_split(const char *s);
int mf_tool_cache_policy(const char *s);
/* The commands' default --dense-split (decode, sim, bench decode): rows, which the simulator
 * predicts faster than layers on the seed host at batch 1, 16 and 64, uniform and zipf:1.0
 * routing (docs/measurements.md part 1); the library's zero (mf_step_opts, mf_plan_opts) is layers. */
#define MF_TOOL_DENSE_SPLIT "rows"
/* --in-split's help after its first line (the engine commands' and sim's: each names its own
 * condition there): mf_sg_in_mode, the threshold mf_sg_in_whole's. */
#define MF_TOOL_IN_SPLIT_HELP                                                                       \
    "by rows or by items over the cards, whichever the cost model prices\n"                         \
    "lower where every card holds all the stage's rows, which it does only\n"                       \
    "for prefill chunks of " MF_OPTS_STR(MF_SG_IN_WHOLE_MIN) " positions or more (cost); by rows only\n" \
    "(rows); by items wherever it can, every card holding all its rows (items)"
/* The commands' default --dev-cache-fill (decode, bench decode, sim, tune): on. With cards and a
 * seed or hybrid placement a warm cache costs one start-up copy (on the seed host ~80 GB at
 * h2d_total_bytes_per_s, ~2 s) and turns batch-1 slots that hybrid sends to the host (a miss's
 * copy costs more than the host's compute) into hits on the card; the library's zero is off. */
#define MF_TOOL_DEV_CACHE_FILL "on"

/* --spec (decode, serve, bench decode, sim; graphs/step/spec.h, docs/dspark.md): off, dspark (the
 * checkpoint's draft), perfect (bench decode only: the candidates of a previous greedy run of the same
 * prompts, injected: the upper bound of what a draft could give). --spec-tokens N|auto: the field (a
 * long) gets N (1..MF_SPEC_MAX) or 0 for auto (the cost model's k per round, mf_spec_opts.adaptive). */
enum { MF_TOOL_SPEC_OFF, MF_TOOL_SPEC_DSPARK, MF_TOOL_SPEC_PERFECT };
extern const mf_opt_word mf_tool_specs[];
int mf_tool_spec_tokens_opt(const mf_opt *o, const char *arg, void *field);
/* What the reports print of a speculation (mf_spec_stats): the JSON member "spec": {n_max, rounds,
 * plain, proposed, accepted, acceptance, acceptance_by_position [...], tokens_per_target_forward,
 * k_chosen [...], probes, draft_s_per_round, verify_cost_over_plain [...] (measured: the mean step of
 * 1 + k items over the mean plain step, null where none ran), price_verify_s, price_draft_s [...]}
 * after a comma; and a one-line summary for stderr. */
typedef struct mf_spec_stats mf_spec_stats;
void mf_tool_spec_json(FILE *f, const mf_spec_stats *st);
void mf_tool_spec_line(FILE *f, const char *who, const mf_spec_stats *st);

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
