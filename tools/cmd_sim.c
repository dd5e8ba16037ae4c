/* `moeflow sim`: simulates decode steps of the scheduled engine on a hardware profile
 * (graphs/sim/plan.h): the predicted per-token time, the phase table, each lane's busy share and the
 * bottleneck, the caches, the Chrome trace of the last step. --measure also runs the real engine
 * (graphs/step/step.h) with the same settings on this machine and prints measured vs predicted. */
#include <errno.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/dev.h"
#include "graphs/model/config.h"
#include "graphs/model/model.h"
#include "graphs/pipe/pipe.h"
#include "graphs/sim/plan.h"
#include "graphs/sim/plan_ranks.h"
#include "graphs/step/stepgraph.h"
#include "graphs/ref/ref.h"
#include "graphs/sim/routing.h"
#include "graphs/step/sample.h"
#include "graphs/step/spec.h"
#include "graphs/step/step.h"
#include "sched/error.h"
#include "sched/profile.h"
#include "tools/commands.h"
#include "tools/sim_common.h"

/* The command line of `moeflow sim`. */
typedef struct mf_sim_cli {
    const char *prof_path, *dir, *preset, *routing_spec, *trace;
    int placement, dense, dense_split, in_split, heads, lt;   /* dense: -1 not given */
    long cards, threads, batch, steps, warmup, seed, context, read_window;
    long copy_slots, dev_task_ns, prompt_tokens, chunk, micro, prefetch_min, cached;
    int json, ops, measure, store, tables, policy, dev_graphs, fill;
    uint64_t store_budget, dev_cache, host_mem;
    long ranks, ranks_micro;   /* a pipeline over hosts (--ranks N) */
    const char *ranks_layers;
    int spec;                 /* MF_TOOL_SPEC_* */
    long spec_tokens;         /* 0: auto */
    const char *accept;       /* --accept: acceptances, comma separated */
} mf_sim_cli;

