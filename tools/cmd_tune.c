/* `moeflow tune`: sweeps the engine's strategy knobs (placement, batch, threads per socket, read
 * window, copy slots, device cache size and policy, host store budget) through the simulator
 * (graphs/sim/plan.h) on a hardware profile, or for real on this machine (--real), and prints the
 * settings ranked, the best one, and the lane that bounds it. */
#include <errno.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "graphs/model/config.h"
#include "graphs/pipe/pipe.h"
#include "graphs/sim/plan.h"
#include "graphs/sim/plan_ranks.h"
#include "graphs/sim/routing.h"
#include "graphs/step/stepgraph.h"
#include "sched/error.h"
#include "sched/profile.h"
#include "tools/commands.h"
#include "tools/sim_common.h"

#define MF_TUNE_MAX_VALS 16

/* A placement's word (mf_tool_placements). */
static const char *mf_tune_place(int64_t v) { return mf_opt_word_name(mf_tool_placements, (int)v); }

/* One knob's values to sweep (its option: a row of mf_tune_table). */
typedef struct mf_tune_knob {
    int n;
    int64_t v[MF_TUNE_MAX_VALS];
    int given;         /* set on the command line */
} mf_tune_knob;

enum { K_PLACE, K_BATCH, K_THREADS, K_WINDOW, K_COPY, K_CACHE, K_POLICY, K_BUDGET, K_DENSE, K_SPLIT, K_MICRO, K_N };

typedef struct mf_tune_result {
    int64_t v[K_N];
    mf_plan_report rep;     /* simulated */
    double meas_token_ns;   /* --real: measured */
    double score;           /* tokens per second (throughput) or 1 / step time (latency) */
} mf_tune_result;

/* Parses a comma list of knob k into kn; 0 or -EINVAL with a message. */
static int mf_tune_parse_list(int k, const char *opt, const char *list, mf_tune_knob *kn)
{
    static const mf_opt_word *const words[K_N] = {[K_PLACE] = mf_tool_placements, [K_POLICY] = mf_tool_cache_policies,
                                                 [K_DENSE] = mf_tool_denses, [K_SPLIT] = mf_tool_dense_splits};
    char buf[512], expect[128];
    if (strlen(list) >= sizeof buf) return mf_error(-EINVAL, "%s: list too long", opt);
    strcpy(buf, list);
    kn->n = 0;
    kn->given = 1;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (kn->n == MF_TUNE_MAX_VALS) return mf_error(-EINVAL, "%s: more than %d values", opt, MF_TUNE_MAX_VALS);
        int64_t v;
        char *end = NULL;
        if (words[k]) {
            if ((v = mf_opt_word_value(words[k], tok)) < 0)
                return mf_error(-EINVAL, "%s: expected %s, found '%s'", opt,
                                mf_opt_words_list(words[k], expect, sizeof expect), tok);
        } else if (k == K_CACHE || k == K_BUDGET) {
            if (!(v = (int64_t)mf_tool_size(tok)))
                return mf_error(-EINVAL, "%s: expected sizes such as 4G or 512M, found '%s'", opt, tok);
        } else {
            v = strtoll(tok, &end, 10);
            int64_t lo = k == K_WINDOW ? -1 : 1,
                    hi = k == K_BATCH ? MF_STEP_MAX_ITEMS : k == K_THREADS ? 256 : k == K_MICRO ? 2 : 4096;
            if (!*tok || *end || v < lo || v > hi || (k == K_WINDOW && v == 0))
                return mf_error(-EINVAL, "%s: expected whole numbers in %" PRId64 "..%" PRId64 "%s, found '%s'", opt,
                                lo, hi, k == K_WINDOW ? " (not 0; -1: all)" : "", tok);
        }
        kn->v[kn->n++] = v;
    }
    if (!kn->n) return mf_error(-EINVAL, "%s: an empty list", opt);
    return 0;
}

/* A knob's LIST as an option table's MF_OPT_FN (o->arg: which knob). */
static int mf_tune_list_opt(const mf_opt *o, const char *arg, void *field)
{
    return mf_tune_parse_list(o->arg, o->flag, arg, field);
}

/* The command line of `moeflow tune`. */
typedef struct mf_tune_cli {
    const char *prof_path, *dir, *preset, *routing_spec;
    long seed, context, steps, warmup, top, ranks;
    int json, real, latency, store, tables, fill;
    mf_tune_knob kn[K_N];
} mf_tune_cli;

static const mf_opt_word mf_tune_objectives[] = {{"throughput", 0}, {"latency", 1}, {NULL, 0}};

#define F(x) offsetof(mf_tune_cli, x)
#define KNOB(flag_, k, example_, help_) \
    {flag_, .kind = MF_OPT_FN, .off = F(kn[k]), .meta = "LIST", .fn = mf_tune_list_opt, .arg = k, \
     .example = example_, .help = help_}
