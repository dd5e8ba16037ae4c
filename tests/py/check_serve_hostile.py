#!/usr/bin/env python3
"""`moeflow serve` under hostile clients (issue 33; docs/serve.md, "Hostile clients"), over raw
sockets on loopback, every count and wait bounded: request heads the front door refuses
(smuggling framing, bad versions, oversize targets, heads and field counts, malformed lines), each
an OpenAI error object with its status; exact routes (404, 405 with Allow, HEAD, %00 in a path);
the API key (scheme in any case, wrong keys, the key from MOEFLOW_API_KEY and from --api-key-file,
401 and 413 before any body byte is sent); refusals on kept-alive connections; half-closed
requests answered; slow headers, slow bodies and idle floods answered 408 at --request-timeout
while a well-behaved client is served; the idle keep-alive timeout; the per-address and total
connection limits (429, 503); fresh seeds reported and reproducible; every refusal counted in
/metrics by reason; --quiet silences libmicrohttpd; load rounds with disconnects repeated until the
RSS is flat (the bound below); 1,000 idle and 300 slow-header connections held open while a
well-behaved client's requests complete (their latency printed: docs/measurements.md); SIGTERM with
long streams: each ends with finish_reason "error" and an error event before [DONE], exit 0.
Smaller counts in a sanitizer build (MOEFLOW_SANITIZE, from CMake). Exits non-zero on any mismatch."""
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import serve_proc

BIN = os.environ.get("MOEFLOW_BIN", "build/moeflow")
TMP = os.path.join(os.environ.get("MOEFLOW_TMP", "/tmp"), f"check_serve_hostile_{os.getpid()}")
SANITIZED = bool(os.environ.get("MOEFLOW_SANITIZE"))
HOST = "127.0.0.1"
KEY = "k3y-hostile"
FAILURES = []
# RSS flat: load rounds until RSS_ROUNDS in a row end at most RSS_BOUND_MB above the RSS before them (the
# engine's kept step shapes fill in the first 10-16 rounds), at most RSS_MAX_ROUNDS rounds
RSS_BOUND_MB, RSS_ROUNDS, RSS_MAX_ROUNDS = 4, 8, 30


def fail(msg):
    FAILURES.append(msg)
    print("MISMATCH:", msg, file=sys.stderr)


def check(cond, msg):
    if not cond:
        fail(msg)
    return cond


