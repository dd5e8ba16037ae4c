/* Loading a DeepSeek-V4.1 text checkpoint: config, supported-config check, the layout checked
 * tensor by tensor against the safetensors headers, one allocation for everything held in memory,
 * and per-layer weight views. Routed experts and Engram tables can stay on disk (lazy). */
#include "graphs/model/model.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "graphs/model/layout.h"
#include "host/hostmem.h"
#include "host/store.h"
#include "host/wmap.h"
#include "sched/error.h"
#include "sched/progress.h"

struct mf_model {
    char dir[4096];
    mf_config cfg;
    mf_st *st;
    mf_layout *layout;
    uint8_t *block;            /* every resident tensor, one allocation */
    uint64_t block_bytes;
    uint64_t *offset;          /* per layout tensor: offset in block, or UINT64_MAX when lazy */
    const mf_st_tensor **st_of;/* per layout tensor */
    int lazy;
    int draft;                 /* the draft's stages were loaded (mf_model_opts.load_draft) */
    mf_model_layer *layers;    /* n_layers, then the draft's stages when loaded */
    mf_weight *experts;        /* n_layers * n_routed * 3, then the draft's n_mtp * its experts * 3 */
    mf_weight embed, norm, head;
    mf_store *store;
    /* n_sockets > 1: the split matrices' tensors (codes, scales) in block order, each socket's
     * share of their rows (mf_model_bind_sockets); how many sockets' shares were bound */
    struct mf_model_region {
        uint64_t off, n_bytes;
        int64_t rows, w_rows, per;   /* the tensor's rows, its matrix's rows, matrix rows per row */
    } *reg;
    int n_reg, n_sock, n_bound;
    /* weights mapped from the page cache (mf_model_opts.weights): the mapping (m->block is its
     * base; tensors the file does not align are copied to its private tail, from copy_off); the
     * fallback to a streamed store when they exceed mem_bytes; the fill's counters */
    mf_wmap *wmap;
    int mapped, fell_back;
    uint64_t copy_off, map_bytes, copied_bytes, mem_bytes;
    mf_wmap_fill_stats fill;
};

#define MF_NO_OFFSET UINT64_MAX

static int mf_is_lazy_group(const mf_layout_tensor *t)
{
    return t->role == MF_ROLE_FP4_WEIGHT || t->role == MF_ROLE_FP4_SCALE ||
           t->role == MF_ROLE_TABLE || t->role == MF_ROLE_TABLE_SCALE;
}

static int mf_shape_str(char *buf, size_t n, int nd, const int64_t *s)
{
    int k = snprintf(buf, n, "[");
    for (int i = 0; i < nd && (size_t)k < n; i++)
        k += snprintf(buf + k, n - (size_t)k, "%s%" PRId64, i ? "," : "", s[i]);
    if ((size_t)k < n) k += snprintf(buf + k, n - (size_t)k, "]");
    return k;
}

/* Whether the load reads tensor t: the draft's only when asked for. */
static int mf_model_wants(const mf_model *m, const mf_layout_tensor *t)
{
    return t->group != MF_GROUP_MTP || m->draft;
}

/* Checks every layout tensor the load reads against the checkpoint; names up to 4 problems. */
static int mf_model_check_tensors(mf_model *m)
{
    int n = mf_layout_n(m->layout), n_missing = 0, n_bad = 0;
    char msg[800] = "";
    size_t used = 0;
    int named = 0;
    for (int i = 0; i < n; i++) {
        const mf_layout_tensor *t = mf_layout_at(m->layout, i);
        if (!mf_model_wants(m, t)) continue;
        const mf_st_tensor *s = mf_st_find(m->st, t->name);
        m->st_of[i] = s;
        char line[320] = "";
        if (!s) {
            n_missing++;
            snprintf(line, sizeof line, "tensor %s is missing (expected %s ", t->name, mf_dtype_name(t->dtype));
            mf_shape_str(line + strlen(line), sizeof line - strlen(line), t->n_dims, t->shape);
            strncat(line, ")", sizeof line - strlen(line) - 1);
        } else {
            int same = s->dtype == t->dtype && s->n_dims == t->n_dims;
            for (int d = 0; same && d < t->n_dims; d++) same = s->shape[d] == t->shape[d];
            if (!same) {
                n_bad++;
                char e[64], f[64];
                mf_shape_str(e, sizeof e, t->n_dims, t->shape);
                mf_shape_str(f, sizeof f, s->n_dims, s->shape);
                snprintf(line, sizeof line, "tensor %s: expected %s %s, found %s %s", t->name,
                         mf_dtype_name(t->dtype), e, mf_dtype_name(s->dtype), f);
            }
        }
        if (line[0] && named < 4 && used + strlen(line) + 3 < sizeof msg) {
            used += (size_t)snprintf(msg + used, sizeof msg - used, "%s%s", named ? "; " : "", line);
            named++;
        }
    }
    if (n_missing || n_bad)
        return mf_error(-EINVAL, "%s: checkpoint does not match the layout of its config.json: %d "
                        "tensor(s) missing, %d with the wrong dtype/shape: %s%s", m->dir, n_missing,
                        n_bad, msg, named < n_missing + n_bad ? "; ..." : "");
    return 0;
}