static const mf_opt mf_tune_table[] = {
    {"--profile", .kind = MF_OPT_STR, .off = F(prof_path), .meta = "P", .help = "the hardware profile"},
    {"--checkpoint", .kind = MF_OPT_STR, .off = F(dir), .meta = "DIR", .help = "the model: DIR/config.json"},
    {"--preset", .kind = MF_OPT_STR, .off = F(preset), .meta = "NAME", .help = "the model: a built-in config"},
    KNOB("--placement", K_PLACE, "host", "host, plus seed and hybrid when the profile has cards"),
    KNOB("--batch", K_BATCH, "1", "1, 4, 16 (sequences per decode step; --real: 1, 4)"),
    KNOB("--threads", K_THREADS, "1", "the profile's threads per socket, and half of them (--real: the first)"),
    KNOB("--read-window", K_WINDOW, "2", "1, 2, 4, -1 (all) with --store streamed; else the engine's 2"),
    KNOB("--copy-slots", K_COPY, "1", "1, 2, 4 (copy-in streams per card) for seed and hybrid"),
    KNOB("--dev-cache", K_CACHE, "1G",
         "a quarter and half of a card's memory, and 0 (what the card has\n"
         "room for beside its dense weights and the steps' buffers, the\n"
         "engine's default), for seed and hybrid"),
    KNOB("--cache-policy", K_POLICY, "lfu", "lfu, lru, for seed and hybrid"),
    KNOB("--store-budget", K_BUDGET, "1G", "the simulator's default (2G) with --store streamed"),
    KNOB("--dense", K_DENSE, "host",
         "host, plus cards when the profile has cards (the dense work\n"
         "on the cards by layer ranges, as `moeflow sim --dense cards`)"),
    KNOB("--dense-split", K_SPLIT, "layers",
         "layers, rows for dense cards (rows: every dense matrix but the\n"
         "shared expert split by rows across all cards, `sim --dense-split`)"),
    KNOB("--micro-batches", K_MICRO, "1", "1, 2 (two micro-batches in flight; 2 only for batches of 2 or more)"),
    {"--dev-cache-fill", .kind = MF_OPT_WORD, .off = F(fill), .def = MF_TOOL_DEV_CACHE_FILL, .meta = "on|off",
     .words = mf_tool_on_off,
     .help = "not swept: every candidate's card caches start warm (on, as\n`moeflow sim`) or empty"},
    {"--store", .kind = MF_OPT_WORD, .off = F(store), .def = "resident", .meta = "MODE", .words = mf_tool_store_modes,
     .help = "not swept: routed experts resident or streamed (as\n`moeflow sim`)"},
    {"--tables", .kind = MF_OPT_WORD, .off = F(tables), .def = "resident", .meta = "MODE", .words = mf_tool_store_modes,
     .help = "not swept: Engram tables resident or streamed"},
    {"--routing", .kind = MF_OPT_STR, .off = F(routing_spec), .def = "uniform", .meta = "R",
     .help = "uniform, zipf:S or trace:FILE (as `moeflow sim`)"},
    {"--seed", .kind = MF_OPT_LONG, .off = F(seed), .def = "1", .meta = "S", .lo = 0, .hi = 1L << 62,
     .help = "seeds the routing's draws"},
    {"--context", .kind = MF_OPT_LONG, .off = F(context), .def = "16", .meta = "N", .lo = 1, .hi = 1L << 40,
     .help = "tokens already in each sequence"},
    {"--real", .kind = MF_OPT_FLAG, .off = F(real),
     .help = "decode for real on this machine instead (needs --checkpoint with a\n"
             "loadable model, e.g. the demo; cards are emulated, emu:N): only the\n"
             "knobs the engine has (placement, batch, threads, read window, device\n"
             "cache); the table shows the simulator's prediction beside each"},
    {"--objective", .kind = MF_OPT_WORD, .off = F(latency), .def = "throughput", .meta = "O",
     .words = mf_tune_objectives,
     .help = "throughput (tokens per second over the batch) or latency (time of\none decode step)"},
    {"--steps", .kind = MF_OPT_LONG, .off = F(steps), .def = "6", .meta = "N", .lo = 1, .hi = 100000,
     .help = "measured steps per setting, after --warmup"},
    {"--warmup", .kind = MF_OPT_LONG, .off = F(warmup), .def = "2", .meta = "N", .lo = 0, .hi = 100000,
     .help = "steps per setting before the measured ones"},
    {"--top", .kind = MF_OPT_LONG, .off = F(top), .def = "15", .meta = "N", .lo = 0, .hi = 1L << 30,
     .help = "rows of the ranked table (0: all)"},
    {"--json", .kind = MF_OPT_FLAG, .off = F(json), .help = "one JSON object: every setting, ranked, and the best"},
    {"--ranks", .kind = MF_OPT_LONG, .off = F(ranks), .meta = "N", .lo = 2, .hi = MF_PIPE_MAX_RANKS,
     .help = "instead: the cut of the model over N hosts of this profile (as `moeflow\n"
             "sim --ranks N`): every split at the model's cuts, with 1, N and 2N\n"
             "micro-batches, per --batch value, ranked; the best proposed as\n"
             "--ranks-layers and --ranks-micro (the other knobs: their first value,\n"
             "or hybrid placement, dense work on cards split by rows with cards)"},
    {NULL},
};
#undef KNOB
#undef F

