/* `moeflow serve`: an OpenAI-compatible HTTP API (libmicrohttpd, a thread per connection) over the
 * continuous batcher (graphs/step/batch.h), stepped by one thread. Requests are parsed by
 * tools/serve_req.c; each becomes a job that the batcher's events fill (text, tokens, the end) and
 * the connection drains, as one JSON response or as server-sent events. docs/serve.md. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "graphs/step/batch.h"
#include "graphs/model/engram_map.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/step.h"
#include "host/tokenizer.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "tools/commands.h"
#include "tools/sim_common.h"
#include "tools/serve_req.h"

/* ---- metrics ---------------------------------------------------------------------------------- */

#define MF_HIST_N 11
static const double mf_ttft_le[MF_HIST_N] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
static const double mf_itl_le[MF_HIST_N] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5};

typedef struct mf_hist {
    uint64_t n[MF_HIST_N + 1];   /* per bucket (last: above every bound) */
    uint64_t count;
    double sum;
} mf_hist;

static void mf_hist_add(mf_hist *h, const double *le, double v)
{
    int b = 0;
    while (b < MF_HIST_N && v > le[b]) b++;
    h->n[b]++;
    h->count++;
    h->sum += v;
}

/* ---- jobs ------------------------------------------------------------------------------------- */

typedef struct mf_job mf_job;

/* One of a job's `n` choices: a batcher request of its own (seed + index). */
typedef struct mf_choice {
    mf_job *j;
    int index;
    uint64_t id;
    int n_gen, done, finish;
    char *text;                /* non-stream: the output text */
    size_t n_text, cap_text;
    int32_t *toks;
    int n_toks, cap_toks;
    int64_t last_ns;
} mf_choice;

struct mf_job {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;                  /* the connection and the batcher (each choice until its DONE) */
    int chat, stream, n_prompt, done, err;   /* done: every choice has ended */
    int n_ch, n_done, n_live;  /* choices; ended; submitted and not ended (under the server's mu) */
    mf_choice *ch;
    char msg[512];             /* the first failed choice's message */
    int failed, cancelled;     /* some choice ended with an error / cancelled */
    char *text;                /* stream: SSE bytes not yet sent */
    size_t n_text, cap_text, n_out_sent;
    int64_t created;
    char rid[48];
    struct mf_job *prev, *next;   /* the server's list of live jobs */
};

typedef struct mf_srv {
    mf_batch *b;
    mf_tok *tok;
    mf_chat_tmpl *chat;        /* NULL: the built-in chat format */
    mf_step *eng;
    const mf_config *c;
    char model[256];
    int64_t max_context;
    const char *api_key;
    size_t max_body;
    int draining, stop_stepper, quiet;
    int n_inflight;            /* requests begun and not completed (mf_srv_done): drained at shutdown */
    pthread_t stepper;
    pthread_mutex_t mu;        /* live jobs and metrics */
    mf_job *jobs;
    mf_hist ttft, itl;
    uint64_t prompt_tokens, gen_tokens, requests[MF_BATCH_ERROR + 1], rejected_429, rejected_400;
    int64_t rate_sec[16];
    uint64_t rate_n[16];
    int64_t start_ns;
    int64_t phase_ns[MF_STEP_N_PHASES];
    uint64_t steps;
} mf_srv;

static int mf_buf_add(char **p, size_t *n, size_t *cap, const char *s, size_t k)
{
    if (*n + k + 1 > *cap) {
        size_t c = (*n + k + 1) * 2 + 256;
        char *q = realloc(*p, c);
        if (!q) return -ENOMEM;
        *p = q;
        *cap = c;
    }
    memcpy(*p + *n, s, k);
    *n += k;
    (*p)[*n] = 0;
    return 0;
}

static void mf_job_unref(mf_job *j)
{
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left) return;
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j->text);
    for (int i = 0; i < j->n_ch; i++) {
        free(j->ch[i].text);
        free(j->ch[i].toks);
    }
    free(j->ch);
    free(j);
}

/* Cancels every choice of j that has not ended (their sequences leave at the next step). */
static void mf_job_cancel(mf_batch *b, mf_job *j)
{
    uint64_t ids[MF_SERVE_MAX_N];
    int n = 0;
    pthread_mutex_lock(&j->mu);
    for (int i = 0; i < j->n_ch; i++)
        if (!j->ch[i].done) ids[n++] = j->ch[i].id;
    pthread_mutex_unlock(&j->mu);
    for (int i = 0; i < n; i++) mf_batch_cancel(b, ids[i]);
}

/* A JSON string of s[0..n) as UTF-8 (ill-formed bytes become U+FFFD). */
static json_t *mf_json_text(const char *s, size_t n)
{
    char *u = malloc(3 * n + 1);
    if (!u) return NULL;
    size_t k = mf_utf8_lossy(s, n, u);
    json_t *j = json_stringn(u, k);
    free(u);
    return j;
}

static const char *mf_finish_openai(int f) { return f == MF_BATCH_LENGTH ? "length" : "stop"; }

/* One server-sent event: "data: <json>\n\n" appended to the job's unsent bytes. */
static void mf_sse_add(mf_job *j, json_t *o)
{
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!s) return;
    mf_buf_add(&j->text, &j->n_text, &j->cap_text, "data: ", 6);
    mf_buf_add(&j->text, &j->n_text, &j->cap_text, s, strlen(s));
    mf_buf_add(&j->text, &j->n_text, &j->cap_text, "\n\n", 2);
    free(s);
}

