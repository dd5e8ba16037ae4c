/* Continuous batching (graphs/step/batch.h): a FIFO queue of requests under a mutex, a fixed pool of
 * sequence slots (state, sampler, logits row, text buffer) touched only by the stepping thread,
 * and one forward per step over decode tokens + prefill chunks. docs/serve.md. */
#include "graphs/step/batch.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "graphs/step/sample.h"
#include "host/tokenizer.h"
#include "sched/clock.h"
#include "sched/error.h"

typedef struct mf_breq {
    uint64_t id;
    mf_batch_req r;       /* prompt and stop point into the copies below */
    int32_t *prompt;
    char **stop;
    int cancel;           /* under the mutex */
    int n_passed;         /* requests admitted ahead of this one while it was the queue's head */
    int64_t submit_ns;
    struct mf_breq *next;
} mf_breq;

typedef struct mf_bseq {
    mf_ref_state *st;
    mf_sampler *smp;
    float *lrow;          /* vocab_size logits of this sequence's last produced item */
    mf_breq *req;         /* NULL: free; written by the stepping thread under the mutex */
    uint64_t order;       /* admission counter: prefill order */
    int n_fed, n_gen;
    int32_t pending;      /* generated token to feed next step, or -1 */
    int in_step, got_logits;
    int admit_rc;         /* the state's reservation at admission (0, or -ENOMEM: the request ends in error) */
    char *txt;            /* generated text; grows (amortized) past its first 4 KiB only */
    size_t n_txt, cap_txt, n_sent;
    int64_t admit_ns, first_ns;
    mf_prefix_seq *ps;    /* its hold on the prefix cache (opts.prefix) */
    int n_cached, n_step; /* prompt tokens restored; items of this step */
} mf_bseq;

struct mf_batch {
    mf_batch_opts o;
    const mf_config *c;
    int64_t V, state_bytes;
    int n_states, step_cap;
    mf_bseq *seq;
    mf_ref_state **it_st;
    int32_t *it_tok;
    float **it_lg;
    int *pf;              /* prefill candidates, sorted by order */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    mf_breq *qhead, *qtail, *dropped;   /* queue; cancelled while queued (DONE pending) */
    int n_queued, n_running, shut;
    int max_bypass;       /* opts.max_bypass resolved: 0 is strict FIFO */
    uint64_t next_id, next_order;
    mf_batch_stats stats;
};

const char *mf_batch_finish_name(mf_batch_finish f)
{
    static const char *const n[] = {"running", "eos", "stop", "length", "cancelled", "error"};
    return f >= 0 && f <= MF_BATCH_ERROR ? n[f] : "?";
}

int64_t mf_batch_state_bytes(const mf_batch *b) { return b->state_bytes; }

static void mf_breq_free(mf_breq *q)
{
    if (!q) return;
    for (int i = 0; q->stop && i < q->r.n_stop; i++) free(q->stop[i]);
    free(q->stop);
    free(q->prompt);
    free(q);
}

