/* `moeflow bench serve`: one mixed-length workload (seeded prompt and output lengths) run by C
 * closed-loop clients, first through the continuous batcher (graphs/step/batch.h), then through static
 * batching (today's `decode --batch`: C sequences prefilled one after another, decoded together
 * until the last one ends, then the next C), in the same run. Prints aggregate tokens/s, time to
 * first token and inter-token latency (p50/p99) per mode and concurrency, and the ratio. */
#include <errno.h>
#include <inttypes.h>
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
#include "sched/clock.h"
#include "sched/error.h"
#include "tools/commands.h"

static void mf_bench_serve_usage(FILE *f)
{
    fprintf(f,
            "usage: moeflow bench serve --checkpoint DIR [--requests N] [--concurrency C,C,..]\n"
            "                           [--prompt-tokens MIN-MAX] [--output-tokens MIN-MAX]\n"
            "                           [--step-tokens N] [--prefill-split K] [--threads N] [--seed S]\n"
            "                           [--warmup N] [--json]\n\n"
            "N requests (default 32) with prompt and output lengths drawn uniformly from the ranges\n"
            "(default 16-128 and 8-64, seeded) are run by C closed-loop clients (default 1,4,16): a\n"
            "client sends its next request when its previous one ends. Continuous: every request\n"
            "goes through the batcher (max batch C, --step-tokens, default 64; --prefill-split: prefilling\n"
            "sequences sharing a step's budget, default 2). Static: batches of C\n"
            "requests, each prompt prefilled alone, then decoded together until the batch's last\n"
            "request ends. Greedy, EOS ignored, so both modes generate the same tokens. Prints per\n"
            "mode generated tokens/s, time to first token and inter-token latency (p50, p99, from\n"
            "the request's arrival), and continuous / static throughput. Each concurrency first runs\n"
            "both modes --warmup times untimed (default 1), so that the engine's graphs for the step\n"
            "sizes of the workload exist (a size's graph is built on its first step).\n"
            "Per mode it also says where the time went: engine forwards (steps), items a step,\n"
            "forward wall time, step shapes built during the pass and their build time, the\n"
            "workers' busy time (summed task durations), the process's CPU time (all threads;\n"
            "less sensitive to other load than wall time), and the forwards that carried prefill\n"
            "items (static: the prefills) with their prefill items, the decode items beside them\n"
            "(continuous: the step's decode tokens) and their wall and CPU time.\n");
}

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
} mf_bs_ctx;

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
        mf_bs_req *nq = &x->q[x->next++];
        nq->arrive_ns = ev->now_ns;
        int rc = mf_batch_submit(x->b, &(mf_batch_req){.prompt = nq->prompt, .n_prompt = nq->n_prompt,
                                                       .max_tokens = nq->n_out, .ignore_eos = 1, .user = nq}, NULL);
        if (rc && !x->rc) x->rc = rc;
    }
}

