/* The executor core: scheduler lifetime, a graph's run state, the per-lane ready queues (ordered by
 * upward rank), task completion (dependency counters, cancellation of dependents, continuation)
 * and the run itself (timeout, external cancel). Lane engines live in lane_*.c. */
#include "sched/sched_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "sched/error.h"

static _Atomic uint64_t mf_sched_gen;

/* ---- keys and heaps -------------------------------------------------------------------------- */

/* A ready-queue key: the rank's float bits above the inverted task id, so keys order by rank and
 * then by lower id; never 0 (0 marks an empty queue). */
static uint64_t mf_key(double rank, mf_task_id t)
{
    float r = rank > 0 ? (float)rank : 0.0f;
    uint32_t bits;
    memcpy(&bits, &r, sizeof bits);
    return (uint64_t)bits << 32 | (uint32_t)~(uint32_t)t;
}

static void mf_heap_push(uint64_t *h, int *n, uint64_t k)
{
    int i = (*n)++;
    while (i > 0) {
        int p = (i - 1) / 2;
        if (h[p] >= k) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = k;
}

static uint64_t mf_heap_pop(uint64_t *h, int *n)
{
    uint64_t top = h[0], last = h[--*n];
    int m = *n, i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= m) break;
        if (c + 1 < m && h[c + 1] > h[c]) c++;
        if (h[c] <= last) break;
        h[i] = h[c];
        i = c;
    }
    if (m) h[i] = last;
    return top;
}

/* ---- ready queues ---------------------------------------------------------------------------- */

static void mf_q_publish(mf_lane_rt *L)
{
    mf_lane_q *q = L->q;
    uint64_t top = 0;
    if (q) {
        if (q->n_heap) top = q->heap[0];
        if (q->i_roots < q->n_roots && q->roots[q->i_roots] > top) top = q->roots[q->i_roots];
    }
    atomic_store_explicit(&L->top_key, top, memory_order_relaxed);
}

/* Pops the best ready key for worker w (0: none of the lane's own) if it is above `above`: its
 * hinted tasks, the shared heap and the sorted roots compete on key; with nothing there, steals
 * another worker's best hinted task. Lane mutex held; the caller counts and publishes. */
static uint64_t mf_q_pop(mf_lane_rt *L, int w, uint64_t above, int *shared)
{
    mf_lane_q *q = L->q;
    uint64_t best = 0;
    int src = -1;   /* 0 own hinted, 1 heap, 2 roots, 3 steal */
    int victim = -1;
    if (w >= 0 && q->wheap && q->n_wheap[w]) best = q->wheap[w][0], src = 0;
    if (q->n_heap && q->heap[0] > best) best = q->heap[0], src = 1;
    if (q->i_roots < q->n_roots && q->roots[q->i_roots] > best) best = q->roots[q->i_roots], src = 2;
    /* Another worker's hinted task only while that worker is busy (it would be next otherwise). */
    if (src < 0 && q->wheap)
        for (int v = 0; v < L->n_workers; v++)
            if (q->n_wheap[v] && L->workers[v].busy && q->wheap[v][0] > best)
                best = q->wheap[v][0], victim = v, src = 3;
    if (best <= above) return 0;
    switch (src) {
    case 0: mf_heap_pop(q->wheap[w], &q->n_wheap[w]); break;
    case 1: mf_heap_pop(q->heap, &q->n_heap); break;
    case 2: q->i_roots++; break;
    default: mf_heap_pop(q->wheap[victim], &q->n_wheap[victim]); break;
    }
    *shared |= src == 1 || src == 2;
    return best;
}

/* Takes up to n of the best ready keys for worker w into keys[] (descending), each above `above`;
 * returns how many. Lane mutex held. */
static int mf_q_take_keys(mf_lane_rt *L, int w, uint64_t above, uint64_t *keys, int n)
{
    int ready = atomic_load_explicit(&L->n_ready, memory_order_relaxed);
    if (!L->q || !ready) return 0;
    int k = 0, shared = 0;
    while (k < n && k < ready && (keys[k] = mf_q_pop(L, w, above, &shared))) k++;
    atomic_store_explicit(&L->n_ready, ready - k, memory_order_relaxed);
    if (shared) mf_q_publish(L);
    return k;
}

int mf_q_take(mf_lane_rt *L, int w, uint64_t above)
{
    uint64_t k;
    return mf_q_take_keys(L, w, above, &k, 1) ? mf_key_task(k) : -1;
}

/* Wakes a sleeping thread of the lane for a new task: for a hinted task its worker, or another
 * (to steal it) only while that worker is busy. Lane mutex held. */
void mf_lane_wake(mf_sched *s, mf_lane_rt *L, int hint)
{
    if (!L->n_sleeping) return;
    mf_worker *w = NULL;
    if (hint >= 0) {
        if (L->workers[hint].sleeping) w = &L->workers[hint];
        else if (!L->workers[hint].busy) return;   /* it is about to look */
    }
    for (int i = 0; !w && i < L->n_workers; i++)
        if (L->workers[i].sleeping) w = &L->workers[i];
    if (!w) return;
    w->sleeping = 0;
    L->n_sleeping--;
    pthread_cond_signal(&w->cond);
}

/* Wakes sleeping CPU workers of the lane for n new shared tasks, fewer by those still spinning
 * (they see the push and take them; a worker that leaves tasks behind wakes the next). Lane mutex
 * held. */
