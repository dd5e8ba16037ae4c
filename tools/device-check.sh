#!/usr/bin/env bash
# The checks a lent GPU machine runs for the device path (docs/device.md "Device check"): builds for
# the card it finds, runs test_cuda and test_dev_cuda (the CUDA kernels against the host), times the
# FP4 kernel against a d2d copy of the same bytes and a pinned h2d of one expert against the largest
# single copy (`moeflow bench dev`), and tries one decode of the demo model with routed experts on
# the card, written with its trace under $OUT (default ./device-check-out). Budget: under 5 minutes.
# NOT RUN YET: written on a machine without a GPU; its first run on a card is its test.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/device-check-out}"
mkdir -p "$OUT"
log() { echo "[device-check $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
t_start=$(date +%s)
left() { echo $((300 - ($(date +%s) - t_start))); }

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >"$OUT/gpus.txt" 2>&1; then
  log "no GPU visible (nvidia-smi missing or failing): nothing to check"; exit 77
fi
log "cards: $(tr '\n' ';' <"$OUT/gpus.txt")"
# the card's architecture: compute capability from nvidia-smi (e.g. 9.0 -> 90), else "native"
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
archs="${cc:-native}"
log "building for CUDA architectures $archs"
build=build-devcheck
if ! { cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEFLOW_CUDA=ON \
         -DMOEFLOW_CUDA_ARCHS="$archs" && cmake --build "$build" -j "$(nproc)"; } >"$OUT/build.log" 2>&1; then
  log "build FAILED (tail of build.log follows)"; tail -20 "$OUT/build.log" | tee -a "$OUT/summary.txt"; exit 1
fi
rc_all=0
for t in test_cuda test_dev_cuda test_dev test_xcache test_place; do
  timeout 120 "$build/tests/$t" >"$OUT/$t.log" 2>&1; rc=$?
  case $rc in 0) s=PASS ;; 77) s=SKIP ;; *) s="FAIL ($rc)"; rc_all=1 ;; esac
  log "$t: $s ($(tail -1 "$OUT/$t.log"))"
done
log "timing: FP4 matmul vs d2d copy, pinned h2d of an expert vs one large copy"
for tok in 1 8; do
  timeout 60 "$build/moeflow" bench dev --devices cuda:0 --tokens $tok --reps 50 --big-mib 1024 \
    >"$OUT/bench_dev_t$tok.txt" 2>&1 || rc_all=1
  cat "$OUT/bench_dev_t$tok.txt" | tee -a "$OUT/summary.txt"
done
ckpt="${MOEFLOW_DEMO_DIR:-$HOME/.cache/moeflow/demo}"
if [ "$(left)" -gt 90 ]; then
  if ! "$build/moeflow" info "$ckpt" >/dev/null 2>&1; then
    timeout 120 "$build/moeflow" gen --preset demo --out "$ckpt" --seed 1 --force >"$OUT/gen.log" 2>&1
  fi
  # 4 logical cards on one GPU: the device spec would have to name card 0 four times
  for spec in "cuda:0,0,0,0" "cuda"; do
    timeout 60 "$build/moeflow" decode --checkpoint "$ckpt" --prompt "The capital of France is" \
      --max-new-tokens 16 --devices "$spec" --placement hybrid --trace "$OUT/trace_$spec.json" \
      >"$OUT/decode_$spec.txt" 2>&1; rc=$?
    log "decode --devices $spec --placement hybrid: rc $rc: $(tail -1 "$OUT/decode_$spec.txt")"
    [ $rc = 0 ] && break
  done
  timeout 60 "$build/moeflow" decode --checkpoint "$ckpt" --prompt "The capital of France is" \
    --max-new-tokens 16 >"$OUT/decode_host.txt" 2>&1
  log "decode, host placement: $(tail -1 "$OUT/decode_host.txt")"
else
  log "no time left for the demo decode"
fi
log "done in $(( $(date +%s) - t_start )) s; results under $OUT"
exit $rc_all
