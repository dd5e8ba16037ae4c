/* Fused CPU matmul kernels over checkpoint formats: y[t][o] = sum_k W[o][k] * x[t][k] with W read
 * in its stored form (BF16, FP8 E4M3 + 32x32 E8M0 tiles, packed E2M1 + 1x32 E8M0) once per call for
 * all tokens and never written out expanded, plus the expert FFN (w1, w3, swiglu, w2) in two phases.
 *
 * Threading: every kernel computes output rows [r0, r1) only, so a caller splits rows across
 * workers; each output element is one fixed-order reduction, so results are bit-identical however
 * rows are split. SIMD: AVX2+FMA paths chosen at run time, a scalar fallback otherwise (or when
 * forced with mf_kern_simd_set; the library reads no environment variable, the moeflow command
 * turns MOEFLOW_SIMD=scalar|avx2|auto into that call); the scalar paths reproduce the AVX2 lane
 * order, so both give the same bits.
 *
 * Two FP4 paths:
 *  - int8 (the decode path): activations are quantized once per call (mf_kern_q8_quantize) to int8
 *    with one float scale per token per 256 inputs; the AVX2 path multiplies with vpmaddubsw /
 *    vpmaddwd, folding each 32-block's E8M0 scale into an int16 factor relative to the largest
 *    scale of its 256-group (blocks more than 14 binades below it are dropped). Integer sums are
 *    exact; the error vs the fp32 reference is the activation rounding: 1.0% (Gaussian inputs),
 *    3.1% with 1% 8x outliers, max over test runs (docs/kernels.md).
 *  - fp32 (mf_kern_fp4_matmul_f32): weights decoded to fp32 in L1-sized tiles, fp32 FMA against
 *    fp32 activations; the only error is fp32 summation.
 * FP8 and BF16 use the fp32 scheme. Number formats as in host/formats.h. */
#ifndef MF_KERNELS_H
#define MF_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* Tokens per pass over the weights: callers may pass more; every further 64 re-read W once. */
#define MF_KERN_TOK_PASS 64

typedef enum mf_kern_simd {
    MF_KERN_SIMD_AUTO = 0,   /* the default: AVX2+FMA when the CPU has AVX2, FMA and F16C, else scalar */
    MF_KERN_SIMD_SCALAR,
    MF_KERN_SIMD_AVX2,
} mf_kern_simd;

/* The path the kernels use now (never AUTO). The AVX2 path needs AVX2, FMA and F16C. */
mf_kern_simd mf_kern_simd_active(void);
/* Sets the path for this process; the default, before any call, is AUTO (the run-time choice
 * above), and AUTO restores it. SCALAR forces the fallback (tests, benches, the moeflow command's
 * MOEFLOW_SIMD=scalar). 0; -ENOTSUP (with a message) when AVX2 is asked for on a CPU without
 * them; -EINVAL for an unknown value. Not thread-safe against kernels running at the same time:
 * set it before starting work. */
int mf_kern_simd_set(mf_kern_simd s);
const char *mf_kern_simd_name(mf_kern_simd s);

/* Tokens from which the FP8, BF16 and FP4 fp32 kernels run as a blocked GEMM (AVX2 path): rows in
 * blocks of 9, each block's weights decoded once per tile and applied to the tokens in register
 * blocks of 3 rows x 4 tokens. Same lanes and fmaf order as below it, so the same bits. */
#define MF_KERN_GEMM_MIN_TOK 16
/* 0: the per-row tile at every token count (benches compare the two paths in one run); 1: the
 * default. Not thread-safe against kernels running at the same time. */
void mf_kern_gemm_set(int on);

typedef enum mf_kern_fmt {
    MF_KERN_BF16 = 1,   /* w: uint16 [n_out][n_in]; scale: unused */
    MF_KERN_FP8,        /* w: E4M3 [n_out][n_in]; scale: E8M0 [ceil(n_out/32)][n_in/32] */
    MF_KERN_FP4,        /* w: E2M1 pairs [n_out][n_in/2], low nibble first; scale: E8M0 [n_out][n_in/32] */
} mf_kern_fmt;

