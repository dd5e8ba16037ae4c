/* The engine and model option group of decode, serve and bench serve (tools/engine_opts.h): its
 * table, its checks, and opening the model, weights, store, cards and engine it describes. */
#define _GNU_SOURCE
#include "tools/engine_opts.h"

#include <errno.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "graphs/sim/routing.h"
#include "sched/clock.h"
#include "sched/cost.h"
#include "sched/error.h"
#include "tools/sim_common.h"

static const mf_opt_word mf_eng_engines[] = {{"scheduled", 1}, {"reference", 0}, {NULL, 0}};
static const mf_opt_word mf_eng_store_modes[] = {
    {"resident", MF_MODEL_STORE_RESIDENT}, {"streamed", MF_MODEL_STORE_STREAMED}, {NULL, 0}};
static const mf_opt_word mf_eng_weights[] = {
    {"mapped", MF_MODEL_WEIGHTS_MAPPED}, {"copied", MF_MODEL_WEIGHTS_COPY}, {NULL, 0}};

/* --dev-cache-fill: on, off or trace:FILE. */
static int mf_eng_fill_opt(const mf_opt *o, const char *arg, void *field)
{
    if (strncmp(arg, "trace:", 6) && mf_opt_word_value(mf_tool_on_off, arg) < 0)
        return mf_error(-EINVAL, "%s: expected on, off or trace:FILE, found '%s'", o->flag, arg);
    *(const char **)field = arg;
    return 0;
}

