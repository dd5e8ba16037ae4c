/* The scheduled engine's shapes (graphs/step/step.c uses them): per batch pattern one step graph
 * (graphs/step/stepgraph.c builds it, with the task function of each op from the task files'
 * tables), its host buffers (one table of {name, bytes, &ptr}, carved from one allocation), its
 * cards' buffers (the one layout of graphs/step/stepgraph.h mf_sg_card_bufs), and the binding of
 * each task to its record; the engine's cache of shapes (mf_step_shape_of). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/step/step_impl.h"
#include "sched/clock.h"
#include "sched/error.h"

/* A row of a shape's buffer table: sized first, then carved from one allocation. */
typedef struct mf_step_buf {
    const char *name;
    size_t bytes;
    void **ptr;
} mf_step_buf;

void mf_step_shape_free(mf_step_shape *sh)
{
    if (!sh) return;
    mf_timeline_destroy(sh->tl);
    mf_stepgraph_free(sh->sg);
    free(sh->slot_w);
    free(sh->slot_rd);
    free(sh->slot_card);
    free(sh->slot_dev);
    free(sh->slot_miss);
    free(sh->pre_card);
    free(sh->pre_dev);
    free(sh->pre_miss);
    free(sh->pre_cached);
    for (int c = 0; c < sh->eng->n_cards; c++) {
        for (int L = 0; sh->dgraph[c] && L < sh->n_dgraph; L++) mf_dev_graph_destroy(sh->dgraph[c][L]);
        free(sh->dgraph[c]);
        mf_dev_host_free(sh->eng->dev, sh->htab[c]);
        mf_dev_free(sh->eng->dev, c, sh->dbuf[c]);
    }
    for (int c = 0; c < sh->eng->n_dense; c++) mf_dev_free(sh->eng->dev, sh->eng->dense_card[c], sh->ddense[c]);
    free(sh->sorted);
    free(sh->hk_map);
    free(sh->iscore);
    free(sh->args);
    free(sh->mem);
    free(sh);
}

static int mf_task_nop(void *arg, mf_task_ctx *ctx)
{
    (void)arg;
    (void)ctx;
    return 0;
}

/* The join's task (graphs/step/stepgraph.h MF_SG_JOIN): nothing. */
static const mf_task_fn mf_step_shape_fn_of[MF_SG_N_OPS] = {[MF_SG_JOIN] = mf_task_nop};

/* The engine's task function of op `op` of the step graph (graphs/step/stepgraph.h): the entry of
 * the table of the file whose tasks run it (step_impl.h), NULL for an op no table has (the IO
 * lane's reads). */
static mf_task_fn mf_step_fn_of(int op)
{
    static const mf_task_fn *const tabs[] = {mf_step_engram_fn_of, mf_step_hc_fn_of,        mf_step_attn_fn_of,
                                             mf_step_moe_fn_of,    mf_step_moe_cards_fn_of, mf_step_dense_fn_of,
                                             mf_step_shape_fn_of};
    for (size_t k = 0; k < sizeof tabs / sizeof tabs[0]; k++)
        if (tabs[k][op]) return tabs[k][op];
    return NULL;
}


/* A per-item op's task over its record's item group (graphs/step/stepgraph.h mf_sg_op_per_item):
 * the op's function once per item, in item order, each seeing a record of that one item. */
static int mf_task_items(void *arg, mf_task_ctx *ctx)
{
    mf_step_targ *a = arg;
    mf_task_fn fn = mf_step_fn_of(a->t->op);
    if (a->t->i1 - a->t->i0 <= 1) return fn(arg, ctx);
    mf_sg_task one = *a->t;
    mf_step_targ b = {a->sh, &one};
    for (int i = a->t->i0; i < a->t->i1; i++) {
        one.i0 = i;
        one.i1 = i + 1;
        one.n_tok = 1;
        int rc = fn(&b, ctx);
        if (rc) return rc;
    }
    return 0;
}

/* The step graph options of a shape of n items; fn_of: MF_SG_N_OPS entries, filled, kept by the
 * caller while the options are used. */
