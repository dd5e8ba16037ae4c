/* `moeflow decode`'s own parts, shared by its two files: tools/cmd_decode.c (the options, the model
 * and engine, the step loop and its reports) and tools/cmd_decode_seqs.c (the prompts in, one
 * record per sequence, the batcher's events out: streamed text, the per-prompt lines, --output's
 * JSONL, the progress line, --record-routing's hook). Private to the command. */
#ifndef MF_TOOLS_CMD_DECODE_H
#define MF_TOOLS_CMD_DECODE_H

#include <stdint.h>
#include <stdio.h>

#include "graphs/model/engram_map.h"
#include "graphs/model/model.h"
#include "graphs/ref/ref.h"
#include "graphs/sim/routing.h"
#include "graphs/step/batch.h"
#include "graphs/step/step.h"
#include "host/store.h"
#include "host/tokenizer.h"
#include "sched/error.h"
#include "sched/profile.h"
#include "tools/commands.h"
#include "tools/engine_opts.h"
#include "tools/ranks.h"
#include "tools/serve_req.h"
#include "tools/tool_prefix.h"

/* The command line (mf_dec_table); the engine and model options are the group decode shares with
 * serve (tools/engine_opts.h). */
typedef struct mf_dec_cli {
    const char *dir, *prompt, *ids, *prompts_file, *outfile, *chat_spec;
    const char *trace, *record, *logits_out;
    int chat, no_bos, ignore_eos, act_quant, quiet, resume;
    long max_new, batch, step_tokens;   /* batch, step_tokens 0: not given */
    double temperature, top_p;
    unsigned long long seed;
    int spec;                      /* --spec: MF_TOOL_SPEC_OFF or _DSPARK */
    long spec_tokens;              /* --spec-tokens: N, 0 auto */
    mf_tool_engine e;
    mf_tool_ranks rk;              /* --ranks-layers, --ranks-micro, --ranks-timeout (e.rk points here) */
    mf_tool_prefix pfx;            /* --prefix-cache and its kin */
} mf_dec_cli;

/* What becomes of a prompt of the run. */
enum {
    MF_DEC_RUN = 0,   /* submitted to the batcher */
    MF_DEC_BAD,       /* refused (bad): an error record instead */
    MF_DEC_HAD        /* --resume: its record is in --output already */
};

/* One prompt of the run and what it produced. */
typedef struct mf_dec_seq {
    int index;             /* --prompts: the line's index in FILE (from 0; empty lines count); else i */
    const char *line;      /* the prompt as given */
    int32_t *pids, *gen;
    int n_pid;
    long n_gen;
    int done, finish, state;
    char *bad;             /* MF_DEC_BAD: why */
    uint64_t id;           /* the batcher's */
    int64_t submit_ns, admit_ns, first_ns, done_ns;
} mf_dec_seq;

/* The batcher's events' side: where tokens and finished prompts go. */
typedef struct mf_dec_ctx {
    mf_dec_seq *sq;
    const mf_tok *tok;
    int stream;            /* one sequence: print tokens as they come */
    int out;               /* --output JSONL (a descriptor: one write per record), or -1 */
    int with_line;         /* --prompts: records carry the line number */
    FILE *lgout;           /* --logits-out, or NULL */
    int64_t V;             /* its rows' length (vocab_size) */
    int quiet, n_done, rc;
    int64_t t0, generated;
    char msg[MF_ERROR_MSG_BYTES];
} mf_dec_ctx;

/* --record-routing: the on_route hook writes each (sequence, position, layer) record; the state
 * it names belongs to the running request the batcher gives back. */
typedef struct mf_route_rec_ctx {
    mf_routing_rec *rec;
    mf_batch *b;
    int rc;   /* first failure, its message in msg (hooks run on worker threads) */
    char msg[MF_ERROR_MSG_BYTES];
} mf_route_rec_ctx;

/* A run of decode: what it opened, its sequences, the step loop's totals. The steps answer 0, a
 * negative code (mf_last_error says why; exit 1) or a positive exit code (said on stderr). */
