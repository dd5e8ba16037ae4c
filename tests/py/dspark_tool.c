/* Drives the DSpark draft's reference (graphs/ref/ref.h mf_ref_draft_*) for
 * tests/conformance/dspark/check_dspark.py: dspark_tool DIR IDS ANCHORS OUT_PREFIX loads DIR with
 * its draft, runs tokens IDS (comma separated, T of them) through one prefill of the reference
 * forward with the Engram token map of DIR/tokenizer.json, and writes OUT_PREFIX.feats (f32 [T,
 * n_target, hidden]: the draft's features of every position), OUT_PREFIX.routes (i32 [T, layers,
 * top-k]), .select (i32 [T, layers, index_topk], -1 padded) and .cand (i32 [T,
 * candidate_topk_blocks], -1 padded) of the backbone, as ref_tool does. Then for each anchor a of
 * ANCHORS (comma separated, 1 <= a < T) one draft state is fed positions 0..a-1 (every anchor from
 * the same state, fed on and rolled back where it can) and proposes dspark_block_size candidates
 * after token IDS[a]: OUT_PREFIX.draft_tokens (i32 [A, B]), .draft_conf (f32 [A, B]: confidence
 * logits), .draft_logits (f32 [A, B, vocab]), .draft_routes (i32 [A, stages, B, draft top-k]). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/model/engram_map.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "host/tokenizer.h"
#include "sched/error.h"

typedef struct rec {
    int n_layers, k, topk, ncand;
    int32_t *routes, *sel, *cand;
} rec;

static void on_route(void *u, const void *seq, int64_t pos, int layer, const int32_t *e, const float *w, int n)
{
    rec *r = u;
    memcpy(r->routes + (pos * r->n_layers + layer) * r->k, e, sizeof *e * (size_t)n);
}

static void on_select(void *u, const void *seq, int64_t pos, int layer, const int32_t *e, int n)
{
    rec *r = u;
    memcpy(r->sel + (pos * r->n_layers + layer) * r->topk, e, sizeof *e * (size_t)n);
}

static void on_candidates(void *u, const void *seq, int64_t pos, int layer, const int32_t *b, int n)
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
        fprintf(stderr, "dspark_tool: cannot write %s\n", path);
        return 1;
    }
    return 0;
}

static int parse_ints(const char *s, int32_t *out, int cap)
{
    int n = 0;
    for (char *p = (char *)s; *p && n < cap;) {
        out[n++] = (int32_t)strtol(p, &p, 10);
        while (*p == ',') p++;
    }
    return n;
}

static int fail(void)
{
    fprintf(stderr, "dspark_tool: %s\n", mf_last_error());
    return 1;
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: dspark_tool DIR IDS ANCHORS OUT_PREFIX\n");
        return 2;
    }
    static int32_t ids[4096], anchors[256];
    int T = parse_ints(argv[2], ids, 4096), A = parse_ints(argv[3], anchors, 256);
    for (int k = 0; k < A; k++)
        if (anchors[k] < 1 || anchors[k] >= T) {
            fprintf(stderr, "dspark_tool: anchor %d outside [1, %d)\n", anchors[k], T);
            return 2;
        }
    mf_model *m;
    if (mf_model_load(argv[1], &(mf_model_opts){.quiet = 1, .load_draft = 1}, &m)) return fail();
    const mf_config *c = mf_model_config(m);
    int has_cand = c->candidate_source_layer_id >= 0, B = c->dspark_block_size, S = c->n_mtp_layers;
    int K = c->dspark_num_experts_per_tok;
    int64_t V = c->vocab_size, per = (int64_t)c->n_dspark_target * c->hidden_size;
    rec r = {c->n_layers, c->n_experts_per_tok, c->index_topk, has_cand ? c->candidate_topk_blocks : 1, NULL, NULL, NULL};
    r.routes = malloc(sizeof(int32_t) * (size_t)T * r.n_layers * r.k);
    r.sel = malloc(sizeof(int32_t) * (size_t)T * r.n_layers * r.topk);
    r.cand = malloc(sizeof(int32_t) * (size_t)T * r.ncand);
    memset(r.sel, 0xff, sizeof(int32_t) * (size_t)T * r.n_layers * r.topk);
    memset(r.cand, 0xff, sizeof(int32_t) * (size_t)T * r.ncand);
    char tpath[4096];
    snprintf(tpath, sizeof tpath, "%s/tokenizer.json", argv[1]);
    mf_tok *tok = NULL;
    mf_engram_map *emap = NULL;
    if (mf_tok_load(tpath, &tok) || mf_engram_map_build(tok, &emap)) return fail();
    mf_ref_opts o = {.token_map = mf_engram_map_ids(emap), .n_token_map = mf_engram_map_n_vocab(emap),
                     .hooks = {.user = &r, .on_route = on_route, .on_select = on_select, .on_candidates = on_candidates}};
    mf_ref *ref;
    mf_ref_state *s;
    if (mf_ref_new(m, &o, &ref) || mf_ref_state_new(ref, T, &s)) return fail();
    float *feats = malloc(sizeof(float) * (size_t)(T * per));
    float **fp = malloc(sizeof *fp * (size_t)T);
    mf_ref_state **st = malloc(sizeof *st * (size_t)T);
    for (int i = 0; i < T; i++) st[i] = s, fp[i] = feats + i * per;
    if (mf_ref_forward_feat(ref, st, ids, T, NULL, fp)) return fail();
    /* the proposals: anchors in the order given, one state fed forward (and back, as far as a
     * rollback reaches; else a fresh feed) */
    mf_ref_draft *d;
    mf_ly_draft_state *ds;
    if (mf_ref_draft_new(ref, &d) || mf_ref_draft_state_new(d, &ds)) return fail();
    int32_t *dtok = malloc(sizeof(int32_t) * (size_t)A * B), *droutes = malloc(sizeof(int32_t) * (size_t)A * S * B * K);
    float *dconf = malloc(sizeof(float) * (size_t)A * B), *dlog = malloc(sizeof(float) * (size_t)A * B * V);
    for (int k = 0; k < A; k++) {
        int64_t a = anchors[k];
        if (a < ds->n_pos && mf_ref_draft_rollback(ds, c, a)) ds->n_pos = 0;   /* too far back: from scratch */
        if (mf_ref_draft_feed(d, ds, feats + ds->n_pos * per, (int)(a - ds->n_pos)) ||
            mf_ref_draft_propose(d, ds, ids[a], B, dtok + k * B, dconf + k * B, dlog + (int64_t)k * B * V,
                                 droutes + (int64_t)k * S * B * K))
            return fail();
    }
    int rc = dump(argv[4], "feats", feats, sizeof(float) * (size_t)(T * per)) ||
             dump(argv[4], "routes", r.routes, sizeof(int32_t) * (size_t)T * r.n_layers * r.k) ||
             dump(argv[4], "select", r.sel, sizeof(int32_t) * (size_t)T * r.n_layers * r.topk) ||
             (has_cand && dump(argv[4], "cand", r.cand, sizeof(int32_t) * (size_t)T * r.ncand)) ||
             dump(argv[4], "draft_tokens", dtok, sizeof(int32_t) * (size_t)A * B) ||
             dump(argv[4], "draft_conf", dconf, sizeof(float) * (size_t)A * B) ||
             dump(argv[4], "draft_logits", dlog, sizeof(float) * (size_t)A * B * V) ||
             dump(argv[4], "draft_routes", droutes, sizeof(int32_t) * (size_t)A * S * B * K);
    mf_ref_draft_state_free(ds);
    mf_ref_draft_free(d);
    mf_ref_state_free(s);
    mf_ref_free(ref);
    mf_model_free(m);
    mf_engram_map_free(emap);
    mf_tok_free(tok);
    free(feats), free(fp), free(st), free(dtok), free(droutes), free(dconf), free(dlog);
    free(r.routes), free(r.sel), free(r.cand);
    return rc;
}
