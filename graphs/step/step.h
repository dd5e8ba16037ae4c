/* The scheduled decode engine: one forward step (a batch of (sequence, token) items) as a scheduler
 * graph, built once per batch size and re-run: hyper-connection mixes, attention (its linears split
 * by rows across workers), router, a fixed number of routed-expert slots (split by rows across
 * workers), the shared expert, a fixed-order combine; Engram and the head likewise. Sequences keep their caches in mf_ref_state (graphs/ref/ref.h),
 * so the reference and this engine can continue each other's sequences. Layout: docs/decode.md. */
#ifndef MF_STEP_H
#define MF_STEP_H

#include <stdint.h>

#include "graphs/ref/ref.h"
#include "graphs/step/stepgraph.h"
#include "sched/graph.h"

typedef struct mf_dev mf_dev;
typedef struct mf_profile mf_profile;

/* Items per graph run of several sequences at most (mf_step_opts.max_batch: larger calls of
 * mf_step_forward are cut into chunks of that many) and sequences per decode step. */
#define MF_STEP_MAX_ITEMS MF_SG_MAX_ITEMS
/* mf_step_opts.max_batch's default */
#define MF_STEP_DEFAULT_BATCH 64
/* Items of one graph run of a DSpark draft round at most (mf_step_draft: its sequences' blocks of
 * dspark_block_size items): a head's pass of rows (MF_SG_HEAD_ROWS), one item per item group */
#define MF_STEP_DRAFT_ITEMS MF_SG_HEAD_ROWS
/* Positions of one sequence per graph run of mf_step_prefill at most (mf_step_opts.prefill_chunk):
 * its serial graph runs the per-item tasks over item groups (graphs/step/stepgraph.h). */
#define MF_STEP_MAX_CHUNK MF_SG_MAX_CHUNK
/* Positions per graph run of mf_step_prefill by default (mf_step_opts.prefill_chunk), chosen by
 * measurement (docs/decode.md "Prefill chunks": on demo, 2 threads, 512 took the least CPU time
 * per 2,048-token prefill of 64, 256, 512, 1024 and 2048); the simulator's prefill uses it too. */
#define MF_STEP_PREFILL_CHUNK 512
/* Items whose logits a dense card's head computes at a time: its logits buffer holds this many rows
 * of the vocabulary (a decode batch of 64's), and a larger batch or a prefill chunk asking logits
 * at more positions takes passes, each copied out before the next (a buffer for every position of an
 * 8,192-position chunk would be 4.2 GB of a card at flash41's vocabulary). */
#define MF_STEP_HEAD_ROWS MF_SG_HEAD_ROWS

/* A pipeline stage's link to its neighbours (graphs/pipe/pipe.h): an engine over a model of layers
 * [b, e) (graphs/model/model.h mf_model_layers) with b > 0 receives each graph run's boundary
 * (its items' mf_sg_boundary_floats each, in item order: residual streams, then the carried mix)
 * through recv before its first layer, and with e < n_layers hands it on through send after its
 * last layer (in place of the head). Both are called once per graph run from the graph's boundary
 * tasks on the engine's boundary lane ("net", one thread), so the run's other tasks (Engram rows
 * from the token history) go on meanwhile; each returns 0 or a negative code with a message
 * (mf_error), which fails the run. send must be done with buf when it returns. */
typedef struct mf_step_link {
    void *user;
    int (*recv)(void *user, float *buf, int64_t n_floats);
    int (*send)(void *user, const float *buf, int64_t n_floats);
} mf_step_link;

