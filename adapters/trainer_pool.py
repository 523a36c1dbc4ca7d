"""Ray placement of the trainers: one actor per base model, holding that model's weights once for every adapter."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import ray

from adapters.actors import call_actor
from adapters.base_models import BaseModelSpec
from adapters.trainer import ModelFacts, MultiLoRATrainer

log = logging.getLogger("compat_server.trainer")


@dataclass(frozen=True)
class TrainerPlacement:
    """Ray resources each trainer actor asks for; on a GPU machine a trainer takes one GPU."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    threads: int | None = None
    resources: dict[str, float] | None = None


class TrainerPool:
    """Starts and addresses the trainer actors. The scheduler is its only caller."""

    def __init__(self, models: list[BaseModelSpec], placement: TrainerPlacement) -> None:
        self.models = {m.name: m for m in models}
        self.placement = placement
        self.actors: dict[str, ray.actor.ActorHandle] = {}
        self.facts: dict[str, ModelFacts] = {}

    async def start(self) -> None:
        """Create every actor and wait until each has loaded its base model."""
        remote_cls = ray.remote(MultiLoRATrainer)
        for name, spec in self.models.items():
            self.actors[name] = remote_cls.options(
                num_cpus=self.placement.num_cpus, num_gpus=self.placement.num_gpus,
                resources=self.placement.resources or None, name=None,
            ).remote(spec.location, self.placement.threads)
        facts = await asyncio.gather(*(self.actors[n].model_facts.remote() for n in self.models))
        self.facts = dict(zip(self.models, facts))
        for name, fact in self.facts.items():
            log.info("trainer ready: %s (%s, vocab %d, context %d, %s)", name, fact.arch, fact.vocab_size,
                     fact.max_context, fact.device)

    async def call(self, base_model: str, method: str, *args, **kwargs):
        """Run ``method`` on the base model's trainer; a ``UserError`` raised there is re-raised here as itself."""
        return await call_actor(self.actors[base_model], method, f"trainer for {base_model}", *args, **kwargs)

    def stop(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor)
        self.actors.clear()
