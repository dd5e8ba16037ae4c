/* `moeflow decode`: decodes on a checkpoint with the scheduled engine (graphs/step/step.h, default) or
 * the plain reference forward (graphs/ref/ref.h): prefill of one prompt or a batch of prompts (text
 * through the checkpoint's tokenizer.json, or token ids), then greedy or seeded temperature/top-p
 * decoding of all sequences at once, streamed (one sequence) or printed per sequence, ending with
 * prefill and aggregate decode tokens/s. This file: the options, the model and engine, the step
 * loop and its reports; the prompts and the batcher's events: tools/cmd_decode_seqs.c. */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "device/dev.h"
#include "graphs/step/stepgraph.h"
#include "sched/clock.h"
#include "tools/cmd_decode.h"
#include "tools/sim_common.h"

static const mf_opt_word mf_dec_engines[] = {{"scheduled", 1}, {"reference", 0}, {NULL, 0}};
static const mf_opt_word mf_dec_store_modes[] = {
    {"resident", MF_MODEL_STORE_RESIDENT}, {"streamed", MF_MODEL_STORE_STREAMED}, {NULL, 0}};

/* --dev-cache-fill: on, off or trace:FILE. */
static int mf_dec_fill_opt(const mf_opt *o, const char *arg, void *field)
{
    if (strncmp(arg, "trace:", 6) && mf_opt_word_value(mf_tool_on_off, arg) < 0)
        return mf_error(-EINVAL, "%s: expected on, off or trace:FILE, found '%s'", o->flag, arg);
    *(const char **)field = arg;
    return 0;
}