typedef struct mf_step_opts {
    int n_threads;     /* CPU workers of the engine's executor (0: 1) */
    /* Items of a graph run of several sequences at most, 1..MF_STEP_MAX_ITEMS (0:
     * MF_STEP_DEFAULT_BATCH): mf_step_forward cuts larger calls of several sequences into runs of
     * this many, mf_step_decode refuses more sequences (-EINVAL), and with cards it is the batch
     * whose buffers the engine keeps free beside the expert caches (a larger max_batch leaves them
     * fewer slots). Graphs and host buffers are sized for what a step asks, not for this: a step of
     * n items runs the graph of its bucket (graphs/step/stepgraph.h mf_sg_bucket), built on that
     * bucket's first step. With the continuous batcher a step holds up to the running sequences'
     * decode tokens plus its prefill budget: the batch plus step_tokens (graphs/step/batch.h). */
    int max_batch;
    int pin_threads;   /* 1: bind workers to cores (hwloc) */
    /* 0 (default): routed experts through the FP4 int8 kernels (activations quantized to int8 per
     * 256 inputs, ~1% error per matmul), the shared expert fused without the reference's bf16
     * roundings inside the FFN. 1: every expert matmul on the fp32 kernel path with the
     * reference's bf16 roundings, so only the summation order differs from the reference. */
    int exact;
    /* With an expert store: slots whose reads are in flight at once, in slot order (0: 2; < 0:
     * all at once), so that the first experts arrive early and their compute overlaps the rest */
    int read_window;
    /* positions of one sequence per graph run in mf_step_prefill (0: MF_STEP_PREFILL_CHUNK; at
     * most MF_STEP_MAX_CHUNK, and fewer where the expert store's budget says so): a prompt holds
     * one chunk's activations at a time (the engine keeps one shape longer than 64 items,
     * replaced when a prompt's last chunk is shorter) */
    int prefill_chunk;
    /* Routed experts on devices (docs/decode.md "Placement"): dev (device/dev.h, opened by the
     * caller, outlives the engine) and a placement; dev NULL or MF_STEP_PLACE_HOST: all on the
     * host. Every card keeps packed experts in an expert cache (device/expert_cache.h) of
     * dev_cache_bytes (0: every expert, or as many as the card grants). Device slots run the
     * int8 path, so placements other than host need exact 0, a swiglu limit and FP4 experts.
     * On emulated cards (emu:N) the logits equal the host placement's bit for bit; on CUDA cards
     * they equal them within tolerance, not bit for bit (fp32 summation order inside each expert:
     * docs/device.md gives the kernels' bounds). */
    mf_dev *dev;
    int placement;               /* mf_step_placement */
    uint64_t dev_cache_bytes;    /* per card */
    int64_t dev_wait_ns;         /* the scheduler's bound on a device completion (mf_sched_opts) */
    /* 1 (`moeflow decode --dev-cache-fill on`, the command's default with cards): warm the
     * expert caches at mf_step_new, before the first step: each card's cache is filled up to its
     * slots with the experts device/expert_cache.h mf_dev_xcache_fill_plan picks for it (the card
     * owns them; by dev_fill_counts, the most routed first, else spread evenly over the layers),
     * copied on the card's copy-in stream through the device API as a miss's copy is, then the
     * caches' counters zeroed (the fill is no decode miss; mf_step_fill says what it moved). The
     * copies come from the host's resident experts or the store's present ones (a streamed
     * store's absent experts are left out). dev_fill_progress 1: progress on stderr. 0: the
     * caches start empty and fill by misses (the library's default). */
    int dev_cache_fill;
    const uint32_t *dev_fill_counts;   /* n_layers x n_routed_experts accesses (read at mf_step_new), or NULL */
    int dev_fill_progress;
    /* 1 (`moeflow decode --dev-graphs`): per layer and card, the device FFNs of all slots are one
     * graph (CUDA graph on CUDA cards), captured on the layer's first run with the experts and
     * rows passed through a device-side slot table, so a new routing needs no new capture; the
     * card's FFNs then start once all its copy-ins of the layer are done. 0: a task per slot. */
    int dev_graphs;
    /* mf_step_dense (`moeflow decode --dense`): MF_STEP_DENSE_CARDS puts the dense work (attention
     * linears, router gate, shared expert, head) on dev's cards by layer ranges
     * (mf_sg_dense_card: cut at KV-source layers, the head on the last layer's card), each
     * sublayer's activations copied in and out (graphs/step/stepgraph.h MF_SG_DENSE_*), whatever
     * the placement of the routed experts; the attention core, norms and mixes stay on the host.
     * Each dense card holds its layers' weights resident (copied at mf_step_new; a card without
     * room fails it with -ENOMEM naming the card and the bytes; mf_step_dense_bytes) and runs each
     * sublayer as device launches on its compute stream (device/dev.h mf_dev_linear and the
     * roundings): emulated cards run the host code, logits bit for bit the host placement's; CUDA
     * cards the card kernels, logits within tolerance (docs/device.md; never run on a GPU yet).
     * MF_STEP_DENSE_HOST (0): on the host. */
    int dense;
    /* With dense cards, graphs/step/stepgraph.h mf_sg_dense_split (`--dense-split`): each layer's
     * dense work on one card by layer ranges (MF_SG_SPLIT_LAYERS, 0), or every dense matrix but
     * the shared expert split by output rows across all the cards (MF_SG_SPLIT_ROWS: each card
     * computes and copies out its rows, mf_sg_dense_rows; logits the same bits). */
    int dense_split;
    /* With MF_SG_SPLIT_ROWS, graphs/step/stepgraph.h mf_sg_in_mode (`--in-split`): the attention's in
     * stage split by rows or by items over the dense cards, per shape and layer by cost (0: every
     * card holds all its rows), by rows only, or by items wherever it can (tests); logits the same
     * bits. */
    int in_split;
    /* With dense cards, the items a dense chain's item block holds at least (graphs/step/stepgraph.h
     * mf_sg_dense_blocks: a long prefill chunk's copies run beside the card's work block by block;
     * the logits are the same bits in any blocks). 0: MF_SG_DENSE_BLOCK. */
    int dense_block;
    /* With dense cards, graphs/step/stepgraph.h mf_sg_heads_mode (`--heads`): where the attention
     * heads' scores and values of a graph of one sequence's positions (a prefill chunk, batch-1
     * decode) run: MF_SG_HEADS_COST (0) per layer by the cost model on `profile` (the host, the
     * layer's dense card or all of them, heads split: mf_sg_heads_choice), MF_SG_HEADS_CARDS on the
     * cards wherever the card op takes the layer, MF_SG_HEADS_HOST on the host. On the cards the
     * host gathers the chunk's key table, prepares the queries and inverse-ropes the outputs
     * (graphs/step/stepgraph.h MF_SG_ATTN_GATHER ...); device/dev.h mf_dev_attn_heads computes the
     * rest: emulated cards the host's bits (logits bit for bit the host placement's), CUDA cards
     * within tolerance (CUDA's expf; never run on a GPU yet). */
    int heads;
    /* graphs/step/stepgraph.h mf_sg_lt_mode (`--cublaslt`): where the cards' tensor cores take work
     * through cuBLASLt (device/dev.h "The cuBLASLt path"): MF_SG_LT_COST (0) where the cost model on
     * `profile` prices it below the CUDA cores (never without a tensor-core rate: the built-in
     * machine, and every emulated card's calibration), MF_SG_LT_ON wherever it applies, MF_SG_LT_DENSE
     * the dense linears only, MF_SG_LT_OFF nowhere. The dense linears on it (those reading bf16
     * values: mf_sg_lt_dense_ok) give the host placement's logits bit for bit on emulated cards, of
     * either 16-bit type (tc=bf16 or fp16; an FP16 matrix whose scales span more binades than FP16
     * holds keeps the CUDA cores, as any matrix of a card without tensor cores); the routed experts on
     * it do not: their x and h are cast to 16 bits where the int8 path quantizes them to 8 (relative
     * differences of the int8 path's size, docs/device.md). Off when a card in use has no tensor
     * cores (tc=none, CUDA before sm_70). */
    int lt;
    /* Tests only (a mutation the bit-identity checks must catch): 1 makes the heads on cards
     * compute with their scale 1% off. 0: off. */
    int heads_fault;
    /* Tests only, as heads_fault: 1 makes the index scores on cards (graphs/step/stepgraph.h
     * MF_SG_D_SCORES, where the heads run on cards) leave out their last index head. 0: off. */
    int scores_fault;
    /* Tests only: > 0 lowers the visible entries the index scores on cards take (beyond them a
     * chunk's selects score on the host) below the engine's 16,384, to reach that path. 0: off. */
    int scores_entries;
    /* Tests only: > 0 lowers the compressed entries the heads on cards take in their key table
     * (beyond them a chunk's q preps run the host's heads: mf_step_shape.hk_host) below the card
     * buffer's. 0: off. */
    int heads_entries;
    /* Tests only: > 0 lowers the items whose logits a dense card's head computes at a time (the
     * rows of its logits buffer, MF_STEP_HEAD_ROWS) to reach the passes. 0: MF_STEP_HEAD_ROWS. */
    int head_rows;
    /* 2 (`moeflow decode --micro-batches 2`): two micro-batches in flight for batches of two or
     * more sequences (graphs/step/stepgraph.h mf_sg_opts.micro): each half of the batch routed,
     * placed and combined on its own, one half's MoE beside the other's attention; the logits are
     * those of one micro-batch bit for bit. 0 or 1: one. */
    int micro;
    /* The experts' prefetch of a prefill chunk (graphs/step/stepgraph.h mf_stepgraph.prefetch): with
     * routed experts on cards and no store, a chunk of at least this many positions places every
     * expert of a layer at the layer's start by its expected tokens and copies the card's ones in
     * while the layer's attention runs (the slots then copy only their rows). 0: from
     * mf_sg_prefetch_min positions (every expert expected used), < 0: never. The logits are the
     * same bits either way. */
    int prefetch_min;
    /* With dev used (a placement other than host, or dense cards), every card first runs the
     * startup self-check (device/dev_check.h: each kernel once against the host's); a card that
     * fails is refused (mf_step_refused says which, with the kernel and error) and the engine
     * continues: routed experts on the host, the dense work on the cards that passed (the host
     * when none did). 1: no self-check (tests that count device operations). */
    int no_selfcheck;
    /* Tests only (a mutation the bit-identity checks must catch): 1 makes card 0's dense tasks
     * split by rows compute one row fewer than they own (its last row is left as the card's
     * buffer holds it, then copied out). 0: off. */
    int dense_fault_skip_row;
    /* the machine's hardware profile (sched/profile.h, e.g. from `moeflow calibrate`), or NULL:
     * the lanes' cost models (priorities, and what hybrid placement weighs) come from it, see
     * mf_step_lane_models; NULL: the built-in assumptions listed there */
    const mf_profile *profile;
    /* overrides the CPU lane's model of expert work (bytes of weights per second per worker) when
     * > 0: what hybrid placement weighs a card against */
    double cpu_bytes_per_s;
    /* The engine's IO lane (with an expert store): reads in flight (0: 64), pread workers instead
     * of io_uring (io_force_pread 1), fault injection on its nth read (io_fault_kind
     * MF_IO_FAULT_EIO or _SHORT, sched/sched.h; 0: none). The moeflow command fills them from
     * --io-depth, MOEFLOW_IO and MOEFLOW_IO_FAULT; the library reads no environment variable. */
    int io_depth;
    int io_force_pread;
    int io_fault_kind;
    int64_t io_fault_nth;
    /* > 1 (`moeflow decode --sockets N`): one CPU lane per socket (sched/sched.h mf_topo_sockets:
     * the NUMA nodes with cores of `topology`), the n_threads workers split across them in
     * proportion to their cores, each pinned to its socket's cores when pin_threads is set. Every
     * matrix the host computes in row parts (a routed expert run on the host; the dense weights
     * the host keeps: attention stages, Engram wkv, router gate, shared expert, head) is shared
     * by all the sockets: each socket's workers compute its share of the matrix's output rows
     * (sched/sched.h mf_topo_rows: where the store and the model put them when created with the
     * same socket count; graphs/step/stepgraph.h mf_sg_stage_rows); the host tasks with other
     * weights (the core's, the Engram gate's) run on socket 0's lane. Logits are the one-lane
     * engine's bit for bit. -EINVAL when the topology has fewer sockets, or fewer than n_threads
     * can share. 0 or 1: one CPU lane. */
    int n_sockets;
    const char *topology;        /* mf_sched_opts.topology (NULL: this machine) */
    /* 1 (`--spec dspark`, docs/dspark.md): the DSpark draft runs on this engine. Every step's graph
     * hands out the draft's features where asked (mf_step_forward_feat: per unit, a parallel or
     * mixed graph's item group, a task at each target layer), and mf_step_draft runs the draft's
     * rounds as graphs of their own (the same builder: graphs/step/stepgraph_draft.c). The model
     * must be loaded with its draft (mf_model_opts.load_draft), its experts resident, all its
     * layers (not a pipeline stage); -EINVAL otherwise. 0: neither (the graphs are as before). */
    int draft;
    /* With a model of some layers only (a pipeline stage): its link (required on the sides it
     * has neighbours, -EINVAL otherwise). Such a stage embeds no tokens unless its first layer is
     * 0 and computes logits only when its last layer is the model's (mf_step_forward's logits
     * must be NULL otherwise); its dense cards hold and run its layers only (mf_sg_dense_card_in). */
    mf_step_link link;
} mf_step_opts;

