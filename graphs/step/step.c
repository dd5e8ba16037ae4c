/* The scheduled decode engine (graphs/step/step.h): per batch size one graph (graphs/step/stepgraph.c
 * builds it; docs/decode.md draws it), per layer [engram embed -> wkv row parts -> engram gate] ->
 * collapse and attn_norm column parts -> attn linear stages (in, qb, oa, ob; row parts) around the
 * q norm (scale, column parts), the core's prep and its head groups -> expand, collapse and
 * ffn_norm column parts -> gate row parts -> route -> expert slots (up parts -> join -> down parts) and the shared expert
 * -> combine column parts, the mixes in row parts beside them; then the final collapse and norm
 * -> head parts. Tasks read the step's data (items, slot table) from the shape's buffers and their
 * ranges from their records, so the graph never changes. The per-item and per-sequence tasks call
 * the layer math (graphs/layers/layers.h) on the running worker's context.
 *
 * This file: the engine's lifetime (mf_step_new, mf_step_free: the cards' self-check, the lanes, the
 * workers' layer contexts, the scheduler), the forward entry points (forward, prefill, decode: each
 * chunk of items one run of its shape's graph) and the reports. The shapes are in step_shape.c, the
 * tasks in step_engram.c, step_hc.c, step_attn.c, step_moe.c, step_moe_cards.c and step_dense.c,
 * the structs they share in step_impl.h. */
#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/dev_check.h"
#include "graphs/step/dev_fill.h"
#include "graphs/step/step_impl.h"
#include "sched/clock.h"
#include "sched/cost.h"
#include "sched/error.h"

const char *mf_step_phase_name(mf_step_phase p)
{
    static const char *const names[] = {"attention stack", "MoE", "Engram", "norm + head", "other"};
    return (unsigned)p < MF_STEP_N_PHASES ? names[p] : "?";
}

/* ---- what every task uses: its worker's layer context, the socket counts ------------------- */

/* With sockets: whether a host row part task reading rows [r0, r1) of w (a routed expert's part;
 * dense: a dense matrix of the model's) ran on a worker of the socket whose share holds them
 * (mf_topo_rows; with the store or the model split by sockets, their socket of the rows' first and
 * last bytes as well), counted for mf_step_last_dev. */
void mf_step_count_socket(mf_step *eng, const mf_task_ctx *ctx, const mf_weight *w, int64_t r0, int64_t r1,
                          int dense)
{
    if (eng->lt.n_sockets <= 1 || ctx->lane < 0 || ctx->lane >= eng->lt.n_lanes || r0 >= r1 || w->rows <= 0) return;
    int k = eng->lt.sock_of_lane[ctx->lane], ok = 0;
    for (int j = 0; j < eng->lt.n_sockets; j++) {
        int64_t a, b;
        mf_topo_rows(w->rows, eng->lt.n_sockets, j, &a, &b);
        if (r0 >= a && r0 < b) ok = j == k && r1 <= b;
    }
    if (ok && w->st_data && w->data) {
        uint64_t rb = w->st_data->n_bytes / (uint64_t)w->rows;
        const uint8_t *p0 = w->data + (uint64_t)r0 * rb, *p1 = w->data + (uint64_t)r1 * rb - 1;
        int in_store = eng->store && mf_store_socket_of(eng->store, w->data) >= 0;
        const mf_model *m = eng->ly->m;
        if (in_store) ok = mf_store_socket_of(eng->store, p0) == k && mf_store_socket_of(eng->store, p1) == k;
        else if (mf_model_socket_of(m, w->data) >= 0) ok = mf_model_socket_of(m, p0) == k && mf_model_socket_of(m, p1) == k;
    }
    _Atomic int64_t *c = dense ? (ok ? &eng->dense_home : &eng->dense_cross) : ok ? &eng->sock_home : &eng->sock_cross;
    atomic_fetch_add_explicit(c, 1, memory_order_relaxed);
}

/* The layer context of the worker running a task (the tasks that use one run on the CPU lane, whose
 * workers are 0..n_threads-1); NULL with an error when a task runs elsewhere. */
mf_ly_ctx *mf_step_cx(const mf_step_targ *a, const mf_task_ctx *ctx)
{
    const mf_step *eng = a->sh->eng;
    if (ctx->lane < 0 || ctx->lane >= eng->lt.n_lanes || eng->lt.lane[ctx->lane].kind != MF_LANE_CPU ||
        ctx->worker < 0 || ctx->worker >= eng->n_cx) {
        mf_error(-EINVAL, "step: a task (op %d) on lane %d worker %d has no layer context", a->t->op, ctx->lane,
                 ctx->worker);
        return NULL;
    }
    int w = eng->lt.cpu_base[ctx->lane] + ctx->worker;   /* workers numbered across the sockets' lanes */
    if (w >= eng->n_cx) {
        mf_error(-EINVAL, "step: a task (op %d) on lane %d worker %d has no layer context", a->t->op, ctx->lane,
                 ctx->worker);
        return NULL;
    }
    return eng->cx[w];
}

