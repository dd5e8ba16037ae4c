/* BF16 fused matmul (embedding rows, head, compressor, router, indexer projections): BF16 weights
 * widened to fp32 tile by tile in L1 and applied to every token (kern_common.c's engine). */
#include "host/kern_internal.h"

#include <immintrin.h>
#include <stdatomic.h>
#include <time.h>

#include "host/formats.h"
#include "host/simd_bf16.h"

static void mf_kern_bf16_decode_scalar(const mf_kern_mat *m, int row, int k0, int n, float *dst)
{
    const uint16_t *w = (const uint16_t *)m->w + (size_t)row * m->n_in + k0;
    for (int i = 0; i < n; i++)
        dst[i] = mf_bf16_to_f32(w[i]);
}

__attribute__((target("avx2,fma")))
static void mf_kern_bf16_decode_avx2(const mf_kern_mat *m, int row, int k0, int n, float *dst)
{
    const uint16_t *w = (const uint16_t *)m->w + (size_t)row * m->n_in + k0;
    mf_kern_prefetch(w, (size_t)n * 2);
    for (int i = 0; i < n; i += 16) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(w + i));
        __m256i lo = _mm256_unpacklo_epi16(_mm256_setzero_si256(), v);   /* bf16 << 16 */
        __m256i hi = _mm256_unpackhi_epi16(_mm256_setzero_si256(), v);
        /* unpack works per 128-bit lane: lo = elements 0-3, 8-11; hi = 4-7, 12-15 */
        __m256i a = _mm256_permute2x128_si256(lo, hi, 0x20);   /* 0-3, 4-7 */
        __m256i b = _mm256_permute2x128_si256(lo, hi, 0x31);   /* 8-11, 12-15 */
        _mm256_store_ps(dst + i, _mm256_castsi256_ps(a));
        _mm256_store_ps(dst + i + 8, _mm256_castsi256_ps(b));
    }
}


/* One token (batch-1 decode: the head, the router, the compressor): the weights widened in
 * registers and applied at once, one row at a time (four independent sums in flight), instead of
 * decoded to an L1 tile and read back. Each output's 32 lanes are the tile engine's (lane = k mod
 * 32, fmaf in k order from +0) and reduced by the same tree, so the bits are the engine's. One row
 * at a time the weights are one forward stream; pf 1 also prefetches each row
 * MF_KERN_PREFETCH_TOK1 ahead into L2 (mf_kern_bf16_tok1_prefetch says which runs). */
/* Placed: the function on 64 bytes and 32 bytes of no-ops at its start, which puts the row loop
 * at 48 mod 64 with GCC 12 -O2 (checked with objdump). On the Intel VM of the third 2026-12-05
 * session (family 6 model 167) the head's phase moved with that loop's place while its code did
 * not: at 0, 16 and 32 mod 64 it ran about 5% slower than at 48 over alternating runs
 * (docs/measurements.md). The alignment keeps changes elsewhere from moving it; other CPUs were
 * not measured (the no-ops cost nothing measurable there: they run once per call). */
__attribute__((target("avx2,fma"), aligned(64)))
static void mf_kern_bf16_tok1_avx2(const mf_kern_mat *m, const float *x, float *y, int y_row0, int r0, int r1, int pf)
{
    __asm__ volatile(".nops 32");
    const int n = m->n_in;
    for (int o = r0; o < r1; o++) {
        const uint16_t *wa = (const uint16_t *)m->w + (size_t)o * n;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int k = 0; k < n; k += 32) {
            if (pf) mf_kern_prefetch_tok1(wa + k);
            a0 = _mm256_fmadd_ps(mf_simd_bf16_load8(wa + k), _mm256_loadu_ps(x + k), a0);
            a1 = _mm256_fmadd_ps(mf_simd_bf16_load8(wa + k + 8), _mm256_loadu_ps(x + k + 8), a1);
            a2 = _mm256_fmadd_ps(mf_simd_bf16_load8(wa + k + 16), _mm256_loadu_ps(x + k + 16), a2);
            a3 = _mm256_fmadd_ps(mf_simd_bf16_load8(wa + k + 24), _mm256_loadu_ps(x + k + 24), a3);
        }
        y[o - y_row0] = mf_kern_reduce4x8_avx2(a0, a1, a2, a3);
    }
}