/* Where routed experts run. SEED: every routed expert on the card that owns it
 * (mf_dev_xcache_owner); attention, router, shared expert and combine on the host. HYBRID: per
 * expert and per step the cheaper, by the lanes' cost models, of the host (its queue of expert
 * work over the workers) and the owner card (zero copy on a cache hit, else the packed expert's
 * bytes over the copy lane, then the compute lane). An expert whose card has every cache slot
 * pinned runs on the host. */
typedef enum mf_step_placement {
    MF_STEP_PLACE_HOST = 0,
    MF_STEP_PLACE_SEED,
    MF_STEP_PLACE_HYBRID
} mf_step_placement;

typedef enum mf_step_dense { MF_STEP_DENSE_HOST = 0, MF_STEP_DENSE_CARDS } mf_step_dense;

typedef struct mf_step mf_step;

/* The engine's cost models of its lanes for `threads` workers: models[0] the CPU lane (one
 * worker's fused fp4 rate, capped by its share of the memory bandwidth of the sockets its workers
 * fill, + latency), models[1] a card's copy-in (h2d), models[2] its compute (card fp4), models[3]
 * its copy-out (d2h). With p NULL, the built-in machine (sched/cost.h mf_cost_default_profile;
 * assumptions, not measurements: host 20e9 B/s + 2 us, copies 25e9 B/s + 10 us, cards 20e9 B/s +
 * 5 us). The simulator (graphs/sim/plan.c) weighs its
 * hybrid placement with the same function. */
