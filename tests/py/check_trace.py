"""Validates moeflow's Chrome trace-event export against the trace-event format: trace_tool
(tests/py/trace_tool.c) writes the JSON of a synthetic multi-lane graph, once simulated and once
run for real by the executor; this checks required keys per phase, that every track is named,
that slices on one track never overlap, and that flow arrows pair up. Exit 1 on any violation."""
import json
import os
import subprocess
import sys


def main():
    build = os.environ["MOEFLOW_BUILD"]
    tmp = os.environ.get("MOEFLOW_TMP", "/tmp")
    tool = os.path.join(build, "tests", "trace_tool")
    if not os.path.exists(tool):
        tool = os.path.join(build, "trace_tool")
    failed = 0
    for mode in ("sim", "real"):
        path = os.path.join(tmp, f"check_trace_{mode}.json")
        out = subprocess.run([tool, path, "12", mode], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"trace_tool {mode} failed:\n{out.stderr}")
            failed = 1
            continue
        n_tasks, n_edges = map(int, out.stdout.split())
        failed |= check(path, mode, n_tasks, n_edges)
    return failed


def check(path, mode, n_tasks, n_edges):

    errors = []
    with open(path) as f:
        doc = json.load(f)
    if doc.get("displayTimeUnit") not in ("ns", "ms"):
        errors.append(f"displayTimeUnit is {doc.get('displayTimeUnit')!r}")
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        print(f"{path}: traceEvents is not a list")
        return 1

    named_tids, used_tids, processes = set(), set(), set()
    flows = {}
    n_x = 0
    for i, ev in enumerate(events):
        ph = ev.get("ph")
        where = f"event {i} ({ev.get('name')!r}, ph {ph!r})"
        for key in ("name", "ph", "pid", "tid"):
            if key not in ev:
                errors.append(f"{where}: no '{key}'")
        if not isinstance(ev.get("pid"), int) or not isinstance(ev.get("tid"), int):
            errors.append(f"{where}: pid/tid must be integers")
        if ph == "M":
            args = ev.get("args", {})
            if ev["name"] not in ("process_name", "thread_name", "thread_sort_index",
                                  "process_sort_index"):
                errors.append(f"{where}: unknown metadata name")
            if ev["name"] == "thread_name":
                if not isinstance(args.get("name"), str) or not args["name"]:
                    errors.append(f"{where}: thread_name without args.name")
                named_tids.add((ev["pid"], ev["tid"]))
            if ev["name"] == "process_name":
                processes.add(ev["pid"])
        elif ph == "X":
            n_x += 1
            ts, dur = ev.get("ts"), ev.get("dur")
            if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)):
                errors.append(f"{where}: ts/dur missing or not numbers")
            elif ts < 0 or dur < 0:
                errors.append(f"{where}: negative ts {ts} or dur {dur}")
            args = ev.get("args", {})
            for key in ("task", "cost_estimate_ns", "status"):
                if key not in args:
                    errors.append(f"{where}: args lack '{key}'")
            used_tids.add((ev["pid"], ev["tid"]))
        elif ph in ("s", "f"):
            for key in ("id", "ts", "cat"):
                if key not in ev:
                    errors.append(f"{where}: no '{key}'")
            if ph == "f" and ev.get("bp") != "e":
                errors.append(f"{where}: flow end without bp 'e'")
            pair = flows.setdefault(ev.get("id"), {})
            if ph in pair:
                errors.append(f"{where}: second '{ph}' for flow id {ev.get('id')}")
            pair[ph] = ev
            used_tids.add((ev["pid"], ev["tid"]))
        else:
            errors.append(f"{where}: unexpected phase")

    for pid_tid in sorted(used_tids - named_tids):
        errors.append(f"track pid {pid_tid[0]} tid {pid_tid[1]} has events but no thread_name")
    for pid, _ in used_tids:
        if pid not in processes:
            errors.append(f"pid {pid} has no process_name")
    for fid, pair in flows.items():
        if set(pair) != {"s", "f"}:
            errors.append(f"flow id {fid}: has only {sorted(pair)}")
            continue
        s, f = pair["s"], pair["f"]
        if (s["cat"], s["name"]) != (f["cat"], f["name"]):
            errors.append(f"flow id {fid}: s and f differ in cat/name")
        if f["ts"] < s["ts"]:
            errors.append(f"flow id {fid}: f at {f['ts']} before s at {s['ts']}")
    if n_x != n_tasks:
        errors.append(f"{n_x} X events for {n_tasks} tasks")
    if len(flows) != n_edges:
        errors.append(f"{len(flows)} flows for {n_edges} dependencies")

    # Slices on one track must not overlap (one track per worker slot).
    by_track = {}
    for ev in events:
        if ev.get("ph") == "X":
            by_track.setdefault((ev["pid"], ev["tid"]), []).append((ev["ts"], ev["ts"] + ev["dur"]))
    for track, spans in by_track.items():
        spans.sort()
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            if b0 < a1 - 1e-6:
                errors.append(f"track {track}: slices [{a0},{a1}) and [{b0},{b1}) overlap")
                break

    for e in errors[:30]:
        print(f"{path}: {e}")
    print(f"check_trace {mode}: {len(events)} events, {n_x} slices, {len(flows)} flows, "
          f"{len(named_tids)} tracks, {len(errors)} violations")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