int mf_batch_new(const mf_batch_opts *opts, mf_batch **out)
{
    *out = NULL;
    if (!opts->ref) return mf_error(-EINVAL, "batch: no forward (opts.ref)");
    mf_batch_opts o = *opts;
    const mf_config *c = mf_ref_config(o.ref);
    if (!o.max_batch) o.max_batch = 16;
    if (!o.step_tokens) o.step_tokens = MF_BATCH_STEP_TOKENS;
    if (!o.prefill_split) o.prefill_split = 2;
    if (!o.max_queue) o.max_queue = 256;
    if (!o.max_context) o.max_context = c->max_position_embeddings < 4096 ? c->max_position_embeddings : 4096;
    if (o.max_batch < 1 || o.max_batch > MF_STEP_MAX_ITEMS)
        return mf_error(-EINVAL, "batch: max_batch %d (expected 1..%d)", o.max_batch, MF_STEP_MAX_ITEMS);
    if (o.step_tokens < 1 || o.step_tokens > 1 << 16)
        return mf_error(-EINVAL, "batch: step_tokens %d (expected 1..65536)", o.step_tokens);
    if (o.prefill_split < 1 || o.prefill_split > MF_STEP_MAX_ITEMS)
        return mf_error(-EINVAL, "batch: prefill_split %d (expected 1..%d)", o.prefill_split, MF_STEP_MAX_ITEMS);
    if (o.max_queue < 1) return mf_error(-EINVAL, "batch: max_queue %d (expected >= 1)", o.max_queue);
    if (o.max_context < 2 || o.max_context > c->max_position_embeddings)
        return mf_error(-EINVAL, "batch: max_context %" PRId64 " (expected 2..%" PRId64 ", the model's "
                        "max_position_embeddings)", o.max_context, c->max_position_embeddings);
    /* a state holds its fixed part from the start and pages for the positions of the request
     * it runs (graphs/ref/ref.h); the budget bounds what all states hold */
    int64_t sb = mf_ref_state_bytes(c, o.max_context), fixed = mf_ref_state_bytes(c, 0);
    if (o.state_budget_bytes && (uint64_t)sb > o.state_budget_bytes)
        return mf_error(-ENOSPC, "batch: a state of %" PRId64 " positions takes %" PRId64 " bytes, more than "
                        "the state budget of %" PRIu64 " bytes", o.max_context, sb, o.state_budget_bytes);
    /* states enough that one of max_context fits beside all the others idle */
    int64_t fit = o.state_budget_bytes ? 1 + (int64_t)((o.state_budget_bytes - (uint64_t)sb) / (uint64_t)fixed)
                                       : o.max_batch;
    mf_batch *b = calloc(1, sizeof *b);
    if (!b) return mf_error(-ENOMEM, "batch: out of memory");
    b->o = o;
    b->c = c;
    b->V = c->vocab_size;
    b->state_bytes = sb;
    b->n_states = fit < o.max_batch ? (int)fit : o.max_batch;
    b->step_cap = o.step_tokens + b->n_states;
    b->next_id = 1;
    b->max_bypass = o.max_bypass == 0 ? MF_BATCH_MAX_BYPASS : o.max_bypass < 0 ? 0 : o.max_bypass;
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, NULL);
    b->seq = calloc((size_t)b->n_states, sizeof *b->seq);
    b->it_st = malloc(sizeof *b->it_st * (size_t)b->step_cap);
    b->it_tok = malloc(sizeof *b->it_tok * (size_t)b->step_cap);
    b->it_lg = malloc(sizeof *b->it_lg * (size_t)b->step_cap);
    b->pf = malloc(sizeof *b->pf * (size_t)b->n_states);
    int rc = b->seq && b->it_st && b->it_tok && b->it_lg && b->pf ? 0 : mf_error(-ENOMEM, "batch: out of memory");
    for (int i = 0; i < b->n_states && !rc; i++) {
        mf_bseq *q = &b->seq[i];
        q->cap_txt = 4096;
        if ((rc = mf_ref_state_new(o.ref, o.max_context, &q->st)) ||
            (rc = mf_sampler_new(b->V, 1.0, 1.0, 0, &q->smp)))
            break;
        if (!(q->lrow = malloc(sizeof(float) * (size_t)b->V)) || !(q->txt = malloc(q->cap_txt)))
            rc = mf_error(-ENOMEM, "batch: out of memory for sequence %d's buffers", i);
        if (!rc && o.prefix) rc = mf_prefix_seq_new(o.prefix, &q->ps);
    }
    b->stats.n_states = b->n_states;
    if (rc) {
        mf_batch_free(b);
        return rc;
    }
    *out = b;
    return 0;
}

static void mf_batch_emit(mf_batch *b, mf_bseq *q, mf_breq *r, mf_batch_event *ev)
{
    ev->id = r->id;
    ev->user = r->r.user;
    ev->n_prompt = r->r.n_prompt;
    ev->submit_ns = r->submit_ns;
    ev->now_ns = mf_now_ns();
    if (q) {
        ev->n_gen = q->n_gen;
        ev->n_cached = q->n_cached;
        ev->admit_ns = q->admit_ns;
        ev->first_ns = q->first_ns;
    }
    if (b->o.on_event) b->o.on_event(b->o.user, ev);
}

