/* Exhaustive and randomized checks of host/formats.c: every code of every format decoded and
 * re-encoded, monotonic order, rounding at and around every midpoint, overflow, signed zeros,
 * subnormals, NaN rules, E2M1 packing, the bulk loops, and 2M random float32 values per format
 * against an independent reference (binary search for the nearest value in the decoded table). */
#include "host/formats.h"
#include "tests/check.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint32_t bits_of(float x)
{
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

static float float_of(uint32_t b)
{
    float x;
    memcpy(&x, &b, sizeof x);
    return x;
}

/* ---- the five formats behind one interface --------------------------------------------------- */

static float dec_e2m1(uint32_t c) { return mf_e2m1_to_f32((uint8_t)c); }
static float dec_e8m0(uint32_t c) { return mf_e8m0_to_f32((uint8_t)c); }
static float dec_e4m3(uint32_t c) { return mf_e4m3_to_f32((uint8_t)c); }
static float dec_bf16(uint32_t c) { return mf_bf16_to_f32((uint16_t)c); }
static float dec_f16(uint32_t c) { return mf_f16_to_f32((uint16_t)c); }
static uint32_t enc_e2m1(float x) { return mf_e2m1_from_f32(x); }
static uint32_t enc_e8m0(float x) { return mf_e8m0_from_f32(x); }
static uint32_t enc_e4m3(float x) { return mf_e4m3_from_f32(x); }
static uint32_t enc_bf16(float x) { return mf_bf16_from_f32(x); }
static uint32_t enc_f16(float x) { return mf_f16_from_f32(x); }

typedef struct fmt {
    const char *name;
    uint32_t n_codes;
    uint32_t sign_bit;     /* 0: unsigned (E8M0) */
    uint32_t max_code;     /* largest finite positive code; codes 0..max_code increase */
    uint32_t overflow;     /* positive code for values rounding past max_code (and +inf) */
    int ties_up;           /* E8M0: ties go to the larger value, not to the even code */
    int n_nan, n_inf;      /* expected counts over all codes */
    int min_exp, max_exp;  /* binary exponents of the smallest and largest nonzero values */
    float max_val;
    float (*decode)(uint32_t);
    uint32_t (*encode)(float);
} fmt;

static const fmt formats[] = {
    {"e2m1", 16, 0x8, 0x7, 0x7, 0, 0, 0, -1, 2, 6.0f, dec_e2m1, enc_e2m1},
    {"e8m0", 256, 0, 0xFE, 0xFF, 1, 1, 0, -127, 127, 0x1p127f, dec_e8m0, enc_e8m0},
    {"e4m3", 256, 0x80, 0x7E, 0x7F, 0, 2, 0, -9, 8, 448.0f, dec_e4m3, enc_e4m3},
    {"bf16", 65536, 0x8000, 0x7F7F, 0x7F80, 0, 254, 2, -133, 127, 0x1.FEp127f, dec_bf16, enc_bf16},
    {"f16", 65536, 0x8000, 0x7BFF, 0x7C00, 0, 2046, 2, -24, 15, 65504.0f, dec_f16, enc_f16},
};
#define N_FORMATS (sizeof formats / sizeof formats[0])

/* The documented NaN rule of each encoder (header comments), restated independently. */
static uint32_t nan_code(const fmt *f, float x)
{
    uint32_t b = bits_of(x);
    int neg = (b >> 31) != 0;
    if (strcmp(f->name, "e2m1") == 0)
        return neg ? 0x0 : 0x8;
    if (strcmp(f->name, "e8m0") == 0)
        return 0xFF;
    if (strcmp(f->name, "e4m3") == 0)
        return neg ? 0xFF : 0x7F;
    if (strcmp(f->name, "bf16") == 0)
        return neg ? 0xFFC0 : 0x7FC0;
    uint32_t payload = (b & 0x7FFFFF) >> 13;
    return (neg ? 0x8000u : 0) | 0x7C00 | (payload ? payload : 1);
}

/* ---- the independent reference: nearest value in the decoded table ----------------------------- */

typedef struct table {
    double val[65536 + 1];  /* val[c] = decode(c) for c <= max_code, then one virtual step beyond */
    uint32_t n;             /* max_code + 2 entries */
} table;

static void table_build(const fmt *f, table *t)
{
    t->n = f->max_code + 2;
    for (uint32_t c = 0; c <= f->max_code; c++)
        t->val[c] = f->decode(c);
    double top = t->val[f->max_code], below = t->val[f->max_code - 1];
    t->val[f->max_code + 1] = f->ties_up ? 2 * top : top + (top - below);
}

/* Encodes x by searching the decoded table: nearest value, ties to the even code (to the larger
 * value for E8M0), one virtual step past the largest value standing for overflow. */
static uint32_t ref_encode(const fmt *f, const table *t, float x)
{
    if (isnan(x))
        return nan_code(f, x);
    int neg = signbit(x) != 0;
    if (f->sign_bit == 0 && (neg || x == 0))
        return 0xFF;  /* E8M0 has neither zero nor sign: NaN */
    double a = fabs((double)x);
    uint32_t sign = neg ? f->sign_bit : 0;
    if (a >= t->val[t->n - 1])
        return sign | f->overflow;
    if (a <= t->val[0])
        return sign | 0;
    /* E8M0 quirk of ml_dtypes, documented in the header: (2^-127, 2^-126) goes up to 2^-126. */
    if (f->ties_up && a > t->val[0] && a < t->val[1])
        return 1;
    uint32_t lo = 0, hi = t->n - 1;  /* val[lo] <= a < val[hi] */
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (t->val[mid] <= a)
            lo = mid;
        else
            hi = mid;
    }
    uint32_t code;
    double d_lo = a - t->val[lo], d_hi = t->val[hi] - a;  /* exact: neighbours within 2x */
    if (d_lo < d_hi)
        code = lo;
    else if (d_hi < d_lo)
        code = hi;
    else
        code = f->ties_up ? hi : ((lo & 1) ? hi : lo);
    if (code > f->max_code)
        code = f->overflow;
    return sign | code;
}

