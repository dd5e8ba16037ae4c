/* `moeflow bench weights`: the scheduled engine's decode steps on the ways weights can be held
 * (docs/io.md), in one process, alternating: mapped from the page cache (--weights mapped), a
 * private copy read at start (--weights copied) and the resident expert store (--weights copied
 * --store resident: experts and Engram tables read with O_DIRECT into the store's slab). Each way
 * prefills the same prompt, then the ways take turns running --steps decode steps, --rounds times
 * (the order of the turns rotating from round to round);
 * prints the median step time and tokens/s of each, their ratio to the mapped way, the process's CPU
 * time a step (all threads: less sensitive to other load than wall time), the page faults during
 * each way's turns, and whether
 * their logits agree bit for bit. */
#include <errno.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/step.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "tools/commands.h"

typedef struct mf_bw_cli {
    const char *dir;
    long steps, rounds, threads, n_prompt;
} mf_bw_cli;

#define F(x) offsetof(mf_bw_cli, x)
static const mf_opt mf_bw_table[] = {
    {"--checkpoint", .kind = MF_OPT_STR, .off = F(dir), .meta = "DIR", .help = "the model"},
    {"--steps", .kind = MF_OPT_LONG, .off = F(steps), .def = "8", .meta = "N", .lo = 1, .hi = 100000,
     .help = "decode steps of a way's turn"},
    {"--rounds", .kind = MF_OPT_LONG, .off = F(rounds), .def = "5", .meta = "R", .lo = 1, .hi = 1000,
     .help = "turns of each way, alternating"},
    {"--threads", .kind = MF_OPT_LONG, .off = F(threads), .meta = "N", .lo = 1, .hi = 256,
     .help = "scheduled engine workers (default: the online CPUs)"},
    {"--prompt-tokens", .kind = MF_OPT_LONG, .off = F(n_prompt), .def = "16", .meta = "P", .lo = 1, .hi = 4096,
     .help = "the prompt each way prefills"},
    {NULL},
};
#undef F

static const mf_opts_spec mf_bw_spec = {
    .cmd = "bench weights",
    .usage = "usage: moeflow bench weights --checkpoint DIR [--steps N] [--rounds R] [--threads N]\n"
             "                             [--prompt-tokens P]\n\n"
             "Decode steps of the scheduled engine on the weights mapped from the page cache, on a\n"
             "private copy, and on the resident expert store (O_DIRECT), in one process: the ways\n"
             "take turns of --steps steps, --rounds times, each continuing its own sequence (the\n"
             "same tokens: greedy on bit-identical logits). Prints each way's median step time,\n"
             "tokens/s and ratio to the mapped way, and whether all logits agree bit for bit.\n\n",
    .opts = mf_bw_table,
    .col = 20,
};

enum { MF_BW_WAYS = 3 };
static const char *const mf_bw_names[MF_BW_WAYS] = {"mapped", "copied", "store"};

typedef struct mf_bw_way {
    mf_model *m;
    mf_ref *r;
    mf_step *e;
    mf_ref_state *st;
    float *logits;
    int32_t tok;
    int64_t *step_ns;
    int64_t cpu_ns;   /* the process's CPU time during the way's turns (all threads) */
    long minflt, majflt;   /* the process's page faults during them */
} mf_bw_way;

/* Way k's model, engine and sequence, its prompt prefilled. */
static int mf_bw_open(const mf_bw_cli *a, int k, mf_bw_way *w)
{
    mf_model_opts mo = {.quiet = 1, .resident_limit_bytes = UINT64_C(64) << 30,
                        .weights = k == 0 ? MF_MODEL_WEIGHTS_MAPPED : MF_MODEL_WEIGHTS_COPY,
                        .store = k == 2 ? MF_MODEL_STORE_RESIDENT : MF_MODEL_STORE_NONE};
    int rc = mf_model_load(a->dir, &mo, &w->m);
    if (!rc) rc = mf_ref_new(w->m, NULL, &w->r);
    if (!rc) rc = mf_step_new(w->r, &(mf_step_opts){.n_threads = (int)a->threads}, &w->e);
    int64_t V = rc ? 0 : mf_model_config(w->m)->vocab_size, total = a->n_prompt + a->steps * a->rounds + 1;
    if (!rc) rc = mf_ref_state_new(w->r, total, &w->st);
    if (rc) return mf_error_wrap(rc, "%s weights", mf_bw_names[k]);
    w->logits = malloc(sizeof(float) * (size_t)V);
    w->step_ns = malloc(sizeof(int64_t) * (size_t)(a->steps * a->rounds));
    int32_t *p = malloc(sizeof(int32_t) * (size_t)a->n_prompt);
    if (!w->logits || !w->step_ns || !p) {
        free(p);
        return mf_error(-ENOMEM, "out of memory");
    }
    for (long i = 0; i < a->n_prompt; i++) p[i] = (int32_t)((37 * i + 11) % V);
    rc = mf_step_prefill(w->e, w->st, p, (int)a->n_prompt, w->logits);
    free(p);
    return rc;
}

