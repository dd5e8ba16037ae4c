/* A loaded DeepSeek-V4.1 text model: the config and every tensor of the released layout
 * (graphs/model/layout.h), checked by name, dtype and shape, held in memory as stored (packed fp4 and
 * fp8 codes with their e8m0 scales, bf16, f32). Routed experts and Engram tables are held too when
 * they fit under a byte limit; otherwise they stay on disk and are read per use (lazy). */
#ifndef MF_MODEL_H
#define MF_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "graphs/model/config.h"
#include "host/safetensors.h"
#include "sched/sched.h"

typedef enum mf_wkind {
    MF_W_NONE = 0,  /* absent on this layer */
    MF_W_FP8,       /* e4m3 codes [rows, cols] + e8m0 tile scales [ceil(rows/bo), ceil(cols/bi)] */
    MF_W_FP4,       /* packed e2m1 [rows, cols/2] + e8m0 scales [rows, cols/32] */
    MF_W_BF16,
    MF_W_F32,
    MF_W_TABLE,     /* Engram table: e4m3 rows [rows, cols] + e8m0 scales [rows, cols/32] */
} mf_wkind;

/* One weight as stored. rows x cols is the logical matrix ([out, in] for linears, cols = 1 for
 * vectors; for fp4 cols counts values, not bytes). data/scale are NULL when the weight is lazy:
 * read it with mf_model_weight_read. */
typedef struct mf_weight {
    mf_wkind kind;
    int64_t rows, cols;
    const char *name;              /* the checkpoint name of the data tensor */
    const uint8_t *data;
    const uint8_t *scale;
    const mf_st_tensor *st_data;   /* where it lives in the checkpoint */
    const mf_st_tensor *st_scale;
    int block_rows, block_cols;    /* fp8 scale tile (quant_block_out x quant_block_in) */
} mf_weight;

/* The weights of one layer; absent ones have kind MF_W_NONE. */
typedef struct mf_model_layer {
    /* Engram (engram layers only) */
    mf_weight eg_table, eg_wkv, eg_q_weight, eg_k_weight;
    /* attention */
    mf_weight hc_attn_fn, hc_attn_base, hc_attn_scale, attn_norm;
    mf_weight wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink;
    mf_weight cmp_wkv, cmp_wgate, cmp_norm;              /* KV-source layers */
    mf_weight idx_wq_b, idx_weights_proj;                /* index-source layers */
    mf_weight idx_wk, idx_k_norm;                        /* KV-source layers */
    /* MoE */
    mf_weight hc_ffn_fn, hc_ffn_base, hc_ffn_scale, ffn_norm;
    mf_weight gate, gate_bias, gate_bias_vl;
    mf_weight sh_w1, sh_w2, sh_w3;
    mf_weight *experts;   /* the layer's routed experts (mf_config_layer_experts) x {w1, w2, w3} */
    /* draft stages only (docs/dspark.md): stage 0 projects the target's features, the last stage
     * has the final norm, the Markov head and the confidence head */
    mf_weight main_proj, main_norm;
    mf_weight out_norm, mk_embed, mk_head, conf_proj;
} mf_model_layer;

typedef struct mf_model mf_model;

