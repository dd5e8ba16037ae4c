#!/usr/bin/env bash
# The checks a lent GPU machine runs for the device path (docs/device.md "Measuring a card"): builds
# for the card it finds; runs the CUDA tests against the host kernels (fp32 and int8 FP4 paths,
# quantization bit for bit, the expert FFN) and the emulated-device tests, and test_dev_cuda once
# more under compute-sanitizer when it is installed; times the FP4 kernels (fp32, int8) and the int8
# expert FFN against d2d copies of the same bytes and a pinned h2d of one expert matrix against the
# largest single copy (`moeflow bench dev`, 1, 8, 64 and, time allowing, 512 tokens; the FP8 dense
# linear on its three paths, warp-per-row, tiled and cuBLASLt, at those and at 2,048 and 8,192 tokens,
# target cuBLASLt >= 3x tiled at 2,048 on an H100/H200); decodes the demo model on the host
# and then with routed experts on 4 logical cards of the one GPU (seed and hybrid placements, and
# hybrid with per-layer device graphs), comparing the tokens; then with the dense work on the cards
# (--dense cards: resident dense weights, the dense card kernels), compared with the host's tokens.
# The dense kernels (strided FP8 linear, BF16 and grouped FP8 linears with reference sums, the
# dense FFN phase 1, bf16 rounding, the exact gating), the indexer's scores of a chunk
# (mf_dev_index_scores) and the bf16 pack/unpack of the dense chains' copies are in test_dev_cuda's
# lines and in the startup self-check (test_dev_iscore checks the scores' order on the host);
# `bench dev` times the FP8 and BF16 dense linears, and the FP8 one with each of its two CUDA kernels
# forced (warp-per-row and tiled, mf_dev_lin.path; the tiled one also forced in test_dev_cuda's
# dense lines and in the self-check). The cuBLASLt path (dequantized FP8 linears and FP4 expert FFNs
# by cublasLtMatmul) is in test_dev_cuda's "dense cublaslt" lines against the host (bounds 1e-3 and
# 4e-3: device/dev_check.h) and in the self-check.
# What comes back from a lent machine is at most 8 files, so everything goes into two under $OUT
# (default ./device-check-out): summary.txt (also printed on stdout: the machine, versions, each
# step's result and wall time, the first lines of every failing log, the kernels' relative errors)
# and device-check.tar.gz (every log, trace and listing). Budget: under 5 minutes (every step has a
# timeout inside a 290 s budget). NOT RUN YET on a card: written on machines without a GPU.
# DEVICE_CHECK_BUDGET_S (default 290) replaces the budget, e.g. for --fake on a loaded machine;
# every step's own limit scales with it (budget / 290).
# Options: --fake (or DEVICE_CHECK_FAKE=1) skips the GPU presence check, to try the build and the
# packing on a machine without a GPU (the GPU tests SKIP; bench and decode run on emulated cards);
# --deps auto|system|prefix (or DEVICE_CHECK_DEPS): where the libraries come from: the system's
# pkg-config, or the Debian packages tools/device-prep.sh downloaded into device-prep/, unpacked
# into a private prefix under the build folder (auto: the system when its pkg-config finds them
# all, else the prefix).
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
W="$OUT/device-check"            # the logs, packed into $OUT/device-check.tar.gz at the end
S="$OUT/summary.txt"
rm -rf "$W" "$S" "$OUT/device-check.tar.gz"
mkdir -p "$W"
build=build-devcheck
mods=(liburing hwloc jansson libutf8proc libpcre2-8)
t_start=$(date +%s)
log() { echo "[device-check $(date -u +%H:%M:%S) +$(($(date +%s) - t_start))s] $*" | tee -a "$S"; }
say() { tee -a "$S"; }            # stdin to the summary and stdout
budget="${DEVICE_CHECK_BUDGET_S:-290}"   # more only to try --fake on a slow machine
left() { echo $((budget - ($(date +%s) - t_start))); }
failed=()                         # logs of failing steps, excerpted into the summary
ms_now() { echo $(($(date +%s%N) / 1000000)); }
# run_t LIMIT NAME CMD...: runs CMD with a timeout of at most LIMIT s and the time left, stdout to
# $W/NAME and stderr to $W/NAME.err; sets rc and wall (ms); a failure's logs are excerpted later.
# LIMIT is for the default budget of 290 s and scales with DEVICE_CHECK_BUDGET_S.
run_t() { local lim=$(($1 * budget / 290)) name=$2; shift 2; local l t0; l=$(left); [ "$l" -lt "$lim" ] && lim=$l
  if [ "$lim" -le 5 ]; then echo "not run: no time left in the ${budget} s budget" >"$W/$name"; rc=124; wall=0
  else t0=$(ms_now); timeout -k 5 "$lim" "$@" >"$W/$name" 2>"$W/$name.err"; rc=$?; wall=$(($(ms_now) - t0))
    [ "$rc" = 124 ] && echo "(killed by its ${lim} s timeout)" >>"$W/$name.err"; fi
  case $rc in 0|77) ;; *) failed+=("$name") ;; esac
  return $rc; }
