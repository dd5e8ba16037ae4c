/* CPU lanes (and the IO lane's pread fallback): a pool of worker threads that take ready tasks in
 * rank order, a few at a time, run them, and go straight on to a successor they made ready when it
 * outranks everything queued (no queue round trip on chains). Idle workers spin briefly, then
 * sleep on a condition variable until a push wakes them. */
#include <immintrin.h>

#include "sched/error.h"
#include "sched/sched_impl.h"
#include "sched/nvtx.h"

#define MF_SPIN_ROUNDS 2000

/* Takes the next task for w: from its batch, else up to a batch from the lane's queues; sleeps
 * when there is nothing. Returns -1 when the scheduler shuts down. */
static mf_task_id mf_cpu_next(mf_sched *s, mf_lane_rt *L, mf_worker *w)
{
    if (w->i_batch < w->n_batch) {
        /* A task pushed since the batch was taken may outrank the rest of it. */
        mf_task_id t = w->batch[w->i_batch++];
        if (atomic_load_explicit(&L->top_key, memory_order_relaxed) > s->rt->key[t])
            t = mf_q_swap(s, L, t);
        return t;
    }
    w->i_batch = w->n_batch = 0;
    pthread_mutex_lock(&L->mu);
    w->busy = 0;
    for (;;) {
        if (L->exit) {
            pthread_mutex_unlock(&L->mu);
            return -1;
        }
        int ready = atomic_load_explicit(&L->n_ready, memory_order_relaxed);
        uint32_t seq = atomic_load_explicit(&L->push_seq, memory_order_relaxed);
        if (ready) {
            int want = ready / (2 * L->n_workers);
            want = want < 1 ? 1 : want > MF_BATCH_MAX ? MF_BATCH_MAX : want;
            while (w->n_batch < want) {
                mf_task_id t = mf_q_take(L, w->index);
                if (t < 0) break;
                w->batch[w->n_batch++] = t;
            }
            if (w->n_batch) {
                w->busy = 1;
                /* Own hinted work left behind may now be stolen: wake a sleeper for it. */
                mf_lane_q *q = L->q;
                if (q->wheap && q->n_wheap[w->index] && L->n_sleeping) mf_lane_wake(s, L, -1);
                pthread_mutex_unlock(&L->mu);
                w->i_batch = 1;
                return w->batch[0];
            }
        }
        /* Nothing for this worker (the queues are empty, or hold only hinted tasks of idle
         * workers): hand in completions, spin a little until something is pushed, then sleep. */
        pthread_mutex_unlock(&L->mu);
        mf_done_flush(s, w);
        for (int i = 0; i < MF_SPIN_ROUNDS; i++) {
            if (atomic_load_explicit(&L->push_seq, memory_order_relaxed) != seq) break;
            _mm_pause();
        }
        pthread_mutex_lock(&L->mu);
        if (L->exit || atomic_load_explicit(&L->push_seq, memory_order_relaxed) != seq) continue;
        w->sleeping = 1;
        L->n_sleeping++;
        while (w->sleeping && !L->exit) pthread_cond_wait(&w->cond, &L->mu);
        if (w->sleeping) {
            w->sleeping = 0;
            L->n_sleeping--;
        }
    }
}

/* Runs (or cancels) t on w and completes it; returns the continuation, if any. */
static mf_task_id mf_cpu_exec(mf_sched *s, mf_lane_rt *L, mf_worker *w, mf_task_id t)
{
    int status = 1;
    if (!mf_task_skip(s, t)) {
        const mf_task_desc *d = &s->g->tasks[t];
        if (s->spans) {
            s->spans[t].start_ns = mf_span_now(s);
            s->spans[t].worker = w->index;
        }
        int rc;
        if (L->engine == MF_ENG_PREAD) {
            rc = mf_io_pread(s, t, w->index);
        } else if (d->fn) {
            mf_task_ctx ctx = {.lane = L->index, .worker = w->index, .numa_node = L->numa_node};
            mf_error_clear();
            mf_nvtx_range_push(L->index, s->g->lanes[L->index].name, d->name);
            rc = d->fn(d->arg, &ctx);
            mf_nvtx_range_pop();
        } else {
            rc = 0;
        }
        status = rc < 0 ? rc : 0;
        if (rc < 0) mf_task_fail(s, t, rc, mf_last_error());
    }
    return mf_task_finish(s, t, status, w);
}

void *mf_cpu_worker_main(void *arg)
{
    mf_worker *w = arg;
    mf_sched *s = w->s;
    mf_lane_rt *L = w->lane;
    mf_task_id cont = -1;
    for (;;) {
        mf_task_id t = cont >= 0 ? cont : mf_cpu_next(s, L, w);
        if (t < 0) break;
        cont = mf_cpu_exec(s, L, w, t);
    }
    return NULL;
}
