/* Internals shared by the reference forward's files (graphs/ref_*.c): the forward object, the
 * per-sequence state, the per-item activations, and the plain numeric helpers of ref_ops.c. */
#ifndef MF_REF_INTERNAL_H
#define MF_REF_INTERNAL_H

#include <math.h>
#include <stdint.h>

#include "graphs/ref.h"
#include "host/formats.h"

#define MF_REF_MAX_HC 16

/* Compressed cache of one KV-source layer. */
typedef struct mf_ref_cache {
    float *kv;        /* cap x head_dim: roped, fp4 fake-quantized entries */
    float *key;       /* cap x index_head_dim: roped, fp4 fake-quantized index keys */
    int64_t n;        /* entries emitted */
    float *pend_kv;   /* ratio 2: the first token of the open group (fp32 kv and gate score) */
    float *pend_score;
} mf_ref_cache;

struct mf_ref_state {
    const mf_ref *r;
    int64_t max_pos;
    int64_t n_pos;       /* tokens consumed */
    int32_t *tokens;     /* max_pos: token ids (history, for Engram) */
    float *ring;         /* n_layers x sliding_window x head_dim (slot = pos % window) */
    mf_ref_cache *cache; /* n_layers; kv/key NULL on non-source layers */
    void *mem;           /* the one allocation behind the arrays */
};

typedef struct mf_ref_pick {
    double score;
    int32_t idx;
} mf_ref_pick;

/* Sorts picks by score descending, ties by index ascending. */
void mf_ref_sort_picks(mf_ref_pick *p, int64_t n);

/* One (sequence, token) of a forward call, with the activations carried between layers. */
typedef struct mf_ref_item {
    mf_ref_state *st;
    int64_t pos;
    int32_t tok;
    float *x;                   /* hc_mult x hidden: the residual streams */
    float pre[MF_REF_MAX_HC];   /* the pre mix carried one sublayer ahead */
    int32_t *topk;              /* index_topk: latest selection (entries of the KV source) */
    int n_topk;
    int topk_src;               /* KV source the selection refers to (-1: none yet) */
    int32_t *cand;              /* candidate_topk_blocks: kept blocks, ascending */
    int n_cand;
    int cand_src;               /* KV source of the candidate mask (-1: none yet) */
    float *logits;
} mf_ref_item;

struct mf_ref {
    const mf_model *m;
    const mf_config *c;
    mf_ref_opts opts;
    int32_t *token_map;          /* vocab_size entries */
    float *freqs_main, *freqs_comp;   /* rope_dim/2 each */
    int src_of[MF_CONFIG_MAX_LAYERS];  /* KV source of each compressed layer (-1 otherwise) */
    /* Engram hash parameters per slot */
    int64_t eg_mult[MF_CONFIG_MAX_ENGRAM][8];
    int64_t *eg_prime[MF_CONFIG_MAX_ENGRAM], *eg_off[MF_CONFIG_MAX_ENGRAM];
    /* scratch (one allocation) */
    float *s[12];                /* each s_len floats: s[0..2] the layer loop, s[3..11] sublayers */
    float *s_aq;                 /* act-quant copy of a linear input */
    int64_t s_len;
    double *s_scores;            /* attention/index scores, s_scores_len long (grown per call) */
    struct mf_ref_pick *s_picks; /* top-k sorting, s_scores_len long */
    int64_t s_scores_len;
    uint8_t *lazy_data, *lazy_scale;   /* one lazy weight */
    float *ex_out;               /* with an expert store: n_experts_per_tok x hidden outputs */
    int64_t *eg_rows;            /* Engram rows of one item: per rows, codes and scales */
    uint8_t *eg_codes, *eg_scales;
    mf_ref_times times;
    /* 0 for the oracle. Set only by the scheduled engine on its own forward objects: resident
     * FP8/BF16 linears without act-quant then run on host/kernels.h (fp32 sums, ~1e-7 apart). */
    int kern_linear;
    void *mem;
};

/* ---- ref_ops.c: numeric helpers ---------------------------------------------------------- */