/* ---- checks ---------------------------------------------------------------------------------- */

/* Every code decodes to its value and encodes back to itself (NaN codes to their NaN rule). */
static void check_roundtrip(const fmt *f)
{
    int n_nan = 0, n_inf = 0, n_bad = 0;
    for (uint32_t c = 0; c < f->n_codes; c++) {
        float v = f->decode(c);
        uint32_t back = f->encode(v);
        uint32_t want = c;
        if (isnan(v)) {
            n_nan++;
            want = nan_code(f, v);
        }
        if (isinf(v))
            n_inf++;
        if (back != want && n_bad++ < 10)
            CHECK(back == want, "%s: code 0x%x -> %g -> 0x%x, expected 0x%x", f->name, c, v, back,
                  want);
        if (f->sign_bit && (c & f->sign_bit)) {
            float pos = f->decode(c & ~f->sign_bit);
            CHECK(bits_of(v) == (bits_of(pos) | 0x80000000u), "%s: code 0x%x is not -(0x%x)",
                  f->name, c, c & ~f->sign_bit);
        }
    }
    CHECK(n_bad == 0, "%s: %d codes do not round-trip", f->name, n_bad);
    CHECK(n_nan == f->n_nan, "%s: %d NaN codes, expected %d", f->name, n_nan, f->n_nan);
    CHECK(n_inf == f->n_inf, "%s: %d infinite codes, expected %d", f->name, n_inf, f->n_inf);
    /* The NaN rule holds for the one NaN class ml_dtypes chose, so bf16 NaNs collapse. */
    if (strcmp(f->name, "bf16") == 0)
        CHECK(f->encode(f->decode(0x7F81)) == 0x7FC0, "bf16: NaN 0x7f81 should become 0x7fc0");
}