static json_t *mf_chunk(const mf_srv *v, const mf_job *j, const mf_choice *c, const char *text, size_t n, int finish)
{
    json_t *ch = json_object();
    json_object_set_new(ch, "index", json_integer(c->index));
    if (j->chat) {
        json_t *d = json_object();
        if (text) json_object_set_new(d, "content", mf_json_text(text, n));
        else if (!finish) json_object_set_new(d, "role", json_string("assistant"));
        json_object_set_new(ch, "delta", d);
    } else {
        json_object_set_new(ch, "text", mf_json_text(text ? text : "", text ? n : 0));
        json_object_set_new(ch, "logprobs", json_null());
    }
    json_object_set_new(ch, "finish_reason", finish ? json_string(mf_finish_openai(c->finish)) : json_null());
    json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", j->rid, "object",
                          j->chat ? "chat.completion.chunk" : "text_completion", "created", (json_int_t)j->created,
                          "model", v->model, "choices", ch);
    return o;
}

/* Usage of j: the prompt once, the tokens of every choice. */
static json_t *mf_usage(const mf_job *j)
{
    int gen = 0;
    for (int i = 0; i < j->n_ch; i++) gen += j->ch[i].n_gen;
    return json_pack("{s:i, s:i, s:i}", "prompt_tokens", j->n_prompt, "completion_tokens", gen, "total_tokens",
                     j->n_prompt + gen);
}

static json_t *mf_error_obj(const char *msg, const char *type, const char *param, const char *code)
{
    return json_pack("{s:{s:s, s:s, s:o, s:o}}", "error", "message", msg, "type", type, "param",
                     param && *param ? json_string(param) : json_null(), "code", code ? json_string(code) : json_null());
}

/* The batcher's events (on the stepping thread): ev->user is a choice. */
static void mf_srv_on_event(void *user, const mf_batch_event *ev)
{
    mf_srv *v = user;
    mf_choice *c = ev->user;
    mf_job *j = c->j;
    pthread_mutex_lock(&v->mu);
    if (ev->kind == MF_BATCH_TOKEN) {
        v->gen_tokens++;
        if (ev->n_gen == 1) mf_hist_add(&v->ttft, mf_ttft_le, (ev->now_ns - ev->submit_ns) / 1e9);
        else mf_hist_add(&v->itl, mf_itl_le, (ev->now_ns - c->last_ns) / 1e9);
        int64_t sec = ev->now_ns / 1000000000;
        int slot = (int)(sec % 16);
        if (v->rate_sec[slot] != sec) v->rate_sec[slot] = sec, v->rate_n[slot] = 0;
        v->rate_n[slot]++;
    } else {
        v->requests[ev->finish]++;
        if (--j->n_live == 0) {   /* its last choice: the job leaves the list */
            if (j->prev) j->prev->next = j->next;
            else if (v->jobs == j) v->jobs = j->next;
            if (j->next) j->next->prev = j->prev;
            j->prev = j->next = NULL;
        }
    }
    pthread_mutex_unlock(&v->mu);
    pthread_mutex_lock(&j->mu);
    c->last_ns = ev->now_ns;
    c->n_gen = ev->n_gen;
    if (ev->kind == MF_BATCH_TOKEN) {
        if (c->n_toks == c->cap_toks) {
            int cap = c->cap_toks ? c->cap_toks * 2 : 64;
            int32_t *t = realloc(c->toks, sizeof *t * (size_t)cap);
            if (t) c->toks = t, c->cap_toks = cap;
        }
        if (c->n_toks < c->cap_toks) c->toks[c->n_toks++] = ev->token;
    }
    int last = ev->kind == MF_BATCH_DONE && j->n_done + 1 == j->n_ch;
    if (ev->kind == MF_BATCH_DONE) c->finish = ev->finish;
    if (j->stream) {
        if (ev->kind == MF_BATCH_TOKEN) {   /* a chunk per token, with its id (moeflow's addition) */
            json_t *o = mf_chunk(v, j, c, ev->text, ev->n_text, 0);
            json_object_set_new(json_array_get(json_object_get(o, "choices"), 0), "tokens", json_pack("[i]", ev->token));
            mf_sse_add(j, o);
        } else if (ev->n_text) {
            mf_sse_add(j, mf_chunk(v, j, c, ev->text, ev->n_text, 0));
        }
        if (ev->kind == MF_BATCH_DONE) {
            if (ev->finish == MF_BATCH_ERROR) {
                mf_sse_add(j, mf_error_obj(ev->msg ? ev->msg : "the forward failed", "server_error", NULL, NULL));
            } else if (ev->finish != MF_BATCH_CANCELLED) {   /* the choice's end; usage with the last */
                json_t *o = mf_chunk(v, j, c, NULL, 0, 1);
                if (last) json_object_set_new(o, "usage", mf_usage(j));
                mf_sse_add(j, o);
            }
            if (last) mf_buf_add(&j->text, &j->n_text, &j->cap_text, "data: [DONE]\n\n", 14);
        }
    } else if (ev->n_text) {
        mf_buf_add(&c->text, &c->n_text, &c->cap_text, ev->text, ev->n_text);
    }
    if (ev->kind == MF_BATCH_DONE) {
        c->done = 1;
        j->n_done++;
        j->done = j->n_done == j->n_ch;
        j->cancelled |= ev->finish == MF_BATCH_CANCELLED;
        if (ev->finish == MF_BATCH_ERROR && !j->failed) {
            j->failed = 1;
            j->err = ev->err;
            snprintf(j->msg, sizeof j->msg, "%s", ev->msg ? ev->msg : "the forward failed");
        }
    }
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    if (ev->kind == MF_BATCH_DONE) mf_job_unref(j);
}

