/* Where a pipeline cuts the model (graphs/pipe/pipe.h): a split given as ranges, checked against the
 * config's cuts (mf_config_cut_ok), or chosen (`auto`) from what each layer holds (the layout's
 * bytes) and costs (the cost model's price of its tasks in a batch-1 step, the step graph's
 * records: the engine's and the simulator's one builder). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/model/layout.h"
#include "graphs/pipe/pipe.h"
#include "graphs/step/stepgraph.h"
#include "sched/error.h"

int mf_pipe_split_parse(const mf_config *c, const char *spec, int n_ranks, mf_pipe_split *out)
{
    memset(out, 0, sizeof *out);
    if (n_ranks < 2 || n_ranks > MF_PIPE_MAX_RANKS)
        return mf_error(-EINVAL, "pipeline: %d ranks (expected 2..%d)", n_ranks, MF_PIPE_MAX_RANKS);
    const char *s = spec;
    int k = 0, prev = 0;
    while (*s && k < n_ranks) {
        char *e;
        long a = strtol(s, &e, 10);
        if (e == s || *e != ':')
            return mf_error(-EINVAL, "pipeline: layers '%s': expected ranges a:b separated by commas", spec);
        s = e + 1;
        long b = strtol(s, &e, 10);
        if (e == s || (*e && *e != ','))
            return mf_error(-EINVAL, "pipeline: layers '%s': expected ranges a:b separated by commas", spec);
        s = *e ? e + 1 : e;
        if (a != prev || b <= a || b > c->n_layers)
            return mf_error(-EINVAL, "pipeline: range %d (%ld:%ld) of '%s': expected %d:b with %d < b <= %d (the "
                            "ranges follow each other from layer 0 to %d)", k, a, b, spec, prev, prev, c->n_layers,
                            c->n_layers);
        if (!mf_config_cut_ok(c, (int)a))
            return mf_error(-EINVAL, "pipeline: range %d (%ld:%ld) of '%s': layer %ld reads the compressed KV of a layer "
                            "before it, so it cannot begin a rank (cuts: layer 0, a KV source, or a window-only "
                            "layer before one)", k, a, b, spec, a);
        out->bound[k++] = (int)a;
        prev = (int)b;
    }
    if (k != n_ranks || *s || prev != c->n_layers)
        return mf_error(-EINVAL, "pipeline: layers '%s': expected %d ranges covering layers 0 to %d, one per rank",
                        spec, n_ranks, c->n_layers);
    out->n_ranks = n_ranks;
    out->bound[n_ranks] = c->n_layers;
    return 0;
}

void mf_pipe_split_str(const mf_pipe_split *s, char *buf, size_t cap)
{
    size_t u = 0;
    if (cap) buf[0] = 0;
    for (int k = 0; k < s->n_ranks && u < cap; k++)
        u += (size_t)snprintf(buf + u, cap - u, "%s%d:%d", k ? "," : "", s->bound[k], s->bound[k + 1]);
}

/* Bytes per layer from the layout: every tensor of layer L (the draft's left out), the embedding,
 * the final norm and head. */
static int mf_pipe_layer_bytes(const mf_config *c, double *bytes)
{
    mf_layout *lay;
    int rc = mf_layout_build(c, &lay);
    if (rc) return rc;
    for (int i = 0; i < mf_layout_n(lay); i++) {
        const mf_layout_tensor *t = mf_layout_at(lay, i);
        if (t->group == MF_GROUP_MTP) continue;
        int k = t->layer >= 0 ? t->layer : !strcmp(t->name, "embed.weight") ? c->n_layers : c->n_layers + 1;
        bytes[k] += (double)t->n_bytes;
    }
    mf_layout_free(lay);
    return 0;
}

int mf_pipe_layer_costs(const mf_config *c, const mf_profile *p, int n_threads, double *bytes, double *ns)
{
    int nl = c->n_layers;
    for (int L = 0; L < nl + 2; L++) bytes[L] = ns[L] = 0;
    int rc = mf_pipe_layer_bytes(c, bytes);
    if (rc) return rc;
    mf_sg_sizes *sz = NULL;
    if ((rc = mf_sg_sizes_new(c, &sz))) return rc;
    mf_lane_model models[4];
    mf_step_lane_models(p, n_threads, models);
    mf_sg_lanes lt;
    mf_sg_lanes_init(&lt, models, n_threads, 0, 0);
    mf_sg_opts o = {.c = c, .sz = sz, .n = 1, .n_threads = n_threads, .lanes = lt.lane, .n_lanes = lt.n_lanes,
                    .lane_io = lt.lane_io, .lane_dev0 = lt.lane_dev0, .lane_net = -1, .profile = p};
    mf_stepgraph *sg = NULL;
    rc = mf_stepgraph_new(&o, &sg);
    for (int t = 0; !rc && t < sg->n_tasks; t++) {
        int L = sg->task[t].layer;
        ns[L >= 0 && L < nl ? L : nl + 1] += mf_graph_task_cost_ns(sg->g, t);
    }
    mf_stepgraph_free(sg);
    mf_sg_sizes_free(sz);
    return rc;
}

