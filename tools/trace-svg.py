#!/usr/bin/env python3
"""Draws a moeflow timeline (the Chrome trace-event JSON of `moeflow decode --trace FILE` or
`moeflow sim --trace FILE`, written by sched/timeline.c) as an SVG picture: lanes against time,
one row per CPU worker, the IO lane's reads and each card's h2d, compute and d2h streams packed
into as few rows as their overlaps need, every task a box coloured by what it belongs to
(attention, routed experts and their reads, route/gate/combine, shared expert, Engram, head),
the start of each layer's attention marked. Each box carries its task name and duration as a
tooltip. Standard library only.

Usage: python3 tools/trace-svg.py TRACE.json -o OUT.svg [--title TEXT] [--width PX]
                                  [--from-ms T] [--to-ms T] [--max-rows N]
  --from-ms, --to-ms  draw only this window (ms from the trace's first task)
  --max-rows N        rows per packed lane group (IO, each card stream) before overlapping
                      tasks share the last row (default 4)
"""
import argparse
import json
import re
import sys
from xml.sax.saxutils import escape

# (key, legend label, fill colour): Okabe-Ito colours, distinguishable with colour blindness
CATEGORIES = [
    ("attn", "attention (norms, linears, heads, mixes)", "#0072B2"),
    ("expert", "routed experts", "#E69F00"),
    ("read", "expert and Engram reads (IO lane)", "#D55E00"),
    ("route", "gate, route, combine, ffn mix", "#009E73"),
    ("shared", "shared expert", "#CC79A7"),
    ("engram", "Engram", "#F0E442"),
    ("head", "final norm and head", "#555555"),
    ("other", "other", "#AAAAAA"),
]
COLOUR = {k: c for k, _, c in CATEGORIES}


def category(name):
    """What a task belongs to, from its name (graphs/step/stepgraph*.c name the tasks)."""
    n = re.sub(r"^dev\d+\s+", "", name)
    word = n.split()[0] if n.split() else ""
    if word == "read" or (word == "engram" and " read" in n):
        return "read"
    if word in ("expert", "slot") or re.match(r"L\d+ slot ", n) or re.search(r"\bslot \d+", n):
        return "expert"
    if word == "attn" or re.match(r"L\d+ attn", n):
        if re.search(r"\bffn (mix|norm)\b", n):
            return "route"
        return "attn"
    if word == "engram" or re.match(r"L\d+ engram", n):
        return "engram"
    if re.match(r"(L\d+ )?shared", n):
        return "shared"
    if word in ("route", "combine", "ffn", "moe", "gate") or re.match(r"L\d+ gate", n):
        return "route"
    if word in ("final", "head"):
        return "head"
    return "other"


def lane_key(family):
    """Drawing order: CPU lanes, the IO lane, then each card's h2d, compute, d2h."""
    m = re.match(r"dev(\d+)\.(\w+)", family)
    if m:
        return (2, int(m.group(1)), {"h2d": 0, "compute": 1, "d2h": 2}.get(m.group(2), 3), family)
    if family.startswith("cpu"):
        return (0, 0, 0, family)
    return (1, 0, 0, family)


def load(path):
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    tname = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            tname[(e["pid"], e["tid"])] = e["args"]["name"]
    tasks = []
    for e in events:
        if e.get("ph") != "X":
            continue
        lane = tname.get((e["pid"], e["tid"]), f"tid {e['tid']}")
        tasks.append((float(e["ts"]), float(e.get("dur", 0.0)), lane, e["name"]))
    if not tasks:
        sys.exit(f"trace-svg: {path}: no complete ('X') events")
    return tasks


def pack(tasks, max_rows):
    """First-fit rows for tasks (start, dur, ...) so that no two in a row overlap; past
    max_rows the last row takes the rest."""
    ends = []
    placed = []
    for t in sorted(tasks):
        for r, end in enumerate(ends):
            if t[0] >= end:
                ends[r] = t[0] + t[1]
                placed.append((r, t))
                break
        else:
            if len(ends) < max_rows:
                ends.append(t[0] + t[1])
                placed.append((len(ends) - 1, t))
            else:
                ends[-1] = max(ends[-1], t[0] + t[1])
                placed.append((max_rows - 1, t))
    return len(ends), placed


def nice_step(span_ms, n=10):
    raw = span_ms / n
    for m in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000):
        for p in (0.001, 0.01, 0.1, 1, 10, 100):
            if m * p >= raw:
                return m * p
    return raw


