/* Dense work on emulated cards (mf_step_opts.dense, graphs/step/stepgraph.h MF_SG_DENSE_*): the
 * layer ranges of mf_sg_dense_card (cut at KV sources, head on the last layer's card), the rows
 * split (--dense-split rows: mf_sg_dense_rows tiling each sublayer, each card's bytes), the step
 * graph's card chains, the simulator's pricing of them, and the engine's logits with the dense work on emu:1..3
 * (split by layers and, on 2..3 cards, by rows; a card skipping a row must be caught) against the host
 * placement of the same engine, bit for bit (memcmp), also with the dense chains in item blocks
 * (mf_step_opts.dense_block) and the head's logits in passes (mf_step_opts.head_rows): tiny at batch 1, 2, 3 and 16, resident and
 * streamed experts, with routed experts on the host and hybrid; demo at batch 1 and 16 on emu:2
 * (not under the sanitizers); CUDA cards (where present) within tolerance; the startup self-check refusing a
 * wrong card and a failing one (device/dev_check.h) while the run continues on the others. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "device/dev.h"
#include "graphs/model/config.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/sim/plan.h"
#include "graphs/step/step.h"
#include "graphs/step/stepgraph.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/step_run.h"
#include "tests/tiny_ckpt.h"

#define N_PROMPT 6
#define MAX_SEQ 16

static int64_t g_V;

/* Layer ranges: contiguous, each starting at layer 0 or a KV source, the head with the last
 * layer; flash41 on 4 cards as the issue names them (sources 2, 8, 14, 20). */
static void test_ranges(void)
{
    mf_config c;
    CHECK(mf_config_preset("flash41", &c) == 0, "preset flash41");
    int want[4] = {0, 8, 14, 20}, start[4] = {-1, -1, -1, -1};
    for (int L = 0; L < c.n_layers; L++) {
        int cd = mf_sg_dense_card(&c, 4, L);
        CHECK(cd >= 0 && cd < 4, "flash41 layer %d on card %d", L, cd);
        if (L > 0) CHECK(cd >= mf_sg_dense_card(&c, 4, L - 1), "flash41: layer %d goes back to card %d", L, cd);
        if (cd >= 0 && cd < 4 && start[cd] < 0) start[cd] = L;
    }
    for (int k = 0; k < 4; k++) CHECK(start[k] == want[k], "flash41 card %d starts at layer %d (expected %d)", k, start[k], want[k]);
    CHECK(mf_sg_dense_card(&c, 4, -1) == mf_sg_dense_card(&c, 4, c.n_layers - 1), "head not on the last layer's card");
    for (int nc = 1; nc <= 6; nc++)
        for (int L = 1; L < c.n_layers; L++) {
            int a = mf_sg_dense_card(&c, nc, L - 1), b = mf_sg_dense_card(&c, nc, L);
            int src = 0;
            for (int i = 0; i < c.n_kv_source; i++) src |= c.kv_source_layer_ids[i] == L;
            CHECK(a == b || (b == a + 1 && src), "flash41 on %d cards: cut before layer %d (cards %d, %d)", nc, L, a, b);
        }
    for (int L = 0; L < c.n_layers; L++) CHECK(mf_sg_dense_card(&c, 1, L) == 0, "one card: layer %d elsewhere", L);
}

/* flash41's config, its sizes (the caller frees them) and the lanes of 8 workers and 4 cards at
 * 1 GB/s: the graph tests' setup. */
static mf_sg_sizes *flash41_graph_setup(mf_config *c, mf_sg_lanes *lt)
{
    CHECK(mf_config_preset("flash41", c) == 0, "preset flash41");
    mf_sg_sizes *sz = NULL;
    CHECK(mf_sg_sizes_new(c, &sz) == 0, "sizes: %s", mf_last_error());
    mf_lane_model m[4] = {{.bytes_per_s = 1e9}, {.bytes_per_s = 1e9}, {.bytes_per_s = 1e9}, {.bytes_per_s = 1e9}};
    mf_sg_lanes_init(lt, m, 8, 0, 4);
    return sz;
}

/* The graph of flash41 at batch 16 with dense work on 4 cards: no host dense tasks, every dense
 * task on its card's lane of its kind, copies with bytes, one head on the last layer's card. */
