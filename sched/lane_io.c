/* The IO lane: reads into caller buffers (and writes from them) on a real io_uring ring driven by one thread, up to the
 * lane's depth in flight, short reads resubmitted for the remainder and completions fed back as
 * task completions. New work reaches the thread through an eventfd read kept armed on the ring.
 * O_DIRECT requests (mf_io_read.dio_align) go straight to the caller's buffer when aligned and
 * through a per-slot aligned bounce buffer when not; reads into registered buffers are
 * fixed-buffer reads. When the kernel refuses io_uring (or the options force pread), pread workers
 * serve the lane instead, with the same O_DIRECT handling. Lane concurrency is the ring's queue depth
 * (or the number of pread workers); 0 means 16. Tests can inject EIO and short reads. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include "sched/error.h"
#include "sched/sched_impl.h"

#define MF_IO_CHUNK_BYTES (1u << 30)   /* largest single read submitted */
#define MF_IO_EFD_TAG UINT64_MAX

struct mf_io_slot {
    mf_task_id t;
    uint64_t done_bytes;   /* bytes of the request delivered to its buffer */
    uint64_t p_off;        /* the piece in flight: file offset and length */
    uint64_t p_len;
    int bounced;           /* the piece reads into the slot's bounce buffer */
    int fault;             /* injected fault on this read (MF_IO_FAULT_*) */
    int eof_next;          /* SHORT fault: the next piece reads as end of file */
};

static _Atomic int mf_io_fallback_logged, mf_io_reg_logged;

/* ---- fault injection ------------------------------------------------------------------------- */

void mf_sched_io_fault(mf_sched *s, int kind, int64_t nth)
{
    atomic_store(&s->io_fault_kind, kind);
    atomic_store(&s->io_fault_left, kind == MF_IO_FAULT_NONE ? 0 : nth);
}

/* Counts one read started on s; returns the fault it must suffer, if any. */
static int mf_io_fault_take(mf_sched *s)
{
    if (atomic_load_explicit(&s->io_fault_left, memory_order_relaxed) <= 0) return 0;
    return atomic_fetch_sub(&s->io_fault_left, 1) == 1 ? atomic_load(&s->io_fault_kind) : 0;
}

/* ---- pieces: straight or through the bounce buffer --------------------------------------------- */

/* The next piece of r after `done` bytes: straight into the caller's buffer (returns 0) or, for a
 * misaligned O_DIRECT request, the enclosing aligned window through the bounce buffer (returns 1). */
static int mf_io_piece(const mf_io_read *r, uint64_t done, uint64_t *off, uint64_t *len)
{
    uint64_t want = r->offset + done, left = r->n_bytes - done, a = r->dio_align;
    if (!a) {
        *off = want;
        *len = left > MF_IO_CHUNK_BYTES ? MF_IO_CHUNK_BYTES : left;
        return 0;
    }
    uintptr_t dst = (uintptr_t)r->buf + done;
    if (want % a == 0 && dst % a == 0 && left >= a) {
        uint64_t n = left - left % a;
        *off = want;
        *len = n > MF_IO_CHUNK_BYTES ? MF_IO_CHUNK_BYTES : n;
        return 0;
    }
    uint64_t a0 = want - want % a, a1 = (want + left + a - 1) / a * a;
    if (a1 - a0 > MF_IO_BOUNCE_BYTES) a1 = a0 + MF_IO_BOUNCE_BYTES;
    *off = a0;
    *len = a1 - a0;
    return 1;
}

/* Bytes of the request a piece that returned `got` bytes delivered (0: end of file first). */
static uint64_t mf_io_absorb(const mf_io_read *r, uint64_t done, int bounced, uint64_t off,
                             const uint8_t *bounce, uint64_t got)
{
    if (!bounced) return got;
    uint64_t want = r->offset + done, end = r->offset + r->n_bytes;
    if (off + got <= want) return 0;
    if (off + got < end) end = off + got;
    memcpy((uint8_t *)r->buf + done, bounce + (want - off), (size_t)(end - want));
    return end - want;
}

