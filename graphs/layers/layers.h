/* The layer math of DeepSeek-V4.1 shared by the reference forward (graphs/ref/ref_model.c, the oracle)
 * and the scheduled engine (graphs/step/step*.c): hyper-connections, attention (in phases), MoE router
 * and experts, Engram, and their numeric helpers (graphs/layer_*.c). Every call names its context:
 * the model's tables (mf_layers: config, weights, options, RoPE tables, Engram hashes), the
 * scratch it may use (one mf_ly_ctx per thread of work) and the linear backend (the oracle's
 * double sums or the fused kernels). What it computes is in docs/reference.md.
 * Threading: an mf_layers is read-only after mf_layers_new and may be shared by any number of
 * threads; an mf_ly_ctx is used by one thread at a time. */
#ifndef MF_LAYERS_H
#define MF_LAYERS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "graphs/model/config.h"
#include "graphs/model/model.h"
#include "host/formats.h"

#define MF_LY_MAX_HC 16
#define MF_LY_MAX_INDEX_DIM 4096   /* index_head_dim the layer math supports (an index key on the stack) */

/* The options of the layer math (named for the oracle's API, graphs/ref/ref.h, which takes them;
 * the engine reads them from the same tables). Debug hooks: called during the forward, on the
 * thread running the item's sublayer. `seq` is the state the item belongs to. Pointers are valid
 * only during the call. */
typedef struct mf_ref_hooks {
    void *user;
    /* routed experts of one token at one layer, in selection order, with their weights */
    void (*on_route)(void *user, const void *seq, int64_t pos, int layer, const int32_t *experts,
                     const float *weights, int n);
    /* compressed entries attended by one token at one layer, ascending */
    void (*on_select)(void *user, const void *seq, int64_t pos, int layer, const int32_t *entries,
                      int n);
    /* candidate blocks kept by one token at the candidate layer, ascending (block b covers
     * compressed entries b*candidate_block_size ..); may be NULL */
    void (*on_candidates)(void *user, const void *seq, int64_t pos, int layer,
                          const int32_t *blocks, int n);
} mf_ref_hooks;

typedef struct mf_ref_opts {
    /* 0 (default, the HF port): linears take their input as is. 1 (DeepSeek's inference/model.py):
     * the input of every fp8/fp4 linear except wo_a is first fake-quantized to e4m3 in 1x32
     * blocks with a power-of-two scale. */
    int act_quant;
    /* Engram token map: vocab id -> compressed id (n_token_map entries). NULL: the placeholder
     * map id % engram_compressed_vocab_size (documented in docs/reference.md). Copied. A model
     * without Engram layers never reads it: it is then accepted and ignored. */
    const int32_t *token_map;
    int64_t n_token_map;
    mf_ref_hooks hooks;
} mf_ref_opts;

typedef struct mf_ref_state mf_ref_state;   /* caches of one sequence (below) */

/* The model's tables every context reads: built once by mf_layers_new. */
typedef struct mf_layers {
    const mf_model *m;
    const mf_config *c;
    int act_quant;                     /* mf_ref_opts.act_quant */
    mf_ref_hooks hooks;                /* mf_ref_opts.hooks */
    int32_t *token_map;                /* vocab_size entries: Engram's compressed ids */
    float *freqs_main, *freqs_comp;    /* rope_dim/2 each: without / with YaRN */
    int src_of[MF_CONFIG_MAX_LAYERS];  /* KV source of each compressed layer (-1 otherwise) */
    int64_t eg_mult[MF_CONFIG_MAX_ENGRAM][8];   /* Engram hash parameters per slot */
    int64_t *eg_prime[MF_CONFIG_MAX_ENGRAM], *eg_off[MF_CONFIG_MAX_ENGRAM];
    void *mem;
} mf_layers;

/* The tables of model m with options opts (may be NULL; the token map is copied, hooks kept).
 * -EINVAL on a model the layer math does not support or a bad token map, -ENOMEM. */
int mf_layers_new(const mf_model *m, const mf_ref_opts *opts, mf_layers **out);
void mf_layers_free(mf_layers *ly);

/* Which sums a context's linears use. DOUBLE (the oracle): every linear accumulated in double per
 * 32-column block. KERN (the scheduled engine): resident FP8/BF16 linears without act quant on
 * host/kernels.h (fp32 sums, ~1e-7 apart); the others as DOUBLE. The router gate and the grouped
 * wo_a are double sums on both (mf_ly_gate_rows, mf_ly_attn_lin_rows). */
typedef enum mf_ly_lin { MF_LY_LIN_DOUBLE, MF_LY_LIN_KERN } mf_ly_lin;

typedef struct mf_ly_pick {
    double score;
    int32_t idx;
} mf_ly_pick;

/* The attention sublayer in phases (layer_attn.c), which the scheduled engine runs with the weight-heavy linears split
 * by output rows across workers and the rest per item (docs/decode.md). mf_ly_attn is
 * in -> qnorm -> qb -> core -> oa -> ob over one item's buffers; the linear stages (IN, QB, OA,
 * OB) are lists of linears (mf_ly_attn_linears). The activations of one item between phases: */
enum {
    MF_LY_A_IN,     /* hidden_size: the input (after attn_norm) */
    MF_LY_A_QR,     /* q_lora_rank: wq_a in (q-normed by the qnorm phase) */
    MF_LY_A_KV,     /* n_kv_heads x head_dim: wkv in (the first head_dim used) */
    MF_LY_A_LAT,    /* head_dim: cmp_wkv in (KV-source layers) */
    MF_LY_A_GATE,   /* head_dim: cmp_wgate in (ratio-2 KV sources) */
    MF_LY_A_IW,     /* index_n_heads: idx_weights_proj in (index-source layers) */
    MF_LY_A_Q,      /* n_heads x head_dim: wq_b qr */
    MF_LY_A_QI,     /* index_n_heads x index_head_dim: idx_wq_b qr (index-source layers) */
    MF_LY_A_O,      /* n_heads x head_dim: attention output (inverse-roped) */
    MF_LY_A_Z,      /* o_groups x o_lora_rank: grouped wo_a o, bf16 */
    MF_LY_A_OUT,    /* hidden_size: wo_b z, bf16 */
    MF_LY_A_N
};