/* A weight matrix as stored ([out, in] rows), viewed, not owned. n_in must be a positive multiple
 * of 32 for every format. */
typedef struct mf_kern_mat {
    mf_kern_fmt fmt;
    const void *w;
    const uint8_t *scale;
    int n_out, n_in;
} mf_kern_mat;

/* Quantized activations for the FP4 int8 path: a view over caller memory set up by
 * mf_kern_q8_init. Token t, 32-block b: 64-byte groups per block pair (even elements of both
 * blocks, then odd elements) as bytes q + offset, and one float scale per 256 inputs. */
typedef struct mf_kern_q8 {
    int n_tok, n_in;
    int offset;         /* 0 (int8 codes: n_tok <= 2) or 128 (q + 128), chosen by mf_kern_q8_init
                         * from n_tok: init again when a call's token count changes */
    int n_sb;           /* 256-input groups per token */
    size_t row_bytes;   /* quantized bytes per token */
    uint8_t *q;         /* [n_tok][row_bytes], 32-byte aligned */
    float *scale;       /* [n_tok][n_sb] */
} mf_kern_q8;

/* Bytes a q8 buffer for n_tok x n_in needs (0 when n_in is not a positive multiple of 32 or
 * n_tok < 1). It is 32 + n_tok x (a token's bytes), so n_tok x mf_kern_q8_bytes(1, n_in) holds
 * n_tok tokens: buffers of row ranges laid out at row0 x mf_kern_q8_bytes(1, n_in) never overlap
 * while the ranges do not (the step's routed-expert slots, one area per slot in rows, not one
 * sized for every row). */
size_t mf_kern_q8_bytes(int n_tok, int n_in);
/* Points q at buf (buf_bytes >= mf_kern_q8_bytes; any alignment). -EINVAL on bad sizes. */
int mf_kern_q8_init(mf_kern_q8 *q, void *buf, size_t buf_bytes, int n_tok, int n_in);
/* Quantizes tokens [t0, t1) of x (row t at x + t * ld_x, n_in floats) into q: per token per 256
 * inputs, scale = max|x| / 127 and q = round-to-even(x * 127 / max|x|). A group holding inf or
 * NaN gets a NaN scale (its outputs become NaN). Workers may quantize disjoint token ranges. */
int mf_kern_q8_quantize(const mf_kern_q8 *q, const float *x, int ld_x, int t0, int t1);

/* The kernels. Token t's input is row t of x (ld_x floats apart) or of xq; outputs y[t * ld_y + o]
 * for o in [r0, r1) are written (not accumulated). Return 0, or -EINVAL with a message for bad
 * shapes, ranges or NULL pointers (nothing is written then). */
int mf_kern_fp4_matmul(const uint8_t *w, const uint8_t *scale, int n_out, int n_in,
                       const mf_kern_q8 *xq, float *y, int ld_y, int r0, int r1);
int mf_kern_fp4_matmul_f32(const uint8_t *w, const uint8_t *scale, int n_out, int n_in,
                           const float *x, int n_tok, int ld_x, float *y, int ld_y, int r0, int r1);
int mf_kern_fp8_matmul(const uint8_t *w, const uint8_t *scale, int n_out, int n_in,
                       const float *x, int n_tok, int ld_x, float *y, int ld_y, int r0, int r1);
/* 1 when the FP8 one-token loop runs 16-lane AVX-512 (the CPU has F, BW and VL), and when the FP4
 * one-token loop runs on AVX-512 (also VNNI and VBMI), else 0; both give the AVX2 loops' bits. The
 * first also says whether the BF16 loop of 2..8 tokens (a speculative verify's head: every token
 * from one pass over the weights in registers, host/kern_bf16.c) runs, which gives the tile
 * engine's bits. set: 0 keeps all on AVX2, 1 or -1 uses AVX-512 where the CPU has it (tests,
 * MOEFLOW_SIMD). */