/* Positive finite codes increase strictly in value, and everything above max_code is non-finite. */
static void check_monotonic(const fmt *f)
{
    int ok = 1;
    for (uint32_t c = 1; c <= f->max_code; c++)
        if (!(f->decode(c) > f->decode(c - 1)) && ok) {
            ok = 0;
            CHECK(0, "%s: decode(0x%x) = %g is not above decode(0x%x) = %g", f->name, c,
                  f->decode(c), c - 1, f->decode(c - 1));
        }
    uint32_t top = f->sign_bit ? f->sign_bit : f->n_codes;
    for (uint32_t c = f->max_code + 1; c < top; c++)
        CHECK(!isfinite(f->decode(c)), "%s: code 0x%x above the largest finite code is %g",
              f->name, c, f->decode(c));
    float smallest = f->decode(f->sign_bit ? 1 : 0);  /* E8M0 has no zero */
    CHECK(smallest == ldexpf(1.0f, f->min_exp), "%s: smallest positive value %g, expected 2^%d",
          f->name, smallest, f->min_exp);
    CHECK(f->decode(f->max_code) == f->max_val, "%s: largest value %g, expected %g", f->name,
          f->decode(f->max_code), f->max_val);
    CHECK(f->decode(0) == (f->ties_up ? ldexpf(1.0f, -127) : 0.0f), "%s: code 0 is %g", f->name,
          f->decode(0));
}

/* Every midpoint between adjacent values, and its float32 neighbours, rounds as documented. */
static void check_midpoints(const fmt *f, const table *t)
{
    int n_bad = 0;
    for (uint32_t c = 0; c + 1 < t->n; c++) {
        double mid = (t->val[c] + t->val[c + 1]) / 2;
        float m = (float)mid;
        CHECK(m == mid, "%s: midpoint above code 0x%x is not a float32", f->name, c);
        uint32_t up = c + 1 > f->max_code ? f->overflow : c + 1;
        uint32_t at = f->ties_up ? up : ((c & 1) ? up : c);
        uint32_t above = up;
        uint32_t below = c;
        if (f->ties_up && c == 0)
            below = 1;  /* the E8M0 quirk: (2^-127, 2^-126) goes to 2^-126 */
        float m_hi = nextafterf(m, INFINITY), m_lo = nextafterf(m, 0.0f);
        uint32_t got_at = f->encode(m), got_hi = f->encode(m_hi), got_lo = f->encode(m_lo);
        if ((got_at != at || got_hi != above || got_lo != below) && n_bad++ < 10) {
            CHECK(got_at == at, "%s: midpoint %a -> 0x%x, expected 0x%x", f->name, m, got_at, at);
            CHECK(got_hi == above, "%s: %a (above midpoint) -> 0x%x, expected 0x%x", f->name, m_hi,
                  got_hi, above);
            CHECK(got_lo == below, "%s: %a (below midpoint) -> 0x%x, expected 0x%x", f->name, m_lo,
                  got_lo, below);
        }
        if (f->sign_bit) {
            uint32_t neg = f->encode(-m);
            if (neg != (at | f->sign_bit) && n_bad++ < 10)
                CHECK(0, "%s: midpoint %a -> 0x%x, expected 0x%x", f->name, -m, neg,
                      at | f->sign_bit);
        }
    }
    CHECK(n_bad == 0, "%s: %d midpoint failures", f->name, n_bad);
}

