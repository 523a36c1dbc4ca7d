"""The trainers of every base model: one per base model (``adapters.trainer.group``: one actor, or N shards), holding
that model's weights once for every adapter; forward_backward and optim_step batched across runs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from adapters import waits
from adapters.batching import Coalescer
from adapters.boundary import Method
from adapters.models.resolve import BaseModelSpec
from adapters.trainer.group import TrainerGroup
from adapters.trainer.interface import (
    AdamHyper,
    DimuonHyper,
    ModelFacts,
    OptimRequest,
    StepOutcome,
    StepRequest,
    StepResult,
    Trainer,
)
from adapters.trainer.options import TrainerOptions
from shims.errors import UserError

__all__ = ["TrainerOptions", "TrainerPool"]

log = logging.getLogger("compat_server.trainer")

Traced = Callable[[str, str | None], AbstractContextManager[Any]]
"""What the server wraps each trainer operation in, given the operation and the run it works on (if any): its
``trainer.<operation>`` tracing span."""


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

    def __init__(self, models: list[BaseModelSpec], options: TrainerOptions, traced: Traced | None = None) -> None:
        """``options``: its ``gpus`` decided (``compat_server.devices``)."""
        self.models = {m.name: m for m in models}
        self.options = options
        self.traced = traced or (lambda operation, model_id: nullcontext())
        self.groups: dict[str, TrainerGroup] = {}
        self.trainers: dict[str, Trainer] = {}
        """Each base model's trainer as the services call it: every call traced."""
        self.batches: dict[str, Coalescer[StepRequest | OptimRequest, StepOutcome]] = {}
        self.on_restart: Callable[[str], Awaitable[None]] | None = None
        """Called with the base model's name once its trainer came back from a crash, empty."""
        self.batch_counts: dict[str, dict[str, int]] = {}
        """Per base model: batches holding forward / forward_backward requests, those requests, the most one batch
        held, and optim steps (for the metrics)."""

    @property
    def facts(self) -> dict[str, ModelFacts]:
        """Each base model's trainer as a whole (a sharded one's rank 0)."""
        return {name: group.facts[0] for name, group in self.groups.items() if group.facts}

    async def start(self) -> None:
        """Create every trainer and wait until each has loaded its base model."""
        for name, spec in self.models.items():
            self.groups[name] = TrainerGroup(name, spec.location, self.options, self._restarted(name))
            self.trainers[name] = self.groups[name].calls(self._around)
            self.batches[name] = Coalescer(self._runner(name), self._admit)
            self.batch_counts[name] = {"batches": 0, "requests": 0, "max_requests_per_batch": 0, "optim_steps": 0,
                                       "optim_calls": 0}
        await asyncio.gather(*(group.start() for group in self.groups.values()))
        for name, group in self.groups.items():
            group.open()
            fact = group.facts[0]
            if group.size > 1:
                held = ", ".join(f"{f.base_bytes / 2**20:.1f} MiB on {f.device} with {f.threads} torch threads "
                                 f"(pid {f.pid}, node {f.node[:12]})" for f in group.facts)
                where = f"{group.size} shards over {fact.backend}, base weights {held}"
                if fact.experts:
                    where += "; expert parallel, each shard holding " + " / ".join(f.experts for f in group.facts)
            else:
                where = f"{fact.device}, {fact.threads} torch threads, Ray node {fact.node[:12]}"
            log.info("trainer ready: %s (%s, vocab %d, context %d, %s); LoRA adapts %s; activation checkpointing: %s",
                     name, fact.arch, fact.vocab_size, fact.max_context, where,
                     "; ".join(f"{group}: {', '.join(names) or 'nothing'}" for group, names in fact.lora_targets.items()),
                     fact.checkpointing)

    def _restarted(self, base_model: str) -> Callable[[], Awaitable[None]]:
        async def reload() -> None:
            if self.on_restart is not None:
                await self.on_restart(base_model)
        return reload

    def _around(self, method: Method, args: tuple, kwargs: dict) -> AbstractContextManager[Any]:
        return self.traced(method.name, method.signature.bind(*args, **kwargs).arguments.get("model_id"))

    def _runner(self, base_model: str):
        trainer = self.groups[base_model].calls()  # the batches' own calls: each request is traced as it is submitted

        async def run(requests: list[StepRequest | OptimRequest]) -> list[StepOutcome]:
            counts = self.batch_counts[base_model]
            steps = sum(isinstance(r, StepRequest) for r in requests)
            counts["batches"] += steps > 0
            counts["requests"] += steps
            counts["max_requests_per_batch"] = max(counts["max_requests_per_batch"], steps)
            counts["optim_steps"] += len(requests) - steps
            counts["optim_calls"] += len(requests) > steps
            return await trainer.run_batch(requests)
        return run

    def _admit(self, pending: list[StepRequest | OptimRequest]) -> int:
        count, tokens, datums = 0, 0, 0
        for request in pending:
            tokens += _tokens(request)
            datums += len(request.data) if isinstance(request, StepRequest) else 0
            if count and (tokens > self.options.max_batch_tokens or datums > self.options.max_batch_datums):
                break
            count += 1
        return count

    def trainer(self, base_model: str) -> Trainer:
        """The base model's trainer (every shard of it), as its Protocol says, each call traced; a ``UserError``
        raised there is re-raised here as itself. If the trainer died, the call fails as a server error and the
        trainer restarts (``adapters.trainer.group``). Its forward / forward_backward and optim_step go through
        ``forward_backward`` and ``optim_step`` instead, batched with other runs'."""
        return self.trainers[base_model]

    async def forward_backward(self, base_model: str, request: StepRequest) -> StepResult:
        """Run one forward / forward_backward, batched with whatever other runs' requests are waiting."""
        with self.traced("forward_backward", request.model_id):
            tokens = _tokens(request)
            if tokens > self.options.max_batch_tokens:
                raise UserError(f"this request holds {tokens} input tokens, more than one batch may "
                                f"(--max-batch-tokens {self.options.max_batch_tokens}); send fewer or shorter datums "
                                "per call")
            return await self._submit(base_model, request)  # type: ignore[return-value]

    async def optim_step(self, base_model: str, model_id: str, hyper: AdamHyper | DimuonHyper) -> dict[str, float]:
        """Apply one run's accumulated gradient, together with whatever other runs' requests are waiting."""
        with self.traced("optim_step", model_id):
            return await self._submit(base_model, OptimRequest(model_id, hyper))  # type: ignore[return-value]

    async def _submit(self, base_model: str, request: StepRequest | OptimRequest) -> StepOutcome:
        """Into the base model's next batch; while a batch of other runs' requests holds the trainer, the request
        says it waits for it (``adapters.waits``: its future's ``queue_state``)."""
        batches = self.batches[base_model]
        if not batches.busy:
            return await batches.submit(request)
        told = waits.waiting(f"waiting for the trainer of {base_model}: it is running other requests")
        return await batches.submit(request, started=lambda: waits.running(told))

    async def watch(self, every: float) -> None:
        """Check every ``every`` seconds that each trainer's processes are all still there (one that died while idle
        restarts its trainer at once, rather than failing the next request)."""
        while True:
            await asyncio.sleep(every)
            for group in self.groups.values():
                group.check()

    def stop(self) -> None:
        for group in self.groups.values():
            group.stop()
        self.groups.clear()
        self.trainers.clear()
