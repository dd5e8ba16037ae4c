/* The chat template engine (host/jinja.h): renders with known outputs (the rules Python's jinja2
 * follows, which tests/py/check_jinja.py checks byte for byte where MOEFLOW_PYTHON is set), the
 * refusals' positions, the limits; and the fuzz seed corpus (tests/fuzz/corpus_jinja) replayed
 * through the fuzz target: valid_* parse, invalid_* are refused at parse. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched/path.h"
#include "tests/check.h"
#include "tests/fuzz/fuzz_jinja.c"

#ifndef MF_SOURCE_DIR
#error "MF_SOURCE_DIR must name the source tree (tests/CMakeLists.txt defines it)"
#endif

/* renders src with ctx_json; the output, or "ERR: " + the message */
static char *render(const char *src, const char *ctx_json)
{
    static char buf[4096];
    json_error_t je;
    json_t *ctx = json_loads(ctx_json, 0, &je);
    mf_jinja *t = NULL;
    char *out = NULL;
    size_t n = 0;
    int rc = ctx ? mf_jinja_parse(src, strlen(src), &t) : -EINVAL;
    if (!rc) rc = mf_jinja_render(t, ctx, &out, &n);
    if (rc) snprintf(buf, sizeof buf, "ERR: %s", mf_last_error());
    else snprintf(buf, sizeof buf, "%s", out);
    free(out);
    mf_jinja_free(t);
    json_decref(ctx);
    return buf;
}

static void same(const char *src, const char *ctx, const char *want)
{
    const char *got = render(src, ctx);
    CHECK(!strcmp(got, want), "%s\n  want '%s'\n  got  '%s'", src, want, got);
}

static void fails(const char *src, const char *ctx, const char *words)
{
    const char *got = render(src, ctx);
    CHECK(!strncmp(got, "ERR: ", 5) && strstr(got, words), "%s: want an error with '%s', got '%s'", src, words, got);
}

int main(void)
{
    const char *m2 = "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \" hi \"}],"
                     " \"bos_token\": \"<s>\", \"add_generation_prompt\": true, \"n\": [1, 2, 3], \"d\": {\"a\": 1}}";
    /* whitespace: trim_blocks, lstrip_blocks, {%- -%}, {%+, one trailing newline dropped */
    same("a\n  {% if 1 %}\n  x\n  {%- endif %}\nb\n", m2, "a\n  xb");
    same("  {%+ if 1 %}k{% endif %}\n", m2, "  k");
    same("{{- '  s  ' -}}  \n  {{ 1 }}", m2, "  s  1");
    same("x{# c #}\ny", m2, "xy");
    /* loops, scopes, namespace */
    same("{% for m in messages %}{{ loop.index0 }}{{ m.role }}{{ '|' if not loop.last }}{% endfor %}", m2, "0system|1user");
    same("{% for i in n %}[{{ y }}]{% set y = i %}{% endfor %}<{{ y }}>", m2, "[][][]<>");
    same("{% set ns = namespace(s=0) %}{% for i in n if i > 1 %}{% set ns.s = ns.s + i %}{% endfor %}{{ ns.s }}", m2, "5");
    same("{% for i in range(9) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}", m2, "023");
    same("{% for k, v in d.items() %}{{ k }}={{ v }}{% endfor %}{% for x in nope %}{% else %}E{% endfor %}", m2, "a=1E");
    /* values as Python prints them */
    same("{{ [1, 'a', none, true, {'k': 1.5}] }} {{ 7 / 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 1e15 }}", m2,
         "[1, 'a', None, True, {'k': 1.5}] 3.5 -4 2 1000000000000000.0");
    same("{{ messages[1]['content'] | trim }}|{{ messages[1].content | length }}|{{ n[::-1] }}|{{ 'héllo'[1:3] }}", m2,
         "hi|4|[3, 2, 1]|él");
    same("{{ 'a</think>b</think>c'.split('</think>')[-1] }} {{ d.get('z', 'q') }} {{ 'b' in 'abc' }} {{ 'z' not in d }}", m2,
         "c q True True");
    same("{{ d | tojson }} {{ 'é\"' | tojson }} {{ nope is defined }} {{ none is none }} {{ x or 'dflt' }}", m2,
         "{\"a\": 1} \"é\\\"\" False True dflt");
    same("{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{{ add_generation_prompt }}",
         m2, "True");
    /* refusals: the position, never a crash */
    fails("line 1\n  {% macro f() %}{% endmacro %}", m2, "line 2 column 6: unsupported tag 'macro'");
    fails("{% if x %}", m2, "line 1 column 11: expected '{% endif %}'");
    fails("{{ 'abc }}", m2, "line 1 column 4: unterminated string");
    fails("{{ (1, 2) }}", m2, "tuples are not supported");
    fails("{{ raise_exception('roles must alternate') }}", m2, "line 1 column 19: raise_exception: roles must alternate");
    /* an argument list refused after values were taken: no value leaks (the ASan build's LSan) */
    fails("{% for me in messages %}{{ raise_exception(me, []) }}{% endfor %}", m2, "too many arguments");
    fails("{{ range(1, 2, 3, 4) }}", m2, "too many arguments");
    fails("{{ 'a b'.split(' ', n=1) }}", m2, "keyword argument 'n' is not supported here");
    fails("{{ 'a' + 1 }}", m2, "'+' between str and int");
    fails("{{ nope.x }}", m2, "of an undefined value");
    fails("{% set d.a = 1 %}", m2, "is not a namespace()");
    fails("{% for i in range(2000000) %}{% endfor %}", m2, "range() of more than");
    fails("{{ 'x' * 100000000 }}", m2, "a string past");
    char deep[400];
    memcpy(deep, "{{ ", 3);
    memset(deep + 3, '(', 200);
    memcpy(deep + 203, " }}", 4);
    fails(deep, m2, "nested deeper than 64");

    /* the seed corpus through the fuzz target */
    const char *dir = MF_SOURCE_DIR "/tests/fuzz/corpus_jinja";
    DIR *d = opendir(dir);
    CHECK(d != NULL, "cannot open %s", dir);
    int n_valid = 0, n_invalid = 0;
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        size_t n = 0;
        char *text = NULL;
        mf_path_read(path, (size_t)1 << 26, &text, &n);
        unsigned char *buf = (unsigned char *)text;
        CHECK(buf != NULL, "cannot read %s", path);
        if (!buf) continue;
        int r = fuzz_jinja_one(buf, n);   /* aborts on a broken invariant */
        if (!strncmp(e->d_name, "valid_", 6)) {
            CHECK(r != 1, "%s should parse: %s", e->d_name, mf_last_error());
            n_valid++;
        } else if (!strncmp(e->d_name, "invalid_", 8)) {
            CHECK(r == 1, "%s should be refused at parse", e->d_name);
            n_invalid++;
        }
        free(buf);
    }
    if (d) closedir(d);
    CHECK(n_valid >= 5 && n_invalid >= 3, "corpus too small: %d valid, %d invalid", n_valid, n_invalid);
    printf("replayed %d valid and %d invalid seeds\n", n_valid, n_invalid);
    return mf_check_exit("test_jinja");
}
