/* Where a layer's routed experts run: the placement rule (mf_sg_placer) that the engine's route task
 * and the simulator share, and the prefetch (mf_sg_prefetch: a layer's experts placed and copied in
 * at its start, beside its attention) with its head start and copy-in ranks, set by
 * stepgraph.c mf_stepgraph_new after finalize. The slots the copies feed: stepgraph_moe.c. */
#include "graphs/step/stepgraph_impl.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "device/expert_cache.h"
#include "sched/error.h"

/* ---- prefetch: the builder's tasks, their head start and ranks ------------------------------ */

/* prefetch: experts per join of a card's copies (mf_sg_prefetch) */
#define SG_PRE_BLOCK 4

/* Prefetch: layer L's place task -> per expert its copy on its owner card's h2d lane -> per card a
 * join, which the slots' copy-ins on that card wait for. Built before the layer's attention, so the
 * copies overlap it and the previous layer's MoE: two layers' card pins at a time. The place task
 * follows layer L - 1's route (its MoE window opens; the links have room there) and layer L - 2's
 * MoE done (its pins released), and layer L - 1's MoE done follows it (L - 1's pins released after
 * L's are taken: the caches see one order of acquisitions and releases, the engine's and the
 * simulator's, graphs/sim/plan.c pl_layer_slots). */
void mf_sg_prefetch(mf_sg_builder *b, int L)
{
    const mf_config *c = b->o->c;
    mf_stepgraph *sg = b->sg;
    int E = c->n_routed_experts;
    SG_NAME(b, "moe L%d place", L);
    mf_sg_task t = mf_sg_rec(L);
    mf_sg_span(b, &t);
    t.w.ref_flops = 8.0 * E;   /* the placer's sums and the cache's look-ups per expert */
    mf_task_id pl = mf_sg_add(b, 0, MF_SG_MOE_PLACE, MF_SG_PH_OTHER, MF_SG_K_OTHER, t);
    mf_sg_dep(b, b->route, pl);
    mf_sg_dep(b, b->pre_done, pl);
    mf_sg_dep(b, pl, b->last_done);
    b->pre_done = b->last_done;
    b->pre_place = pl;
    for (int cd = 0; cd < sg->n_cards; cd++) {
        SG_NAME(b, "dev%d L%d prefetched", cd, L);
        b->pre_join[cd] = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_OTHER, MF_SG_K_OTHER, mf_sg_rec(L));
    }
    /* per card its experts in descending order in blocks of SG_PRE_BLOCK, each block's join after
     * the copies of every expert of the card's blocks down to it (b->pre_sfx[e] of each expert e
     * of the block): slot s (whose expert, the slot table's distinct experts ascending, is >= s)
     * on card cd waits for the join of the block of the lowest expert >= s that cd owns
     * (stepgraph_moe.c sg_slot_card), so a card starts on its slots while the other copies run. Joins on the
     * copies, not the copies chained, so the copies keep their ranks (the dense chains' copies
     * first) and, equal among themselves, go in the order they are added (a lower id first on
     * ties): descending, the first slots' experts first; and not joins chained, so each waits
     * for one worker once its copies are in (mf_sg_pre_ranks ranks them above the host's experts) */
    mf_task_id pj[MF_SG_MAX_CARDS];
    int nb[MF_SG_MAX_CARDS] = {0};
    for (int e = E - 1; e >= 0; e--) {
        int cd = mf_dev_xcache_owner(sg->n_cards, L, e);
        SG_NAME(b, "dev%d L%d expert %d pre", cd, L, e);
        mf_sg_task tp = mf_sg_rec(L);
        tp.card = (int8_t)cd;
        tp.part = e;
        tp.w.copy_bytes = b->o->sz->xslot_bytes;
        tp.w.copies = b->o->miss_copies > 0 ? b->o->miss_copies : MF_SG_EXPERT_PARTS;
        mf_task_id pt = sg->pre_tid[(size_t)L * E + e] =
            mf_sg_add(b, b->o->lane_dev0 + 3 * cd, MF_SG_DEV_PRE, MF_SG_PH_OTHER, MF_SG_K_COPY, tp);
        mf_sg_dep(b, pl, pt);
        mf_sg_dep(b, pt, b->pre_join[cd]);
        if (nb[cd] == 0) {   /* a new block of the card: its join after every copy of the card so far */
            SG_NAME(b, "dev%d L%d experts %d+ in", cd, L, e);
            pj[cd] = mf_sg_add(b, 0, MF_SG_JOIN, MF_SG_PH_OTHER, MF_SG_K_OTHER, mf_sg_rec(L));
            for (int f = e + 1; f < E; f++)
                if (mf_dev_xcache_owner(sg->n_cards, L, f) == cd) mf_sg_dep(b, sg->pre_tid[(size_t)L * E + f], pj[cd]);
        }
        mf_sg_dep(b, pt, pj[cd]);
        b->pre_sfx[e] = pj[cd];
        nb[cd] = (nb[cd] + 1) % SG_PRE_BLOCK;
    }
}

