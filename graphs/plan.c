/* The decode-step simulator (graphs/plan.h). Each step draws its routing, then builds the graph
 * graphs/step.c would run for a parallel decode shape of `batch` items (mf_step_build_graph: per
 * layer engram embed i -> wkv parts -> engram gate i -> attn i -> gate parts -> route -> slots (IO
 * reads, up parts, join, down parts, and
 * per card in / ffn / out) and the shared expert -> moe done -> combine i; norm i -> head join ->
 * head parts), places the slots as mf_step_place does, updates the expert caches, gives every task
 * a duration from the profile (docs/sim.md "Cost formulas") and runs mf_sim_run_opts. */
#include "graphs/plan.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/layout.h"
#include "sched/error.h"
#include "sched/residency.h"
#include "sched/sim.h"
#include "sched/timeline.h"

#define PL_MAX_CARDS 16
#define PL_STORE_ALIGN 4096.0   /* host/store.c MF_STORE_SLOT_ALIGN: reads are aligned extents */
/* The reference code's loops against the profile's REF loop (plain C attention, double sums):
 * what one unit of each costs in REF multiply-adds. Measured on the 2-core development box with a
 * micro-benchmark of each loop in the same minute as `moeflow calibrate` (docs/sim.md "Weights"):
 * a MAC of mf_ref_linear_rows over fp8 weights (0.457 ns) and over bf16 weights (0.728 ns), a
 * MAC of the hyper-connection mixes over fp32 weights out of cache (0.676 ns), one bf16 rounding
 * (mf_bf on random values, 8.83 ns), against host_ref 2.67 GMAC/s (0.374 ns). Rates are the
 * profile's; only these ratios are built in. */
#define PL_W_DOT_FP8 1.22
#define PL_W_DOT_BF16 1.95
#define PL_W_MIX 1.81
#define PL_W_ROUND 23.6

/* The attention's linear stages (ref_internal.h MF_RA_STAGE_*), and the core's linears. */
enum { PL_ST_IN, PL_ST_QB, PL_ST_OA, PL_ST_OB, PL_ST_CORE, PL_N_STAGES };
#define PL_MAX_ATTN_PARTS 64   /* step.c's MF_STEP_MAX_PARTS */

/* Weights of one layer, from the layout (graphs/layout.h), for the cost formulas. */
typedef struct pl_layer {
    /* attention linears per stage (ref_attn.c mf_ref_attn_linears: in, qb, oa, ob) on the kernels:
     * fp8 and bf16 (LINEAR role) weight bytes, multiply-adds per token, calls; the core's own
     * (indexer wk) likewise */
    double st_fp8_bytes[PL_N_STAGES], st_bf16_bytes[PL_N_STAGES];
    double st_fp8_macs[PL_N_STAGES], st_bf16_macs[PL_N_STAGES];
    int st_fp8_calls[PL_N_STAGES], st_bf16_calls[PL_N_STAGES];
    double hc_macs;                           /* both hyper-connection projections (fp32, scalar) */
    double attn_ref_macs;                     /* wo_a: the reference's scalar dot rows (grouped) */
    double eng_fp8_bytes, eng_bf16_bytes;     /* Engram wkv, q/k projections */
    double eng_fp8_macs;                      /* Engram wkv multiply-adds per token */
    double eng_row_bytes;                     /* one table row (codes + scales) */
} pl_layer;

/* Kinds of task, as step.c's MF_STEP_K_* (what the phase table leaves out), and the host-thread
 * work of an emulated card's operation (no phase either). */
enum { PL_K_OTHER, PL_K_IO, PL_K_EXPERT, PL_K_COPY, PL_K_DEV, PL_K_COPY_OUT, PL_K_WAKE };

struct mf_plan {
    mf_plan_opts o;
    mf_config c;
    mf_profile prof;
    int n_cards, n_threads, n_cores, batch, read_window, copy_slots, emulated;
    int H, I, K, E, hc, n_layers;
    pl_layer *layer;
    double up_bytes, down_bytes;             /* one routed expert: w1 + w3, w2 (codes + scales) */
    double xslot_bytes;                      /* packed expert on a card (step.c mf_step_dev_setup) */
    double store_slot_bytes;                 /* one expert in the host store, read as 6 extents */
    double part_bytes[6];
    double sh_up_bytes, sh_down_bytes, Ish;  /* shared expert */
    double head_bytes;
    double cpu_bytes_per_s;                  /* host kernels: min(thread, socket memory / threads) */
    mf_lane_model models[4];                 /* the engine's lane models (mf_step_lane_models) */
    /* lanes: cpu, [io], 3 per card */
    mf_lane_desc lanes[2 + 6 * PL_MAX_CARDS];
    char lane_names[2 + 6 * PL_MAX_CARDS][32];
    uint8_t lane_core[2 + 6 * PL_MAX_CARDS];
    int n_lanes, io_lane, dev_lane0, emu_lane;
    /* caches */
    int streamed;
    mf_resid *store;                          /* the host store's policy (streamed), or NULL */
    mf_resid *dev[PL_MAX_CARDS];              /* each card's expert cache policy */
    void *resid_mem;                          /* one block for all of them */
    /* routing */
    uint64_t rng;
    int32_t *ex;                             /* n_layers x batch x K */
    int64_t pos;                             /* position of the next step's tokens */
    /* the last step */
    mf_graph *g;
    mf_timeline *tl;
    int64_t *task_ns;
    uint8_t *phase_of, *kind_of;
    int cap_tasks;
    mf_task_id *noop_ids;                    /* tasks with nothing to do this step (marked noop) */
    int n_noop, cap_noop;
    mf_plan_report total;
};

/* ---- cost formulas (docs/sim.md) ----------------------------------------------------------- */

/* A kernel of `bytes` weight bytes and `macs` multiply-adds per token over n tokens
 * (sched/profile.h): latency + bytes / rate + (n - 1) * macs / mac rate. */
static double pl_kern(const mf_profile_kern *k, double bytes_per_s, double bytes, double macs, int n)
{
    double ns = k->latency_ns;
    if (bytes_per_s > 0) ns += bytes / bytes_per_s * 1e9;
    if (n > 1 && k->macs_per_s > 0) ns += (n - 1) * macs / k->macs_per_s * 1e9;
    return ns;
}

static double pl_host(const mf_plan *p, int fam, double bytes, double macs, int n)
{
    double bps = p->prof.host[fam].bytes_per_s;
    if (p->cpu_bytes_per_s > 0 && p->cpu_bytes_per_s < bps) bps = p->cpu_bytes_per_s;
    return pl_kern(&p->prof.host[fam], bps, bytes, macs, n);
}

/* Plain scalar code (the reference's dot rows, norms, mixes, scores): flops counted as
 * multiply-adds at the REF rate, no latency of its own. */
static double pl_ref(const mf_plan *p, double flops)
{
    const mf_profile_kern *k = &p->prof.host[MF_KF_REF];
    return k->macs_per_s > 0 ? flops / k->macs_per_s * 1e9 : 0;
}

/* The attention sublayer as graphs/step.c runs it (ref_attn.c's phases): per item a pre task
 * (mf_task_attn_pre), row-split linear stages over all items (mf_task_attn_rows), the q norm
 * (mf_task_attn_qnorm), per item the core (mf_task_attn_core) and a post task (mf_task_attn_post).
 * Each function is one task's duration. */

/* mf_task_attn_pre, one item: the attention mix (one of the layer's two HC projections), its
 * Sinkhorn, the collapse, attn_norm, and their bf16 roundings. */
static double pl_attn_pre_ns(const mf_plan *p, int L)
{
    const mf_config *c = &p->c;
    double H = c->hidden_size, hc = c->hc_mult;
    double fl = PL_W_MIX * p->layer[L].hc_macs / 2 + 2.0 * hc * H + 4.0 * H +
                c->hc_sinkhorn_iters * 4.0 * hc * hc * 2 + PL_W_ROUND * 2.0 * H;
    return pl_ref(p, fl);
}

/* mf_task_attn_post, one item: the output expanded into the streams, the ffn mix, collapse and
 * ffn_norm, and their roundings. */
static double pl_attn_post_ns(const mf_plan *p, int L)
{
    const mf_config *c = &p->c;
    double H = c->hidden_size, hc = c->hc_mult;
    double fl = PL_W_MIX * p->layer[L].hc_macs / 2 + 2.0 * hc * H * (1 + hc) + 4.0 * H +
                c->hc_sinkhorn_iters * 4.0 * hc * hc * 2 + PL_W_ROUND * (4.0 + hc) * H;
    return pl_ref(p, fl);
}

/* Kernel calls of one stage's part over n tokens: its fp8 and bf16 linears' bytes and MACs split
 * over `parts`, each linear's latency once. */
