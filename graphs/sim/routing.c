/* Routing for simulation (graphs/sim/routing.h): uniform and Zipf draws from per-layer random streams
 * (so a token's routes do not depend on how tokens are batched), draws with temporal locality per
 * sequence (each of a token's picks reuses one of its sequence's recent experts with a set
 * probability, calibrated to the seed's measured FIFO misses), replay of recorded traces, and
 * the recorder that `moeflow decode --record-routing` feeds from the reference's on_route hook.
 * Trace format (text): a header line `moeflow-routing 1 layers L experts E top_k K`, then one
 * line per record `seq pos layer e0 .. e(K-1)`; `#` lines are comments. */
#include "graphs/sim/routing.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sched/error.h"
#include "sched/path.h"

typedef enum { MF_ROUTE_UNIFORM, MF_ROUTE_ZIPF, MF_ROUTE_TRACE, MF_ROUTE_LOCAL } mf_route_kind;

#define MF_LOCAL_MAX_W 1024   /* the recency window of local routing, at most */

struct mf_routing {
    mf_route_kind kind;
    int n_layers, n_experts, top_k;
    char desc[320];
    uint64_t *rng;           /* one stream per layer */
    /* zipf */
    double s;
    int32_t *rank_expert;    /* [layer][rank] -> expert */
    double *weight;          /* [rank] = 1 / (rank + 1)^s */
    double weight_sum;
    uint8_t *taken;          /* [rank] scratch */
    /* trace */
    int64_t n_tokens, next_token;
    int32_t *trace;          /* [token][layer][k] */
    /* local: per (layer, sequence) the w most recently used distinct experts, newest first */
    double p_reuse;
    int w;
    int n_seq;               /* sequences with a history so far */
    int32_t *mru;            /* [layer][seq][w] */
    int *mru_n;              /* [layer][seq] */
};

/* ---- random streams -------------------------------------------------------------------------- */