smi() { timeout -k 2 15 nvidia-smi "$@" 2>&1; }
gpu_state() {   # clocks, power, temperature and throttle reasons, one csv line
  [ "$fake" = 1 ] && { echo "(no GPU: --fake)"; return; }
  local q=clocks.sm,clocks.mem,power.draw,temperature.gpu
  # the throttle reasons' field was renamed in newer drivers; an unknown field fails the query
  local n="timeout -k 2 15 nvidia-smi --format=csv,noheader"
  $n --query-gpu=$q,clocks_event_reasons.active 2>/dev/null ||
    $n --query-gpu=$q,clocks_throttle_reasons.active 2>/dev/null || smi --query-gpu=$q --format=csv,noheader; }
# packs $W into the archive and ends the summary; runs however the script ends
finish() {
  local code=$?
  if [ ${#failed[@]} -gt 0 ]; then
    echo "== first lines of each failing step's logs" | say
    local seen=" "
    for f in "${failed[@]}"; do
      case $seen in *" $f "*) continue ;; esac
      seen="$seen$f "
      for g in "$W/$f" "$W/$f.err"; do
        [ -s "$g" ] || continue
        echo "-- ${g#$W/} (first 15 of $(wc -l <"$g") lines, progress bars left out)" | say
        grep -av 'ETA [0-9]*s' "$g" | head -15 | cut -c1-300 | say
      done
    done
  fi
  log "done in $(( $(date +%s) - t_start )) s, exit $code; logs in $OUT/device-check.tar.gz"
  cp "$S" "$W/summary.txt"
  tar -czf "$OUT/device-check.tar.gz" -C "$OUT" device-check &&
    echo "archive: $(du -k "$OUT/device-check.tar.gz" | cut -f1) KiB, $(find "$W" -type f | wc -l) files" | say &&
    rm -rf "$W"
  exit $code
}
trap finish EXIT

echo "== machine" | say
{ echo "host $(hostname), $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME"), kernel $(uname -r), $(nproc) cpus, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)"
  echo "nvcc: $(nvcc --version 2>&1 | grep -m1 release || echo missing)"
  echo "cmake: $(cmake --version 2>&1 | head -1); ninja $(ninja --version 2>&1); gcc: $(gcc --version 2>&1 | head -1)"
  echo "compute-sanitizer: $(compute-sanitizer --version 2>&1 | grep -m1 -i version || echo missing)"
  echo "cuobjdump: $(command -v cuobjdump || echo missing)"
} | say
if [ "$fake" = 1 ]; then
  log "--fake: not looking for a GPU (the GPU tests SKIP; bench and decode on emulated cards)"
  echo "(none: --fake)" >"$W/gpus.txt"
elif ! command -v nvidia-smi >/dev/null 2>&1 || ! smi -L >"$W/gpus.txt"; then
  log "no GPU visible (nvidia-smi missing, failing or hanging): nothing to check"; cat "$W/gpus.txt" | say
  exit 77
