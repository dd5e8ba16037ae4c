/* Run-time SIMD choice, argument checks and the fp32 tile engine shared by the FP8, BF16 and FP4
 * fp32 kernels: a row's weights are decoded tile by tile into L1 and applied to every token there,
 * so W is read once per call; at MF_KERN_GEMM_MIN_TOK tokens or more, rows go in blocks of 9
 * through register-blocked GEMM tiles (3 rows x 4 tokens). AVX2+FMA, GEMM and scalar paths give identical bits (same lanes,
 * fmaf in k order). */
#include "host/kern_internal.h"

#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "sched/error.h"

static int mf_kern_simd_cached = -1;   /* resolved or forced choice; -1 = not yet (AUTO) */
static int mf_kern_gemm_on = 1;        /* mf_kern_gemm_set */

static int mf_kern_cpu_has_avx2(void)
{
    /* F16C through cpuid (leaf 1, ECX bit 29): clang 14's __builtin_cpu_supports lacks "f16c". */
    unsigned a, b, c, d;
    int f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
}

mf_kern_simd mf_kern_simd_active(void)
{
    int s = __atomic_load_n(&mf_kern_simd_cached, __ATOMIC_RELAXED);
    if (s < 0) {
        s = mf_kern_cpu_has_avx2() ? MF_KERN_SIMD_AVX2 : MF_KERN_SIMD_SCALAR;
        __atomic_store_n(&mf_kern_simd_cached, s, __ATOMIC_RELAXED);
    }
    return (mf_kern_simd)s;
}

int mf_kern_simd_set(mf_kern_simd s)
{
    if (s == MF_KERN_SIMD_AVX2 && !mf_kern_cpu_has_avx2())
        return mf_error(-ENOTSUP, "kernels: AVX2+FMA path asked for, but this CPU lacks AVX2, FMA or F16C");
    if (s != MF_KERN_SIMD_AUTO && s != MF_KERN_SIMD_SCALAR && s != MF_KERN_SIMD_AVX2)
        return mf_error(-EINVAL, "kernels: unknown SIMD path %d", (int)s);
    __atomic_store_n(&mf_kern_simd_cached, s == MF_KERN_SIMD_AUTO ? -1 : (int)s, __ATOMIC_RELAXED);
    return 0;
}

/* The one-token loops' AVX-512 forms: -1 not yet looked at, else bit 0 the FP8 loop's (F, BW, VL)
 * and bit 1 the FP4 loop's (also VNNI and VBMI), 0 when switched off. */
static int mf_kern_tok1_512 = -1;