static inline float mf_bf(float x) { return mf_bf16_to_f32(mf_bf16_from_f32(x)); }
void mf_bf_n(float *x, int64_t n);

/* y[rows] = W x[cols], accumulated in double per 32-column block, rounded to fp32. W of any kind
 * but MF_W_TABLE; lazy weights are read into r's scratch. With aq, x is first fake-quantized to
 * e4m3 1x32 (a copy; x itself is untouched). With r->kern_linear (never on the oracle), resident
 * FP8/BF16 weights go through mf_kern_matmul instead. */
int mf_ref_linear(mf_ref *r, const mf_weight *w, const float *x, float *y, int aq);
/* Rows [r0, r1) of y = W x for n_tok inputs (row t of x at x + t * ld_x, of y at y + t * ld_y),
 * without act quant: with kern set, resident FP8/BF16 weights on mf_kern_matmul, else the
 * double sums of mf_ref_linear_rows; each row the same bits as mf_ref_linear gives it. */
int mf_ref_linear_part(mf_ref *r, const mf_weight *w, int kern, const float *x, int n_tok, int64_t ld_x,
                       float *y, int64_t ld_y, int64_t r0, int64_t r1);
/* Rows [row0, row0+n) of W only (same rules; used by the grouped wo_a). */
int mf_ref_linear_rows(mf_ref *r, const mf_weight *w, int64_t row0, int64_t n, const float *x,
                       int64_t x_cols, int64_t col0, float *y);
/* Element i of a bf16/f32 vector weight. */
float mf_ref_vec(const mf_weight *w, int64_t i);

/* out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))) (the HF port's rounding). out may be x. */
void mf_ref_rmsnorm(const float *x, int64_t n, const mf_weight *w, double eps, float *out);

/* Interleaved RoPE on the last 2*n_pairs dims of x (pairs (2i, 2i+1)) at position pos; inverse
 * rotates by the conjugate. fp32 angle pos*freq, as torch computes it. */
void mf_ref_rope(float *x, int n_pairs, const float *freqs, int64_t pos, int inverse);

/* Fake quantization in place over blocks of `block` values:
 * e4m3 with a power-of-two scale 2^ceil(log2(max(amax, 1e-4)/448)) (window KV, act quant);
 * e2m1 with an e8m0 scale 2^ceil(log2(max(amax, 6*2^-126)/6)) (index q and keys);
 * e2m1 with an e4m3 scale e4m3(max(amax, 6*2^-9)/6) (compressed KV entries). */
void mf_ref_fq_e4m3_pow2(float *x, int64_t n, int block);
void mf_ref_fq_e2m1_pow2(float *x, int64_t n, int block);
void mf_ref_fq_e2m1_e4m3(float *x, int64_t n, int block);

float mf_ref_silu(float x);
float mf_ref_sigmoid(float x);
float mf_ref_softplus(float x);   /* torch's: x above 20 returns x */

/* ---- per concern ----------------------------------------------------------------------- */

/* ref_hc.c */
void mf_ref_hc_mixes(const mf_ref *r, const float *x, const mf_weight *fn, float *mixes);
void mf_ref_hc_collapse(const mf_ref *r, const float *x, const float *pre, float *h);
void mf_ref_hc_expand(const mf_ref *r, float *x, const float *out, const float *post,
                      const float *comb);
void mf_ref_hc_split_w(const mf_config *c, const float *mixes, const mf_weight *scale,
                       const mf_weight *base, float *pre, float *post, float *comb);

/* ref_attn.c: the attention sublayer of item it at layer L; in = attn input (after attn_norm),
 * out = hidden_size outputs (bf16 values). */
int mf_ref_attn(mf_ref *r, mf_ref_item *it, int L, const float *in, float *out);

/* The same sublayer in phases, for the scheduled engine, which runs the weight-heavy linears split
 * by output rows across workers and the rest per item (docs/decode.md). mf_ref_attn is
 * in -> qnorm -> qb -> core -> oa -> ob over one item's buffers; the linear stages (IN, QB, OA,
 * OB) are lists of linears (mf_ref_attn_linears). The activations of one item between phases: */
