/* Dense work on cards (mf_sg_opts.n_dense_cards): which card holds a layer's dense sublayers, their
 * split by rows and item blocks, the weight bytes and the card buffer layout a step takes
 * (mf_sg_card_bufs_of, mf_sg_card_reserve: step.c and the simulator allocate from it), the bf16
 * copies, and the dense chain (copy in -> card work -> copy out) that stepgraph_attn.c, _engram.c,
 * _moe.c and _head.c build their sublayers on cards with. */
#include "graphs/step/stepgraph_impl.h"

#include <stdio.h>
#include <string.h>

#include "sched/error.h"

/* ---- which card, which rows ------------------------------------------------------------------ */

int mf_sg_dense_card(const mf_config *c, int n_cards, int L) { return mf_sg_dense_card_in(c, n_cards, 0, c->n_layers, L); }

int mf_sg_dense_card_in(const mf_config *c, int n_cards, int l0, int l1, int L)
{
    int nl = l1 - l0, pos[MF_CONFIG_MAX_IDS + 2], m = 0;   /* positions relative to l0 */
    if (n_cards < 1 || nl < 1) return 0;
    if (L < l0 || L >= l1) L = l1 - 1;
    L -= l0;
    pos[m++] = 0;   /* candidate first layers, ascending: the range's first and the KV sources */
    for (int l = 1; l < nl; l++)
        for (int i = 0; i < c->n_kv_source; i++)
            if (c->kv_source_layer_ids[i] == l0 + l && m < MF_CONFIG_MAX_IDS + 1) {
                pos[m++] = l;
                break;
            }
    pos[m] = nl;
    int k = n_cards < m ? n_cards : m;
    /* f[g][j]: the least largest range covering layers [0, pos[j]) with g ranges; arg: its last cut */
    int f[MF_SG_MAX_CARDS + 1][MF_CONFIG_MAX_IDS + 2], arg[MF_SG_MAX_CARDS + 1][MF_CONFIG_MAX_IDS + 2];
    for (int j = 1; j <= m; j++) f[1][j] = pos[j], arg[1][j] = 0;
    for (int g = 2; g <= k; g++)
        for (int j = g; j <= m; j++) {
            f[g][j] = nl + 1;
            for (int i = g - 1; i < j; i++) {
                int v = f[g - 1][i] > pos[j] - pos[i] ? f[g - 1][i] : pos[j] - pos[i];
                if (v < f[g][j]) f[g][j] = v, arg[g][j] = i;
            }
        }
    for (int g = k, j = m; g >= 1; g--) {   /* range g - 1 is [pos[arg], pos[j]) */
        int i = arg[g][j];
        if (L >= pos[i]) return g - 1;
        j = i;
    }
    return 0;
}

static const char *const sg_dense_name[MF_SG_N_DENSE] = {"attn in", "attn qb", "attn oa",    "attn ob",
                                                         "gate",    "shared",  "head",       "engram wkv",
                                                         "markov"};

const char *mf_sg_dense_name(int d) { return d >= 0 && d < MF_SG_N_DENSE ? sg_dense_name[d] : "?"; }

int mf_sg_dense_parts(int n_dense_cards, int split, int dense)
{
    return split == MF_SG_SPLIT_ROWS && dense != MF_SG_D_SHARED && n_dense_cards > 1 ? n_dense_cards : 1;
}

int mf_sg_dense_whole(const mf_config *c, int n_dense_cards, int split, int in_whole, int dense, int L)
{
    return dense == MF_SG_D_ATTN_IN && split == MF_SG_SPLIT_ROWS && n_dense_cards > 1 && in_whole && L >= 0 &&
           L < c->n_layers;
}

/* The in stage's item blocks over n items split by items over `parts` cards: as many a card as
 * the split by rows gives each card (mf_sg_dense_blocks), so that a card's copies run beside its
 * work as much, while each block holds block_min items (0: MF_SG_DENSE_BLOCK); at least the split
 * by rows' blocks. */
static int sg_in_blocks(int n, int block_min, int parts)
{
    int m = block_min > 0 ? block_min : MF_SG_DENSE_BLOCK, nb = mf_sg_dense_blocks(n, m), k = n / m;
    int want = nb * parts < k ? nb * parts : k;
    return want > nb ? want : nb;
}

/* The price of the slowest card's in stage chain of layer L over n items in nb blocks: split by
 * items (items 1: card k the blocks j with j mod parts == k, all rows) or by rows (every block, its
 * share of the rows); each card's blocks' copies in, work and copies out one after another. */
