"""tinker:// paths ↔ directories on disk, with atomic publication of checkpoint directories.

A checkpoint is written into a hidden staging directory beside its final place, every file is fsynced, and only then
is the directory renamed into place and recorded — so a checkpoint half-written at a crash is never listed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from tinker.types import ParsedCheckpointTinkerPath

from compat_server.records import Records
from shims.errors import NotFound, UserError

KIND_DIRS = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: str) -> str:
    """Checkpoint names become directory names: letters, digits, ``._-``; no separators, no ``..``."""
    if not _NAME.match(name) or ".." in name:
        raise UserError(f"invalid checkpoint name {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
                        "starting with a letter or digit")
    return name


def tinker_path(training_run_id: str, kind: str, name: str) -> str:
    return f"tinker://{training_run_id}/{KIND_DIRS[kind]}/{check_name(name)}"


def parse_path(path: str) -> ParsedCheckpointTinkerPath:
    """Parse with the SDK's own parser; a malformed path or name is a user error."""
    try:
        parsed = ParsedCheckpointTinkerPath.from_tinker_path(path)
    except ValueError as exc:
        raise UserError(f"{exc}; expected tinker://<training_run_id>/weights/<name>, .../sampler_weights/<name> or "
                        ".../external_weights/<name>") \
            from None
    if parsed.checkpoint_type not in KIND_DIRS or not parsed.training_run_id or "/" in parsed.training_run_id \
            or parsed.training_run_id.startswith("."):
        raise UserError(f"unsupported tinker path {path!r}")
    check_name(parsed.checkpoint_id.split("/", 1)[1])
    return parsed


SAMPLER_COPY = ".sampler"
"""In an ``external_weights`` checkpoint (exported or uploaded: hosted Tinker's naming), the same adapter in the
stored naming samplers load (``adapters.lora.files``); not one of the checkpoint's files (never listed or downloaded),
though its bytes count in the checkpoint's size on disk, and deleted with it."""

MAX_TTL_SECONDS = 10 * 365 * 24 * 3600
"""Tinker's upper bound on a checkpoint's time to live: ten years."""


class CheckpointStore:
    """Maps tinker paths onto ``root``, publishes checkpoint directories atomically, and applies the TTL rules.

    Every save is its own directory, ``ROOT/RUN/KIND/NAME/UID``: a checkpoint deleted and saved again under the same
    name gets a new ``uid`` and a new directory, so a handle opened on the old save (a sampling session, a signed
    download URL) can never reach the new files, whoever owns them."""

    def __init__(self, root: Path, min_ttl_seconds: float) -> None:
        self.root = root
        self.min_ttl_seconds = min_ttl_seconds
        root.mkdir(parents=True, exist_ok=True)
        self.abandoned = self._discard_abandoned()

    def _discard_abandoned(self) -> int:
        """Staging directories left by a process that died mid-save: never published, never recorded, deleted."""
        abandoned = [d for d in self.root.glob("*/*/*/.staging-*") if d.is_dir()]
        for directory in abandoned:
            shutil.rmtree(directory, ignore_errors=True)
        return len(abandoned)

    def adopt_unversioned(self, rows: list[dict]) -> int:
        """Move checkpoints saved before per-save directories existed (files directly in ``NAME``) into
        ``NAME/UID``, the uid their record was given on upgrade. Returns how many moved."""
        moved = 0
        for row in rows:
            old = self._name_dir(row["tinker_path"])
            if not old.is_dir() or not any(entry.is_file() for entry in old.iterdir()):
                continue
            temporary = old.with_name(f".staging-{old.name}-{uuid.uuid4().hex[:8]}")
            os.rename(old, temporary)
            old.mkdir()
            os.rename(temporary, old / row["uid"])
            moved += 1
        return moved

    @staticmethod
    def new_uid() -> str:
        return uuid.uuid4().hex

    def expiry(self, ttl_seconds: float | None) -> str | None:
        """When a checkpoint given ``ttl_seconds`` from now expires (None: never). Tinker's range is one hour
        (``--min-checkpoint-ttl``) to ten years."""
        if ttl_seconds is None:
            return None
        if not self.min_ttl_seconds <= ttl_seconds <= MAX_TTL_SECONDS:
            raise UserError(f"ttl_seconds must be between {self.min_ttl_seconds:g} and {MAX_TTL_SECONDS} "
                            f"(ten years), or None for no expiry; got {ttl_seconds}")
        return (datetime.now(UTC) + timedelta(seconds=ttl_seconds)).isoformat()

    def readable(self, records: Records, owner: str, path: str, what: str = "checkpoint",
                  uid: str | None = None) -> tuple[dict, Path]:
        """A checkpoint's record and directory, checked now: it exists, has not expired, ``owner`` may read it (its
        own, or a published one), and — given ``uid`` — it is still that very save, not a later one under the same
        name. Otherwise "not found", exactly as for a path that never existed."""
        parse_path(path)
        row = records.checkpoints.checkpoint(path, owner)
        if row is None or (uid is not None and row["uid"] != uid):
            raise NotFound(f"{what} {path} not found" if uid is None else
                           f"{what} {path} is no longer available to this key: it was deleted, replaced by a new "
                           "save, unpublished or has expired")
        directory = self.directory(path, row["uid"])
        if not directory.exists():
            raise NotFound(f"{what} {path} not found")
        return row, directory

    def _name_dir(self, path: str) -> Path:
        parsed = parse_path(path)
        return self.root / parsed.training_run_id / parsed.checkpoint_id

    def directory(self, path: str, uid: str) -> Path:
        """Where the save ``uid`` of ``path`` lies."""
        if not uid or not uid.isalnum():
            raise ValueError(f"invalid checkpoint uid {uid!r}")
        return self._name_dir(path) / uid

    @staticmethod
    def sampler_copy(directory: Path) -> Path:
        """Where the samplers' copy of an external checkpoint in ``directory`` lies (``SAMPLER_COPY``)."""
        return directory / SAMPLER_COPY

    @staticmethod
    def files(directory: Path) -> list[str]:
        """The checkpoint's own files, relative to its directory, sorted (not the samplers' copy)."""
        return sorted(f.relative_to(directory).as_posix() for f in directory.rglob("*")
                      if f.is_file() and SAMPLER_COPY not in f.relative_to(directory).parts)

    def staging(self, path: str) -> Path:
        """A fresh hidden directory on the same filesystem as the final one, for the writer to fill."""
        parent = self._name_dir(path)
        parent.mkdir(parents=True, exist_ok=True)
        return parent / f".staging-{uuid.uuid4().hex[:8]}"

    def publish(self, staging: Path, path: str, uid: str) -> int:
        """fsync the staged files, rename the directory into place as save ``uid``, and return its size in bytes (on
        disk: the samplers' copy included). Blocking: callers on the event loop run it in a thread."""
        final = self.directory(path, uid)
        size = 0
        for file in staging.rglob("*"):
            if file.is_file():
                size += file.stat().st_size
                with open(file, "rb") as handle:
                    os.fsync(handle.fileno())
        os.rename(staging, final)
        dir_fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return size

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def delete(self, path: str, uid: str) -> None:
        """Delete the files of save ``uid`` (and the name's directory once no save is left in it)."""
        directory = self.directory(path, uid)
        shutil.rmtree(directory, ignore_errors=True)
        with contextlib.suppress(OSError):  # not empty: a newer save, or one being staged, lives there
            directory.parent.rmdir()
