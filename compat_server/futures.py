"""Futures: every asynchronous Tinker call answers a ``request_id`` at once and its result is fetched later.

Results and errors are stored in the records, so a completed future stays retrievable; the in-memory events only
wake up long-polling ``retrieve_future`` calls.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from dataclasses import dataclass

import numpy as np

from compat_server.quotas import KeyQuota
from compat_server.records import Records
from compat_server.telemetry import FUTURE_DURATION, FUTURES_FINISHED

JSON = "application/json"
PROTOBUF = "application/x-protobuf"


@dataclass(frozen=True)
class Payload:
    """A future's result, already encoded the way the SDK expects it (JSON or protobuf)."""

    media_type: str
    body: bytes


KEY_WINDOW = 1_000
"""Durations kept per API key (the server-wide windows keep 10,000)."""


class LatencyWindow:
    """The most recent durations of one kind (a bounded window, so memory stays flat), for p50/p99 in the metrics."""

    def __init__(self, size: int = 10_000) -> None:
        self._seconds: deque[float] = deque(maxlen=size)
        self.count = 0

    def add(self, seconds: float) -> None:
        self._seconds.append(seconds)
        self.count += 1

    def summary(self) -> dict:
        if not self._seconds:
            return {"count": self.count, "p50_ms": None, "p99_ms": None, "max_ms": None}
        p50, p99, top = np.percentile(np.fromiter(self._seconds, float), [50, 99, 100]) * 1000
        return {"count": self.count, "p50_ms": round(p50, 2), "p99_ms": round(p99, 2), "max_ms": round(top, 2)}


class FutureHub:
    """Creates futures, records their outcome, and lets pollers wait for it."""

    def __init__(self, records: Records, quota: KeyQuota | None = None) -> None:
        self.records = records
        self.quota = quota or KeyQuota(None)
        self._events: dict[str, asyncio.Event] = {}
        self._open: dict[str, tuple[str, str, float]] = {}
        """Unfinished futures created by this process: owner, kind, and when they were submitted."""
        self.completion = LatencyWindow()
        self._per_key: dict[str, tuple[LatencyWindow, LatencyWindow]] = {}
        """Each key's own completion and retrieve_future windows (what a tenant's metrics show it)."""
        """Submit to result, per future: what a client waits in all."""
        self.polls = LatencyWindow()
        """Each ``retrieve_future`` call, including the time it is held open waiting for the result."""

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
        self._open[request_id] = (owner, kind, time.perf_counter())
        return request_id, True

    def complete(self, request_id: str, payload: Payload) -> None:
        self.records.finish_future(request_id, media_type=payload.media_type, result=payload.body)
        self._wake(request_id, {"state": "complete"})

    def fail(self, request_id: str, message: str, category: str) -> None:
        self.records.fail_future(request_id, error=message, category=category)
        self._wake(request_id, {"state": "failed", "category": category})

    def _wake(self, request_id: str, outcome: dict[str, str]) -> None:
        opened = self._open.pop(request_id, None)
        if opened is not None:
            owner, kind, submitted = opened
            self.quota.release(owner)
            seconds = time.perf_counter() - submitted
            self.completion.add(seconds)
            self._key_windows(owner)[0].add(seconds)
            FUTURES_FINISHED.add(1, {"kind": kind, **outcome})
            FUTURE_DURATION.record(seconds, {"kind": kind})
        event = self._events.pop(request_id, None)
        if event is not None:
            event.set()

    async def wait(self, request_id: str, owner: str, hold_seconds: float) -> dict | None:
        """The future's record once it is finished, waiting up to ``hold_seconds``; None if it is unknown."""
        started = time.perf_counter()
        row = self.records.future(request_id, owner)
        if row is not None and row["state"] == "pending":
            event = self._events.setdefault(request_id, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), timeout=hold_seconds)
            except TimeoutError:
                pass
            row = self.records.future(request_id, owner)
        self.polls.add(time.perf_counter() - started)
        self._key_windows(owner)[1].add(time.perf_counter() - started)
        return row

    def pending_by_state(self) -> dict[str, int]:
        """Unfinished futures (the telemetry gauge); queued ones are also counted by the scheduler's queue depth."""
        return {"pending": len(self._open)}

    def _key_windows(self, owner: str) -> tuple[LatencyWindow, LatencyWindow]:
        if owner not in self._per_key:
            self._per_key[owner] = (LatencyWindow(KEY_WINDOW), LatencyWindow(KEY_WINDOW))
        return self._per_key[owner]

    def latency(self, owner: str | None = None) -> dict:
        """Percentiles over the server's recent futures, or (given ``owner``) over that key's own."""
        completion, polls = (self.completion, self.polls) if owner is None else self._key_windows(owner)
        return {"completion": completion.summary(), "retrieve_future": polls.summary()}
