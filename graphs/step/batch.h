/* Continuous batching over the scheduled engine (graphs/step/step.h) or the reference forward
 * (graphs/ref/ref.h): a queue of requests and a running set of sequences whose states and samplers
 * come from a pool allocated once at start. Each mf_batch_step runs one forward: a decode token
 * for every running sequence that has one, then prefill chunks of the others under a token budget;
 * new requests join at the next step, finished or cancelled ones leave at once and their state is
 * reset for the next request. Policy, knobs and numerics: docs/serve.md. */
#ifndef MF_BATCH_H
#define MF_BATCH_H

#include <stddef.h>
#include <stdint.h>

#include "graphs/prefix/prefix.h"
#include "graphs/ref/ref.h"
#include "graphs/step/sample.h"
#include "graphs/step/step.h"

typedef struct mf_tok mf_tok;
typedef struct mf_batch mf_batch;
typedef struct mf_gram mf_gram;               /* host/grammar.h */
typedef struct mf_gram_vocab mf_gram_vocab;   /* host/grammar.h */

/* The most top alternatives a request may ask per token (mf_batch_req.top_logprobs). */
#define MF_BATCH_MAX_LOGPROBS 20

/* Why a request ended. */
typedef enum mf_batch_finish {
    MF_BATCH_RUNNING = 0,
    MF_BATCH_EOS,         /* sampled eos_token_id (not part of the output) */
    MF_BATCH_STOP,        /* the output reached one of the stop strings (cut before it) */
    MF_BATCH_LENGTH,      /* max_tokens generated */
    MF_BATCH_CANCELLED,   /* mf_batch_cancel, or mf_batch_close with requests left */
    MF_BATCH_ERROR        /* the forward failed (event's err and msg) */
} mf_batch_finish;

const char *mf_batch_finish_name(mf_batch_finish f);   /* "eos", "stop", "length", ... */

typedef enum mf_batch_event_kind {
    MF_BATCH_TOKEN = 0,   /* a generated token (never EOS) */
    MF_BATCH_DONE,        /* the request ended; always the last event of a request */
    MF_BATCH_PROMPT       /* echo_logprobs: prompt token `pos` (1..n_prompt-1, in order) with its logprob */
} mf_batch_event_kind;

/* An event of one request, passed to on_event on the thread that calls mf_batch_step.
 * Pointers are valid during the callback only. */
typedef struct mf_batch_event {
    uint64_t id;                 /* from mf_batch_submit */
    void *user;                  /* the request's user pointer */
    mf_batch_event_kind kind;
    int32_t token;               /* TOKEN: the token; PROMPT: prompt[pos] */
    /* TOKEN: vocab_size logits it was sampled from (after logit_bias, penalties and a grammar's
     * mask; as the model gave them when the request has none) */
    const float *logits;
    /* TOKEN with logprobs, PROMPT, DONE "eos" with logprobs (token: EOS): the token's log-probability under the model's distribution
     * (log-softmax of the logits the forward gave, before logit_bias, penalties, grammar and
     * temperature) and the request's top_logprobs most probable tokens under it, most probable
     * first (ties: lower id first) */
    float logprob;
    const mf_logprob *top;
    int n_top;
    int has_logprob;             /* logprob and top are valid (also on DONE "eos": EOS's own) */
    int pos;                     /* PROMPT: the prompt position */
    /* Output text that became final with this event (with a tokenizer; else n_text 0): bytes
     * that might begin a stop string, or an unfinished UTF-8 character, are held back until they
     * cannot; DONE flushes what is left (cut before a matched stop string). */
    const char *text;
    size_t n_text;
    mf_batch_finish finish;      /* DONE: why */
    int n_prompt, n_gen;         /* prompt tokens; tokens generated so far */
    int n_cached;                /* prompt tokens restored from the prefix cache (not run) */
    /* mf_now_ns() (sched/clock.h) of submission, admission into the running set, the first
     * generated token (0 before it) and this event */
    int64_t submit_ns, admit_ns, first_ns, now_ns;
    int err;                     /* DONE with MF_BATCH_ERROR: the negative code */
    const char *msg;             /* and its message */
} mf_batch_event;

