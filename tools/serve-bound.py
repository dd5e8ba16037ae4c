#!/usr/bin/env python3
"""Upper bound of continuous over static batching throughput, from the simulator's step costs.

For each batch size n the simulator predicts one decode step's time t(n) on a profile
(`moeflow sim ... --batch n`). A workload of requests with output lengths drawn uniformly from
LO..HI is then decoded two ways, counting decode steps only (prefill is the same work in both):
  static      batches of C requests decoded together until the longest ends (t(live) a step);
  continuous  an ideal batcher: C live sequences every step until the queue runs dry.
The ratio static_time / continuous_time bounds what any continuous batcher can gain over static
batching on that machine for that workload: it assumes free admission and no prefill in the steps.

usage: tools/serve-bound.py [--moeflow BIN] [--concurrency 16,64] [--outputs 8-256,8-32]
                            [--requests-per-slot 20] [--seed 1] -- SIM-ARGS...
e.g.   tools/serve-bound.py -- --profile tools/profiles/seed-host.prof --preset flash41 \\
           --warmup 60 --placement hybrid --dense cards --steps 8
"""
import argparse, random, re, subprocess, sys

def step_ms(moeflow, sim_args, n):
    out = subprocess.run([moeflow, "sim", *sim_args, "--batch", str(n)], check=True,
                         capture_output=True, text=True).stdout
    m = re.search(r"^predicted: ([0-9.]+) ms per step", out, re.M)
    if not m:
        sys.exit(f"serve-bound: no 'predicted:' line from moeflow sim --batch {n}")
    return float(m.group(1))

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moeflow", default="./build/moeflow")
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--outputs", default="8-256,8-32")
    ap.add_argument("--requests-per-slot", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("sim_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    sim_args = a.sim_args[1:] if a.sim_args[:1] == ["--"] else a.sim_args
    cs = [int(c) for c in a.concurrency.split(",")]
    cost = {n: step_ms(a.moeflow, sim_args, n) for n in range(1, max(cs) + 1)}
    for c in cs:
        for rng in a.outputs.split(","):
            lo, hi = (int(x) for x in rng.split("-"))
            random.seed(a.seed)
            outs = [random.randint(lo, hi) for _ in range(c * a.requests_per_slot)]
            static = 0.0
            for i in range(0, len(outs), c):
                batch = outs[i:i + c]
                for s in range(1, max(batch) + 1):
                    static += cost[sum(1 for o in batch if o >= s)]
            cont, queue, live = 0.0, list(outs), []
            while queue or live:
                while queue and len(live) < c:
                    live.append(queue.pop())
                cont += cost[len(live)]
                live = [o - 1 for o in live if o > 1]
            tok = sum(outs)
            print(f"concurrency {c}, outputs {lo}-{hi}: static {tok / static * 1e3:.2f} tokens/s, "
                  f"ideal continuous {tok / cont * 1e3:.2f} tokens/s, ratio {static / cont:.3f}")
    print("t(n) ms: " + ", ".join(f"{n}:{cost[n]:.1f}" for n in sorted(cost)))

if __name__ == "__main__":
    main()