static uint64_t mf_splitmix(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double mf_rand01(uint64_t *x) { return (double)(mf_splitmix(x) >> 11) * 0x1.0p-53; }

static int mf_rand_below(uint64_t *x, int n)
{
    return (int)(((unsigned __int128)mf_splitmix(x) * (unsigned)n) >> 64);
}

/* The start of stream `tag` of layer `layer` under `seed`. */
static uint64_t mf_stream(uint64_t seed, int layer, uint64_t tag)
{
    uint64_t x = seed ^ (0xd1b54a32d192ed03ull * (uint64_t)(layer + 1)) ^ (tag << 56);
    mf_splitmix(&x);
    return mf_splitmix(&x);
}

/* ---- traces ---------------------------------------------------------------------------------- */

#define MF_TRACE_MAGIC "moeflow-routing"

typedef struct mf_tok_slot {
    int seq;
    int64_t pos;
    int64_t token;     /* index into the token list; -1: empty slot */
} mf_tok_slot;

/* A trace being read: per token (in order of first appearance) its routes tr[token][layer][k],
 * which layers it has (have: a bit per layer, words per token; n_have), the line it first
 * appeared on; an open-addressing table from (seq, pos) to the newest token of that key. */
typedef struct mf_trace_rd {
    const char *path;
    int L, E, K;
    int64_t cap_tok, n_tok;
    int32_t *tr;
    uint64_t *have;
    size_t words;
    int *n_have;
    int64_t *first_line;
    mf_tok_slot *slots;
    size_t n_slots;
} mf_trace_rd;

static size_t mf_trace_hash(int seq, int64_t pos, size_t n_slots)
{
    uint64_t k = (uint64_t)seq * 0x9e3779b97f4a7c15ull ^ (uint64_t)pos * 0xc2b2ae3d27d4eb4full;
    return (size_t)(k ^ (k >> 29)) & (n_slots - 1);
}

/* The header line s: format version 1 and the routing's layers, experts and top-k. */
static int mf_trace_header(const mf_trace_rd *rd, const char *s, int64_t lineno)
{
    int v, fl, fe, fk, n = 0, L = rd->L, E = rd->E, K = rd->K;
    if (sscanf(s, MF_TRACE_MAGIC " %d layers %d experts %d top_k %d %n", &v, &fl, &fe, &fk, &n) != 4 || s[n] != '\0')
        return mf_error(-EINVAL, "%s:%" PRId64 ": expected the header '" MF_TRACE_MAGIC
                        " 1 layers L experts E top_k K': not a routing trace", rd->path, lineno);
    if (v != 1)
        return mf_error(-EINVAL, "%s:%" PRId64 ": trace format version %d, expected 1", rd->path, lineno, v);
    if (fl != L || fe != E || fk != K) {
        char diff[160] = "";
        size_t m = 0;
        if (fl != L) m += (size_t)snprintf(diff + m, sizeof diff - m, " layers %d (expected %d)", fl, L);
        if (fe != E) m += (size_t)snprintf(diff + m, sizeof diff - m, " experts %d (expected %d)", fe, E);
        if (fk != K) m += (size_t)snprintf(diff + m, sizeof diff - m, " top_k %d (expected %d)", fk, K);
        return mf_error(-EINVAL, "%s: the trace was recorded for another model: differs in%s", rd->path, diff);
    }
    return 0;
}

/* A record line s, `seq pos layer e0 .. e(K-1)`, into vals[3 + K]: integers, seq and pos >= 0,
 * the layer and the experts in range, no expert twice. */
static int mf_trace_record(const mf_trace_rd *rd, char *s, int64_t lineno, long long *vals)
{
    int K = rd->K, n_vals = 0;
    char *p = s, *end;
    for (;;) {
        while (*p == ' ' || *p == '\t') p++;
        if (*p == '\n' || *p == '\r' || *p == '\0') break;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || errno || (*end && !isspace((unsigned char)*end)))
            return mf_error(-EINVAL, "%s:%" PRId64 ": expected integers 'seq pos layer' and %d experts, "
                            "found '%.*s'", rd->path, lineno, K, (int)strcspn(p, " \t\r\n"), p);
        if (n_vals == 3 + K) { n_vals++; break; }
        vals[n_vals++] = v;
        p = end;
    }
    if (n_vals != 3 + K)
        return mf_error(-EINVAL, "%s:%" PRId64 ": expected 'seq pos layer' and %d experts (%d numbers), "
                        "found %s%d", rd->path, lineno, K, 3 + K, n_vals > 3 + K ? "more than " : "",
                        n_vals > 3 + K ? 3 + K : n_vals);
    if (vals[0] < 0 || vals[0] > INT32_MAX || vals[1] < 0 || vals[2] < 0 || vals[2] >= rd->L)
        return mf_error(-EINVAL, "%s:%" PRId64 ": seq %lld pos %lld layer %lld: expected seq, pos >= 0 "
                        "and layer in [0, %d)", rd->path, lineno, vals[0], vals[1], vals[2], rd->L);
    for (int j = 0; j < K; j++) {
        if (vals[3 + j] < 0 || vals[3 + j] >= rd->E)
            return mf_error(-EINVAL, "%s:%" PRId64 ": expert %lld out of range [0, %d)", rd->path, lineno,
                            vals[3 + j], rd->E);
        for (int i = 0; i < j; i++)
            if (vals[3 + i] == vals[3 + j])
                return mf_error(-EINVAL, "%s:%" PRId64 ": expert %lld chosen twice in one record", rd->path,
                                lineno, vals[3 + j]);
    }
    return 0;
}

