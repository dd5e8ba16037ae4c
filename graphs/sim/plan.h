/* The simulator of real decode steps: runs the graph one scheduled decode step runs (the engine's
 * own, from graphs/step/stepgraph.h), prices each task's record from a hardware profile
 * (sched/profile.h), keeps the expert caches (host store, per-card device caches) across steps
 * with the engine's replacement policy, places and marks noop tasks as the engine's route task,
 * and runs it in virtual time (sched/sim.h). Never reads tensor data: a config is enough
 * (docs/sim.md). */
#ifndef MF_PLAN_H
#define MF_PLAN_H

#include <stdint.h>
#include <stdio.h>

#include "graphs/model/config.h"
#include "graphs/sim/routing.h"
#include "graphs/step/step.h"
#include "sched/profile.h"

/* Replacement policy of the simulated device expert caches (sched/residency.h). LFU is what
 * device/expert_cache.c and host/store.c run (LFU with aging, LRU among equal counts); LRU is
 * offered for tuning. */
/* Where the dense work (attention linears, router gate, shared expert, head) runs. */
typedef enum mf_plan_dense { MF_PLAN_DENSE_HOST = 0, MF_PLAN_DENSE_CARDS } mf_plan_dense;

typedef enum mf_plan_cache_policy {
    MF_PLAN_CACHE_LFU = 0,
    MF_PLAN_CACHE_LRU
} mf_plan_cache_policy;

/* Where the experts (and Engram tables) live on the host: all in memory, or a cache of a byte
 * budget whose misses are read from disk on the IO lane (host/store.h). */
typedef enum mf_plan_store {
    MF_PLAN_STORE_RESIDENT = 0,
    MF_PLAN_STORE_STREAMED
} mf_plan_store;