static void *mf_srv_stepper(void *arg)
{
    mf_srv *v = arg;
    for (;;) {
        pthread_mutex_lock(&v->mu);
        int stop = v->stop_stepper;
        pthread_mutex_unlock(&v->mu);
        if (stop) break;
        if (!mf_batch_wait(v->b, 100000000)) {   /* after shutdown it returns at once when idle */
            usleep(10000);
            continue;
        }
        int n = 0;
        if (mf_batch_step(v->b, &n) && !v->quiet) fprintf(stderr, "moeflow serve: step failed: %s\n", mf_last_error());
        if (n && v->eng) {
            mf_step_times t;
            mf_step_last_times(v->eng, &t);
            pthread_mutex_lock(&v->mu);
            for (int p = 0; p < MF_STEP_N_PHASES; p++) v->phase_ns[p] += t.phase_ns[p];
            v->steps++;
            pthread_mutex_unlock(&v->mu);
        }
    }
    return NULL;
}

/* ---- HTTP ------------------------------------------------------------------------------------- */

typedef struct mf_conn {
    char *body;
    size_t n, cap;
    int too_big;
} mf_conn;

static enum MHD_Result mf_send(struct MHD_Connection *c, unsigned status, const char *type, char *body, size_t n,
                               const char *retry_after)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(n, body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", type);
    if (retry_after) MHD_add_response_header(r, "Retry-After", retry_after);
    enum MHD_Result ok = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ok;
}

static enum MHD_Result mf_send_json(struct MHD_Connection *c, unsigned status, json_t *o, const char *retry_after)
{
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!s) return MHD_NO;
    return mf_send(c, status, "application/json", s, strlen(s), retry_after);
}

static enum MHD_Result mf_send_error(struct MHD_Connection *c, unsigned status, const char *msg, const char *type,
                                     const char *param, const char *code, const char *retry_after)
{
    return mf_send_json(c, status, mf_error_obj(msg, type, param, code), retry_after);
}

/* 1 when the client closed its end (or the socket failed). */
static int mf_peer_gone(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return 0;
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLRDHUP};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR));
}

typedef struct mf_stream {
    mf_srv *v;
    mf_job *j;
    struct MHD_Connection *c;
} mf_stream;

