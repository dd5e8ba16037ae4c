/* graphs/config: presets validate, both config.json dialects parse to the same config, every
 * malformed field gives a message naming the file and the field, flash41's derived sizes are
 * the released checkpoint's figures (shared/v41-flash.md), and every preset (with and without
 * Engram layers) round-trips through config.json and loads with a token map. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <inttypes.h>

#include "graphs/model/config.h"
#include "graphs/model/engram_map.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "host/tokenizer.h"
#include "sched/error.h"
#include "tests/check.h"
#include "tests/tiny_ckpt.h"

/* Parses `text` and checks it equals `want` field for field (both start from memset 0). */
static void check_same(const char *what, const char *text, const mf_config *want)
{
    mf_config got;
    int rc = mf_config_parse(what, text, &got);
    CHECK(rc == 0, "%s: parse failed: %s", what, mf_last_error());
    if (rc == 0) CHECK(memcmp(&got, want, sizeof got) == 0, "%s: parsed config differs", what);
}

static json_t *flat_of(const mf_config *c)
{
    char *text = mf_config_to_json(c);
    json_t *o = json_loads(text, 0, NULL);
    free(text);
    return o;
}

/* HF nested dialect: every model key moves under text_config; quantization_config stays at the
 * top (quant_inside = 0) or moves too (1). */
static char *nested_of(const mf_config *c, int quant_inside)
{
    json_t *flat = flat_of(c), *root = json_object(), *tc = json_object();
    const char *k;
    json_t *v;
    json_object_foreach(flat, k, v)
    {
        if (!strcmp(k, "quantization_config") && !quant_inside) json_object_set(root, k, v);
        else json_object_set(tc, k, v);
    }
    json_object_set_new(root, "model_type", json_string("deepseek_v41"));
    json_object_set_new(root, "vision_config", json_pack("{s:i}", "hidden_size", 1152));
    json_object_set_new(root, "text_config", tc);
    char *out = json_dumps(root, 0);
    json_decref(root);
    json_decref(flat);
    return out;
}

typedef void (*mutate_fn)(json_t *model, json_t *root);

static void m_del_hidden(json_t *m, json_t *r) { json_object_del(m, "hidden_size"); }
static void m_str_hidden(json_t *m, json_t *r) { json_object_set_new(m, "hidden_size", json_string("5120")); }
static void m_zero_layers(json_t *m, json_t *r) { json_object_set_new(m, "num_hidden_layers", json_integer(0)); }
static void m_short_ratios(json_t *m, json_t *r)
{
    json_array_remove(json_object_get(m, "compress_ratios"), 0);
}
static void m_bad_ratio(json_t *m, json_t *r)
{
    json_array_set_new(json_object_get(m, "compress_ratios"), 5, json_integer(4));
}
static void m_kv_out(json_t *m, json_t *r)
{
    json_array_set_new(json_object_get(m, "kv_source_layer_ids"), 3, json_integer(40));
}
static void m_topk(json_t *m, json_t *r) { json_object_set_new(m, "num_experts_per_tok", json_integer(385)); }
static void m_rope(json_t *m, json_t *r) { json_object_set_new(m, "qk_rope_head_dim", json_integer(1024)); }
static void m_eng_rows(json_t *m, json_t *r) { json_array_remove(json_object_get(m, "engram_num_embeddings"), 1); }
static void m_eng_ids(json_t *m, json_t *r)
{
    json_array_set_new(json_object_get(m, "engram_layer_ids"), 1, json_integer(40));
}
static void m_expert_dtype(json_t *m, json_t *r)
{
    json_object_set_new(json_object_get(r, "quantization_config"), "expert_dtype", json_string("fp8"));
}
static void m_no_quant(json_t *m, json_t *r) { json_object_del(r, "quantization_config"); }
static void m_block(json_t *m, json_t *r)
{
    json_object_set_new(json_object_get(r, "quantization_config"), "weight_block_size",
                        json_pack("[i]", 32));
}
static void m_scoring(json_t *m, json_t *r) { json_object_set_new(m, "scoring_func", json_string("relu")); }
static void m_cand(json_t *m, json_t *r) { json_object_set_new(m, "candidate_source_layer_id", json_integer(3)); }
static void m_groups(json_t *m, json_t *r) { json_object_set_new(m, "o_groups", json_integer(7)); }
static void m_eps(json_t *m, json_t *r) { json_object_set_new(m, "rms_norm_eps", json_real(-1.0)); }
static void m_yarn(json_t *m, json_t *r)
{
    json_object_set_new(json_object_get(m, "rope_scaling"), "beta_fast", json_string("fast"));
}
static void m_idx_ratio0(json_t *m, json_t *r)
{
    json_array_insert_new(json_object_get(m, "index_source_layer_ids"), 0, json_integer(1));
}
/* what the oracle's loader refuses and moeflow once accepted: a candidate layer that is no KV
 * source (24 is an index source on KV source 20); an index layer after the candidate layer on
 * another KV source (24 made a KV source: the oracle's indexer finds no candidates there) */
