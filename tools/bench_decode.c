/* `moeflow bench decode`: prefill and decode steps of the reference engine and the scheduled engine
 * in the same run, on the same synthetic prompt, with a phase table per engine (attention stack,
 * MoE, Engram, norm + head, other) per step, tokens/s and the speedup, and the scheduled engine's
 * compute fraction: its kernel multiply-adds (the step graph's records) per second over the fused
 * int8 kernel's rate measured in the same run; --trace writes one scheduled step's timeline,
 * --json a machine-readable summary. */
#include <errno.h>
#include <inttypes.h>
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

static void mf_bench_decode_usage(FILE *f)
{
    fprintf(f,
            "usage: moeflow bench decode --checkpoint DIR [--steps N] [--batch B] [--threads N]\n"
            "                            [--prompt-tokens P] [--chunk T] [--exact] [--no-reference]\n"
            "                            [--micro-batches 1|2] [--sockets N|auto] [--trace FILE] [--json]\n"
            "                            [--devices emu:N|cuda[:IDS] [--dense host|cards]\n"
            "                             [--dense-split layers|rows]]\n\n"
            "Prefills B sequences of a synthetic P-token prompt (default 16; sequence i's tokens are\n"
            "(37 k + 11 + 101 i) mod vocab) and runs N greedy decode steps (default 8) of the batch\n"
            "with the reference engine, then with the scheduled engine on --threads workers (default\n"
            "the online CPUs). Prints per engine and step where the time went (ms): attention stack,\n"
            "MoE, Engram, norm + head, other (embedding, checks, copies, scheduling gaps), tokens/s,\n"
            "the speedup scheduled / reference, prefill and decode tokens/s, and the compute fraction:\n"
            "the scheduled engine's kernel multiply-adds per second (the step graph's records) over\n"
            "the fused int8 kernel's rate on the model's expert shape at 64 tokens on the same\n"
            "threads, measured by this command before the engines run; and the floor fraction: the\n"
            "time a decode step's weights (the bytes its host kernels read, from the records) take at\n"
            "the streaming read rate of the same threads over the mean measured step time (at batch 1:\n"
            "how close a token is to the memory floor). The read rate is the best pass of a probe: the\n"
            "--threads threads, unbound as the engine's workers, each read its slice of a 256 MiB buffer\n"
            "(2 MiB pages where the kernel allows, as the weights) once with 32-byte loads, timed from a\n"
            "common start to the last one's end; 5 passes before the engines run and one after every\n"
            "scheduled decode step (untimed), so a rate that moves during the run is seen at its best.\n"
            "The JSON adds the passes' median and lowest, the floor fraction of the median step, and\n"
            "bf16_tok1_prefetch: whether the one-token BF16 loop (the head) prefetches, as measured on\n"
            "this machine by its first large calls (1 on, 0 off, -1 not decided yet), and\n"
            "fp8_tok1_avx512: whether the one-token FP8 loop runs 16-lane AVX-512 (the CPU has it).\n"
            "--micro-batches 2: the scheduled engine with two micro-batches in flight (batch >= 2).\n"
            "--sockets N|auto (default auto: one lane where hwloc finds one NUMA node): the\n"
            "scheduled engine with one CPU lane per socket, workers pinned,\n"
            "each routed expert's and dense matrix's rows split across the sockets' workers and memory\n"
            "(as moeflow decode --sockets; the experts here are the model's resident copies, split\n"
            "with the dense weights in the model's memory).\n"
            "--no-reference skips the one-thread reference engine (a long prefill takes it\n"
            "minutes). --chunk T: the scheduled\n"
            "engine's prefill chunk (positions per graph run, 1..%d; default %d). --exact runs the\n"
            "scheduled engine's experts on the fp32 kernel path. --trace FILE writes the Chrome trace\n"
            "of the last scheduled step. --json prints {\"tokens_per_s\", \"reference_tokens_per_s\",\n"
            "\"speedup\", \"prefill_tokens_per_s\", \"decode_tokens_per_s\", \"compute_fraction\",\n"
            "\"floor_fraction\", \"decode_weight_bytes_per_step\", \"read_bytes_per_s\",\n"
            "\"prefill_cpu_s\", \"decode_cpu_s\" (the process's CPU time: what a loaded machine's wall\n"
            "time hides), \"phases\": {phase: seconds per step}, \"reference_phases\": {...}, ...} instead of the\n"
            "tables (reference fields null with --no-reference).\n"
            "--devices SPEC with --dense cards (the default with devices) runs the scheduled engine's\n"
            "dense work on those cards (routed experts on the host), by layer ranges or, with\n"
            "--dense-split rows (the default), every dense matrix but the shared expert split by rows\n"
            "across all.\n",
            MF_STEP_MAX_CHUNK, MF_STEP_PREFILL_CHUNK);
}

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

