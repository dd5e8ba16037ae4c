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
    float *s[10];                /* each s_len floats: s[0..2] the layer loop, s[3..9] sublayers */
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

/* ref_moe.c */
int mf_ref_moe(mf_ref *r, mf_ref_item *it, int L, const float *in, float *out);

/* ref_engram.c */
int mf_ref_engram_setup(mf_ref *r);
int mf_ref_engram(mf_ref *r, mf_ref_item *it, int L);

#endif