/* Prefetch: per layer the links' head start before its route (mf_stepgraph.pre_ahead_ns): how long
 * the layer's attention and Engram take before the route, the longer of the priced host work over
 * the workers and the longest priced path from the layer's place task to its route (the dense
 * chains' copies and card work, which the workers do not shorten), less the most any card's h2d
 * lane copies for them (its dense inputs), at least 0; and the priced host work of its MoE other
 * than the routed experts' (mf_stepgraph.pre_moe_host_ns). After finalize (the path reads the
 * graph's edges); 0 or -ENOMEM. */
int mf_sg_pre_ahead(const mf_sg_opts *o, mf_stepgraph *sg)
{
    int W = o->n_threads > 0 ? o->n_threads : 1, n = sg->n_tasks, nl = o->c->n_layers;
    double cpu[MF_CONFIG_MAX_LAYERS] = {0}, h2d[MF_CONFIG_MAX_LAYERS][MF_SG_MAX_CARDS] = {{0}};
    mf_task_id place[MF_CONFIG_MAX_LAYERS], route[MF_CONFIG_MAX_LAYERS];
    for (int L = 0; L < nl; L++) place[L] = route[L] = -1;
    for (int t = 0; t < n; t++) {
        const mf_sg_task *r = &sg->task[t];
        if (r->layer < 0) continue;
        if (r->op == MF_SG_MOE_PLACE && place[r->layer] < 0) place[r->layer] = t;
        if (r->op == MF_SG_ROUTE && r->part < 0 && route[r->layer] < 0) route[r->layer] = t;
        double ns = mf_graph_task(sg->g, t)->cost.time_ns;
        int host = r->kind != MF_SG_K_COPY_OUT && r->kind != MF_SG_K_DEV && r->kind != MF_SG_K_IO;
        if (r->phase == MF_SG_PH_MOE && host && r->kind != MF_SG_K_COPY && r->card < 0 && r->op != MF_SG_SLOT_UP &&
            r->op != MF_SG_SLOT_JOIN && r->op != MF_SG_SLOT_DOWN)
            sg->pre_moe_host_ns[r->layer] += ns;
        if (r->phase != MF_SG_PH_ATTN && r->phase != MF_SG_PH_ENGRAM) continue;
        if ((r->kind == MF_SG_K_COPY || r->op == MF_SG_DENSE_DEQ) && r->card >= 0) h2d[r->layer][r->card] += ns;
        else if (host) cpu[r->layer] += ns;
    }
    /* each task's earliest start by the prices with unbounded lanes, in topological order */
    double *top = calloc((size_t)n + 1, sizeof *top);
    int *left = malloc(sizeof *left * ((size_t)n + 1)), *queue = malloc(sizeof *queue * ((size_t)n + 1));
    if (!top || !left || !queue) {
        free(top), free(left), free(queue);
        return mf_error(-ENOMEM, "step graph: out of memory");
    }
    int qh = 0, qt = 0;
    for (int t = 0; t < n; t++)
        if (!(left[t] = mf_graph_n_pred(sg->g, t))) queue[qt++] = t;
    while (qh < qt) {
        int t = queue[qh++], ns = mf_graph_n_succ(sg->g, t);
        const mf_task_id *su = mf_graph_succ(sg->g, t);
        double end = top[t] + mf_graph_task(sg->g, t)->cost.time_ns;
        for (int k = 0; k < ns; k++) {
            if (end > top[su[k]]) top[su[k]] = end;
            if (!--left[su[k]]) queue[qt++] = su[k];
        }
    }
    for (int L = 0; L < nl; L++) {
        double most = 0, path = 0;
        for (int cd = 0; cd < MF_SG_MAX_CARDS; cd++) most = h2d[L][cd] > most ? h2d[L][cd] : most;
        if (place[L] >= 0 && route[L] >= 0)
            path = top[route[L]] - top[place[L]] - mf_graph_task(sg->g, place[L])->cost.time_ns;
        double a = (cpu[L] / W > path ? cpu[L] / W : path) - most;
        sg->pre_ahead_ns[L] = a > 0 ? a : 0;
    }
    free(top), free(left), free(queue);
    return 0;
}

