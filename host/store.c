/* The host expert store (resident or streamed under a byte budget, LFU with aging) and the Engram
 * row gatherer. The store hands out reads (extents and their place in its slab or the caller's
 * staging); an engine issues them on its own IO lane. The synchronous calls (start-up loads, the
 * oracle, tools) issue them on a private run made when first needed (one CPU worker, an IO lane):
 * one slab and prebuilt graphs (experts: per batch entry its reads, then a compute task; gathers:
 * a row of reads) are made at start; a call only fills payloads and runs. Which expert holds which
 * slot is the shared policy of sched/residency.h (LFU with aging, pins); host/store.h says how
 * the store drives it. */
#define _GNU_SOURCE
#include "host/store.h"

#include <errno.h>
#include <hwloc.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "host/dio.h"
#include "host/hostmem.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "sched/path.h"
#include "sched/progress.h"
#include "sched/residency.h"
#include "sched/sched.h"
#include "sched/timeline.h"

#define MF_STORE_SLOT_ALIGN 4096u
#define MF_STORE_GAP_BYTES (64u << 10)       /* parts closer than this are read as one extent */
#define MF_STORE_CHUNK_BYTES (8u << 20)      /* resident table loads: bytes per read */

enum { L_CPU, L_IO, N_LANES };
enum { SLOT_FREE, SLOT_LOADING, SLOT_PRESENT };

typedef struct mf_xread {   /* one aligned extent of an expert: file range -> slot offset */
    int shard;
    uint64_t off, len, slot_off;
} mf_xread;

typedef struct mf_store_table {
    const mf_st_tensor *data, *scale;
    int64_t rows;
    uint64_t row_bytes, srow_bytes;
    const uint8_t *res_data, *res_scale;   /* resident copies, or NULL */
} mf_store_table;

typedef struct mf_span2 { int64_t a, b; } mf_span2;
typedef struct mf_rowkey { int64_t row; int32_t idx; } mf_rowkey;

/* A planned gather (mf_store_gather_reads), in the caller's scratch: the header, then per row its
 * key and its unique index, then the staging of the unique rows (codes, then scales). */
typedef struct mf_gplan {
    int32_t table, n, n_max, nu;
    mf_rowkey *keys;
    int32_t *uniq;
    uint8_t *stage_d, *stage_s;
} mf_gplan;
struct mf_cpu_arg { struct mf_store *s; int k; };

struct mf_store {
    mf_store_opts o;
    int n_layers, n_experts, n_parts, n_items;
    int layer0, table0;           /* the callers' numbers of the first layer and table (mf_store_layout) */
    const mf_st_tensor **parts;   /* [n_items * n_parts] */
    int n_shards;
    mf_dio_file *files;
    int direct;
    mf_sched *sched;              /* the private run of the synchronous calls; NULL until needed */
    int sched_reg;                /* 1: the slab is registered with its ring */
    const char *io_engine;        /* the engine of the last private run ("none" before any) */
    int fault_kind;               /* armed on the next private run (opts, mf_store_io_fault) */
    int64_t fault_nth;
    mf_lane_desc lanes[N_LANES];
    /* slab and slots */
    uint8_t *slab;
    uint64_t slab_bytes, slot_bytes;
    int n_slots;
    uint32_t *part_off;           /* [n_items * n_parts]: offset of the part in its slot */
    mf_xread *xr;                 /* [n_items * n_parts] */
    uint8_t *n_xr;                /* [n_items] */
    mf_resid *res;                /* item (layer x n_experts + id) <-> slot, pins, counts */
    void *res_mem;
    uint8_t *slot_state;          /* [n_slots]: free, loading (a batch's miss) or present */
    uint64_t b_seq;               /* batches begun: marks the shards checked for this one */
    /* the batch graph */
    mf_graph *gs[2], *g;          /* windowed (with compute) and bulk; g: the last run's */
    mf_timeline *tls[2], *tl;
    mf_task_id *g_io, *g_cpu;
    mf_io_read *reads;            /* [max_batch * n_parts] */
    struct mf_cpu_arg *cargs;
    mf_io_read zero_read;
    int b_layer, b_n, b_active;
    int32_t *b_ids;
    uint8_t *b_miss, *b_nreads;
    mf_store_fn fn;
    void *user;
    _Atomic int in_fn;
    mf_span2 *sp_io, *sp_cpu;
    uint64_t *shard_seen;
    int traced;
    /* tables and gathers */
    int n_tables;
    mf_store_table *tables;
    uint8_t *tslab;
    uint64_t tslab_bytes;
    mf_graph *gg;
    mf_task_id *gg_io;
    mf_io_read *greads;
    int max_greads;
    void *gscratch;               /* the synchronous gather's plan (mf_store_gather_bytes(max_rows)) */
    uint64_t gscratch_bytes, max_row_bytes, max_srow_bytes;
    mf_store_stats total, step;
    /* n_sockets > 1 (resident): every expert's rows split in n_sock shares (mf_store_bind_sockets) */
    int n_sock, n_bound;
};

static uint64_t mf_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* ---- layout of experts in slots ---------------------------------------------------------------- */

static int mf_cmp_u64pair(const void *a, const void *b)
{
    const uint64_t *x = a, *y = b;
    return x[0] < y[0] ? -1 : x[0] > y[0];
}

/* Extents of item i (parts sorted by shard and offset, merged when close), their slot offsets and
 * each part's offset in the slot; returns the slot bytes the item needs. */
static uint64_t mf_store_plan_item(mf_store *s, int i)
{
    int np = s->n_parts;
    uint64_t key[64][2];   /* (shard << 48 | offset order key, part) */
    for (int p = 0; p < np; p++) {
        const mf_st_tensor *t = s->parts[(size_t)i * np + p];
        key[p][0] = ((uint64_t)t->shard << 48) | t->file_offset;
        key[p][1] = (uint64_t)p;
    }
    qsort(key, (size_t)np, sizeof key[0], mf_cmp_u64pair);
    mf_xread *x = &s->xr[(size_t)i * np];
    int n = 0;
    uint64_t pos = 0;
    for (int q = 0; q < np; q++) {
        const mf_st_tensor *t = s->parts[(size_t)i * np + key[q][1]];
        const mf_dio_file *f = &s->files[t->shard];
        uint64_t a = f->dio_align ? f->dio_align : 1;
        uint64_t a0 = t->file_offset / a * a, a1 = mf_up(t->file_offset + t->n_bytes, a);
        if (a1 > f->size_bytes) a1 = f->size_bytes;
        if (n && x[n - 1].shard == t->shard && a0 <= x[n - 1].off + x[n - 1].len + MF_STORE_GAP_BYTES &&
            a0 >= x[n - 1].off) {
            uint64_t end = x[n - 1].off + x[n - 1].len;
            if (a1 > end) {
                pos += a1 - end;
                x[n - 1].len = a1 - x[n - 1].off;
            }
        } else {
            pos = mf_up(pos, MF_STORE_SLOT_ALIGN);
            x[n++] = (mf_xread){t->shard, a0, a1 - a0, pos};
            pos += a1 - a0;
        }
        s->part_off[(size_t)i * np + key[q][1]] =
            (uint32_t)(x[n - 1].slot_off + (t->file_offset - x[n - 1].off));
    }
    s->n_xr[i] = (uint8_t)n;
    return mf_up(pos, MF_STORE_SLOT_ALIGN);
}

/* ---- creation ---------------------------------------------------------------------------------- */