/* A context: the tables, the linear backend and named scratch, sized from the model once
 * (mf_ly_ctx_new: a table of {name, bytes, &ptr}, one allocation) except the score buffers,
 * which grow with the longest sequence (mf_ly_ctx_reserve, before a forward). */
typedef struct mf_ly_ctx {
    const mf_layers *ly;
    mf_ly_lin lin;
    float *hc_xn;          /* 4 x hc_mult x hidden: the normalized streams of mf_ly_hc_mixes (the first
                            * hc_mult x hidden); in the engine's mixes (fast_attn.h) four items'
                            * normed streams or a block's lanes (16 floats per item and row) */
    float *hc_h;           /* hidden: a collapse of the streams (a sublayer's input before its norm) */
    float *sub_in;         /* hidden: a sublayer's normed input (the oracle's layer loop) */
    float *sub_out;        /* hidden: a sublayer's output (the oracle's layer loop) */
    float *aq;             /* widest linear input: its act-quant copy */
    float *attn[MF_LY_A_N];   /* mf_ly_attn's buffers of one item (IN and OUT are the caller's) */
    double *attn_acc;      /* head_dim: one head's weighted values */
    float *sel_kv;         /* index_topk x head_dim: the selected compressed entries, unpacked */
    float *win_kv;         /* sliding_window x head_dim: a heads call's window rows from the ring, unpacked */
    float *cache_row;      /* max(head_dim, index_head_dim): an entry or index key before packing */
    float *gate_logits;    /* n_routed_experts: the router gate's output */
    float *gate_bias;      /* n_routed_experts: its bias as floats */
    float *ffn_g, *ffn_u;  /* an expert's hidden size: w1 and w3 outputs */
    float *ffn_y;          /* hidden: an expert's output */
    double *moe_acc;       /* hidden: the sum of expert outputs (also the engine's combine) */
    float *ex_out;         /* with an expert store: n_experts_per_tok x hidden outputs */
    float *eg_emb;         /* Engram rows of one item (n-gram heads x head_dim), dequantized */
    float *eg_kv;          /* (hc_mult + 1) x hidden: Engram's wkv output */
    int64_t *eg_rows;      /* Engram table rows of one item */
    uint8_t *eg_codes, *eg_scales;
    uint8_t *lazy_data, *lazy_scale;   /* one lazy weight read in */
    double *scores;        /* attention and index scores, n_scores long */
    mf_ly_pick *picks;     /* top-k sorting, n_scores long */
    int64_t n_scores;
    void *mem;
} mf_ly_ctx;

int mf_ly_ctx_new(const mf_layers *ly, mf_ly_lin lin, mf_ly_ctx **out);
void mf_ly_ctx_free(mf_ly_ctx *cx);
/* Score buffers for sequences of up to max_positions tokens (grown, never shrunk). -ENOMEM. */
int mf_ly_ctx_reserve(mf_ly_ctx *cx, int64_t max_positions);

/* ---- layer_cache.c: the compressed caches, packed and paged --------------------------------- */

/* A KV-source layer's cache holds what the compressor emits, in the packed form its fake
 * quantization rounds to (so the store is lossless): entry j is head_dim E2M1 codes (two a byte,
 * low nibble first) with one E4M3 scale per 16 values (mf_ly_fq_e2m1_e4m3), and its index key
 * index_head_dim E2M1 codes with one UE8M0 scale byte per 32 (mf_ly_fq_e2m1_pow2; the scale is
 * 2^(byte-127)). Every dim is quantized, the RoPE part included. Entries live in pages of
 * mf_ly_cache_page_entries entries (MF_LY_PAGE_POSITIONS positions' worth); the state
 * (graphs/ref/ref.h) adds pages as positions arrive and keeps them over a reset. */
#define MF_LY_PAGE_POSITIONS 256   /* positions a page of every cache covers (tokens too) */

typedef struct mf_ly_cache {
    uint8_t **page;   /* n_pages pages; page p holds entries [p * page_entries, (p + 1) * page_entries) */
    int64_t n_pages;
    int64_t n;        /* entries emitted */
    float *pend_kv;   /* ratio 2: the first token of the open group (fp32 kv and gate score) */
    float *pend_score;
} mf_ly_cache;

/* Entries a page of KV-source layer L holds (ceil(MF_LY_PAGE_POSITIONS / ratio)), the bytes of one
 * packed entry (KV + index key, codes + scales) and of one page. */
int64_t mf_ly_cache_page_entries(const mf_config *c, int L);
int64_t mf_ly_cache_entry_bytes(const mf_config *c);
int64_t mf_ly_cache_page_bytes(const mf_config *c, int L);

/* The one place each cache is written and read (the attention and index-score code calls nothing
 * else; fast versions read through these too). All need entry j inside the cache's pages
 * (j < n_pages * page entries; the state reserves them before a forward), L the KV-source layer.
 * put_kv fake-quantizes kv (head_dim floats, as mf_ly_fq_e2m1_e4m3 per 16) into entry j's codes,
 * put_key the index key (index_head_dim floats, as mf_ly_fq_e2m1_pow2 per 32); the floats are
 * left as they were. get_kv / get_key write the entry's values (exactly what the fake
 * quantization gives) into out. get_kv_rows unpacks entries rows[0..n) into out (n x head_dim):
 * done once per item and layer into scratch, where every head then reads the same rows.
 * Thread-safe for distinct entries; reads may run in parallel. */