static double sg_in_ns(const mf_sg_opts *o, int L, int n, int nb, int parts, int items)
{
    const mf_config *c = o->c;
    const mf_sg_layer_sizes *y = &o->sz->layer[L];
    mf_cost_model m = {.p = o->profile ? o->profile : mf_cost_default_profile()};
    double rows = y->st_out_rows[MF_SG_ST_IN], in_tok = mf_sg_attn_val_bytes(MF_LY_A_IN) * c->hidden_size;
    double bf = mf_sg_attn_buf_bf16(MF_LY_A_QR) ? (double)c->q_lora_rank : 0, worst = 0;
    for (int k = 0; k < parts; k++) {
        int64_t r0 = 0, r1 = (int64_t)rows;
        if (!items) mf_sg_dense_rows(parts, k, (int64_t)rows, &r0, &r1);
        double share = rows > 0 ? (double)(r1 - r0) / rows : 0, b16 = 0, ns = 0;
        b16 = (double)((r1 < bf ? r1 : bf) - (r0 < bf ? r0 : bf));
        mf_work w = {0};
        w.w_bytes[MF_KF_FP8] = y->st_fp8_bytes[MF_SG_ST_IN] * share;
        w.macs[MF_KF_FP8] = y->st_fp8_macs[MF_SG_ST_IN] * share;
        w.calls[MF_KF_FP8] = y->st_fp8_calls[MF_SG_ST_IN];
        w.w_bytes[MF_KF_BF16] = y->st_bf16_bytes[MF_SG_ST_IN] * share;
        w.macs[MF_KF_BF16] = y->st_bf16_macs[MF_SG_ST_IN] * share;
        w.calls[MF_KF_BF16] = y->st_bf16_calls[MF_SG_ST_IN];
        for (int j = 0; j < nb; j++) {
            if (items && j % parts != k) continue;
            double nt = (double)((int64_t)n * (j + 1) / nb - (int64_t)n * j / nb);
            ns += mf_cost_act_copy(&m, 0, in_tok * nt) + mf_cost_card(&m, &w, (int)nt) +
                  (r1 > r0 ? mf_cost_act_copy(&m, 1, (4.0 * (double)(r1 - r0) - 2.0 * b16) * nt) : 0);
        }
        if (ns > worst) worst = ns;
    }
    return worst;
}

int mf_sg_in_items(const mf_sg_opts *o, int n, int L)
{
    int parts = mf_sg_dense_parts(o->n_dense_cards, o->dense_split, MF_SG_D_ATTN_IN);
    if (o->draft || parts < 2 || o->in_split == MF_SG_IN_ROWS ||
        !mf_sg_dense_whole(o->c, o->n_dense_cards, o->dense_split, o->in_whole, MF_SG_D_ATTN_IN, L))
        return 0;
    int nb = mf_sg_dense_blocks(n, o->dense_block), nbi = sg_in_blocks(n, o->dense_block, parts);
    if (o->in_split == MF_SG_IN_ITEMS) return nbi > 1;
    return nbi > 1 && sg_in_ns(o, L, n, nbi, parts, 1) < sg_in_ns(o, L, n, nb, parts, 0);
}

int mf_sg_in_whole(const mf_sg_opts *o, int chunk)
{
    if (o->in_split == MF_SG_IN_ROWS || mf_sg_dense_parts(o->n_dense_cards, o->dense_split, MF_SG_D_ATTN_IN) < 2)
        return 0;
    if (o->in_split == MF_SG_IN_ITEMS) return 1;
    if (chunk < MF_SG_IN_WHOLE_MIN) return 0;
    mf_sg_opts w = *o;
    w.in_whole = 1;
    w.draft = 0;
    for (int L = 0; L < o->c->n_layers; L++)
        if (mf_sg_in_items(&w, chunk, L)) return 1;
    return 0;
}

int mf_sg_markov_parts(const mf_config *c, const mf_profile *p, double w_bytes, int n_dense_cards, int split)
{
    int parts = mf_sg_dense_parts(n_dense_cards, split, MF_SG_D_MARKOV);
    if (parts <= 1) return 1;
    mf_cost_model m = {.p = p ? p : mf_cost_default_profile()};
    double V = (double)c->vocab_size, R = c->dspark_markov_rank, ns[2];
    for (int k = 0; k < 2; k++) {   /* k 0: all rows on one card; 1: the first (largest) part's */
        int64_t r0 = 0, r1 = (int64_t)V;
        if (k) mf_sg_dense_rows(parts, 0, (int64_t)V, &r0, &r1);
        double share = (double)(r1 - r0) / V;
        mf_work w = {0};
        w.w_bytes[MF_KF_BF16] = w_bytes * share;
        w.macs[MF_KF_BF16] = V * R * share;
        w.calls[MF_KF_BF16] = 1;
        ns[k] = mf_cost_act_copy(&m, 0, 4.0 * R) + mf_cost_card_on(&m, &w, 1, 0) +
                mf_cost_act_copy(&m, 1, 4.0 * V * share);
    }
    return ns[1] < ns[0] ? parts : 1;
}

