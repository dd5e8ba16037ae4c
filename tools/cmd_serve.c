/* `moeflow serve`: an OpenAI-compatible HTTP API over continuous batching (docs/serve.md). This
 * file is the command: its options (the API key from a flag, a file or MOEFLOW_API_KEY), opening
 * the model, engine and batcher, listening (the front door, tools/serve_door.c, hands connections
 * to libmicrohttpd), and the drain at SIGTERM/SIGINT; the server's handlers, jobs and metrics are
 * tools/serve_http.c. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <malloc.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "graphs/model/engram_map.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/batch.h"
#include "graphs/step/step.h"
#include "host/tokenizer.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "tools/commands.h"
#include "tools/engine_opts.h"
#include "tools/ranks.h"
#include "tools/serve_door.h"
#include "tools/serve_http.h"
#include "tools/serve_req.h"
#include "tools/sim_common.h"
#include "tools/tool_prefix.h"

/* The command line of `moeflow serve`; the engine and model options are the group serve shares
 * with decode (tools/engine_opts.h). */
typedef struct mf_serve_cli {
    const char *dir, *host, *api_key, *key_file, *model_name, *chat_spec;
    int quiet;
    long port, max_batch, step_tokens, max_queue, max_context, timeout, request_timeout, drain;
    long max_conns, max_per_addr;
    uint64_t budget, max_body;
    int spec;                  /* --spec: MF_TOOL_SPEC_OFF or _DSPARK */
    long spec_tokens;          /* 0: auto */
    mf_tool_engine e;
    mf_tool_ranks rk;          /* --ranks-layers ...: rank 0 serves, the others run their layers (e.rk points here) */
    mf_tool_prefix pfx;        /* --prefix-cache and its kin */
} mf_serve_cli;