/* ---- the engine ---------------------------------------------------------------------------- */

void mf_step_lane_models(const mf_profile *p, int threads, mf_lane_model models[4])
{
    if (!p) p = mf_cost_default_profile();
    double bps = p->host[MF_KF_FP4].bytes_per_s, share = mf_cost_thread_share(p, threads);
    if (share > 0 && share < bps) bps = share;
    models[0] = (mf_lane_model){.bytes_per_s = bps, .latency_ns = p->host[MF_KF_FP4].latency_ns};
    models[1] = (mf_lane_model){.bytes_per_s = p->h2d_bytes_per_s, .latency_ns = p->h2d_latency_ns};
    models[2] = (mf_lane_model){.bytes_per_s = p->card[MF_KF_FP4].bytes_per_s,
                                .latency_ns = p->card[MF_KF_FP4].latency_ns};
    models[3] = (mf_lane_model){.bytes_per_s = p->d2h_bytes_per_s, .latency_ns = p->d2h_latency_ns};
}

/* The startup self-check (device/dev_check.h) of every card of s->o.dev: a card that fails is
 * refused (its message kept in s->refused); with any refused, the routed experts run on the host
 * and the dense work on the cards that passed (on the host when none did). */
static void mf_step_selfcheck(mf_step *s)
{
    int n = mf_dev_n_cards(s->o.dev), len = 0;
    for (int cd = 0; cd < n; cd++) {
        /* a card without room for the check's buffers is left to the setup, which refuses a
         * card too small for its work with its own message */
        int rc = mf_dev_selfcheck(s->o.dev, cd, 1);
        if (!rc || rc == -ENOMEM) continue;
        s->refused_mask |= 1u << cd;
        len += snprintf(s->refused + len, sizeof s->refused - (size_t)len, "%srefused %s", len ? "; " : "",
                        mf_last_error());
        if (len >= (int)sizeof s->refused) len = (int)sizeof s->refused - 1;
    }
    if (!s->refused_mask) return;
    if (s->o.placement != MF_STEP_PLACE_HOST) {
        s->o.placement = MF_STEP_PLACE_HOST;
        len += snprintf(s->refused + len, sizeof s->refused - (size_t)len, "; routed experts run on the host");
        if (len >= (int)sizeof s->refused) len = (int)sizeof s->refused - 1;
    }
    if (s->o.dense && s->refused_mask == (1u << n) - 1) {
        s->o.dense = MF_STEP_DENSE_HOST;
        snprintf(s->refused + len, sizeof s->refused - (size_t)len, "; the dense work runs on the host");
    }
}

const char *mf_step_refused(const mf_step *s) { return s->refused; }

void mf_step_last_dev(const mf_step *s, mf_step_dev_stats *out)
{
    *out = s->dstat;
    out->sock_home = atomic_load(&s->sock_home);
    out->sock_cross = atomic_load(&s->sock_cross);
    out->dense_home = atomic_load(&s->dense_home);
    out->dense_cross = atomic_load(&s->dense_cross);
    out->miss_spans = atomic_load(&s->miss_spans);
    out->lt_linears = atomic_load(&s->lt_linears);
    out->lt_slots = atomic_load(&s->lt_slots);
    out->gather_slots = atomic_load(&s->gather_slots);
}

void mf_step_fill(const mf_step *s, mf_step_fill_stats *out) { *out = s->fill; }

/* One executor per engine: the store's reads go to this engine's IO lane, whose ring registers the
 * slab (fixed-buffer reads; a refusal is logged and reads stay correct), and the store's own run
 * is released (the oracle's synchronous calls start it again when they come). */
static int mf_step_store_attach(mf_step *s)
{
    void *bufs[63];
    uint64_t lens[63];
    int n = mf_store_io_buffers(s->store, bufs, lens, 63);
    if (n) mf_sched_io_register(s->sched, bufs, lens, n);
    mf_error_clear();
    mf_store_io_release(s->store);
    return 0;
}

/* One CPU lane per socket (mf_step_opts.n_sockets): the topology's sockets, the workers split in
 * proportion to their cores (at least one each). */
