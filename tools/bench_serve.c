/* `moeflow bench serve`: one mixed-length workload (seeded prompt and output lengths) run by C
 * closed-loop clients, first through the continuous batcher (graphs/step/batch.h), then through static
 * batching (today's `decode --batch`: C sequences prefilled one after another, decoded together
 * until the last one ends, then the next C), in the same run. Prints aggregate tokens/s, time to
 * first token and inter-token latency (p50/p99) per mode and concurrency, and the ratio. */
#include <errno.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "graphs/step/batch.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/sample.h"
#include "graphs/step/step.h"
#include "host/grammar.h"
#include "host/tokenizer.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "tools/bench_serve.h"
#include "tools/commands.h"
#include "tools/engine_opts.h"

typedef struct mf_bs_req {
    int n_prompt, n_out;
    int32_t *prompt;
    int64_t arrive_ns, first_ns, last_ns;
    int n_gen;
} mf_bs_req;

typedef struct mf_bs_lat {
    double *ttft, *itl;
    int n_ttft, n_itl;
} mf_bs_lat;

/* Where a mode's time went: engine forwards (steps), their items, their wall time, and the step
 * shapes built during the pass (mf_step_builds). */
typedef struct mf_bs_prof {
    int64_t steps, items, fwd_ns, busy_ns, n_built, build_ns;
    /* of those, forwards with prefill items (static: the prefills): their prefill items, the
     * decode items beside them (continuous: a step's decode tokens; static: none), wall time */
    int64_t pf_steps, pf_items, pf_dec, pf_ns;
    double cpu_s;      /* the process's CPU time over the pass (all threads) */
    double fwd_cpu_s, pf_cpu_s;   /* of it, during the forwards; during those with prefill items */
} mf_bs_prof;

static double mf_bs_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Accounts the forward that just ended (begun at process CPU time cpu0). */
static void mf_bs_fwd(mf_step *e, mf_bs_prof *p, int items, int pf_items, double cpu0)
{
    mf_step_times t;
    mf_step_last_times(e, &t);
    double cpu = mf_bs_cpu_s() - cpu0;
    if (pf_items) {
        p->pf_steps++;
        p->pf_items += pf_items;
        p->pf_dec += items - pf_items;
        p->pf_ns += t.wall_ns;
        p->pf_cpu_s += cpu;
    }
    p->steps++;
    p->items += items;
    p->fwd_ns += t.wall_ns;
    p->fwd_cpu_s += cpu;
    for (int k = 0; k < MF_STEP_N_PHASES; k++) p->busy_ns += t.busy_ns[k];
}

typedef struct mf_bs_ctx {
    mf_batch *b;
    mf_bs_req *q;
    int n, next, done, rc;
    mf_bs_lat *lat;
    const mf_gram *g;     /* --constrained: the grammar of a fraction frac of the requests */
    double frac;
} mf_bs_ctx;

/* Submits request i (constrained when the fraction frac of requests 0..i says so). */
static int mf_bs_submit(mf_bs_ctx *x, int i)
{
    mf_bs_req *q = &x->q[i];
    int constrained = x->g && (int)((i + 1) * x->frac) > (int)(i * x->frac);
    return mf_batch_submit(x->b, &(mf_batch_req){.prompt = q->prompt, .n_prompt = q->n_prompt, .max_tokens = q->n_out,
                                                 .ignore_eos = 1, .grammar = constrained ? x->g : NULL, .user = q}, NULL);
}

static void mf_bs_token(mf_bs_lat *l, mf_bs_req *q, int64_t now)
{
    if (q->n_gen == 0) l->ttft[l->n_ttft++] = (now - q->arrive_ns) / 1e9, q->first_ns = now;
    else l->itl[l->n_itl++] = (now - q->last_ns) / 1e9;
    q->last_ns = now;
    q->n_gen++;
}

