"""A client environment for tinker-cookbook recipes, as a user would have beside the server.

tinker-cookbook 0.6.1 (from the package registry) declares ``tml-renderers>=0.4.1``, which the registry does not
carry; that package is imported lazily and only for Kimi/Inkling models and audio recipes, none of which run here.
So the recipe environment installs tinker-cookbook without its declared dependencies and then every other one it
declares (plus its ``math-rl`` extra), in a virtualenv of its own (so the server environment's ``pip check`` stays
clean). The virtualenv also sees this interpreter's packages (torch, transformers, tinker), so nothing heavy is
installed twice.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

COOKBOOK = "tinker-cookbook==0.6.1"
UNAVAILABLE = {"tml-renderers"}
EXTRAS = {"math-rl"}
ROOT = Path(__file__).resolve().parent.parent

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
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args],
                   check=True, timeout=900)


def cookbook_python() -> Path:
    """The recipe environment's interpreter, built on first use (``$COMPAT_SERVER_COOKBOOK_VENV`` or
    ``.venv-cookbook`` in the repository)."""
    venv = Path(os.environ.get("COMPAT_SERVER_COOKBOOK_VENV") or ROOT / ".venv-cookbook")
    python = venv / "bin" / "python"
    ready = venv / f".ready-{COOKBOOK}"
    if ready.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "compat_server_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _pip(python, "--no-deps", COOKBOOK)
    listed = subprocess.run([str(python), "-c", _REQUIREMENTS.format(extras=sorted(EXTRAS), skip=sorted(UNAVAILABLE))],
                            check=True, capture_output=True, text=True).stdout.split()
    _pip(python, *listed)
    ready.touch()
    return python