static const char *mf_io_verb(const mf_io_read *r) { return r->write ? "write" : "read"; }

static int mf_io_check_align(const mf_io_read *r)
{
    uint32_t a = r->dio_align;
    if (a & (a - 1) || a > MF_IO_BOUNCE_BYTES / 2)
        return mf_error(-EINVAL, "%s of %" PRIu64 " bytes at offset %" PRIu64 " (fd %d): "
                        "dio_align %u is not a power of two up to %u", mf_io_verb(r), r->n_bytes, r->offset,
                        r->fd, a, MF_IO_BOUNCE_BYTES / 2);
    if (r->write && a && (r->offset % a || r->n_bytes % a || (uintptr_t)r->buf % a))
        return mf_error(-EINVAL, "write of %" PRIu64 " bytes at offset %" PRIu64 " from %p (fd %d): not "
                        "aligned to the O_DIRECT alignment %u", r->n_bytes, r->offset, r->buf, r->fd, a);
    return 0;
}

int mf_io_lane_alloc(mf_lane_rt *L)
{
    int n = L->cap > L->n_workers ? L->cap : L->n_workers;
    if (n < 1) n = 1;
    if (posix_memalign((void **)&L->bounce, 4096, (size_t)n * MF_IO_BOUNCE_BYTES)) {
        L->bounce = NULL;
        return -ENOMEM;
    }
    return 0;
}

/* ---- io_uring engine ---------------------------------------------------------------------------- */

/* Sets up the ring and eventfd; on a refusal (the caller falls back to pread) logs once. */
int mf_io_uring_start(mf_sched *s, mf_lane_rt *L)
{
    (void)s;
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

int mf_sched_io_register(mf_sched *s, void *const *bufs, const uint64_t *n_bytes, int n)
{
    if (n < 0 || n > MF_IO_MAX_REG - 1)
        return mf_error(-EINVAL, "sched: %d buffers to register (at most %d)", n, MF_IO_MAX_REG - 1);
    for (int i = 0; i < n; i++)
        if (!bufs[i] || !n_bytes[i] || n_bytes[i] > (UINT64_C(1) << 30))
            return mf_error(-EINVAL, "sched: registered buffer %d: %" PRIu64 " bytes (1 B to 1 GiB)",
                            i, n_bytes[i]);
    for (int l = 0; l < s->n_lanes; l++) {
        mf_lane_rt *L = &s->lanes[l];
        if (L->engine != MF_ENG_URING) continue;
        if (L->n_reg) io_uring_unregister_buffers(&L->ring);
        L->n_reg = 0;
        struct iovec iov[MF_IO_MAX_REG];
        for (int i = 0; i < n; i++) iov[i] = (struct iovec){bufs[i], (size_t)n_bytes[i]};
        iov[n] = (struct iovec){L->bounce, (size_t)L->cap * MF_IO_BOUNCE_BYTES};   /* last: bounce */
        int rc = io_uring_register_buffers(&L->ring, iov, (unsigned)n + 1);
        if (rc < 0) {
            if (!atomic_exchange(&mf_io_reg_logged, 1))
                fprintf(stderr, "moeflow: io_uring_register_buffers refused (%s at %s:%d); reads "
                        "stay unregistered\n", strerror(-rc), __FILE__, __LINE__);
            return mf_error(rc, "sched: IO lane '%s': io_uring_register_buffers: %s (%s:%d)",
                            L->desc.name ? L->desc.name : "io", strerror(-rc), __FILE__, __LINE__);
        }
        for (int i = 0; i <= n; i++) {
            L->reg_base[i] = iov[i].iov_base;
            L->reg_bytes[i] = iov[i].iov_len;
        }
        L->n_reg = n + 1;
    }
    return 0;
}

/* Index of the registered buffer holding [p, p+n), or -1. */
static int mf_io_reg_find(const mf_lane_rt *L, const uint8_t *p, uint64_t n)
{
    for (int i = 0; i < L->n_reg; i++)
        if (p >= L->reg_base[i] && p + n <= L->reg_base[i] + L->reg_bytes[i]) return i;
    return -1;
}

static void mf_io_prep(mf_lane_rt *L, int slot, const mf_io_read *r)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&L->ring);   /* never NULL: ring holds depth+1 */
    struct mf_io_slot *S = &L->slots[slot];
    S->bounced = mf_io_piece(r, S->done_bytes, &S->p_off, &S->p_len);
    uint8_t *dst = S->bounced ? L->bounce + (size_t)slot * MF_IO_BOUNCE_BYTES
                              : (uint8_t *)r->buf + S->done_bytes;
    int reg = mf_io_reg_find(L, dst, S->p_len);
    if (r->write && reg >= 0)
        io_uring_prep_write_fixed(sqe, r->fd, dst, (unsigned)S->p_len, S->p_off, reg);
    else if (r->write)
        io_uring_prep_write(sqe, r->fd, dst, (unsigned)S->p_len, S->p_off);
    else if (reg >= 0)
        io_uring_prep_read_fixed(sqe, r->fd, dst, (unsigned)S->p_len, S->p_off, reg);
    else
        io_uring_prep_read(sqe, r->fd, dst, (unsigned)S->p_len, S->p_off);
    io_uring_sqe_set_data64(sqe, (uint64_t)slot);
}

