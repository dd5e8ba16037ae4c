/* The pipeline's transport over Open MPI (sched/link_mpi.h): buffered nonblocking sends, polled
 * receives with bounds, and a watcher thread that exchanges heartbeats, takes failure messages and
 * keeps the sends in flight progressing; beside it UDP heartbeats on a thread that never calls MPI
 * (sched/hb_udp.h). Built only with MPI (MOEFLOW_MPI). */
#include "sched/link_mpi.h"

#include <errno.h>
#include <inttypes.h>
#include <mpi.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "sched/clock.h"
#include "sched/error.h"
#include "sched/hb_udp.h"

#define TAG_HB (MF_LINK_MAX_TAG + 1)     /* a heartbeat: one byte */
#define TAG_FAIL (MF_LINK_MAX_TAG + 2)   /* a failure: its message */
#define MAX_PENDING 64                   /* buffered sends in flight */
#define FAIL_BYTES 512
#define WATCH_NS 5000000                 /* the watcher's period */

typedef struct mf_lsend {
    MPI_Request req;   /* MPI_REQUEST_NULL: free */
    void *buf;
    size_t cap;
} mf_lsend;

struct mf_link_mpi {
    mf_link_ops ops;
    MPI_Comm comm;
    int rank, size;
    int64_t hb_ns, lost_ns;
    pthread_t watcher;
    int watching;
    atomic_int stop;
    pthread_mutex_t mu;          /* pend[], hb_req[], fail_req[], the failure's message */
    mf_lsend pend[MAX_PENDING];
    _Atomic int64_t *heard;      /* per rank: when a message of it last arrived over MPI */
    mf_hb_udp *hb;               /* the UDP heartbeats (NULL where no UDP socket could be had) */
    MPI_Request *hb_req;         /* per rank: the heartbeat in flight to it */
    MPI_Request *fail_req;       /* per rank: the failure message in flight to it */
    uint8_t hb_byte;
    atomic_int failed;
    char msg[FAIL_BYTES];        /* the failure (set once, under mu, before failed) */
    char fail_out[FAIL_BYTES];   /* what this rank tells the others */
};

static void mf_lm_sleep(int64_t ns)
{
    struct timespec ts = {.tv_sec = ns / 1000000000, .tv_nsec = ns % 1000000000};
    nanosleep(&ts, NULL);
}

static int mf_lm_err(int mrc, const char *what)
{
    char s[MPI_MAX_ERROR_STRING];
    int n = 0;
    MPI_Error_string(mrc, s, &n);
    return mf_error(-EIO, "MPI: %s: %s", what, s);
}

/* Records the failure msg (the first only) and, with tell, sends it to every other rank. Under mu. */
static void mf_lm_fail_locked(mf_link_mpi *l, const char *msg, int tell)
{
    if (atomic_load(&l->failed)) return;
    snprintf(l->msg, sizeof l->msg, "%s", msg);
    atomic_store(&l->failed, 1);
    if (!tell) return;
    snprintf(l->fail_out, sizeof l->fail_out, "%s", msg);
    for (int p = 0; p < l->size; p++)
        if (p != l->rank && l->fail_req[p] == MPI_REQUEST_NULL)
            MPI_Isend(l->fail_out, (int)strlen(l->fail_out) + 1, MPI_CHAR, p, TAG_FAIL, l->comm, &l->fail_req[p]);
}

/* Completes the sends in flight that are done (their buffers stay for reuse). Under mu. */
static void mf_lm_progress_locked(mf_link_mpi *l)
{
    int done;
    for (int i = 0; i < MAX_PENDING; i++)
        if (l->pend[i].req != MPI_REQUEST_NULL) MPI_Test(&l->pend[i].req, &done, MPI_STATUS_IGNORE);
    for (int p = 0; p < l->size; p++) {
        if (l->hb_req[p] != MPI_REQUEST_NULL) MPI_Test(&l->hb_req[p], &done, MPI_STATUS_IGNORE);
        if (l->fail_req[p] != MPI_REQUEST_NULL) MPI_Test(&l->fail_req[p], &done, MPI_STATUS_IGNORE);
    }
}

/* Takes the heartbeats and failure messages that arrived. */
static void mf_lm_take(mf_link_mpi *l, int64_t now)
{
    for (;;) {
        int flag = 0;
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_HB, l->comm, &flag, &st) != MPI_SUCCESS || !flag) break;
        uint8_t b;
        MPI_Recv(&b, 1, MPI_BYTE, st.MPI_SOURCE, TAG_HB, l->comm, MPI_STATUS_IGNORE);
        atomic_store(&l->heard[st.MPI_SOURCE], now);
    }
    for (;;) {
        int flag = 0;
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_FAIL, l->comm, &flag, &st) != MPI_SUCCESS || !flag) break;
        char text[FAIL_BYTES] = "";
        MPI_Recv(text, FAIL_BYTES, MPI_CHAR, st.MPI_SOURCE, TAG_FAIL, l->comm, MPI_STATUS_IGNORE);
        text[FAIL_BYTES - 1] = 0;
        char m[FAIL_BYTES + 64];
        snprintf(m, sizeof m, "rank %d stopped: %s", st.MPI_SOURCE, text);
        pthread_mutex_lock(&l->mu);
        mf_lm_fail_locked(l, m, 1);   /* passed on: a rank the sender cannot reach may hear it from here */
        pthread_mutex_unlock(&l->mu);
    }
}