class Server:
    def __init__(self, ckpt, *args, env=None):
        e = dict(os.environ)
        e.pop("MOEFLOW_API_KEY", None)
        if SANITIZED:   # a small quarantine, so the RSS says what the server holds
            e["ASAN_OPTIONS"] = (e.get("ASAN_OPTIONS", "") + ":quarantine_size_mb=16").lstrip(":")
        e.update(env or {})
        self.p, self.port, self.log = serve_proc.start([BIN, "serve", "--checkpoint", ckpt, "--host", HOST, "--port",
                                                        "0", "--threads", "2", *args], env=e)

    def rss_mb(self):
        for line in open(f"/proc/{self.p.pid}/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
        return 0

    def stop(self, sig=signal.SIGTERM, timeout=60):
        self.p.send_signal(sig)
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return None


def connect(port, src=None, timeout=10):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    if src:
        s.bind((src, 0))
    s.connect((HOST, port))
    return s


def read_response(s, head_only=False):
    """One HTTP/1.1 response from socket s: (status, headers with lower-case names, body); body by
    Content-Length, chunked, or until the close. (None, {}, b'') when the socket closed first."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        try:
            c = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            c = b""
        if not c:
            return None, {}, buf
        buf += c
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hd = {}
    for ln in lines[1:]:
        k, v = ln.split(":", 1)
        hd[k.strip().lower()] = v.strip()

    def more():
        try:
            return s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            return b""
    if head_only:
        return status, hd, rest
    if "content-length" in hd:
        n = int(hd["content-length"])
        while len(rest) < n:
            c = more()
            if not c:
                break
            rest += c
        return status, hd, rest[:n]
    if hd.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            while b"\r\n" not in rest:
                c = more()
                if not c:
                    return status, hd, body
                rest += c
            size_s, rest = rest.split(b"\r\n", 1)
            size = int(size_s.split(b";")[0], 16)
            while len(rest) < size + 2:
                c = more()
                if not c:
                    return status, hd, body + rest
                rest += c
            body += rest[:size]
            rest = rest[size + 2:]
            if size == 0:
                return status, hd, body
    while True:
        c = more()
        if not c:
            return status, hd, rest
        rest += c


def closed(s, wait):
    """True when the peer closes s within `wait` seconds (what arrives meanwhile is dropped)."""
    s.settimeout(wait)
    t0 = time.time()
    try:
        while time.time() - t0 < wait:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False


def raw(port, data, src=None, shut=False):
    s = connect(port, src)
    try:
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        return read_response(s)
    finally:
        s.close()


def dechunk(b):
    """The data of a chunked body (as far as it goes)."""
    out = b""
    while b"\r\n" in b:
        size_s, b = b.split(b"\r\n", 1)
        size = int(size_s.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += b[:size]
        b = b[size + 2:]
    return out


def error_code(body):
    try:
        e = json.loads(body)["error"]
        return e["code"] if isinstance(e.get("message"), str) and e["message"] and "type" in e else "<malformed>"
    except Exception:
        return "<not an error object>"


def expect(what, resp, status, code=None):
    st, hd, body = resp
    got = error_code(body) if code else None
    check(st == status and (code is None or got == code) and
          (code is None or hd.get("content-type") == "application/json"),
          f"{what}: status {st} code {got} (want {status} {code}); {body[:160]!r}")


def post(path, body, headers=b"", version=b"HTTP/1.1"):
    b = body.encode() if isinstance(body, str) else body
    return (b"POST " + path + b" " + version + b"\r\nHost: x\r\nContent-Type: application/json\r\n" + headers +
            b"Content-Length: " + str(len(b)).encode() + b"\r\n\r\n" + b)


AUTH = b"Authorization: Bearer " + KEY.encode() + b"\r\n"


def check_heads(port):
    """Heads the front door refuses (a connection's first request), each an error object."""
    big_target = b"/v1/models?" + b"a" * 9000
    cases = [
        (post(b"/v1/completions", "{}", b"Transfer-Encoding: chunked\r\n"), 400, "bad_request"),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
         411, "length_required"),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 501, "not_implemented"),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}", 400,
         "bad_request"),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2x\r\n\r\n{}", 400, "bad_request"),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999999\r\n\r\n", 413,
         "body_too_large"),
        (b"GET /health HTTP/1.1\r\nHost : x\r\n\r\n", 400, "bad_request"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n  2\r\n\r\n", 400, "bad_request"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: 1\r2\r\n\r\n", 400, "bad_request"),
        (b"GET /health HTTP/1.1\r\nX-A: 1\r\n\r\n", 400, "bad_request"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400, "bad_request"),
        (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505, "http_version_not_supported"),
        (b"GET /health HTTP/1.2\r\nHost: x\r\n\r\n", 505, "http_version_not_supported"),
        (b"GET /health HTTX/1.1\r\nHost: x\r\n\r\n", 400, "bad_request"),
        (b"GARBAGE\r\n\r\n", 400, "bad_request"),
        (b"GET  /health HTTP/1.1\r\nHost: x\r\n\r\n", 400, "bad_request"),
        (b"GET /he\x01alth HTTP/1.1\r\nHost: x\r\n\r\n", 400, "bad_request"),
        (b"GET http://x/health HTTP/1.1\r\nHost: x\r\n\r\n", 400, "bad_request"),
        (b"GET " + big_target + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 17000 + b"\r\n\r\n", 431, "header_too_large"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101)) + b"\r\n", 431,
         "header_too_large"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: 1", 400, "bad_request"),   # half-closed before the blank line
    ]
    for k, (data, st, code) in enumerate(cases):
        expect(f"head case {k} {data[:50]!r}", raw(port, data, shut=k == len(cases) - 1), st, code)
    # a target still arriving is refused as soon as it is too long
    s = connect(port)
    s.sendall(b"GET /" + b"x" * 9100)
    expect("a long target still arriving", read_response(s), 414, "uri_too_long")
    s.close()
    # HTTP/1.0 needs no Host
    st, _, body = raw(port, b"GET /health HTTP/1.0\r\n\r\n")
    check(st == 200 and b"ok" in body, f"HTTP/1.0 /health: {st} {body!r}")
    return len(cases) + 1


