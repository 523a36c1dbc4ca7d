"""Ray placement of the trainers: one actor per base model, holding that model's weights once for every adapter."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Concatenate, ParamSpec, TypeVar

import ray

from adapters.actors import ActorUnavailable, call_actor
from adapters.batching import Coalescer
from adapters.models.resolve import BaseModelSpec
from adapters.trainer.actor import ModelFacts, MultiLoRATrainer, StepRequest, StepResult
from adapters.trainer.interface import AdamHyper, DimuonHyper, OptimRequest
from shims.errors import UserError

log = logging.getLogger("compat_server.trainer")

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class TrainerPlacement:
    """Ray resources each trainer actor asks for; on a GPU machine a trainer takes one GPU."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    threads: int | None = None
    resources: dict[str, float] | None = None
    max_batch_tokens: int = 131072
    """Most input tokens one mixed forward_backward batch may hold (several requests join while it stays under)."""
    max_adapters: int = 64
    """Most training runs (LoRA adapters) one base model's trainer holds at once."""
    recompute_tokens: int = 4096
    """Training batches of at least this many tokens checkpoint each decoder layer (``adapters.trainer.recompute``)."""


def _tokens(request: StepRequest | OptimRequest) -> int:
    return sum(d.tokens.size for d in request.data) if isinstance(request, StepRequest) else 0