static void test_graph(void)
{
    mf_config c;
    mf_sg_lanes lt;
    mf_sg_sizes *sz = flash41_graph_setup(&c, &lt);
    mf_stepgraph *sg = NULL;
    CHECK(mf_stepgraph_new(&(mf_sg_opts){.c = &c, .sz = sz, .n = 16, .par = 1, .n_threads = 8, .n_dense_cards = 4,
                                         .lanes = lt.lane, .n_lanes = lt.n_lanes, .lane_io = lt.lane_io,
                                         .lane_dev0 = lt.lane_dev0},
                           &sg) == 0,
          "graph: %s", mf_last_error());
    int heads = 0, n_dense[3] = {0};
    for (int t = 0; sg && t < sg->n_tasks; t++) {
        const mf_sg_task *r = &sg->task[t];
        CHECK(r->op != MF_SG_ATTN_ROWS && r->op != MF_SG_GATE_ROWS && r->op != MF_SG_SHARED_UP &&
                  r->op != MF_SG_SHARED_DOWN && r->op != MF_SG_HEAD && r->op != MF_SG_ENGRAM_ROWS,
              "task %d (op %d) left on the host", t, r->op);
        if (r->op < MF_SG_DENSE_IN || r->op > MF_SG_DENSE_OUT) continue;
        int k = r->op - MF_SG_DENSE_IN, lane = mf_graph_task(sg->g, t)->lane;
        n_dense[k]++;
        CHECK(r->card == mf_sg_dense_card(&c, 4, r->layer) && lane == lt.lane_dev0 + 3 * r->card + k,
              "task %d of layer %d on card %d lane %d", t, r->layer, r->card, lane);
        if (k != 1) CHECK(r->w.copy_bytes_tok > 0 && r->n_tok == 16, "copy task %d without bytes", t);
        heads += r->dense == MF_SG_D_HEAD && k == 1;
    }
    /* per layer 5 card tasks (in, qb, oa, ob, gate + shared = 6), plus the head and the Engram
     * layers' wkv (each a copy in, the kernel, a copy out) */
    int ne = c.n_engram;
    CHECK(ne == 2 && n_dense[1] == 6 * c.n_layers + 1 + ne, "%d dense card tasks (expected %d)", n_dense[1],
          6 * c.n_layers + 1 + ne);
    CHECK(n_dense[0] == 4 * c.n_layers + 1 + ne && n_dense[2] == 5 * c.n_layers + 1 + ne, "%d copies in, %d out",
          n_dense[0], n_dense[2]);
    CHECK(heads == 1, "%d heads", heads);
    mf_stepgraph_free(sg);
    mf_sg_sizes_free(sz);
}

/* --dense-split rows: flash41 at batch 1 and 16 on 4 cards. Every dense sublayer but the shared
 * expert is one chain per card (its record's part the card, on that card's lanes); the parts'
 * rows (mf_sg_dense_rows) tile each sublayer's rows without gaps or overlaps, 32-row aligned; the
 * records' weight bytes per card are mf_sg_dense_card_bytes's (each weight read once, on one
 * card: no mirror), their sum the layer-range split's, and each card's share fits the seed
 * host's cards; the copies move 2 bytes a value where they are bf16 (mf_sg_attn_buf_bf16). */
