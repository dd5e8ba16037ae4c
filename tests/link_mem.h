/* A link (sched/link.h) between the threads of one process, for tests of the pipeline without MPI
 * (tests/test_step_pipe.c): one hub, a queue of messages per rank, receives that wait on a
 * condition variable with the given timeout. A failure (fail) ends every rank's waits. Not a
 * transport for real use: no liveness of its own. */
#ifndef MF_TEST_LINK_MEM_H
#define MF_TEST_LINK_MEM_H

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sched/error.h"
#include "sched/link.h"

#define MF_LMEM_MAX 16

typedef struct mf_lmem_msg {
    int from, tag;
    size_t n;
    struct mf_lmem_msg *next;
    unsigned char data[];
} mf_lmem_msg;

typedef struct mf_lmem_hub mf_lmem_hub;
typedef struct mf_lmem_end {
    mf_lmem_hub *hub;
    int rank;
} mf_lmem_end;

struct mf_lmem_hub {
    int size;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    mf_lmem_msg *q[MF_LMEM_MAX];   /* per receiving rank, oldest first */
    int failed;
    char msg[512];
    mf_lmem_end end[MF_LMEM_MAX];
    mf_link_ops ops[MF_LMEM_MAX];
};

static int mf_lmem_send(void *ctx, int to, int tag, const void *buf, size_t n)
{
    mf_lmem_end *e = ctx;
    mf_lmem_hub *h = e->hub;
    mf_lmem_msg *m = malloc(sizeof *m + (n ? n : 1));
    if (!m) return mf_error(-ENOMEM, "link_mem: out of memory");
    *m = (mf_lmem_msg){.from = e->rank, .tag = tag, .n = n};
    memcpy(m->data, buf, n);
    pthread_mutex_lock(&h->mu);
    if (h->failed) {
        pthread_mutex_unlock(&h->mu);
        free(m);
        return mf_error(-EPIPE, "%s", h->msg);
    }
    mf_lmem_msg **t = &h->q[to];
    while (*t) t = &(*t)->next;
    *t = m;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    return 0;
}

static int mf_lmem_recv(void *ctx, int from, int tag, void *buf, size_t cap, size_t *got, int64_t timeout_ns,
                        const char *what)
{
    mf_lmem_end *e = ctx;
    mf_lmem_hub *h = e->hub;
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    int64_t t = timeout_ns >= 0 ? timeout_ns : 600000000000LL;
    dl.tv_sec += (time_t)(t / 1000000000);
    dl.tv_nsec += (long)(t % 1000000000);
    if (dl.tv_nsec >= 1000000000) dl.tv_sec++, dl.tv_nsec -= 1000000000;
    pthread_mutex_lock(&h->mu);
    for (;;) {
        for (mf_lmem_msg **p = &h->q[e->rank]; *p; p = &(*p)->next)
            if ((*p)->from == from && (*p)->tag == tag) {
                mf_lmem_msg *m = *p;
                *p = m->next;
                pthread_mutex_unlock(&h->mu);
                int rc = m->n > cap ? mf_error(-EMSGSIZE, "link_mem: %s: %zu bytes, room for %zu", what, m->n, cap) : 0;
                if (!rc) memcpy(buf, m->data, m->n);
                *got = m->n;
                free(m);
                return rc;
            }
        if (h->failed) {
            pthread_mutex_unlock(&h->mu);
            return mf_error(-EPIPE, "%s", h->msg);
        }
        if (pthread_cond_timedwait(&h->cv, &h->mu, &dl) == ETIMEDOUT) {
            pthread_mutex_unlock(&h->mu);
            return mf_error(-ETIMEDOUT, "rank %d: nothing from rank %d while waiting for %s", e->rank, from, what);
        }
    }
}

static void mf_lmem_fail(void *ctx, const char *msg)
{
    mf_lmem_end *e = ctx;
    mf_lmem_hub *h = e->hub;
    pthread_mutex_lock(&h->mu);
    if (!h->failed) snprintf(h->msg, sizeof h->msg, "%s", msg);
    h->failed = 1;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
}

static inline mf_lmem_hub *mf_lmem_new(int size)
{
    mf_lmem_hub *h = calloc(1, sizeof *h);
    if (!h || size > MF_LMEM_MAX) {
        free(h);
        return NULL;
    }
    h->size = size;
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    for (int r = 0; r < size; r++) {
        h->end[r] = (mf_lmem_end){h, r};
        h->ops[r] = (mf_link_ops){.ctx = &h->end[r], .rank = r, .size = size, .send = mf_lmem_send,
                                  .recv = mf_lmem_recv, .fail = mf_lmem_fail};
    }
    return h;
}

/* Messages left in the queues (0 after a clean run). */
static inline int mf_lmem_left(mf_lmem_hub *h)
{
    int n = 0;
    for (int r = 0; r < h->size; r++)
        for (mf_lmem_msg *m = h->q[r]; m; m = m->next) n++;
    return n;
}

static inline void mf_lmem_free(mf_lmem_hub *h)
{
    if (!h) return;
    for (int r = 0; r < h->size; r++)
        while (h->q[r]) {
            mf_lmem_msg *m = h->q[r];
            h->q[r] = m->next;
            free(m);
        }
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv);
    free(h);
}

#endif