static void mf_io_arm_efd(mf_lane_rt *L)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&L->ring);
    io_uring_prep_read(sqe, L->efd, &L->efd_buf, sizeof L->efd_buf, 0);
    io_uring_sqe_set_data64(sqe, MF_IO_EFD_TAG);
}

/* eof: the piece returned 0 bytes (a read past the end of the file, a write that made no
 * progress); else err is the call's error */
static int mf_io_fail_msg(const mf_io_read *r, uint64_t done, int err, int eof, char *msg, size_t n)
{
    if (eof)
        return snprintf(msg, n, "%s of %" PRIu64 " bytes at offset %" PRIu64 " (fd %d) %s after %" PRIu64 " bytes",
                        mf_io_verb(r), r->n_bytes, r->offset, r->fd, r->write ? "made no progress" : "hit end of file",
                        done);
    return snprintf(msg, n, "%s of %" PRIu64 " bytes at offset %" PRIu64 " (fd %d): %s",
                    mf_io_verb(r), r->n_bytes, r->offset, r->fd, strerror(-err));
}

static void mf_io_fail(mf_sched *s, mf_task_id t, const mf_io_read *r, uint64_t done, int err,
                       int eof)
{
    char msg[256];
    mf_io_fail_msg(r, done, err, eof, msg, sizeof msg);
    mf_task_fail(s, t, err, msg);
}

