/* The attention heads' scores and values on (emulated) cards (graphs/step/stepgraph.h
 * MF_SG_ATTN_GATHER, MF_SG_ATTN_QPREP, MF_SG_D_HEADS, MF_SG_ATTN_OPOST; mf_step_opts.heads): the
 * cost model's choice on the seed host's profile (flash41: a 512- and an 8,192-token chunk's heads on the
 * cards, batch-1 and batch-64 decode's on the host), the graph's card chains (tiny, forced on 2
 * cards: 3 tasks per card and layer, no host heads task), and the engine's logits of a 40-token
 * prompt in chunks of 16 then 3 decode steps with the heads on emu:1 and emu:2 (split by heads),
 * bit for bit (memcmp) the host placement's, and different with the card op perturbed
 * (mf_step_opts.heads_fault). With the heads, the scored layers' index scores (MF_SG_ATTN_KEYS,
 * MF_SG_D_SCORES): the choice (flash41's 8 scored layers at chunks 512 and 8,192 on the 4 cards,
 * none at batch 1), the graph (tiny: per scored layer a keys task and per card an in, a scores
 * and an out task over each of its two blocks, a quarter of the items each, no host score task;
 * test_scores_range: each card's share of the work the same), the logits (tiny; demo, whose top-k
 * of 128 a 200-token prompt in chunks of 96 exceeds) bit for bit and different with the card's
 * scores perturbed (mf_step_opts.scores_fault); with the cards taking fewer entries
 * (mf_step_opts.scores_entries 12, then 1) the host's fallback scores, bit for bit, and with 1 the
 * card's perturbation unseen (no chunk scored there); with the dense chains and heads in item blocks
 * (mf_step_opts.dense_block 3) bit for bit, and the heads' perturbation still caught. Split by rows
 * on emu:2, wo_a's outputs exchanged between the cards for wo_b (test_graph_exchange: each card
 * keeps its own rows), bit for bit; each q prep after qb's blocks over its items, the core of a layer
 * not scored after no qb task (test_graph_qprep); the host's steps after only the card blocks of
 * their items, each collapse after its own item's combine parts (test_graph_blocks). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/dev.h"
#include "graphs/model/config.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/step/step.h"
#include "graphs/step/stepgraph.h"
#include "sched/error.h"
#include "sched/profile.h"
#include "tests/check.h"
#include "tests/step_run.h"
#include "tests/tiny_ckpt.h"

#define N_PROMPT 40
#define N_DEC 3

static int64_t g_V;

static int32_t prompt_tok(int s, int i) { return (int32_t)((i * 37 + s * 101 + (i * i) % 13) % g_V); }

/* flash41 on the seed host (4 dense cards, 44 workers): by cost, the heads of every layer of an
 * 8,192-token prefill chunk go to the cards, batch-1 decode's (one item: the copies cost more than
 * they save) and a 64-sequence batch's (several units) stay on the host; --heads host keeps all. */
static void test_choice(void)
{
    mf_config c;
    mf_profile f;
    CHECK(mf_config_preset("flash41", &c) == 0, "preset flash41");
    CHECK(mf_profile_load(MF_SOURCE_DIR "/tools/profiles/seed-host.prof", &f) == 0, "profile: %s", mf_last_error());
    mf_sg_opts o = {.c = &c, .n_threads = 44, .n_dense_cards = 4, .profile = &f};
    static const int chunks[2] = {512, 8192};
    for (int ci = 0; ci < 2; ci++) {
        o.n = chunks[ci];
        int on = 0, split = 0, scored = 0, sc = 0;
        for (int L = 0; L < c.n_layers; L++) {
            int k = mf_sg_heads_choice(&o, L), s = mf_sg_scores_choice(&o, L, k);
            on += k > 0;
            split += k == 4;
            scored += mf_sg_layer_scored(&c, L);
            sc += s == 4;
            CHECK(s == (mf_sg_layer_scored(&c, L) ? 4 : 0), "chunk %d: layer %d's index scores on %d cards", o.n, L, s);
        }
        CHECK(on == c.n_layers, "chunk %d: heads of %d of %d layers on cards", o.n, on, c.n_layers);
        CHECK(scored == 8 && sc == scored, "chunk %d: %d scored layers, %d with their scores on 4 cards", o.n, scored, sc);
        printf("chunk %d: %d layers' heads on cards, %d of them split over 4; the %d scored layers' index scores on 4\n",
               o.n, on, split, sc);
    }
    o.n = 1;
    for (int L = 0; L < c.n_layers; L++) {
        CHECK(mf_sg_heads_choice(&o, L) == 0, "batch 1: layer %d's heads on cards", L);
        CHECK(mf_sg_scores_choice(&o, L, 0) == 0, "batch 1: layer %d's index scores on cards", L);
    }
    o.n = 64;
    o.par = 1;
    for (int L = 0; L < c.n_layers; L++) CHECK(mf_sg_heads_choice(&o, L) == 0, "batch 64: layer %d's heads on cards", L);
    o.n = 8192;
    o.par = 0;
    o.heads = MF_SG_HEADS_HOST;
    for (int L = 0; L < c.n_layers; L++) CHECK(mf_sg_heads_choice(&o, L) == 0, "--heads host: layer %d on cards", L);
    o.heads = MF_SG_HEADS_COST;
    o.exact = 1;
    CHECK(mf_sg_heads_choice(&o, 0) == 0, "exact: heads on cards");
}

