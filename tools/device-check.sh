#!/usr/bin/env bash
# The checks a lent GPU machine runs for the device path (docs/device.md "Measuring a card"): builds
# for the card it finds; runs the CUDA tests against the host kernels (fp32 and int8 FP4 paths,
# quantization bit for bit, the expert FFN) and the emulated-device tests, and test_dev_cuda once
# more under compute-sanitizer when it is installed; times the FP4 kernels (fp32, int8) and the int8
# expert FFN against d2d copies of the same bytes and a pinned h2d of one expert matrix against the
# largest single copy (`moeflow bench dev`, 1, 8 and 64 tokens); decodes the demo model on the host
# and then with routed experts on 4 logical cards of the one GPU (seed and hybrid placements, and
# hybrid with per-layer device graphs), comparing the tokens. Logs, traces and summary.txt under $OUT (default ./device-check-out).
# Budget: under 5 minutes. NOT RUN YET: written on machines without a GPU; its first run on a card
# is its test.
# Options: --fake (or DEVICE_CHECK_FAKE=1) skips the GPU presence check, to try the build and the
# packing on a machine without a GPU (the GPU tests then SKIP); --deps auto|system|prefix (or
# DEVICE_CHECK_DEPS): where the libraries come from: the system's pkg-config, or the Debian
# packages tools/device-prep.sh downloaded into device-prep/, unpacked into a private prefix under
# the build folder (auto: the system when its pkg-config finds them all, else the prefix).
set -uo pipefail
cd "$(dirname "$0")/.."
fake="${DEVICE_CHECK_FAKE:-0}" deps="${DEVICE_CHECK_DEPS:-auto}"
while [ $# -gt 0 ]; do
  case $1 in
    --fake) fake=1 ;;
    --deps) deps=$2; shift ;;
    *) echo "device-check: unknown option $1 (expected --fake, --deps auto|system|prefix)" >&2; exit 2 ;;
  esac
  shift