mf_sg_opts mf_step_sg_opts(const mf_step *eng, int n, int par, int n_units, const int *unit_end, mf_task_fn *fn_of)
{
    for (int op = 0; op < MF_SG_N_OPS; op++)   /* the per-item ops over their item groups; the mixes
                                                 * take their whole item group (mf_step_mix_rows) */
        fn_of[op] = mf_sg_op_per_item(op) && op != MF_SG_ATTN_MIX && op != MF_SG_FFN_MIX ? mf_task_items
                                                                                          : mf_step_fn_of(op);
    const mf_ref_hooks *hk = &eng->ly->hooks;
    int ordered = hk->on_route || hk->on_select || hk->on_candidates;   /* the hooks in item order */
    return (mf_sg_opts){.c = eng->c, .sz = eng->sz, .n = n, .par = par,
                        .n_units = n_units, .unit_end = unit_end, .ordered = ordered,
                        .n_threads = eng->o.n_threads, .n_cards = eng->n_cards,
                        .n_dense_cards = eng->n_dense, .dense_split = eng->o.dense_split,
                        .dense_block = eng->o.dense_block,
                        .dev_graphs = eng->dev_graphs, .store = eng->store != NULL,
                        .miss_copies = eng->miss_span ? 1 : 0,
                        .read_window = eng->o.read_window, .eg_reads = eng->eg_reads,
                        .lanes = eng->lt.lane, .n_sockets = eng->lt.n_sockets,
                        .lane_sock = eng->lt.lane_sock,
                        .n_lanes = eng->lt.n_lanes, .lane_io = eng->lt.lane_io,
                        .lane_dev0 = eng->lt.lane_dev0,
                        .micro = eng->o.micro, .exact = eng->o.exact, .heads = eng->o.heads,
                        .prefetch_min = eng->o.prefetch_min, .lt = eng->lt_mode,
                        .fn_of = fn_of,
                        .profile = eng->o.profile};
}

/* The step graph of a shape of n items (parallel, serial, or n_units units ending at unit_end[])
 * on the engine's lanes. */
static int mf_step_graph_new(mf_step *eng, int n, int par, int n_units, const int *unit_end, mf_stepgraph **out)
{
    mf_task_fn fn_of[MF_SG_N_OPS];
    mf_sg_opts o = mf_step_sg_opts(eng, n, par, n_units, unit_end, fn_of);
    return mf_stepgraph_new(&o, out);
}

/* What the card buffers of shape graph sg (laid out for ln items) take (stepgraph.h: the one layout
 * of them, which the simulator and the caches' sizing read too). */
mf_sg_card_in mf_step_card_in(const mf_step *eng, const mf_stepgraph *sg, int ln)
{
    return (mf_sg_card_in){.c = eng->c, .sg = sg, .ln = ln, .sh_rows = (int64_t)eng->sz->sh_rows,
                           .exact = eng->o.exact, .dev_graphs = eng->dev_graphs, .head_rows = eng->o.head_rows};
}

/* Binds the shape's buffers to its graph's tasks: each task's argument is its record (its worker's
 * layer context is found when it runs); an IO task's is its slot's read. Then the timeline and the spans' scratch. */
static int mf_step_bind(mf_step *eng, mf_step_shape *sh)
{
    mf_stepgraph *sg = sh->sg;
    int n = sg->n_tasks;
    sh->args = calloc((size_t)n, sizeof *sh->args);
    sh->sorted = malloc(sizeof *sh->sorted * 2 * (size_t)n);
    if (!sh->args || !sh->sorted) return mf_error(-ENOMEM, "step: out of memory for the graph");
    for (int t = 0; t < n; t++) {
        const mf_sg_task *rec = &sg->task[t];
        sh->args[t] = (mf_step_targ){sh, rec};
        if (rec->op == MF_SG_SLOT_READ)
            mf_graph_set_arg(sh->g, t, &sh->slot_rd[(size_t)rec->slot * sh->n_parts + rec->read]);
        else if (rec->op == MF_SG_ENGRAM_READ)
            mf_graph_set_arg(sh->g, t, &sh->eg_rd[mf_step_eg_row(sh, rec->layer, rec->i0) * 2 * sh->eg_per + rec->read]);
        else
            mf_graph_set_arg(sh->g, t, &sh->args[t]);
    }
    return mf_timeline_create(sh->g, &sh->tl);
}

/* The card buffers of shape sh (experts on cards): slot tables, one device allocation per card
 * (rows in, token weights, h, quantized h, outputs, the FFN graphs' slot tables). 0 or a negative
 * code; the caller frees sh. */
