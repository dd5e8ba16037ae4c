#!/usr/bin/env bash
# Logits of this tree against another commit's, byte for byte, for changes meant to keep behaviour
# (refactors; a new option left off): builds BASE's library in a temporary worktree and this tree's
# (CPU only, build-logits/ in each), links tests/py/logits_tool.c (public API only) against both,
# runs its settings on the tiny and demo presets (generated once under $MOEFLOW_TMP or /tmp) and
# compares every file with cmp. Usage: tools/logits-check.sh [BASE] (default origin/main or main).
# Exit 0 when every setting's logits are identical, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
base=${1:-main}
tmp=${MOEFLOW_TMP:-/tmp}/logits-check
rm -rf "$tmp/out-base" "$tmp/out-head"
mkdir -p "$tmp/out-base" "$tmp/out-head"
wt="$tmp/base-tree"
git worktree remove --force "$wt" 2>/dev/null || rm -rf "$wt"
git worktree add --detach "$wt" "$base" >/dev/null
trap 'git -C "$root" worktree remove --force "$wt" >/dev/null 2>&1 || true' EXIT
cp tests/py/logits_tool.c "$wt/tests/py/logits_tool.c"   # the same program against the base library
for t in "$wt" "$root"; do
  cmake -S "$t" -B "$t/build-logits" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEFLOW_CUDA=OFF >/dev/null
  cmake --build "$t/build-logits" --target logits_tool moeflow_cli >/dev/null
done
for p in tiny demo; do
  [ -f "$tmp/$p/config.json" ] || "$root/build-logits/moeflow" gen --preset "$p" --out "$tmp/$p" --quiet
  "$wt/build-logits/logits_tool" "$tmp/$p" "$p" "$tmp/out-base" >/dev/null
  "$root/build-logits/logits_tool" "$tmp/$p" "$p" "$tmp/out-head"
done
bad=0 n=0
for f in "$tmp"/out-base/*.f32; do
  n=$((n + 1))
  if ! cmp -s "$f" "$tmp/out-head/$(basename "$f")"; then echo "DIFFERENT: $(basename "$f")"; bad=1; fi
done
echo "logits-check: $n settings against $base ($(git rev-parse --short "$base")): $([ $bad = 0 ] && echo all identical || echo DIFFERENCES)"
exit $bad
