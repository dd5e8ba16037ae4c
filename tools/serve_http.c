/* `moeflow serve`'s server (tools/serve_http.h): an OpenAI-compatible HTTP API on libmicrohttpd (an
 * epoll thread pool; connections come from the front door, tools/serve_door.c) over the
 * continuous batcher (graphs/step/batch.h), stepped by one thread. Requests are parsed by
 * tools/serve_req.c; each becomes a job that the batcher's events fill (text, tokens, the end).
 * A connection waiting for its job is suspended (parked) and resumed by the events, so no thread
 * waits for a client: the answer is one JSON response or server-sent events; /metrics in
 * Prometheus text. The command around it: tools/cmd_serve.c. docs/serve.md. */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <microhttpd.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "graphs/step/batch.h"
#include "graphs/step/step.h"
#include "host/tokenizer.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "host/grammar.h"
#include "tools/serve_head.h"
#include "tools/serve_http.h"
#include "tools/serve_logprobs.h"
#include "tools/serve_req.h"
#include "tools/tool_prefix.h"
#include "tools/serve_tools.h"

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
    mf_lp_list lp;             /* logprobs: the prompt's entries (echo), then the generated tokens' */
    int64_t lp_offset;         /* stream: text_offset of the next completions entry */
    int n_lp_sent, echo_sent;  /* stream: entries and the echo chunk sent */
    size_t n_content_sent;     /* stream with tools: bytes of text sent as content */
    int called;                /* the answer parsed as tool calls (finish_reason tool_calls) */
} mf_choice;

struct mf_job {
    pthread_mutex_t mu;
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
    uint64_t seed;             /* choice i samples with seed + i (drawn when the request gave none) */
    struct MHD_Connection *conn;   /* parked: the suspended connection the events resume */
    int parked;                /* the connection waits for news of this job (suspended) */
    int fd;                    /* the connection's socket (the tick's hang-up check) */
    int cut;                   /* cancelled by the server (drain deadline): streams end with an error */
    struct mf_job *prev, *next;   /* the server's list of live jobs */
    mf_serve_req q;            /* the request (owned: its grammar outlives the batcher's use, its tools the parse) */
    int32_t *prompt;           /* echo: the prompt's ids */
    int tools_on;              /* chat with tools: the answer is parsed for calls */
};

static void mf_job_unref(mf_job *j)
{
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left) return;
    pthread_mutex_destroy(&j->mu);
    free(j->text);
    for (int i = 0; i < j->n_ch; i++) {
        free(j->ch[i].text);
        free(j->ch[i].toks);
        mf_lp_free(&j->ch[i].lp);
    }
    free(j->ch);
    mf_serve_req_clear(&j->q);
    free(j->prompt);
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

/* finish_reason: "error" for a choice the server cut (an engine error, the drain deadline). */
static const char *mf_finish_openai(int f)
{
    return f == MF_BATCH_LENGTH ? "length" : f == MF_BATCH_ERROR || f == MF_BATCH_CANCELLED ? "error" : "stop";
}

/* One server-sent event: "data: <json>\n\n" appended to the job's unsent bytes. */
static void mf_sse_add(mf_job *j, json_t *o)
{
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    if (!s) return;
    mf_srv_buf_add(&j->text, &j->n_text, &j->cap_text, "data: ", 6);
    mf_srv_buf_add(&j->text, &j->n_text, &j->cap_text, s, strlen(s));
    mf_srv_buf_add(&j->text, &j->n_text, &j->cap_text, "\n\n", 2);
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
    json_object_set_new(ch, "finish_reason", !finish ? json_null() : json_string(c->called ? "tool_calls"
                                                                                        : mf_finish_openai(c->finish)));
    json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", j->rid, "object",
                          j->chat ? "chat.completion.chunk" : "text_completion", "created", (json_int_t)j->created,
                          "model", v->model, "choices", ch);
    json_object_set_new(o, "seed", json_integer((json_int_t)j->seed));   /* moeflow's addition */
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

/* ---- logprobs, echo and tool calls in responses (docs/serve.md; issue 32) ---------------------- */

/* The echoed prompt's text: the prompt as given, or its ids decoded. malloc'ed; NULL: none. */
static char *mf_srv_echo_text(const mf_srv *v, const mf_job *j, size_t *n)
{
    *n = 0;
    if (j->q.prompt) {
        *n = strlen(j->q.prompt);
        return strdup(j->q.prompt);
    }
    size_t need = 0;
    if (!v->tok || !j->prompt) return NULL;
    mf_tok_decode(v->tok, j->prompt, (size_t)j->n_prompt, 0, NULL, 0, &need);
    char *t = malloc(need + 1);
    if (t && mf_tok_decode(v->tok, j->prompt, (size_t)j->n_prompt, 0, t, need + 1, n)) *n = 0;
    return t;
}

/* The logprobs object of c's entries [from, to) for a response or chunk. */
static json_t *mf_srv_logprobs(const mf_srv *v, const mf_job *j, mf_choice *c, int from, int to)
{
    if (!j->q.logprobs) return json_null();
    if (j->chat) return mf_lp_chat(v->tok, c->lp.e + from, to - from);
    return mf_lp_completion(v->tok, c->lp.e + from, to - from, &c->lp_offset);
}