/* Prefetch: each slot's copy-in on a card ranks above the layer's expert copies on that card, and
 * the joins it waits for above it. Its own expert's copy is in once it is ready (mf_sg_prefetch's
 * joins) and its card's FFN waits for it alone, but the copies still queued rank above it by their
 * own cost (an expert's copy takes longer than a slot's rows), so the card would idle until the
 * last of them; and its joins would wait for a worker behind the host's experts. 0 or the
 * graph's error. */
int mf_sg_pre_ranks(const mf_sg_opts *o, mf_stepgraph *sg)
{
    int E = o->c->n_routed_experts, rc = 0;
    for (int L = 0; L < o->c->n_layers && !rc; L++)
        for (int cd = 0; cd < sg->n_cards && !rc; cd++) {
            double top = 0;
            for (int e = 0; e < E; e++) {
                mf_task_id pt = sg->pre_tid[(size_t)L * E + e];
                if (pt >= 0 && sg->task[pt].card == cd && mf_graph_rank_ns(sg->g, pt) > top) top = mf_graph_rank_ns(sg->g, pt);
            }
            for (int s = 0; s < sg->n_slots && !rc; s++) {
                mf_task_id din = sg->slot_tid[((size_t)L * sg->n_slots + s) * sg->tid_per_slot + 2 * sg->p_exp + 1 + 3 * cd];
                if (din < 0) continue;
                rc = mf_graph_raise_rank(sg->g, din, top + 1);
                /* and the joins it waits for (its copies', its rows') as the highest of them and
                 * the copies: they are free, and would wait for a worker behind the host's experts;
                 * so the card's copy of the rows' items (slot_gather), on the lane before it */
                const mf_task_id *pr = mf_graph_pred(sg->g, din);
                double jr = top + 2;
                for (int k = 0; k < mf_graph_n_pred(sg->g, din); k++)
                    if ((sg->task[pr[k]].op == MF_SG_JOIN || sg->task[pr[k]].op == MF_SG_DEV_ROWS) &&
                        mf_graph_rank_ns(sg->g, pr[k]) > jr)
                        jr = mf_graph_rank_ns(sg->g, pr[k]);
                for (int k = 0; k < mf_graph_n_pred(sg->g, din) && !rc; k++)
                    if (sg->task[pr[k]].op == MF_SG_JOIN || sg->task[pr[k]].op == MF_SG_DEV_ROWS)
                        rc = mf_graph_raise_rank(sg->g, pr[k], jr);
            }
        }
    return rc;
}

/* ---- the placement rule ---------------------------------------------------------------------- */

static double sg_lane_ns(const mf_lane_model *m, double bytes)
{
    return m->latency_ns + (m->bytes_per_s > 0 ? bytes / m->bytes_per_s * 1e9 : 0);
}

