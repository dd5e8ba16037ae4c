#!/usr/bin/env python3
"""Which rates of a hardware profile carry the headline figures: each rate (a key ending in _per_s,
with --latencies also each _ns key) moved by -D and +D (default 20%) in a copy of the profile, the
headline simulations rerun on it, the change printed as a Markdown table (docs/measurements.md
"Sensitivity"). Headline figures (flash41, `moeflow sim`, uniform routing):
  b1   hybrid, dense on cards (rows), batch 1: ms per token (--warmup W, 8 steps)
  b16  the same at batch 16: tokens/s
  b64  the same at batch 64: tokens/s
  ttft hybrid, dense on cards: time to first token of an 8,192-token prompt at --chunk 8192, s
Usage: python3 tools/sensitivity.py [--profile P] [--build DIR] [--delta 0.2] [--warmup 60]
                                    [--keys k1,k2,..] [--latencies] [--jobs N]
The simulator is deterministic (seeded routing), so a row's change is the model's, not noise.
Only the standard library; runs the moeflow binary of --build (default build)."""
import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile

HEADLINES = [
    ("b1", "batch 1 ms/token", ["--placement", "hybrid", "--dense", "cards", "--dense-split", "rows", "--batch", "1"],
     lambda r: r["token_s"] * 1e3, "ms", False),
    ("b16", "batch 16 tokens/s", ["--placement", "hybrid", "--dense", "cards", "--dense-split", "rows", "--batch", "16"],
     lambda r: r["tokens_per_s"], "tok/s", True),
    ("b64", "batch 64 tokens/s", ["--placement", "hybrid", "--dense", "cards", "--dense-split", "rows", "--batch", "64"],
     lambda r: r["tokens_per_s"], "tok/s", True),
    ("ttft", "first token of 8,192, chunk 8192, s",
     ["--placement", "hybrid", "--dense", "cards", "--prompt-tokens", "8192", "--chunk", "8192"],
     lambda r: r["ttft_s"], "s", False),
]


def profile_keys(path, latencies):
    """(key, value text, value) of the profile's rates (and latencies), in file order."""
    keys = []
    for line in open(path):
        body = line.split("#", 1)[0]
        m = re.match(r"\s*([a-z0-9_]+)\s*=\s*(\S+)\s*$", body)
        if not m:
            continue
        key, text = m.group(1), m.group(2)
        if not (key.endswith("_per_s") or (latencies and key.endswith("_ns"))):
            continue
        keys.append((key, text, parse_value(text)))
    return keys


def parse_value(text):
    mult = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 1024.0, "Mi": 1024.0 ** 2, "Gi": 1024.0 ** 3,
            "Ti": 1024.0 ** 4}
    m = re.match(r"([-+0-9.eE]+)([KMGT]i?)?$", text)
    if not m:
        raise ValueError(f"cannot read the value '{text}'")
    return float(m.group(1)) * (mult[m.group(2)] if m.group(2) else 1.0)


def write_variant(src, dst, key, value):
    """src with key's value replaced by value (its comment and source kept)."""
    out = []
    for line in open(src):
        m = re.match(r"(\s*" + re.escape(key) + r"\s*=\s*)(\S+)(.*)$", line.rstrip("\n"))
        if m and not line.lstrip().startswith("#"):
            line = f"{m.group(1)}{value:.9g}{m.group(3)}\n"
        out.append(line)
    with open(dst, "w") as f:
        f.writelines(out)


def run_headlines(binary, prof, warmup):
    vals = {}
    for name, _, args, get, _, _ in HEADLINES:
        cmd = [binary, "sim", "--profile", prof, "--preset", "flash41", "--json"] + args
        if "--prompt-tokens" not in args:
            cmd += ["--warmup", str(warmup)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
        vals[name] = get(json.loads(r.stdout))
    return vals


def cell(base, lo, hi):
    """the change at -D and at +D, in percent of the base figure"""
    pct = lambda v: 100.0 * (v - base) / base if base else 0.0
    a, b = pct(lo), pct(hi)
    if abs(a) < 0.05 and abs(b) < 0.05:
        return "0"
    return f"{a:+.1f}% / {b:+.1f}%"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tools/profiles/seed-host.prof")
    ap.add_argument("--build", default="build")
    ap.add_argument("--delta", type=float, default=0.2)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--keys", default="")
    ap.add_argument("--latencies", action="store_true")
    ap.add_argument("--jobs", type=int, default=2)
    o = ap.parse_args()
    binary = os.path.join(o.build, "moeflow")
    if not os.access(binary, os.X_OK):
        sys.exit(f"sensitivity.py: {binary} not found: build first")
    keys = profile_keys(o.profile, o.latencies)
    if o.keys:
        want = o.keys.split(",")
        keys = [k for k in keys if k[0] in want]
        missing = set(want) - {k[0] for k in keys}
        if missing:
            sys.exit(f"sensitivity.py: {', '.join(sorted(missing))} not in {o.profile}")
    keys = [k for k in keys if k[2] != 0]   # a 0 figure (no such part) stays 0
    tmp = tempfile.mkdtemp(prefix="sens.", dir=os.environ.get("MOEFLOW_TMP") or None)
    jobs = {"base": o.profile}
    for key, _, v in keys:
        for sign, f in (("lo", 1 - o.delta), ("hi", 1 + o.delta)):
            p = os.path.join(tmp, f"{key}.{sign}.prof")
            write_variant(o.profile, p, key, v * f)
            jobs[(key, sign)] = p
    res = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, o.jobs)) as ex:
        futs = {ex.submit(run_headlines, binary, p, o.warmup): j for j, p in jobs.items()}
        for fut in concurrent.futures.as_completed(futs):
            res[futs[fut]] = fut.result()
    for p in jobs.values():
        if p != o.profile:
            os.remove(p)
    os.rmdir(tmp)
    base = res["base"]
    d = round(o.delta * 100)
    print(f"Profile `{o.profile}`, flash41, uniform routing; hybrid with the dense work on the cards (split by "
          f"rows); decode: --warmup {o.warmup} + 8 steps; first token: `--prompt-tokens 8192 --chunk 8192`. "
          f"Each cell: the figure's change with the rate at -{d}% / +{d}% (0: less than 0.05% either way).")
    print()
    print("| rate | value | " + " | ".join(h[1] for h in HEADLINES) + " |")
    print("|---|---|" + "---|" * len(HEADLINES))
    print("| (the profile as it is) | | " + " | ".join(
        f"{base[h[0]]:.2f} {h[4]}" for h in HEADLINES) + " |")
    rows = []
    for key, text, _ in keys:
        lo, hi = res[(key, "lo")], res[(key, "hi")]
        weight = max(abs(lo[h[0]] - base[h[0]]) / base[h[0]] + abs(hi[h[0]] - base[h[0]]) / base[h[0]]
                     for h in HEADLINES)
        rows.append((weight, key, text, [cell(base[h[0]], lo[h[0]], hi[h[0]]) for h in HEADLINES]))
    for _, key, text, cells in sorted(rows, key=lambda r: -r[0]):
        print(f"| `{key}` | {text} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