void mf_sg_dense_rows(int parts, int part, int64_t n_rows, int64_t *r0, int64_t *r1)
{
    if (part < 0 || parts <= 1) {
        *r0 = 0;
        *r1 = n_rows;
        return;
    }
    int64_t chunk = (n_rows + parts - 1) / parts;
    chunk = (chunk + 31) / 32 * 32;
    int64_t a = part * chunk, e = a + chunk;
    *r0 = a < n_rows ? a : n_rows;
    *r1 = e < n_rows ? e : n_rows;
}

void mf_sg_oa_exchange(const mf_sg_opts *o, mf_stepgraph *sg)
{
    const mf_config *c = o->c;
    int nc = o->n_dense_cards, parts = mf_sg_dense_parts(nc, o->dense_split, MF_SG_D_ATTN_OA);
    sg->oa_x = parts > 1 && !o->draft && mf_sg_dense_parts(nc, o->dense_split, MF_SG_D_ATTN_OB) == parts;
    memset(sg->oa_kept, 0, sizeof sg->oa_kept);
    if (!sg->oa_x) return;
    mf_cost_model m = {.p = o->profile ? o->profile : mf_cost_default_profile()};
    int n = sg->n_halves > 1 ? sg->n / 2 : sg->n, nb = mf_sg_dense_blocks(n, sg->dense_block);
    int64_t n_rows = (int64_t)c->o_groups * c->o_lora_rank, r0, r1;
    double tok = mf_sg_attn_val_bytes(MF_LY_A_Z) * (n / nb > 0 ? n / nb : 1);   /* a block's bytes a column */
    double all = mf_cost_act_copy(&m, 0, tok * (double)n_rows), lat = mf_cost_act_copy(&m, 0, 0);
    for (int k = 0; k < parts && k < MF_SG_MAX_CARDS; k++) {
        mf_sg_dense_rows(parts, k, n_rows, &r0, &r1);
        int copies = (r0 > 0) + (r1 < n_rows);
        if (r1 <= r0 || copies < 1) continue;
        double others = mf_cost_act_copy(&m, 0, tok * (double)(n_rows - (r1 - r0))) + (copies - 1) * lat;
        sg->oa_kept[k] = others < all;
    }
}

int mf_sg_ob_in_cols(const mf_stepgraph *sg, int k, int64_t n_oa_rows, int64_t c[2][2])
{
    int64_t r0, r1;
    int m = 0;
    if (!sg->oa_x || k < 0 || k >= MF_SG_MAX_CARDS || !sg->oa_kept[k]) {
        c[0][0] = 0;
        c[0][1] = n_oa_rows;
        return n_oa_rows > 0;
    }
    mf_sg_dense_rows(sg->n_dense_cards, k, n_oa_rows, &r0, &r1);
    if (r0 > 0) c[m][0] = 0, c[m++][1] = r0;
    if (r1 < n_oa_rows) c[m][0] = r1, c[m++][1] = n_oa_rows;
    return m;
}

/* The share of n_rows rows that part k of `parts` owns (mf_sg_dense_rows). */
static double sg_dense_share(int parts, int k, double n_rows)
{
    int64_t r0, r1;
    mf_sg_dense_rows(parts, parts > 1 ? k : -1, (int64_t)n_rows, &r0, &r1);
    return n_rows > 0 ? (double)(r1 - r0) / n_rows : 0;
}

double mf_sg_dense_card_bytes(const mf_config *c, const mf_sg_sizes *sz, int n_cards, int split, int in_whole,
                              int card)
{
    return mf_sg_dense_card_bytes_in(c, sz, n_cards, split, in_whole, card, 0, c->n_layers);
}