/* Ends the request of slot q: DONE event with the rest of its text, slot freed, state reset. */
static void mf_batch_finish_seq(mf_batch *b, mf_bseq *q, mf_batch_finish f, int err, const char *msg)
{
    mf_breq *r = q->req;
    mf_batch_event ev = {.kind = MF_BATCH_DONE, .finish = f, .err = err, .msg = msg,
                         .text = q->txt + q->n_sent, .n_text = q->n_txt - q->n_sent};
    q->n_sent = q->n_txt;
    mf_batch_emit(b, q, r, &ev);
    q->admit_ns = 0;
    pthread_mutex_lock(&b->mu);
    q->req = NULL;
    b->n_running--;
    b->stats.completed += f != MF_BATCH_CANCELLED;
    b->stats.cancelled += f == MF_BATCH_CANCELLED;
    pthread_mutex_unlock(&b->mu);
    mf_prefix_seq_end(b->o.prefix, q->ps, q->st, f != MF_BATCH_ERROR);   /* its last block a tail */
    mf_ref_state_reset(q->st);
    mf_breq_free(r);
}

/* Bytes at the end of txt[from..n) that may begin a stop string or are an unfinished UTF-8
 * character: they are held back. */
static size_t mf_batch_hold(const mf_breq *r, const char *txt, size_t from, size_t n)
{
    size_t hold = 0;
    for (int s = 0; s < r->r.n_stop; s++) {
        size_t ls = strlen(r->stop[s]);
        for (size_t k = ls - 1; k > hold; k--)
            if (k <= n - from && !memcmp(txt + n - k, r->stop[s], k)) {
                hold = k;
                break;
            }
    }
    for (size_t k = 1; k <= 3 && k <= n - from; k++) {
        unsigned char ch = (unsigned char)txt[n - k];
        if ((ch & 0xC0) == 0x80) continue;   /* continuation byte */
        size_t need = ch >= 0xF0 ? 4 : ch >= 0xE0 ? 3 : ch >= 0xC0 ? 2 : 1;
        if (need > k && k > hold) hold = k;
        break;
    }
    return hold;
}

/* Appends token t's bytes to q's text. Returns 1 when a stop string now appears (text cut
 * before it), 0, or -ENOMEM. */
static int mf_batch_text(mf_batch *b, mf_bseq *q, int32_t t)
{
    if (!b->o.tok) return 0;
    for (;;) {
        int n = mf_tok_token_bytes(b->o.tok, t, q->txt + q->n_txt, q->cap_txt - q->n_txt);
        if (n < 0) return 0;   /* an id the tokenizer lacks contributes no text */
        if ((size_t)n <= q->cap_txt - q->n_txt) {
            q->n_txt += (size_t)n;
            break;
        }
        char *g = realloc(q->txt, q->cap_txt * 2 + (size_t)n);
        if (!g) return mf_error(-ENOMEM, "batch: out of memory for a request's text");
        q->txt = g;
        q->cap_txt = q->cap_txt * 2 + (size_t)n;
    }
    mf_breq *r = q->req;
    size_t cut = q->n_txt;
    for (int s = 0; s < r->r.n_stop; s++) {
        size_t ls = strlen(r->stop[s]);
        for (size_t p = q->n_sent; p + ls <= q->n_txt && p < cut; p++)
            if (!memcmp(q->txt + p, r->stop[s], ls)) {
                cut = p;
                break;
            }
    }
    if (cut < q->n_txt) {
        q->n_txt = cut;
        return 1;
    }
    return 0;
}

int64_t mf_batch_request_bytes(const mf_batch *b, int n_prompt, int max_tokens)
{
    return mf_ref_state_bytes(b->c, (int64_t)n_prompt + max_tokens);
}

