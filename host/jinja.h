/* A Jinja2 subset for chat templates (a checkpoint's tokenizer_config.json `chat_template`): parse
 * once, render many times with a JSON context. It renders what Hugging Face's apply_chat_template
 * renders: the environment has trim_blocks and lstrip_blocks on, `raise_exception(msg)` and
 * `namespace(...)` as globals, `tojson` as json.dumps(ensure_ascii=False) and break/continue.
 * tests/py/check_jinja.py holds the output byte for byte to the Python jinja2 package. What it
 * covers is listed in docs/serve.md ("Chat templates"); anything else is refused with the line and
 * column where it stands, never rendered wrong. */
#ifndef MF_JINJA_H
#define MF_JINJA_H

#include <stddef.h>
#include <jansson.h>

typedef struct mf_jinja mf_jinja;

/* Parses src[0..len). Returns 0 and *out, or -EINVAL with mf_last_error() naming the line and
 * column ("template line 3 column 14: unsupported tag 'macro'"), or -ENOMEM. Never reads past len;
 * nesting deeper than 64 is refused. */
int mf_jinja_parse(const char *src, size_t len, mf_jinja **out);
void mf_jinja_free(mf_jinja *t);

/* Renders t with the variables of the JSON object ctx (not modified). *out is malloc'ed and
 * NUL-terminated, *n_out its length. Returns 0, -EINVAL with mf_last_error() giving the line and
 * column of the failing expression (a type error, an undefined value used where Jinja fails, or
 * raise_exception's message), -E2BIG past 64 MiB of output or 1<<20 loop iterations, -ENOMEM.
 * Thread-safe: a parsed template may be rendered from several threads at once. */
int mf_jinja_render(const mf_jinja *t, const json_t *ctx, char **out, size_t *n_out);

#endif
