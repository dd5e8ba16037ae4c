#!/usr/bin/env python3
"""`moeflow serve` with the prefix cache (docs/prefix.md) on a tiny checkpoint, loopback only: a
repeated long prompt reports usage.prompt_tokens_details.cached_tokens (whole blocks below its last
token), the next turn of a conversation (the prompt, its reply and new tokens) restores up to the
last token fed, a chat's second turn hits its first turn's prompt, streamed responses carry the
same usage; every response's tokens and logprobs (generated, and an echo's prompt entries: such a
request restores nothing) equal a server's without the cache (--prefix-cache 0); /metrics
has the cache's lines; a restart on the same --prefix-cache-dir hits from disk with the same tokens.
Standard library only. Exits non-zero on any mismatch."""
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import serve_proc

BIN = os.environ.get("MOEFLOW_BIN", "build/moeflow")
TMP = os.path.join(os.environ.get("MOEFLOW_TMP", "/tmp"), f"check_prefix_serve_{os.getpid()}")
HOST = "127.0.0.1"
FAILURES = []


def check(cond, msg):
    if not cond:
        FAILURES.append(msg)
        print("MISMATCH:", msg, file=sys.stderr)
    return cond


class Server:
    def __init__(self, ckpt, *args):
        self.p, self.port, self.log = serve_proc.start([BIN, "serve", "--checkpoint", ckpt, "--host", HOST, "--port",
                                                        "0", "--threads", "2", "--max-context", "1024", *args])

    def req(self, method, path, body=None):
        c = http.client.HTTPConnection(HOST, self.port, timeout=120)
        c.request(method, path, body=json.dumps(body) if body is not None else None,
                  headers={"Content-Type": "application/json"} if body is not None else {})
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, data

    def post(self, path, body):
        st, data = self.req("POST", path, body)
        check(st == 200, f"{path}: HTTP {st}: {data[:300]!r}")
        return json.loads(data) if st == 200 else None

    def stream(self, path, body):
        """The SSE events' JSON objects of a streamed request."""
        st, data = self.req("POST", path, dict(body, stream=True))
        check(st == 200, f"{path} stream: HTTP {st}")
        return [json.loads(x[6:]) for x in data.decode().split("\n\n") if x.startswith("data: {")]

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        rc = self.p.wait(timeout=60)
        check(rc == 0, f"server exit {rc}: {''.join(self.log[-5:])}")


def cached(r):
    return ((r or {}).get("usage") or {}).get("prompt_tokens_details", {}).get("cached_tokens")


def toks(r):
    return (r or {}).get("choices", [{}])[0].get("tokens")


def lp(r):
    return (r or {}).get("choices", [{}])[0].get("logprobs")


def run(srv):
    """The requests; what each returned (tokens, cached tokens)."""
    out = {}
    long = [(29 * k + 3) % 500 for k in range(200)]
    r = srv.post("/v1/completions", {"prompt": long, "max_tokens": 4, "temperature": 0, "logprobs": 3})
    out["first"] = (toks(r), cached(r))
    out["first logprobs"] = (lp(r), cached(r))
    r = srv.post("/v1/completions", {"prompt": long, "max_tokens": 4, "temperature": 0, "logprobs": 3})
    out["repeat"] = (toks(r), cached(r))
    out["repeat logprobs"] = (lp(r), cached(r))
    nxt = long + (toks(r) or []) + [(7 * k + 5) % 500 for k in range(20)]
    r = srv.post("/v1/completions", {"prompt": nxt, "max_tokens": 4, "temperature": 0, "logprobs": 3})
    out["next turn"] = (toks(r), cached(r))
    out["next turn logprobs"] = (lp(r), cached(r))
    # echo: every prompt position's logprob, so a cached prompt is computed whole (cached_tokens 0)
    r = srv.post("/v1/completions", {"prompt": long, "max_tokens": 2, "temperature": 0, "logprobs": 2, "echo": True})
    out["echo"] = ((toks(r), lp(r)), cached(r))
    ev = srv.stream("/v1/completions", {"prompt": nxt, "max_tokens": 3, "temperature": 0})
    last = [e for e in ev if e.get("usage")]
    out["stream"] = ([t for e in ev for t in e["choices"][0].get("tokens", [])] if ev else None,
                     cached(last[-1]) if last else None)
    msgs = [{"role": "system", "content": "You answer in one word. " * 12},
            {"role": "user", "content": "What is the colour of the sky on a clear day, seen from a field?"}]
    r = srv.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "temperature": 0})
    out["chat 1"] = (toks(r), cached(r))
    reply = (r or {}).get("choices", [{}])[0].get("message", {}).get("content", "")
    msgs2 = msgs + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And at night?"}]
    r = srv.post("/v1/chat/completions", {"messages": msgs2, "max_tokens": 5, "temperature": 0})
    out["chat 2"] = (toks(r), cached(r), (r or {}).get("usage", {}).get("prompt_tokens"))
    return out


