"""Ray placement of the samplers: ``count`` replicas per base model, each an actor holding the model once (a vLLM
replica over ``tensor_parallel_size`` workers, its child processes, on the GPUs its actor reserves).

Routing prefers the replica that last served an adapter (it most likely still holds it, so nothing reloads), unless
that replica is much busier than the least busy one; otherwise the least busy replica takes the request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import ray

from adapters import waits
from adapters.actors import ActorRestarting, ActorUnavailable, actor_proxy
from adapters.boundary import actor_class, method_of
from adapters.cpu_threads import sampler_environment
from adapters.models.resolve import BaseModelSpec
from adapters.samplers.interface import SAMPLER_REPLICA_CLASS, AdapterRef, SamplerFacts, SamplerReplica
from adapters.samplers.options import SamplerOptions
from adapters.samplers.vllm.parallel import backend_refusal
from adapters.samplers.vllm.support import has_routed_experts, vllm_lora_refusal
from shims.errors import ConfigurationRefused
from shims.sampling.job import SampleJob, SampleResult, TokenEvent

__all__ = ["SamplerOptions", "SamplerPool"]

log = logging.getLogger("compat_server.sampler")

RESTART_WAIT_SECONDS = 600.0
"""How long a request waits for a sampler replica that Ray is restarting."""


@dataclass
class _Replica:
    actor: ray.actor.ActorHandle
    calls: SamplerReplica
    """The actor, as its Protocol says."""
    what: str
    """How errors name it: ``sampler 0 for <base model>``."""
    in_flight: int = 0


@dataclass
class _BaseReplicas:
    replicas: list[_Replica]
    affinity: dict[str, int] = field(default_factory=dict)
    """adapter key → the replica that served it last."""


class SamplerPool:
    """Starts and addresses the sampler replicas; the sampling service is its only caller."""

    def __init__(self, models: list[BaseModelSpec], options: SamplerOptions) -> None:
        """``options``: its ``backend`` and ``gpus`` decided (``compat_server.services``)."""
        self.models = {m.name: m for m in models}
        self.options = options
        self.bases: dict[str, _BaseReplicas] = {}
        self.facts: dict[str, SamplerFacts] = {}
        self.torch_threads: dict[str, list[int]] = {}
        """Per base model, the torch threads of every replica's workers as they started (the ready line)."""
        self._configs: dict[str, dict] = {}
        """``config.json`` of each base model, where its samplers are vLLM (``adapter_refusal``)."""
        if refusal := backend_refusal(options.backend, options.tensor_parallel_size):
            raise ConfigurationRefused(refusal)  # before any actor (or trainer) is started

    async def start(self) -> None:
        """Create every replica and wait until each has loaded its base model."""
        remote_cls = ray.remote(actor_class(SamplerReplica, SAMPLER_REPLICA_CLASS, concurrent=True))
        p = self.options
        for name, spec in self.models.items():
            replicas = []
            for index in range(p.count):
                # A crashed replica is restarted by Ray (calls in flight fail, never re-run); it reloads adapters on
                # demand, as after any eviction.
                actor = remote_cls.options(num_cpus=p.cpus, num_gpus=p.gpus or 0.0, resources=p.resources or None,
                                           max_restarts=-1, max_task_retries=0,
                                           runtime_env={"env_vars": sampler_environment(p.backend)}
                                           ).remote(spec.location, p)
                what = f"sampler {index} for {name}"
                replicas.append(_Replica(actor, actor_proxy(actor, SamplerReplica, what), what))
            self.bases[name] = _BaseReplicas(replicas)
        for name, base in self.bases.items():
            facts = await asyncio.gather(*(r.calls.facts() for r in base.replicas))
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

    def takes_peft_tensors(self, base_model: str) -> bool:
        """Whether this base model's samplers take weights handed in memory as a PEFT directory's contents
        (``PeftTensors``: vLLM, which loads PEFT directories) rather than by the LoRA model's slot keys
        (``AdapterTensors``: the transformers sampler, which shares the trainer's LoRA model code)."""
        return self.facts[base_model].backend == "vllm"

    def _route(self, base: _BaseReplicas, adapter: AdapterRef | None) -> int:
        least = min(range(len(base.replicas)), key=lambda i: base.replicas[i].in_flight)
        if adapter is None:
            return least
        holder = base.affinity.get(adapter.key)
        slack = self.options.max_batch_sequences
        if holder is not None and base.replicas[holder].in_flight <= base.replicas[least].in_flight + slack:
            return holder
        base.affinity[adapter.key] = least
        return least

    async def sample(self, base_model: str, adapter: AdapterRef | None, job: SampleJob) -> SampleResult:
        base = self.bases[base_model]
        replica = base.replicas[self._route(base, adapter)]
        replica.in_flight += job.num_samples
        try:
            deadline = asyncio.get_running_loop().time() + RESTART_WAIT_SECONDS
            while True:
                try:
                    return await replica.calls.sample(adapter, job)
                except ActorRestarting:
                    await self._restarted(replica, deadline)
        finally:
            replica.in_flight -= job.num_samples

    async def stream(self, base_model: str, adapter: AdapterRef | None,
                     job: SampleJob) -> AsyncIterator[list[TokenEvent] | SampleResult]:
        """Like ``sample``, yielding lists of tokens as they are sampled and then the result."""
        base = self.bases[base_model]
        replica = base.replicas[self._route(base, adapter)]
        replica.in_flight += job.num_samples
        try:
            deadline = asyncio.get_running_loop().time() + RESTART_WAIT_SECONDS
            while True:
                started = False
                try:
                    async for item in replica.calls.stream(adapter, job):
                        started = True
                        yield item
                    return
                except ActorRestarting:
                    if started:
                        raise
                    await self._restarted(replica, deadline)
        finally:
            replica.in_flight -= job.num_samples

    async def _restarted(self, replica: _Replica, deadline: float) -> None:
        """Wait while a replica is replaced (a vLLM engine takes from seconds to minutes to start): a request that
        arrives meanwhile runs once the replica is back, instead of failing. Past ``deadline`` it fails as a server
        error."""
        log.warning("%s is restarting; a request waits for it", replica.what)
        told = waits.waiting(f"waiting for {replica.what}, which is restarting")
        while True:
            if asyncio.get_running_loop().time() > deadline:
                raise ActorUnavailable(f"{replica.what} did not come back within {RESTART_WAIT_SECONDS:.0f} s")
            try:
                await replica.calls.ready()
                waits.running(told)
                return
            except ActorRestarting:
                await asyncio.sleep(1.0)

    async def stats(self) -> dict[str, list[dict]]:
        """Per base model, each replica's load and resident adapter count."""
        out = {}
        for name, base in self.bases.items():
            stats = await asyncio.gather(*(r.calls.stats() for r in base.replicas))
            out[name] = [{"in_flight": r.in_flight, "resident_adapters": len(s["resident_adapters"]),
                          **{k: v for k, v in s.items() if k != "resident_adapters"}}
                         for r, s in zip(base.replicas, stats)]
        return out

    def resident_counts(self, timeout: float = 5.0) -> dict[str, int]:
        """Adapters resident per base model, over all its replicas. Blocking: for a metrics reader's thread, never
        the event loop. A base whose replicas do not all answer within ``timeout`` (together) is left out."""
        stats = method_of(SamplerReplica, SamplerReplica.stats)  # submitted here, waited for by Ray: not a coroutine
        asked = {name: [stats.submit(r.actor, (), {}) for r in base.replicas]
                 for name, base in list(self.bases.items())}
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