void mf_ly_cache_put_kv(const mf_config *c, int L, mf_ly_cache *ca, int64_t j, const float *kv);
void mf_ly_cache_put_key(const mf_config *c, int L, mf_ly_cache *ca, int64_t j, const float *key);
void mf_ly_cache_get_kv(const mf_config *c, int L, const mf_ly_cache *ca, int64_t j, float *out);
void mf_ly_cache_get_key(const mf_config *c, int L, const mf_ly_cache *ca, int64_t j, float *out);
/* Index keys j0..j0+n-1 into out (n x index_head_dim), each the bits of mf_ly_cache_get_key: the
 * page found once per page, not once per key. */
void mf_ly_cache_get_keys(const mf_config *c, int L, const mf_ly_cache *ca, int64_t j0, int64_t n, float *out);
void mf_ly_cache_get_kv_rows(const mf_config *c, int L, const mf_ly_cache *ca, const int32_t *rows, int n,
                             float *out);
/* Entries [r0, r0 + n) of one page of layer L as bytes (n x mf_ly_cache_entry_bytes, each part's
 * rows in a run: KV codes, KV scales, key codes, key scales) and back: what the prefix cache's disk
 * tier stores (graphs/prefix/prefix_disk.c). r0 + n <= mf_ly_cache_page_entries. */
void mf_ly_cache_save(const mf_config *c, int L, const uint8_t *page, int64_t r0, int64_t n, uint8_t *out);
void mf_ly_cache_load(const mf_config *c, int L, uint8_t *page, int64_t r0, int64_t n, const uint8_t *in);

/* The window ring of a sequence, packed (the one place it is written and read; the layout is
 * layer_cache.c's): slot t % sliding_window of layer L holds position t's window KV, which the
 * attention has fake-quantized with mf_ly_fq_e4m3_pow2 per 32 (every dim, the RoPE tail
 * included), as its E4M3 codes (head_dim bytes) and one exponent byte per 32 values
 * (mf_ly_pack_e4m3_pow2): head_dim + ceil(head_dim / 32) bytes a slot instead of 4 x head_dim.
 * ring_put packs kv (values of mf_ly_fq_e4m3_pow2 per 32) into position pos's slot; ring_get
 * unpacks positions [t0, t0 + n) (all inside the window that holds them) into out (n x head_dim),
 * exactly the floats that were put. ring_row gives a slot's codes and scales for fast readers
 * (graphs/step/fast_attn.c), which must give ring_get's floats. Thread-safe for distinct slots. */
#define MF_LY_RING_BLOCK 32   /* values per exponent byte of a ring slot */
int64_t mf_ly_ring_row_bytes(const mf_config *c);
int64_t mf_ly_ring_bytes(const mf_config *c);   /* all layers' slots */
void mf_ly_ring_put(const mf_config *c, mf_ref_state *st, int L, int64_t pos, const float *kv);
/* ring_put's copy into the tap alone (mf_ref_state.tap; nothing when it does not hold pos), the ring
 * untouched: a position whose slot a later position of the same step takes, which the ring never
 * holds but the prefix cache keeps (graphs/step/step_attn.c mf_task_attn_ring). */
void mf_ly_ring_tap(const mf_config *c, mf_ref_state *st, int L, int64_t pos, const float *kv);
void mf_ly_ring_get(const mf_config *c, const mf_ref_state *st, int L, int64_t t0, int64_t n, float *out);
const uint8_t *mf_ly_ring_row(const mf_config *c, const mf_ref_state *st, int L, int64_t t, const uint8_t **scales);
/* Puts a packed slot (mf_ly_ring_row_bytes, as the tap or ring_row gives it) back as position t's of
 * layer L: the prefix cache's restore of a window (graphs/prefix/prefix.c). */
void mf_ly_ring_set_row(const mf_config *c, mf_ref_state *st, int L, int64_t t, const uint8_t *row);

/* The caches of one sequence (mf_ref_state_new, graphs/ref/ref_state.c). The fixed part (ring,
 * pending groups, the page tables' owner) is one allocation; the token history and the caches'
 * pages grow with the positions reserved (mf_ref_state_reserve). Pages are reference counted
 * (mf_ref_page_*, graphs/ref/ref.h): a full page may be shared with the prefix cache
 * (graphs/prefix/prefix.h) and other states, read-only below every holder's entry count. */
struct mf_ref_state {
    const mf_layers *ly;
    int64_t max_pos;
    int64_t n_pos;       /* tokens consumed */
    int64_t cap_pos;     /* positions the pages and tokens hold: a multiple of MF_LY_PAGE_POSITIONS */
    int64_t tok_cap;     /* token ids the history holds (>= cap_pos) */
    int32_t *tokens;     /* tok_cap: token ids (history, for Engram) */
    uint8_t *ring;       /* n_layers x sliding_window packed slots (slot = pos % window, mf_ly_ring_*) */
    mf_ly_cache *cache;  /* n_layers; pages only on KV-source layers */
    void *mem;           /* the fixed part's one allocation */
    /* The window tap (NULL: none): mf_ly_ring_put also copies position pos's packed slot of layer
     * L to tap[pos - tap_pos0] + L * mf_ly_ring_row_bytes when 0 <= pos - tap_pos0 < tap_n and that
     * entry is not NULL (n_layers slots a position). The prefix cache sets it around a forward to
     * keep the window KV of the positions it caches; nothing else writes it. */
    uint8_t *const *tap;
    int64_t tap_pos0, tap_n;
    struct mf_ly_journal *jr;   /* speculation's undo record (mf_ref_state_mark), NULL until first used */
};

