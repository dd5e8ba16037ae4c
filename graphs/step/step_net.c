/* A pipeline stage's boundary tasks (graphs/step/stepgraph_net.c builds them; graphs/pipe/pipe.h
 * runs the stages): MF_SG_NET_IN receives a run's boundary through the engine's link
 * (mf_step_opts.link) and unpacks each item's residual streams and carried mix; MF_SG_NET_OUT packs
 * them after the last layer and sends them. The layout is mf_sg_boundary_floats's. */
#include <string.h>

#include "graphs/step/step_impl.h"

static int mf_task_net_in(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    const mf_config *c = sh->eng->c;
    int64_t per = mf_sg_boundary_floats(c), xs = (int64_t)c->hc_mult * c->hidden_size;
    const mf_step_link *ln = &sh->eng->o.link;
    int n = sh->sg->n_live;   /* a bucket's graph: the step's live items cross, not the dead ones */
    int rc = ln->recv(ln->user, sh->net, per * n);
    if (rc) return rc;
    for (int i = 0; i < n; i++) {
        const float *b = sh->net + (size_t)i * per;
        memcpy(sh->items[i].x, b, sizeof(float) * (size_t)xs);
        memcpy(sh->items[i].pre, b + xs, sizeof(float) * (size_t)c->hc_mult);
    }
    return 0;
}

static int mf_task_net_out(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    mf_step_targ *a = arg;
    mf_step_shape *sh = a->sh;
    const mf_config *c = sh->eng->c;
    int64_t per = mf_sg_boundary_floats(c), xs = (int64_t)c->hc_mult * c->hidden_size;
    int n = sh->sg->n_live;   /* a bucket's graph: the step's live items cross, not the dead ones */
    for (int i = 0; i < n; i++) {
        float *b = sh->net + (size_t)i * per;
        memcpy(b, sh->items[i].x, sizeof(float) * (size_t)xs);
        memcpy(b + xs, sh->items[i].pre, sizeof(float) * (size_t)c->hc_mult);
    }
    const mf_step_link *ln = &sh->eng->o.link;
    return ln->send(ln->user, sh->net, per * n);
}

/* This file's ops (step_impl.h; step_shape.c binds them). */
const mf_task_fn mf_step_net_fn_of[MF_SG_N_OPS] = {[MF_SG_NET_IN] = mf_task_net_in, [MF_SG_NET_OUT] = mf_task_net_out};
