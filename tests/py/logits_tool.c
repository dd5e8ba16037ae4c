/* Dumps the logits of a fixed list of engine settings, for checking that a change meant to keep
 * behaviour (a refactor, a new option left off) gives the same bits as the commit before it:
 * `tools/logits-check.sh BASE` builds BASE's library beside this tree, links this program against
 * both and compares the files byte for byte. Uses the public engine API only (graphs/step/step.h,
 * graphs/ref/ref.h), so the same source builds against an older library.
 *
 * logits_tool DIR PRESET OUTDIR [NAME]: for each setting of PRESET's list (tiny or demo) writes
 * OUTDIR/<preset>-<setting>.f32: per sequence its prefill's last logits and one row per greedy
 * decode step (f32 [n_seq, 1 + n_dec, vocab]), the greedy tokens chosen from the logits (ties to
 * the lower id). With NAME, only that setting. Prints one line per setting; exit 1 on an error. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/dev.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/step.h"
#include "sched/error.h"

typedef struct setting {
    const char *name;
    int ref;                  /* 1: the reference forward instead of the engine */
    int threads, exact, n_seq, n_prompt, n_dec, chunk, micro;
    int cards, placement, dense, dense_split, dev_graphs, heads;
    int streamed;             /* the model's expert store, streamed under a small budget */
    int n_sockets;            /* > 1: sockets on a synthetic topology */
} setting;

#define TOPO "package:2 numa:1 core:1 pu:1"