static double pl_attn_kern_ns(const mf_plan *p, int L, int st, int parts, int n)
{
    const pl_layer *y = &p->layer[L];
    const mf_profile *f = &p->prof;
    double ns = 0;
    if (y->st_fp8_calls[st])
        ns += pl_host(p, MF_KF_FP8, y->st_fp8_bytes[st] / parts, y->st_fp8_macs[st] / parts, n) +
              (y->st_fp8_calls[st] - 1) * f->host[MF_KF_FP8].latency_ns;
    if (y->st_bf16_calls[st])
        ns += pl_host(p, MF_KF_BF16, y->st_bf16_bytes[st] / parts, y->st_bf16_macs[st] / parts, n) +
              (y->st_bf16_calls[st] - 1) * f->host[MF_KF_BF16].latency_ns;
    return ns;
}

/* mf_task_attn_rows: one of `parts` row ranges of stage st for n items. in: wq_a, wkv, the
 * compressor and indexer input projections (+ rounding of the low-rank query); qb: wq_b and the
 * indexer's; oa: the grouped wo_a, scalar dot rows per item (mf_ref_linear_rows) + its output's
 * roundings; ob: wo_b + the output's roundings. */
static double pl_attn_rows_ns(const mf_plan *p, int L, int st, int parts, int n)
{
    const mf_config *c = &p->c;
    if (st == PL_ST_OA)
        return pl_ref(p, n * (PL_W_DOT_FP8 * p->layer[L].attn_ref_macs +
                              PL_W_ROUND * (double)c->o_groups * c->o_lora_rank) / parts);
    double rounds = st == PL_ST_IN ? (double)c->q_lora_rank : st == PL_ST_OB ? (double)c->hidden_size : 0;
    return pl_attn_kern_ns(p, L, st, parts, n) + pl_ref(p, PL_W_ROUND * rounds * n / parts);
}

/* mf_task_attn_qnorm, n items: rounding and RMS norm of the low-rank query. */
static double pl_attn_qnorm_ns(const mf_plan *p, int n)
{
    return pl_ref(p, n * (4.0 + 2.0 * PL_W_ROUND) * p->c.q_lora_rank);
}

/* mf_task_attn_core, one item at position pos: RoPE, the window KV (norm, fake quant, ring), the
 * compressor and indexer (the indexer's wk on the kernels), scores and values over the window and
 * the selected compressed entries, sinks, and their roundings. */
static double pl_attn_core_ns(const mf_plan *p, int L, int64_t pos)
{
    const mf_config *c = &p->c;
    double D = c->head_dim, nh = c->n_heads;
    int64_t W = c->sliding_window, n_win = pos + 1 < W ? pos + 1 : W, n_sel = 0, n_vis = 0;
    int ratio = c->compress_ratios[L];
    if (ratio > 0) {
        n_vis = (pos + 1) / ratio;
        n_sel = n_vis < c->index_topk ? n_vis : c->index_topk;
    }
    double fl = 4.0 * D + 2.0 * nh * D * (double)(n_win + n_sel) +
                PL_W_ROUND * (3.0 * nh * D + nh * (double)c->qk_rope_head_dim + 4.0 * D);
    if (mf_config_is_index_source(c, L) && n_vis > 0) fl += (double)n_vis * c->index_n_heads * c->index_head_dim;
    return pl_attn_kern_ns(p, L, PL_ST_CORE, 1, 1) + pl_ref(p, fl);
}

/* Rows of part q of `parts` over n_rows, as step.c's mf_step_rows splits them (chunks rounded up
 * to 16 rows: with few rows the last parts are empty). */
static double pl_part_rows(int64_t n_rows, int parts, int q)
{
    int64_t chunk = (n_rows + parts - 1) / parts;
    chunk = (chunk + 15) / 16 * 16;
    int64_t a = q * chunk, b = a + chunk;
    a = a < n_rows ? a : n_rows;
    b = b < n_rows ? b : n_rows;
    return (double)(b - a);
}

/* Engram as step.c runs it (ref_engram.c's phases): per item an embed task and a gate task, the
 * wkv projection in row parts over all items between them. */

/* mf_task_engram_embed, one item: the table rows (dequantized; streamed tables read each row as an
 * aligned block at the disk's depth). */
static double pl_engram_embed_ns(const mf_plan *p, int L, uint64_t *bytes_read)
{
    const mf_config *c = &p->c;
    const pl_layer *y = &p->layer[L];
    double rows = (double)(c->engram_max_ngram_size - 1) * c->engram_n_heads;
    double ns = pl_ref(p, rows * c->engram_head_dim * 2);
    if (p->o.tables == MF_PLAN_STORE_STREAMED) {
        double b = rows * ceil(y->eng_row_bytes / PL_STORE_ALIGN) * PL_STORE_ALIGN;
        ns += p->prof.disk_latency_ns + b / p->prof.disk_bytes_per_s * 1e9;
        *bytes_read += (uint64_t)b;
    }
    return ns;
}

/* mf_task_engram_rows: part q of `parts` of the wkv projection ((hc + 1) x hidden rows, fp8 on
 * the kernels) for n items, its share of the bytes and multiply-adds by its rows. */
static double pl_engram_rows_ns(const mf_plan *p, int L, int parts, int q, int n)
{
    const pl_layer *y = &p->layer[L];
    double R = (double)(p->c.hc_mult + 1) * p->c.hidden_size, f = pl_part_rows((int64_t)R, parts, q) / R;
    return f > 0 ? pl_host(p, MF_KF_FP8, y->eng_fp8_bytes * f, y->eng_fp8_macs * f, n) : 0;
}

/* mf_task_engram_gate, one item: the q/k weights and the gating of each stream, its roundings. */
static double pl_engram_gate_ns(const mf_plan *p, int L)
{
    const mf_config *c = &p->c;
    return pl_host(p, MF_KF_BF16, p->layer[L].eng_bf16_bytes, 0, 1) +
           pl_ref(p, 6.0 * (c->hc_mult + 1) * c->hidden_size + PL_W_ROUND * (c->hc_mult + 1.0) * c->hidden_size);
}

/* mf_task_gate_rows: part q of `parts` of the router's logits (n_routed_experts bf16 rows, the
 * reference's scalar double sums) for n items. */
static double pl_gate_rows_ns(const mf_plan *p, int parts, int q, int n)
{
    return pl_ref(p, n * PL_W_DOT_BF16 * p->H * pl_part_rows(p->E, parts, q));
}

/* ---- setup --------------------------------------------------------------------------------- */

static int pl_sizes(mf_plan *p)
{
    mf_layout *lay;
    int rc = mf_layout_build(&p->c, &lay);
    if (rc) return mf_error_wrap(rc, "plan: the layout of the config");
    p->layer = calloc((size_t)p->n_layers, sizeof *p->layer);
    if (!p->layer) {
        mf_layout_free(lay);
        return mf_error(-ENOMEM, "plan: out of memory");
    }
    int n = mf_layout_n(lay);
    for (int i = 0; i < n; i++) {
        const mf_layout_tensor *t = mf_layout_at(lay, i);
        double b = (double)t->n_bytes;
        if (t->layer < 0) {
            if (!strcmp(t->name, "head.weight")) p->head_bytes = b;
            continue;
        }
        pl_layer *y = &p->layer[t->layer];
        const char *nm = t->name;
        if (t->group == MF_GROUP_ATTN && strstr(nm, ".wo_a.")) {
            /* ref_attn.c runs the grouped wo_a through mf_ref_linear_rows: scalar, not the kernels */
            if (t->role == MF_ROLE_FP8_WEIGHT) y->attn_ref_macs += (double)t->shape[0] * (double)t->shape[1];
        } else if (t->group == MF_GROUP_ATTN) {
            /* mf_ref_attn_linears: what reads the input (in), the normed low-rank query (qb), the
             * heads' output (ob); the indexer's wk reads compressed latents inside the core */
            int st = strstr(nm, ".attn.wq_b.") || strstr(nm, ".indexer.wq_b.") ? PL_ST_QB
                     : strstr(nm, ".attn.wo_b.")                                ? PL_ST_OB
                     : strstr(nm, ".indexer.wk.")                               ? PL_ST_CORE
                                                                                : PL_ST_IN;
            double macs = t->n_dims == 2 ? (double)t->shape[0] * (double)t->shape[1] : 0;
            if (t->role == MF_ROLE_FP8_WEIGHT) {
                y->st_fp8_calls[st]++;
                y->st_fp8_macs[st] += macs;
            }
            if (t->role == MF_ROLE_FP8_WEIGHT || t->role == MF_ROLE_FP8_SCALE) y->st_fp8_bytes[st] += b;
            if (t->role == MF_ROLE_LINEAR) {
                y->st_bf16_bytes[st] += b;
                y->st_bf16_macs[st] += macs;
                y->st_bf16_calls[st]++;
            }
        } else if (t->group == MF_GROUP_SHARED_EXPERTS) {
            if (strstr(nm, ".w2.")) p->sh_down_bytes += b;
            else p->sh_up_bytes += b;
            if (t->role == MF_ROLE_FP8_WEIGHT && strstr(nm, ".w1.")) p->Ish = (double)t->shape[0];
        } else if (t->group == MF_GROUP_ENGRAM) {
            if (t->role == MF_ROLE_FP8_WEIGHT || t->role == MF_ROLE_FP8_SCALE) y->eng_fp8_bytes += b;
            if (t->role == MF_ROLE_FP8_WEIGHT) y->eng_fp8_macs += (double)t->shape[0] * (double)t->shape[1];
            else if (t->role == MF_ROLE_LINEAR) y->eng_bf16_bytes += b;
            else if (t->role == MF_ROLE_TABLE || t->role == MF_ROLE_TABLE_SCALE)
                y->eng_row_bytes += b / (double)t->shape[0];
        } else if (t->role == MF_ROLE_HC_FN) {
            y->hc_macs += (double)t->shape[0] * (double)t->shape[1];
        } else if (t->group == MF_GROUP_EXPERTS && t->layer == 0 && strstr(nm, ".experts.0.")) {
            int k = strstr(nm, ".w1.") ? 0 : strstr(nm, ".w2.") ? 1 : 2, sc = t->role == MF_ROLE_FP4_SCALE;
            p->part_bytes[2 * k + sc] = b;
            if (k == 1) p->down_bytes += b;
            else p->up_bytes += b;
        }
    }
    mf_layout_free(lay);
    p->sh_up_bytes /= p->n_layers;
    p->sh_down_bytes /= p->n_layers;
    /* step.c mf_step_dev_setup: each part 256-aligned in a card's slot */
    p->xslot_bytes = p->store_slot_bytes = 0;
    for (int k = 0; k < 6; k++) {
        p->xslot_bytes += ceil(p->part_bytes[k] / 256) * 256;
        p->store_slot_bytes += ceil(p->part_bytes[k] / PL_STORE_ALIGN) * PL_STORE_ALIGN;
    }
    return 0;
}