/* Items per step by default (mf_batch_opts.step_tokens), so a step's decode tokens never wait
 * behind a longer prefill chunk. A larger budget lets a lone prompt's prefill run as long chunks
 * (graphs/step/step.h mf_step_forward: the items of one sequence in chunks of up to
 * MF_STEP_MAX_CHUNK); steps of several sequences run in graphs of up to the engine's max_batch
 * items (mf_batch_step_items). */
#define MF_BATCH_STEP_TOKENS 64
#define MF_BATCH_MAX_BYPASS 16   /* mf_batch_opts.max_bypass's default */

typedef struct mf_batch_opts {
    mf_ref *ref;          /* the forward the states belong to (required) */
    mf_step *eng;         /* the scheduled engine over ref, or NULL: the reference forward */
    /* Runs the forwards instead of eng or ref when set, with the contract of mf_step_forward
     * (graphs/step/step.h) over ref's states: a pipeline's first stage (graphs/pipe/pipe.h
     * mf_pipe_forward, ctx its pipe). NULL: eng, else ref. */
    int (*forward)(void *ctx, mf_ref_state *const *states, const int32_t *tokens, int n, float *const *logits);
    void *forward_ctx;
    const mf_tok *tok;    /* for text and stop strings; NULL: token ids only (stops refused) */
    int max_batch;        /* running sequences, 1..MF_STEP_MAX_ITEMS (0: 16) */
    /* items per step (0: mf_batch_default_step_tokens(max_batch), MF_BATCH_STEP_TOKENS up to a
     * max_batch of 32): every running sequence's decode token
     * first, then prefill chunks in admission order fill what is left; at least 1 prefill item
     * per step when the decode tokens take the whole budget, so a prompt always makes progress */
    int step_tokens;
    /* prefilling sequences that share a step's prefill budget (0: 2): the first k = min(this,
     * prefilling) in admission order take ceil(left / k) each (what one leaves, the next take);
     * each sequence's chunk is one unit of the engine's per-item tasks, so k chunks run their
     * per-item parts in parallel. 1: the first takes all it can (earliest first token). */
    int prefill_split;
    int64_t max_context;  /* positions per state: prompt + max_tokens (0: min(model's, 4096)) */
    /* bytes all states may hold (0: no limit). A state holds a fixed part (the packed window ring) and
     * pages for the positions of the request it runs (graphs/ref/ref.h): a request is admitted
     * (in queue order, but see max_bypass) when a state is free and the bytes every state holds plus what it needs
     * (mf_batch_request_bytes: prompt + max_tokens positions) fit; it waits in the queue until
     * then (idle states give back their pages when that makes room; without a budget a state keeps
     * its pages for the next request). The pool holds min(max_batch, 1 + (budget - one state of
     * max_context) / the fixed part) states, so that a request of max_context always fits beside
     * idle states; a budget below one state of max_context is -ENOSPC. */
    uint64_t state_budget_bytes;
    /* admission past a queue head that does not fit the budget (0: MF_BATCH_MAX_BYPASS; -1: none,
     * strict FIFO): a free state takes the first request behind the head whose bytes fit, at most
     * this many times while that head waits; then no request starts ahead of it until it has. So
     * short requests use the room a long head leaves, and the head waits at most for the running
     * requests and these max_bypass ones to end. Without a budget the head always fits. */
    int max_bypass;
    int max_queue;        /* waiting requests (0: 256); one more is refused with -EAGAIN */
    /* The prefix cache (graphs/prefix/prefix.h; NULL: none), made over the same ref: a request
     * starts from the longest cached prefix of its prompt that leaves a token to run (the state's
     * need counts the full pages it maps as the cache's, not again), and inserts its blocks after
     * every forward and its last partial block at the prompt's end and when it ends. A request whose
     * prompt shares at least a block more than its hit with a running sequence's prompt that is
     * still prefilling that part waits (as one that does not fit the budget: others may pass it)
     * until it can restore it. An echo_logprobs request restores nothing (it needs every prompt
     * position's logits) but inserts its blocks. Numerics unchanged: logits after a hit are the bits of a run from
     * scratch (tests/test_prefix_batch.c). Not with spec yet (-EINVAL). */
    mf_prefix *prefix;
    /* prompt positions per step whose logits echo_logprobs requests may ask (0: none, such
     * requests are refused): a chunk of such a request is at most this long, and the batcher
     * holds this many rows of vocab_size floats (allocated at mf_batch_new). Other chunks ask
     * the engine for one row (their prompt's last position) as before. */
    int echo_rows;
    /* the tokenizer's vocabulary for constrained requests (mf_batch_req.grammar); NULL: they are
     * refused. Not owned; outlives the batcher. */
    const mf_gram_vocab *gram_vocab;
    void (*on_event)(void *user, const mf_batch_event *ev);
    void *user;           /* for on_event */
    /* Speculative decoding (graphs/step/spec.h, docs/dspark.md), or NULL: made for this batcher's
     * slots (mf_spec_new with n_slots max_batch; the same ref and engine), it outlives the batcher.
     * Each step's decode sequences then run their pending token and the round's candidates as one
     * unit of the forward (at most mf_batch_step_items(max_batch, step_tokens) decode items in all,
     * one graph run of an engine made for them, and no more candidates than a request may still
     * generate; not with a forward of its own), every forward hands out the draft's features, and a sequence
     * may produce several tokens per step (one TOKEN event each, with its own logits): the tokens
     * of greedy decoding are those without speculation, bit for bit, and sampled ones have the same
     * distribution. */
    struct mf_spec *spec;
} mf_batch_opts;