static int mf_bind(mf_model *m, mf_weight *w, mf_wkind kind, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Fills w from the layout tensors named by fmt (+ ".weight"/".scale" for fp8, fp4 and tables). */
static int mf_bind(mf_model *m, mf_weight *w, mf_wkind kind, const char *fmt, ...)
{
    char base[MF_LAYOUT_NAME_BYTES], dn[MF_LAYOUT_NAME_BYTES + 8], sn[MF_LAYOUT_NAME_BYTES + 8];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(base, sizeof base, fmt, ap);
    va_end(ap);
    int scaled = kind == MF_W_FP8 || kind == MF_W_FP4 || kind == MF_W_TABLE;
    if (scaled) {
        snprintf(dn, sizeof dn, "%s.weight", base);
        snprintf(sn, sizeof sn, "%s.scale", base);
    } else {
        snprintf(dn, sizeof dn, "%s", base);
    }
    int di = mf_layout_find(m->layout, dn), si = scaled ? mf_layout_find(m->layout, sn) : -1;
    if (di < 0 || (scaled && si < 0))   /* the layout and this binder disagree: a bug */
        return mf_error(-EINVAL, "model: layout has no tensor %s", scaled && di >= 0 ? sn : dn);
    const mf_layout_tensor *t = mf_layout_at(m->layout, di);
    memset(w, 0, sizeof *w);
    w->kind = kind;
    w->name = t->name;
    w->rows = t->shape[0];
    w->cols = t->n_dims > 1 ? t->shape[1] : 1;
    if (kind == MF_W_FP4) w->cols *= 2;
    w->st_data = m->st_of[di];
    w->data = m->offset[di] == MF_NO_OFFSET ? NULL : m->block + m->offset[di];
    if (scaled) {
        w->st_scale = m->st_of[si];
        w->scale = m->offset[si] == MF_NO_OFFSET ? NULL : m->block + m->offset[si];
    }
    w->block_rows = m->cfg.quant_block_out;
    w->block_cols = m->cfg.quant_block_in;
    return 0;
}

#define B(w, k, ...) do { if ((rc = mf_bind(m, (w), (k), __VA_ARGS__))) return rc; } while (0)

/* The weights of backbone layer L or draft stage L - n_layers, named below prefix pre
 * ("layers.L" or "mtp.s"); experts at *ex (the layer's count x 3). */
static int mf_model_bind_layer(mf_model *m, int L, const char *pre, mf_weight *ex)
{
    const mf_config *c = &m->cfg;
    mf_model_layer *y = &m->layers[L];
    int rc = 0;
    if (mf_config_engram_slot(c, L) >= 0) {
        B(&y->eg_table, MF_W_TABLE, "%s.engram.embed", pre);
        B(&y->eg_wkv, MF_W_FP8, "%s.engram.wkv", pre);
        B(&y->eg_q_weight, MF_W_BF16, "%s.engram.q_weight", pre);
        B(&y->eg_k_weight, MF_W_BF16, "%s.engram.k_weight", pre);
    }
    B(&y->hc_attn_fn, MF_W_F32, "%s.hc_attn_fn", pre);
    B(&y->hc_attn_base, MF_W_F32, "%s.hc_attn_base", pre);
    B(&y->hc_attn_scale, MF_W_F32, "%s.hc_attn_scale", pre);
    B(&y->attn_norm, MF_W_BF16, "%s.attn_norm.weight", pre);
    B(&y->wq_a, MF_W_FP8, "%s.attn.wq_a", pre);
    B(&y->q_norm, MF_W_BF16, "%s.attn.q_norm.weight", pre);
    B(&y->wq_b, MF_W_FP8, "%s.attn.wq_b", pre);
    B(&y->wkv, MF_W_FP8, "%s.attn.wkv", pre);
    B(&y->kv_norm, MF_W_BF16, "%s.attn.kv_norm.weight", pre);
    B(&y->wo_a, MF_W_FP8, "%s.attn.wo_a", pre);
    B(&y->wo_b, MF_W_FP8, "%s.attn.wo_b", pre);
    B(&y->attn_sink, MF_W_F32, "%s.attn.attn_sink", pre);
    if (L < c->n_layers && mf_config_is_kv_source(c, L)) {
        B(&y->cmp_wkv, MF_W_BF16, "%s.attn.compressor.wkv.weight", pre);
        if (c->compress_ratios[L] == 2) B(&y->cmp_wgate, MF_W_BF16, "%s.attn.compressor.wgate.weight", pre);
        B(&y->cmp_norm, MF_W_BF16, "%s.attn.compressor.norm.weight", pre);
        B(&y->idx_wk, MF_W_BF16, "%s.attn.indexer.wk.weight", pre);
        B(&y->idx_k_norm, MF_W_BF16, "%s.attn.indexer.k_norm.weight", pre);
    }
    if (L < c->n_layers && mf_config_is_index_source(c, L)) {
        B(&y->idx_wq_b, MF_W_FP8, "%s.attn.indexer.wq_b", pre);
        B(&y->idx_weights_proj, MF_W_BF16, "%s.attn.indexer.weights_proj.weight", pre);
    }
    B(&y->hc_ffn_fn, MF_W_F32, "%s.hc_ffn_fn", pre);
    B(&y->hc_ffn_base, MF_W_F32, "%s.hc_ffn_base", pre);
    B(&y->hc_ffn_scale, MF_W_F32, "%s.hc_ffn_scale", pre);
    B(&y->ffn_norm, MF_W_BF16, "%s.ffn_norm.weight", pre);
    B(&y->gate, MF_W_BF16, "%s.ffn.gate.weight", pre);
    B(&y->gate_bias, MF_W_F32, "%s.ffn.gate.bias", pre);
    B(&y->gate_bias_vl, MF_W_F32, "%s.ffn.gate.bias_vl", pre);
    if (c->n_shared_experts > 0) {
        B(&y->sh_w1, MF_W_FP8, "%s.ffn.shared_experts.w1", pre);
        B(&y->sh_w2, MF_W_FP8, "%s.ffn.shared_experts.w2", pre);
        B(&y->sh_w3, MF_W_FP8, "%s.ffn.shared_experts.w3", pre);
    }
    y->experts = ex;
    for (int e = 0; e < mf_config_layer_experts(c, L); e++)
        for (int k = 0; k < 3; k++) B(&y->experts[e * 3 + k], MF_W_FP4, "%s.ffn.experts.%d.w%d", pre, e, k + 1);
    return 0;
}

static int mf_model_bind_all(mf_model *m)
{
    const mf_config *c = &m->cfg;
    int rc = 0;
    char pre[32];
    B(&m->embed, MF_W_BF16, "embed.weight");
    B(&m->norm, MF_W_BF16, "norm.weight");
    B(&m->head, MF_W_BF16, "head.weight");
    for (int L = 0; L < c->n_layers; L++) {
        snprintf(pre, sizeof pre, "layers.%d", L);
        if ((rc = mf_model_bind_layer(m, L, pre, m->experts + (size_t)L * c->n_routed_experts * 3))) return rc;
    }
    for (int s = 0; m->draft && s < c->n_mtp_layers; s++) {
        int L = c->n_layers + s;
        mf_model_layer *y = &m->layers[L];
        snprintf(pre, sizeof pre, "mtp.%d", s);
        mf_weight *ex = m->experts + ((size_t)c->n_layers * c->n_routed_experts +
                                      (size_t)s * c->dspark_n_routed_experts) * 3;
        if ((rc = mf_model_bind_layer(m, L, pre, ex))) return rc;
        if (s == 0) {
            B(&y->main_proj, MF_W_FP8, "mtp.0.main_proj");
            B(&y->main_norm, MF_W_BF16, "mtp.0.main_norm.weight");
        }
        if (s == c->n_mtp_layers - 1) {
            B(&y->out_norm, MF_W_BF16, "%s.norm.weight", pre);
            B(&y->mk_embed, MF_W_BF16, "%s.markov_head.embed.weight", pre);
            B(&y->mk_head, MF_W_BF16, "%s.markov_head.head.weight", pre);
            B(&y->conf_proj, MF_W_BF16, "%s.confidence_head.proj.weight", pre);
        }
    }
    return 0;
}
#undef B

int mf_model_split_weights(const mf_model *m, int L, const mf_weight **out, int max)
{
    int n = 0;
    if (L < 0) {
        if (max > 0 && m->head.data) out[n++] = &m->head;
        return n;
    }
    const mf_model_layer *y = mf_model_layer_at(m, L);
    if (!y) return 0;
    const mf_weight *d[] = {&y->eg_wkv, &y->wq_a, &y->wkv, &y->cmp_wkv, &y->cmp_wgate, &y->idx_weights_proj,
                            &y->wq_b, &y->idx_wq_b, &y->wo_a, &y->wo_b, &y->gate, &y->sh_w1, &y->sh_w2, &y->sh_w3};
    for (size_t i = 0; i < sizeof d / sizeof d[0] && n < max; i++)
        if (d[i]->kind != MF_W_NONE && d[i]->data) out[n++] = d[i];
    for (int e = 0; e < 3 * m->cfg.n_routed_experts && n < max; e++)
        if (y->experts[e].data) out[n++] = &y->experts[e];
    return n;
}

static int mf_model_reg_cmp(const void *a, const void *b)
{
    const struct mf_model_region *x = a, *y = b;
    return x->off < y->off ? -1 : x->off > y->off;
}

/* The split matrices' tensors as regions of the block, in block order (mf_model_socket_of). */
static int mf_model_regions(mf_model *m)
{
    const mf_config *c = &m->cfg;
    int cap = 2 * (c->n_layers * (14 + 3 * c->n_routed_experts) + 1);
    const mf_weight **w = malloc(sizeof *w * (size_t)(16 + 3 * c->n_routed_experts));
    m->reg = malloc(sizeof *m->reg * (size_t)cap);
    if (!w || !m->reg) {
        free(w);
        return mf_error(-ENOMEM, "model: out of memory");
    }
    for (int L = -1; L < c->n_layers; L++) {
        int nw = mf_model_split_weights(m, L, w, 16 + 3 * c->n_routed_experts);
        for (int i = 0; i < nw && m->n_reg + 2 <= cap; i++)
            for (int q = 0; q < 2; q++) {
                const mf_st_tensor *t = q ? w[i]->st_scale : w[i]->st_data;
                const uint8_t *base = q ? w[i]->scale : w[i]->data;
                if (!t || !base || t->n_dims < 1 || t->shape[0] < 1) continue;
                /* an fp8 scale row covers a tile of block_rows matrix rows; fp4 scales a row each */
                int64_t per = q && w[i]->kind == MF_W_FP8 ? w[i]->block_rows : 1;
                m->reg[m->n_reg++] = (struct mf_model_region){.off = (uint64_t)(base - m->block), .n_bytes = t->n_bytes,
                                                              .rows = t->shape[0], .w_rows = w[i]->rows, .per = per};
            }
    }
    free(w);
    qsort(m->reg, (size_t)m->n_reg, sizeof *m->reg, mf_model_reg_cmp);
    return 0;
}

/* Region r's rows that socket k's share of its matrix covers, [*a, *b). */
static void mf_model_reg_rows(const mf_model *m, const struct mf_model_region *r, int k, int64_t *a, int64_t *b)
{
    int64_t r0, r1;
    mf_topo_rows(r->w_rows, m->n_sock, k, &r0, &r1);
    *a = (r0 + r->per - 1) / r->per;
    *b = (r1 + r->per - 1) / r->per;
    if (*b > r->rows) *b = r->rows;
    if (*a > *b) *a = *b;
}

/* n_sockets > 1: socket k's share of every split matrix bound to socket_node[k], page by page,
 * before the weights are read in (the reads' first touch then lands on each page's node): a page
 * belongs to the share holding its first byte (split tensors start on pages: mf_model_load). A
 * node that does not exist, or a refused binding, is a note (that socket's pages stay first
 * touch), not an error. */
/* range i of socket k's share: region i's rows of socket k (mf_topo_share_fn) */
static void mf_model_share(void *ctx, int k, int64_t i, uint64_t *x, uint64_t *y, int *first)
{
    const mf_model *m = ctx;
    const struct mf_model_region *r = &m->reg[i];
    int64_t a, b;
    mf_model_reg_rows(m, r, k, &a, &b);
    uint64_t rb = r->n_bytes / (uint64_t)r->rows;
    *x = r->off + (uint64_t)a * rb;
    *y = r->off + (uint64_t)b * rb;
    *first = a == 0;
}

static void mf_model_bind_sockets(mf_model *m, const mf_model_opts *o)
{
    m->n_bound = mf_topo_bind_shares(m->block, m->block_bytes, m->n_sock, o->socket_node, m->n_reg, mf_model_share, m,
                                     "model", "the dense weights' rows", o->quiet);
}

/* The last region starting at or before block offset off, or -1. */
static int mf_model_reg_at(const mf_model *m, uint64_t off)
{
    if (!m->n_reg || m->reg[0].off > off) return -1;
    int lo = 0, hi = m->n_reg;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (m->reg[mid].off <= off) lo = mid;
        else hi = mid;
    }
    return lo;
}

