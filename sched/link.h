/* Messages between the processes of a pipeline split over hosts (graphs/pipe/pipe.h): what a
 * transport gives, as ops. sched/link_mpi.h opens the one over Open MPI (built when CMake finds
 * MPI); tests/link_mem.h is one between the threads of a process. A link knows nothing about
 * models: it moves tagged byte messages between ranks and makes no wait unbounded: a wait ends
 * with the message, or with an error that names the rank it is missing, within the transport's
 * stated bounds. */
#ifndef MF_LINK_H
#define MF_LINK_H

#include <stddef.h>
#include <stdint.h>

#define MF_LINK_MAX_TAG 1023   /* tags 0..MF_LINK_MAX_TAG are the callers'; a transport keeps its own above */

typedef struct mf_link_ops {
    void *ctx;
    int rank, size;   /* this process and how many there are (rank 0..size-1) */
    /* Sends n bytes to rank `to` with `tag`. buf may be reused when it returns (the transport has
     * copied it or handed it over); messages from one rank to another with one tag arrive in the
     * order sent. 0, or a negative code with a message (mf_error) naming the rank when one is lost. */
    int (*send)(void *ctx, int to, int tag, const void *buf, size_t n);
    /* Receives the next message from `from` with `tag` into buf (at most cap bytes; *got its size).
     * Waits at most timeout_ns (< 0: for as long as every rank is alive); `what` names what is
     * awaited in the messages. -ETIMEDOUT (naming `from` and what), -EPIPE when a rank is lost or
     * has failed (naming it and why), -EMSGSIZE for a message larger than cap. */
    int (*recv)(void *ctx, int from, int tag, void *buf, size_t cap, size_t *got, int64_t timeout_ns,
                const char *what);
    /* This rank fails with msg: every other rank's waits end with -EPIPE naming this rank and msg
     * (as far as the links still carry it). */
    void (*fail)(void *ctx, const char *msg);
} mf_link_ops;

#endif