#define F(x) offsetof(mf_serve_cli, x)
static const mf_opt mf_serve_table[] = {
    {"--checkpoint", .kind = MF_OPT_STR, .off = F(dir), .meta = "DIR",
     .help = "config.json + safetensors (+ tokenizer.json for text)"},
    {"--host", .kind = MF_OPT_STR, .off = F(host), .def = "127.0.0.1", .meta = "ADDR",
     .help = "IPv4 address to bind (localhost: 127.0.0.1; the default is\nloopback only)"},
    {"--port", .kind = MF_OPT_LONG, .off = F(port), .def = "8000", .meta = "N", .lo = 0, .hi = 65535,
     .help = "TCP port (0: a free one, printed at start)"},
    {"--max-batch", .kind = MF_OPT_LONG, .off = F(max_batch), .def = "16", .meta = "N", .lo = 1, .hi = MF_STEP_MAX_ITEMS,
     .help = "running sequences, 1.." MF_OPTS_STR(MF_STEP_MAX_ITEMS)},
    {"--step-tokens", .kind = MF_OPT_LONG, .off = F(step_tokens), .meta = "N", .lo = 1, .hi = 65536,
     .help = "items per step: decode tokens, then prefill chunks (default 2 x\n"
             "--max-batch, at least " MF_OPTS_STR(MF_BATCH_STEP_TOKENS) ", at most " MF_OPTS_STR(MF_STEP_MAX_ITEMS) ")"},
    {"--state-budget", .kind = MF_OPT_SIZE, .off = F(budget), .meta = "SIZE",
     .help = "bytes for all sequence states, e.g. 2G (default: max-batch states)"},
    {"--max-queue", .kind = MF_OPT_LONG, .off = F(max_queue), .def = "256", .meta = "N", .lo = 1, .hi = 1 << 20,
     .help = "waiting requests; more get 429 with Retry-After"},
    {"--api-key", .kind = MF_OPT_STR, .off = F(api_key), .meta = "KEY",
     .help = "every request but /health needs 'Authorization: Bearer KEY' (the\n"
             "command line is visible to other users: prefer --api-key-file or\n"
             "the environment variable MOEFLOW_API_KEY)"},
    {"--api-key-file", .kind = MF_OPT_STR, .off = F(key_file), .meta = "FILE",
     .help = "the API key is FILE's first line"},
    {"--max-context", .kind = MF_OPT_LONG, .off = F(max_context), .meta = "N", .lo = 2, .hi = 1L << 30,
     .help = "positions per sequence: prompt + max_tokens (default min(model, 4096))"},
    {"--model-name", .kind = MF_OPT_STR, .off = F(model_name), .meta = "NAME",
     .help = "the model id in responses and /v1/models (default: DIR's name)"},
    {"--max-body", .kind = MF_OPT_SIZE, .off = F(max_body), .def = "1M", .meta = "SIZE",
     .help = "largest request body; larger: 413"},
    {"--timeout", .kind = MF_OPT_LONG, .off = F(timeout), .def = "30", .meta = "S", .lo = 1, .hi = 86400,
     .help = "close a kept-alive connection that begins no request for S\nseconds, or a client that takes no "
             "answer bytes for S + 1\nseconds"},
    {"--request-timeout", .kind = MF_OPT_LONG, .off = F(request_timeout), .def = "10", .meta = "S", .lo = 1,
     .hi = 86400, .help = "a request's head and body must arrive within S seconds of its\nstart; slower: 408, closed"},
    {"--max-connections", .kind = MF_OPT_LONG, .off = F(max_conns), .def = "4096", .meta = "N", .lo = 1,
     .hi = 1 << 20, .help = "open connections in all; more: 503 at once (the open files limit\nis raised to fit "
                            "them where it can)"},
    {"--max-connections-per-addr", .kind = MF_OPT_LONG, .off = F(max_per_addr), .def = "256", .meta = "N",
     .lo = 0, .hi = 1 << 20, .help = "open connections of one client address (0: no limit); more: 429"},
    {"--drain-timeout", .kind = MF_OPT_LONG, .off = F(drain), .def = "10", .meta = "S", .lo = 0, .hi = 86400,
     .help = "on SIGTERM/SIGINT, seconds to let running requests finish"},
    {"--chat-template", .kind = MF_OPT_STR, .off = F(chat_spec), .meta = "T",
     .help = "the chat template: DIR/tokenizer_config.json's chat_template by default\n"
             "(Jinja2, the subset of docs/serve.md; the built-in DeepSeek-V3 format\n"
             "without one), FILE (a template, or a tokenizer_config.json), builtin,\n"
             "or deepseek-v4 (DeepSeek-V4's encoding with tools, as `moeflow gen` writes)"},
    {"--spec", .kind = MF_OPT_WORD, .off = F(spec), .def = "off", .meta = "S", .words = mf_tool_specs,
     .help = "dspark: speculative decoding with the checkpoint's DSpark draft\n"
             "(see moeflow decode --help); its counters in /metrics\n"
             "(moeflow_spec_*); off: none"},
    {"--spec-tokens", .kind = MF_OPT_FN, .off = F(spec_tokens), .def = "auto", .meta = "N|auto",
     .fn = mf_tool_spec_tokens_opt, .example = "auto",
     .help = "with --spec: N candidates every round, or auto (the cost model's\nk per round and sequence)"},
    MF_TOOL_RANKS_ROWS(F(rk)),
    MF_TOOL_PREFIX_OPTS(F, pfx),
    {"--quiet", "-q", MF_OPT_FLAG, F(quiet), .help = "no log lines on stderr"},
    MF_OPT_GROUP_ROW(mf_tool_engine_table, F(e)),
    {NULL},
};
#undef F