/* Hand-written expectations: values, overflow, zeros, infinities, NaNs, subnormals. */
static void check_specials(void)
{
    static const float e2m1_vals[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
    for (int c = 0; c < 16; c++)
        CHECK(mf_e2m1_to_f32((uint8_t)c) == (c & 8 ? -e2m1_vals[c & 7] : e2m1_vals[c & 7]),
              "e2m1 0x%x", c);
    CHECK(mf_e2m1_to_f32(0xF7) == 6.0f, "e2m1 decode uses only the low nibble");
    CHECK(mf_e2m1_from_f32(5.0f) == 0x6 && mf_e2m1_from_f32(5.01f) == 0x7, "e2m1 near 5");
    CHECK(mf_e2m1_from_f32(1e30f) == 0x7 && mf_e2m1_from_f32(-7.0f) == 0xF, "e2m1 saturates");
    CHECK(mf_e2m1_from_f32(INFINITY) == 0x7 && mf_e2m1_from_f32(-INFINITY) == 0xF, "e2m1 inf");
    CHECK(mf_e2m1_from_f32(0.25f) == 0x0 && mf_e2m1_from_f32(-0.25f) == 0x8, "e2m1 0.25 tie");
    CHECK(mf_e2m1_from_f32(0.75f) == 0x2 && mf_e2m1_from_f32(1.25f) == 0x2, "e2m1 ties to even");
    CHECK(mf_e2m1_from_f32(NAN) == 0x8 && mf_e2m1_from_f32(-NAN) == 0x0, "e2m1 NaN rule");
    CHECK(mf_e2m1_from_f32(0.0f) == 0x0 && mf_e2m1_from_f32(-0.0f) == 0x8, "e2m1 signed zero");
    CHECK(mf_e2m1_from_f32(-1e-30f) == 0x8, "e2m1 tiny negative -> -0");

    CHECK(bits_of(mf_e8m0_to_f32(0)) == 0x00400000u, "e8m0 0 is 2^-127");
    CHECK(mf_e8m0_to_f32(127) == 1.0f && mf_e8m0_to_f32(0xFE) == ldexpf(1, 127), "e8m0 values");
    CHECK(isnan(mf_e8m0_to_f32(0xFF)), "e8m0 0xff is NaN");
    CHECK(mf_e8m0_from_f32(1.0f) == 127 && mf_e8m0_from_f32(0.75f) == 127, "e8m0 0.75 tie up");
    CHECK(mf_e8m0_from_f32(3.0f) == 129 && mf_e8m0_from_f32(2.99f) == 128, "e8m0 3 tie up");
    CHECK(mf_e8m0_from_f32(1.4142135f) == 127, "e8m0 rounds linearly, not in log2");
    CHECK(mf_e8m0_from_f32(0.0f) == 0xFF && mf_e8m0_from_f32(-0.0f) == 0xFF, "e8m0 zero");
    CHECK(mf_e8m0_from_f32(-1.0f) == 0xFF && mf_e8m0_from_f32(-1e-40f) == 0xFF, "e8m0 negative");
    CHECK(mf_e8m0_from_f32(INFINITY) == 0xFF && mf_e8m0_from_f32(NAN) == 0xFF, "e8m0 inf/NaN");
    CHECK(mf_e8m0_from_f32(ldexpf(1.5f, 127)) == 0xFF, "e8m0 overflow");
    CHECK(mf_e8m0_from_f32(nextafterf(ldexpf(1.5f, 127), 0)) == 0xFE, "e8m0 below overflow");
    CHECK(mf_e8m0_from_f32(ldexpf(1, -127)) == 0 && mf_e8m0_from_f32(ldexpf(1, -149)) == 0,
          "e8m0 tiny -> 2^-127");
    CHECK(mf_e8m0_from_f32(nextafterf(ldexpf(1, -127), 1)) == 1, "e8m0 subnormal quirk");

    CHECK(mf_e4m3_to_f32(0x7E) == 448.0f && mf_e4m3_to_f32(0x38) == 1.0f, "e4m3 values");
    CHECK(mf_e4m3_to_f32(0x01) == ldexpf(1, -9) && mf_e4m3_to_f32(0x08) == ldexpf(1, -6),
          "e4m3 smallest subnormal / normal");
    for (int c = 0; c < 8; c++)
        CHECK(mf_e4m3_to_f32((uint8_t)c) == ldexpf((float)c, -9), "e4m3 subnormal 0x%x", c);
    CHECK(isnan(mf_e4m3_to_f32(0x7F)) && isnan(mf_e4m3_to_f32(0xFF)), "e4m3 NaN codes");
    CHECK(!isnan(mf_e4m3_to_f32(0x7E)) && !isnan(mf_e4m3_to_f32(0xF8)), "e4m3 non-NaN codes");
    CHECK(mf_e4m3_from_f32(464.0f) == 0x7E && mf_e4m3_from_f32(465.0f) == 0x7F, "e4m3 overflow");
    CHECK(mf_e4m3_from_f32(-1e9f) == 0xFF && mf_e4m3_from_f32(INFINITY) == 0x7F, "e4m3 to NaN");
    CHECK(mf_e4m3_from_f32(-NAN) == 0xFF && mf_e4m3_from_f32(NAN) == 0x7F, "e4m3 NaN sign");
    CHECK(mf_e4m3_from_f32(ldexpf(1, -10)) == 0x00, "e4m3 half the smallest -> 0");
    CHECK(mf_e4m3_from_f32(ldexpf(3, -10)) == 0x02, "e4m3 1.5x smallest -> 2 (even)");
    CHECK(mf_e4m3_from_f32(-0.0f) == 0x80 && mf_e4m3_from_f32(0.0f) == 0x00, "e4m3 signed zero");

    CHECK(mf_bf16_to_f32(0x3F80) == 1.0f && mf_bf16_to_f32(0x0001) == ldexpf(1, -133), "bf16");
    CHECK(mf_bf16_from_f32(float_of(0x7F800001)) == 0x7FC0, "bf16 signalling NaN -> 0x7fc0");
    CHECK(mf_bf16_from_f32(float_of(0xFFFFFFFF)) == 0xFFC0, "bf16 negative NaN -> 0xffc0");
    CHECK(mf_bf16_from_f32(float_of(0x7F7FFFFF)) == 0x7F80, "bf16 FLT_MAX overflows to inf");
    CHECK(mf_bf16_from_f32(float_of(0x3F808000)) == 0x3F80, "bf16 tie to even (down)");
    CHECK(mf_bf16_from_f32(float_of(0x3F818000)) == 0x3F82, "bf16 tie to even (up)");
    CHECK(mf_bf16_from_f32(float_of(0x00008000)) == 0x0000, "bf16 subnormal tie -> 0");
    CHECK(mf_bf16_from_f32(-0.0f) == 0x8000, "bf16 -0");

    CHECK(mf_f16_to_f32(0x0001) == ldexpf(1, -24) && mf_f16_to_f32(0x3C00) == 1.0f, "f16 values");
    CHECK(mf_f16_to_f32(0x7BFF) == 65504.0f && mf_f16_to_f32(0x0400) == ldexpf(1, -14), "f16");
    for (int c = 0; c < 1024; c++)
        CHECK(mf_f16_to_f32((uint16_t)c) == ldexpf((float)c, -24), "f16 subnormal 0x%x", c);
    CHECK(isinf(mf_f16_to_f32(0x7C00)) && mf_f16_to_f32(0xFC00) < 0, "f16 inf");
    CHECK(bits_of(mf_f16_to_f32(0x7D00)) == 0x7FA00000u, "f16 NaN payload kept on decode");
    CHECK(mf_f16_from_f32(65519.0f) == 0x7BFF && mf_f16_from_f32(65520.0f) == 0x7C00, "f16 max");
    CHECK(mf_f16_from_f32(-1e10f) == 0xFC00, "f16 overflow -> -inf");
    CHECK(mf_f16_from_f32(ldexpf(1, -25)) == 0 && mf_f16_from_f32(ldexpf(3, -25)) == 2,
          "f16 subnormal ties to even");
    CHECK(mf_f16_from_f32(nextafterf(ldexpf(1, -25), 1)) == 1, "f16 just above half of 2^-24");
    CHECK(mf_f16_from_f32(float_of(0x7F800001)) == 0x7C01, "f16 NaN payload truncating to 0");
    CHECK(mf_f16_from_f32(float_of(0x7FC00000)) == 0x7E00, "f16 quiet NaN");
    CHECK(mf_f16_from_f32(float_of(0xFFA00000)) == 0xFD00, "f16 NaN payload and sign kept");
    CHECK(mf_f16_from_f32(-0.0f) == 0x8000, "f16 -0");
}

/* xorshift64*, fixed seed: the same sequence on every run. */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng_next(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}

/* A random float32: either any bit pattern, or a value with an exponent near the format's range. */
static float random_float(const fmt *f, int targeted)
{
    uint64_t r = rng_next();
    if (!targeted)
        return float_of((uint32_t)r);
    int span = f->max_exp - f->min_exp + 8;
    int e = f->min_exp - 4 + (int)((r >> 32) % (uint64_t)span);
    float m = 1.0f + (float)(r & 0x7FFFFF) / 8388608.0f;
    float x = ldexpf(m, e);
    return (r >> 31) & 1 ? -x : x;
}

static void check_random(const fmt *f, const table *t, long n)
{
    long n_bad = 0;
    for (long i = 0; i < n; i++) {
        float x = random_float(f, (int)(i & 1));
        uint32_t got = f->encode(x), want = ref_encode(f, t, x);
        if (got != want && n_bad++ < 10)
            CHECK(got == want, "%s: %a (0x%08x) -> 0x%x, reference 0x%x", f->name, x, bits_of(x),
                  got, want);
    }
    CHECK(n_bad == 0, "%s: %ld of %ld random values differ from the reference", f->name, n_bad, n);
}

static void check_pack(void)
{
    uint8_t codes[67], back[67], packed[34 + 1];
    for (size_t n = 0; n <= 67; n++) {
        for (size_t i = 0; i < n; i++)
            codes[i] = (uint8_t)rng_next();  /* junk in the high nibble must be dropped */
        memset(packed, 0xA5, sizeof packed);
        mf_e2m1_pack(packed, codes, n);
        size_t n_bytes = (n + 1) / 2;
        CHECK(packed[n_bytes] == 0xA5, "pack n=%zu wrote past %zu bytes", n, n_bytes);
        if (n & 1)
            CHECK((packed[n_bytes - 1] >> 4) == 0, "pack n=%zu: unused high nibble not zero", n);
        for (size_t i = 0; i < n; i++) {
            CHECK(mf_e2m1_get(packed, i) == (codes[i] & 0x0F), "get n=%zu i=%zu", n, i);
            uint8_t byte = packed[i / 2];
            CHECK(((i & 1) ? byte >> 4 : byte & 0x0F) == (codes[i] & 0x0F),
                  "nibble order n=%zu i=%zu", n, i);
        }
        memset(back, 0xEE, sizeof back);
        mf_e2m1_unpack(back, packed, n);
        for (size_t i = 0; i < n; i++)
            CHECK(back[i] == (codes[i] & 0x0F), "unpack n=%zu i=%zu", n, i);
        if (n < sizeof back)
            CHECK(back[n] == 0xEE, "unpack n=%zu wrote past the end", n);
    }
}

static void check_bulk(void)
{
    static uint16_t codes[65536], codes_back[65536];
    static float vals[65536];
    for (uint32_t c = 0; c < 65536; c++)
        codes[c] = (uint16_t)c;
    mf_bf16_to_f32_n(vals, codes, 65536);
    int bad = 0;
    for (uint32_t c = 0; c < 65536; c++)
        bad += bits_of(vals[c]) != bits_of(mf_bf16_to_f32((uint16_t)c));
    CHECK(bad == 0, "mf_bf16_to_f32_n: %d codes differ from the scalar decode", bad);

    for (uint32_t i = 0; i < 65536; i++)
        vals[i] = float_of((uint32_t)rng_next());
    mf_f32_to_bf16_n(codes_back, vals, 65536);
    bad = 0;
    for (uint32_t i = 0; i < 65536; i++)
        bad += codes_back[i] != mf_bf16_from_f32(vals[i]);
    CHECK(bad == 0, "mf_f32_to_bf16_n: %d values differ from the scalar encode", bad);

    uint8_t e4[256];
    float e4v[256];
    for (int c = 0; c < 256; c++)
        e4[c] = (uint8_t)c;
    mf_e4m3_to_f32_n(e4v, e4, 256);
    bad = 0;
    for (int c = 0; c < 256; c++)
        bad += bits_of(e4v[c]) != bits_of(mf_e4m3_to_f32((uint8_t)c));
    CHECK(bad == 0, "mf_e4m3_to_f32_n: %d codes differ from the scalar decode", bad);
}

int main(void)
{
    static table t;
    for (size_t i = 0; i < N_FORMATS; i++) {
        const fmt *f = &formats[i];
        table_build(f, &t);
        check_roundtrip(f);
        check_monotonic(f);
        check_midpoints(f, &t);
        check_random(f, &t, 2000000);
    }
    check_specials();
    check_pack();
    check_bulk();
    return mf_check_exit("test_formats");
}