static int mf_step_shape_cards(mf_step *eng, mf_step_shape *sh)
{
    const mf_config *c = eng->c;
    int n = sh->n;
    if (!eng->n_cards) return 0;
    sh->slot_card = malloc((size_t)sh->n_slots * sizeof *sh->slot_card);
    sh->slot_dev = calloc((size_t)sh->n_slots, sizeof *sh->slot_dev);
    sh->slot_miss = calloc((size_t)sh->n_slots, 1);
    if (!sh->slot_card || !sh->slot_dev || !sh->slot_miss) return mf_error(-ENOMEM, "step: out of memory");
    for (int s = 0; s < sh->n_slots; s++) sh->slot_card[s] = -1;
    if (sh->sg->prefetch) {
        size_t E = (size_t)c->n_routed_experts;
        sh->pre_card = malloc(E * sizeof *sh->pre_card);
        sh->pre_dev = calloc(E, sizeof *sh->pre_dev);
        sh->pre_miss = calloc(E, 1);
        sh->pre_cached = calloc(E, 1);
        if (!sh->pre_card || !sh->pre_dev || !sh->pre_miss || !sh->pre_cached)
            return mf_error(-ENOMEM, "step: out of memory");
        for (size_t e = 0; e < E; e++) sh->pre_card[e] = -1;
    }
    /* the routed block of the one layout (mf_sg_card_bufs); the int8 scratch by rows
     * (mf_dev_ffn_table.q8_row): a slot's area where its rows are */
    const mf_sg_card_bufs *cb = &sh->cb;
    sh->dq_bytes = cb->q8_row;
    sh->d_x = cb->x;
    sh->d_w = cb->w;
    sh->d_h = cb->h;
    sh->d_q = cb->q;
    sh->d_y = cb->y;
    sh->d_x16 = cb->x16;
    sh->d_y16 = cb->y16;
    sh->d_tab = cb->tab;
    size_t tab_bytes = cb->routed_bytes - cb->tab, total = cb->routed_bytes;
    for (int cd = 0; cd < eng->n_cards; cd++) {
        void *p = NULL;
        int rc = mf_dev_alloc(eng->dev, cd, total, &p);
        if (rc) return mf_error_wrap(rc, "step: device buffers of a batch of %d on card %d", n, cd);
        sh->dbuf[cd] = p;
        if (!eng->dev_graphs) continue;
        sh->n_dgraph = c->n_layers * sh->sg->n_halves;   /* per layer and micro-batch */
        sh->dgraph[cd] = calloc((size_t)sh->n_dgraph, sizeof *sh->dgraph[cd]);
        rc = sh->dgraph[cd] ? mf_dev_host_alloc(eng->dev, cd, tab_bytes, (void **)&sh->htab[cd])
                            : mf_error(-ENOMEM, "step: out of memory");
        if (rc) return mf_error_wrap(rc, "step: slot tables on card %d", cd);
        memset(sh->htab[cd], 0, tab_bytes);
    }
    return 0;
}

/* Each dense card's copies of shape sh's activations (--dense cards): the dense block of the one
 * layout (mf_sg_card_bufs), one device allocation per card. 0 or a negative code; the caller
 * frees sh. */
static int mf_step_shape_dense(mf_step *eng, mf_step_shape *sh)
{
    if (!eng->n_dense) return 0;
    const mf_sg_card_bufs *cb = &sh->cb;
    for (int b = 0; b < MF_LY_A_N; b++) {
        sh->dd_ab[b] = cb->ab[b];
        sh->dd16_ab[b] = cb->ab16[b];
    }
    sh->dd16_xin = cb->xin16;
    sh->dd16_ys = cb->ys16;
    sh->dd_xin = cb->xin;
    sh->dd_logits = cb->logits;
    sh->dd_hs = cb->hs;
    sh->dd_gs = cb->gs;
    sh->dd_us = cb->us;
    sh->dd_ys = cb->ys;
    sh->dd_hn = cb->hn;
    sh->head_rows = cb->head_rows;
    sh->dd_lbuf = cb->lbuf;
    sh->dd_eg_emb = cb->eg_emb;
    sh->dd_eg_kv = cb->eg_kv;
    sh->dd_hk_tab = cb->hk_tab;
    sh->dd_hk_keys = cb->hk_keys;
    sh->dd_hk_nk = cb->hk_nk;
    sh->dd_hk_sink = cb->hk_sink;
    sh->dd_sk_tab = cb->sk_tab;
    sh->dd_sk_nvis = cb->sk_nvis;
    sh->dd_sk_score = cb->sk_score;
    size_t total = cb->dense_bytes;
    for (int cd = 0; cd < eng->n_dense; cd++) {
        void *dp = NULL;
        int rc = mf_dev_alloc(eng->dev, eng->dense_card[cd], total, &dp);
        if (rc)
            return mf_error_wrap(rc, "step: dense activations of a batch of %d on card %d", sh->n, eng->dense_card[cd]);
        sh->ddense[cd] = dp;
    }
    return 0;
}