/* What a verify's positions overwrite that a rollback must give back (graphs/ref/ref_state.c
 * mf_ref_state_mark / mf_ref_state_rollback; docs/dspark.md "Rollback"): from position pos0 on, n
 * positions of the sequence run; before they run, the window ring's slots they will write (their
 * old bytes, n_layers x n rows) and every ratio-2 compressor's open group (pend_kv, pend_score) are
 * kept; while they run, each position that opens a ratio-2 group leaves its (kv, score) here
 * (mf_ly_journal_pend), since a later position of the same verify overwrites the state's copy. */
typedef struct mf_ly_journal {
    int active;         /* positions [pos0, pos0 + n) are being recorded */
    int64_t pos0;
    int n, cap;         /* positions of this verify; the most the buffers hold */
    uint8_t *ring;      /* n_layers x cap: slot of pos0 + i as it was, row i */
    float *pend;        /* per ratio-2 KV source (jr_src) x (1 + cap) x 2 x head_dim: [0] the group
                         * open before pos0, [1 + i] the one position pos0 + i opened */
    uint8_t *pend_set;  /* per ratio-2 KV source x cap: [i] written */
    int n_src2;
    int src2[MF_CONFIG_MAX_LAYERS];   /* the ratio-2 KV-source layers, in order */
    void *mem;
} mf_ly_journal;

/* A ratio-2 compressor's group opened by the token at pos (its cmp_wkv and cmp_wgate outputs, head_dim
 * each) into st's journal when it is recording pos; nothing otherwise (the layer math's compressors
 * call it at every group they open). Thread-safe for distinct positions. */
void mf_ly_journal_pend(const mf_config *c, mf_ref_state *st, int L, int64_t pos, const float *kv, const float *score);

/* Sorts picks by score descending, ties by index ascending. */
void mf_ly_sort_picks(mf_ly_pick *p, int64_t n);

/* One (sequence, token) of a forward call, with the activations carried between layers. */
typedef struct mf_ly_item {
    mf_ref_state *st;
    int64_t pos;
    int32_t tok;
    float *x;                   /* hc_mult x hidden: the residual streams */
    float pre[MF_LY_MAX_HC];    /* the pre mix carried one sublayer ahead */
    int32_t *topk;              /* index_topk: latest selection (entries of the KV source) */
    int n_topk;
    int topk_src;               /* KV source the selection refers to (-1: none yet) */
    float *sel_kv;              /* NULL, or index_topk x head_dim: the selection's entries, unpacked
                                 * once when it is made (mf_ly_item_selected) for every heads call
                                 * of every layer that reads it; NULL: each heads call unpacks them
                                 * into its context's scratch */
    int32_t *cand;              /* candidate_topk_blocks: kept blocks, ascending */
    int n_cand;
    int cand_src;               /* KV source of the candidate mask (-1: none yet) */
    float *logits;
    int32_t *routes;            /* NULL, or the layer's top-k: its routed experts written here too */
} mf_ly_item;

/* After a selection is made for item it (it->topk, n_topk, topk_src set): its entries unpacked
 * into it->sel_kv when the item has one. */
void mf_ly_item_selected(const mf_config *c, mf_ly_item *it);
/* The selection's entries for a heads call: it->sel_kv, or unpacked into scratch (index_topk x
 * head_dim) when the item has no sel_kv. */
const float *mf_ly_item_sel_kv(const mf_config *c, const mf_ly_item *it, float *scratch);

/* ---- layer_ops.c: numeric helpers ----------------------------------------------------------- */

/* bf16 rounding (host/formats.h mf_bf16_round, inline) */
static inline float mf_bf(float x) { return mf_bf16_round(x); }
void mf_bf_n(float *x, int64_t n);

/* y[rows] = W x[cols] on cx's backend, each row rounded to fp32. W of any kind but MF_W_TABLE;
 * lazy weights are read into cx's scratch. With aq, x is first fake-quantized to e4m3 1x32 (a
 * copy; x itself is untouched) and the sums are double. -EINVAL on a weight that is no linear. */
int mf_ly_linear(mf_ly_ctx *cx, const mf_weight *w, const float *x, float *y, int aq);
/* Rows [r0, r1) of y = W x for n_tok inputs (row t of x at x + t * ld_x, of y at y + t * ld_y),
 * without act quant, on cx's backend; each row the same bits as mf_ly_linear gives it, so any
 * split of the rows gives the same bits. */
int mf_ly_linear_part(mf_ly_ctx *cx, const mf_weight *w, const float *x, int n_tok, int64_t ld_x,
                      float *y, int64_t ld_y, int64_t r0, int64_t r1);
/* 1 when mf_ly_linear_part runs w on the kernels (with the kernels' backend): resident BF16, or
 * FP8 in 32x32 blocks, with columns a multiple of 32; else it sums in double. The one rule the
 * engine's host tasks and its dense cards' launches follow. */
int mf_ly_linear_kern(const mf_weight *w);
/* Rows [row0, row0+n) of W, double sums on every backend (used by the grouped wo_a and the router
 * gate). cx may be NULL for a resident weight. */
int mf_ly_linear_rows(mf_ly_ctx *cx, const mf_weight *w, int64_t row0, int64_t n, const float *x,
                      int64_t x_cols, int64_t col0, float *y);
/* Element i of a bf16/f32 vector weight. */
float mf_ly_vec(const mf_weight *w, int64_t i);

/* out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))) (the HF port's rounding). out may be x. */
void mf_ly_rmsnorm(const float *x, int64_t n, const mf_weight *w, double eps, float *out);
/* Columns [c0, c1) of the same (the mean over all n): any split gives the whole's bits. */
void mf_ly_rmsnorm_cols(const float *x, int64_t n, const mf_weight *w, double eps, float *out, int64_t c0,
                        int64_t c1);
