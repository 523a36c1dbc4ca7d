"""The account side of the SDK's ``RestClient`` / ``AdminClient`` for one key: its audit log, checkpoint storage,
hourly usage, the timeline of a session as a Perfetto-loadable trace, and the key's own record (``tinker auth login``
/ ``logout``). Everything is scoped to the calling key. Session search and projects are in
``compat_server.sessions``."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime, timedelta

from tinker import types

from compat_server.access.auth import ANONYMOUS, owner_of
from compat_server.access.tokens import TokenIssuer
from compat_server.records import Records
from compat_server.records.account import AUDITED_RESOURCES
from compat_server.runs.downloads import DownloadGrant, UrlSigner
from shims.errors import NotFound, UserError

MAX_TRACE_REQUESTS = 100_000
"""A trace holds at most this many requests (the oldest first)."""
USAGE_WINDOW = timedelta(days=14)
"""The longest usage window one call may ask for, as the SDK documents."""


def as_utc(moment: datetime, name: str) -> datetime:
    """``moment`` in UTC (a naive one is taken as UTC). Python's datetimes hold the years 1 to 9999 only, so
    ``0001-01-01T00:00:00+01:00`` has no UTC form: a user error naming the field, not an ``OverflowError``."""
    if moment.tzinfo is None:
        return moment.replace(tzinfo=UTC)
    try:
        return moment.astimezone(UTC)
    except OverflowError:
        raise UserError(f"{name} {moment.isoformat()} is out of range: in UTC it falls outside the years 1 to "
                        "9999") from None


class AccountService:
    def __init__(self, records: Records, signer: UrlSigner) -> None:
        self.records = records
        self.signer = signer

    # ---- audit, storage, usage ---------------------------------------------------------------------------------------
    def audit_log(self, owner: str, event_type: str, day: date | None) -> types.AuditLogResponse:
        if event_type not in ("all", *AUDITED_RESOURCES, "teams", "organizations"):
            raise UserError(f"event_type must be all, checkpoints, projects, teams or organizations, not {event_type!r}")
        if day is not None and day >= date.max:  # its end, the next midnight, is past what a datetime holds
            raise UserError(f"day {day} is out of range: the audit log has days up to {date.max - timedelta(days=1)}")
        start = datetime.combine(day or datetime.now(UTC).date(), datetime.min.time(), UTC)
        prefix = None if event_type == "all" else AUDITED_RESOURCES.get(event_type, f"{event_type}_")
        entries = self.records.account.audit_entries(owner, start.isoformat(),
                                                     (start + timedelta(days=1)).isoformat(), prefix)
        return types.AuditLogResponse(entries=[types.AuditLogEntry(
            timestamp=row["at"], event=row["event"], event_details=row["details"],
            model_id=row["details"].get("model_id") if row["event"].startswith("checkpoint_") else None,
            tinker_path=row["details"].get("tinker_path"), purpose=row["details"].get("purpose"))
            for row in entries])

    def storage_usage(self, owner: str, project_id: str | None) -> types.CurrentCheckpointStorageUsageResponse:
        """Live checkpoints of the key grouped by project (as the SDK's type groups them); no prices: self-hosted."""
        rows = [r for r in self.records.account.storage_by_project(owner)
                if project_id is None or r["project_id"] == project_id]
        return types.CurrentCheckpointStorageUsageResponse(data=[types.CurrentCheckpointStorageUsageItem(
            project_id=r["project_id"], checkpoint_count=r["checkpoint_count"], size_bytes=r["size_bytes"],
            size_gigabytes=r["size_bytes"] / 1e9) for r in rows])

    def usage_events(self, owner: str, request: types.GetBillingUsageRequest) -> types.BillingUsageResponse:
        """Hourly training tokens and checkpoint saves of the key. Sampled tokens are not kept per request, so they
        are not reported; nothing carries a price."""
        start, end = as_utc(request.starting_on, "starting_on"), as_utc(request.ending_before, "ending_before")
        if not (start < end and end - start <= USAGE_WINDOW):  # ``start + USAGE_WINDOW`` could pass the year 9999
            raise UserError("ending_before must come after starting_on, by at most 14 days")
        span = (start.isoformat(), end.isoformat())

        def bucket(hour: str) -> dict:
            begin = datetime.fromisoformat(hour + ":00:00+00:00")
            return {"bucket_start": begin, "bucket_end": begin + timedelta(hours=1)}

        events = [types.BillingUsageEvent(**bucket(r["hour"]), base_model=r["base_model"], session_id=r["session_id"],
                                          event_info=types.TrainingBillingEvent(token_count=r["tokens"] or 0))
                  for r in self.records.account.training_tokens_by_hour(owner, *span)]
        events += [types.BillingUsageEvent(**bucket(r["hour"]), base_model=r["base_model"],
                                           event_info=types.CheckpointBillingEvent(count=r["count"]))
                   for r in self.records.account.checkpoints_by_hour(owner, *span)]
        return types.BillingUsageResponse(data=sorted(events, key=lambda e: e.bucket_start))

    # ---- trace export ----------------------------------------------------------------------------------------------------
    def _trace_grant(self, session_id: str, owner: str) -> DownloadGrant:
        return DownloadGrant(tinker_path=f"session-trace:{session_id}", uid=session_id,
                             grantee=self.signer.grantee(owner))

    def trace_url(self, owner: str, session_id: str, base_url: str) -> str:
        """A signed URL of the session's trace, like checkpoint download URLs (no API key needed until it expires)."""
        if self.records.sessions.session(session_id, owner) is None:
            raise NotFound(f"session {session_id!r} not found")
        self.records.account.audit(owner, "session_trace_export", session_id=session_id)
        _, query = self.signer.sign(self._trace_grant(session_id, owner), "trace.json")
        return f"{base_url.rstrip('/')}/api/v1/sessions/{session_id}/trace.json?{query}"

    def trace_requests(self, session_id: str, grantee: str, expires: int, signature: str) -> list:
        """The session's request records for its trace (``trace_json``), newest ``MAX_TRACE_REQUESTS``. Re-checked
        at download: the URL's key must still own the session."""
        owner = self.records.sessions.session_owner(session_id)
        if owner is None or self.signer.grantee(owner) != grantee or not self.signer.valid(
                self._trace_grant(session_id, owner), "trace.json", expires, signature):
            raise NotFound("this trace URL is invalid or has expired; export the trace again")
        return self.records.account.session_requests(session_id, owner, MAX_TRACE_REQUESTS)

    # ---- the key itself ------------------------------------------------------------------------------------------------
    def token(self, owner: str, tokens: TokenIssuer) -> str:
        row = self.records.tenants.key_of(owner)
        return tokens.issue(owner, row["name"] if row else "open-auth-key")

    def key_info(self, owner: str, auth_mode: str) -> dict:
        """``tinker auth login`` checks a pasted key with this (the CLI's ``SelfApiKeyResponse``)."""
        row = self.records.tenants.key_of(owner)
        anonymous = owner == owner_of(ANONYMOUS)
        name = row["name"] if row else "anonymous" if anonymous else "open-auth key"
        key_id = int(row["id"], 16) if row else int(owner[:12], 16)
        note = ("registered with compat-server keys create" if row
                else "no tml- key: the one tenant shared by every such caller (--auth open)" if anonymous
                else f"any tml- key is accepted (--auth {auth_mode})")
        return {"key_id": key_id, "name": name, "note": note,
                "details": {"org_details": {"name": "compat-server"}, "user_details": {"email": f"{name}@compat-server"}}}

    def revoke_own_key(self, owner: str) -> None:
        """``tinker auth logout``: the key revokes itself (and nothing else)."""
        row = self.records.tenants.key_of(owner)
        if row is None:
            raise UserError("this server runs with --auth open: keys are not registered, so there is nothing to revoke")
        self.records.tenants.revoke_key(row["id"])
        self.records.account.audit(owner, "apikey_revoke", name=row["name"])


def trace_json(session_id: str, requests: list) -> bytes:
    """A session's requests (``AccountService.trace_requests``) as a Chrome/Perfetto JSON trace, encoded: one
    complete slice per request, one track per training run or sampling client. Up to 100,000 events take a second
    or more to build and encode, so the route runs this in a worker thread, off the event loop."""
    lanes = {lane: index + 1 for index, lane in enumerate(dict.fromkeys(r["lane"] or "other" for r in requests))}
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"session {session_id}"}}]
    events += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}}
               for lane, tid in lanes.items()]
    for r in requests:
        begin = datetime.fromisoformat(r["created"]).timestamp() * 1e6
        end = datetime.fromisoformat(r["finished"]).timestamp() * 1e6 if r["finished"] else begin
        events.append({"name": r["kind"], "cat": "request", "ph": "X", "pid": 1, "tid": lanes[r["lane"] or "other"],
                       "ts": begin, "dur": max(end - begin, 0.0),
                       "args": {"request_id": r["request_id"], "state": r["state"]}})
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}).encode()