static const setting g_tiny[] = {
    {"ref", 1, 0, 0, 1, 40, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {"ref-batch3", 1, 0, 0, 3, 9, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {"host-1t", 0, 1, 0, 1, 40, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {"host-2t", 0, 2, 0, 1, 40, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {"host-exact", 0, 2, 1, 1, 40, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {"host-chunk7", 0, 2, 0, 1, 40, 4, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {"host-batch5", 0, 2, 0, 5, 11, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {"host-batch16-micro2", 0, 2, 0, 16, 5, 4, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0},
    {"seed-emu2", 0, 2, 0, 3, 20, 5, 0, 0, 2, MF_STEP_PLACE_SEED, 0, 0, 0, 0, 0, 0},
    {"seed-emu2-graphs", 0, 2, 0, 3, 20, 5, 0, 0, 2, MF_STEP_PLACE_SEED, 0, 0, 1, 0, 0, 0},
    {"hybrid-emu2", 0, 2, 0, 4, 20, 5, 0, 0, 2, MF_STEP_PLACE_HYBRID, 0, 0, 0, 0, 0, 0},
    {"dense-rows-emu2", 0, 2, 0, 2, 30, 5, 0, 0, 2, MF_STEP_PLACE_HYBRID, MF_STEP_DENSE_CARDS, MF_SG_SPLIT_ROWS, 0,
     0, 0, 0},
    {"dense-layers-emu2", 0, 2, 0, 2, 30, 5, 0, 0, 2, MF_STEP_PLACE_HOST, MF_STEP_DENSE_CARDS, MF_SG_SPLIT_LAYERS, 0,
     0, 0, 0},
    {"dense-heads-emu2", 0, 2, 0, 1, 60, 4, 16, 0, 2, MF_STEP_PLACE_SEED, MF_STEP_DENSE_CARDS, MF_SG_SPLIT_ROWS, 0,
     MF_SG_HEADS_CARDS, 0, 0},
    {"dense-micro2-emu2", 0, 2, 0, 6, 8, 4, 0, 2, 2, MF_STEP_PLACE_HYBRID, MF_STEP_DENSE_CARDS, MF_SG_SPLIT_ROWS, 0,
     0, 0, 0},
    {"streamed", 0, 2, 0, 3, 20, 5, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0},
    {"sockets2", 0, 2, 0, 2, 20, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2},
};

static const setting g_demo[] = {
    {"host-2t", 0, 2, 0, 1, 600, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {"host-batch8", 0, 2, 0, 8, 24, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {"hybrid-dense-emu2", 0, 2, 0, 2, 80, 4, 0, 0, 2, MF_STEP_PLACE_HYBRID, MF_STEP_DENSE_CARDS, MF_SG_SPLIT_ROWS, 0,
     0, 0, 0},
};

static int64_t g_V;

static int32_t prompt_tok(int s, int i) { return (int32_t)((i * 53 + s * 97 + (i * s) % 11 + 3) % g_V); }

static int argmax(const float *x)
{
    int b = 0;
    for (int64_t i = 1; i < g_V; i++)
        if (x[i] > x[b]) b = (int)i;
    return b;
}

/* Prefill every sequence, then n_dec greedy steps of all at once; out [n_seq, 1 + n_dec, V]. */
static int run(mf_ref *r, mf_step *e, const setting *x, float *out)
{
    int nl = 1 + x->n_dec, rc = 0;
    mf_ref_state **st = calloc((size_t)x->n_seq, sizeof *st);
    int32_t *p = malloc(sizeof(int32_t) * (size_t)x->n_prompt), *tok = malloc(sizeof(int32_t) * (size_t)x->n_seq);
    float *step = malloc(sizeof(float) * (size_t)x->n_seq * g_V);
    if (!st || !p || !tok || !step) rc = -ENOMEM;
    for (int s = 0; s < x->n_seq && !rc; s++) {
        for (int i = 0; i < x->n_prompt; i++) p[i] = prompt_tok(s, i);
        rc = mf_ref_state_new(r, x->n_prompt + x->n_dec + 1, &st[s]);
        float *o = out + (size_t)s * nl * g_V;
        if (!rc) rc = e ? mf_step_prefill(e, st[s], p, x->n_prompt, o) : mf_ref_prefill(r, st[s], p, x->n_prompt, o);
    }
    for (int k = 0; k < x->n_dec && !rc; k++) {
        for (int s = 0; s < x->n_seq; s++) tok[s] = argmax(out + ((size_t)s * nl + k) * g_V);
        rc = e ? mf_step_decode(e, st, tok, x->n_seq, step) : mf_ref_decode(r, st, tok, x->n_seq, step);
        for (int s = 0; s < x->n_seq && !rc; s++)
            memcpy(out + ((size_t)s * nl + k + 1) * g_V, step + (size_t)s * g_V, sizeof(float) * g_V);
    }
    for (int s = 0; st && s < x->n_seq; s++) mf_ref_state_free(st[s]);
    free(st);
    free(p);
    free(tok);
    free(step);
    return rc;
}

static int one(const char *dir, const char *preset, const char *outdir, const setting *x)
{
    mf_model *m = NULL;
    mf_ref *r = NULL;
    mf_dev *d = NULL;
    mf_step *e = NULL;
    mf_model_opts mo = {.quiet = 1, .n_sockets = x->n_sockets};
    if (x->streamed) {
        mo.store = MF_MODEL_STORE_STREAMED;
        mo.store_budget_bytes = 64ull << 20;
    }
    int rc = mf_model_load(dir, &mo, &m);
    if (!rc) rc = mf_ref_new(m, NULL, &r);
    if (!rc && x->cards) {
        char spec[64];
        snprintf(spec, sizeof spec, "emu:%d,bw=50e9,lat_ns=2000", x->cards);
        rc = mf_dev_open(spec, &d);
    }
    if (!rc && !x->ref) {
        mf_step_opts o = {.n_threads = x->threads, .exact = x->exact, .prefill_chunk = x->chunk, .micro = x->micro,
                          .dev = d, .placement = x->placement, .dense = x->dense, .dense_split = x->dense_split,
                          .dev_graphs = x->dev_graphs, .heads = x->heads, .n_sockets = x->n_sockets,
                          .topology = x->n_sockets > 1 ? TOPO : NULL};
        rc = mf_step_new(r, &o, &e);
    }
    size_t n = (size_t)x->n_seq * (1 + x->n_dec) * (size_t)g_V;
    float *out = rc ? NULL : calloc(n, sizeof(float));
    if (!rc && !out) rc = -ENOMEM;
    if (!rc) rc = run(r, e, x, out);
    if (!rc) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s-%s.f32", outdir, preset, x->name);
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(out, sizeof(float), n, f) != n) rc = -EIO;
        if (f && fclose(f)) rc = -EIO;
        if (!rc) printf("%s-%s: %zu logits\n", preset, x->name, n);
    }
    if (rc) fprintf(stderr, "%s-%s: %s (%d)\n", preset, x->name, mf_last_error(), rc);
    free(out);
    mf_step_free(e);
    mf_dev_close(d);
    mf_ref_free(r);
    mf_model_free(m);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc < 4) {
        fprintf(stderr, "usage: logits_tool DIR tiny|demo OUTDIR [SETTING]\n");
        return 2;
    }
    int tiny = !strcmp(argv[2], "tiny");
    const setting *set = tiny ? g_tiny : g_demo;
    int n = tiny ? (int)(sizeof g_tiny / sizeof *g_tiny) : (int)(sizeof g_demo / sizeof *g_demo);
    mf_model *m = NULL;
    if (mf_model_load(argv[1], &(mf_model_opts){.quiet = 1, .resident_limit_bytes = MF_MODEL_ALL_LAZY}, &m)) {
        fprintf(stderr, "%s: %s\n", argv[1], mf_last_error());
        return 1;
    }
    g_V = mf_model_config(m)->vocab_size;
    mf_model_free(m);
    int bad = 0, ran = 0;
    for (int k = 0; k < n; k++)
        if (argc < 5 || !strcmp(argv[4], set[k].name)) {
            bad |= one(argv[1], argv[2], argv[3], &set[k]) != 0;
            ran++;
        }
    if (!ran) fprintf(stderr, "no setting %s\n", argv[4]);
    return bad || !ran;
}