def check_routes(port):
    expect("%00 in the path", raw(port, b"GET /v1/models%00.json HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n"), 404,
           "not_found")
    expect("a trailing slash", raw(port, b"GET /v1/models/ HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n"), 404, "not_found")
    r = raw(port, post(b"/health", "{}"))
    expect("POST /health", r, 405, "method_not_allowed")
    check(r[1].get("allow") == "GET, HEAD", f"POST /health: Allow {r[1].get('allow')!r}")
    r = raw(port, b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n")
    expect("GET /v1/completions", r, 405, "method_not_allowed")
    check(r[1].get("allow") == "POST", f"GET /v1/completions: Allow {r[1].get('allow')!r}")
    expect("DELETE /v1/models", raw(port, b"DELETE /v1/models HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n"), 405,
           "method_not_allowed")
    s = connect(port)
    s.sendall(b"HEAD /v1/models HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n")
    st, hd, rest = read_response(s, head_only=True)
    check(st == 200 and int(hd.get("content-length", "0")) > 0 and rest == b"", f"HEAD /v1/models: {st} {hd} {rest!r}")
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")   # the connection is still usable: no body came
    st, _, body = read_response(s)
    check(st == 200 and body == b'{"status":"ok"}', f"GET after HEAD on one connection: {st} {body!r}")
    s.close()


def check_auth(port):
    models = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
    expect("no key", raw(port, models + b"\r\n"), 401, "invalid_api_key")
    for a in (b"bearer ", b"BEARER ", b"Bearer  ", b"bEaReR\t"):
        st, _, body = raw(port, models + b"Authorization: " + a + KEY.encode() + b"\r\n\r\n")
        check(st == 200 and b'"data"' in body, f"scheme {a!r}: {st} {body[:80]!r}")
    for a in (b"Bearer " + KEY[:-1].encode(), b"Bearer " + KEY.encode() + b"x", b"Basic " + KEY.encode(),
              b"Bearer" + KEY.encode(), b"Bearer ", b"Bearer x" + KEY.encode()):
        expect(f"key {a!r}", raw(port, models + b"Authorization: " + a + b"\r\n\r\n"), 401, "invalid_api_key")
    st, _, _ = raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    check(st == 200, f"/health without a key: {st}")
    # refused before the body: the head alone gets its answer, and the connection closes
    for hdrs, st, code in ((b"", 401, "invalid_api_key"), (AUTH, 413, "body_too_large")):
        n = 60000 if st == 401 else 1 << 20
        s = connect(port, timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + hdrs + b"Content-Length: %d\r\n\r\n" % n)
        r = read_response(s)
        expect(f"{st} before the body", r, st, code)
        check(r[1].get("connection") == "close" and closed(s, 3), f"{st} before the body: the connection stays open")
        s.close()
        # a client that sends the whole body anyway (most do) can: the socket is drained after the
        # answer, not reset, and the answer is there to read
        s = connect(port, timeout=10)
        try:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + hdrs + b"Content-Length: %d\r\n\r\n" % n +
                      b" " * n)
            expect(f"{st} with the whole body sent", read_response(s), st, code)
        except OSError as e:
            fail(f"{st} with the whole body sent: {e!r}")
        s.close()
    # refusals on a kept-alive connection (libmicrohttpd parsed the head; the handler refuses)
    s = connect(port)
    for data, st, code in ((post(b"/v1/completions", "{}", AUTH + b"Transfer-Encoding: chunked\r\n"), 400, "bad_request"),
                           (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + AUTH +
                            b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 411, "length_required"),
                           (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 20000 + b"\r\n\r\n", 431,
                            "header_too_large"),
                           (b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(101)) +
                            b"\r\n", 431, "header_too_large"),
                           (b"GET /" + b"x" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414, "uri_too_long")):
        s.close()
        s = connect(port)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        check(read_response(s)[0] == 200, "kept-alive: first request")
        s.sendall(data)
        expect(f"kept-alive follow-up {data[:40]!r}", read_response(s), st, code)
    s.close()


