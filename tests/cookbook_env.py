"""A client environment for tinker-cookbook recipes, as a user would have beside the server.

The cookbook and its extras are named in ``cookbook-requirements.in``. It declares a dependency the package
registry does not carry (``cookbook-unavailable.txt``), so the recipe environment installs tinker-cookbook without
its declared dependencies and then every other one it declares (with those extras), in a virtualenv of its own (so
the server environment's ``pip check`` stays clean). Every install is held to the versions of the repository's lock
(``constraints.txt``, which ``.ci/lock`` resolves with the cookbook in it), and the environment is rebuilt when the
lock changes. The virtualenv also sees this interpreter's packages (torch, transformers, tinker), so nothing heavy
is installed twice.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

from packaging.requirements import Requirement

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LOCK = ROOT / "constraints.txt"


def _requirements(path: Path) -> list[Requirement]:
    return [Requirement(line) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


(COOKBOOK_REQUIREMENT,) = _requirements(HERE / "cookbook-requirements.in")
COOKBOOK = f"{COOKBOOK_REQUIREMENT.name}{COOKBOOK_REQUIREMENT.specifier}"
EXTRAS = set(COOKBOOK_REQUIREMENT.extras)
UNAVAILABLE = {requirement.name for requirement in _requirements(HERE / "cookbook-unavailable.txt")}

_REQUIREMENTS = """
import re
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("tinker-cookbook") or []:
    req = Requirement(line)
    wanted = req.marker is None or any(req.marker.evaluate({{"extra": e}}) for e in {extras!r})
    if wanted and req.name not in {skip!r}:
        print(str(req).split(";")[0])
"""


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-c", str(LOCK),
                    *args], check=True, timeout=900)


def cookbook_python() -> Path:
    """The recipe environment's interpreter, built on first use (``$COMPAT_SERVER_COOKBOOK_VENV`` or
    ``.venv-cookbook`` in the repository)."""
    venv = Path(os.environ.get("COMPAT_SERVER_COOKBOOK_VENV") or ROOT / ".venv-cookbook")
    python = venv / "bin" / "python"
    ready = venv / f".ready-{COOKBOOK}-lock-{hashlib.sha256(LOCK.read_bytes()).hexdigest()[:12]}"
    if ready.exists():
        return python
    # Made afresh (a lock that changed may have dropped packages an older build installed).
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "compat_server_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _pip(python, "--no-deps", COOKBOOK)
    listed = subprocess.run([str(python), "-c", _REQUIREMENTS.format(extras=sorted(EXTRAS), skip=sorted(UNAVAILABLE))],
                            check=True, capture_output=True, text=True).stdout.split()
    _pip(python, *listed)
    ready.touch()
    return python