/* The graph of 16 items of one sequence of c with the heads forced on 2 dense cards (dense_split and
 * dense_block as given, 0: the defaults) on 2 workers; *sz and *lt its sizes and lanes. NULL on
 * error (checked). */
static mf_stepgraph *heads_graph(const mf_config *c, mf_sg_sizes **sz, mf_sg_lanes *lt, int split, int block)
{
    CHECK(mf_sg_sizes_new(c, sz) == 0, "sizes: %s", mf_last_error());
    mf_lane_model m[4] = {{.bytes_per_s = 1e9}, {.bytes_per_s = 1e9}, {.bytes_per_s = 1e9}, {.bytes_per_s = 1e9}};
    mf_sg_lanes_init(lt, m, 2, 0, 2);
    mf_stepgraph *sg = NULL;
    CHECK(mf_stepgraph_new(&(mf_sg_opts){.c = c, .sz = *sz, .n = 16, .n_threads = 2, .n_dense_cards = 2,
                                         .dense_split = split, .dense_block = block, .heads = MF_SG_HEADS_CARDS,
                                         .lanes = lt->lane, .n_lanes = lt->n_lanes, .lane_io = lt->lane_io,
                                         .lane_dev0 = lt->lane_dev0},
                           &sg) == 0,
          "graph: %s", mf_last_error());
    return sg;
}

/* The index scores' split (mf_sg_scores_range): 8,192, 1,000 and 7 items (blocks of 0 or 1) on 4
 * cards, every item once, and at 8,192 and 1,000 each card's share of a causal triangle (item i
 * sees i + 1 entries) within one item's of the others'. */
static void test_scores_range(void)
{
    static const int ns[3] = {8192, 1000, 7};
    for (int x = 0; x < 3; x++) {
        int n = ns[x], seen = 0;
        double w[4] = {0}, lo = 1e300, hi = 0;
        for (int p = 0; p < 4; p++)
            for (int q = 0; q < 2; q++) {
                int a, e;
                mf_sg_scores_range(n, 4, p, q, &a, &e);
                seen += e - a;
                for (int i = a; i < e; i++) w[p] += i + 1;
            }
        for (int p = 0; p < 4; p++) lo = w[p] < lo ? w[p] : lo, hi = w[p] > hi ? w[p] : hi;
        CHECK(seen == n && (n < 8 || hi - lo <= n), "%d items: %d scored, the cards' work %.0f..%.0f", n, seen, lo, hi);
    }
}

/* tiny, 16 items of one sequence, heads forced on 2 dense cards: per layer and card an in, a
 * compute and an out task of MF_SG_D_HEADS on that card's lanes with the card's half of the heads,
 * a gather, q preps and o posts on the CPU lane, no MF_SG_ATTN_HEADS. */
static void test_graph(void)
{
    mf_config c;
    CHECK(mf_config_preset("tiny", &c) == 0, "preset tiny");
    mf_sg_sizes *sz = NULL;
    mf_sg_lanes lt;
    mf_stepgraph *sg = heads_graph(&c, &sz, &lt, 0, 0);
    int cnt[3] = {0}, host_heads = 0, gathers = 0, heads_rows[2] = {0}, n_scored = 0, keys = 0, host_scores = 0;
    int sc_cnt[3] = {0}, sc_items[2] = {0};
    for (int L = 0; L < c.n_layers; L++) n_scored += mf_sg_layer_scored(&c, L);
    for (int t = 0; sg && t < sg->n_tasks; t++) {
        const mf_sg_task *r = &sg->task[t];
        host_heads += r->op == MF_SG_ATTN_HEADS;
        gathers += r->op == MF_SG_ATTN_GATHER;
        keys += r->op == MF_SG_ATTN_KEYS;
        host_scores += r->op == MF_SG_ATTN_SCORE;
        if (r->dense == MF_SG_D_SCORES) {   /* the index scores: per scored layer and card in, run, out */
            int k = r->op - MF_SG_DENSE_IN, lane = mf_graph_task(sg->g, t)->lane;
            CHECK(k >= 0 && k < 3 && r->card >= 0 && r->card < 2 && lane == lt.lane_dev0 + 3 * r->card + k,
                  "scores task %d: op %d card %d lane %d", t, r->op, r->card, lane);
            if (k < 0 || k >= 3 || r->card < 0 || r->card >= 2) continue;
            sc_cnt[k]++;
            if (k == 1) sc_items[r->card] += r->i1 - r->i0;
            /* 4 blocks of 4: card 0 blocks 3 then 0, card 1 blocks 2 then 1 (mf_sg_scores_range) */
            int blk = r->block ? r->card : 3 - r->card;
            CHECK(r->i0 == 4 * blk && r->i1 == 4 * blk + 4, "scores task %d (card %d, block %d): items %d..%d",
                  t, r->card, r->block, r->i0, r->i1);
            continue;
        }
        if (r->dense != MF_SG_D_HEADS) continue;
        int k = r->op - MF_SG_DENSE_IN;
        CHECK(k >= 0 && k < 3 && r->card >= 0 && r->card < 2, "heads task %d: op %d card %d", t, r->op, r->card);
        if (k < 0 || k >= 3 || r->card < 0 || r->card >= 2) continue;
        cnt[k]++;
        int lane = mf_graph_task(sg->g, t)->lane;
        CHECK(lane == lt.lane_dev0 + 3 * r->card + k, "heads task %d of card %d on lane %d", t, r->card, lane);
        if (k == 1) heads_rows[r->card] += (int)((r->r1 - r->r0) / c.head_dim);
        /* the queries in and the outputs out as bf16 (mf_sg_attn_buf_bf16): 2 bytes a value */
        if (k == 2)
            CHECK(r->w.copy_bytes_tok == 2.0 * (double)(r->r1 - r->r0), "heads out: %.0f bytes an item for %lld values",
                  r->w.copy_bytes_tok, (long long)(r->r1 - r->r0));
        double keys = (r->w.copy_bytes_tok - 2.0 * (double)(r->r1 - r->r0)) / 4 - 1;   /* the key list's entries */
        if (k == 0) CHECK(keys == floor(keys) && keys >= 1 && keys <= sg->heads_keys,
                          "heads in: %.0f bytes an item for %lld query values and a list of at most %d keys",
                          r->w.copy_bytes_tok, (long long)(r->r1 - r->r0), sg->heads_keys);
    }
    CHECK(host_heads == 0, "%d host heads tasks", host_heads);
    CHECK(host_scores == 0 && keys == n_scored, "%d host score tasks, %d key tasks (expected 0, %d)", host_scores, keys,
          n_scored);
    for (int k = 0; k < 3; k++)   /* 2 cards x 2 blocks (mf_sg_scores_range) */
        CHECK(sc_cnt[k] == 4 * n_scored, "%d scores tasks of kind %d (expected %d)", sc_cnt[k], k, 4 * n_scored);
    for (int cd = 0; cd < 2; cd++)
        CHECK(sc_items[cd] == n_scored * 8, "card %d scores %d items over the layers (expected %d)", cd, sc_items[cd],
              n_scored * 8);
    CHECK(gathers == c.n_layers, "%d gathers (expected %d)", gathers, c.n_layers);
    for (int k = 0; k < 3; k++) CHECK(cnt[k] == 2 * c.n_layers, "%d heads tasks of kind %d (expected %d)", cnt[k], k, 2 * c.n_layers);
    for (int cd = 0; cd < 2; cd++)
        CHECK(heads_rows[cd] == c.n_layers * c.n_heads / 2, "card %d computes %d heads over the layers", cd, heads_rows[cd]);
    mf_stepgraph_free(sg);
    mf_sg_sizes_free(sz);
}