/* SSE body: blocks (this connection's own thread) until the job has bytes or has ended. */
static ssize_t mf_stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    mf_stream *s = cls;
    mf_job *j = s->j;
    (void)pos;
    pthread_mutex_lock(&j->mu);
    for (;;) {
        if (j->n_out_sent < j->n_text) {
            size_t k = j->n_text - j->n_out_sent < max ? j->n_text - j->n_out_sent : max;
            memcpy(buf, j->text + j->n_out_sent, k);
            j->n_out_sent += k;
            pthread_mutex_unlock(&j->mu);
            return (ssize_t)k;
        }
        if (j->done) {
            pthread_mutex_unlock(&j->mu);
            return MHD_CONTENT_READER_END_OF_STREAM;
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50000000;
        if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
        pthread_cond_timedwait(&j->cv, &j->mu, &ts);
        if (!j->done && j->n_out_sent == j->n_text && mf_peer_gone(s->c)) {
            pthread_mutex_unlock(&j->mu);
            mf_job_cancel(s->v->b, j);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
    }
}

static void mf_stream_free(void *cls)
{
    mf_stream *s = cls;
    pthread_mutex_lock(&s->j->mu);
    int done = s->j->done;
    pthread_mutex_unlock(&s->j->mu);
    if (!done) mf_job_cancel(s->v->b, s->j);   /* the client went away: its sequences leave at the next step */
    mf_job_unref(s->j);
    free(s);
}

/* Prompt ids of a parsed request: BOS + the encoded text (completions text, or the rendered chat),
 * or the ids as given. */
static int mf_srv_prompt(mf_srv *v, const mf_serve_req *q, int32_t **ids, int *n, char *why, size_t cap)
{
    if (!q->chat && q->ids) {
        if (!(*ids = malloc(sizeof **ids * (size_t)q->n_ids))) return -ENOMEM;
        memcpy(*ids, q->ids, sizeof **ids * (size_t)q->n_ids);
        *n = q->n_ids;
        return 0;
    }
    if (!v->tok) {
        snprintf(why, cap, "this checkpoint has no tokenizer.json: give the prompt as a list of token ids");
        return -EINVAL;
    }
    char *text = NULL;
    size_t len = 0;
    int bos_in_text = 0;
    if (q->chat) {
        int rc = mf_serve_chat_render(q, v->chat, &text, &len, &bos_in_text);
        if (rc) {
            snprintf(why, cap, "the chat template cannot render these messages: %s", mf_last_error());
            return rc == -ENOMEM ? rc : -EINVAL;
        }
    } else {
        text = q->prompt;
        len = strlen(q->prompt);
    }
    size_t c = len + 2, got = 0;
    int32_t *p = malloc(sizeof *p * c);
    int rc = p ? mf_tok_encode(v->tok, text, len, p + 1, c - 1, &got) : -ENOMEM;
    if (q->chat) free(text);
    if (rc) {
        free(p);
        snprintf(why, cap, "the prompt cannot be encoded: %s", mf_last_error());
        return rc == -ENOMEM ? rc : -EINVAL;
    }
    p[0] = v->c->bos_token_id;
    if (bos_in_text) memmove(p, p + 1, sizeof *p * got);   /* the template's text holds what it wants */
    else got++;
    if (got == 0) {
        free(p);
        snprintf(why, cap, "the prompt encodes to no tokens");
        return -EINVAL;
    }
    *ids = p;
    *n = (int)got;
    return 0;
}

static enum MHD_Result mf_srv_complete(mf_srv *v, struct MHD_Connection *c, mf_conn *cn, int chat)
{
    if (cn->too_big) {
        char m[128];
        snprintf(m, sizeof m, "the request body is larger than %zu bytes", v->max_body);
        return mf_send_error(c, 413, m, "invalid_request_error", NULL, "body_too_large", NULL);
    }
    mf_serve_req q;
    mf_serve_err e;
    int rc = mf_serve_req_parse(cn->body ? cn->body : "", cn->n, chat, &q, &e);
    if (rc) {
        pthread_mutex_lock(&v->mu);
        v->rejected_400++;
        pthread_mutex_unlock(&v->mu);
        return mf_send_error(c, rc == -ENOMEM ? 500 : 400, e.message, "invalid_request_error", e.param, NULL, NULL);
    }
    int32_t *ids = NULL;
    int n_ids = 0;
    char why[600] = "";
    if ((rc = mf_srv_prompt(v, &q, &ids, &n_ids, why, sizeof why))) {
        mf_serve_req_clear(&q);
        return mf_send_error(c, rc == -ENOMEM ? 500 : 400, why[0] ? why : "out of memory", "invalid_request_error",
                             chat ? "messages" : "prompt", NULL, NULL);
    }
    int64_t room = v->max_context - n_ids;
    int max_tokens = q.max_tokens >= 0 ? q.max_tokens : chat ? (int)(room > 0 ? room : 0) : 16;
    if (n_ids + (int64_t)max_tokens > v->max_context) {
        snprintf(why, sizeof why, "this model's context is %" PRId64 " tokens; the prompt has %d and max_tokens asks "
                 "for %d more", v->max_context, n_ids, max_tokens);
        free(ids);
        mf_serve_req_clear(&q);
        return mf_send_error(c, 400, why, "invalid_request_error", chat ? "messages" : "prompt",
                             "context_length_exceeded", NULL);
    }
    mf_job *j = calloc(1, sizeof *j);
    if (j) j->ch = calloc((size_t)q.n, sizeof *j->ch);
    if (!j || !j->ch) {
        free(j);
        free(ids);
        mf_serve_req_clear(&q);
        return MHD_NO;
    }
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->n_ch = q.n;
    for (int i = 0; i < q.n; i++) j->ch[i] = (mf_choice){.j = j, .index = i};
    j->refs = 1 + q.n;
    j->chat = chat;
    j->stream = q.stream;
    j->n_prompt = n_ids;
    j->created = (int64_t)time(NULL);
    static uint64_t next_rid;
    snprintf(j->rid, sizeof j->rid, "%s-%" PRIu64, chat ? "chatcmpl" : "cmpl",
             __atomic_add_fetch(&next_rid, 1, __ATOMIC_RELAXED));
    for (int i = 0; j->stream && chat && i < q.n; i++)   /* each choice's role delta comes first */
        mf_sse_add(j, mf_chunk(v, j, &j->ch[i], NULL, 0, 0));
    /* choice i is a request of its own, seeded seed + i; the job is listed before any can end
     * (the last DONE event unlinks it) */
    pthread_mutex_lock(&v->mu);
    int n_sub = 0;
    for (; n_sub < q.n && !rc; n_sub++) {
        mf_batch_req br = {.prompt = ids, .n_prompt = n_ids, .max_tokens = max_tokens, .temperature = q.temperature,
                           .top_p = q.top_p, .seed = q.seed + (uint64_t)n_sub, .ignore_eos = q.ignore_eos,
                           .stop = (const char *const *)q.stop, .n_stop = q.n_stop, .user = &j->ch[n_sub]};
        rc = mf_batch_submit(v->b, &br, &j->ch[n_sub].id);
        if (rc) break;
    }
    j->n_live = n_sub;
    if (n_sub) {
        j->next = v->jobs;
        if (v->jobs) v->jobs->prev = j;
        v->jobs = j;
        v->prompt_tokens += (uint64_t)n_ids;
    }
    if (rc == -EAGAIN) v->rejected_429++;
    pthread_mutex_unlock(&v->mu);
    free(ids);
    mf_serve_req_clear(&q);
    if (rc) {
        char m[MF_ERROR_MSG_BYTES];
        snprintf(m, sizeof m, "%s", mf_last_error());
        /* the choices submitted before the refusal are cancelled; their DONE events drop their refs */
        pthread_mutex_lock(&j->mu);
        j->refs -= j->n_ch - n_sub;   /* (q is cleared by now) */
        for (int i = n_sub; i < j->n_ch; i++) j->ch[i].done = 1;
        pthread_mutex_unlock(&j->mu);
        mf_job_cancel(v->b, j);
        mf_job_unref(j);
        if (rc == -EAGAIN)
            return mf_send_error(c, 429, "the server's queue is full; retry later", "rate_limit_error", NULL,
                                 "queue_full", "1");
        if (rc == -ESHUTDOWN)
            return mf_send_error(c, 503, "the server is shutting down", "server_error", NULL, "shutting_down", "5");
        return mf_send_error(c, rc == -ENOMEM ? 500 : 400, m, "invalid_request_error", NULL, NULL, NULL);
    }
    if (j->stream) {
        mf_stream *s = malloc(sizeof *s);
        struct MHD_Response *r = s ? MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, mf_stream_read, s,
                                                                       mf_stream_free) : NULL;
        if (!r) {
            free(s);
            mf_job_cancel(v->b, j);
            mf_job_unref(j);
            return MHD_NO;
        }
        *s = (mf_stream){.v = v, .j = j, .c = c};
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        enum MHD_Result ok = MHD_queue_response(c, MHD_HTTP_OK, r);
        MHD_destroy_response(r);
        return ok;
    }
    /* one JSON response: wait for the end, cancelling if the client leaves meanwhile */
    pthread_mutex_lock(&j->mu);
    int cancelled = 0;
    while (!j->done) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50000000;
        if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
        pthread_cond_timedwait(&j->cv, &j->mu, &ts);
        if (!j->done && !cancelled && mf_peer_gone(c)) {
            cancelled = 1;
            pthread_mutex_unlock(&j->mu);
            mf_job_cancel(v->b, j);
            pthread_mutex_lock(&j->mu);
        }
    }
    pthread_mutex_unlock(&j->mu);
    enum MHD_Result ok;
    if (j->failed || j->cancelled) {
        ok = j->failed ? mf_send_error(c, 500, j->msg, "server_error", NULL, NULL, NULL)
                       : mf_send_error(c, 503, "the request was cancelled", "server_error", NULL, "cancelled", NULL);
    } else {
        json_t *chs = json_array();
        for (int i = 0; i < j->n_ch; i++) {
            const mf_choice *x = &j->ch[i];
            json_t *ch = json_object(), *toks = json_array();
            for (int k = 0; k < x->n_toks; k++) json_array_append_new(toks, json_integer(x->toks[k]));
            json_object_set_new(ch, "index", json_integer(i));
            if (chat)
                json_object_set_new(ch, "message", json_pack("{s:s, s:o}", "role", "assistant", "content",
                                                             mf_json_text(x->text ? x->text : "", x->n_text)));
            else
                json_object_set_new(ch, "text", mf_json_text(x->text ? x->text : "", x->n_text));
            json_object_set_new(ch, "logprobs", json_null());
            json_object_set_new(ch, "finish_reason", json_string(mf_finish_openai(x->finish)));
            json_object_set_new(ch, "tokens", toks);   /* moeflow's addition: the generated token ids */
            json_array_append_new(chs, ch);
        }
        json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:o, s:o}", "id", j->rid, "object",
                              chat ? "chat.completion" : "text_completion", "created", (json_int_t)j->created, "model",
                              v->model, "choices", chs, "usage", mf_usage(j));
        ok = mf_send_json(c, 200, o, NULL);
    }
    mf_job_unref(j);
    return ok;
}