static void test_graph_rows(void)
{
    mf_config c;
    mf_sg_lanes lt;
    mf_sg_sizes *sz = flash41_graph_setup(&c, &lt);
    for (int64_t n_rows = 1; n_rows < 4000; n_rows = n_rows * 3 + 7)
        for (int parts = 1; parts <= 5; parts++) {
            int64_t next = 0, r0, r1;
            for (int k = 0; k < parts; k++) {
                mf_sg_dense_rows(parts, parts > 1 ? k : -1, n_rows, &r0, &r1);
                CHECK(r0 == next && r1 >= r0 && (r0 % 32 == 0 || r0 == n_rows), "%lld rows, part %d of %d: [%lld, %lld)",
                      (long long)n_rows, k, parts, (long long)r0, (long long)r1);
                next = r1;
            }
            CHECK(next == n_rows, "%lld rows in %d parts end at %lld", (long long)n_rows, parts, (long long)next);
        }
    double total[2] = {0};
    for (int sp = 0; sp < 2; sp++)
        for (int cd = 0; cd < 4; cd++) total[sp] += mf_sg_dense_card_bytes(&c, sz, 4, sp, 0, cd);
    CHECK(total[0] > 7e9 && fabs(total[1] - total[0]) < 1e-6 * total[0], "dense bytes %.0f (layers), %.0f (rows)",
          total[0], total[1]);
    static const int ns[2] = {1, 16};
    for (int ni = 0; ni < 2; ni++) {
        mf_stepgraph *sg = NULL;
        CHECK(mf_stepgraph_new(&(mf_sg_opts){.c = &c, .sz = sz, .n = ns[ni], .par = ns[ni] > 1, .n_threads = 8,
                                             .n_dense_cards = 4, .dense_split = MF_SG_SPLIT_ROWS,
                                             .in_split = MF_SG_IN_ROWS, .lanes = lt.lane, .n_lanes = lt.n_lanes,
                                             .lane_io = lt.lane_io, .lane_dev0 = lt.lane_dev0},
                               &sg) == 0,
              "rows graph: %s", mf_last_error());
        double bytes[4] = {0}, cp_tok[MF_SG_N_DENSE][3] = {{0}};   /* layer 3's copies per item, all cards */
        double qbi_out = 0;   /* qb's copies out of the first layer with an indexer (its queries too) */
        int runs[MF_SG_N_DENSE] = {0}, li = 0;
        while (li < c.n_layers && !mf_sg_layer_scored(&c, li)) li++;
        for (int t = 0; sg && t < sg->n_tasks; t++) {
            const mf_sg_task *r = &sg->task[t];
            if (r->op < MF_SG_DENSE_IN || r->op > MF_SG_DENSE_OUT) continue;
            int k = r->op - MF_SG_DENSE_IN, lane = mf_graph_task(sg->g, t)->lane;
            if (r->layer == 3 && r->dense < MF_SG_N_DENSE) cp_tok[r->dense][k] += r->w.copy_bytes_tok;
            if (r->layer == li && r->dense == MF_SG_D_ATTN_QB && k == 2) qbi_out += r->w.copy_bytes_tok;
            int parts = mf_sg_dense_parts(4, MF_SG_SPLIT_ROWS, r->dense);
            int want = parts > 1 ? r->part : mf_sg_dense_card(&c, 4, r->layer);
            CHECK(r->card == want && lane == lt.lane_dev0 + 3 * r->card + k && (parts > 1) == (r->part >= 0),
                  "rows task %d (layer %d, dense %d, part %d) on card %d lane %d", t, r->layer, r->dense, r->part,
                  r->card, lane);
            if (k != 1) continue;
            runs[r->dense]++;
            for (int f = 0; f < MF_KF_REF; f++) bytes[r->card] += r->w.w_bytes[f];
        }
        /* the bf16 copies (mf_sg_attn_buf_bf16, mf_sg_dense_bf16) at 2 bytes a value, the others at 4:
         * every card copies in all of in's input and the MoE input, and out its rows; of wo_a's output
         * the columns mf_sg_ob_in_cols gives (the first and last card leave their own rows out: one
         * copy either way) */
        const mf_sg_layer_sizes *y3 = &sz->layer[3];
        double H = (double)c.hidden_size, nz = y3->st_out_rows[MF_SG_ST_OA], ob_in = 0;
        double qr = (double)c.q_lora_rank;
        for (int k = 0; sg && k < 4; k++) {
            int64_t cols[2][2];
            int m = mf_sg_ob_in_cols(sg, k, (int64_t)nz, cols);
            for (int q = 0; q < m; q++) ob_in += 2.0 * (double)(cols[q][1] - cols[q][0]);
        }
        CHECK(sg && sg->oa_x && sg->oa_kept[0] && sg->oa_kept[3] && ob_in < 4 * 2 * nz, "batch %d: wo_a's outputs "
              "not exchanged (the edge cards keep their rows)", ns[ni]);
        static const char *const cp_name[8] = {"in's in", "in's out", "qb's in", "qb's out", "oa's out", "ob's in",
                                               "ob's out", "the gate's in"};
        double cp_got[8] = {cp_tok[MF_SG_D_ATTN_IN][0], cp_tok[MF_SG_D_ATTN_IN][2], cp_tok[MF_SG_D_ATTN_QB][0],
                            cp_tok[MF_SG_D_ATTN_QB][2], cp_tok[MF_SG_D_ATTN_OA][2], cp_tok[MF_SG_D_ATTN_OB][0],
                            cp_tok[MF_SG_D_ATTN_OB][2], cp_tok[MF_SG_D_GATE][0]};
        double cp_want[8] = {4 * 2 * H, 2 * qr + 4 * (y3->st_out_rows[MF_SG_ST_IN] - qr), 4 * 2 * qr,
                             2 * y3->st_out_rows[MF_SG_ST_QB], 2 * nz, ob_in, 2 * H, 4 * 2 * H};
        for (int q = 0; q < 8; q++)
            CHECK(fabs(cp_got[q] - cp_want[q]) < 1e-9 * cp_want[q], "batch %d layer 3: %s copies %.0f bytes an item "
                  "(expected %.0f: bf16 where mf_sg_attn_buf_bf16 says)", ns[ni], cp_name[q], cp_got[q], cp_want[q]);
        double qbi_want = 2 * sz->layer[li].st_out_rows[MF_SG_ST_QB];
        CHECK(li < c.n_layers && sz->layer[li].st_out_rows[MF_SG_ST_QB] > (double)c.n_heads * c.head_dim &&
                  qbi_out == qbi_want,
              "batch %d layer %d (an indexer's): qb copies out %.0f bytes an item (expected %.0f)", ns[ni], li, qbi_out,
              qbi_want);
        CHECK(cp_tok[MF_SG_D_SHARED][2] == 2 * H, "batch %d: the shared expert copies out %.0f bytes an item",
              ns[ni], cp_tok[MF_SG_D_SHARED][2]);
        for (int d = 0; d < MF_SG_N_DENSE; d++) {
            int per = d == MF_SG_D_HEAD ? 1 : d == MF_SG_D_ENGRAM ? c.n_engram : c.n_layers;
            int want = d == MF_SG_D_MARKOV ? 0 : per * mf_sg_dense_parts(4, MF_SG_SPLIT_ROWS, d);   /* a draft round's */
            CHECK(runs[d] == want, "batch %d: sublayer %d: %d card tasks (expected %d)", ns[ni], d, runs[d], want);
        }
        for (int cd = 0; cd < 4; cd++) {
            double want = mf_sg_dense_card_bytes(&c, sz, 4, MF_SG_SPLIT_ROWS, 0, cd);
            CHECK(fabs(bytes[cd] - want) < 1e-6 * want, "batch %d card %d: records read %.0f bytes, the card holds %.0f",
                  ns[ni], cd, bytes[cd], want);
            CHECK(want < 11e9 && want > total[1] / 8, "card %d holds %.0f of %.0f dense bytes", cd, want, total[1]);
        }
        mf_stepgraph_free(sg);
    }
    mf_sg_sizes_free(sz);
}

/* The in stage split by items (mf_sg_in_mode): flash41 on 4 cards, a chunk of 2,048 items in 8
 * blocks of the in stage, block j on card j mod 4 with all the stage's rows (part -1), its input
 * copied in once over all the cards (a quarter a card, not all of it on every card), its whole
 * weights read by each block's work, its outputs' all rows copied out once; the cards then hold
 * all the stage's rows (mf_sg_dense_card_bytes: every card's rows-only bytes plus the other cards'
 * shares of the stage). Where the weights stay split (in_whole 0: by rows, the layer split, a
 * decode engine's short chunks by cost) no layer splits by items, nor a decode batch by cost. */