/* Which one-token loop streams faster is the machine's (docs/kernels.md "The one-token prefetch":
 * a Zen 4 VM 29-30 GB/s a thread without the prefetch, 25-26 with it; an Intel VM with AVX-512
 * 16.6-17.4 GB/s for two threads without, 26.1-27.5 with), so it is measured where it runs: the
 * first calls over at least MF_BF16_TUNE_BYTES alternate the two and time them, and once each has
 * MF_BF16_TUNE_CALLS the one with fewer ns per byte stays for the process (smaller calls run
 * without the prefetch until then; mf_kern_bf16_tok1_set_prefetch fixes it instead). The sums are
 * the same either way: only the speed depends on the choice. */
#define MF_BF16_TUNE_BYTES (4u << 20)
#define MF_BF16_TUNE_CALLS 8
static atomic_int g_pf = -1;   /* -1: measuring, 0 or 1: chosen */
static atomic_int g_turn, g_calls[2];
static atomic_llong g_ns[2], g_bytes[2];

int mf_kern_bf16_tok1_prefetch(void) { return atomic_load_explicit(&g_pf, memory_order_relaxed); }

void mf_kern_bf16_tok1_set_prefetch(int pf)
{
    atomic_store(&g_pf, pf == 0 || pf == 1 ? pf : -1);
    for (int v = 0; v < 2; v++) {
        atomic_store(&g_calls[v], 0);
        atomic_store(&g_ns[v], 0);
        atomic_store(&g_bytes[v], 0);
    }
}

static void mf_kern_bf16_tok1(const mf_kern_mat *m, const float *x, float *y, int y_row0, int r0, int r1)
{
    int pf = mf_kern_bf16_tok1_prefetch();
    long long bytes = (long long)(r1 - r0) * m->n_in * 2;
    if (pf >= 0 || bytes < (long long)MF_BF16_TUNE_BYTES) {
        mf_kern_bf16_tok1_avx2(m, x, y, y_row0, r0, r1, pf > 0);
        return;
    }
    int v = atomic_fetch_add(&g_turn, 1) & 1;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    mf_kern_bf16_tok1_avx2(m, x, y, y_row0, r0, r1, v);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    atomic_fetch_add(&g_ns[v], (long long)(t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec));
    atomic_fetch_add(&g_bytes[v], bytes);
    atomic_fetch_add(&g_calls[v], 1);
    if (atomic_load(&g_calls[0]) >= MF_BF16_TUNE_CALLS && atomic_load(&g_calls[1]) >= MF_BF16_TUNE_CALLS) {
        /* ns0 / bytes0 <= ns1 / bytes1: no prefetch */
        double a = (double)atomic_load(&g_ns[0]) * (double)atomic_load(&g_bytes[1]);
        double b = (double)atomic_load(&g_ns[1]) * (double)atomic_load(&g_bytes[0]);
        int measuring = -1;
        atomic_compare_exchange_strong(&g_pf, &measuring, a <= b ? 0 : 1);
    }
}

/* A few tokens (2..MF_KERN_BF16_TOKN: a speculative verify's, a small batch's) with AVX-512: the
 * one-token loop's way for each of them at once, one row at a time: the row's 32 weights of a step
 * widened into two 16-lane registers once and applied to every token's accumulators (2 x nt
 * registers), so the weights stream once from memory and nothing goes through an L1 tile. Each
 * output's 32 lanes are the tile engine's (lane = k mod 32, fmaf in k order from +0) reduced by the
 * same tree (mf_kern_reduce4x8_avx2 of its four 8-lane quarters), so the bits are the engine's. */
#define MF_KERN_BF16_TOKN 8

__attribute__((target("avx512f,avx2,fma"), always_inline))
static inline __m512 mf_kern_bf16_load16(const uint16_t *w)
{
    __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)w));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

