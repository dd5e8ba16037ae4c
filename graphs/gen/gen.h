/* Synthetic checkpoints with the real layout: config.json, safetensors shards and the index, with
 * the released names, dtypes, shapes and quantization, filled with deterministic random values
 * whose scales keep activations finite (or left as holes: layout-only, sparse files). Every
 * tensor's values depend only on (seed, tensor name, element index), so any chunk can be made in
 * any order and re-made later to check a reader. */
#ifndef MF_GEN_H
#define MF_GEN_H

#include <stddef.h>
#include <stdint.h>

#include "graphs/model/config.h"
#include "graphs/model/layout.h"

typedef struct mf_gen_opts {
    uint64_t seed;
    int n_shards;     /* >= 1 */
    int sparse;       /* 1: headers only, data left as holes */
    int force;        /* 1: write into a non-empty directory, replacing our files there */
    int quiet;        /* 1: no progress on stderr */
} mf_gen_opts;

/* Default options of a preset: tiny 2 shards, demo 4, flash41 48 and sparse. */
int mf_gen_preset_opts(const char *preset, mf_gen_opts *out);

/* Writes the checkpoint for config `c` into `dir` (created if missing): shards
 * model-0000k-of-0000n.safetensors, then config.json, then model.safetensors.index.json last.
 * Refuses a non-empty dir unless opts->force. On failure removes every file it wrote (and the
 * dir if it created it) and returns a negative code with a message. */
int mf_gen_write(const mf_config *c, const char *dir, const mf_gen_opts *opts);

/* Shard of every tensor of `l` (shard_of[i] in [0, n_shards)): tensors in layout order, cut into
 * n_shards consecutive runs of about equal bytes; deterministic. -EINVAL when the layout has
 * fewer tensors than shards. */
int mf_gen_assign_shards(const mf_layout *l, int n_shards, int *shard_of);

/* Fills bytes [offset, offset + n) of tensor t's data as the generator writes it for `seed`.
 * offset and n must be multiples of the element size (bytes for 8-bit and packed types). */
void mf_gen_fill(const mf_layout_tensor *t, uint64_t seed, uint64_t offset, void *dst, size_t n);

#endif
