#!/usr/bin/env python3
"""`moeflow serve` on a tiny checkpoint, on 127.0.0.1 with a free port, through the real `openai`
client: completions and chat, streaming and not, n > 1, greedy responses equal to `moeflow decode` on
the same prompts (token ids and text); SSE framing over a raw socket; OpenAI-style errors
(malformed JSON, wrong types, n out of range, oversize body, context limit, unknown endpoint, missing API
key, full queue with Retry-After, a partial request closed at the timeout); a bounded load test (64 concurrent clients, some with n = 2, mixed prompt and
output lengths, some disconnecting mid-stream) where every completed response equals its
sequential run and the server stays up; graceful shutdown on SIGTERM (exit 0); logprobs (chat and
completions, streamed and not, echo with max_tokens 0), a tool-calling round trip with a role tool
reply and streamed delta.tool_calls (DeepSeek-V4 DSML through gen's chat template), response_format
json_schema on every other request of a concurrent batch (outputs validated by `jsonschema`, the
unconstrained neighbours equal to their sequential runs bit for bit) and json_object, and an error
object for every bad value of the new fields (schemas with unsupported keywords, recursive and
huge ones, logit_bias ids outside the vocabulary, top_logprobs over 20). Loopback only.
Exits non-zero on any mismatch."""
import concurrent.futures as cf
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import openai

import serve_proc

BIN = os.environ.get("MOEFLOW_BIN", "build/moeflow")
TMP = os.path.join(os.environ.get("MOEFLOW_TMP", "/tmp"), f"check_serve_{os.getpid()}")
HOST = "127.0.0.1"
FAILURES = []
DEADLINE = time.time() + 240   # the load test's bound (the check takes ~20-50 s here, more under ASan)


def fail(msg):
    FAILURES.append(msg)
    print("MISMATCH:", msg, file=sys.stderr)


def check(cond, msg):
    if not cond:
        fail(msg)
    return cond


class Server:
    def __init__(self, ckpt, *args):
        self.p, self.port, self.log = serve_proc.start([BIN, "serve", "--checkpoint", ckpt, "--host", HOST, "--port",
                                                        "0", "--threads", "2", *args])

    def url(self):
        return f"http://{HOST}:{self.port}/v1"

    def raw(self, method, path, body=None, headers=None):
        c = http.client.HTTPConnection(HOST, self.port, timeout=60)
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, dict(r.getheaders()), data

    def stop(self, sig=signal.SIGTERM, timeout=30):
        self.p.send_signal(sig)
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return None


def decode_ref(ckpt, prompts, n):
    """Greedy tokens and text of each prompt decoded by `moeflow decode` (the batcher's own CLI)."""
    pf = os.path.join(TMP, "prompts.txt")
    of = os.path.join(TMP, "ref.jsonl")
    with open(pf, "w") as f:
        f.write("".join(p + "\n" for p in prompts))
    subprocess.run([BIN, "decode", "--checkpoint", ckpt, "--prompts", pf, "--max-new-tokens", str(n), "--batch", "1",
                    "--threads", "2", "--quiet", "--output", of], check=True, stdout=subprocess.DEVNULL)
    out = {}
    for line in open(of):
        o = json.loads(line)
        out[o["index"]] = (o["tokens"], o["text"], o["finish_reason"])
    return [out[i] for i in range(len(prompts))]


def sse_events(data):
    """Splits an SSE body into its data payloads; checks the framing."""
    text = data.decode()
    check(text.endswith("data: [DONE]\n\n"), f"SSE does not end with 'data: [DONE]': {text[-80:]!r}")
    events = text.split("\n\n")
    check(events[-1] == "", "SSE: trailing bytes after the last event")
    payloads = []
    for e in events[:-1]:
        check(e.startswith("data: ") and "\n" not in e, f"SSE event framing: {e[:80]!r}")
        payloads.append(e[6:])
    return payloads