static int mf_step_socket_lanes(mf_step *s)
{
    mf_topo_sockets ts;
    int n = s->o.n_sockets, rc = mf_topo_sockets_of(s->o.topology, &ts);
    if (rc) return rc;
    if (ts.n < n || n > s->o.n_threads)
        return mf_error(-EINVAL, "step: %d sockets asked; the topology%s%s has %d, and %d workers to share",
                        n, s->o.topology ? " " : "", s->o.topology ? s->o.topology : "", ts.n, s->o.n_threads);
    int thr[MF_TOPO_MAX_SOCKETS], cores = 0, given = 0;
    for (int k = 0; k < n; k++) cores += ts.cores[k];
    for (int k = 0; k < n; k++) {
        thr[k] = (int)((int64_t)s->o.n_threads * ts.cores[k] / cores);
        if (thr[k] < 1) thr[k] = 1;
        given += thr[k];
    }
    for (int k = 0; given != s->o.n_threads; k = (k + 1) % n) {   /* the rounding, one at a time */
        if (given < s->o.n_threads) thr[k]++, given++;
        else if (thr[k] > 1) thr[k]--, given--;
    }
    return mf_sg_lanes_sockets(&s->lt, n, thr, ts.numa);
}

/* A pipeline stage (graphs/step/step.h mf_step_link; its layers s->l0, s->l1 from the model): the
 * link the sides with neighbours need, the boundary lane. The whole model: nothing. 0 or -EINVAL / -ENOTSUP. */
static int mf_step_stage(mf_step *s)
{
    int first = s->l0 == 0, last = s->l1 == s->c->n_layers;
    if (first && last) return 0;
    if ((!first && !s->o.link.recv) || (!last && !s->o.link.send))
        return mf_error(-EINVAL, "step: a model of layers [%d, %d) of %d is a pipeline stage: it needs a link %s",
                        s->l0, s->l1, s->c->n_layers, !first && !s->o.link.recv ? "to receive from" : "to send to");
    mf_sg_lanes_net(&s->lt);
    return 0;
}