static int pl_check(const mf_plan_opts *o)
{
    if (!o || !o->config || !o->profile)
        return mf_error(-EINVAL, "plan: options need a config and a profile");
    const mf_profile *f = o->profile;
    if (o->placement < MF_STEP_PLACE_HOST || o->placement > MF_STEP_PLACE_HYBRID)
        return mf_error(-EINVAL, "plan: placement %d (expected host, seed or hybrid)", o->placement);
    if (o->batch < 0 || o->batch > MF_STEP_MAX_ITEMS)
        return mf_error(-EINVAL, "plan: batch %d (expected 1..%d)", o->batch, MF_STEP_MAX_ITEMS);
    if (o->n_cards < 0 || o->n_cards > PL_MAX_CARDS)
        return mf_error(-EINVAL, "plan: %d cards (expected 0..%d)", o->n_cards, PL_MAX_CARDS);
    if (o->placement != MF_STEP_PLACE_HOST && (o->n_cards ? o->n_cards : f->n_cards) < 1)
        return mf_error(-EINVAL, "plan: placement %s needs cards; profile '%s' has none and no card count "
                        "was given", o->placement == MF_STEP_PLACE_SEED ? "seed" : "hybrid", f->name);
    if (o->n_sockets < 0 || o->threads_per_socket < 0 || o->threads_per_socket > 256)
        return mf_error(-EINVAL, "plan: %d sockets x %d threads", o->n_sockets, o->threads_per_socket);
    if (o->read_window < -1 || o->read_window > 4096)
        return mf_error(-EINVAL, "plan: read window %d (expected -1 for all, 0 for the default 2, or 1..4096)",
                        o->read_window);
    if (o->copy_slots < 0 || o->copy_slots > 64)
        return mf_error(-EINVAL, "plan: %d copy slots per card (expected 0..64)", o->copy_slots);
    if (o->dev_cache_policy != MF_PLAN_CACHE_LFU && o->dev_cache_policy != MF_PLAN_CACHE_LRU)
        return mf_error(-EINVAL, "plan: cache policy %d (expected lfu or lru)", o->dev_cache_policy);
    if ((o->store != MF_PLAN_STORE_RESIDENT && o->store != MF_PLAN_STORE_STREAMED) ||
        (o->tables != MF_PLAN_STORE_RESIDENT && o->tables != MF_PLAN_STORE_STREAMED))
        return mf_error(-EINVAL, "plan: store modes %d / %d (expected resident or streamed)", o->store, o->tables);
    if (o->context < 0) return mf_error(-EINVAL, "plan: context %" PRId64 " tokens", o->context);
    if (!(o->dev_task_ns >= 0 && o->dev_task_ns < 1e9))
        return mf_error(-EINVAL, "plan: device task time %g ns (expected 0..1e9)", o->dev_task_ns);
    int thr = (o->n_sockets ? o->n_sockets : f->n_sockets) * (o->threads_per_socket ? o->threads_per_socket
                                                                                  : f->threads_per_socket);
    if (thr < 1 || thr > 256)
        return mf_error(-EINVAL, "plan: %d engine threads (expected 1..256; the profile says %d sockets x %d)",
                        thr, f->n_sockets, f->threads_per_socket);
    static const char *const fam[MF_KF_N] = {"fp4", "fp8", "bf16", "ref"};
    for (int k = 0; k < MF_KF_N; k++)
        if (!(k == MF_KF_REF ? f->host[k].macs_per_s > 0 : f->host[k].bytes_per_s > 0))
            return mf_error(-EINVAL, "plan: profile '%s' has no host %s rate", f->name, fam[k]);
    if (o->store == MF_PLAN_STORE_STREAMED || o->tables == MF_PLAN_STORE_STREAMED)
        if (!(f->disk_bytes_per_s > 0))
            return mf_error(-EINVAL, "plan: a streamed store needs the profile's disk_bytes_per_s (profile '%s')",
                            f->name);
    if (o->placement != MF_STEP_PLACE_HOST &&
        !(f->card[MF_KF_FP4].bytes_per_s > 0 && f->h2d_bytes_per_s > 0 && f->d2h_bytes_per_s > 0))
        return mf_error(-EINVAL, "plan: placement on cards needs the profile's card fp4, h2d and d2h rates "
                        "(profile '%s')", f->name);
    return mf_config_validate("plan", o->config);
}

/* The expert caches' bookkeeping: the streamed store's policy (LFU with aging, as host/store.c)
 * and each card's (dev_policy; LFU as device/expert_cache.c), the policy of sched/residency.h
 * over (layer, expert) items L x E + e, all carved from one block. -ENOMEM. */
static int pl_caches_new(mf_plan *p, int store_slots, const int *dev_slots, mf_resid_policy dev_policy)
{
    int n_items = p->n_layers * p->E, n = 0;
    mf_resid_opts ro[1 + PL_MAX_CARDS];
    mf_resid **dst[1 + PL_MAX_CARDS];
    if (p->streamed) {
        ro[n] = (mf_resid_opts){.policy = MF_RESID_LFU, .n_items = n_items, .n_slots = store_slots};
        dst[n++] = &p->store;
    }
    for (int cd = 0; cd < p->n_cards; cd++) {
        ro[n] = (mf_resid_opts){.policy = dev_policy, .n_items = n_items, .n_slots = dev_slots[cd]};
        dst[n++] = &p->dev[cd];
    }
    if (!n) return 0;
    size_t total = 0;
    for (int i = 0; i < n; i++) total += mf_resid_bytes(&ro[i]);
    uint8_t *mem = p->resid_mem = malloc(total);
    if (!mem) return mf_error(-ENOMEM, "plan: out of memory for the expert caches (%zu bytes)", total);
    for (int i = 0; i < n; i++) {
        size_t b = mf_resid_bytes(&ro[i]);
        int rc = mf_resid_init(&ro[i], mem, b, dst[i]);
        if (rc) return rc;
        mem += b;
    }
    return 0;
}

