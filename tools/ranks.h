/* The commands' side of a pipeline over several hosts (graphs/pipe/pipe.h): `moeflow decode|serve
 * ... --ranks-layers auto|a:b,c:d` under `mpirun -n N`. Their three option rows, opening the link
 * (Open MPI: sched/link_mpi.h) and agreeing on the split, the layers this rank loads, the pipe,
 * the follower's loop, and the end: the stop sent, the measurements printed, and after a failure
 * the message naming the lost rank and an exit that makes no MPI call. docs/pipeline.md. */
#ifndef MF_TOOLS_RANKS_H
#define MF_TOOLS_RANKS_H

#include <stddef.h>

#include "graphs/model/config.h"
#include "graphs/pipe/pipe.h"
#include "sched/profile.h"
#include "tools/opts.h"

typedef struct mf_tool_ranks {
    /* options */
    const char *spec;      /* --ranks-layers: "auto" or ranges a:b,c:d; NULL: one host */
    long micro;            /* --ranks-micro: micro-batches per step (0: the ranks) */
    double timeout;        /* --ranks-timeout: seconds after which a silent rank is lost */
    /* opened */
    int rank, size;        /* 0 and 1 without --ranks-layers */
    mf_pipe_split split;
    void *mpi;             /* the link (sched/link_mpi.h), or NULL */
    const mf_link_ops *link;
    mf_pipe *pipe;
} mf_tool_ranks;

/* The three rows of a command's option table for an mf_tool_ranks at offset `base` of its options. */
#define MF_TOOL_RANKS_ROWS(base)                                                                          \
    {"--ranks-layers", .kind = MF_OPT_STR, .off = (base) + offsetof(mf_tool_ranks, spec), .meta = "L",      \
     .help = "under mpirun -n N: the model split by layers over the N ranks\n"                            \
             "(hosts), auto (the least time of the slowest rank by the cost\n"                            \
             "model among the cuts that fit memory) or a:b,c:d,... (rank k\n"                              \
             "runs the layers of range k; a range begins at layer 0, a KV\n"                               \
             "source, or a window-only layer before one); rank 0 holds the\n"                              \
             "embedding, tokenizer, batcher (and server), the last the head;\n"                           \
             "logits as on one host bit for bit (docs/pipeline.md; needs MPI)"},                             \
    {"--ranks-micro", .kind = MF_OPT_LONG, .off = (base) + offsetof(mf_tool_ranks, micro), .meta = "M",     \
     .lo = 0, .hi = 64,                                                                                    \
     .help = "with --ranks-layers: micro-batches a step's sequences are cut\n"                            \
             "into, so that the ranks work at once (default 0: one per rank)"},                             \
    {"--ranks-timeout", .kind = MF_OPT_DOUBLE, .off = (base) + offsetof(mf_tool_ranks, timeout), .def = "10", \
     .meta = "S", .lo = 0.5, .hi = 3600,                                                                   \
     .help = "with --ranks-layers: a rank not heard from for S seconds is lost:\n"                        \
             "every rank then exits non-zero naming it; a step's message\n"                               \
             "waits at most 60 S"}

/* With --ranks-layers: MPI (the link), this rank, and the split (rank 0 parses or chooses it for
 * checkpoint dir's config, `auto` on profile_path's profile (NULL: built-in) with `threads`
 * workers and its host_mem_bytes or this machine's memory; the others take rank 0's); rank 0
 * prints it. Without: size 1. 0, or a negative code (mf_error: built without MPI, not under
 * mpirun, a bad split, ...). cmd names the command in messages. */
int mf_tool_ranks_open(mf_tool_ranks *r, const char *cmd, const char *dir, const char *profile_path, int threads,
                       int *argc, char ***argv);
/* The layers this rank loads: [*begin, *end) (0, 0: all). */
void mf_tool_ranks_layers(const mf_tool_ranks *r, int *begin, int *end);
/* The pipe over config c (after mf_tool_ranks_open, before the engine: its link is
 * mf_pipe_step_link(r->pipe)). 0 or a negative code. */
int mf_tool_ranks_pipe(mf_tool_ranks *r, const mf_config *c);
/* A rank > 0: follows rank 0's steps until it stops; its measurements on stderr (unless quiet). */
int mf_tool_ranks_follow(mf_tool_ranks *r, const char *cmd, int quiet);
/* The end of a command with --ranks-layers (nothing without): rank 0 stops the others (rc >= 0: a
 * clean end, or a deliberate stop whose exit status rc is) or tells them it failed (rc < 0); its
 * measurements; the link closed. After any failure (this rank's rc < 0, or one told by another) prints "moeflow <cmd>: rank R: <why>" naming the lost or
 * failed rank, flushes stdout and stderr and exits the process with status 1 without calling
 * MPI (_exit: MPI_Finalize could wait for a lost rank). Else returns rc. */
int mf_tool_ranks_end(mf_tool_ranks *r, const char *cmd, int rc, int quiet);

#endif