int mf_step_new(mf_ref *r, const mf_step_opts *opts, mf_step **out)
{
    *out = NULL;
    const mf_layers *ly = mf_ref_layers(r);
    const mf_config *c = ly->c;
    mf_store *store = mf_model_store(ly->m);
    if (mf_model_is_lazy(ly->m) && !store)
        return mf_error(-ENOTSUP, "step: the model's experts are not resident (lazy load); the "
                        "scheduled engine needs them in memory or behind an expert store");
    if (opts && (opts->max_batch < 0 || opts->max_batch > MF_STEP_MAX_ITEMS))
        return mf_error(-EINVAL, "step: max_batch %d (expected 0 for %d, or 1..%d)", opts->max_batch,
                        MF_STEP_DEFAULT_BATCH, MF_STEP_MAX_ITEMS);
    int max_items = opts && opts->max_batch ? opts->max_batch : MF_STEP_DEFAULT_BATCH, max_chunk = MF_STEP_MAX_CHUNK;
    if (store) {   /* a graph run pins one layer's slots: min(items x top_k, experts) */
        int K = c->n_experts_per_tok, E = c->n_routed_experts;
        int fit = mf_store_n_slots(store) < mf_store_max_batch(store) ? mf_store_n_slots(store)
                                                                        : mf_store_max_batch(store);
        if (mf_store_n_parts(store) != 6 || mf_store_n_parts(store) > 64)
            return mf_error(-EINVAL, "step: the expert store holds %d parts per expert, expected 6",
                            mf_store_n_parts(store));
        if (fit < K && fit < E)
            return mf_error(-ENOSPC, "step: the expert store holds %d experts (slots of %" PRIu64 " bytes); "
                            "the scheduled engine pins the top_k = %d experts of a token's layer at once: "
                            "a budget of at least %" PRIu64 " bytes", fit, mf_store_slot_bytes(store), K,
                            (uint64_t)K * mf_store_slot_bytes(store));
        if (fit < E && fit / K < max_items) max_items = fit / K;
        max_chunk = fit >= E ? MF_STEP_MAX_CHUNK : fit / K;
        if (max_chunk > MF_STEP_MAX_CHUNK) max_chunk = MF_STEP_MAX_CHUNK;
    }
    if (ly->act_quant)
        return mf_error(-ENOTSUP, "step: act_quant is not supported by the scheduled engine");
    if (c->quant_block_out != 32 || c->quant_block_in != 32)
        return mf_error(-ENOTSUP, "step: FP8 scale tiles %dx%d, the kernels need 32x32",
                        c->quant_block_out, c->quant_block_in);
    if (mf_model_head(ly->m)->kind != MF_W_BF16)
        return mf_error(-ENOTSUP, "step: head.weight is not bf16");
    if (c->n_shared_experts > 1)
        return mf_error(-ENOTSUP, "step: %d shared experts (expected 0 or 1)", c->n_shared_experts);
    if (c->hidden_size % 32 || c->moe_intermediate_size % 32)
        return mf_error(-ENOTSUP, "step: hidden_size %" PRId64 " and moe_intermediate_size %" PRId64
                        " must be multiples of 32", (int64_t)c->hidden_size, (int64_t)c->moe_intermediate_size);
    if (opts && opts->draft) {
        int rc = mf_step_draft_check(ly);
        if (rc) return rc;
    }
    mf_step *s = calloc(1, sizeof *s);
    if (!s) return mf_error(-ENOMEM, "step: out of memory");
    s->ly = ly;
    s->c = c;
    mf_model_layers(ly->m, &s->l0, &s->l1);   /* a pipeline stage's (mf_step_stage) */
    if (opts) s->o = *opts;
    if (s->o.n_threads < 1) s->o.n_threads = 1;
    if (s->o.prefill_chunk < 0 || s->o.prefill_chunk > MF_STEP_MAX_CHUNK) {
        int n = s->o.prefill_chunk;
        free(s);
        return mf_error(-EINVAL, "step: prefill chunk %d (expected 0 for the default %d, or 1..%d)", n,
                        MF_STEP_PREFILL_CHUNK, MF_STEP_MAX_CHUNK);
    }
    if (s->o.n_threads > 256) {
        int n = s->o.n_threads;
        free(s);
        return mf_error(-EINVAL, "step: %d threads (max 256)", n);
    }
    if (s->o.lt < MF_SG_LT_COST || s->o.lt > MF_SG_LT_OFF) {
        int m = s->o.lt;
        free(s);
        return mf_error(-EINVAL, "step: cuBLASLt mode %d (expected cost, on, dense or off)", m);
    }
    s->store = store;
    s->eg_reads = store && mf_store_tables_streamed(store);
    s->max_items = max_items;
    s->max_chunk = max_chunk;
    if (s->o.profile) {   /* the shapes' graphs are priced on it later (mf_sg_opts.profile) */
        s->prof = *s->o.profile;
        s->o.profile = &s->prof;
    }
    mf_step_lane_models(s->o.profile, s->o.n_threads, s->models);
    if (s->o.cpu_bytes_per_s > 0) s->models[0].bytes_per_s = s->o.cpu_bytes_per_s;
    int rc = 0;
    if (s->o.dev && (s->o.placement != MF_STEP_PLACE_HOST || s->o.dense) && !s->o.no_selfcheck)
        mf_step_selfcheck(s);
    rc = mf_sg_sizes_new(c, &s->sz);   /* the model's sizes (the dense upload's Markov rows ask them) */
    /* the dense weights first: the expert caches then take what the cards have left */
    if (!rc && s->o.dense) rc = mf_step_dense_setup(s);
    if (!rc && s->o.dev && s->o.placement != MF_STEP_PLACE_HOST) rc = mf_step_dev_setup(s);
    s->n_lane_cards = s->n_cards > s->n_dense ? s->n_cards : s->n_dense;
    if (!rc) rc = mf_step_lt_setup(s);   /* the cuBLASLt path on these cards (step_dense.c) */
    /* lanes: models for placement and priorities (mf_step_lane_models: the profile's, or the
     * built-in assumptions); dense-only cards map to the cards that passed the self-check */
    mf_sg_lanes_init(&s->lt, s->models, s->o.n_threads, store != NULL, s->n_lane_cards);
    if (!s->n_cards) mf_sg_lanes_map(&s->lt, s->dense_card, s->n_dense);
    if (!rc && s->o.n_sockets > 1) rc = mf_step_socket_lanes(s);
    if (!rc) rc = mf_step_stage(s);   /* a pipeline stage: its range, link and boundary lane */
    if (s->lt.lane_io >= 0 && s->o.io_depth > 0) s->lt.lane[s->lt.lane_io].concurrency = s->o.io_depth;
    /* one layer context per CPU worker, on the kernels */
    s->cx = calloc((size_t)s->o.n_threads, sizeof *s->cx);
    if (!rc && !s->cx) rc = mf_error(-ENOMEM, "step: out of memory");
    for (int w = 0; !rc && w < s->o.n_threads; w++)
        if (!(rc = mf_ly_ctx_new(ly, MF_LY_LIN_KERN, &s->cx[w]))) s->n_cx = w + 1;
    if (!rc && s->n_cards) rc = mf_step_caches_new(s);
    if (!rc) rc = mf_sched_create(&(mf_sched_opts){.lanes = s->lt.lane, .n_lanes = s->lt.n_lanes,
                                                   .pin_threads = s->o.pin_threads,
                                                   .dev = s->dev ? mf_dev_lane_ops_of(s->dev) : NULL,
                                                   .dev_wait_ns = s->o.dev_wait_ns,
                                                   .io_force_pread = s->o.io_force_pread,
                                                   .io_fault_kind = s->o.io_fault_kind,
                                                   .io_fault_nth = s->o.io_fault_nth,
                                                   .topology = s->o.topology},
                                  &s->sched);
    if (!rc && store) rc = mf_step_store_attach(s);
    if (!rc && s->o.dev_cache_fill && s->n_cards)
        rc = mf_dev_fill(&(mf_dev_fill_in){.dev = s->dev, .xc = s->xc, .n_cards = s->n_cards, .m = s->ly->m,
                                           .store = store, .part_off = s->part_off, .part_bytes = s->part_bytes,
                                           .counts = s->o.dev_fill_counts, .progress = s->o.dev_fill_progress},
                         &s->fill);
    s->o.dev_fill_counts = NULL;   /* read only here */
    if (rc) {
        mf_sg_sizes_free(s->sz);
        for (int w = 0; w < s->n_cx; w++) mf_ly_ctx_free(s->cx[w]);
        free(s->cx);
        for (int c = 0; c < s->n_cards; c++) mf_dev_xcache_free(s->xc[c]);
        mf_step_dense_free(s);
        mf_sched_destroy(s->sched);
        free(s);
        return rc;
    }
    *out = s;
    return 0;
}