#define F(x) offsetof(mf_sim_cli, x)
static const mf_opt mf_sim_table[] = {
    {"--profile", .kind = MF_OPT_STR, .off = F(prof_path), .meta = "P",
     .help = "the hardware profile (docs/profiles.md, `moeflow calibrate`)"},
    {"--checkpoint", .kind = MF_OPT_STR, .off = F(dir), .meta = "DIR",
     .help = "the model: DIR/config.json (the sparse flash41 layout works)"},
    {"--preset", .kind = MF_OPT_STR, .off = F(preset), .meta = "NAME", .help = "the model: a built-in config"},
    {"--placement", .kind = MF_OPT_WORD, .off = F(placement), .def = "host", .meta = "P", .words = mf_tool_placements,
     .help = "host, seed or hybrid (routed experts on cards)"},
    {"--cards", .kind = MF_OPT_LONG, .off = F(cards), .meta = "N", .lo = 1, .hi = 16,
     .help = "cards for seed/hybrid and --dense cards (default: the profile's)"},
    {"--dense", .kind = MF_OPT_WORD, .off = F(dense), .meta = "D", .words = mf_tool_denses,
     .help = "the dense work (attention linears, router gate, shared expert,\n"
             "head) on the host or on the cards (default: cards when --cards is\n"
             "given or placement is seed/hybrid, else host)"},
    {"--dense-split", .kind = MF_OPT_WORD, .off = F(dense_split), .def = MF_TOOL_DENSE_SPLIT, .meta = "S",
     .words = mf_tool_dense_splits,
     .help = "dense cards: layers (each layer's dense work on one card, by layer\n"
             "ranges) or rows (every dense matrix but the shared expert split by\n"
             "output rows across all cards)"},
    {"--in-split", .kind = MF_OPT_WORD, .off = F(in_split), .def = "cost", .meta = "I", .words = mf_tool_in_splits,
     .help = "dense cards split by rows: the attention's in stage per layer and shape\n"
             MF_TOOL_IN_SPLIT_HELP},
    {"--heads", .kind = MF_OPT_WORD, .off = F(heads), .def = "cost", .meta = "H", .words = mf_tool_heads_modes,
     .help = "dense cards: the attention heads' scores and values of a serial graph\n"
             "(a prefill chunk, batch 1) per layer by the cost model (cost), on the\n"
             "cards wherever they can, or on the host"},
    {"--cublaslt", .kind = MF_OPT_WORD, .off = F(lt), .def = "cost", .meta = "L", .words = mf_tool_lt_modes,
     .help = "where the cards' tensor cores take work through cuBLASLt: cost (by\n"
             "the cost model on --profile: never without a tensor-core rate), on\n"
             "(wherever it applies), dense (the dense linears only: host logits\n"
             "bit for bit on emulated cards), off"},
    {"--prefetch-min", .kind = MF_OPT_LONG, .off = F(prefetch_min), .def = "0", .meta = "N", .lo = -1,
     .hi = MF_STEP_MAX_CHUNK,
     .help = "a prefill chunk of at least N positions places each layer's\n"
             "experts at the layer's start and copies the cards' ones in\n"
             "while its attention runs (0: from the length at which every\n"
             "expert is expected used, 378 on flash41; -1: never)"},
    {"--micro-batches", .kind = MF_OPT_LONG, .off = F(micro), .def = "1", .meta = "M", .lo = 1, .hi = 2,
     .expect = "1 or 2", .help = "2: two micro-batches in flight (batch >= 2; the engine's\n--micro-batches), 1: one"},
    {"--threads", .kind = MF_OPT_LONG, .off = F(threads), .meta = "N", .lo = 1, .hi = 256,
     .help = "engine workers per socket (default: the profile's)"},
    {"--batch", .kind = MF_OPT_LONG, .off = F(batch), .def = "1", .meta = "B", .lo = 1, .hi = MF_STEP_MAX_ITEMS,
     .help = "sequences per step (1.." MF_OPTS_STR(MF_STEP_MAX_ITEMS) ")"},
    {"--steps", .kind = MF_OPT_LONG, .off = F(steps), .def = "8", .meta = "N", .lo = 1, .hi = 100000,
     .help = "steps reported"},
    {"--warmup", .kind = MF_OPT_LONG, .off = F(warmup), .def = "2", .meta = "N", .lo = 0, .hi = 100000,
     .help = "steps before them that warm the caches"},
    {"--routing", .kind = MF_OPT_STR, .off = F(routing_spec), .def = "uniform", .meta = "R",
     .help = "uniform, zipf:S, local[:P[:W]] (temporal locality per sequence:\nP the chance a pick repeats one of the last W experts; local is\nlocal:0.6:16, calibrated to the seed page's FIFO misses), or trace:FILE\n(a routing trace of moeflow decode --record-routing)"},
    {"--seed", .kind = MF_OPT_LONG, .off = F(seed), .def = "1", .meta = "S", .lo = 0, .hi = 1L << 62,
     .help = "seeds the routing's draws"},
    {"--context", .kind = MF_OPT_LONG, .off = F(context), .def = "16", .meta = "N", .lo = 1, .hi = 1L << 40,
     .help = "tokens already in each sequence"},
    {"--store", .kind = MF_OPT_WORD, .off = F(store), .def = "resident", .meta = "MODE", .words = mf_tool_store_modes,
     .help = "routed experts resident or streamed from disk through a cache of\n--store-budget bytes"},
    {"--store-budget", .kind = MF_OPT_SIZE, .off = F(store_budget), .meta = "SIZE",
     .help = "the streamed store's cache bytes (default 2G)"},
    {"--tables", .kind = MF_OPT_WORD, .off = F(tables), .def = "resident", .meta = "MODE", .words = mf_tool_store_modes,
     .help = "Engram tables resident or streamed"},
    {"--dev-cache", .kind = MF_OPT_SIZE, .off = F(dev_cache), .meta = "SIZE",
     .help = "expert cache bytes per card (default: every expert the card holds)"},
    {"--dev-cache-fill", .kind = MF_OPT_WORD, .off = F(fill), .def = MF_TOOL_DEV_CACHE_FILL, .meta = "on|off",
     .words = mf_tool_on_off,
     .help = "fill each card's expert cache before the first step (on: a trace\n"
             "routing's most routed experts first, else spread evenly over layers;\n"
             "the fill's time is reported), or start empty (off)"},
    {"--cache-policy", .kind = MF_OPT_WORD, .off = F(policy), .def = "lfu", .meta = "P", .words = mf_tool_cache_policies,
     .help = "lfu (the engine's) or lru"},
    {"--read-window", .kind = MF_OPT_LONG, .off = F(read_window), .meta = "N", .lo = -1, .hi = 4096,
     .flags = MF_OPT_NOT0, .help = "streamed store: slots whose reads are in flight (default 2, -1 all)"},
    {"--copy-slots", .kind = MF_OPT_LONG, .off = F(copy_slots), .meta = "N", .lo = 1, .hi = 64,
     .help = "copy-in streams per card (default 1, the engine's)"},
    {"--dev-task-ns", .kind = MF_OPT_LONG, .off = F(dev_task_ns), .meta = "NS", .lo = 1, .hi = 100000000,
     .help = "emulated cards: host core time per device task, from `moeflow\n"
             "bench devtasks` (default: the profile's card_fp4_latency_ns)"},
    {"--dev-graphs", .kind = MF_OPT_FLAG, .off = F(dev_graphs),
     .help = "a layer's FFNs on a card as one device graph task (the engine's\n"
             "--dev-graphs; also MOEFLOW_DEV_GRAPHS=1)"},
    {"--trace", .kind = MF_OPT_STR, .off = F(trace), .meta = "FILE",
     .help = "Chrome trace of the last simulated step (with --prompt-tokens:\nof the last full chunk)"},
    {"--json", .kind = MF_OPT_FLAG, .off = F(json),
     .help = "one JSON object instead of the tables (its \"ops\": per op the\n"
             "tasks and their work on the CPU lanes and on the other lanes)"},
    {"--ops", .kind = MF_OPT_FLAG, .off = F(ops), .help = "also a table of the work per op (mf_sg_op), largest first\n"
             "(with --spec: the draft round's and the verify's at the largest k)"},
    {"--measure", .kind = MF_OPT_FLAG, .off = F(measure),
     .help = "also decode for real on this machine (a loadable checkpoint;\n"
             "emu:N cards for seed/hybrid) and print measured vs predicted"},
    {"--prompt-tokens", .kind = MF_OPT_LONG, .off = F(prompt_tokens), .meta = "N", .lo = 1, .hi = 1L << 30,
     .help = "instead of decode steps: the time to first token of an N-token\n"
             "prompt, prefilled in chunks of --chunk positions through the\n"
             "engine's serial graph, caches empty at the start (--batch,\n"
             "--steps, --warmup, --context do not apply)"},
    {"--spec", .kind = MF_OPT_WORD, .off = F(spec), .def = "off", .meta = "S", .words = mf_tool_specs,
     .help = "dspark: the speculating engine (docs/dspark.md): per k = 0..N the\n"
             "verify of 1 + k items per sequence (its k candidates in one unit,\n"
             "routed as the sequence's consecutive tokens) and the draft round of\n"
             "the batch, then tokens/s at each --accept with the k the cost model\n"
             "picks (--spec-tokens auto) or N, against k = 0; off: none"},
    {"--spec-tokens", .kind = MF_OPT_FN, .off = F(spec_tokens), .def = "auto", .meta = "N|auto",
     .fn = mf_tool_spec_tokens_opt, .example = "auto",
     .help = "with --spec: candidates per round (N), or auto: the best k of\n"
             "0..dspark_block_size by the cost model (k stops where the batch's\n"
             "items pass " MF_OPTS_STR(MF_STEP_MAX_ITEMS) ")"},
    {"--accept", .kind = MF_OPT_STR, .off = F(accept), .def = "0.6,0.89", .meta = "A,...",
     .help = "with --spec: the acceptance of each candidate given the ones\n"
             "before it accepted (0..1), one result per value"},
    {"--ranks", .kind = MF_OPT_LONG, .off = F(ranks), .meta = "N", .lo = 2, .hi = MF_PIPE_MAX_RANKS,
     .help = "the model split by layers over N hosts of this profile joined by\n"
             "its link (link_bytes_per_s, link_latency_ns; graphs/pipe/pipe.h):\n"
             "each rank's stage simulated at each micro-batch's size, the link's\n"
             "boundaries and logits priced, the step put together as the\n"
             "pipeline runs it (docs/pipeline.md)"},
    {"--ranks-layers", .kind = MF_OPT_STR, .off = F(ranks_layers), .def = "auto", .meta = "L",
     .help = "with --ranks: auto (as moeflow decode --ranks-layers auto, on this\n"
             "profile) or a:b,c:d,..."},
    {"--ranks-micro", .kind = MF_OPT_LONG, .off = F(ranks_micro), .def = "0", .meta = "M", .lo = 0, .hi = 64,
     .help = "with --ranks: micro-batches a step's batch is cut into (0: the ranks)"},
    {"--host-mem", .kind = MF_OPT_SIZE, .off = F(host_mem), .meta = "SIZE",
     .help = "with --ranks: memory a host gives the weights (default: 0.9 of the\n"
             "profile's host_mem_bytes; none: no limit); a rank whose layers do not\n"
             "fit streams its experts (and tables) through what is left"},
    {"--cached", .kind = MF_OPT_LONG, .off = F(cached), .meta = "M", .lo = 0, .hi = 1L << 30,
     .help = "with --prompt-tokens: the first M positions come from the prefix\n"
             "cache (docs/prefix.md): the chunks run positions M..N-1 from M"},
    {"--chunk", .kind = MF_OPT_LONG, .off = F(chunk), .meta = "T", .lo = 1, .hi = MF_STEP_MAX_CHUNK,
     .help = "with --prompt-tokens: positions per chunk (1.." MF_OPTS_STR(MF_STEP_MAX_CHUNK) ", default "
             MF_OPTS_STR(MF_STEP_PREFILL_CHUNK) ",\nthe engine's)"},
    {NULL},
};
#undef F