static int mf_kern_tok1_512_bits(void)
{
    int v = __atomic_load_n(&mf_kern_tok1_512, __ATOMIC_RELAXED);
    if (v < 0) {
        __builtin_cpu_init();
        int f = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl");
        v = f | (f && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi")) << 1;
        __atomic_store_n(&mf_kern_tok1_512, v, __ATOMIC_RELAXED);
    }
    return v;
}

int mf_kern_fp8_tok1_avx512(void) { return mf_kern_tok1_512_bits() & 1; }
int mf_kern_fp4_tok1_avx512(void) { return (mf_kern_tok1_512_bits() >> 1) & 1; }

void mf_kern_tok1_set_avx512(int on)
{
    __atomic_store_n(&mf_kern_tok1_512, on == 0 ? 0 : -1, __ATOMIC_RELAXED);   /* else as the CPU allows */
}

void mf_kern_gemm_set(int on) { __atomic_store_n(&mf_kern_gemm_on, on != 0, __ATOMIC_RELAXED); }

const char *mf_kern_simd_name(mf_kern_simd s)
{
    switch (s) {
    case MF_KERN_SIMD_AUTO: return "auto";
    case MF_KERN_SIMD_SCALAR: return "scalar";
    case MF_KERN_SIMD_AVX2: return "avx2";
    }
    return "?";
}

int mf_kern_check(const char *who, const void *w, const void *scale, int need_scale, int n_out,
                  int n_in, const void *x, int n_tok, int ld_x, const float *y, int ld_y, int r0,
                  int r1)
{
    if (!w || (need_scale && !scale) || !x || !y)
        return mf_error(-EINVAL, "%s: NULL %s", who,
                        !w ? "weights" : (need_scale && !scale) ? "scales" : !x ? "input" : "output");
    if (n_out < 1 || n_in < 32 || n_in % 32)
        return mf_error(-EINVAL, "%s: shape [%d, %d]: expected n_out >= 1 and n_in a positive "
                        "multiple of 32", who, n_out, n_in);
    if (n_tok < 1 || ld_x < n_in || ld_y < n_out)
        return mf_error(-EINVAL, "%s: %d tokens, ld_x %d, ld_y %d for shape [%d, %d]: expected "
                        "n_tok >= 1, ld_x >= n_in, ld_y >= n_out", who, n_tok, ld_x, ld_y, n_out, n_in);
    if (r0 < 0 || r1 > n_out || r0 > r1)
        return mf_error(-EINVAL, "%s: row range [%d, %d) outside [0, %d)", who, r0, r1, n_out);
    return 0;
}

/* acc[t][32] += wt[0..n) . x[t][k0..k0+n), lane = k mod 32, fmaf in k order. */
static void mf_kern_f32_tile_scalar(const float *wt, int n, const float *x, int n_tok, int ld_x,
                                    int k0, float (*acc)[32])
{
    for (int t = 0; t < n_tok; t++) {
        const float *xt = x + (size_t)t * ld_x + k0;
        for (int j = 0; j < n; j += 32)
            for (int l = 0; l < 32; l++)
                acc[t][l] = fmaf(wt[j + l], xt[j + l], acc[t][l]);
    }
}

__attribute__((target("avx2,fma")))
static void mf_kern_f32_tile_avx2(const float *wt, int n, const float *x, int n_tok, int ld_x,
                                  int k0, float (*acc)[32])
{
    int t = 0;
    for (; t + 2 <= n_tok; t += 2) {
        const float *xa = x + (size_t)t * ld_x + k0, *xb = xa + ld_x;
        __m256 a0 = _mm256_load_ps(acc[t]), a1 = _mm256_load_ps(acc[t] + 8);
        __m256 a2 = _mm256_load_ps(acc[t] + 16), a3 = _mm256_load_ps(acc[t] + 24);
        __m256 b0 = _mm256_load_ps(acc[t + 1]), b1 = _mm256_load_ps(acc[t + 1] + 8);
        __m256 b2 = _mm256_load_ps(acc[t + 1] + 16), b3 = _mm256_load_ps(acc[t + 1] + 24);
        for (int j = 0; j < n; j += 32) {
            __m256 w0 = _mm256_load_ps(wt + j), w1 = _mm256_load_ps(wt + j + 8);
            __m256 w2 = _mm256_load_ps(wt + j + 16), w3 = _mm256_load_ps(wt + j + 24);
            a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xa + j), a0);
            a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xa + j + 8), a1);
            a2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xa + j + 16), a2);
            a3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xa + j + 24), a3);
            b0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xb + j), b0);
            b1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + j + 8), b1);
            b2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + j + 16), b2);
            b3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + j + 24), b3);
        }
        _mm256_store_ps(acc[t], a0), _mm256_store_ps(acc[t] + 8, a1);
        _mm256_store_ps(acc[t] + 16, a2), _mm256_store_ps(acc[t] + 24, a3);
        _mm256_store_ps(acc[t + 1], b0), _mm256_store_ps(acc[t + 1] + 8, b1);
        _mm256_store_ps(acc[t + 1] + 16, b2), _mm256_store_ps(acc[t + 1] + 24, b3);
    }
    for (; t < n_tok; t++) {
        const float *xa = x + (size_t)t * ld_x + k0;
        __m256 a0 = _mm256_load_ps(acc[t]), a1 = _mm256_load_ps(acc[t] + 8);
        __m256 a2 = _mm256_load_ps(acc[t] + 16), a3 = _mm256_load_ps(acc[t] + 24);
        for (int j = 0; j < n; j += 32) {
            a0 = _mm256_fmadd_ps(_mm256_load_ps(wt + j), _mm256_loadu_ps(xa + j), a0);
            a1 = _mm256_fmadd_ps(_mm256_load_ps(wt + j + 8), _mm256_loadu_ps(xa + j + 8), a1);
            a2 = _mm256_fmadd_ps(_mm256_load_ps(wt + j + 16), _mm256_loadu_ps(xa + j + 16), a2);
            a3 = _mm256_fmadd_ps(_mm256_load_ps(wt + j + 24), _mm256_loadu_ps(xa + j + 24), a3);
        }
        _mm256_store_ps(acc[t], a0), _mm256_store_ps(acc[t] + 8, a1);
        _mm256_store_ps(acc[t] + 16, a2), _mm256_store_ps(acc[t] + 24, a3);
    }
}