/* The Engram rows of shape sh's items (ln laid out): an item's rows and their lengths (the card
 * buffers' layout), its part of the gather plans' scratch with streamed tables. Returns the values
 * of a table row (0: no Engram). */
static size_t mf_step_shape_engram(mf_step *eng, mf_step_shape *sh, int ln)
{
    const mf_config *c = eng->c;
    size_t eg_d = 0;
    if (c->n_engram > 0) {   /* Engram rows of one item, its wkv output */
        sh->eg_per = sh->cb.eg_per;
        sh->eg_emb_ld = sh->cb.eg_emb_ld;
        sh->eg_kv_ld = sh->cb.eg_kv_ld;
        eg_d = (size_t)c->engram_head_dim;
        if (eng->eg_reads) sh->eg_scratch_item = (mf_store_gather_bytes(eng->store, sh->eg_per) + 15) / 16 * 16;
    }
    sh->eg_items = ln;
    return eg_d;
}

/* The expert slots shape sh's buffers hold into *out: its graph's, or for a unit shape (shared: laid
 * out in the engine's umem for ln items, nk = ln x top_k rows) the most a shape of ln items has. Frees
 * sh and fails when its graph has more. */
static int mf_step_shape_slots(mf_step *eng, mf_step_shape *sh, int n, int shared, size_t nk, size_t *out)
{
    int E = eng->c->n_routed_experts;
    size_t ns = (size_t)sh->n_slots;
    if (shared) {   /* the most slots a shape of ln items has (two micro-batches: E per half at most) */
        size_t cap = (size_t)(eng->o.micro == 2 ? 2 : 1) * E;
        ns = nk < cap ? nk : cap;
        if ((size_t)sh->n_slots > ns) {
            mf_step_shape_free(sh);
            return mf_error(-EINVAL, "step: a unit shape of %d items has %d expert slots, past the %zu laid out",
                            n, sh->n_slots, ns);
        }
    }
    *out = ns;
    return 0;
}

/* Carves the rows of tab (n_tab, each from a 64-byte boundary) from one allocation: for a unit shape
 * (shared) the engine's umem, allocated by the first one, for ln = max_items items; else the shape's
 * own (sh->mem). Frees sh and fails without the memory. */
static int mf_step_shape_carve(mf_step *eng, mf_step_shape *sh, const mf_step_buf *tab, int n_tab, int shared, int ln)
{
    size_t bytes = 0;
    for (int i = 0; i < n_tab; i++) bytes += (tab[i].bytes + 63) / 64 * 64;
    uint8_t *p = shared ? eng->umem : NULL;
    if (shared && p && bytes != eng->umem_bytes) {
        mf_step_shape_free(sh);
        return mf_error(-EINVAL, "step: unit shape buffers of %zu bytes, the engine laid out %zu", bytes, eng->umem_bytes);
    }
    if (!p) {
        if (!(p = aligned_alloc(64, bytes))) {
            mf_step_shape_free(sh);
            return mf_error(-ENOMEM, "step: cannot allocate %zu bytes of buffers for a batch of %d", bytes, ln);
        }
        memset(p, 0, bytes);
        if (shared) {
            eng->umem = p;
            eng->umem_bytes = bytes;
        } else {
            sh->mem = p;
        }
    }
    for (int i = 0; i < n_tab; i++) {
        *tab[i].ptr = tab[i].bytes ? p : NULL;
        p += (tab[i].bytes + 63) / 64 * 64;
    }
    return 0;
}

/* The host buffers of shape sh of n items (ln laid out; shared: in the engine's umem): sized in one
 * table of {name, bytes, &ptr}, then carved from one allocation (mf_step_shape_carve); the items'
 * streams and lists in them. Frees sh and fails on error. */
