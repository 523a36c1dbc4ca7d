"""Start the real server as a subprocess on 127.0.0.1 and wait until it answers; and the servers the whole test run
shares (``shared_server``): started once by whichever pytest-xdist worker needs one first, used by every worker, and
stopped by the run's controller when every worker is done."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path

import httpx
import psutil

from tests.serve import MODULES_ENV


REPOSITORY = Path(__file__).resolve().parent.parent
"""Where servers start: the repository root, from which ``python -m tests.serve`` finds the tests package."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RunningServer:
    pid: int
    args: list[str]
    """The server's command line."""
    base_url: str
    data_dir: Path
    log_path: Path
    admin_key: str
    """An operator key (``keys create --admin``): the one that sees server-wide metrics."""
    env: dict[str, str]
    """The environment variables the test set for it, beyond its own."""
    extra: dict = field(default_factory=dict)
    """What the fixture that started it keeps beside it (``keyed_server``: the keys it issued)."""
    process: subprocess.Popen | None = field(default=None, repr=False, compare=False)
    """The process, in the test process that started it; None in the other workers of a shared server."""

    @property
    def admin(self) -> dict[str, str]:
        return {"X-API-Key": self.admin_key}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def stop(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            return
        try:
            process = psutil.Process(self.pid)
            process.terminate()
            process.wait(timeout=30)
        except psutil.TimeoutExpired:
            os.kill(self.pid, signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass

    def imported_modules(self, timeout: float = 30) -> set[str]:
        """The modules the server process has imported by now (a server started with ``reports_modules``)."""
        listed = Path(self.env[MODULES_ENV])
        listed.unlink(missing_ok=True)
        os.kill(self.pid, signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while not listed.exists():
            assert time.monotonic() < deadline, f"the server wrote no module list in {timeout} s"
            time.sleep(0.1)
        return set(listed.read_text().split())

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self) if f.name != "process"}, default=str)

    @classmethod
    def from_json(cls, text: str) -> RunningServer:
        fields_ = json.loads(text)
        return cls(**{**fields_, "data_dir": Path(fields_["data_dir"]), "log_path": Path(fields_["log_path"])})


def start_server(data_dir: Path, *extra_args: str, env: dict[str, str] | None = None,
                 timeout: float = 180, attempts: int = 3, detached: bool = False,
                 reports_modules: bool = False) -> RunningServer:
    """Start a server on a free port. The port is free when chosen, but the server binds it only once it is ready,
    seconds later, and Ray processes pick random ports meanwhile; losing that race retries with another port.
    ``detached``: in a session of its own, so that it outlives the worker that started it (``shared_server``).
    ``reports_modules``: through ``tests.serve``, which writes the modules it has imported to ``<data dir>/modules.txt``
    when sent SIGUSR1 (``RunningServer.imported_modules``)."""
    for attempt in range(attempts):
        try:
            return _start_once(data_dir, extra_args, env, timeout, detached, reports_modules)
        except PortTaken:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def shared_server(registry: Path, name: str, start: Callable[[], RunningServer]) -> RunningServer:
    """The run's server ``name``: ``start()`` (which must start it ``detached``) in the first worker that asks, the same
    server in every later one. ``registry`` is a directory every worker of the run sees (``shared_registry``); the
    controller stops what it lists at the end of the run (``stop_shared_servers``). A server that failed to start is
    not retried by the next worker: its error is recorded and raised again, so one broken start is reported once per
    worker rather than costing each worker the start's timeout."""
    registry.mkdir(parents=True, exist_ok=True)
    record, failure = registry / f"{name}.json", registry / f"{name}.failed"
    with _locked(registry / f"{name}.lock"):
        if failure.exists():
            raise RuntimeError(f"the shared {name} server failed to start in another worker:\n{failure.read_text()}")
        if record.exists():
            return RunningServer.from_json(record.read_text())
        try:
            server = start()
        except Exception as exc:
            failure.write_text(f"{type(exc).__name__}: {exc}")
            raise
        record.write_text(server.to_json())
        return server


def stop_shared_servers(registry: Path) -> None:
    """Stop every server ``shared_server`` started under ``registry`` (the controller, once the run is over)."""
    for record in sorted(registry.glob("*.json")):
        RunningServer.from_json(record.read_text()).stop()
        record.unlink()


def _admin_key(data_dir: Path) -> str:
    """The data directory's operator key for the tests, made once (a restarted server keeps it)."""
    kept = data_dir / "test-admin-key"
    if not kept.exists():
        made = subprocess.run([sys.executable, "-m", "compat_server.cli", "keys", "--data-dir", str(data_dir),
                               "create", "--admin", "--name", "test-operator"],
                              capture_output=True, text=True, timeout=60, check=True)
        kept.write_text(made.stdout.strip())
    return kept.read_text()


class PortTaken(RuntimeError):
    pass


SERVER_ENV: dict[str, str] = {}
"""Environment every server started here gets, beneath the caller's ``env``: empty (benchmarks run the defaults);
the test suite sets its own (``tests/conftest.py``)."""


def _start_once(data_dir: Path, extra_args: tuple[str, ...], env: dict[str, str] | None,
                timeout: float, detached: bool, reports_modules: bool) -> RunningServer:
    port = free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    admin_key = _admin_key(data_dir)
    log_path = data_dir / "server.log"
    log_file = open(log_path, "wb")  # noqa: SIM115 - the child process writes to it for its whole life
    if reports_modules:
        env = {**(env or {}), MODULES_ENV: str(data_dir / "modules.txt")}
    entry = "tests.serve" if reports_modules else "compat_server.cli"
    args = [sys.executable, "-m", entry, "serve", "--host", "127.0.0.1", "--port", str(port),
            "--data-dir", str(data_dir), "--poll-hold-seconds", "2", *extra_args]
    process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT,
                               env={**os.environ, **SERVER_ENV, **(env or {})}, start_new_session=detached,
                               cwd=REPOSITORY)
    server = RunningServer(process.pid, args, f"http://127.0.0.1:{port}", data_dir, log_path, admin_key,
                           dict(env or {}), process=process)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            error = PortTaken if "address already in use" in server.log() else RuntimeError
            raise error(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/api/v1/healthz", timeout=2).status_code == 200 \
                    and "compat-server ready at" in server.log():
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"server did not become ready in {timeout}s:\n{server.log()}")