/* The blocked tile (GEMM) of the fp32 engine: two decoded rows wa, wb against tokens [0, nt) of
 * x, acc rows acca, accb. Register blocks of 2 rows x 4 tokens x 8 lanes: each weight vector is
 * loaded once per 4 tokens and each input vector once per 2 rows (the per-row tile loads both per
 * 2 FMAs). Lanes are independent sums, so each lane group runs over the whole tile on its own;
 * every lane is still one fmaf chain in k order, so the bits equal mf_kern_f32_tile_avx2's. */
__attribute__((target("avx2,fma")))
static void mf_kern_f32_gemm2_avx2(const float *wa, const float *wb, int n, const float *x, int nt,
                                   int ld_x, int k0, float (*acca)[32], float (*accb)[32])
{
    int t = 0;
    for (; t + 4 <= nt; t += 4) {
        const float *x0 = x + (size_t)t * ld_x + k0, *x1 = x0 + ld_x, *x2 = x1 + ld_x, *x3 = x2 + ld_x;
        for (int g = 0; g < 32; g += 8) {
            __m256 a0 = _mm256_load_ps(acca[t] + g), a1 = _mm256_load_ps(acca[t + 1] + g);
            __m256 a2 = _mm256_load_ps(acca[t + 2] + g), a3 = _mm256_load_ps(acca[t + 3] + g);
            __m256 b0 = _mm256_load_ps(accb[t] + g), b1 = _mm256_load_ps(accb[t + 1] + g);
            __m256 b2 = _mm256_load_ps(accb[t + 2] + g), b3 = _mm256_load_ps(accb[t + 3] + g);
            for (int j = g; j < n; j += 32) {
                __m256 w0 = _mm256_load_ps(wa + j), w1 = _mm256_load_ps(wb + j), v;
                v = _mm256_loadu_ps(x0 + j);
                a0 = _mm256_fmadd_ps(w0, v, a0);
                b0 = _mm256_fmadd_ps(w1, v, b0);
                v = _mm256_loadu_ps(x1 + j);
                a1 = _mm256_fmadd_ps(w0, v, a1);
                b1 = _mm256_fmadd_ps(w1, v, b1);
                v = _mm256_loadu_ps(x2 + j);
                a2 = _mm256_fmadd_ps(w0, v, a2);
                b2 = _mm256_fmadd_ps(w1, v, b2);
                v = _mm256_loadu_ps(x3 + j);
                a3 = _mm256_fmadd_ps(w0, v, a3);
                b3 = _mm256_fmadd_ps(w1, v, b3);
            }
            _mm256_store_ps(acca[t] + g, a0), _mm256_store_ps(acca[t + 1] + g, a1);
            _mm256_store_ps(acca[t + 2] + g, a2), _mm256_store_ps(acca[t + 3] + g, a3);
            _mm256_store_ps(accb[t] + g, b0), _mm256_store_ps(accb[t + 1] + g, b1);
            _mm256_store_ps(accb[t + 2] + g, b2), _mm256_store_ps(accb[t + 3] + g, b3);
        }
    }
    if (t < nt) {   /* the last 1..3 tokens: the per-row tile, same lanes and order */
        const float *xt = x + (size_t)t * ld_x;
        mf_kern_f32_tile_avx2(wa, n, xt, nt - t, ld_x, k0, acca + t);
        mf_kern_f32_tile_avx2(wb, n, xt, nt - t, ld_x, k0, accb + t);
    }
}