def check_half_close(port, prompt_ids):
    body = json.dumps({"prompt": prompt_ids, "max_tokens": 6, "temperature": 0})
    st, _, out = raw(port, post(b"/v1/completions", body, AUTH), shut=True)
    ok = st == 200 and len(json.loads(out)["choices"][0]["tokens"]) > 0
    check(ok, f"half-closed request: {st} {out[:160]!r}")
    body = json.dumps({"prompt": prompt_ids, "max_tokens": 6, "temperature": 0, "stream": True})
    st, _, out = raw(port, post(b"/v1/completions", body, AUTH), shut=True)
    check(st == 200 and out.endswith(b"data: [DONE]\n\n"), f"half-closed stream: {st} {out[-120:]!r}")


def served(port, prompt_ids):
    """A well-behaved client's request on a new connection: its latency in seconds (None on failure)."""
    t0 = time.time()
    body = json.dumps({"prompt": prompt_ids, "max_tokens": 2, "temperature": 0})
    try:
        st, _, out = raw(port, post(b"/v1/completions", body, AUTH))
    except OSError as e:
        return fail(f"a well-behaved request: {e}")
    if not check(st == 200 and b'"choices"' in out, f"a well-behaved request: {st} {out[:160]!r}"):
        return None
    return time.time() - t0


def slow_clients(port, n, kind, srcs, stop, out):
    """n connections from the addresses srcs: 'idle' (nothing sent), 'head' (a head one byte at a time,
    a byte a second) or 'body' (a whole head, then the body a byte a second). out gets, per
    connection, (seconds from connect to the answer, status, code)."""
    socks = []
    for i in range(n):
        try:
            s = connect(port, srcs[i % len(srcs)], timeout=30)
        except OSError as e:
            out.append((None, f"connect: {e}", None))
            continue
        socks.append((s, time.time()))
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"s" * 200 + b"\r\n\r\n"
    if kind == "body":
        head = post(b"/v1/completions", " " * 200 + "{}", AUTH)
        for s, _ in socks:
            s.sendall(head[:len(head) - 200])
    pos = len(head) - 200 if kind == "body" else 0
    live = list(socks)
    while live and not stop.is_set():
        if kind != "idle":
            for s, _ in list(live):
                try:
                    s.sendall(head[pos:pos + 1])
                except OSError:
                    pass
            pos += 1
        t_next = time.time() + 1.0
        for s, t0 in list(live):   # whoever has an answer (or a close) is done
            s.setblocking(False)
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            s.settimeout(5)
            st = None
            if data:
                try:
                    s2 = data
                    while b"\r\n\r\n" not in s2 or len(s2.split(b"\r\n\r\n", 1)[1]) < int(
                            re.search(rb"Content-Length: (\d+)", s2).group(1)):
                        c = s.recv(65536)
                        if not c:
                            break
                        s2 += c
                    st = int(s2.split()[1])
                    out.append((time.time() - t0, st, error_code(s2.split(b"\r\n\r\n", 1)[1])))
                except Exception as e:
                    out.append((time.time() - t0, "unparsed", repr(e)))
            else:
                out.append((time.time() - t0, "closed", None))
            live.remove((s, t0))
            s.close()
        time.sleep(max(0.0, t_next - time.time()))
    for s, _ in live:
        s.close()
    return len(live)


def check_slow(port, prompt_ids, rt, n_each):
    """Slow heads, slow bodies and idle connections are answered 408 about --request-timeout after
    they connect, while a well-behaved client is served at once."""
    srcs = ["127.0.0.%d" % k for k in range(2, 7)]
    stop = threading.Event()
    outs = {k: [] for k in ("idle", "head", "body")}
    ths = [threading.Thread(target=slow_clients, args=(port, n_each, k, srcs, stop, outs[k])) for k in outs]
    for t in ths:
        t.start()
    time.sleep(0.8)
    lat = [served(port, prompt_ids) for _ in range(3)]
    check(all(x is not None and x < rt for x in lat), f"served beside slow clients: latencies {lat} (want < {rt} s)")
    for t in ths:
        t.join(rt + 30)
    stop.set()
    for k, o in outs.items():
        good = [x for x in o if x[1] == 408 and x[2] == "request_timeout" and rt - 0.5 <= x[0] <= rt + 3]
        check(len(good) == n_each, f"slow {k}: {len(good)} of {n_each} answered 408 near {rt} s: {o[:4]}")


