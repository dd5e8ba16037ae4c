/* Small numeric helpers the tests share: a xorshift generator of floats in [-1, 1) and the
 * relative distance of two vectors. */
#ifndef MF_TEST_NUM_H
#define MF_TEST_NUM_H

#include <math.h>
#include <stdint.h>

/* The next float in [-1, 1) of the xorshift64 state *s. */
static inline float mf_test_frand(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return (float)((double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* max|a - b| / max|a| over n values (max|a - b| where a is all zeros). */
static inline double mf_test_max_rel(const float *a, const float *b, int64_t n)
{
    double scale = 0, d = 0;
    for (int64_t i = 0; i < n; i++) {
        scale = fmax(scale, fabs(a[i]));
        d = fmax(d, fabs((double)a[i] - b[i]));
    }
    return scale > 0 ? d / scale : d;
}

#endif
