"""Ray placement of the samplers: ``count`` replicas per base model, each an actor holding the model once (a vLLM
replica over ``vllm.tensor_parallel_size`` workers, its child processes, on the GPUs its actor reserves).

Routing prefers the replica that last served an adapter (it most likely still holds it, so nothing reloads), unless
that replica is much busier than the least busy one; otherwise the least busy replica takes the request.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import ray

from adapters.actors import ActorRestarting, ActorUnavailable, call_actor, ray_node, stream_actor
from adapters.cpu_threads import sampler_environment
from adapters.logs import configure_logging
from adapters.models.resolve import BaseModelSpec
from adapters.samplers.interface import AdapterRef, Restarting, SamplerBackend, SamplerFacts
from adapters.samplers.vllm.options import VLLMOptions
from adapters.samplers.vllm.parallel import backend_refusal
from adapters.samplers.vllm.support import has_routed_experts, vllm_lora_refusal
from shims.errors import ConfigurationRefused
from shims.sampling.job import SampleJob, SampleResult, TokenEvent

log = logging.getLogger("compat_server.sampler")

RESTART_WAIT_SECONDS = 600.0
"""How long a request waits for a sampler replica that Ray is restarting."""


@dataclass(frozen=True)
class SamplerPlacement:
    """How many sampler replicas each base model gets, which backend, the Ray resources each asks for, and the
    settings of the model it holds."""

    count: int = 1
    backend: str = "transformers"
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    threads: int | None = None
    max_batch_sequences: int = 32
    max_resident: int = 8
    dtype: str = "auto"
    max_model_len: int | None = None
    disable_any_whitespace: bool = False
    """Constrained JSON without optional whitespace (``--disable-any-whitespace``)."""
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    resources: dict[str, float] | None = None


class SamplerActor:
    """The Ray actor around one backend. Its ``sample`` is a coroutine, so Ray runs the actor asynchronously and
    concurrent requests reach the backend together (which is what lets it batch them)."""

    def __init__(self, location: str, placement: SamplerPlacement) -> None:
        configure_logging()
        self.refused: ConfigurationRefused | None = None
        self.threads: tuple[int, ...] = ()
        try:
            self.impl: SamplerBackend = make_backend(location, placement)
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

    def ready(self) -> None:
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

    async def stream(self, adapter: AdapterRef | None, job: SampleJob) -> AsyncIterator[list[TokenEvent] | SampleResult]:
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


def make_backend(location: str, placement: SamplerPlacement) -> SamplerBackend:
    """The backend ``placement`` names, holding the model at ``location`` (imported only when chosen: vLLM's
    package is optional)."""
    p = placement
    if p.backend == "vllm":
        from adapters.samplers.vllm.sampler import VLLMSampler

        return VLLMSampler(location, max_resident=p.max_resident, dtype=p.dtype, max_model_len=p.max_model_len,
                           options=p.vllm, on_engine_dead=_exit_soon, disable_any_whitespace=p.disable_any_whitespace)
    from adapters.samplers.hf.sampler import TransformersSampler

    return TransformersSampler(location, max_batch_sequences=p.max_batch_sequences, max_resident=p.max_resident,
                               threads=p.threads, dtype=p.dtype, max_model_len=p.max_model_len,
                               disable_any_whitespace=p.disable_any_whitespace)


def _exit_soon(delay: float = 1.0) -> None:
    """End this actor's process shortly (after the failing calls have answered) so that Ray, which restarts a crashed
    sampler actor, starts a fresh replica: a vLLM engine that died does not come back inside its process."""
    asyncio.get_running_loop().call_later(delay, os._exit, 1)


@dataclass
class _Replica:
    actor: ray.actor.ActorHandle
    in_flight: int = 0


@dataclass
class _BaseReplicas:
    replicas: list[_Replica]
    affinity: dict[str, int] = field(default_factory=dict)
    """adapter key → the replica that served it last."""


class SamplerPool:
    """Starts and addresses the sampler replicas; the sampling service is its only caller."""

    def __init__(self, models: list[BaseModelSpec], placement: SamplerPlacement) -> None:
        self.models = {m.name: m for m in models}
        self.placement = placement
        self.bases: dict[str, _BaseReplicas] = {}
        self.facts: dict[str, SamplerFacts] = {}
        self.torch_threads: dict[str, list[int]] = {}
        """Per base model, the torch threads of every replica's workers as they started (the ready line)."""
        self._configs: dict[str, dict] = {}
        """``config.json`` of each base model, where its samplers are vLLM (``adapter_refusal``)."""
        if refusal := backend_refusal(placement.backend, placement.vllm.tensor_parallel_size):
            raise ConfigurationRefused(refusal)  # before any actor (or trainer) is started

    async def start(self) -> None:
        """Create every replica and wait until each has loaded its base model."""
        remote_cls = ray.remote(SamplerActor)
        p = self.placement
        for name, spec in self.models.items():
            self.bases[name] = _BaseReplicas([
                # A crashed replica is restarted by Ray (calls in flight fail, never re-run); it reloads adapters on
                # demand, as after any eviction.
                _Replica(remote_cls.options(num_cpus=p.num_cpus, num_gpus=p.num_gpus, resources=p.resources or None,
                                            max_restarts=-1, max_task_retries=0,
                                            runtime_env={"env_vars": sampler_environment(p.backend)})
                         .remote(spec.location, p))
                for _ in range(p.count)])
        for name, base in self.bases.items():
            facts = await asyncio.gather(*(call_actor(r.actor, "facts", f"sampler for {name}")
                                           for r in base.replicas))
            self.facts[name] = facts[0]
            self.torch_threads[name] = [n for f in facts for n in f.torch_threads]
            parallel = f", tensor parallel {facts[0].tensor_parallel_size}" * (facts[0].tensor_parallel_size > 1)
            threads = " + ".join(map(str, facts[0].torch_threads))
            log.info("samplers ready: %s × %d (%s on %s%s, %s torch threads, up to %d adapters resident each)", name,
                     len(facts), facts[0].backend, facts[0].device, parallel, threads, facts[0].max_resident,
                     extra={"event": "samplers_ready", "base_model": name, "replicas": len(facts),
                            "backend": facts[0].backend, "tensor_parallel_size": facts[0].tensor_parallel_size,
                            "torch_threads": [list(f.torch_threads) for f in facts]})
            if facts[0].backend == "vllm":
                from transformers import AutoConfig

                self._configs[name] = AutoConfig.from_pretrained(self.models[name].location).to_dict()

    def adapter_refusal(self, base_model: str, groups: list[str]) -> str | None:
        """Why this base model's samplers could not serve a LoRA adapter on weight ``groups`` (``attn``, ``mlp``,
        ``unembed``), as a user error naming the option to change; None when they can (every transformers sampler
        can). Asked when a training run is created, so that nothing is trained that cannot be sampled."""
        config = self._configs.get(base_model)
        if config is None:
            return None
        facts = self.facts[base_model]
        on = set(groups) | ({"experts"} if "mlp" in groups and has_routed_experts(config) else set())
        # The replicas started, so the base model itself is served where they run (torchvision included).
        return vllm_lora_refusal(config, on, facts.device, facts.dtype, torchvision=True)

    def _route(self, base: _BaseReplicas, adapter: AdapterRef | None) -> int:
        least = min(range(len(base.replicas)), key=lambda i: base.replicas[i].in_flight)
        if adapter is None:
            return least
        holder = base.affinity.get(adapter.key)
        slack = self.placement.max_batch_sequences
        if holder is not None and base.replicas[holder].in_flight <= base.replicas[least].in_flight + slack:
            return holder
        base.affinity[adapter.key] = least
        return least

    async def sample(self, base_model: str, adapter: AdapterRef | None, job: SampleJob) -> SampleResult:
        base = self.bases[base_model]
        index = self._route(base, adapter)
        replica = base.replicas[index]
        what = f"sampler {index} for {base_model}"
        replica.in_flight += job.num_samples
        try:
            deadline = asyncio.get_running_loop().time() + RESTART_WAIT_SECONDS
            while True:
                try:
                    return await call_actor(replica.actor, "sample", what, adapter, job)
                except ActorRestarting:
                    await self._restarted(replica, what, deadline)
        finally:
            replica.in_flight -= job.num_samples

    async def stream(self, base_model: str, adapter: AdapterRef | None,
                     job: SampleJob) -> AsyncIterator[list[TokenEvent] | SampleResult]:
        """Like ``sample``, yielding lists of tokens as they are sampled and then the result."""
        base = self.bases[base_model]
        index = self._route(base, adapter)
        replica = base.replicas[index]
        what = f"sampler {index} for {base_model}"
        replica.in_flight += job.num_samples
        try:
            deadline = asyncio.get_running_loop().time() + RESTART_WAIT_SECONDS
            while True:
                started = False
                try:
                    async for item in stream_actor(replica.actor, "stream", what, adapter, job):
                        started = True
                        yield item
                    return
                except ActorRestarting:
                    if started:
                        raise
                    await self._restarted(replica, what, deadline)
        finally:
            replica.in_flight -= job.num_samples

    async def _restarted(self, replica: _Replica, what: str, deadline: float) -> None:
        """Wait while a replica is replaced (a vLLM engine takes from seconds to minutes to start): a request that
        arrives meanwhile runs once the replica is back, instead of failing. Past ``deadline`` it fails as a server
        error."""
        log.warning("%s is restarting; a request waits for it", what)
        while True:
            if asyncio.get_running_loop().time() > deadline:
                raise ActorUnavailable(f"{what} did not come back within {RESTART_WAIT_SECONDS:.0f} s")
            try:
                await call_actor(replica.actor, "ready", what)
                return
            except ActorRestarting:
                await asyncio.sleep(1.0)

    async def stats(self) -> dict[str, list[dict]]:
        """Per base model, each replica's load and resident adapter count."""
        out = {}
        for name, base in self.bases.items():
            stats = await asyncio.gather(*(call_actor(r.actor, "stats", f"sampler for {name}") for r in base.replicas))
            out[name] = [{"in_flight": r.in_flight, "resident_adapters": len(s["resident_adapters"]),
                          **{k: v for k, v in s.items() if k != "resident_adapters"}}
                         for r, s in zip(base.replicas, stats)]
        return out

    def resident_counts(self, timeout: float = 5.0) -> dict[str, int]:
        """Adapters resident per base model, over all its replicas. Blocking: for a metrics reader's thread, never
        the event loop. A base whose replicas do not all answer within ``timeout`` (together) is left out."""
        asked = {name: [r.actor.stats.remote() for r in base.replicas] for name, base in list(self.bases.items())}
        refs = [ref for refs in asked.values() for ref in refs]
        answered = set(ray.wait(refs, num_returns=len(refs), timeout=timeout)[0]) if refs else set()
        counts = {}
        for name, refs in asked.items():
            try:
                if all(ref in answered for ref in refs):
                    counts[name] = sum(len(stats["resident_adapters"]) for stats in ray.get(refs))
            except ray.exceptions.RayError:
                log.debug("samplers of %s did not report their resident adapters", name)
        return counts

    def stop(self) -> None:
        for base in self.bases.values():
            for replica in base.replicas:
                ray.kill(replica.actor)
        self.bases.clear()