/* The heads' outputs left on the cards for wo_a (mf_sg_heads_local): the rule (tiny and flash41 split
 * by rows on 2 and 4 cards: each card's wo_a rows are its heads' groups; by layers on 2 cards, or
 * tiny's 4 heads on 3, not), and tiny's graph split by rows on 2 cards: no heads copy out, no o
 * post, no oa copy in, each heads copy-in carrying the items' inverse RoPE tables, and every oa
 * work on a card after the heads of its items on that card. */
static void test_graph_local(void)
{
    mf_config c, f;
    CHECK(mf_config_preset("tiny", &c) == 0 && mf_config_preset("flash41", &f) == 0, "presets");
    CHECK(mf_sg_heads_local(&c, 2, MF_SG_SPLIT_ROWS, 2) == 1, "tiny, 2 cards by rows: not local");
    CHECK(mf_sg_heads_local(&f, 4, MF_SG_SPLIT_ROWS, 4) == 1, "flash41, 4 cards by rows: not local");
    CHECK(mf_sg_heads_local(&c, 2, MF_SG_SPLIT_LAYERS, 2) == 0, "tiny, heads on 2 cards, wo_a on one: local");
    CHECK(mf_sg_heads_local(&c, 2, MF_SG_SPLIT_LAYERS, 1) == 1, "tiny, heads and wo_a on one card: not local");
    CHECK(mf_sg_heads_local(&c, 3, MF_SG_SPLIT_ROWS, 3) == 0, "tiny, 4 heads on 3 cards: local");
    mf_sg_sizes *sz = NULL;
    mf_sg_lanes lt;
    mf_stepgraph *sg = heads_graph(&c, &sz, &lt, MF_SG_SPLIT_ROWS, 4);
    int opost = 0, hout = 0, oa_in = 0, oa_runs = 0, oa_after = 0, h_in = 0, local = 0;
    for (int L = 0; sg && L < c.n_layers; L++) local += sg->heads_local[L];
    CHECK(local == c.n_layers, "%d of %d layers' heads local", local, c.n_layers);
    for (int t = 0; sg && t < sg->n_tasks; t++) {
        const mf_sg_task *r = &sg->task[t];
        opost += r->op == MF_SG_ATTN_OPOST;
        hout += r->op == MF_SG_DENSE_OUT && r->dense == MF_SG_D_HEADS;
        oa_in += r->op == MF_SG_DENSE_IN && r->dense == MF_SG_D_ATTN_OA;
        if (r->op == MF_SG_DENSE_IN && r->dense == MF_SG_D_HEADS) {
            double qb = sg->heads_qlocal[r->layer] ? 0 : 2.0 * (double)(r->r1 - r->r0);   /* mf_sg_heads_qlocal: none */
            double keys = (r->w.copy_bytes_tok - qb - 4.0 * c.qk_rope_head_dim) / 4 - 1;
            h_in++;
            CHECK(keys == floor(keys) && keys >= 1 && keys <= sg->heads_keys,
                  "heads in: %.0f bytes an item, not its queries, key list and inverse RoPE table", r->w.copy_bytes_tok);
        }
        if (r->op != MF_SG_DENSE || r->dense != MF_SG_D_HEADS) continue;
        const mf_task_id *succ = mf_graph_succ(sg->g, t);
        for (int k = 0; k < mf_graph_n_succ(sg->g, t); k++) {   /* the oa work of its card and items */
            const mf_sg_task *o = &sg->task[succ[k]];
            if (o->op != MF_SG_DENSE || o->dense != MF_SG_D_ATTN_OA) continue;
            CHECK(o->card == r->card && o->i0 < r->i1 && o->i1 > r->i0, "heads (card %d, items %d..%d) before oa "
                  "(card %d, items %d..%d)", r->card, r->i0, r->i1, o->card, o->i0, o->i1);
            oa_after++;
        }
    }
    for (int t = 0; sg && t < sg->n_tasks; t++)
        oa_runs += sg->task[t].op == MF_SG_DENSE && sg->task[t].dense == MF_SG_D_ATTN_OA;
    CHECK(opost == 0 && hout == 0 && oa_in == 0, "%d o posts, %d heads copies out, %d oa copies in (expected none)",
          opost, hout, oa_in);
    CHECK(h_in == 2 * 4 * c.n_layers, "%d heads copies in (expected 2 cards x 4 blocks x %d layers)", h_in, c.n_layers);
    CHECK(oa_runs == 2 * 4 * c.n_layers && oa_after >= oa_runs, "%d oa works, %d after the heads of their card",
          oa_runs, oa_after);
    mf_stepgraph_free(sg);
    mf_sg_sizes_free(sz);
}