static const mf_opts_spec mf_serve_spec = {
    .cmd = "serve",
    .usage = "usage: moeflow serve --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--max-batch N]\n"
             "                     [--step-tokens N] [--state-budget BYTES] [--max-queue N] [--api-key KEY]\n"
             "                     [--max-context N] [--model-name NAME] [--max-body BYTES] [--timeout S]\n"
             "                     [--drain-timeout S] [--request-timeout S] [--max-connections N]\n"
             "                     [--max-connections-per-addr N] [--api-key-file FILE]\n"
             "                     [--chat-template FILE|builtin|deepseek-v4] [--prefix-cache SIZE]\n"
             "                     [--prefix-cache-dir DIR] [--prefix-block N] [--quiet]\n"
             "                     [--spec dspark [--spec-tokens N|auto]]\n"
             "                     [--ranks-layers auto|a:b,c:d [--ranks-micro M] [--ranks-timeout S]]\n"
             MF_TOOL_ENGINE_USAGE "\n"
             "Serves an OpenAI-compatible HTTP API over the continuous batcher (docs/serve.md):\n"
             "POST /v1/completions, POST /v1/chat/completions (stream: true for server-sent events),\n"
             "GET /v1/models, /health, /metrics (Prometheus text). SIGTERM or SIGINT stop accepting,\n"
             "let running requests finish for --drain-timeout seconds, cancel the rest (a stream so\n"
             "cut ends with finish_reason \"error\" and an error event), and exit 0. Without --api-key\n"
             "or --api-key-file, the environment variable MOEFLOW_API_KEY is the key when set.\n"
             "The engine and model options are decode's (the same table): the weights are mapped\n"
             "from the page cache by default, so a restart on a warm machine reads nothing from\n"
             "the disk (docs/io.md).\n\n",
    .opts = mf_serve_table,
    .col = 23,
};

/* What the command opens around the server. */
typedef struct mf_serve {
    const mf_serve_cli *a;
    mf_srv *v;
    mf_tool_run x;             /* the model and engine (tools/engine_opts.h) */
    struct MHD_Daemon *d;
    mf_door *door;
    char *key;                 /* the API key (from --api-key, --api-key-file or MOEFLOW_API_KEY), or NULL */
    int stepper;               /* the stepping thread runs */
    char chat_desc[4400];
} mf_serve;

/* The tokenizer (when DIR has one), the chat template, the model and its Engram token map, the
 * reference and (scheduled) the engine, the batcher, the model's name. 0, a negative code or 2. */