/* The main tile of the GEMM: three decoded rows against four tokens of x, in register blocks of
 * 3 rows x 4 tokens x 8 lanes (12 accumulators): per step each weight vector is used by 4 tokens
 * and each input vector, loaded once into a register, by 3 rows (7 loads per 12 FMAs; the pair
 * tile above loads 6 per 8 and its inputs twice, as the compiler folds them into the FMAs).
 * first: the accumulators start at +0 (the first tile of the row; no memset before it). Every
 * lane is still one fmaf chain in k order, so the bits equal mf_kern_f32_tile_avx2's. */
__attribute__((target("avx2,fma")))
static void mf_kern_f32_gemm3x4_avx2(const float *wa, const float *wb, const float *wc, int n,
                                     const float *x, int ld_x, int k0, float (*acca)[32],
                                     float (*accb)[32], float (*accc)[32], int first)
{
    const float *x0 = x + k0, *x1 = x0 + ld_x, *x2 = x1 + ld_x, *x3 = x2 + ld_x;
    for (int g = 0; g < 32; g += 8) {
        __m256 a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3;
        if (first) {
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = c0 = c1 = c2 = c3 = _mm256_setzero_ps();
        } else {
            a0 = _mm256_load_ps(acca[0] + g), a1 = _mm256_load_ps(acca[1] + g);
            a2 = _mm256_load_ps(acca[2] + g), a3 = _mm256_load_ps(acca[3] + g);
            b0 = _mm256_load_ps(accb[0] + g), b1 = _mm256_load_ps(accb[1] + g);
            b2 = _mm256_load_ps(accb[2] + g), b3 = _mm256_load_ps(accb[3] + g);
            c0 = _mm256_load_ps(accc[0] + g), c1 = _mm256_load_ps(accc[1] + g);
            c2 = _mm256_load_ps(accc[2] + g), c3 = _mm256_load_ps(accc[3] + g);
        }
        for (int j = g; j < n; j += 32) {
            __m256 w0 = _mm256_load_ps(wa + j), w1 = _mm256_load_ps(wb + j), w2 = _mm256_load_ps(wc + j), v;
/* keeps v in a register: folded into each FMA it would be loaded three times */
#define MF_KERN_GEMM_STEP(xp, A, B, C)                                                                     \
            v = _mm256_loadu_ps((xp) + j);                                                                 \
            __asm__("" : "+x"(v));                                                                         \
            A = _mm256_fmadd_ps(w0, v, A), B = _mm256_fmadd_ps(w1, v, B), C = _mm256_fmadd_ps(w2, v, C)
            MF_KERN_GEMM_STEP(x0, a0, b0, c0);
            MF_KERN_GEMM_STEP(x1, a1, b1, c1);
            MF_KERN_GEMM_STEP(x2, a2, b2, c2);
            MF_KERN_GEMM_STEP(x3, a3, b3, c3);
#undef MF_KERN_GEMM_STEP
        }
        _mm256_store_ps(acca[0] + g, a0), _mm256_store_ps(acca[1] + g, a1);
        _mm256_store_ps(acca[2] + g, a2), _mm256_store_ps(acca[3] + g, a3);
        _mm256_store_ps(accb[0] + g, b0), _mm256_store_ps(accb[1] + g, b1);
        _mm256_store_ps(accb[2] + g, b2), _mm256_store_ps(accb[3] + g, b3);
        _mm256_store_ps(accc[0] + g, c0), _mm256_store_ps(accc[1] + g, c1);
        _mm256_store_ps(accc[2] + g, c2), _mm256_store_ps(accc[3] + g, c3);
    }
}

/* mf_kern_reduce32 on the vector unit, the same adds in the same order (lane-wise
 * (v0 + v1) + (v2 + v3), then l + (l + 4), then (0 + 2, 1 + 3), then the two): the same bits. */
__attribute__((target("avx2,fma")))
static inline float mf_kern_reduce32_avx2(const float *v)
{
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_load_ps(v), _mm256_load_ps(v + 8)),
                             _mm256_add_ps(_mm256_load_ps(v + 16), _mm256_load_ps(v + 24)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    __m128 r = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(r, _mm_shuffle_ps(r, r, 1)));
}

