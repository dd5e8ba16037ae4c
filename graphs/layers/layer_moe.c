/* The MoE sublayer (graphs/layers/layers.h): fp32 router (sqrtsoftplus scores, bias-corrected
 * top-k selection, weights from the unbiased scores, normalized and scaled), clamped-SwiGLU routed
 * experts (packed fp4) and the shared expert (fp8), summed in fp32. */
#include <errno.h>
#include <string.h>

#include "graphs/layers/layers.h"
#include "host/store.h"
#include "sched/error.h"

void mf_ly_route(const mf_config *c, const float *logits, const float *bias, int32_t *experts,
                  float *weights)
{
    mf_ly_route_n(c, c->n_routed_experts, c->n_experts_per_tok, logits, bias, experts, weights);
}

void mf_ly_route_n(const mf_config *c, int n, int k, const float *logits, const float *bias, int32_t *experts,
                   float *weights)
{
    /* scores are recomputed per candidate: small n, plain loops */
    for (int t = 0; t < k; t++) {
        int best = -1;
        float best_v = 0;
        for (int e = 0; e < n; e++) {
            int taken = 0;
            for (int u = 0; u < t; u++) taken |= experts[u] == e;
            if (taken) continue;
            float v = sqrtf(mf_ly_softplus(logits[e])) + bias[e];
            if (best < 0 || v > best_v) {   /* strict: ties keep the lower index */
                best = e;
                best_v = v;
            }
        }
        experts[t] = best;
    }
    double sum = 0;
    for (int t = 0; t < k; t++) {
        weights[t] = sqrtf(mf_ly_softplus(logits[experts[t]]));
        sum += weights[t];
    }
    float denom = (float)sum + 1e-20f;
    for (int t = 0; t < k; t++) {
        if (c->norm_topk_prob) weights[t] /= denom;
        weights[t] *= (float)c->routed_scaling_factor;
    }
}

int mf_ly_gate_rows(mf_ly_ctx *cx, int L, const float *x, int n_tok, int64_t ld_x, float *logits,
                    int64_t ld_y, int64_t r0, int64_t r1)
{
    const mf_weight *w = &mf_model_layer_at(cx->ly->m, L)->gate;
    if (r0 < 0 || r1 > w->rows || r0 > r1 || n_tok < 1)
        return mf_error(-EINVAL, "layers: rows [%lld, %lld) of %s (%lld rows), %d inputs", (long long)r0,
                        (long long)r1, w->name ? w->name : "the router gate", (long long)w->rows, n_tok);
    for (int t = 0; t < n_tok; t++) {
        int rc = mf_ly_linear_rows(cx, w, r0, r1 - r0, x + t * ld_x, w->cols, 0, logits + t * ld_y + r0);
        if (rc) return rc;
    }
    return 0;
}

void mf_ly_route_item(mf_ly_ctx *cx, const mf_ly_item *it, int L, const float *logits, int32_t *experts,
                      float *weights)
{
    const mf_config *c = cx->ly->c;
    const mf_model_layer *y = mf_model_layer_at(cx->ly->m, L);
    float *bias = cx->gate_bias;
    int n = mf_config_layer_experts(c, L), k = mf_config_layer_topk(c, L);
    for (int e = 0; e < n; e++) bias[e] = mf_ly_vec(&y->gate_bias, e);
    mf_ly_route_n(c, n, k, logits, bias, experts, weights);
    if (it->routes) memcpy(it->routes, experts, (size_t)k * sizeof *experts);
    if (cx->ly->hooks.on_route && L < c->n_layers)
        cx->ly->hooks.on_route(cx->ly->hooks.user, it->st, it->pos, L, experts, weights, k);
}