static int mf_store_cpu_task(void *arg, mf_task_ctx *ctx)
{
    (void)ctx;
    struct mf_cpu_arg *a = arg;
    mf_store *s = a->s;
    if (!s->fn || a->k >= s->b_n) return 0;
    s->in_fn = 1;
    int rc = s->fn(s->user, a->k);
    s->in_fn = 0;
    if (rc < 0 && !mf_last_error()[0])
        return mf_error(rc, "expert store: compute of layer %d expert %d failed", s->b_layer,
                        s->b_ids[a->k]);
    return rc < 0 ? rc : 0;
}

static int mf_store_membind(mf_store *s, void *p, uint64_t n)
{
    if (s->o.numa_node < 0) return 0;
    hwloc_topology_t topo;
    if (hwloc_topology_init(&topo) < 0 || hwloc_topology_load(topo) < 0)
        return mf_error(-EIO, "expert store: hwloc cannot load the topology (%s:%d)", __FILE__, __LINE__);
    hwloc_obj_t node = hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, (unsigned)s->o.numa_node);
    int rc = 0;
    if (!node)
        rc = mf_error(-EINVAL, "expert store: NUMA node %d does not exist", s->o.numa_node);
    else if (hwloc_set_area_membind(topo, p, (size_t)n, node->nodeset, HWLOC_MEMBIND_BIND,
                                    HWLOC_MEMBIND_BYNODESET) < 0)
        rc = mf_error(-errno ? -errno : -EIO, "expert store: hwloc_set_area_membind to node %d "
                      "failed (%s:%d): %s", s->o.numa_node, __FILE__, __LINE__, strerror(errno));
    hwloc_topology_destroy(topo);
    return rc;
}

/* n_sockets > 1 (resident): every expert's parts split by rows (mf_topo_rows of the pair's data
 * rows; a part's scales share its codes' rows), socket k's share of each part bound to socket k's
 * node, page by page: a page belongs to the share that holds its first byte (a share's last rows
 * before a boundary inside a page lie on the next share's node: at most one page per boundary).
 * The slab is bound before the resident load, whose first touch then lands on each page's node;
 * slot i holds item i (the load takes the items in order into ascending free slots; checked
 * after it). A node that does not exist, or a refused binding, is a note (that socket's pages
 * stay first touch), not an error. */
static void mf_store_part_rows(const mf_store *s, int i, int p, int64_t *rows, uint64_t *row_bytes)
{
    const mf_st_tensor *d = s->parts[(size_t)i * s->n_parts + (p & ~1)], *t = s->parts[(size_t)i * s->n_parts + p];
    *rows = d->n_dims > 0 && d->shape[0] > 0 ? d->shape[0] : 1;
    *row_bytes = t->n_bytes / (uint64_t)*rows;
}

/* range i of socket k's share: part i % n_parts of slot i / n_parts, socket k's rows of it
 * (mf_topo_share_fn) */
static void mf_store_share(void *ctx, int k, int64_t i, uint64_t *a, uint64_t *b, int *first)
{
    const mf_store *s = ctx;
    uint64_t np = (uint64_t)s->n_parts, it = (uint64_t)i / np, p = (uint64_t)i % np, rb;
    uint64_t base = it * s->slot_bytes + s->part_off[it * np + p];
    int64_t R, r0, r1;
    mf_store_part_rows(s, (int)it, (int)p, &R, &rb);
    mf_topo_rows(R, s->n_sock, k, &r0, &r1);
    *a = base + (uint64_t)r0 * rb;
    *b = base + (uint64_t)r1 * rb;
    *first = r0 == 0;
}

static void mf_store_bind_sockets(mf_store *s)
{
    s->n_bound = mf_topo_bind_shares(s->slab, s->slab_bytes, s->n_sock, s->o.socket_node,
                                     (int64_t)s->n_items * s->n_parts, mf_store_share, s, "expert store",
                                     "the experts' rows", s->o.quiet);
}

int mf_store_socket_of(const mf_store *s, const void *p)
{
    const uint8_t *q = p;
    if (s->n_sock < 2 || q < s->slab || q >= s->slab + s->slab_bytes) return -1;
    uint64_t off = (uint64_t)(q - s->slab), i = off / s->slot_bytes, in = off % s->slot_bytes;
    for (int j = 0; j < s->n_parts; j++) {   /* the part holding q, its row, that row's share */
        uint64_t o0 = s->part_off[i * (uint64_t)s->n_parts + (uint64_t)j], rb;
        int64_t R, r0, r1;
        if (in < o0 || in >= o0 + s->parts[i * (uint64_t)s->n_parts + (uint64_t)j]->n_bytes) continue;
        mf_store_part_rows(s, (int)i, j, &R, &rb);
        int64_t row = rb ? (int64_t)((in - o0) / rb) : 0;
        for (int k = 0; k < s->n_sock; k++) {
            mf_topo_rows(R, s->n_sock, k, &r0, &r1);
            if (row >= r0 && row < r1) return k;
        }
    }
    return -1;
}

int mf_store_n_bound(const mf_store *s) { return s->n_bound; }

static void *mf_store_map(uint64_t n) { return mf_hostmem_map((size_t)n, 0); }

/* Graph w = 0 (calls with a compute function): at most read_window experts' reads in flight, in
 * selection order, each expert's compute after its reads and the previous compute; w = 1 (bulk
 * loads): every read at once. Both number their tasks alike. */
static int mf_store_build_graphs(mf_store *s)
{
    int mb = s->o.max_batch, np = s->n_parts, rc = 0, win = s->o.read_window;
    char name[64];
    for (int w = 0; w < 2; w++) {
        mf_graph *g;
        if ((rc = mf_graph_create(s->lanes, N_LANES, &g))) return rc;
        s->gs[w] = g;
        for (int k = 0; k < mb; k++) {
            for (int j = 0; j < np; j++) {
                snprintf(name, sizeof name, "store.read.%d.%d", k, j);
                s->reads[k * np + j] = s->zero_read;
                mf_task_id t = mf_graph_add_task(g, &(mf_task_desc){.name = name, .lane = L_IO,
                                                 .arg = &s->reads[k * np + j], .place_hint = -1,
                                                 .cost = {.bytes = (double)s->slot_bytes / np}});
                if (t < 0) return t;
                s->g_io[k * np + j] = t;
                if (w == 0 && k >= win) {
                    for (int i = 0; i < np; i++)
                        if ((rc = mf_graph_add_dep(g, s->g_io[(k - win) * np + i], t))) return rc;
                }
            }
            s->cargs[k] = (struct mf_cpu_arg){s, k};
            snprintf(name, sizeof name, "store.compute.%d", k);
            mf_task_id c = mf_graph_add_task(g, &(mf_task_desc){.name = name, .lane = L_CPU,
                                             .fn = mf_store_cpu_task, .arg = &s->cargs[k],
                                             .place_hint = -1, .cost = {.time_ns = 1e6}});
            if (c < 0) return c;
            s->g_cpu[k] = c;
            for (int j = 0; j < np; j++)
                if ((rc = mf_graph_add_dep(g, s->g_io[k * np + j], c))) return rc;
            if (k && (rc = mf_graph_add_dep(g, s->g_cpu[k - 1], c))) return rc;   /* in order */
        }
        if ((rc = mf_graph_finalize(g)) || (rc = mf_timeline_create(g, &s->tls[w]))) return rc;
    }
    s->g = s->gs[0];
    s->tl = s->tls[0];
    if ((rc = mf_graph_create(s->lanes, N_LANES, &s->gg))) return rc;
    for (int i = 0; i < s->max_greads; i++) {
        snprintf(name, sizeof name, "store.gather.%d", i);
        s->greads[i] = s->zero_read;
        mf_task_id t = mf_graph_add_task(s->gg, &(mf_task_desc){.name = name, .lane = L_IO,
                                         .arg = &s->greads[i], .place_hint = -1,
                                         .cost = {.bytes = 512}});
        if (t < 0) return t;
        s->gg_io[i] = t;
    }
    return mf_graph_finalize(s->gg);
}

