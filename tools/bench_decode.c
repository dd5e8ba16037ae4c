/* `moeflow bench decode`: prefill and decode steps of the reference engine and the scheduled engine
 * in the same run, on the same synthetic prompt, with a phase table per engine (attention stack,
 * MoE, Engram, norm + head, other) per step, tokens/s and the speedup, and the scheduled engine's
 * compute fraction: its kernel multiply-adds (the step graph's records) per second over the fused
 * int8 kernel's rate measured in the same run; --trace writes one scheduled step's timeline,
 * --json a machine-readable summary. */
#include <errno.h>
#include <inttypes.h>
#include <stddef.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "device/dev.h"
#include "graphs/calib/hwcal.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/sample.h"
#include "graphs/sim/plan.h"
#include "graphs/step/step.h"
#include "graphs/step/stepgraph.h"
#include "host/kernels.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "tools/commands.h"
#include "tools/sim_common.h"

typedef struct mf_bd_run {
    double phase_s[MF_STEP_N_PHASES];   /* summed over steps */
    double total_s;
    double prefill_s;                   /* all sequences' prefills */
    double prefill_cpu_s, decode_cpu_s; /* the process's CPU time over them (all threads) */
    double prefill_macs, decode_macs;   /* scheduled engine: kernel multiply-adds (mf_step_times) */
    double decode_weight_bytes;         /* scheduled engine: weight bytes its kernels read in decode */
    int32_t *tokens;                    /* steps x batch: the greedy inputs fed */
    double *step_s;                     /* steps: each step's wall time */
    /* the read probe: when set, one pass on probe_threads after every decode step (untimed) */
    mf_hwcal_probe *probe;
    int probe_threads, n_read;
    double *read_v;                     /* the passes' rates, n_read of them */
} mf_bd_run;

/* The read probe: a buffer of MF_BD_READ_BYTES (8x a 32 MiB last-level cache: read from DRAM),
 * MF_BD_READ_FIRST passes before the engines run and one after every scheduled decode step. */
#define MF_BD_READ_BYTES ((size_t)256 << 20)
#define MF_BD_READ_FIRST 5

static int mf_bd_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* ---- the fused kernel's multiply-add rate ---------------------------------------------------- */

typedef struct mf_bd_rate {
    const uint8_t *w, *scale;
    int n_out, n_in, n_threads, reps;
    const mf_kern_q8 *q8;
    float *y;
    int rc[256];
} mf_bd_rate;

typedef struct mf_bd_rate_arg {
    mf_bd_rate *r;
    int id;
} mf_bd_rate_arg;

static void *mf_bd_rate_worker(void *p)
{
    mf_bd_rate_arg *a = p;
    mf_bd_rate *r = a->r;
    int r0 = (int)((int64_t)r->n_out * a->id / r->n_threads), r1 = (int)((int64_t)r->n_out * (a->id + 1) / r->n_threads);
    for (int k = 0; k < r->reps && !r->rc[a->id]; k++)
        r->rc[a->id] = mf_kern_fp4_matmul(r->w, r->scale, r->n_out, r->n_in, r->q8, r->y, r->n_out, r0, r1);
    return NULL;
}

/* The fused FP4 int8 kernel's multiply-add rate on `threads` threads: w1's shape of config c
 * ([moe_intermediate, hidden], random codes, weights warm) over 64 quantized tokens, each thread
 * its rows, repeated; the best of 5 rounds. 0 or a negative code. */