static const mf_opts_spec mf_sim_spec = {
    .cmd = "sim",
    .usage =
        "usage: moeflow sim --profile P (--checkpoint DIR | --preset NAME) [--placement host|seed|hybrid]\n"
        "                   [--cards N] [--threads N] [--batch B] [--steps N] [--warmup N]\n"
        "                   [--routing uniform|zipf:S|local[:P[:W]]|trace:FILE] [--seed S] [--context N]\n"
        "                   [--store resident|streamed] [--store-budget SIZE] [--tables resident|streamed]\n"
        "                   [--dev-cache SIZE] [--dev-cache-fill on|off] [--cache-policy lfu|lru]\n"
        "                   [--read-window N]\n"
        "                   [--copy-slots N] [--dev-task-ns NS] [--dev-graphs] [--dense host|cards]\n"
        "                   [--dense-split layers|rows] [--heads cost|cards|host] [--cublaslt cost|on|dense|off]\n"
        "                   [--micro-batches 1|2] [--prefetch-min N]\n"
        "                   [--trace FILE] [--json] [--ops]\n"
        "                   [--measure] [--prompt-tokens N [--chunk T] [--cached M]]\n"
        "                   [--spec dspark [--spec-tokens N|auto] [--accept A,...]]\n"
        "                   [--ranks N [--ranks-layers auto|a:b,c:d] [--ranks-micro M] [--host-mem SIZE]]\n\n"
        "Simulates decode steps of the scheduled engine (graphs/step/step.c's graph, docs/sim.md) on the\n"
        "hardware profile P: --warmup steps warm the caches, then --steps are reported: predicted\n"
        "time per token, the phase table, each lane's work and busy share, the bottleneck lane,\n"
        "the expert caches. Only the checkpoint's config.json is read (the sparse flash41 layout\n"
        "works); --preset uses a built-in config instead.\n\n",
    .opts = mf_sim_table,
    .col = 22,
};