/* The slab in pieces of at most 1 GiB (as the rings register them); 0 when over 62 GiB. */
static int mf_store_slab_pieces(const mf_store *s, void **bufs, uint64_t *lens, int max)
{
    int n = 0;
    if (!s->slab_bytes || s->slab_bytes > (UINT64_C(62) << 30)) return 0;
    for (uint64_t off = 0; off < s->slab_bytes && n < max; off += UINT64_C(1) << 30, n++) {
        bufs[n] = s->slab + off;
        lens[n] = s->slab_bytes - off < (UINT64_C(1) << 30) ? s->slab_bytes - off : UINT64_C(1) << 30;
    }
    return n;
}

int mf_store_io_buffers(const mf_store *s, void **bufs, uint64_t *n_bytes, int max)
{
    return s->o.mode == MF_STORE_STREAMED ? mf_store_slab_pieces(s, bufs, n_bytes, max) : 0;
}

/* The private run of the synchronous calls, made when first needed; with `experts`, the slab is
 * registered with its ring (fixed-buffer reads) before the first expert read through it. */
static int mf_store_sync(mf_store *s, int experts)
{
    if (!s->sched) {
        int rc = mf_sched_create(&(mf_sched_opts){.lanes = s->lanes, .n_lanes = N_LANES,
                                                  .io_force_pread = s->o.force_pread,
                                                  .io_fault_kind = s->fault_kind,
                                                  .io_fault_nth = s->fault_nth}, &s->sched);
        if (rc) return mf_error_wrap(rc, "expert store: its IO lane");
        s->fault_kind = MF_IO_FAULT_NONE;
        s->fault_nth = 0;
        s->io_engine = mf_sched_io_engine(s->sched);
        s->sched_reg = 0;
    }
    if (experts && !s->sched_reg) {
        void *bufs[63];
        uint64_t lens[63];
        int n = mf_store_slab_pieces(s, bufs, lens, 63);
        if (n) mf_sched_io_register(s->sched, bufs, lens, n);   /* a refusal is logged; reads still work */
        mf_error_clear();
        s->sched_reg = 1;
    }
    return 0;
}

void mf_store_io_release(mf_store *s)
{
    mf_sched_destroy(s->sched);
    s->sched = NULL;
    s->sched_reg = 0;
}

void mf_store_io_fault(mf_store *s, int kind, int64_t nth)
{
    if (s->sched) {
        mf_sched_io_fault(s->sched, kind, nth);
    } else {
        s->fault_kind = kind;
        s->fault_nth = nth;
    }
}

static int mf_store_load_resident(mf_store *s);
static int mf_store_load_tables(mf_store *s);

/* The item of expert id of layer (the callers' numbers: layer0 first). */
static int mf_store_item(const mf_store *s, int layer, int id) { return (layer - s->layer0) * s->n_experts + id; }

/* The options with their defaults, the layout's counts. */
static void mf_store_init_opts(mf_store *s, const mf_store_layout *lay, const mf_store_opts *opts)
{
    if (opts) s->o = *opts;
    else s->o.numa_node = -1;
    if (!s->o.budget_bytes) s->o.budget_bytes = UINT64_C(2) << 30;
    if (!s->o.io_depth) s->o.io_depth = 64;
    if (!s->o.max_batch) s->o.max_batch = 16;
    if (!s->o.max_rows) s->o.max_rows = 1024;
    if (s->o.read_window <= 0) s->o.read_window = 2;
    s->n_layers = lay->n_layers;
    s->n_experts = lay->n_experts;
    s->n_parts = lay->n_parts;
    s->n_items = lay->n_layers * lay->n_experts;
    s->n_tables = lay->n_tables;
    s->layer0 = lay->layer0;
    s->table0 = lay->table0;
    s->zero_read = (mf_io_read){.fd = -1};
    s->max_greads = 2 * s->o.max_rows;
}

/* Every shard of st opened (O_DIRECT unless buffered; direct stays 1 only if all are). */
static int mf_store_open_files(mf_store *s, const mf_st *st)
{
    s->n_shards = mf_st_n_shards(st);
    s->files = calloc((size_t)s->n_shards, sizeof *s->files);
    s->shard_seen = calloc((size_t)s->n_shards, sizeof *s->shard_seen);
    if (!s->files || !s->shard_seen) return mf_error(-ENOMEM, "expert store: out of memory");
    for (int i = 0; i < s->n_shards; i++) s->files[i].fd = -1;
    s->direct = !s->o.buffered;
    for (int i = 0; i < s->n_shards; i++) {
        int rc = mf_dio_open(mf_st_shard_path(st, i), !s->o.buffered, &s->files[i]);
        if (rc) return rc;
        if (!s->files[i].dio_align) s->direct = 0;
    }
    return 0;
}

/* Per-expert bookkeeping (its parts from the layout, their offsets and reads) and the per-call
 * arrays of a batch of max_batch experts and of a gather of max_greads reads. */
static int mf_store_alloc_items(mf_store *s, const mf_store_layout *lay)
{
    size_t ni = (size_t)s->n_items;
    int np = s->n_parts, mb = s->o.max_batch;
    s->parts = malloc(ni * np * sizeof *s->parts + 1);
    s->part_off = calloc(ni * np + 1, sizeof *s->part_off);
    s->xr = calloc(ni * np + 1, sizeof *s->xr);
    s->n_xr = calloc(ni + 1, 1);
    s->reads = calloc((size_t)mb * np, sizeof *s->reads);
    s->g_io = calloc((size_t)mb * np, sizeof *s->g_io);
    s->g_cpu = calloc((size_t)mb, sizeof *s->g_cpu);
    s->cargs = calloc((size_t)mb, sizeof *s->cargs);
    s->b_ids = calloc((size_t)mb, sizeof *s->b_ids);
    s->b_miss = calloc((size_t)mb, 1);
    s->b_nreads = calloc((size_t)mb, 1);
    s->sp_io = calloc((size_t)mb * (np + 1), sizeof *s->sp_io);
    s->sp_cpu = calloc((size_t)mb + 1, sizeof *s->sp_cpu);
    s->tables = calloc((size_t)s->n_tables + 1, sizeof *s->tables);
    s->greads = calloc((size_t)s->max_greads, sizeof *s->greads);
    s->gg_io = calloc((size_t)s->max_greads, sizeof *s->gg_io);
    if (!s->parts || !s->part_off || !s->xr || !s->n_xr || !s->reads || !s->g_io || !s->g_cpu ||
        !s->cargs || !s->b_ids || !s->b_miss || !s->b_nreads || !s->sp_io || !s->sp_cpu ||
        !s->tables || !s->greads || !s->gg_io)
        return mf_error(-ENOMEM, "expert store: out of memory for %d experts", s->n_items);
    if (ni) memcpy(s->parts, lay->parts, ni * np * sizeof *s->parts);
    for (size_t i = 0; i < ni * np; i++)
        if (!s->parts[i]) return mf_error(-EINVAL, "expert store: part %zu of the layout is NULL", i);
    return 0;
}

/* Each expert's reads planned (the largest makes slot_bytes), the slots (every expert resident,
 * else what the budget holds, at least what one call may pin), their residency policy and the
 * slab, mapped and bound to the NUMA node. */