double mf_sg_dense_card_bytes_in(const mf_config *c, const mf_sg_sizes *sz, int n_cards, int split, int in_whole,
                                 int card, int l0, int l1)
{
    double b = 0;
    for (int L = -1; L < l1 && n_cards > 0; L++) {
        if (L < 0 ? l1 < c->n_layers : L < l0) continue;   /* a pipeline stage's layers, its head if the last */
        int dense[MF_SG_N_DENSE], nd = 0;
        if (L < 0) dense[nd++] = MF_SG_D_HEAD;
        else
            for (int d = MF_SG_D_ATTN_IN; d <= MF_SG_D_SHARED; d++) dense[nd++] = d;
        if (L >= 0 && mf_config_engram_slot(c, L) >= 0) dense[nd++] = MF_SG_D_ENGRAM;
        for (int i = 0; i < nd; i++) {
            int d = dense[i], parts = mf_sg_dense_parts(n_cards, split, d);
            if (parts == 1 && mf_sg_dense_card_in(c, n_cards, l0, l1, L) != card) continue;
            double w, rows;
            if (L < 0) {
                w = sz->head_bytes, rows = (double)c->vocab_size;
            } else if (d == MF_SG_D_GATE) {
                w = sz->layer[L].gate_bytes, rows = (double)c->n_routed_experts;
            } else if (d == MF_SG_D_SHARED) {
                w = sz->sh_up_bytes + sz->sh_down_bytes, rows = 1;
            } else if (d == MF_SG_D_ENGRAM) {
                w = sz->layer[L].eng_fp8_bytes, rows = (double)(c->hc_mult + 1) * c->hidden_size;
            } else {
                static const int st_of[4] = {MF_SG_ST_IN, MF_SG_ST_QB, MF_SG_ST_OA, MF_SG_ST_OB};
                const mf_sg_layer_sizes *y = &sz->layer[L];
                int st = st_of[d];
                w = st == MF_SG_ST_OA ? y->oa_fp8_bytes : y->st_fp8_bytes[st] + y->st_bf16_bytes[st];
                rows = y->st_out_rows[st];
            }
            b += w * (mf_sg_dense_whole(c, n_cards, split, in_whole, d, L) ? 1 : sg_dense_share(parts, card, rows));
        }
    }
    return b;
}

/* ---- the card buffers ------------------------------------------------------------------------ */

static size_t sg_al256(size_t b) { return (b + 255) / 256 * 256; }

/* The most items a dense task of sg copies as bf16 at once: its block's (the attention stages', the
 * heads', the shared expert's chains). */
static size_t sg_stage_rows(const mf_stepgraph *sg)
{
    size_t r = 0;
    for (int t = 0; t < sg->n_tasks; t++) {
        const mf_sg_task *k = &sg->task[t];
        int d = k->dense;
        if (k->card < 0 || !((d >= MF_SG_D_ATTN_IN && d <= MF_SG_D_ATTN_OB) || d == MF_SG_D_SHARED || d == MF_SG_D_HEADS))
            continue;
        if (k->i1 - k->i0 > 0 && (size_t)(k->i1 - k->i0) > r) r = (size_t)(k->i1 - k->i0);
    }
    return r;
}

