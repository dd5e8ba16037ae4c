/* config.json of a DeepSeek-V4.1-style checkpoint: parsing (flat and HF-nested dialects) with
 * jansson, validation, the flat writer and the presets. Every error names the file and field and
 * says what was expected and what was found. */
#include "graphs/model/config.h"
#include "host/json_kind.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sched/error.h"
#include "sched/path.h"

static int mf_config_check(const char *what, const char *pfx, const mf_config *c);

/* ---- reading ------------------------------------------------------------------------------- */

typedef struct mf_cfg_src {
    const char *what;       /* file name for messages */
    json_t *model;          /* object holding the model keys */
    const char *prefix;     /* "" or "text_config." */
    json_t *quant;          /* quantization_config */
    const char *qprefix;    /* "quantization_config." or "text_config.quantization_config." */
} mf_cfg_src;

static int mf_cfg_bad(const mf_cfg_src *s, const char *prefix, const char *key, const char *expected,
                      const char *found)
{
    return mf_error(-EINVAL, "%s: field '%s%s': expected %s, found %s", s->what, prefix, key,
                    expected, found);
}

/* Integer field in [lo, hi]; absent (or null when null_ok) -> *out = def when !required. */
static int mf_cfg_int(const mf_cfg_src *s, const char *key, int64_t lo, int64_t hi, int required,
                      int64_t def, int64_t *out)
{
    json_t *v = json_object_get(s->model, key);
    char expected[96], found[64];
    snprintf(expected, sizeof expected, "an integer in [%" PRId64 ", %" PRId64 "]", lo, hi);
    if (!v || json_is_null(v)) {
        if (required) return mf_cfg_bad(s, s->prefix, key, expected, v ? "null" : "nothing (the field is missing)");
        *out = def;
        return 0;
    }
    int64_t x;
    if (json_is_integer(v)) {
        x = json_integer_value(v);
    } else if (json_is_real(v) && json_real_value(v) == floor(json_real_value(v)) &&
               fabs(json_real_value(v)) < 9e15) {
        x = (int64_t)json_real_value(v);   /* 16.0 for an integer field is accepted */
    } else {
        return mf_cfg_bad(s, s->prefix, key, expected, mf_json_kind(v));
    }
    if (x < lo || x > hi) {
        snprintf(found, sizeof found, "%" PRId64, x);
        return mf_cfg_bad(s, s->prefix, key, expected, found);
    }
    *out = x;
    return 0;
}

static int mf_cfg_i32(const mf_cfg_src *s, const char *key, int64_t lo, int64_t hi, int required,
                      int64_t def, int *out)
{
    int64_t x;
    int rc = mf_cfg_int(s, key, lo, hi, required, def, &x);
    if (rc == 0) *out = (int)x;
    return rc;
}

/* Real field in (lo, hi] when lo_open, else [lo, hi]. */
static int mf_cfg_real(const mf_cfg_src *s, const char *key, double lo, double hi, int lo_open,
                       int required, double def, double *out)
{
    json_t *v = json_object_get(s->model, key);
    char expected[96], found[64];
    snprintf(expected, sizeof expected, "a number in %c%g, %g]", lo_open ? '(' : '[', lo, hi);
    if (!v || json_is_null(v)) {
        if (required) return mf_cfg_bad(s, s->prefix, key, expected, v ? "null" : "nothing (the field is missing)");
        *out = def;
        return 0;
    }
    if (!json_is_number(v)) return mf_cfg_bad(s, s->prefix, key, expected, mf_json_kind(v));
    double x = json_number_value(v);
    if (!(lo_open ? x > lo : x >= lo) || !(x <= hi)) {
        snprintf(found, sizeof found, "%g", x);
        return mf_cfg_bad(s, s->prefix, key, expected, found);
    }
    *out = x;
    return 0;
}

/* List of integers, each in [lo, hi], at most cap entries. */
static int mf_cfg_list(const mf_cfg_src *s, const char *key, int64_t lo, int64_t hi, int cap,
                       int required, int64_t *vals, int *n)
{
    json_t *v = json_object_get(s->model, key);
    char expected[128], found[96];
    snprintf(expected, sizeof expected, "a list of at most %d integers in [%" PRId64 ", %" PRId64 "]",
             cap, lo, hi);
    *n = 0;
    if (!v || json_is_null(v)) {
        if (required) return mf_cfg_bad(s, s->prefix, key, expected, v ? "null" : "nothing (the field is missing)");
        return 0;
    }
    if (!json_is_array(v)) return mf_cfg_bad(s, s->prefix, key, expected, mf_json_kind(v));
    size_t len = json_array_size(v);
    if (len > (size_t)cap) {
        snprintf(found, sizeof found, "%zu entries", len);
        return mf_cfg_bad(s, s->prefix, key, expected, found);
    }
    for (size_t i = 0; i < len; i++) {
        json_t *e = json_array_get(v, i);
        if (!json_is_integer(e)) {
            snprintf(found, sizeof found, "%s at index %zu", mf_json_kind(e), i);
            return mf_cfg_bad(s, s->prefix, key, expected, found);
        }
        int64_t x = json_integer_value(e);
        if (x < lo || x > hi) {
            snprintf(found, sizeof found, "%" PRId64 " at index %zu", x, i);
            return mf_cfg_bad(s, s->prefix, key, expected, found);
        }
        vals[i] = x;
    }
    *n = (int)len;
    return 0;
}

static int mf_cfg_list_i32(const mf_cfg_src *s, const char *key, int64_t lo, int64_t hi, int cap,
                           int required, int *vals, int *n)
{
    int64_t tmp[MF_CONFIG_MAX_LAYERS];
    int rc = mf_cfg_list(s, key, lo, hi, cap, required, tmp, n);
    for (int i = 0; rc == 0 && i < *n; i++) vals[i] = (int)tmp[i];
    return rc;
}

/* String field of obj; NULL result when absent and !required. */
static int mf_cfg_str(const mf_cfg_src *s, json_t *obj, const char *prefix, const char *key,
                      const char *expected, int required, const char **out)
{
    json_t *v = json_object_get(obj, key);
    *out = NULL;
    if (!v || json_is_null(v)) {
        if (required) return mf_cfg_bad(s, prefix, key, expected, v ? "null" : "nothing (the field is missing)");
        return 0;
    }
    if (!json_is_string(v)) return mf_cfg_bad(s, prefix, key, expected, mf_json_kind(v));
    *out = json_string_value(v);
    return 0;
}

static int mf_cfg_bool(const mf_cfg_src *s, const char *key, int def, int *out)
{
    json_t *v = json_object_get(s->model, key);
    if (!v || json_is_null(v)) {
        *out = def;
        return 0;
    }
    if (!json_is_boolean(v)) return mf_cfg_bad(s, s->prefix, key, "true or false", mf_json_kind(v));
    *out = json_is_true(v);
    return 0;
}

