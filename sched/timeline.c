/* Reading a filled timeline: the summary (makespan, busy time per lane, overlap ratio, measured
 * critical path), a printed table of it, and the Chrome trace-event JSON export. Flow arrows for
 * dependencies are written only for graphs of at most MF_CHROME_FLOW_MAX_TASKS tasks (viewers
 * choke on millions of arrows); slices and tracks are always written, streamed event by event. */
#define _GNU_SOURCE   /* qsort_r */
#include "sched/timeline.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "sched/error.h"
#include "sched/path.h"
#include "sched/timeline_impl.h"

#define MF_CHROME_FLOW_MAX_TASKS 20000

/* A task "ran" (occupied its lane) unless it was cancelled before starting. */
static int span_ran(const mf_task_span *s)
{
    return s->status != 1;
}

static int cmp_by_start(const void *a, const void *b, void *spans)
{
    const mf_task_span *x = &((const mf_task_span *)spans)[*(const mf_task_id *)a];
    const mf_task_span *y = &((const mf_task_span *)spans)[*(const mf_task_id *)b];
    if (x->start_ns != y->start_ns)
        return x->start_ns < y->start_ns ? -1 : 1;
    return *(const mf_task_id *)a - *(const mf_task_id *)b;
}

/* Length of the union of intervals [start, end) of ids[0..n), sorted by start. */
static int64_t union_length(const mf_task_span *spans, const mf_task_id *ids, int n)
{
    int64_t total = 0, cur_start = 0, cur_end = 0;
    int open = 0;
    for (int i = 0; i < n; i++) {
        const mf_task_span *s = &spans[ids[i]];
        int64_t e = s->end_ns > s->start_ns ? s->end_ns : s->start_ns;
        if (open && s->start_ns <= cur_end) {
            if (e > cur_end)
                cur_end = e;
            continue;
        }
        if (open)
            total += cur_end - cur_start;
        cur_start = s->start_ns;
        cur_end = e;
        open = 1;
    }
    if (open)
        total += cur_end - cur_start;
    return total;
}

int mf_timeline_summarize(mf_timeline *tl, mf_timeline_summary *out)
{
    if (!tl || !out)
        return mf_error(-EINVAL, "mf_timeline_summarize: NULL timeline or summary");
    const mf_graph *g = tl->g;
    int n = tl->n, n_lanes = mf_graph_n_lanes(g);
    if (mf_graph_n_tasks(g) != n)
        return mf_error(-EINVAL, "mf_timeline_summarize: the timeline holds %d tasks, its graph "
                        "now has %d", n, mf_graph_n_tasks(g));
    if (n_lanes > MF_TIMELINE_MAX_LANES)
        return mf_error(-E2BIG, "mf_timeline_summarize: graph has %d lanes, the summary holds %d",
                        n_lanes, MF_TIMELINE_MAX_LANES);
    memset(out, 0, sizeof *out);
    out->n_lanes = n_lanes;
    out->busiest_lane = -1;
    out->critical = tl->critical;
    tl->n_critical = 0;
    if (n == 0)
        return 0;

    const mf_task_span *spans = tl->spans;
    mf_task_id *ids = malloc((size_t)n * sizeof *ids);
    int *lane_off = calloc((size_t)n_lanes + 1, sizeof *lane_off);
    if (!ids || !lane_off) {
        free(ids);
        free(lane_off);
        return mf_error(-ENOMEM, "mf_timeline_summarize: out of memory for %d tasks", n);
    }

    /* Makespan and the last task to finish (lowest id on ties). */
    mf_task_id last = -1;
    for (mf_task_id t = 0; t < n; t++) {
        if (!span_ran(&spans[t]))
            continue;
        if (last < 0 || spans[t].end_ns > spans[last].end_ns)
            last = t;
    }
    out->makespan_ns = last >= 0 ? spans[last].end_ns : 0;

    /* Busy time per lane: bucket the tasks that ran by lane, sort each bucket by start, merge. */
    for (mf_task_id t = 0; t < n; t++)
        if (span_ran(&spans[t]))
            lane_off[mf_graph_task(g, t)->lane + 1]++;
    for (int l = 0; l < n_lanes; l++)
        lane_off[l + 1] += lane_off[l];
    int *fill = malloc((size_t)n_lanes * sizeof *fill);
    if (!fill) {
        free(ids);
        free(lane_off);
        return mf_error(-ENOMEM, "mf_timeline_summarize: out of memory");
    }
    memcpy(fill, lane_off, (size_t)n_lanes * sizeof *fill);
    for (mf_task_id t = 0; t < n; t++)
        if (span_ran(&spans[t]))
            ids[fill[mf_graph_task(g, t)->lane]++] = t;
    free(fill);
    int64_t busiest = -1;
    for (int l = 0; l < n_lanes; l++) {
        int cnt = lane_off[l + 1] - lane_off[l];
        qsort_r(ids + lane_off[l], (size_t)cnt, sizeof *ids, cmp_by_start, (void *)spans);
        out->lane_busy_ns[l] = union_length(spans, ids + lane_off[l], cnt);
        if (out->lane_busy_ns[l] > busiest) {
            busiest = out->lane_busy_ns[l];
            out->busiest_lane = l;
        }
    }
    out->overlap_ratio = busiest > 0 ? (double)out->makespan_ns / (double)busiest : 0.0;
    free(ids);
    free(lane_off);

    /* Measured critical path: from the last task to finish, repeatedly step to the predecessor
     * that finished last (lowest id on ties). Its length is the sum of those tasks' durations. */
    int k = 0;
    for (mf_task_id t = last; t >= 0;) {
        tl->critical[k++] = t;
        out->critical_path_ns += spans[t].end_ns - spans[t].start_ns;
        const mf_task_id *pred = mf_graph_pred(g, t);
        mf_task_id best = -1;
        for (int i = 0; i < mf_graph_n_pred(g, t); i++) {
            mf_task_id p = pred[i];
            if (!span_ran(&spans[p]))
                continue;
            if (best < 0 || spans[p].end_ns > spans[best].end_ns ||
                (spans[p].end_ns == spans[best].end_ns && p < best))
                best = p;
        }
        t = best;
    }
    for (int i = 0; i < k / 2; i++) {   /* first task first */
        mf_task_id tmp = tl->critical[i];
        tl->critical[i] = tl->critical[k - 1 - i];
        tl->critical[k - 1 - i] = tmp;
    }
    tl->n_critical = k;
    out->n_critical = k;
    return 0;
}