static void mf_bs_on_event(void *user, const mf_batch_event *ev)
{
    mf_bs_ctx *x = user;
    mf_bs_req *q = ev->user;
    if (ev->kind == MF_BATCH_TOKEN) {
        mf_bs_token(x->lat, q, ev->now_ns);
        return;
    }
    x->done++;
    if (ev->finish != MF_BATCH_LENGTH && !x->rc) x->rc = mf_error(-EIO, "bench serve: a request ended with %s",
                                                                  mf_batch_finish_name(ev->finish));
    if (x->next < x->n) {   /* this client's next request arrives now */
        x->q[x->next].arrive_ns = ev->now_ns;
        int rc = mf_bs_submit(x, x->next++);
        if (rc && !x->rc) x->rc = rc;
    }
}

static int mf_bs_continuous(mf_ref *r, mf_step *e, mf_bs_req *q, int n, int conc, int step_tokens, int split,
                            int64_t ctx, mf_bs_lat *lat, double *sec, mf_bs_prof *pr, const mf_gram *g,
                            const mf_gram_vocab *gv, double frac)
{
    mf_bs_ctx x = {.q = q, .n = n, .lat = lat, .g = g, .frac = frac};
    if (!step_tokens) step_tokens = mf_batch_default_step_tokens(conc);
    int rc = mf_batch_new(&(mf_batch_opts){.ref = r, .eng = e, .max_batch = conc, .step_tokens = step_tokens,
                                           .prefill_split = split, .gram_vocab = gv,
                                           .max_context = ctx, .max_queue = n, .on_event = mf_bs_on_event,
                                           .user = &x}, &x.b);
    if (rc) return rc;
    int64_t t0 = mf_now_ns();
    for (; x.next < conc && x.next < n && !rc; x.next++) {
        q[x.next].arrive_ns = t0;
        rc = mf_bs_submit(&x, x.next);
    }
    while (!rc && !x.rc && x.done < n) {
        int items = 0;
        mf_batch_stats s0, s1;
        mf_batch_get_stats(x.b, &s0);
        double cpu0 = mf_bs_cpu_s();
        rc = mf_batch_step(x.b, &items);
        mf_batch_get_stats(x.b, &s1);
        if (items) mf_bs_fwd(e, pr, items, (int)(s1.prefill_items - s0.prefill_items), cpu0);
        if (!rc && !items && x.done < n) rc = mf_error(-EIO, "bench serve: the batcher stalled");
    }
    *sec = (mf_now_ns() - t0) / 1e9;
    mf_batch_free(x.b);
    return rc ? rc : x.rc;
}

/* Static batching as `decode --batch` did: per batch, prefill each prompt alone, then decode the
 * batch (shrinking as requests end) until all are done. Client k's next request arrives when its
 * previous one ends and waits for the next batch. */
