/* `moeflow decode`: runs the plain reference forward (graphs/ref.h) on a checkpoint: prefill of a
 * prompt (text through the checkpoint's tokenizer.json, or token ids), then greedy or seeded
 * temperature/top-p decoding, streamed as text (or ids), ending with tokens/s. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "graphs/engram_map.h"
#include "graphs/model.h"
#include "graphs/ref.h"
#include "graphs/sample.h"
#include "host/store.h"
#include "host/tokenizer.h"
#include "sched/clock.h"
#include "sched/error.h"
#include "tools/commands.h"

static void mf_decode_usage(FILE *f)
{
    fprintf(f,
            "usage: moeflow decode --checkpoint DIR (--prompt TEXT | --tokens IDS)\n"
            "                      [--max-new-tokens N] [--temperature T --top-p P --seed S]\n"
            "                      [--no-bos] [--ignore-eos] [--act-quant] [--quiet]\n"
            "                      [--store resident|streamed [--store-budget SIZE]\n"
            "                       [--store-tables resident|streamed] [--io-depth N] [--trace FILE]]\n\n"
            "Runs the plain reference forward (fp32, one thread: the correctness oracle, not a\n"
            "fast path) and streams the continuation: text when DIR has a tokenizer.json, token\n"
            "ids otherwise. Ends with prefill and decode tokens/s on stderr.\n\n"
            "  --checkpoint DIR    config.json + safetensors (e.g. from `moeflow gen`)\n"
            "  --prompt TEXT       text, encoded with DIR/tokenizer.json (BOS prepended)\n"
            "  --tokens IDS        token ids, comma or space separated, used as given\n"
            "  --max-new-tokens N  tokens to generate (default 16)\n"
            "  --temperature T     0 (default) = greedy; > 0 samples\n"
            "  --top-p P           nucleus mass in (0, 1] (default 1)\n"
            "  --seed S            sampling seed (default 0)\n"
            "  --no-bos            do not prepend bos_token_id to --prompt\n"
            "  --ignore-eos        keep going after eos_token_id\n"
            "  --act-quant         quantize linear inputs to e4m3 as DeepSeek's inference code\n"
            "                      does (default: the Hugging Face port, which does not)\n"
            "  --quiet             no progress or timing on stderr\n"
            "  --store MODE        experts and Engram tables through the expert store: resident (read\n"
            "                      in at load) or streamed (a cache, misses read per use through\n"
            "                      io_uring); per-step hits/misses on stderr\n"
            "  --store-budget SIZE streamed cache bytes, e.g. 2G, 512M (default 2G)\n"
            "  --store-tables MODE Engram tables resident or streamed (default: as --store)\n"
            "  --io-depth N        reads in flight (default 64)\n"
            "  --trace FILE        Chrome trace of the last step's expert reads and compute\n");
}

static int mf_parse_tokens(const char *s, int32_t **out, int *n_out)
{
    int cap = 16, n = 0;
    int32_t *t = malloc(sizeof *t * (size_t)cap);
    if (!t) return -ENOMEM;
    const char *p = s;
    for (;;) {
        while (*p == ',' || *p == ' ' || *p == '\t' || *p == '\n') p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long long v = strtoll(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX || (*end && *end != ',' && *end != ' ' &&
                                                           *end != '\t' && *end != '\n')) {
            free(t);
            return mf_error(-EINVAL, "--tokens: expected non-negative integers separated by commas "
                            "or spaces, found '%.20s'", p);
        }
        if (n == cap) {
            int32_t *u = realloc(t, sizeof *t * (size_t)(cap *= 2));
            if (!u) {
                free(t);
                return -ENOMEM;
            }
            t = u;
        }
        t[n++] = (int32_t)v;
        p = end;
    }
    if (n == 0) {
        free(t);
        return mf_error(-EINVAL, "--tokens: no token ids given");
    }
    *out = t;
    *n_out = n;
    return 0;
}

static void mf_emit_token(const mf_tok *tok, int32_t id, int first)
{
    if (tok) {
        char buf[1024];
        int n = mf_tok_token_bytes(tok, id, buf, sizeof buf);
        if (n > 0) fwrite(buf, 1, (size_t)(n < (int)sizeof buf ? n : (int)sizeof buf), stdout);
        else if (n < 0) printf("<%d>", id);
    } else {
        printf(first ? "%d" : " %d", id);
    }
    fflush(stdout);
}

/* "2G", "512M", "4096" -> bytes; 0 on a malformed size. */
static uint64_t mf_parse_size(const char *t)
{
    char *end;
    errno = 0;
    double v = strtod(t, &end);
    if (errno || end == t || !(v > 0)) return 0;
    double mul = 1;
    if (*end == 'K' || *end == 'k') mul = 1024.0, end++;
    else if (*end == 'M' || *end == 'm') mul = 1024.0 * 1024, end++;
    else if (*end == 'G' || *end == 'g') mul = 1024.0 * 1024 * 1024, end++;
    if (*end == 'i') end++;
    if (*end == 'B') end++;
    return *end ? 0 : (uint64_t)(v * mul);
}