#define F(x) offsetof(mf_dec_cli, x)
static const mf_opt mf_dec_table[] = {
    {"--checkpoint", .kind = MF_OPT_STR, .off = F(dir), .meta = "DIR",
     .help = "config.json + safetensors (e.g. from `moeflow gen`)"},
    {"--prompt", .kind = MF_OPT_STR, .off = F(prompt), .meta = "TEXT",
     .help = "text, encoded with DIR/tokenizer.json (BOS prepended)"},
    {"--tokens", .kind = MF_OPT_STR, .off = F(ids), .meta = "IDS",
     .help = "token ids, comma or space separated, used as given"},
    {"--prompts", .kind = MF_OPT_STR, .off = F(prompts_file), .meta = "FILE",
     .help = "one prompt per line, any number of lines (text with a tokenizer,\n"
             "else token ids); empty lines are skipped; a line that cannot be\n"
             "a prompt (not UTF-8, bad ids, past the context) gets an error\n"
             "record and the run goes on (exit 3 at the end). SIGINT or SIGTERM:\n"
             "no new prompts start, the ones generating finish (a second signal\n"
             "cancels them), a summary, exit 130 (SIGINT) or 143 (SIGTERM)"},
    {"--resume", .kind = MF_OPT_FLAG, .off = F(resume),
     .help = "with --prompts and --output: the prompts whose records are in\n"
             "--output already are not run again (a cut last line is removed);\n"
             "the new records are appended"},
    {"--batch", .kind = MF_OPT_LONG, .off = F(batch), .meta = "B", .lo = 1, .hi = MF_STEP_MAX_ITEMS,
     .help = "sequences decoded at once (1.." MF_OPTS_STR(MF_STEP_MAX_ITEMS) "): with --prompts every line\n"
             "runs, B at a time (default: all, at most " MF_OPTS_STR(MF_STEP_MAX_ITEMS) "); with --prompt or\n"
             "--tokens, B copies of it"},
    {"--step-tokens", .kind = MF_OPT_LONG, .off = F(step_tokens), .meta = "N", .lo = 1, .hi = 65536,
     .help = "items per step (default " MF_OPTS_STR(MF_BATCH_STEP_TOKENS) "; one sequence on the scheduled\n"
             "engine: " MF_OPTS_STR(MF_STEP_PREFILL_CHUNK) ", its prompt in the engine's prefill chunks):\n"
             "decode tokens first, then prefill\n"
             "chunks; smaller N cuts long prompts into more steps; a step\n"
             "of one sequence's prefill alone runs as one graph of up to\n"
             MF_OPTS_STR(MF_STEP_MAX_CHUNK) " positions (long chunks), mixed steps in graphs of "
             MF_OPTS_STR(MF_STEP_MAX_ITEMS)},
    {"--output", .kind = MF_OPT_STR, .off = F(outfile), .meta = "FILE",
     .help = "one JSON object per prompt as it finishes, one write each (the\n"
             "scriptable channel): index (the line's index in FILE, from 0),\n"
             "line (its number, from 1), prompt, text (with a tokenizer), tokens,\n"
             "prompt_tokens, finish_reason (eos or length), queue_s,\n"
             "first_token_s, total_s; a refused line: index, line, prompt, error"},
    {"--engine", .kind = MF_OPT_WORD, .off = F(sched), .def = "scheduled", .meta = "E", .words = mf_dec_engines,
     .help = "scheduled or reference"},
    {"--threads", .kind = MF_OPT_LONG, .off = F(threads), .meta = "N", .lo = 1, .hi = 256,
     .help = "scheduled engine workers (default: the online CPUs)"},
    {"--sockets", .kind = MF_OPT_FN, .off = F(sk), .meta = "N|auto", .fn = mf_tool_sockets_opt, .example = "1",
     .help = "scheduled engine: one CPU lane per socket (NUMA node with cores;\n"
             "auto: all hwloc finds), the --threads workers split across them\n"
             "by cores and pinned there; each routed expert's rows are split\n"
             "across the sockets, each share run by the workers of the socket\n"
             "whose memory holds it (--store resident binds the shares to the\n"
             "sockets' nodes, one copy, bound with hwloc;\n"
             "a node that does not exist is a one-line note). Logits as with\n"
             "one lane. MOEFLOW_TOPOLOGY=DESC|FILE.xml: an hwloc synthetic or\n"
             "XML topology instead of this machine's (tests). Default auto\n"
             "(one lane on a machine with one NUMA node, as before)"},
    {"--exact", .kind = MF_OPT_FLAG, .off = F(exact),
     .help = "scheduled engine: fp32 kernel path for the FP4 experts (matches\n"
             "the reference to ~1e-7) instead of the int8 path (~1% per matmul)"},
    {"--max-new-tokens", .kind = MF_OPT_LONG, .off = F(max_new), .def = "16", .meta = "N", .lo = 0, .hi = INT32_MAX,
     .help = "tokens to generate"},
    {"--temperature", .kind = MF_OPT_DOUBLE, .off = F(temperature), .def = "0", .meta = "T", .lo = 0, .hi = 100,
     .help = "0 = greedy; > 0 samples"},
    {"--top-p", .kind = MF_OPT_DOUBLE, .off = F(top_p), .def = "1", .meta = "P", .lo = 0, .hi = 1,
     .flags = MF_OPT_LO_OPEN, .help = "nucleus mass in (0, 1]"},
    {"--seed", .kind = MF_OPT_ULL, .off = F(seed), .def = "0", .meta = "S",
     .help = "sampling seed (sequence i samples with S + i)"},
    {"--no-bos", .kind = MF_OPT_FLAG, .off = F(no_bos), .help = "do not prepend bos_token_id to --prompt"},
    {"--chat", .kind = MF_OPT_FLAG, .off = F(chat),
     .help = "each prompt is one user message, rendered with the chat template\n"
             "as `moeflow serve` renders /v1/chat/completions: DIR's\n"
             "tokenizer_config.json chat_template (no BOS id prepended: the\n"
             "template writes it), else the built-in DeepSeek-V3 format"},
    {"--chat-template", .kind = MF_OPT_STR, .off = F(chat_spec), .meta = "T",
     .help = "with --chat: FILE (a template, or a tokenizer_config.json) or\nbuiltin, instead of DIR's"},
    {"--ignore-eos", .kind = MF_OPT_FLAG, .off = F(ignore_eos), .help = "keep going after eos_token_id"},
    {"--act-quant", .kind = MF_OPT_FLAG, .off = F(act_quant),
     .help = "quantize linear inputs to e4m3 as DeepSeek's inference code\n"
             "does (default: the Hugging Face port, which does not);\n"
             "reference engine only"},
    {"--trace", .kind = MF_OPT_STR, .off = F(trace), .meta = "FILE",
     .help = "Chrome trace of the last step: the scheduled engine's task\n"
             "graph (with --store its IO-lane expert reads), or with the\n"
             "reference engine and --store the store's reads and compute"},
    {"--store", .kind = MF_OPT_WORD, .off = F(store_mode), .meta = "MODE", .words = mf_dec_store_modes,
     .help = "experts and Engram tables through the expert store: resident\n"
             "(read in at load) or streamed (a cache, misses read per use\n"
             "through io_uring; the scheduled engine reads them on its IO\n"
             "lane inside the step graph); per-step hits/misses on stderr"},
    {"--store-budget", .kind = MF_OPT_SIZE, .off = F(store_budget), .meta = "SIZE",
     .help = "streamed cache bytes, e.g. 2G, 512M (default 2G)"},
    {"--store-tables", .kind = MF_OPT_WORD, .off = F(store_tables), .meta = "MODE", .words = mf_dec_store_modes,
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
     .fn = mf_dec_fill_opt,
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
    {"--record-routing", .kind = MF_OPT_STR, .off = F(record), .meta = "FILE",
     .help = "write the routed experts of every token (prefill and\n"
             "decode, every sequence and layer) to FILE, a routing trace\n"
             "for `moeflow sim --routing trace:FILE`; it records through the\n"
             "reference's on_route hook, and with a hook set the scheduled\n"
             "engine runs its serial graph (a batch's per-sequence parts one\n"
             "after another), so timings differ from a run without it"},
    MF_TOOL_PREFIX_OPTS(F, pfx),
    {"--quiet", "-q", MF_OPT_FLAG, F(quiet), .help = "no progress or timing on stderr"},
    {NULL},
};
#undef F

static const mf_opts_spec mf_dec_spec = {
    .cmd = "decode",
    .usage =
        "usage: moeflow decode --checkpoint DIR (--prompt TEXT | --tokens IDS | --prompts FILE [--resume])\n"
        "                      [--engine scheduled|reference] [--threads N] [--sockets N|auto]\n"
        "                      [--exact] [--batch B]\n"
        "                      [--step-tokens N] [--output FILE.jsonl]\n"
        "                      [--max-new-tokens N] [--temperature T --top-p P --seed S]\n"
        "                      [--no-bos] [--ignore-eos] [--act-quant] [--quiet] [--trace FILE]\n"
        "                      [--chat [--chat-template FILE|builtin]]\n"
        "                      [--store resident|streamed [--store-budget SIZE]\n"
        "                       [--store-tables resident|streamed] [--io-depth N] [--read-window N]]\n"
        "                      [--devices emu:N|cuda[:IDS] [--placement seed|host|hybrid] [--dense host|cards]\n"
        "                       [--dense-split layers|rows] [--heads cost|cards|host] [--micro-batches 1|2]\n"
        "                       [--cublaslt cost|on|dense|off]\n"
        "                       [--dev-cache SIZE] [--dev-cache-fill on|off|trace:FILE] [--dev-graphs]\n"
        "                       [--profile P]] [--record-routing FILE]\n"
        "                      [--prefix-cache SIZE] [--prefix-cache-dir DIR] [--prefix-block N]\n\n"
        "Decodes with the scheduled engine (a task graph per step on --threads workers: experts\n"
        "and head on fused kernels, see docs/decode.md) or the plain reference forward (fp32,\n"
        "one thread: the correctness oracle). Every prompt goes through the continuous batcher\n"
        "(graphs/step/batch.h, docs/serve.md): up to B sequences per step, each step a decode token\n"
        "of every running sequence plus prefill chunks of new ones under --step-tokens; a\n"
        "finished sequence's place goes to the next prompt at the next step. Each sequence's\n"
        "tokens are the ones it gets decoded alone. One sequence is streamed: text when DIR has\n"
        "a tokenizer.json, token ids otherwise; several are printed one line each, '[i] ...'\n"
        "(i: the line's index in FILE; newline, CR, tab, backslash and control bytes escaped as\n"
        "\\n \\r \\t \\\\ \\xHH), with a progress line (done/total, tokens/s, ETA) on stderr. Ends\n"
        "with prefill and aggregate decode tokens/s on stderr. Exit codes: 0 done, 1 failed, 2 bad\n"
        "usage, 3 done with refused lines, 130/143 interrupted (SIGINT/SIGTERM).\n\n",
    .opts = mf_dec_table,
    .col = 22,
};

/* The options that cannot go together, and what they leave to decide: the sockets (auto: every
 * socket hwloc finds, at most one per worker), the placement and whether the dense work runs on
 * the cards. 0 or 2 (said on stderr). */
static int mf_dec_check(mf_dec_cli *a, mf_dec *d)
{
    if (!a->sk.n) {
        if (mf_tool_sockets_of("auto", &a->sk)) {
            fprintf(stderr, "moeflow decode: %s\n", mf_last_error());
            return 2;
        }
        if (a->sk.n > a->threads) a->sk.n = (int)a->threads;
    }
    if (!a->dir || (!!a->prompt + !!a->ids + !!a->prompts_file) != 1)
        return mf_opts_refuse(&mf_dec_spec, "--checkpoint and exactly one of --prompt / --tokens / --prompts are "
                                            "required");
    struct stat st;
    if (stat(a->dir, &st) || !S_ISDIR(st.st_mode)) {
        fprintf(stderr, "moeflow decode: --checkpoint %s: %s\n", a->dir,
                stat(a->dir, &st) ? (errno == ENOENT ? "no such directory" : strerror(errno)) : "not a directory");
        return 2;
    }
    const char *why = NULL;
    char buf[64];
    if (a->sched && a->act_quant)
        why = "--act-quant is only implemented by the reference engine (add --engine reference)";
    else if (!a->sched && a->trace && !a->store_mode) why = "--trace needs the scheduled engine or --store";
    else if ((a->devices || a->placement >= 0) && !a->sched)
        why = "--devices and --placement apply to the scheduled engine";
    else if (a->placement > 0 && !a->devices)
        why = (snprintf(buf, sizeof buf, "--placement %s needs --devices", mf_opt_word_name(mf_tool_placements,
                                                                                           a->placement)), buf);
    else if (a->profile_path && !a->sched) why = "--profile applies to the scheduled engine";
    else if (a->dense == MF_PLAN_DENSE_CARDS && !a->devices) why = "--dense cards needs --devices";
    else if (!a->sched && a->exact) why = "--exact applies to the scheduled engine (the reference is exact)";
    if (why) {
        fprintf(stderr, "moeflow decode: %s\n", why);
        return 2;
    }
    if (a->devices && a->placement < 0) a->placement = MF_STEP_PLACE_HYBRID;
    d->placement = a->placement >= 0 ? mf_opt_word_name(mf_tool_placements, a->placement) : NULL;
    d->dense = a->dense >= 0 ? a->dense == MF_PLAN_DENSE_CARDS : a->devices && !strncmp(a->devices, "emu", 3);
    d->place = !a->devices ? MF_STEP_PLACE_HOST : a->placement;
    d->no_bos = a->no_bos;
    return 0;
}

/* One line of store counters per step. The store's own timings (runs, io busy, compute, overlap)
 * only cover reads it drives itself (the reference engine); the scheduled engine reads through its
 * own IO lane and reports those times from its timeline instead, so they are left out there. */
static void mf_print_step(mf_store *st, const char *what, long k, int sched)
{
    mf_store_stats x;
    mf_store_step(st, &x);
    fprintf(stderr, "moeflow decode: %s %ld: experts %" PRIu64 " hits %" PRIu64 " misses (%.1f MiB "
            "read, %" PRIu64 " evicted), Engram %" PRIu64 " rows in %" PRIu64 " reads", what, k, x.hits,
            x.misses, x.bytes_read / 1048576.0, x.evictions, x.rows, x.row_reads);
    if (sched)
        fputc('\n', stderr);
    else
        fprintf(stderr, "; store runs %.1f ms, io busy %.1f ms, compute %.1f ms, io overlapping compute "
                "%.1f ms\n", x.read_wall_ns / 1e6, x.io_busy_ns / 1e6, x.cpu_busy_ns / 1e6,
                x.overlap_ns / 1e6);
}

/* The model (through the expert store with --store), its prompts' fit (ids in the vocabulary,
 * positions within the model's), the Engram token map of the tokenizer. */
static int mf_dec_model(mf_dec *d)
{
    const mf_dec_cli *a = d->a;
    /* the scheduled engine needs the experts in memory: allow up to 64 GiB resident */
    mf_model_opts mo = {.quiet = a->quiet, .resident_limit_bytes = a->sched ? UINT64_C(64) << 30 : 0,
                        .store = a->store_mode, .store_tables = a->store_tables,
                        .store_budget_bytes = a->store_budget, .store_io_depth = (int)a->io_depth,
                        .store_io_pread = mf_tool_io_env.force_pread, .n_sockets = a->sched ? a->sk.n : 1};
    memcpy(mo.socket_node, a->sk.node, sizeof mo.socket_node);
    if (!a->sched) {   /* the reference engine reads through the store's own run */
        mo.store_io_fault_kind = mf_tool_io_env.fault_kind;
        mo.store_io_fault_nth = mf_tool_io_env.fault_nth;
    }
    int64_t tl0 = mf_now_ns();
    int rc = mf_model_load(a->dir, &mo, &d->m);
    if (rc) return rc;
    mf_store *mst = d->mst = mf_model_store(d->m);
    if (mst && !a->quiet)
        fprintf(stderr, "moeflow decode: expert store %s, %d slots of %.2f MiB (%.2f GiB slab), "
                "engine %s, %s; loaded in %.2f s\n",
                a->store_mode == MF_MODEL_STORE_STREAMED ? "streamed" : "resident", mf_store_n_slots(mst),
                mf_store_slot_bytes(mst) / 1048576.0, mf_store_slab_bytes(mst) / 1073741824.0,
                mf_store_io_engine(mst), mf_store_direct(mst) ? "O_DIRECT" : "buffered",
                (mf_now_ns() - tl0) / 1e9);
    const mf_config *c = mf_model_config(d->m);
    int max_prompt = 0;
    for (int s = 0; s < d->n_seq; s++) {   /* with --prompts a line that does not fit is refused */
        mf_dec_seq *q = &d->sq[s];
        if (q->state != MF_DEC_RUN) continue;
        if (d->is_text && !d->no_bos) q->pids[0] = c->bos_token_id;
        for (int i = 0; i < q->n_pid; i++)
            if (q->pids[i] >= c->vocab_size) {
                if (a->prompts_file) {
                    mf_dec_refuse_line(d, s, "token %d (position %d) is outside the vocabulary (vocab_size %" PRId64
                                       ")", q->pids[i], i, c->vocab_size);
                    break;
                }
                fprintf(stderr, "moeflow decode: token %d (prompt %d, position %d) is outside the vocabulary of "
                                "%s (vocab_size %" PRId64 ")\n", q->pids[i], s + 1, i, a->dir, c->vocab_size);
                return 2;
            }
        if (q->state == MF_DEC_RUN && a->prompts_file && q->n_pid + a->max_new > c->max_position_embeddings)
            mf_dec_refuse_line(d, s, "the prompt (%d tokens) + --max-new-tokens %ld is past the model's "
                               "max_position_embeddings %" PRId64, q->n_pid, a->max_new, c->max_position_embeddings);
        if (q->state == MF_DEC_RUN) max_prompt = q->n_pid > max_prompt ? q->n_pid : max_prompt;
    }
    d->total = (int64_t)max_prompt + a->max_new;
    if (d->total > c->max_position_embeddings) {
        fprintf(stderr, "moeflow decode: prompt (%d tokens) + --max-new-tokens %ld = %" PRId64
                        " positions, past the model's max_position_embeddings %" PRId64 "\n",
                max_prompt, a->max_new, d->total, c->max_position_embeddings);
        return 2;
    }
    if (!d->tok || c->n_engram <= 0) return 0;
    if ((rc = mf_engram_map_build(d->tok, &d->emap))) return rc;   /* the real Engram token map */
    if (mf_engram_map_n_unique(d->emap) > c->engram_compressed_vocab_size) {
        fprintf(stderr, "moeflow decode: the tokenizer's Engram map has %d unique keys, more than "
                        "engram_compressed_vocab_size %" PRId64 " of %s/config.json\n",
                mf_engram_map_n_unique(d->emap), c->engram_compressed_vocab_size, a->dir);
        return 1;
    }
    return 0;
}

/* The reference forward (with the Engram map and --record-routing's hook), the cards and, for the
 * scheduled engine, the engine over them (cache fill from a routing trace's counts). */
static int mf_dec_engine(mf_dec *d)
{
    const mf_dec_cli *a = d->a;
    const mf_config *c = mf_model_config(d->m);
    mf_ref_opts ro = {.act_quant = a->act_quant};
    if (d->emap) {
        ro.token_map = mf_engram_map_ids(d->emap);
        ro.n_token_map = mf_engram_map_n_vocab(d->emap);
    }
    int rc = 0;
    if (a->record) {
        if ((rc = mf_routing_rec_open(a->record, c->n_layers, c->n_routed_experts, c->n_experts_per_tok, &d->rrec.rec)))
            return rc;
        ro.hooks = (mf_ref_hooks){.user = &d->rrec, .on_route = mf_dec_on_route};
    }
    static mf_profile prof;
    if (a->profile_path) {
        if ((rc = mf_profile_load(a->profile_path, &prof))) return rc;
        d->prof = &prof;
    }
    if ((rc = mf_ref_new(d->m, &ro, &d->r))) return rc;
    if (a->devices && (d->place != MF_STEP_PLACE_HOST || d->dense) && (rc = mf_dev_open(a->devices, &d->dev))) return rc;
    if (d->dev && d->place != MF_STEP_PLACE_HOST && !strncmp(a->fill_spec, "trace:", 6)) {   /* the trace's counts */
        mf_routing *frt = NULL;
        if ((rc = mf_routing_open(a->fill_spec, c->n_layers, c->n_routed_experts, c->n_experts_per_tok, 0, &frt)))
            return rc;
        d->fill_counts = malloc(sizeof *d->fill_counts * (size_t)c->n_layers * c->n_routed_experts);
        if (d->fill_counts) mf_routing_counts(frt, d->fill_counts);
        mf_routing_free(frt);
        if (!d->fill_counts) return mf_error(-ENOMEM, "out of memory");
    }
    if (!a->sched) return 0;
    rc = mf_step_new(d->r, &(mf_step_opts){.n_threads = (int)a->threads, .exact = a->exact, .n_sockets = a->sk.n,
                                           .topology = a->sk.topology, .pin_threads = a->sk.n > 1,
                                           .read_window = (int)a->read_window, .dev = d->dev, .placement = d->place,
                                           .dev_cache_bytes = a->dev_cache,
                                           .dev_cache_fill = strcmp(a->fill_spec, "off") != 0,
                                           .dev_fill_counts = d->fill_counts, .dev_fill_progress = !a->quiet,
                                           .dev_graphs = a->dev_graphs, .dense = d->dense,
                                           .dense_split = a->dense_split, .heads = a->heads, .micro = (int)a->micro,
                                           .lt = a->lt, .profile = d->prof, .io_depth = (int)a->io_depth,
                                           .io_force_pread = mf_tool_io_env.force_pread,
                                           .io_fault_kind = mf_tool_io_env.fault_kind,
                                           .io_fault_nth = mf_tool_io_env.fault_nth}, &d->eng);
    free(d->fill_counts);
    d->fill_counts = NULL;
    return rc;
}

/* What the engine did before the first step: the card caches' fill, the cards' self-check, the
 * dense weights each card holds. */
static void mf_dec_engine_notes(const mf_dec *d)
{
    const mf_dec_cli *a = d->a;
    if (!d->eng) return;
    if (!a->quiet) {
        mf_step_fill_stats fs;
        mf_step_fill(d->eng, &fs);
        if (fs.experts)
            fprintf(stderr, "moeflow decode: warmed the card caches: %" PRId64 " experts, %.1f MB in %.3f s%s\n",
                    fs.experts, fs.bytes / 1e6, fs.wall_ns / 1e9, fs.skipped ? " (some not held by the host: left out)" : "");
    }
    if (mf_step_refused(d->eng)[0]) fprintf(stderr, "moeflow decode: card self-check: %s\n", mf_step_refused(d->eng));
    for (int k = 0, cd = 0; d->dense && mf_step_dense_bytes(d->eng, k, &cd); k++)
        if (!a->quiet)
            fprintf(stderr, "moeflow decode: dense weights on card %d (%s): %.1f MB\n", cd, a->devices,
                    (double)mf_step_dense_bytes(d->eng, k, NULL) / 1e6);
}

/* The batcher over the engine, every prompt submitted (sequence i seeded --seed + i). */
static int mf_dec_submit(mf_dec *d)
{
    const mf_dec_cli *a = d->a;
    d->dc = (mf_dec_ctx){.sq = d->sq, .tok = d->tok, .stream = d->n_seq == 1, .out = d->outf, .quiet = a->quiet,
                         .with_line = a->prompts_file != NULL};
    int rc = mf_tool_prefix_open(&a->pfx, d->r, mf_tool_prefix_numerics(a->sched, a->exact, a->devices),
                                 "moeflow decode", a->quiet, &d->pfx);
    if (rc) return rc;
    rc = mf_batch_new(&(mf_batch_opts){.ref = d->r, .eng = d->eng, .tok = d->tok, .max_batch = d->max_batch,
                                       .step_tokens = (int)d->step_tokens, .max_context = d->total > 1 ? d->total : 2,
                                       .max_queue = d->n_seq, .prefix = d->pfx, .on_event = mf_dec_on_event,
                                       .user = &d->dc}, &d->bat);
    if (rc) return rc;
    d->rrec.b = d->bat;
    if ((rc = mf_dec_write_refused(d))) return rc;
    for (int s = 0; s < d->n_seq; s++) {
        mf_dec_seq *q = &d->sq[s];
        if (q->state != MF_DEC_RUN) continue;
        if (!(q->gen = malloc(sizeof(int32_t) * (size_t)(a->max_new + 1)))) return mf_error(-ENOMEM, "out of memory");
        mf_batch_req rq = {.prompt = q->pids, .n_prompt = q->n_pid, .max_tokens = (int)a->max_new,
                           .temperature = a->temperature, .top_p = a->top_p, .seed = a->seed + (unsigned long long)s,
                           .ignore_eos = a->ignore_eos, .user = q};
        if ((rc = mf_batch_submit(d->bat, &rq, &q->id))) return rc;
    }
    return 0;
}

/* After step d->steps: the IO lane's, the sockets' and the cards' counters into the totals, the
 * cards' and the store's line of the step. */
static void mf_dec_step_stats(mf_dec *d)
{
    const mf_dec_cli *a = d->a;
    mf_step_times tm = {0};
    mf_step_dev_stats x = {0};
    if (d->eng) {
        mf_step_last_times(d->eng, &tm);
        mf_step_last_dev(d->eng, &x);
    }
    if (d->eng && d->mst) {
        d->io_busy_ns += tm.io_busy_ns;
        d->io_overlap_ns += tm.io_overlap_ns;
        d->ex_busy_ns += tm.expert_busy_ns;
    }
    if (d->eng && a->sk.n > 1) {   /* where the host expert slots ran */
        d->sock_home += x.sock_home;
        d->sock_cross += x.sock_cross;
        d->dense_home += x.dense_home;
        d->dense_cross += x.dense_cross;
    }
    if (d->dev) {
        mf_step_dev_stats *t = &d->dtot;
        d->cp_busy_ns += tm.copy_busy_ns;
        d->cp_overlap_ns += tm.copy_overlap_ns;
        d->cm_busy_ns += tm.compute_busy_ns;
        t->dev_slots += x.dev_slots, t->host_slots += x.host_slots, t->hits += x.hits;
        t->misses += x.misses, t->bytes_in += x.bytes_in, t->evictions += x.evictions;
        t->host_fallbacks += x.host_fallbacks;
        t->lt_linears += x.lt_linears, t->lt_slots += x.lt_slots;
        t->n_cards = x.n_cards, t->cache_slots = x.cache_slots;
        if (!a->quiet)
            fprintf(stderr, "moeflow decode: step %ld devices: %" PRId64 " expert slots on cards, %" PRId64
                    " on the host; cache %" PRIu64 " hits, %" PRIu64 " misses, %" PRIu64 " evictions, %.2f MiB "
                    "copied in; copies %.2f ms, overlapping expert compute %.2f ms\n", d->steps, x.dev_slots,
                    x.host_slots, x.hits, x.misses, x.evictions, x.bytes_in / 1048576.0, tm.copy_busy_ns / 1e6,
                    tm.copy_overlap_ns / 1e6);
    }
    if (d->mst && !a->quiet) mf_print_step(d->mst, "step", d->steps, a->sched);
}

/* The signals of an interrupted run (mf_dec_run): how many came, the first one. */
static volatile sig_atomic_t mf_dec_n_sig, mf_dec_first_sig;

static void mf_dec_on_signal(int sig)
{
    if (!mf_dec_n_sig) mf_dec_first_sig = sig;
    if (mf_dec_n_sig < 2) mf_dec_n_sig++;
}

/* With --prompts, from the first record written to the exit: SIGINT and SIGTERM are taken
 * (counted; the step loop acts on them), so the process never dies in mid-record or before its
 * summary. Before (loading the model), and with --prompt or --tokens, a signal ends it as before. */
static void mf_dec_catch(const mf_dec *d)
{
    if (!d->a->prompts_file) return;
    struct sigaction sa = {.sa_handler = mf_dec_on_signal, .sa_flags = SA_RESTART};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

/* After a signal: the first cancels the prompts not generating yet (queued, or in their prefill);
 * the second the rest. `seen` is how many signals were acted on. */
static void mf_dec_interrupt(mf_dec *d, int *seen)
{
    int n = mf_dec_n_sig;
    if (n <= *seen) return;
    d->sig = mf_dec_first_sig;
    for (int s = 0; s < d->n_seq; s++) {
        const mf_dec_seq *q = &d->sq[s];
        if (q->state == MF_DEC_RUN && !q->done && (n > 1 || q->n_gen == 0)) mf_batch_cancel(d->bat, q->id);
    }
    if (!d->a->quiet || n > 1)
        fprintf(stderr, "\nmoeflow decode: %s: %s\n", d->sig == SIGINT ? "SIGINT" : "SIGTERM",
                n > 1 ? "cancelling the prompts still generating" :
                        "no new prompts start; the ones generating finish (signal again to cancel them)");
    *seen = n;
}

/* Steps the batcher until every prompt has finished (or an interruption has ended them), the
 * progress line once a second; the signals taken since mf_dec_catch act between steps
 * (mf_dec_interrupt). */
static int mf_dec_run(mf_dec *d)
{
    const mf_dec_cli *a = d->a;
    int64_t next_progress = (d->t0 = mf_now_ns()) + 1000000000;
    d->dc.t0 = d->t0;
    if (d->mst) mf_store_step(d->mst, NULL);
    int seen = 0, rc = 0;
    for (;;) {
        mf_dec_interrupt(d, &seen);
        int n_items = 0;
        if ((rc = mf_batch_step(d->bat, &n_items))) break;
        if (!n_items) break;
        d->steps++;
        mf_dec_step_stats(d);
        int64_t now = mf_now_ns();
        if (!a->quiet && d->n_seq > 1 && now >= next_progress) {
            mf_dec_progress(&d->dc, d->n_seq - d->n_bad - d->n_had, now, 0);
            next_progress = now + 1000000000;
        }
    }
    mf_dec_interrupt(d, &seen);   /* one that came during the last step */
    if (rc) return rc;
    if (d->dc.rc) return mf_error(d->dc.rc, "%s", d->dc.msg);
    d->t2 = mf_now_ns();
    if (!a->quiet && d->n_seq > 1 && !d->sig) mf_dec_progress(&d->dc, d->n_seq - d->n_bad - d->n_had, d->t2, 1);
    return 0;
}

/* The outputs: the sequences' lines (one sequence was streamed), --output closed, the routing
 * trace closed (removed when a hook failed), the Chrome trace. */
static int mf_dec_outputs(mf_dec *d)
{
    const mf_dec_cli *a = d->a;
    if (d->n_seq == 1 && d->sq[0].state == MF_DEC_RUN) putchar('\n');
    else mf_dec_print_lines(d);
    fflush(stdout);
    if (d->outf >= 0) {
        int bad = close(d->outf);
        d->outf = -1;
        if (bad) return mf_error(-EIO, "--output %s: write failed", a->outfile);
    }
    if (d->rrec.rec) {
        mf_routing_rec *w = d->rrec.rec;
        d->rrec.rec = NULL;
        if (d->rrec.rc) {
            mf_routing_rec_close(w);
            unlink(a->record);
            return mf_error(d->rrec.rc, "--record-routing: %s", d->rrec.msg);
        }
        int rc = mf_routing_rec_close(w);
        if (rc) return rc;
        if (!a->quiet) fprintf(stderr, "moeflow decode: routing trace written to %s\n", a->record);
    }
    if (a->trace) return a->sched ? mf_step_write_trace(d->eng, a->trace) : mf_store_write_trace(d->mst, a->trace);
    return 0;
}

/* The totals on stderr: the expert store's, the sockets', the cards', then the run's rates. */
static void mf_dec_report(const mf_dec *d)
{
    const mf_dec_cli *a = d->a;
    if (a->quiet) return;
    if (d->mst) {
        mf_store_stats x;
        mf_store_stats_total(d->mst, &x);
        fprintf(stderr, "moeflow decode: expert store total: %" PRIu64 " hits, %" PRIu64 " misses "
                "(hit rate %.1f%%), %.2f GiB read", x.hits, x.misses,
                100.0 * x.hits / (double)(x.hits + x.misses ? x.hits + x.misses : 1), x.bytes_read / 1073741824.0);
        if (a->sched)
            fprintf(stderr, "\nmoeflow decode: scheduled engine steps: IO lane busy %.3f s, expert compute "
                    "%.3f s, overlapping %.3f s (%.1f%% of IO busy, %.1f%% of expert compute)\n", d->io_busy_ns / 1e9,
                    d->ex_busy_ns / 1e9, d->io_overlap_ns / 1e9,
                    d->io_busy_ns ? 100.0 * d->io_overlap_ns / d->io_busy_ns : 0.0,
                    d->ex_busy_ns ? 100.0 * d->io_overlap_ns / d->ex_busy_ns : 0.0);
        else
            fprintf(stderr, " in %.2f s of store runs (reads + expert compute); io overlapping compute %.1f%% "
                    "of io busy time\n", x.read_wall_ns / 1e9, x.io_busy_ns ? 100.0 * x.overlap_ns / x.io_busy_ns : 0.0);
    }
    if (a->sched && a->sk.n > 1)
        fprintf(stderr, "moeflow decode: %d sockets: %" PRId64 " host expert part weights read by the workers of "
                "the socket holding their rows, %" PRId64 " by another's; %" PRId64 " dense part weights by the "
                "socket holding their rows, %" PRId64 " by another's\n", a->sk.n, d->sock_home, d->sock_cross,
                d->dense_home, d->dense_cross);
    const mf_step_dev_stats *t = &d->dtot;
    if (d->dev)
        fprintf(stderr, "moeflow decode: devices (%s, %s placement, %d cache slots per card) steps: %" PRId64
                " expert slots on cards, %" PRId64 " on the host (%" PRId64 " for want of a free cache slot); "
                "cache hit rate %.1f%% (%" PRIu64 " hits, %" PRIu64 " misses), %.2f GiB copied in; copies busy %.3f s, "
                "expert compute %.3f s, overlapping %.3f s (%.1f%% of copy time); cuBLASLt: %" PRId64 " dense linear "
                "launches, %" PRId64 " expert slots\n", a->devices, d->placement,
                t->n_cards ? t->cache_slots : 0, t->dev_slots, t->host_slots, t->host_fallbacks,
                100.0 * t->hits / (double)(t->hits + t->misses ? t->hits + t->misses : 1), t->hits,
                t->misses, t->bytes_in / 1073741824.0, d->cp_busy_ns / 1e9, d->cm_busy_ns / 1e9,
                d->cp_overlap_ns / 1e9, d->cp_busy_ns ? 100.0 * d->cp_overlap_ns / d->cp_busy_ns : 0.0, t->lt_linears,
                t->lt_slots);
    long out_tokens = 0;
    for (int s = 0; s < d->n_seq; s++) out_tokens += d->sq[s].n_gen;
    mf_batch_stats bs;
    mf_batch_get_stats(d->bat, &bs);
    double sec = (d->t2 - d->t0) / 1e9;
    fprintf(stderr, "moeflow decode (%s engine%s, %d sequence%s, batch %d, step budget %ld): %ld steps in %.3f s; "
                    "prefill %" PRId64 " tokens (%.2f tokens/s), decode %" PRId64 " tokens (%.2f tokens/s "
                    "aggregate); %ld tokens out (%.2f tokens/s); first token after %.3f s (median)\n",
            mf_opt_word_name(mf_dec_engines, a->sched), a->sched ? (a->exact ? ", fp32 experts" : ", int8 experts") : "",
            d->n_seq, d->n_seq > 1 ? "s" : "", bs.n_states, d->step_tokens, d->steps, sec, bs.prefill_items,
            bs.prefill_items / sec, bs.decode_items, bs.decode_items / sec, out_tokens, out_tokens / sec,
            mf_dec_median_ttft(d->sq, d->n_seq));
    mf_tool_prefix_report(d->pfx, "moeflow decode", stderr);
}

/* After a run with refused lines or an interruption: what became of the prompts, on stderr (with
 * --quiet too), and the exit code: 130 / 143 interrupted (SIGINT / SIGTERM), 3 with refused lines,
 * else 0. */
static int mf_dec_summary(const mf_dec *d)
{
    int done = 0, cancelled = 0, not_started = 0;
    for (int s = 0; s < d->n_seq; s++) {
        const mf_dec_seq *q = &d->sq[s];
        if (q->state != MF_DEC_RUN) continue;
        if (q->done && q->finish != MF_BATCH_CANCELLED) done++;
        else if (q->done && q->admit_ns) cancelled++;
        else not_started++;
    }
    int refused = d->n_bad + d->n_had_bad;
    if (!d->sig && !refused) return 0;
    const char *out = d->a->outfile;
    if (d->sig)
        fprintf(stderr, "moeflow decode: interrupted by %s: %d prompts done, %d cancelled, %d not started",
                d->sig == SIGINT ? "SIGINT" : "SIGTERM", done, cancelled, not_started);
    else
        fprintf(stderr, "moeflow decode: %d prompts done", done);
    if (refused)
        fprintf(stderr, ", %d line%s refused (error records%s)", refused, refused > 1 ? "s" : "", out ? " in --output" : " above");
    if (d->n_had) fprintf(stderr, ", %d were in --output already", d->n_had);
    fprintf(stderr, "%s%s%s\n", d->sig && out ? "; `--resume` with the same --output runs the rest (" : "",
            d->sig && out ? out : "", d->sig && out ? " holds whole lines only)" : "");
    return d->sig == SIGINT ? 130 : d->sig ? 143 : 3;
}

static void mf_dec_close(mf_dec *d)
{
    free(d->fill_counts);
    if (d->rrec.rec) {   /* failed before the end: no partial trace is left behind */
        mf_routing_rec_close(d->rrec.rec);
        unlink(d->a->record);
    }
    mf_batch_free(d->bat);
    mf_prefix_free(d->pfx);
    mf_step_free(d->eng);
    mf_dev_close(d->dev);
    mf_ref_free(d->r);
    mf_model_free(d->m);
    mf_engram_map_free(d->emap);
    mf_dec_prompts_free(d);
}

int mf_cmd_decode(int argc, char **argv)
{
    mf_dec_cli a = {.threads = sysconf(_SC_NPROCESSORS_ONLN), .placement = -1, .dense = -1,
                    .dev_graphs = mf_tool_env_on("MOEFLOW_DEV_GRAPHS")};   /* --dev-graphs */
    if (a.threads < 1) a.threads = 1;
    int rc = mf_opts_parse(&mf_dec_spec, argc, argv, &a);
    if (rc != MF_OPTS_RUN) return rc;
    static mf_dec d;
    d = (mf_dec){.a = &a, .outf = -1};
    if ((rc = mf_dec_check(&a, &d))) return rc;
    rc = mf_dec_prompts(&d);
    if (!rc) rc = mf_dec_model(&d);
    if (!rc) rc = mf_dec_engine(&d);
    if (!rc) mf_dec_engine_notes(&d);
    if (!rc) mf_dec_catch(&d);
    if (!rc) rc = mf_dec_submit(&d);
    if (!rc) rc = mf_dec_run(&d);
    if (!rc) rc = mf_dec_outputs(&d);
    if (!rc && !d.sig) mf_dec_report(&d);
    if (!rc) rc = mf_dec_summary(&d);
    if (rc < 0) fprintf(stderr, "moeflow decode: %s\n", mf_last_error()[0] ? mf_last_error() : "out of memory");
    mf_dec_close(&d);
    return rc < 0 ? 1 : rc;
}