/* Rank of ranges [pos[i], pos[j]) (first: rank 0, last: the last rank): its bytes and time. */
static void mf_pipe_range(const double *bytes, const double *ns, int nl, int a, int b, double *rb, double *rn)
{
    *rb = *rn = 0;
    for (int L = a; L < b; L++) *rb += bytes[L], *rn += ns[L];
    if (a == 0) *rb += bytes[nl], *rn += ns[nl];
    if (b == nl) *rb += bytes[nl + 1], *rn += ns[nl + 1];
}

/* (x0, x1) < (y0, y1) lexicographically. */
static int mf_pipe_less(double x0, double x1, double y0, double y1) { return x0 < y0 || (x0 == y0 && x1 < y1); }

/* The split into n ranges at pos[0..m] (pos[m] = n_layers) least in (key0, key1) of its worst
 * rank, key0 the time (by_time) or bytes; ranges over mem_bytes excluded (0: none). 1 when found. */
static int mf_pipe_dp(const double *bytes, const double *ns, int nl, const int *pos, int m, int n, double mem_bytes,
                      int by_time, mf_pipe_split *out)
{
    enum { P = MF_CONFIG_MAX_LAYERS + 1 };
    static double f0[MF_PIPE_MAX_RANKS + 1][P], f1[MF_PIPE_MAX_RANKS + 1][P];
    static int arg[MF_PIPE_MAX_RANKS + 1][P];
    const double INF = 1e300;
    for (int g = 0; g <= n; g++)
        for (int j = 0; j <= m; j++) f0[g][j] = f1[g][j] = INF, arg[g][j] = -1;
    f0[0][0] = f1[0][0] = 0;
    for (int g = 1; g <= n; g++)
        for (int j = g; j <= m; j++)
            for (int i = g - 1; i < j; i++) {
                if (f0[g - 1][i] >= INF) continue;
                double rb, rn;
                mf_pipe_range(bytes, ns, nl, pos[i], pos[j], &rb, &rn);
                if (mem_bytes > 0 && rb > mem_bytes) continue;
                double k0 = by_time ? rn : rb, k1 = by_time ? rb : rn;
                double v0 = f0[g - 1][i] > k0 ? f0[g - 1][i] : k0, v1 = f1[g - 1][i] > k1 ? f1[g - 1][i] : k1;
                if (mf_pipe_less(v0, v1, f0[g][j], f1[g][j])) f0[g][j] = v0, f1[g][j] = v1, arg[g][j] = i;
            }
    if (f0[n][m] >= INF) return 0;
    out->n_ranks = n;
    for (int g = n, j = m; g >= 1; g--) {
        out->bound[g] = pos[j];
        j = arg[g][j];
    }
    out->bound[0] = 0;
    return 1;
}

int mf_pipe_split_auto(const mf_config *c, const double *bytes, const double *ns, int n_ranks, double mem_bytes,
                       mf_pipe_split *out)
{
    memset(out, 0, sizeof *out);
    int nl = c->n_layers, pos[MF_CONFIG_MAX_LAYERS + 1], m = 0;
    for (int L = 0; L < nl; L++)
        if (mf_config_cut_ok(c, L)) pos[m++] = L;
    pos[m] = nl;
    if (n_ranks < 2 || n_ranks > MF_PIPE_MAX_RANKS || n_ranks > m)
        return mf_error(-EINVAL, "pipeline: %d ranks, but the model can be cut in at most %d places (its layers "
                        "beginning a rank: 0 and the KV sources with what comes just before them)", n_ranks, m);
    if (mf_pipe_dp(bytes, ns, nl, pos, m, n_ranks, mem_bytes, 1, out)) return 0;
    mf_pipe_dp(bytes, ns, nl, pos, m, n_ranks, 0, 0, out);
    return 0;
}

void mf_pipe_split_print(const mf_pipe_split *s, const double *bytes, const double *ns, int n_layers, FILE *f,
                         const char *prefix)
{
    double tn = 0;
    for (int L = 0; L < n_layers + 2; L++) tn += ns[L];
    for (int k = 0; k < s->n_ranks; k++) {
        double rb, rn;
        mf_pipe_range(bytes, ns, n_layers, s->bound[k], s->bound[k + 1], &rb, &rn);
        fprintf(f, "%srank %d: layers %d..%d%s%s, %.2f GiB, %.1f%% of a step's cost-model time\n", prefix, k,
                s->bound[k], s->bound[k + 1] - 1, k == 0 ? " + embedding" : "",
                k == s->n_ranks - 1 ? " + head" : "", rb / 1073741824.0, tn > 0 ? 100.0 * rn / tn : 0.0);
    }
}
