#!/usr/bin/env python3
"""`moeflow tune` end to end: the default sweep on the tiny preset with the shipped profile of this
machine tries exactly the combinations its --help promises (card knobs once under host placement,
two micro-batches only for batches of 2 or more),
ranks them by predicted tokens per second, and its best row is what `moeflow sim` predicts for the
same settings (the simulator is deterministic); bad options fail with exit 2 or 1 and a message
naming the option; --real decodes a generated tiny checkpoint and ranks by the measured time.
Exits non-zero on any mismatch. Checks no speed."""
import json
import os
import shutil
import subprocess
import sys

BIN = os.environ.get("MOEFLOW_BIN", "build/moeflow")
TMP = os.path.join(os.environ.get("MOEFLOW_TMP", "/tmp"), f"check_tune_{os.getpid()}")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROFILE = os.path.join(ROOT, "tools", "profiles", "this-machine.prof")
FAILURES = []


def fail(msg):
    FAILURES.append(msg)
    print("MISMATCH:", msg, file=sys.stderr)


def run(args):
    return subprocess.run([BIN] + args, capture_output=True, text=True, timeout=600)


def profile_cards():
    for line in open(PROFILE):
        key = line.split("#")[0].split("=")
        if len(key) == 2 and key[0].strip() == "n_cards":
            return int(key[1])
    return 0


def check_sweep():
    out = run(["tune", "--profile", PROFILE, "--preset", "tiny", "--json", "--steps", "3", "--warmup", "1"])
    if out.returncode != 0:
        fail(f"tune --json exited {out.returncode}: {out.stderr[-400:]}")
        return
    doc = json.loads(out.stdout)
    res = doc["results"]
    cards = profile_cards() > 0
    # threads: the profile's per socket and half of it (when > 1)
    tps = None
    for line in open(PROFILE):
        k = line.split("#")[0].split("=")
        if len(k) == 2 and k[0].strip() == "threads_per_socket":
            tps = int(k[1])
    n_thr = 2 if tps > 1 else 1
    # dense: host, plus cards split by layers and by rows when the profile has cards (every
    # placement); batches 1, 4, 16, the last two with one and two micro-batches
    expect = (1 + 2 * 2) * n_thr * (1 + (2 * 3 * 3 * 2 if cards else 0)) * (3 if cards else 1)
    if len(res) != expect:
        fail(f"{len(res)} settings tried, expected {expect}")
    if [r["rank"] for r in res] != list(range(1, len(res) + 1)):
        fail("ranks are not 1..n")
    tps_list = [r["predicted_tokens_per_s"] for r in res]
    if tps_list != sorted(tps_list, reverse=True):
        fail("results are not ranked by predicted tokens per second")
    seen = set()
    for r in res:
        if r["placement"] not in ("host", "seed", "hybrid"):
            fail(f"placement {r['placement']}")
        if r["dense"] not in (("host", "cards") if cards else ("host",)):
            fail(f"dense {r['dense']}")
        if r["placement"] == "host" and (r["copy_slots"] or r["dev_cache_bytes"]):
            fail(f"host row carries card knobs: {r}")
        if r["dense_split"] not in ("layers", "rows") or (r["dense"] == "host" and r["dense_split"] != "layers"):
            fail(f"dense split {r['dense_split']} with dense {r['dense']}")
        if r["micro_batches"] not in ((1,) if r["batch"] < 2 else (1, 2)):
            fail(f"batch {r['batch']} with {r['micro_batches']} micro-batches")
        key = (r["placement"], r["dense"], r["dense_split"], r["batch"], r["micro_batches"], r["threads_per_socket"],
               r["copy_slots"], r["dev_cache_bytes"], r["cache_policy"])
        if key in seen:
            fail(f"setting tried twice: {key}")
        seen.add(key)
        if not r["predicted_step_s"] > 0 or not 0 < r["bottleneck_busy"] <= 1.0 + 1e-9:
            fail(f"implausible row {r}")
    best = res[0]
    args = ["sim", "--profile", PROFILE, "--preset", "tiny", "--json", "--steps", "3", "--warmup", "1",
            "--placement", best["placement"], "--dense", best["dense"], "--dense-split", best["dense_split"],
            "--batch", str(best["batch"]), "--threads", str(best["threads_per_socket"]),
            "--micro-batches", str(best["micro_batches"])]
    if best["placement"] != "host":
        args += ["--copy-slots", str(best["copy_slots"]), "--dev-cache", str(best["dev_cache_bytes"]),
                 "--cache-policy", best["cache_policy"]]
    sim = run(args)
    if sim.returncode != 0:
        fail(f"sim of the best setting exited {sim.returncode}: {sim.stderr[-300:]}")
        return
    s = json.loads(sim.stdout)
    if abs(s["step_s"] - best["predicted_step_s"]) > 1e-9 * max(1.0, s["step_s"]):
        fail(f"tune's best step {best['predicted_step_s']} s, sim of the same settings {s['step_s']} s")
    print(f"tune: {len(res)} settings, best {best['placement']} batch {best['batch']} "
          f"{best['predicted_tokens_per_s']:.1f} tok/s, sim agrees")