/* qb's queries left on the cards for the heads (mf_sg_heads_qlocal): the rule (tiny and flash41 split
 * by rows on 2 and 4 cards: each card's qb rows are its heads' queries on the layers not scored, not
 * on the scored ones, whose qb rows hold the indexer's queries too; tiny by layers, heads on 2
 * cards and qb on one: not; both on one card: yes; tiny's 4 heads on 3 cards: not), and tiny's
 * graph split by rows on 2 cards: on those layers each qb copy-out carries nothing and runs after
 * the gather (for the host's fallback heads), the q preps round nothing; on the scored layers qb's
 * copy-outs carry its rows. */
static void test_graph_qlocal(void)
{
    mf_config c, f;
    CHECK(mf_config_preset("tiny", &c) == 0 && mf_config_preset("flash41", &f) == 0, "presets");
    int nq = 0;
    for (int L = 0; L < f.n_layers; L++) {
        int q = mf_sg_heads_qlocal(&f, L, 4, MF_SG_SPLIT_ROWS, 4);
        CHECK(q == !mf_sg_layer_scored(&f, L), "flash41 layer %d, 4 cards by rows: queries local %d", L, q);
        nq += q;
    }
    CHECK(nq == 32, "flash41: %d layers' queries local (expected the 32 not scored)", nq);
    CHECK(mf_sg_heads_qlocal(&c, 3, 2, MF_SG_SPLIT_ROWS, 2) == 1 && mf_sg_heads_qlocal(&c, 2, 2, MF_SG_SPLIT_ROWS, 2) == 0,
          "tiny, 2 cards by rows: layer 3 (not scored) local, layer 2 (scored) not");
    CHECK(mf_sg_heads_qlocal(&c, 3, 2, MF_SG_SPLIT_LAYERS, 2) == 0, "tiny, heads on 2 cards, qb on one: local");
    CHECK(mf_sg_heads_qlocal(&c, 3, 2, MF_SG_SPLIT_LAYERS, 1) == 1, "tiny, heads and qb on one card: not local");
    CHECK(mf_sg_heads_qlocal(&c, 3, 3, MF_SG_SPLIT_ROWS, 3) == 0, "tiny, 4 heads on 3 cards: local");
    mf_sg_sizes *sz = NULL;
    mf_sg_lanes lt;
    mf_stepgraph *sg = heads_graph(&c, &sz, &lt, MF_SG_SPLIT_ROWS, 4);
    int qb_out = 0, qb_kept = 0, qb_after = 0, qp = 0;
    for (int L = 0; sg && L < c.n_layers; L++)
        CHECK(sg->heads_qlocal[L] == !mf_sg_layer_scored(&c, L), "tiny layer %d: queries local %d", L, sg->heads_qlocal[L]);
    for (int t = 0; sg && t < sg->n_tasks; t++) {
        const mf_sg_task *r = &sg->task[t];
        int q = r->layer >= 0 && r->layer < c.n_layers && sg->heads_qlocal[r->layer];
        if (r->op == MF_SG_ATTN_QPREP && q) {
            qp++;
            CHECK(r->w.vec_flops == 0, "q prep of layer %d: %.0f vector flops (the queries' roundings)", r->layer,
                  r->w.vec_flops);
        }
        if (r->op == MF_SG_DENSE_OUT && r->dense == MF_SG_D_ATTN_QB) {
            qb_out++;
            qb_kept += q;
            CHECK(q ? r->w.copy_bytes_tok == 0 : r->w.copy_bytes_tok > 0, "qb out of layer %d: %.0f bytes an item",
                  r->layer, r->w.copy_bytes_tok);
        }
        if (r->op != MF_SG_ATTN_GATHER || !q) continue;
        const mf_task_id *succ = mf_graph_succ(sg->g, t);
        for (int k = 0; k < mf_graph_n_succ(sg->g, t); k++) {
            const mf_sg_task *o = &sg->task[succ[k]];
            qb_after += o->op == MF_SG_DENSE_OUT && o->dense == MF_SG_D_ATTN_QB && o->layer == r->layer;
        }
    }
    CHECK(qb_out == 2 * 4 * c.n_layers && qb_kept == 2 * 4 * 5 && qb_after == qb_kept && qp > 0,
          "%d qb copies out, %d of them kept, %d after their gather, %d q preps", qb_out, qb_kept, qb_after, qp);
    mf_stepgraph_free(sg);
    mf_sg_sizes_free(sz);
}