int mf_model_socket_of(const mf_model *m, const void *p)
{
    const uint8_t *q = p;
    if (m->n_sock < 2 || q < m->block || q >= m->block + m->block_bytes) return -1;
    uint64_t off = (uint64_t)(q - m->block);
    int lo = mf_model_reg_at(m, off);
    if (lo < 0 || off >= m->reg[lo].off + m->reg[lo].n_bytes) return -1;
    const struct mf_model_region *r = &m->reg[lo];
    int64_t row = (int64_t)((off - r->off) / (r->n_bytes / (uint64_t)r->rows));
    for (int k = 0; k < m->n_sock; k++) {
        int64_t a, b;
        mf_model_reg_rows(m, r, k, &a, &b);
        if (row >= a && row < b) return k;
    }
    return -1;
}

int mf_model_n_bound(const mf_model *m) { return m->n_bound; }

/* The store over the model's routed experts and Engram tables. */
static int mf_model_store_open(mf_model *m, const mf_model_opts *o)
{
    const mf_config *c = &m->cfg;
    size_t n = (size_t)c->n_layers * c->n_routed_experts * 6;
    const mf_st_tensor **parts = malloc((n + 1) * sizeof *parts);
    const mf_st_tensor *tables[2 * MF_CONFIG_MAX_ENGRAM];
    if (!parts) return mf_error(-ENOMEM, "model: out of memory");
    for (int L = 0; L < c->n_layers; L++)
        for (int e = 0; e < c->n_routed_experts; e++)
            for (int k = 0; k < 3; k++) {
                const mf_weight *w = &m->layers[L].experts[e * 3 + k];
                size_t i = ((size_t)L * c->n_routed_experts + e) * 6 + 2 * k;
                parts[i] = w->st_data;
                parts[i + 1] = w->st_scale;
            }
    int nt = 0;
    for (int L = 0; L < c->n_layers; L++)
        if (mf_config_engram_slot(c, L) >= 0) {
            tables[2 * nt] = m->layers[L].eg_table.st_data;
            tables[2 * nt + 1] = m->layers[L].eg_table.st_scale;
            nt++;
        }
    mf_store_layout lay = {.n_layers = c->n_layers, .n_experts = c->n_routed_experts, .n_parts = 6,
                           .parts = parts, .n_tables = nt, .tables = tables};
    int mode = o->store == MF_MODEL_STORE_STREAMED ? MF_STORE_STREAMED : MF_STORE_RESIDENT;
    int tmode = o->store_tables ? (o->store_tables == MF_MODEL_STORE_STREAMED ? MF_STORE_STREAMED
                                                                              : MF_STORE_RESIDENT)
                                : mode;
    mf_store_opts so = {.mode = mode, .table_mode = tmode, .budget_bytes = o->store_budget_bytes,
                        .io_depth = o->store_io_depth, .numa_node = -1, .quiet = o->quiet,
                        .force_pread = o->store_io_pread, .io_fault_kind = o->store_io_fault_kind,
                        .io_fault_nth = o->store_io_fault_nth,
                        /* a call names up to a layer's experts (the scheduled engine's slots of a
                         * batch); the budget must hold at least one token's */
                        .max_batch = c->n_routed_experts > 16 ? c->n_routed_experts : 16,
                        .min_slots = c->n_experts_per_tok, .n_sockets = o->n_sockets};
    memcpy(so.socket_node, o->socket_node, sizeof so.socket_node);
    int rc = mf_store_create(m->st, &lay, &so, &m->store);
    free(parts);
    return rc ? mf_error_wrap(rc, "model %s", m->dir) : 0;
}

