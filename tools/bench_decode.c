/* `moeflow bench decode`: decode steps of the reference engine and the scheduled engine in the same
 * run, on the same synthetic prompt, with a phase table per engine (attention stack, MoE, Engram,
 * norm + head, other) per step, tokens/s and the speedup; --trace writes one scheduled step's
 * timeline, --json a machine-readable summary. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/sample.h"
#include "graphs/step/step.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "tools/commands.h"

static void mf_bench_decode_usage(FILE *f)
{
    fprintf(f,
            "usage: moeflow bench decode --checkpoint DIR [--steps N] [--batch B] [--threads N]\n"
            "                            [--prompt-tokens P] [--exact] [--trace FILE] [--json]\n\n"
            "Prefills B sequences of a synthetic P-token prompt (default 16; sequence i's tokens are\n"
            "(37 k + 11 + 101 i) mod vocab) and runs N greedy decode steps (default 8) of the batch\n"
            "with the reference engine, then with the scheduled engine on --threads workers (default\n"
            "the online CPUs). Prints per engine and step where the time went (ms): attention stack,\n"
            "MoE, Engram, norm + head, other (embedding, checks, copies, scheduling gaps), tokens/s,\n"
            "and the speedup scheduled / reference. --exact runs the scheduled engine's experts on\n"
            "the fp32 kernel path. --trace FILE writes the Chrome trace of the last scheduled step.\n"
            "--json prints {\"tokens_per_s\", \"reference_tokens_per_s\", \"speedup\", \"phases\":\n"
            "{phase: seconds per step}, \"reference_phases\": {...}, ...} instead of the tables.\n");
}

typedef struct mf_bd_run {
    double phase_s[MF_STEP_N_PHASES];   /* summed over steps */
    double total_s;
    int32_t *tokens;                    /* steps x batch: the greedy inputs fed */
} mf_bd_run;

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
            rc = eng ? mf_step_prefill(eng, st[s], prompt, n_prompt, lg) : mf_ref_prefill(r, st[s], prompt, n_prompt, lg);
        }
    }
    free(prompt);
    if (!quiet_rows && !rc) mf_bd_header(eng ? "scheduled" : "reference", batch);
    for (int k = 0; k < steps && !rc; k++) {
        int32_t tok[MF_STEP_MAX_ITEMS];
        for (int s = 0; s < batch; s++) tok[s] = out->tokens[k * batch + s] = mf_sample_greedy(logits + (size_t)s * V, V);
        double ph[MF_STEP_N_PHASES] = {0}, total;
        if (eng) {
            rc = mf_step_decode(eng, st, tok, batch, logits);
            mf_step_times t;
            mf_step_last_times(eng, &t);
            for (int p = 0; p < MF_STEP_N_PHASES; p++) ph[p] = t.phase_ns[p] / 1e9;
            total = t.wall_ns / 1e9;
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
        for (int p = 0; p < MF_STEP_N_PHASES; p++) out->phase_s[p] += ph[p];
        out->total_s += total;
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
    const char *dir = NULL, *trace = NULL;
    long steps = 8, batch = 1, n_prompt = 16, threads = sysconf(_SC_NPROCESSORS_ONLN);
    int json = 0, exact = 0;
    if (threads < 1) threads = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int hv = i + 1 < argc;
        char *end = NULL;
        long *num = !strcmp(a, "--steps") ? &steps : !strcmp(a, "--batch") ? &batch
                  : !strcmp(a, "--threads") ? &threads : !strcmp(a, "--prompt-tokens") ? &n_prompt : NULL;
        long lo = 1, hi = !strcmp(a, "--batch") ? MF_STEP_MAX_ITEMS : !strcmp(a, "--threads") ? 256 : 100000;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            mf_bench_decode_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--checkpoint") && hv) {
            dir = argv[++i];
        } else if (!strcmp(a, "--trace") && hv) {
            trace = argv[++i];
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (!strcmp(a, "--exact")) {
            exact = 1;
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
    if (!dir) {
        fprintf(stderr, "moeflow bench decode: --checkpoint DIR is required\n\n");
        mf_bench_decode_usage(stderr);
        return 2;
    }
    int ret = 1;
    mf_model *m = NULL;
    mf_ref *r = NULL;
    mf_step *eng = NULL;
    float *logits = NULL;
    mf_bd_run ref = {0}, sch = {0};
    if (mf_model_load(dir, &(mf_model_opts){.quiet = json, .resident_limit_bytes = UINT64_C(64) << 30}, &m) ||
        mf_ref_new(m, NULL, &r) ||
        mf_step_new(r, &(mf_step_opts){.n_threads = (int)threads, .exact = exact}, &eng))
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
    if (!logits || !ref.tokens || !sch.tokens) {
        mf_error(-ENOMEM, "out of memory");
        goto fail;
    }
    if (!json)
        printf("bench decode: %s, batch %ld, %ld-token prompt, %ld steps; scheduled engine on %ld threads (%s "
               "experts)\n", dir, batch, n_prompt, steps, threads, exact ? "fp32" : "int8");
    if (mf_bd_engine(r, NULL, c->vocab_size, (int)batch, (int)n_prompt, (int)steps, json, logits, &ref) ||
        mf_bd_engine(r, eng, c->vocab_size, (int)batch, (int)n_prompt, (int)steps, json, logits, &sch))
        goto fail;
    if (trace && mf_step_write_trace(eng, trace)) goto fail;
    double tps = batch * steps / sch.total_s, rtps = batch * steps / ref.total_s;
    int same = 0;
    for (long k = 0; k < steps * batch; k++) same += ref.tokens[k] == sch.tokens[k];
    if (json) {
        printf("{\"tokens_per_s\":%.6g,\"reference_tokens_per_s\":%.6g,\"speedup\":%.6g,\"batch\":%ld,"
               "\"threads\":%ld,\"steps\":%ld,\"exact\":%d,\"same_tokens\":%d,", tps, rtps, tps / rtps, batch,
               threads, steps, exact, same);
        mf_bd_json_phases("phases", &sch, (int)steps);
        printf(",");
        mf_bd_json_phases("reference_phases", &ref, (int)steps);
        printf("}\n");
    } else {
        printf("\ntokens/s: scheduled %.2f, reference %.2f: speedup %.2fx; greedy inputs equal in %d of %ld "
               "(step, sequence) pairs\n", tps, rtps, tps / rtps, same, steps * batch);
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
    mf_step_free(eng);
    mf_ref_free(r);
    mf_model_free(m);
    return ret;
}