static void test_graph_in_items(void)
{
    mf_config c;
    mf_sg_lanes lt;
    mf_sg_sizes *sz = flash41_graph_setup(&c, &lt);
    mf_sg_opts o = {.c = &c, .sz = sz, .n = 2048, .n_threads = 8, .n_dense_cards = 4, .dense_split = MF_SG_SPLIT_ROWS,
                    .in_split = MF_SG_IN_ITEMS, .lanes = lt.lane, .n_lanes = lt.n_lanes, .lane_io = lt.lane_io,
                    .lane_dev0 = lt.lane_dev0};
    o.in_whole = mf_sg_in_whole(&o, o.n);
    mf_sg_opts no = o;
    no.in_split = MF_SG_IN_ROWS;
    CHECK(o.in_whole && !mf_sg_in_whole(&no, 8192), "in_whole: items %d, rows %d", o.in_whole, mf_sg_in_whole(&no, 8192));
    no.in_split = MF_SG_IN_COST;
    CHECK(!mf_sg_in_whole(&no, MF_STEP_PREFILL_CHUNK), "the default chunk holds all the in stage's rows");
    no.in_whole = 1;
    for (int L = 0; L < c.n_layers; L++)
        CHECK(!mf_sg_in_items(&no, 1, L) && !mf_sg_in_items(&no, 64, L), "layer %d: a decode batch splits by items", L);
    no.dense_split = MF_SG_SPLIT_LAYERS;
    no.in_split = MF_SG_IN_ITEMS;
    CHECK(!mf_sg_in_whole(&no, 8192), "the layer split holds all the in stage's rows");
    mf_stepgraph *sg = NULL;
    CHECK(mf_stepgraph_new(&o, &sg) == 0, "items graph: %s", mf_last_error());
    const mf_sg_layer_sizes *y3 = &sz->layer[3];
    double H = (double)c.hidden_size, qr = (double)c.q_lora_rank, rows = y3->st_out_rows[MF_SG_ST_IN];
    double in_b[4] = {0}, out_b = 0, w_in = y3->st_fp8_bytes[MF_SG_ST_IN] + y3->st_bf16_bytes[MF_SG_ST_IN];
    int works = 0, items[4] = {0};
    for (int t = 0; sg && t < sg->n_tasks; t++) {
        const mf_sg_task *r = &sg->task[t];
        if (r->op < MF_SG_DENSE_IN || r->op > MF_SG_DENSE_OUT || r->dense != MF_SG_D_ATTN_IN || r->layer != 3) continue;
        CHECK(r->part == -1 && r->block >= 0 && r->card == r->block % 4, "in task %d: part %d, block %d on card %d", t,
              r->part, r->block, r->card);
        if (r->card < 0 || r->card > 3) continue;
        if (r->op == MF_SG_DENSE_IN) in_b[r->card] += r->w.copy_bytes_tok * r->n_tok;
        if (r->op == MF_SG_DENSE_OUT) out_b += r->w.copy_bytes_tok * r->n_tok;
        if (r->op != MF_SG_DENSE) continue;
        works++;
        items[r->card] += r->n_tok;
        double w = 0;
        for (int f = 0; f < MF_KF_REF; f++) w += r->w.w_bytes[f];
        CHECK(fabs(w - w_in) < 1e-9 * w_in, "in work %d reads %.0f weight bytes (all the stage's %.0f)", t, w, w_in);
    }
    double out_want = 2048 * (2 * qr + 4 * (rows - qr));
    CHECK(sg && sg->in_items[3] && works == 8 && fabs(out_b - out_want) < 1e-9 * out_want, "layer 3: %d in works, "
          "%.0f bytes out (expected 8, %.0f)", works, out_b, out_want);
    for (int k = 0; k < 4; k++)
        CHECK(items[k] == 512 && in_b[k] == 2 * H * 512, "card %d: %d items, %.0f bytes in (expected 512, %.0f)", k,
              items[k], in_b[k], 2 * H * 512);
    mf_stepgraph_free(sg);
    for (int cd = 0; cd < 4; cd++) {
        double more = 0;
        for (int L = 0; L < c.n_layers; L++) {
            const mf_sg_layer_sizes *y = &sz->layer[L];
            int64_t r0, r1, n_rows = (int64_t)y->st_out_rows[MF_SG_ST_IN];
            mf_sg_dense_rows(4, cd, n_rows, &r0, &r1);
            more += (y->st_fp8_bytes[MF_SG_ST_IN] + y->st_bf16_bytes[MF_SG_ST_IN]) * (1 - (double)(r1 - r0) / n_rows);
        }
        double got = mf_sg_dense_card_bytes(&c, sz, 4, MF_SG_SPLIT_ROWS, 1, cd) -
                     mf_sg_dense_card_bytes(&c, sz, 4, MF_SG_SPLIT_ROWS, 0, cd);
        CHECK(more > 0 && fabs(got - more) < 1e-6 * more, "card %d holds %.0f more bytes with all the in stage's rows "
              "(expected %.0f)", cd, got, more);
    }
    mf_sg_sizes_free(sz);
}

/* The simulator prices the chains: on a profile whose cards read weights 30x faster than a host
 * thread, demo at batch 16 with the dense work on 2 cards keeps their compute lanes busy, takes
 * work off the CPU lane and predicts a shorter step than with the dense work on the host; with
 * --dense host no card lane has work. A profile without card rates is refused. */