static int mf_store_plan_slots(mf_store *s)
{
    int mb = s->o.max_batch, rc;
    s->slot_bytes = 0;
    for (int i = 0; i < s->n_items; i++) {
        uint64_t b = mf_store_plan_item(s, i);
        if (b > s->slot_bytes) s->slot_bytes = b;
    }
    if (s->slot_bytes > UINT32_MAX) return mf_error(-EINVAL, "expert store: an expert spans over 4 GiB");
    if (s->o.mode == MF_STORE_RESIDENT) {
        s->n_slots = s->n_items;
    } else {
        uint64_t n = s->slot_bytes ? s->o.budget_bytes / s->slot_bytes : 0;
        if (n > (uint64_t)s->n_items) n = (uint64_t)s->n_items;
        int need = s->o.min_slots > 0 && s->o.min_slots < mb ? s->o.min_slots : mb;
        if (n < (uint64_t)need && n < (uint64_t)s->n_items)
            return mf_error(-ENOSPC, "expert store: a budget of %" PRIu64 " bytes holds %" PRIu64
                            " experts of %" PRIu64 " bytes, fewer than the %d one call may pin",
                            s->o.budget_bytes, n, s->slot_bytes, need);
        s->n_slots = (int)n;
    }
    mf_resid_opts ro = {.policy = MF_RESID_LFU, .n_items = s->n_items, .n_slots = s->n_slots,
                        .aging_period = s->o.aging_period > 0 ? s->o.aging_period : 0};
    size_t res_bytes = mf_resid_bytes(&ro);
    s->res_mem = malloc(res_bytes ? res_bytes : 1);
    s->slot_state = calloc((size_t)s->n_slots + 1, 1);
    if (!s->res_mem || !s->slot_state)
        return mf_error(-ENOMEM, "expert store: out of memory for %d slots", s->n_slots);
    if ((rc = mf_resid_init(&ro, s->res_mem, res_bytes, &s->res))) return rc;
    s->slab_bytes = (uint64_t)s->n_slots * s->slot_bytes;
    s->slab = mf_store_map(s->slab_bytes);
    if (!s->slab)
        return mf_error(-ENOMEM, "expert store: cannot map %" PRIu64 " bytes for %d expert slots",
                        s->slab_bytes, s->n_slots);
    if (s->o.mode != MF_STORE_RESIDENT || s->o.n_sockets < 2) return mf_store_membind(s, s->slab, s->slab_bytes);
    /* every expert's rows shared by the sockets (mf_store_bind_sockets) */
    s->n_sock = s->o.n_sockets > MF_TOPO_MAX_SOCKETS ? MF_TOPO_MAX_SOCKETS : s->o.n_sockets;
    mf_store_bind_sockets(s);
    return 0;
}

/* The Engram tables of the layout (data and scale per table, rows agreeing), their row sizes,
 * the gather scratch and, resident, the tables' slab. */
static int mf_store_plan_tables(mf_store *s, const mf_store_layout *lay)
{
    for (int t = 0; t < s->n_tables; t++) {
        mf_store_table *T = &s->tables[t];
        T->data = lay->tables[2 * t];
        T->scale = lay->tables[2 * t + 1];
        T->rows = T->data->n_dims ? T->data->shape[0] : 0;
        if (T->rows < 1 || T->scale->shape[0] != T->rows)
            return mf_error(-EINVAL, "expert store: table %s has %" PRId64 " rows, its scales %s %" PRId64,
                            T->data->name, T->rows, T->scale->name, T->scale->shape[0]);
        T->row_bytes = T->data->n_bytes / (uint64_t)T->rows;
        T->srow_bytes = T->scale->n_bytes / (uint64_t)T->rows;
        if (s->o.table_mode == MF_STORE_RESIDENT)
            s->tslab_bytes += mf_up(T->data->n_bytes, 4096) + mf_up(T->scale->n_bytes, 4096) + 2 * 4096;
    }
    for (int t = 0; t < s->n_tables; t++) {
        if (s->tables[t].row_bytes > s->max_row_bytes) s->max_row_bytes = s->tables[t].row_bytes;
        if (s->tables[t].srow_bytes > s->max_srow_bytes) s->max_srow_bytes = s->tables[t].srow_bytes;
    }
    s->gscratch_bytes = mf_store_gather_bytes(s, s->o.max_rows);
    s->gscratch = mf_store_map(s->gscratch_bytes);
    s->tslab = s->tslab_bytes ? mf_store_map(s->tslab_bytes) : NULL;
    if (!s->gscratch || (s->tslab_bytes && !s->tslab))
        return mf_error(-ENOMEM, "expert store: cannot map %" PRIu64 " bytes for Engram tables", s->tslab_bytes);
    return s->tslab ? mf_store_membind(s, s->tslab, s->tslab_bytes) : 0;
}

/* The private run's lanes (mf_store_sync: one compute worker, the IO lane at depth) and graphs,
 * the slab pinned (pin_hook), the IO engine started, the resident experts and tables read in. */
static int mf_store_start(mf_store *s)
{
    int rc;
    s->lanes[L_CPU] = (mf_lane_desc){.kind = MF_LANE_CPU, .name = "store.cpu", .concurrency = 1,
                                     .numa_node = -1, .model = {.latency_ns = 1e3}};
    s->lanes[L_IO] = (mf_lane_desc){.kind = MF_LANE_IO, .name = "store.io",
                                    .concurrency = s->o.io_depth, .numa_node = -1,
                                    .model = {.bytes_per_s = 2e9, .latency_ns = 1e5}};
    s->io_engine = "none";
    s->fault_kind = s->o.io_fault_kind;
    s->fault_nth = s->o.io_fault_nth;
    if ((rc = mf_store_build_graphs(s))) return rc;
    if (s->o.pin_hook && s->slab_bytes && (rc = s->o.pin_hook(s->o.pin_user, s->slab, s->slab_bytes)) < 0)
        return rc;
    if ((rc = mf_store_sync(s, 0))) return rc;
    if (s->o.mode == MF_STORE_RESIDENT && (rc = mf_store_load_resident(s))) return rc;
    return mf_store_load_tables(s);
}

int mf_store_create(const mf_st *st, const mf_store_layout *lay, const mf_store_opts *opts,
                    mf_store **out)
{
    *out = NULL;
    if (!lay || lay->n_layers < 0 || lay->n_experts < 0 || lay->n_parts < 1 || lay->n_parts > 64 ||
        lay->n_tables < 0 || (lay->n_layers > 0 && lay->n_experts > 0 && !lay->parts))
        return mf_error(-EINVAL, "expert store: bad layout (%d parts per expert, 1..64)",
                        lay ? lay->n_parts : 0);
    mf_store *s = calloc(1, sizeof *s);
    if (!s) return mf_error(-ENOMEM, "expert store: out of memory");
    mf_store_init_opts(s, lay, opts);
    int rc = mf_store_open_files(s, st);
    if (!rc) rc = mf_store_alloc_items(s, lay);
    if (!rc) rc = mf_store_plan_slots(s);
    if (!rc) rc = mf_store_plan_tables(s, lay);
    if (!rc) rc = mf_store_start(s);
    if (rc) {
        mf_store_destroy(s);
        return rc;
    }
    memset(&s->total, 0, sizeof s->total);
    memset(&s->step, 0, sizeof s->step);
    mf_resid_stats_reset(s->res);
    *out = s;
    return 0;
}

