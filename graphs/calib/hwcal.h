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
 * buffer once, as calibrate measures mem_bytes_per_s: the best of `reps` rounds, bytes/s. 0 or
 * -ENOMEM / -EAGAIN with a message. */
int mf_hwcal_read_rate(int n_threads, size_t bytes, int reps, double *bytes_per_s);

/* "HOST DATE" (UTC date) as the sources name it, and the CPU model from /proc/cpuinfo. */
void mf_hwcal_host_date(char *buf, int cap);
void mf_hwcal_cpu_model(char *buf, int cap);

#endif
