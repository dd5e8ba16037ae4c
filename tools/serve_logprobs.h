/* `moeflow serve`'s logprobs objects (docs/serve.md "Logprobs"): a choice keeps one entry per token
 * (the prompt's with echo, then the generated ones), and these functions write them in OpenAI's
 * shapes: chat's {"content": [{token, logprob, bytes, top_logprobs}]} and the legacy completions
 * {tokens, token_logprobs, top_logprobs, text_offset}. Values are the model's distribution
 * (graphs/step/batch.h mf_batch_event.logprob). */
#ifndef MF_TOOLS_SERVE_LOGPROBS_H
#define MF_TOOLS_SERVE_LOGPROBS_H

#include <jansson.h>
#include <stdint.h>

#include "graphs/step/sample.h"
#include "tools/serve_req.h"

typedef struct mf_tok mf_tok;

/* One token's entry: has 0 for the prompt's first token (no logprob: null). */
typedef struct mf_lp_entry {
    int32_t tok;
    float lp;
    uint8_t has, n_top;
    mf_logprob top[MF_SERVE_MAX_LOGPROBS];
} mf_lp_entry;

/* A growing list of entries (amortized). */
typedef struct mf_lp_list {
    mf_lp_entry *e;
    int n, cap;
} mf_lp_list;

/* Appends an entry (tok, lp and the first n_top of top; has 0: no logprob). 0 or -ENOMEM. */
int mf_lp_add(mf_lp_list *l, int32_t tok, int has, float lp, const mf_logprob *top, int n_top);
void mf_lp_free(mf_lp_list *l);

/* Chat: {"content": [...]} of entries e[0..n). */
json_t *mf_lp_chat(const mf_tok *tok, const mf_lp_entry *e, int n);
/* Completions: the legacy object of e[0..n); text_offset counts characters from *offset (which
 * it advances, for a stream's next chunk). Each top_logprobs dict holds the top alternatives
 * and the chosen token (vLLM's shape: up to logprobs + 1 entries). */
json_t *mf_lp_completion(const mf_tok *tok, const mf_lp_entry *e, int n, int64_t *offset);

#endif