static void m_cand_not_kv(json_t *m, json_t *r) { json_object_set_new(m, "candidate_source_layer_id", json_integer(24)); }
static void m_idx_other_group(json_t *m, json_t *r)
{
    json_array_append_new(json_object_get(m, "kv_source_layer_ids"), json_integer(24));
}
/* what `gen` once wrote and its own loader refused: index keys of 16 dims (the fp4 blocks are
 * 32); a ratio-2 layer whose KV source (20) has ratio 1 */
static void m_idx_dim16(json_t *m, json_t *r) { json_object_set_new(m, "index_head_dim", json_integer(16)); }
static void m_ratio_owner(json_t *m, json_t *r)
{
    json_array_set_new(json_object_get(m, "compress_ratios"), 21, json_integer(2));
}
static void m_kv_heads(json_t *m, json_t *r) { json_object_set_new(m, "num_key_value_heads", json_integer(2)); }
/* the draft's fields */
static void m_draft_ratio(json_t *m, json_t *r)
{
    json_array_set_new(json_object_get(m, "compress_ratios"), 41, json_integer(1));
}
static void m_draft_target(json_t *m, json_t *r)
{
    json_array_set_new(json_object_get(m, "dspark_target_layer_ids"), 2, json_integer(40));
}
static void m_draft_noise(json_t *m, json_t *r) { json_object_set_new(m, "dspark_noise_token_id", json_integer(200000)); }
static void m_draft_topk(json_t *m, json_t *r) { json_object_set_new(m, "dspark_num_experts_per_tok", json_integer(129)); }
static void m_draft_rank(json_t *m, json_t *r) { json_object_set_new(m, "dspark_markov_rank", json_integer(0)); }
static void m_draft_block(json_t *m, json_t *r) { json_object_set_new(m, "dspark_block_size", json_integer(0)); }
static void m_draft_type(json_t *m, json_t *r) { json_object_set_new(m, "dspark_target_layer_ids", json_integer(39)); }
static void m_hidden_odd(json_t *m, json_t *r) { json_object_set_new(m, "hidden_size", json_integer(5000)); }
static void m_ratio_type(json_t *m, json_t *r)
{
    json_array_set_new(json_object_get(m, "compress_ratios"), 2, json_string("2"));
}

static const struct {
    mutate_fn fn;
    const char *field;   /* must appear in the message */
    const char *found;   /* and this (what was found) */
} cases[] = {
    {m_del_hidden, "hidden_size", "missing"},
    {m_str_hidden, "hidden_size", "a string"},
    {m_zero_layers, "num_hidden_layers", "found 0"},
    {m_short_ratios, "compress_ratios", "42 entries"},
    {m_bad_ratio, "compress_ratios", "found 4"},
    {m_ratio_type, "compress_ratios", "a string at index 2"},
    {m_kv_out, "kv_source_layer_ids", "found 40"},
    {m_topk, "num_experts_per_tok", "found 385"},
    {m_rope, "qk_rope_head_dim", "found 1024"},
    {m_eng_rows, "engram_num_embeddings", "1 entries"},
    {m_eng_ids, "engram_layer_ids", "found 40"},
    {m_expert_dtype, "expert_dtype", "\"fp8\""},
    {m_no_quant, "quantization_config", "missing"},
    {m_block, "weight_block_size", "1 entries"},
    {m_scoring, "scoring_func", "\"relu\""},
    {m_cand, "candidate_source_layer_id", "found 3"},
    {m_groups, "o_groups", "found 7"},
    {m_eps, "rms_norm_eps", "found -1"},
    {m_yarn, "rope_scaling.beta_fast", "string"},
    {m_idx_ratio0, "index_source_layer_ids", "layer 1 with ratio 0"},
    {m_hidden_odd, "hidden_size", "found 5000"},
    {m_cand_not_kv, "candidate_source_layer_id", "found 24"},
    {m_idx_other_group, "index_source_layer_ids", "index layer 24 on KV source 24"},
    {m_idx_dim16, "index_head_dim", "found 16"},
    {m_ratio_owner, "compress_ratios", "found KV source 20 of ratio 1"},
    {m_kv_heads, "num_key_value_heads", "found 2"},
    {m_draft_ratio, "compress_ratios", "draft stage 1 at index 41, found 1"},
    {m_draft_target, "dspark_target_layer_ids", "found 40"},
    {m_draft_noise, "dspark_noise_token_id", "found 200000"},
    {m_draft_topk, "dspark_num_experts_per_tok", "found 129"},
    {m_draft_rank, "dspark_markov_rank", "found 0"},
    {m_draft_block, "dspark_block_size", "found 0"},
    {m_draft_type, "dspark_target_layer_ids", "an integer"},
};

