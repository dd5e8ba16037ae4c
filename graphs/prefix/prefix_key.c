/* The identity of what the prefix cache holds (graphs/prefix/prefix.h mf_prefix_key): a state after a
 * prefix depends on the model's config, its weights, the layer options and the forward's numerics;
 * the disk tier names and checks its entries with this key so that another checkpoint's or another
 * engine's entries are never used. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/prefix/prefix_impl.h"
#include "host/safetensors.h"
#include "sched/error.h"

#define MF_PFX_SAMPLES 8          /* reads spread over each shard */
#define MF_PFX_SAMPLE_BYTES 4096  /* bytes of each */

/* The checkpoint's tensors: every entry of the table (name, dtype, shape, where) and MF_PFX_SAMPLES
 * reads of each shard's bytes (weights drawn from another seed differ in all of them). */
static int mf_pfx_key_tensors(const char *dir, uint8_t h[16])
{
    mf_st *st = NULL;
    int rc = mf_st_open(dir, &st);
    if (rc) return rc;
    for (int i = 0; i < mf_st_n_tensors(st); i++) {
        const mf_st_tensor *t = mf_st_tensor_at(st, i);
        int64_t rec[4 + MF_ST_MAX_DIMS] = {t->dtype, t->n_dims, t->shard, (int64_t)t->file_offset};
        memcpy(rec + 4, t->shape, sizeof t->shape);
        mf_pfx_hash_bytes(h, t->name, (int64_t)strlen(t->name), h);
        mf_pfx_hash_bytes(h, rec, sizeof rec, h);
    }
    uint8_t *buf = malloc(MF_PFX_SAMPLE_BYTES);
    if (!buf) rc = mf_error(-ENOMEM, "prefix cache: out of memory");
    for (int i = 0; i < mf_st_n_tensors(st) && !rc; i++) {   /* samples: the tensors at evenly spread ranks */
        if ((int64_t)i * MF_PFX_SAMPLES / mf_st_n_tensors(st) == (int64_t)(i + 1) * MF_PFX_SAMPLES / mf_st_n_tensors(st) &&
            i + 1 < mf_st_n_tensors(st))
            continue;
        const mf_st_tensor *t = mf_st_tensor_at(st, i);
        size_t n = t->n_bytes < MF_PFX_SAMPLE_BYTES ? (size_t)t->n_bytes : MF_PFX_SAMPLE_BYTES;
        if (n && !(rc = mf_st_read(st, t, t->n_bytes - n, buf, n))) mf_pfx_hash_bytes(h, buf, (int64_t)n, h);
    }
    free(buf);
    mf_st_close(st);
    return rc;
}

int mf_prefix_key(const mf_ref *r, const char *numerics, uint8_t key[16])
{
    const mf_layers *ly = mf_ref_layers(r);
    uint8_t h[16] = "moeflow-prefix1";
    char *js = mf_config_to_json(ly->c);
    if (!js) return mf_error(-ENOMEM, "prefix cache: out of memory");
    mf_pfx_hash_bytes(h, js, (int64_t)strlen(js), h);
    free(js);
    int32_t aq = ly->act_quant;
    mf_pfx_hash_bytes(h, &aq, sizeof aq, h);
    if (ly->token_map) mf_pfx_hash(h, ly->token_map, ly->c->vocab_size, h);
    mf_pfx_hash_bytes(h, numerics ? numerics : "", numerics ? (int64_t)strlen(numerics) : 0, h);
    int rc = mf_pfx_key_tensors(mf_model_dir(ly->m), h);
    if (rc) return rc;
    memcpy(key, h, 16);
    return 0;
}