void mf_store_destroy(mf_store *s)
{
    if (!s) return;
    mf_sched_destroy(s->sched);   /* before the buffers its ring has registered */
    for (int w = 0; w < 2; w++) {
        mf_timeline_destroy(s->tls[w]);
        mf_graph_destroy(s->gs[w]);
    }
    mf_graph_destroy(s->gg);
    if (s->slab) munmap(s->slab, (size_t)(s->slab_bytes ? s->slab_bytes : 1));
    if (s->tslab) munmap(s->tslab, (size_t)s->tslab_bytes);
    if (s->gscratch) munmap(s->gscratch, (size_t)(s->gscratch_bytes ? s->gscratch_bytes : 1));
    for (int i = 0; s->files && i < s->n_shards; i++) mf_dio_close(&s->files[i]);
    free(s->files);
    free(s->shard_seen);
    free(s->parts);
    free(s->part_off);
    free(s->xr);
    free(s->n_xr);
    free(s->res_mem);
    free(s->slot_state);
    free(s->reads);
    free(s->g_io);
    free(s->g_cpu);
    free(s->cargs);
    free(s->b_ids);
    free(s->b_miss);
    free(s->b_nreads);
    free(s->sp_io);
    free(s->sp_cpu);
    free(s->tables);
    free(s->greads);
    free(s->gg_io);
    free(s);
}

static void mf_store_name_item(const mf_store *s, int item, const mf_xread *x, char *buf, size_t n)
{
    /* the tensors whose bytes fall in extent x (all of the item's when x is NULL) */
    size_t k = 0;
    buf[0] = 0;
    for (int p = 0; p < s->n_parts && k + 2 < n; p++) {
        const mf_st_tensor *t = s->parts[(size_t)item * s->n_parts + p];
        if (x && (t->shard != x->shard || t->file_offset < x->off || t->file_offset >= x->off + x->len))
            continue;
        k += (size_t)snprintf(buf + k, n - k, "%s%s", k ? ", " : "", t->name);
    }
}

int mf_store_begin(mf_store *s, int layer, const int32_t *ids, int n)
{
    if (layer < s->layer0 || layer >= s->layer0 + s->n_layers || n < 0 || n > s->o.max_batch)
        return mf_error(-EINVAL, "expert store: layer %d, %d experts (layers %d..%d, at most %d per "
                        "call)", layer, n, s->layer0, s->layer0 + s->n_layers - 1, s->o.max_batch);
    for (int k = 0; k < n; k++) {
        if (ids[k] < 0 || ids[k] >= s->n_experts)
            return mf_error(-EINVAL, "expert store: expert %d out of 0..%d", ids[k], s->n_experts - 1);
        for (int j = 0; j < k; j++)
            if (ids[j] == ids[k])
                return mf_error(-EINVAL, "expert store: expert %d named twice in one call", ids[k]);
    }
    s->b_layer = layer;
    s->b_n = n;
    s->b_active = 1;
    s->b_seq++;
    /* every access counted first, then the hits pinned, so that no hit is evicted for a miss */
    for (int k = 0; k < n; k++) {
        int item = mf_store_item(s, layer, ids[k]), sl;
        s->b_ids[k] = ids[k];
        s->b_nreads[k] = 0;
        mf_resid_touch(s->res, item);
        s->b_miss[k] = mf_resid_slot(s->res, item) < 0;
        if (!s->b_miss[k] && mf_resid_lookup(s->res, item, &sl) == 1) mf_resid_pin(s->res, sl);
    }
    for (int k = 0; k < n; k++) {
        if (!s->b_miss[k]) continue;
        int item = mf_store_item(s, layer, ids[k]);
        int sl;   /* a free slot, else the policy's victim, evicted */
        if (mf_resid_lookup(s->res, item, &sl) != 0) {
            for (int j = 0; j < n; j++) {   /* undo: free the slots taken, unpin the hits */
                int q = mf_resid_slot(s->res, mf_store_item(s, layer, ids[j]));
                if (!s->b_miss[j]) {
                    mf_resid_unpin(s->res, q);
                } else if (j < k) {
                    s->slot_state[q] = SLOT_FREE;
                    mf_resid_clear(s->res, q);
                }
            }
            s->b_active = 0;
            return mf_error(-ENOSPC, "expert store: all %d slots are pinned; layer %d expert %d "
                            "has nowhere to go (raise the budget or unpin)", s->n_slots, layer, ids[k]);
        }
        s->slot_state[sl] = SLOT_LOADING;
        mf_resid_pin(s->res, sl);
        const mf_xread *x = &s->xr[(size_t)item * s->n_parts];
        uint8_t *base = s->slab + (uint64_t)sl * s->slot_bytes;
        for (int j = 0; j < s->n_xr[item]; j++) {
            const mf_dio_file *f = &s->files[x[j].shard];
            s->reads[k * s->n_parts + j] = (mf_io_read){.fd = f->fd, .offset = x[j].off,
                                                        .buf = base + x[j].slot_off,
                                                        .n_bytes = x[j].len,
                                                        .dio_align = f->dio_align};
        }
        s->b_nreads[k] = s->n_xr[item];
    }
    return 0;
}

mf_io_read *mf_store_reads(mf_store *s, int k, int *n)
{
    *n = k >= 0 && k < s->b_n ? s->b_nreads[k] : 0;
    return &s->reads[(k < 0 ? 0 : k) * s->n_parts];
}

const uint8_t *mf_store_batch_part(const mf_store *s, int k, int part)
{
    if (!s->b_active || k < 0 || k >= s->b_n || part < 0 || part >= s->n_parts) return NULL;
    int item = mf_store_item(s, s->b_layer, s->b_ids[k]), sl = mf_resid_slot(s->res, item);
    if (sl < 0) return NULL;
    return s->slab + (uint64_t)sl * s->slot_bytes + s->part_off[(size_t)item * s->n_parts + part];
}

static int mf_store_check_shards(mf_store *s);
int mf_store_check(mf_store *s) { return mf_store_check_shards(s); }

int mf_store_end(mf_store *s, int status)
{
    if (!s->b_active) return status;
    for (int k = 0; k < s->b_n; k++) {
        if (!s->b_miss[k]) continue;
        int item = mf_store_item(s, s->b_layer, s->b_ids[k]), sl = mf_resid_slot(s->res, item);
        if (status == 0) {
            s->slot_state[sl] = SLOT_PRESENT;
            for (int j = 0; j < s->b_nreads[k]; j++) {
                s->total.bytes_read += s->reads[k * s->n_parts + j].n_bytes;
                s->step.bytes_read += s->reads[k * s->n_parts + j].n_bytes;
            }
        } else {   /* nothing partially read is ever marked present */
            s->slot_state[sl] = SLOT_FREE;
            mf_resid_clear(s->res, sl);
        }
    }
    for (int k = 0; k < s->b_n * s->n_parts; k++) s->reads[k] = s->zero_read;
    if (status) {   /* a failed call pins nothing */
        for (int k = 0; k < s->b_n; k++) {
            int sl = mf_resid_slot(s->res, mf_store_item(s, s->b_layer, s->b_ids[k]));
            if (sl >= 0 && !s->b_miss[k]) mf_resid_unpin(s->res, sl);
        }
    }
    s->b_active = 0;
    return status;
}

/* ---- running a batch ------------------------------------------------------------------------- */

static int mf_cmp_span(const void *a, const void *b)
{
    const mf_span2 *x = a, *y = b;
    return x->a < y->a ? -1 : x->a > y->a;
}

static int mf_span_union(mf_span2 *v, int n, int64_t *busy)
{
    qsort(v, (size_t)n, sizeof *v, mf_cmp_span);
    int m = 0;
    *busy = 0;
    for (int i = 0; i < n; i++) {
        if (m && v[i].a <= v[m - 1].b) {
            if (v[i].b > v[m - 1].b) v[m - 1].b = v[i].b;
        } else {
            v[m++] = v[i];
        }
    }
    for (int i = 0; i < m; i++) *busy += v[i].b - v[i].a;
    return m;
}

