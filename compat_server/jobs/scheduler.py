"""Runs the work behind futures: per model strictly in ``seq_id`` order, across models concurrently.

The tinker SDK numbers each training client's requests 1, 2, 3, … and may deliver them out of order (a multi-chunk
forward_backward sends its first chunk last). A model's lane holds later requests until the next expected one has
arrived. If a number never arrives (a client died mid-submit), the lane moves on after ``gap_timeout`` seconds
rather than stalling that model forever. Jobs reach a base model's trainer through ``trainer_for`` (typed by
``adapters.trainer.interface.Trainer``), its batched forward_backward and optim_step through ``trainers``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry.trace import Span, StatusCode

from adapters import waits
from adapters.trainer.interface import Trainer
from adapters.trainer.pool import TrainerPool
from compat_server.jobs.futures import FutureHub, Payload
from compat_server.telemetry import ids, tracer
from shims.errors import UserError

log = logging.getLogger("compat_server.scheduler")

@dataclass(frozen=True)
class Finishing:
    """What a job answers when its turn in the model's order is over but its result is not ready yet: ``rest``
    finishes it outside the order (a named save's files, written while the run's next requests run), and the future
    resolves with what ``rest`` returns, or fails with what it raises, as it would for the job itself."""

    rest: Awaitable[Payload]


Job = Callable[[], Awaitable[Payload | Finishing]]


@dataclass
class _Queued:
    """A job waiting for its turn, with the trace context of the request that submitted it: its spans (the wait,
    then the work) belong to that request's trace even though they run after the HTTP answer went out."""

    request_id: str
    kind: str
    job: Job
    context: otel_context.Context
    attributes: dict
    queued: Span

    @classmethod
    def start(cls, request_id: str, kind: str, job: Job, model_id: str | None, seq_id: int | None) -> _Queued:
        context = otel_context.get_current()
        attributes = ids(model_id, request_id, seq_id, kind)
        span = tracer.start_span("queue", context=context, attributes=attributes)
        return cls(request_id, kind, job, context, attributes, span)


@dataclass
class _Lane:
    next_seq: int = 1
    waiting: dict[int, _Queued] = field(default_factory=dict)
    skipped: list[range] = field(default_factory=list)
    """Numbers passed over by the gap timeout: if one turns up late after all, it still runs. Kept as ranges: a
    client may jump far ahead (seq_id 2**62), and the numbers in between must not be listed one by one."""
    late: set[int] = field(default_factory=set)
    """Skipped numbers that did turn up (each may run once)."""
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    runner: asyncio.Task | None = None

    def was_skipped(self, seq_id: int) -> bool:
        return seq_id not in self.late and any(seq_id in gap for gap in self.skipped)