/* Where the weights go: nothing lazy when mapped (unless they exceed the memory: then the routed
 * experts and Engram tables go to a streamed store, m->fell_back), else lazy above the limit or
 * with a store. o->store may be set here. */
static void mf_model_plan(mf_model *m, mf_model_opts *o)
{
    uint64_t lazy_bytes = 0, all_bytes = 0;
    for (int i = 0; i < mf_layout_n(m->layout); i++) {
        const mf_layout_tensor *t = mf_layout_at(m->layout, i);
        if (!mf_model_wants(m, t)) continue;
        all_bytes += t->n_bytes;
        if (mf_is_lazy_group(t)) lazy_bytes += t->n_bytes;
    }
    uint64_t limit = o->resident_limit_bytes ? o->resident_limit_bytes : (UINT64_C(4) << 30);
    int all_lazy = o->resident_limit_bytes == MF_MODEL_ALL_LAZY;
    m->mapped = o->weights == MF_MODEL_WEIGHTS_MAPPED;
    if (m->mapped && !o->store && !all_lazy) {
        uint64_t avail = 0, total = 0;
        if (mf_wmap_meminfo(&avail, &total)) avail = total = UINT64_MAX;   /* unknown: assume they fit */
        m->mem_bytes = o->map_mem_bytes ? o->map_mem_bytes : avail > total / 32 ? avail - total / 32 : 0;
        if (all_bytes > m->mem_bytes) {   /* larger than memory: the experts and tables streamed */
            o->store = MF_MODEL_STORE_STREAMED;
            m->fell_back = 1;
        }
    }
    mf_error_clear();
    m->lazy = m->mapped ? o->store || all_lazy : lazy_bytes > limit || all_lazy || o->store;
}

