"""What the typed boundary (``adapters.boundary``, ``adapters.actors``) costs per call: an actor created from the class
made from a Protocol (each method handing the call to the implementation built in the actor) and called through the
typed proxy, against an actor created from the implementation itself and called on its bare Ray handle. The call
does nothing, so what is measured is the overhead alone: Ray's round trip, and what the boundary adds to it.

    python -m bench.boundary_overhead [--calls 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Protocol

import ray

from adapters.actors import actor_proxy
from adapters.boundary import actor_class
from bench.common import write

HERE = "bench.boundary_overhead"
"""This module's import path, also when run as ``__main__``: the actors import the implementations from it."""


class Echo(Protocol):
    async def echo(self, value: int) -> int: ...


class ThreadedEcho:
    """A trainer-like implementation: plain methods, one call at a time."""

    def echo(self, value: int) -> int:
        return value


class ConcurrentEcho:
    """A sampler-like implementation: coroutines."""

    async def echo(self, value: int) -> int:
        return value


async def _per_call(calls: dict[str, object], count: int, rounds: int = 7) -> dict[str, float]:
    """Microseconds per call of each of ``calls``, one call after another: the median of ``rounds`` rounds, the
    ways taking turns within each round so that a load that changes meanwhile (a shared machine) weighs on each
    alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            for value in range(count):
                await call(value)  # type: ignore[operator]
            times[name].append((time.perf_counter() - start) / count * 1e6)
    return {name: statistics.median(each) for name, each in times.items()}


def _in_process(calls: int) -> tuple[float, float]:
    """The delegating method against the implementation's own, in one process (no Ray): nanoseconds per call."""
    implementation = ThreadedEcho()
    made = actor_class(Echo, f"{HERE}:ThreadedEcho", concurrent=False)()
    times = []
    for call in (implementation.echo, made.echo):
        start = time.perf_counter()
        for value in range(calls * 100):
            call(value)
        times.append((time.perf_counter() - start) / (calls * 100) * 1e9)
    return times[0], times[1]


async def _through_ray(calls: int) -> dict[str, float]:
    out = {}
    for kind, implementation, concurrent in (("threaded", ThreadedEcho, False), ("concurrent", ConcurrentEcho, True)):
        bare = ray.remote(implementation).remote()
        made = ray.remote(actor_class(Echo, f"{HERE}:{implementation.__name__}", concurrent=concurrent)).remote()
        typed = actor_proxy(made, Echo, kind)
        await bare.echo.remote(0)
        await typed.echo(0)

        async def raw(value: int, handle=bare) -> int:
            return await handle.echo.remote(value)

        out |= await _per_call({f"{kind}: bare handle": raw, f"{kind}: boundary": typed.echo}, calls)
        ray.kill(bare)
        ray.kill(made)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    own, delegated = _in_process(args.calls)
    rows = [{"path": "in-process", "way": "implementation", "ns_per_call": own},
            {"path": "in-process", "way": "actor class from the Protocol", "ns_per_call": delegated}]
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    try:
        for name, micros in asyncio.run(_through_ray(args.calls)).items():
            rows.append({"path": "through Ray", "way": name, "us_per_call": micros})
    finally:
        ray.shutdown()
    write("boundary_overhead", vars(args), rows)


if __name__ == "__main__":
    main()
