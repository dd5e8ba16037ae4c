/* A pipeline stage's boundaries (mf_sg_opts.layer_begin, layer_end; graphs/pipe/pipe.h): before its
 * first layer one task receives every item's residual streams and carried mix from the stage
 * before (MF_SG_NET_IN), after its last layer one task sends them on (MF_SG_NET_OUT, in place of
 * the final norm and head). Both on the boundary lane (mf_sg_lanes_net), priced by the profile's
 * link (sched/cost.h mf_cost_net). */
#include "graphs/step/stepgraph_impl.h"

int64_t mf_sg_boundary_floats(const mf_config *c) { return (int64_t)c->hc_mult * c->hidden_size + c->hc_mult; }

/* The record of a boundary task: all items, their bytes over the link in one message. */
static mf_sg_task sg_net_rec(const mf_sg_builder *b, int L)
{
    mf_sg_task t = mf_sg_rec(L);
    t.i0 = 0;
    t.i1 = b->sg->n;
    t.n_tok = b->sg->n;
    t.w.net_bytes = 4.0 * (double)mf_sg_boundary_floats(b->o->c) * b->sg->n;
    t.w.net_msgs = 1;
    return t;
}

mf_task_id mf_sg_net_in(mf_sg_builder *b)
{
    SG_NAME(b, "net in L%d", b->o->layer_begin);
    return mf_sg_add(b, b->o->lane_net, MF_SG_NET_IN, MF_SG_PH_OTHER, MF_SG_K_NET, sg_net_rec(b, b->o->layer_begin));
}

void mf_sg_net_out(mf_sg_builder *b, const mf_task_id *unit)
{
    SG_NAME(b, "net out L%d", b->o->layer_end);
    mf_task_id t = mf_sg_add(b, b->o->lane_net, MF_SG_NET_OUT, MF_SG_PH_OTHER, MF_SG_K_NET, sg_net_rec(b, -1));
    for (int k = 0; k < b->sg->n_units; k++) mf_sg_dep(b, unit[k], t);
}
