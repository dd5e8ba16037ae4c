/* The DeepSeek-V4 chat template with tools (graphs/gen/gen_chat.h). The DSML markers are those of
 * tools/serve_tools.h; the tools block's wording is moeflow's (DeepSeek's encoding_dsv4.py words
 * its own: a released checkpoint's file is the one to serve it with). */
#include "graphs/gen/gen_chat.h"

#include <errno.h>
#include <jansson.h>

#include "sched/error.h"

#define D "\xef\xbd\x9c" "DSML" "\xef\xbd\x9c"
#define USER "<\xef\xbd\x9cUser\xef\xbd\x9c>"
#define ASSISTANT "<\xef\xbd\x9c" "Assistant\xef\xbd\x9c>"

static const char mf_chat_src[] =
    "{%- set ns = namespace(tools_done=false, schemas='') -%}\n"
    "{%- for t in (tools or []) -%}{%- set ns.schemas = ns.schemas + ('\\n' if not loop.first else '') + "
    "(t.function | tojson) -%}{%- endfor -%}\n"
    "{%- set tools_block = '## Tools\\n\\nYou can call the tools below. To call them, end your answer with a \"<" D
    "tool_calls>\" block of this form:\\n\\n<" D "tool_calls>\\n<" D "invoke name=\"$TOOL_NAME\">\\n<" D
    "parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</" D "parameter>\\n...\\n</" D
    "invoke>\\n</" D "tool_calls>\\n\\nGive string parameters as they are, with string=\"true\"; give numbers, "
    "booleans, arrays and objects as JSON, with string=\"false\".\\n\\n### Available Tool Schemas\\n\\n' + "
    "ns.schemas + '\\n\\nUse only these tool names and parameters.\\n' -%}\n"
    "{{- bos_token -}}\n"
    "{%- if tools and not (messages and messages[0].role == 'system') -%}"
    "{{- '\\n\\n' + tools_block -}}{%- set ns.tools_done = true -%}{%- endif -%}\n"
    "{%- for m in messages -%}\n"
    "{%- set prev = loop.previtem.role if loop.previtem is defined else '' -%}\n"
    "{%- set next = loop.nextitem.role if loop.nextitem is defined else '' -%}\n"
    "{%- if m.role == 'system' -%}\n"
    "{{- m.content or '' -}}\n"
    "{%- if tools and not ns.tools_done -%}{{- '\\n\\n' + tools_block -}}{%- set ns.tools_done = true -%}{%- endif -%}\n"
    "{%- elif m.role == 'user' or m.role == 'developer' -%}\n"
    "{{- ('\\n\\n' if prev == 'tool' else '" USER "') + (m.content or '') -}}\n"
    "{%- elif m.role == 'tool' -%}\n"
    "{{- ('\\n\\n' if prev == 'tool' else '" USER "') + '<tool_result>' + (m.content or '') + '</tool_result>' -}}\n"
    "{%- elif m.role == 'assistant' -%}\n"
    "{{- m.content or '' -}}\n"
    "{%- if m.tool_calls -%}\n"
    "{{- '\\n\\n<" D "tool_calls>\\n' -}}\n"
    "{%- for tc in m.tool_calls -%}\n"
    "{{- '<" D "invoke name=\"' + tc.function.name + '\">\\n' -}}\n"
    "{%- for k, v in tc.function.arguments.items() -%}\n"
    "{{- '<" D "parameter name=\"' + k + '\" string=\"' + ('true' if v is string else 'false') + '\">' + "
    "(v if v is string else v | tojson) + '</" D "parameter>' -}}\n"
    "{%- if not loop.last -%}{{- '\\n' -}}{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{{- '\\n</" D "invoke>' -}}\n"
    "{%- if not loop.last -%}{{- '\\n' -}}{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{{- '\\n</" D "tool_calls>' -}}\n"
    "{%- endif -%}\n"
    "{{- eos_token -}}\n"
    "{%- endif -%}\n"
    "{%- if m.role in ['user', 'developer', 'tool'] and next in ['assistant', ''] -%}"
    "{{- '" ASSISTANT "</think>' -}}{%- endif -%}\n"
    "{%- endfor -%}\n";

const char *mf_gen_chat_template(void) { return mf_chat_src; }

int mf_gen_tokenizer_config_write(const mf_config *c, const char *path)
{
    (void)c;   /* the special tokens' strings are the DeepSeek ones gen_tokenizer.c writes at c's ids */
    json_t *o = json_pack("{s:s, s:s, s:s, s:I, s:b, s:s}", "bos_token",
                          "<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>", "eos_token",
                          "<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>", "tokenizer_class",
                          "PreTrainedTokenizerFast", "model_max_length", (json_int_t)c->max_position_embeddings,
                          "add_bos_token", 0, "chat_template", mf_chat_src);
    if (!o) return mf_error(-ENOMEM, "%s: out of memory", path);
    int rc = json_dump_file(o, path, JSON_INDENT(2)) ? mf_error(-EIO, "%s: cannot write", path) : 0;
    json_decref(o);
    return rc;
}