def check_n(cl, prompts, ref, N, msgs, chat_ref):
    """n > 1 on both endpoints: greedy choices all equal decode's; sampled choice k equals a single
    request seeded seed + k; streamed choices are told apart by their index."""
    def toks(c):
        return c.model_dump()["tokens"]
    r = cl.completions.create(model="tiny", prompt=prompts[4], max_tokens=N, temperature=0, n=3)
    check([c.index for c in r.choices] == [0, 1, 2] and all(toks(c) == ref[4][0] and c.text == ref[4][1]
                                                             for c in r.choices), f"n=3 greedy: {r}")
    check(r.usage.completion_tokens == 3 * len(ref[4][0]), f"n=3 usage {r.usage}")
    r = cl.completions.create(model="tiny", prompt=prompts[0], max_tokens=10, temperature=0.9, seed=11, n=3)
    solo = [cl.completions.create(model="tiny", prompt=prompts[0], max_tokens=10, temperature=0.9, seed=11 + k)
            for k in range(3)]
    check([toks(c) for c in r.choices] == [toks(x.choices[0]) for x in solo] and
          [c.text for c in r.choices] == [x.choices[0].text for x in solo], "n=3 sampled: choice k != seed + k")
    check(len({tuple(toks(c)) for c in r.choices}) > 1, f"n=3 sampled: all choices equal {r.choices}")
    got, fins, usage = {}, {}, None
    for ch in cl.completions.create(model="tiny", prompt=prompts[1], max_tokens=N, temperature=0, n=2, stream=True):
        for c in ch.choices:
            got.setdefault(c.index, []).extend(c.model_dump().get("tokens") or [])
            fins[c.index] = c.finish_reason or fins.get(c.index)
        usage = ch.usage or usage
    check(got == {0: ref[1][0], 1: ref[1][0]} and all(fins.get(k) for k in (0, 1)) and usage is not None and
          usage.completion_tokens == 2 * len(ref[1][0]), f"n=2 streamed: {got} {fins} {usage}")
    r = cl.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0.7, seed=3, n=2)
    solo = [cl.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0.7, seed=3 + k)
            for k in range(2)]
    check([c.message.content for c in r.choices] == [x.choices[0].message.content for x in solo] and
          [toks(c) for c in r.choices] == [toks(x.choices[0]) for x in solo], "chat n=2 sampled: choice k != seed + k")
    got, roles = {}, {}
    for ch in cl.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, n=2, stream=True):
        for c in ch.choices:
            if c.delta.role:
                roles[c.index] = roles.get(c.index, []) + [c.delta.role]
            got.setdefault(c.index, []).extend(c.model_dump().get("tokens") or [])
    check(roles == {0: ["assistant"], 1: ["assistant"]} and got == {0: chat_ref[0], 1: chat_ref[0]},
          f"chat n=2 streamed: {roles} {got}")


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"},
                                          "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["n", "ok"]}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                     "mode": {"enum": ["fast", "exact"]}}, "required": ["a", "b"]}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]