/* y[hidden] = w2(bf16(weight * silu(min(g, lim)) * clamp(u, +-lim))) with g = w1 x, u = w3 x. */
static int mf_ly_expert(mf_ly_ctx *cx, const mf_weight *w1, const mf_weight *w2, const mf_weight *w3,
                         float weight, const float *in, float *y)
{
    const mf_config *c = cx->ly->c;
    int aq = cx->ly->act_quant;
    float *g = cx->ffn_g, *u = cx->ffn_u;
    int rc;
    if ((rc = mf_ly_linear(cx, w1, in, g, aq)) || (rc = mf_ly_linear(cx, w3, in, u, aq))) return rc;
    float lim = (float)c->swiglu_limit;
    for (int64_t i = 0; i < w1->rows; i++) {
        float gi = mf_bf(g[i]), ui = mf_bf(u[i]);   /* linear outputs are bf16, then .float() */
        if (lim > 0) {
            ui = fminf(fmaxf(ui, -lim), lim);
            gi = fminf(gi, lim);
        }
        g[i] = mf_bf(weight * (mf_ly_silu(gi) * ui));
    }
    if ((rc = mf_ly_linear(cx, w2, g, y, aq))) return rc;
    mf_bf_n(y, w2->rows);
    return 0;
}

/* With an expert store: the selected experts are made present in one batch of reads, and each
 * is computed (into its own output, on the store's compute worker) as soon as its bytes are in,
 * while the others are still being read. The sum below runs in selection order as without. */
typedef struct mf_ly_ex {
    mf_ly_ctx *cx;
    int L;
    const int32_t *experts;
    const float *weights;
    const float *in;
} mf_ly_ex;

static int mf_ly_expert_task(void *user, int k)
{
    mf_ly_ex *x = user;
    mf_ly_ctx *cx = x->cx;
    mf_store *st = mf_model_store(cx->ly->m);
    const mf_weight *ew = &mf_model_layer_at(cx->ly->m, x->L)->experts[x->experts[k] * 3];
    mf_weight w[3];
    for (int i = 0; i < 3; i++) {
        w[i] = ew[i];
        w[i].data = mf_store_part(st, x->L, x->experts[k], 2 * i);
        w[i].scale = mf_store_part(st, x->L, x->experts[k], 2 * i + 1);
        if (!w[i].data || !w[i].scale)
            return mf_error(-EIO, "reference: %s is not present in the expert store", w[i].name);
    }
    return mf_ly_expert(cx, &w[0], &w[1], &w[2], x->weights[k], x->in,
                         cx->ex_out + (int64_t)k * cx->ly->c->hidden_size);
}

int mf_ly_moe(mf_ly_ctx *cx, mf_ly_item *it, int L, const float *in, float *out)
{
    const mf_config *c = cx->ly->c;
    const mf_model_layer *y = mf_model_layer_at(cx->ly->m, L);
    int64_t H = c->hidden_size;
    int n_exp = mf_config_layer_experts(c, L), k = mf_config_layer_topk(c, L);
    float *logits = cx->gate_logits, *acc_y = cx->ffn_y;
    int rc;
    if ((rc = mf_ly_gate_rows(cx, L, in, 1, H, logits, n_exp, 0, n_exp))) return rc;
    int32_t experts[256];
    float weights[256];
    mf_ly_route_item(cx, it, L, logits, experts, weights);
    double *acc = cx->moe_acc;   /* hidden doubles */
    for (int64_t d = 0; d < H; d++) acc[d] = 0;
    /* the store holds the backbone's experts; a draft stage's are the model's own */
    mf_store *st = L < c->n_layers ? mf_model_store(cx->ly->m) : NULL;
    if (st) {
        mf_ly_ex x = {cx, L, experts, weights, in};
        rc = mf_store_ensure(st, L, experts, k, mf_ly_expert_task, &x);
        if (rc) return rc;
        mf_store_unpin(st, L, experts, k);
        for (int t = 0; t < k; t++)
            for (int64_t d = 0; d < H; d++) acc[d] += cx->ex_out[(int64_t)t * H + d];
    }
    for (int t = 0; !st && t < k; t++) {
        const mf_weight *ew = &y->experts[experts[t] * 3];
        if ((rc = mf_ly_expert(cx, &ew[0], &ew[1], &ew[2], weights[t], in, acc_y))) return rc;
        for (int64_t d = 0; d < H; d++) acc[d] += acc_y[d];
    }
    if (c->n_shared_experts > 0) {
        if ((rc = mf_ly_expert(cx, &y->sh_w1, &y->sh_w2, &y->sh_w3, 1.0f, in, acc_y))) return rc;
        for (int64_t d = 0; d < H; d++) acc[d] += acc_y[d];
    }
    for (int64_t d = 0; d < H; d++) out[d] = mf_bf((float)acc[d]);
    return 0;
}