typedef struct mf_model_opts {
    /* Routed experts and Engram tables are read into memory at load when together they take at
     * most this many bytes; otherwise they are lazy. 0 means the default (4 GiB); use
     * MF_MODEL_ALL_LAZY to force lazy. */
    uint64_t resident_limit_bytes;
    int quiet;   /* no progress on stderr */
    /* Expert store (host/store.h) for routed experts and Engram tables: MF_MODEL_STORE_NONE (the
     * resident/lazy handling above), RESIDENT (read in at load through the IO lane) or STREAMED
     * (a cache of store_budget_bytes, misses read per use). Tables follow store_tables when set
     * (MF_MODEL_STORE_RESIDENT or STREAMED), else the store's mode. */
    int store;
    int store_tables;
    uint64_t store_budget_bytes;   /* 0: 2 GiB */
    int store_io_depth;            /* 0: 64 */
    /* the store's private run (host/store.h): pread workers instead of io_uring; fault injection
     * (MF_IO_FAULT_* of sched/sched.h on its nth read) */
    int store_io_pread;
    int store_io_fault_kind;
    int64_t store_io_fault_nth;
    /* > 1: the weights the host computes in row parts split across the sockets' memory, one
     * copy: socket k holds rows mf_topo_rows(rows, n_sockets, k) (sched/sched.h) of each, bound to
     * OS NUMA node socket_node[k] (sched/sched.h mf_topo_sockets node): the routed experts in a
     * resident store (host/store.h mf_store_opts n_sockets, socket_node), the matrices of
     * mf_model_split_weights in the model's memory (each tensor then starts on a page; a page
     * straddling a share boundary goes to the share holding its first byte).
     * A node that does not exist, or a binding the kernel refuses, leaves that socket's pages to
     * first touch with one line on stderr (unless quiet). 0 or 1: no split. */
    int n_sockets;
    int socket_node[MF_TOPO_MAX_SOCKETS];
    /* 1: also the DSpark draft (the mtp.* tensors; mf_model_layer_at(m, n_layers + s) for stage s),
     * checked and read like the backbone's (its routed experts resident or lazy with them, never in
     * the store); -EINVAL when the config has no draft stages or the checkpoint lacks them. 0 (the
     * default): the draft's tensors are neither checked nor read, so plain decoding's memory is
     * unchanged and a checkpoint without them (older `moeflow gen` output) loads. */
    int load_draft;
    /* Where the weights the load reads are held (docs/io.md, "Resident weights that outlive the
     * process"). MF_MODEL_WEIGHTS_COPY (0, the default): in the model's own memory, read with pread
     * (resident_limit_bytes decides what is lazy). MF_MODEL_WEIGHTS_MAPPED: views of the shard files
     * mapped read-only from the page cache (host/wmap.h), the one resident copy, kept by the kernel
     * after the process ends and shared with every process mapping the same files: a warm start
     * reads nothing from the disk; a cold one faults them in at the disk's rate (progress, ETA; with
     * sockets, each share by threads bound to its node). Nothing is lazy then (resident_limit_bytes
     * is unused but for MF_MODEL_ALL_LAZY), and the tensors lie at their file offsets (a tensor the
     * file does not align for its element type is copied; MF_MODEL_EXPERT_ALIGN does not hold).
     * When the weights exceed map_mem_bytes (0: the kernel's MemAvailable less 1/32 of MemTotal)
     * and no store was asked for, the routed experts and Engram tables go to a streamed store
     * (store_budget_bytes, store_tables) and the rest is mapped: mf_model_weights_info says so. */
    int weights;
    uint64_t map_mem_bytes;
    int map_threads;   /* threads faulting the mapped weights in (0: mf_wmap_fill_opts' default) */
} mf_model_opts;

enum { MF_MODEL_WEIGHTS_COPY, MF_MODEL_WEIGHTS_MAPPED };

/* How a loaded model holds its weights (mf_model_opts.weights). */
typedef struct mf_model_weights {
    int mapped;              /* views of the page cache */
    int fell_back;           /* mapped, but larger than mem_bytes: experts and tables streamed */
    uint64_t mem_bytes;      /* mapped: the memory the weights were held against */
    uint64_t map_bytes;      /* mapped: the bytes of tensors viewed in the page cache */
    uint64_t cached_bytes;   /* mapped: of their pages, those the page cache held at load (warm) */
    uint64_t copied_bytes;   /* mapped: tensors the file does not align, copied */
    int64_t fill_ns;         /* mapped: the fill (residency check, faults, reads) */
    int fill_threads;
} mf_model_weights;
void mf_model_weights_info(const mf_model *m, mf_model_weights *out);

enum { MF_MODEL_STORE_NONE, MF_MODEL_STORE_RESIDENT, MF_MODEL_STORE_STREAMED };

