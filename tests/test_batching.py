"""adapters.batching.Coalescer and the trainer pool's batch admission, without Ray."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from adapters.batching import Coalescer
from adapters.trainer.interface import AdamHyper, OptimRequest, StepRequest
from adapters.trainer.pool import TrainerOptions, TrainerPool
from shims.errors import UserError
from shims.tinker.training_wire import DatumArrays


def test_requests_waiting_during_a_batch_run_together_in_the_next():
    batches: list[list[int]] = []

    async def run(items: list[int]) -> list:
        batches.append(items)
        await asyncio.sleep(0.05)
        return [ValueError(f"bad {i}") if i == 3 else i * 10 for i in items]

    async def main():
        coalescer = Coalescer(run, lambda pending: 2)  # at most two per batch
        tasks = [asyncio.create_task(coalescer.submit(i)) for i in range(5)]
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(main())
    assert batches == [[0, 1], [2, 3], [4]]  # oldest first, two at a time, none lost
    assert results[:3] == [0, 10, 20] and results[4] == 40
    assert isinstance(results[3], ValueError)  # one item's failure is its own


def test_a_caller_that_stopped_waiting_never_joins_a_batch():
    batches: list[list[int]] = []

    async def run(items: list[int]) -> list:
        batches.append(items)
        await asyncio.sleep(0.05)
        return [i * 10 for i in items]

    async def main():
        coalescer = Coalescer(run, lambda pending: 10)
        first = asyncio.create_task(coalescer.submit(0))
        await asyncio.sleep(0.01)  # batch [0] is running; the next three wait
        waiting = [asyncio.create_task(coalescer.submit(i)) for i in (1, 2, 3)]
        await asyncio.sleep(0)
        waiting[1].cancel()
        return await asyncio.gather(first, *waiting, return_exceptions=True)

    results = asyncio.run(main())
    assert batches == [[0], [1, 3]]
    assert results[0] == 0 and results[1] == 10 and results[3] == 30
    assert isinstance(results[2], asyncio.CancelledError)


def _request(tokens: int) -> StepRequest:
    return StepRequest("m", [DatumArrays(tokens=np.zeros(tokens, dtype=np.int64))], "cross_entropy", {}, False)


def test_trainer_batches_admit_requests_up_to_the_token_budget():
    pool = TrainerPool([], TrainerOptions(max_batch_tokens=100))
    assert pool._admit([_request(60), _request(30), _request(20)]) == 2
    assert pool._admit([_request(100), _request(1)]) == 1
    step = OptimRequest("other-run", AdamHyper())  # optim steps join any call: they hold no tokens
    assert pool._admit([_request(60), step, _request(30), step, _request(20)]) == 4
    assert pool._admit([step, _request(100), step]) == 3
    with pytest.raises(UserError, match="101 input tokens.*--max-batch-tokens 100"):
        asyncio.run(pool.forward_backward("base", _request(101)))


def test_each_item_hears_when_its_batch_starts_and_busy_says_a_batch_runs():
    events: list[str] = []

    async def main():
        release = asyncio.Event()

        async def run(items: list[int]) -> list:
            events.append(f"run {items}")
            await release.wait()  # each batch runs until the test lets it end
            release.clear()
            return items

        coalescer = Coalescer(run, lambda pending: 10)
        assert not coalescer.busy
        first = asyncio.create_task(coalescer.submit(0, started=lambda: events.append("started 0")))
        while "run [0]" not in events:
            await asyncio.sleep(0)
        assert coalescer.busy  # batch [0] runs: what arrives now waits for it
        later = [asyncio.create_task(coalescer.submit(i, started=lambda i=i: events.append(f"started {i}")))
                 for i in (1, 2)]
        for _ in range(10):
            await asyncio.sleep(0)
        assert "started 1" not in events
        release.set()
        await first
        while "run [1, 2]" not in events:
            await asyncio.sleep(0)
        release.set()
        await asyncio.gather(*later)
        assert not coalescer.busy

    asyncio.run(main())
    assert events == ["started 0", "run [0]", "started 1", "started 2", "run [1, 2]"]


def test_a_start_callback_that_fails_fails_nothing_else():
    async def run(items: list[int]) -> list:
        return [i * 10 for i in items]

    def broken() -> None:
        raise RuntimeError("listener gone")

    async def main():
        coalescer = Coalescer(run, lambda pending: 10)
        return await asyncio.gather(coalescer.submit(1, started=broken), coalescer.submit(2))

    assert asyncio.run(main()) == [10, 20]