static int mf_bs_static(mf_ref *r, mf_step *e, mf_bs_req *q, int n, int conc, int64_t ctx, mf_bs_lat *lat,
                        double *sec, mf_bs_prof *pr)
{
    const mf_config *c = mf_ref_config(r);
    int64_t V = c->vocab_size;
    mf_ref_state *st[MF_STEP_MAX_ITEMS] = {0};
    float *lg = malloc(sizeof(float) * (size_t)V * (size_t)conc);
    int rc = lg ? 0 : mf_error(-ENOMEM, "bench serve: out of memory");
    for (int i = 0; i < conc && !rc; i++) rc = mf_ref_state_new(r, ctx, &st[i]);
    int64_t t0 = mf_now_ns();
    for (int i = 0; i < conc && i < n; i++) q[i].arrive_ns = t0;
    for (int base = 0; base < n && !rc; base += conc) {
        int nb = n - base < conc ? n - base : conc;
        for (int i = 0; i < nb && !rc; i++) {
            mf_ref_state_reset(st[i]);
            double cpu0 = mf_bs_cpu_s();
            rc = mf_step_prefill(e, st[i], q[base + i].prompt, q[base + i].n_prompt, lg + (size_t)i * V);
            mf_bs_fwd(e, pr, q[base + i].n_prompt, q[base + i].n_prompt, cpu0);
        }
        int live[MF_STEP_MAX_ITEMS], n_live = nb;
        for (int i = 0; i < nb; i++) live[i] = i;
        int row[MF_STEP_MAX_ITEMS];
        for (int i = 0; i < nb; i++) row[i] = i;
        while (n_live > 0 && !rc) {
            int64_t now = mf_now_ns();
            mf_ref_state *bs[MF_STEP_MAX_ITEMS];
            int32_t bt[MF_STEP_MAX_ITEMS];
            int k = 0;
            for (int j = 0; j < n_live; j++) {
                int i = live[j];
                mf_bs_req *x = &q[base + i];
                int32_t t = mf_sample_greedy(lg + (size_t)row[i] * V, V);
                mf_bs_token(lat, x, now);
                if (x->n_gen == x->n_out) {   /* ends: its client's next request arrives */
                    int nx = base + i + conc;
                    if (nx < n) q[nx].arrive_ns = now;
                    continue;
                }
                bs[k] = st[i];
                bt[k] = t;
                live[k++] = i;
            }
            n_live = k;
            if (k) {
                double cpu0 = mf_bs_cpu_s();
                rc = mf_step_decode(e, bs, bt, k, lg);
                mf_bs_fwd(e, pr, k, 0, cpu0);
            }
            for (int j = 0; j < k; j++) row[live[j]] = j;
        }
    }
    *sec = (mf_now_ns() - t0) / 1e9;
    for (int i = 0; i < conc; i++) mf_ref_state_free(st[i]);
    free(lg);
    return rc;
}

static int mf_bs_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double mf_bs_pct(double *v, int n, double p)
{
    if (n == 0) return 0;
    qsort(v, (size_t)n, sizeof *v, mf_bs_cmp);
    int i = (int)(p * (n - 1) + 0.5);
    return v[i];
}

/* A range MIN-MAX of lengths (--prompt-tokens, --output-tokens). */
typedef struct mf_bs_range {
    int lo, hi;
} mf_bs_range;

static int mf_bs_range_opt(const mf_opt *o, const char *s, void *field)
{
    mf_bs_range *r = field;
    if (sscanf(s, "%d-%d", &r->lo, &r->hi) == 2 && r->lo >= 1 && r->hi >= r->lo && r->hi <= 1 << 20) return 0;
    return mf_error(-EINVAL, "%s: expected MIN-MAX with 1 <= MIN <= MAX <= %d, found '%s'", o->flag, 1 << 20, s);
}

/* The command line of `moeflow bench serve`. */
typedef struct mf_bs_cli {
    const char *dir, *concs;
    long n, step_tokens, split, warmup, rounds;
    mf_bs_range prompt, output;
    unsigned long long seed;
    int json;
    long turns, system_tokens, block;   /* --turns: the multi-turn workload (tools/bench_serve_turns.c) */
    uint64_t cache_bytes;
    double constrained;
    mf_tool_engine e;   /* the engine and model options of decode and serve (tools/engine_opts.h) */
} mf_bs_cli;

