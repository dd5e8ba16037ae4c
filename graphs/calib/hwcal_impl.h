/* Internals of the hardware calibration (graphs/calib/hwcal.h): the state the phases share and the
 * phases themselves (hwcal.c: host; hwcal_io.c: disk; hwcal_dev.c: cards). */
#ifndef MF_HWCAL_IMPL_H
#define MF_HWCAL_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "graphs/calib/hwcal.h"

typedef struct mf_hwcal {
    const mf_hwcal_opts *o;
    mf_profile *p;
    char who[160];          /* "HOST DATE" */
    size_t llc_bytes;       /* largest cache level, for out-of-cache weight pools */
    uint64_t rng;
} mf_hwcal;

/* Sets key's value (through the profile's fields, by the caller) source to
 * "measured by moeflow calibrate on WHO: METHOD". */
int mf_hwcal_src(mf_hwcal *h, const char *key, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Sets a source verbatim (figures that are not measurements say so themselves). */
int mf_hwcal_src_raw(mf_hwcal *h, const char *key, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* A progress line on stderr unless quiet. */
void mf_hwcal_note(const mf_hwcal *h, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
uint64_t mf_hwcal_rand(mf_hwcal *h);
/* Fills n bytes with random weight codes of a format (no NaN codes): 1 fp4, 2 fp8, 3 bf16,
 * 4 E8M0 scales in a realistic spread. */
void mf_hwcal_fill(mf_hwcal *h, void *p, size_t n, int kind);
double mf_hwcal_median(double *v, int n);

/* The two-point fit a kernel's figures come from: time(bytes, 1 token) at sizes A and B gives
 * bytes_per_s and latency_ns (where that line's intercept would be negative: latency 0 and B's own
 * rate, bytes_b / t_b1, so the large matrix is priced at what it took); B at 1 and at n_many tokens
 * gives macs_per_s. -EIO when the times do not grow with the work (too noisy). */
int mf_hwcal_fit_kern(const char *what, double bytes_a, double t_a1, double bytes_b, double t_b1,
                      double macs_b, int n_many, double t_bn, mf_profile_kern *out);

int mf_hwcal_host(mf_hwcal *h);
int mf_hwcal_disk(mf_hwcal *h);
int mf_hwcal_cards(mf_hwcal *h);

/* Shapes of the kernel measurements: A small, B large; the REF loop's key counts. */
#define MF_HWCAL_A_OUT 256
#define MF_HWCAL_A_IN 2048
#define MF_HWCAL_B_OUT 2048
#define MF_HWCAL_B_IN 4096
#define MF_HWCAL_MANY 8

#endif