class Scheduler:
    """Orders and runs jobs, and records each job's outcome in its future."""

    def __init__(self, hub: FutureHub, trainers: TrainerPool, gap_timeout: float) -> None:
        self.hub = hub
        self.trainers = trainers
        self.gap_timeout = gap_timeout
        self._lanes: dict[str, _Lane] = {}
        self._tasks: set[asyncio.Task] = set()
        self._unordered: dict[str, asyncio.Task] = {}
        """Running jobs outside any model's order (samples), by request id: what ``cancel`` can stop."""
        self._finishing: set[asyncio.Task] = set()
        """Jobs finishing after their turn (``Finishing``): what a graceful stop waits for."""

    def submit(self, *, owner: str, kind: str, job: Job, model_id: str | None = None, seq_id: int | None = None,
               idempotency_key: str | None = None, poll_group: str | None = None) -> str:
        """Create the future and queue its job; returns the request id at once.

        Jobs with a ``seq_id`` run in that model's order; jobs without one (model creation) run immediately.
        A resubmission with the same idempotency key returns the first request's id and runs nothing.
        """
        lane = self._lanes.setdefault(model_id, _Lane()) if model_id is not None and seq_id is not None else None
        if lane is not None and seq_id in lane.waiting:
            return lane.waiting[seq_id].request_id  # the same turn resubmitted (a retry with a fresh idempotency key)
        request_id, created = self.hub.create(owner=owner, model_id=model_id, seq_id=seq_id, kind=kind,
                                              idempotency_key=idempotency_key, poll_group=poll_group)
        if not created:
            return request_id
        queued = _Queued.start(request_id, kind, job, model_id, seq_id)
        if lane is None:
            task = self._unordered[request_id] = self._spawn(self._run(queued))
            task.add_done_callback(lambda _: self._unordered.pop(request_id, None))
            return request_id
        if seq_id < lane.next_seq:
            if not lane.was_skipped(seq_id):
                self.hub.fail(request_id, f"seq_id {seq_id} of model {model_id} was already used; the next "
                                          f"expected is {lane.next_seq}", "user")
                queued.queued.end()
                return request_id
            lane.late.add(seq_id)
        lane.waiting[seq_id] = queued
        lane.arrived.set()
        if lane.runner is None or lane.runner.done():
            lane.runner = self._spawn(self._drain(model_id, lane))
        return request_id

    def fail_now(self, *, owner: str, kind: str, message: str, idempotency_key: str | None = None,
                 poll_group: str | None = None) -> str:
        """A future that is already failed with a user error (for requests rejected before any work)."""
        request_id, created = self.hub.create(owner=owner, model_id=None, seq_id=None, kind=kind,
                                              idempotency_key=idempotency_key, poll_group=poll_group)
        if created:
            self.hub.fail(request_id, message, "user")
        return request_id

    async def _drain(self, model_id: str, lane: _Lane) -> None:
        while lane.waiting:
            if lane.next_seq in lane.waiting:
                seq = lane.next_seq
            elif min(lane.waiting) < lane.next_seq:
                seq = min(lane.waiting)  # a number the gap timeout skipped, arriving late after all
            else:
                lane.arrived.clear()
                try:
                    await asyncio.wait_for(lane.arrived.wait(), timeout=self.gap_timeout)
                    continue
                except TimeoutError:
                    seq = min(lane.waiting)
                    lane.skipped.append(range(lane.next_seq, seq))
                    log.warning("model %s: seq_id %d never arrived after %.0fs; continuing at %d", model_id,
                                lane.next_seq, self.gap_timeout, seq)
            queued = lane.waiting.pop(seq)
            lane.next_seq = max(lane.next_seq, seq + 1)
            await self._run(queued)

    async def _run(self, queued: _Queued) -> None:
        queued.queued.end()
        told = waits.listener.set(lambda reason: self.hub.waiting(queued.request_id, reason))  # the pools say it waits
        try:
            with tracer.start_as_current_span(queued.kind, context=queued.context,
                                              attributes=queued.attributes) as span:
                finishing = await self._settle(queued, queued.job(), span)
        finally:
            waits.listener.reset(told)
        if finishing is not None:
            task = self._spawn(self._finish(queued, finishing.rest))
            self._finishing.add(task)
            task.add_done_callback(self._finishing.discard)

    async def _finish(self, queued: _Queued, rest: Awaitable[Payload]) -> None:
        with tracer.start_as_current_span(f"{queued.kind}.finish", context=queued.context,
                                          attributes=queued.attributes) as span:
            if await self._settle(queued, rest, span) is not None:
                self.hub.fail(queued.request_id, "a job finishing after its turn answered Finishing again", "server")

    async def _settle(self, queued: _Queued, work: Awaitable[Payload | Finishing], span: Span) -> Finishing | None:
        """Await ``work`` and record its outcome in the future; a ``Finishing`` answer is returned instead."""
        request_id = queued.request_id
        try:
            payload = await work
        except UserError as exc:
            span.set_attribute("compat_server.error", str(exc))
            self.hub.fail(request_id, str(exc), "user")
        except Exception as exc:
            log.exception("request %s (%s) failed", request_id, queued.kind)
            span.set_status(StatusCode.ERROR, str(exc))
            self.hub.fail(request_id, f"{type(exc).__name__}: {exc}", "server")
        else:
            if isinstance(payload, Finishing):
                return payload
            self.hub.complete(request_id, payload)
        return None

    async def finish_pending(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for the jobs still finishing after their turn (a graceful stop: a named
        save whose files are being written); returns how many did not finish."""
        if not self._finishing:
            return 0
        _, pending = await asyncio.wait(set(self._finishing), timeout=timeout)
        return len(pending)

    def cancel(self, request_id: str) -> bool:
        """Stop a running sample (``cancel_future``): its sampler work is cancelled, as for an OpenAI client that
        disconnects, and its future fails saying so. False if it is not running (finished, unknown, or a training
        request, which keeps its place in the model's order)."""
        task = self._unordered.pop(request_id, None)
        if task is None or task.done():
            return False
        task.cancel()
        self.hub.fail(request_id, "cancelled: the client abandoned this request (cancel_future)", "user")
        return True

    def queue_depth(self) -> int:
        """Jobs waiting for their turn in a model's order (the telemetry's queue depth)."""
        return sum(len(lane.waiting) for lane in self._lanes.values())

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def trainer_for(self, base_model: str) -> Trainer:
        """The base model's trainer, as its Protocol says, each call traced as ``trainer.<operation>``."""
        return self.trainers.trainer(base_model)
