/* Runs an engine the way the placement tests compare them (tests/test_place_dense.c,
 * tests/test_micro.c): n_seq sequences prefilled with their prompts, then n_dec decode steps
 * teacher-forced by toks (with fill: toks written from the logits first: greedy), every call's
 * logits kept. */
#ifndef MF_TEST_STEP_RUN_H
#define MF_TEST_STEP_RUN_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/ref/ref.h"
#include "device/dev.h"
#include "graphs/step/step.h"

#define MF_TEST_RUN_MAX_SEQ 64
#define MF_TEST_RUN_MAX_PROMPT 256

/* Tasks of graph sg but those that grow with a long chunk by design: the Engram wkv's blocks of
 * eg_block items, the index score parts (key_parts) and the compressor's item ranges
 * (graphs/step/stepgraph.h): what the item groups keep bounded. */
static inline int mf_test_fixed_tasks(const mf_stepgraph *sg)
{
    int n = 0;
    for (int t = 0; t < sg->n_tasks; t++) {
        const mf_sg_task *r = &sg->task[t];
        n += r->op != MF_SG_ENGRAM_ROWS && r->op != MF_SG_ATTN_SCORE && !(r->op == MF_SG_ATTN_KV && r->part == 1);
    }
    return n;
}

/* The placement tests' emulated cards: n_cards of them with the same link figures (50 GB/s, 2 us a
 * copy); the spec written into spec[cap] for the caller's messages. */
static inline int mf_test_emu_open(int n_cards, char *spec, size_t cap, mf_dev **d)
{
    snprintf(spec, cap, "emu:%d,bw=50e9,lat_ns=2000", n_cards);
    return mf_dev_open(spec, d);
}

/* prompt(s, i): token i of sequence s's n_prompt-token prompt. out: n_seq x (1 + n_dec) x V,
 * sequence s's prefill logits then one row per decode step. 0 or the engine's error. */
static inline int mf_test_run_steps(mf_ref *r, mf_step *e, int64_t V, int n_seq, int n_prompt,
                             int32_t (*prompt)(int s, int i), int n_dec, int32_t *toks, int fill, float *out)
{
    mf_ref_state *st[MF_TEST_RUN_MAX_SEQ] = {0};
    if (n_seq > MF_TEST_RUN_MAX_SEQ || n_prompt > MF_TEST_RUN_MAX_PROMPT) return -EINVAL;
    int rc = 0, nl = 1 + n_dec;
    for (int s = 0; s < n_seq && !rc; s++) {
        int32_t p[MF_TEST_RUN_MAX_PROMPT];
        for (int i = 0; i < n_prompt; i++) p[i] = prompt(s, i);
        rc = mf_ref_state_new(r, n_prompt + n_dec + 1, &st[s]);
        if (!rc) rc = mf_step_prefill(e, st[s], p, n_prompt, out + (size_t)s * nl * V);
    }
    float *step = malloc(sizeof(float) * (size_t)n_seq * V);
    if (!step && !rc) rc = -ENOMEM;
    for (int k = 0; k < n_dec && !rc; k++) {
        int32_t tok[MF_TEST_RUN_MAX_SEQ];
        for (int s = 0; s < n_seq; s++) {
            if (fill) {
                const float *prev = out + ((size_t)s * nl + k) * V;
                int b = 0;
                for (int64_t i = 1; i < V; i++)
                    if (prev[i] > prev[b]) b = (int)i;
                toks[s * n_dec + k] = b;
            }
            tok[s] = toks[s * n_dec + k];
        }
        rc = mf_step_decode(e, st, tok, n_seq, step);
        for (int s = 0; s < n_seq && !rc; s++)
            memcpy(out + ((size_t)s * nl + k + 1) * V, step + (size_t)s * V, sizeof(float) * V);
    }
    free(step);
    for (int s = 0; s < n_seq; s++) mf_ref_state_free(st[s]);
    return rc;
}

#endif
