/* `moeflow serve`'s /metrics (tools/serve_http.h): the latency histograms, the reasons of refusals,
 * and the Prometheus text of the server's counters, the batcher's, the engine's, speculation's and
 * the prefix cache's (tools/tool_prefix.c). The handlers and the batcher's events that count them:
 * tools/serve_http.c. docs/serve.md. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/clock.h"
#include "tools/serve_http.h"
#include "tools/tool_prefix.h"

int mf_srv_buf_add(char **p, size_t *n, size_t *cap, const char *s, size_t k)
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

static const double mf_ttft_le[MF_HIST_N] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30};
static const double mf_itl_le[MF_HIST_N] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5};

void mf_srv_hist_add(mf_hist *h, int itl, double v)
{
    const double *le = itl ? mf_itl_le : mf_ttft_le;
    int b = 0;
    while (b < MF_HIST_N && v > le[b]) b++;
    h->n[b]++;
    h->count++;
    h->sum += v;
}

/* The reasons of moeflow_rejected_total: the error codes clients get ("invalid": a request whose
 * body or values were refused, 400), the last one for any other code. */
static const char *const mf_srv_reasons[MF_SRV_N_REASONS] = {
    "invalid", "context_length_exceeded", "queue_full", "shutting_down", "invalid_api_key", "not_found",
    "method_not_allowed", "body_too_large", "length_required", "request_timeout", "bad_request", "uri_too_long",
    "header_too_large", "http_version_not_supported", "not_implemented", "too_many_connections", "server_busy",
    "other"};

void mf_srv_refused(void *user, const char *code)
{
    mf_srv *v = user;
    int k = 0;
    while (k < MF_SRV_N_REASONS - 1 && strcmp(mf_srv_reasons[k], code)) k++;
    pthread_mutex_lock(&v->mu);
    v->rejected[k]++;
    pthread_mutex_unlock(&v->mu);
}

char *mf_srv_metrics_text(mf_srv *v, size_t *n_out)
{
    mf_batch_stats bs;
    mf_batch_get_stats(v->b, &bs);
    int held = 0, served = 0;
    if (v->door) mf_door_counts(v->door, &held, &served);   /* before v->mu: the door calls in under its own */
    char *s = NULL;
    size_t n = 0, cap = 0;
    char line[512];
#define OUT(...) do { int k_ = snprintf(line, sizeof line, __VA_ARGS__); mf_srv_buf_add(&s, &n, &cap, line, (size_t)k_); } while (0)
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
    OUT("# HELP moeflow_rejected_total Requests and connections refused, by the error code they got.\n"
        "# TYPE moeflow_rejected_total counter\n");
    for (int k = 0; k < MF_SRV_N_REASONS; k++)
        OUT("moeflow_rejected_total{reason=\"%s\"} %" PRIu64 "\n", mf_srv_reasons[k], v->rejected[k]);
    OUT("# HELP moeflow_connections Open connections: held by the front door until their first request head is "
        "in, or served.\n# TYPE moeflow_connections gauge\nmoeflow_connections{state=\"held\"} %d\n"
        "moeflow_connections{state=\"served\"} %d\n", held, served);
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
    if (v->spec) {   /* speculative decoding (docs/dspark.md) */
        const mf_spec_stats *st = &v->spec_st;
        int64_t fw = st->rounds + st->plain;
        OUT("# HELP moeflow_spec_candidates_total Draft candidates proposed and accepted.\n"
            "# TYPE moeflow_spec_candidates_total counter\nmoeflow_spec_candidates_total{outcome=\"proposed\"} %" PRId64
            "\nmoeflow_spec_candidates_total{outcome=\"accepted\"} %" PRId64 "\n", st->proposed, st->accepted);
        OUT("# HELP moeflow_spec_acceptance Accepted over proposed candidates.\n# TYPE moeflow_spec_acceptance gauge\n"
            "moeflow_spec_acceptance %.6f\n", st->proposed ? (double)st->accepted / st->proposed : 0);
        OUT("# HELP moeflow_spec_position_acceptance Acceptance of the i-th candidate given the ones before it.\n"
            "# TYPE moeflow_spec_position_acceptance gauge\n");
        for (int i = 1; i <= st->n_max; i++)
            OUT("moeflow_spec_position_acceptance{position=\"%d\"} %.6f\n", i,
                st->pos_tried[i] ? (double)st->pos_accepted[i] / st->pos_tried[i] : 0);
        OUT("# HELP moeflow_spec_tokens_per_forward Tokens per target forward of a decoding sequence.\n"
            "# TYPE moeflow_spec_tokens_per_forward gauge\nmoeflow_spec_tokens_per_forward %.6f\n",
            fw ? (double)(st->tokens + st->plain) / fw : 0);
        OUT("# HELP moeflow_spec_rounds_total Sequence-rounds by the k chosen (0: a plain step).\n"
            "# TYPE moeflow_spec_rounds_total counter\n");
        for (int k = 0; k <= st->n_max; k++) OUT("moeflow_spec_rounds_total{k=\"%d\"} %" PRId64 "\n", k, st->k_chosen[k]);
        OUT("# HELP moeflow_spec_verify_cost_ratio A step of 1 + k items over a plain step, measured (batch 1).\n"
            "# TYPE moeflow_spec_verify_cost_ratio gauge\n");
        for (int k = 1; k <= st->n_max; k++)
            if (st->steps[0] && st->steps[k])
                OUT("moeflow_spec_verify_cost_ratio{k=\"%d\"} %.6f\n", k,
                    ((double)st->step_ns[k] / st->steps[k]) / ((double)st->step_ns[0] / st->steps[0]));
        OUT("# TYPE moeflow_spec_draft_seconds_total counter\nmoeflow_spec_draft_seconds_total %.6f\n", st->draft_ns / 1e9);
    }
    if (v->eng) {
        OUT("# HELP moeflow_step_phase_seconds_total Wall time of engine steps per phase.\n"
            "# TYPE moeflow_step_phase_seconds_total counter\n");
        for (int p = 0; p < MF_STEP_N_PHASES; p++)
            OUT("moeflow_step_phase_seconds_total{phase=\"%s\"} %.6f\n", mf_step_phase_name((mf_step_phase)p),
                v->phase_ns[p] / 1e9);
        OUT("# HELP moeflow_step_shapes_built_total Step shapes (graph, binding, buffers) the engine built: a step "
            "of a shape it did not keep builds one.\n# TYPE moeflow_step_shapes_built_total counter\n"
            "moeflow_step_shapes_built_total %" PRId64 "\n# TYPE moeflow_step_shape_build_seconds_total counter\n"
            "moeflow_step_shape_build_seconds_total %.6f\n",
            v->builds.n_built, v->builds.build_ns / 1e9);
    }
    pthread_mutex_unlock(&v->mu);
    char pm[4096];   /* the prefix cache's (tools/tool_prefix.c) */
    size_t pn = mf_tool_prefix_metrics(v->prefix, pm, sizeof pm);
    if (pn) mf_srv_buf_add(&s, &n, &cap, pm, pn);
#undef OUT
    *n_out = n;
    return s;
}