static int mf_cfg_rope_scaling(const mf_cfg_src *s, mf_config *c)
{
    json_t *rs = json_object_get(s->model, "rope_scaling");
    c->yarn_factor = 0;
    c->yarn_defaulted = 0;
    if (!rs || json_is_null(rs)) {   /* the released defaults, as the oracle applies them */
        c->yarn_factor = MF_CONFIG_YARN_FACTOR;
        c->yarn_original_max_position_embeddings = MF_CONFIG_YARN_ORIGINAL_MAX_POSITIONS;
        c->yarn_beta_fast = MF_CONFIG_YARN_BETA_FAST;
        c->yarn_beta_slow = MF_CONFIG_YARN_BETA_SLOW;
        c->yarn_defaulted = 1;
        return 0;
    }
    if (!json_is_object(rs))
        return mf_cfg_bad(s, s->prefix, "rope_scaling", "an object", mf_json_kind(rs));
    char prefix[64];
    snprintf(prefix, sizeof prefix, "%srope_scaling.", s->prefix);
    mf_cfg_src sub = {s->what, rs, prefix, NULL, NULL};
    const char *type = NULL;
    int rc = mf_cfg_str(&sub, rs, prefix, "rope_type", "\"yarn\"", 0, &type);
    if (rc == 0 && !type) rc = mf_cfg_str(&sub, rs, prefix, "type", "\"yarn\"", 1, &type);
    if (rc) return rc;
    if (strcmp(type, "yarn") != 0) {
        char found[80];
        snprintf(found, sizeof found, "\"%.60s\"", type);
        return mf_cfg_bad(s, prefix, json_object_get(rs, "rope_type") ? "rope_type" : "type",
                          "\"yarn\" (the only scaling V4.1 uses)", found);
    }
    if ((rc = mf_cfg_real(&sub, "factor", 0, 1e6, 1, 1, 0, &c->yarn_factor))) return rc;
    if ((rc = mf_cfg_int(&sub, "original_max_position_embeddings", 1, INT64_C(1) << 40, 1, 0,
                         &c->yarn_original_max_position_embeddings)))
        return rc;
    if ((rc = mf_cfg_real(&sub, "beta_fast", 0, 1e6, 0, 0, MF_CONFIG_YARN_BETA_FAST, &c->yarn_beta_fast)))
        return rc;
    if ((rc = mf_cfg_real(&sub, "beta_slow", 0, 1e6, 0, 0, MF_CONFIG_YARN_BETA_SLOW, &c->yarn_beta_slow)))
        return rc;
    return 0;
}

static int mf_cfg_quant(const mf_cfg_src *s, mf_config *c)
{
    json_t *q = s->quant;
    const char *qp = s->qprefix;
    const char *str;
    char found[96];
    int rc;
    if ((rc = mf_cfg_str(s, q, qp, "quant_method", "\"fp8\"", 1, &str))) return rc;
    if (strcmp(str, "fp8") != 0) {
        snprintf(found, sizeof found, "\"%.60s\"", str);
        return mf_cfg_bad(s, qp, "quant_method", "\"fp8\"", found);
    }
    if ((rc = mf_cfg_str(s, q, qp, "fmt", "\"e4m3\"", 0, &str))) return rc;
    if (str && strcmp(str, "e4m3") != 0) {
        snprintf(found, sizeof found, "\"%.60s\"", str);
        return mf_cfg_bad(s, qp, "fmt", "\"e4m3\"", found);
    }
    if ((rc = mf_cfg_str(s, q, qp, "scale_fmt", "\"ue8m0\"", 1, &str))) return rc;
    if (strcmp(str, "ue8m0") != 0) {
        snprintf(found, sizeof found, "\"%.60s\"", str);
        return mf_cfg_bad(s, qp, "scale_fmt", "\"ue8m0\"", found);
    }
    if ((rc = mf_cfg_str(s, q, qp, "expert_dtype", "\"fp4\"", 1, &str))) return rc;
    if (strcmp(str, "fp4") != 0) {
        snprintf(found, sizeof found, "\"%.60s\"", str);
        return mf_cfg_bad(s, qp, "expert_dtype", "\"fp4\" (packed e2m1 experts)", found);
    }
    mf_cfg_src sub = {s->what, q, qp, NULL, NULL};
    int64_t wbs[2];
    int n;
    if ((rc = mf_cfg_list(&sub, "weight_block_size", 1, 4096, 2, 1, wbs, &n))) return rc;
    if (n != 2) {
        snprintf(found, sizeof found, "%d entries", n);
        return mf_cfg_bad(s, qp, "weight_block_size", "2 entries [out, in]", found);
    }
    c->quant_block_out = (int)wbs[0];
    c->quant_block_in = (int)wbs[1];
    return 0;
}

/* The DSpark draft's fields, with the oracle's defaults when absent (checked by mf_config_check
 * only when the config has draft stages). */
static int mf_cfg_dspark(const mf_cfg_src *s, mf_config *c)
{
    const int IMAX = 1 << 30;
    int rc;
    if ((rc = mf_cfg_i32(s, "dspark_block_size", 0, 4096, 0, MF_CONFIG_DSPARK_BLOCK, &c->dspark_block_size)) ||
        (rc = mf_cfg_i32(s, "dspark_noise_token_id", 0, IMAX, 0, MF_CONFIG_DSPARK_NOISE,
                         &c->dspark_noise_token_id)) ||
        (rc = mf_cfg_i32(s, "dspark_markov_rank", 0, 1 << 20, 0, MF_CONFIG_DSPARK_RANK, &c->dspark_markov_rank)) ||
        (rc = mf_cfg_i32(s, "dspark_n_routed_experts", 1, 1 << 20, 0, MF_CONFIG_DSPARK_EXPERTS,
                         &c->dspark_n_routed_experts)) ||
        (rc = mf_cfg_i32(s, "dspark_num_experts_per_tok", 1, 1 << 20, 0, MF_CONFIG_DSPARK_TOPK,
                         &c->dspark_num_experts_per_tok)))
        return rc;
    json_t *v = json_object_get(s->model, "dspark_target_layer_ids");
    if (!v || json_is_null(v)) {
        static const int def[] = MF_CONFIG_DSPARK_TARGETS;
        c->n_dspark_target = (int)(sizeof def / sizeof def[0]);
        memcpy(c->dspark_target_layer_ids, def, sizeof def);
        return 0;
    }
    return mf_cfg_list_i32(s, "dspark_target_layer_ids", 0, IMAX, MF_CONFIG_MAX_IDS, 1,
                           c->dspark_target_layer_ids, &c->n_dspark_target);
}

