/* The engine and model options `moeflow decode`, `moeflow serve` and `moeflow bench serve` share,
 * written once: one option table (mf_tool_engine_table, included in each command's table with
 * MF_OPT_GROUP_ROW, so the flags, their help and their parsing are the same everywhere), one check
 * of what cannot go together, and one opening of what they describe: the model with its weights
 * (mapped from the page cache unless --weights copied, docs/io.md), the expert store, the Engram
 * token map, the reference forward, the cards and the scheduled engine, with the lines that say
 * how the weights are held. */
#ifndef MF_TOOLS_ENGINE_OPTS_H
#define MF_TOOLS_ENGINE_OPTS_H

#include <stdint.h>

#include "device/dev.h"
#include "graphs/model/engram_map.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/spec.h"
#include "graphs/step/step.h"
#include "host/store.h"
#include "host/tokenizer.h"
#include "sched/profile.h"
#include "tools/commands.h"
#include "tools/ranks.h"

/* The options (mf_tool_engine_table), then what mf_tool_engine_check resolves. */
typedef struct mf_tool_engine {
    int sched;                     /* --engine: 1 scheduled, 0 reference */
    long threads;
    mf_tool_sockets sk;            /* n 0: --sockets not given (auto) */
    int exact;
    int weights;                   /* --weights: MF_MODEL_WEIGHTS_* */
    int store_mode, store_tables;  /* MF_MODEL_STORE_*; 0: none / as --store */
    uint64_t store_budget;
    long io_depth, read_window;
    const char *devices, *profile_path, *fill_spec;
    int placement, dense;          /* -1: not given */
    int dense_split, heads, dev_graphs, lt;   /* lt: --cublaslt (mf_step_opts.lt) */
    int in_split;                  /* --in-split (mf_step_opts.in_split) */
    long micro;
    uint64_t dev_cache;
    int draft;                     /* not an option: the command's --spec dspark (the checkpoint's DSpark
                                    * draft loaded, mf_model_opts.load_draft; the engine made with it) */
    /* A pipeline over several hosts (tools/ranks.h), or NULL: one host. Not the group's rows (bench
     * serve runs on one host): decode and serve point it at their MF_TOOL_RANKS_ROWS' options and
     * open it (mf_tool_ranks_open) before mf_tool_run_open, which then loads this rank's layers only
     * and gives the engine the pipe's link. */
    mf_tool_ranks *rk;
    /* resolved by mf_tool_engine_check */
    int place, dense_cards;        /* MF_STEP_PLACE_*; the dense work on the cards */
    const char *placement_word;    /* the placement's word for reports, or NULL */
    /* set by the command before mf_tool_run_open */
    int max_items;                 /* the engine's largest step (mf_step_opts.max_batch; 0: its default),
                                    * so that every step of the command's batcher is one graph */
} mf_tool_engine;

extern const mf_opt mf_tool_engine_table[];

/* The usage lines of the group, for a command's usage text (indented to `moeflow decode `). */
#define MF_TOOL_ENGINE_USAGE \
    "                      [--engine scheduled|reference] [--threads N] [--sockets N|auto] [--exact]\n" \
    "                      [--weights mapped|copied]\n" \
    "                      [--store resident|streamed [--store-budget SIZE]\n" \
    "                       [--store-tables resident|streamed] [--io-depth N] [--read-window N]]\n" \
    "                      [--devices emu:N|cuda[:IDS] [--placement seed|host|hybrid] [--dense host|cards]\n" \
    "                       [--dense-split layers|rows] [--heads cost|cards|host] [--micro-batches 1|2]\n" \
    "                       [--cublaslt cost|on|dense|off]\n" \
    "                       [--dev-cache SIZE] [--dev-cache-fill on|off|trace:FILE] [--dev-graphs]\n" \
    "                       [--profile P]]\n"

/* The defaults the table cannot state: --threads the online CPUs, --placement and --dense not
 * given, --dev-graphs from MOEFLOW_DEV_GRAPHS=1. Call before mf_opts_parse. */
void mf_tool_engine_init(mf_tool_engine *e);

/* The options that cannot go together (--ranks-layers needs the scheduled engine), and what they
 * leave to decide: the sockets (auto: every
 * socket hwloc finds, at most one per worker), the placement and whether the dense work runs on
 * the cards. 0, or 2 with the reason on stderr ("moeflow <cmd>: ..."). */
int mf_tool_engine_check(const char *cmd, mf_tool_engine *e);

/* What mf_tool_run_open opened. */
typedef struct mf_tool_run {
    mf_model *m;
    mf_store *mst;         /* the model's expert store, or NULL */
    mf_engram_map *emap;   /* the tokenizer's Engram token map, or NULL */
    mf_ref *r;
    mf_dev *dev;
    mf_step *eng;          /* the scheduled engine, or NULL (reference) */
    mf_profile prof;
    int have_prof;
    double load_s;         /* the model's load */
    mf_spec *spec;         /* mf_tool_run_spec's, or NULL */
} mf_tool_run;

/* Opens checkpoint dir as e says (after mf_tool_engine_check): the model (weights as --weights;
 * stderr says how they are held: mapped warm or cold, or the fall back to a streamed store when
 * they exceed the memory, and the store's line), the Engram token map of tok (when given and the
 * model has Engram layers), the reference forward (ro: the command's act_quant and hooks; the token
 * map is set here), the cards and, scheduled, the engine (with mf_tool_io_env's IO settings; a
 * card cache fill from a routing trace's counts). With e->rk opened for several ranks: this rank's
 * layers only, the pipe (e->rk->pipe) made before the engine, its link given to the engine and the
 * pipe attached to the forward and engine after. Nothing on stderr but errors when quiet.
 * 0, a negative code (mf_last_error) or a positive exit code said on stderr. */
int mf_tool_run_open(const char *cmd, const mf_tool_engine *e, const char *dir, const mf_tok *tok,
                     mf_ref_opts ro, int quiet, mf_tool_run *x);
/* What the engine did before the first step: the card caches' fill, the cards' self-check, the
 * dense weights each card holds (stderr; not when quiet, but for the self-check). */
void mf_tool_run_notes(const char *cmd, const mf_tool_engine *e, const mf_tool_run *x, int quiet);
/* --spec dspark (e->draft, after mf_tool_run_open): x->spec, the speculation over the engine (or the
 * reference) for a batcher of max_batch slots, n_tokens candidates a round (--spec-tokens; 0 auto),
 * priced on what it runs (--profile or the built-in machine; its threads, placement, cards, dense
 * work) at context positions. 0 or a negative code. */
int mf_tool_run_spec(const mf_tool_engine *e, mf_tool_run *x, long n_tokens, int max_batch, int64_t context);
/* Frees what mf_tool_run_open and mf_tool_run_spec made (after the batcher over them). */
void mf_tool_run_close(mf_tool_run *x);

/* Seconds since this process started (its start time in /proc/self/stat), or -1. */
double mf_tool_since_start_s(void);
/* This process's resident bytes now (/proc/self/status): its own (RssAnon) and files' pages it
 * maps (RssFile, the mapped weights). 0 or -1. */
int mf_tool_rss(double *anon_bytes, double *file_bytes);

#endif