void mf_lane_wake_n(mf_sched *s, mf_lane_rt *L, int n)
{
    n -= atomic_load_explicit(&L->n_idle, memory_order_relaxed) - L->n_sleeping;
    for (int i = 0; i < n && L->n_sleeping; i++) mf_lane_wake(s, L, -1);
}

static void mf_lane_kick_io(mf_lane_rt *L, int need)
{
    if (need) {
        uint64_t one = 1;
        ssize_t r = write(L->efd, &one, sizeof one);
        (void)r;   /* an eventfd write only fails on counter overflow, which still wakes the ring */
    }
}

void mf_q_push(mf_sched *s, mf_task_id t)
{
    mf_grt *rt = s->rt;
    mf_lane_rt *L = &s->lanes[rt->lane[t]];
    int h = rt->hint[t], kick = 0;
    pthread_mutex_lock(&L->mu);
    mf_lane_q *q = L->q;
    if (h >= 0) {
        mf_heap_push(q->wheap[h], &q->n_wheap[h], rt->key[t]);
    } else {
        mf_heap_push(q->heap, &q->n_heap, rt->key[t]);
        if (q->heap[0] == rt->key[t]) mf_q_publish(L);
    }
    atomic_store_explicit(&L->n_ready, atomic_load_explicit(&L->n_ready, memory_order_relaxed) + 1,
                          memory_order_relaxed);
    atomic_fetch_add_explicit(&L->push_seq, 1, memory_order_relaxed);
    if (L->engine == MF_ENG_URING) {
        kick = L->wants_wake;
        L->wants_wake = 0;
    } else {
        mf_lane_wake(s, L, h);
    }
    pthread_mutex_unlock(&L->mu);
    mf_lane_kick_io(L, kick);
}

/* Puts t (ready, lane L) in L's queues: its worker's heap when hinted, else the shared heap.
 * Lane mutex held; the caller publishes and wakes. */
static void mf_q_put(mf_grt *rt, mf_lane_q *q, uint64_t k)
{
    int h = rt->hint[mf_key_task(k)];
    if (h >= 0) mf_heap_push(q->wheap[h], &q->n_wheap[h], k);
    else mf_heap_push(q->heap, &q->n_heap, k);
}

/* ---- what a CPU worker holds ------------------------------------------------------------------
 * w->own[own_lo .. own_hi) are keys in descending order: the worker's next task is own[own_lo]. */

static inline int mf_own_n(const mf_worker *w) { return w->own_hi - w->own_lo; }

/* Adds key k to what w holds (there is room). Successors usually rank below what w holds: an
 * append. */
static void mf_own_add(mf_worker *w, uint64_t k)
{
    if (w->own_hi == MF_OWN_MAX) {   /* compact, leaving room in front for a refill's batch */
        int n = mf_own_n(w), lo = n + MF_BATCH_MAX < MF_OWN_MAX ? MF_BATCH_MAX : MF_OWN_MAX - 1 - n;
        memmove(w->own + lo, w->own + w->own_lo, (size_t)n * sizeof *w->own);
        w->own_lo = lo;
        w->own_hi = lo + n;
    }
    int i = w->own_hi++;
    while (i > w->own_lo && w->own[i - 1] < k) {
        w->own[i] = w->own[i - 1];
        i--;
    }
    w->own[i] = k;
}

/* Hands the tasks w holds beyond its best `keep` to its lane, and its released successors
 * waiting in w->out, waking sleepers for them. Lane mutex held. */
void mf_q_give_back(mf_sched *s, mf_lane_rt *L, mf_worker *w, int keep)
{
    mf_grt *rt = s->rt;
    mf_lane_q *q = L->q;
    int n = 0;
    while (mf_own_n(w) > keep) mf_q_put(rt, q, w->own[--w->own_hi]), n++;
    for (int i = 0; i < w->n_out; i++) mf_q_put(rt, q, rt->key[w->out[i]]);
    n += w->n_out;
    w->n_out = 0;
    if (!n) return;
    atomic_store_explicit(&L->n_ready, atomic_load_explicit(&L->n_ready, memory_order_relaxed) + n,
                          memory_order_relaxed);
    atomic_fetch_add_explicit(&L->push_seq, 1, memory_order_relaxed);
    mf_q_publish(L);
    mf_lane_wake_n(s, L, n);
}

/* Refills w under the lane mutex: hands the lane the successors waiting in w->out, then w's next
 * tasks become the best `want` of what it holds and the lane's queue (want: its part of the
 * lane's ready tasks, at most MF_BATCH_MAX); of the rest it holds, it keeps what fits while the
 * queue still has a task for every worker (on a lane with a stash), and hands the others back.
 * Returns how many tasks w now holds. */