enum {
    MF_RA_IN,     /* hidden_size: the input (after attn_norm) */
    MF_RA_QR,     /* q_lora_rank: wq_a in (q-normed by the qnorm phase) */
    MF_RA_KV,     /* n_kv_heads x head_dim: wkv in (the first head_dim used) */
    MF_RA_LAT,    /* head_dim: cmp_wkv in (KV-source layers) */
    MF_RA_GATE,   /* head_dim: cmp_wgate in (ratio-2 KV sources) */
    MF_RA_IW,     /* index_n_heads: idx_weights_proj in (index-source layers) */
    MF_RA_Q,      /* n_heads x head_dim: wq_b qr */
    MF_RA_QI,     /* index_n_heads x index_head_dim: idx_wq_b qr (index-source layers) */
    MF_RA_O,      /* n_heads x head_dim: attention output (inverse-roped) */
    MF_RA_Z,      /* o_groups x o_lora_rank: grouped wo_a o, bf16 */
    MF_RA_OUT,    /* hidden_size: wo_b z, bf16 */
    MF_RA_N
};
int64_t mf_ref_attn_buf_len(const mf_config *c, int buf);

enum { MF_RA_STAGE_IN, MF_RA_STAGE_QB, MF_RA_STAGE_OA, MF_RA_STAGE_OB, MF_RA_N_STAGES };
#define MF_RA_MAX_LIN 5   /* linears per stage */

/* One linear of a stage: buffer y = W buffer x. groups > 0 (wo_a): row block g of w->rows/groups
 * rows reads columns [g * w->cols, (g + 1) * w->cols) of x. */
typedef struct mf_ref_attn_lin {
    const mf_weight *w;
    int x, y;     /* MF_RA_* */
    int aq;       /* the reference fake-quantizes x first (with opts.act_quant) */
    int groups;
    int bf;       /* y is rounded to bf16 */
} mf_ref_attn_lin;

/* The linears of stage `stage` of layer L into out[0..MF_RA_MAX_LIN); returns their count. */
int mf_ref_attn_linears(const mf_ref *r, int L, int stage, mf_ref_attn_lin *out);
/* Rows [r0, r1) of linear l for n_tok items: item t reads x + t * ld_x and writes y + t * ld_y.
 * Without act quant only (the engine): each row as mf_ref_linear sums it with r->kern_linear
 * set, so any split of the rows gives the same bits. */
int mf_ref_attn_lin_rows(mf_ref *r, const mf_ref_attn_lin *l, const float *x, int64_t ld_x, float *y,
                         int64_t ld_y, int n_tok, int64_t r0, int64_t r1);
/* The phases; b[MF_RA_*] are one item's buffers. stage runs a linear stage whole (the reference's
 * calls, act quant included); qnorm rounds and normalizes QR; core is the per-item middle: RoPE,
 * window KV into the ring, compressor, indexer, attention with the sink into O (items of one
 * sequence in position order). */
int mf_ref_attn_stage(mf_ref *r, int L, int stage, float *const *b);
void mf_ref_attn_qnorm(const mf_ref *r, int L, float *const *b);
int mf_ref_attn_core(mf_ref *r, mf_ref_item *it, int L, float *const *b);

/* ref_moe.c */
int mf_ref_moe(mf_ref *r, mf_ref_item *it, int L, const float *in, float *out);

/* ref_engram.c */
int mf_ref_engram_setup(mf_ref *r);
int mf_ref_engram(mf_ref *r, mf_ref_item *it, int L);
/* Its phases (the engine runs the wkv projection between them, split by rows): embed hashes the
 * item's n-grams, reads (the store's gatherer or the table) and dequantizes its table rows into
 * emb (n-gram heads x head_dim floats); gate adds the gated value of kv (= wkv emb, (hc + 1) x
 * hidden) into the item's streams. */
int mf_ref_engram_embed(mf_ref *r, const mf_ref_item *it, int L, float *emb);
void mf_ref_engram_gate(mf_ref *r, mf_ref_item *it, int L, const float *kv);

#endif