static int mf_bd_kernel_rate(const mf_config *c, int threads, double *macs_per_s)
{
    int n_out = (int)c->moe_intermediate_size, n_in = (int)c->hidden_size, n_tok = 64, rc = 0;
    size_t wb = (size_t)n_out * n_in / 2, sb = (size_t)n_out * (n_in / 32), qb = mf_kern_q8_bytes(n_tok, n_in);
    uint8_t *w = malloc(wb), *sc = malloc(sb);
    float *x = malloc(sizeof(float) * (size_t)n_tok * n_in), *y = malloc(sizeof(float) * (size_t)n_tok * n_out);
    void *qbuf = malloc(qb);
    pthread_t th[256];
    mf_bd_rate_arg args[256];
    if (!w || !sc || !x || !y || !qbuf) {
        rc = mf_error(-ENOMEM, "bench decode: out of memory for the kernel rate");
        goto out;
    }
    uint64_t z = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < wb; i++) w[i] = (uint8_t)((z = z * 6364136223846793005ull + 1442695040888963407ull) >> 56);
    for (size_t i = 0; i < sb; i++) sc[i] = (uint8_t)(120 + i % 7);
    for (size_t i = 0; i < (size_t)n_tok * n_in; i++) x[i] = (float)((int)(i * 2654435761u % 2001) - 1000) * 1e-3f;
    mf_kern_q8 q8;
    if ((rc = mf_kern_q8_init(&q8, qbuf, qb, n_tok, n_in)) || (rc = mf_kern_q8_quantize(&q8, x, n_in, 0, n_tok)))
        goto out;
    double macs_call = (double)n_out * n_in * n_tok, best = 0;
    mf_bd_rate r = {.w = w, .scale = sc, .n_out = n_out, .n_in = n_in, .n_threads = threads, .q8 = &q8, .y = y};
    r.reps = (int)(2e9 / macs_call) + 1;   /* ~2 G multiply-adds a round: tens of ms */
    /* a round: the threads started, each its rows reps times, joined (starting a thread costs
     * microseconds against a round's tens of milliseconds) */
    for (int round = 0; round < 5 && !rc; round++) {
        int started = 0;
        int64_t t0 = mf_now_ns();
        for (; started < threads; started++) {
            args[started] = (mf_bd_rate_arg){&r, started};
            if (pthread_create(&th[started], NULL, mf_bd_rate_worker, &args[started])) break;
        }
        for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
        double sec = (mf_now_ns() - t0) / 1e9;
        if (started < threads) rc = mf_error(-EAGAIN, "bench decode: could not start %d threads for the kernel rate", threads);
        for (int i = 0; i < threads && !rc; i++) rc = r.rc[i];
        double rate = macs_call * r.reps / sec;
        if (!rc && rate > best) best = rate;
    }
    *macs_per_s = best;
out:
    free(w);
    free(sc);
    free(x);
    free(y);
    free(qbuf);
    return rc;
}

static void mf_bd_row(const char *label, const double *ph, double total, double tps)
{
    printf("%-6s", label);
    for (int p = 0; p < MF_STEP_N_PHASES; p++) printf(" %15.2f", ph[p] * 1e3);
    printf(" %10.2f %10.2f\n", total * 1e3, tps);
}

static void mf_bd_header(const char *engine, int batch)
{
    printf("\n%s engine, batch %d (ms per step)\n%-6s", engine, batch, "step");
    for (int p = 0; p < MF_STEP_N_PHASES; p++) printf(" %15s", mf_step_phase_name((mf_step_phase)p));
    printf(" %10s %10s\n", "total", "tokens/s");
}