int mf_plan_new(const mf_plan_opts *o, mf_plan **out)
{
    *out = NULL;
    int rc = pl_check(o);
    if (rc) return rc;
    mf_plan *p = calloc(1, sizeof *p);
    if (!p) return mf_error(-ENOMEM, "plan: out of memory");
    p->o = *o;
    p->c = *o->config;
    p->prof = *o->profile;
    const mf_profile *f = &p->prof;
    const mf_config *c = &p->c;
    p->H = c->hidden_size;
    p->I = c->moe_intermediate_size;
    p->K = c->n_experts_per_tok;
    p->E = c->n_routed_experts;
    p->hc = c->hc_mult;
    p->n_layers = c->n_layers;
    p->batch = o->batch ? o->batch : 1;
    p->n_threads = (o->n_sockets ? o->n_sockets : f->n_sockets) *
                   (o->threads_per_socket ? o->threads_per_socket : f->threads_per_socket);
    p->n_cores = f->n_sockets * f->threads_per_socket;
    p->n_cards = o->placement == MF_STEP_PLACE_HOST ? 0 : o->n_cards ? o->n_cards : f->n_cards;
    p->emulated = f->cards_emulated;
    p->read_window = o->read_window ? o->read_window : 2;
    p->copy_slots = o->copy_slots ? o->copy_slots : 1;
    p->streamed = o->store == MF_PLAN_STORE_STREAMED;
    p->pos = o->context ? o->context : 16;
    p->rng = o->seed ^ 0x6d6f65666c6f77ULL;
    /* all threads of a socket streaming weights share its memory bandwidth */
    int per_socket = o->threads_per_socket ? o->threads_per_socket : f->threads_per_socket;
    p->cpu_bytes_per_s = f->mem_bytes_per_s > 0 ? f->mem_bytes_per_s / per_socket : 0;
    if ((rc = pl_sizes(p))) goto fail;

    /* lanes as mf_step_new / mf_step_dev_setup, with the engine's models (from the same profile,
     * as an engine given it: `moeflow decode --profile P`) for priorities and hybrid placement */
    mf_step_lane_models(f, p->n_threads, p->models);
    if (o->cpu_bytes_per_s > 0) p->models[0].bytes_per_s = o->cpu_bytes_per_s;
    p->lanes[0] = (mf_lane_desc){.kind = MF_LANE_CPU, .name = "cpu", .concurrency = p->n_threads,
                                 .numa_node = -1, .model = p->models[0]};
    p->lane_core[0] = 1;
    p->n_lanes = 1;
    p->io_lane = -1;
    if (p->streamed) {
        p->io_lane = p->n_lanes++;
        /* one pipe at the disk's bandwidth: reads queue at depth, the latency overlaps */
        p->lanes[p->io_lane] = (mf_lane_desc){.kind = MF_LANE_IO, .name = "io", .concurrency = 1,
                                              .numa_node = -1, .model = {.bytes_per_s = 2e9, .latency_ns = 1e5}};
    }
    p->dev_lane0 = p->n_lanes;
    for (int cd = 0; cd < p->n_cards; cd++) {
        static const char *const kn[3] = {"h2d", "compute", "d2h"};
        static const mf_lane_kind kk[3] = {MF_LANE_DEV_COPY_IN, MF_LANE_DEV_COMPUTE, MF_LANE_DEV_COPY_OUT};
        for (int k = 0; k < 3; k++) {
            int l = p->n_lanes++;
            snprintf(p->lane_names[l], sizeof p->lane_names[l], "dev%d.%s", cd, kn[k]);
            mf_lane_model m = p->models[k + 1];
            /* one stream per lane: its operations run in order */
            p->lanes[l] = (mf_lane_desc){.kind = kk[k], .name = p->lane_names[l],
                                         .concurrency = k == 0 ? p->copy_slots : 1, .numa_node = -1,
                                         .device = cd, .model = m};
            p->lane_core[l] = k == 1 && p->emulated;
        }
    }
    p->emu_lane = -1;
    if (p->n_cards && p->emulated) {
        /* emulated cards are host threads: each device task's round trip through its stream
         * (the stream's thread running its operations in order, the callback) needs a host core:
         * per stream a lane of one, in the pool */
        if (p->n_lanes + 3 * p->n_cards > MF_PLAN_MAX_LANES) {
            rc = mf_error(-EINVAL, "plan: %d emulated cards need %d lanes (at most %d)", p->n_cards,
                          p->n_lanes + 3 * p->n_cards, MF_PLAN_MAX_LANES);
            goto fail;
        }
        p->emu_lane = p->n_lanes;
        for (int cd = 0; cd < p->n_cards; cd++)
            for (int k = 0; k < 3; k++) {
                int l = p->n_lanes++;
                snprintf(p->lane_names[l], sizeof p->lane_names[l], "dev%d.%s.thr", cd,
                         k == 0 ? "in" : k == 1 ? "ffn" : "out");
                p->lanes[l] = (mf_lane_desc){.kind = MF_LANE_CPU, .name = p->lane_names[l], .concurrency = 1,
                                             .numa_node = -1, .model = {.latency_ns = 5000}};
                p->lane_core[l] = 1;
            }
    }

    /* caches */
    int store_slots = 0, dev_slots[PL_MAX_CARDS] = {0};
    if (p->streamed) {
        uint64_t budget = o->store_budget_bytes ? o->store_budget_bytes : UINT64_C(2) << 30;
        int64_t slots = (int64_t)(budget / p->store_slot_bytes);
        int need = p->batch * p->K < p->E ? p->batch * p->K : p->E;
        if (slots < need) {
            rc = mf_error(-ENOSPC, "plan: a store budget of %" PRIu64 " bytes holds %" PRId64 " experts of %.0f "
                          "bytes; a decode batch of %d pins up to %d experts of a layer: at least %.0f bytes",
                          budget, slots, p->store_slot_bytes, p->batch, need, need * p->store_slot_bytes);
            goto fail;
        }
        if (slots > (int64_t)p->n_layers * p->E) slots = (int64_t)p->n_layers * p->E;
        store_slots = (int)slots;
    }
    for (int cd = 0; cd < p->n_cards; cd++) {
        /* mf_dev_xcache_new: the budget's slots, or every expert halved until the card holds them */
        int64_t n_items = (int64_t)p->n_layers * p->E, slots;
        if (o->dev_cache_bytes) {
            slots = (int64_t)(o->dev_cache_bytes / p->xslot_bytes);
        } else {
            slots = n_items;
            while (slots > 1 && f->card_mem_bytes && slots * p->xslot_bytes > (double)f->card_mem_bytes)
                slots /= 2;
        }
        if (slots > n_items) slots = n_items;
        if (slots < 1) {
            rc = mf_error(-ENOSPC, "plan: card %d: a cache of %" PRIu64 " bytes holds no expert of %.0f bytes",
                          cd, o->dev_cache_bytes ? o->dev_cache_bytes : f->card_mem_bytes, p->xslot_bytes);
            goto fail;
        }
        dev_slots[cd] = (int)slots;
    }
    if ((rc = pl_caches_new(p, store_slots, dev_slots,
                            o->dev_cache_policy == MF_PLAN_CACHE_LRU ? MF_RESID_LRU : MF_RESID_LFU)))
        goto fail;
    p->ex = malloc(sizeof *p->ex * (size_t)p->n_layers * p->batch * p->K);
    if (!p->ex) {
        rc = mf_error(-ENOMEM, "plan: out of memory");
        goto fail;
    }
    *out = p;
    return 0;
fail:
    mf_plan_free(p);
    return rc;
}

void mf_plan_free(mf_plan *p)
{
    if (!p) return;
    mf_timeline_destroy(p->tl);
    mf_graph_destroy(p->g);
    free(p->resid_mem);
    free(p->task_ns);
    free(p->noop_ids);
    free(p->phase_of);
    free(p->kind_of);
    free(p->layer);
    free(p->ex);
    free(p);
}

/* ---- routing ------------------------------------------------------------------------------- */

static uint64_t pl_next(uint64_t *s)   /* splitmix64 */
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* The step's routes, ex[(L * batch + t) * K + j], from the routing or uniform draws. */
static int pl_route(mf_plan *p)
{
    int n = p->batch, K = p->K, E = p->E;
    if (p->o.routing) return mf_routing_next(p->o.routing, n, p->ex);
    for (int L = 0; L < p->n_layers; L++)
        for (int t = 0; t < n; t++) {
            int32_t *e = p->ex + ((size_t)L * n + t) * K;
            for (int j = 0; j < K; j++) {
                int x, dup;
                do {
                    x = (int)(pl_next(&p->rng) % (uint64_t)E);
                    dup = 0;
                    for (int i = 0; i < j; i++) dup |= e[i] == x;
                } while (dup);
                e[j] = x;
            }
        }
    return 0;
}

/* ---- the step graph ------------------------------------------------------------------------ */

typedef struct pl_builder {
    mf_plan *p;
    int rc;
} pl_builder;