static int mf_step_shape_host(mf_step *eng, mf_step_shape *sh, int n, int shared, int ln)
{
    const mf_config *c = eng->c;
    int64_t H = c->hidden_size, I = c->moe_intermediate_size, V = c->vocab_size;
    int64_t Ish = c->n_shared_experts > 0 ? mf_model_layer_at(eng->ly->m, 0)->sh_w1.rows : 0;
    int K = c->n_experts_per_tok, E = c->n_routed_experts, hc = c->hc_mult;
    int n_cb = c->candidate_topk_blocks > 0 ? c->candidate_topk_blocks : 1;
    int rc;
    /* the int8 rows by rows (host/kernels.h mf_kern_q8_bytes): a slot's area where its rows are */
    size_t nk = (size_t)ln * K, q8x = mf_kern_q8_bytes(1, (int)H), q8h = mf_kern_q8_bytes(1, (int)I);
    int ex = eng->o.exact;
    size_t f = sizeof(float), ab_sz[MF_LY_A_N];
    size_t eg_d = mf_step_shape_engram(eng, sh, ln);
    size_t eg_items = (size_t)ln * (size_t)c->n_engram;   /* one set of rows per Engram slot */
    size_t eg_n = eng->eg_reads ? eg_items * sh->eg_per : 0;
    /* with dense cards: the bf16 mirrors of what their chains copy as bf16 (mf_sg_attn_buf_bf16) */
    size_t ab16_sz[MF_LY_A_N], dn = eng->n_dense > 0 ? (size_t)ln : 0;
    for (int b = 0; b < MF_LY_A_N; b++) {
        sh->ab_ld[b] = sh->cb.ab_ld[b];
        ab_sz[b] = (size_t)ln * sh->ab_ld[b] * sizeof(float);
        ab16_sz[b] = mf_sg_attn_buf_bf16(b) ? dn * sh->ab_ld[b] * 2 : 0;
    }
    size_t xin16_sz = mf_sg_dense_bf16(MF_SG_D_GATE, 0) ? dn * H * 2 : 0;
    size_t ys16_sz = mf_sg_dense_bf16(MF_SG_D_SHARED, 1) && c->n_shared_experts > 0 ? dn * H * 2 : 0;
    /* the shape's buffers: {name, bytes, &ptr}, sized first, then carved from one allocation */
    float *x = NULL;
    int32_t *topk = NULL, *cand = NULL;
    float *sel_kv = NULL;   /* per item its selection's entries, unpacked once (mf_ly_item.sel_kv) */
    int has_comp = 0;
    for (int L = 0; L < c->n_layers; L++) has_comp |= c->compress_ratios[L] > 0;
    size_t n_ = (size_t)ln, ns = 0;
    if ((rc = mf_step_shape_slots(eng, sh, n, shared, nk, &ns))) return rc;   /* sh freed */
    /* the heads on cards: the key table's entries at most (a longer union runs the host's heads) */
    int hk = sh->sg->heads_any, sk = sh->sg->scores_any;
    sh->sk_rows = sh->cb.sk_rows;   /* a card's items of the index scores at most */
    sh->hk_ecap = sh->cb.hk_ecap;
    mf_step_buf tab[] = {
        {"items", n_ * sizeof(mf_ly_item), (void **)&sh->items},
        {"streams", n_ * hc * H * f, (void **)&x},
        {"topk", n_ * c->index_topk * 4, (void **)&topk},
        {"sel_kv", has_comp ? n_ * c->index_topk * c->head_dim * f : 0, (void **)&sel_kv},
        {"candidates", n_ * n_cb * 4, (void **)&cand},
        {"xin", n_ * H * f, (void **)&sh->xin},
        {"moe_out", n_ * H * f, (void **)&sh->moe_out},
        {"ex", nk * 4, (void **)&sh->ex},
        {"wt", nk * f, (void **)&sh->wt},
        {"asg", nk * 4, (void **)&sh->asg},
        {"cnt", (size_t)E * 4, (void **)&sh->cnt},
        {"fill", (size_t)E * 4, (void **)&sh->fill},
        {"slot_of", (size_t)E * 4, (void **)&sh->slot_of},
        {"slot_e", ns * 4, (void **)&sh->slot_e},
        {"slot_off", ns * 4, (void **)&sh->slot_off},
        {"slot_cnt", ns * 4, (void **)&sh->slot_cnt},
        {"xg", nk * H * f, (void **)&sh->xg},
        {"wg", nk * f, (void **)&sh->wg},
        {"h", nk * I * f, (void **)&sh->h},
        {"gg", ex ? nk * I * f : 0, (void **)&sh->gg},
        {"uu", ex ? nk * I * f : 0, (void **)&sh->uu},
        {"y", nk * H * f, (void **)&sh->y},
        {"xg16", eng->n_cards ? nk * H * 2 : 0, (void **)&sh->xg16},
        {"y16", eng->n_cards ? nk * H * 2 : 0, (void **)&sh->y16},
        {"row_card", eng->n_cards ? nk : 0, (void **)&sh->row_card},
        {"q8x", ns * sizeof(mf_kern_q8), (void **)&sh->q8x},
        {"q8h", ns * sizeof(mf_kern_q8), (void **)&sh->q8h},
        {"q8x_mem", nk * q8x, (void **)&sh->q8x_mem},
        {"q8h_mem", nk * q8h, (void **)&sh->q8h_mem},
        {"hs", n_ * Ish * f, (void **)&sh->hs},
        {"gs", ex ? n_ * Ish * f : 0, (void **)&sh->gs},
        {"us", ex ? n_ * Ish * f : 0, (void **)&sh->us},
        {"ys", n_ * H * f, (void **)&sh->ys},
        {"hn", n_ * H * f, (void **)&sh->hn},
        {"lbuf", n_ * V * f, (void **)&sh->lbuf},
        {"head_item", n_ * 4, (void **)&sh->head_item},
        {"head_row", n_ * 4, (void **)&sh->head_row},
        {"amix", n_ * MF_STEP_N_MIX * f, (void **)&sh->amix},
        {"fmix", n_ * MF_STEP_N_MIX * f, (void **)&sh->fmix},
        {"hcol", n_ * H * f, (void **)&sh->hcol},
        {"qrs", n_ * f, (void **)&sh->qrs},
        {"logits", n_ * E * f, (void **)&sh->logits},
        {"eg_emb", eg_items * sh->eg_emb_ld * f, (void **)&sh->eg_emb},
        {"eg_kv", eg_items * sh->eg_kv_ld * f, (void **)&sh->eg_kv},
        {"eg_rows", eg_n * sizeof(int64_t), (void **)&sh->eg_rows},
        {"eg_codes", eg_n * eg_d, (void **)&sh->eg_codes},
        {"eg_scales", eg_n * ((eg_d + 31) / 32), (void **)&sh->eg_scales},
        {"eg_rd", 2 * eg_n * sizeof(mf_io_read), (void **)&sh->eg_rd},
        {"eg_scratch", eng->eg_reads ? eg_items * sh->eg_scratch_item : 0, (void **)&sh->eg_scratch},
        {"ab_in", ab_sz[MF_LY_A_IN], (void **)&sh->ab[MF_LY_A_IN]},
        {"ab_qr", ab_sz[MF_LY_A_QR], (void **)&sh->ab[MF_LY_A_QR]},
        {"ab_kv", ab_sz[MF_LY_A_KV], (void **)&sh->ab[MF_LY_A_KV]},
        {"ab_lat", ab_sz[MF_LY_A_LAT], (void **)&sh->ab[MF_LY_A_LAT]},
        {"ab_gate", ab_sz[MF_LY_A_GATE], (void **)&sh->ab[MF_LY_A_GATE]},
        {"ab_iw", ab_sz[MF_LY_A_IW], (void **)&sh->ab[MF_LY_A_IW]},
        {"ab_q", ab_sz[MF_LY_A_Q], (void **)&sh->ab[MF_LY_A_Q]},
        {"ab_qi", ab_sz[MF_LY_A_QI], (void **)&sh->ab[MF_LY_A_QI]},
        {"ab_o", ab_sz[MF_LY_A_O], (void **)&sh->ab[MF_LY_A_O]},
        {"ab_z", ab_sz[MF_LY_A_Z], (void **)&sh->ab[MF_LY_A_Z]},
        {"ab_out", ab_sz[MF_LY_A_OUT], (void **)&sh->ab[MF_LY_A_OUT]},
        {"hk_tab", hk ? ((size_t)c->sliding_window + (size_t)sh->hk_ecap) * c->head_dim * f : 0, (void **)&sh->hk_tab},
        {"hk_keys", hk ? n_ * sh->sg->heads_keys * 4 : 0, (void **)&sh->hk_keys},
        {"hk_nk", hk ? n_ * 4 : 0, (void **)&sh->hk_nk},
        {"hk_sink", hk ? (size_t)c->n_heads * f : 0, (void **)&sh->hk_sink},
        {"ab16_in", ab16_sz[MF_LY_A_IN], (void **)&sh->ab16[MF_LY_A_IN]},
        {"ab16_qr", ab16_sz[MF_LY_A_QR], (void **)&sh->ab16[MF_LY_A_QR]},
        {"ab16_q", ab16_sz[MF_LY_A_Q], (void **)&sh->ab16[MF_LY_A_Q]},
        {"ab16_qi", ab16_sz[MF_LY_A_QI], (void **)&sh->ab16[MF_LY_A_QI]},
        {"ab16_o", ab16_sz[MF_LY_A_O], (void **)&sh->ab16[MF_LY_A_O]},
        {"ab16_z", ab16_sz[MF_LY_A_Z], (void **)&sh->ab16[MF_LY_A_Z]},
        {"ab16_out", ab16_sz[MF_LY_A_OUT], (void **)&sh->ab16[MF_LY_A_OUT]},
        {"xin16", xin16_sz, (void **)&sh->xin16},
        {"ys16", ys16_sz, (void **)&sh->ys16},
        {"sk_tab", sk ? (size_t)MF_SG_SCORE_ENTRIES * c->index_head_dim * f : 0, (void **)&sh->sk_tab},
        {"sk_nvis", sk ? n_ * 4 : 0, (void **)&sh->sk_nvis},
    };
    _Static_assert(MF_LY_A_N == 11, "one row per attention buffer");
    enum { N_TAB = sizeof tab / sizeof tab[0] };
    if ((rc = mf_step_shape_carve(eng, sh, tab, N_TAB, shared, ln))) return rc;   /* sh freed */
    for (int b = 0; b < MF_LY_A_N; b++)
        if (ab16_sz[b] && !sh->ab16[b]) {   /* a bf16 buffer (mf_sg_attn_buf_bf16) without a row above */
            mf_step_shape_free(sh);
            return mf_error(-EINVAL, "step: attention buffer %d is copied as bf16 but has no mirror (internal)", b);
        }
    sh->q8x_bytes = q8x;
    sh->q8h_bytes = q8h;
    for (int i = 0; i < n; i++) {
        sh->items[i].x = x + (size_t)i * hc * H;
        sh->items[i].topk = topk + (size_t)i * c->index_topk;
        sh->items[i].sel_kv = sel_kv ? sel_kv + (size_t)i * c->index_topk * c->head_dim : NULL;
        sh->items[i].cand = cand + (size_t)i * n_cb;
    }
    return 0;
}