/* wo_a's outputs exchanged between the cards for wo_b (mf_sg_oa_exchange, issue 37 phase 6): on the
 * seed host (flash41, 4 cards by rows) every card keeps its own wo_a rows at chunks 8,192 and 512
 * and batch 64 (1 or 2 copies of the others' rows), at batch 1 the two middle cards copy all of
 * them in (a second copy's latency costs more than their rows); by layers no exchange. Tiny's graph
 * by rows on 2 cards: each wo_b copy-in carries the other card's rows (half of wo_a's output), after
 * the other card's oa copy out and its own card's oa work over items meeting its own, not after
 * the oa join. */
static void test_graph_exchange(void)
{
    mf_config f, c;
    mf_profile p;
    CHECK(mf_config_preset("flash41", &f) == 0 && mf_config_preset("tiny", &c) == 0, "presets");
    CHECK(mf_profile_load(MF_SOURCE_DIR "/tools/profiles/seed-host.prof", &p) == 0, "profile: %s", mf_last_error());
    mf_stepgraph *g = calloc(1, sizeof *g);
    static const int ns[4] = {8192, 512, 64, 1}, kept[4] = {4, 4, 4, 2};
    for (int i = 0; g && i < 4; i++) {
        mf_sg_opts o = {.c = &f, .n = ns[i], .n_threads = 44, .n_dense_cards = 4, .dense_split = MF_SG_SPLIT_ROWS,
                        .profile = &p};
        *g = (mf_stepgraph){.n = ns[i], .n_halves = 1, .dense_block = MF_SG_DENSE_BLOCK, .n_dense_cards = 4};
        mf_sg_oa_exchange(&o, g);
        int k = 0;
        for (int q = 0; q < 4; q++) k += g->oa_kept[q];
        CHECK(g->oa_x == 1 && k == kept[i] && g->oa_kept[0] && g->oa_kept[3], "%d items: exchange %d, %d cards keep "
              "their rows (expected %d, the first and last among them)", ns[i], g->oa_x, k, kept[i]);
        int64_t cols[2][2];
        CHECK(mf_sg_ob_in_cols(g, 1, 8192, cols) == (g->oa_kept[1] ? 2 : 1), "%d items: card 1's copies", ns[i]);
        o.dense_split = MF_SG_SPLIT_LAYERS;
        mf_sg_oa_exchange(&o, g);
        CHECK(g->oa_x == 0 && g->oa_kept[0] == 0, "%d items by layers: an exchange", ns[i]);
    }
    free(g);
    mf_sg_sizes *sz = NULL;
    mf_sg_lanes lt;
    mf_stepgraph *sg = heads_graph(&c, &sz, &lt, MF_SG_SPLIT_ROWS, 4);
    int ob_in = 0, deps = 0, half = c.o_groups * c.o_lora_rank / 2;
    CHECK(sg && sg->oa_x && sg->oa_kept[0] && sg->oa_kept[1], "tiny by rows on 2 cards: no exchange");
    for (int t = 0; sg && t < sg->n_tasks; t++) {
        const mf_sg_task *r = &sg->task[t];
        if (r->op != MF_SG_DENSE_IN || r->dense != MF_SG_D_ATTN_OB) continue;
        ob_in++;
        CHECK(r->w.copy_bytes_tok == 2.0 * half && r->w.copies == 1, "wo_b in: %.0f bytes an item in %d copies "
              "(expected the other card's %d bf16 values in one)", r->w.copy_bytes_tok, r->w.copies, half);
        int other = 0, own = 0;
        for (mf_task_id u = 0; u < sg->n_tasks; u++) {   /* its predecessors */
            const mf_task_id *succ = mf_graph_succ(sg->g, u);
            for (int k = 0; k < mf_graph_n_succ(sg->g, u); k++) {
                if (succ[k] != t) continue;
                const mf_sg_task *o = &sg->task[u];
                CHECK(o->op != MF_SG_JOIN, "wo_b in (card %d, items %d..%d) after a join", r->card, r->i0, r->i1);
                if (o->dense != MF_SG_D_ATTN_OA || o->i0 >= r->i1 || o->i1 <= r->i0) continue;
                other += o->op == MF_SG_DENSE_OUT && o->card != r->card;
                own += o->op == MF_SG_DENSE && o->card == r->card;
            }
        }
        CHECK(other >= 1 && own >= 1, "wo_b in (card %d, items %d..%d) after %d oa copies out of the other card and "
              "%d oa works of its own", r->card, r->i0, r->i1, other, own);
        deps += other > 0 && own > 0;
    }
    CHECK(ob_in == 2 * 4 * c.n_layers && deps == ob_in, "%d wo_b copies in, %d after their items' wo_a (expected 2 "
          "cards x 4 blocks x %d layers)", ob_in, deps, c.n_layers);
    mf_stepgraph_free(sg);
    mf_sg_sizes_free(sz);
}

/* The item blocks of 4 of heads_graph's 16 items that record r's items meet. */
static int blocks_of4(const mf_sg_task *r)
{
    int n = 0;
    for (int j = 0; j < 4; j++) n += 4 * j < r->i1 && 4 * j + 4 > r->i0;
    return n;
}