void mf_step_lane_models(const mf_profile *p, int threads, mf_lane_model models[4]);

/* An engine over the reference forward `r`: it advances r's states (mf_ref_state_new(r, ...)) and
 * runs the parts it does not split by rows (Engram, attention's per-item parts, hyper-connections,
 * router) with the layer math of graphs/layers/layers.h on r's tables (mf_ref_layers), one context per
 * CPU worker whose FP8/BF16 linears run on the kernels; attention's linears run split by rows
 * (docs/decode.md). r must outlive the engine and must not run forwards of its own while
 * an engine call is in progress. Debug hooks of r are called on worker threads, in item order
 * (a batch with hooks runs the serial graph). Fails with -ENOTSUP when the model is lazy without
 * an expert store, the reference uses act_quant, or FP8 tiles are not 32x32.
 * With an expert store (mf_model_store) the routed experts are streamed: per layer the route task
 * opens a store batch for the slots' experts (pinned), IO-lane tasks read each slot's misses into
 * the store (empty on hits) and the slot's up tasks wait only for its own reads, so reads of one
 * expert overlap compute of another; the layer's end closes the batch and unpins. A graph run
 * pins min(items x top_k, experts) experts: longer runs are cut into chunks that fit the store,
 * a decode batch that does not fit fails with -ENOSPC naming the budget needed, and a store
 * holding fewer than top_k experts fails here with -ENOSPC. Streamed Engram tables are gathered
 * the same way: per item task a plan task (rows hashed, the store's reads planned), IO-lane
 * tasks for the reads, then the embed task; resident ones are copied by the embed task. One
 * executor: the store's reads all run on this engine's IO lane, whose ring registers the store's
 * slab; the store's own run is released here (host/store.h). */