/* Room for twice the tokens. 0 or -ENOMEM. */
static int mf_trace_grow(mf_trace_rd *rd)
{
    int64_t cap = rd->cap_tok * 2;
    int32_t *ntr = realloc(rd->tr, (size_t)cap * rd->L * rd->K * sizeof *ntr);
    if (ntr) rd->tr = ntr;
    uint64_t *nh = realloc(rd->have, (size_t)cap * rd->words * sizeof *nh);
    if (nh) rd->have = nh;
    int *nn = realloc(rd->n_have, (size_t)cap * sizeof *nn);
    if (nn) rd->n_have = nn;
    int64_t *nf = realloc(rd->first_line, (size_t)cap * sizeof *nf);
    if (nf) rd->first_line = nf;
    if (!ntr || !nh || !nn || !nf)
        return mf_error(-ENOMEM, "%s: out of memory at %" PRId64 " tokens", rd->path, rd->n_tok);
    rd->cap_tok = cap;
    return 0;
}

/* The (seq, pos) table four times larger, the newest token per key kept. 0 or -ENOMEM. */
static int mf_trace_rehash(mf_trace_rd *rd)
{
    size_t nn_slots = rd->n_slots * 4;
    mf_tok_slot *ns = malloc(nn_slots * sizeof *ns);
    if (!ns) return mf_error(-ENOMEM, "%s: out of memory", rd->path);
    for (size_t i = 0; i < nn_slots; i++) ns[i].token = -1;
    for (size_t i = 0; i < rd->n_slots; i++) {
        if (rd->slots[i].token < 0) continue;
        size_t g = mf_trace_hash(rd->slots[i].seq, rd->slots[i].pos, nn_slots);
        while (ns[g].token >= 0) g = (g + 1) & (nn_slots - 1);
        ns[g] = rd->slots[i];
    }
    free(rd->slots);
    rd->slots = ns;
    rd->n_slots = nn_slots;
    return 0;
}

/* The open token of (seq, pos) into *t, or a new one (first seen on lineno) when there is none or
 * that token already has every layer. 0 or -ENOMEM. */
static int mf_trace_token(mf_trace_rd *rd, int seq, int64_t pos, int64_t lineno, int64_t *t)
{
    size_t h = mf_trace_hash(seq, pos, rd->n_slots);
    while (rd->slots[h].token >= 0 && !(rd->slots[h].seq == seq && rd->slots[h].pos == pos))
        h = (h + 1) & (rd->n_slots - 1);
    *t = rd->slots[h].token;
    if (*t >= 0 && rd->n_have[*t] == rd->L) *t = -1;   /* that token is complete: the same (seq, pos) again */
    if (*t >= 0) return 0;
    int rc = rd->n_tok == rd->cap_tok ? mf_trace_grow(rd) : 0;
    if (rc) return rc;
    *t = rd->n_tok++;
    memset(rd->have + *t * (int64_t)rd->words, 0, rd->words * sizeof *rd->have);
    rd->n_have[*t] = 0;
    rd->first_line[*t] = lineno;
    int fresh = rd->slots[h].token < 0;
    rd->slots[h] = (mf_tok_slot){.seq = seq, .pos = pos, .token = *t};
    if (fresh && (size_t)rd->n_tok * 2 > rd->n_slots) return mf_trace_rehash(rd);
    return 0;
}

/* Record vals (mf_trace_record's, first seen on lineno) into its token. */
static int mf_trace_add(mf_trace_rd *rd, const long long *vals, int64_t lineno)
{
    int seq = (int)vals[0], layer = (int)vals[2], K = rd->K;
    int64_t pos = vals[1], t;
    int rc = mf_trace_token(rd, seq, pos, lineno, &t);
    if (rc) return rc;
    uint64_t *hv = rd->have + t * (int64_t)rd->words;
    if (hv[layer / 64] >> (layer % 64) & 1)
        return mf_error(-EINVAL, "%s:%" PRId64 ": seq %d pos %" PRId64 " layer %d recorded twice", rd->path,
                        lineno, seq, pos, layer);
    hv[layer / 64] |= 1ull << (layer % 64);
    rd->n_have[t]++;
    for (int j = 0; j < K; j++) rd->tr[(t * rd->L + layer) * K + j] = (int32_t)vals[3 + j];
    return 0;
}