#define MF_MODEL_ALL_LAZY UINT64_C(1)
/* Where resident, the routed experts' parts (and the other lazy-group tensors) start on this
 * alignment in the model block (at least; pages with sockets): a card slot's part alignment, so
 * that an expert's parts lie as its card slot holds them (graphs/step/step_moe_cards.c mf_step_xslot_layout) */
#define MF_MODEL_EXPERT_ALIGN UINT64_C(256)

/* Opens the checkpoint in `dir` (config.json + safetensors), checks that the config is one the
 * reference forward supports, and that every tensor of the layout is present with the expected
 * dtype and shape; reads the weights. Errors name the file/tensor, what was expected and found;
 * when several tensors are wrong the message counts them and names the first few. */
int mf_model_load(const char *dir, const mf_model_opts *opts, mf_model **out);
void mf_model_free(mf_model *m);

const mf_config *mf_model_config(const mf_model *m);
/* Layer `layer` of the backbone, or draft stage layer - n_layers when the draft was loaded; NULL
 * otherwise. */
const mf_model_layer *mf_model_layer_at(const mf_model *m, int layer);
int mf_model_has_draft(const mf_model *m);   /* loaded with load_draft */
const mf_weight *mf_model_embed(const mf_model *m);
const mf_weight *mf_model_norm(const mf_model *m);
const mf_weight *mf_model_head(const mf_model *m);
const char *mf_model_dir(const mf_model *m);
int mf_model_is_lazy(const mf_model *m);       /* experts/tables read per use */
/* The expert store when one was asked for, else NULL. Expert e of layer L is item (L, e) with
 * parts w1, w1 scale, w2, w2 scale, w3, w3 scale; Engram slot k is table k. */
struct mf_store *mf_model_store(const mf_model *m);
/* The bytes of the model's memory block (mapped: the mapping's reservation, shards and gaps). */
uint64_t mf_model_resident_bytes(const mf_model *m);

/* The matrices of layer L (-1: the head) in the model's memory that the host computes in row
 * parts (graphs/step/stepgraph.h mf_sg_stage_rows), split across the sockets with
 * mf_model_opts.n_sockets > 1: the Engram wkv, the attention stages' linears (wq_a, wkv, the
 * compressor's wkv and wgate, the indexer's weights_proj and wq_b, wq_b, wo_a, wo_b), the router
 * gate, the shared expert's w1, w2, w3, the routed experts' w1, w2, w3 when they are in the
 * model's memory (no store, not lazy); the head. Not split: vectors, the embedding and Engram
 * tables (gathered rows), the hyper-connection mixes' weights and the Engram gate's (read whole by
 * every item's tasks), the indexer's wk (read whole by the core). Up to max into out (16 plus 3
 * per routed expert hold any layer's); returns their count. */
int mf_model_split_weights(const mf_model *m, int L, const mf_weight **out, int max);
/* The socket whose share of a split matrix's rows holds p (mf_model_opts.n_sockets > 1: the share
 * of the row p lies in; an fp8 scale row, of its tile's first row), else -1; how many sockets'
 * shares were bound to their node (the rest are first touch). */
int mf_model_socket_of(const mf_model *m, const void *p);
int mf_model_n_bound(const mf_model *m);

/* Bytes of w's data and scale tensors. */
uint64_t mf_weight_data_bytes(const mf_weight *w);
uint64_t mf_weight_scale_bytes(const mf_weight *w);

/* Reads rows [row0, row0 + n_rows) of a lazy (or resident) weight into data/scale buffers of
 * n_rows rows each (scale may be NULL for kinds without scales; fp8 tiles are not row-sliceable,
 * so fp8 weights must be read whole: row0 = 0, n_rows = rows). */
int mf_model_weight_read(const mf_model *m, const mf_weight *w, int64_t row0, int64_t n_rows,
                         uint8_t *data, uint8_t *scale);

#endif
