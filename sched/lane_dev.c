/* Device lanes: one submitting thread per lane runs each task's fn (which enqueues async work on
 * the lane's queue) and asks the backend to call back once that work is done; the task completes
 * in the callback, on the backend's thread. At most `concurrency` tasks of a lane are in flight
 * (0: no limit); no CPU thread waits on a device. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "sched/error.h"
#include "sched/nvtx.h"
#include "sched/sched_impl.h"

/* The backend's callback: the task's device work has finished, failed with err (msg) when err < 0. */
static void mf_dev_done_status(void *arg, int err, const char *msg)
{
    struct mf_dev_tok *tok = arg;
    int expect = MF_TOK_INFLIGHT;
    /* abandoned: the run gave up waiting (mf_sched_opts.dev_wait_ns) and completed the task */
    if (!atomic_compare_exchange_strong(&tok->state, &expect, MF_TOK_IDLE)) return;
    mf_sched *s = tok->s;
    mf_lane_rt *L = &s->lanes[s->rt->lane[tok->t]];
    mf_task_id t = tok->t;
    if (err > 0) err = -EIO;
    if (err) mf_task_fail(s, t, err, msg);
    pthread_mutex_lock(&L->mu);
    L->inflight--;
    mf_lane_wake(s, L, -1);
    pthread_mutex_unlock(&L->mu);
    mf_task_finish(s, t, err, NULL);   /* last touch of the run */
}

static void mf_dev_done(void *arg) { mf_dev_done_status(arg, 0, NULL); }

void *mf_dev_submit_main(void *arg)
{
    mf_worker *w = arg;
    mf_sched *s = w->s;
    mf_lane_rt *L = w->lane;
    for (;;) {
        mf_task_id t = -1;
        pthread_mutex_lock(&L->mu);
        for (;;) {
            if (L->exit) {
                pthread_mutex_unlock(&L->mu);
                return NULL;
            }
            if (L->inflight < L->cap && (t = mf_q_take(L, -1, 0)) >= 0) break;
            if (w->local_done) {   /* hand in completions before sleeping */
                pthread_mutex_unlock(&L->mu);
                mf_done_flush(s, w);
                pthread_mutex_lock(&L->mu);
                continue;
            }
            w->sleeping = 1;
            L->n_sleeping++;
            while (w->sleeping && !L->exit) pthread_cond_wait(&w->cond, &L->mu);
            if (w->sleeping) {
                w->sleeping = 0;
                L->n_sleeping--;
            }
        }
        L->inflight++;
        pthread_mutex_unlock(&L->mu);

        int rc = 0;
        if (mf_task_skip(s, t)) {
            rc = 1;
        } else {
            const mf_task_desc *d = &s->g->tasks[t];
            if (s->spans) {
                s->spans[t].start_ns = mf_span_now(s);
                s->spans[t].worker = 0;
            }
            mf_task_ctx ctx = {.lane = L->index, .worker = 0, .numa_node = -1, .queue = L->queue};
            mf_error_clear();
            /* the range covers the enqueueing; the device work shows on the named stream */
            mf_nvtx_range_push(L->index, s->g->lanes[L->index].name, d->name);
            if (d->fn) rc = d->fn(d->arg, &ctx);
            mf_nvtx_range_pop();
            if (rc < 0) {
                mf_task_fail(s, t, rc, mf_last_error());
            } else if (rc == MF_TASK_NO_WORK) {
                rc = 0;   /* nothing enqueued: done now, no round trip through the stream */
            } else {
                mf_error_clear();
                struct mf_dev_tok *tok = &s->rt->tok[t];
                tok->t_ns = mf_now_ns();
                atomic_store_explicit(&tok->state, MF_TOK_INFLIGHT, memory_order_release);
                rc = s->dev->notify_status
                         ? s->dev->notify_status(s->dev->ctx, L->queue, mf_dev_done_status, tok)
                         : s->dev->notify(s->dev->ctx, L->queue, mf_dev_done, tok);
                if (rc == 0) continue;   /* completes in mf_dev_done (or is abandoned) */
                atomic_store(&tok->state, MF_TOK_IDLE);
                if (rc > 0) rc = -EIO;
                char msg[512];
                snprintf(msg, sizeof msg, "device notify on lane '%s' failed: %s", L->desc.name,
                         *mf_last_error() ? mf_last_error() : strerror(-rc));
                mf_task_fail(s, t, rc, msg);
            }
        }
        pthread_mutex_lock(&L->mu);
        L->inflight--;
        pthread_mutex_unlock(&L->mu);
        mf_task_finish(s, t, rc, w);
    }
}