/* The whole trace read: a header, tokens, every token with every layer. */
static int mf_trace_complete(const mf_trace_rd *rd, int header)
{
    if (!header) return mf_error(-EINVAL, "%s: empty: no '" MF_TRACE_MAGIC "' header", rd->path);
    if (rd->n_tok == 0) return mf_error(-EINVAL, "%s: the trace holds no tokens", rd->path);
    for (int64_t t = 0; t < rd->n_tok; t++)
        if (rd->n_have[t] != rd->L) {
            int miss = 0;
            while (rd->have[t * (int64_t)rd->words + miss / 64] >> (miss % 64) & 1) miss++;
            return mf_error(-EINVAL, "%s:%" PRId64 ": the token first recorded here has %d of %d layers "
                            "(layer %d missing)", rd->path, rd->first_line[t], rd->n_have[t], rd->L, miss);
        }
    return 0;
}

/* Reads a whole trace into r->trace (tokens in order of first appearance). */
static int mf_trace_load(mf_routing *r, const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        int e = errno;
        return mf_error(-e, "%s: cannot open routing trace: %s", path, strerror(e));
    }
    int L = r->n_layers, rc = 0, header = 0;
    mf_trace_rd rd = {.path = path, .L = L, .E = r->n_experts, .K = r->top_k, .cap_tok = 64, .n_slots = 1024,
                      .words = (size_t)(L + 63) / 64};
    rd.tr = malloc((size_t)rd.cap_tok * L * rd.K * sizeof *rd.tr);
    rd.have = calloc((size_t)rd.cap_tok * rd.words, sizeof *rd.have);   /* layers recorded */
    rd.n_have = calloc((size_t)rd.cap_tok, sizeof *rd.n_have);
    rd.first_line = malloc((size_t)rd.cap_tok * sizeof *rd.first_line);
    rd.slots = malloc(rd.n_slots * sizeof *rd.slots);
    char *line = NULL;
    size_t line_cap = 0;
    int64_t lineno = 0;
    if (!rd.tr || !rd.have || !rd.n_have || !rd.first_line || !rd.slots)
        rc = mf_error(-ENOMEM, "%s: out of memory", path);
    for (size_t i = 0; !rc && i < rd.n_slots; i++) rd.slots[i].token = -1;
    while (!rc && getline(&line, &line_cap, f) >= 0) {
        lineno++;
        char *s = line;
        while (isspace((unsigned char)*s)) s++;
        if (!*s || *s == '#') continue;
        long long vals[3 + 256];
        if (!header) rc = mf_trace_header(&rd, s, lineno), header = !rc;
        else if (!(rc = mf_trace_record(&rd, s, lineno, vals))) rc = mf_trace_add(&rd, vals, lineno);
    }
    if (!rc && ferror(f)) rc = mf_error(-EIO, "%s: read failed", path);
    if (!rc) rc = mf_trace_complete(&rd, header);
    if (!rc) {
        r->trace = rd.tr;
        rd.tr = NULL;
        r->n_tokens = rd.n_tok;
    }
    free(rd.tr);
    free(rd.have);
    free(rd.n_have);
    free(rd.first_line);
    free(rd.slots);
    free(line);
    fclose(f);
    return rc;
}

/* ---- opening and drawing --------------------------------------------------------------------- */