static const mf_opts_spec mf_tune_spec = {
    .cmd = "tune",
    .usage =
        "usage: moeflow tune --profile P (--checkpoint DIR | --preset NAME) [--real]\n"
        "                    [--placement LIST] [--batch LIST] [--threads LIST] [--read-window LIST]\n"
        "                    [--copy-slots LIST] [--dev-cache LIST] [--cache-policy LIST]\n"
        "                    [--store-budget LIST] [--dense LIST] [--dense-split LIST]\n"
        "                    [--micro-batches LIST] [--dev-cache-fill on|off]\n"
        "                    [--store resident|streamed]\n"
        "                    [--tables resident|streamed]\n"
        "                    [--routing R] [--seed S] [--context N] [--steps N] [--warmup N]\n"
        "                    [--objective throughput|latency] [--top N] [--json] [--ranks N]\n\n"
        "Tries every combination of the knobs' values (LIST: comma-separated, e.g. --batch 1,4,16)\n"
        "in the simulator (graphs/sim/plan.h, as `moeflow sim`) on the hardware profile P and prints them\n"
        "ranked, the best setting, and why: the lane that bounds it and how busy it is.\n"
        "Knobs not given are swept over defaults that fit the profile and the options, which each\n"
        "knob's line below says. Settings that cannot differ (card knobs under host placement, the\n"
        "dense split with the dense work on the host, two micro-batches at batch 1) are tried once.\n\n",
    .opts = mf_tune_table,
    .tail = "Progress goes to stderr.\n",
    .col = 24,
};

static void mf_tune_fmt_size(int64_t b, char *out, size_t n)
{
    if (b <= 0) snprintf(out, n, "-");
    else if (b >= (INT64_C(1) << 30)) snprintf(out, n, "%.3gG", b / 1073741824.0);
    else snprintf(out, n, "%.3gM", b / 1048576.0);
}

static int mf_tune_cmp(const void *pa, const void *pb)
{
    const mf_tune_result *a = pa, *b = pb;
    return (a->score < b->score) - (a->score > b->score);
}

/* Why the setting runs as it does: the bottleneck lane and what would move it. */
static void mf_tune_why(const mf_tune_result *r, int real, FILE *f)
{
    const mf_plan_report *p = &r->rep;
    const char *ln = p->lanes[p->bottleneck].name;
    fprintf(f, "why: the simulated step is bound by lane '%s', busy %.0f%% of the step (%d slots, %.3f ms of work)",
            ln, 100 * p->lanes[p->bottleneck].share, p->lanes[p->bottleneck].slots,
            p->lanes[p->bottleneck].busy_ns / 1e6);
    int second = -1;
    for (int l = 0; l < p->n_lanes; l++)
        if (l != p->bottleneck && (second < 0 || p->lanes[l].share > p->lanes[second].share)) second = l;
    if (second >= 0)
        fprintf(f, "; next busiest '%s' at %.0f%%", p->lanes[second].name, 100 * p->lanes[second].share);
    fprintf(f, ".\n");
    if (!strncmp(ln, "cpu", 3))
        fprintf(f, "     Host workers are the limit: more threads per socket, a larger batch (weights read once for\n"
                   "     all its tokens) or moving expert work to cards would help.\n");
    else if (strstr(ln, "h2d"))
        fprintf(f, "     Copies to the cards are the limit: a larger device cache (fewer misses), more cards, or\n"
                   "     hybrid placement (misses computed on the host instead) would help.\n");
    else if (!strcmp(ln, "io"))
        fprintf(f, "     Disk reads are the limit: a larger host store budget or a wider read window would help.\n");
    else if (strstr(ln, "compute"))
        fprintf(f, "     Card kernels are the limit: more cards or hybrid placement would help.\n");
    if (p->lanes[p->bottleneck].share < 0.5)
        fprintf(f, "     No lane is busy half the step: the dependency chain (layer after layer), not a lane's\n"
                   "     throughput, sets the time; more overlap (batch, read window) rather than more bandwidth.\n");
    if (real) fprintf(f, "     (--real: ranked by the measured time; the bottleneck is the simulator's reading.)\n");
}

/* The options that cannot go together; 0 or 2 (said on stderr). */
static int mf_tune_check(const mf_tune_cli *a)
{
    const mf_tune_knob *kn = a->kn;
    if (!a->prof_path || (!a->dir == !a->preset))
        return mf_opts_refuse(&mf_tune_spec, "--profile P and one of --checkpoint DIR or --preset NAME are required");
    if (a->real && !a->dir) {
        fprintf(stderr, "moeflow tune: --real decodes for real: it needs --checkpoint DIR\n");
        return 2;
    }
    if (a->real && ((kn[K_COPY].given && (kn[K_COPY].n > 1 || kn[K_COPY].v[0] != 1)) ||
                    (kn[K_POLICY].given && (kn[K_POLICY].n > 1 || kn[K_POLICY].v[0] != MF_PLAN_CACHE_LFU)))) {
        fprintf(stderr, "moeflow tune: --real: the engine has one copy-in stream per card and an LFU device "
                        "cache; --copy-slots and --cache-policy can only be swept in simulation\n");
        return 2;
    }
    return 0;
}

/* The values of the knobs not given: what fits the profile (cards or not) and the options. 0 or
 * -EINVAL for card values asked of a profile without cards, or a read window without a stream. */
