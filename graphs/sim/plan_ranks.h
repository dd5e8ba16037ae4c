/* The simulator of a pipeline over several hosts (graphs/pipe/pipe.h): each rank's stage is the
 * engine's step graph of its layers (graphs/sim/plan.h with layer_begin/_end, its boundary tasks
 * MF_SG_NET_*) simulated on the host profile at each micro-batch's size, and the stages are put
 * together as the pipeline runs them: rank 0 runs its micro-batches one after another; rank r
 * starts micro-batch j once it finished j - 1 and j's boundary arrived (the boundary task's
 * record priced on the profile's link: sched/cost.h mf_cost_net); the last rank's logits go back
 * to rank 0 the same way; a step ends when rank 0 has the last micro-batch's logits (the next
 * step's tokens are sampled from them). Transfers on one link are not made to wait for each other
 * (a step's boundaries follow each other on it). docs/pipeline.md. */
#ifndef MF_PLAN_RANKS_H
#define MF_PLAN_RANKS_H

#include <stdio.h>

#include "graphs/pipe/pipe.h"
#include "graphs/sim/plan.h"

typedef struct mf_plan_ranks_opts {
    const mf_plan_opts *host;     /* every host's options (profile, placement, batch, store, ...) */
    mf_pipe_split split;
    int micro;                    /* micro-batches a step's batch is cut into (0: the ranks; at most the batch) */
    int warmup, steps;            /* per rank and micro-batch size, as mf_plan_run */
    /* the memory a host gives the weights (0: the profile's host_mem_bytes; both 0: no limit, the
     * host options' store as given): a rank whose layers do not fit streams its routed experts
     * through a store of what is left, and its Engram tables too when they do not fit either */
    double host_mem_bytes;
} mf_plan_ranks_opts;

#define MF_PLAN_RANKS_SIZES 2     /* a batch cut into micro-batches of two sizes at most */

typedef struct mf_plan_ranks_report {
    int n_ranks, micro, batch;
    double step_ns, token_ns, tokens_per_s;
    double boundary_ns[MF_PLAN_RANKS_SIZES], logits_ns[MF_PLAN_RANKS_SIZES];   /* per micro-batch size */
    /* the other design: sampling on the last rank, the tokens sent back (4 bytes an item) instead
     * of the logits (what the pipeline does: rank 0 samples, serves logprobs, writes --logits-out) */
    double tokens_back_ns[MF_PLAN_RANKS_SIZES], tokens_per_s_sampled_last;
    int size[MF_PLAN_RANKS_SIZES], n_size;   /* the micro-batch sizes */
    struct {
        int l0, l1;
        double bytes, expert_bytes, table_bytes;   /* what its layers hold (the layout's) */
        int store, tables;                         /* mf_plan_store it runs with */
        double store_budget;
        double stage_ns[MF_PLAN_RANKS_SIZES];      /* its stage's step at each micro-batch size */
        double busy;                               /* its stages' time / the step's */
        char bottleneck[24];                       /* its stage's busiest lane (the largest size's) */
    } rank[MF_PIPE_MAX_RANKS];
} mf_plan_ranks_report;

/* Simulates the split: 0, or a negative code (a rank's plan's, naming the rank). */
int mf_plan_ranks_run(const mf_plan_ranks_opts *o, mf_plan_ranks_report *out);
void mf_plan_ranks_print(const mf_plan_ranks_report *r, FILE *f);
void mf_plan_ranks_json(const mf_plan_ranks_report *r, FILE *f);

#endif
