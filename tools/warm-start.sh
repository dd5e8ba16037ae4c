#!/usr/bin/env bash
# Start-up of `moeflow decode`, cold (the page cache dropped) against warm, for the ways the weights
# can be held (docs/io.md, "Resident weights that outlive the process"): each run's time from the
# process's start to its first token, its decode tokens/s, the bytes it read from the block device
# (/proc/PID/io read_bytes through /usr/bin/time's %I, and the device's /sys/block/DEV/stat delta,
# which counts every process on the machine), and its memory (RssAnon: its own; RssFile: the
# mapped page cache). Runs alternate between the ways, so that the machine's load falls on each.
# Needs root (drop_caches; --throttle: a blkio cgroup, v1).
#
#   tools/warm-start.sh --checkpoint DIR [--runs 3] [--ways "mapped copied store"]
#                       [--throttle BYTES_PER_S] [--nice N] [--bin build/moeflow] [-- decode args]
# ways: mapped (the default: --weights mapped), copied (--weights copied: a private copy read
# buffered), store (--weights copied --store resident: what a checkpoint over 64 GiB took before,
# experts and tables read with O_DIRECT into the process), streamed (--weights copied --store
# streamed: what a checkpoint larger than the memory took before; mapped falls back to it). --throttle caps the device's read rate
# for the runs (e.g. 284164096 = 271 MiB/s, the seed host's disk). --nice -20 runs them ahead of
# the machine's other processes (in a session of their own, whose autogroup gets that nice too:
# on a shared VM what is measured is then the run's own time).
set -euo pipefail
ckpt= runs=3 ways="mapped copied store" throttle= bin=build/moeflow nice=0
while [ $# -gt 0 ]; do
  case "$1" in
    --checkpoint) ckpt=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --ways) ways=$2; shift 2 ;;
    --throttle) throttle=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --nice) nice=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "warm-start.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$ckpt" ] || { echo "warm-start.sh: --checkpoint DIR is required" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "warm-start.sh: needs root (drop_caches)" >&2; exit 2; }
extra=("$@")
[ ${#extra[@]} -gt 0 ] || extra=(--tokens 11,523,77,1900 --max-new-tokens 16 --ignore-eos)
dev=$(df --output=source "$ckpt" | tail -1); dev=${dev#/dev/}; dev=${dev%%[0-9]*}
[ -r /sys/block/$dev/stat ] || dev=$(lsblk -no pkname "$(df --output=source "$ckpt" | tail -1)" 2>/dev/null || true)
cg=
if [ -n "$throttle" ]; then
  cg=/sys/fs/cgroup/blkio/moeflow-warm-start.$$
  mkdir "$cg"
  echo "$(cat /sys/block/$dev/dev) $throttle" > "$cg/blkio.throttle.read_bps_device"
  trap 'rmdir "$cg" 2>/dev/null || true' EXIT
fi
args_of() {
  case "$1" in
    mapped) echo "--weights mapped" ;;
    copied) echo "--weights copied" ;;
    store) echo "--weights copied --store resident" ;;
    streamed) echo "--weights copied --store streamed" ;;
  esac
}
echo "nice $nice; checkpoint $ckpt on /dev/$dev ($(cat /sys/block/$dev/queue/rotational 2>/dev/null | sed 's/1/rotational/;s/0/not rotational/')), $(nproc) CPUs, $(free -g | awk '/Mem:/{print $2}') GiB RAM, load $(cut -d' ' -f1-3 /proc/loadavg)${throttle:+, reads throttled to $throttle B/s}"
printf "%-7s %-5s %4s %9s %10s %11s %11s %8s %8s\n" way start run ttft_s decode_t/s proc_rd_MiB dev_rd_MiB anon_GiB file_GiB
one() {   # way cold|warm run
  local way=$1 mode=$2 k=$3 out s0 s1
  [ "$mode" = cold ] && { sync; echo 3 > /proc/sys/vm/drop_caches; }
  s0=$(awk '{print $3}' /sys/block/$dev/stat)
  # shellcheck disable=SC2046
  # a session of its own (its own autogroup: the scheduler shares the CPUs between sessions first),
  # that session's nice and the process's
  out=$( { /usr/bin/time -f "TIME %I" setsid -w sh -c '[ -n "$1" ] && echo $$ > "$1/tasks"; echo "$2" > /proc/$$/autogroup;
           shift 2; exec "$@"' sh "$cg" "$nice" nice -n "$nice" "$bin" decode --checkpoint "$ckpt" $(args_of "$way") \
           "${extra[@]}" > /dev/null; } 2>&1 )
  s1=$(awk '{print $3}' /sys/block/$dev/stat)
  local ttft tps inb anon file
  ttft=$(sed -n 's/.*first token \([0-9.]*\) s after the process started.*/\1/p' <<<"$out")
  tps=$(sed -n 's/.*decode [0-9]* tokens (\([0-9.]*\) tokens\/s aggregate.*/\1/p' <<<"$out")
  inb=$(sed -n 's/^TIME \([0-9]*\)$/\1/p' <<<"$out")
  anon=$(sed -n 's/.*memory: \([0-9.]*\) GiB of the process.*/\1/p' <<<"$out")
  file=$(sed -n 's/.*(RssAnon), \([0-9.]*\) GiB of files.*/\1/p' <<<"$out")
  printf "%-7s %-5s %4d %9s %10s %11d %11d %8s %8s\n" "$way" "$mode" "$k" "${ttft:-?}" "${tps:-?}" $(( ${inb:-0} * 512 / 1048576 )) \
    $(( (s1 - s0) * 512 / 1048576 )) "${anon:-?}" "${file:-?}"
  [ -n "$ttft" ] || { echo "$out" | tail -5 >&2; }
}
for k in $(seq 1 "$runs"); do
  for way in $ways; do
    one "$way" cold "$k"
    one "$way" warm "$k"
  done
done
