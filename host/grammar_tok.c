/* A tokenizer's vocabulary for the grammar matcher (host/grammar.h mf_gram_vocab_new): every
 * token's bytes (mf_tok_token_bytes), special tokens left out. Apart from grammar_match.c so that
 * the fuzz targets build the matcher without the tokenizer. */
#include <errno.h>
#include <stdlib.h>

#include "host/grammar.h"
#include "host/tokenizer.h"
#include "sched/error.h"

int mf_gram_vocab_new(const mf_tok *tok, int64_t n_vocab, int32_t eos_id, mf_gram_vocab **out)
{
    *out = NULL;
    char buf[4096];
    size_t bytes = 0;
    for (int64_t i = 0; i < n_vocab; i++) {
        int k = mf_tok_token_bytes(tok, (int32_t)i, buf, sizeof buf);
        if (k > 0 && !mf_tok_is_special(tok, (int32_t)i)) bytes += (size_t)k;
    }
    char **t = malloc(sizeof *t * (size_t)(n_vocab > 0 ? n_vocab : 1));
    size_t *l = malloc(sizeof *l * (size_t)(n_vocab > 0 ? n_vocab : 1));
    char *all = malloc(bytes ? bytes : 1);
    int rc = t && l && all ? 0 : mf_error(-ENOMEM, "grammar: out of memory");
    size_t o = 0;
    for (int64_t i = 0; i < n_vocab && !rc; i++) {
        int k = mf_tok_token_bytes(tok, (int32_t)i, all + o, bytes - o);
        t[i] = NULL;
        l[i] = 0;
        if (k <= 0 || mf_tok_is_special(tok, (int32_t)i) || (size_t)k > bytes - o) continue;
        t[i] = all + o;
        l[i] = (size_t)k;
        o += (size_t)k;
    }
    if (!rc) rc = mf_gram_vocab_from((const char *const *)t, l, n_vocab, eos_id, out);
    free(t);
    free(l);
    free(all);
    return rc;
}