int mf_q_refill(mf_sched *s, mf_lane_rt *L, mf_worker *w)
{
    mf_grt *rt = s->rt;
    mf_lane_q *q = L->q;
    /* The successors it released go first: they compete for the batch. The queue's new tasks are
     * announced once, at the end (idle workers watch push_seq). */
    int added = w->n_out, taken = 0;
    for (int k = 0; k < w->n_out; k++) mf_q_put(rt, q, rt->key[w->out[k]]);
    w->n_out = 0;
    int ready = atomic_load_explicit(&L->n_ready, memory_order_relaxed) + added;
    atomic_store_explicit(&L->n_ready, ready, memory_order_relaxed);
    int nw = L->n_workers, held = mf_own_n(w);
    int want = (ready + held) / (2 * nw);
    want = want < 1 ? 1 : want > MF_BATCH_MAX ? MF_BATCH_MAX : want;
    if (!held) {   /* the common case: straight into w's stash, already in descending order */
        w->own_lo = 0;
        w->own_hi = taken = mf_q_take_keys(L, w->index, 0, w->own, want);
    } else {
        uint64_t next[MF_BATCH_MAX];
        int n = 0, i = w->own_lo;
        while (n < want) {
            uint64_t mine = i < w->own_hi ? w->own[i] : 0;
            if (mf_q_take_keys(L, w->index, mine, &next[n], 1)) n++, taken++;
            else if (mine) next[n++] = mine, i++;
            else break;
        }
        int keep = w->own_hi - i;
        if (!L->stash || atomic_load_explicit(&L->n_ready, memory_order_relaxed) < nw) keep = 0;
        if (keep > MF_OWN_MAX - n) keep = MF_OWN_MAX - n;
        w->own_lo = i;   /* w holds the tail only: what is not kept goes back */
        int back = 0;
        while (mf_own_n(w) > keep) mf_q_put(rt, q, w->own[--w->own_hi]), back++;
        if (back) {
            atomic_store_explicit(&L->n_ready, atomic_load_explicit(&L->n_ready, memory_order_relaxed) + back,
                                  memory_order_relaxed);
            added += back;
        }
        if (n > i) {   /* make room in front of the tail */
            memmove(w->own + n, w->own + i, (size_t)keep * sizeof *w->own);
            i = n;
        }
        memcpy(w->own + i - n, next, (size_t)n * sizeof *w->own);   /* next[] above the tail */
        w->own_lo = i - n;
        w->own_hi = i + keep;
    }
    if (added) {
        atomic_fetch_add_explicit(&L->push_seq, 1, memory_order_relaxed);
        mf_q_publish(L);
        if (added > taken) mf_lane_wake_n(s, L, added - taken);
    }
    return mf_own_n(w);
}

/* ---- completion ------------------------------------------------------------------------------ */

void mf_done_add(mf_sched *s, uint32_t n)
{
    /* Once the count may reach the total the run may end and s go away: read nothing after. */
    uint32_t total = atomic_load_explicit(&s->run_n, memory_order_relaxed);
    uint32_t v = atomic_fetch_add_explicit(&s->n_done, n, memory_order_acq_rel) + n;
    if (v == total) {
        pthread_mutex_lock(&s->run_mu);
        s->finished = 1;
        pthread_cond_signal(&s->run_cond);
        pthread_mutex_unlock(&s->run_mu);
    }
}

void mf_done_flush(mf_sched *s, mf_worker *w)
{
    if (w->local_done) {
        uint32_t n = w->local_done;
        w->local_done = 0;
        mf_done_add(s, n);
    }
}

void mf_task_fail(mf_sched *s, mf_task_id t, int code, const char *msg)
{
    int zero = 0;
    if (atomic_compare_exchange_strong(&s->result, &zero, code))
        snprintf(s->err_msg, sizeof s->err_msg, "task '%s': %s", s->g->tasks[t].name,
                 msg && *msg ? msg : "failed without a message");
}

#define MF_NOOP_STACK 64

/* Hands w's waiting released successors (w->out) to its lane under one lock. */
static void mf_out_flush(mf_sched *s, mf_worker *w)
{
    pthread_mutex_lock(&w->lane->mu);
    mf_q_give_back(s, w->lane, w, mf_own_n(w));
    pthread_mutex_unlock(&w->lane->mu);
}

/* Releases x's successors (poisoned when status != 0): a ready one marked noop (mf_graph_set_noop)
 * goes on `stack` to complete inline. One that CPU worker w may run stays with w when another
 * worker would take the lane's top task `top` before it anyway, or when it outranks all w holds
 * (w runs it next, as a chain's next task); otherwise it waits in w->out to go to the lane with
 * the others released now (one lock). The rest are queued. */
static void mf_release(mf_sched *s, mf_task_id x, int status, mf_worker *w, uint64_t top,
                       mf_task_id *stack, int *n_stack)
{
    mf_grt *rt = s->rt;
    const mf_graph *g = s->g;
    for (int32_t k = g->succ_off[x], e = g->succ_off[x + 1]; k < e; k++) {
        mf_task_id u = g->succ[k];
        uint32_t v = atomic_load_explicit(&rt->pend[u], memory_order_acquire);
        if ((v & MF_PEND_MASK) == 1) {
            /* x is u's last unfinished predecessor (the others' decrements are visible): u is
             * ready, and nobody else writes its counter in this run, so no read-modify-write.
             * Whoever runs u reads the mark after a queue lock or on this thread. */
            if (status) atomic_store_explicit(&rt->pend[u], v | MF_PEND_POISON, memory_order_relaxed);
        } else {
            if (status) atomic_fetch_or_explicit(&rt->pend[u], MF_PEND_POISON, memory_order_relaxed);
            uint32_t old = atomic_fetch_sub_explicit(&rt->pend[u], 1, memory_order_acq_rel);
            if ((old & MF_PEND_MASK) != 1) continue;
        }
        if (*n_stack < MF_NOOP_STACK && atomic_load_explicit(&g->noop[u], memory_order_relaxed)) {
            stack[(*n_stack)++] = u;
        } else if (w && rt->lane[u] == w->lane->index && (rt->hint[u] < 0 || rt->hint[u] == w->index)) {
            uint64_t ku = rt->key[u];
            int n = w->own_hi - w->own_lo;
            if (n < MF_OWN_MAX && ((ku < top && w->lane->stash) || !n || ku > w->own[w->own_lo])) {
                mf_own_add(w, ku);
            } else {
                if (w->n_out == MF_OUT_MAX) mf_out_flush(s, w);
                w->out[w->n_out++] = u;
            }
        } else {
            mf_q_push(s, u);
        }
    }
}