/* Per op: its tasks, their work on the CPU lanes and on the others (cards, IO), per step. */
static void mf_sim_json_ops(const mf_plan_report *r)
{
    printf(",\"ops\":{");
    for (int op = 0, k = 0; op < MF_SG_N_OPS; op++)
        if (r->op_tasks[op])
            printf("%s\"%s\":{\"tasks\":%d,\"cpu_work_s\":%.9g,\"other_work_s\":%.9g}", k++ ? "," : "",
                   mf_sg_op_name(op), r->op_tasks[op], r->op_cpu_ns[op] / 1e9, r->op_other_ns[op] / 1e9);
    printf("}");
}

static void mf_sim_print_ops(const mf_plan_report *r)
{
    int order[MF_SG_N_OPS], n = 0;
    for (int op = 0; op < MF_SG_N_OPS; op++)
        if (r->op_tasks[op]) order[n++] = op;
    for (int a = 1; a < n; a++)   /* largest CPU work first, then the other lanes' */
        for (int b = a; b > 0; b--) {
            int x = order[b - 1], y = order[b];
            if (r->op_cpu_ns[x] > r->op_cpu_ns[y] ||
                (r->op_cpu_ns[x] == r->op_cpu_ns[y] && r->op_other_ns[x] >= r->op_other_ns[y]))
                break;
            order[b - 1] = y;
            order[b] = x;
        }
    printf("\n%-16s %8s %14s %14s\n", "op", "tasks", "cpu work ms", "other work ms");
    for (int k = 0; k < n; k++)
        printf("%-16s %8d %14.3f %14.3f\n", mf_sg_op_name(order[k]), r->op_tasks[order[k]],
               r->op_cpu_ns[order[k]] / 1e6, r->op_other_ns[order[k]] / 1e6);
}