/* IO busy, compute busy and their intersection in the last run. */
static void mf_store_overlap(mf_store *s)
{
    mf_task_span *sp = mf_timeline_spans(s->tl);
    int ni = 0, nc = 0;
    for (int k = 0; k < s->b_n; k++) {
        for (int j = 0; j < s->b_nreads[k]; j++) {
            mf_task_span *x = &sp[s->g_io[k * s->n_parts + j]];
            if (x->status == 0) s->sp_io[ni++] = (mf_span2){x->start_ns, x->end_ns};
        }
        mf_task_span *c = &sp[s->g_cpu[k]];
        if (c->status == 0) s->sp_cpu[nc++] = (mf_span2){c->start_ns, c->end_ns};
    }
    int64_t bi, bc, ov = 0;
    ni = mf_span_union(s->sp_io, ni, &bi);
    nc = mf_span_union(s->sp_cpu, nc, &bc);
    for (int i = 0, j = 0; i < ni && j < nc;) {
        int64_t a = s->sp_io[i].a > s->sp_cpu[j].a ? s->sp_io[i].a : s->sp_cpu[j].a;
        int64_t b = s->sp_io[i].b < s->sp_cpu[j].b ? s->sp_io[i].b : s->sp_cpu[j].b;
        if (b > a) ov += b - a;
        if (s->sp_io[i].b < s->sp_cpu[j].b) i++;
        else j++;
    }
    s->total.io_busy_ns += bi;
    s->total.cpu_busy_ns += bc;
    s->total.overlap_ns += ov;
    s->step.io_busy_ns += bi;
    s->step.cpu_busy_ns += bc;
    s->step.overlap_ns += ov;
}

/* Checks the shards a batch will read (truncated or replaced since open) before reading. */
static int mf_store_check_shards(mf_store *s)
{
    if (!s->b_active) return 0;
    uint64_t mark = s->b_seq;
    for (int k = 0; k < s->b_n; k++) {
        int item = mf_store_item(s, s->b_layer, s->b_ids[k]);
        for (int j = 0; j < s->b_nreads[k]; j++) {
            int sh = s->xr[(size_t)item * s->n_parts + j].shard;
            if (s->shard_seen[sh] == mark) continue;
            s->shard_seen[sh] = mark;
            int rc = mf_dio_check(&s->files[sh]);
            if (rc) {
                char names[512];
                mf_store_name_item(s, item, NULL, names, sizeof names);
                return mf_error_wrap(rc, "expert store: layer %d expert %d (%s)", s->b_layer,
                                     s->b_ids[k], names);
            }
        }
    }
    return 0;
}

/* After a failed run: names the expert, tensors and file of the first failed read. */
static int mf_store_explain(mf_store *s, int rc)
{
    char lane[MF_ERROR_MSG_BYTES];
    snprintf(lane, sizeof lane, "%s", mf_last_error());
    mf_task_span *sp = mf_timeline_spans(s->tl);
    for (int k = 0; k < s->b_n; k++)
        for (int j = 0; j < s->b_nreads[k]; j++) {
            if (sp[s->g_io[k * s->n_parts + j]].status >= 0) continue;
            int item = mf_store_item(s, s->b_layer, s->b_ids[k]);
            const mf_xread *x = &s->xr[(size_t)item * s->n_parts + j];
            char names[512], why[MF_ERROR_MSG_BYTES] = "";
            mf_store_name_item(s, item, x, names, sizeof names);
            if (mf_dio_check(&s->files[x->shard])) snprintf(why, sizeof why, " (%s)", mf_last_error());
            return mf_error(rc, "expert store: layer %d expert %d: reading %s from %s failed%s: %s",
                            s->b_layer, s->b_ids[k], names, s->files[x->shard].path, why, lane);
        }
    return mf_error(rc, "expert store: layer %d: %s", s->b_layer, lane);
}

int mf_store_ensure(mf_store *s, int layer, const int32_t *ids, int n, mf_store_fn fn, void *user)
{
    int rc = mf_store_begin(s, layer, ids, n);
    if (rc) return rc;
    int n_reads = 0;
    for (int k = 0; k < n; k++) n_reads += s->b_nreads[k];
    if (n_reads && (rc = mf_store_check_shards(s))) return mf_store_end(s, rc);
    if (!n_reads && !fn) return mf_store_end(s, 0);
    if ((rc = mf_store_sync(s, n_reads > 0))) return mf_store_end(s, rc);
    s->fn = fn;
    s->user = user;
    s->g = s->gs[fn ? 0 : 1];
    s->tl = s->tls[fn ? 0 : 1];
    mf_timeline_reset(s->tl);
    int64_t t0 = mf_now_ns();
    rc = mf_sched_run(s->sched, s->g, &(mf_run_opts){.timeline = s->tl});
    if (n_reads) {
        s->total.read_wall_ns += mf_now_ns() - t0;
        s->step.read_wall_ns += mf_now_ns() - t0;
    }
    s->fn = NULL;
    if (rc) {
        int any_io = 0;
        mf_task_span *sp = mf_timeline_spans(s->tl);
        for (int k = 0; k < n; k++)
            for (int j = 0; j < s->b_nreads[k]; j++) any_io |= sp[s->g_io[k * s->n_parts + j]].status < 0;
        if (any_io) rc = mf_store_explain(s, rc);
        return mf_store_end(s, rc);
    }
    if (fn) {
        mf_store_overlap(s);
        s->traced = 1;
    }
    return mf_store_end(s, 0);
}

void mf_store_unpin(mf_store *s, int layer, const int32_t *ids, int n)
{
    for (int k = 0; k < n; k++) {
        if (layer < s->layer0 || layer >= s->layer0 + s->n_layers || ids[k] < 0 || ids[k] >= s->n_experts) continue;
        int sl = mf_resid_slot(s->res, mf_store_item(s, layer, ids[k]));
        if (sl >= 0) mf_resid_unpin(s->res, sl);
    }
}

const uint8_t *mf_store_part(const mf_store *s, int layer, int id, int part)
{
    if (layer < s->layer0 || layer >= s->layer0 + s->n_layers || id < 0 || id >= s->n_experts || part < 0 ||
        part >= s->n_parts)
        return NULL;
    int item = mf_store_item(s, layer, id), sl = mf_resid_slot(s->res, item);
    /* inside fn, the experts of the batch are read (fn of k runs after k's reads) */
    if (sl < 0 || (s->slot_state[sl] != SLOT_PRESENT && !(s->in_fn && s->slot_state[sl] == SLOT_LOADING)))
        return NULL;
    return s->slab + (uint64_t)sl * s->slot_bytes + s->part_off[(size_t)item * s->n_parts + part];
}

static int mf_store_load_resident(mf_store *s)
{
    mf_progress pr;
    mf_progress_begin(&pr, "experts", (uint64_t)s->n_items * s->slot_bytes, 1, s->o.quiet);
    int32_t ids[256];
    int mb = s->o.max_batch < 256 ? s->o.max_batch : 256;
    /* in item order: the free slots are taken in ascending order, so slot i holds item i (the
     * sockets' shares were bound by that, mf_store_bind_sockets; checked below) */
    for (int L = s->layer0; L < s->layer0 + s->n_layers; L++)
        for (int e0 = 0; e0 < s->n_experts;) {
            int n = 0;
            for (; e0 < s->n_experts && n < mb; e0++) ids[n++] = e0;
            if (!n) continue;
            uint64_t before = s->total.bytes_read;
            int rc = mf_store_ensure(s, L, ids, n, NULL, NULL);
            if (rc) {
                mf_progress_end(&pr);
                return rc;
            }
            mf_store_unpin(s, L, ids, n);
            mf_progress_add(&pr, s->total.bytes_read - before);
        }
    mf_progress_end(&pr);
    for (int i = 0; s->n_sock > 1 && i < s->n_items; i++)
        if (mf_resid_slot(s->res, i) != i)
            return mf_error(-EFAULT, "expert store: expert %d loaded into slot %d, not its own (internal)", i,
                            mf_resid_slot(s->res, i));
    return 0;
}