static int mf_tune_defaults(mf_tune_cli *a, const mf_profile *prof)
{
    mf_tune_knob *kn = a->kn;
    int cards = prof->n_cards > 0, real = a->real, streamed = a->store == MF_PLAN_STORE_STREAMED;
    if (!kn[K_PLACE].given) {
        kn[K_PLACE].n = cards ? 3 : 1;
        for (int i = 0; i < kn[K_PLACE].n; i++) kn[K_PLACE].v[i] = i;
    } else if (!cards) {
        for (int i = 0; i < kn[K_PLACE].n; i++)
            if (kn[K_PLACE].v[i] != MF_STEP_PLACE_HOST)
                return mf_error(-EINVAL, "--placement %s: profile %s has no cards",
                                mf_tune_place(kn[K_PLACE].v[i]), prof->name);
    }
    if (!kn[K_BATCH].given) {
        int64_t b[] = {1, 4, 16};
        kn[K_BATCH].n = real ? 2 : 3;
        memcpy(kn[K_BATCH].v, b, sizeof b);
    }
    if (!kn[K_THREADS].given) {
        kn[K_THREADS].n = 1;
        kn[K_THREADS].v[0] = prof->threads_per_socket;
        if (!real && prof->threads_per_socket > 1) kn[K_THREADS].v[kn[K_THREADS].n++] = prof->threads_per_socket / 2;
    }
    if (!kn[K_WINDOW].given) {
        int64_t w[] = {1, 2, 4, -1};
        kn[K_WINDOW].n = streamed && !real ? 4 : 1;
        memcpy(kn[K_WINDOW].v, streamed && !real ? w : (int64_t[]){2}, sizeof(int64_t) * kn[K_WINDOW].n);
    }
    if (!kn[K_COPY].given) {
        int64_t c[] = {1, 2, 4};
        kn[K_COPY].n = cards && !real ? 3 : 1;
        memcpy(kn[K_COPY].v, c, sizeof c);
    }
    if (!kn[K_CACHE].given) {
        uint64_t m = prof->card_mem_bytes;
        kn[K_CACHE].n = cards && !real && m ? 3 : 1;
        /* a budget of all of the card (the sweep's third before 2026-12-05) leaves no room for the
         * steps' buffers: the engine would refuse it, so the plan does; 0 is the engine's own sizing */
        kn[K_CACHE].v[0] = kn[K_CACHE].n == 3 ? (int64_t)(m / 4) : 0;
        kn[K_CACHE].v[1] = (int64_t)(m / 2);
        kn[K_CACHE].v[2] = 0;
    }
    if (!kn[K_POLICY].given) {
        kn[K_POLICY].n = cards && !real ? 2 : 1;
        kn[K_POLICY].v[0] = MF_PLAN_CACHE_LFU;
        kn[K_POLICY].v[1] = MF_PLAN_CACHE_LRU;
    }
    if (!kn[K_BUDGET].given) {
        kn[K_BUDGET].n = 1;
        kn[K_BUDGET].v[0] = 0;
    }
    if (!kn[K_DENSE].given) {
        kn[K_DENSE].n = cards ? 2 : 1;
        kn[K_DENSE].v[0] = MF_PLAN_DENSE_HOST;
        kn[K_DENSE].v[1] = MF_PLAN_DENSE_CARDS;
    } else if (!cards) {
        for (int i = 0; i < kn[K_DENSE].n; i++)
            if (kn[K_DENSE].v[i] != MF_PLAN_DENSE_HOST)
                return mf_error(-EINVAL, "--dense cards: profile %s has no cards", prof->name);
    }
    if (!kn[K_SPLIT].given) {
        kn[K_SPLIT].n = cards ? 2 : 1;
        kn[K_SPLIT].v[0] = MF_SG_SPLIT_LAYERS;
        kn[K_SPLIT].v[1] = MF_SG_SPLIT_ROWS;
    }
    if (!kn[K_MICRO].given) {   /* 1 and 2 (2 tried for batches of 2 or more) */
        kn[K_MICRO].n = 2;
        kn[K_MICRO].v[0] = 1;
        kn[K_MICRO].v[1] = 2;
    }
    if (!streamed && (kn[K_WINDOW].given || kn[K_BUDGET].given))
        return mf_error(-EINVAL, "--read-window and --store-budget sweep a streamed store: add --store streamed");
    return 0;
}

/* Every combination into *out (*n_out of them); card knobs collapse to their first value under
 * host placement, the split under dense host, two micro-batches are skipped at batch 1. */
static int mf_tune_combos(const mf_tune_knob *kn, mf_tune_result **out, int *n_out)
{
    int64_t total = 1;
    for (int k = 0; k < K_N; k++) total *= kn[k].n;
    if (total > 100000) return mf_error(-EINVAL, "%" PRId64 " combinations: narrow the lists (at most 100000)", total);
    mf_tune_result *res = calloc((size_t)total, sizeof *res);
    if (!res) return mf_error(-ENOMEM, "out of memory");
    int idx[K_N] = {0}, n_res = 0;
    for (int64_t t = 0; t < total; t++) {
        int64_t v[K_N];
        for (int k = 0; k < K_N; k++) v[k] = kn[k].v[idx[k]];
        int host = v[K_PLACE] == MF_STEP_PLACE_HOST;
        int skip = (host && (idx[K_COPY] || idx[K_CACHE] || idx[K_POLICY])) ||
                   (v[K_DENSE] == MF_PLAN_DENSE_HOST && idx[K_SPLIT]) ||
                   (v[K_BATCH] < 2 && v[K_MICRO] == 2);
        for (int k = K_N - 1; k >= 0; k--) {   /* next combination */
            if (++idx[k] < kn[k].n) break;
            idx[k] = 0;
        }
        if (skip) continue;
        if (host) v[K_COPY] = v[K_CACHE] = v[K_POLICY] = 0;
        if (v[K_DENSE] == MF_PLAN_DENSE_HOST) v[K_SPLIT] = MF_SG_SPLIT_LAYERS;
        memcpy(res[n_res++].v, v, sizeof v);
    }
    *out = res;
    *n_out = n_res;
    return 0;
}

