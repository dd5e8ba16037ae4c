/* `moeflow serve`'s tool calls in the checkpoint's own format, DeepSeek-V4's DSML (DeepSeek's
 * encoding_dsv4.py; docs/serve.md "Tool calls"): the model ends its answer with
 *   "\n\n<｜DSML｜tool_calls>\n" + invokes joined by "\n" + "\n</｜DSML｜tool_calls>"
 * where an invoke is '<｜DSML｜invoke name="NAME">\n' + parameters joined by "\n" + "\n</｜DSML｜invoke>"
 * and a parameter '<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>'
 * (string="true": VALUE is the raw string; "false": VALUE is JSON). This file parses such output
 * into OpenAI tool_calls, says how much of a streamed text is surely content, and builds the
 * grammar that forces a call (tool_choice required or a named function). No HTTP: fuzzed with the
 * request parser. */
#ifndef MF_TOOLS_SERVE_TOOLS_H
#define MF_TOOLS_SERVE_TOOLS_H

#include <stddef.h>

#include "tools/serve_req.h"

/* The DSML markers (one home; gen's chat template writes the same). */
#define MF_DSML "\xef\xbd\x9c" "DSML" "\xef\xbd\x9c"   /* ｜DSML｜ */
#define MF_DSML_CALLS_OPEN "\n\n<" MF_DSML "tool_calls>"
#define MF_DSML_CALLS_CLOSE "</" MF_DSML "tool_calls>"
#define MF_DSML_INVOKE "<" MF_DSML "invoke name=\""
#define MF_DSML_INVOKE_CLOSE "</" MF_DSML "invoke>"
#define MF_DSML_PARAM "<" MF_DSML "parameter name=\""
#define MF_DSML_PARAM_CLOSE "</" MF_DSML "parameter>"

/* 1 when name is 1..64 of [a-zA-Z0-9_.-] (OpenAI's rule for function names). */
int mf_serve_tool_name_ok(const char *name);

/* One parsed call: the function's name and its arguments as compact JSON (an object). */
typedef struct mf_tool_call {
    char *name;
    char *args;
} mf_tool_call;

typedef struct mf_tool_calls {
    char *content;      /* the text before the calls */
    size_t n_content;
    mf_tool_call *calls;
    int n;
} mf_tool_calls;

/* Parses text[0..n) (a finished answer): 1 with *out filled when it holds a well-formed DSML
 * block of calls to functions named in r's tools (text after it: none), 0 when it holds no
 * block's opening, -EINVAL when it opens one that is malformed (the caller returns the text as
 * content), -ENOMEM. */
int mf_serve_tools_parse(const mf_serve_req *r, const char *text, size_t n, mf_tool_calls *out);
void mf_tool_calls_clear(mf_tool_calls *c);

/* Bytes of a streamed text[0..n) that are content whatever follows: up to the block's opening,
 * or, without one, all but a tail that could begin it. */
size_t mf_serve_tools_content_len(const char *text, size_t n);

/* The grammar of a forced call for r (tool_choice required: one or more calls to r's tools;
 * named: one call to that function), parameters named by each tool's properties with values
 * valid under their schemas (string-typed: raw text, string="true"; others JSON, "false"). 0 or
 * the grammar compiler's code (mf_last_error() says which tool and keyword). */
int mf_serve_tools_grammar(const mf_serve_req *r, mf_gram **out);

#endif
