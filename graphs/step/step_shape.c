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
    for (int k = 0; k < 2; k++) free(sh->pre_card[k]), free(sh->pre_dev[k]), free(sh->pre_miss[k]);
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
                                             mf_step_draft_fn_of,  mf_step_net_fn_of,       mf_step_shape_fn_of};
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
    if (a->t->i1 <= a->t->i0) return 0;   /* dead items (mf_stepgraph_set_live) */
    if (a->t->i1 - a->t->i0 == 1) return fn(arg, ctx);
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

/* The step graph options of a shape of n items (parallel, mixed or serial); fn_of: MF_SG_N_OPS
 * entries, filled, kept by the caller while the options are used. */
mf_sg_opts mf_step_sg_opts(const mf_step *eng, int n, int par, int mixed, mf_task_fn *fn_of)
{
    for (int op = 0; op < MF_SG_N_OPS; op++)   /* the per-item ops over their item groups; the mixes
                                                 * take their whole item group (mf_step_mix_rows) */
        fn_of[op] = mf_sg_op_per_item(op) && op != MF_SG_ATTN_MIX && op != MF_SG_FFN_MIX ? mf_task_items
                                                                                          : mf_step_fn_of(op);
    const mf_ref_hooks *hk = &eng->ly->hooks;
    int ordered = hk->on_route || hk->on_select || hk->on_candidates;   /* the hooks in item order */
    return (mf_sg_opts){.c = eng->c, .sz = eng->sz, .n = n, .par = par, .mixed = mixed, .ordered = ordered,
                        .n_threads = eng->o.n_threads, .n_cards = eng->n_cards,
                        .n_dense_cards = eng->n_dense, .dense_split = eng->o.dense_split,
                        .in_split = eng->o.in_split, .in_whole = eng->in_whole,
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
                        .profile = eng->o.profile,
                        .layer_begin = eng->l0, .layer_end = eng->l1, .lane_net = eng->lt.lane_net,
                        .feats = eng->o.draft && eng->c->n_mtp_layers > 0};
}

/* The draft round's graph options (mf_sg_opts.draft): n_seq units of dspark_block_size items, the
 * routed experts on the host or on the cards while they hold the draft's (mf_step_draft_cards: the
 * route places them; no store, device graphs or micro-batches: the draft's experts are resident),
 * the dense work on the dense cards when the steps' is there. */
static mf_sg_opts mf_step_draft_opts(const mf_step *eng, int n_seq, int *unit_end, mf_task_fn *fn_of)
{
    int B = eng->c->dspark_block_size;
    for (int k = 0; k < n_seq; k++) unit_end[k] = (k + 1) * B;
    mf_sg_opts o = mf_step_sg_opts(eng, n_seq * B, 0, 0, fn_of);
    o.draft = 1;
    o.feats = 0;
    o.n_units = n_seq;
    o.unit_end = unit_end;
    o.dev_graphs = o.store = o.eg_reads = 0;   /* its dense work where the steps' is */
    o.layer_begin = o.layer_end = 0;                       /* its own stages (a whole model's: mf_step_draft_check) */
    o.micro = 1;
    o.prefetch_min = -1;
    o.ordered = 0;
    return o;
}

/* The step graph of a shape of n items (parallel, mixed or serial; a draft round's of n /
 * dspark_block_size sequences) on the engine's lanes. */
static int mf_step_graph_new(mf_step *eng, int n, int par, int mixed, int draft, mf_stepgraph **out)
{
    mf_task_fn fn_of[MF_SG_N_OPS];
    int ue[MF_STEP_DRAFT_ITEMS];
    mf_sg_opts o = draft ? mf_step_draft_opts(eng, n / eng->c->dspark_block_size, ue, fn_of)
                         : mf_step_sg_opts(eng, n, par, mixed, fn_of);
    return mf_stepgraph_new(&o, out);
}

/* What the card buffers of shape graph sg (laid out for ln items) take (stepgraph.h: the one layout
 * of them, which the simulator and the caches' sizing read too). */
