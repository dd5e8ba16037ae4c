/* The batcher's per-request controls (graphs/step/batch.h) on the tiny preset, requests of every kind
 * in one batch: echo's prompt logprobs and generated tokens' logprobs equal the log-softmax of the
 * logits of a solo prefill of every position; unconstrained greedy neighbours of constrained
 * requests give the solo logits and tokens bit for bit (also in a slot a constrained request used
 * before); a grammar's output parses and fits its schema; logit_bias bans and forces; penalties
 * equal a plain re-implementation of their rule over the solo run; top_k 1 and min_p 1 sample the
 * argmax. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/batch.h"
#include "graphs/step/sample.h"
#include "graphs/step/step.h"
#include "host/grammar.h"
#include "host/tokenizer.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/tiny_ckpt.h"

#define CTX 160
#define GEN 24
#define NP 12

static int64_t V;
static mf_ref *R;
static mf_step *E;
static mf_tok *TOK;

typedef struct ev_log {
    int n_gen, done, finish, n_prompt_ev;
    int32_t gen[CTX];
    float lp[CTX], plp[CTX];    /* generated tokens' and prompt tokens' logprobs */
    int32_t top0[CTX];          /* each generated token's most probable alternative */
    float *logits;              /* GEN x V: what each token was drawn from */
    char text[8192];
    size_t n_text;
} ev_log;

static void on_event(void *user, const mf_batch_event *ev)
{
    (void)user;
    ev_log *g = ev->user;
    if (ev->kind == MF_BATCH_PROMPT) {
        g->plp[ev->pos] = ev->logprob;
        g->n_prompt_ev++;
        return;
    }
    if (ev->n_text && g->n_text + ev->n_text < sizeof g->text) {
        memcpy(g->text + g->n_text, ev->text, ev->n_text);
        g->n_text += ev->n_text;
    }
    if (ev->kind == MF_BATCH_DONE) {
        g->done = 1;
        g->finish = ev->finish;
        return;
    }
    if (g->n_gen < GEN && g->logits) memcpy(g->logits + (size_t)g->n_gen * V, ev->logits, sizeof(float) * V);
    g->lp[g->n_gen] = ev->logprob;
    g->top0[g->n_gen] = ev->n_top ? ev->top[0].id : -1;
    g->gen[g->n_gen++] = ev->token;
}

static void prompt_of(int q, int32_t *p, int n)
{
    for (int i = 0; i < n; i++) p[i] = (int32_t)((i * 37 + q * 101 + 3) % (V - 8) + 4);
}

/* Solo: the prompt's logits at every position (one prefill), then greedy decode steps with the
 * penalties of pr (NULL: none) applied by this file's own code. */
static void solo(const int32_t *p, int n, const mf_batch_req *pr, float *plog, int32_t *gen, float *glog)
{
    mf_ref_state *st = NULL;
    CHECK(mf_ref_state_new(R, CTX, &st) == 0, "state");
    mf_ref_state **sts = malloc(sizeof *sts * (size_t)n);
    float **lg = malloc(sizeof *lg * (size_t)n);
    for (int i = 0; i < n; i++) sts[i] = st, lg[i] = plog + (size_t)i * V;
    CHECK(mf_step_forward(E, sts, p, n, lg) == 0, "prefill: %s", mf_last_error());
    float *row = malloc(sizeof(float) * V);
    int *cnt = calloc((size_t)V, sizeof *cnt);
    char *inp = calloc((size_t)V, 1);
    for (int i = 0; i < n; i++) inp[p[i]] = 1;
    memcpy(row, plog + (size_t)(n - 1) * V, sizeof(float) * V);
    for (int k = 0; k < GEN; k++) {
        if (glog) memcpy(glog + (size_t)k * V, row, sizeof(float) * V);
        for (int64_t t = 0; pr && t < V; t++) {   /* the penalties' rule, written out */
            double x = row[t], rp = pr->repetition_penalty ? pr->repetition_penalty : 1;
            if ((cnt[t] || inp[t]) && rp != 1) x = x > 0 ? x / rp : x * rp;
            if (cnt[t]) x -= pr->frequency_penalty * cnt[t] + pr->presence_penalty;
            row[t] = (float)x;
        }
        gen[k] = mf_sample_greedy(row, V);
        cnt[gen[k]]++;
        float *one[1] = {row};
        CHECK(mf_step_forward(E, &st, &gen[k], 1, one) == 0, "decode: %s", mf_last_error());
    }
    free(row);
    free(cnt);
    free(inp);
    free(sts);
    free(lg);
    mf_ref_state_free(st);
}

