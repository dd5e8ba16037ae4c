#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs dependencies, builds the normal configuration
# (CUDA on when nvcc is found), an ASan+UBSan build (CPU only), a TSan build for the
# concurrent parts (scheduler, simulator, IO lane, store, scheduled engine, devices, batcher),
# and a clang libFuzzer build with a short fuzz run; runs ctest in each, and the conformance checks
# against reference Python packages (tests/conformance/run.sh) on the normal build. First, the
# house's size limits (tools/house-check.py: files and functions, a few seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
jobs=$(nproc)
bash tools/install-deps.sh
py=$(bash tools/pyenv.sh)

# each suite's wall time, printed at the end (and the whole run's)
t_all=$(date +%s)
times=()
timed() {  # label, command...
  local label=$1 t0; shift
  t0=$(date +%s)
  "$@"
  times+=("$(printf '%-12s %5d s' "$label" $(( $(date +%s) - t0 )))")
}

run_suite() {  # name, ctest filter, cmake args...
  local dir=$1 filter=$2; shift 2
  echo "=== test.sh: $dir ($*)"
  cmake -S "$root" -B "$root/$dir" -G Ninja -DMOEFLOW_PYTHON="$py" "$@" >/dev/null
  cmake --build "$root/$dir" -j "$jobs"
  local sel=()
  [ -n "$filter" ] && sel=(-R "$filter")
  (cd "$root/$dir" && ctest --output-on-failure -j "$jobs" "${sel[@]}") | tee "$root/$dir/ctest.out"
  # the slowest tests of the suite (each must stay far below its timeout on a busy machine)
  echo "--- $dir: slowest tests"
  grep -E 'Test +#[0-9]+: ' "$root/$dir/ctest.out" | sed -E 's/.* ([^ ]+) \.+ *([A-Za-z*]+.*) +([0-9.]+) sec/  \3 s  \1/' |
    sort -rn | head -5
}

echo "=== test.sh: house (tools/house-check.py: file and function lengths)"
timed house python3 tools/house-check.py
timed build run_suite build "" -DCMAKE_BUILD_TYPE=RelWithDebInfo
echo "=== test.sh: conformance (tests/conformance/run.sh)"
MOEFLOW_BUILD="$root/build" timed conformance bash tests/conformance/run.sh
# ASan+UBSan at -O1 with asserts on (Debug's -O0 made the engine tests 2-3x slower)
timed build-asan run_suite build-asan "" -DCMAKE_BUILD_TYPE=Debug "-DCMAKE_C_FLAGS_DEBUG=-g -O1" \
  -DMOEFLOW_CUDA=OFF "-DMOEFLOW_SANITIZE=address;undefined"
if ls "$root"/tests/test_sched*.c >/dev/null 2>&1; then
  timed build-tsan run_suite build-tsan "sched|sim|step|store|io_lane|test_dev|place|xcache|routing|batch" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEFLOW_CUDA=OFF \
    -DMOEFLOW_SANITIZE=thread
fi
if [ -f "$root/tests/fuzz/CMakeLists.txt" ]; then
  timed build-fuzz run_suite build-fuzz "fuzz" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEFLOW_CUDA=OFF \
    -DCMAKE_C_COMPILER=clang -DMOEFLOW_FUZZ=ON
fi
echo "=== test.sh: wall time per suite (build + tests)"
printf '  %s\n' "${times[@]}"
printf '  %-12s %5d s\n' total $(( $(date +%s) - t_all ))
echo "=== test.sh: all suites passed"