void mf_timeline_print_summary(const mf_timeline *tl, const mf_timeline_summary *s, FILE *f)
{
    const mf_graph *g = tl->g;
    double ms = 1e-6;
    fprintf(f, "%-16s %12s %8s\n", "lane", "busy ms", "share");
    for (int l = 0; l < s->n_lanes; l++) {
        double share = s->makespan_ns > 0 ? (double)s->lane_busy_ns[l] / (double)s->makespan_ns : 0;
        fprintf(f, "%-16s %12.3f %7.1f%%%s\n", mf_graph_lane(g, l)->name,
                (double)s->lane_busy_ns[l] * ms, 100.0 * share,
                l == s->busiest_lane ? "  (busiest)" : "");
    }
    fprintf(f, "makespan        %12.3f ms\n", (double)s->makespan_ns * ms);
    fprintf(f, "overlap ratio   %12.3f (makespan / busiest lane busy; 1.0 = never waited)\n",
            s->overlap_ratio);
    fprintf(f, "critical path   %12.3f ms over %d tasks:", (double)s->critical_path_ns * ms,
            s->n_critical);
    int show = s->n_critical < 6 ? s->n_critical : 6;
    for (int i = 0; i < show; i++)
        fprintf(f, "%s %s", i ? "," : "", mf_graph_task(g, s->critical[i])->name);
    fprintf(f, "%s\n", s->n_critical > show ? ", ..." : "");
}

/* ---- Chrome trace-event export -------------------------------------------------------------- */

/* A JSON string for a name; bytes that are not valid UTF-8 become '?'. */
static json_t *json_name(const char *s)
{
    if (!s)
        s = "";
    json_t *j = json_string(s);
    if (j)
        return j;
    char *copy = strdup(s);
    if (!copy)
        return NULL;
    for (char *p = copy; *p; p++)
        if ((unsigned char)*p >= 0x80)
            *p = '?';
    j = json_string(copy);
    free(copy);
    return j;
}

typedef struct chrome_writer {
    FILE *f;
    const char *path;
    int n_written;
    int err;
} chrome_writer;