/* An expert of `bytes` and `macs` per token over cnt tokens on a lane of model m whose kernels
 * multiply-add at macs_per_s (mf_cost_kern's formula; 0: each token adds 2% to the bytes' time). */
static double sg_place_ns(const mf_lane_model *m, double macs_per_s, double bytes, double macs, int cnt)
{
    if (!(macs_per_s > 0) || !(macs > 0)) return sg_lane_ns(m, bytes) * (1 + 0.02 * cnt);
    mf_profile_kern k = {.bytes_per_s = m->bytes_per_s, .macs_per_s = macs_per_s, .latency_ns = m->latency_ns};
    return mf_cost_kern(&k, k.bytes_per_s, bytes, macs, cnt);
}

double mf_sg_slot_tok_bytes(const mf_config *c, int dir)
{
    return (double)c->hidden_size * 2.0 + (dir ? 0 : 4.0);   /* bf16 rows; an fp32 token weight in */
}

void mf_sg_placer_init(mf_sg_placer *p, const mf_lane_model models[4], const mf_profile *prof, int n_threads,
                       int hybrid, double expert_bytes, double expert_macs, double tok_in, double tok_out,
                       int miss_copies)
{
    memset(p, 0, sizeof *p);
    if (!prof) prof = mf_cost_default_profile();
    p->cm = (mf_cost_model){.p = prof};
    p->macs = expert_macs;
    p->host_macs_per_s = prof->host[MF_KF_FP4].macs_per_s;
    p->card_macs_per_s = prof->card[MF_KF_FP4].macs_per_s;
    p->cpu = models[0];
    p->comp = models[2];
    p->workers = n_threads;
    p->hybrid = hybrid;
    p->bytes = expert_bytes;
    p->tok_in = tok_in;
    p->tok_out = tok_out;
    p->miss_copies = miss_copies > 0 ? miss_copies : MF_SG_EXPERT_PARTS;
}

void mf_sg_place_host_work(mf_sg_placer *p, int cnt)
{
    p->host_q += sg_place_ns(&p->cpu, p->host_macs_per_s, p->bytes, p->macs, cnt);
}

int mf_sg_place_want_card(mf_sg_placer *p, int card, int cnt, int cached)
{
    int c = card;
    p->card = c;
    p->host_ns = sg_place_ns(&p->cpu, p->host_macs_per_s, p->bytes, p->macs, cnt);
    /* the copy-in as mf_sg_task_ns prices MF_SG_DEV_IN: rows and weights, and the expert on a miss (one span or its parts);
     * ahead (prefetch): the expert as MF_SG_DEV_PRE on their own queue from its head start, the rows
     * after the route and the parts */
    double copy_end;
    if (p->ahead) {
        p->pre_ns = cached ? 0 : mf_cost_copy(&p->cm, 0, p->miss_copies, p->bytes);
        p->copy_ns = mf_sg_slot_in_ns(&p->cm, p->gather, cnt, p->tok_in, 0, 0, 0);
        double pre_end = p->pre_q[c] + p->pre_ns;
        p->copy_end = (pre_end > p->copy_q[c] ? pre_end : p->copy_q[c]) + p->copy_ns;
        copy_end = p->copy_end;
    } else {
        p->copy_ns = mf_sg_slot_in_ns(&p->cm, p->gather, cnt, p->tok_in, !cached, p->miss_copies, p->bytes);
        copy_end = p->copy_q[c] + p->copy_ns;
    }
    double comp_ns = sg_place_ns(&p->comp, p->card_macs_per_s, p->bytes, p->macs, cnt), lt_ns;
    if (p->lt == MF_SG_LT_COST || p->lt == MF_SG_LT_ON) {   /* on the path its FFN takes (mf_sg_ffn_lt) */
        mf_work w = {0};
        w.w_bytes[MF_KF_FP4] = p->bytes, w.macs[MF_KF_FP4] = p->macs, w.calls[MF_KF_FP4] = 1;
        if (mf_sg_ffn_lt(&p->cm, &w, cnt, p->lt, &lt_ns)) comp_ns = lt_ns;
    }
    double out_ns = mf_cost_copy(&p->cm, 1, 1, cnt * p->tok_out);
    p->t_dev = (copy_end > p->comp_q[c] ? copy_end : p->comp_q[c]) + comp_ns;
    return !p->hybrid || p->t_dev + out_ns <= p->host_q / p->workers;
}