static void test_sim(void)
{
    mf_config c;
    CHECK(mf_config_preset("demo", &c) == 0, "preset demo");
    mf_profile f;
    memset(&f, 0, sizeof f);
    snprintf(f.name, sizeof f.name, "test");
    f.n_sockets = 1;
    f.threads_per_socket = 4;
    f.mem_bytes_per_s = 40e9;
    f.cross_socket_factor = 1;
    f.task_overhead_ns = 2000;
    for (int k = 0; k < MF_KF_N; k++) {
        f.host[k] = (mf_profile_kern){.bytes_per_s = k == MF_KF_REF ? 0 : 10e9, .macs_per_s = 2e9, .latency_ns = 1000};
        f.card[k] = (mf_profile_kern){.bytes_per_s = k == MF_KF_REF ? 0 : 300e9, .macs_per_s = 10e12, .latency_ns = 5000};
    }
    f.host_vec = (mf_profile_kern){.macs_per_s = 2e9};
    f.disk_bytes_per_s = 1e9;
    f.disk_queue_depth = 1;
    f.n_cards = 2;
    f.card_mem_bytes = UINT64_C(8) << 30;
    f.h2d_bytes_per_s = f.d2h_bytes_per_s = f.h2d_total_bytes_per_s = 8e9;
    f.h2d_latency_ns = f.d2h_latency_ns = 10000;
    mf_plan_report rep[2];
    for (int d = 0; d < 2; d++) {
        mf_plan_opts po = {.config = &c, .profile = &f, .batch = 16, .seed = 3,
                           .dense = d ? MF_PLAN_DENSE_CARDS : MF_PLAN_DENSE_HOST};
        CHECK(mf_plan_run(&po, 1, 2, &rep[d]) == 0, "plan dense %d: %s", d, mf_last_error());
    }
    double card_work[2] = {0}, cpu_work[2] = {0};
    for (int d = 0; d < 2; d++)
        for (int l = 0; l < rep[d].n_lanes; l++) {
            if (strstr(rep[d].lanes[l].name, ".compute")) card_work[d] += rep[d].lanes[l].busy_ns;
            if (!strcmp(rep[d].lanes[l].name, "cpu")) cpu_work[d] = rep[d].lanes[l].busy_ns;
        }
    CHECK(card_work[0] == 0 && card_work[1] > 0, "card compute work %.0f (dense host), %.0f ns (cards)", card_work[0],
          card_work[1]);
    CHECK(cpu_work[1] < cpu_work[0], "cpu work %.0f ns with dense on cards, %.0f on the host", cpu_work[1], cpu_work[0]);
    CHECK(rep[1].step_ns < rep[0].step_ns, "dense on cards predicted %lld ns, on the host %lld", (long long)rep[1].step_ns,
          (long long)rep[0].step_ns);
    for (int k = 0; k < MF_KF_N; k++) f.card[k].bytes_per_s = 0;
    mf_plan_opts po = {.config = &c, .profile = &f, .batch = 1, .dense = MF_PLAN_DENSE_CARDS};
    mf_plan_report r;
    CHECK(mf_plan_run(&po, 0, 1, &r) == -EINVAL && strstr(mf_last_error(), "card fp8 and bf16"),
          "no card rates: %s", mf_last_error());
}

/* Token i of sequence s's prompt (distinct prompts). */
static int32_t prompt_tok(int s, int i) { return (int32_t)((i * 37 + s * 101 + (i * i) % 13) % g_V); }

/* The engine's logits of every call (tests/step_run.h). */
static int run(mf_ref *r, mf_step *e, int n_seq, int n_dec, int32_t *toks, int fill, float *out)
{
    return mf_test_run_steps(r, e, g_V, n_seq, N_PROMPT, prompt_tok, n_dec, toks, fill, out);
}

/* The model r's host run against dense on emu:nc for each batch in batches[], placements host
 * and hybrid (routed experts), n_dec decode steps. */
