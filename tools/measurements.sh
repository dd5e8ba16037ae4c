#!/usr/bin/env bash
# Regenerates the tables of docs/measurements.md: (1) V4.1-Flash (the flash41 preset's config, no
# checkpoint needed) simulated on the seed host's profile under each placement and batch, with the
# lane that bounds each; (2) the simulator against real decoding of the demo model on this machine
# (`moeflow sim --measure`, every placement, --runs times each, medians); (3) the simulator on a
# machine it has not seen: `moeflow calibrate` here, then simulate and measure on that fresh
# profile, --rounds times (each round calibrates again), the ratio per phase. Prints Markdown.
# Usage: bash tools/measurements.sh [--build DIR] [--runs N (default 5)] [--rounds N (default 3)]
#                                   [--fifo] [--skip-measure] [--fresh-only (part 3 alone)]
# --fifo runs calibrate and the measured decodes under `chrt -f 10` (root only): on a shared
# machine the other processes then cannot take the cores in the middle of a timing.
# Needs a built moeflow (default build/moeflow); part 2 needs the demo checkpoint
# (~/.cache/moeflow/demo, `bash tools/demo.sh` makes it) and a quiet machine (it says the load).
set -euo pipefail
cd "$(dirname "$0")/.."
build=build runs=5 rounds=3 measure=1 rt= fresh_only=0
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --fifo) rt="chrt -f 10"; shift ;;
    --fresh-only) fresh_only=1; shift ;;
    --skip-measure) measure=0; shift ;;
    -h|--help) sed -n 2,13p "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "measurements.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
bin=$build/moeflow
[ -x "$bin" ] || { echo "measurements.sh: $bin not found: build first (cmake --build $build)" >&2; exit 1; }
seed=tools/profiles/seed-host.prof here=tools/profiles/this-machine.prof
demo=${MOEFLOW_DEMO_DIR:-$HOME/.cache/moeflow/demo}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# one JSON line per run -> a Markdown row (python3: only the standard library)
row() {  # label, json file
  python3 - "$1" "$2" <<'EOF'
import json, sys
label, path = sys.argv[1], sys.argv[2]
r = json.load(open(path))
ph = r["phases"]
lanes = {l["name"]: l for l in r["lanes"]}
b = lanes[r["bottleneck"]]
h2d = sum(l["work_s"] for l in r["lanes"] if l["name"].endswith(".h2d"))
slots = r["dev_slots"] + r["host_slots"]
card = f"{100 * r['dev_slots'] / slots:.0f}%" if slots else "-"
hits = r["dev_hits"] + r["dev_misses"]
hit = f"{100 * r['dev_hits'] / hits:.0f}%" if hits else "-"
print(f"| {label} | {r['token_s'] * 1e3:.1f} | {r['tokens_per_s']:.2f} | {ph['attention stack'] * 1e3:.0f} | "
      f"{ph['MoE'] * 1e3:.0f} | {ph['Engram'] * 1e3:.0f} | {ph['norm + head'] * 1e3:.0f} | {ph['other'] * 1e3:.0f} | "
      f"{card} | {hit} | {h2d * 1e3:.0f} | {r['bottleneck']} {100 * b['busy']:.0f}% |")
EOF
}

if [ $fresh_only = 0 ]; then
warm=60   # steps before the 8 reported: the card caches (4 x 22 GiB) and the store fill first
echo "## V4.1-Flash on the seed host, simulated ($seed, flash41 config, uniform routing, $warm warm-up + 8 steps)"
echo
echo "| setting | ms/token | tokens/s | attention ms | MoE ms | Engram ms | head ms | other ms | slots on cards | card cache hits | h2d work ms/step | bottleneck (busy) |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
for batch in 1 16; do
  for place in host seed hybrid; do
    "$bin" sim --profile $seed --preset flash41 --placement $place --dense host --batch $batch --warmup $warm --json >"$tmp/s.json"
    row "$place, batch $batch" "$tmp/s.json"
  done
done
# batch 64, and the dense work (attention linears, gate, shared expert, head) on the cards
for place in host hybrid; do
  "$bin" sim --profile $seed --preset flash41 --placement $place --dense host --batch 64 --warmup $warm --json >"$tmp/s.json"
  row "$place, batch 64" "$tmp/s.json"
done
# the dense work on the cards by layer ranges (--dense-split layers), then split by rows across
# all four (rows, the default), with uniform and zipf:1.0 routing
for split in layers rows; do
  for batch in 1 16 64; do
    for place in host hybrid; do
      "$bin" sim --profile $seed --preset flash41 --placement $place --dense cards --dense-split $split --batch $batch \
        --warmup $warm --json >"$tmp/s.json"
      row "$place, dense on cards ($split), batch $batch" "$tmp/s.json"
    done
  done
done
for batch in 1 16 64; do
  for place in host hybrid; do
    "$bin" sim --profile $seed --preset flash41 --placement $place --dense cards --dense-split rows --batch $batch \
      --routing zipf:1.0 --warmup $warm --json >"$tmp/s.json"
    row "$place, dense on cards (rows), batch $batch, zipf:1.0" "$tmp/s.json"
  done
