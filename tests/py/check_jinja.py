"""host/jinja_*.c against the Python jinja2 package, in the environment Hugging Face's
apply_chat_template renders chat templates with (ImmutableSandboxedEnvironment, trim_blocks,
lstrip_blocks, loopcontrols, raise_exception, tojson as json.dumps(ensure_ascii=False)).

Every template of tests/py/chat_templates (and any given as arguments, e.g. a checkpoint's) is
rendered over the message lists below with add_generation_prompt true and false: the output must be
byte-identical, and where jinja2 raises, moeflow must fail with raise_exception's message. Then
snippets for the single features, and templates moeflow refuses: each refusal must name a line and
column (and the line jinja2 names, where it refuses too), and never crash.

With MOEFLOW_BIN (ctest sets it), end to end on a tiny checkpoint given a tokenizer_config.json with
chatml_style.jinja: `moeflow decode --chat` generates the tokens of `decode --prompt <jinja2's
rendering> --no-bos`, and `moeflow serve`'s /v1/chat/completions the same tokens again.

Run: MOEFLOW_BUILD=build python tests/py/check_jinja.py [TEMPLATE_OR_TOKENIZER_CONFIG ...]"""
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
BUILD = os.environ.get("MOEFLOW_BUILD", os.path.join(HERE, "..", "..", "build"))
RENDER = os.path.join(BUILD, "jinja_render")
TMP = tempfile.mkdtemp(prefix="check_jinja_", dir=os.environ.get("MOEFLOW_TMP"))


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
ENV.filters["tojson"] = tojson
ENV.globals["raise_exception"] = raise_exception

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

MESSAGES = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  2+2?  \n"}],
    [{"role": "system", "content": "A"}, {"role": "system", "content": "B"},
     {"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>hmm</think>Hello."},
     {"role": "user", "content": "again, in 中文 ✓"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
         {"type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
     {"role": "tool", "content": "18C"}, {"role": "tool", "content": "noon"},
     {"role": "assistant", "content": "18C at noon."}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}, {"role": "user", "content": ""}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "two users in a row"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "image"},
                                  {"type": "text", "text": "part two"}]}],
    [{"role": "developer", "content": "odd role"}, {"role": "user", "content": "x"}],
    [{"role": "system", "content": "only a system prompt"}],
    [],
]