typedef struct mf_plan_opts {
    const mf_config *config;     /* the model (validated); no files needed */
    const mf_profile *profile;   /* the machine */
    int placement;               /* mf_step_placement: host, seed or hybrid */
    int n_cards;                 /* cards for seed/hybrid (0: the profile's n_cards) */
    int n_sockets;               /* sockets whose threads run the engine (0: the profile's) */
    int threads_per_socket;      /* engine workers per socket (0: the profile's) */
    int batch;                   /* sequences per decode step, 1..MF_STEP_MAX_ITEMS (0: 1) */
    int64_t context;             /* tokens already in each sequence at the first step (0: 16) */
    int read_window;             /* streamed store: slots whose reads are in flight (0: 2, -1: all) */
    int copy_slots;              /* per card: copy-in streams (0: 1, the engine's one stream) */
    uint64_t dev_cache_bytes;    /* per card (0: every expert, halved until card_mem_bytes holds it) */
    int dev_cache_policy;        /* mf_plan_cache_policy */
    int dev_cache_fill;          /* 1: the caches start warm (mf_step_opts.dev_cache_fill): each card's slots
                                  * filled by device/expert_cache.h mf_dev_xcache_fill_plan, by the counts of
                                  * a trace routing (mf_routing_counts) else spread over layers; 0: empty */
    int store;                   /* mf_plan_store for routed experts */
    uint64_t store_budget_bytes; /* streamed: slab bytes (0: 2 GiB, as host/store.h) */
    int tables;                  /* mf_plan_store for Engram tables (reads per step when streamed) */
    int dev_graphs;              /* 1: a layer's FFNs on a card are one device graph (mf_step_opts.dev_graphs) */
    int dense;                   /* mf_plan_dense: the dense work on the host (0) or on the cards (n_cards or
                                  * the profile's; mf_sg_dense_card; their weights leave the rest to the caches) */
    int dense_split;             /* mf_sg_dense_split: dense cards by layer ranges (0) or by rows across all
                                  * (mf_sg_dense_rows; mf_sg_dense_card_bytes per card) */
    int in_split;                /* mf_sg_in_mode: the in stage split by rows or items (mf_step_opts.in_split) */
    int heads;                   /* mf_sg_heads_mode: with dense cards, the attention heads of a prefill chunk
                                  * (a serial graph) by cost (0), on the cards or on the host (mf_step_opts.heads) */
    int micro;                   /* 2: two micro-batches in flight (mf_step_opts.micro; routing drawn per
                                  * half as the engine routes it); 0 or 1: one */
    int lt;                      /* mf_sg_lt_mode: where the cards' tensor cores take work through cuBLASLt
                                  * (mf_step_opts.lt; 0: by the cost model on the profile) */
    double dev_task_ns;          /* emulated cards: the host core time of one device task's round
                                  * trip (`moeflow bench devtasks`; 0: the profile's card_fp4_latency_ns) */
    double cpu_bytes_per_s;      /* overrides the engine's model of host expert work per worker, as
                                  * mf_step_opts.cpu_bytes_per_s (0: from the profile, as an engine
                                  * given it: mf_step_lane_models) */
    /* 1: every step is a prefill chunk of `batch` positions of one sequence (the engine's serial
     * graph, mf_step_prefill), the first at position `context` (0: the prompt's start); the head
     * runs only where set_logits says (mf_plan_prefill: the prompt's last position) */
    int prefill;
    int chunk;                   /* the engine's prefill chunk (mf_step_opts.prefill_chunk; 0: MF_STEP_PREFILL_CHUNK,
                                  * a prefill plan's batch when longer): its buffers are among those held back
                                  * from the card caches (mf_sg_card_reserve) */
    int prefetch_min;            /* mf_sg_opts.prefetch_min: a prefill chunk's experts placed and copied in
                                  * at each layer's start from this many positions (0: mf_sg_prefetch_min,
                                  * < 0: never), as mf_step_opts.prefetch_min */
    /* Speculative decoding (docs/dspark.md). unit_len > 1: every one of the batch's sequences runs
     * unit_len consecutive positions (a verify of its anchor and unit_len - 1 candidates) as one
     * unit of the engine's graph, each item with logits; the routing draws a unit's tokens as its
     * sequence's consecutive tokens (mf_routing_next_units); batch x unit_len <= MF_STEP_MAX_ITEMS.
     * draft 1..dspark_block_size: instead a DSpark draft round of the batch's sequences proposing
     * that many candidates each (the builder's draft graph on the host, routed by uniform draws of
     * the draft's experts; the routing below is the backbone's and not used). feats 1: the step's
     * graph hands out the draft's features (an engine made with mf_step_opts.draft). 0: none.
     * draft_cards 1 (with cards): the draft's routed experts are held on the cards while speculation
     * pays (docs/dspark.md "The draft's experts on the cards"): one cache a card over the
     * backbone's and the draft's experts, in which each card keeps its owned share of the draft's
     * (mf_dev_xcache_owner of the stage's layer n_layers + s, mf_dev_xcache_owned) resident, so a
     * draft round's MoE takes card slots, every one a hit, and a step's backbone experts have that
     * many slots fewer; 0: the draft's experts on the host and the backbone's cache whole. */
    int unit_len, draft, feats, draft_cards;
    mf_routing *routing;         /* borrowed; NULL: uniform draws from `seed` */
    uint64_t seed;
    /* A pipeline stage (graphs/pipe/pipe.h): the engine's graph of layers [layer_begin, layer_end)
     * only, with its boundary tasks (MF_SG_NET_*); the boundary in is priced 0 here (the data has
     * arrived: graphs/sim/plan_ranks.h prices the link between stages), the boundary out one
     * message's latency; dense cards hold the stage's layers only. Both 0: all. */
    int layer_begin, layer_end;
} mf_plan_opts;

#define MF_PLAN_MAX_LANES 64

/* What simulated steps cost: one step (mf_plan_step) or the sum over steps (mf_plan_total, whose
 * times are per-step means). Phases as mf_step_times (graphs/step/step.h): per phase the union of its
 * tasks' intervals, OTHER = the rest of the step. */
typedef struct mf_plan_report {
    int n_steps, batch;
    int64_t step_ns;                          /* makespan of a step */
    double token_ns;                          /* step_ns / batch */
    int64_t phase_ns[MF_STEP_N_PHASES];
    int64_t busy_ns[MF_STEP_N_PHASES];        /* summed task durations per phase */
    int n_lanes;
    struct {
        char name[24];
        int64_t busy_ns;                      /* summed durations of the lane's tasks */
        double share;                         /* busy_ns / slots / step_ns: 1 = always full */
        int slots;                            /* the lane's concurrency */
    } lanes[MF_PLAN_MAX_LANES];
    int bottleneck;                           /* the lane with the largest share */
    int n_tasks;
    /* routed-expert slots (one per distinct expert of a layer's batch) */
    int64_t dev_slots, host_slots, host_fallbacks;
    /* device expert caches, summed over cards: hits + misses = dev_slots */
    uint64_t dev_hits, dev_misses, dev_evictions, dev_bytes_in;
    /* host expert store (streamed): hits + misses = slots that needed the host copy */
    uint64_t store_hits, store_misses, store_evictions, store_bytes_read;
    uint64_t table_bytes_read;                /* streamed Engram rows */
    /* the warm fill before the first step (dev_cache_fill), once, kept by mf_plan_reset_totals:
     * experts and bytes over all cards; its time: the larger of bytes / h2d_total_bytes_per_s and
     * the fullest card's bytes / h2d_bytes_per_s */
    int64_t fill_experts;
    double fill_bytes, fill_ns;
    /* card 0's memory, set at the start: its dense weights, the steps' buffers held back from its
     * cache (mf_sg_card_reserve; with --dev-cache this graph's), its cache's slots; card_in_whole:
     * the dense cards hold all the in stage's rows (graphs/step/stepgraph.h mf_sg_in_whole) */
    double card_weights, card_bufs, card_cache;
    int card_slots, card_in_whole;
    /* the host's buffers of this step's graph, as the engine lays them out (graphs/step/step.h
     * mf_step_host_bytes: a decode batch's bucket), set at the start */
    double host_bufs;
    /* per op (mf_sg_op, named by mf_sg_op_name): summed task durations on the CPU lanes and on
     * the other lanes (cards' copies and compute, IO), and the tasks that ran (noop ones left out) */
    int64_t op_cpu_ns[MF_SG_N_OPS], op_other_ns[MF_SG_N_OPS];
    int op_tasks[MF_SG_N_OPS];
} mf_plan_report;