/* With the prefix cache: whether r should wait for a running sequence that is still prefilling a
 * common prefix at least a block longer than r's hit (started now, r would compute those positions a
 * second time; it restores them once that sequence has passed them). */
static int mf_batch_prefix_wait(const mf_batch *b, int i, const mf_breq *r, int hit)
{
    int B = mf_prefix_block_tokens(b->o.prefix);
    for (int j = 0; j < b->n_states; j++) {
        const mf_bseq *s = &b->seq[j];
        if (j == i || !s->req) continue;
        int fed = s->admit_ns ? s->n_fed : s->n_cached;   /* admitted in this pass: at its hit */
        int n = r->r.n_prompt - 1 < s->req->r.n_prompt ? r->r.n_prompt - 1 : s->req->r.n_prompt, L = 0;
        while (L < n && r->prompt[L] == s->req->prompt[L]) L++;
        if (L / B * B >= hit + B && fed < L / B * B) return 1;
    }
    return 0;
}

/* Whether request r may take free slot i under the state budget: the bytes every other state
 * holds plus what r needs. Idle states give back their pages (largest first) when that makes
 * room. Then i's state is trimmed to r's positions and reserved for them (its admit_rc). */
static int mf_batch_fits(mf_batch *b, int i, const mf_breq *r)
{
    int64_t n = (int64_t)r->r.n_prompt + r->r.max_tokens, mapped = 0;
    mf_bseq *q = &b->seq[i];
    q->n_cached = b->o.prefix ? mf_prefix_match(b->o.prefix, q->ps, r->prompt, r->r.n_prompt, &mapped) : 0;
    if (b->o.prefix && mf_batch_prefix_wait(b, i, r, q->n_cached)) {
        mf_prefix_seq_end(b->o.prefix, q->ps, NULL, 0);
        return 0;
    }
    if (b->o.state_budget_bytes) {
        int64_t need = mf_ref_state_bytes(b->c, n) - mapped, used = 0;
        for (int j = 0; j < b->n_states; j++)
            if (j != i) used += mf_ref_state_held_bytes(b->seq[j].st);
        while ((uint64_t)(used + need) > b->o.state_budget_bytes) {
            int big = -1;
            for (int j = 0; j < b->n_states; j++)
                if (j != i && !b->seq[j].req && mf_ref_state_held_bytes(b->seq[j].st) > mf_ref_state_bytes(b->c, 0) &&
                    (big < 0 || mf_ref_state_held_bytes(b->seq[j].st) > mf_ref_state_held_bytes(b->seq[big].st)))
                    big = j;
            if (big < 0) {   /* waits for a running sequence to finish */
                mf_prefix_seq_end(b->o.prefix, q->ps, NULL, 0);
                return 0;
            }
            used -= mf_ref_state_held_bytes(b->seq[big].st);
            mf_ref_state_trim(b->seq[big].st, 0);
            used += mf_ref_state_held_bytes(b->seq[big].st);
        }
    }
    /* without a budget it keeps its pages for reuse; the pages a hit maps are not its own */
    if (b->o.state_budget_bytes) mf_ref_state_trim(q->st, n - q->n_cached / MF_LY_PAGE_POSITIONS * MF_LY_PAGE_POSITIONS);
    if (b->o.prefix) q->n_cached = mf_prefix_restore(b->o.prefix, q->ps, q->st);
    if (q->n_cached < 0) q->n_cached = 0;   /* out of memory restoring: from scratch */
    q->admit_rc = mf_ref_state_reserve(q->st, n);   /* no allocation on the step path from here on */
    b->stats.cached_tokens += q->n_cached;
    return 1;
}

/* Takes the queue's cancellations and admissions (under the mutex), then delivers them. A free
 * state takes the queue's head when the state budget holds what it needs; else the first request
 * behind it that fits, while the head has been passed fewer than max_bypass times. */