/* Records t's end, releases its successors (poisoned when status != 0, so they complete as
 * cancelled) and counts it done. Successors marked noop complete here at once, releasing theirs in
 * turn (cancelled when poisoned). With a CPU worker w, successors on w's lane that w may run stay
 * with w as mf_release says (w runs the best it holds next unless the lane's queue holds a better
 * one); the rest go to the lane under one lock. Must be the last thing a non-worker thread does
 * with the run. */
void mf_task_finish(mf_sched *s, mf_task_id t, int status, mf_worker *w)
{
    mf_grt *rt = s->rt;
    if (s->spans) {
        mf_task_span *sp = &s->spans[t];
        sp->end_ns = mf_span_now(s);
        if (status == 1) sp->start_ns = sp->end_ns, sp->worker = -1;
        sp->status = status;
    }
    mf_worker *cw = w && w->lane->engine == MF_ENG_CPU ? w : NULL;
    const mf_graph *g = s->g;
    uint64_t top = cw && g->succ_off[t + 1] > g->succ_off[t]
                       ? atomic_load_explicit(&cw->lane->top_key, memory_order_relaxed) : 0;
    mf_task_id stack[MF_NOOP_STACK];
    int n_stack = 0;
    uint32_t n_noop = 0;
    mf_release(s, t, status, cw, top, stack, &n_stack);
    while (n_stack) {   /* noop tasks: done now, without their lanes */
        mf_task_id x = stack[--n_stack];
        int st = s->stop || (atomic_load_explicit(&rt->pend[x], memory_order_relaxed) & MF_PEND_POISON) ? 1 : 0;
        if (s->spans) {
            int64_t now = mf_span_now(s);
            s->spans[x] = (mf_task_span){now, now, -1, st};
        }
        mf_release(s, x, st, cw, top, stack, &n_stack);
        n_noop++;
    }
    /* Successors for the lane go now, unless w's next step is a refill (under the same lock). */
    if (cw && cw->n_out && mf_own_n(cw) &&
        cw->own[cw->own_lo] >= atomic_load_explicit(&cw->lane->top_key, memory_order_relaxed))
        mf_out_flush(s, cw);
    if (w) {
        w->local_done += 1 + n_noop;
        if (w->local_done >= 256) mf_done_flush(s, w);
    } else {
        mf_done_add(s, 1 + n_noop);
    }
}

/* ---- per-graph run state --------------------------------------------------------------------- */

static void mf_grt_free(void *p)
{
    mf_grt *rt = p;
    if (!rt) return;
    if (rt->q) {
        for (int l = 0; l < rt->n_lanes; l++) {
            mf_lane_q *q = &rt->q[l];
            free(q->heap);
            free(q->roots);
            if (q->wheap)
                for (int w = 0; w < q->n_w; w++) free(q->wheap[w]);
            free(q->wheap);
            free(q->n_wheap);
        }
    }
    free(rt->q);
    free((void *)rt->pend);
    free(rt->pend_init);
    free(rt->key);
    free(rt->lane);
    free(rt->hint);
    free(rt->tok);
    free(rt->hinted_roots);
    free(rt);
}

static int mf_key_desc(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x < y) - (x > y);
}

/* mf_graph_set_lane's update of the run state's copy (the task is not ready: nothing queued). */
static void mf_grt_set_lane(void *p, mf_task_id t, int lane)
{
    mf_grt *rt = p;
    rt->lane[t] = (int16_t)lane;
}