fi
log "cards: $(tr '\n' ';' <"$W/gpus.txt")"
cc="" node=""
if [ "$fake" != 1 ]; then
  smi >"$W/nvidia-smi.txt"
  smi -q -d CLOCK,ECC,POWER,PERFORMANCE >"$W/nvidia-smi-q.txt"
  smi --query-gpu=name,driver_version,pci.bus_id,compute_cap,memory.total,ecc.mode.current,mig.mode.current,clocks.max.sm,clocks.max.mem,power.limit \
      --format=csv | say
  cc=$(smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
  bus=$(smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr -d ' ' | tr 'A-F' 'a-f')
  bus=${bus#0000}   # nvidia-smi: 00000000:19:00.0; sysfs: 0000:19:00.0
  node=$(cat "/sys/bus/pci/devices/$bus/numa_node" 2>/dev/null || echo "unknown (no /sys/bus/pci/devices/$bus)")
  log "GPU NUMA node (sysfs): $node; NUMA nodes of the machine: $(ls -d /sys/devices/system/node/node* 2>/dev/null | wc -l)"
  log "GPU state at start: $(gpu_state)"
fi
[[ "$cc" =~ ^[0-9]+$ ]] || cc=90
archs=$cc

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
  cp device-prep/MANIFEST "$W/device-prep-MANIFEST.txt" 2>/dev/null
else
  PKGC=pkg-config
fi
for m in "${mods[@]}"; do
  log "library $m: $("$PKGC" --modversion "$m" 2>&1) in $("$PKGC" --variable=libdir "$m" 2>/dev/null) ($deps)"
done
log "building for CUDA architectures $archs"
rm -f "$build/CMakeCache.txt"   # a fresh configure: the library paths are not taken from an earlier one
run_t 90 cmake.log cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEFLOW_CUDA=ON \
  -DMOEFLOW_CUDA_ARCHS="$archs" "${pc_args[@]}"
log "configure: rc $rc, $wall ms"
[ "$rc" = 0 ] || exit 1
run_t 200 build.log cmake --build "$build" -j "$(nproc)"
log "build: rc $rc, $wall ms"
if [ "$rc" != 0 ]; then
  echo "== build errors (first 30 lines naming an error)" | say
  grep -m30 -iE "error|undefined reference" "$W/build.log" | cut -c1-300 | say
  exit 1
fi
grep -i "warning" "$W/build.log" >"$W/build_warnings.txt" && log "build warnings: $(wc -l <"$W/build_warnings.txt") (first 5 below)" &&
  head -5 "$W/build_warnings.txt" | cut -c1-300 | say
ldd "$build/moeflow" >"$W/ldd_moeflow.txt" 2>&1
log "moeflow loads: $(grep -E 'uring|hwloc|jansson|utf8proc|pcre2|cudart' "$W/ldd_moeflow.txt" | awk '{print $1 " => " $3}' | tr '\n' ';')"
if command -v cuobjdump >/dev/null 2>&1; then
  cuobjdump --list-elf "$build/moeflow" >"$W/cuobjdump_elf.txt" 2>&1
  cuobjdump --list-ptx "$build/moeflow" >"$W/cuobjdump_ptx.txt" 2>&1
  log "embedded machine code: $(grep -c "sm_$archs" "$W/cuobjdump_elf.txt") sm_$archs ELF, $(grep -c . "$W/cuobjdump_elf.txt") ELF in all, $(grep -c "ptx" "$W/cuobjdump_ptx.txt") PTX"
fi

rc_all=0
echo "== tests" | say
for t in test_cuda test_dev_cuda test_dev_kmath test_dev test_dev_iscore test_xcache test_place test_place_dense; do
  # test_place_dense (dense work on emulated cards, the self-check's refusals) writes a demo
  # checkpoint of its own: only with time to spare
  if [ $t = test_place_dense ] && [ "$(left)" -lt 200 ]; then log "$t: not run (time)"; continue; fi
  [ -x "$build/tests/$t" ] || { log "$t: not built"; continue; }
  run_t 90 "$t.log" "$build/tests/$t"
  case $rc in 0) s=PASS ;; 77) s=SKIP ;; *) s="FAIL ($rc)"; rc_all=1 ;; esac
  log "$t: $s in $wall ms ($(tail -1 "$W/$t.log" | cut -c1-200))"