#define F(x) offsetof(mf_bs_cli, x)
static const mf_opt mf_bs_table[] = {
    {"--checkpoint", .kind = MF_OPT_STR, .off = F(dir), .meta = "DIR", .help = "the model"},
    {"--requests", .kind = MF_OPT_LONG, .off = F(n), .def = "32", .meta = "N", .lo = 1, .hi = 1 << 24,
     .help = "requests of the workload"},
    {"--concurrency", .kind = MF_OPT_STR, .off = F(concs), .def = "1,4,16", .meta = "C,C,..",
     .help = "closed-loop clients, one run per value (each\n1.." MF_OPTS_STR(MF_STEP_MAX_ITEMS) ", at most 8 values)"},
    {"--prompt-tokens", .kind = MF_OPT_FN, .off = F(prompt), .def = "16-128", .meta = "MIN-MAX", .fn = mf_bs_range_opt,
     .help = "prompt lengths, drawn uniformly"},
    {"--output-tokens", .kind = MF_OPT_FN, .off = F(output), .def = "8-64", .meta = "MIN-MAX", .fn = mf_bs_range_opt,
     .help = "output lengths, drawn uniformly"},
    {"--step-tokens", .kind = MF_OPT_LONG, .off = F(step_tokens), .meta = "N", .lo = 1, .hi = 1 << 24,
     .help = "the batcher's items per step (default 2 x the concurrency,\nat least " MF_OPTS_STR(MF_BATCH_STEP_TOKENS)
             ", at most " MF_OPTS_STR(MF_STEP_MAX_ITEMS) ")"},
    {"--prefill-split", .kind = MF_OPT_LONG, .off = F(split), .def = "2", .meta = "K", .lo = 1, .hi = MF_STEP_MAX_ITEMS,
     .help = "prefilling sequences sharing a step's budget"},
    {"--seed", .kind = MF_OPT_ULL, .off = F(seed), .def = "1", .meta = "S", .help = "seeds the lengths"},
    {"--warmup", .kind = MF_OPT_LONG, .off = F(warmup), .def = "1", .meta = "N", .lo = 0, .hi = 10,
     .help = "untimed passes of both modes before each\nconcurrency's timed one"},
    {"--rounds", .kind = MF_OPT_LONG, .off = F(rounds), .def = "1", .meta = "N", .lo = 1, .hi = 20,
     .help = "timed passes of each mode per concurrency, alternating\n(continuous, static, continuous, ...), each pair's ratio"},
    {"--turns", .kind = MF_OPT_LONG, .off = F(turns), .meta = "T", .lo = 1, .hi = 16,
     .help = "the multi-turn workload instead: N conversations of T turns, each\n"
             "turn's prompt the history (the last prompt and its reply) and\n"
             "--prompt-tokens new user tokens, its reply --output-tokens; run\n"
             "with the prefix cache and without (docs/prefix.md)"},
    {"--system-tokens", .kind = MF_OPT_LONG, .off = F(system_tokens), .def = "0", .meta = "S", .lo = 0, .hi = 1 << 20,
     .help = "with --turns: a system prompt of S tokens opens every conversation"},
    {"--prefix-cache", .kind = MF_OPT_SIZE, .off = F(cache_bytes), .def = "1G", .meta = "SIZE",
     .help = "with --turns: the prefix cache's memory"},
    {"--prefix-block", .kind = MF_OPT_LONG, .off = F(block), .def = "0", .meta = "N", .lo = 0, .hi = 256,
     .help = "with --turns: tokens per cached block (0: " MF_OPTS_STR(MF_PREFIX_BLOCK) ")"},
    {"--constrained", .kind = MF_OPT_DOUBLE, .off = F(constrained), .def = "0", .meta = "F", .lo = 0, .hi = 1,
     .help = "this fraction of the requests constrained by a JSON Schema\n(arrays of objects with string,"
             " integer and boolean\nfields, long enough to last every request): the\nconstrained run is then"
             " compared with the same\nworkload unconstrained instead of static batching,\ntimed A B B A"},
    {"--json", .kind = MF_OPT_FLAG, .off = F(json),
     .help = "{\"requests\", \"results\": [{mode, concurrency, tokens_per_s, ttft and itl\n"
             "percentiles, wall_s, and where the time went}]} instead of the table"},
    MF_OPT_GROUP_ROW(mf_tool_engine_table, F(e)),
    {NULL},
};
#undef F