static int mf_cfg_read(const mf_cfg_src *s, mf_config *c)
{
    const int64_t BIG = INT64_C(1) << 40;
    const int IMAX = 1 << 30;
    int rc = 0;
    int64_t list[MF_CONFIG_MAX_LAYERS];
    int n;
    memset(c, 0, sizeof *c);
#define TRY(x) do { if ((rc = (x))) return rc; } while (0)
    TRY(mf_cfg_int(s, "vocab_size", 1, IMAX, 1, 0, &c->vocab_size));
    TRY(mf_cfg_i32(s, "hidden_size", 1, 1 << 20, 1, 0, &c->hidden_size));
    TRY(mf_cfg_i32(s, "num_hidden_layers", 1, MF_CONFIG_MAX_LAYERS, 1, 0, &c->n_layers));
    TRY(mf_cfg_i32(s, "num_attention_heads", 1, 4096, 1, 0, &c->n_heads));
    TRY(mf_cfg_i32(s, "num_key_value_heads", 1, 4096, 0, 1, &c->n_kv_heads));
    TRY(mf_cfg_i32(s, "head_dim", 1, 1 << 16, 1, 0, &c->head_dim));
    TRY(mf_cfg_i32(s, "qk_rope_head_dim", 0, 1 << 16, 1, 0, &c->qk_rope_head_dim));
    TRY(mf_cfg_i32(s, "q_lora_rank", 1, 1 << 20, 1, 0, &c->q_lora_rank));
    TRY(mf_cfg_i32(s, "o_groups", 1, 4096, 1, 0, &c->o_groups));
    TRY(mf_cfg_i32(s, "o_lora_rank", 1, 1 << 20, 1, 0, &c->o_lora_rank));
    TRY(mf_cfg_real(s, "rms_norm_eps", 0, 1, 1, 1, 0, &c->rms_norm_eps));
    TRY(mf_cfg_i32(s, "bos_token_id", 0, IMAX, 1, 0, &c->bos_token_id));
    {   /* eos may be a list in HF configs: the first entry is the end of sequence */
        json_t *v = json_object_get(s->model, "eos_token_id");
        if (v && json_is_array(v) && json_array_size(v) > 0) {
            mf_cfg_src one = *s;
            json_t *tmp = json_object();
            json_object_set(tmp, "eos_token_id", json_array_get(v, 0));
            one.model = tmp;
            rc = mf_cfg_i32(&one, "eos_token_id", 0, IMAX, 1, 0, &c->eos_token_id);
            json_decref(tmp);
            if (rc) return rc;
        } else {
            TRY(mf_cfg_i32(s, "eos_token_id", 0, IMAX, 1, 0, &c->eos_token_id));
        }
    }
    TRY(mf_cfg_i32(s, "pad_token_id", 0, IMAX, 0, -1, &c->pad_token_id));
    TRY(mf_cfg_int(s, "max_position_embeddings", 1, BIG, 0, 1048576, &c->max_position_embeddings));
    TRY(mf_cfg_real(s, "rope_theta", 0, 1e12, 1, 1, 0, &c->rope_theta));
    TRY(mf_cfg_real(s, "compress_rope_theta", 0, 1e12, 1, 1, 0, &c->compress_rope_theta));
    TRY(mf_cfg_rope_scaling(s, c));
    TRY(mf_cfg_i32(s, "sliding_window", 1, IMAX, 1, 0, &c->sliding_window));
    TRY(mf_cfg_i32(s, "num_nextn_predict_layers", 0, 64, 0, 0, &c->n_mtp_layers));
    TRY(mf_cfg_list(s, "compress_ratios", 0, 1 << 20, MF_CONFIG_MAX_LAYERS, 1, list, &n));
    if (n != c->n_layers + c->n_mtp_layers) {
        char exp[96], found[64];
        snprintf(exp, sizeof exp, "%d entries (num_hidden_layers %d + num_nextn_predict_layers %d)",
                 c->n_layers + c->n_mtp_layers, c->n_layers, c->n_mtp_layers);
        snprintf(found, sizeof found, "%d entries", n);
        return mf_cfg_bad(s, s->prefix, "compress_ratios", exp, found);
    }
    for (int i = 0; i < n; i++) c->compress_ratios[i] = (int)list[i];
    TRY(mf_cfg_list_i32(s, "kv_source_layer_ids", 0, IMAX, MF_CONFIG_MAX_IDS, 0,
                        c->kv_source_layer_ids, &c->n_kv_source));
    TRY(mf_cfg_list_i32(s, "index_source_layer_ids", 0, IMAX, MF_CONFIG_MAX_IDS, 0,
                        c->index_source_layer_ids, &c->n_index_source));
    int need_idx = c->n_index_source > 0;
    TRY(mf_cfg_i32(s, "index_n_heads", 1, 4096, need_idx, 0, &c->index_n_heads));
    TRY(mf_cfg_i32(s, "index_head_dim", 1, 1 << 16, need_idx, 0, &c->index_head_dim));
    TRY(mf_cfg_i32(s, "index_topk", 1, IMAX, need_idx, 0, &c->index_topk));
    TRY(mf_cfg_i32(s, "candidate_source_layer_id", 0, IMAX, 0, -1, &c->candidate_source_layer_id));
    int need_cand = c->candidate_source_layer_id >= 0;
    TRY(mf_cfg_i32(s, "candidate_topk_blocks", 1, IMAX, need_cand, 0, &c->candidate_topk_blocks));
    TRY(mf_cfg_i32(s, "candidate_block_size", 1, IMAX, need_cand, 0, &c->candidate_block_size));
    TRY(mf_cfg_i32(s, "n_routed_experts", 1, 1 << 20, 1, 0, &c->n_routed_experts));
    TRY(mf_cfg_i32(s, "num_experts_per_tok", 1, 1 << 20, 1, 0, &c->n_experts_per_tok));
    TRY(mf_cfg_i32(s, "n_shared_experts", 0, 64, 1, 0, &c->n_shared_experts));
    TRY(mf_cfg_i32(s, "moe_intermediate_size", 1, 1 << 20, 1, 0, &c->moe_intermediate_size));
    {
        const char *sf;
        TRY(mf_cfg_str(s, s->model, s->prefix, "scoring_func",
                       "\"sqrtsoftplus\", \"softmax\" or \"sigmoid\"", 1, &sf));
        if (!strcmp(sf, "sqrtsoftplus")) c->scoring_func = MF_SCORING_SQRTSOFTPLUS;
        else if (!strcmp(sf, "softmax")) c->scoring_func = MF_SCORING_SOFTMAX;
        else if (!strcmp(sf, "sigmoid")) c->scoring_func = MF_SCORING_SIGMOID;
        else {
            char found[80];
            snprintf(found, sizeof found, "\"%.60s\"", sf);
            return mf_cfg_bad(s, s->prefix, "scoring_func",
                              "\"sqrtsoftplus\", \"softmax\" or \"sigmoid\"", found);
        }
    }
    TRY(mf_cfg_bool(s, "norm_topk_prob", 1, &c->norm_topk_prob));
    TRY(mf_cfg_real(s, "routed_scaling_factor", 0, 1e6, 1, 1, 0, &c->routed_scaling_factor));
    TRY(mf_cfg_real(s, "swiglu_limit", 0, 1e9, 0, 1, 0, &c->swiglu_limit));
    TRY(mf_cfg_i32(s, "hc_mult", 1, 64, 1, 0, &c->hc_mult));
    TRY(mf_cfg_real(s, "hc_eps", 0, 1, 0, 1, 0, &c->hc_eps));
    TRY(mf_cfg_i32(s, "hc_sinkhorn_iters", 1, 10000, 1, 0, &c->hc_sinkhorn_iters));
    TRY(mf_cfg_list_i32(s, "engram_layer_ids", 0, IMAX, MF_CONFIG_MAX_ENGRAM, 0,
                        c->engram_layer_ids, &c->n_engram));
    int need_eng = c->n_engram > 0;
    TRY(mf_cfg_list(s, "engram_num_embeddings", 1, BIG, MF_CONFIG_MAX_ENGRAM, need_eng,
                    c->engram_num_embeddings, &n));
    if (n != c->n_engram) {
        char exp[96], found[64];
        snprintf(exp, sizeof exp, "one entry per engram_layer_ids entry (%d)", c->n_engram);
        snprintf(found, sizeof found, "%d entries", n);
        return mf_cfg_bad(s, s->prefix, "engram_num_embeddings", exp, found);
    }
    TRY(mf_cfg_i32(s, "engram_max_ngram_size", 2, 64, need_eng, 0, &c->engram_max_ngram_size));
    TRY(mf_cfg_i32(s, "engram_n_heads", 1, 4096, need_eng, 0, &c->engram_n_heads));
    TRY(mf_cfg_i32(s, "engram_head_dim", 1, 1 << 16, need_eng, 0, &c->engram_head_dim));
    TRY(mf_cfg_int(s, "engram_vocab_size", 1, BIG, 0, 0, &c->engram_vocab_size));
    TRY(mf_cfg_int(s, "engram_compressed_vocab_size", 1, IMAX, need_eng, 0,
                   &c->engram_compressed_vocab_size));
    TRY(mf_cfg_i32(s, "engram_pad_token_id", 0, IMAX, 0, c->pad_token_id,
                   &c->engram_pad_token_id));
    TRY(mf_cfg_dspark(s, c));
    TRY(mf_cfg_quant(s, c));
#undef TRY
    return mf_config_check(s->what, s->prefix, c);
}