static mf_task_id pl_add(pl_builder *b, const char *name, int lane, int phase, int kind, double rank_bytes,
                         double rank_ns, double ns)
{
    mf_plan *p = b->p;
    if (b->rc) return -1;
    int n = mf_graph_n_tasks(p->g);
    if (n == p->cap_tasks) {
        int cap = p->cap_tasks ? 2 * p->cap_tasks : 4096;
        int64_t *t = realloc(p->task_ns, sizeof *t * (size_t)cap);
        if (t) p->task_ns = t;
        uint8_t *ph = realloc(p->phase_of, (size_t)cap);
        if (ph) p->phase_of = ph;
        uint8_t *k = realloc(p->kind_of, (size_t)cap);
        if (k) p->kind_of = k;
        if (!t || !ph || !k) {
            b->rc = mf_error(-ENOMEM, "plan: out of memory for %d tasks", cap);
            return -1;
        }
        p->cap_tasks = cap;
    }
    static mf_io_read no_read = {.fd = -1};
    mf_task_desc d = {.name = name, .lane = lane, .arg = p->lanes[lane].kind == MF_LANE_IO ? &no_read : NULL,
                      .cost = {.bytes = rank_bytes, .time_ns = rank_ns}, .place_hint = -1};
    mf_task_id t = mf_graph_add_task(p->g, &d);
    if (t < 0) {
        b->rc = t;
        return -1;
    }
    /* every task pays the executor's cost of starting and finishing it */
    p->task_ns[t] = llround(ns + p->prof.task_overhead_ns);
    p->phase_of[t] = (uint8_t)phase;
    p->kind_of[t] = (uint8_t)kind;
    return t;
}

/* t has nothing to do this step: as step.c's route task marks it (mf_step_mark_noop), it is
 * marked noop once the graph is finalized, so the simulator completes it the instant it is ready,
 * at no cost and on no lane. */
static void pl_noop(pl_builder *b, mf_task_id t)
{
    mf_plan *p = b->p;
    if (b->rc || t < 0) return;
    if (p->n_noop == p->cap_noop) {
        int cap = p->cap_noop ? 2 * p->cap_noop : 1024;
        mf_task_id *v = realloc(p->noop_ids, sizeof *v * (size_t)cap);
        if (!v) {
            b->rc = mf_error(-ENOMEM, "plan: out of memory");
            return;
        }
        p->noop_ids = v;
        p->cap_noop = cap;
    }
    p->noop_ids[p->n_noop++] = t;
    p->task_ns[t] = 0;
}

static void pl_dep(pl_builder *b, mf_task_id before, mf_task_id after)
{
    if (!b->rc && before >= 0 && after >= 0) b->rc = mf_graph_add_dep(b->p->g, before, after);
}

/* mf_step_lane_ns: the engine's own model of a lane, which its hybrid placement weighs. */
static double pl_lane_ns(const mf_lane_desc *l, double bytes)
{
    return l->model.latency_ns + (l->model.bytes_per_s > 0 ? bytes / l->model.bytes_per_s * 1e9 : 0);
}

typedef struct pl_slot {
    int e, cnt, card, miss, store_miss;
} pl_slot;

/* mf_task_route's slot table (distinct experts ascending, their token counts), the store's begin
 * (hits and misses, pinned) and mf_step_place (card or host; cache slots taken and pinned). */
static int pl_layer_slots(mf_plan *p, int L, pl_slot *sl, int *n_used, mf_plan_report *r)
{
    int n = p->batch, K = p->K, E = p->E, ns = 0;
    int32_t cnt[4096];
    int32_t *cn = E <= 4096 ? cnt : calloc((size_t)E, sizeof *cn);
    if (!cn) return mf_error(-ENOMEM, "plan: out of memory");
    memset(cn, 0, sizeof *cn * (size_t)E);
    for (int j = 0; j < n * K; j++) cn[p->ex[(size_t)L * n * K + j]]++;
    for (int e = 0; e < E; e++)
        if (cn[e]) sl[ns++] = (pl_slot){.e = e, .cnt = cn[e], .card = -1};
    if (cn != cnt) free(cn);
    *n_used = ns;
    if (p->streamed)
        for (int s = 0; s < ns; s++) {
            int slot, hit = mf_resid_acquire(p->store, L * E + sl[s].e, &slot);
            if (hit < 0) return mf_error(-ENOSPC, "plan: the expert store's slots are all pinned (internal)");
            sl[s].store_miss = !hit;
            if (hit) r->store_hits++;
            else {
                r->store_misses++;
                r->store_bytes_read += (uint64_t)p->store_slot_bytes;
            }
        }
    if (!p->n_cards) {
        r->host_slots += ns;
        return 0;
    }
    /* mf_step_place */
    double bytes = p->xslot_bytes, W = p->n_threads;
    double host_q = 0, copy_q[PL_MAX_CARDS] = {0}, comp_q[PL_MAX_CARDS] = {0};
    mf_lane_desc cpu = {.model = p->models[0]};
    for (int s = 0; s < ns; s++) {
        int e = sl[s].e, c = (int)(((int64_t)e + L) % p->n_cards);   /* mf_dev_xcache_owner */
        if (p->n_cards <= 1) c = 0;
        const mf_lane_desc *lin = &p->lanes[p->dev_lane0 + 3 * c], *lc = lin + 1;
        double host_ns = pl_lane_ns(&cpu, bytes) * (1 + 0.02 * sl[s].cnt);
        double copy_ns = mf_resid_slot(p->dev[c], L * p->E + e) >= 0 ? 0 : pl_lane_ns(lin, bytes);
        double comp_ns = pl_lane_ns(lc, bytes) * (1 + 0.02 * sl[s].cnt);
        double t_dev = (copy_q[c] + copy_ns > comp_q[c] ? copy_q[c] + copy_ns : comp_q[c]) + comp_ns;
        double t_host = (host_q + host_ns) / W;
        if (p->o.placement == MF_STEP_PLACE_HYBRID && t_host <= t_dev) {
            host_q += host_ns;
            r->host_slots++;
            continue;
        }
        int slot, hit = mf_resid_acquire(p->dev[c], L * p->E + e, &slot);
        if (hit == -ENOSPC) {
            host_q += host_ns;
            r->host_slots++;
            r->host_fallbacks++;
            continue;
        }
        copy_q[c] += copy_ns;
        comp_q[c] = t_dev;
        sl[s].card = c;
        sl[s].miss = !hit;
        r->dev_slots++;
        if (hit) r->dev_hits++;
        else {
            r->dev_misses++;
            r->dev_bytes_in += (uint64_t)p->xslot_bytes;
        }
    }
    return 0;
}

/* mf_task_moe_done: the layer's store batch closed and its pins (store, cards) released. */
static void pl_layer_done(mf_plan *p, int L, const pl_slot *sl, int n_used)
{
    for (int s = 0; s < n_used; s++) {
        int item = L * p->E + sl[s].e;
        if (p->streamed) mf_resid_unpin(p->store, mf_resid_slot(p->store, item));
        if (sl[s].card >= 0) mf_resid_unpin(p->dev[sl[s].card], mf_resid_slot(p->dev[sl[s].card], item));
    }
}

/* mf_step_build_graph for a parallel decode shape (serial when batch is 1, as step.c: one task
 * each for the per-item parts, combine and norm), with this step's slot table and
 * placement deciding which slot tasks do work. */
