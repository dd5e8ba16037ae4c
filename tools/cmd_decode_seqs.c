/* `moeflow decode`'s sequences (tools/cmd_decode.h): the prompts in (text through the
 * checkpoint's tokenizer, optionally as a chat message, or token ids; one prompt, B copies of it,
 * or every line of --prompts FILE; a line that cannot be a prompt becomes an error record), one
 * record per sequence, and the batcher's events out: text or ids streamed for one sequence, a line
 * per sequence for several, --output's JSON lines as prompts finish (each one write, so an
 * interrupted run leaves whole lines; --resume takes them up), the progress line, and
 * --record-routing's hook. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "graphs/step/batch.h"
#include "host/tokenizer.h"
#include "sched/error.h"
#include "sched/path.h"
#include "tools/cmd_decode.h"

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

void mf_dec_emit_token(const mf_tok *tok, int32_t id, int first)
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

/* Prompt text or ids -> token ids (BOS first for text unless no_bos; bos fixed up after load). */
static int mf_prompt_ids(const mf_tok *tok, const char *text, const char *ids, int no_bos, int32_t **out, int *n_out)
{
    if (ids) return mf_parse_tokens(ids, out, n_out);
    size_t len = strlen(text), cap = len + 2, n = 0;
    int32_t *p = malloc(sizeof *p * cap);
    if (!p) return mf_error(-ENOMEM, "out of memory");
    int rc = mf_tok_encode(tok, text, len, p + 1, cap - 1, &n);
    if (rc) {
        free(p);
        return rc;
    }
    int np = (int)n + 1;
    p[0] = 0;
    if (no_bos) memmove(p, p + 1, sizeof *p * (size_t)--np);
    if (np == 0) {
        free(p);
        return mf_error(-EINVAL, "the prompt '%.40s' encodes to no tokens", text);
    }
    *out = p;
    *n_out = np;
    return 0;
}

/* Reads FILE's non-empty lines (newline stripped) into an array of strings, and their line
 * numbers (from 1). A line holding a NUL byte is NULL there (its prompt is refused). */
static int mf_read_lines(const char *path, char ***out, int **line_no, int *n_out)
{
    FILE *f = fopen(path, "r");
    if (!f) return mf_error(-errno, "--prompts %s: cannot open: %s", path, strerror(errno));
    char **lines = NULL, *buf = NULL;
    int *nos = NULL;
    size_t cap_b = 0;
    int n = 0, cap = 0, rc = 0, no = 0;
    ssize_t len;
    while ((len = getline(&buf, &cap_b, f)) >= 0) {
        no++;
        while (len > 0 && (buf[len - 1] == '\n' || buf[len - 1] == '\r')) buf[--len] = 0;
        if (len == 0) continue;
        if (n + 1 >= cap) {
            cap = cap ? cap * 2 : 16;
            char **l = realloc(lines, sizeof *l * (size_t)cap);
            if (l) lines = l;
            int *m = l ? realloc(nos, sizeof *m * (size_t)cap) : NULL;
            if (m) nos = m;
            if (!l || !m) {
                rc = mf_error(-ENOMEM, "out of memory");
                break;
            }
        }
        if (strlen(buf) == (size_t)len && !(lines[n] = strdup(buf))) {
            rc = mf_error(-ENOMEM, "out of memory");
            break;
        }
        if (strlen(buf) != (size_t)len) lines[n] = NULL;
        nos[n++] = no;
    }
    free(buf);
    fclose(f);
    if (!rc && n == 0) rc = mf_error(-EINVAL, "--prompts %s: no prompts (no non-empty lines)", path);
    if (rc) {
        for (int i = 0; i < n; i++) free(lines[i]);
        free(lines);
        free(nos);
        return rc;
    }
    *out = lines;
    *line_no = nos;
    *n_out = n;
    return 0;
}