/* The injected fault's result for a piece that returned res (0: none) */
static int mf_io_fault_res(int fault, int res, int *eof_next)
{
    if (fault == MF_IO_FAULT_EIO) return -EIO;
    if (fault == MF_IO_FAULT_ENOSPC) return -ENOSPC;
    if (fault == MF_IO_FAULT_SHORT && res > 0) {
        *eof_next = 1;
        return res / 2;
    }
    return res;
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
            mf_task_id t = mf_q_take(L, -1, 0);
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
            L->slots[slot] = (struct mf_io_slot){.t = t};
            if (s->spans) {
                s->spans[t].start_ns = mf_span_now(s);
                s->spans[t].worker = slot;
            }
            int bad = mf_io_check_align(r);
            if (!r->n_bytes || bad) {   /* nothing to read, or a request the lane refuses */
                if (bad) mf_task_fail(s, t, bad, mf_last_error());
                free_slots[n_free++] = slot;
                mf_task_finish(s, t, bad, w);
                continue;
            }
            L->slots[slot].fault = mf_io_fault_take(s);
            mf_io_prep(L, slot, r);
            inflight++;
        }
        mf_done_flush(s, w);
        /* Tasks still queued with slots free (some taken were empty or refused): submit and come
         * back for them rather than wait for a completion that may never come. */
        int more = inflight < depth && atomic_load_explicit(&L->n_ready, memory_order_relaxed) > 0;
        int rc = more ? io_uring_submit(&L->ring) : io_uring_submit_and_wait(&L->ring, 1);
        if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
            /* The ring itself broke: fail what is in flight rather than hang the run. */
            for (int k = 0; k < depth; k++) {
                int busy = 1;
                for (int j = 0; j < n_free; j++) busy &= free_slots[j] != k;
                if (!busy) continue;
                mf_task_id t = L->slots[k].t;
                mf_io_fail(s, t, s->g->tasks[t].arg, L->slots[k].done_bytes, rc, 0);
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
            struct mf_io_slot *S = &L->slots[slot];
            mf_task_id t = S->t;
            const mf_io_read *r = s->g->tasks[t].arg;
            int status = 0;
            if (res == -EINTR || res == -EAGAIN) {
                mf_io_prep(L, slot, r);
                continue;
            }
            if (res >= 0 && S->eof_next) res = 0;
            res = mf_io_fault_res(S->fault, res, &S->eof_next);
            S->fault = 0;
            uint64_t n = res > 0 ? mf_io_absorb(r, S->done_bytes, S->bounced, S->p_off,
                                                L->bounce + (size_t)slot * MF_IO_BOUNCE_BYTES,
                                                (uint64_t)res)
                                 : 0;
            if (res < 0) {
                mf_io_fail(s, t, r, S->done_bytes, res, 0);
                status = res;
            } else if (n == 0) {
                mf_io_fail(s, t, r, S->done_bytes, -EIO, 1);
                status = -EIO;
            } else {
                S->done_bytes += n;
                if (S->done_bytes < r->n_bytes) {   /* short read: the rest */
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

/* ---- pread engine ------------------------------------------------------------------------------ */

/* The pread fallback for one IO task, on pread worker `worker`. */
int mf_io_pread(mf_sched *s, mf_task_id t, int worker)
{
    const mf_io_read *r = s->g->tasks[t].arg;
    mf_lane_rt *L = &s->lanes[s->g->tasks[t].lane];
    uint8_t *bounce = L->bounce + (size_t)worker * MF_IO_BOUNCE_BYTES;
    int rc = mf_io_check_align(r);
    if (rc || !r->n_bytes) return rc;
    int fault = mf_io_fault_take(s), eof_next = 0;
    uint64_t done = 0;
    while (done < r->n_bytes) {
        uint64_t off, len;
        int bounced = mf_io_piece(r, done, &off, &len);
        uint8_t *p = bounced ? bounce : (uint8_t *)r->buf + done;
        ssize_t got = r->write ? pwrite(r->fd, p, (size_t)len, (off_t)off) : pread(r->fd, p, (size_t)len, (off_t)off);
        if (got < 0 && errno == EINTR) continue;
        int res = got < 0 ? -errno : (int)got;   /* a piece is at most MF_IO_CHUNK_BYTES */
        if (res >= 0 && eof_next) res = 0;
        res = mf_io_fault_res(fault, res, &eof_next);
        fault = 0;
        char msg[256];
        if (res < 0) {
            mf_io_fail_msg(r, done, res, 0, msg, sizeof msg);
            return mf_error(res, "%s", msg);
        }
        uint64_t n = res > 0 ? mf_io_absorb(r, done, bounced, off, bounce, (uint64_t)res) : 0;
        if (n == 0) {
            mf_io_fail_msg(r, done, -EIO, 1, msg, sizeof msg);
            return mf_error(-EIO, "%s", msg);
        }
        done += n;
    }
    return 0;
}