int mf_step_new(mf_ref *r, const mf_step_opts *opts, mf_step **out);
void mf_step_free(mf_step *s);

/* Same contract as mf_ref_forward (graphs/ref/ref.h): item i is token tokens[i] of states[i]; items of
 * one state consecutive; logits[i] (may be NULL) receives vocab_size fp32 logits. More than
 * max_batch items (mf_step_opts) run as consecutive chunks of that many, or, when they are all of
 * one sequence, of up to MF_STEP_MAX_CHUNK (fewer where the expert store's budget says so). Items
 * of several sequences run their bucket's graph (decode tokens alone the parallel one, with
 * prefill chunks the mixed one: mf_step_graph), one sequence's the serial graph of their count;
 * each graph (and its buffers) is built on its first call, so later calls of any composition
 * allocate nothing. Each item's logits are the same bits in any graph and beside any items. */
int mf_step_forward(mf_step *s, mf_ref_state *const *states, const int32_t *tokens, int n,
                    float *const *logits);
int mf_step_prefill(mf_step *s, mf_ref_state *st, const int32_t *tokens, int n, float *logits);
/* mf_step_forward, also writing item i's DSpark features into feats[i] when feats and feats[i]
 * are non-NULL (n_dspark_target x hidden floats, bit for bit what mf_ref_forward_feat's layer math
 * gives for the engine's streams: mf_ly_draft_feature). Needs an engine made with opts.draft
 * (-EINVAL otherwise, when asked for features). */
