/* Helper for tests/conformance/tokenizer: drives host/tokenizer and graphs/engram_map from files.
 *   tok_tool encode TOKENIZER TEXTS      texts: one JSON string a line -> ids a line ("ERR msg")
 *   tok_tool decode TOKENIZER IDS [skip] ids: space-separated a line -> one JSON string a line
 *   tok_tool engram TOKENIZER            -> JSON {"n_unique", "ids", "keys"}
 *   tok_tool normalize TEXTS             -> the Engram normalization of each, one JSON string a line
 *   tok_tool unassigned                  -> code point ranges PCRE2 (UCP) calls unassigned (\p{Cn}),
 *                                           "first last" a line, so the harness can tell which
 *                                           characters this PCRE2's Unicode tables know */
#include <errno.h>
#include <jansson.h>
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "graphs/model/engram_map.h"
#include "host/tokenizer.h"
#include "sched/error.h"

static void put_json_string(const char *s, size_t n)
{
    json_t *j = json_stringn(s, n);
    char *d = j ? json_dumps(j, JSON_ENCODE_ANY) : NULL;
    puts(d ? d : "null");
    free(d);
    json_decref(j);
}

/* Reads the next line's JSON string; returns 1, 0 at EOF, -1 on a malformed line. */
static int next_text(FILE *f, char **line, size_t *cap, json_t **out)
{
    ssize_t n = getline(line, cap, f);
    if (n < 0) return 0;
    json_error_t err;
    *out = json_loadb(*line, (size_t)n, JSON_DECODE_ANY | JSON_ALLOW_NUL, &err);
    if (!*out || !json_is_string(*out)) {
        fprintf(stderr, "tok_tool: bad text line: %s\n", *out ? "not a string" : err.text);
        json_decref(*out);
        return -1;
    }
    return 1;
}