void mf_step_free(mf_step *s)
{
    if (!s) return;
    mf_sched_destroy(s->sched);
    for (int i = 0; i <= MF_STEP_SERIAL_ITEMS; i++) mf_step_shape_free(s->shapes[i]);
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < MF_STEP_N_BUCKETS; j++) mf_step_shape_free(s->bshapes[k][j]);
    for (int k = 0; k <= MF_STEP_DRAFT_ITEMS; k++) mf_step_shape_free(s->dshapes[k]);
    free(s->umem);
    mf_step_shape_free(s->long_shape);
    for (int c = 0; c < s->n_cards; c++) mf_dev_xcache_free(s->xc[c]);
    mf_step_dense_free(s);
    for (int w = 0; w < s->n_cx; w++) mf_ly_ctx_free(s->cx[w]);
    free(s->cx);
    mf_sg_sizes_free(s->sz);
    free(s);
}

/* ---- a forward: checks, a chunk's graph run, its times ------------------------------------- */

/* Checks as mf_ref_forward does, before any state changes. */
static int mf_step_check(mf_step *s, mf_ref_state *const *states, const int32_t *tokens, int n)
{
    const mf_config *c = s->c;
    int64_t need = 0;
    for (int i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= c->vocab_size)
            return mf_error(-EINVAL, "step: token %d (item %d) outside the vocabulary [0, %" PRId64 ")",
                            tokens[i], i, c->vocab_size);
        if (states[i]->ly != s->ly) return mf_error(-EINVAL, "step: item %d's state belongs to another forward", i);
        for (int j = 0; i > 0 && states[i - 1] != states[i] && j < i - 1; j++)
            if (states[j] == states[i])
                return mf_error(-EINVAL, "step: items of one sequence must be consecutive (item %d)", i);
        int64_t k = 0;
        for (int j = 0; j < n; j++) k += states[j] == states[i];
        if (states[i]->n_pos + k > states[i]->max_pos)
            return mf_error(-EINVAL, "step: sequence would reach %" PRId64 " positions, past its maximum "
                            "of %" PRId64, states[i]->n_pos + k, states[i]->max_pos);
        need = need > states[i]->max_pos ? need : states[i]->max_pos;
    }
    for (int w = 0; w < s->n_cx; w++) {   /* score buffers for the longest sequence */
        int rc = mf_ly_ctx_reserve(s->cx[w], need);
        if (rc) return rc;
    }
    return mf_ref_states_reserve(states, n);   /* the states' pages for every position the items reach */
}

/* The spans of the last run's tasks of the kinds in mask `kinds`, merged (mf_timeline_union) into
 * out; returns their count, *busy their length. */
static int mf_step_union(mf_step_shape *sh, mf_task_span *out, unsigned kinds, int64_t *busy)
{
    const mf_task_span *sp = mf_timeline_spans(sh->tl);
    int n = mf_graph_n_tasks(sh->g), m = 0;
    for (int t = 0; t < n; t++)
        if (sp[t].status == 0 && ((kinds >> sh->sg->task[t].kind) & 1) && sp[t].end_ns > sp[t].start_ns)
            out[m++] = sp[t];
    return mf_timeline_union(out, m, busy);
}

/* IO busy time of the last run (union of its IO-lane reads) and the part of it during which an
 * expert's compute task (routed or shared) was running; with devices the same for copy-ins
 * against expert compute on the host or a card. */