void mf_sg_place_card(mf_sg_placer *p)
{
    if (p->ahead) {
        p->pre_q[p->card] += p->pre_ns;
        p->copy_q[p->card] = p->copy_end;
    } else
        p->copy_q[p->card] += p->copy_ns;
    p->comp_q[p->card] = p->t_dev;
    p->host_q -= p->host_ns;
}

int mf_sg_prefetch_min(const mf_config *c)
{
    double E = c->n_routed_experts, K = c->n_experts_per_tok;
    if (!(E > 1) || K >= E) return 1;
    return (int)ceil(log(E) / -log(1 - K / E));
}

int mf_sg_prefetch_on(const mf_sg_opts *o)
{
    int serial = !o->par && !o->mixed;
    int min = o->prefetch_min > 0 ? o->prefetch_min : mf_sg_prefetch_min(o->c);
    return o->prefetch_min >= 0 && serial && o->micro < 2 && o->n_cards > 0 && !o->store && o->n >= min;
}

void mf_sg_place_lt(mf_sg_placer *p, int mode) { p->lt = mode; }

void mf_sg_place_gather(mf_sg_placer *p, int on) { p->gather = on; }

void mf_sg_place_ahead(mf_sg_placer *p, double ahead_ns, double host_ns, const double *left_ns)
{
    p->ahead = 1;
    p->host_q += host_ns;
    for (int c = 0; c < MF_SG_MAX_CARDS; c++) p->pre_q[c] = -ahead_ns - (left_ns ? left_ns[c] : 0);
}

void mf_sg_place_left(const mf_sg_placer *p, double left_ns[MF_SG_MAX_CARDS])
{
    double win = p->workers > 0 ? p->host_q / p->workers : 0;
    for (int c = 0; c < MF_SG_MAX_CARDS; c++) {
        double busy = p->pre_q[c] > p->copy_q[c] ? p->pre_q[c] : p->copy_q[c], l = win - (busy > 0 ? busy : 0);
        left_ns[c] = l > 0 ? l : 0;
    }
}

int mf_sg_place_all(mf_sg_placer *p, const mf_config *c, int L, int n_cards, int tok, const uint8_t *cached,
                    mf_sg_take_fn take, void *ctx, int32_t *card, uint8_t *miss)
{
    int E = c->n_routed_experts, n = 0;
    for (int e = 0; e < E; e++) {
        card[e] = -1;
        miss[e] = 0;
        mf_sg_place_host_work(p, tok);
    }
    for (int pass = 0; pass < 2; pass++)   /* the cached experts first, then the rest */
        for (int e = 0; e < E; e++) {
            if (cached[e] == pass) continue;
            int cd = mf_dev_xcache_owner(n_cards, L, e), hit = 0;
            if (!mf_sg_place_want_card(p, cd, tok, !pass) || !take(ctx, cd, e, &hit)) continue;
            mf_sg_place_card(p);
            card[e] = cd;
            miss[e] = (uint8_t)!hit;
            n++;
        }
    return n;
}

void mf_sg_place_shared(mf_sg_placer *p, const mf_stepgraph *sg, int L, int h)
{
    if (L < 0 || L >= MF_CONFIG_MAX_LAYERS || h < 0 || h > 1) return;
    for (int cd = 0; cd < MF_SG_MAX_CARDS; cd++) p->comp_q[cd] += sg->shared_ns[h][L][cd];
}

void mf_stepgraph_mark_prefetch(mf_stepgraph *sg, int L, const int32_t *card, const uint8_t *miss)
{
    for (int e = 0; sg->prefetch && e < sg->pre_experts; e++)
        mf_graph_set_noop(sg->g, sg->pre_tid[(size_t)L * sg->pre_experts + e], card[e] < 0 || !miss[e]);
}
