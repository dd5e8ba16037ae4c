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
#include "graphs/step/spec.h"
#include "graphs/step/stepgraph.h"
#include "sched/clock.h"
#include "tools/cmd_decode.h"
#include "tools/sim_common.h"

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
     .help = "items per step (default 2 x B, at least " MF_OPTS_STR(MF_BATCH_STEP_TOKENS) ", at most "
             MF_OPTS_STR(MF_STEP_MAX_ITEMS) ": the\n"
             "decode tokens and as many prompt tokens; one sequence on the\n"
             "scheduled engine: " MF_OPTS_STR(MF_STEP_PREFILL_CHUNK) ", its prompt in the engine's prefill chunks):\n"
             "decode tokens first, then prefill chunks; smaller N cuts long\n"
             "prompts into more steps; a step of one sequence's prefill alone\n"
             "runs as one graph of up to " MF_OPTS_STR(MF_STEP_MAX_CHUNK) " positions (long chunks), steps\n"
             "of several sequences in one graph of up to max(B, N) items (at\n"
             "most " MF_OPTS_STR(MF_STEP_MAX_ITEMS) ")"},
    {"--output", .kind = MF_OPT_STR, .off = F(outfile), .meta = "FILE",
     .help = "one JSON object per prompt as it finishes, one write each (the\n"
             "scriptable channel): index (the line's index in FILE, from 0),\n"
             "line (its number, from 1), prompt, text (with a tokenizer), tokens,\n"
             "prompt_tokens, finish_reason (eos or length), queue_s,\n"
             "first_token_s, total_s; a refused line: index, line, prompt, error"},
    {"--logits-out", .kind = MF_OPT_STR, .off = F(logits_out), .meta = "FILE",
     .help = "every generated token's logits as they come: the sequence's index\n"
             "and the token (int32), then vocab_size fp32 values (this\n"
             "machine's byte order): to compare runs byte for byte"},
    MF_OPT_GROUP_ROW(mf_tool_engine_table, F(e)),
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
    {"--record-routing", .kind = MF_OPT_STR, .off = F(record), .meta = "FILE",
     .help = "write the routed experts of every token (prefill and\n"
             "decode, every sequence and layer) to FILE, a routing trace\n"
             "for `moeflow sim --routing trace:FILE`; it records through the\n"
             "reference's on_route hook, and with a hook set the scheduled\n"
             "engine runs its serial graph (a batch's per-sequence parts one\n"
             "after another), so timings differ from a run without it"},
    {"--spec", .kind = MF_OPT_WORD, .off = F(spec), .def = "off", .meta = "S", .words = mf_tool_specs,
     .help = "dspark: speculative decoding with the checkpoint's DSpark draft\n"
             "(its mtp.* tensors, loaded only then; docs/dspark.md): each step a\n"
             "sequence's pending token and the draft's candidates run as one\n"
             "verify, the longest prefix the target agrees with is kept (greedy:\n"
             "the same tokens bit for bit; sampling: the same distribution);\n"
             "the summary on stderr; off: none"},
    {"--spec-tokens", .kind = MF_OPT_FN, .off = F(spec_tokens), .def = "auto", .meta = "N|auto",
     .fn = mf_tool_spec_tokens_opt, .example = "3",
     .help = "with --spec: N candidates every round (1..dspark_block_size), or\n"
             "auto: per round and sequence the k the cost model (--profile's\n"
             "prices) says pays, 0 when none does"},
    MF_TOOL_RANKS_ROWS(F(rk)),
    MF_TOOL_PREFIX_OPTS(F, pfx),
    {"--quiet", "-q", MF_OPT_FLAG, F(quiet), .help = "no progress or timing on stderr"},
    {NULL},
};
#undef F

