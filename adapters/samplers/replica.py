"""One sampler replica, inside its Ray actor's process: the actor that holds one backend, and the backend it makes.
The pool (``adapters.samplers.pool``) creates it from its import path (``SAMPLER_REPLICA_CLASS``), so that only the
actor's process imports this module and the backend it chooses."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import replace

from adapters.actors import ray_node
from adapters.logs import configure_logging
from adapters.samplers.interface import AdapterRef, Restarting, SamplerBackend, SamplerFacts
from adapters.samplers.options import SamplerOptions
from shims.errors import ConfigurationRefused
from shims.sampling.job import SampleJob, SampleResult, TokenEvent


class SamplerActor:
    """The Ray actor around one backend; it implements ``SamplerReplica``. Its methods are coroutines, so Ray runs the
    actor asynchronously and concurrent requests reach the backend together (which is what lets it batch them)."""

    def __init__(self, location: str, options: SamplerOptions) -> None:
        configure_logging()
        self.refused: ConfigurationRefused | None = None
        self.threads: tuple[int, ...] = ()
        try:
            self.impl: SamplerBackend = make_backend(location, options)
        except ConfigurationRefused as exc:  # raised by ``facts``, the pool's first call, to reach it as itself
            self.refused = exc

    async def facts(self) -> SamplerFacts:
        """What the replica serves, and the torch threads it computes with (read once, in its workers, the first
        time: nothing changes them after)."""
        if self.refused is not None:
            raise self.refused
        if not self.threads:
            self.threads = tuple(await self.impl.torch_threads())
        return replace(self.impl.facts(), torch_threads=self.threads)

    async def ready(self) -> None:
        """Answers once this replica can serve; raises ``Restarting`` while it is about to be replaced."""
        if self.impl.dead:
            raise Restarting(f"its backend stopped ({self.impl.dead})")

    async def stats(self) -> dict:
        facts = await self.facts()  # also after Ray restarted this actor, its threads read again
        return {**self.impl.stats(), "resident_limit": facts.max_resident,
                "tensor_parallel_size": facts.tensor_parallel_size, "torch_threads": list(self.threads),
                "node": ray_node(), "pid": os.getpid()}

    async def sample(self, adapter: AdapterRef | None, job: SampleJob) -> SampleResult:
        return await self.impl.sample(adapter, job)

    async def stream(self, adapter: AdapterRef | None,
                     job: SampleJob) -> AsyncIterator[list[TokenEvent] | SampleResult]:
        """The same request as ``sample``, yielding the tokens as they come (every token available at that moment,
        as one list), then the ``SampleResult``."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        done = object()
        task = loop.create_task(self.impl.sample(
            adapter, job, lambda event: loop.call_soon_threadsafe(queue.put_nowait, event)))
        # Scheduled when the request finishes, so after every token the generation thread announced before that.
        task.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, done))
        try:
            while True:
                events = [await queue.get()]
                while not queue.empty():
                    events.append(queue.get_nowait())
                finished = events[-1] is done
                tokens = events[:-1] if finished else events
                if tokens:
                    yield tokens
                if finished:
                    break
            yield task.result()
        finally:
            if not task.done():  # the consumer went away: stop sampling for it
                task.cancel()
                task.add_done_callback(lambda t: t.cancelled() or t.exception())  # an error nobody waits for


def make_backend(location: str, options: SamplerOptions) -> SamplerBackend:
    """The backend ``options`` names (decided: not ``auto``), holding the model at ``location`` (imported only when
    chosen: vLLM's package is optional)."""
    if options.backend == "vllm":
        from adapters.samplers.vllm.sampler import VLLMSampler

        return VLLMSampler(location, options, on_engine_dead=_exit_soon)
    from adapters.samplers.hf.sampler import TransformersSampler

    return TransformersSampler(location, options)


def _exit_soon(delay: float = 1.0) -> None:
    """End this actor's process shortly (after the failing calls have answered) so that Ray, which restarts a crashed
    sampler actor, starts a fresh replica: a vLLM engine that died does not come back inside its process."""
    asyncio.get_running_loop().call_later(delay, os._exit, 1)