/* Makes g's run state for s: counters, keys, and queues big enough that a run never allocates. */
static int mf_grt_make(mf_sched *s, mf_graph *g, mf_grt **out)
{
    int n = g->n_tasks, nl = g->n_lanes;
    size_t nn = (size_t)(n ? n : 1);
    mf_grt *rt = calloc(1, sizeof *rt);
    if (!rt) return mf_error(-ENOMEM, "sched: out of memory");
    rt->owner = s;
    rt->owner_gen = s->gen;
    rt->n = n;
    rt->n_lanes = nl;
    rt->pend = malloc(nn * sizeof *rt->pend);
    rt->pend_init = malloc(nn * sizeof *rt->pend_init);
    rt->key = malloc(nn * sizeof *rt->key);
    rt->lane = malloc(nn * sizeof *rt->lane);
    rt->hint = malloc(nn * sizeof *rt->hint);
    rt->tok = malloc(nn * sizeof *rt->tok);
    rt->q = calloc((size_t)nl, sizeof *rt->q);
    int *n_lane = calloc((size_t)nl, sizeof *n_lane);
    if (!rt->pend || !rt->pend_init || !rt->key || !rt->lane || !rt->hint || !rt->tok || !rt->q ||
        !n_lane)
        goto oom;
    for (int l = 0; l < nl; l++) {
        rt->q[l].n_w = s->lanes[l].n_workers;
        if (s->lanes[l].engine == MF_ENG_CPU) {
            rt->q[l].wheap = calloc((size_t)rt->q[l].n_w, sizeof *rt->q[l].wheap);
            rt->q[l].n_wheap = calloc((size_t)rt->q[l].n_w, sizeof *rt->q[l].n_wheap);
            if (!rt->q[l].wheap || !rt->q[l].n_wheap) goto oom;
        }
    }
    for (int t = 0; t < n; t++) {
        const mf_task_desc *d = &g->tasks[t];
        mf_lane_rt *L = &s->lanes[d->lane];
        rt->pend_init[t] = (uint32_t)(g->pred_off[t + 1] - g->pred_off[t]);
        rt->key[t] = mf_key(g->rank_ns[t], t);
        rt->lane[t] = (int16_t)d->lane;
        rt->hint[t] = (int16_t)(L->engine == MF_ENG_CPU && d->place_hint >= 0
                                    ? d->place_hint % L->n_workers : -1);
        rt->tok[t].s = s;
        rt->tok[t].t = t;
        atomic_init(&rt->tok[t].state, MF_TOK_IDLE);
        rt->tok[t].t_ns = 0;
        n_lane[d->lane]++;
        if (rt->hint[t] >= 0) rt->q[d->lane].n_wheap[rt->hint[t]]++;   /* capacity count */
        else if (!rt->pend_init[t]) rt->q[d->lane].n_roots++;
    }
    int n_cpu = 0;   /* tasks may move between CPU lanes (mf_graph_set_lane): room for all of them */
    for (int l = 0; l < nl; l++) n_cpu += s->lanes[l].engine == MF_ENG_CPU ? n_lane[l] : 0;
    for (int l = 0; l < nl; l++) {
        mf_lane_q *q = &rt->q[l];
        int cap = s->lanes[l].engine == MF_ENG_CPU ? n_cpu : n_lane[l];
        q->heap = malloc((size_t)(cap ? cap : 1) * sizeof *q->heap);
        q->roots = malloc((size_t)(q->n_roots ? q->n_roots : 1) * sizeof *q->roots);
        if (!q->heap || !q->roots) goto oom;
        for (int w = 0; q->wheap && w < q->n_w; w++) {
            q->wheap[w] = malloc((size_t)(q->n_wheap[w] ? q->n_wheap[w] : 1) * sizeof(uint64_t));
            if (!q->wheap[w]) goto oom;
            q->n_wheap[w] = 0;
        }
        q->n_roots = 0;
    }
    for (int t = 0; t < n; t++)
        if (!rt->pend_init[t] && rt->hint[t] < 0) {
            mf_lane_q *q = &rt->q[rt->lane[t]];
            q->roots[q->n_roots++] = rt->key[t];
        }
    for (int l = 0; l < nl; l++)
        qsort(rt->q[l].roots, (size_t)rt->q[l].n_roots, sizeof(uint64_t), mf_key_desc);
    for (int t = 0; t < n; t++) rt->n_hinted_roots += !rt->pend_init[t] && rt->hint[t] >= 0;
    rt->hinted_roots = malloc((size_t)(rt->n_hinted_roots ? rt->n_hinted_roots : 1) *
                              sizeof(mf_task_id));
    if (!rt->hinted_roots) goto oom;
    for (int t = 0, k = 0; t < n; t++)
        if (!rt->pend_init[t] && rt->hint[t] >= 0) rt->hinted_roots[k++] = t;
    free(n_lane);
    *out = rt;
    return 0;
oom:
    free(n_lane);
    mf_grt_free(rt);
    return mf_error(-ENOMEM, "sched: out of memory for the run state of %d tasks", n);
}

/* ---- scheduler lifetime ---------------------------------------------------------------------- */