/* The two halves of mf_ly_rmsnorm_cols: the scale 1 / rms(x) (over all n, eps added to the mean)
 * and columns [c0, c1) of out = bf16(w * bf16(x * rs)); out may be x (each column reads only its
 * own x). Split this way, the scale once and the columns in parts, the bits are the whole's. */
float mf_ly_rms_scale(const float *x, int64_t n, double eps);
void mf_ly_rmsnorm_apply(const float *x, const mf_weight *w, float rs, float *out, int64_t c0, int64_t c1);

/* Interleaved RoPE on the last 2*n_pairs dims of x (pairs (2i, 2i+1)) at position pos; inverse
 * rotates by the conjugate. fp32 angle pos*freq, as torch computes it. */
void mf_ly_rope(float *x, int n_pairs, const float *freqs, int64_t pos, int inverse);
/* RoPE inverse frequencies of layer `layer` (qk_rope_head_dim/2 values, fp32): rope_theta without
 * YaRN on ratio-0 layers, compress_rope_theta with YaRN on the others. */
void mf_ly_rope_freqs(const mf_config *c, int layer, float *freqs);

/* Fake quantization in place over blocks of `block` values:
 * e4m3 with a power-of-two scale 2^ceil(log2(max(amax, 1e-4)/448)) (window KV, act quant);
 * e2m1 with an e8m0 scale 2^ceil(log2(max(amax, 6*2^-126)/6)) (index q and keys);
 * e2m1 with an e4m3 scale e4m3(max(amax, 6*2^-9)/6) (compressed KV entries). */
void mf_ly_fq_e4m3_pow2(float *x, int64_t n, int block);
void mf_ly_fq_e2m1_pow2(float *x, int64_t n, int block);
void mf_ly_fq_e2m1_e4m3(float *x, int64_t n, int block);
/* The same two e2m1 roundings as codes and scales: pack writes (n + 1) / 2 code bytes (low nibble
 * first, an odd n's last high nibble 0) and ceil(n / block) scale bytes (UE8M0 exponent bytes
 * for pow2, E4M3 codes for e4m3); unpack writes the n floats the fake quantization gives, bit for
 * bit (tests/test_kvpack.c). */
void mf_ly_pack_e2m1_pow2(const float *x, int64_t n, int block, uint8_t *codes, uint8_t *scales);
void mf_ly_pack_e2m1_e4m3(const float *x, int64_t n, int block, uint8_t *codes, uint8_t *scales);
void mf_ly_unpack_e2m1_pow2(const uint8_t *codes, const uint8_t *scales, int64_t n, int block, float *out);
void mf_ly_unpack_e2m1_e4m3(const uint8_t *codes, const uint8_t *scales, int64_t n, int block, float *out);
/* The e4m3 pow2 rounding's values stored: pack takes x as mf_ly_fq_e4m3_pow2 left it (its output,
 * not its input) and writes n E4M3 codes and ceil(n / block) exponent bytes (the scale is
 * 2^(byte-127), 255 inf); unpack writes those n floats back bit for bit (tests/test_kvpack.c).
 * A block's scale is found again from its values (pow2_ceil(max(amax, 1e-4) / 448), at most the
 * rounding's own: every value is then a code times it exactly); a block that held an inf (scale
 * inf: every value NaN or +-inf) is scale 255 with codes 0 (NaN), 1.0 or -1.0. Values no
 * rounding gives (finite values beside a NaN or inf) are not kept. */
void mf_ly_pack_e4m3_pow2(const float *x, int64_t n, int block, uint8_t *codes, uint8_t *scales);
void mf_ly_unpack_e4m3_pow2(const uint8_t *codes, const uint8_t *scales, int64_t n, int block, float *out);

float mf_ly_silu(float x);
float mf_ly_sigmoid(float x);
float mf_ly_softplus(float x);   /* torch's: x above 20 returns x */

/* ---- layer_hc.c: hyper-connections ---------------------------------------------------------- */

/* The mixes of the streams x against fn (scratch: hc_xn). */
void mf_ly_hc_mixes(const mf_ly_ctx *cx, const float *x, const mf_weight *fn, float *mixes);
/* Hyper-connection split of (2+hc)*hc mixes into pre[hc], post[hc] and the Sinkhorn-normalized
 * comb[hc][hc] (row = source stream); _w reads scale and base from their weights. */
void mf_ly_hc_split(const mf_config *c, const float *mixes, const float *scale, const float *base,
                    float *pre, float *post, float *comb);
void mf_ly_hc_split_w(const mf_config *c, const float *mixes, const mf_weight *scale,
                      const mf_weight *base, float *pre, float *post, float *comb);
void mf_ly_hc_collapse(const mf_ly_ctx *cx, const float *x, const float *pre, float *h);
void mf_ly_hc_expand(const mf_ly_ctx *cx, float *x, const float *out, const float *post,
                     const float *comb);
/* The same in parts, each giving the bits of the whole for its share: mixes [k0, k1) (each part
 * normalizes all of x again in scratch hc_xn: the norm is one sum), collapse and expand of hidden
 * columns [d0, d1). */
void mf_ly_hc_mixes_rows(const mf_ly_ctx *cx, const float *x, const mf_weight *fn, float *mixes, int k0, int k1);
void mf_ly_hc_collapse_cols(const mf_ly_ctx *cx, const float *x, const float *pre, float *h, int64_t d0,
                            int64_t d1);
void mf_ly_hc_expand_cols(const mf_ly_ctx *cx, float *x, const float *out, const float *post, const float *comb,
                          int64_t d0, int64_t d1);

/* ---- layer_attn.c: the attention sublayer ---------------------------------------------------- */

/* The attention sublayer of item it at layer L; in = attn input (after attn_norm), out =
 * hidden_size outputs (bf16 values). Scratch: attn, attn_acc, scores, picks. */
