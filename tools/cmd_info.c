/* `moeflow info`: the byte census of a checkpoint (headers only) by group, like the seed's
 * "What is in the 475 GiB" table, with the config summary and a check of the tensors against the
 * layout the config implies; --json for scripts. */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <limits.h>
#include <sys/stat.h>

#include "graphs/model/census.h"
#include "graphs/model/config.h"
#include "graphs/model/layout.h"
#include "graphs/prefix/prefix.h"
#include "graphs/ref/ref.h"
#include "host/safetensors.h"
#include "host/wmap.h"
#include "sched/error.h"
#include "tools/commands.h"

#define GIB 1073741824.0

/* The command line of `moeflow info`. */
typedef struct mf_info_cli {
    const char *dir;
    int json, resident, evict;
} mf_info_cli;

static const mf_opt mf_info_table[] = {
    {"--json", .kind = MF_OPT_FLAG, .off = offsetof(mf_info_cli, json),
     .help = "one JSON object: total_bytes, n_tensors, n_shards, groups, group_tensors,\n"
             "config, rope_scaling, draft and sequence_state (with config.json);\n"
             "with --resident: dir, bytes, cached_bytes, shards [{path, bytes,\n"
             "cached_bytes, mapped_by [{pid, command}]}]"},
    {"--resident", .kind = MF_OPT_FLAG, .off = offsetof(mf_info_cli, resident),
     .help = "what of DIR's shards the page cache holds (the resident copy of\n"
             "the weights that `decode` and `serve` map: a warm start reads\n"
             "nothing from the disk), which processes map them, and how to\n"
             "free it; without DIR, every safetensors file a process maps"},
    {"--evict", .kind = MF_OPT_FLAG, .off = offsetof(mf_info_cli, evict),
     .help = "with --resident: drop DIR's shards from the page cache (the\n"
             "pages no process maps; the next start reads them from the disk)"},
    {NULL},
};

static const mf_opts_spec mf_info_spec = {
    .cmd = "info",
    .usage = "usage: moeflow info DIR [--json]\n"
             "       moeflow info [DIR] --resident [--evict] [--json]\n\n"
             "Prints the byte census of the checkpoint in DIR (a directory with shards and\n"
             "model.safetensors.index.json, or one .safetensors file) by group: experts,\n"
             "engram, mtp, attn, shared_experts, embed_head, other. Reads headers only.\n"
             "With config.json beside the shards, validates it, prints a summary and checks\n"
             "every tensor of the layout it implies against the checkpoint; exits 1 when any\n"
             "is missing or misshapen (the census is printed all the same). A checkpoint\n"
             "without the DSpark draft's mtp.* tensors is complete for plain decoding (noted).\n"
             "--resident says what of the checkpoint the page cache holds (docs/io.md).\n\n",
    .opts = mf_info_table,
    .pos_meta = "DIR",
    .pos_off = offsetof(mf_info_cli, dir),
    .col = 14,
};

static void mf_print_ids(const char *label, const int *ids, int n)
{
    printf("%s [", label);
    for (int i = 0; i < n; i++) printf("%s%d", i ? "," : "", ids[i]);
    printf("]");
}

/* A sequence state's size by need (graphs/ref/ref.h): the fixed part, the average bytes per
 * position over a page (token history + packed compressed KV and index keys), an 8k-token
 * sequence, and how many of those a 64 GiB state budget holds. */
typedef struct mf_info_state {
    int64_t fixed_bytes, bytes_8k, seqs_8k_64g;
    double bytes_per_token;
} mf_info_state;

static mf_info_state mf_info_state_of(const mf_config *c)
{
    mf_info_state s;
    s.fixed_bytes = mf_ref_state_bytes(c, 0);
    s.bytes_per_token = (double)(mf_ref_state_bytes(c, MF_LY_PAGE_POSITIONS) - s.fixed_bytes) / MF_LY_PAGE_POSITIONS;
    s.bytes_8k = mf_ref_state_bytes(c, 8192);
    s.seqs_8k_64g = (int64_t)((64.0 * GIB) / (double)s.bytes_8k);
    return s;
}