static void mf_step_io_overlap(mf_step *s, mf_step_shape *sh)
{
    int n = mf_graph_n_tasks(sh->g);
    mf_task_span *io = sh->sorted, *cp = sh->sorted + n;
    int64_t bi, bc;
    if (s->store) {
        int ni = mf_step_union(sh, io, 1u << MF_SG_K_IO, &bi);
        int nc = mf_step_union(sh, cp, 1u << MF_SG_K_EXPERT, &bc);
        s->times.io_busy_ns += bi;
        s->times.io_overlap_ns += mf_timeline_overlap(io, ni, cp, nc);
        s->times.expert_busy_ns += bc;
    }
    if (s->n_lane_cards) {   /* copy-in tasks (experts, dense activations) vs expert compute on the host or a card */
        int u = mf_step_union(sh, io, 1u << MF_SG_K_COPY, &bi);
        int ny = mf_step_union(sh, cp, (1u << MF_SG_K_EXPERT) | (1u << MF_SG_K_DEV), &bc);
        s->times.copy_busy_ns += bi;
        s->times.compute_busy_ns += bc;
        s->times.copy_overlap_ns += mf_timeline_overlap(io, u, cp, ny);
    }
}

/* Adds the last run's time per phase to s->times (mf_stepgraph_phase_times: per phase the union
 * of its tasks' intervals and their summed durations). */
static void mf_step_account(mf_step *s, mf_step_shape *sh)
{
    mf_step_io_overlap(s, sh);
    mf_stepgraph_phase_times(sh->sg, mf_timeline_spans(sh->tl), sh->sorted, s->times.phase_ns, s->times.busy_ns);
    s->times.n_tasks = mf_graph_n_tasks(sh->g);
}

/* After a failed run with a store: names the expert of the first failed read, closes the store's
 * open batch (its new slots freed, nothing pinned) so that the store stays usable. */
static int mf_step_store_fail(mf_step *s, mf_step_shape *sh, int rc)
{
    const mf_task_span *sp = mf_timeline_spans(sh->tl);
    int n = mf_graph_n_tasks(sh->g);
    for (int t = 0; t < n; t++) {
        if (sh->sg->task[t].kind != MF_SG_K_IO || sp[t].status >= 0) continue;
        const mf_step_targ *a = &sh->args[t];
        if (a->t->op == MF_SG_ENGRAM_READ) {
            const mf_model_layer *y = mf_model_layer_at(s->ly->m, a->t->layer);
            const mf_io_read *rd = &sh->eg_rd[mf_step_eg_row(sh, a->t->layer, a->t->i0) * 2 * sh->eg_per + a->t->read];
            int c = mf_store_gather_check(s->store, mf_config_engram_slot(s->c, a->t->layer));
            rc = mf_error_wrap(c ? c : rc, "step: layer %d: Engram gather of %s: reading %" PRIu64 " bytes at offset %"
                               PRIu64 " failed", a->t->layer, y->eg_table.name, rd->n_bytes, rd->offset);
            break;
        }
        const mf_model_layer *y = mf_model_layer_at(s->ly->m, a->t->layer);
        const mf_io_read *rd = &sh->slot_rd[(size_t)a->t->slot * sh->n_parts + a->t->read];
        rc = mf_error_wrap(rc, "step: layer %d expert %d (%s...): reading %" PRIu64 " bytes at offset %"
                           PRIu64 " into the expert store failed", a->t->layer, sh->slot_e[a->t->slot],
                           y->experts[sh->slot_e[a->t->slot] * 3].name, rd->n_bytes, rd->offset);
        break;
    }
    if (sh->store_layer >= 0) {
        mf_store_end(s->store, rc);
        sh->store_layer = -1;
    }
    return rc;
}