/* Simulates (and with --real measures) setting r on the routing rt; its score. With tty, says
 * that it decodes for real (progress, on stderr). */
static int mf_tune_try(const mf_tune_cli *a, const mf_config *cfg, const mf_profile *prof, mf_routing *rt,
                       mf_tune_result *r, const char *progress)
{
    mf_plan_opts po = {.config = cfg, .profile = prof, .placement = (int)r->v[K_PLACE],
                       .threads_per_socket = (int)r->v[K_THREADS], .batch = (int)r->v[K_BATCH],
                       .context = a->context, .read_window = (int)r->v[K_WINDOW], .copy_slots = (int)r->v[K_COPY],
                       .dev_cache_bytes = (uint64_t)r->v[K_CACHE], .dev_cache_policy = (int)r->v[K_POLICY],
                       .dev_cache_fill = a->fill, .store = a->store, .store_budget_bytes = (uint64_t)r->v[K_BUDGET],
                       .tables = a->tables, .routing = rt, .seed = (uint64_t)a->seed, .dense = (int)r->v[K_DENSE],
                       .dense_split = (int)r->v[K_SPLIT], .micro = (int)r->v[K_MICRO]};
    int rc = mf_plan_run(&po, (int)a->warmup, (int)a->steps, &r->rep);
    if (!rc && a->real) {
        mf_step_times mt;
        if (progress) fputs(progress, stderr);
        rc = mf_tool_measure(a->dir, &po, prof->n_cards, (int)r->v[K_THREADS] * prof->n_sockets, (int)a->warmup,
                             (int)a->steps, &r->meas_token_ns, &mt);
    }
    if (rc) return rc;
    double tok_ns = a->real ? r->meas_token_ns : r->rep.token_ns;
    r->score = a->latency ? 1e9 / (tok_ns * r->v[K_BATCH]) : 1e9 / tok_ns;
    return 0;
}

/* Tries every setting, progress on stderr, then ranks them. */
static int mf_tune_run(const mf_tune_cli *a, const mf_config *cfg, const mf_profile *prof, mf_tune_result *res,
                       int n_res)
{
    int tty = isatty(2);
    for (int i = 0; i < n_res; i++) {
        mf_tune_result *r = &res[i];
        mf_routing *rt = NULL;
        char progress[64];
        snprintf(progress, sizeof progress, "\rtune: setting %d of %d: decoding for real ...", i + 1, n_res);
        int rc = mf_routing_open(a->routing_spec, cfg->n_layers, cfg->n_routed_experts, cfg->n_experts_per_tok,
                                 (uint64_t)a->seed, &rt);
        if (rc) return rc;
        rc = mf_tune_try(a, cfg, prof, rt, r, tty ? progress : NULL);
        mf_routing_free(rt);
        if (rc)
            return mf_error_wrap(rc, "setting %d (placement %s, dense %s, batch %" PRId64 ", threads %" PRId64 ")",
                                 i + 1, mf_tune_place(r->v[K_PLACE]), r->v[K_DENSE] ? "cards" : "host",
                                 r->v[K_BATCH], r->v[K_THREADS]);
        if (tty) fprintf(stderr, "\rtune: %d of %d settings tried", i + 1, n_res);
        else if (a->real || (i + 1) * 10 / n_res != i * 10 / n_res) fprintf(stderr, "tune: %d of %d settings tried\n", i + 1, n_res);
    }
    if (tty) fprintf(stderr, "\n");
    qsort(res, (size_t)n_res, sizeof *res, mf_tune_cmp);
    return 0;
}