static void mf_info_config(const mf_config *c)
{
    printf("config: vocab %lld, hidden %d, %d layers (+%d MTP), %d heads x %d (rope %d), "
           "q_lora %d, output %d x %d\n",
           (long long)c->vocab_size, c->hidden_size, c->n_layers, c->n_mtp_layers, c->n_heads,
           c->head_dim, c->qk_rope_head_dim, c->q_lora_rank, c->o_groups, c->o_lora_rank);
    int count[3] = {0, 0, 0};
    for (int i = 0; i < c->n_layers; i++) count[c->compress_ratios[i]]++;
    printf("  attention: window %d; compress ratio 0/1/2 on %d/%d/%d layers; ", c->sliding_window,
           count[0], count[1], count[2]);
    mf_print_ids("KV sources", c->kv_source_layer_ids, c->n_kv_source);
    mf_print_ids(", index sources", c->index_source_layer_ids, c->n_index_source);
    printf(", candidate source %d\n", c->candidate_source_layer_id);
    if (c->yarn_factor > 0)
        printf("  rope: theta %g on ratio-0 layers; theta %g + YaRN factor %g from %lld positions "
               "(beta_fast %g, beta_slow %g) on the others, %s\n", c->rope_theta,
               c->compress_rope_theta, c->yarn_factor,
               (long long)c->yarn_original_max_position_embeddings, c->yarn_beta_fast,
               c->yarn_beta_slow,
               c->yarn_defaulted ? "the released defaults: config.json has no rope_scaling"
                                 : "from config.json's rope_scaling");
    else
        printf("  rope: theta %g on ratio-0 layers, theta %g on the others, no YaRN\n",
               c->rope_theta, c->compress_rope_theta);
    printf("  MoE: %d routed experts, top-%d, %d shared, intermediate %d, %s, scale %g, "
           "swiglu limit %g\n",
           c->n_routed_experts, c->n_experts_per_tok, c->n_shared_experts, c->moe_intermediate_size,
           mf_scoring_name(c->scoring_func), c->routed_scaling_factor, c->swiglu_limit);
    printf("  hyper-connections %d streams, %d Sinkhorn iterations; ", c->hc_mult,
           c->hc_sinkhorn_iters);
    mf_print_ids("Engram layers", c->engram_layer_ids, c->n_engram);
    printf(" rows [");
    for (int i = 0; i < c->n_engram; i++)
        printf("%s%lld", i ? "," : "", (long long)c->engram_num_embeddings[i]);
    printf("]\n  quantization: fp8 e4m3 dense in %dx%d tiles, ue8m0 scales; experts fp4 e2m1\n",
           c->quant_block_out, c->quant_block_in);
    printf("  derived: %.2f MiB per expert, experts %.2f GiB, Engram tables %.2f GiB, "
           "resident %.2f GiB\n",
           mf_config_expert_bytes(c) / 1048576.0, mf_config_expert_bank_bytes(c) / GIB,
           mf_config_engram_table_bytes(c) / GIB, mf_config_resident_bytes(c) / GIB);
    if (c->n_mtp_layers > 0) {
        printf("  draft: %d stages (DSpark, mtp.*): block %d, noise token %d, ", c->n_mtp_layers, c->dspark_block_size,
               c->dspark_noise_token_id);
        mf_print_ids("features of layers", c->dspark_target_layer_ids, c->n_dspark_target);
        printf(", %d routed experts top-%d, Markov rank %d; %.2f GiB, read only when speculation is asked for; "
               "%.2f MiB of context per sequence\n", c->dspark_n_routed_experts, c->dspark_num_experts_per_tok,
               c->dspark_markov_rank, mf_config_draft_bytes(c) / GIB, mf_ly_draft_ring_bytes(c) / 1048576.0);
    } else {
        printf("  draft: none (num_nextn_predict_layers 0)\n");
    }
    mf_info_state ss = mf_info_state_of(c);
    printf("  sequence state: %.2f MiB fixed (packed E4M3 window ring) + %.1f bytes per token (packed fp4 compressed KV "
           "and index keys, pages of %d positions); 8k tokens %.2f MiB, %lld of them in 64 GiB\n",
           ss.fixed_bytes / 1048576.0, ss.bytes_per_token, MF_LY_PAGE_POSITIONS, ss.bytes_8k / 1048576.0,
           (long long)ss.seqs_8k_64g);
    /* the prefix cache (graphs/prefix/prefix.h): the pages and token id, plus the window rows a block keeps */
    double pb = mf_prefix_bytes_per_token(c, 0);
    printf("  prefix cache: %.0f bytes per cached token with blocks of %d (the state's %.1f + window rows and node "
           "%.0f amortized over the block); %.0f with blocks of %d; 1 GiB holds %.0fk tokens\n", pb, MF_PREFIX_BLOCK,
           ss.bytes_per_token, pb - ss.bytes_per_token, mf_prefix_bytes_per_token(c, MF_LY_PAGE_POSITIONS),
           MF_LY_PAGE_POSITIONS, GIB / pb / 1000);
}