static const mf_opts_spec mf_bs_spec = {
    .cmd = "bench serve",
    .usage = "usage: moeflow bench serve --checkpoint DIR [--requests N] [--concurrency C,C,..]\n"
             "                           [--prompt-tokens MIN-MAX] [--output-tokens MIN-MAX]\n"
             "                           [--step-tokens N] [--prefill-split K] [--seed S] [--warmup N]\n"
             "                           [--rounds N] [--constrained F] [--json]\n"
             "       moeflow bench serve --checkpoint DIR --turns T [--system-tokens S] [--prefix-cache SIZE]\n"
             "                           [--prefix-block N] [...]\n"
             MF_TOOL_ENGINE_USAGE
             "\n"
             "N requests with prompt and output lengths drawn uniformly from the ranges (seeded)\n"
             "are run by C closed-loop clients: a client sends its next request when its previous\n"
             "one ends. Continuous: every request goes through the batcher (max batch C,\n"
             "--step-tokens, --prefill-split). Static: batches of C requests, each prompt prefilled\n"
             "alone, then decoded together until the batch's last request ends. Greedy, EOS\n"
             "ignored, so both modes generate the same tokens. Prints per mode generated tokens/s,\n"
             "time to first token and inter-token latency (p50, p99, from the request's arrival),\n"
             "and continuous / static throughput. Each concurrency first runs both modes --warmup\n"
             "times untimed, so that the engine's graphs for the step sizes of the workload exist\n"
             "(a size's graph is built on its first step), then --rounds timed pairs (continuous,\n"
             "static), each with its ratio.\n"
             "Per mode it also says where the time went: engine forwards (steps), items a step,\n"
             "forward wall time, step shapes built during the pass (and per 1,000 steps) and their\n"
             "build time, the workers' busy time (summed task durations), the process's CPU time (all threads;\n"
             "less sensitive to other load than wall time), and the forwards that carried prefill\n"
             "items (static: the prefills) with their prefill items, the decode items beside them\n"
             "(continuous: the step's decode tokens) and their wall and CPU time.\n"
             "The engine and model options are decode's and serve's (one table); the batcher needs\n"
             "the scheduled engine.\n\n",
    .opts = mf_bs_table,
    .col = 26,
};

/* A run of bench serve: the engine, the workload, the latencies of the pass being run. */
typedef struct mf_bs {
    const mf_bs_cli *a;
    mf_tool_run x;   /* the model and engine */
    mf_model *m;
    mf_ref *r;
    mf_step *e;
    mf_tok *tok;          /* --constrained: the tokenizer, its vocabulary for grammars, the grammar */
    mf_gram_vocab *gv;
    mf_gram *g;
    mf_bs_req *q;
    int n;
    mf_bs_lat lat;
    int64_t total_out, ctx;
    int max_items;   /* the engine's max_batch: every mode's step one graph */
} mf_bs;

/* The engine and the workload: request i's lengths from the seeded draws, its prompt tokens
 * (37 k + 11 + 101 i) mod vocab. 0 or a negative code. */
static int mf_bs_open(mf_bs *b)
{
    const mf_bs_cli *a = b->a;
    b->n = (int)a->n;
    b->ctx = 2;
    if (!(b->q = calloc((size_t)b->n, sizeof *b->q))) return mf_error(-ENOMEM, "out of memory");
    mf_tool_engine e = a->e;
    e.max_items = b->max_items;
    int rc = mf_tool_run_open("bench serve", &e, a->dir, NULL, (mf_ref_opts){0}, a->json, &b->x);
    if (rc) return rc;
    b->m = b->x.m;
    b->r = b->x.r;
    b->e = b->x.eng;
    const mf_config *c = mf_model_config(b->m);
    uint64_t rng = a->seed * 0x9E3779B97F4A7C15ULL + 1;
    for (int i = 0; i < b->n; i++) {
        mf_bs_req *q = &b->q[i];
        rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
        q->n_prompt = a->prompt.lo + (int)((rng >> 33) % (uint64_t)(a->prompt.hi - a->prompt.lo + 1));
        rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
        q->n_out = a->output.lo + (int)((rng >> 33) % (uint64_t)(a->output.hi - a->output.lo + 1));
        if (!(q->prompt = malloc(sizeof(int32_t) * (size_t)q->n_prompt))) return mf_error(-ENOMEM, "out of memory");
        for (int k = 0; k < q->n_prompt; k++) q->prompt[k] = (int32_t)((37 * k + 11 + 101 * i) % c->vocab_size);
        b->total_out += q->n_out;
        b->ctx = q->n_prompt + q->n_out > b->ctx ? q->n_prompt + q->n_out : b->ctx;
    }
    if (a->constrained > 0) {   /* a schema whose arrays outlast every request: each ends at its length */
        static const char schema[] = "{\"type\":\"array\",\"minItems\":1000000,\"items\":{\"type\":\"object\","
                                     "\"properties\":{\"id\":{\"type\":\"integer\"},\"name\":{\"type\":\"string\"},"
                                     "\"ok\":{\"type\":\"boolean\"}},\"required\":[\"id\",\"name\",\"ok\"]}}";
        char tp[4200];
        snprintf(tp, sizeof tp, "%s/tokenizer.json", a->dir);
        if ((rc = mf_tok_load(tp, &b->tok)) ||
            (rc = mf_gram_vocab_new(b->tok, c->vocab_size, (int32_t)c->eos_token_id, &b->gv)) ||
            (rc = mf_gram_from_schema(schema, sizeof schema - 1, &b->g)))
            return rc;
    }
    b->lat.ttft = malloc(sizeof(double) * (size_t)b->n);
    b->lat.itl = malloc(sizeof(double) * (size_t)b->total_out);
    return b->lat.ttft && b->lat.itl ? 0 : mf_error(-ENOMEM, "out of memory");
}