static int mf_parse_store_mode(const char *t)
{
    return !strcmp(t, "resident") ? MF_MODEL_STORE_RESIDENT
           : !strcmp(t, "streamed") ? MF_MODEL_STORE_STREAMED : -1;
}

static void mf_print_step(mf_store *st, const char *what, long k)
{
    mf_store_stats x;
    mf_store_step(st, &x);
    fprintf(stderr, "moeflow decode: %s %ld: experts %" PRIu64 " hits %" PRIu64 " misses (%.1f MiB "
            "read, %" PRIu64 " evicted), Engram %" PRIu64 " rows in %" PRIu64 " reads; store runs %.1f ms, "
            "io busy %.1f ms, compute %.1f ms, io overlapping compute %.1f ms\n", what, k, x.hits,
            x.misses, x.bytes_read / 1048576.0, x.evictions, x.rows, x.row_reads, x.read_wall_ns / 1e6,
            x.io_busy_ns / 1e6, x.cpu_busy_ns / 1e6, x.overlap_ns / 1e6);
}

int mf_cmd_decode(int argc, char **argv)
{
    const char *dir = NULL, *prompt = NULL, *ids = NULL;
    long max_new = 16;
    double temperature = 0, top_p = 1.0;
    unsigned long long seed = 0;
    int no_bos = 0, ignore_eos = 0, act_quant = 0, quiet = 0;
    int store_mode = 0, store_tables = 0;
    long io_depth = 0;
    uint64_t store_budget = 0;
    const char *trace = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int hv = i + 1 < argc;
        char *end = NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            mf_decode_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--checkpoint") && hv) {
            dir = argv[++i];
        } else if (!strcmp(a, "--prompt") && hv) {
            prompt = argv[++i];
        } else if (!strcmp(a, "--tokens") && hv) {
            ids = argv[++i];
        } else if (!strcmp(a, "--max-new-tokens") && hv) {
            max_new = strtol(argv[++i], &end, 10);
            if (*end || !*argv[i] || max_new < 0 || max_new > INT32_MAX) {
                fprintf(stderr, "moeflow decode: --max-new-tokens: expected 0..2147483647, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--temperature") && hv) {
            temperature = strtod(argv[++i], &end);
            if (*end || !*argv[i] || !(temperature >= 0) || temperature > 100) {
                fprintf(stderr, "moeflow decode: --temperature: expected 0..100, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--top-p") && hv) {
            top_p = strtod(argv[++i], &end);
            if (*end || !*argv[i] || !(top_p > 0 && top_p <= 1)) {
                fprintf(stderr, "moeflow decode: --top-p: expected a number in (0, 1], found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--seed") && hv) {
            errno = 0;
            seed = strtoull(argv[++i], &end, 0);
            if (errno || *end || !*argv[i]) {
                fprintf(stderr, "moeflow decode: --seed: expected a non-negative integer, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--no-bos")) {
            no_bos = 1;
        } else if (!strcmp(a, "--ignore-eos")) {
            ignore_eos = 1;
        } else if (!strcmp(a, "--act-quant")) {
            act_quant = 1;
        } else if (!strcmp(a, "--store") && hv) {
            if ((store_mode = mf_parse_store_mode(argv[++i])) < 0) {
                fprintf(stderr, "moeflow decode: --store: expected resident or streamed, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--store-tables") && hv) {
            if ((store_tables = mf_parse_store_mode(argv[++i])) < 0) {
                fprintf(stderr, "moeflow decode: --store-tables: expected resident or streamed, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--store-budget") && hv) {
            if (!(store_budget = mf_parse_size(argv[++i]))) {
                fprintf(stderr, "moeflow decode: --store-budget: expected a size such as 2G or 512M, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--io-depth") && hv) {
            io_depth = strtol(argv[++i], &end, 10);
            if (*end || io_depth < 1 || io_depth > 4096) {
                fprintf(stderr, "moeflow decode: --io-depth: expected 1..4096, found '%s'\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(a, "--trace") && hv) {
            trace = argv[++i];
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            quiet = 1;
        } else {
            fprintf(stderr, "moeflow decode: unknown or incomplete option '%s'\n\n", a);
            mf_decode_usage(stderr);
            return 2;
        }
    }
    if (!dir || (!prompt == !ids)) {
        fprintf(stderr, "moeflow decode: --checkpoint and exactly one of --prompt / --tokens are required\n\n");
        mf_decode_usage(stderr);
        return 2;
    }

    int ret = 1;
    mf_tok *tok = NULL;
    mf_engram_map *emap = NULL;
    mf_model *m = NULL;
    mf_ref *r = NULL;
    mf_ref_state *st = NULL;
    mf_sampler *smp = NULL;
    int32_t *prompt_ids = NULL;
    float *logits = NULL;
    int n_prompt = 0;

    char tpath[4200];
    snprintf(tpath, sizeof tpath, "%s/tokenizer.json", dir);
    int have_tok = access(tpath, R_OK) == 0;
    if (prompt && !have_tok) {
        fprintf(stderr, "moeflow decode: %s has no tokenizer.json, so --prompt text cannot be encoded; "
                        "give token ids with --tokens\n", dir);
        return 2;
    }
    if (have_tok && mf_tok_load(tpath, &tok)) goto fail;

    if (ids) {
        if (mf_parse_tokens(ids, &prompt_ids, &n_prompt)) {
            fprintf(stderr, "moeflow decode: %s\n", mf_last_error());
            return 2;
        }
    } else {
        size_t len = strlen(prompt), cap = len + 2, n = 0;
        prompt_ids = malloc(sizeof *prompt_ids * cap);
        if (!prompt_ids) goto fail;
        int rc = mf_tok_encode(tok, prompt, len, prompt_ids + 1, cap - 1, &n);
        if (rc == -ENOSPC) {   /* cannot happen (one id per byte at most), but handle it */
            free(prompt_ids);
            cap = n + 2;
            prompt_ids = malloc(sizeof *prompt_ids * cap);
            if (!prompt_ids) goto fail;
            rc = mf_tok_encode(tok, prompt, len, prompt_ids + 1, cap - 1, &n);
        }
        if (rc) goto fail;
        n_prompt = (int)n + 1;
        prompt_ids[0] = 0;
        if (no_bos) memmove(prompt_ids, prompt_ids + 1, sizeof *prompt_ids * (size_t)--n_prompt);
        if (n_prompt == 0) {
            fprintf(stderr, "moeflow decode: the prompt encodes to no tokens\n");
            ret = 2;
            goto out;
        }
    }

    int64_t tl0 = mf_now_ns();
    if (mf_model_load(dir, &(mf_model_opts){.quiet = quiet, .store = store_mode,
                                            .store_tables = store_tables,
                                            .store_budget_bytes = store_budget,
                                            .store_io_depth = (int)io_depth}, &m))
        goto fail;
    mf_store *mst = mf_model_store(m);
    if (mst && !quiet)
        fprintf(stderr, "moeflow decode: expert store %s, %d slots of %.2f MiB (%.2f GiB slab), "
                "engine %s, %s; loaded in %.2f s\n",
                store_mode == MF_MODEL_STORE_STREAMED ? "streamed" : "resident", mf_store_n_slots(mst),
                mf_store_slot_bytes(mst) / 1048576.0, mf_store_slab_bytes(mst) / 1073741824.0,
                mf_store_io_engine(mst), mf_store_direct(mst) ? "O_DIRECT" : "buffered",
                (mf_now_ns() - tl0) / 1e9);
    const mf_config *c = mf_model_config(m);
    if (prompt && !no_bos) prompt_ids[0] = c->bos_token_id;
    for (int i = 0; i < n_prompt; i++)
        if (prompt_ids[i] >= c->vocab_size) {
            fprintf(stderr, "moeflow decode: token %d (position %d) is outside the vocabulary of %s "
                            "(vocab_size %" PRId64 ")\n", prompt_ids[i], i, dir, c->vocab_size);
            ret = 2;
            goto out;
        }
    int64_t total = (int64_t)n_prompt + max_new;
    if (total > c->max_position_embeddings) {
        fprintf(stderr, "moeflow decode: prompt (%d tokens) + --max-new-tokens %ld = %" PRId64
                        " positions, past the model's max_position_embeddings %" PRId64 "\n",
                n_prompt, max_new, total, c->max_position_embeddings);
        ret = 2;
        goto out;
    }
    mf_ref_opts ro = {.act_quant = act_quant};
    if (tok && c->n_engram > 0) {   /* the real Engram token map */
        if (mf_engram_map_build(tok, &emap)) goto fail;
        if (mf_engram_map_n_unique(emap) > c->engram_compressed_vocab_size) {
            fprintf(stderr, "moeflow decode: the tokenizer's Engram map has %d unique keys, more than "
                            "engram_compressed_vocab_size %" PRId64 " of %s/config.json\n",
                    mf_engram_map_n_unique(emap), c->engram_compressed_vocab_size, dir);
            goto out;
        }
        ro.token_map = mf_engram_map_ids(emap);
        ro.n_token_map = mf_engram_map_n_vocab(emap);
    }
    if (mf_ref_new(m, &ro, &r) || mf_ref_state_new(r, total > 0 ? total : 1, &st) ||
        mf_sampler_new(c->vocab_size, temperature, top_p, seed, &smp))
        goto fail;
    logits = malloc(sizeof *logits * (size_t)c->vocab_size);
    if (!logits) goto fail;

    int64_t t0 = mf_now_ns();
    if (mst) mf_store_step(mst, NULL);
    if (mf_ref_prefill(r, st, prompt_ids, n_prompt, logits)) goto fail;
    if (mst && !quiet) mf_print_step(mst, "prefill", 0);
    int64_t t1 = mf_now_ns();
    long n_gen = 0, steps = 0;
    for (; n_gen < max_new; n_gen++) {
        int32_t next = mf_sampler_pick(smp, logits);
        if (next == c->eos_token_id && !ignore_eos) break;
        mf_emit_token(tok, next, n_gen == 0);
        if (n_gen + 1 == max_new) {
            n_gen++;
            break;
        }
        if (mf_ref_decode(r, &st, &next, 1, logits)) goto fail;
        steps++;
        if (mst && !quiet) mf_print_step(mst, "step", steps);
    }
    int64_t t2 = mf_now_ns();
    putchar('\n');
    fflush(stdout);
    if (mst && trace && mf_store_write_trace(mst, trace)) goto fail;
    if (mst && !quiet) {
        mf_store_stats x;
        mf_store_stats_total(mst, &x);
        fprintf(stderr, "moeflow decode: expert store total: %" PRIu64 " hits, %" PRIu64 " misses "
                "(hit rate %.1f%%), %.2f GiB read in %.2f s of store runs (reads + expert compute); io overlapping compute %.1f%% "
                "of io busy time\n", x.hits, x.misses, 100.0 * x.hits / (double)(x.hits + x.misses ? x.hits + x.misses : 1),
                x.bytes_read / 1073741824.0, x.read_wall_ns / 1e9,
                x.io_busy_ns ? 100.0 * x.overlap_ns / x.io_busy_ns : 0.0);
    }
    if (!quiet)
        fprintf(stderr, "moeflow decode: prefill %d tokens in %.3f s (%.2f tokens/s); decode %ld "
                        "forward steps in %.3f s (%.2f tokens/s); %ld tokens out\n", n_prompt, (t1 - t0) / 1e9,
                n_prompt / ((t1 - t0) / 1e9), steps, (t2 - t1) / 1e9,
                steps ? steps / ((t2 - t1) / 1e9) : 0.0, n_gen);
    ret = 0;
    goto out;
fail:
    fprintf(stderr, "moeflow decode: %s\n", mf_last_error()[0] ? mf_last_error() : "out of memory");
out:
    free(logits);
    mf_sampler_free(smp);
    mf_ref_state_free(st);
    mf_ref_free(r);
    mf_model_free(m);
    mf_engram_map_free(emap);
    mf_tok_free(tok);
    free(prompt_ids);
    return ret;
}