/* The copy: every tensor the load reads in one allocation of the model's (2 MiB pages where the
 * kernel allows: the head and experts are streamed every step), read with pread after the views
 * are made and, with sockets, the split matrices' shares bound. */
static int mf_model_place_copied(mf_model *m, const mf_model_opts *o)
{
    int n = mf_layout_n(m->layout), rc;
    uint64_t total = 0;
    /* split across sockets: every tensor on its own pages (each page's node is one share's) */
    uint64_t align = m->n_sock > 1 ? (uint64_t)sysconf(_SC_PAGESIZE) : 64;
    for (int i = 0; i < n; i++) {
        const mf_layout_tensor *t = mf_layout_at(m->layout, i);
        if ((m->lazy && mf_is_lazy_group(t)) || !mf_model_wants(m, t)) {
            m->offset[i] = MF_NO_OFFSET;
            continue;
        }
        /* a routed expert's parts (layout order: w1 codes, scales, w2 ..., w3 ...) one after another
         * at the card slot's part alignment, so that a card's cache miss copies them as one span
         * (graphs/step/step_moe_cards.c mf_step_xslot_layout) */
        uint64_t a = mf_is_lazy_group(t) && align < MF_MODEL_EXPERT_ALIGN ? MF_MODEL_EXPERT_ALIGN : align;
        total = (total + a - 1) / a * a;
        m->offset[i] = total;
        total += t->n_bytes;
    }
    total = (total + align - 1) / align * align;
    m->block_bytes = total;
    m->block = mf_hostmem_map(total, 1);
    if (!m->block)
        return mf_error(-ENOMEM, "model: cannot allocate %" PRIu64 " bytes for the resident weights of %s",
                        total, m->dir);
    /* the views first: with sockets, the split matrices' shares are bound before the reads */
    if ((rc = mf_model_bind_all(m))) return rc;
    if (m->n_sock > 1) {
        if ((rc = mf_model_regions(m))) return rc;
        mf_model_bind_sockets(m, o);
    }
    mf_progress pr;
    mf_progress_begin(&pr, "load", total, 1, o->quiet);
    for (int i = 0; i < n && !rc; i++) {
        if (m->offset[i] == MF_NO_OFFSET) continue;
        const mf_layout_tensor *t = mf_layout_at(m->layout, i);
        rc = mf_st_read(m->st, m->st_of[i], 0, m->block + m->offset[i], t->n_bytes);
        mf_progress_add(&pr, t->n_bytes);
    }
    mf_progress_end(&pr);
    return rc;
}