int mf_step_forward_feat(mf_step *s, mf_ref_state *const *states, const int32_t *tokens, int n,
                         float *const *logits, float *const *feats);

/* One draft round of the DSpark draft for each of n_seq sequences (graphs/ref/ref.h's reference
 * round, mf_ref_draft_feed + mf_ref_draft_propose, as graph runs of this engine: the builder's draft
 * graph of up to MF_STEP_DRAFT_ITEMS / dspark_block_size sequences at a time). Sequence k first
 * feeds n_feed pending feature rows (n_dspark_target x hidden each, from mf_step_forward_feat: the
 * positions ds->n_pos on), then proposes n_cand candidates (1..dspark_block_size) after `anchor`
 * greedily, with the confidence logits and, where asked, the candidates' logits (n_cand x
 * vocab_size). The linears run on the kernels (the engine's default path: within tolerance of the
 * reference, docs/dspark.md gives the measured differences), the MoE through the engine's routed
 * expert slots on the host. 0, or -EINVAL (no draft, bad counts), the run's error. */
typedef struct mf_step_draft_seq {
    mf_ly_draft_state *ds;   /* the sequence's draft state (mf_ref_draft_state_new) */
    const float *feed;       /* n_feed rows */
    int n_feed;
    int32_t anchor;          /* the token at position ds->n_pos + n_feed */
    int n_cand;
    int32_t *tokens;         /* out: n_cand */
    float *confidence;       /* out: n_cand, or NULL */
    float *logits;           /* out: n_cand x vocab_size, or NULL */
} mf_step_draft_seq;
int mf_step_draft(mf_step *s, mf_step_draft_seq *seqs, int n_seq);