class TrainerPool:
    """Starts and addresses the trainer actors. The scheduler is its only caller.

    forward / forward_backward and optim_step requests of different training runs on one base model that wait while
    that model's trainer is busy go to it together, in one call (``MultiLoRATrainer.run_batch``): the forward
    passes as one mixed-adapter batch, the optimizer steps as one AdamW over all their parameters. Each run's own
    requests still arrive one at a time in seq_id order (the scheduler sees to that), so its optim_step and
    load/save stay barriers for that run alone.
    """

    def __init__(self, models: list[BaseModelSpec], placement: TrainerPlacement) -> None:
        self.models = {m.name: m for m in models}
        self.placement = placement
        self.actors: dict[str, ray.actor.ActorHandle] = {}
        self.facts: dict[str, ModelFacts] = {}
        self.batches: dict[str, Coalescer[StepRequest | OptimRequest, StepResult | dict[str, float]]] = {}
        self.on_restart: Callable[[str], Awaitable[None]] | None = None
        """Called with the base model's name once its trainer came back from a crash, empty."""
        self._checks: dict[str, asyncio.Task] = {}
        self.batch_counts: dict[str, dict[str, int]] = {}
        """Per base model: batches holding forward / forward_backward requests, those requests, the most one batch
        held, and optim steps (for the metrics)."""

    async def start(self) -> None:
        """Create every actor and wait until each has loaded its base model."""
        remote_cls = ray.remote(MultiLoRATrainer)
        for name, spec in self.models.items():
            # A trainer that dies is restarted by Ray (its in-flight calls fail, never re-run); ``on_restart`` then
            # puts the adapters back.
            self.actors[name] = remote_cls.options(
                num_cpus=self.placement.num_cpus, num_gpus=self.placement.num_gpus,
                resources=self.placement.resources or None, name=None, max_restarts=-1, max_task_retries=0,
            ).remote(spec.location, self.placement.threads, self.placement.max_adapters,
                     self.placement.recompute_tokens)
            self.batches[name] = Coalescer(self._runner(name), self._admit)
            self.batch_counts[name] = {"batches": 0, "requests": 0, "max_requests_per_batch": 0, "optim_steps": 0,
                                       "optim_calls": 0}
        facts = await asyncio.gather(*(self.actors[n].model_facts.remote() for n in self.models))
        self.facts = dict(zip(self.models, facts))
        for name, fact in self.facts.items():
            log.info("trainer ready: %s (%s, vocab %d, context %d, %s, Ray node %s); LoRA adapts %s", name, fact.arch,
                     fact.vocab_size, fact.max_context, fact.device, fact.node[:12],
                     "; ".join(f"{group}: {', '.join(names) or 'nothing'}" for group, names in fact.lora_targets.items()))

    def _runner(self, base_model: str):
        async def run(requests: list[StepRequest | OptimRequest]) -> list:
            counts = self.batch_counts[base_model]
            steps = sum(isinstance(r, StepRequest) for r in requests)
            counts["batches"] += steps > 0
            counts["requests"] += steps
            counts["max_requests_per_batch"] = max(counts["max_requests_per_batch"], steps)
            counts["optim_steps"] += len(requests) - steps
            counts["optim_calls"] += len(requests) > steps
            return await self.call(base_model, MultiLoRATrainer.run_batch, requests)
        return run

    def _admit(self, pending: list[StepRequest | OptimRequest]) -> int:
        count, tokens = 0, 0
        for request in pending:
            tokens += _tokens(request)
            if count and tokens > self.placement.max_batch_tokens:
                break
            count += 1
        return count

    async def forward_backward(self, base_model: str, request: StepRequest) -> StepResult:
        """Run one forward / forward_backward, batched with whatever other runs' requests are waiting."""
        tokens = _tokens(request)
        if tokens > self.placement.max_batch_tokens:
            raise UserError(f"this request holds {tokens} input tokens, more than one batch may (--max-batch-tokens "
                            f"{self.placement.max_batch_tokens}); send fewer or shorter datums per call")
        return await self.batches[base_model].submit(request)  # type: ignore[return-value]

    async def optim_step(self, base_model: str, model_id: str, hyper: AdamHyper | DimuonHyper) -> dict[str, float]:
        """Apply one run's accumulated gradient, together with whatever other runs' requests are waiting."""
        return await self.batches[base_model].submit(OptimRequest(model_id, hyper))  # type: ignore[return-value]

    async def call(self, base_model: str, method: Callable[Concatenate[MultiLoRATrainer, P], R], *args: P.args,
                   **kwargs: P.kwargs) -> R:
        """Run ``method`` (a ``MultiLoRATrainer`` method: ``MultiLoRATrainer.save_state``, not a name, so arguments
        are type-checked and a renamed method fails where it is named) on the base model's trainer; a ``UserError``
        raised there is re-raised here as itself. If the trainer died, the call fails as a server error and a
        restart check starts at once. Callers other than this pool use ``compat_server.jobs.trainer_client``."""
        try:
            return await call_actor(self.actors[base_model], method.__name__, f"trainer for {base_model}", *args,
                                    **kwargs)
        except ActorUnavailable:
            self._check_soon(base_model)
            raise

    def _check_soon(self, base_model: str) -> None:
        task = self._checks.get(base_model)
        if task is None or task.done():
            self._checks[base_model] = asyncio.get_running_loop().create_task(self._check(base_model))

    async def _check(self, base_model: str) -> None:
        """Ask the trainer who it is (waiting while Ray restarts it); a new process is reported to ``on_restart``."""
        while True:
            try:
                facts = await call_actor(self.actors[base_model], MultiLoRATrainer.model_facts.__name__,
                                         f"trainer for {base_model}")
                break
            except ActorUnavailable:
                await asyncio.sleep(1.0)
        if facts.boot == self.facts[base_model].boot:
            return
        self.facts[base_model] = facts
        log.warning("trainer for %s restarted (pid %d); reloading its training runs", base_model, facts.pid)
        if self.on_restart is not None:
            await self.on_restart(base_model)

    async def watch(self, every: float) -> None:
        """Check every ``every`` seconds that each trainer is still the process it was (Ray restarts a crashed one
        silently; calls queued meanwhile would otherwise meet an empty trainer)."""
        while True:
            await asyncio.sleep(every)
            for name in self.actors:
                self._check_soon(name)

    def stop(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor)
        self.actors.clear()
