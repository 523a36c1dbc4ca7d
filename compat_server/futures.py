"""Futures: every asynchronous Tinker call answers a ``request_id`` at once and its result is fetched later.

Results and errors are stored in the records, so a completed future stays retrievable; the in-memory events only
wake up long-polling ``retrieve_future`` calls.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from compat_server.records import Records

JSON = "application/json"
PROTOBUF = "application/x-protobuf"


@dataclass(frozen=True)
class Payload:
    """A future's result, already encoded the way the SDK expects it (JSON or protobuf)."""

    media_type: str
    body: bytes


class TooManyRequests(Exception):
    """A key already has its limit of unfinished requests; answered 429 with ``Retry-After``, which the SDK's
    client honours by retrying the same request later."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class FutureHub:
    """Creates futures, records their outcome, and lets pollers wait for it."""

    def __init__(self, records: Records, max_pending_per_key: int | None = None) -> None:
        self.records = records
        self.max_pending_per_key = max_pending_per_key
        self._events: dict[str, asyncio.Event] = {}
        self._pending: dict[str, int] = {}
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
        pending = self._pending.get(owner, 0)
        if self.max_pending_per_key is not None and pending >= self.max_pending_per_key:
            raise TooManyRequests(f"this key already has {pending} unfinished requests (--max-pending-per-key "
                                  f"{self.max_pending_per_key}); retry when some have finished")
        request_id = f"req-{uuid.uuid4().hex}"
        self.records.create_future(request_id, owner=owner, model_id=model_id, seq_id=seq_id, kind=kind,
                                   idempotency_key=idempotency_key)
        self._events[request_id] = asyncio.Event()
        self._pending[owner] = pending + 1
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
            self._pending[owner] -= 1
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