/* The draft's routed experts on the cards (an engine with opts.draft and routed experts on cards;
 * docs/dspark.md "The draft's experts on the cards"): on 1, each card takes the draft stages'
 * experts it owns (mf_dev_xcache_owner of layer n_layers + s) into its expert cache, copied in
 * and held there (pinned), so the draft rounds' MoE places slots on the cards as a step's (every
 * one a hit) and the backbone's experts have that many slots fewer; on 0 they are dropped and the
 * backbone gets the slots back. Without them the draft's experts run on the host. Between calls
 * that run graphs only. 0, -EINVAL (no draft or no cards), a copy's error (nothing held then). */
int mf_step_draft_cards(mf_step *s, int on);

/* One token for each of n_seq distinct sequences; logits is n_seq x vocab_size. */
int mf_step_decode(mf_step *s, mf_ref_state *const *states, const int32_t *tokens, int n_seq,
                   float *logits);

/* Phases of a step, for reports: each task belongs to one. */
typedef enum mf_step_phase {
    MF_STEP_ATTN = MF_SG_PH_ATTN,       /* hyper-connection mixes, norms, attention sublayer */
    MF_STEP_MOE = MF_SG_PH_MOE,         /* router, routed expert slots, shared expert, combine */
    MF_STEP_ENGRAM = MF_SG_PH_ENGRAM,
    MF_STEP_HEAD = MF_SG_PH_HEAD,       /* final collapse, norm and head */
    MF_STEP_OTHER = MF_SG_PH_OTHER,     /* embedding, argument checks, copies, scheduling gaps */
    MF_STEP_N_PHASES = MF_SG_N_PHASES
} mf_step_phase;

const char *mf_step_phase_name(mf_step_phase p);

/* Where the time of the last mf_step_forward call went: per phase the wall time during which a task
 * of that phase ran (union of its task intervals, summed over chunks), OTHER = the rest of the
 * call's wall time; busy_ns = summed task durations (worker time) per phase. */
typedef struct mf_step_times {
    int64_t wall_ns;
    int64_t phase_ns[MF_STEP_N_PHASES];
    int64_t busy_ns[MF_STEP_N_PHASES];
    int n_tasks;   /* tasks of the last graph run */
    /* multiply-adds on the kernels over the call's chunks, from the step graph's records
     * (mf_stepgraph_macs: the head over the items with logits) */
    double macs;
    /* weight bytes the host's kernels read over the call's chunks (mf_stepgraph_weight_bytes) */
    double weight_bytes;
    /* with an expert store: IO-lane busy time (union of the expert reads), expert compute time
     * (union of routed and shared expert tasks) and the time both ran; IO tasks count in no phase */
    int64_t io_busy_ns, expert_busy_ns, io_overlap_ns;
    /* with devices: host-to-device copy time (union of the copy-in tasks), expert compute on the
     * host or a card (union), and the time both ran */
    int64_t copy_busy_ns, compute_busy_ns, copy_overlap_ns;
} mf_step_times;

void mf_step_last_times(const mf_step *s, mf_step_times *out);

/* Step shapes (graph and buffers) built since mf_step_new, and the wall time their building took
 * (graph, binding, buffer allocation): a forward of a shape not kept builds one first. */
typedef struct mf_step_build_stats {
    int64_t n_built;
    int64_t build_ns;
} mf_step_build_stats;
void mf_step_builds(const mf_step *s, mf_step_build_stats *out);

/* Where the routed experts of the last mf_step_forward or mf_step_draft call ran: slots (one per distinct expert
 * of a layer's batch) on a card and on the host, and the device expert caches' counters over the
 * call, summed over cards (hits + misses = dev_slots). */
