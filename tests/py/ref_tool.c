/* Drives the reference forward for tests/py/check_ref.py and tests/conformance/model:
 * ref_tool DIR IDS OUT_PREFIX [act_quant [tok|notok [GEN [ENGINE]]]] runs tokens IDS (comma
 * separated) through one layer-major forward, then, with GEN > 0, greedily decodes GEN more tokens
 * one mf_ref_decode step at a time (each step feeds the argmax of the previous position's logits,
 * ties to the lower id). ENGINE "ref" (default) is the reference forward; "step" and "step-exact"
 * run the same prefill and decode steps (mf_step_forward, mf_step_decode) on the scheduled engine
 * (graphs/step/step.h, 2 workers) with its default int8 experts or with --exact's fp32 kernels.
 * Over all T = len(IDS) + GEN positions it writes OUT_PREFIX.tokens (i32 [T]: IDS, then the
 * greedy tokens), OUT_PREFIX.logits (f32 [T, vocab]), OUT_PREFIX.routes
 * (i32 [T, layers, experts_per_tok]), OUT_PREFIX.select (i32 [T, layers, index_topk], -1
 * padded; compressed entries attended) and OUT_PREFIX.cand (i32 [T, candidate_topk_blocks], -1
 * padded; candidate blocks kept at the candidate layer; absent without one). With "tok" the
 * Engram token map is built from DIR/tokenizer.json as `moeflow decode` does (else the
 * placeholder map) and written to OUT_PREFIX.tokmap (i32 [vocab of the tokenizer]). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/model/engram_map.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/step.h"
#include "host/tokenizer.h"
#include "sched/error.h"

typedef struct rec {
    int n_layers, k, topk, ncand;
    int32_t *routes, *sel, *cand;
} rec;

static void on_route(void *u, const void *seq, int64_t pos, int layer, const int32_t *e,
                     const float *w, int n)
{
    rec *r = u;
    memcpy(r->routes + (pos * r->n_layers + layer) * r->k, e, sizeof *e * (size_t)n);
}

static void on_select(void *u, const void *seq, int64_t pos, int layer, const int32_t *e, int n)
{
    rec *r = u;
    memcpy(r->sel + (pos * r->n_layers + layer) * r->topk, e, sizeof *e * (size_t)n);
}

static void on_candidates(void *u, const void *seq, int64_t pos, int layer, const int32_t *b,
                          int n)
{
    rec *r = u;
    memcpy(r->cand + pos * r->ncand, b, sizeof *b * (size_t)n);
}

static int dump(const char *prefix, const char *ext, const void *p, size_t n)
{
    char path[4096];
    snprintf(path, sizeof path, "%s.%s", prefix, ext);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n || fclose(f)) {
        fprintf(stderr, "ref_tool: cannot write %s\n", path);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: ref_tool DIR IDS OUT_PREFIX "
                        "[act_quant [tok|notok [GEN [ref|step|step-exact]]]]\n");
        return 2;
    }
    int32_t toks[4096];
    int n_prompt = 0;
    for (char *p = argv[2]; *p && n_prompt < 4096;) {
        toks[n_prompt++] = (int32_t)strtol(p, &p, 10);
        while (*p == ',') p++;
    }
    int gen = argc > 6 ? atoi(argv[6]) : 0;
    if (n_prompt < 1 || gen < 0 || gen > 4096 - n_prompt) {
        fprintf(stderr, "ref_tool: need 1..4096 tokens in all (prompt %d, GEN %s)\n", n_prompt,
                argc > 6 ? argv[6] : "0");
        return 2;
    }
    int n = n_prompt + gen;
    const char *engine = argc > 7 ? argv[7] : "ref";
    int step = !strcmp(engine, "step") || !strcmp(engine, "step-exact");
    if (!step && strcmp(engine, "ref")) {
        fprintf(stderr, "ref_tool: engine '%s' (expected ref, step or step-exact)\n", engine);
        return 2;
    }
    mf_model *m;
    if (mf_model_load(argv[1], &(mf_model_opts){.quiet = 1}, &m)) {
        fprintf(stderr, "ref_tool: %s\n", mf_last_error());
        return 1;
    }
    const mf_config *c = mf_model_config(m);
    int has_cand = c->candidate_source_layer_id >= 0;
    rec r = {c->n_layers, c->n_experts_per_tok, c->index_topk,
             has_cand ? c->candidate_topk_blocks : 1, NULL, NULL, NULL};
    r.routes = malloc(sizeof(int32_t) * (size_t)n * r.n_layers * r.k);
    r.sel = malloc(sizeof(int32_t) * (size_t)n * r.n_layers * r.topk);
    float *logits = malloc(sizeof(float) * (size_t)n * c->vocab_size);
    float **lg = malloc(sizeof *lg * (size_t)n);
    mf_ref_state **st = malloc(sizeof *st * (size_t)n);
    r.cand = malloc(sizeof(int32_t) * (size_t)n * r.ncand);
    memset(r.sel, 0xff, sizeof(int32_t) * (size_t)n * r.n_layers * r.topk);
    memset(r.cand, 0xff, sizeof(int32_t) * (size_t)n * r.ncand);
    mf_ref_opts o = {.act_quant = argc > 4 && atoi(argv[4]),
                     .hooks = {.user = &r, .on_route = on_route, .on_select = on_select,
                               .on_candidates = on_candidates}};
    mf_tok *tok = NULL;
    mf_engram_map *emap = NULL;
    if (argc > 5 && !strcmp(argv[5], "tok")) {
        char tpath[4096];
        snprintf(tpath, sizeof tpath, "%s/tokenizer.json", argv[1]);
        if (mf_tok_load(tpath, &tok) || mf_engram_map_build(tok, &emap)) {
            fprintf(stderr, "ref_tool: %s\n", mf_last_error());
            return 1;
        }
        o.token_map = mf_engram_map_ids(emap);
        o.n_token_map = mf_engram_map_n_vocab(emap);
        if (dump(argv[3], "tokmap", o.token_map, sizeof(int32_t) * (size_t)o.n_token_map)) return 1;
    }
    mf_ref *ref;
    mf_ref_state *s;
    mf_step *eng = NULL;
    if (mf_ref_new(m, &o, &ref) || mf_ref_state_new(ref, n, &s) ||
        (step && mf_step_new(ref, &(mf_step_opts){.n_threads = 2,
                                                   .exact = !strcmp(engine, "step-exact")},
                             &eng))) {
        fprintf(stderr, "ref_tool: %s\n", mf_last_error());
        return 1;
    }
    for (int i = 0; i < n; i++) st[i] = s, lg[i] = logits + (size_t)i * c->vocab_size;
    if (eng ? mf_step_forward(eng, st, toks, n_prompt, lg)
            : mf_ref_forward(ref, st, toks, n_prompt, lg)) {
        fprintf(stderr, "ref_tool: %s\n", mf_last_error());
        return 1;
    }
    for (int i = n_prompt; i < n; i++) {   /* greedy: the argmax of position i-1 */
        const float *prev = lg[i - 1];
        int32_t best = 0;
        for (int32_t v = 1; v < c->vocab_size; v++)
            if (prev[v] > prev[best]) best = v;
        toks[i] = best;
        if (eng ? mf_step_decode(eng, &s, &toks[i], 1, lg[i])
                : mf_ref_decode(ref, &s, &toks[i], 1, lg[i])) {
            fprintf(stderr, "ref_tool: decode step %d: %s\n", i - n_prompt, mf_last_error());
            return 1;
        }
    }
    int rc = dump(argv[3], "tokens", toks, sizeof(int32_t) * (size_t)n) ||
             dump(argv[3], "logits", logits, sizeof(float) * (size_t)n * c->vocab_size) ||
             dump(argv[3], "routes", r.routes, sizeof(int32_t) * (size_t)n * r.n_layers * r.k) ||
             dump(argv[3], "select", r.sel, sizeof(int32_t) * (size_t)n * r.n_layers * r.topk) ||
             (has_cand && dump(argv[3], "cand", r.cand, sizeof(int32_t) * (size_t)n * r.ncand));
    mf_step_free(eng);
    mf_ref_state_free(s);
    mf_ref_free(ref);
    mf_model_free(m);
    mf_engram_map_free(emap);
    mf_tok_free(tok);
    free(logits);
    free(lg);
    free(st);
    free(r.routes);
    free(r.sel);
    free(r.cand);
    return rc;
}