/* A logit bias: `bias` is added to token id's logit; <= -100 bans the token (its logit -inf). */
typedef struct mf_batch_bias {
    int32_t id;
    float bias;
} mf_batch_bias;

/* One request. Everything is copied by mf_batch_submit (the grammar is referenced: it must
 * outlive the request's DONE event). The logits a token is drawn from are the model's, then
 * logit_bias added, then the penalties, then the grammar's mask (-inf outside it), then the
 * sampler (graphs/step/sample.h: greedy, or temperature, top_k, top_p, min_p). Penalties (the
 * vLLM / llama.cpp meanings): repetition_penalty r divides a positive logit by r and multiplies a
 * negative one by r for every token that occurs in the prompt or the output so far (HF's CTRL
 * rule); frequency_penalty subtracts f x (the token's occurrences in the output so far),
 * presence_penalty subtracts p once for a token that occurs in the output (OpenAI's rule; prompt
 * tokens are not counted). Counts live in the sequence's slot (no per-step allocation). */
typedef struct mf_batch_req {
    const int32_t *prompt;
    int n_prompt;            /* >= 1 */
    int max_tokens;          /* >= 0 (0: prefill only); n_prompt + max_tokens <= max_context */
    double temperature;      /* <= 0: greedy */
    double top_p;            /* (0, 1] when sampling (0: 1) */
    uint64_t seed;
    int ignore_eos;
    const char *const *stop; /* n_stop strings (non-empty), needs opts.tok */
    int n_stop;
    void *user;
    int top_k;               /* >= 0 (0: all) */
    double min_p;            /* [0, 1] (0: off) */
    double presence_penalty, frequency_penalty;   /* [-2, 2] (0: off) */
    double repetition_penalty;                    /* (0, 2] (0 or 1: off) */
    const mf_batch_bias *bias;                    /* n_bias entries, ids in the vocabulary */
    int n_bias;
    int logprobs;            /* 1: TOKEN events carry logprob and top (top_logprobs of them) */
    int top_logprobs;        /* 0..MF_BATCH_MAX_LOGPROBS */
    /* 1: PROMPT events for prompt positions 1..n_prompt-1 (the logprob of each prompt token given
     * those before it; top_logprobs alternatives), from the prefill (needs opts.echo_rows) */
    int echo_logprobs;
    /* constrained decoding (needs opts.gram_vocab): every token keeps the output a prefix of the
     * grammar's language; EOS only once it is complete, and the request ends (MF_BATCH_STOP) with
     * the token that completes it. Greedy requests try the best token first and compute the
     * grammar's mask only when it does not fit. */
    const mf_gram *grammar;
} mf_batch_req;

