/* `moeflow sim`: simulates decode steps of the scheduled engine on a hardware profile
 * (graphs/sim/plan.h): the predicted per-token time, the phase table, each lane's busy share and the
 * bottleneck, the caches, the Chrome trace of the last step. --measure also runs the real engine
 * (graphs/step/step.h) with the same settings on this machine and prints measured vs predicted. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/dev.h"
#include "graphs/model/config.h"
#include "graphs/model/model.h"
#include "graphs/sim/plan.h"
#include "graphs/step/stepgraph.h"
#include "graphs/ref/ref.h"
#include "graphs/sim/routing.h"
#include "graphs/step/sample.h"
#include "graphs/step/step.h"
#include "sched/error.h"
#include "sched/profile.h"
#include "tools/commands.h"
#include "tools/sim_common.h"

static void mf_sim_usage(FILE *f)
{
    fprintf(f,
            "usage: moeflow sim --profile P (--checkpoint DIR | --preset NAME) [--placement host|seed|hybrid]\n"
            "                   [--cards N] [--threads N] [--batch B] [--steps N] [--warmup N]\n"
            "                   [--routing uniform|zipf:S|trace:FILE] [--seed S] [--context N]\n"
            "                   [--store resident|streamed] [--store-budget SIZE] [--tables resident|streamed]\n"
            "                   [--dev-cache SIZE] [--dev-cache-fill on|off] [--cache-policy lfu|lru] [--read-window N]\n"
            "                   [--copy-slots N] [--dev-task-ns NS] [--dev-graphs] [--dense host|cards]\n"
            "                   [--dense-split layers|rows] [--heads cost|cards|host]\n"
            "                   [--micro-batches 1|2] [--prefetch-min N]\n"
            "                   [--trace FILE] [--json] [--ops]\n"
            "                   [--measure] [--prompt-tokens N [--chunk T]]\n\n"
            "Simulates decode steps of the scheduled engine (graphs/step/step.c's graph, docs/sim.md) on the\n"
            "hardware profile P: --warmup steps (default 2) warm the caches, then --steps (default 8)\n"
            "are reported: predicted time per token, the phase table, each lane's work and busy share,\n"
            "the bottleneck lane, the expert caches. Only the checkpoint's config.json is read (the\n"
            "sparse flash41 layout works); --preset uses a built-in config instead.\n\n"
            "  --placement P       host (default), seed or hybrid (routed experts on cards)\n"
            "  --cards N           cards for seed/hybrid and --dense cards (default: the profile's)\n"
            "  --dense D           the dense work (attention linears, router gate, shared expert,\n"
            "                      head) on the host or on the cards (default: cards when --cards is\n"
            "                      given or placement is seed/hybrid, else host)\n"
            "  --dense-split S     dense cards: layers (each layer's dense work on one card, by layer\n"
            "                      ranges) or rows (default: every dense matrix but the shared expert\n"
            "                      split by output rows across all cards)\n"
            "  --heads H           dense cards: the attention heads' scores and values of a serial graph\n"
            "                      (a prefill chunk, batch 1) per layer by the cost model (cost, the\n"
            "                      default), on the cards wherever they can, or on the host\n"
            "  --prefetch-min N    a prefill chunk of at least N positions places each layer's\n"
            "                      experts at the layer's start and copies the cards' ones in\n"
            "                      while its attention runs (0, the default: from the length at\n"
            "                      which every expert is expected used, 378 on flash41; -1: never)\n"
            "  --micro-batches M   2: two micro-batches in flight (batch >= 2; the engine's\n"
            "                      --micro-batches), 1: one (default)\n"
            "  --threads N         engine workers per socket (default: the profile's)\n"
            "  --batch B           sequences per step (1..%d, default 1)\n"
            "  --routing R         uniform (default), zipf:S, or trace:FILE (moeflow decode\n"
            "                      --record-routing); --seed S seeds the draws (default 1)\n"
            "  --context N         tokens already in each sequence (default 16)\n"
            "  --store MODE        routed experts resident (default) or streamed from disk through\n"
            "                      a cache of --store-budget bytes (default 2G)\n"
            "  --tables MODE       Engram tables resident (default) or streamed\n"
            "  --dev-cache SIZE    expert cache bytes per card (default: every expert the card holds)\n"
            "  --dev-cache-fill on|off  fill each card's expert cache before the first step (on,\n"
            "                      the default: a trace routing's most routed experts first, else\n"
            "                      spread evenly over layers; the fill's time is reported), or start\n"
            "                      empty (off)\n"
            "  --cache-policy P    lfu (default, the engine's) or lru\n"
            "  --read-window N     streamed store: slots whose reads are in flight (default 2, -1 all)\n"
            "  --copy-slots N      copy-in streams per card (default 1, the engine's)\n"
            "  --dev-task-ns NS    emulated cards: host core time per device task, from `moeflow\n"
            "                      bench devtasks` (default: the profile's card_fp4_latency_ns)\n"
            "  --dev-graphs        a layer's FFNs on a card as one device graph task (the engine's\n"
            "                      --dev-graphs; also MOEFLOW_DEV_GRAPHS=1)\n"
            "  --trace FILE        Chrome trace of the last simulated step (with --prompt-tokens:\n"
            "                      of the last full chunk)\n"
            "  --json              one JSON object instead of the tables (its \"ops\": per op the\n"
            "                      tasks and their work on the CPU lanes and on the other lanes)\n"
            "  --ops               also a table of the work per op (mf_sg_op), largest first\n"
            "  --measure           also decode for real on this machine (a loadable checkpoint;\n"
            "                      emu:N cards for seed/hybrid) and print measured vs predicted\n"
            "  --prompt-tokens N   instead of decode steps: the time to first token of an N-token\n"
            "                      prompt, prefilled in chunks of --chunk T positions (1..%d,\n"
            "                      default %d, the engine's) through the engine's serial graph,\n"
            "                      caches empty at the start (--batch, --steps, --warmup, --context\n"
            "                      do not apply)\n",
            MF_STEP_MAX_ITEMS, MF_STEP_MAX_CHUNK, MF_STEP_PREFILL_CHUNK);
}

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
    static const char *const pl[] = {"host", "seed", "hybrid"};
    printf("{\"placement\":\"%s\",\"dense\":\"%s\",\"dense_split\":\"%s\",\"routing\":\"%s\",\"batch\":%d,\"steps\":%d,\"step_s\":%.9g,\"token_s\":%.9g,"
           "\"tokens_per_s\":%.6g,\"n_tasks\":%d,\"phases\":{",
           pl[placement], dense == MF_PLAN_DENSE_CARDS ? "cards" : "host", split == MF_SG_SPLIT_ROWS ? "rows" : "layers", routing, r->batch, r->n_steps, r->step_ns / 1e9, r->token_ns / 1e9,
           r->token_ns > 0 ? 1e9 / r->token_ns : 0, r->n_tasks);
    for (int q = 0; q < MF_STEP_N_PHASES; q++)
        printf("%s\"%s\":%.9g", q ? "," : "", mf_step_phase_name((mf_step_phase)q), r->phase_ns[q] / 1e9);
    printf("},\"lanes\":[");
    for (int l = 0; l < r->n_lanes; l++)
        printf("%s{\"name\":\"%s\",\"slots\":%d,\"work_s\":%.9g,\"busy\":%.6g}", l ? "," : "", r->lanes[l].name,
               r->lanes[l].slots, r->lanes[l].busy_ns / 1e9, r->lanes[l].share);
    printf("],\"bottleneck\":\"%s\",\"dev_slots\":%" PRId64 ",\"host_slots\":%" PRId64 ",\"dev_hits\":%" PRIu64
           ",\"dev_misses\":%" PRIu64 ",\"store_hits\":%" PRIu64 ",\"store_misses\":%" PRIu64,
           r->lanes[r->bottleneck].name, r->dev_slots, r->host_slots, r->dev_hits, r->dev_misses, r->store_hits,
           r->store_misses);
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

int mf_cmd_sim(int argc, char **argv)
{
    const char *prof_path = NULL, *dir = NULL, *preset = NULL, *routing_spec = "uniform", *trace = NULL;
    const char *placement = "host", *dense_s = NULL;
    int dense_split = MF_TOOL_DENSE_SPLIT, heads = MF_SG_HEADS_COST;
    long cards = 0, threads = 0, batch = 1, steps = 8, warmup = 2, seed = 1, context = 16, read_window = 0;
    long copy_slots = 0, dev_task_ns = 0, prompt_tokens = 0, chunk = 0;
    int json = 0, ops = 0, measure = 0, store = MF_PLAN_STORE_RESIDENT, tables = MF_PLAN_STORE_RESIDENT, policy = 0;
    int dev_graphs = mf_tool_env_on("MOEFLOW_DEV_GRAPHS");   /* --dev-graphs */
    long micro = 1, prefetch_min = 0;
    uint64_t store_budget = 0, dev_cache = 0;
    int fill = MF_TOOL_DEV_CACHE_FILL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int hv = i + 1 < argc;
        char *end = NULL;
        struct { const char *name; long *v; long lo, hi; } nums[] = {
            {"--cards", &cards, 1, 16}, {"--threads", &threads, 1, 256}, {"--batch", &batch, 1, MF_STEP_MAX_ITEMS},
            {"--steps", &steps, 1, 100000}, {"--warmup", &warmup, 0, 100000}, {"--seed", &seed, 0, 1L << 62},
            {"--context", &context, 1, 1L << 40}, {"--read-window", &read_window, -1, 4096},
            {"--copy-slots", &copy_slots, 1, 64}, {"--dev-task-ns", &dev_task_ns, 1, 100000000},
            {"--prompt-tokens", &prompt_tokens, 1, 1L << 30}, {"--chunk", &chunk, 1, MF_STEP_MAX_CHUNK},
        };
        int k = 0;
        while (k < (int)(sizeof nums / sizeof nums[0]) && strcmp(a, nums[k].name)) k++;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            mf_sim_usage(stdout);
            return 0;
        } else if (k < (int)(sizeof nums / sizeof nums[0]) && hv) {
            *nums[k].v = strtol(argv[++i], &end, 10);
            if (*end || !*argv[i] || *nums[k].v < nums[k].lo || *nums[k].v > nums[k].hi ||
                (nums[k].v == &read_window && !read_window)) {
                fprintf(stderr, "moeflow sim: %s: expected %ld..%ld%s, found '%s'\n", a, nums[k].lo, nums[k].hi,
                        nums[k].v == &read_window ? " (not 0)" : "", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--profile") && hv) {
            prof_path = argv[++i];
        } else if (!strcmp(a, "--checkpoint") && hv) {
            dir = argv[++i];
        } else if (!strcmp(a, "--preset") && hv) {
            preset = argv[++i];
        } else if (!strcmp(a, "--routing") && hv) {
            routing_spec = argv[++i];
        } else if (!strcmp(a, "--trace") && hv) {
            trace = argv[++i];
        } else if (!strcmp(a, "--dense") && hv) {
            dense_s = argv[++i];
            if (mf_tool_dense(dense_s) < 0) {
                fprintf(stderr, "moeflow sim: --dense: expected host or cards, found '%s'\n", dense_s);
                return 2;
            }
        } else if (!strcmp(a, "--heads") && hv) {
            if ((heads = mf_tool_heads(argv[++i])) < 0) {
                fprintf(stderr, "moeflow sim: --heads: expected cost, cards or host, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--dense-split") && hv) {
            if ((dense_split = mf_tool_dense_split(argv[++i])) < 0) {
                fprintf(stderr, "moeflow sim: --dense-split: expected layers or rows, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--placement") && hv) {
            placement = argv[++i];
            if (mf_tool_placement(placement) < 0) {
                fprintf(stderr, "moeflow sim: --placement: expected host, seed or hybrid, found '%s'\n", placement);
                return 2;
            }
        } else if ((!strcmp(a, "--store") || !strcmp(a, "--tables")) && hv) {
            const char *v = argv[++i];
            int mode = mf_tool_store_mode(v);
            if (mode < 0) {
                fprintf(stderr, "moeflow sim: %s: expected resident or streamed, found '%s'\n", a, v);
                return 2;
            }
            *(!strcmp(a, "--store") ? &store : &tables) = mode;
        } else if ((!strcmp(a, "--store-budget") || !strcmp(a, "--dev-cache")) && hv) {
            uint64_t v = mf_tool_size(argv[++i]);
            if (!v) {
                fprintf(stderr, "moeflow sim: %s: expected a size such as 2G or 512M, found '%s'\n", a, argv[i]);
                return 2;
            }
            *(!strcmp(a, "--store-budget") ? &store_budget : &dev_cache) = v;
        } else if (!strcmp(a, "--dev-cache-fill") && hv) {
            if ((fill = mf_tool_on_off(argv[++i])) < 0) {
                fprintf(stderr, "moeflow sim: --dev-cache-fill: expected on or off, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--cache-policy") && hv) {
            const char *v = argv[++i];
            policy = mf_tool_cache_policy(v);
            if (policy < 0) {
                fprintf(stderr, "moeflow sim: --cache-policy: expected lfu or lru, found '%s'\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (!strcmp(a, "--ops")) {
            ops = 1;
        } else if (!strcmp(a, "--measure")) {
            measure = 1;
        } else if (!strcmp(a, "--dev-graphs")) {
            dev_graphs = 1;
        } else if (!strcmp(a, "--prefetch-min") && hv) {
            char *end;
            prefetch_min = strtol(argv[++i], &end, 10);
            if (*end || prefetch_min < -1 || prefetch_min > MF_STEP_MAX_CHUNK) {
                fprintf(stderr, "moeflow sim: --prefetch-min: expected -1..%d, found '%s'\n", MF_STEP_MAX_CHUNK, argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--micro-batches") && hv) {
            char *end;
            micro = strtol(argv[++i], &end, 10);
            if (*end || (micro != 1 && micro != 2)) {
                fprintf(stderr, "moeflow sim: --micro-batches: expected 1 or 2, found '%s'\n", argv[i]);
                return 2;
            }
        } else {
            fprintf(stderr, "moeflow sim: unknown or incomplete option '%s'\n\n", a);
            mf_sim_usage(stderr);
            return 2;
        }
    }
    if (!prof_path || (!dir == !preset)) {
        fprintf(stderr, "moeflow sim: --profile P and one of --checkpoint DIR or --preset NAME are required\n\n");
        mf_sim_usage(stderr);
        return 2;
    }
    if (prompt_tokens && measure) {
        fprintf(stderr, "moeflow sim: --prompt-tokens predicts a prefill; --measure measures decode steps: "
                        "use `moeflow bench decode --prompt-tokens N` for the measured prefill\n");
        return 2;
    }
    if (chunk && !prompt_tokens) {
        fprintf(stderr, "moeflow sim: --chunk applies to --prompt-tokens\n");
        return 2;
    }
    if (measure && !dir) {
        fprintf(stderr, "moeflow sim: --measure decodes for real: it needs --checkpoint DIR\n");
        return 2;
    }
    int place = mf_tool_placement(placement);
    int dense = dense_s ? mf_tool_dense(dense_s) : cards || place != MF_STEP_PLACE_HOST ? MF_PLAN_DENSE_CARDS
                                                                                        : MF_PLAN_DENSE_HOST;
    static mf_profile prof;
    mf_config cfg;
    mf_routing *rt = NULL;
    mf_plan *p = NULL;
    int ret = 1, rc;
    if ((rc = mf_tool_plan_inputs(prof_path, dir, preset, &prof, &cfg))) goto fail;
    if ((rc = mf_routing_open(routing_spec, cfg.n_layers, cfg.n_routed_experts, cfg.n_experts_per_tok,
                              (uint64_t)seed, &rt)))
        goto fail;
    mf_plan_opts po = {.config = &cfg, .profile = &prof, .placement = place, .n_cards = (int)cards,
                       .threads_per_socket = (int)threads, .batch = (int)batch, .context = context,
                       .read_window = (int)read_window, .copy_slots = (int)copy_slots, .dev_cache_bytes = dev_cache,
                       .dev_cache_policy = policy, .dev_cache_fill = fill, .store = store,
                       .store_budget_bytes = store_budget, .tables = tables, .routing = rt, .seed = (uint64_t)seed, .dev_task_ns = (double)dev_task_ns,
                       .dev_graphs = dev_graphs, .dense = dense,
                       .dense_split = dense_split, .heads = heads, .micro = (int)micro,
                       .prefetch_min = (int)prefetch_min};
    if (prompt_tokens) {
        mf_plan_report rep;
        int64_t ttft_ns;
        int T = chunk ? (int)chunk : MF_STEP_PREFILL_CHUNK;
        if ((rc = mf_plan_prefill_trace(&po, prompt_tokens, T, &rep, &ttft_ns, trace))) goto fail;
        double tps = prompt_tokens / (ttft_ns / 1e9);
        if (json) {
            printf("{\"placement\":\"%s\",\"routing\":\"%s\",\"prompt_tokens\":%ld,\"chunk\":%d,"
                   "\"ttft_s\":%.9g,\"prefill_tokens_per_s\":%.6g,\"chunk_s\":%.9g,\"bottleneck\":\"%s\"",
                   placement, mf_routing_describe(rt), prompt_tokens, T, ttft_ns / 1e9, tps, rep.step_ns / 1e9,
                   rep.lanes[rep.bottleneck].name);
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
        } else {
            printf("sim: %s on profile %s, placement %s, routing %s: prefill of %ld tokens in chunks of %d\n",
                   dir ? dir : preset, prof.name, placement, mf_routing_describe(rt), prompt_tokens, T);
            printf("time to first token: %.3f s (%.1f prompt tokens/s); per chunk (mean of the full chunks; "
                   "per token = per prompt position):\n", ttft_ns / 1e9, tps);
            mf_plan_print(&rep, stdout);
            if (ops) mf_sim_print_ops(&rep);
            if (trace) printf("trace of the last full chunk: %s\n", trace);
        }
        ret = 0;
        goto out;
    }
    if ((rc = mf_plan_new(&po, &p))) goto fail;
    for (long k = 0; k < warmup && !rc; k++) rc = mf_plan_step(p, NULL);
    mf_plan_reset_totals(p);
    for (long k = 0; k < steps && !rc; k++) rc = mf_plan_step(p, NULL);
    if (rc) goto fail;
    mf_plan_report rep;
    mf_plan_total(p, &rep);
    if (trace && (rc = mf_plan_write_trace(p, trace))) goto fail;
    double meas_ns = 0;
    mf_step_times mt = {0};
    if (measure) {
        int n_threads = (int)(threads ? threads : prof.threads_per_socket) * prof.n_sockets;
        int n_cards = (int)(cards ? cards : prof.n_cards);
        if ((rc = mf_tool_measure(dir, &po, n_cards, n_threads, (int)warmup, (int)steps, &meas_ns, &mt)))
            goto fail;
    }
    if (json) {
        mf_sim_json(&rep, mf_routing_describe(rt), place, dense, dense_split, measure, meas_ns, &mt);
    } else {
        printf("sim: %s on profile %s, placement %s, dense %s, routing %s, batch %ld, %ld warm-up + %ld steps\n",
               dir ? dir : preset, prof.name, placement,
               dense != MF_PLAN_DENSE_CARDS ? "host" : dense_split == MF_SG_SPLIT_ROWS ? "cards (rows)" : "cards",
               mf_routing_describe(rt), batch, warmup, steps);
        mf_plan_print(&rep, stdout);
        if (ops) mf_sim_print_ops(&rep);
        mf_sg_sizes *sz = NULL;
        int nd = (int)(cards ? cards : prof.n_cards);
        if (dense == MF_PLAN_DENSE_CARDS && !mf_sg_sizes_new(&cfg, &sz)) {   /* mf_sg_dense_card_bytes */
            printf("dense weights per card (%s):", dense_split == MF_SG_SPLIT_ROWS ? "split by rows" : "by layers");
            for (int cd = 0; cd < nd; cd++)
                printf(" %.2f GB", mf_sg_dense_card_bytes(&cfg, sz, nd, dense_split, cd) / 1e9);
            printf(" (of %.2f GB each)\n", prof.card_mem_bytes / 1e9);
            mf_sg_sizes_free(sz);
        }
        if (trace) printf("trace of the last simulated step: %s\n", trace);
        if (measure) {
            printf("\nmeasured on this machine (real engine%s, median of %ld steps): %.3f ms per token\n",
                   place == MF_STEP_PLACE_HOST ? "" : ", emulated cards", steps, meas_ns / 1e6);
            printf("%-16s %12s %12s\n", "phase", "measured ms", "predicted ms");
            for (int q = 0; q < MF_STEP_N_PHASES; q++)
                printf("%-16s %12.3f %12.3f\n", mf_step_phase_name((mf_step_phase)q), mt.phase_ns[q] / 1e6,
                       rep.phase_ns[q] / 1e6);
            printf("per token: predicted %.3f ms, measured %.3f ms, predicted / measured = %.3f\n",
                   rep.token_ns / 1e6, meas_ns / 1e6, rep.token_ns / meas_ns);
        }
    }
    ret = 0;
    goto out;
fail:
    fprintf(stderr, "moeflow sim: %s\n", mf_last_error()[0] ? mf_last_error() : "failed");
out:
    mf_plan_free(p);
    mf_routing_free(rt);
    return ret;
}