static void mf_batch_admit(mf_batch *b)
{
    mf_breq *dropped;
    int cancel[MF_STEP_MAX_ITEMS] = {0};
    pthread_mutex_lock(&b->mu);
    dropped = b->dropped;
    b->dropped = NULL;
    for (int i = 0; i < b->n_states; i++) {
        mf_bseq *q = &b->seq[i];
        if (q->req) {
            cancel[i] = q->req->cancel;
            continue;
        }
        if (!b->qhead) continue;
        mf_breq *r = b->qhead, **link = &b->qhead, *prev = NULL;
        if (!mf_batch_fits(b, i, r)) {
            /* the head does not fit the budget: the first request behind it that fits may start,
             * while the head has been passed fewer than max_bypass times (then FIFO until it starts) */
            if (r->n_passed >= b->max_bypass) continue;
            for (prev = r, link = &r->next; *link && !mf_batch_fits(b, i, *link); prev = *link, link = &(*link)->next) {
            }
            if (!*link) continue;
            r = *link;
            b->qhead->n_passed++;
            b->stats.bypassed++;
        }
        *link = r->next;
        if (b->qtail == r) b->qtail = link == &b->qhead ? NULL : prev;
        b->n_queued--;
        b->n_running++;
        q->req = r;
    }
    int64_t held = 0;
    for (int i = 0; i < b->n_states; i++) held += mf_ref_state_held_bytes(b->seq[i].st);
    b->stats.state_bytes_held = held;
    pthread_mutex_unlock(&b->mu);
    while (dropped) {
        mf_breq *r = dropped;
        dropped = r->next;
        mf_batch_event ev = {.kind = MF_BATCH_DONE, .finish = MF_BATCH_CANCELLED};
        mf_batch_emit(b, NULL, r, &ev);
        mf_breq_free(r);
    }
    int64_t now = mf_now_ns();
    for (int i = 0; i < b->n_states; i++) {
        mf_bseq *q = &b->seq[i];
        if (cancel[i]) {
            mf_batch_finish_seq(b, q, MF_BATCH_CANCELLED, 0, NULL);
        } else if (q->req && !q->admit_ns && q->admit_rc) {   /* its state could not grow */
            mf_batch_finish_seq(b, q, MF_BATCH_ERROR, q->admit_rc, mf_last_error());
        } else if (q->req && !q->admit_ns) {   /* just admitted (settings were checked at submit) */
            mf_sampler_reset(q->smp, q->req->r.temperature, q->req->r.top_p, q->req->r.seed);
            q->order = b->next_order++;
            q->n_fed = q->n_cached;
            q->n_gen = 0;
            q->pending = -1;
            q->n_txt = q->n_sent = 0;
            q->admit_ns = now;
            q->first_ns = 0;
        }
    }
}

static int mf_batch_pf_cmp(const void *a, const void *b, void *ctx)
{
    const mf_bseq *s = ctx;
    uint64_t x = s[*(const int *)a].order, y = s[*(const int *)b].order;
    return (x > y) - (x < y);
}

/* Fills the step's items: decode tokens, then prefill chunks by admission order. */
static int mf_batch_items(mf_batch *b)
{
    int n = 0, n_pf = 0;
    for (int i = 0; i < b->n_states; i++) {
        mf_bseq *q = &b->seq[i];
        q->in_step = q->got_logits = 0;
        if (!q->req) continue;
        if (q->pending >= 0) {
            b->it_st[n] = q->st;
            b->it_tok[n] = q->pending;
            b->it_lg[n++] = q->lrow;
            q->in_step = q->got_logits = q->n_step = 1;
        } else {
            b->pf[n_pf++] = i;
        }
    }
    int n_dec = n;
    /* insertion sort by admission order (at most 64 entries) */
    for (int i = 1; i < n_pf; i++)
        for (int j = i; j > 0 && mf_batch_pf_cmp(&b->pf[j - 1], &b->pf[j], b->seq) > 0; j--) {
            int t = b->pf[j];
            b->pf[j] = b->pf[j - 1];
            b->pf[j - 1] = t;
        }
    int budget = b->o.step_tokens - n;
    if (budget < 1) budget = 1;
    /* the first `split` prefilling sequences share the budget evenly, the rest take what is left */
    int split = n_pf < b->o.prefill_split ? n_pf : b->o.prefill_split;
    for (int k = 0; k < n_pf && budget > 0; k++) {
        mf_bseq *q = &b->seq[b->pf[k]];
        int cap = k < split ? (budget + split - k - 1) / (split - k) : budget;
        int left = q->req->r.n_prompt - q->n_fed, take = left < cap ? left : cap;
        for (int j = 0; j < take; j++) {
            b->it_st[n] = q->st;
            b->it_tok[n] = q->req->prompt[q->n_fed + j];
            b->it_lg[n++] = NULL;
        }
        if (take == left && q->req->r.max_tokens > 0) {
            b->it_lg[n - 1] = q->lrow;
            q->got_logits = 1;
        }
        q->n_fed += take;
        q->in_step = 1;
        q->n_step = take;
        budget -= take;
    }
    pthread_mutex_lock(&b->mu);
    b->stats.decode_items += n_dec;
    b->stats.prefill_items += n - n_dec;
    pthread_mutex_unlock(&b->mu);
    return n;
}

