/* The shape of a step graph (graphs/step/stepgraph_impl.h mf_sg_parts): its units, item groups and
 * micro-batch halves with their slots, and the row and column parts each sublayer splits into. One
 * home: the builder's files (stepgraph*.c), the engine's buffers (step.c) and the simulator read
 * them from mf_stepgraph. */
#include "graphs/step/stepgraph_impl.h"

#include <math.h>
#include <stdlib.h>

#include "graphs/step/fast_attn.h"
#include "host/kernels.h"

#define SG_MAX_EXP_PARTS 32   /* row parts of one routed expert */
#define SG_MIN_GATHER 4         /* rows of a route's gather part, at least */
#define SG_MIN_COLS 64          /* columns of a hyper-connection part, at least */
#define SG_MIN_QCOLS 16         /* columns of a q norm part, at least (tiny's 64: 4 parts) */
#define SG_KEY_WAVES 16         /* index score parts of a long unit: waves of the workers (sg_key_parts) */
#define SG_EG_ROW_SPLIT 4       /* row parts of an Engram wkv pass per worker (4 beat 1 on every seed-host figure) */

/* The micro-batches of the shape (o->micro; sg's units set): two halves at the unit boundary
 * whose halves are the most equal in items (the first such), else one (a mixed graph: one, its
 * sequences' items may lie on both sides of any boundary); each half's slots. */
static void sg_halves(const mf_sg_opts *o, mf_stepgraph *sg)
{
    const mf_config *c = o->c;
    int K = mf_config_layer_topk(c, sg->layer0), E = mf_config_layer_experts(c, sg->layer0), best = 0;
    sg->n_halves = 1;
    sg->half_end[0] = sg->n;
    sg->half_unit[0] = 0;
    sg->half_unit[1] = sg->n_units;
    for (int k = 1; o->micro == 2 && !sg->mixed && k < sg->n_units; k++) {   /* half 0: units [0, k) */
        int d = abs(2 * sg->unit_end[k - 1] - sg->n);
        if (!best || d < abs(2 * sg->half_end[0] - sg->n)) {
            best = k;
            sg->half_end[0] = sg->unit_end[k - 1];
        }
    }
    if (best) {
        sg->n_halves = 2;
        sg->half_end[1] = sg->n;
        sg->half_unit[1] = best;
        sg->half_unit[2] = sg->n_units;
    }
    sg->half_slot[0] = 0;
    for (int h = 0; h < sg->n_halves; h++) {
        int items = sg->half_end[h] - (h ? sg->half_end[h - 1] : 0);
        sg->half_slot[h + 1] = sg->half_slot[h] + (items * K < E ? items * K : E);
    }
    sg->n_slots = sg->half_slot[sg->n_halves];
}

/* Parts per task of n tasks on W workers: the fewest from p_min that keep the last wave of the
 * n p tasks at least 95% full, at most p_max. */
static int sg_wave_parts(int n, int W, int p_min, int p_max)
{
    int p = p_min;
    for (; p < p_max; p++) {
        int tasks = n * p, waves = (tasks + W - 1) / W;
        if (tasks >= 0.95 * waves * W) break;
    }
    return p;
}

/* The index score parts of each item group (mf_stepgraph.key_parts): p_key, or in a unit of
 * several groups (a long chunk, its items at consecutive positions) parts by the entries its items
 * see in a unit from position 0 (item j of the unit about (j + 1) / ratio), the unit's
 * SG_KEY_WAVES x W parts shared out so (rounded up): a chunk's last groups see twice the mean, and
 * one part each left them the last of the tasks (128 groups on 44 workers: 387 ms of scores where
 * the work over the workers is 288 ms). A later chunk's groups see about the same: there the
 * parts are finer than they need be, no worse balanced. */
