/* The model configuration of a DeepSeek-V4.1-style checkpoint: every field of config.json the
 * runtime needs, read from either dialect (flat, as released, or Hugging Face nested under
 * `text_config`), validated with messages naming the file and field, written back (flat), and
 * the built-in presets used by `moeflow gen` (tiny, demo, flash41). */
#ifndef MF_CONFIG_H
#define MF_CONFIG_H

#include <stdint.h>

#define MF_CONFIG_MAX_LAYERS 256   /* n_layers + n_mtp_layers */
#define MF_CONFIG_MAX_IDS 64       /* entries of each layer-id list */
#define MF_CONFIG_MAX_ENGRAM 8     /* Engram layers */

typedef enum mf_scoring {
    MF_SCORING_SQRTSOFTPLUS,
    MF_SCORING_SOFTMAX,
    MF_SCORING_SIGMOID,
} mf_scoring;

/* The released V4.1 checkpoint's rope_scaling (YaRN), applied when a config.json has none. */
#define MF_CONFIG_YARN_FACTOR 16.0
#define MF_CONFIG_YARN_ORIGINAL_MAX_POSITIONS 65536
#define MF_CONFIG_YARN_BETA_FAST 32.0
#define MF_CONFIG_YARN_BETA_SLOW 1.0

/* The oracle's DSpark defaults (NeMo AutoModel 0.7.0's DeepseekV41TextConfig), applied to a
 * config.json without the fields. */
#define MF_CONFIG_DSPARK_BLOCK 5
#define MF_CONFIG_DSPARK_NOISE 128799
#define MF_CONFIG_DSPARK_TARGETS {37, 38, 39}
#define MF_CONFIG_DSPARK_RANK 256
#define MF_CONFIG_DSPARK_EXPERTS 128
#define MF_CONFIG_DSPARK_TOPK 3

typedef struct mf_config {
    /* shape of the transformer */
    int64_t vocab_size;
    int hidden_size;
    int n_layers;                  /* num_hidden_layers (MTP blocks not counted) */
    int n_heads;                   /* num_attention_heads */
    int n_kv_heads;                /* num_key_value_heads */
    int head_dim;
    int qk_rope_head_dim;          /* the last qk_rope_head_dim dims of a head are roped */
    int q_lora_rank;
    int o_groups;
    int o_lora_rank;
    double rms_norm_eps;
    int bos_token_id, eos_token_id, pad_token_id;   /* pad -1 when the config has none */
    int64_t max_position_embeddings;

    /* positions: rope_theta on layers with compress ratio 0, compress_rope_theta + YaRN on the
     * others. A config.json without rope_scaling (or with null) gets the released checkpoint's
     * YaRN (the MF_CONFIG_YARN_* defaults below), as the oracle (NeMo AutoModel's deepseek_v41
     * config) does: V4.1 is trained with it, and converters that drop the field would otherwise
     * run without it unnoticed; yarn_defaulted says so and `moeflow info` prints it. Inside
     * rope_scaling, beta_fast / beta_slow default to 32 / 1 (the oracle's and HF's); factor and
     * original_max_position_embeddings are required. factor 1 turns the scaling off. */
    double rope_theta;
    double compress_rope_theta;
    double yarn_factor;
    int64_t yarn_original_max_position_embeddings;
    double yarn_beta_fast, yarn_beta_slow;
    int yarn_defaulted;            /* 1: config.json had no rope_scaling, the defaults apply */

    /* attention topology */
    int sliding_window;
    int n_mtp_layers;              /* num_nextn_predict_layers */
    int compress_ratios[MF_CONFIG_MAX_LAYERS];   /* n_layers + n_mtp_layers entries, each 0/1/2 */
    int n_kv_source;
    int kv_source_layer_ids[MF_CONFIG_MAX_IDS];
    int n_index_source;
    int index_source_layer_ids[MF_CONFIG_MAX_IDS];
    int index_n_heads, index_head_dim, index_topk;
    int candidate_source_layer_id; /* -1: none */
    int candidate_topk_blocks, candidate_block_size;

    /* MoE */
    int n_routed_experts;
    int n_experts_per_tok;
    int n_shared_experts;
    int moe_intermediate_size;
    mf_scoring scoring_func;
    int norm_topk_prob;
    double routed_scaling_factor;
    double swiglu_limit;

    /* hyper-connections */
    int hc_mult;
    double hc_eps;
    int hc_sinkhorn_iters;

    /* Engram */
    int n_engram;
    int engram_layer_ids[MF_CONFIG_MAX_ENGRAM];
    int64_t engram_num_embeddings[MF_CONFIG_MAX_ENGRAM];   /* table rows per Engram layer */
    int engram_max_ngram_size;
    int engram_n_heads;
    int engram_head_dim;
    int64_t engram_vocab_size;                /* bucket target of the prime search */
    int64_t engram_compressed_vocab_size;
    int engram_pad_token_id;

    /* DSpark, the checkpoint's draft (the mtp.* blocks, n_mtp_layers stages; docs/dspark.md):
     * a parallel drafter of dspark_block_size positions (the anchor token, then
     * dspark_noise_token_id) whose window attention reads the target's features (the mean of the
     * residual streams entering layers dspark_target_layer_ids, projected by stage 0's main_proj),
     * with a MoE of dspark_n_routed_experts experts top-dspark_num_experts_per_tok (the backbone's
     * intermediate size and shared expert), a rank-dspark_markov_rank Markov head and a confidence
     * head on the last stage. Absent fields take the oracle's defaults (NeMo AutoModel 0.7.0's
     * DeepseekV41TextConfig: 5, 128799, [37, 38, 39], 256, 128, 3); they are checked only when
     * n_mtp_layers > 0. */
    int dspark_block_size;
    int dspark_noise_token_id;
    int n_dspark_target;
    int dspark_target_layer_ids[MF_CONFIG_MAX_IDS];
    int dspark_markov_rank;
    int dspark_n_routed_experts;
    int dspark_num_experts_per_tok;

    /* quantization_config: dense linears fp8 e4m3 in quant_block_out x quant_block_in tiles with
     * ue8m0 scales, routed experts packed fp4 (e2m1) with one ue8m0 scale per 32 along K. */
    int quant_block_out, quant_block_in;
} mf_config;