/* The process's CPU time (all threads), seconds: what a loaded machine's wall time hides. */
static double mf_bd_cpu_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Prefill + steps on one engine (eng NULL: the reference). */
static int mf_bd_engine(mf_ref *r, mf_step *eng, int64_t V, int batch, int n_prompt, int steps,
                        int quiet_rows, float *logits, mf_bd_run *out)
{
    int rc = 0;
    mf_ref_state *st[MF_STEP_MAX_ITEMS] = {0};
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)n_prompt);
    if (!prompt) return mf_error(-ENOMEM, "out of memory");
    for (int s = 0; s < batch && !rc; s++) {
        for (int k = 0; k < n_prompt; k++) prompt[k] = (int32_t)((37LL * k + 11 + 101LL * s) % V);
        rc = mf_ref_state_new(r, n_prompt + steps + 1, &st[s]);
        if (!rc) {
            float *lg = logits + (size_t)s * V;
            int64_t t0 = mf_now_ns();
            double c0 = mf_bd_cpu_s();
            rc = eng ? mf_step_prefill(eng, st[s], prompt, n_prompt, lg) : mf_ref_prefill(r, st[s], prompt, n_prompt, lg);
            out->prefill_s += (mf_now_ns() - t0) / 1e9;
            out->prefill_cpu_s += mf_bd_cpu_s() - c0;
            if (eng && !rc) {
                mf_step_times t;
                mf_step_last_times(eng, &t);
                out->prefill_macs += t.macs;
            }
        }
    }
    free(prompt);
    if (!quiet_rows && !rc) mf_bd_header(eng ? "scheduled" : "reference", batch);
    for (int k = 0; k < steps && !rc; k++) {
        int32_t tok[MF_STEP_MAX_ITEMS];
        for (int s = 0; s < batch; s++) tok[s] = out->tokens[k * batch + s] = mf_sample_greedy(logits + (size_t)s * V, V);
        double ph[MF_STEP_N_PHASES] = {0}, total;
        double c0 = mf_bd_cpu_s();
        if (eng) {
            rc = mf_step_decode(eng, st, tok, batch, logits);
            mf_step_times t;
            mf_step_last_times(eng, &t);
            for (int p = 0; p < MF_STEP_N_PHASES; p++) ph[p] = t.phase_ns[p] / 1e9;
            total = t.wall_ns / 1e9;
            out->decode_macs += t.macs;
            out->decode_weight_bytes += t.weight_bytes;
        } else {
            mf_ref_times a, b;
            mf_ref_times_get(r, &a);
            int64_t t0 = mf_now_ns();
            rc = mf_ref_decode(r, st, tok, batch, logits);
            total = (mf_now_ns() - t0) / 1e9;
            mf_ref_times_get(r, &b);
            ph[MF_STEP_ATTN] = (b.attn_ns - a.attn_ns) / 1e9;
            ph[MF_STEP_MOE] = (b.moe_ns - a.moe_ns) / 1e9;
            ph[MF_STEP_ENGRAM] = (b.engram_ns - a.engram_ns) / 1e9;
            ph[MF_STEP_HEAD] = (b.head_ns - a.head_ns) / 1e9;
            double rest = total - ph[0] - ph[1] - ph[2] - ph[3];
            ph[MF_STEP_OTHER] = rest > 0 ? rest : 0;
        }
        if (rc) break;
        out->decode_cpu_s += mf_bd_cpu_s() - c0;
        for (int p = 0; p < MF_STEP_N_PHASES; p++) out->phase_s[p] += ph[p];
        out->total_s += total;
        if (out->step_s) out->step_s[k] = total;
        if (out->probe && (rc = mf_hwcal_probe_pass(out->probe, out->probe_threads, &out->read_v[out->n_read++])))
            break;
        if (!quiet_rows) {
            char label[16];
            snprintf(label, sizeof label, "%d", k);
            mf_bd_row(label, ph, total, batch / total);
        }
    }
    if (!quiet_rows && !rc) {
        double mean[MF_STEP_N_PHASES];
        for (int p = 0; p < MF_STEP_N_PHASES; p++) mean[p] = out->phase_s[p] / steps;
        mf_bd_row("mean", mean, out->total_s / steps, batch * steps / out->total_s);
    }
    for (int s = 0; s < batch; s++) mf_ref_state_free(st[s]);
    return rc;
}

static void mf_bd_json_phases(const char *key, const mf_bd_run *run, int steps)
{
    printf("\"%s\":{", key);
    for (int p = 0; p < MF_STEP_N_PHASES; p++)
        printf("%s\"%s\":%.6g", p ? "," : "", mf_step_phase_name((mf_step_phase)p), run->phase_s[p] / steps);
    printf("}");
}

/* The command line of `moeflow bench decode`. */
typedef struct mf_bd_cli {
    const char *dir, *trace, *devices;
    long steps, batch, n_prompt, chunk, threads, micro;
    int json, exact, no_ref, dense, dense_split;   /* dense: -1 not given */
    mf_tool_sockets sk;                            /* n 0: --sockets not given (auto) */
    int spec;                                      /* MF_TOOL_SPEC_* */
    long spec_tokens, rounds;                      /* spec_tokens 0: auto */
} mf_bd_cli;

