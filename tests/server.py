"""Start the real server as a subprocess on 127.0.0.1 and wait until it answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RunningServer:
    process: subprocess.Popen
    base_url: str
    data_dir: Path
    log_path: Path
    admin_key: str
    """An operator key (``keys create --admin``): the one that sees server-wide metrics."""
    env: dict[str, str]
    """The environment variables the test set for it, beyond its own."""

    @property
    def admin(self) -> dict[str, str]:
        return {"X-API-Key": self.admin_key}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_server(data_dir: Path, *extra_args: str, env: dict[str, str] | None = None,
                 timeout: float = 180, attempts: int = 3) -> RunningServer:
    """Start a server on a free port. The port is free when chosen, but the server binds it only once it is ready,
    seconds later, and Ray processes pick random ports meanwhile; losing that race retries with another port."""
    for attempt in range(attempts):
        try:
            return _start_once(data_dir, extra_args, env, timeout)
        except PortTaken:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


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


def _start_once(data_dir: Path, extra_args: tuple[str, ...], env: dict[str, str] | None,
                timeout: float) -> RunningServer:
    port = free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    admin_key = _admin_key(data_dir)
    log_path = data_dir / "server.log"
    log_file = open(log_path, "wb")  # noqa: SIM115 - the child process writes to it for its whole life
    process = subprocess.Popen(
        [sys.executable, "-m", "compat_server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--data-dir", str(data_dir), "--poll-hold-seconds", "2", *extra_args],
        stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
    )
    server = RunningServer(process, f"http://127.0.0.1:{port}", data_dir, log_path, admin_key, dict(env or {}))
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