mf_sg_card_in mf_step_card_in(const mf_step *eng, const mf_stepgraph *sg, int ln)
{
    return (mf_sg_card_in){.c = eng->c, .sg = sg, .ln = ln, .sh_rows = (int64_t)eng->sz->sh_rows,
                           .exact = eng->o.exact, .dev_graphs = eng->dev_graphs, .head_rows = eng->o.head_rows};
}

/* Each task's argument: its record (its worker's layer context is found when it runs); an IO
 * task's its read in the shape's buffers (again after they are carved again). */
static void mf_step_bind_args(mf_step_shape *sh)
{
    mf_stepgraph *sg = sh->sg;
    for (int t = 0; t < sg->n_tasks; t++) {
        const mf_sg_task *rec = &sg->task[t];
        sh->args[t] = (mf_step_targ){sh, rec};
        if (rec->op == MF_SG_SLOT_READ)
            mf_graph_set_arg(sh->g, t, &sh->slot_rd[(size_t)rec->slot * sh->n_parts + rec->read]);
        else if (rec->op == MF_SG_ENGRAM_READ)
            mf_graph_set_arg(sh->g, t, &sh->eg_rd[mf_step_eg_row(sh, rec->layer, rec->i0) * 2 * sh->eg_per + rec->read]);
        else
            mf_graph_set_arg(sh->g, t, &sh->args[t]);
    }
}

/* Binds the shape's buffers to its graph's tasks (mf_step_bind_args), then the timeline and the
 * spans' scratch. */
static int mf_step_bind(mf_step *eng, mf_step_shape *sh)
{
    (void)eng;
    int n = sh->sg->n_tasks;
    sh->args = calloc((size_t)n, sizeof *sh->args);
    sh->sorted = malloc(sizeof *sh->sorted * 2 * (size_t)n);
    if (!sh->args || !sh->sorted) return mf_error(-ENOMEM, "step: out of memory for the graph");
    mf_step_bind_args(sh);
    return mf_timeline_create(sh->g, &sh->tl);
}

/* The card buffers of shape sh (experts on cards): slot tables, one device allocation per card
 * (rows in, token weights, h, quantized h, outputs, the FFN graphs' slot tables). 0 or a negative
 * code; the caller frees sh. */