static int mf_serve_open(mf_serve *s)
{
    const mf_serve_cli *a = s->a;
    mf_srv *v = s->v;
    char tpath[4200];
    snprintf(tpath, sizeof tpath, "%s/tokenizer.json", a->dir);
    int rc = access(tpath, R_OK) == 0 ? mf_tok_load(tpath, &v->tok) : 0;
    if (rc) return rc;
    if (mf_chat_tmpl_load(a->dir, a->chat_spec, &v->chat, s->chat_desc, sizeof s->chat_desc)) {
        fprintf(stderr, "moeflow serve: %s\n(--chat-template builtin serves the built-in DeepSeek-V3 chat format instead)\n",
                mf_last_error());
        return 2;
    }
    mf_tool_engine e = a->e;   /* every step of the batcher one graph */
    e.max_items = mf_batch_step_items((int)a->max_batch, (int)a->step_tokens);
    if ((rc = mf_tool_run_open("serve", &e, a->dir, v->tok, (mf_ref_opts){0}, a->quiet, &s->x))) return rc;
    v->c = mf_model_config(s->x.m);
    v->eng = s->x.eng;
    if (a->rk.rank > 0) return 0;   /* a pipeline's later rank: its layers of rank 0's steps, no batcher or server */
    mf_tool_run_notes("serve", &a->e, &s->x, a->quiet);
    mf_pipe *pipe = a->rk.pipe;     /* a pipeline: rank 0's forwards run every rank's layers */
    if ((rc = mf_tool_run_spec(&e, &s->x, a->spec_tokens, (int)a->max_batch, 1024))) return rc;
    v->spec = s->x.spec;
    int64_t model_ctx = v->c->max_position_embeddings;
    v->max_context = a->max_context ? a->max_context : model_ctx < 4096 ? model_ctx : 4096;
    if (v->max_context > model_ctx) {
        fprintf(stderr, "moeflow serve: --max-context %ld is past the model's max_position_embeddings %" PRId64 "\n",
                a->max_context, model_ctx);
        return 2;
    }
    if ((rc = mf_tool_prefix_open(&a->pfx, s->x.r, mf_tool_prefix_numerics(a->e.sched, a->e.exact, a->e.devices), "moeflow serve",
                                  a->quiet, &v->prefix)))
        return rc;
    /* constrained output walks the tokenizer's vocabulary; echo's prompt logprobs take a chunk's rows */
    if (v->tok && (rc = mf_gram_vocab_new(v->tok, v->c->vocab_size, (int32_t)v->c->eos_token_id, &v->gram_vocab)))
        return rc;
    int echo_rows = a->step_tokens < MF_STEP_MAX_ITEMS ? (int)a->step_tokens : MF_STEP_MAX_ITEMS;
    if ((rc = mf_batch_new(&(mf_batch_opts){.ref = s->x.r, .eng = v->eng, .tok = v->tok, .max_batch = (int)a->max_batch,
                                            .forward = pipe ? mf_pipe_forward : NULL, .forward_ctx = pipe,
                                            .step_tokens = (int)a->step_tokens, .max_context = v->max_context,
                                            .state_budget_bytes = a->budget, .max_queue = (int)a->max_queue,
                                            .echo_rows = echo_rows, .gram_vocab = v->gram_vocab,
                                            .prefix = v->prefix, .on_event = mf_srv_on_event, .user = v,
                                            .spec = v->spec}, &v->b)))
        return rc;
    char dn[256];
    snprintf(dn, sizeof dn, "%s", a->dir);
    for (size_t k = strlen(dn); k > 1 && dn[k - 1] == '/'; k--) dn[k - 1] = 0;
    const char *base = strrchr(dn, '/');
    snprintf(v->model, sizeof v->model, "%s", a->model_name ? a->model_name : base ? base + 1 : dn);
    v->api_key = s->key;
    v->max_body = a->max_body;
    v->quiet = a->quiet;
    return 0;
}

/* The stepping thread, the front door on sa and the HTTP daemon it hands connections to: an epoll
 * thread pool (libmicrohttpd's way with many slow clients), connections suspended while they wait
 * for their jobs; the start line. 0 or a negative code. */
static int mf_serve_listen(mf_serve *s, const struct sockaddr_in *sa)
{
    const mf_serve_cli *a = s->a;
    mf_srv *v = s->v;
    v->start_ns = mf_now_ns();
    int rc = mf_door_open(&(mf_door_opts){.addr = *sa, .max_conns = (int)a->max_conns,
                                          .max_per_addr = (int)a->max_per_addr,
                                          .request_timeout_s = (int)a->request_timeout, .idle_timeout_s = (int)a->timeout,
                                          .refused = mf_srv_refused, .tick = mf_srv_tick, .user = v}, &s->door);
    if (rc) {
        if (rc == -EADDRINUSE)
            return mf_error(rc, "cannot listen on %s:%ld (in use, or not an address of this machine): %s", a->host,
                            a->port, mf_last_error());
        return rc;
    }
    v->door = s->door;
    if (pthread_create(&v->stepper, NULL, mf_srv_stepper, v)) return mf_error(-EAGAIN, "cannot start the stepping thread");
    s->stepper = 1;
    /* libmicrohttpd's idle timeout (which closes silently) a second past the door's deadlines, so
     * that a slow request gets the door's 408 and an idle one the door's close first; it still
     * closes a client that takes no answer bytes */
    long idle_s = a->timeout > a->request_timeout ? a->timeout : a->request_timeout;
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME |
                     MHD_USE_NO_LISTEN_SOCKET | MHD_USE_ITC | (a->quiet ? 0 : MHD_USE_ERROR_LOG);
    s->d = MHD_start_daemon(flags, 0, NULL, NULL, mf_srv_handle, v, MHD_OPTION_EXTERNAL_LOGGER, mf_srv_log, v,
                            MHD_OPTION_THREAD_POOL_SIZE, 4u,
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)(idle_s + 1), MHD_OPTION_CONNECTION_LIMIT,
                            (unsigned)(2 * a->max_conns + 64), MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)64 << 10,
                            MHD_OPTION_NOTIFY_COMPLETED, mf_srv_done, v, MHD_OPTION_NOTIFY_CONNECTION,
                            mf_srv_conn_notify, v, MHD_OPTION_URI_LOG_CALLBACK, mf_srv_uri_log, v,
                            MHD_OPTION_UNESCAPE_CALLBACK, mf_srv_unescape, v, MHD_OPTION_END);
    if (!s->d) return mf_error(-ENOMEM, "cannot start the HTTP daemon (libmicrohttpd)");
    if ((rc = mf_door_start(s->door, s->d))) return rc;
    mf_batch_stats bs;
    mf_batch_get_stats(v->b, &bs);
    fprintf(stderr, "moeflow serve: listening on http://%s:%u (model %s, %s engine, up to %d states, %.1f MiB each "
            "at the full context of %" PRId64 " (pages as positions arrive), step budget %ld)\n", a->host,
            mf_door_port(s->door), v->model, a->e.sched ? "scheduled" : "reference", bs.n_states,
            mf_batch_state_bytes(v->b) / 1048576.0, v->max_context, a->step_tokens);
    if (!a->quiet) fprintf(stderr, "moeflow serve: chat: %s\n", s->chat_desc);
    fflush(stderr);
    return 0;
}