int mf_config_parse(const char *what, const char *json, mf_config *out)
{
    json_error_t jerr;
    json_t *root = json_loads(json, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return mf_error(-EINVAL, "%s: not valid JSON: line %d column %d: %s", what, jerr.line,
                        jerr.column, jerr.text);
    int rc;
    if (!json_is_object(root)) {
        rc = mf_error(-EINVAL, "%s: expected a JSON object at the top, found %s", what,
                      mf_json_kind(root));
        json_decref(root);
        return rc;
    }
    mf_cfg_src s = {what, root, "", NULL, "quantization_config."};
    json_t *tc = json_object_get(root, "text_config");
    if (tc) {   /* HF nested dialect */
        if (!json_is_object(tc)) {
            rc = mf_cfg_bad(&s, "", "text_config", "an object", mf_json_kind(tc));
            json_decref(root);
            return rc;
        }
        s.model = tc;
        s.prefix = "text_config.";
        s.quant = json_object_get(tc, "quantization_config");
        if (s.quant) s.qprefix = "text_config.quantization_config.";
    }
    if (!s.quant) s.quant = json_object_get(root, "quantization_config");
    if (!s.quant || !json_is_object(s.quant)) {
        rc = mf_cfg_bad(&s, "", "quantization_config",
                        "an object (fp8 dense weights, ue8m0 scales, fp4 experts)",
                        s.quant ? mf_json_kind(s.quant) : "nothing (the field is missing)");
        json_decref(root);
        return rc;
    }
    rc = mf_cfg_read(&s, out);
    json_decref(root);
    return rc;
}

int mf_config_load(const char *path, mf_config *out)
{
    FILE *f = fopen(path, "rb");
    if (!f) return mf_error(-errno, "%s: cannot open config: %s", path, strerror(errno));
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 65536 + 1 > cap) {
            cap = cap ? cap * 2 : 131072;
            if (cap > (64u << 20)) {
                free(buf);
                fclose(f);
                return mf_error(-EFBIG, "%s: config larger than 64 MiB", path);
            }
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf);
                fclose(f);
                return mf_error(-ENOMEM, "%s: out of memory reading config", path);
            }
            buf = nb;
        }
        size_t got = fread(buf + len, 1, cap - len - 1, f);
        len += got;
        if (got == 0) break;
    }
    int err = ferror(f);
    fclose(f);
    if (err) {
        free(buf);
        return mf_error(-EIO, "%s: read error", path);
    }
    buf[len] = '\0';
    int rc = mf_config_parse(path, buf, out);
    free(buf);
    return rc;
}

/* ---- validation ---------------------------------------------------------------------------- */

static int mf_ids_check(const char *what, const char *pfx, const char *field, const int *ids, int n,
                        int n_layers)
{
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= n_layers)
            return mf_error(-EINVAL,
                            "%s: field '%s%s': expected layer ids in [0, %d) (num_hidden_layers %d), "
                            "found %d at index %d",
                            what, pfx, field, n_layers, n_layers, ids[i], i);
        if (i > 0 && ids[i] <= ids[i - 1])
            return mf_error(-EINVAL,
                            "%s: field '%s%s': expected strictly increasing layer ids, found %d after %d",
                            what, pfx, field, ids[i], ids[i - 1]);
    }
    return 0;
}

static int mf_in_list(const int *ids, int n, int x)
{
    for (int i = 0; i < n; i++)
        if (ids[i] == x) return 1;
    return 0;
}

#define BAD(field, fmt, w, ...) \
    return mf_error(-EINVAL, "%s: field '%s" field "': " fmt, w, pfx, __VA_ARGS__)

/* Sizes, token ids, positions: ranges and the divisibility the formats need (fp8 tiles and
 * activation blocks of 32, fp4 scale blocks of 32, fake-quant blocks of 32 and 16). */
static int mf_check_shape(const char *what, const char *pfx, const mf_config *c)
{
    if (c->n_layers < 1 || c->n_layers + c->n_mtp_layers > MF_CONFIG_MAX_LAYERS)
        BAD("num_hidden_layers", "expected 1..%d layers with the MTP blocks, found %d + %d", what,
            MF_CONFIG_MAX_LAYERS, c->n_layers, c->n_mtp_layers);
    if (c->vocab_size < 1) BAD("vocab_size", "expected > 0, found %" PRId64, what, c->vocab_size);
    if (c->hidden_size < 32 || c->hidden_size % 32)
        BAD("hidden_size", "expected a positive multiple of 32 (fp4 scale blocks), found %d", what,
            c->hidden_size);
    if (c->head_dim < 32 || c->head_dim % 32)
        BAD("head_dim", "expected a positive multiple of 32 (the window KV's fp8 blocks), found %d", what,
            c->head_dim);
    if (c->q_lora_rank < 32 || c->q_lora_rank % 32)
        BAD("q_lora_rank", "expected a positive multiple of 32 (activation blocks), found %d", what,
            c->q_lora_rank);
    if (c->qk_rope_head_dim < 2 || c->qk_rope_head_dim > c->head_dim || c->qk_rope_head_dim % 2)
        BAD("qk_rope_head_dim", "expected an even number in [2, head_dim %d], found %d", what,
            c->head_dim, c->qk_rope_head_dim);
    if (c->n_kv_heads != 1)   /* the oracle's: V4.1 shares one latent KV head */
        BAD("num_key_value_heads", "expected 1 (V4.1's attention has one shared latent KV head), found %d",
            what, c->n_kv_heads);
    if (c->n_heads < 1) BAD("num_attention_heads", "expected > 0, found %d", what, c->n_heads);
    if (c->o_groups < 1 || c->n_heads % c->o_groups)
        BAD("o_groups", "expected a divisor of num_attention_heads %d, found %d", what, c->n_heads,
            c->o_groups);
    if (c->o_lora_rank < 1) BAD("o_lora_rank", "expected > 0, found %d", what, c->o_lora_rank);
    if (!(c->rms_norm_eps > 0)) BAD("rms_norm_eps", "expected > 0, found %g", what, c->rms_norm_eps);
    if (c->bos_token_id < 0 || c->bos_token_id >= c->vocab_size)
        BAD("bos_token_id", "expected a token id < vocab_size %" PRId64 ", found %d", what,
            c->vocab_size, c->bos_token_id);
    if (c->eos_token_id < 0 || c->eos_token_id >= c->vocab_size)
        BAD("eos_token_id", "expected a token id < vocab_size %" PRId64 ", found %d", what,
            c->vocab_size, c->eos_token_id);
    if (c->pad_token_id >= c->vocab_size)
        BAD("pad_token_id", "expected a token id < vocab_size %" PRId64 ", found %d", what,
            c->vocab_size, c->pad_token_id);
    if (!(c->rope_theta > 0)) BAD("rope_theta", "expected > 0, found %g", what, c->rope_theta);
    if (!(c->compress_rope_theta > 0))
        BAD("compress_rope_theta", "expected > 0, found %g", what, c->compress_rope_theta);
    if (c->sliding_window < 1)
        BAD("sliding_window", "expected > 0, found %d", what, c->sliding_window);
    if (c->quant_block_out < 1 || c->quant_block_in < 1)
        BAD("quantization_config.weight_block_size", "expected two positive sizes, found [%d, %d]",
            what, c->quant_block_out, c->quant_block_in);
    return 0;
}

