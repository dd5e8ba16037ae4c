/* `moeflow serve`'s server (tools/serve_http.h): an OpenAI-compatible HTTP API on libmicrohttpd (a
 * thread per connection) over the continuous batcher (graphs/step/batch.h), stepped by one thread.
 * Requests are parsed by tools/serve_req.c; each becomes a job that the batcher's events fill
 * (text, tokens, the end) and the connection drains, as one JSON response or as server-sent
 * events; /metrics in Prometheus text. The command around it: tools/cmd_serve.c. docs/serve.md. */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <microhttpd.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "graphs/step/batch.h"
#include "graphs/step/step.h"
#include "host/tokenizer.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "tools/serve_http.h"
#include "tools/serve_req.h"
#include "tools/tool_prefix.h"

/* ---- metrics ---------------------------------------------------------------------------------- */

static const double mf_ttft_le[MF_HIST_N] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
static const double mf_itl_le[MF_HIST_N] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5};

static void mf_hist_add(mf_hist *h, const double *le, double v)
{
    int b = 0;
    while (b < MF_HIST_N && v > le[b]) b++;
    h->n[b]++;
    h->count++;
    h->sum += v;
}

/* ---- jobs ------------------------------------------------------------------------------------- */

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
    int n_cached;              /* prompt tokens choice 0 restored from the prefix cache */
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
    return json_pack("{s:i, s:i, s:i, s:{s:i}}", "prompt_tokens", j->n_prompt, "completion_tokens", gen, "total_tokens",
                     j->n_prompt + gen, "prompt_tokens_details", "cached_tokens", j->n_cached);
}

static json_t *mf_error_obj(const char *msg, const char *type, const char *param, const char *code)
{
    return json_pack("{s:{s:s, s:s, s:o, s:o}}", "error", "message", msg, "type", type, "param",
                     param && *param ? json_string(param) : json_null(), "code", code ? json_string(code) : json_null());
}

/* The batcher's events (on the stepping thread): ev->user is a choice. */
void mf_srv_on_event(void *user, const mf_batch_event *ev)
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
    if (c->index == 0) j->n_cached = ev->n_cached;
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

void *mf_srv_stepper(void *arg)
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

/* A job for request q (n choices, each a request of its own), its id and creation time; for a
 * streamed chat, each choice's role delta first. NULL when out of memory. */
static mf_job *mf_job_new(const mf_srv *v, const mf_serve_req *q, int chat, int n_ids)
{
    mf_job *j = calloc(1, sizeof *j);
    if (j) j->ch = calloc((size_t)q->n, sizeof *j->ch);
    if (!j || !j->ch) {
        free(j);
        return NULL;
    }
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->n_ch = q->n;
    for (int i = 0; i < q->n; i++) j->ch[i] = (mf_choice){.j = j, .index = i};
    j->refs = 1 + q->n;
    j->chat = chat;
    j->stream = q->stream;
    j->n_prompt = n_ids;
    j->created = (int64_t)time(NULL);
    static uint64_t next_rid;
    snprintf(j->rid, sizeof j->rid, "%s-%" PRIu64, chat ? "chatcmpl" : "cmpl",
             __atomic_add_fetch(&next_rid, 1, __ATOMIC_RELAXED));
    for (int i = 0; j->stream && chat && i < q->n; i++)   /* each choice's role delta comes first */
        mf_sse_add(j, mf_chunk(v, j, &j->ch[i], NULL, 0, 0));
    return j;
}

/* Submits j's choices, choice i seeded seed + i; the job is listed before any can end (the last
 * DONE event unlinks it). *n_sub: how many went in before a refusal. 0 or the refusal's code. */
static int mf_srv_submit(mf_srv *v, mf_job *j, const mf_serve_req *q, const int32_t *ids, int n_ids, int max_tokens,
                         int *n_sub)
{
    int rc = 0, n = 0;
    pthread_mutex_lock(&v->mu);
    for (; n < q->n; n++) {
        mf_batch_req br = {.prompt = ids, .n_prompt = n_ids, .max_tokens = max_tokens, .temperature = q->temperature,
                           .top_p = q->top_p, .seed = q->seed + (uint64_t)n, .ignore_eos = q->ignore_eos,
                           .stop = (const char *const *)q->stop, .n_stop = q->n_stop, .user = &j->ch[n]};
        if ((rc = mf_batch_submit(v->b, &br, &j->ch[n].id))) break;
    }
    j->n_live = n;
    if (n) {
        j->next = v->jobs;
        if (v->jobs) v->jobs->prev = j;
        v->jobs = j;
        v->prompt_tokens += (uint64_t)n_ids;
    }
    if (rc == -EAGAIN) v->rejected_429++;
    pthread_mutex_unlock(&v->mu);
    *n_sub = n;
    return rc;
}

/* The batcher refused choice n_sub (code rc): the ones submitted before it are cancelled (their
 * DONE events drop their refs), and the client gets 429, 503 or 400. */
static enum MHD_Result mf_srv_refused(mf_srv *v, struct MHD_Connection *c, mf_job *j, int n_sub, int rc)
{
    char m[MF_ERROR_MSG_BYTES];
    snprintf(m, sizeof m, "%s", mf_last_error());
    pthread_mutex_lock(&j->mu);
    j->refs -= j->n_ch - n_sub;
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

/* stream: true: server-sent events, drained from the job by mf_stream_read. */
static enum MHD_Result mf_srv_stream(mf_srv *v, struct MHD_Connection *c, mf_job *j)
{
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

/* One JSON response: waits for the job's end, cancelling it if the client leaves meanwhile. */
static enum MHD_Result mf_srv_answer(mf_srv *v, struct MHD_Connection *c, mf_job *j, int chat)
{
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

/* POST /v1/completions or /v1/chat/completions: the body parsed and checked, its prompt encoded
 * and fitted to the context, a job submitted, then streamed or answered once. */
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
    mf_job *j = mf_job_new(v, &q, chat, n_ids);
    int n_sub = 0;
    rc = j ? mf_srv_submit(v, j, &q, ids, n_ids, max_tokens, &n_sub) : 0;
    free(ids);
    mf_serve_req_clear(&q);
    if (!j) return MHD_NO;
    if (rc) return mf_srv_refused(v, c, j, n_sub, rc);
    return j->stream ? mf_srv_stream(v, c, j) : mf_srv_answer(v, c, j, chat);
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
    char pm[4096];   /* the prefix cache's (tools/tool_prefix.c) */
    size_t pn = mf_tool_prefix_metrics(v->prefix, pm, sizeof pm);
    if (pn) mf_buf_add(&s, &n, &cap, pm, pn);
#undef OUT
    if (!s) return MHD_NO;
    return mf_send(c, 200, "text/plain; version=0.0.4", s, n, NULL);
}

enum MHD_Result mf_srv_handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
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

void mf_srv_done(void *cls, struct MHD_Connection *c, void **ctx, enum MHD_RequestTerminationCode t)
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

int mf_srv_cancel_all(mf_srv *v)
{
    pthread_mutex_lock(&v->mu);
    int n = 0;
    for (mf_job *j = v->jobs; j; j = j->next) n += j->n_ch;
    uint64_t *ids = calloc((size_t)n + 1, sizeof *ids);
    n = 0;
    for (mf_job *j = v->jobs; j && ids; j = j->next)
        for (int i = 0; i < j->n_ch; i++) ids[n++] = j->ch[i].id;   /* ended ones: cancel finds nothing */
    pthread_mutex_unlock(&v->mu);
    for (int i = 0; i < n; i++) mf_batch_cancel(v->b, ids[i]);
    free(ids);
    return n;
}
