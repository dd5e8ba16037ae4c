#!/usr/bin/env python3
"""`moeflow decode --prompts` interrupted (issue 33; docs/serve.md, "decode --prompts"): on a tiny
checkpoint, a prompts file with an empty line and two lines that cannot be prompts (not UTF-8; a NUL
byte) is decoded once uninterrupted (greedy), then again with SIGINT or SIGTERM at random points
(once: the prompts generating finish; twice: they are cancelled), and, to stand for SIGKILL, with
a half-written last line appended. After every interruption: the exit code (130 / 143), the
summary line, every line of --output a whole JSON record; then `--resume` (itself interrupted at
times) until it exits 3 (done, lines refused), and the records by index equal the uninterrupted
run's (tokens, text, finish_reason). Also: `index` is the line's index in the file (empty lines
count), refused lines are error records, stdout's `[i]` lines escape newlines (one line each),
`--checkpoint /nonexistent` says the directory does not exist. Exits non-zero on any mismatch."""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

BIN = os.environ.get("MOEFLOW_BIN", "build/moeflow")
TMP = os.path.join(os.environ.get("MOEFLOW_TMP", "/tmp"), f"check_decode_interrupt_{os.getpid()}")
SANITIZED = bool(os.environ.get("MOEFLOW_SANITIZE"))
FAILURES = []


def fail(msg):
    FAILURES.append(msg)
    print("MISMATCH:", msg, file=sys.stderr)


def check(cond, msg):
    if not cond:
        fail(msg)
    return cond