void mf_sg_card_bufs_of(const mf_sg_card_in *in, mf_sg_card_bufs *b)
{
    const mf_config *c = in->c;
    const mf_stepgraph *sg = in->sg;
    memset(b, 0, sizeof *b);
    size_t n_ = (size_t)sg->n, ln = (size_t)(in->ln > sg->n ? in->ln : sg->n), f = sizeof(float);
    size_t H = (size_t)c->hidden_size, I = (size_t)c->moe_intermediate_size, V = (size_t)c->vocab_size;
    size_t E = (size_t)c->n_routed_experts, Ish = c->n_shared_experts > 0 ? (size_t)in->sh_rows : 0;
    int ex = in->exact;
    /* routed: n x top-k rows; the FFN's h and int8 scratch one slot's rows (a card's slots' FFNs run
     * one after another on its compute stream; a slot has at most one row an item), but per row
     * for the slot-table FFN (one launch over every slot); the bf16 rows out in the rows in (a
     * slot's out rows start where its in rows do: its FFN has read them) */
    size_t nk = n_ * (size_t)c->n_experts_per_tok;
    b->q8_row = mf_dev_ffn_q8_bytes(1, (int)H, (int)I);
    b->ffn_slot = !in->dev_graphs;
    b->ffn_rows = b->ffn_slot ? n_ : nk;
    b->x = 0;
    b->w = b->x + sg_al256(nk * H * f);
    b->h = b->w + sg_al256(nk * f);
    b->q = b->h + sg_al256(b->ffn_rows * I * f);
    b->y = b->q + sg_al256(b->ffn_rows * b->q8_row);
    b->x16 = b->y + sg_al256(nk * H * f);
    b->y16 = b->x;
    b->ri = b->x16 + sg_al256(sg->slot_gather ? 0 : nk * H * 2);
    b->tab = mf_sg_lt_routed_bufs(in, b, b->ri + sg_al256(sg->slot_gather ? nk * 4 : 0));   /* the cuBLASLt path's, if any */
    b->routed_bytes = b->tab + (in->dev_graphs ? sizeof(mf_dev_ffn_slot) * (size_t)sg->n_slots * (size_t)c->n_layers : 0);
    /* dense: the host's layouts' row lengths, then each copy {bytes, &offset} */
    for (int k = 0; k < MF_LY_A_N; k++) b->ab_ld[k] = (mf_ly_attn_buf_len(c, k) + 15) / 16 * 16;
    if (c->n_engram > 0) {
        b->eg_per = (c->engram_max_ngram_size - 1) * c->engram_n_heads;
        b->eg_emb_ld = ((int64_t)b->eg_per * c->engram_head_dim + 15) / 16 * 16;
        b->eg_kv_ld = ((int64_t)(c->hc_mult + 1) * c->hidden_size + 15) / 16 * 16;
    }
    int64_t ecap = (int64_t)ln * c->index_topk;
    b->hk_ecap = (int)(ecap < MF_SG_HEADS_ENTRIES ? ecap : MF_SG_HEADS_ENTRIES);
    for (int L = 0; L < c->n_layers; L++)   /* a card's items of the index scores at most (both blocks) */
        for (int p = 0; p < sg->scores_cards[L]; p++) {
            int a0, e0, a1, e1;
            mf_sg_scores_range(sg->n, sg->scores_cards[L], p, 0, &a0, &e0);
            mf_sg_scores_range(sg->n, sg->scores_cards[L], p, 1, &a1, &e1);
            if (e0 - a0 + e1 - a1 > b->sk_rows) b->sk_rows = e0 - a0 + e1 - a1;
        }
    b->head_rows = in->head_rows > 0 ? in->head_rows : MF_SG_HEAD_ROWS;
    if ((size_t)b->head_rows > n_) b->head_rows = (int)n_;
    struct { size_t bytes, *off; } dt[MF_LY_A_N + 26];
    int m = 0;
    for (int k = 0; k < MF_LY_A_N; k++) dt[m++] = (typeof(dt[0])){ln * (size_t)b->ab_ld[k] * f, &b->ab[k]};
    /* the bf16 copies' staging, one for the copy-in stream and one for the copy-out stream (each
     * copy packs or unpacks there in turn): the widest bf16 row by the most items a chain's block
     * copies; the MoE input's copy stays whole (the slots' gathers read it) */
    size_t w16 = Ish && mf_sg_dense_bf16(MF_SG_D_SHARED, 1) ? H : 0;
    for (int k = 0; k < MF_LY_A_N; k++)
        if (mf_sg_attn_buf_bf16(k) && (size_t)b->ab_ld[k] > w16) w16 = (size_t)b->ab_ld[k];
    b->stg_rows = sg_stage_rows(sg);
    b->stg_bytes = b->stg_rows * w16 * 2;
    dt[m++] = (typeof(dt[0])){b->stg_bytes, &b->stg_in};
    dt[m++] = (typeof(dt[0])){b->stg_bytes, &b->stg_out};
    dt[m++] = (typeof(dt[0])){mf_sg_dense_bf16(MF_SG_D_GATE, 0) ? n_ * H * 2 : 0, &b->xin16};
    dt[m++] = (typeof(dt[0])){n_ * H * f, &b->xin};
    dt[m++] = (typeof(dt[0])){n_ * E * f, &b->logits};
    dt[m++] = (typeof(dt[0])){n_ * Ish * f, &b->hs};
    dt[m++] = (typeof(dt[0])){ex ? n_ * Ish * f : 0, &b->gs};
    dt[m++] = (typeof(dt[0])){ex ? n_ * Ish * f : 0, &b->us};
    dt[m++] = (typeof(dt[0])){n_ * H * f, &b->ys};
    dt[m++] = (typeof(dt[0])){n_ * H * f, &b->hn};
    dt[m++] = (typeof(dt[0])){(size_t)b->head_rows * V * f, &b->lbuf};
    size_t eg = c->n_engram > 0 ? ln : 0;   /* one Engram layer's rows: its chains run in turn */
    dt[m++] = (typeof(dt[0])){eg * (size_t)b->eg_emb_ld * f, &b->eg_emb};
    dt[m++] = (typeof(dt[0])){eg * (size_t)b->eg_kv_ld * f, &b->eg_kv};
    int hk = sg->heads_any;   /* the heads' key table, lists, counts, sinks */
    size_t D = (size_t)c->head_dim;
    dt[m++] = (typeof(dt[0])){hk ? ((size_t)c->sliding_window + n_ + (size_t)b->hk_ecap) * D * f : 0, &b->hk_tab};
    dt[m++] = (typeof(dt[0])){hk ? n_ * (size_t)sg->heads_keys * 4 : 0, &b->hk_keys};
    dt[m++] = (typeof(dt[0])){hk ? n_ * 4 : 0, &b->hk_nk};
    dt[m++] = (typeof(dt[0])){hk ? (size_t)c->n_heads * f : 0, &b->hk_sink};
    dt[m++] = (typeof(dt[0])){sg->heads_local_any || sg->heads_qlocal_any ? n_ * (size_t)c->qk_rope_head_dim * f : 0,
                              &b->hk_rope};
    int sk = sg->scores_any;   /* the index scores' keys, counts, scores */
    dt[m++] = (typeof(dt[0])){sk ? (size_t)MF_SG_SCORE_ENTRIES * (size_t)c->index_head_dim * f : 0, &b->sk_tab};
    dt[m++] = (typeof(dt[0])){sk ? n_ * 4 : 0, &b->sk_nvis};
    dt[m++] = (typeof(dt[0])){sk ? (size_t)b->sk_rows * MF_SG_SCORE_ENTRIES * sizeof(double) : 0, &b->sk_score};
    size_t du = sg->draft ? (size_t)sg->n_units : 0;   /* a draft round's Markov rows, a unit each */
    dt[m++] = (typeof(dt[0])){du * (size_t)c->dspark_markov_rank * f, &b->mk_in};
    dt[m++] = (typeof(dt[0])){du * V * f, &b->mk_out};
    size_t lt[3];   /* the cuBLASLt path's: 16-bit weights of two layers, the cast, the workspace */
    mf_sg_lt_dense_bufs(in, b, lt);
    dt[m++] = (typeof(dt[0])){lt[0], &b->lt_w16};
    dt[m++] = (typeof(dt[0])){lt[1], &b->lt_x16};
    dt[m++] = (typeof(dt[0])){lt[2], &b->lt_ws};
    for (int i = 0; i < m; i++) {
        *dt[i].off = b->dense_bytes;
        b->dense_bytes += sg_al256(dt[i].bytes);
    }
}

