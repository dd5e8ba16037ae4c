#!/usr/bin/env python3
"""The model split by layers over several processes on Open MPI (graphs/pipe/pipe.h,
docs/pipeline.md), on this one machine: `mpirun -n 2` and `-n 3` over TCP on loopback, greedy
decode of tiny (batch 1 and 4, 1 to 3 micro-batches; 2 and 3 ranks) and demo (batch 1 and 3 on 2
ranks: ~/.cache/moeflow/demo, or one made by `moeflow gen --preset demo` in the check's own folder
where it is absent, as on a fresh CI machine; tests/test_step_pipe.c runs demo in one process too),
tokens and every generated token's logits (decode --logits-out) byte-identical to one
process; `serve` answering on rank 0 as one process does, and SIGTERM to rank 0 stopping every
rank (exit 0; decode's rank 0 143, the others 0: sent once rank 0 has its handler, with mpirun
not ending the others at rank 0's non-zero status, so that each rank's own status is seen). Two network namespaces joined by a veth pair with a tc rate limit (tbf; netem is
not in this kernel, so no added delay) as two hosts: the same bytes. Faults, with mpirun
--enable-recovery so that the ranks' own detection is what ends them: a rank killed mid-step, a
rank stopped (SIGSTOP: hung), the veth taken down mid-step: every other rank exits non-zero
within the timeout with a message naming the lost rank. Every mpirun runs under a deadline and
everything the check made (processes, namespaces) is removed after. Exits 77 (skip) only
without mpirun; a moeflow built without MPI on a machine with mpirun is a failure (libopenmpi-dev
missing when it was configured: tools/install-deps.sh installs both). The namespace part is
skipped (said) without root, `ip` and `tc` (iproute2), or where the kernel refuses namespaces."""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import json

import serve_proc

T0 = time.time()
BIN = os.path.abspath(os.environ.get("MOEFLOW_BIN", "build/moeflow"))
TMP = os.path.join(os.environ.get("MOEFLOW_TMP", "/tmp"), f"check_mpi_{os.getpid()}")
TAG = f"mfcheck{os.getpid()}"
FAILURES = []
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", MF_CHECK_TAG=TAG,
           # libmpi's own allocations at exit are not ours to chase (the in-process test_step_pipe runs the
           # pipeline's code with leak detection on)
           ASAN_OPTIONS=os.environ.get("ASAN_OPTIONS", "") + ":detect_leaks=0")
# TCP on loopback only (not shared memory): what crosses between hosts
LOOP = ["--oversubscribe", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo",
        "--mca", "oob_tcp_if_include", "lo", "-x", "MF_CHECK_TAG", "-x", "ASAN_OPTIONS"]


def fail(msg):
    FAILURES.append(msg)
    print("MISMATCH:", msg, file=sys.stderr, flush=True)


def check(cond, msg):
    if not cond:
        fail(msg)
    return cond