/* OpenAI tool_calls of parsed calls (stream: with their index). */
static json_t *mf_srv_calls_json(const mf_job *j, const mf_choice *c, const mf_tool_calls *tc, int stream)
{
    json_t *a = json_array();
    for (int k = 0; k < tc->n; k++) {
        char id[96];
        snprintf(id, sizeof id, "call_%s_%d_%d", j->rid, c->index, k);
        json_t *o = json_pack("{s:s, s:s, s:{s:s, s:s}}", "id", id, "type", "function", "function", "name",
                              tc->calls[k].name, "arguments", tc->calls[k].args);
        if (stream) json_object_set_new(o, "index", json_integer(k));
        json_array_append_new(a, o);
    }
    return a;
}

/* A finished chat choice's message: its text, or with tools its parsed calls (content null when
 * none came before them). */
static json_t *mf_srv_message(mf_job *j, mf_choice *x)
{
    mf_tool_calls tc;
    const char *t = x->text ? x->text : "";
    if (j->tools_on && mf_serve_tools_parse(&j->q, t, x->n_text, &tc) == 1) {
        x->called = 1;
        json_t *m = json_pack("{s:s, s:o, s:o}", "role", "assistant", "content",
                              tc.n_content ? mf_json_text(tc.content, tc.n_content) : json_null(), "tool_calls",
                              mf_srv_calls_json(j, x, &tc, 0));
        mf_tool_calls_clear(&tc);
        return m;
    }
    return json_pack("{s:s, s:o}", "role", "assistant", "content", mf_json_text(t, x->n_text));
}

/* A finished completions choice's text: with echo, the prompt first. */
static json_t *mf_srv_text(const mf_srv *v, const mf_job *j, const mf_choice *x)
{
    size_t n = 0;
    char *p = j->q.echo ? mf_srv_echo_text(v, j, &n) : NULL;
    char *all = malloc(n + x->n_text + 1);
    if (!all) {
        free(p);
        return json_string("");
    }
    if (n) memcpy(all, p, n);
    if (x->n_text) memcpy(all + n, x->text, x->n_text);
    json_t *o = mf_json_text(all, n + x->n_text);
    free(all);
    free(p);
    return o;
}

/* Stream: the event's text (with tools, only what is surely content; the echo first) and its
 * token's logprobs, as a chunk. */
static void mf_srv_stream_text(const mf_srv *v, mf_job *j, mf_choice *c, const mf_batch_event *ev)
{
    if (j->q.echo && !c->echo_sent) {   /* completions: the prompt (and its logprobs) first */
        size_t n = 0;
        char *t = mf_srv_echo_text(v, j, &n);
        json_t *o = mf_chunk(v, j, c, t ? t : "", n, 0);
        int np = j->q.logprobs ? (c->lp.n < j->n_prompt ? c->lp.n : j->n_prompt) : 0;
        json_object_set_new(json_array_get(json_object_get(o, "choices"), 0), "logprobs", mf_srv_logprobs(v, j, c, 0, np));
        mf_sse_add(j, o);
        free(t);
        c->echo_sent = 1;
        c->n_lp_sent = np;
    }
    const char *text = ev->text;
    size_t n = ev->n_text;
    if (j->tools_on) {   /* a call's opening may be on its way: hold back what could begin it */
        mf_srv_buf_add(&c->text, &c->n_text, &c->cap_text, ev->text ? ev->text : "", ev->n_text);
        size_t safe = c->called ? c->n_content_sent : mf_serve_tools_content_len(c->text, c->n_text);
        text = c->text + c->n_content_sent;
        n = safe > c->n_content_sent ? safe - c->n_content_sent : 0;
        c->n_content_sent += n;
    }
    if (ev->kind != MF_BATCH_TOKEN && !n && c->n_lp_sent == c->lp.n) return;
    json_t *o = mf_chunk(v, j, c, text ? text : "", n, 0), *ch = json_array_get(json_object_get(o, "choices"), 0);
    if (ev->kind == MF_BATCH_TOKEN)   /* a chunk per token, with its id (moeflow's addition) */
        json_object_set_new(ch, "tokens", json_pack("[i]", ev->token));
    if (j->q.logprobs) {
        json_object_set_new(ch, "logprobs", mf_srv_logprobs(v, j, c, c->n_lp_sent, c->lp.n));
        c->n_lp_sent = c->lp.n;
    }
    mf_sse_add(j, o);
}

/* Stream, at a choice's end with tools: its calls as delta.tool_calls (chunk o), or the text held
 * back as content when it holds none or a malformed block. */
static void mf_srv_stream_calls(mf_job *j, mf_choice *c, json_t *o)
{
    mf_tool_calls tc;
    json_t *d = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "delta");
    json_object_del(d, "role");
    if (mf_serve_tools_parse(&j->q, c->text ? c->text : "", c->n_text, &tc) == 1) {
        c->called = 1;
        json_object_set_new(d, "tool_calls", mf_srv_calls_json(j, c, &tc, 1));
        mf_tool_calls_clear(&tc);
    } else if (c->n_text > c->n_content_sent) {
        json_object_set_new(d, "content", mf_json_text(c->text + c->n_content_sent, c->n_text - c->n_content_sent));
    } else {
        json_decref(o);
        return;
    }
    c->n_content_sent = c->n_text;
    mf_sse_add(j, o);
}