int mf_sg_card_reserve(const mf_sg_opts *base, const mf_sg_card_in *in, int chunk, int max_items, double *routed,
                       double *dense)
{
    *routed = *dense = 0;
    const int ns[2] = {chunk, max_items > 0 ? mf_sg_bucket(max_items) : 0};   /* the graph a batch runs in */
    for (int k = 0; k < 2; k++) {
        if (ns[k] < 1) continue;
        mf_sg_opts o = *base;
        o.n = ns[k];
        o.par = k == 1 && ns[k] > 1;
        mf_stepgraph *g = NULL;
        int rc = mf_stepgraph_new(&o, &g);
        if (rc) return mf_error_wrap(rc, "the card buffers of a %s of %d", k ? "decode batch" : "prefill chunk", ns[k]);
        mf_sg_card_in ci = *in;
        ci.sg = g;
        ci.ln = ns[k];
        mf_sg_card_bufs b;
        mf_sg_card_bufs_of(&ci, &b);
        if (base->n_cards) *routed += (double)b.routed_bytes;
        if (base->n_dense_cards) *dense += (double)b.dense_bytes;
        mf_stepgraph_free(g);
    }
    return 0;
}

/* ---- the bf16 copies ------------------------------------------------------------------------- */

int mf_sg_attn_buf_bf16(int buf)
{
    return buf == MF_LY_A_IN || buf == MF_LY_A_QR || buf == MF_LY_A_Q || buf == MF_LY_A_QI || buf == MF_LY_A_O ||
           buf == MF_LY_A_Z || buf == MF_LY_A_OUT;
}

int mf_sg_dense_bf16(int dense, int out)
{
    return (dense == MF_SG_D_GATE && !out) || (dense == MF_SG_D_SHARED && out);
}

/* Bytes a value of attention buffer buf travels in (mf_sg_attn_buf_bf16). */
double mf_sg_attn_val_bytes(int buf) { return mf_sg_attn_buf_bf16(buf) ? 2.0 : 4.0; }

/* ---- the dense chain ------------------------------------------------------------------------- */

/* The share of the heads' output that part k of `parts` of the grouped wo_a's n_rows rows reads:
 * the groups its rows touch (each group's rows read their own slice of the input). */
static double sg_dense_oa_in_share(const mf_config *c, int parts, int k, double n_rows)
{
    int64_t r0, r1, G = c->o_groups > 0 ? c->o_groups : 1, R = (int64_t)n_rows / G;
    if (parts <= 1 || R < 1) return 1;
    mf_sg_dense_rows(parts, k, (int64_t)n_rows, &r0, &r1);
    return r1 > r0 ? (double)((r1 + R - 1) / R - r0 / R) / (double)G : 0;
}

/* Card part k's wo_b copy-in of layer L (record t; in_tok: all of wo_a's output, per item): the
 * columns mf_sg_ob_in_cols gives, one act copy each. */
static void sg_dense_ob_in(const mf_sg_builder *b, int L, int k, double in_tok, mf_sg_task *t)
{
    int64_t n_rows = (int64_t)b->o->sz->layer[L].st_out_rows[MF_SG_ST_OA], cols[2][2], w = 0;
    int m = mf_sg_ob_in_cols(b->sg, k, n_rows, cols);
    for (int r = 0; r < m; r++) w += cols[r][1] - cols[r][0];
    t->w.copy_bytes_tok = n_rows > 0 ? in_tok * (double)w / (double)n_rows : 0;
    t->w.copies = m;
}

