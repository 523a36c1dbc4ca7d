"""Futures: every asynchronous Tinker call answers a ``request_id`` at once and its result is fetched later.

Results and errors are stored in the records, so a completed future stays retrievable; the in-memory events only
wake up long-polling ``retrieve_future`` calls.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from compat_server.access.quotas import KeyQuota
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
        self.held = 0
        """Polls that found nothing finished and were held open: what a client's long-poll connections cost."""

    def add(self, seconds: float, held: bool = False) -> None:
        self._seconds.append(seconds)
        self.count += 1
        self.held += held

    def summary(self) -> dict:
        counts = {"count": self.count, "held": self.held}
        if not self._seconds:
            return {**counts, "p50_ms": None, "p99_ms": None, "max_ms": None}
        p50, p99, top = np.percentile(np.fromiter(self._seconds, float), [50, 99, 100]) * 1000
        return {**counts, "p50_ms": round(p50, 2), "p99_ms": round(p99, 2), "max_ms": round(top, 2)}


@dataclass
class Windows:
    """One scope's windows (the server's, or one key's): submit to result, and each kind of poll."""

    size: int = 10_000
    completion: LatencyWindow = field(init=False)
    retrieve_future: LatencyWindow = field(init=False)
    retrieve_futures: LatencyWindow = field(init=False)

    def __post_init__(self) -> None:
        self.completion, self.retrieve_future, self.retrieve_futures = (LatencyWindow(self.size) for _ in range(3))

    def summary(self) -> dict:
        return {"completion": self.completion.summary(), "retrieve_future": self.retrieve_future.summary(),
                "retrieve_futures": self.retrieve_futures.summary()}


async def _hold(event: asyncio.Event, seconds: float) -> None:
    """A long poll's wait: until ``event`` is set, or ``seconds`` pass (then the poll answers what it has)."""
    try:
        await asyncio.wait_for(event.wait(), timeout=seconds)
    except TimeoutError:
        pass


def poll_group(sampling_session_id: str, seq_id: int) -> str:
    """The ``retrieve_futures`` target a sample belongs to: its sampling session and the clone that sent it. The SDK
    gives each clone of a sampling client its own block of a billion ``seq_id`` values (``seq_id // 1e9``)."""
    return f"{sampling_session_id}/{seq_id // 1_000_000_000}"