static double lsm(const float *row, int32_t t)
{
    double mx = -INFINITY, s = 0;
    for (int64_t i = 0; i < V; i++) mx = row[i] > mx ? row[i] : mx;
    for (int64_t i = 0; i < V; i++) s += exp((double)row[i] - mx);
    return (double)row[t] - mx - log(s);
}

static void run(mf_batch *b, ev_log *g, int n)
{
    int guard = 0;
    for (;;) {
        int all = 1;
        for (int i = 0; i < n; i++) all &= g[i].done;
        if (all || ++guard > 2000) break;
        int items;
        CHECK(mf_batch_step(b, &items) == 0, "step: %s", mf_last_error());
    }
}

int main(void)
{
    mf_config c;
    char dir[1024], tp[1100];
    CHECK(mf_config_preset("tiny", &c) == 0, "preset");
    if (mf_test_gen_ckpt(&c, "batch_controls", dir, sizeof dir)) return 1;
    snprintf(tp, sizeof tp, "%s/tokenizer.json", dir);
    CHECK(mf_tok_load(tp, &TOK) == 0, "tokenizer: %s", mf_last_error());
    mf_model *m = NULL;
    CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1}, &m) == 0, "load: %s", mf_last_error());
    if (!m) return mf_check_exit("test_batch_controls");
    V = mf_model_config(m)->vocab_size;
    int32_t eos = (int32_t)mf_model_config(m)->eos_token_id;
    CHECK(mf_ref_new(m, NULL, &R) == 0 && mf_step_new(R, &(mf_step_opts){.n_threads = 2}, &E) == 0, "engine: %s",
          mf_last_error());
    mf_gram_vocab *gv = NULL;
    CHECK(mf_gram_vocab_new(TOK, V, eos, &gv) == 0, "grammar vocabulary: %s", mf_last_error());
    const char *schema = "{\"type\":\"object\",\"properties\":{\"n\":{\"type\":\"integer\"},\"b\":{\"type\":\"boolean\"},"
                         "\"e\":{\"enum\":[\"x\",\"yy\"]}},\"required\":[\"n\",\"b\"]}";
    mf_gram *gr = NULL;
    CHECK(mf_gram_from_schema(schema, strlen(schema), &gr) == 0, "schema: %s", mf_last_error());

    /* requests: 0 echo + logprobs, 1 plain greedy, 2 constrained, 3 plain greedy, 4 penalties,
     * 5 bias banning request 1's first token, 6 constrained, 7 top_k 1 sampled, 8 min_p 1 sampled,
     * 9 plain greedy after a slot held a constrained request (max_batch below the request count) */
    enum { N = 10 };
    int32_t p[N][NP];
    float *plog = malloc(sizeof(float) * NP * V), *glog[N];
    int32_t sgen[N][GEN];
    mf_batch_req pen = {.repetition_penalty = 1.5, .presence_penalty = 0.5, .frequency_penalty = 0.7};
    for (int q = 0; q < N; q++) {
        prompt_of(q % 7, p[q], NP);
        glog[q] = malloc(sizeof(float) * GEN * V);
        solo(p[q], NP, q == 4 ? &pen : NULL, plog, sgen[q], glog[q]);
    }
    float *plog0 = malloc(sizeof(float) * NP * V);
    int32_t tmp[GEN];
    solo(p[0], NP, NULL, plog0, tmp, NULL);
    mf_batch *b = NULL;
    CHECK(mf_batch_new(&(mf_batch_opts){.ref = R, .eng = E, .tok = TOK, .max_batch = 6, .step_tokens = 7,
                                        .max_context = CTX, .echo_rows = 5, .gram_vocab = gv, .on_event = on_event},
                       &b) == 0, "batch: %s", mf_last_error());
    if (!b) return mf_check_exit("test_batch_controls");
    static ev_log g[N];
    mf_batch_bias ban = {sgen[1][0], -100}, force = {17, 100};
    for (int q = 0; q < N; q++) {
        g[q].logits = (q == 1 || q == 3 || q == 9) ? malloc(sizeof(float) * GEN * V) : NULL;
        mf_batch_req rq = {.prompt = p[q], .n_prompt = NP, .max_tokens = GEN, .temperature = 0, .ignore_eos = 1,
                           .user = &g[q]};
        if (q == 0) rq.logprobs = 1, rq.top_logprobs = 3, rq.echo_logprobs = 1;
        if (q == 2 || q == 6) rq.grammar = gr, rq.max_tokens = CTX - NP, rq.ignore_eos = 0;
        if (q == 4) rq.repetition_penalty = pen.repetition_penalty, rq.presence_penalty = pen.presence_penalty,
                    rq.frequency_penalty = pen.frequency_penalty;
        if (q == 5) rq.bias = q == 5 ? &ban : NULL, rq.n_bias = 1, rq.prompt = p[1];
        if (q == 7) rq.temperature = 1, rq.top_k = 1, rq.seed = 5, rq.logprobs = 1, rq.top_logprobs = 1;
        if (q == 8) rq.temperature = 1.5, rq.min_p = 1, rq.seed = 9;
        CHECK(mf_batch_submit(b, &rq, NULL) == 0, "submit %d: %s", q, mf_last_error());
    }
    run(b, g, N);
    /* echo: prompt positions 1.. against the solo prefill's logits (the same bits, the same math) */
    CHECK(g[0].n_prompt_ev == NP - 1, "%d prompt events", g[0].n_prompt_ev);
    double worst = 0;
    for (int i = 1; i < NP; i++) worst = fmax(worst, fabs(g[0].plp[i] - lsm(plog0 + (size_t)(i - 1) * V, p[0][i])));
    for (int k = 0; k < g[0].n_gen; k++) worst = fmax(worst, fabs(g[0].lp[k] - lsm(glog[0] + (size_t)k * V, sgen[0][k])));
    CHECK(worst < 1e-6, "logprobs differ from the solo log-softmax by %g", worst);
    CHECK(g[0].n_gen == GEN && !memcmp(g[0].gen, sgen[0], sizeof sgen[0]), "echo request's tokens");
    for (int k = 0; k < g[0].n_gen; k++) CHECK(g[0].top0[k] == g[0].gen[k], "greedy: the top alternative is the token");
    /* unconstrained neighbours: bit for bit */
    for (int q = 1; q < N; q += 2) {
        if (q == 5 || q == 7) continue;
        int same = g[q].n_gen == GEN && !memcmp(g[q].gen, sgen[q], sizeof sgen[q]) &&
                   !memcmp(g[q].logits, glog[q], sizeof(float) * GEN * V);
        CHECK(same, "request %d: tokens and logits equal its solo run", q);
    }
    /* constrained: JSON of the schema, ended by the grammar */
    for (int q = 2; q <= 6; q += 4) {
        json_error_t je;
        json_t *o = json_loadb(g[q].text, g[q].n_text, 0, &je);
        CHECK(o && json_is_integer(json_object_get(o, "n")) && json_is_boolean(json_object_get(o, "b")) &&
                  json_object_size(o) <= 3 && g[q].finish == MF_BATCH_STOP,
              "request %d: '%.*s' (finish %d)", q, (int)g[q].n_text, g[q].text, g[q].finish);
        json_decref(o);
    }
    /* penalties: the rule applied to the solo run gives the same tokens */
    CHECK(g[4].n_gen == GEN && !memcmp(g[4].gen, sgen[4], sizeof sgen[4]), "penalties");
    CHECK(g[5].n_gen && g[5].gen[0] != sgen[1][0], "logit_bias -100 bans the greedy token");
    CHECK(g[7].n_gen == GEN && !memcmp(g[7].gen, sgen[7], sizeof sgen[7]), "top_k 1 samples the argmax");
    CHECK(g[8].n_gen == GEN && !memcmp(g[8].gen, sgen[8], sizeof sgen[8]), "min_p 1 samples the argmax");
    /* a forcing bias; a grammar request, then a plain one, in the same single slot */
    mf_batch_free(b);
    CHECK(mf_batch_new(&(mf_batch_opts){.ref = R, .eng = E, .tok = TOK, .max_batch = 1, .max_context = CTX,
                                        .gram_vocab = gv, .on_event = on_event}, &b) == 0, "batch");
    static ev_log h[3];
    h[2].logits = malloc(sizeof(float) * GEN * V);
    CHECK(mf_batch_submit(b, &(mf_batch_req){.prompt = p[1], .n_prompt = NP, .max_tokens = 3, .bias = &force, .n_bias = 1,
                                             .ignore_eos = 1, .user = &h[0]}, NULL) == 0, "submit");
    CHECK(mf_batch_submit(b, &(mf_batch_req){.prompt = p[2], .n_prompt = NP, .max_tokens = CTX - NP, .grammar = gr,
                                             .user = &h[1]}, NULL) == 0, "submit");
    CHECK(mf_batch_submit(b, &(mf_batch_req){.prompt = p[3], .n_prompt = NP, .max_tokens = GEN, .ignore_eos = 1,
                                             .user = &h[2]}, NULL) == 0, "submit");
    run(b, h, 3);
    CHECK(h[0].n_gen == 3 && h[0].gen[0] == 17 && h[0].gen[1] == 17, "logit_bias +100 forces the token");
    CHECK(h[1].finish == MF_BATCH_STOP && !memcmp(h[1].text, g[2].text, g[2].n_text), "the constrained request alone");
    CHECK(h[2].n_gen == GEN && !memcmp(h[2].gen, sgen[3], sizeof sgen[3]) &&
              !memcmp(h[2].logits, glog[3], sizeof(float) * GEN * V),
          "after a constrained request, a plain one in its slot equals its solo run");
    /* refusals */
    mf_batch_bias oov = {(int32_t)V, 1};
    CHECK(mf_batch_submit(b, &(mf_batch_req){.prompt = p[0], .n_prompt = 2, .max_tokens = 1, .bias = &oov, .n_bias = 1},
                          NULL) == -EINVAL && strstr(mf_last_error(), "logit bias 0"), "an id outside the vocabulary");
    CHECK(mf_batch_submit(b, &(mf_batch_req){.prompt = p[0], .n_prompt = 2, .max_tokens = 1, .echo_logprobs = 1}, NULL) ==
              -EINVAL, "echo without echo_rows");
    CHECK(mf_batch_submit(b, &(mf_batch_req){.prompt = p[0], .n_prompt = 2, .max_tokens = 1, .top_logprobs = 21}, NULL) ==
              -EINVAL, "top_logprobs 21");
    mf_batch_free(b);
    for (int q = 0; q < N; q++) free(glog[q]), free(g[q].logits);
    free(h[2].logits);
    free(plog);
    free(plog0);
    mf_gram_free(gr);
    mf_gram_vocab_free(gv);
    mf_step_free(E);
    mf_ref_free(R);
    mf_model_free(m);
    mf_tok_free(TOK);
    return mf_check_exit("test_batch_controls");
}