/* Each member of group g on card cd (a dense chain's first task or card work: its chains, one per
 * card and item block) before `after`. */
static void sg_dense_member_dep(mf_sg_builder *b, mf_task_id g, int cd, mf_task_id after)
{
    for (mf_task_id x = g; x >= 0 && after >= 0 && !b->rc; x = b->next_of[x])
        if (b->sg->task[x].card == cd) b->rc = mf_graph_add_dep(b->sg->g, x, after);
}

/* Each card work of group `after` waits for the members of group `before` on its card. */
void mf_sg_dense_after(mf_sg_builder *b, mf_task_id before, mf_task_id after)
{
    for (mf_task_id y = after; y >= 0 && before >= 0 && !b->rc; y = b->next_of[y])
        sg_dense_member_dep(b, before, b->sg->task[y].card, y);
}

int mf_sg_dense_blocks(int n, int block_min)
{
    int m = block_min > 0 ? block_min : MF_SG_DENSE_BLOCK, k = n / m;
    return k < 1 ? 1 : k > MF_SG_DENSE_MAX_BLOCKS ? MF_SG_DENSE_MAX_BLOCKS : k;
}

/* Dense sublayer d of layer L (-1: the head) on its card, or with --dense-split rows on every
 * card (mf_sg_dense_parts), each card a chain over its rows (mf_sg_dense_rows of the
 * sublayer's out_tok / 4 output rows; its record's part the card, its work and copy-out that
 * share) per item block of the micro-batch's items (mf_sg_dense_blocks; a block's copy in after
 * the block before's): copy in of in_tok bytes per item (0: none; the card work then waits for
 * after_in's members on its card, the copy-ins of an earlier chain) -> the card's work (record t)
 * -> copy out of the card's rows per item (out_tok 0: none, the output stays on the card), the
 * first out_bf_rows of all the rows as bf16 (2 bytes: mf_sg_attn_buf_bf16), the others fp32;
 * in_tok counts the bytes as they travel. The in stage split by items (mf_stepgraph.in_items[L]):
 * card k's chain over the blocks j with j mod parts == k only, all the rows (part -1: its work and
 * copy-out all of them, its records the whole weights'). Returns the first chain's first task;
 * the chains' first tasks are a group (a dependency on it is one on each chain's last task,
 * mf_sg_dep), their card works another (b->chain_run its first: mf_sg_dense_after). */