static void mf_sim_json(const mf_plan_report *r, const char *routing, int placement, int dense, int split, int measured,
                        double meas_ns, const mf_step_times *mt)
{
    printf("{\"placement\":\"%s\",\"dense\":\"%s\",\"dense_split\":\"%s\",\"routing\":\"%s\",\"batch\":%d,\"steps\":%d,\"step_s\":%.9g,\"token_s\":%.9g,"
           "\"tokens_per_s\":%.6g,\"n_tasks\":%d,\"phases\":{",
           mf_opt_word_name(mf_tool_placements, placement), dense == MF_PLAN_DENSE_CARDS ? "cards" : "host", split == MF_SG_SPLIT_ROWS ? "rows" : "layers", routing, r->batch, r->n_steps, r->step_ns / 1e9, r->token_ns / 1e9,
           r->token_ns > 0 ? 1e9 / r->token_ns : 0, r->n_tasks);
    for (int q = 0; q < MF_STEP_N_PHASES; q++)
        printf("%s\"%s\":%.9g", q ? "," : "", mf_step_phase_name((mf_step_phase)q), r->phase_ns[q] / 1e9);
    printf("},\"lanes\":[");
    for (int l = 0; l < r->n_lanes; l++)
        printf("%s{\"name\":\"%s\",\"slots\":%d,\"work_s\":%.9g,\"busy\":%.6g}", l ? "," : "", r->lanes[l].name,
               r->lanes[l].slots, r->lanes[l].busy_ns / 1e9, r->lanes[l].share);
    printf("],\"bottleneck\":\"%s\",\"dev_slots\":%" PRId64 ",\"host_slots\":%" PRId64 ",\"dev_hits\":%" PRIu64
           ",\"dev_misses\":%" PRIu64 ",\"store_hits\":%" PRIu64 ",\"store_misses\":%" PRIu64
           ",\"host_bufs_bytes\":%.0f,\"card_bufs_bytes\":%.0f,\"card_weights_bytes\":%.0f",
           r->lanes[r->bottleneck].name, r->dev_slots, r->host_slots, r->dev_hits, r->dev_misses, r->store_hits,
           r->store_misses, r->host_bufs, r->card_bufs, r->card_weights);
    mf_sim_json_ops(r);
    if (measured) {
        printf(",\"measured_token_s\":%.9g,\"ratio\":%.6g,\"measured_phases\":{", meas_ns / 1e9,
               r->token_ns / meas_ns);
        for (int q = 0; q < MF_STEP_N_PHASES; q++)
            printf("%s\"%s\":%.9g", q ? "," : "", mf_step_phase_name((mf_step_phase)q), mt->phase_ns[q] / 1e9);
        printf("}");
    }
    printf("}\n");
}

/* --prompt-tokens: the predicted time to first token of a chunked prefill. */
static int mf_sim_prefill(const mf_sim_cli *a, const mf_plan_opts *po, const mf_profile *prof, mf_routing *rt)
{
    mf_plan_report rep;
    int64_t ttft_ns;
    int T = a->chunk ? (int)a->chunk : MF_STEP_PREFILL_CHUNK, rc;
    const char *placement = mf_opt_word_name(mf_tool_placements, a->placement);
    if ((rc = mf_plan_prefill_at(po, a->cached, a->prompt_tokens, T, &rep, &ttft_ns, a->trace))) return rc;
    double tps = (a->prompt_tokens - a->cached) / (ttft_ns / 1e9);
    if (a->json) {
        printf("{\"placement\":\"%s\",\"routing\":\"%s\",\"prompt_tokens\":%ld,\"cached\":%ld,\"chunk\":%d,"
               "\"ttft_s\":%.9g,\"prefill_tokens_per_s\":%.6g,\"chunk_s\":%.9g,\"bottleneck\":\"%s\"",
               placement, mf_routing_describe(rt), a->prompt_tokens, a->cached, T, ttft_ns / 1e9, tps,
               rep.step_ns / 1e9, rep.lanes[rep.bottleneck].name);
        printf(",\"phases\":{");
        for (int q = 0; q < MF_STEP_N_PHASES; q++)
            printf("%s\"%s\":{\"wall_s\":%.9g,\"work_s\":%.9g}", q ? "," : "",
                   mf_step_phase_name((mf_step_phase)q), rep.phase_ns[q] / 1e9, rep.busy_ns[q] / 1e9);
        printf("},\"lanes\":[");
        for (int l = 0; l < rep.n_lanes; l++)
            printf("%s{\"name\":\"%s\",\"slots\":%d,\"work_s\":%.9g,\"busy\":%.6g}", l ? "," : "",
                   rep.lanes[l].name, rep.lanes[l].slots, rep.lanes[l].busy_ns / 1e9, rep.lanes[l].share);
        printf("]");
        mf_sim_json_ops(&rep);
        printf("}\n");
        return 0;
    }
    printf("sim: %s on profile %s, placement %s, routing %s: prefill of %ld tokens in chunks of %d", a->dir ? a->dir : a->preset,
           prof->name, placement, mf_routing_describe(rt), a->prompt_tokens - a->cached, T);
    if (a->cached) printf(" after %ld cached (a %ld-token prompt)", a->cached, a->prompt_tokens);
    printf("\ntime to first token: %.3f s (%.1f prompt tokens/s); per chunk (mean of the full chunks; "
           "per token = per prompt position):\n", ttft_ns / 1e9, tps);
    mf_plan_print(&rep, stdout);
    if (a->ops) mf_sim_print_ops(&rep);
    if (a->trace) printf("trace of the last full chunk: %s\n", a->trace);
    return 0;
}

/* Decode steps: warm-up, then the reported steps; the trace of the last. */
static int mf_sim_steps(const mf_sim_cli *a, const mf_plan_opts *po, mf_plan_report *rep)
{
    mf_plan *p = NULL;
    int rc = mf_plan_new(po, &p);
    for (long k = 0; k < a->warmup && !rc; k++) rc = mf_plan_step(p, NULL);
    if (!rc) mf_plan_reset_totals(p);
    for (long k = 0; k < a->steps && !rc; k++) rc = mf_plan_step(p, NULL);
    if (!rc) mf_plan_total(p, rep);
    if (!rc && a->trace) rc = mf_plan_write_trace(p, a->trace);
    mf_plan_free(p);
    return rc;
}