/* The step budget for max_batch running sequences when none is given (mf_batch_opts.step_tokens 0;
 * `moeflow decode --prompts`): 2 x max_batch, at least MF_BATCH_STEP_TOKENS, at most
 * MF_STEP_MAX_ITEMS: the running sequences' decode tokens and as many prompt tokens, so prompts
 * about as long as their outputs keep the batch decoding (a budget below the batch leaves the
 * prompts what the decode tokens do not take: at 256 running sequences and 64, one token a step). */
int mf_batch_default_step_tokens(int max_batch);

/* The most items a step holds with max_batch running sequences and a budget of step_tokens (0:
 * mf_batch_default_step_tokens): max(max_batch, step_tokens), at most MF_STEP_MAX_ITEMS (a step's decode
 * tokens and prefill chunks fill the budget; decode tokens alone its running sequences). What the
 * engine's mf_step_opts.max_batch should be for every step to run as one graph. */
int mf_batch_step_items(int max_batch, int step_tokens);

/* Bytes of one state of max_context positions (the most a request may need). */
int64_t mf_batch_state_bytes(const mf_batch *b);
/* Bytes the state of a request of n_prompt + max_tokens positions holds (what the budget counts). */
int64_t mf_batch_request_bytes(const mf_batch *b, int n_prompt, int max_tokens);

/* Allocates the pool (states, samplers, logits rows, step arrays). -EINVAL on bad options,
 * -ENOSPC when the budget holds no state, -ENOMEM. */
int mf_batch_new(const mf_batch_opts *opts, mf_batch **out);
/* Cancels what is left (DONE events with MF_BATCH_CANCELLED, on the calling thread) and frees. */
void mf_batch_free(mf_batch *b);

/* Queues a request (thread-safe). *id (may be NULL) receives its id, never 0. Fails with
 * -EINVAL (message names the field: prompt empty or out of the vocabulary, max_tokens, the
 * context limit, sampling values, stops without a tokenizer), -EAGAIN when max_queue requests
 * already wait, -ESHUTDOWN after mf_batch_shutdown, -ENOMEM. */
int mf_batch_submit(mf_batch *b, const mf_batch_req *req, uint64_t *id);

/* Cancels a queued or running request (thread-safe): it gets its DONE (MF_BATCH_CANCELLED) from
 * the next mf_batch_step and its state is free from then on. -ENOENT when no such request is left. */
int mf_batch_cancel(mf_batch *b, uint64_t id);

/* Refuses submissions from now on (thread-safe) and wakes mf_batch_wait. */
void mf_batch_shutdown(mf_batch *b);

/* Blocks until there is work (queued or running requests or pending cancels), shutdown, or
 * timeout_ns passes (< 0: no limit). Returns 1 when there is work, else 0. Thread-safe. */
int mf_batch_wait(mf_batch *b, int64_t timeout_ns);

/* One step (one caller thread at a time): admits queued requests into free states, delivers
 * cancellations, runs one forward, samples, and calls on_event. *n_items (may be NULL) receives
 * the items run (0: nothing to do). A failed forward ends the requests of that step with
 * MF_BATCH_ERROR (their states are reset) and returns its code; the batcher stays usable. */
int mf_batch_step(mf_batch *b, int *n_items);

typedef struct mf_batch_stats {
    int queued, running, n_states;
    int64_t steps, items, prefill_items, decode_items, generated;
    int64_t completed, cancelled, refused;
    int64_t state_bytes_held;   /* what all states hold, as of the last admission */
    int64_t bypassed;           /* requests admitted ahead of a queue head that did not fit (max_bypass) */
    int64_t cached_tokens;      /* prompt tokens restored from the prefix cache */
} mf_batch_stats;

void mf_batch_get_stats(mf_batch *b, mf_batch_stats *out);   /* thread-safe */

/* The user pointer of the running request whose state is `state` (a hook's `seq`), or NULL. For
 * debug hooks during mf_batch_step. */
void *mf_batch_state_user(const mf_batch *b, const void *state);

#endif