/* One pass of one mode (0 continuous, 1 static) at concurrency conc: its wall time and profile. */
static int mf_bs_pass(mf_bs *b, int mode, int conc, double *sec, mf_bs_prof *pr)
{
    for (int i = 0; i < b->n; i++) b->q[i].n_gen = 0, b->q[i].first_ns = b->q[i].last_ns = 0;
    b->lat.n_ttft = b->lat.n_itl = 0;
    *sec = 0;
    *pr = (mf_bs_prof){0};
    mf_step_build_stats b0, b1;
    mf_step_builds(b->e, &b0);
    double cpu0 = mf_bs_cpu_s();
    int rc = mode == 0 || b->g ? mf_bs_continuous(b->r, b->e, b->q, b->n, conc, (int)b->a->step_tokens,
                                                  (int)b->a->split, b->ctx, &b->lat, sec, pr, mode ? NULL : b->g, b->gv,
                                                  b->a->constrained)
                               : mf_bs_static(b->r, b->e, b->q, b->n, conc, b->ctx, &b->lat, sec, pr);
    if (rc) return rc;
    mf_step_builds(b->e, &b1);
    pr->cpu_s = mf_bs_cpu_s() - cpu0;
    pr->n_built = b1.n_built - b0.n_built;
    pr->build_ns = b1.build_ns - b0.build_ns;
    return 0;
}

/* A mode's name: continuous and static; with --constrained, constrained and continuous. */
static const char *mf_bs_mode(const mf_bs *b, int mode)
{
    return b->g ? (mode ? "continuous" : "constrained") : mode ? "static" : "continuous";
}