done
OUT="${OUT:-$PWD/device-check-out}"
mkdir -p "$OUT"
build=build-devcheck
mods=(liburing hwloc jansson libutf8proc libpcre2-8)
log() { echo "[device-check $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }
t_start=$(date +%s)
left() { echo $((290 - ($(date +%s) - t_start))); }
# runs a command with a timeout of at most the time left; its output to a log
run_t() { local lim=$1 log_f=$2; shift 2; local l; l=$(left); [ "$l" -lt "$lim" ] && lim=$l
  [ "$lim" -le 5 ] && { echo "no time left" >"$log_f"; return 124; }; timeout "$lim" "$@" >"$log_f" 2>"$log_f.err"; }

if [ "$fake" = 1 ]; then
  log "--fake: not looking for a GPU (build and packing only; the GPU tests SKIP)"
  echo "(none: --fake)" >"$OUT/gpus.txt"
elif ! command -v nvidia-smi >/dev/null 2>&1 || ! timeout 20 nvidia-smi -L >"$OUT/gpus.txt" 2>&1; then
  log "no GPU visible (nvidia-smi missing or failing): nothing to check"; exit 77
fi
log "cards: $(tr '\n' ';' <"$OUT/gpus.txt")"
# the card's architecture: compute capability from nvidia-smi (e.g. 9.0 -> 90), else "native"
cc=""
[ "$fake" = 1 ] || cc=$(timeout 20 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
archs="${cc:-90}"
# The libraries: the system's, or the carried packages unpacked into $build/deps (never over /).
# The .pc files' /usr is rewritten to the prefix (so -I and -L point into it and are not taken
# for system folders), pkgconf itself runs through a wrapper that finds its libpkgconf there, and
# CMake records the libraries' folder in the binaries' RUNPATH; LD_LIBRARY_PATH covers the rest.
pc_args=()
if [ "$deps" = auto ]; then
  if command -v pkg-config >/dev/null 2>&1 && pkg-config --exists "${mods[@]}" 2>/dev/null; then deps=system
  else deps=prefix; fi
fi
if [ "$deps" = prefix ]; then
  P="$PWD/$build/deps"
  ls device-prep/*.deb >/dev/null 2>&1 || { log "build FAILED: --deps prefix but no device-prep/*.deb (run tools/device-prep.sh where a registry is reachable, and carry device-prep)"; exit 1; }
  rm -rf "$P"
  mkdir -p "$P"
  for f in device-prep/*.deb; do
    case ${f##*/} in libudev1_*) ldconfig -p 2>/dev/null | grep -q 'libudev\.so\.1 ' && continue ;; esac
    dpkg-deb -x "$f" "$P" || { log "build FAILED: dpkg-deb -x $f"; exit 1; }
  done
  for pc in "$P"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc "$P"/usr/share/pkgconfig/*.pc; do
    [ -f "$pc" ] && sed -i "s|=/usr|=$P/usr|" "$pc"
  done
  mkdir -p "$P/bin"
  printf '#!/bin/sh\nLD_LIBRARY_PATH="%s/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s/usr/bin/pkgconf" "$@"\n' "$P" "$P" >"$P/bin/pkg-config"
  chmod +x "$P/bin/pkg-config"
  export PKG_CONFIG_LIBDIR="$P/usr/lib/x86_64-linux-gnu/pkgconfig:$P/usr/share/pkgconfig" PKG_CONFIG_PATH=""
  export LD_LIBRARY_PATH="$P/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  pc_args=(-DPKG_CONFIG_EXECUTABLE="$P/bin/pkg-config")
  PKGC="$P/bin/pkg-config"
else
  PKGC=pkg-config
fi
for m in "${mods[@]}"; do
  log "library $m: $("$PKGC" --modversion "$m" 2>&1) $("$PKGC" --variable=libdir "$m" 2>/dev/null) ($deps)"
done
log "building for CUDA architectures $archs"
rm -f "$build/CMakeCache.txt"   # a fresh configure: the library paths are not taken from an earlier one
if ! { timeout 90 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEFLOW_CUDA=ON \
         -DMOEFLOW_CUDA_ARCHS="$archs" "${pc_args[@]}" &&
       timeout 200 cmake --build "$build" -j "$(nproc)"; } >"$OUT/build.log" 2>&1; then
  log "build FAILED (tail of build.log follows)"; tail -20 "$OUT/build.log" | tee -a "$OUT/summary.txt"; exit 1
fi
grep -i "warning" "$OUT/build.log" >"$OUT/build_warnings.txt" && log "build warnings: $(wc -l <"$OUT/build_warnings.txt") (build_warnings.txt)"
rc_all=0
for t in test_cuda test_dev_cuda test_dev_kmath test_dev test_xcache test_place; do
  run_t 90 "$OUT/$t.log" "$build/tests/$t"; rc=$?
  case $rc in 0) s=PASS ;; 77) s=SKIP ;; *) s="FAIL ($rc)"; rc_all=1 ;; esac
  log "$t: $s ($(tail -1 "$OUT/$t.log"))"
done
grep -E "rel err" "$OUT/test_dev_cuda.log" | sort -t: -k2 | tail -40 >"$OUT/kernel_errors.txt"
log "kernel relative errors vs the host: kernel_errors.txt ($(wc -l <"$OUT/kernel_errors.txt") lines)"
if command -v compute-sanitizer >/dev/null 2>&1 && [ "$(left)" -gt 150 ]; then
  run_t 60 "$OUT/memcheck_test_dev_cuda.log" compute-sanitizer --tool memcheck --error-exitcode 9 \
    "$build/tests/test_dev_cuda"; rc=$?
  [ $rc = 0 ] || rc_all=1
  log "compute-sanitizer memcheck test_dev_cuda: rc $rc ($(grep -m1 "ERROR SUMMARY" "$OUT/memcheck_test_dev_cuda.log"))"
fi
log "timing: FP4 matmul (fp32, int8) and int8 expert FFN vs d2d copies; pinned h2d vs one large copy"
for tok in 1 8 64; do
  run_t 40 "$OUT/bench_dev_t$tok.txt" "$build/moeflow" bench dev --devices cuda:0 --tokens $tok --reps 50 \
    --big-mib 1024 || rc_all=1
  tee -a "$OUT/summary.txt" <"$OUT/bench_dev_t$tok.txt"
done
ckpt="${MOEFLOW_DEMO_DIR:-$HOME/.cache/moeflow/demo}"
if [ "$(left)" -gt 60 ]; then
  if [ ! -f "$ckpt/tokenizer.json" ] || ! "$build/moeflow" info "$ckpt" >/dev/null 2>&1; then
    mkdir -p "$(dirname "$ckpt")"
    run_t 60 "$OUT/gen.log" "$build/moeflow" gen --preset demo --out "$ckpt" --seed 1 --force
  fi
  args=(decode --checkpoint "$ckpt" --prompt "The capital of France is" --max-new-tokens 16 --ignore-eos --quiet)
  run_t 40 "$OUT/decode_host.txt" "$build/moeflow" "${args[@]}"; rc=$?
  log "decode, host placement: rc $rc: $(head -c 200 "$OUT/decode_host.txt")"
  # 4 logical cards on the one GPU (each with its own streams and expert cache)
  # seed, hybrid, and hybrid with each layer's device FFNs as one CUDA graph per card
  for run in seed:0 hybrid:0 hybrid:1; do
    pl=${run%:*} gr=${run#*:} tag="${run/:/_graphs}"
    MOEFLOW_DEV_GRAPHS=$gr run_t 40 "$OUT/decode_cuda4_$tag.txt" "$build/moeflow" "${args[@]}" \
      --devices cuda:0,0,0,0 --placement $pl --trace "$OUT/trace_cuda4_$tag.json"; rc=$?
    [ $rc = 0 ] || rc_all=1
    if [ $rc = 0 ] && cmp -s "$OUT/decode_host.txt" "$OUT/decode_cuda4_$tag.txt"; then same="same tokens as the host"
    else same="tokens differ from the host (the card's int8 kernels match it within tolerance, not bit for bit)"; fi
    log "decode --devices cuda:0,0,0,0 --placement $pl, device graphs $gr: rc $rc, $same: $(head -c 200 "$OUT/decode_cuda4_$tag.txt")"
  done
else
  log "no time left for the demo decode"
fi
log "done in $(( $(date +%s) - t_start )) s; results under $OUT"
exit $rc_all