typedef struct mf_dec {
    const mf_dec_cli *a;
    int no_bos;                    /* resolved: no BOS id */
    int follower;                  /* a pipeline's rank > 0: its layers for rank 0's steps, no prompts' outputs */
    mf_tool_ranks *rk;             /* the cli's rk, opened (tools/ranks.h) */
    /* the prompts (cmd_decode_seqs.c) */
    mf_tok *tok;
    int have_tok, is_text;
    mf_chat_tmpl *ct;
    char **lines;
    int *line_no;                  /* --prompts: each line's number in FILE (from 1) */
    int n_lines, n_seq, max_batch;
    int n_bad, n_had;              /* prompts refused (error records), already in --output (--resume) */
    int n_had_bad;                 /* --resume: error records among those already in --output */
    long step_tokens;
    mf_dec_seq *sq;
    int outf;                      /* --output, or -1 */
    FILE *lgf;                     /* --logits-out, or NULL */
    int sig;                       /* the signal that interrupted the run (SIGINT, SIGTERM), or 0 */
    /* the model, engine (tools/engine_opts.h) and batcher */
    mf_tool_run x;
    mf_batch *bat;
    mf_prefix *pfx;                /* the prefix cache, or NULL (--prefix-cache 0) */
    int64_t total;                 /* positions: the longest prompt + --max-new-tokens */
    mf_route_rec_ctx rrec;
    mf_dec_ctx dc;
    /* the step loop's totals */
    long steps;
    int64_t t0, t2;
    int64_t io_busy_ns, io_overlap_ns, ex_busy_ns;            /* scheduled engine with a store */
    int64_t cp_busy_ns, cp_overlap_ns, cm_busy_ns;            /* with devices */
    int64_t sock_home, sock_cross, dense_home, dense_cross;   /* with sockets */
    mf_step_dev_stats dtot;
} mf_dec;

/* cmd_decode_seqs.c: the tokenizer, the chat template, the prompts (one, B copies, or FILE's
 * lines) as token ids (a line that cannot be a prompt is marked MF_DEC_BAD with its reason), and
 * --output's file: created, or with --resume the records already in it taken (a cut last line
 * removed) and the file opened to append. 0, a negative code or 2. */
int mf_dec_prompts(mf_dec *d);
/* Marks prompt i refused (MF_DEC_BAD) with the reason fmt... (its error record comes later). */
void mf_dec_refuse_line(mf_dec *d, int i, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* The error records of the refused prompts not in --output yet. 0 or -EIO. */
int mf_dec_write_refused(mf_dec *d);
/* The stdout lines of several sequences: "[index] text" (newline, CR, tab, backslash and other
 * control bytes escaped as \n \r \t \\ \xHH), "[index] error: why" for a refused one; token
 * ids without a tokenizer. Prompts cancelled or not started by an interruption print none. */
void mf_dec_print_lines(const mf_dec *d);
/* Prints one token: its text with a tokenizer, else its id (space-separated after the first). */
void mf_dec_emit_token(const mf_tok *tok, int32_t id, int first);
/* The batcher's on_event: tokens into their sequence (streamed with one), ends into --output. */
void mf_dec_on_event(void *user, const mf_batch_event *ev);
/* The progress line: done/total, generated tokens/s, ETA (from the rate of finished prompts). */
void mf_dec_progress(const mf_dec_ctx *x, int total, int64_t now, int last);
/* The median time to first token over a sample of at most 64 sequences, seconds. */
double mf_dec_median_ttft(const mf_dec_seq *sq, int n);
/* --record-routing's on_route hook (user: an mf_route_rec_ctx). */
void mf_dec_on_route(void *user, const void *seq, int64_t pos, int layer, const int32_t *experts,
                     const float *weights, int n);
/* Frees the prompts' side (tokenizer, template, lines, sequences, --output's file). */
void mf_dec_prompts_free(mf_dec *d);

#endif
