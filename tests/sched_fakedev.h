/* A fake device for scheduler tests: one host thread per queue runs enqueued closures in order,
 * and notify() enqueues the scheduler's done callback behind them, as a CUDA stream host function
 * would. Only for tests; the real emulated device lives in device/. */
#ifndef MF_TEST_SCHED_FAKEDEV_H
#define MF_TEST_SCHED_FAKEDEV_H

#include <pthread.h>
#include <stdlib.h>

#include "sched/sched.h"

#define FAKEDEV_CAP 4096

typedef struct fakedev_item {
    void (*fn)(void *);
    void *arg;
} fakedev_item;

typedef struct fakedev_queue {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cond;
    fakedev_item items[FAKEDEV_CAP];
    unsigned head, tail;
    int exit;
    long n_run;
    int fail_notify;   /* test hook: notify returns an error */
} fakedev_queue;

typedef struct fakedev {
    fakedev_queue q[3];   /* copy-in, compute, copy-out of device 0 */
    mf_dev_lane_ops ops;
} fakedev;

static void *fakedev_main(void *arg)
{
    fakedev_queue *q = arg;
    pthread_mutex_lock(&q->mu);
    for (;;) {
        while (q->head == q->tail && !q->exit) pthread_cond_wait(&q->cond, &q->mu);
        if (q->head == q->tail) break;
        fakedev_item it = q->items[q->head % FAKEDEV_CAP];
        pthread_mutex_unlock(&q->mu);
        it.fn(it.arg);
        pthread_mutex_lock(&q->mu);
        q->head++;   /* retire after running, so the slot is not reused early */
        q->n_run++;
        pthread_cond_broadcast(&q->cond);
    }
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

static void fakedev_enqueue(void *queue, void (*fn)(void *), void *arg)
{
    fakedev_queue *q = queue;
    pthread_mutex_lock(&q->mu);
    while (q->tail - q->head >= FAKEDEV_CAP) pthread_cond_wait(&q->cond, &q->mu);
    q->items[q->tail++ % FAKEDEV_CAP] = (fakedev_item){fn, arg};
    pthread_cond_broadcast(&q->cond);
    pthread_mutex_unlock(&q->mu);
}

static void *fakedev_queue_of(void *ctx, int device, mf_lane_kind kind)
{
    fakedev *d = ctx;
    return &d->q[kind == MF_LANE_DEV_COPY_IN ? 0 : kind == MF_LANE_DEV_COMPUTE ? 1 : 2];
}

static int fakedev_notify(void *ctx, void *queue, void (*done)(void *), void *done_arg)
{
    fakedev_queue *q = queue;
    if (q->fail_notify) return -EIO;
    fakedev_enqueue(queue, done, done_arg);
    return 0;
}

static void fakedev_start(fakedev *d)
{
    for (int i = 0; i < 3; i++) {
        fakedev_queue *q = &d->q[i];
        q->head = q->tail = 0;
        q->exit = 0;
        q->n_run = 0;
        q->fail_notify = 0;
        pthread_mutex_init(&q->mu, NULL);
        pthread_cond_init(&q->cond, NULL);
        pthread_create(&q->thread, NULL, fakedev_main, q);
    }
    d->ops = (mf_dev_lane_ops){.ctx = d, .queue = fakedev_queue_of, .notify = fakedev_notify};
}

static void fakedev_stop(fakedev *d)
{
    for (int i = 0; i < 3; i++) {
        fakedev_queue *q = &d->q[i];
        pthread_mutex_lock(&q->mu);
        q->exit = 1;
        pthread_cond_broadcast(&q->cond);
        pthread_mutex_unlock(&q->mu);
        pthread_join(q->thread, NULL);
        pthread_mutex_destroy(&q->mu);
        pthread_cond_destroy(&q->cond);
    }
}

/* Scales a test's size down 4x under sanitizers (slow) unless MOEFLOW_TEST_TASKS says otherwise. */
static int sched_test_tasks(int full)
{
    const char *e = getenv("MOEFLOW_TEST_TASKS");
    if (e && atoi(e) > 0) return atoi(e);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
    return full / 4;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
    return full / 4;
#endif
#endif
    return full;
}

#endif