/* The batcher's events (on the stepping thread): ev->user is a choice. */
void mf_srv_on_event(void *user, const mf_batch_event *ev)
{
    mf_srv *v = user;
    mf_choice *c = ev->user;
    mf_job *j = c->j;
    if (ev->kind == MF_BATCH_PROMPT) {   /* echo: a prompt token's logprob */
        pthread_mutex_lock(&j->mu);
        mf_lp_add(&c->lp, ev->token, 1, ev->logprob, ev->top, ev->n_top);
        pthread_mutex_unlock(&j->mu);
        return;
    }
    pthread_mutex_lock(&v->mu);
    if (ev->kind == MF_BATCH_TOKEN) {
        v->gen_tokens++;
        if (ev->n_gen == 1) mf_srv_hist_add(&v->ttft, 0, (ev->now_ns - ev->submit_ns) / 1e9);
        else mf_srv_hist_add(&v->itl, 1, (ev->now_ns - c->last_ns) / 1e9);
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
    if (ev->has_logprob) mf_lp_add(&c->lp, ev->token, 1, ev->logprob, ev->top, ev->n_top);
    int last = ev->kind == MF_BATCH_DONE && j->n_done + 1 == j->n_ch;
    if (ev->kind == MF_BATCH_DONE) c->finish = ev->finish;
    if (ev->kind == MF_BATCH_DONE && ev->finish == MF_BATCH_ERROR && !j->failed) {
        j->failed = 1;
        j->err = ev->err;
        snprintf(j->msg, sizeof j->msg, "%s", ev->msg ? ev->msg : "the forward failed");
    }
    if (j->stream) {
        mf_srv_stream_text(v, j, c, ev);
        if (ev->kind == MF_BATCH_DONE) {
            /* the choice's end, usage with the last; a choice the server cut ends too
             * (finish_reason "error"), and the stream's error event comes before [DONE] */
            if (j->tools_on && ev->finish != MF_BATCH_CANCELLED && ev->finish != MF_BATCH_ERROR)
                mf_srv_stream_calls(j, c, mf_chunk(v, j, c, NULL, 0, 0));   /* its calls, or the text held back */
            if (ev->finish != MF_BATCH_CANCELLED || j->cut) {
                json_t *o = mf_chunk(v, j, c, NULL, 0, 1);
                if (last) json_object_set_new(o, "usage", mf_usage(j));
                mf_sse_add(j, o);
            }
            if (last && j->failed)
                mf_sse_add(j, mf_error_obj(j->msg, "server_error", NULL, NULL));
            else if (last && j->cut)
                mf_sse_add(j, mf_error_obj("the server is shutting down: the stream was cut at the drain deadline "
                                           "(--drain-timeout)", "server_error", NULL, "shutting_down"));
            if (last) mf_srv_buf_add(&j->text, &j->n_text, &j->cap_text, "data: [DONE]\n\n", 14);
        }
    } else if (ev->n_text) {
        mf_srv_buf_add(&c->text, &c->n_text, &c->cap_text, ev->text, ev->n_text);
    }
    if (ev->kind == MF_BATCH_DONE) {
        c->done = 1;
        j->n_done++;
        j->done = j->n_done == j->n_ch;
        j->cancelled |= ev->finish == MF_BATCH_CANCELLED;
    }
    if (j->parked && (j->stream || j->done)) {   /* the connection waiting for this news */
        j->parked = 0;
        MHD_resume_connection(j->conn);
    }
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
            mf_step_build_stats bst;
            mf_step_last_times(v->eng, &t);
            mf_step_builds(v->eng, &bst);
            pthread_mutex_lock(&v->mu);
            for (int p = 0; p < MF_STEP_N_PHASES; p++) v->phase_ns[p] += t.phase_ns[p];
            v->steps++;
            v->builds = bst;
            pthread_mutex_unlock(&v->mu);
        }
        if (n && v->spec) {   /* the metrics read the copy */
            mf_spec_stats st;
            mf_spec_get_stats(v->spec, &st);
            pthread_mutex_lock(&v->mu);
            v->spec_st = st;
            pthread_mutex_unlock(&v->mu);
        }
    }
    return NULL;
}

/* ---- HTTP ------------------------------------------------------------------------------------- */

typedef struct mf_conn mf_conn;

/* An endpoint (mf_routes, below). */
typedef struct mf_route {
    const char *path;
    int post;                  /* 1: POST; 0: GET and HEAD */
    int open;                  /* 1: no API key needed */
    enum MHD_Result (*fn)(mf_srv *v, struct MHD_Connection *c, mf_conn *cn);
} mf_route;

/* A request: made by the URI log callback (its request line is in), freed at its completion. */
struct mf_conn {
    char *body;
    size_t n, cap;
    int fd;                    /* the connection's socket (the door's records are by socket) */
    int seen;                  /* the handler has seen its head */
    int has_body, body_done;   /* Content-Length > 0 (or Transfer-Encoding); all of it read */
    const mf_route *route;
    mf_job *job;               /* a parked non-streamed request's job (the connection's reference) */
};

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

/* A refusal: counted under its code (reason "invalid" for 400s without one), the door told that the
 * request is answered, the error object queued (405: with Allow). The connection closes after it
 * when the request's body is left unread, or after a 408. */