#define F(x) offsetof(mf_bd_cli, x)
static const mf_opt mf_bd_table[] = {
    {"--checkpoint", .kind = MF_OPT_STR, .off = F(dir), .meta = "DIR", .help = "the model"},
    {"--steps", .kind = MF_OPT_LONG, .off = F(steps), .def = "8", .meta = "N", .lo = 1, .hi = 100000,
     .help = "greedy decode steps of the batch"},
    {"--batch", .kind = MF_OPT_LONG, .off = F(batch), .def = "1", .meta = "B", .lo = 1, .hi = MF_STEP_MAX_ITEMS,
     .help = "sequences"},
    {"--threads", .kind = MF_OPT_LONG, .off = F(threads), .meta = "N", .lo = 1, .hi = 256,
     .help = "scheduled engine workers (default: the online CPUs)"},
    {"--prompt-tokens", .kind = MF_OPT_LONG, .off = F(n_prompt), .def = "16", .meta = "P", .lo = 1, .hi = 100000,
     .help = "the synthetic prompt's length"},
    {"--chunk", .kind = MF_OPT_LONG, .off = F(chunk), .meta = "T", .lo = 1, .hi = MF_STEP_MAX_CHUNK,
     .help = "the scheduled engine's prefill chunk (positions per graph run, 1.." MF_OPTS_STR(MF_STEP_MAX_CHUNK)
             ";\ndefault " MF_OPTS_STR(MF_STEP_PREFILL_CHUNK) ")"},
    {"--exact", .kind = MF_OPT_FLAG, .off = F(exact), .help = "the scheduled engine's experts on the fp32 kernel path"},
    {"--no-reference", .kind = MF_OPT_FLAG, .off = F(no_ref),
     .help = "skip the one-thread reference engine (a long prefill takes it minutes)"},
    {"--micro-batches", .kind = MF_OPT_LONG, .off = F(micro), .def = "1", .meta = "M", .lo = 1, .hi = 2,
     .expect = "1 or 2", .help = "2: the scheduled engine with two micro-batches in flight\n(batch >= 2)"},
    {"--sockets", .kind = MF_OPT_FN, .off = F(sk), .meta = "N|auto", .fn = mf_tool_sockets_opt, .example = "1",
     .help = "the scheduled engine with one CPU lane per socket, workers\n"
             "pinned, each routed expert's and dense matrix's rows split across\n"
             "the sockets' workers and memory (as moeflow decode --sockets; the\n"
             "experts here are the model's resident copies, split with the dense\n"
             "weights in the model's memory; MOEFLOW_TOPOLOGY as there); default\n"
             "auto: one lane where hwloc finds one NUMA node"},
    {"--trace", .kind = MF_OPT_STR, .off = F(trace), .meta = "FILE",
     .help = "the Chrome trace of the last scheduled step"},
    {"--json", .kind = MF_OPT_FLAG, .off = F(json),
     .help = "{\"tokens_per_s\", \"reference_tokens_per_s\", \"speedup\",\n"
             "\"prefill_tokens_per_s\", \"decode_tokens_per_s\", \"compute_fraction\",\n"
             "\"floor_fraction\", \"decode_weight_bytes_per_step\", \"read_bytes_per_s\",\n"
             "\"prefill_cpu_s\", \"decode_cpu_s\" (the process's CPU time: what a\n"
             "loaded machine's wall time hides), \"phases\": {phase: seconds per\n"
             "step}, \"reference_phases\": {...}, ...} instead of the tables\n"
             "(reference fields null with --no-reference); it adds the read\n"
             "passes' median and lowest, the floor fraction of the median step,\n"
             "and bf16_tok1_prefetch: whether the one-token BF16 loop (the head)\n"
             "prefetches, as measured on this machine by its first large calls\n"
             "(1 on, 0 off, -1 not decided yet), and fp8_tok1_avx512: whether\n"
             "the one-token FP8 loop runs 16-lane AVX-512 (the CPU has it)"},
    {"--devices", .kind = MF_OPT_STR, .off = F(devices), .meta = "SPEC",
     .help = "cards for the scheduled engine's dense work (emu:N, cuda[:IDS];\n"
             "routed experts on the host)"},
    {"--dense", .kind = MF_OPT_WORD, .off = F(dense), .meta = "host|cards", .words = mf_tool_denses,
     .help = "cards (the default with --devices): the dense work on the\ncards; host: on the host"},
    {"--dense-split", .kind = MF_OPT_WORD, .off = F(dense_split), .def = MF_TOOL_DENSE_SPLIT, .meta = "layers|rows",
     .words = mf_tool_dense_splits,
     .help = "with dense cards: by layer ranges, or every dense matrix\n"
             "but the shared expert split by rows across all cards"},
    {"--spec", .kind = MF_OPT_WORD, .off = F(spec), .def = "off", .meta = "S", .words = mf_tool_specs,
     .help = "instead of the engines' tables: speculative decoding against plain\n"
             "decoding through the batcher, in the same run (tools/bench_spec.c):\n"
             "dspark the checkpoint's draft; perfect the candidates of a greedy run\n"
             "of the same prompts (the upper bound of a draft). A greedy run, one\n"
             "untimed run of each, then --rounds rounds alternating; decode\n"
             "tokens/s (first generated token to last) medians, their ratio, the\n"
             "acceptance by position, tokens per target forward, the verify's\n"
             "measured cost over a plain step, the k chosen (--json: as JSON);\n"
             "fails when a speculating run's greedy tokens differ"},
    {"--spec-tokens", .kind = MF_OPT_FN, .off = F(spec_tokens), .def = "auto", .meta = "N|auto",
     .fn = mf_tool_spec_tokens_opt, .example = "5",
     .help = "with --spec: N candidates every round, or auto (the cost model's\nk per round, on the built-in machine's prices)"},
    {"--rounds", .kind = MF_OPT_LONG, .off = F(rounds), .def = "5", .meta = "R", .lo = 1, .hi = 1000,
     .help = "with --spec: timed rounds (plain then speculating)"},
    {NULL},
};
#undef F

