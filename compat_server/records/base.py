"""The records file itself: opening it (integrity check, WAL), its schema and upgrades, and the helpers every group
of tables shares."""

from __future__ import annotations

import contextlib
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlite_utils

SCHEMA_VERSION = 2
"""2: checkpoints carry ``uid`` (one per save: a later save under the same name never shares it) and sampling
sessions the ``checkpoint_uid`` they were opened on."""

LIVE = "(expires_at is null or expires_at > ?)"
"""Where-clause for checkpoints not yet expired; its parameter is ``now()``."""


_ADDED_COLUMNS = (("checkpoints", "uid", str), ("samplers", "checkpoint_uid", str), ("models", "rolled_back", str),
                  ("models", "rollback_unseen", int), ("api_keys", "admin", int), ("futures", "poll_group", str),
                  ("futures", "completion_seq", int), ("samplers", "clients", int),
                  ("sessions", "display_name", str), ("models", "project_id", str))
"""Columns added since schema 1, added to an older file at open."""


def now() -> str:
    """Timestamps are ISO-8601 UTC strings: sortable, readable in the database, and what the SDK's types parse."""
    return datetime.now(UTC).isoformat()


class CorruptRecords(RuntimeError):
    """The records file fails SQLite's integrity check: the server refuses to start on it rather than serve (and
    write into) a damaged store."""


def check_integrity(path: Path) -> None:
    """``PRAGMA quick_check`` on an existing records file (with its WAL); raises ``CorruptRecords`` saying how to
    recover. Seconds even for a large file: it checks structure, not index contents."""
    if not path.exists():
        return
    try:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            problems = [row[0] for row in conn.execute("PRAGMA quick_check(5)")]
    except sqlite3.DatabaseError as exc:
        problems = [str(exc)]
    if problems != ["ok"]:
        raise CorruptRecords(
            f"the records file {path} is damaged ({'; '.join(problems)}), so the server will not start on it. "
            f"Stop every process using it, then either restore it (and its -wal file) from a backup, or recover what "
            f"SQLite can still read: `sqlite3 {path} .recover | sqlite3 {path}.recovered`, check the result with "
            f"`sqlite3 {path}.recovered 'PRAGMA integrity_check'`, move the damaged file aside and put "
            f"{path.name}.recovered in its place.")