__attribute__((target("avx512f,avx2,fma"), always_inline))
static inline __m256 mf_kern_hi256(__m512 v)   /* lanes 8-15 */
{
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

__attribute__((target("avx512f,avx2,fma"), always_inline))
static inline void mf_kern_bf16_tokn_rows(const mf_kern_mat *m, const float *x, int ld_x, float *y, int ld_y,
                                          int y_row0, int r0, int r1, const int NT)
{
    const int n = m->n_in;
    for (int o = r0; o < r1; o++) {
        const uint16_t *w = (const uint16_t *)m->w + (size_t)o * n;
        __m512 a[MF_KERN_BF16_TOKN][2];
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++) a[t][0] = a[t][1] = _mm512_setzero_ps();
        for (int k = 0; k < n; k += 32) {
            __m512 w0 = mf_kern_bf16_load16(w + k), w1 = mf_kern_bf16_load16(w + k + 16);
#pragma GCC unroll 8
            for (int t = 0; t < NT; t++) {
                const float *xt = x + (size_t)t * ld_x + k;
                a[t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xt), a[t][0]);
                a[t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), a[t][1]);
            }
        }
#pragma GCC unroll 8
        for (int t = 0; t < NT; t++)
            y[(size_t)t * ld_y + (o - y_row0)] =
                mf_kern_reduce4x8_avx2(_mm512_castps512_ps256(a[t][0]), mf_kern_hi256(a[t][0]),
                                       _mm512_castps512_ps256(a[t][1]), mf_kern_hi256(a[t][1]));
    }
}

__attribute__((target("avx512f,avx2,fma")))
static void mf_kern_bf16_tokn_avx512(const mf_kern_mat *m, const float *x, int n_tok, int ld_x, float *y, int ld_y,
                                     int y_row0, int r0, int r1)
{
    switch (n_tok) {
    case 2: mf_kern_bf16_tokn_rows(m, x, ld_x, y, ld_y, y_row0, r0, r1, 2); break;
    case 3: mf_kern_bf16_tokn_rows(m, x, ld_x, y, ld_y, y_row0, r0, r1, 3); break;
    case 4: mf_kern_bf16_tokn_rows(m, x, ld_x, y, ld_y, y_row0, r0, r1, 4); break;
    case 5: mf_kern_bf16_tokn_rows(m, x, ld_x, y, ld_y, y_row0, r0, r1, 5); break;
    case 6: mf_kern_bf16_tokn_rows(m, x, ld_x, y, ld_y, y_row0, r0, r1, 6); break;
    case 7: mf_kern_bf16_tokn_rows(m, x, ld_x, y, ld_y, y_row0, r0, r1, 7); break;
    default: mf_kern_bf16_tokn_rows(m, x, ld_x, y, ld_y, y_row0, r0, r1, 8); break;
    }
}

void mf_kern_bf16_rows(const mf_kern_mat *m, const float *x, int n_tok, int ld_x, float *y,
                       int ld_y, int y_row0, int r0, int r1)
{
    if (n_tok == 1 && mf_kern_simd_active() == MF_KERN_SIMD_AVX2) {
        mf_kern_bf16_tok1(m, x, y, y_row0, r0, r1);
        return;
    }
    if (n_tok >= 2 && n_tok <= MF_KERN_BF16_TOKN && m->n_in % 32 == 0 && mf_kern_simd_active() == MF_KERN_SIMD_AVX2 &&
        mf_kern_fp8_tok1_avx512()) {
        mf_kern_bf16_tokn_avx512(m, x, n_tok, ld_x, y, ld_y, y_row0, r0, r1);
        return;
    }
    mf_kern_f32_run(m, mf_kern_bf16_decode_avx2, mf_kern_bf16_decode_scalar, x, n_tok, ld_x, y,
                    ld_y, y_row0, r0, r1);
}

int mf_kern_bf16_matmul(const uint16_t *w, int n_out, int n_in,
                        const float *x, int n_tok, int ld_x, float *y, int ld_y, int r0, int r1)
{
    int rc = mf_kern_check("bf16 matmul", w, NULL, 0, n_out, n_in, x, n_tok, ld_x, y, ld_y, r0, r1);
    if (rc)
        return rc;
    mf_kern_mat m = {MF_KERN_BF16, w, NULL, n_out, n_in};
    mf_kern_bf16_rows(&m, x, n_tok, ld_x, y, ld_y, 0, r0, r1);
    return 0;
}