static const mf_opts_spec mf_bd_spec = {
    .cmd = "bench decode",
    .usage =
        "usage: moeflow bench decode --checkpoint DIR [--steps N] [--batch B] [--threads N]\n"
        "                            [--prompt-tokens P] [--chunk T] [--exact] [--no-reference]\n"
        "                            [--micro-batches 1|2] [--sockets N|auto] [--trace FILE] [--json]\n"
        "                            [--devices emu:N|cuda[:IDS] [--dense host|cards]\n"
        "                             [--dense-split layers|rows]]\n"
        "                            [--spec dspark|perfect [--spec-tokens N|auto] [--rounds R]]\n\n"
        "Prefills B sequences of a synthetic P-token prompt (sequence i's tokens are\n"
        "(37 k + 11 + 101 i) mod vocab) and runs N greedy decode steps of the batch with the\n"
        "reference engine, then with the scheduled engine on --threads workers. Prints per\n"
        "engine and step where the time went (ms): attention stack, MoE, Engram, norm + head,\n"
        "other (embedding, checks, copies, scheduling gaps), tokens/s, the speedup scheduled /\n"
        "reference, prefill and decode tokens/s, and the compute fraction: the scheduled engine's\n"
        "kernel multiply-adds per second (the step graph's records) over the fused int8 kernel's\n"
        "rate on the model's expert shape at 64 tokens on the same threads, measured by this\n"
        "command before the engines run; and the floor fraction: the time a decode step's weights\n"
        "(the bytes its host kernels read, from the records) take at the streaming read rate of\n"
        "the same threads over the mean measured step time (at batch 1: how close a token is to\n"
        "the memory floor). The read rate is the best pass of a probe: the --threads threads,\n"
        "unbound as the engine's workers, each read its slice of a 256 MiB buffer (2 MiB pages\n"
        "where the kernel allows, as the weights) once with 32-byte loads, timed from a common\n"
        "start to the last one's end; 5 passes before the engines run and one after every\n"
        "scheduled decode step (untimed), so a rate that moves during the run is seen at its best.\n\n",
    .opts = mf_bd_table,
    .col = 22,
};

/* A run of bench decode: the model, both engines' runs, the rates measured beside them. */
typedef struct mf_bd {
    const mf_bd_cli *a;
    int dense;
    mf_model *m;
    mf_ref *r;
    mf_step *eng;
    mf_dev *dev;
    const mf_config *c;
    float *logits;
    mf_bd_run ref, sch;
    double kern_rate, read_rate, read_med, read_min;
} mf_bd;

/* The model (with sockets, the weights split over their memory as the engine's row parts are),
 * the reference, the cards and the scheduled engine. 0, a negative code, or 2 (said on stderr). */
