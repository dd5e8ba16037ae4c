/* `moeflow bench serve`'s multi-turn workload (tools/bench_serve_turns.c), run by tools/bench_serve.c
 * with --turns. Private to the command. */
#ifndef MF_TOOLS_BENCH_SERVE_H
#define MF_TOOLS_BENCH_SERVE_H

#include <stdint.h>

#include "graphs/ref/ref.h"
#include "graphs/step/step.h"

typedef struct mf_bt_opts {
    mf_ref *r;
    mf_step *e;
    int n_conv, conc, turns, system_tokens;   /* conversations, clients, turns each, shared system prompt */
    int user_lo, user_hi, reply_lo, reply_hi; /* a turn's new user tokens and reply tokens (seeded draws) */
    int step_tokens, warmup, json, block;     /* block: the prefix cache's (0: MF_PREFIX_BLOCK) */
    uint64_t cache_bytes, seed;
    int64_t ctx;                              /* set by mf_bench_serve_turns: the longest conversation */
} mf_bt_opts;

/* Runs the conversations with the prefix cache and without (alternating, after o->warmup untimed
 * pairs) and prints the table or JSON. 0, or a negative code (mf_error), also when the two modes'
 * replies differ. */
int mf_bench_serve_turns(const mf_bt_opts *o);

#endif