int mf_kern_fp8_tok1_avx512(void);
int mf_kern_fp4_tok1_avx512(void);
void mf_kern_tok1_set_avx512(int on);
/* The BF16 one-token loop's L2 prefetch (host/kern_bf16.c): 1 on, 0 off, -1 still being measured
 * on this machine (the first large calls alternate both and keep the faster). The results are the
 * same bits either way. set: 0 or 1 fixes it, else measures again from zero (tests). */
int mf_kern_bf16_tok1_prefetch(void);
void mf_kern_bf16_tok1_set_prefetch(int pf);
int mf_kern_bf16_matmul(const uint16_t *w, int n_out, int n_in,
                        const float *x, int n_tok, int ld_x, float *y, int ld_y, int r0, int r1);

/* An input to mf_kern_matmul / the FFN: fp32 rows, and for FP4 weights optionally their q8 copy
 * (q8 != NULL selects the int8 path, NULL the fp32 path). */
typedef struct mf_kern_in {
    const float *x;
    int n_tok, ld_x;
    const mf_kern_q8 *q8;
} mf_kern_in;

/* Dispatches on m->fmt. */
int mf_kern_matmul(const mf_kern_mat *m, const mf_kern_in *in, float *y, int ld_y, int r0, int r1);

/* The expert FFN, as two row-split phases (v41-flash step 5):
 *   phase 1, rows [r0, r1) of the hidden size (w1/w3 n_out):
 *     g = min(w1 x, limit); u = clamp(w3 x, -limit, limit);
 *     h[t][r] = (silu(g) * u) * tok_weight[t]            (tok_weight NULL: weight 1)
 *   between phases, once: quantize h (mf_kern_q8_quantize) when w2 is FP4 and the int8 path is used;
 *   phase 2, rows [r0, r1) of the model size: y = w2 h  (mf_kern_ffn_down = mf_kern_matmul).
 * w1, w3 (and w2) may be FP4 (routed experts) or FP8 (shared expert). h has ld_h >= w1->n_out. */
int mf_kern_ffn_up(const mf_kern_mat *w1, const mf_kern_mat *w3, const mf_kern_in *x,
                   const float *tok_weight, float limit, float *h, int ld_h, int r0, int r1);
int mf_kern_ffn_down(const mf_kern_mat *w2, const mf_kern_in *h, float *y, int ld_y, int r0, int r1);

/* ---- fp32 vector code (host/kern_vec.c) ----
 * The engine's fast per-item attention math (graphs/step/fast_attn.c) and what `moeflow calibrate`
 * times for the profile's host_vec rate. A dot product of n floats is 16 lanes (lane l sums
 * elements k = l mod 16 in k order with fmaf), then a fixed tree (lanes l and l+8, then l+4, l+2,
 * l+1); a weighted value sum is one fmaf chain per output element in key order. The AVX2 path
 * (n or D a multiple of 16) and the scalar path compute exactly that: the same bits. */

/* x[0..n) rounded to bf16 in place (host/formats.h mf_bf16_round, NaN included): 8 lanes at a time
 * on the AVX2 path, the same bits. graphs/layers mf_bf_n and the engine's heads run on it. */
void mf_kern_vec_bf16_round(float *x, int64_t n);
/* y[0..n) = the bf16 codes of x[0..n) (host/formats.h mf_bf16_from_f32, NaN included), and back:
 * x[0..n) = the floats of codes y[0..n) (exact). unpack(pack(x)) is mf_kern_vec_bf16_round(x): x
 * itself for a value already rounded to bf16, so an activation that is bf16 travels in 2 bytes
 * without loss (the dense chains' copies, graphs/step/stepgraph.h mf_sg_attn_buf_bf16). 8 lanes at
 * a time on the AVX2 path, the same bits. */