done
# two micro-batches in flight (one half's MoE beside the other's attention), and zipf:1.0 routing
for batch in 16 64; do
  for place in host hybrid; do
    "$bin" sim --profile $seed --preset flash41 --placement $place --dense cards --batch $batch --micro-batches 2 \
      --warmup $warm --json >"$tmp/s.json"
    row "$place, dense on cards (rows), batch $batch, 2 micro-batches" "$tmp/s.json"
  done
  for micro in 1 2; do
    "$bin" sim --profile $seed --preset flash41 --placement hybrid --dense cards --batch $batch --micro-batches $micro \
      --routing zipf:1.0 --warmup $warm --json >"$tmp/s.json"
    row "hybrid, dense on cards (rows), batch $batch, $micro micro-batch(es), zipf:1.0 routing" "$tmp/s.json"
  done
done
"$bin" sim --profile $seed --preset flash41 --placement host --store streamed --store-budget 64G --warmup $warm \
  --json >"$tmp/s.json"
row "host, batch 1, experts streamed from the SMR disk through a 64 GiB store" "$tmp/s.json"
echo

fi

[ $measure = 1 ] || exit 0
if ! "$bin" info "$demo" >/dev/null 2>&1; then
  echo "(part 2 skipped: no valid demo checkpoint at $demo; bash tools/demo.sh makes it)"
  exit 0
fi
if [ $fresh_only = 0 ]; then
echo "## Simulated vs measured on this machine (demo model, $here, batch 1, 16 steps, $runs runs each)"
echo
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| placement | predicted ms/token | measured ms/token (runs) | median | predicted / measured |"
echo "|---|---|---|---|---|"
for place in host seed hybrid; do
  : >"$tmp/m.txt"
  for i in $(seq "$runs"); do
    $rt "$bin" sim --profile $here --checkpoint "$demo" --placement $place --steps 16 --measure --json >"$tmp/m.json"
    python3 -c "import json,sys; r=json.load(open('$tmp/m.json')); print(r['token_s']*1e3, r['measured_token_s']*1e3)" >>"$tmp/m.txt"
  done
  python3 - "$place" "$tmp/m.txt" <<'EOF'
import statistics, sys
place, path = sys.argv[1], sys.argv[2]
rows = [tuple(map(float, l.split())) for l in open(path) if l.strip()]
pred = rows[0][0]
meas = [m for _, m in rows]
med = statistics.median(meas)
print(f"| {place} | {pred:.2f} | {', '.join(f'{m:.2f}' for m in meas)} | {med:.2f} | {pred / med:.3f} |")
EOF
done
echo
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
fi

# (3) calibrate, then simulate and measure on the fresh profile (host placement, batch 1), per phase.
# busy: cores' worth of CPU other processes used while the round ran (/proc/stat less this shell's
# children).
cpu_busy() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9}' /proc/stat; }
own_cpu() { awk '{print $14+$15+$16+$17}' /proc/$$/stat; }
echo
echo "## The simulator on a freshly calibrated profile (demo model, host placement, batch 1, 16 steps, $rounds rounds${rt:+, under $rt})"
echo
echo 'Each round: `moeflow calibrate --out fresh.prof`, then `moeflow sim --profile fresh.prof --placement host --steps 16 --measure`.'
echo
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "| round | busy (other processes, cores) | predicted ms/token | measured | predicted / measured | attention | MoE | Engram | norm + head | measured other ms |"
echo "|---|---|---|---|---|---|---|---|---|---|"
: >"$tmp/rounds.txt"
hz=$(getconf CLK_TCK)
for i in $(seq "$rounds"); do
  b0=$(cpu_busy) s0=$(own_cpu) t0=$(date +%s.%N)
  $rt "$bin" calibrate --out "$tmp/fresh.prof" >/dev/null 2>"$tmp/cal.err" || { cat "$tmp/cal.err" >&2; exit 1; }
  $rt "$bin" sim --profile "$tmp/fresh.prof" --checkpoint "$demo" --placement host --steps 16 --measure --json \
    >"$tmp/f.json"
  b1=$(cpu_busy) s1=$(own_cpu) t1=$(date +%s.%N)
  busy=$(python3 -c "print(f'{max(0, (($b1 - $b0) - ($s1 - $s0)) / $hz / ($t1 - $t0)):.2f}')")
  python3 - "$i" "$busy" "$tmp/f.json" <<'EOF' | tee -a "$tmp/rounds.txt"
import json, sys
i, busy, path = sys.argv[1], sys.argv[2], sys.argv[3]
r = json.load(open(path))
p, m = r["phases"], r["measured_phases"]
cells = " | ".join(f"{p[q] / m[q]:.2f}" if m[q] > 0 else "-" for q in ("attention stack", "MoE", "Engram", "norm + head"))
print(f"| {i} | {busy} | {r['token_s'] * 1e3:.2f} | {r['measured_token_s'] * 1e3:.2f} | {r['ratio']:.3f} | {cells} | "
      f"{m['other'] * 1e3:.2f} |")
EOF
done
python3 - "$tmp/rounds.txt" <<'EOF'
import statistics, sys
rows = [[c.strip() for c in l.strip().strip("|").split("|")] for l in open(sys.argv[1]) if l.strip()]
med = lambda k: statistics.median(float(r[k]) for r in rows if r[k] != "-")
print(f"| median | {med(1):.2f} | {med(2):.2f} | {med(3):.2f} | {med(4):.3f} | " +
      " | ".join(f"{med(k):.2f}" for k in (5, 6, 7, 8)) + f" | {med(9):.2f} |")
EOF
echo
echo "(phase columns: predicted / measured per phase of the step; the measured other is the engine's work outside"
echo "the graph, which the simulator does not model.)"
echo
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