static const mf_opts_spec mf_dec_spec = {
    .cmd = "decode",
    .usage =
        "usage: moeflow decode --checkpoint DIR (--prompt TEXT | --tokens IDS | --prompts FILE [--resume])\n"
        MF_TOOL_ENGINE_USAGE
        "                      [--batch B] [--step-tokens N] [--output FILE.jsonl] [--logits-out FILE]\n"
        "                      [--max-new-tokens N] [--temperature T --top-p P --seed S]\n"
        "                      [--no-bos] [--ignore-eos] [--act-quant] [--quiet] [--trace FILE]\n"
        "                      [--chat [--chat-template FILE|builtin]] [--record-routing FILE]\n"
        "                      [--spec dspark [--spec-tokens N|auto]]\n"
        "                      [--prefix-cache SIZE] [--prefix-cache-dir DIR] [--prefix-block N]\n"
        "                      [--ranks-layers auto|a:b,c:d [--ranks-micro M] [--ranks-timeout S]]\n\n"
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

/* The options that cannot go together (the engine group's: mf_tool_engine_check; decode's own:
 * a prompt, --act-quant, --trace, --ranks-layers without --record-routing). 0 or 2 (said on
 * stderr). */
static int mf_dec_check(mf_dec_cli *a, mf_dec *d)
{
    int rc = mf_tool_engine_check("decode", &a->e);
    if (!rc) rc = mf_tool_prefix_check("decode", &a->pfx, a->rk.spec != NULL);
    if (rc) return rc;
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
    if (a->e.sched && a->act_quant)
        why = "--act-quant is only implemented by the reference engine (add --engine reference)";
    else if (!a->e.sched && a->trace && !a->e.store_mode) why = "--trace needs the scheduled engine or --store";
    else if (a->spec == MF_TOOL_SPEC_PERFECT) why = "--spec perfect is bench decode's (decode takes off or dspark)";
    else if (a->spec && a->record) why = "--spec and --record-routing: the trace would record rejected tokens too";
    else if (a->rk.spec && a->record)
        why = "--ranks-layers runs without --record-routing (each rank routes its own layers)";
    else if (a->spec && a->rk.spec)
        why = "--spec runs on one host (without --ranks-layers): the draft reads every layer's features";
    if (why) {
        fprintf(stderr, "moeflow decode: %s\n", why);
        return 2;
    }
    d->no_bos = a->no_bos;
    a->e.draft = a->spec == MF_TOOL_SPEC_DSPARK;
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

/* The model, its Engram token map, the reference forward (with --record-routing's hook) and the
 * engine (tools/engine_opts.h); the prompts' fit (ids in the vocabulary, positions within the
 * model's). */
static int mf_dec_open(mf_dec *d)
{
    const mf_dec_cli *a = d->a;
    mf_ref_opts ro = {.act_quant = a->act_quant};
    if (a->record) {   /* the routing trace's shape needs the config: read it first */
        mf_config cc;
        char path[4200];
        snprintf(path, sizeof path, "%s/config.json", a->dir);
        int rc = mf_config_load(path, &cc);
        if (!rc) rc = mf_routing_rec_open(a->record, cc.n_layers, cc.n_routed_experts, cc.n_experts_per_tok, &d->rrec.rec);
        if (rc) return rc;
        ro.hooks = (mf_ref_hooks){.user = &d->rrec, .on_route = mf_dec_on_route};
    }
    mf_tool_engine e = a->e;   /* every step of the batcher one graph */
    e.max_items = mf_batch_step_items(d->max_batch, (int)d->step_tokens);
    int rc = mf_tool_run_open("decode", &e, a->dir, d->tok, ro, a->quiet, &d->x);
    if (rc) return rc;
    const mf_config *c = mf_model_config(d->x.m);
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
    if (!d->follower) mf_tool_run_notes("decode", &a->e, &d->x, a->quiet);
    return 0;
}

/* The batcher over the engine, every prompt submitted (sequence i seeded --seed + i). */
static int mf_dec_submit(mf_dec *d)
{
    const mf_dec_cli *a = d->a;
    d->dc = (mf_dec_ctx){.sq = d->sq, .tok = d->tok, .stream = d->n_seq == 1, .out = d->outf, .quiet = a->quiet,
                         .with_line = a->prompts_file != NULL, .lgout = d->lgf,
                         .V = mf_model_config(d->x.m)->vocab_size};
    int rc = mf_tool_prefix_open(&a->pfx, d->x.r, mf_tool_prefix_numerics(a->e.sched, a->e.exact, a->e.devices),
                                 "moeflow decode", a->quiet, &d->pfx);
    if (rc) return rc;
    mf_pipe *pipe = d->rk->pipe;   /* a pipeline: rank 0's forwards run every rank's layers */
    if (!rc) rc = mf_tool_run_spec(&a->e, &d->x, a->spec_tokens, d->max_batch, d->total / 2 + 1);
    if (!rc)
        rc = mf_batch_new(&(mf_batch_opts){.ref = d->x.r, .eng = d->x.eng, .tok = d->tok, .max_batch = d->max_batch,
                                           .forward = pipe ? mf_pipe_forward : NULL, .forward_ctx = pipe,
                                           .step_tokens = (int)d->step_tokens, .max_context = d->total > 1 ? d->total : 2,
                                           .max_queue = d->n_seq, .prefix = d->pfx, .on_event = mf_dec_on_event,
                                           .user = &d->dc, .spec = d->x.spec}, &d->bat);
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
    if (d->x.eng) {
        mf_step_last_times(d->x.eng, &tm);
        mf_step_last_dev(d->x.eng, &x);
    }
    if (d->x.eng && d->x.mst) {
        d->io_busy_ns += tm.io_busy_ns;
        d->io_overlap_ns += tm.io_overlap_ns;
        d->ex_busy_ns += tm.expert_busy_ns;
    }
    if (d->x.eng && a->e.sk.n > 1) {   /* where the host expert slots ran */
        d->sock_home += x.sock_home;
        d->sock_cross += x.sock_cross;
        d->dense_home += x.dense_home;
        d->dense_cross += x.dense_cross;
    }
    if (d->x.dev) {
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
    if (d->x.mst && !a->quiet) mf_print_step(d->x.mst, "step", d->steps, a->e.sched);
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
 * summary. Before (loading the model), and with --prompt or --tokens, a signal ends it as before;
 * but on a pipeline's rank 0 (--ranks-layers) they are taken with any prompts, so that the other
 * ranks are told to stop (tools/ranks.h). */
static void mf_dec_catch(const mf_dec *d)
{
    if (!d->a->prompts_file && d->rk->size < 2) return;   /* a pipeline's rank 0 stops the others too */
    struct sigaction sa = {.sa_handler = mf_dec_on_signal, .sa_flags = SA_RESTART};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

/* After a signal: the first cancels the prompts not generating yet (queued, or in their prefill);
 * the second the rest (without --prompts, on a pipeline's rank 0: the first). `seen` is how many
 * signals were acted on. */
static void mf_dec_interrupt(mf_dec *d, int *seen)
{
    int n = mf_dec_n_sig, all = n > 1 || !d->a->prompts_file;
    if (n <= *seen) return;
    d->sig = mf_dec_first_sig;
    for (int s = 0; s < d->n_seq; s++) {
        const mf_dec_seq *q = &d->sq[s];
        if (q->state == MF_DEC_RUN && !q->done && (all || q->n_gen == 0)) mf_batch_cancel(d->bat, q->id);
    }
    if (!d->a->quiet || all)
        fprintf(stderr, "\nmoeflow decode: %s: %s\n", d->sig == SIGINT ? "SIGINT" : "SIGTERM",
                all ? "cancelling the prompts still generating" :
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
    if (d->x.mst) mf_store_step(d->x.mst, NULL);
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
    if (a->trace) return a->e.sched ? mf_step_write_trace(d->x.eng, a->trace) : mf_store_write_trace(d->x.mst, a->trace);
    return 0;
}

/* The totals on stderr: the expert store's, the sockets', the cards', then the run's rates. */
static void mf_dec_report(const mf_dec *d)
{
    const mf_dec_cli *a = d->a;
    if (a->quiet) return;
    if (d->x.mst) {
        mf_store_stats x;
        mf_store_stats_total(d->x.mst, &x);
        fprintf(stderr, "moeflow decode: expert store total: %" PRIu64 " hits, %" PRIu64 " misses "
                "(hit rate %.1f%%), %.2f GiB read", x.hits, x.misses,
                100.0 * x.hits / (double)(x.hits + x.misses ? x.hits + x.misses : 1), x.bytes_read / 1073741824.0);
        if (a->e.sched)
            fprintf(stderr, "\nmoeflow decode: scheduled engine steps: IO lane busy %.3f s, expert compute "
                    "%.3f s, overlapping %.3f s (%.1f%% of IO busy, %.1f%% of expert compute)\n", d->io_busy_ns / 1e9,
                    d->ex_busy_ns / 1e9, d->io_overlap_ns / 1e9,
                    d->io_busy_ns ? 100.0 * d->io_overlap_ns / d->io_busy_ns : 0.0,
                    d->ex_busy_ns ? 100.0 * d->io_overlap_ns / d->ex_busy_ns : 0.0);
        else
            fprintf(stderr, " in %.2f s of store runs (reads + expert compute); io overlapping compute %.1f%% "
                    "of io busy time\n", x.read_wall_ns / 1e9, x.io_busy_ns ? 100.0 * x.overlap_ns / x.io_busy_ns : 0.0);
    }
    if (a->e.sched && a->e.sk.n > 1)
        fprintf(stderr, "moeflow decode: %d sockets: %" PRId64 " host expert part weights read by the workers of "
                "the socket holding their rows, %" PRId64 " by another's; %" PRId64 " dense part weights by the "
                "socket holding their rows, %" PRId64 " by another's\n", a->e.sk.n, d->sock_home, d->sock_cross,
                d->dense_home, d->dense_cross);
    const mf_step_dev_stats *t = &d->dtot;
    if (d->x.dev)
        fprintf(stderr, "moeflow decode: devices (%s, %s placement, %d cache slots per card) steps: %" PRId64
                " expert slots on cards, %" PRId64 " on the host (%" PRId64 " for want of a free cache slot); "
                "cache hit rate %.1f%% (%" PRIu64 " hits, %" PRIu64 " misses), %.2f GiB copied in; copies busy %.3f s, "
                "expert compute %.3f s, overlapping %.3f s (%.1f%% of copy time); cuBLASLt: %" PRId64 " dense linear "
                "launches, %" PRId64 " expert slots\n", a->e.devices, a->e.placement_word,
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
            a->e.sched ? "scheduled" : "reference", a->e.sched ? (a->e.exact ? ", fp32 experts" : ", int8 experts") : "",
            d->n_seq, d->n_seq > 1 ? "s" : "", bs.n_states, d->step_tokens, d->steps, sec, bs.prefill_items,
            bs.prefill_items / sec, bs.decode_items, bs.decode_items / sec, out_tokens, out_tokens / sec,
            mf_dec_median_ttft(d->sq, d->n_seq));
    mf_tool_prefix_report(d->pfx, "moeflow decode", stderr);
    int64_t first = 0, now = mf_now_ns();   /* the first token of any sequence, from the process's start */
    for (int s = 0; s < d->n_seq; s++)
        if (d->sq[s].first_ns && (!first || d->sq[s].first_ns < first)) first = d->sq[s].first_ns;
    double since = mf_tool_since_start_s();
    if (first && since >= 0)
        fprintf(stderr, "moeflow decode: first token %.3f s after the process started (the model's load %.3f s)\n",
                since - (now - first) / 1e9, d->x.load_s);
    double anon, file;
    if (!mf_tool_rss(&anon, &file))
        fprintf(stderr, "moeflow decode: memory: %.2f GiB of the process's own (RssAnon), %.2f GiB of files mapped "
                "(RssFile: the page cache, shared, kept after exit)\n", anon / 1073741824.0, file / 1073741824.0);
    if (d->x.spec) {
        mf_spec_stats st;
        mf_spec_get_stats(d->x.spec, &st);
        mf_tool_spec_line(stderr, "moeflow decode", &st);
    }
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
    if (d->rrec.rec) {   /* failed before the end: no partial trace is left behind */
        mf_routing_rec_close(d->rrec.rec);
        unlink(d->a->record);
    }
    mf_batch_free(d->bat);
    mf_prefix_free(d->pfx);
    mf_tool_run_close(&d->x);
    mf_dec_prompts_free(d);
}

int mf_cmd_decode(int argc, char **argv)
{
    mf_dec_cli a = {0};
    mf_tool_engine_init(&a.e);
    a.e.rk = &a.rk;   /* --ranks-layers: the opener loads this rank's layers and links the engine */
    int rc = mf_opts_parse(&mf_dec_spec, argc, argv, &a);
    if (rc != MF_OPTS_RUN) return rc;
    static mf_dec d;
    d = (mf_dec){.a = &a, .outf = -1, .rk = &a.rk};
    if ((rc = mf_dec_check(&a, &d))) return rc;
    rc = mf_tool_ranks_open(&a.rk, "decode", a.dir, a.e.profile_path, (int)a.e.threads, NULL, NULL);
    d.follower = a.rk.rank > 0;   /* a pipeline's later rank runs its layers of rank 0's steps */
    if (!rc) rc = mf_dec_prompts(&d);
    if (!rc) rc = mf_dec_open(&d);
    if (!rc && d.follower) rc = mf_tool_ranks_follow(&a.rk, "decode", a.quiet);
    if (!rc && !d.follower) {
        mf_dec_catch(&d);
        rc = mf_dec_submit(&d);
        if (!rc) rc = mf_dec_run(&d);
        if (!rc) rc = mf_dec_outputs(&d);
        if (!rc && !d.sig) mf_dec_report(&d);
        if (!rc) rc = mf_dec_summary(&d);
    }
    rc = mf_tool_ranks_end(&a.rk, "decode", rc, a.quiet);   /* after a pipeline's failure: exits */
    if (rc < 0) fprintf(stderr, "moeflow decode: %s\n", mf_last_error()[0] ? mf_last_error() : "out of memory");
    mf_dec_close(&d);
    return rc < 0 ? 1 : rc;
}
