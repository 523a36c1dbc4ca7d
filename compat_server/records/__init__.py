"""Everything the server remembers, in one SQLite file (sqlite-utils, WAL). This package is the only code that
touches SQLite: ``base`` opens and upgrades the file, and each other module holds the accessors of one group of tables.

Every record carries ``owner``: a hash of the API key that created it (never the key), so tenants can be kept apart.
"""

from __future__ import annotations

from compat_server.records.account import AccountRecords
from compat_server.records.base import SCHEMA_VERSION, CorruptRecords, check_integrity, now
from compat_server.records.checkpoints import CheckpointRecords
from compat_server.records.runs import RunRecords
from compat_server.records.tenants import TenantRecords


class Records(RunRecords, CheckpointRecords, TenantRecords, AccountRecords):
    """Typed accessors over the tables; callers never write SQL."""


__all__ = ["SCHEMA_VERSION", "CorruptRecords", "Records", "check_integrity", "now"]