static enum MHD_Result mf_srv_refuse(mf_srv *v, struct MHD_Connection *c, mf_conn *cn, unsigned status,
                                     const char *code, const char *msg, const char *param, const char *retry_after)
{
    mf_srv_refused(v, code ? code : "invalid");
    if (mf_door_request_read(v->door, cn->fd)) return MHD_NO;   /* the door has answered 408 */
    const char *type = status == 429 ? "rate_limit_error" : status >= 500 ? "server_error" : "invalid_request_error";
    json_t *o = mf_error_obj(msg, type, param, code);
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    struct MHD_Response *r = s ? MHD_create_response_from_buffer(strlen(s), s, MHD_RESPMEM_MUST_FREE) : NULL;
    if (!r) {
        free(s);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", "application/json");
    if (retry_after) MHD_add_response_header(r, "Retry-After", retry_after);
    if (status == 405) MHD_add_response_header(r, "Allow", cn->route && cn->route->post ? "POST" : "GET, HEAD");
    if (cn->has_body && !cn->body_done) mf_door_linger(v->door, cn->fd);   /* the client may be sending it */
    if (status == 408 || (cn->has_body && !cn->body_done)) MHD_add_response_header(r, "Connection", "close");
    enum MHD_Result ok = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ok;
}

typedef struct mf_stream {
    mf_srv *v;
    mf_job *j;
    struct MHD_Connection *c;
} mf_stream;

/* SSE body: the job's bytes not yet sent; with none, the connection parks (suspended) until the
 * job's next event resumes it, so no thread waits. */
static ssize_t mf_stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    mf_stream *s = cls;
    mf_job *j = s->j;
    (void)pos;
    pthread_mutex_lock(&j->mu);
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
    if (__atomic_load_n(&s->v->stopping, __ATOMIC_ACQUIRE)) {   /* the daemon stops: no waiting */
        pthread_mutex_unlock(&j->mu);
        return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    j->conn = s->c;
    j->parked = 1;
    MHD_suspend_connection(s->c);
    pthread_mutex_unlock(&j->mu);
    return 0;
}

static void mf_stream_free(void *cls)
{
    mf_stream *s = cls;
    pthread_mutex_lock(&s->j->mu);
    int done = s->j->done;
    s->j->conn = NULL;
    s->j->parked = 0;
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
static mf_job *mf_job_new(const mf_srv *v, mf_serve_req *q, int chat, const int32_t *ids, int n_ids)
{
    mf_job *j = calloc(1, sizeof *j);
    if (j) j->ch = calloc((size_t)q->n, sizeof *j->ch);
    if (j && q->echo) j->prompt = malloc(sizeof *j->prompt * (size_t)n_ids);
    if (!j || !j->ch || (q->echo && !j->prompt)) {
        if (j) free(j->ch);
        free(j);
        return NULL;
    }
    j->q = *q;   /* the job owns the request from here */
    memset(q, 0, sizeof *q);
    j->tools_on = chat && j->q.n_tools > 0;
    if (j->prompt) memcpy(j->prompt, ids, sizeof *ids * (size_t)n_ids);
    pthread_mutex_init(&j->mu, NULL);
    j->n_ch = j->q.n;
    for (int i = 0; i < j->q.n; i++) {
        j->ch[i] = (mf_choice){.j = j, .index = i};
        if (j->q.echo && j->q.logprobs) mf_lp_add(&j->ch[i].lp, ids[0], 0, 0, NULL, 0);   /* the first: null */
    }
    j->refs = 1 + j->q.n;
    j->chat = chat;
    j->stream = j->q.stream;
    j->n_prompt = n_ids;
    j->created = (int64_t)time(NULL);
    j->seed = j->q.seed;
    j->fd = -1;
    static uint64_t next_rid;
    snprintf(j->rid, sizeof j->rid, "%s-%" PRIu64, chat ? "chatcmpl" : "cmpl",
             __atomic_add_fetch(&next_rid, 1, __ATOMIC_RELAXED));
    for (int i = 0; j->stream && chat && i < j->q.n; i++)   /* each choice's role delta comes first */
        mf_sse_add(j, mf_chunk(v, j, &j->ch[i], NULL, 0, 0));
    return j;
}

/* Submits j's choices, choice i seeded seed + i; the job is listed before any can end (the last
 * DONE event unlinks it). *n_sub: how many went in before a refusal. 0 or the refusal's code. */
static int mf_srv_submit(mf_srv *v, mf_job *j, const int32_t *ids, int n_ids, int max_tokens, int *n_sub)
{
    const mf_serve_req *q = &j->q;
    int rc = 0, n = 0;
    mf_batch_bias *bias = q->n_bias ? malloc(sizeof *bias * (size_t)q->n_bias) : NULL;
    if (q->n_bias && !bias) return -ENOMEM;
    for (int i = 0; i < q->n_bias; i++) bias[i] = (mf_batch_bias){q->bias[i].id, q->bias[i].bias};
    pthread_mutex_lock(&v->mu);
    for (; n < q->n; n++) {
        mf_batch_req br = {.prompt = ids, .n_prompt = n_ids, .max_tokens = max_tokens, .temperature = q->temperature,
                           .top_p = q->top_p, .seed = q->seed + (uint64_t)n, .ignore_eos = q->ignore_eos,
                           .stop = (const char *const *)q->stop, .n_stop = q->n_stop, .user = &j->ch[n],
                           .top_k = q->top_k, .min_p = q->min_p, .presence_penalty = q->presence_penalty,
                           .frequency_penalty = q->frequency_penalty, .repetition_penalty = q->repetition_penalty,
                           .bias = bias, .n_bias = q->n_bias, .logprobs = q->logprobs, .top_logprobs = q->top_logprobs,
                           .echo_logprobs = q->echo && q->logprobs, .grammar = q->grammar};
        if ((rc = mf_batch_submit(v->b, &br, &j->ch[n].id))) break;
    }
    free(bias);
    j->n_live = n;
    if (n) {
        j->next = v->jobs;
        if (v->jobs) v->jobs->prev = j;
        v->jobs = j;
        v->prompt_tokens += (uint64_t)n_ids;
    }
    pthread_mutex_unlock(&v->mu);
    *n_sub = n;
    return rc;
}

/* The batcher refused choice n_sub (code rc): the ones submitted before it are cancelled (their
 * DONE events drop their refs), and the client gets 429, 503 or 400. */
static enum MHD_Result mf_srv_not_queued(mf_srv *v, struct MHD_Connection *c, mf_conn *cn, mf_job *j, int n_sub,
                                         int rc)
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
        return mf_srv_refuse(v, c, cn, 429, "queue_full", "the server's queue is full; retry later", NULL, "1");
    if (rc == -ESHUTDOWN)
        return mf_srv_refuse(v, c, cn, 503, "shutting_down", "the server is shutting down", NULL, "5");
    return mf_srv_refuse(v, c, cn, rc == -ENOMEM ? 500 : 400, rc == -ENOMEM ? "server_error" : NULL, m, NULL, NULL);
}

/* stream: true: server-sent events, drained from the job by mf_stream_read. */
static enum MHD_Result mf_srv_stream(mf_srv *v, struct MHD_Connection *c, mf_conn *cn, mf_job *j)
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
    pthread_mutex_lock(&j->mu);
    j->fd = cn->fd;
    pthread_mutex_unlock(&j->mu);
    MHD_add_response_header(r, "Content-Type", "text/event-stream");
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    enum MHD_Result ok = MHD_queue_response(c, MHD_HTTP_OK, r);
    MHD_destroy_response(r);
    return ok;
}