#define F(x) offsetof(mf_tool_engine, x)
const mf_opt mf_tool_engine_table[] = {
    {"--engine", .kind = MF_OPT_WORD, .off = F(sched), .def = "scheduled", .meta = "E", .words = mf_eng_engines,
     .help = "scheduled or reference"},
    {"--threads", .kind = MF_OPT_LONG, .off = F(threads), .meta = "N", .lo = 1, .hi = 256,
     .help = "scheduled engine workers (default: the online CPUs)"},
    {"--sockets", .kind = MF_OPT_FN, .off = F(sk), .meta = "N|auto", .fn = mf_tool_sockets_opt, .example = "1",
     .help = "scheduled engine: one CPU lane per socket (NUMA node with cores;\n"
             "auto: all hwloc finds), the --threads workers split across them\n"
             "by cores and pinned there; each routed expert's rows are split\n"
             "across the sockets, each share run by the workers of the socket\n"
             "whose memory holds it (mapped weights: each share read into its\n"
             "socket's node by threads bound there on a cold start; --store\n"
             "resident binds the shares to the sockets' nodes, one copy, bound\n"
             "with hwloc; a node that does not exist is a one-line note). Logits\n"
             "as with one lane. MOEFLOW_TOPOLOGY=DESC|FILE.xml: an hwloc synthetic\n"
             "or XML topology instead of this machine's (tests). Default auto\n"
             "(one lane on a machine with one NUMA node, as before)"},
    {"--exact", .kind = MF_OPT_FLAG, .off = F(exact),
     .help = "scheduled engine: fp32 kernel path for the FP4 experts (matches\n"
             "the reference to ~1e-7) instead of the int8 path (~1% per matmul)"},
    {"--weights", .kind = MF_OPT_WORD, .off = F(weights), .def = "mapped", .meta = "W", .words = mf_eng_weights,
     .help = "mapped: the weights are views of the checkpoint's files in the\n"
             "page cache, the one copy, which the kernel keeps after the\n"
             "process ends: a warm start reads nothing from the disk; a cold\n"
             "one reads at the disk's rate (progress, ETA); weights larger\n"
             "than the memory stream their routed experts and Engram tables\n"
             "from the disk (as --store streamed, said at start); `moeflow\n"
             "info DIR --resident` shows what is held and how to free it.\n"
             "copied: read into the process's own memory at every start\n"
             "(docs/io.md)"},
    {"--store", .kind = MF_OPT_WORD, .off = F(store_mode), .meta = "MODE", .words = mf_eng_store_modes,
     .help = "experts and Engram tables through the expert store: resident\n"
             "(read in at load with O_DIRECT into the process's memory) or\n"
             "streamed (a cache, misses read per use through io_uring; the\n"
             "scheduled engine reads them on its IO lane inside the step\n"
             "graph); per-step hits/misses on stderr"},
    {"--store-budget", .kind = MF_OPT_SIZE, .off = F(store_budget), .meta = "SIZE",
     .help = "streamed cache bytes, e.g. 2G, 512M (default 2G)"},
    {"--store-tables", .kind = MF_OPT_WORD, .off = F(store_tables), .meta = "MODE", .words = mf_eng_store_modes,
     .help = "Engram tables resident or streamed (default: as --store)"},
    {"--io-depth", .kind = MF_OPT_LONG, .off = F(io_depth), .meta = "N", .lo = 1, .hi = 4096,
     .help = "reads in flight (default 64)"},
    {"--read-window", .kind = MF_OPT_LONG, .off = F(read_window), .meta = "N", .lo = -1, .hi = 4096,
     .flags = MF_OPT_NOT0, .expect = "1..4096 or -1 (all)",
     .help = "scheduled engine with --store: experts of a layer whose reads\n"
             "are in flight at once, in slot order (default 2; -1: all)"},
    {"--devices", .kind = MF_OPT_STR, .off = F(devices), .meta = "SPEC",
     .help = "routed experts on devices (scheduled engine): emu:N emulated\n"
             "cards (emu:N,mem=SIZE,bw=B/S,lat_ns=NS) or cuda, cuda:0,1"},
    {"--dense", .kind = MF_OPT_WORD, .off = F(dense), .meta = "D", .words = mf_tool_denses,
     .help = "cards: the dense work (attention linears, router gate, shared\n"
             "expert, head) on the cards (split as --dense-split), activations copied per\n"
             "sublayer, weights resident on the cards (default with emu:N devices;\n"
             "on CUDA cards only when asked: never run on a GPU yet); host: on the\n"
             "host (default otherwise)"},
    {"--dense-split", .kind = MF_OPT_WORD, .off = F(dense_split), .def = MF_TOOL_DENSE_SPLIT, .meta = "S",
     .words = mf_tool_dense_splits,
     .help = "with --dense cards: layers (each layer's dense work on one card) or\n"
             "rows (every dense matrix but the shared expert split by\n"
             "output rows across all cards; either gives the host's logits bit for\n"
             "bit on emulated cards)"},
    {"--in-split", .kind = MF_OPT_WORD, .off = F(in_split), .def = "cost", .meta = "I", .words = mf_tool_in_splits,
     .help = "with --dense-split rows: the attention's in stage per layer and shape\n"
             MF_TOOL_IN_SPLIT_HELP},
    {"--heads", .kind = MF_OPT_WORD, .off = F(heads), .def = "cost", .meta = "H", .words = mf_tool_heads_modes,
     .help = "with --dense cards: the attention heads' scores and values of one\n"
             "sequence's positions (prefill chunks, batch 1) per layer by the cost\n"
             "model on --profile (cost), on the cards wherever they\n"
             "can, or on the host (host logits bit for bit on emulated cards)"},
    {"--cublaslt", .kind = MF_OPT_WORD, .off = F(lt), .def = "cost", .meta = "L", .words = mf_tool_lt_modes,
     .help = "where the cards' tensor cores take work through cuBLASLt: cost (by\n"
             "the cost model on --profile: never without a tensor-core rate), on\n"
             "(wherever it applies), dense (the dense linears only: host logits\n"
             "bit for bit on emulated cards), off"},
    {"--micro-batches", .kind = MF_OPT_LONG, .off = F(micro), .def = "1", .meta = "M", .lo = 1, .hi = 2,
     .expect = "1 or 2",
     .help = "scheduled engine, batch >= 2: 2 splits the batch into two halves\n"
             "in flight at once (one half's routed experts beside the other's\n"
             "attention; the same logits bit for bit); 1: one"},
    {"--placement", .kind = MF_OPT_WORD, .off = F(placement), .meta = "P", .words = mf_tool_placements,
     .help = "seed: routed experts on the card owning them; hybrid: per\n"
             "expert and step the cheaper of host and card by the lanes'\n"
             "cost models (default with --devices); host: all on the\n"
             "host (default without). Per-step device lines on stderr"},
    {"--dev-cache", .kind = MF_OPT_SIZE, .off = F(dev_cache), .meta = "SIZE",
     .help = "expert cache bytes per card (default: every expert, or as\nmany as the card holds)"},
    {"--dev-cache-fill", .kind = MF_OPT_FN, .off = F(fill_spec), .def = MF_TOOL_DEV_CACHE_FILL, .meta = "F",
     .fn = mf_eng_fill_opt,
     .help = "on: fill each card's expert cache before the first\n"
             "token, spread evenly over layers (progress on stderr); trace:FILE:\n"
             "the experts a --record-routing trace routes most first; off: the\n"
             "caches start empty"},
    {"--dev-graphs", .kind = MF_OPT_FLAG, .off = F(dev_graphs),
     .help = "per layer and card, the device FFNs of all slots as one graph\n"
             "(a CUDA graph on CUDA cards; docs/device.md); also with the\n"
             "environment variable MOEFLOW_DEV_GRAPHS=1"},
    {"--profile", .kind = MF_OPT_STR, .off = F(profile_path), .meta = "P",
     .help = "hardware profile (docs/profiles.md, `moeflow calibrate`) whose\n"
             "host fp4, h2d and card fp4 rates are the lanes' cost models\n"
             "that hybrid placement weighs (default: built-in assumptions,\n"
             "host 20 GB/s per worker, copies 25 GB/s + 10 us, cards 20 GB/s)"},
    {NULL},
};
#undef F