# one feature each; rendered with a small context (below) and compared the same way
SNIPPETS = [
    "plain text\n", "a\n  {% if x %}\n  yes\n  {%- endif %}\nb\n", "{%- if x -%}  x  {%- endif -%}  ",
    "  {%+ if x %}kept{% endif %}\n", "{% if x +%}\nkept newline{% endif %}", "line\n{# comment #}\nnext\n",
    "{{ 1 + 2 * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 - 5 }} {{ 'ab' * 3 }}",
    "{{ 'a' ~ 1 ~ none ~ true ~ 1.5 }} {{ 'x' + 'y' ~ 'z' }}", "{{ [1, 'a', none, true, {'k': 1.5, 'q': \"it's\"}] }}",
    "{{ 0.1 }} {{ 2.0 }} {{ 1e15 }} {{ 1e16 }} {{ 1.5e-7 }} {{ 123.456 }}",
    "{{ x is defined }} {{ nope is defined }} {{ nope is not defined }} {{ none is none }} {{ s is string }}",
    "{{ s | trim }}|{{ s | length }}|{{ items | length }}|{{ d | length }}|{{ nope | length }}",
    "{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ s.split() }}|{{ 'a,b,,c'.split(',') }}|{{ 'a b c'.split(' ', 1) }}",
    "{{ s.startswith('  h') }} {{ s.endswith('x') }} {{ 'AbC'.lower() }} {{ 'AbC'.upper() }} {{ 'aXbX'.replace('X', '-') }}",
    "{{ items[0] }} {{ items[-1] }} {{ items[1:] }} {{ items[:-1] }} {{ items[::-1] }} {{ items[5] is defined }}",
    "{{ 'héllo'[1] }} {{ 'héllo'[1:3] }} {{ 'héllo'[::-1] }} {{ 'héllo' | length }}",
    "{{ d.a }} {{ d['b'] }} {{ d.get('a') }} {{ d.get('z') }} {{ d.get('z', 'dflt') }} {{ d.missing is defined }}",
    "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %} {{ d.keys() | list if false else '' }}",
    "{% for k in d %}{{ k }}{% endfor %} {% for c in 'ab' %}{{ c }}.{% endfor %}",
    "{% for i in items %}{{ loop.index0 }}/{{ loop.index }}/{{ loop.first }}/{{ loop.last }}/{{ loop.length }}/{{ loop.revindex }} {% endfor %}",
    "{% for i in items if i != 2 %}{{ i }}{{ ',' if not loop.last }}{% endfor %}",
    "{% for i in [] %}x{% else %}empty{% endfor %}", "{% for i in nope %}x{% else %}undefined is empty{% endfor %}",
    "{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}",
    "{% for i in [1,2,3] %}[{{ y }}]{% set y = i %}{% endfor %}<{{ y }}>",
    "{% set y = 5 %}{% for i in [1] %}{% set y = 7 %}{{ y }}{% endfor %}{{ y }}",
    "{% if x %}{% set z = 3 %}{% endif %}{{ z }}", "{% set ns = namespace(n=0) %}{% for i in items %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}",
    "{{ 'yes' if x else 'no' }} {{ 'yes' if nope else 'no' }} {{ 'no else' if nope }}.",
    "{{ x and 'A' }} {{ nope or 'B' }} {{ not x }} {{ 0 or '' }} {{ 1 and 0 }}",
    "{{ 'b' in 'abc' }} {{ 2 in items }} {{ 'a' in d }} {{ 'z' not in d }} {{ not 'a' in d }}",
    "{{ 1 < 2 }} {{ 'a' < 'b' }} {{ 2 >= 2.0 }} {{ 1 == 1.0 }} {{ true == 1 }} {{ [1, 2] == [1, 2] }} {{ {'a': 1} != {'a': 1} }}",
    "{{ items | tojson }} {{ d | tojson }} {{ 'é\"\\n' | tojson }} {{ d | tojson(indent=2) }}",
    "{{ items | join(', ') }} {{ items | first }} {{ items | last }} {{ nope | default('dflt') }} {{ '' | default('e', true) }}",
    "{{ 3.7 | int }} {{ s | string | length }} {{ 'x' | upper }} {{ items | string }}",
    "{{ \"it's\" }} {{ 'say \"hi\"' }} {{ 'tab\\tnl\\nuni\\u00e9\\x41' }} {{ 'a' 'b' }}",
    "{{- '  strip both  ' -}}  \n  {{ x }}", "{{ bos_token }}{{ eos_token }}",
    "{{ messages[0].content if messages else 'none' }}",
]
SNIPPET_CTX = {"x": True, "s": "  hello world  ", "items": [1, 2, 3], "d": {"a": 1, "b": "two"}, "messages": [],
               "bos_token": BOS, "eos_token": EOS}

# refused by moeflow at parse time: the error must name a line and column
UNSUPPORTED = [
    "{% macro f() %}x{% endmacro %}", "{% raw %}{{ x }}{% endraw %}", "{% set x %}block{% endset %}",
    "{% for i in items recursive %}{% endfor %}", "{{ (1, 2) }}", "{{ 2 ** 3 }}", "{{ 1 < 2 < 3 }}",
    "{% include 'x' %}", "{% if x %}unclosed", "{{ x ", "{% for %}", "line 1\nline 2 {{ 'unterminated }}",
    "{% endif %}", "{{ x | }}", "{{ @ }}", "{# never closed", "{%- else %}",
]
# refused at render time (jinja2 raises too): a message, never a crash
RENDER_ERRORS = [
    "{{ raise_exception('custom failure') }}", "{{ 'a' + 1 }}", "{{ nope.attr }}", "{{ 1 // 0 }}",
    "{% set s.x = 1 %}", "{% for i in 5 %}{% endfor %}", "{{ 1 < 'a' }}",
]


