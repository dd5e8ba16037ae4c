/* Renders a chat template (host/jinja.h) for tests/py/check_jinja.py: jinja_render TEMPLATE CONTEXT.json
 * writes the output to stdout and exits 0, or writes the error to stderr and exits 2 (parse) or
 * 3 (render). */
#include <stdio.h>
#include <stdlib.h>

#include "host/jinja.h"
#include "sched/error.h"
#include "sched/path.h"

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: jinja_render TEMPLATE CONTEXT.json\n");
        return 1;
    }
    size_t n;
    char *src = NULL;
    mf_path_read(argv[1], (size_t)1 << 26, &src, &n);
    json_error_t je;
    json_t *ctx = json_load_file(argv[2], JSON_ALLOW_NUL, &je);
    if (!src || !ctx) {
        fprintf(stderr, "jinja_render: cannot read %s\n", !src ? argv[1] : argv[2]);
        return 1;
    }
    mf_jinja *t = NULL;
    char *out = NULL;
    size_t n_out = 0;
    int rc = 0;
    if (mf_jinja_parse(src, n, &t)) {
        fprintf(stderr, "%s\n", mf_last_error());
        rc = 2;
    } else if (mf_jinja_render(t, ctx, &out, &n_out)) {
        fprintf(stderr, "%s\n", mf_last_error());
        rc = 3;
    } else {
        fwrite(out, 1, n_out, stdout);
    }
    free(out);   /* everything freed on every path: the ASan build's leak check runs this too */
    mf_jinja_free(t);
    json_decref(ctx);
    free(src);
    return rc;
}