/* Waits until the batcher has no requests (queued or running), at most until `until` (or 500
 * rounds of 20 ms when until is 0). */
static void mf_serve_wait_idle(mf_srv *v, int64_t until, mf_batch_stats *bs)
{
    for (int k = 0;; k++) {
        mf_batch_get_stats(v->b, bs);
        if ((!bs->queued && !bs->running) || (until ? mf_now_ns() >= until : k >= 500)) break;
        usleep(20000);
    }
}

/* After SIGTERM or SIGINT: no new connections or requests; running requests get --drain-timeout
 * seconds, then the rest are cancelled; the answers of the requests that just ended (the
 * cancelled ones' 503) are sent before the daemon closes the connections. */
static void mf_serve_drain(mf_serve *s, int sig)
{
    const mf_serve_cli *a = s->a;
    mf_srv *v = s->v;
    if (!a->quiet) fprintf(stderr, "moeflow serve: %s: no new requests; draining for up to %ld s\n", strsignal(sig), a->drain);
    mf_door_quiesce(s->door);   /* stop accepting; open connections keep going */
    pthread_mutex_lock(&v->mu);
    v->draining = 1;
    pthread_mutex_unlock(&v->mu);
    mf_batch_shutdown(v->b);
    mf_batch_stats bs;
    mf_serve_wait_idle(v, mf_now_ns() + (int64_t)a->drain * 1000000000, &bs);
    if (bs.queued || bs.running) {   /* past the deadline: cancel what is left */
        int n = mf_srv_cancel_all(v);
        if (!a->quiet) fprintf(stderr, "moeflow serve: cancelled %d requests at the deadline\n", n);
        mf_serve_wait_idle(v, 0, &bs);
    }
    for (int k = 0; k < 250; k++) {   /* every begun request answered, bounded */
        pthread_mutex_lock(&v->mu);
        int busy = v->n_inflight;
        pthread_mutex_unlock(&v->mu);
        if (!busy) break;
        usleep(20000);
    }
    mf_srv_unpark_all(v);    /* MHD_stop_daemon must find no connection suspended */
    MHD_stop_daemon(s->d);   /* closes the connections left (kept alive, or a client slow to read) */
    s->d = NULL;
    if (!a->quiet) fprintf(stderr, "moeflow serve: stopped\n");
}