/* The decode steps' tables: the plan's, per op, the dense weights per card, measured vs predicted. */
static void mf_sim_text(const mf_sim_cli *a, const mf_plan_opts *po, const mf_plan_report *rep, mf_routing *rt,
                        double meas_ns, const mf_step_times *mt)
{
    const mf_profile *prof = po->profile;
    int cards_dense = po->dense == MF_PLAN_DENSE_CARDS, rows = a->dense_split == MF_SG_SPLIT_ROWS;
    printf("sim: %s on profile %s, placement %s, dense %s, routing %s, batch %ld, %ld warm-up + %ld steps\n",
           a->dir ? a->dir : a->preset, prof->name, mf_opt_word_name(mf_tool_placements, a->placement),
           !cards_dense ? "host" : rows ? "cards (rows)" : "cards", mf_routing_describe(rt), a->batch, a->warmup,
           a->steps);
    mf_plan_print(rep, stdout);
    if (a->ops) mf_sim_print_ops(rep);
    mf_sg_sizes *sz = NULL;
    int nd = (int)(a->cards ? a->cards : prof->n_cards);
    if (cards_dense && !mf_sg_sizes_new(po->config, &sz)) {   /* mf_sg_dense_card_bytes */
        printf("dense weights per card (%s):", rows ? "split by rows" : "by layers");
        for (int cd = 0; cd < nd; cd++)
            printf(" %.2f GB", mf_sg_dense_card_bytes(po->config, sz, nd, a->dense_split, rep->card_in_whole, cd) / 1e9);
        printf(" (of %.2f GB each)\n", prof->card_mem_bytes / 1e9);
        mf_sg_sizes_free(sz);
    }
    if (a->trace) printf("trace of the last simulated step: %s\n", a->trace);
    if (!a->measure) return;
    printf("\nmeasured on this machine (real engine%s, median of %ld steps): %.3f ms per token\n",
           a->placement == MF_STEP_PLACE_HOST ? "" : ", emulated cards", a->steps, meas_ns / 1e6);
    printf("%-16s %12s %12s\n", "phase", "measured ms", "predicted ms");
    for (int q = 0; q < MF_STEP_N_PHASES; q++)
        printf("%-16s %12.3f %12.3f\n", mf_step_phase_name((mf_step_phase)q), mt->phase_ns[q] / 1e6,
               rep->phase_ns[q] / 1e6);
    printf("per token: predicted %.3f ms, measured %.3f ms, predicted / measured = %.3f\n",
           rep->token_ns / 1e6, meas_ns / 1e6, rep->token_ns / meas_ns);
}