static int mf_step_shape_cards(mf_step *eng, mf_step_shape *sh)
{
    const mf_config *c = eng->c;
    int n = sh->n;
    if (!sh->sg->n_cards) return 0;
    sh->slot_card = malloc((size_t)sh->n_slots * sizeof *sh->slot_card);
    sh->slot_dev = calloc((size_t)sh->n_slots, sizeof *sh->slot_dev);
    sh->slot_miss = calloc((size_t)sh->n_slots, 1);
    if (!sh->slot_card || !sh->slot_dev || !sh->slot_miss) return mf_error(-ENOMEM, "step: out of memory");
    for (int s = 0; s < sh->n_slots; s++) sh->slot_card[s] = -1;
    if (sh->sg->prefetch) {
        size_t E = (size_t)c->n_routed_experts;
        for (int k = 0; k < 2; k++) {
            sh->pre_card[k] = malloc(E * sizeof *sh->pre_card[k]);
            sh->pre_dev[k] = calloc(E, sizeof *sh->pre_dev[k]);
            sh->pre_miss[k] = calloc(E, 1);
            if (!sh->pre_card[k] || !sh->pre_dev[k] || !sh->pre_miss[k]) return mf_error(-ENOMEM, "step: out of memory");
            for (size_t e = 0; e < E; e++) sh->pre_card[k][e] = -1;
        }
        sh->pre_cached = calloc(E, 1);
        if (!sh->pre_cached) return mf_error(-ENOMEM, "step: out of memory");
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
    sh->d_ri = cb->ri;
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
    if (!sh->sg->n_dense_cards) return 0;
    const mf_sg_card_bufs *cb = &sh->cb;
    for (int b = 0; b < MF_LY_A_N; b++) {
        sh->dd_ab[b] = cb->ab[b];
    }
    sh->dd16_xin = cb->xin16;
    sh->dd_xin = cb->xin;
    sh->dd_logits = cb->logits;
    sh->dd_hs = cb->hs;
    sh->dd_gs = cb->gs;
    sh->dd_us = cb->us;
    sh->dd_ys = cb->ys;
    sh->dd_hn = cb->hn;
    sh->head_rows = cb->head_rows;
    sh->dd_lbuf = cb->lbuf;
    sh->dd_mk_in = cb->mk_in;
    sh->dd_mk_out = cb->mk_out;
    sh->dd_eg_emb = cb->eg_emb;
    sh->dd_eg_kv = cb->eg_kv;
    sh->dd_hk_tab = cb->hk_tab;
    sh->dd_hk_keys = cb->hk_keys;
    sh->dd_hk_nk = cb->hk_nk;
    sh->dd_hk_sink = cb->hk_sink;
    sh->dd_hk_rope = cb->hk_rope;
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

/* What a shape's host buffers depend on beside its graph: the engine's settings (mf_step_host_in_of)
 * or, for the simulator's report, the same from its options (mf_step_host_bytes). */
typedef struct mf_step_host_in {
    const mf_config *c;
    int64_t sh_rows;          /* the shared expert's hidden rows */
    int exact, n_cards, n_dense, micro;
    int eg_reads;             /* streamed Engram tables: the gathers' buffers */
    const mf_store *store;    /* with eg_reads: its gather plans' scratch */
    int net;                  /* a pipeline stage: the items' boundaries (the simulator's report leaves them out) */
} mf_step_host_in;

static mf_step_host_in mf_step_host_in_of(const mf_step *eng)
{
    return (mf_step_host_in){.c = eng->c, .sh_rows = (int64_t)eng->sz->sh_rows, .exact = eng->o.exact,
                             .n_cards = eng->n_cards, .n_dense = eng->n_dense, .micro = eng->o.micro,
                             .eg_reads = eng->eg_reads, .store = eng->store,
                             .net = eng->lt.lane_net >= 0};
}

/* The Engram rows of shape sh's items (ln laid out): an item's rows and their lengths (the card
 * buffers' layout), its part of the gather plans' scratch with streamed tables. Returns the values
 * of a table row (0: no Engram). */
static size_t mf_step_shape_engram(const mf_step_host_in *in, mf_step_shape *sh, int ln)
{
    const mf_config *c = in->c;
    size_t eg_d = 0;
    if (c->n_engram > 0) {   /* Engram rows of one item, its wkv output */
        sh->eg_per = sh->cb.eg_per;
        sh->eg_emb_ld = sh->cb.eg_emb_ld;
        sh->eg_kv_ld = sh->cb.eg_kv_ld;
        eg_d = (size_t)c->engram_head_dim;
        if (in->eg_reads) sh->eg_scratch_item = (mf_store_gather_bytes(in->store, sh->eg_per) + 15) / 16 * 16;
    }
    sh->eg_items = ln;
    return eg_d;
}

/* The expert slots shape sh's buffers hold: its graph's, or for a bucket's shape (shared: laid out
 * in the engine's umem for ln items, nk = ln x top_k rows) the most a shape of ln items has (two
 * micro-batches: experts per half at most). */
static size_t mf_step_shape_slots(const mf_step_host_in *in, const mf_step_shape *sh, int shared, size_t nk)
{
    size_t cap = (size_t)(in->micro == 2 ? 2 : 1) * (size_t)in->c->n_routed_experts;
    return !shared ? (size_t)sh->n_slots : nk < cap ? nk : cap;
}

/* Carves the rows of tab (n_tab, each from a 64-byte boundary) from one allocation: for a bucket's
 * shape (shared) the engine's umem, allocated by the first one laid out for ln = umem_items items;
 * else the shape's own (sh->mem). Fails without the memory. */
static int mf_step_shape_carve(mf_step *eng, mf_step_shape *sh, const mf_step_buf *tab, int n_tab, int shared, int ln)
{
    size_t bytes = 0;
    for (int i = 0; i < n_tab; i++) bytes += (tab[i].bytes + 63) / 64 * 64;
    uint8_t *p = shared ? eng->umem : NULL;
    if (shared && p && bytes != eng->umem_bytes)
        return mf_error(-EINVAL, "step: shape buffers of %zu bytes, the engine laid out %zu", bytes, eng->umem_bytes);
    if (!p) {
        if (!(p = aligned_alloc(64, bytes)))
            return mf_error(-ENOMEM, "step: cannot allocate %zu bytes of buffers for a batch of %d", bytes, ln);
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

#define MF_STEP_HOST_ROWS 96   /* rows of the host buffers' table at most */

/* The table of shape sh's host buffers laid out for ln items ({name, bytes, &ptr}: sized here,
 * carved by mf_step_shape_carve) into tab; returns its rows. Sets the shape's row lengths and the
 * sizes the tasks read (eg_*, sk_rows, hk_ecap, q8 row bytes). */
static int mf_step_host_table(const mf_step_host_in *in, mf_step_shape *sh, int shared, int ln, mf_step_buf *tab)
{
    const mf_config *c = in->c;
    int64_t H = c->hidden_size, I = c->moe_intermediate_size, V = c->vocab_size;
    int64_t Ish = c->n_shared_experts > 0 ? in->sh_rows : 0;
    int K = c->n_experts_per_tok, E = c->n_routed_experts, hc = c->hc_mult;
    int n_cb = c->candidate_topk_blocks > 0 ? c->candidate_topk_blocks : 1;
    /* the int8 rows by rows (host/kernels.h mf_kern_q8_bytes): a slot's area where its rows are */
    size_t nk = (size_t)ln * K, q8x = mf_kern_q8_bytes(1, (int)H), q8h = mf_kern_q8_bytes(1, (int)I);
    int ex = in->exact, cards = in->n_cards > 0 && sh->sg->n_cards > 0;
    size_t f = sizeof(float), ab_sz[MF_LY_A_N];
    size_t eg_d = mf_step_shape_engram(in, sh, ln);
    size_t eg_items = (size_t)ln * (size_t)c->n_engram;   /* one set of rows per Engram slot */
    size_t eg_n = in->eg_reads ? eg_items * sh->eg_per : 0;
    /* with dense cards: the bf16 mirrors of what their chains copy as bf16 (mf_sg_attn_buf_bf16) */
    size_t ab16_sz[MF_LY_A_N], dn = in->n_dense > 0 ? (size_t)ln : 0;
    /* the draft: a step's features, a round's feed rows, key tables and Markov logits */
    size_t fo = sh->sg->feats ? (size_t)ln : 0, du = sh->sg->draft ? (size_t)sh->sg->n_units : 0;
    size_t dfr = du * (size_t)c->sliding_window, D = (size_t)c->head_dim;
    size_t dkr = (size_t)c->sliding_window + (size_t)c->dspark_block_size;
    sh->dfeed_rows = (int)dfr;
    for (int b = 0; b < MF_LY_A_N; b++) {
        sh->ab_ld[b] = sh->cb.ab_ld[b];
        ab_sz[b] = (size_t)ln * sh->ab_ld[b] * sizeof(float);
        ab16_sz[b] = mf_sg_attn_buf_bf16(b) ? dn * sh->ab_ld[b] * 2 : 0;
    }
    size_t xin16_sz = mf_sg_dense_bf16(MF_SG_D_GATE, 0) ? dn * H * 2 : 0;
    size_t ys16_sz = mf_sg_dense_bf16(MF_SG_D_SHARED, 1) && c->n_shared_experts > 0 ? dn * H * 2 : 0;
    int has_comp = 0;
    for (int L = 0; L < c->n_layers; L++) has_comp |= c->compress_ratios[L] > 0;
    size_t n_ = (size_t)ln, ns = mf_step_shape_slots(in, sh, shared, nk);
    /* the heads on cards: the key table's entries at most (a longer union runs the host's heads) */
    int hk = sh->sg->heads_any, sk = sh->sg->scores_any;
    sh->sk_rows = sh->cb.sk_rows;   /* a card's items of the index scores at most */
    sh->hk_ecap = sh->cb.hk_ecap;
    sh->q8x_bytes = q8x;
    sh->q8h_bytes = q8h;
    const mf_step_buf t[] = {
        {"items", n_ * sizeof(mf_ly_item), (void **)&sh->items},
        {"streams", n_ * hc * H * f, (void **)&sh->streams},
        {"topk", n_ * c->index_topk * 4, (void **)&sh->topk_rows},
        {"sel_kv", has_comp ? n_ * c->index_topk * c->head_dim * f : 0, (void **)&sh->sel_kv_rows},
        {"candidates", n_ * n_cb * 4, (void **)&sh->cand_rows},
        {"xin", n_ * H * f, (void **)&sh->xin},
        {"moe_out", n_ * H * f, (void **)&sh->moe_out},
        {"net", in->net ? n_ * (size_t)mf_sg_boundary_floats(c) * f : 0, (void **)&sh->net},
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
        {"xg16", cards && !sh->sg->slot_gather ? nk * H * 2 : 0, (void **)&sh->xg16},
        {"row_item", sh->sg->slot_gather ? nk * 4 : 0, (void **)&sh->row_item},
        {"y16", cards ? nk * H * 2 : 0, (void **)&sh->y16},
        {"row_card", cards ? nk : 0, (void **)&sh->row_card},
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
        {"eg_scratch", in->eg_reads ? eg_items * sh->eg_scratch_item : 0, (void **)&sh->eg_scratch},
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
        {"hk_rope", sh->sg->heads_local_any || sh->sg->heads_qlocal_any ? n_ * c->qk_rope_head_dim * f : 0,
         (void **)&sh->hk_rope},
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
        {"feat_out", fo * sizeof(float *), (void **)&sh->feat_out},
        {"dseq", du * sizeof(mf_step_draft_seq), (void **)&sh->dseq},
        {"dfeed_x", dfr * (size_t)c->n_dspark_target * H * f, (void **)&sh->dfeed_x},
        {"dfeed_u", dfr * H * f, (void **)&sh->dfeed_u},
        {"dkv", (size_t)c->n_mtp_layers * dfr * D * f, (void **)&sh->dkv},
        {"dkeys", du * dkr * D * f, (void **)&sh->dkeys},
        {"dmk", du * V * f, (void **)&sh->dmk},
        {"dmk_in", dn ? (size_t)in->n_dense * du * (size_t)c->dspark_markov_rank * f : 0, (void **)&sh->dmk_in},
        {"dfeed_off", du * sizeof(int), (void **)&sh->dfeed_off},
        {"dfeed_n", du * sizeof(int), (void **)&sh->dfeed_n},
        {"dnkeys", du * sizeof(int), (void **)&sh->dnkeys},
    };
    _Static_assert(MF_LY_A_N == 11, "one row per attention buffer");
    _Static_assert(sizeof t / sizeof t[0] <= MF_STEP_HOST_ROWS, "the table's rows");
    memcpy(tab, t, sizeof t);
    return (int)(sizeof t / sizeof t[0]);
}

/* The host buffers of shape sh of n items (ln laid out; shared: in the engine's umem): its table
 * (mf_step_host_table) carved from one allocation (mf_step_shape_carve); the items' streams and
 * lists in them. 0 or a negative code (the caller frees sh). */
static int mf_step_shape_host(mf_step *eng, mf_step_shape *sh, int n, int shared, int ln)
{
    const mf_config *c = eng->c;
    mf_step_host_in in = mf_step_host_in_of(eng);
    mf_step_buf tab[MF_STEP_HOST_ROWS];
    size_t nk = (size_t)ln * c->n_experts_per_tok;
    if ((size_t)sh->n_slots > mf_step_shape_slots(&in, sh, shared, nk))
        return mf_error(-EINVAL, "step: a shape of %d items has %d expert slots, past the %zu laid out", n, sh->n_slots,
                        mf_step_shape_slots(&in, sh, shared, nk));
    int n_tab = mf_step_host_table(&in, sh, shared, ln, tab), rc;
    if ((rc = mf_step_shape_carve(eng, sh, tab, n_tab, shared, ln))) return rc;
    for (int b = 0; b < MF_LY_A_N; b++)
        if (mf_sg_attn_buf_bf16(b) && eng->n_dense > 0 && sh->ab_ld[b] > 0 && !sh->ab16[b])   /* a bf16 buffer without a row */
            return mf_error(-EINVAL, "step: attention buffer %d is copied as bf16 but has no mirror (internal)", b);
    sh->ln = ln;
    int64_t H = c->hidden_size;
    int n_cb = c->candidate_topk_blocks > 0 ? c->candidate_topk_blocks : 1;
    for (int i = 0; i < n; i++) {
        sh->items[i].x = sh->streams + (size_t)i * c->hc_mult * H;
        sh->items[i].topk = sh->topk_rows + (size_t)i * c->index_topk;
        sh->items[i].sel_kv = sh->sel_kv_rows ? sh->sel_kv_rows + (size_t)i * c->index_topk * c->head_dim : NULL;
        sh->items[i].cand = sh->cand_rows + (size_t)i * n_cb;
    }
    return 0;
}

uint64_t mf_step_host_bytes(const mf_config *c, const mf_sg_sizes *sz, const mf_stepgraph *sg, int exact, int n_cards,
                            int n_dense, int micro)
{
    mf_step_shape *sh = calloc(1, sizeof *sh);
    if (!sh) return 0;
    mf_step_host_in in = {.c = c, .sh_rows = (int64_t)sz->sh_rows, .exact = exact, .n_cards = n_cards,
                          .n_dense = n_dense, .micro = micro};
    sh->sg = (mf_stepgraph *)sg;   /* only read */
    sh->n_slots = sg->n_slots;
    mf_sg_card_bufs_of(&(mf_sg_card_in){.c = c, .sg = sg, .ln = sg->n, .sh_rows = (int64_t)sz->sh_rows, .exact = exact},
                       &sh->cb);
    mf_step_buf tab[MF_STEP_HOST_ROWS];
    int n_tab = mf_step_host_table(&in, sh, sg->par || sg->mixed, sg->n, tab);
    uint64_t bytes = 0;
    for (int i = 0; i < n_tab; i++) bytes += (tab[i].bytes + 63) / 64 * 64;
    free(sh);
    return bytes;
}

/* A shape of n items: parallel, mixed (a bucket's shape, its buffers the engine's umem, laid out
 * for umem_items >= n items), serial or a draft round's (draft 1; these two own their buffers). In
 * order: its graph, the store's slot reads, the cards' buffers (mf_step_shape_cards, laid out for
 * n), the host's (mf_step_shape_host), the dense cards' (mf_step_shape_dense), the tasks bound
 * (mf_step_bind). */
static int mf_step_shape_new(mf_step *eng, int n, int par, int mixed, int draft, mf_step_shape **out)
{
    int64_t t0 = mf_now_ns();
    mf_step_shape *sh = calloc(1, sizeof *sh);
    if (!sh) return mf_error(-ENOMEM, "step: out of memory");
    sh->eng = eng;
    sh->n = n;
    sh->par = par;
    int rc = mf_step_graph_new(eng, n, par, mixed, draft, &sh->sg);
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
    if (eng->store && !draft) {   /* the draft's experts are resident, never in the store */
        sh->n_parts = mf_store_n_parts(eng->store);
        sh->slot_w = calloc((size_t)sh->n_slots * 3, sizeof *sh->slot_w);
        sh->slot_rd = calloc((size_t)sh->n_slots * sh->n_parts, sizeof *sh->slot_rd);
        if (!sh->slot_w || !sh->slot_rd) {
            mf_step_shape_free(sh);
            return mf_error(-ENOMEM, "step: out of memory");
        }
        for (int i = 0; i < sh->n_slots * sh->n_parts; i++) sh->slot_rd[i] = (mf_io_read){.fd = -1};
    }
    sh->dev_layer = sh->pre_layer[0] = sh->pre_layer[1] = sh->pre_left_layer = -1;
    int shared = par || mixed, ln = shared ? eng->umem_items : n;   /* the host layout's items */
    mf_sg_card_in ci = mf_step_card_in(eng, sh->sg, n);
    mf_sg_card_bufs_of(&ci, &sh->cb);
    if ((rc = mf_step_shape_cards(eng, sh)) || (rc = mf_step_shape_host(eng, sh, n, shared, ln)) ||
        (rc = mf_step_shape_dense(eng, sh)) || (rc = mf_step_bind(eng, sh))) {
        mf_step_shape_free(sh);
        return mf_error_wrap(rc, "step: building the shape of a batch of %d", n);
    }
    eng->builds.n_built++;
    eng->builds.build_ns += mf_now_ns() - t0;
    *out = sh;
    return 0;
}

/* Frees every bucket's shape and the arena they share. */
static void mf_step_buckets_free(mf_step *s)
{
    for (int k = 0; k < 2; k++)
        for (int j = 0; j < MF_STEP_N_BUCKETS; j++) {
            if (s->last == s->bshapes[k][j]) s->last = NULL;
            mf_step_shape_free(s->bshapes[k][j]);
            s->bshapes[k][j] = NULL;
        }
    free(s->umem);
    s->umem = NULL;
    s->umem_bytes = 0;
    s->umem_items = 0;
}

/* The shape of bucket j (2^j items) of kind `mixed` (0: parallel), built on first use. A bucket
 * larger than the arena's layout lays it out again for its items and carves the kept buckets'
 * buffers from it (their IO tasks' reads bound again); on a failure every bucket is let go. */
static int mf_step_bucket(mf_step *s, int mixed, int j, mf_step_shape **out)
{
    int N = 1 << j, rc = 0;
    if (!s->bshapes[mixed][j]) {
        if (N > s->umem_items) {   /* a new layout: the kept shapes' buffers follow it */
            free(s->umem);
            s->umem = NULL;
            s->umem_bytes = 0;
            s->umem_items = N;
        }
        rc = mf_step_shape_new(s, N, !mixed, mixed, 0, &s->bshapes[mixed][j]);
        for (int k = 0; k < 2 && !rc; k++)
            for (int i = 0; i < MF_STEP_N_BUCKETS && !rc; i++) {
                mf_step_shape *sh = s->bshapes[k][i];
                if (!sh || sh->ln == s->umem_items) continue;
                if (!(rc = mf_step_shape_host(s, sh, sh->n, 1, s->umem_items))) mf_step_bind_args(sh);
            }
        if (rc) {
            mf_step_buckets_free(s);
            return rc;
        }
    }
    *out = s->bshapes[mixed][j];
    return 0;
}

/* The shape for items of `states` (one state's items consecutive). With hooks set, or one
 * sequence's items: a serial shape (the hooks are called in item order on one thread), kept per
 * length up to MF_STEP_SERIAL_ITEMS, longer the one long shape. Else a bucket's shape
 * (mf_sg_bucket): parallel when every sequence has one item (decode tokens), mixed otherwise
 * (prefill chunks beside them), its first n items live (mf_stepgraph_set_live): a step's
 * composition builds nothing once its bucket exists. */
int mf_step_shape_of(mf_step *s, mf_ref_state *const *states, int n, mf_step_shape **out)
{
    const mf_ref_hooks *hk = &s->ly->hooks;
    int hooks = hk->on_route || hk->on_select || hk->on_candidates, n_units = 0, rc;
    for (int i = 1; i <= n; i++) n_units += i == n || states[i] != states[i - 1];
    if (hooks || n_units == 1) {
        mf_step_shape **slot = n <= MF_STEP_SERIAL_ITEMS ? &s->shapes[n] : &s->long_shape;
        if (*slot && (*slot)->n != n) {   /* the long shape of another length */
            if (s->last == *slot) s->last = NULL;
            mf_step_shape_free(*slot);
            *slot = NULL;
        }
        if (!*slot && (rc = mf_step_shape_new(s, n, 0, 0, 0, slot))) return rc;
        *out = *slot;
        return 0;
    }
    int N = mf_sg_bucket(n), j = 0;
    while (1 << j < N) j++;
    if ((rc = mf_step_bucket(s, n_units < n, j, out))) return rc;
    mf_stepgraph_set_live((*out)->sg, n);
    return 0;
}

int mf_step_draft_shape(mf_step *s, int n_seq, mf_step_shape **out)
{
    int B = s->c->dspark_block_size;
    if (n_seq < 1 || n_seq * B > MF_STEP_DRAFT_ITEMS)
        return mf_error(-EINVAL, "step: a draft round of %d sequences (expected 1..%d)", n_seq, MF_STEP_DRAFT_ITEMS / B);
    int rc = s->dshapes[n_seq] ? 0 : mf_step_shape_new(s, n_seq * B, 0, 0, 1, &s->dshapes[n_seq]);
    *out = s->dshapes[n_seq];
    return rc;
}