static void mf_tune_json(const mf_tune_cli *a, const mf_profile *prof, const mf_tune_result *res, int n_res)
{
    printf("{\"profile\":\"%s\",\"model\":\"%s\",\"mode\":\"%s\",\"objective\":\"%s\",\"routing\":\"%s\","
           "\"steps\":%ld,\"warmup\":%ld,\"results\":[",
           prof->name, a->dir ? a->dir : a->preset, a->real ? "measured" : "simulated",
           a->latency ? "latency" : "throughput", a->routing_spec, a->steps, a->warmup);
    for (int i = 0; i < n_res; i++) {
        const mf_tune_result *r = &res[i];
        const mf_plan_report *p = &r->rep;
        printf("%s{\"rank\":%d,\"placement\":\"%s\",\"dense\":\"%s\",\"dense_split\":\"%s\",\"batch\":%" PRId64 ",\"threads_per_socket\":%" PRId64
               ",\"read_window\":%" PRId64 ",\"copy_slots\":%" PRId64 ",\"dev_cache_bytes\":%" PRId64
               ",\"cache_policy\":\"%s\",\"store_budget_bytes\":%" PRId64 ",\"micro_batches\":%" PRId64
               ",\"predicted_step_s\":%.9g,"
               "\"predicted_tokens_per_s\":%.6g,\"bottleneck\":\"%s\",\"bottleneck_busy\":%.4f",
               i ? "," : "", i + 1, mf_tune_place(r->v[K_PLACE]), r->v[K_DENSE] ? "cards" : "host",
               r->v[K_SPLIT] == MF_SG_SPLIT_ROWS ? "rows" : "layers", r->v[K_BATCH], r->v[K_THREADS],
               r->v[K_WINDOW], r->v[K_COPY], r->v[K_CACHE], r->v[K_POLICY] ? "lru" : "lfu", r->v[K_BUDGET],
               r->v[K_MICRO], p->step_ns / 1e9, p->token_ns > 0 ? 1e9 / p->token_ns : 0, p->lanes[p->bottleneck].name,
               p->lanes[p->bottleneck].share);
        if (a->real) printf(",\"measured_token_s\":%.9g,\"measured_tokens_per_s\":%.6g", r->meas_token_ns / 1e9,
                            1e9 / r->meas_token_ns);
        printf("}");
    }
    printf("]}\n");
}

/* One row of the ranked table (and its count of ties). */
static void mf_tune_row(const mf_tune_cli *a, int w, const mf_tune_result *r, int ties)
{
    const mf_plan_report *p = &r->rep;
    int real = a->real, streamed = a->store == MF_PLAN_STORE_STREAMED, host = r->v[K_PLACE] == MF_STEP_PLACE_HOST;
    char cache[16], budget[16], win[8], copy[8];
    mf_tune_fmt_size(r->v[K_CACHE], cache, sizeof cache);
    mf_tune_fmt_size(r->v[K_BUDGET], budget, sizeof budget);
    snprintf(win, sizeof win, "%" PRId64, r->v[K_WINDOW]);
    snprintf(copy, sizeof copy, "%" PRId64, r->v[K_COPY]);
    printf("%4d %10.2f %10.*f %-7s %-5s %5" PRId64 " %5" PRId64 " %7" PRId64 " %6s %5s %8s %6s %8s  %s (%.0f%%)\n",
           w + 1, real ? 1e9 / r->meas_token_ns : 1e9 / p->token_ns, real ? 2 : 3,
           real ? 1e9 / p->token_ns : p->step_ns / 1e6, mf_tune_place(r->v[K_PLACE]),
           !r->v[K_DENSE] ? "host" : r->v[K_SPLIT] == MF_SG_SPLIT_ROWS ? "rows" : "cards", r->v[K_BATCH], r->v[K_MICRO],
           r->v[K_THREADS], streamed ? win : "-", host ? "-" : copy, host ? "-" : cache,
           host ? "-" : (r->v[K_POLICY] ? "lru" : "lfu"), streamed ? budget : "-",
           p->lanes[p->bottleneck].name, 100 * p->lanes[p->bottleneck].share);
    if (ties) printf("%4s %d more setting%s within 0.1%% (other copy slots, cache or window values)\n", "",
                     ties, ties > 1 ? "s" : "");
}

/* The ranked table: rows within 0.1% of the row above with the same placement, batch and threads
 * are ties, counted in that row instead of shown (the knobs that differ do not matter there). */
static int mf_tune_table_print(const mf_tune_cli *a, const mf_profile *prof, const mf_tune_result *res, int n_res)
{
    printf("tune: %s on profile %s, %d settings %s (%ld warm-up + %ld steps each, routing %s), ranked by %s\n\n",
           a->dir ? a->dir : a->preset, prof->name, n_res, a->real ? "measured" : "simulated", a->warmup, a->steps,
           a->routing_spec, a->latency ? "step time" : "tokens per second");
    printf("%4s %10s %10s %-7s %-5s %5s %5s %7s %6s %5s %8s %6s %8s  %s\n", "row", a->real ? "meas tok/s" : "tok/s",
           a->real ? "pred tok/s" : "step ms", "place", "dense", "batch", "micro", "threads", "window", "copy",
           "devcache", "policy", "budget", "bottleneck (busy)");
    int n_rows = 0, *row = malloc(sizeof(int) * (size_t)n_res), *ties = calloc((size_t)n_res, sizeof(int));
    if (!row || !ties) {
        free(row);
        free(ties);
        return mf_error(-ENOMEM, "out of memory");
    }
    for (int i = 0; i < n_res; i++) {
        const mf_tune_result *r = &res[i], *q = n_rows ? &res[row[n_rows - 1]] : NULL;
        if (q && q->v[K_PLACE] == r->v[K_PLACE] && q->v[K_DENSE] == r->v[K_DENSE] && q->v[K_SPLIT] == r->v[K_SPLIT] &&
            q->v[K_BATCH] == r->v[K_BATCH] && q->v[K_MICRO] == r->v[K_MICRO] && q->v[K_THREADS] == r->v[K_THREADS] &&
            r->score >= q->score * 0.999)
            ties[n_rows - 1]++;
        else
            row[n_rows++] = i;
    }
    int shown = a->top && a->top < n_rows ? (int)a->top : n_rows;
    for (int w = 0; w < shown; w++) mf_tune_row(a, w, &res[row[w]], ties[w]);
    if (shown < n_rows) printf("(%d more rows: --top 0 shows all)\n", n_rows - shown);
    free(row);
    free(ties);
    return 0;
}