def main():
    ap = argparse.ArgumentParser(description="a moeflow --trace file as an SVG timeline")
    ap.add_argument("trace")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("--width", type=int, default=1200)
    ap.add_argument("--from-ms", type=float, default=None)
    ap.add_argument("--to-ms", type=float, default=None)
    ap.add_argument("--max-rows", type=int, default=4)
    a = ap.parse_args()

    tasks = load(a.trace)
    t0 = min(t[0] for t in tasks)
    tasks = [((s - t0) / 1e3, d / 1e3, lane, name) for s, d, lane, name in tasks]   # ms
    lo = a.from_ms if a.from_ms is not None else 0.0
    hi = a.to_ms if a.to_ms is not None else max(s + d for s, d, _, _ in tasks)
    tasks = [t for t in tasks if t[0] + t[1] >= lo and t[0] <= hi]
    if hi <= lo or not tasks:
        sys.exit("trace-svg: nothing in the window")

    # rows: one per CPU worker; the other lanes' slots (io/0..63, devN.h2d/0..3) packed by family
    families = {}
    for t in tasks:
        fam = t[2].split("/")[0]
        families.setdefault(fam, []).append(t)
    rows = []          # (label, [(start, dur, name)])
    for fam in sorted(families, key=lane_key):
        if fam.startswith("cpu"):
            for lane in sorted({t[2] for t in families[fam]}, key=lambda s: int(s.split("/")[-1])
                               if s.split("/")[-1].isdigit() else 0):
                rows.append((f"{lane} (worker)", [t for t in families[fam] if t[2] == lane], fam))
            continue
        n, placed = pack([(s, d, lane, name) for s, d, lane, name in families[fam]], a.max_rows)
        for r in range(n):
            label = fam if r == 0 else ""
            if fam == "io" and r == 0:
                label = "io (reads)"
            rows.append((label, [t for rr, t in placed if rr == r], fam))

    left, right, top = 150, 20, 56
    row_h, gap, fam_gap = 16, 3, 10
    plot_w = a.width - left - right
    scale = plot_w / (hi - lo)

    def x(ms):
        return left + (min(max(ms, lo), hi) - lo) * scale

    y = top
    row_y = []
    prev_fam = None
    for label, _, fam in rows:
        group = fam.split(".")[0]
        if prev_fam is not None and group != prev_fam:
            y += fam_gap
        row_y.append(y)
        y += row_h + gap
        prev_fam = group
    plot_bottom = y
    legend_y = plot_bottom + 50
    height = legend_y + 20 * ((len(CATEGORIES) + 2) // 3) + 10

    out = []
    out.append(f'<svg xmlns="http://www.w3.org/2000/svg" width="{a.width}" height="{height}" '
               f'viewBox="0 0 {a.width} {height}" font-family="sans-serif" font-size="11">')
    out.append(f'<rect width="{a.width}" height="{height}" fill="white"/>')
    if a.title:
        out.append(f'<text x="{left}" y="18" font-size="13" font-weight="bold">{escape(a.title)}</text>')

    # time axis and grid
    step = nice_step(hi - lo)
    k = int(lo / step)
    while k * step <= hi + 1e-9:
        t = k * step
        if t >= lo - 1e-9:
            xx = x(t)
            out.append(f'<line x1="{xx:.1f}" y1="{top - 4}" x2="{xx:.1f}" y2="{plot_bottom}" '
                       f'stroke="#e4e4e4"/>')
            out.append(f'<text x="{xx:.1f}" y="{plot_bottom + 13}" text-anchor="middle" '
                       f'fill="#444">{t:g}</text>')
        k += 1
    out.append(f'<text x="{left + plot_w / 2:.0f}" y="{plot_bottom + 27}" text-anchor="middle" '
               f'fill="#444">ms from the step\'s first task</text>')

    # layer marks: the first attention task of each layer on the CPU lanes
    first = {}
    for s, d, lane, name in tasks:
        m = re.match(r"attn L(\d+) ", name)
        if m and lane.startswith("cpu"):
            L = int(m.group(1))
            first[L] = min(first.get(L, s), s)
    fin = [s for s, d, lane, name in tasks if name.startswith("final ")]
    marks = sorted((s, f"L{L}") for L, s in first.items())
    if fin:
        marks.append((min(fin), "head"))
    for s, label in marks:
        if lo <= s <= hi:
            xx = x(s)
            out.append(f'<line x1="{xx:.1f}" y1="{top - 14}" x2="{xx:.1f}" y2="{plot_bottom}" '
                       f'stroke="#888" stroke-dasharray="3,3"/>')
            out.append(f'<text x="{xx + 2:.1f}" y="{top - 6}" fill="#333">{label}</text>')

    # a bracket beside each packed lane group's rows (tasks in flight at once on one stream)
    spans = {}
    for (label, items, fam), yy in zip(rows, row_y):
        if not fam.startswith("cpu"):
            lo_y, hi_y = spans.get(fam, (yy, yy))
            spans[fam] = (min(lo_y, yy), max(hi_y, yy + row_h))
    for fam, (y0, y1) in spans.items():
        if y1 - y0 > row_h:
            out.append(f'<path d="M{left - 3},{y0 + 1} h-3 V{y1 - 1} h3" fill="none" stroke="#888"/>')

    # rows
    for (label, items, fam), yy in zip(rows, row_y):
        out.append(f'<text x="{left - 9}" y="{yy + row_h - 4}" text-anchor="end" fill="#222">'
                   f'{escape(label)}</text>')
        out.append(f'<rect x="{left}" y="{yy}" width="{plot_w}" height="{row_h}" fill="#f7f7f7"/>')
        for s, d, lane, name in sorted(items):
            x0, x1 = x(s), x(s + d)
            w = max(x1 - x0, 0.6)
            cat = category(name)
            out.append(f'<rect x="{x0:.1f}" y="{yy + 1}" width="{w:.1f}" height="{row_h - 2}" '
                       f'fill="{COLOUR[cat]}" stroke="#222" stroke-width="0.2">'
                       f'<title>{escape(name)} ({lane}): {d * 1e3:.0f} us</title></rect>')

    # legend
    for i, (key, label, colour) in enumerate(CATEGORIES):
        lx = left + (i % 3) * (plot_w / 3)
        ly = legend_y + 20 * (i // 3)
        out.append(f'<rect x="{lx:.0f}" y="{ly - 10}" width="14" height="11" fill="{colour}" '
                   f'stroke="#222" stroke-width="0.3"/>')
        out.append(f'<text x="{lx + 20:.0f}" y="{ly}" fill="#222">{escape(label)}</text>')
    out.append("</svg>")
    with open(a.out, "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"trace-svg: {a.out}: {len(tasks)} tasks on {len(rows)} rows, {hi - lo:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