class RecordsFile:
    """The open database, its schema, and the single-row helpers every group of tables (``Records``'s parts)
    shares."""

    def __init__(self, path: Path) -> None:
        check_integrity(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite_utils.Database(path)
        self.db.enable_wal()
        self.db.execute("PRAGMA synchronous=NORMAL")
        self._create_schema()
        self._pks = {table.name: table.pks[0] for table in self.db.tables}
        """Each table's primary-key column, read once from the schema (for ``get`` and ``update``)."""

    def _create_schema(self) -> None:
        db = self.db
        db["schema_version"].create({"version": int, "applied": str}, pk="version", if_not_exists=True)
        db["sessions"].create({
            "id": str, "owner": str, "created": str, "last_heartbeat": str, "tags": str, "user_metadata": str,
            "sdk_version": str, "project_id": str, "finished": str, "finish_reason": str, "display_name": str,
        }, pk="id", if_not_exists=True)
        db["models"].create({
            "id": str, "session_id": str, "owner": str, "base_model": str, "is_lora": int, "lora_rank": int,
            "lora_config": str, "status": str, "created": str, "last_request": str, "user_metadata": str,
            "rolled_back": str, "rollback_unseen": int, "project_id": str,
        }, pk="id", if_not_exists=True)
        db["futures"].create({
            "request_id": str, "owner": str, "model_id": str, "seq_id": int, "kind": str, "state": str,
            "created": str, "finished": str, "media_type": str, "result": bytes, "error": str, "category": str,
            "idempotency_key": str, "poll_group": str, "completion_seq": int,
        }, pk="request_id", if_not_exists=True)
        db["checkpoints"].create({
            "tinker_path": str, "training_run_id": str, "checkpoint_id": str, "kind": str, "owner": str,
            "base_model": str, "size_bytes": int, "created": str, "expires_at": str, "public": int,
            "user_metadata": str, "uid": str,
        }, pk="tinker_path", if_not_exists=True)
        db["samplers"].create({
            "id": str, "session_id": str, "owner": str, "base_model": str, "kind": str, "model_path": str,
            "model_id": str, "adapter_key": str, "adapter_dir": str, "created": str, "checkpoint_uid": str,
            "clients": int,
        }, pk="id", if_not_exists=True)
        db["stability_records"].create({
            "sequence_id": str, "session_id": str, "owner": str, "prompt": str, "tokens": str, "logprobs": str,
            "created": str, "last_used": str,
        }, pk="sequence_id", if_not_exists=True)
        db["uploads"].create({
            "id": str, "owner": str, "base_model": str, "lora_config": str, "project_id": str, "created": str,
            "expires_at": str, "state": str, "tinker_path": str,
        }, pk="id", if_not_exists=True)
        db["upload_files"].create({"upload_id": str, "file": str, "state": str, "bytes": int},
                                  pk=("upload_id", "file"), if_not_exists=True)
        db["api_keys"].create({"id": str, "name": str, "owner": str, "created": str, "revoked": str, "admin": int},
                               pk="id", if_not_exists=True)
        db["audit"].create({"id": int, "owner": str, "at": str, "event": str, "details": str}, pk="id",
                           if_not_exists=True)
        db["audit"].create_index(["owner", "at"], if_not_exists=True)
        db["telemetry"].create({"id": int, "owner": str, "session_id": str, "events": int, "received": str},
                               pk="id", if_not_exists=True)
        db["steps"].create({
            "id": int, "model_id": str, "seq_id": int, "kind": str, "loss_fn": str, "metrics": str, "num_tokens": int,
            "tokens_per_s": float, "created": str,
        }, pk="id", if_not_exists=True)
        db["steps"].create_index(["model_id", "id"], if_not_exists=True)
        db["futures"].create_index(["owner", "idempotency_key"], if_not_exists=True)
        db["models"].create_index(["owner"], if_not_exists=True)
        db["checkpoints"].create_index(["training_run_id"], if_not_exists=True)
        db["stability_records"].create_index(["last_used"], if_not_exists=True)
        db["api_keys"].create_index(["name"], unique=True, if_not_exists=True)
        db["api_keys"].create_index(["owner"], if_not_exists=True)
        self._upgrade()

    def _upgrade(self) -> None:
        """Bring a records file written by an older version up to ``SCHEMA_VERSION``."""
        db = self.db
        versions = [row["version"] for row in db["schema_version"].rows]
        for table, column, kind in _ADDED_COLUMNS:
            if column not in db[table].columns_dict:
                db[table].add_column(column, kind)
        if 1 in versions and 2 not in versions:
            # checkpoints saved before identities existed get one each now; sampling sessions opened on them have
            # none, so they stop at their next use and are opened again (an unknown identity is never trusted)
            with db.conn:
                db.conn.execute("UPDATE checkpoints SET uid = lower(hex(randomblob(16))) WHERE uid IS NULL")
        if SCHEMA_VERSION not in versions:
            db["schema_version"].insert({"version": SCHEMA_VERSION, "applied": now()})
        db["futures"].create_index(["poll_group", "completion_seq"], if_not_exists=True)
        db["checkpoints"].create_index(["created", "uid"], if_not_exists=True)  # checkpoint search's order

    # ---- helpers --------------------------------------------------------------------------------------------------
    # Plain SQL for single rows: these run several times per training step, and sqlite-utils' table methods read the
    # schema (table_info, sqlite_master) on every call, which cost more than the statement itself.
    def get(self, table: str, pk: str) -> dict | None:
        """A row by primary key, or None."""
        cursor = self.db.conn.execute(f"SELECT * FROM [{table}] WHERE [{self._pks[table]}] = ?", [pk])
        row = cursor.fetchone()
        return None if row is None else dict(zip([c[0] for c in cursor.description], row, strict=True))

    def owned(self, table: str, pk: str, owner: str) -> dict | None:
        """A row by primary key, only if ``owner`` owns it: another tenant's rows look exactly like missing ones."""
        row = self.get(table, pk)
        return row if row is not None and row["owner"] == owner else None

    def insert(self, table: str, row: dict[str, Any], replace: bool = False) -> None:
        """Insert ``row`` (``replace``: over the row with the same primary key)."""
        columns = ", ".join(f"[{name}]" for name in row)
        with self.db.conn:
            self.db.conn.execute(f"INSERT {'OR REPLACE ' if replace else ''}INTO [{table}] ({columns}) "
                                 f"VALUES ({', '.join('?' * len(row))})", list(row.values()))

    def update(self, table: str, pk: str, values: dict[str, Any]) -> None:
        """Set ``values`` on the row with primary key ``pk`` (no row: nothing changes)."""
        assignments = ", ".join(f"[{name}] = ?" for name in values)
        with self.db.conn:
            self.db.conn.execute(f"UPDATE [{table}] SET {assignments} WHERE [{self._pks[table]}] = ?",
                                 [*values.values(), pk])
