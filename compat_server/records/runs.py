"""Sessions, training runs, their steps (the dashboard's loss curves) and futures."""

from __future__ import annotations

import itertools
import json
from typing import Any

from compat_server.records.base import RecordsBase, now
from compat_server.telemetry import RESIDENT_ADAPTERS, traced


class RunRecords(RecordsBase):
    # ---- sessions -------------------------------------------------------------------------------------------------
    def create_session(self, session_id: str, owner: str, *, tags: list[str], user_metadata: dict[str, Any],
                       sdk_version: str | None, project_id: str | None, display_name: str | None = None) -> None:
        stamp = now()
        self._insert("sessions", {
            "id": session_id, "owner": owner, "created": stamp, "last_heartbeat": stamp, "tags": json.dumps(tags),
            "user_metadata": json.dumps(user_metadata), "sdk_version": sdk_version, "project_id": project_id,
            "display_name": display_name,
        })
        self.audit(owner, "session_create", session_id=session_id, project_id=project_id)

    def session(self, session_id: str, owner: str) -> dict | None:
        return self._owned("sessions", session_id, owner)

    def heartbeat(self, session_id: str) -> None:
        self._update("sessions", session_id, {"last_heartbeat": now()})

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
        self._update("sessions", session_id, {"finished": now(), "finish_reason": reason})

    def count_telemetry(self, owner: str, session_id: str | None, events: int) -> None:
        self._insert("telemetry", {"owner": owner, "session_id": session_id, "events": events, "received": now()})

    # ---- models (training runs) -----------------------------------------------------------------------------------
    @traced("records.create_model")
    def create_model(self, model_id: str, *, session_id: str, owner: str, base_model: str, lora: dict[str, Any],
                     user_metadata: dict[str, Any] | None) -> None:
        stamp = now()
        self._insert("models", {
            "id": model_id, "session_id": session_id, "owner": owner, "base_model": base_model, "is_lora": 1,
            "lora_rank": lora["rank"], "lora_config": json.dumps(lora), "status": "active", "created": stamp,
            "last_request": stamp, "user_metadata": json.dumps(user_metadata or {}),
        }, replace=True)
        self.audit(owner, "training_run_create", model_id=model_id, session_id=session_id, base_model=base_model)
        RESIDENT_ADAPTERS.add(1)

    def model(self, model_id: str, owner: str) -> dict | None:
        return self._owned("models", model_id, owner)

    @traced("records.set_model_status")
    def set_model_status(self, model_id: str, status: str) -> None:
        was = self._get("models", model_id)["status"]
        self._update("models", model_id, {"status": status, "last_request": now()})
        RESIDENT_ADAPTERS.add((status == "active") - (was == "active"))

    def set_rolled_back(self, model_id: str, notice: str) -> None:
        """Record that the run was rolled back to a checkpoint; its owner's next request on it is told so."""
        self._update("models", model_id, {"rolled_back": notice, "rollback_unseen": 1})

    def take_rollback_notice(self, model_id: str) -> str | None:
        """The rollback notice its owner has not been told yet (marked told), or None."""
        with self.db.conn:
            row = self.db.conn.execute("UPDATE models SET rollback_unseen = 0 WHERE id = ? AND rollback_unseen = 1 "
                                       "RETURNING rolled_back", [model_id]).fetchone()
        return row[0] if row else None

    def set_model_lora(self, model_id: str, lora: dict[str, Any]) -> None:
        self._update("models", model_id, {"lora_rank": lora["rank"], "lora_config": json.dumps(lora)})

    # ---- training steps (for the dashboard's loss curves) ---------------------------------------------------------
    @traced("records.add_step")
    def add_step(self, model_id: str, *, seq_id: int, kind: str, loss_fn: str, metrics: dict[str, float],
                 num_tokens: int, tokens_per_s: float) -> None:
        self._insert("steps", {"model_id": model_id, "seq_id": seq_id, "kind": kind, "loss_fn": loss_fn,
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
        pending = [row[0] for row in self.db.execute("SELECT request_id FROM futures WHERE state = 'pending'")]
        models = self.db["models"].count_where("status = 'active'")
        with self.db.conn:
            for request_id in pending:  # numbered as they finish, so a retrieve_futures poller hears of them too
                self.db.execute("UPDATE futures SET state = 'failed', category = 'server', error = ?, finished = ?, "
                                "completion_seq = ? WHERE request_id = ?",
                                ["the server restarted before this request finished; resubmit it", now(),
                                 self._next_completion(), request_id])
            self.db.execute("UPDATE models SET status = 'unloaded (server restarted)' WHERE status = 'active'")
        return len(pending), models

    # ---- futures --------------------------------------------------------------------------------------------------
    @traced("records.create_future")
    def create_future(self, request_id: str, *, owner: str, model_id: str | None, seq_id: int | None, kind: str,
                      idempotency_key: str | None, poll_group: str | None = None) -> None:
        """``poll_group`` names the futures one ``retrieve_futures`` poll covers (a sampling session's clone)."""
        self._insert("futures", {
            "request_id": request_id, "owner": owner, "model_id": model_id, "seq_id": seq_id, "kind": kind,
            "state": "pending", "created": now(), "idempotency_key": idempotency_key, "poll_group": poll_group,
        })

    def future_by_idempotency_key(self, owner: str, key: str) -> dict | None:
        rows = list(self.db["futures"].rows_where("owner = ? and idempotency_key = ?", [owner, key], limit=1))
        return rows[0] if rows else None

    @traced("records.finish_future")
    def finish_future(self, request_id: str, *, media_type: str, result: bytes) -> None:
        self._update("futures", request_id, {"state": "complete", "finished": now(), "media_type": media_type,
                                             "result": result, "completion_seq": self._next_completion()})

    @traced("records.fail_future")
    def fail_future(self, request_id: str, *, error: str, category: str) -> None:
        self._update("futures", request_id, {"state": "failed", "finished": now(), "error": error,
                                             "category": category, "completion_seq": self._next_completion()})

    @traced("records.future")
    def future(self, request_id: str, owner: str) -> dict | None:
        return self._owned("futures", request_id, owner)

    def _next_completion(self) -> int:
        """Finished futures are numbered in the order they finish: the cursor of ``retrieve_futures``. The
        numbering goes on from the file's highest, so a cursor a client holds across a restart stays meaningful."""
        if self._completions is None:
            highest = self.db.execute("SELECT max(completion_seq) FROM futures").fetchone()[0] or 0
            self._completions = itertools.count(highest + 1)
        return next(self._completions)

    def completions_after(self, owner: str, poll_group: str, cursor: int, limit: int) -> list[dict]:
        """The group's futures finished after ``cursor``, oldest first (request id, state, payload size, seq)."""
        return [dict(zip(("request_id", "state", "size", "completion_seq"), row)) for row in self.db.execute(
            "SELECT request_id, state, length(result), completion_seq FROM futures WHERE poll_group = ? AND owner = ? "
            "AND completion_seq > ? ORDER BY completion_seq LIMIT ?", [poll_group, owner, cursor, limit])]

    def forget_results(self, owner: str, poll_group: str, request_ids: list[str]) -> None:
        """Drop the payloads a client reports fully retrieved (``retrieved_request_ids``); their state stays."""
        with self.db.conn:  # one committed transaction, like every other write here
            self.db.conn.executemany("UPDATE futures SET result = NULL WHERE request_id = ? AND owner = ? AND "
                                     "poll_group = ? AND state = 'complete'",
                                     [(request_id, owner, poll_group) for request_id in request_ids])