void mf_kern_vec_bf16_pack(const float *x, uint16_t *y, int64_t n);
void mf_kern_vec_bf16_unpack(const uint16_t *y, float *x, int64_t n);
/* y[0..n) = x[0..n) * s (one fp32 product each: the same bits on every path), 8 lanes at a time on
 * the AVX2 path. */
void mf_kern_vec_scale(float *y, const float *x, float s, int64_t n);
/* out[g] = q[g] . k for G (1..4) queries against one vector k of n floats. */
void mf_kern_vec_dots(const float *const *q, int G, const float *k, int n, float *out);
/* out[j][g] = q[g] . k[j] for G (1..4) queries and nk keys: per key the bits of mf_kern_vec_dots;
 * four queries go in threes of keys on the AVX2 path (twelve dots in registers, each query vector
 * loaded once for three keys). */
void mf_kern_vec_dots_keys(const float *const *q, int G, const float *const *k, int64_t nk, int n, float (*out)[4]);
/* The indexer's scores of one item against nk keys k[j] (n floats each): score[j] = (float) of the
 * sum in double, over heads h in order, of the float w[h] * max(q_h . k[j], 0), q_h = q + h * n
 * (mf_kern_vec_dots_keys' dots, four heads at a time). graphs/step/fast_attn.c on the host and
 * device/dense_host.c on emulated cards run it (one home); the CUDA kernel computes the same
 * lanes, tree and order (device/kern_attn.h). */
void mf_kern_vec_index_scores(const float *q, const float *w, int n_heads, const float *const *k, int64_t nk, int n,
                              double *score);
/* The 16 lanes of dots carried over blocks of columns (a long vector read in pieces, each piece
 * once for many queries): acc[(g * ld + j) * 16 + l] continues lane l's fmaf chain (elements
 * i = l mod 16 in i order) of q[g] . k[j] over n elements, for G (1..4) queries and nk keys; four
 * queries go in threes of keys on the AVX2 path (mf_kern_vec_dots_keys' loop). With acc zero before
 * a vector's first piece, pieces fed in order, every piece but the last of a multiple of 16
 * elements, mf_kern_vec_lanes_sum(acc + (g * ld + j) * 16) gives the bits of mf_kern_vec_dots. */
void mf_kern_vec_dots_lanes(const float *const *q, int G, const float *const *k, int nk, int n, float *acc, int ld);
/* The tree of 16 lanes (l and l+8, then l+4, l+2, l+1): a dot's result. */
float mf_kern_vec_lanes_sum(const float *l);
/* acc[g * D + d] = sum over i in [0, n) of e[g * ld_e + i] * kp[i][d], for G (1..4) weight rows. */
void mf_kern_vec_values(const float *const *kp, int64_t n, const float *e, int64_t ld_e, int G, int D, float *acc);
/* One group of G (1..4) attention heads over the same n keys kp[i] (D floats each, values = keys):
 * s[g * n + i] = expf(scale * q[g].kp[i] - mx[g]) with mx[g] the largest of sink[g] and the scaled
 * scores, den[g] = expf(sink[g] - mx[g]) + the sum of s[g * n + i] in key order (double), acc as
 * mf_kern_vec_values of s. 2 G n D multiply-adds. s holds G n floats, acc G D. */
void mf_kern_vec_attn(const float *const *q, int G, const float *const *kp, int64_t n, int D, float scale,
                      const float *sink, float *s, float *acc, double *den);
/* The heads of a group as the engine's attention gives them (graphs/step/fast_attn.c on the host,
 * device/dense_host.c on emulated cards: one home): mf_kern_vec_attn, then o[g][d] =
 * bf16((float)((double)acc[g * D + d] / den[g])). D at most MF_KERN_VEC_ATTN_MAX_D; s as
 * mf_kern_vec_attn's. */
#define MF_KERN_VEC_ATTN_MAX_D 512
void mf_kern_vec_attn_out(const float *const *q, int G, const float *const *kp, int64_t n, int D, float scale,
                          const float *sink, float *s, float *const *o);

#endif