/* A timed pass's row (or JSON object; first: the first of the list). */
static void mf_bs_print(mf_bs *b, int mode, int conc, int first, double tps, double sec, const mf_bs_prof *pr)
{
    mf_bs_lat *l = &b->lat;
    double t50 = mf_bs_pct(l->ttft, l->n_ttft, 0.5), t99 = mf_bs_pct(l->ttft, l->n_ttft, 0.99);
    double i50 = mf_bs_pct(l->itl, l->n_itl, 0.5), i99 = mf_bs_pct(l->itl, l->n_itl, 0.99);
    double k_builds = pr->steps ? 1000.0 * (double)pr->n_built / (double)pr->steps : 0;   /* per 1,000 forwards */
    if (b->a->json)
        printf("%s{\"mode\":\"%s\",\"concurrency\":%d,\"tokens_per_s\":%.3f,\"ttft_p50_s\":%.4f,"
               "\"ttft_p99_s\":%.4f,\"itl_p50_s\":%.4f,\"itl_p99_s\":%.4f,\"wall_s\":%.3f,\"steps\":%" PRId64 ",\"items\":%" PRId64
               ",\"forward_s\":%.3f,\"shapes_built\":%" PRId64 ",\"builds_per_1000_steps\":%.1f,\"build_s\":%.3f,\"busy_s\":%.3f,\"cpu_s\":%.3f,\"forward_cpu_s\":%.3f,"
               "\"prefill_forwards\":%" PRId64 ",\"prefill_items\":%" PRId64 ",\"prefill_forward_decode_items\":%" PRId64
               ",\"prefill_forward_s\":%.3f,\"prefill_forward_cpu_s\":%.3f}", first ? "" : ",",
               mf_bs_mode(b, mode), conc, tps, t50, t99, i50, i99, sec, pr->steps, pr->items,
               pr->fwd_ns / 1e9, pr->n_built, k_builds, pr->build_ns / 1e9, pr->busy_ns / 1e9, pr->cpu_s, pr->fwd_cpu_s,
               pr->pf_steps, pr->pf_items, pr->pf_dec, pr->pf_ns / 1e9, pr->pf_cpu_s);
    else
        printf("%-11s %5d %9.2f %10.3f %10.3f %10.4f %10.4f %9.2f\n"
               "%-11s %5s steps %" PRId64 ", %.1f items a step, forwards %.2f s (of which %" PRId64
               " shapes built in %.2f s: %.1f per 1,000 steps), workers busy %.2f s, CPU %.2f s\n"
               "%-11s %5s with prefill: %" PRId64 " forwards, %" PRId64 " prefill items beside %" PRId64
               " decode items, %.2f s (CPU %.2f s)\n", mf_bs_mode(b, mode), conc, tps, t50, t99, i50,
               i99, sec, "", "", pr->steps, pr->steps ? (double)pr->items / pr->steps : 0.0, pr->fwd_ns / 1e9,
               pr->n_built, pr->build_ns / 1e9, k_builds, pr->busy_ns / 1e9, pr->cpu_s, "", "", pr->pf_steps, pr->pf_items,
               pr->pf_dec, pr->pf_ns / 1e9, pr->pf_cpu_s);
    fflush(stdout);
}

/* Each concurrency: untimed first passes build the engine's graphs for the step sizes this
 * workload makes (each new size is built on first use), so neither mode pays for them in the
 * timed pass; then both modes timed and their ratio. */
static int mf_bs_run(mf_bs *b, const int *cl, int n_c)
{
    const mf_bs_cli *a = b->a;
    char budget[32];   /* the batcher's step budget: given, or 2 x the concurrency */
    if (a->step_tokens) snprintf(budget, sizeof budget, "%ld", a->step_tokens);
    else snprintf(budget, sizeof budget, "2 x concurrency");
    if (!a->json)
        printf("bench serve: %s, %d requests, prompts %d-%d tokens, outputs %d-%d (%" PRId64 " tokens), %ld threads, "
               "step budget %s, prefill split %ld\n%-11s %5s %9s %10s %10s %10s %10s %9s\n", a->dir, b->n, a->prompt.lo,
               a->prompt.hi, a->output.lo, a->output.hi, b->total_out, a->e.threads, budget, a->split, "mode",
               "conc", "tokens/s", "ttft p50", "ttft p99", "itl p50", "itl p99", "wall s");
    else
        printf("{\"requests\":%d,\"results\":[", b->n);
    for (int k = 0; k < n_c; k++) {
        double tps[2], cpu[2] = {0, 0}, wall[2] = {0, 0};
        for (int pass = 0; pass < a->warmup + a->rounds; pass++) {
            for (int mode = 0; mode < 2; mode++) {
                double sec;
                mf_bs_prof pr;
                int rc = mf_bs_pass(b, mode, cl[k], &sec, &pr);
                if (rc) return rc;
                if (pass < a->warmup) continue;
                tps[mode] = b->total_out / sec;
                wall[mode] += sec;
                cpu[mode] += pr.cpu_s;
                mf_bs_print(b, mode, cl[k], k + mode + pass - a->warmup == 0, tps[mode], sec, &pr);
            }
            if (!a->json && !b->g && pass >= a->warmup) printf("%-11s %5d %8.2fx\n", "ratio", cl[k], tps[0] / tps[1]);
        }
        /* --constrained: the timed pair again in the other order (A B B A), since on a loaded
         * machine the first of a pair ran slower whatever it was; the ratio of the sums */
        for (int mode = 1; b->g && mode >= 0; mode--) {
            double sec;
            mf_bs_prof pr;
            int rc = mf_bs_pass(b, mode, cl[k], &sec, &pr);
            if (rc) return rc;
            wall[mode] += sec;
            cpu[mode] += pr.cpu_s;
            mf_bs_print(b, mode, cl[k], 0, b->total_out / sec, sec, &pr);
        }
        if (!a->json && b->g)
            printf("%-11s %5d %8.2fx (A B B A: wall %.2f / %.2f s; CPU %.2f / %.2f s, %.3fx)\n", "ratio", cl[k],
                   wall[1] / wall[0], wall[0], wall[1], cpu[0], cpu[1], cpu[1] / cpu[0]);
    }
    if (a->json) printf("]}\n");
    return 0;
}