/* ---- Engram tables ----------------------------------------------------------------------------- */

/* Runs the gather graph over greads[0..n); names `what` on failure. */
static int mf_store_run_greads(mf_store *s, int n, const char *what)
{
    for (int i = n; i < s->max_greads; i++) s->greads[i] = s->zero_read;
    int rc = mf_store_sync(s, 0);
    if (rc) return rc;
    rc = mf_sched_run(s->sched, s->gg, NULL);
    for (int i = 0; i < n; i++) s->greads[i] = s->zero_read;
    if (!rc) return 0;
    char lane[MF_ERROR_MSG_BYTES];
    snprintf(lane, sizeof lane, "%s", mf_last_error());
    return mf_error(rc, "%s: %s", what, lane);
}

static int mf_store_load_tables(mf_store *s)
{
    if (s->o.table_mode != MF_STORE_RESIDENT || !s->n_tables) return 0;
    uint64_t total = 0;
    for (int t = 0; t < s->n_tables; t++) total += s->tables[t].data->n_bytes + s->tables[t].scale->n_bytes;
    mf_progress pr;
    mf_progress_begin(&pr, "engram", total, 1, s->o.quiet);
    uint8_t *p = s->tslab;
    for (int t = 0; t < s->n_tables; t++)
        for (int w = 0; w < 2; w++) {
            const mf_st_tensor *x = w ? s->tables[t].scale : s->tables[t].data;
            const mf_dio_file *f = &s->files[x->shard];
            uint64_t a = f->dio_align ? f->dio_align : 1;
            /* the tensor keeps its file offset modulo the alignment, so reads go straight in */
            uint8_t *dst = p + x->file_offset % a;
            if (w) s->tables[t].res_scale = dst;
            else s->tables[t].res_data = dst;
            uint64_t off = 0;
            while (off < x->n_bytes) {
                int n = 0;
                uint64_t batch0 = off;
                for (; n < s->max_greads && off < x->n_bytes; n++) {
                    uint64_t len = x->n_bytes - off;
                    /* chunk ends on an aligned file offset */
                    uint64_t end = (x->file_offset + off + MF_STORE_CHUNK_BYTES) / a * a - x->file_offset;
                    if (end > off && end - off < len) len = end - off;
                    s->greads[n] = (mf_io_read){.fd = f->fd, .offset = x->file_offset + off,
                                                .buf = dst + off, .n_bytes = len,
                                                .dio_align = f->dio_align};
                    off += len;
                }
                char what[4600];
                snprintf(what, sizeof what, "Engram table: reading %s from %s", x->name, f->path);
                int rc = mf_store_run_greads(s, n, what);
                if (rc) {
                    mf_progress_end(&pr);
                    return rc;
                }
                mf_progress_add(&pr, off - batch0);
            }
            p += mf_up(x->n_bytes, 4096) + 4096;
        }
    mf_progress_end(&pr);
    return 0;
}

static int mf_cmp_rowkey(const void *a, const void *b)
{
    const mf_rowkey *x = a, *y = b;
    return x->row < y->row ? -1 : x->row > y->row;
}

/* The plan in scratch for n rows: header, keys, unique indices, staging (codes, then scales). */
static mf_gplan *mf_gplan_carve(const mf_store *s, void *scratch, int n)
{
    uint8_t *p = scratch;
    mf_gplan *P = (mf_gplan *)p;
    p += mf_up(sizeof *P, 16);
    P->keys = (mf_rowkey *)p;
    p += mf_up((uint64_t)n * sizeof *P->keys, 16);
    P->uniq = (int32_t *)p;
    p += mf_up((uint64_t)n * sizeof *P->uniq, 16);
    P->stage_d = p;
    p += mf_up((uint64_t)n * s->max_row_bytes, 16);
    P->stage_s = p;
    P->n_max = n;
    return P;
}

uint64_t mf_store_gather_bytes(const mf_store *s, int n)
{
    uint64_t m = n > 0 ? (uint64_t)n : 0;
    return mf_up(sizeof(mf_gplan), 16) + mf_up(m * sizeof(mf_rowkey), 16) + mf_up(m * 4, 16) +
           mf_up(m * s->max_row_bytes, 16) + m * s->max_srow_bytes + 16;
}

static void mf_store_count(uint64_t *a, uint64_t *b, uint64_t v)
{
    __atomic_fetch_add(a, v, __ATOMIC_RELAXED);
    __atomic_fetch_add(b, v, __ATOMIC_RELAXED);
}

int mf_store_gather_reads(mf_store *s, int table, const int64_t *rows, int n, void *scratch,
                          mf_io_read *reads, int max_reads, int *n_reads)
{
    *n_reads = 0;
    table -= s->table0;   /* the callers' number (mf_store_layout.table0) */
    if (table < 0 || table >= s->n_tables || n < 0)
        return mf_error(-EINVAL, "Engram gather: table %d of %d, %d rows", table, s->n_tables, n);
    mf_store_table *T = &s->tables[table];
    for (int i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= T->rows)
            return mf_error(-EINVAL, "Engram gather: row %" PRId64 " of %s is outside [0, %" PRId64 ")",
                            rows[i], T->data->name, T->rows);
    mf_gplan *P = mf_gplan_carve(s, scratch, n);
    P->table = table;
    P->n = n;
    P->nu = 0;
    mf_store_count(&s->total.rows, &s->step.rows, (uint64_t)n);
    for (int i = 0; i < n; i++) P->keys[i] = (mf_rowkey){rows[i], i};
    if (T->res_data) return 0;   /* resident: mf_store_gather_copy copies from memory */
    if (max_reads < 2 * n)
        return mf_error(-EINVAL, "Engram gather: room for %d reads, %d rows may need %d", max_reads, n, 2 * n);
    uint64_t rb = T->row_bytes, sb = T->srow_bytes;
    const mf_dio_file *fd = &s->files[T->data->shard], *fs = &s->files[T->scale->shard];
    qsort(P->keys, (size_t)n, sizeof *P->keys, mf_cmp_rowkey);
    /* unique rows in order; runs of consecutive rows become one read per tensor */
    int nu = 0, nr = 0;
    int64_t run0 = -1, prev = -2;
    int u_run0 = 0;
    uint64_t bytes = 0;
    for (int i = 0; i <= n; i++) {
        int64_t r = i < n ? P->keys[i].row : -10;
        if (i < n && r == prev) {
            P->uniq[i] = nu - 1;
            continue;
        }
        if (i == n || r != prev + 1) {
            if (run0 >= 0) {   /* close the run [run0, prev] at unique index u_run0 */
                uint64_t cnt = (uint64_t)(prev - run0 + 1);
                reads[nr++] = (mf_io_read){.fd = fd->fd, .offset = T->data->file_offset + (uint64_t)run0 * rb,
                                           .buf = P->stage_d + (size_t)u_run0 * rb, .n_bytes = cnt * rb,
                                           .dio_align = fd->dio_align};
                if (sb)
                    reads[nr++] = (mf_io_read){.fd = fs->fd, .offset = T->scale->file_offset + (uint64_t)run0 * sb,
                                               .buf = P->stage_s + (size_t)u_run0 * sb, .n_bytes = cnt * sb,
                                               .dio_align = fs->dio_align};
            }
            run0 = r;
            u_run0 = nu;
        }
        if (i == n) break;
        P->uniq[i] = nu++;
        prev = r;
    }
    P->nu = nu;
    for (int i = 0; i < nr; i++) bytes += reads[i].n_bytes;
    mf_store_count(&s->total.row_bytes_read, &s->step.row_bytes_read, bytes);
    mf_store_count(&s->total.row_reads, &s->step.row_reads, (uint64_t)nr);
    *n_reads = nr;
    return 0;
}

