"""A key's sessions: create one within the session limits, keep it alive, get, list and search them (a key sees only
its own), and move one to a project. Ending one is the training service's (see ``compat_server.sessions``)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from litestar.exceptions import ClientException
from tinker import types

from compat_server.account.service import as_utc
from compat_server.records import Records
from compat_server.runs.service import checked_page, string_metadata
from compat_server.sessions.limits import SessionLimits
from shims.errors import NotFound, UserError


def _session_status(row: dict) -> Any:
    if not row["finished"]:
        return types.SessionActive()
    reason = row["finish_reason"]
    if reason in ("success", "errored", "interrupted"):
        return types.ClientSessionFinished(reason={"type": reason})
    return types.SessionCancelled(detail=f"ended by the server: {reason}")


def _status_matches(status: Any, queries: list[Any] | None) -> bool:
    if queries is None:
        return True
    for query in queries:
        if query.type == status.type and (query.type != "client_finished" or query.reasons is None
                                          or status.reason.type in query.reasons):
            return True
    return False


class SessionService:
    def __init__(self, records: Records, limits: SessionLimits) -> None:
        self.records = records
        self.limits = limits

    def create(self, owner: str, req: types.CreateSessionRequest) -> str:
        """A new session of the key's, once its fields are within the session limits (refused whole otherwise:
        nothing is stored)."""
        self._check_field("display_name", req.display_name)
        self._check_field("project_id", req.project_id)
        self._check_field("sdk_version", req.sdk_version)
        if len(req.tags) > self.limits.tags:
            raise UserError(f"a session takes at most {self.limits.tags} tags, not {len(req.tags)} "
                            "(--max-session-tags)")
        for tag in req.tags:
            self._check_field("a tag", tag)
        metadata = req.user_metadata or {}
        size = len(json.dumps(metadata))  # as stored; ASCII, so characters are bytes
        if size > self.limits.metadata_bytes:
            raise UserError(f"user_metadata is {size} bytes of JSON, over the {self.limits.metadata_bytes} a "
                            "session's may have (--max-session-metadata-bytes)")
        session_id = str(uuid.uuid4())
        self.records.sessions.create_session(session_id, owner, tags=req.tags, user_metadata=metadata,
                                         sdk_version=req.sdk_version, project_id=req.project_id,
                                         display_name=req.display_name)
        return session_id

    def _check_field(self, name: str, value: str | None) -> None:
        if value is not None and len(value) > self.limits.field_chars:
            raise UserError(f"{name} is {len(value)} characters long, over the {self.limits.field_chars} a "
                            "session's names, tags and versions may have (--max-session-field-chars)")

    def _session(self, owner: str, session_id: str) -> dict:
        row = self.records.sessions.session(session_id, owner)
        if row is None:
            raise NotFound(f"session {session_id!r} not found")
        return row

    def heartbeat(self, owner: str, session_id: str) -> None:
        """Keep a live session from expiring. An unknown or expired one is 410 Gone, which stops the SDK's
        heartbeat loop instead of retrying forever."""
        row = self.records.sessions.session(session_id, owner)
        if row is None:
            raise ClientException(f"unknown session_id {session_id!r}", status_code=410)
        if row["finish_reason"] == "expired":
            raise ClientException(f"session {session_id} expired after missing heartbeats; start a new one",
                                  status_code=410)
        self.records.sessions.heartbeat(session_id)

    def get(self, owner: str, session_id: str) -> types.GetSessionResponse:
        row = self._session(owner, session_id)
        runs, samplers = self.records.sessions.session_children(session_id)
        return types.GetSessionResponse(training_run_ids=runs, sampler_ids=samplers,
                                        user_metadata=string_metadata(row["user_metadata"]) or None)

    def list_page(self, owner: str, limit: int, offset: int) -> types.ListSessionsResponse:
        """One page of the key's session ids, oldest first."""
        limit, offset = checked_page(limit, offset)
        return types.ListSessionsResponse(sessions=self.records.sessions.sessions_page(owner, limit, offset))

    def assign_project(self, owner: str, session_id: str, project_id: Any) -> None:
        if not isinstance(project_id, str) or not project_id:
            raise UserError("assigning a project needs {\"project_id\": \"…\"}")
        self._check_field("project_id", project_id)
        self._session(owner, session_id)
        self.records.sessions.set_session_project(session_id, project_id)
        self.records.account.audit(owner, "project_session_assign", session_id=session_id, project_id=project_id)

    def search(self, owner: str, req: types.SessionSearchRequest) -> types.SessionSearchResponse:
        """The key's own sessions only (``owner`` other than "own" matches the key's own too: a key sees no one
        else's), newest first, filtered and paged by the request: at most 200 a page, each within ``SessionLimits``."""
        if req.owner.type == "user":
            raise UserError("searching other users' sessions is not supported: a key sees only its own")
        before = (as_utc(req.cursor.last_created_at, "cursor.last_created_at").isoformat(),
                  req.cursor.last_session_id) if req.cursor else None
        words = (req.display_name or "").lower().split()
        found: list[dict] = []
        while len(found) < req.limit + 1:
            rows = self.records.sessions.search_sessions(owner, before=before, limit=500)
            if not rows:
                break
            for row in rows:
                if self._session_matches(row, req, words):
                    found.append(row)
            before = (rows[-1]["created"], rows[-1]["id"])
        page = found[:req.limit]
        summaries = [self._summary(row) for row in page]
        more = len(found) > req.limit
        cursor = types.SessionSearchCursor(last_created_at=page[-1]["created"], last_session_id=page[-1]["id"]) \
            if more and page else None
        return types.SessionSearchResponse(sessions=summaries, next_cursor=cursor)

    def _session_matches(self, row: dict, req: types.SessionSearchRequest, words: list[str]) -> bool:
        metadata = string_metadata(row["user_metadata"])
        named = bool(words) and all(w in (row["display_name"] or "").lower() for w in words)
        if (req.session_id is not None or words) and not (row["id"] == req.session_id or named):
            return False
        if req.project_ids is not None and (row["project_id"] or "default") not in req.project_ids:
            return False
        if any(metadata.get(k) != v for k, v in req.user_metadata.items()):
            return False
        return _status_matches(_session_status(row), req.statuses)

    def _summary(self, row: dict) -> types.SessionSummary:
        count, size = self.records.sessions.session_storage(row["id"])
        return types.SessionSummary(
            session_id=row["id"], created_at=row["created"], owner=f"key:{row['owner'][:16]}",
            project_id=row["project_id"] or "default", status=_session_status(row), checkpoints_count=count,
            display_name=row["display_name"], user_metadata=string_metadata(row["user_metadata"]) or None,
            checkpoint_storage_bytes=size)