static int mf_step_chunk(mf_step *s, mf_ref_state *const *states, const int32_t *tokens, int n,
                         float *const *logits, float *const *feats)
{
    const mf_config *c = s->c;
    mf_step_shape *sh;
    int rc = mf_step_shape_of(s, states, n, &sh);
    if (rc) return rc;
    int64_t H = c->hidden_size, need = 0;
    for (int i = 0; i < n; i++) need = need > states[i]->max_pos ? need : states[i]->max_pos;
    if (need > sh->iscore_ld) {   /* index scores for the longest sequence (as the workers' score buffers) */
        double *v = realloc(sh->iscore, sizeof *v * (size_t)sh->n * (size_t)need);
        if (!v) return mf_error(-ENOMEM, "step: index scores of %d items of up to %" PRId64 " positions", sh->n, need);
        sh->iscore = v;
        sh->iscore_ld = need;
    }
    const mf_weight *emb = mf_model_embed(s->ly->m);
    int embed = s->l0 == 0;   /* a later pipeline stage: the boundary task fills the streams */
    sh->n_head = 0;
    for (int i = 0; i < n; i++) {
        mf_ly_item *it = &sh->items[i];
        it->st = states[i];
        it->pos = i > 0 && states[i - 1] == states[i] ? sh->items[i - 1].pos + 1 : states[i]->n_pos;
        it->tok = tokens[i];
        it->st->tokens[it->pos] = tokens[i];
        it->topk_src = it->cand_src = -1;
        it->n_topk = it->n_cand = 0;
        memset(it->pre, 0, sizeof it->pre);
        it->pre[0] = 1.0f;
        it->logits = logits ? logits[i] : NULL;
        if (sh->feat_out) sh->feat_out[i] = feats ? feats[i] : NULL;
        sh->head_row[i] = it->logits ? sh->n_head : -1;
        if (it->logits) sh->head_item[sh->n_head++] = i;
        if (it->logits && s->l1 < c->n_layers)
            return mf_error(-EINVAL, "step: logits asked of a pipeline stage without the head (layers [%d, %d) of %d)",
                            s->l0, s->l1, (int)c->n_layers);
        for (int64_t d = 0; embed && d < H; d++) {
            uint16_t b;
            memcpy(&b, emb->data + ((int64_t)tokens[i] * H + d) * 2, 2);
            it->x[d] = mf_bf16_to_f32(b);
        }
        for (int k = 1; embed && k < c->hc_mult; k++) memcpy(it->x + k * H, it->x, (size_t)H * sizeof(float));
    }
    mf_timeline_reset(sh->tl);
    rc = mf_sched_run(s->sched, sh->g, &(mf_run_opts){.timeline = sh->tl});
    s->last = sh;
    if (rc && mf_step_dev_pinned(sh)) rc = mf_step_dev_fail(sh, rc);
    if (rc && s->store) rc = mf_step_store_fail(s, sh, rc);
    if (rc) return rc;
    for (int j = 0; j < sh->n_head; j++)
        memcpy(sh->items[sh->head_item[j]].logits, sh->lbuf + (size_t)j * c->vocab_size,
               sizeof(float) * (size_t)c->vocab_size);
    for (int i = 0; i < n; i++) sh->items[i].st->n_pos = sh->items[i].pos + 1;
    mf_step_account(s, sh);
    s->times.macs += mf_stepgraph_macs(sh->sg, c->n_experts_per_tok, sh->n_head);
    s->times.weight_bytes += mf_stepgraph_weight_bytes(sh->sg);
    return 0;
}

void mf_step_dev_begin(mf_step *s)
{
    s->dstat.dev_slots = s->dstat.host_slots = s->dstat.host_fallbacks = 0;
    atomic_store(&s->sock_home, 0);
    atomic_store(&s->sock_cross, 0);
    atomic_store(&s->dense_home, 0);
    atomic_store(&s->dense_cross, 0);
    atomic_store(&s->miss_spans, 0);
    atomic_store(&s->lt_linears, 0);
    atomic_store(&s->lt_slots, 0);
    atomic_store(&s->gather_slots, 0);
    for (int c = 0; c < s->n_cards; c++) mf_dev_xcache_step(s->xc[c], NULL);
}

void mf_step_dev_end(mf_step *s)
{
    s->dstat.hits = s->dstat.misses = s->dstat.evictions = s->dstat.bytes_in = 0;
    for (int c = 0; c < s->n_cards; c++) {
        mf_dev_xcache_stats x;
        mf_dev_xcache_step(s->xc[c], &x);
        s->dstat.hits += x.hits;
        s->dstat.misses += x.misses;
        s->dstat.evictions += x.evictions;
        s->dstat.bytes_in += x.bytes_in;
    }
}

/* mf_step_forward in graph runs of at most `chunk` items. */
static int mf_step_forward_chunks(mf_step *s, mf_ref_state *const *states, const int32_t *tokens, int n,
                                  float *const *logits, float *const *feats, int chunk)
{
    int64_t t0 = mf_now_ns();
    memset(&s->times, 0, sizeof s->times);
    mf_step_dev_begin(s);
    if (n < 1) return mf_error(-EINVAL, "step: forward of %d items", n);
    if (feats && !(s->o.draft && s->c->n_mtp_layers > 0))
        return mf_error(-EINVAL, "step: the draft's features asked of an engine made without the draft (opts.draft)");
    int rc = mf_step_check(s, states, tokens, n);
    if (rc) return rc;
    for (int i = 0; i < n && !rc; i += chunk) {
        int m = n - i < chunk ? n - i : chunk;
        rc = mf_step_chunk(s, states + i, tokens + i, m, logits ? logits + i : NULL, feats ? feats + i : NULL);
    }
    s->times.wall_ns = mf_now_ns() - t0;
    mf_step_dev_end(s);
    int64_t rest = s->times.wall_ns;
    for (int p = 0; p < MF_STEP_OTHER; p++) rest -= s->times.phase_ns[p];
    s->times.phase_ns[MF_STEP_OTHER] = rest > 0 ? rest : 0;
    if (rc) return mf_error_wrap(rc, "scheduled forward (the states involved are now inconsistent: reset them)");
    return 0;
}