/* The best setting, and why it runs as it does. */
static void mf_tune_best(const mf_tune_cli *a, const mf_tune_result *b)
{
    printf("\nbest: placement %s, dense %s, batch %" PRId64 ", %" PRId64 " micro-batch%s, %" PRId64 " threads per socket",
           mf_tune_place(b->v[K_PLACE]),
           !b->v[K_DENSE] ? "host" : b->v[K_SPLIT] == MF_SG_SPLIT_ROWS ? "cards (split by rows)" : "cards",
           b->v[K_BATCH], b->v[K_MICRO], b->v[K_MICRO] > 1 ? "es" : "", b->v[K_THREADS]);
    if (b->v[K_PLACE] != MF_STEP_PLACE_HOST) {
        char cache[16];
        mf_tune_fmt_size(b->v[K_CACHE], cache, sizeof cache);
        printf(", %" PRId64 " copy slots, device cache %s %s", b->v[K_COPY], b->v[K_CACHE] ? cache : "(all)",
               b->v[K_POLICY] ? "lru" : "lfu");
    }
    if (a->store == MF_PLAN_STORE_STREAMED) printf(", read window %" PRId64, b->v[K_WINDOW]);
    double btok = a->real ? b->meas_token_ns : b->rep.token_ns;
    printf(": %.2f tokens/s %s (%.3f ms per step of %" PRId64 ")\n", 1e9 / btok, a->real ? "measured" : "simulated",
           btok * b->v[K_BATCH] / 1e6, b->v[K_BATCH]);
    mf_tune_why(b, a->real, stdout);
}

/* One split and micro-batch count of --ranks, simulated. */
typedef struct mf_tune_cut {
    mf_pipe_split sp;
    int micro, batch;
    double tokens_per_s, step_ns;
} mf_tune_cut;

static int mf_tune_cut_cmp(const void *pa, const void *pb)
{
    const mf_tune_cut *x = pa, *y = pb;
    if (x->batch != y->batch) return x->batch < y->batch ? -1 : 1;
    return x->tokens_per_s > y->tokens_per_s ? -1 : x->tokens_per_s < y->tokens_per_s;
}

/* The knob's first given value, else v. */
static int64_t mf_tune_first(const mf_tune_knob *k, int64_t v) { return k->given ? k->v[0] : v; }

/* The splits of cfg into a->ranks ranges at cuts (pos[0..m) the cuts, 0 first) into cuts[]. */
static int mf_tune_splits(const mf_config *cfg, int n, mf_pipe_split *out, int max)
{
    int pos[MF_CONFIG_MAX_LAYERS], m = 0, k = 0, idx[MF_PIPE_MAX_RANKS];
    for (int L = 1; L < cfg->n_layers; L++)
        if (mf_config_cut_ok(cfg, L)) pos[m++] = L;
    if (n - 1 > m) return 0;
    for (int i = 0; i < n - 1; i++) idx[i] = i;   /* combinations of n - 1 of the m cuts, ascending */
    for (;;) {
        if (k < max) {
            out[k].n_ranks = n;
            out[k].bound[0] = 0;
            for (int i = 0; i < n - 1; i++) out[k].bound[i + 1] = pos[idx[i]];
            out[k].bound[n] = cfg->n_layers;
            k++;
        }
        int i = n - 2;
        while (i >= 0 && idx[i] == m - (n - 1) + i) i--;
        if (i < 0) return k;
        idx[i]++;
        for (int j = i + 1; j < n - 1; j++) idx[j] = idx[j - 1] + 1;
    }
}

/* --ranks N: every split, with 1, N and 2N micro-batches, per batch, simulated as a pipeline;
 * ranked per batch, the best proposed. */