static void *mf_lm_watch(void *arg)
{
    mf_link_mpi *l = arg;
    int64_t last_hb = 0;
    while (!atomic_load(&l->stop)) {
        int64_t now = mf_now_ns();
        mf_lm_take(l, now);
        pthread_mutex_lock(&l->mu);
        mf_lm_progress_locked(l);
        if (now - last_hb >= l->hb_ns) {
            for (int p = 0; p < l->size; p++)
                if (p != l->rank && l->hb_req[p] == MPI_REQUEST_NULL)
                    MPI_Isend(&l->hb_byte, 1, MPI_BYTE, p, TAG_HB, l->comm, &l->hb_req[p]);
            last_hb = now;
        }
        for (int p = 0; p < l->size; p++) {
            int64_t last = atomic_load(&l->heard[p]), udp = l->hb ? mf_hb_udp_heard(l->hb, p) : 0;
            int64_t quiet = now - (udp > last ? udp : last);   /* heard by either channel */
            if (p == l->rank || quiet <= l->lost_ns) continue;
            char m[FAIL_BYTES];
            snprintf(m, sizeof m, "rank %d lost: nothing heard from it for %.1f s (seen by rank %d)", p, quiet / 1e9,
                     l->rank);
            mf_lm_fail_locked(l, m, 1);
        }
        pthread_mutex_unlock(&l->mu);
        mf_lm_sleep(WATCH_NS);
    }
    return NULL;
}

static int mf_lm_send(void *ctx, int to, int tag, const void *buf, size_t n)
{
    mf_link_mpi *l = ctx;
    if (to < 0 || to >= l->size || to == l->rank || tag < 0 || tag > MF_LINK_MAX_TAG || n > (size_t)INT32_MAX)
        return mf_error(-EINVAL, "link: rank %d: a send of %zu bytes to rank %d with tag %d (ranks 0..%d, tags 0..%d)",
                        l->rank, n, to, tag, l->size - 1, MF_LINK_MAX_TAG);
    for (int64_t k = 0;; k++) {
        if (atomic_load(&l->failed)) return mf_error(-EPIPE, "%s", l->msg);
        pthread_mutex_lock(&l->mu);
        mf_lm_progress_locked(l);
        int best = -1;   /* a free copy large enough, else any free one */
        for (int i = 0; i < MAX_PENDING; i++)
            if (l->pend[i].req == MPI_REQUEST_NULL && (best < 0 || (l->pend[i].cap >= n && l->pend[best].cap < n)))
                best = i;
        if (best >= 0) {
            mf_lsend *s = &l->pend[best];
            if (s->cap < n) {
                void *b = realloc(s->buf, n ? n : 1);
                if (!b) {
                    pthread_mutex_unlock(&l->mu);
                    return mf_error(-ENOMEM, "link: rank %d: no memory for a message of %zu bytes", l->rank, n);
                }
                s->buf = b;
                s->cap = n;
            }
            memcpy(s->buf, buf, n);
            int mrc = MPI_Isend(s->buf, (int)n, MPI_BYTE, to, tag, l->comm, &s->req);
            pthread_mutex_unlock(&l->mu);
            return mrc == MPI_SUCCESS ? 0 : mf_lm_err(mrc, "a send");
        }
        pthread_mutex_unlock(&l->mu);
        mf_lm_sleep(k < 100 ? 20000 : 200000);   /* every copy in flight: wait for one (the watcher bounds it) */
    }
}

