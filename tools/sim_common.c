/* What the commands share (tools/sim_common.h): the words of their options, and for `moeflow sim`
 * and `tune` running the real scheduled engine with a simulation's settings (the measured side of
 * the simulator's predictions). */
#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/dev.h"
#include "graphs/model/model.h"
#include "graphs/sim/plan.h"
#include "graphs/ref/ref.h"
#include "graphs/step/sample.h"
#include "graphs/step/spec.h"
#include "graphs/step/stepgraph.h"
#include "graphs/step/step.h"
#include "sched/error.h"
#include "tools/sim_common.h"

const mf_opt_word mf_tool_placements[] = {
    {"host", MF_STEP_PLACE_HOST}, {"seed", MF_STEP_PLACE_SEED}, {"hybrid", MF_STEP_PLACE_HYBRID}, {NULL, 0}};
const mf_opt_word mf_tool_denses[] = {{"host", MF_PLAN_DENSE_HOST}, {"cards", MF_PLAN_DENSE_CARDS}, {NULL, 0}};
const mf_opt_word mf_tool_dense_splits[] = {{"layers", MF_SG_SPLIT_LAYERS}, {"rows", MF_SG_SPLIT_ROWS}, {NULL, 0}};
const mf_opt_word mf_tool_in_splits[] = {{"cost", MF_SG_IN_COST}, {"rows", MF_SG_IN_ROWS}, {"items", MF_SG_IN_ITEMS}, {NULL, 0}};
const mf_opt_word mf_tool_heads_modes[] = {
    {"cost", MF_SG_HEADS_COST}, {"cards", MF_SG_HEADS_CARDS}, {"host", MF_SG_HEADS_HOST}, {NULL, 0}};
const mf_opt_word mf_tool_lt_modes[] = {
    {"cost", MF_SG_LT_COST}, {"on", MF_SG_LT_ON}, {"dense", MF_SG_LT_DENSE}, {"off", MF_SG_LT_OFF}, {NULL, 0}};
const mf_opt_word mf_tool_store_modes[] = {
    {"resident", MF_PLAN_STORE_RESIDENT}, {"streamed", MF_PLAN_STORE_STREAMED}, {NULL, 0}};
const mf_opt_word mf_tool_cache_policies[] = {{"lfu", MF_PLAN_CACHE_LFU}, {"lru", MF_PLAN_CACHE_LRU}, {NULL, 0}};
const mf_opt_word mf_tool_on_off[] = {{"on", 1}, {"off", 0}, {NULL, 0}};

const mf_opt_word mf_tool_specs[] = {{"off", MF_TOOL_SPEC_OFF}, {"dspark", MF_TOOL_SPEC_DSPARK},
                                     {"perfect", MF_TOOL_SPEC_PERFECT}, {NULL, 0}};

int mf_tool_spec_tokens_opt(const mf_opt *o, const char *arg, void *field)
{
    char *end = NULL;
    long n = strcmp(arg, "auto") ? strtol(arg, &end, 10) : 0;
    if (strcmp(arg, "auto") && (!end || *end || n < 1 || n > MF_SPEC_MAX))
        return mf_error(-EINVAL, "%s: expected auto or 1..%d, found '%s'", o->flag, MF_SPEC_MAX, arg);
    *(long *)field = n;
    return 0;
}

/* The mean measured step of 1 + k items over the mean plain step (0: not measured). */
static double mf_tool_spec_cost(const mf_spec_stats *st, int k)
{
    if (!st->steps[0] || !st->steps[k]) return 0;
    return ((double)st->step_ns[k] / st->steps[k]) / ((double)st->step_ns[0] / st->steps[0]);
}

