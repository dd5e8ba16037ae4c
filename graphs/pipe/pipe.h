/* The model split by layers over several processes (hosts): a pipeline of stages, rank k running
 * layers [bound[k], bound[k + 1]) with the scheduled engine as one host does (its own model of
 * those layers, graphs/model/model.h mf_model_opts.layer_begin, its own cards, sockets and
 * sequence states), the stages joined by a link (sched/link.h; over Open MPI: sched/link_mpi.h).
 *
 * Rank 0 holds the embedding, the tokenizer, the batcher and the server: its forward
 * (mf_pipe_forward, the contract of graphs/step/step.h mf_step_forward) cuts the items into
 * micro-batches at sequence boundaries, and for each sends a header (per item: the sequence's
 * slot, its token, position and maximum) to rank 1 and runs its own layers, whose last task sends
 * the boundary (graphs/step/stepgraph.h mf_sg_boundary_floats per item: the hyper-connection
 * residual streams and the carried mix, fp32 as the engine holds them) on. Each later rank takes
 * the header, passes it on, and runs its layers on its own states for those slots: its first
 * task receives the boundary, its last sends it on; Engram rows come from each rank's own copy of
 * the token history, so nothing else crosses. The last rank computes the logits of the items that
 * want them and sends them back to rank 0, which samples as one host does. Micro-batch j + 1 runs
 * on rank 0 while rank 1 runs micro-batch j, so with a batch every rank works at once; at batch 1
 * the stages run in turn. Logits are the one-host engine's bit for bit (the same layers on the
 * same bits; tests/test_pipe.c, tests/py/check_mpi.py).
 *
 * Cuts respect the model's sharing: a rank begins at a layer from which no layer reads the
 * compressed KV, index keys or candidate blocks of a layer before it (graphs/model/config.h
 * mf_config_cut_ok). docs/pipeline.md has the protocol, the bounds and the measurements. */
#ifndef MF_PIPE_H
#define MF_PIPE_H

#include <stdint.h>
#include <stdio.h>

#include "graphs/model/config.h"
#include "graphs/ref/ref.h"
#include "graphs/step/step.h"
#include "sched/link.h"
#include "sched/profile.h"

#define MF_PIPE_MAX_RANKS 16
#define MF_PIPE_MAX_SLOTS 1024   /* sequence states rank 0 may use (a batcher's pool is far smaller) */

/* Rank k runs layers [bound[k], bound[k + 1]): bound[0] 0, bound[n_ranks] n_layers. */
typedef struct mf_pipe_split {
    int n_ranks;
    int bound[MF_PIPE_MAX_RANKS + 1];
} mf_pipe_split;

/* ---- cuts (graphs/pipe/pipe_cut.c) ---------------------------------------------------------- */

/* "a:b,c:d,..." (e.g. "0:4,4:8"): n_ranks ranges, contiguous from layer 0 to n_layers, each
 * beginning at a cut. -EINVAL naming the range and why. */
int mf_pipe_split_parse(const mf_config *c, const char *spec, int n_ranks, mf_pipe_split *out);

/* What each layer holds and costs, for choosing cuts: bytes[L] every tensor of layer L (dense,
 * routed experts, Engram tables: the layout's), ns[L] the cost model's price of its tasks in a
 * batch-1 decode step on profile p (NULL: the built-in machine) with n_threads workers (the step
 * graph's records summed: work, not makespan); entry n_layers the embedding (rank 0's), entry
 * n_layers + 1 the final norm and head (the last rank's). Arrays of n_layers + 2. 0 or the
 * graph's error. */
int mf_pipe_layer_costs(const mf_config *c, const mf_profile *p, int n_threads, double *bytes, double *ns);

/* The cut `auto` chooses: among the splits into n_ranks ranges at cuts whose bytes fit mem_bytes
 * on every rank (0: no limit), the one whose slowest rank's cost-model time is least (ties: the
 * least largest bytes); when none fits, the one whose largest bytes are least. -EINVAL when the
 * model has fewer cuts than ranks. */