void mf_dec_refuse_line(mf_dec *d, int i, const char *fmt, ...)
{
    char m[MF_ERROR_MSG_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(m, sizeof m, fmt, ap);
    va_end(ap);
    mf_dec_seq *q = &d->sq[i];
    if (q->state != MF_DEC_RUN) return;
    free(q->pids);
    q->pids = NULL;
    q->n_pid = 0;
    q->state = MF_DEC_BAD;
    q->bad = strdup(m);
    d->n_bad++;
}

/* The tokenizer (when DIR has one) and, with --chat, the chat template. 0, a negative code, or 2. */
static int mf_dec_tokenizer(mf_dec *d)
{
    const mf_dec_cli *a = d->a;
    char tpath[4200];
    snprintf(tpath, sizeof tpath, "%s/tokenizer.json", a->dir);
    d->have_tok = access(tpath, R_OK) == 0;
    if (a->prompt && !d->have_tok) {
        fprintf(stderr, "moeflow decode: %s has no tokenizer.json, so --prompt text cannot be encoded; "
                        "give token ids with --tokens\n", a->dir);
        return 2;
    }
    int rc = d->have_tok ? mf_tok_load(tpath, &d->tok) : 0;
    if (rc) return rc;
    if (a->chat_spec && !a->chat) {
        fprintf(stderr, "moeflow decode: --chat-template applies with --chat\n");
        return 2;
    }
    if (!a->chat) return 0;
    char desc[4400];
    if (!d->have_tok || a->ids) {
        fprintf(stderr, "moeflow decode: --chat needs prompt text and %s/tokenizer.json\n", a->dir);
        return 2;
    }
    if (mf_chat_tmpl_load(a->dir, a->chat_spec, &d->ct, desc, sizeof desc)) {
        fprintf(stderr, "moeflow decode: %s\n", mf_last_error());
        return 2;
    }
    if (!a->quiet) fprintf(stderr, "moeflow decode: chat: %s\n", desc);
    if (d->ct) d->no_bos = 1;   /* the template writes BOS as text, if it wants one */
    return 0;
}

/* Sequence i's prompt ids: its text (through the chat template with --chat) or its ids. 0 or 2;
 * with --prompts a line that cannot be a prompt is refused (MF_DEC_BAD) and the run goes on. */
static int mf_dec_seq_ids(mf_dec *d, int i)
{
    const mf_dec_cli *a = d->a;
    mf_dec_seq *q = &d->sq[i];
    q->index = a->prompts_file ? d->line_no[i] - 1 : i;
    q->line = a->prompts_file ? d->lines[i] : a->prompt ? a->prompt : a->ids;
    if (a->prompts_file && !d->lines[i]) {
        mf_dec_refuse_line(d, i, "the line holds a NUL byte");
        return 0;
    }
    const char *text = a->prompts_file ? (d->have_tok ? d->lines[i] : NULL) : a->prompt;
    const char *tids = a->prompts_file ? (d->have_tok ? NULL : d->lines[i]) : a->ids;
    char *rendered = NULL;
    if (a->chat && text) {   /* one user message through the chat template */
        mf_serve_msg msg = {.role = "user", .content = (char *)text};
        mf_serve_req rq = {.chat = 1, .msgs = &msg, .n_msgs = 1};
        size_t rn;
        int bos_in_text;
        if (mf_serve_chat_render(&rq, d->ct, &rendered, &rn, &bos_in_text)) {
            if (a->prompts_file) {
                mf_dec_refuse_line(d, i, "the chat template: %s", mf_last_error());
                return 0;
            }
            fprintf(stderr, "moeflow decode: the chat template: %s\n", mf_last_error());
            return 2;
        }
        text = rendered;
    }
    int prc = mf_prompt_ids(d->tok, text, tids, d->no_bos, &q->pids, &q->n_pid);
    free(rendered);
    if (prc == -ENOMEM) return prc;
    if (prc && a->prompts_file) {
        mf_dec_refuse_line(d, i, "%s", mf_last_error());
        return 0;
    }
    if (prc) {
        fprintf(stderr, "moeflow decode: %s\n", mf_last_error());
        return 2;
    }
    return 0;
}

/* Writes line[0..n) and a newline to fd with one write (a record is whole or absent). 0 or -EIO. */
static int mf_dec_write_line(int fd, const char *line, size_t n)
{
    char *b = malloc(n + 1);
    if (!b) return -ENOMEM;
    memcpy(b, line, n);
    b[n] = '\n';
    size_t off = 0;
    while (off < n + 1) {
        ssize_t w = write(fd, b + off, n + 1 - off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break;
        off += (size_t)w;
    }
    free(b);
    return off == n + 1 ? 0 : -EIO;
}

/* --resume: the records already in --output (one JSON object per line, with its "index"): their
 * prompts are not run again. A last line without its newline (a run killed mid-write) is cut off;
 * a record for a line FILE does not have, or whose prompt differs, refuses the resume. 0 or 2. */
static int mf_dec_resume(mf_dec *d)
{
    const mf_dec_cli *a = d->a;
    FILE *f = fopen(a->outfile, "r");
    if (!f && errno == ENOENT) return 0;   /* nothing yet: a fresh run */
    if (!f) {
        fprintf(stderr, "moeflow decode: --output %s: cannot open: %s\n", a->outfile, strerror(errno));
        return 2;
    }
    char *buf = NULL;
    size_t cap = 0;
    ssize_t len;
    long good = 0, no = 0;
    int rc = 0;
    while (!rc && (len = getline(&buf, &cap, f)) > 0) {
        no++;
        json_error_t je;
        json_t *o = buf[len - 1] == '\n' ? json_loadb(buf, (size_t)len, JSON_ALLOW_NUL, &je) : NULL;
        json_t *ix = json_object_get(o, "index");
        if (!o || !json_is_integer(ix)) {   /* cut mid-write: only the last line may be */
            json_decref(o);
            if (buf[len - 1] != '\n' && getc(f) == EOF) break;
            fprintf(stderr, "moeflow decode: --resume: %s line %ld is not a record of decode --output\n", a->outfile, no);
            rc = 2;
            break;
        }
        json_int_t want = json_integer_value(ix);
        int lo = 0, hi = d->n_seq;   /* the prompts are in file order: their indices ascend */
        while (lo < hi) {
            int mid = (lo + hi) / 2;
            if (d->sq[mid].index < want) lo = mid + 1;
            else hi = mid;
        }
        int k = lo < d->n_seq && d->sq[lo].index == want ? lo : d->n_seq;
        const char *pr = json_string_value(json_object_get(o, "prompt"));
        if (k == d->n_seq || (pr && d->sq[k].line && strcmp(pr, d->sq[k].line))) {
            fprintf(stderr, "moeflow decode: --resume: %s line %ld is the record of a prompt %s %s does not have "
                    "(index %lld): another prompts file?\n", a->outfile, no, k == d->n_seq ? "that" : "which",
                    a->prompts_file, (long long)want);
            rc = 2;
        } else if (d->sq[k].state != MF_DEC_HAD) {
            d->n_bad -= d->sq[k].state == MF_DEC_BAD;
            d->sq[k].state = MF_DEC_HAD;
            d->n_had++;
            d->n_had_bad += json_object_get(o, "error") != NULL;
        }
        json_decref(o);
        good += len;
    }
    free(buf);
    fclose(f);
    if (!rc && truncate(a->outfile, good)) {
        fprintf(stderr, "moeflow decode: --output %s: %s\n", a->outfile, strerror(errno));
        rc = 2;
    }
    return rc;
}

int mf_dec_prompts(mf_dec *d)
{
    const mf_dec_cli *a = d->a;
    int rc = mf_dec_tokenizer(d);
    if (rc) return rc;
    if (a->resume && (!a->prompts_file || !a->outfile)) {
        fprintf(stderr, "moeflow decode: --resume needs --prompts and --output\n");
        return 2;
    }
    if (a->prompts_file) {
        if (mf_read_lines(a->prompts_file, &d->lines, &d->line_no, &d->n_lines)) {
            fprintf(stderr, "moeflow decode: %s\n", mf_last_error());
            return 2;
        }
        d->n_seq = d->n_lines;
        d->is_text = d->have_tok;
    } else {
        d->n_seq = a->batch ? (int)a->batch : 1;
        d->is_text = a->prompt != NULL;
    }
    /* one sequence on the scheduled engine: nothing waits behind its prefill, which runs in the
     * engine's prefill chunks (fewer weight passes than graphs of 64: docs/decode.md) */
    d->step_tokens = a->step_tokens ? a->step_tokens
                   : d->n_seq == 1 && a->e.sched ? MF_STEP_PREFILL_CHUNK : MF_BATCH_STEP_TOKENS;
    if (!(d->sq = calloc((size_t)d->n_seq, sizeof *d->sq))) return mf_error(-ENOMEM, "out of memory");
    for (int i = 0; i < d->n_seq; i++)
        if ((rc = mf_dec_seq_ids(d, i))) return rc;
    d->max_batch = a->batch ? (int)a->batch : d->n_seq < MF_STEP_MAX_ITEMS ? d->n_seq : MF_STEP_MAX_ITEMS;
    if (a->outfile && mf_path_make_parent(a->outfile)) {   /* missing folders are made, as mkdir -p */
        fprintf(stderr, "moeflow decode: --output: %s\n", mf_last_error());
        return 2;
    }
    if (a->resume && (rc = mf_dec_resume(d))) return rc;
    if (a->outfile && (d->outf = open(a->outfile, O_WRONLY | O_CREAT | O_CLOEXEC | (a->resume ? O_APPEND : O_TRUNC),
                                      0644)) < 0) {
        fprintf(stderr, "moeflow decode: --output %s: cannot open: %s\n", a->outfile, strerror(errno));
        return 2;
    }
    if (a->resume && !a->quiet)
        fprintf(stderr, "moeflow decode: --resume: %d of %d prompts are in %s already\n", d->n_had, d->n_seq,
                a->outfile);
    return 0;
}

void mf_dec_prompts_free(mf_dec *d)
{
    if (d->outf >= 0) close(d->outf);
    for (int s = 0; d->sq && s < d->n_seq; s++) {
        free(d->sq[s].pids);
        free(d->sq[s].gen);
        free(d->sq[s].bad);
    }
    free(d->sq);
    mf_tok_free(d->tok);
    mf_chat_tmpl_free(d->ct);
    for (int i = 0; i < d->n_lines; i++) free(d->lines[i]);
    free(d->lines);
    free(d->line_no);
}

void mf_dec_on_route(void *user, const void *seq, int64_t pos, int layer, const int32_t *experts,
                     const float *weights, int n)
{
    mf_route_rec_ctx *x = user;
    const mf_dec_seq *q = mf_batch_state_user(x->b, seq);
    int rc = mf_routing_rec_add(x->rec, q ? q->index : 0, pos, layer, experts, n), zero = 0;
    (void)weights;
    if (rc && __atomic_compare_exchange_n(&x->rc, &zero, rc, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        snprintf(x->msg, sizeof x->msg, "%s", mf_last_error());
}

/* The text of ids (ill-formed UTF-8 as U+FFFD), malloc'ed in *out (n_out bytes), or NULL. */
static char *mf_dec_text(const mf_tok *tok, const int32_t *ids, long n, size_t *n_out)
{
    size_t cap = 64 + (size_t)n * 64, nb = 0;
    char *t = malloc(cap);
    int rc = t ? mf_tok_decode(tok, ids, (size_t)n, 0, t, cap, &nb) : -ENOMEM;
    if (rc == -ENOSPC) {
        char *u = realloc(t, nb + 1);
        rc = u ? mf_tok_decode(tok, ids, (size_t)n, 0, t = u, nb + 1, &nb) : -ENOMEM;
    }
    if (rc) {
        free(t);
        return NULL;
    }
    *n_out = nb;
    return t;
}

/* Record o as one line of --output (o released). 0 or -EIO. */
static int mf_dec_put(int fd, json_t *o)
{
    char *line = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    int rc = line ? mf_dec_write_line(fd, line, strlen(line)) : -ENOMEM;
    free(line);
    return rc;
}

/* The fields every record starts with: index (the line's index in FILE, from 0), line (its
 * number, from 1; --prompts only), prompt (null when not UTF-8). */
static json_t *mf_dec_record(const mf_dec_seq *q, int with_line)
{
    json_t *o = json_object();
    json_object_set_new(o, "index", json_integer(q->index));
    if (with_line) json_object_set_new(o, "line", json_integer(q->index + 1));
    json_t *pl = q->line ? json_string(q->line) : NULL;   /* NULL when the line is not UTF-8 */
    json_object_set_new(o, "prompt", pl ? pl : json_null());
    return o;
}

/* --output: one JSON object per finished prompt (in the order they finish). */
static int mf_dec_write_jsonl(mf_dec_ctx *x, const mf_dec_seq *q)
{
    json_t *o = mf_dec_record(q, x->with_line), *ids = json_array();
    for (long k = 0; k < q->n_gen; k++) json_array_append_new(ids, json_integer(q->gen[k]));
    if (x->tok) {
        size_t nb = 0;
        char *t = mf_dec_text(x->tok, q->gen, q->n_gen, &nb);
        json_t *js = t ? json_stringn(t, nb) : NULL;
        json_object_set_new(o, "text", js ? js : json_null());
        free(t);
    }
    json_object_set_new(o, "tokens", ids);
    json_object_set_new(o, "prompt_tokens", json_integer(q->n_pid));
    json_object_set_new(o, "finish_reason", json_string(mf_batch_finish_name((mf_batch_finish)q->finish)));
    json_object_set_new(o, "queue_s", json_real((q->admit_ns - q->submit_ns) / 1e9));
    json_object_set_new(o, "first_token_s", json_real(q->first_ns ? (q->first_ns - q->submit_ns) / 1e9 : 0.0));
    json_object_set_new(o, "total_s", json_real((q->done_ns - q->submit_ns) / 1e9));
    return mf_dec_put(x->out, o);
}

int mf_dec_write_refused(mf_dec *d)
{
    for (int i = 0; d->outf >= 0 && i < d->n_seq; i++) {
        const mf_dec_seq *q = &d->sq[i];
        if (q->state != MF_DEC_BAD) continue;
        json_t *o = mf_dec_record(q, d->a->prompts_file != NULL);
        json_object_set_new(o, "error", json_string(q->bad ? q->bad : "refused"));
        if (mf_dec_put(d->outf, o)) return mf_error(-EIO, "--output %s: write failed", d->a->outfile);
    }
    return 0;
}

/* Prints s[0..n) with newline, CR, tab, backslash and the other control bytes escaped. */
static void mf_dec_print_escaped(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\\') fputs("\\\\", stdout);
        else if (c == '\n') fputs("\\n", stdout);
        else if (c == '\r') fputs("\\r", stdout);
        else if (c == '\t') fputs("\\t", stdout);
        else if (c < 0x20 || c == 0x7f) printf("\\x%02x", c);
        else putchar(c);
    }
}

void mf_dec_print_lines(const mf_dec *d)
{
    for (int s = 0; s < d->n_seq; s++) {
        const mf_dec_seq *q = &d->sq[s];
        if (q->state == MF_DEC_BAD) {
            printf("[%d] error: ", q->index);
            mf_dec_print_escaped(q->bad ? q->bad : "refused", strlen(q->bad ? q->bad : "refused"));
            putchar('\n');
            continue;
        }
        if (q->state != MF_DEC_RUN || !q->done || q->finish == MF_BATCH_CANCELLED) continue;
        printf("[%d] ", q->index);
        size_t nb = 0;
        char *t = d->tok ? mf_dec_text(d->tok, q->gen, q->n_gen, &nb) : NULL;
        if (t) mf_dec_print_escaped(t, nb);
        for (long k = 0; !t && k < q->n_gen; k++) printf(k ? " %d" : "%d", q->gen[k]);
        free(t);
        putchar('\n');
    }
}

void mf_dec_on_event(void *user, const mf_batch_event *ev)
{
    mf_dec_ctx *x = user;
    mf_dec_seq *q = ev->user;
    if (ev->kind == MF_BATCH_TOKEN) {
        q->gen[q->n_gen++] = ev->token;
        x->generated++;
        if (x->stream) mf_dec_emit_token(x->tok, ev->token, q->n_gen == 1);
        return;
    }
    q->done = 1;
    q->finish = ev->finish;
    q->submit_ns = ev->submit_ns;
    q->admit_ns = ev->admit_ns;
    q->first_ns = ev->first_ns;
    q->done_ns = ev->now_ns;
    x->n_done += ev->finish != MF_BATCH_CANCELLED;
    if (ev->finish == MF_BATCH_ERROR && !x->rc) {
        x->rc = ev->err;
        snprintf(x->msg, sizeof x->msg, "%s", ev->msg ? ev->msg : "forward failed");
    }
    if (ev->finish == MF_BATCH_CANCELLED) return;   /* an interrupted run: --resume runs it again */
    if (x->out >= 0 && mf_dec_write_jsonl(x, q) && !x->rc) {
        x->rc = -EIO;
        snprintf(x->msg, sizeof x->msg, "--output: write failed");
    }
}

/* The progress line: done/total, generated tokens/s, ETA (from the rate of finished prompts). */
void mf_dec_progress(const mf_dec_ctx *x, int total, int64_t now, int last)
{
    double sec = (now - x->t0) / 1e9;
    int tty = isatty(2);
    char eta[32] = "-";
    if (x->n_done > 0 && x->n_done < total)
        snprintf(eta, sizeof eta, "%.0f s", sec / x->n_done * (total - x->n_done));
    else if (x->n_done == total)
        snprintf(eta, sizeof eta, "0 s");
    fprintf(stderr, "%smoeflow decode: %d/%d done, %.2f tokens/s, ETA %s%s", tty ? "\r" : "", x->n_done, total,
            sec > 0 ? x->generated / sec : 0.0, eta, tty && !last ? "   " : "\n");
}

double mf_dec_median_ttft(const mf_dec_seq *sq, int n)
{
    double v[64];
    int k = 0;
    for (int i = 0; i < n && k < 64; i += n / 64 + 1)   /* a sample of at most 64 */
        if (sq[i].first_ns) v[k++] = (sq[i].first_ns - sq[i].submit_ns) / 1e9;
    for (int i = 1; i < k; i++)
        for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return k ? v[k / 2] : 0.0;
}