def moeflow_render(src, ctx):
    tp, cp = os.path.join(TMP, "t.jinja"), os.path.join(TMP, "ctx.json")
    with open(tp, "w", encoding="utf-8") as f:
        f.write(src)
    with open(cp, "w", encoding="utf-8") as f:
        json.dump(ctx, f, ensure_ascii=False)
    r = subprocess.run([RENDER, tp, cp], capture_output=True, timeout=60)
    if r.returncode < 0 or r.returncode == 1:
        raise SystemExit(f"jinja_render crashed or failed (rc {r.returncode}): {r.stderr.decode()!r} on {src!r}")
    return r.returncode, r.stdout.decode("utf-8"), r.stderr.decode("utf-8").strip()


def python_render(src, ctx):
    try:
        return 0, ENV.from_string(src).render(**ctx)
    except jinja2.exceptions.TemplateSyntaxError as e:
        return 2, e
    except Exception as e:   # TemplateError from raise_exception, TypeError, UndefinedError ...
        return 3, e


def compare(name, src, ctx, failures, counts):
    prc, pout = python_render(src, ctx)
    mrc, mout, merr = moeflow_render(src, ctx)
    counts["cases"] += 1
    if prc == 0 and mrc == 0:
        if pout != mout:
            failures.append(f"{name}: output differs\n  jinja2:  {pout!r}\n  moeflow: {mout!r}")
        else:
            counts["identical"] += 1
        return
    if prc == 0:
        failures.append(f"{name}: jinja2 renders {pout!r}, moeflow refuses: {merr}")
        return
    if mrc == 0:
        failures.append(f"{name}: jinja2 fails ({pout}), moeflow renders {mout!r}")
        return
    if not re.search(r"line \d+ column \d+", merr):
        failures.append(f"{name}: moeflow's error names no line and column: {merr}")
    if isinstance(pout, jinja2.exceptions.TemplateError) and type(pout) is jinja2.exceptions.TemplateError:
        if str(pout) not in merr:   # raise_exception: the template's own message
            failures.append(f"{name}: raise_exception's message {str(pout)!r} not in moeflow's {merr!r}")
    counts["both_fail"] += 1


def load_template(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):   # a tokenizer_config.json
        tmpl = json.loads(text).get("chat_template")
        if isinstance(tmpl, list):   # named templates: the default one
            tmpl = next(t["template"] for t in tmpl if t.get("name") == "default")
        return tmpl
    return text