void mf_tool_engine_init(mf_tool_engine *e)
{
    *e = (mf_tool_engine){.threads = sysconf(_SC_NPROCESSORS_ONLN), .placement = -1, .dense = -1,
                          .dev_graphs = mf_tool_env_on("MOEFLOW_DEV_GRAPHS")};   /* --dev-graphs */
    if (e->threads < 1) e->threads = 1;
}

int mf_tool_engine_check(const char *cmd, mf_tool_engine *e)
{
    if (!e->sk.n) {
        if (mf_tool_sockets_of("auto", &e->sk)) {
            fprintf(stderr, "moeflow %s: %s\n", cmd, mf_last_error());
            return 2;
        }
        if (e->sk.n > e->threads) e->sk.n = (int)e->threads;
    }
    const char *why = NULL;
    char buf[64];
    if ((e->devices || e->placement >= 0) && !e->sched) why = "--devices and --placement apply to the scheduled engine";
    else if (e->placement > 0 && !e->devices)
        why = (snprintf(buf, sizeof buf, "--placement %s needs --devices", mf_opt_word_name(mf_tool_placements,
                                                                                           e->placement)), buf);
    else if (e->profile_path && !e->sched) why = "--profile applies to the scheduled engine";
    else if (e->dense == MF_PLAN_DENSE_CARDS && !e->devices) why = "--dense cards needs --devices";
    else if (!e->sched && e->exact) why = "--exact applies to the scheduled engine (the reference is exact)";
    else if (e->rk && e->rk->spec && !e->sched) why = "--ranks-layers runs the scheduled engine";
    if (why) {
        fprintf(stderr, "moeflow %s: %s\n", cmd, why);
        return 2;
    }
    if (e->devices && e->placement < 0) e->placement = MF_STEP_PLACE_HYBRID;
    e->placement_word = e->placement >= 0 ? mf_opt_word_name(mf_tool_placements, e->placement) : NULL;
    e->dense_cards = e->dense >= 0 ? e->dense == MF_PLAN_DENSE_CARDS : e->devices && !strncmp(e->devices, "emu", 3);
    e->place = !e->devices ? MF_STEP_PLACE_HOST : e->placement;
    return 0;
}

