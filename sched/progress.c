/* The progress bar behind mf_progress_*: rate-limited redraws so that it costs nothing on hot paths. */
#include "sched/progress.h"
#include "sched/clock.h"

#include <stdio.h>
#include <unistd.h>

static void mf_progress_print(mf_progress *p, int final)
{
    double t = (mf_now_ns() - p->start_ns) / 1e9;
    double frac = p->total ? (double)p->done / (double)p->total : 1.0;
    double rate = t > 0 ? p->done / t : 0.0;
    double eta = (rate > 0 && p->total > p->done) ? (p->total - p->done) / rate : 0.0;
    char bar[31];
    int fill = (int)(frac * 30.0 + 0.5);
    for (int i = 0; i < 30; i++) bar[i] = i < fill ? '#' : '.';
    bar[30] = '\0';
    const char *end = p->tty && !final ? "\r" : "\n";
    if (p->bytes)
        fprintf(stderr, "%s [%s] %5.1f%% %.2f/%.2f GiB %.2f GiB/s ETA %.0fs%s", p->label, bar,
                frac * 100.0, p->done / 1073741824.0, p->total / 1073741824.0, rate / 1073741824.0,
                eta, end);
    else
        fprintf(stderr, "%s [%s] %5.1f%% %llu/%llu ETA %.0fs%s", p->label, bar, frac * 100.0,
                (unsigned long long)p->done, (unsigned long long)p->total, eta, end);
    fflush(stderr);
}

void mf_progress_begin(mf_progress *p, const char *label, uint64_t total, int bytes, int quiet)
{
    p->label = label;
    p->total = total;
    p->done = 0;
    p->start_ns = mf_now_ns();
    p->last_print_ns = 0;
    p->quiet = quiet;
    p->tty = isatty(2);
    p->bytes = bytes;
}

void mf_progress_add(mf_progress *p, uint64_t n)
{
    p->done += n;
    if (p->quiet) return;
    int64_t now = mf_now_ns();
    int64_t gap = p->tty ? 100000000LL : 5000000000LL;
    if (now - p->last_print_ns >= gap) {
        p->last_print_ns = now;
        mf_progress_print(p, 0);
    }
}

void mf_progress_end(mf_progress *p)
{
    if (!p->quiet) mf_progress_print(p, 1);
}