int mf_routing_open(const char *spec, int n_layers, int n_experts, int top_k, uint64_t seed,
                    mf_routing **out)
{
    *out = NULL;
    if (!spec) return mf_error(-EINVAL, "routing: no spec (uniform, zipf:S, local[:P[:W]] or trace:PATH)");
    if (n_layers < 1 || n_experts < 1 || top_k < 1 || top_k > n_experts || top_k > 256)
        return mf_error(-EINVAL, "routing '%s': expected layers >= 1 and 1 <= top_k <= experts (and <= 256), "
                        "found %d layers, %d experts, top_k %d", spec, n_layers, n_experts, top_k);
    mf_routing *r = calloc(1, sizeof *r);
    if (!r) return mf_error(-ENOMEM, "routing: out of memory");
    r->n_layers = n_layers;
    r->n_experts = n_experts;
    r->top_k = top_k;
    int rc = 0;
    if (strcmp(spec, "uniform") == 0) {
        r->kind = MF_ROUTE_UNIFORM;
        snprintf(r->desc, sizeof r->desc, "uniform");
    } else if (strncmp(spec, "zipf:", 5) == 0) {
        char *end;
        errno = 0;
        double s = strtod(spec + 5, &end);
        if (end == spec + 5 || *end || errno || !isfinite(s) || s < 0 || s > 100) {
            rc = mf_error(-EINVAL, "routing '%s': expected zipf:S with S a number in [0, 100]", spec);
            goto fail;
        }
        r->kind = s == 0 ? MF_ROUTE_UNIFORM : MF_ROUTE_ZIPF;
        r->s = s;
        snprintf(r->desc, sizeof r->desc, "%s", s == 0 ? "uniform" : spec);
    } else if (strcmp(spec, "local") == 0 || strncmp(spec, "local:", 6) == 0) {
        /* local[:P[:W]]: the calibrated default, P 0.6 from the 16 most recent (docs/dspark.md) */
        double p = MF_ROUTING_LOCAL_P;
        long w = MF_ROUTING_LOCAL_W;
        char *end = (char *)spec + 5;
        if (*end == ':') {
            errno = 0;
            p = strtod(end + 1, &end);
            if (*end == ':') w = strtol(end + 1, &end, 10);
        }
        int w_max = n_experts < MF_LOCAL_MAX_W ? n_experts : MF_LOCAL_MAX_W;
        if (*end || errno || !(p >= 0 && p <= 1) || w < 1 || w > w_max) {
            rc = mf_error(-EINVAL, "routing '%s': expected local, local:P or local:P:W with P in [0, 1] and W in "
                          "[1, %d] (the experts, at most %d)", spec, w_max, MF_LOCAL_MAX_W);
            goto fail;
        }
        r->kind = MF_ROUTE_LOCAL;
        r->p_reuse = p;
        r->w = (int)w;
        snprintf(r->desc, sizeof r->desc, "local:%g:%d", p, r->w);
    } else if (strncmp(spec, "trace:", 6) == 0) {
        if (!spec[6]) {
            rc = mf_error(-EINVAL, "routing '%s': expected trace:PATH", spec);
            goto fail;
        }
        r->kind = MF_ROUTE_TRACE;
        if ((rc = mf_trace_load(r, spec + 6))) goto fail;
        snprintf(r->desc, sizeof r->desc, "trace:%.280s (%" PRId64 " tokens)", spec + 6, r->n_tokens);
    } else {
        rc = mf_error(-EINVAL, "routing '%s': unknown spec (expected uniform, zipf:S, local[:P[:W]] or trace:PATH)",
                      spec);
        goto fail;
    }
    if (r->kind != MF_ROUTE_TRACE) {
        r->rng = malloc((size_t)n_layers * sizeof *r->rng);
        if (!r->rng) goto nomem;
        for (int l = 0; l < n_layers; l++) r->rng[l] = mf_stream(seed, l, 1);
    }
    if (r->kind == MF_ROUTE_ZIPF) {
        r->rank_expert = malloc((size_t)n_layers * n_experts * sizeof *r->rank_expert);
        r->weight = malloc((size_t)n_experts * sizeof *r->weight);
        r->taken = calloc((size_t)n_experts, 1);
        if (!r->rank_expert || !r->weight || !r->taken) goto nomem;
        r->weight_sum = 0;
        for (int i = 0; i < n_experts; i++) r->weight_sum += r->weight[i] = pow(i + 1.0, -r->s);
        for (int l = 0; l < n_layers; l++) {   /* the layer's ranking: Fisher-Yates from its own stream */
            uint64_t x = mf_stream(seed, l, 2);
            int32_t *p = r->rank_expert + (size_t)l * n_experts;
            for (int i = 0; i < n_experts; i++) p[i] = i;
            for (int i = n_experts - 1; i > 0; i--) {
                int j = mf_rand_below(&x, i + 1);
                int32_t t = p[i];
                p[i] = p[j];
                p[j] = t;
            }
        }
    }
    *out = r;
    return 0;
nomem:
    rc = mf_error(-ENOMEM, "routing '%s': out of memory", spec);
fail:
    mf_routing_free(r);
    return rc;
}