/* Reads config.json at `path` (flat or nested dialect) into *out and validates it. On failure
 * returns -EINVAL/-ENOENT/... with mf_last_error() naming the file and field, and what was
 * expected and found. */
int mf_config_load(const char *path, mf_config *out);

/* The same from JSON text; `what` names the source in errors. */
int mf_config_parse(const char *what, const char *json, mf_config *out);

/* The one validation of a config, used by the parser (so by the loader and `moeflow info`), the
 * presets, the layout (so `moeflow gen`) and the reference: ranges, list lengths, layer ids,
 * divisibility, and what the oracle (NeMo AutoModel 0.7.0's deepseek_v41) refuses and what the
 * layer math needs: one KV head, sqrtsoftplus routing, RoPE dims even and within head_dim and
 * index_head_dim, every compressed layer after a KV source of the same ratio (no other in
 * between) and an index source on that source, the candidate layer a KV source and no index
 * layer after it on another KV source, draft stages window-only, ... (docs/model.md lists them).
 * `what` names the source in errors. 0 or -EINVAL naming the field. */
int mf_config_validate(const char *what, const mf_config *c);

/* Writes the flat dialect to `path` (atomically via a temporary file). */
int mf_config_write_json(const mf_config *c, const char *path);

/* A newly allocated JSON text of the flat dialect (free()), or NULL with an error set. */
char *mf_config_to_json(const mf_config *c);

/* Fills *out with a preset: "tiny" (every feature, millisecond sizes), "demo" (a ~2 GiB model
 * for the README demo), "big" (demo with ~26 GiB of experts, for streamed decodes larger than RAM), "flash41" (the released DeepSeek-V4.1-Flash). -EINVAL for other names. */
int mf_config_preset(const char *name, mf_config *out);

/* "tiny demo flash41" for help texts. */
const char *mf_config_preset_names(void);

const char *mf_scoring_name(mf_scoring s);

/* ---- derived sizes (bytes of the released layout, see graphs/model/layout.h) -------------------- */

int mf_config_is_kv_source(const mf_config *c, int layer);
int mf_config_is_index_source(const mf_config *c, int layer);
int mf_config_engram_slot(const mf_config *c, int layer);   /* index into engram_*, or -1 */
/* 1 when a run of layers may begin at `layer` (a pipeline's cut, graphs/pipe/pipe.h): no layer at
 * or after it reads the compressed KV, index keys or candidate blocks of a KV source before it,
 * i.e. the first compressed layer from `layer` on is a KV source (or there is none). Layer 0
 * always; layer n_layers (the end) too; 0 for other values. */
int mf_config_cut_ok(const mf_config *c, int layer);

/* Routed experts and top-k of layer L: the backbone's for L < n_layers, the draft's
 * (dspark_n_routed_experts, dspark_num_experts_per_tok) for the draft stages n_layers + s. */
int mf_config_layer_experts(const mf_config *c, int L);
int mf_config_layer_topk(const mf_config *c, int L);

/* One routed expert (w1, w2, w3 packed fp4 + their scales). */
uint64_t mf_config_expert_bytes(const mf_config *c);
/* All routed experts of all layers. */
uint64_t mf_config_expert_bank_bytes(const mf_config *c);
/* The Engram tables (embed.weight + embed.scale) of all Engram layers. */
uint64_t mf_config_engram_table_bytes(const mf_config *c);
/* Everything of the text model except routed experts, Engram tables and MTP blocks; 0 with an
 * error set if the layout cannot be built. */
uint64_t mf_config_resident_bytes(const mf_config *c);
/* The draft's tensors (the mtp.* blocks, all stages); 0 without draft stages. */
uint64_t mf_config_draft_bytes(const mf_config *c);

#endif