static int mf_bd_open(mf_bd *b)
{
    const mf_bd_cli *a = b->a;
    mf_model_opts mo = {.quiet = a->json, .resident_limit_bytes = UINT64_C(64) << 30, .n_sockets = a->sk.n};
    memcpy(mo.socket_node, a->sk.node, sizeof mo.socket_node);
    int rc = mf_model_load(a->dir, &mo, &b->m);
    if (!rc) rc = mf_ref_new(b->m, NULL, &b->r);
    if (!rc && b->dense) rc = mf_dev_open(a->devices, &b->dev);
    if (!rc)
        rc = mf_step_new(b->r, &(mf_step_opts){.n_threads = (int)a->threads, .exact = a->exact,
                                                .max_batch = a->batch > MF_STEP_DEFAULT_BATCH ? (int)a->batch : 0,
                                                .prefill_chunk = (int)a->chunk, .dev = b->dev,
                                                .dense = b->dense ? MF_STEP_DENSE_CARDS : MF_STEP_DENSE_HOST,
                                                .dense_split = a->dense_split, .micro = (int)a->micro,
                                                .n_sockets = a->sk.n, .topology = a->sk.topology,
                                                .pin_threads = a->sk.n > 1},
                         &b->eng);
    if (rc) return rc;
    b->c = mf_model_config(b->m);
    if (a->n_prompt + a->steps + 1 > b->c->max_position_embeddings) {
        fprintf(stderr, "moeflow bench decode: --prompt-tokens + --steps pass max_position_embeddings\n");
        return 2;
    }
    long steps = a->steps, batch = a->batch;
    b->logits = malloc(sizeof(float) * (size_t)b->c->vocab_size * (size_t)batch);
    b->ref.tokens = malloc(sizeof(int32_t) * (size_t)(steps * batch));
    b->sch.tokens = malloc(sizeof(int32_t) * (size_t)(steps * batch));
    b->sch.step_s = malloc(sizeof(double) * (size_t)steps);
    b->sch.read_v = malloc(sizeof(double) * (size_t)(steps + MF_BD_READ_FIRST));
    if (!b->logits || !b->ref.tokens || !b->sch.tokens || !b->sch.step_s || !b->sch.read_v)
        return mf_error(-ENOMEM, "out of memory");
    return 0;
}

/* The kernel rate, the first read passes, both engines (the read probe after every scheduled
 * decode step), the trace; then the read rates' best, median and lowest. */
static int mf_bd_measure(mf_bd *b)
{
    const mf_bd_cli *a = b->a;
    int threads = (int)a->threads, batch = (int)a->batch, n_prompt = (int)a->n_prompt, steps = (int)a->steps;
    mf_bd_run *sch = &b->sch;
    int rc = mf_bd_kernel_rate(b->c, threads, &b->kern_rate);
    if (!rc) rc = mf_hwcal_probe_new(MF_BD_READ_BYTES, &sch->probe);
    if (rc) return rc;
    sch->probe_threads = threads;
    for (int k = 0; k < MF_BD_READ_FIRST && !rc; k++) rc = mf_hwcal_probe_pass(sch->probe, threads, &sch->read_v[sch->n_read++]);
    if (!rc && !a->no_ref)
        rc = mf_bd_engine(b->r, NULL, b->c->vocab_size, batch, n_prompt, steps, a->json, b->logits, &b->ref);
    if (!rc) rc = mf_bd_engine(b->r, b->eng, b->c->vocab_size, batch, n_prompt, steps, a->json, b->logits, sch);
    if (!rc && a->trace) rc = mf_step_write_trace(b->eng, a->trace);
    if (rc) return rc;
    qsort(sch->read_v, (size_t)sch->n_read, sizeof(double), mf_bd_cmp);
    b->read_rate = sch->read_v[sch->n_read - 1];
    b->read_min = sch->read_v[0];
    b->read_med = sch->read_v[sch->n_read / 2];
    qsort(sch->step_s, (size_t)steps, sizeof(double), mf_bd_cmp);
    return 0;
}

/* What the report prints: rates, fractions, agreement of the engines' greedy inputs. */
typedef struct mf_bd_sum {
    double tps, rtps, ptps, rptps, pfrac, dfrac, frac, step_bytes, floor_s, floor_frac, floor_frac_med, step_med;
    int same;
} mf_bd_sum;

static mf_bd_sum mf_bd_summary(const mf_bd *b)
{
    const mf_bd_cli *a = b->a;
    const mf_bd_run *sch = &b->sch, *ref = &b->ref;
    long steps = a->steps, batch = a->batch, n_prompt = a->n_prompt;
    mf_bd_sum x = {0};
    x.step_med = sch->step_s[steps / 2];
    x.tps = batch * steps / sch->total_s;
    x.rtps = a->no_ref ? 0 : batch * steps / ref->total_s;
    x.ptps = batch * n_prompt / sch->prefill_s;
    x.rptps = a->no_ref ? 0 : batch * n_prompt / ref->prefill_s;
    /* compute fraction: kernel multiply-adds per second over the fused kernel's rate */
    x.pfrac = sch->prefill_macs / sch->prefill_s / b->kern_rate;
    x.dfrac = sch->decode_macs / sch->total_s / b->kern_rate;
    x.frac = (sch->prefill_macs + sch->decode_macs) / (sch->prefill_s + sch->total_s) / b->kern_rate;
    /* floor fraction: the time to read a step's weights at the read rate over the measured step */
    x.step_bytes = sch->decode_weight_bytes / steps;
    x.floor_s = x.step_bytes / b->read_rate;
    x.floor_frac = x.floor_s / (sch->total_s / steps);
    x.floor_frac_med = x.floor_s / x.step_med;
    for (long k = 0; k < steps * batch && !a->no_ref; k++) x.same += ref->tokens[k] == sch->tokens[k];
    return x;
}

