"""The trainer's adapters: each one's LoRA weights, optimizer and step, and the table of training runs holding them.

Its own module so that the trainer's parts (``adapters.trainer.forward``, ``.files``, ``.optim``) all import it and
none imports another. An adapter is either a training run, in the table under its ``model_id`` and counted against
``--max-adapters``, or temporary: built by the trainer for its own use (a checkpoint being staged before it replaces a
run, the adapter ``score`` measures logprobs with), never in the table and never counted, so no run name is reserved
for it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from adapters.lora.layers import LoRALinear
from adapters.trainer.dimuon import Dimuon
from adapters.trainer.interface import LORA_ALPHA, AdamHyper, LoraSpec
from shims.errors import UserError


@dataclass
class Adapter:
    name: str
    """Its name in every LoRA layer (``adapter_<n>``), unique for the trainer's lifetime."""
    spec: LoraSpec
    params: list[torch.nn.Parameter]
    """A and B of every adapted layer, in the model's layer order (the order optimizer state is saved in)."""
    optimizer: torch.optim.Optimizer
    step: int = 0


class AdapterTable(Mapping[str, Adapter]):
    """The training runs on one base model, by ``model_id``; also builds and drops the temporary adapters."""

    def __init__(self, layers: dict[str, LoRALinear], device: torch.device, max_adapters: int) -> None:
        self.layers = layers
        """Every layer a LoRA may target, by module path; each adapter is on the ones its spec names."""
        self.device = device
        self.max_adapters = max_adapters
        self._runs: dict[str, Adapter] = {}
        self._counter = 0

    def __getitem__(self, model_id: str) -> Adapter:
        return self._runs[model_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._runs)

    def __len__(self) -> int:
        return len(self._runs)

    def get_run(self, model_id: str) -> Adapter:
        """The run ``model_id``, or the user error saying it is not loaded."""
        adapter = self._runs.get(model_id)
        if adapter is None:
            raise UserError(f"model {model_id} is not loaded on the trainer")
        return adapter

    def create(self, model_id: str, spec: LoraSpec) -> None:
        """Add a training run with a freshly initialised adapter (LoRA B = 0: it starts equal to the base model)."""
        spec.validate()
        if model_id in self._runs:
            raise UserError(f"model {model_id} already exists")
        runs = len(self._runs)
        if runs >= self.max_adapters:
            raise UserError(f"this base model's trainer already holds {runs} training runs (--max-adapters "
                            f"{self.max_adapters}); unload one (or save its state and load it later) first")
        self._runs[model_id] = self.temporary(spec)

    def unload(self, model_id: str) -> None:
        """Drop a run's adapter and its optimizer state; the base model stays loaded for the others."""
        self.discard(self.get_run(model_id))
        del self._runs[model_id]

    def install(self, model_id: str, adapter: Adapter) -> None:
        """Make a temporary adapter (a staged checkpoint) run ``model_id``, replacing the run's current adapter if it
        has one. Like the load it completes, this does not check ``--max-adapters``: a crashed trainer's runs are put
        back this way."""
        if model_id in self._runs:
            self.unload(model_id)
        self._runs[model_id] = adapter

    def temporary(self, spec: LoraSpec) -> Adapter:
        """A freshly initialised adapter in the layers but in no run: the caller installs or discards it."""
        spec.validate()
        self._counter += 1
        name = f"adapter_{self._counter}"
        targets = set(spec.target_modules())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            for path, layer in self.layers.items():
                if path.rsplit(".", 1)[-1] in targets:
                    layer.add(name, spec.rank, LORA_ALPHA / spec.rank)
        params = [p for layer in self.layers.values() if name in layer.scaling
                  for p in (layer.lora_a[name], layer.lora_b[name])]
        if spec.optimizer == "dimuon":
            optimizer: torch.optim.Optimizer = Dimuon(params, spec.rank)
        elif self.device.type == "cuda":  # one kernel for all of a run's tensors
            optimizer = torch.optim.AdamW(params, lr=AdamHyper.learning_rate, fused=True)
        else:
            optimizer = torch.optim.AdamW(params, lr=AdamHyper.learning_rate, foreach=True)
        return Adapter(name=name, spec=spec, params=params, optimizer=optimizer)

    def discard(self, adapter: Adapter) -> None:
        """Remove an adapter's matrices from every layer (a temporary one, or an unloaded run's)."""
        for layer in self.layers.values():
            layer.remove(adapter.name)
