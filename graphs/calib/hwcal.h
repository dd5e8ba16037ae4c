/* Hardware calibration: measures the machine it runs on and fills a hardware profile
 * (sched/profile.h) with every figure and its source: host kernel rates per thread, memory
 * bandwidth of a socket, executor task overhead, the disk through O_DIRECT reads, and with cards
 * their copy rates and kernel rates through device/dev.h. `moeflow calibrate` is its command;
 * docs/profiles.md says how each figure is measured. */
#ifndef MF_HWCAL_H
#define MF_HWCAL_H

#include <stdint.h>

#include "sched/profile.h"

typedef struct mf_hwcal_opts {
    const char *name;       /* profile name (NULL: "calibrated-<host name>") */
    const char *dir;        /* where the disk probe's temporary file goes (NULL: ".") */
    const char *devices;    /* NULL: no cards; else a device spec for mf_dev_open (emu:N, cuda) */
    int quick;              /* smaller buffers and fewer repetitions (a few seconds): tests */
    int quiet;              /* no progress on stderr */
    uint64_t disk_bytes;    /* the temporary file's size (0: 256 MiB; quick: 64 MiB) */
} mf_hwcal_opts;

/* Measures this machine into *out (every key of the format, each with its source "measured by
 * moeflow calibrate on HOST DATE: METHOD"), progress on stderr unless quiet. The temporary file
 * under dir is removed before returning. 0 or a negative code with a message: a directory whose
 * filesystem refuses O_DIRECT, a device spec that does not open, a measurement that could not be
 * fitted (too noisy). */
int mf_hwcal_run(const mf_hwcal_opts *o, mf_profile *out);

/* The streaming read rate of n_threads threads (unbound) each reading its slice of a `bytes`
 * buffer once, started together and timed to the last one's end, as calibrate measures
 * mem_bytes_per_s: the best of `reps` rounds, bytes/s. The buffer is mapped as the model's
 * weights are (mf_hostmem_map: 2 MiB pages where the kernel allows) and filled before the first
 * round. 0 or -ENOMEM / -EAGAIN with a message. */
int mf_hwcal_read_rate(int n_threads, size_t bytes, int reps, double *bytes_per_s);

/* The same measure one pass at a time over a buffer kept between passes, so a caller can
 * interleave passes with other work (bench decode: one after every decode step). _new maps and
 * fills `bytes` (0 or -ENOMEM); _pass is one round of mf_hwcal_read_rate (0 or -EAGAIN);
 * _free takes NULL. Not thread-safe: one pass at a time. */
typedef struct mf_hwcal_probe mf_hwcal_probe;
int mf_hwcal_probe_new(size_t bytes, mf_hwcal_probe **out);
int mf_hwcal_probe_pass(mf_hwcal_probe *p, int n_threads, double *bytes_per_s);
void mf_hwcal_probe_free(mf_hwcal_probe *p);

/* "HOST DATE" (UTC date) as the sources name it, and the CPU model from /proc/cpuinfo. */
void mf_hwcal_host_date(char *buf, int cap);
void mf_hwcal_cpu_model(char *buf, int cap);

#endif