/* top_k distinct ranks drawn one after another, rank r with weight 1/(r+1)^s among those left. */
static void mf_draw_zipf(mf_routing *r, int layer, int32_t *ex)
{
    uint64_t *x = &r->rng[layer];
    const int32_t *rank_expert = r->rank_expert + (size_t)layer * r->n_experts;
    double left = r->weight_sum;
    int chosen[256];
    for (int j = 0; j < r->top_k; j++) {
        double u = mf_rand01(x) * left;
        int pick = -1;
        for (int i = 0; i < r->n_experts; i++) {
            if (r->taken[i]) continue;
            pick = i;   /* the last untaken rank absorbs rounding at the top */
            if ((u -= r->weight[i]) < 0) break;
        }
        r->taken[pick] = 1;
        chosen[j] = pick;
        left -= r->weight[pick];
        ex[j] = rank_expert[pick];
    }
    for (int j = 0; j < r->top_k; j++) r->taken[chosen[j]] = 0;
}

/* Room for the histories of n sequences (each starts empty). 0 or -ENOMEM. */
static int mf_local_grow(mf_routing *r, int n)
{
    if (n <= r->n_seq) return 0;
    int L = r->n_layers, w = r->w;
    int32_t *mru = calloc((size_t)L * n * w, sizeof *mru);
    int *cnt = calloc((size_t)L * n, sizeof *cnt);
    if (!mru || !cnt) {
        free(mru);
        free(cnt);
        return mf_error(-ENOMEM, "routing %s: out of memory for %d sequences", r->desc, n);
    }
    for (int l = 0; l < L; l++)
        for (int q = 0; q < r->n_seq; q++) {
            memcpy(mru + ((size_t)l * n + q) * w, r->mru + ((size_t)l * r->n_seq + q) * w, (size_t)w * sizeof *mru);
            cnt[(size_t)l * n + q] = r->mru_n[(size_t)l * r->n_seq + q];
        }
    free(r->mru);
    free(r->mru_n);
    r->mru = mru;
    r->mru_n = cnt;
    r->n_seq = n;
    return 0;
}

/* Sequence q's token at layer l: each of its top_k picks is, with probability p_reuse, one of
 * the sequence's w most recently used experts of the layer it has not picked yet (uniformly),
 * else a uniform draw among those it has not picked; then its experts become the most recent. */
static void mf_draw_local(mf_routing *r, int layer, int q, int32_t *ex)
{
    uint64_t *x = &r->rng[layer];
    int w = r->w, K = r->top_k;
    int32_t *mru = r->mru + ((size_t)layer * r->n_seq + q) * w;
    int *n_mru = &r->mru_n[(size_t)layer * r->n_seq + q];
    for (int j = 0; j < K; j++) {
        int32_t avail[MF_LOCAL_MAX_W];
        int n_av = 0;
        for (int i = 0; i < *n_mru; i++) {
            int dup = 0;
            for (int u = 0; u < j; u++) dup |= ex[u] == mru[i];
            if (!dup) avail[n_av++] = mru[i];
        }
        if (n_av > 0 && mf_rand01(x) < r->p_reuse) {
            ex[j] = avail[mf_rand_below(x, n_av)];
            continue;
        }
        int e, dup;
        do {
            e = mf_rand_below(x, r->n_experts);
            dup = 0;
            for (int u = 0; u < j; u++) dup |= ex[u] == e;
        } while (dup);
        ex[j] = e;
    }
    /* the token's experts first, then the older ones it did not pick */
    int32_t next[MF_LOCAL_MAX_W];
    int n = 0;
    for (int j = 0; j < K && n < w; j++) next[n++] = ex[j];
    for (int i = 0; i < *n_mru && n < w; i++) {
        int dup = 0;
        for (int j = 0; j < K; j++) dup |= ex[j] == mru[i];
        if (!dup) next[n++] = mru[i];
    }
    memcpy(mru, next, (size_t)n * sizeof *mru);
    *n_mru = n;
}

