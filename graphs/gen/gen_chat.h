/* The chat template `moeflow gen` writes (tokenizer_config.json) for synthetic checkpoints, and that
 * `moeflow serve --chat-template deepseek-v4` uses: DeepSeek-V4's chat encoding (encoding_dsv4.py,
 * chat mode) in the Jinja2 subset of host/jinja.h, with tools. docs/serve.md "Tool calls". */
#ifndef MF_GEN_CHAT_H
#define MF_GEN_CHAT_H

#include "graphs/model/config.h"

/* The template's source (a static string). It renders BOS, then per message: a system message's
 * content (the first followed by the tools block when tools are given; without a system message
 * the block comes first), "<｜User｜>" + content for user and developer messages, tool results as
 * "<tool_result>...</tool_result>" in a user turn (consecutive ones, and a user message after
 * them, joined by "\n\n"), an assistant's content, its tool_calls in DSML (tools/serve_tools.h)
 * and EOS; after a user turn that ends the list or precedes an assistant message,
 * "<｜Assistant｜></think>" (chat mode: no thinking). Tool call arguments must be objects (the
 * server parses OpenAI's JSON strings for templates). */
const char *mf_gen_chat_template(void);

/* Writes path (a tokenizer_config.json): bos_token, eos_token (the DeepSeek special tokens at
 * c's ids), tokenizer_class PreTrainedTokenizerFast, model_max_length, chat_template. 0 or a
 * negative code with a message. */
int mf_gen_tokenizer_config_write(const mf_config *c, const char *path);

#endif