/* How the weights are held, on stderr: mapped warm or cold, the fall back, the store's line. */
static void mf_tool_run_weights_line(const char *cmd, const mf_tool_engine *e, const mf_tool_run *x)
{
    mf_model_weights w;
    mf_model_weights_info(x->m, &w);
    const double G = 1073741824.0;
    if (w.fell_back)
        fprintf(stderr, "moeflow %s: the weights take more than the %.2f GiB of memory available: the routed "
                "experts and Engram tables are streamed from the disk (as --store streamed%s), the other "
                "%.2f GiB mapped from the page cache\n", cmd, w.mem_bytes / G,
                e->store_budget ? "" : " --store-budget 2G", w.map_bytes / G);
    if (w.mapped) {
        uint64_t read = w.map_bytes > w.cached_bytes ? w.map_bytes - w.cached_bytes : 0;
        fprintf(stderr, "moeflow %s: weights mapped from the page cache: %.2f GiB, %.2f GiB of it cached before "
                "(%s), %.2f GiB read in %.2f s on %d thread%s%s\n", cmd, w.map_bytes / G,
                (w.cached_bytes < w.map_bytes ? w.cached_bytes : w.map_bytes) / G,
                read == 0 ? "warm" : w.cached_bytes ? "partly warm" : "cold", read / G, w.fill_ns / 1e9,
                w.fill_threads, w.fill_threads == 1 ? "" : "s", w.copied_bytes ? "; tensors the file does not align copied" : "");
    }
    if (x->mst)
        fprintf(stderr, "moeflow %s: expert store %s, %d slots of %.2f MiB (%.2f GiB slab), engine %s, %s; "
                "loaded in %.2f s\n", cmd,
                e->store_mode == MF_MODEL_STORE_RESIDENT ? "resident" : "streamed", mf_store_n_slots(x->mst),
                mf_store_slot_bytes(x->mst) / 1048576.0, mf_store_slab_bytes(x->mst) / G,
                mf_store_io_engine(x->mst), mf_store_direct(x->mst) ? "O_DIRECT" : "buffered", x->load_s);
}

/* The model as e says; how its weights are held on stderr. */
static int mf_tool_run_model(const char *cmd, const mf_tool_engine *e, const char *dir, int quiet, mf_tool_run *x)
{
    /* copied: the scheduled engine needs the experts in memory, so up to 64 GiB resident */
    mf_model_opts mo = {.quiet = quiet, .resident_limit_bytes = e->sched ? UINT64_C(64) << 30 : 0,
                        .weights = e->weights, .store = e->store_mode, .store_tables = e->store_tables,
                        .store_budget_bytes = e->store_budget, .store_io_depth = (int)e->io_depth,
                        .store_io_pread = mf_tool_io_env.force_pread, .n_sockets = e->sched ? e->sk.n : 1,
                        .load_draft = e->draft};
    if (e->rk) mf_tool_ranks_layers(e->rk, &mo.layer_begin, &mo.layer_end);   /* a pipeline's rank: its layers */
    memcpy(mo.socket_node, e->sk.node, sizeof mo.socket_node);
    if (!e->sched) {   /* the reference engine reads through the store's own run */
        mo.store_io_fault_kind = mf_tool_io_env.fault_kind;
        mo.store_io_fault_nth = mf_tool_io_env.fault_nth;
    }
    int64_t t0 = mf_now_ns();
    int rc = mf_model_load(dir, &mo, &x->m);
    if (rc) return rc;
    x->load_s = (mf_now_ns() - t0) / 1e9;
    x->mst = mf_model_store(x->m);
    if (!quiet) mf_tool_run_weights_line(cmd, e, x);
    return 0;
}