static int mf_bs_continuous(mf_ref *r, mf_step *e, mf_bs_req *q, int n, int conc, int step_tokens, int split,
                            int64_t ctx, mf_bs_lat *lat, double *sec, mf_bs_prof *pr)
{
    mf_bs_ctx x = {.q = q, .n = n, .lat = lat};
    int rc = mf_batch_new(&(mf_batch_opts){.ref = r, .eng = e, .max_batch = conc, .step_tokens = step_tokens,
                                           .prefill_split = split,
                                           .max_context = ctx, .max_queue = n, .on_event = mf_bs_on_event,
                                           .user = &x}, &x.b);
    if (rc) return rc;
    int64_t t0 = mf_now_ns();
    for (; x.next < conc && x.next < n && !rc; x.next++) {
        q[x.next].arrive_ns = t0;
        rc = mf_batch_submit(x.b, &(mf_batch_req){.prompt = q[x.next].prompt, .n_prompt = q[x.next].n_prompt,
                                                 .max_tokens = q[x.next].n_out, .ignore_eos = 1,
                                                 .user = &q[x.next]}, NULL);
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

static int mf_bs_range(const char *s, int *lo, int *hi)
{
    return sscanf(s, "%d-%d", lo, hi) == 2 && *lo >= 1 && *hi >= *lo && *hi <= 1 << 20 ? 0 : -1;
}

int mf_bench_serve(int argc, char **argv)
{
    const char *dir = NULL, *concs = "1,4,16";
    int n = 32, p_lo = 16, p_hi = 128, o_lo = 8, o_hi = 64, step_tokens = 64, json = 0, warmup = 1, split = 2;
    long threads = sysconf(_SC_NPROCESSORS_ONLN);
    unsigned long long seed = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int hv = i + 1 < argc, bad = 0;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            mf_bench_serve_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--checkpoint") && hv) dir = argv[++i];
        else if (!strcmp(a, "--requests") && hv) bad = (n = atoi(argv[++i])) < 1;
        else if (!strcmp(a, "--concurrency") && hv) concs = argv[++i];
        else if (!strcmp(a, "--prompt-tokens") && hv) bad = mf_bs_range(argv[++i], &p_lo, &p_hi);
        else if (!strcmp(a, "--output-tokens") && hv) bad = mf_bs_range(argv[++i], &o_lo, &o_hi);
        else if (!strcmp(a, "--step-tokens") && hv) bad = (step_tokens = atoi(argv[++i])) < 1;
        else if (!strcmp(a, "--prefill-split") && hv) bad = (split = atoi(argv[++i])) < 1 || split > MF_STEP_MAX_ITEMS;
        else if (!strcmp(a, "--threads") && hv) bad = (threads = atol(argv[++i])) < 1 || threads > 256;
        else if (!strcmp(a, "--seed") && hv) seed = strtoull(argv[++i], NULL, 0);
        else if (!strcmp(a, "--warmup") && hv) bad = (warmup = atoi(argv[++i])) < 0 || warmup > 10;
        else if (!strcmp(a, "--json")) json = 1;
        else bad = 1;
        if (bad) {
            fprintf(stderr, "moeflow bench serve: bad or incomplete option '%s'\n\n", a);
            mf_bench_serve_usage(stderr);
            return 2;
        }
    }
    if (!dir) {
        mf_bench_serve_usage(stderr);
        return 2;
    }
    int cl[8], n_c = 0;
    for (const char *p = concs; *p && n_c < 8;) {
        int v = atoi(p);
        if (v < 1 || v > MF_STEP_MAX_ITEMS) {
            fprintf(stderr, "moeflow bench serve: --concurrency: each 1..%d, found '%s'\n", MF_STEP_MAX_ITEMS, concs);
            return 2;
        }
        cl[n_c++] = v;
        p = strchr(p, ',');
        if (!p) break;
        p++;
    }
    mf_model *m = NULL;
    mf_ref *r = NULL;
    mf_step *e = NULL;
    mf_bs_req *q = calloc((size_t)n, sizeof *q);
    mf_bs_lat lat = {0};
    int ret = 1;
    if (!q || mf_model_load(dir, &(mf_model_opts){.quiet = 1, .resident_limit_bytes = UINT64_C(64) << 30}, &m) ||
        mf_ref_new(m, NULL, &r) || mf_step_new(r, &(mf_step_opts){.n_threads = (int)threads}, &e))
        goto fail;
    const mf_config *c = mf_model_config(m);
    uint64_t rng = seed * 0x9E3779B97F4A7C15ULL + 1;
    int64_t total_out = 0, ctx = 2;
    for (int i = 0; i < n; i++) {
        rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
        q[i].n_prompt = p_lo + (int)((rng >> 33) % (uint64_t)(p_hi - p_lo + 1));
        rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
        q[i].n_out = o_lo + (int)((rng >> 33) % (uint64_t)(o_hi - o_lo + 1));
        if (!(q[i].prompt = malloc(sizeof(int32_t) * (size_t)q[i].n_prompt))) goto fail;
        for (int k = 0; k < q[i].n_prompt; k++) q[i].prompt[k] = (int32_t)((37 * k + 11 + 101 * i) % c->vocab_size);
        total_out += q[i].n_out;
        ctx = q[i].n_prompt + q[i].n_out > ctx ? q[i].n_prompt + q[i].n_out : ctx;
    }
    lat.ttft = malloc(sizeof(double) * (size_t)n);
    lat.itl = malloc(sizeof(double) * (size_t)total_out);
    if (!lat.ttft || !lat.itl) goto fail;
    if (!json)
        printf("bench serve: %s, %d requests, prompts %d-%d tokens, outputs %d-%d (%" PRId64 " tokens), %ld threads, "
               "step budget %d, prefill split %d\n%-11s %5s %9s %10s %10s %10s %10s %9s\n", dir, n, p_lo, p_hi, o_lo, o_hi, total_out,
               threads, step_tokens, split, "mode", "conc", "tokens/s", "ttft p50", "ttft p99", "itl p50", "itl p99", "wall s");
    else
        printf("{\"requests\":%d,\"results\":[", n);
    for (int k = 0; k < n_c; k++) {
        double tps[2];
        /* untimed first passes build the engine's graphs for the step sizes this workload makes
         * (each new size is built on first use), so neither mode pays for them in the timed pass */
        for (int pass = 0; pass <= warmup; pass++)
        for (int mode = 0; mode < 2; mode++) {
            for (int i = 0; i < n; i++) q[i].n_gen = 0, q[i].first_ns = q[i].last_ns = 0;
            lat.n_ttft = lat.n_itl = 0;
            double sec = 0;
            mf_bs_prof pr = {0};
            mf_step_build_stats b0, b1;
            mf_step_builds(e, &b0);
            double cpu0 = mf_bs_cpu_s();
            int rc = mode == 0 ? mf_bs_continuous(r, e, q, n, cl[k], step_tokens, split, ctx, &lat, &sec, &pr)
                               : mf_bs_static(r, e, q, n, cl[k], ctx, &lat, &sec, &pr);
            if (rc) goto fail;
            mf_step_builds(e, &b1);
            pr.cpu_s = mf_bs_cpu_s() - cpu0;
            pr.n_built = b1.n_built - b0.n_built;
            pr.build_ns = b1.build_ns - b0.build_ns;
            if (pass < warmup) continue;
            tps[mode] = total_out / sec;
            double t50 = mf_bs_pct(lat.ttft, lat.n_ttft, 0.5), t99 = mf_bs_pct(lat.ttft, lat.n_ttft, 0.99);
            double i50 = mf_bs_pct(lat.itl, lat.n_itl, 0.5), i99 = mf_bs_pct(lat.itl, lat.n_itl, 0.99);
            if (json)
                printf("%s{\"mode\":\"%s\",\"concurrency\":%d,\"tokens_per_s\":%.3f,\"ttft_p50_s\":%.4f,"
                       "\"ttft_p99_s\":%.4f,\"itl_p50_s\":%.4f,\"itl_p99_s\":%.4f,\"wall_s\":%.3f,\"steps\":%" PRId64 ",\"items\":%" PRId64
                       ",\"forward_s\":%.3f,\"shapes_built\":%" PRId64 ",\"build_s\":%.3f,\"busy_s\":%.3f,\"cpu_s\":%.3f,\"forward_cpu_s\":%.3f,"
                       "\"prefill_forwards\":%" PRId64 ",\"prefill_items\":%" PRId64 ",\"prefill_forward_decode_items\":%" PRId64
                       ",\"prefill_forward_s\":%.3f,\"prefill_forward_cpu_s\":%.3f}", k + mode ? "," : "",
                       mode ? "static" : "continuous", cl[k], tps[mode], t50, t99, i50, i99, sec, pr.steps, pr.items,
                       pr.fwd_ns / 1e9, pr.n_built, pr.build_ns / 1e9, pr.busy_ns / 1e9, pr.cpu_s, pr.fwd_cpu_s,
                       pr.pf_steps, pr.pf_items, pr.pf_dec, pr.pf_ns / 1e9, pr.pf_cpu_s);
            else
                printf("%-11s %5d %9.2f %10.3f %10.3f %10.4f %10.4f %9.2f\n"
                       "%-11s %5s steps %" PRId64 ", %.1f items a step, forwards %.2f s (of which %" PRId64
                       " shapes built in %.2f s), workers busy %.2f s, CPU %.2f s\n"
                       "%-11s %5s with prefill: %" PRId64 " forwards, %" PRId64 " prefill items beside %" PRId64
                       " decode items, %.2f s (CPU %.2f s)\n", mode ? "static" : "continuous", cl[k], tps[mode], t50, t99, i50,
                       i99, sec, "", "", pr.steps, pr.steps ? (double)pr.items / pr.steps : 0.0, pr.fwd_ns / 1e9,
                       pr.n_built, pr.build_ns / 1e9, pr.busy_ns / 1e9, pr.cpu_s, "", "", pr.pf_steps, pr.pf_items,
                       pr.pf_dec, pr.pf_ns / 1e9, pr.pf_cpu_s);
            fflush(stdout);
        }
        if (!json) printf("%-11s %5d %8.2fx\n", "ratio", cl[k], tps[0] / tps[1]);
    }
    if (json) printf("]}\n");
    ret = 0;
    goto out;
fail:
    fprintf(stderr, "moeflow bench serve: %s\n", mf_last_error()[0] ? mf_last_error() : "out of memory");
out:
    for (int i = 0; q && i < n; i++) free(q[i].prompt);
    free(q);
    free(lat.ttft);
    free(lat.itl);
    mf_step_free(e);
    mf_ref_free(r);
    mf_model_free(m);
    return ret;
}