/* Dumps one event (stealing the reference) with a separating comma. */
static void emit(chrome_writer *w, json_t *ev)
{
    if (w->err) {
        json_decref(ev);
        return;
    }
    if (!ev) {
        w->err = mf_error(-ENOMEM, "%s: out of memory building a trace event", w->path);
        return;
    }
    if ((w->n_written++ && fputs(",\n", w->f) == EOF) || json_dumpf(ev, w->f, JSON_COMPACT) != 0)
        w->err = mf_error(-EIO, "%s: write failed: %s", w->path, strerror(errno));
    json_decref(ev);
}

static json_t *meta_event(const char *what, int tid, json_t *args)
{
    return json_pack("{s:s, s:s, s:i, s:i, s:o}", "name", what, "ph", "M", "pid", 0, "tid", tid,
                     "args", args);
}

/* The track of a slice; a worker index outside the lane's slots (a corrupt span) goes to slot 0. */
static int track_of(const int *base, const int *n_slots, int lane, int32_t worker)
{
    return base[lane] + (worker >= 0 && worker < n_slots[lane] ? worker : 0);
}

static double us(int64_t ns)
{
    return (double)ns / 1000.0;
}

int mf_timeline_write_chrome(const mf_timeline *tl, const char *path)
{
    if (!tl || !path)
        return mf_error(-EINVAL, "mf_timeline_write_chrome: NULL timeline or path");
    const mf_graph *g = tl->g;
    const mf_task_span *spans = tl->spans;
    int n = tl->n, n_lanes = mf_graph_n_lanes(g);
    if (mf_graph_n_tasks(g) != n)
        return mf_error(-EINVAL, "%s: the timeline holds %d tasks, its graph now has %d", path, n,
                        mf_graph_n_tasks(g));

    /* Tracks: lane l has n_slots[l] tracks starting at tid base[l]; a lane that can run more
     * than one task at once gets one track per worker slot so overlapping slices don't nest. */
    int *base = malloc(((size_t)n_lanes + 1) * sizeof *base);
    int *n_slots = malloc(((size_t)n_lanes + 1) * sizeof *n_slots);
    if (!base || !n_slots) {
        free(base);
        free(n_slots);
        return mf_error(-ENOMEM, "%s: out of memory", path);
    }
    for (int l = 0; l < n_lanes; l++)
        n_slots[l] = mf_graph_lane(g, l)->concurrency > 1 ? mf_graph_lane(g, l)->concurrency : 1;
    for (mf_task_id t = 0; t < n; t++) {
        int l = mf_graph_task(g, t)->lane;
        if (span_ran(&spans[t]) && spans[t].worker >= n_slots[l] && spans[t].worker < (1 << 16))
            n_slots[l] = spans[t].worker + 1;
    }
    base[0] = 0;
    for (int l = 0; l < n_lanes; l++)
        base[l + 1] = base[l] + n_slots[l];

    int mk = mf_path_make_parent(path);
    if (mk) {
        free(base);
        free(n_slots);
        return mk;
    }
    chrome_writer w = {.f = fopen(path, "w"), .path = path};
    if (!w.f) {
        int e = errno;
        free(base);
        free(n_slots);
        return mf_error(-e, "%s: cannot create trace file: %s", path, strerror(e));
    }
    if (fputs("{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n", w.f) == EOF)
        w.err = mf_error(-EIO, "%s: write failed: %s", path, strerror(errno));

    emit(&w, meta_event("process_name", 0, json_pack("{s:s}", "name", "moeflow")));
    for (int l = 0; l < n_lanes; l++) {
        const mf_lane_desc *ld = mf_graph_lane(g, l);
        int multi = n_slots[l] > 1 || ld->concurrency > 1;
        for (int k = 0; k < n_slots[l]; k++) {
            char name[256];
            if (multi)
                snprintf(name, sizeof name, "%s/%d", ld->name ? ld->name : "lane", k);
            else
                snprintf(name, sizeof name, "%s", ld->name ? ld->name : "lane");
            json_t *args = json_object();
            if (args)
                json_object_set_new(args, "name", json_name(name));
            emit(&w, meta_event("thread_name", base[l] + k, args));
            emit(&w, meta_event("thread_sort_index", base[l] + k,
                                json_pack("{s:i}", "sort_index", base[l] + k)));
        }
    }

    for (mf_task_id t = 0; t < n && !w.err; t++) {
        const mf_task_span *s = &spans[t];
        if (!span_ran(s))
            continue;
        const mf_task_desc *d = mf_graph_task(g, t);
        int64_t dur = s->end_ns > s->start_ns ? s->end_ns - s->start_ns : 0;
        json_t *ev = json_pack("{s:o, s:o, s:s, s:f, s:f, s:i, s:i, s:{s:i, s:f, s:f, s:f, s:i}}",
                               "name", json_name(d->name), "cat", json_name(mf_graph_lane(g, d->lane)->name),
                               "ph", "X", "ts", us(s->start_ns), "dur", us(dur), "pid", 0,
                               "tid", track_of(base, n_slots, d->lane, s->worker), "args", "task", t,
                               "cost_estimate_ns", mf_graph_task_cost_ns(g, t), "bytes", d->cost.bytes,
                               "flops", d->cost.flops, "status", s->status);
        emit(&w, ev);
    }

    /* Flow arrows: "s" just inside the end of the producer's slice, "f" (binding to the enclosing
     * slice, bp "e") just inside the start of the consumer's slice; one id per edge. */
    if (n <= MF_CHROME_FLOW_MAX_TASKS) {
        int64_t flow_id = 0;
        for (mf_task_id a = 0; a < n && !w.err; a++) {
            const mf_task_span *sa = &spans[a];
            if (!span_ran(sa))
                continue;
            int64_t ts_s = sa->end_ns > sa->start_ns ? sa->end_ns - 1 : sa->start_ns;
            const mf_task_id *succ = mf_graph_succ(g, a);
            for (int i = 0; i < mf_graph_n_succ(g, a); i++) {
                mf_task_id b = succ[i];
                const mf_task_span *sb = &spans[b];
                if (!span_ran(sb))
                    continue;
                int64_t ts_f = sb->end_ns > sb->start_ns ? sb->start_ns + 1 : sb->start_ns;
                if (ts_f < ts_s)   /* only when spans contradict the edge; keep the pair valid */
                    ts_f = ts_s;
                flow_id++;
                int tid_a = track_of(base, n_slots, mf_graph_task(g, a)->lane, sa->worker);
                int tid_b = track_of(base, n_slots, mf_graph_task(g, b)->lane, sb->worker);
                emit(&w, json_pack("{s:s, s:s, s:s, s:I, s:f, s:i, s:i}", "name", "dep", "cat",
                                   "dep", "ph", "s", "id", (json_int_t)flow_id, "ts", us(ts_s),
                                   "pid", 0, "tid", tid_a));
                emit(&w, json_pack("{s:s, s:s, s:s, s:s, s:I, s:f, s:i, s:i}", "name", "dep",
                                   "cat", "dep", "ph", "f", "bp", "e", "id", (json_int_t)flow_id,
                                   "ts", us(ts_f), "pid", 0, "tid", tid_b));
            }
        }
    }

    if (!w.err && fputs("\n]}\n", w.f) == EOF)
        w.err = mf_error(-EIO, "%s: write failed: %s", path, strerror(errno));
    if (fclose(w.f) != 0 && !w.err)
        w.err = mf_error(-EIO, "%s: write failed: %s", path, strerror(errno));
    free(base);
    free(n_slots);
    return w.err;
}