static void mf_draw_uniform(mf_routing *r, int layer, int32_t *ex)
{
    uint64_t *x = &r->rng[layer];
    for (int j = 0; j < r->top_k; j++) {
        int e, dup;
        do {
            e = mf_rand_below(x, r->n_experts);
            dup = 0;
            for (int i = 0; i < j; i++) dup |= ex[i] == e;
        } while (dup);
        ex[j] = e;
    }
}

int mf_routing_next(mf_routing *r, int n_tokens, int32_t *ex) { return mf_routing_next_units(r, n_tokens, 1, ex); }

int mf_routing_next_units(mf_routing *r, int n_seq, int per_seq, int32_t *ex)
{
    if (n_seq < 0 || per_seq < 1)
        return mf_error(-EINVAL, "routing %s: %d sequences of %d tokens", r->desc, n_seq, per_seq);
    int n_tokens = n_seq * per_seq;
    int L = r->n_layers, K = r->top_k;
    if (r->kind == MF_ROUTE_TRACE) {
        for (int t = 0; t < n_tokens; t++) {
            const int32_t *src = r->trace + r->next_token * L * K;
            for (int l = 0; l < L; l++)
                memcpy(ex + ((size_t)l * n_tokens + t) * K, src + (size_t)l * K, (size_t)K * sizeof *ex);
            r->next_token = (r->next_token + 1) % r->n_tokens;
        }
        return 0;
    }
    if (r->kind == MF_ROUTE_LOCAL) {
        int rc = mf_local_grow(r, n_seq);
        if (rc) return rc;
    }
    for (int l = 0; l < L; l++)
        for (int t = 0; t < n_tokens; t++) {
            int32_t *dst = ex + ((size_t)l * n_tokens + t) * K;
            if (r->kind == MF_ROUTE_ZIPF)
                mf_draw_zipf(r, l, dst);
            else if (r->kind == MF_ROUTE_LOCAL)
                mf_draw_local(r, l, t / per_seq, dst);   /* a unit's tokens: its sequence's, in order */
            else
                mf_draw_uniform(r, l, dst);
        }
    return 0;
}

int mf_routing_counts(const mf_routing *r, uint32_t *counts)
{
    if (r->kind != MF_ROUTE_TRACE) return 0;
    int L = r->n_layers, E = r->n_experts, K = r->top_k;
    for (int64_t i = 0; i < (int64_t)L * E; i++) counts[i] = 0;
    for (int64_t t = 0; t < r->n_tokens; t++)
        for (int l = 0; l < L; l++)
            for (int k = 0; k < K; k++) {
                uint32_t *c = &counts[(int64_t)l * E + r->trace[(t * L + l) * K + k]];
                if (*c < UINT32_MAX) (*c)++;
            }
    return 1;
}

const char *mf_routing_describe(const mf_routing *r) { return r->desc; }

void mf_routing_free(mf_routing *r)
{
    if (!r) return;
    free(r->rng);
    free(r->rank_expert);
    free(r->weight);
    free(r->taken);
    free(r->trace);
    free(r->mru);
    free(r->mru_n);
    free(r);
}

/* ---- recording ------------------------------------------------------------------------------- */

struct mf_routing_rec {
    pthread_mutex_t mu;
    FILE *f;
    char path[1024], tmp[1100];
    int n_layers, n_experts, top_k;
    int err;                 /* first write error */
    char err_msg[1300];
};