/* A shape of n items: parallel, serial, or n_units units ending at unit_end[]. A unit shape
 * (n_units > 0) carves its buffers from the engine's umem, laid out for max_items items (the
 * first n used); the others own theirs. In order: its graph, the store's slot reads, the cards'
 * buffers (mf_step_shape_cards), the host's (mf_step_shape_host), the dense cards'
 * (mf_step_shape_dense), the tasks bound (mf_step_bind). */
static int mf_step_shape_new(mf_step *eng, int n, int par, int n_units, const int *unit_end, mf_step_shape **out)
{
    int64_t t0 = mf_now_ns();
    mf_step_shape *sh = calloc(1, sizeof *sh);
    if (!sh) return mf_error(-ENOMEM, "step: out of memory");
    sh->eng = eng;
    sh->n = n;
    sh->par = par;
    int rc = mf_step_graph_new(eng, n, par, n_units, unit_end, &sh->sg);
    if (rc) {
        free(sh);
        return mf_error_wrap(rc, "step: building the graph of a batch of %d", n);
    }
    sh->g = sh->sg->g;
    sh->n_slots = sh->sg->n_slots;
    sh->p_exp = sh->sg->p_exp;
    sh->p_sh = sh->sg->p_sh;
    sh->p_head = sh->sg->p_head;
    sh->p_attn = sh->sg->p_attn;
    sh->store_layer = -1;
    if (eng->store) {
        sh->n_parts = mf_store_n_parts(eng->store);
        sh->slot_w = calloc((size_t)sh->n_slots * 3, sizeof *sh->slot_w);
        sh->slot_rd = calloc((size_t)sh->n_slots * sh->n_parts, sizeof *sh->slot_rd);
        if (!sh->slot_w || !sh->slot_rd) {
            mf_step_shape_free(sh);
            return mf_error(-ENOMEM, "step: out of memory");
        }
        for (int i = 0; i < sh->n_slots * sh->n_parts; i++) sh->slot_rd[i] = (mf_io_read){.fd = -1};
    }
    sh->dev_layer = -1;
    int shared = n_units > 0, ln = shared ? eng->max_items : n;   /* the layout's items */
    mf_sg_card_in ci = mf_step_card_in(eng, sh->sg, ln);
    mf_sg_card_bufs_of(&ci, &sh->cb);
    if ((rc = mf_step_shape_cards(eng, sh))) {
        mf_step_shape_free(sh);
        return rc;
    }
    if ((rc = mf_step_shape_host(eng, sh, n, shared, ln))) return rc;   /* sh freed */
    if ((rc = mf_step_shape_dense(eng, sh))) {
        mf_step_shape_free(sh);
        return rc;
    }
    rc = mf_step_bind(eng, sh);
    if (rc) {
        mf_step_shape_free(sh);
        return mf_error_wrap(rc, "step: building the graph of a batch of %d", n);
    }
    eng->builds.n_built++;
    eng->builds.build_ns += mf_now_ns() - t0;
    *out = sh;
    return 0;
}