static void mf_bd_json(const mf_bd *b, const mf_bd_sum *x)
{
    const mf_bd_cli *a = b->a;
    const mf_bd_run *sch = &b->sch;
    char rt[32] = "null", sp[32] = "null", rp[32] = "null", sm[16] = "null";
    if (!a->no_ref) {
        snprintf(rt, sizeof rt, "%.6g", x->rtps);
        snprintf(sp, sizeof sp, "%.6g", x->tps / x->rtps);
        snprintf(rp, sizeof rp, "%.6g", x->rptps);
        snprintf(sm, sizeof sm, "%d", x->same);
    }
    printf("{\"tokens_per_s\":%.6g,\"reference_tokens_per_s\":%s,\"speedup\":%s,\"batch\":%ld,"
           "\"threads\":%ld,\"steps\":%ld,\"prompt_tokens\":%ld,\"chunk\":%ld,\"exact\":%d,\"same_tokens\":%s,"
           "\"prefill_tokens_per_s\":%.6g,\"reference_prefill_tokens_per_s\":%s,\"decode_tokens_per_s\":%.6g,"
           "\"compute_fraction\":%.6g,\"prefill_compute_fraction\":%.6g,\"decode_compute_fraction\":%.6g,"
           "\"prefill_macs_per_token\":%.6g,\"decode_macs_per_token\":%.6g,\"kernel_macs_per_s\":%.6g,"
           "\"prefill_s\":%.6g,\"prefill_cpu_s\":%.6g,\"decode_s\":%.6g,\"decode_cpu_s\":%.6g,"
           "\"decode_weight_bytes_per_step\":%.6g,\"read_bytes_per_s\":%.6g,\"floor_fraction\":%.6g,"
           "\"read_bytes_per_s_median\":%.6g,\"read_bytes_per_s_min\":%.6g,\"read_passes\":%d,"
           "\"step_s_median\":%.6g,\"floor_fraction_median_step\":%.6g,\"bf16_tok1_prefetch\":%d,"
           "\"fp8_tok1_avx512\":%d,",
           x->tps, rt, sp, a->batch, a->threads, a->steps, a->n_prompt, a->chunk ? a->chunk : MF_STEP_PREFILL_CHUNK,
           a->exact, sm, x->ptps, rp, x->tps, x->frac, x->pfrac, x->dfrac, sch->prefill_macs / (a->batch * a->n_prompt),
           sch->decode_macs / (a->batch * a->steps), b->kern_rate, sch->prefill_s, sch->prefill_cpu_s, sch->total_s,
           sch->decode_cpu_s, x->step_bytes, b->read_rate, x->floor_frac, b->read_med, b->read_min, sch->n_read,
           x->step_med, x->floor_frac_med, mf_kern_bf16_tok1_prefetch(), mf_kern_fp8_tok1_avx512());
    mf_bd_json_phases("phases", sch, (int)a->steps);
    printf(",");
    if (a->no_ref) printf("\"reference_phases\":null");
    else mf_bd_json_phases("reference_phases", &b->ref, (int)a->steps);
    printf("}\n");
}

