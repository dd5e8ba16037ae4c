/* Engram (graphs/layers/layers.h; the oracle's and the engine's): n-gram hashing of the (token-mapped) history with the
 * published multipliers (numpy default_rng(10007 * layer), reproduced here: SeedSequence, PCG64,
 * Lemire bounded integers) and primes (next unused primes above engram_vocab_size - 1), gather
 * and dequant of the 24 (in V4.1) table rows, the wkv projection, and the per-stream gate. */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/layers/layers.h"
#include "host/store.h"
#include "sched/error.h"

/* ---- numpy's SeedSequence + PCG64 + Generator.integers(0, bound, n, int64) ---------------- */

typedef unsigned __int128 mf_u128;

static uint32_t mf_ss_hashmix(uint32_t v, uint32_t *hc)
{
    v ^= *hc;
    *hc *= 0x931e8875u;
    v *= *hc;
    v ^= v >> 16;
    return v;
}

static uint32_t mf_ss_mix(uint32_t x, uint32_t y)
{
    uint32_t r = 0xca01f9ddu * x - 0x4973f715u * y;
    r ^= r >> 16;
    return r;
}

/* SeedSequence(entropy).generate_state(4, uint64) for an entropy below 2^64. */
static void mf_seedseq_state(uint64_t entropy, uint64_t out[4])
{
    uint32_t ent[2];
    int n_ent = 0;
    do {
        ent[n_ent++] = (uint32_t)entropy;
        entropy >>= 32;
    } while (entropy && n_ent < 2);
    uint32_t pool[4], hc = 0x43b0d7e5u;
    for (int i = 0; i < 4; i++) pool[i] = mf_ss_hashmix(i < n_ent ? ent[i] : 0, &hc);
    for (int s = 0; s < 4; s++)
        for (int d = 0; d < 4; d++)
            if (s != d) pool[d] = mf_ss_mix(pool[d], mf_ss_hashmix(pool[s], &hc));
    uint32_t hb = 0x8b51f9ddu, w[8];
    for (int i = 0; i < 8; i++) {
        uint32_t v = pool[i % 4];
        v ^= hb;
        hb *= 0x58f38dedu;
        v *= hb;
        v ^= v >> 16;
        w[i] = v;
    }
    for (int i = 0; i < 4; i++) out[i] = (uint64_t)w[2 * i] | ((uint64_t)w[2 * i + 1] << 32);
}

typedef struct mf_pcg64 {
    mf_u128 state, inc;
} mf_pcg64;

static const mf_u128 MF_PCG_MULT =
    ((mf_u128)0x2360ED051FC65DA4ULL << 64) | (mf_u128)0x4385DF649FCCF645ULL;

static void mf_pcg64_step(mf_pcg64 *g) { g->state = g->state * MF_PCG_MULT + g->inc; }

static uint64_t mf_pcg64_next(mf_pcg64 *g)
{
    mf_pcg64_step(g);
    uint64_t x = (uint64_t)(g->state >> 64) ^ (uint64_t)g->state;
    unsigned rot = (unsigned)(g->state >> 122);
    return (x >> rot) | (x << ((64 - rot) & 63));
}

static void mf_pcg64_seed(mf_pcg64 *g, uint64_t entropy)
{
    uint64_t s[4];
    mf_seedseq_state(entropy, s);
    mf_u128 seed = ((mf_u128)s[0] << 64) | s[1], inc = ((mf_u128)s[2] << 64) | s[3];
    g->state = 0;
    g->inc = (inc << 1) | 1;
    mf_pcg64_step(g);
    g->state += seed;
    mf_pcg64_step(g);
}

