/* Monotonic time in nanoseconds, the one clock every timeline and benchmark uses. */
#ifndef MF_CLOCK_H
#define MF_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline int64_t mf_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

#endif