def mpirun(n, args, extra=(), timeout=240):
    """mpirun -n n moeflow args over loopback; (rc, stdout, stderr)."""
    p = subprocess.run(["mpirun", *LOOP, *extra, "-n", str(n), BIN, *args], capture_output=True, env=ENV,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr.decode(errors="replace")


def decode_args(ckpt, logits, *more):
    return ["decode", "--checkpoint", ckpt, "--threads", "1", "--quiet", "--logits-out", logits, *more]


def same_file(a, b):
    with open(a, "rb") as f, open(b, "rb") as g:
        return f.read() == g.read()


def rank_pids():
    """rank -> pid of this check's moeflow processes (their MF_CHECK_TAG)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/comm") as f:
                if f.read().strip() != "moeflow":
                    continue
            with open(f"/proc/{d}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"MF_CHECK_TAG") == TAG.encode() and b"OMPI_COMM_WORLD_RANK" in env:
            out[int(env[b"OMPI_COMM_WORLD_RANK"])] = int(d)
    return out


def kill_ours():
    for pid in rank_pids().values():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def equal_runs(ckpt, name, ref_out, ref_lg, more, runs):
    """Each (n, spec, micro) of runs against the one-process outputs."""
    for n, spec, micro in runs:
        lg = os.path.join(TMP, f"{name}_{n}_{spec.replace(':', '-').replace(',', '_')}_{micro}.bin")
        rc, out, err = mpirun(n, decode_args(ckpt, lg, *more, "--ranks-layers", spec, "--ranks-micro", str(micro)))
        what = f"{name}: mpirun -n {n} --ranks-layers {spec} --ranks-micro {micro}"
        if not check(rc == 0, f"{what}: exit {rc}: {err[-2000:]}"):
            continue
        check(out == ref_out, f"{what}: output differs: {out!r} vs {ref_out!r}")
        check(same_file(lg, ref_lg), f"{what}: logits differ from one process's")
        print(f"  {what}: tokens and logits identical ({time.time() - T0:.0f} s)", flush=True)


def test_decode(ckpt, name, prompts, n_new, runs):
    pf = os.path.join(TMP, f"{name}_prompts.txt")
    with open(pf, "w") as f:
        f.write("\n".join(prompts) + "\n")
    more = ["--prompts", pf, "--max-new-tokens", str(n_new)]
    ref_lg = os.path.join(TMP, f"{name}_ref.bin")
    p = subprocess.run([BIN, *decode_args(ckpt, ref_lg, *more)], capture_output=True, env=ENV)
    if not check(p.returncode == 0, f"{name}: one process: {p.stderr.decode(errors='replace')[-2000:]}"):
        return
    check(os.path.getsize(ref_lg) > 0, f"{name}: no logits written")
    equal_runs(ckpt, name, p.stdout, ref_lg, more, runs)


def test_serve(ckpt):
    """serve over 2 ranks answers as one process's decode; SIGTERM to rank 0 stops every rank."""
    jl = os.path.join(TMP, "serve_ref.jsonl")
    subprocess.run([BIN, "decode", "--checkpoint", ckpt, "--tokens", "1,5,9,33,7", "--max-new-tokens", "8",
                    "--threads", "1", "--quiet", "--output", jl], capture_output=True, env=ENV, check=True)
    with open(jl) as f:
        want = json.loads(f.readline())["tokens"]
    try:
        p, port, _ = serve_proc.start(["mpirun", *LOOP, "-n", "2", BIN, "serve", "--checkpoint", ckpt, "--port", "0",
                                       "--threads", "1", "--ranks-layers", "auto"], env=ENV)
    except RuntimeError as e:
        check(False, "serve over 2 ranks did not start: " + str(e)[-2000:])
        kill_ours()
        return
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                     data=json.dumps({"prompt": [1, 5, 9, 33, 7], "max_tokens": 8,
                                                      "temperature": 0}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            got = json.load(r)["choices"][0]["tokens"]
        check(got == want, f"serve over 2 ranks: tokens {got}, one process's decode {want}")
        pids = rank_pids()
        check(sorted(pids) == [0, 1], f"serve: ranks found {pids}")
        t1 = time.time()
        os.kill(pids[0], signal.SIGTERM)
        rc = p.wait(timeout=60)
        check(rc == 0, f"serve: SIGTERM to rank 0: mpirun exit {rc}")
        check(not rank_pids(), "serve: a rank is left after SIGTERM to rank 0")
        print(f"  serve on rank 0 of 2: tokens as decode's; SIGTERM to rank 0 stopped both in {time.time() - t1:.1f} s",
              flush=True)
    finally:
        if p.poll() is None:
            p.kill()
        kill_ours()


def wrapper():
    """A shell wrapper writing each rank's exit status into $MF_RCDIR/rc.<rank>."""
    w = os.path.join(TMP, "wrap.sh")
    with open(w, "w") as f:
        f.write('#!/bin/sh\n"$@"\nrc=$?\necho $rc > "$MF_RCDIR/rc.$OMPI_COMM_WORLD_RANK"\nexit $rc\n')
    os.chmod(w, 0o755)
    return w


def run_fault(name, n, spec, act, named, timeout_s=4.0, launcher=None, names=True):
    """A long decode over n ranks; act(pids) breaks it 2 s in; every rank r of named must exit
    non-zero within timeout_s + a margin with a message naming rank named[r] lost. launcher: the
    command before the wrapper and its -n (default: mpirun on loopback with --enable-recovery).
    names False: each rank's exit is checked, not that its own message names the lost rank (with
    three ranks mpirun may stop one before it prints, when another exits first). Always: no rank's
    output names a rank lost that was not (a live rank named lost: docs/pipeline.md "Failures")."""
    rcdir = os.path.join(TMP, f"rc_{name}")
    outdir = os.path.join(TMP, f"out_{name}")
    for d in (rcdir, outdir):
        shutil.rmtree(d, ignore_errors=True)
    os.makedirs(rcdir)
    env = dict(ENV, MF_RCDIR=rcdir)
    launch = launcher or ["mpirun", *LOOP, "--enable-recovery"]
    cmd = launch + ["-x", "MF_RCDIR", "--output-filename", outdir, "-n", str(n), wrapper(), BIN, "decode",
                    "--checkpoint", CKPT, "--tokens", "1,2,3", "--max-new-tokens", "1000000", "--ignore-eos",
                    "--threads", "1", "--quiet", "--ranks-layers", spec, "--ranks-timeout", str(timeout_s)]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        t0 = time.time()
        while time.time() - t0 < 60 and len(rank_pids()) < n:
            time.sleep(0.2)
        time.sleep(2.0)   # mid-decode
        pids = rank_pids()
        if not check(len(pids) == n, f"{name}: {len(pids)} of {n} ranks running"):
            return
        t_act = time.time()
        act(pids)
        bound = timeout_s + 8.0
        while time.time() - t_act < bound and not all(os.path.exists(os.path.join(rcdir, f"rc.{r}")) for r in named):
            time.sleep(0.1)
        took = time.time() - t_act
        time.sleep(0.5)   # the last lines of stderr
        err = {}
        for root, _, files in os.walk(outdir):
            m = re.search(r"rank\.(\d+)$", root)
            if m and "stderr" in files:
                with open(os.path.join(root, "stderr"), errors="replace") as g:
                    err[int(m.group(1))] = g.read()
        for r, lost in named.items():
            f = os.path.join(rcdir, f"rc.{r}")
            if not check(os.path.exists(f), f"{name}: rank {r} still running {bound:.0f} s after the fault"):
                continue
            with open(f) as g:
                rc = int(g.read().strip() or "0")
            check(rc != 0, f"{name}: rank {r} exited 0")
            check(not names or re.search(rf"moeflow decode: rank {r}: .*rank {lost} lost", err.get(r, "")),
                  f"{name}: rank {r}'s message does not name rank {lost} lost: {err.get(r, '')[-1500:]!r}")
        for r, text in err.items():
            wrong = sorted({int(x) for x in re.findall(r"rank (\d+) lost", text)} - set(named.values()))
            check(not wrong, f"{name}: rank {r}'s output names live rank(s) {wrong} lost: {text[-1500:]!r}")
        print(f"  {name}: ranks {sorted(named)} exited non-zero{' naming the lost rank' if names else ''} within {took:.1f} s "
              f"(--ranks-timeout {timeout_s:g})", flush=True)
    finally:
        kill_ours()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def sig(rank, s):
    return lambda pids: os.kill(pids[rank], s)


def catches_term(pid):
    """Whether process pid has a handler for SIGTERM (/proc/pid/status SigCgt)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            cgt = next(int(l.split()[1], 16) for l in f if l.startswith("SigCgt:"))
    except (OSError, StopIteration, TypeError):
        return False
    return bool(cgt >> (signal.SIGTERM - 1) & 1)


def test_decode_sigterm():
    """SIGTERM to decode's rank 0 mid-run: it cancels, tells the other ranks to stop (they exit 0)
    and exits 143 itself."""
    rcdir = os.path.join(TMP, "rc_sigterm")
    shutil.rmtree(rcdir, ignore_errors=True)
    os.makedirs(rcdir)
    # mpirun would kill rank 1 as soon as rank 0 exits 143 (its default on a non-zero status), racing
    # rank 1's own exit (lost under ASan): here each rank's own exit status is the point
    p = subprocess.Popen(["mpirun", *LOOP, "--mca", "orte_abort_on_non_zero_status", "0", "-x", "MF_RCDIR", "-n", "2",
                          wrapper(), BIN, "decode", "--checkpoint", CKPT,
                          "--tokens", "1,2,3", "--max-new-tokens", "1000000", "--ignore-eos", "--threads", "1",
                          "--quiet", "--ranks-layers", "auto"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env=dict(ENV, MF_RCDIR=rcdir))
    try:
        t0 = time.time()
        while time.time() - t0 < 60 and len(rank_pids()) < 2:
            time.sleep(0.2)
        # rank 0 takes SIGTERM once decoding (before, the default action ends it and rank 1 finds it
        # lost): send it when its handler is there (/proc's SigCgt; a slow ASan start took over 1 s)
        while time.time() - t0 < 60 and not catches_term(rank_pids().get(0)):
            time.sleep(0.1)
        time.sleep(0.5)
        t1 = time.time()
        os.kill(rank_pids()[0], signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            fail("decode, SIGTERM to rank 0: mpirun still running 30 s after")
            return
        rcs = {}
        for r in range(2):
            f = os.path.join(rcdir, f"rc.{r}")
            rcs[r] = int(open(f).read().strip()) if os.path.exists(f) else None
        check(rcs == {0: 143, 1: 0}, f"decode, SIGTERM to rank 0: exit statuses {rcs} (expected rank 0 143, rank 1 0)")
        print(f"  decode on 2 ranks: SIGTERM to rank 0 stopped both in {time.time() - t1:.1f} s (rank 0 143, "
              f"rank 1 0)", flush=True)
    finally:
        kill_ours()
        if p.poll() is None:
            p.kill()
            p.wait()


def test_faults():
    run_fault("kill", 2, "0:2,2:8", sig(1, signal.SIGKILL), {0: 1})
    # three ranks: every rank ends non-zero within the bound, and none names a live rank lost (until
    # the UDP heartbeats one did once, its MPI progress stalled on the dead peer: docs/pipeline.md)
    run_fault("kill3", 3, "0:1,1:4,4:8", sig(1, signal.SIGKILL), {0: 1, 2: 1}, names=False)
    run_fault("hang", 2, "auto", sig(1, signal.SIGSTOP), {0: 1})


class Netns:
    """Two network namespaces joined by a veth pair (tbf rate limits both ways) as two hosts."""

    def __init__(self):
        k = os.getpid() % 200 + 20
        self.ns = [f"mfA{os.getpid()}", f"mfB{os.getpid()}"]
        self.dev = [f"mfa{os.getpid() % 100000}", f"mfb{os.getpid() % 100000}"]
        self.ip = [f"10.213.{k}.1", f"10.213.{k}.2"]
        self.net = f"10.213.{k}.0/24"

    def ip_run(self, *a):
        subprocess.run(["ip", *a], check=True, capture_output=True)

    def up(self):
        for ns in self.ns:
            self.ip_run("netns", "add", ns)
        self.ip_run("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
        for i in range(2):
            self.ip_run("link", "set", self.dev[i], "netns", self.ns[i])
            self.ip_run("-n", self.ns[i], "addr", "add", self.ip[i] + "/24", "dev", self.dev[i])
            self.ip_run("-n", self.ns[i], "link", "set", self.dev[i], "up")
            self.ip_run("-n", self.ns[i], "link", "set", "lo", "up")
            # 1 Gbit/s each way (netem's delay is not in this kernel: `tc qdisc ... netem` is refused)
            subprocess.run(["ip", "netns", "exec", self.ns[i], "tc", "qdisc", "add", "dev", self.dev[i], "root", "tbf",
                            "rate", "1gbit", "burst", "256kb", "latency", "50ms"], check=True, capture_output=True)
        agent = os.path.join(TMP, "netns-agent.sh")
        with open(agent, "w") as f:
            f.write("#!/bin/sh\n# mpirun's rsh agent: the host is an address of one of the check's namespaces\n"
                    f'h=$1; shift\ncase "$h" in {self.ip[0]}) ns={self.ns[0]};; {self.ip[1]}) ns={self.ns[1]};; '
                    '*) echo "agent: unknown host $h" >&2; exit 1;; esac\nexec ip netns exec "$ns" /bin/sh -c "$*"\n')
        os.chmod(agent, 0o755)
        self.agent = agent

    def mpirun(self, args):
        return ["ip", "netns", "exec", self.ns[0], "mpirun", "--mca", "plm_rsh_agent", self.agent, "--host",
                ",".join(self.ip), "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", self.net, "--mca",
                "oob_tcp_if_include", self.net, "-x", "MF_CHECK_TAG", "-x", "ASAN_OPTIONS", *args]

    def down(self):
        for ns in self.ns:
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
        time.sleep(0.3)
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_netns(ckpt):
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        print("  two namespaces: skipped (needs root, ip and tc)", flush=True)
        return
    nn = Netns()
    try:
        nn.up()
    except subprocess.CalledProcessError as e:
        print(f"  two namespaces: skipped ({e.cmd}: {e.stderr.decode(errors='replace').strip()})", flush=True)
        nn.down()
        return
    try:
        pf = os.path.join(TMP, "tiny_prompts.txt")
        more = ["--prompts", pf, "--max-new-tokens", "12"]
        ref_lg = os.path.join(TMP, "tiny_ref.bin")
        ref = subprocess.run([BIN, *decode_args(ckpt, ref_lg, *more)], capture_output=True, env=ENV)
        lg = os.path.join(TMP, "netns.bin")
        p = subprocess.run(nn.mpirun(["-n", "2", BIN, *decode_args(ckpt, lg, *more, "--ranks-layers", "auto")]),
                           capture_output=True, env=ENV, timeout=180)
        if check(p.returncode == 0, f"two namespaces: exit {p.returncode}: {p.stderr.decode(errors='replace')[-2000:]}"):
            check(p.stdout == ref.stdout, "two namespaces: output differs")
            check(same_file(lg, ref_lg), "two namespaces: logits differ from one process's")
            print("  two namespaces over a veth pair (tbf 1 Gbit/s): tokens and logits identical", flush=True)

        def cut(pids):
            subprocess.run(["ip", "-n", nn.ns[0], "link", "set", nn.dev[0], "down"], check=True)

        # each side loses the other (mpirun itself runs in the first namespace, its daemon in the second)
        run_fault("cut", 2, "auto", cut, {0: 1, 1: 0}, launcher=nn.mpirun([]))
    finally:
        nn.down()


def main():
    if not shutil.which("mpirun"):
        print("check_mpi: SKIP (no mpirun: tools/install-deps.sh installs openmpi-bin)")
        return 77
    os.makedirs(TMP, exist_ok=True)
    global CKPT
    CKPT = os.path.join(TMP, "tiny")
    subprocess.run([BIN, "gen", "--preset", "tiny", "--out", CKPT, "--quiet"], check=True)
    rc, _, err = mpirun(2, ["decode", "--checkpoint", CKPT, "--tokens", "1,2", "--max-new-tokens", "1", "--quiet",
                            "--ranks-layers", "auto"])
    if rc != 0 and "without MPI" in err:
        print(f"check_mpi: FAILED: mpirun is here ({shutil.which('mpirun')}) but {BIN} was built without MPI "
              "(CMake found no MPI: libopenmpi-dev missing? tools/install-deps.sh installs it; reconfigure)")
        return 1
    check(rc == 0, f"a first run over 2 ranks: exit {rc}: {err[-2000:]}")
    t0 = time.time()
    # a sanitized build (CI's build-asan, build-tsan directories) runs fewer of them: each is 3-5x slower
    sanitized = "asan" in BIN or "tsan" in BIN
    prompts = ["the house", "hello world of tiny things", "a", "once upon a time there was"]
    test_decode(CKPT, "tiny b1", prompts[:1], 12, [(2, "auto", 1), (3, "0:1,1:4,4:8", 1)])
    test_decode(CKPT, "tiny", prompts, 12, [(2, "0:2,2:8", 2), (3, "0:1,1:4,4:8", 3)] +
                ([] if sanitized else [(2, "auto", 1)]))
    demo = os.path.expanduser("~/.cache/moeflow/demo")
    if not os.path.exists(os.path.join(demo, "config.json")):
        demo = os.path.join(TMP, "demo")   # as tools/demo.sh makes it (1.5 GB, ~10 s), removed after
        print(f"  demo: no ~/.cache/moeflow/demo, generating one in {demo}", flush=True)
        subprocess.run([BIN, "gen", "--preset", "demo", "--out", demo, "--seed", "1", "--quiet"], check=True)
    test_decode(demo, "demo b1", ["The house stands on a hill"], 4, [(2, "auto", 1)])
    test_decode(demo, "demo", ["The house stands on a hill", "a small dog", "one two three"], 3,
                [(2, "0:4,4:8", 2)])
    test_serve(CKPT)
    test_decode_sigterm()
    test_faults()
    test_netns(CKPT)
    print(f"check_mpi: {time.time() - t0:.0f} s", flush=True)
    shutil.rmtree(TMP, ignore_errors=True)
    if FAILURES:
        print(f"check_mpi: {len(FAILURES)} failure(s)")
        return 1
    print("check_mpi: ok")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        kill_ours()