def check_controls(srv, cl, prompts, ref, N, err):
    """logprobs (streamed and not), a tool-calling round trip, response_format in a batch mixing
    constrained and unconstrained requests (greedy neighbours unchanged bit for bit), bad input."""
    import jsonschema
    # chat logprobs: the same values streamed and not; greedy tokens are their own top alternative
    msgs = [{"role": "user", "content": "count"}]
    r = cl.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    check(len(lp) == len(r.model_dump()["choices"][0]["tokens"]) and
          all(e.top_logprobs[0].token == e.token and len(e.top_logprobs) == 3 and e.logprob <= 0 for e in lp),
          f"chat logprobs {lp}")
    slp = []
    for ch in cl.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=3, stream=True):
        if ch.choices and ch.choices[0].logprobs:
            slp += ch.choices[0].logprobs.content or []
    check([(e.token, e.logprob) for e in slp] == [(e.token, e.logprob) for e in lp], "chat logprobs streamed != not")
    # completions: legacy logprobs, echo with max_tokens 0 (the first prompt token's logprob null)
    r = cl.completions.create(model="tiny", prompt=prompts[0], max_tokens=0, echo=True, logprobs=2)
    L = r.choices[0].logprobs
    check(r.choices[0].text == prompts[0] and L.token_logprobs[0] is None and L.top_logprobs[0] is None and
          len(L.tokens) == r.usage.prompt_tokens and all(x is not None and x <= 0 for x in L.token_logprobs[1:]) and
          L.text_offset[0] == 0, f"echo logprobs {L}")
    r2 = cl.completions.create(model="tiny", prompt=prompts[0], max_tokens=3, echo=True, logprobs=2, temperature=0)
    L2 = r2.choices[0].logprobs
    check(L2.token_logprobs[:len(L.tokens)] == L.token_logprobs and len(L2.tokens) == len(L.tokens) + 3 and
          r2.choices[0].text == prompts[0] + ref[0][1][:len(r2.choices[0].text) - len(prompts[0])],
          f"echo + 3 tokens {L2}")
    slp = []
    for ch in cl.completions.create(model="tiny", prompt=prompts[0], max_tokens=3, echo=True, logprobs=2, temperature=0,
                                    stream=True):
        if ch.choices and ch.choices[0].logprobs:
            slp += ch.choices[0].logprobs.token_logprobs
    check(slp == L2.token_logprobs, f"streamed echo logprobs {slp} vs {L2.token_logprobs}")
    # tools: a named call, its arguments valid under the tool's schema; the answer sent back as a
    # tool message; streamed calls arrive as delta.tool_calls
    tmsgs = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "add 2 and 3"}]
    r = cl.chat.completions.create(model="tiny", messages=tmsgs, tools=TOOLS, max_tokens=400, temperature=0,
                                   tool_choice={"type": "function", "function": {"name": "add"}})
    c = r.choices[0]
    ok = c.finish_reason == "tool_calls" and c.message.tool_calls and c.message.tool_calls[0].function.name == "add"
    check(ok, f"named tool call: {c}")
    if ok:
        call = c.message.tool_calls[0]
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, TOOLS[0]["function"]["parameters"])
        back = tmsgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                        {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        r2 = cl.chat.completions.create(model="tiny", messages=back, tools=TOOLS, max_tokens=4, temperature=0)
        check(r2.choices[0].finish_reason in ("stop", "length", "tool_calls") and
              r2.usage.prompt_tokens > r.usage.prompt_tokens, f"tool round trip: {r2}")
    calls = {}
    for ch in cl.chat.completions.create(model="tiny", messages=tmsgs, tools=TOOLS, max_tokens=400, temperature=0,
                                         tool_choice={"type": "function", "function": {"name": "add"}}, stream=True):
        for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            calls.setdefault(tc.index, []).append(tc)
        fin = ch.choices[0].finish_reason if ch.choices else None
    check(calls and fin == "tool_calls" and all(json.loads(v[0].function.arguments) is not None for v in calls.values()),
          f"streamed named call: {calls} {fin}")
    # required: one call or more to any tool (a random model may go on calling: length is possible)
    r = cl.chat.completions.create(model="tiny", messages=tmsgs, tools=TOOLS, max_tokens=1500, temperature=0,
                                   tool_choice="required")
    c = r.choices[0]
    check(c.finish_reason == "length" or (c.finish_reason == "tool_calls" and c.message.tool_calls and
                                          all(t.function.name in ("add", "now") for t in c.message.tool_calls)),
          f"required: {c}")
    # response_format beside unconstrained requests, all at once: every constrained output is valid,
    # every unconstrained one equals its sequential run
    fmt = {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA}}

    def one(k):
        c2 = openai.OpenAI(base_url=srv.url(), api_key="unused", max_retries=0, timeout=120)
        if k % 2:
            x = c2.completions.create(model="tiny", prompt=prompts[k % len(prompts)], max_tokens=300, temperature=0,
                                      extra_body={"response_format": fmt})
            return ("json", x.choices[0].text, x.choices[0].finish_reason)
        x = c2.completions.create(model="tiny", prompt=prompts[k % len(prompts)], max_tokens=N, temperature=0)
        return ("plain", k, x.model_dump()["choices"][0]["tokens"])
    with cf.ThreadPoolExecutor(8) as ex:
        res = list(ex.map(one, range(8)))
    for kind, a, b in res:
        if kind == "json":
            try:
                jsonschema.validate(json.loads(a), SCHEMA)
                check(b == "stop", f"constrained finish {b}")
            except Exception as e:
                fail(f"constrained output {a!r}: {e}")
        else:
            check(b == ref[a % len(prompts)][0], f"unconstrained {a} beside constrained ones: {b}")
    r = cl.chat.completions.create(model="tiny", messages=msgs, max_tokens=300, temperature=0,
                                   response_format={"type": "json_object"})
    check(isinstance(json.loads(r.choices[0].message.content), dict), f"json_object: {r.choices[0].message.content!r}")
    # bad input: an OpenAI error object each, the server unaffected
    chat = "/v1/chat/completions"
    m = '"messages": [{"role": "user", "content": "x"}]'
    for body, param, path in [
            ('{"prompt": "x", "logprobs": 21}', "logprobs", None), ('{"prompt": "x", "echo": "yes"}', "echo", None),
            ('{%s, "logprobs": true, "top_logprobs": 21}' % m, "top_logprobs", chat),
            ('{%s, "top_logprobs": 2}' % m, "top_logprobs", chat), ('{%s, "logprobs": 1}' % m, "logprobs", chat),
            ('{"prompt": "x", "presence_penalty": 2.5}', "presence_penalty", None),
            ('{"prompt": "x", "frequency_penalty": "a"}', "frequency_penalty", None),
            ('{"prompt": "x", "repetition_penalty": 0}', "repetition_penalty", None),
            ('{"prompt": "x", "min_p": -0.1}', "min_p", None), ('{"prompt": "x", "top_k": 0.5}', "top_k", None),
            ('{"prompt": "x", "logit_bias": {"1": 200}}', "logit_bias", None),
            ('{"prompt": "x", "logit_bias": {"abc": 1}}', "logit_bias", None),
            ('{"prompt": "x", "logit_bias": {"99999999": 1}}', "logit_bias", None),
            ('{"prompt": "x", "response_format": {"type": "yaml"}}', "response_format", None),
            ('{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string", '
             '"pattern": "^a"}}}}', "response_format", None),
            ('{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {"$defs": {}, '
             '"$ref": "#"}}}}', "response_format", None),
            (json.dumps({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
                "schema": json.loads('{"items":' * 40 + "{}" + "}" * 40)}}}), "response_format", None),
            (json.dumps({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {
                "properties": {f"p{i}": {} for i in range(100)}}}}}), "response_format", None),
            ('{%s, "tools": [{"type": "function", "function": {"name": "bad name"}}]}' % m, "tools", chat),
            ('{%s, "tools": "x"}' % m, "tools", chat), ('{%s, "tool_choice": "required"}' % m, "tool_choice", chat),
            (json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                         "tool_choice": {"type": "function", "function": {"name": "nope"}}}), "tool_choice", chat),
            ('{%s, "functions": [{"name": "f"}]}' % m, "functions", chat)]:
        err(body, 400, param, path=path or "/v1/completions")
    st, _, data = srv.raw("GET", "/health")
    check(st == 200, f"health after bad input: {st}")
    r = cl.completions.create(model="tiny", prompt=prompts[2], max_tokens=4, temperature=0)
    check(r.model_dump()["choices"][0]["tokens"] == ref[2][0][:4], "a request after bad input")


