"""The server's calls to one base model's trainer: one typed method per trainer operation.

Each call is traced as a ``trainer.<operation>`` span naming the run it works on, and goes through the pool
(``adapters.trainer.pool``): forward / forward_backward and optim_step batched with other runs' waiting requests, the
others as one actor call each, with the pool's restart check when the trainer died. The trainer's methods are named
here as ``MultiLoRATrainer`` attributes, not strings, so a renamed one fails where it is named (and
``tests/test_trainer_client.py`` checks the two sets of methods agree).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

from adapters.trainer.actor import MultiLoRATrainer
from adapters.trainer.interface import AdamHyper, DimuonHyper, LoraSpec, StepRequest, StepResult
from adapters.trainer.pool import TrainerPool
from compat_server.telemetry import ids, tracer

P = ParamSpec("P")
R = TypeVar("R")


class TrainerClient:
    """The trainer of ``base_model``, as the services call it (``Scheduler.trainer_for``)."""

    def __init__(self, pool: TrainerPool, base_model: str) -> None:
        self.pool = pool
        self.base_model = base_model

    async def forward_backward(self, request: StepRequest) -> StepResult:
        """A forward / forward_backward, batched with other runs' waiting requests on the same base model."""
        with tracer.start_as_current_span("trainer.forward_backward", attributes=ids(request.model_id)):
            return await self.pool.forward_backward(self.base_model, request)

    async def optim_step(self, model_id: str, hyper: AdamHyper | DimuonHyper) -> dict[str, float]:
        """An optim_step, in one trainer call with other runs' waiting requests on the same base model."""
        with tracer.start_as_current_span("trainer.optim_step", attributes=ids(model_id)):
            return await self.pool.optim_step(self.base_model, model_id, hyper)

    async def create(self, model_id: str, spec: LoraSpec) -> None:
        """Add a run with a fresh adapter; a user error if the trainer holds ``--max-adapters`` runs already."""
        await self._call(model_id, MultiLoRATrainer.create, model_id, spec)

    async def unload(self, model_id: str) -> None:
        """Drop a run's adapter and optimizer state from the trainer."""
        await self._call(model_id, MultiLoRATrainer.unload, model_id)

    async def save_state(self, model_id: str, directory: str) -> None:
        """Write a run's adapter, optimizer state and step into ``directory`` (a training checkpoint)."""
        await self._call(model_id, MultiLoRATrainer.save_state, model_id, directory)

    async def load_state(self, model_id: str, directory: str, with_optimizer: bool) -> LoraSpec:
        """Replace (or create) a run's adapter with the checkpoint in ``directory``; returns the layout loaded."""
        return await self._call(model_id, MultiLoRATrainer.load_state, model_id, directory, with_optimizer)

    async def save_for_sampler(self, model_id: str, directory: str) -> None:
        """Write a run's adapter as a PEFT directory samplers load."""
        await self._call(model_id, MultiLoRATrainer.save_for_sampler, model_id, directory)

    async def save_for_export(self, model_id: str, directory: str) -> None:
        """Write a run's adapter for download, named as hosted Tinker names it."""
        await self._call(model_id, MultiLoRATrainer.save_for_export, model_id, directory)

    async def score(self, directory: str | None, tokens: list[int]) -> list[float]:
        """Logprobs of ``tokens[1:]`` under the base model plus the adapter saved in ``directory`` (None: the base
        model alone); no run is touched."""
        return await self._call(None, MultiLoRATrainer.score, directory, tokens)

    async def _call(self, model_id: str | None, method: Callable[Concatenate[MultiLoRATrainer, P], R],
                    *args: P.args, **kwargs: P.kwargs) -> R:
        """The one actor call behind the operations above, in its span."""
        with tracer.start_as_current_span(f"trainer.{method.__name__}", attributes=ids(model_id)):
            return await self.pool.call(self.base_model, method, *args, **kwargs)
