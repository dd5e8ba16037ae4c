"""Starts `moeflow serve` for the Python checks (check_serve, check_serve_hostile, check_mpi,
check_prefix_serve): the process with its stderr read into a log, and the port it says it listens
on. One home for the start-up wait those checks share."""
import re
import subprocess
import threading
import time


def start(cmd, env=None, wait_s=60):
    """Runs cmd (a `moeflow serve ... --port 0` command line), reads its stderr until the
    "listening on http://127.0.0.1:PORT" line (at most wait_s seconds), then keeps reading it into
    the log on a thread. Returns (process, port, log); raises RuntimeError with the log when no port
    was named."""
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    log, port = [], None
    t0 = time.time()
    while time.time() - t0 < wait_s:
        line = p.stderr.readline()
        if not line:
            break
        log.append(line)
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
            break
    if port is None:
        raise RuntimeError("server did not start: " + "".join(log))
    threading.Thread(target=lambda: [log.append(x) for x in p.stderr], daemon=True).start()
    return p, port, log
