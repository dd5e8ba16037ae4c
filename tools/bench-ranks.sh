#!/usr/bin/env bash
# Decode on one process against the same split over ranks under mpirun on this machine (TCP on
# loopback), in pairs whose order alternates: decode tokens/s of each, their ratio, and the ranks' boundary and
# logits transfer times (send to receive, p50/p99) as `moeflow decode` reports them; the load average
# beside each pair (docs/pipeline.md, docs/measurements.md "pipeline over ranks").
#   bash tools/bench-ranks.sh [--build DIR] [--checkpoint DIR] [--ranks N] [--layers SPEC] [--batch B]
#                             [--tokens N] [--threads T] [--pairs P]
set -euo pipefail
build=build ckpt=$HOME/.cache/moeflow/demo ranks=2 layers=auto batch=1 tokens=48 threads=2 pairs=4
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$2; shift 2;; --checkpoint) ckpt=$2; shift 2;; --ranks) ranks=$2; shift 2;;
    --layers) layers=$2; shift 2;; --batch) batch=$2; shift 2;; --tokens) tokens=$2; shift 2;;
    --threads) threads=$2; shift 2;; --pairs) pairs=$2; shift 2;;
    *) echo "bench-ranks: unknown option $1" >&2; exit 2;;
  esac
done
bin=$build/moeflow
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tmp=$(mktemp -d "${MOEFLOW_TMP:-/tmp}/bench-ranks.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
common=(decode --checkpoint "$ckpt" --prompt "The house stands on a hill" --batch "$batch"
        --max-new-tokens "$tokens" --ignore-eos --threads "$threads")
rate() { sed -n 's/.*decode [0-9]* tokens (\([0-9.]*\) tokens\/s aggregate).*/\1/p' "$1" | tail -1; }
echo "bench-ranks: $ckpt, batch $batch, $tokens tokens, $threads workers per process; $ranks ranks, layers $layers"
one() { "$bin" "${common[@]}" > /dev/null 2> "$tmp/a"; }
split() {
  mpirun --oversubscribe --mca btl tcp,self --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo -n "$ranks" \
    "$bin" "${common[@]}" --ranks-layers "$layers" > /dev/null 2> "$tmp/b"
}
for p in $(seq 1 "$pairs"); do
  load=$(cut -d' ' -f1-3 /proc/loadavg)
  if [ $((p % 2)) = 1 ]; then one; split; else split; one; fi   # the order alternates
  a=$(rate "$tmp/a") b=$(rate "$tmp/b")
  printf 'pair %d (load %s): one process %s tokens/s, %d ranks %s tokens/s, ratio %.3f\n' "$p" "$load" "$a" \
    "$ranks" "$b" "$(echo "$b / $a" | bc -l)"
  grep -E 'boundaries in|logits messages in' "$tmp/b" | sed 's/^/  /'
done