static int mf_sched_start_lane(mf_sched *s, mf_lane_rt *L, const mf_sched_opts *o)
{
    const mf_lane_desc *d = &L->desc;
    switch (d->kind) {
    case MF_LANE_CPU: {
        L->engine = MF_ENG_CPU;
        int rc = mf_topo_plan(s, L);
        if (rc) return rc;
        break;
    }
    case MF_LANE_IO:
        L->n_workers = 1;
        L->engine = MF_ENG_PREAD;
        if (!s->io_pread) {
            int rc = mf_io_uring_start(s, L);
            if (rc == 0) L->engine = MF_ENG_URING;
            else if (rc != -ENOSYS && rc != -EPERM && rc != -EACCES && rc != -EINVAL &&
                     rc != -ENOMEM)
                return rc;   /* refusals fall back to pread; anything else is an error */
        }
        if (L->engine == MF_ENG_PREAD) L->n_workers = d->concurrency ? d->concurrency : 16;
        if (mf_io_lane_alloc(L)) return mf_error(-ENOMEM, "sched: IO lane '%s': out of memory for "
                                                 "its bounce buffers", d->name ? d->name : "io");
        break;
    default:
        if (!o->dev)
            return mf_error(-EINVAL, "sched: lane '%s' is a device lane but no device ops were "
                            "given", d->name ? d->name : "?");
        L->engine = MF_ENG_DEV;
        L->n_workers = 1;
        L->cap = d->concurrency ? d->concurrency : 1 << 30;
        L->queue = o->dev->queue(o->dev->ctx, d->device, d->kind);
        break;
    }
    L->workers = calloc((size_t)L->n_workers, sizeof *L->workers);
    if (!L->workers) return mf_error(-ENOMEM, "sched: out of memory");
    for (int i = 0; i < L->n_workers; i++) {
        mf_worker *w = &L->workers[i];
        w->s = s;
        w->lane = L;
        w->index = i;
        pthread_cond_init(&w->cond, NULL);
    }
    for (int i = 0; i < L->n_workers; i++) {
        mf_worker *w = &L->workers[i];
        void *(*fn)(void *) = L->engine == MF_ENG_URING ? mf_io_uring_main
                              : L->engine == MF_ENG_DEV ? mf_dev_submit_main
                                                        : mf_cpu_worker_main;
        int rc = pthread_create(&w->thread, NULL, fn, w);
        if (rc) return mf_error(-rc, "sched: lane '%s': cannot start thread %d: %s", d->name, i,
                                strerror(rc));
        w->started = 1;
        if (s->pin && L->bind) {
            rc = mf_topo_bind(s, L, i);
            if (rc) return rc;
        }
    }
    return 0;
}

int mf_sched_create(const mf_sched_opts *o, mf_sched **out)
{
    *out = NULL;
    if (!o || !o->lanes || o->n_lanes <= 0 || o->n_lanes > INT16_MAX)
        return mf_error(-EINVAL, "sched: needs a lane table (got %d lanes)", o ? o->n_lanes : 0);
    mf_sched *s = calloc(1, sizeof *s);
    if (!s) return mf_error(-ENOMEM, "sched: out of memory");
    s->gen = atomic_fetch_add(&mf_sched_gen, 1) + 1;
    s->dev = o->dev;
    s->pin = o->pin_threads;
    mf_sched_io_fault(s, o->io_fault_kind, o->io_fault_nth);
    s->io_pread = o->io_force_pread;
    s->dev_wait_ns = o->dev_wait_ns ? o->dev_wait_ns : MF_SCHED_DEV_WAIT_NS;
    s->io_engine = "none";
    pthread_mutex_init(&s->run_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&s->run_cond, &ca);
    pthread_condattr_destroy(&ca);
    int rc;
    if ((rc = mf_topo_load(o->topology, &s->topo))) goto fail;
    s->lanes = calloc((size_t)o->n_lanes, sizeof *s->lanes);
    if (!s->lanes) {
        rc = mf_error(-ENOMEM, "sched: out of memory");
        goto fail;
    }
    for (int l = 0; l < o->n_lanes; l++) {
        mf_lane_rt *L = &s->lanes[l];
        L->index = l;
        L->desc = o->lanes[l];
        L->numa_node = L->desc.numa_node;
        L->efd = -1;
        pthread_mutex_init(&L->mu, NULL);
        if ((unsigned)L->desc.kind > MF_LANE_DEV_COPY_OUT || L->desc.concurrency < 0) {
            rc = mf_error(-EINVAL, "sched: lane %d ('%s'): bad kind %d or concurrency %d", l,
                          L->desc.name ? L->desc.name : "", (int)L->desc.kind, L->desc.concurrency);
            goto fail;
        }
    }
    s->n_lanes = o->n_lanes;
    for (int l = 0; l < s->n_lanes; l++) {
        rc = mf_sched_start_lane(s, &s->lanes[l], o);
        if (rc) goto fail;
        if (s->lanes[l].engine == MF_ENG_DEV) s->n_dev_lanes++;
        if (s->lanes[l].engine == MF_ENG_URING) s->io_engine = "io_uring";
        else if (s->lanes[l].engine == MF_ENG_PREAD) s->io_engine = "pread";
    }
    *out = s;
    return 0;
fail:
    if (!s->n_lanes && s->lanes) {
        s->n_lanes = o->n_lanes;   /* lanes are initialized but none started */
    }
    mf_sched_destroy(s);
    return rc;
}

void mf_sched_destroy(mf_sched *s)
{
    if (!s) return;
    for (int l = 0; l < s->n_lanes; l++) {
        mf_lane_rt *L = &s->lanes[l];
        pthread_mutex_lock(&L->mu);
        L->exit = 1;
        for (int i = 0; L->workers && i < L->n_workers; i++) {
            L->workers[i].sleeping = 0;
            pthread_cond_signal(&L->workers[i].cond);
        }
        pthread_mutex_unlock(&L->mu);
        if (L->engine == MF_ENG_URING) mf_lane_kick_io(L, 1);
        for (int i = 0; L->workers && i < L->n_workers; i++)
            if (L->workers[i].started) pthread_join(L->workers[i].thread, NULL);
        for (int i = 0; L->workers && i < L->n_workers; i++) pthread_cond_destroy(&L->workers[i].cond);
        if (L->ring_ok) mf_io_uring_stop(L);
        for (int i = 0; L->bind && i < L->n_workers; i++) hwloc_bitmap_free(L->bind[i]);
        free(L->bind);
        free(L->workers);
        free(L->slots);
        free(L->bounce);
        pthread_mutex_destroy(&L->mu);
    }
    free(s->lanes);
    if (s->topo) hwloc_topology_destroy(s->topo);
    pthread_mutex_destroy(&s->run_mu);
    pthread_cond_destroy(&s->run_cond);
    free(s);
}