int mf_bench_decode(int argc, char **argv)
{
    const char *dir = NULL, *trace = NULL, *devices = NULL, *dense_s = NULL;
    int dense_split = MF_TOOL_DENSE_SPLIT;
    long steps = 8, batch = 1, n_prompt = 16, chunk = 0, threads = sysconf(_SC_NPROCESSORS_ONLN);
    int json = 0, exact = 0, no_ref = 0, micro = 1;
    mf_tool_sockets sk = {.n = 0};   /* 0: --sockets not given (auto)*/
    if (threads < 1) threads = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int hv = i + 1 < argc;
        char *end = NULL;
        long *num = !strcmp(a, "--steps") ? &steps : !strcmp(a, "--batch") ? &batch
                  : !strcmp(a, "--threads") ? &threads : !strcmp(a, "--prompt-tokens") ? &n_prompt
                  : !strcmp(a, "--chunk") ? &chunk : NULL;
        long lo = 1, hi = !strcmp(a, "--batch") ? MF_STEP_MAX_ITEMS : !strcmp(a, "--chunk") ? MF_STEP_MAX_CHUNK
                          : !strcmp(a, "--threads") ? 256 : 100000;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            mf_bench_decode_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--checkpoint") && hv) {
            dir = argv[++i];
        } else if (!strcmp(a, "--trace") && hv) {
            trace = argv[++i];
        } else if (!strcmp(a, "--devices") && hv) {
            devices = argv[++i];
        } else if (!strcmp(a, "--dense") && hv) {
            dense_s = argv[++i];
            if (mf_tool_dense(dense_s) < 0) {
                fprintf(stderr, "moeflow bench decode: --dense: expected host or cards, found '%s'\n", dense_s);
                return 2;
            }
        } else if (!strcmp(a, "--dense-split") && hv) {
            if ((dense_split = mf_tool_dense_split(argv[++i])) < 0) {
                fprintf(stderr, "moeflow bench decode: --dense-split: expected layers or rows, found '%s'\n",
                        argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--sockets") && hv) {
            if (mf_tool_sockets_arg("bench decode", argv[++i], &sk)) return 2;
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (!strcmp(a, "--exact")) {
            exact = 1;
        } else if (!strcmp(a, "--no-reference")) {
            no_ref = 1;
        } else if (!strcmp(a, "--micro-batches") && hv) {
            micro = atoi(argv[++i]);
            if (micro != 1 && micro != 2) {
                fprintf(stderr, "moeflow bench decode: --micro-batches: expected 1 or 2, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (num && hv) {
            *num = strtol(argv[++i], &end, 10);
            if (*end || !*argv[i] || *num < lo || *num > hi) {
                fprintf(stderr, "moeflow bench decode: %s: expected %ld..%ld, found '%s'\n", a, lo, hi, argv[i]);
                return 2;
            }
        } else {
            fprintf(stderr, "moeflow bench decode: unknown or incomplete option '%s'\n\n", a);
            mf_bench_decode_usage(stderr);
            return 2;
        }
    }
    if (!sk.n) {   /* auto: every socket hwloc finds, at most one per worker */
        if (mf_tool_sockets_arg("bench decode", "auto", &sk)) return 2;
        if (sk.n > threads) sk.n = (int)threads;
    }
    if (!dir) {
        fprintf(stderr, "moeflow bench decode: --checkpoint DIR is required\n\n");
        mf_bench_decode_usage(stderr);
        return 2;
    }
    int dense = dense_s ? mf_tool_dense(dense_s) == MF_PLAN_DENSE_CARDS : devices != NULL;
    if (dense && !devices) {
        fprintf(stderr, "moeflow bench decode: --dense cards needs --devices\n");
        return 2;
    }
    int ret = 1;
    mf_model *m = NULL;
    mf_ref *r = NULL;
    mf_step *eng = NULL;
    mf_dev *dev = NULL;
    float *logits = NULL;
    mf_bd_run ref = {0}, sch = {0};
    /* with sockets, the weights split over their memory as the engine's row parts are */
    mf_model_opts mo = {.quiet = json, .resident_limit_bytes = UINT64_C(64) << 30, .n_sockets = sk.n};
    memcpy(mo.socket_node, sk.node, sizeof mo.socket_node);
    if (mf_model_load(dir, &mo, &m) ||
        mf_ref_new(m, NULL, &r) || (dense && mf_dev_open(devices, &dev)) ||
        mf_step_new(r, &(mf_step_opts){.n_threads = (int)threads, .exact = exact, .prefill_chunk = (int)chunk,
                                       .dev = dev, .dense = dense ? MF_STEP_DENSE_CARDS : MF_STEP_DENSE_HOST,
                                       .dense_split = dense_split, .micro = micro, .n_sockets = sk.n,
                                       .topology = sk.topology, .pin_threads = sk.n > 1},
                    &eng))
        goto fail;
    const mf_config *c = mf_model_config(m);
    if (n_prompt + steps + 1 > c->max_position_embeddings) {
        fprintf(stderr, "moeflow bench decode: --prompt-tokens + --steps pass max_position_embeddings\n");
        ret = 2;
        goto out;
    }
    logits = malloc(sizeof(float) * (size_t)c->vocab_size * (size_t)batch);
    ref.tokens = malloc(sizeof(int32_t) * (size_t)(steps * batch));
    sch.tokens = malloc(sizeof(int32_t) * (size_t)(steps * batch));
    sch.step_s = malloc(sizeof(double) * (size_t)steps);
    sch.read_v = malloc(sizeof(double) * (size_t)(steps + MF_BD_READ_FIRST));
    if (!logits || !ref.tokens || !sch.tokens || !sch.step_s || !sch.read_v) {
        mf_error(-ENOMEM, "out of memory");
        goto fail;
    }
    if (!json)
        printf("bench decode: %s, batch %ld, %ld-token prompt, %ld steps; scheduled engine on %ld threads (%s "
               "experts)%s\n", dir, batch, n_prompt, steps, threads, exact ? "fp32" : "int8",
               no_ref ? "; no reference engine" : "");
    double kern_rate = 0, read_rate = 0, read_med = 0, read_min = 0;
    if (mf_bd_kernel_rate(c, (int)threads, &kern_rate)) goto fail;
    /* the read rate (the usage text says what and why): MF_BD_READ_FIRST passes now, one after
     * every scheduled decode step, the best of all */
    if (mf_hwcal_probe_new(MF_BD_READ_BYTES, &sch.probe)) goto fail;
    sch.probe_threads = (int)threads;
    for (int k = 0; k < MF_BD_READ_FIRST; k++)
        if (mf_hwcal_probe_pass(sch.probe, (int)threads, &sch.read_v[sch.n_read++])) goto fail;
    if ((!no_ref && mf_bd_engine(r, NULL, c->vocab_size, (int)batch, (int)n_prompt, (int)steps, json, logits, &ref)) ||
        mf_bd_engine(r, eng, c->vocab_size, (int)batch, (int)n_prompt, (int)steps, json, logits, &sch))
        goto fail;
    if (trace && mf_step_write_trace(eng, trace)) goto fail;
    qsort(sch.read_v, (size_t)sch.n_read, sizeof(double), mf_bd_cmp);
    read_rate = sch.read_v[sch.n_read - 1];
    read_min = sch.read_v[0];
    read_med = sch.read_v[sch.n_read / 2];
    qsort(sch.step_s, (size_t)steps, sizeof(double), mf_bd_cmp);
    double step_med = sch.step_s[steps / 2];
    double tps = batch * steps / sch.total_s, rtps = no_ref ? 0 : batch * steps / ref.total_s;
    double ptps = batch * n_prompt / sch.prefill_s, rptps = no_ref ? 0 : batch * n_prompt / ref.prefill_s;
    /* compute fraction: kernel multiply-adds per second over the fused kernel's rate */
    double pfrac = sch.prefill_macs / sch.prefill_s / kern_rate, dfrac = sch.decode_macs / sch.total_s / kern_rate;
    double frac = (sch.prefill_macs + sch.decode_macs) / (sch.prefill_s + sch.total_s) / kern_rate;
    /* floor fraction: the time to read a step's weights at the read rate over the measured step */
    double step_bytes = sch.decode_weight_bytes / steps, floor_s = step_bytes / read_rate;
    double floor_frac = floor_s / (sch.total_s / steps), floor_frac_med = floor_s / step_med;
    int same = 0;
    for (long k = 0; k < steps * batch && !no_ref; k++) same += ref.tokens[k] == sch.tokens[k];
    if (json) {
        char rt[32] = "null", sp[32] = "null", rp[32] = "null", sm[16] = "null";
        if (!no_ref) {
            snprintf(rt, sizeof rt, "%.6g", rtps);
            snprintf(sp, sizeof sp, "%.6g", tps / rtps);
            snprintf(rp, sizeof rp, "%.6g", rptps);
            snprintf(sm, sizeof sm, "%d", same);
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
               tps, rt, sp, batch, threads, steps, n_prompt, chunk ? chunk : MF_STEP_PREFILL_CHUNK, exact, sm, ptps, rp, tps, frac, pfrac, dfrac,
               sch.prefill_macs / (batch * n_prompt), sch.decode_macs / (batch * steps), kern_rate, sch.prefill_s,
               sch.prefill_cpu_s, sch.total_s, sch.decode_cpu_s, step_bytes, read_rate, floor_frac, read_med, read_min,
               sch.n_read, step_med, floor_frac_med, mf_kern_bf16_tok1_prefetch(), mf_kern_fp8_tok1_avx512());
        mf_bd_json_phases("phases", &sch, (int)steps);
        printf(",");
        if (no_ref) printf("\"reference_phases\":null");
        else mf_bd_json_phases("reference_phases", &ref, (int)steps);
        printf("}\n");
    } else {
        if (!no_ref)
            printf("\ntokens/s: scheduled %.2f, reference %.2f: speedup %.2fx; greedy inputs equal in %d of %ld "
                   "(step, sequence) pairs\n", tps, rtps, tps / rtps, same, steps * batch);
        printf("%sprefill: %.2f tokens/s%s; decode: %.2f tokens/s (process CPU time: prefill %.2f s, decode "
               "%.2f s; wall %.2f s, %.2f s)\n", no_ref ? "\n" : "", ptps,
               no_ref ? "" : " (reference engine's shown in --json)", tps, sch.prefill_cpu_s, sch.decode_cpu_s,
               sch.prefill_s, sch.total_s);
        printf("compute fraction: prefill %.3f (%.1f M multiply-adds per token), decode %.3f (%.1f M), all %.3f, "
               "of the fused int8 kernel's %.1f G multiply-adds/s on %ld threads\n", pfrac,
               sch.prefill_macs / (batch * n_prompt) / 1e6, dfrac, sch.decode_macs / (batch * steps) / 1e6, frac,
               kern_rate / 1e9, threads);
        printf("floor fraction: %.3f (a decode step's %.1f MB of weights at the measured read rate of %.2f GB/s "
               "on %ld threads take %.2f ms; the step took %.2f ms); %.3f of the median step (%.2f ms); read "
               "rate: best of %d passes, median %.2f, lowest %.2f GB/s\n", floor_frac, step_bytes / 1e6,
               read_rate / 1e9, threads, floor_s * 1e3, sch.total_s / steps * 1e3, floor_frac_med, step_med * 1e3,
               sch.n_read, read_med / 1e9, read_min / 1e9);
        if (trace) printf("trace of the last scheduled step: %s\n", trace);
    }
    ret = 0;
    goto out;
fail:
    fprintf(stderr, "moeflow bench decode: %s\n", mf_last_error()[0] ? mf_last_error() : "out of memory");
out:
    free(logits);
    free(ref.tokens);
    free(sch.tokens);
    free(sch.step_s);
    free(sch.read_v);
    mf_hwcal_probe_free(sch.probe);
    mf_step_free(eng);
    mf_dev_close(dev);
    mf_ref_free(r);
    mf_model_free(m);
    return ret;
}