static void mf_serve_close(mf_serve *s)
{
    mf_srv *v = s->v;
    if (s->d) {
        mf_door_quiesce(s->door);   /* nothing more handed to the daemon */
        mf_srv_unpark_all(v);
        MHD_stop_daemon(s->d);
    }
    mf_door_close(s->door);
    v->door = NULL;
    if (s->stepper) {
        pthread_mutex_lock(&v->mu);
        v->stop_stepper = 1;
        pthread_mutex_unlock(&v->mu);
        mf_batch_shutdown(v->b);
        pthread_join(v->stepper, NULL);
    }
    mf_batch_free(v->b);
    if (!s->a->quiet) mf_tool_prefix_report(v->prefix, "moeflow serve", stderr);
    mf_prefix_free(v->prefix);
    mf_tool_run_close(&s->x);   /* the speculation too: after the batcher */
    v->eng = NULL;
    v->spec = NULL;
    mf_gram_vocab_free(v->gram_vocab);
    mf_tok_free(v->tok);
    mf_chat_tmpl_free(v->chat);
    pthread_mutex_destroy(&v->mu);
    if (s->key) memset(s->key, 0, strlen(s->key));
    free(s->key);
}

/* The API key: --api-key (its argv bytes are overwritten, so `ps` shows x's from here on),
 * --api-key-file's first line, or MOEFLOW_API_KEY; one token of visible ASCII. *key NULL: none.
 * 0 or 2 (said on stderr). */
static int mf_serve_key(const mf_serve_cli *a, char **key)
{
    *key = NULL;
    const char *env = getenv("MOEFLOW_API_KEY"), *src = a->key_file ? a->key_file : a->api_key ? "--api-key" : "MOEFLOW_API_KEY";
    if (a->api_key && a->key_file) {
        fprintf(stderr, "moeflow serve: --api-key and --api-key-file: give one\n");
        return 2;
    }
    if (a->key_file) {
        FILE *f = fopen(a->key_file, "r");
        char line[4096];
        if (!f || !fgets(line, sizeof line, f)) {
            fprintf(stderr, "moeflow serve: --api-key-file %s: %s\n", a->key_file, f ? "empty" : strerror(errno));
            if (f) fclose(f);
            return 2;
        }
        fclose(f);
        line[strcspn(line, "\r\n")] = 0;
        *key = strdup(line);
        memset(line, 0, sizeof line);
        struct stat st;
        if (!a->quiet && !stat(a->key_file, &st) && (st.st_mode & 077))
            fprintf(stderr, "moeflow serve: note: %s can be read by other users (chmod 600 it)\n", a->key_file);
    } else if (a->api_key) {
        *key = strdup(a->api_key);
        memset((char *)a->api_key, 'x', strlen(a->api_key));
    } else if (env && *env) {
        *key = strdup(env);
    } else {
        return 0;
    }
    if (!*key) return mf_error(-ENOMEM, "out of memory");
    const char *bad = NULL;
    for (const char *p = *key; *p && !bad; p++)
        if ((unsigned char)*p <= 0x20 || (unsigned char)*p >= 0x7f) bad = p;
    if (!**key || bad) {
        fprintf(stderr, "moeflow serve: the API key from %s is %s\n", src,
                **key ? "not one token of visible ASCII (a space or control byte in it)" : "empty");
        return 2;
    }
    return 0;
}

/* Raises the soft limit of open files toward the hard one, so --max-connections fits: a
 * connection is a socket. */
static void mf_serve_nofile(const mf_serve_cli *a)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl)) return;
    rlim_t want = (rlim_t)a->max_conns + 1024;
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want) {
        rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max > want ? want : rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
}

/* A pipeline's later rank (or any rank whose opening failed, rc): its layers (model, forward,
 * engine) for rank 0's steps until rank 0 stops, then the end (tools/ranks.h). */
static int mf_serve_follower(mf_serve_cli *a, int rc)
{
    static mf_srv v;
    static mf_serve s;
    memset(&v, 0, sizeof v);
    pthread_mutex_init(&v.mu, NULL);
    s = (mf_serve){.a = a, .v = &v};
    if (!rc) rc = mf_serve_open(&s);
    if (!rc) rc = mf_tool_ranks_follow(&a->rk, "serve", a->quiet);
    if (rc < 0 && !a->rk.mpi) fprintf(stderr, "moeflow serve: %s\n", mf_last_error());
    mf_serve_close(&s);
    rc = mf_tool_ranks_end(&a->rk, "serve", rc, a->quiet);
    return rc < 0 ? 1 : rc;
}