int mf_ly_attn(mf_ly_ctx *cx, mf_ly_item *it, int L, const float *in, float *out);

int64_t mf_ly_attn_buf_len(const mf_config *c, int buf);

enum { MF_LY_A_STAGE_IN, MF_LY_A_STAGE_QB, MF_LY_A_STAGE_OA, MF_LY_A_STAGE_OB, MF_LY_A_N_STAGES };
#define MF_LY_A_MAX_LIN 5   /* linears per stage */

/* One linear of a stage: buffer y = W buffer x. groups > 0 (wo_a): row block g of w->rows/groups
 * rows reads columns [g * w->cols, (g + 1) * w->cols) of x. */
typedef struct mf_ly_attn_lin {
    const mf_weight *w;
    int x, y;     /* MF_LY_A_* */
    int aq;       /* the reference fake-quantizes x first (with act_quant) */
    int groups;
    int bf;       /* y is rounded to bf16 */
} mf_ly_attn_lin;

/* The linears of stage `stage` of layer L into out[0..MF_LY_A_MAX_LIN); returns their count. */
int mf_ly_attn_linears(const mf_layers *ly, int L, int stage, mf_ly_attn_lin *out);
/* Rows [r0, r1) of linear l for n_tok items: item t reads x + t * ld_x and writes y + t * ld_y.
 * Without act quant only: each row as mf_ly_linear sums it on cx's backend (grouped: double
 * sums), so any split of the rows gives the same bits. */
int mf_ly_attn_lin_rows(mf_ly_ctx *cx, const mf_ly_attn_lin *l, const float *x, int64_t ld_x, float *y,
                        int64_t ld_y, int n_tok, int64_t r0, int64_t r1);
/* The phases; b[MF_LY_A_*] are one item's buffers. stage runs a linear stage whole (the reference's
 * calls, act quant included); qnorm rounds and normalizes QR; core is the per-item middle: RoPE,
 * window KV into the ring, compressor, indexer, attention with the sink into O (items of one
 * sequence in position order). */
int mf_ly_attn_stage(mf_ly_ctx *cx, int L, int stage, float *const *b);
/* The low-rank query (rounded by the IN stage: wq_a's outputs are bf16) normed with q_norm in place. */
void mf_ly_attn_qnorm(const mf_ly_ctx *cx, int L, float *const *b);
int mf_ly_attn_core(mf_ly_ctx *cx, mf_ly_item *it, int L, float *const *b);
/* The core in parts (mf_ly_attn_core is prep, ring write, heads 0..n_heads): prep readies the
 * item's window KV in b[KV] (normed, roped, fake-quantized; not yet in the ring), runs the
 * compressor and the indexer (their state: items of one sequence in position order) and leaves
 * the selection in it; heads [h0, h1) round and rope their queries in b[Q] and attend over the
 * window and the selection into b[O] (scratch: scores, attn_acc), any split of the heads giving
 * the same bits; ring_write puts the item's window KV into the ring. With win, window positions
 * from win->pos0 on are read from win->kv (row t - pos0, ld floats apart) instead of the ring:
 * the items of one chunk attend to each other's KV before it is written (a later item's write
 * would overwrite a slot an earlier item still reads when the chunk is longer than the window). */
typedef struct mf_ly_win {
    const float *kv;
    int64_t ld, pos0;
} mf_ly_win;
int mf_ly_attn_core_prep(mf_ly_ctx *cx, mf_ly_item *it, int L, float *const *b);
/* The prep in three steps (mf_ly_attn_core_prep: kv, scores of all visible entries into
 * cx->scores, select): kv readies the window KV, runs the compressor and readies the index query
 * (b[QI], b[IW]); index_scores scores the visible entries [j0, j1) of an index-source layer into
 * score (any split of the entries gives the same bits; reads the layer's KV source, nothing of a
 * context); select builds the candidate mask, the top-k selection (scratch: picks) and calls the
 * select hook. index_n_vis: the entries an index-source layer scores at pos (0 on other layers). */
int mf_ly_attn_core_kv(mf_ly_ctx *cx, mf_ly_item *it, int L, float *const *b);
/* The kv step in its two halves (core_kv runs them in a row): window_kv readies the window KV and
 * runs the compressor (it reads only the IN stage's outputs b[KV], b[LAT], b[GATE]; items of one
 * sequence in position order); index_query readies the index query in place (b[QI] of the QB
 * stage, b[IW]). They touch disjoint data, so they may run in either order or at once. */
int mf_ly_attn_window_kv(mf_ly_ctx *cx, mf_ly_item *it, int L, float *const *b);
/* window_kv's two parts (it runs them in a row), which touch disjoint data: the window KV in place
 * (b[KV]; any item on its own) and the compressor (b[LAT], b[GATE] and the layer's cache: items of
 * one sequence in position order). */
void mf_ly_attn_kv_window(const mf_ly_ctx *cx, const mf_ly_item *it, int L, float *const *b);
int mf_ly_attn_kv_compress(mf_ly_ctx *cx, mf_ly_item *it, int L, float *const *b);
/* The compressor of a sequence's run of items in one step split over threads (kv_compress's bits,
 * entry by entry): compress_item runs an item's part, any items at once: the entry its position
 * closes (b[LAT] overwritten), a ratio-2 group's first token read from prev, the buffers of the
 * item before it in the run (at an even position: compress_item leaves them as they are), or with
 * prev NULL (the run's first item) from the state; it writes nothing of the state but the entry.
 * compress_state, once per run after compress_item of the run's first item (which reads the
 * state's open group), checks the state's entry count against first's position (-EINVAL: out of
 * step) and leaves it as kv_compress of every item would: the open group of the run's last item
 * that opened one (ratio 2: its buffers b_open; NULL when no item of the run opened one) and the
 * count. */
