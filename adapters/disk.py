"""Writing checkpoints: a full disk is reported as what it is, not as a failed or unavailable actor."""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOW_SPACE_BYTES = 1 << 20
"""Less free space than this after a failed write means the disk filled up (torch's writer reports only "file write
failed", without the OS error)."""


class DiskFull(RuntimeError):
    """A checkpoint could not be written for want of space: the server's disk, not the caller's request."""


def _out_of_space(exc: BaseException, directory: Path) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left on device" in str(exc):
        return True
    existing = next((p for p in (directory, *directory.parents) if p.exists()), None)
    return existing is not None and shutil.disk_usage(existing).free < LOW_SPACE_BYTES


@contextmanager
def writing(directory: Path) -> Iterator[None]:
    """Around code that writes into ``directory``: running out of space raises ``DiskFull`` naming it."""
    try:
        yield
    except DiskFull:
        raise
    except Exception as exc:
        if _out_of_space(exc, directory):
            raise DiskFull(f"no space left on device while writing {directory}") from None
        raise