/* The attention topology as the oracle builds it: window-only layers are no sources; every
 * compressed layer reads the latest KV source at or before it, which must have its ratio (the
 * oracle: "needs a preceding KV source with the same compression ratio"), and takes its top-k
 * from the latest index source since that KV source; KV sources are index sources; the candidate
 * layer is a KV source (the oracle: "a Full-mode KV source") and every index layer after it reads
 * its KV source (another KV source starts a new attention state without candidates, which the
 * oracle's indexer refuses). */
static int mf_check_topology(const char *what, const char *pfx, const mf_config *c)
{
    for (int i = 0; i < c->n_layers + c->n_mtp_layers; i++)
        if (c->compress_ratios[i] < 0 || c->compress_ratios[i] > 2)
            BAD("compress_ratios", "expected 0 (window only), 1 or 2 per layer, found %d at index %d",
                what, c->compress_ratios[i], i);
    int rc;
    if ((rc = mf_ids_check(what, pfx, "kv_source_layer_ids", c->kv_source_layer_ids, c->n_kv_source,
                           c->n_layers)))
        return rc;
    if ((rc = mf_ids_check(what, pfx, "index_source_layer_ids", c->index_source_layer_ids,
                           c->n_index_source, c->n_layers)))
        return rc;
    for (int i = 0; i < c->n_index_source; i++)
        if (c->compress_ratios[c->index_source_layer_ids[i]] == 0)
            BAD("index_source_layer_ids",
                "expected compressed layers (compress_ratios != 0), found layer %d with ratio 0",
                what, c->index_source_layer_ids[i]);
    for (int i = 0; i < c->n_kv_source; i++) {
        int l = c->kv_source_layer_ids[i];
        if (c->compress_ratios[l] == 0)
            BAD("kv_source_layer_ids",
                "expected compressed layers (compress_ratios != 0), found layer %d with ratio 0", what, l);
        if (!mf_in_list(c->index_source_layer_ids, c->n_index_source, l))
            BAD("kv_source_layer_ids",
                "expected every KV-source layer to be an index source too, found layer %d missing "
                "from index_source_layer_ids", what, l);
    }
    int src = -1, idx = -1;
    for (int L = 0; L < c->n_layers; L++) {
        int r = c->compress_ratios[L];
        if (mf_in_list(c->kv_source_layer_ids, c->n_kv_source, L)) src = L, idx = -1;
        if (mf_in_list(c->index_source_layer_ids, c->n_index_source, L)) idx = L;
        if (r == 0) continue;
        if (src < 0)
            BAD("compress_ratios", "expected compressed layer %d (ratio %d) to have a KV source of the same "
                "ratio at or before it, found none (kv_source_layer_ids)", what, L, r);
        if (c->compress_ratios[src] != r)
            BAD("compress_ratios", "expected compressed layer %d (ratio %d) to have a KV source of the same "
                "ratio at or before it, found KV source %d of ratio %d", what, L, r, src,
                c->compress_ratios[src]);
        if (idx < 0)   /* unreachable while KV sources are index sources; kept for the invariant */
            BAD("index_source_layer_ids", "expected an index source between KV source %d and compressed "
                "layer %d, found none", what, src, L);
    }
    if (c->n_index_source > 0) {
        if (c->index_n_heads < 1 || c->index_topk < 1)
            BAD("index_n_heads", "expected index_n_heads and index_topk > 0, found %d, %d", what,
                c->index_n_heads, c->index_topk);
        if (c->index_head_dim < 32 || c->index_head_dim % 32 || c->index_head_dim > c->head_dim)
            BAD("index_head_dim", "expected a multiple of 32 (the index keys' fp4 blocks) in [32, head_dim "
                "%d], found %d", what, c->head_dim, c->index_head_dim);
    }
    if (c->index_head_dim > 0 && c->qk_rope_head_dim > c->index_head_dim)
        BAD("qk_rope_head_dim", "expected at most index_head_dim %d (the oracle ropes the index keys' tail), "
            "found %d", what, c->index_head_dim, c->qk_rope_head_dim);
    int cl = c->candidate_source_layer_id;
    if (cl >= 0) {
        if (cl >= c->n_layers || !mf_in_list(c->kv_source_layer_ids, c->n_kv_source, cl))
            BAD("candidate_source_layer_id", "expected one of kv_source_layer_ids (the oracle's candidate "
                "layer is a KV source), found %d", what, cl);
        for (int i = 0; i < c->n_kv_source; i++)
            if (c->kv_source_layer_ids[i] > cl)
                BAD("index_source_layer_ids", "expected every index layer after candidate_source_layer_id %d to "
                    "read its KV source, found index layer %d on KV source %d", what, cl,
                    c->kv_source_layer_ids[i], c->kv_source_layer_ids[i]);
        int64_t held = (int64_t)c->candidate_topk_blocks * c->candidate_block_size -
                       (c->candidate_block_size - 1);
        if (c->candidate_topk_blocks < 1 || c->candidate_block_size < 1 || held < c->index_topk)
            BAD("candidate_topk_blocks",
                "expected candidate_topk_blocks x candidate_block_size - (block - 1) >= index_topk "
                "%d, found %d x %d", what, c->index_topk, c->candidate_topk_blocks,
                c->candidate_block_size);
    }
    return 0;
}

/* MoE, hyper-connections, Engram. */
static int mf_check_moe(const char *what, const char *pfx, const mf_config *c)
{
    if (c->n_routed_experts < 1)
        BAD("n_routed_experts", "expected > 0, found %d", what, c->n_routed_experts);
    if (c->n_experts_per_tok < 1 || c->n_experts_per_tok > c->n_routed_experts || c->n_experts_per_tok > 256)
        BAD("num_experts_per_tok", "expected 1..n_routed_experts (%d) and at most 256, found %d", what,
            c->n_routed_experts, c->n_experts_per_tok);
    if (c->scoring_func != MF_SCORING_SQRTSOFTPLUS)
        BAD("scoring_func", "expected \"sqrtsoftplus\" (V4.1 routes with it; the oracle's gate refuses "
            "others), found \"%s\"", what, mf_scoring_name(c->scoring_func));
    if (c->moe_intermediate_size < 32 || c->moe_intermediate_size % 32)
        BAD("moe_intermediate_size",
            "expected a positive multiple of 32 (fp4 scale blocks), found %d", what,
            c->moe_intermediate_size);
    if (!(c->routed_scaling_factor > 0))
        BAD("routed_scaling_factor", "expected > 0, found %g", what, c->routed_scaling_factor);
    if (!(c->swiglu_limit >= 0)) BAD("swiglu_limit", "expected >= 0, found %g", what, c->swiglu_limit);
    if (c->hc_mult < 1 || c->hc_mult > 16) BAD("hc_mult", "expected 1..16, found %d", what, c->hc_mult);
    if (!(c->hc_eps >= 0)) BAD("hc_eps", "expected >= 0, found %g", what, c->hc_eps);
    if (c->hc_sinkhorn_iters < 1)
        BAD("hc_sinkhorn_iters", "expected >= 1, found %d", what, c->hc_sinkhorn_iters);
    int rc = mf_ids_check(what, pfx, "engram_layer_ids", c->engram_layer_ids, c->n_engram, c->n_layers);
    if (rc || c->n_engram == 0) return rc;
    for (int i = 0; i < c->n_engram; i++)
        if (c->engram_num_embeddings[i] < 1)
            BAD("engram_num_embeddings", "expected > 0 rows, found %" PRId64 " at index %d",
                what, c->engram_num_embeddings[i], i);
    if (c->engram_max_ngram_size < 2 || c->engram_max_ngram_size > 8)
        BAD("engram_max_ngram_size", "expected 2..8, found %d", what, c->engram_max_ngram_size);
    if (c->engram_n_heads < 1)
        BAD("engram_n_heads", "expected > 0, found %d", what, c->engram_n_heads);
    if (c->engram_head_dim < 32 || c->engram_head_dim % 32)
        BAD("engram_head_dim", "expected a positive multiple of 32 (one scale per 32), found %d",
            what, c->engram_head_dim);
    if (c->engram_vocab_size < 2)
        BAD("engram_vocab_size", "expected >= 2 (the hash primes' search starts from it), found %" PRId64,
            what, c->engram_vocab_size);
    if (c->engram_compressed_vocab_size < 1 || c->engram_compressed_vocab_size > c->vocab_size)
        BAD("engram_compressed_vocab_size", "expected 1..vocab_size (%" PRId64 "), found %" PRId64,
            what, c->vocab_size, c->engram_compressed_vocab_size);
    if (c->engram_pad_token_id < 0 || c->engram_pad_token_id >= c->vocab_size)
        BAD("engram_pad_token_id", "expected a token id < vocab_size %" PRId64 ", found %d", what,
            c->vocab_size, c->engram_pad_token_id);
    return 0;
}