/* --spec: the verify and draft prices per k (mf_spec_sim), then per acceptance the k and tokens/s. */
static int mf_sim_spec_run(const mf_sim_cli *a, const mf_plan_opts *po, mf_routing *rt)
{
    double acc[16], v[MF_SPEC_MAX + 1], d[MF_SPEC_MAX + 1];
    int n_acc = 0, n_k = 0, n_max = a->spec_tokens ? (int)a->spec_tokens : po->config->dspark_block_size;
    for (const char *p = a->accept; *p && n_acc < 16;) {
        char *end;
        double x = strtod(p, &end);
        if (end == p || x < 0 || x > 1 || (*end && *end != ','))
            return mf_error(-EINVAL, "--accept: expected acceptances in [0, 1] separated by commas, found '%s'", a->accept);
        acc[n_acc++] = x;
        p = *end ? end + 1 : end;
    }
    int rc = mf_spec_sim(po, n_max, (int)a->warmup, (int)a->steps, v, d, &n_k);
    if (rc) return rc;
    double b = po->batch ? po->batch : 1;
    if (a->json) printf("{\"spec\":{\"routing\":\"%s\",\"batch\":%.0f,\"prices\":[", mf_routing_describe(rt), b);
    else printf("sim --spec dspark: %s, routing %s, batch %.0f: a step of 1 + k items per sequence and the draft round "
                "of the batch (ms)\n%-4s %12s %12s\n", a->dir ? a->dir : a->preset, mf_routing_describe(rt), b, "k",
                "verify", "draft");
    for (int k = 0; k <= n_k; k++)
        if (a->json) printf("%s{\"k\":%d,\"verify_s\":%.9g,\"draft_s\":%.9g}", k ? "," : "", k, v[k] / 1e9, d[k] / 1e9);
        else printf("%-4d %12.3f %12.3f\n", k, v[k] / 1e6, d[k] / 1e6);
    if (a->json) printf("],\"by_acceptance\":[");
    for (int j = 0; j < n_acc; j++) {
        double al[MF_SPEC_MAX + 1], gain;
        for (int k = 0; k <= n_k; k++) al[k] = acc[j];
        int k = a->spec_tokens ? (n_max < n_k ? n_max : n_k) : mf_spec_choose(v, d, al, n_k, &gain);
        double e = 1, p = 1;
        for (int i = 1; i <= k; i++) e += p *= acc[j];
        double tps = b * e / ((v[k] + d[k]) / 1e9), plain = b / (v[0] / 1e9);
        if (a->json)
            printf("%s{\"acceptance\":%.6g,\"k\":%d,\"tokens_per_round\":%.6g,\"tokens_per_s\":%.6g,"
                   "\"plain_tokens_per_s\":%.6g,\"speedup\":%.6g}", j ? "," : "", acc[j], k, e, tps, plain, tps / plain);
        else
            printf("acceptance %.2f: k %d (%s), %.2f tokens per round, %.2f tokens/s against %.2f without "
                   "speculation: %.3fx\n", acc[j], k, a->spec_tokens ? "fixed" : "the cost model's", e, tps, plain,
                   tps / plain);
    }
    if (a->json) printf("]}}\n");
    if (a->ops && !a->json && n_k) {   /* the work per op of the draft round of k n_k and of its verify */
        for (int w = 0; w < 2 && !rc; w++) {
            mf_plan_opts o = mf_spec_sim_plan(po, n_k, !w);   /* as mf_spec_sim's */
            mf_plan_report r;
            if ((rc = mf_plan_run(&o, (int)a->warmup, (int)a->steps, &r))) break;
            if (w) printf("\nthe verify of 1 + %d items a sequence:\n", n_k);
            else printf("\nthe draft round of %d candidates for %d sequences:\n", n_k, o.batch);
            mf_plan_print(&r, stdout);
            mf_sim_print_ops(&r);
        }
    }
    return rc;
}

/* --ranks: the split (auto on this profile, or the ranges) simulated as a pipeline of hosts. */
static int mf_sim_ranks(mf_sim_cli *a, mf_plan_opts *po, mf_routing *rt)
{
    const mf_config *c = po->config;
    const mf_profile *prof = po->profile;
    mf_pipe_split sp;
    double mem = a->host_mem ? (double)a->host_mem : 0.9 * (double)prof->host_mem_bytes;
    int rc, n = (int)a->ranks;
    if (strcmp(a->ranks_layers, "auto")) {
        rc = mf_pipe_split_parse(c, a->ranks_layers, n, &sp);
    } else {
        double bytes[MF_CONFIG_MAX_LAYERS + 2], ns[MF_CONFIG_MAX_LAYERS + 2];
        int thr = (int)(a->threads ? a->threads : prof->threads_per_socket) * prof->n_sockets;
        rc = mf_pipe_layer_costs(c, prof, thr, bytes, ns);
        if (!rc) rc = mf_pipe_split_auto(c, bytes, ns, n, mem, &sp);
    }
    mf_plan_ranks_report r;
    if (!rc)
        rc = mf_plan_ranks_run(&(mf_plan_ranks_opts){.host = po, .split = sp, .micro = (int)a->ranks_micro,
                                                     .warmup = (int)a->warmup, .steps = (int)a->steps,
                                                     .host_mem_bytes = mem}, &r);
    if (rc) return rc;
    if (a->json) {
        mf_plan_ranks_json(&r, stdout);
        return 0;
    }
    char s[256];
    mf_pipe_split_str(&sp, s, sizeof s);
    printf("sim: %s over %d hosts of profile %s (link %.3g Gb/s, %.0f us a message; %.0f GiB for weights each), "
           "layers %s, placement %s, routing %s, %ld warm-up + %ld steps\n", a->dir ? a->dir : a->preset, n,
           prof->name, prof->link_bytes_per_s * 8 / 1e9, prof->link_latency_ns / 1e3, mem / 1073741824.0, s,
           mf_opt_word_name(mf_tool_placements, a->placement), mf_routing_describe(rt), a->warmup, a->steps);
    mf_plan_ranks_print(&r, stdout);
    return 0;
}