static void test_engine(mf_ref *r, const char *what, const int *batches, int n_b, int min_cards, int max_cards,
                        int hybrid, int n_dec)
{
    static const char *const split_name[2] = {"layers", "rows"};
    for (int bi = 0; bi < n_b; bi++) {
        int b = batches[bi];
        size_t per = (size_t)b * (1 + n_dec) * g_V;
        float *host = malloc(sizeof(float) * per), *got = malloc(sizeof(float) * per);
        int32_t *toks = malloc(sizeof(int32_t) * (size_t)b * (n_dec ? n_dec : 1));
        mf_step *e = NULL;
        CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2}, &e) == 0, "%s host: %s", what, mf_last_error());
        CHECK(e && run(r, e, b, n_dec, toks, 1, host) == 0, "%s host run batch %d: %s", what, b, mf_last_error());
        mf_step_free(e);
        for (int nc = min_cards; nc <= max_cards; nc++)
            for (int pl = MF_STEP_PLACE_HOST; pl <= (hybrid ? MF_STEP_PLACE_HYBRID : MF_STEP_PLACE_HOST);
                 pl += MF_STEP_PLACE_HYBRID)
                for (int sp = MF_SG_SPLIT_LAYERS; sp <= MF_SG_SPLIT_ROWS; sp++) {
                    if (MF_TEST_TSAN && pl != MF_STEP_PLACE_HOST && nc != max_cards) continue;
                    if (sp == MF_SG_SPLIT_ROWS && nc == 1) continue;   /* one card: the same graph */
                    char spec[64];
                    mf_dev *d = NULL;
                    CHECK(mf_test_emu_open(nc, spec, sizeof spec, &d) == 0, "open %s: %s", spec, mf_last_error());
                    if (!d) continue;
                    e = NULL;
                    CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2, .dev = d, .placement = pl,
                                                         .dense = MF_STEP_DENSE_CARDS, .dense_split = sp},
                                      &e) == 0,
                          "%s %s dense: %s", what, spec, mf_last_error());
                    if (e) {
                        memset(got, 0, sizeof(float) * per);
                        int rc = run(r, e, b, n_dec, toks, 0, got);
                        CHECK(rc == 0, "%s %s placement %d batch %d %s: %s", what, spec, pl, b, split_name[sp],
                              mf_last_error());
                        CHECK(!rc && !memcmp(host, got, sizeof(float) * per),
                              "%s %s placement %d batch %d, split %s: dense-on-card logits differ from the host "
                              "placement's", what, spec, pl, b, split_name[sp]);
                        /* the copies ran on the device lanes */
                        mf_step_times t;
                        mf_step_last_times(e, &t);
                        CHECK(t.copy_busy_ns > 0, "%s %s: no copy time on the device lanes", what, spec);
                        mf_step_free(e);
                    }
                    /* the dense chains in item blocks of 2 items or more (mf_sg_dense_blocks: a
                     * prefill of 6 in 3, batch 16 in 8) and the head's logits in passes of 3 items
                     * (mf_step_opts.head_rows: batch 16 in 6), with the last placement; split by
                     * rows, again with the in stage split by items (mf_sg_in_mode: card k the
                     * blocks j mod nc == k, all the stage's rows) */
                    for (int in = MF_SG_IN_COST; in <= (sp == MF_SG_SPLIT_ROWS ? MF_SG_IN_ITEMS : MF_SG_IN_COST);
                         in += MF_SG_IN_ITEMS) {
                        e = NULL;
                        if (pl == (hybrid ? MF_STEP_PLACE_HYBRID : MF_STEP_PLACE_HOST))
                            CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2, .dev = d, .placement = pl,
                                                                 .dense = MF_STEP_DENSE_CARDS, .dense_split = sp,
                                                                 .in_split = in, .dense_block = 2, .head_rows = 3},
                                              &e) == 0,
                                  "%s %s dense blocks: %s", what, spec, mf_last_error());
                        if (e) {
                            memset(got, 0, sizeof(float) * per);
                            int rc = run(r, e, b, n_dec, toks, 0, got);
                            CHECK(rc == 0 && !memcmp(host, got, sizeof(float) * per),
                                  "%s %s placement %d batch %d, split %s%s, item blocks and head passes: %s", what, spec,
                                  pl, b, split_name[sp], in ? " (in by items)" : "",
                                  rc ? mf_last_error() : "logits differ from the host placement's");
                            mf_step_free(e);
                        }
                    }
                    for (int c = 0; c < nc; c++)
                        CHECK(mf_dev_emu_used_bytes(d, c) == 0, "%s %s: card %d holds %lld bytes after free", what, spec,
                              c, (long long)mf_dev_emu_used_bytes(d, c));
                    mf_dev_close(d);
                }
        free(host);
        free(got);
        free(toks);
    }
}

/* The mutation the bit-identity checks must catch: with --dense-split rows, card 0 computing one
 * row fewer than it owns (mf_step_opts.dense_fault_skip_row) gives logits that differ from the
 * host placement's; the same engine without the fault matches them. */
static void test_rows_mutation(mf_ref *r)
{
    int b = 2, n_dec = 2;
    size_t per = (size_t)b * (1 + n_dec) * g_V;
    float *host = malloc(sizeof(float) * per), *got = malloc(sizeof(float) * per);
    int32_t toks[2 * 2];
    mf_step *e = NULL;
    CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2}, &e) == 0, "mutation host: %s", mf_last_error());
    CHECK(e && run(r, e, b, n_dec, toks, 1, host) == 0, "mutation host run: %s", mf_last_error());
    mf_step_free(e);
    for (int fault = 0; fault < 2; fault++) {
        mf_dev *d = NULL;
        CHECK(mf_dev_open("emu:2,bw=50e9,lat_ns=2000", &d) == 0, "open emu:2: %s", mf_last_error());
        e = NULL;
        CHECK(d && mf_step_new(r, &(mf_step_opts){.n_threads = 2, .dev = d, .dense = MF_STEP_DENSE_CARDS,
                                                  .dense_split = MF_SG_SPLIT_ROWS, .dense_fault_skip_row = fault},
                               &e) == 0,
              "mutation engine: %s", mf_last_error());
        if (e) {
            memset(got, 0, sizeof(float) * per);
            CHECK(run(r, e, b, n_dec, toks, 0, got) == 0, "mutation run: %s", mf_last_error());
            int same = !memcmp(host, got, sizeof(float) * per);
            CHECK(same == !fault, fault ? "card 0 skipping its last row went unnoticed (logits the host's)"
                                        : "rows split without the fault: logits differ from the host's");
            mf_step_free(e);
        }
        mf_dev_close(d);
    }
    free(host);
    free(got);
}

