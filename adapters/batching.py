"""Continuous batching for one worker: requests that arrive while a batch runs wait, and all of them (as many as
the policy admits) go together in the next batch. Used by the trainer pool (cross-client forward_backward batches)
and by the transformers sampler.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger("compat_server.batching")

Item = TypeVar("Item")
Result = TypeVar("Result")

RunBatch = Callable[[list[Item]], Awaitable[Sequence[Result | BaseException]]]
"""Runs a batch; one outcome per item, in order: its result, or the exception that item alone should raise."""
TakeCount = Callable[[list[Item]], int]
"""How many of the waiting items, from the oldest, go into the next batch (at least one is always taken)."""


class Coalescer(Generic[Item, Result]):
    def __init__(self, run: RunBatch, take: TakeCount) -> None:
        self._run = run
        self._take = take
        self._pending: list[tuple[Item, asyncio.Future, Callable[[], None] | None]] = []
        self._worker: asyncio.Task | None = None

    async def submit(self, item: Item, started: Callable[[], None] | None = None) -> Result:
        """Queue ``item`` and return its outcome once the batch it joined has run; ``started`` is called when that
        batch starts."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((item, future, started))
        if self._worker is None or self._worker.done():
            # A context of its own: the worker outlives this caller, whose context variables are not its own.
            self._worker = loop.create_task(self._drain(), context=contextvars.Context())
        return await future

    @property
    def waiting(self) -> int:
        return len(self._pending)

    @property
    def busy(self) -> bool:
        """Whether a batch is running now (an item submitted waits for it to end)."""
        return self._worker is not None and not self._worker.done()

    async def _drain(self) -> None:
        while True:
            self._pending = [entry for entry in self._pending if not entry[1].done()]  # callers gone
            if not self._pending:
                break
            count = max(1, min(self._take([item for item, _, _ in self._pending]), len(self._pending)))
            batch, self._pending = self._pending[:count], self._pending[count:]
            for _, _, started in batch:
                if started is not None:
                    try:
                        started()
                    except Exception:  # a listener's failure is not the batch's
                        log.exception("a batch's start callback failed")
            try:
                outcomes = await self._run([item for item, _, _ in batch])
            except Exception as exc:  # noqa: BLE001 - every caller in the batch must hear about the failure
                outcomes = [exc] * len(batch)
            for (_, future, _), outcome in zip(batch, outcomes, strict=True):
                if future.done():
                    continue
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

    async def close(self) -> None:
        """Stop the worker (callers still waiting are cancelled)."""
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        for _, future, _ in self._pending:
            future.cancel()
        self._pending.clear()