/* Whether tensor t's bytes at its file offset are aligned for its element type (a view of them is
 * then a valid C array; the released and generated layouts align every tensor). */
static int mf_model_aligned(const mf_st_tensor *t)
{
    int bits = mf_dtype_bits(t->dtype);
    uint64_t el = bits >= 16 ? (uint64_t)bits / 8 : 1;
    return t->file_offset % el == 0;
}

/* The ranges of the mapping the load faults in: every tensor it reads, with sockets each split
 * matrix's share for that socket's threads (a page belongs to the share holding its first byte). */
static int mf_model_map_ranges(const mf_model *m, mf_wmap_range **out, int *n_out)
{
    int n = mf_layout_n(m->layout), k = 0;
    mf_wmap_range *r = malloc(sizeof *r * ((size_t)n + (size_t)m->n_reg * (size_t)m->n_sock + 1));
    if (!r) return mf_error(-ENOMEM, "model: out of memory");
    uint64_t pg = (uint64_t)sysconf(_SC_PAGESIZE);
    for (int i = 0; i < n; i++) {
        if (m->offset[i] == MF_NO_OFFSET || m->offset[i] >= m->copy_off) continue;
        int g = m->n_sock > 1 ? mf_model_reg_at(m, m->offset[i]) : -1;
        if (g < 0 || m->reg[g].off != m->offset[i]) {
            r[k++] = (mf_wmap_range){m->offset[i], mf_layout_at(m->layout, i)->n_bytes, -1};
            continue;
        }
        for (int s = 0; s < m->n_sock; s++) {
            uint64_t a, b;
            int first;
            mf_model_share((void *)m, s, g, &a, &b, &first);
            mf_topo_share_pages(&a, &b, first, pg);
            if (b > a) r[k++] = (mf_wmap_range){a, b - a, s};
        }
    }
    *out = r;
    *n_out = k;
    return 0;
}

