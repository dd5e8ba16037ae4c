/* The prefix cache's options and reports for the commands (tools/tool_prefix.h). */
#include "tools/tool_prefix.h"

#include <errno.h>
#include <inttypes.h>
#include <string.h>

#include "sched/error.h"
#include "tools/commands.h"

int mf_tool_prefix_size_opt(const mf_opt *o, const char *arg, void *field)
{
    if (strcmp(arg, "0") && !mf_tool_size(arg))
        return mf_error(-EINVAL, "%s: expected a size (64M, 2G) or 0 (off), found '%s'", o->flag, arg);
    *(const char **)field = arg;
    return 0;
}

int mf_tool_prefix_check(const char *cmd, mf_tool_prefix *o, int pipeline)
{
    if (!pipeline) return 0;
    if ((o->size && strcmp(o->size, "0")) || o->dir) {
        fprintf(stderr, "moeflow %s: the prefix cache holds one process's sequence states, not a pipeline's: "
                "--prefix-cache and --prefix-cache-dir do not go with --ranks-layers\n", cmd);
        return 2;
    }
    o->size = "0";
    return 0;
}

/* MemAvailable of /proc/meminfo in bytes, 0 when unknown */
static uint64_t mf_tool_mem_available(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    unsigned long long kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
    if (f) fclose(f);
    return (uint64_t)kb * 1024;
}

const char *mf_tool_prefix_numerics(int sched, int exact, const char *devices)
{
    int cuda = devices && !strncmp(devices, "cuda", 4);
    if (!sched) return "reference";
    return exact ? (cuda ? "scheduled-fp32-cuda" : "scheduled-fp32") : (cuda ? "scheduled-int8-cuda" : "scheduled-int8");
}

int mf_tool_prefix_open(const mf_tool_prefix *o, const mf_ref *r, const char *numerics, const char *who, int quiet,
                        mf_prefix **out)
{
    *out = NULL;
    if (o->size && !strcmp(o->size, "0")) {
        if (o->dir) return mf_error(-EINVAL, "--prefix-cache-dir needs the prefix cache (--prefix-cache is 0)");
        return 0;
    }
    uint64_t avail = mf_tool_mem_available(), budget = o->size ? mf_tool_size(o->size) : avail / MF_TOOL_PREFIX_FRACTION;
    if (!budget) budget = UINT64_C(1) << 30;   /* no /proc/meminfo: 1 GiB */
    mf_prefix_opts po = {.ref = r, .block_tokens = (int)o->block, .budget_bytes = budget, .dir = o->dir,
                         .disk_budget_bytes = o->disk, .io_force_pread = mf_tool_io_env.force_pread,
                         .io_fault_kind = mf_tool_io_env.fault_kind, .io_fault_nth = mf_tool_io_env.fault_nth,
                         .quiet = quiet};
    int rc = o->dir ? mf_prefix_key(r, numerics, po.key) : 0;
    if (!rc) rc = mf_prefix_new(&po, out);
    if (rc) return rc;
    if (!quiet) {
        const mf_config *c = mf_ref_config(r);
        int B = mf_prefix_block_tokens(*out);
        fprintf(stderr, "%s: prefix cache %.1f MiB%s, blocks of %d tokens, %.0f bytes per cached token", who,
                budget / 1048576.0, o->size ? "" : " (a quarter of the memory available)", B,
                mf_prefix_bytes_per_token(c, B));
        if (o->dir) {
            mf_prefix_stats st;
            mf_prefix_get_stats(*out, &st);
            fprintf(stderr, "; disk %s: %" PRId64 " blocks, %.1f of %.1f MiB", o->dir, st.disk_files,
                    st.disk_bytes / 1048576.0, st.disk_budget_bytes / 1048576.0);
        }
        fputc('\n', stderr);
    }
    return 0;
}