int mf_ly_attn_kv_compress_item(mf_ly_ctx *cx, const mf_ly_item *it, int L, float *const *b, float *const *prev);
int mf_ly_attn_kv_compress_state(mf_ly_ctx *cx, const mf_ly_item *first, const mf_ly_item *last, int L,
                                 float *const *b_open);
void mf_ly_attn_index_query(const mf_ly_ctx *cx, const mf_ly_item *it, int L, float *const *b);
int64_t mf_ly_index_n_vis(const mf_config *c, int L, int64_t pos);
void mf_ly_index_scores(const mf_layers *ly, const mf_ly_item *it, int L, float *const *b, double *score, int64_t j0,
                        int64_t j1);
void mf_ly_attn_core_select(mf_ly_ctx *cx, mf_ly_item *it, int L, double *score);
void mf_ly_attn_core_heads(mf_ly_ctx *cx, const mf_ly_item *it, int L, float *const *b, int h0, int h1,
                           const mf_ly_win *win);
void mf_ly_attn_ring_write(const mf_ly_ctx *cx, const mf_ly_item *it, int L, const float *kv);
/* One head's attention with a sink over n contiguous key rows (K = V, D floats each), the formula of
 * mf_ly_attn_core_heads: o = sum_t e^(s_t - m) k_t / (sum_t e^(s_t - m) + e^(sink - m)) with
 * s_t = q.k_t / sqrt(D), in double, o rounded to bf16. Scratch: s (n doubles), acc (D doubles). */
void mf_ly_attn_sink_rows(const float *qh, const float *keys, int64_t n, int D, double sink, double *s,
                          double *acc, float *oh);

/* ---- layer_moe.c: router and experts -------------------------------------------------------- */

/* The MoE sublayer of item it at layer L (router, routed experts, shared expert), in -> out. */
int mf_ly_moe(mf_ly_ctx *cx, mf_ly_item *it, int L, const float *in, float *out);
/* Rows [r0, r1) (experts) of layer L's router gate logits for n_tok inputs, double sums on every
 * backend (the routing is the reference's). */
int mf_ly_gate_rows(mf_ly_ctx *cx, int L, const float *x, int n_tok, int64_t ld_x, float *logits,
                    int64_t ld_y, int64_t r0, int64_t r1);
/* The routing of item it at layer L from its gate logits (scratch: gate_bias), with the route
 * hook. */
void mf_ly_route_item(mf_ly_ctx *cx, const mf_ly_item *it, int L, const float *logits, int32_t *experts,
                      float *weights);
/* Router of one token: logits[n_routed] are the gate logits; picks the top n_experts_per_tok of
 * sqrtsoftplus(logits) + bias (ties: lower index), weights normalized and scaled. _n: of n experts
 * top-k (a draft stage's: mf_config_layer_experts, mf_config_layer_topk). The route hook is called
 * for backbone layers only. */
void mf_ly_route(const mf_config *c, const float *logits, const float *bias, int32_t *experts,
                 float *weights);
void mf_ly_route_n(const mf_config *c, int n, int k, const float *logits, const float *bias, int32_t *experts,
                   float *weights);

/* ---- layer_dspark.c: the DSpark draft (docs/dspark.md) --------------------------------------- */

/* The draft of a model loaded with its draft (mf_model_opts.load_draft), stage s at layer index
 * n_layers + s of the tables. Per round it drafts dspark_block_size positions after an anchor a
 * (the last token the target has produced, not yet run through it): the anchor's embedding, then
 * the noise token's, at positions a..a+B-1, predicting the tokens at a+1..a+B. Each stage's window
 * attention reads the target's context, positions a-W..a-1 (W = sliding_window), and the block's
 * own positions (both ways).
 *
 * The context: the target's feature at position p is the mean over the hyper-connection streams
 * entering each layer of dspark_target_layer_ids (after its Engram, before its attention),
 * rounded to bf16, concatenated (n_target x hidden). The draft keeps, per sequence and stage, the
 * window KV of the projected features (stage 0's main_norm(main_proj(feature)), then the stage's
 * kv_norm(wkv(.)), RoPE at p, fp8 fake quantization: the backbone's window KV formula) in a ring of
 * mf_ly_draft_ring_slots positions: W + B, so that a verify's rejected positions (at most B past
 * the accepted ones) never overwrite a slot the next round reads. Rolling back is lowering n_pos. */
typedef struct mf_ly_draft_state {
    int64_t n_pos;     /* positions fed (their features' KV in the ring) */
    uint8_t *ring;     /* n_mtp_layers x mf_ly_draft_ring_slots packed window-KV rows (slot p % slots) */
} mf_ly_draft_state;

int64_t mf_ly_draft_ring_slots(const mf_config *c);
/* Bytes of a state's ring (all stages). */
int64_t mf_ly_draft_ring_bytes(const mf_config *c);

/* The feature of one layer input: out[hidden] = bf16(mean over the hc_mult streams of x). */
void mf_ly_draft_feature(const mf_config *c, const float *x, float *out);

/* A block's activations, sized once (mf_ly_draft_ws_new: one allocation of a {name, bytes, &ptr}
 * table): B = dspark_block_size positions. */
typedef struct mf_ly_draft_ws {
    float *x;        /* B x hc_mult x hidden: the streams */
    float *pre;      /* B x MF_LY_MAX_HC: the carried pre mixes */
    float *q;        /* B x heads x head_dim: the block's queries */
    float *kv;       /* B x head_dim: the block's window KV */
    float *keys;     /* (W + B) x head_dim: one query's keys (context, then block) */
    float *out;      /* B x hidden: a sublayer's outputs */
    float *feat;     /* hidden: the projected context feature being fed */
    float *normed;   /* B x hidden: the last stage's final-normed states */
    float *mk_emb;   /* dspark_markov_rank: a Markov embedding row */
    float *mk_out;   /* vocab_size: the Markov head's logits */
    void *mem;
} mf_ly_draft_ws;
int mf_ly_draft_ws_new(const mf_config *c, mf_ly_draft_ws *ws);
void mf_ly_draft_ws_free(mf_ly_draft_ws *ws);