/* Compares the checkpoint with the layout of `c`: prints missing, mismatched and extra tensors
 * (the first few of each); returns the number of missing + mismatched. */
static int mf_info_check_layout(const mf_st *st, const mf_config *c)
{
    mf_layout *l;
    if (mf_layout_build(c, &l)) {
        printf("layout check: %s\n", mf_last_error());
        return 1;
    }
    int missing = 0, mismatched = 0, n = mf_layout_n(l), n_draft = 0, draft_missing = 0;
    for (int i = 0; i < n; i++) {
        const mf_layout_tensor *t = mf_layout_at(l, i);
        n_draft += t->group == MF_GROUP_MTP;
        draft_missing += t->group == MF_GROUP_MTP && !mf_st_find(st, t->name);
    }
    /* a checkpoint without the draft (older gen output, or one stripped of it) is complete for
     * plain decoding: its absence is a note, not a mismatch; a partial draft is an error */
    int skip_draft = n_draft > 0 && draft_missing == n_draft;
    for (int i = 0; i < n; i++) {
        const mf_layout_tensor *t = mf_layout_at(l, i);
        const mf_st_tensor *s = mf_st_find(st, t->name);
        if (skip_draft && t->group == MF_GROUP_MTP) continue;
        if (!s) {
            if (missing++ < 5) printf("  missing: %s\n", t->name);
            continue;
        }
        int same = s->dtype == t->dtype && s->n_dims == t->n_dims;
        for (int d = 0; same && d < t->n_dims; d++) same = s->shape[d] == t->shape[d];
        if (!same && mismatched++ < 5)
            printf("  mismatch: %s is %s %lldx%lld, layout says %s %lldx%lld\n", t->name,
                   mf_dtype_name(s->dtype), (long long)s->shape[0],
                   (long long)(s->n_dims > 1 ? s->shape[1] : 1), mf_dtype_name(t->dtype),
                   (long long)t->shape[0], (long long)(t->n_dims > 1 ? t->shape[1] : 1));
    }
    int extra = 0, n_st = mf_st_n_tensors(st);
    for (int i = 0; i < n_st; i++) {
        const mf_st_tensor *s = mf_st_tensor_at(st, i);
        if (mf_layout_find(l, s->name) < 0 && extra++ < 5) printf("  not in layout: %s\n", s->name);
    }
    if (skip_draft)
        printf("draft: none of its %d mtp.* tensors is in the checkpoint: plain decoding only (no speculation)\n",
               n_draft);
    printf("layout check: %d tensors expected, %d missing, %d mismatched, %d not in layout%s\n",
           n - (skip_draft ? n_draft : 0), missing, mismatched, extra, extra ? " (vision and unknown tensors)" : "");
    mf_layout_free(l);
    return missing + mismatched;
}

/* What info reads: the checkpoint's headers, their census, config.json beside them. */
typedef struct mf_info_ck {
    mf_st *st;
    mf_census cs;
    int have_cfg;
    mf_config cfg;
    char cfg_path[4096];
} mf_info_ck;

/* Opens dir and its config.json (when dir is a directory that has one). 0, or 1 (the exit code)
 * after saying why. */
static int mf_info_open(const char *dir, mf_info_ck *k)
{
    if (mf_st_open(dir, &k->st)) {
        fprintf(stderr, "moeflow info: %s\n", mf_last_error());
        return 1;
    }
    mf_census_of(k->st, &k->cs);
    struct stat sb;
    if (stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        snprintf(k->cfg_path, sizeof k->cfg_path, "%s/config.json", dir);
        if (stat(k->cfg_path, &sb) == 0) {
            if (mf_config_load(k->cfg_path, &k->cfg)) {
                fprintf(stderr, "moeflow info: %s\n", mf_last_error());
                mf_st_close(k->st);
                return 1;
            }
            k->have_cfg = 1;
        }
    }
    return 0;
}