void mf_tool_spec_json(FILE *f, const mf_spec_stats *st)
{
    int64_t fw = st->rounds + st->plain;
    fprintf(f, ",\"spec\":{\"n_max\":%d,\"rounds\":%" PRId64 ",\"plain\":%" PRId64 ",\"proposed\":%" PRId64
            ",\"accepted\":%" PRId64 ",\"acceptance\":%.6g,\"acceptance_by_position\":[", st->n_max, st->rounds,
            st->plain, st->proposed, st->accepted, st->proposed ? (double)st->accepted / st->proposed : 0);
    for (int i = 1; i <= st->n_max; i++)
        fprintf(f, i > 1 ? ",%.6g" : "%.6g", st->pos_tried[i] ? (double)st->pos_accepted[i] / st->pos_tried[i] : 0);
    fprintf(f, "],\"tokens_per_target_forward\":%.6g,\"k_chosen\":[", fw ? (double)(st->tokens + st->plain) / fw : 0);
    for (int k = 0; k <= st->n_max; k++) fprintf(f, k ? ",%" PRId64 : "%" PRId64, st->k_chosen[k]);
    fprintf(f, "],\"probes\":%" PRId64 ",\"draft_s_per_round\":%.6g,\"verify_cost_over_plain\":[", st->probes,
            st->draft_calls ? st->draft_ns / 1e9 / st->draft_calls : 0);
    for (int k = 0; k <= st->n_max; k++) {
        double r = mf_tool_spec_cost(st, k);
        if (r > 0) fprintf(f, k ? ",%.6g" : "%.6g", r);
        else fprintf(f, k ? ",null" : "null");
    }
    fprintf(f, "],\"price_verify_s\":[");
    for (int k = 0; k <= st->n_max; k++) fprintf(f, k ? ",%.6g" : "%.6g", st->price_verify_ns[k] / 1e9);
    fprintf(f, "],\"price_draft_s\":[");
    for (int k = 0; k <= st->n_max; k++) fprintf(f, k ? ",%.6g" : "%.6g", st->price_draft_ns[k] / 1e9);
    fprintf(f, "],\"draft_cards\":{\"taken\":%" PRId64 ",\"given_back\":%" PRId64 ",\"held\":%d}}", st->dcards_takes,
            st->dcards_drops, st->dcards_held);
}

void mf_tool_spec_line(FILE *f, const char *who, const mf_spec_stats *st)
{
    int64_t fw = st->rounds + st->plain;
    fprintf(f, "%s: speculation: %" PRId64 " rounds, %" PRId64 " plain steps (%" PRId64 " probes); accepted %" PRId64
            " of %" PRId64 " candidates (%.1f%%; by position:", who, st->rounds, st->plain, st->probes, st->accepted,
            st->proposed, st->proposed ? 100.0 * st->accepted / st->proposed : 0);
    for (int i = 1; i <= st->n_max; i++)
        fprintf(f, " %.0f%%", st->pos_tried[i] ? 100.0 * st->pos_accepted[i] / st->pos_tried[i] : 0);
    fprintf(f, "); %.2f tokens per target forward; k chosen:", fw ? (double)(st->tokens + st->plain) / fw : 0);
    for (int k = 0; k <= st->n_max; k++) fprintf(f, " %d:%" PRId64, k, st->k_chosen[k]);
    fprintf(f, "; verify over a plain step (measured):");
    for (int k = 1; k <= st->n_max; k++)
        if (mf_tool_spec_cost(st, k) > 0) fprintf(f, " 1+%d %.2fx", k, mf_tool_spec_cost(st, k));
    if (st->draft_calls) fprintf(f, "; draft %.2f ms a round", st->draft_ns / 1e6 / st->draft_calls);
    if (st->dcards_takes)
        fprintf(f, "; the draft's experts on the cards: taken %" PRId64 "x, given back %" PRId64 "x%s", st->dcards_takes,
                st->dcards_drops, st->dcards_held ? ", held" : "");
    fputc('\n', f);
}

int mf_tool_placement(const char *s) { return mf_opt_word_value(mf_tool_placements, s); }
int mf_tool_dense(const char *s) { return mf_opt_word_value(mf_tool_denses, s); }
int mf_tool_dense_split(const char *s) { return mf_opt_word_value(mf_tool_dense_splits, s); }
int mf_tool_cache_policy(const char *s) { return mf_opt_word_value(mf_tool_cache_policies, s); }

int mf_tool_plan_inputs(const char *profile, const char *dir, const char *preset, mf_profile *prof, mf_config *cfg)
{
    int rc = mf_profile_load(profile, prof);
    if (rc) return rc;
    if (!dir) return mf_config_preset(preset, cfg);
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    return mf_config_load(path, cfg);
}

static int mf_measure_cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The real engine with the plan's settings: prefill of `context` tokens per sequence, `warmup`
 * decode steps, then `steps` timed; *token_ns the median step wall time / batch, phases the
 * mean per step. */