static void check_errors(const mf_config *flash)
{
    for (int nested = 0; nested < 2; nested++) {
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            json_t *flat = flat_of(flash), *root = flat, *model = flat;
            if (nested) {
                char *t = nested_of(flash, 0);
                root = json_loads(t, 0, NULL);
                free(t);
                json_decref(flat);
                model = json_object_get(root, "text_config");
            }
            cases[i].fn(model, root);
            char *text = json_dumps(root, 0);
            json_decref(root);
            mf_config got;
            mf_error_clear();
            int rc = mf_config_parse("cfg/config.json", text, &got);
            free(text);
            const char *msg = mf_last_error();
            CHECK(rc == -EINVAL, "case %zu (%s) nested %d: rc %d", i, cases[i].field, nested, rc);
            CHECK(strstr(msg, "cfg/config.json") && strstr(msg, cases[i].field) &&
                      strstr(msg, cases[i].found) && strstr(msg, "expected"),
                  "case %zu nested %d: message lacks file/field '%s'/found '%s': %s", i, nested,
                  cases[i].field, cases[i].found, msg);
            if (nested && strcmp(cases[i].field, "quantization_config") &&
                strcmp(cases[i].field, "expert_dtype") && strcmp(cases[i].field, "weight_block_size"))
                CHECK(strstr(msg, "text_config.") != NULL, "nested message lacks prefix: %s", msg);
        }
    }
    mf_config got;
    CHECK(mf_config_parse("x.json", "{\"vocab_size\": 12,", &got) == -EINVAL &&
              strstr(mf_last_error(), "x.json") && strstr(mf_last_error(), "not valid JSON"),
          "bad JSON: %s", mf_last_error());
    CHECK(mf_config_parse("x.json", "[1,2]", &got) == -EINVAL && strstr(mf_last_error(), "a list"),
          "array top: %s", mf_last_error());
    CHECK(mf_config_load("/nonexistent/dir/config.json", &got) == -ENOENT &&
              strstr(mf_last_error(), "/nonexistent/dir/config.json"),
          "missing file: %s", mf_last_error());
    CHECK(mf_config_preset("huge", &got) == -EINVAL && strstr(mf_last_error(), "huge"),
          "unknown preset: %s", mf_last_error());
}

/* Every preset, and each without its Engram layers, through write -> read (identical config);
 * then a generated no-Engram checkpoint and the tiny one loaded with the tokenizer's Engram
 * token map, as `moeflow decode` passes it. */
