"""A watchdog that ends the server's private Ray processes when the server ends, however it ends.

Ray stops its own processes when the server shuts down cleanly, and its raylet and GCS follow a killed server, but
some of its agents outlive a ``kill -9`` by a minute or more, holding ports and memory a restarted server may need.
The watchdog is a small process started beside the private Ray instance: it notes the server's descendants every
two seconds and, once the server is gone, terminates those still running (checked by start time, so a reused pid is
never touched), then exits. A server that joins an existing cluster (``--ray-address``) starts none.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

INTERVAL_SECONDS = 2.0
"""How often the server's descendants are listed: each listing reads every process on the machine (``/proc``), which
at half a second took about 1 % of a core per server on a busy machine. The processes it is for (Ray's agents, the
actors' workers) live for the server's lifetime, so a slower look misses none of them."""
GRACE_SECONDS = 3.0


def start() -> subprocess.Popen:
    """Watch this process from a new session (a signal to the server's process group does not reach it)."""
    return subprocess.Popen([sys.executable, "-m", "compat_server.watchdog", str(os.getpid())],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def watch(server_pid: int) -> None:
    server = psutil.Process(server_pid)
    known: dict[int, float] = {}
    while _alive(server):
        try:
            known.update((p.pid, p.create_time()) for p in server.children(recursive=True) if p.pid != os.getpid())
        except psutil.NoSuchProcess:
            break
        time.sleep(INTERVAL_SECONDS)
    left = []
    for pid, created in known.items():
        try:
            process = psutil.Process(pid)
            if process.create_time() == created:
                left.append(process)
        except psutil.NoSuchProcess:
            pass
    for process in left:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    for process in psutil.wait_procs(left, timeout=GRACE_SECONDS)[1]:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


if __name__ == "__main__":
    watch(int(sys.argv[1]))