/* Samples the next token of q from its logits row and emits it; ends the request when done. */
static void mf_batch_next(mf_batch *b, mf_bseq *q, int64_t now)
{
    mf_breq *r = q->req;
    int32_t t = mf_sampler_pick(q->smp, q->lrow);
    if (t == b->c->eos_token_id && !r->r.ignore_eos) {
        mf_batch_finish_seq(b, q, MF_BATCH_EOS, 0, NULL);
        return;
    }
    q->n_gen++;
    if (!q->first_ns) q->first_ns = now;
    int stop = mf_batch_text(b, q, t);
    if (stop < 0) {
        mf_batch_finish_seq(b, q, MF_BATCH_ERROR, stop, mf_last_error());
        return;
    }
    size_t hold = stop ? 0 : mf_batch_hold(r, q->txt, q->n_sent, q->n_txt);
    mf_batch_event ev = {.kind = MF_BATCH_TOKEN, .token = t, .logits = q->lrow, .text = q->txt + q->n_sent,
                         .n_text = q->n_txt - hold - q->n_sent};
    q->n_sent = q->n_txt - hold;
    mf_batch_emit(b, q, r, &ev);
    pthread_mutex_lock(&b->mu);
    b->stats.generated++;
    pthread_mutex_unlock(&b->mu);
    if (stop)
        mf_batch_finish_seq(b, q, MF_BATCH_STOP, 0, NULL);
    else if (q->n_gen >= r->r.max_tokens)
        mf_batch_finish_seq(b, q, MF_BATCH_LENGTH, 0, NULL);
    else
        q->pending = t;
}

int mf_batch_step(mf_batch *b, int *n_items)
{
    if (n_items) *n_items = 0;
    mf_batch_admit(b);
    int n = mf_batch_items(b);
    if (!n) return 0;
    for (int i = 0; b->o.prefix && i < b->n_states; i++)   /* the prefix cache taps the window */
        if (b->seq[i].in_step) mf_prefix_step_begin(b->o.prefix, b->seq[i].ps, b->seq[i].st, b->seq[i].n_step);
    /* one forward over decode tokens and prefill chunks: the engine runs each sequence's items
     * as one unit of per-item tasks, the sequences' units in parallel (graphs/step/step.h) */
    int rc = b->o.eng ? mf_step_forward(b->o.eng, b->it_st, b->it_tok, n, b->it_lg)
                      : mf_ref_forward(b->o.ref, b->it_st, b->it_tok, n, b->it_lg);
    for (int i = 0; b->o.prefix && i < b->n_states; i++) {   /* and keeps the blocks completed */
        mf_bseq *q = &b->seq[i];
        if (q->in_step)
            mf_prefix_step_end(b->o.prefix, q->ps, q->st, !rc, q->pending < 0 && q->n_fed == q->req->r.n_prompt);
    }
    pthread_mutex_lock(&b->mu);
    b->stats.steps++;
    b->stats.items += n;
    pthread_mutex_unlock(&b->mu);
    if (n_items) *n_items = n;
    int64_t now = mf_now_ns();
    for (int i = 0; i < b->n_states; i++) {
        mf_bseq *q = &b->seq[i];
        if (!q->in_step) continue;
        if (rc) {
            mf_batch_finish_seq(b, q, MF_BATCH_ERROR, rc, mf_last_error());
            continue;
        }
        if (!q->got_logits) {   /* a prefill chunk short of the prompt's end, or max_tokens 0 */
            if (q->n_fed == q->req->r.n_prompt && q->req->r.max_tokens == 0)
                mf_batch_finish_seq(b, q, MF_BATCH_LENGTH, 0, NULL);
            continue;
        }
        q->pending = -1;
        mf_batch_next(b, q, now);
    }
    return rc;
}