int mf_tool_measure(const char *dir, const mf_plan_opts *po, int n_cards, int threads, int warmup,
                          int steps, double *token_ns, mf_step_times *mean)
{
    mf_model *m = NULL;
    mf_ref *r = NULL;
    mf_step *eng = NULL;
    mf_dev *dev = NULL;
    mf_ref_state *st[MF_STEP_MAX_ITEMS] = {0};
    float *logits = NULL;
    int64_t *wall = NULL;
    int batch = po->batch ? po->batch : 1, n_prompt = (int)(po->context ? po->context : 16), rc;
    /* the weights mapped from the page cache: trials after the first read nothing from the disk */
    mf_model_opts mo = {.quiet = 1, .resident_limit_bytes = UINT64_C(64) << 30, .weights = MF_MODEL_WEIGHTS_MAPPED};
    if (po->store == MF_PLAN_STORE_STREAMED || po->tables == MF_PLAN_STORE_STREAMED) {
        mo.store = po->store == MF_PLAN_STORE_STREAMED ? MF_MODEL_STORE_STREAMED : MF_MODEL_STORE_RESIDENT;
        mo.store_tables = po->tables == MF_PLAN_STORE_STREAMED ? MF_MODEL_STORE_STREAMED : MF_MODEL_STORE_RESIDENT;
        mo.store_budget_bytes = po->store_budget_bytes;
    }
    if ((rc = mf_model_load(dir, &mo, &m)) || (rc = mf_ref_new(m, NULL, &r))) goto out;
    if (po->placement != MF_STEP_PLACE_HOST || po->dense == MF_PLAN_DENSE_CARDS) {
        char spec[32];
        snprintf(spec, sizeof spec, "emu:%d", n_cards);
        if ((rc = mf_dev_open(spec, &dev))) goto out;
    }
    rc = mf_step_new(r, &(mf_step_opts){.n_threads = threads, .read_window = po->read_window, .dev = dev,
                                        .max_batch = batch > MF_STEP_DEFAULT_BATCH ? batch : 0,
                                        .placement = po->placement, .dev_cache_bytes = po->dev_cache_bytes,
                                        .dev_cache_fill = po->dev_cache_fill,
                                        .dev_graphs = po->dev_graphs, .cpu_bytes_per_s = po->cpu_bytes_per_s,
                                        .micro = po->micro,
                                        .dense = po->dense == MF_PLAN_DENSE_CARDS ? MF_STEP_DENSE_CARDS
                                                                                   : MF_STEP_DENSE_HOST,
                                        .dense_split = po->dense_split, .in_split = po->in_split, .lt = po->lt, .profile = po->profile},
                     &eng);
    if (rc) goto out;
    const mf_config *c = mf_model_config(m);
    int64_t V = c->vocab_size;
    logits = malloc(sizeof(float) * (size_t)V * (size_t)batch);
    wall = malloc(sizeof *wall * (size_t)steps);
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)n_prompt);
    if (!logits || !wall || !prompt) {
        free(prompt);
        rc = mf_error(-ENOMEM, "out of memory");
        goto out;
    }
    /* the prompts of bench decode: sequence i's tokens are (37 k + 11 + 101 i) mod vocab */
    for (int s = 0; s < batch && !rc; s++) {
        for (int k = 0; k < n_prompt; k++) prompt[k] = (int32_t)((37LL * k + 11 + 101LL * s) % V);
        rc = mf_ref_state_new(r, n_prompt + warmup + steps + 1, &st[s]);
        if (!rc) rc = mf_step_prefill(eng, st[s], prompt, n_prompt, logits + (size_t)s * V);
    }
    free(prompt);
    memset(mean, 0, sizeof *mean);
    for (int k = 0; k < warmup + steps && !rc; k++) {
        int32_t tok[MF_STEP_MAX_ITEMS];
        for (int s = 0; s < batch; s++) tok[s] = mf_sample_greedy(logits + (size_t)s * V, V);
        if ((rc = mf_step_decode(eng, st, tok, batch, logits))) break;
        if (k < warmup) continue;
        mf_step_times t;
        mf_step_last_times(eng, &t);
        wall[k - warmup] = t.wall_ns;
        mean->wall_ns += t.wall_ns / steps;
        for (int q = 0; q < MF_STEP_N_PHASES; q++) mean->phase_ns[q] += t.phase_ns[q] / steps;
    }
    if (!rc) {
        qsort(wall, (size_t)steps, sizeof *wall, mf_measure_cmp_i64);
        *token_ns = (steps % 2 ? (double)wall[steps / 2] : (wall[steps / 2 - 1] + wall[steps / 2]) / 2.0) / batch;
    }
out:
    for (int s = 0; s < batch; s++) mf_ref_state_free(st[s]);
    free(wall);
    free(logits);
    mf_step_free(eng);
    mf_dev_close(dev);
    mf_ref_free(r);
    mf_model_free(m);
    return rc;
}