typedef struct mf_plan mf_plan;

/* Checks the options (each bad one fails with -EINVAL naming it and the accepted range) and sets up
 * lanes, cost models and empty caches. */
int mf_plan_new(const mf_plan_opts *o, mf_plan **out);
void mf_plan_free(mf_plan *p);

/* Simulates the next decode step: draws its routing, places the slots (mf_sg_placer, as the
 * engine), updates the caches, marks the noop tasks, prices the records, runs mf_sim_run_opts.
 * `out` (may be NULL) gets that step's report; the totals accumulate. */
int mf_plan_step(mf_plan *p, mf_plan_report *out);
/* Sums over the steps so far, times as per-step means (n_steps 0: all zero). */
void mf_plan_total(const mf_plan *p, mf_plan_report *out);
/* Forgets the totals (caches stay warm): for warm-up steps. */
void mf_plan_reset_totals(mf_plan *p);

/* Convenience: warmup steps then n_steps steps, the report of the latter. */
int mf_plan_run(const mf_plan_opts *o, int warmup, int n_steps, mf_plan_report *out);

/* Time to first token of an n_prompt-token prompt: the engine's prefill (mf_step_prefill) as
 * chunks of `chunk` positions (0: MF_STEP_PREFILL_CHUNK) through its serial graph, priced as
 * mf_plan_step does, each chunk at its positions (the attention's work grows with them), caches
 * starting empty; a shorter last chunk runs on its own graph (its caches start empty too), and
 * only the last position runs the head. o's batch, context and prefill are ignored. *ttft_ns: the
 * chunks' makespans summed; out (may be NULL): the full chunks' totals as mf_plan_total (per-chunk
 * means; batch = chunk), or the last chunk's when the prompt is shorter than one chunk. */
int mf_plan_prefill(const mf_plan_opts *o, int64_t n_prompt, int chunk, mf_plan_report *out, int64_t *ttft_ns);
/* As mf_plan_prefill, and with trace_path set, the Chrome trace (mf_plan_write_trace) of the last
 * full chunk (the shorter last chunk's when the prompt is shorter than one chunk). */
int mf_plan_prefill_trace(const mf_plan_opts *o, int64_t n_prompt, int chunk, mf_plan_report *out,
                          int64_t *ttft_ns, const char *trace_path);
/* As mf_plan_prefill_trace for a prompt whose first n_cached positions the caches already hold (a
 * prefix cache's hit, graphs/prefix/prefix.h): the chunks cover positions [n_cached, n_prompt) and
 * start at n_cached. The restore itself (a copy of the window's rows and a page) is not priced.
 * -EINVAL unless 0 <= n_cached < n_prompt. */
int mf_plan_prefill_at(const mf_plan_opts *o, int64_t n_cached, int64_t n_prompt, int chunk, mf_plan_report *out,
                       int64_t *ttft_ns, const char *trace_path);

/* The step graph the simulator runs: the engine's for this shape (graphs/step/stepgraph.h). */
const mf_stepgraph *mf_plan_graph(const mf_plan *p);

/* Chrome trace-event JSON of the last simulated step (sched/timeline.h). */
int mf_plan_write_trace(const mf_plan *p, const char *path);
/* The report as tables: per-token time, phases, lanes with busy shares, the bottleneck, caches. */
void mf_plan_print(const mf_plan_report *r, FILE *f);

#endif
