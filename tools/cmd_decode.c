/* `moeflow decode`: decodes on a checkpoint with the scheduled engine (graphs/step/step.h, default) or
 * the plain reference forward (graphs/ref/ref.h): prefill of one prompt or a batch of prompts (text
 * through the checkpoint's tokenizer.json, or token ids), then greedy or seeded temperature/top-p
 * decoding of all sequences at once, streamed (one sequence) or printed per sequence, ending with
 * prefill and aggregate decode tokens/s. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "device/dev.h"
#include <jansson.h>

#include "graphs/step/batch.h"
#include "graphs/model/engram_map.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/sim/routing.h"
#include "graphs/step/sample.h"
#include "graphs/step/step.h"
#include "graphs/step/stepgraph.h"
#include "host/store.h"
#include "host/tokenizer.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "sched/path.h"
#include "sched/profile.h"
#include "tools/commands.h"
#include "tools/serve_req.h"
#include "tools/sim_common.h"

static void mf_decode_usage(FILE *f)
{
    fprintf(f,
            "usage: moeflow decode --checkpoint DIR (--prompt TEXT | --tokens IDS | --prompts FILE)\n"
            "                      [--engine scheduled|reference] [--threads N] [--sockets N|auto]\n"
            "                      [--exact] [--batch B]\n"
            "                      [--step-tokens N] [--output FILE.jsonl]\n"
            "                      [--max-new-tokens N] [--temperature T --top-p P --seed S]\n"
            "                      [--no-bos] [--ignore-eos] [--act-quant] [--quiet] [--trace FILE]\n"
            "                      [--chat [--chat-template FILE|builtin]]\n"
            "                      [--store resident|streamed [--store-budget SIZE]\n"
            "                       [--store-tables resident|streamed] [--io-depth N]]\n"
            "                      [--devices emu:N|cuda[:IDS] [--placement seed|host|hybrid] [--dense host|cards]\n"
            "                       [--dense-split layers|rows] [--heads cost|cards|host]\n"
            "                       [--dev-cache SIZE] [--dev-cache-fill on|off|trace:FILE] [--dev-graphs] [--profile P]] [--record-routing FILE]\n\n"
            "Decodes with the scheduled engine (a task graph per step on --threads workers: experts\n"
            "and head on fused kernels, see docs/decode.md) or the plain reference forward (fp32,\n"
            "one thread: the correctness oracle). Every prompt goes through the continuous batcher\n"
            "(graphs/step/batch.h, docs/serve.md): up to B sequences per step, each step a decode token\n"
            "of every running sequence plus prefill chunks of new ones under --step-tokens; a\n"
            "finished sequence's place goes to the next prompt at the next step. Each sequence's\n"
            "tokens are the ones it gets decoded alone. One sequence is streamed: text when DIR has\n"
            "a tokenizer.json, token ids otherwise; several are printed one line each, '[i] ...',\n"
            "with a progress line (done/total, tokens/s, ETA) on stderr. Ends with prefill and\n"
            "aggregate decode tokens/s on stderr.\n\n"
            "  --checkpoint DIR    config.json + safetensors (e.g. from `moeflow gen`)\n"
            "  --prompt TEXT       text, encoded with DIR/tokenizer.json (BOS prepended)\n"
            "  --tokens IDS        token ids, comma or space separated, used as given\n"
            "  --prompts FILE      one prompt per line, any number of lines (text with a tokenizer,\n"
            "                      else token ids); empty lines are skipped\n"
            "  --batch B           sequences decoded at once (1..64): with --prompts every line\n"
            "                      runs, B at a time (default: all, at most 64); with --prompt or\n"
            "                      --tokens, B copies of it\n"
            "  --step-tokens N     items per step (default %d; one sequence on the scheduled\n"
            "                      engine: %d, its prompt in the engine's prefill chunks):\n"
            "                      decode tokens first, then prefill\n"
            "                      chunks; smaller N cuts long prompts into more steps; a step\n"
            "                      of one sequence's prefill alone runs as one graph of up to\n"
            "                      8192 positions (long chunks), mixed steps in graphs of 64\n"
            "  --output FILE       one JSON object per prompt as it finishes: index, prompt, text\n"
            "                      (with a tokenizer), tokens, prompt_tokens, finish_reason (eos or\n"
            "                      length), queue_s, first_token_s, total_s\n"
            "  --engine E          scheduled (default) or reference\n"
            "  --threads N         scheduled engine workers (default: the online CPUs)\n"
            "  --sockets N|auto    scheduled engine: one CPU lane per socket (NUMA node with cores;\n"
            "                      auto: all hwloc finds), the --threads workers split across them\n"
            "                      by cores and pinned there; each routed expert's rows are split\n"
            "                      across the sockets, each share run by the workers of the socket\n"
            "                      whose memory holds it (--store resident binds the shares to the\n"
            "                      sockets' nodes, one copy, bound with hwloc;\n"
            "                      a node that does not exist is a one-line note). Logits as with\n"
            "                      one lane. MOEFLOW_TOPOLOGY=DESC|FILE.xml: an hwloc synthetic or\n"
            "                      XML topology instead of this machine's (tests). Default auto\n"
            "                      (one lane on a machine with one NUMA node, as before)\n"
            "  --exact             scheduled engine: fp32 kernel path for the FP4 experts (matches\n"
            "                      the reference to ~1e-7) instead of the int8 path (~1%% per matmul)\n"
            "  --max-new-tokens N  tokens to generate (default 16)\n"
            "  --temperature T     0 (default) = greedy; > 0 samples\n"
            "  --top-p P           nucleus mass in (0, 1] (default 1)\n"
            "  --seed S            sampling seed (default 0)\n"
            "  --no-bos            do not prepend bos_token_id to --prompt\n"
            "  --chat              each prompt is one user message, rendered with the chat template\n"
            "                      as `moeflow serve` renders /v1/chat/completions: DIR's\n"
            "                      tokenizer_config.json chat_template (no BOS id prepended: the\n"
            "                      template writes it), else the built-in DeepSeek-V3 format\n"
            "  --chat-template T   with --chat: FILE (a template, or a tokenizer_config.json) or\n"
            "                      builtin, instead of DIR's\n"
            "  --ignore-eos        keep going after eos_token_id\n"
            "  --act-quant         quantize linear inputs to e4m3 as DeepSeek's inference code\n"
            "                      does (default: the Hugging Face port, which does not);\n"
            "                      reference engine only\n"
            "  --trace FILE        Chrome trace of the last step: the scheduled engine's task\n"
            "                      graph (with --store its IO-lane expert reads), or with the\n"
            "                      reference engine and --store the store's reads and compute\n"
            "  --store MODE        experts and Engram tables through the expert store: resident\n"
            "                      (read in at load) or streamed (a cache, misses read per use\n"
            "                      through io_uring; the scheduled engine reads them on its IO\n"
            "                      lane inside the step graph); per-step hits/misses on stderr\n"
            "  --store-budget SIZE streamed cache bytes, e.g. 2G, 512M (default 2G)\n"
            "  --store-tables MODE Engram tables resident or streamed (default: as --store)\n"
            "  --io-depth N        reads in flight (default 64)\n"
            "  --read-window N     scheduled engine with --store: experts of a layer whose reads\n"
            "                      are in flight at once, in slot order (default 2; -1: all)\n"
            "  --devices SPEC      routed experts on devices (scheduled engine): emu:N emulated\n"
            "                      cards (emu:N,mem=SIZE,bw=B/S,lat_ns=NS) or cuda, cuda:0,1\n"
            "  --dense D           cards: the dense work (attention linears, router gate, shared\n"
            "                      expert, head) on the cards (split as --dense-split), activations copied per\n"
            "                      sublayer, weights resident on the cards (default with emu:N devices;\n"
            "                      on CUDA cards only when asked: never run on a GPU yet); host: on the\n"
            "                      host (default otherwise)\n"
            "  --dense-split S     with --dense cards: layers (each layer's dense work on one card) or\n"
            "                      rows (default: every dense matrix but the shared expert split by\n"
            "                      output rows across all cards; either gives the host's logits bit for\n"
            "                      bit on emulated cards)\n"
            "  --heads H           with --dense cards: the attention heads' scores and values of one\n"
            "                      sequence's positions (prefill chunks, batch 1) per layer by the cost\n"
            "                      model on --profile (cost, the default), on the cards wherever they\n"
            "                      can, or on the host (host logits bit for bit on emulated cards)\n"
            "  --micro-batches M   scheduled engine, batch >= 2: 2 splits the batch into two halves\n"
            "                      in flight at once (one half's routed experts beside the other's\n"
            "                      attention; the same logits bit for bit); 1: one (default)\n"
            "  --placement P       seed: routed experts on the card owning them; hybrid: per\n"
            "                      expert and step the cheaper of host and card by the lanes'\n"
            "                      cost models (default with --devices); host: all on the\n"
            "                      host (default without). Per-step device lines on stderr\n"
            "  --dev-cache SIZE    expert cache bytes per card (default: every expert, or as\n"
            "                      many as the card holds)\n"
            "  --dev-cache-fill F  on (default): fill each card's expert cache before the first\n"
            "                      token, spread evenly over layers (progress on stderr); trace:FILE:\n"
            "                      the experts a --record-routing trace routes most first; off: the\n"
            "                      caches start empty\n"
            "  --dev-graphs        per layer and card, the device FFNs of all slots as one graph\n"
            "                      (a CUDA graph on CUDA cards; docs/device.md); also with the\n"
            "                      environment variable MOEFLOW_DEV_GRAPHS=1\n"
            "  --profile P         hardware profile (docs/profiles.md, `moeflow calibrate`) whose\n"
            "                      host fp4, h2d and card fp4 rates are the lanes' cost models\n"
            "                      that hybrid placement weighs (default: built-in assumptions,\n"
            "                      host 20 GB/s per worker, copies 25 GB/s + 10 us, cards 20 GB/s)\n"
            "  --record-routing FILE  write the routed experts of every token (prefill and\n"
            "                      decode, every sequence and layer) to FILE, a routing trace\n"
            "                      for `moeflow sim --routing trace:FILE`; it records through the\n"
            "                      reference's on_route hook, and with a hook set the scheduled\n"
            "                      engine runs its serial graph (a batch's per-sequence parts one\n"
            "                      after another), so timings differ from a run without it\n"
            "  --quiet             no progress or timing on stderr\n", MF_BATCH_STEP_TOKENS, MF_STEP_PREFILL_CHUNK);
}

static int mf_parse_tokens(const char *s, int32_t **out, int *n_out)
{
    int cap = 16, n = 0;
    int32_t *t = malloc(sizeof *t * (size_t)cap);
    if (!t) return -ENOMEM;
    const char *p = s;
    for (;;) {
        while (*p == ',' || *p == ' ' || *p == '\t' || *p == '\n') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX || (*end && *end != ',' && *end != ' ' &&
                                                           *end != '\t' && *end != '\n')) {
            free(t);
            return mf_error(-EINVAL, "--tokens: expected non-negative integers separated by commas "
                            "or spaces, found '%.20s'", p);
        }
        if (n == cap) {
            int32_t *u = realloc(t, sizeof *t * (size_t)(cap *= 2));
            if (!u) {
                free(t);
                return -ENOMEM;
            }
            t = u;
        }
        t[n++] = (int32_t)v;
        p = end;
    }
    if (n == 0) {
        free(t);
        return mf_error(-EINVAL, "--tokens: no token ids given");
    }
    *out = t;
    *n_out = n;
    return 0;
}

static void mf_emit_token(const mf_tok *tok, int32_t id, int first)
{
    if (tok) {
        char buf[1024];
        int n = mf_tok_token_bytes(tok, id, buf, sizeof buf);
        if (n > 0) fwrite(buf, 1, (size_t)(n < (int)sizeof buf ? n : (int)sizeof buf), stdout);
        else if (n < 0) printf("<%d>", id);
    } else {
        printf(first ? "%d" : " %d", id);
    }
    fflush(stdout);
}



static int mf_parse_store_mode(const char *t)
{
    return !strcmp(t, "resident") ? MF_MODEL_STORE_RESIDENT
           : !strcmp(t, "streamed") ? MF_MODEL_STORE_STREAMED : -1;
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

/* Prompt text or ids -> token ids (BOS first for text unless no_bos; bos fixed up after load). */
static int mf_prompt_ids(const mf_tok *tok, const char *text, const char *ids, int no_bos, int32_t **out, int *n_out)
{
    if (ids) return mf_parse_tokens(ids, out, n_out);
    size_t len = strlen(text), cap = len + 2, n = 0;
    int32_t *p = malloc(sizeof *p * cap);
    if (!p) return mf_error(-ENOMEM, "out of memory");
    int rc = mf_tok_encode(tok, text, len, p + 1, cap - 1, &n);
    if (rc) {
        free(p);
        return rc;
    }
    int np = (int)n + 1;
    p[0] = 0;
    if (no_bos) memmove(p, p + 1, sizeof *p * (size_t)--np);
    if (np == 0) {
        free(p);
        return mf_error(-EINVAL, "the prompt '%.40s' encodes to no tokens", text);
    }
    *out = p;
    *n_out = np;
    return 0;
}