static int mf_tune_ranks(const mf_tune_cli *a, const mf_config *cfg, const mf_profile *prof)
{
    const mf_tune_knob *kn = a->kn;
    int n = (int)a->ranks, cards = prof->n_cards > 0, n_sp;
    static mf_pipe_split sp[4096];
    if (!(n_sp = mf_tune_splits(cfg, n, sp, 4096)))
        return mf_error(-EINVAL, "--ranks %d: the model has fewer cuts than ranks", n);
    int n_b = kn[K_BATCH].given ? kn[K_BATCH].n : 3, nres = 0;
    int64_t batches[MF_TUNE_MAX_VALS] = {1, 16, 64};
    if (kn[K_BATCH].given) memcpy(batches, kn[K_BATCH].v, sizeof batches);
    mf_tune_cut *res = malloc(sizeof *res * (size_t)n_sp * 3 * (size_t)n_b);
    if (!res) return mf_error(-ENOMEM, "out of memory");
    double mem = 0.9 * (double)prof->host_mem_bytes;
    int rc = 0;
    for (int b = 0; b < n_b && !rc; b++)
        for (int i = 0; i < n_sp && !rc; i++) {
            int micros[3] = {1, n, 2 * n};
            for (int u = 0; u < 3 && !rc; u++) {
                if ((u && micros[u] > batches[b]) || (u == 2 && micros[2] == micros[1])) continue;
                mf_routing *rt = NULL;
                rc = mf_routing_open(a->routing_spec, cfg->n_layers, cfg->n_routed_experts, cfg->n_experts_per_tok,
                                     (uint64_t)a->seed, &rt);
                mf_plan_opts po = {
                    .config = cfg, .profile = prof, .batch = (int)batches[b], .context = a->context,
                    .placement = (int)mf_tune_first(&kn[K_PLACE], cards ? MF_STEP_PLACE_HYBRID : MF_STEP_PLACE_HOST),
                    .dense = (int)mf_tune_first(&kn[K_DENSE], cards ? MF_PLAN_DENSE_CARDS : MF_PLAN_DENSE_HOST),
                    .dense_split = (int)mf_tune_first(&kn[K_SPLIT], MF_SG_SPLIT_ROWS),
                    .threads_per_socket = (int)mf_tune_first(&kn[K_THREADS], prof->threads_per_socket),
                    .read_window = (int)mf_tune_first(&kn[K_WINDOW], 2), .copy_slots = (int)mf_tune_first(&kn[K_COPY], 1),
                    .dev_cache_bytes = (uint64_t)mf_tune_first(&kn[K_CACHE], 0), .dev_cache_fill = a->fill,
                    .store = a->store, .tables = a->tables, .store_budget_bytes = (uint64_t)mf_tune_first(&kn[K_BUDGET], 0),
                    .routing = rt, .seed = (uint64_t)a->seed};
                mf_plan_ranks_report r;
                if (!rc)
                    rc = mf_plan_ranks_run(&(mf_plan_ranks_opts){.host = &po, .split = sp[i], .micro = micros[u],
                                                                 .warmup = (int)a->warmup, .steps = (int)a->steps,
                                                                 .host_mem_bytes = mem}, &r);
                mf_routing_free(rt);
                if (!rc) res[nres++] = (mf_tune_cut){sp[i], r.micro, r.batch, r.tokens_per_s, r.step_ns};
            }
            if (isatty(2)) fprintf(stderr, "\rtune: batch %" PRId64 ": %d of %d splits tried", batches[b], i + 1, n_sp);
        }
    if (isatty(2)) fprintf(stderr, "\n");
    if (!rc) {
        qsort(res, (size_t)nres, sizeof *res, mf_tune_cut_cmp);
        printf("tune: the model over %d hosts of profile %s (link %.3g Gb/s, %.0f us a message), every split at "
               "its cuts:\n%-6s %-28s %6s %12s %12s\n", n, prof->name, prof->link_bytes_per_s * 8 / 1e9,
               prof->link_latency_ns / 1e3, "batch", "layers", "micro", "tokens/s", "step ms");
        for (int i = 0, shown = 0; i < nres; i++) {
            shown = i && res[i].batch == res[i - 1].batch ? shown + 1 : 0;
            if (a->top && shown >= a->top) continue;
            char str[256];
            mf_pipe_split_str(&res[i].sp, str, sizeof str);
            printf("%-6d %-28s %6d %12.2f %12.3f\n", res[i].batch, str, res[i].micro, res[i].tokens_per_s,
                   res[i].step_ns / 1e6);
        }
        for (int i = 0; i < nres; i++)
            if (!i || res[i].batch != res[i - 1].batch) {
                char str[256];
                mf_pipe_split_str(&res[i].sp, str, sizeof str);
                printf("best at batch %d: --ranks-layers %s --ranks-micro %d (%.2f tokens/s)\n", res[i].batch, str,
                       res[i].micro, res[i].tokens_per_s);
            }
    }
    free(res);
    return rc;
}

int mf_cmd_tune(int argc, char **argv)
{
    static mf_tune_cli a;
    memset(&a, 0, sizeof a);
    int rc = mf_opts_parse(&mf_tune_spec, argc, argv, &a);
    if (rc != MF_OPTS_RUN) return rc;
    if ((rc = mf_tune_check(&a))) return rc;
    static mf_profile prof;
    mf_config cfg;
    mf_tune_result *res = NULL;
    int n_res = 0;
    rc = mf_tool_plan_inputs(a.prof_path, a.dir, a.preset, &prof, &cfg);
    if (!rc && a.ranks) {   /* the cut over hosts */
        rc = mf_tune_ranks(&a, &cfg, &prof);
        if (rc) fprintf(stderr, "moeflow tune: %s\n", mf_last_error()[0] ? mf_last_error() : "failed");
        return rc ? 1 : 0;
    }
    if (!rc) rc = mf_tune_defaults(&a, &prof);
    if (!rc) rc = mf_tune_combos(a.kn, &res, &n_res);
    if (!rc) rc = mf_tune_run(&a, &cfg, &prof, res, n_res);
    if (!rc && a.json) mf_tune_json(&a, &prof, res, n_res);
    else if (!rc && !(rc = mf_tune_table_print(&a, &prof, res, n_res))) mf_tune_best(&a, &res[0]);
    if (rc) fprintf(stderr, "moeflow tune: %s\n", mf_last_error()[0] ? mf_last_error() : "failed");
    free(res);
    return rc ? 1 : 0;
}