def check_keepalive(port, idle):
    s = connect(port)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    check(read_response(s)[0] == 200, "keep-alive: first request")
    t0 = time.time()
    check(closed(s, idle + 4) and idle - 0.5 <= time.time() - t0 <= idle + 3,
          f"an idle kept-alive connection: closed after {time.time() - t0:.1f} s (want ~{idle})")
    s.close()
    s = connect(port)   # a second request dribbled byte by byte is cut at the idle deadline too
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    check(read_response(s)[0] == 200, "keep-alive: first request")
    t0 = time.time()
    for ch in b"GET /health HTTP/1.1\r\n":
        try:
            s.sendall(bytes([ch]))
        except OSError:
            break
        if closed(s, 0.4):
            break
    check(time.time() - t0 <= idle + 3, f"a dribbled second request: open {time.time() - t0:.1f} s (want <= ~{idle})")
    s.close()


def check_limits(port, per_addr):
    socks = [connect(port, "127.0.0.77") for _ in range(per_addr)]
    time.sleep(0.3)
    s = connect(port, "127.0.0.77")
    r = read_response(s)
    expect("over the per-address limit", r, 429, "too_many_connections")
    check(r[1].get("retry-after") == "1", f"429: Retry-After {r[1].get('retry-after')!r}")
    s.close()
    st, _, _ = raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", src="127.0.0.78")
    check(st == 200, f"another address beside a full one: {st}")
    for x in socks:
        x.close()


