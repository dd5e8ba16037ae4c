/* The DSpark draft's reference driver (graphs/ref/ref.h): the draft's context per sequence, fed
 * with the target's features position by position and rolled back after a rejection, and the
 * round's greedy proposal through the layer math's draft forward (graphs/layers/layer_dspark.c)
 * on a double-sum context of its own. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/layers/layers.h"
#include "graphs/ref/ref.h"
#include "sched/error.h"

struct mf_ref_draft {
    const mf_layers *ly;
    mf_ly_ctx *cx;
    mf_ly_draft_ws ws;
};

int mf_ref_draft_new(const mf_ref *r, mf_ref_draft **out)
{
    *out = NULL;
    const mf_layers *ly = mf_ref_layers(r);
    if (!mf_model_has_draft(ly->m))
        return mf_error(-EINVAL, "draft: the model was loaded without its DSpark draft (mf_model_opts.load_draft)");
    mf_ref_draft *d = calloc(1, sizeof *d);
    if (!d) return mf_error(-ENOMEM, "draft: out of memory");
    d->ly = ly;
    int rc = mf_ly_ctx_new(ly, MF_LY_LIN_DOUBLE, &d->cx);
    if (!rc) rc = mf_ly_draft_ws_new(ly->c, &d->ws);
    if (rc) {
        mf_ref_draft_free(d);
        return rc;
    }
    *out = d;
    return 0;
}

void mf_ref_draft_free(mf_ref_draft *d)
{
    if (!d) return;
    mf_ly_draft_ws_free(&d->ws);
    mf_ly_ctx_free(d->cx);
    free(d);
}

int mf_ref_draft_state_new(const mf_ref_draft *d, mf_ly_draft_state **out)
{
    *out = NULL;
    mf_ly_draft_state *s = calloc(1, sizeof *s);
    if (s) s->ring = calloc(1, (size_t)mf_ly_draft_ring_bytes(d->ly->c));
    if (!s || !s->ring) {
        free(s);
        return mf_error(-ENOMEM, "draft: out of memory for a sequence's context (%lld bytes)",
                        (long long)mf_ly_draft_ring_bytes(d->ly->c));
    }
    *out = s;
    return 0;
}

void mf_ref_draft_state_free(mf_ly_draft_state *s)
{
    if (!s) return;
    free(s->ring);
    free(s);
}

int mf_ref_draft_feed(mf_ref_draft *d, mf_ly_draft_state *s, const float *feats, int n)
{
    const mf_config *c = d->ly->c;
    int64_t per = (int64_t)c->n_dspark_target * c->hidden_size;
    for (int i = 0; i < n; i++) {
        int rc = mf_ly_draft_feed(d->cx, &d->ws, s, feats + i * per);
        if (rc) return rc;
    }
    return 0;
}

int mf_ref_draft_rollback(mf_ly_draft_state *s, const mf_config *c, int64_t n_pos)
{
    if (n_pos > s->n_pos || n_pos < 0 || s->n_pos - n_pos > c->dspark_block_size)
        return mf_error(-EINVAL, "draft: rollback from %lld to %lld positions (at most dspark_block_size %d back)",
                        (long long)s->n_pos, (long long)n_pos, c->dspark_block_size);
    s->n_pos = n_pos;
    return 0;
}

int mf_ref_draft_propose(mf_ref_draft *d, const mf_ly_draft_state *s, int32_t anchor, int n, int32_t *tokens,
                         float *confidence, float *logits, int32_t *routes)
{
    const mf_config *c = d->ly->c;
    if (n < 1 || n > c->dspark_block_size)
        return mf_error(-EINVAL, "draft: %d candidates asked for (expected 1..dspark_block_size %d)", n,
                        c->dspark_block_size);
    int64_t V = c->vocab_size;
    float *own = logits ? NULL : malloc((size_t)V * sizeof *own);
    if (!logits && !own) return mf_error(-ENOMEM, "draft: out of memory");
    int rc = mf_ly_draft_block(d->cx, &d->ws, s, anchor, routes);
    int32_t prev = anchor;
    for (int i = 0; i < n && !rc; i++) {
        float *lg = logits ? logits + (int64_t)i * V : own;
        if ((rc = mf_ly_draft_heads(d->cx, &d->ws, i, prev, lg, &confidence[i]))) break;
        int32_t best = 0;
        for (int64_t v = 1; v < V; v++)
            if (lg[v] > lg[best]) best = (int32_t)v;
        tokens[i] = prev = best;
    }
    free(own);
    return rc;
}