static void check_round_trips(const char *tmpdir)
{
    const char *all[] = {"tiny", "demo", "big", "flash41"};
    char path[4096];
    snprintf(path, sizeof path, "%s/test_config_rt.json", tmpdir);
    for (int i = 0; i < 4; i++)
        for (int no_eng = 0; no_eng <= 1; no_eng++) {
            mf_config c, back;
            CHECK(mf_config_preset(all[i], &c) == 0, "preset %s: %s", all[i], mf_last_error());
            if (no_eng) {
                c.n_engram = 0;
                memset(c.engram_layer_ids, 0, sizeof c.engram_layer_ids);
                memset(c.engram_num_embeddings, 0, sizeof c.engram_num_embeddings);
            }
            CHECK(mf_config_write_json(&c, path) == 0, "write %s: %s", all[i], mf_last_error());
            CHECK(mf_config_load(path, &back) == 0, "load %s: %s", all[i], mf_last_error());
            CHECK(memcmp(&back, &c, sizeof back) == 0, "%s%s: file round trip differs", all[i],
                  no_eng ? " without Engram" : "");
        }
    remove(path);
    for (int no_eng = 0; no_eng <= 1; no_eng++) {
        mf_config c;
        mf_config_preset("tiny", &c);
        if (no_eng) c.n_engram = 0;
        char dir[4096], tokp[4200];
        if (mf_test_gen_ckpt(&c, no_eng ? "config_rt_noeng" : "config_rt_eng", dir, sizeof dir)) {
            CHECK(0, "gen failed");
            continue;
        }
        mf_model *m = NULL;
        mf_tok *tok = NULL;
        mf_engram_map *map = NULL;
        mf_ref *r = NULL;
        snprintf(tokp, sizeof tokp, "%s/tokenizer.json", dir);
        CHECK(mf_model_load(dir, NULL, &m) == 0, "%s: %s", dir, mf_last_error());
        CHECK(mf_tok_load(tokp, &tok) == 0 && mf_engram_map_build(tok, &map) == 0, "%s: %s", tokp,
              mf_last_error());
        if (m && map) {
            mf_ref_opts ro = {.token_map = mf_engram_map_ids(map), .n_token_map = mf_engram_map_n_vocab(map)};
            CHECK(mf_ref_new(m, &ro, &r) == 0, "%s: reference with the token map: %s", dir,
                  mf_last_error());
            /* the config keeps the compressed vocabulary the map was built for */
            int32_t hi = 0;
            for (int64_t i = 0; i < ro.n_token_map; i++) hi = ro.token_map[i] > hi ? ro.token_map[i] : hi;
            CHECK(hi < mf_model_config(m)->engram_compressed_vocab_size, "%s: token map reaches %d, "
                  "engram_compressed_vocab_size read back is %" PRId64, dir, hi,
                  mf_model_config(m)->engram_compressed_vocab_size);
        }
        mf_ref_free(r);
        mf_engram_map_free(map);
        mf_tok_free(tok);
        mf_model_free(m);
    }
}

/* A config.json without rope_scaling (or with null) gets the released YaRN, flagged as defaulted;
 * one with rope_scaling keeps its figures, beta_fast/beta_slow defaulting to 32/1. */
static void check_rope_defaults(void)
{
    mf_config c;
    mf_config_preset("tiny", &c);
    for (int v = 0; v < 4; v++) {
        char *text = mf_config_to_json(&c);
        json_t *o = json_loads(text, 0, NULL);
        free(text);
        if (v == 0) json_object_del(o, "rope_scaling");
        if (v == 1) json_object_set_new(o, "rope_scaling", json_null());
        if (v == 2) json_object_del(json_object_get(o, "rope_scaling"), "beta_fast");
        if (v == 3) json_object_del(json_object_get(o, "rope_scaling"), "beta_slow");
        text = json_dumps(o, 0);
        json_decref(o);
        mf_config got;
        CHECK(mf_config_parse("rope", text, &got) == 0, "variant %d: %s", v, mf_last_error());
        free(text);
        if (v < 2) {
            CHECK(got.yarn_defaulted && got.yarn_factor == MF_CONFIG_YARN_FACTOR &&
                      got.yarn_original_max_position_embeddings == MF_CONFIG_YARN_ORIGINAL_MAX_POSITIONS &&
                      got.yarn_beta_fast == 32 && got.yarn_beta_slow == 1,
                  "variant %d: defaulted %d factor %g from %lld", v, got.yarn_defaulted, got.yarn_factor,
                  (long long)got.yarn_original_max_position_embeddings);
        } else {
            CHECK(!got.yarn_defaulted && got.yarn_factor == c.yarn_factor &&
                      got.yarn_original_max_position_embeddings == c.yarn_original_max_position_embeddings &&
                      got.yarn_beta_fast == (v == 2 ? 32 : c.yarn_beta_fast) &&
                      got.yarn_beta_slow == (v == 3 ? 1 : c.yarn_beta_slow),
                  "variant %d: beta %g/%g", v, got.yarn_beta_fast, got.yarn_beta_slow);
        }
    }
}