int mf_batch_submit(mf_batch *b, const mf_batch_req *req, uint64_t *id)
{
    if (id) *id = 0;
    const mf_batch_req *x = req;
    if (x->n_prompt < 1) return mf_error(-EINVAL, "batch: the prompt has no tokens");
    if (x->max_tokens < 0) return mf_error(-EINVAL, "batch: max_tokens %d (expected >= 0)", x->max_tokens);
    if ((int64_t)x->n_prompt + x->max_tokens > b->o.max_context)
        return mf_error(-EINVAL, "batch: prompt of %d tokens + max_tokens %d = %" PRId64 " positions, past the "
                        "context limit of %" PRId64, x->n_prompt, x->max_tokens,
                        (int64_t)x->n_prompt + x->max_tokens, b->o.max_context);
    for (int i = 0; i < x->n_prompt; i++)
        if (x->prompt[i] < 0 || x->prompt[i] >= b->V)
            return mf_error(-EINVAL, "batch: prompt token %d (position %d) outside the vocabulary [0, %" PRId64 ")",
                            x->prompt[i], i, b->V);
    double top_p = x->top_p ? x->top_p : 1.0;
    if (x->temperature != x->temperature || x->temperature > 1e6)
        return mf_error(-EINVAL, "batch: temperature %g (expected a number <= 1e6)", x->temperature);
    if (x->temperature > 0 && !(top_p > 0 && top_p <= 1))
        return mf_error(-EINVAL, "batch: top_p %g (expected (0, 1])", x->top_p);
    if (x->n_stop < 0 || x->n_stop > 16) return mf_error(-EINVAL, "batch: %d stop strings (0..16)", x->n_stop);
    if (x->n_stop && !b->o.tok) return mf_error(-EINVAL, "batch: stop strings need a tokenizer");
    for (int i = 0; i < x->n_stop; i++)
        if (!x->stop[i] || !x->stop[i][0]) return mf_error(-EINVAL, "batch: stop string %d is empty", i);
    mf_breq *r = calloc(1, sizeof *r);
    if (!r) return mf_error(-ENOMEM, "batch: out of memory");
    r->r = *x;
    r->r.top_p = top_p;
    r->prompt = malloc(sizeof *r->prompt * (size_t)x->n_prompt);
    r->stop = x->n_stop ? calloc((size_t)x->n_stop, sizeof *r->stop) : NULL;
    int ok = r->prompt && (!x->n_stop || r->stop);
    for (int i = 0; ok && i < x->n_stop; i++) ok = (r->stop[i] = strdup(x->stop[i])) != NULL;
    if (!ok) {
        mf_breq_free(r);
        return mf_error(-ENOMEM, "batch: out of memory");
    }
    memcpy(r->prompt, x->prompt, sizeof *r->prompt * (size_t)x->n_prompt);
    r->r.prompt = r->prompt;
    r->r.stop = (const char *const *)r->stop;
    r->submit_ns = mf_now_ns();
    pthread_mutex_lock(&b->mu);
    int rc = b->shut ? -ESHUTDOWN : b->n_queued >= b->o.max_queue ? -EAGAIN : 0;
    uint64_t rid = 0;
    if (!rc) {
        r->id = rid = b->next_id++;
        if (b->qtail) b->qtail->next = r;
        else b->qhead = r;
        b->qtail = r;
        b->n_queued++;
        pthread_cond_broadcast(&b->cv);
    } else {
        b->stats.refused++;
    }
    int q = b->n_queued;
    pthread_mutex_unlock(&b->mu);
    if (rc) {
        mf_breq_free(r);
        return rc == -EAGAIN ? mf_error(rc, "batch: %d requests already wait (max_queue)", q)
                             : mf_error(rc, "batch: shutting down");
    }
    if (id) *id = rid;   /* r may be finished and freed by now */
    return 0;
}