def main():
    os.makedirs(TMP, exist_ok=True)
    ckpt = os.path.join(TMP, "tiny")
    subprocess.run([BIN, "gen", "--preset", "tiny", "--out", ckpt, "--quiet"], check=True)
    prompts = ["hello world", "The quick brown fox jumps over the lazy dog", "a", "moeflow serves tokens",
               "one two three four five six seven eight nine ten eleven twelve", "zz", "Once upon a time", "x y"]
    N = 16
    ref = decode_ref(ckpt, prompts, N)
    # the chat prompt is the text of gen's template (DeepSeek-V4's encoding, docs/serve.md), BOS + its encoding
    chat_text = "You are terse.<\uff5cUser\uff5c>hi there<\uff5cAssistant\uff5c></think>"
    chat_ref = decode_ref(ckpt, [chat_text], 8)[0]

    srv = Server(ckpt, "--max-batch", "8", "--step-tokens", "16", "--max-queue", "128")
    try:
        cl = openai.OpenAI(base_url=srv.url(), api_key="unused", max_retries=0, timeout=120)
        models = cl.models.list()
        check(len(models.data) == 1 and models.data[0].id == "tiny", f"/v1/models: {models}")

        # completions, not streamed: tokens and text equal decode's
        for i in (0, 1, 4):
            r = cl.completions.create(model="tiny", prompt=prompts[i], max_tokens=N, temperature=0)
            d = r.model_dump()
            check(d["choices"][0]["tokens"] == ref[i][0], f"completion {i}: tokens {d['choices'][0]['tokens']} "
                  f"vs decode {ref[i][0]}")
            check(r.choices[0].text == ref[i][1], f"completion {i}: text {r.choices[0].text!r} vs {ref[i][1]!r}")
            check(r.usage.completion_tokens == len(ref[i][0]) and r.usage.prompt_tokens > 0, f"usage {r.usage}")
            check(r.choices[0].finish_reason == ("length" if ref[i][2] == "length" else "stop"), "finish_reason")
        # completions streamed through the client: the concatenated text equals
        stream = cl.completions.create(model="tiny", prompt=prompts[1], max_tokens=N, temperature=0, stream=True)
        text, toks, fin = "", [], None
        for ch in stream:
            text += ch.choices[0].text
            toks += ch.model_dump()["choices"][0].get("tokens") or []
            fin = ch.choices[0].finish_reason or fin
        check(toks == ref[1][0] and text == ref[1][1] and fin is not None,
              f"streamed completion: {toks} {text!r} vs {ref[1][0]} {ref[1][1]!r}")
        # chat, not streamed and streamed
        msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi there"}]
        r = cl.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
        check(r.model_dump()["choices"][0]["tokens"] == chat_ref[0] and r.choices[0].message.content == chat_ref[1]
              and r.choices[0].message.role == "assistant", f"chat: {r} vs {chat_ref}")
        text, toks, roles = "", [], []
        for ch in cl.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True):
            delta = ch.choices[0].delta
            roles += [delta.role] if delta.role else []
            text += delta.content or ""
            toks += ch.model_dump()["choices"][0].get("tokens") or []
        check(roles == ["assistant"] and toks == chat_ref[0] and text == chat_ref[1],
              f"streamed chat: {roles} {toks} {text!r} vs {chat_ref}")
        # a seeded sampled request is reproducible
        a = cl.completions.create(model="tiny", prompt=prompts[0], max_tokens=8, temperature=0.8, seed=7)
        b = cl.completions.create(model="tiny", prompt=prompts[0], max_tokens=8, temperature=0.8, seed=7)
        check(a.model_dump()["choices"][0]["tokens"] == b.model_dump()["choices"][0]["tokens"], "seeded sampling")

        # SSE framing over a raw socket (curl's view): headers, data: lines, [DONE]
        st, hd, body = srv.raw("POST", "/v1/completions", json.dumps(
            {"prompt": prompts[2], "max_tokens": 5, "temperature": 0, "stream": True}))
        check(st == 200 and hd.get("Content-Type") == "text/event-stream", f"SSE status/headers {st} {hd}")
        pl = sse_events(body)
        chunks = [json.loads(p) for p in pl[:-1]]
        check(pl[-1] == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop") and
              "usage" in chunks[-1] and all(c["object"] == "text_completion" for c in chunks), "SSE chunks")
        if shutil.which("curl"):
            out = subprocess.run(["curl", "-sN", "-H", "Content-Type: application/json", "-d",
                                  json.dumps({"prompt": prompts[3], "max_tokens": 4, "temperature": 0, "stream": True}),
                                  f"http://{HOST}:{srv.port}/v1/completions"], capture_output=True, timeout=60)
            pl = sse_events(out.stdout)
            toks = sum((json.loads(p)["choices"][0].get("tokens", []) for p in pl[:-1]), [])
            check(toks == ref[3][0][:4], f"curl SSE tokens {toks} vs {ref[3][0][:4]}")

        # errors: OpenAI error objects, the server unharmed
        def err(body, want_status, want_param=None, want_code=None, path="/v1/completions", headers=None):
            st, hd, data = srv.raw("POST", path, body, headers)
            try:
                e = json.loads(data)["error"]
            except Exception:
                return fail(f"{body[:60]!r}: not an error object: {st} {data[:200]!r}")
            check(st == want_status and isinstance(e.get("message"), str) and e["message"] and "type" in e,
                  f"{body[:60]!r}: status {st} (want {want_status}) {e}")
            if want_param is not None:
                check(e.get("param") == want_param, f"{body[:60]!r}: param {e.get('param')} want {want_param}")
            if want_code is not None:
                check(e.get("code") == want_code, f"{body[:60]!r}: code {e.get('code')} want {want_code}")
            return hd
        err('{"prompt": ', 400)
        err('[1, 2]', 400)
        err('{"max_tokens": 3}', 400, "prompt")
        err('{"prompt": "x", "max_tokens": "5"}', 400, "max_tokens")
        err('{"prompt": "x", "temperature": "hot"}', 400, "temperature")
        err('{"prompt": "x", "stream": 1}', 400, "stream")
        err('{"prompt": "x", "stop": [1]}', 400, "stop")
        err('{"prompt": "x", "n": 0}', 400, "n")
        err('{"prompt": "x", "n": 17}', 400, "n")
        err('{"prompt": ["a", "b"]}', 400, "prompt")
        err('{"prompt": "x", "logprobs": true}', 400, "logprobs")
        err('{"messages": "hi"}', 400, "messages", path="/v1/chat/completions")
        err('{"messages": [{"role": "robot", "content": "x"}]}', 400, "messages", path="/v1/chat/completions")
        err('{"prompt": "x", "max_tokens": 100000}', 400, "prompt", "context_length_exceeded")
        err('{"prompt": [1, 2, 999999]}', 400)
        err(json.dumps({"prompt": "a" * (2 << 20)}), 413, None, "body_too_large")
        st, _, data = srv.raw("GET", "/v1/nothing")
        check(st == 404 and b"error" in data, f"404: {st} {data[:100]!r}")
        check_n(cl, prompts, ref, N, msgs, chat_ref)
        check_controls(srv, cl, prompts, ref, N, err)
        # the load test: 64 clients, mixed prompts and lengths, some with n = 2, some disconnecting
        # mid-stream (half of those with n = 2: both choices are cancelled)
        lens = [1, 3, 6, 11, 16]
        jobs = [(k, k % len(prompts), lens[k % len(lens)], k % 3 == 0, k % 8 == 5, 2 if k % 7 == 2 else 1)
                for k in range(64)]

        def client(job):
            k, pi, n, stream, leave, nc = job
            if leave:   # a raw streaming request dropped after the first event
                s = socket.create_connection((HOST, srv.port), timeout=60)
                body = json.dumps({"prompt": prompts[pi], "max_tokens": 200, "temperature": 0, "stream": True,
                                   "ignore_eos": True, "n": 1 + (k % 16 == 5)})
                s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
                got = b""
                while b"data: " not in got:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    got += chunk
                s.close()
                return ("left", k, None)
            c = openai.OpenAI(base_url=srv.url(), api_key="unused", max_retries=0, timeout=120)
            if stream:
                toks = {}
                for ch in c.completions.create(model="tiny", prompt=prompts[pi], max_tokens=n, temperature=0,
                                               stream=True, n=nc):
                    for x in ch.model_dump()["choices"]:
                        toks.setdefault(x["index"], []).extend(x.get("tokens") or [])
                return ("done", k, toks.get(0) if sorted(toks) == list(range(nc)) and
                        all(t == toks[0] for t in toks.values()) else toks)
            r = c.completions.create(model="tiny", prompt=prompts[pi], max_tokens=n, temperature=0, n=nc)
            toks = [x["tokens"] for x in r.model_dump()["choices"]]
            return ("done", k, toks[0] if len(toks) == nc and all(t == toks[0] for t in toks) else toks)

        t0 = time.time()
        with cf.ThreadPoolExecutor(64) as ex:
            results = list(ex.map(client, jobs, timeout=max(10, DEADLINE - time.time())))
        same = sum(1 for st, k, toks in results if st == "done" and toks == ref[jobs[k][1]][0][:jobs[k][2]])
        done = sum(1 for r in results if r[0] == "done")
        left = sum(1 for r in results if r[0] == "left")
        print(f"load: {len(jobs)} clients in {time.time() - t0:.1f} s: {done} completed ({same} equal to their "
              f"sequential run), {left} disconnected mid-stream")
        check(same == done and done + left == len(jobs), f"load: {same} of {done} equal")
        for st, k, toks in results:
            if st == "done" and toks != ref[jobs[k][1]][0][:jobs[k][2]]:
                fail(f"load client {k}: {toks} vs {ref[jobs[k][1]][0][:jobs[k][2]]}")
        # the disconnected ones were cancelled: nothing stays running, the server answers
        metrics = ""
        for _ in range(100):
            st, _, data = srv.raw("GET", "/metrics")
            metrics = data.decode()
            if re.search(r"^moeflow_running_sequences 0$", metrics, re.M) and re.search(r"^moeflow_queue_depth 0$",
                                                                                         metrics, re.M):
                break
            time.sleep(0.1)
        check(re.search(r"^moeflow_running_sequences 0$", metrics, re.M) is not None, "sequences left running")
        m = re.search(r'^moeflow_requests_total\{finish="cancelled"\} (\d+)$', metrics, re.M)
        check(m is not None and int(m.group(1)) >= left, f"cancelled count: {m and m.group(1)} (want >= {left})")
        for name in ("moeflow_time_to_first_token_seconds_bucket", "moeflow_inter_token_latency_seconds_count",
                     "moeflow_tokens_per_second", "moeflow_step_phase_seconds_total"):
            check(name in metrics, f"/metrics lacks {name}")
        st, _, data = srv.raw("GET", "/health")
        check(st == 200 and b"ok" in data, f"health after load: {st}")
        r = cl.completions.create(model="tiny", prompt=prompts[0], max_tokens=N, temperature=0)
        check(r.model_dump()["choices"][0]["tokens"] == ref[0][0], "a request after the load test")
    finally:
        rc = srv.stop()
    check(rc == 0, f"SIGTERM: exit {rc}; log: {''.join(srv.log[-5:])}")

    # a second server: API key, a queue of 1 (429 + Retry-After), SIGTERM with a request running
    srv = Server(ckpt, "--max-batch", "1", "--max-queue", "1", "--api-key", "sekret", "--drain-timeout", "1",
                 "--timeout", "2", "--request-timeout", "2")
    try:
        # a partial request gets 408 after --request-timeout seconds and is closed; the server goes on
        s = socket.create_connection((HOST, srv.port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\"")
        t0 = time.time()
        got = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            got += chunk
        check(got.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in got and time.time() - t0 < 15,
              f"partial request: {got[:200]!r} after {time.time() - t0:.1f} s")
        s.close()
        st, _, _ = srv.raw("GET", "/health")
        check(st == 200, f"health after a timed-out client: {st}")
        st, _, data = srv.raw("GET", "/v1/models")
        check(st == 401 and b"invalid_api_key" in data, f"no key: {st}")
        auth = {"Authorization": "Bearer sekret"}
        st, _, _ = srv.raw("GET", "/v1/models", headers=auth)
        check(st == 200, f"with the key: {st}")
        body = json.dumps({"prompt": prompts[1], "max_tokens": 300, "temperature": 0, "ignore_eos": True})
        with cf.ThreadPoolExecutor(6) as ex:
            futs = [ex.submit(srv.raw, "POST", "/v1/completions", body, auth) for _ in range(6)]
            time.sleep(0.5)
            res = [f.result(timeout=120) for f in futs]
        n429 = [r for r in res if r[0] == 429]
        check(len(n429) >= 1 and all(r[1].get("Retry-After") for r in n429) and
              all(json.loads(r[2])["error"]["code"] == "queue_full" for r in n429),
              f"queue of 1: statuses {[r[0] for r in res]}")
        # SIGTERM while a long request runs: it is cancelled at the drain deadline, exit 0
        holder = {}
        th = threading.Thread(target=lambda: holder.setdefault("r", srv.raw("POST", "/v1/completions", json.dumps(
            {"prompt": prompts[1], "max_tokens": 3000, "temperature": 0, "ignore_eos": True}), auth)))
        th.start()
        for _ in range(300):   # SIGTERM once it runs (a busy machine may take a while to get it there)
            st, _, data = srv.raw("GET", "/metrics", headers=auth)
            if re.search(r"^moeflow_running_sequences 1$", data.decode(), re.M):
                break
            time.sleep(0.05)
        time.sleep(0.3)
        t0 = time.time()
        rc = srv.stop(timeout=30)
        th.join(30)
        check(rc == 0 and time.time() - t0 < 20, f"SIGTERM with a request running: exit {rc} after "
              f"{time.time() - t0:.1f} s")
        check("r" in holder and holder["r"][0] in (200, 503), f"the running request's answer: {holder.get('r')}")
    finally:
        if srv.p.poll() is None:
            srv.p.kill()
    shutil.rmtree(TMP, ignore_errors=True)
    if FAILURES:
        print(f"check_serve: {len(FAILURES)} mismatches", file=sys.stderr)
        return 1
    print("check_serve: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
