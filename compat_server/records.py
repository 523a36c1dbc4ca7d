"""Everything the server remembers, in one SQLite file (sqlite-utils, WAL). The only module that touches SQLite.

Every record carries ``owner``: a hash of the API key that created it (never the key), so tenants can be kept apart.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlite_utils
from sqlite_utils.db import NotFoundError

from compat_server.telemetry import RESIDENT_ADAPTERS, traced

SCHEMA_VERSION = 2
"""2: checkpoints carry ``uid`` (one per save: a later save under the same name never shares it) and sampling
sessions the ``checkpoint_uid`` they were opened on."""

_LIVE = "(expires_at is null or expires_at > ?)"
"""Where-clause for checkpoints not yet expired; its parameter is ``now()``."""


_ADDED_COLUMNS = (("checkpoints", "uid", str), ("samplers", "checkpoint_uid", str), ("models", "rolled_back", str),
                  ("models", "rollback_unseen", int), ("api_keys", "admin", int))
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


class Records:
    """Typed accessors over the tables; callers never write SQL."""

    def __init__(self, path: Path) -> None:
        check_integrity(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite_utils.Database(path)
        self.db.enable_wal()
        self.db.execute("PRAGMA synchronous=NORMAL")
        self._create_schema()

    def _create_schema(self) -> None:
        db = self.db
        db["schema_version"].create({"version": int, "applied": str}, pk="version", if_not_exists=True)
        db["sessions"].create({
            "id": str, "owner": str, "created": str, "last_heartbeat": str, "tags": str, "user_metadata": str,
            "sdk_version": str, "project_id": str, "finished": str, "finish_reason": str,
        }, pk="id", if_not_exists=True)
        db["models"].create({
            "id": str, "session_id": str, "owner": str, "base_model": str, "is_lora": int, "lora_rank": int,
            "lora_config": str, "status": str, "created": str, "last_request": str, "user_metadata": str,
            "rolled_back": str, "rollback_unseen": int,
        }, pk="id", if_not_exists=True)
        db["futures"].create({
            "request_id": str, "owner": str, "model_id": str, "seq_id": int, "kind": str, "state": str,
            "created": str, "finished": str, "media_type": str, "result": bytes, "error": str, "category": str,
            "idempotency_key": str,
        }, pk="request_id", if_not_exists=True)
        db["checkpoints"].create({
            "tinker_path": str, "training_run_id": str, "checkpoint_id": str, "kind": str, "owner": str,
            "base_model": str, "size_bytes": int, "created": str, "expires_at": str, "public": int,
            "user_metadata": str, "uid": str,
        }, pk="tinker_path", if_not_exists=True)
        db["samplers"].create({
            "id": str, "session_id": str, "owner": str, "base_model": str, "kind": str, "model_path": str,
            "model_id": str, "adapter_key": str, "adapter_dir": str, "created": str, "checkpoint_uid": str,
        }, pk="id", if_not_exists=True)
        db["stability_records"].create({
            "sequence_id": str, "session_id": str, "owner": str, "prompt": str, "tokens": str, "logprobs": str,
            "created": str, "last_used": str,
        }, pk="sequence_id", if_not_exists=True)
        db["api_keys"].create({"id": str, "name": str, "owner": str, "created": str, "revoked": str, "admin": int},
                               pk="id", if_not_exists=True)
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

    # ---- sessions -------------------------------------------------------------------------------------------------
    def create_session(self, session_id: str, owner: str, *, tags: list[str], user_metadata: dict[str, Any],
                       sdk_version: str | None, project_id: str | None) -> None:
        stamp = now()
        self.db["sessions"].insert({
            "id": session_id, "owner": owner, "created": stamp, "last_heartbeat": stamp, "tags": json.dumps(tags),
            "user_metadata": json.dumps(user_metadata), "sdk_version": sdk_version, "project_id": project_id,
        })

    def session(self, session_id: str, owner: str) -> dict | None:
        return self._owned("sessions", session_id, owner)

    def heartbeat(self, session_id: str) -> None:
        self.db["sessions"].update(session_id, {"last_heartbeat": now()})

    def stale_sessions(self, heartbeat_before: str) -> list[dict]:
        """Open sessions whose last heartbeat is older than ``heartbeat_before``."""
        return list(self.db["sessions"].rows_where("finished IS NULL AND last_heartbeat < ?", [heartbeat_before]))

    def active_models_of(self, session_id: str) -> list[dict]:
        return list(self.db["models"].rows_where("session_id = ? AND status = 'active'", [session_id]))

    def active_model_count(self, owner: str) -> int:
        return self.db["models"].count_where("owner = ? AND status = 'active'", [owner])

    def active_models_on(self, base_model: str) -> list[dict]:
        return list(self.db["models"].rows_where("base_model = ? AND status = 'active'", [base_model]))

    def finish_session(self, session_id: str, reason: str) -> None:
        self.db["sessions"].update(session_id, {"finished": now(), "finish_reason": reason})

    def count_telemetry(self, owner: str, session_id: str | None, events: int) -> None:
        self.db["telemetry"].insert({"owner": owner, "session_id": session_id, "events": events, "received": now()})

    # ---- models (training runs) -----------------------------------------------------------------------------------
    @traced("records.create_model")
    def create_model(self, model_id: str, *, session_id: str, owner: str, base_model: str, lora: dict[str, Any],
                     user_metadata: dict[str, Any] | None) -> None:
        stamp = now()
        self.db["models"].insert({
            "id": model_id, "session_id": session_id, "owner": owner, "base_model": base_model, "is_lora": 1,
            "lora_rank": lora["rank"], "lora_config": json.dumps(lora), "status": "active", "created": stamp,
            "last_request": stamp, "user_metadata": json.dumps(user_metadata or {}),
        }, replace=True)
        RESIDENT_ADAPTERS.add(1)

    def model(self, model_id: str, owner: str) -> dict | None:
        return self._owned("models", model_id, owner)

    @traced("records.set_model_status")
    def set_model_status(self, model_id: str, status: str) -> None:
        was = self.db["models"].get(model_id)["status"]
        self.db["models"].update(model_id, {"status": status, "last_request": now()})
        RESIDENT_ADAPTERS.add((status == "active") - (was == "active"))

    def set_rolled_back(self, model_id: str, notice: str) -> None:
        """Record that the run was rolled back to a checkpoint; its owner's next request on it is told so."""
        self.db["models"].update(model_id, {"rolled_back": notice, "rollback_unseen": 1})

    def take_rollback_notice(self, model_id: str) -> str | None:
        """The rollback notice its owner has not been told yet (marked told), or None."""
        with self.db.conn:
            row = self.db.conn.execute("UPDATE models SET rollback_unseen = 0 WHERE id = ? AND rollback_unseen = 1 "
                                       "RETURNING rolled_back", [model_id]).fetchone()
        return row[0] if row else None

    def set_model_lora(self, model_id: str, lora: dict[str, Any]) -> None:
        self.db["models"].update(model_id, {"lora_rank": lora["rank"], "lora_config": json.dumps(lora)})

    # ---- training steps (for the dashboard's loss curves) ---------------------------------------------------------
    @traced("records.add_step")
    def add_step(self, model_id: str, *, seq_id: int, kind: str, loss_fn: str, metrics: dict[str, float],
                 num_tokens: int, tokens_per_s: float) -> None:
        self.db["steps"].insert({"model_id": model_id, "seq_id": seq_id, "kind": kind, "loss_fn": loss_fn,
                                 "metrics": json.dumps(metrics), "num_tokens": num_tokens,
                                 "tokens_per_s": tokens_per_s, "created": now()})

    def steps(self, model_id: str, kind: str, limit: int) -> list[dict]:
        """The run's latest ``limit`` steps of ``kind`` (forward or forward_backward), oldest first, metrics decoded."""
        rows = list(self.db["steps"].rows_where("model_id = ? AND kind = ?", [model_id, kind], order_by="id desc",
                                                limit=limit))
        for row in rows:
            row["metrics"] = json.loads(row["metrics"])
        return rows[::-1]

    def recover_after_restart(self) -> tuple[int, int]:
        """At start-up nothing runs yet and the trainers are empty: every pending future was abandoned by a previous
        process (it fails as a server error), and every active model must be reloaded from a checkpoint
        (create_training_client_from_state). Returns (futures failed, models unloaded)."""
        futures = self.db["futures"].count_where("state = 'pending'")
        models = self.db["models"].count_where("status = 'active'")
        with self.db.conn:
            self.db.execute("UPDATE futures SET state = 'failed', category = 'server', error = ?, finished = ? "
                            "WHERE state = 'pending'",
                            ["the server restarted before this request finished; resubmit it", now()])
            self.db.execute("UPDATE models SET status = 'unloaded (server restarted)' WHERE status = 'active'")
        return futures, models

    # ---- futures --------------------------------------------------------------------------------------------------
    @traced("records.create_future")
    def create_future(self, request_id: str, *, owner: str, model_id: str | None, seq_id: int | None, kind: str,
                      idempotency_key: str | None) -> None:
        self.db["futures"].insert({
            "request_id": request_id, "owner": owner, "model_id": model_id, "seq_id": seq_id, "kind": kind,
            "state": "pending", "created": now(), "idempotency_key": idempotency_key,
        })

    def future_by_idempotency_key(self, owner: str, key: str) -> dict | None:
        rows = list(self.db["futures"].rows_where("owner = ? and idempotency_key = ?", [owner, key], limit=1))
        return rows[0] if rows else None

    @traced("records.finish_future")
    def finish_future(self, request_id: str, *, media_type: str, result: bytes) -> None:
        self.db["futures"].update(request_id, {"state": "complete", "finished": now(), "media_type": media_type,
                                               "result": result})

    @traced("records.fail_future")
    def fail_future(self, request_id: str, *, error: str, category: str) -> None:
        self.db["futures"].update(request_id, {"state": "failed", "finished": now(), "error": error,
                                               "category": category})

    @traced("records.future")
    def future(self, request_id: str, owner: str) -> dict | None:
        return self._owned("futures", request_id, owner)

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    @traced("records.add_checkpoint")
    def add_checkpoint(self, tinker_path: str, *, uid: str, training_run_id: str, checkpoint_id: str, kind: str,
                       owner: str, base_model: str, size_bytes: int, expires_at: str | None,
                       user_metadata: dict[str, str] | None) -> dict | None:
        """Record a new save under ``tinker_path`` (identity ``uid``); returns the record it replaced, if any
        (an overwritten or an expired, not yet swept, checkpoint), whose files the caller deletes."""
        try:
            replaced = self.db["checkpoints"].get(tinker_path)
        except NotFoundError:
            replaced = None
        self.db["checkpoints"].insert({
            "tinker_path": tinker_path, "training_run_id": training_run_id, "checkpoint_id": checkpoint_id,
            "kind": kind, "owner": owner, "base_model": base_model, "size_bytes": size_bytes, "created": now(),
            "expires_at": expires_at, "public": 0, "user_metadata": json.dumps(user_metadata or {}), "uid": uid,
        }, replace=True)
        return replaced

    def all_checkpoints(self) -> list[dict]:
        """Every recorded checkpoint, expired or not (start-up housekeeping)."""
        return list(self.db["checkpoints"].rows)

    def live_checkpoint(self, tinker_path: str) -> dict | None:
        """A checkpoint's record unless it is missing or expired, whoever owns it (callers check access)."""
        try:
            row = self.db["checkpoints"].get(tinker_path)
        except NotFoundError:
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
        return list(self.db["checkpoints"].rows_where(f"training_run_id = ? and {_LIVE}", [training_run_id, now()],
                                                      order_by="created"))

    def user_checkpoints(self, owner: str, limit: int, offset: int) -> tuple[list[dict], int]:
        table, where, args = self.db["checkpoints"], f"owner = ? and {_LIVE}", [owner, now()]
        rows = list(table.rows_where(where, args, order_by="created desc", limit=limit, offset=offset))
        return rows, table.count_where(where, args)

    def set_checkpoint_expiry(self, tinker_path: str, expires_at: str | None) -> None:
        self.db["checkpoints"].update(tinker_path, {"expires_at": expires_at})

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
        self.db["checkpoints"].update(tinker_path, {"public": int(public)})

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
        return list(self.db["checkpoints"].rows_where(f"kind = 'sampler' and (owner = ? or public = 1) and {_LIVE}",
                                                      [owner, now()],
                                                      order_by="created"))

    # ---- sampling sessions ----------------------------------------------------------------------------------------
    def create_sampler(self, sampler_id: str, *, session_id: str, owner: str, base_model: str, kind: str,
                       model_path: str | None = None, model_id: str | None = None, adapter_key: str | None = None,
                       adapter_dir: str | None = None, checkpoint_uid: str | None = None) -> None:
        """``kind`` is ``base``, ``checkpoint`` (a saved sampler checkpoint), ``snapshot`` (ephemeral weights saved
        by save_weights_and_get_sampling_client) or ``inflight`` (the training model's shared, mutable weights)."""
        self.db["samplers"].insert({
            "id": sampler_id, "session_id": session_id, "owner": owner, "base_model": base_model, "kind": kind,
            "model_path": model_path, "model_id": model_id, "adapter_key": adapter_key, "adapter_dir": adapter_dir,
            "created": now(), "checkpoint_uid": checkpoint_uid,
        })

    def sampler(self, sampler_id: str, owner: str) -> dict | None:
        return self._owned("samplers", sampler_id, owner)

    # ---- API keys (--auth keys) ----------------------------------------------------------------------------------
    def add_key(self, key_id: str, name: str, owner: str, admin: bool = False) -> None:
        """Register a key by its tenant hash (the key itself is never stored)."""
        if self.db["api_keys"].count_where("name = ?", [name]):
            raise ValueError(f"a key named {name!r} already exists")
        self.db["api_keys"].insert({"id": key_id, "name": name, "owner": owner, "created": now(), "revoked": None,
                                    "admin": int(admin)})

    def api_keys(self) -> list[dict]:
        return list(self.db["api_keys"].rows_where(order_by="created", select="id, name, created, revoked, admin"))

    def is_admin(self, owner: str) -> bool:
        """An operator key (``keys create --admin``), not revoked: it may see server-wide figures."""
        return self.db["api_keys"].count_where("owner = ? AND revoked IS NULL AND admin = 1", [owner]) > 0

    def revoke_key(self, name_or_id: str) -> bool:
        """Revoke by name or id; False when no active key matches."""
        with self.db.conn:
            return self.db.conn.execute("UPDATE api_keys SET revoked = ? WHERE (name = ? OR id = ?) AND revoked IS NULL",
                                        [now(), name_or_id, name_or_id]).rowcount > 0

    def key_active(self, owner: str) -> bool:
        return self.db["api_keys"].count_where("owner = ? AND revoked IS NULL", [owner]) > 0

    # ---- stability info (stable_reinforce) -------------------------------------------------------------------------
    def record_sequences(self, owner: str, session_id: str,
                         sequences: list[tuple[str, list[int], list[int], list[float]]]) -> None:
        """Store (sequence_id, prompt, sampled tokens, sampler logprobs) per sampled sequence; a retried request
        replaces its own rows."""
        stamp = now()
        self.db["stability_records"].insert_all(({
            "sequence_id": sequence_id, "session_id": session_id, "owner": owner, "prompt": json.dumps(prompt),
            "tokens": json.dumps(tokens), "logprobs": json.dumps(logprobs), "created": stamp, "last_used": stamp,
        } for sequence_id, prompt, tokens, logprobs in sequences), replace=True)

    def recorded_sequence(self, sequence_id: str, owner: str) -> dict | None:
        row = self._owned("stability_records", sequence_id, owner)
        if row is not None:
            row.update({key: json.loads(row[key]) for key in ("prompt", "tokens", "logprobs")})
        return row

    def touch_sequences(self, sequence_ids: list[str]) -> None:
        stamp = now()
        with self.db.conn:
            self.db.conn.executemany("UPDATE stability_records SET last_used = ? WHERE sequence_id = ?",
                                     [(stamp, sid) for sid in sequence_ids])

    def purge_sequences(self, unused_since: str) -> int:
        """Delete stability records not used since ``unused_since``; returns how many."""
        with self.db.conn:
            return self.db.conn.execute("DELETE FROM stability_records WHERE last_used < ?", [unused_since]).rowcount

    # ---- helpers --------------------------------------------------------------------------------------------------
    def _owned(self, table: str, pk: str, owner: str) -> dict | None:
        """A row by primary key, only if ``owner`` owns it: another tenant's rows look exactly like missing ones."""
        try:
            row = self.db[table].get(pk)
        except NotFoundError:
            return None
        return row if row["owner"] == owner else None