/* The startup self-check: a card whose kernels are off (emu bad_card=1) or whose copy fails
 * (fail_h2d=1: card 0's first) is refused with a message naming the card and kernel; the engine
 * runs the dense work on the cards that passed (lanes mapped to cards 0 and 2), its logits still
 * the host placement's; healthy cards refuse nothing. */
static void test_selfcheck(mf_ref *r)
{
    int b = 2, n_dec = 3;
    size_t per = (size_t)b * (1 + n_dec) * g_V;
    float *host = malloc(sizeof(float) * per), *got = malloc(sizeof(float) * per);
    int32_t toks[2 * 3];
    mf_step *e = NULL;
    CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2}, &e) == 0, "host: %s", mf_last_error());
    CHECK(e && run(r, e, b, n_dec, toks, 1, host) == 0, "host run: %s", mf_last_error());
    mf_step_free(e);
    static const struct { const char *spec, *want[3]; int split; } cs[] = {
        {"emu:3,bad_card=1", {"refused card 1 (emu): kernel fp8 matmul", "relative error", "routed experts run on the host"}, 0},
        {"emu:2,fail_h2d=1", {"refused card 0 (emu): self-check of kernel fp8 matmul", "injected failure", "host"}, 0},
        {"emu:2", {"", "", ""}, 0},
        /* split by rows over the cards that passed (device cards 0 and 2) */
        {"emu:3,bad_card=1", {"refused card 1 (emu): kernel fp8 matmul", "relative error", "routed experts run on the host"},
         MF_SG_SPLIT_ROWS},
    };
    for (int i = 0; i < (int)(sizeof cs / sizeof cs[0]); i++) {
        mf_dev *d = NULL;
        CHECK(mf_dev_open(cs[i].spec, &d) == 0, "open %s: %s", cs[i].spec, mf_last_error());
        if (!d) continue;
        e = NULL;
        CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2, .dev = d, .placement = MF_STEP_PLACE_SEED,
                                             .dense = MF_STEP_DENSE_CARDS, .dense_split = cs[i].split},
                          &e) == 0,
              "%s: %s", cs[i].spec, mf_last_error());
        if (e) {
            const char *msg = mf_step_refused(e);
            for (int k = 0; k < 3; k++)
                CHECK(strstr(msg, cs[i].want[k]) != NULL, "%s: refusal '%s' lacks '%s'", cs[i].spec, msg, cs[i].want[k]);
            if (!cs[i].want[0][0]) CHECK(!msg[0], "%s: healthy cards refused: %s", cs[i].spec, msg);
            int rc = run(r, e, b, n_dec, toks, 0, got);
            CHECK(rc == 0 && !memcmp(host, got, sizeof(float) * per), "%s: after the self-check: rc %d, logits %s", cs[i].spec,
                  rc, rc ? mf_last_error() : "differ from the host placement's");
            mf_step_free(e);
        }
        mf_dev_close(d);
    }
    free(host);
    free(got);
}

/* The resident weights: a dense card reports its bytes (held on the card); a card with room
 * for half of them refuses the engine naming the card and the bytes; and
 * the exact path (the shared expert's two linears and the reference's gating as launches) equals
 * the host placement's exact logits. */
static void test_weights_exact(mf_ref *r)
{
    mf_dev *d = NULL;
    mf_step *e = NULL;
    uint64_t bytes = 0;
    CHECK(mf_dev_open("emu:1", &d) == 0, "open: %s", mf_last_error());
    CHECK(d && mf_step_new(r, &(mf_step_opts){.n_threads = 1, .dev = d, .dense = MF_STEP_DENSE_CARDS}, &e) == 0,
          "emu:1 dense: %s", mf_last_error());
    int card = -1;
    if (e) bytes = mf_step_dense_bytes(e, 0, &card);
    CHECK(bytes > 0 && card == 0 && mf_dev_emu_used_bytes(d, 0) >= (int64_t)bytes, "dense card 0: %llu bytes on card %d",
          (unsigned long long)bytes, card);
    CHECK(e && mf_step_dense_bytes(e, 1, NULL) == 0, "a second dense card on emu:1");
    mf_step_free(e);
    mf_dev_close(d);
    char spec[64], want[64];
    snprintf(spec, sizeof spec, "emu:1,mem=%llu", (unsigned long long)(bytes / 2));
    snprintf(want, sizeof want, "(%llu bytes) do not fit on card 0", (unsigned long long)bytes);
    d = NULL;
    e = NULL;
    CHECK(mf_dev_open(spec, &d) == 0, "open %s: %s", spec, mf_last_error());
    int rc = d ? mf_step_new(r, &(mf_step_opts){.n_threads = 1, .dev = d, .dense = MF_STEP_DENSE_CARDS}, &e) : -1;
    CHECK(rc == -ENOMEM && !e && strstr(mf_last_error(), want), "%s: rc %d: %s (expected '%s')", spec, rc,
          mf_last_error(), want);
    mf_step_free(e);
    mf_dev_close(d);

    int b = 2, n_dec = 3;
    size_t per = (size_t)b * (1 + n_dec) * g_V;
    float *host = malloc(sizeof(float) * per), *got = malloc(sizeof(float) * per);
    int32_t toks[2 * 3];
    e = NULL;
    CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2, .exact = 1}, &e) == 0 && run(r, e, b, n_dec, toks, 1, host) == 0,
          "host exact: %s", mf_last_error());
    mf_step_free(e);
    d = NULL;
    e = NULL;
    CHECK(mf_dev_open("emu:2", &d) == 0, "open: %s", mf_last_error());
    CHECK(d && mf_step_new(r, &(mf_step_opts){.n_threads = 2, .exact = 1, .dev = d, .dense = MF_STEP_DENSE_CARDS},
                           &e) == 0,
          "emu:2 dense exact: %s", mf_last_error());
    rc = e ? run(r, e, b, n_dec, toks, 0, got) : -1;
    CHECK(rc == 0 && !memcmp(host, got, sizeof(float) * per), "dense exact on emu:2: rc %d, logits %s", rc,
          rc ? mf_last_error() : "differ from the host placement's");
    mf_step_free(e);
    mf_dev_close(d);
    free(host);
    free(got);
}