/* One prompt of the run and what it produced. */
typedef struct mf_dec_seq {
    int index;
    const char *line;      /* the prompt as given */
    int32_t *pids, *gen;
    int n_pid;
    long n_gen;
    int done, finish;
    int64_t submit_ns, admit_ns, first_ns, done_ns;
} mf_dec_seq;

typedef struct mf_dec_ctx {
    mf_dec_seq *sq;
    const mf_tok *tok;
    int stream;            /* one sequence: print tokens as they come */
    FILE *out;             /* --output JSONL, or NULL */
    int quiet, n_done, rc;
    int64_t t0, generated;
    char msg[MF_ERROR_MSG_BYTES];
} mf_dec_ctx;

/* --record-routing: the on_route hook writes each (sequence, position, layer) record; the state
 * it names belongs to the running request the batcher gives back. */
typedef struct mf_route_rec_ctx {
    mf_routing_rec *rec;
    mf_batch *b;
    int rc;   /* first failure, its message in msg (hooks run on worker threads) */
    char msg[MF_ERROR_MSG_BYTES];
} mf_route_rec_ctx;

static void mf_on_route_record(void *user, const void *seq, int64_t pos, int layer, const int32_t *experts,
                               const float *weights, int n)
{
    mf_route_rec_ctx *x = user;
    const mf_dec_seq *q = mf_batch_state_user(x->b, seq);
    int rc = mf_routing_rec_add(x->rec, q ? q->index : 0, pos, layer, experts, n), zero = 0;
    (void)weights;
    if (rc && __atomic_compare_exchange_n(&x->rc, &zero, rc, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        snprintf(x->msg, sizeof x->msg, "%s", mf_last_error());
}

/* --output: one JSON object per finished prompt (in the order they finish). */
static int mf_dec_write_jsonl(mf_dec_ctx *x, const mf_dec_seq *q)
{
    json_t *o = json_object(), *ids = json_array();
    for (long k = 0; k < q->n_gen; k++) json_array_append_new(ids, json_integer(q->gen[k]));
    json_object_set_new(o, "index", json_integer(q->index));
    json_t *pl = json_string(q->line);   /* NULL when the line is not UTF-8 */
    json_object_set_new(o, "prompt", pl ? pl : json_null());
    if (x->tok) {
        size_t cap = 64 + (size_t)q->n_gen * 64, nb = 0;
        char *t = malloc(cap);
        int rc = t ? mf_tok_decode(x->tok, q->gen, (size_t)q->n_gen, 0, t, cap, &nb) : -ENOMEM;
        if (rc == -ENOSPC) {
            char *u = realloc(t, nb + 1);
            rc = u ? mf_tok_decode(x->tok, q->gen, (size_t)q->n_gen, 0, t = u, nb + 1, &nb) : -ENOMEM;
        }
        json_t *js = rc ? NULL : json_stringn(t, nb);
        json_object_set_new(o, "text", js ? js : json_null());
        free(t);
    }
    json_object_set_new(o, "tokens", ids);
    json_object_set_new(o, "prompt_tokens", json_integer(q->n_pid));
    json_object_set_new(o, "finish_reason", json_string(mf_batch_finish_name((mf_batch_finish)q->finish)));
    json_object_set_new(o, "queue_s", json_real((q->admit_ns - q->submit_ns) / 1e9));
    json_object_set_new(o, "first_token_s", json_real(q->first_ns ? (q->first_ns - q->submit_ns) / 1e9 : 0.0));
    json_object_set_new(o, "total_s", json_real((q->done_ns - q->submit_ns) / 1e9));
    char *line = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    int rc = line && fprintf(x->out, "%s\n", line) > 0 ? 0 : -EIO;
    free(line);
    return rc;
}

static void mf_dec_on_event(void *user, const mf_batch_event *ev)
{
    mf_dec_ctx *x = user;
    mf_dec_seq *q = ev->user;
    if (ev->kind == MF_BATCH_TOKEN) {
        q->gen[q->n_gen++] = ev->token;
        x->generated++;
        if (x->stream) mf_emit_token(x->tok, ev->token, q->n_gen == 1);
        return;
    }
    q->done = 1;
    q->finish = ev->finish;
    q->submit_ns = ev->submit_ns;
    q->admit_ns = ev->admit_ns;
    q->first_ns = ev->first_ns;
    q->done_ns = ev->now_ns;
    x->n_done++;
    if (ev->finish == MF_BATCH_ERROR && !x->rc) {
        x->rc = ev->err;
        snprintf(x->msg, sizeof x->msg, "%s", ev->msg ? ev->msg : "forward failed");
    }
    if (x->out && mf_dec_write_jsonl(x, q) && !x->rc) {
        x->rc = -EIO;
        snprintf(x->msg, sizeof x->msg, "--output: write failed");
    }
}

/* The progress line: done/total, generated tokens/s, ETA (from the rate of finished prompts). */
static void mf_dec_progress(const mf_dec_ctx *x, int total, int64_t now, int last)
{
    double sec = (now - x->t0) / 1e9;
    int tty = isatty(2);
    char eta[32] = "-";
    if (x->n_done > 0 && x->n_done < total)
        snprintf(eta, sizeof eta, "%.0f s", sec / x->n_done * (total - x->n_done));
    else if (x->n_done == total)
        snprintf(eta, sizeof eta, "0 s");
    fprintf(stderr, "%smoeflow decode: %d/%d done, %.2f tokens/s, ETA %s%s", tty ? "\r" : "", x->n_done, total,
            sec > 0 ? x->generated / sec : 0.0, eta, tty && !last ? "   " : "\n");
}

static double mf_dec_median_ttft(const mf_dec_seq *sq, int n)
{
    double v[64];
    int k = 0;
    for (int i = 0; i < n && k < 64; i += n / 64 + 1)   /* a sample of at most 64 */
        if (sq[i].first_ns) v[k++] = (sq[i].first_ns - sq[i].submit_ns) / 1e9;
    for (int i = 1; i < k; i++)
        for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return k ? v[k / 2] : 0.0;
}

/* Reads FILE's non-empty lines (newline stripped) into a NULL-terminated array of strings. */
static int mf_read_lines(const char *path, char ***out, int *n_out)
{
    FILE *f = fopen(path, "r");
    if (!f) return mf_error(-errno, "--prompts %s: cannot open: %s", path, strerror(errno));
    char **lines = NULL, *buf = NULL;
    size_t cap_b = 0;
    int n = 0, cap = 0, rc = 0;
    ssize_t len;
    while ((len = getline(&buf, &cap_b, f)) >= 0) {
        while (len > 0 && (buf[len - 1] == '\n' || buf[len - 1] == '\r')) buf[--len] = 0;
        if (len == 0) continue;
        if (n + 1 >= cap) {
            char **l = realloc(lines, sizeof *l * (size_t)(cap = cap ? cap * 2 : 16));
            if (!l) {
                rc = mf_error(-ENOMEM, "out of memory");
                break;
            }
            lines = l;
        }
        if (!(lines[n] = strdup(buf))) {
            rc = mf_error(-ENOMEM, "out of memory");
            break;
        }
        lines[++n] = NULL;
    }
    free(buf);
    fclose(f);
    if (!rc && n == 0) rc = mf_error(-EINVAL, "--prompts %s: no prompts (no non-empty lines)", path);
    if (rc) {
        for (int i = 0; i < n; i++) free(lines[i]);
        free(lines);
        return rc;
    }
    *out = lines;
    *n_out = n;
    return 0;
}

int mf_cmd_decode(int argc, char **argv)
{
    const char *dir = NULL, *prompt = NULL, *ids = NULL, *prompts_file = NULL, *engine = "scheduled";
    const char *outfile = NULL, *chat_spec = NULL;
    int chat = 0;
    mf_chat_tmpl *ct = NULL;
    long max_new = 16, batch = 0, threads = sysconf(_SC_NPROCESSORS_ONLN), step_tokens = 0;
    double temperature = 0, top_p = 1.0;
    unsigned long long seed = 0;
    int no_bos = 0, ignore_eos = 0, act_quant = 0, quiet = 0, exact = 0;
    int dev_graphs = mf_tool_env_on("MOEFLOW_DEV_GRAPHS");   /* --dev-graphs */
    int store_mode = 0, store_tables = 0;
    long io_depth = 0, read_window = 0, micro = 1;
    uint64_t store_budget = 0;
    const char *trace = NULL, *devices = NULL, *placement = NULL, *record = NULL, *dense_s = NULL;
    int dense_split = MF_TOOL_DENSE_SPLIT, heads = MF_SG_HEADS_COST;
    uint64_t dev_cache = 0;
    const char *fill_spec = MF_TOOL_DEV_CACHE_FILL ? "on" : "off";
    uint32_t *fill_counts = NULL;
    const char *profile_path = NULL;
    static mf_profile prof;
    mf_tool_sockets sk = {.n = 0};   /* 0: --sockets not given (auto)*/
    if (threads < 1) threads = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int hv = i + 1 < argc;
        char *end = NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            mf_decode_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--checkpoint") && hv) {
            dir = argv[++i];
        } else if (!strcmp(a, "--prompt") && hv) {
            prompt = argv[++i];
        } else if (!strcmp(a, "--tokens") && hv) {
            ids = argv[++i];
        } else if (!strcmp(a, "--prompts") && hv) {
            prompts_file = argv[++i];
        } else if (!strcmp(a, "--chat")) {
            chat = 1;
        } else if (!strcmp(a, "--chat-template") && hv) {
            chat_spec = argv[++i];
        } else if (!strcmp(a, "--engine") && hv) {
            engine = argv[++i];
            if (strcmp(engine, "scheduled") && strcmp(engine, "reference")) {
                fprintf(stderr, "moeflow decode: --engine: expected scheduled or reference, found '%s'\n", engine);
                return 2;
            }
        } else if ((!strcmp(a, "--threads") || !strcmp(a, "--batch")) && hv) {
            long v = strtol(argv[++i], &end, 10);
            int is_b = !strcmp(a, "--batch");
            if (*end || !*argv[i] || v < 1 || v > (is_b ? MF_STEP_MAX_ITEMS : 256)) {
                fprintf(stderr, "moeflow decode: %s: expected 1..%d, found '%s'\n", a,
                        is_b ? MF_STEP_MAX_ITEMS : 256, argv[i]);
                return 2;
            }
            *(is_b ? &batch : &threads) = v;
        } else if (!strcmp(a, "--sockets") && hv) {
            if (mf_tool_sockets_arg("decode", argv[++i], &sk)) return 2;
        } else if (!strcmp(a, "--step-tokens") && hv) {
            step_tokens = strtol(argv[++i], &end, 10);
            if (*end || !*argv[i] || step_tokens < 1 || step_tokens > 65536) {
                fprintf(stderr, "moeflow decode: --step-tokens: expected 1..65536, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--output") && hv) {
            outfile = argv[++i];
        } else if (!strcmp(a, "--exact")) {
            exact = 1;
        } else if (!strcmp(a, "--max-new-tokens") && hv) {
            max_new = strtol(argv[++i], &end, 10);
            if (*end || !*argv[i] || max_new < 0 || max_new > INT32_MAX) {
                fprintf(stderr, "moeflow decode: --max-new-tokens: expected 0..2147483647, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--temperature") && hv) {
            temperature = strtod(argv[++i], &end);
            if (*end || !*argv[i] || !(temperature >= 0) || temperature > 100) {
                fprintf(stderr, "moeflow decode: --temperature: expected 0..100, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--top-p") && hv) {
            top_p = strtod(argv[++i], &end);
            if (*end || !*argv[i] || !(top_p > 0 && top_p <= 1)) {
                fprintf(stderr, "moeflow decode: --top-p: expected a number in (0, 1], found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--seed") && hv) {
            errno = 0;
            seed = strtoull(argv[++i], &end, 0);
            if (errno || *end || !*argv[i]) {
                fprintf(stderr, "moeflow decode: --seed: expected a non-negative integer, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--no-bos")) {
            no_bos = 1;
        } else if (!strcmp(a, "--ignore-eos")) {
            ignore_eos = 1;
        } else if (!strcmp(a, "--act-quant")) {
            act_quant = 1;
        } else if (!strcmp(a, "--store") && hv) {
            if ((store_mode = mf_parse_store_mode(argv[++i])) < 0) {
                fprintf(stderr, "moeflow decode: --store: expected resident or streamed, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--store-tables") && hv) {
            if ((store_tables = mf_parse_store_mode(argv[++i])) < 0) {
                fprintf(stderr, "moeflow decode: --store-tables: expected resident or streamed, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--store-budget") && hv) {
            if (!(store_budget = mf_tool_size(argv[++i]))) {
                fprintf(stderr, "moeflow decode: --store-budget: expected a size such as 2G or 512M, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--io-depth") && hv) {
            io_depth = strtol(argv[++i], &end, 10);
            if (*end || io_depth < 1 || io_depth > 4096) {
                fprintf(stderr, "moeflow decode: --io-depth: expected 1..4096, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--read-window") && hv) {
            read_window = strtol(argv[++i], &end, 10);
            if (*end || read_window < -1 || read_window > 4096 || !read_window) {
                fprintf(stderr, "moeflow decode: --read-window: expected 1..4096 or -1 (all), found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--devices") && hv) {
            devices = argv[++i];
        } else if (!strcmp(a, "--dense") && hv) {
            dense_s = argv[++i];
            if (strcmp(dense_s, "host") && strcmp(dense_s, "cards")) {
                fprintf(stderr, "moeflow decode: --dense: expected host or cards, found '%s'\n", dense_s);
                return 2;
            }
        } else if (!strcmp(a, "--heads") && hv) {
            if ((heads = mf_tool_heads(argv[++i])) < 0) {
                fprintf(stderr, "moeflow decode: --heads: expected cost, cards or host, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--dense-split") && hv) {
            if ((dense_split = mf_tool_dense_split(argv[++i])) < 0) {
                fprintf(stderr, "moeflow decode: --dense-split: expected layers or rows, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--micro-batches") && hv) {
            micro = strtol(argv[++i], &end, 10);
            if (*end || (micro != 1 && micro != 2)) {
                fprintf(stderr, "moeflow decode: --micro-batches: expected 1 or 2, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--placement") && hv) {
            placement = argv[++i];
            if (strcmp(placement, "seed") && strcmp(placement, "host") && strcmp(placement, "hybrid")) {
                fprintf(stderr, "moeflow decode: --placement: expected seed, host or hybrid, found '%s'\n", placement);
                return 2;
            }
        } else if (!strcmp(a, "--dev-cache") && hv) {
            if (!(dev_cache = mf_tool_size(argv[++i]))) {
                fprintf(stderr, "moeflow decode: --dev-cache: expected a size such as 2G or 512M, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--dev-cache-fill") && hv) {
            fill_spec = argv[++i];
            if (strncmp(fill_spec, "trace:", 6) && mf_tool_on_off(fill_spec) < 0) {
                fprintf(stderr, "moeflow decode: --dev-cache-fill: expected on, off or trace:FILE, found '%s'\n",
                        fill_spec);
                return 2;
            }
        } else if (!strcmp(a, "--dev-graphs")) {
            dev_graphs = 1;
        } else if (!strcmp(a, "--profile") && hv) {
            profile_path = argv[++i];
        } else if (!strcmp(a, "--record-routing") && hv) {
            record = argv[++i];
        } else if (!strcmp(a, "--trace") && hv) {
            trace = argv[++i];
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            quiet = 1;
        } else {
            fprintf(stderr, "moeflow decode: unknown or incomplete option '%s'\n\n", a);
            mf_decode_usage(stderr);
            return 2;
        }
    }
    if (!sk.n) {   /* auto: every socket hwloc finds, at most one per worker */
        if (mf_tool_sockets_arg("decode", "auto", &sk)) return 2;
        if (sk.n > threads) sk.n = (int)threads;
    }
    if (!dir || (!!prompt + !!ids + !!prompts_file) != 1) {
        fprintf(stderr, "moeflow decode: --checkpoint and exactly one of --prompt / --tokens / --prompts are "
                        "required\n\n");
        mf_decode_usage(stderr);
        return 2;
    }
    int sched = !strcmp(engine, "scheduled");
    if (sched && act_quant) {
        fprintf(stderr, "moeflow decode: --act-quant is only implemented by the reference engine (add "
                        "--engine reference)\n");
        return 2;
    }
    if (!sched && trace && !store_mode) {
        fprintf(stderr, "moeflow decode: --trace needs the scheduled engine or --store\n");
        return 2;
    }
    if ((devices || placement) && !sched) {
        fprintf(stderr, "moeflow decode: --devices and --placement apply to the scheduled engine\n");
        return 2;
    }
    if (placement && strcmp(placement, "host") && !devices) {
        fprintf(stderr, "moeflow decode: --placement %s needs --devices\n", placement);
        return 2;
    }
    if (profile_path && !sched) {
        fprintf(stderr, "moeflow decode: --profile applies to the scheduled engine\n");
        return 2;
    }
    if (devices && !placement) placement = "hybrid";
    if (dense_s && !strcmp(dense_s, "cards") && !devices) {
        fprintf(stderr, "moeflow decode: --dense cards needs --devices\n");
        return 2;
    }
    int dense = dense_s ? !strcmp(dense_s, "cards") : devices && !strncmp(devices, "emu", 3);
    int place = !devices || !strcmp(placement, "host") ? MF_STEP_PLACE_HOST
                : !strcmp(placement, "seed") ? MF_STEP_PLACE_SEED : MF_STEP_PLACE_HYBRID;
    if (!sched && exact) {
        fprintf(stderr, "moeflow decode: --exact applies to the scheduled engine (the reference is exact)\n");
        return 2;
    }

    int ret = 1, n_seq = 0, n_lines = 0;
    mf_tok *tok = NULL;
    mf_engram_map *emap = NULL;
    mf_model *m = NULL;
    mf_ref *r = NULL;
    mf_step *eng = NULL;
    mf_dev *dev = NULL;
    mf_batch *bat = NULL;
    char **lines = NULL;
    mf_dec_seq *sq = NULL;
    FILE *outf = NULL;
    mf_route_rec_ctx rrec = {0};
    mf_dec_ctx dc = {0};

    char tpath[4200];
    snprintf(tpath, sizeof tpath, "%s/tokenizer.json", dir);
    int have_tok = access(tpath, R_OK) == 0;
    if (prompt && !have_tok) {
        fprintf(stderr, "moeflow decode: %s has no tokenizer.json, so --prompt text cannot be encoded; "
                        "give token ids with --tokens\n", dir);
        return 2;
    }
    if (have_tok && mf_tok_load(tpath, &tok)) goto fail;
    if (chat_spec && !chat) {
        fprintf(stderr, "moeflow decode: --chat-template applies with --chat\n");
        ret = 2;
        goto out;
    }
    if (chat) {
        char desc[4400];
        if (!have_tok || ids) {
            fprintf(stderr, "moeflow decode: --chat needs prompt text and %s/tokenizer.json\n", dir);
            ret = 2;
            goto out;
        }
        if (mf_chat_tmpl_load(dir, chat_spec, &ct, desc, sizeof desc)) {
            fprintf(stderr, "moeflow decode: %s\n", mf_last_error());
            ret = 2;
            goto out;
        }
        if (!quiet) fprintf(stderr, "moeflow decode: chat: %s\n", desc);
        if (ct) no_bos = 1;   /* the template writes BOS as text, if it wants one */
    }
    int is_text = 0;
    if (prompts_file) {
        if (mf_read_lines(prompts_file, &lines, &n_lines)) {
            fprintf(stderr, "moeflow decode: %s\n", mf_last_error());
            return 2;
        }
        n_seq = n_lines;
        is_text = have_tok;
    } else {
        n_seq = batch ? (int)batch : 1;
        is_text = prompt != NULL;
    }
    /* one sequence on the scheduled engine: nothing waits behind its prefill, which runs in the
     * engine's prefill chunks (fewer weight passes than graphs of 64: docs/decode.md) */
    if (!step_tokens) step_tokens = n_seq == 1 && sched ? MF_STEP_PREFILL_CHUNK : MF_BATCH_STEP_TOKENS;
    if (!(sq = calloc((size_t)n_seq, sizeof *sq))) goto fail;
    for (int i = 0; i < n_seq; i++) {
        const char *text = prompts_file ? (have_tok ? lines[i] : NULL) : prompt;
        const char *tids = prompts_file ? (have_tok ? NULL : lines[i]) : ids;
        char *rendered = NULL;
        if (chat && text) {   /* one user message through the chat template */
            mf_serve_msg msg = {.role = "user", .content = (char *)text};
            mf_serve_req q = {.chat = 1, .msgs = &msg, .n_msgs = 1};
            size_t rn;
            int bos_in_text;
            if (mf_serve_chat_render(&q, ct, &rendered, &rn, &bos_in_text)) {
                fprintf(stderr, "moeflow decode: prompt %d: the chat template: %s\n", i + 1, mf_last_error());
                ret = 2;
                goto out;
            }
            text = rendered;
        }
        int prc = mf_prompt_ids(tok, text, tids, no_bos, &sq[i].pids, &sq[i].n_pid);
        free(rendered);
        if (prc) {
            if (prompts_file)
                fprintf(stderr, "moeflow decode: %s line %d: %s\n", prompts_file, i + 1, mf_last_error());
            else
                fprintf(stderr, "moeflow decode: %s\n", mf_last_error());
            ret = 2;
            goto out;
        }
        sq[i].line = prompts_file ? lines[i] : prompt ? prompt : ids;
    }
    int max_batch = batch ? (int)batch : n_seq < MF_STEP_MAX_ITEMS ? n_seq : MF_STEP_MAX_ITEMS;
    if (outfile && mf_path_make_parent(outfile)) {   /* missing folders are made, as mkdir -p */
        fprintf(stderr, "moeflow decode: --output: %s\n", mf_last_error());
        ret = 2;
        goto out;
    }
    if (outfile && !(outf = fopen(outfile, "w"))) {
        fprintf(stderr, "moeflow decode: --output %s: cannot open: %s\n", outfile, strerror(errno));
        ret = 2;
        goto out;
    }

    /* the scheduled engine needs the experts in memory: allow up to 64 GiB resident */
    mf_model_opts mo = {.quiet = quiet, .resident_limit_bytes = sched ? UINT64_C(64) << 30 : 0,
                        .store = store_mode, .store_tables = store_tables,
                        .store_budget_bytes = store_budget, .store_io_depth = (int)io_depth,
                        .store_io_pread = mf_tool_io_env.force_pread,
                        .n_sockets = sched ? sk.n : 1};
    memcpy(mo.socket_node, sk.node, sizeof mo.socket_node);
    if (!sched) {   /* the reference engine reads through the store's own run */
        mo.store_io_fault_kind = mf_tool_io_env.fault_kind;
        mo.store_io_fault_nth = mf_tool_io_env.fault_nth;
    }
    int64_t tl0 = mf_now_ns();
    if (mf_model_load(dir, &mo, &m)) goto fail;
    mf_store *mst = mf_model_store(m);
    if (mst && !quiet)
        fprintf(stderr, "moeflow decode: expert store %s, %d slots of %.2f MiB (%.2f GiB slab), "
                "engine %s, %s; loaded in %.2f s\n",
                store_mode == MF_MODEL_STORE_STREAMED ? "streamed" : "resident", mf_store_n_slots(mst),
                mf_store_slot_bytes(mst) / 1048576.0, mf_store_slab_bytes(mst) / 1073741824.0,
                mf_store_io_engine(mst), mf_store_direct(mst) ? "O_DIRECT" : "buffered",
                (mf_now_ns() - tl0) / 1e9);
    const mf_config *c = mf_model_config(m);
    int max_prompt = 0;
    for (int s = 0; s < n_seq; s++) {
        if (is_text && !no_bos) sq[s].pids[0] = c->bos_token_id;
        for (int i = 0; i < sq[s].n_pid; i++)
            if (sq[s].pids[i] >= c->vocab_size) {
                fprintf(stderr, "moeflow decode: token %d (prompt %d, position %d) is outside the vocabulary of "
                                "%s (vocab_size %" PRId64 ")\n", sq[s].pids[i], s + 1, i, dir, c->vocab_size);
                ret = 2;
                goto out;
            }
        max_prompt = sq[s].n_pid > max_prompt ? sq[s].n_pid : max_prompt;
    }
    int64_t total = (int64_t)max_prompt + max_new;
    if (total > c->max_position_embeddings) {
        fprintf(stderr, "moeflow decode: prompt (%d tokens) + --max-new-tokens %ld = %" PRId64
                        " positions, past the model's max_position_embeddings %" PRId64 "\n",
                max_prompt, max_new, total, c->max_position_embeddings);
        ret = 2;
        goto out;
    }
    mf_ref_opts ro = {.act_quant = act_quant};
    if (tok && c->n_engram > 0) {   /* the real Engram token map */
        if (mf_engram_map_build(tok, &emap)) goto fail;
        if (mf_engram_map_n_unique(emap) > c->engram_compressed_vocab_size) {
            fprintf(stderr, "moeflow decode: the tokenizer's Engram map has %d unique keys, more than "
                            "engram_compressed_vocab_size %" PRId64 " of %s/config.json\n",
                    mf_engram_map_n_unique(emap), c->engram_compressed_vocab_size, dir);
            goto out;
        }
        ro.token_map = mf_engram_map_ids(emap);
        ro.n_token_map = mf_engram_map_n_vocab(emap);
    }
    if (record) {
        if (mf_routing_rec_open(record, c->n_layers, c->n_routed_experts, c->n_experts_per_tok, &rrec.rec))
            goto fail;
        ro.hooks = (mf_ref_hooks){.user = &rrec, .on_route = mf_on_route_record};
    }
    if (profile_path && mf_profile_load(profile_path, &prof)) goto fail;
    if (mf_ref_new(m, &ro, &r)) goto fail;
    if (devices && (place != MF_STEP_PLACE_HOST || dense) && mf_dev_open(devices, &dev)) goto fail;
    if (dev && place != MF_STEP_PLACE_HOST && !strncmp(fill_spec, "trace:", 6)) {   /* the trace's counts */
        mf_routing *frt = NULL;
        if (mf_routing_open(fill_spec, c->n_layers, c->n_routed_experts, c->n_experts_per_tok, 0, &frt)) goto fail;
        fill_counts = malloc(sizeof *fill_counts * (size_t)c->n_layers * c->n_routed_experts);
        if (fill_counts) mf_routing_counts(frt, fill_counts);
        mf_routing_free(frt);
        if (!fill_counts) goto fail;
    }
    if (sched && mf_step_new(r, &(mf_step_opts){.n_threads = (int)threads, .exact = exact,
                                                 .n_sockets = sk.n, .topology = sk.topology,
                                                 .pin_threads = sk.n > 1,
                                                 .read_window = (int)read_window, .dev = dev,
                                                 .placement = place, .dev_cache_bytes = dev_cache,
                                                 .dev_cache_fill = strcmp(fill_spec, "off") != 0,
                                                 .dev_fill_counts = fill_counts, .dev_fill_progress = !quiet,
                                                 .dev_graphs = dev_graphs, .dense = dense,
                                                 .dense_split = dense_split, .heads = heads,
                                                 .micro = (int)micro,
                                                 .profile = profile_path ? &prof : NULL,
                                                 .io_depth = (int)io_depth,
                                                 .io_force_pread = mf_tool_io_env.force_pread,
                                                 .io_fault_kind = mf_tool_io_env.fault_kind,
                                                 .io_fault_nth = mf_tool_io_env.fault_nth}, &eng))
        goto fail;
    free(fill_counts);
    fill_counts = NULL;
    if (eng && !quiet) {
        mf_step_fill_stats fs;
        mf_step_fill(eng, &fs);
        if (fs.experts)
            fprintf(stderr, "moeflow decode: warmed the card caches: %" PRId64 " experts, %.1f MB in %.3f s%s\n",
                    fs.experts, fs.bytes / 1e6, fs.wall_ns / 1e9, fs.skipped ? " (some not held by the host: left out)" : "");
    }
    if (eng && mf_step_refused(eng)[0]) fprintf(stderr, "moeflow decode: card self-check: %s\n", mf_step_refused(eng));
    for (int k = 0, cd = 0; eng && dense && mf_step_dense_bytes(eng, k, &cd); k++)
        if (!quiet)
            fprintf(stderr, "moeflow decode: dense weights on card %d (%s): %.1f MB\n", cd, devices,
                    (double)mf_step_dense_bytes(eng, k, NULL) / 1e6);
    dc = (mf_dec_ctx){.sq = sq, .tok = tok, .stream = n_seq == 1, .out = outf, .quiet = quiet};
    if (mf_batch_new(&(mf_batch_opts){.ref = r, .eng = eng, .tok = tok, .max_batch = max_batch,
                                      .step_tokens = (int)step_tokens, .max_context = total > 1 ? total : 2,
                                      .max_queue = n_seq, .on_event = mf_dec_on_event, .user = &dc}, &bat))
        goto fail;
    rrec.b = bat;
    for (int s = 0; s < n_seq; s++) {
        if (!(sq[s].gen = malloc(sizeof(int32_t) * (size_t)(max_new + 1)))) goto fail;
        mf_batch_req rq = {.prompt = sq[s].pids, .n_prompt = sq[s].n_pid, .max_tokens = (int)max_new,
                           .temperature = temperature, .top_p = top_p, .seed = seed + (unsigned long long)s,
                           .ignore_eos = ignore_eos, .user = &sq[s]};
        sq[s].index = s;
        if (mf_batch_submit(bat, &rq, NULL)) goto fail;
    }

    int64_t t0 = mf_now_ns(), next_progress = t0 + 1000000000;
    long steps = 0;
    int64_t io_busy_ns = 0, io_overlap_ns = 0, ex_busy_ns = 0;   /* scheduled engine with a store */
    int64_t cp_busy_ns = 0, cp_overlap_ns = 0, cm_busy_ns = 0;   /* with devices */
    int64_t sock_home = 0, sock_cross = 0, dense_home = 0, dense_cross = 0;   /* with sockets */
    mf_step_dev_stats dtot = {0};
    dc.t0 = t0;
    if (mst) mf_store_step(mst, NULL);
    for (;;) {
        int n_items = 0;
        if (mf_batch_step(bat, &n_items)) goto fail;
        if (!n_items) break;
        steps++;
        if (sched && mst) {
            mf_step_times tm;
            mf_step_last_times(eng, &tm);
            io_busy_ns += tm.io_busy_ns;
            io_overlap_ns += tm.io_overlap_ns;
            ex_busy_ns += tm.expert_busy_ns;
        }
        if (sched && sk.n > 1) {   /* where the host expert slots ran */
            mf_step_dev_stats x;
            mf_step_last_dev(eng, &x);
            sock_home += x.sock_home;
            sock_cross += x.sock_cross;
            dense_home += x.dense_home;
            dense_cross += x.dense_cross;
        }
        if (dev) {
            mf_step_times tm;
            mf_step_dev_stats x;
            mf_step_last_times(eng, &tm);
            mf_step_last_dev(eng, &x);
            cp_busy_ns += tm.copy_busy_ns;
            cp_overlap_ns += tm.copy_overlap_ns;
            cm_busy_ns += tm.compute_busy_ns;
            dtot.dev_slots += x.dev_slots, dtot.host_slots += x.host_slots, dtot.hits += x.hits;
            dtot.misses += x.misses, dtot.bytes_in += x.bytes_in, dtot.evictions += x.evictions;
            dtot.host_fallbacks += x.host_fallbacks;
            dtot.n_cards = x.n_cards, dtot.cache_slots = x.cache_slots;
            if (!quiet)
                fprintf(stderr, "moeflow decode: step %ld devices: %" PRId64 " expert slots on cards, %" PRId64
                        " on the host; cache %" PRIu64 " hits, %" PRIu64 " misses, %" PRIu64 " evictions, %.2f MiB "
                        "copied in; copies %.2f ms, overlapping expert compute %.2f ms\n", steps, x.dev_slots,
                        x.host_slots, x.hits, x.misses, x.evictions, x.bytes_in / 1048576.0, tm.copy_busy_ns / 1e6,
                        tm.copy_overlap_ns / 1e6);
        }
        if (mst && !quiet) mf_print_step(mst, "step", steps, sched);
        int64_t now = mf_now_ns();
        if (!quiet && n_seq > 1 && now >= next_progress) {
            mf_dec_progress(&dc, n_seq, now, 0);
            next_progress = now + 1000000000;
        }
    }
    if (dc.rc) {
        mf_error(dc.rc, "%s", dc.msg);
        goto fail;
    }
    int64_t t2 = mf_now_ns();
    if (!quiet && n_seq > 1) mf_dec_progress(&dc, n_seq, t2, 1);
    long out_tokens = 0, n_prefill = 0;
    if (n_seq == 1) {
        putchar('\n');
    } else {
        for (int s = 0; s < n_seq; s++) {
            printf("[%d] ", s);
            for (long k = 0; k < sq[s].n_gen; k++) mf_emit_token(tok, sq[s].gen[k], k == 0);
            putchar('\n');
        }
    }
    for (int s = 0; s < n_seq; s++) out_tokens += sq[s].n_gen, n_prefill += sq[s].n_pid;
    fflush(stdout);
    if (outf) {
        int bad = fclose(outf);
        outf = NULL;
        if (bad) {
            mf_error(-EIO, "--output %s: write failed", outfile);
            goto fail;
        }
    }
    if (rrec.rec) {
        mf_routing_rec *w = rrec.rec;
        rrec.rec = NULL;
        if (rrec.rc) {
            mf_routing_rec_close(w);
            unlink(record);
            mf_error(rrec.rc, "--record-routing: %s", rrec.msg);
            goto fail;
        }
        if (mf_routing_rec_close(w)) goto fail;
        if (!quiet) fprintf(stderr, "moeflow decode: routing trace written to %s\n", record);
    }
    if (trace && (sched ? mf_step_write_trace(eng, trace) : mf_store_write_trace(mst, trace))) goto fail;
    if (mst && !quiet) {
        mf_store_stats x;
        mf_store_stats_total(mst, &x);
        fprintf(stderr, "moeflow decode: expert store total: %" PRIu64 " hits, %" PRIu64 " misses "
                "(hit rate %.1f%%), %.2f GiB read", x.hits, x.misses,
                100.0 * x.hits / (double)(x.hits + x.misses ? x.hits + x.misses : 1), x.bytes_read / 1073741824.0);
        if (sched)
            fputc('\n', stderr);
        else
            fprintf(stderr, " in %.2f s of store runs (reads + expert compute); io overlapping compute %.1f%% "
                    "of io busy time\n", x.read_wall_ns / 1e9, x.io_busy_ns ? 100.0 * x.overlap_ns / x.io_busy_ns : 0.0);
        if (sched)
            fprintf(stderr, "moeflow decode: scheduled engine steps: IO lane busy %.3f s, expert compute "
                    "%.3f s, overlapping %.3f s (%.1f%% of IO busy, %.1f%% of expert compute)\n", io_busy_ns / 1e9,
                    ex_busy_ns / 1e9, io_overlap_ns / 1e9, io_busy_ns ? 100.0 * io_overlap_ns / io_busy_ns : 0.0,
                    ex_busy_ns ? 100.0 * io_overlap_ns / ex_busy_ns : 0.0);
    }
    if (sched && sk.n > 1 && !quiet)
        fprintf(stderr, "moeflow decode: %d sockets: %" PRId64 " host expert part weights read by the workers of "
                "the socket holding their rows, %" PRId64 " by another's; %" PRId64 " dense part weights by the "
                "socket holding their rows, %" PRId64 " by another's\n", sk.n, sock_home, sock_cross, dense_home,
                dense_cross);
    if (dev && !quiet)
        fprintf(stderr, "moeflow decode: devices (%s, %s placement, %d cache slots per card) steps: %" PRId64
                " expert slots on cards, %" PRId64 " on the host (%" PRId64 " for want of a free cache slot); "
                "cache hit rate %.1f%% (%" PRIu64 " hits, %" PRIu64 " misses), %.2f GiB copied in; copies busy %.3f s, "
                "expert compute %.3f s, overlapping %.3f s (%.1f%% of copy time)\n", devices, placement,
                dtot.n_cards ? dtot.cache_slots : 0, dtot.dev_slots, dtot.host_slots, dtot.host_fallbacks,
                100.0 * dtot.hits / (double)(dtot.hits + dtot.misses ? dtot.hits + dtot.misses : 1), dtot.hits,
                dtot.misses, dtot.bytes_in / 1073741824.0, cp_busy_ns / 1e9, cm_busy_ns / 1e9, cp_overlap_ns / 1e9,
                cp_busy_ns ? 100.0 * cp_overlap_ns / cp_busy_ns : 0.0);
    if (!quiet) {
        mf_batch_stats bs;
        mf_batch_get_stats(bat, &bs);
        double sec = (t2 - t0) / 1e9;
        fprintf(stderr, "moeflow decode (%s engine%s, %d sequence%s, batch %d, step budget %ld): %ld steps in %.3f s; "
                        "prefill %" PRId64 " tokens (%.2f tokens/s), decode %" PRId64 " tokens (%.2f tokens/s "
                        "aggregate); %ld tokens out (%.2f tokens/s); first token after %.3f s (median)\n", engine,
                sched ? (exact ? ", fp32 experts" : ", int8 experts") : "", n_seq, n_seq > 1 ? "s" : "",
                bs.n_states, step_tokens, steps, sec, bs.prefill_items, bs.prefill_items / sec,
                bs.decode_items, bs.decode_items / sec, out_tokens, out_tokens / sec, mf_dec_median_ttft(sq, n_seq));
    }
    (void)n_prefill;
    ret = 0;
    goto out;
fail:
    fprintf(stderr, "moeflow decode: %s\n", mf_last_error()[0] ? mf_last_error() : "out of memory");
out:
    free(fill_counts);
    if (rrec.rec) {   /* failed before the end: no partial trace is left behind */
        mf_routing_rec_close(rrec.rec);
        unlink(record);
    }
    if (outf) fclose(outf);
    mf_batch_free(bat);
    for (int s = 0; sq && s < n_seq; s++) {
        free(sq[s].pids);
        free(sq[s].gen);
    }
    free(sq);
    mf_step_free(eng);
    mf_dev_close(dev);
    mf_ref_free(r);
    mf_model_free(m);
    mf_engram_map_free(emap);
    mf_tok_free(tok);
    mf_chat_tmpl_free(ct);
    for (int i = 0; i < n_lines; i++) free(lines[i]);
    free(lines);
    return ret;
}
