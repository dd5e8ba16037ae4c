/* A pipeline over several hosts in the simulator (graphs/sim/plan_ranks.h): each rank's stage
 * simulated by the plan of its layers, what its layers hold against the host's memory, and the
 * stages put together as the pipeline runs micro-batches through them. */
#include "graphs/sim/plan_ranks.h"

#include <errno.h>
#include <string.h>

#include "graphs/model/layout.h"
#include "graphs/step/stepgraph.h"
#include "sched/cost.h"
#include "sched/error.h"

/* What layers [l0, l1) hold (rank 0 also the embedding, the last the final norm and head): all,
 * the routed experts, the Engram tables. */
static int pr_bytes(const mf_config *c, int l0, int l1, double *all, double *ex, double *tab)
{
    mf_layout *lay;
    int rc = mf_layout_build(c, &lay);
    if (rc) return rc;
    *all = *ex = *tab = 0;
    for (int i = 0; i < mf_layout_n(lay); i++) {
        const mf_layout_tensor *t = mf_layout_at(lay, i);
        if (t->group == MF_GROUP_MTP) continue;
        int in = t->layer >= 0 ? t->layer >= l0 && t->layer < l1
                               : !strcmp(t->name, "embed.weight") ? l0 == 0 : l1 == c->n_layers;
        if (!in) continue;
        *all += (double)t->n_bytes;
        if (t->role == MF_ROLE_FP4_WEIGHT || t->role == MF_ROLE_FP4_SCALE) *ex += (double)t->n_bytes;
        if (t->role == MF_ROLE_TABLE || t->role == MF_ROLE_TABLE_SCALE) *tab += (double)t->n_bytes;
    }
    mf_layout_free(lay);
    return 0;
}

/* Rank k's store: resident when its layers fit mem (0: the host options' as given), else its
 * experts streamed through what is left, and its tables streamed too when they do not fit. */
static void pr_fit(const mf_plan_ranks_opts *o, mf_plan_ranks_report *r, int k, double mem, mf_plan_opts *po)
{
    double rest = r->rank[k].bytes - r->rank[k].expert_bytes - r->rank[k].table_bytes;
    po->store = o->host->store;
    po->tables = o->host->tables;
    po->store_budget_bytes = o->host->store_budget_bytes;
    if (mem > 0 && r->rank[k].bytes > mem) {
        po->store = MF_PLAN_STORE_STREAMED;
        double left = mem - rest - r->rank[k].table_bytes;
        if (left < 0.1 * mem) {   /* the tables do not fit beside a store either */
            po->tables = MF_PLAN_STORE_STREAMED;
            left = mem - rest;
        }
        po->store_budget_bytes = left > 0 ? (uint64_t)left : 0;
    }
    r->rank[k].store = po->store;
    r->rank[k].tables = po->tables;
    r->rank[k].store_budget = po->store == MF_PLAN_STORE_STREAMED ? (double)po->store_budget_bytes : 0;
}

/* Rank k's stages at each micro-batch size. */
static int pr_stages(const mf_plan_ranks_opts *o, mf_plan_ranks_report *r, int k, double mem)
{
    const mf_config *c = o->host->config;
    int l0 = o->split.bound[k], l1 = o->split.bound[k + 1];
    r->rank[k].l0 = l0;
    r->rank[k].l1 = l1;
    int rc = pr_bytes(c, l0, l1, &r->rank[k].bytes, &r->rank[k].expert_bytes, &r->rank[k].table_bytes);
    if (rc) return rc;
    mf_plan_opts po = *o->host;
    po.layer_begin = l0;
    po.layer_end = l1;
    pr_fit(o, r, k, mem, &po);
    for (int s = 0; s < r->n_size; s++) {
        mf_plan_report rep;
        po.batch = r->size[s];
        if ((rc = mf_plan_run(&po, o->warmup, o->steps, &rep)))
            return mf_error_wrap(rc, "rank %d (layers %d..%d) at %d sequences", k, l0, l1 - 1, r->size[s]);
        r->rank[k].stage_ns[s] = (double)rep.step_ns;
        if (s == 0)   /* the largest micro-batch's */
            snprintf(r->rank[k].bottleneck, sizeof r->rank[k].bottleneck, "%s", rep.lanes[rep.bottleneck].name);
    }
    return 0;
}