static int cmd_encode(mf_tok *tok, const char *texts)
{
    FILE *f = fopen(texts, "r");
    if (!f) return perror(texts), 1;
    char *line = NULL;
    size_t cap = 0, idcap = 1024;
    int32_t *ids = malloc(idcap * sizeof *ids);
    json_t *j;
    int r;
    while ((r = next_text(f, &line, &cap, &j)) == 1) {
        size_t n;
        int rc = mf_tok_encode(tok, json_string_value(j), json_string_length(j), ids, idcap, &n);
        if (rc == -ENOSPC) {
            idcap = n;
            ids = realloc(ids, idcap * sizeof *ids);
            rc = mf_tok_encode(tok, json_string_value(j), json_string_length(j), ids, idcap, &n);
        }
        if (rc) {
            printf("ERR %s\n", mf_last_error());
        } else {
            for (size_t i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
            putchar('\n');
        }
        json_decref(j);
    }
    free(ids);
    free(line);
    fclose(f);
    return r < 0;
}

static int cmd_decode(mf_tok *tok, const char *path, int flags)
{
    FILE *f = fopen(path, "r");
    if (!f) return perror(path), 1;
    char *line = NULL;
    size_t cap = 0, ocap = 1 << 16, nid_cap = 1024;
    char *out = malloc(ocap);
    int32_t *ids = malloc(nid_cap * sizeof *ids);
    while (getline(&line, &cap, f) >= 0) {
        size_t n = 0;
        for (char *p = line, *end;; p = end) {
            long v = strtol(p, &end, 10);
            if (end == p) break;
            if (n == nid_cap) ids = realloc(ids, (nid_cap *= 2) * sizeof *ids);
            ids[n++] = (int32_t)v;
        }
        size_t nb;
        int rc = mf_tok_decode(tok, ids, n, flags, out, ocap, &nb);
        if (rc == -ENOSPC) {
            out = realloc(out, ocap = nb + 1);
            rc = mf_tok_decode(tok, ids, n, flags, out, ocap, &nb);
        }
        if (rc) printf("ERR %s\n", mf_last_error());
        else put_json_string(out, nb);
    }
    free(ids);
    free(out);
    free(line);
    fclose(f);
    return 0;
}

static int cmd_engram(mf_tok *tok)
{
    mf_engram_map *m;
    if (mf_engram_map_build(tok, &m)) {
        fprintf(stderr, "tok_tool: %s\n", mf_last_error());
        return 1;
    }
    json_t *root = json_object(), *ids = json_array(), *keys = json_array();
    for (int i = 0; i < mf_engram_map_n_vocab(m); i++)
        json_array_append_new(ids, json_integer(mf_engram_map_ids(m)[i]));
    for (int c = 0; c < mf_engram_map_n_unique(m); c++) {
        size_t len;
        const char *k = mf_engram_map_key(m, c, &len);
        json_array_append_new(keys, json_stringn(k, len));
    }
    json_object_set_new(root, "n_unique", json_integer(mf_engram_map_n_unique(m)));
    json_object_set_new(root, "ids", ids);
    json_object_set_new(root, "keys", keys);
    json_dumpf(root, stdout, JSON_COMPACT);
    putchar('\n');
    json_decref(root);
    mf_engram_map_free(m);
    return 0;
}

static int cmd_normalize(const char *texts)
{
    FILE *f = fopen(texts, "r");
    if (!f) return perror(texts), 1;
    char *line = NULL;
    size_t cap = 0;
    json_t *j;
    int r;
    while ((r = next_text(f, &line, &cap, &j)) == 1) {
        char *o;
        size_t n;
        if (mf_engram_normalize(json_string_value(j), json_string_length(j), &o, &n)) {
            printf("ERR %s\n", mf_last_error());
        } else {
            put_json_string(o, n);
            free(o);
        }
        json_decref(j);
    }
    free(line);
    fclose(f);
    return r < 0;
}

static int cmd_unassigned(void)
{
    int err;
    PCRE2_SIZE at;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR) "^\\p{Cn}$", PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP, &err, &at, NULL);
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    if (!re || !md) return 1;
    long first = -1;
    for (long cp = 0; cp <= 0x110000; cp++) {
        int cn = 0;
        if (cp < 0x110000 && !(cp >= 0xD800 && cp < 0xE000)) {
            unsigned char u[4];
            int n = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
            if (n == 1) u[0] = (unsigned char)cp;
            else {
                for (int k = n - 1; k > 0; k--) u[k] = (unsigned char)(0x80 | ((cp >> (6 * (n - 1 - k))) & 0x3F));
                u[0] = (unsigned char)((0xF00 >> n) | (cp >> (6 * (n - 1))));
            }
            cn = pcre2_match(re, u, (PCRE2_SIZE)n, 0, 0, md, NULL) >= 0;
        }
        if (cn && first < 0) first = cp;
        if (!cn && first >= 0) {
            printf("%ld %ld\n", first, cp - 1);
            first = -1;
        }
    }
    pcre2_match_data_free(md);
    pcre2_code_free(re);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc == 2 && strcmp(argv[1], "unassigned") == 0) return cmd_unassigned();
    if (argc >= 3 && strcmp(argv[1], "normalize") == 0) return cmd_normalize(argv[2]);
    if (argc < 3) {
        fprintf(stderr, "usage: tok_tool encode|decode|engram TOKENIZER [FILE [skip]] | "
                        "tok_tool normalize TEXTS\n");
        return 2;
    }
    mf_tok *tok;
    if (mf_tok_load(argv[2], &tok)) {
        fprintf(stderr, "tok_tool: %s\n", mf_last_error());
        return 1;
    }
    int rc = 2;
    if (strcmp(argv[1], "encode") == 0 && argc == 4) rc = cmd_encode(tok, argv[3]);
    else if (strcmp(argv[1], "decode") == 0 && argc >= 4)
        rc = cmd_decode(tok, argv[3], argc > 4 && strcmp(argv[4], "skip") == 0 ? MF_TOK_SKIP_SPECIAL : 0);
    else if (strcmp(argv[1], "engram") == 0) rc = cmd_engram(tok);
    else fprintf(stderr, "tok_tool: unknown command or wrong arguments\n");
    mf_tok_free(tok);
    return rc;
}