/* The shape for items of `states` (one state's items consecutive): per-item parts one task per
 * run of a state's items (a unit), run in order; with hooks set, one task for all (the hooks are
 * called in order on one thread then). Units all single: the parallel shape; one unit: the
 * serial one; else a unit shape, built on first use and kept among the last
 * MF_STEP_UNIT_SHAPES used. */
int mf_step_shape_of(mf_step *s, mf_ref_state *const *states, int n, mf_step_shape **out)
{
    const mf_ref_hooks *hk = &s->ly->hooks;
    int hooks = hk->on_route || hk->on_select || hk->on_candidates, n_units = 0, unit_end[MF_STEP_MAX_ITEMS], rc;
    if (n > MF_STEP_MAX_ITEMS) {   /* a long chunk of one sequence (mf_step_forward_chunks checked it) */
        if (!s->long_shape || s->long_shape->n != n) {
            if (s->last == s->long_shape) s->last = NULL;
            mf_step_shape_free(s->long_shape);
            s->long_shape = NULL;
            if ((rc = mf_step_shape_new(s, n, 0, 0, NULL, &s->long_shape))) return rc;
        }
        *out = s->long_shape;
        return 0;
    }
    for (int i = 1; i <= n; i++)
        if (i == n || states[i] != states[i - 1]) unit_end[n_units++] = i;
    int par = n > 1 && !hooks && n_units == n;
    if (hooks || n_units == 1 || par) {
        if (!s->shapes[par][n] && (rc = mf_step_shape_new(s, n, par, 0, NULL, &s->shapes[par][n]))) return rc;
        *out = s->shapes[par][n];
        return 0;
    }
    s->n_calls++;
    int lru = 0;
    for (int k = 0; k < MF_STEP_UNIT_SHAPES; k++) {
        const mf_stepgraph *g = s->ushapes[k] ? s->ushapes[k]->sg : NULL;
        if (g && g->n == n && g->n_units == n_units && !memcmp(g->unit_end, unit_end, sizeof(int) * (size_t)n_units)) {
            s->ushape_used[k] = s->n_calls;
            *out = s->ushapes[k];
            return 0;
        }
        if (s->ushape_used[k] < s->ushape_used[lru]) lru = k;
    }
    if (s->last == s->ushapes[lru]) s->last = NULL;
    mf_step_shape_free(s->ushapes[lru]);
    s->ushapes[lru] = NULL;
    s->ushape_used[lru] = 0;
    if ((rc = mf_step_shape_new(s, n, 0, n_units, unit_end, &s->ushapes[lru]))) return rc;
    s->ushape_used[lru] = s->n_calls;
    *out = s->ushapes[lru];
    return 0;
}
