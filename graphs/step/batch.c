/* Continuous batching (graphs/step/batch.h): a FIFO queue of requests under a mutex, a fixed pool of
 * sequence slots (state, sampler, logits row, text buffer) touched only by the stepping thread,
 * and one forward per step over decode tokens + prefill chunks. docs/serve.md. */
#include "graphs/step/batch.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "graphs/step/sample.h"
#include "graphs/step/spec.h"
#include "host/grammar.h"
#include "host/tokenizer.h"
#include "sched/clock.h"
#include "sched/error.h"

typedef struct mf_breq {
    uint64_t id;
    mf_batch_req r;       /* prompt, stop and bias point into the copies below */
    int32_t *prompt;
    char **stop;
    mf_batch_bias *bias;
    int cancel;           /* under the mutex */
    int n_passed;         /* requests admitted ahead of this one while it was the queue's head */
    int64_t submit_ns;
    struct mf_breq *next;
} mf_breq;

typedef struct mf_bseq {
    mf_ref_state *st;
    mf_sampler *smp;
    float *lrow;          /* vocab_size logits of this sequence's last produced item (with speculation,
                           * 1 + its most candidates rows: a verify's every item) */
    int n_ver;            /* this step's decode items: the pending token and its candidates */
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
    /* penalties: per token its occurrences in the output (MF_CNT_OUT bits) and MF_CNT_PROMPT;
     * touched lists the ids with a non-zero entry (cleared at the end). Allocated at the slot's
     * first request with penalties, kept. */
    uint32_t *cnt;
    int32_t *touched;
    int n_touched, cap_touched;
    int penalize;         /* the running request has penalties */
    mf_gram_match *gm;    /* constrained decoding: allocated at the slot's first such request, kept */
    int constrained;      /* the running request has a grammar (gm matches it) */
    uint32_t *mask;       /* the grammar's allowed tokens, vocab_size bits */
    int echo_rows;        /* echo: rows of b->erows this step's chunk uses, from echo_row0; */
    int echo_row0, echo_pos0;   /* row r holds the logits of prompt position echo_pos0 + r */
} mf_bseq;

#define MF_CNT_PROMPT 0x80000000u
#define MF_CNT_OUT 0x7fffffffu