/* --json: the census, and with a config what positions get and a sequence state's size. 0 or 1. */
static int mf_info_json(const mf_info_ck *k)
{
    const mf_census *cs = &k->cs;
    json_t *o = json_object(), *groups = json_object(), *counts = json_object();
    json_object_set_new(o, "total_bytes", json_integer((json_int_t)cs->total_bytes));
    json_object_set_new(o, "n_tensors", json_integer(cs->n_tensors));
    json_object_set_new(o, "n_shards", json_integer(cs->n_shards));
    for (int g = 0; g < MF_GROUP_COUNT; g++) {
        json_object_set_new(groups, mf_group_name(g), json_integer((json_int_t)cs->bytes[g]));
        json_object_set_new(counts, mf_group_name(g), json_integer(cs->tensors[g]));
    }
    json_object_set_new(o, "groups", groups);
    json_object_set_new(o, "group_tensors", counts);
    json_object_set_new(o, "config", k->have_cfg ? json_string(k->cfg_path) : json_null());
    if (k->have_cfg) {   /* what positions get: YaRN from the file or the released defaults */
        const mf_config *c = &k->cfg;
        json_object_set_new(o, "rope_scaling",
            json_pack("{s:s, s:f, s:I, s:f, s:f, s:s}", "rope_type", "yarn", "factor", c->yarn_factor,
                      "original_max_position_embeddings", (json_int_t)c->yarn_original_max_position_embeddings,
                      "beta_fast", c->yarn_beta_fast, "beta_slow", c->yarn_beta_slow, "source",
                      c->yarn_defaulted ? "default" : "config.json"));
        /* the draft the config describes, and how much of it the checkpoint has */
        json_object_set_new(o, "draft",
            json_pack("{s:i, s:I, s:I, s:I}", "stages", c->n_mtp_layers, "layout_bytes",
                      (json_int_t)mf_config_draft_bytes(c), "bytes", (json_int_t)cs->bytes[MF_GROUP_MTP],
                      "tensors", (json_int_t)cs->tensors[MF_GROUP_MTP]));
        mf_info_state ss = mf_info_state_of(c);
        json_object_set_new(o, "sequence_state",
            json_pack("{s:I, s:f, s:I, s:I, s:I}", "fixed_bytes", (json_int_t)ss.fixed_bytes, "bytes_per_token",
                      ss.bytes_per_token, "page_positions", (json_int_t)MF_LY_PAGE_POSITIONS, "bytes_8k",
                      (json_int_t)ss.bytes_8k, "sequences_8k_in_64gib", (json_int_t)ss.seqs_8k_64g));
        json_object_set_new(o, "prefix_cache",
            json_pack("{s:i, s:f, s:f}", "block_tokens", MF_PREFIX_BLOCK, "bytes_per_token",
                      mf_prefix_bytes_per_token(c, 0), "bytes_per_token_block_256",
                      mf_prefix_bytes_per_token(c, MF_LY_PAGE_POSITIONS)));
    }
    char *text = json_dumps(o, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(o);
    if (!text) {
        fprintf(stderr, "moeflow info: out of memory\n");
        return 1;
    }
    printf("%s\n", text);
    free(text);
    return 0;
}

/* The census table, then the config summary and the layout check. 0, or 1 when the checkpoint
 * does not match its config's layout. */
static int mf_info_text(const char *dir, const mf_info_ck *k)
{
    const mf_census *cs = &k->cs;
    printf("%s: %lld tensors in %d shard%s, %.2f GiB (%llu bytes)\n\n", dir, (long long)cs->n_tensors,
           cs->n_shards, cs->n_shards == 1 ? "" : "s", cs->total_bytes / GIB, (unsigned long long)cs->total_bytes);
    printf("| %-15s | %9s | %6s | %8s | %17s |\n", "group", "GiB", "share", "tensors", "bytes");
    printf("|-----------------|-----------|--------|----------|-------------------|\n");
    for (int g = 0; g < MF_GROUP_COUNT; g++) {
        double share = cs->total_bytes ? 100.0 * cs->bytes[g] / cs->total_bytes : 0.0;
        printf("| %-15s | %9.2f | %5.1f%% | %8lld | %17llu |\n", mf_group_name(g), cs->bytes[g] / GIB, share,
               (long long)cs->tensors[g], (unsigned long long)cs->bytes[g]);
    }
    printf("| %-15s | %9.2f | %5.1f%% | %8lld | %17llu |\n\n", "total", cs->total_bytes / GIB, 100.0,
           (long long)cs->n_tensors, (unsigned long long)cs->total_bytes);
    if (!k->have_cfg) {
        printf("no config.json in %s: config summary skipped\n", dir);
        return 0;
    }
    mf_info_config(&k->cfg);
    int bad = mf_info_check_layout(k->st, &k->cfg);
    if (bad)
        fprintf(stderr, "moeflow info: %s does not match the layout its config.json implies "
                "(%d tensors missing or misshapen; regenerate it, or fix config.json)\n", dir, bad);
    return bad ? 1 : 0;
}

/* ---- --resident: the page cache's copy of the weights ----------------------------------------- */

/* A process mapping a file: pid, command, the file (resolved path). */
typedef struct mf_info_map {
    int pid;
    char comm[64];
    char path[4096];
} mf_info_map;

/* Every safetensors file mapped by a process (/proc/PID/maps), one entry per (pid, file), into a
 * malloc'ed array; the processes this user may not read are skipped. */
static int mf_info_maps(mf_info_map **out)
{
    int n = 0, cap = 0;
    *out = NULL;
    DIR *pd = opendir("/proc");
    if (!pd) return 0;
    for (struct dirent *e; (e = readdir(pd));) {
        int pid = atoi(e->d_name);
        if (pid <= 0) continue;
        char p[64], line[4400], comm[64] = "?";
        snprintf(p, sizeof p, "/proc/%d/comm", pid);
        FILE *f = fopen(p, "r");
        if (f) {
            if (fgets(comm, sizeof comm, f)) comm[strcspn(comm, "\n")] = 0;
            fclose(f);
        }
        snprintf(p, sizeof p, "/proc/%d/maps", pid);
        if (!(f = fopen(p, "r"))) continue;
        while (fgets(line, sizeof line, f)) {
            char *path = strchr(line, '/');
            size_t len = path ? strcspn(path, "\n") : 0;
            if (!path || len < 12 || strncmp(path + len - 12, ".safetensors", 12)) continue;
            path[len] = 0;
            int dup = 0;
            for (int i = n - 1; i >= 0 && (*out)[i].pid == pid && !dup; i--) dup = !strcmp((*out)[i].path, path);
            if (dup) continue;
            if (n == cap) {
                mf_info_map *g = realloc(*out, sizeof *g * (size_t)(cap = cap ? 2 * cap : 16));
                if (!g) break;
                *out = g;
            }
            (*out)[n] = (mf_info_map){.pid = pid};
            snprintf((*out)[n].comm, sizeof (*out)[n].comm, "%s", comm);
            snprintf((*out)[n].path, sizeof (*out)[n].path, "%s", path);
            n++;
        }
        fclose(f);
    }
    closedir(pd);
    return n;
}

/* Without DIR: every safetensors file a process maps, with what the page cache holds of it. */
static int mf_info_resident_all(int json)
{
    mf_info_map *mp = NULL;
    int n = mf_info_maps(&mp);
    json_t *arr = json ? json_array() : NULL;
    if (!json && !n)
        printf("no process maps a safetensors file now. The page cache may still hold checkpoints that\n"
               "processes mapped before (the resident weights of a warm start): `moeflow info DIR --resident`\n"
               "says how much of one it holds, `--evict` frees it.\n");
    for (int i = 0; i < n; i++) {
        uint64_t cached = 0, size = 0;
        mf_wmap_file_cached(mp[i].path, &cached, &size);
        if (json)
            json_array_append_new(arr, json_pack("{s:i, s:s, s:s, s:I, s:I}", "pid", mp[i].pid, "command", mp[i].comm,
                                                 "path", mp[i].path, "bytes", (json_int_t)size, "cached_bytes",
                                                 (json_int_t)cached));
        else
            printf("pid %d (%s) maps %s: %.2f GiB, %.2f GiB of it in the page cache\n", mp[i].pid, mp[i].comm,
                   mp[i].path, size / GIB, cached / GIB);
    }
    if (!json && n)
        printf("the page cache keeps these after the processes end (reclaimable when memory is short);\n"
               "`moeflow info DIR --resident --evict` drops a checkpoint's pages once no process maps them\n");
    if (json) {
        json_t *o = json_pack("{s:o}", "mapped", arr);
        char *t = json_dumps(o, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        json_decref(o);
        if (t) printf("%s\n", t);
        free(t);
    }
    free(mp);
    return 0;
}

/* One shard of DIR: its size, what the page cache holds, who maps it (JSON or a line). */
static void mf_info_resident_shard(const char *path, const mf_info_map *mp, int n, json_t *arr, uint64_t *bytes,
                                   uint64_t *cached)
{
    uint64_t c = 0, sz = 0;
    char real[4096];
    if (mf_wmap_file_cached(path, &c, &sz)) fprintf(stderr, "moeflow info: %s\n", mf_last_error());
    *bytes += sz;
    *cached += c;
    if (!realpath(path, real)) snprintf(real, sizeof real, "%s", path);
    json_t *by = json_array();
    char who[512] = "";
    size_t k = 0;
    for (int i = 0; i < n; i++)
        if (!strcmp(mp[i].path, real)) {
            json_array_append_new(by, json_pack("{s:i, s:s}", "pid", mp[i].pid, "command", mp[i].comm));
            if (k < sizeof who) k += (size_t)snprintf(who + k, sizeof who - k, "%s%d (%s)", k ? ", " : "", mp[i].pid, mp[i].comm);
        }
    if (arr)
        json_array_append_new(arr, json_pack("{s:s, s:I, s:I, s:o}", "path", path, "bytes", (json_int_t)sz,
                                             "cached_bytes", (json_int_t)c, "mapped_by", by));
    else {
        printf("  %s: %.2f of %.2f GiB cached%s%s\n", path, c / GIB, sz / GIB, k ? ", mapped by pid " : "", who);
        json_decref(by);
    }
}

/* DIR: each shard's cached bytes and mappers, the total, how to free it; --evict first drops them. */
static int mf_info_resident(const mf_info_cli *a)
{
    mf_st *st = NULL;
    if (mf_st_open(a->dir, &st)) {
        fprintf(stderr, "moeflow info: %s\n", mf_last_error());
        return 1;
    }
    int ns = mf_st_n_shards(st), rc = 0;
    for (int s = 0; a->evict && s < ns; s++)
        if (mf_wmap_file_evict(mf_st_shard_path(st, s))) {
            fprintf(stderr, "moeflow info: %s\n", mf_last_error());
            rc = 1;
        }
    mf_info_map *mp = NULL;
    int n = mf_info_maps(&mp);
    json_t *arr = a->json ? json_array() : NULL;
    uint64_t bytes = 0, cached = 0;
    if (!a->json) printf("%s: the page cache%s holds\n", a->dir, a->evict ? ", after --evict," : "");
    for (int s = 0; s < ns; s++) mf_info_resident_shard(mf_st_shard_path(st, s), mp, n, arr, &bytes, &cached);
    int mapped = 0;
    for (int i = 0; i < n; i++)
        for (int s = 0; s < ns && !mapped; s++) {
            char real[4096];
            mapped = realpath(mf_st_shard_path(st, s), real) && !strcmp(real, mp[i].path);
        }
    if (a->json) {
        json_t *o = json_pack("{s:s, s:I, s:I, s:o}", "dir", a->dir, "bytes", (json_int_t)bytes, "cached_bytes",
                              (json_int_t)cached, "shards", arr);
        char *t = json_dumps(o, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        json_decref(o);
        if (t) printf("%s\n", t);
        free(t);
    } else {
        printf("total: %.2f of %.2f GiB (%.1f%%) in the page cache: the resident copy a start with mapped weights\n"
               "(the default of decode and serve) uses without reading the disk. The kernel holds it, not a process:\n"
               "it outlives every run and is reclaimed when memory runs short.\n"
               "To free it: `moeflow info %s --resident --evict`%s,\n"
               "or as root `sync; echo 1 > /proc/sys/vm/drop_caches` (every file's cache).\n",
               cached / GIB, bytes / GIB, bytes ? 100.0 * cached / bytes : 0.0, a->dir,
               mapped ? " once the processes above have ended (their mapped pages stay)" : "");
    }
    free(mp);
    mf_st_close(st);
    return rc;
}

int mf_cmd_info(int argc, char **argv)
{
    mf_info_cli a = {0};
    int rc = mf_opts_parse(&mf_info_spec, argc, argv, &a);
    if (rc != MF_OPTS_RUN) return rc;
    if (a.evict && !a.resident) return mf_opts_refuse(&mf_info_spec, "--evict goes with --resident");
    if (a.resident) return a.dir ? mf_info_resident(&a) : (a.evict ? mf_opts_refuse(&mf_info_spec, "--evict needs DIR")
                                                                   : mf_info_resident_all(a.json));
    if (!a.dir) return mf_opts_refuse(&mf_info_spec, "DIR is required");
    static mf_info_ck k;
    if ((rc = mf_info_open(a.dir, &k))) return rc;
    rc = a.json ? mf_info_json(&k) : mf_info_text(a.dir, &k);
    mf_st_close(k.st);
    return rc;
}