/* Each q prep after qb's blocks over its items (issue 37 phase 8): tiny's graph by rows on 2 cards
 * in item blocks of 4; on a layer not scored every q prep waits for the qb copy out of each card's
 * block meeting its items and for no other, and the core for no qb task (it reads nothing of qb's
 * there), so the heads' copy-ins start with qb's first blocks out; on a scored layer the core
 * waits for qb (the index queries). */
static void test_graph_qprep(void)
{
    mf_config c;
    CHECK(mf_config_preset("tiny", &c) == 0, "preset tiny");
    mf_sg_sizes *sz = NULL;
    mf_sg_lanes lt;
    mf_stepgraph *sg = heads_graph(&c, &sz, &lt, MF_SG_SPLIT_ROWS, 4);
    int n = sg ? sg->n_tasks : 0, qpreps = 0, scored_cores = 0, unscored = 0;
    int *n_qb = calloc((size_t)n + 1, sizeof *n_qb), *n_far = calloc((size_t)n + 1, sizeof *n_far);
    CHECK(n_qb && n_far, "memory");
    for (int u = 0; sg && n_qb && n_far && u < n; u++) {   /* each task's qb predecessors, meeting its items or not */
        const mf_sg_task *q = &sg->task[u];
        if (q->dense != MF_SG_D_ATTN_QB || q->op < MF_SG_DENSE_IN || q->op > MF_SG_DENSE_OUT) continue;
        const mf_task_id *succ = mf_graph_succ(sg->g, u);
        for (int k = 0; k < mf_graph_n_succ(sg->g, u); k++) {
            const mf_sg_task *r = &sg->task[succ[k]];
            if (r->op == MF_SG_ATTN_QPREP && q->op != MF_SG_DENSE_OUT) n_far[succ[k]]++;
            else if (r->op == MF_SG_ATTN_QPREP) (q->i0 < r->i1 && q->i1 > r->i0 ? n_qb : n_far)[succ[k]]++;
            else if (r->op == MF_SG_ATTN_CORE) (mf_sg_layer_scored(&c, r->layer) ? n_qb : n_far)[succ[k]]++;
        }
    }
    for (int t = 0; sg && n_qb && n_far && t < n; t++) {
        const mf_sg_task *r = &sg->task[t];
        if (r->op == MF_SG_ATTN_CORE) {
            int scored = mf_sg_layer_scored(&c, r->layer);
            unscored += !scored;
            scored_cores += scored && n_qb[t] > 0;
            CHECK(n_far[t] == 0, "layer %d's core (items %d..%d) after %d qb tasks", r->layer, r->i0, r->i1, n_far[t]);
        }
        if (r->op != MF_SG_ATTN_QPREP || mf_sg_layer_scored(&c, r->layer)) continue;
        qpreps++;
        int want = 2 * blocks_of4(r);   /* a copy out of each such block on each card */
        CHECK(n_qb[t] == want && n_far[t] == 0, "layer %d's q prep (items %d..%d) after %d qb copies out over its "
              "items (expected %d) and %d other qb tasks", r->layer, r->i0, r->i1, n_qb[t], want, n_far[t]);
    }
    CHECK(unscored > 0 && qpreps > 0 && scored_cores > 0, "%d cores of layers not scored, %d of their q preps, %d "
          "cores of scored layers after qb", unscored, qpreps, scored_cores);
    free(n_qb);
    free(n_far);
    mf_stepgraph_free(sg);
    mf_sg_sizes_free(sz);
}

/* Whether records a and b share an item (a record without items spans them all). */
static int meets(const mf_sg_task *a, const mf_sg_task *b)
{
    return a->i1 <= a->i0 || b->i1 <= b->i0 || (a->i0 < b->i1 && a->i1 > b->i0);
}

/* The host's steps pipelined with the cards' item blocks (tiny by rows on 2 cards, blocks of 4
 * items, one item a group): each q scale after exactly the in stage's copies out meeting its items
 * (a block's on each card), each post after exactly the ob copies out meeting its items, each
 * gate block's copy in after exactly the ffn norms of its items, and each collapse after its own
 * item's combine parts or one join (the layer before's combine join where its streams' last writer
 * was not the combine), never another item's combine. */
