"""What a key can ask about its own account: the audit log of its mutating actions, checkpoint storage, hourly usage,
and the timeline of a session's requests (the trace export)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from compat_server.records.base import LIVE, RecordsFile, now

AUDITED_RESOURCES = {"checkpoints": "checkpoint_", "projects": "project_"}
"""``get_audit_log(event_type=…)`` → the event-name prefix it selects; sessions, runs and key use show under "all"."""


class AccountRecords:
    def __init__(self, file: RecordsFile) -> None:
        self.file = file
        self.db = file.db
        self._key_days: set[tuple[str, str]] = set()
        """(owner, UTC day) whose key use is already in the audit log."""

    # ---- audit log ------------------------------------------------------------------------------------------------
    def audit(self, owner: str, event: str, **details: Any) -> None:
        """Record one of ``owner``'s actions as ``<resource>_<action>`` with what it was about."""
        self.file.insert("audit", {"owner": owner, "at": now(), "event": event, "details": json.dumps(details)})

    def note_key_use(self, owner: str) -> None:
        """``apikey_use``, once per key per UTC day (every request would flood the log)."""
        day = datetime.now(UTC).date().isoformat()
        if (owner, day) in self._key_days:
            return
        self._key_days.add((owner, day))
        if not self.db["audit"].count_where("owner = ? AND event = 'apikey_use' AND at >= ?", [owner, day]):
            self.audit(owner, "apikey_use", day=day)

    def audit_entries(self, owner: str, start: str, end: str, prefix: str | None) -> list[dict]:
        where, args = "owner = ? AND at >= ? AND at < ?", [owner, start, end]
        if prefix is not None:
            where, args = where + " AND event LIKE ?", [*args, prefix + "%"]
        return [{**row, "details": json.loads(row["details"])}
                for row in self.db["audit"].rows_where(where, args, order_by="at, id")]

    # ---- usage ------------------------------------------------------------------------------------------------------
    def storage_by_project(self, owner: str) -> list[dict]:
        """The owner's live checkpoints grouped by project: their run's (a copy or an upload), else the session's
        that saved them."""
        return [dict(zip(("project_id", "checkpoint_count", "size_bytes"), row)) for row in self.db.execute(
            f"SELECT coalesce(m.project_id, s.project_id) AS project, count(*), coalesce(sum(c.size_bytes), 0) "
            f"FROM checkpoints c LEFT JOIN models m ON m.id = c.training_run_id "
            f"LEFT JOIN sessions s ON s.id = m.session_id "
            f"WHERE c.owner = ? AND {LIVE.replace('expires_at', 'c.expires_at')} GROUP BY project "
            f"ORDER BY project", [owner, now()])]

    def training_tokens_by_hour(self, owner: str, start: str, end: str) -> list[dict]:
        """Tokens trained per UTC hour, base model and session, from the recorded steps."""
        return [dict(zip(("hour", "base_model", "session_id", "tokens"), row)) for row in self.db.execute(
            "SELECT substr(st.created, 1, 13), m.base_model, m.session_id, sum(st.num_tokens) FROM steps st "
            "JOIN models m ON m.id = st.model_id WHERE m.owner = ? AND st.created >= ? AND st.created < ? "
            "GROUP BY 1, 2, 3 ORDER BY 1, 4 DESC", [owner, start, end])]

    def checkpoints_by_hour(self, owner: str, start: str, end: str) -> list[dict]:
        """Checkpoint saves per UTC hour and base model, from the audit log (deleted ones were saved all the same)."""
        return [dict(zip(("hour", "base_model", "count"), row)) for row in self.db.execute(
            "SELECT substr(at, 1, 13), json_extract(details, '$.base_model'), count(*) FROM audit WHERE owner = ? "
            "AND event = 'checkpoint_create' AND at >= ? AND at < ? GROUP BY 1, 2 ORDER BY 1", [owner, start, end])]

    # ---- trace export -----------------------------------------------------------------------------------------------
    def session_requests(self, session_id: str, owner: str, limit: int) -> list[dict]:
        """The session's requests (its training runs' and its sampling sessions') with their times, oldest first."""
        return [dict(zip(("request_id", "kind", "lane", "state", "created", "finished"), row)) for row in
                self.db.execute(
                    "SELECT request_id, kind, coalesce(model_id, poll_group), state, created, finished FROM futures "
                    "WHERE owner = ? AND (model_id IN (SELECT id FROM models WHERE session_id = ?) OR poll_group "
                    "LIKE ? ESCAPE '\\') ORDER BY created LIMIT ?",
                    [owner, session_id, session_id.replace("%", "\\%").replace("_", "\\_") + ":%", limit])]