int mf_cmd_serve(int argc, char **argv)
{
    mf_serve_cli a = {0};
    mf_tool_engine_init(&a.e);
    a.e.rk = &a.rk;   /* --ranks-layers: the opener loads this rank's layers and links the engine */
    int rc = mf_opts_parse(&mf_serve_spec, argc, argv, &a);
    if (rc != MF_OPTS_RUN) return rc;
    if (!a.dir) return mf_opts_refuse(&mf_serve_spec, "--checkpoint is required");
    if (!a.step_tokens) a.step_tokens = mf_batch_default_step_tokens((int)a.max_batch);
    struct stat st;
    if (stat(a.dir, &st) || !S_ISDIR(st.st_mode)) {
        fprintf(stderr, "moeflow serve: --checkpoint %s: %s\n", a.dir,
                stat(a.dir, &st) ? (errno == ENOENT ? "no such directory" : strerror(errno)) : "not a directory");
        return 2;
    }
    if ((rc = mf_tool_engine_check("serve", &a.e))) return rc;
    if (a.spec == MF_TOOL_SPEC_PERFECT) {
        fprintf(stderr, "moeflow serve: --spec perfect is bench decode's (serve takes off or dspark)\n");
        return 2;
    }
    if (a.spec && a.rk.spec) {
        fprintf(stderr, "moeflow serve: --spec runs on one host (without --ranks-layers): the draft reads every "
                "layer's features\n");
        return 2;
    }
    a.e.draft = a.spec == MF_TOOL_SPEC_DSPARK;
    if ((rc = mf_tool_prefix_check("serve", &a.pfx, a.rk.spec != NULL))) return rc;
    if ((rc = mf_tool_ranks_open(&a.rk, "serve", a.dir, a.e.profile_path, (int)a.e.threads, NULL, NULL)) ||
        a.rk.rank > 0)
        return mf_serve_follower(&a, rc);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)a.port)};
    if (inet_pton(AF_INET, !strcmp(a.host, "localhost") ? "127.0.0.1" : a.host, &sa.sin_addr) != 1) {
        fprintf(stderr, "moeflow serve: --host: expected an IPv4 address such as 127.0.0.1, found '%s'\n", a.host);
        return 2;
    }
    /* the signals are taken by sigwait below, in this thread only */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    static mf_srv v;
    static mf_serve s;
    memset(&v, 0, sizeof v);
    pthread_mutex_init(&v.mu, NULL);
    s = (mf_serve){.a = &a, .v = &v};
    mf_serve_nofile(&a);
    /* A fixed mmap threshold: glibc's moving one (raised to the size of each large block freed) put
     * the step graphs' multi-megabyte arrays, rebuilt as the engine's kept shapes turn over, into
     * the heap after the first were freed, and the heap's holes grew the RSS by ~80 MB over 30
     * rounds of load on the tiny preset (docs/serve.md, "Memory"); with this it stays flat. */
    mallopt(M_MMAP_THRESHOLD, 128 << 10);
    rc = mf_serve_key(&a, &s.key);
    if (!rc) rc = mf_serve_open(&s);
    if (!rc) rc = mf_serve_listen(&s, &sa);
    if (!rc) {
        int sig = 0;
        sigwait(&sigs, &sig);
        mf_serve_drain(&s, sig);
    }
    if (rc < 0) fprintf(stderr, "moeflow serve: %s\n", mf_last_error()[0] ? mf_last_error() : "out of memory");
    mf_serve_close(&s);
    rc = mf_tool_ranks_end(&a.rk, "serve", rc, a.quiet);   /* stops the other ranks; after a failure exits */
    return rc < 0 ? 1 : rc;
}