static void test_graph_blocks(void)
{
    mf_config c;
    CHECK(mf_config_preset("tiny", &c) == 0, "preset tiny");
    mf_sg_sizes *sz = NULL;
    mf_sg_lanes lt;
    mf_stepgraph *sg = heads_graph(&c, &sz, &lt, MF_SG_SPLIT_ROWS, 4);
    int n = sg ? sg->n_tasks : 0, seen[4] = {0}, by_comb = 0;
    int *near = calloc((size_t)n + 1, sizeof *near), *far = calloc((size_t)n + 1, sizeof *far);
    CHECK(near && far && (!sg || sg->n_groups == 16), "memory; %d item groups", sg ? sg->n_groups : 0);
    for (int u = 0; sg && near && far && u < n; u++) {   /* each task's predecessors of the kind it is checked on */
        const mf_sg_task *q = &sg->task[u];
        const mf_task_id *succ = mf_graph_succ(sg->g, u);
        for (int k = 0; k < mf_graph_n_succ(sg->g, u); k++) {
            const mf_sg_task *r = &sg->task[succ[k]];
            int want = r->op == MF_SG_ATTN_QSCALE ? q->dense == MF_SG_D_ATTN_IN
                       : r->op == MF_SG_ATTN_POST ? q->dense == MF_SG_D_ATTN_OB
                       : r->dense == MF_SG_D_GATE && r->op == MF_SG_DENSE_IN ? q->op == MF_SG_FFN_NORM
                       : r->op == MF_SG_ATTN_PRE && r->layer >= 0 ? q->op == MF_SG_COMBINE || q->op == MF_SG_JOIN
                                                                  : 0;
            if (!want) continue;
            int ok = meets(q, r) && (q->op != MF_SG_DENSE && q->op != MF_SG_DENSE_IN);
            (ok ? near : far)[succ[k]]++;
            by_comb += r->op == MF_SG_ATTN_PRE && q->op == MF_SG_COMBINE;
        }
    }
    for (int t = 0; sg && near && far && t < n; t++) {
        const mf_sg_task *r = &sg->task[t];
        int blocks = blocks_of4(r);
        if (r->op == MF_SG_ATTN_QSCALE || r->op == MF_SG_ATTN_POST) {
            seen[r->op == MF_SG_ATTN_POST]++;
            CHECK(near[t] == 2 * blocks && far[t] == 0, "layer %d's %s (items %d..%d) after %d copies out over its "
                  "items (expected %d) and %d others", r->layer, r->op == MF_SG_ATTN_POST ? "post" : "q scale", r->i0,
                  r->i1, near[t], 2 * blocks, far[t]);
        } else if (r->dense == MF_SG_D_GATE && r->op == MF_SG_DENSE_IN) {
            seen[2]++;
            CHECK(near[t] == (r->i1 - r->i0) * sg->p_hc && far[t] == 0, "layer %d's gate block (items %d..%d) after %d "
                  "ffn norms over its items (expected %d) and %d others", r->layer, r->i0, r->i1, near[t],
                  (r->i1 - r->i0) * sg->p_hc, far[t]);
        } else if (r->op == MF_SG_ATTN_PRE && r->layer > 0) {
            seen[3]++;
            CHECK(far[t] == 0 && near[t] >= 1, "layer %d's collapse (items %d..%d) after %d tasks of its items, %d "
                  "of others", r->layer, r->i0, r->i1, near[t], far[t]);
        }
    }
    CHECK(seen[0] > 0 && seen[1] > 0 && seen[2] > 0 && seen[3] > 0 && by_comb > 0,
          "%d q scales, %d posts, %d gate blocks, %d collapses (%d waits on a combine part) checked", seen[0], seen[1],
          seen[2], seen[3], by_comb);
    free(near);
    free(far);
    mf_stepgraph_free(sg);
    mf_sg_sizes_free(sz);
}

/* The logits of the host placement against the heads (and the index scores) on emu:nc (fault 1:
 * the heads perturbed, 2: the index scores), the dense work split by `split`, the heads' table of
 * compressed entries cut to h_entries (0: the card buffer's). */
static int run_cards_split(mf_ref *r, int nc, int fault, int n_prompt, int chunk, float *out, int32_t *toks,
                           int entries, int block, int split, int h_entries)
{
    char spec[64];
    mf_dev *d = NULL;
    int rc = mf_test_emu_open(nc, spec, sizeof spec, &d);
    mf_step *e = NULL;
    if (!rc)
        rc = mf_step_new(r, &(mf_step_opts){.n_threads = 2, .prefill_chunk = chunk, .dev = d, .dense = MF_STEP_DENSE_CARDS,
                                            .heads = MF_SG_HEADS_CARDS, .heads_fault = fault == 1,
                                            .scores_fault = fault == 2, .scores_entries = entries,
                                            .dense_block = block, .dense_split = split,
                                            .heads_entries = h_entries},
                         &e);
    if (!rc) rc = mf_test_run_steps(r, e, g_V, 1, n_prompt, prompt_tok, N_DEC, toks, 0, out);
    mf_step_free(e);
    mf_dev_close(d);
    return rc;
}

static int run_cards(mf_ref *r, int nc, int fault, int n_prompt, int chunk, float *out, int32_t *toks, int entries,
                     int block)
{
    return run_cards_split(r, nc, fault, n_prompt, chunk, out, toks, entries, block, MF_SG_SPLIT_LAYERS, 0);
}

