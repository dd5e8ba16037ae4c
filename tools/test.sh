#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs dependencies, builds the normal configuration
# (CUDA on when nvcc is found), an ASan+UBSan build (CPU only), a TSan build for the
# concurrent parts (scheduler, simulator, IO lane, store, scheduled engine, devices, batcher),
# and a clang libFuzzer build with a short fuzz run; runs ctest in each, and the conformance checks
# against reference Python packages (tests/conformance/run.sh) on the normal build.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
jobs=$(nproc)
bash tools/install-deps.sh
py=$(bash tools/pyenv.sh)

run_suite() {  # name, ctest filter, cmake args...
  local dir=$1 filter=$2; shift 2
  echo "=== test.sh: $dir ($*)"
  cmake -S "$root" -B "$root/$dir" -G Ninja -DMOEFLOW_PYTHON="$py" "$@" >/dev/null
  cmake --build "$root/$dir" -j "$jobs"
  if [ -n "$filter" ]; then
    (cd "$root/$dir" && ctest --output-on-failure -j "$jobs" -R "$filter")
  else
    (cd "$root/$dir" && ctest --output-on-failure -j "$jobs")
  fi
}

run_suite build "" -DCMAKE_BUILD_TYPE=RelWithDebInfo
echo "=== test.sh: conformance (tests/conformance/run.sh)"
MOEFLOW_BUILD="$root/build" bash tests/conformance/run.sh
run_suite build-asan "" -DCMAKE_BUILD_TYPE=Debug -DMOEFLOW_CUDA=OFF \
  "-DMOEFLOW_SANITIZE=address;undefined"
if ls "$root"/tests/test_sched*.c >/dev/null 2>&1; then
  run_suite build-tsan "sched|sim|step|store|io_lane|test_dev|place|xcache|routing|batch" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEFLOW_CUDA=OFF \
    -DMOEFLOW_SANITIZE=thread
fi
if [ -f "$root/tests/fuzz/CMakeLists.txt" ]; then
  run_suite build-fuzz "fuzz" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEFLOW_CUDA=OFF \
    -DCMAKE_C_COMPILER=clang -DMOEFLOW_FUZZ=ON
fi
echo "=== test.sh: all suites passed"