done
# the startup self-check on the card (test_dev_cuda runs mf_dev_selfcheck on every card)
grep -h "self-check" "$W"/test_dev_cuda.log "$W"/test_dev_cuda.err 2>/dev/null | head -3 | say
# the cuBLASLt path's type (its cases are the "dense cublaslt ... rel err" lines below)
grep -h "cuBLASLt path" "$W"/test_dev_cuda.log 2>/dev/null | head -1 | say
grep -h "pinned staging" "$W"/test_*.err 2>/dev/null | sort -u | head -3 | say
# every kernel error line, sorted by the error, then the largest per category
cat "$W/test_dev_cuda.log" "$W/test_cuda.log" 2>/dev/null | grep "rel err" |
  awk 'function num(x) { return x ~ /nan|inf/ ? "1e999" : x }   # a NaN or inf error sorts last
       { line = $0; c = line; sub(/: rel err .*/, "", c); sub(/^card [0-9]+ /, "", c)
         gsub(/ ?T=[0-9]+/, "", c); gsub(/ routing [0-9]+ slot [0-9]+/, "", c)
         v = line; sub(/.*: rel err /, "", v)
         if (v ~ /^h /) { split(v, b, /[ ,]+/); print num(b[2]) "\t" c " (h)\t" line; print num(b[4]) "\t" c " (y)\t" line }
         else print num(v) "\t" c "\t" line }' | sort -g -k1,1 >"$W/kernel_errors.txt"
if [ -s "$W/kernel_errors.txt" ]; then
  echo "== kernel relative errors vs the host, all $(wc -l <"$W/kernel_errors.txt") sorted (error, category, line)" | say
  cut -c1-200 "$W/kernel_errors.txt" | say
  echo "== the largest per category" | say
  awk -F'\t' '{ if (!($2 in m) || $1 + 0 > m[$2] + 0) m[$2] = $1 } END { for (c in m) print m[c] "\t" c }' \
    "$W/kernel_errors.txt" | sort -g | say
fi
if [ "$fake" != 1 ] && command -v compute-sanitizer >/dev/null 2>&1 && [ "$(left)" -gt 150 ]; then
  # API errors not reported: test_dev_cuda makes a 1 PiB cudaMalloc fail on purpose (and checks
  # every call's result itself); memory errors in kernels still fail the run (exit 9)
  run_t 60 memcheck_test_dev_cuda.log compute-sanitizer --tool memcheck --report-api-errors no \
    --error-exitcode 9 "$build/tests/test_dev_cuda"
  [ $rc = 0 ] || rc_all=1
  log "compute-sanitizer memcheck test_dev_cuda: rc $rc in $wall ms ($(grep -m1 "ERROR SUMMARY" "$W/memcheck_test_dev_cuda.log"))"
fi

dev1=cuda:0 dev4=cuda:0,0,0,0 bench_args=(--reps 50 --big-mib 1024)
[ "$fake" = 1 ] && dev1=emu:1 dev4=emu:4 bench_args=(--reps 3 --big-mib 64 --rotate-mib 64 --warm-ms 20)
echo "== bench dev on $dev1: FP4 matmul (fp32, int8) and int8 expert FFN vs d2d copies; pinned h2d vs one large copy" | say
log "GPU state before the benchmark: $(gpu_state)"
# 512 tokens: the dense linear's tiled kernel against the warp-per-row one where prefill chunks run
# (the "tiled / rows" lines measure MF_DEV_LIN_TILED_MIN_TOK's crossover), when the time allows
for tok in 1 8 64 512; do
  if [ $tok = 512 ] && [ "$(left)" -lt 150 ]; then log "bench dev --tokens 512: not run (time)"; continue; fi
  run_t 40 "bench_dev_t$tok.txt" "$build/moeflow" bench dev --devices $dev1 --tokens $tok "${bench_args[@]}" || rc_all=1
  log "bench dev --tokens $tok: rc $rc in $wall ms"
  grep -v '^{' "$W/bench_dev_t$tok.txt" | say
  grep -h "pinned staging" "$W/bench_dev_t$tok.txt.err" | head -1 | say
done
# prefill sizes: the FP8 linear's three paths (warp-per-row, tiled, cuBLASLt on dequantized weights)
# and the dequantization alone (--linears-only; 64 and 512 above report them too); emulated cards
# (--fake) on a small matrix, their host code being no measurement of a card
lin_args=()
[ "$fake" = 1 ] && lin_args=(--rows 256 --cols 1024)
for tok in 2048 8192; do
  if [ "$(left)" -lt 120 ]; then log "bench dev --tokens $tok --linears-only: not run (time)"; continue; fi
  run_t 40 "bench_dev_lin_t$tok.txt" "$build/moeflow" bench dev --devices $dev1 --tokens $tok --linears-only \
    "${bench_args[@]}" "${lin_args[@]}" || rc_all=1
  log "bench dev --tokens $tok --linears-only: rc $rc in $wall ms"
  grep -v '^{' "$W/bench_dev_lin_t$tok.txt" | say
