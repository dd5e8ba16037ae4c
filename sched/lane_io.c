/* The IO lane: reads into caller buffers on a real io_uring ring driven by one thread, up to the
 * lane's depth in flight, short reads resubmitted for the remainder and completions fed back as
 * task completions. New work reaches the thread through an eventfd read kept armed on the ring.
 * When the kernel refuses io_uring (or MOEFLOW_IO=pread), pread workers serve the lane instead.
 * Lane concurrency is the ring's queue depth (or the number of pread workers); 0 means 16. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "sched/error.h"
#include "sched/sched_impl.h"

#define MF_IO_CHUNK_BYTES (1u << 30)   /* largest single read submitted */
#define MF_IO_EFD_TAG UINT64_MAX

struct mf_io_slot {
    mf_task_id t;
    uint64_t done_bytes;
};

static _Atomic int mf_io_fallback_logged;

/* Sets up the ring and eventfd; on a refusal (the caller falls back to pread) logs once. */
int mf_io_uring_start(mf_sched *s, mf_lane_rt *L)
{
    int depth = L->desc.concurrency ? L->desc.concurrency : 16;
    L->cap = depth;
    int rc = io_uring_queue_init((unsigned)depth + 1, &L->ring, 0);
    if (rc < 0) {
        if (!atomic_exchange(&mf_io_fallback_logged, 1))
            fprintf(stderr, "moeflow: io_uring unavailable (io_uring_queue_init: %s at %s:%d), IO "
                    "lane uses pread workers\n", strerror(-rc), __FILE__, __LINE__);
        return rc;
    }
    L->efd = eventfd(0, EFD_CLOEXEC);
    L->slots = calloc((size_t)depth, sizeof *L->slots);
    if (L->efd < 0 || !L->slots) {
        int e = L->efd < 0 ? -errno : -ENOMEM;
        io_uring_queue_exit(&L->ring);
        if (L->efd >= 0) close(L->efd);
        L->efd = -1;
        return mf_error(e == -ENOMEM ? -ENOMEM : -EIO, "sched: IO lane '%s': cannot set up its "
                        "eventfd/slots: %s", L->desc.name ? L->desc.name : "io", strerror(-e));
    }
    L->ring_ok = 1;
    return 0;
}

void mf_io_uring_stop(mf_lane_rt *L)
{
    io_uring_queue_exit(&L->ring);
    close(L->efd);
    L->efd = -1;
    L->ring_ok = 0;
}

static void mf_io_prep(mf_lane_rt *L, int slot, const mf_io_read *r)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&L->ring);   /* never NULL: ring holds depth+1 */
    uint64_t done = L->slots[slot].done_bytes, left = r->n_bytes - done;
    unsigned len = left > MF_IO_CHUNK_BYTES ? MF_IO_CHUNK_BYTES : (unsigned)left;
    io_uring_prep_read(sqe, r->fd, (char *)r->buf + done, len, r->offset + done);
    io_uring_sqe_set_data64(sqe, (uint64_t)slot);
}

static void mf_io_arm_efd(mf_lane_rt *L)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&L->ring);
    io_uring_prep_read(sqe, L->efd, &L->efd_buf, sizeof L->efd_buf, 0);
    io_uring_sqe_set_data64(sqe, MF_IO_EFD_TAG);
}

static void mf_io_fail(mf_sched *s, mf_task_id t, const mf_io_read *r, uint64_t done, int err)
{
    char msg[256];
    if (err == -EIO && done < r->n_bytes)
        snprintf(msg, sizeof msg, "read of %" PRIu64 " bytes at offset %" PRIu64 " (fd %d) hit end "
                 "of file after %" PRIu64 " bytes", r->n_bytes, r->offset, r->fd, done);
    else
        snprintf(msg, sizeof msg, "read of %" PRIu64 " bytes at offset %" PRIu64 " (fd %d): %s",
                 r->n_bytes, r->offset, r->fd, strerror(-err));
    mf_task_fail(s, t, err, msg);
}