/* The four lane-wise sums (v0 + v1) + (v2 + v3) of mf_kern_reduce32 for one accumulator. */
__attribute__((target("avx2,fma")))
static inline __m256 mf_kern_reduce32_lanes(const float *v)
{
    return _mm256_add_ps(_mm256_add_ps(_mm256_load_ps(v), _mm256_load_ps(v + 8)),
                         _mm256_add_ps(_mm256_load_ps(v + 16), _mm256_load_ps(v + 24)));
}

/* mf_kern_reduce32 of eight accumulators a[0..8) at once, into one vector (a[k]'s sum in lane k):
 * the same adds of the same operands as mf_kern_reduce32_avx2, moved between registers so that
 * each step adds eight at a time (s[l] + s[l + 4], then (0 + 2, 1 + 3), then the two). */
__attribute__((target("avx2,fma")))
static inline __m256 mf_kern_reduce32x8_avx2(const float *const a[8])
{
    __m256 s[8], q[4], r[2];
    for (int k = 0; k < 8; k++) s[k] = mf_kern_reduce32_lanes(a[k]);
    for (int k = 0; k < 4; k++)   /* [q of 2k | q of 2k + 1], q[l] = s[l] + s[l + 4] */
        q[k] = _mm256_add_ps(_mm256_permute2f128_ps(s[2 * k], s[2 * k + 1], 0x20),
                             _mm256_permute2f128_ps(s[2 * k], s[2 * k + 1], 0x31));
    for (int k = 0; k < 2; k++)   /* [r0 r1 of 4k, 4k + 2 | of 4k + 1, 4k + 3], r0 = q0 + q2, r1 = q1 + q3 */
        r[k] = _mm256_add_ps(_mm256_shuffle_ps(q[2 * k], q[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(q[2 * k], q[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* r0 + r1: [0 2 4 6 | 1 3 5 7], then in order */
    __m256 f = _mm256_add_ps(_mm256_shuffle_ps(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* y[t * ld_y + r] = mf_kern_reduce32(acc[r][t]) for nr rows and nt tokens of a block: per token,
 * eight rows at a time into one store, the rest one by one (the same bits). */
__attribute__((target("avx2,fma")))
static void mf_kern_reduce_block_avx2(float (*acc)[MF_KERN_TOK_PASS][32], int nr, int nt, float *y, int ld_y)
{
    for (int t = 0; t < nt; t++) {
        float *yt = y + (size_t)t * ld_y;
        int r = 0;
        for (; r + 8 <= nr; r += 8) {
            const float *a[8];
            for (int k = 0; k < 8; k++) a[k] = acc[r + k][t];
            _mm256_storeu_ps(yt + r, mf_kern_reduce32x8_avx2(a));
        }
        for (; r < nr; r++) yt[r] = mf_kern_reduce32_avx2(acc[r][t]);
    }
}

/* Rows per block of the GEMM (three 3-row tiles): their tiles are decoded together (18 KiB of
 * decoded weights in L1), and each 4-token slice of the input (8 KiB) is applied to all of them
 * while it is in L1. */
#define MF_KERN_GEMM_ROWS 9

/* The fp32 engine at >= MF_KERN_GEMM_MIN_TOK tokens (AVX2): blocks of MF_KERN_GEMM_ROWS rows,
 * each block's tiles decoded once per pass of up to 64 tokens; per tile, every 4 tokens go
 * through the block's row triples (mf_kern_f32_gemm3x4_avx2), the last 1 or 2 rows of a short
 * block through the pair tile or the per-row tile, the last 1..3 tokens of the pass through the
 * per-row tile (their accumulators zeroed first; the triples' start at zero in the kernel). */
static void mf_kern_f32_run_gemm(const mf_kern_mat *m, mf_kern_decode_fn dec, const float *x, int n_tok,
                                 int ld_x, float *y, int ld_y, int y_row0, int r0, int r1)
{
    _Alignas(32) float wt[MF_KERN_GEMM_ROWS][MF_KERN_TILE];
    _Alignas(32) float acc[MF_KERN_GEMM_ROWS][MF_KERN_TOK_PASS][32];

    for (int t0 = 0; t0 < n_tok; t0 += MF_KERN_TOK_PASS) {
        int nt = n_tok - t0 < MF_KERN_TOK_PASS ? n_tok - t0 : MF_KERN_TOK_PASS, nt4 = nt / 4 * 4;
        const float *xc = x + (size_t)t0 * ld_x;
        for (int o = r0; o < r1; o += MF_KERN_GEMM_ROWS) {
            int nr = r1 - o < MF_KERN_GEMM_ROWS ? r1 - o : MF_KERN_GEMM_ROWS, nr3 = nr / 3 * 3;
            for (int r = 0; r < nr; r++)
                if (r >= nr3)
                    memset(acc[r], 0, sizeof acc[0][0] * (size_t)nt);
                else if (nt4 < nt)
                    memset(acc[r][nt4], 0, sizeof acc[0][0] * (size_t)(nt - nt4));
            for (int k0 = 0; k0 < m->n_in; k0 += MF_KERN_TILE) {
                int n = m->n_in - k0 < MF_KERN_TILE ? m->n_in - k0 : MF_KERN_TILE;
                for (int r = 0; r < nr; r++) dec(m, o + r, k0, n, wt[r]);
                for (int t = 0; t < nt4; t += 4) {
                    const float *xt = xc + (size_t)t * ld_x;
                    for (int r = 0; r < nr3; r += 3)
                        mf_kern_f32_gemm3x4_avx2(wt[r], wt[r + 1], wt[r + 2], n, xt, ld_x, k0, acc[r] + t,
                                                 acc[r + 1] + t, acc[r + 2] + t, k0 == 0);
                    if (nr - nr3 == 2)
                        mf_kern_f32_gemm2_avx2(wt[nr3], wt[nr3 + 1], n, xt, 4, ld_x, k0, acc[nr3] + t,
                                               acc[nr3 + 1] + t);
                    else if (nr - nr3 == 1)
                        mf_kern_f32_tile_avx2(wt[nr3], n, xt, 4, ld_x, k0, acc[nr3] + t);
                }
                if (nt4 < nt)
                    for (int r = 0; r < nr; r++)
                        mf_kern_f32_tile_avx2(wt[r], n, xc + (size_t)nt4 * ld_x, nt - nt4, ld_x, k0, acc[r] + nt4);
            }
            mf_kern_reduce_block_avx2(acc, nr, nt, y + (size_t)t0 * ld_y + (o - y_row0), ld_y);
        }
    }
}

void mf_kern_f32_run(const mf_kern_mat *m, mf_kern_decode_fn dec_avx2, mf_kern_decode_fn dec_scalar,
                     const float *x, int n_tok, int ld_x, float *y, int ld_y, int y_row0, int r0,
                     int r1)
{
    int avx2 = mf_kern_simd_active() == MF_KERN_SIMD_AVX2;
    if (avx2 && n_tok >= MF_KERN_GEMM_MIN_TOK && __atomic_load_n(&mf_kern_gemm_on, __ATOMIC_RELAXED)) {
        mf_kern_f32_run_gemm(m, dec_avx2, x, n_tok, ld_x, y, ld_y, y_row0, r0, r1);
        return;
    }
    mf_kern_decode_fn dec = avx2 ? dec_avx2 : dec_scalar;
    _Alignas(32) float wt[MF_KERN_TILE];
    _Alignas(32) float acc[MF_KERN_TOK_PASS][32];

    for (int t0 = 0; t0 < n_tok; t0 += MF_KERN_TOK_PASS) {
        int nt = n_tok - t0 < MF_KERN_TOK_PASS ? n_tok - t0 : MF_KERN_TOK_PASS;
        const float *xc = x + (size_t)t0 * ld_x;
        for (int o = r0; o < r1; o++) {
            memset(acc, 0, sizeof(float) * 32 * (size_t)nt);
            for (int k0 = 0; k0 < m->n_in; k0 += MF_KERN_TILE) {
                int n = m->n_in - k0 < MF_KERN_TILE ? m->n_in - k0 : MF_KERN_TILE;
                dec(m, o, k0, n, wt);
                if (avx2)
                    mf_kern_f32_tile_avx2(wt, n, xc, nt, ld_x, k0, acc);
                else
                    mf_kern_f32_tile_scalar(wt, n, xc, nt, ld_x, k0, acc);
            }
            for (int t = 0; t < nt; t++)
                y[(size_t)(t0 + t) * ld_y + (o - y_row0)] = mf_kern_reduce32(acc[t]);
        }
    }
}