def decode(ckpt, prompts, out, *extra, signals=(), stdout=None):
    """Runs decode; signals: (delay s, signal) pairs sent after it starts. (rc, stdout, stderr)."""
    p = subprocess.Popen([BIN, "decode", "--checkpoint", ckpt, "--prompts", prompts, "--max-new-tokens",
                          "12" if SANITIZED else "24",
                          "--batch", "6", "--threads", "2", "--output", out, *extra], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    t0 = time.time()
    for delay, sig in signals:
        time.sleep(max(0.0, t0 + delay - time.time()))
        if p.poll() is None:
            p.send_signal(sig)
    o, e = p.communicate(timeout=600)
    return p.returncode, o.decode("utf-8", "replace"), e.decode("utf-8", "replace")


def records(path):
    """The records of --output, checking that every line is whole JSON with an index."""
    out = {}
    data = open(path, "rb").read()
    check(data == b"" or data.endswith(b"\n"), f"{path}: the last line is cut: {data[-80:]!r}")
    for k, line in enumerate(data.split(b"\n")[:-1]):
        try:
            o = json.loads(line)
        except ValueError:
            fail(f"{path} line {k + 1} is not JSON: {line[:120]!r}")
            continue
        if not check(isinstance(o.get("index"), int) and o["index"] not in out, f"{path} line {k + 1}: index {o}"):
            continue
        out[o["index"]] = o
    return out


def content(recs):
    return {k: (o.get("tokens"), o.get("text"), o.get("finish_reason"), o.get("error"), o.get("line"))
            for k, o in recs.items()}


def main():
    os.makedirs(TMP, exist_ok=True)
    ckpt = os.path.join(TMP, "tiny")
    subprocess.run([BIN, "gen", "--preset", "tiny", "--out", ckpt, "--quiet"], check=True)
    rng = random.Random(33)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 14))).encode() for _ in range(16 if SANITIZED else 30)]
    lines[4] = b""                       # skipped: no record, but it counts in the indices
    lines[7] = b"bad \xff\xfe bytes"     # not UTF-8: an error record
    lines[11] = b"nul \x00 byte"         # a NUL byte: an error record
    prompts = os.path.join(TMP, "prompts.txt")
    with open(prompts, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    n_ok = sum(1 for k, ln in enumerate(lines) if ln and k not in (7, 11))

    ref_out = os.path.join(TMP, "ref.jsonl")
    t0 = time.time()
    rc, so, se = decode(ckpt, prompts, ref_out, "--quiet")
    t_full = time.time() - t0
    ref = records(ref_out)
    check(rc == 3, f"uninterrupted run with refused lines: exit {rc} (want 3): {se[-300:]}")
    check(sorted(ref) == [k for k, ln in enumerate(lines) if ln], f"indices {sorted(ref)}")
    check(all("error" in ref[k] for k in (7, 11)) and sum("tokens" in o for o in ref.values()) == n_ok,
          f"error records: {[ref.get(k) for k in (7, 11)]}")
    check(all(o["line"] == k + 1 for k, o in ref.items()), "line numbers")
    out_lines = so.splitlines()
    check(len(out_lines) == n_ok + 2 and all(re.match(r"^\[\d+\] ", x) for x in out_lines),
          f"stdout: {len(out_lines)} lines (want {n_ok + 2}), e.g. {out_lines[:3]}")
    check(re.search(r"^\[7\] error: ", so, re.M) is not None, "stdout: [7] error line")
    print(f"uninterrupted: {len(ref)} records in {t_full:.1f} s")

    trials = [[(0.3, signal.SIGINT)], [(0.5, signal.SIGTERM)], [(0.2, signal.SIGINT), (0.6, signal.SIGINT)],
              [(0.4, signal.SIGTERM), (0.5, signal.SIGTERM)], "cut"]
    if SANITIZED:   # fewer, in a sanitizer build
        trials = [trials[0], trials[3], trials[4]]
    for t, sigs in enumerate(trials):
        out = os.path.join(TMP, f"run{t}.jsonl")
        if sigs == "cut":   # SIGKILL mid-write, as it would look: whole records, then half a line
            data = open(ref_out, "rb").read().split(b"\n")
            with open(out, "wb") as f:
                f.write(b"\n".join(data[:9]) + b"\n" + data[9][:len(data[9]) // 2])
            rc, so, se = 137, "", ""
        else:
            scale = t_full * (0.5 + rng.random())   # somewhere inside the run
            sigs = [(d * scale, s) for d, s in sigs]
            rc, so, se = decode(ckpt, prompts, out, signals=sigs)
            want = 130 if sigs[0][1] == signal.SIGINT else 143
            m = re.search(r"interrupted by (SIG\w+): (\d+) prompts done, (\d+) cancelled, (\d+) not started", se)
            if rc in (3, 0):   # it finished before the signal
                print(f"trial {t}: finished before the signal")
            elif rc in (-signal.SIGINT, -signal.SIGTERM):   # before the step loop: the default action
                check(open(out, "rb").read() == b"", f"trial {t}: killed while loading, yet --output has records")
                print(f"trial {t}: the signal came while the model loaded")
            elif check(rc == want and m is not None, f"trial {t}: exit {rc} (want {want}); stderr {se[-400:]}"):
                got = records(out)
                done = sum(1 for o in got.values() if "tokens" in o)
                check(int(m.group(2)) == done, f"trial {t}: summary says {m.group(2)} done, --output has {done}")
                check(int(m.group(2)) + int(m.group(3)) + int(m.group(4)) == n_ok, f"trial {t}: summary {m.group(0)}")
                if len(sigs) > 1 and int(m.group(4)) + int(m.group(3)) == 0:
                    print(f"trial {t}: the second signal found nothing running")
                print(f"trial {t}: {m.group(0)}")
        for k in range(6):   # resume until done (interrupted again now and then)
            again = [(t_full * rng.random(), signal.SIGINT)] if k == 0 and t % 2 == 0 else []
            rc, so, se = decode(ckpt, prompts, out, "--resume", signals=again)
            records(out)
            if rc == 3:
                break
            # 130 / 143: interrupted in the step loop; -2: by the signal itself, while the model loaded
            check(rc in (130, 143, -signal.SIGINT) and again, f"trial {t} resume {k}: exit {rc}: {se[-300:]}")
        got = records(out)
        check(content(got) == content(ref), f"trial {t}: resumed output differs from the uninterrupted run: "
              f"{sorted(set(got) ^ set(ref))} "
              f"{[k for k in ref if k in got and content(got)[k] != content(ref)[k]][:5]}")
    p = subprocess.run([BIN, "decode", "--checkpoint", "/nonexistent", "--prompt", "hi"], capture_output=True, text=True)
    check(p.returncode == 2 and "no such directory" in p.stderr, f"/nonexistent: {p.returncode} {p.stderr!r}")
    shutil.rmtree(TMP, ignore_errors=True)
    if FAILURES:
        print(f"check_decode_interrupt: {len(FAILURES)} mismatches", file=sys.stderr)
        return 1
    print("check_decode_interrupt: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
