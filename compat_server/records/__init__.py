"""Everything the server remembers, in one SQLite file (sqlite-utils, WAL). This package is the only code that
touches SQLite: ``base`` opens and upgrades the file (``RecordsFile``), and each other module holds the accessors of
one group of tables over that file. ``Records`` puts the groups together: ``records.runs.model(...)``,
``records.checkpoints.live_checkpoint(...)``.

Every record carries ``owner``: a hash of the API key that created it (never the key), so tenants can be kept apart.
"""

from __future__ import annotations

from pathlib import Path

from compat_server.records.account import AccountRecords
from compat_server.records.base import SCHEMA_VERSION, CorruptRecords, RecordsFile, check_integrity, now
from compat_server.records.checkpoints import CheckpointRecords
from compat_server.records.futures import FutureRecords
from compat_server.records.runs import RunRecords
from compat_server.records.samplers import SamplerRecords
from compat_server.records.sessions import SessionRecords
from compat_server.records.tenants import TenantRecords
from compat_server.records.uploads import UploadRecords


class Records:
    """Typed accessors over the tables, one object per group; callers never write SQL."""

    def __init__(self, path: Path) -> None:
        self.file = RecordsFile(path)
        """The open database (``file.db``), shared by every group."""
        self.account = AccountRecords(self.file)
        """The audit log, usage and session traces a key may ask about (also where the other groups audit)."""
        self.futures = FutureRecords(self.file)
        """Requests' futures and their outcomes."""
        self.sessions = SessionRecords(self.file, self.account)
        """Sessions: created, heartbeating, ended, listed and searched."""
        self.runs = RunRecords(self.file, self.account, self.futures)
        """Training runs and their steps."""
        self.checkpoints = CheckpointRecords(self.file, self.account)
        """Saved checkpoints."""
        self.samplers = SamplerRecords(self.file)
        """Sampling sessions and the stability info recorded for them."""
        self.tenants = TenantRecords(self.file)
        """API keys."""
        self.uploads = UploadRecords(self.file, self.account)
        """Adapter uploads and their files."""


__all__ = ["SCHEMA_VERSION", "CorruptRecords", "Records", "RecordsFile", "check_integrity", "now"]