def main():
    os.makedirs(TMP, exist_ok=True)
    ckpt = os.path.join(TMP, "tiny")
    subprocess.run([BIN, "gen", "--preset", "tiny", "--out", ckpt, "--quiet"], check=True)
    pdir = os.path.join(TMP, "prefix")
    srv = Server(ckpt, "--prefix-cache", "0")
    try:
        base = run(srv)
    finally:
        srv.stop()
    check(all(v[1] == 0 for v in base.values()), f"without the cache every cached_tokens is 0: {base}")
    srv = Server(ckpt, "--prefix-cache", "64M", "--prefix-cache-dir", pdir)
    try:
        got = run(srv)
        st, m = srv.req("GET", "/metrics")
        m = m.decode()
        hit = re.search(r"^moeflow_prefix_cache_hit_tokens_total (\d+)$", m, re.M)
        check(st == 200 and hit and int(hit.group(1)) > 0 and 'moeflow_prefix_cache_bytes{tier="ram"}' in m
              and 'moeflow_prefix_cache_bytes{tier="disk"}' in m and "moeflow_prefix_cache_hit_rate" in m
              and 'moeflow_prefix_cache_evictions_total{tier="ram"}' in m and "moeflow_prefix_cache_lookups_total" in m,
              f"/metrics: {m[-1500:]}")
    finally:
        srv.stop()
    for k, v in base.items():
        check(got[k][0] == v[0], f"{k}: {str(got[k][0])[:200]} with the cache, {str(v[0])[:200]} without")
    check(base["first logprobs"][0] is not None and len(base["first logprobs"][0].get("token_logprobs", [])) == 4,
          f"logprobs of 4 tokens: {base['first logprobs']}")
    check(base["echo"][0][1] is not None and len(base["echo"][0][1].get("token_logprobs", [])) == 202,
          f"echo: 200 prompt and 2 generated entries: {str(base['echo'])[:300]}")
    check(got["echo"][1] == 0, f"an echo request restores nothing: {got['echo'][1]} cached")
    check(got["first"][1] == 0 and got["repeat"][1] == 192, f"a repeated 200-token prompt: {got['first']}, {got['repeat']}")
    check(got["next turn"][1] == 203, f"the next turn restores the prompt and 3 of 4 reply tokens: {got['next turn']}")
    check(got["stream"][1] is not None and got["stream"][1] >= 192, f"streamed usage: {got['stream']}")
    check(got["chat 2"][1] >= 64, f"a chat's second turn hits its first: {got['chat 2']}")
    srv = Server(ckpt, "--prefix-cache", "64M", "--prefix-cache-dir", pdir)   # a restart: memory empty
    try:
        long = [(29 * k + 3) % 500 for k in range(200)]
        r = srv.post("/v1/completions", {"prompt": long, "max_tokens": 4, "temperature": 0})
        check(toks(r) == base["first"][0] and cached(r) == 192, f"after a restart: {toks(r)}, {cached(r)} cached")
    finally:
        srv.stop()
    print(f"check_prefix_serve: cached tokens {[(k, v[1]) for k, v in got.items()]}; "
          f"{len(FAILURES)} mismatches")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
