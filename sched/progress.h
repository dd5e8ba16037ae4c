/* Progress for long operations (generation, resident loads): a one-line bar with rate and ETA on
 * stderr when it is a terminal, a line every few seconds otherwise, nothing when quiet. */
#ifndef MF_PROGRESS_H
#define MF_PROGRESS_H

#include <stdint.h>

typedef struct mf_progress {
    const char *label;
    uint64_t total;      /* units of work, e.g. bytes */
    uint64_t done;
    int64_t start_ns;
    int64_t last_print_ns;
    int quiet;
    int tty;
    int bytes;           /* 1: units are bytes, printed as GiB and GiB/s */
} mf_progress;

void mf_progress_begin(mf_progress *p, const char *label, uint64_t total, int bytes, int quiet);
void mf_progress_add(mf_progress *p, uint64_t n);
void mf_progress_end(mf_progress *p);

#endif