/* Mapped: the shards mapped from the page cache (host/wmap.h), every tensor the load reads a view
 * of its bytes there, except those the file does not align for their type: copied into the
 * mapping's private tail. Then the views, the sockets' regions, and the fill (warm: only mapped;
 * cold: read at the disk's rate, each socket's shares by threads bound to its node). */
static int mf_model_place_mapped(mf_model *m, const mf_model_opts *o)
{
    int n = mf_layout_n(m->layout), rc;
    uint64_t copy = 0;
    for (int i = 0; i < n; i++) {
        const mf_layout_tensor *t = mf_layout_at(m->layout, i);
        int used = mf_model_wants(m, t) && !(m->lazy && mf_is_lazy_group(t));
        if (used && !mf_model_aligned(m->st_of[i])) copy += (t->n_bytes + 63) / 64 * 64;
    }
    if ((rc = mf_wmap_open(m->st, copy, &m->wmap))) return rc;
    m->block = mf_wmap_base(m->wmap);
    m->block_bytes = mf_wmap_bytes(m->wmap);
    m->copy_off = mf_wmap_copy_off(m->wmap);
    uint64_t cpos = m->copy_off;
    for (int i = 0; i < n; i++) {
        const mf_layout_tensor *t = mf_layout_at(m->layout, i);
        if ((m->lazy && mf_is_lazy_group(t)) || !mf_model_wants(m, t)) {
            m->offset[i] = MF_NO_OFFSET;
        } else if (mf_model_aligned(m->st_of[i])) {
            m->offset[i] = mf_wmap_tensor_off(m->wmap, m->st_of[i]);
            m->map_bytes += t->n_bytes;
        } else {
            m->offset[i] = cpos;
            cpos += (t->n_bytes + 63) / 64 * 64;
        }
    }
    m->copied_bytes = copy;
    if ((rc = mf_model_bind_all(m))) return rc;
    if (m->n_sock > 1 && (rc = mf_model_regions(m))) return rc;
    mf_wmap_range *r = NULL;
    int nr = 0;
    if ((rc = mf_model_map_ranges(m, &r, &nr))) return rc;
    rc = mf_wmap_fill(m->wmap, r, nr, &(mf_wmap_fill_opts){.n_threads = o->map_threads, .n_sockets = m->n_sock,
                                                          .socket_node = o->socket_node, .quiet = o->quiet},
                      &m->fill);
    free(r);
    m->n_bound = m->fill.n_bound;
    for (int i = 0; i < n && !rc; i++)
        if (m->offset[i] != MF_NO_OFFSET && m->offset[i] >= m->copy_off)
            rc = mf_st_read(m->st, m->st_of[i], 0, m->block + m->offset[i], m->st_of[i]->n_bytes);
    return rc;
}

int mf_model_load(const char *dir, const mf_model_opts *opts, mf_model **out)
{
    *out = NULL;
    mf_model_opts o = {0};
    if (opts) o = *opts;
    mf_model *m = calloc(1, sizeof *m);
    if (!m) return mf_error(-ENOMEM, "model: out of memory");
    snprintf(m->dir, sizeof m->dir, "%s", dir);
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    int rc = mf_config_load(path, &m->cfg);
    if (!rc && o.load_draft && m->cfg.n_mtp_layers == 0)
        rc = mf_error(-EINVAL, "%s: the DSpark draft was asked for, but the config has no draft stages "
                      "(num_nextn_predict_layers 0)", path);
    if (!rc) rc = mf_st_open(dir, &m->st);
    if (!rc) rc = mf_layout_build(&m->cfg, &m->layout);
    if (rc) goto fail;
    m->draft = o.load_draft != 0;
    int n = mf_layout_n(m->layout), n_draft = m->draft ? m->cfg.n_mtp_layers : 0;
    m->offset = calloc((size_t)n, sizeof *m->offset);
    m->st_of = calloc((size_t)n, sizeof *m->st_of);
    m->layers = calloc((size_t)(m->cfg.n_layers + n_draft), sizeof *m->layers);
    m->experts = calloc(((size_t)m->cfg.n_layers * m->cfg.n_routed_experts +
                         (size_t)n_draft * m->cfg.dspark_n_routed_experts) * 3, sizeof *m->experts);
    if (!m->offset || !m->st_of || !m->layers || !m->experts) {
        rc = mf_error(-ENOMEM, "model: out of memory for %d tensor entries", n);
        goto fail;
    }
    if ((rc = mf_model_check_tensors(m))) goto fail;
    mf_model_plan(m, &o);
    m->n_sock = o.n_sockets > MF_TOPO_MAX_SOCKETS ? MF_TOPO_MAX_SOCKETS : o.n_sockets > 1 ? o.n_sockets : 1;
    m->copy_off = UINT64_MAX;
    rc = m->mapped ? mf_model_place_mapped(m, &o) : mf_model_place_copied(m, &o);
    if (rc) goto fail;
    if (o.store && (rc = mf_model_store_open(m, &o))) goto fail;
    *out = m;
    return 0;
fail:
    mf_model_free(m);
    return rc;
}

