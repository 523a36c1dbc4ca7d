"""Sessions: their creation, heartbeats and end, listing and search, what they hold, and the SDK telemetry counted
per session. A session's requests (its trace) are the account group's (``account``)."""

from __future__ import annotations

import json
from typing import Any

from compat_server.records.account import AccountRecords
from compat_server.records.base import LIVE, RecordsFile, now


class SessionRecords:
    def __init__(self, file: RecordsFile, account: AccountRecords) -> None:
        self.file = file
        self.db = file.db
        self.account = account
        """Where creations are audited."""

    # ---- sessions -------------------------------------------------------------------------------------------------
    def create_session(self, session_id: str, owner: str, *, tags: list[str], user_metadata: dict[str, Any],
                       sdk_version: str | None, project_id: str | None, display_name: str | None = None) -> None:
        stamp = now()
        self.file.insert("sessions", {
            "id": session_id, "owner": owner, "created": stamp, "last_heartbeat": stamp, "tags": json.dumps(tags),
            "user_metadata": json.dumps(user_metadata), "sdk_version": sdk_version, "project_id": project_id,
            "display_name": display_name,
        })
        self.account.audit(owner, "session_create", session_id=session_id, project_id=project_id)

    def session(self, session_id: str, owner: str) -> dict | None:
        return self.file.owned("sessions", session_id, owner)

    def heartbeat(self, session_id: str) -> None:
        self.file.update("sessions", session_id, {"last_heartbeat": now()})

    def stale_sessions(self, heartbeat_before: str) -> list[dict]:
        """Open sessions whose last heartbeat is older than ``heartbeat_before``."""
        return list(self.db["sessions"].rows_where("finished IS NULL AND last_heartbeat < ?", [heartbeat_before]))

    def finish_session(self, session_id: str, reason: str) -> None:
        self.file.update("sessions", session_id, {"finished": now(), "finish_reason": reason})

    def sessions_page(self, owner: str, limit: int, offset: int) -> list[str]:
        return [row["id"] for row in self.db["sessions"].rows_where(
            "owner = ?", [owner], order_by="created, id", limit=limit, offset=offset, select="id")]

    def recent_sessions(self, owner: str, limit: int) -> list[dict]:
        return list(self.db["sessions"].rows_where("owner = ?", [owner], order_by="created desc", limit=limit))

    def session_children(self, session_id: str) -> tuple[list[str], list[str]]:
        """(training run ids, sampler ids) created in a session."""
        runs = [r["id"] for r in self.db["models"].rows_where("session_id = ?", [session_id], order_by="created",
                                                              select="id")]
        samplers = [r["id"] for r in self.db["samplers"].rows_where("session_id = ?", [session_id],
                                                                    order_by="created", select="id")]
        return runs, samplers

    # ---- search and what a session holds --------------------------------------------------------------------------
    def session_owner(self, session_id: str) -> str | None:
        row = self.db.execute("SELECT owner FROM sessions WHERE id = ?", [session_id]).fetchone()
        return None if row is None else row[0]

    def set_session_project(self, session_id: str, project_id: str) -> None:
        self.file.update("sessions", session_id, {"project_id": project_id})

    def search_sessions(self, owner: str, *, before: tuple[str, str] | None, limit: int) -> list[dict]:
        """The owner's sessions newest first, after the page cursor ``(created, id)``; filters are applied by the
        caller on these rows (a key's sessions are few enough to scan)."""
        where, args = "owner = ?", [owner]
        if before is not None:
            where, args = where + " AND (created < ? OR (created = ? AND id < ?))", [*args, before[0], *before]
        return list(self.db["sessions"].rows_where(where, args, order_by="created desc, id desc", limit=limit))

    def session_storage(self, session_id: str) -> tuple[int, int]:
        """(live checkpoints, their bytes) saved by the session's training runs."""
        count, size = self.db.execute(
            f"SELECT count(*), coalesce(sum(size_bytes), 0) FROM checkpoints WHERE {LIVE} AND training_run_id IN "
            "(SELECT id FROM models WHERE session_id = ?)", [now(), session_id]).fetchone()
        return count, size

    # ---- SDK telemetry --------------------------------------------------------------------------------------------
    def count_telemetry(self, owner: str, session_id: str | None, events: int) -> None:
        self.file.insert("telemetry", {"owner": owner, "session_id": session_id, "events": events, "received": now()})