/* One JSON response from cn's ended job (the connection's reference released). A job that has not
 * ended (the daemon stops: mf_srv_unpark_all) is cancelled and answered 503. */
static enum MHD_Result mf_srv_answer(mf_srv *v, struct MHD_Connection *c, mf_conn *cn)
{
    mf_job *j = cn->job;
    cn->job = NULL;
    int chat = j->chat;
    pthread_mutex_lock(&j->mu);
    int done = j->done;
    pthread_mutex_unlock(&j->mu);
    if (!done) {
        mf_job_cancel(v->b, j);
        mf_job_unref(j);
        return mf_srv_refuse(v, c, cn, 503, "shutting_down", "the server is shutting down", NULL, "5");
    }
    enum MHD_Result ok;
    if (j->failed || j->cancelled) {
        ok = j->failed ? mf_send_error(c, 500, j->msg, "server_error", NULL, NULL, NULL)
             : j->cut ? mf_send_error(c, 503, "the server is shutting down: the request was cancelled at the drain "
                                      "deadline (--drain-timeout)", "server_error", NULL, "shutting_down", "5")
                      : mf_send_error(c, 503, "the request was cancelled", "server_error", NULL, "cancelled", NULL);
    } else {
        json_t *chs = json_array();
        for (int i = 0; i < j->n_ch; i++) {
            mf_choice *x = &j->ch[i];
            json_t *ch = json_object(), *toks = json_array();
            for (int k = 0; k < x->n_toks; k++) json_array_append_new(toks, json_integer(x->toks[k]));
            json_object_set_new(ch, "index", json_integer(i));
            if (chat)
                json_object_set_new(ch, "message", mf_srv_message(j, x));
            else
                json_object_set_new(ch, "text", mf_srv_text(v, j, x));
            json_object_set_new(ch, "logprobs", mf_srv_logprobs(v, j, x, 0, x->lp.n));
            json_object_set_new(ch, "finish_reason", json_string(x->called ? "tool_calls" : mf_finish_openai(x->finish)));
            json_object_set_new(ch, "tokens", toks);   /* moeflow's addition: the generated token ids */
            json_array_append_new(chs, ch);
        }
        json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:o, s:o}", "id", j->rid, "object",
                              chat ? "chat.completion" : "text_completion", "created", (json_int_t)j->created, "model",
                              v->model, "choices", chs, "usage", mf_usage(j));
        json_object_set_new(o, "seed", json_integer((json_int_t)j->seed));   /* moeflow's addition */
        ok = mf_send_json(c, 200, o, NULL);
    }
    mf_job_unref(j);
    return ok;
}

/* A non-streamed request: answered once its job has ended. Till then the connection parks
 * (suspended); the job's last event resumes it, and mf_srv_handle answers then. */
static enum MHD_Result mf_srv_park(mf_srv *v, struct MHD_Connection *c, mf_conn *cn, mf_job *j)
{
    cn->job = j;
    pthread_mutex_lock(&j->mu);
    if (!j->done) {
        j->conn = c;
        j->fd = cn->fd;
        j->parked = 1;
        MHD_suspend_connection(c);
        pthread_mutex_unlock(&j->mu);
        return MHD_YES;
    }
    pthread_mutex_unlock(&j->mu);
    return mf_srv_answer(v, c, cn);
}

/* A seed for a request that gave none: 53 random bits (exact as a JSON number in any client). */
static uint64_t mf_srv_fresh_seed(void)
{
    uint64_t x = 0;
    if (getrandom(&x, sizeof x, GRND_NONBLOCK) != (ssize_t)sizeof x)
        x = (uint64_t)mf_now_ns() * UINT64_C(0x9E3779B97F4A7C15) ^ (uint64_t)getpid();
    return x & ((UINT64_C(1) << 53) - 1);
}

