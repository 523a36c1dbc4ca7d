"""One Ray head node for the whole test run, which the servers the tests start join (``--ray-address``) instead of
each starting a private Ray instance.

Why: a private instance costs every server start about 13 s and 12 CPU-seconds (GCS, raylet, dashboard agent,
runtime-env agent, log monitor, prestarted workers; measured in bench/RESULTS.md, "Fourth pass"), and each keeps
polling while its server lives. The suite starts about 25 servers. Joining a running cluster is also the deployment
operators grow into (docs/deployment.md), so the tests exercise that path throughout.

What stays on a private instance, by asking for it (``start_server(..., own_ray=True)``): servers whose test checks
the private instance itself (kill -9 leaves none of its processes behind; the memory of the server's process tree),
and servers given environment variables their actors must see — an actor of a joined cluster inherits the head's
environment, not its server's. The head runs with the test run's own environment (``tests/conftest.py`` sets it
before anything starts), so what every actor needs from it (the model caches, offline hub) is there.

Started once per run by whichever worker asks first (a lock in the run's registry directory, as
``tests.server.shared_server``), stopped by the controller when the run ends (``stop_shared_ray``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from tests.server import free_port, locked

RAY = str(Path(sys.executable).with_name("ray"))

LOGICAL_CPUS = 64
"""What the head tells Ray it has. Ray's CPUs are bookkeeping for placement: the servers alive at once (a module's
and the session's, one with eight models) reserve far more than 2 cores' worth, and torch's threads come from the
affinity mask, not from this (``adapters/cpu_threads.py``)."""

OBJECT_STORE_BYTES = 512 * 1024 * 1024

CLIENT_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
"""Environment a server needs to join the head (which runs without Ray's token authentication: it listens on
127.0.0.1 for the run's own servers only)."""


def shared_ray_address(registry: Path, timeout: float = 120) -> str:
    """The address of the run's Ray head, started now if no worker has started it yet."""
    registry.mkdir(parents=True, exist_ok=True)
    record = registry / "ray-head.record"
    with locked(registry / "ray-head.lock"):
        if record.exists():
            return json.loads(record.read_text())["address"]
        ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
        address = f"127.0.0.1:{free_port()}"
        log_path = Path(ray_tmp, "head.log")
        args = [RAY, "start", "--head", "--block", f"--port={address.split(':')[1]}", "--node-ip-address=127.0.0.1",
                f"--num-cpus={LOGICAL_CPUS}", f"--object-store-memory={OBJECT_STORE_BYTES}",
                "--include-dashboard=false", "--disable-usage-stats", f"--dashboard-agent-listen-port={free_port()}"]
        with open(log_path, "wb") as log:
            head = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **CLIENT_ENV, "RAY_TMPDIR": ray_tmp})
        deadline = time.monotonic() + timeout
        while "Ray runtime started" not in log_path.read_text(errors="replace"):
            if head.poll() is not None or time.monotonic() > deadline:
                head.kill()
                raise RuntimeError(f"the run's Ray head did not start:\n{log_path.read_text(errors='replace')}")
            time.sleep(0.3)
        record.write_text(json.dumps({"address": address, "pid": head.pid, "tmp": ray_tmp}))
        return address


def stop_shared_ray(registry: Path) -> None:
    """Stop the run's Ray head, if one was started (the controller, once every server has stopped)."""
    record = registry / "ray-head.record"
    if not record.exists():
        return
    head = json.loads(record.read_text())
    try:
        process = psutil.Process(head["pid"])
        process.terminate()  # `ray start --block` stops its node's processes on SIGTERM
        process.wait(timeout=60)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        pass
    try:
        os.killpg(head["pid"], signal.SIGKILL)  # whatever of the node outlived it
    except ProcessLookupError:
        pass
    record.unlink()
    shutil.rmtree(head["tmp"], ignore_errors=True)