static enum MHD_Result mf_srv_metrics(mf_srv *v, struct MHD_Connection *c)
{
    mf_batch_stats bs;
    mf_batch_get_stats(v->b, &bs);
    char *s = NULL;
    size_t n = 0, cap = 0;
    char line[512];
#define OUT(...) do { int k_ = snprintf(line, sizeof line, __VA_ARGS__); mf_buf_add(&s, &n, &cap, line, (size_t)k_); } while (0)
    pthread_mutex_lock(&v->mu);
    int64_t now = mf_now_ns(), sec = now / 1000000000;
    uint64_t recent = 0;   /* the last 10 full seconds (fewer just after start) */
    for (int i = 0; i < 16; i++)
        if (v->rate_sec[i] >= sec - 10 && v->rate_sec[i] < sec) recent += v->rate_n[i];
    int64_t full = sec - v->start_ns / 1000000000;
    double tps = recent / (double)(full < 1 ? 1 : full > 10 ? 10 : full);
    OUT("# HELP moeflow_queue_depth Requests waiting for a sequence state.\n# TYPE moeflow_queue_depth gauge\n"
        "moeflow_queue_depth %d\n", bs.queued);
    OUT("# HELP moeflow_running_sequences Sequences in the running set.\n# TYPE moeflow_running_sequences gauge\n"
        "moeflow_running_sequences %d\n", bs.running);
    OUT("# HELP moeflow_sequence_states States in the pool.\n# TYPE moeflow_sequence_states gauge\n"
        "moeflow_sequence_states %d\n", bs.n_states);
    OUT("# HELP moeflow_tokens_per_second Generated tokens per second over the last 10 full seconds.\n"
        "# TYPE moeflow_tokens_per_second gauge\nmoeflow_tokens_per_second %.3f\n", tps);
    OUT("# TYPE moeflow_generated_tokens_total counter\nmoeflow_generated_tokens_total %" PRIu64 "\n", v->gen_tokens);
    OUT("# TYPE moeflow_prompt_tokens_total counter\nmoeflow_prompt_tokens_total %" PRIu64 "\n", v->prompt_tokens);
    OUT("# TYPE moeflow_steps_total counter\nmoeflow_steps_total %" PRId64 "\n", bs.steps);
    OUT("# TYPE moeflow_requests_total counter\n");
    for (int f = MF_BATCH_EOS; f <= MF_BATCH_ERROR; f++)
        OUT("moeflow_requests_total{finish=\"%s\"} %" PRIu64 "\n", mf_batch_finish_name((mf_batch_finish)f),
            v->requests[f]);
    OUT("# TYPE moeflow_rejected_total counter\nmoeflow_rejected_total{reason=\"queue_full\"} %" PRIu64 "\n"
        "moeflow_rejected_total{reason=\"invalid\"} %" PRIu64 "\n", v->rejected_429, v->rejected_400);
    const mf_hist *hs[2] = {&v->ttft, &v->itl};
    const double *les[2] = {mf_ttft_le, mf_itl_le};
    const char *names[2] = {"moeflow_time_to_first_token_seconds", "moeflow_inter_token_latency_seconds"};
    for (int h = 0; h < 2; h++) {
        OUT("# TYPE %s histogram\n", names[h]);
        uint64_t cum = 0;
        for (int b = 0; b < MF_HIST_N; b++) {
            cum += hs[h]->n[b];
            OUT("%s_bucket{le=\"%g\"} %" PRIu64 "\n", names[h], les[h][b], cum);
        }
        OUT("%s_bucket{le=\"+Inf\"} %" PRIu64 "\n%s_sum %.6f\n%s_count %" PRIu64 "\n", names[h], hs[h]->count,
            names[h], hs[h]->sum, names[h], hs[h]->count);
    }
    if (v->eng) {
        OUT("# HELP moeflow_step_phase_seconds_total Wall time of engine steps per phase.\n"
            "# TYPE moeflow_step_phase_seconds_total counter\n");
        for (int p = 0; p < MF_STEP_N_PHASES; p++)
            OUT("moeflow_step_phase_seconds_total{phase=\"%s\"} %.6f\n", mf_step_phase_name((mf_step_phase)p),
                v->phase_ns[p] / 1e9);
    }
    pthread_mutex_unlock(&v->mu);
#undef OUT
    if (!s) return MHD_NO;
    return mf_send(c, 200, "text/plain; version=0.0.4", s, n, NULL);
}

