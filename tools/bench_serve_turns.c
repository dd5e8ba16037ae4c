/* `moeflow bench serve --turns T`: the multi-turn workload of the prefix cache (docs/prefix.md). C
 * closed-loop clients hold conversations of T turns: turn k's prompt is turn k-1's prompt, its
 * reply (the tokens generated) and the user's next message, as a chat client resends the whole
 * history; a shared system prompt may open every conversation. The same conversations run through
 * the continuous batcher with the prefix cache and without it, alternating, in the same run;
 * greedy, EOS ignored, so both generate the same tokens (checked). Prints per mode the time to
 * first token of every turn (median over the conversations), tokens/s and the tokens restored, and
 * per turn the ratio with / without. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/prefix/prefix.h"
#include "graphs/step/batch.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "tools/bench_serve.h"

#define MF_BT_MAX_TURNS 16

typedef struct mf_bt_conv {
    int32_t *toks;          /* the conversation so far: the last turn's prompt and reply */
    int n_toks, turn, n_gen;
    int user[MF_BT_MAX_TURNS], reply[MF_BT_MAX_TURNS];   /* lengths (seeded) */
    int64_t arrive_ns;
    double ttft[MF_BT_MAX_TURNS];
    int cached[MF_BT_MAX_TURNS];
    uint64_t hash;          /* of every generated token (both modes must agree) */
} mf_bt_conv;

typedef struct mf_bt {
    const mf_bt_opts *o;
    mf_batch *b;
    mf_bt_conv *cv;
    int next, done, rc, system;
    int64_t V, gen;
} mf_bt;

/* The user's message of turn t of conversation i, appended to its tokens */
static void mf_bt_user(mf_bt *x, int i)
{
    mf_bt_conv *c = &x->cv[i];
    for (int k = 0; k < c->user[c->turn]; k++)
        c->toks[c->n_toks++] = (int32_t)((53 * k + 7 * c->turn + 131 * i + 17) % x->V);
}

static int mf_bt_submit(mf_bt *x, int i, int64_t now)
{
    mf_bt_conv *c = &x->cv[i];
    mf_bt_user(x, i);
    c->arrive_ns = now;
    c->n_gen = 0;
    return mf_batch_submit(x->b, &(mf_batch_req){.prompt = c->toks, .n_prompt = c->n_toks, .max_tokens = c->reply[c->turn],
                                                .ignore_eos = 1, .user = (void *)(intptr_t)i}, NULL);
}

static void mf_bt_on_event(void *user, const mf_batch_event *ev)
{
    mf_bt *x = user;
    int i = (int)(intptr_t)ev->user;
    mf_bt_conv *c = &x->cv[i];
    if (ev->kind == MF_BATCH_TOKEN) {
        if (!c->n_gen++) {
            c->ttft[c->turn] = (ev->now_ns - c->arrive_ns) / 1e9;
            c->cached[c->turn] = ev->n_cached;
        }
        c->toks[c->n_toks++] = ev->token;   /* the reply joins the history */
        c->hash = (c->hash ^ (uint64_t)ev->token) * 0x100000001b3ULL;
        x->gen++;
        return;
    }
    if (ev->finish != MF_BATCH_LENGTH && !x->rc)
        x->rc = mf_error(-EIO, "bench serve --turns: a turn ended with %s", mf_batch_finish_name(ev->finish));
    int rc = 0;
    if (++c->turn < x->o->turns) {
        rc = mf_bt_submit(x, i, ev->now_ns);   /* the same client's next turn */
    } else {
        x->done++;
        if (x->next < x->o->n_conv) rc = mf_bt_submit(x, x->next++, ev->now_ns);   /* its next conversation */
    }
    if (rc && !x->rc) x->rc = rc;
}

/* One pass: every conversation from its first turn, with a prefix cache (p) or without */
static int mf_bt_pass(mf_bt *x, mf_prefix *p, double *sec)
{
    const mf_bt_opts *o = x->o;
    for (int i = 0; i < o->n_conv; i++) {
        mf_bt_conv *c = &x->cv[i];
        c->turn = c->n_toks = 0;
        c->hash = 0xcbf29ce484222325ULL;
        for (int k = 0; k < x->system; k++) c->toks[c->n_toks++] = (int32_t)((29 * k + 3) % x->V);
    }
    x->next = x->done = x->rc = 0;
    x->gen = 0;
    int rc = mf_batch_new(&(mf_batch_opts){.ref = o->r, .eng = o->e, .max_batch = o->conc, .step_tokens = o->step_tokens,
                                           .max_context = o->ctx, .max_queue = o->n_conv, .prefix = p,
                                           .on_event = mf_bt_on_event, .user = x}, &x->b);
    if (rc) return rc;
    int64_t t0 = mf_now_ns();
    for (; x->next < o->conc && x->next < o->n_conv && !rc; x->next++) rc = mf_bt_submit(x, x->next, t0);
    while (!rc && !x->rc && x->done < o->n_conv) {
        int items = 0;
        rc = mf_batch_step(x->b, &items);
        if (!rc && !items && x->done < o->n_conv) rc = mf_error(-EIO, "bench serve --turns: the batcher stalled");
    }
    *sec = (mf_now_ns() - t0) / 1e9;
    mf_batch_free(x->b);
    x->b = NULL;
    return rc ? rc : x->rc;
}

static int mf_bt_cmp(const void *a, const void *b)
{
    double u = *(const double *)a, v = *(const double *)b;
    return (u > v) - (u < v);
}

/* The median over the conversations of turn t's first-token time */
static double mf_bt_median(const mf_bt *x, int t, double *tmp)
{
    for (int i = 0; i < x->o->n_conv; i++) tmp[i] = x->cv[i].ttft[t];
    qsort(tmp, (size_t)x->o->n_conv, sizeof *tmp, mf_bt_cmp);
    return tmp[(x->o->n_conv - 1) / 2];
}