class FutureHub:
    """Creates futures, records their outcome, and lets pollers wait for it."""

    def __init__(self, records: Records, quota: KeyQuota | None = None) -> None:
        self.records = records
        self.quota = quota or KeyQuota(None)
        self._events: dict[str, asyncio.Event] = {}
        self._open: dict[str, tuple[str, str, float]] = {}
        """Unfinished futures created by this process: owner, kind, and when they were submitted."""
        self._group_of: dict[str, str] = {}
        """Unfinished futures' poll groups, to wake a group's ``retrieve_futures`` pollers when one finishes."""
        self._groups: dict[str, asyncio.Event] = {}
        self.windows = Windows()
        """Submit to result per future (what a client waits in all), and each poll including the time it is held."""
        self._per_key: dict[str, Windows] = {}
        """Each key's own windows (what a tenant's metrics show it)."""
        self._waiting: dict[str, str] = {}
        """Why unfinished futures wait for compute, while they do (``adapters.waits``): their ``queue_state``."""

    def create(self, *, owner: str, model_id: str | None, seq_id: int | None, kind: str,
               idempotency_key: str | None, poll_group: str | None = None) -> tuple[str, bool]:
        """A new pending future, or — for a retried submit with the same idempotency key — the existing one.
        ``poll_group``: the ``retrieve_futures`` target it belongs to (see ``poll_group``).

        Returns ``(request_id, created)``.
        """
        if idempotency_key:
            existing = self.records.futures.future_by_idempotency_key(owner, idempotency_key)
            if existing is not None:
                return existing["request_id"], False
        request_id = f"req-{uuid.uuid4().hex}"
        self.quota.acquire(owner)  # released when the future finishes (``_wake``)
        try:
            self.records.futures.create_future(request_id, owner=owner, model_id=model_id, seq_id=seq_id, kind=kind,
                                               idempotency_key=idempotency_key, poll_group=poll_group)
        except BaseException:
            self.quota.release(owner)
            raise
        self._events[request_id] = asyncio.Event()
        self._open[request_id] = (owner, kind, time.perf_counter())
        if poll_group is not None:
            self._group_of[request_id] = poll_group
        return request_id, True

    def complete(self, request_id: str, payload: Payload) -> None:
        self.records.futures.finish_future(request_id, media_type=payload.media_type, result=payload.body)
        self._wake(request_id, {"state": "complete"})

    def fail(self, request_id: str, message: str, category: str) -> None:
        self.records.futures.fail_future(request_id, error=message, category=category)
        self._wake(request_id, {"state": "failed", "category": category})

    def waiting(self, request_id: str, reason: str | None) -> None:
        """Record why an unfinished future waits for compute, or (None) that its work runs."""
        if reason is None:
            self._waiting.pop(request_id, None)
        elif request_id in self._open:
            self._waiting[request_id] = reason

    def wait_reason(self, request_id: str) -> str | None:
        """Why the future waits for compute now, or None (queued in its model's order, or running)."""
        return self._waiting.get(request_id)

    def _wake(self, request_id: str, outcome: dict[str, str]) -> None:
        self._waiting.pop(request_id, None)
        opened = self._open.pop(request_id, None)
        if opened is not None:
            owner, kind, submitted = opened
            self.quota.release(owner)
            seconds = time.perf_counter() - submitted
            for windows in (self.windows, self._key_windows(owner)):
                windows.completion.add(seconds)
            FUTURES_FINISHED.add(1, {"kind": kind, **outcome})
            FUTURE_DURATION.record(seconds, {"kind": kind})
        event = self._events.pop(request_id, None)
        if event is not None:
            event.set()
        group = self._group_of.pop(request_id, None)
        if group is not None and (group_event := self._groups.pop(group, None)) is not None:
            group_event.set()

    async def wait(self, request_id: str, owner: str, hold_seconds: float) -> dict | None:
        """The future's record once it is finished, waiting up to ``hold_seconds``; None if it is unknown."""
        started = time.perf_counter()
        row = self.records.futures.future(request_id, owner)
        held = row is not None and row["state"] == "pending"
        if held:
            await _hold(self._events.setdefault(request_id, asyncio.Event()), hold_seconds)
            row = self.records.futures.future(request_id, owner)
        for windows in (self.windows, self._key_windows(owner)):
            windows.retrieve_future.add(time.perf_counter() - started, held)
        return row

    async def wait_group(self, owner: str, poll_group: str, cursor: int, hold_seconds: float,
                         limit: int) -> list[dict]:
        """The group's futures finished after ``cursor`` (``retrieve_futures``), waiting up to ``hold_seconds`` for
        one if there are none yet: one long poll stands for every pending sample of a sampling client."""
        started = time.perf_counter()
        finished = self.records.futures.completions_after(owner, poll_group, cursor, limit)
        held = not finished and hold_seconds > 0
        if held:
            await _hold(self._groups.setdefault(poll_group, asyncio.Event()), hold_seconds)
            finished = self.records.futures.completions_after(owner, poll_group, cursor, limit)
        for windows in (self.windows, self._key_windows(owner)):
            windows.retrieve_futures.add(time.perf_counter() - started, held)
        return finished

    def pending_by_state(self) -> dict[str, int]:
        """Unfinished futures (the telemetry gauge); queued ones are also counted by the scheduler's queue depth."""
        return {"pending": len(self._open)}

    def _key_windows(self, owner: str) -> Windows:
        if owner not in self._per_key:
            self._per_key[owner] = Windows(KEY_WINDOW)
        return self._per_key[owner]

    def latency(self, owner: str | None = None) -> dict:
        """Counts and percentiles over the server's recent futures and polls, or (given ``owner``) that key's own."""
        return (self.windows if owner is None else self._key_windows(owner)).summary()