mf_task_id mf_sg_dense_chain(mf_sg_builder *b, int L, int d, mf_sg_task t, int phase, double in_tok, double out_tok,
                             mf_task_id after_in, double out_bf_rows)
{
    mf_stepgraph *sg = b->sg;
    int parts = d == MF_SG_D_MARKOV ? sg->mk_parts : mf_sg_dense_parts(sg->n_dense_cards, sg->dense_split, d);
    int n = b->h1 - b->h0, nb = d == MF_SG_D_HEAD || d == MF_SG_D_MARKOV ? 1 : mf_sg_dense_blocks(n, sg->dense_block);
    /* split by items (mf_sg_in_items): card k all rows of blocks j mod parts == k; whole: the card
     * holds every row (its scratch of the cuBLASLt path too: mf_sg_dense_whole) */
    int items = d == MF_SG_D_ATTN_IN && L >= 0 && L < b->o->c->n_layers && sg->in_items[L] && parts > 1;
    int whole = mf_sg_dense_whole(b->o->c, sg->n_dense_cards, sg->dense_split, sg->in_whole, d, L);
    if (items) nb = sg_in_blocks(n, sg->dense_block, parts);
    mf_task_id head = -1, prev_first = -1, prev_run = -1;
    for (int k = 0; k < parts && !b->rc; k++) {
        int cd = parts > 1 ? k : mf_sg_dense_card_of(b->o, sg->n_dense_cards, L), lane = b->o->lane_dev0 + 3 * cd;
        double share = parts > 1 && !items ? sg_dense_share(parts, k, out_tok / 4) : 1;
        mf_sg_task ts = t;   /* the card's share, whose price picks its FP8 linears' path */
        for (int f = 0; f < MF_KF_N; f++) ts.w.w_bytes[f] *= share, ts.w.macs[f] *= share;
        int path = mf_sg_lt_path(b, L, d, whole ? 1 : parts, k, &ts, n, (n + nb - 1) / nb);
        mf_task_id prev_in = -1;
        for (int j = 0; j < nb && !b->rc; j++) {
            if (items && j % parts != k) continue;
            mf_sg_task r = mf_sg_rec(L);
            r.card = (int8_t)cd;
            r.dense = (int8_t)d;
            r.part = parts > 1 && !items ? k : -1;
            r.cand = t.cand;
            mf_sg_span(b, &r);
            if (nb > 1) {   /* block j's items: n / nb or one more */
                r.i0 = b->h0 + (int)((int64_t)n * j / nb);
                r.i1 = b->h0 + (int)((int64_t)n * (j + 1) / nb);
                r.n_tok = r.i1 - r.i0;
                r.block = (int8_t)j;
            }
            char pre[24], blk[16] = "";
            if (L < 0) snprintf(pre, sizeof pre, "dev%d", cd);
            else snprintf(pre, sizeof pre, "dev%d L%d", cd, L);
            if (nb > 1) snprintf(blk, sizeof blk, " b%d", j);
            mf_task_id in = -1;
            if (in_tok > 0) {
                SG_NAME(b, "%s %s in%s", pre, sg_dense_name[d], blk);
                mf_sg_task ti = r;
                ti.w.copy_bytes_tok =
                    in_tok * (d == MF_SG_D_ATTN_OA ? sg_dense_oa_in_share(b->o->c, parts, k, out_tok / 4) : 1);
                if (d == MF_SG_D_ATTN_OB && parts > 1) sg_dense_ob_in(b, L, k, in_tok, &ti);
                in = mf_sg_add(b, lane, MF_SG_DENSE_IN, phase, MF_SG_K_COPY, ti);
                if (!b->rc && prev_in >= 0) b->rc = mf_graph_add_dep(sg->g, prev_in, in);
                prev_in = in;
            }
            mf_sg_task tk = t;
            tk.card = r.card;
            tk.dense = r.dense;
            tk.part = r.part;
            tk.block = r.block;
            tk.i0 = r.i0;
            tk.i1 = r.i1;
            tk.n_tok = r.n_tok;
            tk.lin_path = (int8_t)path;
            for (int f = 0; f < MF_KF_N; f++) {   /* the card's share of the rows (calls: each card's) */
                tk.w.w_bytes[f] *= share;
                tk.w.macs[f] *= share;
            }
            tk.w.ref_flops *= share * (n > 0 ? (double)r.n_tok / n : 1);   /* over the span: the block's share */
            SG_NAME(b, "%s %s%s", pre, sg_dense_name[d], blk);
            mf_task_id run = mf_sg_add(b, lane + 1, MF_SG_DENSE, phase, MF_SG_K_OTHER, tk), last = run;
            if (path == MF_DEV_LIN_CUBLASLT) {   /* whole: the dequantization of all the card's rows */
                mf_sg_task tq = tk;
                if (whole) tq.w.w_bytes[MF_KF_FP8] = t.w.w_bytes[MF_KF_FP8], tq.w.macs[MF_KF_FP8] = t.w.macs[MF_KF_FP8];
                mf_sg_lt_deq(b, &tq, phase, run);
            }
            if (in >= 0) {
                if (!b->rc) b->rc = mf_graph_add_dep(sg->g, in, run);
            } else if (after_in >= 0) {
                sg_dense_member_dep(b, after_in, cd, run);
            }
            if (out_tok > 0 && share > 0) {
                SG_NAME(b, "%s %s out%s", pre, sg_dense_name[d], blk);
                mf_sg_task to = r;
                int64_t r0, r1, bf = (int64_t)out_bf_rows;   /* the card's rows, those of them bf16 */
                mf_sg_dense_rows(parts, r.part, (int64_t)(out_tok / 4), &r0, &r1);
                double n_bf = (double)((r1 < bf ? r1 : bf) - (r0 < bf ? r0 : bf));
                to.w.copy_bytes_tok = out_tok * share - 2.0 * n_bf;
                last = mf_sg_add(b, lane + 2, MF_SG_DENSE_OUT, phase, MF_SG_K_COPY_OUT, to);
                if (!b->rc) b->rc = mf_graph_add_dep(sg->g, run, last);
            }
            if (b->rc) break;
            mf_task_id first = in_tok > 0 ? in : run;
            b->exit_of[first] = last;
            if (prev_first >= 0) b->next_of[prev_first] = first;
            if (prev_run >= 0 && prev_run != prev_first) b->next_of[prev_run] = run;
            if (head < 0) head = first, b->chain_run = run;
            prev_first = first;
            prev_run = run;
        }
    }
    return b->rc ? -1 : head;
}

int mf_sg_dense_card_of(const mf_sg_opts *o, int n_cards, int L)
{
    int l1 = o->layer_begin || o->layer_end ? o->layer_end : o->c->n_layers;
    return mf_sg_dense_card_in(o->c, n_cards, o->layer_begin, l1, L);
}