void mf_store_gather_copy(const mf_store *s, const void *scratch, uint8_t *data, uint8_t *scale)
{
    const mf_gplan *P = scratch;
    const mf_store_table *T = &s->tables[P->table];
    uint64_t rb = T->row_bytes, sb = T->srow_bytes;
    for (int i = 0; i < P->n; i++) {
        int o = P->keys[i].idx;
        const uint8_t *d = T->res_data ? T->res_data + (uint64_t)P->keys[i].row * rb : P->stage_d + (size_t)P->uniq[i] * rb;
        const uint8_t *c = T->res_data ? T->res_scale + (uint64_t)P->keys[i].row * sb : P->stage_s + (size_t)P->uniq[i] * sb;
        memcpy(data + (size_t)o * rb, d, (size_t)rb);
        if (scale) memcpy(scale + (size_t)o * sb, c, (size_t)sb);
    }
}

int mf_store_gather_check(mf_store *s, int table)
{
    table -= s->table0;   /* the callers' number (mf_store_layout.table0) */
    if (table < 0 || table >= s->n_tables) return 0;
    const mf_dio_file *fd = &s->files[s->tables[table].data->shard], *fs = &s->files[s->tables[table].scale->shard];
    int c = mf_dio_check(fd);
    if (!c && fs != fd) c = mf_dio_check(fs);
    return c ? mf_error_wrap(c, "Engram gather of %s", s->tables[table].data->name) : 0;
}

int mf_store_gather(mf_store *s, int table, const int64_t *rows, int n, uint8_t *data, uint8_t *scale)
{
    table -= s->table0;   /* the callers' number (mf_store_layout.table0) */
    if (table < 0 || table >= s->n_tables || n < 0)
        return mf_error(-EINVAL, "Engram gather: table %d of %d, %d rows", table, s->n_tables, n);
    mf_store_table *T = &s->tables[table];
    uint64_t rb = T->row_bytes, sb = T->srow_bytes;
    const mf_dio_file *fd = &s->files[T->data->shard];
    if (T->res_data) {   /* copies from memory, no shared scratch: callers may run at once */
        for (int i = 0; i < n; i++)
            if (rows[i] < 0 || rows[i] >= T->rows)
                return mf_error(-EINVAL, "Engram gather: row %" PRId64 " of %s is outside [0, %" PRId64 ")",
                                rows[i], T->data->name, T->rows);
        mf_store_count(&s->total.rows, &s->step.rows, (uint64_t)n);
        for (int i = 0; i < n; i++) {
            memcpy(data + (size_t)i * rb, T->res_data + (uint64_t)rows[i] * rb, (size_t)rb);
            if (scale) memcpy(scale + (size_t)i * sb, T->res_scale + (uint64_t)rows[i] * sb, (size_t)sb);
        }
        return 0;
    }
    for (int i0 = 0; i0 < n; i0 += s->o.max_rows) {
        int m = n - i0 < s->o.max_rows ? n - i0 : s->o.max_rows, nr = 0;
        int rc = mf_store_gather_reads(s, table, rows + i0, m, s->gscratch, s->greads, s->max_greads, &nr);
        if (rc) return rc;
        if (nr) {
            char what[4600];
            snprintf(what, sizeof what, "Engram gather: reading %d rows of %s from %s", m, T->data->name, fd->path);
            int64_t t0 = mf_now_ns();
            rc = mf_store_run_greads(s, nr, what);
            s->total.read_wall_ns += mf_now_ns() - t0;
            s->step.read_wall_ns += mf_now_ns() - t0;
            if (rc) {
                int c = mf_store_gather_check(s, table);
                return c ? mf_error_wrap(c, "%s", "Engram gather") : rc;
            }
        }
        mf_store_gather_copy(s, s->gscratch, data + (size_t)i0 * rb, scale ? scale + (size_t)i0 * sb : NULL);
    }
    return 0;
}

/* ---- counters and facts ---------------------------------------------------------------------- */

/* The store's own counters with the policy's hits, misses and evictions. */
static void mf_store_stats_fill(mf_store_stats *out, const mf_store_stats *own, mf_resid_stats r)
{
    *out = *own;
    out->hits = r.hits;
    out->misses = r.misses;
    out->evictions = r.evictions;
}

void mf_store_stats_total(const mf_store *s, mf_store_stats *out)
{
    mf_resid_stats r;
    mf_resid_stats_total(s->res, &r);
    mf_store_stats_fill(out, &s->total, r);
}

void mf_store_step(mf_store *s, mf_store_stats *step)
{
    mf_resid_stats r;
    mf_resid_step(s->res, &r);
    if (step) mf_store_stats_fill(step, &s->step, r);
    memset(&s->step, 0, sizeof s->step);
}
int mf_store_n_slots(const mf_store *s) { return s->n_slots; }
int mf_store_max_batch(const mf_store *s) { return s->o.max_batch; }
int mf_store_n_parts(const mf_store *s) { return s->n_parts; }
uint64_t mf_store_slot_bytes(const mf_store *s) { return s->slot_bytes; }
uint64_t mf_store_slab_bytes(const mf_store *s) { return s->slab_bytes; }
const char *mf_store_io_engine(const mf_store *s) { return s->sched ? mf_sched_io_engine(s->sched) : s->io_engine; }
int mf_store_direct(const mf_store *s) { return s->direct; }
int mf_store_tables_streamed(const mf_store *s) { return s->n_tables > 0 && s->o.table_mode == MF_STORE_STREAMED; }

int mf_store_write_trace(const mf_store *s, const char *path)
{
    if (!s->traced) return mf_error(-EINVAL, "expert store: no run with compute to trace yet");
    int mk = mf_path_make_parent(path);
    if (mk) return mk;
    FILE *f = fopen(path, "w");
    if (!f) return mf_error(-errno, "%s: cannot create: %s", path, strerror(errno));
    /* Chrome trace events: one track per IO slot and one for the compute worker */
    mf_task_span *sp = mf_timeline_spans(s->tls[0]);
    fprintf(f, "{\"traceEvents\":[\n");
    int first = 1;
    for (int k = 0; k < s->b_n; k++)
        for (int j = -1; j < s->b_nreads[k]; j++) {   /* j = -1: the compute task */
            mf_task_id t = j < 0 ? s->g_cpu[k] : s->g_io[k * s->n_parts + j];
            const mf_task_desc *d = mf_graph_task(s->gs[0], t);
            if (sp[t].status != 0) continue;
            fprintf(f, "%s{\"name\":\"%s\",\"ph\":\"X\",\"pid\":0,\"tid\":\"%s.%d\",\"ts\":%.3f,"
                    "\"dur\":%.3f,\"args\":{\"layer\":%d,\"expert\":%d}}", first ? "" : ",\n", d->name,
                    s->lanes[d->lane].name, sp[t].worker, sp[t].start_ns / 1e3,
                    (sp[t].end_ns - sp[t].start_ns) / 1e3, s->b_layer, s->b_ids[k]);
            first = 0;
        }
    fprintf(f, "\n]}\n");
    if (fclose(f)) return mf_error(-EIO, "%s: write failed", path);
    return 0;
}
