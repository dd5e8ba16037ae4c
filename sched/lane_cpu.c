/* CPU lanes (and the IO lane's pread fallback): a pool of worker threads that take ready tasks in
 * rank order, a batch at a time, and keep the successors they release that another worker would
 * not take first anyway, so that most tasks pass no lock; idle workers get what a busy one holds.
 * Idle workers spin briefly, then sleep on a condition variable until a push wakes them. */
#include <immintrin.h>

#include "sched/error.h"
#include "sched/sched_impl.h"
#include "sched/nvtx.h"

#define MF_SPIN_ROUNDS MF_SCHED_SPIN_ROUNDS

/* Takes the next task for w: the best it holds while nothing in the lane's queue outranks it (no
 * lock); otherwise, under one lock, hands back what it holds and takes up to a batch of the lane's
 * best; sleeps when there is nothing. While other workers of the lane are idle, w keeps only its
 * next task and hands them the rest. Returns -1 when the scheduler shuts down. */
static mf_task_id mf_cpu_next(mf_sched *s, mf_lane_rt *L, mf_worker *w)
{
    if (w->own_hi - w->own_lo > 1 && atomic_load_explicit(&L->n_idle, memory_order_relaxed) &&
        !atomic_load_explicit(&L->top_key, memory_order_relaxed)) {
        pthread_mutex_lock(&L->mu);   /* idle workers, nothing shared: hand them what w holds */
        mf_q_give_back(s, L, w, 1);
        pthread_mutex_unlock(&L->mu);
    }
    mf_task_id t = mf_own_next(w);
    if (t >= 0) {
        if (w->n_out) {   /* left for a refill that is not needed after all */
            pthread_mutex_lock(&L->mu);
            mf_q_give_back(s, L, w, w->own_hi - w->own_lo);
            pthread_mutex_unlock(&L->mu);
        }
        return t;
    }
    pthread_mutex_lock(&L->mu);
    w->busy = 0;
    int idle = 0;
    for (;;) {
        if (L->exit) {
            if (idle) atomic_fetch_sub_explicit(&L->n_idle, 1, memory_order_relaxed);
            pthread_mutex_unlock(&L->mu);
            return -1;
        }
        uint32_t seq = atomic_load_explicit(&L->push_seq, memory_order_relaxed);
        if (L->q && mf_q_refill(s, L, w)) {
            w->busy = 1;
            if (idle) atomic_fetch_sub_explicit(&L->n_idle, 1, memory_order_relaxed);
            /* Own hinted work left behind may now be stolen: wake a sleeper for it. */
            mf_lane_q *q = L->q;
            if (q->wheap && q->n_wheap[w->index] && L->n_sleeping) mf_lane_wake_n(s, L, 1);
            pthread_mutex_unlock(&L->mu);
            t = mf_key_task(w->own[w->own_lo++]);
            if (w->own_lo == w->own_hi) w->own_lo = w->own_hi = 0;
            return t;
        }
        /* Nothing for this worker (the queues are empty, or hold only hinted tasks of idle
         * workers): hand in completions, spin a little until something is pushed, then sleep. */
        if (!idle) atomic_fetch_add_explicit(&L->n_idle, 1, memory_order_relaxed);
        idle = 1;
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

/* Runs (or cancels) t on w and completes it. */
static void mf_cpu_exec(mf_sched *s, mf_lane_rt *L, mf_worker *w, mf_task_id t)
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
    mf_task_finish(s, t, status, w);
}

void *mf_cpu_worker_main(void *arg)
{
    mf_worker *w = arg;
    mf_sched *s = w->s;
    mf_lane_rt *L = w->lane;
    for (;;) {
        mf_task_id t = mf_cpu_next(s, L, w);
        if (t < 0) break;
        mf_cpu_exec(s, L, w, t);
    }
    return NULL;
}