/* The link's price of a boundary of m items and of m items' logits (the pipe's 24-byte prefix). */
static void pr_links(const mf_plan_ranks_opts *o, mf_plan_ranks_report *r)
{
    const mf_config *c = o->host->config;
    mf_cost_model cm = {.p = o->host->profile};
    for (int s = 0; s < r->n_size; s++) {
        double m = r->size[s];
        r->boundary_ns[s] = mf_cost_net(&cm, 1, 24 + 4.0 * (double)mf_sg_boundary_floats(c) * m);
        r->logits_ns[s] = mf_cost_net(&cm, 1, 24 + 4.0 * (double)c->vocab_size * m);
        r->tokens_back_ns[s] = mf_cost_net(&cm, 1, 24 + 4.0 * m);
    }
}

/* The step as the pipeline runs it: F[r][j] = max(F[r][j - 1], F[r - 1][j] + boundary) + stage, the
 * step's end the last micro-batch's back on rank 0 (back[s]: its logits' or tokens' price). */
static double pr_step(mf_plan_ranks_report *r, const int *size_of, const double *back_ns, double *busy)
{
    int N = r->n_ranks, M = r->micro;
    double F[MF_PIPE_MAX_RANKS] = {0}, end = 0;
    for (int j = 0; j < M; j++) {
        int s = size_of[j];
        double prev = 0;   /* when rank r - 1 finished micro-batch j */
        for (int k = 0; k < N; k++) {
            double ready = k ? prev + r->boundary_ns[s] : 0;
            double start = F[k] > ready ? F[k] : ready;
            F[k] = start + r->rank[k].stage_ns[s];
            busy[k] += r->rank[k].stage_ns[s];
            prev = F[k];
        }
        double back = prev + back_ns[s];
        end = back > end ? back : end;
    }
    return end;
}

static void pr_compose(mf_plan_ranks_report *r, const int *size_of)
{
    double busy[MF_PIPE_MAX_RANKS] = {0}, other[MF_PIPE_MAX_RANKS] = {0};
    double end = pr_step(r, size_of, r->logits_ns, busy), alt = pr_step(r, size_of, r->tokens_back_ns, other);
    r->step_ns = end;
    r->token_ns = end / r->batch;
    r->tokens_per_s = end > 0 ? 1e9 * r->batch / end : 0;
    r->tokens_per_s_sampled_last = alt > 0 ? 1e9 * r->batch / alt : 0;
    for (int k = 0; k < r->n_ranks; k++) r->rank[k].busy = end > 0 ? busy[k] / end : 0;
}

int mf_plan_ranks_run(const mf_plan_ranks_opts *o, mf_plan_ranks_report *out)
{
    memset(out, 0, sizeof *out);
    const mf_pipe_split *sp = &o->split;
    if (sp->n_ranks < 2 || sp->n_ranks > MF_PIPE_MAX_RANKS || sp->bound[sp->n_ranks] != o->host->config->n_layers)
        return mf_error(-EINVAL, "plan: a split of %d ranks (expected 2..%d over every layer)", sp->n_ranks,
                        MF_PIPE_MAX_RANKS);
    int B = o->host->batch ? o->host->batch : 1, M = o->micro > 0 ? o->micro : sp->n_ranks;
    if (M > B) M = B;
    *out = (mf_plan_ranks_report){.n_ranks = sp->n_ranks, .micro = M, .batch = B};
    /* the micro-batches: B / M sequences each, the first B mod M of them one more */
    int size_of[MF_PIPE_MAX_RANKS * 4 + 64];
    if (M > (int)(sizeof size_of / sizeof size_of[0])) M = out->micro = (int)(sizeof size_of / sizeof size_of[0]);
    int lo = B / M, extra = B % M;
    out->size[0] = lo + (extra > 0);
    out->n_size = 1;
    if (extra > 0 && lo > 0) out->size[out->n_size++] = lo;
    for (int j = 0; j < M; j++) size_of[j] = j < extra || out->n_size == 1 ? 0 : 1;
    double mem = o->host_mem_bytes > 0 ? o->host_mem_bytes : (double)o->host->profile->host_mem_bytes;
    for (int k = 0; k < sp->n_ranks; k++) {
        int rc = pr_stages(o, out, k, mem);
        if (rc) return rc;
    }
    pr_links(o, out);
    pr_compose(out, size_of);
    return 0;
}