static int pl_build(mf_plan *p, mf_plan_report *r)
{
    const mf_config *c = &p->c;
    int n = p->batch, par = n > 1, u = par ? n : 1, K = p->K, E = p->E, W = p->n_threads;
    int n_slots = n * K < E ? n * K : E;
    int p_exp = n_slots >= 2 * W ? 1 : (2 * W + n_slots - 1) / n_slots;
    if (p_exp > 8) p_exp = 8;
    int p_sh = c->n_shared_experts > 0 ? (W < 8 ? W : 8) : 0, p_head = 2 * W, n_parts = 6;
    int win = p->read_window;
    double H = p->H, I = p->I, per = (double)n / u;
    mf_graph_destroy(p->g);
    p->g = NULL;
    mf_timeline_destroy(p->tl);
    p->tl = NULL;
    int rc = mf_graph_create(p->lanes, p->n_lanes, &p->g);
    if (rc) return rc;
    pl_builder b = {p, 0};
    p->n_noop = 0;
    pl_slot *sl = malloc(sizeof *sl * (size_t)n_slots);
    mf_task_id *io_ids = malloc(sizeof *io_ids * ((size_t)n_slots * n_parts + 1));
    mf_task_id unit[MF_STEP_MAX_ITEMS], at[MF_STEP_MAX_ITEMS], emb[MF_STEP_MAX_ITEMS], wr[PL_MAX_ATTN_PARTS];
    mf_task_id apre[MF_STEP_MAX_ITEMS], core[MF_STEP_MAX_ITEMS], rows[4][PL_MAX_ATTN_PARTS];
    if (!sl || !io_ids) {
        free(sl);
        free(io_ids);
        return mf_error(-ENOMEM, "plan: out of memory");
    }
    /* step.c's rough costs, kept for the priorities (upward ranks) the executor would use */
    double hc_ns = per * H * c->hc_mult * (c->hc_mult + 4.0);
    double core_ns = per * (double)c->n_heads * c->head_dim * 2.0 * (c->sliding_window + c->index_topk);
    int p_attn = W < PL_MAX_ATTN_PARTS ? W : PL_MAX_ATTN_PARTS;   /* mf_step_shape_new's p_attn */
    double exp_bytes = 3 * H * I * 0.53, sh_bytes = 3 * H * I * 1.0;
    double empty = 0;   /* a host task whose slot is elsewhere: marked noop below, no cost */
    /* a device task with nothing to do returns MF_TASK_NO_WORK: it completes at once on the
     * submitting thread, without a round trip through its stream (sched/lane_dev.c) */
    double dev_empty = 0;
    const mf_profile *f = &p->prof;
    char name[64];
    for (int k = 0; k < u; k++) unit[k] = -1;
    for (int L = 0; L < c->n_layers && !b.rc; L++) {
        int n_used = 0;
        int64_t pos = p->pos;
        if ((b.rc = pl_layer_slots(p, L, sl, &n_used, r))) break;
        if (mf_config_engram_slot(c, L) >= 0) {   /* [per unit: embed] -> wkv parts -> [per unit: gate] */
            for (int k = 0; k < u; k++) {
                snprintf(name, sizeof name, par ? "engram L%d embed item %d" : "engram L%d embed", L, k);
                double ns = 0;
                for (int i = 0; i < (par ? 1 : n); i++) ns += pl_engram_embed_ns(p, L, &r->table_bytes_read);
                emb[k] = pl_add(&b, name, 0, MF_STEP_ENGRAM, PL_K_OTHER, 0, per * 2e4, ns);
                pl_dep(&b, unit[k], emb[k]);
            }
            for (int q = 0; q < p_attn; q++) {
                snprintf(name, sizeof name, "engram L%d wkv %d", L, q);
                wr[q] = pl_add(&b, name, 0, MF_STEP_ENGRAM, PL_K_OTHER, p->layer[L].eng_fp8_bytes / p_attn, 0,
                               pl_engram_rows_ns(p, L, p_attn, q, n));
                for (int k = 0; k < u; k++) pl_dep(&b, emb[k], wr[q]);
            }
            for (int k = 0; k < u; k++) {
                snprintf(name, sizeof name, par ? "engram L%d gate item %d" : "engram L%d gate", L, k);
                unit[k] = pl_add(&b, name, 0, MF_STEP_ENGRAM, PL_K_OTHER, 0, per * 8.0 * c->hc_mult * H,
                                 per * pl_engram_gate_ns(p, L));
                for (int q = 0; q < p_attn; q++) pl_dep(&b, wr[q], unit[k]);
            }
        }
        for (int k = 0; k < u; k++) {
            snprintf(name, sizeof name, par ? "attn L%d pre item %d" : "attn L%d pre", L, k);
            apre[k] = pl_add(&b, name, 0, MF_STEP_ATTN, PL_K_OTHER, 0, hc_ns, per * pl_attn_pre_ns(p, L));
            pl_dep(&b, unit[k], apre[k]);
        }
        /* the attention's row-split stages, q norm, core and post (mf_step_build_graph) */
        static const char *const st_name[4] = {"in", "qb", "oa", "ob"};
        for (int st = 0; st < 4; st++) {
            double st_bytes = p->layer[L].st_fp8_bytes[st] + p->layer[L].st_bf16_bytes[st] +
                              (st == PL_ST_OA ? p->layer[L].attn_ref_macs : 0);
            double ns = pl_attn_rows_ns(p, L, st, p_attn, n);
            for (int q = 0; q < p_attn; q++) {
                snprintf(name, sizeof name, "attn L%d %s %d", L, st_name[st], q);
                rows[st][q] = pl_add(&b, name, 0, MF_STEP_ATTN, PL_K_OTHER, st_bytes / p_attn, 0, ns);
            }
        }
        snprintf(name, sizeof name, "attn L%d q norm", L);
        mf_task_id qn = pl_add(&b, name, 0, MF_STEP_ATTN, PL_K_OTHER, 0, n * 4.0 * c->q_lora_rank,
                               pl_attn_qnorm_ns(p, n));
        snprintf(name, sizeof name, "attn L%d oa join", L);
        mf_task_id oj = pl_add(&b, name, 0, MF_STEP_ATTN, PL_K_OTHER, 0, 0, 0);
        for (int k = 0; k < u; k++) {
            snprintf(name, sizeof name, par ? "attn L%d core item %d" : "attn L%d core", L, k);
            double ns = 0;
            for (int i = 0; i < (par ? 1 : n); i++) ns += pl_attn_core_ns(p, L, pos);
            core[k] = pl_add(&b, name, 0, MF_STEP_ATTN, PL_K_OTHER, 0, core_ns, ns);
            snprintf(name, sizeof name, par ? "attn L%d post item %d" : "attn L%d post", L, k);
            at[k] = pl_add(&b, name, 0, MF_STEP_ATTN, PL_K_OTHER, 0, 2 * hc_ns, per * pl_attn_post_ns(p, L));
        }
        for (int q = 0; q < p_attn; q++) {
            for (int k = 0; k < u; k++) {
                pl_dep(&b, apre[k], rows[PL_ST_IN][q]);
                pl_dep(&b, rows[PL_ST_QB][q], core[k]);
                pl_dep(&b, core[k], rows[PL_ST_OA][q]);
                pl_dep(&b, rows[PL_ST_OB][q], at[k]);
            }
            pl_dep(&b, rows[PL_ST_IN][q], qn);
            pl_dep(&b, qn, rows[PL_ST_QB][q]);
            pl_dep(&b, rows[PL_ST_OA][q], oj);
            pl_dep(&b, oj, rows[PL_ST_OB][q]);
        }
        /* route: the top-k of the gate parts' logits, the slot table, gathers, quantization of
         * host slots' inputs */
        double route_fl = n * (H * K * 2.0 + 4.0 * E);
        snprintf(name, sizeof name, "route L%d", L);
        mf_task_id ro = pl_add(&b, name, 0, MF_STEP_MOE, PL_K_OTHER, 0, n * (H * K + 4.0 * E), pl_ref(p, route_fl));
        for (int q = 0; q < p_attn; q++) {
            snprintf(name, sizeof name, "gate L%d %d", L, q);
            mf_task_id gp = pl_add(&b, name, 0, MF_STEP_MOE, PL_K_OTHER, 0, n * H * E / p_attn,
                                   pl_gate_rows_ns(p, p_attn, q, n));
            for (int k = 0; k < u; k++) pl_dep(&b, at[k], gp);
            pl_dep(&b, gp, ro);
        }
        snprintf(name, sizeof name, "moe L%d done", L);
        mf_task_id done = pl_add(&b, name, 0, MF_STEP_MOE, PL_K_OTHER, 0, 0, 0);
        for (int s = 0; s < n_slots; s++) {
            int used = s < n_used, host = used && sl[s].card < 0, cnt = used ? sl[s].cnt : 0;
            snprintf(name, sizeof name, "expert L%d slot %d join", L, s);
            mf_task_id jo = pl_add(&b, name, 0, MF_STEP_MOE, PL_K_EXPERT, 0, I * 2,
                                   host ? pl_ref(p, 2.0 * I * cnt) : empty);
            if (!host) pl_noop(&b, jo);
            mf_task_id *io = io_ids + (size_t)s * n_parts;
            for (int j = 0; p->streamed && j < n_parts; j++) {
                snprintf(name, sizeof name, "read L%d slot %d part %d", L, s, j);
                double rb = used && sl[s].store_miss ? ceil(p->part_bytes[j] / PL_STORE_ALIGN) * PL_STORE_ALIGN : 0;
                double ns = rb > 0 ? f->disk_latency_ns / (f->disk_queue_depth > 0 ? f->disk_queue_depth : 1) +
                                         rb / f->disk_bytes_per_s * 1e9
                                   : 0;
                io[j] = pl_add(&b, name, p->io_lane, MF_STEP_MOE, PL_K_IO, p->store_slot_bytes / n_parts, 0, ns);
                /* an empty read finishes at once, without the executor's task overhead */
                if (io[j] >= 0 && rb == 0) p->task_ns[io[j]] = 0;
                pl_dep(&b, ro, io[j]);
                for (int i = 0; win > 0 && s >= win && i < n_parts; i++)
                    pl_dep(&b, io_ids[(size_t)(s - win) * n_parts + i], io[j]);
            }
            for (int q = 0; q < p_exp; q++) {
                snprintf(name, sizeof name, "expert L%d slot %d up %d", L, s, q);
                mf_task_id up = pl_add(&b, name, 0, MF_STEP_MOE, PL_K_EXPERT, exp_bytes * 2 / 3 / p_exp, 0,
                                       host ? pl_host(p, MF_KF_FP4, p->up_bytes / p_exp, 2 * H * I / p_exp, cnt)
                                            : empty);
                snprintf(name, sizeof name, "expert L%d slot %d down %d", L, s, q);
                /* mf_step_ffn_down rounds each output to bf16 */
                mf_task_id dn = pl_add(&b, name, 0, MF_STEP_MOE, PL_K_EXPERT, exp_bytes / 3 / p_exp, 0,
                                       host ? pl_host(p, MF_KF_FP4, p->down_bytes / p_exp, H * I / p_exp, cnt) +
                                                  pl_ref(p, PL_W_ROUND * H / p_exp * cnt)
                                            : empty);
                if (!host) {
                    pl_noop(&b, up);
                    pl_noop(&b, dn);
                }
                pl_dep(&b, ro, up);
                for (int j = 0; p->streamed && j < n_parts; j++) pl_dep(&b, io[j], up);
                pl_dep(&b, up, jo);
                pl_dep(&b, jo, dn);
                pl_dep(&b, dn, done);
            }
            for (int cd = 0; cd < p->n_cards; cd++) {
                int here = used && sl[s].card == cd, miss = here && sl[s].miss;
                double act = cnt * H * 4.0 + cnt * 4.0;
                double in_ns = here ? (miss ? 8 : 2) * f->h2d_latency_ns +
                                      ((miss ? p->xslot_bytes : 0) + act) / f->h2d_bytes_per_s * 1e9
                                    : dev_empty;
                double ffn_ns = here ? pl_kern(&f->card[MF_KF_FP4], f->card[MF_KF_FP4].bytes_per_s,
                                               p->up_bytes + p->down_bytes, 3 * H * I, cnt)
                                     : dev_empty;
                double out_ns = here ? f->d2h_latency_ns + cnt * H * 4.0 / f->d2h_bytes_per_s * 1e9 : dev_empty;
                snprintf(name, sizeof name, "dev%d L%d slot %d in", cd, L, s);
                mf_task_id din = pl_add(&b, name, p->dev_lane0 + 3 * cd, MF_STEP_MOE, PL_K_COPY, p->xslot_bytes,
                                        0, in_ns);
                snprintf(name, sizeof name, "dev%d L%d slot %d ffn", cd, L, s);
                mf_task_id dff = pl_add(&b, name, p->dev_lane0 + 3 * cd + 1, MF_STEP_MOE, PL_K_DEV,
                                        p->xslot_bytes, 0, ffn_ns);
                snprintf(name, sizeof name, "dev%d L%d slot %d out", cd, L, s);
                mf_task_id dout = pl_add(&b, name, p->dev_lane0 + 3 * cd + 2, MF_STEP_MOE, PL_K_COPY_OUT,
                                         n * H * 4.0, 0, out_ns);
                mf_task_id wk[3] = {-1, -1, -1};
                for (int k = 0; p->emu_lane >= 0 && k < 3; k++) {
                    snprintf(name, sizeof name, "dev%d L%d slot %d %s (threads)", cd, L, s,
                             k == 0 ? "in" : k == 1 ? "ffn" : "out");
                    wk[k] = pl_add(&b, name, p->emu_lane + 3 * cd + k, MF_STEP_MOE, PL_K_WAKE, 0, 0,
                                   (p->o.dev_task_ns > 0 ? p->o.dev_task_ns : f->card[MF_KF_FP4].latency_ns) -
                                       p->prof.task_overhead_ns);
                    if (!here) pl_noop(&b, wk[k]);   /* no stream round trip */
                }
                if (!here) {
                    pl_noop(&b, din);
                    pl_noop(&b, dff);
                    pl_noop(&b, dout);
                }
                mf_task_id first = wk[0] >= 0 ? wk[0] : din;
                pl_dep(&b, ro, first);
                for (int j = 0; p->streamed && j < n_parts; j++) pl_dep(&b, io[j], first);
                pl_dep(&b, wk[0], din);
                pl_dep(&b, din, wk[1] >= 0 ? wk[1] : dff);
                pl_dep(&b, wk[1], dff);
                pl_dep(&b, dff, wk[2] >= 0 ? wk[2] : dout);
                pl_dep(&b, wk[2], dout);
                pl_dep(&b, dout, done);
            }
        }
        snprintf(name, sizeof name, "shared L%d join", L);
        mf_task_id sj = pl_add(&b, name, 0, MF_STEP_MOE, PL_K_OTHER, 0, 0, 0);
        for (int q = 0; q < p_sh; q++) {
            snprintf(name, sizeof name, "shared L%d up %d", L, q);
            mf_task_id up = pl_add(&b, name, 0, MF_STEP_MOE, PL_K_EXPERT, sh_bytes * 2 / 3 / p_sh, 0,
                                   pl_host(p, MF_KF_FP8, p->sh_up_bytes / p_sh, 2 * H * p->Ish / p_sh, n));
            snprintf(name, sizeof name, "shared L%d down %d", L, q);
            mf_task_id dn = pl_add(&b, name, 0, MF_STEP_MOE, PL_K_EXPERT, sh_bytes / 3 / p_sh, 0,
                                   pl_host(p, MF_KF_FP8, p->sh_down_bytes / p_sh, H * p->Ish / p_sh, n) +
                                       pl_ref(p, PL_W_ROUND * H / p_sh * n));
            for (int k = 0; k < u; k++) pl_dep(&b, at[k], up);
            if (p->streamed) pl_dep(&b, ro, up);
            pl_dep(&b, up, sj);
            pl_dep(&b, sj, dn);
            pl_dep(&b, dn, done);
        }
        pl_dep(&b, ro, done);
        for (int k = 0; k < u; k++) {
            snprintf(name, sizeof name, par ? "combine L%d item %d" : "combine L%d", L, k);
            /* per item: K routed outputs rounded and summed, the shared one, the sum rounded, the
             * expand into the streams (rounded) */
            unit[k] = pl_add(&b, name, 0, MF_STEP_MOE, PL_K_OTHER, 0, per * H * (K + 2 + 2 * c->hc_mult),
                             pl_ref(p, per * H * (K + 2 + c->hc_mult * (1 + c->hc_mult) +
                                                  PL_W_ROUND * (K + 1 + c->hc_mult))));
            pl_dep(&b, done, unit[k]);
        }
        pl_layer_done(p, L, sl, n_used);
    }
    mf_task_id hj = pl_add(&b, "head join", 0, MF_STEP_HEAD, PL_K_OTHER, 0, 0, 0);
    for (int k = 0; k < u; k++) {
        snprintf(name, sizeof name, par ? "norm item %d" : "norm", k);
        mf_task_id no = pl_add(&b, name, 0, MF_STEP_HEAD, PL_K_OTHER, 0, per * H * 8,
                               pl_ref(p, per * H * (c->hc_mult + 2 + 3 * PL_W_ROUND)));
        pl_dep(&b, unit[k], no);
        pl_dep(&b, no, hj);
    }
    for (int q = 0; q < p_head; q++) {
        snprintf(name, sizeof name, "head %d", q);
        mf_task_id hd = pl_add(&b, name, 0, MF_STEP_HEAD, PL_K_OTHER, 0, 2.0 * c->vocab_size * H / p_head,
                               pl_host(p, MF_KF_BF16, p->head_bytes / p_head, c->vocab_size * H / p_head, n));
        pl_dep(&b, hj, hd);
    }
    free(sl);
    free(io_ids);
    if (b.rc) return b.rc;
    if ((rc = mf_graph_finalize(p->g))) return rc;
    for (int i = 0; i < p->n_noop; i++) mf_graph_set_noop(p->g, p->noop_ids[i], 1);
    return mf_timeline_create(p->g, &p->tl);
}