struct mf_batch {
    mf_batch_opts o;
    const mf_config *c;
    int64_t V, state_bytes;
    int n_states, step_cap;
    mf_bseq *seq;
    mf_ref_state **it_st;
    int32_t *it_tok;
    float **it_lg;
    float **it_ft;        /* with speculation: each item's features (graphs/step/spec.h) */
    int spec_max;         /* with speculation: candidates per round at most, else 0 */
    int *pf;              /* prefill candidates, sorted by order */
    float *erows;         /* echo_rows rows of V logits: the prompt positions of echo chunks */
    float *raw;           /* V: a logprobs request's logits as the model gave them (before adjusting) */
    mf_logprob top[MF_BATCH_MAX_LOGPROBS];
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

int mf_batch_default_step_tokens(int max_batch)
{
    int n = 2 * max_batch;
    return n < MF_BATCH_STEP_TOKENS ? MF_BATCH_STEP_TOKENS : n > MF_STEP_MAX_ITEMS ? MF_STEP_MAX_ITEMS : n;
}

int mf_batch_step_items(int max_batch, int step_tokens)
{
    int n = step_tokens > 0 ? step_tokens : mf_batch_default_step_tokens(max_batch);
    n = max_batch > n ? max_batch : n;
    return n < MF_STEP_MAX_ITEMS ? n : MF_STEP_MAX_ITEMS;
}

static void mf_breq_free(mf_breq *q)
{
    if (!q) return;
    for (int i = 0; q->stop && i < q->r.n_stop; i++) free(q->stop[i]);
    free(q->stop);
    free(q->prompt);
    free(q->bias);
    free(q);
}

int mf_batch_new(const mf_batch_opts *opts, mf_batch **out)
{
    *out = NULL;
    if (!opts->ref) return mf_error(-EINVAL, "batch: no forward (opts.ref)");
    if (opts->spec && opts->forward)
        return mf_error(-EINVAL, "batch: speculation with a forward of its own (opts.forward: a pipeline's); the "
                        "draft reads features of a whole model's forward");
    mf_batch_opts o = *opts;
    const mf_config *c = mf_ref_config(o.ref);
    if (!o.max_batch) o.max_batch = 16;
    if (!o.step_tokens) o.step_tokens = mf_batch_default_step_tokens(o.max_batch);
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
    if (o.echo_rows < 0 || o.echo_rows > MF_STEP_MAX_ITEMS)
        return mf_error(-EINVAL, "batch: echo_rows %d (expected 0..%d)", o.echo_rows, MF_STEP_MAX_ITEMS);
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
    if (o.spec) {
        mf_spec_stats ss;
        mf_spec_get_stats(o.spec, &ss);
        b->spec_max = ss.n_max;
    }
    b->step_cap = o.step_tokens + b->n_states * (1 + b->spec_max);
    b->next_id = 1;
    b->max_bypass = o.max_bypass == 0 ? MF_BATCH_MAX_BYPASS : o.max_bypass < 0 ? 0 : o.max_bypass;
    pthread_mutex_init(&b->mu, NULL);
    pthread_cond_init(&b->cv, NULL);
    b->seq = calloc((size_t)b->n_states, sizeof *b->seq);
    b->it_st = malloc(sizeof *b->it_st * (size_t)b->step_cap);
    b->it_tok = malloc(sizeof *b->it_tok * (size_t)b->step_cap);
    b->it_lg = malloc(sizeof *b->it_lg * (size_t)b->step_cap);
    b->it_ft = o.spec ? malloc(sizeof *b->it_ft * (size_t)b->step_cap) : NULL;
    b->pf = malloc(sizeof *b->pf * (size_t)b->n_states);
    if (o.echo_rows) b->erows = malloc(sizeof(float) * (size_t)o.echo_rows * (size_t)b->V);
    b->raw = malloc(sizeof(float) * (size_t)b->V);
    int rc = b->seq && b->it_st && b->it_tok && b->it_lg && b->pf && (!o.echo_rows || b->erows) && b->raw
             && (!o.spec || b->it_ft)
                 ? 0 : mf_error(-ENOMEM, "batch: out of memory");
    for (int i = 0; i < b->n_states && !rc; i++) {
        mf_bseq *q = &b->seq[i];
        q->cap_txt = 4096;
        if ((rc = mf_ref_state_new(o.ref, o.max_context, &q->st)) ||
            (rc = mf_sampler_new(b->V, 1.0, 1.0, 0, &q->smp)))
            break;
        if (!(q->lrow = malloc(sizeof(float) * (size_t)b->V * (size_t)(1 + b->spec_max))) || !(q->txt = malloc(q->cap_txt)))
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

/* Ends the request of slot q: DONE event with the rest of its text (and lp's token and logprobs,
 * for an EOS a logprobs request drew), slot freed, state reset. */
static void mf_batch_finish_lp(mf_batch *b, mf_bseq *q, mf_batch_finish f, int err, const char *msg,
                               const mf_batch_event *lp)
{
    mf_breq *r = q->req;
    mf_batch_event ev = {.kind = MF_BATCH_DONE, .finish = f, .err = err, .msg = msg,
                         .text = q->txt + q->n_sent, .n_text = q->n_txt - q->n_sent};
    if (lp) {
        ev.token = lp->token;
        ev.logprob = lp->logprob;
        ev.top = lp->top;
        ev.n_top = lp->n_top;
        ev.has_logprob = 1;
    }
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
    for (int i = 0; i < q->n_touched; i++) q->cnt[q->touched[i]] = 0;
    q->n_touched = 0;
    mf_breq_free(r);
}

static void mf_batch_finish_seq(mf_batch *b, mf_bseq *q, mf_batch_finish f, int err, const char *msg)
{
    mf_batch_finish_lp(b, q, f, err, msg, NULL);
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
    /* echo_logprobs needs the logits of every prompt position: such a request restores nothing (a
     * lookup of its first token) and computes its prompt, inserting its blocks as any other */
    int echo = r->r.echo_logprobs, n_look = echo ? 1 : r->r.n_prompt;
    q->n_cached = b->o.prefix ? mf_prefix_match(b->o.prefix, q->ps, r->prompt, n_look, &mapped) : 0;
    if (b->o.prefix && !echo && mf_batch_prefix_wait(b, i, r, q->n_cached)) {
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

/* A just-admitted request's sampler settings, penalty counts (the prompt's tokens marked for
 * repetition_penalty) and grammar matcher; the slot's count table and matcher are allocated at
 * its first request that needs them. 0, -ENOMEM or the grammar's code (the request ends in error). */
static int mf_batch_start_seq(mf_batch *b, mf_bseq *q)
{
    const mf_batch_req *r = &q->req->r;
    mf_sampler_set(q->smp, &(mf_sample_opts){.temperature = r->temperature, .top_p = r->top_p, .top_k = r->top_k,
                                             .min_p = r->min_p, .seed = r->seed});
    q->penalize = r->presence_penalty != 0 || r->frequency_penalty != 0 ||
                  (r->repetition_penalty != 0 && r->repetition_penalty != 1);
    if (q->penalize && !q->cnt) {
        q->cnt = calloc((size_t)b->V, sizeof *q->cnt);
        q->cap_touched = (int)b->o.max_context;
        q->touched = malloc(sizeof *q->touched * (size_t)q->cap_touched);
        if (!q->cnt || !q->touched) {
            free(q->cnt);
            free(q->touched);
            q->cnt = NULL;
            q->touched = NULL;
            return mf_error(-ENOMEM, "batch: out of memory for a sequence's penalty counts");
        }
    }
    if (q->penalize && r->repetition_penalty != 0 && r->repetition_penalty != 1)
        for (int i = 0; i < r->n_prompt; i++) {
            int32_t t = r->prompt[i];
            if (!q->cnt[t]) q->touched[q->n_touched++] = t;
            q->cnt[t] |= MF_CNT_PROMPT;
        }
    q->constrained = r->grammar != NULL;
    if (!r->grammar) return 0;
    if (!q->gm) {
        int rc = mf_gram_match_new(b->o.gram_vocab, &q->gm);
        if (rc) return rc;
        if (!(q->mask = malloc(sizeof *q->mask * (size_t)((b->V + 31) / 32))))
            return mf_error(-ENOMEM, "batch: out of memory for a grammar mask");
    }
    return mf_gram_match_start(q->gm, r->grammar);
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
    int rc;
    for (int i = 0; i < b->n_states; i++) {
        mf_bseq *q = &b->seq[i];
        if (cancel[i]) {
            mf_batch_finish_seq(b, q, MF_BATCH_CANCELLED, 0, NULL);
        } else if (q->req && !q->admit_ns && q->admit_rc) {   /* its state could not grow */
            mf_batch_finish_seq(b, q, MF_BATCH_ERROR, q->admit_rc, mf_last_error());
        } else if (q->req && !q->admit_ns && (rc = mf_batch_start_seq(b, q))) {
            mf_batch_finish_seq(b, q, MF_BATCH_ERROR, rc, mf_last_error());
        } else if (q->req && !q->admit_ns) {   /* just admitted (settings were checked at submit) */
            q->order = b->next_order++;
            q->n_fed = q->n_cached;
            q->n_gen = 0;
            q->pending = -1;
            q->n_txt = q->n_sent = 0;
            q->admit_ns = now;
            q->first_ns = 0;
            if (b->o.spec) mf_spec_admit(b->o.spec, i);
        }
    }
}

static int mf_batch_pf_cmp(const void *a, const void *b, void *ctx)
{
    const mf_bseq *s = ctx;
    uint64_t x = s[*(const int *)a].order, y = s[*(const int *)b].order;
    return (x > y) - (x < y);
}

/* Whether q's request may speculate: plain sampling of the model's logits (no logprobs, logit_bias,
 * penalties or grammar: those requests take plain steps, k = 0). */
static int mf_batch_spec_plain(const mf_bseq *q)
{
    const mf_batch_req *r = &q->req->r;
    return !r->logprobs && !r->n_bias && !q->penalize && !q->constrained;
}

/* With speculation: whether q's step was a verify (its decode items the pending token and its
 * candidates, accepted by mf_batch_spec_next, which rolls its state back to what it keeps). */
static int mf_batch_spec_verify(const mf_batch *b, const mf_bseq *q)
{
    return b->o.spec && q->n_ver && mf_batch_spec_plain(q);
}

/* With speculation: the round's candidates of the step's decode sequences (graphs/step/spec.h
 * mf_spec_plan), each taking at most what its request may still generate and its share of the
 * graph run's items (mf_batch_step_items: the engine's max_batch as the tools make it; none where it
 * may not speculate: mf_batch_spec_plain). 0 or the draft's error. */
static int mf_batch_spec_plan(mf_batch *b)
{
    mf_spec_seq sq[MF_STEP_MAX_ITEMS];
    int n = 0, cap = mf_batch_step_items(b->o.max_batch, b->o.step_tokens);   /* the engine's graph run */
    for (int i = 0; i < b->n_states && n < MF_STEP_MAX_ITEMS; i++) {
        mf_bseq *q = &b->seq[i];
        if (q->req && q->pending >= 0) sq[n++] = (mf_spec_seq){.slot = i, .st = q->st, .anchor = q->pending,
                                                               .req_user = q->req->r.user};
    }
    for (int j = 0; j < n; j++) {
        const mf_bseq *q = &b->seq[sq[j].slot];
        int room = q->req->r.max_tokens - q->n_gen - 1, share = (cap - n) / n;
        int64_t ctx = q->st->max_pos - q->st->n_pos - 1;
        sq[j].room = room < share ? (room < ctx ? room : (int)ctx) : (share < ctx ? share : (int)ctx);
        if (sq[j].room < 0 || !mf_batch_spec_plain(q)) sq[j].room = 0;
    }
    return n ? mf_spec_plan(b->o.spec, sq, n) : 0;
}

/* Fills the step's items: decode tokens (with speculation each one's candidates after it), then
 * prefill chunks by admission order; with speculation each item's feature row. */
static int mf_batch_items(mf_batch *b)
{
    int n = 0, n_pf = 0;
    for (int i = 0; i < b->n_states; i++) {
        mf_bseq *q = &b->seq[i];
        q->in_step = q->got_logits = 0;
        q->echo_rows = 0;
        if (!q->req) continue;
        if (q->pending >= 0) {
            const int32_t *cand = NULL;
            int k = b->o.spec ? mf_spec_cands(b->o.spec, i, &cand) : 0;
            q->n_ver = 1 + k;
            if (b->o.spec) mf_spec_rows(b->o.spec, i, q->st->n_pos, q->n_ver, b->it_ft + n);
            for (int j = 0; j < q->n_ver; j++) {
                b->it_st[n] = q->st;
                b->it_tok[n] = j ? cand[j - 1] : q->pending;
                b->it_lg[n++] = q->lrow + (size_t)j * b->V;
            }
            q->in_step = q->got_logits = 1;
            q->n_step = q->n_ver;
        } else {
            b->pf[n_pf++] = i;
        }
    }
    int n_dec = n;
    /* insertion sort by admission order (at most max_batch entries, nearly in order) */
    for (int i = 1; i < n_pf; i++)
        for (int j = i; j > 0 && mf_batch_pf_cmp(&b->pf[j - 1], &b->pf[j], b->seq) > 0; j--) {
            int t = b->pf[j];
            b->pf[j] = b->pf[j - 1];
            b->pf[j - 1] = t;
        }
    int budget = b->o.step_tokens - n;
    if (budget < 1) budget = 1;
    /* the first `split` prefilling sequences share the budget evenly, the rest take what is left */
    int split = n_pf < b->o.prefill_split ? n_pf : b->o.prefill_split, erow = 0;
    for (int k = 0; k < n_pf && budget > 0; k++) {
        mf_bseq *q = &b->seq[b->pf[k]];
        int cap = k < split ? (budget + split - k - 1) / (split - k) : budget;
        int left = q->req->r.n_prompt - q->n_fed, take = left < cap ? left : cap;
        int echo = q->req->r.echo_logprobs;
        if (echo && take > b->o.echo_rows - erow) take = b->o.echo_rows - erow;   /* a logits row per position */
        if (take <= 0) continue;
        q->echo_row0 = erow;
        q->echo_pos0 = q->n_fed;
        if (b->o.spec) mf_spec_rows(b->o.spec, b->pf[k], q->st->n_pos, take, b->it_ft + n);
        for (int j = 0; j < take; j++) {
            b->it_st[n] = q->st;
            b->it_tok[n] = q->req->prompt[q->n_fed + j];
            /* echo: every position but the prompt's last gives the next prompt token's logprob */
            int row = echo && q->n_fed + j < q->req->r.n_prompt - 1;
            b->it_lg[n++] = row ? b->erows + (size_t)(erow + q->echo_rows++) * (size_t)b->V : NULL;
        }
        erow += q->echo_rows;
        if (take == left && q->req->r.max_tokens > 0) {
            b->it_lg[n - 1] = q->lrow;
            q->got_logits = 1;
        }
        q->n_fed += take;
        q->in_step = 1;
        q->n_ver = 0;
        q->n_step = take;
        budget -= take;
    }
    pthread_mutex_lock(&b->mu);
    b->stats.decode_items += n_dec;
    b->stats.prefill_items += n - n_dec;
    pthread_mutex_unlock(&b->mu);
    return n;
}

/* PROMPT events of q's echo rows this step: row r, the logits of prompt position echo_pos0 + r,
 * gives the logprob of the prompt token after it. */
static void mf_batch_echo(mf_batch *b, mf_bseq *q)
{
    mf_breq *r = q->req;
    for (int k = 0; k < q->echo_rows; k++) {
        int pos = q->echo_pos0 + k + 1;
        mf_batch_event ev = {.kind = MF_BATCH_PROMPT, .pos = pos, .token = r->prompt[pos], .top = b->top,
                             .n_top = r->r.top_logprobs, .has_logprob = 1};
        mf_logprobs(b->erows + (size_t)(q->echo_row0 + k) * (size_t)b->V, b->V, ev.token, ev.n_top, &ev.logprob, b->top);
        mf_batch_emit(b, q, r, &ev);
    }
}

/* The request's logit_bias and penalties applied to q's logits row, in place. */
static void mf_batch_adjust(mf_bseq *q)
{
    const mf_batch_req *r = &q->req->r;
    float *l = q->lrow;
    for (int i = 0; i < r->n_bias; i++)
        l[r->bias[i].id] = r->bias[i].bias <= -100 ? -INFINITY : l[r->bias[i].id] + r->bias[i].bias;
    if (!q->penalize) return;
    double rp = r->repetition_penalty != 0 ? r->repetition_penalty : 1;
    for (int i = 0; i < q->n_touched; i++) {
        int32_t t = q->touched[i];
        uint32_t c = q->cnt[t] & MF_CNT_OUT;
        double x = l[t];
        if (rp != 1) x = x > 0 ? x / rp : x * rp;
        if (c) x -= r->frequency_penalty * c + r->presence_penalty;
        l[t] = (float)x;
    }
}

/* q's next token under its grammar: greedy tries the best token first; otherwise (or when it does
 * not fit) the grammar's mask sets the logits outside it to -inf before the sampler draws. The
 * token is then accepted by the matcher. A token or a negative code. */
static int32_t mf_batch_pick_constrained(mf_batch *b, mf_bseq *q)
{
    int32_t t;
    if (q->req->r.temperature <= 0) {
        t = mf_sample_greedy(q->lrow, b->V);
        if (q->lrow[t] > -INFINITY && mf_gram_match_allows(q->gm, t) == 1)
            return mf_gram_match_accept(q->gm, t) ? -EPROTO : t;
    }
    int n = mf_gram_match_mask(q->gm, q->mask);
    if (n < 0) return n;
    for (int64_t w = 0; w < (b->V + 31) / 32; w++) {
        uint32_t m = q->mask[w];
        if (m == 0xffffffffu) continue;
        for (int k = 0; k < 32 && w * 32 + k < b->V; k++)
            if (!(m >> k & 1)) q->lrow[w * 32 + k] = -INFINITY;
    }
    t = mf_sampler_pick(q->smp, q->lrow);
    if (q->lrow[t] == -INFINITY || mf_gram_match_accept(q->gm, t))   /* nothing allowed survived logit_bias */
        return mf_error(-EPROTO, "batch: no token the grammar allows is left (logit_bias banned them all)");
    return t;
}

/* Emits token t of q (ev: its event, the logprob filled where asked, logits the row it came from);
 * ends the request when done. Returns 1 when it goes on. */
static int mf_batch_emit_token(mf_batch *b, mf_bseq *q, int32_t t, mf_batch_event *ev, int64_t now)
{
    mf_breq *r = q->req;
    ev->token = t;
    if (t == b->c->eos_token_id && (!r->r.ignore_eos || q->constrained)) {   /* a grammar allows EOS only once complete */
        mf_batch_finish_lp(b, q, MF_BATCH_EOS, 0, NULL, r->r.logprobs ? ev : NULL);
        return 0;
    }
    if (q->penalize) {
        if (!q->cnt[t]) q->touched[q->n_touched++] = t;
        if ((q->cnt[t] & MF_CNT_OUT) != MF_CNT_OUT) q->cnt[t]++;
    }
    q->n_gen++;
    if (!q->first_ns) q->first_ns = now;
    int stop = mf_batch_text(b, q, t);
    if (stop < 0) {
        mf_batch_finish_seq(b, q, MF_BATCH_ERROR, stop, mf_last_error());
        return 0;
    }
    size_t hold = stop ? 0 : mf_batch_hold(r, q->txt, q->n_sent, q->n_txt);
    ev->text = q->txt + q->n_sent;
    ev->n_text = q->n_txt - hold - q->n_sent;
    q->n_sent = q->n_txt - hold;
    mf_batch_emit(b, q, r, ev);
    pthread_mutex_lock(&b->mu);
    b->stats.generated++;
    pthread_mutex_unlock(&b->mu);
    if (stop || (q->constrained && mf_gram_match_done(q->gm)))   /* a complete grammar allows nothing but EOS */
        mf_batch_finish_seq(b, q, MF_BATCH_STOP, 0, NULL);
    else if (q->n_gen >= r->r.max_tokens)
        mf_batch_finish_seq(b, q, MF_BATCH_LENGTH, 0, NULL);
    else
        return 1;
    return 0;
}

/* Samples the next token of q from its logits row and emits it; ends the request when done. */
static void mf_batch_next(mf_batch *b, mf_bseq *q, int64_t now)
{
    mf_breq *r = q->req;
    mf_batch_event ev = {.kind = MF_BATCH_TOKEN, .top = b->top, .n_top = r->r.logprobs ? r->r.top_logprobs : 0,
                         .logits = q->lrow};
    double lse = 0;
    const float *raw = q->lrow;
    if (r->r.logprobs) {   /* the model's distribution: before bias, penalties, grammar, temperature */
        lse = mf_logprobs(q->lrow, b->V, 0, ev.n_top, NULL, b->top);
        if (r->r.n_bias || q->penalize || q->constrained) {
            memcpy(b->raw, q->lrow, sizeof(float) * (size_t)b->V);
            raw = b->raw;
        }
    }
    if (r->r.n_bias || q->penalize) mf_batch_adjust(q);
    int32_t t = q->constrained ? mf_batch_pick_constrained(b, q) : mf_sampler_pick(q->smp, q->lrow);
    if (t < 0) {
        mf_batch_finish_seq(b, q, MF_BATCH_ERROR, t, mf_last_error());
        return;
    }
    ev.logprob = (float)((double)raw[t] - lse);
    ev.has_logprob = r->r.logprobs;
    if (mf_batch_emit_token(b, q, t, &ev, now)) q->pending = t;
}

/* With speculation, a decode sequence's tokens of the step (graphs/step/spec.h mf_spec_accept: the
 * accepted candidates and the bonus, its state rolled back to what it keeps), emitted in order. */
static void mf_batch_spec_next(mf_batch *b, mf_bseq *q, int i, int64_t now)
{
    int32_t tok[MF_SPEC_MAX + 1];
    int nt = 0, rc = mf_spec_accept(b->o.spec, i, q->st, q->smp, q->lrow, tok, &nt);
    /* the prefix cache keeps the blocks the kept positions completed: none of a rejected one */
    mf_prefix_step_end(b->o.prefix, q->ps, q->st, !rc, 0);
    if (rc) {
        mf_batch_finish_seq(b, q, MF_BATCH_ERROR, rc, mf_last_error());
        return;
    }
    for (int j = 0; j < nt; j++) {
        mf_batch_event ev = {.kind = MF_BATCH_TOKEN, .logits = q->lrow + (size_t)j * b->V};
        if (!mf_batch_emit_token(b, q, tok[j], &ev, now)) return;
    }
    q->pending = tok[nt - 1];
}

int mf_batch_step(mf_batch *b, int *n_items)
{
    if (n_items) *n_items = 0;
    mf_batch_admit(b);
    int rc = b->o.spec ? mf_batch_spec_plan(b) : 0;   /* the round's candidates first */
    int n = mf_batch_items(b), n_dec = 0, n_seq = 0;
    if (!n) return 0;
    for (int i = 0; b->o.prefix && i < b->n_states; i++)   /* the prefix cache taps the window */
        if (b->seq[i].in_step) mf_prefix_step_begin(b->o.prefix, b->seq[i].ps, b->seq[i].st, b->seq[i].n_step);
    /* one forward over decode tokens and prefill chunks: the engine runs each sequence's items
     * as one unit of per-item tasks, the sequences' units in parallel (graphs/step/step.h) */
    float **ft = b->o.spec && mf_spec_feats(b->o.spec) ? b->it_ft : NULL;
    int64_t t0 = mf_now_ns();
    if (!rc)
        rc = b->o.forward ? b->o.forward(b->o.forward_ctx, b->it_st, b->it_tok, n, b->it_lg)
             : b->o.eng   ? mf_step_forward_feat(b->o.eng, b->it_st, b->it_tok, n, b->it_lg, ft)
                          : mf_ref_forward_feat(b->o.ref, b->it_st, b->it_tok, n, b->it_lg, ft);
    for (int i = 0; i < b->n_states; i++) {
        n_dec += b->seq[i].in_step && b->seq[i].n_ver ? b->seq[i].n_ver : 0;
        n_seq += b->seq[i].in_step && b->seq[i].n_ver;
    }
    if (!rc && b->o.spec && n_dec == n) mf_spec_step_done(b->o.spec, mf_now_ns() - t0, n, n_seq);   /* decode only */
    for (int i = 0; b->o.prefix && i < b->n_states; i++) {   /* and keeps the blocks completed */
        mf_bseq *q = &b->seq[i];   /* a verify's after its rollback (mf_batch_spec_next) */
        if (q->in_step && (rc || !mf_batch_spec_verify(b, q)))
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
        if (q->echo_rows) mf_batch_echo(b, q);
        if (!q->got_logits) {   /* a prefill chunk short of the prompt's end, or max_tokens 0 */
            if (q->n_fed == q->req->r.n_prompt && q->req->r.max_tokens == 0)
                mf_batch_finish_seq(b, q, MF_BATCH_LENGTH, 0, NULL);
            continue;
        }
        q->pending = -1;
        if (mf_batch_spec_verify(b, q)) mf_batch_spec_next(b, q, i, now);
        else mf_batch_next(b, q, now);
    }
    return rc;
}

/* The sampling controls, logprobs and grammar of a request: 0 or -EINVAL naming the field. */
static int mf_batch_check_controls(const mf_batch *b, const mf_batch_req *x)
{
    if (x->top_k < 0) return mf_error(-EINVAL, "batch: top_k %d (expected >= 0)", x->top_k);
    if (!(x->min_p >= 0 && x->min_p <= 1)) return mf_error(-EINVAL, "batch: min_p %g (expected 0..1)", x->min_p);
    if (!(x->presence_penalty >= -2 && x->presence_penalty <= 2))
        return mf_error(-EINVAL, "batch: presence_penalty %g (expected -2..2)", x->presence_penalty);
    if (!(x->frequency_penalty >= -2 && x->frequency_penalty <= 2))
        return mf_error(-EINVAL, "batch: frequency_penalty %g (expected -2..2)", x->frequency_penalty);
    if (!(x->repetition_penalty >= 0 && x->repetition_penalty <= 2))
        return mf_error(-EINVAL, "batch: repetition_penalty %g (expected 0..2; 0 or 1: off)", x->repetition_penalty);
    if (x->n_bias < 0 || x->n_bias > b->V || (x->n_bias && !x->bias))
        return mf_error(-EINVAL, "batch: %d logit biases (expected 0..%" PRId64 ")", x->n_bias, b->V);
    for (int i = 0; i < x->n_bias; i++)
        if (x->bias[i].id < 0 || x->bias[i].id >= b->V || !(x->bias[i].bias >= -100 && x->bias[i].bias <= 100))
            return mf_error(-EINVAL, "batch: logit bias %d: token %d, bias %g (expected a token in [0, %" PRId64 "), "
                            "a bias in -100..100)", i, x->bias[i].id, x->bias[i].bias, b->V);
    if (x->top_logprobs < 0 || x->top_logprobs > MF_BATCH_MAX_LOGPROBS)
        return mf_error(-EINVAL, "batch: top_logprobs %d (expected 0..%d)", x->top_logprobs, MF_BATCH_MAX_LOGPROBS);
    if (x->echo_logprobs && !b->o.echo_rows)
        return mf_error(-EINVAL, "batch: prompt logprobs need opts.echo_rows");
    if (x->grammar && !b->o.gram_vocab)
        return mf_error(-EINVAL, "batch: a grammar needs opts.gram_vocab");
    return 0;
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
    int rc = mf_batch_check_controls(b, x);
    if (rc) return rc;
    mf_breq *r = calloc(1, sizeof *r);
    if (!r) return mf_error(-ENOMEM, "batch: out of memory");
    r->r = *x;
    r->r.top_p = top_p;
    r->prompt = malloc(sizeof *r->prompt * (size_t)x->n_prompt);
    r->stop = x->n_stop ? calloc((size_t)x->n_stop, sizeof *r->stop) : NULL;
    r->bias = x->n_bias ? malloc(sizeof *r->bias * (size_t)x->n_bias) : NULL;
    int ok = r->prompt && (!x->n_stop || r->stop) && (!x->n_bias || r->bias);
    for (int i = 0; ok && i < x->n_stop; i++) ok = (r->stop[i] = strdup(x->stop[i])) != NULL;
    if (!ok) {
        mf_breq_free(r);
        return mf_error(-ENOMEM, "batch: out of memory");
    }
    memcpy(r->prompt, x->prompt, sizeof *r->prompt * (size_t)x->n_prompt);
    if (x->n_bias) memcpy(r->bias, x->bias, sizeof *r->bias * (size_t)x->n_bias);
    r->r.prompt = r->prompt;
    r->r.bias = r->bias;
    r->r.stop = (const char *const *)r->stop;
    r->submit_ns = mf_now_ns();
    pthread_mutex_lock(&b->mu);
    rc = b->shut ? -ESHUTDOWN : b->n_queued >= b->o.max_queue ? -EAGAIN : 0;
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
        free(b->seq[i].cnt);
        free(b->seq[i].touched);
        mf_gram_match_free(b->seq[i].gm);
        free(b->seq[i].mask);
    }
    free(b->erows);
    free(b->raw);
    free(b->seq);
    free(b->it_st);
    free(b->it_tok);
    free(b->it_lg);
    free(b->it_ft);
    free(b->pf);
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
    free(b);
}