const char *mf_sched_io_engine(const mf_sched *s) { return s->io_engine; }

/* ---- runs ------------------------------------------------------------------------------------ */

static int mf_sched_check_graph(const mf_sched *s, const mf_graph *g)
{
    if (!g->finalized) return mf_error(-EINVAL, "sched: graph is not finalized");
    if (g->n_lanes != s->n_lanes)
        return mf_error(-EINVAL, "sched: graph has %d lanes, scheduler %d", g->n_lanes, s->n_lanes);
    for (int l = 0; l < g->n_lanes; l++)
        if (g->lanes[l].kind != s->lanes[l].desc.kind)
            return mf_error(-EINVAL, "sched: graph lane %d ('%s') has kind %d, scheduler's lane has "
                            "kind %d", l, g->lanes[l].name, (int)g->lanes[l].kind,
                            (int)s->lanes[l].desc.kind);
    return 0;
}

/* Run states whose run abandoned a device task (mf_dev_watch): a callback may still come for it at
 * any time, even after the scheduler and the graph are gone (the caller may destroy them before
 * closing the device), and it reads its token's state, so they are kept, reachable, for the rest
 * of the process. Only a run that found a device faulted leaves one. */
static pthread_mutex_t mf_orphans_mu = PTHREAD_MUTEX_INITIALIZER;
static mf_grt *mf_orphans;

/* The run thread's watch over device completions (run_mu not held): a device task whose callback
 * has not come dev_wait_ns after its work was enqueued is abandoned: it fails with -ETIMEDOUT
 * naming the wait, the run stops, and the task is completed here in place of its callback (which,
 * if it comes late, finds the token abandoned and leaves). Returns how many were abandoned. */
static int mf_dev_watch(mf_sched *s, int64_t now)
{
    mf_grt *rt = s->rt;
    int n_abandoned = 0;
    for (mf_task_id t = 0; t < rt->n; t++) {
        struct mf_dev_tok *tok = &rt->tok[t];
        if (atomic_load_explicit(&tok->state, memory_order_acquire) != MF_TOK_INFLIGHT ||
            now - tok->t_ns < s->dev_wait_ns)
            continue;
        int expect = MF_TOK_INFLIGHT;
        if (!atomic_compare_exchange_strong(&tok->state, &expect, MF_TOK_ABANDONED)) continue;
        mf_lane_rt *L = &s->lanes[rt->lane[t]];
        char msg[512];
        snprintf(msg, sizeof msg, "device lane '%s': no completion from the device %.1f ms after "
                 "the task's work was enqueued (bound: mf_sched_opts.dev_wait_ns = %.1f ms); the "
                 "device faulted or lost its callback, so the run stops", L->desc.name,
                 (double)(now - tok->t_ns) / 1e6, (double)s->dev_wait_ns / 1e6);
        mf_task_fail(s, t, -ETIMEDOUT, msg);
        atomic_store(&s->stop, 1);
        pthread_mutex_lock(&L->mu);
        L->inflight--;
        mf_lane_wake(s, L, -1);
        pthread_mutex_unlock(&L->mu);
        n_abandoned++;
        mf_task_finish(s, t, -ETIMEDOUT, NULL);
    }
    return n_abandoned;
}

