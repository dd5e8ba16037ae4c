/* Calibration: fits a lane's cost model (mf_lane_model) to this machine by running short real
 * graphs through the executor and regressing time per task on its size: CPU lanes with a fixed
 * FMA kernel of known flops, IO lanes with reads of a file held in the page cache. A few hundred
 * ms per lane. The simulator (sim.h) then predicts runs of graphs built from the same kinds of work. */
#ifndef MF_CALIBRATE_H
#define MF_CALIBRATE_H

#include <stdint.h>

#include "sched/graph.h"
#include "sched/sched.h"

/* Argument of mf_calib_fma_task: `flops` floating-point operations (2 per FMA) on independent
 * accumulators; the result lands in `sink` so the work cannot be optimized away. */
typedef struct mf_calib_fma {
    double flops;
    double sink;
} mf_calib_fma;

/* A CPU task fn doing arg->flops flops of FMA; always returns 0. */
int mf_calib_fma_task(void *arg, mf_task_ctx *ctx);

/* One lane's fit: time per task = latency_ns + size / rate, with one task in flight (a chain)
 * and with the lane's concurrency busy (that many chains side by side). */
typedef struct mf_calib_fit {
    mf_lane_model one;       /* one task in flight */
    mf_lane_model all;       /* `concurrency` tasks in flight */
    int concurrency;
    double max_resid;        /* worst |measured - fit| / measured over the fitted points */
    double size[3];          /* the measured points: task size (flops or bytes) */
    double one_ns[3];        /* median time per task, one chain */
    double all_ns[3];        /* median time per task, `concurrency` chains */
} mf_calib_fit;

/* Fits CPU lane `lane` of s (whose lane table is lanes[0..n_lanes)) with FMA chains. */
int mf_calibrate_cpu(mf_sched *s, const mf_lane_desc *lanes, int n_lanes, int lane,
                     mf_calib_fit *out);

/* Fits IO lane `lane` with chains of reads of fd, a file of file_bytes that the caller keeps in
 * the page cache (see mf_calib_file_create): the fit is for cached reads, not the disk. */
int mf_calibrate_io(mf_sched *s, const mf_lane_desc *lanes, int n_lanes, int lane, int fd,
                    uint64_t file_bytes, mf_calib_fit *out);

/* Creates an unlinked temporary file of n_bytes under dir, filled with non-zero data and read
 * back once so it sits in the page cache; returns its fd in *fd_out (close it when done). */
int mf_calib_file_create(const char *dir, uint64_t n_bytes, int *fd_out);

#endif