int mf_step_forward_feat(mf_step *s, mf_ref_state *const *states, const int32_t *tokens, int n,
                         float *const *logits, float *const *feats)
{
    int one = 1;   /* items all of one sequence: its serial graph runs up to max_chunk of them */
    for (int i = 1; i < n && one; i++) one = states[i] == states[0];
    return mf_step_forward_chunks(s, states, tokens, n, logits, feats,
                                  one && n > s->max_items ? s->max_chunk : s->max_items);
}

int mf_step_forward(mf_step *s, mf_ref_state *const *states, const int32_t *tokens, int n,
                    float *const *logits)
{
    return mf_step_forward_feat(s, states, tokens, n, logits, NULL);
}

int mf_step_prefill(mf_step *s, mf_ref_state *st, const int32_t *tokens, int n, float *logits)
{
    if (n < 1) return mf_error(-EINVAL, "step: prefill of %d tokens", n);
    mf_ref_state **sts = malloc((size_t)n * sizeof *sts);
    float **lg = calloc((size_t)n, sizeof *lg);
    if (!sts || !lg) {
        free(sts);
        free(lg);
        return mf_error(-ENOMEM, "step: out of memory");
    }
    for (int i = 0; i < n; i++) sts[i] = st;
    lg[n - 1] = logits;
    int chunk = s->o.prefill_chunk > 0 ? s->o.prefill_chunk : MF_STEP_PREFILL_CHUNK;
    int rc = mf_step_forward_chunks(s, sts, tokens, n, lg, NULL, chunk < s->max_chunk ? chunk : s->max_chunk);
    free(sts);
    free(lg);
    return rc;
}

int mf_step_decode(mf_step *s, mf_ref_state *const *states, const int32_t *tokens, int n_seq,
                   float *logits)
{
    int max_batch = s->o.max_batch ? s->o.max_batch : MF_STEP_DEFAULT_BATCH;
    if (n_seq < 1 || n_seq > max_batch)
        return mf_error(-EINVAL, "step: decode of %d sequences (1..%d: mf_step_opts.max_batch, at most %d)", n_seq,
                        max_batch, MF_STEP_MAX_ITEMS);
    float *lg[MF_STEP_MAX_ITEMS];
    for (int i = 0; i < n_seq; i++) lg[i] = logits ? logits + (size_t)i * s->c->vocab_size : NULL;
    for (int i = 0; i < n_seq; i++)
        for (int j = 0; j < i; j++)
            if (states[i] == states[j]) return mf_error(-EINVAL, "step: decode got sequence %d twice", i);
    if (n_seq > s->max_items) {   /* the expert store's budget holds fewer */
        int K = s->c->n_experts_per_tok;
        return mf_error(-ENOSPC, "step: a decode batch of %d sequences pins up to %d experts of a layer "
                        "at once; the expert store holds %d (slots of %" PRIu64 " bytes): a budget of at "
                        "least %" PRIu64 " bytes, or at most %d sequences", n_seq, n_seq * K,
                        mf_store_n_slots(s->store), mf_store_slot_bytes(s->store),
                        (uint64_t)(n_seq * K < s->c->n_routed_experts ? n_seq * K : s->c->n_routed_experts) *
                            mf_store_slot_bytes(s->store), s->max_items);
    }
    return mf_step_forward(s, states, tokens, n_seq, lg);
}

void mf_step_last_times(const mf_step *s, mf_step_times *out) { *out = s->times; }

void mf_step_builds(const mf_step *s, mf_step_build_stats *out) { *out = s->builds; }

const mf_stepgraph *mf_step_graph(const mf_step *s, int n, int kind)
{
    if (n < 1) return NULL;
    if (!kind) {
        if (n > MF_STEP_SERIAL_ITEMS) return s->long_shape && s->long_shape->n == n ? s->long_shape->sg : NULL;
        return s->shapes[n] ? s->shapes[n]->sg : NULL;
    }
    if (n > MF_STEP_MAX_ITEMS) return NULL;
    int j = 0;
    while (1 << j < mf_sg_bucket(n)) j++;
    const mf_step_shape *sh = s->bshapes[kind == MF_STEP_GRAPH_MIXED][j];
    return sh ? sh->sg : NULL;
}

int mf_step_write_trace(const mf_step *s, const char *path)
{
    if (!s->last) return mf_error(-EINVAL, "step: no step has run yet, nothing to trace");
    return mf_timeline_write_chrome(s->last->tl, path);
}