static void sg_key_parts(mf_stepgraph *sg, int W)
{
    for (int k = 0; k < sg->n_units; k++) {
        int i0 = k > 0 ? sg->unit_end[k - 1] : 0, i1 = sg->unit_end[k];
        int g0 = mf_sg_group_of(sg, i0), g1 = mf_sg_group_of(sg, i1 - 1) + 1;
        double n = i1 - i0, total = n * (n + 1) / 2;   /* sum of j + 1 over the unit's items */
        for (int g = g0; g < g1; g++) {
            double a = (g ? sg->group_end[g - 1] : 0) - i0, b = sg->group_end[g] - i0;
            double share = (b * (b + 1) - a * (a + 1)) / 2 / total;
            int q = g1 - g0 > 1 ? (int)ceil(SG_KEY_WAVES * W * share) : sg->p_key;
            sg->key_parts[g] = q < sg->p_key ? sg->p_key : q > MF_SG_MAX_PARTS ? MF_SG_MAX_PARTS : q;
        }
    }
}

#define SG_HEAD_PART_BYTES (16.0 * 1024 * 1024)   /* the head's largest part (mf_sg_parts) */

/* Part counts of the shape (one home: the engine's buffers and the simulator read them here). */
void mf_sg_parts(const mf_sg_opts *o, mf_stepgraph *sg)
{
    const mf_config *c = o->c;
    int W = o->n_threads > 0 ? o->n_threads : 1;
    sg->n = sg->n_live = o->n;
    sg->n_layers = c->n_layers;
    sg->par = o->par;
    sg->mixed = o->mixed && !o->par && !o->draft;
    /* the layers it runs: the backbone's (a pipeline stage's range), or the draft's stages (their
     * top-k and experts) */
    sg->draft = o->draft != 0;
    sg->feats = o->feats != 0 && !o->draft;
    sg->layer0 = o->draft ? c->n_layers : o->layer_begin;
    sg->layer1 = o->draft ? c->n_layers + c->n_mtp_layers : o->layer_begin || o->layer_end ? o->layer_end : c->n_layers;
    /* item groups: one item each, or MF_SG_MAX_GROUPS of consecutive items */
    sg->n_groups = o->n < MF_SG_MAX_GROUPS ? o->n : MF_SG_MAX_GROUPS;
    for (int g = 0; g < sg->n_groups; g++)
        sg->group_end[g] = (int)((int64_t)o->n * (g + 1) / sg->n_groups);
    /* units: the item groups of a parallel or mixed graph (up to 128 items: one item each), the
     * one of a serial graph */
    sg->n_units = sg->par || sg->mixed ? sg->n_groups : 1;
    for (int k = 0; k < sg->n_units; k++) sg->unit_end[k] = sg->par || sg->mixed ? sg->group_end[k] : o->n;
    if (o->draft) {   /* a draft round: its sequences' blocks (mf_sg_draft_check) */
        sg->n_units = o->n_units;
        for (int k = 0; k < sg->n_units; k++) sg->unit_end[k] = o->unit_end[k];
    }
    sg_halves(o, sg);
    int ns_half = 0;   /* the larger half's slots: what one MoE runs at a time */
    for (int h = 0; h < sg->n_halves; h++)
        if (sg->half_slot[h + 1] - sg->half_slot[h] > ns_half) ns_half = sg->half_slot[h + 1] - sg->half_slot[h];
    /* split experts by rows when there are fewer slots than two per worker: the fewest parts that
     * give at least two tasks per worker and keep the last wave of tasks at least 95% full (6
     * slots on 44 workers: 8 parts are 48 tasks, a second wave of 4, twice the time; 22 parts
     * are 132, three full waves), at most SG_MAX_EXP_PARTS */
    sg->p_exp = ns_half < 2 * W ? sg_wave_parts(ns_half, W, (2 * W + ns_half - 1) / ns_half, SG_MAX_EXP_PARTS) : 1;
    /* with sockets, a multiple of them: each socket's share of the rows (mf_topo_rows) in equal
     * parts, so that every part lies in one socket's memory */
    int S = o->n_sockets > 1 && o->lane_sock ? o->n_sockets : 1;
    sg->p_exp = (sg->p_exp + S - 1) / S * S;
    /* the dense matrices' row parts likewise (mf_sg_stage_rows; p_attn's cap MF_SG_MAX_PARTS is a
     * multiple of 2, 4 and 8 sockets: with another count the last socket's extra parts are empty) */
    sg->p_sh = c->n_shared_experts > 0 ? ((W < 8 ? W : 8) + S - 1) / S * S : 0;
    /* the head: at least two parts per worker, and parts of at most SG_HEAD_PART_BYTES, so that a
     * worker the machine slows (a neighbour on a VM) holds up the step by at most one such part:
     * on the Intel VM of the third 2026-12-05 session (two workers, demo's 265 MB head), 16-32
     * parts ended the head's phase about 5% sooner than 4 (docs/measurements.md); flash41's
     * 1.32 GB on 44 workers keeps its 88 */
    int ph = 2 * W;
    if (o->sz && o->sz->head_bytes > (double)ph * SG_HEAD_PART_BYTES) ph = (int)ceil(o->sz->head_bytes / SG_HEAD_PART_BYTES);
    sg->p_head = (ph + S - 1) / S * S;
    /* a route's row gather: parts of >= SG_MIN_GATHER rows, at most one per worker (and
     * MF_SG_MAX_PARTS), one (in the route) for a few rows. Before, at most 16 (batch 64's 384
     * rows): an 8192-item chunk's 49,152 rows were 16 parts of 13.5 ms on every layer's path
     * between the gate and the experts (simulated seed host; 44 parts: 5 ms) */
    int max_items = 0;
    for (int h = 0; h < sg->n_halves; h++) {
        int items = sg->half_end[h] - (h ? sg->half_end[h - 1] : 0);
        if (items > max_items) max_items = items;
    }
    int g_rows = max_items * mf_config_layer_topk(c, sg->layer0);
    sg->p_gather = (g_rows + SG_MIN_GATHER - 1) / SG_MIN_GATHER;
    if (sg->p_gather > W) sg->p_gather = W;
    if (sg->p_gather > MF_SG_MAX_PARTS) sg->p_gather = MF_SG_MAX_PARTS;
    if (sg->p_gather < 1) sg->p_gather = 1;
    /* attention stages, Engram wkv, router gate: one part per worker (row chunks of >= 16) */
    sg->p_attn = ((W < MF_SG_MAX_PARTS ? W : MF_SG_MAX_PARTS) + S - 1) / S * S;
    if (sg->p_attn > MF_SG_MAX_PARTS) sg->p_attn = MF_SG_MAX_PARTS;
    /* the Engram wkv: blocks of SG_EG_PASSES kernel passes, SG_EG_ROW_SPLIT x p_attn row parts
     * per pass of a block (a decode batch of <= 64 items: one block of 4 p_attn parts) */
    sg->eg_block = SG_EG_PASSES * MF_KERN_TOK_PASS;
    int passes = (max_items < sg->eg_block ? max_items : sg->eg_block);
    passes = (passes + MF_KERN_TOK_PASS - 1) / MF_KERN_TOK_PASS;
    sg->p_eg = sg->p_attn * passes * SG_EG_ROW_SPLIT;
    /* per item, the parts that give the workers work when the items are fewer: T = workers per
     * item; hyper-connection columns in chunks of >= SG_MIN_COLS, mixes in up to SG_MAX_MIX row
     * parts, heads in equal groups; the q norm's columns in chunks of >= SG_MIN_QCOLS */
    int T = (W + sg->n_groups - 1) / sg->n_groups, nh = c->n_heads, cols = (int)(c->hidden_size / SG_MIN_COLS);
    int hc_max = cols < 1 ? 1 : cols < MF_SG_MAX_PARTS ? cols : MF_SG_MAX_PARTS;
    sg->p_hc = sg_wave_parts(sg->n_groups, W, T < hc_max ? T : hc_max, hc_max);
    sg->p_mix = sg_wave_parts(sg->n_groups, W, T < SG_MAX_MIX ? T : SG_MAX_MIX, SG_MAX_MIX);
    /* a parallel or mixed graph of more items than one mix call takes (MF_FA_MIX_ITEMS): each mix
     * in blocks of groups of up to that many items, whole rows (the rows read once per block and
     * each item's streams twice, not each group's rows: a mix runs beside the layer's chain) */
    sg->mix_groups = 1;
    if ((sg->par || sg->mixed) && o->n > MF_FA_MIX_ITEMS) {
        int per = (o->n + sg->n_groups - 1) / sg->n_groups;   /* items of a group, at most */
        sg->mix_groups = 16 / per > 1 ? 16 / per : 1;
        sg->p_mix = 1;
    }
    /* head groups: from T, the fewest that keep the last wave of the groups' tasks 95% full
     * (batch 64 on 44 workers: 2 groups, 128 tasks in three waves, not 64 in two) */
    int ta = sg_wave_parts(sg->n_groups, W, T < nh ? T : nh, nh);
    sg->ah_heads = (nh + ta - 1) / ta;
    sg->p_ah = (nh + sg->ah_heads - 1) / sg->ah_heads;
    int qcols = (int)(c->q_lora_rank / SG_MIN_QCOLS);
    sg->p_qn = T < qcols ? T : qcols > 0 ? qcols : 1;
    if (sg->p_qn > MF_SG_MAX_PARTS) sg->p_qn = MF_SG_MAX_PARTS;
    sg->ring_late = !o->par && (o->n > 1 || sg->mixed);
    sg->p_key = T < MF_SG_MAX_PARTS ? T : MF_SG_MAX_PARTS;
    sg_key_parts(sg, W);
    sg->n_cards = o->n_cards;
    sg->dev_graphs = o->n_cards > 0 && o->dev_graphs;
    sg->n_dense_cards = o->n_dense_cards;
    sg->dense_split = o->dense_split;
    sg->mk_parts = o->draft ? mf_sg_markov_parts(c, o->profile, o->sz->mk_head_bytes, o->n_dense_cards, o->dense_split) : 1;
    sg->route_topk = sg->p_gather > 1 && !o->ordered;
    sg->dense_block = o->dense_block > 0 ? o->dense_block : MF_SG_DENSE_BLOCK;
    sg->in_split = o->in_split;
    sg->in_whole = o->in_whole;
    for (int L = 0; L < c->n_layers && L < MF_CONFIG_MAX_LAYERS; L++)   /* a micro-batch's items */
        sg->in_items[L] = (int8_t)mf_sg_in_items(o, sg->n_halves > 1 ? sg->n / 2 : sg->n, L);
    for (int L = 0; L < c->n_layers && L < MF_CONFIG_MAX_LAYERS && !o->draft; L++) {
        sg->heads_cards[L] = (int8_t)mf_sg_heads_choice(o, L);
        if (sg->heads_cards[L] && mf_sg_heads_keys(c, L) > sg->heads_keys) sg->heads_keys = mf_sg_heads_keys(c, L);
        sg->heads_any |= sg->heads_cards[L] > 0;
        sg->heads_local[L] = (int8_t)(sg->heads_cards[L] > 0 &&
                                      mf_sg_heads_local(c, o->n_dense_cards, o->dense_split, sg->heads_cards[L]));
        sg->heads_local_any |= sg->heads_local[L];
        sg->heads_qlocal[L] = (int8_t)(sg->heads_cards[L] > 0 && mf_sg_heads_qlocal(c, L, o->n_dense_cards, o->dense_split,
                                                                                    sg->heads_cards[L]));
        sg->heads_qlocal_any |= sg->heads_qlocal[L];
        sg->scores_cards[L] = (int8_t)mf_sg_scores_choice(o, L, sg->heads_cards[L]);
        sg->scores_any |= sg->scores_cards[L] > 0;
    }
    mf_sg_oa_exchange(o, sg);
    sg->n_io_parts = o->store ? MF_SG_EXPERT_PARTS : 0;
    sg->tid_per_slot = 2 * sg->p_exp + 1 + 3 * sg->n_cards;
    /* Engram reads: a unit's items x rows x (codes, scales), the table's stride the largest unit's */
    int max_unit = 0;
    for (int k = 0; k < sg->n_units; k++) {
        int len = sg->unit_end[k] - (k ? sg->unit_end[k - 1] : 0);
        if (len > max_unit) max_unit = len;
    }
    sg->eg_reads_per_unit = o->eg_reads ? 2 * max_unit * (c->engram_max_ngram_size - 1) * c->engram_n_heads : 0;
}