int mf_bench_serve_turns(const mf_bt_opts *o)
{
    if (o->turns < 1 || o->turns > MF_BT_MAX_TURNS)
        return mf_error(-EINVAL, "bench serve: --turns %d (expected 1..%d)", o->turns, MF_BT_MAX_TURNS);
    mf_bt x = {.o = o, .V = mf_ref_config(o->r)->vocab_size, .system = o->system_tokens};
    mf_bt_opts oc = *o;   /* the context: the longest conversation */
    x.o = &oc;
    x.cv = calloc((size_t)o->n_conv, sizeof *x.cv);
    double *tmp = malloc(sizeof(double) * (size_t)o->n_conv);
    int rc = x.cv && tmp ? 0 : mf_error(-ENOMEM, "out of memory");
    uint64_t rng = o->seed * 0x9E3779B97F4A7C15ULL + 1;
    int64_t longest = 0;
    for (int i = 0; i < o->n_conv && !rc; i++) {
        mf_bt_conv *c = &x.cv[i];
        int64_t n = x.system;
        for (int t = 0; t < o->turns; t++) {
            rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
            c->user[t] = o->user_lo + (int)((rng >> 33) % (uint64_t)(o->user_hi - o->user_lo + 1));
            rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
            c->reply[t] = o->reply_lo + (int)((rng >> 33) % (uint64_t)(o->reply_hi - o->reply_lo + 1));
            n += c->user[t] + c->reply[t];
        }
        longest = n > longest ? n : longest;
        if (!(c->toks = malloc(sizeof(int32_t) * (size_t)(n + 1)))) rc = mf_error(-ENOMEM, "out of memory");
    }
    oc.ctx = longest + 1;
    if (!rc && oc.ctx > mf_ref_config(o->r)->max_position_embeddings)
        rc = mf_error(-EINVAL, "bench serve --turns: conversations of up to %" PRId64 " tokens, past the model's "
                      "max_position_embeddings", longest);
    double med[2][MF_BT_MAX_TURNS] = {{0}}, sec[2] = {0}, tps[2] = {0};
    int64_t cached[2] = {0};
    uint64_t hash[2] = {0};
    for (int pass = 0; pass <= o->warmup && !rc; pass++)
        for (int mode = 0; mode < 2 && !rc; mode++) {   /* 0: with the cache, 1: without (alternating) */
            mf_prefix *p = NULL;
            if (mode == 0)
                rc = mf_prefix_new(&(mf_prefix_opts){.ref = o->r, .block_tokens = o->block, .budget_bytes = o->cache_bytes},
                                   &p);
            if (!rc) rc = mf_bt_pass(&x, p, &sec[mode]);
            mf_prefix_free(p);
            if (rc || pass < o->warmup) continue;
            tps[mode] = x.gen / sec[mode];
            cached[mode] = 0;
            hash[mode] = 0;
            for (int i = 0; i < o->n_conv; i++) {
                hash[mode] ^= x.cv[i].hash + (uint64_t)i;
                for (int t = 0; t < o->turns; t++) cached[mode] += x.cv[i].cached[t];
            }
            for (int t = 0; t < o->turns; t++) med[mode][t] = mf_bt_median(&x, t, tmp);
        }
    if (!rc && hash[0] != hash[1])
        rc = mf_error(-EIO, "bench serve --turns: the replies with the prefix cache differ from those without");
    if (!rc) {
        if (o->json) {
            printf("{\"conversations\":%d,\"turns\":%d,\"concurrency\":%d,\"results\":[", o->n_conv, o->turns, o->conc);
            for (int mode = 0; mode < 2; mode++) {
                printf("%s{\"mode\":\"%s\",\"tokens_per_s\":%.3f,\"wall_s\":%.3f,\"cached_tokens\":%" PRId64
                       ",\"ttft_p50_s\":[", mode ? "," : "", mode ? "no_cache" : "prefix_cache", tps[mode], sec[mode],
                       cached[mode]);
                for (int t = 0; t < o->turns; t++) printf("%s%.4f", t ? "," : "", med[mode][t]);
                printf("]}");
            }
            printf("],\"ttft_ratio\":[");
            for (int t = 0; t < o->turns; t++) printf("%s%.4f", t ? "," : "", med[1][t] > 0 ? med[0][t] / med[1][t] : 0);
            printf("]}\n");
        } else {
            printf("bench serve --turns %d: %d conversations, concurrency %d, system prompt %d tokens, turns of %d-%d "
                   "user tokens and %d-%d reply tokens\n%-13s %9s %9s %9s  time to first token per turn (median, s)\n",
                   o->turns, o->n_conv, o->conc, x.system, o->user_lo, o->user_hi, o->reply_lo, o->reply_hi, "mode",
                   "tokens/s", "wall s", "cached");
            for (int mode = 0; mode < 2; mode++) {
                printf("%-13s %9.2f %9.2f %9" PRId64 " ", mode ? "no cache" : "prefix cache", tps[mode], sec[mode],
                       cached[mode]);
                for (int t = 0; t < o->turns; t++) printf(" %8.3f", med[mode][t]);
                printf("\n");
            }
            printf("%-13s %29s", "ratio", "");
            for (int t = 0; t < o->turns; t++) printf(" %7.3fx", med[1][t] > 0 ? med[0][t] / med[1][t] : 0);
            printf("\n");
        }
    }
    for (int i = 0; x.cv && i < o->n_conv; i++) free(x.cv[i].toks);
    free(x.cv);
    free(tmp);
    return rc;
}