/* The options that cannot go together; 0 or 2 (said on stderr). */
static int mf_sim_check(const mf_sim_cli *a)
{
    if (!a->prof_path || (!a->dir == !a->preset))
        return mf_opts_refuse(&mf_sim_spec, "--profile P and one of --checkpoint DIR or --preset NAME are required");
    if (a->prompt_tokens && a->measure) {
        fprintf(stderr, "moeflow sim: --prompt-tokens predicts a prefill; --measure measures decode steps: "
                        "use `moeflow bench decode --prompt-tokens N` for the measured prefill\n");
        return 2;
    }
    if (a->cached && (!a->prompt_tokens || a->cached >= a->prompt_tokens)) {
        fprintf(stderr, "moeflow sim: --cached M applies to --prompt-tokens N with M < N (a token is left to run)\n");
        return 2;
    }
    if (a->chunk && !a->prompt_tokens) {
        fprintf(stderr, "moeflow sim: --chunk applies to --prompt-tokens\n");
        return 2;
    }
    if (a->spec && (a->measure || a->prompt_tokens || a->spec == MF_TOOL_SPEC_PERFECT)) {
        fprintf(stderr, "moeflow sim: --spec dspark prices decode steps: not with --measure or --prompt-tokens "
                        "(and perfect is bench decode's)\n");
        return 2;
    }
    if (a->ranks && a->spec) {
        fprintf(stderr, "moeflow sim: --spec prices one host's engine (not with --ranks)\n");
        return 2;
    }
    if (a->ranks && (a->measure || a->prompt_tokens || a->trace)) {
        fprintf(stderr, "moeflow sim: --ranks simulates decode steps (not with --measure, --prompt-tokens, --trace)\n");
        return 2;
    }
    if (a->measure && !a->dir) {
        fprintf(stderr, "moeflow sim: --measure decodes for real: it needs --checkpoint DIR\n");
        return 2;
    }
    return 0;
}

/* Simulates (and with --measure decodes) as the options say. 0 or a negative code. */
static int mf_sim_run(mf_sim_cli *a)
{
    static mf_profile prof;
    mf_config cfg;
    mf_routing *rt = NULL;
    int rc = mf_tool_plan_inputs(a->prof_path, a->dir, a->preset, &prof, &cfg);
    if (!rc) rc = mf_routing_open(a->routing_spec, cfg.n_layers, cfg.n_routed_experts, cfg.n_experts_per_tok,
                                  (uint64_t)a->seed, &rt);
    if (rc) return rc;
    if (a->dense < 0) a->dense = a->cards || a->placement != MF_STEP_PLACE_HOST ? MF_PLAN_DENSE_CARDS : MF_PLAN_DENSE_HOST;
    mf_plan_opts po = {.config = &cfg, .profile = &prof, .placement = a->placement, .n_cards = (int)a->cards,
                       .threads_per_socket = (int)a->threads, .batch = (int)a->batch, .context = a->context,
                       .read_window = (int)a->read_window, .copy_slots = (int)a->copy_slots,
                       .dev_cache_bytes = a->dev_cache, .dev_cache_policy = a->policy, .dev_cache_fill = a->fill,
                       .store = a->store, .store_budget_bytes = a->store_budget, .tables = a->tables, .routing = rt,
                       .seed = (uint64_t)a->seed, .dev_task_ns = (double)a->dev_task_ns, .dev_graphs = a->dev_graphs,
                       .dense = a->dense, .dense_split = a->dense_split, .in_split = a->in_split, .heads = a->heads, .micro = (int)a->micro,
                       .prefetch_min = (int)a->prefetch_min, .lt = a->lt};
    mf_plan_report rep;
    double meas_ns = 0;
    mf_step_times mt = {0};
    if (a->spec) {
        rc = mf_sim_spec_run(a, &po, rt);
    } else if (a->ranks) {
        rc = mf_sim_ranks(a, &po, rt);
    } else if (a->prompt_tokens) {
        rc = mf_sim_prefill(a, &po, &prof, rt);
    } else if (!(rc = mf_sim_steps(a, &po, &rep))) {
        int n_threads = (int)(a->threads ? a->threads : prof.threads_per_socket) * prof.n_sockets;
        int n_cards = (int)(a->cards ? a->cards : prof.n_cards);
        if (a->measure) rc = mf_tool_measure(a->dir, &po, n_cards, n_threads, (int)a->warmup, (int)a->steps, &meas_ns, &mt);
        if (!rc && a->json)
            mf_sim_json(&rep, mf_routing_describe(rt), a->placement, a->dense, a->dense_split, a->measure, meas_ns, &mt);
        else if (!rc)
            mf_sim_text(a, &po, &rep, rt, meas_ns, &mt);
    }
    mf_routing_free(rt);
    return rc;
}

int mf_cmd_sim(int argc, char **argv)
{
    mf_sim_cli a = {.dense = -1, .dev_graphs = mf_tool_env_on("MOEFLOW_DEV_GRAPHS")};   /* --dev-graphs */
    int rc = mf_opts_parse(&mf_sim_spec, argc, argv, &a);
    if (rc != MF_OPTS_RUN) return rc;
    if ((rc = mf_sim_check(&a))) return rc;
    if (mf_sim_run(&a)) {
        fprintf(stderr, "moeflow sim: %s\n", mf_last_error()[0] ? mf_last_error() : "failed");
        return 1;
    }
    return 0;
}
