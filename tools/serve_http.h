/* `moeflow serve`'s server (tools/serve_http.c): the state its HTTP handlers, the batcher's events
 * and its stepping thread share, and the entry points tools/cmd_serve.c hands to libmicrohttpd,
 * the front door (tools/serve_door.h) and the batcher. Private to the command; requests are
 * parsed by tools/serve_req.h. */
#ifndef MF_TOOLS_SERVE_HTTP_H
#define MF_TOOLS_SERVE_HTTP_H

#include <microhttpd.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "graphs/model/config.h"
#include "graphs/step/spec.h"
#include "graphs/step/batch.h"
#include "graphs/step/step.h"
#include "host/grammar.h"
#include "host/tokenizer.h"
#include "tools/serve_door.h"
#include "tools/serve_req.h"

/* A latency histogram of /metrics: counts per bucket of fixed upper bounds. */
#define MF_HIST_N 11
typedef struct mf_hist {
    uint64_t n[MF_HIST_N + 1];   /* per bucket (last: above every bound) */
    uint64_t count;
    double sum;
} mf_hist;

typedef struct mf_job mf_job;   /* one request: its choices, their text or SSE bytes (serve_http.c) */

/* Why requests were refused: the `reason` of moeflow_rejected_total, each the code of the error
 * object the client got (mf_srv_reasons[], serve_http.c, names them). */
#define MF_SRV_N_REASONS 18

/* The server: the batcher and what it runs on, the settings the handlers apply, the live jobs and
 * the metrics. mu guards jobs, the metrics, draining and n_inflight. */
typedef struct mf_srv {
    mf_batch *b;
    mf_prefix *prefix;         /* the prefix cache, or NULL */
    mf_tok *tok;
    mf_chat_tmpl *chat;        /* NULL: the built-in chat format */
    mf_gram_vocab *gram_vocab; /* the tokenizer's vocabulary for constrained output (NULL: no tokenizer) */
    mf_step *eng;
    const mf_config *c;
    char model[256];
    int64_t max_context;
    const char *api_key;       /* NULL: none needed */
    size_t max_body;
    mf_door *door;             /* the connections' deadlines and counts */
    int draining, stop_stepper, quiet;
    int stopping;              /* the daemon is about to stop: parked connections answer at once */
    int n_inflight;            /* requests begun and not completed (mf_srv_done): drained at shutdown */
    pthread_t stepper;
    pthread_mutex_t mu;        /* live jobs and metrics */
    mf_job *jobs;
    mf_hist ttft, itl;
    uint64_t prompt_tokens, gen_tokens, requests[MF_BATCH_ERROR + 1], rejected[MF_SRV_N_REASONS];
    int64_t rate_sec[16];
    uint64_t rate_n[16];
    int64_t start_ns;
    int64_t phase_ns[MF_STEP_N_PHASES];
    uint64_t steps;
    mf_spec *spec;             /* --spec dspark, or NULL; its counters copied after each step (under mu) */
    mf_spec_stats spec_st;
    mf_step_build_stats builds;   /* the engine's, copied by the stepping thread */
} mf_srv;

/* The batcher's on_event (user: the mf_srv; on the stepping thread): tokens and ends into their
 * jobs and the metrics. */
void mf_srv_on_event(void *user, const mf_batch_event *ev);
/* The stepping thread (arg: the mf_srv): steps the batcher while there is work, until stop_stepper. */
void *mf_srv_stepper(void *arg);
/* libmicrohttpd's callbacks (cls: the mf_srv): the access handler, the URI log (a request begins:
 * its record), the completion (the record freed, a parked job given up), the connections' end, the
 * URI unescaper (none: routes match the raw path, so /v1/models%00.json is not /v1/models) and the
 * logger (silent with --quiet). */
enum MHD_Result mf_srv_handle(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                              const char *version, const char *upload, size_t *upload_size, void **ctx);
void *mf_srv_uri_log(void *cls, const char *uri, struct MHD_Connection *c);
void mf_srv_done(void *cls, struct MHD_Connection *c, void **ctx, enum MHD_RequestTerminationCode t);
void mf_srv_conn_notify(void *cls, struct MHD_Connection *c, void **socket_ctx, enum MHD_ConnectionNotificationCode t);
size_t mf_srv_unescape(void *cls, struct MHD_Connection *c, char *uri);
void mf_srv_log(void *cls, const char *fmt, va_list ap);
/* The front door's callbacks (user: the mf_srv): a refusal counted by its code; the tick (every
 * 100 ms): parked connections whose client has gone (hang-up or error, not a half-close) cancel
 * their jobs. */
void mf_srv_refused(void *user, const char *code);
void mf_srv_tick(void *user);
/* Cancels every choice of every live job (ended ones: cancel finds nothing); how many ids it tried.
 * Streams so cut end with finish_reason "error" and an error event (code shutting_down). */
int mf_srv_cancel_all(mf_srv *v);
/* Before MHD_stop_daemon (which must find no suspended connection): every parked connection is
 * resumed, and answers 503 or ends its stream. */
void mf_srv_unpark_all(mf_srv *v);

/* tools/serve_metrics.c: appends k bytes of s to the growing buffer *p (n used, cap allocated,
 * kept NUL-terminated); 0 or -ENOMEM. */
int mf_srv_buf_add(char **p, size_t *n, size_t *cap, const char *s, size_t k);
/* Counts v seconds into a histogram of /metrics: the time to first token's (itl 0) or the
 * inter-token latency's bounds (itl 1). */
void mf_srv_hist_add(mf_hist *h, int itl, double v);
/* /metrics' Prometheus text (malloc'ed, its length in *n), or NULL when out of memory. */
char *mf_srv_metrics_text(mf_srv *v, size_t *n);

#endif