/* POST /v1/completions or /v1/chat/completions: the body parsed and checked, its prompt encoded
 * and fitted to the context, a job submitted (seeded with the request's seed or a fresh one), then
 * streamed or parked until answered once. */
static enum MHD_Result mf_srv_complete(mf_srv *v, struct MHD_Connection *c, mf_conn *cn, int chat)
{
    mf_serve_req q;
    mf_serve_err e;
    int rc = mf_serve_req_parse(cn->body ? cn->body : "", cn->n, chat, &q, &e);
    if (rc) return mf_srv_refuse(v, c, cn, rc == -ENOMEM ? 500 : 400, rc == -ENOMEM ? "server_error" : NULL, e.message,
                                 e.param, NULL);
    if (!q.seed_given) q.seed = mf_srv_fresh_seed();
    int32_t *ids = NULL;
    int n_ids = 0;
    char why[600] = "";
    if ((rc = mf_srv_prompt(v, &q, &ids, &n_ids, why, sizeof why))) {
        mf_serve_req_clear(&q);
        return mf_srv_refuse(v, c, cn, rc == -ENOMEM ? 500 : 400, rc == -ENOMEM ? "server_error" : NULL,
                             why[0] ? why : "out of memory", chat ? "messages" : "prompt", NULL);
    }
    int64_t room = v->max_context - n_ids;
    int max_tokens = q.max_tokens >= 0 ? q.max_tokens : chat ? (int)(room > 0 ? room : 0) : 16;
    if (n_ids + (int64_t)max_tokens > v->max_context) {
        snprintf(why, sizeof why, "this model's context is %" PRId64 " tokens; the prompt has %d and max_tokens asks "
                 "for %d more", v->max_context, n_ids, max_tokens);
        free(ids);
        mf_serve_req_clear(&q);
        return mf_srv_refuse(v, c, cn, 400, "context_length_exceeded", why, chat ? "messages" : "prompt", NULL);
    }
    for (int i = 0; i < q.n_bias; i++)
        if (q.bias[i].id >= v->c->vocab_size) {
            snprintf(why, sizeof why, "'logit_bias' names token %d, outside the vocabulary of %" PRId64 " tokens",
                     q.bias[i].id, v->c->vocab_size);
            free(ids);
            mf_serve_req_clear(&q);
            return mf_send_error(c, 400, why, "invalid_request_error", "logit_bias", NULL, NULL);
        }
    if (q.grammar && !v->gram_vocab) {
        free(ids);
        mf_serve_req_clear(&q);
        return mf_send_error(c, 400, "constrained output (response_format, a required tool call) needs the checkpoint's "
                             "tokenizer.json", "invalid_request_error", "response_format", NULL, NULL);
    }
    mf_job *j = mf_job_new(v, &q, chat, ids, n_ids);   /* takes q */
    int n_sub = 0;
    rc = j ? mf_srv_submit(v, j, ids, n_ids, max_tokens, &n_sub) : 0;
    free(ids);
    mf_serve_req_clear(&q);
    if (!j) return MHD_NO;
    if (rc) return mf_srv_not_queued(v, c, cn, j, n_sub, rc);
    return j->stream ? mf_srv_stream(v, c, cn, j) : mf_srv_park(v, c, cn, j);
}

static enum MHD_Result mf_srv_health(mf_srv *v, struct MHD_Connection *c, mf_conn *cn)
{
    (void)cn;
    pthread_mutex_lock(&v->mu);
    int dr = v->draining;
    pthread_mutex_unlock(&v->mu);
    char *b = strdup(dr ? "{\"status\":\"shutting down\"}" : "{\"status\":\"ok\"}");
    return b ? mf_send(c, dr ? 503 : 200, "application/json", b, strlen(b), dr ? "5" : NULL) : MHD_NO;
}

static enum MHD_Result mf_srv_models(mf_srv *v, struct MHD_Connection *c, mf_conn *cn)
{
    (void)cn;
    json_t *o = json_pack("{s:s, s:[{s:s, s:s, s:i, s:s, s:I}]}", "object", "list", "data", "id", v->model, "object",
                          "model", "created", 0, "owned_by", "moeflow", "max_context", (json_int_t)v->max_context);
    return mf_send_json(c, 200, o, NULL);
}

static enum MHD_Result mf_srv_metrics_get(mf_srv *v, struct MHD_Connection *c, mf_conn *cn)
{
    (void)cn;
    size_t n = 0;
    char *s = mf_srv_metrics_text(v, &n);
    return s ? mf_send(c, 200, "text/plain; version=0.0.4", s, n, NULL) : MHD_NO;
}

static enum MHD_Result mf_srv_completions(mf_srv *v, struct MHD_Connection *c, mf_conn *cn)
{
    return mf_srv_complete(v, c, cn, 0);
}

static enum MHD_Result mf_srv_chat(mf_srv *v, struct MHD_Connection *c, mf_conn *cn)
{
    return mf_srv_complete(v, c, cn, 1);
}

/* The endpoints: a path matched exactly (the raw path: no percent-decoding), its method (GET
 * routes answer HEAD too: libmicrohttpd sends the headers only), whether it needs the API key. */