void mf_model_weights_info(const mf_model *m, mf_model_weights *out)
{
    *out = (mf_model_weights){.mapped = m->mapped, .fell_back = m->fell_back, .mem_bytes = m->mem_bytes,
                              .map_bytes = m->map_bytes, .cached_bytes = m->fill.cached_bytes,
                              .copied_bytes = m->copied_bytes, .fill_ns = m->fill.wall_ns,
                              .fill_threads = m->fill.n_threads};
}

void mf_model_free(mf_model *m)
{
    if (!m) return;
    mf_store_destroy(m->store);
    if (m->wmap) mf_wmap_close(m->wmap);
    else mf_hostmem_unmap(m->block, m->block_bytes, 1);
    free(m->offset);
    free(m->st_of);
    free(m->layers);
    free(m->experts);
    free(m->reg);
    mf_layout_free(m->layout);
    mf_st_close(m->st);
    free(m);
}

const mf_config *mf_model_config(const mf_model *m) { return &m->cfg; }
const mf_model_layer *mf_model_layer_at(const mf_model *m, int layer)
{
    int n = m->cfg.n_layers + (m->draft ? m->cfg.n_mtp_layers : 0);
    return layer >= 0 && layer < n ? &m->layers[layer] : NULL;
}
int mf_model_has_draft(const mf_model *m) { return m->draft; }
const mf_weight *mf_model_embed(const mf_model *m) { return &m->embed; }
const mf_weight *mf_model_norm(const mf_model *m) { return &m->norm; }
const mf_weight *mf_model_head(const mf_model *m) { return &m->head; }
const char *mf_model_dir(const mf_model *m) { return m->dir; }
int mf_model_is_lazy(const mf_model *m) { return m->lazy; }
struct mf_store *mf_model_store(const mf_model *m) { return m->store; }
uint64_t mf_model_resident_bytes(const mf_model *m) { return m->block_bytes; }

uint64_t mf_weight_data_bytes(const mf_weight *w) { return w->st_data ? w->st_data->n_bytes : 0; }
uint64_t mf_weight_scale_bytes(const mf_weight *w) { return w->st_scale ? w->st_scale->n_bytes : 0; }

int mf_model_weight_read(const mf_model *m, const mf_weight *w, int64_t row0, int64_t n_rows,
                         uint8_t *data, uint8_t *scale)
{
    if (row0 < 0 || n_rows < 0 || row0 + n_rows > w->rows)
        return mf_error(-EINVAL, "%s: rows [%" PRId64 ", %" PRId64 ") out of [0, %" PRId64 ")",
                        w->name, row0, row0 + n_rows, w->rows);
    if (w->kind == MF_W_FP8 && (row0 != 0 || n_rows != w->rows))
        return mf_error(-EINVAL, "%s: fp8 weights are read whole", w->name);
    uint64_t drow = w->st_data->n_bytes / (uint64_t)(w->rows ? w->rows : 1);
    int rc;
    if (w->data) memcpy(data, w->data + (uint64_t)row0 * drow, (size_t)(drow * (uint64_t)n_rows));
    else if ((rc = mf_st_read(m->st, w->st_data, (uint64_t)row0 * drow, data, (size_t)(drow * (uint64_t)n_rows))))
        return rc;
    if (scale && w->st_scale) {
        if (w->kind == MF_W_FP8) {
            if (w->scale) memcpy(scale, w->scale, (size_t)w->st_scale->n_bytes);
            else if ((rc = mf_st_read(m->st, w->st_scale, 0, scale, (size_t)w->st_scale->n_bytes))) return rc;
        } else {
            uint64_t srow = w->st_scale->n_bytes / (uint64_t)w->rows;
            if (w->scale) memcpy(scale, w->scale + (uint64_t)row0 * srow, (size_t)(srow * (uint64_t)n_rows));
            else if ((rc = mf_st_read(m->st, w->st_scale, (uint64_t)row0 * srow, scale,
                                      (size_t)(srow * (uint64_t)n_rows))))
                return rc;
        }
    }
    return 0;
}