static void mf_bs_close(mf_bs *b)
{
    for (int i = 0; b->q && i < b->n; i++) free(b->q[i].prompt);
    free(b->q);
    free(b->lat.ttft);
    free(b->lat.itl);
    mf_tool_run_close(&b->x);
    mf_gram_free(b->g);
    mf_gram_vocab_free(b->gv);
    mf_tok_free(b->tok);
}

int mf_bench_serve(int argc, char **argv)
{
    mf_bs_cli a = {0};
    mf_tool_engine_init(&a.e);
    int rc = mf_opts_parse(&mf_bs_spec, argc, argv, &a);
    if (rc != MF_OPTS_RUN) return rc;
    if (!a.dir) return mf_opts_refuse(&mf_bs_spec, "--checkpoint DIR is required");
    if (!a.e.sched) {
        fprintf(stderr, "moeflow bench serve: the batcher runs the scheduled engine (--engine reference is decode's "
                        "and serve's)\n");
        return 2;
    }
    if ((rc = mf_tool_engine_check("bench serve", &a.e))) return rc;
    int cl[8], n_c = 0;
    for (const char *p = a.concs; *p && n_c < 8;) {
        int v = atoi(p);
        if (v < 1 || v > MF_STEP_MAX_ITEMS) {
            fprintf(stderr, "moeflow bench serve: --concurrency: each 1..%d, found '%s'\n", MF_STEP_MAX_ITEMS, a.concs);
            return 2;
        }
        cl[n_c++] = v;
        p = strchr(p, ',');
        if (!p) break;
        p++;
    }
    mf_bs b = {.a = &a};
    for (int k = 0; k < n_c; k++) {   /* a continuous step: its decode tokens and prefill budget */
        int items = mf_batch_step_items(cl[k], (int)a.step_tokens);
        b.max_items = items > b.max_items ? items : b.max_items;
    }
    rc = mf_bs_open(&b);
    if (!rc && !a.turns) rc = mf_bs_run(&b, cl, n_c);
    for (int k = 0; !rc && a.turns && k < n_c; k++)   /* the multi-turn workload, per concurrency */
        rc = mf_bench_serve_turns(&(mf_bt_opts){.r = b.r, .e = b.e, .n_conv = b.n, .conc = cl[k], .turns = (int)a.turns,
                                                .system_tokens = (int)a.system_tokens, .user_lo = a.prompt.lo,
                                                .user_hi = a.prompt.hi, .reply_lo = a.output.lo, .reply_hi = a.output.hi,
                                                .step_tokens = (int)a.step_tokens, .warmup = (int)a.warmup,
                                                .json = a.json, .block = (int)a.block, .cache_bytes = a.cache_bytes,
                                                .seed = a.seed});
    if (rc) fprintf(stderr, "moeflow bench serve: %s\n", mf_last_error()[0] ? mf_last_error() : "out of memory");
    mf_bs_close(&b);
    return rc ? 1 : 0;
}