/* The DSpark draft (only with draft stages): the oracle's DeepseekV41DSparkModel needs window-only
 * stages (compress ratio 0), a positive Markov rank, target layers inside the backbone (strictly
 * increasing), a noise token in the vocabulary; its MoE top-k within its experts. */
static int mf_check_draft(const char *what, const char *pfx, const mf_config *c)
{
    if (c->n_mtp_layers == 0) return 0;
    for (int s = 0; s < c->n_mtp_layers; s++)
        if (c->compress_ratios[c->n_layers + s] != 0)
            BAD("compress_ratios", "expected 0 (window only) for draft stage %d at index %d, found %d", what, s,
                c->n_layers + s, c->compress_ratios[c->n_layers + s]);
    if (c->dspark_block_size < 1)
        BAD("dspark_block_size", "expected >= 1 draft positions with num_nextn_predict_layers %d, found %d",
            what, c->n_mtp_layers, c->dspark_block_size);
    if (c->dspark_noise_token_id < 0 || c->dspark_noise_token_id >= c->vocab_size)
        BAD("dspark_noise_token_id", "expected a token id < vocab_size %" PRId64 ", found %d", what,
            c->vocab_size, c->dspark_noise_token_id);
    if (c->n_dspark_target < 1)
        BAD("dspark_target_layer_ids", "expected at least one target layer, found %d", what, c->n_dspark_target);
    int rc = mf_ids_check(what, pfx, "dspark_target_layer_ids", c->dspark_target_layer_ids, c->n_dspark_target,
                          c->n_layers);
    if (rc) return rc;
    if (c->dspark_markov_rank < 1)
        BAD("dspark_markov_rank", "expected > 0 (the oracle's draft requires a Markov head), found %d", what,
            c->dspark_markov_rank);
    if (c->dspark_n_routed_experts < 1)
        BAD("dspark_n_routed_experts", "expected > 0, found %d", what, c->dspark_n_routed_experts);
    if (c->dspark_num_experts_per_tok < 1 || c->dspark_num_experts_per_tok > c->dspark_n_routed_experts ||
        c->dspark_num_experts_per_tok > 256)
        BAD("dspark_num_experts_per_tok", "expected 1..dspark_n_routed_experts (%d) and at most 256, found %d",
            what, c->dspark_n_routed_experts, c->dspark_num_experts_per_tok);
    return 0;
}
#undef BAD

/* Validation with the prefix the fields carry in the file ("" or "text_config."). */
static int mf_config_check(const char *what, const char *pfx, const mf_config *c)
{
    int rc = mf_check_shape(what, pfx, c);
    if (!rc) rc = mf_check_topology(what, pfx, c);
    if (!rc) rc = mf_check_moe(what, pfx, c);
    if (!rc) rc = mf_check_draft(what, pfx, c);
    return rc;
}

int mf_config_validate(const char *what, const mf_config *c) { return mf_config_check(what, "", c); }

/* ---- writing ------------------------------------------------------------------------------- */

static json_t *mf_json_ints(const int *v, int n)
{
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_integer(v[i]));
    return a;
}

