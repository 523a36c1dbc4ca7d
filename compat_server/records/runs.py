"""Training runs and their steps (the dashboard's loss curves); the sessions they are created in: ``sessions``."""

from __future__ import annotations

import json
from typing import Any

from compat_server.records.account import AccountRecords
from compat_server.records.base import RecordsFile, now
from compat_server.records.futures import FutureRecords
from compat_server.telemetry import RESIDENT_ADAPTERS, traced


class RunRecords:
    def __init__(self, file: RecordsFile, account: AccountRecords, futures: FutureRecords) -> None:
        self.file = file
        self.db = file.db
        self.account = account
        """Where creations are audited."""
        self.futures = futures
        """Whose pending futures ``recover_after_restart`` fails."""

    # ---- models (training runs) -----------------------------------------------------------------------------------
    @traced("records.create_model")
    def create_model(self, model_id: str, *, session_id: str, owner: str, base_model: str, lora: dict[str, Any],
                     user_metadata: dict[str, Any] | None, project_id: str | None = None) -> None:
        """``project_id``: for a run made outside a session (a copy, an upload); a session's runs are in its
        project."""
        stamp = now()
        self.file.insert("models", {
            "id": model_id, "session_id": session_id, "owner": owner, "base_model": base_model, "is_lora": 1,
            "lora_rank": lora["rank"], "lora_config": json.dumps(lora), "status": "active", "created": stamp,
            "last_request": stamp, "user_metadata": json.dumps(user_metadata or {}), "project_id": project_id,
        }, replace=True)
        self.account.audit(owner, "training_run_create", model_id=model_id, session_id=session_id,
                           base_model=base_model)
        RESIDENT_ADAPTERS.add(1)

    def model(self, model_id: str, owner: str) -> dict | None:
        return self.file.owned("models", model_id, owner)

    def models_page(self, owner: str, limit: int, offset: int) -> tuple[list[dict], int]:
        """The owner's training runs, oldest first, one page; and how many there are in all."""
        table = self.db["models"]
        rows = list(table.rows_where("owner = ?", [owner], order_by="created, id", limit=limit, offset=offset))
        return rows, table.count_where("owner = ?", [owner])

    def active_models_of(self, session_id: str) -> list[dict]:
        return list(self.db["models"].rows_where("session_id = ? AND status = 'active'", [session_id]))

    def active_model_count(self, owner: str) -> int:
        return self.db["models"].count_where("owner = ? AND status = 'active'", [owner])

    def active_models_on(self, base_model: str) -> list[dict]:
        return list(self.db["models"].rows_where("base_model = ? AND status = 'active'", [base_model]))

    @traced("records.set_model_status")
    def set_model_status(self, model_id: str, status: str) -> None:
        was = self.file.get("models", model_id)["status"]
        self.file.update("models", model_id, {"status": status, "last_request": now()})
        RESIDENT_ADAPTERS.add((status == "active") - (was == "active"))

    def set_rolled_back(self, model_id: str, notice: str) -> None:
        """Record that the run was rolled back to a checkpoint; its owner's next request on it is told so."""
        self.file.update("models", model_id, {"rolled_back": notice, "rollback_unseen": 1})

    def take_rollback_notice(self, model_id: str) -> str | None:
        """The rollback notice its owner has not been told yet (marked told), or None."""
        with self.db.conn:
            row = self.db.conn.execute("UPDATE models SET rollback_unseen = 0 WHERE id = ? AND rollback_unseen = 1 "
                                       "RETURNING rolled_back", [model_id]).fetchone()
        return row[0] if row else None

    def set_model_lora(self, model_id: str, lora: dict[str, Any]) -> None:
        self.file.update("models", model_id, {"lora_rank": lora["rank"], "lora_config": json.dumps(lora)})

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
                                 self.futures.next_completion(), request_id])
            self.db.execute("UPDATE models SET status = 'unloaded (server restarted)' WHERE status = 'active'")
        return len(pending), models

    # ---- training steps (for the dashboard's loss curves) ---------------------------------------------------------
    @traced("records.add_step")
    def add_step(self, model_id: str, *, seq_id: int, kind: str, loss_fn: str, metrics: dict[str, float],
                 num_tokens: int, tokens_per_s: float) -> None:
        self.file.insert("steps", {"model_id": model_id, "seq_id": seq_id, "kind": kind, "loss_fn": loss_fn,
                                   "metrics": json.dumps(metrics), "num_tokens": num_tokens,
                                   "tokens_per_s": tokens_per_s, "created": now()})

    def steps(self, model_id: str, kind: str, limit: int) -> list[dict]:
        """The run's latest ``limit`` steps of ``kind`` (forward or forward_backward), oldest first, metrics decoded."""
        rows = list(self.db["steps"].rows_where("model_id = ? AND kind = ?", [model_id, kind], order_by="id desc",
                                                limit=limit))
        for row in rows:
            row["metrics"] = json.loads(row["metrics"])
        return rows[::-1]