static const char *pr_mode(int m) { return m == MF_PLAN_STORE_STREAMED ? "streamed" : "resident"; }

void mf_plan_ranks_print(const mf_plan_ranks_report *r, FILE *f)
{
    fprintf(f, "%d ranks, batch %d in %d micro-batch%s of", r->n_ranks, r->batch, r->micro, r->micro > 1 ? "es" : "");
    for (int s = 0; s < r->n_size; s++) fprintf(f, "%s %d", s ? " and" : "", r->size[s]);
    fprintf(f, ": %.3f ms a step, %.3f ms a token, %.2f tokens/s (sampling on the last rank instead: %.2f)\n",
            r->step_ns / 1e6, r->token_ns / 1e6, r->tokens_per_s, r->tokens_per_s_sampled_last);
    for (int s = 0; s < r->n_size; s++)
        fprintf(f, "  link, %d sequences: boundary %.1f us, logits back %.1f us (tokens back %.1f us)\n", r->size[s],
                r->boundary_ns[s] / 1e3, r->logits_ns[s] / 1e3, r->tokens_back_ns[s] / 1e3);
    fprintf(f, "  %-5s %-10s %9s %9s %9s %-28s %12s %6s  %s\n", "rank", "layers", "GiB", "experts", "tables", "store",
            "stage ms", "busy", "bottleneck");
    for (int k = 0; k < r->n_ranks; k++) {
        char store[64];
        snprintf(store, sizeof store, "%s%s", pr_mode(r->rank[k].store), r->rank[k].tables ? ", tables streamed" : "");
        if (r->rank[k].store == MF_PLAN_STORE_STREAMED)
            snprintf(store + strlen(store), sizeof store - strlen(store), " (%.0f GiB)",
                     r->rank[k].store_budget / 1073741824.0);
        char lay[24];
        snprintf(lay, sizeof lay, "%d..%d", r->rank[k].l0, r->rank[k].l1 - 1);
        fprintf(f, "  %-5d %-10s %9.2f %9.2f %9.2f %-28s %12.3f %5.0f%%  %s\n", k, lay, r->rank[k].bytes / 1073741824.0,
                r->rank[k].expert_bytes / 1073741824.0, r->rank[k].table_bytes / 1073741824.0, store,
                r->rank[k].stage_ns[0] / 1e6, 100 * r->rank[k].busy, r->rank[k].bottleneck);
    }
}

void mf_plan_ranks_json(const mf_plan_ranks_report *r, FILE *f)
{
    fprintf(f, "{\"ranks\":%d,\"batch\":%d,\"micro\":%d,\"step_s\":%.9g,\"token_s\":%.9g,\"tokens_per_s\":%.6g,"
            "\"tokens_per_s_sampled_last\":%.6g,\"links\":[", r->n_ranks, r->batch, r->micro, r->step_ns / 1e9,
            r->token_ns / 1e9, r->tokens_per_s, r->tokens_per_s_sampled_last);
    for (int s = 0; s < r->n_size; s++)
        fprintf(f, "%s{\"sequences\":%d,\"boundary_s\":%.9g,\"logits_s\":%.9g}", s ? "," : "", r->size[s],
                r->boundary_ns[s] / 1e9, r->logits_ns[s] / 1e9);
    fprintf(f, "],\"stages\":[");
    for (int k = 0; k < r->n_ranks; k++) {
        fprintf(f, "%s{\"layers\":[%d,%d],\"bytes\":%.0f,\"store\":\"%s\",\"tables\":\"%s\",\"stage_s\":[", k ? "," : "",
                r->rank[k].l0, r->rank[k].l1, r->rank[k].bytes, pr_mode(r->rank[k].store), pr_mode(r->rank[k].tables));
        for (int s = 0; s < r->n_size; s++) fprintf(f, "%s%.9g", s ? "," : "", r->rank[k].stage_ns[s] / 1e9);
        fprintf(f, "],\"busy\":%.6g,\"bottleneck\":\"%s\"}", r->rank[k].busy, r->rank[k].bottleneck);
    }
    fprintf(f, "]}\n");
}