static int mf_lm_recv(void *ctx, int from, int tag, void *buf, size_t cap, size_t *got, int64_t timeout_ns,
                      const char *what)
{
    mf_link_mpi *l = ctx;
    *got = 0;
    if (from < 0 || from >= l->size || from == l->rank || tag < 0 || tag > MF_LINK_MAX_TAG || cap > (size_t)INT32_MAX)
        return mf_error(-EINVAL, "link: rank %d: a receive from rank %d with tag %d", l->rank, from, tag);
    if (atomic_load(&l->failed)) return mf_error(-EPIPE, "%s", l->msg);
    MPI_Request r;
    int mrc = MPI_Irecv(buf, (int)cap, MPI_BYTE, from, tag, l->comm, &r);
    if (mrc != MPI_SUCCESS) return mf_lm_err(mrc, "a receive");
    int64_t t0 = mf_now_ns();
    for (int64_t k = 0;; k++) {
        int done = 0;
        MPI_Status st;
        mrc = MPI_Test(&r, &done, &st);
        if (mrc != MPI_SUCCESS) {
            int cls = 0;
            MPI_Error_class(mrc, &cls);
            if (cls == MPI_ERR_TRUNCATE)
                return mf_error(-EMSGSIZE, "link: rank %d: %s from rank %d is larger than %zu bytes", l->rank, what,
                                from, cap);
            return mf_lm_err(mrc, what);
        }
        if (done) {
            int cnt = 0;
            MPI_Get_count(&st, MPI_BYTE, &cnt);
            *got = (size_t)cnt;
            atomic_store(&l->heard[from], mf_now_ns());
            return 0;
        }
        int64_t now = mf_now_ns();
        int late = timeout_ns >= 0 && now - t0 > timeout_ns;
        if (atomic_load(&l->failed) || late) {
            MPI_Cancel(&r);
            MPI_Request_free(&r);
            if (!late) return mf_error(-EPIPE, "%s", l->msg);
            return mf_error(-ETIMEDOUT, "rank %d: nothing from rank %d for %.1f s while waiting for %s (rank %d still "
                            "sends heartbeats: alive but hung?)", l->rank, from, (now - t0) / 1e9, what, from);
        }
        /* a few polls at once, then sleeps that grow with the wait so far (1/16 of it, from 10 us to
         * 100 us, or 1 ms in an idle wait): a message is taken at most ~6% of the wait, and never
         * more than ~0.1 ms (idle: 1 ms), later than a busy poll would, and a rank waiting for
         * another's layers (tens of ms) wakes ~10,000 times a second instead of spinning beside
         * the workers of its own engine (an idle one ~1,000 times) */
        int64_t nap = (now - t0) / 16, cap = timeout_ns < 0 ? 1000000 : 100000;
        if (k < 50) sched_yield();
        else mf_lm_sleep(nap < 10000 ? 10000 : nap > cap ? cap : nap);
    }
}

static void mf_lm_fail(void *ctx, const char *msg)
{
    mf_link_mpi *l = ctx;
    char m[FAIL_BYTES];
    snprintf(m, sizeof m, "%s", msg);
    pthread_mutex_lock(&l->mu);
    mf_lm_fail_locked(l, m, 1);
    pthread_mutex_unlock(&l->mu);
}

/* The UDP heartbeats: rank 0's job id to every rank, then every rank's record to every rank (two
 * collectives each rank makes in open; all: size records). A rank that got no UDP socket hands out
 * an empty record and is heard, and hears, through MPI alone. */
static void mf_lm_hb_open(mf_link_mpi *l, mf_hb_record *all)
{
    uint64_t job = 0;
    if (l->rank == 0) job = (uint64_t)mf_now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)l;
    MPI_Bcast(&job, 1, MPI_UINT64_T, 0, l->comm);
    mf_hb_record mine;
    mf_hb_udp *h = NULL;
    if (mf_hb_udp_open(job, l->rank, l->size, l->hb_ns, &h, &mine)) memset(&mine, 0, sizeof mine);
    int mrc = MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, l->comm);
    if (mrc == MPI_SUCCESS && h && !mf_hb_udp_start(h, all)) l->hb = h;
    else mf_hb_udp_close(h);
}