static void mf_bd_text(const mf_bd *b, const mf_bd_sum *x)
{
    const mf_bd_cli *a = b->a;
    const mf_bd_run *sch = &b->sch;
    long steps = a->steps, batch = a->batch;
    if (!a->no_ref)
        printf("\ntokens/s: scheduled %.2f, reference %.2f: speedup %.2fx; greedy inputs equal in %d of %ld "
               "(step, sequence) pairs\n", x->tps, x->rtps, x->tps / x->rtps, x->same, steps * batch);
    printf("%sprefill: %.2f tokens/s%s; decode: %.2f tokens/s (process CPU time: prefill %.2f s, decode "
           "%.2f s; wall %.2f s, %.2f s)\n", a->no_ref ? "\n" : "", x->ptps,
           a->no_ref ? "" : " (reference engine's shown in --json)", x->tps, sch->prefill_cpu_s, sch->decode_cpu_s,
           sch->prefill_s, sch->total_s);
    printf("compute fraction: prefill %.3f (%.1f M multiply-adds per token), decode %.3f (%.1f M), all %.3f, "
           "of the fused int8 kernel's %.1f G multiply-adds/s on %ld threads\n", x->pfrac,
           sch->prefill_macs / (batch * a->n_prompt) / 1e6, x->dfrac, sch->decode_macs / (batch * steps) / 1e6,
           x->frac, b->kern_rate / 1e9, a->threads);
    printf("floor fraction: %.3f (a decode step's %.1f MB of weights at the measured read rate of %.2f GB/s "
           "on %ld threads take %.2f ms; the step took %.2f ms); %.3f of the median step (%.2f ms); read "
           "rate: best of %d passes, median %.2f, lowest %.2f GB/s\n", x->floor_frac, x->step_bytes / 1e6,
           b->read_rate / 1e9, a->threads, x->floor_s * 1e3, sch->total_s / steps * 1e3, x->floor_frac_med,
           x->step_med * 1e3, sch->n_read, b->read_med / 1e9, b->read_min / 1e9);
    if (a->trace) printf("trace of the last scheduled step: %s\n", a->trace);
}

static void mf_bd_close(mf_bd *b)
{
    free(b->logits);
    free(b->ref.tokens);
    free(b->sch.tokens);
    free(b->sch.step_s);
    free(b->sch.read_v);
    mf_hwcal_probe_free(b->sch.probe);
    mf_step_free(b->eng);
    mf_dev_close(b->dev);
    mf_ref_free(b->r);
    mf_model_free(b->m);
}

int mf_bench_decode(int argc, char **argv)
{
    mf_bd_cli a = {.threads = sysconf(_SC_NPROCESSORS_ONLN), .dense = -1};
    if (a.threads < 1) a.threads = 1;
    int rc = mf_opts_parse(&mf_bd_spec, argc, argv, &a);
    if (rc != MF_OPTS_RUN) return rc;
    if (!a.sk.n) {   /* auto: every socket hwloc finds, at most one per worker */
        if (mf_tool_sockets_of("auto", &a.sk)) {
            fprintf(stderr, "moeflow bench decode: %s\n", mf_last_error());
            return 2;
        }
        if (a.sk.n > a.threads) a.sk.n = (int)a.threads;
    }
    if (!a.dir) return mf_opts_refuse(&mf_bd_spec, "--checkpoint DIR is required");
    if (a.spec) {   /* plain against speculating runs instead of the engines' tables */
        mf_bench_spec_opts so = {.dir = a.dir, .spec = a.spec, .exact = a.exact, .json = a.json,
                                 .spec_tokens = a.spec_tokens, .batch = a.batch, .steps = a.steps,
                                 .n_prompt = a.n_prompt, .threads = a.threads, .rounds = a.rounds};
        if ((rc = mf_bench_decode_spec(&so)))
            fprintf(stderr, "moeflow bench decode: %s\n", mf_last_error()[0] ? mf_last_error() : "failed");
        return rc ? 1 : 0;
    }
    static mf_bd b;
    b = (mf_bd){.a = &a, .dense = a.dense >= 0 ? a.dense == MF_PLAN_DENSE_CARDS : a.devices != NULL};
    if (b.dense && !a.devices) {
        fprintf(stderr, "moeflow bench decode: --dense cards needs --devices\n");
        return 2;
    }
    rc = mf_bd_open(&b);
    if (!rc && !a.json)
        printf("bench decode: %s, batch %ld, %ld-token prompt, %ld steps; scheduled engine on %ld threads (%s "
               "experts)%s\n", a.dir, a.batch, a.n_prompt, a.steps, a.threads, a.exact ? "fp32" : "int8",
               a.no_ref ? "; no reference engine" : "");
    if (!rc) rc = mf_bd_measure(&b);
    if (!rc) {
        mf_bd_sum x = mf_bd_summary(&b);
        if (a.json) mf_bd_json(&b, &x);
        else mf_bd_text(&b, &x);
    }
    if (rc < 0) fprintf(stderr, "moeflow bench decode: %s\n", mf_last_error()[0] ? mf_last_error() : "out of memory");
    mf_bd_close(&b);
    return rc < 0 ? 1 : rc;
}