/* --dev-cache-fill trace:FILE: the trace's routing counts per (layer, expert), malloc'ed. */
static int mf_tool_fill_counts(const mf_tool_engine *e, const mf_config *c, uint32_t **out)
{
    mf_routing *frt = NULL;
    int rc = mf_routing_open(e->fill_spec, c->n_layers, c->n_routed_experts, c->n_experts_per_tok, 0, &frt);
    if (rc) return rc;
    *out = malloc(sizeof **out * (size_t)c->n_layers * c->n_routed_experts);
    if (*out) mf_routing_counts(frt, *out);
    mf_routing_free(frt);
    return *out ? 0 : mf_error(-ENOMEM, "out of memory");
}

int mf_tool_run_open(const char *cmd, const mf_tool_engine *e, const char *dir, const mf_tok *tok,
                     mf_ref_opts ro, int quiet, mf_tool_run *x)
{
    memset(x, 0, sizeof *x);
    int rc = mf_tool_run_model(cmd, e, dir, quiet, x);
    if (rc) return rc;
    const mf_config *c = mf_model_config(x->m);
    if (tok && c->n_engram > 0) {   /* the real Engram token map */
        if ((rc = mf_engram_map_build(tok, &x->emap))) return rc;
        if (mf_engram_map_n_unique(x->emap) > c->engram_compressed_vocab_size) {
            fprintf(stderr, "moeflow %s: the tokenizer's Engram map has %d unique keys, more than "
                            "engram_compressed_vocab_size %" PRId64 " of %s/config.json\n",
                    cmd, mf_engram_map_n_unique(x->emap), c->engram_compressed_vocab_size, dir);
            return 1;
        }
        ro.token_map = mf_engram_map_ids(x->emap);
        ro.n_token_map = mf_engram_map_n_vocab(x->emap);
    }
    if (e->profile_path) {
        if ((rc = mf_profile_load(e->profile_path, &x->prof))) return rc;
        x->have_prof = 1;
    }
    if ((rc = mf_ref_new(x->m, &ro, &x->r))) return rc;
    if (e->devices && (e->place != MF_STEP_PLACE_HOST || e->dense_cards) && (rc = mf_dev_open(e->devices, &x->dev)))
        return rc;
    if (!e->sched) return 0;
    if (e->rk && (rc = mf_tool_ranks_pipe(e->rk, c))) return rc;   /* a pipeline's rank: the pipe */
    mf_pipe *pipe = e->rk ? e->rk->pipe : NULL;   /* its link to the engine, attached after */
    uint32_t *counts = NULL;
    if (x->dev && e->place != MF_STEP_PLACE_HOST && !strncmp(e->fill_spec, "trace:", 6) &&
        (rc = mf_tool_fill_counts(e, c, &counts)))
        return rc;
    rc = mf_step_new(x->r, &(mf_step_opts){.n_threads = (int)e->threads, .exact = e->exact, .max_batch = e->max_items,
                                           .n_sockets = e->sk.n,
                                           .topology = e->sk.topology, .pin_threads = e->sk.n > 1,
                                           .read_window = (int)e->read_window, .dev = x->dev, .placement = e->place,
                                           .dev_cache_bytes = e->dev_cache,
                                           .dev_cache_fill = strcmp(e->fill_spec, "off") != 0,
                                           .dev_fill_counts = counts, .dev_fill_progress = !quiet,
                                           .dev_graphs = e->dev_graphs, .dense = e->dense_cards,
                                           .dense_split = e->dense_split, .in_split = e->in_split, .heads = e->heads,
                                           .micro = (int)e->micro,
                                           .lt = e->lt, .profile = x->have_prof ? &x->prof : NULL, .io_depth = (int)e->io_depth,
                                           .io_force_pread = mf_tool_io_env.force_pread,
                                           .io_fault_kind = mf_tool_io_env.fault_kind,
                                           .io_fault_nth = mf_tool_io_env.fault_nth, .draft = e->draft,
                                           .link = pipe ? mf_pipe_step_link(pipe) : (mf_step_link){0}}, &x->eng);
    if (!rc && pipe) mf_pipe_attach(pipe, x->r, x->eng);
    free(counts);
    return rc;
}

