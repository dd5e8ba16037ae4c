/* The commands' side of a pipeline over several hosts (tools/ranks.h): the link opened under mpirun,
 * the split chosen on rank 0 and agreed by all, the pipe, the follower's loop and the end (stop,
 * measurements, failures reported with the lost rank and an exit without MPI calls). */
#include "tools/ranks.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sched/error.h"
#ifdef MOEFLOW_MPI
#include "sched/link_mpi.h"
#endif

/* Rank 0's split: the ranges given, or `auto` on the profile's costs and memory. */
static int mf_tool_ranks_split(mf_tool_ranks *r, const mf_config *c, const char *profile_path, int threads)
{
    if (strcmp(r->spec, "auto")) return mf_pipe_split_parse(c, r->spec, r->size, &r->split);
    static mf_profile prof;
    const mf_profile *p = NULL;
    if (profile_path) {
        int rc = mf_profile_load(profile_path, &prof);
        if (rc) return rc;
        p = &prof;
    }
    double bytes[MF_CONFIG_MAX_LAYERS + 2], ns[MF_CONFIG_MAX_LAYERS + 2];
    int rc = mf_pipe_layer_costs(c, p, threads, bytes, ns);
    if (rc) return rc;
    /* every host as this one: the profile's memory, else this machine's, 90% of it for the weights */
    double mem = p && p->host_mem_bytes ? (double)p->host_mem_bytes
                                        : (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
    return mf_pipe_split_auto(c, bytes, ns, r->size, 0.9 * mem, &r->split);
}

int mf_tool_ranks_open(mf_tool_ranks *r, const char *cmd, const char *dir, const char *profile_path, int threads,
                       int *argc, char ***argv)
{
    r->rank = 0;
    r->size = 1;
    if (!r->spec) return 0;
#ifndef MOEFLOW_MPI
    (void)cmd, (void)dir, (void)profile_path, (void)threads, (void)argc, (void)argv;
    return mf_error(-ENOTSUP, "--ranks-layers: this moeflow was built without MPI (install libopenmpi-dev, "
                    "tools/install-deps.sh, and build again)");
#else
    mf_link_mpi *l = NULL;
    int64_t lost = (int64_t)(r->timeout * 1e9);
    int rc = mf_link_mpi_open(argc, argv, &(mf_link_mpi_opts){.lost_ns = lost, .heartbeat_ns = lost / 5}, &l);
    if (rc) return rc;
    r->mpi = l;
    r->link = mf_link_mpi_ops(l);
    r->rank = r->link->rank;
    r->size = r->link->size;
    if (r->size < 2)
        return mf_error(-EINVAL, "--ranks-layers: %d process: run under mpirun -n N with N >= 2 (one per host)",
                        r->size);
    if (r->size > MF_PIPE_MAX_RANKS)
        return mf_error(-EINVAL, "--ranks-layers: %d processes (at most %d)", r->size, MF_PIPE_MAX_RANKS);
    mf_config c;
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    rc = mf_config_load(path, &c);
    if (!rc && r->rank == 0) rc = mf_tool_ranks_split(r, &c, profile_path, threads);
    if (rc && r->rank == 0) r->link->fail(r->link->ctx, mf_last_error());
    if (!rc) rc = mf_pipe_agree(r->link, &c, &r->split);
    if (!rc && r->rank == 0) {
        char s[256];
        mf_pipe_split_str(&r->split, s, sizeof s);
        fprintf(stderr, "moeflow %s: %d ranks, layers %s (rank 0: embedding, tokenizer, batcher; rank %d: head)\n",
                cmd, r->size, s, r->size - 1);
    }
    return rc;
#endif
}

void mf_tool_ranks_layers(const mf_tool_ranks *r, int *begin, int *end)
{
    *begin = *end = 0;
    if (r->size < 2) return;
    *begin = r->split.bound[r->rank];
    *end = r->split.bound[r->rank + 1];
}

int mf_tool_ranks_pipe(mf_tool_ranks *r, const mf_config *c)
{
    if (r->size < 2) return 0;
    return mf_pipe_new(c, &(mf_pipe_opts){.link = r->link, .split = r->split, .micro = (int)r->micro,
                                          .step_timeout_ns = (int64_t)(60 * r->timeout * 1e9)}, &r->pipe);
}

/* This rank's boundary (and on rank 0 logits) transfer times, one line. */
static void mf_tool_ranks_stats(const mf_tool_ranks *r, const char *cmd)
{
    mf_pipe_stats st;
    mf_pipe_stats_get(r->pipe, &st);
    if (st.n_boundary)
        fprintf(stderr, "moeflow %s: rank %d: %" PRId64 " boundaries in (%.2f MB), send to receive p50 %.1f us, "
                "p99 %.1f us\n", cmd, r->rank, st.n_boundary, st.boundary_bytes / 1e6, st.boundary_p50_ns / 1e3,
                st.boundary_p99_ns / 1e3);
    if (st.n_logits)
        fprintf(stderr, "moeflow %s: rank %d: %" PRId64 " logits messages in (%.2f MB), send to receive p50 %.1f us, "
                "p99 %.1f us\n", cmd, r->rank, st.n_logits, st.logits_bytes / 1e6, st.logits_p50_ns / 1e3,
                st.logits_p99_ns / 1e3);
}

int mf_tool_ranks_follow(mf_tool_ranks *r, const char *cmd, int quiet)
{
    int rc = mf_pipe_follow(r->pipe);
    if (!quiet && !rc) mf_tool_ranks_stats(r, cmd);
    return rc;
}

int mf_tool_ranks_end(mf_tool_ranks *r, const char *cmd, int rc, int quiet)
{
    if (!r->mpi) return rc;
#ifdef MOEFLOW_MPI
    mf_link_mpi *l = r->mpi;
    if (r->size < 2) {   /* MPI opened by one process: no pipeline, the command says why */
        char keep[MF_ERROR_MSG_BYTES];
        snprintf(keep, sizeof keep, "%s", mf_last_error());
        mf_link_mpi_close(l);
        r->mpi = NULL;
        if (rc < 0) mf_error(rc, "%s", keep);
        return rc;
    }
    char why[MF_ERROR_MSG_BYTES + 64] = "";
    if (rc < 0) snprintf(why, sizeof why, "%s", mf_last_error()[0] ? mf_last_error() : "failed");
    if (rc >= 0 && r->rank == 0 && r->pipe) {   /* a clean end, or a deliberate stop (rc > 0: an exit status) */
        int s = mf_pipe_stop(r->pipe);
        if (s) rc = s, snprintf(why, sizeof why, "%s", mf_last_error());
    }
    if (rc < 0 && !mf_link_mpi_failed(l, NULL)) {
        char m[MF_ERROR_MSG_BYTES + 160];
        snprintf(m, sizeof m, "rank %d failed: %s", r->rank, why[0] ? why : mf_last_error());
        r->link->fail(r->link->ctx, m);
    }
    if (!quiet && r->rank == 0 && r->pipe && rc >= 0) mf_tool_ranks_stats(r, cmd);
    mf_pipe_free(r->pipe);
    r->pipe = NULL;
    const char *msg = NULL;
    int failed = mf_link_mpi_failed(l, &msg);
    char told[600];
    snprintf(told, sizeof told, "%s", failed ? msg : "");
    int crc = mf_link_mpi_close(l);
    r->mpi = NULL;
    if (!crc && !failed && rc >= 0) return rc;
    /* a failure: say which rank, then leave without MPI (MPI_Finalize could wait for the lost one) */
    fprintf(stderr, "moeflow %s: rank %d: %s%s%s\n", cmd, r->rank, told[0] ? told : why[0] ? why : "the ranks did not end together",
            told[0] && why[0] && !strstr(told, why) ? "; here: " : "", told[0] && why[0] && !strstr(told, why) ? why : "");
    fflush(stdout);
    fflush(stderr);
    _exit(1);
#else
    (void)cmd, (void)quiet;
    return rc;
#endif
}