/* A config.json without the DSpark fields gets the oracle's defaults (flash41's are those); an
 * older one without draft stages (num_nextn_predict_layers 0, no dspark_*) still parses, its
 * defaults unchecked (noise token 128799 past tiny's vocabulary). */
static void check_draft_defaults(void)
{
    static const char *keys[] = {"dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids",
                                 "dspark_markov_rank", "dspark_n_routed_experts", "dspark_num_experts_per_tok"};
    for (int v = 0; v < 2; v++) {
        mf_config c, got;
        mf_config_preset(v ? "tiny" : "flash41", &c);
        char *text = mf_config_to_json(&c);
        json_t *o = json_loads(text, 0, NULL);
        free(text);
        for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) json_object_del(o, keys[k]);
        if (v) {
            json_object_set_new(o, "num_nextn_predict_layers", json_integer(0));
            for (int k = 0; k < 3; k++) json_array_remove(json_object_get(o, "compress_ratios"), 8);
        }
        text = json_dumps(o, 0);
        json_decref(o);
        int rc = mf_config_parse("draft", text, &got);
        free(text);
        CHECK(rc == 0, "variant %d: %s", v, mf_last_error());
        if (rc) continue;
        if (!v) CHECK(memcmp(&got, &c, sizeof got) == 0, "flash41 without dspark fields differs from the preset");
        CHECK(got.dspark_block_size == 5 && got.dspark_noise_token_id == 128799 && got.n_dspark_target == 3 &&
                  got.dspark_target_layer_ids[0] == 37 && got.dspark_target_layer_ids[2] == 39 &&
                  got.dspark_markov_rank == 256 && got.dspark_n_routed_experts == 128 &&
                  got.dspark_num_experts_per_tok == 3 && got.n_mtp_layers == (v ? 0 : 3),
              "variant %d: the oracle's defaults", v);
    }
}

int main(void)
{
    const char *names[] = {"tiny", "demo", "flash41"};
    mf_config c[3];
    for (int i = 0; i < 3; i++) {
        CHECK(mf_config_preset(names[i], &c[i]) == 0, "preset %s: %s", names[i], mf_last_error());
        char *flat = mf_config_to_json(&c[i]);
        check_same("flat", flat, &c[i]);
        free(flat);
        for (int q = 0; q < 2; q++) {
            char *nested = nested_of(&c[i], q);
            check_same(q ? "nested, quant inside" : "nested, quant at top", nested, &c[i]);
            free(nested);
        }
    }

    /* the file writer and loader round trip */
    const char *tmpdir = getenv("MOEFLOW_TMP");
    char path[4096];
    snprintf(path, sizeof path, "%s/test_config.json", tmpdir ? tmpdir : "/tmp");
    CHECK(mf_config_write_json(&c[2], path) == 0, "write: %s", mf_last_error());
    mf_config back;
    CHECK(mf_config_load(path, &back) == 0, "load: %s", mf_last_error());
    CHECK(memcmp(&back, &c[2], sizeof back) == 0, "file round trip differs");
    remove(path);

    /* flash41: the released checkpoint's figures */
    const mf_config *f = &c[2];
    CHECK(mf_config_expert_bytes(f) == 18800640ull, "expert bytes %llu",
          (unsigned long long)mf_config_expert_bytes(f));
    CHECK(mf_config_expert_bank_bytes(f) == 288777830400ull, "expert bank %llu",
          (unsigned long long)mf_config_expert_bank_bytes(f));
    CHECK(mf_config_engram_table_bytes(f) == 202758032400ull, "engram tables %llu",
          (unsigned long long)mf_config_engram_table_bytes(f));
    /* the page's resident text weights: everything but experts, Engram tables and MTP */
    uint64_t res = mf_config_resident_bytes(f);
    CHECK(res == 9846748608ull, "resident %llu", (unsigned long long)res);

    check_errors(f);
    check_round_trips(tmpdir ? tmpdir : "/tmp");
    check_rope_defaults();
    check_draft_defaults();
    return mf_check_exit("test_config");
}