def check_errors():
    cases = [
        (["--batch", "0"], 2, "--batch"),
        (["--placement", "gpu"], 2, "--placement"),
        (["--cache-policy", "fifo"], 2, "--cache-policy"),
        (["--dev-cache", "lots"], 2, "--dev-cache"),
        (["--read-window", "4"], 1, "--store streamed"),
        (["--objective", "speed"], 2, "--objective"),
        (["--real"], 2, "--checkpoint"),
    ]
    for extra, code, word in cases:
        out = run(["tune", "--profile", PROFILE, "--preset", "tiny"] + extra)
        if out.returncode != code or word not in out.stderr:
            fail(f"tune {' '.join(extra)}: exit {out.returncode} (expected {code}), stderr {out.stderr.strip()[:200]!r}")
    out = run(["tune", "--profile", os.path.join(TMP, "missing.prof"), "--preset", "tiny"])
    if out.returncode != 1 or "missing.prof" not in out.stderr:
        fail(f"missing profile: exit {out.returncode}, {out.stderr.strip()[:200]!r}")


def check_real():
    ckpt = os.path.join(TMP, "tiny")
    g = run(["gen", "--preset", "tiny", "--out", ckpt, "--seed", "3"])
    if g.returncode != 0:
        fail(f"gen tiny: {g.stderr[-300:]}")
        return
    places = "host,hybrid" if profile_cards() > 0 else "host"
    out = run(["tune", "--profile", PROFILE, "--checkpoint", ckpt, "--real", "--placement", places,
               "--batch", "1,2", "--steps", "2", "--warmup", "1", "--json"])
    if out.returncode != 0:
        fail(f"tune --real exited {out.returncode}: {out.stderr[-400:]}")
        return
    res = json.loads(out.stdout)["results"]
    # dense: host, cards split by layers, cards split by rows (with cards); batch 2: 1 and 2 micro-batches
    if len(res) != 3 * len(places.split(",")) * (3 if profile_cards() > 0 else 1):
        fail(f"tune --real tried {len(res)} settings")
    meas = [r["measured_tokens_per_s"] for r in res]
    if meas != sorted(meas, reverse=True) or not all(m > 0 for m in meas):
        fail(f"tune --real is not ranked by measured tokens/s: {meas}")
    print(f"tune --real: {len(res)} settings measured")


def main():
    os.makedirs(TMP, exist_ok=True)
    try:
        check_sweep()
        check_errors()
        check_real()
    finally:
        shutil.rmtree(TMP, ignore_errors=True)
    if FAILURES:
        print(f"{len(FAILURES)} mismatches", file=sys.stderr)
        return 1
    print("check_tune: all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