int mf_pipe_split_auto(const mf_config *c, const double *bytes, const double *ns, int n_ranks, double mem_bytes,
                       mf_pipe_split *out);

/* "0:20,20:40" into buf. */
void mf_pipe_split_str(const mf_pipe_split *s, char *buf, size_t cap);

/* Per rank: its layers, GiB held and share of the cost-model time, one line each, to f. */
void mf_pipe_split_print(const mf_pipe_split *s, const double *bytes, const double *ns, int n_layers, FILE *f,
                         const char *prefix);

/* ---- the pipeline (graphs/pipe/pipe.c) ------------------------------------------------------- */

typedef struct mf_pipe_opts {
    const mf_link_ops *link;      /* the transport: its rank and size are the pipeline's */
    mf_pipe_split split;          /* n_ranks = link size */
    int micro;                    /* rank 0: micro-batches a forward's items are cut into (0: n_ranks) */
    int64_t step_timeout_ns;      /* a step's messages wait at most this (0: 600 s); idle waits for
                                   * the next step are bounded only by the link's lost-rank bound */
} mf_pipe_opts;

typedef struct mf_pipe mf_pipe;

/* This rank's side of the pipeline over config c (the checkpoint every rank opened). 0, -EINVAL
 * (a split that does not match the link or the config), -ENOMEM. */
int mf_pipe_new(const mf_config *c, const mf_pipe_opts *o, mf_pipe **out);
void mf_pipe_free(mf_pipe *p);

/* Rank 0 sends its split and the config's shape to every rank; the others receive them (waiting
 * as long as every rank is alive) and check the shape against their own config. After it every
 * rank has rank 0's split in *s. 0, -EINVAL on a different model, or the link's error. */
int mf_pipe_agree(const mf_link_ops *l, const mf_config *c, mf_pipe_split *s);

/* The engine link of this rank (graphs/step/step.h mf_step_opts.link) for its engine over a
 * model of its layers. */
mf_step_link mf_pipe_step_link(mf_pipe *p);
/* The forward and engine of this rank (r's states are the followers' sequence states). */
void mf_pipe_attach(mf_pipe *p, mf_ref *r, mf_step *eng);

/* Rank 0: a forward over the pipeline, the contract of mf_step_forward (graphs/step/step.h; ctx is
 * the pipe, so it serves as graphs/step/batch.h mf_batch_opts.forward). A failure (here or on any
 * rank) is told to every rank and returned; the pipeline is then unusable. */
int mf_pipe_forward(void *ctx, mf_ref_state *const *states, const int32_t *tokens, int n, float *const *logits);
/* Ranks > 0: runs the steps rank 0 sends until it sends stop (0) or something fails (the error,
 * told to every rank), on sequence states of its own (created as rank 0's slots appear, freed
 * when it returns: the attached forward must outlive the call). */
int mf_pipe_follow(mf_pipe *p);
/* Rank 0: tells every rank to stop (their mf_pipe_follow returns 0). */
int mf_pipe_stop(mf_pipe *p);

/* Tells every rank that this one fails with msg (mf_link_ops.fail). */
void mf_pipe_fail(mf_pipe *p, const char *msg);

/* What this rank measured: boundaries received (count; the time from the sender posting one to
 * this rank having it, p50 and p99, ns: one machine's monotonic clock, so meaningful across
 * processes of one host only), and on rank 0 the logits messages likewise; steps run. */
typedef struct mf_pipe_stats {
    int64_t n_boundary, n_logits, steps;
    int64_t boundary_p50_ns, boundary_p99_ns, logits_p50_ns, logits_p99_ns;
    double boundary_bytes, logits_bytes;   /* summed */
} mf_pipe_stats;
void mf_pipe_stats_get(const mf_pipe *p, mf_pipe_stats *out);

#endif
