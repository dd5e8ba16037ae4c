/* Graph construction: adjacency packing, duplicate edges, upward ranks from lane models, and the
 * errors for cycles, bad lanes, unknown tasks and IO tasks without a read. */
#include <string.h>

#include "sched/error.h"
#include "sched/graph.h"
#include "sched/timeline.h"
#include "tests/check.h"

static int nop(void *arg, mf_task_ctx *ctx) { return 0; }

int main(void)
{
    mf_lane_desc lanes[2] = {
        {.kind = MF_LANE_CPU, .name = "cpu0", .concurrency = 2, .numa_node = 0,
         .model = {.flops_per_s = 1e9, .latency_ns = 10}},
        {.kind = MF_LANE_IO, .name = "io", .concurrency = 4, .model = {.bytes_per_s = 1e9}},
    };
    mf_graph *g;
    CHECK(mf_graph_create(lanes, 2, &g) == 0, "%s", mf_last_error());
    mf_io_read rd = {0};
    /* diamond: a -> b, a -> c, b -> d, c -> d; a is an IO read of 1000 bytes (1000 ns). */
    mf_task_id a = mf_graph_add_task(g, &(mf_task_desc){.name = "a", .lane = 1, .arg = &rd,
                                                         .cost = {.bytes = 1000}});
    mf_task_id b = mf_graph_add_task(g, &(mf_task_desc){.name = "b", .lane = 0, .fn = nop,
                                                         .cost = {.flops = 500}});
    mf_task_id c = mf_graph_add_task(g, &(mf_task_desc){.name = "c", .lane = 0, .fn = nop,
                                                         .cost = {.time_ns = 100}});
    mf_task_id d = mf_graph_add_task(g, &(mf_task_desc){.name = "d", .lane = 0, .fn = nop});
    CHECK(a == 0 && b == 1 && c == 2 && d == 3, "ids %d %d %d %d", a, b, c, d);
    CHECK(mf_graph_add_task(g, &(mf_task_desc){.name = "bad", .lane = 7}) < 0, "bad lane accepted");
    CHECK(strstr(mf_last_error(), "bad") && strstr(mf_last_error(), "lane 7"), "%s", mf_last_error());
    CHECK(mf_graph_add_dep(g, a, 99) == -EINVAL, "unknown task accepted");
    CHECK(mf_graph_add_dep(g, b, b) == -EINVAL, "self dependency accepted");
    CHECK(mf_graph_add_dep(g, a, b) == 0, "%s", mf_last_error());
    CHECK(mf_graph_add_dep(g, a, b) == 0, "duplicate");
    CHECK(mf_graph_add_dep(g, a, c) == 0, "%s", mf_last_error());
    CHECK(mf_graph_add_dep(g, b, d) == 0, "%s", mf_last_error());
    CHECK(mf_graph_add_dep(g, c, d) == 0, "%s", mf_last_error());
    CHECK(mf_graph_finalize(g) == 0, "%s", mf_last_error());
    CHECK(mf_graph_n_succ(g, a) == 2 && mf_graph_n_pred(g, a) == 0, "a adjacency");
    CHECK(mf_graph_n_pred(g, b) == 1 && mf_graph_pred(g, b)[0] == a, "duplicate edge not merged");
    CHECK(mf_graph_n_pred(g, d) == 2 && mf_graph_pred(g, d)[0] == b && mf_graph_pred(g, d)[1] == c, "d preds");
    CHECK(mf_graph_succ(g, a)[0] == b && mf_graph_succ(g, a)[1] == c, "a succ");
    CHECK(mf_graph_task_cost_ns(g, a) == 1000, "cost a %g", mf_graph_task_cost_ns(g, a));
    CHECK(mf_graph_task_cost_ns(g, b) == 510, "cost b %g", mf_graph_task_cost_ns(g, b));
    CHECK(mf_graph_task_cost_ns(g, c) == 110, "cost c %g", mf_graph_task_cost_ns(g, c));
    CHECK(mf_graph_rank_ns(g, d) == 10, "rank d %g", mf_graph_rank_ns(g, d));
    CHECK(mf_graph_rank_ns(g, a) == 1000 + 510 + 10, "rank a %g", mf_graph_rank_ns(g, a));
    CHECK(mf_graph_add_task(g, &(mf_task_desc){.name = "late", .lane = 0}) < 0, "add after finalize");
    /* a raised rank: only up, only known tasks */
    CHECK(mf_graph_raise_rank(g, d, 5) == 0 && mf_graph_rank_ns(g, d) == 10, "a lower rank lowered d: %g",
          mf_graph_rank_ns(g, d));
    CHECK(mf_graph_raise_rank(g, d, 5000) == 0 && mf_graph_rank_ns(g, d) == 5000, "rank d raised: %g",
          mf_graph_rank_ns(g, d));
    CHECK(mf_graph_rank_ns(g, a) == 1000 + 510 + 10, "raising d moved a: %g", mf_graph_rank_ns(g, a));
    CHECK(mf_graph_raise_rank(g, 99, 1) == -EINVAL, "unknown task raised");
    int x;
    mf_graph_set_arg(g, b, &x);
    CHECK(mf_graph_task(g, b)->arg == &x, "set_arg");
    CHECK(!strcmp(mf_graph_task(g, c)->name, "c") && !strcmp(mf_graph_lane(g, 1)->name, "io"), "names");

    mf_timeline *tl;
    CHECK(mf_timeline_create(g, &tl) == 0, "%s", mf_last_error());
    CHECK(mf_timeline_graph(tl) == g && mf_timeline_spans(tl)[3].status == 1, "timeline init");
    mf_timeline_destroy(tl);
    mf_graph_destroy(g);

    /* A cycle x -> y -> z -> x behind an acyclic head names one of its tasks. */
    CHECK(mf_graph_create(lanes, 2, &g) == 0, "%s", mf_last_error());
    mf_task_id h = mf_graph_add_task(g, &(mf_task_desc){.name = "head", .lane = 0});
    mf_task_id xs = mf_graph_add_task(g, &(mf_task_desc){.name = "x", .lane = 0});
    mf_task_id ys = mf_graph_add_task(g, &(mf_task_desc){.name = "y", .lane = 0});
    mf_task_id zs = mf_graph_add_task(g, &(mf_task_desc){.name = "z", .lane = 0});
    mf_task_id tail = mf_graph_add_task(g, &(mf_task_desc){.name = "tail", .lane = 0});
    mf_graph_add_dep(g, h, xs);
    mf_graph_add_dep(g, xs, ys);
    mf_graph_add_dep(g, ys, zs);
    mf_graph_add_dep(g, zs, xs);
    mf_graph_add_dep(g, zs, tail);
    CHECK(mf_graph_finalize(g) == -EINVAL, "cycle not found");
    const char *e = mf_last_error();
    CHECK(strstr(e, "cycle") && (strstr(e, "'x'") || strstr(e, "'y'") || strstr(e, "'z'")) &&
          !strstr(e, "'head'") && !strstr(e, "'tail'"), "%s", e);
    mf_graph_destroy(g);

    /* IO task without a read. */
    CHECK(mf_graph_create(lanes, 2, &g) == 0, "%s", mf_last_error());
    mf_graph_add_task(g, &(mf_task_desc){.name = "noread", .lane = 1});
    CHECK(mf_graph_finalize(g) == -EINVAL && strstr(mf_last_error(), "noread"), "%s", mf_last_error());
    mf_graph_destroy(g);

    lanes[0].concurrency = -1;
    CHECK(mf_graph_create(lanes, 2, &g) == -EINVAL, "negative concurrency accepted");
    return mf_check_exit("test_sched_graph");
}