static void test_engine(mf_ref *r, const char *name, int n_prompt, int chunk, int max_cards)
{
    size_t per = (size_t)(1 + N_DEC) * g_V;
    float *host = malloc(sizeof(float) * per), *got = malloc(sizeof(float) * per);
    int32_t toks[N_DEC];
    mf_step *e = NULL;
    CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2, .prefill_chunk = chunk}, &e) == 0, "host: %s", mf_last_error());
    CHECK(e && mf_test_run_steps(r, e, g_V, 1, n_prompt, prompt_tok, N_DEC, toks, 1, host) == 0, "host run: %s",
          mf_last_error());
    mf_step_free(e);
    for (int nc = 1; nc <= max_cards; nc++) {
        memset(got, 0, sizeof(float) * per);
        int rc = run_cards(r, nc, 0, n_prompt, chunk, got, toks, 0, 0);
        CHECK(rc == 0, "%s emu:%d heads on cards: %s", name, nc, mf_last_error());
        CHECK(!rc && !memcmp(host, got, sizeof(float) * per), "%s emu:%d: logits with the heads and index scores on "
              "cards differ from the host placement's", name, nc);
        for (int fault = 1; fault <= 2; fault++) {
            rc = run_cards(r, nc, fault, n_prompt, chunk, got, toks, 0, 0);
            CHECK(rc == 0, "%s emu:%d perturbed: %s", name, nc, mf_last_error());
            CHECK(!rc && memcmp(host, got, sizeof(float) * per), "%s emu:%d: the perturbed card %s went unnoticed", name,
                  nc, fault == 1 ? "heads" : "index scores");
        }
        /* the host's scores where a chunk sees more entries than the cards take (here 12: the
         * ratio-1 layers of every chunk, the ratio-2 one's first chunk on the cards), and the
         * card's perturbation then caught only where the cards still score */
        memset(got, 0, sizeof(float) * per);
        rc = run_cards(r, nc, 0, n_prompt, chunk, got, toks, 12, 0);
        CHECK(rc == 0 && !memcmp(host, got, sizeof(float) * per), "%s emu:%d: the host's fallback scores: %s", name, nc,
              rc ? mf_last_error() : "logits differ from the host placement's");
        /* the dense chains and the heads in item blocks of 3 items or more (mf_sg_dense_blocks:
         * a chunk of 16 in 5, of 96 in 8), block 0's copy of the key table shared by the others */
        memset(got, 0, sizeof(float) * per);
        rc = run_cards(r, nc, 0, n_prompt, chunk, got, toks, 0, 3);
        CHECK(rc == 0 && !memcmp(host, got, sizeof(float) * per), "%s emu:%d: the dense chains in item blocks: %s", name,
              nc, rc ? mf_last_error() : "logits differ from the host placement's");
        rc = run_cards(r, nc, 1, n_prompt, chunk, got, toks, 0, 3);
        CHECK(rc == 0 && memcmp(host, got, sizeof(float) * per), "%s emu:%d: in item blocks the perturbed heads went "
              "unnoticed (%s)", name, nc, rc ? mf_last_error() : "");
        if (nc > 1) {   /* split by rows: each card's heads' outputs stay on it for its own wo_a rows */
            memset(got, 0, sizeof(float) * per);
            rc = run_cards_split(r, nc, 0, n_prompt, chunk, got, toks, 0, 3, MF_SG_SPLIT_ROWS, 0);
            CHECK(rc == 0 && !memcmp(host, got, sizeof(float) * per), "%s emu:%d: the heads' outputs left on the "
                  "cards for wo_a: %s", name, nc, rc ? mf_last_error() : "logits differ from the host placement's");
            rc = run_cards_split(r, nc, 1, n_prompt, chunk, got, toks, 0, 3, MF_SG_SPLIT_ROWS, 0);
            CHECK(rc == 0 && memcmp(host, got, sizeof(float) * per), "%s emu:%d: split by rows the perturbed heads "
                  "went unnoticed (%s)", name, nc, rc ? mf_last_error() : "");
            /* the host's fallback heads (a table of one compressed entry): their outputs copied in */
            memset(got, 0, sizeof(float) * per);
            rc = run_cards_split(r, nc, 0, n_prompt, chunk, got, toks, 0, 3, MF_SG_SPLIT_ROWS, 1);
            CHECK(rc == 0 && !memcmp(host, got, sizeof(float) * per), "%s emu:%d: split by rows, the host's fallback "
                  "heads: %s", name, nc, rc ? mf_last_error() : "logits differ from the host placement's");
        }
        rc = run_cards(r, nc, 2, n_prompt, chunk, got, toks, 1, 0);
        CHECK(rc == 0 && !memcmp(host, got, sizeof(float) * per), "%s emu:%d: every chunk on the host's scores, yet "
              "the card's perturbation changed the logits (%s)", name, nc, rc ? mf_last_error() : "");
        printf("%s: a %d-token prompt in chunks of %d, %d decode steps on emu:%d: the host's logits bit for bit (and "
               "with the host's fallback scores, and in item blocks)\n", name, n_prompt, chunk, N_DEC, nc);
    }
    free(host);
    free(got);
}

int main(void)
{
    test_choice();
    test_scores_range();
    test_graph();
    test_graph_local();
    test_graph_qlocal();
    test_graph_exchange();
    test_graph_qprep();
    test_graph_blocks();
    char dir[1024];
    mf_config c;
    CHECK(mf_config_preset("tiny", &c) == 0, "preset");
    if (mf_test_gen_ckpt(&c, "heads_cards_tiny", dir, sizeof dir)) return 1;
    g_V = c.vocab_size;
    mf_model *m = NULL;
    mf_ref *r = NULL;
    CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1}, &m) == 0, "load: %s", mf_last_error());
    if (!m || mf_ref_new(m, NULL, &r)) return mf_check_exit("test_heads_cards");
    test_engine(r, "tiny", N_PROMPT, 16, 2);
    mf_ref_free(r);
    mf_model_free(m);
    /* demo (index top-k 128): a 200-token prompt, so the scored layers see more entries than they
     * select; not under the sanitizers */
    if (!MF_TEST_SANITIZED) {
        CHECK(mf_config_preset("demo", &c) == 0, "preset demo");
        if (mf_test_gen_ckpt(&c, "heads_cards_demo", dir, sizeof dir)) return 1;
        g_V = c.vocab_size;
        m = NULL;
        r = NULL;
        CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1}, &m) == 0, "load demo: %s", mf_last_error());
        if (m && !mf_ref_new(m, NULL, &r)) test_engine(r, "demo", 200, 96, 2);
        mf_ref_free(r);
        mf_model_free(m);
    }
    return mf_check_exit("test_heads_cards");
}