int mf_link_mpi_open(int *argc, char ***argv, const mf_link_mpi_opts *o, mf_link_mpi **out)
{
    *out = NULL;
    int inited = 0, prov = 0;
    MPI_Initialized(&inited);
    if (!inited) {
        int mrc = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &prov);
        if (mrc != MPI_SUCCESS) return mf_lm_err(mrc, "MPI_Init_thread");
    } else {
        MPI_Query_thread(&prov);
    }
    if (prov < MPI_THREAD_MULTIPLE)
        return mf_error(-ENOTSUP, "MPI: this MPI library gives thread level %d, not MPI_THREAD_MULTIPLE (%d): the "
                        "engine's boundary lane and the link's watcher make MPI calls beside the caller's", prov,
                        MPI_THREAD_MULTIPLE);
    mf_link_mpi *l = calloc(1, sizeof *l);
    if (!l) return mf_error(-ENOMEM, "link: out of memory");
    l->hb_ns = o && o->heartbeat_ns > 0 ? o->heartbeat_ns : 1000000000LL;
    l->lost_ns = o && o->lost_ns > 0 ? o->lost_ns : 10000000000LL;
    if (l->lost_ns < 2 * l->hb_ns) l->lost_ns = 2 * l->hb_ns;
    MPI_Comm_dup(MPI_COMM_WORLD, &l->comm);
    MPI_Comm_set_errhandler(l->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(l->comm, &l->rank);
    MPI_Comm_size(l->comm, &l->size);
    l->heard = calloc((size_t)l->size, sizeof *l->heard);
    l->hb_req = malloc(sizeof *l->hb_req * (size_t)l->size);
    l->fail_req = malloc(sizeof *l->fail_req * (size_t)l->size);
    mf_hb_record *recs = calloc((size_t)l->size, sizeof *recs);
    if (!l->heard || !l->hb_req || !l->fail_req || !recs) {
        free(recs);
        free(l->heard);
        free(l->hb_req);
        free(l->fail_req);
        free(l);
        return mf_error(-ENOMEM, "link: out of memory");
    }
    int64_t now = mf_now_ns();
    for (int p = 0; p < l->size; p++) {
        atomic_store(&l->heard[p], now);
        l->hb_req[p] = l->fail_req[p] = MPI_REQUEST_NULL;
    }
    for (int i = 0; i < MAX_PENDING; i++) l->pend[i].req = MPI_REQUEST_NULL;
    pthread_mutex_init(&l->mu, NULL);
    l->ops = (mf_link_ops){.ctx = l, .rank = l->rank, .size = l->size, .send = mf_lm_send, .recv = mf_lm_recv,
                           .fail = mf_lm_fail};
    if (l->size > 1) mf_lm_hb_open(l, recs);
    free(recs);
    if (l->size > 1) {
        if (pthread_create(&l->watcher, NULL, mf_lm_watch, l)) {
            mf_hb_udp_close(l->hb);
            pthread_mutex_destroy(&l->mu);
            free(l->heard);
            free(l->hb_req);
            free(l->fail_req);
            free(l);
            return mf_error(-EAGAIN, "link: cannot start the watcher thread");
        }
        l->watching = 1;
    }
    *out = l;
    return 0;
}

const mf_link_ops *mf_link_mpi_ops(mf_link_mpi *l) { return &l->ops; }

int mf_link_mpi_failed(mf_link_mpi *l, const char **msg)
{
    int f = atomic_load(&l->failed);
    if (msg) *msg = f ? l->msg : "";
    return f;
}

/* Polls until every buffered send and, with barrier, a nonblocking barrier are done, at most
 * bound_ns or until a failure. 1 when done. */
static int mf_lm_drain(mf_link_mpi *l, int barrier, int64_t bound_ns)
{
    MPI_Request b = MPI_REQUEST_NULL;
    if (barrier && MPI_Ibarrier(l->comm, &b) != MPI_SUCCESS) return 0;
    int64_t t0 = mf_now_ns();
    for (;;) {
        int busy = 0, done = 0;
        pthread_mutex_lock(&l->mu);
        mf_lm_progress_locked(l);
        for (int i = 0; i < MAX_PENDING; i++) busy |= l->pend[i].req != MPI_REQUEST_NULL;
        for (int p = 0; p < l->size; p++) busy |= l->fail_req[p] != MPI_REQUEST_NULL;
        pthread_mutex_unlock(&l->mu);
        if (b != MPI_REQUEST_NULL) MPI_Test(&b, &done, MPI_STATUS_IGNORE);
        if (!busy && b == MPI_REQUEST_NULL) return 1;
        if ((barrier && atomic_load(&l->failed)) || mf_now_ns() - t0 > bound_ns) return 0;   /* the barrier is left */
        mf_lm_sleep(1000000);
    }
}

int mf_link_mpi_close(mf_link_mpi *l)
{
    if (!l) return 0;
    int ok = !atomic_load(&l->failed) && (l->size < 2 || mf_lm_drain(l, 1, l->lost_ns));
    if (!ok) {
        if (!atomic_load(&l->failed)) mf_lm_fail(l, "the others did not close with it");
        mf_lm_drain(l, 0, 1000000000LL);   /* the failure told, at most 1 s */
    }
    atomic_store(&l->stop, 1);
    if (l->watching) pthread_join(l->watcher, NULL);
    mf_hb_udp_close(l->hb);
    l->hb = NULL;
    if (!ok) return -EPIPE;   /* l stays: MPI may still read the messages in flight until the caller exits */
    for (int p = 0; p < l->size; p++)   /* a heartbeat the peer never took */
        if (l->hb_req[p] != MPI_REQUEST_NULL) {
            MPI_Cancel(&l->hb_req[p]);
            MPI_Request_free(&l->hb_req[p]);
        }
    MPI_Comm_free(&l->comm);
    MPI_Finalize();
    for (int i = 0; i < MAX_PENDING; i++) free(l->pend[i].buf);
    pthread_mutex_destroy(&l->mu);
    free(l->heard);
    free(l->hb_req);
    free(l->fail_req);
    free(l);
    return 0;
}