static enum MHD_Result mf_srv_handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                     const char *version, const char *upload, size_t *upload_size, void **ctx)
{
    mf_srv *v = cls;
    (void)version;
    mf_conn *cn = *ctx;
    if (!cn) {
        if (!(cn = calloc(1, sizeof *cn))) return MHD_NO;
        *ctx = cn;
        pthread_mutex_lock(&v->mu);
        v->n_inflight++;
        pthread_mutex_unlock(&v->mu);
        return MHD_YES;
    }
    if (*upload_size) {
        if (!cn->too_big && cn->n + *upload_size > v->max_body) {
            cn->too_big = 1;
        } else if (!cn->too_big && mf_buf_add(&cn->body, &cn->n, &cn->cap, upload, *upload_size)) {
            return MHD_NO;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    int post = !strcmp(method, "POST"), get = !strcmp(method, "GET");
    if (!strcmp(url, "/health")) {
        pthread_mutex_lock(&v->mu);
        int dr = v->draining;
        pthread_mutex_unlock(&v->mu);
        char *b = strdup(dr ? "{\"status\":\"shutting down\"}" : "{\"status\":\"ok\"}");
        return b ? mf_send(c, dr ? 503 : 200, "application/json", b, strlen(b), NULL) : MHD_NO;
    }
    if (v->api_key) {
        const char *a = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
        if (!a || strncmp(a, "Bearer ", 7) || strcmp(a + 7, v->api_key))
            return mf_send_error(c, 401, "a valid API key is required (Authorization: Bearer KEY)",
                                 "invalid_request_error", NULL, "invalid_api_key", NULL);
    }
    if (!strcmp(url, "/metrics") && get) return mf_srv_metrics(v, c);
    if (!strcmp(url, "/v1/models") && get) {
        json_t *o = json_pack("{s:s, s:[{s:s, s:s, s:i, s:s, s:I}]}", "object", "list", "data", "id", v->model, "object",
                              "model", "created", 0, "owned_by", "moeflow", "max_context", (json_int_t)v->max_context);
        return mf_send_json(c, 200, o, NULL);
    }
    int chat = !strcmp(url, "/v1/chat/completions");
    if (chat || !strcmp(url, "/v1/completions")) {
        if (!post) return mf_send_error(c, 405, "use POST", "invalid_request_error", NULL, NULL, NULL);
        return mf_srv_complete(v, c, cn, chat);
    }
    char m[300];
    snprintf(m, sizeof m, "no endpoint %s %.200s", method, url);
    return mf_send_error(c, 404, m, "invalid_request_error", NULL, "not_found", NULL);
}

static void mf_srv_done(void *cls, struct MHD_Connection *c, void **ctx, enum MHD_RequestTerminationCode t)
{
    mf_srv *v = cls;
    (void)c, (void)t;
    mf_conn *cn = *ctx;
    if (cn) {
        free(cn->body);
        free(cn);
        pthread_mutex_lock(&v->mu);
        v->n_inflight--;
        pthread_mutex_unlock(&v->mu);
    }
    *ctx = NULL;
}

/* ---- the command ------------------------------------------------------------------------------ */

static void mf_serve_usage(FILE *f)
{
    fprintf(f,
            "usage: moeflow serve --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--max-batch N]\n"
            "                     [--step-tokens N] [--state-budget BYTES] [--max-queue N] [--api-key KEY]\n"
            "                     [--max-context N] [--threads N] [--exact] [--engine scheduled|reference]\n"
            "                     [--model-name NAME] [--max-body BYTES] [--timeout S] [--drain-timeout S]\n"
            "                     [--chat-template FILE|builtin] [--quiet]\n\n"
            "Serves an OpenAI-compatible HTTP API over the continuous batcher (docs/serve.md):\n"
            "POST /v1/completions, POST /v1/chat/completions (stream: true for server-sent events),\n"
            "GET /v1/models, /health, /metrics (Prometheus text). SIGTERM or SIGINT stop accepting,\n"
            "let running requests finish for --drain-timeout seconds, cancel the rest, and exit 0.\n\n"
            "  --checkpoint DIR     config.json + safetensors (+ tokenizer.json for text)\n"
            "  --host ADDR          IPv4 address to bind (default 127.0.0.1, loopback only)\n"
            "  --port N             TCP port (default 8000; 0: a free one, printed at start)\n"
            "  --max-batch N        running sequences, 1..64 (default 16)\n"
            "  --step-tokens N      items per step: decode tokens, then prefill chunks (default 64)\n"
            "  --state-budget SIZE  bytes for all sequence states, e.g. 2G (default: max-batch states)\n"
            "  --max-queue N        waiting requests; more get 429 with Retry-After (default 256)\n"
            "  --api-key KEY        every request but /health needs 'Authorization: Bearer KEY'\n"
            "  --max-context N      positions per sequence: prompt + max_tokens (default min(model, 4096))\n"
            "  --threads N          scheduled engine workers (default: the online CPUs)\n"
            "  --exact              fp32 kernel path for the FP4 experts (see moeflow decode --help)\n"
            "  --engine E           scheduled (default) or reference\n"
            "  --model-name NAME    the model id in responses and /v1/models (default: DIR's name)\n"
            "  --max-body SIZE      largest request body (default 1M); larger: 413\n"
            "  --timeout S          close connections idle for S seconds (default 30)\n"
            "  --drain-timeout S    on SIGTERM/SIGINT, seconds to let running requests finish (default 10)\n"
            "  --chat-template T    the chat template: DIR/tokenizer_config.json's chat_template by default\n"
            "                       (Jinja2, the subset of docs/serve.md; the built-in DeepSeek-V3 format\n"
            "                       without one), FILE (a template, or a tokenizer_config.json), or builtin\n"
            "  --quiet              no log lines on stderr\n");
}


static int mf_serve_long(const char *opt, const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long x = strtol(s, &end, 10);
    if (errno || *end || !*s || x < lo || x > hi) {
        fprintf(stderr, "moeflow serve: %s: expected %ld..%ld, found '%s'\n", opt, lo, hi, s);
        return -1;
    }
    *out = x;
    return 0;
}

int mf_cmd_serve(int argc, char **argv)
{
    const char *dir = NULL, *host = "127.0.0.1", *api_key = NULL, *model_name = NULL, *engine = "scheduled";
    const char *chat_spec = NULL;
    long port = 8000, max_batch = 16, step_tokens = 64, max_queue = 256, max_context = 0, timeout = 30, drain = 10;
    long threads = sysconf(_SC_NPROCESSORS_ONLN);
    uint64_t budget = 0, max_body = 1 << 20;
    int exact = 0, quiet = 0;
    if (threads < 1) threads = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int hv = i + 1 < argc, bad = 0;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            mf_serve_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--checkpoint") && hv) dir = argv[++i];
        else if (!strcmp(a, "--host") && hv) host = argv[++i];
        else if (!strcmp(a, "--port") && hv) bad = mf_serve_long(a, argv[++i], 0, 65535, &port);
        else if (!strcmp(a, "--max-batch") && hv) bad = mf_serve_long(a, argv[++i], 1, MF_STEP_MAX_ITEMS, &max_batch);
        else if (!strcmp(a, "--step-tokens") && hv) bad = mf_serve_long(a, argv[++i], 1, 65536, &step_tokens);
        else if (!strcmp(a, "--max-queue") && hv) bad = mf_serve_long(a, argv[++i], 1, 1 << 20, &max_queue);
        else if (!strcmp(a, "--max-context") && hv) bad = mf_serve_long(a, argv[++i], 2, 1L << 30, &max_context);
        else if (!strcmp(a, "--threads") && hv) bad = mf_serve_long(a, argv[++i], 1, 256, &threads);
        else if (!strcmp(a, "--timeout") && hv) bad = mf_serve_long(a, argv[++i], 1, 86400, &timeout);
        else if (!strcmp(a, "--drain-timeout") && hv) bad = mf_serve_long(a, argv[++i], 0, 86400, &drain);
        else if (!strcmp(a, "--api-key") && hv) api_key = argv[++i];
        else if (!strcmp(a, "--model-name") && hv) model_name = argv[++i];
        else if (!strcmp(a, "--chat-template") && hv) chat_spec = argv[++i];
        else if (!strcmp(a, "--engine") && hv) {
            engine = argv[++i];
            bad = strcmp(engine, "scheduled") && strcmp(engine, "reference");
            if (bad) fprintf(stderr, "moeflow serve: --engine: expected scheduled or reference, found '%s'\n", engine);
        } else if ((!strcmp(a, "--state-budget") || !strcmp(a, "--max-body")) && hv) {
            uint64_t x = mf_tool_size(argv[++i]);
            if (!x) {
                fprintf(stderr, "moeflow serve: %s: expected a size such as 2G or 512M, found '%s'\n", a, argv[i]);
                bad = 1;
            }
            *(!strcmp(a, "--max-body") ? &max_body : &budget) = x;
        } else if (!strcmp(a, "--exact")) exact = 1;
        else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) quiet = 1;
        else {
            fprintf(stderr, "moeflow serve: unknown or incomplete option '%s'\n\n", a);
            mf_serve_usage(stderr);
            return 2;
        }
        if (bad) return 2;
    }
    if (!dir) {
        fprintf(stderr, "moeflow serve: --checkpoint is required\n\n");
        mf_serve_usage(stderr);
        return 2;
    }
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (inet_pton(AF_INET, !strcmp(host, "localhost") ? "127.0.0.1" : host, &sa.sin_addr) != 1) {
        fprintf(stderr, "moeflow serve: --host: expected an IPv4 address such as 127.0.0.1, found '%s'\n", host);
        return 2;
    }
    int sched = !strcmp(engine, "scheduled");