static int32_t mf_bw_argmax(const float *x, int64_t n)
{
    int64_t b = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return (int32_t)b;
}

/* The process's CPU time, all threads. */
static int64_t mf_bw_cpu_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int mf_bw_cmp(const void *x, const void *y)
{
    int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return (a > b) - (a < b);
}

int mf_bench_weights(int argc, char **argv)
{
    mf_bw_cli a = {.threads = sysconf(_SC_NPROCESSORS_ONLN)};
    int rc = mf_opts_parse(&mf_bw_spec, argc, argv, &a);
    if (rc != MF_OPTS_RUN) return rc;
    if (!a.dir) return mf_opts_refuse(&mf_bw_spec, "--checkpoint DIR is required");
    rc = 0;
    mf_bw_way w[MF_BW_WAYS] = {0};
    for (int k = 0; k < MF_BW_WAYS && !rc; k++) rc = mf_bw_open(&a, k, &w[k]);
    int64_t V = rc ? 0 : mf_model_config(w[0].m)->vocab_size;
    int same = 1;
    for (int k = 1; k < MF_BW_WAYS && !rc; k++) same &= !memcmp(w[0].logits, w[k].logits, sizeof(float) * (size_t)V);
    long n = 0;
    for (long r = 0; r < a.rounds && !rc; r++) {
        for (int i = 0; i < MF_BW_WAYS && !rc; i++)   /* the order rotates: none always follows another */
        {
            int k = (int)((r + i) % MF_BW_WAYS);
            int64_t c0 = mf_bw_cpu_ns();
            struct rusage u0, u1;
            getrusage(RUSAGE_SELF, &u0);
            for (long s = 0; s < a.steps && !rc; s++) {
                w[k].tok = mf_bw_argmax(w[k].logits, V);
                int64_t t0 = mf_now_ns();
                rc = mf_step_decode(w[k].e, &w[k].st, &w[k].tok, 1, w[k].logits);
                w[k].step_ns[r * a.steps + s] = mf_now_ns() - t0;
            }
            w[k].cpu_ns += mf_bw_cpu_ns() - c0;
            getrusage(RUSAGE_SELF, &u1);
            w[k].minflt += u1.ru_minflt - u0.ru_minflt;
            w[k].majflt += u1.ru_majflt - u0.ru_majflt;
        }
        for (int j = 1; j < MF_BW_WAYS && !rc; j++)   /* every way at the same step: compare */
            same &= !memcmp(w[0].logits, w[j].logits, sizeof(float) * (size_t)V);
        n += a.steps;
    }
    if (!rc) {
        printf("bench weights: %s, %ld threads, %ld rounds of %ld decode steps per way (batch 1), alternating\n",
               a.dir, a.threads, a.rounds, a.steps);
        double med[MF_BW_WAYS];
        for (int k = 0; k < MF_BW_WAYS; k++) {
            qsort(w[k].step_ns, (size_t)(a.steps * a.rounds), sizeof(int64_t), mf_bw_cmp);
            med[k] = w[k].step_ns[a.steps * a.rounds / 2] / 1e6;
            printf("  %-7s median step %8.3f ms  %8.2f tokens/s  ratio to mapped %.3f  CPU %.3f ms a step  "
                   "faults %ld minor %ld major\n", mf_bw_names[k], med[k], 1e3 / med[k], med[k] / med[0],
                   w[k].cpu_ns / 1e6 / (double)n, w[k].minflt, w[k].majflt);
        }
        printf("  logits after the prefill and after each turn (%ld steps): %s\n", n,
               same ? "bit-identical across the ways" : "DIFFER");
    } else {
        fprintf(stderr, "moeflow bench weights: %s\n", mf_last_error()[0] ? mf_last_error() : "out of memory");
    }
    for (int k = 0; k < MF_BW_WAYS; k++) {
        mf_ref_state_free(w[k].st);
        mf_step_free(w[k].e);
        mf_ref_free(w[k].r);
        mf_model_free(w[k].m);
        free(w[k].logits);
        free(w[k].step_ns);
    }
    return rc ? 1 : same ? 0 : 1;
}