char *mf_config_to_json(const mf_config *c)
{
    json_t *o = json_object();
#define SETI(k, v) json_object_set_new(o, k, json_integer(v))
#define SETR(k, v) json_object_set_new(o, k, json_real(v))
    json_object_set_new(o, "architectures", json_pack("[s]", "DeepseekV41ForCausalLM"));
    json_object_set_new(o, "model_type", json_string("deepseek_v41"));
    SETI("vocab_size", c->vocab_size);
    SETI("hidden_size", c->hidden_size);
    SETI("num_hidden_layers", c->n_layers);
    SETI("num_attention_heads", c->n_heads);
    SETI("num_key_value_heads", c->n_kv_heads);
    SETI("head_dim", c->head_dim);
    SETI("qk_rope_head_dim", c->qk_rope_head_dim);
    SETI("q_lora_rank", c->q_lora_rank);
    SETI("o_groups", c->o_groups);
    SETI("o_lora_rank", c->o_lora_rank);
    SETR("rms_norm_eps", c->rms_norm_eps);
    SETI("bos_token_id", c->bos_token_id);
    SETI("eos_token_id", c->eos_token_id);
    json_object_set_new(o, "pad_token_id",
                        c->pad_token_id >= 0 ? json_integer(c->pad_token_id) : json_null());
    SETI("max_position_embeddings", c->max_position_embeddings);
    SETR("rope_theta", c->rope_theta);
    SETR("compress_rope_theta", c->compress_rope_theta);
    if (c->yarn_factor > 0)
        json_object_set_new(o, "rope_scaling",
                            json_pack("{s:s, s:f, s:I, s:f, s:f}", "rope_type", "yarn", "factor",
                                      c->yarn_factor, "original_max_position_embeddings",
                                      (json_int_t)c->yarn_original_max_position_embeddings,
                                      "beta_fast", c->yarn_beta_fast, "beta_slow",
                                      c->yarn_beta_slow));
    SETI("sliding_window", c->sliding_window);
    SETI("num_nextn_predict_layers", c->n_mtp_layers);
    json_object_set_new(o, "compress_ratios",
                        mf_json_ints(c->compress_ratios, c->n_layers + c->n_mtp_layers));
    json_object_set_new(o, "kv_source_layer_ids", mf_json_ints(c->kv_source_layer_ids, c->n_kv_source));
    json_object_set_new(o, "index_source_layer_ids",
                        mf_json_ints(c->index_source_layer_ids, c->n_index_source));
    SETI("index_n_heads", c->index_n_heads);
    SETI("index_head_dim", c->index_head_dim);
    SETI("index_topk", c->index_topk);
    json_object_set_new(o, "candidate_source_layer_id",
                        c->candidate_source_layer_id >= 0 ? json_integer(c->candidate_source_layer_id)
                                                          : json_null());
    SETI("candidate_topk_blocks", c->candidate_topk_blocks);
    SETI("candidate_block_size", c->candidate_block_size);
    SETI("n_routed_experts", c->n_routed_experts);
    SETI("num_experts_per_tok", c->n_experts_per_tok);
    SETI("n_shared_experts", c->n_shared_experts);
    SETI("moe_intermediate_size", c->moe_intermediate_size);
    json_object_set_new(o, "scoring_func", json_string(mf_scoring_name(c->scoring_func)));
    json_object_set_new(o, "topk_method", json_string("noaux_tc"));
    json_object_set_new(o, "norm_topk_prob", json_boolean(c->norm_topk_prob));
    SETR("routed_scaling_factor", c->routed_scaling_factor);
    SETR("swiglu_limit", c->swiglu_limit);
    SETI("hc_mult", c->hc_mult);
    SETR("hc_eps", c->hc_eps);
    SETI("hc_sinkhorn_iters", c->hc_sinkhorn_iters);
    json_object_set_new(o, "engram_layer_ids", mf_json_ints(c->engram_layer_ids, c->n_engram));
    json_t *rows = json_array();
    for (int i = 0; i < c->n_engram; i++)
        json_array_append_new(rows, json_integer(c->engram_num_embeddings[i]));
    json_object_set_new(o, "engram_num_embeddings", rows);
    /* the Engram fields are written whenever set, with or without Engram layers, so a config
     * round-trips exactly (a no-Engram checkpoint keeps its compressed vocabulary size, which a
     * token map is checked against); unset ones (out of the parser's range) are left out */
    if (c->engram_max_ngram_size >= 2) SETI("engram_max_ngram_size", c->engram_max_ngram_size);
    if (c->engram_n_heads >= 1) SETI("engram_n_heads", c->engram_n_heads);
    if (c->engram_head_dim >= 1) SETI("engram_head_dim", c->engram_head_dim);
    if (c->engram_vocab_size > 0) SETI("engram_vocab_size", c->engram_vocab_size);
    if (c->engram_compressed_vocab_size >= 1)
        SETI("engram_compressed_vocab_size", c->engram_compressed_vocab_size);
    if (c->engram_pad_token_id >= 0) SETI("engram_pad_token_id", c->engram_pad_token_id);
    SETI("dspark_block_size", c->dspark_block_size);
    SETI("dspark_noise_token_id", c->dspark_noise_token_id);
    json_object_set_new(o, "dspark_target_layer_ids", mf_json_ints(c->dspark_target_layer_ids, c->n_dspark_target));
    SETI("dspark_markov_rank", c->dspark_markov_rank);
    SETI("dspark_n_routed_experts", c->dspark_n_routed_experts);
    SETI("dspark_num_experts_per_tok", c->dspark_num_experts_per_tok);
    json_object_set_new(o, "quantization_config",
                        json_pack("{s:s, s:s, s:s, s:[i,i], s:s}", "quant_method", "fp8", "fmt",
                                  "e4m3", "scale_fmt", "ue8m0", "weight_block_size",
                                  c->quant_block_out, c->quant_block_in, "expert_dtype", "fp4"));
#undef SETI
#undef SETR
    char *text = json_dumps(o, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(17));
    json_decref(o);
    if (!text) mf_error(-ENOMEM, "config: out of memory writing JSON");
    return text;
}

int mf_config_write_json(const mf_config *c, const char *path)
{
    char *text = mf_config_to_json(c);
    if (!text) return -ENOMEM;
    char tmp[4096];
    FILE *f;
    int rc = mf_path_open_tmp(path, tmp, sizeof tmp, &f);
    if (!rc) {
        fputs(text, f);   /* a failed write sets the stream's error: the commit refuses it */
        fputc('\n', f);
        rc = mf_path_commit_tmp(f, tmp, path);
    }
    free(text);
    return rc;
}

/* ---- presets ------------------------------------------------------------------------------- */

static void mf_preset_common(mf_config *c)
{
    c->n_kv_heads = 1;
    c->rms_norm_eps = 1e-20;
    c->bos_token_id = 0;
    c->eos_token_id = 1;
    c->pad_token_id = 2;
    c->engram_pad_token_id = 2;
    c->max_position_embeddings = 1048576;
    c->rope_theta = 10000;
    c->compress_rope_theta = 160000;
    c->yarn_factor = MF_CONFIG_YARN_FACTOR;
    c->yarn_original_max_position_embeddings = MF_CONFIG_YARN_ORIGINAL_MAX_POSITIONS;
    c->yarn_beta_fast = MF_CONFIG_YARN_BETA_FAST;
    c->yarn_beta_slow = MF_CONFIG_YARN_BETA_SLOW;
    c->n_shared_experts = 1;
    c->scoring_func = MF_SCORING_SQRTSOFTPLUS;
    c->norm_topk_prob = 1;
    c->routed_scaling_factor = 1.5;
    c->swiglu_limit = 10.0;
    c->hc_mult = 4;
    c->hc_eps = 1e-6;
    c->hc_sinkhorn_iters = 20;
    c->quant_block_out = 32;
    c->quant_block_in = 32;
    /* the released draft's (flash41 keeps them; the small presets size theirs down) */
    static const int targets[] = MF_CONFIG_DSPARK_TARGETS;
    c->dspark_block_size = MF_CONFIG_DSPARK_BLOCK;
    c->dspark_noise_token_id = MF_CONFIG_DSPARK_NOISE;
    c->n_dspark_target = (int)(sizeof targets / sizeof targets[0]);
    memcpy(c->dspark_target_layer_ids, targets, sizeof targets);
    c->dspark_markov_rank = MF_CONFIG_DSPARK_RANK;
    c->dspark_n_routed_experts = MF_CONFIG_DSPARK_EXPERTS;
    c->dspark_num_experts_per_tok = MF_CONFIG_DSPARK_TOPK;
}

/* The small presets share the real model's layer roles on 8 layers: window-only layers 0-1,
 * ratio-2 layers 2-3, ratio-1 layers 4-7; KV sources 2 and 4, index sources 2, 4, 6; layer 4
 * publishes the candidate mask; Engram on layers 1 and 3; three window-only draft stages reading
 * the inputs of the last three layers (5, 6, 7), as the released draft reads 37-39 of 40. */
static void mf_preset_small_roles(mf_config *c)
{
    static const int ratios[11] = {0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0};
    c->n_layers = 8;
    c->n_mtp_layers = 3;
    memcpy(c->compress_ratios, ratios, sizeof ratios);
    c->n_dspark_target = 3;
    for (int i = 0; i < 3; i++) c->dspark_target_layer_ids[i] = 5 + i;
    c->n_kv_source = 2;
    c->kv_source_layer_ids[0] = 2;
    c->kv_source_layer_ids[1] = 4;
    c->n_index_source = 3;
    c->index_source_layer_ids[0] = 2;
    c->index_source_layer_ids[1] = 4;
    c->index_source_layer_ids[2] = 6;
    c->candidate_source_layer_id = 4;
    c->n_engram = 2;
    c->engram_layer_ids[0] = 1;
    c->engram_layer_ids[1] = 3;
}