static int span_cmp(const void *pa, const void *pb)
{
    const mf_task_span *x = pa, *y = pb;
    return (x->start_ns > y->start_ns) - (x->start_ns < y->start_ns);
}

int mf_timeline_union(mf_task_span *s, int n, int64_t *len_ns)
{
    if (n > 1)
        qsort(s, (size_t)n, sizeof *s, span_cmp);
    int u = 0;
    int64_t len = 0;
    for (int i = 0; i < n; i++) {
        if (u && s[i].start_ns <= s[u - 1].end_ns) {
            if (s[i].end_ns > s[u - 1].end_ns)
                s[u - 1].end_ns = s[i].end_ns;
        } else {
            s[u++] = s[i];
        }
    }
    for (int i = 0; i < u; i++)
        len += s[i].end_ns - s[i].start_ns;
    if (len_ns)
        *len_ns = len;
    return u;
}

int64_t mf_timeline_overlap(const mf_task_span *a, int na, const mf_task_span *b, int nb)
{
    int64_t ov = 0;
    for (int i = 0, j = 0; i < na && j < nb;) {
        int64_t x = a[i].start_ns > b[j].start_ns ? a[i].start_ns : b[j].start_ns;
        int64_t y = a[i].end_ns < b[j].end_ns ? a[i].end_ns : b[j].end_ns;
        if (y > x)
            ov += y - x;
        if (a[i].end_ns < b[j].end_ns)
            i++;
        else
            j++;
    }
    return ov;
}