int mf_batch_cancel(mf_batch *b, uint64_t id)
{
    int rc = -ENOENT;
    pthread_mutex_lock(&b->mu);
    for (mf_breq **p = &b->qhead, *prev = NULL; *p; prev = *p, p = &(*p)->next)
        if ((*p)->id == id) {
            mf_breq *r = *p;
            *p = r->next;
            if (b->qtail == r) b->qtail = prev;
            b->n_queued--;
            r->next = b->dropped;
            b->dropped = r;
            rc = 0;
            break;
        }
    for (int i = 0; rc && i < b->n_states; i++)
        if (b->seq[i].req && b->seq[i].req->id == id) {
            b->seq[i].req->cancel = 1;
            rc = 0;
        }
    if (!rc) pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
    return rc ? mf_error(rc, "batch: no request %" PRIu64 " is queued or running", id) : 0;
}

void mf_batch_shutdown(mf_batch *b)
{
    pthread_mutex_lock(&b->mu);
    b->shut = 1;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

int mf_batch_wait(mf_batch *b, int64_t timeout_ns)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t t = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec + (timeout_ns < 0 ? 0 : timeout_ns);
    ts.tv_sec = t / 1000000000;
    ts.tv_nsec = t % 1000000000;
    pthread_mutex_lock(&b->mu);
    int work;
    while (!(work = b->n_queued || b->n_running || b->dropped) && !b->shut)
        if (timeout_ns < 0 ? pthread_cond_wait(&b->cv, &b->mu) : pthread_cond_timedwait(&b->cv, &b->mu, &ts))
            break;
    pthread_mutex_unlock(&b->mu);
    return work;
}

void mf_batch_get_stats(mf_batch *b, mf_batch_stats *out)
{
    pthread_mutex_lock(&b->mu);
    *out = b->stats;
    out->queued = b->n_queued;
    out->running = b->n_running;
    pthread_mutex_unlock(&b->mu);
}

void *mf_batch_state_user(const mf_batch *b, const void *state)
{
    for (int i = 0; i < b->n_states; i++)
        if ((const void *)b->seq[i].st == state) return b->seq[i].req ? b->seq[i].req->r.user : NULL;
    return NULL;
}

void mf_batch_free(mf_batch *b)
{
    if (!b) return;
    pthread_mutex_lock(&b->mu);
    for (mf_breq *r = b->qhead; r;) {   /* queued requests end as cancelled */
        mf_breq *nx = r->next;
        r->next = b->dropped;
        b->dropped = r;
        r = nx;
    }
    b->qhead = b->qtail = NULL;
    b->n_queued = 0;
    for (int i = 0; b->seq && i < b->n_states; i++)
        if (b->seq[i].req) b->seq[i].req->cancel = 1;
    pthread_mutex_unlock(&b->mu);
    if (b->seq) mf_batch_admit(b);
    for (int i = 0; b->seq && i < b->n_states; i++) {
        mf_prefix_seq_free(b->seq[i].ps);
        mf_ref_state_free(b->seq[i].st);
        mf_sampler_free(b->seq[i].smp);
        free(b->seq[i].lrow);
        free(b->seq[i].txt);
    }
    free(b->seq);
    free(b->it_st);
    free(b->it_tok);
    free(b->it_lg);
    free(b->pf);
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
    free(b);
}