int mf_sched_run(mf_sched *s, mf_graph *g, const mf_run_opts *ro)
{
    int rc = mf_sched_check_graph(s, g);
    if (rc) return rc;
    mf_timeline *tl = ro ? ro->timeline : NULL;
    if (tl && (tl->g != g || tl->n != g->n_tasks))
        return mf_error(-EINVAL, "sched: the timeline was made for another graph");
    int idle = 0;
    if (!atomic_compare_exchange_strong(&s->running, &idle, 1))
        return mf_error(-EBUSY, "sched: a run is already in progress");
    mf_grt *rt = g->rt;
    if (!rt || rt->owner != s || rt->owner_gen != s->gen) {
        if (g->rt_free) g->rt_free(g->rt);
        g->rt = NULL;
        g->rt_free = NULL;
        g->rt_set_lane = NULL;
        rc = mf_grt_make(s, g, &rt);
        if (rc) {
            atomic_store(&s->running, 0);
            return rc;
        }
        g->rt = rt;
        g->rt_free = mf_grt_free;
        g->rt_set_lane = mf_grt_set_lane;
    }
    int n = g->n_tasks;
    if (tl) mf_timeline_reset(tl);
    if (!n) {
        atomic_store(&s->running, 0);
        return 0;
    }
    memcpy((void *)rt->pend, rt->pend_init, (size_t)n * sizeof *rt->pend_init);
    s->g = g;
    s->rt = rt;
    s->spans = tl ? tl->spans : NULL;
    atomic_store(&s->stop, 0);
    atomic_store(&s->result, 0);
    atomic_store(&s->n_done, 0);
    atomic_store(&s->run_n, (uint32_t)n);
    s->err_msg[0] = '\0';
    pthread_mutex_lock(&s->run_mu);
    s->finished = 0;
    s->in_run = 1;
    pthread_mutex_unlock(&s->run_mu);
    s->t0_ns = mf_now_ns();
    /* Every lane gets its (empty) queues first, since a task that runs pushes to other lanes;
     * then each lane's roots become visible and its sleepers wake. */
    for (int l = 0; l < s->n_lanes; l++) {
        mf_lane_rt *L = &s->lanes[l];
        mf_lane_q *q = &rt->q[l];
        pthread_mutex_lock(&L->mu);
        q->n_heap = 0;
        q->i_roots = q->n_roots;
        for (int w = 0; q->wheap && w < q->n_w; w++) q->n_wheap[w] = 0;
        atomic_store_explicit(&L->n_ready, 0, memory_order_relaxed);
        L->q = q;
        pthread_mutex_unlock(&L->mu);
    }
    for (int l = 0; l < s->n_lanes; l++) {
        mf_lane_rt *L = &s->lanes[l];
        mf_lane_q *q = &rt->q[l];
        pthread_mutex_lock(&L->mu);
        q->i_roots = 0;
        atomic_store_explicit(&L->n_ready,
                              atomic_load_explicit(&L->n_ready, memory_order_relaxed) + q->n_roots,
                              memory_order_relaxed);
        atomic_fetch_add_explicit(&L->push_seq, 1, memory_order_relaxed);
        mf_q_publish(L);
        int kick = 0;
        if (L->engine == MF_ENG_URING) {
            kick = L->wants_wake;
            L->wants_wake = 0;
        } else {
            for (int i = 0; i < L->n_workers && L->n_sleeping && i < q->n_roots; i++)
                mf_lane_wake(s, L, -1);
        }
        pthread_mutex_unlock(&L->mu);
        mf_lane_kick_io(L, kick);
    }
    /* Hinted roots go to their worker's heap. */
    for (int i = 0; i < rt->n_hinted_roots; i++) mf_q_push(s, rt->hinted_roots[i]);

    /* Waits for the end of the run, waking for the run's timeout and, with device lanes, every
     * quarter of the device wait bound (1 ms..1 s) to look for device tasks whose callback is
     * overdue. */
    int64_t timeout = ro ? ro->timeout_ns : 0;
    int64_t watch_ns = 0, n_abandoned = 0;
    if (s->n_dev_lanes && s->dev_wait_ns > 0) {
        watch_ns = s->dev_wait_ns / 4;
        watch_ns = watch_ns < 1000000 ? 1000000 : watch_ns > 1000000000 ? 1000000000 : watch_ns;
    }
    pthread_mutex_lock(&s->run_mu);
    while (!s->finished) {
        int64_t now = mf_now_ns(), at = 0;
        int run_deadline = timeout > 0 && !atomic_load(&s->stop);
        if (run_deadline) at = s->t0_ns + timeout;
        if (watch_ns && (!at || now + watch_ns < at)) at = now + watch_ns;
        if (!at) {
            pthread_cond_wait(&s->run_cond, &s->run_mu);
            continue;
        }
        struct timespec dl = {.tv_sec = at / 1000000000LL, .tv_nsec = at % 1000000000LL};
        if (pthread_cond_timedwait(&s->run_cond, &s->run_mu, &dl) != ETIMEDOUT || s->finished)
            continue;
        now = mf_now_ns();
        if (run_deadline && now >= s->t0_ns + timeout) {
            int zero = 0;
            atomic_compare_exchange_strong(&s->result, &zero, -ETIMEDOUT);
            atomic_store(&s->stop, 1);
        }
        if (watch_ns) {
            pthread_mutex_unlock(&s->run_mu);
            n_abandoned += mf_dev_watch(s, now);
            pthread_mutex_lock(&s->run_mu);
        }
    }
    rc = atomic_load(&s->result);
    s->in_run = 0;
    pthread_mutex_unlock(&s->run_mu);
    if (n_abandoned) {   /* a late callback may still read its token, even after destroy */
        g->rt = NULL;
        g->rt_free = NULL;
        g->rt_set_lane = NULL;
        pthread_mutex_lock(&mf_orphans_mu);
        rt->orphan_next = mf_orphans;
        mf_orphans = rt;
        pthread_mutex_unlock(&mf_orphans_mu);
    }

    for (int l = 0; l < s->n_lanes; l++) {
        mf_lane_rt *L = &s->lanes[l];
        pthread_mutex_lock(&L->mu);
        L->q = NULL;
        atomic_store_explicit(&L->top_key, 0, memory_order_relaxed);
        pthread_mutex_unlock(&L->mu);
    }
    s->g = NULL;
    s->rt = NULL;
    s->spans = NULL;
    atomic_store(&s->running, 0);
    if (rc == -ETIMEDOUT && !s->err_msg[0])
        return mf_error(rc, "sched: run timed out after %.3f ms", (double)timeout / 1e6);
    if (rc == -ECANCELED && !s->err_msg[0]) return mf_error(rc, "sched: run cancelled");
    if (rc) return mf_error(rc, "%s", s->err_msg);
    return 0;
}

void mf_sched_cancel(mf_sched *s)
{
    pthread_mutex_lock(&s->run_mu);
    if (s->in_run && !s->finished) {
        int zero = 0;
        atomic_compare_exchange_strong(&s->result, &zero, -ECANCELED);
        atomic_store(&s->stop, 1);
    }
    pthread_mutex_unlock(&s->run_mu);
}