def end_to_end(failures, counts):
    """decode --chat and serve's chat endpoint use the checkpoint's template as jinja2 renders it"""
    bin_ = os.environ["MOEFLOW_BIN"]
    base, ck = os.path.join(TMP, "tiny"), os.path.join(TMP, "tiny_chat")
    subprocess.run([bin_, "gen", "--preset", "tiny", "--out", base, "--quiet"], check=True)
    os.makedirs(ck)
    for f in os.listdir(base):
        os.symlink(os.path.join(base, f), os.path.join(ck, f))
    tmpl = load_template(os.path.join(HERE, "chat_templates", "chatml_style.jinja"))
    with open(os.path.join(ck, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token": {"content": BOS}, "eos_token": EOS, "chat_template": tmpl}, f, ensure_ascii=False)
    prompts = ["Hello there", "  What is two plus two?  ", "A longer prompt about the weather in Paris"]
    pf, of = os.path.join(TMP, "prompts.txt"), os.path.join(TMP, "chat.jsonl")
    with open(pf, "w") as f:
        f.write("".join(p + "\n" for p in prompts))
    n = 6
    common = ["--max-new-tokens", str(n), "--threads", "2", "--quiet"]
    subprocess.run([bin_, "decode", "--checkpoint", ck, "--prompts", pf, "--chat", "--output", of, *common],
                   check=True, stdout=subprocess.DEVNULL)
    got = {o["index"]: o["tokens"] for o in map(json.loads, open(of))}
    want = []
    for i, p in enumerate(prompts):
        text = ENV.from_string(tmpl).render(messages=[{"role": "user", "content": p}], add_generation_prompt=True,
                                            bos_token=BOS, eos_token=EOS)
        oi = os.path.join(TMP, f"one{i}.jsonl")
        subprocess.run([bin_, "decode", "--checkpoint", base, "--prompt", text, "--no-bos", "--output", oi, *common],
                       check=True, stdout=subprocess.DEVNULL)
        want.append(json.loads(open(oi).readline())["tokens"])
        counts["cases"] += 1
        if got.get(i) != want[i]:
            failures.append(f"decode --chat prompt {i}: tokens {got.get(i)}, decode of jinja2's text {want[i]}")
    srv = subprocess.Popen([bin_, "serve", "--checkpoint", ck, "--port", "0", "--threads", "2"],
                           stderr=subprocess.PIPE, text=True)
    try:
        port, t0, log = None, time.time(), []
        while port is None and time.time() - t0 < 60:
            line = srv.stderr.readline()
            if not line:
                break
            log.append(line)
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else None
        if port is None:
            failures.append("serve did not start: " + "".join(log))
            return
        for i, p in enumerate(prompts):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            c.request("POST", "/v1/chat/completions", json.dumps(
                {"messages": [{"role": "user", "content": p}], "max_tokens": n, "temperature": 0}))
            r = json.loads(c.getresponse().read())
            c.close()
            counts["cases"] += 1
            toks = r["choices"][0]["tokens"] if "choices" in r else r
            if toks != want[i]:
                failures.append(f"serve chat prompt {i}: {toks}, decode of jinja2's text {want[i]}")
    finally:
        srv.terminate()
        srv.wait(60)


def main():
    if not os.path.exists(RENDER):
        print(f"SKIP: {RENDER} not built")
        return 77
    failures, counts = [], {"cases": 0, "identical": 0, "both_fail": 0}
    tdir = os.path.join(HERE, "chat_templates")
    paths = sorted(os.path.join(tdir, p) for p in os.listdir(tdir)) + sys.argv[1:]
    for path in paths:
        src = load_template(path)
        for i, msgs in enumerate(MESSAGES):
            for agp in (True, False):
                ctx = {"messages": msgs, "add_generation_prompt": agp, "bos_token": BOS, "eos_token": EOS}
                compare(f"{os.path.basename(path)} messages[{i}] add_generation_prompt={agp}", src, ctx, failures, counts)
        ctx = {"messages": MESSAGES[1], "bos_token": BOS, "eos_token": EOS}   # add_generation_prompt not given
        compare(f"{os.path.basename(path)} without add_generation_prompt", src, ctx, failures, counts)
    for i, src in enumerate(SNIPPETS):
        compare(f"snippet {i} {src[:40]!r}", src, SNIPPET_CTX, failures, counts)
    for src in RENDER_ERRORS:
        prc, pout = python_render(src, SNIPPET_CTX)
        mrc, _, merr = moeflow_render(src, SNIPPET_CTX)
        counts["cases"] += 1
        if prc == 0 or mrc != 3 or not re.search(r"line \d+ column \d+", merr):
            failures.append(f"render error {src!r}: jinja2 rc {prc}, moeflow rc {mrc}: {merr}")
        else:
            counts["both_fail"] += 1
    for src in UNSUPPORTED:
        mrc, _, merr = moeflow_render(src, SNIPPET_CTX)
        counts["cases"] += 1
        m = re.search(r"line (\d+) column (\d+)", merr)
        if mrc != 2 or not m:
            failures.append(f"unsupported {src!r}: expected a parse error with line and column, rc {mrc}: {merr}")
            continue
        prc, pout = python_render(src, SNIPPET_CTX)
        if prc == 2 and pout.lineno != int(m.group(1)):
            failures.append(f"unsupported {src!r}: moeflow names line {m.group(1)}, jinja2 line {pout.lineno}")
        counts["refused"] = counts.get("refused", 0) + 1
    if os.environ.get("MOEFLOW_BIN"):
        end_to_end(failures, counts)
    for f in failures:
        print("FAIL", f)
    print(f"check_jinja: {counts['cases']} cases, {counts['identical']} byte-identical renders, "
          f"{counts['both_fail']} failing in both, {counts.get('refused', 0)} refused with a position; "
          f"{len(failures)} failures")
    print(f"{counts['cases'] - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