int main(void)
{
    test_ranges();
    test_graph();
    test_graph_rows();
    test_graph_in_items();
    test_sim();
    char dir[1024];
    mf_config c;
    CHECK(mf_config_preset("tiny", &c) == 0, "preset");
    if (mf_test_gen_ckpt(&c, "place_dense_tiny", dir, sizeof dir)) return 1;
    g_V = c.vocab_size;
    mf_model *m = NULL;
    mf_ref *r = NULL;
    CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1}, &m) == 0, "load: %s", mf_last_error());
    if (!m || mf_ref_new(m, NULL, &r)) return mf_check_exit("test_place_dense");
    /* TSan: batch 3 on 1..2 cards (the concurrent path: copies and card work beside host tasks) */
    static const int all[] = {1, 2, 3, 16}, tsan[] = {3};
    int n_dec = MF_TEST_SANITIZED ? 3 : 8;
    test_selfcheck(r);
    test_weights_exact(r);
    test_rows_mutation(r);
    if (MF_TEST_TSAN) test_engine(r, "tiny resident", tsan, 1, 1, 2, 1, n_dec);
    else test_engine(r, "tiny resident", all, 4, 1, 3, 1, n_dec);

    /* CUDA cards (where the build has CUDA and a card): the dense work on the card kernels, logits
     * within tolerance of the host placement's (fp32 sums in another order; a routing choice the
     * order flips moves a token's logits by more, so the bound is loose: 5% of the largest logit) */
    mf_dev *d = NULL;
    if (mf_dev_open("cuda", &d) == 0) {
        int b = 2, n_dec = 3;
        size_t per = (size_t)b * (1 + n_dec) * g_V;
        float *host = malloc(sizeof(float) * per), *got = malloc(sizeof(float) * per);
        int32_t toks[2 * 3];
        mf_step *e = NULL;
        CHECK(mf_step_new(r, &(mf_step_opts){.n_threads = 2}, &e) == 0 && run(r, e, b, n_dec, toks, 1, host) == 0,
              "host run: %s", mf_last_error());
        mf_step_free(e);
        e = NULL;
        int rc = mf_step_new(r, &(mf_step_opts){.n_threads = 2, .dev = d, .dense = MF_STEP_DENSE_CARDS}, &e);
        CHECK(rc == 0, "cuda dense: rc %d: %s", rc, mf_last_error());
        if (e) {
            rc = run(r, e, b, n_dec, toks, 0, got);
            CHECK(rc == 0, "cuda dense run: %s", mf_last_error());
            double md = 0, mh = 0;
            for (size_t i = 0; i < per; i++) {
                double df = fabs((double)got[i] - host[i]);
                if (!(df <= md)) md = df;
                if (fabs(host[i]) > mh) mh = fabs(host[i]);
            }
            printf("cuda dense: logits rel err %.3e against the host placement (max |diff| / max |host|)\n", md / mh);
            CHECK(!rc && md / mh <= 0.05, "cuda dense: logits rel err %.3e (bound 0.05)", md / mh);
            mf_step_free(e);
        }
        free(host);
        free(got);
        mf_dev_close(d);
    }
    mf_ref_free(r);
    mf_model_free(m);

    /* streamed experts */
    m = NULL;
    r = NULL;
    CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1, .store = MF_MODEL_STORE_STREAMED,
                                              .store_budget_bytes = 64ull << 20}, &m) == 0,
          "load streamed: %s", mf_last_error());
    if (m && !mf_ref_new(m, NULL, &r)) {
        static const int sb[] = {1, 3};
        test_engine(r, "tiny streamed", sb + (MF_TEST_TSAN ? 1 : 0), MF_TEST_TSAN ? 1 : 2, 1, 2, 1, n_dec);
    }
    mf_ref_free(r);
    mf_model_free(m);

    /* demo (8 layers, hidden 1024): batch 1 and 16 on emu:2, one decode step; not under the sanitizers */
    if (!MF_TEST_SANITIZED) {
        CHECK(mf_config_preset("demo", &c) == 0, "preset demo");
        if (mf_test_gen_ckpt(&c, "place_dense_demo", dir, sizeof dir)) return 1;
        g_V = c.vocab_size;
        m = NULL;
        r = NULL;
        CHECK(mf_model_load(dir, &(mf_model_opts){.quiet = 1}, &m) == 0, "load demo: %s", mf_last_error());
        if (m && !mf_ref_new(m, NULL, &r)) {
            static const int db[] = {1, 16};
            test_engine(r, "demo", db, 2, 2, 2, 0, 1);
        }
        mf_ref_free(r);
        mf_model_free(m);
    }
    return mf_check_exit("test_place_dense");
}