static const mf_route mf_routes[] = {
    {"/v1/completions", 1, 0, mf_srv_completions},
    {"/v1/chat/completions", 1, 0, mf_srv_chat},
    {"/v1/models", 0, 0, mf_srv_models},
    {"/health", 0, 1, mf_srv_health},
    {"/metrics", 0, 0, mf_srv_metrics_get},
};

/* `Authorization: Bearer KEY` (the scheme in any case, RFC 9110) with the server's key, compared in
 * time that depends on the key's length only. */
static int mf_srv_key_ok(const mf_srv *v, struct MHD_Connection *c)
{
    const char *a = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (!a || strncasecmp(a, "Bearer", 6) || (a[6] != ' ' && a[6] != '\t')) return 0;
    for (a += 6; *a == ' ' || *a == '\t'; a++) {}
    size_t n = strlen(a), k = strlen(v->api_key);
    while (n && (a[n - 1] == ' ' || a[n - 1] == '\t')) n--;
    unsigned d = n != k;
    for (size_t i = 0; i < k; i++) d |= (unsigned char)v->api_key[i] ^ (unsigned char)(i < n ? a[i] : 0);
    return d == 0;
}

/* The handler's first call for a request: its head is in, no byte of its body read. Everything a
 * head decides is refused here, so a refused body is never read: past its deadline (408), the
 * door's limits (414, 431: a kept-alive connection's later heads come to libmicrohttpd
 * directly), the path (404) and method (405), Transfer-Encoding (with Content-Length: 400, request
 * smuggling; alone: 411), the API key (401), Content-Length past --max-body (413). */
static enum MHD_Result mf_srv_head_in(mf_srv *v, struct MHD_Connection *c, mf_conn *cn, const char *url,
                                      const char *method)
{
    cn->seen = 1;
    const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    const char *te = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_TRANSFER_ENCODING);
    cn->has_body = te || (cl && strspn(cl, "0") != strlen(cl));
    char m[300];
    if (mf_door_request_late(v->door, cn->fd)) {
        snprintf(m, sizeof m, "the request's head did not arrive within its time (--request-timeout)");
        return mf_srv_refuse(v, c, cn, 408, "request_timeout", m, NULL, NULL);
    }
    const union MHD_ConnectionInfo *hs = MHD_get_connection_info(c, MHD_CONNECTION_INFO_REQUEST_HEADER_SIZE);
    if (strlen(url) > MF_HTTP_MAX_TARGET) {
        snprintf(m, sizeof m, "the request target is longer than %d bytes", MF_HTTP_MAX_TARGET);
        return mf_srv_refuse(v, c, cn, 414, "uri_too_long", m, NULL, NULL);
    }
    if ((hs && hs->header_size > MF_HTTP_MAX_HEAD) ||
        MHD_get_connection_values(c, MHD_HEADER_KIND, NULL, NULL) > MF_HTTP_MAX_FIELDS) {
        snprintf(m, sizeof m, "the request head is larger than %d bytes or has more than %d header fields",
                 MF_HTTP_MAX_HEAD, MF_HTTP_MAX_FIELDS);
        return mf_srv_refuse(v, c, cn, 431, "header_too_large", m, NULL, NULL);
    }
    for (size_t k = 0; k < sizeof mf_routes / sizeof *mf_routes; k++)
        if (!strcmp(url, mf_routes[k].path)) cn->route = &mf_routes[k];
    const mf_route *r = cn->route;
    if (!r) {
        snprintf(m, sizeof m, "no endpoint %.20s %.200s", method, url);
        return mf_srv_refuse(v, c, cn, 404, "not_found", m, NULL, NULL);
    }
    int get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    if (r->post ? strcmp(method, "POST") != 0 : !get) {
        snprintf(m, sizeof m, "%s takes %s, not %.20s", r->path, r->post ? "POST" : "GET (or HEAD)", method);
        return mf_srv_refuse(v, c, cn, 405, "method_not_allowed", m, NULL, NULL);
    }
    if (te && cl)
        return mf_srv_refuse(v, c, cn, 400, "bad_request", "both Content-Length and Transfer-Encoding are given "
                             "(refused: request smuggling)", NULL, NULL);
    if (te)
        return mf_srv_refuse(v, c, cn, 411, "length_required", "a request body needs Content-Length (chunked uploads "
                             "are not accepted)", NULL, NULL);
    if (!r->open && v->api_key && !mf_srv_key_ok(v, c))
        return mf_srv_refuse(v, c, cn, 401, "invalid_api_key", "a valid API key is required (Authorization: Bearer "
                             "KEY)", NULL, NULL);
    unsigned long long n = cl ? strtoull(cl, NULL, 10) : 0;
    if (n > v->max_body) {
        snprintf(m, sizeof m, "the request body is larger than %zu bytes (--max-body)", v->max_body);
        return mf_srv_refuse(v, c, cn, 413, "body_too_large", m, NULL, NULL);
    }
    return MHD_YES;
}

