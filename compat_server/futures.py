"""Futures: every asynchronous Tinker call answers a ``request_id`` at once and its result is fetched later.

Results and errors are stored in the records, so a completed future stays retrievable; the in-memory events only
wake up long-polling ``retrieve_future`` calls.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from compat_server.quotas import KeyQuota
from compat_server.records import Records

JSON = "application/json"
PROTOBUF = "application/x-protobuf"


@dataclass(frozen=True)
class Payload:
    """A future's result, already encoded the way the SDK expects it (JSON or protobuf)."""

    media_type: str
    body: bytes


class FutureHub:
    """Creates futures, records their outcome, and lets pollers wait for it."""

    def __init__(self, records: Records, quota: KeyQuota | None = None) -> None:
        self.records = records
        self.quota = quota or KeyQuota(None)
        self._events: dict[str, asyncio.Event] = {}
        self._owners: dict[str, str] = {}

    def create(self, *, owner: str, model_id: str | None, seq_id: int | None, kind: str,
               idempotency_key: str | None) -> tuple[str, bool]:
        """A new pending future, or — for a retried submit with the same idempotency key — the existing one.

        Returns ``(request_id, created)``.
        """
        if idempotency_key:
            existing = self.records.future_by_idempotency_key(owner, idempotency_key)
            if existing is not None:
                return existing["request_id"], False
        request_id = f"req-{uuid.uuid4().hex}"
        self.quota.acquire(owner)  # released when the future finishes (``_wake``)
        try:
            self.records.create_future(request_id, owner=owner, model_id=model_id, seq_id=seq_id, kind=kind,
                                       idempotency_key=idempotency_key)
        except BaseException:
            self.quota.release(owner)
            raise
        self._events[request_id] = asyncio.Event()
        self._owners[request_id] = owner
        return request_id, True

    def complete(self, request_id: str, payload: Payload) -> None:
        self.records.finish_future(request_id, media_type=payload.media_type, result=payload.body)
        self._wake(request_id)

    def fail(self, request_id: str, message: str, category: str) -> None:
        self.records.fail_future(request_id, error=message, category=category)
        self._wake(request_id)

    def _wake(self, request_id: str) -> None:
        owner = self._owners.pop(request_id, None)
        if owner is not None:
            self.quota.release(owner)
        event = self._events.pop(request_id, None)
        if event is not None:
            event.set()

    async def wait(self, request_id: str, owner: str, hold_seconds: float) -> dict | None:
        """The future's record once it is finished, waiting up to ``hold_seconds``; None if it is unknown."""
        row = self.records.future(request_id, owner)
        if row is None or row["state"] != "pending":
            return row
        event = self._events.setdefault(request_id, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout=hold_seconds)
        except TimeoutError:
            pass
        return self.records.future(request_id, owner)