    /* the signals are taken by sigwait below, in this thread only */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    int ret = 1;
    static mf_srv v;
    memset(&v, 0, sizeof v);
    pthread_mutex_init(&v.mu, NULL);
    mf_model *m = NULL;
    mf_ref *r = NULL;
    mf_engram_map *emap = NULL;
    struct MHD_Daemon *d = NULL;
    int stepper = 0;
    char tpath[4200];
    snprintf(tpath, sizeof tpath, "%s/tokenizer.json", dir);
    if (access(tpath, R_OK) == 0 && mf_tok_load(tpath, &v.tok)) goto fail;
    char chat_desc[4400];
    if (mf_chat_tmpl_load(dir, chat_spec, &v.chat, chat_desc, sizeof chat_desc)) {
        fprintf(stderr, "moeflow serve: %s\n(--chat-template builtin serves the built-in DeepSeek-V3 chat format instead)\n",
                mf_last_error());
        ret = 2;
        goto out;
    }
    if (mf_model_load(dir, &(mf_model_opts){.quiet = quiet, .resident_limit_bytes = sched ? UINT64_C(64) << 30 : 0}, &m))
        goto fail;
    v.c = mf_model_config(m);
    mf_ref_opts ro = {0};
    if (v.tok && v.c->n_engram > 0) {   /* the real Engram token map, as decode */
        if (mf_engram_map_build(v.tok, &emap)) goto fail;
        ro.token_map = mf_engram_map_ids(emap);
        ro.n_token_map = mf_engram_map_n_vocab(emap);
    }
    if (mf_ref_new(m, &ro, &r)) goto fail;
    if (sched && mf_step_new(r, &(mf_step_opts){.n_threads = (int)threads, .exact = exact}, &v.eng)) goto fail;
    v.max_context = max_context ? max_context : v.c->max_position_embeddings < 4096 ? v.c->max_position_embeddings : 4096;
    if (v.max_context > v.c->max_position_embeddings) {
        fprintf(stderr, "moeflow serve: --max-context %ld is past the model's max_position_embeddings %" PRId64 "\n",
                max_context, v.c->max_position_embeddings);
        ret = 2;
        goto out;
    }
    if (mf_batch_new(&(mf_batch_opts){.ref = r, .eng = v.eng, .tok = v.tok, .max_batch = (int)max_batch,
                                      .step_tokens = (int)step_tokens, .max_context = v.max_context,
                                      .state_budget_bytes = budget, .max_queue = (int)max_queue,
                                      .on_event = mf_srv_on_event, .user = &v}, &v.b))
        goto fail;
    char dn[256];
    snprintf(dn, sizeof dn, "%s", dir);
    for (size_t k = strlen(dn); k > 1 && dn[k - 1] == '/'; k--) dn[k - 1] = 0;
    const char *base = strrchr(dn, '/');
    snprintf(v.model, sizeof v.model, "%s", model_name ? model_name : base ? base + 1 : dn);
    v.api_key = api_key;
    v.max_body = max_body;
    v.quiet = quiet;
    v.start_ns = mf_now_ns();
    if (pthread_create(&v.stepper, NULL, mf_srv_stepper, &v)) {
        mf_error(-EAGAIN, "cannot start the stepping thread");
        goto fail;
    }
    stepper = 1;
    d = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_ITC |
                             MHD_USE_ERROR_LOG,
                         0, NULL, NULL, mf_srv_handle, &v, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
                         MHD_OPTION_NOTIFY_COMPLETED, mf_srv_done, &v, MHD_OPTION_CONNECTION_TIMEOUT,
                         (unsigned)timeout, MHD_OPTION_CONNECTION_LIMIT, (unsigned)(max_queue + max_batch + 64),
                         MHD_OPTION_LISTEN_BACKLOG_SIZE, 256u, MHD_OPTION_END);
    if (!d) {
        mf_error(-EADDRINUSE, "cannot listen on %s:%ld (in use, or not an address of this machine)", host, port);
        goto fail;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    mf_batch_stats bs;
    mf_batch_get_stats(v.b, &bs);
    fprintf(stderr, "moeflow serve: listening on http://%s:%u (model %s, %s engine, up to %d states, %.1f MiB each "
            "at the full context of %" PRId64 " (pages as positions arrive), step budget %ld)\n", host, di ? di->port : (unsigned)port, v.model, engine, bs.n_states,
            mf_batch_state_bytes(v.b) / 1048576.0, v.max_context, step_tokens);
    if (!quiet) fprintf(stderr, "moeflow serve: chat: %s\n", chat_desc);
    fflush(stderr);

    int sig = 0;
    sigwait(&sigs, &sig);
    if (!quiet) fprintf(stderr, "moeflow serve: %s: no new requests; draining for up to %ld s\n", strsignal(sig), drain);
    MHD_quiesce_daemon(d);   /* stop accepting; open connections keep going */
    pthread_mutex_lock(&v.mu);
    v.draining = 1;
    pthread_mutex_unlock(&v.mu);
    mf_batch_shutdown(v.b);
    int64_t until = mf_now_ns() + (int64_t)drain * 1000000000;
    for (;;) {
        mf_batch_get_stats(v.b, &bs);
        if ((!bs.queued && !bs.running) || mf_now_ns() >= until) break;
        usleep(20000);
    }
    if (bs.queued || bs.running) {   /* past the deadline: cancel what is left */
        pthread_mutex_lock(&v.mu);
        int n = 0;
        for (mf_job *j = v.jobs; j; j = j->next) n += j->n_ch;
        uint64_t *ids = calloc((size_t)n + 1, sizeof *ids);
        n = 0;
        for (mf_job *j = v.jobs; j && ids; j = j->next)
            for (int i = 0; i < j->n_ch; i++) ids[n++] = j->ch[i].id;   /* ended ones: cancel finds nothing */
        pthread_mutex_unlock(&v.mu);
        for (int i = 0; i < n; i++) mf_batch_cancel(v.b, ids[i]);
        free(ids);
        if (!quiet) fprintf(stderr, "moeflow serve: cancelled %d requests at the deadline\n", n);
        for (int k = 0; k < 500; k++) {
            mf_batch_get_stats(v.b, &bs);
            if (!bs.queued && !bs.running) break;
            usleep(20000);
        }
    }
    /* the answers of the requests that just ended (the cancelled ones' 503) are sent before the
     * daemon closes the connections: wait, bounded, until every begun request has completed */
    for (int k = 0; k < 250; k++) {
        pthread_mutex_lock(&v.mu);
        int busy = v.n_inflight;
        pthread_mutex_unlock(&v.mu);
        if (!busy) break;
        usleep(20000);
    }
    MHD_stop_daemon(d);   /* waits for the connections' threads, which end with their jobs */
    d = NULL;
    if (!quiet) fprintf(stderr, "moeflow serve: stopped\n");
    ret = 0;
    goto out;
fail:
    fprintf(stderr, "moeflow serve: %s\n", mf_last_error()[0] ? mf_last_error() : "out of memory");
out:
    if (d) MHD_stop_daemon(d);
    if (stepper) {
        pthread_mutex_lock(&v.mu);
        v.stop_stepper = 1;
        pthread_mutex_unlock(&v.mu);
        mf_batch_shutdown(v.b);
        pthread_join(v.stepper, NULL);
    }
    mf_batch_free(v.b);
    mf_step_free(v.eng);
    mf_ref_free(r);
    mf_model_free(m);
    mf_engram_map_free(emap);
    mf_tok_free(v.tok);
    mf_chat_tmpl_free(v.chat);
    pthread_mutex_destroy(&v.mu);
    return ret;
}