int mf_tool_run_spec(const mf_tool_engine *e, mf_tool_run *x, long n_tokens, int max_batch, int64_t context)
{
    if (!e->draft) return 0;
    mf_plan_opts price = {.config = mf_model_config(x->m), .profile = x->have_prof ? &x->prof : mf_cost_default_profile(),
                          .placement = e->place, .n_cards = x->dev ? mf_dev_n_cards(x->dev) : 0, .n_sockets = 1,
                          .threads_per_socket = (int)e->threads, .context = context,
                          .dense = e->dense_cards ? MF_PLAN_DENSE_CARDS : MF_PLAN_DENSE_HOST,
                          .dense_split = e->dense_split, .in_split = e->in_split, .micro = (int)e->micro};
    return mf_spec_new(&(mf_spec_opts){.ref = x->r, .eng = x->eng, .source = MF_SPEC_DSPARK, .n_max = (int)n_tokens,
                                       .adaptive = n_tokens == 0, .price = &price},
                       max_batch, &x->spec);
}

void mf_tool_run_notes(const char *cmd, const mf_tool_engine *e, const mf_tool_run *x, int quiet)
{
    if (!x->eng) return;
    if (!quiet) {
        mf_step_fill_stats fs;
        mf_step_fill(x->eng, &fs);
        if (fs.experts)
            fprintf(stderr, "moeflow %s: warmed the card caches: %" PRId64 " experts, %.1f MB in %.3f s%s\n", cmd,
                    fs.experts, fs.bytes / 1e6, fs.wall_ns / 1e9, fs.skipped ? " (some not held by the host: left out)" : "");
    }
    if (mf_step_refused(x->eng)[0]) fprintf(stderr, "moeflow %s: card self-check: %s\n", cmd, mf_step_refused(x->eng));
    for (int k = 0, cd = 0; e->dense_cards && mf_step_dense_bytes(x->eng, k, &cd); k++)
        if (!quiet)
            fprintf(stderr, "moeflow %s: dense weights on card %d (%s): %.1f MB\n", cmd, cd, e->devices,
                    (double)mf_step_dense_bytes(x->eng, k, NULL) / 1e6);
}

void mf_tool_run_close(mf_tool_run *x)
{
    mf_spec_free(x->spec);
    mf_step_free(x->eng);
    mf_dev_close(x->dev);
    mf_ref_free(x->r);
    mf_model_free(x->m);
    mf_engram_map_free(x->emap);
    memset(x, 0, sizeof *x);
}

double mf_tool_since_start_s(void)
{
    FILE *f = fopen("/proc/self/stat", "r");
    if (!f) return -1;
    char buf[2048];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')');   /* the command name may hold spaces */
    unsigned long long start = 0;
    /* after ") ": state (field 3) ... starttime is field 22 */
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu",
                     &start) != 1)
        return -1;
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    long hz = sysconf(_SC_CLK_TCK);
    return hz > 0 ? ts.tv_sec + ts.tv_nsec / 1e9 - (double)start / (double)hz : -1;
}

int mf_tool_rss(double *anon_bytes, double *file_bytes)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    unsigned long long kb;
    int got = 0;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "RssAnon: %llu kB", &kb) == 1) *anon_bytes = kb * 1024.0, got |= 1;
        if (sscanf(line, "RssFile: %llu kB", &kb) == 1) *file_bytes = kb * 1024.0, got |= 2;
    }
    fclose(f);
    return got == 3 ? 0 : -1;
}