int mf_config_preset(const char *name, mf_config *c)
{
    memset(c, 0, sizeof *c);
    mf_preset_common(c);
    if (!strcmp(name, "tiny")) {
        mf_preset_small_roles(c);
        c->vocab_size = 512;
        c->hidden_size = 256;
        c->n_heads = 4;
        c->head_dim = 64;
        c->qk_rope_head_dim = 16;
        c->q_lora_rank = 64;
        c->o_groups = 2;
        c->o_lora_rank = 64;
        c->yarn_original_max_position_embeddings = 256;
        c->yarn_factor = 4;
        c->sliding_window = 16;
        c->index_n_heads = 4;
        c->index_head_dim = 32;
        c->index_topk = 16;
        c->candidate_topk_blocks = 8;
        c->candidate_block_size = 4;
        c->n_routed_experts = 16;
        c->n_experts_per_tok = 2;
        c->moe_intermediate_size = 64;
        /* each table holds exactly the rows its hash primes address (sum of the primes, as in
         * the released model; see graphs/layers/layer_engram.c) */
        c->engram_num_embeddings[0] = 2056;
        c->engram_num_embeddings[1] = 2208;
        c->engram_max_ngram_size = 3;
        c->engram_n_heads = 2;
        c->engram_head_dim = 32;
        c->engram_vocab_size = 500;
        c->engram_compressed_vocab_size = 400;
        c->dspark_noise_token_id = 511;   /* the vocabulary's last id */
        c->dspark_markov_rank = 32;
        c->dspark_n_routed_experts = 8;
        c->dspark_num_experts_per_tok = 2;
    } else if (!strcmp(name, "demo")) {
        mf_preset_small_roles(c);
        c->vocab_size = 129280;
        c->hidden_size = 1024;
        c->n_heads = 16;
        c->head_dim = 128;
        c->qk_rope_head_dim = 32;
        c->q_lora_rank = 256;
        c->o_groups = 4;
        c->o_lora_rank = 256;
        c->sliding_window = 128;
        c->index_n_heads = 8;
        c->index_head_dim = 64;
        c->index_topk = 128;
        c->candidate_topk_blocks = 256;
        c->candidate_block_size = 8;
        c->n_routed_experts = 64;
        c->n_experts_per_tok = 6;
        c->moe_intermediate_size = 768;
        c->engram_num_embeddings[0] = 1920646;   /* sums of the hash primes */
        c->engram_num_embeddings[1] = 1922284;
        c->engram_max_ngram_size = 4;
        c->engram_n_heads = 4;
        c->engram_head_dim = 64;
        c->engram_vocab_size = 160000;
        c->engram_compressed_vocab_size = 99092;
        c->dspark_markov_rank = 64;
        c->dspark_n_routed_experts = 16;
        c->dspark_num_experts_per_tok = 3;
    } else if (!strcmp(name, "big")) {
        /* demo's attention with experts that outgrow a 24 GiB machine: 8 x 1024 experts of
         * ~3.2 MiB (26 GiB) and Engram rows of the released width (256 codes + 8 scales) */
        mf_config_preset("demo", c);
        c->n_routed_experts = 1024;
        c->moe_intermediate_size = 2048;
        c->engram_head_dim = 256;
    } else if (!strcmp(name, "flash41")) {
        c->vocab_size = 129280;
        c->hidden_size = 5120;
        c->n_layers = 40;
        c->n_heads = 64;
        c->head_dim = 512;
        c->qk_rope_head_dim = 64;
        c->q_lora_rank = 1280;
        c->o_groups = 8;
        c->o_lora_rank = 1024;
        c->sliding_window = 128;
        c->n_mtp_layers = 3;
        /* [0]*2 + [2]*18 + [1]*20 + [0]*3: the draft stages are window-only */
        for (int i = 0; i < 43; i++) c->compress_ratios[i] = i < 2 || i >= 40 ? 0 : i < 20 ? 2 : 1;
        static const int kv[4] = {2, 8, 14, 20}, idx[8] = {2, 8, 14, 20, 24, 28, 32, 36};
        c->n_kv_source = 4;
        memcpy(c->kv_source_layer_ids, kv, sizeof kv);
        c->n_index_source = 8;
        memcpy(c->index_source_layer_ids, idx, sizeof idx);
        c->index_n_heads = 32;
        c->index_head_dim = 128;
        c->index_topk = 512;
        c->candidate_source_layer_id = 20;
        c->candidate_topk_blocks = 2048;
        c->candidate_block_size = 8;
        c->n_routed_experts = 384;
        c->n_experts_per_tok = 6;
        c->moe_intermediate_size = 2304;
        c->n_engram = 2;
        c->engram_layer_ids[0] = 1;
        c->engram_layer_ids[1] = 14;
        c->engram_num_embeddings[0] = 384006168;
        c->engram_num_embeddings[1] = 384016682;
        c->engram_max_ngram_size = 4;
        c->engram_n_heads = 8;
        c->engram_head_dim = 256;
        c->engram_vocab_size = 16000000;
        c->engram_compressed_vocab_size = 99092;
    } else {
        return mf_error(-EINVAL, "unknown preset '%s' (expected one of: %s)", name,
                        mf_config_preset_names());
    }
    return mf_config_validate(name, c);
}

const char *mf_config_preset_names(void) { return "tiny demo big flash41"; }

const char *mf_scoring_name(mf_scoring s)
{
    switch (s) {
    case MF_SCORING_SQRTSOFTPLUS: return "sqrtsoftplus";
    case MF_SCORING_SOFTMAX: return "softmax";
    case MF_SCORING_SIGMOID: return "sigmoid";
    }
    return "?";
}

/* ---- derived ------------------------------------------------------------------------------- */

int mf_config_is_kv_source(const mf_config *c, int layer)
{
    return mf_in_list(c->kv_source_layer_ids, c->n_kv_source, layer);
}

int mf_config_is_index_source(const mf_config *c, int layer)
{
    return mf_in_list(c->index_source_layer_ids, c->n_index_source, layer);
}

int mf_config_cut_ok(const mf_config *c, int layer)
{
    if (layer < 0 || layer > c->n_layers) return 0;
    for (int L = layer; L < c->n_layers; L++)   /* the first compressed layer reads the latest source */
        if (c->compress_ratios[L]) return mf_config_is_kv_source(c, L);
    return 1;
}

int mf_config_engram_slot(const mf_config *c, int layer)
{
    for (int i = 0; i < c->n_engram; i++)
        if (c->engram_layer_ids[i] == layer) return i;
    return -1;
}

/* One packed-fp4 projection [out, in]: out*in/2 code bytes + out*in/32 scale bytes. */
static uint64_t mf_fp4_linear_bytes(uint64_t out, uint64_t in)
{
    return out * (in / 2) + out * (in / 32);
}

uint64_t mf_config_expert_bytes(const mf_config *c)
{
    uint64_t h = (uint64_t)c->hidden_size, m = (uint64_t)c->moe_intermediate_size;
    return 2 * mf_fp4_linear_bytes(m, h) + mf_fp4_linear_bytes(h, m);
}

int mf_config_layer_experts(const mf_config *c, int L)
{
    return L >= c->n_layers ? c->dspark_n_routed_experts : c->n_routed_experts;
}

int mf_config_layer_topk(const mf_config *c, int L)
{
    return L >= c->n_layers ? c->dspark_num_experts_per_tok : c->n_experts_per_tok;
}

uint64_t mf_config_expert_bank_bytes(const mf_config *c)
{
    return mf_config_expert_bytes(c) * (uint64_t)c->n_routed_experts * (uint64_t)c->n_layers;
}

uint64_t mf_config_engram_table_bytes(const mf_config *c)
{
    uint64_t d = (uint64_t)c->engram_head_dim, total = 0;
    for (int i = 0; i < c->n_engram; i++)
        total += (uint64_t)c->engram_num_embeddings[i] * (d + (d + 31) / 32);
    return total;
}
