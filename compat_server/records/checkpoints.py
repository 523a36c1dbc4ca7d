"""Checkpoints: each save with its own uid, its expiry and whether it is published."""

from __future__ import annotations

import json

from compat_server.records.account import AccountRecords
from compat_server.records.base import LIVE, RecordsFile, now
from compat_server.telemetry import traced


class CheckpointRecords:
    def __init__(self, file: RecordsFile, account: AccountRecords) -> None:
        self.file = file
        self.db = file.db
        self.account = account
        """Where saves are audited."""

    @traced("records.add_checkpoint")
    def add_checkpoint(self, tinker_path: str, *, uid: str, training_run_id: str, checkpoint_id: str, kind: str,
                       owner: str, base_model: str, size_bytes: int, expires_at: str | None,
                       user_metadata: dict[str, str] | None) -> dict | None:
        """Record a new save under ``tinker_path`` (identity ``uid``); returns the record it replaced, if any
        (an overwritten or an expired, not yet swept, checkpoint), whose files the caller deletes."""
        replaced = self.file.get("checkpoints", tinker_path)
        self.file.insert("checkpoints", {
            "tinker_path": tinker_path, "training_run_id": training_run_id, "checkpoint_id": checkpoint_id,
            "kind": kind, "owner": owner, "base_model": base_model, "size_bytes": size_bytes, "created": now(),
            "expires_at": expires_at, "public": 0, "user_metadata": json.dumps(user_metadata or {}), "uid": uid,
        }, replace=True)
        self.account.audit(owner, "checkpoint_create", model_id=training_run_id, tinker_path=tinker_path, kind=kind,
                           base_model=base_model, size_bytes=size_bytes, replaced=replaced is not None)
        return replaced

    def all_checkpoints(self) -> list[dict]:
        """Every recorded checkpoint, expired or not (start-up housekeeping)."""
        return list(self.db["checkpoints"].rows)

    def live_checkpoint(self, tinker_path: str) -> dict | None:
        """A checkpoint's record unless it is missing or expired, whoever owns it (callers check access)."""
        row = self.file.get("checkpoints", tinker_path)
        if row is None:
            return None
        return None if row["expires_at"] is not None and row["expires_at"] <= now() else row

    def checkpoint(self, tinker_path: str, owner: str) -> dict | None:
        """A checkpoint the owner may read: its own, or one another tenant published; never an expired one."""
        row = self.live_checkpoint(tinker_path)
        return row if row is not None and (row["owner"] == owner or row["public"]) else None

    def run_checkpoints(self, training_run_id: str) -> list[dict]:
        return list(self.db["checkpoints"].rows_where(f"training_run_id = ? and {LIVE}", [training_run_id, now()],
                                                      order_by="created"))

    def user_checkpoints(self, owner: str, limit: int, offset: int) -> tuple[list[dict], int]:
        table, where, args = self.db["checkpoints"], f"owner = ? and {LIVE}", [owner, now()]
        rows = list(table.rows_where(where, args, order_by="created desc", limit=limit, offset=offset))
        return rows, table.count_where(where, args)

    def readable_page(self, owner: str, *, before: tuple[str, str] | None, limit: int, whose: str = "accessible",
                      owner_prefixes: list[str] | None = None, kind: str | None = None,
                      base_models: list[str] | None = None, projects: list[str] | None = None) -> list[dict]:
        """Live checkpoints ``owner`` may read (its own and published ones) newest first, after the page cursor
        ``(created, uid)``, each with the project it is in (its run's, else its session's, else ``default``), those
        filters applied: ``whose`` ``own`` (the key's alone) or ``accessible``; owners whose identity starts with
        one of ``owner_prefixes``; a checkpoint type; base models; projects (each None: any)."""
        clauses = ["c.owner = ?" if whose == "own" else "(c.owner = ? OR c.public = 1)",
                   LIVE.replace("expires_at", "c.expires_at")]
        args: list = [owner, now()]
        for column, values in (("substr(c.owner, 1, 16)", owner_prefixes), ("c.base_model", base_models),
                               ("coalesce(m.project_id, s.project_id, 'default')", projects)):
            if values is not None:
                clauses.append(f"{column} IN ({', '.join('?' * len(values))})")
                args += values
        if kind is not None:
            clauses.append("c.kind = ?")
            args.append(kind)
        if before is not None:
            clauses.append("(c.created < ? OR (c.created = ? AND c.uid < ?))")
            args += [before[0], *before]
        cursor = self.db.execute(
            f"SELECT c.*, coalesce(m.project_id, s.project_id, 'default') AS project_id FROM checkpoints c "
            f"LEFT JOIN models m ON m.id = c.training_run_id LEFT JOIN sessions s ON s.id = m.session_id "
            f"WHERE {' AND '.join(clauses)} ORDER BY c.created DESC, c.uid DESC LIMIT ?", [*args, limit])
        names = [column[0] for column in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]

    def projects(self, owner: str) -> set[str]:
        """The projects ``owner`` may list: ``default`` and every one its sessions or runs are in."""
        rows = self.db.execute("SELECT project_id FROM sessions WHERE owner = ? UNION SELECT project_id FROM models "
                               "WHERE owner = ?", [owner, owner]).fetchall()
        return {"default"} | {row[0] for row in rows if row[0]}

    def sampler_checkpoints(self, owner: str) -> list[dict]:
        """Sampler and external checkpoints the owner may read (its own and published ones), oldest first: what it
        may sample (an external one, where its samplers' copy exists)."""
        return list(self.db["checkpoints"].rows_where(f"kind in ('sampler', 'external') and (owner = ? or public = 1) "
                                                      f"and {LIVE}",
                                                      [owner, now()],
                                                      order_by="created"))

    def set_checkpoint_expiry(self, tinker_path: str, expires_at: str | None) -> None:
        self.file.update("checkpoints", tinker_path, {"expires_at": expires_at})

    def expired_checkpoints(self) -> list[tuple[str, str]]:
        """(path, uid) of checkpoints whose expiry has passed (still recorded until the sweep deletes them)."""
        return [(row["tinker_path"], row["uid"]) for row in self.db["checkpoints"].rows_where(
            "expires_at is not null and expires_at <= ?", [now()], select="tinker_path, uid")]

    def delete_checkpoint(self, tinker_path: str, uid: str) -> bool:
        """Forget the checkpoint saved as ``uid`` (never a later save under the same path); False if it is gone."""
        with self.db.conn:
            return self.db.conn.execute("DELETE FROM checkpoints WHERE tinker_path = ? AND uid = ?",
                                        [tinker_path, uid]).rowcount > 0

    def set_checkpoint_public(self, tinker_path: str, public: bool) -> None:
        self.file.update("checkpoints", tinker_path, {"public": int(public)})