void mf_tool_prefix_report(const mf_prefix *p, const char *who, FILE *f)
{
    if (!p) return;
    mf_prefix_stats st;
    mf_prefix_get_stats((mf_prefix *)p, &st);
    fprintf(f, "%s: prefix cache: %" PRId64 " of %" PRId64 " prompt tokens cached (%.1f%%) in %" PRId64 " of %" PRId64
            " lookups; %" PRId64 " blocks, %.1f MiB held, %" PRId64 " evicted", who, st.hit_tokens, st.lookup_tokens,
            st.lookup_tokens ? 100.0 * st.hit_tokens / st.lookup_tokens : 0.0, st.hits, st.lookups, st.nodes,
            st.bytes / 1048576.0, st.evicted);
    if (st.disk_budget_bytes)
        fprintf(f, "; disk: %" PRId64 " loaded, %" PRId64 " written, %" PRId64 " files (%.1f MiB), %" PRId64
                " evicted, %" PRId64 " skipped, %" PRId64 " not written", st.disk_loaded, st.disk_written, st.disk_files,
                st.disk_bytes / 1048576.0, st.disk_evicted, st.disk_skipped, st.disk_failed);
    fputc('\n', f);
}

size_t mf_tool_prefix_metrics(const mf_prefix *p, char *buf, size_t cap)
{
    if (!p || !cap) return 0;
    mf_prefix_stats st;
    mf_prefix_get_stats((mf_prefix *)p, &st);
    int n = snprintf(buf, cap,
                     "# HELP moeflow_prefix_cache_lookups_total Prompts looked up in the prefix cache.\n"
                     "# TYPE moeflow_prefix_cache_lookups_total counter\nmoeflow_prefix_cache_lookups_total %" PRId64 "\n"
                     "# HELP moeflow_prefix_cache_hit_tokens_total Prompt tokens restored from the prefix cache.\n"
                     "# TYPE moeflow_prefix_cache_hit_tokens_total counter\nmoeflow_prefix_cache_hit_tokens_total %" PRId64 "\n"
                     "# TYPE moeflow_prefix_cache_lookup_tokens_total counter\nmoeflow_prefix_cache_lookup_tokens_total %" PRId64 "\n"
                     "# HELP moeflow_prefix_cache_hit_rate Prompt tokens restored over prompt tokens looked up.\n"
                     "# TYPE moeflow_prefix_cache_hit_rate gauge\nmoeflow_prefix_cache_hit_rate %.6f\n"
                     "# TYPE moeflow_prefix_cache_bytes gauge\nmoeflow_prefix_cache_bytes{tier=\"ram\"} %" PRId64 "\n"
                     "moeflow_prefix_cache_bytes{tier=\"disk\"} %" PRId64 "\n"
                     "# TYPE moeflow_prefix_cache_blocks gauge\nmoeflow_prefix_cache_blocks{tier=\"ram\"} %" PRId64 "\n"
                     "moeflow_prefix_cache_blocks{tier=\"disk\"} %" PRId64 "\n"
                     "# TYPE moeflow_prefix_cache_evictions_total counter\n"
                     "moeflow_prefix_cache_evictions_total{tier=\"ram\"} %" PRId64 "\n"
                     "moeflow_prefix_cache_evictions_total{tier=\"disk\"} %" PRId64 "\n"
                     "# TYPE moeflow_prefix_cache_disk_total counter\n"
                     "moeflow_prefix_cache_disk_total{op=\"loaded\"} %" PRId64 "\n"
                     "moeflow_prefix_cache_disk_total{op=\"written\"} %" PRId64 "\n"
                     "moeflow_prefix_cache_disk_total{op=\"skipped\"} %" PRId64 "\n"
                     "moeflow_prefix_cache_disk_total{op=\"not_written\"} %" PRId64 "\n",
                     st.lookups, st.hit_tokens, st.lookup_tokens,
                     st.lookup_tokens ? (double)st.hit_tokens / st.lookup_tokens : 0.0, st.bytes, st.disk_bytes, st.nodes,
                     st.disk_files, st.evicted, st.disk_evicted, st.disk_loaded, st.disk_written, st.disk_skipped,
                     st.disk_failed);
    return n < 0 ? 0 : (size_t)n < cap ? (size_t)n : cap - 1;
}