/* Lemire's bounded integer in [0, rng] (numpy's 64-bit path, rng > 2^32 - 1). */
static uint64_t mf_lemire64(mf_pcg64 *g, uint64_t rng)
{
    uint64_t excl = rng + 1;
    mf_u128 m = (mf_u128)mf_pcg64_next(g) * excl;
    uint64_t left = (uint64_t)m;
    if (left < excl) {
        uint64_t thr = (UINT64_MAX - rng) % excl;
        while (left < thr) {
            m = (mf_u128)mf_pcg64_next(g) * excl;
            left = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}

static int mf_is_prime(int64_t n)
{
    if (n < 2) return 0;
    for (int64_t d = 2; d * d <= n; d++)
        if (n % d == 0) return 0;
    return 1;
}

int mf_ly_engram_params(const mf_config *c, int slot, int64_t *mult, int64_t *primes,
                         int64_t *offsets)
{
    int ng = c->engram_max_ngram_size, nh = c->engram_n_heads, per = (ng - 1) * nh;
    if (slot < 0 || slot >= c->n_engram || ng < 2 || ng > 8)
        return mf_error(-EINVAL, "engram: slot %d / max_ngram_size %d not supported", slot, ng);
    int64_t bound = INT64_MAX / c->engram_compressed_vocab_size / 2;
    if (bound <= (int64_t)UINT32_MAX + 1)
        return mf_error(-EINVAL, "engram: engram_compressed_vocab_size %" PRId64 " too large for "
                        "the 64-bit multiplier draw", c->engram_compressed_vocab_size);
    mf_pcg64 g;
    mf_pcg64_seed(&g, (uint64_t)10007 * (uint64_t)c->engram_layer_ids[slot]);
    for (int k = 0; k < ng; k++) mult[k] = (int64_t)mf_lemire64(&g, (uint64_t)bound - 1) * 2 + 1;
    /* primes: slots in order, each n-gram group restarting its search at vocab-1; used primes
     * are skipped across all groups and slots */
    int n_all = c->n_engram * per;
    int64_t *seen = calloc((size_t)n_all, sizeof *seen);
    if (!seen) return mf_error(-ENOMEM, "engram: out of memory");
    int n_seen = 0;
    for (int s = 0; s <= slot; s++)
        for (int i = 0; i < ng - 1; i++) {
            int64_t cand = c->engram_vocab_size - 1;
            for (int h = 0; h < nh; h++) {
                for (;;) {
                    cand++;
                    if (!mf_is_prime(cand)) continue;
                    int used = 0;
                    for (int u = 0; u < n_seen && !used; u++) used = seen[u] == cand;
                    if (!used) break;
                }
                seen[n_seen++] = cand;
                if (s == slot) primes[i * nh + h] = cand;
            }
        }
    free(seen);
    int64_t off = 0;
    for (int i = 0; i < per; i++) {
        offsets[i] = off;
        off += primes[i];
    }
    return 0;
}

int mf_ly_engram_setup(mf_layers *ly)
{
    const mf_config *c = ly->c;
    int per = (c->engram_max_ngram_size - 1) * c->engram_n_heads;
    for (int k = 0; k < c->n_engram; k++) {
        int rc = mf_ly_engram_params(c, k, ly->eg_mult[k], ly->eg_prime[k], ly->eg_off[k]);
        if (rc) return rc;
        int64_t need = ly->eg_off[k][per - 1] + ly->eg_prime[k][per - 1];
        if (need > c->engram_num_embeddings[k])
            return mf_error(-EINVAL, "engram: layer %d's table has %" PRId64 " rows but its hash "
                            "primes address %" PRId64 " (engram_num_embeddings[%d] must be the sum "
                            "of the primes)", c->engram_layer_ids[k], c->engram_num_embeddings[k],
                            need, k);
    }
    return 0;
}

void mf_ly_engram_rows(const mf_layers *ly, const mf_ly_item *it, int L, int64_t *rows)
{
    const mf_config *c = ly->c;
    int slot = mf_config_engram_slot(c, L), ng = c->engram_max_ngram_size, nh = c->engram_n_heads;
    int64_t pad = ly->token_map[c->engram_pad_token_id];
    /* compressed ids of the look-back; blocked once the sequence start is passed */
    int64_t cid[8];
    for (int k = 0; k < ng; k++) {
        int64_t t = it->pos - k;
        cid[k] = t >= 0 && (k == 0 || cid[k - 1] != -1) ? ly->token_map[it->st->tokens[t]] : -1;
    }
    for (int k = 0; k < ng; k++)
        if (cid[k] < 0) cid[k] = pad;
    uint64_t h = (uint64_t)cid[0] * (uint64_t)ly->eg_mult[slot][0];
    for (int i = 1; i < ng; i++) {
        h ^= (uint64_t)cid[i] * (uint64_t)ly->eg_mult[slot][i];
        for (int hd = 0; hd < nh; hd++) {
            int j = (i - 1) * nh + hd;
            rows[j] = (int64_t)(h % (uint64_t)ly->eg_prime[slot][j]) + ly->eg_off[slot][j];
        }
    }
}

void mf_ly_engram_dequant(const mf_layers *ly, const uint8_t *codes, const uint8_t *scales, float *emb)
{
    const mf_config *c = ly->c;
    int d = c->engram_head_dim, per = (c->engram_max_ngram_size - 1) * c->engram_n_heads, sb = (d + 31) / 32;
    for (int j = 0; j < per; j++) {
        const uint8_t *cj = codes + (int64_t)j * d, *sj = scales + (int64_t)j * sb;
        for (int e = 0; e < d; e++)
            emb[(int64_t)j * d + e] = mf_e4m3_to_f32(cj[e]) * mf_e8m0_to_f32(sj[e / 32]);
    }
    if (ly->act_quant) mf_bf_n(emb, (int64_t)per * d);   /* REF: rows cast to bf16, then act-quant */
}

int mf_ly_engram_embed(mf_ly_ctx *cx, const mf_ly_item *it, int L, float *emb)
{
    const mf_config *c = cx->ly->c;
    const mf_model_layer *y = mf_model_layer_at(cx->ly->m, L);
    int slot = mf_config_engram_slot(c, L), d = c->engram_head_dim;
    int per = (c->engram_max_ngram_size - 1) * c->engram_n_heads, sb = (d + 31) / 32;
    /* every row of this token first, then one batch of reads (the store's gatherer, on its own
     * run) or a read per row */
    mf_ly_engram_rows(cx->ly, it, L, cx->eg_rows);
    struct mf_store *st = mf_model_store(cx->ly->m);
    if (st) {
        int rc = mf_store_gather(st, slot, cx->eg_rows, per, cx->eg_codes, cx->eg_scales);
        if (rc) return rc;
    } else {
        for (int j = 0; j < per; j++) {
            int rc = mf_model_weight_read(cx->ly->m, &y->eg_table, cx->eg_rows[j], 1,
                                          cx->eg_codes + (int64_t)j * d, cx->eg_scales + (int64_t)j * sb);
            if (rc) return rc;
        }
    }
    mf_ly_engram_dequant(cx->ly, cx->eg_codes, cx->eg_scales, emb);
    return 0;
}

void mf_ly_engram_gate(mf_ly_ctx *cx, mf_ly_item *it, int L, const float *kv)
{
    const mf_config *c = cx->ly->c;
    const mf_model_layer *y = mf_model_layer_at(cx->ly->m, L);
    int hc = c->hc_mult;
    int64_t H = c->hidden_size;
    const float *value = kv + (int64_t)hc * H;
    for (int s = 0; s < hc; s++) {
        float *x = it->x + s * H;
        const float *key = kv + s * H;
        double sx = 0, sk = 0, dot = 0;
        for (int64_t e = 0; e < H; e++) {
            float w = mf_ly_vec(&y->eg_q_weight, s * H + e) * mf_ly_vec(&y->eg_k_weight, s * H + e);
            sx += (double)x[e] * x[e];
            sk += (double)key[e] * key[e];
            dot += (double)x[e] * w * key[e];
        }
        double rstd = 1.0 / sqrt(sx / (double)H + c->rms_norm_eps) / sqrt(sk / (double)H + c->rms_norm_eps);
        double g = dot * rstd / sqrt((double)H), a = fabs(g) > 1e-6 ? fabs(g) : 1e-6;
        float gate = mf_ly_sigmoid((float)copysign(sqrt(a), g));
        for (int64_t e = 0; e < H; e++) x[e] = mf_bf(x[e] + gate * value[e]);
    }
}

int mf_ly_engram(mf_ly_ctx *cx, mf_ly_item *it, int L)
{
    const mf_config *c = cx->ly->c;
    float *emb = cx->eg_emb, *kv = cx->eg_kv;
    int aq = cx->ly->act_quant;
    int rc = mf_ly_engram_embed(cx, it, L, emb);
    if (!rc) rc = mf_ly_linear(cx, &mf_model_layer_at(cx->ly->m, L)->eg_wkv, emb, kv, aq);
    if (rc) return rc;
    if (aq) mf_bf_n(kv, (int64_t)(c->hc_mult + 1) * c->hidden_size);
    mf_ly_engram_gate(cx, it, L, kv);
    return 0;
}
