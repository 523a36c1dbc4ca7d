"""Checkpoints (each save with its own uid) and the sampling sessions opened on them."""

from __future__ import annotations

import json

from compat_server.records.base import LIVE, RecordsBase, now
from compat_server.telemetry import traced


class CheckpointRecords(RecordsBase):
    # ---- checkpoints ----------------------------------------------------------------------------------------------
    @traced("records.add_checkpoint")
    def add_checkpoint(self, tinker_path: str, *, uid: str, training_run_id: str, checkpoint_id: str, kind: str,
                       owner: str, base_model: str, size_bytes: int, expires_at: str | None,
                       user_metadata: dict[str, str] | None) -> dict | None:
        """Record a new save under ``tinker_path`` (identity ``uid``); returns the record it replaced, if any
        (an overwritten or an expired, not yet swept, checkpoint), whose files the caller deletes."""
        replaced = self._get("checkpoints", tinker_path)
        self._insert("checkpoints", {
            "tinker_path": tinker_path, "training_run_id": training_run_id, "checkpoint_id": checkpoint_id,
            "kind": kind, "owner": owner, "base_model": base_model, "size_bytes": size_bytes, "created": now(),
            "expires_at": expires_at, "public": 0, "user_metadata": json.dumps(user_metadata or {}), "uid": uid,
        }, replace=True)
        self.audit(owner, "checkpoint_create", model_id=training_run_id, tinker_path=tinker_path, kind=kind,
                   base_model=base_model, size_bytes=size_bytes, replaced=replaced is not None)
        return replaced

    def all_checkpoints(self) -> list[dict]:
        """Every recorded checkpoint, expired or not (start-up housekeeping)."""
        return list(self.db["checkpoints"].rows)

    def live_checkpoint(self, tinker_path: str) -> dict | None:
        """A checkpoint's record unless it is missing or expired, whoever owns it (callers check access)."""
        row = self._get("checkpoints", tinker_path)
        if row is None:
            return None
        return None if row["expires_at"] is not None and row["expires_at"] <= now() else row

    def checkpoint(self, tinker_path: str, owner: str) -> dict | None:
        """A checkpoint the owner may read: its own, or one another tenant published; never an expired one."""
        row = self.live_checkpoint(tinker_path)
        return row if row is not None and (row["owner"] == owner or row["public"]) else None

    def models_page(self, owner: str, limit: int, offset: int) -> tuple[list[dict], int]:
        """The owner's training runs, oldest first, one page; and how many there are in all."""
        table = self.db["models"]
        rows = list(table.rows_where("owner = ?", [owner], order_by="created, id", limit=limit, offset=offset))
        return rows, table.count_where("owner = ?", [owner])

    def run_checkpoints(self, training_run_id: str) -> list[dict]:
        return list(self.db["checkpoints"].rows_where(f"training_run_id = ? and {LIVE}", [training_run_id, now()],
                                                      order_by="created"))

    def user_checkpoints(self, owner: str, limit: int, offset: int) -> tuple[list[dict], int]:
        table, where, args = self.db["checkpoints"], f"owner = ? and {LIVE}", [owner, now()]
        rows = list(table.rows_where(where, args, order_by="created desc", limit=limit, offset=offset))
        return rows, table.count_where(where, args)

    def set_checkpoint_expiry(self, tinker_path: str, expires_at: str | None) -> None:
        self._update("checkpoints", tinker_path, {"expires_at": expires_at})

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
        self._update("checkpoints", tinker_path, {"public": int(public)})

    def sessions_page(self, owner: str, limit: int, offset: int) -> list[str]:
        return [row["id"] for row in self.db["sessions"].rows_where(
            "owner = ?", [owner], order_by="created, id", limit=limit, offset=offset, select="id")]

    def recent_sessions(self, owner: str, limit: int) -> list[dict]:
        return list(self.db["sessions"].rows_where("owner = ?", [owner], order_by="created desc", limit=limit))

    def recent_failures(self, owner: str, limit: int) -> list[dict]:
        """The owner's latest failed futures (the dashboard's recent errors)."""
        return list(self.db["futures"].rows_where(
            "owner = ? AND state = 'failed'", [owner], order_by="finished desc", limit=limit,
            select="request_id, model_id, kind, finished, error, category"))

    def session_children(self, session_id: str) -> tuple[list[str], list[str]]:
        """(training run ids, sampler ids) created in a session."""
        runs = [r["id"] for r in self.db["models"].rows_where("session_id = ?", [session_id], order_by="created",
                                                              select="id")]
        samplers = [r["id"] for r in self.db["samplers"].rows_where("session_id = ?", [session_id],
                                                                    order_by="created", select="id")]
        return runs, samplers

    def sampler_checkpoints(self, owner: str) -> list[dict]:
        """Sampler checkpoints the owner may sample from (its own and published ones), oldest first."""
        return list(self.db["checkpoints"].rows_where(f"kind = 'sampler' and (owner = ? or public = 1) and {LIVE}",
                                                      [owner, now()],
                                                      order_by="created"))

    # ---- sampling sessions ----------------------------------------------------------------------------------------
    def create_sampler(self, sampler_id: str, *, session_id: str, owner: str, base_model: str, kind: str,
                       model_path: str | None = None, model_id: str | None = None, adapter_key: str | None = None,
                       adapter_dir: str | None = None, checkpoint_uid: str | None = None) -> None:
        """``kind`` is ``base``, ``checkpoint`` (a saved sampler checkpoint), ``snapshot`` (ephemeral weights saved
        by save_weights_and_get_sampling_client) or ``inflight`` (the training model's shared, mutable weights)."""
        self._insert("samplers", {
            "id": sampler_id, "session_id": session_id, "owner": owner, "base_model": base_model, "kind": kind,
            "model_path": model_path, "model_id": model_id, "adapter_key": adapter_key, "adapter_dir": adapter_dir,
            "created": now(), "checkpoint_uid": checkpoint_uid,
        })

    def sampler(self, sampler_id: str, owner: str) -> dict | None:
        return self._owned("samplers", sampler_id, owner)

    def join_sampler(self, sampler_id: str, owner: str) -> int | None:
        """The next clone number of a sampling session (``join_sampling_session``; the original client is 0), or
        None if ``owner`` has no such session. Counted in the file, so numbers are never reused, even across
        restarts."""
        with self.db.conn:
            updated = self.db.execute("UPDATE samplers SET clients = coalesce(clients, 0) + 1 WHERE id = ? AND "
                                      "owner = ? RETURNING clients", [sampler_id, owner]).fetchone()
        return None if updated is None else updated[0]