int mf_routing_rec_open(const char *path, int n_layers, int n_experts, int top_k, mf_routing_rec **out)
{
    *out = NULL;
    if (n_layers < 1 || n_experts < 1 || top_k < 1 || top_k > n_experts || top_k > 256)
        return mf_error(-EINVAL, "%s: routing trace: expected layers >= 1 and 1 <= top_k <= experts "
                        "(and <= 256), found %d layers, %d experts, top_k %d", path, n_layers, n_experts, top_k);
    if (strlen(path) >= 1000) return mf_error(-ENAMETOOLONG, "routing trace path too long");
    int mk = mf_path_make_parent(path);
    if (mk) return mk;
    mf_routing_rec *w = calloc(1, sizeof *w);
    if (!w) return mf_error(-ENOMEM, "%s: out of memory", path);
    snprintf(w->path, sizeof w->path, "%s", path);
    snprintf(w->tmp, sizeof w->tmp, "%s.tmp.%d", path, (int)getpid());
    w->f = fopen(w->tmp, "w");
    if (!w->f) {
        int e = errno;
        free(w);
        return mf_error(-e, "%s: cannot create: %s", path, strerror(e));
    }
    pthread_mutex_init(&w->mu, NULL);
    w->n_layers = n_layers;
    w->n_experts = n_experts;
    w->top_k = top_k;
    fprintf(w->f, "# routing trace written by moeflow decode --record-routing; lines: seq pos layer experts\n");
    fprintf(w->f, MF_TRACE_MAGIC " 1 layers %d experts %d top_k %d\n", n_layers, n_experts, top_k);
    *out = w;
    return 0;
}

int mf_routing_rec_add(mf_routing_rec *w, int seq, int64_t pos, int layer, const int32_t *ex, int k)
{
    if (seq < 0 || pos < 0 || layer < 0 || layer >= w->n_layers || k != w->top_k)
        return mf_error(-EINVAL, "%s: routing record seq %d pos %" PRId64 " layer %d with %d experts: "
                        "expected seq, pos >= 0, layer in [0, %d) and %d experts", w->path, seq, pos,
                        layer, k, w->n_layers, w->top_k);
    for (int j = 0; j < k; j++) {
        if (ex[j] < 0 || ex[j] >= w->n_experts)
            return mf_error(-EINVAL, "%s: routing record layer %d: expert %d out of range [0, %d)",
                            w->path, layer, ex[j], w->n_experts);
        for (int i = 0; i < j; i++)
            if (ex[i] == ex[j])
                return mf_error(-EINVAL, "%s: routing record layer %d: expert %d twice", w->path, layer, ex[j]);
    }
    char buf[4096];
    int n = snprintf(buf, sizeof buf, "%d %" PRId64 " %d", seq, pos, layer);
    for (int j = 0; j < k; j++) n += snprintf(buf + n, sizeof buf - (size_t)n, " %d", ex[j]);
    buf[n++] = '\n';
    pthread_mutex_lock(&w->mu);
    int rc = w->err;
    if (!rc && fwrite(buf, 1, (size_t)n, w->f) != (size_t)n) {
        int e = errno ? errno : EIO;
        w->err = rc = -e;
        snprintf(w->err_msg, sizeof w->err_msg, "%s: write failed: %s", w->tmp, strerror(e));
    }
    pthread_mutex_unlock(&w->mu);
    return rc ? mf_error(rc, "%s", w->err_msg) : 0;
}

int mf_routing_rec_close(mf_routing_rec *w)
{
    if (!w) return 0;
    int rc = w->err;
    char msg[1300];
    snprintf(msg, sizeof msg, "%s", w->err_msg);
    if (fclose(w->f) != 0 && !rc) {
        int e = errno ? errno : EIO;
        rc = -e;
        snprintf(msg, sizeof msg, "%s: write failed: %s", w->tmp, strerror(e));
    }
    if (!rc && rename(w->tmp, w->path) != 0) {
        int e = errno;
        rc = -e;
        snprintf(msg, sizeof msg, "%s: cannot rename into place: %s", w->path, strerror(e));
    }
    if (rc) unlink(w->tmp);
    pthread_mutex_destroy(&w->mu);
    free(w);
    return rc ? mf_error(rc, "%s", msg) : 0;
}