/* ---- reports ------------------------------------------------------------------------------- */

static int pl_span_cmp(const void *pa, const void *pb)
{
    const mf_task_span *x = pa, *y = pb;
    return (x->start_ns > y->start_ns) - (x->start_ns < y->start_ns);
}

/* mf_step_account: per phase the union of its tasks' intervals and their summed durations (IO
 * and copy tasks in no phase), lanes' work, the bottleneck. */
static int pl_account(mf_plan *p, mf_plan_report *r)
{
    const mf_task_span *sp = mf_timeline_spans(p->tl);
    int n = mf_graph_n_tasks(p->g), m = 0;
    mf_task_span *sorted = malloc(sizeof *sorted * (size_t)(n ? n : 1));
    if (!sorted) return mf_error(-ENOMEM, "plan: out of memory");
    int64_t end = 0;
    for (int t = 0; t < n; t++) {
        if (sp[t].end_ns > end) end = sp[t].end_ns;
        int l = mf_graph_task(p->g, t)->lane;
        r->lanes[l].busy_ns += sp[t].end_ns - sp[t].start_ns;
        int k = p->kind_of[t];
        if (k == PL_K_IO || k == PL_K_COPY || k == PL_K_COPY_OUT || k == PL_K_WAKE) continue;
        sorted[m] = sp[t];
        sorted[m++].worker = p->phase_of[t];
    }
    qsort(sorted, (size_t)m, sizeof *sorted, pl_span_cmp);
    int64_t cs[MF_STEP_N_PHASES], ce[MF_STEP_N_PHASES];
    for (int q = 0; q < MF_STEP_N_PHASES; q++) cs[q] = ce[q] = -1;
    for (int i = 0; i < m; i++) {
        const mf_task_span *x = &sorted[i];
        int q = x->worker;
        r->busy_ns[q] += x->end_ns - x->start_ns;
        if (x->start_ns > ce[q]) {
            if (ce[q] > cs[q]) r->phase_ns[q] += ce[q] - cs[q];
            cs[q] = x->start_ns;
            ce[q] = x->end_ns;
        } else if (x->end_ns > ce[q]) {
            ce[q] = x->end_ns;
        }
    }
    for (int q = 0; q < MF_STEP_N_PHASES; q++)
        if (ce[q] > cs[q]) r->phase_ns[q] += ce[q] - cs[q];
    int64_t rest = end;
    for (int q = 0; q < MF_STEP_OTHER; q++) rest -= r->phase_ns[q];
    r->phase_ns[MF_STEP_OTHER] = rest > 0 ? rest : 0;
    r->step_ns = end;
    r->n_tasks = n;
    free(sorted);
    return 0;
}

