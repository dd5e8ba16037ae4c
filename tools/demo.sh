#!/usr/bin/env bash
# The README demo: installs what is missing, builds, generates the demo checkpoint if absent (a
# synthetic DeepSeek-V4.1 layout with random weights, 1.4 GiB), and decodes from it with the
# scheduled engine (docs/decode.md). Random weights give random text: the demo shows the machinery
# (load, tokenize, prefill, decode, stream, timing), not a trained model's answer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$(nproc)"
ckpt="${MOEFLOW_DEMO_DIR:-$HOME/.cache/moeflow/demo}"
if [ ! -f "$ckpt/tokenizer.json" ] || ! ./build/moeflow info "$ckpt" >/dev/null 2>&1; then
  ./build/moeflow gen --preset demo --out "$ckpt" --seed 1 --force
fi
./build/moeflow info "$ckpt"
echo
echo "demo: greedy decode of 24 tokens with the scheduled engine (all cores; --engine reference: the fp32 oracle)"
./build/moeflow decode --checkpoint "$ckpt" --prompt "The capital of France is" --max-new-tokens 24
