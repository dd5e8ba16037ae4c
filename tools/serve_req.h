/* `moeflow serve`'s request parser: an OpenAI /v1/completions or /v1/chat/completions body
 * (JSON) into a request, every field checked for type and range, and the chat template that
 * turns messages into prompt text. No HTTP and no engine here, so it can be fuzzed
 * (tests/fuzz/fuzz_serve_req.c). Fields and refusals: docs/serve.md. */
#ifndef MF_SERVE_REQ_H
#define MF_SERVE_REQ_H

#include <stddef.h>
#include <stdint.h>

#define MF_SERVE_MAX_STOP 4
#define MF_SERVE_MAX_IDS (1 << 20)
#define MF_SERVE_MAX_N 16   /* choices per request (`n`) */

#define MF_SERVE_MAX_TOOLS 128   /* tools per request */
#define MF_SERVE_MAX_LOGPROBS 20 /* top_logprobs (chat), logprobs (completions) */

typedef struct mf_serve_msg {
    char *role;      /* system, developer, user, assistant or tool */
    char *content;   /* "" when null (content_null 1) */
    int content_null;
    char *tool_calls;     /* assistant: its tool_calls as compact JSON ([{id, type, function: {name,
                           * arguments}}], arguments a string), or NULL */
    char *tool_call_id;   /* tool: the call it answers (may be NULL) */
} mf_serve_msg;

/* A logit bias of the request: token id -> bias (-100..100). */
typedef struct mf_serve_bias {
    int32_t id;
    float bias;
} mf_serve_bias;

typedef struct mf_gram mf_gram;   /* host/grammar.h */

enum { MF_TOOLS_NONE = 0, MF_TOOLS_AUTO, MF_TOOLS_REQUIRED, MF_TOOLS_NAMED };

typedef struct mf_serve_req {
    int chat;                   /* 1: /v1/chat/completions */
    char *prompt;               /* completions: text (NULL when given as token ids) */
    int32_t *ids;               /* completions: the prompt as token ids */
    int n_ids;
    mf_serve_msg *msgs;         /* chat */
    int n_msgs;
    int n;                      /* choices, 1..MF_SERVE_MAX_N (default 1); choice i samples with seed + i */
    int max_tokens;             /* -1: not given */
    double temperature;         /* default 1 (OpenAI's) */
    double top_p;               /* default 1 */
    uint64_t seed;              /* default 0 */
    int seed_given;             /* 1: `seed` was in the request (else the server draws one) */
    int stream, ignore_eos;
    char *stop[MF_SERVE_MAX_STOP];
    int n_stop;
    char *model;                /* NULL: not given */
    /* logprobs: chat `logprobs: true` (top_logprobs 0..20 alternatives), completions
     * `logprobs: N` (N alternatives); echo (completions): the prompt comes back with the text,
     * and with logprobs its tokens' logprobs too */
    int logprobs, top_logprobs, echo;
    double presence_penalty, frequency_penalty;   /* -2..2, default 0 */
    double repetition_penalty;                    /* 0 < r <= 2, default 1 (off) */
    double min_p;                                 /* 0..1, default 0 */
    int top_k;                                    /* 0 (all) or -1 (all), up to 1<<20 */
    mf_serve_bias *bias;                          /* logit_bias (ids checked by the server) */
    int n_bias;
    /* response_format: json_object or json_schema, compiled (host/grammar.h); NULL: text */
    mf_gram *grammar;
    int json_mode;                                /* 0 text, 1 json_object, 2 json_schema */
    /* chat tools: the `tools` list as compact JSON ([{type: "function", function: {name,
     * description, parameters}}]), their names, and tool_choice (MF_TOOLS_*; NAMED: tool_name).
     * tool_choice none, or no tools: n_tools 0 and tools NULL (the template sees none). */
    char *tools;
    char **tool_names;
    char **tool_params;         /* each tool's parameters schema as compact JSON ("{}" if absent) */
    int n_tools, tool_choice;
    char *tool_name;
} mf_serve_req;

/* Why a body was refused: an OpenAI error object's message and param (the field, or ""). */
typedef struct mf_serve_err {
    char message[512];
    char param[64];
} mf_serve_err;

/* Parses body[0..len) for the completions (chat 0) or chat endpoint. Returns 0, or -EINVAL with
 * err filled: malformed JSON (line and column), not an object, a missing prompt / messages, a
 * field of the wrong type or out of range, n outside 1..MF_SERVE_MAX_N, a response_format schema
 * outside the supported subset (the message names the keyword), tools that are not functions
 * with names, a tool_choice naming no tool, options moeflow does not implement (best_of > 1,
 * suffix, functions / function_call) when set to anything but their defaults; -ENOMEM. Unknown
 * fields are ignored. *out is cleared on failure. */
int mf_serve_req_parse(const char *body, size_t len, int chat, mf_serve_req *out, mf_serve_err *err);
void mf_serve_req_clear(mf_serve_req *r);

/* A chat template: a Jinja2 template (host/jinja.h) with the bos_token and eos_token strings it is
 * rendered with. Opaque; NULL stands for the built-in format below. */
typedef struct mf_chat_tmpl mf_chat_tmpl;

/* The chat template for checkpoint dir. spec NULL: dir/tokenizer_config.json's `chat_template` (a
 * string, or the entry named "default" of a list) with its bos_token / eos_token (strings or
 * {"content": ...}); 0 and *out NULL when the file or the field is absent. spec "builtin": *out
 * NULL. Else spec is a file: a tokenizer_config.json when it ends in .json, a template otherwise
 * (bos/eos from dir's tokenizer_config.json when it has them). desc gets what was chosen, for the
 * start line. spec "deepseek-v4": the template `moeflow gen` writes (graphs/gen/gen_chat.h:
 * DeepSeek-V4's chat encoding with tools) with DeepSeek's BOS and EOS. Fails with -EINVAL (a template moeflow cannot render: mf_last_error names the file,
 * line and column; a malformed tokenizer_config.json), -ENOENT (spec missing), -ENOMEM. */
int mf_chat_tmpl_load(const char *dir, const char *spec, mf_chat_tmpl **out, char *desc, size_t desc_cap);
void mf_chat_tmpl_free(mf_chat_tmpl *t);

/* Renders r's messages as prompt text. With t: the template, with messages [{role, content}]
 * (content null where it was), add_generation_prompt true, bos_token and eos_token; *bos_in_text 1:
 * the caller adds no BOS id (as apply_chat_template: BOS is in the text if the template writes it,
 * and the text is encoded without special tokens added). Its failures
 * (raise_exception, a type error) are -EINVAL with mf_last_error() naming line and column.
 * t NULL, the built-in format (the DeepSeek-V3 format without tools or thinking): system messages'
 * contents first, then "<｜User｜>" + content for user messages, "<｜Assistant｜>" + content +
 * "<｜end▁of▁sentence｜>" for assistant messages, and a final "<｜Assistant｜>"; BOS is not part of
 * the text (*bos_in_text 0: the caller prepends its id). *out is malloc'ed; 0, -EINVAL or -ENOMEM. */
int mf_serve_chat_render(const mf_serve_req *r, const mf_chat_tmpl *t, char **out, size_t *n_out, int *bos_in_text);



#endif