enum MHD_Result mf_srv_handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                              const char *version, const char *upload, size_t *upload_size, void **ctx)
{
    mf_srv *v = cls;
    (void)version;
    mf_conn *cn = *ctx;
    if (!cn) return MHD_NO;   /* the URI log callback ran out of memory */
    if (!cn->seen) return mf_srv_head_in(v, c, cn, url, method);
    if (*upload_size) {   /* body bytes: at most Content-Length, which is at most --max-body */
        /* past its deadline the body is dropped: libmicrohttpd takes no answer while a body
         * arrives, so the door answers 408 and shuts the connection (mf_door_sweep) */
        if (!mf_door_request_late(v->door, cn->fd) &&
            (cn->n + *upload_size > v->max_body || mf_srv_buf_add(&cn->body, &cn->n, &cn->cap, upload, *upload_size)))
            return MHD_NO;
        *upload_size = 0;
        return MHD_YES;
    }
    cn->body_done = 1;
    if (cn->job) return mf_srv_answer(v, c, cn);   /* resumed: its job has ended */
    if (mf_door_request_read(v->door, cn->fd)) return MHD_NO;   /* the door has answered 408 */
    return cn->route->fn(v, c, cn);
}

/* The socket of connection c, or -1. */
static int mf_srv_fd(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
}

void *mf_srv_uri_log(void *cls, const char *uri, struct MHD_Connection *c)
{
    mf_srv *v = cls;
    (void)uri;
    mf_conn *cn = calloc(1, sizeof *cn);
    if (!cn) return NULL;
    cn->fd = mf_srv_fd(c);
    mf_door_request_line(v->door, cn->fd);
    pthread_mutex_lock(&v->mu);
    v->n_inflight++;
    pthread_mutex_unlock(&v->mu);
    return cn;
}

void mf_srv_done(void *cls, struct MHD_Connection *c, void **ctx, enum MHD_RequestTerminationCode t)
{
    mf_srv *v = cls;
    (void)t;
    mf_conn *cn = *ctx;
    *ctx = NULL;
    if (!cn) return;
    mf_door_request_done(v->door, cn->fd);
    if (cn->job) {   /* closed before its answer: the job is given up */
        mf_job *j = cn->job;
        pthread_mutex_lock(&j->mu);
        int done = j->done;
        if (j->conn == c) j->conn = NULL, j->parked = 0;
        pthread_mutex_unlock(&j->mu);
        if (!done) mf_job_cancel(v->b, j);
        mf_job_unref(j);
    }
    free(cn->body);
    free(cn);
    pthread_mutex_lock(&v->mu);
    v->n_inflight--;
    pthread_mutex_unlock(&v->mu);
}

void mf_srv_conn_notify(void *cls, struct MHD_Connection *c, void **socket_ctx, enum MHD_ConnectionNotificationCode t)
{
    mf_srv *v = cls;
    (void)socket_ctx;
    if (t == MHD_CONNECTION_NOTIFY_CLOSED) mf_door_conn_closed(v->door, mf_srv_fd(c));
}

size_t mf_srv_unescape(void *cls, struct MHD_Connection *c, char *uri)
{
    (void)cls, (void)c;
    return strlen(uri);
}

void mf_srv_log(void *cls, const char *fmt, va_list ap)
{
    mf_srv *v = cls;
    if (v->quiet) return;
    char m[512];
    vsnprintf(m, sizeof m, fmt, ap);
    size_t n = strlen(m);
    while (n && m[n - 1] == '\n') m[--n] = 0;
    fprintf(stderr, "moeflow serve: http: %s\n", m);
}

void mf_srv_tick(void *user)
{
    enum { MAX = 4096 };
    static mf_job *js[MAX];   /* the door's thread only */
    static struct pollfd pf[MAX];
    mf_srv *v = user;
    int n = 0;
    pthread_mutex_lock(&v->mu);
    for (mf_job *j = v->jobs; j && n < MAX; j = j->next) {
        pthread_mutex_lock(&j->mu);
        if (j->parked && j->fd >= 0) {
            j->refs++;
            js[n] = j;
            pf[n++] = (struct pollfd){.fd = j->fd};   /* events 0: hang-up and errors only */
        }
        pthread_mutex_unlock(&j->mu);
    }
    pthread_mutex_unlock(&v->mu);
    if (n && poll(pf, (nfds_t)n, 0) > 0)
        for (int i = 0; i < n; i++)
            if (pf[i].revents & (POLLHUP | POLLERR)) mf_job_cancel(v->b, js[i]);
    for (int i = 0; i < n; i++) mf_job_unref(js[i]);
}

int mf_srv_cancel_all(mf_srv *v)
{
    pthread_mutex_lock(&v->mu);
    int n = 0;
    for (mf_job *j = v->jobs; j; j = j->next) n += j->n_ch;
    uint64_t *ids = calloc((size_t)n + 1, sizeof *ids);
    n = 0;
    for (mf_job *j = v->jobs; j && ids; j = j->next) {
        pthread_mutex_lock(&j->mu);
        j->cut = 1;
        pthread_mutex_unlock(&j->mu);
        for (int i = 0; i < j->n_ch; i++) ids[n++] = j->ch[i].id;   /* ended ones: cancel finds nothing */
    }
    pthread_mutex_unlock(&v->mu);
    for (int i = 0; i < n; i++) mf_batch_cancel(v->b, ids[i]);
    free(ids);
    return n;
}

void mf_srv_unpark_all(mf_srv *v)
{
    __atomic_store_n(&v->stopping, 1, __ATOMIC_RELEASE);
    pthread_mutex_lock(&v->mu);
    for (mf_job *j = v->jobs; j; j = j->next) {
        pthread_mutex_lock(&j->mu);
        if (j->parked) {
            j->parked = 0;
            MHD_resume_connection(j->conn);
        }
        pthread_mutex_unlock(&j->mu);
    }
    pthread_mutex_unlock(&v->mu);
}