void *mf_io_uring_main(void *arg)
{
    mf_worker *w = arg;
    mf_sched *s = w->s;
    mf_lane_rt *L = w->lane;
    int depth = L->cap, inflight = 0, n_free = depth;
    int free_slots[depth];
    mf_task_id got[depth];
    for (int i = 0; i < depth; i++) free_slots[i] = depth - 1 - i;
    mf_io_arm_efd(L);
    for (;;) {
        int ng = 0;
        pthread_mutex_lock(&L->mu);
        if (L->exit) {
            pthread_mutex_unlock(&L->mu);
            break;
        }
        while (inflight + ng < depth) {
            mf_task_id t = mf_q_take(L, -1);
            if (t < 0) break;
            got[ng++] = t;
        }
        L->wants_wake = atomic_load_explicit(&L->n_ready, memory_order_relaxed) == 0;
        pthread_mutex_unlock(&L->mu);

        for (int i = 0; i < ng; i++) {
            mf_task_id t = got[i];
            const mf_io_read *r = s->g->tasks[t].arg;
            if (mf_task_skip(s, t)) {
                mf_task_finish(s, t, 1, w);
                continue;
            }
            int slot = free_slots[--n_free];
            L->slots[slot] = (struct mf_io_slot){t, 0};
            if (s->spans) {
                s->spans[t].start_ns = mf_span_now(s);
                s->spans[t].worker = slot;
            }
            if (!r->n_bytes) {   /* nothing to read */
                free_slots[n_free++] = slot;
                mf_task_finish(s, t, 0, w);
                continue;
            }
            mf_io_prep(L, slot, r);
            inflight++;
        }
        mf_done_flush(s, w);
        int rc = io_uring_submit_and_wait(&L->ring, 1);
        if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
            /* The ring itself broke: fail what is in flight rather than hang the run. */
            for (int k = 0; k < depth; k++) {
                int busy = 1;
                for (int j = 0; j < n_free; j++) busy &= free_slots[j] != k;
                if (!busy) continue;
                mf_task_id t = L->slots[k].t;
                mf_io_fail(s, t, s->g->tasks[t].arg, L->slots[k].done_bytes, rc);
                free_slots[n_free++] = k;
                inflight--;
                mf_task_finish(s, t, rc, w);
            }
            mf_done_flush(s, w);
            continue;
        }
        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&L->ring, head, cqe) {
            seen++;
            uint64_t tag = io_uring_cqe_get_data64(cqe);
            int res = cqe->res;
            if (tag == MF_IO_EFD_TAG) {
                mf_io_arm_efd(L);
                continue;
            }
            int slot = (int)tag;
            mf_task_id t = L->slots[slot].t;
            const mf_io_read *r = s->g->tasks[t].arg;
            int status = 0;
            if (res == -EINTR || res == -EAGAIN) {
                mf_io_prep(L, slot, r);
                continue;
            }
            if (res < 0) {
                mf_io_fail(s, t, r, L->slots[slot].done_bytes, res);
                status = res;
            } else if (res == 0) {
                mf_io_fail(s, t, r, L->slots[slot].done_bytes, -EIO);
                status = -EIO;
            } else {
                L->slots[slot].done_bytes += (uint64_t)res;
                if (L->slots[slot].done_bytes < r->n_bytes) {   /* short read: the rest */
                    mf_io_prep(L, slot, r);
                    continue;
                }
            }
            free_slots[n_free++] = slot;
            inflight--;
            mf_task_finish(s, t, status, w);
        }
        io_uring_cq_advance(&L->ring, seen);
    }
    return NULL;
}

/* The pread fallback for one IO task, on a pread worker. */
int mf_io_pread(mf_sched *s, mf_task_id t, int worker)
{
    const mf_io_read *r = s->g->tasks[t].arg;
    uint64_t done = 0;
    while (done < r->n_bytes) {
        uint64_t left = r->n_bytes - done;
        size_t len = left > MF_IO_CHUNK_BYTES ? MF_IO_CHUNK_BYTES : (size_t)left;
        ssize_t got = pread(r->fd, (char *)r->buf + done, len, (off_t)(r->offset + done));
        if (got < 0) {
            if (errno == EINTR) continue;
            return mf_error(-errno, "read of %" PRIu64 " bytes at offset %" PRIu64 " (fd %d): %s",
                            r->n_bytes, r->offset, r->fd, strerror(errno));
        }
        if (got == 0)
            return mf_error(-EIO, "read of %" PRIu64 " bytes at offset %" PRIu64 " (fd %d) hit end "
                            "of file after %" PRIu64 " bytes", r->n_bytes, r->offset, r->fd, done);
        done += (uint64_t)got;
    }
    return 0;
}
