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


async def _per_call(call, calls: int) -> float:
    """Microseconds per call, one call after another (the median of five rounds)."""
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for value in range(calls):
            await call(value)
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


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

        out[f"{kind}: bare handle"] = await _per_call(raw, calls)
        out[f"{kind}: boundary"] = await _per_call(typed.echo, calls)
        ray.kill(bare)
        ray.kill(made)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    own, delegated = _in_process(args.calls)
    print(f"in one process: the implementation's method {own:.0f} ns, the actor class's {delegated:.0f} ns per call")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False)
    try:
        for name, micros in asyncio.run(_through_ray(args.calls)).items():
            print(f"through Ray, {name}: {micros:.0f} µs per call")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
