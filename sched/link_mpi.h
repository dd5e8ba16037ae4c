/* The pipeline's transport (sched/link.h) over Open MPI: built only when CMake finds MPI
 * (MOEFLOW_MPI). Open MPI picks TCP on Ethernet and UCX/verbs on InfiniBand or RoCE by itself.
 *
 * Threads: MPI is initialized with MPI_THREAD_MULTIPLE (open fails when the library cannot give
 * it): the calling thread, the engine's boundary lane and this module's watcher thread each make
 * MPI calls. Every call is nonblocking (MPI_Isend, MPI_Irecv, MPI_Iprobe, MPI_Ibarrier) and every
 * wait polls with a bound:
 * - the watcher sends each other rank a heartbeat every heartbeat_ns and takes theirs, and so, over
 *   UDP, does a thread that never calls MPI (sched/hb_udp.h: a rank whose MPI progress stalls is
 *   still heard; where UDP does not get through, MPI's heartbeats alone); a rank not heard from
 *   by either for lost_ns is lost: every wait of this rank fails with -EPIPE naming it ("rank 2
 *   lost: nothing heard from it for 10.0 s"), and the others are told (a FAIL message);
 * - a receive with a timeout fails with -ETIMEDOUT naming the rank it waits for (alive, since it
 *   still sends heartbeats, but silent: hung) once the timeout passes;
 * - a rank that fails (mf_link_ops.fail) or learns of a failure tells every rank it can reach.
 * So a rank that dies, hangs or is cut off makes every other rank fail within lost_ns (plus a
 * heartbeat period); nothing waits forever. A receive polls a few times at once, then sleeps
 * between polls for 1/16 of the time waited so far, 10 to 100 us (1 ms in a wait without a
 * timeout: an idle rank's): a message is taken at most ~0.1 ms (1 ms) after it arrived, and a
 * waiting rank does not spin beside its host's workers. Sends are buffered: the bytes are copied and the
 * send is posted, so a stage goes on computing while its boundary travels; the copies are reused
 * (no allocation per message once the largest has been seen). */
#ifndef MF_LINK_MPI_H
#define MF_LINK_MPI_H

#include <stdint.h>

#include "sched/link.h"

typedef struct mf_link_mpi_opts {
    int64_t heartbeat_ns;   /* between heartbeats to each rank (0: 1 s) */
    int64_t lost_ns;        /* a rank not heard from this long is lost (0: 10 s; at least 2 heartbeats) */
} mf_link_mpi_opts;

typedef struct mf_link_mpi mf_link_mpi;

/* MPI_Init_thread (MPI_THREAD_MULTIPLE) over argc/argv (may be NULL), a duplicate of
 * MPI_COMM_WORLD with errors returned, the watcher thread. 0, or a negative code naming what MPI
 * refused. */
int mf_link_mpi_open(int *argc, char ***argv, const mf_link_mpi_opts *o, mf_link_mpi **out);
/* The ops over l (rank, size, send, recv, fail); valid until mf_link_mpi_close. */
const mf_link_ops *mf_link_mpi_ops(mf_link_mpi *l);
/* 1 once a rank was lost or failed (this one or another), with its message in *msg (NULL: not
 * wanted). */
int mf_link_mpi_failed(mf_link_mpi *l, const char **msg);
/* Ends the link. After a clean run (no failure): waits for the sends in flight and for every rank
 * to close (a nonblocking barrier, at most lost_ns), then MPI_Finalize: 0. After a failure, or
 * when the barrier did not complete: tells the other ranks (at most 1 s for the messages to
 * leave), does NOT call MPI_Finalize (it could wait for a lost rank forever) and returns -EPIPE,
 * leaving l's memory (MPI may still read a message in flight): the caller should then exit without
 * calling MPI (e.g. _exit after flushing its output). */
int mf_link_mpi_close(mf_link_mpi *l);

#endif