typedef struct mf_step_dev_stats {
    int64_t dev_slots, host_slots;
    int64_t host_fallbacks;      /* slots placed on a card whose cache slots were all pinned */
    uint64_t hits, misses, evictions, bytes_in;
    /* misses copied as one span: the expert's parts lie on the host as in the card's slot (the
     * model's resident experts, the slot mirroring their layout); the others one copy per part */
    int64_t miss_spans;
    int n_cards, cache_slots;    /* cards in use; cache slots per card */
    /* with sockets (mf_step_opts.n_sockets > 1): host expert part tasks (ups: w1 and w3, downs:
     * w2, each weight counted) run by a worker of the socket holding their rows (the store's
     * socket of their first and last bytes too, with a store split by sockets), and not */
    int64_t sock_home, sock_cross;
    /* the same for the host's dense row parts (attention stages, Engram wkv, router gate, shared
     * expert, head: each matrix counted per part), against the model's shares
     * (graphs/model/model.h mf_model_split_weights) */
    int64_t dense_home, dense_cross;
    /* the cuBLASLt path (mf_step_opts.lt): dense linears run on it (each card's launch of a weight
     * slice counted) and routed-expert slots whose FFN did */
    int64_t lt_linears, lt_slots;
    /* routed-expert slots whose rows their card gathered from the MoE input it holds
     * (mf_stepgraph.slot_gather: no copy of the rows) */
    int64_t gather_slots;
} mf_step_dev_stats;

void mf_step_last_dev(const mf_step *s, mf_step_dev_stats *out);

/* What the warm fill at mf_step_new (mf_step_opts.dev_cache_fill) copied: experts and bytes over
 * all cards, experts left out (not held by the host), and its wall time. Zeros without a fill. */
typedef struct mf_step_fill_stats {
    int64_t experts, skipped;
    uint64_t bytes;
    int64_t wall_ns;
} mf_step_fill_stats;
void mf_step_fill(const mf_step *s, mf_step_fill_stats *out);

/* The startup self-check's refusals of the engine's cards ("refused card 1 (emu): kernel fp8
 * matmul: relative error ...; routed experts run on the host"), "" when every card passed. */
const char *mf_step_refused(const mf_step *s);

/* With the dense work on cards: the bytes of resident weights dense card k holds and (card) its
 * device card; 0 for k out of range (0..number of dense cards - 1) or without dense cards. */
uint64_t mf_step_dense_bytes(const mf_step *s, int k, int *card);

/* The step graph (graphs/step/stepgraph.h) a forward of n items runs, as built by an earlier call:
 * kind MF_STEP_GRAPH_SERIAL (0) one sequence's (or any items' with hooks set) of exactly n items,
 * MF_STEP_GRAPH_PAR (1) the parallel graph (decode tokens of distinct sequences) and
 * MF_STEP_GRAPH_MIXED the mixed one (prefill chunks beside decode tokens) of n's bucket
 * (mf_sg_bucket: its n is the bucket's, n_live the last step's); NULL if none ran yet. For tests
 * and tools (the simulator runs the same graph: graphs/sim/plan.h). Valid until the engine's next
 * call: a serial graph of more than 64 items is the one long shape, freed when a call of another
 * long length replaces it; a bucket's graphs live as long as the engine. */
enum { MF_STEP_GRAPH_SERIAL = 0, MF_STEP_GRAPH_PAR = 1, MF_STEP_GRAPH_MIXED = 2 };
const mf_stepgraph *mf_step_graph(const mf_step *s, int n, int kind);

/* The host buffers (bytes) the engine lays out for step graph sg of config c (sizes sz; exact,
 * n_cards with routed experts, n_dense dense cards and micro as mf_step_opts; resident Engram
 * tables): a parallel or mixed graph's, which every bucket of up to sg->n items shares, or a serial
 * one's. What `moeflow sim` reports beside the cards' buffers; 0 without memory. */
uint64_t mf_step_host_bytes(const mf_config *c, const mf_sg_sizes *sz, const mf_stepgraph *sg, int exact, int n_cards,
                            int n_dense, int micro);

/* Chrome trace-event JSON of the last graph run (one chunk of the last call). 0 or negative code. */
int mf_step_write_trace(const mf_step *s, const char *path);

#endif