/* Feeds the target's features of position ds->n_pos (feat: n_target x hidden, mf_ly_draft_feature
 * per target layer) into every stage's ring; n_pos advances. cx must belong to a model loaded with
 * its draft (-EINVAL otherwise). In two steps (the engine runs the projection in row parts):
 * u = main_proj feat (fp32, as mf_ly_linear gives it), then feed_kv rounds u to bf16 and norms it
 * with main_norm in place, writes every stage's window KV of it at ds->n_pos (scratch: cx->attn)
 * and advances n_pos. */
#define MF_LY_DRAFT_MAX_D 4096   /* head_dim the draft's feed supports (a KV row on the stack) */
int mf_ly_draft_feed(mf_ly_ctx *cx, mf_ly_draft_ws *ws, mf_ly_draft_state *ds, const float *feat);
int mf_ly_draft_feed_kv(mf_ly_ctx *cx, mf_ly_draft_state *ds, float *u);
/* feed_kv's pieces, for rows fed together (the engine reads each stage's wkv once for all of them):
 * norm rounds a projected row u and norms it with main_norm in place; put takes stage s's wkv
 * output kv of a normed row (head_dim floats, as the linear gives them; overwritten) through the
 * window KV formula (kv_norm, RoPE at pos, fp8) and packs it into the ring's slot of pos. */
void mf_ly_draft_feed_norm(const mf_ly_ctx *cx, float *u);
void mf_ly_draft_feed_put(const mf_ly_ctx *cx, mf_ly_draft_state *ds, int s, int64_t pos, float *kv);

/* The pieces of a stage's attention the engine runs as tasks (graphs/step/step_draft.c): context
 * unpacks stage s's context rows for a block at anchor position a (positions max(0, a - W)..a-1)
 * into keys (head_dim floats each) and returns their count; head runs head h of a block position at
 * pos over n_keys rows (the context, then the block's window KV): its query (q: the position's
 * heads x head_dim, head h rounded and roped in place) attends with the sink into o's head h,
 * inverse-roped (scratch: cx->scores, at least n_keys; cx->attn_acc). */
int64_t mf_ly_draft_context(const mf_config *c, const mf_ly_draft_state *ds, int s, int64_t a, float *keys);
void mf_ly_draft_head(mf_ly_ctx *cx, int L, int64_t pos, int h, float *q, const float *keys, int64_t n_keys, float *o);

/* The heads' pieces: the Markov embedding of token prev (dspark_markov_rank floats from the bf16
 * table) and the confidence logit of a normed state (hidden) with that embedding. */
void mf_ly_draft_mk_emb(const mf_layers *ly, int32_t prev, float *emb);
float mf_ly_draft_confidence(const mf_layers *ly, const float *normed, const float *emb);

/* One round's forward: the block after anchor token `anchor` at position ds->n_pos through every
 * stage; leaves the last stage's final-normed states in ws->normed (B x hidden). routes (NULL, or
 * n_mtp_layers x B x dspark_num_experts_per_tok) receives each stage's routed experts. */
int mf_ly_draft_block(mf_ly_ctx *cx, mf_ly_draft_ws *ws, const mf_ly_draft_state *ds, int32_t anchor,
                      int32_t *routes);

/* The heads of block position i (0..B-1) given the token before it, prev (the anchor for i = 0,
 * else the candidate at i - 1): logits[vocab] = head(normed_i) (fp32) + bf16(markov_head(
 * markov_embed[prev])), and *confidence = confidence_head(normed_i, markov_embed[prev]) (a logit:
 * sigmoid of it estimates that the candidate is accepted given the ones before it). */
int mf_ly_draft_heads(mf_ly_ctx *cx, const mf_ly_draft_ws *ws, int i, int32_t prev, float *logits,
                      float *confidence);

/* ---- layer_engram.c ------------------------------------------------------------------------- */

int mf_ly_engram_setup(mf_layers *ly);
int mf_ly_engram(mf_ly_ctx *cx, mf_ly_item *it, int L);
/* Its phases (the engine runs the wkv projection between them, split by rows): embed hashes the
 * item's n-grams, reads (the store's gatherer or the table) and dequantizes its table rows into
 * emb (n-gram heads x head_dim floats); gate adds the gated value of kv (= wkv emb, (hc + 1) x
 * hidden) into the item's streams. */
int mf_ly_engram_embed(mf_ly_ctx *cx, const mf_ly_item *it, int L, float *emb);
/* embed's own phases, for an engine that reads the rows on its own IO lane: rows writes the
 * item's table rows ((max_ngram - 1) x n_heads, n-gram major) at layer L; dequant turns their
 * codes (head_dim bytes each) and scales (head_dim / 32 each), in that order, into emb. */
void mf_ly_engram_rows(const mf_layers *ly, const mf_ly_item *it, int L, int64_t *rows);
void mf_ly_engram_dequant(const mf_layers *ly, const uint8_t *codes, const uint8_t *scales, float *emb);
void mf_ly_engram_gate(mf_ly_ctx *cx, mf_ly_item *it, int L, const float *kv);
/* Engram hash parameters of Engram slot k: multipliers[max_ngram] (odd int64), primes and row
 * offsets [(max_ngram-1) * n_heads] (n-gram major). 0 or -EINVAL. */
int mf_ly_engram_params(const mf_config *c, int slot, int64_t *multipliers, int64_t *primes,
                        int64_t *offsets);

#endif