static void pl_shares(const mf_plan *p, mf_plan_report *r, double step_ns)
{
    r->n_lanes = p->n_lanes;
    r->bottleneck = 0;
    for (int l = 0; l < p->n_lanes; l++) {
        snprintf(r->lanes[l].name, sizeof r->lanes[l].name, "%s", p->lanes[l].name);
        r->lanes[l].slots = p->lanes[l].concurrency;
        r->lanes[l].share = step_ns > 0 ? r->lanes[l].busy_ns / (double)r->lanes[l].slots / step_ns : 0;
        if (r->lanes[l].share > r->lanes[r->bottleneck].share) r->bottleneck = l;
    }
}

int mf_plan_step(mf_plan *p, mf_plan_report *out)
{
    mf_plan_report r = {.n_steps = 1, .batch = p->batch};
    int rc = pl_route(p);
    if (rc) return mf_error_wrap(rc, "plan: routing of step %d", p->total.n_steps);
    mf_resid_stats st;
    if (p->store) mf_resid_step(p->store, NULL);
    for (int cd = 0; cd < p->n_cards; cd++) mf_resid_step(p->dev[cd], NULL);
    if ((rc = pl_build(p, &r))) return mf_error_wrap(rc, "plan: building the step graph");
    for (int cd = 0; cd < p->n_cards; cd++) {
        mf_resid_step(p->dev[cd], &st);
        r.dev_evictions += st.evictions;
    }
    if (p->store) {
        mf_resid_step(p->store, &st);
        r.store_evictions = st.evictions;
    }
    rc = mf_sim_run_opts(p->g, &(mf_sim_opts){.task_ns = p->task_ns, .lane_core = p->lane_core,
                                              .n_cores = p->emulated && p->n_cards ? p->n_cores : 0},
                         p->tl);
    if (!rc) rc = pl_account(p, &r);
    if (rc) return rc;
    p->pos++;
    pl_shares(p, &r, (double)r.step_ns);
    r.token_ns = (double)r.step_ns / p->batch;
    /* totals */
    mf_plan_report *t = &p->total;
    t->n_steps++;
    t->batch = p->batch;
    t->step_ns += r.step_ns;
    for (int q = 0; q < MF_STEP_N_PHASES; q++) {
        t->phase_ns[q] += r.phase_ns[q];
        t->busy_ns[q] += r.busy_ns[q];
    }
    for (int l = 0; l < p->n_lanes; l++) t->lanes[l].busy_ns += r.lanes[l].busy_ns;
    t->n_tasks = r.n_tasks;
    t->dev_slots += r.dev_slots;
    t->host_slots += r.host_slots;
    t->host_fallbacks += r.host_fallbacks;
    t->dev_hits += r.dev_hits;
    t->dev_misses += r.dev_misses;
    t->dev_bytes_in += r.dev_bytes_in;
    t->store_hits += r.store_hits;
    t->store_misses += r.store_misses;
    t->store_bytes_read += r.store_bytes_read;
    t->table_bytes_read += r.table_bytes_read;
    t->dev_evictions += r.dev_evictions;
    t->store_evictions += r.store_evictions;
    if (out) *out = r;
    return 0;
}

void mf_plan_total(const mf_plan *p, mf_plan_report *out)
{
    *out = p->total;
    int n = out->n_steps;
    if (!n) {
        *out = (mf_plan_report){.batch = p->batch};
        return;
    }
    out->step_ns = p->total.step_ns / n;
    for (int q = 0; q < MF_STEP_N_PHASES; q++) {
        out->phase_ns[q] /= n;
        out->busy_ns[q] /= n;
    }
    for (int l = 0; l < p->n_lanes; l++) out->lanes[l].busy_ns /= n;
    pl_shares(p, out, (double)p->total.step_ns / n);
    out->token_ns = (double)out->step_ns / p->batch;
}

void mf_plan_reset_totals(mf_plan *p)
{
    p->total = (mf_plan_report){.batch = p->batch};
}

int mf_plan_run(const mf_plan_opts *o, int warmup, int n_steps, mf_plan_report *out)
{
    if (warmup < 0 || n_steps < 1)
        return mf_error(-EINVAL, "plan: %d warm-up and %d measured steps (expected >= 0 and >= 1)", warmup, n_steps);
    mf_plan *p;
    int rc = mf_plan_new(o, &p);
    for (int i = 0; !rc && i < warmup; i++) rc = mf_plan_step(p, NULL);
    if (!rc) mf_plan_reset_totals(p);
    for (int i = 0; !rc && i < n_steps; i++) rc = mf_plan_step(p, NULL);
    if (!rc) mf_plan_total(p, out);
    mf_plan_free(p);
    return rc;
}

int mf_plan_write_trace(const mf_plan *p, const char *path)
{
    if (!p->tl) return mf_error(-EINVAL, "plan: no step has been simulated yet, nothing to trace");
    return mf_timeline_write_chrome(p->tl, path);
}

void mf_plan_print(const mf_plan_report *r, FILE *f)
{
    fprintf(f, "predicted: %.3f ms per step of %d, %.3f ms per token (%.2f tokens/s), %d tasks, mean of %d steps\n",
            r->step_ns / 1e6, r->batch, r->token_ns / 1e6, r->token_ns > 0 ? 1e9 / r->token_ns : 0, r->n_tasks,
            r->n_steps);
    fprintf(f, "\n%-16s %12s %12s\n", "phase", "wall ms", "work ms");
    for (int q = 0; q < MF_STEP_N_PHASES; q++)
        fprintf(f, "%-16s %12.3f %12.3f\n", mf_step_phase_name((mf_step_phase)q), r->phase_ns[q] / 1e6,
                r->busy_ns[q] / 1e6);
    fprintf(f, "\n%-16s %6s %12s %8s\n", "lane", "slots", "work ms", "busy");
    for (int l = 0; l < r->n_lanes; l++)
        fprintf(f, "%-16s %6d %12.3f %7.1f%%%s\n", r->lanes[l].name, r->lanes[l].slots, r->lanes[l].busy_ns / 1e6,
                100 * r->lanes[l].share, l == r->bottleneck ? "  <- bottleneck" : "");
    fprintf(f, "\nrouted-expert slots: %" PRId64 " on cards, %" PRId64 " on the host (%" PRId64 " fallbacks)\n",
            r->dev_slots, r->host_slots, r->host_fallbacks);
    if (r->dev_slots)
        fprintf(f, "device caches: %" PRIu64 " hits, %" PRIu64 " misses, %" PRIu64 " evictions, %.1f MiB in\n",
                r->dev_hits, r->dev_misses, r->dev_evictions, r->dev_bytes_in / 1048576.0);
    if (r->store_hits + r->store_misses)
        fprintf(f, "host store: %" PRIu64 " hits, %" PRIu64 " misses, %" PRIu64 " evictions, %.1f MiB read\n",
                r->store_hits, r->store_misses, r->store_evictions, r->store_bytes_read / 1048576.0);
    if (r->table_bytes_read) fprintf(f, "Engram rows read: %.2f MiB\n", r->table_bytes_read / 1048576.0);
}
