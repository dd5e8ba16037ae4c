"""tools/trace-svg.py against moeflow's own traces: trace_tool (tests/py/trace_tool.c) writes the
Chrome trace-event JSON of a synthetic multi-lane graph, once simulated and once run for real by
the executor; the script draws each as SVG, and this checks that the SVG parses as XML and holds
one box per task, each box's tooltip naming its task and lane, every box inside the plot, and a
labelled row for every lane of the trace. Exit 1 on any violation."""
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

SVG = "{http://www.w3.org/2000/svg}"


def main():
    build = os.environ["MOEFLOW_BUILD"]
    tmp = os.environ.get("MOEFLOW_TMP", "/tmp")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "tools", "trace-svg.py")
    tool = os.path.join(build, "trace_tool")
    failed = 0
    for mode in ("sim", "real"):
        trace = os.path.join(tmp, f"check_trace_svg_{mode}.json")
        svg = os.path.join(tmp, f"check_trace_svg_{mode}.svg")
        out = subprocess.run([tool, trace, "12", mode], capture_output=True, text=True)
        if out.returncode != 0:
            print(f"trace_tool {mode} failed:\n{out.stderr}")
            failed = 1
            continue
        out = subprocess.run([sys.executable, script, trace, "-o", svg, "--title", f"check {mode}"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            print(f"trace-svg.py {mode} failed:\n{out.stdout}{out.stderr}")
            failed = 1
            continue
        failed |= check(trace, svg, mode)
    return failed


def check(trace, svg, mode):
    errors = []
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    tasks = [(e["name"], lanes[(e["pid"], e["tid"])]) for e in events if e.get("ph") == "X"]

    doc = ET.parse(svg).getroot()
    width = float(doc.get("width"))
    boxes = []
    for r in doc.iter(f"{SVG}rect"):
        t = r.find(f"{SVG}title")
        if t is not None:
            boxes.append((r, t.text))
    if len(boxes) != len(tasks):
        errors.append(f"{len(boxes)} boxes for {len(tasks)} tasks")
    drawn = sorted(re.sub(r": [0-9]+ us$", "", text) for _, text in boxes)
    want = sorted(f"{name} ({lane})" for name, lane in tasks)
    if drawn != want:
        missing = sorted(set(want) - set(drawn))[:5]
        errors.append(f"the boxes' tooltips do not name the trace's tasks (missing e.g. {missing})")
    left = min((float(r.get("x")) for r, _ in boxes), default=0.0)
    for r, text in boxes:
        x, w = float(r.get("x")), float(r.get("width"))
        if x < left - 1e-6 or x + w > width + 1e-6 or w <= 0:
            errors.append(f"box '{text}' at x {x} width {w} outside the plot (0..{width})")
            break
    labels = {t.text for t in doc.iter(f"{SVG}text")}
    for lane in set(lanes.values()):
        family = lane.split("/")[0]
        if not any(l and (l.startswith(lane) or l.startswith(family)) for l in labels):
            errors.append(f"no row labelled for lane {lane}")

    for e in errors[:20]:
        print(f"{svg}: {e}")
    print(f"check_trace_svg {mode}: {len(tasks)} tasks, {len(boxes)} boxes, "
          f"{len(set(lanes.values()))} lanes, {len(errors)} violations")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