done
log "GPU state after the benchmark: $(gpu_state)"
if grep -qh "pinned staging" "$W"/*.err 2>/dev/null; then log "pinned memory: cudaHostAlloc fallback (the note above)"
elif [[ "$node" =~ ^[0-9]+$ ]] && [ "$node" -ge 0 ]; then log "pinned memory: bound to NUMA node $node (mbind) and cudaHostRegister"
else log "pinned memory: cudaHostAlloc (the card's NUMA node is unknown: $node)"; fi

ckpt="${MOEFLOW_DEMO_DIR:-$HOME/.cache/moeflow/demo}"
echo "== decode of the demo model" | say
# slot counts and tokens/s from a decode's stderr summary
dec_stats() { local e="$W/$1.err" on host tps sum
  # the totals line ("moeflow decode: devices (SPEC, P placement, N cache slots per card) steps: ...")
  sum=$(tr '\r' '\n' <"$e" | grep -a "^moeflow decode: devices (" | tail -1)
  on=$(grep -oE "steps: [0-9]+ expert slots on cards" <<<"$sum" | grep -oE "[0-9]+" | head -1)
  host=$(grep -oE "expert slots on cards, [0-9]+ on the host" <<<"$sum" | grep -oE "[0-9]+" | head -1)
  tps=$(grep -oE "\(([0-9.]+) tokens/s aggregate\)" "$e" | grep -oE "[0-9.]+" | head -1)
  echo "${on:--} ${host:--} ${tps:--}"; }
if [ "$(left)" -gt 60 ]; then
  if [ ! -f "$ckpt/tokenizer.json" ] || ! "$build/moeflow" info "$ckpt" >/dev/null 2>&1; then
    mkdir -p "$(dirname "$ckpt")"
    run_t 90 gen.log "$build/moeflow" gen --preset demo --out "$ckpt" --seed 1 --force
    log "gen --preset demo: rc $rc in $wall ms"
  fi
  args=(decode --checkpoint "$ckpt" --prompt "The capital of France is" --max-new-tokens 16 --ignore-eos)
  run_t 40 decode_host.txt "$build/moeflow" "${args[@]}"
  read -r _ _ tps <<<"$(dec_stats decode_host.txt)"
  log "decode, host placement: rc $rc in $wall ms, $tps tokens/s: $(head -c 200 "$W/decode_host.txt")"
  # per-layer device graphs: the MOEFLOW_DEV_GRAPHS environment variable, and --dev-graphs where
  # this moeflow has that option
  gflag=()
  "$build/moeflow" decode --help 2>&1 | grep -q -- "--dev-graphs" && gflag=(--dev-graphs)
  # 4 logical cards on the one GPU (each with its own streams and expert cache): seed, hybrid
  # (per-slot FFN launches), and hybrid with each layer's device FFNs as one graph per card
  for run in seed:0 hybrid:0 hybrid:1; do
    pl=${run%:*} gr=${run#*:} tag="${run/:/_graphs}" extra=()
    [ "$gr" = 1 ] && extra=("${gflag[@]}")
    MOEFLOW_DEV_GRAPHS=$gr run_t 40 "decode_dev4_$tag.txt" "$build/moeflow" "${args[@]}" \
      --devices $dev4 --placement $pl --trace "$W/trace_dev4_$tag.json" "${extra[@]}"
    [ $rc = 0 ] || rc_all=1
    read -r on host tps <<<"$(dec_stats "decode_dev4_$tag.txt")"
    if [ $rc != 0 ]; then same="FAILED (its log below)"
    elif cmp -s "$W/decode_host.txt" "$W/decode_dev4_$tag.txt"; then same="same tokens as the host"
    else same="tokens differ from the host (the card's int8 kernels match it within tolerance, not bit for bit)"; fi
    log "decode --devices $dev4 --placement $pl, device graphs $gr${extra:+ (${extra[*]})}: rc $rc in $wall ms, expert slots $on on cards and $host on the host, $tps tokens/s; $same: $(head -c 200 "$W/decode_dev4_$tag.txt")"
    if [ "$pl" = seed ] && [ $rc = 0 ] && ! [ "${on:-0}" -gt 0 ] 2>/dev/null; then
      log "FAIL: seed placement ran no expert slot on the cards"; rc_all=1; failed+=("decode_dev4_$tag.txt")
    fi
  done
  # the dense work on the cards (--dense cards: attention linears, gate, shared expert and head
  # resident on the cards, run by the dense card kernels): on emulated cards (--fake) the tokens
  # must equal the host's; on CUDA cards the run must succeed, and its tokens are compared with
  # the host's (expected mostly the same, not guaranteed: fp32 sums in another order can flip a
  # routing choice or a near tie); the bytes each card holds are in the decode's log
  run_t 40 decode_dense.txt "$build/moeflow" "${args[@]}" --devices $dev4 --placement host --dense cards \
    --trace "$W/trace_dense.json"
  [ $rc = 0 ] || rc_all=1
  read -r _ _ tps <<<"$(dec_stats decode_dense.txt)"
  if [ $rc != 0 ]; then
    log "FAIL: decode --devices $dev4 --dense cards: rc $rc (its log below)"; failed+=("decode_dense.txt")
  elif cmp -s "$W/decode_host.txt" "$W/decode_dense.txt"; then
    log "decode --devices $dev4 --dense cards: rc 0 in $wall ms, $tps tokens/s, same tokens as the host"
  elif [ "$fake" = 1 ]; then
    log "FAIL: decode --devices $dev4 --dense cards on emulated cards: tokens differ from the host (must be bit for bit)"
    rc_all=1; failed+=("decode_dense.txt")
  else
    log "decode --devices $dev4 --dense cards: rc 0 in $wall ms, $tps tokens/s; tokens differ from the host (the card kernels match it within tolerance, not bit for bit): $(head -c 200 "$W/decode_dense.txt")"
  fi
  # the dense linears on the cuBLASLt path (--cublaslt dense: every FP8 linear reading bf16 values,
  # on weights dequantized per layer on the copy-in stream): emulated cards give the host's tokens
  # (bit for bit, must), CUDA cards the tensor cores' sums (compared as above); the decode's summary
  # counts the launches that took the path
  run_t 40 decode_dense_lt.txt "$build/moeflow" "${args[@]}" --devices $dev4 --placement host --dense cards \
    --cublaslt dense
  [ $rc = 0 ] || rc_all=1
  ltn=$(tr '\r' '\n' <"$W/decode_dense_lt.txt.err" | grep -aoE "cuBLASLt: [0-9]+ dense linear launches" | tail -1)
  if [ $rc != 0 ]; then
    log "FAIL: decode --dense cards --cublaslt dense: rc $rc (its log below)"; failed+=("decode_dense_lt.txt")
  elif cmp -s "$W/decode_host.txt" "$W/decode_dense_lt.txt"; then
    log "decode --devices $dev4 --dense cards --cublaslt dense: rc 0 in $wall ms, ${ltn:-no count}, same tokens as the host"
  elif [ "$fake" = 1 ]; then
    log "FAIL: decode --dense cards --cublaslt dense on emulated cards: tokens differ from the host (must be bit for bit)"
    rc_all=1; failed+=("decode_dense_lt.txt")
  else
    log "decode --devices $dev4 --dense cards --cublaslt dense: rc 0 in $wall ms, ${ltn:-no count}; tokens differ from the host (tensor-core sums): $(head -c 200 "$W/decode_dense_lt.txt")"
  fi
  grep -ah "dense weights" "$W/decode_dense.txt.err" | head -4 | say
  grep -h "card self-check" "$W"/decode_*.err 2>/dev/null | sort -u | head -4 | say
  # the per-slot and per-layer-graph runs launch the same kernel bodies with the same placement
  if cmp -s "$W/decode_dev4_hybrid_graphs0.txt" "$W/decode_dev4_hybrid_graphs1.txt" && [ -s "$W/decode_dev4_hybrid_graphs0.txt" ]; then
    log "hybrid per-slot and per-layer-graph runs: byte-identical tokens"
  else
    log "FAIL: hybrid per-slot and per-layer-graph runs give different tokens (or none)"; rc_all=1
    failed+=("decode_dev4_hybrid_graphs0.txt" "decode_dev4_hybrid_graphs1.txt")
  fi
else
  log "no time left for the demo decode"; rc_all=1
fi
exit $rc_all