def check_total(ckpt):
    srv = Server(ckpt, "--max-connections", "20", "--quiet", "--request-timeout", "5")
    try:
        socks = [connect(srv.port, "127.0.0.%d" % (10 + k % 5)) for k in range(20)]
        time.sleep(0.3)
        s = connect(srv.port, "127.0.0.30")
        r = read_response(s)
        expect("over --max-connections", r, 503, "server_busy")
        s.close()
        for x in socks:
            x.close()
        time.sleep(0.5)
        st, _, _ = raw(srv.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        check(st == 200, f"after the flood left: {st}")
    finally:
        check(srv.stop() == 0, "--max-connections server: exit code")


def check_seeds(port, prompt_ids):
    def gen(**kw):
        st, _, out = raw(port, post(b"/v1/completions", json.dumps(
            {"prompt": prompt_ids, "max_tokens": 12, "temperature": 1.5, **kw}), AUTH))
        check(st == 200, f"sampled request: {st} {out[:200]!r}")
        o = json.loads(out)
        return o.get("seed"), [c["tokens"] for c in o["choices"]]
    runs = [gen() for _ in range(4)]
    check(all(isinstance(sd, int) for sd, _ in runs) and len({sd for sd, _ in runs}) == 4,
          f"fresh seeds: {[sd for sd, _ in runs]}")
    check(len({tuple(t[0]) for _, t in runs}) > 1, f"4 unseeded samples all equal: {runs}")
    sd, toks = runs[0]
    check(gen(seed=sd) == (sd, toks), "a reported seed does not reproduce its tokens")
    sd2, toks2 = gen(n=2)
    check(gen(seed=sd2 + 1)[1][0] == toks2[1], "n=2 with a fresh seed: choice 1 is not seed + 1")


def metrics(port):
    st, _, body = raw(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n")
    out = {}
    for m in re.finditer(r'^moeflow_rejected_total\{reason="([a-z_]+)"\} (\d+)$', body.decode(), re.M):
        out[m.group(1)] = int(m.group(2))
    return out


def load_round(port, prompt_ids, n):
    """n clients at once: streamed and not, n = 2 for some, a quarter leaving after their first event."""
    def one(k):
        try:
            body = json.dumps({"prompt": prompt_ids[:1 + k % len(prompt_ids)], "max_tokens": 4 + (k * 5) % 24,
                               "temperature": 0, "stream": k % 2 == 0, "ignore_eos": True, "n": 1 + (k % 7 == 3)})
            s = connect(port, timeout=120)
            s.sendall(post(b"/v1/completions", body, AUTH))
            if k % 4 == 1:
                buf = b""
                while b"data: " not in buf and b"\r\n\r\n{" not in buf:
                    c = s.recv(4096)
                    if not c:
                        break
                    buf += c
            else:
                st, _, _ = read_response(s)
                check(st == 200, f"load client {k}: {st}")
            s.close()
        except OSError as e:
            fail(f"load client {k}: {e}")
    ths = [threading.Thread(target=one, args=(k,)) for k in range(n)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(300)


def check_rss(srv, prompt_ids, n):
    """Load rounds until RSS_ROUNDS in a row stay within RSS_BOUND_MB of the RSS before them."""
    rss = [srv.rss_mb()]
    flat = False
    for r in range(RSS_MAX_ROUNDS):
        load_round(srv.port, prompt_ids, n)
        time.sleep(0.2)
        rss.append(srv.rss_mb())
        if len(rss) > RSS_ROUNDS and max(rss[-RSS_ROUNDS:]) - rss[-RSS_ROUNDS - 1] <= RSS_BOUND_MB:
            flat = True
            break
    print(f"rss: {len(rss) - 1} load rounds of {n} clients: " + " ".join(f"{x:.1f}" for x in rss) + " MB")
    check(flat, f"RSS not flat ({RSS_ROUNDS} rounds within {RSS_BOUND_MB} MB) after {len(rss) - 1} rounds: {rss}")


def check_held(ckpt, prompt_ids, n_idle, n_slow):
    """n_idle idle and n_slow slow-header connections held open (from several loopback addresses):
    a well-behaved client's requests complete; their latency printed."""
    srv = Server(ckpt, "--quiet", "--max-connections", "4096", "--max-connections-per-addr", "128", "--request-timeout",
                 "30")
    socks = []
    try:
        served(srv.port, prompt_ids)   # warm: the shapes of this request built
        base = sorted(served(srv.port, prompt_ids) or 99 for _ in range(5))
        t0 = time.time()
        for k in range(n_idle + n_slow):
            socks.append(connect(srv.port, "127.0.1.%d" % (1 + k // 100)))
        for s in socks[n_idle:]:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        t_open = time.time() - t0
        time.sleep(1.0)
        lat = []
        for r in range(5):
            for s in socks[n_idle:]:
                s.sendall(b"s")
            lat.append(served(srv.port, prompt_ids) or 99)
        st, _, body = raw(srv.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n")
        held = re.search(rb'moeflow_connections\{state="held"\} (\d+)', body)
        check(held and int(held.group(1)) >= n_idle + n_slow,
              f"held connections: {held and held.group(1)} (want >= {n_idle + n_slow})")
        lat.sort()
        print(f"held: {n_idle} idle + {n_slow} slow-header connections opened in {t_open:.2f} s; a well-behaved "
              f"request (2 tokens) took median {lat[2] * 1e3:.1f} ms, max {lat[-1] * 1e3:.1f} ms "
              f"(without them: median {base[2] * 1e3:.1f} ms, max {base[-1] * 1e3:.1f} ms)")
        check(max(lat) < 10, f"well-behaved requests beside held connections: {lat}")
    finally:
        for s in socks:
            s.close()
        check(srv.stop() == 0, "held-connections server: exit code")


def check_drain(ckpt, prompt_ids):
    """SIGTERM with long streams running: each ends with finish_reason "error" and an error event
    (shutting_down) before [DONE]; a long non-streamed request gets 503; exit 0."""
    # five sequences, five states: whichever request the server reads first, all run at once
    srv = Server(ckpt, "--max-batch", "5", "--drain-timeout", "1", env={"MOEFLOW_API_KEY": KEY})
    socks, got = [], {}
    try:
        for k in range(3):
            s = connect(srv.port, timeout=60)
            s.sendall(post(b"/v1/completions", json.dumps(
                {"prompt": prompt_ids, "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True,
                 "n": 1 + (k == 2)}), AUTH))
            socks.append(s)
        s = connect(srv.port, timeout=60)
        s.sendall(post(b"/v1/completions", json.dumps({"prompt": prompt_ids, "max_tokens": 3000, "temperature": 0,
                                                       "ignore_eos": True}), AUTH))
        plain = s
        for k, s in enumerate(socks):   # every stream has begun
            buf = b""
            try:
                while buf.count(b"data: ") < 3:
                    c = s.recv(65536)
                    if not c:
                        break
                    buf += c
            except socket.timeout:
                st, _, m = raw(srv.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + AUTH + b"\r\n")
                fail(f"drain: stream {k} did not begin in 60 s: {buf[:300]!r}; metrics "
                     f"{[x for x in m.decode().splitlines() if not x.startswith('#')][:40]}")
            got[k] = buf
        t_stop = time.time()
        rc = srv.stop()
        check(rc == 0, f"drain: exit code {rc}; log {''.join(srv.log[-4:])}")
        t_stop = time.time() - t_stop
        for k, s in enumerate(socks):
            buf = got[k]
            while True:
                try:
                    c = s.recv(65536)
                except OSError:
                    break
                if not c:
                    break
                buf += c
            text = dechunk(buf.split(b"\r\n\r\n", 1)[1]).decode(errors="replace")
            events = [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]
            fins = [json.loads(e)["choices"][0].get("finish_reason") for e in events[:-2]
                    if e.startswith("{") and "choices" in json.loads(e)]
            n_ch = 1 + (k == 2)
            ok = (len(events) >= 3 and events[-1] == "[DONE]" and error_code(events[-2]) == "shutting_down" and
                  fins.count("error") == n_ch)
            check(ok, f"drained stream {k}: last events {events[-3:]} finish_reasons {fins[-3:]}; exit after "
                      f"{t_stop:.1f} s; server log {''.join(srv.log[-6:])}")
        st, _, body = read_response(plain)
        check(st == 503 and error_code(body) == "shutting_down", f"drained plain request: {st} {body[:160]!r}")
        stray = [x for x in srv.log if x.strip() and not x.startswith(("moeflow serve: ", "load ["))]
        check(any("draining" in x for x in srv.log) and not stray, f"log lines without the prefix: {stray[:3]}")
    finally:
        for s in socks:
            s.close()
        if srv.p.poll() is None:
            srv.p.kill()


def main():
    os.makedirs(TMP, exist_ok=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2048 if SANITIZED else 4096
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    ckpt = os.path.join(TMP, "tiny")
    subprocess.run([BIN, "gen", "--preset", "tiny", "--out", ckpt, "--quiet"], check=True)
    ids = [5, 17, 42, 99, 7, 300, 12, 8, 61, 250]
    keyfile = os.path.join(TMP, "key")
    with open(keyfile, "w") as f:
        f.write(KEY + "\n")
    os.chmod(keyfile, 0o600)
    rt, idle, per_addr = 2, 3, 40
    srv = Server(ckpt, "--max-batch", "4", "--step-tokens", "16", "--request-timeout", str(rt), "--timeout", str(idle),
                 "--max-connections", "600", "--max-connections-per-addr", str(per_addr), "--max-body", "64K",
                 "--api-key-file", keyfile, "--quiet")
    try:
        n_heads = check_heads(srv.port)
        check_routes(srv.port)
        check_auth(srv.port)
        check_half_close(srv.port, ids)
        n_each = 8 if SANITIZED else 24
        check_slow(srv.port, ids, rt, n_each)
        check_keepalive(srv.port, idle)
        check_limits(srv.port, per_addr)
        check_seeds(srv.port, ids)
        m = metrics(srv.port)
        want = {"bad_request": 13, "request_timeout": 3 * n_each, "too_many_connections": 1, "invalid_api_key": 8,
                "not_found": 2, "method_not_allowed": 3, "length_required": 2, "body_too_large": 3,
                "uri_too_long": 3, "header_too_large": 4, "http_version_not_supported": 2, "not_implemented": 1}
        check(all(m.get(k, 0) >= v for k, v in want.items()) and n_heads > 20,
              f"/metrics rejected_total: {m} (want at least {want})")
        check_rss(srv, ids, 12 if SANITIZED else 32)
        check(not any(x for x in srv.log[1:] if x.strip()), f"--quiet printed: {srv.log[1:4]}")
    finally:
        rc = srv.stop()
    check(rc == 0, f"SIGTERM: exit {rc}; log: {''.join(srv.log[-5:])}")
    check_total(ckpt)
    check_held(ckpt, ids, 200 if SANITIZED else 1000, 60 if SANITIZED else 300)
    check_drain(ckpt, ids)
    shutil.rmtree(TMP, ignore_errors=True)
    if FAILURES:
        print(f"check_serve_hostile: {len(FAILURES)} mismatches", file=sys.stderr)
        return 1
    print("check_serve_hostile: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
